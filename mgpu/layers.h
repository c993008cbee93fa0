/* mgpu/layers.h: the layers' public functions, each a check of shapes
   and devices and then its kernels enqueued on the device's compute
   queue: pooling, ReLU and the residual add, linear. (Convolution, the
   largest, has mgpu/convolution.h.) Chapter 2 builds LeNet from them.
   defines: mgpu_avg_pool2d_output_shape, mgpu_avg_pool2d_forward,
   mgpu_avg_pool2d_backward, mgpu_global_avg_pool_forward,
   mgpu_global_avg_pool_backward, mgpu_relu_forward, mgpu_relu_backward,
   mgpu_add, mgpu_add_relu, mgpu_linear_forward, mgpu_linear_backward */
/* ======================================================================
   Layers: the public wrappers of kernels/conv.h, pool.h, activation.h
   and linear.h. Each checks shapes and devices, then enqueues the kernels
   on the device's compute queue. A convolution is several kernels in a
   row (im2col, a product, an axis swap, ...), enqueued one after another
   on the same queue, so they run in that order.
   ====================================================================== */

/* Enqueues fn##_cpu / fn##_cuda with `args` on dev's compute queue. */
#define MGPU__ENQUEUE(dev, name, fn, args)                                                 \
    mgpu__launch_on(&(dev)->queue[0], name, fn##_cpu, MGPU__CUDA_FN(fn##_cuda), &(args), \
                    sizeof(args))

/* Enqueues a per-channel sum (kernels/linear.h) on dev, with the scratch
   for the GPU's split sum when it needs one. */
static void mgpu__enqueue_chan_sum(mgpu_device *dev, const char *name, float *out, const float *x,
                                   int outer, int channels, size_t inner, float alpha,
                                   float beta) {
    mgpu__chan_sum_args a = {out, x, outer, channels, inner, alpha, beta, NULL, 1};
    mgpu_tensor *partials = NULL;
    if (mgpu_device_is_gpu(dev)) a.splits = mgpu__chan_sum_splits(outer, channels, inner);
    if (a.splits > 1) {
        partials = mgpu_empty(dev, mgpu_shape1(channels * a.splits));
        a.partials = partials->data;
    }
    MGPU__ENQUEUE(dev, name, mgpu__chan_sum, a);
    mgpu_free(partials); /* reused only by work enqueued after this on the same queue */
}

static void mgpu__require_shape(const mgpu_tensor *t, mgpu_shape want, const char *op,
                                const char *what) {
    char a[64], b[64];
    MGPU_REQUIRE(mgpu_shape_equal(t->shape, want), "%s: %s has shape %s, expected %s", op, what,
                 mgpu_shape_str(t->shape, a, sizeof a), mgpu_shape_str(want, b, sizeof b));
}
/* A channels-last copy of x [N, C, H, W]: [N, H*W, C] on x's device
   (kernels/channels_last.h). */
static void mgpu__require_channels_last_of(const mgpu_tensor *t, const mgpu_tensor *x, const char *op,
                                           const char *what) {
    mgpu__require_device(t, x->device, op);
    mgpu__require_shape(t, mgpu_shape3(x->shape.d[0], x->shape.d[2] * x->shape.d[3], x->shape.d[1]), op,
                        what);
}

/* The GPU kernels index in 32 bits (a 64-bit division is slow on a GPU),
   so the layers take tensors of up to 2^31 - 1 elements (8 GiB). */
#define MGPU__MAX_LAYER_NUMEL ((size_t)0x7fffffff)
static void mgpu__require_indexable(const mgpu_tensor *t, const char *op) {
    char s[64];
    MGPU_REQUIRE(t->numel <= MGPU__MAX_LAYER_NUMEL,
                 "%s: a tensor of shape %s has %zu elements, more than the layers handle "
                 "(2^31 - 1)", op, mgpu_shape_str(t->shape, s, sizeof s), t->numel);
}

/* --------------------------------------------------------------- pooling */
static mgpu_shape mgpu__avg_pool_shape(const char *op, mgpu_shape x, int k) {
    char sx[64];
    MGPU_REQUIRE(x.ndim == 4 && k >= 1 && x.d[2] >= k && x.d[3] >= k,
                 "%s: cannot pool input %s with %dx%d windows (want [N, C, H, W] with "
                 "H, W >= k >= 1)", op, mgpu_shape_str(x, sx, sizeof sx), k, k);
    return mgpu_shape4(x.d[0], x.d[1], x.d[2] / k, x.d[3] / k);
}
MGPU_DEF mgpu_shape mgpu_avg_pool2d_output_shape(mgpu_shape x, int k) {
    return mgpu__avg_pool_shape("mgpu_avg_pool2d_output_shape", x, k);
}

MGPU_DEF void mgpu_avg_pool2d_forward(mgpu_tensor *y, const mgpu_tensor *x, int k) {
    const char *op = "mgpu_avg_pool2d_forward";
    mgpu__require_device(y, x->device, op);
    mgpu__require_shape(y, mgpu__avg_pool_shape(op, x->shape, k), op, "output y");
    mgpu__require_indexable(x, op);
    mgpu__avg_pool_args a = {y->data, x->data, y->numel, x->shape.d[2], x->shape.d[3], k};
    mgpu__before_write(y);
    MGPU__ENQUEUE(x->device, "avg_pool2d", mgpu__avg_pool, a);
}

MGPU_DEF void mgpu_avg_pool2d_backward(mgpu_tensor *dx, const mgpu_tensor *dy, int k) {
    const char *op = "mgpu_avg_pool2d_backward";
    mgpu__require_device(dy, dx->device, op);
    mgpu__require_shape(dy, mgpu__avg_pool_shape(op, dx->shape, k), op, "output gradient dy");
    mgpu__require_indexable(dx, op);
    mgpu__avg_pool_backward_args a = {dx->data, dy->data, dx->numel, dx->shape.d[2],
                                      dx->shape.d[3], k};
    mgpu__before_write(dx);
    MGPU__ENQUEUE(dx->device, "avg_pool2d_backward", mgpu__avg_pool_backward, a);
}

/* images [N, C, H, W] and means [N, C] on one device. The kernels see
   the images as [1, N*C, H*W]: one channel per plane. */
static void mgpu__global_pool_check(const char *op, const mgpu_tensor *images,
                                    const mgpu_tensor *means, const char *means_name) {
    char s[64];
    mgpu__require_device(means, images->device, op);
    MGPU_REQUIRE(images->shape.ndim == 4, "%s: images %s must be [N, C, H, W]", op,
                 mgpu_shape_str(images->shape, s, sizeof s));
    mgpu__require_shape(means, mgpu_shape2(images->shape.d[0], images->shape.d[1]), op,
                        means_name);
    mgpu__require_indexable(images, op);
}

MGPU_DEF void mgpu_global_avg_pool_forward(mgpu_tensor *y, const mgpu_tensor *x) {
    mgpu__global_pool_check("mgpu_global_avg_pool_forward", x, y, "output y");
    size_t hw = (size_t)x->shape.d[2] * x->shape.d[3];
    float mean = 1.0f / (float)hw;
    mgpu__before_write(y);
    mgpu__enqueue_chan_sum(x->device, "global_avg_pool", y->data, x->data, 1, (int)y->numel, hw,
                           mean, 0.0f);
}

MGPU_DEF void mgpu_global_avg_pool_backward(mgpu_tensor *dx, const mgpu_tensor *dy) {
    mgpu__global_pool_check("mgpu_global_avg_pool_backward", dx, dy, "output gradient dy");
    size_t hw = (size_t)dx->shape.d[2] * dx->shape.d[3];
    float share = 1.0f / (float)hw; /* each pixel's part in its plane's mean */
    mgpu__chan_broadcast_args a = {dx->data, dy->data, 1, (int)dy->numel, hw, share, 0.0f};
    mgpu__before_write(dx);
    MGPU__ENQUEUE(dx->device, "global_avg_pool_backward", mgpu__chan_broadcast, a);
}

/* ----------------------------------------------------- ReLU and residuals */
MGPU_DEF void mgpu_relu_forward(mgpu_tensor *y, const mgpu_tensor *x) {
    mgpu__require_device(x, y->device, "mgpu_relu_forward");
    mgpu__require_same_shape(y, x, "mgpu_relu_forward");
    mgpu__relu_args a = {y->data, x->data, y->numel};
    mgpu__before_write(y);
    MGPU__ENQUEUE(y->device, "relu", mgpu__relu, a);
}

MGPU_DEF void mgpu_relu_backward(mgpu_tensor *dx, const mgpu_tensor *dy,
                                 const mgpu_tensor *y_or_x) {
    const char *op = "mgpu_relu_backward";
    mgpu__require_device(dy, dx->device, op);
    mgpu__require_device(y_or_x, dx->device, op);
    mgpu__require_same_shape(dx, dy, op);
    mgpu__require_same_shape(dx, y_or_x, op);
    mgpu__relu_backward_args a = {dx->data, dy->data, y_or_x->data, dx->numel};
    mgpu__before_write(dx);
    MGPU__ENQUEUE(dx->device, "relu_backward", mgpu__relu_backward, a);
}

static void mgpu__residual_launch(const char *op, mgpu_tensor *y, const mgpu_tensor *a,
                                  const mgpu_tensor *b, int relu) {
    mgpu__require_device(a, y->device, op);
    mgpu__require_device(b, y->device, op);
    mgpu__require_same_shape(a, b, op);
    mgpu__require_same_shape(y, a, op);
    mgpu__add_args args = {y->data, a->data, b->data, y->numel, relu};
    mgpu__before_write(y);
    MGPU__ENQUEUE(y->device, relu ? "add_relu" : "add", mgpu__add, args);
}
MGPU_DEF void mgpu_add(mgpu_tensor *y, const mgpu_tensor *a, const mgpu_tensor *b) {
    mgpu__residual_launch("mgpu_add", y, a, b, 0);
}
MGPU_DEF void mgpu_add_relu(mgpu_tensor *y, const mgpu_tensor *a, const mgpu_tensor *b) {
    mgpu__residual_launch("mgpu_add_relu", y, a, b, 1);
}

/* ---------------------------------------------------------------- linear */

/* Checks x [N, in...] against w [in, out]; returns N. */
static int mgpu__linear_check(const char *op, const mgpu_tensor *x, const mgpu_tensor *w) {
    char sx[64], sw[64];
    mgpu_shape_str(x->shape, sx, sizeof sx);
    mgpu_shape_str(w->shape, sw, sizeof sw);
    mgpu__require_device(w, x->device, op);
    MGPU_REQUIRE(w->shape.ndim == 2, "%s: weight %s must be a matrix [in, out]", op, sw);
    MGPU_REQUIRE(x->shape.ndim >= 2, "%s: input %s must be [N, in] (or [N, C, H, W])", op, sx);
    size_t features = x->numel / (size_t)(x->shape.d[0] ? x->shape.d[0] : 1);
    MGPU_REQUIRE(features == (size_t)w->shape.d[0],
                 "%s: input %s has %zu features but weight %s expects %d", op, sx, features, sw,
                 w->shape.d[0]);
    return x->shape.d[0];
}

MGPU_DEF void mgpu_linear_forward(mgpu_tensor *y, const mgpu_tensor *x, const mgpu_tensor *w,
                                  const mgpu_tensor *b) {
    const char *op = "mgpu_linear_forward";
    int n = mgpu__linear_check(op, x, w), in = w->shape.d[0], out = w->shape.d[1];
    mgpu__require_device(y, x->device, op);
    mgpu__require_shape(y, mgpu_shape2(n, out), op, "output y");
    mgpu__require_indexable(y, op);
    if (b) {
        mgpu__require_device(b, x->device, op);
        mgpu__require_shape(b, mgpu_shape1(out), op, "bias b");
    }
    mgpu__before_write(y);
    int tf32 = mgpu__tf32_allowed(MGPU__TF32_MATMUL);
    mgpu__gemm_args prod = mgpu__gemm_dense(0, 0, n, out, in, x->data, w->data, y->data, 0.0f,
                                            tf32);
    MGPU__ENQUEUE(x->device, "linear", mgpu__gemm, prod);
    if (b) {
        mgpu__chan_broadcast_args bias = {y->data, b->data, n, out, 1, 1.0f, 1.0f};
        MGPU__ENQUEUE(x->device, "linear", mgpu__chan_broadcast, bias);
    }
}

MGPU_DEF void mgpu_linear_backward(mgpu_tensor *dx, mgpu_tensor *dw, mgpu_tensor *db,
                                   const mgpu_tensor *dy, const mgpu_tensor *x,
                                   const mgpu_tensor *w, int accumulate) {
    const char *op = "mgpu_linear_backward";
    int n = mgpu__linear_check(op, x, w), in = w->shape.d[0], out = w->shape.d[1];
    mgpu_device *dev = x->device;
    float beta = accumulate ? 1.0f : 0.0f;
    int tf32 = mgpu__tf32_allowed(MGPU__TF32_MATMUL);
    mgpu__require_device(dy, dev, op);
    mgpu__require_shape(dy, mgpu_shape2(n, out), op, "output gradient dy");
    mgpu__require_indexable(dy, op);
    if (dw) {
        mgpu__require_device(dw, dev, op);
        mgpu__require_shape(dw, w->shape, op, "weight gradient dw");
    }
    if (dx) {
        mgpu__require_device(dx, dev, op);
        mgpu__require_shape(dx, x->shape, op, "input gradient dx");
    }
    if (db) {
        mgpu__require_device(db, dev, op);
        mgpu__require_shape(db, mgpu_shape1(out), op, "bias gradient db");
    }
    if (dx) { /* dx [N, in] = dy [N, out] w^T */
        mgpu__gemm_args dxp = mgpu__gemm_dense(0, 1, n, in, out, dy->data, w->data, dx->data,
                                               0.0f, tf32);
        mgpu__before_write(dx);
        MGPU__ENQUEUE(dev, "linear_backward", mgpu__gemm, dxp);
    }
    if (dw) { /* dw [in, out] (+)= x^T [in, N] dy [N, out] */
        mgpu__gemm_args dwp = mgpu__gemm_dense(1, 0, in, out, n, x->data, dy->data, dw->data, beta,
                                               tf32);
        mgpu__before_write(dw);
        MGPU__ENQUEUE(dev, "linear_backward", mgpu__gemm, dwp);
    }
    if (db) {
        mgpu__before_write(db);
        mgpu__enqueue_chan_sum(dev, "linear_backward", db->data, dy->data, n, out, 1, 1.0f, beta);
    }
}
