/* tests/gpu_layers.c: every layer kernel on the GPU against the same call
   on the CPU (whose correctness tests/test_layers.c establishes).

   Inputs are drawn on the CPU device and copied to GPU 0, so both sides
   see the same numbers. Outputs and gradients start as NaN, so a kernel
   that fails to write an element (or reads a tensor it should overwrite)
   is caught; parameter gradients are then accumulated once more on top.

   Tolerances, relative to the largest magnitude of the CPU result:
   products (convolutions, linear layers) 1e-4: cuBLAS and OpenBLAS add
   the same float terms in different orders, which moves a sum of n terms
   by about sqrt(n) * 6e-8 of its size, at most ~1e-5 for the sums here
   (up to ~10^5 terms); elementwise operations 1e-6 (ReLU, the residual
   sum and pooling compute the same float operations, up to the division
   in pooling); the channel sums (bias gradients, global pooling) 1e-5
   (float on the GPU, double on the CPU). These hold with TF32 off, as the
   harness sets it; the TF32 products have a test of their own.

   Built with nvcc only; without a GPU it says "skipped: no GPU" and
   passes. */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"
#include "test.h"

static mgpu_device *gpu;

/* The same tensor on the CPU and on the GPU. */
typedef struct { mgpu_tensor *c, *g; } pair;
static pair pair_randn(mgpu_shape s) {
    pair p;
    p.c = mgpu_randn(mgpu_cpu(), s, 0.0f, 1.0f);
    p.g = mgpu_to(p.c, gpu, 0);
    return p;
}
static pair pair_nan(mgpu_shape s) {
    pair p;
    p.c = mgpu_full(mgpu_cpu(), s, NAN);
    p.g = mgpu_full(gpu, s, NAN);
    return p;
}
static void pair_free(pair *p) {
    mgpu_free(p->c);
    mgpu_free(p->g);
}
/* NULL stands for "no tensor" (no bias, no dx). */
static mgpu_tensor *on_cpu(pair *p, int present) { return present ? p->c : NULL; }
static mgpu_tensor *on_gpu(pair *p, int present) { return present ? p->g : NULL; }

/* max |gpu - cpu| <= tol * max(1, max |cpu|); returns max |gpu - cpu| / max(1, max |cpu|) */
static double check_same(const char *name, const char *what, const pair *p, double tol) {
    size_t n = p->c->numel;
    float *want = (float *)malloc(n * sizeof(float)), *got = (float *)malloc(n * sizeof(float));
    mgpu_to_host(p->c, want);
    mgpu_to_host(p->g, got);
    double scale = 1.0, err = 0.0;
    size_t worst = 0;
    for (size_t i = 0; i < n; i++) {
        if (fabs(want[i]) > scale) scale = fabs(want[i]);
        double e = fabs((double)got[i] - want[i]);
        if (!(e <= err)) { /* also catches NaN */
            err = isnan(e) ? INFINITY : e;
            worst = i;
        }
    }
    if (!(err <= tol * scale)) {
        fprintf(stderr, "  %s, %s: element %zu is %.9g on the GPU, %.9g on the CPU (max error %.3g, "
                "allowed %.3g)\n", name, what, worst, got[worst], want[worst], err, tol * scale);
        test__failures++;
    }
    free(want);
    free(got);
    return err / scale;
}

/* ------------------------------------------------------------ convolution */
static void conv_compare(const char *name, int n, int c, int h, int w, int k, int r, int s,
                         int stride, int pad, int bias, int with_dx) {
    mgpu_shape xs = mgpu_shape4(n, c, h, w), ws = mgpu_shape4(k, c, r, s);
    mgpu_shape ys = mgpu_conv2d_output_shape(xs, ws, stride, pad);
    pair x = pair_randn(xs), wt = pair_randn(ws), b = pair_randn(mgpu_shape1(k));
    pair y = pair_nan(ys), dy = pair_randn(ys);
    pair dx = pair_nan(xs), dw = pair_nan(ws), db = pair_nan(mgpu_shape1(k));
    mgpu_conv2d_forward(y.c, x.c, wt.c, on_cpu(&b, bias), stride, pad);
    mgpu_conv2d_forward(y.g, x.g, wt.g, on_gpu(&b, bias), stride, pad);
    check_same(name, "y", &y, 1e-4);
    for (int accumulate = 0; accumulate <= 1; accumulate++) {
        mgpu_conv2d_backward(on_cpu(&dx, with_dx), dw.c, on_cpu(&db, bias), dy.c, x.c, wt.c, stride,
                             pad, accumulate);
        mgpu_conv2d_backward(on_gpu(&dx, with_dx), dw.g, on_gpu(&db, bias), dy.g, x.g, wt.g, stride,
                             pad, accumulate);
        if (with_dx) check_same(name, "dx", &dx, 1e-4);
        check_same(name, accumulate ? "dw accumulated" : "dw", &dw, 1e-4);
        if (bias) check_same(name, accumulate ? "db accumulated" : "db", &db, 1e-5);
    }
    pair_free(&x); pair_free(&wt); pair_free(&b); pair_free(&y); pair_free(&dy);
    pair_free(&dx); pair_free(&dw); pair_free(&db);
}

TEST(conv2d_small_shapes) {
    /*            name                   N  C   H   W  K  R  S  t  d  bias dx */
    conv_compare("3x3 single image", 1, 1, 6, 6, 2, 3, 3, 1, 0, 1, 1);
    conv_compare("3x3 pad 1", 3, 3, 7, 9, 4, 3, 3, 1, 1, 1, 1);
    conv_compare("5x5 no bias", 2, 2, 8, 7, 3, 5, 5, 1, 0, 0, 1);
    conv_compare("5x5 stride 2 pad 1", 2, 3, 9, 8, 5, 5, 5, 2, 1, 1, 1);
    conv_compare("1x1 stride 2", 2, 4, 6, 5, 3, 1, 1, 2, 0, 1, 1);
    conv_compare("3x2 kernel", 2, 2, 6, 7, 3, 3, 2, 1, 1, 1, 1);
    conv_compare("3x3 stride 3 pad 2", 1, 2, 11, 10, 2, 3, 3, 3, 2, 1, 0);
    conv_compare("5x5 pad 2 of 3x1", 2, 2, 3, 1, 2, 5, 5, 1, 2, 1, 1);
}

TEST(conv2d_lenet_and_resnet_shapes) {
    conv_compare("LeNet conv 1", 256, 1, 28, 28, 20, 3, 3, 1, 0, 1, 0);
    conv_compare("LeNet conv 2", 256, 20, 13, 13, 50, 5, 5, 1, 0, 1, 1);
    conv_compare("ResNet stem", 64, 1, 28, 28, 64, 3, 3, 1, 1, 0, 0);
    conv_compare("ResNet downsampling 3x3", 32, 64, 28, 28, 128, 3, 3, 2, 1, 0, 1);
    conv_compare("ResNet 1x1 shortcut", 32, 64, 28, 28, 128, 1, 1, 2, 0, 0, 1);
    conv_compare("ResNet stage 4", 64, 512, 4, 4, 512, 3, 3, 1, 1, 0, 1);
}

/* 96 images of 64 x 28 x 28 with 64 3x3 filters need (576 + 64) * 784
   floats of scratch each: 33 fit in the GPU's 64 MiB, so 3 chunks. Then
   a tiny budget: one image per chunk. */
TEST(conv2d_in_chunks) {
    conv_compare("three chunks", 96, 64, 28, 28, 64, 3, 3, 1, 1, 1, 1);
    size_t saved = mgpu__conv_scratch_floats[1];
    mgpu__conv_scratch_floats[1] = 1;
    conv_compare("one image per chunk", 5, 3, 9, 8, 4, 3, 3, 2, 1, 1, 1);
    mgpu__conv_scratch_floats[1] = saved;
}

/* ---------------------------------------------------------------- pooling */
static void pool_compare(const char *name, mgpu_shape xs, int k) {
    mgpu_shape ys = mgpu_avg_pool2d_output_shape(xs, k);
    pair x = pair_randn(xs), y = pair_nan(ys), dy = pair_randn(ys), dx = pair_nan(xs);
    mgpu_avg_pool2d_forward(y.c, x.c, k);
    mgpu_avg_pool2d_forward(y.g, x.g, k);
    check_same(name, "y", &y, 1e-6);
    mgpu_avg_pool2d_backward(dx.c, dy.c, k);
    mgpu_avg_pool2d_backward(dx.g, dy.g, k);
    check_same(name, "dx", &dx, 1e-6);
    pair_free(&x); pair_free(&y); pair_free(&dy); pair_free(&dx);
}

static void global_pool_compare(const char *name, mgpu_shape xs) {
    mgpu_shape ys = mgpu_shape2(xs.d[0], xs.d[1]);
    pair x = pair_randn(xs), y = pair_nan(ys), dy = pair_randn(ys), dx = pair_nan(xs);
    mgpu_global_avg_pool_forward(y.c, x.c);
    mgpu_global_avg_pool_forward(y.g, x.g);
    check_same(name, "y", &y, 1e-5);
    mgpu_global_avg_pool_backward(dx.c, dy.c);
    mgpu_global_avg_pool_backward(dx.g, dy.g);
    check_same(name, "dx", &dx, 1e-6);
    pair_free(&x); pair_free(&y); pair_free(&dy); pair_free(&dx);
}

TEST(pooling) {
    pool_compare("2x2 LeNet 1", mgpu_shape4(256, 20, 26, 26), 2);
    pool_compare("2x2 LeNet 2 (9x9 rounds down)", mgpu_shape4(256, 50, 9, 9), 2);
    pool_compare("3x3 of 9x7", mgpu_shape4(3, 2, 9, 7), 3);
    global_pool_compare("global 4x4", mgpu_shape4(256, 512, 4, 4));
    global_pool_compare("global 7x7", mgpu_shape4(3, 5, 7, 7));
    global_pool_compare("global 28x28", mgpu_shape4(4, 3, 28, 28));
}

/* ------------------------------------------------- ReLU, residual sum */
TEST(relu_and_add) {
    mgpu_shape s = mgpu_shape4(64, 32, 14, 14);
    pair x = pair_randn(s), y = pair_nan(s), dy = pair_randn(s), dx = pair_nan(s);
    mgpu_relu_forward(y.c, x.c);
    mgpu_relu_forward(y.g, x.g);
    check_same("relu", "y", &y, 1e-6);
    mgpu_relu_backward(dx.c, dy.c, x.c);
    mgpu_relu_backward(dx.g, dy.g, x.g);
    check_same("relu", "dx, mask from x", &dx, 1e-6);
    mgpu_fill(dx.c, NAN);
    mgpu_fill(dx.g, NAN);
    mgpu_relu_backward(dx.c, dy.c, y.c);
    mgpu_relu_backward(dx.g, dy.g, y.g);
    check_same("relu", "dx, mask from y", &dx, 1e-6);
    mgpu_add(y.c, x.c, dy.c);
    mgpu_add(y.g, x.g, dy.g);
    check_same("add", "y", &y, 1e-6);
    mgpu_add_relu(y.c, x.c, dy.c);
    mgpu_add_relu(y.g, x.g, dy.g);
    check_same("add_relu", "y", &y, 1e-6);
    pair_free(&x); pair_free(&y); pair_free(&dy); pair_free(&dx);
}

/* ----------------------------------------------------------------- linear */
static void linear_compare(const char *name, mgpu_shape xs, int fout, int bias, int with_dx) {
    int rows = xs.d[0], fin = (int)(mgpu_shape_numel(xs) / (size_t)rows);
    mgpu_shape ws = mgpu_shape2(fin, fout), ys = mgpu_shape2(rows, fout);
    pair x = pair_randn(xs), wt = pair_randn(ws), b = pair_randn(mgpu_shape1(fout));
    pair y = pair_nan(ys), dy = pair_randn(ys);
    pair dx = pair_nan(xs), dw = pair_nan(ws), db = pair_nan(mgpu_shape1(fout));
    mgpu_linear_forward(y.c, x.c, wt.c, on_cpu(&b, bias));
    mgpu_linear_forward(y.g, x.g, wt.g, on_gpu(&b, bias));
    check_same(name, "y", &y, 1e-4);
    for (int accumulate = 0; accumulate <= 1; accumulate++) {
        mgpu_linear_backward(on_cpu(&dx, with_dx), dw.c, on_cpu(&db, bias), dy.c, x.c, wt.c, accumulate);
        mgpu_linear_backward(on_gpu(&dx, with_dx), dw.g, on_gpu(&db, bias), dy.g, x.g, wt.g, accumulate);
        if (with_dx) check_same(name, "dx", &dx, 1e-4);
        check_same(name, accumulate ? "dw accumulated" : "dw", &dw, 1e-4);
        if (bias) check_same(name, accumulate ? "db accumulated" : "db", &db, 1e-5);
    }
    pair_free(&x); pair_free(&wt); pair_free(&b); pair_free(&y); pair_free(&dy);
    pair_free(&dx); pair_free(&dw); pair_free(&db);
}

TEST(linear) {
    linear_compare("LeNet 800 -> 128 of pooled maps", mgpu_shape4(256, 50, 4, 4), 128, 1, 1);
    linear_compare("LeNet 128 -> 10", mgpu_shape2(256, 128), 10, 1, 1);
    linear_compare("ResNet head 512 -> 10", mgpu_shape2(1024, 512), 10, 1, 1);
    linear_compare("odd sizes, no bias, no dx", mgpu_shape2(7, 13), 5, 0, 0);
}

/* ------------------------------------------------------------------- TF32 */
/* TF32 rounds each input of a product to 10 bits of mantissa (relative
   error up to 2^-11 = 4.9e-4) and keeps float32 sums. For a sum of K
   products of standard normal numbers the error is a random walk of K
   such roundings: ~5e-4 * sqrt(K) * 0.8 in absolute terms, against a
   largest output of ~4 sqrt(K), so ~1e-4 of the largest output, a few
   times that at the worst of a million elements. Allowed: 2e-3. And the
   rounding must show: at least 1e-5 and ten times float32's error, so a
   setting that never reaches cuBLAS fails the test. */
static void tf32_compare(const char *name, double tf32_err, double float32_err) {
    if (!(tf32_err <= 2e-3 && tf32_err >= 1e-5 && tf32_err >= 10 * float32_err)) {
        fprintf(stderr, "  %s: error %.3g with TF32, %.3g in float32 (want TF32's in [1e-5, "
                "2e-3] and >= 10x float32's)\n", name, tf32_err, float32_err);
        test__failures++;
    }
}

TEST(tf32_products_are_rounded_but_close) {
    /* a ResNet stage-2 convolution: sums of 64 * 3 * 3 = 576 products, by
       im2col, whose product is cuBLAS's (the implicit GEMMs are TF32 always
       and compared with the CPU below; and on the emulated GPU the trial of
       every kernel took two minutes here) */
    mgpu__conv_settings_from_environment(); /* so that MGPU_CONV is not read after this */
    mgpu__conv_mode = MGPU__CONV_IM2COL;
    mgpu_shape xs = mgpu_shape4(32, 64, 14, 14), ws = mgpu_shape4(64, 64, 3, 3);
    mgpu_shape ys = mgpu_conv2d_output_shape(xs, ws, 1, 1);
    pair x = pair_randn(xs), wt = pair_randn(ws), y = pair_nan(ys);
    mgpu_conv2d_forward(y.c, x.c, wt.c, NULL, 1, 1);
    mgpu_set_tf32(0, 1); /* matmul only: the convolution stays float32 */
    mgpu_conv2d_forward(y.g, x.g, wt.g, NULL, 1, 1);
    double conv32 = check_same("conv, TF32 for matmul only", "y", &y, 1e-4);
    mgpu_set_tf32(1, 0);
    mgpu_conv2d_forward(y.g, x.g, wt.g, NULL, 1, 1);
    tf32_compare("conv", check_same("conv, TF32", "y", &y, 2e-3), conv32);
    pair_free(&x); pair_free(&wt); pair_free(&y);
    mgpu__conv_mode = MGPU__CONV_RULE;

    /* the ResNet head's product: sums of 512 */
    mgpu_shape as = mgpu_shape2(1024, 512), bs = mgpu_shape2(512, 10);
    pair a = pair_randn(as), lw = pair_randn(bs), out = pair_nan(mgpu_shape2(1024, 10));
    mgpu_linear_forward(out.c, a.c, lw.c, NULL);
    mgpu_linear_forward(out.g, a.g, lw.g, NULL); /* (1, 0): the linear layer stays float32 */
    double lin32 = check_same("linear, TF32 for conv only", "y", &out, 1e-4);
    mgpu_set_tf32(0, 1);
    mgpu_linear_forward(out.g, a.g, lw.g, NULL);
    tf32_compare("linear", check_same("linear, TF32", "y", &out, 2e-3), lin32);
    pair_free(&a); pair_free(&lw); pair_free(&out);
    mgpu_set_tf32(0, 0);
}

/* MGPU_CONV=implicit: y, dx and dw by the fast kernels where they fit
   (kernels/conv_nhwc.h, winograd.h, conv_few_inputs.h), else im2col, TF32, at ResNet-18's shapes and at sizes
   that leave partial tiles; within TF32's 2e-3 of the CPU. */
static void implicit_compare(const char *name, int n, int c, int h, int k, int r, int stride,
                             int pad, int bias) {
    mgpu_shape xs = mgpu_shape4(n, c, h, h), ws = mgpu_shape4(k, c, r, r);
    mgpu_shape ys = mgpu_conv2d_output_shape(xs, ws, stride, pad);
    pair x = pair_randn(xs), wt = pair_randn(ws), b = pair_randn(mgpu_shape1(k)), y = pair_nan(ys);
    mgpu_conv2d_forward(y.c, x.c, wt.c, on_cpu(&b, bias), stride, pad);
    mgpu_conv2d_forward(y.g, x.g, wt.g, on_gpu(&b, bias), stride, pad);
    check_same(name, "y", &y, 2e-3);
    pair dy = pair_randn(ys), dx = pair_nan(xs), dw = pair_nan(ws), db = pair_nan(mgpu_shape1(k));
    mgpu_conv2d_backward(dx.c, dw.c, on_cpu(&db, bias), dy.c, x.c, wt.c, stride, pad, 0);
    mgpu_conv2d_backward(dx.g, dw.g, on_gpu(&db, bias), dy.g, x.g, wt.g, stride, pad, 0);
    check_same(name, "dx", &dx, 2e-3);
    check_same(name, "dw", &dw, 2e-3);
    pair_free(&x); pair_free(&wt); pair_free(&b); pair_free(&y);
    pair_free(&dy); pair_free(&dx); pair_free(&dw); pair_free(&db);
}
/* dx of geometry g by `kernel`, against the CPU's (in dx->c): written
   over NaNs, then added to what is there (twice the CPU's); keep_w_t as
   mgpu__conv_dx_implicit takes it. */
static void dx_compare(const char *what, const mgpu__conv_geom *g, mgpu__implicit_kernel kernel, pair *wt,
                       pair *dy, pair *dx, mgpu_tensor **keep_w_t) {
    mgpu_fill(dx->g, NAN);
    mgpu__conv_dx_implicit(dx->g, dy->g, NULL, wt->g, keep_w_t, g, kernel, 0);
    check_same(what, "dx", dx, 2e-3);
    size_t count = dx->c->numel;
    float *twice = (float *)malloc(count * sizeof(float));
    mgpu_to_host(dx->c, twice);
    for (size_t i = 0; i < count; i++) twice[i] *= 2;
    pair added = {mgpu_from_host(dx->c->device, dx->c->shape, twice), dx->g};
    mgpu__conv_dx_implicit(dx->g, dy->g, NULL, wt->g, keep_w_t, g, kernel, 1);
    check_same(what, "dx added to dx", &added, 2e-3);
    mgpu_free(added.c);
    free(twice);
}
/* y and dx by Winograd (kernels/winograd.h) where it fits, against the
   CPU's in y and dx (dx also added to what is there). */
static void winograd_compare(const char *name, const mgpu__conv_geom *g, pair *x, pair *wt, pair *b, pair *y,
                             pair *dy, pair *dx) {
    mgpu__implicit_kernel winograd = mgpu__kernel_of(MGPU__WINOGRAD, MGPU__TILE_64x64, 1, 0);
    char what[96];
    snprintf(what, sizeof what, "%s, Winograd", name);
    if (mgpu__conv_winograd_fits(MGPU__TRY_Y, g)) {
        mgpu_fill(y->g, NAN);
        mgpu__conv_forward_implicit(y->g, x->g, NULL, wt->g, NULL, b->g, g, winograd, NULL);
        check_same(what, "y", y, 2e-3);
    }
    if (mgpu__conv_winograd_fits(MGPU__TRY_DX, g)) dx_compare(what, g, winograd, wt, dy, dx, NULL);
}
static int stride2_checks; /* the input gradients checked by the stride-2 dx kernel below */
/* dx by conv_nhwc.h's stride-2 dx kernel where it fits (3x3, stride 2, padding 1),
   against the CPU's, the turned weights' copy made at the first call and
   kept for the second. */
static void stride2_dx_compare(const char *name, const mgpu__conv_geom *g, pair *wt, pair *dy, pair *dx) {
    if (!mgpu__conv_method_fits(MGPU__STRIDE2_DX, MGPU__TRY_DX, g)) return;
    mgpu__implicit_kernel stride2_dx = mgpu__kernel_of(MGPU__STRIDE2_DX, MGPU__TILE_64x64, 1, 0);
    char what[96];
    snprintf(what, sizeof what, "%s, stride-2 dx kernel", name);
    mgpu_tensor *w_turned_t = NULL;
    dx_compare(what, g, stride2_dx, wt, dy, dx, &w_turned_t);
    CHECK(w_turned_t != NULL);
    mgpu_free(w_turned_t);
    stride2_checks++;
}
static int wgmma_checks; /* the input gradients checked by wgmma below */
/* A convolution of n images of c x h x h, k filters of r x r: its
   geometry, inputs (x, weights, bias, dy) on both sides, and outputs (y,
   dx, dw) computed on the CPU (y with the bias) and NaN on the GPU. */
static void conv_case(const char *name, int n, int c, int h, int k, int r, int stride, int pad, mgpu__conv_geom *g,
                      pair *x, pair *wt, pair *b, pair *y, pair *dy, pair *dx, pair *dw) {
    mgpu_shape xs = mgpu_shape4(n, c, h, h), ws = mgpu_shape4(k, c, r, r);
    mgpu_shape ys = mgpu_conv2d_output_shape(xs, ws, stride, pad);
    *g = mgpu__conv_geometry(name, xs, ws, stride, pad);
    *x = pair_randn(xs), *wt = pair_randn(ws), *b = pair_randn(mgpu_shape1(k)), *y = pair_nan(ys);
    *dy = pair_randn(ys), *dx = pair_nan(xs), *dw = pair_nan(ws);
    mgpu_conv2d_forward(y->c, x->c, wt->c, b->c, stride, pad);
    mgpu_conv2d_backward(dx->c, dw->c, NULL, dy->c, x->c, wt->c, stride, pad, 0);
}
/* Every tile shape of the implicit GEMM, each launched directly (the
   library keeps the fastest per pass, so some may never run above),
   where it fits. */
static void implicit_tiles_compare(const char *name, int n, int c, int h, int k, int r, int stride,
                                   int pad) {
    mgpu__conv_geom g;
    pair x, wt, b, y, dy, dx, dw;
    conv_case(name, n, c, h, k, r, stride, pad, &g, &x, &wt, &b, &y, &dy, &dx, &dw);
    for (int kind = 0; kind < MGPU__TILE_KINDS; kind++) {
        mgpu__implicit_tile tile = (mgpu__implicit_tile)kind;
        char what[96];
        snprintf(what, sizeof what, "%s, tile %s", name, mgpu__implicit_tile_names[tile]);
        mgpu_fill(y.g, NAN);
        mgpu_fill(dx.g, NAN);
        mgpu_fill(dw.g, NAN);
        mgpu__implicit_kernel channels_last = mgpu__kernel_of(MGPU__DIRECT, tile, 1, 0);
        mgpu__implicit_kernel sliced = mgpu__kernel_of(MGPU__DIRECT, tile, 2, 0); /* the sum in 2 slices */
        mgpu_tensor *x_t = NULL; /* the forward's copy of x, kept for dW */
        mgpu_tensor *w_t = NULL, *w_turned_t = NULL; /* the weights' copies, kept for the next call */
        if (mgpu__conv_nhwc_fits(&g)) {
            mgpu_fill(y.g, NAN);
            mgpu__conv_forward_implicit(y.g, x.g, NULL, wt.g, &w_t, b.g, &g, channels_last, &x_t);
            check_same(what, "y", &y, 2e-3);
            mgpu_fill(y.g, NAN);
            mgpu__conv_forward_implicit(y.g, x.g, x_t, wt.g, &w_t, b.g, &g, sliced, NULL);
            check_same(what, "y in 2 slices, from the kept copies of x and w", &y, 2e-3);
        }
        if (mgpu__conv_nhwc_dx_fits(&g)) {
            mgpu_fill(dx.g, NAN);
            mgpu__conv_dx_implicit(dx.g, dy.g, NULL, wt.g, &w_turned_t, &g, channels_last, 0);
            check_same(what, "dx", &dx, 2e-3);
            CHECK((w_turned_t != NULL) == (stride == 1)); /* (the sub-pixel classes take their own) */
            mgpu_fill(dx.g, NAN);
            mgpu__conv_dx_implicit(dx.g, dy.g, NULL, wt.g, &w_turned_t, &g, sliced, 0);
            check_same(what, "dx in 2 slices, from the kept copy of w", &dx, 2e-3);
        }
        /* by wgmma, where the GPU has it (sm_90a code on an H100 or H200,
           and the emulator): whole and in 2 slices */
        for (int splits = 1; splits <= 2 && mgpu__wgmma_tile_fits(tile) && mgpu__wgmma_runs(x.g->device); splits++) {
            mgpu__implicit_kernel by_wgmma = mgpu__kernel_of(MGPU__DIRECT, tile, splits, 1);
            char how[160];
            snprintf(how, sizeof how, "%s by wgmma, %d slices", what, splits);
            if (mgpu__conv_nhwc_fits(&g)) {
                mgpu_fill(y.g, NAN);
                mgpu__conv_forward_implicit(y.g, x.g, NULL, wt.g, NULL, b.g, &g, by_wgmma, NULL);
                check_same(how, "y", &y, 2e-3);
            }
            if (mgpu__conv_nhwc_dx_fits(&g)) {
                mgpu_fill(dx.g, NAN);
                mgpu__conv_dx_implicit(dx.g, dy.g, NULL, wt.g, NULL, &g, by_wgmma, 0);
                check_same(how, "dx", &dx, 2e-3);
                wgmma_checks++;
            }
        }
        if (mgpu__conv_nhwc_dw_fits(&g)) {
            mgpu_fill(dw.g, NAN);
            mgpu__conv_dw_implicit(dw.g, dy.g, NULL, x.g, NULL, &g, 0, channels_last);
            check_same(what, "dw", &dw, 2e-3);
            if (x_t) { /* from the forward's copy of x */
                mgpu_fill(dw.g, NAN);
                mgpu__conv_dw_implicit(dw.g, dy.g, NULL, x.g, x_t, &g, 0, sliced);
                check_same(what, "dw in 2 slices, from the forward's x_t", &dw, 2e-3);
            }
        }
        mgpu_free(x_t);
        mgpu_free(w_t);
        mgpu_free(w_turned_t);
    }
    winograd_compare(name, &g, &x, &wt, &b, &y, &dy, &dx);
    stride2_dx_compare(name, &g, &wt, &dy, &dx);
    pair_free(&x); pair_free(&wt); pair_free(&b); pair_free(&y);
    pair_free(&dy); pair_free(&dx); pair_free(&dw);
}
TEST_REAL_GPU(implicit_gemm_convolution) { /* emulated: 6 minutes */
    stride2_checks = 0; /* this test's own */
    mgpu__conv_settings_from_environment(); /* so that MGPU_CONV is not read after this */
    mgpu__conv_mode = MGPU__CONV_IMPLICIT;
    mgpu_set_tf32(1, 0);
    /*               name                   N    C   H    K  R  t  d  bias */
    implicit_compare("stem",                64,  1, 28,  64, 3, 1, 1, 1);
    implicit_compare("stage 1",             32, 64, 28,  64, 3, 1, 1, 1);
    implicit_compare("downsampling 3x3",    32, 64, 28, 128, 3, 2, 1, 0);
    implicit_compare("1x1 shortcut",        32, 64, 28, 128, 1, 2, 0, 1);
    implicit_compare("stage 4",             16, 512, 4, 512, 3, 1, 1, 1);
    implicit_compare("partial tiles",        3,  5, 11,  70, 3, 2, 2, 1);
    /*                     name                N    C   H    K  R  t  d */
    implicit_tiles_compare("stage 1",          32, 64, 28,  64, 3, 1, 1);
    implicit_tiles_compare("downsampling 3x3", 32, 64, 28, 128, 3, 2, 1);
    implicit_tiles_compare("1x1 shortcut",     32, 64, 28, 128, 1, 2, 0);
    implicit_tiles_compare("stage 3",          32, 256, 7, 256, 3, 1, 1);
    implicit_tiles_compare("stage 4",          16, 512, 4, 512, 3, 1, 1);
    implicit_tiles_compare("partial tiles",     3, 96, 11,  96, 3, 1, 2);
    implicit_tiles_compare("stage 4 /2",       16, 256, 7, 512, 3, 2, 1); /* dx 7 x 7: odd */
    CHECK_EQ_INT(stride2_checks, 2); /* the two 3x3 convolutions at stride 2 */
    if (mgpu__wgmma_runs(gpu)) {
        printf("  wgmma: %d input gradients checked by the direct kernels\n", wgmma_checks);
        CHECK(wgmma_checks > 0);
    }
    else printf("  (no wgmma kernels on this GPU: they need sm_90a code and compute capability 9.0)\n");
    mgpu_set_tf32(0, 0);
    mgpu__conv_mode = MGPU__CONV_RULE;
}
/* A convolution's forward and backward passes (dW and db accumulated) on
   the CPU and on the GPU with MGPU_CONV=mode, twice: the trials, then the
   plans remembered (the second round traced). The trials must leave the
   results as one algorithm alone would (the weight gradient accumulated
   once), within TF32's tolerance of the CPU. Prints the plans, and
   returns the index of the first (forward, then backward). */
static int conv_twice_by(mgpu__conv_mode_kind mode, const char *label, mgpu_shape xs, mgpu_shape ws) {
    mgpu__conv_settings_from_environment();
    mgpu__conv_mode = mode;
    mgpu_set_tf32(1, 0);
    int k = ws.d[0];
    mgpu_shape ys = mgpu_conv2d_output_shape(xs, ws, 1, 1);
    pair x = pair_randn(xs), wt = pair_randn(ws), b = pair_randn(mgpu_shape1(k)), y = pair_nan(ys);
    pair dy = pair_randn(ys), dx = pair_nan(xs), dw = pair_randn(ws), db = pair_randn(mgpu_shape1(k));
    int before = mgpu__conv_choice_count;
    for (int round = 0; round < 2; round++) {
        mgpu_conv2d_forward(y.c, x.c, wt.c, b.c, 1, 1);
        mgpu_conv2d_backward(dx.c, dw.c, db.c, dy.c, x.c, wt.c, 1, 1, 1);
        if (round == 1) mgpu_trace_begin();
        mgpu_conv2d_forward(y.g, x.g, wt.g, b.g, 1, 1);
        mgpu_conv2d_backward(dx.g, dw.g, db.g, dy.g, x.g, wt.g, 1, 1, 1);
        if (round == 1) mgpu_trace_end();
        CHECK_EQ_INT(mgpu__conv_choice_count, before + 2);
        check_same(label, "y", &y, 2e-3);
        check_same(label, "dx", &dx, 2e-3);
        check_same(label, "dw, accumulated", &dw, 2e-3);
        check_same(label, "db, accumulated", &db, 1e-5);
    }
    for (int i = before; i < mgpu__conv_choice_count; i++) {
        char plan[200];
        printf("  %s: %s\n", label, mgpu__conv_choice_str(&mgpu__conv_choices[i], plan, sizeof plan));
    }
    pair_free(&x); pair_free(&wt); pair_free(&b); pair_free(&y);
    pair_free(&dy); pair_free(&dx); pair_free(&dw); pair_free(&db);
    mgpu_set_tf32(0, 0);
    mgpu__conv_mode = MGPU__CONV_RULE;
    return before;
}
/* MGPU_CONV=timed: the first call with a shape times im2col and every
   tile and remembers the fastest. */
TEST_LONG(conv_algorithm_chosen_by_measuring) {
    if (!mgpu__conv_implicit_available()) return; /* a GPU before sm_80: im2col only */
    /* small: on the emulated GPU every trial takes seconds */
    conv_twice_by(MGPU__CONV_TIMED, "timed", mgpu_shape4(2, 64, 8, 8), mgpu_shape4(64, 64, 3, 3));
}

/* The slices of the sum the trial times a pass of a ResNet-18 convolution
   (batch 256) in, with one tile, by the direct kernel, into splits;
   returns how many (and in *winograd, whether it times Winograd too). */
static int candidate_slices(mgpu__conv_try what, mgpu__implicit_tile tile, const mgpu__conv_geom *g, int *splits,
                            int *winograd) {
    mgpu__implicit_kernel list[MGPU__CANDIDATES];
    int count = mgpu__conv_candidates(what, g, 0, list), found = 0;
    *winograd = 0;
    for (int j = 0; j < count; j++)
        if (list[j].method == MGPU__WINOGRAD) *winograd += 1;
        else if (list[j].tile == tile && list[j].method == MGPU__DIRECT)
            splits[found++] = list[j].splits;
    return found;
}
static void check_slices(const char *what, const int *got, int count, const int *want, int wanted) {
    int same = count == wanted;
    for (int i = 0; same && i < count; i++) same = got[i] == want[i];
    if (!same) {
        fprintf(stderr, "  %s: slices", what);
        for (int i = 0; i < count; i++) fprintf(stderr, " %d", got[i]);
        fprintf(stderr, "; want");
        for (int i = 0; i < wanted; i++) fprintf(stderr, " %d", want[i]);
        fprintf(stderr, "\n");
    }
    CHECK(same);
}
/* The trial's candidates: the channels-last forward and dx sliced where
   every slice keeps at least 8 steps of 32 terms and the partials fit in
   16M floats; the channels-last dW in
   distinct slices of its pixels, for 256 to 1536 blocks of at least 512
   pixels; for the forward pass and dx of 3x3 convolutions at stride 1,
   Winograd with 256 channels and filters or more. */
TEST(trial_candidates_slice_the_sums) {
    int got[MGPU__CANDIDATES], winograd;
    const mgpu__conv_geom stage4 =
        mgpu__conv_geometry("stage 4", mgpu_shape4(256, 512, 4, 4), mgpu_shape4(512, 512, 3, 3), 1, 1);
    const mgpu__conv_geom stage1 =
        mgpu__conv_geometry("stage 1", mgpu_shape4(256, 64, 28, 28), mgpu_shape4(64, 64, 3, 3), 1, 1);
    const mgpu__conv_geom stage3 =
        mgpu__conv_geometry("stage 3", mgpu_shape4(256, 256, 7, 7), mgpu_shape4(256, 256, 3, 3), 1, 1);
    const mgpu__conv_geom stage3_down =
        mgpu__conv_geometry("stage 3 /2", mgpu_shape4(256, 128, 14, 14), mgpu_shape4(256, 128, 3, 3), 2, 1);
    /* stage 4's 3x3: 512 * 9 / 32 = 144 steps, every choice up to 8 slices */
    const int all[] = {1, 2, 3, 4, 6, 8}, two[] = {1, 2}, whole[] = {1};
    int n = candidate_slices(MGPU__TRY_Y, MGPU__TILE_128x128, &stage4, got, &winograd);
    check_slices("stage 4, y", got, n, all, 6);
    CHECK_EQ_INT(winograd, 1); /* 3x3 at stride 1, 512 channels: Winograd too */
    n = candidate_slices(MGPU__TRY_DX, MGPU__TILE_128x128, &stage4, got, &winograd);
    check_slices("stage 4, dx", got, n, all, 6);
    CHECK_EQ_INT(winograd, 1);
    /* stage 3's 3x3: 72 steps, but 6 slices' partials of 256 x 12544
       would pass 16M floats */
    const int four[] = {1, 2, 3, 4};
    n = candidate_slices(MGPU__TRY_Y, MGPU__TILE_64x128, &stage3, got, &winograd);
    check_slices("stage 3, y", got, n, four, 4);
    CHECK_EQ_INT(winograd, 1);
    /* stage 1's 3x3: 64 * 9 / 32 = 18 steps would make 2 slices of 9, but
       their partials, 2 x 64 x 200704 floats, pass 16M: whole only */
    n = candidate_slices(MGPU__TRY_DX, MGPU__TILE_64x64, &stage1, got, &winograd);
    check_slices("stage 1, dx", got, n, whole, 1);
    CHECK_EQ_INT(winograd, 0); /* (it fits, but 64 channels are too few to pay) */
    /* stage 3's stride-2 3x3 dx: 4 sub-pixel classes of about 256 * 9 / 4
       terms, 18 steps: 2 slices of 9 and no more */
    n = candidate_slices(MGPU__TRY_DX, MGPU__TILE_64x128, &stage3_down, got, &winograd);
    check_slices("stage 3, stride 2, dx", got, n, two, 2);
    CHECK_EQ_INT(winograd, 0);
    /* stage 4's dW in 64 x 128 tiles: 8 x 36 = 288 tiles; 1 slice for 256
       and 384 blocks, 2 for 512 (the default) ..., 6 for 1536 */
    const int stage4_dw[] = {1, 2, 3, 4, 6};
    n = candidate_slices(MGPU__TRY_DW, MGPU__TILE_64x128, &stage4, got, &winograd);
    check_slices("stage 4, dW", got, n, stage4_dw, 5);
    CHECK_EQ_INT(winograd, 0);
    /* in 128 x 128 tiles (144): 11 slices for 1536 blocks, but the
       partials are kept under 16M floats: 7 slices of 512 x 4608 */
    const int stage4_dw_128[] = {2, 3, 4, 6, 7};
    n = candidate_slices(MGPU__TRY_DW, MGPU__TILE_128x128, &stage4, got, &winograd);
    check_slices("stage 4, dW, 128 x 128", got, n, stage4_dw_128, 5);
    /* stage 1's dW: 5 tiles of 64 x 128 (576 columns); 52 slices of
       3872 pixels for 256 blocks ... 308 for 1536 */
    const int stage1_dw[] = {52, 77, 103, 154, 205, 308};
    n = candidate_slices(MGPU__TRY_DW, MGPU__TILE_64x128, &stage1, got, &winograd);
    check_slices("stage 1, dW", got, n, stage1_dw, 6);
    /* with wgmma asked for: the channels-last kernels again by wgmma, in
       its two tiles, sliced as by mma.sync: stage 4's y in 6 slicings
       each; stage 3's stride-2 dx in 2; never dW */
    mgpu__implicit_kernel list[MGPU__CANDIDATES];
    int plain = mgpu__conv_candidates(MGPU__TRY_Y, &stage4, 0, list);
    int count = mgpu__conv_candidates(MGPU__TRY_Y, &stage4, 1, list), by_wgmma = 0;
    CHECK_EQ_INT(count - plain, 2 * 6);
    for (int j = 0; j < count; j++) {
        if (!list[j].wgmma) continue;
        CHECK(mgpu__wgmma_tile_fits(list[j].tile) && list[j].method == MGPU__DIRECT &&
              list[j].splits == all[by_wgmma % 6]);
        by_wgmma++;
    }
    CHECK_EQ_INT(by_wgmma, 2 * 6);
    plain = mgpu__conv_candidates(MGPU__TRY_DX, &stage3_down, 0, list);
    CHECK_EQ_INT(mgpu__conv_candidates(MGPU__TRY_DX, &stage3_down, 1, list) - plain, 2 * 2);
    plain = mgpu__conv_candidates(MGPU__TRY_DW, &stage4, 0, list);
    CHECK_EQ_INT(mgpu__conv_candidates(MGPU__TRY_DW, &stage4, 1, list), plain);
}

/* conv_few_inputs.h's kernels are candidates where C*R*S <= 9, for the
   forward pass and dW (not dx): ResNet-18's stem, not stage 1. */
static int lists_method(mgpu__conv_method method, mgpu__conv_try what, const mgpu__conv_geom *g) {
    mgpu__implicit_kernel list[MGPU__CANDIDATES];
    int count = mgpu__conv_candidates(what, g, 0, list), found = 0;
    for (int j = 0; j < count; j++) found += list[j].method == method;
    return found;
}
static int lists_few_inputs(mgpu__conv_try what, const mgpu__conv_geom *g) {
    return lists_method(MGPU__FEW_INPUTS, what, g);
}
TEST(trial_candidates_few_inputs) {
    const mgpu__conv_geom stem =
        mgpu__conv_geometry("stem", mgpu_shape4(256, 1, 28, 28), mgpu_shape4(64, 1, 3, 3), 1, 1);
    const mgpu__conv_geom stage1 =
        mgpu__conv_geometry("stage 1", mgpu_shape4(256, 64, 28, 28), mgpu_shape4(64, 64, 3, 3), 1, 1);
    CHECK_EQ_INT(lists_few_inputs(MGPU__TRY_Y, &stem), 1);
    CHECK_EQ_INT(lists_few_inputs(MGPU__TRY_DW, &stem), 1);
    CHECK_EQ_INT(lists_few_inputs(MGPU__TRY_DX, &stem), 0);
    CHECK_EQ_INT(lists_few_inputs(MGPU__TRY_Y, &stage1), 0);
    CHECK_EQ_INT(lists_few_inputs(MGPU__TRY_DW, &stage1), 0);
}

/* The stride-2 dx kernel is one candidate for dx of ResNet's 3x3 convolutions at
   stride 2 (padding 1), and of nothing else: not their forward pass or
   dW, not the 1x1 shortcuts at stride 2, not stride 1, not padding 0.
   They read the weights' turned copy, which the trial then makes and
   charges them for; the sub-pixel classes at stride 2 (their own taps)
   and Winograd are not charged for it. */
TEST(trial_candidates_stride2_dx) {
    mgpu_shape stage2_in = mgpu_shape4(256, 64, 28, 28);
    mgpu__conv_geom down = mgpu__conv_geometry("stage 2 /2", stage2_in, mgpu_shape4(128, 64, 3, 3), 2, 1);
    mgpu__conv_geom stage4_down =
        mgpu__conv_geometry("stage 4 /2", mgpu_shape4(256, 256, 7, 7), mgpu_shape4(512, 256, 3, 3), 2, 1);
    mgpu__conv_geom shortcut = mgpu__conv_geometry("1x1 /2", stage2_in, mgpu_shape4(128, 64, 1, 1), 2, 0);
    mgpu__conv_geom unpadded = mgpu__conv_geometry("pad 0", stage2_in, mgpu_shape4(128, 64, 3, 3), 2, 0);
    mgpu__conv_geom stage1 = mgpu__conv_geometry("stage 1", stage2_in, mgpu_shape4(64, 64, 3, 3), 1, 1);
    CHECK_EQ_INT(lists_method(MGPU__STRIDE2_DX, MGPU__TRY_DX, &down), 1);
    CHECK_EQ_INT(lists_method(MGPU__STRIDE2_DX, MGPU__TRY_DX, &stage4_down), 1);
    CHECK_EQ_INT(lists_method(MGPU__STRIDE2_DX, MGPU__TRY_Y, &down), 0);
    CHECK_EQ_INT(lists_method(MGPU__STRIDE2_DX, MGPU__TRY_DW, &down), 0);
    CHECK_EQ_INT(lists_method(MGPU__STRIDE2_DX, MGPU__TRY_DX, &shortcut), 0);
    CHECK_EQ_INT(lists_method(MGPU__STRIDE2_DX, MGPU__TRY_DX, &unpadded), 0);
    CHECK_EQ_INT(lists_method(MGPU__STRIDE2_DX, MGPU__TRY_DX, &stage1), 0);
    CHECK(mgpu__conv_dx_reads_turned_weights(&down) && mgpu__conv_dx_reads_turned_weights(&stage1));
    CHECK(!mgpu__conv_dx_reads_turned_weights(&shortcut));
    mgpu__implicit_kernel stride2_dx = mgpu__kernel_of(MGPU__STRIDE2_DX, MGPU__TILE_64x64, 1, 0);
    mgpu__implicit_kernel classes = mgpu__kernel_of(MGPU__DIRECT, MGPU__TILE_64x128, 1, 0);
    mgpu__implicit_kernel winograd = mgpu__kernel_of(MGPU__WINOGRAD, MGPU__TILE_64x64, 1, 0);
    CHECK(mgpu__conv_reads_weights_copy(MGPU__TRY_DX, &down, stride2_dx));
    CHECK(!mgpu__conv_reads_weights_copy(MGPU__TRY_DX, &down, classes));
    CHECK(mgpu__conv_reads_weights_copy(MGPU__TRY_Y, &down, classes));
    CHECK(mgpu__conv_reads_weights_copy(MGPU__TRY_DX, &stage1, classes));
    CHECK(!mgpu__conv_reads_weights_copy(MGPU__TRY_DX, &stage1, winograd));
}
/* MGPU_CONV=rule, the default: a plan fixed by the shape (and whether the
   GPU has wgmma, which the emulated one has not), asked of no clock. At
   ResNet-18's shapes: few inputs for the stem, the 64 x 128 tile, quads
   for dx at stride 2, im2col at stage 4's 4 x 4 outputs. Then a
   convolution by rule through the public calls against the CPU. ("@"
   in a plan below: " wgmma" where the GPU has it.) */
TEST(conv_plan_by_rule) {
    if (!mgpu__conv_implicit_available()) return; /* a GPU before sm_80: im2col only */
    struct { mgpu_shape x, w; int stride, pad, backward; const char *plan; } cases[] = {
        {mgpu_shape4(256, 1, 28, 28), mgpu_shape4(64, 1, 3, 3), 1, 1, 0, "forward by few inputs"},
        {mgpu_shape4(256, 1, 28, 28), mgpu_shape4(64, 1, 3, 3), 1, 1, 1, "dx by -, dW by few inputs"},
        {mgpu_shape4(256, 64, 28, 28), mgpu_shape4(64, 64, 3, 3), 1, 1, 0, "forward by channels-last 64x128@"},
        {mgpu_shape4(256, 64, 28, 28), mgpu_shape4(64, 64, 3, 3), 1, 1, 1,
         "dx by channels-last 64x128@, dW by channels-last 64x128"},
        {mgpu_shape4(256, 64, 28, 28), mgpu_shape4(128, 64, 3, 3), 2, 1, 1,
         "dx by channels-last stride-2 dx, dW by channels-last 64x128"},
        {mgpu_shape4(256, 256, 7, 7), mgpu_shape4(512, 256, 3, 3), 2, 1, 0, "forward by im2col"},
        {mgpu_shape4(256, 512, 4, 4), mgpu_shape4(512, 512, 3, 3), 1, 1, 1, "backward by im2col"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        mgpu__conv_geom g = mgpu__conv_geometry("rule", cases[i].x, cases[i].w, cases[i].stride, cases[i].pad);
        int with_dx = cases[i].backward && cases[i].x.d[1] > 1;
        mgpu__conv_choice c = {g, cases[i].backward, with_dx,
                               mgpu__conv_plan_by_rule(gpu, &g, cases[i].backward, with_dx)};
        char plan[200];
        mgpu__conv_choice_str(&c, plan, sizeof plan);
        char want[200];
        size_t at = 0;
        for (const char *p = cases[i].plan; *p && at + 8 < sizeof want; p++)
            at += *p != '@' ? (size_t)snprintf(want + at, 2, "%c", *p)
                            : (size_t)snprintf(want + at, 7, "%s", mgpu__wgmma_usable(gpu) ? " wgmma" : "");
        const char *by = strstr(plan, ": ") + 2;
        if (strcmp(by, want) != 0) {
            fprintf(stderr, "  %s: want %s\n", plan, want);
            test__failures++;
        }
    }
    /* (a shape no other test plans: the plans are remembered by shape, and a
       whole run would find conv_algorithm_chosen_by_measuring's) */
    conv_twice_by(MGPU__CONV_RULE, "rule", mgpu_shape4(2, 64, 6, 6), mgpu_shape4(64, 64, 3, 3));
}

/* A first layer (1 channel, 3x3, 20 filters: two groups of the forward's
   16, five of dW's 4) whose plan takes conv_few_inputs.h's kernels (set by
   hand), through the public calls: y, and dW written and added to, in
   float32 (1e-5: TF32 would miss it by some 1e-3), by those kernels (as
   the trace names them). */
static int traced_calls(const char *name) {
    int calls = 0;
    for (int i = 0; i < mgpu__library.trace_n; i++) calls += strcmp(mgpu__library.trace[i].name, name) == 0;
    return calls;
}
/* Sets g's plan by hand, for its forward pass and its backward pass
   without dx; returns the count of choices to go back to. */
static int plan_by_hand(const mgpu__conv_geom *g, mgpu__conv_plan plan) {
    int before = mgpu__conv_choice_count;
    for (int backward = 0; backward <= 1; backward++) {
        mgpu__conv_choice c = {*g, backward, 0, plan};
        mgpu__conv_choices[mgpu__conv_choice_count++] = c;
    }
    return before;
}
/* dW of a backward pass without dx whose plan is set by hand, written and
   then added to, against the CPU within tol, and by the kernel the trace
   names `traced`. */
static void check_dw_by(const char *what, pair *dw, pair *dy, pair *x, pair *wt, double tol, const char *traced) {
    for (int accumulate = 0; accumulate <= 1; accumulate++) {
        mgpu_conv2d_backward(NULL, dw->c, NULL, dy->c, x->c, wt->c, 1, 1, accumulate);
        mgpu_trace_begin();
        mgpu_conv2d_backward(NULL, dw->g, NULL, dy->g, x->g, wt->g, 1, 1, accumulate);
        mgpu_trace_end();
        check_same(what, accumulate ? "dw added" : "dw", dw, tol);
        CHECK_EQ_INT(traced_calls(traced), 1);
    }
}
TEST(first_layer_by_few_inputs) {
    mgpu__conv_settings_from_environment();
    mgpu_set_tf32(1, 0);
    mgpu_shape xs = mgpu_shape4(3, 1, 17, 15), ws = mgpu_shape4(20, 1, 3, 3);
    mgpu_shape ys = mgpu_conv2d_output_shape(xs, ws, 1, 1);
    mgpu__conv_geom g = mgpu__conv_geometry("first", xs, ws, 1, 1);
    mgpu__implicit_kernel few = mgpu__kernel_of(MGPU__FEW_INPUTS, MGPU__TILE_64x64, 1, 0);
    mgpu__conv_plan plan = {1, 0, 0, few, few, few};
    int before = plan_by_hand(&g, plan);
    pair x = pair_randn(xs), wt = pair_randn(ws), b = pair_randn(mgpu_shape1(20)), y = pair_nan(ys);
    pair dy = pair_randn(ys), dw = pair_nan(ws);
    mgpu_conv2d_forward(y.c, x.c, wt.c, b.c, 1, 1);
    mgpu_trace_begin();
    mgpu_conv2d_forward(y.g, x.g, wt.g, b.g, 1, 1);
    mgpu_trace_end();
    check_same("first layer, few inputs", "y", &y, 1e-5);
    CHECK_EQ_INT(traced_calls("conv2d few inputs"), 1);
    check_dw_by("first layer, few inputs", &dw, &dy, &x, &wt, 1e-5, "conv2d_backward few inputs dW");
    mgpu__conv_choice_count = before;
    pair_free(&x); pair_free(&wt); pair_free(&b); pair_free(&y);
    pair_free(&dy); pair_free(&dw);
    mgpu_set_tf32(0, 0);
}


/* Each gradient by its half of the im2col path alone (the plan's
   dx_im2col and dw_im2col), in TF32: the same as the CPU's whole backward
   pass, dW added to what was there, and neither half touching the
   other's gradient. Stride 2, and 4 chunks of images (a small im2col
   scratch), so that the chunks after the first add to dW. */
TEST(conv_backward_im2col_halves) {
    mgpu__conv_settings_from_environment();
    size_t scratch = mgpu__conv_scratch_floats[1];
    mgpu__conv_scratch_floats[1] = (size_t)1 << 16; /* 3 images' col buffers of 18432 floats */
    mgpu_set_tf32(1, 0);
    mgpu_shape xs = mgpu_shape4(12, 32, 15, 15), ws = mgpu_shape4(40, 32, 3, 3);
    mgpu_shape ys = mgpu_conv2d_output_shape(xs, ws, 2, 1);
    mgpu__conv_geom g = mgpu__conv_geometry("halves", xs, ws, 2, 1);
    pair x = pair_randn(xs), wt = pair_randn(ws), dy = pair_randn(ys), dx = pair_nan(xs), dw = pair_randn(ws);
    mgpu_conv2d_backward(dx.c, dw.c, NULL, dy.c, x.c, wt.c, 2, 1, 1);
    pair dw_kept = {mgpu_to(dw.g, gpu, 0), dw.g};
    mgpu__conv_backward_im2col(dx.g, NULL, dy.g, x.g, wt.g, &g, 1, 0, 0);
    check_same("im2col, dx alone", "dw untouched", &dw_kept, 0);
    pair dx_kept = {mgpu_to(dx.g, gpu, 0), dx.g};
    mgpu__conv_backward_im2col(NULL, dw.g, dy.g, x.g, wt.g, &g, 1, 1, 0);
    check_same("im2col, dW alone", "dx untouched", &dx_kept, 0);
    check_same("im2col, dx alone", "dx", &dx, 2e-3);
    check_same("im2col, dW alone", "dw, accumulated", &dw, 2e-3);
    mgpu_free(dw_kept.c);
    mgpu_free(dx_kept.c);
    pair_free(&x); pair_free(&wt); pair_free(&dy); pair_free(&dx); pair_free(&dw);
    mgpu_set_tf32(0, 0);
    mgpu__conv_scratch_floats[1] = scratch;
}

/* small enough for compute-sanitizer (bench/gpu_session.sh sanitize) */
TEST_LONG(implicit_gemm_small_tiles) {
    mgpu_set_tf32(1, 0);
    stride2_checks = 0;
    implicit_tiles_compare("partial tiles", 3, 130, 11, 140, 3, 2, 2);
    implicit_tiles_compare("channels-last", 2, 64, 9, 96, 3, 1, 1); /* y, dx and dW channels-last too */
    implicit_tiles_compare("channels-last, stride 2", 2, 32, 9, 64, 3, 2, 1); /* dx by sub-pixels, and the stride-2 dx kernel */
    implicit_tiles_compare("Winograd, padding 0", 2, 32, 8, 64, 3, 1, 0); /* (y 6x6; dx padded by 2) */
    implicit_tiles_compare("Winograd, padding 2", 1, 64, 5, 32, 3, 1, 2); /* (y 7x7, dx 5x5: half tiles) */
    if (mgpu__wgmma_runs(gpu)) CHECK(wgmma_checks > 0); /* (the emulator's GPUs run them) */
    CHECK_EQ_INT(stride2_checks, 1);
    mgpu_set_tf32(0, 0);
}

/* A network's convolution keeps the channels-last copy of its input that
   a channels-last forward made, and its weight gradient reads that copy
   instead of making another. The plans are set by hand (the trials would
   choose by time): channels-last for y, dx and dW, then im2col, after
   which no copy may be kept. */
TEST(conv_layer_keeps_the_forwards_channels_last_copy) {
    if (!mgpu__conv_implicit_available()) return; /* a GPU before sm_80: im2col only */
    mgpu__conv_settings_from_environment();
    mgpu_set_tf32(1, 0);
    mgpu_shape xs = mgpu_shape4(2, 32, 6, 6);
    mgpu__conv_geom g = mgpu__conv_geometry("keep", xs, mgpu_shape4(32, 32, 3, 3), 1, 1);
    mgpu__implicit_kernel cl = mgpu__kernel_of(MGPU__DIRECT, MGPU__TILE_64x64, 1, 0);
    mgpu__conv_plan plan = {1, 0, 0, cl, cl, cl};
    int before = mgpu__conv_choice_count;
    mgpu__conv_choice forward = {g, 0, 0, plan}, backward = {g, 1, 1, plan};
    mgpu__conv_choices[mgpu__conv_choice_count++] = forward;
    mgpu__conv_choices[mgpu__conv_choice_count++] = backward;
    mgpu_manual_seed(9);
    mgpu_layer *on_c = mgpu__conv_new("conv", 32, 32, 3, 1, 1, mgpu_cpu());
    mgpu_layer *on_g = mgpu__layer_clone(on_c, gpu, 0);
    pair x = pair_randn(xs), dy = pair_randn(mgpu_shape4(2, 32, 6, 6));
    mgpu__layer_forward(on_c, x.c, NULL, NULL, 1);
    mgpu__layer_forward(on_g, x.g, NULL, NULL, 1);
    CHECK(on_g->copies->input_t != NULL);
    CHECK(on_c->copies->input_t == NULL); /* the CPU takes im2col */
    pair y = {on_c->output, on_g->output};
    check_same("kept x_t", "y", &y, 2e-3);
    mgpu__layer_backward(on_c, dy.c, NULL, NULL, NULL, 1);
    mgpu__layer_backward(on_g, dy.g, NULL, NULL, NULL, 1);
    pair dx = {on_c->dinput, on_g->dinput}, dw = {on_c->weight.grad, on_g->weight.grad};
    pair db = {on_c->bias.grad, on_g->bias.grad};
    check_same("kept x_t", "dx", &dx, 2e-3);
    check_same("kept x_t", "dw", &dw, 2e-3);
    check_same("kept x_t", "db", &db, 1e-5);
    mgpu__conv_choices[before].plan.implicit = 0; /* the forward by im2col: no copy */
    mgpu__layer_forward(on_g, x.g, NULL, NULL, 1);
    CHECK(on_g->copies->input_t == NULL);
    mgpu__conv_choice_count = before;
    mgpu__layer_free(on_c, 0);
    mgpu__layer_free(on_g, 0);
    pair_free(&x);
    pair_free(&dy);
    mgpu_set_tf32(0, 0);
}

/* A residual block's input gradient is the skip path's plus conv1's, which
   conv1's backward pass adds to the skip path's as it writes it. Checked
   against the CPU for each way dx can run (im2col, channels-last whole,
   in slices, by wgmma), in a block with the identity shortcut and in one
   with the 1x1 stride-2 convolution (whose channels-last dx takes the
   sub-pixel classes, three of them without taps; conv1's takes the stride-2 dx kernel
   when asked, as the trace shows). Plans set by hand,
   as above. */
static mgpu__conv_method method_where_it_fits(mgpu__conv_method method, mgpu__conv_try what,
                                              const mgpu__conv_geom *g) {
    return mgpu__conv_method_fits(method, what, g) ? method : MGPU__DIRECT;
}
static void residual_block_compare(int stride, mgpu__implicit_kernel kernel, int dx_im2col) {
    mgpu_shape xs = mgpu_shape4(2, 32, 6, 6);
    int out_hw = stride == 1 ? 6 : 3;
    mgpu__conv_geom g1 = mgpu__conv_geometry("block", xs, mgpu_shape4(32, 32, 3, 3), stride, 1);
    mgpu__conv_geom g2 = mgpu__conv_geometry("block", mgpu_shape4(2, 32, out_hw, out_hw),
                                             mgpu_shape4(32, 32, 3, 3), 1, 1);
    mgpu__conv_geom g3 = mgpu__conv_geometry("block", xs, mgpu_shape4(32, 32, 1, 1), stride, 0);
    int before = mgpu__conv_choice_count;
    const mgpu__conv_geom *geoms[] = {&g1, &g2, &g3};
    for (int i = 0; i < 3; i++)
        for (int backward = 0; backward <= 1; backward++) {
            mgpu__conv_plan plan = {1, dx_im2col, 0, kernel, kernel, kernel}; /* (dx by the stride-2 dx kernel: conv1 alone) */
            plan.dx.method = kernel.method == MGPU__STRIDE2_DX ? method_where_it_fits(MGPU__STRIDE2_DX, MGPU__TRY_DX, geoms[i])
                                                         : kernel.method;
            plan.y.method = plan.dw.method = kernel.method == MGPU__STRIDE2_DX ? MGPU__DIRECT : kernel.method;
            mgpu__conv_choice c = {*geoms[i], backward, backward, plan};
            mgpu__conv_choices[mgpu__conv_choice_count++] = c;
        }
    char name[96], how[48];
    mgpu__conv_kernel_str(how, sizeof how, kernel, MGPU__TRY_DX);
    snprintf(name, sizeof name, "residual block, stride %d, dx by %s", stride, dx_im2col ? "im2col" : how);
    mgpu_manual_seed(11);
    mgpu_layer *on_c = mgpu__residual_new("block", 32, 32, stride, mgpu_cpu());
    mgpu_layer *on_g = mgpu__layer_clone(on_c, gpu, 0);
    CHECK((on_c->shortcut != NULL) == (stride == 2));
    pair x = pair_randn(xs), dy = pair_randn(mgpu_shape4(2, 32, out_hw, out_hw));
    mgpu__layer_forward(on_c, x.c, NULL, NULL, 1);
    mgpu__layer_forward(on_g, x.g, NULL, NULL, 1);
    /* bn1 writes conv2's input channels-last, and conv2 makes no copy of
       its own */
    CHECK(on_g->bn1->copies->output_t != NULL);
    CHECK(on_g->conv2->copies->input_t == on_g->bn1->copies->output_t && on_g->conv2->copies->own_input_t == NULL);
    mgpu__layer_backward(on_c, dy.c, NULL, NULL, NULL, 1);
    mgpu_trace_begin();
    mgpu__layer_backward(on_g, dy.g, NULL, NULL, NULL, 1);
    mgpu_trace_end();
    int stride2_dx = kernel.method == MGPU__STRIDE2_DX && stride == 2; /* conv1 */
    CHECK_EQ_INT(traced_calls("conv2d_backward channels-last stride-2 dx"), stride2_dx);
    /* and both batch norms write their input gradients channels-last
       alone, unless dx reads dy itself (im2col) */
    CHECK((on_g->bn2->copies->dinput_t != NULL) == !dx_im2col && (on_g->bn1->copies->dinput_t != NULL) == !dx_im2col);
    pair dx = {on_c->dinput, on_g->dinput};
    pair dw1 = {on_c->conv1->weight.grad, on_g->conv1->weight.grad};
    pair dw2 = {on_c->conv2->weight.grad, on_g->conv2->weight.grad};
    pair dgamma1 = {on_c->bn1->weight.grad, on_g->bn1->weight.grad};
    check_same(name, "dx", &dx, 2e-3);
    check_same(name, "conv1 dw", &dw1, 2e-3);
    check_same(name, "conv2 dw", &dw2, 2e-3);
    check_same(name, "bn1 dgamma", &dgamma1, 2e-3);
    if (stride == 2) {
        pair dw3 = {on_c->shortcut->weight.grad, on_g->shortcut->weight.grad};
        pair db3 = {on_c->shortcut->bias.grad, on_g->shortcut->bias.grad}; /* (added by bn2's backward) */
        check_same(name, "shortcut dw", &dw3, 2e-3);
        check_same(name, "shortcut db", &db3, 2e-3);
    }
    mgpu__conv_choice_count = before;
    mgpu__layer_free(on_c, 0);
    mgpu__layer_free(on_g, 0);
    pair_free(&x);
    pair_free(&dy);
}
TEST(residual_block_input_gradient_by_every_dx_path) {
    if (!mgpu__conv_implicit_available()) return; /* a GPU before sm_80: im2col only */
    mgpu__conv_settings_from_environment();
    mgpu_set_tf32(1, 0);
    mgpu__implicit_kernel channels_last = mgpu__kernel_of(MGPU__DIRECT, MGPU__TILE_64x64, 1, 0);
    mgpu__implicit_kernel sliced = mgpu__kernel_of(MGPU__DIRECT, MGPU__TILE_64x64, 2, 0);
    mgpu__implicit_kernel wgmma = mgpu__kernel_of(MGPU__DIRECT, MGPU__TILE_128x128, 1, 1);
    mgpu__implicit_kernel wgmma_sliced = mgpu__kernel_of(MGPU__DIRECT, MGPU__TILE_64x128, 2, 1);
    mgpu__implicit_kernel stride2_dx = mgpu__kernel_of(MGPU__STRIDE2_DX, MGPU__TILE_64x64, 1, 0);
    residual_block_compare(2, stride2_dx, 0);
    for (int stride = 1; stride <= 2; stride++) {
        residual_block_compare(stride, channels_last, 1);
        residual_block_compare(stride, channels_last, 0);
        residual_block_compare(stride, sliced, 0);
        if (!mgpu__wgmma_runs(gpu)) continue;
        residual_block_compare(stride, wgmma, 0);
        residual_block_compare(stride, wgmma_sliced, 0);
    }
    mgpu_set_tf32(0, 0);
}

/* The networks below: a stem convolution and batch norm, a stride-1
   block, a stride-2 block with the 1x1 shortcut, pooling and a linear
   layer, on the CPU (to be replicated to the GPU), for a batch of 2
   images of 32 x 6 x 6, with every convolution's plans set by hand to
   `kernel` in every pass (in the forward pass and dx by `method` where
   it fits); *before: the plans' count before these. */
static mgpu_shape small_batch(void) { return mgpu_shape4(2, 32, 6, 6); }
static mgpu_net *small_network(mgpu__implicit_kernel kernel, mgpu__conv_method method, int *before) {
    mgpu_shape xs = small_batch(), half = mgpu_shape4(2, 64, 3, 3);
    mgpu__conv_geom geoms[] = {
        mgpu__conv_geometry("net", xs, mgpu_shape4(32, 32, 3, 3), 1, 1),   /* stem, block 1 */
        mgpu__conv_geometry("net", xs, mgpu_shape4(64, 32, 3, 3), 2, 1),   /* block 2's conv1 */
        mgpu__conv_geometry("net", half, mgpu_shape4(64, 64, 3, 3), 1, 1), /* its conv2 */
        mgpu__conv_geometry("net", xs, mgpu_shape4(64, 32, 1, 1), 2, 0),   /* its shortcut */
    };
    *before = mgpu__conv_choice_count;
    for (int i = 0; i < 4; i++)
        for (int pass = 0; pass < 3; pass++) { /* forward; backward without dx, with dx */
            mgpu__conv_plan plan = {1, 0, 0, kernel, kernel, kernel};
            plan.y.method = method_where_it_fits(method, MGPU__TRY_Y, &geoms[i]);
            plan.dx.method = method_where_it_fits(method, MGPU__TRY_DX, &geoms[i]);
            mgpu__conv_choice c = {geoms[i], pass > 0, pass == 2, plan};
            mgpu__conv_choices[mgpu__conv_choice_count++] = c;
        }
    mgpu_net *model = mgpu_net_new(mgpu_cpu());
    mgpu_net_add_conv(model, 32, 32, 3, 1, 1);
    mgpu_net_add_batchnorm(model, 32);
    mgpu_net_add_relu(model);
    mgpu_net_add_residual(model, 32, 32, 1);
    mgpu_net_add_residual(model, 32, 64, 2);
    mgpu_net_add_global_avg_pool(model);
    mgpu_net_add_linear(model, 64, 10);
    return model;
}
/* What the two tests below share: the model, a batch and its labels. */
typedef struct {
    mgpu_net *model;
    mgpu_tensor *x, *y;
    int before;
} small_test;
static small_test small_test_new(mgpu__implicit_kernel kernel, mgpu__conv_method method) {
    small_test t;
    float labels[2] = {3, 7};
    t.model = small_network(kernel, method, &t.before);
    t.x = mgpu_randn(gpu, small_batch(), 0.0f, 1.0f);
    t.y = mgpu_from_host(gpu, mgpu_shape1(2), labels);
    return t;
}
/* Checks that two networks give the same logits and, bit for bit, the
   same parameter gradients (grads) or values; then frees them and the
   test's tensors, and forgets the plans set by hand. */
static void same_networks(small_test *t, const char *name, mgpu_net *nets[2], mgpu_tensor *logits[2],
                          int grads) {
    pair out = {logits[0], logits[1]};
    check_same(name, "logits", &out, 0);
    for (int i = 0; i < t->model->nparams; i++) {
        pair p = {grads ? nets[0]->params[i]->grad : nets[0]->params[i]->value,
                  grads ? nets[1]->params[i]->grad : nets[1]->params[i]->value};
        char what[32];
        snprintf(what, sizeof what, "%s %d", grads ? "gradient" : "parameter", i);
        check_same(name, what, &p, 0);
    }
    mgpu__conv_choice_count = t->before;
    mgpu_net_free(t->model);
    mgpu_net_free(nets[0]);
    mgpu_net_free(nets[1]);
    mgpu_free(t->x);
    mgpu_free(t->y);
    mgpu_set_tf32(0, 0);
}

/* A network whose convolutions all take the channels-last kernels (plans
   set by hand, as above): each batch norm writes the next convolution's
   input channels-last beside its output (the stem's for the first block,
   the first block's for the second block's convolution and shortcut),
   and its input gradient channels-last alone for the convolution before
   it; the blocks' bn1 writes conv2's input channels-last alone (its
   plain output, filled with NaN, stays so). The copies are the ones the
   convolutions would make, so the step gives exactly what it gives with
   the convolutions copying. (Against
   the CPU, the residual blocks above; over a whole network with batch
   norm, TF32's rounding grows too much for a tolerance that means
   something: the gradients left after batch norm removes each channel's
   mean and slope are small differences of larger numbers.) */
static int all_nan(const mgpu_tensor *t) {
    int all = 1;
    for (size_t i = 0; i < t->numel; i++) all &= isnan(mgpu_item(t, i));
    return all;
}
static void batch_norms_write_copies_compare(const char *name, mgpu__conv_method method) {
    mgpu_set_tf32(1, 0);
    mgpu__implicit_kernel kernel = mgpu__kernel_of(MGPU__DIRECT, MGPU__TILE_64x64, 1, 0);
    mgpu_manual_seed(13);
    small_test test = small_test_new(kernel, method);
    mgpu_net *nets[2]; /* the convolutions copying, then batch norm writing the copies */
    mgpu_tensor *logits[2];
    int copies_written[2]; /* backward passes of batch norm that wrote a convolution's copy instead of dx */
    for (int k = 0; k < 2; k++) {
        mgpu__batch_norm_writes_channels_last = k;
        nets[k] = mgpu_net_replicate(test.model, gpu);
        for (int step = 0; step < 2; step++) { /* the same step again, bn1's outputs NaN */
            mgpu_net_zero_grad(nets[k]);
            logits[k] = mgpu_net_forward(nets[k], test.x);
            if (step > 0) mgpu_trace_begin();
            mgpu_net_loss_backward(nets[k], logits[k], test.y, 0.5f, NULL);
            if (step > 0) {
                mgpu_trace_end();
                copies_written[k] = traced_calls("batchnorm backward, channels-last dx");
                break;
            }
            mgpu_fill(nets[k]->layers[2]->bn1->output, NAN);
            mgpu_fill(nets[k]->layers[3]->bn1->output, NAN);
        }
    }
    mgpu__batch_norm_writes_channels_last = 1;
    for (int k = 0; k < 2; k++) {
        mgpu_layer **l = nets[k]->layers;
        int wrote = k == 1;
        CHECK((l[1]->copies->output_t != NULL) == wrote && (l[2]->copies->output_t != NULL) == wrote);
        CHECK(l[3]->copies->output_t == NULL); /* pooling comes next */
        CHECK((l[2]->conv1->copies->own_input_t == NULL) == wrote);
        CHECK(l[2]->conv1->copies->input_t == (wrote ? l[1]->copies->output_t : l[2]->conv1->copies->own_input_t));
        CHECK(!wrote ||
              (l[3]->conv1->copies->input_t == l[2]->copies->output_t && l[3]->shortcut->copies->input_t == l[2]->copies->output_t));
        CHECK((copies_written[k] > 0) == wrote); /* (each copy is freed once its convolution has read it) */
        CHECK(all_nan(l[2]->bn1->output) == wrote && all_nan(l[3]->bn1->output) == wrote);
    }
    same_networks(&test, name, nets, logits, 1);
}
TEST(network_batch_norms_write_the_convolutions_channels_last_copies) {
    if (!mgpu__conv_implicit_available()) return; /* a GPU before sm_80: im2col only */
    mgpu__conv_settings_from_environment();
    batch_norms_write_copies_compare("batch norm writing the copies", MGPU__DIRECT);
    /* Winograd reads the same copies (stem, block 1, block 2's conv2) */
    batch_norms_write_copies_compare("batch norm writing the copies, Winograd", MGPU__WINOGRAD);
}

/* The same network, every convolution channels-last (forward and dx in 2
   slices), trained 3 steps with SGD: its convolutions keep their weights'
   copies, which each forward pass remakes from the updated weights (in a
   few launches), and the logits and weights after the last step equal,
   bit for bit, those of the network whose convolutions copy their weights
   at every pass. The stride-1 convolutions that take dx keep the turned
   copy too; the others (the stem, which wants no dx, and the stride-2
   ones, whose sub-pixel classes take their own taps) do not, but for
   block 2's conv1 when its dx is by the stride-2 dx kernel. */
static void kept_copies_compare(const char *name, mgpu__conv_method method) {
    mgpu_set_tf32(1, 0);
    mgpu__implicit_kernel kernel = mgpu__kernel_of(MGPU__DIRECT, MGPU__TILE_64x64, 2, 0); /* in 2 slices */
    mgpu_manual_seed(17);
    small_test test = small_test_new(kernel, method);
    mgpu_net *nets[2]; /* copying the weights at each pass, then keeping the copies */
    mgpu_tensor *logits[2];
    for (int k = 0; k < 2; k++) {
        mgpu__network_keeps_weight_copies = k;
        nets[k] = mgpu_net_replicate(test.model, gpu);
        for (int step = 0; step < 3; step++) {
            mgpu_net_zero_grad(nets[k]);
            logits[k] = mgpu_net_forward(nets[k], test.x);
            mgpu_net_loss_backward(nets[k], logits[k], test.y, 0.5f, NULL);
            mgpu_net_sgd(nets[k], 0.5f, 0.9f, 0.0f);
        }
    }
    mgpu__network_keeps_weight_copies = 1;
    for (int k = 0; k < 2; k++) {
        mgpu_layer **l = nets[k]->layers;
        int kept = k == 1;
        CHECK((l[0]->copies->weight_t != NULL) == kept && l[0]->copies->weight_turned_t == NULL);
        CHECK((l[2]->conv1->copies->weight_t != NULL) == kept && (l[2]->conv1->copies->weight_turned_t != NULL) == kept);
        CHECK((l[2]->conv2->copies->weight_t != NULL) == kept && (l[2]->conv2->copies->weight_turned_t != NULL) == kept);
        CHECK((l[3]->conv1->copies->weight_t != NULL) == kept);
        CHECK((l[3]->conv1->copies->weight_turned_t != NULL) == (kept && method == MGPU__STRIDE2_DX));
        CHECK((l[3]->conv2->copies->weight_turned_t != NULL) == kept);
        CHECK((l[3]->shortcut->copies->weight_t != NULL) == kept && l[3]->shortcut->copies->weight_turned_t == NULL);
    }
    same_networks(&test, name, nets, logits, 0);
}
TEST_LONG(network_keeps_its_weights_channels_last_copies_current) {
    if (!mgpu__conv_implicit_available()) return; /* a GPU before sm_80: im2col only */
    mgpu__conv_settings_from_environment();
    kept_copies_compare("kept weight copies", MGPU__DIRECT);
    kept_copies_compare("kept weight copies, dx by the stride-2 dx kernel", MGPU__STRIDE2_DX);
}

#if MGPU_CUDNN
/* cuDNN's algorithms (kernels/conv_cudnn.h) for each pass, each launched
   directly, at LeNet's and ResNet-18's shapes (small batches: the
   emulator's cuDNN is a direct loop), against the CPU: within TF32's 2e-3,
   or 1e-4 for an algorithm that runs in float32. dx and dW are written
   over NaNs, then added to what is there (twice the CPU's). */
static const mgpu__conv_try cudnn_passes[3] = {MGPU__TRY_Y, MGPU__TRY_DX, MGPU__TRY_DW};
static int refusals; /* the emulator's algorithm that is listed but refuses to run, met */
static void cudnn_run(pair *out, pair *x, pair *wt, pair *b, pair *dy, const mgpu__conv_geom *g,
                      mgpu__conv_try what, mgpu__implicit_kernel kernel, int add) {
    if (what == MGPU__TRY_Y) mgpu__conv_forward_implicit(out->g, x->g, NULL, wt->g, NULL, b->g, g, kernel, NULL);
    else if (what == MGPU__TRY_DX) mgpu__conv_dx_implicit(out->g, dy->g, NULL, wt->g, NULL, g, kernel, add);
    else mgpu__conv_dw_implicit(out->g, dy->g, NULL, x->g, NULL, g, add, kernel);
}
static void cudnn_compare(const char *name, int n, int c, int h, int k, int r, int stride, int pad) {
    mgpu__conv_geom g;
    pair x, wt, b, y, dy, dx, dw;
    conv_case(name, n, c, h, k, r, stride, pad, &g, &x, &wt, &b, &y, &dy, &dx, &dw);
    pair *outs[3] = {&y, &dx, &dw};
    for (int p = 0; p < 3; p++) {
        mgpu__implicit_kernel list[MGPU__CUDNN_CANDIDATES];
        int count = mgpu__conv_cudnn_candidates(gpu, cudnn_passes[p], &g, list);
        CHECK(count >= 1);
        pair *out = outs[p];
        size_t numel = out->c->numel;
        float *twice = (float *)malloc(numel * sizeof(float));
        mgpu_to_host(out->c, twice);
        for (size_t i = 0; i < numel; i++) twice[i] *= 2;
        pair added = {mgpu_from_host(mgpu_cpu(), out->c->shape, twice), out->g};
        for (int i = 0; i < count; i++) {
            char what[160], how[64];
            mgpu__conv_kernel_str(how, sizeof how, list[i], cudnn_passes[p]);
            snprintf(what, sizeof what, "%s, %s", name, how);
            double tol = list[i].cudnn.math == CUDNN_FMA_MATH ? 1e-4 : 2e-3;
#if MGPU_CUDA_EMU
            if (p == 0 && list[i].cudnn.algo == MGPU_EMU_CUDNN_LISTED_BUT_REFUSED) {
                /* one line naming the call, the algorithm, the shape and the layer */
                EXPECT_DIES(mgpu__layer_enqueuing = "conv2"; cudnn_run(out, &x, &wt, &b, &dy, &g, MGPU__TRY_Y, list[i], 0);
                            mgpu_synchronize(gpu),
                            "cuDNN: cudnnConvolutionForward (nonfused Winograd, 3x3,");
                EXPECT_DIES(mgpu__layer_enqueuing = "conv2"; cudnn_run(out, &x, &wt, &b, &dy, &g, MGPU__TRY_Y, list[i], 0);
                            mgpu_synchronize(gpu),
                            "failed: CUDNN_STATUS_NOT_SUPPORTED, in layer conv2\n");
                refusals++;
                continue;
            }
#endif
            mgpu_fill(out->g, NAN);
            cudnnStatus_t refused = CUDNN_STATUS_SUCCESS; /* (an algorithm listed may still refuse the shape) */
            mgpu__cudnn_trial_refusal = &refused;
            cudnn_run(out, &x, &wt, &b, &dy, &g, cudnn_passes[p], list[i], 0);
            mgpu__cudnn_trial_refusal = NULL;
            if (refused != CUDNN_STATUS_SUCCESS) {
                printf("  %s, %s: listed, but refused the shape (%s)\n", name, how, cudnnGetErrorString(refused));
                continue;
            }
            check_same(what, p == 0 ? "y" : p == 1 ? "dx" : "dw", out, tol);
            if (p > 0) {
                cudnn_run(out, &x, &wt, &b, &dy, &g, cudnn_passes[p], list[i], 1);
                check_same(what, p == 1 ? "dx added to" : "dw accumulated", &added, tol);
            }
            /* none whose sums may come out in another order each run
               (dx's algorithm 0, dW's 0 and 3: atomics), none Winograd
               at stride 2 */
            int algo = list[i].cudnn.algo;
            CHECK(!(p == 1 && algo == 0) && !(p == 2 && (algo == 0 || algo == 3)));
            CHECK(stride == 1 || !strstr(how, "Winograd"));
        }
        mgpu_free(added.c);
        free(twice);
    }
    pair_free(&x); pair_free(&wt); pair_free(&b); pair_free(&y);
    pair_free(&dy); pair_free(&dx); pair_free(&dw);
}
TEST_LONG(cudnn_algorithms_match_the_cpu) {
    mgpu_set_tf32(1, 0);
    /*             name                   N   C   H    K  R  t  d */
    cudnn_compare("LeNet conv 1",         8,  1, 28,   6, 5, 1, 2);
    cudnn_compare("LeNet conv 2",         8,  6, 14,  16, 5, 1, 0);
    cudnn_compare("ResNet stem",          4,  1, 28,  64, 3, 1, 1);
    cudnn_compare("stage 1",              2, 64, 28,  64, 3, 1, 1);
    cudnn_compare("downsampling 3x3",     2, 64, 28, 128, 3, 2, 1);
    cudnn_compare("1x1 shortcut",         2, 64, 28, 128, 1, 2, 0);
    cudnn_compare("stage 4",              2, 512, 4, 512, 3, 1, 1);
#if MGPU_CUDA_EMU
    CHECK_EQ_INT(refusals, 3); /* (at stride 1, 3x3: stem, stage 1, stage 4) */
#endif
    mgpu_set_tf32(0, 0);
}

/* Nonfused Winograd in TF32 at a 5x5 filter is no candidate: its errors
   at LeNet's layers were several times TF32's own on an H200. In float32
   it stays one (the emulator lists it there; a GPU's cuDNN may not). */
static int nonfused_winograd_listed(const mgpu__conv_geom *g, int tf32) {
    mgpu__cudnn_algorithm list[MGPU__CUDNN_MAX_ALGORITHMS];
    int count = mgpu__cudnn_algorithms(mgpu__cudnn_ready(gpu), MGPU__CUDNN_Y, g, tf32, list), listed = 0;
    for (int i = 0; i < count; i++)
        listed += strcmp(mgpu__cudnn_algorithm_name(MGPU__CUDNN_Y, list[i].algo), "nonfused Winograd") == 0;
    return listed;
}
TEST(cudnn_leaves_out_nonfused_winograd_in_tf32_at_5x5) {
    mgpu__conv_geom g5 = mgpu__conv_geometry("conv", mgpu_shape4(8, 6, 14, 14), mgpu_shape4(16, 6, 5, 5), 1, 0);
    mgpu__conv_geom g3 = mgpu__conv_geometry("conv", mgpu_shape4(2, 64, 28, 28), mgpu_shape4(64, 64, 3, 3), 1, 1);
    CHECK_EQ_INT(nonfused_winograd_listed(&g5, 1), 0);
#if MGPU_CUDA_EMU
    CHECK_EQ_INT(nonfused_winograd_listed(&g5, 0), 1);
    CHECK_EQ_INT(nonfused_winograd_listed(&g3, 1), 1); /* (3x3 keeps it) */
#else
    (void)g3;
#endif
}

/* MGPU_CONV=cudnn: every pass by cuDNN through the public calls, as the
   plans say and the trace shows. (On the emulator, the trial meets an
   algorithm that refuses to run, and leaves it.) */
TEST(conv_by_cudnn_alone) {
    if (!mgpu__conv_implicit_available()) return; /* a GPU before sm_80: im2col only */
    int first = conv_twice_by(MGPU__CONV_CUDNN, "cudnn", mgpu_shape4(3, 16, 10, 10), mgpu_shape4(24, 16, 3, 3));
    const mgpu__conv_plan *forward = &mgpu__conv_choices[first].plan, *backward = &mgpu__conv_choices[first + 1].plan;
    CHECK(forward->implicit && forward->y.method == MGPU__CUDNN);
    CHECK(backward->implicit && !backward->dx_im2col && !backward->dw_im2col);
    CHECK(backward->dx.method == MGPU__CUDNN && backward->dw.method == MGPU__CUDNN);
    CHECK_EQ_INT(traced_calls("conv2d cuDNN"), 1);
    CHECK_EQ_INT(traced_calls("conv2d_backward cuDNN dx"), 1);
    CHECK_EQ_INT(traced_calls("conv2d_backward cuDNN dW"), 1);
}

/* A cuDNN call that fails stops the program with one line: the call,
   cuDNN's status, and the layer being enqueued. */
TEST(cudnn_errors_are_one_line_naming_the_layer) {
    cudnnTensorDescriptor_t d;
    MGPU_CUDNN_CHECK(cudnnCreateTensorDescriptor(&d));
    EXPECT_DIES(mgpu__layer_enqueuing = "conv7";
                MGPU_CUDNN_CHECK(cudnnSetTensor4dDescriptor(d, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, -1, 1, 1, 1)),
                "cuDNN: cudnnSetTensor4dDescriptor(d, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, -1, 1, 1, 1) failed: "
                "CUDNN_STATUS_BAD_PARAM, in layer conv7");
    MGPU_CUDNN_CHECK(cudnnDestroyTensorDescriptor(d));
}
#endif

TEST_MAIN_GPU(gpu = mgpu_try_gpu(0))
