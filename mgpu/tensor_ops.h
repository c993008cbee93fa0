/* mgpu/tensor_ops.h: filling tensors (constants, random numbers from
   the one seed, ranges), the elementwise updates, the matrix product, and
   copies between devices and the host. Chapter 1 multiplies matrices on
   two devices and copies between them with these.
   defines: mgpu_empty_pinned, mgpu_philox, mgpu_manual_seed, mgpu_fill,
   mgpu_full, mgpu_zeros, mgpu_ones, mgpu_rand_uniform, mgpu_rand,
   mgpu_randn, mgpu_arange, mgpu_add_, mgpu_scale_, mgpu_matmul, mgpu_mm,
   mgpu_copy, mgpu_to, mgpu_from_host, mgpu_to_host, mgpu_item,
   mgpu_print */
MGPU_DEF mgpu_tensor *mgpu_empty_pinned(mgpu_shape shape) {
    return mgpu__tensor_alloc(mgpu_cpu(), shape, 1, 0);
}
MGPU_DEF void mgpu_philox(uint64_t key, uint64_t counter, uint32_t out[4]) {
    mgpu__philox4x32(key, counter, out);
}
MGPU_DEF void mgpu_manual_seed(uint64_t seed) {
    mgpu__init();
    mgpu__library.seed = seed;
    mgpu__library.offset = 0;
}
/* Each draw takes the next block of counters, rounded to whole Philox blocks. */
static uint64_t mgpu__random_offset(size_t n) {
    mgpu__init();
    uint64_t offset = mgpu__library.offset;
    mgpu__library.offset += (n + 3) / 4 * 4;
    return offset;
}

/* ------------------------------------------------------- filling tensors */
static void mgpu__fill_launch(mgpu_tensor *t, int kind, float a, float b) {
    mgpu__fill_args args;
    args.y = t->data;
    args.n = t->numel;
    args.kind = kind;
    args.a = a;
    args.b = b;
    args.key = mgpu__library.seed;
    args.offset = (kind == MGPU__FILL_UNIFORM || kind == MGPU__FILL_NORMAL)
                      ? mgpu__random_offset(t->numel) : 0;
    mgpu__before_write(t);
    mgpu__launch_on(&t->device->queue[0], "fill", mgpu__fill_cpu,
                    MGPU__CUDA_FN(mgpu__fill_cuda), &args, sizeof args);
}
MGPU_DEF void mgpu_fill(mgpu_tensor *t, float value) { mgpu__fill_launch(t, MGPU__FILL_CONSTANT, value, 0); }
MGPU_DEF mgpu_tensor *mgpu_full(mgpu_device *dev, mgpu_shape shape, float value) {
    mgpu_tensor *t = mgpu_empty(dev, shape);
    mgpu_fill(t, value);
    return t;
}
MGPU_DEF mgpu_tensor *mgpu_zeros(mgpu_device *dev, mgpu_shape shape) { return mgpu_full(dev, shape, 0.0f); }
MGPU_DEF mgpu_tensor *mgpu_ones(mgpu_device *dev, mgpu_shape shape) { return mgpu_full(dev, shape, 1.0f); }
MGPU_DEF mgpu_tensor *mgpu_rand_uniform(mgpu_device *dev, mgpu_shape shape, float low, float high) {
    mgpu_tensor *t = mgpu_empty(dev, shape);
    mgpu__fill_launch(t, MGPU__FILL_UNIFORM, low, high);
    return t;
}
MGPU_DEF mgpu_tensor *mgpu_rand(mgpu_device *dev, mgpu_shape shape) { return mgpu_rand_uniform(dev, shape, 0, 1); }
MGPU_DEF mgpu_tensor *mgpu_randn(mgpu_device *dev, mgpu_shape shape, float mean, float std) {
    mgpu_tensor *t = mgpu_empty(dev, shape);
    mgpu__fill_launch(t, MGPU__FILL_NORMAL, mean, std);
    return t;
}
MGPU_DEF mgpu_tensor *mgpu_arange(mgpu_device *dev, mgpu_shape shape) {
    mgpu_tensor *t = mgpu_empty(dev, shape);
    mgpu__fill_launch(t, MGPU__FILL_ARANGE, 0, 0);
    return t;
}

MGPU_DEF void mgpu_add_(mgpu_tensor *y, const mgpu_tensor *x) {
    mgpu__require_device(x, y->device, "mgpu_add_");
    mgpu__require_same_shape(y, x, "mgpu_add_");
    mgpu__require_apart(y, x, "mgpu_add_", 1);
    mgpu__axpby_args args = {y->data, x->data, y->numel, 1.0f, 1.0f};
    mgpu__before_write(y);
    mgpu__launch_on(&y->device->queue[0], "add", mgpu__axpby_cpu, MGPU__CUDA_FN(mgpu__axpby_cuda),
                    &args, sizeof args);
}
MGPU_DEF void mgpu_scale_(mgpu_tensor *y, float s) {
    mgpu__axpby_args args = {y->data, y->data, y->numel, 0.0f, s};
    mgpu__before_write(y);
    mgpu__launch_on(&y->device->queue[0], "scale", mgpu__axpby_cpu, MGPU__CUDA_FN(mgpu__axpby_cuda),
                    &args, sizeof args);
}

/* ------------------------------------------------------------ matmul */

MGPU_DEF void mgpu_matmul(mgpu_tensor *c, const mgpu_tensor *a, const mgpu_tensor *b) {
    char sa[64], sb[64], sc[64];
    mgpu__require_device(a, c->device, "mgpu_matmul");
    mgpu__require_device(b, c->device, "mgpu_matmul");
    MGPU_REQUIRE(a->shape.ndim == 2 && b->shape.ndim == 2 && c->shape.ndim == 2 &&
                     a->shape.d[1] == b->shape.d[0] && c->shape.d[0] == a->shape.d[0] &&
                     c->shape.d[1] == b->shape.d[1],
                 "mgpu_matmul: cannot multiply %s by %s into %s",
                 mgpu_shape_str(a->shape, sa, sizeof sa), mgpu_shape_str(b->shape, sb, sizeof sb),
                 mgpu_shape_str(c->shape, sc, sizeof sc));
    mgpu__require_apart(c, a, "mgpu_matmul", 0);
    mgpu__require_apart(c, b, "mgpu_matmul", 0);
    mgpu__gemm_args g = mgpu__gemm_dense(0, 0, a->shape.d[0], b->shape.d[1], a->shape.d[1], a->data,
                                         b->data, c->data, 0.0f,
                                         mgpu__tf32_allowed(MGPU__TF32_MATMUL));
    mgpu__before_write(c);
    mgpu__launch_on(&c->device->queue[0], "matmul", mgpu__gemm_cpu, MGPU__CUDA_FN(mgpu__gemm_cuda),
                    &g, sizeof g);
}
MGPU_DEF mgpu_tensor *mgpu_mm(const mgpu_tensor *a, const mgpu_tensor *b) {
    MGPU_REQUIRE(a->shape.ndim == 2 && b->shape.ndim == 2, "mgpu_mm: both tensors must be matrices");
    mgpu_tensor *c = mgpu_empty(a->device, mgpu_shape2(a->shape.d[0], b->shape.d[1]));
    mgpu_matmul(c, a, b);
    return c;
}

/* ======================================================================
   Copies between devices
   ====================================================================== */
typedef struct { float *dst; const float *src; size_t bytes; int dst_gpu, src_gpu; } mgpu__memcpy_args;
static void mgpu__memcpy_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__memcpy_args *a = (const mgpu__memcpy_args *)args;
    memcpy(a->dst, a->src, a->bytes);
}
#if MGPU_CUDA
static void mgpu__memcpy_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__memcpy_args *a = (const mgpu__memcpy_args *)args;
    cudaStream_t s = (cudaStream_t)ex->stream;
    if (a->src_gpu >= 0 && a->dst_gpu >= 0 && a->src_gpu != a->dst_gpu)
        MGPU_CUDA_CHECK(cudaMemcpyPeerAsync(a->dst, a->dst_gpu, a->src, a->src_gpu, a->bytes, s));
    else
        MGPU_CUDA_CHECK(cudaMemcpyAsync(a->dst, a->src, a->bytes, cudaMemcpyDefault, s));
}
#endif

/* The copy runs on the copy queue of the GPU side (a CUDA copy is issued on
   a GPU stream), or of the source device between CPU devices. It waits
   for the destination device's compute queue to finish what it has been
   given (its work may still read dst, or the memory the allocator has just
   handed out as dst), or, given dst_free, for that event only: the caller
   knows when the last work reading dst ends (mgpu__scatter). It waits for
   the source device's compute queue to finish what it has been given (its
   work may still write src), or, given src_ready, for that event only:
   the caller knows when src was written (a pipeline's stages, whose
   queues have gone on to later work by the time the next stage takes
   their output). */
static void mgpu__copy(mgpu_tensor *dst, const mgpu_tensor *src, int non_blocking, mgpu_event *dst_free,
                       mgpu_event *src_ready) {
    mgpu__require_alive(dst, "mgpu_copy");
    mgpu__require_alive(src, "mgpu_copy");
    mgpu__require_same_shape(dst, src, "mgpu_copy");
    mgpu__require_apart(dst, src, "mgpu_copy", 1);
    mgpu_device *from = src->device, *to = dst->device;
    mgpu__queue *q = (to->gpu >= 0 && from->gpu < 0) ? &to->queue[1] : &from->queue[1];
    /* Wait for the source to be written and for the destination to be free.
       One event per queue: an event re-recorded on another queue could
       complete out of order (and a CUDA event belongs to one GPU). */
    mgpu_event *ready = NULL;
    if (src_ready) {
        mgpu__event_wait_on(q, src_ready);
    } else {
        ready = mgpu_event_new();
        mgpu__event_record_on(ready, &from->queue[0]);
        mgpu__event_wait_on(q, ready);
    }
    if (to != from && dst_free) {
        mgpu__event_wait_on(q, dst_free);
    } else if (to != from) {
        mgpu_event *free_dst = mgpu_event_new();
        mgpu__event_record_on(free_dst, &to->queue[0]);
        mgpu__event_wait_on(q, free_dst);
        mgpu_event_free(free_dst);
    }
    /* ... and for copies on other queues still reading (or, pinned, writing) dst. */
    const mgpu_tensor *dst_base = dst->base ? dst->base : dst;
    if (dst_base->last_read) mgpu__event_wait_on(q, dst_base->last_read);
    /* A pinned source may still be being filled by a copy on another queue. */
    const mgpu_tensor *src_base = src->base ? src->base : src;
    if (src_base->last_write) mgpu__event_wait_on(q, src_base->last_write);
    mgpu__memcpy_args args = {dst->data, src->data, src->numel * sizeof(float), to->gpu, from->gpu};
    mgpu__launch_on(q, "copy", mgpu__memcpy_cpu, MGPU__CUDA_FN(mgpu__memcpy_cuda), &args, sizeof args);
    /* One event per tensor marks its last copy: make this copy's event
       also cover copies still using the tensors from other queues (a batch
       scattered to several GPUs is read by several copy queues). */
    const mgpu_tensor *tracked[2] = {src, dst->pinned ? dst : NULL};
    for (int i = 0; i < 2; i++) {
        const mgpu_tensor *t = tracked[i] && tracked[i]->base ? tracked[i]->base : tracked[i];
        if (t && t->last_read) mgpu__event_wait_on(q, t->last_read);
    }
    mgpu_event *done = mgpu_event_new();
    mgpu__event_record_on(done, q);
    /* The destination's compute queue uses the result only after the copy.
       Pinned host memory is the exception: it is a staging area the host
       reads after synchronising (as in PyTorch), so that a device copying
       its results out keeps computing meanwhile. */
    if (dst->pinned) {
        mgpu__tensor_track(dst, done);
        mgpu_tensor *w = dst->base ? dst->base : dst;
        mgpu__event_retain(done);
        mgpu_event_free(w->last_write);
        w->last_write = done;
    } else {
        mgpu__event_wait_on(&to->queue[0], done);
    }
    /* The source remembers that a copy queue may still be reading it. */
    if (q != &from->queue[0]) mgpu__tensor_track((mgpu_tensor *)src, done);
    if (!non_blocking) mgpu_event_synchronize(done);
    mgpu_event_free(done);
    mgpu_event_free(ready);
}
MGPU_DEF void mgpu_copy(mgpu_tensor *dst, const mgpu_tensor *src, int non_blocking) {
    mgpu__copy(dst, src, non_blocking, NULL, NULL);
}

MGPU_DEF mgpu_tensor *mgpu_to(const mgpu_tensor *t, mgpu_device *dev, int non_blocking) {
    mgpu_tensor *out = mgpu_empty(dev, t->shape);
    mgpu_copy(out, t, non_blocking);
    return out;
}

MGPU_DEF mgpu_tensor *mgpu_from_host(mgpu_device *dev, mgpu_shape shape, const float *values) {
    mgpu_tensor *t = mgpu_empty(dev, shape);
    mgpu_synchronize(dev);
#if MGPU_CUDA
    if (dev->gpu >= 0) {
        /* On the device's own (non-blocking) compute stream: the legacy default
           stream that cudaMemcpy uses does not order the queues' streams, and a
           pageable host-to-device cudaMemcpy may return before its DMA lands. */
        cudaStream_t s = dev->queue[0].stream;
        MGPU_CUDA_CHECK(cudaSetDevice(dev->gpu));
        MGPU_CUDA_CHECK(cudaMemcpyAsync(t->data, values, t->numel * sizeof(float),
                                        cudaMemcpyHostToDevice, s));
        MGPU_CUDA_CHECK(cudaStreamSynchronize(s));
        return t;
    }
#endif
    memcpy(t->data, values, t->numel * sizeof(float));
    return t;
}

MGPU_DEF void mgpu_to_host(const mgpu_tensor *t, float *out) {
    mgpu__require_alive(t, "mgpu_to_host");
    /* A non-blocking copy into pinned memory is tracked on the tensor, not
       waited for by the CPU device's queues: wait for it here. */
    const mgpu_tensor *b = t->base ? t->base : t;
    if (b->last_write) mgpu_event_synchronize(b->last_write);
    mgpu_synchronize(t->device);
#if MGPU_CUDA
    if (t->device->gpu >= 0) {
        MGPU_CUDA_CHECK(cudaSetDevice(t->device->gpu));
        MGPU_CUDA_CHECK(cudaMemcpy(out, t->data, t->numel * sizeof(float), cudaMemcpyDeviceToHost));
        return;
    }
#endif
    memcpy(out, t->data, t->numel * sizeof(float));
}

/* A view of value i of t alone, shape [1] (past INT_MAX too, where
   mgpu_narrow's rows stop). */
static mgpu_tensor *mgpu__value_view(const mgpu_tensor *t, size_t i) {
    mgpu_tensor *one = mgpu_view(t, t->shape);
    one->shape = mgpu_shape1(1);
    one->numel = 1;
    one->data += i;
    return one;
}
MGPU_DEF float mgpu_item(const mgpu_tensor *t, size_t i) {
    mgpu__require_alive(t, "mgpu_item");
    MGPU_REQUIRE(i < t->numel, "mgpu_item: index %zu out of range for %zu elements", i, t->numel);
    mgpu_tensor *one = mgpu__value_view(t, i);
    float v;
    mgpu_to_host(one, &v);
    mgpu_free(one);
    return v;
}

/* Prints like PyTorch: tensor([[0., 1.], [2., 3.]], device='cuda:0') */
MGPU_DEF void mgpu_print(const char *label, const mgpu_tensor *t) {
    mgpu__require_alive(t, "mgpu_print");
    float *v = (float *)mgpu__xmalloc(t->numel * sizeof(float));
    mgpu_to_host(t, v);
    if (label) printf("%s", label);
    printf("tensor(");
    /* block[k]: elements in one entry of dimension k; a bracket opens where a block starts */
    size_t block[MGPU_MAX_DIMS];
    size_t size = 1;
    for (int k = t->shape.ndim - 1; k >= 0; k--) block[k] = size *= (size_t)t->shape.d[k];
    for (size_t i = 0; i < t->numel; i++) {
        for (int k = 0; k < t->shape.ndim; k++)
            if (i % block[k] == 0) printf("[");
        float x = v[i];
        if (x == (float)(long)x && fabsf(x) < 1e7f) printf("%.0f.", x);
        else printf("%.4f", x);
        int closed = 0;
        for (int k = t->shape.ndim - 1; k >= 0; k--)
            if ((i + 1) % block[k] == 0) { printf("]"); closed++; }
        if (i + 1 < t->numel) {
            if (closed) printf(",\n%*s", 7 + t->shape.ndim - closed, "");
            else printf(", ");
        }
    }
    printf(", device='%s')\n", t->device->name);
    free(v);
}
