/* tests/test_train_ops.c: batch norm, cross-entropy, accuracy, sums and
   SGD on the CPU device.

   Gradients are checked against central finite differences of the forward
   pass: dL/dv ~ (L(v + h) - L(v - h)) / (2h), with h = 1e-2 and the loss L
   summed in double. The forward pass computes in float, so each of L's few
   hundred terms (of size ~1, random signs) carries a rounding error of
   ~1e-7, about 1e-6 in all; dividing by 2h turns that into ~5e-5. The
   truncation error of the central difference, h^2/6 times a third
   derivative of order 1, is ~2e-5. The tolerance,
   |analytic - numeric| <= 5e-4 + 1e-3 |numeric|, is ten times that: loose
   enough never to fail on rounding, tight enough to catch an m-1 for an m
   in batch norm's backward pass.

   The PyTorch conventions (momentum 0.1, eps 1e-5, unbiased running
   variance, argmax ties, SGD's first momentum step) are checked against
   values worked out by hand in the comments. */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"
#include "test.h"

#define FD_STEP 1e-2f
#define FD_ATOL 5e-4
#define FD_RTOL 1e-3

/* ------------------------------------------------------------ helpers */
static uint32_t rng_state = 12345;
static float uniform(float lo, float hi) {
    rng_state = rng_state * 1664525u + 1013904223u;
    return lo + (hi - lo) * (float)(rng_state >> 8) / 16777216.0f;
}
static float *uniform_array(size_t n, float lo, float hi) {
    float *v = (float *)malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) v[i] = uniform(lo, hi);
    return v;
}
static mgpu_tensor *on_cpu(mgpu_shape s, const float *values) {
    return mgpu_from_host(mgpu_cpu(), s, values);
}
static double weighted_sum(const float *y, const float *w, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)w[i] * y[i];
    return s;
}

/* The central difference of f at v[j]; v is perturbed in place and
   restored. The step actually taken, (v + h) - (v - h) after rounding to
   float, is the denominator. */
typedef double (*loss_fn)(void *problem);
static double central_difference(float *v, size_t j, loss_fn f, void *problem) {
    float saved = v[j], up = saved + FD_STEP, down = saved - FD_STEP;
    v[j] = up;
    double loss_up = f(problem);
    v[j] = down;
    double loss_down = f(problem);
    v[j] = saved;
    return (loss_up - loss_down) / ((double)up - (double)down);
}

/* A fatal error raised inside a CPU kernel comes from the device's worker
   thread. The child that EXPECT_DIES forks has no copy of the parent's
   worker threads, so it makes a device of its own: cpu#1, which the parent
   never creates in this file. */
static mgpu_device *fresh_device_in_child(void) {
    mgpu_device *d[2];
    mgpu_devices(2, 0, d);
    return d[1];
}

/* ------------------------------------------------ batch norm gradients */
typedef struct {
    int n, c, h, w;
    int fuse_relu;
    float *x, *gamma, *beta;   /* the point, perturbed in place by the check */
    float *w_loss;             /* L = sum w_loss * y */
    float *y;                  /* scratch */
    unsigned char *mask;       /* y > 0 at the unperturbed point */
    int kink;                  /* a perturbation moved some value across the ReLU's kink */
} bn_problem;

static mgpu_shape bn_shape(const bn_problem *p) { return mgpu_shape4(p->n, p->c, p->h, p->w); }
static size_t bn_numel(const bn_problem *p) { return (size_t)p->n * p->c * p->h * p->w; }

/* Training-mode forward on the CPU device: y to the host; the saved
   statistics stay in save_mean / save_invstd when those are given. */
static void bn_forward(bn_problem *p, mgpu_tensor *save_mean, mgpu_tensor *save_invstd) {
    mgpu_device *d = mgpu_cpu();
    mgpu_shape cs = mgpu_shape1(p->c);
    mgpu_tensor *x = on_cpu(bn_shape(p), p->x), *gamma = on_cpu(cs, p->gamma), *beta = on_cpu(cs, p->beta);
    mgpu_tensor *y = mgpu_empty(d, bn_shape(p)), *rm = mgpu_zeros(d, cs), *rv = mgpu_ones(d, cs);
    mgpu_tensor *sm = save_mean ? save_mean : mgpu_empty(d, cs);
    mgpu_tensor *si = save_invstd ? save_invstd : mgpu_empty(d, cs);
    mgpu_batchnorm2d_forward(y, x, gamma, beta, rm, rv, sm, si, 1, 0.1f, 1e-5f, p->fuse_relu);
    mgpu_to_host(y, p->y);
    if (!save_mean) mgpu_free(sm);
    if (!save_invstd) mgpu_free(si);
    mgpu_free(x); mgpu_free(gamma); mgpu_free(beta); mgpu_free(y); mgpu_free(rm); mgpu_free(rv);
}

static double bn_loss(void *problem) {
    bn_problem *p = (bn_problem *)problem;
    bn_forward(p, NULL, NULL);
    if (p->fuse_relu)
        for (size_t i = 0; i < bn_numel(p); i++)
            if ((p->y[i] > 0) != p->mask[i]) p->kink = 1;
    return weighted_sum(p->y, p->w_loss, bn_numel(p));
}

/* Compares analytic gradients with central differences over every value
   of v. With the fused ReLU, L has kinks: where a perturbation moves some
   output across zero the difference is not a derivative, so that
   coordinate is skipped (and counted). */
static void check_against_differences(bn_problem *p, float *v, const float *analytic, size_t n,
                                      int *skipped) {
    for (size_t j = 0; j < n; j++) {
        p->kink = 0;
        double numeric = central_difference(v, j, bn_loss, p);
        if (p->kink) {
            (*skipped)++;
            continue;
        }
        CHECK_CLOSE(analytic[j], numeric, FD_ATOL, FD_RTOL);
    }
}

static void check_bn_gradients(int n, int c, int h, int w, int fuse_relu) {
    bn_problem p;
    memset(&p, 0, sizeof p);
    p.n = n; p.c = c; p.h = h; p.w = w;
    p.fuse_relu = fuse_relu;
    size_t numel = bn_numel(&p);
    p.x = uniform_array(numel, -2.0f, 2.0f);
    p.gamma = uniform_array((size_t)c, 0.5f, 1.5f);
    p.beta = uniform_array((size_t)c, -0.5f, 0.5f);
    p.w_loss = uniform_array(numel, -1.0f, 1.0f);
    p.y = (float *)malloc(numel * sizeof(float));
    p.mask = (unsigned char *)malloc(numel);

    /* The analytic gradients at the point, with dy = dL/dy = w_loss. */
    mgpu_device *d = mgpu_cpu();
    mgpu_shape cs = mgpu_shape1(c);
    mgpu_tensor *sm = mgpu_empty(d, cs), *si = mgpu_empty(d, cs);
    bn_forward(&p, sm, si);
    for (size_t i = 0; i < numel; i++) p.mask[i] = p.y[i] > 0;
    mgpu_tensor *x = on_cpu(bn_shape(&p), p.x), *beta = on_cpu(cs, p.beta);
    mgpu_tensor *dy = on_cpu(bn_shape(&p), p.w_loss), *gamma = on_cpu(cs, p.gamma);
    mgpu_tensor *dx = mgpu_empty(d, bn_shape(&p)), *dgamma = mgpu_empty(d, cs), *dbeta = mgpu_empty(d, cs);
    mgpu_batchnorm2d_backward(dx, dgamma, dbeta, dy, x, gamma, beta, sm, si, fuse_relu, 0);
    float *dx_h = (float *)malloc(numel * sizeof(float));
    float *dgamma_h = (float *)malloc((size_t)c * sizeof(float)), *dbeta_h = (float *)malloc((size_t)c * sizeof(float));
    mgpu_to_host(dx, dx_h);
    mgpu_to_host(dgamma, dgamma_h);
    mgpu_to_host(dbeta, dbeta_h);

    int skipped = 0;
    check_against_differences(&p, p.x, dx_h, numel, &skipped);
    check_against_differences(&p, p.gamma, dgamma_h, (size_t)c, &skipped);
    check_against_differences(&p, p.beta, dbeta_h, (size_t)c, &skipped);
    /* Only a few coordinates may sit within a step of a kink. */
    CHECK(skipped <= (int)(numel + 2 * c) / 10);
    if (!fuse_relu) CHECK_EQ_INT(skipped, 0);

    mgpu_free(sm); mgpu_free(si); mgpu_free(x); mgpu_free(beta); mgpu_free(dy); mgpu_free(gamma);
    mgpu_free(dx); mgpu_free(dgamma); mgpu_free(dbeta);
    free(dx_h); free(dgamma_h); free(dbeta_h);
    free(p.x); free(p.gamma); free(p.beta); free(p.w_loss); free(p.y); free(p.mask);
}

TEST(batchnorm_gradients_2x3x4x5) { check_bn_gradients(2, 3, 4, 5, 0); }
TEST(batchnorm_gradients_one_image) { check_bn_gradients(1, 2, 3, 3, 0); }
TEST(batchnorm_gradients_one_channel) { check_bn_gradients(4, 1, 2, 2, 0); }
TEST(batchnorm_gradients_1x1_pixels) { check_bn_gradients(6, 2, 1, 1, 0); }
TEST(batchnorm_relu_gradients_2x3x4x5) { check_bn_gradients(2, 3, 4, 5, 1); }
TEST(batchnorm_relu_gradients_one_image) { check_bn_gradients(1, 2, 3, 3, 1); }
TEST(batchnorm_relu_gradients_one_channel) { check_bn_gradients(4, 1, 2, 2, 1); }

/* With the fused ReLU, backward recomputes the mask y > 0 from x. It must
   be the forward's exactly: backward with it equals, bit for bit, backward
   without the ReLU from dy zeroed where the forward's y is not above 0.
   Channel 0 has mean 0, gamma 1 and beta 0, and four x exactly 0: their
   y is exactly 0, on the kink, and clipped (PyTorch's ReLU passes no
   gradient at 0 either). */
TEST(batchnorm_relu_mask_is_the_forwards) {
    mgpu_device *d = mgpu_cpu();
    mgpu_shape s = mgpu_shape4(2, 2, 2, 3), cs = mgpu_shape1(2);
    float xv[24] = {-2, -1, 0, 0, 1, 2,    0.3f, -0.7f, 1.1f, 0.2f, -0.4f, 0.9f,  /* image 0 */
                    -3, 0, 3, -0.5f, 0.5f, 0, -1.3f, 0.6f, 0.05f, -0.2f, 0.8f, -0.6f}; /* image 1 */
    float gv[2] = {1, 0.8f}, bv[2] = {0, 0.1f}, dyv[24], masked[24], yv[24];
    for (int i = 0; i < 24; i++) dyv[i] = (float)((i * 7) % 11) / 11.0f - 0.4f;
    mgpu_tensor *x = on_cpu(s, xv), *gamma = on_cpu(cs, gv), *beta = on_cpu(cs, bv), *dy = on_cpu(s, dyv);
    mgpu_tensor *y = mgpu_empty(d, s), *rm = mgpu_zeros(d, cs), *rv = mgpu_ones(d, cs);
    mgpu_tensor *sm = mgpu_empty(d, cs), *si = mgpu_empty(d, cs);
    mgpu_batchnorm2d_forward(y, x, gamma, beta, rm, rv, sm, si, 1, 0.1f, 1e-5f, 1);
    mgpu_to_host(y, yv);
    int on_kink = 0;
    for (int i = 0; i < 24; i++) {
        masked[i] = yv[i] > 0 ? dyv[i] : 0.0f;
        on_kink += (i / 6) % 2 == 0 && xv[i] == 0 && yv[i] == 0; /* channel 0's zeros */
    }
    CHECK_EQ_INT(on_kink, 4);
    mgpu_tensor *dy_masked = on_cpu(s, masked);
    mgpu_tensor *dx[2], *dgamma[2], *dbeta[2];
    for (int k = 0; k < 2; k++) {
        dx[k] = mgpu_empty(d, s);
        dgamma[k] = mgpu_empty(d, cs);
        dbeta[k] = mgpu_empty(d, cs);
    }
    mgpu_batchnorm2d_backward(dx[0], dgamma[0], dbeta[0], dy, x, gamma, beta, sm, si, 1, 0);
    mgpu_batchnorm2d_backward(dx[1], dgamma[1], dbeta[1], dy_masked, x, gamma, NULL, sm, si, 0, 0);
    float a[24], b[24];
    mgpu_to_host(dx[0], a);
    mgpu_to_host(dx[1], b);
    for (int i = 0; i < 24; i++) CHECK_CLOSE(a[i], b[i], 0, 0);
    mgpu_to_host(dgamma[0], a);
    mgpu_to_host(dgamma[1], b);
    mgpu_to_host(dbeta[0], a + 2);
    mgpu_to_host(dbeta[1], b + 2);
    for (int i = 0; i < 4; i++) CHECK_CLOSE(a[i], b[i], 0, 0);
    mgpu_tensor *all[] = {x, gamma, beta, dy, y, rm, rv, sm, si, dy_masked, dx[0], dx[1],
                          dgamma[0], dgamma[1], dbeta[0], dbeta[1]};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) mgpu_free(all[i]);
}

/* accumulate 1 adds to dgamma and dbeta; dx is overwritten either way. */
TEST(batchnorm_backward_accumulates) {
    mgpu_device *d = mgpu_cpu();
    mgpu_shape s = mgpu_shape4(2, 2, 2, 2), cs = mgpu_shape1(2);
    float *xv = uniform_array(16, -1, 1), *dyv = uniform_array(16, -1, 1);
    mgpu_tensor *x = on_cpu(s, xv), *dy = on_cpu(s, dyv), *y = mgpu_empty(d, s);
    mgpu_tensor *gamma = mgpu_ones(d, cs), *beta = mgpu_zeros(d, cs);
    mgpu_tensor *rm = mgpu_zeros(d, cs), *rv = mgpu_ones(d, cs), *sm = mgpu_empty(d, cs), *si = mgpu_empty(d, cs);
    mgpu_tensor *dx = mgpu_empty(d, s), *dgamma = mgpu_empty(d, cs), *dbeta = mgpu_empty(d, cs);
    mgpu_batchnorm2d_forward(y, x, gamma, beta, rm, rv, sm, si, 1, 0.1f, 1e-5f, 0);
    mgpu_batchnorm2d_backward(dx, dgamma, dbeta, dy, x, gamma, NULL, sm, si, 0, 0);
    float once_g[2], once_b[2], once_dx[16], twice_g[2], twice_b[2], twice_dx[16];
    mgpu_to_host(dgamma, once_g);
    mgpu_to_host(dbeta, once_b);
    mgpu_to_host(dx, once_dx);
    mgpu_batchnorm2d_backward(dx, dgamma, dbeta, dy, x, gamma, NULL, sm, si, 0, 1);
    mgpu_to_host(dgamma, twice_g);
    mgpu_to_host(dbeta, twice_b);
    mgpu_to_host(dx, twice_dx);
    for (int c = 0; c < 2; c++) {
        CHECK_CLOSE(twice_g[c], 2 * once_g[c], 1e-6, 1e-6);
        CHECK_CLOSE(twice_b[c], 2 * once_b[c], 1e-6, 1e-6);
    }
    for (int i = 0; i < 16; i++) CHECK_CLOSE(twice_dx[i], once_dx[i], 0, 0);
    mgpu_tensor *all[] = {x, dy, y, gamma, beta, rm, rv, sm, si, dx, dgamma, dbeta};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) mgpu_free(all[i]);
    free(xv); free(dyv);
}

/* ------------------------------------------- batch norm statistics */
/* x is [2, 2, 1, 2]: channel 0 holds 1, 2 (image 0) and 3, 4 (image 1);
   channel 1 holds 0, 0 and 0, 8.
       channel 0: mean 2.5, biased var (2.25+0.25+0.25+2.25)/4 = 1.25, unbiased 5/3
       channel 1: mean 2,   biased var (4+4+4+36)/4 = 12,             unbiased 16
   From running_mean 0 and running_var 1 (PyTorch's start), momentum 0.1:
       step 1: running_mean = 0.1 mean          = [0.25, 0.2]
               running_var  = 0.9 + 0.1 unbiased = [0.9 + 1/6, 0.9 + 1.6] = [1.0666667, 2.5]
   Step 2 with 2x (mean [5, 4], unbiased var [20/3, 64]):
               running_mean = 0.9 [0.25, 0.2] + 0.1 [5, 4]           = [0.725, 0.58]
               running_var  = 0.9 [1.0666667, 2.5] + 0.1 [20/3, 64]  = [1.6266667, 8.65] */
TEST(batchnorm_running_statistics) {
    mgpu_device *d = mgpu_cpu();
    mgpu_shape s = mgpu_shape4(2, 2, 1, 2), cs = mgpu_shape1(2);
    float xv[8] = {1, 2, 0, 0, 3, 4, 0, 8};
    mgpu_tensor *x = on_cpu(s, xv), *y = mgpu_empty(d, s);
    mgpu_tensor *gamma = mgpu_ones(d, cs), *beta = mgpu_zeros(d, cs);
    mgpu_tensor *rm = mgpu_zeros(d, cs), *rv = mgpu_ones(d, cs), *sm = mgpu_empty(d, cs), *si = mgpu_empty(d, cs);
    mgpu_batchnorm2d_forward(y, x, gamma, beta, rm, rv, sm, si, 1, 0.1f, 1e-5f, 0);
    CHECK_CLOSE(mgpu_item(rm, 0), 0.25, 1e-6, 1e-6);
    CHECK_CLOSE(mgpu_item(rm, 1), 0.2, 1e-6, 1e-6);
    CHECK_CLOSE(mgpu_item(rv, 0), 0.9 + 1.0 / 6.0, 1e-6, 1e-6);
    CHECK_CLOSE(mgpu_item(rv, 1), 2.5, 1e-6, 1e-6);
    CHECK_CLOSE(mgpu_item(sm, 0), 2.5, 1e-6, 1e-6);
    CHECK_CLOSE(mgpu_item(si, 0), 1.0 / sqrt(1.25 + 1e-5), 1e-6, 1e-6);
    CHECK_CLOSE(mgpu_item(si, 1), 1.0 / sqrt(12 + 1e-5), 1e-6, 1e-6);
    /* y is normalised with the biased variance: (1 - 2.5) / sqrt(1.25 + eps) */
    CHECK_CLOSE(mgpu_item(y, 0), -1.5 / sqrt(1.25 + 1e-5), 1e-6, 1e-6);

    mgpu_scale_(x, 2.0f);
    mgpu_batchnorm2d_forward(y, x, gamma, beta, rm, rv, sm, si, 1, 0.1f, 1e-5f, 0);
    CHECK_CLOSE(mgpu_item(rm, 0), 0.725, 1e-6, 1e-6);
    CHECK_CLOSE(mgpu_item(rm, 1), 0.58, 1e-6, 1e-6);
    CHECK_CLOSE(mgpu_item(rv, 0), 0.9 * (0.9 + 1.0 / 6.0) + 0.1 * 20.0 / 3.0, 1e-6, 1e-6);
    CHECK_CLOSE(mgpu_item(rv, 1), 8.65, 1e-6, 1e-6);
    mgpu_tensor *all[] = {x, y, gamma, beta, rm, rv, sm, si};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) mgpu_free(all[i]);
}

/* Evaluation mode: y = gamma (x - running_mean) / sqrt(running_var + eps) + beta,
   and nothing else changes. */
static void check_bn_eval(int fuse_relu, int in_place) {
    mgpu_device *d = mgpu_cpu();
    const int n = 3, c = 4, hw = 5;
    mgpu_shape s = mgpu_shape4(n, c, 1, hw), cs = mgpu_shape1(c);
    float *xv = uniform_array((size_t)n * c * hw, -3, 3);
    float *gv = uniform_array((size_t)c, 0.5f, 2), *bv = uniform_array((size_t)c, -1, 1);
    float *mv = uniform_array((size_t)c, -1, 1), *vv = uniform_array((size_t)c, 0.1f, 3);
    mgpu_tensor *x = on_cpu(s, xv), *y = in_place ? x : mgpu_empty(d, s);
    mgpu_tensor *gamma = on_cpu(cs, gv), *beta = on_cpu(cs, bv), *rm = on_cpu(cs, mv), *rv = on_cpu(cs, vv);
    mgpu_batchnorm2d_forward(y, x, gamma, beta, rm, rv, NULL, NULL, 0, 0.1f, 1e-5f, fuse_relu);
    float *yv = (float *)malloc((size_t)n * c * hw * sizeof(float));
    mgpu_to_host(y, yv);
    for (int i = 0; i < n; i++)
        for (int k = 0; k < c; k++)
            for (int j = 0; j < hw; j++) {
                size_t at = ((size_t)i * c + k) * hw + j;
                double want = gv[k] * (xv[at] - mv[k]) / sqrt((double)vv[k] + 1e-5) + bv[k];
                if (fuse_relu && want < 0) want = 0;
                CHECK_CLOSE(yv[at], want, 1e-5, 1e-5);
            }
    for (int k = 0; k < c; k++) {
        CHECK_CLOSE(mgpu_item(rm, (size_t)k), mv[k], 0, 0);
        CHECK_CLOSE(mgpu_item(rv, (size_t)k), vv[k], 0, 0);
    }
    if (!in_place) mgpu_free(y);
    mgpu_free(x); mgpu_free(gamma); mgpu_free(beta); mgpu_free(rm); mgpu_free(rv);
    free(xv); free(gv); free(bv); free(mv); free(vv); free(yv);
}
TEST(batchnorm_eval_uses_running_statistics) { check_bn_eval(0, 0); }
TEST(batchnorm_eval_fused_relu) { check_bn_eval(1, 0); }
TEST(batchnorm_eval_in_place) { check_bn_eval(0, 1); }

/* The residual block's end in one pass, max(bn(x) + skip, 0), is batch
   norm, then mgpu_add_relu: the same float operations, so exactly equal,
   and the running statistics move the same way. */
TEST(batchnorm_with_skip_is_the_residual_blocks_end) {
    mgpu_device *d = mgpu_cpu();
    const int n = 3, c = 4, hw = 6;
    mgpu_shape s = mgpu_shape4(n, c, 2, 3), cs = mgpu_shape1(c);
    float *xv = uniform_array((size_t)n * c * hw, -3, 3), *sv = uniform_array((size_t)n * c * hw, -2, 2);
    float *gv = uniform_array((size_t)c, 0.5f, 2), *bv = uniform_array((size_t)c, -1, 1);
    mgpu_tensor *x = on_cpu(s, xv), *skip = on_cpu(s, sv), *gamma = on_cpu(cs, gv), *beta = on_cpu(cs, bv);
    for (int training = 1; training >= 0; training--) {
        mgpu_tensor *rm[2], *rv[2], *sm[2], *si[2], *y[2];
        for (int k = 0; k < 2; k++) {
            rm[k] = mgpu_zeros(d, cs), rv[k] = mgpu_ones(d, cs);
            sm[k] = mgpu_empty(d, cs), si[k] = mgpu_empty(d, cs), y[k] = mgpu_empty(d, s);
        }
        mgpu__batchnorm2d_forward("test", y[0], NULL, x, skip, gamma, beta, rm[0], rv[0], sm[0], si[0],
                                  training, 0.1f, 1e-5f, 1, NULL);
        mgpu_tensor *normalised = mgpu_empty(d, s);
        mgpu_batchnorm2d_forward(normalised, x, gamma, beta, rm[1], rv[1], sm[1], si[1], training,
                                 0.1f, 1e-5f, 0);
        mgpu_add_relu(y[1], normalised, skip);
        float a[72], b[72];
        mgpu_to_host(y[0], a);
        mgpu_to_host(y[1], b);
        int clipped = 0;
        for (int i = 0; i < n * c * hw; i++) {
            CHECK_CLOSE(a[i], b[i], 0, 0);
            clipped += a[i] == 0.0f;
        }
        CHECK(clipped > 0 && clipped < n * c * hw); /* the ReLU had work on both sides */
        for (int k = 0; k < c; k++) {
            CHECK_CLOSE(mgpu_item(rm[0], (size_t)k), mgpu_item(rm[1], (size_t)k), 0, 0);
            CHECK_CLOSE(mgpu_item(rv[0], (size_t)k), mgpu_item(rv[1], (size_t)k), 0, 0);
        }
        mgpu_free(normalised);
        for (int k = 0; k < 2; k++) {
            mgpu_free(rm[k]); mgpu_free(rv[k]); mgpu_free(sm[k]); mgpu_free(si[k]); mgpu_free(y[k]);
        }
    }
    EXPECT_DIES(mgpu__batchnorm2d_forward("block.bn2", x, NULL, x, gamma, gamma, beta, gamma, beta, gamma,
                                          beta, 1, 0.1f, 1e-5f, 1, NULL),
                "block.bn2: shapes [4] and [3, 4, 2, 3] differ");
    mgpu_free(x); mgpu_free(skip); mgpu_free(gamma); mgpu_free(beta);
    free(xv); free(sv); free(gv); free(bv);
}

/* [N, C] is batch norm over the batch for each feature (H = W = 1). */
TEST(batchnorm_on_a_matrix_is_over_the_batch) {
    mgpu_device *d = mgpu_cpu();
    float xv[6] = {1, 10, 2, 20, 3, 60}; /* [3, 2] */
    mgpu_tensor *x = on_cpu(mgpu_shape2(3, 2), xv), *y = mgpu_empty(d, mgpu_shape2(3, 2));
    mgpu_shape cs = mgpu_shape1(2);
    mgpu_tensor *gamma = mgpu_ones(d, cs), *beta = mgpu_zeros(d, cs);
    mgpu_tensor *rm = mgpu_zeros(d, cs), *rv = mgpu_ones(d, cs), *sm = mgpu_empty(d, cs), *si = mgpu_empty(d, cs);
    mgpu_batchnorm2d_forward(y, x, gamma, beta, rm, rv, sm, si, 1, 0.1f, 1e-5f, 0);
    CHECK_CLOSE(mgpu_item(sm, 0), 2, 1e-6, 1e-6);
    CHECK_CLOSE(mgpu_item(sm, 1), 30, 1e-6, 1e-6);
    /* feature 0: values 1, 2, 3, biased var 2/3 */
    CHECK_CLOSE(mgpu_item(y, 0), -1 / sqrt(2.0 / 3.0 + 1e-5), 1e-6, 1e-6);
    mgpu_tensor *all[] = {x, y, gamma, beta, rm, rv, sm, si};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) mgpu_free(all[i]);
}

TEST(batchnorm_errors) {
    mgpu_device *d = mgpu_cpu();
    mgpu_shape s = mgpu_shape4(2, 3, 2, 2), cs = mgpu_shape1(3);
    mgpu_tensor *x = mgpu_zeros(d, s), *y = mgpu_empty(d, s), *wrong = mgpu_ones(d, mgpu_shape1(4));
    mgpu_tensor *gamma = mgpu_ones(d, cs), *beta = mgpu_zeros(d, cs);
    mgpu_tensor *rm = mgpu_zeros(d, cs), *rv = mgpu_ones(d, cs), *sm = mgpu_empty(d, cs), *si = mgpu_empty(d, cs);
    mgpu_tensor *one_value = mgpu_zeros(d, mgpu_shape4(1, 3, 1, 1)), *y1 = mgpu_empty(d, mgpu_shape4(1, 3, 1, 1));
    mgpu_tensor *vec = mgpu_zeros(d, mgpu_shape1(3));
    EXPECT_DIES(mgpu_batchnorm2d_forward(y, x, wrong, beta, rm, rv, sm, si, 1, 0.1f, 1e-5f, 0),
                "mgpu_batchnorm2d_forward: gamma has shape [4]; it needs one value per channel (3)");
    EXPECT_DIES(mgpu_batchnorm2d_forward(y, x, gamma, beta, rm, rv, NULL, si, 1, 0.1f, 1e-5f, 0),
                "mgpu_batchnorm2d_forward: save_mean is NULL");
    EXPECT_DIES(mgpu_batchnorm2d_forward(wrong, x, gamma, beta, rm, rv, sm, si, 1, 0.1f, 1e-5f, 0),
                "mgpu_batchnorm2d_forward: shapes [4] and [2, 3, 2, 2] differ");
    EXPECT_DIES(mgpu_batchnorm2d_forward(y1, one_value, gamma, beta, rm, rv, sm, si, 1, 0.1f, 1e-5f, 0),
                "training needs more than one value per channel; x has shape [1, 3, 1, 1]");
    EXPECT_DIES(mgpu_batchnorm2d_forward(vec, vec, gamma, beta, rm, rv, sm, si, 1, 0.1f, 1e-5f, 0),
                "x has shape [3]; it must be [N, C, H, W] or [N, C]");
    EXPECT_DIES(mgpu_batchnorm2d_backward(y, gamma, beta, x, x, gamma, NULL, sm, si, 1, 0),
                "mgpu_batchnorm2d_backward: beta (needed with fuse_relu) is NULL");
    EXPECT_DIES(mgpu_batchnorm2d_backward(y, gamma, beta, x, x, gamma, x, sm, si, 1, 0),
                "mgpu_batchnorm2d_backward: beta (needed with fuse_relu) has shape [2, 3, 2, 2]; "
                "it needs one value per channel (3)");
    EXPECT_DIES(mgpu_batchnorm2d_backward(y, wrong, beta, x, x, gamma, NULL, sm, si, 0, 0),
                "mgpu_batchnorm2d_backward: dgamma has shape [4]; it needs one value per channel (3)");
    mgpu_tensor *all[] = {x, y, wrong, gamma, beta, rm, rv, sm, si, one_value, y1, vec};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) mgpu_free(all[i]);
}

/* ------------------------------------------------------ cross-entropy */
static double reference_loss(const float *z, int classes, int label) {
    double max = z[0], sum = 0;
    for (int j = 1; j < classes; j++) max = z[j] > max ? z[j] : max;
    for (int j = 0; j < classes; j++) sum += exp(z[j] - max);
    return max + log(sum) - z[label];
}

TEST(cross_entropy_losses) {
    const int n = 5, classes = 7;
    float *z = uniform_array((size_t)n * classes, -4, 4);
    float labels[5] = {0, 6, 3, 3, 1};
    mgpu_tensor *tz = on_cpu(mgpu_shape2(n, classes), z), *ty = on_cpu(mgpu_shape1(n), labels);
    mgpu_tensor *losses = mgpu_empty(mgpu_cpu(), mgpu_shape1(n));
    mgpu_cross_entropy_forward(losses, tz, ty);
    for (int i = 0; i < n; i++)
        CHECK_CLOSE(mgpu_item(losses, (size_t)i), reference_loss(z + i * classes, classes, (int)labels[i]),
                    1e-6, 1e-6);
    mgpu_free(tz); mgpu_free(ty); mgpu_free(losses);
    free(z);
}

/* exp(1000) overflows a float; log-sum-exp must not. */
TEST(cross_entropy_is_stable_for_large_logits) {
    float z[6] = {1000, 0, -1000, -1000, 0, 1000};
    float labels[2] = {0, 1};
    mgpu_tensor *tz = on_cpu(mgpu_shape2(2, 3), z), *ty = on_cpu(mgpu_shape1(2), labels);
    mgpu_tensor *losses = mgpu_empty(mgpu_cpu(), mgpu_shape1(2)), *dz = mgpu_empty(mgpu_cpu(), mgpu_shape2(2, 3));
    mgpu_cross_entropy_forward(losses, tz, ty);
    mgpu_cross_entropy_backward(dz, tz, ty, 1.0f);
    CHECK_CLOSE(mgpu_item(losses, 0), 0, 1e-6, 0);
    CHECK_CLOSE(mgpu_item(losses, 1), 1000, 0, 1e-6);
    CHECK_CLOSE(mgpu_item(dz, 0), 0, 1e-6, 0);       /* softmax 1 - 1 */
    CHECK_CLOSE(mgpu_item(dz, 4), -1, 1e-6, 0);      /* softmax 0 - 1 */
    CHECK_CLOSE(mgpu_item(dz, 5), 1, 1e-6, 0);
    mgpu_free(tz); mgpu_free(ty); mgpu_free(losses); mgpu_free(dz);
}

typedef struct {
    float *z;
    mgpu_tensor *labels;
    int n, classes;
    double scale;
} ce_problem;

static double ce_loss(void *problem) {
    ce_problem *p = (ce_problem *)problem;
    mgpu_tensor *z = on_cpu(mgpu_shape2(p->n, p->classes), p->z);
    mgpu_tensor *losses = mgpu_empty(mgpu_cpu(), mgpu_shape1(p->n));
    mgpu_cross_entropy_forward(losses, z, p->labels);
    float *v = (float *)malloc((size_t)p->n * sizeof(float));
    mgpu_to_host(losses, v);
    double sum = 0;
    for (int i = 0; i < p->n; i++) sum += v[i];
    free(v);
    mgpu_free(z);
    mgpu_free(losses);
    return p->scale * sum;
}

static void check_ce_gradient(double scale) {
    const int n = 4, classes = 5;
    float labels[4] = {4, 0, 2, 2};
    ce_problem p = {uniform_array((size_t)n * classes, -3, 3), on_cpu(mgpu_shape1(n), labels), n, classes, scale};
    mgpu_tensor *z = on_cpu(mgpu_shape2(n, classes), p.z), *dz = mgpu_empty(mgpu_cpu(), mgpu_shape2(n, classes));
    mgpu_cross_entropy_backward(dz, z, p.labels, (float)scale);
    float analytic[20];
    mgpu_to_host(dz, analytic);
    for (size_t j = 0; j < (size_t)n * classes; j++)
        CHECK_CLOSE(analytic[j], central_difference(p.z, j, ce_loss, &p), FD_ATOL, FD_RTOL);
    mgpu_free(z); mgpu_free(dz); mgpu_free(p.labels);
    free(p.z);
}
TEST(cross_entropy_gradient_of_the_sum) { check_ce_gradient(1.0); }
TEST(cross_entropy_gradient_of_the_mean) { check_ce_gradient(1.0 / 4.0); }

/* Rows [1 3 3], [2 2 2], [0 1 5], [4 0 4] have their first largest at
   1, 0, 2, 0; with labels 1, 0, 1, 2 the first two are right. */
TEST(accuracy_counts_first_argmax) {
    float z[12] = {1, 3, 3, 2, 2, 2, 0, 1, 5, 4, 0, 4};
    float labels[4] = {1, 0, 1, 2};
    mgpu_tensor *tz = on_cpu(mgpu_shape2(4, 3), z), *ty = on_cpu(mgpu_shape1(4), labels);
    mgpu_tensor *count = mgpu_empty(mgpu_cpu(), mgpu_shape1(1));
    mgpu_accuracy_count(count, tz, ty);
    CHECK_EQ_INT(mgpu_item(count, 0), 2);
    mgpu_free(tz); mgpu_free(ty); mgpu_free(count);
}

/* A NaN counts as the largest logit, as torch.argmax takes it (the first
   NaN of a row): rows [1 NaN 3], [NaN NaN 0], [NaN 2 2], [2 5 NaN],
   [-inf -inf -inf] have their argmax at 1, 0, 0, 2, 0; labels 1, 0, 0, 2, 1
   make 4 right. (A diverged run then scores the same on CPU and GPU.) */
TEST(accuracy_takes_nan_as_the_largest) {
    float z[15] = {1, NAN, 3, NAN, NAN, 0, NAN, 2, 2, 2, 5, NAN, -INFINITY, -INFINITY, -INFINITY};
    float labels[5] = {1, 0, 0, 2, 1};
    mgpu_tensor *tz = on_cpu(mgpu_shape2(5, 3), z), *ty = on_cpu(mgpu_shape1(5), labels);
    mgpu_tensor *count = mgpu_empty(mgpu_cpu(), mgpu_shape1(1));
    mgpu_accuracy_count(count, tz, ty);
    CHECK_EQ_INT(mgpu_item(count, 0), 4);
    mgpu_free(tz); mgpu_free(ty); mgpu_free(count);
}

/* The line a GPU's report of a bad label becomes (kernels/loss.h: the
   kernels write the report; tests/gpu_train_ops.c checks that they do). */
TEST(a_gpus_bad_label_report_is_the_cpus_line) {
    mgpu__label_error e = {(unsigned long long)(uintptr_t) "mgpu_data_parallel_step", 41, 10, -1.0f};
    EXPECT_DIES(mgpu__label_error_fail(&e, mgpu_cpu()),
                "mgpu: error: mgpu_data_parallel_step: label -1 of sample 41 is not a class index in [0, 10) (on cpu)");
    mgpu_device fake_gpu = *mgpu_cpu(); /* (a copy that holds a report, as a GPU's would) */
    fake_gpu.label_error = &e;
    EXPECT_DIES(mgpu__require_no_label_error(&fake_gpu), "label -1 of sample 41");
    e.op = 0; /* no report: nothing to say */
    mgpu__require_no_label_error(&fake_gpu);
}

TEST(sum_and_mean) {
    float v[5] = {1, 2, 3, 4, 5.5f};
    mgpu_tensor *x = on_cpu(mgpu_shape1(5), v), *out = mgpu_empty(mgpu_cpu(), mgpu_shape1(1));
    mgpu_sum(out, x);
    CHECK_CLOSE(mgpu_item(out, 0), 15.5, 0, 0);
    mgpu_mean(out, x);
    CHECK_CLOSE(mgpu_item(out, 0), 3.1, 1e-6, 1e-6);
    mgpu_free(x); mgpu_free(out);
}

/* Runs one loss or accuracy op in a forked child on labels [0, label]. */
static void ce_in_child(int which, float label) {
    mgpu_device *d = fresh_device_in_child();
    float z[6] = {0, 1, 2, 3, 4, 5}, labels[2] = {0, label};
    mgpu_tensor *tz = mgpu_from_host(d, mgpu_shape2(2, 3), z), *ty = mgpu_from_host(d, mgpu_shape1(2), labels);
    mgpu_tensor *out = mgpu_empty(d, which == 1 ? mgpu_shape2(2, 3) : mgpu_shape1(which == 0 ? 2 : 1));
    if (which == 0) mgpu_cross_entropy_forward(out, tz, ty);
    if (which == 1) mgpu_cross_entropy_backward(out, tz, ty, 1.0f);
    if (which == 2) mgpu_accuracy_count(out, tz, ty);
    mgpu_synchronize(d);
}

TEST(cross_entropy_errors) {
    EXPECT_DIES(ce_in_child(0, 3), "mgpu_cross_entropy_forward: label 3 of sample 1 is not a class index in [0, 3)");
    EXPECT_DIES(ce_in_child(1, -1), "mgpu_cross_entropy_backward: label -1 of sample 1 is not a class index in [0, 3)");
    EXPECT_DIES(ce_in_child(2, 1.5f), "mgpu_accuracy_count: label 1.5 of sample 1 is not a class index in [0, 3)");
    mgpu_device *d = mgpu_cpu();
    mgpu_tensor *z = mgpu_zeros(d, mgpu_shape2(4, 3)), *labels = mgpu_zeros(d, mgpu_shape1(5));
    mgpu_tensor *good_labels = mgpu_zeros(d, mgpu_shape1(4)), *losses = mgpu_empty(d, mgpu_shape1(4));
    mgpu_tensor *count2 = mgpu_empty(d, mgpu_shape1(2));
    EXPECT_DIES(mgpu_cross_entropy_forward(losses, z, labels),
                "mgpu_cross_entropy_forward: logits [4, 3] and labels [5] do not match");
    EXPECT_DIES(mgpu_cross_entropy_backward(losses, z, good_labels, 1.0f),
                "mgpu_cross_entropy_backward: shapes [4] and [4, 3] differ");
    EXPECT_DIES(mgpu_accuracy_count(count2, z, good_labels),
                "mgpu_accuracy_count: the output has shape [2]; it must be [1]");
    EXPECT_DIES(mgpu_sum(count2, z), "mgpu_sum: the output has shape [2]; it must be [1]");
    mgpu_free(z); mgpu_free(labels); mgpu_free(good_labels); mgpu_free(losses); mgpu_free(count2);
}

/* ------------------------------------------------------------------ SGD */
/* lr 0.1, batch 4: param -= 0.025 grad, and grad is cleared.
   [1, 2] - 0.025 [2, -4] = [0.95, 2.1]; - 0.025 [4, 0] = [0.85, 2.1];
   - 0.025 [-8, 8] = [1.05, 1.9]. */
TEST(sgd_book_steps) {
    float p0[2] = {1, 2}, grads[3][2] = {{2, -4}, {4, 0}, {-8, 8}};
    float want[3][2] = {{0.95f, 2.1f}, {0.85f, 2.1f}, {1.05f, 1.9f}};
    mgpu_tensor *p = on_cpu(mgpu_shape1(2), p0);
    for (int step = 0; step < 3; step++) {
        mgpu_tensor *g = on_cpu(mgpu_shape1(2), grads[step]);
        mgpu_sgd_book(p, g, 0.1f, 4);
        for (int i = 0; i < 2; i++) {
            CHECK_CLOSE(mgpu_item(p, (size_t)i), want[step][i], 1e-6, 1e-6);
            CHECK_CLOSE(mgpu_item(g, (size_t)i), 0, 0, 0);
        }
        mgpu_free(g);
    }
    mgpu_free(p);
}

/* lr 0.1, weight decay 0.01, the same gradient [1, -2] at every step
   (the step leaves it alone), from param [1, 2].
   momentum 0.9, element 0:
       step 1: g = 1 + 0.01*1 = 1.01;  buf = 1.01;  p = 1 - 0.101 = 0.899
       step 2: g = 1.00899;  buf = 0.9*1.01 + 1.00899 = 1.91799;  p = 0.707201
       step 3: g = 1.00707201;  buf = 2.73326301;  p = 0.433874699
   element 1: p = 2.198, 2.574002, 3.109829798.
   momentum 0: p -= 0.1 (grad + 0.01 p): [0.899, 2.198], [0.798101, 2.395802],
   [0.697302899, 2.593406198]. */
static void check_sgd(float momentum, const double want[3][2]) {
    float p0[2] = {1, 2}, g0[2] = {1, -2};
    mgpu_tensor *p = on_cpu(mgpu_shape1(2), p0), *g = on_cpu(mgpu_shape1(2), g0);
    mgpu_tensor *buf = momentum != 0 ? mgpu_empty(mgpu_cpu(), mgpu_shape1(2)) : NULL;
    for (int step = 0; step < 3; step++) {
        mgpu_sgd_step(p, g, buf, 0.1f, momentum, 0.01f, step == 0);
        for (int i = 0; i < 2; i++) {
            CHECK_CLOSE(mgpu_item(p, (size_t)i), want[step][i], 1e-6, 1e-6);
            CHECK_CLOSE(mgpu_item(g, (size_t)i), g0[i], 0, 0);
        }
    }
    mgpu_free(p); mgpu_free(g); mgpu_free(buf);
}
TEST(sgd_momentum_weight_decay_steps) {
    const double want[3][2] = {{0.899, 2.198}, {0.707201, 2.574002}, {0.433874699, 3.109829798}};
    check_sgd(0.9f, want);
}
TEST(sgd_weight_decay_without_momentum) {
    const double want[3][2] = {{0.899, 2.198}, {0.798101, 2.395802}, {0.697302899, 2.593406198}};
    check_sgd(0.0f, want);
}

TEST(sgd_errors) {
    mgpu_device *d = mgpu_cpu();
    mgpu_tensor *p = mgpu_zeros(d, mgpu_shape1(3)), *g = mgpu_zeros(d, mgpu_shape1(4));
    mgpu_tensor *g3 = mgpu_zeros(d, mgpu_shape1(3));
    EXPECT_DIES(mgpu_sgd_book(p, g, 0.1f, 4), "mgpu_sgd_book: shapes [3] and [4] differ");
    EXPECT_DIES(mgpu_sgd_book(p, g3, 0.1f, 0), "mgpu_sgd_book: batch_size is 0; it must be positive");
    EXPECT_DIES(mgpu_sgd_step(p, g, NULL, 0.1f, 0, 0, 1), "mgpu_sgd_step: shapes [3] and [4] differ");
    EXPECT_DIES(mgpu_sgd_step(p, g3, NULL, 0.1f, 0.9f, 0, 1),
                "mgpu_sgd_step: momentum_buf (needed with momentum) is NULL");
    EXPECT_DIES(mgpu_sgd_step(p, g3, g, 0.1f, 0.9f, 0, 1), "mgpu_sgd_step: shapes [3] and [4] differ");
    EXPECT_DIES(mgpu_sgd_step(p, g3, NULL, 0.1f, 0, -1e-4f, 1),
                "mgpu_sgd_step: learning rate 0.1, momentum 0, weight decay -0.0001: each must be a finite 0 or more");
    EXPECT_DIES(mgpu_sgd_step(p, g3, g3, 0.1f, NAN, 0, 1), "mgpu_sgd_step: learning rate 0.1, momentum nan");
    mgpu_free(p); mgpu_free(g); mgpu_free(g3);
}

TEST_MAIN()
