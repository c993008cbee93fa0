/* tests/assignments/schedules.h: what the checkers of the pipeline-
   schedule assignments share (check_pipeline.c, check_zero_bubble.c).
   The checker defines, before it includes this file,
       STUDENT_SCHEDULE   the student's schedule (an mgpu_schedule_fn)
       PASSES             the passes it writes a micro-batch: 2 (forward,
                          backward) or 3 (forward, B, W)
   and gets: whether the schedule is accepted, tried in a child process
   first (accepted); the tests schedule_is_accepted and
   gradients_are_one_devices, on 2, 3 and 4 CPU devices with 1, 2, 3, 4
   and 8 micro-batches; the tests' networks and batches; and each stage's
   peak activations over a step against the schedule's bound, which the
   checker defines too:
       ACTIVATION_BOUND(p, s, m)  the micro-batches stage s may hold
       BOUND_SAID                 that in words, for the failure's line
   (measure_in_flight). */
#include "tests/assignments/child.h"

#define TOLERANCE 1e-5
#define MIN_STAGES 2
#define MAX_STAGES 4
static const int micro[] = {1, 2, 3, 4, 8};
#define NMICRO (int)(sizeof micro / sizeof micro[0])
#define SAID 4 /* the wrong settings said in full, at most, by each test */

/* ---- is the schedule accepted? ----
   mgpu_pipeline_set_schedule checks a schedule (every pass once, each
   backward after its forward, no stage waiting for a pass that waits for
   it) and ends the program with a one-line error when it is wrong. So the
   checker tries it first in a child process, and reads the line: a wrong
   schedule fails the tests instead of stopping the checker. A schedule
   that crashes (writing past its PASSES m passes) or loops is caught too.
   Each setting is tried once; the answer is kept. */
static int tried[MAX_STAGES + 1][9]; /* [p][m]: 0 not yet, 1 accepted, -1 not (why_refused says why) */
static char why_refused[MAX_STAGES + 1][9][2112]; /* (room for the whole of a child's line) */

/* The child's part: the schedule alone first, into room for PASSES m
   passes and more, to see that it writes nothing past them (the
   library's order has no more); then the library's check. */
typedef struct { mgpu_pipeline *pp; int m; } schedule_trial;
static void try_schedule(void *arg) {
    const schedule_trial *t = (const schedule_trial *)arg;
    int p = mgpu_pipeline_num_stages(t->pp), m = t->m, n = PASSES * m;
    mgpu_pipeline_pass *order = (mgpu_pipeline_pass *)malloc((size_t)(n + 16) * sizeof *order);
    for (int s = 0; s < p; s++) {
        for (int i = 0; i < n + 16; i++) order[i].backward = order[i].micro_batch = -7;
        STUDENT_SCHEDULE(s, p, m, order);
        for (int i = n; i < n + 16; i++)
            if (order[i].backward != -7 || order[i].micro_batch != -7) {
                fprintf(stderr, "your schedule writes order[%d] on stage %d of %d, m = %d; it has %d m = %d "
                        "passes (order[0] to order[%d])\n", i, s, p, m, PASSES, n, n - 1);
                _exit(3);
            }
    }
    free(order);
    mgpu_pipeline_set_schedule(t->pp, STUDENT_SCHEDULE, m);
}
static void try_in_a_child(mgpu_pipeline *pp, int m) {
    int p = mgpu_pipeline_num_stages(pp);
    schedule_trial trial = {pp, m};
    char line[2048];
    int status = run_in_a_child(try_schedule, &trial, 10, line, sizeof line);
    char *why = why_refused[p][m];
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
        tried[p][m] = 1;
    else if (WIFEXITED(status) && WEXITSTATUS(status) == 3)
        snprintf(why, sizeof why_refused[0][0], "%s", line);
    else if (WIFEXITED(status))
        snprintf(why, sizeof why_refused[0][0], "the library refuses your schedule: %s",
                 line[0] ? line : "(it said nothing)");
    else if (WTERMSIG(status) == SIGALRM)
        snprintf(why, sizeof why_refused[0][0], "your schedule did not return within 10 s (a loop that never ends?)");
    else
        snprintf(why, sizeof why_refused[0][0],
                 "your schedule crashed (%s): does it write past order[%d m - 1], or read past its arguments?",
                 strsignal(WTERMSIG(status)), PASSES);
    if (!tried[p][m]) tried[p][m] = -1;
}
static int accepted(mgpu_pipeline *pp, int m) {
    int p = mgpu_pipeline_num_stages(pp);
    if (!tried[p][m]) try_in_a_child(pp, m);
    if (tried[p][m] > 0) mgpu_pipeline_set_schedule(pp, STUDENT_SCHEDULE, m);
    return tried[p][m] > 0;
}

/* Settings the later tests leave out, the schedule not accepted there:
   counted and said in one line (the first test says why). */
static void say_skipped(int skipped) {
    if (skipped)
        printf("  %d of the %d settings left out: your schedule is not accepted there (see "
               "schedule_is_accepted)\n",
               skipped, (MAX_STAGES - MIN_STAGES + 1) * NMICRO);
}

/* ---- the networks ---- */

/* A small network without batch norm: the tests' plain network
   (convolutions, ReLUs, pooling, a linear layer: 7 layers); without batch
   norm a pipeline's gradients are one device's on the whole batch, up to
   the order of the sums. */
static void batch(int n, mgpu_tensor **x, mgpu_tensor **y) {
    mgpu_manual_seed(11);
    *x = mgpu_rand(mgpu_cpu(), mgpu_shape4(n, 1, 8, 8));
    float labels[64];
    for (int i = 0; i < n; i++) labels[i] = (float)((i * 7 + 11) % 10);
    *y = mgpu_from_host(mgpu_cpu(), mgpu_shape1(n), labels);
}

/* `layers` linear layers of 64 features with ReLUs between them: stages
   of about equal activations, for the memory test. */
static mgpu_net *equal_layers(int layers) {
    mgpu_manual_seed(7);
    mgpu_net *net = mgpu_net_new(mgpu_cpu());
    for (int i = 0; i < layers; i++) {
        mgpu_net_add_linear(net, 64, i + 1 < layers ? 64 : 10);
        if (i + 1 < layers) mgpu_net_add_relu(net);
    }
    return net;
}

/* ---- the tests every schedule takes ---- */

/* Every setting's schedule accepted by mgpu_pipeline_set_schedule. */
TEST(schedule_is_accepted) {
    mgpu_device *devs[MAX_STAGES];
    mgpu_devices(MAX_STAGES, 0, devs);
    int refused = 0;
    for (int p = MIN_STAGES; p <= MAX_STAGES; p++) {
        mgpu_net *net = test_plain_net(mgpu_cpu(), 3, 0);
        mgpu_pipeline *pp = mgpu_pipeline_new(net, devs, p, NULL);
        for (int i = 0; i < NMICRO; i++)
            if (!accepted(pp, micro[i]) && refused++ < SAID)
                printf("  %d stages, m = %d: %s\n", p, micro[i], why_refused[p][micro[i]]);
        mgpu_pipeline_free(pp);
        mgpu_net_free(net);
    }
    if (refused > SAID) printf("  (and %d more settings not accepted)\n", refused - SAID);
    CHECK(refused == 0);
}

/* The pipeline's gradients are one device's on the same batch (16 rows:
   3 micro-batches of 6, 5 and 5), within 1e-5 of each tensor's largest
   value. Any order the library accepts gives them (every pass once, each
   backward after its forward): this checks the library under your order
   as much as your order. */
TEST(gradients_are_one_devices) {
    mgpu_device *devs[MAX_STAGES];
    mgpu_devices(MAX_STAGES, 0, devs);
    mgpu_tensor *x, *y;
    batch(16, &x, &y);
    mgpu_net *ref = test_plain_net(mgpu_cpu(), 3, 0);
    mgpu_net_zero_grad(ref);
    mgpu_net_loss_backward(ref, mgpu_net_forward(ref, x), y, 1.0f / 16, NULL);
    mgpu_synchronize_all();
    int skipped = 0, wrong = 0;
    for (int p = MIN_STAGES; p <= MAX_STAGES; p++) {
        mgpu_net *net = test_plain_net(mgpu_cpu(), 3, 0);
        mgpu_pipeline *pp = mgpu_pipeline_new(net, devs, p, NULL);
        for (int i = 0; i < NMICRO; i++) {
            int m = micro[i];
            if (!accepted(pp, m)) {
                skipped++;
                continue;
            }
            mgpu_pipeline_forward_backward(pp, x, y, NULL); /* (it writes the gradients) */
            mgpu_synchronize_all();
            double worst = 0;
            int worst_stage = 0, worst_param = 0;
            for (int s = 0, offset = 0; s < p; s++) {
                mgpu_net *stage = mgpu_pipeline_stage(pp, s);
                for (int k = 0; k < stage->nparams; k++) {
                    double diff = test_relative_diff(stage->params[k]->grad, ref->params[offset + k]->grad);
                    if (diff > worst) worst = diff, worst_stage = s, worst_param = k;
                }
                offset += stage->nparams;
            }
            if (!(worst <= TOLERANCE) && wrong++ < SAID)
                printf("  %d stages, m = %d: stage %d's gradient %d is %.3g off one device's (relative); want "
                       "within %g\n",
                       p, m, worst_stage, worst_param, worst, TOLERANCE);
        }
        mgpu_pipeline_free(pp);
        mgpu_net_free(net);
    }
    if (wrong > SAID) printf("  (and %d more settings off)\n", wrong - SAID);
    say_skipped(skipped);
    CHECK(wrong == 0);
    mgpu_free(x), mgpu_free(y);
    mgpu_net_free(ref);
}

/* Stage s's peak activation bytes over one step of `rows` rows (a step
   first: it makes the scratch that stays). */
static void activation_peaks(mgpu_pipeline *pp, mgpu_device **devs, int rows, size_t *peak) {
    int p = mgpu_pipeline_num_stages(pp);
    mgpu_tensor *x = mgpu_rand(mgpu_cpu(), mgpu_shape2(rows, 64)), *y = mgpu_zeros(mgpu_cpu(), mgpu_shape1(rows));
    mgpu_pipeline_forward_backward(pp, x, y, NULL);
    mgpu_synchronize_all();
    for (int s = 0; s < p; s++) mgpu_device_reset_peak(devs[s]);
    mgpu_pipeline_forward_backward(pp, x, y, NULL);
    mgpu_synchronize_all();
    for (int s = 0; s < p; s++) peak[s] = mgpu_device_memory_peak_of(devs[s], MGPU_MEMORY_ACTIVATIONS);
    mgpu_free(x), mgpu_free(y);
}

/* The activations each stage holds at its peak, in micro-batches of 8
   rows (its peak over one micro-batch's, measured alone), and the
   micro-batches its schedule has in flight at most (mgpu_pipeline_slots),
   for every setting, measured once for the checker's tests: the stages
   above the schedule's bound ACTIVATION_BOUND(p, s, m) micro-batches
   (BOUND_SAID says it in words), and those whose warm-up stops short of
   it, counted, the first few said. */
static struct {
    int measured, over, under, skipped;
    char over_said[SAID][256], under_said[SAID][256];
} flight;

static void measure_in_flight(void) {
    enum { ROWS = 8 };
    mgpu_device *devs[MAX_STAGES];
    mgpu_devices(MAX_STAGES, 0, devs);
    flight.measured = 1;
    for (int p = MIN_STAGES; p <= MAX_STAGES; p++) {
        mgpu_net *net = equal_layers(8);
        mgpu_pipeline *pp = mgpu_pipeline_new(net, devs, p, NULL);
        size_t one[MAX_STAGES], yours[MAX_STAGES];
        mgpu_pipeline_set_schedule(pp, mgpu_schedule_gpipe, 1);
        activation_peaks(pp, devs, ROWS, one); /* one micro-batch (any schedule runs F0 then B0) */
        for (int i = 0; i < NMICRO; i++) {
            int m = micro[i];
            if (!accepted(pp, m)) {
                flight.skipped++;
                continue;
            }
            activation_peaks(pp, devs, m * ROWS, yours);
            for (int s = 0; s < p; s++) {
                int bound = ACTIVATION_BOUND(p, s, m), slots = mgpu_pipeline_slots(pp, s);
                double held = (double)yours[s] / (double)one[s];
                if (yours[s] > (size_t)bound * one[s] && flight.over++ < SAID)
                    snprintf(flight.over_said[flight.over - 1], sizeof flight.over_said[0],
                             "%d stages, m = %d: stage %d held %.3g micro-batches' activations at its peak (%zu "
                             "bytes, one's %zu); %s = %d",
                             p, m, s, held, yours[s], one[s], BOUND_SAID, bound);
                if (slots < bound && flight.under++ < SAID)
                    snprintf(flight.under_said[flight.under - 1], sizeof flight.under_said[0],
                             "%d stages, m = %d: stage %d has at most %d micro-batch%s in flight, fewer than "
                             "the schedule's warm-up puts there (%d): it waits, and the bubble grows",
                             p, m, s, slots, slots == 1 ? "" : "es", bound);
            }
        }
        mgpu_pipeline_free(pp);
        mgpu_net_free(net);
    }
}
static void say(int count, char said[][256], const char *more) {
    for (int i = 0; i < count && i < SAID; i++) printf("  %s\n", said[i]);
    if (count > SAID) printf("  (and %d more %s)\n", count - SAID, more);
}

