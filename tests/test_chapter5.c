/* tests/test_chapter5.c: chapter 5's own decisions. The chapter is
   included whole (its main renamed), so that these call the very
   functions it decides with:
   - the memory picture's x: a step's allocator calls run evenly from 0
     to 1 however many there are, so a step that recomputes, with more
     calls, lies on the same axis as the plain one; its y: the
     activations less what other networks hold;
   - figures past their bounds are flagged, and figures within are not:
     a checkpointed step faster than the plain one (as a busy machine
     once showed, at 0.80x) or slower than it plus a forward pass; peak
     activations above the plain step's or below its k-th part; a
     model's state off its formula; a checkpointed largest batch below
     the plain step's. */
#define main chapter5_main
#include "../chapters/05_memory.c"
#undef main
#include "test.h"

/* n samples holding base + i MiB of activations after call i */
static void samples_rising(mgpu_memory_sample *samples, int n, size_t base) {
    memset(samples, 0, sizeof *samples * (size_t)n);
    for (int i = 0; i < n; i++) samples[i].held[MGPU_MEMORY_ACTIVATIONS] = base + (size_t)i * 1048576;
}

TEST(the_pictures_x_runs_from_0_to_1_whatever_the_number_of_calls) {
    mgpu_memory_sample samples[9];
    double fraction[9], held[9];
    const size_t base = 3 * 1048576;
    samples_rising(samples, 5, base);
    timeline_curve(samples, 5, MGPU_MEMORY_ACTIVATIONS, base, fraction, held);
    for (int i = 0; i < 5; i++) {
        CHECK_CLOSE(fraction[i], i / 4.0, 1e-12, 0.0);
        CHECK_CLOSE(held[i], (double)i, 1e-12, 0.0);
    }
    samples_rising(samples, 9, base); /* twice the calls: the same 0 to 1 */
    timeline_curve(samples, 9, MGPU_MEMORY_ACTIVATIONS, base, fraction, held);
    CHECK_CLOSE(fraction[0], 0.0, 1e-12, 0.0);
    CHECK_CLOSE(fraction[4], 0.5, 1e-12, 0.0);
    CHECK_CLOSE(fraction[8], 1.0, 1e-12, 0.0);
    CHECK_CLOSE(held[8], 8.0, 1e-12, 0.0);
    timeline_curve(samples, 1, MGPU_MEMORY_ACTIVATIONS, base, fraction, held); /* one call: at 0 */
    CHECK_CLOSE(fraction[0], 0.0, 1e-12, 0.0);
}

TEST(a_checkpointed_steps_time_past_its_bounds_is_flagged) {
    /* plain 1000 ms, a forward pass 300 ms: a checkpointed step takes
       1000 to 1300 ms, 5% below and 10% above allowed */
    CHECK(!recompute_time_holds(3, 800, 1000, 300)); /* recomputation shown as faster */
    CHECK(!recompute_time_holds(3, 870, 1000, 300));
    CHECK(!recompute_time_holds(3, 940, 1000, 300));
    CHECK(!recompute_time_holds(12, 1450, 1000, 300)); /* more than a whole forward pass again */
    CHECK(recompute_time_holds(3, 960, 1000, 300));
    CHECK(recompute_time_holds(3, 1210, 1000, 300));
    CHECK(recompute_time_holds(12, 1420, 1000, 300));
}

TEST(peak_activations_past_their_bounds_are_flagged) {
    /* the plain step's 55.8 MiB: at 3 runs, 18.6 to 55.8 MiB, 1% either side */
    CHECK(!peak_holds(3, 60.0, 55.8));
    CHECK(!peak_holds(3, 18.0, 55.8));
    CHECK(peak_holds(3, 30.6, 55.8));
    CHECK(peak_holds(3, 18.5, 55.8));
    CHECK(peak_holds(1, 55.8, 55.8));
}

TEST(a_models_state_off_its_formula_is_flagged) {
    CHECK(near_formula("ZeRO-2's state (MiB)", 74.7, 74.6)); /* batch norm's statistics: within 1% */
    CHECK(!near_formula("ZeRO-2's state (MiB)", 106.6, 74.6)); /* ZeRO-1's figure */
    CHECK(!near_formula("Adam's state (MiB)", 42.6, 85.3)); /* one moment of two */
}

TEST(a_checkpointed_largest_batch_below_the_plain_one_is_flagged) {
    /* each found to within 4 below the true one */
    CHECK(!larger_batch_holds(48, 40, 4));
    CHECK(larger_batch_holds(48, 44, 4));
    CHECK(larger_batch_holds(48, 68, 4));
}

TEST_MAIN()
