/* tests/dist_tests.c: the process group and the distributed wrapper,
   run by tests/dist.sh under mpirun with 1 to 4 ranks.

   - every collective against sums in double, at awkward lengths, with the
     same bits on every rank;
   - a send and a receive leave the ranks in step for what follows;
   - the distributed wrapper on k ranks trains like one process on the
     same global batch, and on 2 ranks exactly like chapter 3's wrapper on
     2 devices (halving is exact, and a + b is b + a);
   - accumulated gradients (no_sync) equal one step on the batches together;
   - synchronised batch norm on k ranks trains like one process;
   - ZeRO stages 1, 2 and 3 over the ranks train like the unsharded wrapper,
     and gradient checkpointing inside the wrapper changes no bit;
   - rank 0's parameters and buffers reach every rank;
   - distributed evaluation counts each image once;
   - a pipeline with a stage in each rank trains like one process;
   - on GPUs, NCCL between the ranks and MPI through the host train alike.
   tests/gpu_dist.c runs them on GPUs (emulated ones in make test): the
   data go by NCCL between the ranks' GPUs where it can start ("nccl"),
   else through host memory ("mpi via host").
   With --fault F it plays one fault instead (tests/dist.sh checks how
   the job ends): out-of-step, extra-collective, stopped-at-barrier,
   stopped-in-training, die, inside-nccl (with the emulated NCCL's fault
   set in the environment), other-network, sync-bn-two-devices; and
   busy-rank, where the job must not end.

   Every rank runs every test; rank 0 prints the results, a test failing
   where it failed on any rank. */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"
#include "test.h"
#include <signal.h>

static mgpu_group *world;
static mgpu_device *dev; /* this rank's: the CPU, or with TEST_ON_GPU its GPU (tests/gpu_dist.c) */

/* Step s's global batch of n images, the same on every rank. */
static void global_batch(int step, int n, mgpu_tensor **x, mgpu_tensor **y) {
    mgpu_manual_seed(1000 + (uint64_t)step);
    *x = mgpu_rand(dev, mgpu_shape4(n, 1, 8, 8));
    float *labels = (float *)malloc(sizeof(float) * (size_t)n);
    for (int i = 0; i < n; i++) labels[i] = (float)((i * 7 + step) % 10);
    *y = mgpu_from_host(dev, mgpu_shape1(n), labels);
    free(labels);
}

/* 1 when every rank holds these exact bits */
static int same_bits_everywhere(const float *values, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    const unsigned char *p = (const unsigned char *)values;
    for (size_t i = 0; i < n * sizeof(float); i++) h = (h ^ p[i]) * 0x100000001b3ull;
    int size = mgpu_group_size(world), same = 1;
    uint64_t *all = (uint64_t *)malloc(sizeof h * (size_t)size);
    mgpu_group_all_gather_host(world, &h, sizeof h, all);
    for (int r = 0; r < size; r++) same &= all[r] == h;
    free(all);
    return same;
}
static int net_same_everywhere(mgpu_net *net) {
    int same = 1;
    for (int p = 0; p < net->nparams; p++) {
        const mgpu_tensor *t = net->params[p]->value;
        float *v = (float *)malloc(t->numel * sizeof(float));
        mgpu_to_host(t, v);
        same &= same_bits_everywhere(v, t->numel);
        free(v);
    }
    return same;
}

/* Rank r's value i of a collective's input. */
static float value_of(int rank, size_t i) { return (float)sin(0.37 * (double)i + 1.3 * rank) * (1.0f + (float)rank); }

TEST(allreduce_matches_double_sums_with_the_same_bits_everywhere) {
    int size = mgpu_group_size(world), rank = mgpu_group_rank(world);
    size_t lengths[] = {1, 7, (size_t)(size > 1 ? size - 1 : 1), (size_t)size + 1, 13, 100003};
    for (size_t k = 0; k < sizeof lengths / sizeof *lengths; k++) {
        size_t n = lengths[k];
        for (int mean = 0; mean < 2; mean++) {
            float *v = (float *)malloc(n * sizeof(float));
            for (size_t i = 0; i < n; i++) v[i] = value_of(rank, i);
            mgpu_tensor *t = mgpu_from_host(dev, mgpu_shape1((int)n), v);
            const char *path = mgpu_group_allreduce(world, t, mean ? MGPU_MEAN : MGPU_SUM);
            CHECK(strcmp(path, mgpu_group_path(world, dev)) == 0);
            mgpu_to_host(t, v);
            double worst = 0;
            for (size_t i = 0; i < n; i++) {
                double want = 0;
                for (int r = 0; r < size; r++) want += value_of(r, i);
                if (mean) want /= size;
                worst = fmax(worst, fabs(v[i] - want) / (1.0 + fabs(want)));
            }
            CHECK_CLOSE(worst, 0.0, 1e-6, 0);
            CHECK(same_bits_everywhere(v, n));
            mgpu_free(t);
            free(v);
        }
    }
}

TEST(broadcast_all_gather_and_reduce_scatter) {
    int size = mgpu_group_size(world), rank = mgpu_group_rank(world);
    const int n = 13;
    float v[13], *all = (float *)malloc(sizeof(float) * (size_t)(n * size));
    for (int root = 0; root < size; root++) {
        for (int i = 0; i < n; i++) v[i] = value_of(rank, (size_t)i);
        mgpu_tensor *t = mgpu_from_host(dev, mgpu_shape1(n), v);
        mgpu_group_broadcast(world, t, root);
        mgpu_to_host(t, v);
        for (int i = 0; i < n; i++) CHECK(v[i] == value_of(root, (size_t)i));
        mgpu_free(t);
    }
    for (int i = 0; i < n; i++) v[i] = value_of(rank, (size_t)i);
    mgpu_tensor *in = mgpu_from_host(dev, mgpu_shape1(n), v);
    mgpu_tensor *gathered = mgpu_empty(dev, mgpu_shape2(size, n));
    mgpu_group_all_gather(world, in, gathered);
    mgpu_to_host(gathered, all);
    for (int r = 0; r < size; r++)
        for (int i = 0; i < n; i++) CHECK(all[r * n + i] == value_of(r, (size_t)i));
    /* reduce-scatter of size chunks of n: rank r gets the sum of every rank's chunk r */
    float *big = (float *)malloc(sizeof(float) * (size_t)(size * n));
    for (int i = 0; i < size * n; i++) big[i] = value_of(rank, (size_t)i);
    mgpu_tensor *whole = mgpu_from_host(dev, mgpu_shape1(size * n), big);
    mgpu_tensor *mine = mgpu_empty(dev, mgpu_shape1(n));
    for (int mean = 0; mean < 2; mean++) {
        mgpu_group_reduce_scatter(world, whole, mine, mean ? MGPU_MEAN : MGPU_SUM);
        mgpu_to_host(mine, v);
        for (int i = 0; i < n; i++) {
            double want = 0;
            for (int r = 0; r < size; r++) want += value_of(r, (size_t)(rank * n + i));
            CHECK_CLOSE(v[i], mean ? want / size : want, 1e-6, 1e-6);
        }
    }
    free(big);
    free(all);
    mgpu_free(in);
    mgpu_free(gathered);
    mgpu_free(whole);
    mgpu_free(mine);
}

/* Each rank sends to the next one round a ring; even ranks send first, so
   that large messages, which wait for their receiver, cannot deadlock. */
/* The tracer records a collective in two parts on the communication
   queue: until the last rank came ("waiting for the other ranks"), then
   the moving of data under the collective's own name. Rank 0 calls the
   allreduce at once and the others 50 ms later, so rank 0's wait is at
   least 40 ms however busy the machine (load only lengthens it). A GPU's
   collective runs on the calling thread, not on a queue: nothing is
   traced to split. */
TEST(an_allreduces_trace_tells_the_wait_from_the_moving) {
    int rank = mgpu_group_rank(world);
    if (mgpu_group_size(world) == 1 || dev->gpu >= 0) return;
    mgpu_tensor *t = mgpu_full(dev, mgpu_shape1(1000), 1.0f);
    mgpu_group_barrier(world);
    mgpu_trace_begin();
    if (rank > 0) {
        struct timespec later = {0, 50 * 1000 * 1000};
        nanosleep(&later, NULL);
    }
    mgpu_group_allreduce(world, t, MGPU_SUM);
    mgpu_trace_end();
    int waits = 0, moves = 0;
    double wait_end = -1, move_start = -2, waited = 0;
    for (int i = 0; i < mgpu_trace_count(); i++) {
        mgpu_trace_op op = mgpu_trace_get(i);
        if (op.lane != 1) continue;
        if (strcmp(op.name, "waiting for the other ranks") == 0) {
            CHECK(strcmp(op.kind, "waiting for the other ranks") == 0);
            waits++, wait_end = op.end_ms, waited = op.end_ms - op.start_ms;
        } else if (strcmp(op.name, "allreduce") == 0) {
            CHECK(strcmp(op.kind, "communication") == 0);
            moves++, move_start = op.start_ms;
        }
    }
    CHECK(waits == 1 && moves == 1);
    CHECK(wait_end == move_start); /* one after the other, no time lost between */
    if (rank == 0) CHECK(waited >= 40.0);
    mgpu_free(t);
}

TEST(send_and_receive_leave_the_ranks_in_step) {
    int size = mgpu_group_size(world), rank = mgpu_group_rank(world);
    if (size == 1) return;
    const int n = 50000;
    float *v = (float *)malloc(sizeof(float) * n);
    for (int i = 0; i < n; i++) v[i] = value_of(rank, (size_t)i);
    mgpu_tensor *out = mgpu_from_host(dev, mgpu_shape1(n), v);
    mgpu_tensor *in = mgpu_zeros(dev, mgpu_shape1(n));
    int next = (rank + 1) % size, before = (rank + size - 1) % size;
    if (rank % 2 == 0) {
        mgpu_group_send(world, out, next);
        mgpu_group_recv(world, in, before);
    } else {
        mgpu_group_recv(world, in, before);
        mgpu_group_send(world, out, next);
    }
    mgpu_to_host(in, v);
    int right = 1;
    for (int i = 0; i < n; i++) right &= v[i] == value_of(before, (size_t)i);
    CHECK(right);
    /* a send between two ranks alone: the others' collectives go on in step */
    if (rank == 0) mgpu_group_send(world, out, 1);
    if (rank == 1) mgpu_group_recv(world, in, 0);
    mgpu_tensor *one = mgpu_ones(dev, mgpu_shape1(3));
    mgpu_group_allreduce(world, one, MGPU_SUM);
    CHECK(mgpu_item(one, 2) == (float)size);
    mgpu_free(one);
    mgpu_free(in);
    mgpu_free(out);
    free(v);
}

/* `steps` SGD steps (momentum 0.9) on the global batches of per_rank
   rows a rank: the whole of each on one process's network, and this
   rank's rows of it through the distributed wrapper. */
static void train_beside_one_process(mgpu_net *one, mgpu_data_parallel *ddp, int steps, int per_rank) {
    int size = mgpu_group_size(world), rank = mgpu_group_rank(world);
    for (int s = 0; s < steps; s++) {
        mgpu_tensor *x, *y;
        global_batch(s, per_rank * size, &x, &y);
        mgpu_net_train_step(one, x, y, 0.1f, 0.9f, 0.0f, NULL);
        mgpu_tensor *xs = mgpu_narrow(x, rank * per_rank, per_rank), *ys = mgpu_narrow(y, rank * per_rank, per_rank);
        mgpu_data_parallel_step(ddp, xs, ys, 0.1f, 0.9f, 0.0f);
        mgpu_free(xs);
        mgpu_free(ys);
        mgpu_free(x);
        mgpu_free(y);
    }
}

/* Each rank starts from other weights (its own seed): the wrapper's
   broadcast gives them rank 0's, and then k ranks with a k-th of the
   batch each train like one process with all of it. */
static void ddp_trains_like_one_process(size_t bucket_bytes, int overlap) {
    int rank = mgpu_group_rank(world);
    const int per_rank = 4, steps = 5;
    mgpu_net *one = test_plain_net(dev, 5, 0);
    mgpu_net *mine = test_plain_net(dev, 5 + (uint64_t)rank, 0);
    mgpu_data_parallel *ddp = mgpu_distributed_data_parallel_new(mine, world);
    mgpu_data_parallel_configure(ddp, bucket_bytes, overlap, 1);
    train_beside_one_process(one, ddp, steps, per_rank);
    CHECK(strcmp(mgpu_data_parallel_algorithm(ddp), mgpu_group_path(world, dev)) == 0);
    CHECK_CLOSE(test_max_param_diff(mine, one), 0.0, 1e-5, 0);
    CHECK(net_same_everywhere(mine));
    mgpu_data_parallel_free(ddp);
    mgpu_net_free(mine);
    mgpu_net_free(one);
}
TEST(ddp_on_k_ranks_trains_like_one_process) {
    ddp_trains_like_one_process(25u << 20, 1); /* the network in one bucket */
    ddp_trains_like_one_process(256, 1);       /* a bucket a layer, reduced under the backward pass */
    ddp_trains_like_one_process(256, 0);       /* the same, reduced after it */
}

/* On GPUs, one a rank: NCCL between the ranks (MGPU_BACKEND_NCCL) and MPI
   through the host (MGPU_BACKEND_MPI) train alike, and like one process.
   Rank 0 prints the way the NCCL group's gradients went, "nccl" or (where
   NCCL cannot start, and says why) "mpi via host", for tests/dist.sh. */
TEST(nccl_and_mpi_through_the_host_train_alike) {
    int size = mgpu_group_size(world), rank = mgpu_group_rank(world);
    if (size == 1 || dev->gpu < 0) return;
    const mgpu_dist_backend asked = mgpu_get_dist_backend(), backends[2] = {MGPU_BACKEND_NCCL, MGPU_BACKEND_MPI};
    mgpu_net *one[2], *mine[2];
    char paths[2][64];
    for (int b = 0; b < 2; b++) {
        mgpu_set_dist_backend(backends[b]);
        /* (a group of its own: it chooses its way at its first collective) */
        mgpu_group *g = mgpu_group_first(world, size);
        one[b] = test_plain_net(dev, 5, 0);
        mine[b] = test_plain_net(dev, 5 + (uint64_t)rank, 0);
        mgpu_data_parallel *ddp = mgpu_distributed_data_parallel_new(mine[b], g);
        mgpu_data_parallel_configure(ddp, 256, 1, 1); /* a bucket a layer */
        train_beside_one_process(one[b], ddp, 5, 4);
        snprintf(paths[b], sizeof paths[b], "%s", mgpu_data_parallel_algorithm(ddp));
        CHECK_CLOSE(test_max_param_diff(mine[b], one[b]), 0.0, 1e-5, 0);
        CHECK(net_same_everywhere(mine[b]));
        mgpu_data_parallel_free(ddp);
        mgpu_group_free(g);
    }
    mgpu_set_dist_backend(asked);
    CHECK(strcmp(paths[0], "nccl") == 0 || strcmp(paths[0], "mpi via host") == 0);
    CHECK(strcmp(paths[1], "mpi via host") == 0);
    /* (the tolerance of k ranks against one process: the emulated NCCL's
       mean divides by k where MPI's multiplies by 1 / k, which differ in the
       last bit on 3 ranks; a real NCCL adds in an order of its own too) */
    CHECK_CLOSE(test_max_param_diff(mine[0], mine[1]), 0.0, 1e-5, 0);
    if (rank == 0) printf("MGPU_BACKEND_NCCL's gradients went: %s\n", paths[0]);
    for (int b = 0; b < 2; b++) {
        mgpu_net_free(mine[b]);
        mgpu_net_free(one[b]);
    }
}

/* A network with batch norm everywhere: after a convolution (with the
   ReLU fused), and a residual block's two (bn2 with the skip). */
static mgpu_net *batch_norm_net(mgpu_device *d, uint64_t seed) {
    mgpu_manual_seed(seed);
    mgpu_net *net = mgpu_net_new(d);
    mgpu_net_add_conv(net, 1, 6, 3, 1, 1);
    mgpu_net_add_batchnorm(net, 6);
    mgpu_net_add_relu(net);
    mgpu_net_add_residual(net, 6, 8, 2);
    mgpu_net_add_global_avg_pool(net);
    mgpu_net_add_linear(net, 8, 10);
    return net;
}
/* 5 steps of k ranks with a k-th of the batch each, beside one process
   with all of it: the largest difference of the parameters and of the
   running statistics. */
static void batch_norm_beside_one_process(int sync, double *params, double *buffers) {
    int rank = mgpu_group_rank(world);
    mgpu_net *one = batch_norm_net(dev, 9);
    mgpu_net *mine = batch_norm_net(dev, 9 + (uint64_t)rank);
    if (sync) mgpu_net_sync_batchnorm(mine, world);
    mgpu_data_parallel *ddp = mgpu_distributed_data_parallel_new(mine, world);
    mgpu_data_parallel_configure(ddp, 256, 1, 1);
    train_beside_one_process(one, ddp, 5, 4);
    *params = test_max_param_diff(mine, one);
    *buffers = test_max_diff(mine, one, 1);
    CHECK(net_same_everywhere(mine));
    mgpu_data_parallel_free(ddp);
    mgpu_net_free(mine);
    mgpu_net_free(one);
}
/* Synchronised batch norm: k ranks train like one process with the
   global batch, batch norm's statistics included; each rank's own
   statistics (the default) do not, which shows that the comparison can
   tell. */
TEST(sync_batchnorm_on_k_ranks_trains_like_one_process) {
    double params, buffers;
    batch_norm_beside_one_process(1, &params, &buffers);
    /* (sums over another split of the batch round apart: 1.03e-5 after 5
       steps on emulated GPUs with one machine's OpenBLAS, whose kernels and
       their order of sums depend on the CPU; without the synchronisation
       it is above 1e-3) */
    CHECK_CLOSE(params, 0.0, 3e-5, 0);
    CHECK_CLOSE(buffers, 0.0, 1e-5, 0);
    if (mgpu_group_size(world) > 1) {
        batch_norm_beside_one_process(0, &params, &buffers);
        CHECK(params > 1e-3);
        CHECK(buffers > 1e-3);
    }
}

/* ZeRO over the ranks: stages 1, 2 and 3, SGD with momentum and AdamW,
   20 steps, against the unsharded distributed wrapper: the same sums in
   the same rank order, so the same bits (NCCL's allreduce and
   reduce-scatter on real GPUs may add in orders of their own: 1e-6
   there); stage 3 also with recomputed runs, whose forward passes gather
   again (collectives every rank takes in the same order). Compared once
   the wrappers are freed: between steps stage 3's parameters are chunks
   on each rank. Stage 3 prefetches over the ranks too: during a step a
   rank holds its chunks and two units whole at a time, more than its
   chunks and the largest unit (each unit's whole values are allocated
   when its gather starts). */
static void zero_over_ranks(int stage, int adam, int segments) {
    int rank = mgpu_group_rank(world);
    mgpu_net *nets[2];
    mgpu_data_parallel *ddps[2];
    for (int k = 0; k < 2; k++) {
        nets[k] = batch_norm_net(dev, 13 + (uint64_t)rank);
        if (adam) mgpu_net_use_adam(nets[k], 0.9f, 0.999f, 1e-8f, 1);
        mgpu_net_recompute(nets[k], segments);
        ddps[k] = mgpu_distributed_data_parallel_new(nets[k], world);
        mgpu_data_parallel_configure(ddps[k], 256, 1, 1);
        if (k) mgpu_data_parallel_zero(ddps[k], stage);
    }
    size_t largest_unit = 0, chunks = 0;
    int size = mgpu_group_size(world);
    for (int s = 0; s < 20; s++) {
        if (s == 1) { /* (the buckets are made in the first step) */
            /* the largest unit, whole, as the allocator rounds it; and
               what the ranks hold between steps */
            for (int b = 0; stage == 3 && b < ddps[1]->buckets.count; b++) {
                size_t before = mgpu_device_memory_in_use(dev);
                mgpu_tensor *whole = mgpu_empty(dev, mgpu_shape1((int)ddps[1]->buckets.len[b]));
                size_t bytes = mgpu_device_memory_in_use(dev) - before;
                mgpu_free(whole);
                if (bytes > largest_unit) largest_unit = bytes;
            }
            mgpu_synchronize(dev);
            chunks = mgpu_device_memory_of(dev, MGPU_MEMORY_PARAMETERS);
            mgpu_device_reset_peak(dev);
        }
        mgpu_tensor *x, *y;
        global_batch(200 + s, 4 * size, &x, &y);
        mgpu_tensor *xs = mgpu_narrow(x, rank * 4, 4), *ys = mgpu_narrow(y, rank * 4, 4);
        for (int k = 0; k < 2; k++) mgpu_data_parallel_step(ddps[k], xs, ys, adam ? 0.01f : 0.1f, adam ? 0.0f : 0.9f, 0.01f);
        mgpu_free(xs);
        mgpu_free(ys);
        mgpu_free(x);
        mgpu_free(y);
    }
    size_t peak = mgpu_device_memory_peak_of(dev, MGPU_MEMORY_PARAMETERS);
    for (int k = 0; k < 2; k++) mgpu_data_parallel_free(ddps[k]); /* (gathers the state back: a collective) */
    double diff = test_max_param_diff(nets[1], nets[0]);
    double tolerance = TEST_EXACT_BUT_ON_NCCL(1e-6);
    if (diff > tolerance)
        printf("  ZeRO-%d%s, %d runs: parameters differ by %.3g\n", stage, adam ? ", AdamW" : "", segments, diff);
    CHECK_CLOSE(diff, 0.0, tolerance, 0);
    CHECK(net_same_everywhere(nets[1]));
    CHECK(nets[1]->momentum[0] != NULL && !nets[1]->sharded);
    if (stage == 3 && size > 1) {
        if (peak <= chunks + largest_unit)
            printf("  ZeRO-3%s, %d runs: parameters peaked at %zu bytes, chunks %zu + the largest unit %zu\n",
                   adam ? ", AdamW" : "", segments, peak, chunks, largest_unit);
        CHECK(peak > chunks + largest_unit);
    }
    for (int k = 0; k < 2; k++) mgpu_net_free(nets[k]);
}
/* Gradient checkpointing inside the distributed wrapper: 5 steps in
   about sqrt(n) runs, the parameters of the plain wrapper bit for bit. */
TEST(checkpointing_inside_the_distributed_wrapper) {
    int rank = mgpu_group_rank(world);
    mgpu_net *nets[2];
    mgpu_data_parallel *ddps[2];
    for (int k = 0; k < 2; k++) {
        nets[k] = batch_norm_net(dev, 17 + (uint64_t)rank);
        mgpu_net_recompute(nets[k], k ? MGPU_SEGMENTS_SQRT : 1);
        ddps[k] = mgpu_distributed_data_parallel_new(nets[k], world);
    }
    int size = mgpu_group_size(world);
    for (int s = 0; s < 5; s++) {
        mgpu_tensor *x, *y;
        global_batch(300 + s, 4 * size, &x, &y);
        mgpu_tensor *xs = mgpu_narrow(x, rank * 4, 4), *ys = mgpu_narrow(y, rank * 4, 4);
        for (int k = 0; k < 2; k++) mgpu_data_parallel_step(ddps[k], xs, ys, 0.1f, 0.9f, 0.0f);
        mgpu_free(xs);
        mgpu_free(ys);
        mgpu_free(x);
        mgpu_free(y);
    }
    CHECK(test_max_param_diff(nets[1], nets[0]) == 0.0);
    CHECK(nets[1]->nsegments > 1);
    for (int k = 0; k < 2; k++) {
        mgpu_data_parallel_free(ddps[k]);
        mgpu_net_free(nets[k]);
    }
}

TEST(zero_over_ranks_trains_like_the_unsharded_wrapper) {
    for (int stage = 1; stage <= 3; stage++)
        for (int adam = 0; adam <= 1; adam++) zero_over_ranks(stage, adam, 1);
    zero_over_ranks(3, 1, 3);
}

/* Two devices a rank (the hybrid case): k ranks of 2 devices, each
   with a 2k-th of the batch, train like one process with all of it,
   also from a network that has taken steps with momentum before (as a
   loaded checkpoint has): its SGD state reaches every device. */
TEST(ddp_with_2_devices_a_rank_trains_like_one_process) {
    int size = mgpu_group_size(world);
    const int per_rank = 8;
    mgpu_group *g = mgpu_group_first(world, size); /* (a group of its own: its collectives run on devs[0]) */
    mgpu_device *devs[2];
    mgpu_group_devices(g, TEST_ON_GPU, 2, devs);
    mgpu_net *one = test_plain_net(dev, 5, 0);
    mgpu_net *mine = test_plain_net(devs[0], 5, 0);
    for (int s = 0; s < 2; s++) { /* (the same steps on every rank) */
        mgpu_tensor *x, *y, *xm, *ym;
        global_batch(100 + s, per_rank * size, &x, &y);
        mgpu_net_train_step(one, x, y, 0.1f, 0.9f, 0.0f, NULL);
        xm = mgpu_to(x, devs[0], 0);
        ym = mgpu_to(y, devs[0], 0);
        mgpu_net_train_step(mine, xm, ym, 0.1f, 0.9f, 0.0f, NULL);
        mgpu_free(xm);
        mgpu_free(ym);
        mgpu_free(x);
        mgpu_free(y);
    }
    mgpu_data_parallel *ddp = mgpu_distributed_data_parallel_new_devices(mine, devs, 2, g);
    mgpu_data_parallel_configure(ddp, 256, 1, 1); /* a bucket a layer */
    train_beside_one_process(one, ddp, 5, per_rank);
    CHECK_CLOSE(test_max_param_diff(mine, one), 0.0, 1e-5, 0);
    CHECK(test_max_param_diff(mgpu_data_parallel_replica(ddp, 1), mine) == 0.0); /* its devices agree */
    CHECK(net_same_everywhere(mine));
    char then[64]; /* (the ring, then the group's way: mpi, or on GPUs nccl or mpi via host) */
    snprintf(then, sizeof then, ", then %s", mgpu_group_path(g, devs[0]));
    if (size > 1) CHECK(strstr(mgpu_data_parallel_algorithm(ddp), then) != NULL);
    mgpu_data_parallel_free(ddp);
    mgpu_net_free(mine);
    mgpu_net_free(one);
    mgpu_group_free(g);
}

TEST(ddp_on_2_ranks_equals_chapter3_wrapper_on_2_devices_bit_for_bit) {
    if (mgpu_group_size(world) < 2) return;
    mgpu_group *two = mgpu_group_first(world, 2);
    if (!two) return; /* ranks 2 and up sit this one out */
    int rank = mgpu_group_rank(two);
    const int per_rank = 4;
    mgpu_device *devs[2];
    mgpu_devices(2, TEST_ON_GPU, devs);
    mgpu_net *local = test_plain_net(devs[0], 9, 0);
    mgpu_data_parallel *dp = mgpu_data_parallel_new(local, devs, 2, MGPU_DP_ALLREDUCE);
    mgpu_net *mine = test_plain_net(dev, 9, 0);
    mgpu_data_parallel *ddp = mgpu_distributed_data_parallel_new(mine, two);
    for (int s = 0; s < 4; s++) {
        mgpu_tensor *x, *y;
        global_batch(s, 2 * per_rank, &x, &y);
        mgpu_data_parallel_step(dp, x, y, 0.1f, 0.9f, 1e-4f);
        mgpu_tensor *xs = mgpu_narrow(x, rank * per_rank, per_rank), *ys = mgpu_narrow(y, rank * per_rank, per_rank);
        mgpu_data_parallel_step(ddp, xs, ys, 0.1f, 0.9f, 1e-4f);
        mgpu_free(xs);
        mgpu_free(ys);
        mgpu_free(x);
        mgpu_free(y);
    }
    CHECK(test_max_param_diff(mine, local) == 0.0);
    mgpu_data_parallel_free(ddp);
    mgpu_data_parallel_free(dp);
    mgpu_net_free(mine);
    mgpu_net_free(local);
    mgpu_group_free(two);
}

/* no_sync: 3 batches of 4 rows a rank, two accumulated and one stepped,
   against one step on the 12 rows together. */
static void accumulate_vs_big_batch(mgpu_data_parallel *small, mgpu_net *small_net, mgpu_data_parallel *big,
                                    mgpu_net *big_net) {
    const int rows = 4;
    for (int s = 0; s < 3; s++) {
        mgpu_tensor *x, *y;
        global_batch(s + 10 * mgpu_group_rank(world), 3 * rows, &x, &y);
        mgpu_data_parallel_step(big, x, y, 0.1f, 0.9f, 0.0f);
        for (int part = 0; part < 3; part++) {
            mgpu_tensor *xs = mgpu_narrow(x, part * rows, rows), *ys = mgpu_narrow(y, part * rows, rows);
            if (part < 2)
                mgpu_data_parallel_accumulate(small, xs, ys);
            else
                mgpu_data_parallel_step(small, xs, ys, 0.1f, 0.9f, 0.0f);
            mgpu_free(xs);
            mgpu_free(ys);
        }
        mgpu_free(x);
        mgpu_free(y);
    }
    CHECK_CLOSE(test_max_param_diff(small_net, big_net), 0.0, 1e-6, 0);
}
TEST(accumulated_gradients_equal_one_step_on_the_batches_together) {
    /* the distributed wrapper: each rank's batches are its own */
    mgpu_net *a = test_plain_net(dev, 11, 0), *b = test_plain_net(dev, 11, 0);
    mgpu_data_parallel *small = mgpu_distributed_data_parallel_new(a, world);
    mgpu_data_parallel *big = mgpu_distributed_data_parallel_new(b, world);
    accumulate_vs_big_batch(small, a, big, b);
    CHECK(net_same_everywhere(a));
    mgpu_data_parallel_free(small);
    mgpu_data_parallel_free(big);
    mgpu_net_free(a);
    mgpu_net_free(b);
    /* chapter 3's wrapper, 2 devices each */
    mgpu_device *devs[4];
    mgpu_devices(4, TEST_ON_GPU, devs);
    a = test_plain_net(devs[0], 11, 0);
    b = test_plain_net(devs[2], 11, 0);
    small = mgpu_data_parallel_new(a, devs, 2, MGPU_DP_ALLREDUCE);
    big = mgpu_data_parallel_new(b, devs + 2, 2, MGPU_DP_ALLREDUCE);
    accumulate_vs_big_batch(small, a, big, b);
    mgpu_data_parallel_free(small);
    mgpu_data_parallel_free(big);
    mgpu_net_free(a);
    mgpu_net_free(b);
}

TEST(rank_0s_parameters_and_buffers_reach_every_rank) {
    int rank = mgpu_group_rank(world);
    mgpu_net *net = test_plain_net(dev, 20 + (uint64_t)rank, 1);
    mgpu_fill(mgpu_net_buffer(net, 0), (float)rank); /* batch norm's running mean */
    mgpu_data_parallel *ddp = mgpu_distributed_data_parallel_new(net, world);
    CHECK(mgpu_item(mgpu_net_buffer(net, 0), 3) == 0.0f);
    CHECK(net_same_everywhere(net));
    /* each step starts from rank 0's running statistics (broadcast_buffers):
       garbage written on another rank between steps is gone after the next */
    mgpu_tensor *x, *y;
    global_batch(0, 4, &x, &y);
    mgpu_data_parallel_step(ddp, x, y, 0.1f, 0.0f, 0.0f);
    float before = mgpu_item(mgpu_net_buffer(net, 0), 1);
    mgpu_group_broadcast(world, mgpu_net_buffer(net, 0), 0);
    CHECK(mgpu_item(mgpu_net_buffer(net, 0), 1) == before); /* the same batch gave every rank the same statistics */
    if (rank != 0) mgpu_fill(mgpu_net_buffer(net, 0), 1e6f);
    mgpu_data_parallel_step(ddp, x, y, 0.1f, 0.0f, 0.0f);
    float mean1 = mgpu_item(mgpu_net_buffer(net, 0), 1);
    float *all = (float *)malloc(sizeof(float) * 8);
    mgpu_tensor *one = mgpu_full(dev, mgpu_shape1(1), mean1);
    mgpu_tensor *gathered = mgpu_empty(dev, mgpu_shape1(mgpu_group_size(world)));
    mgpu_group_all_gather(world, one, gathered);
    mgpu_to_host(gathered, all);
    for (int r = 0; r < mgpu_group_size(world); r++) CHECK(all[r] == all[0]);
    free(all);
    mgpu_free(one);
    mgpu_free(gathered);
    mgpu_free(x);
    mgpu_free(y);
    mgpu_data_parallel_free(ddp);
    mgpu_net_free(net);
}

TEST(distributed_evaluation_counts_each_image_once) {
    /* 10 images, so that 3 or 4 ranks get parts of unequal size */
    mgpu_dataset d = {10, 8, 8, NULL, NULL};
    d.images = (unsigned char *)malloc(10 * 64);
    d.labels = (unsigned char *)malloc(10);
    for (int i = 0; i < 10 * 64; i++) d.images[i] = (unsigned char)((i * 37) % 251);
    for (int i = 0; i < 10; i++) d.labels[i] = (unsigned char)((i * 3) % 10);
    mgpu_net *net = test_plain_net(dev, 5, 0);
    double whole = mgpu_net_evaluate_accuracy(net, &d, 4);
    double shared = mgpu_dist_evaluate_accuracy(world, net, &d, 4);
    CHECK(whole == shared);
    CHECK(whole > 0.0 && whole < 1.0); /* a count that tells parts apart */
    mgpu_net_free(net);
    /* with batch norm, after a step on each rank's own batch: every rank's
       running statistics moved its own way, and the evaluation uses rank 0's */
    net = test_plain_net(dev, 5, 1);
    mgpu_data_parallel *ddp = mgpu_distributed_data_parallel_new(net, world);
    mgpu_tensor *x, *y;
    global_batch(mgpu_group_rank(world), 4, &x, &y);
    mgpu_data_parallel_step(ddp, x, y, 0.1f, 0.0f, 0.0f);
    shared = mgpu_dist_evaluate_accuracy(world, net, &d, 4);
    whole = mgpu_net_evaluate_accuracy(net, &d, 4); /* (rank 0's statistics now on every rank) */
    double mine = whole, *every = (double *)malloc(sizeof(double) * (size_t)mgpu_group_size(world));
    mgpu_group_all_gather_host(world, &mine, sizeof mine, every);
    CHECK(shared == every[0]);
    free(every);
    mgpu_free(x);
    mgpu_free(y);
    mgpu_data_parallel_free(ddp);
    mgpu_net_free(net);
    free(d.images);
    free(d.labels);
}

/* A pipeline with a stage in each rank (mgpu_pipeline_new_group), GPipe,
   1F1B and ZB-H1 (whose W passes send nothing), micro-batches that do and do not divide the batch: 3 steps
   with momentum train each rank's stage as one process trains those
   layers, within 1e-5; and freeing it gives the rank's network its
   stage's values. */
TEST(pipeline_stages_in_ranks_train_like_one_process) {
    int ranks = mgpu_group_size(world), rank = mgpu_group_rank(world);
    mgpu_schedule_fn schedules[3] = {mgpu_schedule_gpipe, mgpu_schedule_1f1b, mgpu_schedule_zb_h1};
    int micro[3] = {1, 4, 5}; /* (5 does not divide 12) */
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < 3; i++) {
            mgpu_net *net = test_plain_net(dev, 5, 0), *ref = test_plain_net(dev, 5, 0);
            mgpu_pipeline *pp = mgpu_pipeline_new_group(net, world, NULL);
            mgpu_pipeline_set_schedule(pp, schedules[k], micro[i]);
            mgpu_tensor *loss = rank == ranks - 1 ? mgpu_zeros(dev, mgpu_shape1(1)) : NULL;
            mgpu_tensor *ref_loss = mgpu_zeros(dev, mgpu_shape1(1));
            for (int step = 0; step < 3; step++) {
                mgpu_tensor *x, *y;
                global_batch(step, 12, &x, &y);
                mgpu_pipeline_train_step(pp, x, y, 0.1f, 0.9f, 0.0f, loss);
                mgpu_net_train_step(ref, x, y, 0.1f, 0.9f, 0.0f, ref_loss);
                mgpu_free(x);
                mgpu_free(y);
            }
            /* this rank's stage, parameters first .. end - 1: layers rank * 7 / ranks on (the default cut) */
            int first = ref->first_param[rank * ref->nlayers / ranks];
            int end = rank == ranks - 1 ? ref->nparams : ref->first_param[(rank + 1) * ref->nlayers / ranks];
            mgpu_net *stage = mgpu_pipeline_stage(pp, rank);
            CHECK_EQ_INT(stage->nparams, end - first);
            double diff = 0;
            for (int p = first; p < end; p++)
                diff = fmax(diff, test_relative_diff(stage->params[p - first]->value, ref->params[p]->value));
            CHECK(diff <= 1e-5);
            if (loss) CHECK_CLOSE(mgpu_item(loss, 0), mgpu_item(ref_loss, 0), 0, 1e-5);
            mgpu_pipeline_free(pp);
            double back = 0;
            for (int p = first; p < end; p++)
                back = fmax(back, test_relative_diff(net->params[p]->value, ref->params[p]->value));
            CHECK(back <= 1e-5);
            mgpu_free(loss);
            mgpu_free(ref_loss);
            mgpu_net_free(net);
            mgpu_net_free(ref);
        }
}

/* ----------------------------------------------------------- faults */
static int play_fault(const char *fault) {
    int rank = mgpu_group_rank(world);
    mgpu_tensor *t = mgpu_ones(dev, mgpu_shape1(1000));
    if (strcmp(fault, "out-of-step") == 0) {
        mgpu_group_allreduce(world, t, MGPU_SUM);
        if (rank == 1) mgpu_group_broadcast(world, t, 0); else mgpu_group_allreduce(world, t, MGPU_SUM);
    } else if (strcmp(fault, "extra-collective") == 0) {
        mgpu_group_allreduce(world, t, MGPU_SUM);
        if (rank == 0) mgpu_group_allreduce(world, t, MGPU_SUM);
    } else if (strcmp(fault, "die") == 0) {
        for (int i = 0; i < 100000; i++) {
            if (rank == 1 && i == 20) raise(SIGKILL);
            mgpu_group_allreduce(world, t, MGPU_MEAN);
        }
    } else if (strcmp(fault, "stopped-at-barrier") == 0) {
        mgpu_group_barrier(world);
        if (rank == mgpu_group_size(world) - 1) raise(SIGSTOP); /* (as kill -STOP would) */
        mgpu_group_barrier(world);
    } else if (strcmp(fault, "stopped-in-training") == 0) {
        for (int i = 0; i < 100000; i++) {
            if (rank == 1 && i == 20) raise(SIGSTOP);
            mgpu_group_allreduce(world, t, MGPU_MEAN);
        }
    } else if (strcmp(fault, "inside-nccl") == 0) {
        /* allreduces alone: the emulated NCCL's MGPU_EMU_NCCL_FAULT
           (tests/cuda_emu_runtime.h) stops or kills a rank inside one */
        for (int i = 0; i < 100000; i++) mgpu_group_allreduce(world, t, MGPU_MEAN);
    } else if (strcmp(fault, "busy-rank") == 0) {
        /* not a fault: rank 0 computes for 4 timeouts while the others wait
           at a barrier, and they must wait it out, for it makes progress */
        double timeout = atof(getenv("MGPU_DIST_TIMEOUT"));
        for (double start = mgpu_now(); rank == 0 && mgpu_now() - start < 4 * timeout;) {
            mgpu_scale_(t, 1.0f);
            mgpu_synchronize(dev);
        }
        mgpu_group_barrier(world);
        if (rank == 0) printf("the others waited out rank 0's %.0f s\n", 4 * timeout);
    } else if (strcmp(fault, "other-network") == 0) {
        mgpu_net *net = test_plain_net(dev, 5, rank == 1);
        mgpu_distributed_data_parallel_new(net, world);
    } else if (strcmp(fault, "sync-bn-two-devices") == 0) {
        mgpu_device *devs[2];
        mgpu_group_devices(world, TEST_ON_GPU, 2, devs);
        mgpu_net *net = batch_norm_net(devs[0], 5);
        mgpu_net_sync_batchnorm(net, world);
        mgpu_distributed_data_parallel_new_devices(net, devs, 2, world);
    } else {
        fprintf(stderr, "dist_tests: unknown fault '%s'\n", fault);
        return 2;
    }
    mgpu_free(t);
    mgpu_dist_finalize(world);
    return 0;
}

/* A test's failures over every rank. */
static int failures_over_ranks(int failures) {
    double sum = failures;
    mgpu_group_sum_host(world, &sum, 1);
    return (int)sum;
}

/* "2 ranks on host-a, host-b": where the ranks run, each host once. */
static void print_hosts(void) {
    enum { NAME = 256 };
    int size = mgpu_group_size(world);
    char mine[NAME] = "", *all = (char *)malloc((size_t)NAME * (size_t)size);
    snprintf(mine, sizeof mine, "%s", mgpu_group_host(world));
    mgpu_group_all_gather_host(world, mine, NAME, all);
    if (test__prints) {
        printf("%d rank%s on ", size, size > 1 ? "s" : "");
        for (int r = 0; r < size; r++) {
            int seen = 0;
            for (int q = 0; q < r; q++) seen |= strcmp(all + q * NAME, all + r * NAME) == 0;
            if (!seen) printf("%s%s", r ? ", " : "", all + r * NAME);
        }
        printf("\n");
    }
    free(all);
}

/* dist_tests [NAME]: the tests (those whose name contains NAME);
   dist_tests --fault FAULT: one fault. */
int main(int argc, char **argv) {
    world = mgpu_dist_init(&argc, &argv);
    dev = mgpu_group_device(world, TEST_ON_GPU);
    if (argc > 2 && strcmp(argv[1], "--fault") == 0) return play_fault(argv[2]);
    test__combine = failures_over_ranks;
    test__prints = mgpu_group_rank(world) == 0;
    print_hosts();
    int status = test__run_all(argc, argv);
    mgpu_dist_finalize(world);
    return status;
}
