/* tests/test_tensor_parallel.c: layers split across devices (the TENSOR
   PARALLELISM section of mgpu.h).

   - a convolution split by output channels over k = 2 and 4 devices
     gives one device's output, input gradient and parameter gradients,
     at two strides and paddings, and again on a shorter batch;
   - so does Megatron's MLP block (column-parallel linear, ReLU,
     row-parallel linear);
   - "the same" is within 1e-5 relative to the largest value
     (test_relative_diff): the split computes the same products, but the
     allreduces add the devices' parts in another order;
   - the output and the input gradient are on every device, each equal
     to one device's;
   - the bytes each block moves per step are the hand-computed ones, and
     so are data parallelism's for the same parameters;
   - each device holds 1/k of the parameters and of their gradients;
   - bad settings are refused with one line naming the function.
   tests/gpu_tensor_parallel.c includes this file with TEST_ON_GPU 1: the
   same tests on GPU devices (physical, then virtual). */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"
#include "test.h"

#define TOLERANCE 1e-5 /* relative: max |split - one device| / max |one device| */

static int close_to(const char *what, int k, const mgpu_tensor *split, const mgpu_tensor *one) {
    double diff = test_relative_diff(split, one);
    if (diff > TOLERANCE) fprintf(stderr, "  k = %d: %s differs from one device's by %g (relative)\n", k, what, diff);
    return diff <= TOLERANCE;
}

/* ------------------------------------------------------------ the convolution */
/* 3 input channels, 8 filters of 3x3, on images of 6x7 (not square, so
   that mixing up H and W shows). */
enum { CONV_C = 3, CONV_K = 8, CONV_H = 6, CONV_W = 7 };

/* One device's forward and backward pass against the split one's, on a
   batch of n images: y and dx on every device, dW and db gathered. */
static void check_conv_step(mgpu_tp_conv *c, mgpu_device *const *devs, const mgpu_tensor *w, const mgpu_tensor *b,
                            int n, int stride, int pad, int k) {
    mgpu_device *dev = w->device;
    mgpu_tensor *x = mgpu_randn(dev, mgpu_shape4(n, CONV_C, CONV_H, CONV_W), 0, 1);
    mgpu_shape y_shape = mgpu_conv2d_output_shape(x->shape, w->shape, stride, pad);
    mgpu_tensor *y = mgpu_empty(dev, y_shape), *dy = mgpu_randn(dev, y_shape, 0, 1);
    mgpu_tensor *dx = mgpu_empty(dev, x->shape), *dw = mgpu_empty(dev, w->shape), *db = mgpu_empty(dev, b->shape);
    mgpu_conv2d_forward(y, x, w, b, stride, pad);
    mgpu_conv2d_backward(dx, dw, db, dy, x, w, stride, pad, 0);

    CHECK(mgpu_tp_conv_forward(c, x) == mgpu_tp_conv_output(c, 0));
    CHECK(mgpu_tp_conv_backward(c, dy) == mgpu_tp_conv_input_grad(c, 0));
    mgpu_tensor *split_dw = mgpu_empty(dev, w->shape), *split_db = mgpu_empty(dev, b->shape);
    mgpu_tp_conv_gather_grads(c, split_dw, split_db);
    for (int i = 0; i < k; i++) {
        CHECK(mgpu_tp_conv_output(c, i)->device == devs[i] && mgpu_tp_conv_input_grad(c, i)->device == devs[i]);
        CHECK(close_to("the convolution's y", k, mgpu_tp_conv_output(c, i), y));
        CHECK(close_to("the convolution's dx", k, mgpu_tp_conv_input_grad(c, i), dx));
    }
    CHECK(close_to("the convolution's dW", k, split_dw, dw));
    CHECK(close_to("the convolution's db", k, split_db, db));
    mgpu_tensor *made[] = {x, y, dy, dx, dw, db, split_dw, split_db};
    for (size_t i = 0; i < sizeof made / sizeof made[0]; i++) mgpu_free(made[i]);
}

TEST(a_convolution_split_by_channels_equals_one_device) {
    const int strides[] = {1, 2}, pads[] = {1, 0};
    for (int k = 2; k <= 4; k += 2)
        for (int s = 0; s < 2; s++) {
            mgpu_device *devs[4];
            mgpu_devices(k, TEST_ON_GPU, devs);
            mgpu_manual_seed(7);
            mgpu_tensor *w = mgpu_randn(devs[0], mgpu_shape4(CONV_K, CONV_C, 3, 3), 0, 1);
            mgpu_tensor *b = mgpu_randn(devs[0], mgpu_shape1(CONV_K), 0, 1);
            mgpu_tp_conv *c = mgpu_tp_conv_new(w, b, strides[s], pads[s], devs, k);
            check_conv_step(c, devs, w, b, 5, strides[s], pads[s], k);
            check_conv_step(c, devs, w, b, 3, strides[s], pads[s], k); /* a shorter batch: new buffers */
            mgpu_tp_conv_free(c);
            mgpu_free(w);
            mgpu_free(b);
        }
}

/* ------------------------------------------------------------ the MLP block */
enum { MLP_IN = 12, MLP_HIDDEN = 16, MLP_OUT = 10, MLP_N = 6 };

TEST(megatrons_mlp_block_equals_one_device) {
    for (int k = 2; k <= 4; k += 2) {
        mgpu_device *devs[4];
        mgpu_devices(k, TEST_ON_GPU, devs);
        mgpu_device *dev = devs[0];
        mgpu_manual_seed(11);
        mgpu_tensor *A = mgpu_randn(dev, mgpu_shape2(MLP_IN, MLP_HIDDEN), 0, 1);
        mgpu_tensor *a = mgpu_randn(dev, mgpu_shape1(MLP_HIDDEN), 0, 1);
        mgpu_tensor *B = mgpu_randn(dev, mgpu_shape2(MLP_HIDDEN, MLP_OUT), 0, 1);
        mgpu_tensor *b = mgpu_randn(dev, mgpu_shape1(MLP_OUT), 0, 1);
        mgpu_tensor *X = mgpu_randn(dev, mgpu_shape2(MLP_N, MLP_IN), 0, 1);
        mgpu_tensor *dY = mgpu_randn(dev, mgpu_shape2(MLP_N, MLP_OUT), 0, 1);
        /* One device: Y = relu(X A + a) B + b, and back. */
        mgpu_tensor *H = mgpu_empty(dev, mgpu_shape2(MLP_N, MLP_HIDDEN)), *dH = mgpu_empty(dev, H->shape);
        mgpu_tensor *Y = mgpu_empty(dev, dY->shape), *dX = mgpu_empty(dev, X->shape);
        mgpu_tensor *dA = mgpu_empty(dev, A->shape), *da = mgpu_empty(dev, a->shape);
        mgpu_tensor *dB = mgpu_empty(dev, B->shape), *db = mgpu_empty(dev, b->shape);
        mgpu_linear_forward(H, X, A, a);
        mgpu_relu_forward(H, H);
        mgpu_linear_forward(Y, H, B, b);
        mgpu_linear_backward(dH, dB, db, dY, H, B, 0);
        mgpu_relu_backward(dH, dH, H);
        mgpu_linear_backward(dX, dA, da, dH, X, A, 0);

        mgpu_tp_mlp *m = mgpu_tp_mlp_new(A, a, B, b, devs, k);
        CHECK(mgpu_tp_mlp_forward(m, X) == mgpu_tp_mlp_output(m, 0));
        CHECK(mgpu_tp_mlp_backward(m, dY) == mgpu_tp_mlp_input_grad(m, 0));
        mgpu_tensor *split_dA = mgpu_empty(dev, A->shape), *split_da = mgpu_empty(dev, a->shape);
        mgpu_tensor *split_dB = mgpu_empty(dev, B->shape), *split_db = mgpu_empty(dev, b->shape);
        mgpu_tp_mlp_gather_grads(m, split_dA, split_da, split_dB, split_db);
        for (int i = 0; i < k; i++) {
            CHECK(mgpu_tp_mlp_output(m, i)->device == devs[i]);
            CHECK(mgpu_tp_mlp_input_grad(m, i)->device == devs[i]);
            CHECK(close_to("the MLP's Y", k, mgpu_tp_mlp_output(m, i), Y));
            CHECK(close_to("the MLP's dX", k, mgpu_tp_mlp_input_grad(m, i), dX));
        }
        CHECK(close_to("the MLP's dA", k, split_dA, dA));
        CHECK(close_to("the MLP's da", k, split_da, da));
        CHECK(close_to("the MLP's dB", k, split_dB, dB));
        CHECK(close_to("the MLP's db", k, split_db, db));
        mgpu_tp_mlp_free(m);
        mgpu_tensor *made[] = {A, a, B, b, X, dY, H, dH, Y, dX, dA, da, dB, db,
                               split_dA, split_da, split_dB, split_db};
        for (size_t i = 0; i < sizeof made / sizeof made[0]; i++) mgpu_free(made[i]);
    }
}

/* ------------------------------------------------------------ bytes per step */
/* By hand, per device, 4-byte floats:
   convolution, batch 5, 3 -> 8 channels of 6x7 (stride 1, padding 1):
     y is 5*8*6*7 = 1680 floats, 6720 bytes: the all-gather (k-1)/k of it,
       3360 (k = 2), 5040 (k = 4);
     x is 5*3*6*7 = 630 floats, 2520 bytes: the allreduce 2(k-1)/k of it,
       2520 (k = 2), 3780 (k = 4);
     parameters 8*3*3*3 + 8 = 224, 896 bytes: data parallelism's
       allreduce 896 (k = 2), 1344 (k = 4).
   MLP, batch 6, 12 -> 16 -> 10:
     Y is 6*10 = 60 floats, 240 bytes: 240 (k = 2), 360 (k = 4);
     X is 6*12 = 72 floats, 288 bytes: 288 (k = 2), 432 (k = 4);
     parameters 12*16 + 16 + 16*10 + 10 = 378, 1512 bytes: 1512, 2268. */
TEST(the_bytes_moved_per_step_are_the_hand_computed_ones) {
    CHECK_EQ_INT(mgpu_all_gather_bytes(1000, 4), 750);
    CHECK_EQ_INT(mgpu_allreduce_bytes(1000, 4), 1500);
    CHECK_EQ_INT(mgpu_allreduce_bytes(1000, 1), 0);
    CHECK_EQ_INT(mgpu_data_parallel_bytes(250, 4), 1500);
    const size_t conv_forward[] = {3360, 5040}, conv_backward[] = {2520, 3780}, conv_dp[] = {896, 1344};
    const size_t mlp_forward[] = {240, 360}, mlp_backward[] = {288, 432}, mlp_dp[] = {1512, 2268};
    for (int k = 2, at = 0; k <= 4; k += 2, at++) {
        mgpu_device *devs[4];
        mgpu_devices(k, TEST_ON_GPU, devs);
        mgpu_tensor *w = mgpu_randn(devs[0], mgpu_shape4(CONV_K, CONV_C, 3, 3), 0, 1);
        mgpu_tensor *b = mgpu_randn(devs[0], mgpu_shape1(CONV_K), 0, 1);
        mgpu_tensor *x = mgpu_randn(devs[0], mgpu_shape4(5, CONV_C, CONV_H, CONV_W), 0, 1);
        mgpu_tensor *dy = mgpu_randn(devs[0], mgpu_shape4(5, CONV_K, CONV_H, CONV_W), 0, 1);
        mgpu_tp_conv *c = mgpu_tp_conv_new(w, b, 1, 1, devs, k);
        CHECK_EQ_INT(mgpu_tp_conv_bytes(c).forward + mgpu_tp_conv_bytes(c).backward, 0); /* no step yet */
        mgpu_tp_conv_forward(c, x);
        mgpu_tp_conv_backward(c, dy);
        CHECK_EQ_INT(mgpu_tp_conv_bytes(c).forward, conv_forward[at]);
        CHECK_EQ_INT(mgpu_tp_conv_bytes(c).backward, conv_backward[at]);
        CHECK_EQ_INT(mgpu_tp_conv_parameters(c), 224);
        CHECK_EQ_INT(mgpu_data_parallel_bytes(mgpu_tp_conv_parameters(c), k), conv_dp[at]);

        mgpu_tensor *A = mgpu_randn(devs[0], mgpu_shape2(MLP_IN, MLP_HIDDEN), 0, 1);
        mgpu_tensor *a = mgpu_randn(devs[0], mgpu_shape1(MLP_HIDDEN), 0, 1);
        mgpu_tensor *B = mgpu_randn(devs[0], mgpu_shape2(MLP_HIDDEN, MLP_OUT), 0, 1);
        mgpu_tensor *bo = mgpu_randn(devs[0], mgpu_shape1(MLP_OUT), 0, 1);
        mgpu_tensor *X = mgpu_randn(devs[0], mgpu_shape2(MLP_N, MLP_IN), 0, 1);
        mgpu_tensor *dY = mgpu_randn(devs[0], mgpu_shape2(MLP_N, MLP_OUT), 0, 1);
        mgpu_tp_mlp *m = mgpu_tp_mlp_new(A, a, B, bo, devs, k);
        mgpu_tp_mlp_forward(m, X);
        mgpu_tp_mlp_backward(m, dY);
        CHECK_EQ_INT(mgpu_tp_mlp_bytes(m).forward, mlp_forward[at]);
        CHECK_EQ_INT(mgpu_tp_mlp_bytes(m).backward, mlp_backward[at]);
        CHECK_EQ_INT(mgpu_tp_mlp_parameters(m), 378);
        CHECK_EQ_INT(mgpu_data_parallel_bytes(mgpu_tp_mlp_parameters(m), k), mlp_dp[at]);
        mgpu_synchronize_all();
        mgpu_tp_conv_free(c);
        mgpu_tp_mlp_free(m);
        mgpu_tensor *made[] = {w, b, x, dy, A, a, B, bo, X, dY};
        for (size_t i = 0; i < sizeof made / sizeof made[0]; i++) mgpu_free(made[i]);
    }
}

/* ------------------------------------------------------------ memory */
/* An MLP 256 -> 512 -> 128 on 4 devices: each holds 128 of the hidden
   units, A's [256, 128] (131072 bytes), a's [128] (512) and B's [128, 128]
   (65536): 197120 bytes of parameters and as many of gradients; device 0
   also b [128] (512 more), where one device would hold all 788992. (Sizes
   that are multiples of the allocator's 512-byte granules, so that what
   a device holds is exact.) */
TEST(each_device_holds_a_kth_of_the_parameters) {
    mgpu_device *devs[4];
    mgpu_devices(4, TEST_ON_GPU, devs);
    mgpu_tensor *A = mgpu_randn(devs[0], mgpu_shape2(256, 512), 0, 1), *a = mgpu_randn(devs[0], mgpu_shape1(512), 0, 1);
    mgpu_tensor *B = mgpu_randn(devs[0], mgpu_shape2(512, 128), 0, 1), *b = mgpu_randn(devs[0], mgpu_shape1(128), 0, 1);
    size_t parameters[4], gradients[4];
    for (int i = 0; i < 4; i++) {
        parameters[i] = mgpu_device_memory_of(devs[i], MGPU_MEMORY_PARAMETERS);
        gradients[i] = mgpu_device_memory_of(devs[i], MGPU_MEMORY_GRADIENTS);
    }
    mgpu_tp_mlp *m = mgpu_tp_mlp_new(A, a, B, b, devs, 4);
    for (int i = 0; i < 4; i++) {
        size_t want = 197120 + (i == 0 ? 512 : 0);
        CHECK_EQ_INT(mgpu_device_memory_of(devs[i], MGPU_MEMORY_PARAMETERS) - parameters[i], want);
        CHECK_EQ_INT(mgpu_device_memory_of(devs[i], MGPU_MEMORY_GRADIENTS) - gradients[i], want);
    }
    mgpu_tp_mlp_free(m);
    for (int i = 0; i < 4; i++) {
        CHECK_EQ_INT(mgpu_device_memory_of(devs[i], MGPU_MEMORY_PARAMETERS), parameters[i]);
        CHECK_EQ_INT(mgpu_device_memory_of(devs[i], MGPU_MEMORY_GRADIENTS), gradients[i]);
    }
    mgpu_free(A);
    mgpu_free(a);
    mgpu_free(B);
    mgpu_free(b);
}

/* ------------------------------------------------------------ refusals */
#if !TEST_ON_GPU /* (a forked child cannot use a GPU) */
TEST(bad_settings_are_refused_by_name) {
    mgpu_device *devs[MGPU_MAX_DEVICES + 1];
    mgpu_devices(3, 0, devs);
    for (int i = 3; i <= MGPU_MAX_DEVICES; i++) devs[i] = devs[0]; /* never read: k is refused first */
    mgpu_device *twice[2] = {devs[0], devs[0]};
    mgpu_device *cpu = devs[0];
    mgpu_tensor *w = mgpu_randn(cpu, mgpu_shape4(CONV_K, CONV_C, 3, 3), 0, 1);
    mgpu_tensor *b = mgpu_randn(cpu, mgpu_shape1(CONV_K), 0, 1);
    mgpu_tensor *x = mgpu_randn(cpu, mgpu_shape4(5, CONV_C, CONV_H, CONV_W), 0, 1);
    mgpu_tensor *x_elsewhere = mgpu_to(x, devs[1], 0);
    mgpu_tensor *x_4_channels = mgpu_randn(cpu, mgpu_shape4(5, 4, CONV_H, CONV_W), 0, 1);
    mgpu_tensor *dy_short = mgpu_randn(cpu, mgpu_shape4(4, CONV_K, CONV_H, CONV_W), 0, 1);

    EXPECT_DIES(mgpu_tp_conv_new(w, b, 1, 1, devs, 3),
                "mgpu_tp_conv_new: 8 output channels do not split into k = 3 equal slices");
    EXPECT_DIES(mgpu_tp_conv_new(w, b, 1, 1, devs, 0),
                "mgpu_tp_conv_new: k = 0; the number of devices must be between 1 and 16");
    EXPECT_DIES(mgpu_tp_conv_new(w, b, 1, 1, devs, MGPU_MAX_DEVICES + 1),
                "mgpu_tp_conv_new: k = 17; the number of devices must be between 1 and 16");
    EXPECT_DIES(mgpu_tp_conv_new(w, b, 1, 1, twice, 2), "mgpu_tp_conv_new: cpu is given twice");
    EXPECT_DIES(mgpu_tp_conv_new(w, w, 1, 1, devs, 2), "mgpu_tp_conv_new: bias has shape [8, 3, 3, 3]; it must be [8]");
    EXPECT_DIES(mgpu_tp_conv_new(b, b, 1, 1, devs, 2), "mgpu_tp_conv_new: weight has shape [8]; it must be [K, C, R, S]");
    EXPECT_DIES(mgpu_tp_conv_new(w, b, 0, 1, devs, 2), "mgpu_tp_conv_new: stride 0 must be >= 1");

    mgpu_tp_conv *c = mgpu_tp_conv_new(w, b, 1, 1, devs, 2);
    EXPECT_DIES(mgpu_tp_conv_backward(c, dy_short), "mgpu_tp_conv_backward: no forward pass before it");
    EXPECT_DIES(mgpu_tp_conv_forward(c, x_elsewhere),
                "mgpu_tp_conv_forward: x is on cpu#1; it must be on devices[0] (cpu)");
    EXPECT_DIES(mgpu_tp_conv_forward(c, x_4_channels),
                "mgpu_tp_conv_forward: input [5, 4, 6, 7] has 4 channels but weight [4, 3, 3, 3] expects 3");
    mgpu_tp_conv_forward(c, x);
    EXPECT_DIES(mgpu_tp_conv_backward(c, dy_short),
                "mgpu_tp_conv_backward: dy has shape [4, 8, 6, 7]; it must be [5, 8, 6, 7]");
    EXPECT_DIES(mgpu_tp_conv_output(c, 2), "mgpu_tp_conv_output: device 2 of a block over 2 devices");
    EXPECT_DIES(mgpu_tp_conv_gather_grads(c, w, w), "mgpu_tp_conv_gather_grads: dbias has shape [8, 3, 3, 3]");

    mgpu_tensor *A = mgpu_randn(cpu, mgpu_shape2(MLP_IN, MLP_HIDDEN), 0, 1);
    mgpu_tensor *a = mgpu_randn(cpu, mgpu_shape1(MLP_HIDDEN), 0, 1);
    mgpu_tensor *B = mgpu_randn(cpu, mgpu_shape2(MLP_HIDDEN, MLP_OUT), 0, 1);
    mgpu_tensor *B_15_rows = mgpu_randn(cpu, mgpu_shape2(15, MLP_OUT), 0, 1);
    mgpu_tensor *bo = mgpu_randn(cpu, mgpu_shape1(MLP_OUT), 0, 1);
    mgpu_tensor *X = mgpu_randn(cpu, mgpu_shape2(MLP_N, MLP_IN), 0, 1);
    mgpu_tensor *X_11 = mgpu_randn(cpu, mgpu_shape2(MLP_N, 11), 0, 1);
    mgpu_tensor *X_elsewhere = mgpu_to(X, devs[1], 0);
    mgpu_tensor *dY = mgpu_randn(cpu, mgpu_shape2(MLP_N, MLP_OUT), 0, 1);
    mgpu_tensor *dY_elsewhere = mgpu_to(dY, devs[1], 0);

    EXPECT_DIES(mgpu_tp_mlp_new(A, a, B, bo, devs, 3),
                "mgpu_tp_mlp_new: 16 hidden units do not split into k = 3 equal slices");
    EXPECT_DIES(mgpu_tp_mlp_new(A, a, B, bo, devs, -1), "mgpu_tp_mlp_new: k = -1; the number of devices");
    EXPECT_DIES(mgpu_tp_mlp_new(A, a, B_15_rows, bo, devs, 2),
                "mgpu_tp_mlp_new: A [12, 16] and B [15, 10] must be [in, hidden] and [hidden, out]");
    EXPECT_DIES(mgpu_tp_mlp_new(A, bo, B, bo, devs, 2), "mgpu_tp_mlp_new: a has shape [10]; it must be [16]");
    mgpu_tp_mlp *m = mgpu_tp_mlp_new(A, a, B, bo, devs, 2);
    EXPECT_DIES(mgpu_tp_mlp_backward(m, dY), "mgpu_tp_mlp_backward: no forward pass before it");
    EXPECT_DIES(mgpu_tp_mlp_forward(m, X_elsewhere),
                "mgpu_tp_mlp_forward: X is on cpu#1; it must be on devices[0] (cpu)");
    EXPECT_DIES(mgpu_tp_mlp_forward(m, X_11), "mgpu_tp_mlp_forward: X has shape [6, 11]; it must be [N, 12]");
    mgpu_tp_mlp_forward(m, X);
    EXPECT_DIES(mgpu_tp_mlp_backward(m, dY_elsewhere),
                "mgpu_tp_mlp_backward: dY is on cpu#1; it must be on devices[0] (cpu)");
    EXPECT_DIES(mgpu_tp_mlp_backward(m, X), "mgpu_tp_mlp_backward: dY has shape [6, 12]; it must be [6, 10]");
    EXPECT_DIES(mgpu_tp_mlp_input_grad(m, -1), "mgpu_tp_mlp_input_grad: device -1 of a block over 2 devices");
    mgpu_synchronize_all();
    mgpu_tp_conv_free(c);
    mgpu_tp_mlp_free(m);
    mgpu_tensor *made[] = {w, b, x, x_elsewhere, x_4_channels, dy_short, A, a, B, B_15_rows, bo,
                           X, X_11, X_elsewhere, dY, dY_elsewhere};
    for (size_t i = 0; i < sizeof made / sizeof made[0]; i++) mgpu_free(made[i]);
}
#endif

TEST_MAIN()
