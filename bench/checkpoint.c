/* bench/checkpoint.c: what gradient checkpointing costs (chapter 5's
   issue: at about sqrt(n) runs, a step at most 1.4 times the plain one).

   A ResNet-18 training step (SGD, momentum 0.9) on one device at batch B
   (default 32 on a CPU, 256 on a GPU), random 1x28x28 images, its 12
   layers (stem convolution, batch norm with its ReLU, 8 residual blocks,
   pooling, linear) plain and in about sqrt(12) = 3 checkpointed runs
   (mgpu_net_recompute). The two networks take their steps in turn, step
   by step, 2 untimed and then --steps timed each, so that a machine's
   changing load falls on both alike. Each step is timed to the device's
   end (mgpu_synchronize). Then each network alone on the device takes
   a step more for its peak activations. Prints the medians, their ratio
   and the peaks, then a line for bench/run.sh:
       RESULT checkpoint on=[cpu] batch=32 runs=3 plain_ms=... checkpointed_ms=... ratio=...
              plain_act_mib=... checkpointed_act_mib=...
   bench/pytorch/checkpoint.py times PyTorch's checkpoint_sequential on
   the same model and cut.

       ./bench/checkpoint [--batch-size B] [--steps N] [--cpu] */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"

static mgpu_net *resnet(mgpu_device *dev, int checkpointed) {
    mgpu_manual_seed(1);
    mgpu_net *net = mgpu_resnet18(10, 1, dev);
    mgpu_net_recompute(net, checkpointed ? MGPU_SEGMENTS_SQRT : 1);
    return net;
}

int main(int argc, char **argv) {
    mgpu_options o;
    memset(&o, 0, sizeof o);
    o.seed = 1;
    int steps = 10;
    const mgpu_flag extra[] = {
        {"--batch-size", 'i', &o.batch_size, "the batch (default 32 on a CPU, 256 on a GPU)"},
        {"--steps", 'i', &steps, "timed steps of each (default 10)"},
    };
    mgpu_options_parse(&o, argc, argv, "bench/checkpoint: a ResNet-18 step with and without checkpointing",
                       extra, (int)(sizeof extra / sizeof extra[0]));
    mgpu_device *dev = o.cpu ? mgpu_cpu() : mgpu_try_gpu(0);
    int batch = o.batch_size ? o.batch_size : mgpu_device_is_gpu(dev) ? 256 : 32;
    mgpu_manual_seed(7);
    mgpu_tensor *x = mgpu_randn(dev, mgpu_shape4(batch, 1, 28, 28), 0.0f, 1.0f);
    float *labels = (float *)malloc(sizeof(float) * (size_t)batch);
    for (int i = 0; i < batch; i++) labels[i] = (float)(i % 10);
    mgpu_tensor *y = mgpu_from_host(dev, mgpu_shape1(batch), labels);
    free(labels);
    mgpu_net *nets[2];
    for (int k = 0; k < 2; k++) nets[k] = resnet(dev, k);
    double *ms[2] = {(double *)malloc(sizeof(double) * (size_t)steps), (double *)malloc(sizeof(double) * (size_t)steps)};
    for (int s = -2; s < steps; s++)
        for (int k = 0; k < 2; k++) {
            mgpu_synchronize(dev);
            double start = mgpu_now();
            mgpu_net_train_step(nets[k], x, y, 0.01f, 0.9f, 0.0f, NULL);
            mgpu_synchronize(dev);
            if (s >= 0) ms[k][s] = 1e3 * (mgpu_now() - start);
        }
    int runs = nets[1]->nsegments;
    double activations[2];
    for (int k = 0; k < 2; k++) mgpu_net_free(nets[k]);
    for (int k = 0; k < 2; k++) { /* (alone: the other's activations are not in the device's) */
        mgpu_net *net = resnet(dev, k);
        mgpu_net_train_step(net, x, y, 0.01f, 0.9f, 0.0f, NULL);
        mgpu_synchronize(dev);
        mgpu_device_reset_peak(dev);
        mgpu_net_train_step(net, x, y, 0.01f, 0.9f, 0.0f, NULL);
        mgpu_synchronize(dev);
        activations[k] = mgpu_device_memory_peak_of(dev, MGPU_MEMORY_ACTIVATIONS) / 1048576.0;
        mgpu_net_free(net);
    }
    double median[2];
    for (int k = 0; k < 2; k++) median[k] = mgpu_median(ms[k], steps);
    printf("ResNet-18 step on %s, batch %d, median of %d: plain %.2f ms (activations %.1f MiB), "
           "%d checkpointed runs %.2f ms (activations %.1f MiB): %.3fx the time, %.2fx the activations\n",
           mgpu_device_name(dev), batch, steps, median[0], activations[0], runs, median[1],
           activations[1], median[1] / median[0], activations[1] / activations[0]);
    printf("RESULT checkpoint on=[%s] batch=%d runs=%d plain_ms=%.3f checkpointed_ms=%.3f ratio=%.4f "
           "plain_act_mib=%.1f checkpointed_act_mib=%.1f\n", mgpu_device_name(dev), batch, runs,
           median[0], median[1], median[1] / median[0], activations[0], activations[1]);
    for (int k = 0; k < 2; k++) free(ms[k]);
    mgpu_free(x);
    mgpu_free(y);
    return 0;
}
