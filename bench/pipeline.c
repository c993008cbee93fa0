/* bench/pipeline.c: what pipelining buys (chapter 6's issue: 2 stages on
   2 CPU devices with m = 8 micro-batches at least 1.6 times naive model
   parallelism's throughput; the formula allows 2 (m / (m + p - 1)) =
   1.78), and what ZB-H1 and interleaved 1F1B buy beyond 1F1B (issue 52).

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
   that difference, about 4% of a stage. Five pipelines of the same
   network take SGD steps in turn, step by step: naive model parallelism
   (m = 1), GPipe, 1F1B and ZB-H1 (each backward pass split into the
   input's gradient and the weights', on the same cut) with m = 8, and
   interleaved 1F1B with m = 8 on the network cut into 2p stages of equal
   blocks, device d holding stages d and d + p (2 chunks a device). First
   one step each without an update checks the gradients (per tensor, the
   largest difference over the largest value): GPipe's against naive's
   (the whole batch through the stages at once: one device's) within
   1e-4, the others' against GPipe's within 1e-5; a failure exits with
   status 1; then 2 untimed steps, then
   --steps timed each, each timed to every device's end. Then one traced
   step each gives the bubble (mgpu_pipeline_measure: an interleaved
   pipeline's per device). Prints the medians, the speed-ups over naive,
   the bubbles beside their formulas ((p - 1) / (m + p - 1) for GPipe and
   1F1B, (p - 1) / (3m + p - 1) for ZB-H1, (p - 1) / (2m + p - 1) for
   interleaved 1F1B with 2 chunks, each for equal passes), then
       RESULT pipeline on=[cpu, cpu#1] stages=2 batch=2048 micro_batches=8 chunks=2 naive_ms=... gpipe_ms=...
              one_f_one_b_ms=... zero_bubble_ms=... interleaved_ms=... gpipe_speedup=... (and the others')
              gpipe_bubble=... gpipe_formula=... (and the others')
   (bench/pytorch/pipeline.py is PyTorch's side: the same model and cuts,
   torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B,
   ScheduleInterleavedZeroBubble and ScheduleInterleaved1F1B.)

       ./bench/pipeline [--batch-size B] [--steps N] [--stages 2|4] [--cpu] */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"

enum { BLOCKS = 16, WIDTH = 1024, MICRO_BATCHES = 8, CHUNKS = 2, SCHEDULES = 5 };

/* The schedules, in the order of their rounds. An interleaved one cuts the
   network in CHUNKS * p stages, CHUNKS a device; the others in p. */
typedef struct {
    const char *name, *key; /* the table's name, the RESULT line's key */
    mgpu_schedule_fn schedule;
    int micro_batches, interleaved;
} bench_schedule;
static const bench_schedule schedules[SCHEDULES] = {
    {"naive", "naive", mgpu_schedule_gpipe, 1, 0},
    {"GPipe", "gpipe", mgpu_schedule_gpipe, MICRO_BATCHES, 0},
    {"1F1B", "one_f_one_b", mgpu_schedule_1f1b, MICRO_BATCHES, 0},
    {"ZB-H1", "zero_bubble", mgpu_schedule_zb_h1, MICRO_BATCHES, 0},
    {"interleaved 1F1B", "interleaved", NULL, MICRO_BATCHES, 1},
};

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

static mgpu_pipeline *pipeline(mgpu_net *net, mgpu_device *const *devs, int devices, const bench_schedule *b) {
    int stages = b->interleaved ? CHUNKS * devices : devices;
    int first[CHUNKS * 4];
    for (int s = 0; s < stages; s++) first[s] = 2 * (s * BLOCKS / stages); /* (a linear layer and its ReLU each) */
    if (!b->interleaved) {
        mgpu_pipeline *pp = mgpu_pipeline_new(net, devs, stages, first);
        mgpu_pipeline_set_schedule(pp, b->schedule, b->micro_batches);
        return pp;
    }
    mgpu_pipeline *pp = mgpu_pipeline_new_interleaved(net, devs, devices, CHUNKS, first);
    mgpu_pipeline_set_interleaved_schedule(pp, mgpu_schedule_interleaved_1f1b, b->micro_batches);
    return pp;
}

static double bubble_formula(const bench_schedule *b, int devices) {
    if (b->interleaved) return mgpu_pipeline_interleaved_bubble_formula(devices, CHUNKS, b->micro_batches);
    if (b->schedule == mgpu_schedule_zb_h1) return mgpu_pipeline_zb_h1_bubble_formula(devices, b->micro_batches);
    return mgpu_pipeline_bubble_formula(devices, b->micro_batches);
}

/* The largest difference between two pipelines' gradients of the same
   network (each parameter's, relative to its largest value in b), however
   each is cut: their stages' parameters, in order, are the network's. */
static double grad_diff(mgpu_pipeline *a, mgpu_pipeline *b) {
    double worst = 0;
    int sa = 0, ia = 0;
    for (int sb = 0; sb < mgpu_pipeline_num_stages(b); sb++) {
        mgpu_net *stage_b = mgpu_pipeline_stage(b, sb);
        for (int ib = 0; ib < mgpu_net_num_params(stage_b); ib++, ia++) {
            while (ia == mgpu_net_num_params(mgpu_pipeline_stage(a, sa))) sa++, ia = 0;
            const mgpu_tensor *ga = mgpu_net_param(mgpu_pipeline_stage(a, sa), ia)->grad;
            const mgpu_tensor *gb = mgpu_net_param(stage_b, ib)->grad;
            float *va = (float *)malloc(sizeof(float) * ga->numel), *vb = (float *)malloc(sizeof(float) * gb->numel);
            mgpu_to_host(ga, va);
            mgpu_to_host(gb, vb);
            double diff = 0, scale = 1e-30;
            for (size_t i = 0; i < gb->numel; i++) {
                diff = fmax(diff, fabs((double)va[i] - vb[i]));
                scale = fmax(scale, fabs((double)vb[i]));
            }
            worst = fmax(worst, diff / scale);
            free(va);
            free(vb);
        }
    }
    return worst;
}

int main(int argc, char **argv) {
    mgpu_options o;
    memset(&o, 0, sizeof o);
    o.seed = 1;
    int steps = 10, devices = 2;
    const mgpu_flag extra[] = {
        {"--batch-size", 'i', &o.batch_size, "the batch (default 2048)"},
        {"--steps", 'i', &steps, "timed steps of each (default 10)"},
        {"--stages", 'i', &devices, "2 or 4 stages, on as many devices (default 2)"},
    };
    mgpu_options_parse(&o, argc, argv,
                       "bench/pipeline: an MLP's steps in stages: naive, GPipe, 1F1B, ZB-H1 and interleaved 1F1B",
                       extra, (int)(sizeof extra / sizeof extra[0]));
    MGPU_REQUIRE(devices == 2 || devices == 4, "--stages %d: 2 or 4", devices);
    int batch = o.batch_size ? o.batch_size : 2048;
    MGPU_REQUIRE(batch >= MICRO_BATCHES, "--batch-size %d: at least %d", batch, MICRO_BATCHES);
    mgpu_device *devs[4];
    mgpu_devices(devices, !o.cpu, devs);
    mgpu_manual_seed(7);
    mgpu_tensor *x = mgpu_randn(mgpu_cpu(), mgpu_shape2(batch, WIDTH), 0.0f, 1.0f);
    float *labels = (float *)malloc(sizeof(float) * (size_t)batch);
    for (int i = 0; i < batch; i++) labels[i] = (float)(i % 10);
    mgpu_tensor *y = mgpu_from_host(mgpu_cpu(), mgpu_shape1(batch), labels);
    free(labels);
    mgpu_net *nets[SCHEDULES];
    mgpu_pipeline *pipes[SCHEDULES];
    double *ms[SCHEDULES], median[SCHEDULES], bubble[SCHEDULES];
    for (int k = 0; k < SCHEDULES; k++) {
        nets[k] = mlp(devs[0]);
        pipes[k] = pipeline(nets[k], devs, devices, &schedules[k]);
        ms[k] = (double *)malloc(sizeof(double) * (size_t)steps);
    }
    /* The check, on the same weights and batch: GPipe's gradients are
       naive model parallelism's (one device's on the whole batch) but for
       the order of the sums over the micro-batches, which moves them by
       up to about 3e-5 of each tensor's largest value here (the random
       labels' gradients mostly cancel over the rows, so the largest value
       is small beside the terms summed); the other schedules run GPipe's
       micro-batches, passes and sums, only in other orders and places, so
       theirs are GPipe's within 1e-5. */
    for (int k = 0; k < SCHEDULES; k++) mgpu_pipeline_forward_backward(pipes[k], x, y, NULL);
    mgpu_synchronize_all();
    for (int k = 1; k < SCHEDULES; k++) {
        int against = k == 1 ? 0 : 1;
        double tolerance = k == 1 ? 1e-4 : 1e-5, diff = grad_diff(pipes[k], pipes[against]);
        printf("check: %s's gradients against %s's: largest relative difference %.2e (tolerance %.0e): %s\n",
               schedules[k].name, schedules[against].name, diff, tolerance, diff <= tolerance ? "ok" : "FAILED");
        if (diff > tolerance) return 1;
    }
    for (int s = -2; s < steps; s++)
        for (int k = 0; k < SCHEDULES; k++) {
            mgpu_synchronize_all();
            double start = mgpu_now();
            mgpu_pipeline_train_step(pipes[k], x, y, 0.01f, 0.0f, 0.0f, NULL);
            mgpu_synchronize_all();
            if (s >= 0) ms[k][s] = 1e3 * (mgpu_now() - start);
        }
    for (int k = 0; k < SCHEDULES; k++) {
        median[k] = mgpu_median(ms[k], steps);
        mgpu_trace_begin();
        mgpu_pipeline_forward_backward(pipes[k], x, y, NULL);
        mgpu_trace_end();
        bubble[k] = mgpu_pipeline_measure(pipes[k]).bubble_mean;
    }
    char on[128];
    mgpu_device_list(on, sizeof on, devs, devices);
    printf("An MLP of %d blocks of %d features in %d stages on %s (interleaved: %d stages, %d a device), batch %d, "
           "median of %d steps:\n", BLOCKS, WIDTH, devices, on, CHUNKS * devices, CHUNKS, batch, steps);
    printf("  %-16s %3s %10s %10s %8s %8s\n", "", "m", "ms a step", "speed-up", "bubble", "formula");
    for (int k = 0; k < SCHEDULES; k++)
        printf("  %-16s %3d %10.2f %9.3fx %8.3f %8.3f\n", schedules[k].name, schedules[k].micro_batches, median[k],
               median[0] / median[k], bubble[k], bubble_formula(&schedules[k], devices));
    printf("RESULT pipeline on=%s stages=%d batch=%d micro_batches=%d chunks=%d", on, devices, batch, MICRO_BATCHES,
           CHUNKS);
    for (int k = 0; k < SCHEDULES; k++) printf(" %s_ms=%.3f", schedules[k].key, median[k]);
    for (int k = 1; k < SCHEDULES; k++) printf(" %s_speedup=%.4f", schedules[k].key, median[0] / median[k]);
    for (int k = 1; k < SCHEDULES; k++)
        printf(" %s_bubble=%.4f %s_formula=%.4f", schedules[k].key, bubble[k], schedules[k].key,
               bubble_formula(&schedules[k], devices));
    printf("\n");
    for (int k = 0; k < SCHEDULES; k++) {
        mgpu_pipeline_free(pipes[k]);
        mgpu_net_free(nets[k]);
        free(ms[k]);
    }
    mgpu_free(x);
    mgpu_free(y);
    return 0;
}
