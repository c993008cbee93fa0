/* tests/test_layers.c: the layers on the CPU device.

   Forward: every output against direct loops in double (for the
   convolution, the sum over (c, r, s) straight from its definition, not
   im2col), so a wrong index in im2col, in the product or in the layout
   shows up as a wrong value.

   Backward: against finite differences of L = sum(y * r), with a random
   "upstream gradient" r (accumulated in double). Then dL/dy = r, so the
   backward pass run with dy = r must give dL/d(input) for every input,
   and the central difference
       (L(v + eps) - L(v - eps)) / ((v + eps) - (v - eps))
   estimates it. Every operation here is linear in each input taken alone
   (the convolution and the linear layer in x for fixed weights and in the
   weights for fixed x; ReLU on inputs kept at least 0.1 away from its
   kink, with eps = 0.01), so the difference quotient is exact up to
   rounding: its only error is the float rounding of the outputs that
   change, about 1e-7 * |y| each, divided by 2 eps = 0.02: at most 5e-5
   in these cases. The tolerance, 1e-3 absolute plus 1e-3 relative, leaves
   a wide margin and still catches any wrong index (which is off by O(1)). The
   denominator is the difference of the two float inputs actually used, so
   the rounding of v +- eps to float costs nothing.

   Every element of an input of up to 200 elements is checked; of larger
   ones, 60 chosen at random. Gradients are first computed with their
   tensors filled with NaN (an overwrite must not read them), then again
   with accumulate = 1 on top of random values (parameter gradients must
   add; dx must still be overwritten). */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"
#include "test.h"

/* ------------------------------------------------------------- helpers */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static double rng_uniform(void) { /* [0, 1), xorshift64* */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (double)((rng_state * 0x2545f4914f6cdd1dull) >> 11) / 9007199254740992.0;
}
static float *random_values(size_t n, int away_from_zero) {
    float *v = (float *)malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        double u = 2.0 * rng_uniform() - 1.0; /* [-1, 1) */
        if (away_from_zero) u = (u < 0 ? -0.1 : 0.1) + 0.9 * u; /* |u| >= 0.1 */
        v[i] = (float)u;
    }
    return v;
}
static float *to_host(const mgpu_tensor *t) {
    float *v = (float *)malloc(t->numel * sizeof(float));
    mgpu_to_host(t, v);
    return v;
}
/* Sets one element of a tensor on the CPU device (its memory is the host's). */
static void set_element(mgpu_tensor *t, size_t i, float v) {
    mgpu_synchronize(t->device);
    t->data[i] = v;
}
static mgpu_tensor *tensor_of(mgpu_shape s, const float *v) {
    return mgpu_from_host(mgpu_cpu(), s, v);
}

/* Compares got with a double reference, element by element; on the first
   failure says where. */
static void check_values(const char *what, const float *got, const double *want, size_t n,
                         double atol, double rtol) {
    int before = test__failures;
    for (size_t i = 0; i < n && test__failures == before; i++) {
        CHECK_CLOSE(got[i], want[i], atol, rtol);
        if (test__failures != before) fprintf(stderr, "  (%s, element %zu)\n", what, i);
    }
}

/* ------------------------------------------------- the operations tested */
typedef struct layer_case layer_case;
#define MAX_INPUTS 3
struct layer_case {
    const char *name;
    int ninputs;                       /* the input, then the parameters */
    mgpu_shape in[MAX_INPUTS];
    int is_param[MAX_INPUTS];          /* gradient accumulates with accumulate = 1 */
    mgpu_shape out;
    int stride, pad, k, mask_is_output; /* what the operation needs */
    void (*forward)(const layer_case *c, mgpu_tensor *y, mgpu_tensor *const *in);
    void (*backward)(const layer_case *c, mgpu_tensor *const *grad, const mgpu_tensor *dy,
                     mgpu_tensor *const *in, int accumulate);
    void (*reference)(const layer_case *c, const float *const *in, double *y);
};

/* conv: in = x, w, and b when there are 3 inputs */
static void conv_forward(const layer_case *c, mgpu_tensor *y, mgpu_tensor *const *in) {
    mgpu_conv2d_forward(y, in[0], in[1], c->ninputs > 2 ? in[2] : NULL, c->stride, c->pad);
}
static void conv_backward(const layer_case *c, mgpu_tensor *const *grad, const mgpu_tensor *dy,
                          mgpu_tensor *const *in, int accumulate) {
    mgpu_conv2d_backward(grad[0], grad[1], c->ninputs > 2 ? grad[2] : NULL, dy, in[0], in[1],
                         c->stride, c->pad, accumulate);
}
static void conv_reference(const layer_case *c, const float *const *in, double *y) {
    const int *xs = c->in[0].d, *ws = c->in[1].d, *ys = c->out.d;
    for (int n = 0; n < ys[0]; n++)
        for (int k = 0; k < ys[1]; k++)
            for (int p = 0; p < ys[2]; p++)
                for (int q = 0; q < ys[3]; q++) {
                    double sum = c->ninputs > 2 ? in[2][k] : 0.0;
                    for (int ch = 0; ch < xs[1]; ch++)
                        for (int r = 0; r < ws[2]; r++)
                            for (int s = 0; s < ws[3]; s++) {
                                int h = p * c->stride + r - c->pad, w = q * c->stride + s - c->pad;
                                if (h < 0 || h >= xs[2] || w < 0 || w >= xs[3]) continue;
                                sum += (double)in[1][((k * ws[1] + ch) * ws[2] + r) * ws[3] + s] *
                                       in[0][((n * xs[1] + ch) * xs[2] + h) * xs[3] + w];
                            }
                    y[((n * ys[1] + k) * ys[2] + p) * ys[3] + q] = sum;
                }
}
static layer_case conv_case(const char *name, int n, int ch, int h, int w, int k, int r, int s,
                            int stride, int pad, int bias) {
    layer_case c;
    memset(&c, 0, sizeof c);
    c.name = name;
    c.ninputs = bias ? 3 : 2;
    c.in[0] = mgpu_shape4(n, ch, h, w);
    c.in[1] = mgpu_shape4(k, ch, r, s);
    c.in[2] = mgpu_shape1(k);
    c.is_param[1] = c.is_param[2] = 1;
    c.out = mgpu_conv2d_output_shape(c.in[0], c.in[1], stride, pad);
    c.stride = stride;
    c.pad = pad;
    c.forward = conv_forward;
    c.backward = conv_backward;
    c.reference = conv_reference;
    return c;
}

/* linear: in = x, w, and b when there are 3 inputs */
static void linear_forward(const layer_case *c, mgpu_tensor *y, mgpu_tensor *const *in) {
    mgpu_linear_forward(y, in[0], in[1], c->ninputs > 2 ? in[2] : NULL);
}
static void linear_backward(const layer_case *c, mgpu_tensor *const *grad, const mgpu_tensor *dy,
                            mgpu_tensor *const *in, int accumulate) {
    mgpu_linear_backward(grad[0], grad[1], c->ninputs > 2 ? grad[2] : NULL, dy, in[0], in[1],
                         accumulate);
}
static void linear_reference(const layer_case *c, const float *const *in, double *y) {
    int rows = c->out.d[0], fin = c->in[1].d[0], fout = c->in[1].d[1];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < fout; j++) {
            double sum = c->ninputs > 2 ? in[2][j] : 0.0;
            for (int l = 0; l < fin; l++) sum += (double)in[0][i * fin + l] * in[1][l * fout + j];
            y[i * fout + j] = sum;
        }
}
static layer_case linear_case(const char *name, mgpu_shape x, int fout, int bias) {
    layer_case c;
    memset(&c, 0, sizeof c);
    c.name = name;
    c.ninputs = bias ? 3 : 2;
    c.in[0] = x;
    c.in[1] = mgpu_shape2((int)(mgpu_shape_numel(x) / (size_t)x.d[0]), fout);
    c.in[2] = mgpu_shape1(fout);
    c.is_param[1] = c.is_param[2] = 1;
    c.out = mgpu_shape2(x.d[0], fout);
    c.forward = linear_forward;
    c.backward = linear_backward;
    c.reference = linear_reference;
    return c;
}

/* average pooling: in = x */
static void pool_forward(const layer_case *c, mgpu_tensor *y, mgpu_tensor *const *in) {
    mgpu_avg_pool2d_forward(y, in[0], c->k);
}
static void pool_backward(const layer_case *c, mgpu_tensor *const *grad, const mgpu_tensor *dy,
                          mgpu_tensor *const *in, int accumulate) {
    (void)in;
    (void)accumulate;
    mgpu_avg_pool2d_backward(grad[0], dy, c->k);
}
static void pool_reference(const layer_case *c, const float *const *in, double *y) {
    const int *xs = c->in[0].d, *ys = c->out.d;
    for (int plane = 0; plane < ys[0] * ys[1]; plane++)
        for (int p = 0; p < ys[2]; p++)
            for (int q = 0; q < ys[3]; q++) {
                double sum = 0;
                for (int i = 0; i < c->k; i++)
                    for (int j = 0; j < c->k; j++)
                        sum += in[0][(plane * xs[2] + p * c->k + i) * xs[3] + q * c->k + j];
                y[(plane * ys[2] + p) * ys[3] + q] = sum / (c->k * c->k);
            }
}
static layer_case pool_case(const char *name, mgpu_shape x, int k) {
    layer_case c;
    memset(&c, 0, sizeof c);
    c.name = name;
    c.ninputs = 1;
    c.in[0] = x;
    c.out = mgpu_avg_pool2d_output_shape(x, k);
    c.k = k;
    c.forward = pool_forward;
    c.backward = pool_backward;
    c.reference = pool_reference;
    return c;
}

/* global average pooling: in = x */
static void gpool_forward(const layer_case *c, mgpu_tensor *y, mgpu_tensor *const *in) {
    (void)c;
    mgpu_global_avg_pool_forward(y, in[0]);
}
static void gpool_backward(const layer_case *c, mgpu_tensor *const *grad, const mgpu_tensor *dy,
                           mgpu_tensor *const *in, int accumulate) {
    (void)c;
    (void)in;
    (void)accumulate;
    mgpu_global_avg_pool_backward(grad[0], dy);
}
static void gpool_reference(const layer_case *c, const float *const *in, double *y) {
    int planes = c->out.d[0] * c->out.d[1], hw = c->in[0].d[2] * c->in[0].d[3];
    for (int p = 0; p < planes; p++) {
        double sum = 0;
        for (int i = 0; i < hw; i++) sum += in[0][p * hw + i];
        y[p] = sum / hw;
    }
}
static layer_case gpool_case(const char *name, mgpu_shape x) {
    layer_case c;
    memset(&c, 0, sizeof c);
    c.name = name;
    c.ninputs = 1;
    c.in[0] = x;
    c.out = mgpu_shape2(x.d[0], x.d[1]);
    c.forward = gpool_forward;
    c.backward = gpool_backward;
    c.reference = gpool_reference;
    return c;
}

/* ReLU: in = x; the backward mask is x, or the output recomputed */
static void relu_forward(const layer_case *c, mgpu_tensor *y, mgpu_tensor *const *in) {
    (void)c;
    mgpu_relu_forward(y, in[0]);
}
static void relu_backward(const layer_case *c, mgpu_tensor *const *grad, const mgpu_tensor *dy,
                          mgpu_tensor *const *in, int accumulate) {
    (void)accumulate;
    if (!c->mask_is_output) {
        mgpu_relu_backward(grad[0], dy, in[0]);
        return;
    }
    mgpu_tensor *y = mgpu_empty(in[0]->device, in[0]->shape);
    mgpu_relu_forward(y, in[0]);
    mgpu_relu_backward(grad[0], dy, y);
    mgpu_free(y);
}
static void relu_reference(const layer_case *c, const float *const *in, double *y) {
    for (size_t i = 0; i < mgpu_shape_numel(c->out); i++) y[i] = in[0][i] > 0 ? in[0][i] : 0.0;
}
static layer_case relu_case(const char *name, mgpu_shape x, int mask_is_output) {
    layer_case c;
    memset(&c, 0, sizeof c);
    c.name = name;
    c.ninputs = 1;
    c.in[0] = x;
    c.out = x;
    c.mask_is_output = mask_is_output;
    c.forward = relu_forward;
    c.backward = relu_backward;
    c.reference = relu_reference;
    return c;
}

/* residual sum: in = a, b; the backward pass is the documented rule
   dL/da = dL/db = dL/dy, which the finite differences check */
static void add_forward(const layer_case *c, mgpu_tensor *y, mgpu_tensor *const *in) {
    (void)c;
    mgpu_add(y, in[0], in[1]);
}
static void add_backward(const layer_case *c, mgpu_tensor *const *grad, const mgpu_tensor *dy,
                         mgpu_tensor *const *in, int accumulate) {
    (void)c;
    (void)in;
    (void)accumulate;
    mgpu_copy(grad[0], dy, 0);
    mgpu_copy(grad[1], dy, 0);
}
static void add_reference(const layer_case *c, const float *const *in, double *y) {
    for (size_t i = 0; i < mgpu_shape_numel(c->out); i++) y[i] = (double)in[0][i] + in[1][i];
}
static layer_case add_case(const char *name, mgpu_shape x) {
    layer_case c;
    memset(&c, 0, sizeof c);
    c.name = name;
    c.ninputs = 2;
    c.in[0] = c.in[1] = x;
    c.out = x;
    c.forward = add_forward;
    c.backward = add_backward;
    c.reference = add_reference;
    return c;
}

/* ---------------------------------------------------------- the checks */

/* Random inputs of a case (kept away from 0, where ReLU has its kink). */
typedef struct {
    float *value[MAX_INPUTS];
    mgpu_tensor *in[MAX_INPUTS];
} case_inputs;
static case_inputs inputs_new(const layer_case *c) {
    case_inputs ci;
    memset(&ci, 0, sizeof ci);
    for (int i = 0; i < c->ninputs; i++) {
        ci.value[i] = random_values(mgpu_shape_numel(c->in[i]), 1);
        ci.in[i] = tensor_of(c->in[i], ci.value[i]);
    }
    return ci;
}
static void inputs_free(const layer_case *c, case_inputs *ci) {
    for (int i = 0; i < c->ninputs; i++) {
        free(ci->value[i]);
        mgpu_free(ci->in[i]);
    }
}

/* The forward output against the double reference. */
static void check_forward(const layer_case *c) {
    case_inputs ci = inputs_new(c);
    size_t n = mgpu_shape_numel(c->out);
    mgpu_tensor *y = mgpu_full(mgpu_cpu(), c->out, NAN);
    c->forward(c, y, ci.in);
    float *got = to_host(y);
    double *want = (double *)malloc(n * sizeof(double));
    c->reference(c, (const float *const *)ci.value, want);
    /* float accumulation over at most a few hundred terms of size ~1 */
    check_values(c->name, got, want, n, 1e-5, 1e-5);
    free(got);
    free(want);
    mgpu_free(y);
    inputs_free(c, &ci);
}

/* L = sum(y * r) in double, for the current inputs. */
static double loss_of(const layer_case *c, mgpu_tensor *y, mgpu_tensor *const *in, const float *r) {
    c->forward(c, y, in);
    float *v = to_host(y);
    double sum = 0;
    for (size_t i = 0; i < y->numel; i++) sum += (double)v[i] * r[i];
    free(v);
    return sum;
}

static void check_gradients(const layer_case *c) {
    int failures_before = test__failures;
    mgpu_device *cpu = mgpu_cpu();
    case_inputs ci = inputs_new(c);
    size_t nout = mgpu_shape_numel(c->out);
    float *r = random_values(nout, 0);
    mgpu_tensor *dy = tensor_of(c->out, r), *y = mgpu_empty(cpu, c->out);
    mgpu_tensor *grad[MAX_INPUTS];
    float *analytic[MAX_INPUTS];

    /* Overwrite: the gradient tensors hold NaN, which must not be read. */
    for (int i = 0; i < c->ninputs; i++) grad[i] = mgpu_full(cpu, c->in[i], NAN);
    c->backward(c, grad, dy, ci.in, 0);
    for (int i = 0; i < c->ninputs; i++) analytic[i] = to_host(grad[i]);

    const float eps = 1e-2f;
    for (int i = 0; i < c->ninputs; i++) {
        size_t n = mgpu_shape_numel(c->in[i]);
        size_t count = n <= 200 ? n : 60;
        for (size_t j = 0; j < count; j++) {
            size_t e = n <= 200 ? j : (size_t)(rng_uniform() * (double)n);
            float v = ci.value[i][e], plus = v + eps, minus = v - eps;
            set_element(ci.in[i], e, plus);
            double lp = loss_of(c, y, ci.in, r);
            set_element(ci.in[i], e, minus);
            double lm = loss_of(c, y, ci.in, r);
            set_element(ci.in[i], e, v);
            double numeric = (lp - lm) / ((double)plus - (double)minus);
            int before = test__failures;
            CHECK_CLOSE(analytic[i][e], numeric, 1e-3, 1e-3);
            if (test__failures != before)
                fprintf(stderr, "  (%s: gradient of input %d, element %zu)\n", c->name, i, e);
        }
    }

    /* Accumulate: parameter gradients add to what is there; dx is still
       overwritten (it holds NaN again). */
    float *start[MAX_INPUTS];
    for (int i = 0; i < c->ninputs; i++) {
        size_t n = mgpu_shape_numel(c->in[i]);
        start[i] = random_values(n, 0);
        mgpu_free(grad[i]);
        grad[i] = c->is_param[i] ? tensor_of(c->in[i], start[i]) : mgpu_full(cpu, c->in[i], NAN);
    }
    c->backward(c, grad, dy, ci.in, 1);
    for (int i = 0; i < c->ninputs; i++) {
        size_t n = mgpu_shape_numel(c->in[i]);
        float *got = to_host(grad[i]);
        double *want = (double *)malloc(n * sizeof(double));
        for (size_t e = 0; e < n; e++)
            want[e] = (double)analytic[i][e] + (c->is_param[i] ? start[i][e] : 0.0f);
        check_values(c->name, got, want, n, 1e-5, 1e-5);
        free(got);
        free(want);
        free(start[i]);
        free(analytic[i]);
        mgpu_free(grad[i]);
    }
    if (test__failures != failures_before) fprintf(stderr, "  (in case %s)\n", c->name);
    free(r);
    mgpu_free(dy);
    mgpu_free(y);
    inputs_free(c, &ci);
}

static void check_case(const layer_case *c) {
    check_forward(c);
    check_gradients(c);
}

/* ----------------------------------------------------------------- tests */
static layer_case conv_cases[10];
static int nconv_cases;
__attribute__((constructor)) static void make_conv_cases(void) {
    int i = 0;
    /*                         name                   N  C   H  W  K  R  S  t  d  bias */
    conv_cases[i++] = conv_case("3x3 single image", 1, 1, 6, 6, 2, 3, 3, 1, 0, 1);
    conv_cases[i++] = conv_case("3x3 pad 1", 3, 3, 7, 9, 4, 3, 3, 1, 1, 1);
    conv_cases[i++] = conv_case("5x5 no bias", 2, 2, 8, 7, 3, 5, 5, 1, 0, 0);
    conv_cases[i++] = conv_case("5x5 stride 2 pad 1", 2, 3, 9, 8, 5, 5, 5, 2, 1, 1);
    conv_cases[i++] = conv_case("1x1 stride 2", 2, 4, 6, 5, 3, 1, 1, 2, 0, 1);
    conv_cases[i++] = conv_case("3x3 stride 2 pad 1", 1, 2, 7, 7, 2, 3, 3, 2, 1, 0);
    conv_cases[i++] = conv_case("1x1 pad 1", 2, 3, 5, 6, 2, 1, 1, 1, 1, 1);
    conv_cases[i++] = conv_case("3x2 kernel", 2, 2, 6, 7, 3, 3, 2, 1, 1, 1);
    conv_cases[i++] = conv_case("3x3 stride 3 pad 2", 1, 2, 11, 10, 2, 3, 3, 3, 2, 1);
    /* a 1-pixel-wide input: some kernel columns see only padding */
    conv_cases[i++] = conv_case("5x5 pad 2 of 3x1", 2, 2, 3, 1, 2, 5, 5, 1, 2, 1);
    nconv_cases = i;
}

TEST(conv2d_forward_and_gradients) {
    for (int i = 0; i < nconv_cases; i++) check_case(&conv_cases[i]);
}

/* The first layer needs no dx: dw and db are the same without it. */
TEST(conv2d_backward_without_dx) {
    layer_case c = conv_case("no dx", 2, 3, 7, 6, 4, 3, 3, 1, 1, 1);
    case_inputs ci = inputs_new(&c);
    mgpu_device *cpu = mgpu_cpu();
    mgpu_tensor *dy = mgpu_randn(cpu, c.out, 0, 1);
    mgpu_tensor *dx = mgpu_empty(cpu, c.in[0]), *dw1 = mgpu_empty(cpu, c.in[1]),
                *db1 = mgpu_empty(cpu, c.in[2]), *dw2 = mgpu_empty(cpu, c.in[1]),
                *db2 = mgpu_empty(cpu, c.in[2]);
    mgpu_conv2d_backward(dx, dw1, db1, dy, ci.in[0], ci.in[1], 1, 1, 0);
    mgpu_conv2d_backward(NULL, dw2, db2, dy, ci.in[0], ci.in[1], 1, 1, 0);
    float *a = to_host(dw1), *b = to_host(dw2), *ab = to_host(db1), *bb = to_host(db2);
    for (size_t i = 0; i < dw1->numel; i++) CHECK(a[i] == b[i]);
    for (size_t i = 0; i < db1->numel; i++) CHECK(ab[i] == bb[i]);
    free(a); free(b); free(ab); free(bb);
    mgpu_free(dy); mgpu_free(dx); mgpu_free(dw1); mgpu_free(db1); mgpu_free(dw2); mgpu_free(db2);
    inputs_free(&c, &ci);
}

/* y, dx, dw, db of a convolution case, on the host. */
static void conv_run(const layer_case *c, const case_inputs *ci, const mgpu_tensor *dy,
                     float *out[4]) {
    mgpu_device *cpu = mgpu_cpu();
    mgpu_tensor *y = mgpu_empty(cpu, c->out);
    mgpu_tensor *grads[3] = {mgpu_empty(cpu, c->in[0]), mgpu_empty(cpu, c->in[1]),
                             mgpu_empty(cpu, c->in[2])};
    conv_forward(c, y, ci->in);
    conv_backward(c, grads, dy, ci->in, 0);
    out[0] = to_host(y);
    mgpu_free(y);
    for (int t = 0; t < 3; t++) {
        out[t + 1] = to_host(grads[t]);
        mgpu_free(grads[t]);
    }
}

/* A scratch budget of a few images makes the batch run in several chunks;
   the results must be those of one chunk, and dw must add up over the
   chunks (also on top of an existing gradient: the finite differences). */
TEST(conv2d_in_chunks) {
    size_t saved = mgpu__conv_scratch_floats[0]; /* the CPU's */
    layer_case c = conv_case("in chunks", 5, 3, 7, 6, 4, 3, 3, 1, 1, 1);
    size_t per_image = (size_t)(3 * 3 * 3 + 4) * 7 * 6; /* (C*R*S + K) * P*Q */
    size_t sizes[4] = {mgpu_shape_numel(c.out), mgpu_shape_numel(c.in[0]),
                       mgpu_shape_numel(c.in[1]), mgpu_shape_numel(c.in[2])};
    case_inputs ci = inputs_new(&c);
    mgpu_tensor *dy = mgpu_randn(mgpu_cpu(), c.out, 0, 1);
    float *whole[4], *chunked[4];
    conv_run(&c, &ci, dy, whole);
    /* chunks of 2, 2 and 1 images; then a budget below one image: 1 per chunk */
    size_t budgets[2] = {2 * per_image, 1};
    for (int b = 0; b < 2; b++) {
        mgpu__conv_scratch_floats[0] = budgets[b];
        conv_run(&c, &ci, dy, chunked);
        for (int t = 0; t < 4; t++) {
            int before = test__failures;
            for (size_t e = 0; e < sizes[t] && before == test__failures; e++)
                CHECK_CLOSE(chunked[t][e], whole[t][e], 1e-5, 1e-5);
            if (before != test__failures)
                fprintf(stderr, "  (budget %zu, tensor %d)\n", budgets[b], t);
            free(chunked[t]);
        }
    }
    mgpu__conv_scratch_floats[0] = 2 * per_image;
    check_gradients(&c);
    mgpu__conv_scratch_floats[0] = 1;
    check_gradients(&conv_cases[3]);
    mgpu__conv_scratch_floats[0] = saved;
    for (int t = 0; t < 4; t++) free(whole[t]);
    mgpu_free(dy);
    inputs_free(&c, &ci);
}

/* The convolutions' settings read again with variable `name` set to
   `value` (NULL: unset). */
static void reread_conv_settings(const char *name, const char *value) {
    if (value) setenv(name, value, 1);
    else unsetenv(name);
    mgpu__conv_env_read = 0;
    mgpu__conv_settings_from_environment();
}
/* The CPU's im2col scratch, 4 MiB = 1 << 20 floats, holds a chunk of 102
   images of (9 + 4) * 28 * 28 floats; 3 MiB (bench/profile --scratch-mb
   3) holds 77. */
TEST(conv_settings_from_the_environment) {
    size_t saved = mgpu__conv_scratch_floats[0];
    mgpu__conv_geom g = mgpu__conv_geometry("test", mgpu_shape4(256, 1, 28, 28),
                                            mgpu_shape4(4, 1, 3, 3), 1, 1);
    CHECK_EQ_INT(mgpu__conv_chunk(&g, mgpu_cpu()), 102);
    mgpu__conv_scratch_floats[0] = (size_t)3 << 18;
    CHECK_EQ_INT(mgpu__conv_chunk(&g, mgpu_cpu()), 77);
    mgpu__conv_scratch_floats[0] = saved;
    /* MGPU_CONV chooses the algorithm (by rule unless told) */
    const char *names[] = {"implicit", "im2col", "timed", "", "cudnn", "rule"};
    int modes[] = {MGPU__CONV_IMPLICIT, MGPU__CONV_IM2COL, MGPU__CONV_TIMED, MGPU__CONV_RULE, MGPU__CONV_CUDNN,
                   MGPU__CONV_RULE};
    for (int i = 0; i < 6; i++) {
        reread_conv_settings("MGPU_CONV", names[i]);
        CHECK_EQ_INT(mgpu__conv_mode, modes[i]);
    }
    setenv("MGPU_CONV", "winograd", 1);
    mgpu__conv_env_read = 0;
    EXPECT_DIES(mgpu__conv_settings_from_environment(),
                "MGPU_CONV=winograd: want rule (the default), timed, im2col, implicit or cudnn");
    reread_conv_settings("MGPU_CONV", NULL);
    CHECK_EQ_INT(mgpu__conv_mode, MGPU__CONV_RULE);
    /* MGPU_WGMMA: 0 leaves the wgmma kernels out; 1 or nothing keeps them */
    const char *wgmma[] = {"1", "0", ""};
    for (int i = 0; i < 3; i++) {
        reread_conv_settings("MGPU_WGMMA", wgmma[i]);
        CHECK_EQ_INT(mgpu__conv_wgmma_asked, i != 1);
    }
    setenv("MGPU_WGMMA", "yes", 1);
    mgpu__conv_env_read = 0;
    EXPECT_DIES(mgpu__conv_settings_from_environment(),
                "MGPU_WGMMA=yes: want 1 (the default: wgmma too, on sm_90) or 0 (mma.sync alone)");
    reread_conv_settings("MGPU_WGMMA", NULL);
    CHECK_EQ_INT(mgpu__conv_wgmma_asked, 1);
}

/* got against want, element by element, within the tolerances; the first
   element outside them is named, with `what`. */
static void check_close_floats(const char *what, const float *got, const float *want, size_t n, double atol,
                               double rtol) {
    int before = test__failures;
    for (size_t i = 0; i < n && test__failures == before; i++) {
        CHECK_CLOSE(got[i], want[i], atol, rtol);
        if (test__failures != before) fprintf(stderr, "  (%s, element %zu)\n", what, i);
    }
}
/* Whether the tracer saw an operation of this name since it began. */
static int traced(const char *name) {
    for (int i = 0; i < mgpu__library.trace_n; i++)
        if (mgpu__library.trace[i].name && strcmp(mgpu__library.trace[i].name, name) == 0) return 1;
    return 0;
}

/* One pass computed on a CPU device in one of MGPU_CONV's modes, or by
   one of the CPU's ways (conv_by_way): each tensor's values, from the
   same random tensors every time. */
typedef struct {
    float *y, *dx, *dw;
} conv_results;
static conv_results conv_computed(int way, mgpu_shape xs, mgpu_shape ws, int stride, int pad, int accumulate,
                                  int add_to_dx) {
    mgpu_device *cpu = mgpu_cpu();
    mgpu_manual_seed(7); /* the same tensors both ways */
    mgpu_tensor *x = mgpu_randn(cpu, xs, 0.0f, 1.0f), *w = mgpu_randn(cpu, ws, 0.0f, 0.1f);
    mgpu_tensor *b = mgpu_randn(cpu, mgpu_shape1(ws.d[0]), 0.0f, 1.0f);
    mgpu_shape ys = mgpu_conv2d_output_shape(xs, ws, stride, pad);
    mgpu_tensor *dy = mgpu_randn(cpu, ys, 0.0f, 1.0f), *y = mgpu_empty(cpu, ys);
    mgpu_tensor *dx = mgpu_randn(cpu, xs, 0.0f, 1.0f), *dw = mgpu_randn(cpu, ws, 0.0f, 1.0f);
    if (way < 0) { /* (as MGPU_CONV says) */
        mgpu_conv2d_forward(y, x, w, b, stride, pad);
        mgpu__conv2d_backward(dx, dw, NULL, dy, NULL, x, NULL, w, NULL, stride, pad, accumulate, add_to_dx, 0);
    } else {
        mgpu__conv_geom g = mgpu__conv_geometry("test", xs, ws, stride, pad);
        mgpu__cpu_conv_call forward = {y, NULL, NULL, x, w, b, NULL, &g, 0, 0, 0, 0};
        mgpu__cpu_conv_call backward = {NULL, dx, dw, x, w, NULL, dy, &g, 1, accumulate, add_to_dx, 0};
        CHECK(mgpu__cpu_conv_by((mgpu__cpu_conv_way)way, &forward) &&
              mgpu__cpu_conv_by((mgpu__cpu_conv_way)way, &backward));
    }
    conv_results r = {to_host(y), to_host(dx), to_host(dw)};
    mgpu_free(x), mgpu_free(w), mgpu_free(b), mgpu_free(dy), mgpu_free(y), mgpu_free(dx), mgpu_free(dw);
    return r;
}
static conv_results conv_by(mgpu__conv_mode_kind mode, mgpu_shape xs, mgpu_shape ws, int stride, int pad,
                            int accumulate, int add_to_dx) {
    mgpu__conv_mode = mode;
    return conv_computed(-1, xs, ws, stride, pad, accumulate, add_to_dx);
}
#if MGPU_ONEDNN
static conv_results conv_by_way(mgpu__cpu_conv_way way, mgpu_shape xs, mgpu_shape ws, int stride, int pad,
                                int accumulate, int add_to_dx) {
    return conv_computed((int)way, xs, ws, stride, pad, accumulate, add_to_dx);
}
#endif

/* The CPU's rule for the vector widths of another CPU: oneDNN's and
   OpenBLAS's AVX-512 (1) or not (0); restore_widths puts this one's
   back. */
static int saved_widths[2];
static void take_widths(int onednn_avx512, int blas_avx512) {
    mgpu__cpu_vector_widths();
    saved_widths[0] = mgpu__onednn_avx512, saved_widths[1] = mgpu__blas_avx512;
    mgpu__onednn_avx512 = onednn_avx512, mgpu__blas_avx512 = blas_avx512;
}
static void restore_widths(void) { mgpu__onednn_avx512 = saved_widths[0], mgpu__blas_avx512 = saved_widths[1]; }

/* By rule (the default) a CPU device whose oneDNN runs AVX2 kernels (or
   that has no oneDNN) computes passes of 3x3 layers at stride 1 by
   Winograd's F(2x2, 3x3) (kernels/winograd.h): the forward pass from 128
   channels and filters, dx from 512, dW from 64; where oneDNN runs
   AVX-512 kernels, none. Within
   float rounding of im2col, written and added to, with padding 0 to 2
   and odd outputs (a last row and column of tiles half used); the same
   bits twice; timed times it beside the other ways (and computes what
   its choice does), implicit leaves it out, and so do fewer channels and
   a stride. (Not the same bits on 1 and 3 threads: the products are
   OpenBLAS's, whose sums, as im2col's, round differently with the number
   of threads at these sizes.) */
TEST(cpu_3x3_layers_by_winograd) {
    mgpu__conv_settings_from_environment(); /* (before the test sets the mode) */
    mgpu__conv_mode_kind saved = mgpu__conv_mode;
    take_widths(0, 0);
    struct { int c, h, k, stride, pad, y, dx, dw; } shapes[] = { /* and which passes Winograd takes */
        {128, 6, 128, 1, 1, 1, 0, 1}, {128, 7, 160, 1, 1, 1, 0, 1}, {132, 5, 128, 1, 0, 1, 0, 1},
        {128, 4, 136, 1, 2, 1, 0, 1}, {512, 4, 512, 1, 1, 1, 1, 1}, {512, 5, 516, 1, 0, 1, 1, 1},
        {514, 3, 512, 1, 2, 1, 1, 1}, /* (dx's padding 0; C not in fours) */
        {124, 6, 128, 1, 1, 0, 0, 1}, {64, 7, 64, 1, 1, 0, 0, 1}, {60, 6, 64, 1, 1, 0, 0, 0},
        {128, 7, 128, 2, 1, 0, 0, 0}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        for (int add_to_dx = 0; add_to_dx <= 1; add_to_dx++) {
            mgpu_shape xs = mgpu_shape4(3, shapes[i].c, shapes[i].h, shapes[i].h);
            mgpu_shape ws = mgpu_shape4(shapes[i].k, shapes[i].c, 3, 3);
            mgpu_shape ys = mgpu_conv2d_output_shape(xs, ws, shapes[i].stride, shapes[i].pad);
            int stride = shapes[i].stride, pad = shapes[i].pad, before = test__failures;
            conv_results want = conv_by(MGPU__CONV_IM2COL, xs, ws, stride, pad, add_to_dx, add_to_dx);
            mgpu_trace_begin();
            conv_results one = conv_by(MGPU__CONV_RULE, xs, ws, stride, pad, add_to_dx, add_to_dx);
            mgpu_synchronize_all();
            CHECK_EQ_INT(traced("conv2d winograd"), shapes[i].y);
            CHECK_EQ_INT(traced("conv2d_backward winograd dx"), shapes[i].dx);
            CHECK_EQ_INT(traced("conv2d_backward winograd dW"), shapes[i].dw);
            mgpu_trace_end();
            conv_results again = conv_by(MGPU__CONV_RULE, xs, ws, stride, pad, add_to_dx, add_to_dx);
            check_close_floats("y", one.y, want.y, mgpu_shape_numel(ys), 1e-4, 1e-4);
            check_close_floats("dx", one.dx, want.dx, mgpu_shape_numel(xs), 1e-4, 1e-4);
            check_close_floats("dW", one.dw, want.dw, mgpu_shape_numel(ws), 1e-3, 1e-4);
            CHECK(memcmp(one.y, again.y, mgpu_shape_numel(ys) * sizeof(float)) == 0);
            CHECK(memcmp(one.dx, again.dx, mgpu_shape_numel(xs) * sizeof(float)) == 0);
            CHECK(memcmp(one.dw, again.dw, mgpu_shape_numel(ws) * sizeof(float)) == 0);
            /* timed times Winograd beside im2col (and oneDNN) where it fits, and computes what its choice does */
            conv_results timed = conv_by(MGPU__CONV_TIMED, xs, ws, stride, pad, add_to_dx, add_to_dx);
            mgpu__conv_geom g = mgpu__conv_geometry("test", xs, ws, stride, pad);
            for (int pass = MGPU__PASS_Y; pass <= MGPU__PASS_DW; pass++) {
                mgpu__cpu_conv_choice *c = mgpu__cpu_conv_choice_find(mgpu_cpu(), &g, (mgpu__conv_pass)pass);
                CHECK(c != NULL && (c->trial_ms[MGPU__CPU_BY_MGPU_WINOGRAD] < HUGE_VAL) == (stride == 1));
            }
            check_close_floats("timed y", timed.y, want.y, mgpu_shape_numel(ys), 1e-4, 1e-4);
            check_close_floats("timed dx", timed.dx, want.dx, mgpu_shape_numel(xs), 1e-4, 1e-4);
            check_close_floats("timed dW", timed.dw, want.dw, mgpu_shape_numel(ws), 1e-3, 1e-4);
            mgpu_trace_begin(); /* implicit leaves it out */
            conv_results implicit = conv_by(MGPU__CONV_IMPLICIT, xs, ws, stride, pad, add_to_dx, add_to_dx);
            mgpu_synchronize_all();
            CHECK(!traced("conv2d winograd") && !traced("conv2d_backward winograd dx") &&
                  !traced("conv2d_backward winograd dW"));
            mgpu_trace_end();
            free(timed.y), free(timed.dx), free(timed.dw), free(implicit.y), free(implicit.dx), free(implicit.dw);
            mgpu__onednn_avx512 = 1; /* (OpenBLAS's AVX-512 or not) */
            for (int blas_avx512 = 0; blas_avx512 <= 1; blas_avx512++) {
                mgpu__blas_avx512 = blas_avx512;
                mgpu_trace_begin();
                conv_results wide = conv_by(MGPU__CONV_RULE, xs, ws, stride, pad, add_to_dx, add_to_dx);
                mgpu_synchronize_all();
                CHECK(!traced("conv2d winograd") && !traced("conv2d_backward winograd dx") &&
                      !traced("conv2d_backward winograd dW"));
                mgpu_trace_end();
                free(wide.y), free(wide.dx), free(wide.dw);
            }
            mgpu__onednn_avx512 = mgpu__blas_avx512 = 0; /* (back to the table's kind: take_widths(0, 0)) */
            if (test__failures != before)
                fprintf(stderr, "  (%d -> %d, 3x3, %dx%d, stride %d, pad %d, add_to_dx %d)\n", shapes[i].c,
                        shapes[i].k, shapes[i].h, shapes[i].h, stride, pad, add_to_dx);
            conv_results *all[] = {&want, &one, &again};
            for (int k = 0; k < 3; k++) free(all[k]->y), free(all[k]->dx), free(all[k]->dw);
        }
    restore_widths();
    mgpu__conv_mode = saved;
}

/* The widths the rule reads are this machine's: OpenBLAS's from the name
   of its kernels; oneDNN's AVX-512 where the processor has what oneDNN's
   avx512_core kernels need (F, CD, BW, DQ, VL), unless a variable caps
   oneDNN's instruction set, and never without oneDNN. */
TEST(cpu_vector_widths_are_this_machines) {
    mgpu__cpu_vector_widths();
    CHECK_EQ_INT(mgpu__blas_avx512, mgpu__blas_core_avx512(openblas_get_corename()));
#if defined(__x86_64__) && defined(__GNUC__) && defined(__GLIBC__)
    __builtin_cpu_init();
    int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
                 __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                 __builtin_cpu_supports("avx512vl");
    int capped = getenv("ONEDNN_MAX_CPU_ISA") || getenv("DNNL_MAX_CPU_ISA");
    if (!capped) CHECK_EQ_INT(mgpu__onednn_avx512, MGPU_ONEDNN && avx512);
    if (!avx512) CHECK(!mgpu__onednn_avx512 && !mgpu__blas_avx512);
#endif
}

/* How many operations of this name the tracer saw since it began. */
static int traced_count(const char *name) {
    int calls = 0;
    for (int i = 0; i < mgpu__library.trace_n; i++)
        calls += mgpu__library.trace[i].name && strcmp(mgpu__library.trace[i].name, name) == 0;
    return calls;
}

#if MGPU_ONEDNN

/* Whether oneDNN's method has a kernel for each pass of a layer of geometry g. */
static int onednn_has(const mgpu__conv_geom *g, mgpu__onednn_method method) {
    for (int pass = MGPU__PASS_Y; pass <= MGPU__PASS_DW; pass++)
        if (!mgpu__onednn_plan_for(g, (mgpu__conv_pass)pass, method, 0, 0, 1)) return 0;
    return 1;
}

/* oneDNN's convolutions against im2col's, at ResNet-18's shapes (batch 2)
   and LeNet's, written and added to (dW, then dx): its direct kernels
   (MGPU_CONV=implicit); MGPU_CONV=timed's, whose first call of a shape is
   the trial, into scratch, then the call itself: it must add once; its
   direct kernels on channels-last activations, which compute every
   shape; and its Winograd kernels, which compute the 3x3 layers at
   stride 1 where oneDNN runs AVX-512 and nothing else. (Winograd's
   transforms round more than direct sums, but at these shapes stay
   within the same tolerances.) */
TEST(conv2d_by_onednn_matches_im2col) {
    struct { int c, h, k, r, stride, pad; } shapes[] = {
        {64, 28, 64, 3, 1, 1}, {64, 28, 128, 3, 2, 1}, {64, 28, 128, 1, 2, 0}, {128, 14, 128, 3, 1, 1},
        {256, 7, 512, 3, 2, 1}, {512, 4, 512, 3, 1, 1}, {1, 28, 64, 3, 1, 1}, /* ResNet-18 */
        {1, 28, 6, 5, 1, 2}, {6, 14, 16, 5, 1, 0}};                            /* LeNet */
    mgpu__conv_settings_from_environment(); /* (before the test sets the mode) */
    mgpu__conv_mode_kind saved = mgpu__conv_mode;
    mgpu__cpu_vector_widths();
    const int adds[3][2] = {{1, 0}, {0, 1}, {0, 0}}; /* accumulate (dW), add_to_dx */
    enum { BY_DIRECT, BY_TIMED, BY_WINOGRAD, BY_CHANNELS_LAST, BYS };
    const char *by_names[BYS] = {"oneDNN", "timed", "oneDNN Winograd", "oneDNN channels-last"};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        for (int t = 0; t < 3 * BYS; t++) {
            int accumulate = adds[t % 3][0], add_to_dx = adds[t % 3][1], by = t / 3;
            mgpu_shape xs = mgpu_shape4(2, shapes[i].c, shapes[i].h, shapes[i].h);
            mgpu_shape ws = mgpu_shape4(shapes[i].k, shapes[i].c, shapes[i].r, shapes[i].r);
            int stride = shapes[i].stride, pad = shapes[i].pad;
            mgpu__conv_geom g = mgpu__conv_geometry("test", xs, ws, stride, pad);
            if (by == BY_WINOGRAD) {
                int winograd = onednn_has(&g, MGPU__ONEDNN_WINOGRAD);
                CHECK_EQ_INT(winograd, mgpu__onednn_avx512 && shapes[i].r == 3 && stride == 1);
                if (!winograd) continue;
            }
            if (by == BY_CHANNELS_LAST) CHECK(onednn_has(&g, MGPU__ONEDNN_CHANNELS_LAST));
            conv_results want = conv_by(MGPU__CONV_IM2COL, xs, ws, stride, pad, accumulate, add_to_dx);
            mgpu_trace_begin();
            conv_results got =
                by == BY_WINOGRAD        ? conv_by_way(MGPU__CPU_BY_ONEDNN_WINOGRAD, xs, ws, stride, pad, accumulate, add_to_dx)
                : by == BY_CHANNELS_LAST ? conv_by_way(MGPU__CPU_BY_ONEDNN_CHANNELS_LAST, xs, ws, stride, pad, accumulate,
                                                       add_to_dx)
                                         : conv_by(by == BY_DIRECT ? MGPU__CONV_IMPLICIT : MGPU__CONV_TIMED, xs, ws,
                                                   stride, pad, accumulate, add_to_dx);
            mgpu_synchronize_all();
            CHECK(by != BY_DIRECT || (traced("conv2d oneDNN forward") && traced("conv2d_backward oneDNN dx") &&
                                      traced("conv2d_backward oneDNN dW")));
            CHECK(by != BY_WINOGRAD ||
                  (traced("conv2d oneDNN Winograd forward") && traced("conv2d_backward oneDNN Winograd dx") &&
                   traced("conv2d_backward oneDNN Winograd dW")));
            CHECK(by != BY_CHANNELS_LAST || (traced("conv2d oneDNN channels-last forward") &&
                                             traced("conv2d_backward oneDNN channels-last dx") &&
                                             traced("conv2d_backward oneDNN channels-last dW")));
            mgpu_trace_end();
            mgpu_shape ys = mgpu_conv2d_output_shape(xs, ws, shapes[i].stride, shapes[i].pad);
            int before = test__failures;
            check_close_floats("y", got.y, want.y, mgpu_shape_numel(ys), 1e-4, 1e-4);
            check_close_floats("dx", got.dx, want.dx, mgpu_shape_numel(xs), 1e-4, 1e-4);
            check_close_floats("dW", got.dw, want.dw, mgpu_shape_numel(ws), 1e-3, 1e-4);
            if (test__failures != before)
                fprintf(stderr, "  (%d -> %d, %dx%d, stride %d, accumulate %d, add_to_dx %d, %s)\n", shapes[i].c,
                        shapes[i].k, shapes[i].r, shapes[i].r, stride, accumulate, add_to_dx, by_names[by]);
            free(want.y), free(want.dx), free(want.dw), free(got.y), free(got.dx), free(got.dw);
        }
    mgpu__conv_mode = saved;
}

/* By default (MGPU_CONV=rule) a CPU device computes each pass by a way
   of its own, in this order: oneDNN's Winograd kernels for 3x3 layers at
   stride 1 from 32 channels and filters whose outputs, of more than one
   4 x 4 tile, fill three quarters of their tiles, where oneDNN runs
   AVX-512 (and has them: the machine's own oneDNN, whatever widths the
   test takes); im2col for the backward passes of 1x1 windows at a stride
   and of outputs of 4 x 4 pixels or fewer, unless oneDNN's vectors are
   wider than OpenBLAS's (AVX-512 against AVX2); oneDNN's direct kernels
   on channels-last activations where oneDNN runs AVX-512 and the
   channels (more than one) or filters are not a multiple of 16; its
   direct kernels on its blocked layouts. Each pass is that way's, bit
   for bit, and traced under its name; nothing is timed. (The shapes are
   too small for mgpu's own Winograd.) */
static int same_floats(const float *a, const float *b, size_t n) { return memcmp(a, b, n * sizeof(float)) == 0; }
TEST(cpu_convolutions_by_rule) {
    mgpu__conv_settings_from_environment(); /* (before the test sets the mode) */
    mgpu__conv_mode_kind saved = mgpu__conv_mode;
    struct { int c, h, k, r, stride, pad, backward_by_im2col, by_winograd, channels_last; } shapes[] = {
        {32, 8, 32, 3, 1, 1, 0, 1, 0}, {32, 7, 32, 3, 1, 1, 0, 1, 0}, /* (7 x 7: 49 of 64 pixels in its tiles) */
        {32, 6, 32, 3, 1, 1, 0, 0, 0}, {16, 8, 32, 3, 1, 1, 0, 0, 0}, {32, 8, 16, 3, 1, 1, 0, 0, 0},
        {16, 9, 32, 1, 2, 0, 1, 0, 0}, {32, 4, 32, 3, 1, 1, 1, 0, 0}, {32, 3, 32, 3, 1, 1, 1, 0, 0},
        {6, 14, 16, 5, 1, 0, 0, 0, 1}, {20, 13, 50, 5, 1, 0, 0, 0, 1}, {24, 8, 32, 3, 1, 1, 0, 0, 1},
        {32, 6, 40, 3, 1, 1, 0, 0, 1}, {20, 4, 32, 3, 1, 1, 1, 0, 1}, /* (forward channels-last, backward im2col) */
        {1, 12, 20, 3, 1, 0, 0, 0, 0}}; /* (one channel: blocked) */
    /* oneDNN's AVX-512, OpenBLAS's, and whether those shapes' backward passes keep im2col */
    const int widths[4][3] = {{0, 0, 1}, {0, 1, 1}, {1, 1, 1}, {1, 0, 0}};
    enum { IM2COL, DIRECT, WINOGRAD, CHANNELS_LAST, WAYS };
    const char *traced_as[3][WAYS] = { /* each pass by each way, as the tracer names it */
        {"conv2d im2col", "conv2d oneDNN forward", "conv2d oneDNN Winograd forward",
         "conv2d oneDNN channels-last forward"},
        {"conv2d_backward dcol product", "conv2d_backward oneDNN dx", "conv2d_backward oneDNN Winograd dx",
         "conv2d_backward oneDNN channels-last dx"},
        {"conv2d_backward dW product", "conv2d_backward oneDNN dW", "conv2d_backward oneDNN Winograd dW",
         "conv2d_backward oneDNN channels-last dW"}};
    for (size_t t = 0; t < 4 * sizeof shapes / sizeof shapes[0]; t++) {
        size_t i = t / 4;
        const int *kind = widths[t % 4];
        take_widths(kind[0], kind[1]);
        int winograd = kind[0] && saved_widths[0], way[3]; /* the way of y, dx and dW */
        for (int pass = 0; pass < 3; pass++) {
            int by_winograd = winograd && shapes[i].by_winograd;
            int by_im2col = pass > 0 && shapes[i].backward_by_im2col && kind[2];
            way[pass] = by_winograd ? WINOGRAD : by_im2col ? IM2COL : shapes[i].channels_last && kind[0] ? CHANNELS_LAST
                                                                                                        : DIRECT;
        }
        mgpu_shape xs = mgpu_shape4(2, shapes[i].c, shapes[i].h, shapes[i].h);
        mgpu_shape ws = mgpu_shape4(shapes[i].k, shapes[i].c, shapes[i].r, shapes[i].r);
        mgpu_shape ys = mgpu_conv2d_output_shape(xs, ws, shapes[i].stride, shapes[i].pad);
        int stride = shapes[i].stride, pad = shapes[i].pad;
        int trials = mgpu__cpu_conv_choice_count, before = test__failures;
        mgpu_trace_begin();
        conv_results rule = conv_by(MGPU__CONV_RULE, xs, ws, stride, pad, 1, 0);
        mgpu_synchronize_all();
        for (int pass = 0; pass < 3; pass++)
            for (int w = 0; w < WAYS; w++)
                CHECK_EQ_INT(traced_count(traced_as[pass][w]) > 0, way[pass] == w);
        /* both gradients by im2col: in one call, which turns dy into its layout once */
        CHECK_EQ_INT(traced_count("conv2d_backward layout"), way[1] == IM2COL || way[2] == IM2COL);
        mgpu_trace_end();
        CHECK_EQ_INT(mgpu__cpu_conv_choice_count, trials); /* (nothing timed) */
        restore_widths();
        conv_results by[WAYS] = {conv_by(MGPU__CONV_IM2COL, xs, ws, stride, pad, 1, 0),
                                 conv_by(MGPU__CONV_IMPLICIT, xs, ws, stride, pad, 1, 0),
                                 {NULL, NULL, NULL},
                                 conv_by_way(MGPU__CPU_BY_ONEDNN_CHANNELS_LAST, xs, ws, stride, pad, 1, 0)};
        if (shapes[i].by_winograd && winograd)
            by[WINOGRAD] = conv_by_way(MGPU__CPU_BY_ONEDNN_WINOGRAD, xs, ws, stride, pad, 1, 0);
        CHECK(same_floats(rule.y, by[way[0]].y, mgpu_shape_numel(ys)));
        CHECK(same_floats(rule.dx, by[way[1]].dx, mgpu_shape_numel(xs)));
        CHECK(same_floats(rule.dw, by[way[2]].dw, mgpu_shape_numel(ws)));
        /* (the ways taken differ from oneDNN's blocked direct kernels in some last bits, or the checks above
           could not tell them apart) */
        CHECK(!same_floats(by[IM2COL].dw, by[DIRECT].dw, mgpu_shape_numel(ws)));
        if (way[2] == WINOGRAD) CHECK(!same_floats(by[WINOGRAD].dw, by[DIRECT].dw, mgpu_shape_numel(ws)));
        if (way[0] == CHANNELS_LAST)
            CHECK(!same_floats(by[CHANNELS_LAST].y, by[DIRECT].y, mgpu_shape_numel(ys)) ||
                  !same_floats(by[CHANNELS_LAST].dx, by[DIRECT].dx, mgpu_shape_numel(xs)) ||
                  !same_floats(by[CHANNELS_LAST].dw, by[DIRECT].dw, mgpu_shape_numel(ws)));
        if (test__failures != before)
            fprintf(stderr, "  (%d -> %d, %dx%d, %dx%d, stride %d; oneDNN's AVX-512 %d, OpenBLAS's %d)\n", shapes[i].c,
                    shapes[i].k, shapes[i].h, shapes[i].h, shapes[i].r, shapes[i].r, stride, kind[0], kind[1]);
        free(rule.y), free(rule.dx), free(rule.dw);
        for (int k = 0; k < WAYS; k++) free(by[k].y), free(by[k].dx), free(by[k].dw);
    }
    mgpu__conv_mode = saved;
}

#endif

/* With MGPU_CONV=timed a CPU device times each way (im2col, for this
   3x3 layer mgpu's Winograd, and where the library has oneDNN its direct
   kernels on its blocked layouts and on channels-last activations and,
   where oneDNN runs AVX-512, its Winograd) at the first call of each
   pass and shape, and the later calls take the fastest. The first
   call's outputs are the fastest way's, bit for bit: where the call writes them (the forward
   pass), im2col's from the trial itself or another's copied from its own
   scratch ("conv2d trial's copy"); where it adds to them (dW
   accumulated), from the fastest way run once more after the trial. */
static int same_bits(const mgpu_tensor *a, const float *b) {
    float *got = (float *)malloc(a->numel * sizeof(float));
    mgpu_to_host(a, got);
    int same = memcmp(got, b, a->numel * sizeof(float)) == 0;
    free(got);
    return same;
}
TEST(cpu_convolutions_keep_the_faster_way) {
    mgpu__conv_settings_from_environment(); /* (before the test sets the mode) */
    mgpu__conv_mode_kind saved = mgpu__conv_mode;
    mgpu__conv_mode = MGPU__CONV_TIMED;
    mgpu__cpu_vector_widths();
    mgpu_device *cpu = mgpu_cpu();
    mgpu_tensor *x = mgpu_randn(cpu, mgpu_shape4(2, 32, 9, 9), 0.0f, 1.0f);
    mgpu_tensor *w = mgpu_randn(cpu, mgpu_shape4(16, 32, 3, 3), 0.0f, 0.1f);
    mgpu_tensor *y = mgpu_empty(cpu, mgpu_shape4(2, 16, 9, 9));
    mgpu_tensor *dy = mgpu_randn(cpu, y->shape, 0.0f, 1.0f), *dw = mgpu_empty(cpu, w->shape);
    float *dw_before = (float *)malloc(w->numel * sizeof(float));
    mgpu_to_host(w, dw_before); /* (what dW is accumulated onto) */
    float *first_y = (float *)malloc(y->numel * sizeof(float)), *first_dw = (float *)malloc(w->numel * sizeof(float));
    mgpu__conv_geom g = mgpu__conv_geometry("test", x->shape, w->shape, 1, 1);
    CHECK(mgpu__cpu_conv_choice_find(cpu, &g, MGPU__PASS_Y) == NULL &&
          mgpu__cpu_conv_choice_find(cpu, &g, MGPU__PASS_DW) == NULL);
    int computes[MGPU__CPU_WAYS]; /* all ways, oneDNN's where the library has it, its Winograd where it runs AVX-512 */
    for (int way = 0; way < MGPU__CPU_WAYS; way++)
        computes[way] = way < MGPU__CPU_BY_ONEDNN_DIRECT ||
                        (MGPU_ONEDNN && (way != MGPU__CPU_BY_ONEDNN_WINOGRAD || mgpu__onednn_avx512));
    for (int call = 0; call < 2; call++) {
        mgpu_synchronize_all();
        mgpu_trace_begin();
        mgpu_fill(y, NAN);
        mgpu_conv2d_forward(y, x, w, NULL, 1, 1);
        mgpu_copy(dw, w, 0);
        mgpu_conv2d_backward(NULL, dw, NULL, dy, x, w, 1, 1, 1);
        mgpu_synchronize_all();
        int chosen[2]; /* the forward pass's way, dW's */
        for (int backward = 0; backward <= 1; backward++) {
            mgpu__cpu_conv_choice *c = mgpu__cpu_conv_choice_find(cpu, &g, backward ? MGPU__PASS_DW : MGPU__PASS_Y);
            CHECK(c != NULL);
            int fastest = 0;
            for (int way = 0; way < MGPU__CPU_WAYS; way++) {
                CHECK(c->trial_ms[way] > 0.0 && (c->trial_ms[way] < HUGE_VAL) == computes[way]);
                if (c->trial_ms[way] < c->trial_ms[fastest]) fastest = way;
            }
            CHECK_EQ_INT(c->way, fastest);
            chosen[backward] = c->way;
        }
        int first = call == 0;
        const char *forward[MGPU__CPU_WAYS] = {"conv2d im2col", "conv2d winograd", "conv2d oneDNN forward",
                                               "conv2d oneDNN channels-last forward", "conv2d oneDNN Winograd forward"};
        const char *dw_by[MGPU__CPU_WAYS] = {"conv2d_backward dW product", "conv2d_backward winograd dW",
                                             "conv2d_backward oneDNN dW", "conv2d_backward oneDNN channels-last dW",
                                             "conv2d_backward oneDNN Winograd dW"};
        for (int way = 0; way < MGPU__CPU_WAYS; way++) {
            int tried = first && computes[way];
            /* forward: the trial's ways, then nothing more (first call); the chosen way alone (later) */
            CHECK_EQ_INT(traced_count(forward[way]), first ? tried : chosen[0] == way);
            /* dW accumulated: the trial's ways, then the chosen one */
            CHECK_EQ_INT(traced_count(dw_by[way]), tried + (chosen[1] == way));
        }
        CHECK_EQ_INT(traced_count("conv2d trial's copy"), first && chosen[0] != MGPU__CPU_BY_IM2COL);
        mgpu_trace_end();
        if (first) {
            mgpu_to_host(y, first_y);
            mgpu_to_host(dw, first_dw);
        } else {
            CHECK(same_bits(y, first_y));
            CHECK(same_bits(dw, first_dw));
        }
    }
    CHECK(!same_bits(dw, dw_before)); /* (it did add) */
    mgpu_free(x), mgpu_free(w), mgpu_free(y), mgpu_free(dy), mgpu_free(dw);
    free(dw_before), free(first_y), free(first_dw);
    mgpu__conv_mode = saved;
}

#if MGPU_ONEDNN
/* A failed oneDNN call stops the program with one line: where, the call,
   and the status's name. */
TEST(onednn_errors_are_one_line) {
    dnnl_memory_desc_t md;
    dnnl_dims_t dims = {-1};
    EXPECT_DIES(MGPU_ONEDNN_CHECK(dnnl_memory_desc_init_by_tag(&md, 1, dims, dnnl_f32, dnnl_a)),
                "oneDNN: dnnl_memory_desc_init_by_tag(&md, 1, dims, dnnl_f32, dnnl_a) failed: invalid_arguments\n");
    /* in a network's pass, naming the layer */
    EXPECT_DIES(mgpu__layer_enqueuing = "conv3";
                MGPU_ONEDNN_CHECK(dnnl_memory_desc_init_by_tag(&md, 1, dims, dnnl_f32, dnnl_a)),
                "failed: invalid_arguments, in layer conv3\n");
}
#endif

/* A first layer's weight gradient (C*R*S <= 9, dx not asked for) on a
   CPU device takes conv_few_inputs.h's CPU kernel in every MGPU_CONV mode
   but im2col: within float rounding of im2col's, written and added to, on
   LeNet's and ResNet-18's first layers and on shapes with a stride,
   padding, several channels and rows wider than a vector's lanes; the same
   bits on 1 and 3 threads; and a pass that wants dx goes the other ways. */
static float *first_layer_dw(mgpu__conv_mode_kind mode, int threads, mgpu_shape xs, mgpu_shape ws, int stride,
                             int pad, int accumulate, int with_dx, int *by_few_inputs) {
    mgpu_device *cpu = mgpu_cpu();
    int saved = mgpu__cpu_threads;
    mgpu__conv_mode = mode;
    mgpu__cpu_threads = threads;
    mgpu_manual_seed(5);
    mgpu_tensor *x = mgpu_randn(cpu, xs, 0.0f, 1.0f), *w = mgpu_randn(cpu, ws, 0.0f, 0.1f);
    mgpu_tensor *dy = mgpu_randn(cpu, mgpu_conv2d_output_shape(xs, ws, stride, pad), 0.0f, 1.0f);
    mgpu_tensor *dw = mgpu_randn(cpu, ws, 0.0f, 1.0f), *dx = with_dx ? mgpu_empty(cpu, xs) : NULL;
    mgpu_trace_begin();
    mgpu_conv2d_backward(dx, dw, NULL, dy, x, w, stride, pad, accumulate);
    mgpu_trace_end();
    *by_few_inputs = traced("conv2d_backward few inputs dW");
    float *got = to_host(dw);
    mgpu_free(x), mgpu_free(w), mgpu_free(dy), mgpu_free(dw), mgpu_free(dx);
    mgpu__cpu_threads = saved;
    return got;
}
TEST(cpu_first_layer_weight_gradient_by_few_inputs) {
    mgpu__conv_settings_from_environment(); /* (before the test sets the mode) */
    mgpu__conv_mode_kind saved = mgpu__conv_mode;
    struct { int n, c, h, k, r, stride, pad; } shapes[] = {
        {8, 1, 28, 20, 3, 1, 0}, {4, 1, 28, 64, 3, 1, 1}, /* LeNet's (the book's) and ResNet-18's first layers */
        {8, 1, 11, 5, 3, 2, 1}, {8, 3, 9, 7, 1, 1, 0}, {8, 1, 40, 6, 2, 1, 1}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        for (int accumulate = 0; accumulate <= 1; accumulate++) {
            mgpu_shape xs = mgpu_shape4(shapes[i].n, shapes[i].c, shapes[i].h, shapes[i].h);
            mgpu_shape ws = mgpu_shape4(shapes[i].k, shapes[i].c, shapes[i].r, shapes[i].r);
            int stride = shapes[i].stride, pad = shapes[i].pad, few[4];
            size_t n = mgpu_shape_numel(ws);
            float *want = first_layer_dw(MGPU__CONV_IM2COL, 1, xs, ws, stride, pad, accumulate, 0, &few[0]);
            float *one = first_layer_dw(MGPU__CONV_RULE, 1, xs, ws, stride, pad, accumulate, 0, &few[1]);
            float *three = first_layer_dw(MGPU__CONV_RULE, 3, xs, ws, stride, pad, accumulate, 0, &few[2]);
            float *with_dx = first_layer_dw(MGPU__CONV_RULE, 1, xs, ws, stride, pad, accumulate, 1, &few[3]);
            int before = test__failures;
            CHECK(!few[0] && few[1] && few[2] && !few[3]);
            check_close_floats("dW", one, want, n, 1e-3, 1e-4);
            CHECK(memcmp(one, three, n * sizeof(float)) == 0);
            if (test__failures != before)
                fprintf(stderr, "  (%d x %d -> %d, %dx%d, stride %d, pad %d, accumulate %d)\n", shapes[i].n,
                        shapes[i].c, shapes[i].k, shapes[i].r, shapes[i].r, stride, pad, accumulate);
            free(want), free(one), free(three), free(with_dx);
        }
    mgpu__conv_mode = saved;
}

/* The backward plan's choice of ways (mgpu__conv_backward_ways), on times
   made up so that each answer is known: the channels-last kernels' one
   shared copy of dy decides between them and the others, and costs
   nothing only where the caller prepares it and both read dy only
   through it. Ways: a kernel on the NCHW tensors, channels-last, im2col
   half. */
TEST(conv_backward_ways_count_the_copy_of_dy_once) {
    const double dx_ms[3] = {12, 10, 13}, dw_ms[3] = {14, 10, 11};
    int by_dx, by_dw;
    /* channels-last both: 10 + 10 + one copy of 5 = 25, not 30; beside
       an NCHW dx and im2col's dW half: 12 + 11 = 23 */
    CHECK(mgpu__conv_backward_ways(dx_ms, dw_ms, 5, 0, 1, &by_dx, &by_dw) == 23);
    CHECK(by_dx == MGPU__BY_NCHW && by_dw == MGPU__BY_IM2COL_HALF);
    /* with the copy prepared: 20 */
    CHECK(mgpu__conv_backward_ways(dx_ms, dw_ms, 5, 1, 1, &by_dx, &by_dw) == 20);
    CHECK(by_dx == MGPU__BY_CHANNELS_LAST && by_dw == MGPU__BY_CHANNELS_LAST);
    /* a copy of 1.5: channels-last both (21.5) beats dx alone that way (10 + 1.5 + 11 = 22.5) */
    CHECK(mgpu__conv_backward_ways(dx_ms, dw_ms, 1.5, 0, 1, &by_dx, &by_dw) == 21.5);
    CHECK(by_dx == MGPU__BY_CHANNELS_LAST && by_dw == MGPU__BY_CHANNELS_LAST);
    /* prepared, but dx's channels-last kernel far slower: dW alone by
       channels-last reads dy_t beside dx's plain dy, so it pays for the
       copy (21.5), and im2col's half wins (21) */
    const double slow_dx[3] = {10, 20, 30};
    CHECK(mgpu__conv_backward_ways(slow_dx, dw_ms, 1.5, 1, 1, &by_dx, &by_dw) == 21);
    CHECK(by_dx == MGPU__BY_NCHW && by_dw == MGPU__BY_IM2COL_HALF);
    /* without dx: dW alone, by channels-last with the copy (15) or prepared (10) */
    CHECK(mgpu__conv_backward_ways(NULL, dw_ms, 5, 0, 0, &by_dx, &by_dw) == 11);
    CHECK(by_dw == MGPU__BY_IM2COL_HALF);
    CHECK(mgpu__conv_backward_ways(NULL, dw_ms, 5, 1, 0, &by_dx, &by_dw) == 10);
    CHECK(by_dw == MGPU__BY_CHANNELS_LAST);
}

TEST(avg_pool2d_forward_and_gradients) {
    layer_case cases[] = {
        pool_case("2x2 even", mgpu_shape4(2, 3, 8, 6), 2),
        pool_case("2x2 of 9x9 rounds down", mgpu_shape4(1, 2, 9, 9), 2),
        pool_case("3x3 of 9x7", mgpu_shape4(2, 1, 9, 7), 3),
        pool_case("4x4 whole map", mgpu_shape4(1, 2, 4, 4), 4),
        pool_case("1x1 identity", mgpu_shape4(1, 2, 3, 2), 1),
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_case(&cases[i]);
    CHECK(mgpu_shape_equal(mgpu_avg_pool2d_output_shape(mgpu_shape4(256, 50, 9, 9), 2),
                           mgpu_shape4(256, 50, 4, 4)));
}

TEST(global_avg_pool_forward_and_gradients) {
    layer_case cases[] = {
        gpool_case("4x5", mgpu_shape4(2, 3, 4, 5)),
        gpool_case("1x1", mgpu_shape4(3, 2, 1, 1)),
        gpool_case("7x7", mgpu_shape4(2, 4, 7, 7)),
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_case(&cases[i]);
}

TEST(relu_forward_and_gradients) {
    layer_case by_input = relu_case("relu, mask from x", mgpu_shape4(2, 3, 4, 5), 0);
    layer_case by_output = relu_case("relu, mask from y", mgpu_shape2(7, 9), 1);
    check_case(&by_input);
    check_case(&by_output);
}

TEST(relu_in_place) {
    float v[6] = {-2, -0.5f, 0, 0.25f, 3, -1e-3f}, want[6] = {0, 0, 0, 0.25f, 3, 0};
    mgpu_tensor *t = tensor_of(mgpu_shape2(2, 3), v);
    mgpu_relu_forward(t, t);
    float got[6];
    mgpu_to_host(t, got);
    for (int i = 0; i < 6; i++) CHECK(got[i] == want[i]);
    /* backward in place: dx = dy; at exactly 0 the gradient is 0, like PyTorch */
    float g[6] = {1, 2, 3, 4, 5, 6}, gwant[6] = {0, 0, 0, 4, 5, 0};
    mgpu_tensor *d = tensor_of(mgpu_shape2(2, 3), g);
    mgpu_relu_backward(d, d, t);
    mgpu_to_host(d, got);
    for (int i = 0; i < 6; i++) CHECK(got[i] == gwant[i]);
    mgpu_free(t);
    mgpu_free(d);
}

TEST(add_forward_and_gradients) {
    layer_case c = add_case("add", mgpu_shape3(2, 3, 4));
    check_case(&c);
    /* in place: a += b */
    float a[3] = {1, 2, 3}, b[3] = {10, 20, 30}, got[3];
    mgpu_tensor *ta = tensor_of(mgpu_shape1(3), a), *tb = tensor_of(mgpu_shape1(3), b);
    mgpu_add(ta, ta, tb);
    mgpu_to_host(ta, got);
    CHECK(got[0] == 11 && got[1] == 22 && got[2] == 33);
    mgpu_free(ta);
    mgpu_free(tb);
}

TEST(add_relu_is_relu_of_the_sum) {
    float a[6] = {1, -2, 3, -4, 0.5f, -0.25f}, b[6] = {-3, 1, 1, 5, -0.5f, 0.125f};
    float got[6], want[6];
    mgpu_tensor *ta = tensor_of(mgpu_shape2(2, 3), a), *tb = tensor_of(mgpu_shape2(2, 3), b);
    mgpu_tensor *y = mgpu_empty(mgpu_cpu(), mgpu_shape2(2, 3));
    mgpu_add_relu(y, ta, tb);
    mgpu_to_host(y, got);
    for (int i = 0; i < 6; i++) want[i] = a[i] + b[i] > 0 ? a[i] + b[i] : 0;
    for (int i = 0; i < 6; i++) CHECK(got[i] == want[i]);
    mgpu_add_relu(ta, ta, tb); /* in place */
    mgpu_to_host(ta, got);
    for (int i = 0; i < 6; i++) CHECK(got[i] == want[i]);
    EXPECT_DIES(mgpu_add_relu(y, ta, mgpu_view(tb, mgpu_shape1(6))), "mgpu_add_relu: shapes");
    mgpu_free(ta);
    mgpu_free(tb);
    mgpu_free(y);
}

TEST(linear_forward_and_gradients) {
    layer_case cases[] = {
        linear_case("linear 4x7 -> 3", mgpu_shape2(4, 7), 3, 1),
        linear_case("linear, one row, no bias", mgpu_shape2(1, 5), 2, 0),
        linear_case("linear of an image batch", mgpu_shape4(3, 2, 2, 2), 4, 1),
        linear_case("linear 20x30 -> 10", mgpu_shape2(20, 30), 10, 1),
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_case(&cases[i]);
}

/* The LeNet's shapes, end to end: 28x28 -> conv 3x3 -> 26 -> pool -> 13
   -> conv 5x5 -> 9 -> pool -> 4 (rounded down) -> 50*4*4 = 800 features. */
TEST(lenet_shapes) {
    mgpu_shape h1 =
        mgpu_conv2d_output_shape(mgpu_shape4(256, 1, 28, 28), mgpu_shape4(20, 1, 3, 3), 1, 0);
    mgpu_shape p1 = mgpu_avg_pool2d_output_shape(h1, 2);
    mgpu_shape h2 = mgpu_conv2d_output_shape(p1, mgpu_shape4(50, 20, 5, 5), 1, 0);
    mgpu_shape p2 = mgpu_avg_pool2d_output_shape(h2, 2);
    CHECK(mgpu_shape_equal(h1, mgpu_shape4(256, 20, 26, 26)));
    CHECK(mgpu_shape_equal(p1, mgpu_shape4(256, 20, 13, 13)));
    CHECK(mgpu_shape_equal(h2, mgpu_shape4(256, 50, 9, 9)));
    CHECK(mgpu_shape_equal(p2, mgpu_shape4(256, 50, 4, 4)));
    /* ResNet's strided 3x3 and 1x1 shortcut give the same size */
    mgpu_shape x = mgpu_shape4(2, 64, 28, 28);
    CHECK(mgpu_shape_equal(mgpu_conv2d_output_shape(x, mgpu_shape4(128, 64, 3, 3), 2, 1),
                           mgpu_conv2d_output_shape(x, mgpu_shape4(128, 64, 1, 1), 2, 0)));
}

/* A network's layer hook (mgpu_net_set_layer_hook) is called around
   each layer's passes in the order they run: forward 0, 1, 2; backward
   2, 1, 0; and with each layer a run of its own (mgpu_net_recompute), the
   recomputed forward pass of runs 0 and 1 inside their layer's backward
   pass, after MGPU_BEFORE_BACKWARD. What the hook allocates counts with
   the parameters: a tensor of 1000 floats made in layer 1's before-
   forward call and freed after it. */
static struct {
    char calls[64][8];
    int n;
    mgpu_net *net;
    mgpu_tensor *made;
} hooked;
static void record_hook(void *ctx, mgpu_net *net, int layer, int when) {
    static const char *const said[] = {"F<", "F>", "B<", "B>"};
    CHECK(ctx == &hooked && net == hooked.net);
    if (hooked.n < 64) snprintf(hooked.calls[hooked.n++], 8, "%s%d", said[when], layer);
    if (layer == 1 && when == MGPU_BEFORE_FORWARD) hooked.made = mgpu_zeros(net->device, mgpu_shape1(1000));
    if (layer == 1 && when == MGPU_AFTER_FORWARD) mgpu_free(hooked.made), hooked.made = NULL;
}
static void expect_hooked(const char *want) {
    char got[512] = "";
    for (int i = 0; i < hooked.n; i++) snprintf(got + strlen(got), sizeof got - strlen(got), "%s%s", i ? " " : "",
                                                hooked.calls[i]);
    if (strcmp(got, want) != 0) printf("  hook calls: %s\n  want:       %s\n", got, want);
    CHECK(strcmp(got, want) == 0);
    hooked.n = 0;
}
TEST(layer_hook_is_called_around_each_pass) {
    mgpu_device *dev = mgpu_cpu();
    mgpu_net *net = hooked.net = mgpu_net_new(dev);
    mgpu_net_add_linear(net, 4, 8);
    mgpu_net_add_relu(net);
    mgpu_net_add_linear(net, 8, 3);
    mgpu_tensor *x = mgpu_randn(dev, mgpu_shape2(5, 4), 0.0f, 1.0f), *y = mgpu_zeros(dev, mgpu_shape1(5));
    mgpu_net_set_layer_hook(net, record_hook, &hooked);
    for (int runs = 1; runs <= 3; runs += 2) {
        mgpu_net_recompute(net, runs);
        mgpu_synchronize_all();
        size_t before = mgpu_device_memory_of(dev, MGPU_MEMORY_PARAMETERS);
        mgpu_device_reset_peak(dev);
        mgpu_tensor *logits = mgpu_net_forward(net, x);
        mgpu_synchronize_all();
        CHECK(mgpu_device_memory_peak_of(dev, MGPU_MEMORY_PARAMETERS) >= before + 1000 * sizeof(float));
        expect_hooked("F<0 F>0 F<1 F>1 F<2 F>2");
        mgpu_net_loss_backward(net, logits, y, 1.0f / 5, NULL);
        expect_hooked(runs == 1 ? "B<2 B>2 B<1 B>1 B<0 B>0" : "B<2 B>2 B<1 F<1 F>1 B>1 B<0 F<0 F>0 B>0");
    }
    mgpu_net_set_layer_hook(net, NULL, NULL); /* (none: nothing called) */
    mgpu_net_forward(net, x);
    expect_hooked("");
    mgpu_free(x), mgpu_free(y);
    mgpu_net_free(net);
}

/* ----------------------------------------------------------- bad calls */
/* A batch norm's running statistics move `momentum` of the way to the
   batch's at each training pass: 0.1 by default, and what
   mgpu_net_set_batchnorm_momentum sets. A constant channel of 2 (variance
   0): mean 0 -> 0.2 -> 0.38 at 0.1, 0 -> 1.0 at 0.5; the variance from 1
   towards 0 alike. */
TEST(batchnorm_momentum) {
    for (int round = 0; round < 2; round++) {
        mgpu_net *net = mgpu_net_new(mgpu_cpu());
        mgpu_layer *bn = mgpu_net_add_batchnorm(net, 1);
        if (round == 1) mgpu_net_set_batchnorm_momentum(net, 0.5f);
        mgpu_net_set_training(net, 1);
        mgpu_tensor *x = mgpu_full(mgpu_cpu(), mgpu_shape4(4, 1, 2, 2), 2.0f);
        float mean, var;
        mgpu_net_forward(net, x);
        mgpu_to_host(bn->running_mean, &mean);
        mgpu_to_host(bn->running_var, &var);
        CHECK_CLOSE(mean, round ? 1.0 : 0.2, 1e-6, 0);
        CHECK_CLOSE(var, round ? 0.5 : 0.9, 1e-6, 0);
        mgpu_net_forward(net, x);
        mgpu_to_host(bn->running_mean, &mean);
        CHECK_CLOSE(mean, round ? 1.5 : 0.38, 1e-6, 0);
        mgpu_free(x);
        mgpu_net_free(net);
    }
    mgpu_net *net = mgpu_net_new(mgpu_cpu());
    EXPECT_DIES(mgpu_net_set_batchnorm_momentum(net, 1.5f),
                "mgpu_net_set_batchnorm_momentum: want a network and a momentum from 0 to 1, got 1.5");
    mgpu_net_free(net);
}

TEST(errors_name_the_shapes) {
    mgpu_device *cpu = mgpu_cpu();
    mgpu_tensor *x = mgpu_zeros(cpu, mgpu_shape4(2, 3, 8, 8));
    mgpu_tensor *w = mgpu_zeros(cpu, mgpu_shape4(4, 3, 3, 3));
    mgpu_tensor *w2 = mgpu_zeros(cpu, mgpu_shape4(4, 2, 3, 3));
    mgpu_tensor *y = mgpu_zeros(cpu, mgpu_shape4(2, 4, 6, 6));
    mgpu_tensor *ybad = mgpu_zeros(cpu, mgpu_shape4(2, 4, 8, 8));
    mgpu_tensor *b5 = mgpu_zeros(cpu, mgpu_shape1(5)), *dw = mgpu_zeros(cpu, mgpu_shape4(4, 3, 3, 2));
    mgpu_tensor *big = mgpu_zeros(cpu, mgpu_shape4(4, 3, 9, 9));
    mgpu_tensor *lx = mgpu_zeros(cpu, mgpu_shape2(4, 7)), *lw = mgpu_zeros(cpu, mgpu_shape2(6, 3));
    mgpu_tensor *ly = mgpu_zeros(cpu, mgpu_shape2(4, 3)), *lw7 = mgpu_zeros(cpu, mgpu_shape2(7, 3));
    mgpu_tensor *ly5 = mgpu_zeros(cpu, mgpu_shape2(5, 3)), *r23 = mgpu_zeros(cpu, mgpu_shape2(2, 3));
    mgpu_tensor *r32 = mgpu_zeros(cpu, mgpu_shape2(3, 2)), *p = mgpu_zeros(cpu, mgpu_shape4(2, 3, 3, 3));
    mgpu_synchronize(cpu); /* the children fork from an idle worker */

    EXPECT_DIES(mgpu_conv2d_forward(y, x, w2, NULL, 1, 0),
                "mgpu_conv2d_forward: input [2, 3, 8, 8] has 3 channels "
                "but weight [4, 2, 3, 3] expects 2");
    EXPECT_DIES(mgpu_conv2d_forward(ybad, x, w, NULL, 1, 0),
                "mgpu_conv2d_forward: output y has shape [2, 4, 8, 8], expected [2, 4, 6, 6]");
    EXPECT_DIES(mgpu_conv2d_forward(y, x, w, b5, 1, 0),
                "mgpu_conv2d_forward: bias b has shape [5], expected [4]");
    EXPECT_DIES(mgpu_conv2d_forward(y, x, big, NULL, 1, 0),
                "mgpu_conv2d_forward: a 9x9 kernel does not fit in input [2, 3, 8, 8] padded by 0");
    EXPECT_DIES(mgpu_conv2d_forward(y, x, w, NULL, 0, 0), "stride 0 must be >= 1");
    EXPECT_DIES(mgpu_conv2d_backward(NULL, dw, NULL, y, x, w, 1, 0, 0),
                "mgpu_conv2d_backward: weight gradient dw has shape [4, 3, 3, 2], expected [4, 3, 3, 3]");
    EXPECT_DIES(mgpu_conv2d_backward(NULL, w, NULL, ybad, x, w, 1, 0, 0),
                "mgpu_conv2d_backward: output gradient dy has shape [2, 4, 8, 8], expected [2, 4, 6, 6]");
    EXPECT_DIES(mgpu_conv2d_output_shape(mgpu_shape2(2, 3), mgpu_shape4(4, 3, 3, 3), 1, 0),
                "input [2, 3] and weight [4, 3, 3, 3] must both have 4 dimensions");
    EXPECT_DIES(mgpu_conv2d_output_shape(mgpu_shape4(2, 0, 8, 8), mgpu_shape4(4, 0, 1, 1), 1, 1),
                "input [2, 0, 8, 8] and weight [4, 0, 1, 1] must have no empty dimension");
    EXPECT_DIES(mgpu_conv2d_output_shape(mgpu_shape4(2, 3, 0, 8), mgpu_shape4(4, 3, 1, 1), 1, 1),
                "input [2, 3, 0, 8] and weight [4, 3, 1, 1] must have no empty dimension");
    EXPECT_DIES(mgpu_linear_forward(ly, lx, lw, NULL),
                "mgpu_linear_forward: input [4, 7] has 7 features but weight [6, 3] expects 6");
    EXPECT_DIES(mgpu_linear_forward(ly5, lx, lw7, NULL),
                "mgpu_linear_forward: output y has shape [5, 3], expected [4, 3]");
    EXPECT_DIES(mgpu_linear_backward(NULL, lw, NULL, ly, lx, lw7, 0),
                "mgpu_linear_backward: weight gradient dw has shape [6, 3], expected [7, 3]");
    EXPECT_DIES(mgpu_avg_pool2d_forward(y, x, 2),
                "mgpu_avg_pool2d_forward: output y has shape [2, 4, 6, 6], expected [2, 3, 4, 4]");
    EXPECT_DIES(mgpu_avg_pool2d_forward(p, p, 4),
                "mgpu_avg_pool2d_forward: cannot pool input [2, 3, 3, 3] with 4x4 windows");
    EXPECT_DIES(mgpu_global_avg_pool_forward(r32, x),
                "mgpu_global_avg_pool_forward: output y has shape [3, 2], expected [2, 3]");
    EXPECT_DIES(mgpu_relu_forward(r23, r32), "mgpu_relu_forward: shapes [2, 3] and [3, 2] differ");
    EXPECT_DIES(mgpu_add(r23, r23, r32), "mgpu_add: shapes [2, 3] and [3, 2] differ");

    mgpu_free(x); mgpu_free(w); mgpu_free(w2); mgpu_free(y); mgpu_free(ybad); mgpu_free(b5);
    mgpu_free(dw); mgpu_free(big); mgpu_free(lx); mgpu_free(lw); mgpu_free(ly); mgpu_free(lw7);
    mgpu_free(ly5); mgpu_free(r23); mgpu_free(r32); mgpu_free(p);
}

/* A second CPU device is made in the child only: mgpu_devices also shares
   the cores between CPU devices, which would slow the rest of the tests. */
static mgpu_tensor *on_second_device(mgpu_shape s) {
    mgpu_device *devs[2];
    mgpu_devices(2, 0, devs);
    return mgpu_empty(devs[1], s);
}

TEST(errors_name_the_devices) {
    mgpu_device *cpu = mgpu_cpu();
    mgpu_tensor *x = mgpu_zeros(cpu, mgpu_shape4(2, 3, 8, 8));
    mgpu_tensor *w = mgpu_zeros(cpu, mgpu_shape4(4, 3, 3, 3));
    mgpu_tensor *y = mgpu_zeros(cpu, mgpu_shape4(2, 4, 6, 6));
    mgpu_tensor *lx = mgpu_zeros(cpu, mgpu_shape2(4, 7));
    mgpu_tensor *ly = mgpu_zeros(cpu, mgpu_shape2(4, 3));
    mgpu_synchronize(cpu);
    EXPECT_DIES(mgpu_conv2d_forward(y, x, on_second_device(w->shape), NULL, 1, 0),
                "mgpu_conv2d_forward: a tensor on cpu#1 is used with one on cpu; "
                "copy it first with mgpu_to");
    EXPECT_DIES(mgpu_conv2d_backward(on_second_device(x->shape), w, NULL, y, x, w, 1, 0, 0),
                "mgpu_conv2d_backward: a tensor on cpu#1 is used with one on cpu");
    EXPECT_DIES(mgpu_linear_forward(ly, lx, on_second_device(mgpu_shape2(7, 3)), NULL),
                "mgpu_linear_forward: a tensor on cpu#1 is used with one on cpu");
    EXPECT_DIES(mgpu_relu_forward(on_second_device(ly->shape), ly),
                "mgpu_relu_forward: a tensor on cpu is used with one on cpu#1");
    mgpu_free(x); mgpu_free(w); mgpu_free(y); mgpu_free(lx); mgpu_free(ly);
}

TEST_MAIN()
