/* bench/pipeline.c: what pipelining buys (chapter 6's issue: 2 stages on
   2 CPU devices with m = 8 micro-batches at least 1.6 times naive model
   parallelism's throughput; the formula allows 2 (m / (m + p - 1)) =
   1.78).

   An MLP of 16 equal blocks [Linear(1024, 1024), ReLU] and a classifier
   Linear(1024, 10), on random inputs of 1024 features, cut into 2 stages
   of 8 blocks (or, with --stages 4, 4 stages of 4; the classifier with
   the last) on as many devices (CPU devices sharing the cores, or
   virtual devices of one GPU), batch B (default 2048: micro-batches of
   256 rows, where a core's matrix products run near their best; at 32
   rows they take about 1.6 times as long a row, which eats the overlap's
   gain). The stages are equal but for what the last does more (its first
   layer's input gradient, which the first stage's first layer does not
   need, the classifier and the loss): 16 blocks rather than 8 halve
   that difference, about 4% of a stage. Three pipelines of the same network
   take SGD steps in turn, step by step: naive model parallelism (m = 1),
   GPipe and 1F1B with m = 8; 2 untimed steps, then --steps timed each,
   each timed to every device's end. Then one traced step each gives the
   bubble. Prints the medians, the speed-ups over naive, the bubbles
   beside (p - 1) / (m + p - 1), then
       RESULT pipeline on=[cpu, cpu#1] stages=2 batch=256 micro_batches=8 naive_ms=... gpipe_ms=...
              one_f_one_b_ms=... gpipe_speedup=... one_f_one_b_speedup=... gpipe_bubble=... one_f_one_b_bubble=...
   (bench/pytorch/pipeline.py is PyTorch's side: the same model and cut,
   torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B.)

       ./bench/pipeline [--batch-size B] [--steps N] [--stages 2|4] [--cpu] */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"

enum { BLOCKS = 16, WIDTH = 1024, MICRO_BATCHES = 8 };

static mgpu_net *mlp(mgpu_device *dev) {
    mgpu_manual_seed(1);
    mgpu_net *net = mgpu_net_new(dev);
    for (int i = 0; i < BLOCKS; i++) {
        mgpu_net_add_linear(net, WIDTH, WIDTH);
        mgpu_net_add_relu(net);
    }
    mgpu_net_add_linear(net, WIDTH, 10);
    return net;
}

int main(int argc, char **argv) {
    mgpu_options o;
    memset(&o, 0, sizeof o);
    o.seed = 1;
    int steps = 10, stages = 2;
    const mgpu_flag extra[] = {
        {"--batch-size", 'i', &o.batch_size, "the batch (default 2048)"},
        {"--steps", 'i', &steps, "timed steps of each (default 10)"},
        {"--stages", 'i', &stages, "2 or 4 stages, on as many devices (default 2)"},
    };
    mgpu_options_parse(&o, argc, argv, "bench/pipeline: an MLP's steps in stages: naive, GPipe and 1F1B", extra,
                       (int)(sizeof extra / sizeof extra[0]));
    MGPU_REQUIRE(stages == 2 || stages == 4, "--stages %d: 2 or 4", stages);
    int batch = o.batch_size ? o.batch_size : 2048;
    MGPU_REQUIRE(batch >= MICRO_BATCHES, "--batch-size %d: at least %d", batch, MICRO_BATCHES);
    mgpu_device *devs[4];
    mgpu_devices(stages, !o.cpu, devs);
    mgpu_manual_seed(7);
    mgpu_tensor *x = mgpu_randn(mgpu_cpu(), mgpu_shape2(batch, WIDTH), 0.0f, 1.0f);
    float *labels = (float *)malloc(sizeof(float) * (size_t)batch);
    for (int i = 0; i < batch; i++) labels[i] = (float)(i % 10);
    mgpu_tensor *y = mgpu_from_host(mgpu_cpu(), mgpu_shape1(batch), labels);
    free(labels);
    static const char *names[3] = {"naive", "GPipe", "1F1B"};
    mgpu_schedule_fn schedules[3] = {mgpu_schedule_gpipe, mgpu_schedule_gpipe, mgpu_schedule_1f1b};
    int first[4] = {0};
    for (int s = 1; s < stages; s++) first[s] = 2 * (s * BLOCKS / stages); /* (a linear layer and its ReLU each) */
    mgpu_net *nets[3];
    mgpu_pipeline *pipes[3];
    double *ms[3], median[3], bubble[3];
    for (int k = 0; k < 3; k++) {
        nets[k] = mlp(devs[0]);
        pipes[k] = mgpu_pipeline_new(nets[k], devs, stages, first);
        mgpu_pipeline_set_schedule(pipes[k], schedules[k], k == 0 ? 1 : MICRO_BATCHES);
        ms[k] = (double *)malloc(sizeof(double) * (size_t)steps);
    }
    for (int s = -2; s < steps; s++)
        for (int k = 0; k < 3; k++) {
            mgpu_synchronize_all();
            double start = mgpu_now();
            mgpu_pipeline_train_step(pipes[k], x, y, 0.01f, 0.0f, 0.0f, NULL);
            mgpu_synchronize_all();
            if (s >= 0) ms[k][s] = 1e3 * (mgpu_now() - start);
        }
    for (int k = 0; k < 3; k++) {
        median[k] = mgpu_median(ms[k], steps);
        mgpu_trace_begin();
        mgpu_pipeline_forward_backward(pipes[k], x, y, NULL);
        mgpu_trace_end();
        bubble[k] = mgpu_pipeline_measure(pipes[k]).bubble_mean;
    }
    char on[128];
    mgpu_device_list(on, sizeof on, devs, stages);
    printf("An MLP of %d blocks of %d features in %d stages on %s, batch %d, median of %d steps:\n", BLOCKS, WIDTH,
           stages, on, batch, steps);
    printf("  %-6s %3s %10s %10s %8s %8s\n", "", "m", "ms a step", "speed-up", "bubble", "formula");
    for (int k = 0; k < 3; k++) {
        int m = k == 0 ? 1 : MICRO_BATCHES;
        printf("  %-6s %3d %10.2f %9.3fx %8.3f %8.3f\n", names[k], m, median[k], median[0] / median[k], bubble[k],
               mgpu_pipeline_bubble_formula(stages, m));
    }
    printf("RESULT pipeline on=%s stages=%d batch=%d micro_batches=%d naive_ms=%.3f gpipe_ms=%.3f one_f_one_b_ms=%.3f "
           "gpipe_speedup=%.4f one_f_one_b_speedup=%.4f gpipe_bubble=%.4f one_f_one_b_bubble=%.4f\n",
           on, stages, batch, MICRO_BATCHES, median[0], median[1], median[2], median[0] / median[1],
           median[0] / median[2], bubble[1], bubble[2]);
    for (int k = 0; k < 3; k++) {
        mgpu_pipeline_free(pipes[k]);
        mgpu_net_free(nets[k]);
        free(ms[k]);
    }
    mgpu_free(x);
    mgpu_free(y);
    return 0;
}
