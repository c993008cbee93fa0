/* bench/zero.c: what ZeRO costs (chapter 5's issue: a ZeRO-2 step at
   most 1.1 times plain data parallelism's on the same devices; issue
   52: a ZeRO-3 step at most 1.3 times on the CPU).

   ResNet-18 with Adam on 2 devices (virtual ones of one GPU, or CPU
   devices sharing the cores), batch B (default 16 a device on a CPU, 128
   on a GPU), random 1x28x28 images, behind three wrappers of chapter 3:
   DDP's allreduce, ZeRO-1, ZeRO-2 and ZeRO-3 (mgpu_data_parallel_zero;
   ZeRO-3's units are the wrapper's 25 MiB buckets). They take
   their steps in turn, step by step, 2 untimed and then --steps timed
   each, each timed to every device's end. Prints the medians, the ratios
   to DDP's and the optimizer state a device holds, then
       RESULT zero on=[cpu, cpu#1] batch=32 ddp_ms=... zero1_ms=... zero2_ms=... zero3_ms=... zero1_ratio=...
              zero2_ratio=... zero3_ratio=...

       ./bench/zero [--batch-size B] [--steps N] [--cpu] */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"

int main(int argc, char **argv) {
    mgpu_options o;
    memset(&o, 0, sizeof o);
    o.seed = 1;
    int steps = 10;
    const mgpu_flag extra[] = {
        {"--batch-size", 'i', &o.batch_size, "the batch a device (default 16 on a CPU, 128 on a GPU)"},
        {"--steps", 'i', &steps, "timed steps of each (default 10)"},
    };
    mgpu_options_parse(&o, argc, argv, "bench/zero: ResNet-18 steps under DDP and ZeRO-1, 2 and 3 on 2 devices",
                       extra, (int)(sizeof extra / sizeof extra[0]));
    mgpu_device *devs[2];
    mgpu_devices(2, !o.cpu, devs);
    int per_device = o.batch_size ? o.batch_size : mgpu_device_is_gpu(devs[0]) ? 128 : 16;
    mgpu_manual_seed(7);
    mgpu_tensor *x = mgpu_randn(mgpu_cpu(), mgpu_shape4(2 * per_device, 1, 28, 28), 0.0f, 1.0f);
    float *labels = (float *)malloc(sizeof(float) * 2 * (size_t)per_device);
    for (int i = 0; i < 2 * per_device; i++) labels[i] = (float)(i % 10);
    mgpu_tensor *y = mgpu_from_host(mgpu_cpu(), mgpu_shape1(2 * per_device), labels);
    free(labels);
    mgpu_net *nets[4];
    mgpu_data_parallel *dps[4];
    for (int k = 0; k < 4; k++) {
        mgpu_manual_seed(1);
        nets[k] = mgpu_resnet18(10, 1, devs[0]);
        mgpu_net_use_adam(nets[k], 0.9f, 0.999f, 1e-8f, 0);
        dps[k] = mgpu_data_parallel_new(nets[k], devs, 2, MGPU_DP_ALLREDUCE);
        mgpu_data_parallel_zero(dps[k], k);
    }
    double *ms[4];
    for (int k = 0; k < 4; k++) ms[k] = (double *)malloc(sizeof(double) * (size_t)steps);
    for (int s = -2; s < steps; s++)
        for (int k = 0; k < 4; k++) {
            mgpu_synchronize_all();
            double start = mgpu_now();
            mgpu_data_parallel_step(dps[k], x, y, 0.001f, 0.0f, 0.0f);
            mgpu_synchronize_all();
            if (s >= 0) ms[k][s] = 1e3 * (mgpu_now() - start);
        }
    double median[4];
    for (int k = 0; k < 4; k++) median[k] = mgpu_median(ms[k], steps);
    char on[64];
    mgpu_device_list(on, sizeof on, devs, 2);
    printf("ResNet-18 with Adam on %s, batch %d, median of %d: DDP %.2f ms (%s), ZeRO-1 %.2f ms (%.3fx), "
           "ZeRO-2 %.2f ms (%.3fx, %s), ZeRO-3 %.2f ms (%.3fx)\n", on, 2 * per_device, steps, median[0],
           mgpu_data_parallel_algorithm(dps[0]), median[1], median[1] / median[0], median[2], median[2] / median[0],
           mgpu_data_parallel_algorithm(dps[2]), median[3], median[3] / median[0]);
    printf("RESULT zero on=%s batch=%d ddp_ms=%.3f zero1_ms=%.3f zero2_ms=%.3f zero3_ms=%.3f zero1_ratio=%.4f "
           "zero2_ratio=%.4f zero3_ratio=%.4f\n", on, 2 * per_device, median[0], median[1], median[2], median[3],
           median[1] / median[0], median[2] / median[0], median[3] / median[0]);
    for (int k = 0; k < 4; k++) {
        mgpu_data_parallel_free(dps[k]);
        mgpu_net_free(nets[k]);
        free(ms[k]);
    }
    mgpu_free(x);
    mgpu_free(y);
    return 0;
}
