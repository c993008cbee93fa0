/* tests/test.h: the smallest test harness that does the job.

   Each test file is one program. A test is a function registered with
   TEST(name); CHECK(...) and friends count failures inside it. main() is
   provided by TEST_MAIN() (TEST_MAIN_GPU(setup) for tests that need a
   GPU), which runs every test (or those whose name contains argv[1]) and
   prints one line per test and a last line
       test-summary: <passed> passed, <failed> failed
   that the Makefile adds up across all test programs.

   EXPECT_DIES(code, "text") runs `code` in a forked child and checks that
   it exits with a non-zero status and that its standard error contains
   "text": this is how the library's one-line fatal errors are tested. */
#ifndef MGPU_TEST_H
#define MGPU_TEST_H
/* tests/gpu_X.c includes tests/test_X.c with TEST_ON_GPU 1 to run the same
   tests on GPU devices (main() then skips them without a GPU). */
#ifndef TEST_ON_GPU
#define TEST_ON_GPU 0
#endif
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef void (*test__fn)(void);
typedef struct { const char *name; test__fn fn; int long_; } test__entry;
static test__entry test__table[512];
static int test__count;
static int test__failures; /* failures inside the running test */

#define TEST__REGISTER(test_name, is_long)                                 \
    static void test_##test_name(void);                                   \
    __attribute__((constructor)) static void test__register_##test_name(void) { \
        test__table[test__count].name = #test_name;                        \
        test__table[test__count].fn = test_##test_name;                    \
        test__table[test__count].long_ = is_long;                          \
        test__count++;                                                     \
    }                                                                      \
    static void test_##test_name(void)
#define TEST(test_name) TEST__REGISTER(test_name, 0)
/* A test that takes half a minute or more on emulated GPUs (tests/
   cuda_emu.h), a second or two elsewhere. Run by hand, a program runs it
   with the others; make test (TEST_SET=quick) leaves the emulated run to
   make test-long (TEST_SET=long), which CI runs too, so that make test
   fits in 10 minutes on 2 cores. */
#ifdef MGPU_CUDA_EMU
#define TEST_LONG(test_name) TEST__REGISTER(test_name, 1)
#else
#define TEST_LONG(test_name) TEST(test_name)
#endif

/* A test too slow for emulated GPUs (tests/cuda_emu.h runs every CUDA
   thread of a kernel in turn on one CPU core): it is left out of the
   emulated build and runs on real GPUs only (make test-gpu). */
#ifdef MGPU_CUDA_EMU
#define TEST_REAL_GPU(test_name) static __attribute__((unused)) void test_##test_name(void)
#else
#define TEST_REAL_GPU(test_name) TEST(test_name)
#endif
#define CHECK(cond)                                                          \
    do {                                                                     \
        if (!(cond)) {                                                       \
            fprintf(stderr, "  %s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, \
                    #cond);                                                  \
            test__failures++;                                                \
        }                                                                    \
    } while (0)

/* |got - want| <= atol + rtol * |want| */
#define CHECK_CLOSE(got, want, atol, rtol)                                    \
    do {                                                                      \
        double test__g = (double)(got), test__w = (double)(want);             \
        if (!(fabs(test__g - test__w) <= (atol) + (rtol) * fabs(test__w))) {  \
            fprintf(stderr, "  %s:%d: %s = %.9g, want %.9g (atol %g, rtol %g)\n", \
                    __FILE__, __LINE__, #got, test__g, test__w, (double)(atol), \
                    (double)(rtol));                                          \
            test__failures++;                                                 \
        }                                                                     \
    } while (0)

#define CHECK_EQ_INT(got, want)                                               \
    do {                                                                      \
        long long test__g = (long long)(got), test__w = (long long)(want);    \
        if (test__g != test__w) {                                             \
            fprintf(stderr, "  %s:%d: %s = %lld, want %lld\n", __FILE__,      \
                    __LINE__, #got, test__g, test__w);                        \
            test__failures++;                                                 \
        }                                                                     \
    } while (0)

/* Runs `code` in a child process; passes when the child exits non-zero
   (not by a signal: a crash is a failure) and its stderr contains `text`. */
/* The child starts with no work in flight: fork() copies only the calling
   thread, and work the library's queues still hold (waits for a GPU's
   events, above all: CUDA does not work across fork) is the parent's to
   finish, not a copy's. Without mgpu.h, nothing to wait for. */
#ifdef MGPU_H
#define TEST__NOTHING_IN_FLIGHT() mgpu_synchronize_all()
#else
#define TEST__NOTHING_IN_FLIGHT() ((void)0)
#endif
#define EXPECT_DIES(code, text)                                               \
    do {                                                                      \
        int test__pipe[2];                                                    \
        if (pipe(test__pipe) != 0) { perror("pipe"); exit(2); }               \
        TEST__NOTHING_IN_FLIGHT();                                            \
        fflush(stdout); fflush(stderr);                                       \
        pid_t test__pid = fork();                                             \
        if (test__pid == 0) {                                                 \
            close(test__pipe[0]);                                             \
            dup2(test__pipe[1], 2);                                           \
            { code; }                                                         \
            _exit(0);                                                         \
        }                                                                     \
        close(test__pipe[1]);                                                 \
        char test__err[4096]; size_t test__len = 0; ssize_t test__r;          \
        while ((test__r = read(test__pipe[0], test__err + test__len,          \
                               sizeof test__err - 1 - test__len)) > 0)        \
            test__len += (size_t)test__r;                                     \
        test__err[test__len] = 0;                                             \
        close(test__pipe[0]);                                                 \
        int test__status = 0;                                                 \
        waitpid(test__pid, &test__status, 0);                                 \
        if (!WIFEXITED(test__status) || WEXITSTATUS(test__status) == 0 ||     \
            !strstr(test__err, text)) {                                       \
            fprintf(stderr, "  %s:%d: expected `%s` to fail with \"%s\"; "    \
                    "%s %d, stderr: %s\n", __FILE__, __LINE__, #code, text,   \
                    WIFEXITED(test__status) ? "exit status" : "signal",       \
                    WIFEXITED(test__status) ? WEXITSTATUS(test__status)       \
                                            : WTERMSIG(test__status),         \
                    test__err);                                               \
            test__failures++;                                                 \
        }                                                                     \
    } while (0)

#ifdef MGPU_H
/* The tolerance of a comparison of sums that the library adds in one
   order on CPU devices and emulated GPUs (0: the same bits), and that
   NCCL adds in an order of its own on a real GPU (`on_nccl` there). */
#if TEST_ON_GPU && !defined(MGPU_CUDA_EMU)
#define TEST_EXACT_BUT_ON_NCCL(on_nccl) (on_nccl)
#else
#define TEST_EXACT_BUT_ON_NCCL(on_nccl) 0.0
#endif

/* The device a test runs on: GPU 0 with TEST_ON_GPU, else the CPU. */
static inline mgpu_device *test_device(void) { return TEST_ON_GPU ? mgpu_try_gpu(0) : mgpu_cpu(); }

/* A small network: a convolution (with batch norm after it, with_batchnorm
   1), ReLU, pooling, a strided convolution, ReLU, global pooling, linear;
   its parameters 30 times the library's initial ones, so that a few
   steps move them. */
static __attribute__((unused)) mgpu_net *test_plain_net(mgpu_device *d, uint64_t seed, int with_batchnorm) {
    mgpu_manual_seed(seed);
    mgpu_net *net = mgpu_net_new(d);
    mgpu_net_add_conv(net, 1, 6, 3, 1, 1);
    if (with_batchnorm) mgpu_net_add_batchnorm(net, 6);
    mgpu_net_add_relu(net);
    mgpu_net_add_avg_pool(net, 2);
    mgpu_net_add_conv(net, 6, 8, 3, 2, 1);
    mgpu_net_add_relu(net);
    mgpu_net_add_global_avg_pool(net);
    mgpu_net_add_linear(net, 8, 10);
    for (int i = 0; i < net->nparams; i++) mgpu_scale_(net->params[i]->value, 30.0f);
    return net;
}

/* max |a - b| / max |b| of two tensors of the same size. */
static __attribute__((unused)) double test_relative_diff(const mgpu_tensor *ta, const mgpu_tensor *tb) {
    float *va = (float *)malloc(ta->numel * sizeof(float)), *vb = (float *)malloc(tb->numel * sizeof(float));
    mgpu_to_host(ta, va);
    mgpu_to_host(tb, vb);
    double diff = 0, scale = 1e-30;
    for (size_t i = 0; i < ta->numel; i++) {
        diff = fmax(diff, fabs((double)va[i] - vb[i]));
        scale = fmax(scale, fabs((double)vb[i]));
    }
    free(va);
    free(vb);
    return diff / scale;
}
/* 1 when the two tensors hold the same bits. */
static __attribute__((unused)) int test_same_bits(const mgpu_tensor *a, const mgpu_tensor *b) {
    float *va = (float *)malloc(a->numel * sizeof(float)), *vb = (float *)malloc(b->numel * sizeof(float));
    mgpu_to_host(a, va);
    mgpu_to_host(b, vb);
    int same = a->numel == b->numel && memcmp(va, vb, a->numel * sizeof(float)) == 0;
    free(va);
    free(vb);
    return same;
}

/* Largest difference between two networks' parameters (with buffers 1,
   their buffers'), relative to each tensor's largest value: the largest
   test_relative_diff over the tensors. (It reads the parameters from the
   nets' structs: mgpu_net_param would mark a wrapped net as changed, and
   its wrapper would copy it again.) */
static __attribute__((unused)) double test_max_diff(const mgpu_net *a, const mgpu_net *b, int buffers) {
    double worst = 0;
    int n = buffers ? a->nbuffers : a->nparams;
    for (int i = 0; i < n; i++)
        worst = fmax(worst, buffers ? test_relative_diff(*a->buffers[i], *b->buffers[i])
                                    : test_relative_diff(a->params[i]->value, b->params[i]->value));
    return worst;
}
static __attribute__((unused)) double test_max_param_diff(const mgpu_net *a, const mgpu_net *b) {
    return test_max_diff(a, b, 0);
}

/* A ReLU of one's own (mgpu_net_add_layer) made of the library's
   operations, which then runs on any device. */
static void test_own_relu_forward(mgpu_layer *l, mgpu_tensor *y, const mgpu_tensor *x, int training) {
    (void)l;
    (void)training;
    mgpu_relu_forward(y, x);
}
static void test_own_relu_backward(mgpu_layer *l, mgpu_tensor *dx, mgpu_tensor *dweight, mgpu_tensor *dbias,
                                   const mgpu_tensor *dy, const mgpu_tensor *x, const mgpu_tensor *y) {
    (void)l;
    (void)dweight;
    (void)dbias;
    (void)x;
    mgpu_relu_backward(dx, dy, y); /* (a parameter-free layer is called only when dx is wanted) */
}
static __attribute__((unused)) const mgpu_layer_fns test_own_relu = {"own_relu", NULL, test_own_relu_forward,
                                                                     test_own_relu_backward, 0};

/* A layer of one's own that passes its input on and takes a fixed time:
   it sleeps *(double *)settings milliseconds forward, and as long again
   backward for each of its input's gradient and its weight's (which it
   leaves alone), so that pipeline stages made of it are equal whatever
   else the machine runs (CPU devices: its loops are its own). Its
   backward can split (l->split_backward: a zero-bubble pipeline's B and
   W, each one unit; two units together). Give it a weight of one value, and put it after a
   layer, so that it has both parts to run: a network's first layer has
   no input gradient to compute. */
static void test_sleep_ms(double ms) {
    struct timespec t = {(time_t)(ms / 1e3), (long)(fmod(ms, 1e3) * 1e6)};
    nanosleep(&t, NULL);
}
static void test_timed_forward(mgpu_layer *l, mgpu_tensor *y, const mgpu_tensor *x, int training) {
    (void)training;
    memcpy(y->data, x->data, x->numel * sizeof(float));
    test_sleep_ms(*(const double *)l->settings);
}
static void test_timed_backward(mgpu_layer *l, mgpu_tensor *dx, mgpu_tensor *dweight, mgpu_tensor *dbias,
                                const mgpu_tensor *dy, const mgpu_tensor *x, const mgpu_tensor *y) {
    (void)dbias, (void)x, (void)y;
    if (dx) memcpy(dx->data, dy->data, dy->numel * sizeof(float));
    test_sleep_ms((double)((dx != NULL) + (dweight != NULL)) * *(const double *)l->settings);
}
static __attribute__((unused)) const mgpu_layer_fns test_timed_layer = {"timed", NULL, test_timed_forward,
                                                                        test_timed_backward, 1};
/* Equal pipeline stages of timed layers (*ms each; read as they run, so
   the caller may lengthen them): a first layer of no duration and no
   parameters (which has no backward pass to run), then two timed layers
   a stage; first[s], stage s's first layer, for mgpu_pipeline_new. */
static __attribute__((unused)) mgpu_net *test_timed_net(int stages, double *ms, int *first) {
    static double no_time = 0.0;
    mgpu_net *net = mgpu_net_new(mgpu_cpu());
    mgpu_net_add_layer(net, &test_timed_layer, NULL, NULL, &no_time);
    for (int i = 0; i < 2 * stages; i++)
        mgpu_net_add_layer(net, &test_timed_layer, mgpu_zeros(mgpu_cpu(), mgpu_shape1(1)), NULL, ms)
            ->split_backward = 1;
    for (int s = 0; s < stages; s++) first[s] = s == 0 ? 0 : 2 * s + 1;
    return net;
}
#endif

/* Runs the registered tests (those whose name contains argv[1] when given). */
/* The tests compare with float32 (or double) references at float32
   tolerances, so on a GPU they switch TF32 off (mgpu_set_tf32); the TF32
   products are checked on their own, in tests/gpu_layers.c. */
/* A program of several processes (tests/dist_tests.c) sets these: a
   test's failures are added up over the processes, and one prints. */
static int (*test__combine)(int failures);
static int test__prints = 1;
static int test__run_all(int argc, char **argv) {
    int passed = 0, failed = 0;
#ifdef MGPU_H /* tests/emu_kernels.cpp runs the kernels without the library */
    mgpu_set_tf32(0, 0);
#endif
    /* TEST_SET: unset, every test; quick, those not marked TEST_LONG;
       long, those alone. TEST_TIMES=1 adds each test's seconds to its
       line (to find the long ones). */
    const char *set = getenv("TEST_SET");
    int want_long = set && strcmp(set, "long") == 0, want_quick = set && strcmp(set, "quick") == 0;
    if (set && *set && !want_long && !want_quick) {
        fprintf(stderr, "TEST_SET=%s: want quick or long (or unset: every test)\n", set);
        return 2;
    }
    int times = getenv("TEST_TIMES") && strcmp(getenv("TEST_TIMES"), "1") == 0;
    for (int i = 0; i < test__count; i++) {
        if (argc > 1 && !strstr(test__table[i].name, argv[1])) continue;
        if ((want_long && !test__table[i].long_) || (want_quick && test__table[i].long_)) continue;
        test__failures = 0;
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        test__table[i].fn();
        clock_gettime(CLOCK_MONOTONIC, &t1);
        if (test__combine) test__failures = test__combine(test__failures);
        if (test__prints) {
            printf("%s %s", test__failures ? "FAIL" : "ok  ", test__table[i].name);
            if (times) printf(" (%.1f s)", (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
            printf("\n");
        }
        fflush(stdout);
        if (test__failures) failed++; else passed++;
    }
    if (test__prints) printf("test-summary: %d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}

#if TEST_ON_GPU
#define TEST_MAIN() TEST_MAIN_GPU((void)0)
#else
#define TEST_MAIN() \
    int main(int argc, char **argv) { return test__run_all(argc, argv); }
#endif

/* For the CUDA-against-CPU tests: without a GPU there is nothing to
   compare, so say so and pass; `setup` runs first when there is one. */
#define TEST_MAIN_GPU(setup)                                                  \
    int main(int argc, char **argv) {                                         \
        if (mgpu_num_gpus() == 0) {                                           \
            printf("skipped: no GPU\ntest-summary: 0 passed, 0 failed\n");    \
            return 0;                                                         \
        }                                                                     \
        setup;                                                                \
        return test__run_all(argc, argv);                                     \
    }

#endif
