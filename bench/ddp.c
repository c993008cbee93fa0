/* bench/ddp.c: what does a training step of the distributed data-parallel
   wrapper (mgpu_distributed_data_parallel_new) cost, on one process and
   on several, and what does the gradients' reduction add to it?

   make bench/ddp
   mpirun -np 2 ./bench/ddp [--model lenet|resnet18] [--batch-size N] [--steps N]
                            [--warmup N] [--reduce WAY[,WAY...]|all] [--adam]
   ./bench/ddp ...                       one process (a group of one)
   ./bench/ddp --devices 2 ...           one process, 2 devices: chapter 3's wrapper

   The models: chapter 2's LeNet (conv 1->20 3x3, ReLU, avg-pool 2, conv
   20->50 5x5, ReLU, avg-pool 2, linear 800->128, ReLU, linear 128->10) or
   chapter 3's ResNet-18 (mgpu_resnet18(10, 1, dev)), on 1x28x28 images.
   --batch-size is the batch of one replica: each process's share of the
   global batch, or each device's with --devices (default 256 for LeNet,
   32 for ResNet-18). The data are random images and labels drawn once
   (seeded, another draw on each rank): a step's time does not depend on
   the values.

   Ways of combining the gradients (mgpu_data_parallel_configure):
     overlapped  each 25 MiB bucket is averaged over the ranks as soon as
                 the backward pass has produced it (the default, as DDP);
     after       the buckets are averaged once the whole backward is done;
     none        no reduction (the replicas drift apart: no matter to a
                 timing); the step's compute alone;
     zero3       fully sharded (mgpu_data_parallel_zero(dp, 3)): each
                 rank keeps 1/procs of the parameters, gradients and
                 optimizer state; a bucket's values are gathered before
                 its layers run, its gradients reduce-scattered (the
                 ZeRO-3 step beside PyTorch's fully_shard,
                 bench/pytorch/fsdp.py).
   --reduce takes one way or several (overlapped,zero3); all is the first
   three. Each way gets a wrapper of its own, and they are timed in turn,
   step by step (the first of each turn rotating), so that a busy moment
   of the machine hits them alike. --adam: Adam (lr 0.001) in place of
   SGD.

   A step, as timed: mgpu_data_parallel_step (the batch's shards copied to
   the devices, forward, loss, backward, the reduction, SGD with lr 0.01
   or Adam),
   then mgpu_synchronize_all and a barrier of the group, so that the step
   is over on every rank. Each way gets --warmup untimed steps (buckets,
   caches, the convolutions' trials), then --steps timed ones; a step's
   time is the longest over the ranks (all gathered at the end), and the
   median over the steps is reported, with the fastest. One line a way:
       RESULT ddp model=lenet procs=2 devices=1 batch=256 global_batch=512 reduce=overlapped
              algorithm=mpi steps=20 step_ms=... min_ms=... images_per_s=...
   (one line; images_per_s is the global batch over the median step). */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"

#define NWAYS 4
typedef struct {
    const char *name;
    int overlap, reduce; /* for mgpu_data_parallel_configure */
    int zero;            /* ZeRO's stage (mgpu_data_parallel_zero), 0: none */
} way;
static const way ways[NWAYS] = {{"overlapped", 1, 1, 0}, {"after", 0, 1, 0}, {"none", 1, 0, 0}, {"zero3", 1, 1, 3}};

int main(int argc, char **argv) {
    mgpu_group *world = mgpu_dist_init(&argc, &argv);
    int rank = mgpu_group_rank(world), procs = mgpu_group_size(world);

    mgpu_options o;
    memset(&o, 0, sizeof o);
    o.devices = 1;
    o.seed = 1;
    int steps = 10, warmup = 2;
    const char *model = "lenet", *reduce = "overlapped";
    int adam = 0;
    const mgpu_flag extra[] = {
        {"--model", 's', &model, "lenet (chapter 2's) or resnet18 (chapter 3's)"},
        {"--batch-size", 'i', &o.batch_size,
         "batch of one process (one device with --devices); default 256 for lenet, 32 for resnet18"},
        {"--steps", 'i', &steps, "timed steps of each way (default 10)"},
        {"--warmup", 'u', &warmup, "untimed steps first (default 2)"},
        {"--reduce", 's', &reduce,
         "overlapped, after, none, zero3, several of them (overlapped,zero3), or all: the first three "
         "(default overlapped)"},
        {"--adam", 'b', &adam, "Adam (lr 0.001) in place of SGD (lr 0.01)"},
        {"--devices", 'i', &o.devices,
         "devices of one process: 2 or more times chapter 3's wrapper instead (not under mpirun)"},
        {"--epochs", 'n', NULL, "--epochs: bench/ddp times steps (--steps)"},
        {"--lr", 'n', NULL, "--lr: bench/ddp's SGD has lr 0.01"},
    };
    mgpu_options_parse(&o, argc, argv,
                       "bench/ddp: a training step of the distributed data-parallel wrapper (run it under "
                       "mpirun), or of chapter 3's wrapper on --devices of one process",
                       extra, (int)(sizeof extra / sizeof extra[0]));
    int is_resnet = strcmp(model, "resnet18") == 0;
    MGPU_REQUIRE(is_resnet || strcmp(model, "lenet") == 0, "--model: lenet or resnet18, got '%s'", model);
    /* the ways asked for: a list, a comma between, or all (the first three) */
    int chosen[NWAYS], nways = 0;
    char names[128];
    snprintf(names, sizeof names, "%s", strcmp(reduce, "all") == 0 ? "overlapped,after,none" : reduce);
    for (char *save = NULL, *name = strtok_r(names, ",", &save); name; name = strtok_r(NULL, ",", &save)) {
        int w = 0;
        while (w < NWAYS && strcmp(ways[w].name, name) != 0) w++;
        for (int k = 0; k < nways && w < NWAYS; k++)
            if (chosen[k] == w) w = NWAYS; /* (each way once) */
        MGPU_REQUIRE(w < NWAYS, "--reduce %s: want overlapped, after, none or zero3, each once (a comma "
                     "between), or all", reduce);
        chosen[nways++] = w;
    }
    MGPU_REQUIRE(nways > 0, "--reduce: empty; want overlapped, after, none or zero3, or all");
    MGPU_REQUIRE(o.devices == 1 || procs == 1,
                 "--devices %d: one process with several devices, or several processes with one each "
                 "(this is rank %d of %d)", o.devices, rank, procs);
    int batch = o.batch_size ? o.batch_size : is_resnet ? 32 : 256;
    int replicas = procs * o.devices, global_batch = batch * replicas;

    /* Each process's devices (their share of the cores): one a process,
       or the devices of one process (a group of one: chapter 3's wrapper). */
    mgpu_device *devs[MGPU_MAX_DEVICES];
    mgpu_group_devices(world, !o.cpu, o.devices, devs);

    /* This process's batch: a replica's share for each of its devices. */
    int local = batch * o.devices;
    mgpu_manual_seed(o.seed * 1000 + (uint64_t)rank);
    mgpu_tensor *x = mgpu_rand(mgpu_cpu(), mgpu_shape4(local, 1, 28, 28));
    float *labels = (float *)malloc(sizeof(float) * (size_t)local);
    for (int i = 0; i < local; i++) labels[i] = (float)((i * 7 + rank * 3) % 10);
    mgpu_tensor *y = mgpu_from_host(mgpu_cpu(), mgpu_shape1(local), labels);
    free(labels);

    mgpu_net *net[NWAYS] = {NULL};
    mgpu_data_parallel *dp[NWAYS] = {NULL};
    float lr = adam ? 0.001f : 0.01f;
    for (int k = 0; k < nways; k++) {
        int w = chosen[k];
        mgpu_manual_seed(o.seed);
        net[w] = is_resnet ? mgpu_resnet18(10, 1, devs[0]) : mgpu_lenet(devs[0]);
        if (adam) mgpu_net_use_adam(net[w], 0.9f, 0.999f, 1e-8f, 0);
        dp[w] = mgpu_distributed_data_parallel_new_devices(net[w], devs, o.devices, world);
        mgpu_data_parallel_configure(dp[w], 25u << 20, ways[w].overlap, ways[w].reduce);
        if (ways[w].zero) mgpu_data_parallel_zero(dp[w], ways[w].zero);
    }
    for (int s = 0; s < warmup; s++)
        for (int k = 0; k < nways; k++) mgpu_data_parallel_step(dp[chosen[k]], x, y, lr, 0.0f, 0.0f);
    mgpu_synchronize_all();
    mgpu_group_barrier(world);

    /* times[w * steps + s]: this rank's time of way w's step s */
    double *times = (double *)malloc(sizeof(double) * NWAYS * (size_t)steps);
    /* The ways take turns, and the turn's first way rotates from step to
       step: no way always runs right after another's step. */
    for (int s = 0; s < steps; s++)
        for (int k = 0; k < nways; k++) {
            int w = chosen[(s + k) % nways];
            double t0 = mgpu_now();
            mgpu_data_parallel_step(dp[w], x, y, lr, 0.0f, 0.0f);
            mgpu_synchronize_all();
            mgpu_group_barrier(world);
            times[w * steps + s] = mgpu_now() - t0;
        }

    /* A step is over when the slowest rank is done with it. */
    int n = NWAYS * steps;
    double *all = (double *)malloc(sizeof(double) * (size_t)n * (size_t)procs);
    mgpu_group_all_gather_host(world, times, sizeof(double) * (size_t)n, all);
    double *sorted = (double *)malloc(sizeof(double) * (size_t)steps);
    char list[128];
    mgpu_device_list(list, sizeof list, devs, o.devices);
    if (rank == 0)
        printf("%s, %d process%s x %d device%s (rank 0 on %s), batch %d per replica, %d in all; "
               "median of %d steps after %d of warm-up\n", is_resnet ? "ResNet-18" : "LeNet", procs,
               procs > 1 ? "es" : "", o.devices, o.devices > 1 ? "s" : "", list, batch, global_batch, steps,
               warmup);
    for (int k = 0; k < nways; k++) {
        int w = chosen[k];
        for (int s = 0; s < steps; s++) {
            double longest = 0;
            for (int r = 0; r < procs; r++) longest = fmax(longest, all[(size_t)r * n + w * steps + s]);
            sorted[s] = longest;
        }
        double median = mgpu_median(sorted, steps);
        const char *algorithm = mgpu_data_parallel_algorithm(dp[w]);
        if (replicas == 1 || !ways[w].reduce) algorithm = "none";
        if (rank == 0) {
            printf("  %-10s %9.2f ms per step (fastest %.2f), %8.1f images/s, gradients by %s\n", ways[w].name,
                   median * 1e3, sorted[0] * 1e3, global_batch / median, algorithm);
            printf("RESULT ddp model=%s procs=%d devices=%d batch=%d global_batch=%d reduce=%s algorithm=%s "
                   "optimizer=%s steps=%d step_ms=%.3f min_ms=%.3f images_per_s=%.1f\n", model, procs, o.devices,
                   batch, global_batch, ways[w].name, algorithm, adam ? "adam" : "sgd", steps, median * 1e3,
                   sorted[0] * 1e3, global_batch / median);
        }
    }

    free(sorted);
    free(all);
    free(times);
    for (int k = 0; k < nways; k++) {
        mgpu_data_parallel_free(dp[chosen[k]]);
        mgpu_net_free(net[chosen[k]]);
    }
    mgpu_free(x);
    mgpu_free(y);
    mgpu_dist_finalize(world);
    return 0;
}
