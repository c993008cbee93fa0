/* tests/assignments/check_zero_bubble.c: the checker of the zero-bubble
   assignment (docs/assignments.md). Built with the student's file by
       make check-assignment NAME=zero_bubble FILE=student.c
   which must define
       void schedule_zb_h1(int stage, int stages, int micro_batches,
                           mgpu_pipeline_pass *order);
   ZB-H1's order of stage `stage`'s 3 m passes: each backward pass split
   into B (part MGPU_PASS_INPUT_GRAD) and W (MGPU_PASS_WEIGHT_GRAD). It
   runs on 2, 3 and 4 CPU devices with 1, 2, 3, 4 and 8 micro-batches;
   one device's gradients, ZB-H1's bubble (p - 1) / (3m + p - 1) on passes
   of equal times, and its bound of min(m, p) micro-batches' activations
   on every stage are the answer. */
#include "mgpu.h"
#include "tests/test.h"
#include STUDENT_FILE
#define STUDENT_SCHEDULE schedule_zb_h1
#define PASSES 3
#define ACTIVATION_BOUND(p, s, m) ((m) < (p) ? (m) : (p))
#define BOUND_SAID "ZB-H1 holds at most min(m, p), 1F1B's first stage's"
#include "tests/assignments/schedules.h"

/* ---- the tests ---- */

/* The bubble of stage orders (one order[s] of n passes a stage) when every
   forward pass, B and W takes one unit of time and a whole backward pass
   two, worked out pass by pass rather than measured, so that it is
   exact: each stage runs its passes in its order, each as soon as the
   stage is free and what it needs has ended (F on stage s needs F on
   s - 1; B needs B on s + 1, or on the last stage its own F; W its B).
   Returns the mean over the stages of the time each idles, over the whole
   step's span; -1 if the stages wait for each other for ever. */
static double unit_time_bubble(mgpu_pipeline_pass *const *order, int p, int m, int n) {
    double forward_end[MAX_STAGES][8], input_grad_end[MAX_STAGES][8], free_at[MAX_STAGES] = {0};
    int next[MAX_STAGES] = {0};
    for (int s = 0; s < p; s++)
        for (int j = 0; j < m; j++) forward_end[s][j] = input_grad_end[s][j] = -1;
    for (int moved = 1; moved;) {
        moved = 0;
        for (int s = 0; s < p; s++)
            for (; next[s] < n; next[s]++) {
                mgpu_pipeline_pass pass = order[s][next[s]];
                int j = pass.micro_batch;
                double needs = !pass.backward ? (s == 0 ? 0 : forward_end[s - 1][j])
                               : pass.part == MGPU_PASS_WEIGHT_GRAD ? input_grad_end[s][j]
                               : s == p - 1 ? forward_end[s][j] : input_grad_end[s + 1][j];
                if (needs < 0) break; /* (not yet: another stage first) */
                double start = needs > free_at[s] ? needs : free_at[s];
                free_at[s] = start + (pass.backward && pass.part == MGPU_PASS_WHOLE ? 2 : 1);
                if (!pass.backward) forward_end[s][j] = free_at[s];
                else if (pass.part != MGPU_PASS_WEIGHT_GRAD) input_grad_end[s][j] = free_at[s];
                moved = 1;
            }
    }
    double span = 0;
    for (int s = 0; s < p; s++) {
        if (next[s] < n) return -1;
        if (free_at[s] > span) span = free_at[s];
    }
    return 1 - 3.0 * m / span; /* (every stage works 3 m units: F, B and W of each micro-batch) */
}

/* ZB-H1's bubble, (p - 1) / (3m + p - 1), for m >= p: where each W runs
   decides it. A W nobody waits for fills a stage's idle time; run at
   once after its B, it holds back the B passes the stages before it wait
   for, and the bubble grows toward 1F1B's, (p - 1) / (m + p - 1). */
TEST(w_passes_fill_the_bubble) {
    int wrong = 0, skipped = 0;
    mgpu_device *devs[MAX_STAGES];
    mgpu_devices(MAX_STAGES, 0, devs);
    for (int p = MIN_STAGES; p <= MAX_STAGES; p++) {
        mgpu_net *net = test_plain_net(mgpu_cpu(), 3, 0);
        mgpu_pipeline *pp = mgpu_pipeline_new(net, devs, p, NULL);
        for (int i = 0; i < NMICRO; i++) {
            int m = micro[i], n = PASSES * m;
            if (m < p) continue; /* (the formula holds from m = p on) */
            if (!accepted(pp, m)) {
                skipped++;
                continue;
            }
            mgpu_pipeline_pass *order[MAX_STAGES];
            for (int s = 0; s < p; s++) {
                order[s] = (mgpu_pipeline_pass *)calloc((size_t)n, sizeof **order);
                schedule_zb_h1(s, p, m, order[s]);
            }
            double bubble = unit_time_bubble(order, p, m, n), want = mgpu_pipeline_zb_h1_bubble_formula(p, m);
            if (!(fabs(bubble - want) < 1e-9) && wrong++ < SAID)
                printf("  %d stages, m = %d: with F, B and W one unit each, your schedule idles %.4f of the step; "
                       "ZB-H1 idles (p - 1) / (3m + p - 1) = %.4f (1F1B's order, %.4f)\n",
                       p, m, bubble, want, mgpu_pipeline_bubble_formula(p, m));
            for (int s = 0; s < p; s++) free(order[s]);
        }
        mgpu_pipeline_free(pp);
        mgpu_net_free(net);
    }
    if (wrong > SAID) printf("  (and %d more settings off)\n", wrong - SAID);
    say_skipped(skipped);
    CHECK(wrong == 0);
}

/* The peak activations on every stage are at most min(m, p) micro-
   batches' worth, measured against one micro-batch's peak: a W keeps its
   micro-batch's activations (and the gradient of its output) until it
   runs, so W passes put off too long hold the memory ZB-H1 saves. */
TEST(activations_at_most_min_m_and_p_micro_batches) {
    measure_in_flight();
    say(flight.over, flight.over_said, "stages over the bound");
    say_skipped(flight.skipped);
    CHECK(flight.over == 0);
}

TEST_MAIN()
