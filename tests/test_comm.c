/* tests/test_comm.c: communication between devices.

   Every allreduce (the book's, the ring, the automatic choice) against a
   sum in double precision, for 1 to 8 devices and lengths 1, 7, k-1, k+1,
   a prime and a large one, summing and averaging; the devices' results
   must be bitwise identical to each other. Then the ordering of the ring
   with the compute queues, get_params, scatter and split_batch, and the
   one-line errors.

   The inputs are not exactly representable and mix signs and sizes, so a
   float sum rounds at almost every element. Summing k floats in any order
   is off by at most (k-1) roundings of at most 2^-24 times the sum of the
   magnitudes; the tolerance is k * 2^-24 * sum_i |x_i| (divided by k for
   the average, whose scaling adds one more rounding).

   tests/gpu_comm.c includes this file with TEST_ON_GPU 1: the same
   tests then run on GPU logical devices (virtual ones on one GPU). */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"
#include "test.h"

#define MAX_K 8

/* Element j of device i's input. */
static float input_value(int i, size_t j) {
    return (float)(sin(0.37 * (double)j + 1.3 * (double)i) * (1.0 + 0.25 * (double)i) + 0.1 / (double)(j % 7 + 1));
}

static mgpu_tensor *input_on(mgpu_device *dev, int i, size_t len, float scale) {
    float *v = (float *)malloc(len * sizeof(float));
    for (size_t j = 0; j < len; j++) v[j] = scale * input_value(i, j);
    mgpu_tensor *t = mgpu_from_host(dev, mgpu_shape1((int)len), v);
    free(v);
    return t;
}

/* An allreduce under test; returns the name of the algorithm it used, or NULL. */
typedef const char *(*allreduce_fn)(mgpu_tensor **data, int k, int average);
static const char *run_book(mgpu_tensor **data, int k, int average) {
    (void)average; /* the book's version only sums */
    mgpu_allreduce(data, k);
    return NULL;
}
static const char *run_ring(mgpu_tensor **data, int k, int average) {
    mgpu_ring_allreduce(data, k, average);
    return NULL;
}
static const char *run_auto(mgpu_tensor **data, int k, int average) {
    return mgpu_allreduce_auto(data, k, average);
}

/* Checks that every device holds `factor` times the sum (or average) of
   the inputs, and that the devices agree bit for bit. */
static void check_result(mgpu_tensor **data, int k, size_t len, int average, double factor,
                         const char *what) {
    float *first = (float *)malloc(len * sizeof(float));
    float *other = (float *)malloc(len * sizeof(float));
    mgpu_to_host(data[0], first);
    size_t bad = 0, first_bad = 0;
    double bad_got = 0, bad_want = 0;
    for (size_t j = 0; j < len; j++) {
        double want = 0, magnitude = 0;
        for (int i = 0; i < k; i++) {
            want += (double)input_value(i, j);
            magnitude += fabs((double)input_value(i, j));
        }
        double tol = (double)k * ldexp(1.0, -24) * magnitude;
        if (average) {
            want /= k;
            tol /= k;
        }
        want *= factor;
        tol *= factor;
        if (!(fabs((double)first[j] - want) <= tol)) {
            if (!bad++) { first_bad = j; bad_got = first[j]; bad_want = want; }
        }
    }
    if (bad)
        fprintf(stderr, "  %s: %zu of %zu elements wrong; element %zu is %.9g, want %.9g\n", what, bad,
                len, first_bad, bad_got, bad_want);
    CHECK(bad == 0);
    for (int i = 1; i < k; i++) {
        mgpu_to_host(data[i], other);
        if (memcmp(first, other, len * sizeof(float)) != 0) {
            fprintf(stderr, "  %s: device %d's result differs from device 0's\n", what, i);
            CHECK(0);
        }
    }
    free(first);
    free(other);
}

static void check_allreduce(allreduce_fn run, const char *name, int k, size_t len, int average) {
    mgpu_device *dev[MAX_K];
    mgpu_tensor *data[MAX_K];
    mgpu_devices(k, TEST_ON_GPU, dev);
    for (int i = 0; i < k; i++) data[i] = input_on(dev[i], i, len, 1.0f);
    run(data, k, average);
    char what[128];
    snprintf(what, sizeof what, "%s, %d devices, length %zu, %s", name, k, len, average ? "average" : "sum");
    check_result(data, k, len, average, 1.0, what);
    for (int i = 0; i < k; i++) mgpu_free(data[i]);
}

/* Lengths 1, 7, k-1 (when there is such a vector), k+1, a prime, a large one. */
static void check_every_size(allreduce_fn run, const char *name, int with_average) {
    for (int k = 1; k <= MAX_K; k++) {
        size_t lengths[] = {1, 7, (size_t)k - 1, (size_t)k + 1, 1009, (size_t)1 << 18};
        for (size_t l = 0; l < sizeof lengths / sizeof lengths[0]; l++) {
            if (lengths[l] == 0) continue;
            for (int average = 0; average <= with_average; average++)
                check_allreduce(run, name, k, lengths[l], average);
        }
    }
}

TEST(book_allreduce_sums_on_every_device) { check_every_size(run_book, "mgpu_allreduce", 0); }
TEST(ring_allreduce_sums_and_averages) { check_every_size(run_ring, "mgpu_ring_allreduce", 1); }
TEST(auto_allreduce_sums_and_averages) { check_every_size(run_auto, "mgpu_allreduce_auto", 1); }

/* The tolerance is not idle: with these inputs the float sums of 8
   devices differ from the correctly rounded sum at many elements. */
TEST(float_rounding_is_visible) {
    enum { K = 8, LEN = 1009 };
    mgpu_device *dev[K];
    mgpu_tensor *data[K];
    float got[LEN];
    mgpu_devices(K, TEST_ON_GPU, dev);
    for (int i = 0; i < K; i++) data[i] = input_on(dev[i], i, LEN, 1.0f);
    mgpu_ring_allreduce(data, K, 0);
    mgpu_to_host(data[0], got);
    int rounded = 0;
    for (size_t j = 0; j < LEN; j++) {
        double want = 0;
        for (int i = 0; i < K; i++) want += (double)input_value(i, j);
        rounded += got[j] != (float)want;
    }
    CHECK(rounded > LEN / 10);
    for (int i = 0; i < K; i++) mgpu_free(data[i]);
}

/* NCCL for distinct GPUs, the ring for virtual devices or CPU devices,
   nothing for one device. */
TEST(auto_allreduce_names_its_algorithm) {
    for (int k = 1; k <= MAX_K; k++) {
        mgpu_device *dev[MAX_K];
        mgpu_tensor *data[MAX_K];
        mgpu_devices(k, TEST_ON_GPU, dev);
        for (int i = 0; i < k; i++) data[i] = mgpu_ones(dev[i], mgpu_shape1(5));
        const char *want = k == 1 ? "none" : TEST_ON_GPU && k <= mgpu_num_gpus() ? "nccl" : "ring";
        const char *got = mgpu_allreduce_auto(data, k, 0);
        if (strcmp(got, want) != 0) fprintf(stderr, "  %d devices: got %s, want %s\n", k, got, want);
        CHECK(strcmp(got, want) == 0);
        CHECK_CLOSE(mgpu_item(data[k - 1], 4), k, 0, 0);
        for (int i = 0; i < k; i++) mgpu_free(data[i]);
    }
}

/* The inputs are still being computed when the allreduce is enqueued
   (after a slow product, each device doubles its half-sized input), and
   each device doubles its result as soon as the allreduce is enqueued,
   while another device may still be reading it. The allreduce must wait
   for the first and the second must wait for the allreduce. Doubling is
   exact, so the result is exactly twice the sum. */
static void check_ordered_with_compute(allreduce_fn run, const char *name) {
    enum { K = 4 };
    size_t len = (size_t)1 << 18;
    mgpu_device *dev[K];
    mgpu_tensor *data[K];
    mgpu_devices(K, TEST_ON_GPU, dev);
    for (int trial = 0; trial < 3; trial++) {
        for (int i = 0; i < K; i++) {
            data[i] = input_on(dev[i], i, len, 0.5f);
            mgpu_tensor *a = mgpu_ones(dev[i], mgpu_shape2(300, 300));
            mgpu_free(mgpu_mm(a, a));
            mgpu_free(a);
            mgpu_add_(data[i], data[i]);
        }
        run(data, K, 0);
        for (int i = 0; i < K; i++) mgpu_scale_(data[i], 2.0f);
        check_result(data, K, len, 0, 2.0, name);
        for (int i = 0; i < K; i++) mgpu_free(data[i]);
    }
}
TEST(allreduce_is_ordered_with_compute) {
    check_ordered_with_compute(run_book, "mgpu_allreduce between compute");
    check_ordered_with_compute(run_ring, "mgpu_ring_allreduce between compute");
    check_ordered_with_compute(run_auto, "mgpu_allreduce_auto between compute");
}

/* mgpu_allreduce_start leaves the compute queues free: work enqueued on
   them before mgpu_comm_wait runs meanwhile; after it, the sums are there.
   Twice: with receive buffers from the allocator, then with our own
   (used for two reductions in a row). */
TEST(allreduce_start_lets_compute_go_on) {
    enum { K = 3 };
    size_t len = 100003;
    mgpu_device *dev[K];
    mgpu_tensor *data[K], *other[K], *scratch[K];
    mgpu_devices(K, TEST_ON_GPU, dev);
    for (int i = 0; i < K; i++) scratch[i] = mgpu_empty(dev[i], mgpu_shape1((int)((len + K - 1) / K)));
    for (int own = 0; own <= 1; own++) {
        for (int round = 0; round < 1 + own; round++) {
            for (int i = 0; i < K; i++) data[i] = input_on(dev[i], i, len, 1.0f);
            const char *algorithm = mgpu_allreduce_start(data, K, 1, own ? scratch : NULL);
            CHECK(strcmp(algorithm, TEST_ON_GPU && K <= mgpu_num_gpus() ? "nccl" : "ring") == 0);
            for (int i = 0; i < K; i++) other[i] = mgpu_full(dev[i], mgpu_shape1(1000), (float)i);
            mgpu_comm_wait(dev, K);
            check_result(data, K, len, 1, 1.0, own ? "mgpu_allreduce_start, own scratch" : "mgpu_allreduce_start");
            for (int i = 0; i < K; i++) {
                CHECK_CLOSE(mgpu_item(other[i], 999), i, 0, 0);
                mgpu_free(data[i]);
                mgpu_free(other[i]);
            }
        }
    }
    for (int i = 0; i < K; i++) mgpu_free(scratch[i]);
}

/* A tensor freed while an allreduce still uses it (before mgpu_comm_wait)
   goes back to the cache marked in use: a new tensor does not get its
   memory, and overwrite the vector, before the reduction is done. */
TEST(a_tensor_freed_under_its_allreduce_is_not_reused_too_early) {
    mgpu_device *dev[2];
    mgpu_devices(2, TEST_ON_GPU, dev);
    enum { N = 1 << 20 };
    for (int run = 0; run < 3; run++) {
        mgpu_tensor *data[2] = {mgpu_full(dev[0], mgpu_shape1(N), 1.0f), mgpu_full(dev[1], mgpu_shape1(N), 2.0f)};
        mgpu_allreduce_start(data, 2, 0, NULL);
        mgpu_free(data[0]);
        mgpu_tensor *other = mgpu_full(dev[0], mgpu_shape1(N), 7.0f); /* the freed block's size */
        mgpu_comm_wait(dev, 2);
        CHECK_CLOSE(mgpu_item(data[1], N - 1), 3.0, 0, 0);
        CHECK_CLOSE(mgpu_item(other, 0), 7.0, 0, 0);
        mgpu_free(other);
        mgpu_free(data[1]);
    }
}

TEST(too_small_scratch_is_an_error) {
    mgpu_device *dev[2];
    mgpu_devices(2, TEST_ON_GPU, dev);
    mgpu_tensor *data[2] = {mgpu_zeros(dev[0], mgpu_shape1(9)), mgpu_zeros(dev[1], mgpu_shape1(9))};
    mgpu_tensor *scratch[2] = {mgpu_zeros(dev[0], mgpu_shape1(5)), mgpu_zeros(dev[1], mgpu_shape1(4))};
    char want[200];
    snprintf(want, sizeof want, "mgpu: error: mgpu_allreduce_start: scratch[1] must hold at least 5 elements on %s\n",
             mgpu_device_name(dev[1]));
    /* (checked where NCCL runs too, which needs no scratch: a call is
       right or wrong the same on every kind of device) */
    EXPECT_DIES(mgpu_allreduce_start(data, 2, 0, scratch), want);
    EXPECT_DIES(mgpu_allreduce_start(data, 2, 0, data), "mgpu_allreduce_start: the output and an input share memory");
    for (int i = 0; i < 2; i++) {
        mgpu_free(data[i]);
        mgpu_free(scratch[i]);
    }
}

TEST(get_params_copies_values_and_zero_grads) {
    mgpu_device *dev[2];
    mgpu_devices(2, TEST_ON_GPU, dev);
    mgpu_tensor *params[2] = {mgpu_arange(mgpu_cpu(), mgpu_shape2(2, 3)),
                              mgpu_full(mgpu_cpu(), mgpu_shape1(4), 0.5f)};
    mgpu_param p[2];
    mgpu_get_params(p, params, 2, dev[1]);
    for (int k = 0; k < 2; k++) {
        CHECK(p[k].value->device == dev[1]);
        CHECK(p[k].grad->device == dev[1]);
        CHECK(mgpu_shape_equal(p[k].value->shape, params[k]->shape));
        CHECK(mgpu_shape_equal(p[k].grad->shape, params[k]->shape));
        for (size_t j = 0; j < params[k]->numel; j++) {
            CHECK_CLOSE(mgpu_item(p[k].value, j), mgpu_item(params[k], j), 0, 0);
            CHECK_CLOSE(mgpu_item(p[k].grad, j), 0, 0, 0);
        }
    }
    mgpu_params_free(p, 2);
    CHECK(p[0].value == NULL && p[1].grad == NULL);
    mgpu_free(params[0]);
    mgpu_free(params[1]);
}

/* out[i] holds rows first.. of the arange x, on devices[i]. */
static void check_rows(mgpu_tensor *out, mgpu_device *dev, int first, int rows, int cols) {
    CHECK(out->device == dev);
    CHECK_EQ_INT(out->shape.d[0], rows);
    CHECK_EQ_INT(out->shape.d[1], cols);
    for (int j = 0; j < rows * cols; j++) CHECK_CLOSE(mgpu_item(out, (size_t)j), first * cols + j, 0, 0);
}

/* Scatters a rows x cols arange onto 2 devices; the first gets `first` rows. */
static void check_scatter_onto_2(int rows, int cols, int first) {
    mgpu_device *dev[2];
    mgpu_devices(2, TEST_ON_GPU, dev);
    mgpu_tensor *x = mgpu_arange(mgpu_cpu(), mgpu_shape2(rows, cols)), *out[2];
    mgpu_scatter(x, dev, 2, out);
    check_rows(out[0], dev[0], 0, first, cols);
    check_rows(out[1], dev[1], first, rows - first, cols);
    for (int i = 0; i < 2; i++) mgpu_free(out[i]);
    mgpu_free(x);
}

TEST(scatter_4x5_onto_2_devices) { check_scatter_onto_2(4, 5, 2); }
TEST(scatter_5_rows_gives_3_and_2) { check_scatter_onto_2(5, 3, 3); }

/* PyTorch's chunks of ceil(4/3) = 2 rows are 2, 2 and nothing: two
   devices get rows, the third none. */
TEST(scatter_of_4_rows_onto_3_devices_uses_2) {
    mgpu_device *dev[3];
    mgpu_devices(3, TEST_ON_GPU, dev);
    mgpu_tensor *x = mgpu_arange(mgpu_cpu(), mgpu_shape2(4, 5)), *out[3];
    out[2] = x; /* to see it set to NULL */
    CHECK_EQ_INT(mgpu_scatter(x, dev, 3, out), 2);
    check_rows(out[0], dev[0], 0, 2, 5);
    check_rows(out[1], dev[1], 2, 2, 5);
    CHECK(out[2] == NULL);
    mgpu_free(out[0]);
    mgpu_free(out[1]);
    mgpu_tensor *none = mgpu_zeros(mgpu_cpu(), mgpu_shape2(0, 5));
    EXPECT_DIES(mgpu_scatter(none, dev, 3, out),
                "mgpu: error: mgpu_scatter: x (shape [0, 5]) has no rows to split\n");
    mgpu_free(none);
    mgpu_free(x);
}

TEST(split_batch_splits_images_and_labels) {
    mgpu_device *dev[2];
    mgpu_devices(2, TEST_ON_GPU, dev);
    mgpu_tensor *X = mgpu_arange(mgpu_cpu(), mgpu_shape2(5, 4)), *y = mgpu_arange(mgpu_cpu(), mgpu_shape2(5, 1));
    mgpu_tensor *Xs[2], *ys[2];
    CHECK_EQ_INT(mgpu_split_batch(X, y, dev, 2, Xs, ys), 2);
    check_rows(Xs[0], dev[0], 0, 3, 4);
    check_rows(Xs[1], dev[1], 3, 2, 4);
    check_rows(ys[0], dev[0], 0, 3, 1);
    check_rows(ys[1], dev[1], 3, 2, 1);
    for (int i = 0; i < 2; i++) {
        mgpu_free(Xs[i]);
        mgpu_free(ys[i]);
    }
    mgpu_free(X);
    mgpu_free(y);
}

TEST(split_batch_row_mismatch_is_an_error) {
    mgpu_device *dev[2];
    mgpu_devices(2, TEST_ON_GPU, dev);
    mgpu_tensor *X = mgpu_zeros(mgpu_cpu(), mgpu_shape2(4, 5)), *y = mgpu_zeros(mgpu_cpu(), mgpu_shape1(3));
    mgpu_tensor *Xs[2], *ys[2];
    EXPECT_DIES(mgpu_split_batch(X, y, dev, 2, Xs, ys),
                "mgpu: error: mgpu_split_batch: X has 4 rows (shape [4, 5]) but y has 3 (shape [3])\n");
    mgpu_free(X);
    mgpu_free(y);
}

TEST(allreduce_of_different_shapes_is_an_error) {
    mgpu_device *dev[2];
    mgpu_devices(2, TEST_ON_GPU, dev);
    mgpu_tensor *data[2] = {mgpu_zeros(dev[0], mgpu_shape1(3)), mgpu_zeros(dev[1], mgpu_shape1(4))};
    EXPECT_DIES(mgpu_ring_allreduce(data, 2, 0), "mgpu: error: mgpu_ring_allreduce: shapes [4] and [3] differ\n");
    EXPECT_DIES(mgpu_allreduce(data, 2), "mgpu: error: mgpu_allreduce: shapes [4] and [3] differ\n");
    EXPECT_DIES(mgpu_allreduce_auto(data, 2, 0), "mgpu: error: mgpu_allreduce_auto: shapes [4] and [3] differ\n");
    mgpu_free(data[0]);
    mgpu_free(data[1]);
}

/* NCCL needs distinct GPUs: CPU devices (and virtual devices) get NULL. */
TEST(nccl_init_gives_null_without_distinct_gpus) {
    mgpu_device *dev[2];
    mgpu_devices(2, 0, dev);
    CHECK(mgpu_nccl_init(dev, 2) == NULL);
    if (mgpu_num_gpus() > 0 && mgpu_num_gpus() < MGPU_MAX_DEVICES) {
        mgpu_device *virt[MGPU_MAX_DEVICES];
        int n = mgpu_num_gpus() + 1; /* one GPU twice */
        mgpu_devices(n, 1, virt);
        CHECK(mgpu_nccl_init(virt, n) == NULL);
    }
}

#if !TEST_ON_GPU
TEST_MAIN()
#endif
