/* tests/gpu_train_ops.c: the CUDA kernels of batch norm, cross-entropy,
   accuracy, sums and SGD against their CPU references, on the same inputs.
   Built with nvcc and run by `make test-gpu`; on a machine without a GPU it
   prints "skipped: no GPU" and passes.

   Tolerances, |gpu - cpu| <= atol + rtol |cpu|, and why:
   - batch norm statistics: the GPU merges float Welford partials, the CPU
     sums in double. The mean is good to a few float ulps of the values'
     magnitude (atol 1e-5 + 1e-6 |offset| for data centred on `offset`),
     the variance and so invstd to ~1e-5 relative (rtol 1e-4).
   - y: those errors times |xhat| <= ~4 and gamma <= 1.5 (atol 5e-4).
   - dgamma, dbeta: sums of m float terms of size <= ~4, in float on the GPU:
     atol 1e-6 m (a loose bound for tree summation), rtol 1e-4.
   - dx: elementwise from the per-channel means: atol 1e-4, rtol 1e-4.
   - cross-entropy: float expf/logf against double: atol 1e-5, rtol 1e-5.
   - accuracy: a count, exact. Sums: both in double, rtol 1e-6.
   - SGD: the same few float operations (the GPU may fuse a multiply and an
     add): atol 1e-7, rtol 1e-6. */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"
#include "test.h"

static mgpu_device *cpu_dev, *gpu_dev;

/* The same values on the CPU and on the GPU. */
typedef struct { mgpu_tensor *cpu, *gpu; } cpu_and_gpu;
static cpu_and_gpu both_from(mgpu_shape s, const float *values) {
    cpu_and_gpu t = {mgpu_from_host(cpu_dev, s, values), mgpu_from_host(gpu_dev, s, values)};
    return t;
}
static cpu_and_gpu both_empty(mgpu_shape s) {
    cpu_and_gpu t = {mgpu_empty(cpu_dev, s), mgpu_empty(gpu_dev, s)};
    return t;
}
static void both_free(cpu_and_gpu t) {
    mgpu_free(t.cpu);
    mgpu_free(t.gpu);
}

static uint32_t rng_state = 2024;
static float uniform(float lo, float hi) {
    rng_state = rng_state * 1664525u + 1013904223u;
    return lo + (hi - lo) * (float)(rng_state >> 8) / 16777216.0f;
}
static cpu_and_gpu both_uniform(mgpu_shape s, float lo, float hi) {
    size_t n = mgpu_shape_numel(s);
    float *v = (float *)malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) v[i] = uniform(lo, hi);
    cpu_and_gpu t = both_from(s, v);
    free(v);
    return t;
}

/* Every value of the GPU tensor against the CPU one; reports how many
   differ, and the first. */
static void expect_close(const char *what, cpu_and_gpu t, double atol, double rtol) {
    size_t n = t.cpu->numel, bad = 0, first = 0;
    float *want = (float *)malloc(n * sizeof(float)), *got = (float *)malloc(n * sizeof(float));
    mgpu_to_host(t.cpu, want);
    mgpu_to_host(t.gpu, got);
    for (size_t i = 0; i < n; i++)
        if (!(fabs((double)got[i] - want[i]) <= atol + rtol * fabs(want[i])) && bad++ == 0) first = i;
    if (bad) {
        fprintf(stderr, "  %s: %zu of %zu values differ; first [%zu]: gpu %.9g, cpu %.9g (atol %g, rtol %g)\n",
                what, bad, n, first, got[first], want[first], atol, rtol);
        test__failures++;
    }
    free(want);
    free(got);
}

/* ----------------------------------------------------------- batch norm */
static void check_batchnorm(int n, int c, int h, int w, float offset, int fuse_relu) {
    mgpu_shape s = mgpu_shape4(n, c, h, w), cs = mgpu_shape1(c);
    double m = (double)n * h * w;
    cpu_and_gpu x = both_uniform(s, offset - 1.0f, offset + 1.0f), y = both_empty(s);
    cpu_and_gpu gamma = both_uniform(cs, 0.5f, 1.5f), beta = both_uniform(cs, -0.5f, 0.5f);
    cpu_and_gpu rm = both_uniform(cs, -1, 1), rv = both_uniform(cs, 0.5f, 2);
    cpu_and_gpu sm = both_empty(cs), si = both_empty(cs);
    mgpu_batchnorm2d_forward(y.cpu, x.cpu, gamma.cpu, beta.cpu, rm.cpu, rv.cpu, sm.cpu, si.cpu, 1, 0.1f, 1e-5f, fuse_relu);
    mgpu_batchnorm2d_forward(y.gpu, x.gpu, gamma.gpu, beta.gpu, rm.gpu, rv.gpu, sm.gpu, si.gpu, 1, 0.1f, 1e-5f, fuse_relu);
    double mean_atol = 1e-5 + 1e-6 * fabs(offset);
    expect_close("save_mean", sm, mean_atol, 0);
    expect_close("save_invstd", si, 0, 1e-4);
    expect_close("running_mean", rm, mean_atol, 0);
    expect_close("running_var", rv, 0, 1e-4);
    expect_close("y (training)", y, 5e-4, 1e-4);

    /* Backward, accumulating into gradients that are already there. With
       the fused ReLU both sides recompute the mask y > 0 from x and the
       saved statistics, so both take the CPU's statistics: the two sets
       agree only to rounding, and among millions of values a few lie so
       near 0 that they would be clipped on one side and not the other.
       From the same statistics the masks agree exactly (fused
       multiply-adds on both sides; kernels/batchnorm.h). */
    if (fuse_relu) {
        mgpu_copy(sm.gpu, sm.cpu, 0);
        mgpu_copy(si.gpu, si.cpu, 0);
    }
    cpu_and_gpu dy = both_uniform(s, -1, 1), dx = both_empty(s);
    cpu_and_gpu dgamma = both_uniform(cs, -1, 1), dbeta = both_uniform(cs, -1, 1);
    mgpu_batchnorm2d_backward(dx.cpu, dgamma.cpu, dbeta.cpu, dy.cpu, x.cpu, gamma.cpu, beta.cpu, sm.cpu, si.cpu, fuse_relu, 1);
    mgpu_batchnorm2d_backward(dx.gpu, dgamma.gpu, dbeta.gpu, dy.gpu, x.gpu, gamma.gpu, beta.gpu, sm.gpu, si.gpu, fuse_relu, 1);
    expect_close("dx", dx, 1e-4, 1e-4);
    expect_close("dgamma", dgamma, 1e-6 * m, 1e-4);
    expect_close("dbeta", dbeta, 1e-6 * m, 1e-4);

    /* Evaluation mode, with the running statistics both devices now hold
       (the same to the tolerance above): compare on the CPU's. */
    mgpu_copy(rm.gpu, rm.cpu, 0);
    mgpu_copy(rv.gpu, rv.cpu, 0);
    mgpu_batchnorm2d_forward(y.cpu, x.cpu, gamma.cpu, beta.cpu, rm.cpu, rv.cpu, NULL, NULL, 0, 0.1f, 1e-5f, fuse_relu);
    mgpu_batchnorm2d_forward(y.gpu, x.gpu, gamma.gpu, beta.gpu, rm.gpu, rv.gpu, NULL, NULL, 0, 0.1f, 1e-5f, fuse_relu);
    expect_close("y (evaluation)", y, 1e-4, 1e-4);

    cpu_and_gpu all[] = {x, y, gamma, beta, rm, rv, sm, si, dy, dx, dgamma, dbeta};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) both_free(all[i]);
}

/* ResNet-18's first stage at batch 256: 200704 values per channel, cut
   into 64 slices of 3136. Centred on 50 to show that the variance does not
   cancel away. */
TEST(batchnorm_resnet_stage1_relu) { check_batchnorm(256, 64, 28, 28, 50.0f, 1); }
TEST(batchnorm_resnet_stage1) { check_batchnorm(256, 64, 28, 28, 0.0f, 0); }
TEST(batchnorm_many_channels_small_images) { check_batchnorm(8, 512, 4, 4, 0.0f, 1); }
TEST(batchnorm_one_image) { check_batchnorm(1, 3, 5, 7, 3.0f, 0); }
TEST(batchnorm_one_pixel_per_image) { check_batchnorm(5, 2, 1, 1, 0.0f, 1); }
TEST(batchnorm_ragged_slices) { check_batchnorm(3, 4, 37, 41, -2.0f, 0); } /* m = 4551: 2 slices */

/* -------------------------------------------------------- cross-entropy */
/* Logits are small integers, so that rows often have ties for the largest. */
static void check_cross_entropy(int n, int classes, int integer_logits) {
    mgpu_shape s = mgpu_shape2(n, classes);
    float *z = (float *)malloc((size_t)n * classes * sizeof(float)), *labels = (float *)malloc((size_t)n * sizeof(float));
    for (size_t i = 0; i < (size_t)n * classes; i++)
        z[i] = integer_logits ? floorf(uniform(0, 3)) : uniform(-8, 8);
    for (int i = 0; i < n; i++) labels[i] = floorf(uniform(0, (float)classes));
    cpu_and_gpu tz = both_from(s, z), ty = both_from(mgpu_shape1(n), labels);
    cpu_and_gpu losses = both_empty(mgpu_shape1(n)), dz = both_empty(s), count = both_empty(mgpu_shape1(1));
    cpu_and_gpu total = both_empty(mgpu_shape1(1));
    mgpu_cross_entropy_forward(losses.cpu, tz.cpu, ty.cpu);
    mgpu_cross_entropy_forward(losses.gpu, tz.gpu, ty.gpu);
    expect_close("losses", losses, 1e-5, 1e-5);
    mgpu_cross_entropy_backward(dz.cpu, tz.cpu, ty.cpu, 1.0f / n);
    mgpu_cross_entropy_backward(dz.gpu, tz.gpu, ty.gpu, 1.0f / n);
    expect_close("dlogits", dz, 1e-5 / n, 1e-5);
    mgpu_accuracy_count(count.cpu, tz.cpu, ty.cpu);
    mgpu_accuracy_count(count.gpu, tz.gpu, ty.gpu);
    expect_close("accuracy count", count, 0, 0);
    mgpu_mean(total.cpu, losses.cpu);
    mgpu_mean(total.gpu, losses.gpu);
    expect_close("mean loss", total, 0, 1e-5);
    cpu_and_gpu all[] = {tz, ty, losses, dz, count, total};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) both_free(all[i]);
    free(z);
    free(labels);
}
TEST(cross_entropy_10_classes) { check_cross_entropy(1000, 10, 0); }
TEST(cross_entropy_1000_classes) { check_cross_entropy(64, 1000, 0); }
TEST(cross_entropy_ties) { check_cross_entropy(4096, 10, 1); }
TEST(cross_entropy_one_class) { check_cross_entropy(7, 1, 0); }

/* On the GPU a label outside [0, classes) is reported in the device's
   mgpu__label_error, which the next wait for the device (mgpu_item here)
   turns into the CPU's line. A forked child cannot use the GPU, so the
   test reads the report itself, then clears it to read the values: the
   sample's loss and gradient row are NaN, and it counts as wrong. */
TEST(cross_entropy_bad_label_is_reported_on_the_gpu) {
    float z[6] = {0, 1, 2, 3, 4, 5}, labels[2] = {2, 3};
    mgpu_tensor *tz = mgpu_from_host(gpu_dev, mgpu_shape2(2, 3), z);
    mgpu_tensor *ty = mgpu_from_host(gpu_dev, mgpu_shape1(2), labels);
    mgpu_tensor *losses = mgpu_empty(gpu_dev, mgpu_shape1(2)), *dz = mgpu_empty(gpu_dev, mgpu_shape2(2, 3));
    mgpu_tensor *count = mgpu_empty(gpu_dev, mgpu_shape1(1));
    mgpu__cross_entropy_forward("a_caller", 40, losses, tz, ty);
    mgpu_cross_entropy_backward(dz, tz, ty, 1.0f);
    mgpu_accuracy_count(count, tz, ty);
    mgpu__queue_synchronize(&gpu_dev->queue[0]);
    mgpu__label_error e = *gpu_dev->label_error; /* (pinned host memory: read as it is) */
    CHECK(e.op != 0 && strcmp((const char *)(uintptr_t)e.op, "a_caller") == 0); /* the first kernel's */
    CHECK_EQ_INT(e.row, 41); /* row 1, counted from the caller's 40 */
    CHECK_EQ_INT(e.classes, 3);
    CHECK(e.label == 3.0f);
    memset(gpu_dev->label_error, 0, sizeof e); /* cleared, and unclaimed, to read the values */
    mgpu_fill(gpu_dev->label_claim, 0.0f);
    CHECK(!isnan(mgpu_item(losses, 0)));
    CHECK(isnan(mgpu_item(losses, 1)));
    CHECK(!isnan(mgpu_item(dz, 2)));
    CHECK(isnan(mgpu_item(dz, 3)) && isnan(mgpu_item(dz, 5)));
    CHECK_EQ_INT(mgpu_item(count, 0), 1);
    mgpu_free(tz); mgpu_free(ty); mgpu_free(losses); mgpu_free(dz); mgpu_free(count);
}

/* The same rows as test_train_ops.c's accuracy_takes_nan_as_the_largest,
   and 40 classes, so that the lanes combine their NaNs in a warp. */
TEST(accuracy_takes_nan_as_the_largest) {
    float z[15] = {1, NAN, 3, NAN, NAN, 0, NAN, 2, 2, 2, 5, NAN, -INFINITY, -INFINITY, -INFINITY};
    float labels[5] = {1, 0, 0, 2, 1};
    cpu_and_gpu tz = both_from(mgpu_shape2(5, 3), z), ty = both_from(mgpu_shape1(5), labels);
    cpu_and_gpu count = both_empty(mgpu_shape1(1));
    mgpu_accuracy_count(count.gpu, tz.gpu, ty.gpu);
    CHECK_EQ_INT(mgpu_item(count.gpu, 0), 4);
    float wide[2 * 40], wide_labels[2] = {33, 0};
    for (int j = 0; j < 80; j++) wide[j] = (float)(j % 7);
    wide[33] = wide[37] = NAN;    /* row 0: the first NaN, 33, in lane 1 */
    for (int j = 40; j < 80; j++) wide[j] = NAN; /* row 1: all NaN: 0 */
    cpu_and_gpu tw = both_from(mgpu_shape2(2, 40), wide), tl = both_from(mgpu_shape1(2), wide_labels);
    mgpu_accuracy_count(count.gpu, tw.gpu, tl.gpu);
    mgpu_accuracy_count(count.cpu, tw.cpu, tl.cpu);
    CHECK_EQ_INT(mgpu_item(count.gpu, 0), 2);
    CHECK_EQ_INT(mgpu_item(count.cpu, 0), 2);
    cpu_and_gpu ts[] = {tz, ty, count, tw, tl};
    for (int i = 0; i < 5; i++) { mgpu_free(ts[i].cpu); mgpu_free(ts[i].gpu); }
}

TEST(sum_of_a_long_vector) {
    cpu_and_gpu x = both_uniform(mgpu_shape1(1000003), -1, 3), out = both_empty(mgpu_shape1(1));
    mgpu_sum(out.cpu, x.cpu);
    mgpu_sum(out.gpu, x.gpu);
    expect_close("sum", out, 0, 1e-6);
    both_free(x);
    both_free(out);
}

/* ------------------------------------------------------------------ SGD */
TEST(sgd_book) {
    mgpu_shape s = mgpu_shape2(1000, 37);
    cpu_and_gpu p = both_uniform(s, -1, 1);
    for (int step = 0; step < 3; step++) {
        cpu_and_gpu g = both_uniform(s, -5, 5);
        mgpu_sgd_book(p.cpu, g.cpu, 0.2f, 256);
        mgpu_sgd_book(p.gpu, g.gpu, 0.2f, 256);
        expect_close("param", p, 1e-7, 1e-6);
        expect_close("grad (cleared)", g, 0, 0);
        both_free(g);
    }
    both_free(p);
}

/* The GPU compiles a * b + c to one fused multiply-add (one rounding), the
   CPU rounds the product and the sum apart: each update may differ by up to
   an ulp of its largest operand (|buf| < 3 here, whose ulp is 2.4e-7), and
   where momentum * buf and g nearly cancel, that is a large relative
   difference of a small result. Hence an absolute tolerance, of 4 such ulps. */
static void check_sgd_step(float momentum, float weight_decay) {
    mgpu_shape s = mgpu_shape1(100001);
    cpu_and_gpu p = both_uniform(s, -1, 1), buf = both_empty(s);
    for (int step = 0; step < 3; step++) {
        cpu_and_gpu g = both_uniform(s, -1, 1);
        mgpu_sgd_step(p.cpu, g.cpu, buf.cpu, 0.1f, momentum, weight_decay, step == 0);
        mgpu_sgd_step(p.gpu, g.gpu, buf.gpu, 0.1f, momentum, weight_decay, step == 0);
        expect_close("param", p, 1e-6, 1e-6);
        if (momentum != 0) expect_close("momentum buffer", buf, 1e-6, 1e-6);
        both_free(g);
    }
    both_free(p);
    both_free(buf);
}
TEST(sgd_momentum_weight_decay) { check_sgd_step(0.9f, 5e-4f); }
TEST(sgd_plain) { check_sgd_step(0.0f, 0.0f); }

TEST_MAIN_GPU((cpu_dev = mgpu_cpu(), gpu_dev = mgpu_try_gpu(0)))
