/* tests/assignments/check_pipeline.c: the checker of the pipeline-
   schedule assignment (docs/assignments.md). Built with the student's
   file by
       make check-assignment NAME=pipeline FILE=student.c
   which must define
       void schedule_1f1b(int stage, int stages, int micro_batches,
                          mgpu_pipeline_pass *order);
   1F1B's order of stage `stage`'s 2 m passes, as mgpu_schedule_fn asks.
   It runs on 2, 3 and 4 CPU devices with 1, 2, 3, 4 and 8 micro-batches
   (fewer than the stages, too); one device's gradients and the library's
   bound min(m, p - s) on the activations are the answer. */
#include "mgpu.h"
#include "tests/test.h"
#include STUDENT_FILE
#define STUDENT_SCHEDULE schedule_1f1b
#define PASSES 2
#define ACTIVATION_BOUND(p, s, m) ((m) < (p) - (s) ? (m) : (p) - (s))
#define BOUND_SAID "1F1B holds at most min(m, p - s)"
#include "tests/assignments/schedules.h"

/* ---- the tests ---- */

/* The peak activations on stage s are at most min(m, p - s) micro-
   batches' worth, measured against one micro-batch's peak (GPipe's order
   holds m of them on every stage). */
TEST(activations_at_most_min_m_and_p_minus_s_micro_batches) {
    if (!flight.measured) measure_in_flight();
    say(flight.over, flight.over_said, "stages over the bound");
    say_skipped(flight.skipped);
    CHECK(flight.over == 0);
}

/* And no fewer in flight than that: stage s runs the forward passes of
   p - s - 1 micro-batches more before the first one's backward pass can
   come back from the stages after it; a schedule that waits for it
   sooner leaves the stage idle. */
TEST(warm_up_fills_the_pipeline) {
    if (!flight.measured) {
        measure_in_flight();
        say_skipped(flight.skipped);
    }
    say(flight.under, flight.under_said, "stages short of it");
    CHECK(flight.under == 0);
}

/* For information (it never fails): the bubble of your schedule measured
   from the trace, beside the formula (p - 1) / (m + p - 1), on stages of
   equal times (tests/test.h's timed layers: 1 ms forward, 2 ms
   backward). */
static double timed_ms = 1.0;

TEST(bubble_for_information) {
    mgpu_device *devs[MAX_STAGES];
    mgpu_devices(MAX_STAGES, 0, devs);
    mgpu_tensor *x = mgpu_rand(mgpu_cpu(), mgpu_shape2(64, 10)), *y = mgpu_zeros(mgpu_cpu(), mgpu_shape1(64));
    for (int p = MIN_STAGES; p <= MAX_STAGES; p += 2) {
        int first[MAX_STAGES];
        mgpu_net *net = test_timed_net(p, &timed_ms, first);
        mgpu_pipeline *pp = mgpu_pipeline_new(net, devs, p, first);
        for (int m = 2; m <= 8; m *= 2) {
            if (!accepted(pp, m)) continue;
            mgpu_pipeline_forward_backward(pp, x, y, NULL); /* (warm) */
            mgpu_trace_begin();
            mgpu_pipeline_forward_backward(pp, x, y, NULL);
            mgpu_trace_end();
            mgpu_pipeline_timing t = mgpu_pipeline_measure(pp);
            printf("  %d stages, m = %d: your schedule's bubble %.3f; the formula (p - 1) / (m + p - 1) %.3f\n",
                   p, m, t.bubble_mean, mgpu_pipeline_bubble_formula(p, m));
        }
        mgpu_pipeline_free(pp);
        mgpu_net_free(net);
    }
    mgpu_free(x), mgpu_free(y);
}

TEST_MAIN()
