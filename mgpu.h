/* mgpu.h: multi-GPU deep learning in C, from the ground up.

   A single-header teaching library (stb style). In exactly ONE source file:

       #define MGPU_IMPLEMENTATION
       #include "mgpu.h"

   and plain `#include "mgpu.h"` everywhere else. Build with gcc as C11 for
   the CPU backend, or with nvcc (as CUDA C++) for the CPU and CUDA backends.
   The CUDA kernels live in kernels/, one file per family of operations;
   the implementation includes them (each kernel file holds the CPU
   reference of its operations beside their CUDA versions).
   Link with: -lopenblas -lstb -lz -lpthread -lm, and with nvcc also
   -lcublas (and -lnccl for the NCCL functions).

   ======================================================================
   THE MANUAL
   ======================================================================

   1. Devices are queues
   ---------------------
   A device (mgpu_device) runs the operations you give it in order, and
   asynchronously to your program: calling mgpu_relu(...) only *enqueues*
   the work and returns at once. Each device has two queues: a compute
   queue for operations and a copy queue for transfers between devices, so
   copies can overlap compute. On a GPU the queues are CUDA streams; on the
   CPU each queue is a worker thread. mgpu_synchronize(dev) waits until a
   device has finished everything enqueued so far; mgpu_synchronize_all()
   waits for every device.

       int mgpu_num_gpus(void);              physical GPUs visible (0 without a GPU)
       mgpu_device *mgpu_cpu(void);          the CPU device "cpu" (also the host)
       mgpu_device *mgpu_try_gpu(int i);     GPU i if there is one, else the CPU
       int mgpu_try_all_gpus(mgpu_device **out, int max);  all GPUs, or [cpu]
       int mgpu_devices(int n, int use_gpu, mgpu_device **out);

   mgpu_devices asks for n *logical* devices: the physical GPUs first, then
   virtual devices past them. A virtual device has its own queues and its
   own memory but shares a GPU ("cuda:0#1" is the second device on GPU 0)
   or the CPU ("cpu#1"). Everything works the same on virtual devices, so
   a program written for 4 GPUs runs on one GPU, or on none. With use_gpu 0
   (the --cpu flag) all devices are CPU devices.

       const char *mgpu_device_name(const mgpu_device *d);   "cuda:0", "cpu#1"
       int mgpu_device_is_gpu(const mgpu_device *d);
       void mgpu_synchronize(mgpu_device *d);  void mgpu_synchronize_all(void);
       size_t mgpu_device_memory_in_use(const mgpu_device *d);   bytes held by tensors
       size_t mgpu_device_memory_peak(const mgpu_device *d);

   2. Events and timers
   --------------------
       mgpu_event *mgpu_event_new(void);      void mgpu_event_free(mgpu_event*);
       void mgpu_event_record(mgpu_event *e, mgpu_device *d);  marks "now" in d's compute queue
       void mgpu_event_wait(mgpu_device *d, mgpu_event *e);    d's queue waits for e
       void mgpu_event_synchronize(mgpu_event *e);            the host waits for e
       double mgpu_event_elapsed_ms(mgpu_event *a, mgpu_event *b);

       mgpu_timer t; mgpu_timer_init(&t); mgpu_timer_start(&t); ... mgpu_timer_stop(&t);
       mgpu_timer_avg(&t), mgpu_timer_sum(&t), mgpu_timer_cumsum(&t, i)  (seconds)

       MGPU_BENCHMARK("GPU1 time") { run(x); }
   runs the block, synchronises every device and prints "GPU1 time: 0.5620 sec".

   3. Tensors
   ----------
   float32, up to 4 dimensions, living on one device. A tensor is freed with
   mgpu_free; memory goes back to the device's caching allocator, so a
   training step allocates nothing new after the first.

       mgpu_shape mgpu_shape1(a) ... mgpu_shape4(a, b, c, d)
       mgpu_tensor *mgpu_empty(dev, shape)   mgpu_zeros  mgpu_ones  mgpu_full(dev, shape, v)
       mgpu_tensor *mgpu_rand(dev, shape)    uniform [0, 1)   (the generator: section 5)
       mgpu_tensor *mgpu_rand_uniform(dev, shape, low, high)
       mgpu_tensor *mgpu_randn(dev, shape, mean, std)
       mgpu_tensor *mgpu_arange(dev, shape)  0, 1, 2, ... in row-major order
       mgpu_tensor *mgpu_empty_pinned(shape) host tensor in page-locked memory
       mgpu_tensor *mgpu_from_host(dev, shape, const float *values)  (blocking)
       void mgpu_to_host(const mgpu_tensor *t, float *out)            (blocking)
       mgpu_tensor *mgpu_to(const mgpu_tensor *t, mgpu_device *dev, int non_blocking)
       void mgpu_copy(mgpu_tensor *dst, const mgpu_tensor *src, int non_blocking)
       mgpu_tensor *mgpu_view(t, shape)   same memory, new shape (same numel)
       mgpu_tensor *mgpu_ensure(&slot, dev, shape)  reuse *slot if it has that shape
       mgpu_tensor *mgpu_narrow(t, start, length)  rows start.. of dimension 0 (a view)
       void mgpu_print(const char *label, const mgpu_tensor *t)
       void mgpu_free(mgpu_tensor *t)

   A copy runs on a copy queue: it starts when the source's device has
   finished what was enqueued before it, and the destination's device will
   not use the result before the copy is done. A blocking copy also makes
   the host wait for it; a non-blocking one returns at once (copy into
   pinned host memory for it to overlap compute on a GPU).

   4. Operations
   -------------
       void mgpu_matmul(mgpu_tensor *c, const mgpu_tensor *a, const mgpu_tensor *b)   c = a b
       mgpu_tensor *mgpu_mm(const mgpu_tensor *a, const mgpu_tensor *b)               new c
       void mgpu_fill(t, v)   void mgpu_add_(y, x)  (y += x)   void mgpu_scale_(y, s)
   Cuda uses cuBLAS, the CPU OpenBLAS (through cblas). Shapes are checked;
   a mismatch is a one-line error naming both shapes.

   5. Random numbers
   -----------------
   A counter-based generator (Philox4x32-10): the i-th number of a draw
   depends only on the seed, the draw's offset and i, so a seed gives the
   same tensors on the CPU and on a GPU.
       void mgpu_manual_seed(uint64_t seed);

   6. Tracing
   ----------
       mgpu_trace_begin();  ... work ...;  mgpu_trace_end();
       mgpu_trace_write_png("timeline.png", "title");
   records every operation and copy (device, queue, name, start, end) and
   draws one lane per device queue, so overlap can be seen.

   7. Errors
   ---------
   Every CUDA, cuBLAS, NCCL, MPI and file call is checked; a failure prints
   one line "mgpu: error: <file>:<line>: <what> (<hint>)" and exits with
   status 1. Bad arguments (shapes, device indices) are reported the same way.

   ====================================================================== */
#ifndef MGPU_H
#define MGPU_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifndef MGPU_DEF
#define MGPU_DEF extern
#endif

#ifdef __CUDACC__
#define MGPU_CUDA 1
#else
#define MGPU_CUDA 0
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- errors */
#if defined(__GNUC__)
#define MGPU__PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define MGPU__PRINTF(a, b)
#endif
/* Prints "mgpu: error: <message>" as one line and exits with status 1. */
MGPU_DEF void mgpu_fatal(const char *fmt, ...) MGPU__PRINTF(1, 2);
/* The same, with the source location first. */
MGPU_DEF void mgpu_fatal_at(const char *file, int line, const char *fmt, ...)
    MGPU__PRINTF(3, 4);
/* Checks a condition that depends on the caller's arguments. */
#define MGPU_REQUIRE(cond, ...) \
    do { if (!(cond)) mgpu_fatal(__VA_ARGS__); } while (0)

/* --------------------------------------------------------------- devices */
typedef struct mgpu_device mgpu_device;
typedef struct mgpu_event mgpu_event;

#define MGPU_MAX_DEVICES 16

MGPU_DEF int mgpu_num_gpus(void);
MGPU_DEF mgpu_device *mgpu_cpu(void);
MGPU_DEF mgpu_device *mgpu_try_gpu(int i);
MGPU_DEF int mgpu_try_all_gpus(mgpu_device **out, int max);
MGPU_DEF int mgpu_devices(int n, int use_gpu, mgpu_device **out);
MGPU_DEF const char *mgpu_device_name(const mgpu_device *d);
MGPU_DEF int mgpu_device_is_gpu(const mgpu_device *d);
MGPU_DEF int mgpu_device_gpu_index(const mgpu_device *d); /* -1 on the CPU */
MGPU_DEF void mgpu_synchronize(mgpu_device *d);
MGPU_DEF void mgpu_synchronize_all(void);
MGPU_DEF size_t mgpu_device_memory_in_use(const mgpu_device *d);
MGPU_DEF size_t mgpu_device_memory_peak(const mgpu_device *d);
MGPU_DEF void mgpu_device_reset_peak(mgpu_device *d);
/* Writes a comma-separated list of names, "[cuda:0, cuda:0#1]", into buf. */
MGPU_DEF const char *mgpu_device_list(char *buf, size_t size, mgpu_device *const *devices, int n);
/* Stops the worker threads and frees every cached block (also at exit). */
MGPU_DEF void mgpu_shutdown(void);

/* ---------------------------------------------------------------- events */
MGPU_DEF mgpu_event *mgpu_event_new(void);
MGPU_DEF void mgpu_event_free(mgpu_event *e);
MGPU_DEF void mgpu_event_record(mgpu_event *e, mgpu_device *d);
MGPU_DEF void mgpu_event_wait(mgpu_device *d, mgpu_event *e);
MGPU_DEF void mgpu_event_synchronize(mgpu_event *e);
MGPU_DEF double mgpu_event_elapsed_ms(mgpu_event *start, mgpu_event *end);

/* ---------------------------------------------------------------- timers */
#define MGPU_TIMER_MAX 4096
typedef struct mgpu_timer {
    double started;             /* seconds, wall clock */
    int n;                      /* number of recorded intervals */
    double times[MGPU_TIMER_MAX];
} mgpu_timer;
MGPU_DEF double mgpu_now(void); /* seconds on a monotonic clock */
MGPU_DEF void mgpu_timer_init(mgpu_timer *t);
MGPU_DEF void mgpu_timer_start(mgpu_timer *t);
MGPU_DEF double mgpu_timer_stop(mgpu_timer *t); /* returns this interval */
MGPU_DEF double mgpu_timer_avg(const mgpu_timer *t);
MGPU_DEF double mgpu_timer_sum(const mgpu_timer *t);
MGPU_DEF double mgpu_timer_cumsum(const mgpu_timer *t, int i); /* sum of the first i+1 */

typedef struct mgpu_benchmark { const char *description; double started; int done; } mgpu_benchmark;
MGPU_DEF mgpu_benchmark mgpu_benchmark_begin(const char *description);
/* Synchronises every device, prints "<description>: 0.5620 sec", returns the seconds. */
MGPU_DEF double mgpu_benchmark_end(mgpu_benchmark *b);
#define MGPU__CAT2(a, b) a##b
#define MGPU__CAT(a, b) MGPU__CAT2(a, b)
#define MGPU_BENCHMARK(description)                                          \
    for (mgpu_benchmark MGPU__CAT(mgpu__bm, __LINE__) =                      \
             mgpu_benchmark_begin(description);                              \
         !MGPU__CAT(mgpu__bm, __LINE__).done;                                \
         mgpu_benchmark_end(&MGPU__CAT(mgpu__bm, __LINE__)))

/* --------------------------------------------------------------- tensors */
#define MGPU_MAX_DIMS 4
typedef struct mgpu_shape { int ndim; int d[MGPU_MAX_DIMS]; } mgpu_shape;
MGPU_DEF mgpu_shape mgpu_shape1(int a);
MGPU_DEF mgpu_shape mgpu_shape2(int a, int b);
MGPU_DEF mgpu_shape mgpu_shape3(int a, int b, int c);
MGPU_DEF mgpu_shape mgpu_shape4(int a, int b, int c, int d);
MGPU_DEF size_t mgpu_shape_numel(mgpu_shape s);
MGPU_DEF int mgpu_shape_equal(mgpu_shape a, mgpu_shape b);
/* "[4000, 4000]" into buf */
MGPU_DEF const char *mgpu_shape_str(mgpu_shape s, char *buf, size_t size);

typedef struct mgpu__block mgpu__block;
typedef struct mgpu_tensor {
    float *data;          /* on the tensor's device */
    mgpu_shape shape;
    size_t numel;
    mgpu_device *device;
    int pinned;           /* host memory that the GPU can copy asynchronously */
    mgpu__block *block;   /* allocator block; NULL for a view */
    mgpu_event *last_read;/* a copy queue may still be using the tensor */
    struct mgpu_tensor *base; /* a view's tensor, which keeps last_read for it */
} mgpu_tensor;

MGPU_DEF mgpu_tensor *mgpu_empty(mgpu_device *dev, mgpu_shape shape);
MGPU_DEF mgpu_tensor *mgpu_zeros(mgpu_device *dev, mgpu_shape shape);
MGPU_DEF mgpu_tensor *mgpu_ones(mgpu_device *dev, mgpu_shape shape);
MGPU_DEF mgpu_tensor *mgpu_full(mgpu_device *dev, mgpu_shape shape, float value);
MGPU_DEF mgpu_tensor *mgpu_rand(mgpu_device *dev, mgpu_shape shape);
MGPU_DEF mgpu_tensor *mgpu_rand_uniform(mgpu_device *dev, mgpu_shape shape, float low, float high);
MGPU_DEF mgpu_tensor *mgpu_randn(mgpu_device *dev, mgpu_shape shape, float mean, float std);
MGPU_DEF mgpu_tensor *mgpu_arange(mgpu_device *dev, mgpu_shape shape);
MGPU_DEF mgpu_tensor *mgpu_empty_pinned(mgpu_shape shape);
MGPU_DEF mgpu_tensor *mgpu_from_host(mgpu_device *dev, mgpu_shape shape, const float *values);
MGPU_DEF void mgpu_to_host(const mgpu_tensor *t, float *out);
MGPU_DEF float mgpu_item(const mgpu_tensor *t, size_t i); /* one value, blocking */
MGPU_DEF mgpu_tensor *mgpu_to(const mgpu_tensor *t, mgpu_device *dev, int non_blocking);
MGPU_DEF void mgpu_copy(mgpu_tensor *dst, const mgpu_tensor *src, int non_blocking);
MGPU_DEF mgpu_tensor *mgpu_view(const mgpu_tensor *t, mgpu_shape shape);
/* Makes *slot a tensor of this shape on dev, reusing the one there when it
   already is: a loop that calls it every step allocates only when a shape
   changes (a shorter last batch). */
MGPU_DEF mgpu_tensor *mgpu_ensure(mgpu_tensor **slot, mgpu_device *dev, mgpu_shape shape);
MGPU_DEF mgpu_tensor *mgpu_narrow(const mgpu_tensor *t, int start, int length);
MGPU_DEF void mgpu_print(const char *label, const mgpu_tensor *t);
MGPU_DEF void mgpu_free(mgpu_tensor *t);

/* ------------------------------------------------------------ operations */
MGPU_DEF void mgpu_fill(mgpu_tensor *t, float value);
MGPU_DEF void mgpu_add_(mgpu_tensor *y, const mgpu_tensor *x);   /* y += x */
MGPU_DEF void mgpu_scale_(mgpu_tensor *y, float s);               /* y *= s */
MGPU_DEF void mgpu_matmul(mgpu_tensor *c, const mgpu_tensor *a, const mgpu_tensor *b);
MGPU_DEF mgpu_tensor *mgpu_mm(const mgpu_tensor *a, const mgpu_tensor *b);

/* ------------------------------------------------------------ drawing */
#include "parts/plot_decl.h"
#include "parts/data_decl.h"
#include "parts/layers_decl.h"
#include "parts/train_ops_decl.h"
#include "parts/comm_decl.h"
#include "parts/nn_decl.h"
#include "parts/parallel_decl.h"

/* ---------------------------------------------------------------- random */
MGPU_DEF void mgpu_manual_seed(uint64_t seed);
/* Philox4x32-10: four 32-bit random words for (key, counter). */
MGPU_DEF void mgpu_philox(uint64_t key, uint64_t counter, uint32_t out[4]);

/* ------------------------------------------------------ command-line flags */
/* Every chapter takes the same flags; a chapter sets its defaults, then
   parses. Extra flags of its own go in an mgpu_flag array. A bad flag or
   value is a one-line error and exit status 1; --help prints the flags. */
typedef struct mgpu_options {
    int devices, epochs, batch_size;
    double lr;
    const char *data;  /* NULL: $MGPU_DATA, then data/fashion-mnist */
    const char *out;   /* folder for PNG and CSV files */
    int cpu;           /* --cpu: CPU devices even when there are GPUs */
    int full;          /* --full: the book's setting on a machine without a GPU */
    uint64_t seed;
} mgpu_options;
typedef struct mgpu_flag {
    const char *name;  /* "--size" */
    char type;         /* 'i' positive int, 'd' positive double, 's' string, 'b' switch */
    void *value;       /* int*, double*, const char**, int* */
    const char *help;
} mgpu_flag;
MGPU_DEF void mgpu_options_parse(mgpu_options *o, int argc, char **argv, const char *about,
                                 const mgpu_flag *extra, int nextra);
/* "<out>/<name>", creating <out> when needed; into buf. */
MGPU_DEF const char *mgpu_out_path(const mgpu_options *o, const char *name, char *buf, size_t size);

/* --------------------------------------------------------------- tracing */
MGPU_DEF void mgpu_trace_begin(void);
MGPU_DEF void mgpu_trace_end(void);  /* synchronises all devices */
MGPU_DEF int mgpu_trace_write_png(const char *path, const char *title);

#ifdef __cplusplus
}
#endif
#endif /* MGPU_H */

/* ======================================================================
   IMPLEMENTATION
   ====================================================================== */
#ifdef MGPU_IMPLEMENTATION
#ifndef MGPU__IMPLEMENTED
#define MGPU__IMPLEMENTED

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/stat.h>
#include <cblas.h>
#if MGPU_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- errors */
static void mgpu__vfatal(const char *file, int line, const char *fmt, va_list ap) {
    fflush(stdout);
    fprintf(stderr, "mgpu: error: ");
    if (file) fprintf(stderr, "%s:%d: ", file, line);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    fflush(stderr);
    /* _exit, not exit: a fatal error may come from a worker thread, and the
       exit handlers would wait for that very thread. */
    _exit(1);
}
MGPU_DEF void mgpu_fatal(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    mgpu__vfatal(NULL, 0, fmt, ap);
    va_end(ap);
}
MGPU_DEF void mgpu_fatal_at(const char *file, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    mgpu__vfatal(file, line, fmt, ap);
    va_end(ap);
}
/* Allocation on the host never fails silently. */
static void *mgpu__xmalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) mgpu_fatal("out of host memory (asked for %zu bytes)", bytes);
    return p;
}
static void *mgpu__xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) mgpu_fatal("out of host memory (asked for %zu x %zu bytes)", n, size);
    return p;
}
#define MGPU__PTHREAD_CHECK(call)                                              \
    do {                                                                       \
        int mgpu__rc = (call);                                                 \
        if (mgpu__rc) mgpu_fatal_at(__FILE__, __LINE__, "%s failed: %s", #call, \
                                    strerror(mgpu__rc));                       \
    } while (0)

#if MGPU_CUDA
#define MGPU_CUDA_CHECK(call)                                                   \
    do {                                                                        \
        cudaError_t mgpu__err = (call);                                         \
        if (mgpu__err != cudaSuccess)                                           \
            mgpu_fatal_at(__FILE__, __LINE__, "%s: %s (%s)", #call,             \
                          cudaGetErrorName(mgpu__err),                          \
                          cudaGetErrorString(mgpu__err));                       \
    } while (0)
#define MGPU_CUBLAS_CHECK(call)                                                 \
    do {                                                                        \
        cublasStatus_t mgpu__st = (call);                                       \
        if (mgpu__st != CUBLAS_STATUS_SUCCESS)                                  \
            mgpu_fatal_at(__FILE__, __LINE__, "%s: %s", #call,                  \
                          cublasGetStatusString(mgpu__st));                     \
    } while (0)
/* After a kernel launch: catches bad launch configurations at once. */
#define MGPU_CUDA_CHECK_LAUNCH() MGPU_CUDA_CHECK(cudaGetLastError())
#endif

/* ----------------------------------------------------------------- clock */
MGPU_DEF double mgpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ======================================================================
   Queues. A CPU queue is a worker thread that takes tasks from a ring in
   order. A task is a function and a small copy of its arguments, so the
   caller can return at once (the arguments are copied, not pointed to).
   ====================================================================== */
#define MGPU__TASK_ARGS 256
#define MGPU__QUEUE_RING 512

/* Where a kernel runs: the CUDA stream and cuBLAS handle of a GPU queue,
   or nothing on the CPU. Every kernel in kernels/ takes one. */
typedef struct mgpu__exec {
    int on_gpu;
    void *stream; /* cudaStream_t */
    void *cublas; /* cublasHandle_t */
} mgpu__exec;
typedef void (*mgpu__kernel_fn)(const void *args, const mgpu__exec *ex);

typedef struct mgpu__task {
    mgpu__kernel_fn fn;
    const char *name;     /* for the tracer; a string literal */
    unsigned char args[MGPU__TASK_ARGS];
} mgpu__task;

typedef struct mgpu__queue {
    mgpu_device *device;
    int lane;             /* 0 compute, 1 copy */
    char name[32];        /* "cpu#1 compute" */
    /* CPU worker */
    pthread_t thread;
    pthread_mutex_t mutex;
    pthread_cond_t changed;
    mgpu__task *ring;
    uint64_t head, tail;  /* tasks [tail, head) are waiting; tail is running */
    int busy, stop, started;
#if MGPU_CUDA
    cudaStream_t stream;
    cublasHandle_t cublas;
#endif
} mgpu__queue;

/* ---------------------------------------------------------- caching allocator
   Blocks freed by tensors go to a per-device cache and are handed out again
   for a request of the same rounded size. Reuse is safe without waiting:
   the block was last used by this device's compute queue, and the new user
   enqueues its work on the same queue, later. A copy queue that may still
   read the block leaves an event on it, which the new user waits for. */
struct mgpu__block {
    void *ptr;
    size_t bytes;
    mgpu__block *next;
    mgpu_event *pending; /* a copy that may still read the block */
};

struct mgpu_device {
    int index;            /* in the device table */
    int gpu;              /* physical GPU, -1 for the CPU */
    int virtual_index;    /* 0 for the physical device, 1.. for virtual ones */
    char name[24];
    mgpu__queue queue[2]; /* compute, copy */
    mgpu__block *cache;   /* free blocks */
    size_t in_use, peak, cached;
    pthread_mutex_t alloc_mutex;
};

/* --------------------------------------------------------------- events */
struct mgpu_event {
    pthread_mutex_t mutex;
    pthread_cond_t done_cond;
    uint64_t recorded, completed; /* generations: done when completed >= recorded */
    int refs;                     /* the owner, plus each queued task that uses it */
    double time;                  /* host seconds when it completed (CPU queues) */
    mgpu__queue *queue;           /* where it was last recorded */
#if MGPU_CUDA
    cudaEvent_t cuda;
    int cuda_created;
#endif
};

/* ------------------------------------------------------------- tracing */
typedef struct mgpu__trace_record {
    int queue_id;         /* device index * 2 + lane */
    const char *name;
    double start, end;    /* host seconds (CPU queues) */
#if MGPU_CUDA
    cudaEvent_t cuda_start, cuda_end; /* GPU queues */
#endif
} mgpu__trace_record;

static struct {
    int initialised;
    pid_t pid;
    pthread_mutex_t mutex;
    int num_gpus;
    int ndevices;
    mgpu_device *devices[MGPU_MAX_DEVICES * 4];
    uint64_t seed, offset;   /* the random generator */
    /* tracer */
    int tracing;
    double trace_start, trace_stop;
    mgpu__trace_record *trace;
    int trace_n, trace_cap;
#if MGPU_CUDA
    cudaEvent_t trace_cuda_start[MGPU_MAX_DEVICES];
#endif
} mgpu__g;

static void mgpu__init(void);
static void mgpu__trace_add(mgpu__queue *q, const char *name, double start, double end);

static void *mgpu__worker(void *arg) {
    mgpu__queue *q = (mgpu__queue *)arg;
    static const mgpu__exec cpu_exec = {0, NULL, NULL};
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&q->mutex));
    for (;;) {
        while (q->tail == q->head && !q->stop)
            MGPU__PTHREAD_CHECK(pthread_cond_wait(&q->changed, &q->mutex));
        if (q->tail == q->head) break; /* stop, and nothing left to do */
        mgpu__task *task = &q->ring[q->tail % MGPU__QUEUE_RING];
        q->busy = 1;
        MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&q->mutex));
        double start = mgpu__g.tracing ? mgpu_now() : 0.0;
        task->fn(task->args, &cpu_exec);
        if (mgpu__g.tracing && task->name) mgpu__trace_add(q, task->name, start, mgpu_now());
        MGPU__PTHREAD_CHECK(pthread_mutex_lock(&q->mutex));
        q->busy = 0;
        q->tail++;
        MGPU__PTHREAD_CHECK(pthread_cond_broadcast(&q->changed));
    }
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&q->mutex));
    return NULL;
}

static void mgpu__queue_init(mgpu__queue *q, mgpu_device *d, int lane) {
    q->device = d;
    q->lane = lane;
    snprintf(q->name, sizeof q->name, "%s %s", d->name, lane ? "copy" : "compute");
#if MGPU_CUDA
    if (d->gpu >= 0) {
        MGPU_CUDA_CHECK(cudaSetDevice(d->gpu));
        MGPU_CUDA_CHECK(cudaStreamCreateWithFlags(&q->stream, cudaStreamNonBlocking));
        MGPU_CUBLAS_CHECK(cublasCreate(&q->cublas));
        MGPU_CUBLAS_CHECK(cublasSetStream(q->cublas, q->stream));
        return;
    }
#endif
    q->ring = (mgpu__task *)mgpu__xcalloc(MGPU__QUEUE_RING, sizeof(mgpu__task));
    MGPU__PTHREAD_CHECK(pthread_mutex_init(&q->mutex, NULL));
    MGPU__PTHREAD_CHECK(pthread_cond_init(&q->changed, NULL));
    MGPU__PTHREAD_CHECK(pthread_create(&q->thread, NULL, mgpu__worker, q));
    q->started = 1;
}

static void mgpu__queue_destroy(mgpu__queue *q) {
#if MGPU_CUDA
    if (q->device->gpu >= 0) {
        MGPU_CUDA_CHECK(cudaSetDevice(q->device->gpu));
        MGPU_CUDA_CHECK(cudaStreamSynchronize(q->stream));
        MGPU_CUBLAS_CHECK(cublasDestroy(q->cublas));
        MGPU_CUDA_CHECK(cudaStreamDestroy(q->stream));
        return;
    }
#endif
    if (!q->started) return;
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&q->mutex));
    q->stop = 1;
    MGPU__PTHREAD_CHECK(pthread_cond_broadcast(&q->changed));
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&q->mutex));
    MGPU__PTHREAD_CHECK(pthread_join(q->thread, NULL));
    pthread_mutex_destroy(&q->mutex);
    pthread_cond_destroy(&q->changed);
    free(q->ring);
}

static inline int mgpu__queue_on_gpu(const mgpu__queue *q) { return q->device->gpu >= 0; }

/* Appends a task to a CPU queue; waits while the ring is full. */
static void mgpu__queue_push(mgpu__queue *q, const char *name, mgpu__kernel_fn fn,
                             const void *args, size_t args_size) {
    if (args_size > MGPU__TASK_ARGS)
        mgpu_fatal("internal: arguments of '%s' are %zu bytes, more than %d", name,
                   args_size, MGPU__TASK_ARGS);
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&q->mutex));
    while (q->head - q->tail >= MGPU__QUEUE_RING)
        MGPU__PTHREAD_CHECK(pthread_cond_wait(&q->changed, &q->mutex));
    mgpu__task *task = &q->ring[q->head % MGPU__QUEUE_RING];
    task->fn = fn;
    task->name = name;
    memcpy(task->args, args, args_size);
    q->head++;
    MGPU__PTHREAD_CHECK(pthread_cond_broadcast(&q->changed));
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&q->mutex));
}

static void mgpu__queue_synchronize(mgpu__queue *q) {
#if MGPU_CUDA
    if (mgpu__queue_on_gpu(q)) {
        MGPU_CUDA_CHECK(cudaStreamSynchronize(q->stream));
        return;
    }
#endif
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&q->mutex));
    while (q->tail != q->head)
        MGPU__PTHREAD_CHECK(pthread_cond_wait(&q->changed, &q->mutex));
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&q->mutex));
}

/* Runs a kernel on a queue: on a GPU it is launched on the queue's stream
   now (the launch itself is asynchronous); on the CPU a copy of its
   arguments is handed to the queue's worker thread. `cuda` is NULL when the
   operation has no CUDA version in this build. */
static void mgpu__launch_on(mgpu__queue *q, const char *name, mgpu__kernel_fn cpu,
                            mgpu__kernel_fn cuda, const void *args, size_t args_size) {
#if MGPU_CUDA
    if (mgpu__queue_on_gpu(q)) {
        if (!cuda) mgpu_fatal("'%s' has no CUDA version", name);
        mgpu__exec ex = {1, (void *)q->stream, (void *)q->cublas};
        MGPU_CUDA_CHECK(cudaSetDevice(q->device->gpu));
        mgpu__trace_record *rec = NULL;
        if (mgpu__g.tracing) {
            mgpu__trace_add(q, name, 0, 0);
            rec = &mgpu__g.trace[mgpu__g.trace_n - 1];
            MGPU_CUDA_CHECK(cudaEventRecord(rec->cuda_start, q->stream));
        }
        cuda(args, &ex);
        if (rec) MGPU_CUDA_CHECK(cudaEventRecord(rec->cuda_end, q->stream));
        return;
    }
#else
    (void)cuda;
#endif
    mgpu__queue_push(q, name, cpu, args, args_size);
}
#if MGPU_CUDA
#define MGPU__CUDA_FN(f) (f)
#else
#define MGPU__CUDA_FN(f) NULL
#endif

/* ======================================================================
   Events
   ====================================================================== */
MGPU_DEF mgpu_event *mgpu_event_new(void) {
    mgpu_event *e = (mgpu_event *)mgpu__xcalloc(1, sizeof *e);
    e->refs = 1;
    MGPU__PTHREAD_CHECK(pthread_mutex_init(&e->mutex, NULL));
    MGPU__PTHREAD_CHECK(pthread_cond_init(&e->done_cond, NULL));
    return e;
}

/* An event lives until its owner has freed it and no queued task still
   records or waits on it: freeing never has to wait for the queues. */
static void mgpu__event_retain(mgpu_event *e) {
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&e->mutex));
    e->refs++;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&e->mutex));
}
static void mgpu__event_release(mgpu_event *e) {
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&e->mutex));
    int last = --e->refs == 0;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&e->mutex));
    if (!last) return;
#if MGPU_CUDA
    if (e->cuda_created) MGPU_CUDA_CHECK(cudaEventDestroy(e->cuda));
#endif
    pthread_mutex_destroy(&e->mutex);
    pthread_cond_destroy(&e->done_cond);
    free(e);
}
MGPU_DEF void mgpu_event_free(mgpu_event *e) {
    if (e) mgpu__event_release(e);
}

typedef struct { mgpu_event *event; uint64_t generation; } mgpu__event_args;
static void mgpu__event_complete(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__event_args *a = (const mgpu__event_args *)args;
    mgpu_event *e = a->event;
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&e->mutex));
    if (e->completed < a->generation) e->completed = a->generation;
    e->time = mgpu_now();
    MGPU__PTHREAD_CHECK(pthread_cond_broadcast(&e->done_cond));
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&e->mutex));
    mgpu__event_release(e);
}

static void mgpu__event_record_on(mgpu_event *e, mgpu__queue *q) {
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&e->mutex));
    uint64_t generation = ++e->recorded;
    e->queue = q;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&e->mutex));
#if MGPU_CUDA
    if (mgpu__queue_on_gpu(q)) {
        MGPU_CUDA_CHECK(cudaSetDevice(q->device->gpu));
        if (!e->cuda_created) {
            MGPU_CUDA_CHECK(cudaEventCreate(&e->cuda));
            e->cuda_created = 1;
        }
        MGPU_CUDA_CHECK(cudaEventRecord(e->cuda, q->stream));
        return;
    }
#endif
    mgpu__event_args a = {e, generation};
    mgpu__event_retain(e);
    mgpu__queue_push(q, NULL, mgpu__event_complete, &a, sizeof a);
}

/* The host waits for generation g of e. */
static void mgpu__event_host_wait(mgpu_event *e, uint64_t generation, mgpu__queue *q) {
#if MGPU_CUDA
    if (q && mgpu__queue_on_gpu(q)) {
        MGPU_CUDA_CHECK(cudaEventSynchronize(e->cuda));
        return;
    }
#else
    (void)q;
#endif
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&e->mutex));
    while (e->completed < generation)
        MGPU__PTHREAD_CHECK(pthread_cond_wait(&e->done_cond, &e->mutex));
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&e->mutex));
}

typedef struct { mgpu_event *event; uint64_t generation; mgpu__queue *source; } mgpu__wait_args;
static void mgpu__event_wait_task(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__wait_args *a = (const mgpu__wait_args *)args;
    mgpu__event_host_wait(a->event, a->generation, a->source);
    mgpu__event_release(a->event);
}

/* Queue q waits (in order, without blocking the host) for e's last record. */
static void mgpu__event_wait_on(mgpu__queue *q, mgpu_event *e) {
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&e->mutex));
    uint64_t generation = e->recorded;
    mgpu__queue *source = e->queue;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&e->mutex));
    if (!source || source == q) return; /* never recorded, or same queue: in order already */
#if MGPU_CUDA
    if (mgpu__queue_on_gpu(q)) {
        if (mgpu__queue_on_gpu(source)) {
            MGPU_CUDA_CHECK(cudaStreamWaitEvent(q->stream, e->cuda, 0));
        } else {
            /* A CUDA stream cannot wait for a CPU thread: the host waits. */
            mgpu__event_host_wait(e, generation, source);
        }
        return;
    }
#endif
    mgpu__wait_args a = {e, generation, source};
    mgpu__event_retain(e);
    mgpu__queue_push(q, NULL, mgpu__event_wait_task, &a, sizeof a);
}

MGPU_DEF void mgpu_event_record(mgpu_event *e, mgpu_device *d) { mgpu__event_record_on(e, &d->queue[0]); }
MGPU_DEF void mgpu_event_wait(mgpu_device *d, mgpu_event *e) { mgpu__event_wait_on(&d->queue[0], e); }
MGPU_DEF void mgpu_event_synchronize(mgpu_event *e) {
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&e->mutex));
    uint64_t generation = e->recorded;
    mgpu__queue *source = e->queue;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&e->mutex));
    if (source) mgpu__event_host_wait(e, generation, source);
}
MGPU_DEF double mgpu_event_elapsed_ms(mgpu_event *start, mgpu_event *end) {
    mgpu_event_synchronize(start);
    mgpu_event_synchronize(end);
#if MGPU_CUDA
    if (start->queue && mgpu__queue_on_gpu(start->queue) && end->queue &&
        mgpu__queue_on_gpu(end->queue)) {
        float ms = 0;
        MGPU_CUDA_CHECK(cudaEventElapsedTime(&ms, start->cuda, end->cuda));
        return ms;
    }
    MGPU_REQUIRE(!(start->queue && mgpu__queue_on_gpu(start->queue)) &&
                     !(end->queue && mgpu__queue_on_gpu(end->queue)),
                 "mgpu_event_elapsed_ms: both events must be on GPUs or both on CPUs");
#endif
    return 1e3 * (end->time - start->time);
}

/* ======================================================================
   Devices
   ====================================================================== */
static mgpu_device *mgpu__device_get(int gpu, int virtual_index) {
    mgpu__init();
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&mgpu__g.mutex));
    mgpu_device *found = NULL;
    for (int i = 0; i < mgpu__g.ndevices && !found; i++)
        if (mgpu__g.devices[i]->gpu == gpu && mgpu__g.devices[i]->virtual_index == virtual_index)
            found = mgpu__g.devices[i];
    if (!found) {
        if (mgpu__g.ndevices == (int)(sizeof mgpu__g.devices / sizeof mgpu__g.devices[0]))
            mgpu_fatal("too many devices (at most %d)", mgpu__g.ndevices);
        mgpu_device *d = (mgpu_device *)mgpu__xcalloc(1, sizeof *d);
        d->index = mgpu__g.ndevices;
        d->gpu = gpu;
        d->virtual_index = virtual_index;
        if (gpu >= 0)
            snprintf(d->name, sizeof d->name, virtual_index ? "cuda:%d#%d" : "cuda:%d", gpu,
                     virtual_index);
        else
            snprintf(d->name, sizeof d->name, virtual_index ? "cpu#%d" : "cpu", virtual_index);
        MGPU__PTHREAD_CHECK(pthread_mutex_init(&d->alloc_mutex, NULL));
        mgpu__queue_init(&d->queue[0], d, 0);
        mgpu__queue_init(&d->queue[1], d, 1);
        mgpu__g.devices[mgpu__g.ndevices++] = d;
        found = d;
    }
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__g.mutex));
    return found;
}

MGPU_DEF int mgpu_num_gpus(void) {
    mgpu__init();
    return mgpu__g.num_gpus;
}
MGPU_DEF mgpu_device *mgpu_cpu(void) { return mgpu__device_get(-1, 0); }
MGPU_DEF mgpu_device *mgpu_try_gpu(int i) {
    MGPU_REQUIRE(i >= 0, "mgpu_try_gpu: device index %d is negative", i);
    return i < mgpu_num_gpus() ? mgpu__device_get(i, 0) : mgpu_cpu();
}
MGPU_DEF int mgpu_try_all_gpus(mgpu_device **out, int max) {
    int n = mgpu_num_gpus();
    if (n == 0) {
        if (max > 0) out[0] = mgpu_cpu();
        return 1;
    }
    for (int i = 0; i < n && i < max; i++) out[i] = mgpu__device_get(i, 0);
    return n < max ? n : max;
}

/* OpenBLAS runs every matrix product with all cores by default. When several
   CPU devices run at once, each gets its share, so that two devices really
   work side by side instead of fighting over the same cores. */
extern void openblas_set_num_threads(int num_threads);
static void mgpu__share_cpu_cores(int ncpu_devices) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int per_device = (int)(cores / (ncpu_devices > 0 ? ncpu_devices : 1));
    openblas_set_num_threads(per_device > 0 ? per_device : 1);
}

MGPU_DEF int mgpu_devices(int n, int use_gpu, mgpu_device **out) {
    MGPU_REQUIRE(n >= 1 && n <= MGPU_MAX_DEVICES,
                 "asked for %d devices; the number must be between 1 and %d", n,
                 MGPU_MAX_DEVICES);
    int gpus = use_gpu ? mgpu_num_gpus() : 0;
    for (int i = 0; i < n; i++) {
        if (gpus > 0)
            out[i] = mgpu__device_get(i % gpus, i / gpus);
        else
            out[i] = mgpu__device_get(-1, i);
    }
    if (gpus == 0) mgpu__share_cpu_cores(n);
    return n;
}

MGPU_DEF const char *mgpu_device_name(const mgpu_device *d) { return d->name; }
MGPU_DEF int mgpu_device_is_gpu(const mgpu_device *d) { return d->gpu >= 0; }
MGPU_DEF int mgpu_device_gpu_index(const mgpu_device *d) { return d->gpu; }
MGPU_DEF void mgpu_synchronize(mgpu_device *d) {
    mgpu__queue_synchronize(&d->queue[0]);
    mgpu__queue_synchronize(&d->queue[1]);
}
MGPU_DEF void mgpu_synchronize_all(void) {
    mgpu__init();
    for (int i = 0; i < mgpu__g.ndevices; i++) mgpu_synchronize(mgpu__g.devices[i]);
}
MGPU_DEF size_t mgpu_device_memory_in_use(const mgpu_device *d) { return d->in_use; }
MGPU_DEF size_t mgpu_device_memory_peak(const mgpu_device *d) { return d->peak; }
MGPU_DEF void mgpu_device_reset_peak(mgpu_device *d) { d->peak = d->in_use; }
MGPU_DEF const char *mgpu_device_list(char *buf, size_t size, mgpu_device *const *devices, int n) {
    size_t used = (size_t)snprintf(buf, size, "[");
    for (int i = 0; i < n && used < size; i++)
        used += (size_t)snprintf(buf + used, size - used, "%s%s", i ? ", " : "", devices[i]->name);
    if (used < size) snprintf(buf + used, size - used, "]");
    return buf;
}

static void mgpu__allocator_release(mgpu_device *d);
MGPU_DEF void mgpu_shutdown(void) {
    if (!mgpu__g.initialised || mgpu__g.pid != getpid()) return;
    for (int i = 0; i < mgpu__g.ndevices; i++) mgpu_synchronize(mgpu__g.devices[i]);
    for (int i = 0; i < mgpu__g.ndevices; i++) {
        mgpu_device *d = mgpu__g.devices[i];
        mgpu__queue_destroy(&d->queue[0]);
        mgpu__queue_destroy(&d->queue[1]);
        mgpu__allocator_release(d);
        pthread_mutex_destroy(&d->alloc_mutex);
        free(d);
    }
    mgpu__g.ndevices = 0;
#if MGPU_CUDA
    for (int i = 0; i < mgpu__g.trace_n; i++) {
        if (mgpu__g.trace[i].cuda_start) cudaEventDestroy(mgpu__g.trace[i].cuda_start);
        if (mgpu__g.trace[i].cuda_end) cudaEventDestroy(mgpu__g.trace[i].cuda_end);
    }
#endif
    free(mgpu__g.trace);
    mgpu__g.trace = NULL;
    mgpu__g.trace_n = mgpu__g.trace_cap = 0;
    pthread_mutex_destroy(&mgpu__g.mutex);
    mgpu__g.initialised = 0;
}

/* fork() copies only the calling thread: in the child, the CPU queues get
   new worker threads (and fresh locks), so a forked child, such as a test
   that expects an error, can still run work on its devices. */
static void mgpu__after_fork_in_child(void) {
    pthread_mutex_init(&mgpu__g.mutex, NULL);
    for (int i = 0; i < mgpu__g.ndevices; i++) {
        mgpu_device *d = mgpu__g.devices[i];
        pthread_mutex_init(&d->alloc_mutex, NULL);
        for (int lane = 0; lane < 2; lane++) {
            mgpu__queue *q = &d->queue[lane];
            if (!q->started) continue;
            pthread_mutex_init(&q->mutex, NULL);
            pthread_cond_init(&q->changed, NULL);
            q->busy = 0;
            MGPU__PTHREAD_CHECK(pthread_create(&q->thread, NULL, mgpu__worker, q));
        }
    }
    mgpu__g.pid = getpid();
}

static void mgpu__init(void) {
    if (mgpu__g.initialised) return;
    mgpu__g.initialised = 1;
    mgpu__g.pid = getpid();
    MGPU__PTHREAD_CHECK(pthread_mutex_init(&mgpu__g.mutex, NULL));
    mgpu__g.seed = 0x5eed;
    mgpu__g.num_gpus = 0;
#if MGPU_CUDA
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err == cudaSuccess) {
        mgpu__g.num_gpus = count;
    } else {
        /* Not an error: a CUDA build on a machine without a GPU runs on the CPU. */
        cudaGetLastError();
        fprintf(stderr, "mgpu: no usable GPU (%s); running on the CPU\n",
                cudaGetErrorString(err));
    }
#endif
    atexit(mgpu_shutdown);
    pthread_atfork(NULL, NULL, mgpu__after_fork_in_child);
}

/* ======================================================================
   The caching allocator
   ====================================================================== */
static size_t mgpu__round_bytes(size_t bytes) {
    /* 512-byte granules keep blocks aligned for vector loads and make
       repeated requests of similar sizes share blocks. */
    return (bytes + 511) / 512 * 512;
}

static void *mgpu__raw_alloc(mgpu_device *d, size_t bytes, int pinned) {
    void *p = NULL;
#if MGPU_CUDA
    if (d->gpu >= 0) {
        MGPU_CUDA_CHECK(cudaSetDevice(d->gpu));
        cudaError_t err = cudaMalloc(&p, bytes);
        if (err != cudaSuccess)
            mgpu_fatal("out of memory on %s: asked for %.1f MiB with %.1f MiB in use (%s)",
                       d->name, bytes / 1048576.0, d->in_use / 1048576.0,
                       cudaGetErrorString(err));
        return p;
    }
    if (pinned && mgpu__g.num_gpus > 0) {
        MGPU_CUDA_CHECK(cudaMallocHost(&p, bytes));
        return p;
    }
#else
    (void)pinned;
#endif
    if (posix_memalign(&p, 64, bytes))
        mgpu_fatal("out of host memory on %s: asked for %.1f MiB", d->name, bytes / 1048576.0);
    return p;
}

static void mgpu__raw_free(mgpu_device *d, void *p, int pinned) {
#if MGPU_CUDA
    if (d->gpu >= 0) {
        MGPU_CUDA_CHECK(cudaFree(p));
        return;
    }
    if (pinned && mgpu__g.num_gpus > 0) {
        MGPU_CUDA_CHECK(cudaFreeHost(p));
        return;
    }
#else
    (void)d;
    (void)pinned;
#endif
    free(p);
}

static mgpu__block *mgpu__block_alloc(mgpu_device *d, size_t bytes, int pinned) {
    bytes = mgpu__round_bytes(bytes);
    mgpu__block *b = NULL;
    if (!pinned) {
        MGPU__PTHREAD_CHECK(pthread_mutex_lock(&d->alloc_mutex));
        for (mgpu__block **link = &d->cache; *link; link = &(*link)->next) {
            if ((*link)->bytes == bytes) {
                b = *link;
                *link = b->next;
                d->cached -= bytes;
                break;
            }
        }
        MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&d->alloc_mutex));
    }
    if (b && b->pending) {
        /* A copy may still be reading this block: the compute queue waits. */
        mgpu__event_wait_on(&d->queue[0], b->pending);
        mgpu__event_wait_on(&d->queue[1], b->pending);
        mgpu_event_free(b->pending);
        b->pending = NULL;
    }
    if (!b) {
        b = (mgpu__block *)mgpu__xcalloc(1, sizeof *b);
        b->bytes = bytes;
        b->ptr = mgpu__raw_alloc(d, bytes, pinned);
    }
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&d->alloc_mutex));
    d->in_use += bytes;
    if (d->in_use > d->peak) d->peak = d->in_use;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&d->alloc_mutex));
    return b;
}

static void mgpu__block_release(mgpu_device *d, mgpu__block *b, int pinned, mgpu_event *pending) {
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&d->alloc_mutex));
    d->in_use -= b->bytes;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&d->alloc_mutex));
    if (pinned) {
        /* Pinned host memory is rare and large: give it straight back, once
           nothing reads it. */
        if (pending) mgpu_event_synchronize(pending);
        mgpu_event_free(pending);
        mgpu_synchronize(d);
        mgpu__raw_free(d, b->ptr, 1);
        free(b);
        return;
    }
    b->pending = pending;
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&d->alloc_mutex));
    b->next = d->cache;
    d->cache = b;
    d->cached += b->bytes;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&d->alloc_mutex));
}

static void mgpu__allocator_release(mgpu_device *d) {
    while (d->cache) {
        mgpu__block *b = d->cache;
        d->cache = b->next;
        mgpu_event_free(b->pending);
        mgpu__raw_free(d, b->ptr, 0);
        free(b);
    }
    d->cached = 0;
}

/* ======================================================================
   Timers
   ====================================================================== */
MGPU_DEF void mgpu_timer_init(mgpu_timer *t) { memset(t, 0, sizeof *t); }
MGPU_DEF void mgpu_timer_start(mgpu_timer *t) { t->started = mgpu_now(); }
MGPU_DEF double mgpu_timer_stop(mgpu_timer *t) {
    double dt = mgpu_now() - t->started;
    if (t->n < MGPU_TIMER_MAX) t->times[t->n++] = dt;
    return dt;
}
MGPU_DEF double mgpu_timer_sum(const mgpu_timer *t) { return mgpu_timer_cumsum(t, t->n - 1); }
MGPU_DEF double mgpu_timer_avg(const mgpu_timer *t) { return t->n ? mgpu_timer_sum(t) / t->n : 0.0; }
MGPU_DEF double mgpu_timer_cumsum(const mgpu_timer *t, int i) {
    double s = 0;
    for (int k = 0; k <= i && k < t->n; k++) s += t->times[k];
    return s;
}
MGPU_DEF mgpu_benchmark mgpu_benchmark_begin(const char *description) {
    mgpu_benchmark b;
    b.description = description;
    b.done = 0;
    b.started = mgpu_now();
    return b;
}
MGPU_DEF double mgpu_benchmark_end(mgpu_benchmark *b) {
    mgpu_synchronize_all();
    double seconds = mgpu_now() - b->started;
    printf("%s: %.4f sec\n", b->description, seconds);
    fflush(stdout);
    b->done = 1;
    return seconds;
}

/* ======================================================================
   Command-line flags
   ====================================================================== */
static void mgpu__flag_set(const mgpu_flag *f, const char *text) {
    char *end = NULL;
    errno = 0;
    if (f->type == 'i') {
        long v = strtol(text, &end, 10);
        if (errno || *end || end == text || v <= 0 || v > 1000000000)
            mgpu_fatal("%s: expected a positive whole number, got '%s'", f->name, text);
        *(int *)f->value = (int)v;
    } else if (f->type == 'd') {
        double v = strtod(text, &end);
        if (errno || *end || end == text || !(v > 0) || !isfinite(v))
            mgpu_fatal("%s: expected a positive number, got '%s'", f->name, text);
        *(double *)f->value = v;
    } else {
        *(const char **)f->value = text;
    }
}

static void mgpu__flag_print(const mgpu_flag *f) {
    char value[64] = "";
    if (f->type == 'i') snprintf(value, sizeof value, " N (now %d)", *(int *)f->value);
    if (f->type == 'd') snprintf(value, sizeof value, " X (now %g)", *(double *)f->value);
    if (f->type == 's') {
        const char *v = *(const char **)f->value;
        snprintf(value, sizeof value, " DIR (now %s)", v ? v : "unset");
    }
    char left[96];
    snprintf(left, sizeof left, "%s%s", f->name, value);
    printf("  %-32s %s\n", left, f->help);
}

MGPU_DEF void mgpu_options_parse(mgpu_options *o, int argc, char **argv, const char *about,
                                 const mgpu_flag *extra, int nextra) {
    int seed = (int)o->seed, help = 0;
    const mgpu_flag common[] = {
        {"--devices", 'i', &o->devices, "number of (logical) devices"},
        {"--epochs", 'i', &o->epochs, "passes over the training data"},
        {"--batch-size", 'i', &o->batch_size, "global batch size, split over the devices"},
        {"--lr", 'd', &o->lr, "learning rate"},
        {"--data", 's', &o->data, "Fashion-MNIST folder (else $MGPU_DATA, then data/fashion-mnist)"},
        {"--out", 's', &o->out, "folder for the PNG and CSV files"},
        {"--seed", 'i', &seed, "random seed"},
        {"--cpu", 'b', &o->cpu, "use CPU devices even when there are GPUs"},
        {"--full", 'b', &o->full, "the book's full setting, also without a GPU"},
        {"--help", 'b', &help, "print this help"},
    };
    int ncommon = (int)(sizeof common / sizeof common[0]);
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        const mgpu_flag *f = NULL;
        for (int k = 0; k < ncommon + nextra && !f; k++) {
            const mgpu_flag *c = k < ncommon ? &common[k] : &extra[k - ncommon];
            if (strcmp(arg, c->name) == 0) f = c;
        }
        if (!f) mgpu_fatal("unknown flag '%s' (try --help)", arg);
        if (f->type == 'b') {
            *(int *)f->value = 1;
            continue;
        }
        if (i + 1 >= argc) mgpu_fatal("%s needs a value (try --help)", arg);
        mgpu__flag_set(f, argv[++i]);
    }
    o->seed = (uint64_t)seed;
    if (help) {
        printf("%s\n\nflags:\n", about);
        for (int k = 0; k < ncommon; k++) mgpu__flag_print(&common[k]);
        for (int k = 0; k < nextra; k++) mgpu__flag_print(&extra[k]);
        exit(0);
    }
    if (!o->out) o->out = ".";
}

MGPU_DEF const char *mgpu_out_path(const mgpu_options *o, const char *name, char *buf, size_t size) {
    const char *dir = o->out ? o->out : ".";
    /* mkdir -p, one component at a time */
    char path[1024];
    snprintf(path, sizeof path, "%s", dir);
    for (char *p = path + 1; ; p++) {
        char c = *p;
        if (c == '/' || c == 0) {
            *p = 0;
            if (mkdir(path, 0777) != 0 && errno != EEXIST)
                mgpu_fatal("--out %s: cannot create folder %s (%s)", dir, path, strerror(errno));
            *p = c;
        }
        if (!c) break;
    }
    snprintf(buf, size, "%s/%s", dir, name);
    return buf;
}

/* ======================================================================
   Random numbers: Philox4x32-10 (Salmon et al., "Parallel random numbers:
   as easy as 1, 2, 3", SC 2011). A bijective mix of a 128-bit counter
   under a 64-bit key: no state, so any element of any draw can be made
   independently, on a CPU thread or a GPU thread, with the same result.
   ====================================================================== */
#if MGPU_CUDA
#define MGPU__HOSTDEVICE __host__ __device__
#else
#define MGPU__HOSTDEVICE
#endif
static MGPU__HOSTDEVICE inline void mgpu__philox4x32(uint64_t key, uint64_t counter, uint32_t out[4]) {
    uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = 0, c3 = 0;
    uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    for (int round = 0; round < 10; round++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1;
        c3 = (uint32_t)p0;
        c0 = n0;
        c2 = n2;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}
/* The i-th number of a draw: uniform in [0, 1) from 24 random bits, or
   standard normal by Box-Muller on a pair of uniforms (in double, so the
   CPU's and the GPU's maths libraries agree to float precision). */
static MGPU__HOSTDEVICE inline float mgpu__random_at(uint64_t key, uint64_t offset, uint64_t i,
                                                     int normal) {
    uint32_t r[4];
    uint64_t n = offset + i;
    mgpu__philox4x32(key, n / 4, r);
    int j = (int)(n % 4);
    if (!normal) return (float)(r[j] >> 8) * (1.0f / 16777216.0f);
    int pair = j & 2;
    double u1 = ((double)(r[pair] >> 8) + 1.0) / 16777217.0; /* (0, 1]: log is finite */
    double u2 = (double)(r[pair + 1] >> 8) / 16777216.0;
    double radius = sqrt(-2.0 * log(u1));
    double angle = 6.283185307179586 * u2;
    return (float)((j & 1) ? radius * sin(angle) : radius * cos(angle));
}
MGPU_DEF void mgpu_philox(uint64_t key, uint64_t counter, uint32_t out[4]) {
    mgpu__philox4x32(key, counter, out);
}
MGPU_DEF void mgpu_manual_seed(uint64_t seed) {
    mgpu__init();
    mgpu__g.seed = seed;
    mgpu__g.offset = 0;
}
/* Each draw takes the next block of counters, rounded to whole Philox blocks. */
static uint64_t mgpu__random_offset(size_t n) {
    mgpu__init();
    uint64_t offset = mgpu__g.offset;
    mgpu__g.offset += (n + 3) / 4 * 4;
    return offset;
}

/* ======================================================================
   Tracing
   ====================================================================== */
static void mgpu__trace_add(mgpu__queue *q, const char *name, double start, double end) {
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&mgpu__g.mutex));
    if (mgpu__g.trace_n == mgpu__g.trace_cap) {
        int cap = mgpu__g.trace_cap ? 2 * mgpu__g.trace_cap : 1024;
        mgpu__trace_record *grown =
            (mgpu__trace_record *)realloc(mgpu__g.trace, (size_t)cap * sizeof *grown);
        if (!grown) mgpu_fatal("out of host memory for the trace");
        memset(grown + mgpu__g.trace_cap, 0, (size_t)(cap - mgpu__g.trace_cap) * sizeof *grown);
        mgpu__g.trace = grown;
        mgpu__g.trace_cap = cap;
    }
    mgpu__trace_record *r = &mgpu__g.trace[mgpu__g.trace_n++];
    r->queue_id = q->device->index * 2 + q->lane;
    r->name = name;
    r->start = start;
    r->end = end;
#if MGPU_CUDA
    if (mgpu__queue_on_gpu(q)) {
        if (!r->cuda_start) MGPU_CUDA_CHECK(cudaEventCreate(&r->cuda_start));
        if (!r->cuda_end) MGPU_CUDA_CHECK(cudaEventCreate(&r->cuda_end));
    }
#endif
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__g.mutex));
}

MGPU_DEF void mgpu_trace_begin(void) {
    mgpu_synchronize_all();
    mgpu__g.trace_n = 0;
#if MGPU_CUDA
    /* One reference event per GPU: GPU times are measured from it. */
    for (int g = 0; g < mgpu__g.num_gpus && g < MGPU_MAX_DEVICES; g++) {
        MGPU_CUDA_CHECK(cudaSetDevice(g));
        if (!mgpu__g.trace_cuda_start[g]) MGPU_CUDA_CHECK(cudaEventCreate(&mgpu__g.trace_cuda_start[g]));
        MGPU_CUDA_CHECK(cudaEventRecord(mgpu__g.trace_cuda_start[g], 0));
        MGPU_CUDA_CHECK(cudaEventSynchronize(mgpu__g.trace_cuda_start[g]));
    }
#endif
    mgpu__g.trace_start = mgpu_now();
    mgpu__g.tracing = 1;
}

MGPU_DEF void mgpu_trace_end(void) {
    mgpu_synchronize_all();
    mgpu__g.tracing = 0;
    mgpu__g.trace_stop = mgpu_now();
}

MGPU_DEF int mgpu_trace_write_png(const char *path, const char *title) {
    mgpu__init();
    /* Lanes: only the queues that did something, in device order. */
    int lane_of[MGPU_MAX_DEVICES * 8];
    const char *lane_names[MGPU_MAX_DEVICES * 8];
    int nqueues = 2 * mgpu__g.ndevices, nlanes = 0;
    for (int id = 0; id < nqueues; id++) {
        lane_of[id] = -1;
        for (int i = 0; i < mgpu__g.trace_n; i++)
            if (mgpu__g.trace[i].queue_id == id) {
                lane_of[id] = nlanes;
                lane_names[nlanes++] = mgpu__g.devices[id / 2]->queue[id % 2].name;
                break;
            }
    }
    mgpu_timeline_bar *bars =
        (mgpu_timeline_bar *)mgpu__xcalloc((size_t)mgpu__g.trace_n + 1, sizeof *bars);
    for (int i = 0; i < mgpu__g.trace_n; i++) {
        const mgpu__trace_record *r = &mgpu__g.trace[i];
        mgpu_timeline_bar *b = &bars[i];
        b->lane = lane_of[r->queue_id];
        snprintf(b->name, sizeof b->name, "%s", r->name);
        b->start_ms = 1e3 * (r->start - mgpu__g.trace_start);
        b->end_ms = 1e3 * (r->end - mgpu__g.trace_start);
#if MGPU_CUDA
        const mgpu_device *d = mgpu__g.devices[r->queue_id / 2];
        if (d->gpu >= 0) {
            float s = 0, e = 0;
            MGPU_CUDA_CHECK(cudaEventElapsedTime(&s, mgpu__g.trace_cuda_start[d->gpu], r->cuda_start));
            MGPU_CUDA_CHECK(cudaEventElapsedTime(&e, mgpu__g.trace_cuda_start[d->gpu], r->cuda_end));
            b->start_ms = s;
            b->end_ms = e;
        }
#endif
    }
    int rc = mgpu_timeline_write_png(path, title, nlanes, lane_names, mgpu__g.trace_n, bars);
    free(bars);
    return rc;
}

#ifdef __cplusplus
}
#endif
#include "parts/plot_impl.h"
#ifdef __cplusplus
extern "C" {
#endif

/* ======================================================================
   Shapes and tensors
   ====================================================================== */
static mgpu_shape mgpu__shape(int ndim, int a, int b, int c, int d) {
    mgpu_shape s;
    s.ndim = ndim;
    s.d[0] = a; s.d[1] = b; s.d[2] = c; s.d[3] = d;
    for (int i = 0; i < ndim; i++)
        MGPU_REQUIRE(s.d[i] >= 0, "a shape cannot have a negative size (%d in dimension %d)",
                     s.d[i], i);
    for (int i = ndim; i < MGPU_MAX_DIMS; i++) s.d[i] = 1;
    return s;
}
MGPU_DEF mgpu_shape mgpu_shape1(int a) { return mgpu__shape(1, a, 1, 1, 1); }
MGPU_DEF mgpu_shape mgpu_shape2(int a, int b) { return mgpu__shape(2, a, b, 1, 1); }
MGPU_DEF mgpu_shape mgpu_shape3(int a, int b, int c) { return mgpu__shape(3, a, b, c, 1); }
MGPU_DEF mgpu_shape mgpu_shape4(int a, int b, int c, int d) { return mgpu__shape(4, a, b, c, d); }
MGPU_DEF size_t mgpu_shape_numel(mgpu_shape s) {
    size_t n = 1;
    for (int i = 0; i < s.ndim; i++) n *= (size_t)s.d[i];
    return n;
}
MGPU_DEF int mgpu_shape_equal(mgpu_shape a, mgpu_shape b) {
    if (a.ndim != b.ndim) return 0;
    for (int i = 0; i < a.ndim; i++)
        if (a.d[i] != b.d[i]) return 0;
    return 1;
}
MGPU_DEF const char *mgpu_shape_str(mgpu_shape s, char *buf, size_t size) {
    size_t used = (size_t)snprintf(buf, size, "[");
    for (int i = 0; i < s.ndim && used < size; i++)
        used += (size_t)snprintf(buf + used, size - used, "%s%d", i ? ", " : "", s.d[i]);
    if (used < size) snprintf(buf + used, size - used, "]");
    return buf;
}

static mgpu_tensor *mgpu__tensor_alloc(mgpu_device *dev, mgpu_shape shape, int pinned) {
    MGPU_REQUIRE(dev != NULL, "tensor on a NULL device");
    MGPU_REQUIRE(shape.ndim >= 1 && shape.ndim <= MGPU_MAX_DIMS,
                 "a tensor has 1 to %d dimensions, not %d", MGPU_MAX_DIMS, shape.ndim);
    mgpu_tensor *t = (mgpu_tensor *)mgpu__xcalloc(1, sizeof *t);
    t->shape = shape;
    t->numel = mgpu_shape_numel(shape);
    t->device = dev;
    t->pinned = pinned;
    t->block = mgpu__block_alloc(dev, t->numel * sizeof(float), pinned);
    t->data = (float *)t->block->ptr;
    return t;
}

MGPU_DEF mgpu_tensor *mgpu_empty(mgpu_device *dev, mgpu_shape shape) {
    return mgpu__tensor_alloc(dev, shape, 0);
}
MGPU_DEF mgpu_tensor *mgpu_empty_pinned(mgpu_shape shape) {
    return mgpu__tensor_alloc(mgpu_cpu(), shape, 1);
}

MGPU_DEF void mgpu_free(mgpu_tensor *t) {
    if (!t) return;
    if (t->block) mgpu__block_release(t->device, t->block, t->pinned, t->last_read);
    else mgpu_event_free(t->last_read);
    free(t);
}

MGPU_DEF mgpu_tensor *mgpu_view(const mgpu_tensor *t, mgpu_shape shape) {
    char a[64], b[64];
    MGPU_REQUIRE(mgpu_shape_numel(shape) == t->numel, "cannot view a tensor of shape %s as %s",
                 mgpu_shape_str(t->shape, a, sizeof a), mgpu_shape_str(shape, b, sizeof b));
    mgpu_tensor *v = (mgpu_tensor *)mgpu__xcalloc(1, sizeof *v);
    v->data = t->data;
    v->shape = shape;
    v->numel = t->numel;
    v->device = t->device;
    v->pinned = t->pinned;
    v->base = t->base ? t->base : (mgpu_tensor *)t;
    return v;
}

MGPU_DEF mgpu_tensor *mgpu_ensure(mgpu_tensor **slot, mgpu_device *dev, mgpu_shape shape) {
    if (*slot && (*slot)->device == dev && mgpu_shape_equal((*slot)->shape, shape)) return *slot;
    mgpu_free(*slot);
    *slot = mgpu_empty(dev, shape);
    return *slot;
}

MGPU_DEF mgpu_tensor *mgpu_narrow(const mgpu_tensor *t, int start, int length) {
    char a[64];
    MGPU_REQUIRE(start >= 0 && length >= 0 && start + length <= t->shape.d[0],
                 "cannot take rows %d..%d of a tensor of shape %s", start, start + length,
                 mgpu_shape_str(t->shape, a, sizeof a));
    mgpu_shape s = t->shape;
    size_t row = t->numel / (size_t)(s.d[0] ? s.d[0] : 1);
    s.d[0] = length;
    mgpu_tensor *v = mgpu_view(t, t->shape);
    v->shape = s;
    v->numel = row * (size_t)length;
    v->data = t->data + row * (size_t)start;
    return v;
}

/* Remembers that a copy queue may still use t (one event per tensor: the
   latest copy, which the copy queue runs after the earlier ones). */
static void mgpu__tensor_track(mgpu_tensor *t, mgpu_event *copy_done) {
    if (t->base) t = t->base;
    mgpu__event_retain(copy_done);
    mgpu_event_free(t->last_read);
    t->last_read = copy_done;
}

/* Before an operation on its own device writes t: wait for copies still using it. */
static void mgpu__before_write(mgpu_tensor *t) {
    if (t->base) t = t->base;
    if (!t->last_read) return;
    mgpu__event_wait_on(&t->device->queue[0], t->last_read);
    mgpu_event_free(t->last_read);
    t->last_read = NULL;
}

static void mgpu__require_device(const mgpu_tensor *t, const mgpu_device *dev, const char *op) {
    MGPU_REQUIRE(t->device == dev, "%s: a tensor on %s is used with one on %s; copy it first with mgpu_to",
                 op, t->device->name, dev->name);
}
static void mgpu__require_same_shape(const mgpu_tensor *a, const mgpu_tensor *b, const char *op) {
    char sa[64], sb[64];
    MGPU_REQUIRE(mgpu_shape_equal(a->shape, b->shape), "%s: shapes %s and %s differ", op,
                 mgpu_shape_str(a->shape, sa, sizeof sa), mgpu_shape_str(b->shape, sb, sizeof sb));
}

#ifdef __cplusplus
}
#endif

/* The kernel families: each file holds the CPU reference of its
   operations and, under nvcc, their CUDA kernels. */
#include "kernels/elementwise.h"
#include "kernels/matmul.h"
#include "kernels/activation.h"
#include "kernels/conv.h"
#include "kernels/pool.h"
#include "kernels/linear.h"
#include "kernels/batchnorm.h"
#include "kernels/loss.h"
#include "kernels/sgd.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------- filling tensors */
static void mgpu__fill_launch(mgpu_tensor *t, int kind, float a, float b) {
    mgpu__fill_args args;
    args.y = t->data;
    args.n = t->numel;
    args.kind = kind;
    args.a = a;
    args.b = b;
    args.key = mgpu__g.seed;
    args.offset = (kind == MGPU__FILL_UNIFORM || kind == MGPU__FILL_NORMAL)
                      ? mgpu__random_offset(t->numel) : 0;
    mgpu__before_write(t);
    mgpu__launch_on(&t->device->queue[0], "fill", mgpu__fill_cpu,
                    MGPU__CUDA_FN(mgpu__fill_cuda), &args, sizeof args);
}
MGPU_DEF void mgpu_fill(mgpu_tensor *t, float value) { mgpu__fill_launch(t, MGPU__FILL_CONSTANT, value, 0); }
MGPU_DEF mgpu_tensor *mgpu_full(mgpu_device *dev, mgpu_shape shape, float value) {
    mgpu_tensor *t = mgpu_empty(dev, shape);
    mgpu_fill(t, value);
    return t;
}
MGPU_DEF mgpu_tensor *mgpu_zeros(mgpu_device *dev, mgpu_shape shape) { return mgpu_full(dev, shape, 0.0f); }
MGPU_DEF mgpu_tensor *mgpu_ones(mgpu_device *dev, mgpu_shape shape) { return mgpu_full(dev, shape, 1.0f); }
MGPU_DEF mgpu_tensor *mgpu_rand_uniform(mgpu_device *dev, mgpu_shape shape, float low, float high) {
    mgpu_tensor *t = mgpu_empty(dev, shape);
    mgpu__fill_launch(t, MGPU__FILL_UNIFORM, low, high);
    return t;
}
MGPU_DEF mgpu_tensor *mgpu_rand(mgpu_device *dev, mgpu_shape shape) { return mgpu_rand_uniform(dev, shape, 0, 1); }
MGPU_DEF mgpu_tensor *mgpu_randn(mgpu_device *dev, mgpu_shape shape, float mean, float std) {
    mgpu_tensor *t = mgpu_empty(dev, shape);
    mgpu__fill_launch(t, MGPU__FILL_NORMAL, mean, std);
    return t;
}
MGPU_DEF mgpu_tensor *mgpu_arange(mgpu_device *dev, mgpu_shape shape) {
    mgpu_tensor *t = mgpu_empty(dev, shape);
    mgpu__fill_launch(t, MGPU__FILL_ARANGE, 0, 0);
    return t;
}

MGPU_DEF void mgpu_add_(mgpu_tensor *y, const mgpu_tensor *x) {
    mgpu__require_device(x, y->device, "mgpu_add_");
    mgpu__require_same_shape(y, x, "mgpu_add_");
    mgpu__axpby_args args = {y->data, x->data, y->numel, 1.0f, 1.0f};
    mgpu__before_write(y);
    mgpu__launch_on(&y->device->queue[0], "add", mgpu__axpby_cpu, MGPU__CUDA_FN(mgpu__axpby_cuda),
                    &args, sizeof args);
}
MGPU_DEF void mgpu_scale_(mgpu_tensor *y, float s) {
    mgpu__axpby_args args = {y->data, y->data, y->numel, 0.0f, s};
    mgpu__before_write(y);
    mgpu__launch_on(&y->device->queue[0], "scale", mgpu__axpby_cpu, MGPU__CUDA_FN(mgpu__axpby_cuda),
                    &args, sizeof args);
}

/* ------------------------------------------------------------ matmul */
MGPU_DEF void mgpu_matmul(mgpu_tensor *c, const mgpu_tensor *a, const mgpu_tensor *b) {
    char sa[64], sb[64], sc[64];
    mgpu__require_device(a, c->device, "mgpu_matmul");
    mgpu__require_device(b, c->device, "mgpu_matmul");
    MGPU_REQUIRE(a->shape.ndim == 2 && b->shape.ndim == 2 && c->shape.ndim == 2 &&
                     a->shape.d[1] == b->shape.d[0] && c->shape.d[0] == a->shape.d[0] &&
                     c->shape.d[1] == b->shape.d[1],
                 "mgpu_matmul: cannot multiply %s by %s into %s",
                 mgpu_shape_str(a->shape, sa, sizeof sa), mgpu_shape_str(b->shape, sb, sizeof sb),
                 mgpu_shape_str(c->shape, sc, sizeof sc));
    mgpu__gemm_args g;
    memset(&g, 0, sizeof g);
    g.m = a->shape.d[0];
    g.n = b->shape.d[1];
    g.k = a->shape.d[1];
    g.alpha = 1.0f;
    g.a = a->data; g.lda = g.k;
    g.b = b->data; g.ldb = g.n;
    g.c = c->data; g.ldc = g.n;
    mgpu__before_write(c);
    mgpu__launch_on(&c->device->queue[0], "matmul", mgpu__gemm_cpu, MGPU__CUDA_FN(mgpu__gemm_cuda),
                    &g, sizeof g);
}
MGPU_DEF mgpu_tensor *mgpu_mm(const mgpu_tensor *a, const mgpu_tensor *b) {
    MGPU_REQUIRE(a->shape.ndim == 2 && b->shape.ndim == 2, "mgpu_mm: both tensors must be matrices");
    mgpu_tensor *c = mgpu_empty(a->device, mgpu_shape2(a->shape.d[0], b->shape.d[1]));
    mgpu_matmul(c, a, b);
    return c;
}

/* ======================================================================
   Copies between devices
   ====================================================================== */
typedef struct { float *dst; const float *src; size_t bytes; int dst_gpu, src_gpu; } mgpu__memcpy_args;
static void mgpu__memcpy_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__memcpy_args *a = (const mgpu__memcpy_args *)args;
    memcpy(a->dst, a->src, a->bytes);
}
#if MGPU_CUDA
static void mgpu__memcpy_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__memcpy_args *a = (const mgpu__memcpy_args *)args;
    cudaStream_t s = (cudaStream_t)ex->stream;
    if (a->src_gpu >= 0 && a->dst_gpu >= 0 && a->src_gpu != a->dst_gpu)
        MGPU_CUDA_CHECK(cudaMemcpyPeerAsync(a->dst, a->dst_gpu, a->src, a->src_gpu, a->bytes, s));
    else
        MGPU_CUDA_CHECK(cudaMemcpyAsync(a->dst, a->src, a->bytes, cudaMemcpyDefault, s));
}
#endif

/* The copy runs on the copy queue of the GPU side (a CUDA copy is issued on
   a GPU stream), or of the source device between CPU devices. */
MGPU_DEF void mgpu_copy(mgpu_tensor *dst, const mgpu_tensor *src, int non_blocking) {
    mgpu__require_same_shape(dst, src, "mgpu_copy");
    mgpu_device *from = src->device, *to = dst->device;
    mgpu__queue *q = (to->gpu >= 0 && from->gpu < 0) ? &to->queue[1] : &from->queue[1];
    /* Wait for the source to be written and for the destination to be free.
       One event per queue: an event re-recorded on another queue could
       complete out of order (and a CUDA event belongs to one GPU). */
    mgpu_event *ready = mgpu_event_new();
    mgpu__event_record_on(ready, &from->queue[0]);
    mgpu__event_wait_on(q, ready);
    if (to != from) {
        mgpu_event *free_dst = mgpu_event_new();
        mgpu__event_record_on(free_dst, &to->queue[0]);
        mgpu__event_wait_on(q, free_dst);
        mgpu_event_free(free_dst);
    }
    mgpu__memcpy_args args = {dst->data, src->data, src->numel * sizeof(float), to->gpu, from->gpu};
    mgpu__launch_on(q, "copy", mgpu__memcpy_cpu, MGPU__CUDA_FN(mgpu__memcpy_cuda), &args, sizeof args);
    /* One event per tensor marks its last copy: make this copy's event
       also cover copies still using the tensors from other queues (a batch
       scattered to several GPUs is read by several copy queues). */
    const mgpu_tensor *tracked[2] = {src, dst->pinned ? dst : NULL};
    for (int i = 0; i < 2; i++) {
        const mgpu_tensor *t = tracked[i] && tracked[i]->base ? tracked[i]->base : tracked[i];
        if (t && t->last_read) mgpu__event_wait_on(q, t->last_read);
    }
    mgpu_event *done = mgpu_event_new();
    mgpu__event_record_on(done, q);
    /* The destination's compute queue uses the result only after the copy.
       Pinned host memory is the exception: it is a staging area the host
       reads after synchronising (as in PyTorch), so that a device copying
       its results out keeps computing meanwhile. */
    if (dst->pinned) mgpu__tensor_track(dst, done);
    else mgpu__event_wait_on(&to->queue[0], done);
    /* The source remembers that a copy queue may still be reading it. */
    if (q != &from->queue[0]) mgpu__tensor_track((mgpu_tensor *)src, done);
    if (!non_blocking) mgpu_event_synchronize(done);
    mgpu_event_free(done);
    mgpu_event_free(ready);
}

MGPU_DEF mgpu_tensor *mgpu_to(const mgpu_tensor *t, mgpu_device *dev, int non_blocking) {
    mgpu_tensor *out = mgpu_empty(dev, t->shape);
    mgpu_copy(out, t, non_blocking);
    return out;
}

MGPU_DEF mgpu_tensor *mgpu_from_host(mgpu_device *dev, mgpu_shape shape, const float *values) {
    mgpu_tensor *t = mgpu_empty(dev, shape);
    mgpu_synchronize(dev);
#if MGPU_CUDA
    if (dev->gpu >= 0) {
        MGPU_CUDA_CHECK(cudaSetDevice(dev->gpu));
        MGPU_CUDA_CHECK(cudaMemcpy(t->data, values, t->numel * sizeof(float), cudaMemcpyHostToDevice));
        return t;
    }
#endif
    memcpy(t->data, values, t->numel * sizeof(float));
    return t;
}

MGPU_DEF void mgpu_to_host(const mgpu_tensor *t, float *out) {
    mgpu_synchronize(t->device);
#if MGPU_CUDA
    if (t->device->gpu >= 0) {
        MGPU_CUDA_CHECK(cudaSetDevice(t->device->gpu));
        MGPU_CUDA_CHECK(cudaMemcpy(out, t->data, t->numel * sizeof(float), cudaMemcpyDeviceToHost));
        return;
    }
#endif
    memcpy(out, t->data, t->numel * sizeof(float));
}

MGPU_DEF float mgpu_item(const mgpu_tensor *t, size_t i) {
    MGPU_REQUIRE(i < t->numel, "mgpu_item: index %zu out of range for %zu elements", i, t->numel);
    mgpu_tensor *flat = mgpu_view(t, mgpu_shape1((int)t->numel));
    mgpu_tensor *one = mgpu_narrow(flat, (int)i, 1);
    float v;
    mgpu_to_host(one, &v);
    mgpu_free(one);
    mgpu_free(flat);
    return v;
}

/* Prints like PyTorch: tensor([[0., 1.], [2., 3.]], device='cuda:0') */
MGPU_DEF void mgpu_print(const char *label, const mgpu_tensor *t) {
    float *v = (float *)mgpu__xmalloc(t->numel * sizeof(float));
    mgpu_to_host(t, v);
    if (label) printf("%s", label);
    printf("tensor(");
    /* block[k]: elements in one entry of dimension k; a bracket opens where a block starts */
    size_t block[MGPU_MAX_DIMS];
    size_t size = 1;
    for (int k = t->shape.ndim - 1; k >= 0; k--) block[k] = size *= (size_t)t->shape.d[k];
    for (size_t i = 0; i < t->numel; i++) {
        for (int k = 0; k < t->shape.ndim; k++)
            if (i % block[k] == 0) printf("[");
        float x = v[i];
        if (x == (float)(long)x && fabsf(x) < 1e7f) printf("%.0f.", x);
        else printf("%.4f", x);
        int closed = 0;
        for (int k = t->shape.ndim - 1; k >= 0; k--)
            if ((i + 1) % block[k] == 0) { printf("]"); closed++; }
        if (i + 1 < t->numel) {
            if (closed) printf(",\n%*s", 7 + t->shape.ndim - closed, "");
            else printf(", ");
        }
    }
    printf(", device='%s')\n", t->device->name);
    free(v);
}

#ifdef __cplusplus
}
#endif

#include "parts/data_impl.h"
#include "parts/layers_impl.h"
#include "parts/train_ops_impl.h"
#include "parts/comm_impl.h"
#include "parts/nn_impl.h"
#include "parts/parallel_impl.h"
#endif /* MGPU__IMPLEMENTED */
#endif /* MGPU_IMPLEMENTATION */
