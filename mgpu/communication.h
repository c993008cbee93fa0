/* mgpu/communication.h: moving tensors among one process's devices. The
   book's functions first (chapter 2: get_params, allreduce by summing on
   one device and copying back, split_batch), then each device's
   communication queue, the ring allreduce (reduce-scatter, then
   all-gather, chunk by chunk), NCCL's collectives, and the choice between
   them that chapter 3's wrapper makes.
   defines: mgpu_enable_peer_access, mgpu_get_params, mgpu_params_free,
   mgpu_allreduce, mgpu_scatter, mgpu_split_batch, mgpu_comm_wait,
   mgpu_ring_allreduce, mgpu_nccl_init, mgpu_nccl_free,
   mgpu_nccl_allreduce, mgpu_nccl_broadcast, mgpu_nccl_reduce_scatter,
   mgpu_nccl_all_gather, mgpu_allreduce_start, mgpu_allreduce_auto */
/* ======================================================================
   Communication: the book's functions, the ring allreduce, NCCL
   (see "Communication" above)
   ======================================================================
   Two kinds of code live here. The book's functions (get_params,
   allreduce, scatter) are built from tensor operations: mgpu_to, mgpu_copy
   and mgpu_add_ already order themselves with events, so these read like
   the book's Python. The ring and NCCL run on each device's communication
   queue (queue[1], the copy queue), so that a reduction can go on while
   the compute queue (queue[0]) works; they order themselves with explicit
   events, and the comments say why each wait is there. */
#if MGPU_CUDA && !defined(MGPU_CUDA_EMU)
#include <nccl.h>
#endif

/* Every collective takes one tensor per device, all of one shape. */
static void mgpu__require_collective(const char *op, mgpu_tensor *const *data, int n) {
    MGPU_REQUIRE(n >= 1 && n <= MGPU_MAX_DEVICES,
                 "%s: %d tensors; the number must be between 1 and %d", op, n, MGPU_MAX_DEVICES);
    for (int i = 0; i < n; i++) {
        MGPU_REQUIRE(data[i] != NULL, "%s: tensor %d is NULL", op, i);
        mgpu__require_same_shape(data[i], data[0], op);
    }
}

static void mgpu__devices_of(mgpu_tensor *const *data, int n, mgpu_device **devices) {
    for (int i = 0; i < n; i++) devices[i] = data[i]->device;
}

/* Peer access (see the manual), for each ordered pair of GPUs once. */
MGPU_DEF void mgpu_enable_peer_access(mgpu_device *const *devices, int n) {
#if MGPU_CUDA
    static unsigned char tried[MGPU_MAX_DEVICES][MGPU_MAX_DEVICES]; /* [from][to] */
    for (int a = 0; a < n; a++)
        for (int b = 0; b < n; b++) {
            int from = devices[a]->gpu, to = devices[b]->gpu, can = 0;
            if (from < 0 || to < 0 || from == to || from >= MGPU_MAX_DEVICES || to >= MGPU_MAX_DEVICES ||
                tried[from][to])
                continue;
            tried[from][to] = 1;
            MGPU_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, from, to));
            if (!can) continue; /* the driver stages the copies through host memory */
            MGPU_CUDA_CHECK(cudaSetDevice(from));
            cudaError_t err = cudaDeviceEnablePeerAccess(to, 0);
            if (err == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError(); /* done before: fine */
            else MGPU_CUDA_CHECK(err);
        }
#else
    (void)devices;
    (void)n;
#endif
}

/* ------------------------------------------------------ the book's functions */
MGPU_DEF void mgpu_get_params(mgpu_param *out, mgpu_tensor *const *params, int n, mgpu_device *dev) {
    MGPU_REQUIRE(dev != NULL, "mgpu_get_params: the device is NULL");
    for (int k = 0; k < n; k++) {
        MGPU_REQUIRE(params[k] != NULL, "mgpu_get_params: parameter %d is NULL", k);
        out[k].value = mgpu_to(params[k], dev, 1);
        out[k].grad = mgpu_zeros(dev, params[k]->shape); /* the book's requires_grad_() */
    }
}

MGPU_DEF void mgpu_params_free(mgpu_param *p, int n) {
    for (int k = 0; k < n; k++) {
        mgpu_free(p[k].value);
        mgpu_free(p[k].grad);
        p[k].value = p[k].grad = NULL;
    }
}

/* The book's allreduce. Each copy waits for the data it reads and the add
   waits for the copy (mgpu_copy's events), so the whole function only
   enqueues work. The staging tensor can be freed at once: its memory goes
   back to device 0's cache, and whatever uses it next is enqueued on
   device 0 after this add. */
MGPU_DEF void mgpu_allreduce(mgpu_tensor **data, int n) {
    mgpu__require_collective("mgpu_allreduce", data, n);
    mgpu_device *devices[MGPU_MAX_DEVICES] = {NULL};
    mgpu__devices_of(data, n, devices);
    mgpu_enable_peer_access(devices, n);
    for (int i = 1; i < n; i++) { /* sum everything into data[0] */
        mgpu_tensor *staged = mgpu_to(data[i], data[0]->device, 1);
        mgpu_add_(data[0], staged);
        mgpu_free(staged);
    }
    for (int i = 1; i < n; i++) mgpu_copy(data[i], data[0], 1); /* send the sum back */
}

/* A copy from a view leaves its mark ("a copy queue may still read this")
   on the view; hand the mark to the tensor the view looks into before the
   view goes, so that a later write to it waits for the copy. */
static void mgpu__free_view_of(mgpu_tensor *base, mgpu_tensor *view) {
    if (view->last_read) mgpu__tensor_track(base, view->last_read);
    mgpu_free(view);
}

/* mgpu_scatter; given kept_free, out[i] may be a tensor of the caller's
   from an earlier call: kept if it still has its part's shape, and the
   copy into it then waits for kept_free[i] (the end of the last work that
   read it) instead of the device's compute queue (else freed and made
   anew, and the copy waits for that queue, as mgpu_copy's). The devices
   left without rows keep their out[i] then (NULL without kept_free). */
static int mgpu__scatter(const mgpu_tensor *x, mgpu_device *const *devices, int n, mgpu_tensor **out,
                         mgpu_event *const *kept_free) {
    char s[64];
    MGPU_REQUIRE(n >= 1, "mgpu_scatter: %d devices; there must be at least one", n);
    int rows = x->shape.d[0];
    MGPU_REQUIRE(rows > 0, "mgpu_scatter: x (shape %s) has no rows to split",
                 mgpu_shape_str(x->shape, s, sizeof s));
    int chunk = (rows + n - 1) / n;                       /* ceil(rows / n), as PyTorch */
    int used = (rows + chunk - 1) / chunk;                /* devices that get rows */
    for (int i = used; i < n && !kept_free; i++) out[i] = NULL;
    for (int i = 0; i < used; i++) {
        int start = i * chunk;
        mgpu_tensor *part = mgpu_narrow(x, start, rows - start < chunk ? rows - start : chunk);
        int kept = kept_free && out[i] && out[i]->device == devices[i] && kept_free[i] &&
                   mgpu_shape_equal(out[i]->shape, part->shape);
        if (!kept) {
            if (kept_free) mgpu_free(out[i]);
            out[i] = mgpu_empty(devices[i], part->shape);
        }
        mgpu__copy(out[i], part, 1, kept ? kept_free[i] : NULL, NULL);
        mgpu__free_view_of((mgpu_tensor *)x, part);
    }
    return used;
}
MGPU_DEF int mgpu_scatter(const mgpu_tensor *x, mgpu_device *const *devices, int n, mgpu_tensor **out) {
    return mgpu__scatter(x, devices, n, out, NULL);
}

/* mgpu_split_batch, with kept_free as in mgpu__scatter. */
static int mgpu__split_batch(const mgpu_tensor *X, const mgpu_tensor *y, mgpu_device *const *devices, int n,
                             mgpu_tensor **X_shards, mgpu_tensor **y_shards, mgpu_event *const *kept_free) {
    char sx[64], sy[64];
    MGPU_REQUIRE(X->shape.d[0] == y->shape.d[0],
                 "mgpu_split_batch: X has %d rows (shape %s) but y has %d (shape %s)", X->shape.d[0],
                 mgpu_shape_str(X->shape, sx, sizeof sx), y->shape.d[0],
                 mgpu_shape_str(y->shape, sy, sizeof sy));
    mgpu__scatter(X, devices, n, X_shards, kept_free);
    return mgpu__scatter(y, devices, n, y_shards, kept_free);
}
MGPU_DEF int mgpu_split_batch(const mgpu_tensor *X, const mgpu_tensor *y, mgpu_device *const *devices,
                              int n, mgpu_tensor **X_shards, mgpu_tensor **y_shards) {
    return mgpu__split_batch(X, y, devices, n, X_shards, y_shards, NULL);
}

/* ------------------------------------------------- communication queues */
/* Queue `waiter` goes no further before `q` has done what it was given so far. */
static void mgpu__queue_wait_queue(mgpu__queue *waiter, mgpu__queue *q) {
    mgpu_event *e = mgpu_event_new();
    mgpu__event_record_on(e, q);
    mgpu__event_wait_on(waiter, e);
    mgpu_event_free(e);
}

/* Before a collective writes data[i] on its device's communication queue:
   that queue waits until the compute queue has produced data[i], and until
   copies that may still read data[i] are done (mgpu__before_write makes the
   compute queue wait for them first). */
static void mgpu__comm_begin(mgpu_tensor *const *data, int n) {
    for (int i = 0; i < n; i++) {
        mgpu__before_write(data[i]);
        mgpu__queue_wait_queue(&data[i]->device->queue[1], &data[i]->device->queue[0]);
    }
}

MGPU_DEF void mgpu_comm_wait(mgpu_device *const *devices, int n) {
    for (int i = 0; i < n; i++) mgpu__queue_wait_queue(&devices[i]->queue[0], &devices[i]->queue[1]);
}

/* A collective's tensors (a[i], and b[i] where b is given: on a[i]'s
   device) are in use on the communication queues until the work enqueued
   there so far is done: freed before mgpu_comm_wait, their memory goes
   back to the cache marked so (mgpu__tensor_track), and is not given out
   again before that. One event a device; the queue first waits for what
   was still reading them, so that the event stands for that too. */
static void mgpu__comm_track(mgpu_tensor *const *a, mgpu_tensor *const *b, int n) {
    for (int i = 0; i < n; i++) {
        mgpu__queue *q = &a[i]->device->queue[1];
        mgpu_tensor *both[2] = {a[i], b ? b[i] : NULL};
        for (int k = 0; k < 2; k++) {
            const mgpu_tensor *base = both[k] && both[k]->base ? both[k]->base : both[k];
            if (base && base->last_read) mgpu__event_wait_on(q, base->last_read);
        }
        mgpu_event *done = mgpu_event_new();
        mgpu__event_record_on(done, q);
        for (int k = 0; k < 2; k++)
            if (both[k]) mgpu__tensor_track(both[k], done);
        mgpu_event_free(done); /* (each tensor keeps its own reference) */
    }
}

static void mgpu__comm_end(mgpu_tensor *const *data, int n) {
    mgpu_device *devices[MGPU_MAX_DEVICES] = {NULL};
    mgpu__devices_of(data, n, devices);
    mgpu_comm_wait(devices, n);
}

/* ------------------------------------------------------ the ring allreduce
   Device i receives from its left neighbour i-1 and sends to its right
   neighbour i+1. The vector is cut into n chunks (chunk c starts at
   c*numel/n, so lengths differ by at most one and short vectors leave
   some chunks empty). Everything runs on the communication queues:

   Each step begins with every device marking how far its queue has got
   (the end of the previous step); then each device i, on its own queue,
   waits for its left neighbour's mark, copies the chunk it needs from the
   neighbour's vector and, in the reduce-scatter, adds it to its own. So
   "device i-1 sends chunk c at step s" is "device i copies chunk c of
   device i-1 as it was after step s-1". Why nothing races:
   - What device i receives at step s+1 is the chunk its neighbour added at
     step s: the mark of step s+1 comes after that add, so a half-added
     chunk is never sent.
   - Device i's receive buffer and vector are written only by its own
     queue, in order: the copy of step s+1 into the buffer comes after the
     add of step s that read it.
   - Device i must not overwrite a chunk that device i+1 is still reading.
     In the reduce-scatter, at step s device i writes chunk (i-1-s) while
     device i+1 reads chunk (i-s): different chunks. In the all-gather
     device i overwrites chunk (i-s) at step s, the chunk device i+1 read
     in reduce-scatter step s. By then device i has waited for device i-1
     after its previous step, which had waited for device i-2 a step
     earlier, and so on round the ring: n-1 hops back is device i+1, n-1
     steps earlier, i.e. after reduce-scatter step s. So it is done.
   - Marks are only ever recorded on their own device's queue, so a queue
     waiting on an old mark is never confused by a newer one.
   The marking is done for all devices before any device is given its
   step: marking device i-1 after device i-1 had been given its own copy
   would make device i wait for that copy too, and the n copies of a step
   would run one after another instead of at once. */
typedef struct mgpu__ring {
    int n;
    size_t numel;
    mgpu_device *dev[MGPU_MAX_DEVICES];
    float *data[MGPU_MAX_DEVICES];
    mgpu_tensor *recv[MGPU_MAX_DEVICES]; /* one chunk: what the left neighbour sent */
    mgpu_event *mark[MGPU_MAX_DEVICES];  /* recorded only on device i's communication queue */
} mgpu__ring;

static int mgpu__mod(int a, int n) { return ((a % n) + n) % n; }

/* Chunk c of the ring's vectors: its first element, and its length in *len. */
static size_t mgpu__ring_chunk(const mgpu__ring *r, int c, size_t *len) {
    size_t start = r->numel * (size_t)c / (size_t)r->n;
    *len = r->numel * (size_t)(c + 1) / (size_t)r->n - start;
    return start;
}

/* The start of a step: every device marks how far its queue has got. */
static void mgpu__ring_mark(mgpu__ring *r) {
    for (int i = 0; i < r->n; i++) mgpu__event_record_on(r->mark[i], &r->dev[i]->queue[1]);
}

/* Device i gets chunk c from its left neighbour and adds it to its own
   chunk c (reduce), or keeps it in place of its own (gather). */
static void mgpu__ring_receive(mgpu__ring *r, int i, int c, int reduce) {
    int left = mgpu__mod(i - 1, r->n);
    mgpu__queue *q = &r->dev[i]->queue[1];
    size_t len, start = mgpu__ring_chunk(r, c, &len);
    mgpu__event_wait_on(q, r->mark[left]);
    if (len == 0) return;
    float *mine = r->data[i] + start;
    mgpu__memcpy_args copy = {reduce ? r->recv[i]->data : mine, r->data[left] + start,
                              len * sizeof(float), r->dev[i]->gpu, r->dev[left]->gpu};
    mgpu__launch_on(q, "ring copy", mgpu__memcpy_cpu, MGPU__CUDA_FN(mgpu__memcpy_cuda), &copy,
                    sizeof copy);
    if (!reduce) return;
    mgpu__axpby_args add = {mine, r->recv[i]->data, len, 1.0f, 1.0f};
    mgpu__launch_on(q, "ring add", mgpu__axpby_cpu, MGPU__CUDA_FN(mgpu__axpby_cuda), &add, sizeof add);
}

/* After the reduce-scatter: device i divides the chunk it owns by n, so
   the all-gather spreads averages (1/n of the work of scaling everything). */
static void mgpu__ring_average(mgpu__ring *r) {
    for (int i = 0; i < r->n; i++) {
        size_t len, start = mgpu__ring_chunk(r, mgpu__mod(i + 1, r->n), &len);
        if (len == 0) continue;
        float *owned = r->data[i] + start;
        mgpu__axpby_args scale = {owned, owned, len, 0.0f, 1.0f / (float)r->n};
        mgpu__launch_on(&r->dev[i]->queue[1], "ring scale", mgpu__axpby_cpu,
                        MGPU__CUDA_FN(mgpu__axpby_cuda), &scale, sizeof scale);
    }
}

/* The ring itself, on the communication queues; the caller orders it
   with the compute queues (mgpu__comm_begin before, mgpu_comm_wait after).
   scratch: the receive buffers, or NULL to take them from the allocator
   for this call (see mgpu_allreduce_start for why a caller keeps its own). */
static void mgpu__ring_run(mgpu_tensor *const *data, int n, int average, mgpu_tensor *const *scratch) {
    mgpu__ring r;
    memset(&r, 0, sizeof r);
    r.n = n;
    r.numel = data[0]->numel;
    for (int i = 0; i < n; i++) {
        r.dev[i] = data[i]->device;
        r.data[i] = data[i]->data;
        r.recv[i] = scratch ? scratch[i] : mgpu_empty(r.dev[i], mgpu_shape1((int)((r.numel + n - 1) / n)));
        r.mark[i] = mgpu_event_new();
    }
    /* Reduce-scatter: at step s device i-1 sends chunk (i-1-s), which
       device i adds to its own. Afterwards device i owns the whole sum of
       chunk (i+1) mod n. */
    for (int s = 0; s < n - 1; s++) {
        mgpu__ring_mark(&r);
        for (int i = 0; i < n; i++) mgpu__ring_receive(&r, i, mgpu__mod(i - 1 - s, n), 1);
    }
    if (average) mgpu__ring_average(&r);
    /* All-gather: at step s device i-1 sends the finished chunk (i-s),
       which device i keeps. */
    for (int s = 0; s < n - 1; s++) {
        mgpu__ring_mark(&r);
        for (int i = 0; i < n; i++) mgpu__ring_receive(&r, i, mgpu__mod(i - s, n), 0);
    }
    /* In the last step device i+1 read data[i]: device i's queue waits for
       it, so that once a device's communication queue is done nothing
       touches its vector any more (mgpu_comm_wait relies on this). A
       receive buffer of our own goes back to the cache marked as in use
       until device i's queue is done with it. */
    mgpu__ring_mark(&r);
    for (int i = 0; i < n; i++) {
        mgpu__event_wait_on(&r.dev[i]->queue[1], r.mark[mgpu__mod(i + 1, n)]);
        if (scratch) continue;
        mgpu__tensor_track(r.recv[i], r.mark[i]);
        mgpu_free(r.recv[i]);
    }
    for (int i = 0; i < n; i++) mgpu_event_free(r.mark[i]);
    mgpu__comm_track(data, scratch, n);
}

/* A CPU queue cannot copy GPU memory, nor a GPU stream wait for a CPU
   queue without stopping the host: a ring is all GPUs or all CPU devices. */
static void mgpu__ring_start(const char *op, mgpu_tensor *const *data, int n, int average,
                             mgpu_tensor *const *scratch) {
    for (int i = 1; i < n; i++)
        MGPU_REQUIRE(mgpu_device_is_gpu(data[i]->device) == mgpu_device_is_gpu(data[0]->device),
                     "%s: %s and %s: the devices of a ring must be all GPUs or all CPU devices", op,
                     data[0]->device->name, data[i]->device->name);
    if (n == 1 || data[0]->numel == 0) return;
    mgpu_device *devices[MGPU_MAX_DEVICES] = {NULL};
    mgpu__devices_of(data, n, devices);
    mgpu_enable_peer_access(devices, n);
    mgpu__comm_begin(data, n);
    mgpu__ring_run(data, n, average, scratch);
}

MGPU_DEF void mgpu_ring_allreduce(mgpu_tensor **data, int n, int average) {
    mgpu__require_collective("mgpu_ring_allreduce", data, n);
    mgpu__ring_start("mgpu_ring_allreduce", data, n, average, NULL);
    mgpu__comm_end(data, n);
}

/* ------------------------------------------------------------------ NCCL */
#if MGPU_CUDA
#define MGPU_NCCL_CHECK(call)                                                         \
    do {                                                                              \
        ncclResult_t mgpu__nr = (call);                                               \
        if (mgpu__nr != ncclSuccess)                                                  \
            mgpu_fatal_at(__FILE__, __LINE__, "%s: %s (NCCL_DEBUG=WARN tells more)",  \
                          #call, ncclGetErrorString(mgpu__nr));                       \
    } while (0)

struct mgpu_nccl_comm {
    int n;
    int gpus[MGPU_MAX_DEVICES];            /* rank i is physical GPU gpus[i] */
    ncclComm_t comms[MGPU_MAX_DEVICES];
    struct mgpu_nccl_comm *next;           /* in mgpu_allreduce_auto's cache */
};

MGPU_DEF mgpu_nccl_comm *mgpu_nccl_init(mgpu_device *const *devices, int n) {
    MGPU_REQUIRE(n >= 1 && n <= MGPU_MAX_DEVICES,
                 "mgpu_nccl_init: %d devices; the number must be between 1 and %d", n, MGPU_MAX_DEVICES);
    for (int i = 0; i < n; i++) {
        if (devices[i]->gpu < 0) return NULL;
        for (int j = 0; j < i; j++)
            if (devices[j]->gpu == devices[i]->gpu) return NULL; /* virtual: one GPU twice */
    }
    mgpu_nccl_comm *c = (mgpu_nccl_comm *)mgpu__xcalloc(1, sizeof *c);
    c->n = n;
    for (int i = 0; i < n; i++) c->gpus[i] = devices[i]->gpu;
    MGPU_NCCL_CHECK(ncclCommInitAll(c->comms, n, c->gpus));
    return c;
}

MGPU_DEF void mgpu_nccl_free(mgpu_nccl_comm *c) {
    if (!c) return;
    for (int i = 0; i < c->n; i++) {
        /* NCCL work still queued must end before its communicator goes. */
        MGPU_CUDA_CHECK(cudaSetDevice(c->gpus[i]));
        MGPU_CUDA_CHECK(cudaDeviceSynchronize());
        MGPU_NCCL_CHECK(ncclCommDestroy(c->comms[i]));
    }
    free(c);
}

/* Rank i's tensor must be on GPU i of the communicator. */
static void mgpu__require_nccl(const char *op, const mgpu_nccl_comm *c, mgpu_tensor *const *t,
                               const char *what) {
    MGPU_REQUIRE(c != NULL, "%s: the communicator is NULL (mgpu_nccl_init gives NULL unless the "
                            "devices are distinct GPUs)", op);
    for (int i = 0; i < c->n; i++) {
        MGPU_REQUIRE(t[i] != NULL, "%s: %s[%d] is NULL", op, what, i);
        MGPU_REQUIRE(t[i]->device->gpu == c->gpus[i], "%s: %s[%d] is on %s, but rank %d is GPU %d", op,
                     what, i, t[i]->device->name, i, c->gpus[i]);
    }
}

/* The tracer's bar for an NCCL call on queue q: NCCL work reaches the
   stream only at ncclGroupEnd, so the bar is opened before the group and
   closed after it (an index, not a pointer: the trace may grow meanwhile). */
static void mgpu__nccl_trace_open(mgpu__queue *q, const char *name, void **bar) {
    bar[0] = bar[1] = NULL;
    if (!mgpu__library.tracing) return;
    MGPU_CUDA_CHECK(cudaSetDevice(q->device->gpu));
    mgpu__trace_add(q, name, mgpu__trace_label_now, 0, 0, bar);
    MGPU_CUDA_CHECK(cudaEventRecord((cudaEvent_t)bar[0], q->stream));
}
static void mgpu__nccl_trace_close(mgpu__queue *q, void **bar) {
    if (!bar[1]) return;
    MGPU_CUDA_CHECK(cudaSetDevice(q->device->gpu));
    MGPU_CUDA_CHECK(cudaEventRecord((cudaEvent_t)bar[1], q->stream));
}

typedef enum {
    MGPU__NCCL_ALLREDUCE, MGPU__NCCL_BROADCAST, MGPU__NCCL_REDUCE_SCATTER, MGPU__NCCL_ALL_GATHER
} mgpu__nccl_kind;

/* One NCCL call per rank on its device's communication queue. In one
   process the calls of all ranks go between ncclGroupStart and
   ncclGroupEnd: a call waits for the other ranks, so making them one by
   one would wait for ever. `arg` is `average` for the reductions and the
   root for the broadcast. */
static void mgpu__nccl_start(const mgpu_nccl_comm *c, const char *name, mgpu__nccl_kind kind,
                             mgpu_tensor *const *in, mgpu_tensor *const *out, int arg) {
    void *bars[MGPU_MAX_DEVICES][2];
    mgpu__comm_begin(out, c->n);
    for (int i = 0; i < c->n; i++) mgpu__nccl_trace_open(&out[i]->device->queue[1], name, bars[i]);
    ncclRedOp_t op = arg ? ncclAvg : ncclSum;
    MGPU_NCCL_CHECK(ncclGroupStart());
    for (int i = 0; i < c->n; i++) {
        cudaStream_t s = out[i]->device->queue[1].stream;
        const void *src = in[i]->data;
        void *dst = out[i]->data;
        switch (kind) {
        case MGPU__NCCL_ALLREDUCE:
            MGPU_NCCL_CHECK(ncclAllReduce(src, dst, out[i]->numel, ncclFloat, op, c->comms[i], s));
            break;
        case MGPU__NCCL_BROADCAST:
            MGPU_NCCL_CHECK(ncclBroadcast(src, dst, out[i]->numel, ncclFloat, arg, c->comms[i], s));
            break;
        case MGPU__NCCL_REDUCE_SCATTER:
            MGPU_NCCL_CHECK(ncclReduceScatter(src, dst, out[i]->numel, ncclFloat, op, c->comms[i], s));
            break;
        case MGPU__NCCL_ALL_GATHER:
            MGPU_NCCL_CHECK(ncclAllGather(src, dst, in[i]->numel, ncclFloat, c->comms[i], s));
            break;
        }
    }
    MGPU_NCCL_CHECK(ncclGroupEnd());
    for (int i = 0; i < c->n; i++) mgpu__nccl_trace_close(&out[i]->device->queue[1], bars[i]);
    mgpu__comm_track(out, in != out ? in : NULL, c->n);
}

MGPU_DEF void mgpu_nccl_allreduce(mgpu_nccl_comm *c, mgpu_tensor **data, int average) {
    mgpu__require_nccl("mgpu_nccl_allreduce", c, data, "data");
    mgpu__require_collective("mgpu_nccl_allreduce", data, c->n);
    mgpu__nccl_start(c, "nccl allreduce", MGPU__NCCL_ALLREDUCE, data, data, average);
    mgpu__comm_end(data, c->n);
}

MGPU_DEF void mgpu_nccl_broadcast(mgpu_nccl_comm *c, mgpu_tensor **data, int root) {
    mgpu__require_nccl("mgpu_nccl_broadcast", c, data, "data");
    mgpu__require_collective("mgpu_nccl_broadcast", data, c->n);
    MGPU_REQUIRE(root >= 0 && root < c->n, "mgpu_nccl_broadcast: root %d of %d ranks", root, c->n);
    mgpu__nccl_start(c, "nccl broadcast", MGPU__NCCL_BROADCAST, data, data, root);
    mgpu__comm_end(data, c->n);
}

/* in[i] holds n times as many elements as out[i]. */
static void mgpu__require_n_times(const char *op, const mgpu_tensor *big, const mgpu_tensor *small, int n) {
    char sb[64], ss[64];
    MGPU_REQUIRE(big->numel == (size_t)n * small->numel,
                 "%s: %s must hold %d times the elements of %s (one part per rank)", op,
                 mgpu_shape_str(big->shape, sb, sizeof sb), n, mgpu_shape_str(small->shape, ss, sizeof ss));
}

MGPU_DEF void mgpu_nccl_reduce_scatter(mgpu_nccl_comm *c, mgpu_tensor *const *in, mgpu_tensor **out,
                                       int average) {
    mgpu__require_nccl("mgpu_nccl_reduce_scatter", c, in, "in");
    mgpu__require_nccl("mgpu_nccl_reduce_scatter", c, out, "out");
    mgpu__require_collective("mgpu_nccl_reduce_scatter", out, c->n);
    for (int i = 0; i < c->n; i++) {
        mgpu__require_device(in[i], out[i]->device, "mgpu_nccl_reduce_scatter");
        mgpu__require_n_times("mgpu_nccl_reduce_scatter", in[i], out[i], c->n);
    }
    mgpu__nccl_start(c, "nccl reduce-scatter", MGPU__NCCL_REDUCE_SCATTER, in, out, average);
    mgpu__comm_end(out, c->n);
}

MGPU_DEF void mgpu_nccl_all_gather(mgpu_nccl_comm *c, mgpu_tensor *const *in, mgpu_tensor **out) {
    mgpu__require_nccl("mgpu_nccl_all_gather", c, in, "in");
    mgpu__require_nccl("mgpu_nccl_all_gather", c, out, "out");
    mgpu__require_collective("mgpu_nccl_all_gather", in, c->n);
    for (int i = 0; i < c->n; i++) {
        mgpu__require_device(in[i], out[i]->device, "mgpu_nccl_all_gather");
        mgpu__require_n_times("mgpu_nccl_all_gather", out[i], in[i], c->n);
    }
    mgpu__nccl_start(c, "nccl all-gather", MGPU__NCCL_ALL_GATHER, in, out, 0);
    mgpu__comm_end(out, c->n);
}

/* The communicators mgpu_allreduce_auto makes, one per list of GPUs, kept
   until the process ends (making one takes a while); like the library's
   other CUDA objects they are left to the end of the process, not
   destroyed at exit (see mgpu__at_exit). */
static mgpu_nccl_comm *mgpu__nccl_cache;
/* NULL when the devices are not distinct GPUs. */
static mgpu_nccl_comm *mgpu__nccl_for(mgpu_device *const *devices, int n) {
    for (mgpu_nccl_comm *c = mgpu__nccl_cache; c; c = c->next) {
        int same = c->n == n;
        for (int i = 0; i < n && same; i++) same = c->gpus[i] == devices[i]->gpu;
        if (same) return c;
    }
    mgpu_nccl_comm *c = mgpu_nccl_init(devices, n);
    if (!c) return NULL;
    c->next = mgpu__nccl_cache;
    mgpu__nccl_cache = c;
    return c;
}

#else /* no nvcc: no GPU, no NCCL, so no communicator can be made */
MGPU_DEF mgpu_nccl_comm *mgpu_nccl_init(mgpu_device *const *devices, int n) {
    (void)devices;
    (void)n;
    return NULL;
}
MGPU_DEF void mgpu_nccl_free(mgpu_nccl_comm *c) { (void)c; }
static void mgpu__no_nccl(const char *op) {
    mgpu_fatal("%s: this program was built without CUDA, so without NCCL (mgpu_nccl_init gives NULL)", op);
}
MGPU_DEF void mgpu_nccl_allreduce(mgpu_nccl_comm *c, mgpu_tensor **data, int average) {
    (void)c; (void)data; (void)average;
    mgpu__no_nccl("mgpu_nccl_allreduce");
}
MGPU_DEF void mgpu_nccl_broadcast(mgpu_nccl_comm *c, mgpu_tensor **data, int root) {
    (void)c; (void)data; (void)root;
    mgpu__no_nccl("mgpu_nccl_broadcast");
}
MGPU_DEF void mgpu_nccl_reduce_scatter(mgpu_nccl_comm *c, mgpu_tensor *const *in, mgpu_tensor **out,
                                       int average) {
    (void)c; (void)in; (void)out; (void)average;
    mgpu__no_nccl("mgpu_nccl_reduce_scatter");
}
MGPU_DEF void mgpu_nccl_all_gather(mgpu_nccl_comm *c, mgpu_tensor *const *in, mgpu_tensor **out) {
    (void)c; (void)in; (void)out;
    mgpu__no_nccl("mgpu_nccl_all_gather");
}
#endif

/* ---------------------------------------------------- choosing an algorithm */
static const char *mgpu__allreduce_start(const char *op, mgpu_tensor **data, int n, int average,
                                         mgpu_tensor *const *scratch) {
    mgpu__require_collective(op, data, n);
    if (n == 1) return "none"; /* the sum of one vector is itself, and so is its average */
    /* checked whichever algorithm runs (NCCL needs no scratch, the ring
       does): a call is right or wrong the same on every kind of device */
    size_t chunk = (data[0]->numel + n - 1) / n; /* the ring's longest chunk */
    for (int i = 0; scratch && i < n; i++) {
        MGPU_REQUIRE(scratch[i] && scratch[i]->device == data[i]->device && scratch[i]->numel >= chunk,
                     "%s: scratch[%d] must hold at least %zu elements on %s", op, i, chunk,
                     data[i]->device->name);
        mgpu__require_apart(scratch[i], data[i], op, 0);
    }
#if MGPU_CUDA
    mgpu_device *devices[MGPU_MAX_DEVICES] = {NULL};
    mgpu__devices_of(data, n, devices);
    mgpu_nccl_comm *c = mgpu__nccl_for(devices, n);
    if (c) {
        mgpu__nccl_start(c, "nccl allreduce", MGPU__NCCL_ALLREDUCE, data, data, average);
        return "nccl";
    }
#endif
    mgpu__ring_start(op, data, n, average, scratch);
    return "ring";
}

MGPU_DEF const char *mgpu_allreduce_start(mgpu_tensor **data, int n, int average, mgpu_tensor *const *scratch) {
    return mgpu__allreduce_start("mgpu_allreduce_start", data, n, average, scratch);
}

MGPU_DEF const char *mgpu_allreduce_auto(mgpu_tensor **data, int n, int average) {
    const char *algorithm = mgpu__allreduce_start("mgpu_allreduce_auto", data, n, average, NULL);
    if (n > 1) mgpu__comm_end(data, n);
    return algorithm;
}
