/* Chapter 1: automatic parallelism.

   What it teaches. A device runs what you give it in order, but
   asynchronously to your program: enqueueing work returns at once. So two
   devices given work back to back, with one synchronisation at the end,
   compute at the same time, and the total is close to the longer of the
   two, not their sum. The same holds for one device's compute and its copy
   engine: results can travel to the host while the next ones are being
   computed, if the copies do not block the program.

   What you should see.
     dev1 (cuda:0) time: ...     dev2 (cuda:1) time: ...
     dev1 & dev2: ...            about the larger of the two
     run on dev1: ...  copy to host: ...  copy to pinned host memory: ...
     run on dev1 and copy to host: ...
                                 less than the sum of compute and pinned copy
   and chapter1_timeline.png, one lane per device queue: the two compute
   lanes overlap, then the copy lane runs under the compute lane.

   Each time is the fastest of three runs: on a machine shared with other
   work a single run can be slowed by what else ran then, and the fastest
   is the one least disturbed. If the times still say something that
   cannot be (two devices together faster than the slower one alone,
   compute and copy together faster than the longer of the two alone),
   the machine was busy, and the chapter says so instead of explaining
   the number.

   On one GPU the second device is virtual (cuda:0#1): its own queue on the
   same GPU. A 4000x4000 product fills the whole GPU, so the two queues take
   turns and "dev1 & dev2" is about the sum: parallelism needs hardware to
   run on. Without a GPU the two devices are CPU worker threads, each with
   its own share of the cores, and they do overlap.

   Reads: mgpu/queues.h (a device's queues), mgpu/devices.h, mgpu/events.h,
   mgpu/tensor_ops.h (mgpu_matmul, mgpu_to), mgpu/timing.h (timers and
   the tracer), mgpu/plots.h (the timeline), mgpu/flags.h (the flags). */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"

#define MAX_REPS 200

/* The book's workload: `reps` products of x with itself, kept in a list. */
static void run(mgpu_tensor *x, int reps, mgpu_tensor **results) {
    for (int i = 0; i < reps; i++) {
        if (!results[i]) results[i] = mgpu_empty(x->device, x->shape);
        mgpu_matmul(results[i], x, x);
    }
}

/* Copies every result to host memory, each copy blocking the program. */
static void copy_to_host(mgpu_tensor **results, mgpu_tensor **host, int reps) {
    for (int i = 0; i < reps; i++) mgpu_copy(host[i], results[i], 0);
}

/* Every result copied into pinned memory without blocking, then one wait:
   the copies alone, as run_and_copy makes them. */
static void copy_to_pinned(mgpu_tensor **results, mgpu_tensor **pinned, int reps) {
    for (int i = 0; i < reps; i++) mgpu_copy(pinned[i], results[i], 1);
}

/* Each product, then at once a non-blocking copy of it into pinned memory.
   A copy waits for what its device was given before it: enqueued right
   after product i, copy i waits for product i only, and travels while
   product i+1 is computed. (Enqueue all products first and every copy
   would wait for all of them.) */
static void run_and_copy(mgpu_tensor *x, int reps, mgpu_tensor **results, mgpu_tensor **pinned) {
    for (int i = 0; i < reps; i++) {
        mgpu_matmul(results[i], x, x);
        mgpu_copy(pinned[i], results[i], 1);
    }
}

/* The experiments, and what each waits for. */
typedef enum { DEV1, DEV2, BOTH, COPY, COPY_PINNED, RUN_AND_COPY } experiment;
typedef struct {
    mgpu_tensor *x1, *x2, **y1, **y2, **host, **pinned;
    int reps;
} workload;

static void perform(experiment e, const workload *w) {
    switch (e) {
    case DEV1: run(w->x1, w->reps, w->y1); break;
    case DEV2: run(w->x2, w->reps, w->y2); break;
    case BOTH:
        run(w->x1, w->reps, w->y1); /* returns as soon as the work is enqueued ... */
        run(w->x2, w->reps, w->y2); /* ... so this starts while dev1 is still busy */
        break;
    case COPY: copy_to_host(w->y1, w->host, w->reps); break;
    case COPY_PINNED: copy_to_pinned(w->y1, w->pinned, w->reps); break;
    case RUN_AND_COPY: run_and_copy(w->x1, w->reps, w->y1, w->pinned); break;
    }
    mgpu_synchronize_all();
}

/* The fastest of three runs of experiment e, printed as the book's
   Benchmark prints a time. */
static double fastest_of_three(const char *name, experiment e, const workload *w) {
    double best = 0;
    for (int i = 0; i < 3; i++) {
        double start = mgpu_now();
        perform(e, w);
        double seconds = mgpu_now() - start;
        if (i == 0 || seconds < best) best = seconds;
    }
    printf("%s: %.4f sec\n", name, best);
    return best;
}

int main(int argc, char **argv) {
    mgpu_options o;
    memset(&o, 0, sizeof o);
    o.seed = 1;
    int size = 0, reps = 0;
#define CHAPTER1_NOT_TAKEN "chapter 1 trains nothing and reads no data (its work is --size and --reps)"
    const mgpu_flag extra[] = {
        {"--size", 'i', &size, "matrix size (default: 4000 on a GPU or with --full, else 1250)"},
        {"--reps", 'i', &reps, "matrix products per run (default: 50 on a GPU or with --full, else 20)"},
        {"--epochs", 'n', NULL, CHAPTER1_NOT_TAKEN},
        {"--batch-size", 'n', NULL, CHAPTER1_NOT_TAKEN},
        {"--lr", 'n', NULL, CHAPTER1_NOT_TAKEN},
        {"--data", 'n', NULL, CHAPTER1_NOT_TAKEN},
    };
    mgpu_options_parse(&o, argc, argv,
                       "chapter1: automatic parallelism on two devices, and compute overlapped "
                       "with copies",
                       extra, (int)(sizeof extra / sizeof extra[0]));

    MGPU_REQUIRE(o.devices == 0 || o.devices == 2,
                 "--devices %d: chapter 1 compares exactly two devices", o.devices);
    mgpu_device *dev[2];
    mgpu_devices(2, !o.cpu, dev);
    int on_gpu = mgpu_device_is_gpu(dev[0]);
    int reduced = !on_gpu && !o.full;
    if (!size) size = reduced ? 1250 : 4000;
    if (!reps) reps = reduced ? 20 : 50;
    MGPU_REQUIRE(reps <= MAX_REPS, "--reps: at most %d", MAX_REPS);
    if (reduced)
        printf("No GPU: two CPU devices, %d products of %dx%d matrices (--full: 50 of 4000x4000).\n",
               reps, size, size);

    char name1[64], name2[64], both[96], run1[64], runcopy[96];
    snprintf(name1, sizeof name1, "dev1 (%s) time", mgpu_device_name(dev[0]));
    snprintf(name2, sizeof name2, "dev2 (%s) time", mgpu_device_name(dev[1]));
    snprintf(both, sizeof both, "dev1 & dev2");
    snprintf(run1, sizeof run1, "run on dev1 (%s)", mgpu_device_name(dev[0]));
    snprintf(runcopy, sizeof runcopy, "run on dev1 (%s) and copy to host", mgpu_device_name(dev[0]));

    mgpu_manual_seed(o.seed);
    mgpu_tensor *x1 = mgpu_rand(dev[0], mgpu_shape2(size, size));
    mgpu_tensor *x2 = mgpu_rand(dev[1], mgpu_shape2(size, size));
    mgpu_tensor *y1[MAX_REPS] = {0}, *y2[MAX_REPS] = {0};

    mgpu_tensor *host[MAX_REPS], *pinned[MAX_REPS];
    for (int i = 0; i < reps; i++) {
        host[i] = mgpu_empty(mgpu_cpu(), x1->shape);
        pinned[i] = mgpu_empty_pinned(x1->shape);
    }
    workload w = {x1, x2, y1, y2, host, pinned, reps};

    /* Warm up both devices (allocations, library start-up) before timing. */
    perform(BOTH, &w);

    printf("\nEach time is the fastest of 3 runs.\n");
    printf("\n1. Two devices\n");
    double t1 = fastest_of_three(name1, DEV1, &w);
    double t2 = fastest_of_three(name2, DEV2, &w);
    double t12 = fastest_of_three(both, BOTH, &w);

    printf("\n2. Compute and copy\n");
    double t_run = fastest_of_three(run1, DEV1, &w); /* (dev1's run again, in this part's words) */
    double t_copy = fastest_of_three("copy to host", COPY, &w);
    /* The copies below go to pinned memory, which the GPU reads and writes
       directly; the ones above went to ordinary memory, through a staging
       buffer (and, the first time, through the page faults of fresh
       memory). So that compute and copy are compared like with like, the
       pinned copies are timed alone too. */
    double t_pinned = fastest_of_three("copy to pinned host memory", COPY_PINNED, &w);
    double t_both = fastest_of_three(runcopy, RUN_AND_COPY, &w);

    /* The timeline: one more run of the two experiments that overlap. */
    mgpu_trace_begin();
    perform(BOTH, &w);
    perform(RUN_AND_COPY, &w);
    mgpu_trace_end();

    double flops = 2.0 * size * (double)size * size * reps;
    double bytes = 4.0 * size * (double)size * reps;
    printf("\nWhat this run shows:\n");
    printf("  each device alone: %.1f and %.1f GFLOP/s\n", flops / t1 * 1e-9, flops / t2 * 1e-9);
    printf("  together they took %.2f of the sum of the two alone (1.00: one after the other,\n"
           "  0.50: fully side by side).\n", t12 / (t1 + t2));
    /* (5% below what can be is left to the timer's noise) */
    if (t12 < 0.95 * (t1 > t2 ? t1 : t2))
        printf("  That cannot be: together they took less than the slower one alone. The\n"
               "  machine was busy with other work while this ran; run it again when it is\n"
               "  quiet.\n");
    else if (on_gpu && mgpu_device_gpu_index(dev[0]) == mgpu_device_gpu_index(dev[1]))
        printf("  Both devices are queues on the same GPU: a %dx%d product keeps every\n"
               "  multiprocessor busy, so the queues take turns and little overlaps.\n",
               size, size);
    else if (t12 / (t1 + t2) < 0.75)
        printf("  The devices ran at the same time: one synchronisation at the end let\n"
               "  the second start while the first was still busy.\n");
    else
        printf("  Little overlap here: the two devices share what limits them (cores or\n"
               "  memory bandwidth).\n");
    printf("  copies moved %.2f GB/s to ordinary memory, %.2f GB/s to pinned memory;\n"
           "  compute and the pinned copies together took %.2f of their sum and %.2f\n"
           "  of the longer one (1.00: the copies hid under the compute).\n",
           bytes / t_copy * 1e-9, bytes / t_pinned * 1e-9, t_both / (t_run + t_pinned),
           t_both / (t_run > t_pinned ? t_run : t_pinned));
    if (t_both < 0.95 * (t_run > t_pinned ? t_run : t_pinned))
        printf("  That cannot be: both together took less than the longer one alone. The\n"
               "  machine was busy with other work while this ran; run it again when it is\n"
               "  quiet.\n");

    char path[1024];
    mgpu_out_path(&o, "chapter1_timeline.png", path, sizeof path);
    if (mgpu_trace_write_png(path, "chapter 1: two devices, then compute and copy") == 0)
        printf("\ntimeline: %s\n", path);

    for (int i = 0; i < reps; i++) {
        mgpu_free(y1[i]);
        mgpu_free(y2[i]);
        mgpu_free(host[i]);
        mgpu_free(pinned[i]);
    }
    mgpu_free(x1);
    mgpu_free(x2);
    return mgpu_output_errors() ? 1 : 0; /* (each said so on stderr) */
}
