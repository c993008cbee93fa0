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

static void mgpu__require_shape(const mgpu_tensor *t, mgpu_shape want, const char *op,
                                const char *what) {
    char a[64], b[64];
    MGPU_REQUIRE(mgpu_shape_equal(t->shape, want), "%s: %s has shape %s, expected %s", op, what,
                 mgpu_shape_str(t->shape, a, sizeof a), mgpu_shape_str(want, b, sizeof b));
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

/* ----------------------------------------------------------- convolution */

/* Scratch a convolution may use at once, in floats: the col buffer and
   the output in [K, n*P*Q] order, for a chunk of n images. On a GPU, 64
   MiB: one product should cover as many images as it can. On the CPU,
   4 MiB: a chunk whose col buffer stays in the processor's cache between
   im2col and the product is faster than one product over the whole
   batch. Indexed by mgpu_device_is_gpu; variables, so that the tests can
   force many small chunks. */
static size_t mgpu__conv_scratch_floats[2] = {(size_t)1 << 20, (size_t)16 << 20};

/* The geometry of conv(x, w) over the whole batch; checks that the shapes fit. */
static mgpu__conv_geom mgpu__conv_geometry(const char *op, mgpu_shape x, mgpu_shape w, int stride,
                                           int pad) {
    char sx[64], sw[64];
    mgpu_shape_str(x, sx, sizeof sx);
    mgpu_shape_str(w, sw, sizeof sw);
    MGPU_REQUIRE(x.ndim == 4 && w.ndim == 4,
                 "%s: input %s and weight %s must both have 4 dimensions ([N, C, H, W] and "
                 "[K, C, R, S])", op, sx, sw);
    MGPU_REQUIRE(x.d[0] >= 1, "%s: input %s is an empty batch", op, sx);
    MGPU_REQUIRE(x.d[1] == w.d[1],
                 "%s: input %s has %d channels but weight %s expects %d", op, sx, x.d[1], sw,
                 w.d[1]);
    MGPU_REQUIRE(stride >= 1 && pad >= 0, "%s: stride %d must be >= 1 and padding %d >= 0", op,
                 stride, pad);
    MGPU_REQUIRE(x.d[2] + 2 * pad >= w.d[2] && x.d[3] + 2 * pad >= w.d[3],
                 "%s: a %dx%d kernel does not fit in input %s padded by %d", op, w.d[2], w.d[3],
                 sx, pad);
    mgpu__conv_geom g;
    g.n = x.d[0]; g.c = x.d[1]; g.h = x.d[2]; g.w = x.d[3];
    g.k = w.d[0]; g.r = w.d[2]; g.s = w.d[3];
    g.stride = stride;
    g.pad = pad;
    g.p = (g.h + 2 * pad - g.r) / stride + 1;
    g.q = (g.w + 2 * pad - g.s) / stride + 1;
    return g;
}

MGPU_DEF mgpu_shape mgpu_conv2d_output_shape(mgpu_shape x, mgpu_shape w, int stride, int pad) {
    mgpu__conv_geom g = mgpu__conv_geometry("mgpu_conv2d_output_shape", x, w, stride, pad);
    return mgpu_shape4(g.n, g.k, g.p, g.q);
}

/* Images per chunk: as many as the scratch allows, at least one. */
static int mgpu__conv_chunk(const mgpu__conv_geom *g, const mgpu_device *dev) {
    size_t per_image = (size_t)(g->c * g->r * g->s + g->k) * g->p * g->q;
    size_t n = mgpu__conv_scratch_floats[mgpu_device_is_gpu(dev)] / (per_image ? per_image : 1);
    if (n > (size_t)g->n) n = (size_t)g->n;
    return n < 1 ? 1 : (int)n;
}

/* The scratch of a chunked convolution: col [C*R*S, n*P*Q] and the output
   (or its gradient) in product order [K, n*P*Q]. Freed right after the
   kernels are enqueued: the allocator hands the blocks out again only to
   work enqueued later on the same queue. */
typedef struct {
    int chunk;
    mgpu_tensor *col, *kout;
} mgpu__conv_scratch;

static mgpu__conv_scratch mgpu__conv_scratch_new(mgpu_device *dev, const mgpu__conv_geom *g) {
    mgpu__conv_scratch s;
    s.chunk = mgpu__conv_chunk(g, dev);
    MGPU_REQUIRE((size_t)s.chunk * g->c * g->r * g->s * g->p * g->q <= MGPU__MAX_LAYER_NUMEL,
                 "conv2d: one image needs %zu floats of im2col scratch, more than the layers "
                 "handle (2^31 - 1)", (size_t)g->c * g->r * g->s * g->p * g->q);
    int cols = s.chunk * g->p * g->q;
    s.col = mgpu_empty(dev, mgpu_shape2(g->c * g->r * g->s, cols));
    s.kout = mgpu_empty(dev, mgpu_shape2(g->k, cols));
    return s;
}
static void mgpu__conv_scratch_free(mgpu__conv_scratch *s) {
    mgpu_free(s->col);
    mgpu_free(s->kout);
}

MGPU_DEF void mgpu_conv2d_forward(mgpu_tensor *y, const mgpu_tensor *x, const mgpu_tensor *w,
                                  const mgpu_tensor *b, int stride, int pad) {
    const char *op = "mgpu_conv2d_forward";
    mgpu__conv_geom g = mgpu__conv_geometry(op, x->shape, w->shape, stride, pad);
    mgpu_device *dev = x->device;
    mgpu__require_device(w, dev, op);
    mgpu__require_device(y, dev, op);
    mgpu__require_shape(y, mgpu_shape4(g.n, g.k, g.p, g.q), op, "output y");
    mgpu__require_indexable(x, op);
    mgpu__require_indexable(y, op);
    if (b) {
        mgpu__require_device(b, dev, op);
        mgpu__require_shape(b, mgpu_shape1(g.k), op, "bias b");
    }
    mgpu__before_write(y);
    size_t pq = (size_t)g.p * g.q, crs = (size_t)g.c * g.r * g.s;
    mgpu__conv_scratch s = mgpu__conv_scratch_new(dev, &g);
    for (int n0 = 0; n0 < g.n; n0 += s.chunk) {
        mgpu__conv_geom part = g;
        part.n = g.n - n0 < s.chunk ? g.n - n0 : s.chunk;
        int cols = part.n * (int)pq;
        mgpu__im2col_args im = {x->data + (size_t)n0 * g.c * g.h * g.w, s.col->data, part};
        MGPU__ENQUEUE(dev, "conv2d", mgpu__im2col, im);
        /* Y [K, n*P*Q] = W [K, C*R*S] col [C*R*S, n*P*Q] */
        mgpu__gemm_args prod = mgpu__gemm_dense(0, 0, g.k, cols, (int)crs, w->data, s.col->data,
                                                s.kout->data, 0.0f);
        MGPU__ENQUEUE(dev, "conv2d", mgpu__gemm, prod);
        /* [K, n, P*Q] -> y's [n, K, P*Q] */
        mgpu__swap_outer_args back = {y->data + (size_t)n0 * g.k * pq, s.kout->data, g.k, part.n,
                                      pq};
        MGPU__ENQUEUE(dev, "conv2d", mgpu__swap_outer, back);
    }
    mgpu__conv_scratch_free(&s);
    if (b) {
        mgpu__chan_broadcast_args bias = {y->data, b->data, g.n, g.k, pq, 1.0f, 1.0f};
        MGPU__ENQUEUE(dev, "conv2d", mgpu__chan_broadcast, bias);
    }
}

MGPU_DEF void mgpu_conv2d_backward(mgpu_tensor *dx, mgpu_tensor *dw, mgpu_tensor *db,
                                   const mgpu_tensor *dy, const mgpu_tensor *x,
                                   const mgpu_tensor *w, int stride, int pad, int accumulate) {
    const char *op = "mgpu_conv2d_backward";
    mgpu__conv_geom g = mgpu__conv_geometry(op, x->shape, w->shape, stride, pad);
    mgpu_device *dev = x->device;
    mgpu__require_device(w, dev, op);
    mgpu__require_device(dy, dev, op);
    mgpu__require_device(dw, dev, op);
    mgpu__require_shape(dy, mgpu_shape4(g.n, g.k, g.p, g.q), op, "output gradient dy");
    mgpu__require_shape(dw, w->shape, op, "weight gradient dw");
    mgpu__require_indexable(x, op);
    mgpu__require_indexable(dy, op);
    if (dx) {
        mgpu__require_device(dx, dev, op);
        mgpu__require_shape(dx, x->shape, op, "input gradient dx");
    }
    if (db) {
        mgpu__require_device(db, dev, op);
        mgpu__require_shape(db, mgpu_shape1(g.k), op, "bias gradient db");
    }
    if (dx) mgpu__before_write(dx);
    if (db) mgpu__before_write(db);
    mgpu__before_write(dw);
    size_t pq = (size_t)g.p * g.q, crs = (size_t)g.c * g.r * g.s, chw = (size_t)g.c * g.h * g.w;
    mgpu__conv_scratch s = mgpu__conv_scratch_new(dev, &g);
    for (int n0 = 0; n0 < g.n; n0 += s.chunk) {
        mgpu__conv_geom part = g;
        part.n = g.n - n0 < s.chunk ? g.n - n0 : s.chunk;
        int cols = part.n * (int)pq;
        /* G [K, n*P*Q] from dy's [n, K, P*Q] */
        mgpu__swap_outer_args there = {s.kout->data, dy->data + (size_t)n0 * g.k * pq, part.n,
                                       g.k, pq};
        MGPU__ENQUEUE(dev, "conv2d_backward", mgpu__swap_outer, there);
        mgpu__im2col_args im = {x->data + (size_t)n0 * chw, s.col->data, part};
        MGPU__ENQUEUE(dev, "conv2d_backward", mgpu__im2col, im);
        /* dW [K, C*R*S] (+)= G col^T; the chunks after the first add to it. */
        float beta = (accumulate || n0 > 0) ? 1.0f : 0.0f;
        mgpu__gemm_args dwp = mgpu__gemm_dense(0, 1, g.k, (int)crs, cols, s.kout->data,
                                               s.col->data, dw->data, beta);
        MGPU__ENQUEUE(dev, "conv2d_backward", mgpu__gemm, dwp);
        if (dx) {
            /* dcol [C*R*S, n*P*Q] = W^T G, into col (no longer needed), then back to pixels. */
            mgpu__gemm_args dcol = mgpu__gemm_dense(1, 0, (int)crs, cols, g.k, w->data,
                                                    s.kout->data, s.col->data, 0.0f);
            MGPU__ENQUEUE(dev, "conv2d_backward", mgpu__gemm, dcol);
            mgpu__col2im_args back = {s.col->data, dx->data + (size_t)n0 * chw, part};
            MGPU__ENQUEUE(dev, "conv2d_backward", mgpu__col2im, back);
        }
    }
    mgpu__conv_scratch_free(&s);
    if (db) {
        float beta = accumulate ? 1.0f : 0.0f;
        mgpu__chan_sum_args sum = {db->data, dy->data, g.n, g.k, pq, 1.0f, beta};
        MGPU__ENQUEUE(dev, "conv2d_backward", mgpu__chan_sum, sum);
    }
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
    mgpu__chan_sum_args a = {y->data, x->data, 1, (int)y->numel, hw, mean, 0.0f};
    mgpu__before_write(y);
    MGPU__ENQUEUE(x->device, "global_avg_pool", mgpu__chan_sum, a);
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

MGPU_DEF void mgpu_add(mgpu_tensor *y, const mgpu_tensor *a, const mgpu_tensor *b) {
    mgpu__require_device(a, y->device, "mgpu_add");
    mgpu__require_device(b, y->device, "mgpu_add");
    mgpu__require_same_shape(a, b, "mgpu_add");
    mgpu__require_same_shape(y, a, "mgpu_add");
    mgpu__add_args args = {y->data, a->data, b->data, y->numel};
    mgpu__before_write(y);
    MGPU__ENQUEUE(y->device, "add", mgpu__add, args);
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
    mgpu__gemm_args prod = mgpu__gemm_dense(0, 0, n, out, in, x->data, w->data, y->data, 0.0f);
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
    mgpu__require_device(dy, dev, op);
    mgpu__require_device(dw, dev, op);
    mgpu__require_shape(dy, mgpu_shape2(n, out), op, "output gradient dy");
    mgpu__require_indexable(dy, op);
    mgpu__require_shape(dw, w->shape, op, "weight gradient dw");
    if (dx) {
        mgpu__require_device(dx, dev, op);
        mgpu__require_shape(dx, x->shape, op, "input gradient dx");
    }
    if (db) {
        mgpu__require_device(db, dev, op);
        mgpu__require_shape(db, mgpu_shape1(out), op, "bias gradient db");
    }
    if (dx) { /* dx [N, in] = dy [N, out] w^T */
        mgpu__gemm_args dxp = mgpu__gemm_dense(0, 1, n, in, out, dy->data, w->data, dx->data, 0.0f);
        mgpu__before_write(dx);
        MGPU__ENQUEUE(dev, "linear_backward", mgpu__gemm, dxp);
    }
    /* dw [in, out] (+)= x^T [in, N] dy [N, out] */
    mgpu__gemm_args dwp = mgpu__gemm_dense(1, 0, in, out, n, x->data, dy->data, dw->data, beta);
    mgpu__before_write(dw);
    MGPU__ENQUEUE(dev, "linear_backward", mgpu__gemm, dwp);
    if (db) {
        mgpu__chan_sum_args sum = {db->data, dy->data, n, out, 1, 1.0f, beta};
        mgpu__before_write(db);
        MGPU__ENQUEUE(dev, "linear_backward", mgpu__chan_sum, sum);
    }
}
