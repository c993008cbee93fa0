/* mgpu/convolution.h: the convolution, and how it is computed. On the
   CPU im2col and a product, oneDNN's, or Winograd's; on a GPU im2col
   with cuBLAS, the implicit GEMMs of kernels/conv_nhwc.h, Winograd, or
   cuDNN, chosen per shape and pass (MGPU_CONV). Scratch is sized per
   device kind. Chapter 2 reads the forward and backward passes; the rest
   is the fast path.
   defines: mgpu_conv2d_output_shape, mgpu_conv2d_forward,
   mgpu_conv2d_backward */
/* ----------------------------------------------------------- convolution */

/* Scratch a convolution may use at once, in floats: the col buffer and
   the output in [K, n*P*Q] order, for a chunk of n images. On a GPU, 256
   MiB: one product should cover as many images as it can (fewer, larger
   products beat chunks small enough to stay in the L2 cache: the sweep
   is in bench/history.md). On
   the CPU, 4 MiB: a chunk whose col buffer stays in the processor's cache between
   im2col and the product is faster than one product over the whole
   batch. Indexed by mgpu_device_is_gpu; variables, so that the tests can
   force many small chunks. */
static size_t mgpu__conv_scratch_floats[2] = {(size_t)1 << 20, (size_t)64 << 20};

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
    MGPU_REQUIRE(x.d[1] >= 1 && x.d[2] >= 1 && x.d[3] >= 1 && w.d[0] >= 1 && w.d[2] >= 1 &&
                     w.d[3] >= 1,
                 "%s: input %s and weight %s must have no empty dimension", op, sx, sw);
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
    mgpu__conv_settings_from_environment();
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

/* y = conv(x, w) + b with im2col and products, a chunk of images at a time. */
static void mgpu__conv_forward_im2col(mgpu_tensor *y, const mgpu_tensor *x, const mgpu_tensor *w,
                                      const mgpu_tensor *b, const mgpu__conv_geom *g, int tf32) {
    mgpu_device *dev = x->device;
    size_t pq = (size_t)g->p * g->q, crs = (size_t)g->c * g->r * g->s;
    mgpu__conv_scratch s = mgpu__conv_scratch_new(dev, g);
    for (int n0 = 0; n0 < g->n; n0 += s.chunk) {
        mgpu__conv_geom part = *g;
        part.n = g->n - n0 < s.chunk ? g->n - n0 : s.chunk;
        int cols = part.n * (int)pq;
        mgpu__im2col_args im = {x->data + (size_t)n0 * g->c * g->h * g->w, s.col->data, part};
        MGPU__ENQUEUE(dev, "conv2d im2col", mgpu__im2col, im);
        /* Y [K, n*P*Q] = W [K, C*R*S] col [C*R*S, n*P*Q] */
        mgpu__gemm_args prod = mgpu__gemm_dense(0, 0, g->k, cols, (int)crs, w->data, s.col->data,
                                                s.kout->data, 0.0f, tf32);
        MGPU__ENQUEUE(dev, "conv2d product", mgpu__gemm, prod);
        /* [K, n, P*Q] -> y's [n, K, P*Q] */
        mgpu__swap_outer_args back = {y->data + (size_t)n0 * g->k * pq, s.kout->data, g->k, part.n,
                                      pq, b ? b->data : NULL};
        MGPU__ENQUEUE(dev, "conv2d layout and bias", mgpu__swap_outer, back);
    }
    mgpu__conv_scratch_free(&s);
}

/* dx and dW, with im2col and products; either may be NULL (not asked
   for), and then its half of the work is left out. accumulate: dW += its
   gradient (else dW = it); add_to_dx: the same for dx. */
static void mgpu__conv_backward_im2col(mgpu_tensor *dx, mgpu_tensor *dw, const mgpu_tensor *dy,
                                       const mgpu_tensor *x, const mgpu_tensor *w,
                                       const mgpu__conv_geom *g, int tf32, int accumulate,
                                       int add_to_dx) {
    mgpu_device *dev = x->device;
    size_t pq = (size_t)g->p * g->q, crs = (size_t)g->c * g->r * g->s, chw = (size_t)g->c * g->h * g->w;
    mgpu__conv_scratch s = mgpu__conv_scratch_new(dev, g);
    for (int n0 = 0; n0 < g->n; n0 += s.chunk) {
        mgpu__conv_geom part = *g;
        part.n = g->n - n0 < s.chunk ? g->n - n0 : s.chunk;
        int cols = part.n * (int)pq;
        /* G [K, n*P*Q] from dy's [n, K, P*Q] */
        mgpu__swap_outer_args there = {s.kout->data, dy->data + (size_t)n0 * g->k * pq, part.n,
                                       g->k, pq, NULL};
        MGPU__ENQUEUE(dev, "conv2d_backward layout", mgpu__swap_outer, there);
        if (dw) {
            mgpu__im2col_args im = {x->data + (size_t)n0 * chw, s.col->data, part};
            MGPU__ENQUEUE(dev, "conv2d_backward im2col", mgpu__im2col, im);
            /* dW [K, C*R*S] (+)= G col^T; the chunks after the first add to it. */
            float beta = (accumulate || n0 > 0) ? 1.0f : 0.0f;
            mgpu__gemm_args dwp = mgpu__gemm_dense(0, 1, g->k, (int)crs, cols, s.kout->data,
                                                   s.col->data, dw->data, beta, tf32);
            MGPU__ENQUEUE(dev, "conv2d_backward dW product", mgpu__gemm, dwp);
        }
        if (dx) {
            /* dcol [C*R*S, n*P*Q] = W^T G, into col (no longer needed), then back to pixels. */
            mgpu__gemm_args dcol = mgpu__gemm_dense(1, 0, (int)crs, cols, g->k, w->data,
                                                    s.kout->data, s.col->data, 0.0f, tf32);
            MGPU__ENQUEUE(dev, "conv2d_backward dcol product", mgpu__gemm, dcol);
            mgpu__col2im_args back = {s.col->data, dx->data + (size_t)n0 * chw, part, add_to_dx};
            MGPU__ENQUEUE(dev, "conv2d_backward col2im", mgpu__col2im, back);
        }
    }
    mgpu__conv_scratch_free(&s);
}

/* What a convolution's caller prepares for it, so that a trial does not
   count it against the channels-last kernels: x's channels-last copy (a
   network's batch norm writes it, or the forward pass kept its own for
   the backward), dy's (batch norm writes it, where both gradients read
   dy only through it), the weights' (a network remakes them all in a
   few launches). The public mgpu_conv2d_* prepare nothing. */
enum { MGPU__PREPARED_X = 1, MGPU__PREPARED_DY = 2, MGPU__PREPARED_W = 4 };

/* The ways a gradient of the backward pass may take (the plan below):
   a kernel that reads the NCHW tensors as they are (conv_few_inputs.h's),
   a channels-last one, or its half of the im2col path. Given each way's time for dx (dx_ms; ignored without dx) and for
   dW (dw_ms), the fastest pair, in *by_dx and *by_dw, and its time. The
   channels-last kernels share one copy of dy, which costs dy_ms, or
   nothing where the caller prepares it (dy_prepared) and they read dy
   only through it: dW by channels-last, and dx too when wanted. */
enum { MGPU__BY_NCHW, MGPU__BY_CHANNELS_LAST, MGPU__BY_IM2COL_HALF, MGPU__WAYS };
static inline double mgpu__conv_backward_ways(const double *dx_ms, const double *dw_ms, double dy_ms,
                                              int dy_prepared, int with_dx, int *by_dx, int *by_dw) {
    double best = HUGE_VAL;
    *by_dx = *by_dw = MGPU__BY_NCHW;
    for (int i = 0; i < (with_dx ? MGPU__WAYS : 1); i++)
        for (int j = 0; j < MGPU__WAYS; j++) {
            int reads_dy_t = (with_dx && i == MGPU__BY_CHANNELS_LAST) || j == MGPU__BY_CHANNELS_LAST;
            int dy_t_only = j == MGPU__BY_CHANNELS_LAST && (!with_dx || i == MGPU__BY_CHANNELS_LAST);
            double copy_ms = reads_dy_t && !(dy_t_only && dy_prepared) ? dy_ms : 0.0;
            double ms = (with_dx ? dx_ms[i] : 0.0) + dw_ms[j] + copy_ms;
            if (ms < best) best = ms, *by_dx = i, *by_dw = j;
        }
    return best;
}

#if MGPU_CUDA
/* The implicit GEMM needs TF32 tensor cores: code compiled for sm_80 or
   newer (a plain `nvcc` without -gencode compiles for an older GPU, and
   kernels/conv_nhwc.h leaves the kernels' bodies out). Asked once (the
   library's GPUs are alike). */
static int mgpu__conv_implicit_available(void) {
    static int available = -1;
    if (available < 0) {
        cudaFuncAttributes f;
        MGPU_CUDA_CHECK(cudaFuncGetAttributes(&f, mgpu__conv_nhwc_kernel<64, 64>));
        available = f.ptxVersion >= 80 && f.binaryVersion >= 80;
        if (!available && mgpu__conv_mode == MGPU__CONV_IMPLICIT)
            fprintf(stderr, "mgpu: MGPU_CONV=implicit needs code built for sm_80 or newer (this is "
                    "sm_%d): using im2col\n", f.ptxVersion);
    }
    return available;
}

/* Which kernel computes a pass. conv_nhwc.h's implicit GEMM (direct),
   from channels-last copies of the tensors, in one of the four tiles,
   its sum split into slices or not, by mma.sync or (sm_90a) by wgmma; at
   stride t > 1, dx by its sub-pixel classes. From the same copies, for
   the forward pass and dx of 3x3 convolutions at stride 1, Winograd
   (winograd.h), and for dx of 3x3 windows at stride 2 and padding 1,
   conv_nhwc.h's kernel that takes a quad of dx's pixels, one of each
   class, at a time (stride-2 dx). And from the NCHW tensors as they are, for
   the forward pass and dW of convolutions with C*R*S <= 9,
   conv_few_inputs.h's kernels (float32), and for every pass, where
   MGPU_CUDNN is built in, cuDNN's algorithms (conv_cudnn.h). Winograd,
   stride-2 dx, few inputs and cuDNN take no tile and no slices. */
typedef enum { MGPU__DIRECT, MGPU__WINOGRAD, MGPU__FEW_INPUTS, MGPU__STRIDE2_DX, MGPU__CUDNN, MGPU__METHODS } mgpu__conv_method;
typedef struct {
    mgpu__conv_method method;
    mgpu__implicit_tile tile;
    int splits; /* slices of the sum, over (r, s, c) in the forward pass and dx (0 or 1:
                   none), over the output pixels in dW (0: the kernel's default) */
    int wgmma;  /* the direct kernel by wgmma (64 x 128 and 128 x 128 tiles) */
#if MGPU_CUDNN
    mgpu__cudnn_algorithm cudnn; /* MGPU__CUDNN: which of cuDNN's algorithms (kernels/conv_cudnn.h) */
#endif
} mgpu__implicit_kernel;
/* A kernel with no cuDNN algorithm (the fields are zero where not given). */
static inline mgpu__implicit_kernel mgpu__kernel_of(mgpu__conv_method method, mgpu__implicit_tile tile, int splits,
                                                    int wgmma) {
    mgpu__implicit_kernel k;
    memset(&k, 0, sizeof k);
    k.method = method;
    k.tile = tile;
    k.splits = splits;
    k.wgmma = wgmma;
    return k;
}
/* Whether kernel k reads the channels-last copies (all but few inputs
   and cuDNN's, which read the NCHW tensors as they are). */
static int mgpu__conv_reads_copies(mgpu__implicit_kernel k) {
    return k.method != MGPU__FEW_INPUTS && k.method != MGPU__CUDNN;
}

/* Scratch of `floats` floats for slices' partial tiles, or NULL for none. */
static mgpu_tensor *mgpu__partials(mgpu_device *dev, size_t floats) {
    return floats ? mgpu_empty(dev, mgpu_shape1((int)floats)) : NULL;
}

/* The shape of a copy's output, [outer, cols, rows]. */
static mgpu_shape mgpu__channels_last_shape(const mgpu__channels_last_to *to) {
    return mgpu_shape3(to->outer, to->cols, to->rows);
}
/* A new tensor, the copy `a` describes (its a.to.out is the new tensor's). */
static mgpu_tensor *mgpu__channels_last_copy_of(mgpu_device *dev, mgpu__channels_last_args a) {
    mgpu_tensor *t = mgpu_empty(dev, mgpu__channels_last_shape(&a.to));
    a.to.out = t->data;
    MGPU__ENQUEUE(dev, "conv2d channels-last copy", mgpu__channels_last, a);
    return t;
}
/* A new tensor [outer, cols, rows], the TF32 copy of in [outer, rows, cols]
   made by kernels/channels_last.h (flip: as there). */
static mgpu_tensor *mgpu__channels_last_copy(mgpu_device *dev, const float *in, int outer, int rows,
                                             int cols, int flip) {
    mgpu__channels_last_args a = {{NULL, outer, rows, cols, flip}, in};
    return mgpu__channels_last_copy_of(dev, a);
}

/* The copy of weights w [K, C, R*S] (k, c, rs given) to w_t [K, RS, C],
   or turned, to w'_t [C, RS flipped, K] (the weights of the input
   gradient's convolution: conv_nhwc.h), into out. */
static mgpu__channels_last_args mgpu__weights_copy(float *out, const float *w, int k, int c, int rs,
                                                   int turned) {
    mgpu__channels_last_args a = {{out, k, c, rs, 0}, w};
    mgpu__channels_last_to turned_to = {out, 1, k, c * rs, rs};
    if (turned) a.to = turned_to;
    return a;
}

/* out = conv(in_t, w) + b by Winograd's F(2x2, 3x3) (kernels/winograd.h),
   in geometry g, from the channels-last copy in_t of the input; turned
   and accumulate as below. */
static void mgpu__conv_winograd(mgpu_device *dev, float *out, const float *in_t, const float *w, const float *b,
                                const mgpu__conv_geom *g, int turned, int accumulate) {
    size_t tiles = mgpu__winograd_tiles(g);
    mgpu_tensor *v = mgpu_empty(dev, mgpu_shape1((int)(16 * tiles * g->c)));
    mgpu_tensor *u = mgpu_empty(dev, mgpu_shape1(16 * g->c * g->k));
    mgpu_tensor *m = mgpu_empty(dev, mgpu_shape1((int)(16 * tiles * g->k)));
    mgpu__winograd_args a = {out, in_t, w, b, v->data, u->data, m->data, *g, turned, accumulate};
    mgpu__launch_on(&dev->queue[0], turned ? "conv2d_backward winograd dx" : "conv2d winograd", NULL,
                    mgpu__winograd_cuda, &a, sizeof a);
    mgpu_free(v); /* (all three reused only by work enqueued after this on the same queue) */
    mgpu_free(u);
    mgpu_free(m);
}
/* The weights' channels-last TF32 copy for a product of geometry g: w_t
   [K, RS, C], or turned, w'_t [C, RS flipped, K] (for_dx: the input
   gradient's; g is then mgpu__conv_dx_geometry's, g->c the weights' K and
   g->k their C). keep_w_t: where the caller keeps it; used if there (the
   caller made it from the weights as they are), else made and left there;
   NULL: made, and in *own, to be freed after use. */
static const float *mgpu__weights_channels_last(mgpu_device *dev, const float *w, mgpu_tensor **keep_w_t,
                                                const mgpu__conv_geom *g, int for_dx, mgpu_tensor **own) {
    *own = NULL;
    if (keep_w_t && *keep_w_t) return (*keep_w_t)->data;
    int rs = g->r * g->s;
    mgpu__channels_last_args copy = for_dx ? mgpu__weights_copy(NULL, w, g->c, g->k, rs, 1)
                                           : mgpu__weights_copy(NULL, w, g->k, g->c, rs, 0);
    mgpu_tensor *w_t = mgpu__channels_last_copy_of(dev, copy);
    if (keep_w_t) *keep_w_t = w_t;
    else *own = w_t;
    return w_t->data;
}
/* out = conv(in_t, w) + b with conv_nhwc.h's kernel, in geometry g, from
   the channels-last copy in_t of the input and the weights' channels-last
   TF32 copy; as w' (turned: flipped, filters and channels swapped) when
   the convolution is the input gradient's (for_dx: in_t is dy's copy, g
   is mgpu__conv_dx_geometry). keep_w_t: as mgpu__weights_channels_last
   says. accumulate: out += the product. */
static void mgpu__conv_channels_last(mgpu_device *dev, float *out, const float *in_t, const float *w,
                                     mgpu_tensor **keep_w_t, const float *b, const mgpu__conv_geom *g,
                                     int for_dx, mgpu__implicit_kernel kernel, int accumulate) {
    if (kernel.method == MGPU__WINOGRAD) { /* (which takes the weights as they are) */
        mgpu__conv_winograd(dev, out, in_t, w, b, g, for_dx, accumulate);
        return;
    }
    mgpu_tensor *own_w_t;
    const float *w_t = mgpu__weights_channels_last(dev, w, keep_w_t, g, for_dx, &own_w_t);
    mgpu_tensor *partials = mgpu__partials(dev, mgpu__conv_nhwc_partial_floats(g, kernel.splits));
    mgpu__nhwc_out plain = {0, 0, 0, 0, 0};
    mgpu__conv_nhwc_args a = {out, in_t, w_t, b, *g, kernel.tile, plain, accumulate, kernel.splits, 0,
                              partials ? partials->data : NULL, kernel.wgmma};
    const char *name = for_dx ? "conv2d_backward channels-last dx" : "conv2d channels-last";
    mgpu__launch_on(&dev->queue[0], name, NULL, mgpu__conv_nhwc_cuda, &a, sizeof a);
    mgpu_free(partials); /* (both reused only by work enqueued after this on the same queue) */
    mgpu_free(own_w_t);
}
/* dy's channels-last copy for the backward kernels: the caller's dy_t
   when it made one for both gradients, else a new one, in *own, to be
   freed after use. */
static const float *mgpu__dy_channels_last(const mgpu_tensor *dy, const mgpu_tensor *dy_t,
                                           const mgpu__conv_geom *g, mgpu_tensor **own) {
    *own = dy_t ? NULL : mgpu__channels_last_copy(dy->device, dy->data, g->n, g->k, g->p * g->q, 0);
    return dy_t ? dy_t->data : (*own)->data;
}

#if MGPU_CUDNN
/* The device's cuDNN handle, made at its first call (the library's
   threads that enqueue work are its callers, one at a time), bound to
   its compute stream. */
static cudnnHandle_t mgpu__cudnn_ready(mgpu_device *dev) {
    mgpu__queue *q = &dev->queue[0];
    MGPU_CUDA_CHECK(cudaSetDevice(dev->gpu));
    if (!q->cudnn) {
        MGPU_CUDNN_CHECK(cudnnCreate(&q->cudnn));
        MGPU_CUDNN_CHECK(cudnnSetStream(q->cudnn, q->stream));
    }
    return q->cudnn;
}
/* Where a trial's cuDNN calls leave a refusal (mgpu__cudnn_args), or
   NULL: outside trials a refusal stops the program. */
static __thread cudnnStatus_t *mgpu__cudnn_trial_refusal;
/* out = (a pass by cuDNN's algorithm) + (add ? out : 0), and the bias b
   (the forward pass, where given); its workspace from dev's allocator.
   in_a and in_b: as mgpu__cudnn_args says. */
static void mgpu__conv_cudnn(mgpu_device *dev, float *out, const float *in_a, const float *in_b, const float *b,
                             const mgpu__conv_geom *g, mgpu__cudnn_pass pass, mgpu__cudnn_algorithm algorithm,
                             int add) {
    static const char *const names[MGPU__CUDNN_PASSES] = {"conv2d cuDNN", "conv2d_backward cuDNN dx",
                                                          "conv2d_backward cuDNN dW"};
    mgpu__cudnn_ready(dev);
    size_t floats = (algorithm.workspace + sizeof(float) - 1) / sizeof(float);
    mgpu_tensor *workspace = floats ? mgpu_empty(dev, mgpu_shape1((int)floats)) : NULL;
    mgpu__cudnn_args a = {out, in_a, in_b, b, workspace ? workspace->data : NULL, *g, pass, algorithm,
                          add ? 1.0f : 0.0f, mgpu__cudnn_trial_refusal};
    mgpu__launch_on(&dev->queue[0], names[pass], NULL, mgpu__conv_cudnn_cuda, &a, sizeof a);
    mgpu_free(workspace); /* (reused only by work enqueued after this on the same queue) */
}
#endif

/* The same with the fast kernels (TF32 but few inputs), no col buffers,
   each pass by the given kernel; from x_t and dy_t, the channels-last
   copies of x and dy, where the caller has them (else NULL). A channels-last forward
   without x_t makes the copy, and leaves it in *keep_x_t when the caller
   gives one (a network keeps it for the weight gradient, which needs the
   same copy), else frees it. */
static void mgpu__conv_forward_implicit(mgpu_tensor *y, const mgpu_tensor *x, const mgpu_tensor *x_t,
                                        const mgpu_tensor *w, mgpu_tensor **keep_w_t, const mgpu_tensor *b,
                                        const mgpu__conv_geom *g, mgpu__implicit_kernel kernel,
                                        mgpu_tensor **keep_x_t) {
    mgpu_device *dev = x->device;
#if MGPU_CUDNN
    if (kernel.method == MGPU__CUDNN) {
        mgpu__conv_cudnn(dev, y->data, x->data, w->data, b ? b->data : NULL, g, MGPU__CUDNN_Y, kernel.cudnn, 0);
        return;
    }
#endif
    if (kernel.method == MGPU__FEW_INPUTS) {
        mgpu__conv_few_inputs_args a = {y->data, x->data, w->data, b ? b->data : NULL, *g};
        mgpu__launch_on(&dev->queue[0], "conv2d few inputs", NULL, mgpu__conv_few_inputs_cuda, &a, sizeof a);
        return;
    }
    mgpu_tensor *own = x_t ? NULL : mgpu__channels_last_copy(dev, x->data, g->n, g->c, g->h * g->w, 0);
    mgpu__conv_channels_last(dev, y->data, (x_t ? x_t : own)->data, w->data, keep_w_t, b ? b->data : NULL, g, 0,
                             kernel, 0);
    if (keep_x_t) *keep_x_t = own;
    else mgpu_free(own);
}
static void mgpu__conv_dx_implicit(mgpu_tensor *dx, const mgpu_tensor *dy, const mgpu_tensor *dy_t,
                                   const mgpu_tensor *w, mgpu_tensor **keep_w_t, const mgpu__conv_geom *g,
                                   mgpu__implicit_kernel kernel, int add_to_dx) {
    mgpu_device *dev = dx->device;
#if MGPU_CUDNN
    if (kernel.method == MGPU__CUDNN) {
        mgpu__conv_cudnn(dev, dx->data, w->data, dy->data, NULL, g, MGPU__CUDNN_DX, kernel.cudnn, add_to_dx);
        return;
    }
#endif
    mgpu_tensor *own;
    const float *dy_cl = mgpu__dy_channels_last(dy, dy_t, g, &own);
    if (g->stride == 1) {
        mgpu__conv_geom d = mgpu__conv_dx_geometry(g);
        mgpu__conv_channels_last(dev, dx->data, dy_cl, w->data, keep_w_t, NULL, &d, 1, kernel, add_to_dx);
    } else if (kernel.method == MGPU__STRIDE2_DX) { /* from the turned weights, as at stride 1 */
        mgpu__conv_geom d = mgpu__conv_dx_geometry(g);
        mgpu_tensor *own_w_t;
        const float *w_t = mgpu__weights_channels_last(dev, w->data, keep_w_t, &d, 1, &own_w_t);
        mgpu__conv_nhwc_stride2_dx_args a = {dx->data, dy_cl, w_t, *g, add_to_dx};
        mgpu__launch_on(&dev->queue[0], "conv2d_backward channels-last stride-2 dx", NULL, mgpu__conv_nhwc_stride2_dx_cuda,
                        &a, sizeof a);
        mgpu_free(own_w_t); /* (reused only by work enqueued after this on the same queue) */
    } else { /* the sub-pixel classes, each with its taps of w */
        mgpu_tensor *w_classes = mgpu_empty(dev, mgpu_shape1((int)mgpu__conv_nhwc_subpixel_weight_floats(g)));
        mgpu_tensor *partials = mgpu__partials(dev, mgpu__conv_nhwc_subpixel_partial_floats(g, kernel.splits));
        mgpu__conv_nhwc_subpixel_args a = {dx->data,   dy_cl,        w->data,       w_classes->data,
                                           *g,         kernel.tile,  add_to_dx,     kernel.splits,
                                           partials ? partials->data : NULL,        kernel.wgmma};
        mgpu__launch_on(&dev->queue[0], "conv2d_backward channels-last dx", NULL, mgpu__conv_nhwc_subpixel_cuda, &a,
                        sizeof a);
        mgpu_free(partials); /* (both reused only by work enqueued after this on the same queue) */
        mgpu_free(w_classes);
    }
    mgpu_free(own);
}
/* x_t: x's channels-last copy, if the forward pass kept one (else NULL). */
static void mgpu__conv_dw_implicit(mgpu_tensor *dw, const mgpu_tensor *dy, const mgpu_tensor *dy_t,
                                   const mgpu_tensor *x, const mgpu_tensor *x_t, const mgpu__conv_geom *g,
                                   int accumulate, mgpu__implicit_kernel kernel) {
    mgpu_device *dev = x->device;
    size_t crs = (size_t)g->c * g->r * g->s;
#if MGPU_CUDNN
    if (kernel.method == MGPU__CUDNN) {
        mgpu__conv_cudnn(dev, dw->data, x->data, dy->data, NULL, g, MGPU__CUDNN_DW, kernel.cudnn, accumulate);
        return;
    }
#endif
    if (kernel.method == MGPU__FEW_INPUTS) {
        mgpu__conv_few_inputs_wgrad_args a = {dw->data, dy->data, x->data, NULL, accumulate ? 1.0f : 0.0f,
                                              mgpu__conv_few_inputs_slices(g), *g};
        mgpu_tensor *partials = mgpu_empty(dev, mgpu_shape1(a.slices * g->k * (int)crs));
        a.partials = partials->data;
        mgpu__launch_on(&dev->queue[0], "conv2d_backward few inputs dW", NULL, mgpu__conv_few_inputs_wgrad_cuda,
                        &a, sizeof a);
        mgpu_free(partials); /* reused only by work enqueued after this on the same queue */
        return;
    }
    mgpu_tensor *own, *own_x_t = NULL; /* from channels-last copies of dy and x */
    const float *dy_cl = mgpu__dy_channels_last(dy, dy_t, g, &own);
    if (!x_t) x_t = own_x_t = mgpu__channels_last_copy(dev, x->data, g->n, g->c, g->h * g->w, 0);
    mgpu__conv_nhwc_dw_args a = {dw->data, NULL, dy_cl, x_t->data, accumulate ? 1.0f : 0.0f, kernel.splits, 0, *g,
                                 kernel.tile};
    mgpu__conv_nhwc_dw_slices(&a);
    mgpu_tensor *partials = mgpu_empty(dev, mgpu_shape1(a.splits * g->k * (int)crs));
    a.partials = partials->data;
    mgpu__launch_on(&dev->queue[0], "conv2d_backward channels-last dW", NULL, mgpu__conv_nhwc_dw_cuda, &a, sizeof a);
    mgpu_free(partials); /* (all three reused only by work enqueued after this on the same queue) */
    mgpu_free(own_x_t);
    mgpu_free(own);
}

/* How a convolution's pass runs. The forward pass: with im2col, or with
   an implicit GEMM (implicit, kernel y). The backward pass: with conv.h's
   im2col path for both gradients at once (they share its dy in [K,
   n*P*Q] and its col buffer), or (implicit) each gradient on its own,
   with a fast kernel (kernels dx and dw) or with its half of the im2col
   path (dx_im2col, dw_im2col): at ResNet-18's last stage, im2col's dW
   half can beat the channels-last dW where its dx does not. */
typedef struct {
    int implicit, dx_im2col, dw_im2col;
    mgpu__implicit_kernel y, dx, dw;
} mgpu__conv_plan;

/* The plans measured so far, one for each shape and pass (measured for
   what the first caller with the shape prepares, MGPU__PREPARED_*: in
   ResNet-18 the convolutions of one shape are prepared alike). */
typedef struct {
    mgpu__conv_geom g;
    int backward, with_dx;
    mgpu__conv_plan plan;
} mgpu__conv_choice;
static mgpu__conv_choice mgpu__conv_choices[256];
static int mgpu__conv_choice_count;

/* What a trial runs: a pass (on the pass's own tensors for the forward,
   on scratch gradients for the backward, so that measuring never adds to
   a real gradient), with im2col or with one of the implicit GEMMs; the
   channels-last kernels from copies made before (x_t .. w_turned_t),
   whose cost is counted apart, where the caller does not prepare them. */
typedef struct {
    mgpu_tensor *y, *dx, *dw;
    const mgpu_tensor *x, *w, *b, *dy;
    const mgpu__conv_geom *g;
    int backward, prepared; /* prepared: MGPU__PREPARED_* */
    mgpu_tensor *x_t, *dy_t, *w_t, *w_turned_t;
} mgpu__conv_trial;
typedef enum {
    MGPU__TRY_IM2COL, MGPU__TRY_IM2COL_DX, MGPU__TRY_IM2COL_DW, MGPU__TRY_Y, MGPU__TRY_DX, MGPU__TRY_DW
} mgpu__conv_try;

/* One timed call, synchronised before and after, so that it measures this
   call alone (other queues of the same GPU may still add noise: the best
   of three counts). */
static double mgpu__conv_trial_ms(mgpu__conv_trial *t, mgpu__conv_try what, mgpu__implicit_kernel kernel) {
    mgpu_device *dev = t->x->device;
#if MGPU_CUDNN
    cudnnStatus_t refused = CUDNN_STATUS_SUCCESS; /* a cuDNN algorithm that refused the shape: not a candidate */
    mgpu__cudnn_trial_refusal = &refused;
#endif
    mgpu_synchronize(dev);
    double t0 = mgpu_now();
    switch (what) {
    case MGPU__TRY_IM2COL:
        if (t->backward) mgpu__conv_backward_im2col(t->dx, t->dw, t->dy, t->x, t->w, t->g, 1, 0, 0);
        else mgpu__conv_forward_im2col(t->y, t->x, t->w, t->b, t->g, 1);
        break;
    case MGPU__TRY_IM2COL_DX: mgpu__conv_backward_im2col(t->dx, NULL, t->dy, t->x, t->w, t->g, 1, 0, 0); break;
    case MGPU__TRY_IM2COL_DW: mgpu__conv_backward_im2col(NULL, t->dw, t->dy, t->x, t->w, t->g, 1, 0, 0); break;
    case MGPU__TRY_Y:
        mgpu__conv_forward_implicit(t->y, t->x, t->x_t, t->w, &t->w_t, t->b, t->g, kernel, NULL);
        break;
    case MGPU__TRY_DX:
        mgpu__conv_dx_implicit(t->dx, t->dy, t->dy_t, t->w, &t->w_turned_t, t->g, kernel, 0);
        break;
    case MGPU__TRY_DW: mgpu__conv_dw_implicit(t->dw, t->dy, t->dy_t, t->x, t->x_t, t->g, 0, kernel); break;
    }
    mgpu_synchronize(dev);
    double ms = (mgpu_now() - t0) * 1e3;
#if MGPU_CUDNN
    mgpu__cudnn_trial_refusal = NULL;
    if (refused != CUDNN_STATUS_SUCCESS) return HUGE_VAL;
#endif
    return ms;
}

/* Whether conv_nhwc.h's direct kernel computes a pass of this
   convolution: the forward pass and dx when the channels come in whole
   steps (dx at stride t > 1 also when its sub-pixel classes share a
   padding), and dW when channels and filters come in fours. */
static int mgpu__conv_channels_last_fits(mgpu__conv_try what, const mgpu__conv_geom *g) {
    return what == MGPU__TRY_Y    ? mgpu__conv_nhwc_fits(g)
           : what == MGPU__TRY_DX ? mgpu__conv_nhwc_dx_fits(g)
                                  : what == MGPU__TRY_DW && mgpu__conv_nhwc_dw_fits(g);
}

/* Whether dev runs the wgmma kernels, asked or not (the tests). */
static int mgpu__wgmma_runs(mgpu_device *dev) {
    static int known[MGPU_MAX_DEVICES]; /* per GPU: 0 not asked yet, 1 no, 2 yes */
    if (dev->gpu < 0 || dev->gpu >= MGPU_MAX_DEVICES) return 0;
    if (!known[dev->gpu]) {
        int major, minor;
        MGPU_CUDA_CHECK(cudaSetDevice(dev->gpu));
        MGPU_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev->gpu));
        MGPU_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev->gpu));
        known[dev->gpu] = major == 9 && minor == 0 && mgpu__wgmma_built(dev->queue[0].stream) ? 2 : 1;
    }
    return known[dev->gpu] == 2;
}
/* Whether a trial on dev times the wgmma kernels (conv_nhwc.h): unless
   MGPU_WGMMA=0, on a GPU of compute capability 9.0 whose code has
   them (nvcc built it for sm_90a; asked once a GPU). */
static int mgpu__wgmma_usable(mgpu_device *dev) {
    mgpu__conv_settings_from_environment();
    return mgpu__conv_wgmma_asked && mgpu__wgmma_runs(dev);
}

/* The slices the channels-last forward and dx are tried in (conv_nhwc.h).
   Not only powers of 2: what counts is how full the last wave of blocks
   is. ResNet-18's stage 4 (256 tiles of 64 x 128, 396 places for them on
   an H100) fills 0.65 of a wave whole, 1.3 waves in 2 slices, 1.94 in 3. */
static const int mgpu__conv_slice_choices[] = {1, 2, 3, 4, 6, 8};
/* The channels-last dW is tried in the slices of its pixels that make
   about this many blocks (its default: 512). Stage 4 again: 288 tiles of
   64 x 128 for 264 places (2 a multiprocessor: three steps in flight
   take more shared memory), 2.18 waves in its default 2 slices. */
static const int mgpu__conv_dw_block_choices[] = {256, 384, 512, 768, 1024, 1536};
#define MGPU__KERNEL_CHOICES 6 /* the length of both lists */
static_assert(sizeof mgpu__conv_slice_choices == MGPU__KERNEL_CHOICES * sizeof(int) &&
                  sizeof mgpu__conv_dw_block_choices == MGPU__KERNEL_CHOICES * sizeof(int),
              "a choice of each kind for each i");
/* Choice i (0 .. MGPU__KERNEL_CHOICES - 1) of the direct kernel in a
   tile for a pass (`what`) of geometry g, in *k; returns whether the
   trial times it: the forward pass and dx in mgpu__conv_slice_choices[i]
   slices of their sum, where every slice keeps at least 8 steps of 32
   (dx at stride t in t^2 classes, each with about 1 / t^2 of the taps)
   and the partials (all the classes', which run at once) fit in
   MGPU__PARTIAL_FLOATS_MAX (as dW's); dW in the slices for
   mgpu__conv_dw_block_choices[i] blocks, where they differ from choice
   i - 1's. With wgmma, the forward pass and dx by the wgmma kernels, in
   their tiles, as those by mma.sync. */
static int mgpu__conv_kernel_choice(mgpu__conv_try what, const mgpu__conv_geom *g, mgpu__implicit_tile tile,
                                    int wgmma, int i, mgpu__implicit_kernel *k) {
    mgpu__implicit_kernel kernel = mgpu__kernel_of(MGPU__DIRECT, tile, 1, wgmma);
    *k = kernel;
    if (wgmma && (what == MGPU__TRY_DW || !mgpu__wgmma_tile_fits(tile))) return 0;
    if (!mgpu__conv_channels_last_fits(what, g)) return 0;
    if (what == MGPU__TRY_DW) {
        k->splits = mgpu__conv_nhwc_dw_splits(g, tile, mgpu__conv_dw_block_choices[i]);
        return i == 0 || k->splits != mgpu__conv_nhwc_dw_splits(g, tile, mgpu__conv_dw_block_choices[i - 1]);
    }
    k->splits = mgpu__conv_slice_choices[i];
    int products = what == MGPU__TRY_DX ? g->stride * g->stride : 1;
    int terms = (what == MGPU__TRY_Y ? g->c : g->k) * g->r * g->s / products;
    size_t partials = what == MGPU__TRY_Y ? mgpu__conv_nhwc_partial_floats(g, k->splits)
                                          : mgpu__conv_nhwc_dx_partial_floats(g, k->splits);
    return i == 0 || (terms / MGPU__NHWC_STEP / k->splits >= 8 && partials <= MGPU__PARTIAL_FLOATS_MAX);
}
/* The geometry of the convolution a channels-last forward pass or dx
   computes: g's, or at stride 1 dx's (conv_nhwc.h). */
static mgpu__conv_geom mgpu__conv_pass_geometry(mgpu__conv_try what, const mgpu__conv_geom *g) {
    return what == MGPU__TRY_DX ? mgpu__conv_dx_geometry(g) : *g;
}
/* Whether Winograd computes a pass of geometry g from the channels-last
   copies: the forward pass or dx of a 3x3 convolution at stride 1. */
static int mgpu__conv_winograd_fits(mgpu__conv_try what, const mgpu__conv_geom *g) {
    if (what == MGPU__TRY_DW || g->stride != 1) return 0;
    if (!mgpu__conv_channels_last_fits(what, g)) return 0; /* (it reads their copies) */
    mgpu__conv_geom d = mgpu__conv_pass_geometry(what, g);
    return mgpu__winograd_fits(&d);
}
/* Whether the trial tries Winograd where it fits: where the channels and
   filters are many. Per output pixel it saves 20/36 of 18 C K multiplies
   and adds, 10 C K FLOPs, and writes and reads V and M, 16/4 (C + K)
   floats each way, 32 (C + K) bytes more. With C = K that is 0.16 C
   FLOPs saved a byte moved, against the 40 or so that the direct
   kernel's pace over memory's bandwidth asks on an H100 (the figures:
   bench/history.md): C of 256 or more, ResNet-18's stages 3 and 4.
   (Elsewhere the trial would only lose time, and stage 1's V and M, 200
   MB each, would count in the first device's peak memory.) */
static int mgpu__conv_winograd_worth_trying(const mgpu__conv_geom *g) { return g->c >= 256 && g->k >= 256; }
/* Whether conv_nhwc.h's stride-2 dx kernel computes a pass of geometry
   g: dx at stride 2 of a 3x3 window with padding 1, where it fits. */
static int mgpu__conv_stride2_dx_fits(mgpu__conv_try what, const mgpu__conv_geom *g) {
    return what == MGPU__TRY_DX && mgpu__conv_nhwc_stride2_dx_fits(g);
}
/* Whether a method computes a pass of geometry g (the direct kernel: in
   some tile; cuDNN's algorithms are asked apart, mgpu__conv_cudnn_candidates). */
static int mgpu__conv_method_fits(mgpu__conv_method method, mgpu__conv_try what, const mgpu__conv_geom *g) {
    return method == MGPU__CUDNN          ? 0
           : method == MGPU__WINOGRAD     ? mgpu__conv_winograd_fits(what, g)
           : method == MGPU__FEW_INPUTS ? what != MGPU__TRY_DX && mgpu__conv_few_inputs_fits(g)
           : method == MGPU__STRIDE2_DX ? mgpu__conv_stride2_dx_fits(what, g)
                                        : mgpu__conv_channels_last_fits(what, g);
}
/* The kernels a trial times for a pass, into list; returns how many:
   the direct kernel's in every tile and choice that fits, by mma.sync
   and with wgmma (mgpu__wgmma_usable) by wgmma too; Winograd where it is
   worth trying, and conv_few_inputs.h's and the stride-2 dx kernel where
   they fit (the methods other than the direct kernel, one each). */
#define MGPU__CANDIDATES (2 * (int)MGPU__TILE_KINDS * MGPU__KERNEL_CHOICES + (int)MGPU__METHODS - 2)
static int mgpu__conv_candidates(mgpu__conv_try what, const mgpu__conv_geom *g, int wgmma,
                                 mgpu__implicit_kernel *list) {
    int count = 0;
    for (int by_wgmma = 0; by_wgmma <= wgmma; by_wgmma++)
        for (int t = 0; t < MGPU__TILE_KINDS; t++)
            for (int i = 0; i < MGPU__KERNEL_CHOICES; i++)
                count += mgpu__conv_kernel_choice(what, g, (mgpu__implicit_tile)t, by_wgmma, i, &list[count]);
    for (int m = MGPU__DIRECT + 1; m < MGPU__METHODS; m++) {
        mgpu__implicit_kernel k = mgpu__kernel_of((mgpu__conv_method)m, MGPU__TILE_64x64, 1, 0);
        if (mgpu__conv_method_fits(k.method, what, g) &&
            (k.method != MGPU__WINOGRAD || mgpu__conv_winograd_worth_trying(g)))
            list[count++] = k;
    }
    return count;
}

/* cuDNN's algorithms for a pass on dev, into list (at most
   MGPU__CUDNN_MAX_ALGORITHMS); returns how many (none without cuDNN). */
#if MGPU_CUDNN
#define MGPU__CUDNN_CANDIDATES MGPU__CUDNN_MAX_ALGORITHMS
/* cuDNN's name for a trial's pass. */
static mgpu__cudnn_pass mgpu__cudnn_pass_of(mgpu__conv_try what) {
    return what == MGPU__TRY_Y ? MGPU__CUDNN_Y : what == MGPU__TRY_DX ? MGPU__CUDNN_DX : MGPU__CUDNN_DW;
}
static int mgpu__conv_cudnn_candidates(mgpu_device *dev, mgpu__conv_try what, const mgpu__conv_geom *g,
                                       mgpu__implicit_kernel *list) {
    mgpu__cudnn_algorithm algorithms[MGPU__CUDNN_MAX_ALGORITHMS];
    int count = mgpu__cudnn_algorithms(mgpu__cudnn_ready(dev), mgpu__cudnn_pass_of(what), g, 1, algorithms);
    for (int i = 0; i < count; i++) {
        list[i] = mgpu__kernel_of(MGPU__CUDNN, MGPU__TILE_64x64, 1, 0);
        list[i].cudnn = algorithms[i];
    }
    return count;
}
#else
#define MGPU__CUDNN_CANDIDATES 0
static int mgpu__conv_cudnn_candidates(mgpu_device *dev, mgpu__conv_try what, const mgpu__conv_geom *g,
                                       mgpu__implicit_kernel *list) {
    (void)dev, (void)what, (void)g, (void)list;
    return 0;
}
#endif

/* Whether dx of geometry g may read the weights' turned channels-last
   copy (w'_t): at stride 1 (the direct kernel), and where the stride-2 dx kernel fits;
   the sub-pixel classes take their own taps. And whether kernel k, for
   pass `what`, reads the weights' copy (Winograd, few inputs and cuDNN
   take the weights as they are). */
static int mgpu__conv_dx_reads_turned_weights(const mgpu__conv_geom *g) {
    return g->stride == 1 || mgpu__conv_nhwc_stride2_dx_fits(g);
}
static int mgpu__conv_reads_weights_copy(mgpu__conv_try what, const mgpu__conv_geom *g, mgpu__implicit_kernel k) {
    if (k.method == MGPU__FEW_INPUTS || k.method == MGPU__WINOGRAD || k.method == MGPU__CUDNN) return 0;
    return what != MGPU__TRY_DX || g->stride == 1 || k.method == MGPU__STRIDE2_DX;
}

/* The fastest kernel for one pass (`what`) among those that read the
   channels-last copies, or (channels_last 0) the NCHW tensors, in
   *kernel, and its time (HUGE_VAL, *kernel untouched, if none fits): the
   best of three calls of each candidate, the candidates taking turns, so
   that a GPU clock still rising favours none; each one that reads the
   weights' channels-last copy charged w_copy_ms for it (Winograd takes
   the weights as they are, the sub-pixel classes their own taps). */
static double mgpu__conv_fastest_kernel(mgpu__conv_trial *t, mgpu__conv_try what, int channels_last,
                                        double w_copy_ms, mgpu__implicit_kernel *kernel) {
    mgpu__implicit_kernel candidates[MGPU__CANDIDATES + MGPU__CUDNN_CANDIDATES];
    double best[MGPU__CANDIDATES + MGPU__CUDNN_CANDIDATES], fastest = HUGE_VAL;
    mgpu_device *dev = t->x->device;
    int count = 0, fits = mgpu__conv_candidates(what, t->g, mgpu__wgmma_usable(dev), candidates);
    fits += mgpu__conv_cudnn_candidates(dev, what, t->g, candidates + fits);
    for (int i = 0; i < fits; i++)
        if (mgpu__conv_reads_copies(candidates[i]) == channels_last &&
            (mgpu__conv_mode != MGPU__CONV_CUDNN || candidates[i].method == MGPU__CUDNN))
            candidates[count++] = candidates[i];
    for (int i = 0; i < count; i++) best[i] = HUGE_VAL;
    for (int round = 0; round < 3; round++)
        for (int i = 0; i < count; i++) {
            double ms = mgpu__conv_trial_ms(t, what, candidates[i]);
            if (mgpu__conv_reads_weights_copy(what, t->g, candidates[i])) ms += w_copy_ms;
            if (ms < best[i]) best[i] = ms;
            if (round == 2 && best[i] < fastest) { /* the last round: all three are in */
                fastest = best[i];
                *kernel = candidates[i];
            }
        }
    return fastest;
}
/* The best of three calls of an im2col pass (`what`: the forward pass,
   the whole backward pass, or one gradient's half of it). */
static double mgpu__conv_im2col_ms(mgpu__conv_trial *t, mgpu__conv_try what) {
    mgpu__implicit_kernel none = mgpu__kernel_of(MGPU__DIRECT, MGPU__TILE_64x64, 1, 0); /* (im2col takes no kernel) */
    double best = HUGE_VAL;
    for (int round = 0; round < 3; round++) {
        double ms = mgpu__conv_trial_ms(t, what, none);
        if (ms < best) best = ms;
    }
    return best;
}

/* A measured plan in words, for the benchmarks and tests: the shape, and
   each pass's kernel (tile, slices of the sum) or im2col. */
static inline void mgpu__conv_kernel_str(char *out, size_t size, mgpu__implicit_kernel k, mgpu__conv_try what) {
#if MGPU_CUDNN
    if (k.method == MGPU__CUDNN) {
        snprintf(out, size, "cuDNN %s%s", mgpu__cudnn_algorithm_name(mgpu__cudnn_pass_of(what), k.cudnn.algo),
                 k.cudnn.math == CUDNN_FMA_MATH ? " (float32)" : "");
        return;
    }
#endif
    (void)what;
    if (k.method != MGPU__DIRECT) {
        snprintf(out, size, "%s", k.method == MGPU__WINOGRAD ? "channels-last Winograd"
                                  : k.method == MGPU__STRIDE2_DX  ? "channels-last stride-2 dx"
                                                             : "few inputs");
        return;
    }
    snprintf(out, size, "channels-last %s%s", mgpu__implicit_tile_names[k.tile], k.wgmma ? " wgmma" : "");
    if (k.splits > 1) snprintf(out + strlen(out), size - strlen(out), " in %d slices", k.splits);
}
static inline const char *mgpu__conv_choice_str(const mgpu__conv_choice *c, char *out, size_t size) {
    const mgpu__conv_geom *g = &c->g;
    const mgpu__conv_plan *p = &c->plan;
    char y[48], dx[48], dw[48];
    mgpu__conv_kernel_str(y, sizeof y, p->y, MGPU__TRY_Y);
    mgpu__conv_kernel_str(dx, sizeof dx, p->dx, MGPU__TRY_DX);
    mgpu__conv_kernel_str(dw, sizeof dw, p->dw, MGPU__TRY_DW);
    int at = snprintf(out, size, "%dx%d, %d -> %d, stride %d, %d x %dx%d: ", g->r, g->s, g->c, g->k, g->stride,
                      g->n, g->h, g->w);
    if (!c->backward) snprintf(out + at, size - at, "forward by %s", p->implicit ? y : "im2col");
    else if (!p->implicit) snprintf(out + at, size - at, "backward by im2col");
    else
        snprintf(out + at, size - at, "dx by %s, dW by %s", !c->with_dx ? "-" : p->dx_im2col ? "im2col" : dx,
                 p->dw_im2col ? "im2col" : dw);
    return out;
}

/* How a convolution's pass (forward, or backward with or without dx)
   runs: im2col without TF32 or on a CPU; else as MGPU_CONV says, the
   implicit GEMMs in the fastest tiles for the shape, and with auto only
   where they beat im2col: in the backward pass each gradient by the
   faster of its implicit GEMM and its half of the im2col path, unless the
   whole im2col path is faster than the two. Measured at the pass's first call with a shape,
   then remembered (not thread-safe: the chapters enqueue their
   convolutions from one thread). */
/* Whether a convolution on dev may take an implicit GEMM. */
static int mgpu__conv_implicit_allowed(const mgpu_device *dev) {
    mgpu__conv_settings_from_environment();
    return mgpu__tf32_allowed(MGPU__TF32_CONV) && mgpu_device_is_gpu(dev) &&
           mgpu__conv_mode != MGPU__CONV_IM2COL && mgpu__conv_implicit_available();
}
/* The plan measured for this pass and shape, or NULL if none was yet. */
static const mgpu__conv_plan *mgpu__conv_plan_known(const mgpu__conv_geom *g, int backward, int with_dx) {
    for (int i = 0; i < mgpu__conv_choice_count; i++) {
        const mgpu__conv_choice *c = &mgpu__conv_choices[i];
        if (!memcmp(&c->g, g, sizeof c->g) && c->backward == backward && c->with_dx == with_dx)
            return &c->plan;
    }
    return NULL;
}
static void mgpu__conv_plan_remember(const mgpu__conv_geom *g, int backward, int with_dx, mgpu__conv_plan plan) {
    if (mgpu__conv_choice_count < (int)(sizeof mgpu__conv_choices / sizeof mgpu__conv_choices[0])) {
        mgpu__conv_choice c = {*g, backward, with_dx, plan};
        mgpu__conv_choices[mgpu__conv_choice_count++] = c;
    }
}
/* Whether a pass by plan p reads the input x (forward), or the output
   gradient dy (backward), only through its channels-last copy: then a
   network's batch norm writes that copy itself (kernels/batchnorm.h) and
   the convolution makes none. The forward reads x_t for y; the backward
   dy_t for dW and for dx when wanted, and plain dy for the bias gradient
   when wanted (with_db). */
static int mgpu__conv_plan_reads_x_t(const mgpu__conv_plan *p) {
    return p && p->implicit && mgpu__conv_reads_copies(p->y);
}
static int mgpu__conv_plan_dw_reads_x_t(const mgpu__conv_plan *p) {
    return p && p->implicit && !p->dw_im2col && mgpu__conv_reads_copies(p->dw);
}
static int mgpu__conv_plan_reads_dy_t_only(const mgpu__conv_plan *p, int with_dx, int with_db) {
    return p && p->implicit && !with_db && !p->dw_im2col && mgpu__conv_reads_copies(p->dw) &&
           (!with_dx || (!p->dx_im2col && mgpu__conv_reads_copies(p->dx)));
}

/* A trial's copies for the channels-last kernels: made before the
   kernels are timed, each timed apart (the best of three makes), and
   counted 0 where the caller prepares it (dy: where the channels-last
   kernels read dy only through it; dy_prepared says whether it is). */
typedef struct {
    double x, dy, w, w_turned;
    int dy_prepared;
} mgpu__conv_copies_ms;
static mgpu_tensor *mgpu__conv_timed_copy(mgpu_device *dev, mgpu__channels_last_args a, double *ms) {
    mgpu_tensor *copy = mgpu_empty(dev, mgpu__channels_last_shape(&a.to));
    a.to.out = copy->data;
    *ms = HUGE_VAL;
    for (int round = 0; round < 3; round++) {
        mgpu_synchronize(dev);
        double t0 = mgpu_now();
        MGPU__ENQUEUE(dev, "conv2d channels-last copy", mgpu__channels_last, a);
        mgpu_synchronize(dev);
        double elapsed = (mgpu_now() - t0) * 1e3;
        if (elapsed < *ms) *ms = elapsed;
    }
    return copy;
}
static void mgpu__conv_trial_copies(mgpu__conv_trial *t, mgpu__conv_copies_ms *ms) {
    const mgpu__conv_geom *g = t->g;
    mgpu_device *dev = t->x->device;
    int y = !t->backward && mgpu__conv_channels_last_fits(MGPU__TRY_Y, g);
    int dx = t->backward && t->dx && mgpu__conv_channels_last_fits(MGPU__TRY_DX, g);
    int dw = t->backward && mgpu__conv_channels_last_fits(MGPU__TRY_DW, g);
    double unused;
    memset(ms, 0, sizeof *ms);
    t->x_t = t->dy_t = t->w_t = t->w_turned_t = NULL;
    if (y || dw) {
        mgpu__channels_last_args x = {{NULL, g->n, g->c, g->h * g->w, 0}, t->x->data};
        t->x_t = mgpu__conv_timed_copy(dev, x, t->prepared & MGPU__PREPARED_X ? &unused : &ms->x);
    }
    if (dx || dw) {
        mgpu__channels_last_args dy = {{NULL, g->n, g->k, g->p * g->q, 0}, t->dy->data};
        t->dy_t = mgpu__conv_timed_copy(dev, dy, &ms->dy);
        ms->dy_prepared = (t->prepared & MGPU__PREPARED_DY) != 0;
    }
    double *w_ms = t->prepared & MGPU__PREPARED_W ? &unused : &ms->w;
    double *w_turned_ms = t->prepared & MGPU__PREPARED_W ? &unused : &ms->w_turned;
    int rs = g->r * g->s;
    if (y) t->w_t = mgpu__conv_timed_copy(dev, mgpu__weights_copy(NULL, t->w->data, g->k, g->c, rs, 0), w_ms);
    if (dx && mgpu__conv_dx_reads_turned_weights(g)) /* (the sub-pixel classes take their own taps) */
        t->w_turned_t = mgpu__conv_timed_copy(dev, mgpu__weights_copy(NULL, t->w->data, g->k, g->c, rs, 1),
                                              w_turned_ms);
}

/* The plan by rule (MGPU_CONV=rule, the default), fixed for a shape and
   a kind of GPU so that the same run computes the same bits every time.
   It is what the timed trials chose for most of ResNet-18's shapes on an
   H200 (bench/RESULTS.md, "the rule's sources"): a first layer on
   few inputs by conv_few_inputs.h; the direct kernel in its 64 x 128 tile
   (by wgmma where the GPU has it), the forward pass and dx in one slice,
   dW in its default slices; dx of 3x3 windows at stride 2 by quads; and
   im2col where the output has 4 x 4 pixels or fewer (stage 4, where im2col
   won every pass but one) or where no kernel fits. */
/* The rule's direct kernel for the forward pass or dx, in *k: the 64 x
   128 tile in one slice, by wgmma where the GPU has it and the pass fits
   it, else by mma.sync; 0 where neither fits. */
static int mgpu__conv_rule_direct(mgpu__conv_try what, const mgpu__conv_geom *g, int wgmma,
                                  mgpu__implicit_kernel *k) {
    return (wgmma && mgpu__conv_kernel_choice(what, g, MGPU__TILE_64x128, 1, 0, k)) ||
           mgpu__conv_kernel_choice(what, g, MGPU__TILE_64x128, 0, 0, k);
}
static mgpu__conv_plan mgpu__conv_plan_by_rule(mgpu_device *dev, const mgpu__conv_geom *g, int backward,
                                               int with_dx) {
    mgpu__conv_plan plan;
    memset(&plan, 0, sizeof plan);
    if (g->p * g->q <= 16) return plan;
    int wgmma = mgpu__wgmma_usable(dev);
    mgpu__implicit_kernel few = mgpu__kernel_of(MGPU__FEW_INPUTS, MGPU__TILE_64x64, 1, 0);
    mgpu__implicit_kernel quads = mgpu__kernel_of(MGPU__STRIDE2_DX, MGPU__TILE_64x64, 1, 0);
    mgpu__implicit_kernel direct = mgpu__kernel_of(MGPU__DIRECT, MGPU__TILE_64x128, 1, 0);
    if (!backward) {
        int fits = mgpu__conv_rule_direct(MGPU__TRY_Y, g, wgmma, &plan.y);
        if (mgpu__conv_method_fits(MGPU__FEW_INPUTS, MGPU__TRY_Y, g)) plan.y = few, fits = 1;
        plan.implicit = fits;
        return plan;
    }
    int fits_dx = mgpu__conv_rule_direct(MGPU__TRY_DX, g, wgmma, &plan.dx);
    if (mgpu__conv_method_fits(MGPU__STRIDE2_DX, MGPU__TRY_DX, g)) plan.dx = quads, fits_dx = 1;
    plan.dx_im2col = with_dx && !fits_dx;
    plan.dw = direct;
    plan.dw.splits = 0; /* (the kernel's default) */
    if (mgpu__conv_method_fits(MGPU__FEW_INPUTS, MGPU__TRY_DW, g)) plan.dw = few;
    else plan.dw_im2col = !mgpu__conv_channels_last_fits(MGPU__TRY_DW, g);
    plan.implicit = !(plan.dw_im2col && (!with_dx || plan.dx_im2col)); /* (both halves: the whole path) */
    return plan;
}

static mgpu__conv_plan mgpu__conv_plan_for(mgpu__conv_trial *t) {
    mgpu__conv_plan plan;
    memset(&plan, 0, sizeof plan);
    mgpu_device *dev = t->x->device;
    if (!mgpu__conv_implicit_allowed(dev)) return plan;
    int with_dx = t->dx != NULL;
    const mgpu__conv_plan *known = mgpu__conv_plan_known(t->g, t->backward, with_dx);
    if (known) return *known;
    if (mgpu__conv_mode == MGPU__CONV_RULE) {
        plan = mgpu__conv_plan_by_rule(dev, t->g, t->backward, with_dx);
        mgpu__conv_plan_remember(t->g, t->backward, with_dx, plan);
        return plan;
    }
    mgpu_tensor *dx = NULL, *dw = NULL;
    if (t->backward) { /* scratch gradients */
        if (with_dx) t->dx = dx = mgpu_empty(dev, t->x->shape);
        t->dw = dw = mgpu_empty(dev, t->w->shape);
    }
    mgpu__conv_copies_ms copy;
    mgpu__conv_trial_copies(t, &copy);
    int timed = mgpu__conv_mode == MGPU__CONV_TIMED;
    plan.implicit = 1;
    if (!t->backward) {
        mgpu__implicit_kernel channels_last = plan.y;
        double y_ms = mgpu__conv_fastest_kernel(t, MGPU__TRY_Y, 0, 0.0, &plan.y);
        double cl_ms = mgpu__conv_fastest_kernel(t, MGPU__TRY_Y, 1, copy.w, &channels_last) + copy.x;
        if (cl_ms < y_ms) y_ms = cl_ms, plan.y = channels_last;
        plan.implicit = timed ? y_ms < mgpu__conv_im2col_ms(t, MGPU__TRY_IM2COL) : y_ms < HUGE_VAL;
    } else {
        /* each gradient's ways (the im2col half with MGPU_CONV=timed, or
           where no kernel fits) */
        double dx_ms[MGPU__WAYS] = {0.0, 0.0, 0.0}, dw_ms[MGPU__WAYS];
        mgpu__implicit_kernel dx_kernel[2] = {plan.dx, plan.dx}, dw_kernel[2] = {plan.dw, plan.dw};
        if (with_dx) {
            dx_ms[MGPU__BY_NCHW] = mgpu__conv_fastest_kernel(t, MGPU__TRY_DX, 0, 0.0, &dx_kernel[0]);
            dx_ms[MGPU__BY_CHANNELS_LAST] =
                mgpu__conv_fastest_kernel(t, MGPU__TRY_DX, 1, copy.w_turned, &dx_kernel[1]);
            dx_ms[MGPU__BY_IM2COL_HALF] = timed || fmin(dx_ms[MGPU__BY_NCHW], dx_ms[MGPU__BY_CHANNELS_LAST]) == HUGE_VAL
                                              ? mgpu__conv_im2col_ms(t, MGPU__TRY_IM2COL_DX)
                                              : HUGE_VAL;
        }
        dw_ms[MGPU__BY_NCHW] = mgpu__conv_fastest_kernel(t, MGPU__TRY_DW, 0, 0.0, &dw_kernel[0]);
        dw_ms[MGPU__BY_CHANNELS_LAST] = mgpu__conv_fastest_kernel(t, MGPU__TRY_DW, 1, 0.0, &dw_kernel[1]) + copy.x;
        dw_ms[MGPU__BY_IM2COL_HALF] = timed || fmin(dw_ms[MGPU__BY_NCHW], dw_ms[MGPU__BY_CHANNELS_LAST]) == HUGE_VAL
                                          ? mgpu__conv_im2col_ms(t, MGPU__TRY_IM2COL_DW)
                                          : HUGE_VAL;
        int by_dx, by_dw;
        double best =
            mgpu__conv_backward_ways(dx_ms, dw_ms, copy.dy, copy.dy_prepared, with_dx, &by_dx, &by_dw);
        plan.dx = dx_kernel[by_dx == MGPU__BY_CHANNELS_LAST];
        plan.dx_im2col = by_dx == MGPU__BY_IM2COL_HALF;
        plan.dw = dw_kernel[by_dw == MGPU__BY_CHANNELS_LAST];
        plan.dw_im2col = by_dw == MGPU__BY_IM2COL_HALF;
        /* (without dx, the dW half is the whole path) */
        if (timed) plan.implicit = !with_dx || best < mgpu__conv_im2col_ms(t, MGPU__TRY_IM2COL);
        else plan.implicit = !(plan.dw_im2col && (!with_dx || plan.dx_im2col)); /* (both halves: the whole path) */
    }
    mgpu_free(dx);
    mgpu_free(dw);
    mgpu_free(t->x_t);
    mgpu_free(t->dy_t);
    mgpu_free(t->w_t);
    mgpu_free(t->w_turned_t);
    mgpu__conv_plan_remember(t->g, t->backward, with_dx, plan);
    return plan;
}
#endif

/* ------------------------------- a CPU's first layer's weight gradient
   A CPU device computes the weight gradient of a convolution whose output
   pixel sees C*R*S <= 9 inputs (a first layer on grayscale images), where
   dx is not asked for, by conv_few_inputs.h's CPU kernel, in every
   MGPU_CONV mode but im2col: it reads the NCHW tensors as they are, where
   oneDNN's blocked layout uses one vector lane in 8 for x and copies x
   and dy into it (bench/RESULTS.md, "LeNet on the CPU"). The layer's
   forward pass stays with the ways below (oneDNN wrote it faster).
   Returns whether it enqueued the pass: dw (=, or += with accumulate)
   from x and dy. */
static int mgpu__conv_dw_few_inputs_on_cpu(mgpu_tensor *dw, const mgpu_tensor *x, const mgpu_tensor *dy,
                                           const mgpu__conv_geom *g, int accumulate) {
    mgpu_device *dev = x->device;
    mgpu__conv_settings_from_environment();
    if (mgpu_device_is_gpu(dev) || mgpu__conv_mode == MGPU__CONV_IM2COL || !mgpu__conv_few_inputs_cpu_fits(g))
        return 0;
    mgpu__conv_few_inputs_wgrad_args a = {dw->data, dy->data, x->data, NULL, accumulate ? 1.0f : 0.0f,
                                          mgpu__conv_few_inputs_slices(g), *g};
    mgpu_tensor *partials = mgpu_empty(dev, mgpu_shape1(a.slices * g->k * g->c * g->r * g->s * MGPU__FEW_LANES));
    a.partials = partials->data;
    mgpu__launch_on(&dev->queue[0], "conv2d_backward few inputs dW", mgpu__conv_few_inputs_wgrad_cpu, NULL, &a,
                    sizeof a);
    mgpu_free(partials); /* (reused only by work enqueued after this on the same queue) */
    return 1;
}

/* ------------------------------------ a CPU's 3x3 layers by Winograd
   By rule (MGPU_CONV's default), a CPU device computes passes of 3x3
   convolutions at stride 1 by kernels/winograd.h's F(2x2, 3x3), 16
   products by OpenBLAS in place of 36 multiplies a 2x2 tile, where it
   beat oneDNN's AVX2 kernels (bench/RESULTS.md, "Winograd on the CPU"):
   the forward pass from 128 channels and filters, dx from 512, dW from
   64 (below); with fewer its passes over the transformed tensors cost
   what its products save. oneDNN's AVX-512 kernels beat it (all but dW
   at 512 channels, where OpenBLAS's own AVX-512 kernels won). Its
   scratch, the transformed tensors, is 4 times the input and the output
   of the whole batch (im2col's is cut into chunks of images; these are
   not). The rule takes it pass by pass (mgpu__winograd_cpu_pays, below),
   MGPU_CONV=timed times it beside im2col and oneDNN's ways (the next
   section), and im2col and implicit leave it out.
   mgpu__enqueue_winograd_pass enqueues a pass with its args, whose three
   scratch pointers (the input's, the weights' and the output's side; in
   scratch, their addresses in args) it sets to tensors made for it,
   freed once it is enqueued. */
static void mgpu__enqueue_winograd_pass(mgpu_device *dev, const char *name, mgpu__kernel_fn pass, void *args,
                                        size_t size, float **scratch[3], const mgpu__conv_geom *g) {
    size_t floats[3];
    mgpu__winograd_cpu_floats(g, floats);
    mgpu_tensor *t[3];
    for (int i = 0; i < 3; i++) {
        t[i] = mgpu_empty(dev, mgpu_shape1((int)floats[i]));
        *scratch[i] = t[i]->data;
    }
    mgpu__launch_on(&dev->queue[0], name, pass, NULL, args, size);
    for (int i = 0; i < 3; i++) mgpu_free(t[i]); /* (reused only by work enqueued after this on the queue) */
}
/* The forward pass or dx: out (=, or += with accumulate) = conv(in, w) +
   b in geometry g; turned: dx, with g mgpu__conv_dx_geometry's and w the
   layer's weights. */
static void mgpu__enqueue_winograd_cpu(float *out, mgpu_device *dev, const float *in, const float *w,
                                       const float *b, const mgpu__conv_geom *g, int turned, int accumulate) {
    mgpu__winograd_cpu_args a = {out, in, w, b, NULL, NULL, NULL, *g, turned, accumulate};
    float **scratch[3] = {&a.v, &a.u, &a.m};
    mgpu__enqueue_winograd_pass(dev, turned ? "conv2d_backward winograd dx" : "conv2d winograd", mgpu__winograd_cpu,
                                &a, sizeof a, scratch, g);
}
/* dw (=, or += with accumulate) = the weight gradient from x and dy. */
static void mgpu__enqueue_winograd_dw_cpu(float *dw, mgpu_device *dev, const float *x, const float *dy,
                                          const mgpu__conv_geom *g, int accumulate) {
    mgpu__winograd_dw_cpu_args a = {dw, x, dy, NULL, NULL, NULL, *g, accumulate};
    float **scratch[3] = {&a.v, &a.du, &a.e};
    mgpu__enqueue_winograd_pass(dev, "conv2d_backward winograd dW", mgpu__winograd_dw_cpu, &a, sizeof a, scratch, g);
}
/* The fewest channels and filters with which the rule takes Winograd for
   each pass: where it won, at batch 32, in bench/convolutions' table
   "oneDNN against Winograd" against oneDNN's AVX2 kernels (oneDNN's dx,
   faster than its forward pass, keeps dx up to 256). */
enum { MGPU__WINOGRAD_CPU_Y_FROM = 128, MGPU__WINOGRAD_CPU_DX_FROM = 512, MGPU__WINOGRAD_CPU_DW_FROM = 64 };
/* The widths of the two libraries' vectors on this CPU, which the CPU's
   rule reads: whether oneDNN runs its AVX-512 kernels, and whether
   OpenBLAS does (the products of im2col and Winograd). 1 or 0, -1 until
   first read; a test sets them to take another CPU's rule. The rule's
   exceptions to oneDNN were measured where the two ran vectors of one
   width (AVX-512 on an Intel Xeon, AVX2 on an AMD EPYC); where oneDNN
   runs AVX-512 and OpenBLAS AVX2 (as on an AMD EPYC whose environment
   sets OPENBLAS_CORETYPE=Haswell), oneDNN won all of ResNet-18's passes
   but one of im2col's (a shortcut, by 3%; bench/RESULTS.md, "oneDNN's
   AVX-512 against OpenBLAS's AVX2"). On that EPYC with OpenBLAS on its
   AVX-512 kernels, oneDNN still won three of im2col's four passes, by 4
   to 34% (8% of a step): where both are AVX-512 the rule rests on the
   Intel Xeon's trials. */
static int mgpu__onednn_avx512 = -1, mgpu__blas_avx512 = -1;
static void mgpu__cpu_vector_widths(void) {
    if (mgpu__onednn_avx512 < 0) {
#if MGPU_ONEDNN
        dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
        mgpu__onednn_avx512 = (isa & dnnl_cpu_isa_avx512_core) == dnnl_cpu_isa_avx512_core;
#else
        mgpu__onednn_avx512 = 0;
#endif
    }
    if (mgpu__blas_avx512 < 0) mgpu__blas_avx512 = mgpu__blas_core_avx512(openblas_get_corename());
}
/* Whether a pass of a layer of geometry g (the layer's own, for all
   three passes) has the pass's fewest channels and filters (above) for
   Winograd to pay, against oneDNN's AVX2 kernels: the rule takes it only
   where oneDNN runs no AVX-512 ones (against those, on an AMD EPYC, it
   lost all but dW at 512 channels). */
static int mgpu__winograd_cpu_pays(const mgpu__conv_geom *g, mgpu__conv_pass pass) {
    int fewest = pass == MGPU__PASS_Y    ? MGPU__WINOGRAD_CPU_Y_FROM
                 : pass == MGPU__PASS_DX ? MGPU__WINOGRAD_CPU_DX_FROM
                                         : MGPU__WINOGRAD_CPU_DW_FROM;
    return mgpu__winograd_cpu_fits_layer(g) && g->c >= fewest && g->k >= fewest;
}

/* -------------------------------- a CPU's: im2col, oneDNN or Winograd */
/* A CPU device computes each pass of a convolution (the forward pass, dx
   and dW, each apart) with conv.h's im2col and OpenBLAS's products, with
   oneDNN's direct kernels (on its blocked layouts or on channels-last
   activations) or, for 3x3 layers at stride 1, its Winograd ones
   (kernels/conv_onednn.h; where the library is built with oneDNN), or
   with mgpu's own Winograd (above, on OpenBLAS's products), by the rule
   or, with MGPU_CONV=timed, whichever was fastest for the pass and
   shape. As on a GPU, the first call of a pass with a shape on a device
   times each way that computes it, once each, each call alone (the
   device synchronised before and after it), and every later call runs
   by the fastest. Where the call writes its outputs (not adding to them),
   im2col writes them in the trial and the other ways write scratch
   copies of their own, the fastest's then replacing them: the first call
   costs the ways, not one more. Where it adds to them, every way writes
   scratch outputs (measuring never adds to a real gradient), and the
   fastest then runs for real. Either way every call of a pass with a
   shape computes what the fastest way computes, and two identical
   networks compute identical values. MGPU_CONV=im2col keeps im2col;
   implicit takes oneDNN's direct kernels wherever they compute a pass
   (MGPU__CPU_BY_DEFAULT: im2col without oneDNN). */
typedef enum {
    MGPU__CPU_BY_IM2COL,
    MGPU__CPU_BY_MGPU_WINOGRAD, /* (winograd.h's, above) */
    MGPU__CPU_BY_ONEDNN_DIRECT, /* (oneDNN's three methods from here on) */
    MGPU__CPU_BY_ONEDNN_CHANNELS_LAST,
    MGPU__CPU_BY_ONEDNN_WINOGRAD,
    MGPU__CPU_WAYS
} mgpu__cpu_conv_way;
static const char *const mgpu__cpu_conv_way_names[MGPU__CPU_WAYS] = {"im2col", "Winograd", "oneDNN",
                                                                     "oneDNN channels-last", "oneDNN Winograd"};
/* The way PyTorch's CPU path takes: oneDNN's direct kernels; im2col where
   the library has no oneDNN. */
#define MGPU__CPU_BY_DEFAULT (MGPU_ONEDNN ? MGPU__CPU_BY_ONEDNN_DIRECT : MGPU__CPU_BY_IM2COL)
typedef struct {
    const mgpu_device *device; /* (each device its own: each has its share of the cores) */
    mgpu__conv_geom g;
    mgpu__conv_pass pass; /* y, dx or dW (each its own way) */
    double trial_ms[MGPU__CPU_WAYS]; /* the trial's times (HUGE_VAL: a way that does not compute it) */
    mgpu__cpu_conv_way way;
} mgpu__cpu_conv_choice;
/* (one for each pass of each shape on each device: 33 a device for ResNet-18) */
static mgpu__cpu_conv_choice mgpu__cpu_conv_choices[1024];
static int mgpu__cpu_conv_choice_count;

/* One call: the forward pass (y), or the backward (dx or dw, or both:
   mgpu__conv_cpu computes each by its own way), with what they add to. */
typedef struct {
    mgpu_tensor *y, *dx, *dw;
    const mgpu_tensor *x, *w, *b, *dy;
    const mgpu__conv_geom *g;
    int backward, accumulate, add_to_dx, tf32;
} mgpu__cpu_conv_call;

#if MGPU_ONEDNN
/* The method of one of oneDNN's ways. */
static mgpu__onednn_method mgpu__cpu_conv_onednn_method(mgpu__cpu_conv_way way) {
    return way == MGPU__CPU_BY_ONEDNN_WINOGRAD        ? MGPU__ONEDNN_WINOGRAD
           : way == MGPU__CPU_BY_ONEDNN_CHANNELS_LAST ? MGPU__ONEDNN_CHANNELS_LAST
                                                      : MGPU__ONEDNN_DIRECT;
}
/* Enqueues one oneDNN pass by its plan on dev, with its chosen-layout
   copies from the allocator. */
static void mgpu__onednn_enqueue(mgpu_device *dev, const char *name, const mgpu__onednn_plan *plan,
                                 const float *in_a, const float *in_b, float *out, const float *bias) {
    mgpu__onednn_args a = {plan, {(float *)in_a, (float *)in_b, out}, {NULL, NULL, NULL}, NULL, bias};
    mgpu_tensor *scratch[MGPU__ONEDNN_TENSORS + 1] = {NULL, NULL, NULL, NULL}; /* the copies, the scratchpad */
    for (int t = 0; t <= MGPU__ONEDNN_TENSORS; t++) {
        size_t bytes = t < MGPU__ONEDNN_TENSORS ? plan->bytes[t] : plan->scratch_bytes;
        if (!bytes) continue;
        scratch[t] = mgpu_empty(dev, mgpu_shape1((int)((bytes + sizeof(float) - 1) / sizeof(float))));
        if (t < MGPU__ONEDNN_TENSORS) a.copy[t] = scratch[t]->data;
        else a.scratch = scratch[t]->data;
    }
    mgpu__launch_on(&dev->queue[0], name, mgpu__onednn_conv_cpu, NULL, &a, sizeof a);
    for (int t = 0; t <= MGPU__ONEDNN_TENSORS; t++) mgpu_free(scratch[t]); /* (reused only by later work) */
}

/* The plans of the call's passes by oneDNN's method, in plans[pass]
   (NULL for a pass the call does not compute); 0 where the method has no
   kernel for one of them. Made at the first call with a shape (oneDNN
   compiles its kernels then: milliseconds). */
static int mgpu__cpu_conv_onednn_plans_of(const mgpu__cpu_conv_call *c, mgpu__onednn_method method,
                                          mgpu__onednn_plan *plans[3]) {
    const mgpu__conv_geom *g = c->g;
    int threads = mgpu__cpu_threads, with_bias = c->b != NULL;
    plans[MGPU__PASS_Y] = plans[MGPU__PASS_DX] = plans[MGPU__PASS_DW] = NULL;
    if (!c->backward) plans[MGPU__PASS_Y] = mgpu__onednn_plan_for(g, MGPU__PASS_Y, method, with_bias, 0, threads);
    if (c->dx) plans[MGPU__PASS_DX] = mgpu__onednn_plan_for(g, MGPU__PASS_DX, method, 0, c->add_to_dx, threads);
    if (c->dw) plans[MGPU__PASS_DW] = mgpu__onednn_plan_for(g, MGPU__PASS_DW, method, 0, c->accumulate, threads);
    return (c->backward || plans[MGPU__PASS_Y]) && (!c->dx || plans[MGPU__PASS_DX]) &&
           (!c->dw || plans[MGPU__PASS_DW]);
}
/* The call by one of oneDNN's ways; 0 (nothing enqueued) where it has no
   kernel for a pass of it. Each method's passes have names of their own
   in a trace. */
static int mgpu__cpu_conv_by_onednn(mgpu__cpu_conv_way way, const mgpu__cpu_conv_call *c) {
    static const char *const names[3][3] = { /* [method][pass] */
        {"conv2d oneDNN forward", "conv2d_backward oneDNN dx", "conv2d_backward oneDNN dW"},
        {"conv2d oneDNN channels-last forward", "conv2d_backward oneDNN channels-last dx",
         "conv2d_backward oneDNN channels-last dW"},
        {"conv2d oneDNN Winograd forward", "conv2d_backward oneDNN Winograd dx", "conv2d_backward oneDNN Winograd dW"}};
    mgpu_device *dev = c->x->device;
    mgpu__onednn_method method = mgpu__cpu_conv_onednn_method(way);
    mgpu__onednn_plan *plans[3];
    if (!mgpu__cpu_conv_onednn_plans_of(c, method, plans)) return 0;
    if (!c->backward)
        mgpu__onednn_enqueue(dev, names[method][MGPU__PASS_Y], plans[MGPU__PASS_Y], c->x->data, c->w->data,
                             c->y->data, c->b ? c->b->data : NULL);
    if (c->dx)
        mgpu__onednn_enqueue(dev, names[method][MGPU__PASS_DX], plans[MGPU__PASS_DX], c->w->data, c->dy->data,
                             c->dx->data, NULL);
    if (c->dw)
        mgpu__onednn_enqueue(dev, names[method][MGPU__PASS_DW], plans[MGPU__PASS_DW], c->x->data, c->dy->data,
                             c->dw->data, NULL);
    return 1;
}
#else
static int mgpu__cpu_conv_by_onednn(mgpu__cpu_conv_way way, const mgpu__cpu_conv_call *c) {
    (void)c, (void)way;
    return 0; /* (the library without oneDNN) */
}
#endif
static void mgpu__cpu_conv_by_im2col(const mgpu__cpu_conv_call *c) {
    if (c->backward)
        mgpu__conv_backward_im2col(c->dx, c->dw, c->dy, c->x, c->w, c->g, c->tf32, c->accumulate, c->add_to_dx);
    else
        mgpu__conv_forward_im2col(c->y, c->x, c->w, c->b, c->g, c->tf32);
}
/* The call by Winograd; 0 (nothing enqueued) where it does not fit. */
static int mgpu__cpu_conv_by_winograd(const mgpu__cpu_conv_call *c) {
    mgpu_device *dev = c->x->device;
    const mgpu__conv_geom *g = c->g;
    if (!mgpu__winograd_cpu_fits_layer(g)) return 0;
    mgpu__conv_geom d = mgpu__conv_dx_geometry(g);
    if (!c->backward)
        mgpu__enqueue_winograd_cpu(c->y->data, dev, c->x->data, c->w->data, c->b ? c->b->data : NULL, g, 0, 0);
    if (c->dx) mgpu__enqueue_winograd_cpu(c->dx->data, dev, c->dy->data, c->w->data, NULL, &d, 1, c->add_to_dx);
    if (c->dw) mgpu__enqueue_winograd_dw_cpu(c->dw->data, dev, c->x->data, c->dy->data, g, c->accumulate);
    return 1;
}
/* The call by a way; 0 (nothing enqueued) where that way has no kernel
   for it. */
static int mgpu__cpu_conv_by(mgpu__cpu_conv_way way, const mgpu__cpu_conv_call *c) {
    if (way >= MGPU__CPU_BY_ONEDNN_DIRECT) return mgpu__cpu_conv_by_onednn(way, c);
    if (way == MGPU__CPU_BY_MGPU_WINOGRAD) return mgpu__cpu_conv_by_winograd(c);
    mgpu__cpu_conv_by_im2col(c);
    return 1;
}
/* Whether a way has a kernel for every pass of the call (oneDNN's plans
   are made then: they are what tells). */
static int mgpu__cpu_conv_computes(mgpu__cpu_conv_way way, const mgpu__cpu_conv_call *c) {
#if MGPU_ONEDNN
    mgpu__onednn_plan *plans[3];
    if (way >= MGPU__CPU_BY_ONEDNN_DIRECT)
        return mgpu__cpu_conv_onednn_plans_of(c, mgpu__cpu_conv_onednn_method(way), plans);
#endif
    return way == MGPU__CPU_BY_IM2COL || (way == MGPU__CPU_BY_MGPU_WINOGRAD && mgpu__winograd_cpu_fits_layer(c->g));
}

/* The pass of a call of one pass. */
static mgpu__conv_pass mgpu__cpu_conv_pass_of(const mgpu__cpu_conv_call *c) {
    return !c->backward ? MGPU__PASS_Y : c->dx ? MGPU__PASS_DX : MGPU__PASS_DW;
}
/* The choice made for a pass and shape on dev, or NULL if none was yet. */
static mgpu__cpu_conv_choice *mgpu__cpu_conv_choice_find(const mgpu_device *dev, const mgpu__conv_geom *g,
                                                         mgpu__conv_pass pass) {
    for (int i = 0; i < mgpu__cpu_conv_choice_count; i++) {
        mgpu__cpu_conv_choice *c = &mgpu__cpu_conv_choices[i];
        if (c->device == dev && !memcmp(&c->g, g, sizeof *g) && c->pass == pass) return c;
    }
    return NULL;
}
static mgpu__cpu_conv_choice *mgpu__cpu_conv_choice_new(const mgpu_device *dev, const mgpu__conv_geom *g,
                                                        mgpu__conv_pass pass) {
    MGPU_REQUIRE(mgpu__cpu_conv_choice_count < (int)(sizeof mgpu__cpu_conv_choices / sizeof mgpu__cpu_conv_choices[0]),
                 "conv2d: more than %d convolution shapes", mgpu__cpu_conv_choice_count);
    mgpu__cpu_conv_choice *c = &mgpu__cpu_conv_choices[mgpu__cpu_conv_choice_count++];
    memset(c, 0, sizeof *c);
    c->device = dev;
    c->g = *g;
    c->pass = pass;
    for (int way = 0; way < MGPU__CPU_WAYS; way++) c->trial_ms[way] = HUGE_VAL;
    return c;
}

/* The trial of a pass (above): each way once, with oneDNN's plans made
   before the clock starts. Returns whether it has done the call (where
   the call writes its outputs). */
static int mgpu__cpu_conv_trial(mgpu__cpu_conv_choice *c, const mgpu__cpu_conv_call *call) {
    mgpu_device *dev = call->x->device;
    int writes = !call->accumulate && !call->add_to_dx; /* (the forward pass always) */
    mgpu__cpu_conv_call written = *call; /* (the call as the trial runs it: writing, not adding) */
    written.accumulate = written.add_to_dx = 0;
    int computes[MGPU__CPU_WAYS];
    for (int way = 0; way < MGPU__CPU_WAYS; way++) computes[way] = mgpu__cpu_conv_computes((mgpu__cpu_conv_way)way, &written);
    mgpu__cpu_conv_call t[MGPU__CPU_WAYS]; /* each way's: the call, into scratch outputs of its own */
    for (int way = 0; way < MGPU__CPU_WAYS; way++) {
        t[way] = *call;
        if (!computes[way] || (way == MGPU__CPU_BY_IM2COL && writes)) continue; /* (not run; the call's own) */
        t[way] = written;
        if (!call->backward) t[way].y = mgpu_empty(dev, call->y->shape);
        t[way].dx = call->dx ? mgpu_empty(dev, call->x->shape) : NULL;
        t[way].dw = call->dw ? mgpu_empty(dev, call->w->shape) : NULL;
    }
    c->way = MGPU__CPU_BY_IM2COL;
    for (int way = 0; way < MGPU__CPU_WAYS; way++) {
        if (!computes[way]) continue; /* (its time stays HUGE_VAL) */
        mgpu_synchronize(dev);
        double t0 = mgpu_now();
        mgpu__cpu_conv_by((mgpu__cpu_conv_way)way, &t[way]);
        mgpu_synchronize(dev);
        c->trial_ms[way] = (mgpu_now() - t0) * 1e3;
        if (c->trial_ms[way] < c->trial_ms[c->way]) c->way = (mgpu__cpu_conv_way)way;
    }
    for (int way = 0; way < MGPU__CPU_WAYS; way++) {
        mgpu_tensor *outs[3][2] = {{call->y, t[way].y}, {call->dx, t[way].dx}, {call->dw, t[way].dw}};
        for (int i = 0; i < 3; i++) { /* (real, scratch) */
            if (outs[i][1] == outs[i][0]) continue; /* im2col's, the call's own */
            if (outs[i][1] && writes && way == (int)c->way) {
                mgpu__memcpy_args copy = {outs[i][0]->data, outs[i][1]->data, outs[i][0]->numel * sizeof(float), -1,
                                          -1};
                MGPU__ENQUEUE(dev, "conv2d trial's copy", mgpu__memcpy, copy);
            }
            mgpu_free(outs[i][1]); /* (reused only by later work) */
        }
    }
    return writes;
}

/* Whether the rule gives a layer of geometry g to oneDNN's Winograd,
   where oneDNN has it: 3x3 windows at stride 1, 32 channels and filters
   or more, and an output of more than one 4 x 4 tile that fills at least
   three quarters of its tiles. On a 2-core AMD EPYC (AVX-512) it took
   0.39 to 0.76 of the direct kernels' time in every pass of ResNet-18's
   3x3 layers from 64 channels at 28 x 28, 14 x 14 and 7 x 7 (a fill of
   0.77), and 0.52 to 0.68 at 32 channels and 28 x 28; at 16 channels it
   tied forward, lost dx by 8% and won dW; it lost at 128 channels and
   5 x 5 (a fill of 0.39), and took 3.3 to 3.5 times direct's time on a
   first layer (one channel). At 4 x 4 (512 channels) it tied forward,
   lost dx, and won dW alone (0.76) but not in the network's step, for
   126 MB more scratch (bench/convolutions --cpu, bench/profile --cpu;
   bench/RESULTS.md, "oneDNN's Winograd and channels-last kernels").
   Where unmeasured, direct, PyTorch's choice, stays. */
static int mgpu__onednn_winograd_pays(const mgpu__conv_geom *g) {
    int tiles = ((g->p + 3) / 4) * ((g->q + 3) / 4), pixels = g->p * g->q;
    return g->r == 3 && g->s == 3 && g->stride == 1 && g->c >= 32 && g->k >= 32 && tiles > 1 &&
           4 * pixels >= 3 * 16 * tiles;
}
/* The way by rule (MGPU_CONV=rule, the default), fixed for a pass and
   shape: where oneDNN runs no AVX-512 kernels, mgpu's Winograd where it
   pays (mgpu__winograd_cpu_pays); where oneDNN runs AVX-512 kernels,
   its Winograd ones where they pay (above). Otherwise oneDNN's direct
   kernels (im2col without oneDNN), except the backward passes where
   im2col won the trials on 2-core CPUs (bench/RESULTS.md, "the rule's
   sources"): 1x1 windows at a stride (ResNet's shortcuts)
   and outputs of 4 x 4 pixels or fewer; not where oneDNN's vectors are
   wider than OpenBLAS's (above). Where oneDNN runs AVX-512, the direct
   kernels take their activations channels-last where the channels or
   the filters do not fill 16-float vectors, from 2 channels: on a 2-core
   AMD EPYC, LeNet's 20 -> 50 5x5 layer took 0.56 of the blocked layouts'
   time forward, 0.83 for dx and 0.64 for dW; but a first layer on one
   channel, whose input is the same in both layouts, took 1.16 forward
   (bench/convolutions --cpu; bench/RESULTS.md, "oneDNN's Winograd and
   channels-last kernels"). */
static mgpu__cpu_conv_way mgpu__cpu_conv_way_by_rule(const mgpu__cpu_conv_call *call) {
    const mgpu__conv_geom *g = call->g;
    mgpu__cpu_vector_widths();
    if (!mgpu__onednn_avx512 && mgpu__winograd_cpu_pays(g, mgpu__cpu_conv_pass_of(call)))
        return MGPU__CPU_BY_MGPU_WINOGRAD;
    if (mgpu__onednn_avx512 && mgpu__onednn_winograd_pays(g) && mgpu__cpu_conv_computes(MGPU__CPU_BY_ONEDNN_WINOGRAD, call))
        return MGPU__CPU_BY_ONEDNN_WINOGRAD;
    int im2col_wins = call->backward && ((g->r == 1 && g->s == 1 && g->stride > 1) || g->p * g->q <= 16) &&
                      !(mgpu__onednn_avx512 && !mgpu__blas_avx512);
    if (im2col_wins) return MGPU__CPU_BY_IM2COL;
    if (mgpu__onednn_avx512 && g->c > 1 && (g->c % 16 || g->k % 16) &&
        mgpu__cpu_conv_computes(MGPU__CPU_BY_ONEDNN_CHANNELS_LAST, call))
        return MGPU__CPU_BY_ONEDNN_CHANNELS_LAST;
    return MGPU__CPU_BY_DEFAULT;
}

/* The way of a pass in the modes that time nothing. */
static mgpu__cpu_conv_way mgpu__cpu_conv_way_untimed(const mgpu__cpu_conv_call *call) {
    return mgpu__conv_mode == MGPU__CONV_IMPLICIT ? MGPU__CPU_BY_DEFAULT
           : mgpu__conv_mode == MGPU__CONV_RULE   ? mgpu__cpu_conv_way_by_rule(call)
                                                  : MGPU__CPU_BY_IM2COL;
}
/* A call on a CPU device: each of its passes by the way its choice says
   (above); both gradients by im2col in one call, where neither is timed,
   as they share its copy of dy. */
static void mgpu__conv_cpu(const mgpu__cpu_conv_call *call) {
    mgpu__conv_settings_from_environment();
    int timed = mgpu__conv_mode == MGPU__CONV_TIMED;
    if (call->dx && call->dw) {
        mgpu__cpu_conv_call dx = *call, dw = *call; /* (each with its own adding alone) */
        dx.dw = NULL;
        dx.accumulate = 0;
        dw.dx = NULL;
        dw.add_to_dx = 0;
        if (!timed && mgpu__cpu_conv_way_untimed(&dx) == MGPU__CPU_BY_IM2COL &&
            mgpu__cpu_conv_way_untimed(&dw) == MGPU__CPU_BY_IM2COL) {
            mgpu__cpu_conv_by_im2col(call);
            return;
        }
        mgpu__conv_cpu(&dx);
        mgpu__conv_cpu(&dw);
        return;
    }
    mgpu__cpu_conv_way way;
    if (timed) {
        mgpu_device *dev = call->x->device;
        mgpu__cpu_conv_choice *c = mgpu__cpu_conv_choice_find(dev, call->g, mgpu__cpu_conv_pass_of(call));
        if (!c) {
            c = mgpu__cpu_conv_choice_new(dev, call->g, mgpu__cpu_conv_pass_of(call));
            if (mgpu__cpu_conv_trial(c, call)) return;
        }
        way = c->way;
    } else {
        way = mgpu__cpu_conv_way_untimed(call);
    }
    if (!mgpu__cpu_conv_by(way, call)) mgpu__cpu_conv_by_im2col(call);
}

/* A choice in words, for the benchmarks and tests: the ways the trial
   timed, each with its time. */
static inline const char *mgpu__cpu_conv_choice_str(const mgpu__cpu_conv_choice *c, char *out, size_t size) {
    const mgpu__conv_geom *g = &c->g;
    int at = snprintf(out, size, "%s: %dx%d, %d -> %d, stride %d, %d x %dx%d: %s by %s (trial:", c->device->name,
                      g->r, g->s, g->c, g->k, g->stride, g->n, g->h, g->w,
                      c->pass == MGPU__PASS_Y ? "forward" : c->pass == MGPU__PASS_DX ? "dx" : "dW",
                      mgpu__cpu_conv_way_names[c->way]);
    const char *sep = " ";
    for (int way = 0; way < MGPU__CPU_WAYS && at > 0 && (size_t)at < size; way++) {
        if (c->trial_ms[way] == HUGE_VAL) continue; /* (a way that does not compute the pass) */
        at += snprintf(out + at, size - (size_t)at, "%s%s %.2f ms", sep, mgpu__cpu_conv_way_names[way],
                       c->trial_ms[way]);
        sep = ", ";
    }
    if (at > 0 && (size_t)at < size) snprintf(out + at, size - (size_t)at, ")");
    return out;
}

/* mgpu_conv2d_forward; x_t: x's channels-last copy, if the caller has
   one (else NULL); with keep_x_t, a channels-last forward that made its
   own copy of x leaves it there for the backward pass (*keep_x_t is freed
   first, and stays NULL when the forward took another path); keep_w_t:
   where the caller keeps the weights' channels-last copy, or NULL (as
   mgpu__conv_channels_last says); prepared: what the caller prepares for
   it, if measuring the plan (MGPU__PREPARED_*). */
static void mgpu__conv2d_forward(mgpu_tensor *y, const mgpu_tensor *x, const mgpu_tensor *x_t,
                                 const mgpu_tensor *w, mgpu_tensor **keep_w_t, const mgpu_tensor *b, int stride,
                                 int pad, mgpu_tensor **keep_x_t, int prepared) {
    const char *op = "mgpu_conv2d_forward";
    if (keep_x_t) {
        mgpu_free(*keep_x_t); /* before the new copy, which may then take its memory */
        *keep_x_t = NULL;
    }
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
    if (x_t) mgpu__require_channels_last_of(x_t, x, op, "channels-last x_t");
    mgpu__before_write(y);
    int tf32 = mgpu__tf32_allowed(MGPU__TF32_CONV);
#if MGPU_CUDA
    mgpu__conv_trial t = {y, NULL, NULL, x, w, b, NULL, &g, 0, prepared, NULL, NULL, NULL, NULL};
    mgpu__conv_plan plan = mgpu__conv_plan_for(&t);
    if (plan.implicit) {
        mgpu__conv_forward_implicit(y, x, x_t, w, keep_w_t, b, &g, plan.y, keep_x_t);
        return;
    }
#endif
    (void)keep_w_t;
    (void)prepared;
    if (!mgpu_device_is_gpu(dev)) {
        mgpu__cpu_conv_call call = {y, NULL, NULL, x, w, b, NULL, &g, 0, 0, 0, tf32};
        mgpu__conv_cpu(&call);
        return;
    }
    mgpu__conv_forward_im2col(y, x, w, b, &g, tf32);
}
MGPU_DEF void mgpu_conv2d_forward(mgpu_tensor *y, const mgpu_tensor *x, const mgpu_tensor *w,
                                  const mgpu_tensor *b, int stride, int pad) {
    mgpu__conv2d_forward(y, x, NULL, w, NULL, b, stride, pad, NULL, 0);
}

/* mgpu_conv2d_backward; x_t: x's channels-last copy, or NULL; dy_t:
   dy's, or NULL: given only where the plan reads dy through it alone
   (mgpu__conv_plan_reads_dy_t_only), and then dy's values are not read
   (a network's batch norm wrote dy_t instead of dy); keep_w_t: as in the
   forward pass, for the turned weights of dx's kernel; add_to_dx: dx +=
   the input gradient (else dx = it; `accumulate` is the same for dw and
   db); prepared: as in the forward pass. */
static void mgpu__conv2d_backward(mgpu_tensor *dx, mgpu_tensor *dw, mgpu_tensor *db,
                                  const mgpu_tensor *dy, const mgpu_tensor *dy_t, const mgpu_tensor *x,
                                  const mgpu_tensor *x_t, const mgpu_tensor *w, mgpu_tensor **keep_w_t,
                                  int stride, int pad, int accumulate, int add_to_dx, int prepared) {
    const char *op = "mgpu_conv2d_backward";
    mgpu__conv_geom g = mgpu__conv_geometry(op, x->shape, w->shape, stride, pad);
    mgpu_device *dev = x->device;
    mgpu__require_device(w, dev, op);
    mgpu__require_device(dy, dev, op);
    mgpu__require_shape(dy, mgpu_shape4(g.n, g.k, g.p, g.q), op, "output gradient dy");
    mgpu__require_indexable(x, op);
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
        mgpu__require_shape(db, mgpu_shape1(g.k), op, "bias gradient db");
    }
    if (dx) mgpu__before_write(dx);
    if (db) mgpu__before_write(db);
    if (dw) mgpu__before_write(dw);
    int tf32 = mgpu__tf32_allowed(MGPU__TF32_CONV), done = 0; /* done: by a way other than im2col here */
#if MGPU_CUDA
    mgpu__conv_trial t = {NULL, dx, NULL, x, w, NULL, dy, &g, 1, db ? prepared & ~MGPU__PREPARED_DY : prepared,
                          NULL, NULL, NULL, NULL};
    mgpu__conv_plan plan = mgpu__conv_plan_for(&t);
    MGPU_REQUIRE(!dy_t || mgpu__conv_plan_reads_dy_t_only(&plan, dx != NULL, db != NULL),
                 "%s: given dy's channels-last copy alone, but this pass reads dy itself", op);
    if (dy_t) mgpu__require_channels_last_of(dy_t, dy, op, "channels-last dy_t");
    done = plan.implicit;
    if (plan.implicit) {
        /* one channels-last copy of dy for both gradients, when both take one */
        int dx_cl = dx && !plan.dx_im2col && mgpu__conv_reads_copies(plan.dx);
        int dw_cl = dw && !plan.dw_im2col && mgpu__conv_reads_copies(plan.dw);
        mgpu_tensor *own_dy_t = NULL;
        if (!dy_t && dx_cl && dw_cl)
            dy_t = own_dy_t = mgpu__channels_last_copy(dev, dy->data, g.n, g.k, g.p * g.q, 0);
        if (dx && plan.dx_im2col) mgpu__conv_backward_im2col(dx, NULL, dy, x, w, &g, tf32, 0, add_to_dx);
        else if (dx) mgpu__conv_dx_implicit(dx, dy, dy_t, w, keep_w_t, &g, plan.dx, add_to_dx);
        if (dw && plan.dw_im2col) mgpu__conv_backward_im2col(NULL, dw, dy, x, w, &g, tf32, accumulate, 0);
        else if (dw) mgpu__conv_dw_implicit(dw, dy, dy_t, x, x_t, &g, accumulate, plan.dw);
        mgpu_free(own_dy_t);
    }
#else
    MGPU_REQUIRE(!dy_t, "%s: given dy's channels-last copy alone, but this pass reads dy itself", op);
#endif
    if (!done && !dx && dw) done = mgpu__conv_dw_few_inputs_on_cpu(dw, x, dy, &g, accumulate);
    if (!done && !mgpu_device_is_gpu(dev)) {
        mgpu__cpu_conv_call call = {NULL, dx, dw, x, w, NULL, dy, &g, 1, accumulate, add_to_dx, tf32};
        mgpu__conv_cpu(&call);
        done = 1;
    }
    if (!done) mgpu__conv_backward_im2col(dx, dw, dy, x, w, &g, tf32, accumulate, add_to_dx);
    if (db) {
        mgpu__enqueue_chan_sum(dev, "conv2d_backward bias", db->data, dy->data, g.n, g.k,
                               (size_t)g.p * g.q, 1.0f, accumulate ? 1.0f : 0.0f);
    }
#if !MGPU_CUDA
    (void)x_t;
    (void)keep_w_t;
    (void)prepared;
#endif
}
MGPU_DEF void mgpu_conv2d_backward(mgpu_tensor *dx, mgpu_tensor *dw, mgpu_tensor *db,
                                   const mgpu_tensor *dy, const mgpu_tensor *x,
                                   const mgpu_tensor *w, int stride, int pad, int accumulate) {
    mgpu__conv2d_backward(dx, dw, db, dy, NULL, x, NULL, w, NULL, stride, pad, accumulate, 0, 0);
}
