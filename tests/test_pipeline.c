/* tests/test_pipeline.c: a network cut into stages (mgpu_pipeline).

   - every schedule (naive, GPipe, 1F1B, zero-bubble ZB-H1; 2 and 3
     stages; micro-batches that do and do not divide the batch) gives one
     device's gradients on the same batch, within 1e-5, for a network
     without batch norm;
   - with batch norm, one device that runs the micro-batches in turn:
     gradients and running statistics, in one stage and in two;
   - interleaved 1F1B (v = 2 chunks a device, 4 and 6 stages on 2 and 3
     devices) gives one device's gradients within 1e-5;
   - ZB-H1 splits a layer of one's own that says it can (a learnt scale):
     one device's gradients within 1e-5, its B and W each called with
     their gradients alone;
   - steps with momentum train like one device, and freeing the pipeline
     gives the network its trained values and momentum;
   - 1F1B holds at most min(m, p - s) micro-batches' activations on stage
     s, GPipe m of them, ZB-H1 p of them on every stage (those between B
     and W keep theirs until W): measured against one micro-batch's;
     interleaved 1F1B its warm-up and one more chunks' micro-batches on
     device d (Megatron's count, 2 (p - d - 1) + (v - 1) p + 1), at least
     the warm-up's and at most as many of its larger chunk's;
   - the bubble measured from the trace within 0.05 of (p-1)/(m+p-1), for
     GPipe and 1F1B, m = 1, 2, 4 and 8, and of (p-1)/(3m+p-1) for ZB-H1
     (F, B and W one unit each), m = p .. 8, and of (p-1)/(vm+p-1) for
     interleaved 1F1B with v = 2, m = p .. 8, on 2 and 4 CPU devices whose
     equal stages sleep a fixed time (the median of 3 steps; on a busy
     machine, tried again with longer sleeps, which the threads' late
     wake-ups then weigh less against);
   - data parallelism over 2 pipelines of 2 stages equals one device;
   - bad settings and schedules are refused by name, B and W passes'
     too.
   tests/gpu_pipeline.c includes this file with TEST_ON_GPU 1: the same
   tests on GPU devices, but the bubble's (its layers sleep on the CPU)
   and the refusals' (a forked child cannot use a GPU). */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"
#include "test.h"

#define TOLERANCE 1e-5

/* Random images [n, 1, 8, 8] and labels on the host. */
static void batch(uint64_t seed, int n, mgpu_tensor **x, mgpu_tensor **y) {
    mgpu_manual_seed(seed);
    *x = mgpu_rand(mgpu_cpu(), mgpu_shape4(n, 1, 8, 8));
    float labels[256];
    for (int i = 0; i < n; i++) labels[i] = (float)((i * 7 + (int)seed) % 10);
    *y = mgpu_from_host(mgpu_cpu(), mgpu_shape1(n), labels);
}

/* Largest difference between the pipeline's gradients (or with buffers,
   its batch norm buffers) and the reference network's, relative to each
   tensor's largest value. */
static double pipeline_diff(mgpu_pipeline *pp, const mgpu_net *ref, int buffers) {
    double worst = 0;
    int offset = 0;
    for (int s = 0; s < mgpu_pipeline_num_stages(pp); s++) {
        mgpu_net *stage = mgpu_pipeline_stage(pp, s);
        int n = buffers ? stage->nbuffers : stage->nparams;
        for (int i = 0; i < n; i++)
            worst = fmax(worst, buffers ? test_relative_diff(*stage->buffers[i], *ref->buffers[offset + i])
                                        : test_relative_diff(stage->params[i]->grad, ref->params[offset + i]->grad));
        offset += n;
    }
    return worst;
}

/* The reference: one device runs the micro-batches in turn, adding up
   their gradients, each micro-batch's loss scaled by 1/N. With m = 1 it
   is the whole batch at once. */
static void reference_grads(mgpu_net *ref, const mgpu_tensor *x, const mgpu_tensor *y, int m) {
    int n = x->shape.d[0];
    mgpu_net_zero_grad(ref);
    for (int j = 0; j < m; j++) {
        int count = n / m + (j < n % m), first = j * (n / m) + (j < n % m ? j : n % m);
        mgpu_tensor *xv = mgpu_narrow(x, first, count), *yv = mgpu_narrow(y, first, count);
        mgpu_tensor *xd = mgpu_to(xv, ref->device, 0), *yd = mgpu_to(yv, ref->device, 0);
        mgpu_net_loss_backward(ref, mgpu_net_forward(ref, xd), yd, 1.0f / (float)n, NULL);
        mgpu_synchronize_all();
        mgpu_free(xv), mgpu_free(yv), mgpu_free(xd), mgpu_free(yd);
    }
}

/* Checks one schedule on `stages` devices: the pipeline's gradients
   against one device's for a batch of n rows in m micro-batches. */
static double schedule_diff(mgpu_schedule_fn schedule, int stages, int m, int n, int with_batchnorm) {
    mgpu_device *devs[4];
    mgpu_devices(stages, TEST_ON_GPU, devs);
    mgpu_net *net = test_plain_net(test_device(), 3, with_batchnorm);
    mgpu_net *ref = test_plain_net(test_device(), 3, with_batchnorm);
    mgpu_pipeline *pp = mgpu_pipeline_new(net, devs, stages, NULL);
    mgpu_pipeline_set_schedule(pp, schedule, m);
    mgpu_tensor *x, *y;
    batch(11, n, &x, &y);
    mgpu_pipeline_forward_backward(pp, x, y, NULL);
    mgpu_synchronize_all();
    /* without batch norm, the whole batch at once; with it, in turn */
    reference_grads(ref, x, y, with_batchnorm ? m : 1);
    double diff = pipeline_diff(pp, ref, 0);
    if (with_batchnorm) diff = fmax(diff, pipeline_diff(pp, ref, 1));
    mgpu_pipeline_free(pp);
    mgpu_free(x), mgpu_free(y);
    mgpu_net_free(net), mgpu_net_free(ref);
    return diff;
}

static mgpu_schedule_fn schedules[3] = {mgpu_schedule_gpipe, mgpu_schedule_1f1b, mgpu_schedule_zb_h1};
static const char *schedule_names[3] = {"GPipe", "1F1B", "ZB-H1"};

TEST(every_schedule_gives_one_devices_gradients) {
    int micro[4] = {1, 2, 4, 3}; /* (3 does not divide 12: micro-batches of 4, 4, 4; and of 5, 5, 4 for 14) */
    for (int k = 0; k < 3; k++)
        for (int stages = 2; stages <= 3; stages++)
            for (int i = 0; i < 4; i++) {
                double diff = schedule_diff(schedules[k], stages, micro[i], i == 3 ? 14 : 12, 0);
                if (diff > TOLERANCE)
                    printf("  %s, %d stages, m = %d: gradients %.3g off\n", schedule_names[k], stages, micro[i],
                           diff);
                CHECK(diff <= TOLERANCE);
            }
}

TEST(batch_norm_uses_each_micro_batchs_statistics) {
    for (int k = 0; k < 3; k++) {
        double diff = schedule_diff(schedules[k], 2, 3, 12, 1);
        CHECK(diff <= TOLERANCE);
    }
    /* and that is not the whole batch's: one device on all 12 rows differs */
    mgpu_device *devs[2];
    mgpu_devices(2, TEST_ON_GPU, devs);
    mgpu_net *net = test_plain_net(test_device(), 3, 1), *ref = test_plain_net(test_device(), 3, 1);
    mgpu_pipeline *pp = mgpu_pipeline_new(net, devs, 2, NULL);
    mgpu_pipeline_set_schedule(pp, mgpu_schedule_gpipe, 3);
    mgpu_tensor *x, *y;
    batch(11, 12, &x, &y);
    mgpu_pipeline_forward_backward(pp, x, y, NULL);
    reference_grads(ref, x, y, 1);
    CHECK(pipeline_diff(pp, ref, 0) > 1e-3);
    mgpu_pipeline_free(pp);
    mgpu_free(x), mgpu_free(y);
    mgpu_net_free(net), mgpu_net_free(ref);
}

/* Interleaved 1F1B, `chunks` stages on each of `devices` devices: the
   pipeline's gradients against one device's for a batch of n rows in m
   micro-batches. */
static double interleaved_diff(int devices, int chunks, int m, int n) {
    mgpu_device *devs[4];
    mgpu_devices(devices, TEST_ON_GPU, devs);
    mgpu_net *net = test_plain_net(test_device(), 3, 0), *ref = test_plain_net(test_device(), 3, 0);
    mgpu_pipeline *pp = mgpu_pipeline_new_interleaved(net, devs, devices, chunks, NULL);
    mgpu_pipeline_set_interleaved_schedule(pp, mgpu_schedule_interleaved_1f1b, m);
    mgpu_tensor *x, *y;
    batch(11, n, &x, &y);
    mgpu_pipeline_forward_backward(pp, x, y, NULL);
    mgpu_synchronize_all();
    reference_grads(ref, x, y, 1);
    double diff = pipeline_diff(pp, ref, 0);
    mgpu_pipeline_free(pp);
    mgpu_free(x), mgpu_free(y);
    mgpu_net_free(net), mgpu_net_free(ref);
    return diff;
}

TEST(interleaved_gives_one_devices_gradients) {
    /* 4 stages on 2 devices, m = 2 and 4; 6 stages on 3, m = 3 (of 5, 5
       and 4 rows) */
    int devices[3] = {2, 2, 3}, micro[3] = {2, 4, 3}, rows[3] = {12, 12, 14};
    for (int i = 0; i < 3; i++) {
        double diff = interleaved_diff(devices[i], 2, micro[i], rows[i]);
        if (diff > TOLERANCE)
            printf("  interleaved, %d devices, m = %d: gradients %.3g off\n", devices[i], micro[i], diff);
        CHECK(diff <= TOLERANCE);
    }
}

#if !TEST_ON_GPU /* (its loops are its own: CPU devices) */
/* A layer of one's own, y = w x with w one learnt value, whose backward
   splits (l->split_backward): dx = w dy, dw = sum dy x, each computed
   from what it is given alone. It counts the calls that gave both, which
   a split pass must not. */
static int scale_whole_calls;
static void scale_forward(mgpu_layer *l, mgpu_tensor *y, const mgpu_tensor *x, int training) {
    (void)training;
    for (size_t i = 0; i < x->numel; i++) y->data[i] = l->weight.value->data[0] * x->data[i];
}
static void scale_backward(mgpu_layer *l, mgpu_tensor *dx, mgpu_tensor *dweight, mgpu_tensor *dbias,
                           const mgpu_tensor *dy, const mgpu_tensor *x, const mgpu_tensor *y) {
    (void)dbias, (void)y;
    scale_whole_calls += dx && dweight;
    for (size_t i = 0; dx && i < dy->numel; i++) dx->data[i] = l->weight.value->data[0] * dy->data[i];
    double sum = 0;
    for (size_t i = 0; dweight && i < dy->numel; i++) sum += (double)dy->data[i] * x->data[i];
    if (dweight) dweight->data[0] = (float)sum;
}
static const mgpu_layer_fns scale_layer = {"scale", NULL, scale_forward, scale_backward, 1};

/* A convolution, ReLU, the scale, pooling, a convolution, ReLU, global
   pooling, linear. */
static mgpu_net *net_with_scale(void) {
    mgpu_manual_seed(5);
    mgpu_net *net = mgpu_net_new(mgpu_cpu());
    mgpu_net_add_conv(net, 1, 6, 3, 1, 1);
    mgpu_net_add_relu(net);
    mgpu_tensor *w = mgpu_zeros(mgpu_cpu(), mgpu_shape1(1));
    mgpu_fill(w, 1.5f);
    mgpu_net_add_layer(net, &scale_layer, w, NULL, NULL)->split_backward = 1;
    mgpu_net_add_avg_pool(net, 2);
    mgpu_net_add_conv(net, 6, 8, 3, 2, 1);
    mgpu_net_add_relu(net);
    mgpu_net_add_global_avg_pool(net);
    mgpu_net_add_linear(net, 8, 10);
    return net;
}

TEST(zero_bubble_splits_a_layer_of_ones_own) {
    mgpu_device *devs[2];
    mgpu_devices(2, 0, devs);
    mgpu_net *net = net_with_scale(), *ref = net_with_scale();
    int cut[2] = {0, 2}; /* (the scale starts stage 1: it computes its input's gradient, to send back) */
    mgpu_pipeline *pp = mgpu_pipeline_new(net, devs, 2, cut);
    mgpu_pipeline_set_schedule(pp, mgpu_schedule_zb_h1, 4);
    mgpu_tensor *x, *y;
    batch(13, 12, &x, &y);
    scale_whole_calls = 0;
    mgpu_pipeline_forward_backward(pp, x, y, NULL);
    mgpu_synchronize_all();
    CHECK_EQ_INT(scale_whole_calls, 0);
    reference_grads(ref, x, y, 1);
    double diff = pipeline_diff(pp, ref, 0);
    if (diff > TOLERANCE) printf("  gradients %.3g off\n", diff);
    CHECK(diff <= TOLERANCE);
    CHECK(scale_whole_calls > 0); /* (one device's whole passes give both) */
    mgpu_pipeline_free(pp);
    mgpu_free(x), mgpu_free(y);
    mgpu_net_free(net), mgpu_net_free(ref);
}
#endif

/* Two convolutions, each with batch norm and ReLU, pooling, linear: cut
   at the second convolution, the second stage's buffers come after the
   first stage's. */
static mgpu_net *two_norms(mgpu_device *d) {
    mgpu_manual_seed(9);
    mgpu_net *net = mgpu_net_new(d);
    for (int i = 0; i < 2; i++) {
        mgpu_net_add_conv(net, i == 0 ? 1 : 4, 4, 3, 1, 1);
        mgpu_net_add_batchnorm(net, 4);
        mgpu_net_add_relu(net); /* (joins the batch norm: one layer) */
    }
    mgpu_net_add_global_avg_pool(net);
    mgpu_net_add_linear(net, 4, 10);
    return net;
}

static void train_two_norms_like_micro_batches_in_turn(mgpu_schedule_fn schedule) {
    mgpu_device *devs[2];
    mgpu_devices(2, TEST_ON_GPU, devs);
    mgpu_net *net = two_norms(test_device()), *ref = two_norms(test_device());
    int cut[2] = {0, 2};
    mgpu_pipeline *pp = mgpu_pipeline_new(net, devs, 2, cut);
    mgpu_pipeline_set_schedule(pp, schedule, 3);
    for (int step = 0; step < 3; step++) {
        mgpu_tensor *x, *y;
        batch(50 + (uint64_t)step, 12, &x, &y);
        mgpu_pipeline_train_step(pp, x, y, 0.1f, 0.9f, 0.0f, NULL);
        reference_grads(ref, x, y, 3);
        mgpu_net_step(ref, 0.1f, 0.9f, 0.0f);
        mgpu_synchronize_all();
        mgpu_free(x), mgpu_free(y);
    }
    mgpu_pipeline_free(pp); /* (the stages' values and buffers back in net) */
    CHECK(test_max_diff(net, ref, 0) <= TOLERANCE);
    CHECK(test_max_diff(net, ref, 1) <= TOLERANCE);
    mgpu_net_free(net), mgpu_net_free(ref);
}

TEST(batch_norm_in_two_stages_trains_like_micro_batches_in_turn) {
    /* (under ZB-H1 the convolutions' weight gradients come in W, batch
       norm's in B, and the convolution's bias, which batch norm cancels,
       is written 0 in B) */
    for (int k = 1; k < 3; k++) train_two_norms_like_micro_batches_in_turn(schedules[k]);
}

TEST(steps_train_like_one_device_and_free_gives_the_state_back) {
    mgpu_device *devs[3];
    mgpu_devices(3, TEST_ON_GPU, devs);
    mgpu_net *net = test_plain_net(test_device(), 4, 0), *ref = test_plain_net(test_device(), 4, 0);
    int first[3] = {0, 2, 5};
    mgpu_pipeline *pp = mgpu_pipeline_new(net, devs, 3, first);
    mgpu_pipeline_set_schedule(pp, mgpu_schedule_1f1b, 4);
    mgpu_tensor *loss = mgpu_zeros(devs[2], mgpu_shape1(1)), *ref_loss = mgpu_zeros(test_device(), mgpu_shape1(1));
    for (int step = 0; step < 5; step++) {
        mgpu_tensor *x, *y;
        batch(20 + (uint64_t)step, 16, &x, &y);
        mgpu_pipeline_train_step(pp, x, y, 0.1f, 0.9f, 1e-4f, loss);
        mgpu_tensor *xd = mgpu_to(x, ref->device, 0), *yd = mgpu_to(y, ref->device, 0);
        mgpu_net_train_step(ref, xd, yd, 0.1f, 0.9f, 1e-4f, ref_loss);
        mgpu_free(xd), mgpu_free(yd);
        mgpu_synchronize_all();
        mgpu_free(x), mgpu_free(y);
    }
    CHECK_CLOSE(mgpu_item(loss, 0), mgpu_item(ref_loss, 0), 0, TOLERANCE);
    mgpu_pipeline_free(pp);
    CHECK(test_max_param_diff(net, ref) <= TOLERANCE);
    CHECK_EQ_INT(net->steps, 5);
    for (int i = 0; i < net->nparams; i++) CHECK(test_relative_diff(net->momentum[i], ref->momentum[i]) <= TOLERANCE);
    /* the network is its own again: it trains alone */
    mgpu_tensor *x, *y;
    batch(30, 8, &x, &y);
    mgpu_tensor *xd = mgpu_to(x, net->device, 0), *yd = mgpu_to(y, net->device, 0);
    mgpu_net_train_step(net, xd, yd, 0.1f, 0.9f, 0.0f, NULL);
    mgpu_free(xd), mgpu_free(yd);
    mgpu_free(x), mgpu_free(y), mgpu_free(loss), mgpu_free(ref_loss);
    mgpu_net_free(net), mgpu_net_free(ref);
}

/* `layers` linear layers of `width` features with ReLUs between them. */
static mgpu_net *equal_layers(int width, int layers) {
    mgpu_manual_seed(7);
    mgpu_net *net = mgpu_net_new(test_device());
    for (int i = 0; i < layers; i++) {
        mgpu_net_add_linear(net, width, i + 1 < layers ? width : 10);
        if (i + 1 < layers) mgpu_net_add_relu(net);
    }
    return net;
}

/* Stage s's peak activation bytes over one step of the schedule. */
static void activation_peaks(mgpu_pipeline *pp, mgpu_device **devs, int stages, int rows, size_t *peak) {
    mgpu_tensor *x = mgpu_rand(mgpu_cpu(), mgpu_shape2(rows, 64)), *y = mgpu_zeros(mgpu_cpu(), mgpu_shape1(rows));
    mgpu_pipeline_forward_backward(pp, x, y, NULL); /* (the first step makes the scratch that stays) */
    mgpu_synchronize_all();
    for (int s = 0; s < stages; s++) mgpu_device_reset_peak(devs[s]);
    mgpu_pipeline_forward_backward(pp, x, y, NULL);
    mgpu_synchronize_all();
    for (int s = 0; s < stages; s++) peak[s] = mgpu_device_memory_peak_of(devs[s], MGPU_MEMORY_ACTIVATIONS);
    mgpu_free(x), mgpu_free(y);
}

TEST(gpipe_1f1b_and_zb_h1_hold_their_micro_batches_activations) {
    enum { STAGES = 4, M = 8, ROWS = 8 };
    mgpu_device *devs[STAGES];
    mgpu_devices(STAGES, TEST_ON_GPU, devs);
    mgpu_net *net = equal_layers(64, 8);
    mgpu_pipeline *pp = mgpu_pipeline_new(net, devs, STAGES, NULL);
    size_t one[STAGES], gpipe[STAGES], f1b1[STAGES], zb[STAGES];
    int zb_slots[STAGES];
    activation_peaks(pp, devs, STAGES, ROWS, one); /* one micro-batch of 8 rows */
    mgpu_pipeline_set_schedule(pp, mgpu_schedule_gpipe, M);
    activation_peaks(pp, devs, STAGES, M * ROWS, gpipe);
    mgpu_pipeline_set_schedule(pp, mgpu_schedule_zb_h1, M);
    activation_peaks(pp, devs, STAGES, M * ROWS, zb);
    for (int s = 0; s < STAGES; s++) zb_slots[s] = mgpu_pipeline_slots(pp, s);
    mgpu_pipeline_set_schedule(pp, mgpu_schedule_1f1b, M);
    activation_peaks(pp, devs, STAGES, M * ROWS, f1b1);
    for (int s = 0; s < STAGES; s++) {
        size_t bound = (size_t)(STAGES - s) * one[s];
        CHECK_EQ_INT(mgpu_pipeline_slots(pp, s), STAGES - s);
        CHECK(one[s] > 0);
        CHECK(f1b1[s] == bound); /* within the bound, which the warm-up fills exactly */
        CHECK(gpipe[s] == (size_t)M * one[s]);
        /* ZB-H1: stage s holds p - s micro-batches between F and B (1F1B's)
           and s between B and W, each with all its activations: p, 1F1B's
           peak on stage 0, on every stage */
        CHECK_EQ_INT(zb_slots[s], STAGES);
        CHECK(zb[s] == (size_t)STAGES * one[s]);
    }
    mgpu_pipeline_free(pp);
    mgpu_net_free(net);
}

TEST(interleaved_holds_at_most_its_warm_up_and_one) {
    enum { DEVICES = 2, CHUNKS = 2, STAGES = DEVICES * CHUNKS, M = 8, ROWS = 8 };
    mgpu_device *devs[STAGES];
    mgpu_devices(STAGES, TEST_ON_GPU, devs);
    /* one micro-batch's activations on each stage: the same cut, a stage a device */
    mgpu_net *net = equal_layers(64, 16);
    mgpu_pipeline *pp = mgpu_pipeline_new(net, devs, STAGES, NULL);
    size_t one[STAGES], peak[DEVICES];
    activation_peaks(pp, devs, STAGES, ROWS, one);
    mgpu_pipeline_free(pp);
    pp = mgpu_pipeline_new_interleaved(net, devs, DEVICES, CHUNKS, NULL);
    mgpu_pipeline_set_interleaved_schedule(pp, mgpu_schedule_interleaved_1f1b, M);
    activation_peaks(pp, devs, DEVICES, M * ROWS, peak);
    for (int d = 0; d < DEVICES; d++) {
        /* Megatron's warm-up, 2 (p - d - 1) + (v - 1) p forward passes, the
           k-th of chunk (k / p) mod v, then one more before the first
           backward pass frees one: the most chunks' micro-batches in
           flight, each at most the larger chunk's; and the warm-up's are
           all there at once */
        int in_flight = 2 * (DEVICES - d - 1) + (CHUNKS - 1) * DEVICES + 1;
        size_t warm_up = 0, largest = 0;
        for (int k = 0; k < in_flight; k++) warm_up += one[k / DEVICES % CHUNKS * DEVICES + d];
        for (int c = 0; c < CHUNKS; c++) largest = one[c * DEVICES + d] > largest ? one[c * DEVICES + d] : largest;
        if (peak[d] < warm_up || peak[d] > (size_t)in_flight * largest)
            printf("  device %d: peak %zu bytes; want %zu to %d x %zu\n", d, peak[d], warm_up, in_flight, largest);
        CHECK(peak[d] >= warm_up);
        CHECK(peak[d] <= (size_t)in_flight * largest);
    }
    mgpu_pipeline_free(pp);
    mgpu_net_free(net);
}

#if !TEST_ON_GPU
/* Equal stages of tests/test.h's timed layers, 5 ms forward, and 5 ms
   for each of B and W (longer on a retry, below), so that waking the
   queues' threads takes a small part of each. */
static double timed_ms = 5.0;

/* The bubble of `schedule` with m micro-batches measured on pp, against
   `want`: the median of 3 steps, and up to 3 tries of that, with longer
   layers each time: on a machine busy with other work the queues'
   threads wake late, by a time that the layers' own then outweigh (the
   bubble is a ratio of times, the same at any layer duration). Returns
   the mean bubble, and in *worst_stage the worst stage's distance from
   want. */
static double measured_bubble(mgpu_pipeline *pp, int stages, double want, double *worst_stage) {
    mgpu_tensor *x = mgpu_rand(mgpu_cpu(), mgpu_shape2(64, 10)), *y = mgpu_zeros(mgpu_cpu(), mgpu_shape1(64));
    mgpu_pipeline_forward_backward(pp, x, y, NULL); /* (warm) */
    static const double tries_ms[3] = {5.0, 25.0, 100.0};
    double got = 0;
    for (int attempt = 0; attempt < 3; attempt++) {
        double bubble[3], stage_bubble[4][3];
        timed_ms = tries_ms[attempt];
        for (int r = 0; r < 3; r++) {
            mgpu_trace_begin();
            mgpu_pipeline_forward_backward(pp, x, y, NULL);
            mgpu_trace_end();
            mgpu_pipeline_timing t = mgpu_pipeline_measure(pp);
            bubble[r] = t.bubble_mean;
            for (int s = 0; s < stages; s++) stage_bubble[s][r] = t.bubble[s];
        }
        got = mgpu_median(bubble, 3), *worst_stage = 0;
        for (int s = 0; s < stages; s++)
            *worst_stage = fmax(*worst_stage, fabs(mgpu_median(stage_bubble[s], 3) - want));
        if (fabs(got - want) <= 0.05 && *worst_stage <= 0.05) break;
    }
    timed_ms = tries_ms[0];
    mgpu_free(x), mgpu_free(y);
    return got;
}

TEST(measured_bubble_is_the_formulas) {
    mgpu_device *devs[4];
    mgpu_devices(4, 0, devs);
    int micro[4] = {1, 2, 4, 8};
    for (int stages = 2; stages <= 4; stages += 2) {
        int first[8];
        mgpu_net *net = test_timed_net(stages, &timed_ms, first);
        mgpu_pipeline *pp = mgpu_pipeline_new(net, devs, stages, first);
        for (int k = 0; k < 3; k++)
            for (int i = 0; i < 4; i++) {
                int zero_bubble = schedules[k] == mgpu_schedule_zb_h1;
                if (zero_bubble && micro[i] < stages) continue; /* (its formula wants m >= p) */
                mgpu_pipeline_set_schedule(pp, schedules[k], micro[i]);
                double want = zero_bubble ? mgpu_pipeline_zb_h1_bubble_formula(stages, micro[i])
                                          : mgpu_pipeline_bubble_formula(stages, micro[i]);
                double worst_stage, got = measured_bubble(pp, stages, want, &worst_stage);
                if (fabs(got - want) > 0.05 || worst_stage > 0.05)
                    printf("  %s, %d stages, m = %d: bubble %.3f (a stage's off by %.3f), formula %.3f\n",
                           schedule_names[k], stages, micro[i], got, worst_stage, want);
                CHECK_CLOSE(got, want, 0.05, 0);
                CHECK(worst_stage <= 0.05);
                if (stages == 2 && micro[i] == 8 && k > 0) {
                    const char *path = "/tmp/mgpu_test_pipeline_timeline.png";
                    CHECK_EQ_INT(mgpu_pipeline_write_timeline(pp, path, schedule_names[k]), 0);
                    FILE *f = fopen(path, "rb");
                    CHECK(f != NULL);
                    if (f) fclose(f);
                    remove(path);
                }
            }
        mgpu_pipeline_free(pp);
        mgpu_net_free(net);
        /* interleaved 1F1B, 2 chunks a device: equal stages, twice as many */
        net = test_timed_net(2 * stages, &timed_ms, first);
        pp = mgpu_pipeline_new_interleaved(net, devs, stages, 2, first);
        for (int m = stages; m <= 8; m *= 2) {
            mgpu_pipeline_set_interleaved_schedule(pp, mgpu_schedule_interleaved_1f1b, m);
            double want = mgpu_pipeline_interleaved_bubble_formula(stages, 2, m);
            double worst_stage, got = measured_bubble(pp, stages, want, &worst_stage);
            if (fabs(got - want) > 0.05 || worst_stage > 0.05)
                printf("  interleaved, %d devices, m = %d: bubble %.3f (a device's off by %.3f), formula %.3f\n",
                       stages, m, got, worst_stage, want);
            CHECK_CLOSE(got, want, 0.05, 0);
            CHECK(worst_stage <= 0.05);
        }
        const char *path = "/tmp/mgpu_test_pipeline_interleaved.png";
        CHECK_EQ_INT(mgpu_pipeline_write_timeline(pp, path, "interleaved 1F1B"), 0);
        FILE *f = fopen(path, "rb");
        CHECK(f != NULL);
        if (f) fclose(f);
        remove(path);
        mgpu_pipeline_free(pp);
        mgpu_net_free(net);
    }
}

#endif

TEST(data_parallel_pipelines_equal_one_device) {
    mgpu_device *devs[4];
    mgpu_devices(4, TEST_ON_GPU, devs);
    mgpu_net *a = test_plain_net(test_device(), 6, 0), *b = test_plain_net(test_device(), 6, 0);
    mgpu_net *ref = test_plain_net(test_device(), 6, 0);
    mgpu_pipeline *pipes[2] = {mgpu_pipeline_new(a, devs, 2, NULL), mgpu_pipeline_new(b, devs + 2, 2, NULL)};
    for (int k = 0; k < 2; k++) mgpu_pipeline_set_schedule(pipes[k], mgpu_schedule_1f1b, 2);
    for (int step = 0; step < 3; step++) {
        mgpu_tensor *x, *y;
        batch(40 + (uint64_t)step, 16, &x, &y);
        for (int k = 0; k < 2; k++) {
            mgpu_tensor *xk = mgpu_narrow(x, 8 * k, 8), *yk = mgpu_narrow(y, 8 * k, 8);
            mgpu_pipeline_forward_backward(pipes[k], xk, yk, NULL);
            mgpu_free(xk), mgpu_free(yk);
        }
        mgpu_pipelines_average_grads(pipes, 2);
        for (int k = 0; k < 2; k++) mgpu_pipeline_step(pipes[k], 0.1f, 0.0f, 0.0f);
        mgpu_tensor *xd = mgpu_to(x, ref->device, 0), *yd = mgpu_to(y, ref->device, 0);
        mgpu_net_train_step(ref, xd, yd, 0.1f, 0.0f, 0.0f, NULL);
        mgpu_free(xd), mgpu_free(yd);
        mgpu_synchronize_all();
        mgpu_free(x), mgpu_free(y);
    }
    for (int k = 0; k < 2; k++) mgpu_pipeline_free(pipes[k]);
    CHECK(test_max_param_diff(a, ref) <= TOLERANCE);
    CHECK(test_max_param_diff(b, ref) <= TOLERANCE);
    mgpu_net_free(a), mgpu_net_free(b), mgpu_net_free(ref);
}

#if !TEST_ON_GPU
/* A schedule that waits for itself: stage 0 wants B0 before F1, stage 1
   wants F1 before B0. */
static void deadlocked(int stage, int stages, int m, mgpu_pipeline_pass *order) {
    (void)stages, (void)m;
    int kinds[2][4] = {{0, 1, 0, 1}, {0, 0, 1, 1}}, micro[2][4] = {{0, 0, 1, 1}, {0, 1, 0, 1}};
    for (int i = 0; i < 4; i++) order[i].backward = kinds[stage][i], order[i].micro_batch = micro[stage][i];
}
static void forward_twice(int stage, int stages, int m, mgpu_pipeline_pass *order) {
    mgpu_schedule_gpipe(stage, stages, m, order);
    order[1] = order[0];
}
static void one_pass_short(int stage, int stages, int m, mgpu_pipeline_pass *order) {
    mgpu_schedule_gpipe(stage, stages, m - 1, order); /* (the last forward and backward unwritten) */
}
static void one_pass_long(int stage, int stages, int m, mgpu_pipeline_pass *order) {
    mgpu_schedule_gpipe(stage, stages, m, order);
    order[2 * m] = order[0];
}
static void backward_first(int stage, int stages, int m, mgpu_pipeline_pass *order) {
    mgpu_schedule_gpipe(stage, stages, m, order);
    mgpu_pipeline_pass first = order[0];
    order[0] = order[m], order[m] = first;
}

/* Split schedules gone wrong: ZB-H1 with W0 before B0 on every stage;
   with B0 whole; with W0 left out; a forward pass given a part. */
static void w_before_b(int stage, int stages, int m, mgpu_pipeline_pass *order) {
    mgpu_schedule_zb_h1(stage, stages, m, order);
    for (int i = 0; i < 3 * m; i++) /* (W0 takes the place of B0, and B0 of W0) */
        if (order[i].micro_batch == 0 && order[i].backward)
            order[i].part = order[i].part == MGPU_PASS_INPUT_GRAD ? MGPU_PASS_WEIGHT_GRAD : MGPU_PASS_INPUT_GRAD;
}
static void whole_among_split(int stage, int stages, int m, mgpu_pipeline_pass *order) {
    mgpu_schedule_zb_h1(stage, stages, m, order);
    for (int i = 0; i < 3 * m; i++)
        if (order[i].micro_batch == 0 && order[i].part == MGPU_PASS_INPUT_GRAD) order[i].part = MGPU_PASS_WHOLE;
}
static void w_left_out(int stage, int stages, int m, mgpu_pipeline_pass *order) {
    mgpu_schedule_zb_h1(stage, stages, m, order);
    order[3 * m - 1].backward = order[3 * m - 1].micro_batch = -1; /* (the last pass, a W, unwritten) */
}
static void forward_with_a_part(int stage, int stages, int m, mgpu_pipeline_pass *order) {
    mgpu_schedule_zb_h1(stage, stages, m, order);
    order[0].part = MGPU_PASS_WEIGHT_GRAD;
}

/* An interleaved schedule with a pass of chunk 2 of 2. */
static void chunk_beyond(int device, int devices, int chunks, int m, mgpu_pipeline_pass *order) {
    mgpu_schedule_interleaved_1f1b(device, devices, chunks, m, order);
    order[0].chunk = chunks;
}

TEST(bad_settings_are_refused_by_name) {
    mgpu_device *devs[4];
    mgpu_devices(4, 0, devs);
    mgpu_net *net = test_plain_net(mgpu_cpu(), 3, 0); /* 7 layers */
    int beyond[2] = {0, 7}, backwards[3] = {0, 4, 2}, late[2] = {1, 3};
    mgpu_device *twice[2] = {devs[1], devs[1]};
    EXPECT_DIES(mgpu_pipeline_new(net, devs, 8, NULL), "8 stages for a network of 7 layers");
    EXPECT_DIES(mgpu_pipeline_new(net, devs, 2, beyond), "stage 1 starts at layer 7, which does not exist");
    EXPECT_DIES(mgpu_pipeline_new(net, devs, 3, backwards), "stage 2 starts at layer 2, not after stage 1's");
    EXPECT_DIES(mgpu_pipeline_new(net, devs, 2, late), "stage 0 starts at layer 1");
    EXPECT_DIES(mgpu_pipeline_new(net, twice, 2, NULL), "cpu#1 is devices[0] and devices[1]");
    mgpu_pipeline *pp = mgpu_pipeline_new(net, devs, 2, NULL);
    EXPECT_DIES(mgpu_pipeline_set_schedule(pp, mgpu_schedule_1f1b, 0), "0 micro-batches");
    EXPECT_DIES(mgpu_pipeline_set_schedule(pp, deadlocked, 2),
                "the schedule waits for itself (stage 0 at B0, stage 1 at F1");
    EXPECT_DIES(mgpu_pipeline_set_schedule(pp, forward_twice, 2), "the schedule runs F0 twice on stage 0");
    EXPECT_DIES(mgpu_pipeline_set_schedule(pp, backward_first, 2), "runs B0 on stage 0 before that micro-batch's");
    EXPECT_DIES(mgpu_pipeline_set_schedule(pp, one_pass_short, 2), "left pass 2 of stage 0 unwritten");
    EXPECT_DIES(mgpu_pipeline_set_schedule(pp, one_pass_long, 2), "wrote past stage 0's 2m = 4 passes");
    EXPECT_DIES(mgpu_pipeline_set_schedule(pp, w_before_b, 2), "the schedule runs W0 on stage 0 before its B0");
    EXPECT_DIES(mgpu_pipeline_set_schedule(pp, whole_among_split, 2),
                "runs B0 whole on stage 0 but splits other backward passes into B and W");
    EXPECT_DIES(mgpu_pipeline_set_schedule(pp, w_left_out, 2),
                "left pass 5 of stage 0 unwritten; it must write 3m = 6 passes (each backward pass split");
    EXPECT_DIES(mgpu_pipeline_set_schedule(pp, forward_with_a_part, 2), "pass 0 of stage 0 has part 2; want");
    EXPECT_DIES(mgpu_pipeline_zb_h1_bubble_formula(4, 3), "3 micro-batches on 4 stages; the formula holds");
    {
        mgpu_net *chunked = test_plain_net(mgpu_cpu(), 3, 0);
        mgpu_pipeline *il = mgpu_pipeline_new_interleaved(chunked, devs, 2, 2, NULL);
        EXPECT_DIES(mgpu_pipeline_set_interleaved_schedule(il, mgpu_schedule_interleaved_1f1b, 3),
                    "mgpu_schedule_interleaved_1f1b: 3 micro-batches on 2 devices; Megatron's interleaved schedule "
                    "takes a multiple of the devices");
        EXPECT_DIES(mgpu_pipeline_set_schedule(il, mgpu_schedule_1f1b, 2),
                    "the pipeline has 2 chunks a device; it takes an interleaved schedule");
        EXPECT_DIES(mgpu_pipeline_set_interleaved_schedule(il, chunk_beyond, 2),
                    "pass 0 of device 0 is for chunk 2; there are 2 (0 to 1)");
        mgpu_pipeline_free(il);
        mgpu_net_free(chunked);
        EXPECT_DIES(mgpu_pipeline_new_interleaved(net, devs, 2, 4, NULL), "8 stages for a network of 7 layers");
    }
    EXPECT_DIES(mgpu_pipeline_new(net, devs, 2, NULL), "a wrapper holds this network already");
    EXPECT_DIES(mgpu_net_free(net), "mgpu_net_free: a pipeline still holds this network; free it first "
                                    "(mgpu_pipeline_free)");
    EXPECT_DIES(mgpu_net_add_relu(net), "the network is held by a pipeline, which copied its layers; add layers "
                                        "before mgpu_pipeline_new");
    EXPECT_DIES(mgpu_net_free(mgpu_pipeline_stage(pp, 1)), "a pipeline still holds this network");
    mgpu_device *none[2] = {devs[0], NULL};
    mgpu_net *other = test_plain_net(mgpu_cpu(), 3, 0);
    EXPECT_DIES(mgpu_pipeline_new(other, none, 2, NULL), "mgpu_pipeline_new: devices[1] is NULL");
    mgpu_pipeline *a = mgpu_pipeline_new(other, devs + 2, 2, NULL);
    int late_cut[2] = {0, 5};
    mgpu_net *third = test_plain_net(mgpu_cpu(), 3, 0);
    mgpu_pipeline *b = mgpu_pipeline_new(third, devs + 2, 2, late_cut), *mismatched[2] = {a, b};
    EXPECT_DIES(mgpu_pipelines_average_grads(mismatched, 2), "pipeline 1's stage 1 starts at layer 5, pipeline 0's at 3");
    EXPECT_DIES(mgpu_pipeline_set_schedule(pp, mgpu_schedule_gpipe, 2049), "2049 micro-batches; want 1 to 2048");
    EXPECT_DIES(mgpu_pipeline_set_schedule(pp, mgpu_schedule_zb_h1, 2048),
                "2048 micro-batches make 6144 trace labels (F, B and W for each micro-batch); want at most 4096");
    mgpu_tensor *x, *y, *wrong = mgpu_zeros(devs[0], mgpu_shape1(1));
    batch(1, 3, &x, &y);
    EXPECT_DIES(mgpu_pipeline_forward_backward(pp, x, y, wrong), "loss_sum is on cpu, the network on cpu#1");
    mgpu_pipeline_set_schedule(pp, mgpu_schedule_gpipe, 4);
    EXPECT_DIES(mgpu_pipeline_forward_backward(pp, x, y, NULL), "a batch of 3 rows cannot make 4 micro-batches");
    mgpu_trace_begin();
    mgpu_trace_end();
    EXPECT_DIES(mgpu_pipeline_measure(pp), "the trace holds none of this pipeline's passes");
    mgpu_pipeline_free(pp), mgpu_pipeline_free(a), mgpu_pipeline_free(b);
    mgpu_free(x), mgpu_free(y), mgpu_free(wrong);
    mgpu_net_free(net), mgpu_net_free(other), mgpu_net_free(third);
}
#endif

TEST_MAIN()
