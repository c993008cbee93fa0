/* Chapter 5: memory. Where a training step's memory goes, and what
   gradient checkpointing does to it.

   What it teaches. A step of training holds four kinds of things on its
   device: the parameters, their gradients, the optimizer's state, and
   the activations that the forward pass keeps for the backward pass
   (plus the backward pass's own workspace: the activations' gradients).
   The first three are fixed by the model: P parameters in float32 take
   4P bytes each, and the optimizer 0 (plain SGD), 4P (SGD with momentum)
   or 8P (Adam's two moments). The activations grow with the batch, and
   on a large model or a large batch they are what does not fit.

   Gradient checkpointing (Chen et al. 2016, PyTorch's
   torch.utils.checkpoint.checkpoint_sequential; mgpu_net_recompute)
   trades compute for that memory: cut the n layers into k runs, keep
   only each run's input during the forward pass, and make a run's
   activations again, by its forward pass, just before its backward pass.
   For n equal layers of A bytes of activations each, the peak falls from
   n A to (n/k + k - 1) A, least near k = sqrt(n), for one more forward
   pass of all runs but the last: about a third more work, as a backward
   pass costs about two forward passes. The gradients are the same, bit
   for bit.

   ZeRO (Rajbhandari et al. 2020; mgpu_data_parallel_zero) trades
   communication for the model's state under data parallelism: w devices
   each hold the whole model, its gradients and its optimizer's state
   (with Adam 4P + 4P + 8P bytes); ZeRO-1 gives each device the optimizer
   state of a w-th of the parameters (it updates that part, and the parts
   are gathered), ZeRO-2 its gradients too (reduce-scattered instead of
   allreduced), ZeRO-3 (PyTorch's FSDP) its parameters' values too: a
   unit of layers is gathered whole just before its forward pass and
   again before its backward pass, and freed after each.

   The chapter measures, on one device (a GPU, or the CPU):
     1. a ResNet-18 step's memory by category, beside the formulas, with
        SGD and momentum and with Adam;
     2. the peak activations and the step's time at 1 (none), 2, about
        sqrt(n) and n checkpointed runs, beside the formula, and a
        picture of the activations through a plain and a checkpointed
        step, each against the fraction of its step's allocator calls
        (chapter5_memory_timeline.png);
     3. the largest batch that fits under a memory limit, with and
        without checkpointing, found by trying: each try is this program
        again (--try-batch), stopped by the allocator's one-line error
        when the step does not fit;
     4. with 2 and 4 devices and Adam, what each device holds of the
        model's state with DataParallel's gather, DDP's allreduce, ZeRO-1,
        ZeRO-2 and ZeRO-3, beside the formulas, and a picture of the
        parameters a device holds through a ZeRO-2 and a ZeRO-3 step on 2
        devices (chapter5_zero3_timeline.png).
   Each figure is held to its bound (mgpu_bound_hold): the memory to its
   formulas, or between what any layers allow; a checkpointed step's
   time between the plain step's and that plus one forward pass. A
   figure past its bound gets a line starting "!" instead of an
   explanation. The run ends with "What this run shows:", a few lines
   from its own figures.

   What you should see (a 2-core CPU, the reduced run: batch 16, a limit
   of 320 MiB): about 43 MiB each for the parameters, their gradients and
   the momentum (P = 11.2 million); activations near 56 MiB at their
   peak; at about sqrt(12) = 3 runs the activations' peak falls by about
   45%, and on an idle machine the step takes about 1.2 times as long (a
   busy one slows the variants unevenly, and "!" lines say so); the
   largest batch under the limit grows by about half with checkpointing
   (48 to 68; 44 to 68 where oneDNN runs AVX-512 and the 3x3 layers take
   its Winograd kernels, whose scratch is larger). ResNet-18's layers
   are not equal (its first layers' outputs are the largest), so the
   measured peaks sit above the formula for equal layers printed beside
   them. In the picture the plain step's
   activations stay level at their peak through the step (its layers'
   outputs stay allocated from one step to the next); the checkpointed
   step's rise and fall run by run, highest where the first run is
   made and made again. With 4 devices and Adam, each device holds 171
   MiB of the model's state under DDP, 107 with ZeRO-1, 75 with ZeRO-2
   and 43 with ZeRO-3, as the formulas say to the tenth of a MiB. In the
   ZeRO-3 picture the parameters rise by a unit at each gather and fall
   at each free, twice through the step (forward, then backward), from
   the device's chunks, a w-th of ZeRO-2's level line.

   Without a GPU it runs a reduced setting (batch 16, 3 timed steps of
   each number of runs, a limit of 320 MiB); --full, or a GPU, runs batch
   256, 10 steps and a limit of 2 GiB.

   Reads: mgpu/memory.h (memory by category), mgpu/networks.h (activation
   recomputation, mgpu_net_recompute), mgpu/zero.h (ZeRO-1, 2 and 3),
   mgpu/data_parallel_step.h, mgpu/timing.h (mgpu_bound_hold),
   mgpu/plots.h, mgpu/flags.h. */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"
#include <unistd.h>

#define MAX_STEPS 64   /* timed steps a number of runs: the least is printed */
#define MAX_VARIANTS 4 /* section 2's numbers of runs: 1, 2, about sqrt(n) and n */
#define MAX_LIMIT_MIB 1048576.0 /* section 3's memory limit at most: 1 TiB, more than a device has */

/* A step's inputs: random images of Fashion-MNIST's shape (memory does
   not depend on the values), the same every step. */
static void step_batch(mgpu_device *dev, int batch, mgpu_tensor **x, mgpu_tensor **y) {
    mgpu_manual_seed(7);
    *x = mgpu_randn(dev, mgpu_shape4(batch, 1, 28, 28), 0.0f, 1.0f);
    float *labels = (float *)mgpu_malloc(sizeof(float) * (size_t)batch);
    for (int i = 0; i < batch; i++) labels[i] = (float)(i % 10);
    *y = mgpu_from_host(dev, mgpu_shape1(batch), labels);
    free(labels);
}

static mgpu_net *resnet(mgpu_device *dev, int segments, int adam) {
    mgpu_manual_seed(1);
    mgpu_net *net = mgpu_resnet18(10, 1, dev);
    mgpu_net_recompute(net, segments);
    if (adam) mgpu_net_use_adam(net, 0.9f, 0.999f, 1e-8f, 0);
    return net;
}

static double mib(size_t bytes) { return (double)bytes / 1048576.0; }

/* The figures' tolerances. Memory is counted exactly, in the
   allocator's 512-byte granules; the parameters' count leaves out batch
   norm's statistics (0.2% more): 1%. A step's time, the least of its
   repeats, still moves by a few percent from one run to the next on an
   idle machine: 5% below the plain step's; 10% above the plain step and
   a forward pass, for the allocator's work on the recomputed runs'
   tensors too, which a forward pass alone does not do. */
#define MEMORY_TOLERANCE 0.01
#define TIME_TOLERANCE_BELOW 0.05
#define TIME_TOLERANCE_ABOVE 0.10
#define MEMORY_ADVICE "but memory does not vary with the load: please report this run"
#define TIME_ADVICE "this time is not the step's own; run it again on an idle machine, or with more --steps"

/* value against its formula, both ways, within MEMORY_TOLERANCE: 1 when
   it holds, else 0 after the one line saying so. */
static int near_formula(const char *figure, double value, double formula) {
    return mgpu_bound_hold(figure, value, MGPU_AT_LEAST, formula, MEMORY_TOLERANCE, MEMORY_ADVICE) &&
           mgpu_bound_hold(figure, value, MGPU_AT_MOST, formula, MEMORY_TOLERANCE, MEMORY_ADVICE);
}

/* Each run's activations are all held at once during its backward pass,
   and the largest run holds at least the average run's share of the
   plain step's: the peak at k runs is at least plain / k. Every tensor a
   checkpointed step holds, the plain step holds too: at most plain. */
static int peak_holds(int k, double peak_mib, double plain_peak_mib) {
    char figure[64];
    snprintf(figure, sizeof figure, "the peak activations at %d runs (MiB)", k);
    return mgpu_bound_hold(figure, peak_mib, MGPU_AT_LEAST, plain_peak_mib / k, MEMORY_TOLERANCE, MEMORY_ADVICE) &&
           mgpu_bound_hold(figure, peak_mib, MGPU_AT_MOST, plain_peak_mib, MEMORY_TOLERANCE, MEMORY_ADVICE);
}

/* A checkpointed step does the plain step's work and the forward pass of
   every run but the last again: its time lies between the plain step's
   and that plus one forward pass. */
static int recompute_time_holds(int k, double step_ms, double plain_ms, double forward_ms) {
    char figure[64];
    snprintf(figure, sizeof figure, "the step's time at %d runs (ms)", k);
    return mgpu_bound_hold(figure, step_ms, MGPU_AT_LEAST, plain_ms, TIME_TOLERANCE_BELOW, TIME_ADVICE) &&
           mgpu_bound_hold(figure, step_ms, MGPU_AT_MOST, plain_ms + forward_ms, TIME_TOLERANCE_ABOVE, TIME_ADVICE);
}

/* What section 1 found, for the closing lines: the model's state
   (parameters, gradients, optimizer) with momentum and with Adam, the
   activations at the peak, and whether the state held to its formulas. */
typedef struct {
    int batch;
    double state[2], activations;
    int holds;
} category_findings;

/* 1. Memory by category at the peak of a step (the second: the first
   makes the optimizer's state), for SGD with momentum and for Adam. */
static category_findings memory_by_category(mgpu_device *dev, int batch) {
    mgpu_tensor *x, *y;
    step_batch(dev, batch, &x, &y);
    size_t held[2][MGPU_MEMORY_CATEGORIES], peak[2];
    double p = 0;
    for (int adam = 0; adam < 2; adam++) {
        mgpu_net *net = resnet(dev, 1, adam);
        p = (double)mgpu_net_num_weights(net);
        float momentum = adam ? 0.0f : 0.9f;
        mgpu_net_train_step(net, x, y, adam ? 0.001f : 0.1f, momentum, 0.0f, NULL);
        mgpu_synchronize(dev);
        mgpu_device_reset_peak(dev);
        mgpu_net_train_step(net, x, y, adam ? 0.001f : 0.1f, momentum, 0.0f, NULL);
        mgpu_synchronize(dev);
        for (int c = 0; c < MGPU_MEMORY_CATEGORIES; c++)
            held[adam][c] = mgpu_device_memory_at_peak(dev, (mgpu_memory_category)c);
        peak[adam] = mgpu_device_memory_peak(dev);
        mgpu_net_free(net);
    }
    double four = 4 * p / 1048576.0; /* 4P bytes in MiB: one float32 copy of the parameters */
    printf("\n1. A ResNet-18 step's memory on %s at its peak, batch %d (MiB); P = %.1f million parameters:\n",
           mgpu_device_name(dev), batch, p / 1e6);
    printf("  %-16s %14s %14s   %s\n", "", "SGD, momentum", "Adam", "formula (SGD / Adam)");
    const int order[] = {MGPU_MEMORY_PARAMETERS, MGPU_MEMORY_GRADIENTS, MGPU_MEMORY_OPTIMIZER,
                         MGPU_MEMORY_ACTIVATIONS, MGPU_MEMORY_WORKSPACE, MGPU_MEMORY_OTHER};
    for (int k = 0; k < 6; k++) {
        int c = order[k];
        printf("  %-16s %14.1f %14.1f   ", mgpu_memory_category_name((mgpu_memory_category)c), mib(held[0][c]),
               mib(held[1][c]));
        if (c == MGPU_MEMORY_PARAMETERS) printf("4P = %.1f (and batch norm's statistics)\n", four);
        else if (c == MGPU_MEMORY_GRADIENTS) printf("4P = %.1f\n", four);
        else if (c == MGPU_MEMORY_OPTIMIZER) printf("4P = %.1f / 8P = %.1f\n", four, 2 * four);
        else if (c == MGPU_MEMORY_ACTIVATIONS) printf("grows with the batch\n");
        else if (c == MGPU_MEMORY_WORKSPACE) printf("activation gradients of a layer or two, scratch\n");
        else printf("the batch itself\n");
    }
    printf("  %-16s %14.1f %14.1f\n", "the whole peak", mib(peak[0]), mib(peak[1]));
    category_findings found = {batch, {0, 0}, mib(held[0][MGPU_MEMORY_ACTIVATIONS]), 1};
    for (int adam = 0; adam < 2; adam++) {
        const char *optimizer = adam ? "Adam" : "SGD";
        char figure[64];
        snprintf(figure, sizeof figure, "the parameters with %s (MiB)", optimizer);
        found.holds &= near_formula(figure, mib(held[adam][MGPU_MEMORY_PARAMETERS]), four);
        snprintf(figure, sizeof figure, "the gradients with %s (MiB)", optimizer);
        found.holds &= near_formula(figure, mib(held[adam][MGPU_MEMORY_GRADIENTS]), four);
        snprintf(figure, sizeof figure, "the optimizer state with %s (MiB)", optimizer);
        found.holds &= near_formula(figure, mib(held[adam][MGPU_MEMORY_OPTIMIZER]), adam ? 2 * four : four);
        found.state[adam] = mib(held[adam][MGPU_MEMORY_PARAMETERS] + held[adam][MGPU_MEMORY_GRADIENTS] +
                                held[adam][MGPU_MEMORY_OPTIMIZER]);
    }
    mgpu_free(x);
    mgpu_free(y);
    return found;
}

/* The picture's x: the fraction of the step's allocator calls made so far
   (0 at its first, 1 at its last), and its y: what category c then held
   (the activations, or the parameters), in MiB, less `base` (what other
   networks hold throughout). A step's
   calls follow its work in order, and a step that recomputes, with more
   of them, is drawn on the same 0 to 1. Not the host's clock: the host
   makes the calls as it hands the work to the device (a CPU device's
   worker thread too), far ahead of it. */
static void timeline_curve(const mgpu_memory_sample *samples, int n, mgpu_memory_category c, size_t base,
                           double *fraction, double *held_mib) {
    for (int i = 0; i < n; i++) {
        fraction[i] = n > 1 ? (double)i / (n - 1) : 0.0;
        held_mib[i] = mib(samples[i].held[c]) - mib(base);
    }
}

/* One number of checkpointed runs: its network, the activations through
   a step of it, and its step's time. */
typedef struct {
    int runs;
    mgpu_net *net;
    double peak_mib; /* the activations at their peak during a step */
    double step_ms;  /* the least of its timed steps */
    int npoints;
    double *fraction, *held_mib; /* the picture's curve (timeline_curve) */
} checkpoint_variant;

/* The activations through one step of v's network, after one to warm up
   (the first step makes the momentum): their peak and the curve. The
   network's activations are then freed, all but its logits, so that the
   next network's are measured nearly alone; what the others hold is
   taken off. */
static void checkpoint_memory(mgpu_device *dev, checkpoint_variant *v, const mgpu_tensor *x, const mgpu_tensor *y) {
    size_t base = mgpu_device_memory_of(dev, MGPU_MEMORY_ACTIVATIONS);
    mgpu_net_train_step(v->net, x, y, 0.1f, 0.9f, 0.0f, NULL);
    mgpu_synchronize(dev);
    mgpu_device_reset_peak(dev);
    mgpu_device_record_memory(dev, 1);
    mgpu_net_train_step(v->net, x, y, 0.1f, 0.9f, 0.0f, NULL);
    mgpu_synchronize(dev);
    mgpu_device_record_memory(dev, 0);
    v->peak_mib = mib(mgpu_device_memory_peak_of(dev, MGPU_MEMORY_ACTIVATIONS)) - mib(base);
    const mgpu_memory_sample *samples;
    v->npoints = mgpu_device_memory_samples(dev, &samples);
    v->fraction = (double *)mgpu_malloc(sizeof(double) * (size_t)(v->npoints + 1));
    v->held_mib = (double *)mgpu_malloc(sizeof(double) * (size_t)(v->npoints + 1));
    timeline_curve(samples, v->npoints, MGPU_MEMORY_ACTIVATIONS, base, v->fraction, v->held_mib);
    mgpu_net_free_activations(v->net);
}

static double least(const double *values, int n) {
    double m = values[0];
    for (int i = 1; i < n; i++) m = fmin(m, values[i]);
    return m;
}

/* Each variant's step, and the plain network's forward pass alone (the
   bound on recomputation), `rounds` times each, taken in turn round by
   round so that a burst of other work on the machine slows all alike.
   The least of each: other work only ever adds time, so the least is the
   nearest to the step's own cost, where a median keeps the load of a
   machine that is busy most of the time. Returns the forward pass's. */
static double time_variants(mgpu_device *dev, checkpoint_variant *v, int nvariants, const mgpu_tensor *x,
                            const mgpu_tensor *y, int rounds) {
    double ms[MAX_VARIANTS + 1][MAX_STEPS];
    for (int r = 0; r < rounds; r++)
        for (int i = 0; i <= nvariants; i++) {
            double start = mgpu_now();
            if (i < nvariants) mgpu_net_train_step(v[i].net, x, y, 0.1f, 0.9f, 0.0f, NULL);
            else mgpu_net_forward(v[0].net, x);
            mgpu_synchronize(dev);
            ms[i][r] = 1e3 * (mgpu_now() - start);
        }
    for (int i = 0; i < nvariants; i++) v[i].step_ms = least(ms[i], rounds);
    return least(ms[nvariants], rounds);
}

/* chapter5_memory_timeline.png: the plain step's activations and those
   of the step at about sqrt(n) runs, on the same 0 to 1. */
static void timeline_picture(const checkpoint_variant *plain, const checkpoint_variant *cut, int n,
                             const mgpu_options *o) {
    char cut_name[48];
    snprintf(cut_name, sizeof cut_name, "%d runs (about sqrt(%d))", cut->runs, n);
    mgpu_series series[2];
    memset(series, 0, sizeof series);
    const checkpoint_variant *drawn[2] = {plain, cut};
    const char *names[2] = {"no checkpointing", cut_name};
    for (int i = 0; i < 2; i++) {
        series[i].name = names[i];
        series[i].n = drawn[i]->npoints;
        series[i].x = drawn[i]->fraction;
        series[i].y = drawn[i]->held_mib;
    }
    mgpu_chart chart;
    memset(&chart, 0, sizeof chart);
    chart.title = "activations held through a ResNet-18 step";
    chart.xlabel = "fraction of the step's allocator calls";
    chart.ylabel = "MiB";
    chart.xmin = 0;
    chart.xmax = 1;
    /* room above the plain step's level line, for the legend */
    chart.ymin = 0;
    chart.ymax = 1.4 * plain->peak_mib;
    chart.nseries = 2;
    chart.series = series;
    char path[1024];
    if (mgpu_chart_write_png(&chart, mgpu_out_path(o, "chapter5_memory_timeline.png", path, sizeof path)) == 0)
        printf("  Memory through a step: %s (without checkpointing every layer's output\n"
               "  stays allocated from one step to the next; with it, each run's activations come and go).\n",
               path);
}

/* What section 2 found, for the closing lines: the plain step and the
   one at about sqrt(n) runs, and whether their figures held. */
typedef struct {
    int root;
    double plain_peak, root_peak, root_time;
    int peaks_hold, root_time_holds;
} checkpoint_findings;

/* 2. Checkpointing at 1 (none), 2, about sqrt(n) and n runs. */
static checkpoint_findings checkpointing(mgpu_device *dev, int batch, int rounds, const mgpu_options *o) {
    mgpu_tensor *x, *y;
    step_batch(dev, batch, &x, &y);
    checkpoint_variant v[MAX_VARIANTS];
    memset(v, 0, sizeof v);
    v[0].net = resnet(dev, 1, 0);
    int n = v[0].net->nlayers, root = (int)lround(sqrt((double)n));
    const int runs[MAX_VARIANTS] = {1, 2, root, n};
    for (int i = 0; i < MAX_VARIANTS; i++) {
        v[i].runs = runs[i];
        if (i) v[i].net = resnet(dev, runs[i], 0);
    }
    /* O: a layer's output on average, the tensor a run keeps for the next */
    mgpu_net_forward(v[0].net, x);
    double outputs = 0;
    for (int i = 0; i < n; i++) outputs += mib(v[0].net->layers[i]->output->numel * sizeof(float));
    double o_mean = outputs / n;
    mgpu_net_free_activations(v[0].net);
    for (int i = 0; i < MAX_VARIANTS; i++) checkpoint_memory(dev, &v[i], x, y);
    double forward_ms = time_variants(dev, v, MAX_VARIANTS, x, y, rounds);
    printf("\n2. Gradient checkpointing: ResNet-18's n = %d layers (its blocks) in k runs, batch %d; the least\n"
           "   of %d steps each, the runs taken in turn:\n", n, batch, rounds);
    printf("  %5s %18s %26s %10s %8s\n", "k", "peak activations", "formula (n/k) A + (k - 1) O", "step ms",
           "time");
    double a_mean = v[0].peak_mib / n;
    checkpoint_findings found = {root, v[0].peak_mib, v[2].peak_mib, v[2].step_ms / v[0].step_ms, 1, 1};
    for (int i = 0; i < MAX_VARIANTS; i++) {
        int k = runs[i];
        double formula = (double)n / k * a_mean + (k - 1) * o_mean;
        printf("  %5d %14.1f MiB %22.1f MiB %10.1f %7.2fx\n", k, v[i].peak_mib, formula, v[i].step_ms,
               v[i].step_ms / v[0].step_ms);
        found.peaks_hold &= peak_holds(k, v[i].peak_mib, v[0].peak_mib);
        int time_holds = recompute_time_holds(k, v[i].step_ms, v[0].step_ms, forward_ms);
        if (i == 2) found.root_time_holds = time_holds;
    }
    printf("  A = %.1f MiB, a layer's activations on average (all it keeps: a residual block keeps 5 or 6\n"
           "  tensors); O = %.2f MiB, a layer's output on average (the one tensor a run keeps for the next).\n"
           "  The formula is for equal layers; ResNet-18's first layers hold the most (64 channels at 28x28),\n"
           "  so a run of them weighs more than its average run. What holds for any layers: a run's\n"
           "  activations are all held during its backward pass, so the peak is at least n A / k, and at\n"
           "  most the plain step's n A; the time lies between the plain step's and that plus one forward\n"
           "  pass (%.1f ms, the least of %d), recomputed for all runs but the last.\n", a_mean, o_mean, forward_ms,
           rounds);
    timeline_picture(&v[0], &v[2], n, o);
    for (int i = 0; i < MAX_VARIANTS; i++) {
        free(v[i].fraction);
        free(v[i].held_mib);
        mgpu_net_free(v[i].net);
    }
    mgpu_free(x);
    mgpu_free(y);
    return found;
}

/* What section 4 found on its most devices, for the closing lines: the
   model's state a device holds under DDP and under ZeRO-2, and whether
   every mode's held to its formula. */
typedef struct {
    int devices;
    double ddp_state, zero2_state, zero3_state;
    int holds;
} sharding_findings;

/* The parameters device 0 holds through one step (the picture's curve,
   timeline_curve's), and between steps. */
typedef struct {
    int npoints;
    double *fraction, *held_mib, between_mib;
} parameters_curve;

/* chapter5_zero3_timeline.png: the parameters device 0 holds through a
   ZeRO-2 step and a ZeRO-3 step, on the same 0 to 1. */
static void zero3_picture(const parameters_curve *zero2, const parameters_curve *zero3, int w, double unit_mib,
                          const mgpu_options *o) {
    mgpu_series series[2];
    memset(series, 0, sizeof series);
    const parameters_curve *drawn[2] = {zero2, zero3};
    const char *names[2] = {"ZeRO-2: every value, always", "ZeRO-3: its chunks, and the units gathered"};
    for (int i = 0; i < 2; i++) {
        series[i].name = names[i];
        series[i].n = drawn[i]->npoints;
        series[i].x = drawn[i]->fraction;
        series[i].y = drawn[i]->held_mib;
    }
    char title[96];
    snprintf(title, sizeof title, "parameters on device 0 through a step, %d devices", w);
    mgpu_chart chart;
    memset(&chart, 0, sizeof chart);
    chart.title = title;
    chart.xlabel = "fraction of the step's allocator calls";
    chart.ylabel = "MiB";
    chart.xmin = 0;
    chart.xmax = 1;
    chart.ymin = 0;
    chart.ymax = 1.4 * zero2->between_mib; /* (room for the legend) */
    chart.nseries = 2;
    chart.series = series;
    char path[1024];
    if (mgpu_chart_write_png(&chart, mgpu_out_path(o, "chapter5_zero3_timeline.png", path, sizeof path)) == 0)
        printf("  Parameters through a step: %s\n"
               "  (ZeRO-3 holds %.1f MiB of chunks between steps; each gather adds a unit, whole blocks of %.0f\n"
               "  MiB or more, and each free takes it off, through the forward pass and again through the\n"
               "  backward pass. Two of the last blocks, whole at once, weigh more than the chunks save on 2\n"
               "  devices: the peak of the parameters needs units small beside the whole model.)\n", path,
               zero3->between_mib, unit_mib);
}

/* ZeRO-3's unit: its buckets' size, at least (a bucket holds whole
   blocks). The wrapper's 25 MiB would cut ResNet-18's 45 MiB of
   parameters in two units, and two are whole at a time. */
#define ZERO3_UNIT_MIB 4

/* 4. Data parallelism on w devices, Adam: what each device holds of the
   model's state (parameters, gradients, optimizer state) between steps,
   and its peak, for DataParallel's gather, DDP's allreduce, ZeRO-1,
   ZeRO-2 and ZeRO-3, beside the formulas. With `curves`, the parameters
   device 0 holds through the second step of ZeRO-2 and of ZeRO-3. */
static void sharded(int w, int use_gpu, int per_device_batch, sharding_findings *found, parameters_curve *curves) {
    mgpu_device *devs[MGPU_MAX_DEVICES];
    mgpu_devices(w, use_gpu, devs);
    mgpu_tensor *x, *y;
    step_batch(mgpu_cpu(), per_device_batch * w, &x, &y);
    static const char *names[5] = {"gather on device 0 (DataParallel)", "allreduce (DDP)", "ZeRO-1", "ZeRO-2",
                                   "ZeRO-3 (FSDP)"};
    printf("  %d devices, batch %d:\n", w, per_device_batch * w);
    found->devices = w;
    for (int mode = 0; mode < 5; mode++) {
        size_t base[MGPU_MAX_DEVICES][MGPU_MEMORY_CATEGORIES];
        mgpu_synchronize_all();
        for (int i = 0; i < w; i++) {
            for (int c = 0; c < MGPU_MEMORY_CATEGORIES; c++)
                base[i][c] = mgpu_device_memory_of(devs[i], (mgpu_memory_category)c);
            mgpu_device_reset_peak(devs[i]);
        }
        mgpu_net *net = resnet(devs[0], 1, 1);
        double p = (double)mgpu_net_num_weights(net);
        mgpu_data_parallel *dp = mgpu_data_parallel_new(net, devs, w, mode == 0 ? MGPU_DP_GATHER : MGPU_DP_ALLREDUCE);
        if (mode == 4) mgpu_data_parallel_configure(dp, (size_t)ZERO3_UNIT_MIB << 20, 1, 1);
        if (mode >= 2) mgpu_data_parallel_zero(dp, mode - 1);
        parameters_curve *curve = curves && mode >= 3 ? &curves[mode - 3] : NULL;
        for (int step = 0; step < 2; step++) {
            if (curve && step == 1) mgpu_device_record_memory(devs[0], 1);
            mgpu_data_parallel_step(dp, x, y, 0.001f, 0.0f, 0.0f);
            mgpu_synchronize_all();
        }
        if (curve) {
            mgpu_device_record_memory(devs[0], 0);
            const mgpu_memory_sample *samples;
            curve->npoints = mgpu_device_memory_samples(devs[0], &samples);
            curve->fraction = (double *)mgpu_malloc(sizeof(double) * (size_t)(curve->npoints + 1));
            curve->held_mib = (double *)mgpu_malloc(sizeof(double) * (size_t)(curve->npoints + 1));
            timeline_curve(samples, curve->npoints, MGPU_MEMORY_PARAMETERS, base[0][MGPU_MEMORY_PARAMETERS],
                           curve->fraction, curve->held_mib);
            curve->between_mib = mib(mgpu_device_memory_of(devs[0], MGPU_MEMORY_PARAMETERS)) -
                                 mib(base[0][MGPU_MEMORY_PARAMETERS]);
        }
        /* the model's state on the device that holds the least of it (device 0 holds more in gather mode) */
        double state[3] = {1e30, 1e30, 1e30}, peak0 = mib(mgpu_device_memory_peak(devs[0])), peak_rest = 0;
        const mgpu_memory_category cats[3] = {MGPU_MEMORY_PARAMETERS, MGPU_MEMORY_GRADIENTS, MGPU_MEMORY_OPTIMIZER};
        for (int i = 0; i < w; i++) {
            for (int k = 0; k < 3; k++) {
                double held = mib(mgpu_device_memory_of(devs[i], cats[k]) - base[i][cats[k]]);
                if (held < state[k]) state[k] = held;
            }
            if (i > 0 && mib(mgpu_device_memory_peak(devs[i])) > peak_rest) peak_rest = mib(mgpu_device_memory_peak(devs[i]));
        }
        /* Rajbhandari et al.'s formulas, float32 and Adam: 4P + 4P + 8P, the optimizer's 8P / w with ZeRO-1,
           the gradients' 4P / w too with ZeRO-2, and the parameters' 4P / w too with ZeRO-3 */
        double four = 4 * p / 1048576.0;
        double formula = (mode == 4 ? four / w : four) + (mode >= 3 ? four / w : four) +
                         (mode >= 2 ? 2 * four / w : 2 * four);
        if (mode == 0) formula = 2 * four; /* (a replica; device 0 also holds Adam's state and the others' gradients) */
        double total = state[0] + state[1] + state[2];
        printf("    %-34s %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f\n", names[mode], state[0], state[1], state[2],
               total, formula, peak0, peak_rest);
        char figure[96];
        snprintf(figure, sizeof figure, "the model's state a device holds, %s on %d devices (MiB)", names[mode], w);
        found->holds &= near_formula(figure, total, formula);
        if (mode == 1) found->ddp_state = total;
        if (mode == 3) found->zero2_state = total;
        if (mode == 4) found->zero3_state = total;
        mgpu_data_parallel_free(dp);
        mgpu_net_free(net);
    }
    mgpu_free(x);
    mgpu_free(y);
}
static sharding_findings sharding(int use_gpu, int per_device_batch, const mgpu_options *o) {
    printf("\n4. Data parallelism with Adam: the model's state a device holds between steps (MiB; the device\n"
           "   holding the least), beside the formula, and each device's peak over a step:\n");
    printf("    %-34s %9s %9s %9s %9s %9s %9s %9s\n", "", "params", "grads", "Adam", "state", "formula",
           "peak dev0", "peak rest");
    sharding_findings found = {0, 0, 0, 0, 1};
    parameters_curve curves[2]; /* ZeRO-2's and ZeRO-3's, on 2 devices */
    memset(curves, 0, sizeof curves);
    for (int w = 2; w <= 4; w *= 2) sharded(w, use_gpu, per_device_batch, &found, w == 2 ? curves : NULL);
    printf("  Formulas (float32, Adam's two moments): 4P + 4P + 8P a device; ZeRO-1: 4P + 4P + 8P/w; ZeRO-2:\n"
           "  4P + 4P/w + 8P/w; ZeRO-3: (4P + 4P + 8P)/w. DataParallel's replicas hold 4P + 4P; its device 0\n"
           "  also holds Adam's 8P, the whole batch's logits and a copy of every replica's gradients for the\n"
           "  update it alone makes. ZeRO-2 and 3 shard what lives between steps: a bucket's whole gradient\n"
           "  still lives while the backward pass fills it, ZeRO-3's units (%d MiB buckets) while they run\n"
           "  and while the next one is gathered, and the activations weigh most in the peak.\n", ZERO3_UNIT_MIB);
    zero3_picture(&curves[0], &curves[1], 2, ZERO3_UNIT_MIB, o);
    for (int i = 0; i < 2; i++) {
        free(curves[i].fraction);
        free(curves[i].held_mib);
    }
    return found;
}

/* One try: this program again, with --try-batch. 1 when the step fit;
   else the allocator's line in `why`. */
static int fits(int batch, int segments, double limit_mib, int use_gpu, char *why, size_t size) {
    char self[1024], command[1400];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0) mgpu_fatal("chapter5: cannot find this program (/proc/self/exe: %s)", strerror(errno));
    self[len] = 0;
    snprintf(command, sizeof command, "'%s' --try-batch %d --checkpointed %d --limit-mib %.17g%s 2>&1", self, batch,
             segments != 1, limit_mib, use_gpu ? "" : " --cpu");
    FILE *p = popen(command, "r");
    if (!p) mgpu_fatal("chapter5: cannot start %s (%s)", self, strerror(errno));
    char line[1024];
    why[0] = 0;
    while (fgets(line, sizeof line, p))
        if (strstr(line, "mgpu: error:")) {
            line[strcspn(line, "\n")] = 0;
            snprintf(why, size, "%s", line);
        }
    int status = pclose(p);
    if (status != 0 && !strstr(why, "out of memory"))
        mgpu_fatal("chapter5: a try at batch %d failed otherwise: %s", batch, why[0] ? why : "(no message)");
    return status == 0;
}

/* The largest batch whose step fits: double until one does not, then
   halve the gap until it is within `within`. */
static int largest_batch(int segments, double limit_mib, int use_gpu, int within, char *why, size_t size) {
    int good = 0, bad = 0;
    for (int b = 8; !bad; b *= 2) {
        if (fits(b, segments, limit_mib, use_gpu, why, size)) good = b;
        else bad = b;
        if (b > (1 << 20)) mgpu_fatal("chapter5: batch %d still fits under %g MiB", b, limit_mib);
    }
    char last_why[1024];
    snprintf(last_why, sizeof last_why, "%s", why);
    while (bad - good > within) {
        int mid = (good + bad) / 2;
        if (fits(mid, segments, limit_mib, use_gpu, why, size)) good = mid;
        else bad = mid, snprintf(last_why, sizeof last_why, "%s", why);
    }
    snprintf(why, size, "%s", last_why);
    return good;
}

/* What section 3 found: the largest batch without and with
   checkpointing, and whether checkpointing's was not the smaller. */
typedef struct {
    int plain, checkpointed, holds;
} batch_findings;

/* Checkpointing keeps fewer activations of every batch than the plain
   step, so the largest batch it fits is not smaller; each is found to
   within `within` below the true one. */
static int larger_batch_holds(int plain, int checkpointed, int within) {
    return mgpu_bound_hold("the largest checkpointed batch", checkpointed, MGPU_AT_LEAST, plain,
                           plain > 0 ? (double)within / plain : 0, MEMORY_ADVICE);
}

/* 3. The largest batch under the limit, with and without checkpointing. */
static batch_findings largest_batches(mgpu_device *dev, double limit_mib, int use_gpu, int within) {
    printf("\n3. The largest batch whose step fits in %.0f MiB on %s (found by trying, to within %d):\n",
           limit_mib, mgpu_device_name(dev), within);
    int found[2];
    for (int k = 0; k < 2; k++) {
        char why[1024];
        int segments = k ? MGPU_SEGMENTS_SQRT : 1;
        found[k] = largest_batch(segments, limit_mib, use_gpu, within, why, sizeof why);
        printf("  %-26s batch %d\n", k ? "checkpointed (sqrt n runs)" : "without checkpointing", found[k]);
        printf("    the first that did not fit said: %s\n", why);
    }
    batch_findings batches = {found[0], found[1], larger_batch_holds(found[0], found[1], within)};
    return batches;
}

/* A try (--try-batch): one training step at this batch under the limit. */
static int try_batch(int batch, int segments, double limit_mib, int use_gpu) {
    mgpu_device *dev = use_gpu ? mgpu_try_gpu(0) : mgpu_cpu();
    mgpu_device_set_memory_limit(dev, (size_t)(limit_mib * 1048576.0));
    mgpu_tensor *x, *y;
    step_batch(dev, batch, &x, &y);
    mgpu_net *net = resnet(dev, segments, 0);
    mgpu_net_train_step(net, x, y, 0.1f, 0.9f, 0.0f, NULL);
    mgpu_synchronize(dev);
    return 0;
}

/* The closing lines, from this run's figures; a figure flagged above
   ("!") is named as such instead of explained. */
static void what_this_run_shows(const category_findings *categories, const checkpoint_findings *checkpoints,
                                const batch_findings *batches, const sharding_findings *shards, double limit_mib) {
    printf("\nWhat this run shows:\n");
    if (categories->holds)
        printf("  - The model's state is fixed by the model: %.1f MiB with momentum, %.1f with Adam, as 12P and\n"
               "    16P bytes say; the activations, %.1f MiB at batch %d, grow with the batch.\n",
               categories->state[0], categories->state[1], categories->activations, categories->batch);
    else printf("  - The model's state did not follow its formulas (flagged above).\n");
    if (checkpoints->peaks_hold && checkpoints->root_time_holds)
        printf("  - Checkpointing at about sqrt(n) = %d runs cut the peak activations from %.1f to %.1f MiB\n"
               "    (%.0f%% less) for %.2f times the step's time.\n", checkpoints->root, checkpoints->plain_peak,
               checkpoints->root_peak, 100 * (1 - checkpoints->root_peak / checkpoints->plain_peak),
               checkpoints->root_time);
    else if (checkpoints->peaks_hold)
        printf("  - Checkpointing at about sqrt(n) = %d runs cut the peak activations from %.1f to %.1f MiB;\n"
               "    what it costs in time, this run could not measure (flagged above).\n", checkpoints->root,
               checkpoints->plain_peak, checkpoints->root_peak);
    else printf("  - The peak activations broke their bounds (flagged above).\n");
    if (batches->holds)
        printf("  - Under %.0f MiB, checkpointing fits a batch of %d where the plain step fits %d.\n", limit_mib,
               batches->checkpointed, batches->plain);
    else printf("  - Checkpointing's largest batch came out smaller than the plain step's (flagged above).\n");
    if (shards->holds)
        printf("  - On %d devices with Adam, ZeRO-2 holds %.1f MiB of the model's state a device and ZeRO-3\n"
               "    %.1f against DDP's %.1f, as the formulas say: the sharded state is what grows the model\n"
               "    that fits.\n", shards->devices, shards->zero2_state, shards->zero3_state, shards->ddp_state);
    else printf("  - The model's state under data parallelism did not follow its formulas (flagged above).\n");
}

int main(int argc, char **argv) {
    mgpu_options o;
    memset(&o, 0, sizeof o);
    o.seed = 1;
    int steps = 0, try_at = 0, segments = 0;
    double limit_mib = 0;
    const mgpu_flag extra[] = {
        {"--batch-size", 'i', &o.batch_size, "the batch of sections 1 and 2 (default 16 reduced, else 256)"},
        {"--steps", 'i', &steps, "timed steps for each number of runs, up to 64 (default 3 reduced, else 10)"},
        {"--limit-mib", 'd', &limit_mib, "section 3's memory limit, 1 MiB to 1 TiB (default 320 reduced, else 2048)"},
        {"--try-batch", 'i', &try_at, "(a try of section 3: one step at this batch under --limit-mib)"},
        {"--checkpointed", 'u', &segments, "(a try: 1 with about sqrt(n) checkpointed runs)"},
        {"--devices", 'n', NULL, "chapter 5 measures one device"},
        {"--epochs", 'n', NULL, "chapter 5 times steps, not epochs (--steps)"},
        {"--lr", 'n', NULL, "chapter 5 does not train to an accuracy"},
        {"--data", 'n', NULL, "chapter 5 reads no data: its batches are random images"},
        {"--seed", 'n', NULL, "chapter 5's weights and batches are fixed (memory does not depend on them)"},
    };
    mgpu_options_parse(&o, argc, argv, "chapter5: where a training step's memory goes, and gradient checkpointing",
                       extra, (int)(sizeof extra / sizeof extra[0]));
    MGPU_REQUIRE(steps <= MAX_STEPS, "--steps %d: at most %d", steps, MAX_STEPS);
    MGPU_REQUIRE(limit_mib == 0 || (limit_mib >= 1 && limit_mib <= MAX_LIMIT_MIB),
                 "--limit-mib %g: want 1 to %.0f (MiB: up to 1 TiB)", limit_mib, MAX_LIMIT_MIB);
    MGPU_REQUIRE(segments <= 1, "--checkpointed %d: want 0 or 1", segments);
    int use_gpu = !o.cpu && mgpu_num_gpus() > 0;
    int reduced = !use_gpu && !o.full;
    if (try_at) return try_batch(try_at, segments ? MGPU_SEGMENTS_SQRT : 1, limit_mib, use_gpu);
    int batch = o.batch_size ? o.batch_size : reduced ? 16 : 256;
    if (!steps) steps = reduced ? 3 : 10;
    if (!limit_mib) limit_mib = reduced ? 320 : 2048;
    mgpu_device *dev = use_gpu ? mgpu_try_gpu(0) : mgpu_cpu();
    if (reduced)
        printf("No GPU: a reduced run on the CPU: batch %d, %d timed steps, a limit of %.0f MiB (--full: batch "
               "256, 10 steps, 2048 MiB).\n", batch, steps, limit_mib);
    category_findings categories = memory_by_category(dev, batch);
    checkpoint_findings checkpoints = checkpointing(dev, batch, steps, &o);
    batch_findings batches = largest_batches(dev, limit_mib, use_gpu, reduced ? 4 : 16);
    sharding_findings shards = sharding(use_gpu, batch >= 4 ? batch / 4 : 1, &o); /* (a quarter of the batch
                                                                                      a device) */
    what_this_run_shows(&categories, &checkpoints, &batches, &shards, limit_mib);
    return mgpu_output_errors() ? 1 : 0;
}
