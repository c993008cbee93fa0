/* tests/test_core.c: devices as queues, events, timers, tensors, copies,
   the random generator, the matrix product and the allocator.

   Built with gcc this runs on CPU devices; built with nvcc on a GPU
   machine (make test-gpu) the same tests also cover GPU and virtual GPU
   devices. */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"
#include "test.h"

/* ---------------------------------------------------------------- queues */
typedef struct { int *log; int *count; int value; pthread_mutex_t *mutex; } append_args;
static void append_task(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const append_args *a = (const append_args *)args;
    pthread_mutex_lock(a->mutex);
    a->log[(*a->count)++] = a->value;
    pthread_mutex_unlock(a->mutex);
}

TEST(queue_runs_tasks_in_order) {
    mgpu_device *d[1];
    mgpu_devices(1, 0, d);
    enum { N = 2000 }; /* more than the ring holds, so the producer also waits */
    static int log[N];
    int count = 0;
    pthread_mutex_t mutex = PTHREAD_MUTEX_INITIALIZER;
    for (int i = 0; i < N; i++) {
        append_args a = {log, &count, i, &mutex};
        mgpu__launch_on(&d[0]->queue[0], "append", append_task, NULL, &a, sizeof a);
    }
    mgpu_synchronize(d[0]);
    CHECK_EQ_INT(count, N);
    int in_order = 1;
    for (int i = 0; i < N; i++) in_order &= log[i] == i;
    CHECK(in_order);
}

typedef struct { int ms; } sleep_args;
static void sleep_task(const void *args, const mgpu__exec *ex) {
    (void)ex;
    usleep((useconds_t)((const sleep_args *)args)->ms * 1000);
}
static void enqueue_sleep(mgpu_device *d, int ms) {
    sleep_args a = {ms};
    mgpu__launch_on(&d->queue[0], "sleep", sleep_task, NULL, &a, sizeof a);
}

TEST(launch_returns_before_the_work_is_done) {
    mgpu_device *d[1];
    mgpu_devices(1, 0, d);
    double t0 = mgpu_now();
    enqueue_sleep(d[0], 200);
    double enqueued = mgpu_now() - t0;
    mgpu_synchronize(d[0]);
    double done = mgpu_now() - t0;
    CHECK(enqueued < 0.05);
    CHECK(done >= 0.19);
}

TEST(two_cpu_devices_run_at_the_same_time) {
    mgpu_device *d[2];
    mgpu_devices(2, 0, d);
    double t0 = mgpu_now();
    enqueue_sleep(d[0], 200);
    enqueue_sleep(d[1], 200);
    mgpu_synchronize_all();
    double both = mgpu_now() - t0;
    CHECK(both >= 0.19);
    CHECK(both < 0.30); /* in series it would take 0.40 */
}

TEST(device_names_and_virtual_devices) {
    mgpu_device *d[4];
    mgpu_devices(4, 0, d);
    CHECK(strcmp(mgpu_device_name(d[0]), "cpu") == 0);
    CHECK(strcmp(mgpu_device_name(d[1]), "cpu#1") == 0);
    CHECK(strcmp(mgpu_device_name(d[3]), "cpu#3") == 0);
    CHECK(d[0] == mgpu_cpu());
    mgpu_device *again[2];
    mgpu_devices(2, 0, again);
    CHECK(again[1] == d[1]); /* the same logical device each time */
    char buf[128];
    CHECK(strcmp(mgpu_device_list(buf, sizeof buf, d, 2), "[cpu, cpu#1]") == 0);
    if (mgpu_num_gpus() == 0) {
        CHECK(mgpu_try_gpu(0) == mgpu_cpu());
        mgpu_device *all[4];
        CHECK_EQ_INT(mgpu_try_all_gpus(all, 4), 1);
        CHECK(all[0] == mgpu_cpu());
    } else {
        CHECK(strcmp(mgpu_device_name(mgpu_try_gpu(0)), "cuda:0") == 0);
        mgpu_device *g[MGPU_MAX_DEVICES];
        int n = mgpu_num_gpus();
        mgpu_devices(n + 1, 1, g); /* one past the physical GPUs: a virtual device */
        CHECK(strcmp(mgpu_device_name(g[n]), "cuda:0#1") == 0);
    }
}

TEST(bad_device_requests_are_clear_errors) {
    mgpu_device *d[MGPU_MAX_DEVICES + 1];
    EXPECT_DIES(mgpu_devices(0, 0, d), "asked for 0 devices");
    EXPECT_DIES(mgpu_devices(MGPU_MAX_DEVICES + 1, 0, d), "between 1 and 16");
    EXPECT_DIES(mgpu_try_gpu(-1), "device index -1 is negative");
}

/* ------------------------------------------------------- events, timers */
TEST(events_order_and_time_work_across_devices) {
    mgpu_device *d[2];
    mgpu_devices(2, 0, d);
    mgpu_event *start = mgpu_event_new(), *end = mgpu_event_new(), *handoff = mgpu_event_new();
    mgpu_event_record(start, d[0]);
    enqueue_sleep(d[0], 100);
    mgpu_event_record(handoff, d[0]);
    mgpu_event_wait(d[1], handoff); /* d[1] may not start its sleep before d[0] is done */
    enqueue_sleep(d[1], 100);
    mgpu_event_record(end, d[1]);
    mgpu_event_synchronize(end);
    double ms = mgpu_event_elapsed_ms(start, end);
    CHECK(ms >= 195 && ms < 300);
    mgpu_event_free(start);
    mgpu_event_free(end);
    mgpu_event_free(handoff);
}

/* Intervals of 20, 40 and 60 ms of sleep: each measured at least its
   sleep (usleep never wakes early) and, in seconds, less than 0.1 s more
   (a busy machine wakes a sleeper late, by milliseconds: a 5 ms bound
   failed in CI while other tests ran); then the sum, mean and running
   sums of exactly those intervals. */
TEST(median_of_odd_and_even_counts) {
    double odd[3] = {3, 1, 2}, even[4] = {4, 1, 3, 2.5};
    CHECK(mgpu_median(odd, 3) == 2.0);
    CHECK(mgpu_median(even, 4) == 2.75);
    CHECK(even[0] == 1.0 && even[3] == 4.0); /* (sorted in place) */
    EXPECT_DIES(mgpu_median(odd, 0), "mgpu_median: 0 values; want 1 or more");
}

/* Impossible figures are flagged in one line naming the figure, its
   bound and the advice; possible ones, and those within the tolerance,
   print nothing. */
TEST(bounds_flag_impossible_figures) {
    char line[256];
    CHECK(mgpu_bound_line(line, sizeof line, "efficiency", 1.0, MGPU_AT_MOST, 1.0, 0.0, NULL) && !line[0]);
    CHECK(mgpu_bound_line(line, sizeof line, "efficiency", 1.04, MGPU_AT_MOST, 1.0, 0.05, NULL) && !line[0]);
    CHECK(!mgpu_bound_line(line, sizeof line, "efficiency", 2.05, MGPU_AT_MOST, 1.0, 0.05,
                           "rerun with no more processes than cores"));
    CHECK(strcmp(line, "  ! efficiency 2.05 is above its bound 1: the machine was busy or too small for it; "
                       "rerun with no more processes than cores") == 0);
    CHECK(mgpu_bound_line(line, sizeof line, "bubble", 0.43, MGPU_AT_LEAST, 0.111, 0.05, NULL) && !line[0]);
    CHECK(!mgpu_bound_line(line, sizeof line, "bubble", 0.246, MGPU_AT_LEAST, 0.333, 0.05, NULL));
    CHECK(strcmp(line, "  ! bubble 0.246 is below its bound 0.333: the machine was busy or too small for it.") == 0);
    CHECK(!mgpu_bound_line(line, sizeof line, "bubble", 0.3, MGPU_AT_LEAST, 0.333, 0.05, NULL)); /* 0.3 < 0.316 */
    CHECK(mgpu_bound_hold("speedup", 1.5, MGPU_AT_MOST, 2.0, 0.0, NULL) == 1);
    EXPECT_DIES(mgpu_bound_line(line, sizeof line, "x", 1.0, MGPU_AT_MOST, 1.0, -0.1, NULL),
                "mgpu_bound_line: want a buffer, a figure's name and a tolerance >= 0");
}

TEST(timer_sums_averages_and_cumulates) {
    mgpu_timer t;
    mgpu_timer_init(&t);
    double interval[3];
    for (int i = 0; i < 3; i++) {
        mgpu_timer_start(&t);
        usleep((useconds_t)((i + 1) * 20000));
        interval[i] = mgpu_timer_stop(&t);
        CHECK(interval[i] >= 0.020 * (i + 1) && interval[i] < 0.020 * (i + 1) + 0.1);
    }
    CHECK_EQ_INT(t.n, 3);
    double sum = interval[0] + interval[1] + interval[2];
    CHECK_CLOSE(mgpu_timer_sum(&t), sum, 1e-12, 0);
    CHECK_CLOSE(mgpu_timer_avg(&t), sum / 3, 1e-12, 0);
    CHECK_CLOSE(mgpu_timer_cumsum(&t, 0), interval[0], 1e-12, 0);
    CHECK_CLOSE(mgpu_timer_cumsum(&t, 1), interval[0] + interval[1], 1e-12, 0);
    CHECK_CLOSE(mgpu_timer_cumsum(&t, 2), sum, 1e-12, 0);
}

/* --------------------------------------------------------------- tensors */
/* Every kind of device this machine has: CPU, virtual CPU, and on a GPU
   machine the GPU, a virtual GPU device and a second GPU if present. */
static int all_kinds_of_device(mgpu_device **out) {
    int n = 0;
    mgpu_device *cpus[2];
    mgpu_devices(2, 0, cpus);
    out[n++] = cpus[0];
    out[n++] = cpus[1];
    int gpus = mgpu_num_gpus();
    if (gpus > 0) {
        mgpu_device *g[MGPU_MAX_DEVICES];
        mgpu_devices(gpus + 1, 1, g);
        out[n++] = g[0];
        out[n++] = g[gpus]; /* virtual: cuda:0#1 */
        if (gpus > 1) out[n++] = g[1];
    }
    return n;
}

TEST(round_trips_between_every_pair_of_devices) {
    mgpu_device *devs[8];
    int n = all_kinds_of_device(devs);
    float host[37], back[37];
    for (int i = 0; i < 37; i++) host[i] = 0.5f * (float)i - 3.0f;
    for (int a = 0; a < n; a++)
        for (int b = 0; b < n; b++)
            for (int non_blocking = 0; non_blocking <= 1; non_blocking++) {
                mgpu_tensor *x = mgpu_from_host(devs[a], mgpu_shape1(37), host);
                mgpu_tensor *y = mgpu_to(x, devs[b], non_blocking);
                mgpu_add_(y, y); /* runs on b after the copy arrives */
                mgpu_tensor *z = mgpu_to(y, devs[a], non_blocking);
                mgpu_to_host(z, back);
                int same = 1;
                for (int i = 0; i < 37; i++) same &= back[i] == 2 * host[i];
                if (!same)
                    fprintf(stderr, "  %s -> %s (non_blocking %d) changed the data\n",
                            mgpu_device_name(devs[a]), mgpu_device_name(devs[b]), non_blocking);
                CHECK(same);
                mgpu_free(x);
                mgpu_free(y);
                mgpu_free(z);
            }
}

TEST(non_blocking_copy_into_pinned_memory) {
    mgpu_device *d[1];
    mgpu_devices(1, 1, d);
    mgpu_tensor *x = mgpu_arange(d[0], mgpu_shape2(64, 64));
    mgpu_tensor *host = mgpu_empty_pinned(mgpu_shape2(64, 64));
    mgpu_copy(host, x, 1);
    mgpu_synchronize_all();
    CHECK_EQ_INT(host->pinned, 1);
    CHECK_CLOSE(host->data[4095], 4095, 0, 0);
    CHECK_CLOSE(host->data[65], 65, 0, 0);
    mgpu_free(x);
    mgpu_free(host);
}

/* Copies on different devices' copy queues that touch the same tensor must
   keep their order. Tensors of 256 MiB, so that an unordered copy would
   still be running when the next one starts (found by review: each of
   these failed every run before the waits were added). */
#define BIG_COPY ((size_t)1 << 26)
TEST(a_copy_does_not_overwrite_a_tensor_another_copy_still_reads) {
    mgpu_device *d[3];
    mgpu_devices(3, 0, d);
    mgpu_tensor *a = mgpu_full(d[0], mgpu_shape1(BIG_COPY), 1.0f);
    mgpu_tensor *b = mgpu_empty(d[1], mgpu_shape1(BIG_COPY));
    mgpu_tensor *c = mgpu_full(d[2], mgpu_shape1(BIG_COPY), 2.0f);
    mgpu_synchronize_all();
    mgpu_copy(b, a, 1); /* d0's copy queue reads a ... */
    mgpu_copy(a, c, 1); /* ... and d2's copy queue overwrites it */
    mgpu_synchronize_all();
    CHECK_CLOSE(mgpu_item(b, 0), 1.0f, 0, 0);
    CHECK_CLOSE(mgpu_item(b, BIG_COPY - 1), 1.0f, 0, 0);
    CHECK_CLOSE(mgpu_item(a, BIG_COPY - 1), 2.0f, 0, 0);
    mgpu_free(a); mgpu_free(b); mgpu_free(c);
}

TEST(pinned_memory_is_read_after_the_copy_into_it) {
    mgpu_device *d[3];
    mgpu_devices(3, 0, d);
    mgpu_tensor *x = mgpu_full(d[1], mgpu_shape1(BIG_COPY), 3.0f);
    mgpu_tensor *p = mgpu_empty_pinned(mgpu_shape1(BIG_COPY));
    mgpu_synchronize_all();
    mgpu_copy(p, x, 1);                          /* d1's copy queue writes p */
    CHECK_CLOSE(mgpu_item(p, BIG_COPY - 1), 3.0f, 0, 0); /* the host waits for it */
    mgpu_fill(x, 4.0f);
    mgpu_copy(p, x, 1);                          /* d1's copy queue writes p again */
    mgpu_tensor *y = mgpu_to(p, d[2], 1);        /* another copy queue reads it after */
    mgpu_synchronize_all();
    CHECK_CLOSE(mgpu_item(y, 0), 4.0f, 0, 0);
    CHECK_CLOSE(mgpu_item(y, BIG_COPY - 1), 4.0f, 0, 0);
    mgpu_free(x); mgpu_free(p); mgpu_free(y);
}

TEST(views_and_narrow_share_memory) {
    mgpu_tensor *x = mgpu_arange(mgpu_cpu(), mgpu_shape2(4, 5));
    mgpu_tensor *rows = mgpu_narrow(x, 2, 2);
    CHECK_EQ_INT(rows->shape.d[0], 2);
    CHECK_EQ_INT(rows->numel, 10);
    CHECK_CLOSE(mgpu_item(rows, 0), 10, 0, 0);
    mgpu_tensor *flat = mgpu_view(x, mgpu_shape1(20));
    CHECK_CLOSE(mgpu_item(flat, 19), 19, 0, 0);
    char a[64];
    CHECK(strcmp(mgpu_shape_str(x->shape, a, sizeof a), "[4, 5]") == 0);
    EXPECT_DIES(mgpu_view(x, mgpu_shape2(3, 5)), "cannot view a tensor of shape [4, 5] as [3, 5]");
    EXPECT_DIES(mgpu_narrow(x, 3, 2), "mgpu_narrow: cannot take rows 3..5 of a tensor of shape [4, 5]");
    EXPECT_DIES(mgpu_empty(mgpu_cpu(), mgpu_shape2(-1, 5)), "negative size");
    EXPECT_DIES(mgpu_narrow(x, 2, INT_MAX), "mgpu_narrow: cannot take rows 2..2147483649"); /* (no overflow) */
    mgpu_free(rows);
    mgpu_free(flat);
    mgpu_free(x);
}

/* mgpu_shape is a plain struct: a shape a program fills itself is checked
   like the constructors' (mgpu_shape4 ...), and one of more values than
   memory can count is refused, not wrapped round to a few bytes. */
/* A tensor's life: freeing it twice, and using it or a view of it after
   mgpu_free, are one-line errors naming the call and the shape, not a
   crash or another tensor's values (the memory freed is given out again:
   the new tensor below takes it). */
static void use_after_free(int what) {
    mgpu_device *cpu = mgpu_cpu();
    mgpu_tensor *t = mgpu_zeros(cpu, mgpu_shape2(3, 4)), *v = mgpu_view(t, mgpu_shape1(12));
    mgpu_tensor *y = mgpu_empty(cpu, mgpu_shape2(3, 4));
    mgpu_free(t);
    mgpu_tensor *other = mgpu_full(cpu, mgpu_shape1(12), 7.0f); /* (in t's memory) */
    if (what == 0) mgpu_free(t);
    if (what == 1) mgpu_print("v = ", v);
    if (what == 2) mgpu_item(t, 0);
    if (what == 3) mgpu_relu_forward(y, t);
    if (what == 4) mgpu_relu_forward(other, v);
    if (what == 5) mgpu_free(v), mgpu_free(v);
    if (what == 6) mgpu_free(mgpu_narrow(v, 0, 2));
    mgpu_free(other);
}
TEST(tensors_used_after_mgpu_free_are_one_line_errors) {
    EXPECT_DIES(use_after_free(0), "mgpu: error: mgpu_free: a tensor of shape [3, 4] freed a second time\n");
    EXPECT_DIES(use_after_free(1), "mgpu: error: mgpu_print: a view (shape [12]) of a tensor that mgpu_free has "
                                   "freed since the view was taken\n");
    EXPECT_DIES(use_after_free(2), "mgpu: error: mgpu_item: a tensor of shape [3, 4] used after mgpu_free freed it\n");
    EXPECT_DIES(use_after_free(3), "mgpu: error: mgpu_relu_forward: a tensor of shape [3, 4] used after mgpu_free "
                                   "freed it\n");
    EXPECT_DIES(use_after_free(4), "mgpu: error: mgpu_relu_forward: a view (shape [12]) of a tensor that mgpu_free "
                                   "has freed since the view was taken\n");
    EXPECT_DIES(use_after_free(5), "mgpu: error: mgpu_free: a tensor of shape [12] freed a second time\n");
    EXPECT_DIES(use_after_free(6), "mgpu: error: mgpu_narrow: a view (shape [12]) of a tensor that mgpu_free has freed");
    /* and a view still alive with its tensor works */
    mgpu_tensor *t = mgpu_full(mgpu_cpu(), mgpu_shape2(3, 4), 2.0f), *v = mgpu_view(t, mgpu_shape1(12));
    CHECK(mgpu_item(v, 11) == 2.0f);
    mgpu_free(v);
    mgpu_free(t);
}

/* Past MGPU__FREED_HEADERS frees, the oldest freed headers are reused,
   not piled up (nor lost: make test-asan's leak check), and a fresh
   double free is still caught. */
TEST(freed_tensor_headers_are_reused_after_the_queue_fills) {
    mgpu_device *cpu = mgpu_cpu();
    for (int i = 0; i < 3 * MGPU__FREED_HEADERS; i++) {
        mgpu_tensor *a = mgpu_empty(cpu, mgpu_shape1(1)), *b = mgpu_empty(cpu, mgpu_shape1(1));
        mgpu_free(a);
        mgpu_free(b);
    }
    CHECK_EQ_INT(mgpu__headers.count, MGPU__FREED_HEADERS);
    CHECK(mgpu__headers.ready_count <= 2); /* (taken again as fast as they come) */
    EXPECT_DIES(mgpu_tensor *t = mgpu_empty(cpu, mgpu_shape1(3)); mgpu_free(t); mgpu_free(t),
                "mgpu_free: a tensor of shape [3] freed a second time");
}

/* What the manual promises of the queues: a write to a copy's source
   enqueued after the copy waits for it (the copy takes the old values),
   freeing a tensor right after enqueuing work on it is safe, and
   mgpu_to(t, t->device, 0) clones t. Between two CPU devices, with a
   large tensor, so that the copy is still running when the fill is
   enqueued. */
TEST(writes_after_a_copy_and_frees_after_work_are_safe) {
    mgpu_device *d[2];
    mgpu_devices(2, 0, d);
    enum { N = 1 << 22 };
    mgpu_tensor *src = mgpu_full(d[0], mgpu_shape1(N), 3.0f), *dst = mgpu_empty(d[1], mgpu_shape1(N));
    mgpu_copy(dst, src, 1);
    mgpu_fill(src, 0.0f);
    CHECK(mgpu_item(dst, N - 1) == 3.0f && mgpu_item(src, N - 1) == 0.0f);
    mgpu_tensor *doomed = mgpu_full(d[0], mgpu_shape1(N), 5.0f), *sum = mgpu_zeros(d[0], mgpu_shape1(N));
    mgpu_add_(sum, doomed);
    mgpu_free(doomed);                                          /* (the add is still queued) */
    mgpu_tensor *next = mgpu_full(d[0], mgpu_shape1(N), 7.0f); /* (may take doomed's memory) */
    CHECK(mgpu_item(sum, N - 1) == 5.0f && mgpu_item(next, 0) == 7.0f);
    mgpu_tensor *clone = mgpu_to(sum, sum->device, 0);
    CHECK(clone->device == d[0] && clone->data != sum->data && mgpu_item(clone, 17) == 5.0f);
    mgpu_free(src), mgpu_free(dst), mgpu_free(sum), mgpu_free(next), mgpu_free(clone);
}

TEST(shapes_that_no_tensor_can_have_are_refused) {
    mgpu_tensor *x = mgpu_zeros(mgpu_cpu(), mgpu_shape1(4));
    mgpu_shape seven = {7, {1, 1, 1, 1}}, negative = {2, {-2, -2, 1, 1}}, none = {0, {1, 1, 1, 1}};
    EXPECT_DIES(mgpu_view(x, seven), "mgpu_view: a tensor has 1 to 4 dimensions, not 7");
    EXPECT_DIES(mgpu_view(x, none), "mgpu_view: a tensor has 1 to 4 dimensions, not 0");
    EXPECT_DIES(mgpu_view(x, negative), "mgpu_view: a shape cannot have a negative size (-2 in dimension 0)");
    EXPECT_DIES(mgpu_empty(mgpu_cpu(), negative), "a new tensor: a shape cannot have a negative size");
    EXPECT_DIES(mgpu_zeros(mgpu_cpu(), mgpu_shape3(1 << 30, 1 << 30, 4)),
                "a new tensor: a shape of more values than memory can hold (dimension 2: 4)");
    /* 2^62 - 4 values: bytes that the allocator's rounding would wrap to 0 */
    EXPECT_DIES(mgpu_zeros(mgpu_cpu(), mgpu_shape3(4, (1 << 30) - 1, (1 << 30) + 1)),
                "a new tensor: a shape of more values than memory can hold (dimension 2");
    mgpu_free(x);
}

/* An output that shares memory with an input would read values the
   operation already wrote: overlapping views are refused (y += y, the
   same values, is fine elementwise; a product is not). */
TEST(outputs_that_overlap_their_inputs_are_refused) {
    mgpu_tensor *t = mgpu_arange(mgpu_cpu(), mgpu_shape1(6));
    mgpu_tensor *head = mgpu_narrow(t, 0, 5), *tail = mgpu_narrow(t, 1, 5);
    EXPECT_DIES(mgpu_add_(tail, head), "mgpu_add_: the output and an input share memory (overlapping views of one tensor)");
    EXPECT_DIES(mgpu_copy(tail, head, 0), "mgpu_copy: the output and an input share memory (overlapping views");
    mgpu_add_(t, t);
    CHECK_CLOSE(mgpu_item(t, 5), 10, 0, 0);
    mgpu_tensor *a = mgpu_ones(mgpu_cpu(), mgpu_shape2(2, 2)), *b = mgpu_ones(mgpu_cpu(), mgpu_shape2(2, 2));
    EXPECT_DIES(mgpu_matmul(a, a, b), "mgpu_matmul: the output and an input share memory (the same tensor)");
    EXPECT_DIES(mgpu_matmul(b, a, b), "mgpu_matmul: the output and an input share memory (the same tensor)");
    mgpu_event *never = mgpu_event_new(), *recorded = mgpu_event_new();
    mgpu_event_record(recorded, mgpu_cpu());
    EXPECT_DIES(mgpu_event_elapsed_ms(never, recorded), "mgpu_event_elapsed_ms: the start event was never recorded");
    EXPECT_DIES(mgpu_event_elapsed_ms(recorded, never), "mgpu_event_elapsed_ms: the end event was never recorded");
    mgpu_event_free(never);
    mgpu_event_free(recorded);
    mgpu_free(head); mgpu_free(tail); mgpu_free(t); mgpu_free(a); mgpu_free(b);
}

TEST(operations_refuse_tensors_from_two_devices) {
    mgpu_device *d[2];
    mgpu_devices(2, 0, d);
    mgpu_tensor *a = mgpu_zeros(d[0], mgpu_shape1(3));
    mgpu_tensor *b = mgpu_zeros(d[1], mgpu_shape1(3));
    mgpu_tensor *c = mgpu_zeros(d[0], mgpu_shape1(4));
    EXPECT_DIES(mgpu_add_(a, b), "a tensor on cpu#1 is used with one on cpu");
    EXPECT_DIES(mgpu_add_(a, c), "mgpu_add_: shapes [3] and [4] differ");
    mgpu_free(a);
    mgpu_free(b);
    mgpu_free(c);
}

TEST(allocator_reuses_freed_blocks) {
    mgpu_device *d = mgpu_cpu();
    size_t before = mgpu_device_memory_in_use(d);
    mgpu_tensor *a = mgpu_empty(d, mgpu_shape2(100, 100));
    float *first = a->data;
    CHECK_EQ_INT(mgpu_device_memory_in_use(d) - before, 40448); /* 40000 rounded up to 512s */
    mgpu_free(a);
    CHECK_EQ_INT(mgpu_device_memory_in_use(d), before);
    mgpu_tensor *b = mgpu_empty(d, mgpu_shape2(50, 200)); /* same bytes, other shape */
    CHECK(b->data == first);
    mgpu_tensor *c = mgpu_empty(d, mgpu_shape2(100, 100)); /* b holds the block: a new one */
    CHECK(c->data != first);
    CHECK(mgpu_device_memory_peak(d) >= before + 2 * 40448);
    mgpu_free(b);
    mgpu_free(c);
}

/* More host memory than the machine has (1 TiB here) is a one-line error,
   not a process the kernel kills later. */
TEST(host_memory_past_the_machines_is_a_clear_error) {
    EXPECT_DIES(mgpu_empty(mgpu_cpu(), mgpu_shape4(1 << 16, 1 << 16, 64, 1)),
                "out of host memory on cpu: asked for 1048576.0 MiB with");
}

/* ---------------------------------------------------------------- random */
TEST(philox_matches_the_published_test_vector) {
    /* Random123's known answer for Philox4x32-10, counter 0, key 0. */
    uint32_t r[4];
    mgpu_philox(0, 0, r);
    CHECK_EQ_INT(r[0], 0x6627e8d5u);
    CHECK_EQ_INT(r[1], 0xe169c58du);
    CHECK_EQ_INT(r[2], 0xbc57ac4cu);
    CHECK_EQ_INT(r[3], 0x9b00dbd8u);
}

static void draw(uint64_t seed, mgpu_device *d, float *out, int n, int normal) {
    mgpu_manual_seed(seed);
    mgpu_tensor *t = normal ? mgpu_randn(d, mgpu_shape1(n), 0, 1) : mgpu_rand(d, mgpu_shape1(n));
    mgpu_to_host(t, out);
    mgpu_free(t);
}

TEST(generator_is_reproducible_and_has_the_right_moments) {
    enum { N = 100000 };
    static float a[N], b[N], c[N];
    mgpu_device *devs[8];
    int ndev = all_kinds_of_device(devs);
    for (int normal = 0; normal <= 1; normal++) {
        draw(42, devs[0], a, N, normal);
        for (int k = 1; k < ndev; k++) { /* same numbers on every device */
            draw(42, devs[k], b, N, normal);
            int same = 1;
            for (int i = 0; i < N; i++) same &= fabsf(a[i] - b[i]) <= 1e-6f * (1 + fabsf(a[i]));
            CHECK(same);
        }
        draw(43, devs[0], c, N, normal);
        int differ = 0;
        for (int i = 0; i < N; i++) differ += a[i] != c[i];
        CHECK(differ > N * 0.99);
        double mean = 0, sq = 0;
        for (int i = 0; i < N; i++) { mean += a[i]; sq += (double)a[i] * a[i]; }
        mean /= N;
        double var = sq / N - mean * mean;
        /* 5 standard errors: sd(mean) = sqrt(var/N) */
        CHECK_CLOSE(mean, normal ? 0.0 : 0.5, 5 * sqrt((normal ? 1.0 : 1.0 / 12) / N), 0);
        CHECK_CLOSE(var, normal ? 1.0 : 1.0 / 12, normal ? 0.02 : 0.002, 0);
    }
    /* two draws in a row differ: the offset moves on */
    mgpu_manual_seed(7);
    mgpu_tensor *x = mgpu_rand(mgpu_cpu(), mgpu_shape1(8));
    mgpu_tensor *y = mgpu_rand(mgpu_cpu(), mgpu_shape1(8));
    CHECK(mgpu_item(x, 0) != mgpu_item(y, 0));
    mgpu_free(x);
    mgpu_free(y);
}

/* ---------------------------------------------------------------- matmul */
static void check_matmul(mgpu_device *d, int m, int k, int n) {
    mgpu_manual_seed((uint64_t)(m * 1000003 + k * 1009 + n));
    mgpu_tensor *a = mgpu_randn(d, mgpu_shape2(m, k), 0, 1);
    mgpu_tensor *b = mgpu_randn(d, mgpu_shape2(k, n), 0, 1);
    mgpu_tensor *c = mgpu_mm(a, b);
    float *ha = (float *)malloc(sizeof(float) * (size_t)m * k);
    float *hb = (float *)malloc(sizeof(float) * (size_t)k * n);
    float *hc = (float *)malloc(sizeof(float) * (size_t)m * n);
    mgpu_to_host(a, ha);
    mgpu_to_host(b, hb);
    mgpu_to_host(c, hc);
    double worst = 0;
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double want = 0, scale = 0;
            for (int p = 0; p < k; p++) {
                want += (double)ha[i * k + p] * hb[p * n + j];
                scale += fabs((double)ha[i * k + p] * hb[p * n + j]);
            }
            /* float accumulation: error grows like k * eps * sum |a b| at worst */
            double err = fabs(hc[i * n + j] - want) / (scale + 1e-30);
            if (err > worst) worst = err;
        }
    if (worst > 1e-5)
        fprintf(stderr, "  matmul %dx%dx%d on %s: relative error %g\n", m, k, n,
                mgpu_device_name(d), worst);
    CHECK(worst <= 1e-5);
    free(ha);
    free(hb);
    free(hc);
    mgpu_free(a);
    mgpu_free(b);
    mgpu_free(c);
}

TEST(matmul_matches_a_double_precision_reference) {
    static const int shapes[][3] = {{1, 1, 1}, {3, 5, 7}, {64, 1, 33}, {17, 31, 1},
                                    {1, 200, 1}, {128, 96, 80}, {256, 800, 128}};
    mgpu_device *devs[8];
    int ndev = all_kinds_of_device(devs);
    for (int k = 0; k < ndev; k++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            check_matmul(devs[k], shapes[s][0], shapes[s][1], shapes[s][2]);
}

/* A product over an empty inner dimension is a matrix of zeros (BLAS
   still wants leading dimensions of at least 1). */
TEST(matmul_with_nothing_to_sum_gives_zeros) {
    mgpu_device *devs[8];
    int ndev = all_kinds_of_device(devs);
    for (int k = 0; k < ndev; k++) {
        mgpu_tensor *a = mgpu_zeros(devs[k], mgpu_shape2(3, 0));
        mgpu_tensor *b = mgpu_zeros(devs[k], mgpu_shape2(0, 4));
        mgpu_tensor *c = mgpu_full(devs[k], mgpu_shape2(3, 4), NAN);
        mgpu_matmul(c, a, b);
        float out[12];
        mgpu_to_host(c, out);
        for (int i = 0; i < 12; i++) CHECK_CLOSE(out[i], 0.0f, 0, 0);
        mgpu_free(a); mgpu_free(b); mgpu_free(c);
    }
}

TEST(matmul_shape_errors_are_clear) {
    mgpu_tensor *a = mgpu_zeros(mgpu_cpu(), mgpu_shape2(3, 4));
    mgpu_tensor *b = mgpu_zeros(mgpu_cpu(), mgpu_shape2(5, 6));
    mgpu_tensor *v = mgpu_zeros(mgpu_cpu(), mgpu_shape1(4));
    EXPECT_DIES(mgpu_mm(a, b), "mgpu_matmul: cannot multiply [3, 4] by [5, 6] into [3, 6]");
    EXPECT_DIES(mgpu_mm(a, v), "mgpu_mm: both tensors must be matrices");
    mgpu_free(a);
    mgpu_free(b);
    mgpu_free(v);
}

/* Where the TF32 settings come from: MGPU_TF32 at the first product, else
   PyTorch's defaults; a bad value is a clear error. (The harness has set
   them already: forget that, then put it back.) */
static void tf32_from_environment(const char *value, int conv, int matmul) {
    if (value) setenv("MGPU_TF32", value, 1);
    else unsetenv("MGPU_TF32");
    mgpu__tf32[0] = mgpu__tf32[1] = -1;
    int got_conv = -1, got_matmul = -1;
    mgpu_get_tf32(&got_conv, &got_matmul);
    CHECK(got_conv == conv && got_matmul == matmul);
}
TEST(tf32_settings_default_to_pytorchs) {
    const char *saved = getenv("MGPU_TF32");
    char *saved_copy = saved ? strdup(saved) : NULL;
    tf32_from_environment(NULL, 1, 0); /* cudnn.allow_tf32 True, matmul.allow_tf32 False */
    tf32_from_environment("", 1, 0);
    tf32_from_environment("0", 0, 0);
    tf32_from_environment("1", 1, 1);
    setenv("MGPU_TF32", "yes", 1);
    mgpu__tf32[0] = mgpu__tf32[1] = -1;
    EXPECT_DIES(mgpu_mm(mgpu_ones(mgpu_cpu(), mgpu_shape2(1, 1)),
                        mgpu_ones(mgpu_cpu(), mgpu_shape2(1, 1))),
                "MGPU_TF32=yes: want 0 (float32 everywhere) or 1 (TF32 in every product)");
    mgpu_set_tf32(1, 0);
    int conv, matmul;
    mgpu_get_tf32(&conv, &matmul);
    CHECK(conv == 1 && matmul == 0);
    if (saved_copy) setenv("MGPU_TF32", saved_copy, 1);
    else unsetenv("MGPU_TF32");
    free(saved_copy);
    mgpu_set_tf32(0, 0);
}

/* --------------------------------------------------------------- tracing */
TEST(tracer_records_overlapping_work_on_two_devices) {
    mgpu_device *d[2];
    mgpu_devices(2, 0, d);
    mgpu_trace_begin();
    enqueue_sleep(d[0], 60);
    enqueue_sleep(d[1], 60);
    mgpu_trace_end();
    int found = 0;
    double s[2] = {0, 0}, e[2] = {0, 0};
    for (int i = 0; i < mgpu__library.trace_n; i++) {
        const mgpu__trace_record *r = &mgpu__library.trace[i];
        if (strcmp(r->name, "sleep") != 0) continue;
        int which = r->queue_id == d[0]->index * 2 ? 0 : 1;
        s[which] = r->start;
        e[which] = r->end;
        found++;
    }
    CHECK_EQ_INT(found, 2);
    CHECK(e[0] - s[0] >= 0.055);
    CHECK(s[1] < e[0] && s[0] < e[1]); /* the two bars overlap in time */
    char path[] = "/tmp/mgpu_trace_XXXXXX.png";
    int fd = mkstemps(path, 4);
    CHECK(fd >= 0);
    close(fd);
    CHECK_EQ_INT(mgpu_trace_write_png(path, "two devices"), 0);
    FILE *f = fopen(path, "rb");
    unsigned char magic[8] = {0};
    CHECK(f && fread(magic, 1, 8, f) == 8);
    if (f) fclose(f);
    CHECK(magic[1] == 'P' && magic[2] == 'N' && magic[3] == 'G');
    unlink(path);
}

/* The trace as data: each operation's device, queue, name and times,
   and each queue's busy time. Device 0 sleeps 40 ms twice, device 1 60
   ms once, at the same time: device 0's compute queue is busy for the
   two sleeps (its operations run one after the other), its copy queue
   not at all, and more than one queue is busy on average. */
TEST(trace_data_gives_each_operation_and_each_queues_busy_time) {
    mgpu_device *d[2];
    mgpu_devices(2, 0, d);
    mgpu_trace_begin();
    enqueue_sleep(d[0], 40);
    enqueue_sleep(d[0], 40);
    enqueue_sleep(d[1], 60);
    int n = mgpu_trace_count(); /* (ends the trace) */
    double sleeps[2] = {0, 0}, last_end = 0;
    int found[2] = {0, 0};
    for (int i = 0; i < n; i++) {
        mgpu_trace_op op = mgpu_trace_get(i);
        last_end = fmax(last_end, op.end_ms);
        CHECK(op.start_ms >= 0 && op.end_ms >= op.start_ms);
        if (strcmp(op.name, "sleep") != 0) continue;
        int which = op.device == d[0] ? 0 : 1;
        CHECK(op.device == d[which] && op.lane == 0);
        CHECK(strcmp(op.queue, which ? "cpu#1 compute" : "cpu compute") == 0);
        CHECK(op.end_ms - op.start_ms >= (which ? 59.0 : 39.0));
        sleeps[which] += op.end_ms - op.start_ms;
        found[which]++;
    }
    CHECK(found[0] == 2 && found[1] == 1);
    CHECK_CLOSE(mgpu_trace_busy_ms(d[0], 0), sleeps[0], 1e-9, 1e-9);
    CHECK_CLOSE(mgpu_trace_busy_ms(d[1], 0), sleeps[1], 1e-9, 1e-9);
    CHECK(mgpu_trace_busy_ms(d[0], 1) == 0.0);
    double span = mgpu_trace_span_ms();
    CHECK(span >= last_end);
    double busy_queues = (mgpu_trace_busy_ms(d[0], 0) + mgpu_trace_busy_ms(d[1], 0)) / span;
    printf("  queues busy on average: %.2f\n", busy_queues);
    CHECK(busy_queues > 1.1 && busy_queues <= 2.0);
    EXPECT_DIES(mgpu_trace_get(n), "mgpu_trace_get: operation");
    EXPECT_DIES(mgpu_trace_busy_ms(d[0], 2), "mgpu_trace_busy_ms: want a device and lane 0 (compute) or 1 (copy)");
}

/* The summary adds the bars up by name: two sleeps of 60 ms and one of 20. */
TEST(trace_summary_totals_time_by_operation) {
    mgpu_device *d[2];
    mgpu_devices(2, 0, d);
    mgpu_trace_begin();
    enqueue_sleep(d[0], 60);
    enqueue_sleep(d[1], 60);
    enqueue_sleep(d[1], 20);
    mgpu_trace_end();
    char text[4096] = {0};
    FILE *f = fmemopen(text, sizeof text - 1, "w");
    mgpu_trace_summary(f);
    fclose(f);
    const char *row = strstr(text, "\nsleep ");
    int calls = 0;
    double total = 0, mean = 0, share = 0;
    CHECK(row && sscanf(row, " sleep %d %lf %lf %lf%%", &calls, &total, &mean, &share) == 4);
    CHECK_EQ_INT(calls, 3);
    CHECK(total >= 139 && total < 200);       /* ms: 140 asked for, sleeps overrun a little */
    CHECK(fabs(mean - 1e3 * total / 3) < 0.5); /* us, from rounded figures */
    CHECK(share > 99.0);                       /* nothing else ran */
    CHECK(strstr(text, "operation") == text);
}

/* OpenBLAS's kernels: better ones asked for only where it took kernels
   without AVX2 and the processor has AVX2 and FMA (AVX-512: SkylakeX's);
   and on this machine the products run on kernels that fit the
   processor (the library restarts the program where they did not). */
TEST(blas_kernels_fit_the_processor) {
    CHECK(strcmp(mgpu__blas_better_core("Prescott", 1, 1), "SkylakeX") == 0);
    CHECK(strcmp(mgpu__blas_better_core("prescott", 1, 0), "Haswell") == 0);
    CHECK(strcmp(mgpu__blas_better_core("Sandybridge", 1, 0), "Haswell") == 0);
    CHECK(mgpu__blas_better_core("Prescott", 0, 0) == NULL); /* nothing better to run */
    CHECK(mgpu__blas_better_core("Haswell", 1, 1) == NULL);  /* AVX2 already */
    CHECK(mgpu__blas_better_core("SkylakeX", 1, 1) == NULL);
    CHECK(mgpu__blas_better_core("Zen", 1, 0) == NULL);
    CHECK(mgpu__blas_better_core(NULL, 1, 1) == NULL);
    /* (and which of its kernels run AVX-512, for the CPU's convolution rule) */
    CHECK(mgpu__blas_core_avx512("SkylakeX") && mgpu__blas_core_avx512("cooperlake") &&
          mgpu__blas_core_avx512("SapphireRapids"));
    CHECK(!mgpu__blas_core_avx512("Haswell") && !mgpu__blas_core_avx512("Zen") && !mgpu__blas_core_avx512(NULL));
#if defined(__x86_64__) && defined(__GNUC__) && defined(__GLIBC__)
    int avx2_fma, avx512;
    mgpu__processor_vectors(&avx2_fma, &avx512);
    const char *core = openblas_get_corename();
    if (!getenv("OPENBLAS_CORETYPE") && mgpu__blas_better_core(core, avx2_fma, avx512))
        fprintf(stderr, "  OpenBLAS runs %s's kernels on a processor with AVX2%s\n", core, avx512 ? " and AVX-512" : "");
    CHECK(getenv("OPENBLAS_CORETYPE") || !mgpu__blas_better_core(core, avx2_fma, avx512));
#endif
}

/* Batch norm forward and backward, then a convolution's im2col pass, on
   one CPU device: every output value, for the threads asked for; the
   convolution's (an OpenBLAS product) are the last *product_count. */
static float *cpu_kernels_outputs(int threads, size_t *count, size_t *product_count) {
    int saved = mgpu__cpu_threads;
    mgpu_device *cpu = mgpu_cpu();
    mgpu__cpu_threads = threads;
    mgpu_manual_seed(3);
    mgpu_shape s = mgpu_shape4(4, 8, 32, 32); /* 32768 values: past MGPU__PARALLEL_MIN */
    mgpu_tensor *x = mgpu_randn(cpu, s, 1.0f, 2.0f), *dy = mgpu_randn(cpu, s, 0.0f, 1.0f);
    mgpu_tensor *gamma = mgpu_randn(cpu, mgpu_shape1(8), 1.0f, 0.1f), *beta = mgpu_randn(cpu, mgpu_shape1(8), 0.0f, 0.1f);
    mgpu_tensor *stats[4], *y = mgpu_empty(cpu, s), *dx = mgpu_empty(cpu, s);
    for (int i = 0; i < 4; i++) stats[i] = mgpu_full(cpu, mgpu_shape1(8), i == 1 ? 1.0f : 0.0f);
    mgpu_tensor *dgamma = mgpu_empty(cpu, mgpu_shape1(8)), *dbeta = mgpu_empty(cpu, mgpu_shape1(8));
    mgpu_batchnorm2d_forward(y, x, gamma, beta, stats[0], stats[1], stats[2], stats[3], 1, 0.1f, 1e-5f, 1);
    mgpu_batchnorm2d_backward(dx, dgamma, dbeta, dy, x, gamma, beta, stats[2], stats[3], 1, 0);
    mgpu_tensor *w = mgpu_randn(cpu, mgpu_shape4(4, 8, 3, 3), 0.0f, 0.1f);
    mgpu_tensor *wide = mgpu_empty(cpu, mgpu_shape4(4, 4, 32, 32));
    mgpu__conv_geom g = mgpu__conv_geometry("test", s, w->shape, 1, 1);
    mgpu__conv_forward_im2col(wide, y, w, NULL, &g, 0);
    const mgpu_tensor *outs[] = {y, dx, dgamma, dbeta, stats[0], stats[1], wide};
    *product_count = wide->numel;
    size_t n = 0;
    for (int i = 0; i < 7; i++) n += outs[i]->numel;
    float *all = (float *)malloc(n * sizeof(float)), *at = all;
    for (int i = 0; i < 7; i++) {
        mgpu_to_host(outs[i], at);
        at += outs[i]->numel;
    }
    *count = n;
    mgpu_free(x), mgpu_free(dy), mgpu_free(gamma), mgpu_free(beta), mgpu_free(y), mgpu_free(dx);
    for (int i = 0; i < 4; i++) mgpu_free(stats[i]);
    mgpu_free(dgamma), mgpu_free(dbeta), mgpu_free(w), mgpu_free(wide);
    mgpu__cpu_threads = saved;
    return all;
}

#ifdef _OPENMP
/* How many threads a kernel's loop gets. */
typedef struct {
    int *team;
    size_t values;
} team_args;
static void team_task(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const team_args *a = (const team_args *)args;
    MGPU__CPU_PARALLEL_FOR(a->values)
    for (int i = 0; i < 8; i++)
        if (omp_get_thread_num() == 0) *a->team = omp_get_num_threads();
}
#endif

/* A process that a launcher started beside others on this machine,
   bound to no cores of its own, takes an even share of them (at least
   one); one bound to some keeps those. */
TEST(processes_started_together_share_the_cores) {
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    cpu_set_t set;
    CHECK(sched_getaffinity(0, sizeof set, &set) == 0);
    int unbound = CPU_COUNT(&set) >= online, alone = mgpu__cores();
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
    CHECK_EQ_INT(mgpu__cores(), unbound ? (alone / 2 > 1 ? alone / 2 : 1) : alone);
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "64", 1);
    CHECK_EQ_INT(mgpu__cores(), unbound ? 1 : alone);
    unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    CHECK_EQ_INT(mgpu__cores(), alone);
    CHECK_EQ_INT(mgpu_num_cores(), alone);
}

/* CPU devices share the cores, and a device's kernels run on its share
   (with OpenMP) with the same results as on one thread, bit for bit.
   OpenBLAS's products are not bit for bit on every processor: on a
   2-core AMD EPYC without AVX-512 (its Zen kernels) the convolution's
   product on 3 threads sums in another order than on 1, and is held to
   float's rounding instead. */
TEST(cpu_devices_run_their_kernels_on_their_share_of_the_cores) {
    int cores = mgpu__cores();
    mgpu_device *d[4];
    mgpu_devices(1, 0, d);
    CHECK_EQ_INT(mgpu__cpu_threads, cores);
    mgpu_devices(2, 0, d);
    CHECK_EQ_INT(mgpu__cpu_threads, cores >= 2 ? cores / 2 : 1);
#ifdef _OPENMP
    /* the team a kernel's loop gets on a device's queue: the share on the
       compute queue, one thread on the copy queue and for a small loop */
    int saved = mgpu__cpu_threads;
    mgpu__cpu_threads = 3;
    for (int lane = 0; lane < 2; lane++)
        for (size_t values = MGPU__PARALLEL_MIN - 1; values <= MGPU__PARALLEL_MIN; values++) {
            int team = 0;
            team_args a = {&team, values};
            mgpu__launch_on(&d[0]->queue[lane], "team", team_task, NULL, &a, sizeof a);
            mgpu_synchronize(d[0]);
            CHECK_EQ_INT(team, lane == 0 && values >= MGPU__PARALLEL_MIN ? 3 : 1);
        }
    mgpu__cpu_threads = saved;
#endif
    size_t n1, n3, product1, product3;
    float *one = cpu_kernels_outputs(1, &n1, &product1), *three = cpu_kernels_outputs(3, &n3, &product3);
    CHECK(n1 == n3 && product1 == product3);
    size_t own = n1 - product1;
    CHECK(memcmp(one, three, own * sizeof(float)) == 0);
    double worst = 0, largest = 1e-30; /* (against the largest value: sums of 72 terms of either sign) */
    for (size_t i = own; i < n1; i++) {
        worst = fmax(worst, fabs((double)one[i] - three[i]));
        largest = fmax(largest, fabs((double)one[i]));
    }
    CHECK_CLOSE(worst / largest, 0.0, 1e-6, 0);
    free(one);
    free(three);
    mgpu_devices(1, 0, d); /* (as the other tests expect) */
}

/* ---------------------------------------------------------------- flags */
/* One flag parsed as a program's extra flag: its value, or the run dies. */
static double parse_double_flag(char type, const char *text) {
    mgpu_options o;
    memset(&o, 0, sizeof o);
    o.out = "/tmp";
    double value = -1;
    const mgpu_flag extra[] = {{"--x", type, &value, "a number"}};
    char program[] = "test", name[] = "--x", given[64];
    snprintf(given, sizeof given, "%s", text);
    char *argv[] = {program, name, given};
    mgpu_options_parse(&o, 3, argv, "test", extra, 1);
    return value;
}

/* 'z' takes 0 and more, 'd' more than 0 only; both refuse in one line. */
TEST(double_flags_of_0_or_more_and_of_more_than_0) {
    CHECK(parse_double_flag('z', "0") == 0.0);
    CHECK(parse_double_flag('z', "0.9") == 0.9);
    CHECK(parse_double_flag('d', "0.9") == 0.9);
    EXPECT_DIES(parse_double_flag('z', "-0.5"), "mgpu: error: --x: expected a number of 0 or more, got '-0.5'\n");
    EXPECT_DIES(parse_double_flag('z', "nan"), "mgpu: error: --x: expected a number of 0 or more, got 'nan'\n");
    EXPECT_DIES(parse_double_flag('z', "1e-40"), "mgpu: error: --x: 1e-40 is out of float's range");
    EXPECT_DIES(parse_double_flag('z', "1e39"), "mgpu: error: --x: 1e39 is out of float's range");
    EXPECT_DIES(parse_double_flag('d', "0"), "mgpu: error: --x: expected a positive number, got '0'\n");
}

/* mgpu_malloc: what the host cannot give is one line, not NULL. */
TEST(host_allocations_that_fail_are_one_line_errors) {
    char *p = (char *)mgpu_malloc(100);
    memset(p, 1, 100);
    free(p);
    EXPECT_DIES(mgpu_malloc(SIZE_MAX / 2), "mgpu: error: out of host memory (asked for");
}

TEST_MAIN()
