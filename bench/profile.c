/* bench/profile.c: where does the time of a ResNet-18 training step go?

   make bench/profile && ./bench/profile [--batch-size N] [--steps N] [--cpu]
                                         [--convolutions-copy] [--weights-copy]
                                         [--scratch-mb N]

   One device, chapter 3's network and step (mgpu_data_parallel on one
   device: forward, backward, SGD), on one Fashion-MNIST batch of 256 (32
   on the CPU, chapter 3's reduced setting) used for every step. First the
   step is timed untraced (one warm-up step, then `steps` steps between two
   synchronisations). Then the same steps run under the tracer and
   mgpu_trace_summary prints the profile: per operation, how many times
   it ran, its total and mean time, and its share. On a GPU the times come
   from CUDA events recorded around every operation, so the traced steps
   are a little slower than the untraced ones; the shares are what
   matter. This is the table to read before tuning anything: products
   (conv2d product, the dW and dcol products) against data movement
   (im2col, col2im, layout) against batch norm and the rest.

   --convolutions-copy: the convolutions make their channels-last copies
   of x and dy themselves, as before batch norm wrote them (mgpu.h,
   "channels-last"), to measure what that saves; --weights-copy: each
   convolution copies its weights at each pass, as before the network
   kept the copies and remade them all in a few launches.

   The last line is for bench/run.sh, which turns the step time into
   TFLOP/s with the network's FLOP count:
       RESULT profile on=[cuda:0] batch=256 step_ms=... traced_step_ms=... */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"

int main(int argc, char **argv) {
    mgpu_options o;
    memset(&o, 0, sizeof o);
    int steps = 0, convolutions_copy = 0, weights_copy = 0, scratch_mb = 0;
    const mgpu_flag extra[] = {
        {"--steps", 'i', &steps, "steps timed, then traced (default 20 on a GPU, 3 on the CPU)"},
        {"--convolutions-copy", 'b', &convolutions_copy,
         "the convolutions copy x and dy to channels-last, not batch norm"},
        {"--weights-copy", 'b', &weights_copy, "each convolution copies its weights at each pass"},
        {"--scratch-mb", 'i', &scratch_mb,
         "the im2col scratch of a convolution, in MiB (the library's: 4 on the CPU, 256 on a GPU)"},
    };
    mgpu_options_parse(&o, argc, argv,
                       "bench/profile: the time of a ResNet-18 training step, and where it goes",
                       extra, 4);
    if (scratch_mb) { /* (the library's setting for both kinds of device) */
        MGPU_REQUIRE(scratch_mb <= 65536, "--scratch-mb %d: at most 65536", scratch_mb);
        mgpu__conv_scratch_floats[0] = mgpu__conv_scratch_floats[1] = (size_t)scratch_mb << 18;
    }
    mgpu__batch_norm_writes_channels_last = !convolutions_copy;
    mgpu__network_keeps_weight_copies = !weights_copy;
    mgpu_device *dev[1];
    mgpu_devices(1, !o.cpu, dev);
    int on_gpu = mgpu_device_is_gpu(dev[0]);
    int batch = o.batch_size ? o.batch_size : on_gpu ? 256 : 32;
    if (!steps) steps = on_gpu ? 20 : 3;

    mgpu_dataset *train = NULL;
    mgpu_dataset_load_fashion_mnist(mgpu_data_dir(o.data), &train, NULL);
    mgpu_loader *loader = mgpu_loader_new(train, batch, 0, 0);
    mgpu_loader_start_epoch(loader, 0);
    mgpu_batch b;
    MGPU_REQUIRE(mgpu_loader_next(loader, &b), "bench/profile: no training batch");

    mgpu_manual_seed(1);
    mgpu_net *net = mgpu_resnet18(10, 1, dev[0]);
    mgpu_data_parallel *dp = mgpu_data_parallel_new(net, dev, 1, MGPU_DP_ALLREDUCE);
    mgpu_data_parallel_step(dp, b.x, b.y, 0.01f, 0.0f, 0.0f); /* warm-up: caches, cuBLAS, the trials */
    double ms[2];
    for (int traced = 0; traced <= 1; traced++) {
        mgpu_synchronize_all();
        if (traced) mgpu_trace_begin();
        double t0 = mgpu_now();
        for (int s = 0; s < steps; s++) mgpu_data_parallel_step(dp, b.x, b.y, 0.01f, 0.0f, 0.0f);
        mgpu_synchronize_all();
        ms[traced] = (mgpu_now() - t0) * 1e3 / steps;
        if (traced) mgpu_trace_end();
    }

    printf("ResNet-18 training step on [%s], batch %d: %.3f ms (mean of %d steps; %.3f ms "
           "traced)\n", mgpu_device_name(dev[0]), batch, ms[0], steps, ms[1]);
    if (on_gpu) printf("GPU arithmetic: %s\n", mgpu_tf32_str());
    printf("profile of the %d traced steps:\n", steps);
    mgpu_trace_summary(stdout);
#if MGPU_CUDA
    if (mgpu__conv_choice_count) printf("the convolutions' plans, measured at the first step:\n");
    for (int i = 0; i < mgpu__conv_choice_count; i++) {
        char plan[160];
        printf("  %s\n", mgpu__conv_choice_str(&mgpu__conv_choices[i], plan, sizeof plan));
    }
#endif
    if (mgpu__cpu_conv_choice_count) printf("the CPU convolutions' ways, timed at the first step:\n");
    for (int i = 0; i < mgpu__cpu_conv_choice_count; i++) {
        char way[200];
        printf("  %s\n", mgpu__cpu_conv_choice_str(&mgpu__cpu_conv_choices[i], way, sizeof way));
    }
    printf("RESULT profile on=[%s] batch=%d step_ms=%.4f traced_step_ms=%.4f\n",
           mgpu_device_name(dev[0]), batch, ms[0], ms[1]);

    mgpu_data_parallel_free(dp);
    mgpu_net_free(net);
    mgpu_loader_free(loader);
    mgpu_dataset_free(train);
    return 0;
}
