/* Chapter 6: model parallelism. Splitting the network, pipelines, and
   splitting layers.

   What it teaches. Dive into Deep Learning names three ways to share a
   network's training among devices: split the data (chapters 2 to 5),
   split the network (consecutive layers on different devices), and split
   the layers (each device computes part of every layer's channels). This
   chapter does the other two.

   Splitting the network (model parallelism; mgpu_pipeline): cut the
   layers into p stages, one a device. The activations go forward from
   stage to stage and their gradients come back. Run naively, one batch
   at a time, stage s + 1 waits for stage s and back again: one device
   works at a time. GPipe (Huang et al. 2019) cuts the batch into m
   micro-batches, so the stages work on different micro-batches at once;
   each stage still idles at the start and the end of a step, a fraction
   (p - 1) / (m + p - 1) of it, the bubble. 1F1B (PipeDream-Flush, as in
   Megatron-LM) orders the same passes so that each backward pass starts
   as early as it can: the same bubble, but stage s keeps the activations
   of at most p - s micro-batches instead of m. Zero bubble (ZB-H1, Qi et
   al. 2023) splits each backward pass into B, the input's gradient,
   which the stage before waits for, and W, the weights', which nobody
   waits for: 1F1B's order with W put off, so that the W passes fill the
   bubble, (p - 1) / (3m + p - 1) of the step with F, B and W equal, a
   third of 1F1B's; each stage then holds p micro-batches. Interleaved
   1F1B (Megatron-LM) gives each device v chunks of smaller stages
   (stages d, d + p, ...), which shortens the bubble to (p - 1) /
   (vm + p - 1). Batch norm takes each micro-batch's statistics, as
   PyTorch's pipelines do.

   Splitting layers (tensor parallelism; mgpu_tp_conv, mgpu_tp_mlp): a
   convolution's output channels divided among the devices, put back
   together by an all-gather; and Megatron's MLP block, a column-parallel
   layer then a row-parallel one, which talks once forward and once
   backward (an allreduce each). The devices then exchange activations,
   not gradients of parameters, and each holds 1/k of the layer.

   The chapter:
     1. trains the network split in 2 stages with 1F1B on Fashion-MNIST
        (chapter6_test_acc.png);
     2. times a step of naive model parallelism, GPipe and 1F1B for m = 1,
        2, 4 and 8 micro-batches on 2 and 4 devices, the bubble measured
        from the trace beside the formula, the speedup over naive beside
        its bound (p, and on CPU devices the cores), and the stages' work
        (their busy time added up): first on layers of fixed duration,
        which wait a fixed time for each image on their device's queue (a
        wait takes no core, so the stages overlap on any machine, and the
        schedule's bubble shows alone), with ZB-H1 for m = p to 8 (its
        formula's range) and interleaved 1F1B with 2 chunks a device for
        m = p to 8 (multiples of p) beside them, then on the network's
        layers, with
        each stage's peak activations beside the schedule's bound and the
        reasons, from the measured work, that their figures differ; one
        timeline per schedule at its most micro-batches
        (chapter6_timeline_<schedule>_<p>_stages_fixed.png and
        chapter6_timeline_<schedule>_<p>_stages.png);
     3. runs the two split layers on 2 and 4 devices against one device,
        with the bytes each moves per step beside data parallelism's;
     4. trains 2 pipelines of 2 stages as data parallelism on 4 devices
        (hybrid parallelism), whose two copies of the network must stay
        equal;
     and ends with what the run shows, from its own figures. Every figure
     is checked against its bound (mgpu_bound_hold): a bubble at least
     its formula less 0.05 (on layers of fixed duration within 0.05 of
     it), a speedup at most the bound above plus 10%, peak activations at
     most the schedule's bound plus 1%; one that breaks its bound is
     said so, in one line beginning "!".

   What you should see (the reduced run on a 2-core CPU): test accuracy
   about 0.5 after 3 epochs of 3072 images. On layers of fixed duration
   the bubble sits within a few hundredths of the formula: 0.50, 0.33,
   0.20 and 0.11 for m = 1, 2, 4 and 8 on 2 stages, ZB-H1's 0.14, 0.08
   and 0.04 for m = 2, 4 and 8, interleaved 1F1B's 0.20, 0.11 and 0.06,
   and the timelines are the textbook's (GPipe's forward passes, then
   the backward ones; 1F1B's alternating once the pipeline is full;
   ZB-H1's W bars in the gaps 1F1B leaves; interleaved 1F1B's chunks
   taking turns on each device). On the network's
   layers the bubble stays well above the formula and the speedup over
   naive is small or below 1: the lines after each table say why, from
   the measured work: 2 CPU devices of one core each share the machine's
   2 cores with whatever else runs there (4 devices share them two to a
   core), and micro-batches of 16 images run a core at another speed
   than the whole batch (bench/RESULTS.md has measured figures). 1F1B's
   first stage holds 2 micro-batches of activations where GPipe's holds
   all 8 (the whole batch's), whatever the machine. The split layers
   equal one device to about 1e-6; the MLP moves fewer bytes split than
   data parallelism would, the convolution, whose activations outweigh
   its weights, more.

   Without a GPU it runs a reduced setting (3 epochs of 3072 images, batch
   128, 3 timed steps a schedule); --full, or a GPU, trains on all 60000
   images for 10 epochs with batch 256 and times 10 steps. The layers of
   fixed duration run on CPU devices even where there is a GPU: they
   wait on the host.

   Reads: mgpu/pipelines.h (stages, micro-batches, GPipe, 1F1B, ZB-H1,
   interleaved 1F1B),
   mgpu/networks.h (mgpu_net_add_layer: a layer of your own, here the
   fixed-duration one), mgpu/tensor_parallel.h (split layers),
   mgpu/groups.h (stages on ranks), mgpu/timing.h (the trace, and
   mgpu_bound_hold) and mgpu/plots.h (the schedules' timelines),
   mgpu/flags.h. */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"

#define BLOCKS 8 /* equal blocks, so that 2 and 4 stages share them evenly */
#define MOST_MICRO_BATCHES 8
#define MAX_STEPS 64 /* timed steps a schedule */
/* How far a measured bubble may stray from (p - 1) / (m + p - 1): a
   pass starts when its device's thread wakes, a little after what it
   waits for is done. */
#define BUBBLE_SLACK 0.05
/* How far, relative, a speedup may pass its bound: micro-batches may fit
   the caches where the whole batch does not. */
#define SPEEDUP_SLACK 0.10
/* How far, relative, a stage's peak activations may pass the schedule's
   bound: the last stage's loss keeps a few values a micro-batch. */
#define PEAK_SLACK 0.01
/* The split layers against one device: float32's sums in another order. */
#define SPLIT_TOLERANCE 1e-5

/* The chapter's network: a stem (a 3x3 convolution at stride 2: 28x28
   images to 14x14, batch norm, ReLU), BLOCKS equal blocks (a 3x3
   convolution of `width` channels, batch norm, ReLU), global pooling and
   a linear layer. first[s] gets stage s's first layer, for `stages`
   stages of equal numbers of blocks: the stem goes with the first and
   the head with the last. (A ReLU after batch norm joins it: one layer.) */
static mgpu_net *convnet(mgpu_device *dev, int width, int stages, int *first) {
    mgpu_net *net = mgpu_net_new(dev);
    mgpu_net_add_conv(net, 1, width, 3, 2, 1);
    mgpu_net_add_batchnorm(net, width);
    mgpu_net_add_relu(net);
    first[0] = 0;
    for (int b = 0; b < BLOCKS; b++) {
        if (b > 0 && b * stages % BLOCKS == 0) first[b * stages / BLOCKS] = net->nlayers;
        mgpu_net_add_conv(net, width, width, 3, 1, 1);
        mgpu_net_add_batchnorm(net, width);
        mgpu_net_add_relu(net);
    }
    mgpu_net_add_global_avg_pool(net);
    mgpu_net_add_linear(net, width, 10);
    return net;
}

/* Layers of fixed duration: a block that passes its input on unchanged
   and waits a fixed time for each image of the micro-batch, forward,
   and as long again backward for each of the two gradients it computes,
   the input's and the weights' (which ZB-H1 runs apart, as B and W: the
   layer says it can, l->split_backward). As a layer of one's own with
   own_loops 1 (mgpu.h, the
   NETWORKS section), each pass runs on its device's queue, in order with
   the pipeline's other work there. A wait takes no core, so stages of
   these overlap on any machine, as stages on devices of their own do:
   what a schedule does to the bubble shows alone. */
#define FIXED_BLOCK_MS 8.0  /* a block's forward pass of the whole batch, whatever its size */
static double fixed_ms_per_image; /* FIXED_BLOCK_MS / batch: the layers' settings */
static void wait_ms(double ms) {
    struct timespec left = {(time_t)(ms / 1e3), (long)(fmod(ms, 1e3) * 1e6)};
    while (nanosleep(&left, &left) != 0 && errno == EINTR) {} /* (a signal cuts it short: wait the rest) */
}
static void fixed_forward(mgpu_layer *l, mgpu_tensor *y, const mgpu_tensor *x, int training) {
    (void)training;
    memcpy(y->data, x->data, x->numel * sizeof(float));
    wait_ms(*(const double *)l->settings * x->shape.d[0]);
}
static void fixed_backward(mgpu_layer *l, mgpu_tensor *dx, mgpu_tensor *dweight, mgpu_tensor *dbias,
                           const mgpu_tensor *dy, const mgpu_tensor *x, const mgpu_tensor *y) {
    (void)dbias, (void)x, (void)y;
    if (dx) memcpy(dx->data, dy->data, dy->numel * sizeof(float));
    wait_ms(((dx != NULL) + (dweight != NULL)) * *(const double *)l->settings * dy->shape.d[0]);
}
static const mgpu_layer_fns fixed_duration = {"fixed", NULL, fixed_forward, fixed_backward, 1};

/* BLOCKS layers of fixed duration, for inputs of 10 values a row (the
   loss reads them as they come), after a first layer that takes no time
   and has no parameters (it gets no backward pass): a network's first
   layer computes no input gradient, and every block here must compute
   both. Each block has a weight of one value, never used, for its
   weights' gradient to be asked for. first[s] gets stage s's first
   layer, for `stages` stages of equal numbers of blocks. */
static mgpu_net *fixed_net(mgpu_device *dev, int stages, int *first) {
    static double no_time = 0.0;
    mgpu_net *net = mgpu_net_new(dev);
    mgpu_net_add_layer(net, &fixed_duration, NULL, NULL, &no_time);
    for (int b = 0; b < BLOCKS; b++)
        mgpu_net_add_layer(net, &fixed_duration, mgpu_zeros(dev, mgpu_shape1(1)), NULL, &fixed_ms_per_image)
            ->split_backward = 1;
    for (int s = 0; s < stages; s++) first[s] = s == 0 ? 0 : 1 + s * BLOCKS / stages;
    return net;
}

typedef struct {
    const char *name;
    mgpu_schedule_fn schedule;
    int (*in_flight)(int stage, int stages, int m); /* the micro-batches whose activations a stage holds at most */
    double (*bubble_formula)(int stages, int m);
    int least_m; /* (ZB-H1's formula holds for m >= p: 0 there) */
} schedule_choice;
static int gpipe_in_flight(int stage, int stages, int m) { return (void)stage, (void)stages, m; }
static int one_f_one_b_in_flight(int stage, int stages, int m) { return m < stages - stage ? m : stages - stage; }
static int zb_h1_in_flight(int stage, int stages, int m) { return (void)stage, m < stages ? m : stages; }
/* GPipe and 1F1B on both kinds of layers, ZB-H1 on those of fixed
   duration (its network's runs would lengthen the chapter) */
#define SCHEDULES 3
static const schedule_choice choices[SCHEDULES] = {
    {"GPipe", mgpu_schedule_gpipe, gpipe_in_flight, mgpu_pipeline_bubble_formula, 1},
    {"1F1B", mgpu_schedule_1f1b, one_f_one_b_in_flight, mgpu_pipeline_bubble_formula, 2},
    {"ZB-H1", mgpu_schedule_zb_h1, zb_h1_in_flight, mgpu_pipeline_zb_h1_bubble_formula, 0}};

static double mib(size_t bytes) { return (double)bytes / 1048576.0; }

/* 1. Trains the network in 2 stages, 1F1B, m micro-batches. */
static void train(int width, int batch, int m, int epochs, double lr, int use_gpu, const mgpu_dataset *train_set,
                  const mgpu_dataset *test_set, const mgpu_options *o) {
    mgpu_device *devs[2];
    mgpu_devices(2, use_gpu, devs);
    mgpu_manual_seed(o->seed);
    int first[2];
    mgpu_net *net = convnet(devs[0], width, 2, first);
    mgpu_pipeline *pp = mgpu_pipeline_new(net, devs, 2, first);
    mgpu_pipeline_set_schedule(pp, mgpu_schedule_1f1b, m);
    char list[128], path[1024], title[256];
    mgpu_device_list(list, sizeof list, devs, 2);
    snprintf(title, sizeof title, "2 stages on %s, 1F1B, m = %d", list, m);
    const char *series[] = {"train loss", "train acc", "test acc"};
    mgpu_animator *animator = mgpu_animator_new(mgpu_out_path(o, "chapter6_test_acc.png", path, sizeof path), title,
                                                "epoch", "", 1, epochs, 3, series);
    mgpu_loader *loader = mgpu_loader_new(train_set, batch, 1, o->seed);
    mgpu_loader_set_drop_last(loader, 1); /* (every step m micro-batches of the same size) */
    mgpu_tensor *loss_sum = mgpu_zeros(devs[1], mgpu_shape1(1));
    printf("\n1. Training in 2 stages on %s: 1F1B, %d micro-batches of %d images, lr %g\n", list, m, batch / m, lr);
    for (int epoch = 0; epoch < epochs; epoch++) {
        mgpu_loader_start_epoch(loader, epoch);
        mgpu_fill(loss_sum, 0.0f);
        mgpu_batch b;
        int seen = 0;
        while (mgpu_loader_next(loader, &b)) {
            mgpu_pipeline_train_step(pp, b.x, b.y, (float)lr, 0.9f, 0.0f, loss_sum);
            seen += b.n;
        }
        double loss = mgpu_item(loss_sum, 0) / seen;
        double train_acc = mgpu_pipeline_evaluate_accuracy(pp, train_set, 256);
        double test_acc = mgpu_pipeline_evaluate_accuracy(pp, test_set, 256);
        double ys[3] = {loss, train_acc, test_acc};
        mgpu_animator_add(animator, epoch + 1, ys);
        printf("  epoch %d: loss %.3f, train acc %.3f, test acc %.3f\n", epoch + 1, loss, train_acc, test_acc);
    }
    printf("test acc: %.2f, after %d epoch%s (%s)\n", mgpu_animator_last(animator, 2), epochs, epochs > 1 ? "s" : "",
           path);
    mgpu_free(loss_sum);
    mgpu_loader_free(loader);
    mgpu_animator_free(animator);
    mgpu_pipeline_free(pp);
    mgpu_net_free(net);
}

/* A step's batch: the first `batch` training images. */
static void first_images(const mgpu_dataset *data, int batch, mgpu_tensor **x, mgpu_tensor **y) {
    mgpu_loader *loader = mgpu_loader_new(data, batch, 0, 0);
    mgpu_loader_start_epoch(loader, 0);
    mgpu_batch b;
    MGPU_REQUIRE(mgpu_loader_next(loader, &b), "chapter6: no training images");
    *x = mgpu_to(b.x, mgpu_cpu(), 0);
    *y = mgpu_to(b.y, mgpu_cpu(), 0);
    mgpu_loader_free(loader);
}

/* The least of n values. */
static double least(double *values, int n) {
    double low = values[0];
    for (int i = 1; i < n; i++) low = fmin(low, values[i]);
    return low;
}

typedef struct {
    double step_ms, bubble, work_ms, peak_mib[MGPU_MAX_DEVICES];
} step_measure;

/* Runs `steps` traced steps of the pipeline (after one to warm up): the
   step's time, its bubble and its work (the stages' busy times added
   up), each `statistic` of the steps' (the least, or the median), and
   each stage's peak activations over the steps. The last step's trace
   stays, for its timeline. */
static step_measure measure_steps(mgpu_pipeline *pp, mgpu_device **devs, int stages, const mgpu_tensor *x,
                                  const mgpu_tensor *y, int steps, double (*statistic)(double *, int)) {
    step_measure r;
    /* (zeroed: where it inlines this function, the compiler cannot always
       see that steps is at least 1) */
    double ms[MAX_STEPS] = {0}, bubble[MAX_STEPS] = {0}, work_ms[MAX_STEPS] = {0};
    mgpu_pipeline_train_step(pp, x, y, 0.01f, 0.0f, 0.0f, NULL);
    mgpu_synchronize_all();
    for (int s = 0; s < stages; s++) mgpu_device_reset_peak(devs[s]);
    for (int i = 0; i < steps; i++) {
        mgpu_trace_begin();
        double start = mgpu_now();
        mgpu_pipeline_train_step(pp, x, y, 0.01f, 0.0f, 0.0f, NULL);
        mgpu_synchronize_all();
        ms[i] = 1e3 * (mgpu_now() - start);
        mgpu_trace_end();
        mgpu_pipeline_timing t = mgpu_pipeline_measure(pp);
        bubble[i] = t.bubble_mean;
        work_ms[i] = 0;
        for (int s = 0; s < stages; s++) work_ms[i] += t.busy_ms[s];
    }
    r.step_ms = statistic(ms, steps);
    r.bubble = statistic(bubble, steps);
    r.work_ms = statistic(work_ms, steps);
    for (int s = 0; s < stages; s++) r.peak_mib[s] = mib(mgpu_device_memory_peak_of(devs[s], MGPU_MEMORY_ACTIVATIONS));
    return r;
}

/* What section 2 keeps of a pipeline's runs, for its explanations and
   the chapter's last lines. */
typedef struct {
    int stages, peaks_held; /* peaks_held: every stage's peak activations kept its bound */
    double naive_ms, naive_work_ms;
    double worst_gap; /* the bubble's largest distance from the formula, at any m */
    /* at MOST_MICRO_BATCHES, each schedule's: */
    double bubble[SCHEDULES], speedup[SCHEDULES], work_ms[SCHEDULES], first_stage_mib[SCHEDULES];
    double alone_work_ms; /* the work of MOST_MICRO_BATCHES micro-batches run alone, one after another */
    double interleaved_bubble; /* interleaved 1F1B's, layers of fixed duration, at MOST_MICRO_BATCHES */
} pipeline_runs;

static void print_row(const char *name, int m, const step_measure *r, double formula, double speedup) {
    printf("  %-11s %3d %9.1f %8.3f %8.3f %8.2f %9.1f\n", name, m, r->step_ms, r->bubble, formula, speedup,
           r->work_ms);
}

/* One row's checks: the bubble at least its formula (on layers of fixed
   duration, which share nothing, at most it too), the speedup at most
   its bound. */
static void check_row(const char *schedule, int stages, int m, int fixed, double bubble, double formula,
                      double speedup, double speedup_bound) {
    char figure[96];
    double slack = BUBBLE_SLACK / formula;
    const char *what = fixed ? "of fixed duration" : "of the network";
    snprintf(figure, sizeof figure, "%s's bubble at m = %d on %d stages %s", schedule, m, stages, what);
    mgpu_bound_hold(figure, bubble, MGPU_AT_LEAST, formula, slack,
                    fixed ? "a stage's wait ran long, which the trace counts as busy"
                          : "stages that share the cores work slower while they overlap, which the trace counts "
                            "as busy");
    if (fixed)
        mgpu_bound_hold(figure, bubble, MGPU_AT_MOST, formula, slack,
                        "its devices' threads woke late; run it on a quieter machine");
    snprintf(figure, sizeof figure, "%s's speedup at m = %d on %d stages %s", schedule, m, stages, what);
    mgpu_bound_hold(figure, speedup, MGPU_AT_MOST, speedup_bound, SPEEDUP_SLACK,
                    "its micro-batches may fit the caches better than the whole batch");
}

/* Each stage's peak activations beside the schedule's bound, checked:
   naive holds one micro-batch, the whole batch, and the largest of m
   micro-batches is 1/m of it, rounded up. by_m[k][m]: schedule k's
   measures at m. Returns whether every bound held. */
static int print_peaks(int stages, int batch, step_measure by_m[SCHEDULES][MOST_MICRO_BATCHES + 1]) {
    const step_measure *naive = &by_m[0][1];
    int held = 1;
    printf("  peak activations a stage, MiB, and the schedule's bound:\n  %-7s %3s", "", "m");
    for (int s = 0; s < stages; s++) printf("  stage %d  bound", s);
    printf("\n");
    for (int k = 0; k < 2; k++)
        for (int m = k == 0 ? 1 : 2; m <= MOST_MICRO_BATCHES; m *= 2) {
            const char *name = m == 1 ? "naive" : choices[k].name;
            double bound[MGPU_MAX_DEVICES];
            printf("  %-7s %3d", name, m);
            for (int s = 0; s < stages; s++) {
                double one = naive->peak_mib[s] * ((batch + m - 1) / m) / batch;
                bound[s] = choices[k].in_flight(s, stages, m) * one;
                printf(" %8.2f %6.2f", by_m[k][m].peak_mib[s], bound[s]);
            }
            printf("\n");
            for (int s = 0; s < stages; s++) {
                char figure[96];
                snprintf(figure, sizeof figure, "%s's peak activations at m = %d on stage %d in MiB", name, m, s);
                held &= mgpu_bound_hold(figure, by_m[k][m].peak_mib[s], MGPU_AT_MOST, bound[s], PEAK_SLACK,
                                        "or the schedule holds more micro-batches than it should");
            }
        }
    return held;
}

/* How a device runs a micro-batch, from the ratio of its time alone to
   the whole batch's. */
static const char *efficiency(double ratio) {
    return ratio > 1.05 ? "less efficiently than" : ratio < 0.95 ? "more efficiently than" : "about as efficiently as";
}

/* Why the network's layers fall short of the formula where the fixed
   ones do not, from the runs' own figures: the same work may take
   longer in micro-batches, and longer again where the stages share the
   machine; a speedup is p (1 - bubble) naive's step over the work. */
static void explain_network_runs(const pipeline_runs *r, int batch, mgpu_device *dev) {
    int p = r->stages, m = MOST_MICRO_BATCHES;
    double alone = r->alone_work_ms / r->naive_work_ms, shared = r->work_ms[1] / r->alone_work_ms;
    int cores = mgpu_num_cores(), threads = cores / p > 1 ? cores / p : 1; /* (mgpu_devices' share) */
    printf("  Why: at m = %d the stages' work was %.0f ms for GPipe and %.0f for 1F1B, against naive's %.0f.\n"
           "  %d micro-batches of %d images run alone, one after another, took %.0f ms, %.2f times naive's: a\n"
           "  micro-batch runs a device %s the whole batch. In 1F1B they took %.2f times that",
           m, r->work_ms[0], r->work_ms[1], r->naive_work_ms, m, batch / m, r->alone_work_ms, alone,
           efficiency(alone), shared);
    if (shared < 0.95)
        printf(":\n  less than alone: other work on the machine, or its caches, favoured this run over those alone.\n");
    else if (shared <= 1.05)
        printf(":\n  sharing the machine cost them little.\n");
    else if (mgpu_device_is_gpu(dev))
        printf(":\n  its %d stages share %d GPU%s.\n", p, mgpu_num_gpus(), mgpu_num_gpus() > 1 ? "s" : "");
    else
        printf(":\n  its %d devices of %d thread%s each share %d cores, and any other work there.\n", p,
               threads, threads > 1 ? "s" : "", cores);
    printf("  Speedup = p (1 - bubble) naive's step / work: for 1F1B %d x %.2f x %.0f / %.0f = %.2f.\n", p,
           1 - r->bubble[1], r->naive_ms, r->work_ms[1], p * (1 - r->bubble[1]) * r->naive_ms / r->work_ms[1]);
}

/* Interleaved 1F1B on layers of fixed duration: CHUNKS stages on each of
   `stages` devices, m = stages to MOST_MICRO_BATCHES (multiples of the
   devices, as Megatron's schedule takes), beside naive's step (naive_ms)
   on the same devices; its rows, checked as the others are, and its
   timeline at the most micro-batches. Returns the bubble there, and
   widens *worst_gap to its rows' largest distance from the formula. */
#define CHUNKS 2
static double interleaved_rows(int stages, mgpu_device **devs, double naive_ms, double speedup_bound, int steps,
                               const mgpu_tensor *x, const mgpu_tensor *y, const mgpu_options *o,
                               double *worst_gap) {
    int first[MGPU_MAX_DEVICES];
    mgpu_net *net = fixed_net(devs[0], stages * CHUNKS, first);
    mgpu_pipeline *pp = mgpu_pipeline_new_interleaved(net, devs, stages, CHUNKS, first);
    double bubble = 0;
    for (int m = stages; m <= MOST_MICRO_BATCHES; m *= 2) {
        mgpu_pipeline_set_interleaved_schedule(pp, mgpu_schedule_interleaved_1f1b, m);
        step_measure r = measure_steps(pp, devs, stages, x, y, steps, least);
        double speedup = naive_ms / r.step_ms, formula = mgpu_pipeline_interleaved_bubble_formula(stages, CHUNKS, m);
        print_row("interleaved", m, &r, formula, speedup);
        check_row("interleaved 1F1B", stages, m, 1, r.bubble, formula, speedup, speedup_bound);
        bubble = r.bubble;
        *worst_gap = fmax(*worst_gap, fabs(r.bubble - formula));
    }
    char file[96], path[1024], title[128];
    snprintf(file, sizeof file, "chapter6_timeline_interleaved_%d_stages_fixed.png", stages);
    snprintf(title, sizeof title, "interleaved 1F1B, %d chunks on %d devices, %d micro-batches, layers of fixed "
             "duration", CHUNKS, stages, MOST_MICRO_BATCHES);
    mgpu_pipeline_write_timeline(pp, mgpu_out_path(o, file, path, sizeof path), title);
    mgpu_pipeline_free(pp);
    mgpu_net_free(net);
    return bubble;
}

/* 2. Naive model parallelism, GPipe and 1F1B on `stages` devices: of
   layers of fixed duration (fixed 1), on CPU devices, or of the
   chapter's network. */
static pipeline_runs schedules(int fixed, int stages, int width, int batch, int steps, int use_gpu,
                               const mgpu_tensor *x, const mgpu_tensor *y, const mgpu_options *o) {
    pipeline_runs runs;
    memset(&runs, 0, sizeof runs);
    runs.stages = stages;
    mgpu_device *devs[MGPU_MAX_DEVICES];
    mgpu_devices(stages, use_gpu && !fixed, devs);
    mgpu_manual_seed(o->seed);
    int first[MGPU_MAX_DEVICES];
    mgpu_net *net = fixed ? fixed_net(devs[0], stages, first) : convnet(devs[0], width, stages, first);
    mgpu_pipeline *pp = mgpu_pipeline_new(net, devs, stages, first);
    int cores = mgpu_num_cores();
    double speedup_bound = fixed || mgpu_device_is_gpu(devs[0]) || cores >= stages ? stages : (double)cores;
    char list[256];
    mgpu_device_list(list, sizeof list, devs, stages);
    printf("\n  %s, %d stages on %s (the %s of %d step%s):\n",
           fixed ? "Layers of fixed duration" : "The network's layers", stages, list, fixed ? "least" : "median", steps,
           steps > 1 ? "s" : "");
    printf("  %-11s %3s %9s %8s %8s %8s %9s\n", "", "m", "step ms", "bubble", "formula", "speedup", "work ms");
    step_measure by_m[SCHEDULES][MOST_MICRO_BATCHES + 1]; /* [schedule][m]; naive's: [0][1] */
    const step_measure *naive = &by_m[0][1];
    for (int k = 0; k < (fixed ? SCHEDULES : 2); k++)
        for (int m = choices[k].least_m ? choices[k].least_m : stages; m <= MOST_MICRO_BATCHES; m *= 2) {
            const char *name = m == 1 ? "naive" : choices[k].name; /* (m = 1: GPipe's, naive) */
            mgpu_pipeline_set_schedule(pp, choices[k].schedule, m);
            step_measure r = by_m[k][m] = measure_steps(pp, devs, stages, x, y, steps, fixed ? least : mgpu_median);
            double speedup = naive->step_ms / r.step_ms, formula = choices[k].bubble_formula(stages, m);
            print_row(name, m, &r, formula, speedup);
            check_row(name, stages, m, fixed, r.bubble, formula, speedup, speedup_bound);
            runs.worst_gap = fmax(runs.worst_gap, fabs(r.bubble - formula));
            if (m == MOST_MICRO_BATCHES) {
                runs.bubble[k] = r.bubble, runs.speedup[k] = speedup, runs.work_ms[k] = r.work_ms;
                runs.first_stage_mib[k] = r.peak_mib[0];
            }
            if (m == 1 || m == MOST_MICRO_BATCHES) { /* the picture of each schedule, at its most micro-batches */
                char file[96], path[1024], title[128];
                snprintf(file, sizeof file, "chapter6_timeline_%s_%d_stages%s.png", name, stages,
                         fixed ? "_fixed" : "");
                snprintf(title, sizeof title, "%s, %d stages, %d micro-batch%s%s", name, stages, m,
                         m > 1 ? "es" : "", fixed ? ", layers of fixed duration" : "");
                mgpu_pipeline_write_timeline(pp, mgpu_out_path(o, file, path, sizeof path), title);
            }
        }
    runs.naive_ms = naive->step_ms, runs.naive_work_ms = naive->work_ms;
    if (fixed)
        runs.interleaved_bubble =
            interleaved_rows(stages, devs, naive->step_ms, speedup_bound, steps, x, y, o, &runs.worst_gap);
    if (!fixed) {
        runs.peaks_held = print_peaks(stages, batch, by_m);
        /* the micro-batches' work without the pipeline: one of them, naive, times their number */
        int rows = batch / MOST_MICRO_BATCHES;
        mgpu_tensor *x_micro = mgpu_narrow(x, 0, rows), *y_micro = mgpu_narrow(y, 0, rows);
        mgpu_pipeline_set_schedule(pp, mgpu_schedule_gpipe, 1);
        runs.alone_work_ms =
            MOST_MICRO_BATCHES * measure_steps(pp, devs, stages, x_micro, y_micro, steps, mgpu_median).work_ms;
        mgpu_free(x_micro);
        mgpu_free(y_micro);
        explain_network_runs(&runs, batch, devs[0]);
    }
    mgpu_pipeline_free(pp);
    mgpu_net_free(net);
    return runs;
}

/* 3. The two split layers against one device, and what they move. */
static double max_relative_diff(const mgpu_tensor *a, const mgpu_tensor *b) {
    size_t n = a->numel;
    float *va = (float *)mgpu_malloc(n * sizeof(float)), *vb = (float *)mgpu_malloc(n * sizeof(float));
    mgpu_to_host(a, va);
    mgpu_to_host(b, vb);
    double diff = 0, scale = 1e-30;
    for (size_t i = 0; i < n; i++) {
        diff = fmax(diff, fabs((double)va[i] - vb[i]));
        scale = fmax(scale, fabs((double)vb[i]));
    }
    free(va);
    free(vb);
    return diff / scale;
}
/* Returns the largest difference from one device. */
static double split_layers(int width, int batch, int use_gpu) {
    printf("\n3. Splitting layers, batch %d: the largest difference from one device (relative), and the bytes\n"
           "   a device sends per step, beside data parallelism's for the same parameters:\n", batch);
    printf("  %-36s %2s %10s %12s %12s %12s\n", "", "k", "differs", "forward", "backward", "data par.");
    mgpu_device *one = mgpu_cpu(), *devs[4];
    mgpu_manual_seed(3);
    /* a block's convolution at the network's size, and an MLP of Fashion-MNIST's pixels */
    mgpu_tensor *w = mgpu_randn(one, mgpu_shape4(width, width, 3, 3), 0.0f, 0.1f), *bias = mgpu_zeros(one, mgpu_shape1(width));
    mgpu_tensor *x = mgpu_randn(one, mgpu_shape4(batch, width, 14, 14), 0.0f, 1.0f);
    mgpu_tensor *y1 = mgpu_empty(one, mgpu_shape4(batch, width, 14, 14));
    mgpu_conv2d_forward(y1, x, w, bias, 1, 1);
    enum { HIDDEN = 512 };
    mgpu_tensor *A = mgpu_randn(one, mgpu_shape2(784, HIDDEN), 0.0f, 0.03f), *a = mgpu_zeros(one, mgpu_shape1(HIDDEN));
    mgpu_tensor *B = mgpu_randn(one, mgpu_shape2(HIDDEN, 10), 0.0f, 0.05f), *b = mgpu_zeros(one, mgpu_shape1(10));
    mgpu_tensor *X = mgpu_randn(one, mgpu_shape2(batch, 784), 0.0f, 1.0f);
    mgpu_tensor *H = mgpu_empty(one, mgpu_shape2(batch, HIDDEN)), *Y1 = mgpu_empty(one, mgpu_shape2(batch, 10));
    mgpu_linear_forward(H, X, A, a);
    mgpu_relu_forward(H, H);
    mgpu_linear_forward(Y1, H, B, b);
    double worst = 0;
    for (int k = 2; k <= 4; k *= 2) {
        mgpu_devices(k, use_gpu, devs);
        mgpu_tensor *xk = mgpu_to(x, devs[0], 0), *Xk = mgpu_to(X, devs[0], 0);
        mgpu_tp_conv *c = mgpu_tp_conv_new(w, bias, 1, 1, devs, k);
        mgpu_tensor *yk = mgpu_tp_conv_forward(c, xk);
        mgpu_tp_conv_backward(c, yk); /* (any gradient: this counts its bytes) */
        mgpu_tp_bytes cb = mgpu_tp_conv_bytes(c);
        char label[64];
        snprintf(label, sizeof label, "convolution %d->%d, 3x3, 14x14", width, width);
        double conv_diff = max_relative_diff(yk, y1);
        printf("  %-36s %2d %10.1e %12zu %12zu %12zu\n", label, k, conv_diff, cb.forward, cb.backward,
               mgpu_data_parallel_bytes(mgpu_tp_conv_parameters(c), k));
        mgpu_tp_mlp *mlp = mgpu_tp_mlp_new(A, a, B, b, devs, k);
        mgpu_tensor *Yk = mgpu_tp_mlp_forward(mlp, Xk);
        mgpu_tp_mlp_backward(mlp, Yk);
        mgpu_tp_bytes mb = mgpu_tp_mlp_bytes(mlp);
        double mlp_diff = max_relative_diff(Yk, Y1);
        printf("  %-36s %2d %10.1e %12zu %12zu %12zu\n", "Megatron MLP 784->512->10", k, mlp_diff, mb.forward,
               mb.backward, mgpu_data_parallel_bytes(mgpu_tp_mlp_parameters(mlp), k));
        worst = fmax(worst, fmax(conv_diff, mlp_diff));
        mgpu_tp_conv_free(c);
        mgpu_tp_mlp_free(mlp);
        mgpu_free(xk);
        mgpu_free(Xk);
    }
    printf("  The convolution sends its output (an all-gather) and its input's gradient (an allreduce): the\n"
           "  activations of the batch. Data parallelism sends the weights' gradients: it depends on the\n"
           "  model, not the batch. The MLP's 400,000 weights outweigh its 10 outputs a row: split, it\n"
           "  moves a small fraction of what data parallelism moves.\n");
    mgpu_tensor *all[] = {w, bias, x, y1, A, a, B, b, X, H, Y1};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) mgpu_free(all[i]);
    return worst;
}

/* 4. Two pipelines of 2 stages as data parallelism on 4 devices,
   against naive's step of the whole batch on 2 (naive_ms). Returns how
   far apart the two copies of the network end. */
static double hybrid(int width, int batch, int m, int steps, int use_gpu, double naive_ms, const mgpu_tensor *x,
                     const mgpu_tensor *y, const mgpu_options *o) {
    mgpu_device *devs[4];
    mgpu_devices(4, use_gpu, devs);
    mgpu_net *nets[2];
    mgpu_pipeline *pipes[2];
    int first[2];
    for (int k = 0; k < 2; k++) {
        mgpu_manual_seed(o->seed); /* (the same values in both) */
        nets[k] = convnet(devs[2 * k], width, 2, first);
        pipes[k] = mgpu_pipeline_new(nets[k], devs + 2 * k, 2, first);
        mgpu_pipeline_set_schedule(pipes[k], mgpu_schedule_1f1b, m);
    }
    double ms[MAX_STEPS];
    for (int i = 0; i <= steps; i++) { /* (the first to warm up) */
        double start = mgpu_now();
        for (int k = 0; k < 2; k++) {
            mgpu_tensor *xk = mgpu_narrow(x, k * batch / 2, batch / 2), *yk = mgpu_narrow(y, k * batch / 2, batch / 2);
            mgpu_pipeline_forward_backward(pipes[k], xk, yk, NULL);
            mgpu_free(xk);
            mgpu_free(yk);
        }
        mgpu_pipelines_average_grads(pipes, 2);
        for (int k = 0; k < 2; k++) mgpu_pipeline_step(pipes[k], 0.01f, 0.0f, 0.0f);
        mgpu_synchronize_all();
        if (i > 0) ms[i - 1] = 1e3 * (mgpu_now() - start);
    }
    double step_ms = mgpu_median(ms, steps);
    for (int k = 0; k < 2; k++) mgpu_pipeline_free(pipes[k]);
    double apart = 0; /* the two pipelines' copies of the network after the steps: values and statistics */
    for (int i = 0; i < nets[0]->nparams; i++)
        apart = fmax(apart, max_relative_diff(mgpu_net_param(nets[0], i)->value, mgpu_net_param(nets[1], i)->value));
    for (int i = 0; i < nets[0]->nbuffers; i++)
        apart = fmax(apart, max_relative_diff(mgpu_net_buffer(nets[0], i), mgpu_net_buffer(nets[1], i)));
    int cores = mgpu_num_cores();
    double speedup = naive_ms / step_ms, bound = mgpu_device_is_gpu(devs[0]) || cores >= 4 ? 4 : (double)cores;
    printf("\n4. Hybrid: 2 pipelines of 2 stages (1F1B, m = %d, half the batch each) with their gradients\n"
           "   averaged between stages 0 and between stages 1, on 4 devices: %.1f ms a step (the median of %d),\n"
           "   %.2f times as fast as naive model parallelism on 2; the two copies of the network (values and\n"
           "   batch norm's statistics) differ by %.1e after %d steps (they must stay equal).\n",
           m, step_ms, steps, speedup, apart, steps + 1);
    mgpu_bound_hold("the hybrid's speedup over naive", speedup, MGPU_AT_MOST, bound, SPEEDUP_SLACK,
                    "at most its 4 devices, and on CPU devices the cores");
    for (int k = 0; k < 2; k++) mgpu_net_free(nets[k]);
    return apart;
}

int main(int argc, char **argv) {
    mgpu_options o;
    memset(&o, 0, sizeof o);
    o.seed = 1;
    int train_samples = 0, steps = 0, width = 0, micro = 4;
    const mgpu_flag extra[] = {
        {"--train-samples", 'i', &train_samples, "train on the first N images"},
        {"--steps", 'i', &steps, "timed steps of each schedule (up to 64; the median is printed, the least "
                                 "for layers of fixed duration)"},
        {"--width", 'i', &width, "the network's channels (32)"},
        {"--micro-batches", 'i', &micro, "micro-batches of the training (section 1; default 4)"},
        {"--devices", 'n', NULL, "chapter 6 runs on 2 and 4 devices, its stages"},
    };
    mgpu_options_parse(&o, argc, argv,
                       "chapter6: model parallelism: pipelines (naive, GPipe, 1F1B, ZB-H1, interleaved 1F1B) and "
                       "split layers", extra, (int)(sizeof extra / sizeof extra[0]));
    int use_gpu = !o.cpu && mgpu_num_gpus() > 0;
    int reduced = !use_gpu && !o.full;
    if (!width) width = 32;
    if (!steps) steps = reduced ? 3 : 10;
    MGPU_REQUIRE(steps <= MAX_STEPS, "--steps %d: at most %d", steps, MAX_STEPS);
    int batch = o.batch_size ? o.batch_size : reduced ? 128 : 256;
    MGPU_REQUIRE(batch >= 8, "--batch-size %d: at least 8 (8 micro-batches)", batch);
    double lr = o.lr ? o.lr : 0.05;
    if (!o.epochs) o.epochs = reduced ? 3 : 10;
    if (reduced && !train_samples) train_samples = 3072;
    if (reduced)
        printf("No GPU: a reduced run on CPU devices: %d training images, %d epoch%s, batch %d, %d timed\n"
               "step%s a schedule (--full: all the images, 10 epochs, batch 256, 10 timed steps).\n",
               train_samples, o.epochs, o.epochs > 1 ? "s" : "", batch, steps, steps > 1 ? "s" : "");
    if (use_gpu) printf("GPU arithmetic: %s; MGPU_TF32=0 or 1 changes it.\n", mgpu_tf32_str());
    printf("The network: a stem and %d equal blocks of %d channels (3x3 convolution, batch norm, ReLU) at 14x14,\n"
           "global pooling, a linear layer; 2 stages take 4 blocks each, 4 stages 2 each.\n", BLOCKS, width);

    mgpu_dataset *train_set = NULL, *test_set = NULL;
    mgpu_dataset_load_fashion_mnist(mgpu_data_dir(o.data), &train_set, &test_set);
    MGPU_REQUIRE(train_samples <= train_set->n, "--train-samples %d: the training set has %d images", train_samples,
                 train_set->n);
    if (train_samples) {
        mgpu_dataset *subset = mgpu_dataset_subset(train_set, train_samples);
        mgpu_dataset_free(train_set);
        train_set = subset;
        mgpu_dataset_truncate(test_set, train_samples);
    }
    MGPU_REQUIRE(train_set->n >= batch, "--batch-size %d: more than the %d training images", batch, train_set->n);
    MGPU_REQUIRE(micro >= 1 && micro <= batch, "--micro-batches %d: want 1 to the batch, %d", micro, batch);
    train(width, batch, micro, o.epochs, lr, use_gpu, train_set, test_set, &o);

    mgpu_tensor *x, *y, *values = mgpu_zeros(mgpu_cpu(), mgpu_shape2(batch, 10));
    first_images(train_set, batch, &x, &y);
    int cores = mgpu_num_cores();
    printf("\n2. A training step split in stages. bubble: measured from the trace, each stage's idle time over\n"
           "   the step's (interleaved: each device's), beside the formula (p - 1) / (m + p - 1), for ZB-H1\n"
           "   (p - 1) / (3m + p - 1), for interleaved 1F1B with v = %d chunks a device (p - 1) / (vm + p - 1);\n"
           "   speedup: naive's step time over this one's, at most the stages (p), and on CPU devices the cores\n"
           "   (here %d); work: the stages' busy time added up. First layers of fixed duration, on CPU devices:\n"
           "   each of the %d blocks waits %.0f ms forward for the batch of %d, and as long again backward for\n"
           "   each of its two gradients (ZB-H1's B and W), less for fewer images: a wait takes no core, so\n"
           "   the stages overlap as on devices of their own, on any machine.\n",
           CHUNKS, cores, BLOCKS, FIXED_BLOCK_MS, batch);
    fixed_ms_per_image = FIXED_BLOCK_MS / batch;
    pipeline_runs fixed[2] = {schedules(1, 2, width, batch, steps, use_gpu, values, y, &o),
                              schedules(1, 4, width, batch, steps, use_gpu, values, y, &o)};
    printf("\n  Then the network's layers; each stage's peak activations beside the schedule's bound: m micro-\n"
           "  batches for GPipe, min(m, p - s) on stage s for 1F1B, each 1/m of naive's whole batch.\n");
    pipeline_runs net[2] = {schedules(0, 2, width, batch, steps, use_gpu, x, y, &o),
                            schedules(0, 4, width, batch, steps, use_gpu, x, y, &o)};
    char path[1024];
    printf("  timelines: %s and the others beside it\n",
           mgpu_out_path(&o, "chapter6_timeline_1F1B_2_stages_fixed.png", path, sizeof path));

    double split_diff = split_layers(width, batch, use_gpu);
    double apart = hybrid(width, batch, 4, steps, use_gpu, net[0].naive_ms, x, y, &o);
    int m = MOST_MICRO_BATCHES;
    printf("\nWhat this run shows:\n");
    double worst_gap = fmax(fixed[0].worst_gap, fixed[1].worst_gap);
    if (worst_gap <= BUBBLE_SLACK)
        printf("  On layers of fixed duration the measured bubble kept within %.3f of its formula at every m on 2\n"
               "  and 4 stages (at m = %d on 2 stages, GPipe %.3f and 1F1B %.3f against %.3f): more micro-batches,\n"
               "  a smaller bubble, as the formula says. ZB-H1, whose W passes wait for nobody, left %.3f on 2\n"
               "  stages and %.3f on 4 at m = %d, against (p - 1) / (3m + p - 1) = %.3f and %.3f; interleaved\n"
               "  1F1B with %d chunks a device %.3f and %.3f, against (p - 1) / (vm + p - 1) = %.3f and %.3f.\n",
               worst_gap, m, fixed[0].bubble[0], fixed[0].bubble[1], mgpu_pipeline_bubble_formula(2, m),
               fixed[0].bubble[2], fixed[1].bubble[2], m, mgpu_pipeline_zb_h1_bubble_formula(2, m),
               mgpu_pipeline_zb_h1_bubble_formula(4, m), CHUNKS, fixed[0].interleaved_bubble,
               fixed[1].interleaved_bubble, mgpu_pipeline_interleaved_bubble_formula(2, CHUNKS, m),
               mgpu_pipeline_interleaved_bubble_formula(4, CHUNKS, m));
    else
        printf("  On layers of fixed duration the measured bubble strayed %.3f from its formula (the ! lines\n"
               "  above): the machine was too busy for this run to show the formula; run it again.\n",
               worst_gap);
    printf("  1F1B's first stage held %.2f MiB of activations at m = %d on 2 stages, GPipe's %.2f: %d micro-batches\n"
           "  against %d, on any machine%s.\n",
           net[0].first_stage_mib[1], m, net[0].first_stage_mib[0], choices[1].in_flight(0, 2, m),
           choices[0].in_flight(0, 2, m), net[0].peaks_held && net[1].peaks_held ? "" : " (but for the ! lines above)");
    printf("  On the network's layers 1F1B at m = %d ran %.2f times as fast as naive on 2 stages and %.2f on\n"
           "  4, with bubbles of %.3f and %.3f against the formula's %.3f and %.3f, and work of %.2f and %.2f\n"
           "  times naive's (the lines after each table say why).\n",
           m, net[0].speedup[1], net[1].speedup[1], net[0].bubble[1], net[1].bubble[1],
           mgpu_pipeline_bubble_formula(2, m), mgpu_pipeline_bubble_formula(4, m),
           net[0].work_ms[1] / net[0].naive_work_ms, net[1].work_ms[1] / net[1].naive_work_ms);
    printf("  The split layers %s one device to %.1e, relative (float32's sums in another order).\n",
           split_diff <= SPLIT_TOLERANCE ? "equal" : "differ from", split_diff);
    mgpu_bound_hold("the split layers' difference from one device", split_diff, MGPU_AT_MOST, SPLIT_TOLERANCE, 0,
                    "or they compute something else");
    printf("  The hybrid's two copies of the network differ by %.1e: %s.\n", apart,
           apart == 0 ? "equal, as averaged gradients keep them" : "they should be equal");
    mgpu_free(values);
    mgpu_free(x);
    mgpu_free(y);
    mgpu_dataset_free(train_set);
    mgpu_dataset_free(test_set);
    return mgpu_output_errors() ? 1 : 0;
}
