/* Chapter 4: distributed data parallelism, one process per device.

   What it teaches. Chapters 2 and 3 ran every device inside one process.
   Real trainers run one process per device (PyTorch's
   DistributedDataParallel), on one machine or many, started by a
   launcher:
       mpirun -np 4 ./chapter4
   Each process (a rank) holds one replica of the network on its own
   device and reads its own share of every epoch (a distributed sampler:
   the same shuffled order on every rank, rank r taking positions r,
   r + world, ...). After the backward pass of each step the ranks average
   their gradients (an allreduce over MPI, bucket by bucket while the
   backward pass goes on), and every rank takes the same SGD step, so the
   replicas stay the same without ever being copied. Nothing is shared but
   the gradients: k processes with a k-th of the global batch each follow
   the path of one process with all of it.

   The chapter trains the same model on 1, 2, 4, ... processes of the
   job (sub-groups of its ranks) with the same global batch, prints what
   each rank saw in the seed's style and a scaling table, and writes
   the accuracy curves and a timeline of one step on every rank. Rank 0
   saves a checkpoint of each run (chapter4_<N>proc.ckpt in --out) at the
   end of every epoch and every --checkpoint-every steps, written whole;
   --resume continues each run from its checkpoint, bit for bit as if it
   had not stopped (a finished run is only evaluated). A checkpoint keeps
   the settings that decide the training's path (the model, the global
   batch, the training images, lr, momentum, the seed, MGPU_CONV): a
   --resume with another of them is refused, naming it, since it would go
   on as another training; another number of processes is not one of them.

   What you should see (mpirun -np 2 on a 2-core machine without a GPU,
   the reduced run; the 1-process run first, then):
       Rank: 0 | Epoch [1/2] | Avg. Loss: 1.889 | Accuracy: 39.160%
       Rank: 1 | Epoch [1/2] | Avg. Loss: 1.867 | Accuracy: 38.696%
       Rank: 0 | Epoch [2/2] | Avg. Loss: 0.878 | Accuracy: 67.822%
       Rank: 1 | Epoch [2/2] | Avg. Loss: 0.863 | Accuracy: 69.482%
       test acc: 0.71, 4.1 sec/epoch, 2021 images/sec, on 2 processes (gradients: mpi); ...
   then the table: images/sec against one process, and the allreduce's
   time and bandwidth for the model's gradients; and the closing lines:
       What this run shows:
         1 and 2 processes reached test accuracies of 0.70 and 0.71 on the same global batch:
         the same model, as expected. ...
   One process and two follow the same path on the same global batch:
   their first epoch's mean loss agrees to the third decimal (1.881
   against 1.878). After that the rounding of sums taken in another order
   (over 256 rows, or 128 and 128 then added) takes the runs apart, each
   as right as the other, and the lr falling to 0 over the reduced run
   lets them settle at the same accuracy. Every process computes on its
   share of the cores: mpirun -np 2 binds each to a core of its own, and
   with mpirun -np 4 on 2 cores, which binds none, each takes one of the
   two (mgpu_num_cores), so the 1-process run computes as each process of
   the larger runs does. A speedup is held to the processes and to the
   hardware under them (here 2), an efficiency to 1: a figure past that
   is flagged on a line of its own, not explained. LeNet's step is small:
   on 2 cores 2 processes do about 1.1 times the work of one, the rest
   going to the allreduce and to waiting at each bucket.

   --devices-per-process N gives each process N devices (CPU devices, or
   GPUs): the hybrid of chapters 3 and 4, where a bucket's gradients are
   summed over the process's devices (chapter 3's ring), then averaged
   over the processes (MPI).

   On GPUs, one a process, the gradients go GPU to GPU with NCCL
   (--backend nccl, the default, as PyTorch's DDP): rank 0's
   ncclUniqueId reaches the others over MPI and each starts its
   communicator without blocking, so that a rank that stops is named
   within MGPU_DIST_TIMEOUT instead of hanging the job. Where NCCL cannot
   start (two processes on one GPU, which NCCL refuses, or an NCCL older
   than 2.14) one line says why and they go through host memory over MPI,
   as --backend mpi does. The line "(gradients: ...)" says which ran:
   nccl, mpi via host, or mpi between CPU processes.

   Batch norm (ResNet-18) normalises by each process's own share of the
   batch, as DDP does: with 4 processes and a global batch of 256, by 64
   images. --sync-bn takes the statistics over the whole global batch
   instead (PyTorch's SyncBatchNorm: two more collectives per batch norm
   and step), so that k processes follow one process's path with batch
   norm too.

   Without a GPU it runs a reduced setting (LeNet, 8192 images, 2 epochs);
   --full trains ResNet-18 on all 60000, as chapter 3.

   Reads: mgpu/groups.h (processes as a group), mgpu/data_parallel.h
   (mgpu_distributed_data_parallel_new), mgpu/data_parallel_step.h,
   mgpu/data.h (the distributed sampler), mgpu/checkpoints.h (resuming),
   mgpu/timing.h (the tracer that records each rank's step; the chapter
   draws the ranks' timeline itself, in ranks_timeline), mgpu/networks.h
   and mgpu/training_ops.h (--sync-bn's batch norm over the group),
   mgpu/communication.h (the ring, with --devices-per-process),
   mgpu/net_training.h, mgpu/plots.h, mgpu/settings.h (MGPU_CONV,
   MGPU_CHECK_REPLICAS, MGPU_DIST_BACKEND), mgpu/flags.h. */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"

typedef struct {
    int resnet; /* ResNet-18, else LeNet */
    int global_batch, epochs, checkpoint_every, resume;
    int devices_per_process, use_gpu, sync_bn;
    int kill_at_step, kill_in_world; /* (0: never) the last rank of the run on kill_in_world processes dies there */
    float lr, momentum;
    int lr_to_zero; /* lr falls linearly to 0 over the run (the reduced run) */
    uint64_t seed;
    const mgpu_options *o;
} settings;

/* Where a run starts: rank 0's checkpoint, if it found one, else the
   beginning. */
typedef struct {
    int found;
    mgpu_checkpoint_info info;
} resume_point;

/* The book's LeNet (mgpu_lenet), with He's initialisation: with the book's
   Normal(0, 0.01) it would still guess after the reduced run's epochs. */
static mgpu_net *lenet(mgpu_device *dev) {
    mgpu_net *net = mgpu_lenet(dev);
    for (int i = 0; i < mgpu_net_num_params(net); i++) {
        mgpu_tensor *w = mgpu_net_param(net, i)->value;
        if (w->shape.ndim < 2) continue; /* (biases keep theirs) */
        int fan_in = w->shape.ndim == 4 ? w->shape.d[1] * w->shape.d[2] * w->shape.d[3] : w->shape.d[0];
        mgpu_tensor *he = mgpu_randn(dev, w->shape, 0.0f, sqrtf(2.0f / (float)fan_in));
        mgpu_copy(w, he, 0);
        mgpu_free(he);
    }
    return net;
}

/* A rank's replica of the model on its devices (devs, s->devices_per_process
   of them). */
static mgpu_net *model(mgpu_group *g, const settings *s, mgpu_device **devs) {
    mgpu_group_devices(g, s->use_gpu, s->devices_per_process, devs);
    mgpu_manual_seed(s->seed);
    return s->resnet ? mgpu_resnet18(10, 1, devs[0]) : lenet(devs[0]);
}

/* What decides the path of the run's training, which its checkpoint keeps. */
static mgpu_train_settings train_settings(const settings *s, const mgpu_net *net, const mgpu_dataset *train_set) {
    mgpu_train_settings t = mgpu_train_settings_of(net, train_set);
    snprintf(t.model, sizeof t.model, "%s", s->resnet ? "resnet18" : "lenet");
    t.batch_size = s->global_batch;
    t.lr = s->lr;
    t.momentum = s->momentum;
    t.weight_decay = 0.0f; /* (the steps take none) */
    t.seed = s->seed;
    return t;
}

/* Where the run on g starts: its checkpoint, if there is one made with
   the same settings (one made with others is refused: going on from it
   would be another training), else the beginning. Rank 0 alone reads the
   file (the others may be on machines without it): the all-gather gives
   every rank what it holds, and the wrapper's broadcast its network and
   SGD's state. The settings are compared before the network is loaded,
   so that another model is named, not found by its shapes. */
static resume_point resume_point_of(mgpu_group *g, mgpu_net *net, const char *checkpoint,
                                    const mgpu_train_settings *now) {
    int rank = mgpu_group_rank(g), world = mgpu_group_size(g);
    resume_point here = {0, {0, 0, 0, world, *now}};
    if (checkpoint && rank == 0 && access(checkpoint, F_OK) == 0) {
        mgpu_checkpoint_read_info(checkpoint, &here.info);
        here.found = 1;
    }
    resume_point *points = (resume_point *)mgpu_malloc(sizeof here * (size_t)world);
    mgpu_group_all_gather_host(g, &here, sizeof here, points);
    resume_point at = points[0];
    free(points);
    char why[512];
    if (at.found && mgpu_train_settings_differ(&at.info.train, now, why, sizeof why))
        mgpu_group_fatal(g, "%s was %s, or delete the file (or leave out --resume) to start afresh", checkpoint,
                         why);
    if (here.found) mgpu_checkpoint_load(net, checkpoint, &here.info);
    return at;
}

/* The rank's replica in the distributed wrapper: rank 0's parameters go
   to every rank and the others' are checked against them. */
static mgpu_data_parallel *wrapped_model(mgpu_group *g, const settings *s, mgpu_device **devs, mgpu_net *net) {
    if (s->sync_bn) mgpu_net_sync_batchnorm(net, g);
    mgpu_data_parallel *ddp = mgpu_distributed_data_parallel_new_devices(net, devs, s->devices_per_process, g);
    /* LeNet is smaller than one bucket of 25 MiB: in buckets of 64 KiB its
       last layers' reduction runs while the first layers' backward does */
    if (!s->resnet) mgpu_data_parallel_configure(ddp, 64 << 10, 1, 1);
    return ddp;
}

/* A hash of the parameters' bits: two runs that end with the same hash
   trained the same network, bit for bit (the resume test compares them). */
static uint64_t parameters_hash(mgpu_net *net) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (int i = 0; i < mgpu_net_num_params(net); i++) {
        const mgpu_tensor *t = mgpu_net_param(net, i)->value;
        float *v = (float *)mgpu_malloc(t->numel * sizeof(float));
        mgpu_to_host(t, v);
        const unsigned char *p = (const unsigned char *)v;
        for (size_t k = 0; k < t->numel * sizeof(float); k++) h = (h ^ p[k]) * 0x100000001b3ull;
        free(v);
    }
    return h;
}

typedef struct {
    double seconds_per_epoch, images_per_second, test_acc;
    const char *path;
} run_result;

/* One rank's training on group g: returns what rank 0 prints in the table. */
static run_result train(mgpu_group *g, const settings *s, const mgpu_dataset *train_set,
                        const mgpu_dataset *test_set, mgpu_animator *animator) {
    int rank = mgpu_group_rank(g), world = mgpu_group_size(g);
    char name[64], checkpoint[1024];
    snprintf(name, sizeof name, "chapter4_%dproc.ckpt", world);
    mgpu_out_path(s->o, name, checkpoint, sizeof checkpoint);
    mgpu_device *devs[MGPU_MAX_DEVICES];
    mgpu_net *net = model(g, s, devs);
    mgpu_train_settings now = train_settings(s, net, train_set);
    resume_point start = resume_point_of(g, net, s->resume ? checkpoint : NULL, &now);
    mgpu_data_parallel *ddp = wrapped_model(g, s, devs, net);
    const mgpu_checkpoint_info at = start.info;
    if (s->resume && !start.found && rank == 0) printf("no checkpoint %s: this run starts afresh\n", checkpoint);
    if (start.found) {
        if (rank == 0 && at.epoch >= s->epochs)
            printf("resumed from %s: finished (%ld steps), only evaluated\n", checkpoint, at.step);
        else if (rank == 0 && at.world == world)
            printf("resumed from %s: epoch %d, batch %d, step %ld\n", checkpoint, at.epoch + 1, at.batch, at.step);
        /* Another number of processes that divides the global batch B
           sees the same global batches: batch j is positions [j B, (j + 1) B)
           of the epoch's order, however the sampler deals them out (only
           the padding at the epoch's end differs). So batch j is where to
           go on, and only the sums' order changes the bits. */
        else if (rank == 0)
            printf("resumed from %s: epoch %d, batch %d, step %ld (saved by %d processes: the epoch's order is "
                   "re-split over %d)\n", checkpoint, at.epoch + 1, at.batch, at.step, at.world, world);
    }
    mgpu_sampler *sampler = mgpu_sampler_new(train_set->n, world, rank, 1, s->seed, 0);
    mgpu_loader *loader = mgpu_loader_new(train_set, s->global_batch / world, 0, s->seed);
    mgpu_loader_set_sampler(loader, sampler);
    int steps = mgpu_loader_num_batches(loader);
    long step = at.step;
    mgpu_synchronize_all(); /* the model's queued initialisation belongs to building it, not to the epoch */
    double train_seconds = 0, result_acc = -1;
    int timed_epochs = 0;
    for (int epoch = at.epoch; epoch < s->epochs; epoch++) {
        mgpu_sampler_set_epoch(sampler, epoch); /* forget it, and every epoch has epoch 0's order */
        int first = epoch == at.epoch ? at.batch : 0;
        mgpu_loader_start_epoch_at(loader, epoch, first);
        mgpu_net_set_training(net, 1);
        double start = mgpu_now();
        mgpu_batch b;
        for (int i = first; mgpu_loader_next(loader, &b); i++) {
            if (s->kill_at_step && step == s->kill_at_step && world == s->kill_in_world && rank == world - 1)
                raise(SIGKILL);
            long total = (long)steps * s->epochs;
            float lr = s->lr_to_zero ? s->lr * (float)(total - step) / (float)total : s->lr;
            mgpu_data_parallel_step(ddp, b.x, b.y, lr, s->momentum, 0.0f);
            step++;
            if (s->checkpoint_every && step % s->checkpoint_every == 0 && i + 1 < steps) {
                mgpu_checkpoint_info info = {epoch, i + 1, step, world, now};
                mgpu_group_barrier(g); /* every rank has finished the steps the file says are done */
                if (rank == 0) mgpu_checkpoint_save(net, checkpoint, &info);
            }
        }
        /* this rank's loss and accuracy, then every rank's in the seed's words */
        double mine[2];
        mgpu_data_parallel_take_stats(ddp, &mine[0], &mine[1]); /* waits for the steps */
        double seconds = mgpu_now() - start;
        int samples = mgpu_sampler_num_samples(sampler) - first * (s->global_batch / world);
        double *all = (double *)mgpu_malloc(sizeof mine * (size_t)world);
        mgpu_group_all_gather_host(g, mine, sizeof mine, all);
        double total[2] = {0, 0};
        for (int r = 0; r < world; r++) {
            if (rank == 0)
                printf("Rank: %d | Epoch [%d/%d] | Avg. Loss: %.3f | Accuracy: %.3f%%\n", r, epoch + 1,
                       s->epochs, all[2 * r] / samples, 100.0 * all[2 * r + 1] / samples);
            total[0] += all[2 * r];
            total[1] += all[2 * r + 1];
        }
        free(all);
        double test_acc = mgpu_dist_evaluate_accuracy(g, net, test_set, 256);
        if (first == 0) {
            train_seconds += seconds;
            timed_epochs++;
        }
        double ys[3] = {total[0] / (samples * world), total[1] / (samples * world), test_acc};
        if (animator) mgpu_animator_add(animator, epoch + 1, ys);
        mgpu_checkpoint_info info = {epoch + 1, 0, step, world, now};
        mgpu_group_barrier(g);
        if (rank == 0) mgpu_checkpoint_save(net, checkpoint, &info);
        result_acc = test_acc;
    }
    run_result result = {0, 0, result_acc, mgpu_data_parallel_algorithm(ddp)};
    double per_epoch = timed_epochs ? train_seconds / timed_epochs : 0;
    result.seconds_per_epoch = per_epoch;
    result.images_per_second = per_epoch > 0 ? (double)mgpu_sampler_total_size(sampler) / per_epoch : 0;
    if (result.test_acc < 0) result.test_acc = mgpu_dist_evaluate_accuracy(g, net, test_set, 256);
    uint64_t hash = parameters_hash(net);
    char where[64];
    snprintf(where, sizeof where, "%d process%s", world, world > 1 ? "es" : "");
    if (s->devices_per_process > 1)
        snprintf(where + strlen(where), sizeof where - strlen(where), " x %d devices", s->devices_per_process);
    if (rank == 0)
        printf("test acc: %.2f, %.*f sec/epoch, %.0f images/sec, on %s (gradients: %s); parameters' hash %016llx\n",
               result.test_acc, MGPU_SECONDS(per_epoch), result.images_per_second, where, result.path,
               (unsigned long long)hash);
    fflush(stdout);
    mgpu_loader_free(loader);
    mgpu_sampler_free(sampler);
    mgpu_data_parallel_free(ddp);
    mgpu_net_free(net);
    return result;
}

/* The allreduce of a gradient's size on group g: milliseconds (median of
   9), and the bandwidths nccl-tests reports: algbw = bytes / time, busbw
   = algbw * 2 (k - 1) / k, what each link carried. */
static double allreduce_ms(mgpu_group *g, mgpu_device *dev, size_t floats) {
    mgpu_tensor *t = mgpu_zeros(dev, mgpu_shape1((int)floats));
    double times[9], *every = (double *)mgpu_malloc(sizeof(double) * (size_t)mgpu_group_size(g));
    for (int i = 0; i < 9; i++) {
        mgpu_group_barrier(g);
        double start = mgpu_now();
        mgpu_group_allreduce(g, t, MGPU_MEAN);
        mgpu_synchronize(dev);
        double mine = (mgpu_now() - start) * 1e3;
        mgpu_group_all_gather_host(g, &mine, sizeof mine, every);
        times[i] = 0; /* the slowest rank's time */
        for (int r = 0; r < mgpu_group_size(g); r++) times[i] = every[r] > times[i] ? every[r] : times[i];
    }
    free(every);
    mgpu_free(t);
    for (int i = 1; i < 9; i++) /* (insertion sort: the median of 9) */
        for (int j = i; j > 0 && times[j] < times[j - 1]; j--) {
            double swap = times[j];
            times[j] = times[j - 1];
            times[j - 1] = swap;
        }
    return times[4];
}

/* One traced step on every rank of g, drawn by rank 0 as one timeline:
   two lanes a rank (compute, and the communication queue where the
   buckets' allreduces run under the backward pass), each bar coloured by
   its operation's kind of work. On CPU devices the tracer records an
   allreduce in two parts: until every rank has reached it (kind "waiting
   for the other ranks"), then the moving and adding of the gradients
   ("communication"). */
static void ranks_timeline(mgpu_group *g, const settings *s, const mgpu_dataset *train_set, const mgpu_options *o) {
    enum { MAX_BARS = 512, MAX_LANES = 32 };
    int rank = mgpu_group_rank(g), world = mgpu_group_size(g), per = s->devices_per_process;
    mgpu_device *devs[MGPU_MAX_DEVICES];
    mgpu_net *net = model(g, s, devs);
    mgpu_data_parallel *ddp = wrapped_model(g, s, devs, net);
    int rows = s->global_batch / world;
    mgpu_dataset part = *train_set;
    part.n = rows;
    mgpu_loader *loader = mgpu_loader_new(&part, rows, 0, 0);
    mgpu_loader_start_epoch(loader, 0);
    mgpu_batch b;
    MGPU_REQUIRE(mgpu_loader_next(loader, &b), "chapter4: no batch for the timeline");
    mgpu_data_parallel_step(ddp, b.x, b.y, s->lr, 0.0f, 0.0f); /* warm-up: buckets, caches */
    mgpu_group_barrier(g);
    mgpu_trace_begin();
    mgpu_data_parallel_step(ddp, b.x, b.y, s->lr, 0.0f, 0.0f);
    mgpu_trace_end();
    /* two lanes a device of each rank: compute, and communication */
    mgpu_timeline_bar mine[MAX_BARS];
    memset(mine, 0, sizeof mine);
    int n = mgpu_trace_count() < MAX_BARS ? mgpu_trace_count() : MAX_BARS;
    for (int i = 0; i < n; i++) {
        mgpu_trace_op op = mgpu_trace_get(i);
        int d = 0;
        while (d + 1 < per && devs[d] != op.device) d++;
        mine[i].lane = 2 * (rank * per + d) + op.lane;
        mine[i].start_ms = op.start_ms;
        mine[i].end_ms = op.end_ms;
        snprintf(mine[i].name, sizeof mine[i].name, "%s", op.kind);
    }
    for (int i = n; i < MAX_BARS; i++) mine[i].lane = -1; /* (no bar: left out) */
    mgpu_timeline_bar *all = (mgpu_timeline_bar *)mgpu_malloc(sizeof mine * (size_t)world);
    mgpu_group_all_gather_host(g, mine, sizeof mine, all);
    if (rank == 0) {
        char names[MAX_LANES][40], path[1024], title[160];
        const char *lanes[MAX_LANES];
        int nlanes = 2 * world * per < MAX_LANES ? 2 * world * per : MAX_LANES;
        for (int l = 0; l < nlanes; l++) {
            if (per > 1)
                snprintf(names[l], sizeof names[l], "rank %d device %d %s", l / 2 / per, l / 2 % per,
                         l % 2 ? "comm" : "compute");
            else
                snprintf(names[l], sizeof names[l], "rank %d %s", l / 2, l % 2 ? "comm" : "compute");
            lanes[l] = names[l];
        }
        snprintf(title, sizeof title, "one %s step on %d processes: buckets averaged under backward",
                 s->resnet ? "ResNet-18" : "LeNet", world);
        if (mgpu_timeline_write_png(mgpu_out_path(o, "chapter4_ranks_timeline.png", path, sizeof path), title,
                                    nlanes, lanes, MAX_BARS * world, all) == 0) {
            printf("ranks' timeline: %s\n", path);
            if (world > 1 && !s->use_gpu) /* (a GPU's collectives run on the calling thread, untraced) */
                printf("  an allreduce there is two bars on a comm lane: \"waiting for the other ranks\" (until every\n"
                       "  rank reached that bucket), then \"communication\" (moving and adding the gradients, beside\n"
                       "  the backward pass, on the same cores); the table's allreduce ms is one allreduce of all the\n"
                       "  gradients alone, just after a barrier: next to no waiting.\n");
        }
    }
    free(all);
    mgpu_loader_free(loader);
    mgpu_data_parallel_free(ddp);
    mgpu_net_free(net);
}

/* How many processes' worth of hardware k processes of the job have
   under them: k, unless they share it. On a CPU each process computes
   on mgpu_num_cores() cores, and this machine has so many (the job's
   other machines taken as alike); on GPUs, as many as there are. */
static double capacity(mgpu_group *everyone, const settings *s, int k) {
    int hosts = mgpu_group_size(everyone) / mgpu_group_local_size(everyone);
    double units = s->use_gpu ? (double)mgpu_num_gpus() * hosts
                              : (double)sysconf(_SC_NPROCESSORS_ONLN) * hosts / mgpu_num_cores();
    return k < units ? k : units;
}

/* The chapter's last lines (rank 0), from its own numbers: whether the
   runs trained the same model, and whether each speedup is one the
   hardware allows. */
static void what_this_run_shows(mgpu_group *everyone, const settings *s, const int *ks, const run_result *r,
                                const double *speedups, int nruns) {
    double lowest = r[0].test_acc, highest = r[0].test_acc;
    char accuracies[128] = "", counts[64] = "";
    for (int i = 0; i < nruns; i++) {
        lowest = fmin(lowest, r[i].test_acc), highest = fmax(highest, r[i].test_acc);
        const char *sep = i == 0 ? "" : i + 1 == nruns ? " and " : ", ";
        snprintf(accuracies + strlen(accuracies), sizeof accuracies - strlen(accuracies), "%s%.2f", sep,
                 r[i].test_acc);
        snprintf(counts + strlen(counts), sizeof counts - strlen(counts), "%s%d", sep, ks[i]);
    }
    printf("\nWhat this run shows:\n");
    if (nruns < 2)
        printf("  one process alone: start more (mpirun -np 2 ./chapter4) to compare.\n");
    else if (highest - lowest <= 0.05)
        printf("  %s processes reached test accuracies of %s on the same global batch:\n"
               "  the same model, as expected. Each process computed the gradient of its share,\n"
               "  and the allreduce summed them: only the order of the sums changed%s.\n",
               counts, accuracies, s->resnet && !s->sync_bn ? " (and batch norm's\n  statistics, taken per process)" : "");
    else
        printf("  %s processes reached test accuracies of %s on the same global batch:\n"
               "  %.2f apart, more than the order of the sums%s explains. Train longer (--epochs)\n"
               "  for the runs to settle.\n",
               counts, accuracies, highest - lowest, s->resnet && !s->sync_bn ? " (and batch norm's per-process statistics)" : "");
    int held = 1;
    for (int i = 1; i < nruns; i++) {
        char figure[64];
        snprintf(figure, sizeof figure, "speedup of %d processes", ks[i]);
        double most = capacity(everyone, s, ks[i]);
        held &= mgpu_bound_hold(figure, speedups[i], MGPU_AT_MOST, most, 0.05,
                                "rerun on a quiet machine, with no more processes than cores");
        snprintf(figure, sizeof figure, "efficiency of %d processes", ks[i]);
        held &= mgpu_bound_hold(figure, speedups[i] / ks[i], MGPU_AT_MOST, 1.0, 0.05,
                                "rerun on a quiet machine, with no more processes than cores");
    }
    if (nruns >= 2 && held) {
        int k = ks[nruns - 1];
        double most = capacity(everyone, s, k);
        printf("  %d processes did %.2f times the work of one a second, where the hardware under\n"
               "  them allows %.0f%s.\n", k, speedups[nruns - 1], most,
               most < k ? (s->use_gpu ? " (they share GPUs)" : " (they share the cores, each process on its own share)")
                        : "");
        if (speedups[nruns - 1] < 0.75 * most)
            printf("  The rest went to the allreduce and to waiting for the slowest rank at each\n"
                   "  bucket (the ranks' timeline shows both): %s's step is too small here for\n"
                   "  more processes to pay.\n", s->resnet ? "ResNet-18" : "LeNet");
    }
}

int main(int argc, char **argv) {
    mgpu_group *everyone = mgpu_dist_init(&argc, &argv);
    int rank = mgpu_group_rank(everyone), size = mgpu_group_size(everyone);
    mgpu_options o;
    memset(&o, 0, sizeof o);
    o.seed = 1;
    settings s;
    memset(&s, 0, sizeof s);
    int train_samples = 0, test_samples = 0;
    double momentum = 0;
    const char *model = NULL, *backend = NULL;
    const mgpu_flag extra[] = {
        {"--backend", 's', &backend,
         "nccl or mpi: how the processes' GPUs move gradients (default: nccl where it can start, "
         "else mpi through the host; MGPU_DIST_BACKEND)"},
        {"--devices", 'i', &o.devices, "runs on 1, 2, 4, ... of the job's processes, up to N (default: all)"},
        {"--devices-per-process", 'i', &s.devices_per_process,
         "N devices in each process (default 1): data parallelism inside each process too"},
        {"--batch-size", 'i', &o.batch_size, "the global batch, split among the processes (default 256)"},
        {"--model", 's', &model, "lenet or resnet18 (default: lenet in the reduced run, else resnet18)"},
        {"--momentum", 'z', &momentum, "SGD's momentum (0: none, as the book)"},
        {"--sync-bn", 'b', &s.sync_bn,
         "batch norm's statistics over the global batch, not each process's share (SyncBatchNorm)"},
        {"--train-samples", 'i', &train_samples, "use the first N training images"},
        {"--test-samples", 'i', &test_samples, "use the first N test images"},
        {"--checkpoint-every", 'u', &s.checkpoint_every, "also save a checkpoint every N steps (0: at each epoch's end only)"},
        {"--resume", 'b', &s.resume, "continue each run from its checkpoint, where there is one"},
        {"--kill-at-step", 'i', &s.kill_at_step,
         "the last rank of the last run kills itself (SIGKILL) when N steps are done: to try --resume"},
    };
    mgpu_options_parse(&o, argc, argv,
                       "chapter4: distributed data parallelism, one process per device (mpirun -np N ./chapter4)",
                       extra, (int)(sizeof extra / sizeof extra[0]));
    int use_gpu = !o.cpu && mgpu_num_gpus() > 0;
    s.use_gpu = use_gpu;
    if (!s.devices_per_process) s.devices_per_process = 1;
    /* (checked here, where every rank sees it, not in the 1-process run that the others wait out) */
    if (s.devices_per_process > MGPU_MAX_DEVICES)
        mgpu_group_fatal(everyone, "--devices-per-process %d: at most %d devices", s.devices_per_process,
                         MGPU_MAX_DEVICES);
    int reduced = !use_gpu && !o.full;
    /* (every rank sees a bad setting: mgpu_group_fatal says it once) */
    if (model && strcmp(model, "lenet") != 0 && strcmp(model, "resnet18") != 0)
        mgpu_group_fatal(everyone, "--model %s: want lenet or resnet18", model);
    s.resnet = model ? strcmp(model, "resnet18") == 0 : !reduced;
    if (backend && strcmp(backend, "nccl") != 0 && strcmp(backend, "mpi") != 0)
        mgpu_group_fatal(everyone, "--backend %s: want nccl or mpi", backend);
    if (backend) mgpu_set_dist_backend(strcmp(backend, "nccl") == 0 ? MGPU_BACKEND_NCCL : MGPU_BACKEND_MPI);
    if (s.sync_bn && !s.resnet)
        mgpu_group_fatal(everyone, "--sync-bn: LeNet has no batch norm (add --model resnet18)");
    if (s.sync_bn && s.devices_per_process > 1)
        mgpu_group_fatal(everyone, "--sync-bn: synchronised batch norm needs one device a process, not %d",
                         s.devices_per_process);
    s.global_batch = o.batch_size ? o.batch_size : 256;
    s.epochs = o.epochs ? o.epochs : reduced ? 2 : 10;
    s.lr = (float)(o.lr ? o.lr : s.resnet ? 0.1 : 0.2); /* the book's, for batch 256 */
    /* In the reduced run's few steps the last ones' noise would decide
       the test accuracy: the lr falls to 0 so that the runs settle. */
    s.lr_to_zero = reduced;
    s.momentum = (float)momentum;
    s.seed = o.seed;
    if (!train_samples && reduced) train_samples = 8192;
    if (!test_samples && reduced) test_samples = 2048;
    int most = o.devices ? o.devices : size;
    if (most > size)
        mgpu_group_fatal(everyone, "--devices %d: the job has %d processes (mpirun -np N starts N)", most, size);
    if (s.global_batch % most != 0)
        mgpu_group_fatal(everyone, "--batch-size %d: %d processes cannot split it evenly", s.global_batch, most);
    s.kill_in_world = most;
    s.o = &o;
    if (rank == 0) {
        if (reduced)
            printf("No GPU: a reduced run on CPU processes: %s, %d training images, %d test images, %d epochs, "
                   "lr falling to 0 (--full: ResNet-18 on all of them, 10 epochs).\n", s.resnet ? "ResNet-18" : "LeNet",
                   train_samples, test_samples, s.epochs);
        printf("%d process%s on %s (this is rank 0 of %d, local rank %d of %d); global batch %d, lr %g%s\n", size,
               size > 1 ? "es" : "", mgpu_group_host(everyone), size, mgpu_group_local_rank(everyone),
               mgpu_group_local_size(everyone), s.global_batch, s.lr,
               s.sync_bn ? "; batch norm synchronised over the processes" : "");
    }
    mgpu_dataset *train_set = NULL, *test_set = NULL;
    mgpu_dataset_load_fashion_mnist(mgpu_data_dir(o.data), &train_set, &test_set);
    if (train_samples > train_set->n)
        mgpu_group_fatal(everyone, "--train-samples %d: the training set has %d images", train_samples, train_set->n);
    if (test_samples > test_set->n)
        mgpu_group_fatal(everyone, "--test-samples %d: the test set has %d images", test_samples, test_set->n);
    mgpu_dataset_truncate(train_set, train_samples);
    mgpu_dataset_truncate(test_set, test_samples);
    if (s.global_batch > train_set->n) /* (the timeline's step takes one global batch of them) */
        mgpu_group_fatal(everyone, "--batch-size %d: more than the %d training images", s.global_batch,
                         train_set->n);

    /* The runs: on 1, 2, 4, ... processes, the last on `most`; the
       processes a run leaves out wait for it */
    int ks[8], nruns = 0;
    for (int k = 1; nruns < 8; k *= 2) {
        ks[nruns++] = k < most ? k : most;
        if (k >= most) break;
    }
    run_result results[8];
    mgpu_animator *runs[8];
    char labels[8][32];
    const char *label_ptrs[8];
    for (int i = 0; i < nruns; i++) {
        int k = ks[i];
        mgpu_group *g = mgpu_group_first(everyone, k);
        snprintf(labels[i], sizeof labels[i], "%d process%s", k, k > 1 ? "es" : "");
        label_ptrs[i] = labels[i];
        runs[i] = NULL;
        if (g) {
            char name[64], path[1024];
            snprintf(name, sizeof name, "chapter4_%d_process%s.png", k, k > 1 ? "es" : "");
            const char *series[] = {"train loss", "train acc", "test acc"};
            runs[i] = mgpu_animator_new(rank == 0 ? mgpu_out_path(&o, name, path, sizeof path) : NULL,
                                        labels[i], "epoch", "", 1, s.epochs, 3, series);
            if (rank == 0) printf("\n%d process%s:\n", k, k > 1 ? "es" : "");
            results[i] = train(g, &s, train_set, test_set, runs[i]);
            mgpu_group_free(g);
        }
        mgpu_group_barrier(everyone);
    }

    /* The scaling table, from rank 0's view of each run */
    size_t floats = 0;
    {
        mgpu_net *net = s.resnet ? mgpu_resnet18(10, 1, mgpu_cpu()) : mgpu_lenet(mgpu_cpu());
        floats = mgpu_net_num_weights(net);
        mgpu_net_free(net);
    }
    if (rank == 0) {
        printf("\nscaling, global batch %d (%zu gradients, %.1f MiB):\n", s.global_batch, floats,
               floats * 4.0 / 1048576.0);
        printf("  %9s %12s %8s %10s %13s %13s %13s\n", "processes", "images/sec", "speedup", "efficiency",
               "allreduce ms", "algbw GB/s", "busbw GB/s");
    }
    double speedups[8];
    for (int i = 0; i < nruns; i++) {
        int k = ks[i];
        mgpu_group *g = mgpu_group_first(everyone, k);
        double ms = g ? allreduce_ms(g, mgpu_group_device(g, s.use_gpu), floats) : 0;
        if (g) mgpu_group_free(g);
        if (rank == 0) {
            double algbw = k > 1 ? floats * 4.0 / (ms * 1e-3) / 1e9 : 0;
            speedups[i] = results[0].images_per_second > 0
                              ? results[i].images_per_second / results[0].images_per_second : 0;
            printf("  %9d %12.0f %8.2f %10.2f %13.3f %13.3f %13.3f\n", k, results[i].images_per_second,
                   speedups[i], speedups[i] / k, ms, algbw, algbw * 2.0 * (k - 1) / k);
        }
        mgpu_group_barrier(everyone);
    }

    if (rank == 0) {
        char path[1024];
        if (mgpu_animator_write_combined(mgpu_out_path(&o, "chapter4_test_acc.png", path, sizeof path),
                                         "test accuracy, same global batch", nruns,
                                         (const mgpu_animator *const *)runs, 2, label_ptrs) == 0)
            printf("plots: %s, and one chapter4_<N>_process(es).png per run beside it\n", path);
    }
    mgpu_group *last = mgpu_group_first(everyone, most);
    if (last) ranks_timeline(last, &s, train_set, &o);
    mgpu_group_free(last);
    mgpu_group_barrier(everyone);
    if (rank == 0) what_this_run_shows(everyone, &s, ks, results, speedups, nruns);

    for (int i = 0; i < nruns; i++) mgpu_animator_free(runs[i]);
    mgpu_dataset_free(train_set);
    mgpu_dataset_free(test_set);
    int errors = mgpu_output_errors();
    mgpu_dist_finalize(everyone);
    return errors ? 1 : 0;
}
