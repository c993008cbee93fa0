/* tests/assignments/check_checkpoint.c: the checker of the gradient-
   checkpointing assignment (docs/assignments.md). Built with the
   student's file by
       make check-assignment NAME=checkpoint FILE=student.c
   which must define
       void checkpointed_pass(mgpu_net **runs, int k, const mgpu_tensor *x,
                              const mgpu_tensor *labels);
   one training pass, forward and backward, through a network cut into k
   runs, keeping only the runs' outputs between the two passes. The same
   network whole, with the library's plain pass, is the answer. */
#include "mgpu.h"
#include "tests/test.h"
#include STUDENT_FILE

/* The network: a convolution, batch norm (with its ReLU), three residual
   blocks, pooling and a linear layer: 7 layers, built whole or cut in k
   runs at layers s n / k, with the same weights (drawn in the same order). */
#define LAYERS 7
static void add_layer(mgpu_net *net, int i) {
    switch (i) {
    case 0: mgpu_net_add_conv(net, 1, 8, 3, 1, 1); break;
    case 1: mgpu_net_add_batchnorm(net, 8); mgpu_net_add_relu(net); break;
    case 2: mgpu_net_add_residual(net, 8, 8, 1); break;
    case 3: mgpu_net_add_residual(net, 8, 16, 2); break;
    case 4: mgpu_net_add_residual(net, 16, 16, 1); break;
    case 5: mgpu_net_add_global_avg_pool(net); break;
    default: mgpu_net_add_linear(net, 16, 10); break;
    }
}
static mgpu_net *whole(void) {
    mgpu_manual_seed(5);
    mgpu_net *net = mgpu_net_new(mgpu_cpu());
    for (int i = 0; i < LAYERS; i++) add_layer(net, i);
    return net;
}
static void cut(int k, mgpu_net **runs) {
    mgpu_manual_seed(5);
    for (int s = 0; s < k; s++) {
        runs[s] = mgpu_net_new(mgpu_cpu());
        for (int i = s * LAYERS / k; i < (s + 1) * LAYERS / k; i++) add_layer(runs[s], i);
    }
}

static mgpu_tensor *x, *labels;

/* The plain pass of the whole network, and the student's of its k runs:
   the first `shown` differences said, the count of parameters (or with
   buffers, running statistics) whose bits differ returned. */
static int differences(int k, int buffers, double *plain_peak, double *yours_peak) {
    mgpu_net *net = whole(), *runs[LAYERS];
    cut(k, runs);
    mgpu_device *d = mgpu_cpu();
    mgpu_net_zero_grad(net);
    for (int s = 0; s < k; s++) mgpu_net_zero_grad(runs[s]);
    mgpu_synchronize(d);
    double base = (double)mgpu_device_memory_of(d, MGPU_MEMORY_ACTIVATIONS);
    mgpu_device_reset_peak(d);
    mgpu_tensor *logits = mgpu_net_forward(net, x);
    mgpu_net_loss_backward(net, logits, labels, 1.0f / (float)x->shape.d[0], NULL);
    mgpu_synchronize(d);
    if (plain_peak) *plain_peak = (double)mgpu_device_memory_peak_of(d, MGPU_MEMORY_ACTIVATIONS) - base;
    mgpu_net_free_activations(net); /* (the student's peak without the plain pass's) */
    mgpu_synchronize(d);
    base = (double)mgpu_device_memory_of(d, MGPU_MEMORY_ACTIVATIONS);
    mgpu_device_reset_peak(d);
    checkpointed_pass(runs, k, x, labels);
    mgpu_synchronize(d);
    if (yours_peak) *yours_peak = (double)mgpu_device_memory_peak_of(d, MGPU_MEMORY_ACTIVATIONS) - base;
    int differ = 0, p = 0, b = 0;
    for (int s = 0; s < k; s++) {
        int n = buffers ? mgpu_net_num_buffers(runs[s]) : mgpu_net_num_params(runs[s]);
        for (int i = 0; i < n; i++, buffers ? b++ : p++) {
            const mgpu_tensor *mine = buffers ? mgpu_net_buffer(runs[s], i) : mgpu_net_param(runs[s], i)->grad;
            const mgpu_tensor *want = buffers ? mgpu_net_buffer(net, b) : mgpu_net_param(net, p)->grad;
            if (!test_same_bits(mine, want)) {
                if (differ++ < 3)
                    printf("  %d runs: run %d's %s %d is not the plain pass's (first value %g, want %g)\n", k, s,
                           buffers ? "running statistic" : "gradient", i, mgpu_item(mine, 0), mgpu_item(want, 0));
            }
        }
    }
    mgpu_net_free(net);
    for (int s = 0; s < k; s++) mgpu_net_free(runs[s]);
    return differ;
}

/* Every parameter's gradient, bit for bit the plain pass's, for 2 and 3
   runs (the same operations on the same numbers). (The runs are cut
   after a batch norm or a block: a convolution right before a batch norm
   writes its bias gradient as the exact 0 that the batch mean makes it,
   which a convolution at a run's end cannot know.) */
TEST(gradients_are_the_plain_ones) {
    for (int k = 2; k <= 3; k++) CHECK(differences(k, 0, NULL, NULL) == 0);
}

/* Batch norm's running statistics moved once, as by the plain pass (a
   second forward pass that keeps them moving would move them again:
   PyTorch's checkpoint does, unless told not to). */
TEST(running_statistics_move_once) {
    for (int k = 2; k <= 3; k++) CHECK(differences(k, 1, NULL, NULL) == 0);
}

/* The activations held at their peak: at most 0.75 of the plain pass's
   with 3 runs (the first run's are freed before the rest are made; about
   0.6 where they go). */
TEST(activations_are_freed_between_the_passes) {
    double plain, yours;
    differences(3, 0, &plain, &yours);
    printf("  peak activations: plain %.1f KiB, yours with 3 runs %.1f KiB\n", plain / 1024, yours / 1024);
    CHECK(yours <= 0.75 * plain);
}

int main(int argc, char **argv) {
    setenv("MGPU_CONV", "im2col", 1); /* (one method: the bits do not depend on a trial) */
    mgpu_manual_seed(9);
    x = mgpu_randn(mgpu_cpu(), mgpu_shape4(8, 1, 12, 12), 0.0f, 1.0f);
    float y[8];
    for (int i = 0; i < 8; i++) y[i] = (float)(i * 3 % 10);
    labels = mgpu_from_host(mgpu_cpu(), mgpu_shape1(8), y);
    return test__run_all(argc, argv);
}
