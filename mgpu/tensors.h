/* mgpu/tensors.h: shapes and tensors: making one on a device, a view of
   part of one, freeing it, and the checks every operation makes of its
   tensors (the same device, the same shape, alive, not overlapping).
   A tensor's header outlives it a while, so that a use after mgpu_free is
   an error line, not someone else's memory. Every chapter reads it.
   defines: mgpu_shape1, mgpu_shape2, mgpu_shape3, mgpu_shape4,
   mgpu_shape_numel, mgpu_shape_equal, mgpu_shape_str, mgpu_empty,
   mgpu_free, mgpu_view, mgpu_ensure, mgpu_narrow */
static mgpu_shape mgpu__shape(int ndim, int a, int b, int c, int d) {
    mgpu_shape s;
    s.ndim = ndim;
    s.d[0] = a; s.d[1] = b; s.d[2] = c; s.d[3] = d;
    for (int i = 0; i < ndim; i++)
        MGPU_REQUIRE(s.d[i] >= 0, "a shape cannot have a negative size (%d in dimension %d)",
                     s.d[i], i);
    for (int i = ndim; i < MGPU_MAX_DIMS; i++) s.d[i] = 1;
    return s;
}
MGPU_DEF mgpu_shape mgpu_shape1(int a) { return mgpu__shape(1, a, 1, 1, 1); }
MGPU_DEF mgpu_shape mgpu_shape2(int a, int b) { return mgpu__shape(2, a, b, 1, 1); }
MGPU_DEF mgpu_shape mgpu_shape3(int a, int b, int c) { return mgpu__shape(3, a, b, c, 1); }
MGPU_DEF mgpu_shape mgpu_shape4(int a, int b, int c, int d) { return mgpu__shape(4, a, b, c, d); }
MGPU_DEF size_t mgpu_shape_numel(mgpu_shape s) {
    size_t n = 1;
    for (int i = 0; i < s.ndim && i < MGPU_MAX_DIMS; i++) n *= (size_t)s.d[i];
    return n;
}
MGPU_DEF int mgpu_shape_equal(mgpu_shape a, mgpu_shape b) {
    if (a.ndim != b.ndim) return 0;
    for (int i = 0; i < a.ndim; i++)
        if (a.d[i] != b.d[i]) return 0;
    return 1;
}
MGPU_DEF const char *mgpu_shape_str(mgpu_shape s, char *buf, size_t size) {
    size_t used = (size_t)snprintf(buf, size, "[");
    for (int i = 0; i < s.ndim && used < size; i++)
        used += (size_t)snprintf(buf + used, size - used, "%s%d", i ? ", " : "", s.d[i]);
    if (used < size) snprintf(buf + used, size - used, "]");
    return buf;
}

/* The values of a shape that op is given, which must be one a tensor can
   have: 1 to MGPU_MAX_DIMS sizes of 0 or more (mgpu_shape is a plain
   struct a program may fill itself), and at most 2^60 values, so that
   their bytes, rounded up by the allocator and with a layer's guard
   floats, still fit a size_t (no machine holds a tenth of that). */
static size_t mgpu__tensor_numel(mgpu_shape shape, const char *op) {
    MGPU_REQUIRE(shape.ndim >= 1 && shape.ndim <= MGPU_MAX_DIMS,
                 "%s: a tensor has 1 to %d dimensions, not %d", op, MGPU_MAX_DIMS, shape.ndim);
    size_t numel = 1;
    for (int i = 0; i < shape.ndim; i++) {
        MGPU_REQUIRE(shape.d[i] >= 0, "%s: a shape cannot have a negative size (%d in dimension %d)", op,
                     shape.d[i], i);
        MGPU_REQUIRE(shape.d[i] == 0 || numel <= ((size_t)1 << 60) / (size_t)shape.d[i],
                     "%s: a shape of more values than memory can hold (dimension %d: %d)", op, i,
                     shape.d[i]);
        numel *= (size_t)shape.d[i];
    }
    return numel;
}

/* Tensor headers. A freed tensor's header is not given back to malloc:
   it waits in a queue, marked dead, until MGPU__FREED_HEADERS others have
   been freed after it, and is then reused. So a second mgpu_free of a
   tensor, or the use of a tensor (or of a view of it) after mgpu_free,
   reads a header that is still there and says so in one line, instead
   of freeing another tensor's memory or reading its values; a view
   checks that its tensor has not been freed since the view was taken
   (the count of its frees). What it misses: a tensor used after more
   than MGPU__FREED_HEADERS later frees, whose header may be a new
   tensor's by then. The cost: two words of memory per header, and a
   compare per tensor per operation. (The type has a name so that
   mgpu/testing.h can declare the queue for the test that fills it.) */
#define MGPU__FREED_HEADERS 4096
static struct mgpu__header_queue {
    pthread_mutex_t mutex;
    mgpu_tensor **queue; /* the latest freed headers, oldest first: a ring of MGPU__FREED_HEADERS */
    int head, count;
    mgpu_tensor **ready; /* older ones, to be reused (a stack of ready_count, room for ready_room) */
    size_t ready_count, ready_room;
} mgpu__headers = {PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0, NULL, 0, 0};
static mgpu_tensor *mgpu__header_new(void) {
    mgpu_tensor *t = NULL;
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&mgpu__headers.mutex));
    if (mgpu__headers.ready_count) t = mgpu__headers.ready[--mgpu__headers.ready_count];
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__headers.mutex));
    unsigned frees = t ? t->frees : 0;
    if (!t) t = (mgpu_tensor *)mgpu__xmalloc(sizeof *t);
    memset(t, 0, sizeof *t);
    t->frees = frees;
    t->alive = 1;
    return t;
}
static void mgpu__header_free(mgpu_tensor *t) {
    t->alive = 0;
    t->frees++;
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&mgpu__headers.mutex));
    if (!mgpu__headers.queue)
        mgpu__headers.queue = (mgpu_tensor **)mgpu__xcalloc(MGPU__FREED_HEADERS, sizeof(mgpu_tensor *));
    if (mgpu__headers.count == MGPU__FREED_HEADERS) { /* the oldest, MGPU__FREED_HEADERS frees ago, may go */
        if (mgpu__headers.ready_count == mgpu__headers.ready_room) {
            mgpu__headers.ready_room = mgpu__headers.ready_room ? 2 * mgpu__headers.ready_room : 1024;
            mgpu__headers.ready = (mgpu_tensor **)mgpu__xrealloc(mgpu__headers.ready,
                                                                 mgpu__headers.ready_room * sizeof(mgpu_tensor *));
        }
        mgpu__headers.ready[mgpu__headers.ready_count++] = mgpu__headers.queue[mgpu__headers.head];
        mgpu__headers.head = (mgpu__headers.head + 1) % MGPU__FREED_HEADERS;
        mgpu__headers.count--;
    }
    mgpu__headers.queue[(mgpu__headers.head + mgpu__headers.count) % MGPU__FREED_HEADERS] = t;
    mgpu__headers.count++;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__headers.mutex));
}
/* A tensor an operation `op` is given: alive, and if a view, its tensor
   not freed since. */
static void mgpu__require_alive(const mgpu_tensor *t, const char *op) {
    char sh[64];
    MGPU_REQUIRE(t->alive, "%s: a tensor of shape %s used after mgpu_free freed it", op,
                 mgpu_shape_str(t->shape, sh, sizeof sh));
    MGPU_REQUIRE(!t->base || (t->base->alive && t->base->frees == t->base_frees),
                 "%s: a view (shape %s) of a tensor that mgpu_free has freed since the view was taken", op,
                 mgpu_shape_str(t->shape, sh, sizeof sh));
}

/* A tensor of this shape on dev, its memory extra_floats longer than its
   values (a layer of yours' guard floats: mgpu__ensure_guarded). */
static mgpu_tensor *mgpu__tensor_alloc(mgpu_device *dev, mgpu_shape shape, int pinned, size_t extra_floats) {
    MGPU_REQUIRE(dev != NULL, "tensor on a NULL device");
    size_t numel = mgpu__tensor_numel(shape, "a new tensor");
    mgpu_tensor *t = mgpu__header_new();
    t->shape = shape;
    t->numel = numel;
    t->device = dev;
    t->pinned = pinned;
    t->block = mgpu__block_alloc(dev, (t->numel + extra_floats) * sizeof(float), pinned);
    t->data = (float *)t->block->ptr;
    return t;
}

MGPU_DEF mgpu_tensor *mgpu_empty(mgpu_device *dev, mgpu_shape shape) {
    return mgpu__tensor_alloc(dev, shape, 0, 0);
}

MGPU_DEF void mgpu_free(mgpu_tensor *t) {
    if (!t) return;
    char sh[64];
    MGPU_REQUIRE(t->alive, "mgpu_free: a tensor of shape %s freed a second time",
                 mgpu_shape_str(t->shape, sh, sizeof sh));
    MGPU_REQUIRE(!t->owner, "mgpu_free: a tensor of shape %s that belongs to %s; do not free it",
                 mgpu_shape_str(t->shape, sh, sizeof sh), t->owner);
    if (t->block) mgpu__block_release(t->device, t->block, t->pinned, t->last_read);
    else mgpu_event_free(t->last_read);
    mgpu_event_free(t->last_write); /* covered by last_read, which waited for it */
    mgpu__header_free(t);
}

MGPU_DEF mgpu_tensor *mgpu_view(const mgpu_tensor *t, mgpu_shape shape) {
    char a[64], b[64];
    mgpu__require_alive(t, "mgpu_view");
    MGPU_REQUIRE(mgpu__tensor_numel(shape, "mgpu_view") == t->numel, "cannot view a tensor of shape %s as %s",
                 mgpu_shape_str(t->shape, a, sizeof a), mgpu_shape_str(shape, b, sizeof b));
    mgpu_tensor *v = mgpu__header_new();
    v->data = t->data;
    v->shape = shape;
    v->numel = t->numel;
    v->device = t->device;
    v->pinned = t->pinned;
    v->base = t->base ? t->base : (mgpu_tensor *)t;
    v->base_frees = v->base->frees;
    return v;
}

MGPU_DEF mgpu_tensor *mgpu_ensure(mgpu_tensor **slot, mgpu_device *dev, mgpu_shape shape) {
    if (*slot && (*slot)->device == dev && mgpu_shape_equal((*slot)->shape, shape)) return *slot;
    mgpu_free(*slot);
    *slot = mgpu_empty(dev, shape);
    return *slot;
}

MGPU_DEF mgpu_tensor *mgpu_narrow(const mgpu_tensor *t, int start, int length) {
    char a[64];
    mgpu__require_alive(t, "mgpu_narrow");
    MGPU_REQUIRE(start >= 0 && length >= 0 && (long long)start + length <= t->shape.d[0],
                 "mgpu_narrow: cannot take rows %d..%lld of a tensor of shape %s", start, (long long)start + length,
                 mgpu_shape_str(t->shape, a, sizeof a));
    mgpu_shape s = t->shape;
    size_t row = t->numel / (size_t)(s.d[0] ? s.d[0] : 1);
    s.d[0] = length;
    mgpu_tensor *v = mgpu_view(t, t->shape);
    v->shape = s;
    v->numel = row * (size_t)length;
    v->data = t->data + row * (size_t)start;
    return v;
}

/* Remembers that a copy queue may still use t (one event per tensor: the
   latest copy, which the copy queue runs after the earlier ones). */
static void mgpu__tensor_track(mgpu_tensor *t, mgpu_event *copy_done) {
    if (t->base) t = t->base;
    mgpu__event_retain(copy_done);
    mgpu_event_free(t->last_read);
    t->last_read = copy_done;
}

/* Before an operation on its own device writes t: wait for copies still using it. */
static void mgpu__before_write(mgpu_tensor *t) {
    mgpu__require_alive(t, "an operation writing a tensor");
    if (t->base) t = t->base;
    if (!t->last_read) return;
    mgpu__event_wait_on(&t->device->queue[0], t->last_read);
    mgpu_event_free(t->last_read);
    t->last_read = NULL;
}

static void mgpu__require_device(const mgpu_tensor *t, const mgpu_device *dev, const char *op) {
    mgpu__require_alive(t, op);
    MGPU_REQUIRE(t->device == dev, "%s: a tensor on %s is used with one on %s; copy it first with mgpu_to",
                 op, t->device->name, dev->name);
}
static void mgpu__require_same_shape(const mgpu_tensor *a, const mgpu_tensor *b, const char *op) {
    char sa[64], sb[64];
    MGPU_REQUIRE(mgpu_shape_equal(a->shape, b->shape), "%s: shapes %s and %s differ", op,
                 mgpu_shape_str(a->shape, sa, sizeof sa), mgpu_shape_str(b->shape, sb, sizeof sb));
}

/* Refuses an output that shares memory with an input: overlapping views
   of one tensor, where the operation would read values it has already
   written (PyTorch refuses them too). The very same values (y += y) are
   fine for an operation that reads each value before writing it
   (allow_same); a matrix product is not one. */
static void mgpu__require_apart(const mgpu_tensor *out, const mgpu_tensor *in, const char *op, int allow_same) {
    if (out->device != in->device || !out->numel || !in->numel) return;
    int shared = out->data < in->data + in->numel && in->data < out->data + out->numel;
    int same = out->data == in->data && out->numel == in->numel;
    MGPU_REQUIRE(!shared || (allow_same && same), "%s: the output and an input share memory (%s)", op,
                 same ? "the same tensor" : "overlapping views of one tensor");
}
