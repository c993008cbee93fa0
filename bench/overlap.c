/* bench/overlap.c: what does combining the gradients cost a training step,
   with and without overlapping it with the backward pass?

   make bench/overlap && ./bench/overlap [--batch-size N] [--steps N] [--trials N] [--cpu]

   One ResNet-18 training step on 2 devices (virtual ones when the machine
   has one GPU or none) through mgpu_data_parallel in allreduce mode, three
   ways (mgpu_data_parallel_configure):
     no reduction    the gradients are not combined at all: the step's
                     compute alone (the replicas drift apart, which does
                     not matter to a timing);
     after backward  the gradient buckets are reduced once the whole
                     backward pass is done;
     overlapped      each bucket (25 MiB) is reduced on the communication
                     queues as soon as the backward pass has produced it,
                     while the backward of the earlier layers goes on (the
                     default, as PyTorch's DDP).
   The batch is chapter 3's for 2 devices: 512 (256 per device) on a GPU,
   64 (32 per device, chapter 3's reduced setting) on the CPU; the same
   Fashion-MNIST batch every step.

   Each way gets its own network and one untimed warm-up step (buckets,
   caches). Then each trial times `steps` steps of each way in turn (a
   busy moment of the machine hits all three alike), from one
   synchronisation to the next; the fastest trial of each way is kept.
       overlapped / no reduction        target: at most 1.05 (issue 5)
       after backward / no reduction    what the overlap saves
   The last line is for bench/run.sh:
       RESULT overlap batch=512 algorithm=ring none_ms=... after_ms=... overlapped_ms=... ratio=... */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"

#define NWAYS 3
typedef struct {
    const char *name;
    int overlap, reduce; /* for mgpu_data_parallel_configure */
} way;
static const way ways[NWAYS] = {{"no reduction", 1, 0}, {"after backward", 0, 1}, {"overlapped", 1, 1}};

int main(int argc, char **argv) {
    mgpu_options o;
    memset(&o, 0, sizeof o);
    int steps = 0, trials = 0;
    const mgpu_flag extra[] = {
        {"--steps", 'i', &steps, "timed steps per trial (default 20 on a GPU, 2 on the CPU)"},
        {"--trials", 'i', &trials, "trials of each way; the fastest is kept (default 3 on a GPU, 2 on the CPU)"},
    };
    mgpu_options_parse(&o, argc, argv,
                       "bench/overlap: a ResNet-18 step on 2 devices without gradient reduction, with "
                       "it after backward, and overlapped with backward",
                       extra, 2);
    mgpu_device *dev[2];
    mgpu_devices(2, !o.cpu, dev);
    int on_gpu = mgpu_device_is_gpu(dev[0]);
    int batch = o.batch_size ? o.batch_size : on_gpu ? 512 : 64;
    if (!steps) steps = on_gpu ? 20 : 2;
    if (!trials) trials = on_gpu ? 3 : 2;

    mgpu_dataset *train = NULL;
    mgpu_dataset_load_fashion_mnist(mgpu_data_dir(o.data), &train, NULL);
    mgpu_loader *loader = mgpu_loader_new(train, batch, 0, 0);
    mgpu_loader_start_epoch(loader, 0);
    mgpu_batch b;
    MGPU_REQUIRE(mgpu_loader_next(loader, &b), "bench/overlap: no training batch");

    mgpu_net *net[NWAYS];
    mgpu_data_parallel *dp[NWAYS];
    for (int w = 0; w < NWAYS; w++) {
        mgpu_manual_seed(1);
        net[w] = mgpu_resnet18(10, 1, dev[0]);
        dp[w] = mgpu_data_parallel_new(net[w], dev, 2, MGPU_DP_ALLREDUCE);
        mgpu_data_parallel_configure(dp[w], 25u << 20, ways[w].overlap, ways[w].reduce);
        mgpu_data_parallel_step(dp[w], b.x, b.y, 0.01f, 0.0f, 0.0f); /* warm-up */
    }
    double best[NWAYS];
    for (int w = 0; w < NWAYS; w++) best[w] = 1e30;
    for (int t = 0; t < trials; t++)
        for (int w = 0; w < NWAYS; w++) {
            mgpu_synchronize_all();
            double t0 = mgpu_now();
            for (int s = 0; s < steps; s++) mgpu_data_parallel_step(dp[w], b.x, b.y, 0.01f, 0.0f, 0.0f);
            mgpu_synchronize_all();
            best[w] = fmin(best[w], (mgpu_now() - t0) / steps);
        }

    char list[128];
    mgpu_device_list(list, sizeof list, dev, 2);
    const char *algorithm = mgpu_data_parallel_algorithm(dp[2]);
    printf("ResNet-18 step on %s, batch %d (%d per device), gradients by %s; %d steps per trial, "
           "fastest of %d trials\n", list, batch, (batch + 1) / 2, algorithm, steps, trials);
    for (int w = 0; w < NWAYS; w++)
        printf("  %-16s %9.2f ms per step  %5.3f of no reduction\n", ways[w].name, best[w] * 1e3,
               best[w] / best[0]);
    printf("  overlapped / no reduction: %.3f (target: at most 1.05)\n", best[2] / best[0]);
    printf("RESULT overlap batch=%d algorithm=%s none_ms=%.3f after_ms=%.3f overlapped_ms=%.3f "
           "ratio=%.4f\n", batch, algorithm, best[0] * 1e3, best[1] * 1e3, best[2] * 1e3,
           best[2] / best[0]);

    for (int w = 0; w < NWAYS; w++) {
        mgpu_data_parallel_free(dp[w]);
        mgpu_net_free(net[w]);
    }
    mgpu_loader_free(loader);
    mgpu_dataset_free(train);
    return 0;
}
