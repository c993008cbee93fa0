/* tests/assignments/check_measure.c: the checker of the measuring-
   parallelism assignment (docs/assignments.md). Built with the student's
   file by
       make check-assignment NAME=measure FILE=student.c
   which must define double queues_busy_on_average(void): from the trace
   just recorded (mgpu_trace_count, mgpu_trace_get, mgpu_trace_span_ms),
   the queues busy on average. */
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include "tests/test.h"
#include STUDENT_FILE

/* A task of the checker's own that sleeps, so that the times are known. */
typedef struct { int ms; } sleep_args;
static void sleep_task(const void *args, const mgpu__exec *ex) {
    (void)ex;
    usleep((useconds_t)((const sleep_args *)args)->ms * 1000);
}
static void enqueue_sleep(mgpu_device *d, int ms) {
    sleep_args a = {ms};
    mgpu__launch_on(&d->queue[0], "sleep", sleep_task, NULL, &a, sizeof a);
}
/* The library's own answer: each queue's busy time over the span. */
static double busy_by_the_library(mgpu_device **d, int n) {
    double busy = 0;
    for (int i = 0; i < n; i++) busy += mgpu_trace_busy_ms(d[i], 0) + mgpu_trace_busy_ms(d[i], 1);
    return busy / mgpu_trace_span_ms();
}
static void check_scene(const char *what, int ndevices, int gap_ms) {
    mgpu_device *d[2];
    mgpu_devices(2, 0, d);
    mgpu_trace_begin();
    enqueue_sleep(d[0], 40);
    if (gap_ms) usleep((useconds_t)gap_ms * 1000);
    enqueue_sleep(d[0], 40);
    if (ndevices == 2) enqueue_sleep(d[1], 60);
    mgpu_trace_end();
    double want = busy_by_the_library(d, 2), got = queues_busy_on_average();
    printf("  %s: %.4f queues busy on average (the library: %.4f)\n", what, got, want);
    CHECK(fabs(got - want) <= 1e-6 * want);
}
TEST(two_devices_at_once) { check_scene("two devices at once", 2, 0); }
TEST(one_device_with_a_gap) { check_scene("one device, idle between its two tasks", 1, 70); }

TEST_MAIN()
