/* tests/assignments/check_measure.c: the checker of the measuring-
   parallelism assignment (docs/assignments.md). Built with the student's
   file by
       make check-assignment NAME=measure FILE=student.c
   which must define double queues_busy_on_average(void): from the trace
   just recorded (mgpu_trace_count, mgpu_trace_get, mgpu_trace_span_ms),
   the queues busy on average. */
#include "mgpu.h"
#include "tests/test.h"
#include STUDENT_FILE

/* Tasks of known length: a one-layer network of the checker's own whose
   forward pass sleeps (own_loops 1: it runs on the device's queue, as a
   layer's pass does, so the trace records it). */
static void sleep_forward(mgpu_layer *l, mgpu_tensor *y, const mgpu_tensor *x, int training) {
    (void)y, (void)x, (void)training;
    usleep((useconds_t)*(const int *)l->settings * 1000);
}
static void no_backward(mgpu_layer *l, mgpu_tensor *dx, mgpu_tensor *dweight, mgpu_tensor *dbias,
                        const mgpu_tensor *dy, const mgpu_tensor *x, const mgpu_tensor *y) {
    (void)l, (void)dx, (void)dweight, (void)dbias, (void)dy, (void)x, (void)y;
}
static const mgpu_layer_fns sleeping = {"sleep", NULL, sleep_forward, no_backward, 1};
typedef struct { int ms; mgpu_net *net; mgpu_tensor *x; } sleeper;
static sleeper sleepers[3];
static int nsleepers;
static void enqueue_sleep(mgpu_device *d, int ms) {
    sleeper *s = &sleepers[nsleepers++];
    s->ms = ms;
    s->net = mgpu_net_new(d);
    mgpu_net_add_layer(s->net, &sleeping, NULL, NULL, &s->ms);
    s->x = mgpu_zeros(d, mgpu_shape2(1, 1));
    mgpu_net_forward(s->net, s->x);
}
static void free_sleepers(void) {
    mgpu_synchronize_all();
    for (int i = 0; i < nsleepers; i++) mgpu_free(sleepers[i].x), mgpu_net_free(sleepers[i].net);
    nsleepers = 0;
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
    free_sleepers();
    CHECK(fabs(got - want) <= 1e-6 * want);
}
TEST(two_devices_at_once) { check_scene("two devices at once", 2, 0); }
TEST(one_device_with_a_gap) { check_scene("one device, idle between its two tasks", 1, 70); }

TEST_MAIN()
