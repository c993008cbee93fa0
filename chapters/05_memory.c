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
   allreduced).

   The chapter measures, on one device (a GPU, or the CPU):
     1. a ResNet-18 step's memory by category, beside the formulas, with
        SGD and momentum and with Adam;
     2. the peak activations and the step's time at 1 (none), 2, about sqrt(n)
        and n checkpointed runs, beside the formula, and a picture of
        memory through a step (chapter5_memory_timeline.png);
     3. the largest batch that fits under a memory limit, with and
        without checkpointing, found by trying: each try is this program
        again (--try-batch), stopped by the allocator's one-line error
        when the step does not fit;
     4. with 2 and 4 devices and Adam, what each device holds of the
        model's state with DataParallel's gather, DDP's allreduce, ZeRO-1
        and ZeRO-2, beside the formulas.

   What you should see (a 2-core CPU, the reduced run: batch 16, a limit
   of 320 MiB): about 43 MiB each for the parameters, their gradients and
   the momentum (P = 11.2 million); activations near 60 MiB at their peak;
   at about sqrt(12) = 3 runs the activations' peak falls by about 40%
   and the step takes about 1.2 times as long; the largest batch under the
   limit grows by about half with checkpointing (48 to 68). ResNet-18's
   layers are not equal (its first layers' outputs are the largest), so
   the measured peaks sit above the formula for equal layers printed
   beside them. With 4 devices and Adam, each device holds 171 MiB of the
   model's state under DDP, 107 with ZeRO-1 and 75 with ZeRO-2, as the
   formulas say to the tenth of a MiB.

   Without a GPU it runs a reduced setting (batch 16, 3 timed steps, a
   limit of 320 MiB); --full, or a GPU, runs batch 256 and a limit of
   2 GiB.

   Reads: mgpu/memory.h (memory by category), mgpu/networks.h (activation
   recomputation, mgpu_net_recompute), mgpu/zero.h (ZeRO-1 and ZeRO-2),
   mgpu/data_parallel_step.h, mgpu/plots.h, mgpu/flags.h. */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"
#include <unistd.h>

#define MAX_STEPS 64 /* timed steps a number of runs: their median is printed */
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

/* 1. Memory by category at the peak of a step (the second: the first
   makes the optimizer's state), for SGD with momentum and for Adam. */
static void memory_by_category(mgpu_device *dev, int batch) {
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
    printf("\n1. A ResNet-18 step's memory on %s at its peak, batch %d (MiB); P = %.1f million parameters:\n",
           mgpu_device_name(dev), batch, p / 1e6);
    printf("  %-16s %14s %14s   %s\n", "", "SGD, momentum", "Adam", "formula (SGD / Adam)");
    const int order[] = {MGPU_MEMORY_PARAMETERS, MGPU_MEMORY_GRADIENTS, MGPU_MEMORY_OPTIMIZER,
                         MGPU_MEMORY_ACTIVATIONS, MGPU_MEMORY_WORKSPACE, MGPU_MEMORY_OTHER};
    for (int k = 0; k < 6; k++) {
        int c = order[k];
        printf("  %-16s %14.1f %14.1f   ", mgpu_memory_category_name((mgpu_memory_category)c), mib(held[0][c]),
               mib(held[1][c]));
        if (c == MGPU_MEMORY_PARAMETERS) printf("4P = %.1f (and batch norm's statistics)\n", 4 * p / 1048576.0);
        else if (c == MGPU_MEMORY_GRADIENTS) printf("4P = %.1f\n", 4 * p / 1048576.0);
        else if (c == MGPU_MEMORY_OPTIMIZER) printf("4P = %.1f / 8P = %.1f\n", 4 * p / 1048576.0, 8 * p / 1048576.0);
        else if (c == MGPU_MEMORY_ACTIVATIONS) printf("grows with the batch\n");
        else if (c == MGPU_MEMORY_WORKSPACE) printf("activation gradients of a layer or two, scratch\n");
        else printf("the batch itself\n");
    }
    printf("  %-16s %14.1f %14.1f\n", "the whole peak", mib(peak[0]), mib(peak[1]));
    mgpu_free(x);
    mgpu_free(y);
}

typedef struct {
    int segments;
    double activations, step_ms;
    int nsamples;
    double *event, *act_mib; /* the last timed step's activations, after each of the allocator's calls */
} checkpoint_run;

/* A step with `segments` runs, timed `steps` times after one to warm up:
   the peak activations and the median step. */
static checkpoint_run checkpoint_try(mgpu_device *dev, int batch, int segments, int steps) {
    checkpoint_run r = {segments, 0, 0, 0, NULL, NULL};
    mgpu_tensor *x, *y;
    step_batch(dev, batch, &x, &y);
    mgpu_net *net = resnet(dev, segments, 0);
    mgpu_net_train_step(net, x, y, 0.1f, 0.9f, 0.0f, NULL);
    mgpu_synchronize(dev);
    double ms[MAX_STEPS];
    for (int s = 0; s < steps; s++) {
        mgpu_device_reset_peak(dev);
        mgpu_device_record_memory(dev, 1);
        double start = mgpu_now();
        mgpu_net_train_step(net, x, y, 0.1f, 0.9f, 0.0f, NULL);
        mgpu_synchronize(dev);
        ms[s] = 1e3 * (mgpu_now() - start);
        mgpu_device_record_memory(dev, 0);
        r.activations = mib(mgpu_device_memory_peak_of(dev, MGPU_MEMORY_ACTIVATIONS));
        if (s == steps - 1) {
            const mgpu_memory_sample *samples;
            r.nsamples = mgpu_device_memory_samples(dev, &samples);
            r.event = (double *)mgpu_malloc(sizeof(double) * (size_t)(r.nsamples + 1));
            r.act_mib = (double *)mgpu_malloc(sizeof(double) * (size_t)(r.nsamples + 1));
            for (int i = 0; i < r.nsamples; i++) {
                r.event[i] = i;
                r.act_mib[i] = mib(samples[i].held[MGPU_MEMORY_ACTIVATIONS]);
            }
        }
    }
    r.step_ms = mgpu_median(ms, steps);
    mgpu_net_free(net);
    mgpu_free(x);
    mgpu_free(y);
    return r;
}

/* 2. Checkpointing at 1 (none), 2, about sqrt(n) and n runs. */
static void checkpointing(mgpu_device *dev, int batch, int steps, const mgpu_options *o) {
    /* O: a layer's output on average, the tensor a run keeps for the next */
    mgpu_net *probe = resnet(dev, 1, 0);
    int n = probe->nlayers, root = (int)lround(sqrt((double)n));
    mgpu_tensor *x, *y;
    step_batch(dev, batch, &x, &y);
    mgpu_net_forward(probe, x);
    double outputs = 0;
    for (int i = 0; i < n; i++) outputs += mib(probe->layers[i]->output->numel * sizeof(float));
    double o_mean = outputs / n;
    mgpu_free(x);
    mgpu_free(y);
    mgpu_net_free(probe);
    int runs[4] = {1, 2, root, n};
    checkpoint_run r[4];
    for (int i = 0; i < 4; i++) r[i] = checkpoint_try(dev, batch, runs[i], steps);
    printf("\n2. Gradient checkpointing: ResNet-18's n = %d layers (its blocks) in k runs, batch %d, median of %d "
           "steps:\n", n, batch, steps);
    printf("  %5s %18s %26s %10s %8s\n", "k", "peak activations", "formula (n/k) A + (k - 1) O", "step ms",
           "time");
    double a_mean = r[0].activations / n;
    for (int i = 0; i < 4; i++) {
        int k = runs[i];
        double formula = (double)n / k * a_mean + (k - 1) * o_mean;
        printf("  %5d %14.1f MiB %22.1f MiB %10.1f %7.2fx\n", runs[i], r[i].activations, formula, r[i].step_ms,
               r[i].step_ms / r[0].step_ms);
    }
    printf("  A = %.1f MiB, a layer's activations on average (all it keeps: a residual block keeps 5 or 6\n"
           "  tensors); O = %.2f MiB, a layer's output on average (the one tensor a run keeps for the next).\n"
           "  ResNet-18's first layers hold the most (64 channels at 28x28), so a run of them weighs more\n"
           "  than the formula's average run: the measured peaks sit above it.\n", a_mean, o_mean);
    mgpu_series series[2];
    memset(series, 0, sizeof series);
    char names[2][48];
    for (int i = 0; i < 2; i++) {
        const checkpoint_run *c = &r[i == 0 ? 0 : 2];
        snprintf(names[i], sizeof names[i], i == 0 ? "no checkpointing" : "%d runs", c->segments);
        series[i].name = names[i];
        series[i].n = c->nsamples;
        series[i].x = c->event;
        series[i].y = c->act_mib;
    }
    mgpu_chart chart;
    memset(&chart, 0, sizeof chart);
    chart.title = "activations held during a ResNet-18 step";
    chart.xlabel = "time: the allocator's calls during the step, in order";
    chart.ylabel = "MiB";
    chart.nseries = 2;
    chart.series = series;
    char path[1024];
    if (mgpu_chart_write_png(&chart, mgpu_out_path(o, "chapter5_memory_timeline.png", path, sizeof path)) == 0)
        printf("memory through the step: %s (without checkpointing every layer's output stays\n"
               "allocated from one step to the next; with it, each run's activations come and go)\n", path);
    for (int i = 0; i < 4; i++) {
        free(r[i].event);
        free(r[i].act_mib);
    }
}

/* 4. Data parallelism on w devices, Adam: what each device holds of the
   model's state (parameters, gradients, optimizer state) between steps,
   and its peak, for DataParallel's gather, DDP's allreduce, ZeRO-1 and
   ZeRO-2, beside the formulas. */
static void sharded(int w, int use_gpu, int per_device_batch) {
    mgpu_device *devs[MGPU_MAX_DEVICES];
    mgpu_devices(w, use_gpu, devs);
    mgpu_tensor *x, *y;
    step_batch(mgpu_cpu(), per_device_batch * w, &x, &y);
    static const char *names[4] = {"gather on device 0 (DataParallel)", "allreduce (DDP)", "ZeRO-1", "ZeRO-2"};
    printf("  %d devices, batch %d:\n", w, per_device_batch * w);
    for (int mode = 0; mode < 4; mode++) {
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
        if (mode >= 2) mgpu_data_parallel_zero(dp, mode - 1);
        for (int step = 0; step < 2; step++) mgpu_data_parallel_step(dp, x, y, 0.001f, 0.0f, 0.0f);
        mgpu_synchronize_all();
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
           and the gradients' 4P / w too with ZeRO-2 */
        double four = 4 * p / 1048576.0, formula = four + (mode == 3 ? four / w : four) + (mode >= 2 ? 2 * four / w : 2 * four);
        if (mode == 0) formula = 2 * four; /* (a replica; device 0 also holds Adam's state and the others' gradients) */
        printf("    %-34s %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f\n", names[mode], state[0], state[1], state[2],
               state[0] + state[1] + state[2], formula, peak0, peak_rest);
        mgpu_data_parallel_free(dp);
        mgpu_net_free(net);
    }
    mgpu_free(x);
    mgpu_free(y);
}
static void sharding(int use_gpu, int per_device_batch) {
    printf("\n4. Data parallelism with Adam: the model's state a device holds between steps (MiB; the device\n"
           "   holding the least), beside the formula, and each device's peak over a step:\n");
    printf("    %-34s %9s %9s %9s %9s %9s %9s %9s\n", "", "params", "grads", "Adam", "state", "formula",
           "peak dev0", "peak rest");
    for (int w = 2; w <= 4; w *= 2) sharded(w, use_gpu, per_device_batch);
    printf("  Formulas (float32, Adam's two moments): 4P + 4P + 8P a device; ZeRO-1: 4P + 4P + 8P/w; ZeRO-2:\n"
           "  4P + 4P/w + 8P/w. DataParallel's replicas hold 4P + 4P; its device 0 also holds Adam's 8P, the\n"
           "  whole batch's logits and a copy of every replica's gradients for the update it alone makes:\n"
           "  the highest peak of all. ZeRO-2's peak is not below ZeRO-1's here: a bucket's whole gradient\n"
           "  lives while the backward pass fills it, and the activations dominate the peak.\n");
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

/* 3. The largest batch under the limit, with and without checkpointing. */
static void largest_batches(mgpu_device *dev, double limit_mib, int use_gpu, int within) {
    printf("\n3. The largest batch whose step fits in %.0f MiB on %s (found by trying, to within %d):\n",
           limit_mib, mgpu_device_name(dev), within);
    for (int k = 0; k < 2; k++) {
        char why[1024];
        int segments = k ? MGPU_SEGMENTS_SQRT : 1;
        int b = largest_batch(segments, limit_mib, use_gpu, within, why, sizeof why);
        printf("  %-26s batch %d\n", k ? "checkpointed (sqrt n runs)" : "without checkpointing", b);
        printf("    the first that did not fit said: %s\n", why);
    }
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
    memory_by_category(dev, batch);
    checkpointing(dev, batch, steps, &o);
    largest_batches(dev, limit_mib, use_gpu, reduced ? 4 : 16);
    sharding(use_gpu, batch >= 4 ? batch / 4 : 1); /* (a quarter of the batch a device) */
    return mgpu_output_errors() ? 1 : 0;
}
