/* mgpu.h: multi-GPU deep learning in C, from the ground up.

   A single-header teaching library (stb style). In exactly ONE source file:

       #define MGPU_IMPLEMENTATION
       #include "mgpu.h"

   and plain `#include "mgpu.h"` everywhere else (in that one file before
   any system header: it asks for the POSIX functions it needs by defining
   _GNU_SOURCE, unless -D_GNU_SOURCE already did). Build with gcc as C11
   for the CPU backend, or with nvcc (as CUDA C++) for the CPU and CUDA
   backends.
   The CUDA kernels live in kernels/, one file per family of operations;
   the implementation includes them (each kernel file holds the CPU
   reference of its operations beside their CUDA versions).
   Link with: -lopenblas -lstb -lz -lpthread -lm, and with nvcc also
   -lcublas -lnccl. For processes that work as a group (the DISTRIBUTED
   section), add -DMGPU_MPI=1 and MPI's flags (mpicc --showme:compile and
   --showme:link). (The tests also build the CUDA path with g++ on
   emulated GPUs, MGPU_CUDA_EMU: see tests/cuda_emu.h.)

   ======================================================================
   THE MANUAL
   ======================================================================

   1. Errors
   ---------
   Every error prints one line on stderr and exits with status 1:
     - bad arguments name the function and what is wrong with them:
       "mgpu: error: mgpu_add_: a tensor on cpu#1 is used with one on cpu;
       copy it first with mgpu_to";
     - bad files name the file: "mgpu: error: <path>: <what is wrong>";
     - a failing CUDA, cuBLAS, NCCL or system call names the call and
       where in mgpu.h it was made: "mgpu: error: <file>:<line>: <call>:
       <what> (<hint>)".

   2. Devices are queues
   ---------------------
   A device (mgpu_device) runs the operations you give it in order, and
   asynchronously to your program: calling mgpu_relu_forward(...) only *enqueues*
   the work and returns at once. Each device has two queues: a compute
   queue for operations and a copy queue for transfers between devices, so
   copies can overlap compute. On a GPU the queues are CUDA streams; on the
   CPU each queue is a worker thread. mgpu_synchronize(dev) waits until a
   device has finished everything enqueued so far (and stops the program
   if a GPU's loss met a label that is not a class: see "Softmax
   cross-entropy" below); mgpu_synchronize_all() waits for every device.

       int mgpu_num_gpus(void);              physical GPUs visible (0 without a GPU)
       mgpu_device *mgpu_cpu(void);          the CPU device "cpu" (also the host)
       mgpu_device *mgpu_try_gpu(int i);     GPU i if there is one, else the CPU
       int mgpu_try_all_gpus(mgpu_device **out, int max);  all GPUs, or [cpu]
       int mgpu_devices(int n, int use_gpu, mgpu_device **out);  (returns n)

   mgpu_devices asks for n *logical* devices: the physical GPUs first, then
   virtual devices past them. A virtual device has its own queues and its
   own memory but shares a GPU ("cuda:0#1" is the second device on GPU 0)
   or the CPU ("cpu#1"). Everything works the same on virtual devices, so
   a program written for 4 GPUs runs on one GPU, or on none. With use_gpu 0
   (the --cpu flag) all devices are CPU devices. CPU devices share the
   machine's cores: mgpu_devices gives each of n CPU devices 1/n of them
   for OpenBLAS's products and, in a program compiled with -fopenmp (the
   Makefile does, with OpenBLAS built for OpenMP), for the device's own
   kernels, so two devices work side by side rather than in turn
   (OPENBLAS_NUM_THREADS is overridden). The results of the library's own
   kernels do not depend on the number of threads: each thread takes
   whole channels or rows. A CPU device's copy queue is a thread too,
   sharing the cores and the memory bandwidth with the compute: a copy
   overlaps compute only where the compute leaves memory bandwidth to
   spare (it is not memory-bound), and on a machine whose cores are all
   busy, not at all. (A GPU's copies run on copy engines of their own.)

       const char *mgpu_device_name(const mgpu_device *d);   "cuda:0", "cpu#1"
       int mgpu_device_is_gpu(const mgpu_device *d);
       void mgpu_synchronize(mgpu_device *d);  void mgpu_synchronize_all(void);
       size_t mgpu_device_memory_in_use(const mgpu_device *d);   bytes held by tensors
       size_t mgpu_device_memory_peak(const mgpu_device *d);
   Memory by what it holds. Every tensor counts under one category:
   MGPU_MEMORY_PARAMETERS, _GRADIENTS (the parameters' gradients, and a
   data-parallel wrapper's buckets of them), _OPTIMIZER (momentum, Adam's
   moments), _ACTIVATIONS (what a network's forward pass keeps for its
   backward pass), _WORKSPACE (the rest that its passes make: the
   activations' gradients, the kernels' scratch) and _OTHER (the rest:
   batches, your own tensors). A convolution's channels-last copies of
   its weights count with the parameters.
       size_t mgpu_device_memory_of(d, category)        held now
       size_t mgpu_device_memory_peak_of(d, category)   the category's own peak
       size_t mgpu_device_memory_at_peak(d, category)   its part of the device's peak
       const char *mgpu_memory_category_name(category)  "activations"
   (mgpu_device_reset_peak starts every peak again from now.)
       mgpu_device_record_memory(d, 1)   ... mgpu_device_record_memory(d, 0)
       int n = mgpu_device_memory_samples(d, &samples);
   records, between the two calls, what the device holds after every
   allocation and every free: an mgpu_memory_sample each (the host's
   seconds, in_use, and held[category]), at most 1 << 20 of them, to be
   read once the recording is off (it may move them while it runs). A
   device's memory is taken and given back when the host asks (the
   allocator is the host's), so the seconds are those of the host's calls,
   ahead of a GPU's work.
       void mgpu_device_set_memory_limit(mgpu_device *d, size_t bytes)
   gives a device, a CPU or virtual one too, a limit (0: none, the
   default): an allocation that would take it past the limit stops the
   program with one line naming the device, the request, the limit and
   the largest holders. It counts what tensors hold, not the allocator's
   cache of freed blocks (which they reuse). A GPU's own memory is a limit
   too, with the same line.

   3. Events and timers
   --------------------
       mgpu_event *mgpu_event_new(void);      void mgpu_event_free(mgpu_event*);
       void mgpu_event_record(mgpu_event *e, mgpu_device *d);  marks "now" in d's compute queue
       void mgpu_event_wait(mgpu_device *d, mgpu_event *e);    d's compute queue waits for e
   (Copies need no events: each orders itself, section 4.)
       void mgpu_event_synchronize(mgpu_event *e);            the host waits for e
       double mgpu_event_elapsed_ms(mgpu_event *a, mgpu_event *b);

       mgpu_timer t; mgpu_timer_init(&t); mgpu_timer_start(&t); ... mgpu_timer_stop(&t);
       mgpu_timer_avg(&t), mgpu_timer_sum(&t), mgpu_timer_cumsum(&t, i)  (seconds)
   The book's Timer: wall-clock seconds. mgpu_timer_stop returns the
   interval it ends; t.times[0 .. t.n-1] keeps every one. It times the
   host: synchronise first to time the devices' work.
       double mgpu_median(double *values, int n)
   the median of n values (the mean of the middle two when n is even),
   sorting them in place: what a benchmark on a shared, noisy machine
   should quote rather than a mean.

       MGPU_BENCHMARK("GPU1 time") { run(x); }
   runs the block, synchronises every device and prints "GPU1 time: 0.5620 sec".

   4. Tensors
   ----------
   float32, up to 4 dimensions, living on one device. A tensor is freed with
   mgpu_free; memory goes back to the device's caching allocator, so a
   training step allocates nothing new after the first.

       mgpu_shape mgpu_shape1(a) ... mgpu_shape4(a, b, c, d)
       mgpu_tensor *mgpu_empty(dev, shape)   mgpu_zeros  mgpu_ones  mgpu_full(dev, shape, v)
       mgpu_tensor *mgpu_rand(dev, shape)    uniform [0, 1)   (the generator: section 6)
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
                   label as given (bring your own ": "), then PyTorch's
                   tensor([...], device='cpu')
       void mgpu_free(mgpu_tensor *t)

   Mistakes with a tensor's life are one-line errors naming the call and
   the shape: freeing a tensor twice, using a tensor after mgpu_free, using
   a view after its tensor was freed, freeing a batch that a loader owns.
   (The library keeps the last 4096 freed tensors' headers to see this;
   a tensor used after more frees than that may go unnoticed.)

   A view (mgpu_view, mgpu_narrow) shares its tensor's memory and does not
   keep it alive: free the views before the tensor. Views can be copied
   to and from, and operated on, like any tensor, except that an output
   may not overlap an input (two views of one tensor that share part of
   it): the operation would read values it has already written, and it is
   an error. The same tensor as output and input is fine where each value
   is read before it is written (y += y, a copy to itself; not a product).

   A copy runs on a copy queue: it starts when the source's device and the
   destination's device have both finished what was enqueued before it
   (so it neither reads a value still being computed nor overwrites one
   still being read), and the destination's device will not use the
   result before the copy is done. A blocking copy also makes the host
   wait for it; a non-blocking one returns at once (copy into pinned host
   memory for it to overlap compute on a GPU).

   What the queues make safe. An operation enqueued after a copy that
   writes the copy's source or destination waits for the copy to be done
   with it: mgpu_copy(dst, src, 1); mgpu_fill(src, 0.0f); copies the old
   values of src. Freeing a tensor right after enqueuing work on it is
   safe too: its memory goes back to the device's cache, which gives it
   out again only to work enqueued after that work (or after the copies
   still reading it). A clone, a new tensor with t's values on t's device:
       mgpu_tensor *c = mgpu_to(t, t->device, 0);

   5. Operations
   -------------
       void mgpu_matmul(mgpu_tensor *c, const mgpu_tensor *a, const mgpu_tensor *b)   c = a b
       mgpu_tensor *mgpu_mm(const mgpu_tensor *a, const mgpu_tensor *b)               new c
       void mgpu_fill(t, v)   void mgpu_add_(y, x)  (y += x)   void mgpu_scale_(y, s)
       void mgpu_set_tf32(int conv, int matmul)      which products may use TF32
       void mgpu_get_tf32(int *conv, int *matmul)    and which do now
       const char *mgpu_tf32_str(void)               the same, in words
   A GPU uses cuBLAS, the CPU OpenBLAS (through cblas). Shapes are checked;
   a mismatch is a one-line error naming both shapes.
   Precision on a GPU. Since the A100, a GPU's tensor cores multiply float32
   matrices several times faster in TF32: the inputs rounded to 10-bit
   mantissas (about 3 decimal digits), the sums kept in float32. mgpu
   follows PyTorch's defaults: the products inside convolutions use TF32
   (torch.backends.cudnn.allow_tf32 = True), mgpu_matmul and the linear
   layers stay float32 (torch.backends.cuda.matmul.allow_tf32 = False).
   mgpu_set_tf32(conv, matmul) changes both for the work enqueued after
   it; the environment variable MGPU_TF32 sets them at start (0: neither,
   1: both). The CPU always computes in float32.

   The rest of the library has a manual section of its own above its
   declarations, below this comment, in this order:
     DATA             Fashion-MNIST: IDX files, data sets, the batch loader
     LAYERS           convolution, pooling, ReLU, residual add, linear
     TRAINING         batch norm, cross-entropy, accuracy, sums, SGD
     COMMUNICATION    get_params, the book's allreduce, scatter,
                      split_batch, the ring allreduce, NCCL, overlap
     NETWORKS         layers with parameters, ResNet-18, save and load,
                      evaluate_accuracy
     DATA PARALLELISM the DataParallel-style wrapper, gradient buckets
     PIPELINES        a network cut into stages on devices: naive model
                      parallelism, GPipe, 1F1B, schedules of your own
     DISTRIBUTED      processes as a group (MPI), their collectives and
                      faults, the DistributedDataParallel-style wrapper
     TENSOR PARALLELISM  layers split across devices: a convolution by
                      its output channels, Megatron's MLP block
     DRAWING          canvas, line charts, the Animator, timelines (PNG)
   Every operation runs on the queue of the device its tensors are on, and
   every tensor it touches must be on that device (copy with mgpu_to).

   6. Random numbers
   -----------------
   A counter-based generator (Philox4x32-10): the i-th number of a draw
   depends only on the seed, the draw's offset and i, so a seed gives the
   same tensors on the CPU and on a GPU.
       void mgpu_manual_seed(uint64_t seed);

   7. Tracing
   ----------
       mgpu_trace_begin();  ... work ...;  mgpu_trace_end();
       mgpu_trace_write_png("timeline.png", "title");
       mgpu_trace_summary(stdout);
   records every operation and copy (device, queue, name, start, end) and
   draws one lane per device queue, so overlap can be seen. The summary
   is a profile: per operation name, how often it ran, its total and mean
   time and its share of all traced time, the largest first. On a GPU the
   times come from CUDA events around each operation. A program reads
   what was recorded (ending the trace if it is still on) as data:
       int mgpu_trace_count(void)              operations recorded
       mgpu_trace_op mgpu_trace_get(int i)     the i-th: device, lane (0
                      compute, 1 copy), queue and operation names, start
                      and end in ms since mgpu_trace_begin
       double mgpu_trace_span_ms(void)         mgpu_trace_begin to _end
       double mgpu_trace_busy_ms(device, lane) the time that queue was
                      busy (it runs one operation at a time: the sum
                      of their durations)
   so that, for instance, the queues busy on average are the sum of
   mgpu_trace_busy_ms over the queues over mgpu_trace_span_ms().
       mgpu_trace_label("F3");  ... enqueue ...;  mgpu_trace_label(NULL);
   labels the operations this thread enqueues from then on (NULL: no
   label), so that a program can tell which of its pieces of work each
   recorded operation belonged to: the pipelines (PIPELINES) label each
   micro-batch's passes so, and draw them from the trace. The library
   keeps a copy of each label (up to 4096 distinct ones).

   8. Settings
   -----------
   Everything that changes how the library computes, in one list.
   MGPU_TF32, MGPU_CONV and MGPU_WGMMA are read once, when the library
   starts (the first device), so that a bad value stops the program
   before its work; mgpu_set_tf32 called after that wins. MGPU_DATA is
   read at each mgpu_data_dir call.
     MGPU_TF32=0|1      0: float32 everywhere; 1: TF32 in every product
                        on a GPU. Unset: PyTorch's defaults, TF32 in the
                        convolutions alone. Setter: mgpu_set_tf32(conv,
                        matmul); mgpu_get_tf32 and mgpu_tf32_str read it.
     MGPU_CONV=auto|im2col|implicit|cudnn
                        how a GPU's TF32 convolutions compute: auto (the
                        default) times im2col, the library's convolution
                        kernels and (built with cuDNN) cuDNN's
                        algorithms at the first call with each shape and
                        keeps the fastest for each of the forward pass,
                        dx and dW; im2col forces im2col and the matrix
                        product; implicit the fastest kernels wherever
                        one fits (the LAYERS section lists what is
                        tried); cudnn cuDNN's fastest algorithm alone. On
                        a CPU with oneDNN, auto chooses between im2col
                        and oneDNN the same way, implicit means oneDNN,
                        and cudnn im2col.
     MGPU_WGMMA=1|0     1 (the default): on an H100 or H200 the trial
                        also times the kernels built on Hopper's
                        warpgroup products; 0 leaves them out.
     MGPU_DATA=DIR      the Fashion-MNIST folder when no --data flag
                        names one (else data/fashion-mnist).
     mgpu_manual_seed(seed)  the random generator's seed (section 6).
     mgpu_devices(n, use_gpu, ...)  gives each of n CPU devices 1/n of the
                        cores for OpenBLAS, its own kernels and oneDNN
                        (OPENBLAS_NUM_THREADS is overridden, and so is
                        OMP_NUM_THREADS on the devices' workers).
     OPENBLAS_CORETYPE  left as you set it. Unset, and OpenBLAS took
                        kernels without AVX2 on a processor that has
                        AVX2 and FMA (a processor it does not know), the
                        program starts again at once with it set to
                        kernels the processor runs, and says so in one
                        line.

   ====================================================================== */
/* The implementation calls POSIX functions (clock_gettime, posix_memalign,
   fileno) that C11's headers declare only when asked to: */
#if defined(MGPU_IMPLEMENTATION) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE
#endif
#ifndef MGPU_H
#define MGPU_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifndef MGPU_DEF
#define MGPU_DEF extern
#endif

/* oneDNN's convolutions on CPU devices (kernels/conv_onednn.h): the
   Makefile sets MGPU_ONEDNN=1 where oneDNN is installed; and cuDNN's on
   GPUs (kernels/conv_cudnn.h): MGPU_CUDNN=1 where cuDNN is. */
#ifndef MGPU_ONEDNN
#define MGPU_ONEDNN 0
#endif
#ifndef MGPU_CUDNN
#define MGPU_CUDNN 0
#endif
/* MPI between processes (the DISTRIBUTED section): the Makefile sets
   MGPU_MPI=1 where mpi.h is found. */
#ifndef MGPU_MPI
#define MGPU_MPI 0
#endif

#if defined(__CUDACC__) || defined(MGPU_CUDA_EMU) /* emulated: tests/cuda_emu.h */
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
#define MGPU__NORETURN __attribute__((noreturn))
#else
#define MGPU__PRINTF(a, b)
#define MGPU__NORETURN
#endif
/* Prints "mgpu: error: <message>" as one line and exits with status 1. */
MGPU_DEF void mgpu_fatal(const char *fmt, ...) MGPU__PRINTF(1, 2) MGPU__NORETURN;
/* The same, with the source location first. */
MGPU_DEF void mgpu_fatal_at(const char *file, int line, const char *fmt, ...)
    MGPU__PRINTF(3, 4) MGPU__NORETURN;
/* Checks a condition that depends on the caller's arguments. */
#define MGPU_REQUIRE(cond, ...) \
    do { if (!(cond)) mgpu_fatal(__VA_ARGS__); } while (0)
/* malloc that never returns NULL: memory the host cannot give is a
   one-line error ("out of host memory (asked for N bytes)"). free() frees it. */
MGPU_DEF void *mgpu_malloc(size_t bytes);

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
/* The CUDA stream (a cudaStream_t) that runs a GPU device's operations;
   NULL for a CPU device. A kernel of yours launched on it runs in order
   with them (a layer of yours on a GPU: mgpu_net_add_layer, which makes
   the layer's GPU the current one before each pass; elsewhere call
   cudaSetDevice(mgpu_device_gpu_index(d)) first). */
MGPU_DEF void *mgpu_device_stream(const mgpu_device *d);
MGPU_DEF void mgpu_synchronize(mgpu_device *d);
MGPU_DEF void mgpu_synchronize_all(void);
MGPU_DEF size_t mgpu_device_memory_in_use(const mgpu_device *d);
MGPU_DEF size_t mgpu_device_memory_peak(const mgpu_device *d);
MGPU_DEF void mgpu_device_reset_peak(mgpu_device *d);
typedef enum {
    MGPU_MEMORY_OTHER, /* (first: what nothing else claims) */
    MGPU_MEMORY_PARAMETERS,
    MGPU_MEMORY_GRADIENTS,
    MGPU_MEMORY_OPTIMIZER,
    MGPU_MEMORY_ACTIVATIONS,
    MGPU_MEMORY_WORKSPACE,
    MGPU_MEMORY_CATEGORIES
} mgpu_memory_category;
MGPU_DEF size_t mgpu_device_memory_of(const mgpu_device *d, mgpu_memory_category c);
MGPU_DEF size_t mgpu_device_memory_peak_of(const mgpu_device *d, mgpu_memory_category c);
MGPU_DEF size_t mgpu_device_memory_at_peak(const mgpu_device *d, mgpu_memory_category c);
MGPU_DEF const char *mgpu_memory_category_name(mgpu_memory_category c);
MGPU_DEF void mgpu_device_set_memory_limit(mgpu_device *d, size_t bytes);
typedef struct mgpu_memory_sample {
    double seconds; /* mgpu_now() */
    size_t in_use, held[MGPU_MEMORY_CATEGORIES];
} mgpu_memory_sample;
MGPU_DEF void mgpu_device_record_memory(mgpu_device *d, int on);
MGPU_DEF int mgpu_device_memory_samples(const mgpu_device *d, const mgpu_memory_sample **samples);
/* How many blocks the device's allocator has taken from the system so far:
   it stops growing once a training loop has seen all its shapes. */
MGPU_DEF size_t mgpu_device_allocations(const mgpu_device *d);
/* Writes a comma-separated list of names, "[cuda:0, cuda:0#1]", into buf. */
MGPU_DEF const char *mgpu_device_list(char *buf, size_t size, mgpu_device *const *devices, int n);
/* Waits for every queue, stops the worker threads and frees every cached
   block. At exit the library waits for the queues by itself, and tears
   down too when no GPU is in use. */
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
MGPU_DEF double mgpu_median(double *values, int n);

/* Seconds as the book prints them, one decimal, or three below 1 s:
   printf("%.*f sec/epoch", MGPU_SECONDS(t)). */
#define MGPU_SECONDS(t) ((t) < 1.0 ? 3 : 1), (t)

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
    mgpu_event *last_write;/* pinned: a copy into it that may still be running */
    struct mgpu_tensor *base; /* a view's tensor, which keeps last_read for it */
    /* Lifetime checks (mgpu_free): whether the tensor is alive, how many
       times its header has been freed, base's count when the view was
       taken, and who owns it if not the program ("the loader"). */
    int alive;
    unsigned frees, base_frees;
    const char *owner;
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
MGPU_DEF void mgpu_set_tf32(int conv, int matmul);
MGPU_DEF void mgpu_get_tf32(int *conv, int *matmul);
MGPU_DEF const char *mgpu_tf32_str(void);

/* ---------------------------------------------------------------- random */
MGPU_DEF void mgpu_manual_seed(uint64_t seed);
/* Philox4x32-10: four 32-bit random words for (key, counter). */
MGPU_DEF void mgpu_philox(uint64_t key, uint64_t counter, uint32_t out[4]);

/* ------------------------------------------------------ command-line flags */
/* Every chapter takes the same flags; a chapter sets its defaults, then
   parses. Extra flags of its own go in an mgpu_flag array (one named like
   a common flag replaces it, help text and all). A bad flag or value is
   a one-line error and exit status 1, before any work: an unknown flag,
   a missing value, a number out of range (--devices up to
   MGPU_MAX_DEVICES, --epochs up to MGPU_TIMER_MAX, whole numbers up to
   10^9, floats within float's range), an empty folder name, an --out that
   cannot be made or written to (parsing makes it). --help prints the
   flags. Other bounds of its own flags a program checks just after
   parsing, before its work, in one line too. */
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
    char type;         /* 'i' positive int, 'u' int of 0 or more, 'd' positive double, 'z' double of
                          0 or more, 's' string, 'b' switch, 'n' a common flag this program
                          refuses: giving it fails with help as the message, and --help omits it
                          (value NULL) */
    void *value;       /* int* ('i', 'u', 'b'), double* ('d', 'z'), const char** ('s') */
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
MGPU_DEF void mgpu_trace_summary(FILE *f);
typedef struct mgpu_trace_op {
    const mgpu_device *device;
    int lane;               /* 0: the compute queue, 1: the copy queue */
    const char *queue;      /* "cpu#1 compute" */
    const char *name;       /* the operation: "conv2d im2col", "copy", ... */
    double start_ms, end_ms;/* since mgpu_trace_begin */
    const char *label;      /* the label it was enqueued under (mgpu_trace_label), or NULL */
} mgpu_trace_op;
MGPU_DEF void mgpu_trace_label(const char *label);
MGPU_DEF int mgpu_trace_count(void);
MGPU_DEF mgpu_trace_op mgpu_trace_get(int i);
MGPU_DEF double mgpu_trace_span_ms(void);
MGPU_DEF double mgpu_trace_busy_ms(const mgpu_device *d, int lane);

/* ---------------------------------------------------------------------------
   DATA. Fashion-MNIST in memory, and batches prepared ahead
   ---------------------------------------------------------------------------
   The whole data set is read into host memory once (47 MB of pixels for
   the training set, a fraction of a second). A loader then cuts it into
   batches, the way the book's load_data_fashion_mnist(batch_size) does
   with two DataLoaders: the training loader reshuffles every epoch and the
   test loader goes in order.

   Where the files are. mgpu_data_dir(flag) picks the folder: the --data
   flag when given (non-NULL), else $MGPU_DATA, else data/fashion-mnist
   (which `make data` fills). In it, each file is looked up as
   train-images-idx3-ubyte.gz or, uncompressed, train-images-idx3-ubyte.

       mgpu_dataset *train, *test;
       mgpu_dataset_load_fashion_mnist(mgpu_data_dir(flag_data), &train, &test);
       printf("%d images of %dx%d, the first is a %s\n", train->n, train->rows,
              train->cols, mgpu_fashion_mnist_label(train->labels[0]));

   The files are in IDX format (big-endian 32-bit header words, then one
   byte per pixel or label), gzip-compressed or not: zlib reads both and
   tells them apart by the gzip magic number. Everything is checked: the
   magic numbers, the sizes, that the file holds exactly what its header
   announces (no more, no less), labels in 0..9, as many labels as images.
   Bad input stops the program with one line naming the file and the
   problem, for example
       mgpu: error: data/fashion-mnist/t10k-labels-idx1-ubyte.gz: label 12 of sample 17 is not in 0..9

   A data set is plain data that a program may also build itself (images
   and labels from malloc, so mgpu_dataset_free frees them):
       n images of rows x cols bytes, one after the other; n labels.
   mgpu_dataset_subset(d, n) copies the first n samples, in order (all of
   them when n >= d->n): the reduced runs without a GPU train on these.

   Loaders: batches prepared ahead. A loader owns a thread that copies the
   samples of the next batches, converted to floats, into pinned host
   tensors while the program computes on the current one, so that neither
   waits for the other (DataLoader's num_workers and pin_memory):
       mgpu_loader *it = mgpu_loader_new(train, 256, 1, seed);   shuffled
       for (int epoch = 0; epoch < epochs; epoch++) {
           mgpu_loader_start_epoch(it, epoch);
           mgpu_batch b;
           while (mgpu_loader_next(it, &b)) {
               ... b.x: [b.n, 1, rows, cols], pixels / 255 in [0, 1] (ToTensor)
               ... b.y: [b.n], the labels as floats (0. to 9.)
           }
       }
       mgpu_loader_free(it);
   - Order: a shuffling loader visits the samples in an order that depends
     only on (seed, epoch): the same pair gives the same order whatever
     happened before, another epoch gives another one. It is a Fisher-Yates
     shuffle driven by Philox (section 6). Without shuffling, the order is
     the data set's, every epoch (or a sampler's, below, when one is set).
   - Every sample once per epoch: the last batch holds what is left (60000
     samples in batches of 256 end with a batch of 96), as DataLoader's
     default drop_last=False. mgpu_loader_num_batches gives the count.
     mgpu_loader_set_drop_last(it, 1), before the first epoch, drops that
     short batch instead (drop_last=True): every batch is then whole, and
     each epoch leaves out the n % batch_size samples its order puts last
     (different ones each epoch when shuffled). A short last batch can do
     harm: a batch of one image split over 2 devices leaves one device no
     image, and batch norm's statistics over one image are noise.
   - The batch's tensors live on the host (device mgpu_cpu(), pinned, so a
     non-blocking mgpu_copy or mgpu_to onto a GPU overlaps compute). They
     belong to the loader: do not free them. A batch stays valid until the
     next call of mgpu_loader_next, mgpu_loader_start_epoch(_at) or
     mgpu_loader_free, and work enqueued on it before that call is safe:
     the loader waits for copies of the batch (or of views of it) and for
     operations on mgpu_cpu() that read it before it reuses the memory.
     Views you take of a batch (mgpu_narrow, to scatter it) are yours to
     free; they show other data once the batch is reused.
   - A full batch is one of the loader's buffers itself; the shorter last
     batch is an mgpu_narrow view of its first b.n rows, so every batch's
     shape tells its true size.
   - mgpu_loader_start_epoch may be called at any time, also in the middle
     of an epoch (the rest of that epoch is dropped), and mgpu_loader_free
     too: the thread stops cleanly.
   - mgpu_loader_start_epoch_at(it, epoch, k) starts the epoch at its k-th
     batch (0 is the start; k up to mgpu_loader_num_batches, which gives
     none): exactly the batches an uninterrupted epoch gives from there on,
     in the same order. A training resumed from a checkpoint
     (mgpu_checkpoint_load, NETWORKS) goes on where it stopped with it.
   The data set must outlive its loaders.

   Samplers: each process its share. Trained by several processes (chapter
   4: one per device), each rank must see its own part of every epoch and
   all ranks together the whole data set, as PyTorch's DistributedSampler
   gives it. A sampler is that choice, made without any communication:
       mgpu_sampler *s = mgpu_sampler_new(train->n, world, rank, 1, seed, 0);
       mgpu_loader *it = mgpu_loader_new(train, 128, 0, 0);   (shuffle 0)
       mgpu_loader_set_sampler(it, s);
       for (int epoch = 0; epoch < epochs; epoch++) {
           mgpu_sampler_set_epoch(s, epoch);      DistributedSampler.set_epoch
           mgpu_loader_start_epoch(it, epoch);
           ...
   - Order: every rank computes the same order of the n samples: with
     shuffle, the one a shuffling loader with that seed gives the epoch
     (depending only on (seed, epoch), so every rank agrees on it without
     talking); without, 0, 1, ..., n-1. Rank r takes the samples at
     positions r, r + world, r + 2 world, ... of it.
   - Sizes: each rank gets mgpu_sampler_num_samples(s) samples an epoch,
     the same on every rank (else the ranks' steps would not pair up):
     ceil(n / world). The order is made as long as world times that
     (mgpu_sampler_total_size) by going on from its start (round it again
     and again where ranks outnumber samples twice over), so a few samples
     count twice in an epoch: 10 samples on 4 ranks give each rank 3, and
     the order's first two, which ranks 0 and 1 have, go to ranks 2 and 3
     as well. With drop_last 1 the order is cut to world times
     floor(n / world) instead (torch's ceil((n - world) / world) where
     world does not divide n): 2 each, samples 8 and 9 of the order left
     out.
   - The loader goes through the rank's samples in that order, in batches
     of its batch size (its drop_last decides about a short last batch),
     and mgpu_loader_num_batches counts them. Set the sampler before the
     first epoch, on a loader made with shuffle 0 (the sampler gives the
     order, as DataLoader refuses shuffle=True with a sampler), for the
     loader's data set (the same n); the sampler must outlive the loader.
   - The mistake PyTorch lets pass: without set_epoch, every epoch gets
     epoch 0's order. Here mgpu_loader_start_epoch(it, epoch) with a sampler
     set to another epoch is a one-line error saying so (a sampler starts
     at epoch 0).
   - mgpu_sampler_indices(s, out) writes the rank's samples of the set
     epoch into out (num_samples of them), for a program that draws its
     batches itself. */
typedef struct mgpu_dataset {
    int n, rows, cols;
    unsigned char *images; /* n * rows * cols bytes, row-major, image after image */
    unsigned char *labels; /* n labels, each in 0..9 */
} mgpu_dataset;

typedef struct mgpu_loader mgpu_loader;
typedef struct mgpu_sampler mgpu_sampler;
typedef struct mgpu_batch {
    mgpu_tensor *x; /* [n, 1, rows, cols] pinned host memory, pixels / 255 in [0, 1] */
    mgpu_tensor *y; /* [n] the labels, as floats */
    int n;          /* samples in this batch */
} mgpu_batch;

/* The data folder: flag_dir if non-NULL, else $MGPU_DATA, else "data/fashion-mnist". */
MGPU_DEF const char *mgpu_data_dir(const char *flag_dir);
/* Reads an IDX image file and an IDX label file (each gzip-compressed or not). */
MGPU_DEF mgpu_dataset *mgpu_dataset_load(const char *images_path, const char *labels_path);
/* Reads Fashion-MNIST's four files from dir (NULL: mgpu_data_dir(NULL));
   a NULL train or test skips that part. */
MGPU_DEF void mgpu_dataset_load_fashion_mnist(const char *dir, mgpu_dataset **train,
                                              mgpu_dataset **test);
/* A copy of the first n samples (all of them when n >= d->n). */
MGPU_DEF mgpu_dataset *mgpu_dataset_subset(const mgpu_dataset *d, int n);
/* Keeps only the first n samples of d, in place (n <= 0 or >= d->n: all);
   the reduced runs of the chapters train on such a part. */
MGPU_DEF void mgpu_dataset_truncate(mgpu_dataset *d, int n);
MGPU_DEF void mgpu_dataset_free(mgpu_dataset *d);
/* A 64-bit digest of the data set: its size, every image and every label.
   Two sets with the same digest are, all but surely, the same samples in
   the same order (a training checkpoint keeps it, to know its data). */
MGPU_DEF uint64_t mgpu_dataset_digest(const mgpu_dataset *d);
/* "T-shirt/top", "Trouser", ..., "Ankle boot" for k = 0..9. */
MGPU_DEF const char *mgpu_fashion_mnist_label(int k);

MGPU_DEF mgpu_loader *mgpu_loader_new(const mgpu_dataset *d, int batch_size, int shuffle,
                                      uint64_t seed);
/* Starts (or restarts) an epoch; shuffled in an order that depends only on (seed, epoch). */
MGPU_DEF void mgpu_loader_start_epoch(mgpu_loader *l, int epoch);
/* The same, from its first_batch-th batch (0..mgpu_loader_num_batches): resuming an epoch. */
MGPU_DEF void mgpu_loader_start_epoch_at(mgpu_loader *l, int epoch, int first_batch);
/* 1 and the next batch in *out, or 0 at the end of the epoch. */
MGPU_DEF int mgpu_loader_next(mgpu_loader *l, mgpu_batch *out);
MGPU_DEF int mgpu_loader_num_batches(const mgpu_loader *l);
/* drop_last 1: no short last batch (before the first epoch; default 0). */
MGPU_DEF void mgpu_loader_set_drop_last(mgpu_loader *l, int drop_last);
/* The epochs go through s's samples for its rank (before the first epoch;
   a loader made with shuffle 0, for the data set of s's n). */
MGPU_DEF void mgpu_loader_set_sampler(mgpu_loader *l, mgpu_sampler *s);
MGPU_DEF void mgpu_loader_free(mgpu_loader *l);
/* Rank `rank` of `world`'s share of n samples, as DistributedSampler:
   shuffle 1 shuffles by (seed, epoch); drop_last 1 cuts what does not
   divide among the ranks instead of repeating samples to fill it. */
MGPU_DEF mgpu_sampler *mgpu_sampler_new(int n, int world, int rank, int shuffle, uint64_t seed,
                                        int drop_last);
/* The epoch whose order the sampler gives (0 until set): call it before each epoch. */
MGPU_DEF void mgpu_sampler_set_epoch(mgpu_sampler *s, int epoch);
/* This rank's samples an epoch, and that times world (the order's length). */
MGPU_DEF int mgpu_sampler_num_samples(const mgpu_sampler *s);
MGPU_DEF int mgpu_sampler_total_size(const mgpu_sampler *s);
/* This rank's samples of the set epoch, in order: num_samples of them into out. */
MGPU_DEF void mgpu_sampler_indices(mgpu_sampler *s, int *out);
MGPU_DEF void mgpu_sampler_free(mgpu_sampler *s);
/* ---------------------------------------------------------------------------
   LAYERS. The layers of a LeNet and of a ResNet, forward and backward, on any
   device (the CPU and CUDA versions compute the same thing; see
   kernels/conv.h, pool.h, activation.h and linear.h for the maths).

   Images are NCHW: x [N, C, H, W]. Every function writes into tensors that
   you allocate (mgpu_empty) with the right shapes; the shapes and devices
   are checked, and a mismatch is a one-line error naming the function and
   the shapes. All tensors of a call must be on the same device, and hold
   fewer than 2^31 elements (the GPU kernels index in 32 bits). Like every
   operation, these only enqueue work on the device and return at once.

   Backward functions take dy = dL/dy, the gradient of the loss with
   respect to the layer's output, and produce the gradients of its inputs.
   An input gradient (dx) is always overwritten. Parameter gradients (dw,
   db) are overwritten when accumulate is 0 and added to when it is 1, like
   PyTorch's .grad (which adds up until it is zeroed): use 1 when the same
   parameters are used more than once, or to sum over several batches.

   Convolution (PyTorch's conv2d): x [N, C, H, W], weight w [K, C, R, S],
   bias b [K], stride >= 1, zero padding pad >= 0 on every side;
   y [N, K, P, Q] with P = (H + 2 pad - R) / stride + 1 (rounded down), Q
   likewise.
       mgpu_shape mgpu_conv2d_output_shape(x_shape, w_shape, stride, pad)
   gives [N, K, P, Q] (and checks that the shapes fit together).
       mgpu_conv2d_forward(y, x, w, b, stride, pad)     b may be NULL: no bias
       mgpu_conv2d_backward(dx, dw, db, dy, x, w, stride, pad, accumulate)
   dx [N, C, H, W] may be NULL (the first layer needs no input gradient);
   dw [K, C, R, S]; db [K] may be NULL (no bias). x and w are the forward
   pass's input and weight. A convolution works through im2col in chunks
   of images whose scratch (the col buffer) is at most 4 MiB on the CPU
   and 256 MiB on a GPU. That is the reference, on every device.
   On a CPU built with oneDNN (MGPU_ONEDNN=1; the Makefile sets it where
   Debian's libdnnl-dev is installed), each pass may instead take oneDNN's
   kernels, PyTorch's CPU convolutions (kernels/conv_onednn.h): the first
   call of a pass with a shape times both ways and keeps the faster (so,
   as with auto on a GPU, the rounding of the results can differ from run
   to run, and oneDNN's with the number of threads).
   On a GPU, a convolution that may use TF32 (mgpu_set_tf32) may instead
   take a fast kernel that never writes a col buffer. What the library
   tries, for each pass (y, dx, dw) of each shape:
     - an implicit GEMM on the tensor cores over channels-last copies of
       the tensors (the forward pass and dx when C, for dx K, is a
       multiple of 32; dw when C and K are multiples of 4), in four tile
       shapes, its sum whole or split into slices that run at once; at
       strides above 1, dx by sub-pixel convolutions, and for 3x3 windows
       at stride 2 and padding 1 also a kernel that computes the four
       sub-pixel classes at once;
     - for 3x3 layers at stride 1 with 256 channels and filters or more,
       the forward pass and dx by Winograd's F(2x2, 3x3);
     - for a first layer on grayscale images (C*R*S <= 9), float32
       kernels for y and dw, bound by memory rather than arithmetic;
     - where the library is built with cuDNN (MGPU_CUDNN=1: the
       Makefile sets it where it finds cuDNN), each of cuDNN's
       algorithms that says it computes the pass on the NCHW tensors as
       they are, PyTorch's GPU convolutions (kernels/conv_cudnn.h); not
       those whose results may change from run to run;
     - im2col itself, for the whole backward pass or for one gradient.
   MGPU_CONV chooses: auto (the default) times every candidate at the
   first call with each shape and keeps the fastest for each pass, as
   PyTorch's cudnn.benchmark does (so the rounding of TF32 results can
   differ from run to run), counting the channels-last copies the
   kernels read (none that a network prepares for them); im2col forces
   im2col; implicit the fastest fast kernel wherever one fits; cudnn
   the fastest of cuDNN's algorithms. On a GPU
   of compute capability 9.0 (H100, H200) with code built for sm_90a
   (as the Makefile builds it), the implicit GEMM is also tried with Hopper's
   warpgroup products (wgmma); MGPU_WGMMA=0 leaves them out.
   kernels/conv_nhwc.h, winograd.h and conv_few_inputs.h hold the
   kernels, and bench/conv/ the variants that lost on every pass.

   Average pooling, k x k windows with stride k: x [N, C, H, W] ->
   y [N, C, H/k, W/k], rounded down like PyTorch (a 9x9 map gives 4x4).
       mgpu_shape mgpu_avg_pool2d_output_shape(x_shape, k)
       mgpu_avg_pool2d_forward(y, x, k)
       mgpu_avg_pool2d_backward(dx, dy, k)          dx has the shape of x
   Global average pooling, the mean of each plane: x [N, C, H, W] -> y [N, C].
       mgpu_global_avg_pool_forward(y, x)
       mgpu_global_avg_pool_backward(dx, dy)        dx [N, C, H, W], dy [N, C]

   ReLU, y = max(x, 0), any shape; y may be x itself (in place).
       mgpu_relu_forward(y, x)
       mgpu_relu_backward(dx, dy, y_or_x)     dx = dy where y_or_x > 0, else 0
   The mask can be the forward input or output (both are positive at the
   same places), so an in-place ReLU loses nothing. dx may be dy.

   Residual sum, y = a + b (same shapes; y may be a or b):
       mgpu_add(y, a, b)
   Its backward pass needs no function: dL/da = dL/db = dL/dy. Hand dy to
   both branches (mgpu_add_ adds it to a gradient a branch already has).
       mgpu_add_relu(y, a, b)      y = max(a + b, 0), a ResNet block's end
   in one pass; its backward is mgpu_relu_backward(dsum, dy, y).

   Linear layer, with the weight stored [in, out] as in the book's LeNet
   (torch.mm(x, W) + b): x [N, in], w [in, out], b [out], y [N, out].
   x may also be an image batch [N, C, H, W] with C*H*W = in: it is read
   as [N, in] (flattened), and dx then has x's shape.
       mgpu_linear_forward(y, x, w, b)          b may be NULL: no bias
       mgpu_linear_backward(dx, dw, db, dy, x, w, accumulate)
   dx (may be NULL) = dy w^T; dw = x^T dy; db (may be NULL) = the sum of
   the rows of dy.

   A LeNet step, for instance (h1 = conv + bias, a1 = ReLU, p1 = pooling):
       mgpu_conv2d_forward(h1, x, w1, b1, 1, 0);
       mgpu_relu_forward(a1, h1);
       mgpu_avg_pool2d_forward(p1, a1, 2);
       ...
       mgpu_avg_pool2d_backward(da1, dp1, 2);
       mgpu_relu_backward(dh1, da1, a1);
       mgpu_conv2d_backward(NULL, dw1, db1, dh1, x, w1, 1, 0, 0);
*/
MGPU_DEF mgpu_shape mgpu_conv2d_output_shape(mgpu_shape x, mgpu_shape w, int stride, int pad);
MGPU_DEF void mgpu_conv2d_forward(mgpu_tensor *y, const mgpu_tensor *x, const mgpu_tensor *w,
                                  const mgpu_tensor *b, int stride, int pad);
MGPU_DEF void mgpu_conv2d_backward(mgpu_tensor *dx, mgpu_tensor *dw, mgpu_tensor *db,
                                   const mgpu_tensor *dy, const mgpu_tensor *x,
                                   const mgpu_tensor *w, int stride, int pad, int accumulate);

MGPU_DEF mgpu_shape mgpu_avg_pool2d_output_shape(mgpu_shape x, int k);
MGPU_DEF void mgpu_avg_pool2d_forward(mgpu_tensor *y, const mgpu_tensor *x, int k);
MGPU_DEF void mgpu_avg_pool2d_backward(mgpu_tensor *dx, const mgpu_tensor *dy, int k);
MGPU_DEF void mgpu_global_avg_pool_forward(mgpu_tensor *y, const mgpu_tensor *x);
MGPU_DEF void mgpu_global_avg_pool_backward(mgpu_tensor *dx, const mgpu_tensor *dy);

MGPU_DEF void mgpu_relu_forward(mgpu_tensor *y, const mgpu_tensor *x);
MGPU_DEF void mgpu_relu_backward(mgpu_tensor *dx, const mgpu_tensor *dy, const mgpu_tensor *y_or_x);
MGPU_DEF void mgpu_add(mgpu_tensor *y, const mgpu_tensor *a, const mgpu_tensor *b);
MGPU_DEF void mgpu_add_relu(mgpu_tensor *y, const mgpu_tensor *a, const mgpu_tensor *b);

MGPU_DEF void mgpu_linear_forward(mgpu_tensor *y, const mgpu_tensor *x, const mgpu_tensor *w,
                                  const mgpu_tensor *b);
MGPU_DEF void mgpu_linear_backward(mgpu_tensor *dx, mgpu_tensor *dw, mgpu_tensor *db,
                                   const mgpu_tensor *dy, const mgpu_tensor *x,
                                   const mgpu_tensor *w, int accumulate);
/* ---------------------------------------------------------------------------
   TRAINING. Batch norm, losses, optimisers. Like every operation they are enqueued on the
   device of their tensors (all on one device) and return at once; the
   caller allocates every tensor, including the outputs.

   Batch normalisation over channels, as PyTorch's BatchNorm2d
   (kernels/batchnorm.h has the maths):

       void mgpu_batchnorm2d_forward(y, x, gamma, beta, running_mean, running_var,
                                     save_mean, save_invstd, training, momentum, eps,
                                     fuse_relu)
   x and y are [N, C, H, W] (or [N, C], or [N, C, L]: every dimension after
   the second is a spatial one), on a GPU fewer than 2^31 values; gamma,
   beta, running_mean, running_var, save_mean and save_invstd hold C values
   each (shape [C]).
   training 1: normalises with the batch's mean and biased variance over
   N*H*W values per channel (N*H*W must be more than 1), writes the mean and
   1/sqrt(var + eps) to save_mean and save_invstd for the backward pass, and
   updates running_mean and running_var with `momentum` (PyTorch: 0.1; the
   running variance takes the unbiased variance, times m/(m-1)).
   training 0: normalises with running_mean and running_var and changes
   nothing else; save_mean and save_invstd may be NULL.
   eps is added to the variance (PyTorch: 1e-5). fuse_relu 1 gives
   y = max(0, batch norm of x) in the same pass. y may be x itself when no
   backward pass will follow (backward needs x).

       void mgpu_batchnorm2d_backward(dx, dgamma, dbeta, dy, x, gamma, beta,
                                      save_mean, save_invstd, fuse_relu, accumulate)
   The backward pass of a training-mode forward: from dy = dL/dy, the x,
   gamma and beta that forward used and its save_mean and save_invstd,
   writes dx (shape of x) and dgamma, dbeta ([C]). With fuse_relu the
   ReLU's mask, y > 0, is recomputed from x exactly as the forward computed
   y, so y itself is not needed; beta is read only then (otherwise it may
   be NULL). accumulate 1 adds to dgamma and dbeta, as PyTorch's .grad
   does; 0 overwrites them. dx is always overwritten.

   Softmax cross-entropy (PyTorch's CrossEntropyLoss; kernels/loss.h):
   logits are [N, classes]; labels hold N class indices stored as floats
   (0., 1., ...). A label that is not an integer in [0, classes) is a fatal
   error: on a CPU device at once; on a GPU when the program next waits
   for the device (mgpu_synchronize, mgpu_item, mgpu_to_host,
   mgpu_event_synchronize, and at the latest when it ends), with the same
   line and the device named (until then the sample's loss and gradient
   row are NaN).

       void mgpu_cross_entropy_forward(losses, logits, labels)
   losses ([N]): one loss per sample, log sum_j exp(z_j) - z_label
   (reduction='none'; computed stably).
       void mgpu_cross_entropy_backward(dlogits, logits, labels, scale)
   dlogits ([N, classes]): the gradient of scale * (sum of the N losses):
   scale 1 for the book's loss(...).sum(), 1/N for the mean
   (reduction='mean').
       void mgpu_accuracy_count(count, logits, labels)
   count ([1]): how many rows have their largest logit at the label (the
   first largest when several are equal, like torch.argmax). Read it with
   mgpu_item(count, 0); it stays on the device until then.

       void mgpu_sum(out, x)     out ([1]) = the sum of all of x's values
       void mgpu_mean(out, x)    out ([1]) = their mean (x not empty)
   For reporting (a loss, a count): summed in double.

   Stochastic gradient descent (kernels/sgd.h):

       void mgpu_sgd_book(param, grad, lr, batch_size)
   The book's d2l.sgd for a loss summed over a batch:
   param -= lr * grad / batch_size, then grad = 0, in one pass.

       void mgpu_sgd_step(param, grad, momentum_buf, lr, momentum, weight_decay,
                          first_step)
   torch.optim.SGD: g = grad + weight_decay * param; with momentum,
   buf = g at the first step (first_step 1) and momentum * buf + g after,
   and param -= lr * buf; without (momentum 0), param -= lr * g and
   momentum_buf is not used (pass NULL). momentum_buf has the shape of
   param. grad is not changed: zero it with mgpu_fill(grad, 0) before the
   next backward pass, PyTorch's zero_grad(). */
MGPU_DEF void mgpu_batchnorm2d_forward(mgpu_tensor *y, const mgpu_tensor *x,
                                       const mgpu_tensor *gamma, const mgpu_tensor *beta,
                                       mgpu_tensor *running_mean, mgpu_tensor *running_var,
                                       mgpu_tensor *save_mean, mgpu_tensor *save_invstd,
                                       int training, float momentum, float eps, int fuse_relu);
MGPU_DEF void mgpu_batchnorm2d_backward(mgpu_tensor *dx, mgpu_tensor *dgamma, mgpu_tensor *dbeta,
                                        const mgpu_tensor *dy, const mgpu_tensor *x,
                                        const mgpu_tensor *gamma, const mgpu_tensor *beta,
                                        const mgpu_tensor *save_mean,
                                        const mgpu_tensor *save_invstd, int fuse_relu,
                                        int accumulate);
MGPU_DEF void mgpu_cross_entropy_forward(mgpu_tensor *losses, const mgpu_tensor *logits,
                                         const mgpu_tensor *labels);
MGPU_DEF void mgpu_cross_entropy_backward(mgpu_tensor *dlogits, const mgpu_tensor *logits,
                                          const mgpu_tensor *labels, float scale);
MGPU_DEF void mgpu_accuracy_count(mgpu_tensor *count, const mgpu_tensor *logits,
                                  const mgpu_tensor *labels);
MGPU_DEF void mgpu_sum(mgpu_tensor *out, const mgpu_tensor *x);
MGPU_DEF void mgpu_mean(mgpu_tensor *out, const mgpu_tensor *x);
MGPU_DEF void mgpu_sgd_book(mgpu_tensor *param, mgpu_tensor *grad, float lr, int batch_size);
MGPU_DEF void mgpu_sgd_step(mgpu_tensor *param, const mgpu_tensor *grad,
                            mgpu_tensor *momentum_buf, float lr, float momentum,
                            float weight_decay, int first_step);
/* ---------------------------------------------------------------------------
   COMMUNICATION. Parameters on every device, splitting a batch, allreduce
   ---------------------------------------------------------------------------
   Data parallelism needs three things: a copy of the parameters on every
   device, each device's share of the batch, and, after each backward pass,
   the sum of every device's gradients on every device (an allreduce).

   The book's functions.
       mgpu_param p[4];  mgpu_get_params(p, params, 4, dev);
   copies each of params[0..3] to dev, each with a zero gradient of the same
   shape (p[k].value, p[k].grad); mgpu_params_free(p, 4) frees them.
       mgpu_allreduce(grads, n);
   the book's allreduce: adds grads[1..n-1] into grads[0] (copying each to
   grads[0]'s device first), then copies the sum back to every device.
       mgpu_scatter(x, devices, n, out);
   splits x along dimension 0 as PyTorch's nn.parallel.scatter does: chunks
   of ceil(N/n) rows, the last one shorter, out[i] a new tensor on
   devices[i]. It returns how many devices got rows: fewer than n when the
   rows run out first (4 rows on 3 devices: 2, 2 and nothing; a short last
   batch of an epoch), and out[i] is NULL for the devices left without.
   An x with no rows is an error. mgpu_split_batch does it for the images X
   and the labels y, which must have the same number of rows, and returns
   the same count. The copies are non-blocking (the batch usually sits in
   pinned host memory).

   The ring allreduce. The book's version moves everything through device
   0: with n devices of N bytes each, device 0 receives and sends (n-1)N
   bytes while the others wait. A ring cuts each vector into n chunks and
   lets every device send and receive at once:
     reduce-scatter, n-1 steps: at step s device i sends its chunk
       (i - s) mod n to device i+1, which adds it to its own copy of that
       chunk. After n-1 steps device i holds the full sum of chunk (i+1).
     all-gather, n-1 steps: at step s device i sends the finished chunk
       (i + 1 - s) mod n to device i+1, which keeps it.
   Each device sends 2(n-1)/n N bytes in all, whatever n is: this is the
   "bus bandwidth" factor 2(n-1)/n of nccl-tests. Any length works (a
   vector shorter than n leaves some chunks empty).
       mgpu_ring_allreduce(grads, n, average);   average: divide by n
   The ring runs on each device's communication queue (its copy queue: a
   CUDA stream, or a worker thread on the CPU), so it can run while the
   compute queue goes on with other work; the adds are kernels on that
   queue. mgpu_ring_allreduce makes each compute queue wait for the result,
   so the next operation on grads[i] sees the sum.

   The order of the sums. Floating-point addition is not associative: the
   book's allreduce adds ((g0 + g1) + g2) + ..., the ring adds each chunk
   in ring order, NCCL in its own. With 2 devices every order gives the
   same bits (a + b is b + a); with 3 or more, two correct allreduces
   differ in the last bits, and over many training steps the difference
   grows: two runs drift apart, each as right as the other. Compare them
   with a tolerance, or on 2 devices.

   NCCL. Between distinct physical GPUs, NVIDIA's NCCL does the same job
   over NVLink or PCIe with tuned kernels. In one process:
       mgpu_nccl_comm *c = mgpu_nccl_init(devices, n);
   returns NULL when the devices are not n distinct GPUs (virtual devices
   share a GPU, and NCCL before 2.30 refuses two ranks on one GPU; CPU
   devices have no NCCL; nor does a build without nvcc). Then
       mgpu_nccl_allreduce(c, data, average)      data[i] on GPU i of c
       mgpu_nccl_broadcast(c, data, root)         data[root] to all
       mgpu_nccl_reduce_scatter(c, in, out, average)  out[i] = chunk i of the sum;
                                                  in[i] has n times out[i]'s elements
       mgpu_nccl_all_gather(c, in, out)           out[i] = in[0], in[1], ... in a row
       mgpu_nccl_free(c)
   run on the communication queues too; the compute queues wait for them.

   Choosing. mgpu_allreduce_auto(data, n, average) uses NCCL when the
   devices are distinct GPUs, the ring otherwise, and nothing for one
   device; it returns the name of what it used: "nccl", "ring" or "none".

   Overlap. mgpu_allreduce_start(data, n, average, scratch) is
   mgpu_allreduce_auto without its last step: the reduction is queued on
   the communication queues (each starts when its compute queue has
   produced data[i]) and the compute queues go on at once;
   mgpu_comm_wait(devices, n) then makes each compute queue wait for
   everything given to its communication queue so far. In between, leave
   data[i] alone: it is being reduced.
       backward of the last layers ...
       mgpu_allreduce_start(bucket, n, 0, scratch);  their reduction starts
       backward of the earlier layers ...             runs meanwhile
       mgpu_comm_wait(devices, n);                    the optimiser sees every sum
   A bucket is one flat tensor per device (gradients can be views into
   it). scratch is NULL, or the ring's receive buffers: one per device, on
   that device, of at least ceil(numel / n) elements, kept from call to
   call and freed after mgpu_comm_wait. Why keep them: memory the ring
   takes from the allocator goes back marked "in use until this reduction
   ends", and the next tensor of that size would make its compute queue
   wait for the reduction, stalling the backward pass the overlap is for.

   Peer access. Two GPUs copy straight to each other (NVLink or PCIe)
   only once peer access is on; otherwise the driver stages every copy
   through host memory. mgpu_enable_peer_access(devices, n) turns it on
   for every pair that can; the ring and the book's allreduce call it.

   Errors: tensors of different shapes, devices of mixed kinds in a ring,
   more than MGPU_MAX_DEVICES tensors, or a scratch that is too short, on
   the wrong device or overlaps its data (checked where NCCL runs too) are
   one-line errors naming the function; NCCL failures name the file, line
   and NCCL's message. A tensor freed before mgpu_comm_wait is given out
   again only once the reduction is done with it. */

typedef struct mgpu_param { mgpu_tensor *value, *grad; } mgpu_param;
MGPU_DEF void mgpu_get_params(mgpu_param *out, mgpu_tensor *const *params, int n, mgpu_device *dev);
MGPU_DEF void mgpu_params_free(mgpu_param *p, int n);

MGPU_DEF void mgpu_allreduce(mgpu_tensor **data, int n);
MGPU_DEF int mgpu_scatter(const mgpu_tensor *x, mgpu_device *const *devices, int n, mgpu_tensor **out);
MGPU_DEF int mgpu_split_batch(const mgpu_tensor *X, const mgpu_tensor *y, mgpu_device *const *devices,
                              int n, mgpu_tensor **X_shards, mgpu_tensor **y_shards);

MGPU_DEF void mgpu_ring_allreduce(mgpu_tensor **data, int n, int average);
MGPU_DEF void mgpu_enable_peer_access(mgpu_device *const *devices, int n);

typedef struct mgpu_nccl_comm mgpu_nccl_comm;
MGPU_DEF mgpu_nccl_comm *mgpu_nccl_init(mgpu_device *const *devices, int n);
MGPU_DEF void mgpu_nccl_free(mgpu_nccl_comm *comm);
MGPU_DEF void mgpu_nccl_allreduce(mgpu_nccl_comm *comm, mgpu_tensor **data, int average);
MGPU_DEF void mgpu_nccl_broadcast(mgpu_nccl_comm *comm, mgpu_tensor **data, int root);
MGPU_DEF void mgpu_nccl_reduce_scatter(mgpu_nccl_comm *comm, mgpu_tensor *const *in, mgpu_tensor **out,
                                       int average);
MGPU_DEF void mgpu_nccl_all_gather(mgpu_nccl_comm *comm, mgpu_tensor *const *in, mgpu_tensor **out);

MGPU_DEF const char *mgpu_allreduce_auto(mgpu_tensor **data, int n, int average);
MGPU_DEF const char *mgpu_allreduce_start(mgpu_tensor **data, int n, int average,
                                          mgpu_tensor *const *scratch);
MGPU_DEF void mgpu_comm_wait(mgpu_device *const *devices, int n);
/* ---------------------------------------------------------------------------
   NETWORKS. A network (mgpu_net) is a list of layers on one device, each with its
   parameters (value and gradient, mgpu_param) and buffers (batch norm's
   running statistics). It is what chapter 3's ResNet-18 is made of, and
   what a course extends with layers of its own (mgpu_net_add_layer, below).

       mgpu_net *mgpu_net_new(mgpu_device *dev);      an empty network, in training mode
       mgpu_net_add_conv(net, in_channels, out_channels, kernel, stride, pad)
       mgpu_net_add_batchnorm(net, channels)          2-D, as PyTorch's BatchNorm2d
       mgpu_net_add_relu(net)
       mgpu_net_add_avg_pool(net, kernel)             kernel x kernel, stride kernel
       mgpu_net_add_global_avg_pool(net)              [N, C, H, W] -> [N, C]
       mgpu_net_add_residual(net, in_channels, out_channels, stride)
       mgpu_net_add_linear(net, in_features, out_features)
   append a layer (each returns it: mgpu_layer, below) with its parameters
   made on the net's device. Conv and linear weights ~ Normal(0, 0.01),
   their biases ~ Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) (as below;
   fan_in, the inputs a weight's output sums over: a convolution's weight
   is [K, C, R, S], fan_in C*R*S; a linear layer's is [in, out], as the
   book's torch.mm(x, W) has it, fan_in = in = its shape.d[0], where
   PyTorch's nn.Linear, [out, in], would have it in d[1]);
   batch norm gamma 1, beta 0. A convolution has a bias; a linear layer
   flattens an image batch it is given. A residual block is the book's
   Residual (ResNet-18's, below), with the 1x1 shortcut where the shape
   changes. A ReLU straight after a batch norm joins it: one pass over
   the data instead of two, and one layer in the list. A layer whose
   channels do not follow from the one before it is a one-line error;
   so is a linear layer's in_features where the layer before says it (a
   linear layer, or global pooling), else at the first forward pass. A
   network holds any number of layers. The LeNet of chapter 2, for instance:
       mgpu_net *net = mgpu_net_new(dev);
       mgpu_net_add_conv(net, 1, 20, 3, 1, 0);  mgpu_net_add_relu(net);
       mgpu_net_add_avg_pool(net, 2);
       mgpu_net_add_conv(net, 20, 50, 5, 1, 0); mgpu_net_add_relu(net);
       mgpu_net_add_avg_pool(net, 2);
       mgpu_net_add_linear(net, 800, 128);      mgpu_net_add_relu(net);
       mgpu_net_add_linear(net, 128, 10);
   mgpu_lenet(dev) builds this one.
   Without batch norm, the book's Normal(0, 0.01) starts such a stack with
   nearly zero signal: chapter 2's LeNet is still at chance (test accuracy
   0.10) after its first epoch of 60000 images, and a few thousand
   images do not move it. To
   start from other weights, draw them into mgpu_net_param(net, i)->value,
   e.g. He's: mgpu_randn(dev, shape, 0, sqrt(2 / fan_in)) copied in with
   mgpu_copy.

       mgpu_net_add_layer(net, &fns, weight, bias, settings)
   appends a layer of your own (the "add a layer" assignment): fns, an
   mgpu_layer_fns that outlives the net, gives its passes as functions;
       kind           names the layer: "leaky_relu" gives "leaky_relu3"
                      (at most MGPU_LAYER_KIND_MAX = 32 characters)
       output_shape   the output's shape for an input of shape x
                      (NULL: the input's)
       forward(l, y, x, training)   writes y = f(x); y has output_shape's
                      shape, on x's device; training is the net's mode
       backward(l, dx, dweight, dbias, dy, x, y)   from dy = dL/dy, and
                      the forward's x and y, puts dL/dx into dx and the
                      parameters' gradients into dweight and dbias. All
                      three come filled with zeros (write or add, as you
                      like: the network adds them up where it must), with
                      the shapes of x and of the parameters. dx is NULL
                      where nothing wants it (the first layer), dweight
                      and dbias where the layer has no such parameter;
                      with none of the three, backward is not called
                      (so a first layer without parameters needs no
                      NULL check, though it must have a backward).
       own_loops      0: the functions run on the calling thread and are
                      made of the library's operations (mgpu_relu_forward,
                      mgpu_linear_forward, ...), which run on their
                      tensors' device, CPU or GPU, so the layer does too;
                      on a GPU they may also launch kernels of yours on
                      the device's stream (mgpu_device_stream; the
                      layer's GPU is then the current device).
                      1: they loop over the values (x->data, ...)
                      themselves, CPU devices only: each pass runs on the
                      device's queue, in order with the work before and
                      after it (no mgpu_synchronize needed, and several
                      devices run their passes at the same time), and
                      works on the values alone: an operation or a wait
                      of the library called from it is a one-line error.
   weight and bias (either may be NULL) become the layer's parameters,
   l->weight.value and l->bias.value: tensors of their own (not views, not
   another layer's) on the net's device, which the net then owns and
   frees. settings is yours (l->settings), for what the functions read,
   such as a slope; the replicas of a data-parallel wrapper share it, so
   it should not change as they run. The builder cannot know the channels
   a layer of yours gives, so it does not check the layer after it. A
   forward that writes past the end of y (output_shape's shape), or a
   backward past the end of dx, is a one-line error naming the layer and
   the tensor's shape (a device's own: in a data-parallel wrapper, its
   slice of the batch): both have 16 guard floats after their values,
   read after every pass of own loops, else after each pass that follows
   a change of shape (the first, a shorter last batch). A write before
   the start, or one that jumps past the guard floats, is not seen: it
   lands in other memory, and may crash or mislead far from the bug. A
   checkpoint holds the parameters' shapes, not the layers' kinds. A leaky
   ReLU, its slope in the settings:
       static void leaky_forward(mgpu_layer *l, mgpu_tensor *y, const mgpu_tensor *x, int training) {
           float slope = *(const float *)l->settings;
           for (size_t i = 0; i < x->numel; i++)
               y->data[i] = x->data[i] > 0 ? x->data[i] : slope * x->data[i];
       }
       static void leaky_backward(mgpu_layer *l, mgpu_tensor *dx, mgpu_tensor *dweight, mgpu_tensor *dbias,
                                  const mgpu_tensor *dy, const mgpu_tensor *x, const mgpu_tensor *y) {
           float slope = *(const float *)l->settings;
           for (size_t i = 0; i < dy->numel; i++)
               dx->data[i] = x->data[i] > 0 ? dy->data[i] : slope * dy->data[i];
       }
       static const mgpu_layer_fns leaky_relu = {"leaky_relu", NULL, leaky_forward, leaky_backward, 1};
       static float slope = 0.1f;
       mgpu_net_add_layer(net, &leaky_relu, NULL, NULL, &slope);
   (tests/smoke.sh builds it as it stands here and trains it on 2 CPU
   devices; tests/test_parallel.c checks it against central differences.)

       mgpu_net *mgpu_resnet18(int num_classes, int in_channels, mgpu_device *dev);
   The book's ResNet-18 for small images: a 3x3 stem convolution (stride 1,
   padding 1), batch norm, ReLU, no max-pool; four stages of two residual
   blocks (64, 128, 256, 512 channels; a 1x1 strided convolution on the
   shortcut where the shape changes); global average pooling; a linear
   layer. Conv and linear weights ~ Normal(0, 0.01) (the book's
   init_weights); their biases as PyTorch initialises them,
   Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)); batch norm gamma 1, beta 0.
   Draws come from the generator (mgpu_manual_seed first).

       mgpu_tensor *mgpu_net_forward(mgpu_net *net, const mgpu_tensor *x);
   runs the layers in order and returns the logits [N, classes] (owned by
   the net: valid until the next forward). In training mode batch norm
   uses the batch's statistics and updates its running ones; in evaluation
   mode it uses the running ones (mgpu_net_set_training). On a GPU, once
   the convolutions' plans are measured (the first step), a batch norm
   also writes the channels-last copy that the next convolution reads,
   and leaves its plain output unwritten where only that convolution
   would read it: a program that
   looks into a residual block's bn1->output after a step may find it
   stale. The convolutions keep their weights' channels-last copies, and
   each forward pass remakes them from the weights: change the weights
   between a forward pass and its backward pass and the backward uses
   the old ones (as it uses the forward's activations).

       void mgpu_net_backward(mgpu_net *net, const mgpu_tensor *dlogits);
   back-propagates through the layers of the last forward and ADDS every
   parameter's gradient into param.grad, as PyTorch's .backward() does;
   mgpu_net_zero_grad clears them. With batch norm, the last forward must
   have run in training mode (its backward needs the batch statistics; a
   one-line error otherwise). A convolution's bias followed by batch norm
   gets exactly 0 added: the batch mean cancels it, so its gradient is
   exactly 0.

       void mgpu_net_checkpoint(mgpu_net *net, int segments)
   gradient checkpointing (Chen et al. 2016; PyTorch's
   checkpoint_sequential): the layers are cut into `segments` runs of
   about equal length (MGPU_SEGMENTS_SQRT: about sqrt(n) of n layers; 1:
   one run, which is no checkpointing, as a new network has). A forward
   pass in training mode then keeps each
   run's input (the output of the run before) and frees what the run's
   layers made for their backward pass, except in the last run; the
   backward pass makes it again, run by run, by running the run's forward
   pass just before its backward pass. The activations held fall from all
   n layers' to the k - 1 kept inputs plus one run's, about n/k + k
   layers' (least near k = sqrt(n)), for a second forward pass of all runs
   but the last. The gradients are bit for bit the plain ones: the same
   kernels on the same inputs (while the convolutions' trial is timing
   its candidates in the first steps, two passes may take two of them:
   fix the method, MGPU_CONV, to compare bits from the first step). Batch
   norm's running statistics move once a step: the recomputation leaves
   them. A layer of yours is recomputed too: its forward pass must depend
   on its input and parameters alone. More runs than layers, or fewer
   than 1, is a one-line error.
   Pieces to build such a scheme of your own (the checkpointing
   assignment), where a network is a run of layers:
       void mgpu_net_free_activations(net)  frees what the last forward pass
                                  kept for the backward pass, all but the
                                  output (which stays valid)
       void mgpu_net_want_input_grad(net, 1) makes its first layer compute
                                  the input's gradient too (a network's
                                  first layer does not, by default)
       mgpu_tensor *mgpu_net_input_grad(net)  that gradient, after a
                                  backward pass (the net's: valid until the
                                  next one)

       void mgpu_net_loss_backward(net, logits, labels, scale, loss_sum_or_NULL)
   the backward pass of scale times the cross-entropy summed over the rows
   of logits (the last forward's): scale 1/N gives the mean over N rows;
   then mgpu_net_backward. Adds the summed loss to loss_sum as below.
       void mgpu_net_sgd(net, lr, momentum, weight_decay)
   one SGD step of every parameter from its gradient (PyTorch's
   torch.optim.SGD: weight decay added to the gradient, then momentum).
       void mgpu_net_use_adam(net, beta1, beta2, eps, decoupled)
   makes the net's optimizer Adam (torch.optim.Adam; decoupled 1: AdamW,
   whose weight decay shrinks the parameters instead of joining the
   gradient); PyTorch's defaults are 0.9, 0.999 and 1e-8, and AdamW's
   weight decay 0.01. Its two moments, each the size of the parameters,
   are made at the first step: the optimizer state that SGD without
   momentum does not have.
       void mgpu_net_step(net, lr, momentum, weight_decay)
   one step of the net's optimizer: SGD's, or Adam's with lr and
   weight_decay (its momentum must then be 0: Adam keeps moments of its
   own). mgpu_net_train_step and the data-parallel wrappers' steps take
   it. A checkpoint holds Adam's moments and step count as it holds SGD's
   momentum.
       void mgpu_net_train_step(net, x, labels, lr, momentum, weight_decay, loss_sum_or_NULL)
   one SGD step on the mean cross-entropy; adds the batch's summed loss to
   a one-element tensor ([1]) on the net's device when given one (an
   argument on another device is an error that names it; read it once an
   epoch: reading it every step would make the host wait every step). The
   step's backward pass WRITES every gradient, so there is no zero_grad
   to run first (PyTorch's zero_grad(set_to_none=True) saves the same
   pass): param.grad is then this batch's gradient, whatever it held.

       int mgpu_net_num_params(net);   mgpu_param *mgpu_net_param(net, i);
       int mgpu_net_num_buffers(net);  mgpu_tensor *mgpu_net_buffer(net, i);
       size_t mgpu_net_num_weights(net)         number of trainable floats
       mgpu_net *mgpu_net_replicate(const mgpu_net *net, mgpu_device *dev)
   a copy on another device (values and buffers copied, gradients zero).
       void mgpu_net_copy_params(mgpu_net *dst, const mgpu_net *src, int with_buffers)
       void mgpu_net_save(const mgpu_net *net, const char *path)
       void mgpu_net_load(mgpu_net *net, const char *path)
   One file holds every parameter and buffer: a header (magic "MGPUNET1",
   version, tensor count), each tensor's shape and values, and a 64-bit
   FNV-1a checksum of everything before it. Loading a damaged file, another
   network's file or a file from another version is a one-line error. A
   save writes "<path>.tmp", flushes it to the disk (fsync) and renames it
   over path (over the file a link names, keeping its permissions): a save
   that fails (a full disk), or a crash, leaves the checkpoint before it
   as it was.
       void mgpu_checkpoint_save(const mgpu_net *net, const char *path, const mgpu_checkpoint_info *info)
       void mgpu_checkpoint_load(mgpu_net *net, const char *path, mgpu_checkpoint_info *info)
       void mgpu_checkpoint_read_info(const char *path, mgpu_checkpoint_info *info)
   A training checkpoint: all a training needs to go on, once loaded, bit
   for bit as if it had never stopped. Beside the parameters and buffers
   it holds the optimizer's state (SGD's momentum buffers, Adam's moments)
   and its count of steps (so the first step after a resume is not taken
   for the training's first, which sets the buffer to the gradient:
   torch.optim.SGD's rule), the random generator's place (mgpu_rand after
   the load draws what it would have drawn after the save), and the info
   (mgpu_checkpoint_info): the epoch and the batch in it to resume at, the
   steps so far, the number of processes it ran on (a program resumed on
   another number sees it, and decides), and the settings that decide the
   training's path (mgpu_train_settings): the model's name, the global
   batch, the training set's size and digest (mgpu_dataset_digest), the
   optimizer with its lr, momentum and weight decay, the data's seed, and
   the convolutions' method (MGPU_CONV) where the network has any. Resumed
   with another of these, a training would go on as another one, with no
   word: another batch size starts at another sample, another training
   set takes another order. mgpu_train_settings_of fills what the library
   can tell (the data, the optimizer, the method), the program the rest;
   mgpu_train_settings_differ names the first setting that differs, and
   mgpu_checkpoint_read_info reads the info without a network, so that a
   program compares the settings before the load (another model is then
   named, not found by its tensors' shapes). Saved after a step, loaded
   at start:
       mgpu_train_settings train = mgpu_train_settings_of(net, train_set);
       snprintf(train.model, sizeof train.model, "lenet");
       train.batch_size = batch_size, train.lr = lr, train.momentum = momentum, train.seed = seed;
       ...
       mgpu_checkpoint_info info = {epoch, batch + 1, step, world, train};
       if (rank == 0) mgpu_checkpoint_save(net, "train.ckpt", &info);
       ...
       char why[512];
       mgpu_checkpoint_read_info("train.ckpt", &info);
       if (mgpu_train_settings_differ(&info.train, &train, why, sizeof why))
           mgpu_fatal("train.ckpt was %s, or delete it to start afresh", why);
       mgpu_checkpoint_load(net, "train.ckpt", &info);
       for (int epoch = info.epoch; epoch < epochs; epoch++) {
           mgpu_sampler_set_epoch(s, epoch);
           mgpu_loader_start_epoch_at(it, epoch, epoch == info.epoch ? info.batch : 0);
           ...
   which refuses another batch size in one line: "train.ckpt was saved
   with --batch-size 64, this run has 128: resume with --batch-size 64, or
   delete it to start afresh". It is written as mgpu_net_save writes
   (whole, on the disk before the rename), with the magic "MGPUCKP1" and
   version 2, the training state after the header, ending in a checksum
   of the file up to it (the info read alone is checked too), the
   optimizer's state after the buffers (an empty momentum buffer before
   the first step with momentum), and the same checksum at the end. A
   missing, empty, truncated or damaged file, one of version 1 (which
   kept no settings), another network's, or mgpu_net_save's file (and a
   training checkpoint given to mgpu_net_load) is a one-line error naming
   the file and what is wrong, and leaves the network as it was: all of it
   is checked before anything is written. Bit for bit also needs the same
   computation: the same devices, and the convolutions computed the same
   way (MGPU_CONV=auto times the ways again in a new process, and may
   choose another, whose sums round differently: fix one,
   MGPU_CONV=im2col, where a resumed run must match to the bit).
       void mgpu_net_free(net)   the layers, parameters, buffers and scratch

       double mgpu_net_evaluate_accuracy(net, data, batch_size)
   (below) runs in evaluation mode and puts the net back in the mode it
   was in. */
typedef enum {
    MGPU_LAYER_CONV,
    MGPU_LAYER_BATCHNORM,
    MGPU_LAYER_RELU,
    MGPU_LAYER_RESIDUAL,
    MGPU_LAYER_AVG_POOL,
    MGPU_LAYER_GLOBAL_AVG_POOL,
    MGPU_LAYER_LINEAR,
    MGPU_LAYER_OWN       /* a layer of yours: mgpu_net_add_layer */
} mgpu_layer_kind;

typedef struct mgpu_layer mgpu_layer;
struct mgpu__layer_copies; /* the library's own (below, in the implementation) */
typedef struct mgpu_layer_fns {
    const char *kind;
    mgpu_shape (*output_shape)(const mgpu_layer *l, mgpu_shape x);
    void (*forward)(mgpu_layer *l, mgpu_tensor *y, const mgpu_tensor *x, int training);
    void (*backward)(mgpu_layer *l, mgpu_tensor *dx, mgpu_tensor *dweight, mgpu_tensor *dbias,
                     const mgpu_tensor *dy, const mgpu_tensor *x, const mgpu_tensor *y);
    int own_loops;
} mgpu_layer_fns;
#define MGPU_LAYER_KIND_MAX 32 /* characters of mgpu_layer_fns.kind */
struct mgpu_layer {
    mgpu_layer_kind kind;
    char name[40];
    /* settings */
    int in_channels, out_channels, kernel, stride, pad;
    int fuse_relu;            /* batch norm followed by ReLU, done in one pass */
    int batch_statistics;     /* batch norm: its last forward used the batch's statistics */
    int need_dinput;          /* 0 for the first layer: nothing before it wants dx */
    struct mgpu_group *sync;  /* batch norm: the group over whose batch its statistics are taken
                                 (mgpu_net_sync_batchnorm), or NULL */
    /* parameters: conv/linear weight and bias; batch norm gamma and beta */
    mgpu_param weight, bias;
    /* batch norm buffers, and what its backward pass needs */
    mgpu_tensor *running_mean, *running_var, *save_mean, *save_invstd;
    /* a residual block's layers (shortcut is NULL for the identity) */
    mgpu_layer *conv1, *bn1, *conv2, *bn2, *shortcut;
    /* activations of the last forward, kept for the backward */
    const mgpu_tensor *input;
    mgpu_tensor *output, *dinput, *dsum;
    /* the library's own: on a GPU, the channels-last copies of tensors
       that its fast convolutions read */
    struct mgpu__layer_copies *copies;
    /* a layer of yours: its functions, your settings, and where its
       backward writes the gradients that the network then adds up */
    const mgpu_layer_fns *fns;
    void *settings;
    mgpu_tensor *dweight, *dbias;
};

typedef struct mgpu_net {
    mgpu_device *device;
    int training;
    /* the arrays below grow as layers are added (their room: *_room) */
    int nlayers, layers_room;
    mgpu_layer **layers;
    int *first_param; /* layer i's parameters are params[first_param[i] ..] */
    int nparams, nbuffers, params_room, buffers_room;
    mgpu_param **params; /* pointers into the layers, in registration order */
    mgpu_tensor ***buffers;
    mgpu_tensor **momentum; /* SGD's momentum buffers, or Adam's first moments, made at the first step */
    mgpu_tensor **second_moment; /* Adam's (mgpu_net_use_adam), made at its first step */
    int adam, decoupled;    /* the optimizer: SGD, or Adam (AdamW when decoupled) */
    int sharded;            /* its optimizer's state is spread over a ZeRO wrapper's members */
    float beta1, beta2, eps;
    /* gradient checkpointing (mgpu_net_checkpoint): runs asked for (0, as made, or 1: none),
       and for the last forward pass, the runs' first layers (room for
       nlayers + 1) and which runs' activations it freed */
    int segments, nsegments;
    int *segment_start;
    unsigned char *segment_freed;
    int activations_freed; /* mgpu_net_free_activations since the last forward pass */
    mgpu_tensor **step_values;        /* a step's lists of the parameters' values */
    const mgpu_tensor **step_grads;   /* and gradients (mgpu_net_sgd, mgpu_net_zero_grad) */
    int steps;
    /* scratch of the training step */
    mgpu_tensor *losses, *dlogits, *loss_sum;
    /* while a data-parallel wrapper (1) or a pipeline (MGPU__HELD_BY_PIPELINE)
       holds the network: its layers are fixed, and it is freed after the
       wrapper */
    int wrapped;
    /* its parameters and buffers are another network's (a pipeline
       stage's micro-batch slot): freed with that one */
    int shares_params;
    /* counts the calls that may have changed its values: mgpu_net_load,
       mgpu_net_sgd, mgpu_net_copy_params into it, and mgpu_net_param and
       mgpu_net_buffer, which hand out what can be written. A wrapper's
       other replicas copy replica 0 again when it moved between steps. */
    unsigned changes;
} mgpu_net;

MGPU_DEF mgpu_net *mgpu_net_new(mgpu_device *dev);
MGPU_DEF mgpu_layer *mgpu_net_add_conv(mgpu_net *net, int in_channels, int out_channels, int kernel, int stride,
                                       int pad);
MGPU_DEF mgpu_layer *mgpu_net_add_batchnorm(mgpu_net *net, int channels);
MGPU_DEF mgpu_layer *mgpu_net_add_relu(mgpu_net *net);
MGPU_DEF mgpu_layer *mgpu_net_add_avg_pool(mgpu_net *net, int kernel);
MGPU_DEF mgpu_layer *mgpu_net_add_global_avg_pool(mgpu_net *net);
MGPU_DEF mgpu_layer *mgpu_net_add_residual(mgpu_net *net, int in_channels, int out_channels, int stride);
MGPU_DEF mgpu_layer *mgpu_net_add_linear(mgpu_net *net, int in_features, int out_features);
MGPU_DEF mgpu_layer *mgpu_net_add_layer(mgpu_net *net, const mgpu_layer_fns *fns, mgpu_tensor *weight,
                                        mgpu_tensor *bias, void *settings);
MGPU_DEF mgpu_net *mgpu_resnet18(int num_classes, int in_channels, mgpu_device *dev);
MGPU_DEF mgpu_net *mgpu_lenet(mgpu_device *dev);
MGPU_DEF mgpu_tensor *mgpu_net_forward(mgpu_net *net, const mgpu_tensor *x);
MGPU_DEF void mgpu_net_backward(mgpu_net *net, const mgpu_tensor *dlogits);
MGPU_DEF void mgpu_net_zero_grad(mgpu_net *net);
MGPU_DEF void mgpu_net_set_training(mgpu_net *net, int training);
#define MGPU_SEGMENTS_SQRT (-1) /* mgpu_net_checkpoint: about sqrt(n) runs of n layers */
MGPU_DEF void mgpu_net_checkpoint(mgpu_net *net, int segments);
MGPU_DEF void mgpu_net_free_activations(mgpu_net *net);
MGPU_DEF void mgpu_net_want_input_grad(mgpu_net *net, int on);
MGPU_DEF mgpu_tensor *mgpu_net_input_grad(mgpu_net *net);
MGPU_DEF void mgpu_net_sgd(mgpu_net *net, float lr, float momentum, float weight_decay);
MGPU_DEF void mgpu_net_use_adam(mgpu_net *net, float beta1, float beta2, float eps, int decoupled);
MGPU_DEF void mgpu_net_step(mgpu_net *net, float lr, float momentum, float weight_decay);
MGPU_DEF void mgpu_net_loss_backward(mgpu_net *net, const mgpu_tensor *logits,
                                     const mgpu_tensor *labels, float scale,
                                     mgpu_tensor *loss_sum);
MGPU_DEF void mgpu_net_train_step(mgpu_net *net, const mgpu_tensor *x, const mgpu_tensor *labels,
                                  float lr, float momentum, float weight_decay,
                                  mgpu_tensor *loss_sum);
MGPU_DEF int mgpu_net_num_params(const mgpu_net *net);
MGPU_DEF mgpu_param *mgpu_net_param(mgpu_net *net, int i);
MGPU_DEF int mgpu_net_num_buffers(const mgpu_net *net);
MGPU_DEF mgpu_tensor *mgpu_net_buffer(mgpu_net *net, int i);
MGPU_DEF size_t mgpu_net_num_weights(const mgpu_net *net);
MGPU_DEF mgpu_net *mgpu_net_replicate(const mgpu_net *net, mgpu_device *dev);
MGPU_DEF void mgpu_net_copy_params(mgpu_net *dst, const mgpu_net *src, int with_buffers);
MGPU_DEF void mgpu_net_save(const mgpu_net *net, const char *path);
MGPU_DEF void mgpu_net_load(mgpu_net *net, const char *path);
/* What decides the path of a training, beside the network's values: a
   training resumed with another of these would go on as another one
   (other batches, another model, other steps). The names are strings of
   under MGPU_SETTING_BYTES bytes: room for Adam's with its constants in
   full. */
#define MGPU_SETTING_BYTES 96
typedef struct mgpu_train_settings {
    char model[MGPU_SETTING_BYTES]; /* the model's name, as the program's --model says it ("lenet") */
    int batch_size;                 /* the global batch: one step's samples, over all processes */
    int samples;                    /* the training set's size */
    uint64_t data;                  /* and its digest (mgpu_dataset_digest) */
    char optimizer[MGPU_SETTING_BYTES]; /* "SGD", "Adam (betas 0.9, 0.999, eps 1e-08)" or "AdamW (...)" */
    float lr, momentum, weight_decay;   /* the steps' (mgpu_net_step) */
    uint64_t seed;                  /* the data's seed (mgpu_sampler_new, mgpu_loader_new) */
    char conv[MGPU_SETTING_BYTES];  /* the convolutions' method (MGPU_CONV), "" for a network without any */
} mgpu_train_settings;
/* The settings the library can tell of a training of net on train_set:
   samples, data, optimizer and conv, the rest zero for the program to set. */
MGPU_DEF mgpu_train_settings mgpu_train_settings_of(const mgpu_net *net, const mgpu_dataset *train_set);
/* 0 when a training saved with `saved` goes on the same path with `now`;
   else 1, with the first setting that differs in why, named as the
   chapters' flags name it: "saved with --batch-size 64, this run has 128:
   resume with --batch-size 64". */
MGPU_DEF int mgpu_train_settings_differ(const mgpu_train_settings *saved, const mgpu_train_settings *now,
                                        char *why, size_t size);
/* Where a training stands and how it is set, kept in its checkpoint beside
   the network. */
typedef struct mgpu_checkpoint_info {
    int epoch;                 /* the epoch to resume in */
    int batch;                 /* and its batch to resume at (mgpu_loader_start_epoch_at) */
    long step;                 /* the training's steps so far */
    int world;                 /* the processes it ran on (for the program to see: another number that
                                  divides the batch sees the same batches) */
    mgpu_train_settings train; /* what decides its path */
} mgpu_checkpoint_info;
MGPU_DEF void mgpu_checkpoint_save(const mgpu_net *net, const char *path, const mgpu_checkpoint_info *info);
MGPU_DEF void mgpu_checkpoint_load(mgpu_net *net, const char *path, mgpu_checkpoint_info *info);
/* The info alone, without a network: to compare the settings before the load. */
MGPU_DEF void mgpu_checkpoint_read_info(const char *path, mgpu_checkpoint_info *info);
MGPU_DEF void mgpu_net_free(mgpu_net *net);
/* Counts, on the net's device, the rows of logits whose argmax is the label,
   over a whole data set in evaluation mode; returns the accuracy. */
MGPU_DEF double mgpu_net_evaluate_accuracy(mgpu_net *net, const mgpu_dataset *data, int batch_size);
/* Gradient check, as torch.autograd.gradcheck, for a whole network or a
   layer alone (a network of that one layer: mgpu_net_new, then
   mgpu_net_add_layer or mgpu_net_add_*):
       mgpu_gradcheck_result r = mgpu_net_gradcheck(net, x, max_values, stdout);
   The loss is L = sum_i p_i y_i over the network's output y for x, with
   fixed random weights p (so that every output counts). The backward
   pass gives dL/dx and dL/d(each parameter); central differences give
   the same slopes, (L(v + h) - L(v - h)) / 2h for a value v, L summed in
   double, with h = 1e-2 max(1, |v|) (float32 values: a smaller step
   drowns in rounding), and at h / 4, combined as (16 s(h / 4) - s(h)) /
   15 (Richardson's extrapolation: the h^2 part of the error cancels).
   They must agree within 1e-3 + 1e-2 |slope| plus what float32's
   rounding of the outputs does to the differences (8 epsilons of
   sum |p_i y_i|, over h, times 5). A ReLU's kink (or a max's) within h of
   a value bends the line there, and the slopes at h and h / 4 disagree
   by more than that: the check then steps by h / 4, if that agrees with
   h / 16. A value whose slopes disagree at every step is not judged,
   but counted as near a kink and named in the report. Of each tensor,
   max_values values are tried (all of them if it has no more), spread
   evenly. The report (NULL: none) gets a line for each value that
   failed or sat near a kink and a last line with the counts. It runs the
   network in its mode, so in training mode batch norm's running
   statistics move with each forward pass; the parameters and x are left
   as they were. */
typedef struct mgpu_gradcheck_result {
    int checked, failed, near_kinks; /* values judged, beyond the tolerance, not judged */
    double worst;                    /* the largest error over its tolerance (<= 1: passed) */
} mgpu_gradcheck_result;
MGPU_DEF mgpu_gradcheck_result mgpu_net_gradcheck(mgpu_net *net, const mgpu_tensor *x, int max_values,
                                                  FILE *report);
/* The book's evaluate_accuracy_gpu for any model: the fraction of a data
   set that forward(model, x) classifies right, running on dev, in batches
   of batch_size in the data set's order. forward returns the logits. */
typedef mgpu_tensor *(*mgpu_forward_fn)(void *model, const mgpu_tensor *x);
MGPU_DEF double mgpu_evaluate_accuracy(mgpu_forward_fn forward, void *model, mgpu_device *dev,
                                       const mgpu_dataset *data, int batch_size);
/* ---------------------------------------------------------------------------
   DATA PARALLELISM. mgpu_data_parallel is the library's nn.DataParallel: one replica of a
   network per device; each step scatters the batch (ceil(N/k) rows each),
   runs forward and backward on every device's queue at the same time,
   combines the gradients and updates, so the replicas stay identical
   (with MGPU_DP_GATHER, below, the others get device 0's parameters at
   the start of each step: between steps they hold the step before's).

       mgpu_data_parallel *mgpu_data_parallel_new(mgpu_net *net, mgpu_device *const *devices,
                                                  int n, mgpu_dp_mode mode);
   net must live on devices[0]; it becomes replica 0 (the seed's `.module`,
   mgpu_data_parallel_module) and the wrapper copies it to the others.
   What you do to net between steps reaches them at the start of the next
   step: its training mode, and its values when you load a checkpoint
   into it, train it alone (mgpu_net_train_step, mgpu_net_sgd), or write
   them through a pointer that mgpu_net_param or mgpu_net_buffer gave you
   since the last step. (Writes through older pointers, or the layer
   structs, are not seen: fetch the pointer again.) Its layers are fixed
   while the wrapper holds it (adding one is an error).
   mgpu_data_parallel_free frees the copies, not net: free net yourself,
   after the wrapper. Each device holds one replica: a device given twice
   is an error (mgpu_devices makes virtual devices where you want more).
   Two ways to combine the gradients:
     MGPU_DP_GATHER     what torch.nn.DataParallel does: every step the
                        parameters are broadcast from device 0, the logits
                        gathered on device 0 for the loss, and every
                        replica's gradients summed into device 0, which
                        alone runs the optimiser. Device 0 holds the full
                        batch's logits and a staging copy of every other
                        device's gradients: it needs more memory than the
                        others.
     MGPU_DP_ALLREDUCE  what DistributedDataParallel does: the gradients are
                        allreduced (NCCL between distinct GPUs, else the
                        ring), every replica runs the same SGD step, and no
                        device carries more than the others.
   Batch norm uses each device's own shard statistics (as PyTorch's
   DataParallel does); the running statistics used for evaluation are
   device 0's, updated from device 0's shard only. A batch with fewer
   rows than there are devices (an epoch's short last batch: 1 row on 2
   devices) runs on the devices that get rows, as PyTorch's does; in
   MGPU_DP_ALLREDUCE mode the others join the reduction with zero
   gradients and take the same update, so the replicas stay the same.

       void mgpu_data_parallel_step(dp, X, y, lr, momentum, weight_decay);
   one SGD step on the mean cross-entropy of the whole batch X [N,...],
   y [N] (on any device; usually pinned host memory from the loader). The
   shards go into two sets of buffers the wrapper keeps, used in turn, so
   that a step's batch is copied while the step before still computes.
   Like mgpu_net_train_step, the step writes the gradients (no zero_grad).
       void mgpu_data_parallel_take_stats(dp, &loss_sum, &correct);
   the summed loss and the number of right predictions of the steps since
   the last call (this waits for them), as the book's training loops count.
       const char *mgpu_data_parallel_algorithm(dp);  "gather", "ring", "nccl", "none",
                                              or yours (below); "(not run yet)" before
                                              the first step

   In MGPU_DP_ALLREDUCE mode the gradients travel in buckets, as in
   PyTorch's DDP: each replica's gradients become views into a few flat
   tensors of about 25 MiB, filled from the last layer back; the reduction
   of a bucket starts on the communication queues as soon as the backward
   pass has produced it, and runs while the backward of the earlier layers
   goes on; the optimiser waits for the last bucket. Before the first step,
       void mgpu_data_parallel_configure(dp, bucket_bytes, overlap, reduce);
   sets the bucket size, overlap 0 to reduce only after the whole backward
   pass, and reduce 0 to skip the reduction (to time what it costs: the
   replicas then drift apart).
       void mgpu_data_parallel_use_allreduce(dp, fn, name);
   makes the reduction yours (the "implement ring allreduce" assignment,
   then train with it): fn(buckets, n) must leave in every one of the n
   tensors (one a device, the same shape) the sum of all n, as
   mgpu_allreduce (the book's) does, which you can pass to compare. It is
   called on the calling thread as each bucket completes, and is made of
   the library's operations (mgpu_narrow, mgpu_to, mgpu_copy, mgpu_add_,
   ...), which order themselves after the backward pass that produced the
   bucket. mgpu_data_parallel_algorithm then says name. MGPU_DP_ALLREDUCE
   mode only, before the first step.
       void mgpu_data_parallel_check_replicas(dp, 1);   or MGPU_CHECK_REPLICAS=1
   a debugging aid: after every step of MGPU_DP_ALLREDUCE mode, each
   replica's parameters are compared, by a checksum of their bits, with
   device 0's, and the first that differs stops the program with a line
   naming the step, the parameter, its layer and the two devices. A
   reduction that does nothing, or sums on some devices only, lets the
   replicas drift apart and train on different models without any other
   sign. It reads every parameter back every step: slow, for debugging.

       void mgpu_data_parallel_zero(dp, stage);         before the first step
   shards the optimizer among the W members, the wrapper's devices (or a
   distributed wrapper's ranks, one device each), as DeepSpeed's ZeRO:
   each bucket (padded with zeros to W equal chunks) is cut in W chunks,
   and member m keeps the optimizer's state (SGD's momentum, Adam's
   moments) of chunk m alone, updates chunk m of the parameters, and the
   updated chunks are then gathered into every member's parameters (which
   become views into flat buckets, as the gradients are). Stage 1: the
   gradients are allreduced as without ZeRO; the optimizer's state per
   member falls from S to S/W. Stage 2: each bucket is reduce-scattered as
   soon as the backward pass has made it, each member keeps its own chunk
   of the gradient, and the whole bucket is freed: the gradients held
   between steps fall from G to G/W too (a bucket's whole gradient lives
   only while the backward pass fills it, so there is no gradient to read
   in param.grad between steps). The updates are the same operations on
   the same numbers, so the parameters stay those of the unsharded
   wrapper (bit for bit where the sums' order is the same: 2 devices, or
   ranks). mgpu_data_parallel_accumulate works with stage 1, not 2; a
   checkpoint of a sharded network is refused until the wrapper is freed,
   which gathers the state back into the module. Stage 3 (the parameters
   sharded too) is not built. */
typedef enum { MGPU_DP_GATHER, MGPU_DP_ALLREDUCE } mgpu_dp_mode;
typedef struct mgpu_data_parallel mgpu_data_parallel;
MGPU_DEF mgpu_data_parallel *mgpu_data_parallel_new(mgpu_net *net, mgpu_device *const *devices,
                                                    int n, mgpu_dp_mode mode);
MGPU_DEF mgpu_net *mgpu_data_parallel_module(mgpu_data_parallel *dp);
MGPU_DEF mgpu_net *mgpu_data_parallel_replica(mgpu_data_parallel *dp, int i);
MGPU_DEF void mgpu_data_parallel_step(mgpu_data_parallel *dp, const mgpu_tensor *X,
                                      const mgpu_tensor *y, float lr, float momentum,
                                      float weight_decay);
MGPU_DEF void mgpu_data_parallel_take_stats(mgpu_data_parallel *dp, double *loss_sum,
                                            double *correct);
MGPU_DEF const char *mgpu_data_parallel_algorithm(const mgpu_data_parallel *dp);
MGPU_DEF void mgpu_data_parallel_configure(mgpu_data_parallel *dp, size_t bucket_bytes,
                                           int overlap, int reduce);
typedef void (*mgpu_allreduce_fn)(mgpu_tensor **data, int n);
MGPU_DEF void mgpu_data_parallel_use_allreduce(mgpu_data_parallel *dp, mgpu_allreduce_fn fn,
                                               const char *name);
MGPU_DEF void mgpu_data_parallel_check_replicas(mgpu_data_parallel *dp, int on);
MGPU_DEF void mgpu_data_parallel_zero(mgpu_data_parallel *dp, int stage);
MGPU_DEF void mgpu_data_parallel_free(mgpu_data_parallel *dp);

/* ---------------------------------------------------------------------------
   PIPELINES. A network cut into stages on several devices
   ---------------------------------------------------------------------------
   Data parallelism puts the whole network on every device. When it does
   not fit on one, it is cut instead (model parallelism): consecutive
   layers, a stage, on each device; the activations go forward from stage
   to stage and their gradients come back.

       int first[] = {0, 6};                     stage 1 starts at layer 6
       mgpu_pipeline *pp = mgpu_pipeline_new(net, devices, 2, first);
       mgpu_pipeline_set_schedule(pp, mgpu_schedule_1f1b, 4);  4 micro-batches
       ... mgpu_pipeline_train_step(pp, b.x, b.y, lr, momentum, wd, loss_sum);
       mgpu_pipeline_free(pp);                  the trained values back in net

   Naive model parallelism: the whole batch goes through stage 0, then
   stage 1, ..., then the backward passes come back. Stage s + 1 waits for
   stage s, so one device works at a time and the others idle.

   Micro-batches (GPipe). The batch is cut into m micro-batches, and stage
   s works on micro-batch j while stage s + 1 works on j - 1. Every stage
   runs all m forward passes, then all m backward passes; the gradients
   add up over the micro-batches, and one optimiser step follows. With p
   stages taking equal times, each stage idles p - 1 slots at the start
   and p - 1 at the end of m + p - 1: the bubble, a fraction
   (p - 1) / (m + p - 1) of the time. m = 1 is naive model parallelism.

   1F1B (PipeDream-Flush, as in Megatron-LM). GPipe keeps the activations
   of all m micro-batches on every stage until their backward passes.
   1F1B starts each backward pass as early as it can: stage s runs
   p - s - 1 forward passes (the warm-up), then one forward and one
   backward in turn, then the backward passes left. The bubble is GPipe's,
   but stage s never holds the activations of more than min(m, p - s)
   micro-batches.

   A schedule is the order of each stage's passes, given by a function:
       typedef struct mgpu_pipeline_pass { int backward, micro_batch; } mgpu_pipeline_pass;
       void schedule(int stage, int stages, int micro_batches, mgpu_pipeline_pass *order);
   writes the 2m passes of `stage` into order, in the order it runs them.
   mgpu_schedule_gpipe and mgpu_schedule_1f1b are the library's; a schedule
   of your own is checked: every pass once, each micro-batch's backward
   after its forward, and no stage waiting for a pass that waits for it
   (a one-line error naming the stages and passes).

   What a step does. The host enqueues every stage's passes in their
   order, each on its stage's device, with the copies between stages
   (manual section 4: a copy waits for its source and its destination),
   and returns: the devices then run the schedule by themselves. Each
   micro-batch's loss is scaled by 1/N, N the batch's rows, so the
   gradients are the whole batch's mean loss's. A stage keeps, for each
   micro-batch in flight, a copy of its layers (a slot) with that
   micro-batch's activations, sharing the parameters, their gradients and
   batch norm's buffers: m slots under GPipe, min(m, p - s) under 1F1B.
   (On a GPU each slot also keeps its convolutions' channels-last copies
   of the weights, which its forward pass remakes: parameters' memory
   that grows with the slots.) A micro-batch's activations and input on a
   stage are freed when its backward pass there is done.

   Batch norm over micro-batches. Each micro-batch is normalised with its
   own statistics, and the running statistics move once per micro-batch,
   in the order of the stage's forward passes, micro-batch order under
   GPipe and 1F1B (PyTorch's pipelines do the same): a pipeline trains as
   one device that runs the micro-batches one after the other, adding up
   their gradients, not as one device on the whole batch. Without batch
   norm the two are the same, up to the order of the sums.

       mgpu_pipeline *mgpu_pipeline_new(mgpu_net *net, mgpu_device *const *devices, int stages,
                                        const int *first_layers)
   stage s takes layers first_layers[s] .. first_layers[s + 1] - 1 of net,
   on devices[s] (first_layers[0] is 0; NULL: as equal numbers of layers as
   can be). Each stage is a network of its own (mgpu_pipeline_stage), made
   of copies of net's layers with their values, buffers and optimizer
   state; net is held, unchanged, until mgpu_pipeline_free copies the
   trained state back. Refused, by name: more stages than layers, a first
   layer that does not exist or does not come after the one before, a
   device twice.
       void mgpu_pipeline_set_schedule(pp, schedule, micro_batches)
   the default is mgpu_schedule_gpipe with 1 micro-batch: naive.
       void mgpu_pipeline_forward_backward(pp, x, labels, loss_sum)
   runs the schedule on one batch: x [N, ...] and labels [N], on the host
   or any device, N at least the micro-batches (cut as torch.tensor_split
   cuts: the first N mod m micro-batches get a row more). It writes every
   stage's gradients, and adds the batch's summed loss to loss_sum (NULL:
   not wanted; else [1] on the last stage's device).
       void mgpu_pipeline_step(pp, lr, momentum, weight_decay)
   every stage's optimiser step (mgpu_net_step). mgpu_pipeline_train_step
   (pp, x, labels, lr, momentum, weight_decay, loss_sum) does both.
       void mgpu_pipelines_average_grads(mgpu_pipeline *const *pipes, int n)
   data parallelism over n pipelines of the same cut (hybrid parallelism):
   each stage's gradients averaged over the pipelines by a ring allreduce
   (manual COMMUNICATION), between forward_backward and step, and batch
   norm's running statistics made pipeline 0's everywhere (as DDP
   broadcasts rank 0's); each pipeline takes its share of the global batch.
       mgpu_pipeline *mgpu_pipeline_new_group(mgpu_net *net, struct mgpu_group *g, const int *first_layers)
   the stages in the processes of a group (DISTRIBUTED), one a rank:
   every rank builds the same net on its device and calls it, and rank r
   keeps stage r (the group's size is the number of stages). Every rank
   then calls every function below with the same arguments (the same
   batch: rank 0 reads x's values, the last rank the labels, the others
   their shapes); the stages send their activations and gradients with
   the group's send and receive, in an order every rank derives from the
   schedule, so that no two ranks wait for each other. loss_sum is the
   last rank's; mgpu_pipeline_stage(pp, s) exists on rank s alone, and
   mgpu_pipeline_measure times this rank's stage. mgpu_pipeline_free
   gives each rank's net its own stage's trained state (the rest of it is
   the other ranks').
       mgpu_tensor *mgpu_pipeline_forward(pp, x)
   the stages' forward passes one after the other, in the mode set by
   mgpu_pipeline_set_training (for evaluation): the logits, on the last
   stage's device, valid until the next pass.
       double mgpu_pipeline_evaluate_accuracy(pp, data, batch_size)
       mgpu_net *mgpu_pipeline_stage(pp, s)     stage s's network
       int mgpu_pipeline_slots(pp, s)           its slots under the schedule
       void mgpu_pipeline_free(pp)

   Measuring a step. Every operation of micro-batch j's forward pass on a
   stage is labelled "F<j>" in the trace, of its backward pass "B<j>"
   (mgpu_trace_label), so a step between mgpu_trace_begin and
   mgpu_trace_end tells where the time went:
       mgpu_pipeline_timing t = mgpu_pipeline_measure(pp);
   t.span_ms from the first labelled operation's start to the last one's
   end; per stage, t.busy_ms[s] (its compute queue's labelled operations)
   and t.bubble[s] = 1 - busy / span; t.bubble_mean, their mean, beside
   mgpu_pipeline_bubble_formula(p, m), (p - 1) / (m + p - 1).
       int mgpu_pipeline_write_timeline(pp, path, title)
   draws it: a lane per stage, a bar per pass (F and B in two colours,
   numbered by micro-batch); the bubbles are the gaps. */
typedef struct mgpu_pipeline mgpu_pipeline;
typedef struct mgpu_pipeline_pass { int backward, micro_batch; } mgpu_pipeline_pass;
typedef void (*mgpu_schedule_fn)(int stage, int stages, int micro_batches, mgpu_pipeline_pass *order);
MGPU_DEF void mgpu_schedule_gpipe(int stage, int stages, int micro_batches, mgpu_pipeline_pass *order);
MGPU_DEF void mgpu_schedule_1f1b(int stage, int stages, int micro_batches, mgpu_pipeline_pass *order);
MGPU_DEF mgpu_pipeline *mgpu_pipeline_new(mgpu_net *net, mgpu_device *const *devices, int stages,
                                          const int *first_layers);
MGPU_DEF mgpu_pipeline *mgpu_pipeline_new_group(mgpu_net *net, struct mgpu_group *g, const int *first_layers);
MGPU_DEF void mgpu_pipeline_set_schedule(mgpu_pipeline *pp, mgpu_schedule_fn schedule, int micro_batches);
MGPU_DEF void mgpu_pipeline_forward_backward(mgpu_pipeline *pp, const mgpu_tensor *x, const mgpu_tensor *labels,
                                             mgpu_tensor *loss_sum);
MGPU_DEF void mgpu_pipeline_step(mgpu_pipeline *pp, float lr, float momentum, float weight_decay);
MGPU_DEF void mgpu_pipeline_train_step(mgpu_pipeline *pp, const mgpu_tensor *x, const mgpu_tensor *labels,
                                       float lr, float momentum, float weight_decay, mgpu_tensor *loss_sum);
MGPU_DEF void mgpu_pipelines_average_grads(mgpu_pipeline *const *pipes, int n);
MGPU_DEF void mgpu_pipeline_set_training(mgpu_pipeline *pp, int training);
MGPU_DEF mgpu_tensor *mgpu_pipeline_forward(mgpu_pipeline *pp, const mgpu_tensor *x);
MGPU_DEF double mgpu_pipeline_evaluate_accuracy(mgpu_pipeline *pp, const mgpu_dataset *data, int batch_size);
MGPU_DEF int mgpu_pipeline_num_stages(const mgpu_pipeline *pp);
MGPU_DEF mgpu_net *mgpu_pipeline_stage(mgpu_pipeline *pp, int s);
MGPU_DEF int mgpu_pipeline_slots(const mgpu_pipeline *pp, int s);
typedef struct mgpu_pipeline_timing {
    int stages;
    double span_ms;
    double busy_ms[MGPU_MAX_DEVICES], bubble[MGPU_MAX_DEVICES];
    double bubble_mean;
} mgpu_pipeline_timing;
MGPU_DEF mgpu_pipeline_timing mgpu_pipeline_measure(const mgpu_pipeline *pp);
MGPU_DEF double mgpu_pipeline_bubble_formula(int stages, int micro_batches);
MGPU_DEF int mgpu_pipeline_write_timeline(const mgpu_pipeline *pp, const char *path, const char *title);
MGPU_DEF void mgpu_pipeline_free(mgpu_pipeline *pp);

/* ---------------------------------------------------------------------------
   DISTRIBUTED. One process per device, on one machine or several (MPI)
   ---------------------------------------------------------------------------
   Chapters 1 to 3 run every device inside one process. A real trainer runs
   one process per device (PyTorch's DistributedDataParallel), started by
   a launcher on one machine or many:
       mpirun -np 4 ./train                     4 processes here
       mpirun -H a:2,b:2 ./train                2 on host a, 2 on host b
       srun -N 2 --ntasks-per-node=2 ./train    under Slurm
   The processes are a group (mgpu_group); each is a rank, 0 .. size-1.
   Built without MPI (the Makefile adds it where mpi.h is found), or
   started without a launcher, a program is a group of one, and every
   call below works (a collective of one rank changes nothing). A
   training program, whole (the batch and the learning rate are the
   global batch's, as one process with all of it would have them):

       mgpu_group *world = mgpu_dist_init(&argc, &argv);
       int rank = mgpu_group_rank(world), size = mgpu_group_size(world);
       mgpu_device *dev = mgpu_group_device(world, use_gpu);
       mgpu_net *net = ...;                           the same on every rank
       mgpu_data_parallel *ddp = mgpu_distributed_data_parallel_new(net, world);
       mgpu_sampler *s = mgpu_sampler_new(train->n, size, rank, 1, seed, 0);
       mgpu_loader *it = mgpu_loader_new(train, batch / size, 0, seed);
       mgpu_loader_set_sampler(it, s);
       for (int epoch = 0; epoch < epochs; epoch++) {
           mgpu_sampler_set_epoch(s, epoch);
           mgpu_loader_start_epoch(it, epoch);
           mgpu_batch b;
           while (mgpu_loader_next(it, &b)) mgpu_data_parallel_step(ddp, b.x, b.y, lr, 0, 0);
           double stats[2];                           this rank's loss sum, right answers
           mgpu_data_parallel_take_stats(ddp, &stats[0], &stats[1]);
           mgpu_group_sum_host(world, stats, 2);      every rank's
           double acc = mgpu_dist_evaluate_accuracy(world, net, test, 256);
           if (rank == 0) printf(...);
       }
       ... free them ...
       mgpu_dist_finalize(world);

   mgpu_dist_init starts MPI when a launcher started the program (it sees
   Open MPI's, PMI's or Slurm's variables), and returns the world group.
   The local rank, the process's place among those on its machine, comes
   from MPI_Comm_split_type(MPI_COMM_TYPE_SHARED). mgpu_group_device gives
   each process its device: GPU local_rank % gpus where the machine has
   GPUs (use_gpu 1), else the CPU, whose cores the processes on one
   machine share (each takes cores / local_size of them, as mgpu_devices
   shares them between CPU devices). mgpu_group_devices(g, use_gpu, n,
   out) gives a process n devices (the hybrid case, below): GPUs
   local_rank * n + i mod gpus (virtual ones where it needs more than
   there are), or n CPU devices with cores / (local_size * n) each; it
   returns n. mgpu_group_first(g, n) is the group of ranks 0 .. n-1 (NULL
   on the others), to run the same work on fewer processes (chapter 4's
   scaling table). Every rank of g calls it, and every member calls
   mgpu_group_free (which first waits for the devices) when done with the
   group.

   Collectives. Every rank of the group calls the same collectives in the
   same order, each with a tensor on its own device:
       mgpu_group_allreduce(g, t, MGPU_SUM or MGPU_MEAN)  every rank gets the sum
                                            (or the mean) of every rank's t
       mgpu_group_broadcast(g, t, root)     every rank gets root's t
       mgpu_group_all_gather(g, in, out)    out = in of rank 0, rank 1, ... in a row
       mgpu_group_reduce_scatter(g, in, out, op)  out = chunk `rank` of the
                                            sum of the in's (in: size * out's elements)
       mgpu_group_send(g, t, to)  mgpu_group_recv(g, t, from)  one rank to another
                                            (only those two call it)
       mgpu_group_barrier(g)                waits until every rank has got
                                            here and its devices are done
   They run on the device's communication queue, ordered like chapter 3's
   collectives: each starts when the compute queue has produced t, and
   the compute queue waits for its result, so the next operation on t
   sees it. mgpu_group_allreduce_start(g, t, op) leaves out that last
   wait (chapter 3's mgpu_allreduce_start): mgpu_comm_wait(&dev, 1) adds it.
   A group's collectives go to one device's queue at a time: use a group
   for one device. Each returns, and mgpu_group_path(g, dev) says, the
   way the data went:
     "mpi"           MPI between CPU processes, straight from the tensors;
     "mpi via host"  GPU tensors copied to host memory, through MPI, and
                     back, with the calling thread waiting for it: the
                     way between GPUs of different processes (those that
                     share a GPU too), so on GPUs a bucket's reduction
                     does not overlap the backward pass;
     "none"          a group of one.
   The allreduce is a reduce-scatter then an all-gather, as the ring of
   chapter 3: rank r receives chunk r of every rank's vector, adds them in
   rank order (0, 1, 2, ...) and sends the sum to every rank. So every
   rank gets the same bits, whatever the network did, and the replicas of
   a distributed model never drift apart.
   For numbers on the host (losses, counts, checksums):
       mgpu_group_sum_host(g, values, n)   values[i] (doubles) summed over the ranks, in place
       mgpu_group_all_gather_host(g, mine, bytes, all)   every rank's `bytes` bytes at
                                           mine, rank r's at all + r * bytes

   Faults. A distributed job must end, not hang, when something is wrong:
   - Before each collective the ranks compare what they are about to do
     (its number in the group's sequence, kind, length, root and sum or
     mean). A rank that calls something else (a bug: one rank skipped a
     step) stops the job with one line naming both calls and the ranks.
   - Every wait on other ranks (a collective, a send or receive, a
     barrier, the host's all-gathers) is watched. A rank that has waited
     MGPU_DIST_TIMEOUT seconds (default 120) asks the ranks it waits for,
     through a watcher thread that each process runs, what they do. It
     goes on waiting for a rank that is busy (its count of operations
     launched still moves: ranks left out of a sub-group's run wait at
     a barrier as long as the run takes); a rank that does not answer
     (stopped or dead) or makes no progress for the timeout (hung, or
     waiting in another collective) stops the job with one line from the
     lowest rank that waits:
       rank 2 (host h, pid 4242) did not reach barrier #7 within 120 s
       (MGPU_DIST_TIMEOUT): it does not answer (stopped, or dead)
     Collectives of devices' tensors are numbered in one sequence, the
     host's (barriers, all-gathers) in another.
   - A rank that dies (killed, or an error: every error line starts with
     "rank r:") makes the launcher stop the others; each says which
     collective it was in, and mpirun names the rank that died. (Under
     Slurm, srun --kill-on-bad-exit does the same.)
   - An error that every rank meets alike (a bad flag or setting, a
     missing file, memory that no rank has) is said once: rank 0 writes
     the line, and the other ranks wait, silent, for the launcher to stop
     them (5 s; a rank still running then had an error of its own, and
     says it). mgpu_group_fatal(g, format, ...) is mgpu_fatal for a
     mistake that every rank of g sees at once: rank 0 alone writes it.
   MPI's start and end, and the making of groups (mgpu_group_first), are
   blocking MPI calls: a rank that does not come to them within the
   timeout ends its process with one line. Call them on every rank.

   Data parallelism across processes (PyTorch's DistributedDataParallel):
       mgpu_data_parallel *ddp = mgpu_distributed_data_parallel_new(net, g);
   wraps net (on this rank's device) like mgpu_data_parallel_new, with one
   replica a process. At construction the ranks check that they built
   the same network (the shapes of its parameters and buffers; a rank
   that differs is named); rank 0's parameters, buffers and SGD state
   (momentum buffers and count of steps) are broadcast, and a checksum of
   every rank's values is compared. So a checkpoint (mgpu_checkpoint_save,
   NETWORKS) is written by rank 0 and needs loading on rank 0 alone,
   before the wrapper is made. Then mgpu_data_parallel_step(ddp, X, y,
   ...) takes this rank's share of the global batch (mgpu_sampler and
   mgpu_loader_set_sampler deal it out): each rank's loss is the mean
   over its rows, and the gradients are averaged over the ranks in
   buckets, from the last layer back, each bucket's allreduce running
   while the backward pass of the earlier layers goes on (chapter 3's
   buckets and mgpu_data_parallel_configure; a network smaller than a
   bucket has one bucket, reduced after the whole backward pass), and
   every rank takes the same SGD step. Batch norm uses each process's own
   statistics; rank 0's running statistics are broadcast to the others
   at the start of each step (as DDP's broadcast_buffers) and before a
   distributed evaluation. mgpu_data_parallel_take_stats gives this
   rank's numbers: add them up with mgpu_group_sum_host.
       mgpu_net_sync_batchnorm(net, g)      before the wrapper is made
   is PyTorch's SyncBatchNorm: every batch norm of net (the residual
   blocks' too) takes its training statistics over the whole group's
   batch. Each forward pass all-gathers every rank's count, mean and sum
   of squared deviations of each channel and merges them in rank order
   (the same bits on every rank); each backward pass allreduces the two
   sums that the input gradient needs (dgamma and dbeta stay this rank's,
   averaged by the wrapper as any gradient). So k ranks train like one
   process with the global batch, batch norm included, where each rank's
   own statistics would normalise by its own few rows. The cost: two
   collectives per batch norm per step, which the calling thread waits
   for. Evaluation uses the running statistics, with no collective. Every
   rank must run each training pass (as the wrapper does), and each
   process must have one device: a wrapper of several devices refuses a
   synchronised network, as PyTorch's does.
       mgpu_data_parallel_accumulate(dp, X, y)
   is DDP's no_sync, in both wrappers: forward and backward, the
   gradients added up and not reduced, no step. k - 1 of these and then
   mgpu_data_parallel_step take one step on the k batches together: the
   gradient of the mean loss over all their rows, with one reduction.
   Several devices a process (data parallelism inside each process, and
   across them):
       mgpu_data_parallel *ddp = mgpu_distributed_data_parallel_new_devices(net, devices, n, g);
   net on devices[0]: the wrapper replicates it on the others, splits each
   of the rank's batches among them, sums a bucket's gradients over them
   (chapter 3's ring, or NCCL), averages that sum over the ranks from
   devices[0], and copies the result to the others. CPU devices, or GPUs
   (through the host, as above).
       double acc = mgpu_dist_evaluate_accuracy(g, net, test, batch_size);
   each rank evaluates its own contiguous part of the data set (no image
   twice, none left out, unlike a padded sampler) and the counts are added. */
typedef struct mgpu_group mgpu_group;
typedef enum { MGPU_SUM, MGPU_MEAN } mgpu_reduce_op;
MGPU_DEF mgpu_group *mgpu_dist_init(int *argc, char ***argv);
MGPU_DEF void mgpu_dist_finalize(mgpu_group *world);
MGPU_DEF int mgpu_group_rank(const mgpu_group *g);
MGPU_DEF int mgpu_group_size(const mgpu_group *g);
MGPU_DEF int mgpu_group_local_rank(const mgpu_group *g);
MGPU_DEF int mgpu_group_local_size(const mgpu_group *g);
MGPU_DEF const char *mgpu_group_host(const mgpu_group *g);
MGPU_DEF mgpu_device *mgpu_group_device(mgpu_group *g, int use_gpu);
MGPU_DEF int mgpu_group_devices(mgpu_group *g, int use_gpu, int n, mgpu_device **out);
MGPU_DEF mgpu_group *mgpu_group_first(mgpu_group *g, int n);
MGPU_DEF void mgpu_group_free(mgpu_group *g);
MGPU_DEF const char *mgpu_group_path(const mgpu_group *g, const mgpu_device *dev);
MGPU_DEF const char *mgpu_group_allreduce(mgpu_group *g, mgpu_tensor *t, mgpu_reduce_op op);
MGPU_DEF const char *mgpu_group_allreduce_start(mgpu_group *g, mgpu_tensor *t, mgpu_reduce_op op);
MGPU_DEF void mgpu_group_broadcast(mgpu_group *g, mgpu_tensor *t, int root);
MGPU_DEF void mgpu_group_all_gather(mgpu_group *g, const mgpu_tensor *in, mgpu_tensor *out);
MGPU_DEF void mgpu_group_reduce_scatter(mgpu_group *g, const mgpu_tensor *in, mgpu_tensor *out,
                                        mgpu_reduce_op op);
MGPU_DEF void mgpu_group_send(mgpu_group *g, const mgpu_tensor *t, int to);
MGPU_DEF void mgpu_group_recv(mgpu_group *g, mgpu_tensor *t, int from);
MGPU_DEF void mgpu_group_barrier(mgpu_group *g);
MGPU_DEF void mgpu_group_fatal(const mgpu_group *g, const char *fmt, ...) MGPU__PRINTF(2, 3) MGPU__NORETURN;
MGPU_DEF void mgpu_group_sum_host(mgpu_group *g, double *values, int n);
MGPU_DEF void mgpu_group_all_gather_host(mgpu_group *g, const void *mine, size_t bytes, void *all);
MGPU_DEF mgpu_data_parallel *mgpu_distributed_data_parallel_new(mgpu_net *net, mgpu_group *g);
MGPU_DEF mgpu_data_parallel *mgpu_distributed_data_parallel_new_devices(mgpu_net *net, mgpu_device *const *devices,
                                                                        int n, mgpu_group *g);
MGPU_DEF void mgpu_data_parallel_accumulate(mgpu_data_parallel *dp, const mgpu_tensor *X,
                                            const mgpu_tensor *y);
MGPU_DEF void mgpu_net_sync_batchnorm(mgpu_net *net, mgpu_group *g);
MGPU_DEF double mgpu_dist_evaluate_accuracy(mgpu_group *g, mgpu_net *net, const mgpu_dataset *data,
                                            int batch_size);

/* ---------------------------------------------------------------------------
   TENSOR PARALLELISM. Splitting layers across devices
   ---------------------------------------------------------------------------
   Data parallelism copies the whole model to every device and splits the
   batch. When one layer is too big for one device, split the layer
   instead: every device holds a slice of its parameters, sees the whole
   batch, and computes a slice of the layer's output. The devices then
   talk about activations (the layer's outputs and input gradients), not
   about parameters: what they send depends on the batch, not on the model.

   Two splits, after Dive into Deep Learning's "splitting layers" and
   NVIDIA's Megatron-LM. Both blocks follow one convention. The input x
   and the gradient dy come on devices[0], where a program keeps its batch
   and its loss; the block copies them to the other devices (not counted
   below: inside a network of split layers every device would have them
   already). The output y and the input gradient dx end up on *every*
   device, so that a next split layer finds its input everywhere.

   A convolution split by output channels.
       mgpu_tp_conv *c = mgpu_tp_conv_new(weight, bias, stride, pad, devices, k);
   weight [K, C, R, S] and bias [K] are one device's parameters (on any
   device); device j gets filters j K/k .. (j+1) K/k - 1 and their biases.
   k must divide K.
       mgpu_tensor *y = mgpu_tp_conv_forward(c, x);       x [N, C, H, W] on devices[0]
   Every device computes its K/k channels of y for the whole batch
   (mgpu_conv2d_forward), then an all-gather puts them side by side: y
   [N, K, P, Q] on every device (mgpu_tp_conv_output(c, i) is device i's;
   the one returned is devices[0]'s). Side by side along channels means,
   in NCHW memory, inside each image: image n's channels from device j
   are one contiguous run, the next image's a whole image further on, so
   the all-gather copies one run per image from each device to each other
   (k(k-1)N small copies: clear, not fast; NCCL's all-gather would send
   each device's slice in one piece, into a [k, N, K/k, P, Q] buffer that a
   kernel then reorders).
       mgpu_tensor *dx = mgpu_tp_conv_backward(c, dy);    dy [N, K, P, Q] on devices[0]
   Device j takes its channels of dy and computes the gradients of its own
   filters and biases, and its part of dx: every output channel depends on
   every input channel, so each device's dx counts only its own filters'
   share, and the true dx is the sum of the k parts: an allreduce (the
   ring, or NCCL between distinct GPUs: mgpu_allreduce_auto), which leaves
   it on every device (mgpu_tp_conv_input_grad(c, i); the one returned is
   devices[0]'s).
       mgpu_tp_conv_gather_grads(c, dweight, dbias);
   copies the k slices of the gradients into one device's full-size
   dweight [K, C, R, S] and dbias [K] (on any device), to compare with one
   device, or to check.

   Megatron's MLP block: Y = relu(X A + a) B + b, with A [in, hidden], a
   [hidden], B [hidden, out], b [out] (weights stored [in, out], as the
   library's linear layers keep them).
       mgpu_tp_mlp *m = mgpu_tp_mlp_new(A, a, B, b, devices, k);
   A is split by columns (device j gets hidden/k of the hidden units, with
   their biases a_j), B by the matching rows (B_j), so k must divide
   hidden. Then X A_j + a_j is device j's hidden units, its ReLU needs no
   other device's, and H_j B_j is device j's share of the product H B:
   Y = sum over j of H_j B_j, plus b once (device 0 adds it).
       mgpu_tensor *Y = mgpu_tp_mlp_forward(m, X);       X [N, in] on devices[0]
       mgpu_tensor *dX = mgpu_tp_mlp_backward(m, dY);    dY [N, out] on devices[0]
   Two operators do all the talking, one each way:
     f, before the column-parallel layer: forward, nothing (every device
        already has X); backward, an allreduce (each device's dX counts
        only its hidden units: the sum of the k parts is dX).
     g, after the row-parallel layer: forward, an allreduce (of the
        partial products H_j B_j: their sum is Y); backward, nothing
        (every device needs all of dY, and has it: the convention above).
   So one allreduce forward and one backward, however wide the hidden
   layer. mgpu_tp_mlp_output(m, i) and mgpu_tp_mlp_input_grad(m, i)
   are Y and dX on device i;
       mgpu_tp_mlp_gather_grads(m, dA, da, dB, db);
   copies the slices into full-size gradients on one device.

   Each device's slices of the parameters and of their gradients count
   under MGPU_MEMORY_PARAMETERS and _GRADIENTS (section 2): 1/k of one
   device's, where data parallelism keeps all of them on every device.

   The tensors these functions return belong to the block (do not free
   them; the accessors give NULL before the first pass) and are
   overwritten by its next step; x and X must stay alive until the
   backward pass that follows (it reads them). The gradients of the
   parameters are overwritten by each backward pass. Each function only
   enqueues work, like every operation.

   Bytes. A block counts what its collectives moved in its last forward
   and backward pass, per device (sent, which for these equals received):
       mgpu_tp_bytes b = mgpu_tp_conv_bytes(c);     b.forward, b.backward
       mgpu_tp_bytes b = mgpu_tp_mlp_bytes(m);
   computed from the tensors' sizes and the algorithms:
       size_t mgpu_all_gather_bytes(size_t bytes, int k)   (k-1)/k bytes
   each device receives the k-1 slices it does not have;
       size_t mgpu_allreduce_bytes(size_t bytes, int k)    2(k-1)/k bytes
   the ring's reduce-scatter, then all-gather, each (k-1)/k of the vector
   (COMMUNICATION; NCCL's ring moves the same), both rounded down (exact
   when k divides the number of floats). So, with 4-byte floats:
       convolution  forward  all_gather(4 |y|), backward allreduce(4 |x|)
       MLP          forward  allreduce(4 |Y|),  backward allreduce(4 |X|)
   against data parallelism over the same k devices, which moves no
   activations but allreduces every parameter's gradient each step:
       size_t mgpu_data_parallel_bytes(size_t parameters, int k)
                    = mgpu_allreduce_bytes(4 parameters, k)
   and mgpu_tp_conv_parameters(c), mgpu_tp_mlp_parameters(m) count the
   block's parameters (all k slices). Which costs less depends on the
   batch against the layer: a wide layer on a small batch moves less split
   than replicated, and the split also divides the parameters' memory by k.

   Errors, each one line naming the function: a k that is not between 1
   and MGPU_MAX_DEVICES, a device given twice, a k that does not divide
   the channels or hidden units, shapes that do not fit together, an input
   or gradient that is not on devices[0], a backward pass before any
   forward pass. mgpu_tp_conv_free and mgpu_tp_mlp_free free a block. */
typedef struct mgpu_tp_bytes {
    size_t forward, backward; /* per device, in the last forward and backward pass */
} mgpu_tp_bytes;
MGPU_DEF size_t mgpu_all_gather_bytes(size_t bytes, int k);
MGPU_DEF size_t mgpu_allreduce_bytes(size_t bytes, int k);
MGPU_DEF size_t mgpu_data_parallel_bytes(size_t parameters, int k);

typedef struct mgpu_tp_conv mgpu_tp_conv;
MGPU_DEF mgpu_tp_conv *mgpu_tp_conv_new(const mgpu_tensor *weight, const mgpu_tensor *bias, int stride,
                                        int pad, mgpu_device *const *devices, int k);
MGPU_DEF mgpu_tensor *mgpu_tp_conv_forward(mgpu_tp_conv *c, const mgpu_tensor *x);
MGPU_DEF mgpu_tensor *mgpu_tp_conv_backward(mgpu_tp_conv *c, const mgpu_tensor *dy);
MGPU_DEF mgpu_tensor *mgpu_tp_conv_output(const mgpu_tp_conv *c, int i);
MGPU_DEF mgpu_tensor *mgpu_tp_conv_input_grad(const mgpu_tp_conv *c, int i);
MGPU_DEF void mgpu_tp_conv_gather_grads(const mgpu_tp_conv *c, mgpu_tensor *dweight, mgpu_tensor *dbias);
MGPU_DEF mgpu_tp_bytes mgpu_tp_conv_bytes(const mgpu_tp_conv *c);
MGPU_DEF size_t mgpu_tp_conv_parameters(const mgpu_tp_conv *c);
MGPU_DEF void mgpu_tp_conv_free(mgpu_tp_conv *c);

typedef struct mgpu_tp_mlp mgpu_tp_mlp;
MGPU_DEF mgpu_tp_mlp *mgpu_tp_mlp_new(const mgpu_tensor *A, const mgpu_tensor *a, const mgpu_tensor *B,
                                      const mgpu_tensor *b, mgpu_device *const *devices, int k);
MGPU_DEF mgpu_tensor *mgpu_tp_mlp_forward(mgpu_tp_mlp *m, const mgpu_tensor *X);
MGPU_DEF mgpu_tensor *mgpu_tp_mlp_backward(mgpu_tp_mlp *m, const mgpu_tensor *dY);
MGPU_DEF mgpu_tensor *mgpu_tp_mlp_output(const mgpu_tp_mlp *m, int i);
MGPU_DEF mgpu_tensor *mgpu_tp_mlp_input_grad(const mgpu_tp_mlp *m, int i);
MGPU_DEF void mgpu_tp_mlp_gather_grads(const mgpu_tp_mlp *m, mgpu_tensor *dA, mgpu_tensor *da,
                                       mgpu_tensor *dB, mgpu_tensor *db);
MGPU_DEF mgpu_tp_bytes mgpu_tp_mlp_bytes(const mgpu_tp_mlp *m);
MGPU_DEF size_t mgpu_tp_mlp_parameters(const mgpu_tp_mlp *m);
MGPU_DEF void mgpu_tp_mlp_free(mgpu_tp_mlp *m);

/* ---------------------------------------------------------------------------
   DRAWING. Plots: PNG pictures of curves and device timelines
   ---------------------------------------------------------------------------
   The chapters show what happened as pictures: accuracy and loss curves
   while a model trains, and a timeline of what every device did and when.
   Everything is drawn by a small rasteriser in this file into an RGB pixel
   buffer (a canvas) with a built-in 5x7 bitmap font, and saved as a PNG
   through stb_image_write. No plotting library, no fonts on the system.

   Colours are 0xRRGGBB integers. Coordinates are pixels: x grows to the
   right, y grows downwards, (0, 0) is the top-left pixel. Everything drawn
   is clipped to the canvas, so drawing partly (or wholly) outside is safe.

   Canvas: the building blocks.
       mgpu_canvas *c = mgpu_canvas_new(200, 100, 0xFFFFFF);
       mgpu_canvas_fill_rect(c, 10, 10, 50, 30, 0x1F77B4); // x in [10,50), y in [10,30)
       mgpu_canvas_line(c, 0, 99, 199, 0, 0xD62728, 2);    // 2 pixels thick
       mgpu_canvas_text(c, 60, 10, "loss: 0.25", 0x000000, 2); // twice the font size
       if (mgpu_canvas_write_png(c, "out/pic.png") != 0) { ... }
       mgpu_canvas_free(c);
   The font has every printable ASCII character (32..126). A character is a
   5x7 pixel glyph (descenders of g, j, p, q, y and _ go 2 rows lower) in a
   6-pixel-wide cell; `scale` multiplies every font pixel, so a string is
   mgpu_text_width(s, scale) pixels wide and 9*scale pixels tall.

   Line charts: fill an mgpu_chart with one mgpu_series per curve.
       mgpu_series s[2];  mgpu_chart ch;
       memset(s, 0, sizeof s);  memset(&ch, 0, sizeof ch);
       s[0].name = "train loss"; s[0].n = n; s[0].x = epochs; s[0].y = loss;
       s[1].name = "test acc";   s[1].n = n; s[1].x = epochs; s[1].y = acc;
       s[1].dashed = 1;
       ch.title = "LeNet"; ch.xlabel = "epoch"; ch.nseries = 2; ch.series = s;
       mgpu_chart_write_png(&ch, "out/lenet.png");
   Zeroed fields take defaults: a 640x480 picture, the x and y ranges taken
   from the data and widened to "nice" tick values (steps of 1, 2 or 5 times
   a power of ten), and colour 0 gives series i colour i of the palette
   (matplotlib's "tab10"; mgpu_palette(i) gives them). Points whose x or y
   is NaN are skipped: the curve goes straight from the point before to the
   point after. A legend lists the named series in the corner of the plot
   where it hides the least of the curves.

   Animator (the book's d2l.Animator): a chart that fills in during
   training. Every mgpu_animator_add appends one x and one y per series and
   rewrites both the PNG and a CSV beside it ("curves.png" -> "curves.csv",
   header "x,name1,name2,...", an empty field for NaN), so opening the PNG
   in a viewer that reloads shows the training progress, and the CSV keeps
   the numbers. Pass NaN for a series that has no value at this x (the
   book adds the test accuracy once per epoch, the training loss more
   often). Each add encodes a PNG (a few milliseconds): add a few points
   per epoch, not one per batch. A NULL png_path keeps the points in memory
   and writes nothing.
       const char *names[] = {"train loss", "train acc", "test acc"};
       mgpu_animator *a = mgpu_animator_new("out/ch2.png", "2 devices",
                              "epoch", NULL, 1, 10, 3, names);
       ... mgpu_animator_add(a, epoch + 1.0, ys);
       printf("test acc: %.2f\n", mgpu_animator_last(a, 2));
   mgpu_animator_write_combined puts one series (say the test accuracy) of
   several animators (say the runs on 1, 2 and 4 devices) in one chart.

   Timelines: one horizontal lane per device queue, one bar per operation
   from its start to its end time in milliseconds, so work that overlaps in
   time on different lanes (parallelism) is seen at a glance. The picture
   is 1000 pixels wide and as tall as its lanes and legend need; a bar on
   no lane, or that ends before it starts, is left out. Bars with the
   same name get the same colour (a hash of the name picks it, and names in
   one picture never share a colour while the palette lasts); a bar's
   label, or where it is empty its name, is written inside it where it
   fits, and a legend maps names to colours. Give operations of the same
   kind the same name ("matmul", "copy to host") rather than numbering
   them, and number them in the label where that helps ("F3": a pipeline's
   forward pass of micro-batch 3). Zero the bars before filling them
   (calloc, memset, or = {0}): an unset label is garbage text.

   Errors: a picture or CSV that cannot be written prints one line
       mgpu: error: out/pic.png: cannot write PNG (No such file or directory)
   to stderr and the function returns non-zero; the program goes on (an
   Animator says it once and then only keeps its points), and
       int mgpu_output_errors(void);
   counts such failures, for the program's exit status (the chapters exit
   with 1 when it is not 0), and a failed write to the standard output,
   which printf does not report: it says so once, in one line. PNGs and
   CSVs are written to "<path>.tmp" and renamed, so a viewer never sees
   half a file, and a failed write leaves the old file as it was. A write
   past the file-size limit (ulimit -f) fails as on a full disk. Out of
   memory, a canvas of no pixels or a series an animator does not have are
   bugs, and fatal (mgpu_fatal). */

typedef struct mgpu_canvas {
    int width, height;
    unsigned char *rgb; /* width*height*3 bytes, row by row from the top */
} mgpu_canvas;

/* A canvas filled with the background colour. */
MGPU_DEF mgpu_canvas *mgpu_canvas_new(int width, int height, uint32_t background_rgb);
MGPU_DEF void mgpu_canvas_free(mgpu_canvas *c);
/* Pixels x0 <= x < x1, y0 <= y < y1. */
MGPU_DEF void mgpu_canvas_fill_rect(mgpu_canvas *c, int x0, int y0, int x1, int y1, uint32_t rgb);
/* A straight line between two pixel positions, `thickness` pixels wide. */
MGPU_DEF void mgpu_canvas_line(mgpu_canvas *c, double x0, double y0, double x1, double y1,
                               uint32_t rgb, int thickness);
/* Text whose top-left corner is (x, y). */
MGPU_DEF void mgpu_canvas_text(mgpu_canvas *c, int x, int y, const char *text, uint32_t rgb,
                               int scale);
MGPU_DEF int mgpu_text_width(const char *text, int scale);
/* 0 on success; non-zero (after a one-line error) when it cannot be written. */
MGPU_DEF int mgpu_canvas_write_png(const mgpu_canvas *c, const char *path);
MGPU_DEF int mgpu_output_errors(void);
/* Colour i (any i >= 0, it wraps) of the 10-colour palette charts use. */
MGPU_DEF uint32_t mgpu_palette(int i);

/* ---- line charts ---- */
typedef struct mgpu_series {
    const char *name; /* in the legend; NULL leaves the series out of it */
    uint32_t color;   /* 0xRRGGBB; 0 picks palette colour i for series i */
    int n;            /* number of points */
    const double *x, *y;
    int dashed; /* non-zero draws a dashed line */
} mgpu_series;

typedef struct mgpu_chart {
    const char *title, *xlabel, *ylabel; /* any may be NULL */
    double xmin, xmax, ymin, ymax;       /* a range with min >= max is taken from the data */
    int width, height;                   /* 0 means 640 and 480 */
    int nseries;
    const mgpu_series *series;
} mgpu_chart;

MGPU_DEF int mgpu_chart_write_png(const mgpu_chart *chart, const char *path);

/* ---- the Animator ---- */
typedef struct mgpu_animator mgpu_animator;

/* xmin >= xmax takes the x range from the data; the y range always is.
   ylabel and title may be NULL. The strings are copied. */
MGPU_DEF mgpu_animator *mgpu_animator_new(const char *png_path, const char *title,
                                          const char *xlabel, const char *ylabel, double xmin,
                                          double xmax, int nseries, const char *const *names);
/* ys holds nseries values (NaN: no value for that series at this x). */
MGPU_DEF void mgpu_animator_add(mgpu_animator *a, double x, const double *ys);
MGPU_DEF int mgpu_animator_count(const mgpu_animator *a); /* points added so far */
/* The last value of a series that was not NaN; NaN when there is none. */
MGPU_DEF double mgpu_animator_last(const mgpu_animator *a, int series);
MGPU_DEF void mgpu_animator_free(mgpu_animator *a);
/* Series `series` of every animator as one curve each, labelled labels[i]
   (labels NULL: each animator's title). The x range and x label are the
   first animator's; so is the y label, or else the series' name. */
MGPU_DEF int mgpu_animator_write_combined(const char *png_path, const char *title, int nanimators,
                                          const mgpu_animator *const *animators, int series,
                                          const char *const *labels);

/* ---- device timelines ---- */
typedef struct mgpu_timeline_bar {
    int lane; /* 0 .. nlanes-1 */
    double start_ms, end_ms;
    char name[32]; /* NUL-terminated; bars with equal names share a colour */
    char label[16]; /* the text written on the bar where it fits; empty: the name */
} mgpu_timeline_bar;

MGPU_DEF int mgpu_timeline_write_png(const char *path, const char *title, int nlanes,
                                     const char *const *lane_names, int nbars,
                                     const mgpu_timeline_bar *bars);
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

/* What the implementation holds, in its order: each section opens with a
   banner of its name (the first with small dividers), and "defines"
   lists the public functions it defines. The kernel files (kernels/, one
   family a file, each saying what it holds) are included just before
   "filling tensors", in the Shapes and tensors section. Plots is the
   manual's DRAWING; Batch norm, losses, optimisers its TRAINING.
     Errors, files written whole, the clock
         defines: mgpu_fatal, mgpu_fatal_at, mgpu_malloc, mgpu_now
     Queues
         internal: a device's queues, and the structs of devices (with the
         blocks of their caching allocator), events and trace records and
         the library's state (mgpu__library)
     Devices
         defines: mgpu_num_gpus, mgpu_cpu, mgpu_try_gpu, mgpu_try_all_gpus,
         mgpu_devices, mgpu_device_name, mgpu_device_is_gpu,
         mgpu_device_gpu_index, mgpu_device_stream, mgpu_synchronize,
         mgpu_synchronize_all, mgpu_device_memory_in_use,
         mgpu_device_memory_peak, mgpu_device_reset_peak,
         mgpu_device_allocations, mgpu_device_list, mgpu_shutdown
     Events
         defines: mgpu_event_new, mgpu_event_free, mgpu_event_record,
         mgpu_event_wait, mgpu_event_synchronize, mgpu_event_elapsed_ms
     Timers
         defines: mgpu_timer_init, mgpu_timer_start, mgpu_timer_stop,
         mgpu_timer_sum, mgpu_timer_avg, mgpu_timer_cumsum, mgpu_benchmark_begin,
         mgpu_benchmark_end
     The caching allocator
         internal: the allocator behind mgpu_empty and mgpu_free
     Random numbers
         defines: mgpu_philox, mgpu_manual_seed
     Shapes and tensors
         defines: mgpu_shape1, mgpu_shape2, mgpu_shape3, mgpu_shape4,
         mgpu_shape_numel, mgpu_shape_equal, mgpu_shape_str, mgpu_empty,
         mgpu_empty_pinned, mgpu_free, mgpu_view, mgpu_ensure, mgpu_narrow,
         mgpu_fill, mgpu_full, mgpu_zeros, mgpu_ones, mgpu_rand_uniform,
         mgpu_rand, mgpu_randn, mgpu_arange, mgpu_add_, mgpu_scale_,
         mgpu_set_tf32, mgpu_get_tf32, mgpu_tf32_str, mgpu_matmul, mgpu_mm
     Copies between devices
         defines: mgpu_copy, mgpu_to, mgpu_from_host, mgpu_to_host, mgpu_item,
         mgpu_print
     Tracing
         defines: mgpu_trace_begin, mgpu_trace_end, mgpu_trace_write_png,
         mgpu_trace_summary, mgpu_trace_count, mgpu_trace_get,
         mgpu_trace_span_ms, mgpu_trace_busy_ms
     Command-line flags
         defines: mgpu_options_parse, mgpu_out_path
     Data
         defines: mgpu_data_dir, mgpu_dataset_load,
         mgpu_dataset_load_fashion_mnist, mgpu_dataset_truncate,
         mgpu_dataset_subset, mgpu_dataset_free, mgpu_fashion_mnist_label,
         mgpu_sampler_new, mgpu_sampler_set_epoch, mgpu_sampler_num_samples,
         mgpu_sampler_total_size, mgpu_sampler_indices, mgpu_sampler_free,
         mgpu_loader_new, mgpu_loader_start_epoch, mgpu_loader_start_epoch_at,
         mgpu_loader_next, mgpu_loader_num_batches, mgpu_loader_set_drop_last,
         mgpu_loader_set_sampler, mgpu_loader_free
     Layers
         defines: mgpu_conv2d_output_shape, mgpu_conv2d_forward,
         mgpu_conv2d_backward, mgpu_avg_pool2d_output_shape,
         mgpu_avg_pool2d_forward, mgpu_avg_pool2d_backward,
         mgpu_global_avg_pool_forward, mgpu_global_avg_pool_backward,
         mgpu_relu_forward, mgpu_relu_backward, mgpu_add, mgpu_add_relu,
         mgpu_linear_forward, mgpu_linear_backward
     Batch norm, losses, optimisers
         defines: mgpu_batchnorm2d_forward, mgpu_batchnorm2d_backward,
         mgpu_cross_entropy_forward, mgpu_cross_entropy_backward,
         mgpu_accuracy_count, mgpu_sum, mgpu_mean, mgpu_sgd_book, mgpu_sgd_step
     Communication
         defines: mgpu_enable_peer_access, mgpu_get_params, mgpu_params_free,
         mgpu_allreduce, mgpu_scatter, mgpu_split_batch, mgpu_comm_wait,
         mgpu_ring_allreduce, mgpu_nccl_init, mgpu_nccl_free,
         mgpu_nccl_allreduce, mgpu_nccl_broadcast, mgpu_nccl_reduce_scatter,
         mgpu_nccl_all_gather, mgpu_allreduce_start, mgpu_allreduce_auto
     Networks
         defines: mgpu_net_new, mgpu_net_add_conv, mgpu_net_add_batchnorm,
         mgpu_net_add_relu, mgpu_net_add_avg_pool, mgpu_net_add_global_avg_pool,
         mgpu_net_add_residual, mgpu_net_add_linear, mgpu_net_add_layer,
         mgpu_resnet18, mgpu_lenet, mgpu_net_forward, mgpu_net_backward, mgpu_net_zero_grad,
         mgpu_net_set_training, mgpu_net_sgd, mgpu_net_loss_backward,
         mgpu_net_train_step, mgpu_net_num_params, mgpu_net_param,
         mgpu_net_num_buffers, mgpu_net_buffer, mgpu_net_num_weights,
         mgpu_net_replicate, mgpu_net_copy_params, mgpu_net_free,
         mgpu_evaluate_accuracy, mgpu_net_evaluate_accuracy, mgpu_net_save,
         mgpu_net_load, mgpu_checkpoint_save, mgpu_checkpoint_load
     Data parallelism
         defines: mgpu_data_parallel_new, mgpu_data_parallel_configure,
         mgpu_data_parallel_use_allreduce, mgpu_data_parallel_check_replicas,
         mgpu_data_parallel_module,
         mgpu_data_parallel_replica, mgpu_data_parallel_algorithm,
         mgpu_data_parallel_step, mgpu_data_parallel_accumulate,
         mgpu_data_parallel_take_stats, mgpu_data_parallel_free
     Distributed: process groups over MPI
         defines: mgpu_dist_init, mgpu_dist_finalize, mgpu_group_rank,
         mgpu_group_size, mgpu_group_local_rank, mgpu_group_local_size,
         mgpu_group_host, mgpu_group_device, mgpu_group_first,
         mgpu_group_free, mgpu_group_path, mgpu_group_allreduce,
         mgpu_group_allreduce_start, mgpu_group_broadcast,
         mgpu_group_all_gather, mgpu_group_reduce_scatter, mgpu_group_send,
         mgpu_group_recv, mgpu_group_barrier, mgpu_group_fatal, mgpu_group_sum_host,
         mgpu_group_all_gather_host, mgpu_distributed_data_parallel_new,
         mgpu_dist_evaluate_accuracy
     Plots
         defines: mgpu_palette, mgpu_canvas_new, mgpu_canvas_free,
         mgpu_canvas_fill_rect, mgpu_canvas_line, mgpu_text_width,
         mgpu_canvas_text, mgpu_output_errors, mgpu_canvas_write_png,
         mgpu_chart_write_png, mgpu_animator_new, mgpu_animator_free,
         mgpu_animator_count, mgpu_animator_last, mgpu_animator_add,
         mgpu_animator_write_combined, mgpu_timeline_write_png
*/

#include <ctype.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/stat.h>
#include <cblas.h>
#if MGPU_MPI
#define OMPI_SKIP_MPICXX 1 /* C's interface alone, also where this is C++ */
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif
#ifndef CLOCK_MONOTONIC /* a system header came first, without POSIX */
#error "mgpu.h: in the file that defines MGPU_IMPLEMENTATION, include mgpu.h before any system header, or compile with -D_GNU_SOURCE"
#endif
#if MGPU_CUDA && !defined(MGPU_CUDA_EMU)
#include <cublas_v2.h>
#include <cuda_runtime.h>
#if MGPU_CUDNN
#include <cudnn.h>
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- errors */
/* "rank 2: " in a process of a distributed job, so that its errors say
   whose they are; else empty. */
static char mgpu__error_prefix[32];

/* Were we started by a launcher (mpirun, srun)? Its variables say how
   many processes it started and which one this is, before MPI starts. */
static int mgpu__launcher_variable(const char *const names[3]) {
    for (int k = 0; k < 3; k++) {
        const char *v = getenv(names[k]);
        if (v && *v) return atoi(v);
    }
    return -1;
}
static int mgpu__launcher_size(void) {
    static const char *const names[3] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"};
    int size = mgpu__launcher_variable(names);
    return size > 0 ? size : 1;
}
/* This process's rank in the launcher's job, or -1 when it runs alone. */
static int mgpu__launcher_rank(void) {
    static const char *const names[3] = {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"};
    return mgpu__launcher_size() > 1 ? mgpu__launcher_variable(names) : -1;
}

/* 1 while a rank waits, silent, for the launcher to stop it: the SIGTERM
   handler (mgpu__dist_on_signal) then ends it without a word. */
static volatile sig_atomic_t mgpu__dist_quiet;
/* Seconds a rank other than 0 keeps an error to itself (below). */
#define MGPU__ALIKE_ERROR_WAIT 5
/* 1 in the thread that reports an error of its own rank alone (a
   timeout that names the ranks it waited for): said at once. */
static __thread int mgpu__error_is_mine_alone;

MGPU__NORETURN static void mgpu__vfatal(const char *file, int line, const char *fmt, va_list ap) {
    /* One line, written whole, by the first thread that fails: two devices'
       workers failing at once (the same bug in each replica) would
       otherwise interleave their lines. A later one waits for the first's
       _exit. */
    static int failing;
    if (__atomic_exchange_n(&failing, 1, __ATOMIC_SEQ_CST))
        for (;;) pause();
    /* Under a launcher most errors are every rank's alike (a bad flag, a
       missing file, memory that no rank has): rank 0 says it, and the
       others wait silently for the launcher, which stops them all once
       rank 0 has exited, so that a job prints one line, not one a rank.
       A rank that is still running after the wait had an error of its
       own, and says it. */
    int rank = mgpu__launcher_rank();
    if (rank >= 0 && !mgpu__error_prefix[0])
        snprintf(mgpu__error_prefix, sizeof mgpu__error_prefix, "rank %d: ", rank);
    if (rank > 0 && !mgpu__error_is_mine_alone) {
        mgpu__dist_quiet = 1;
        struct timespec wait = {MGPU__ALIKE_ERROR_WAIT, 0};
        while (nanosleep(&wait, &wait) != 0 && errno == EINTR) {}
        mgpu__dist_quiet = 0;
    }
    char text[2048];
    int at = snprintf(text, sizeof text, "mgpu: error: %s", mgpu__error_prefix);
    if (file) at += snprintf(text + at, sizeof text - at, "%s:%d: ", file, line);
    vsnprintf(text + at, sizeof text - at, fmt, ap);
    fflush(stdout);
    fprintf(stderr, "%s\n", text);
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
static void *mgpu__xrealloc(void *old, size_t bytes) {
    void *p = realloc(old, bytes ? bytes : 1);
    if (!p) mgpu_fatal("out of host memory (asked for %zu bytes)", bytes);
    return p;
}
static void *mgpu__xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) mgpu_fatal("out of host memory (asked for %zu x %zu bytes)", n, size);
    return p;
}
MGPU_DEF void *mgpu_malloc(size_t bytes) { return mgpu__xmalloc(bytes); }
/* The layer whose pass this thread is enqueuing (a network's forward
   and backward passes set it), or NULL: the error lines of the
   libraries' calls name it, ", in layer conv1" (MGPU__IN_LAYER gives the
   two strings a "%s%s" takes). */
static __thread const char *mgpu__layer_enqueuing;
#define MGPU__IN_LAYER(name) (name) ? ", in layer " : "", (name) ? (name) : ""

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
#if MGPU_CUDNN
#define MGPU_CUDNN_CHECK(call)                                                  \
    do {                                                                        \
        cudnnStatus_t mgpu__cudnn_st = (call);                                  \
        if (mgpu__cudnn_st != CUDNN_STATUS_SUCCESS)                             \
            mgpu_fatal_at(__FILE__, __LINE__, "cuDNN: %s failed: %s%s%s", #call, \
                          cudnnGetErrorString(mgpu__cudnn_st),                  \
                          MGPU__IN_LAYER(mgpu__layer_enqueuing));               \
    } while (0)
#endif
/* After a kernel launch: catches bad launch configurations at once. */
#define MGPU_CUDA_CHECK_LAUNCH() MGPU_CUDA_CHECK(cudaGetLastError())
#endif

/* ----------------------------------------------------------------- files */
/* A file that appears whole or not at all: written to "<path>.tmp", which
   is then renamed over path. A viewer that reloads it (the Animator
   rewrites its files after every point) sees the old file or the new one,
   and a full disk leaves the old one as it was. Where path is a link, the
   file it names is the one replaced, and a file replaced keeps its
   permissions. Open gives the FILE (NULL with errno set); close returns 0,
   or the errno of what failed (EIO where none was set), and removes the
   temporary file on failure.
   A write past the file-size limit (ulimit -f) would raise SIGXFSZ, which
   kills the process without a word and leaves the ".tmp" behind: open
   ignores it (for the whole process, the first time), so that the write
   fails with EFBIG and takes the path of a full disk. SIGPIPE is left as
   it is (a program whose reader is gone, `./chapter4 | head`, should
   stop): the ".tmp" is a regular file made anew, never a pipe. */
typedef struct mgpu__whole_file {
    FILE *f;
    char *target, *tmp; /* the file replaced (a link's target), and "<target>.tmp" */
} mgpu__whole_file;
static FILE *mgpu__whole_file_open(mgpu__whole_file *w, const char *path) {
    char *resolved = realpath(path, NULL); /* (NULL where there is no file yet) */
    const char *target = resolved ? resolved : path;
    size_t length = strlen(target);
    w->target = (char *)mgpu__xmalloc(length + 1);
    w->tmp = (char *)mgpu__xmalloc(length + 5);
    memcpy(w->target, target, length + 1);
    memcpy(w->tmp, target, length);
    memcpy(w->tmp + length, ".tmp", 5);
    free(resolved);
    struct stat old;
    int replaces = stat(w->target, &old) == 0;
    signal(SIGXFSZ, SIG_IGN);
    /* A ".tmp" already there is a crashed writer's, or something else (a
       FIFO would block the open): gone, and made anew ("x": not opened if
       it is still there). */
    unlink(w->tmp);
    w->f = fopen(w->tmp, "wbx");
    if (!w->f) {
        int error = errno;
        free(w->target);
        free(w->tmp);
        errno = error;
        return NULL;
    }
    if (replaces) (void)fchmod(fileno(w->f), old.st_mode & 07777); /* (failing, it keeps umask's) */
    errno = 0; /* a write that fails sets it again: mgpu__whole_file_close reads it */
    return w->f;
}
static int mgpu__whole_file_close(mgpu__whole_file *w, int failed) {
    /* the first failure's errno: the writes', else fclose's, else rename's */
    int error = (failed || ferror(w->f)) ? (errno ? errno : EIO) : 0;
    if (fclose(w->f) != 0 && !error) error = errno ? errno : EIO; /* a full disk may only show here */
    if (!error && rename(w->tmp, w->target) != 0) error = errno ? errno : EIO;
    if (error) remove(w->tmp);
    free(w->target);
    free(w->tmp);
    return error;
}

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
#define MGPU__TASK_ARGS 768 /* room for a list of tensors (kernels/sgd.h), or six tensors (a layer of yours) */

/* A CPU device's share of the machine's cores: cores / CPU devices
   (mgpu_devices sets it). Its compute queue's worker runs each task with
   OpenMP set to that many threads, and its copy queue's with one (a copy
   or a reduction overlapping compute must not take the compute's cores):
   OpenBLAS's products (built for OpenMP), oneDNN's convolutions and the
   library's own kernels (MGPU__CPU_PARALLEL_FOR, kernels/common.h) then
   split their work over them. */
static int mgpu__cpu_threads = 1; /* (all the cores once the library starts) */
#define MGPU__QUEUE_RING 512

/* Where a kernel runs: the CUDA stream and cuBLAS handle of a GPU queue,
   or nothing on the CPU. Every kernel in kernels/ takes one. */
typedef struct mgpu__exec {
    int on_gpu;
    void *stream; /* cudaStream_t */
    void *cublas; /* cublasHandle_t */
    void *cudnn;  /* cudnnHandle_t, once the queue made one (kernels/conv_cudnn.h), else NULL */
} mgpu__exec;
typedef void (*mgpu__kernel_fn)(const void *args, const mgpu__exec *ex);

typedef struct mgpu__task {
    mgpu__kernel_fn fn;
    const char *name;     /* for the tracer; a string literal */
    const char *label;    /* the tracer's label when it was enqueued (mgpu_trace_label) */
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
    const char *running_layer; /* the host-loop layer whose pass the worker runs, or NULL */
#if MGPU_CUDA
    cudaStream_t stream;
    cublasHandle_t cublas;
#if MGPU_CUDNN
    cudnnHandle_t cudnn; /* made at the queue's first cuDNN call (mgpu__cudnn_ready) */
#endif
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
    int category;        /* an mgpu_memory_category */
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
    size_t limit;         /* on in_use, or 0 (mgpu_device_set_memory_limit) */
    size_t held[MGPU_MEMORY_CATEGORIES], held_peak[MGPU_MEMORY_CATEGORIES], held_at_peak[MGPU_MEMORY_CATEGORIES];
    int recording, nsamples, samples_room; /* mgpu_device_record_memory */
    mgpu_memory_sample *samples;
    size_t allocations;   /* blocks taken from the system (cudaMalloc, posix_memalign) */
    pthread_mutex_t alloc_mutex;
    mgpu_tensor *bn_done; /* a GPU's batch norm counters (mgpu__bn_done), or NULL */
    /* a GPU's report of a bad label (kernels/loss.h), made by its first
       loss: in pinned host memory, which the GPU writes directly, and the
       word in device memory that a reporting thread claims first */
    struct mgpu__label_error *label_error;
    mgpu_tensor *label_claim;
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
    int cuda_gpu;  /* the GPU the CUDA event was made on */
#endif
};

/* ------------------------------------------------------------- tracing */
typedef struct mgpu__trace_record {
    int queue_id;         /* device index * 2 + lane */
    const char *name;
    const char *label;    /* mgpu_trace_label's when the operation was enqueued, or NULL */
    double start, end;    /* host seconds (CPU queues) */
#if MGPU_CUDA
    cudaEvent_t cuda_start, cuda_end; /* GPU queues */
    int cuda_gpu;                     /* the GPU they were made on (events belong to one) */
#endif
} mgpu__trace_record;

/* The library's state: its devices, the random generator and the tracer. */
static struct {
    int initialised;
    pid_t pid;
    int forked; /* a child of fork(): CUDA cannot be used here */
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
    char **trace_labels; /* mgpu_trace_label's copies, each distinct */
    int trace_nlabels;
#if MGPU_CUDA
    cudaEvent_t trace_cuda_start[MGPU_MAX_DEVICES];
#endif
} mgpu__library;

static void mgpu__init(void);
static void mgpu__trace_add(mgpu__queue *q, const char *name, const char *label, double start, double end,
                            void **gpu_events);
/* The label the calling thread gives the operations it enqueues
   (mgpu_trace_label): one of the library's interned copies, or NULL. */
static __thread const char *mgpu__trace_label_now;

/* How far this process has got: the operations it has launched and run.
   A rank that waits for this one asks it (mgpu__dist_wait): a number that
   moves says "busy, not stuck". */
static long mgpu__progress;

static void *mgpu__worker(void *arg) {
    mgpu__queue *q = (mgpu__queue *)arg;
    static const mgpu__exec cpu_exec = {0, NULL, NULL, NULL};
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&q->mutex));
    for (;;) {
        while (q->tail == q->head && !q->stop)
            MGPU__PTHREAD_CHECK(pthread_cond_wait(&q->changed, &q->mutex));
        if (q->tail == q->head) break; /* stop, and nothing left to do */
        mgpu__task *task = &q->ring[q->tail % MGPU__QUEUE_RING];
        q->busy = 1;
        MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&q->mutex));
        double start = mgpu__library.tracing ? mgpu_now() : 0.0;
#ifdef _OPENMP
        omp_set_num_threads(q->lane ? 1 : mgpu__cpu_threads);
#endif
        task->fn(task->args, &cpu_exec);
        __atomic_add_fetch(&mgpu__progress, 1, __ATOMIC_RELAXED);
        if (mgpu__library.tracing && task->name)
            mgpu__trace_add(q, task->name, task->label, start, mgpu_now(), NULL);
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
#if MGPU_CUDNN
        if (q->cudnn) MGPU_CUDNN_CHECK(cudnnDestroy(q->cudnn));
#endif
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
/* A function that a CPU queue runs (a host-loop layer's pass) cannot
   call the library for that queue: the work would wait behind, or for,
   the function itself. */
static void mgpu__require_not_in_worker(const mgpu__queue *q, const char *what) {
    MGPU_REQUIRE(!q->started || !pthread_equal(pthread_self(), q->thread),
                 "%s's host loop called the library (%s, on %s): a host-loop pass works on its "
                 "tensors' values alone, with none of the library's operations or waits",
                 q->running_layer ? q->running_layer : "a layer", what, q->name);
}
static void mgpu__queue_push(mgpu__queue *q, const char *name, mgpu__kernel_fn fn,
                             const void *args, size_t args_size) {
    mgpu__require_not_in_worker(q, name);
    if (args_size > MGPU__TASK_ARGS)
        mgpu_fatal("internal: arguments of '%s' are %zu bytes, more than %d", name,
                   args_size, MGPU__TASK_ARGS);
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&q->mutex));
    while (q->head - q->tail >= MGPU__QUEUE_RING)
        MGPU__PTHREAD_CHECK(pthread_cond_wait(&q->changed, &q->mutex));
    mgpu__task *task = &q->ring[q->head % MGPU__QUEUE_RING];
    task->fn = fn;
    task->name = name;
    task->label = mgpu__trace_label_now;
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
    mgpu__require_not_in_worker(q, "waiting for the queue");
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
    __atomic_add_fetch(&mgpu__progress, 1, __ATOMIC_RELAXED);
#if MGPU_CUDA
    if (mgpu__queue_on_gpu(q)) {
        if (!cuda) mgpu_fatal("'%s' has no CUDA version", name);
        mgpu__exec ex = {1, (void *)q->stream, (void *)q->cublas, NULL};
#if MGPU_CUDNN
        ex.cudnn = (void *)q->cudnn;
#endif
        MGPU_CUDA_CHECK(cudaSetDevice(q->device->gpu));
        void *bar[2] = {NULL, NULL}; /* the tracer's start and end events */
        if (mgpu__library.tracing) {
            mgpu__trace_add(q, name, mgpu__trace_label_now, 0, 0, bar);
            MGPU_CUDA_CHECK(cudaEventRecord((cudaEvent_t)bar[0], q->stream));
        }
        cuda(args, &ex);
        if (bar[1]) MGPU_CUDA_CHECK(cudaEventRecord((cudaEvent_t)bar[1], q->stream));
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
   Devices
   ====================================================================== */
static void mgpu__require_no_label_error(const mgpu_device *d);
static mgpu_device *mgpu__device_get(int gpu, int virtual_index) {
    mgpu__init();
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&mgpu__library.mutex));
    mgpu_device *found = NULL;
    for (int i = 0; i < mgpu__library.ndevices && !found; i++)
        if (mgpu__library.devices[i]->gpu == gpu && mgpu__library.devices[i]->virtual_index == virtual_index)
            found = mgpu__library.devices[i];
    if (!found) {
        if (mgpu__library.ndevices == (int)(sizeof mgpu__library.devices / sizeof mgpu__library.devices[0]))
            mgpu_fatal("too many devices (at most %d)", mgpu__library.ndevices);
        mgpu_device *d = (mgpu_device *)mgpu__xcalloc(1, sizeof *d);
        d->index = mgpu__library.ndevices;
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
        mgpu__library.devices[mgpu__library.ndevices++] = d;
        found = d;
    }
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__library.mutex));
    return found;
}

MGPU_DEF int mgpu_num_gpus(void) {
    mgpu__init();
    return mgpu__library.num_gpus;
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

/* OpenBLAS picks its kernels for the processor's family and model. On a
   processor it does not know (cloud machines may report a generic name,
   "Intel(R) Xeon(R) Processor") it takes its oldest x86-64 kernels,
   Prescott's, with neither AVX2 nor AVX-512: its products then run at a
   fifth of the speed the processor has (bench/RESULTS.md). It chooses
   when it is loaded, reading OPENBLAS_CORETYPE only then; so where it took
   kernels without AVX2 on a processor with AVX2 and FMA, the program
   starts again before main, with OPENBLAS_CORETYPE naming the kernels the
   processor runs, and says so in one line. A coretype the user set is
   left alone. */
extern char *openblas_get_corename(void);
/* The kernels to ask for, given those OpenBLAS took (core) and what the
   processor has; NULL where core uses AVX2 already, or the processor has
   nothing better. */
static inline const char *mgpu__blas_better_core(const char *core, int avx2_fma, int avx512) {
    static const char *const without_avx2[] = {"Prescott",    "Core2",   "Penryn",    "Dunnington", "Nehalem",
                                               "Sandybridge", "Atom",    "Opteron",   "Barcelona",  "Bobcat",
                                               "Bulldozer",   "Piledriver", "Steamroller", "Nano"};
    if (!avx2_fma || !core) return NULL;
    for (size_t i = 0; i < sizeof without_avx2 / sizeof without_avx2[0]; i++)
        if (strcasecmp(core, without_avx2[i]) == 0) return avx512 ? "SkylakeX" : "Haswell";
    return NULL;
}
#if defined(__x86_64__) && defined(__GNUC__) && defined(__GLIBC__)
static void mgpu__processor_vectors(int *avx2_fma, int *avx512) {
    __builtin_cpu_init();
    *avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    *avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
              __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
/* (glibc hands a constructor the program's arguments, as main gets them) */
__attribute__((constructor)) static void mgpu__blas_kernels_check(int argc, char **argv) {
    if (getenv("OPENBLAS_CORETYPE") || argc < 1 || !argv) return;
    int avx2_fma, avx512;
    mgpu__processor_vectors(&avx2_fma, &avx512);
    const char *core = openblas_get_corename();
    const char *better = mgpu__blas_better_core(core, avx2_fma, avx512);
    if (!better) return;
    fprintf(stderr, "mgpu: OpenBLAS took its %s kernels on a processor with %s; starting again with "
            "OPENBLAS_CORETYPE=%s\n", core, avx512 ? "AVX-512" : "AVX2", better);
    if (setenv("OPENBLAS_CORETYPE", better, 1) == 0) execv("/proc/self/exe", argv);
    fprintf(stderr, "mgpu: could not start again (%s): the products keep %s's kernels\n", strerror(errno), core);
}
#endif

/* OpenBLAS runs every matrix product with all cores by default. When several
   CPU devices run at once, each gets its share, for its products and its
   own kernels, so that two devices really work side by side instead of
   fighting over the same cores. */
extern void openblas_set_num_threads(int num_threads);
/* The cores this process may run on (its affinity: a container or
   taskset may give it fewer than the machine has). */
static int mgpu__cores(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    return cores > 0 ? (int)cores : 1;
}
static void mgpu__share_cpu_cores(int ncpu_devices) {
    int cores = mgpu__cores();
    int per_device = cores / (ncpu_devices > 0 ? ncpu_devices : 1);
    mgpu__cpu_threads = per_device > 0 ? per_device : 1;
    openblas_set_num_threads(mgpu__cpu_threads);
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
MGPU_DEF void *mgpu_device_stream(const mgpu_device *d) {
#if MGPU_CUDA
    if (mgpu_device_is_gpu(d)) return (void *)d->queue[0].stream;
#endif
    (void)d;
    return NULL;
}
MGPU_DEF void mgpu_synchronize(mgpu_device *d) {
    mgpu__queue_synchronize(&d->queue[0]);
    mgpu__queue_synchronize(&d->queue[1]);
    mgpu__require_no_label_error(d);
}
MGPU_DEF void mgpu_synchronize_all(void) {
    mgpu__init();
    for (int i = 0; i < mgpu__library.ndevices; i++) mgpu_synchronize(mgpu__library.devices[i]);
}
MGPU_DEF size_t mgpu_device_memory_in_use(const mgpu_device *d) { return d->in_use; }
MGPU_DEF size_t mgpu_device_memory_peak(const mgpu_device *d) { return d->peak; }
MGPU_DEF void mgpu_device_reset_peak(mgpu_device *d) {
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&d->alloc_mutex));
    d->peak = d->in_use;
    for (int c = 0; c < MGPU_MEMORY_CATEGORIES; c++) d->held_peak[c] = d->held_at_peak[c] = d->held[c];
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&d->alloc_mutex));
}
static void mgpu__require_category(mgpu_memory_category c, const char *op) {
    MGPU_REQUIRE((int)c >= 0 && c < MGPU_MEMORY_CATEGORIES, "%s: memory category %d does not exist", op, (int)c);
}
MGPU_DEF size_t mgpu_device_memory_of(const mgpu_device *d, mgpu_memory_category c) {
    mgpu__require_category(c, "mgpu_device_memory_of");
    return d->held[c];
}
MGPU_DEF size_t mgpu_device_memory_peak_of(const mgpu_device *d, mgpu_memory_category c) {
    mgpu__require_category(c, "mgpu_device_memory_peak_of");
    return d->held_peak[c];
}
MGPU_DEF size_t mgpu_device_memory_at_peak(const mgpu_device *d, mgpu_memory_category c) {
    mgpu__require_category(c, "mgpu_device_memory_at_peak");
    return d->held_at_peak[c];
}
MGPU_DEF const char *mgpu_memory_category_name(mgpu_memory_category c) {
    static const char *const names[MGPU_MEMORY_CATEGORIES] = {"other", "parameters", "gradients",
                                                              "optimizer state", "activations", "workspace"};
    mgpu__require_category(c, "mgpu_memory_category_name");
    return names[c];
}
MGPU_DEF void mgpu_device_set_memory_limit(mgpu_device *d, size_t bytes) { d->limit = bytes; }
MGPU_DEF void mgpu_device_record_memory(mgpu_device *d, int on) {
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&d->alloc_mutex));
    if (on) d->nsamples = 0;
    d->recording = on != 0;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&d->alloc_mutex));
}
MGPU_DEF int mgpu_device_memory_samples(const mgpu_device *d, const mgpu_memory_sample **samples) {
    *samples = d->samples;
    return d->nsamples;
}
MGPU_DEF size_t mgpu_device_allocations(const mgpu_device *d) { return d->allocations; }
MGPU_DEF const char *mgpu_device_list(char *buf, size_t size, mgpu_device *const *devices, int n) {
    size_t used = (size_t)snprintf(buf, size, "[");
    for (int i = 0; i < n && used < size; i++)
        used += (size_t)snprintf(buf + used, size - used, "%s%s", i ? ", " : "", devices[i]->name);
    if (used < size) snprintf(buf + used, size - used, "]");
    return buf;
}

static void mgpu__allocator_release(mgpu_device *d);
MGPU_DEF void mgpu_shutdown(void) {
    if (!mgpu__library.initialised || mgpu__library.pid != getpid()) return;
    for (int i = 0; i < mgpu__library.ndevices; i++) mgpu_synchronize(mgpu__library.devices[i]);
    for (int i = 0; i < mgpu__library.ndevices; i++) {
        mgpu_device *d = mgpu__library.devices[i];
        mgpu_free(d->bn_done);
        mgpu_free(d->label_claim);
#if MGPU_CUDA
        if (d->label_error) MGPU_CUDA_CHECK(cudaFreeHost(d->label_error));
#endif
        mgpu__queue_destroy(&d->queue[0]);
        mgpu__queue_destroy(&d->queue[1]);
        mgpu__allocator_release(d);
        pthread_mutex_destroy(&d->alloc_mutex);
        free(d);
    }
    mgpu__library.ndevices = 0;
#if MGPU_CUDA
    for (int i = 0; i < mgpu__library.trace_n; i++) {
        if (mgpu__library.trace[i].cuda_start) cudaEventDestroy(mgpu__library.trace[i].cuda_start);
        if (mgpu__library.trace[i].cuda_end) cudaEventDestroy(mgpu__library.trace[i].cuda_end);
    }
#endif
    free(mgpu__library.trace);
    mgpu__library.trace = NULL;
    mgpu__library.trace_n = mgpu__library.trace_cap = 0;
    for (int i = 0; i < mgpu__library.trace_nlabels; i++) free(mgpu__library.trace_labels[i]);
    free(mgpu__library.trace_labels);
    mgpu__library.trace_labels = NULL;
    mgpu__library.trace_nlabels = 0;
    mgpu__trace_label_now = NULL;
    pthread_mutex_destroy(&mgpu__library.mutex);
    mgpu__library.initialised = 0;
}

/* At the end of the process: wait for every queue, so that no work is
   lost, then tear down. With GPUs, stop after the waiting: the CUDA
   libraries may have run their own exit handlers already (those a library
   registers when its first handle is made run before this one), and
   destroying cuBLAS handles or streams after them can crash; the end of
   the process frees all of it (PyTorch leaks its handles at exit for the
   same reason). A forked child leaves the GPUs alone: CUDA does not work
   across fork. */
static void mgpu__at_exit(void) {
    if (!mgpu__library.initialised || mgpu__library.pid != getpid()) return;
    if (mgpu__library.num_gpus == 0) {
        mgpu_shutdown();
        return;
    }
    for (int i = 0; i < mgpu__library.ndevices; i++)
        if (!(mgpu__library.forked && mgpu_device_is_gpu(mgpu__library.devices[i])))
            mgpu_synchronize(mgpu__library.devices[i]);
}

/* fork() copies only the calling thread: in the child, the CPU queues get
   new worker threads (and fresh locks), so a forked child, such as a test
   that expects an error, can still run work on its devices. */
static void mgpu__after_fork_in_child(void) {
    mgpu__library.pid = getpid();
    mgpu__library.forked = 1; /* before the workers start: work they find may not call CUDA */
    pthread_mutex_init(&mgpu__library.mutex, NULL);
    for (int i = 0; i < mgpu__library.ndevices; i++) {
        mgpu_device *d = mgpu__library.devices[i];
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
}

static int mgpu__tf32_allowed(int which);
static void mgpu__conv_settings_from_environment(void);
/* MGPU_CHECK_REPLICAS: 1 if data parallelism compares its replicas after each step. */
static int mgpu__check_replicas_setting(void) {
    const char *check = getenv("MGPU_CHECK_REPLICAS");
    MGPU_REQUIRE(!check || !*check || strcmp(check, "0") == 0 || strcmp(check, "1") == 0,
                 "MGPU_CHECK_REPLICAS=%s: want 1 (compare the replicas after each step) or 0", check);
    return check && strcmp(check, "1") == 0;
}
static void mgpu__init(void) {
    if (mgpu__library.initialised) return;
    mgpu__library.initialised = 1;
    mgpu__library.pid = getpid();
    MGPU__PTHREAD_CHECK(pthread_mutex_init(&mgpu__library.mutex, NULL));
    mgpu__library.seed = 0x5eed;
    mgpu__cpu_threads = mgpu__cores(); /* one CPU device alone: all of them, as OpenBLAS */
    mgpu__library.num_gpus = 0;
#if MGPU_CUDA
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err == cudaSuccess) {
        mgpu__library.num_gpus = count;
    } else {
        /* Not an error: a CUDA build on a machine without a GPU runs on the CPU. */
        cudaGetLastError();
        fprintf(stderr, "mgpu: no usable GPU (%s); running on the CPU\n",
                cudaGetErrorString(err));
    }
#endif
    atexit(mgpu__at_exit);
    pthread_atfork(NULL, NULL, mgpu__after_fork_in_child);
    /* The environment's settings now: a bad value stops the program before
       its work, not at its first convolution. */
    mgpu__tf32_allowed(0);
    mgpu__conv_settings_from_environment();
    mgpu__check_replicas_setting();
}

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
    /* A forked child cannot call CUDA (the context is the parent's): there
       the CUDA event is left alone, and goes with the child's exit. */
    if (e->cuda_created && !mgpu__library.forked) MGPU_CUDA_CHECK(cudaEventDestroy(e->cuda));
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
        if (e->cuda_created && e->cuda_gpu != q->device->gpu) {
            /* a CUDA event belongs to one GPU: recorded on another, it is made anew */
            MGPU_CUDA_CHECK(cudaEventSynchronize(e->cuda));
            MGPU_CUDA_CHECK(cudaEventDestroy(e->cuda));
            e->cuda_created = 0;
        }
        if (!e->cuda_created) {
            MGPU_CUDA_CHECK(cudaEventCreate(&e->cuda));
            e->cuda_created = 1;
            e->cuda_gpu = q->device->gpu;
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
    if (source && mgpu__queue_on_gpu(source)) mgpu__require_no_label_error(source->device);
}
MGPU_DEF double mgpu_event_elapsed_ms(mgpu_event *start, mgpu_event *end) {
    MGPU_REQUIRE(start && end && start->queue && end->queue,
                 "mgpu_event_elapsed_ms: %s event was never recorded (mgpu_event_record it first)",
                 !start || !start->queue ? "the start" : "the end");
    mgpu_event_synchronize(start);
    mgpu_event_synchronize(end);
#if MGPU_CUDA
    if (mgpu__queue_on_gpu(start->queue) && mgpu__queue_on_gpu(end->queue)) {
        float ms = 0;
        MGPU_REQUIRE(start->cuda_gpu == end->cuda_gpu,
                     "mgpu_event_elapsed_ms: the events were recorded on GPUs %d and %d; "
                     "time two events of one GPU", start->cuda_gpu, end->cuda_gpu);
        MGPU_CUDA_CHECK(cudaEventElapsedTime(&ms, start->cuda, end->cuda));
        return ms;
    }
    MGPU_REQUIRE(!mgpu__queue_on_gpu(start->queue) && !mgpu__queue_on_gpu(end->queue),
                 "mgpu_event_elapsed_ms: both events must be on GPUs or both on CPUs");
#endif
    return 1e3 * (end->time - start->time);
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
static int mgpu__double_order(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
MGPU_DEF double mgpu_median(double *values, int n) {
    MGPU_REQUIRE(n >= 1, "mgpu_median: %d values; want 1 or more", n);
    qsort(values, (size_t)n, sizeof *values, mgpu__double_order);
    return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}
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
   The caching allocator
   ====================================================================== */
static size_t mgpu__round_bytes(size_t bytes) {
    /* 512-byte granules keep blocks aligned for vector loads and make
       repeated requests of similar sizes share blocks. */
    return (bytes + 511) / 512 * 512;
}

/* Refuses host memory past the machine's: the CPU devices' blocks (in
   use and cached) and this request against its physical memory. Past it,
   the kernel would sooner or later kill the process without a word. */
static void mgpu__require_host_memory(const mgpu_device *d, size_t bytes) {
    mgpu_device *devices[MGPU_MAX_DEVICES * 4];
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&mgpu__library.mutex));
    int n = mgpu__library.ndevices;
    memcpy(devices, mgpu__library.devices, (size_t)n * sizeof devices[0]);
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__library.mutex));
    size_t held = 0;
    for (int i = 0; i < n; i++) {
        if (devices[i]->gpu >= 0) continue;
        MGPU__PTHREAD_CHECK(pthread_mutex_lock(&devices[i]->alloc_mutex));
        held += devices[i]->in_use + devices[i]->cached;
        MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&devices[i]->alloc_mutex));
    }
    double machine = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
    if ((double)held + (double)bytes > machine)
        mgpu_fatal("out of host memory on %s: asked for %.1f MiB with %.1f MiB held by the CPU devices; "
                   "the machine has %.1f MiB", d->name, bytes / 1048576.0, held / 1048576.0, machine / 1048576.0);
}

/* The category that the calling thread's allocations count under (see
   mgpu__memory_scope). */
static __thread int mgpu__memory_category;
/* Makes this thread's allocations count under category c until the
   returned category is given back to it. */
static int mgpu__memory_scope(mgpu_memory_category c) {
    int before = mgpu__memory_category;
    mgpu__memory_category = (int)c;
    return before;
}

/* An allocation that cannot be had (why: past what): one line, with the
   device's largest holders. */
static void mgpu__out_of_memory(const mgpu_device *d, size_t bytes, int category, const char *why) {
    char holders[256] = "";
    int order[MGPU_MEMORY_CATEGORIES], at = 0;
    for (int c = 0; c < MGPU_MEMORY_CATEGORIES; c++) order[c] = c;
    for (int i = 0; i < MGPU_MEMORY_CATEGORIES; i++) /* largest first */
        for (int j = i + 1; j < MGPU_MEMORY_CATEGORIES; j++)
            if (d->held[order[j]] > d->held[order[i]]) {
                int t = order[i];
                order[i] = order[j];
                order[j] = t;
            }
    for (int i = 0; i < 3 && d->held[order[i]] > 0; i++)
        at += snprintf(holders + at, sizeof holders - (size_t)at, "%s%s %.1f MiB", i ? ", " : "",
                       mgpu_memory_category_name((mgpu_memory_category)order[i]), d->held[order[i]] / 1048576.0);
    mgpu_fatal("out of memory on %s: asked for %.1f MiB (%s) with %.1f MiB in use, past %s; the largest "
               "holders: %s%s%s", d->name, bytes / 1048576.0, mgpu_memory_category_name((mgpu_memory_category)category),
               d->in_use / 1048576.0, why, at ? holders : "none", MGPU__IN_LAYER(mgpu__layer_enqueuing));
}

static void *mgpu__raw_alloc(mgpu_device *d, size_t bytes, int pinned) {
    void *p = NULL;
#if MGPU_CUDA
    if (d->gpu >= 0) {
        MGPU_CUDA_CHECK(cudaSetDevice(d->gpu));
        cudaError_t err = cudaMalloc(&p, bytes);
        if (err != cudaSuccess) {
            char why[96];
            snprintf(why, sizeof why, "what the GPU has (cudaMalloc: %s)", cudaGetErrorString(err));
            mgpu__out_of_memory(d, bytes, mgpu__memory_category, why);
        }
        return p;
    }
    if (pinned && mgpu__library.num_gpus > 0) {
        MGPU_CUDA_CHECK(cudaMallocHost(&p, bytes));
        return p;
    }
#else
    (void)pinned;
#endif
    mgpu__require_host_memory(d, bytes);
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
    if (pinned && mgpu__library.num_gpus > 0) {
        MGPU_CUDA_CHECK(cudaFreeHost(p));
        return;
    }
#else
    (void)d;
    (void)pinned;
#endif
    free(p);
}

/* Counts bytes taken (taken 1) or given back (0) under category c, and
   the peaks, with d's allocation mutex held. */
static void mgpu__memory_count(mgpu_device *d, int c, size_t bytes, int taken) {
    if (taken) {
        d->in_use += bytes;
        d->held[c] += bytes;
        if (d->held[c] > d->held_peak[c]) d->held_peak[c] = d->held[c];
        if (d->in_use > d->peak) {
            d->peak = d->in_use;
            memcpy(d->held_at_peak, d->held, sizeof d->held);
        }
    } else {
        d->in_use -= bytes;
        d->held[c] -= bytes;
    }
    if (d->recording && d->nsamples < (1 << 20)) {
        if (d->nsamples == d->samples_room) {
            d->samples_room = 2 * d->samples_room + 1024;
            d->samples = (mgpu_memory_sample *)mgpu__xrealloc(d->samples, d->samples_room * sizeof *d->samples);
        }
        mgpu_memory_sample *s = &d->samples[d->nsamples++];
        s->seconds = mgpu_now();
        s->in_use = d->in_use;
        memcpy(s->held, d->held, sizeof d->held);
    }
}
/* Moves tensor t's bytes to category c (a parameter made by a caller,
   then registered). */
static void mgpu__memory_recount(mgpu_tensor *t, mgpu_memory_category c) {
    if (!t->block || t->block->category == (int)c) return;
    mgpu_device *d = t->device;
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&d->alloc_mutex));
    mgpu__memory_count(d, t->block->category, t->block->bytes, 0);
    t->block->category = (int)c;
    mgpu__memory_count(d, (int)c, t->block->bytes, 1);
    if (d->in_use == d->peak) memcpy(d->held_at_peak, d->held, sizeof d->held); /* (the peak's, recounted) */
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&d->alloc_mutex));
}

static mgpu__block *mgpu__block_alloc(mgpu_device *d, size_t bytes, int pinned) {
    bytes = mgpu__round_bytes(bytes);
    /* the bytes counted before they are taken, under the mutex, so that
       two threads cannot both pass the limit's check */
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&d->alloc_mutex));
    int over = d->limit && d->in_use + bytes > d->limit;
    if (!over) mgpu__memory_count(d, mgpu__memory_category, bytes, 1);
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&d->alloc_mutex));
    if (over) {
        char why[96];
        snprintf(why, sizeof why, "its limit of %.1f MiB (mgpu_device_set_memory_limit)", d->limit / 1048576.0);
        mgpu__out_of_memory(d, bytes, mgpu__memory_category, why);
    }
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
    int fresh = !b;
    if (fresh) {
        b = (mgpu__block *)mgpu__xcalloc(1, sizeof *b);
        b->bytes = bytes;
        b->ptr = mgpu__raw_alloc(d, bytes, pinned);
    }
    b->category = mgpu__memory_category;
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&d->alloc_mutex));
    d->allocations += (size_t)fresh;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&d->alloc_mutex));
    return b;
}

static void mgpu__block_release(mgpu_device *d, mgpu__block *b, int pinned, mgpu_event *pending) {
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&d->alloc_mutex));
    mgpu__memory_count(d, b->category, b->bytes, 0);
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
    free(d->samples);
    d->samples = NULL;
    d->nsamples = d->samples_room = 0;
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
    mgpu__library.seed = seed;
    mgpu__library.offset = 0;
}
/* Each draw takes the next block of counters, rounded to whole Philox blocks. */
static uint64_t mgpu__random_offset(size_t n) {
    mgpu__init();
    uint64_t offset = mgpu__library.offset;
    mgpu__library.offset += (n + 3) / 4 * 4;
    return offset;
}

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
    for (int i = 0; i < s.ndim && i < MGPU_MAX_DIMS; i++) n *= (size_t)s.d[i];
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

/* The values of a shape that op is given, which must be one a tensor can
   have: 1 to MGPU_MAX_DIMS sizes of 0 or more (mgpu_shape is a plain
   struct a program may fill itself), and at most 2^60 values, so that
   their bytes, rounded up by the allocator and with a layer's guard
   floats, still fit a size_t (no machine holds a tenth of that). */
static size_t mgpu__tensor_numel(mgpu_shape shape, const char *op) {
    MGPU_REQUIRE(shape.ndim >= 1 && shape.ndim <= MGPU_MAX_DIMS,
                 "%s: a tensor has 1 to %d dimensions, not %d", op, MGPU_MAX_DIMS, shape.ndim);
    size_t numel = 1;
    for (int i = 0; i < shape.ndim; i++) {
        MGPU_REQUIRE(shape.d[i] >= 0, "%s: a shape cannot have a negative size (%d in dimension %d)", op,
                     shape.d[i], i);
        MGPU_REQUIRE(shape.d[i] == 0 || numel <= ((size_t)1 << 60) / (size_t)shape.d[i],
                     "%s: a shape of more values than memory can hold (dimension %d: %d)", op, i,
                     shape.d[i]);
        numel *= (size_t)shape.d[i];
    }
    return numel;
}

/* Tensor headers. A freed tensor's header is not given back to malloc:
   it waits in a queue, marked dead, until MGPU__FREED_HEADERS others have
   been freed after it, and is then reused. So a second mgpu_free of a
   tensor, or the use of a tensor (or of a view of it) after mgpu_free,
   reads a header that is still there and says so in one line, instead
   of freeing another tensor's memory or reading its values; a view
   checks that its tensor has not been freed since the view was taken
   (the count of its frees). What it misses: a tensor used after more
   than MGPU__FREED_HEADERS later frees, whose header may be a new
   tensor's by then. The cost: two words of memory per header, and a
   compare per tensor per operation. */
#define MGPU__FREED_HEADERS 4096
static struct {
    pthread_mutex_t mutex;
    mgpu_tensor **queue; /* the latest freed headers, oldest first: a ring of MGPU__FREED_HEADERS */
    int head, count;
    mgpu_tensor **ready; /* older ones, to be reused (a stack of ready_count, room for ready_room) */
    size_t ready_count, ready_room;
} mgpu__headers = {PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0, NULL, 0, 0};
static mgpu_tensor *mgpu__header_new(void) {
    mgpu_tensor *t = NULL;
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&mgpu__headers.mutex));
    if (mgpu__headers.ready_count) t = mgpu__headers.ready[--mgpu__headers.ready_count];
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__headers.mutex));
    unsigned frees = t ? t->frees : 0;
    if (!t) t = (mgpu_tensor *)mgpu__xmalloc(sizeof *t);
    memset(t, 0, sizeof *t);
    t->frees = frees;
    t->alive = 1;
    return t;
}
static void mgpu__header_free(mgpu_tensor *t) {
    t->alive = 0;
    t->frees++;
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&mgpu__headers.mutex));
    if (!mgpu__headers.queue)
        mgpu__headers.queue = (mgpu_tensor **)mgpu__xcalloc(MGPU__FREED_HEADERS, sizeof(mgpu_tensor *));
    if (mgpu__headers.count == MGPU__FREED_HEADERS) { /* the oldest, MGPU__FREED_HEADERS frees ago, may go */
        if (mgpu__headers.ready_count == mgpu__headers.ready_room) {
            mgpu__headers.ready_room = mgpu__headers.ready_room ? 2 * mgpu__headers.ready_room : 1024;
            mgpu__headers.ready = (mgpu_tensor **)mgpu__xrealloc(mgpu__headers.ready,
                                                                 mgpu__headers.ready_room * sizeof(mgpu_tensor *));
        }
        mgpu__headers.ready[mgpu__headers.ready_count++] = mgpu__headers.queue[mgpu__headers.head];
        mgpu__headers.head = (mgpu__headers.head + 1) % MGPU__FREED_HEADERS;
        mgpu__headers.count--;
    }
    mgpu__headers.queue[(mgpu__headers.head + mgpu__headers.count) % MGPU__FREED_HEADERS] = t;
    mgpu__headers.count++;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__headers.mutex));
}
/* A tensor an operation `op` is given: alive, and if a view, its tensor
   not freed since. */
static void mgpu__require_alive(const mgpu_tensor *t, const char *op) {
    char sh[64];
    MGPU_REQUIRE(t->alive, "%s: a tensor of shape %s used after mgpu_free freed it", op,
                 mgpu_shape_str(t->shape, sh, sizeof sh));
    MGPU_REQUIRE(!t->base || (t->base->alive && t->base->frees == t->base_frees),
                 "%s: a view (shape %s) of a tensor that mgpu_free has freed since the view was taken", op,
                 mgpu_shape_str(t->shape, sh, sizeof sh));
}

/* A tensor of this shape on dev, its memory extra_floats longer than its
   values (a layer of yours' guard floats: mgpu__ensure_guarded). */
static mgpu_tensor *mgpu__tensor_alloc(mgpu_device *dev, mgpu_shape shape, int pinned, size_t extra_floats) {
    MGPU_REQUIRE(dev != NULL, "tensor on a NULL device");
    size_t numel = mgpu__tensor_numel(shape, "a new tensor");
    mgpu_tensor *t = mgpu__header_new();
    t->shape = shape;
    t->numel = numel;
    t->device = dev;
    t->pinned = pinned;
    t->block = mgpu__block_alloc(dev, (t->numel + extra_floats) * sizeof(float), pinned);
    t->data = (float *)t->block->ptr;
    return t;
}

MGPU_DEF mgpu_tensor *mgpu_empty(mgpu_device *dev, mgpu_shape shape) {
    return mgpu__tensor_alloc(dev, shape, 0, 0);
}
MGPU_DEF mgpu_tensor *mgpu_empty_pinned(mgpu_shape shape) {
    return mgpu__tensor_alloc(mgpu_cpu(), shape, 1, 0);
}

MGPU_DEF void mgpu_free(mgpu_tensor *t) {
    if (!t) return;
    char sh[64];
    MGPU_REQUIRE(t->alive, "mgpu_free: a tensor of shape %s freed a second time",
                 mgpu_shape_str(t->shape, sh, sizeof sh));
    MGPU_REQUIRE(!t->owner, "mgpu_free: a tensor of shape %s that belongs to %s; do not free it",
                 mgpu_shape_str(t->shape, sh, sizeof sh), t->owner);
    if (t->block) mgpu__block_release(t->device, t->block, t->pinned, t->last_read);
    else mgpu_event_free(t->last_read);
    mgpu_event_free(t->last_write); /* covered by last_read, which waited for it */
    mgpu__header_free(t);
}

MGPU_DEF mgpu_tensor *mgpu_view(const mgpu_tensor *t, mgpu_shape shape) {
    char a[64], b[64];
    mgpu__require_alive(t, "mgpu_view");
    MGPU_REQUIRE(mgpu__tensor_numel(shape, "mgpu_view") == t->numel, "cannot view a tensor of shape %s as %s",
                 mgpu_shape_str(t->shape, a, sizeof a), mgpu_shape_str(shape, b, sizeof b));
    mgpu_tensor *v = mgpu__header_new();
    v->data = t->data;
    v->shape = shape;
    v->numel = t->numel;
    v->device = t->device;
    v->pinned = t->pinned;
    v->base = t->base ? t->base : (mgpu_tensor *)t;
    v->base_frees = v->base->frees;
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
    mgpu__require_alive(t, "mgpu_narrow");
    MGPU_REQUIRE(start >= 0 && length >= 0 && (long long)start + length <= t->shape.d[0],
                 "mgpu_narrow: cannot take rows %d..%lld of a tensor of shape %s", start, (long long)start + length,
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
    mgpu__require_alive(t, "an operation writing a tensor");
    if (t->base) t = t->base;
    if (!t->last_read) return;
    mgpu__event_wait_on(&t->device->queue[0], t->last_read);
    mgpu_event_free(t->last_read);
    t->last_read = NULL;
}

static void mgpu__require_device(const mgpu_tensor *t, const mgpu_device *dev, const char *op) {
    mgpu__require_alive(t, op);
    MGPU_REQUIRE(t->device == dev, "%s: a tensor on %s is used with one on %s; copy it first with mgpu_to",
                 op, t->device->name, dev->name);
}
static void mgpu__require_same_shape(const mgpu_tensor *a, const mgpu_tensor *b, const char *op) {
    char sa[64], sb[64];
    MGPU_REQUIRE(mgpu_shape_equal(a->shape, b->shape), "%s: shapes %s and %s differ", op,
                 mgpu_shape_str(a->shape, sa, sizeof sa), mgpu_shape_str(b->shape, sb, sizeof sb));
}

/* Refuses an output that shares memory with an input: overlapping views
   of one tensor, where the operation would read values it has already
   written (PyTorch refuses them too). The very same values (y += y) are
   fine for an operation that reads each value before writing it
   (allow_same); a matrix product is not one. */
static void mgpu__require_apart(const mgpu_tensor *out, const mgpu_tensor *in, const char *op, int allow_same) {
    if (out->device != in->device || !out->numel || !in->numel) return;
    int shared = out->data < in->data + in->numel && in->data < out->data + out->numel;
    int same = out->data == in->data && out->numel == in->numel;
    MGPU_REQUIRE(!shared || (allow_same && same), "%s: the output and an input share memory (%s)", op,
                 same ? "the same tensor" : "overlapping views of one tensor");
}

#ifdef __cplusplus
}
#endif

/* The kernel families: each file holds the CPU reference of its
   operations and, under nvcc, their CUDA kernels. */
#ifdef MGPU_CUDA_EMU
#include "kernels.h" /* the same files, their launches rewritten for the emulator (Makefile) */
#else
#include "kernels/elementwise.h"
#include "kernels/matmul.h"
#include "kernels/activation.h"
#include "kernels/channels_last.h"
#include "kernels/conv.h"
#include "kernels/conv_nhwc.h"
#include "kernels/winograd.h"
#include "kernels/pool.h"
#include "kernels/linear.h"
#include "kernels/batchnorm.h"
#include "kernels/conv_few_inputs.h"
#include "kernels/conv_onednn.h"
#include "kernels/conv_cudnn.h"
#include "kernels/loss.h"
#include "kernels/sgd.h"
#include "kernels/adam.h"
#endif

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
    args.key = mgpu__library.seed;
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
    mgpu__require_apart(y, x, "mgpu_add_", 1);
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
/* Which products may use TF32 on a GPU: [0] convolutions, [1] mgpu_matmul
   and the linear layers. -1 until first asked: then MGPU_TF32 or
   PyTorch's defaults (conv yes, matmul no). */
static int mgpu__tf32[2] = {-1, -1};
MGPU_DEF void mgpu_set_tf32(int conv, int matmul) {
    mgpu__tf32[0] = conv != 0;
    mgpu__tf32[1] = matmul != 0;
}
enum { MGPU__TF32_CONV, MGPU__TF32_MATMUL };
static int mgpu__tf32_allowed(int which) {
    if (mgpu__tf32[which] < 0) {
        const char *env = getenv("MGPU_TF32");
        MGPU_REQUIRE(!env || !*env || strcmp(env, "0") == 0 || strcmp(env, "1") == 0,
                     "MGPU_TF32=%s: want 0 (float32 everywhere) or 1 (TF32 in every product)",
                     env);
        if (env && *env) mgpu_set_tf32(env[0] == '1', env[0] == '1');
        else mgpu_set_tf32(1, 0);
    }
    return mgpu__tf32[which];
}
MGPU_DEF void mgpu_get_tf32(int *conv, int *matmul) {
    *conv = mgpu__tf32_allowed(MGPU__TF32_CONV);
    *matmul = mgpu__tf32_allowed(MGPU__TF32_MATMUL);
}
MGPU_DEF const char *mgpu_tf32_str(void) {
    static const char *words[2][2] = {
        {"float32 everywhere", "TF32 in matrix products, float32 in convolutions"},
        {"TF32 in convolutions, float32 in matrix products (PyTorch's defaults)",
         "TF32 in every product"}};
    int conv, matmul;
    mgpu_get_tf32(&conv, &matmul);
    return words[conv][matmul];
}

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
    mgpu__require_apart(c, a, "mgpu_matmul", 0);
    mgpu__require_apart(c, b, "mgpu_matmul", 0);
    mgpu__gemm_args g = mgpu__gemm_dense(0, 0, a->shape.d[0], b->shape.d[1], a->shape.d[1], a->data,
                                         b->data, c->data, 0.0f,
                                         mgpu__tf32_allowed(MGPU__TF32_MATMUL));
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
   a GPU stream), or of the source device between CPU devices. It waits
   for the destination device's compute queue to finish what it has been
   given (its work may still read dst, or the memory the allocator has just
   handed out as dst), or, given dst_free, for that event only: the caller
   knows when the last work reading dst ends (mgpu__scatter). It waits for
   the source device's compute queue to finish what it has been given (its
   work may still write src), or, given src_ready, for that event only:
   the caller knows when src was written (a pipeline's stages, whose
   queues have gone on to later work by the time the next stage takes
   their output). */
static void mgpu__copy(mgpu_tensor *dst, const mgpu_tensor *src, int non_blocking, mgpu_event *dst_free,
                       mgpu_event *src_ready) {
    mgpu__require_alive(dst, "mgpu_copy");
    mgpu__require_alive(src, "mgpu_copy");
    mgpu__require_same_shape(dst, src, "mgpu_copy");
    mgpu__require_apart(dst, src, "mgpu_copy", 1);
    mgpu_device *from = src->device, *to = dst->device;
    mgpu__queue *q = (to->gpu >= 0 && from->gpu < 0) ? &to->queue[1] : &from->queue[1];
    /* Wait for the source to be written and for the destination to be free.
       One event per queue: an event re-recorded on another queue could
       complete out of order (and a CUDA event belongs to one GPU). */
    mgpu_event *ready = NULL;
    if (src_ready) {
        mgpu__event_wait_on(q, src_ready);
    } else {
        ready = mgpu_event_new();
        mgpu__event_record_on(ready, &from->queue[0]);
        mgpu__event_wait_on(q, ready);
    }
    if (to != from && dst_free) {
        mgpu__event_wait_on(q, dst_free);
    } else if (to != from) {
        mgpu_event *free_dst = mgpu_event_new();
        mgpu__event_record_on(free_dst, &to->queue[0]);
        mgpu__event_wait_on(q, free_dst);
        mgpu_event_free(free_dst);
    }
    /* ... and for copies on other queues still reading (or, pinned, writing) dst. */
    const mgpu_tensor *dst_base = dst->base ? dst->base : dst;
    if (dst_base->last_read) mgpu__event_wait_on(q, dst_base->last_read);
    /* A pinned source may still be being filled by a copy on another queue. */
    const mgpu_tensor *src_base = src->base ? src->base : src;
    if (src_base->last_write) mgpu__event_wait_on(q, src_base->last_write);
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
    if (dst->pinned) {
        mgpu__tensor_track(dst, done);
        mgpu_tensor *w = dst->base ? dst->base : dst;
        mgpu__event_retain(done);
        mgpu_event_free(w->last_write);
        w->last_write = done;
    } else {
        mgpu__event_wait_on(&to->queue[0], done);
    }
    /* The source remembers that a copy queue may still be reading it. */
    if (q != &from->queue[0]) mgpu__tensor_track((mgpu_tensor *)src, done);
    if (!non_blocking) mgpu_event_synchronize(done);
    mgpu_event_free(done);
    mgpu_event_free(ready);
}
MGPU_DEF void mgpu_copy(mgpu_tensor *dst, const mgpu_tensor *src, int non_blocking) {
    mgpu__copy(dst, src, non_blocking, NULL, NULL);
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
        /* On the device's own (non-blocking) compute stream: the legacy default
           stream that cudaMemcpy uses does not order the queues' streams, and a
           pageable host-to-device cudaMemcpy may return before its DMA lands. */
        cudaStream_t s = dev->queue[0].stream;
        MGPU_CUDA_CHECK(cudaSetDevice(dev->gpu));
        MGPU_CUDA_CHECK(cudaMemcpyAsync(t->data, values, t->numel * sizeof(float),
                                        cudaMemcpyHostToDevice, s));
        MGPU_CUDA_CHECK(cudaStreamSynchronize(s));
        return t;
    }
#endif
    memcpy(t->data, values, t->numel * sizeof(float));
    return t;
}

MGPU_DEF void mgpu_to_host(const mgpu_tensor *t, float *out) {
    mgpu__require_alive(t, "mgpu_to_host");
    /* A non-blocking copy into pinned memory is tracked on the tensor, not
       waited for by the CPU device's queues: wait for it here. */
    const mgpu_tensor *b = t->base ? t->base : t;
    if (b->last_write) mgpu_event_synchronize(b->last_write);
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

/* A view of value i of t alone, shape [1] (past INT_MAX too, where
   mgpu_narrow's rows stop). */
static mgpu_tensor *mgpu__value_view(const mgpu_tensor *t, size_t i) {
    mgpu_tensor *one = mgpu_view(t, t->shape);
    one->shape = mgpu_shape1(1);
    one->numel = 1;
    one->data += i;
    return one;
}
MGPU_DEF float mgpu_item(const mgpu_tensor *t, size_t i) {
    mgpu__require_alive(t, "mgpu_item");
    MGPU_REQUIRE(i < t->numel, "mgpu_item: index %zu out of range for %zu elements", i, t->numel);
    mgpu_tensor *one = mgpu__value_view(t, i);
    float v;
    mgpu_to_host(one, &v);
    mgpu_free(one);
    return v;
}

/* Prints like PyTorch: tensor([[0., 1.], [2., 3.]], device='cuda:0') */
MGPU_DEF void mgpu_print(const char *label, const mgpu_tensor *t) {
    mgpu__require_alive(t, "mgpu_print");
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

/* ======================================================================
   Tracing
   ====================================================================== */
/* Adds a bar to the trace. On a GPU queue the times come from two CUDA
   events that the caller records around the work: their handles are
   returned in gpu_events (records are reused from trace to trace, and
   another thread may grow the array meanwhile, so no pointer is kept). */
static void mgpu__trace_add(mgpu__queue *q, const char *name, const char *label, double start, double end,
                            void **gpu_events) {
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&mgpu__library.mutex));
    if (mgpu__library.trace_n == mgpu__library.trace_cap) {
        int cap = mgpu__library.trace_cap ? 2 * mgpu__library.trace_cap : 1024;
        mgpu__trace_record *grown =
            (mgpu__trace_record *)realloc(mgpu__library.trace, (size_t)cap * sizeof *grown);
        if (!grown) mgpu_fatal("out of host memory for the trace");
        memset(grown + mgpu__library.trace_cap, 0, (size_t)(cap - mgpu__library.trace_cap) * sizeof *grown);
        mgpu__library.trace = grown;
        mgpu__library.trace_cap = cap;
    }
    mgpu__trace_record *r = &mgpu__library.trace[mgpu__library.trace_n++];
    r->queue_id = q->device->index * 2 + q->lane;
    r->name = name;
    r->label = label;
    r->start = start;
    r->end = end;
#if MGPU_CUDA
    if (mgpu__queue_on_gpu(q)) {
        if (r->cuda_start && r->cuda_gpu != q->device->gpu) {
            MGPU_CUDA_CHECK(cudaEventDestroy(r->cuda_start));
            MGPU_CUDA_CHECK(cudaEventDestroy(r->cuda_end));
            r->cuda_start = r->cuda_end = NULL;
        }
        if (!r->cuda_start) { /* the caller has made q's GPU current */
            MGPU_CUDA_CHECK(cudaEventCreate(&r->cuda_start));
            MGPU_CUDA_CHECK(cudaEventCreate(&r->cuda_end));
            r->cuda_gpu = q->device->gpu;
        }
        gpu_events[0] = (void *)r->cuda_start;
        gpu_events[1] = (void *)r->cuda_end;
    }
#else
    (void)gpu_events;
#endif
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__library.mutex));
}

MGPU_DEF void mgpu_trace_begin(void) {
    mgpu_synchronize_all();
    mgpu__library.trace_n = 0;
#if MGPU_CUDA
    /* One reference event per GPU: GPU times are measured from it. */
    for (int g = 0; g < mgpu__library.num_gpus && g < MGPU_MAX_DEVICES; g++) {
        MGPU_CUDA_CHECK(cudaSetDevice(g));
        if (!mgpu__library.trace_cuda_start[g])
            MGPU_CUDA_CHECK(cudaEventCreate(&mgpu__library.trace_cuda_start[g]));
        MGPU_CUDA_CHECK(cudaEventRecord(mgpu__library.trace_cuda_start[g], 0));
        MGPU_CUDA_CHECK(cudaEventSynchronize(mgpu__library.trace_cuda_start[g]));
    }
#endif
    mgpu__library.trace_start = mgpu_now();
    mgpu__library.tracing = 1;
}

MGPU_DEF void mgpu_trace_end(void) {
    mgpu_synchronize_all();
    mgpu__library.tracing = 0;
    mgpu__library.trace_stop = mgpu_now();
}

/* A record's start and end in milliseconds since mgpu_trace_begin. */
static void mgpu__trace_times(const mgpu__trace_record *r, double *start_ms, double *end_ms) {
    *start_ms = 1e3 * (r->start - mgpu__library.trace_start);
    *end_ms = 1e3 * (r->end - mgpu__library.trace_start);
#if MGPU_CUDA
    const mgpu_device *d = mgpu__library.devices[r->queue_id / 2];
    if (d->gpu >= 0) {
        float s = 0, e = 0;
        MGPU_CUDA_CHECK(cudaEventElapsedTime(&s, mgpu__library.trace_cuda_start[d->gpu], r->cuda_start));
        MGPU_CUDA_CHECK(cudaEventElapsedTime(&e, mgpu__library.trace_cuda_start[d->gpu], r->cuda_end));
        *start_ms = s;
        *end_ms = e;
    }
#endif
}

MGPU_DEF int mgpu_trace_write_png(const char *path, const char *title) {
    mgpu__init();
    if (mgpu__library.tracing) mgpu_trace_end(); /* every traced operation must have finished */
    /* Lanes: only the queues that did something, in device order. */
    int lane_of[MGPU_MAX_DEVICES * 8];
    const char *lane_names[MGPU_MAX_DEVICES * 8];
    int nqueues = 2 * mgpu__library.ndevices, nlanes = 0;
    for (int id = 0; id < nqueues; id++) {
        lane_of[id] = -1;
        for (int i = 0; i < mgpu__library.trace_n; i++)
            if (mgpu__library.trace[i].queue_id == id) {
                lane_of[id] = nlanes;
                lane_names[nlanes++] = mgpu__library.devices[id / 2]->queue[id % 2].name;
                break;
            }
    }
    mgpu_timeline_bar *bars =
        (mgpu_timeline_bar *)mgpu__xcalloc((size_t)mgpu__library.trace_n + 1, sizeof *bars);
    for (int i = 0; i < mgpu__library.trace_n; i++) {
        const mgpu__trace_record *r = &mgpu__library.trace[i];
        mgpu_timeline_bar *b = &bars[i];
        b->lane = lane_of[r->queue_id];
        snprintf(b->name, sizeof b->name, "%s", r->name);
        mgpu__trace_times(r, &b->start_ms, &b->end_ms);
    }
    int rc = mgpu_timeline_write_png(path, title, nlanes, lane_names, mgpu__library.trace_n, bars);
    free(bars);
    return rc;
}

typedef struct { const char *name; int calls; double total_ms; } mgpu__trace_total;
static int mgpu__trace_total_cmp(const void *a, const void *b) {
    double x = ((const mgpu__trace_total *)a)->total_ms, y = ((const mgpu__trace_total *)b)->total_ms;
    return x < y ? 1 : x > y ? -1 : 0;
}

MGPU_DEF void mgpu_trace_summary(FILE *f) {
    mgpu__init();
    if (mgpu__library.tracing) mgpu_trace_end(); /* every traced operation must have finished */
    mgpu__trace_total *totals =
        (mgpu__trace_total *)mgpu__xcalloc((size_t)mgpu__library.trace_n + 1, sizeof *totals);
    int ntotals = 0;
    double all_ms = 0;
    for (int i = 0; i < mgpu__library.trace_n; i++) {
        const mgpu__trace_record *r = &mgpu__library.trace[i];
        double start, end;
        mgpu__trace_times(r, &start, &end);
        int t = 0;
        while (t < ntotals && strcmp(totals[t].name, r->name) != 0) t++;
        if (t == ntotals) totals[ntotals++].name = r->name;
        totals[t].calls++;
        totals[t].total_ms += end - start;
        all_ms += end - start;
    }
    qsort(totals, (size_t)ntotals, sizeof *totals, mgpu__trace_total_cmp);
    fprintf(f, "%-32s %7s %11s %10s %7s\n", "operation", "calls", "total ms", "mean us", "share");
    for (int t = 0; t < ntotals; t++)
        fprintf(f, "%-32s %7d %11.3f %10.1f %6.1f%%\n", totals[t].name, totals[t].calls,
                totals[t].total_ms, 1e3 * totals[t].total_ms / totals[t].calls,
                all_ms > 0 ? 100.0 * totals[t].total_ms / all_ms : 0.0);
    fprintf(f, "%-32s %7d %11.3f   (summed over the queues; %.3f ms from begin to end)\n", "all",
            mgpu__library.trace_n, all_ms, 1e3 * (mgpu__library.trace_stop - mgpu__library.trace_start));
    free(totals);
}

MGPU_DEF int mgpu_trace_count(void) {
    mgpu__init();
    if (mgpu__library.tracing) mgpu_trace_end(); /* every traced operation must have finished */
    return mgpu__library.trace_n;
}
MGPU_DEF mgpu_trace_op mgpu_trace_get(int i) {
    int n = mgpu_trace_count();
    MGPU_REQUIRE(i >= 0 && i < n, "mgpu_trace_get: operation %d of %d recorded", i, n);
    const mgpu__trace_record *r = &mgpu__library.trace[i];
    const mgpu_device *d = mgpu__library.devices[r->queue_id / 2];
    mgpu_trace_op op = {d, r->queue_id % 2, d->queue[r->queue_id % 2].name, r->name, 0, 0, r->label};
    mgpu__trace_times(r, &op.start_ms, &op.end_ms);
    return op;
}
#define MGPU__TRACE_LABELS_MAX 4096
MGPU_DEF void mgpu_trace_label(const char *label) {
    mgpu__init();
    if (!label) {
        mgpu__trace_label_now = NULL;
        return;
    }
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&mgpu__library.mutex));
    int i = 0;
    while (i < mgpu__library.trace_nlabels && strcmp(mgpu__library.trace_labels[i], label) != 0) i++;
    if (i == mgpu__library.trace_nlabels) {
        if (i == MGPU__TRACE_LABELS_MAX) {
            MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__library.mutex));
            mgpu_fatal("mgpu_trace_label: more than %d distinct labels (\"%s\")", MGPU__TRACE_LABELS_MAX, label);
        }
        if (i % 64 == 0)
            mgpu__library.trace_labels =
                (char **)mgpu__xrealloc(mgpu__library.trace_labels, (size_t)(i + 64) * sizeof(char *));
        size_t bytes = strlen(label) + 1;
        mgpu__library.trace_labels[i] = (char *)memcpy(mgpu__xmalloc(bytes), label, bytes);
        mgpu__library.trace_nlabels++;
    }
    mgpu__trace_label_now = mgpu__library.trace_labels[i];
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__library.mutex));
}
MGPU_DEF double mgpu_trace_span_ms(void) {
    mgpu_trace_count();
    return 1e3 * (mgpu__library.trace_stop - mgpu__library.trace_start);
}
/* A queue runs its operations one at a time: its busy time is the sum
   of theirs. */
MGPU_DEF double mgpu_trace_busy_ms(const mgpu_device *d, int lane) {
    MGPU_REQUIRE(d && (lane == 0 || lane == 1), "mgpu_trace_busy_ms: want a device and lane 0 (compute) or 1 (copy)");
    double busy = 0;
    for (int i = 0, n = mgpu_trace_count(); i < n; i++) {
        mgpu_trace_op op = mgpu_trace_get(i);
        if (op.device == d && op.lane == lane) busy += op.end_ms - op.start_ms;
    }
    return busy;
}

/* ======================================================================
   Command-line flags
   ====================================================================== */
static void mgpu__flag_set(const mgpu_flag *f, const char *text) {
    char *end = NULL;
    errno = 0;
    /* The value is the number alone: strtol and strtod would pass over
       spaces before it, and take a '+'. */
    int starts_like_a_number = isdigit((unsigned char)text[0]) || text[0] == '.' || text[0] == '-';
    if (f->type == 'i' || f->type == 'u') {
        long v = strtol(text, &end, 10), least = f->type == 'u' ? 0 : 1;
        if (!starts_like_a_number || errno || *end || end == text || v < least || v > 1000000000)
            mgpu_fatal("%s: expected %s, got '%s'", f->name,
                       least ? "a positive whole number" : "a whole number of 0 or more", text);
        *(int *)f->value = (int)v;
    } else if (f->type == 'd' || f->type == 'z') {
        double v = strtod(text, &end);
        int zero_too = f->type == 'z';
        if (!starts_like_a_number || *end || end == text || !(v > 0 || (zero_too && v == 0)))
            mgpu_fatal("%s: expected %s, got '%s'", f->name, zero_too ? "a number of 0 or more" : "a positive number",
                       text);
        if (errno || (v != 0 && v < FLT_MIN) || v > FLT_MAX) /* (the library computes in float) */
            mgpu_fatal("%s: %s is out of float's range (%g to %g)", f->name, text, FLT_MIN, FLT_MAX);
        *(double *)f->value = v;
    } else {
        if (!*text) mgpu_fatal("%s: expected a folder, got ''", f->name);
        *(const char **)f->value = text;
    }
}

/* Makes folder dir and the folders above it where missing (mkdir -p),
   and checks that the program can write there. */
static void mgpu__make_out_folder(const char *dir) {
    char path[1024];
    if (strlen(dir) >= sizeof path - 64) /* (room for the file names after it) */
        mgpu_fatal("--out: a folder name of at most %d characters, got %zu", (int)sizeof path - 65, strlen(dir));
    snprintf(path, sizeof path, "%s", dir);
    for (char *p = path + 1; ; p++) { /* one component at a time */
        char c = *p;
        if (c == '/' || c == 0) {
            *p = 0;
            if (mkdir(path, 0777) != 0 && errno != EEXIST)
                mgpu_fatal("--out %s: cannot create folder %s (%s)", dir, path, strerror(errno));
            *p = c;
        }
        if (!c) break;
    }
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) mgpu_fatal("--out %s: not a folder", dir);
    if (access(dir, W_OK) != 0) mgpu_fatal("--out %s: cannot write there (%s)", dir, strerror(errno));
}

static void mgpu__flag_print(const mgpu_flag *f) {
    char value[64] = "";
    if (f->type == 'u') snprintf(value, sizeof value, " N (now %d)", *(int *)f->value);
    if (f->type == 'i' && *(int *)f->value) snprintf(value, sizeof value, " N (now %d)", *(int *)f->value);
    if (f->type == 'i' && !*(int *)f->value) snprintf(value, sizeof value, " N");
    if (f->type == 'd' && *(double *)f->value) snprintf(value, sizeof value, " X (now %g)", *(double *)f->value);
    if (f->type == 'd' && !*(double *)f->value) snprintf(value, sizeof value, " X");
    if (f->type == 'z') snprintf(value, sizeof value, " X (now %g)", *(double *)f->value);
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
    /* one line at a time, also into a pipe or a log, so that the lines on
       stdout and the progress lines on stderr come out in order */
    setvbuf(stdout, NULL, _IOLBF, 0);
    int seed = (int)o->seed, help = 0;
    const mgpu_flag common[] = {
        {"--devices", 'i', &o->devices, "number of (logical) devices"},
        {"--epochs", 'i', &o->epochs, "passes over the training data"},
        {"--batch-size", 'i', &o->batch_size, "global batch size, split over the devices"},
        {"--lr", 'd', &o->lr, "learning rate"},
        {"--data", 's', &o->data, "Fashion-MNIST folder (else $MGPU_DATA, then data/fashion-mnist)"},
        {"--out", 's', &o->out, "folder for the PNG and CSV files"},
        {"--seed", 'u', &seed, "random seed"},
        {"--cpu", 'b', &o->cpu, "use CPU devices even when there are GPUs"},
        {"--full", 'b', &o->full, "the book's full setting, also without a GPU"},
        {"--help", 'b', &help, "print this help"},
    };
    int ncommon = (int)(sizeof common / sizeof common[0]);
    /* A chapter's own flags first: one may give a common flag its own meaning. */
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        const mgpu_flag *f = NULL;
        for (int k = 0; k < nextra + ncommon && !f; k++) {
            const mgpu_flag *c = k < nextra ? &extra[k] : &common[k - nextra];
            if (strcmp(arg, c->name) == 0) f = c;
        }
        if (!f) mgpu_fatal("unknown flag '%s' (try --help)", arg);
        if (f->type == 'n') mgpu_fatal("%s: %s", arg, f->help);
        if (f->type == 'b') {
            *(int *)f->value = 1;
            continue;
        }
        if (i + 1 >= argc || strncmp(argv[i + 1], "--", 2) == 0)
            mgpu_fatal("%s needs a value (try --help)", arg);
        mgpu__flag_set(f, argv[++i]);
    }
    o->seed = (uint64_t)seed;
    if (help) {
        printf("%s\n\nflags:\n", about);
        for (int k = 0; k < ncommon; k++) {
            int overridden = 0;
            for (int e = 0; e < nextra; e++) overridden |= strcmp(extra[e].name, common[k].name) == 0;
            if (!overridden) mgpu__flag_print(&common[k]);
        }
        for (int k = 0; k < nextra; k++)
            if (extra[k].type != 'n') mgpu__flag_print(&extra[k]);
        exit(0);
    }
    /* Checked now, not when a run has ended: */
    if (o->devices > MGPU_MAX_DEVICES)
        mgpu_fatal("--devices %d: at most %d devices", o->devices, MGPU_MAX_DEVICES);
    if (o->epochs > MGPU_TIMER_MAX)
        mgpu_fatal("--epochs %d: at most %d (a timer keeps that many epochs' times)", o->epochs, MGPU_TIMER_MAX);
    if (!o->out) o->out = ".";
    mgpu__make_out_folder(o->out);
}

MGPU_DEF const char *mgpu_out_path(const mgpu_options *o, const char *name, char *buf, size_t size) {
    const char *dir = o->out ? o->out : ".";
    mgpu__make_out_folder(dir);
    snprintf(buf, size, "%s/%s", dir, name);
    return buf;
}

/* ======================================================================
   Data: the IDX reader, the data set and the loaders (see "Data" above)
   ======================================================================
   The reader trusts nothing in a file: every size it reads is checked
   against what the file can hold before memory is allocated or bytes are
   read, and every read is checked for errors, so a bad file gives one line
   naming it and the problem, never a crash or a read past the end. */
#include <limits.h>
#include <sys/stat.h>
#include <zlib.h>

/* ------------------------------------------------------------ IDX files */
typedef struct mgpu__idx_file {
    const char *path;
    gzFile gz;
    long long disk_bytes; /* the file's size on disk (compressed or not) */
} mgpu__idx_file;

static void mgpu__idx_fail(const mgpu__idx_file *f, const char *fmt, ...) MGPU__PRINTF(2, 3);
static void mgpu__idx_fail(const mgpu__idx_file *f, const char *fmt, ...) {
    char problem[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(problem, sizeof problem, fmt, ap);
    va_end(ap);
    mgpu_fatal("%s: %s", f->path, problem);
}

enum { MGPU__GZ_BUFFER = 1 << 17 };
/* Opens path for reading: a regular file, gzip-compressed or not. */
static mgpu__idx_file mgpu__idx_open(const char *path) {
    mgpu__idx_file f;
    f.path = path;
    f.gz = NULL;
    struct stat st;
    if (stat(path, &st) != 0) mgpu__idx_fail(&f, "cannot open (%s)", strerror(errno));
    if (S_ISDIR(st.st_mode)) mgpu__idx_fail(&f, "is a directory, not an IDX file");
    if (!S_ISREG(st.st_mode)) mgpu__idx_fail(&f, "is not a regular file");
    f.disk_bytes = (long long)st.st_size;
    f.gz = gzopen(path, "rb");
    if (!f.gz) mgpu__idx_fail(&f, "cannot open (%s)", errno ? strerror(errno) : "out of memory");
    /* Large reads go faster through a larger buffer (zlib's default is 8 KiB). */
    if (gzbuffer(f.gz, MGPU__GZ_BUFFER) != 0) mgpu__idx_fail(&f, "cannot set up zlib's buffer");
    return f;
}

/* Reads up to n bytes; a zlib error (corrupt or cut gzip data) is fatal.
   Returns how many bytes there were before the end of the data. */
static size_t mgpu__idx_read_some(mgpu__idx_file *f, unsigned char *buf, size_t n) {
    size_t got = 0;
    while (got < n) {
        /* In chunks of half zlib's buffer (set in mgpu__idx_open): a read
           larger than the buffer inflates straight into buf, and that way
           zlib lets a stream cut just before its trailer (CRC and length)
           pass unnoticed. */
        size_t chunk = n - got < MGPU__GZ_BUFFER / 2 ? n - got : MGPU__GZ_BUFFER / 2;
        int r = gzread(f->gz, buf + got, (unsigned)chunk);
        int err = Z_OK;
        const char *msg = gzerror(f->gz, &err);
        /* zlib's message starts with the path, which ours already names. */
        size_t len = strlen(f->path);
        if (strncmp(msg, f->path, len) == 0 && strncmp(msg + len, ": ", 2) == 0) msg += len + 2;
        if (err == Z_BUF_ERROR)
            mgpu__idx_fail(f, "truncated gzip stream (%s)", msg);
        if (r < 0 || err != Z_OK)
            mgpu__idx_fail(f, "corrupt gzip data (%s)", err == Z_ERRNO ? strerror(errno) : msg);
        if (r == 0) break;
        got += (size_t)r;
    }
    return got;
}

/* Reads exactly n bytes of `what` ("images" or "labels"). */
static void mgpu__idx_read(mgpu__idx_file *f, unsigned char *buf, size_t n, const char *what) {
    size_t got = mgpu__idx_read_some(f, buf, n);
    if (got < n)
        mgpu__idx_fail(f, "truncated: the file ends in the middle of the %s (%zu of %zu bytes)",
                       what, got, n);
}

static uint32_t mgpu__big_endian32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

/* What a header announces, for messages: "5 images of 28x28" or "5 labels". */
static void mgpu__idx_announced(char *buf, size_t size, int ndims, const uint32_t *dims) {
    if (ndims == 3)
        snprintf(buf, size, "%u images of %ux%u", dims[0], dims[1], dims[2]);
    else
        snprintf(buf, size, "%u labels", dims[0]);
}

/* Reads a whole IDX file of unsigned bytes with ndims dimensions (3 for
   images: count, rows, cols; 1 for labels: count) into dims and a new
   buffer. The magic number is 0x00000800 + ndims: two zero bytes, the type
   (0x08, unsigned byte) and the number of dimensions. */
static unsigned char *mgpu__idx_load(const char *path, int ndims, uint32_t dims[3]) {
    const char *kind = ndims == 3 ? "images" : "labels";
    const uint32_t magic = 0x00000800u | (uint32_t)ndims;
    mgpu__idx_file f = mgpu__idx_open(path);

    /* The magic number first: a wrong file is named as such, even when it
       is too short for the header it should have. */
    unsigned char header[16] = {0};
    size_t header_bytes = 4 + 4 * (size_t)ndims;
    size_t got = mgpu__idx_read_some(&f, header, header_bytes);
    int compressed = !gzdirect(f.gz); /* zlib knows after the first read */
    uint32_t found = mgpu__big_endian32(header);
    if (got >= 4 && found != magic)
        mgpu__idx_fail(&f, "wrong magic number 0x%08x: not an IDX %s file (0x%08x)%s", found, kind,
                       magic, compressed ? "" : ", and not gzip-compressed either");
    if (got < header_bytes)
        mgpu__idx_fail(&f, "truncated: the file ends in the middle of the header (%zu of %zu bytes)",
                       got, header_bytes);
    for (int i = 0; i < ndims; i++) dims[i] = mgpu__big_endian32(header + 4 + 4 * i);
    if (dims[0] == 0) mgpu__idx_fail(&f, "holds no %s", kind);
    /* Sizes must fit the int fields of mgpu_dataset. */
    if (dims[0] > INT_MAX) mgpu__idx_fail(&f, "%u %s are too many (at most %d)", dims[0], kind, INT_MAX);
    if (ndims == 3 && (dims[1] == 0 || dims[2] == 0 || dims[1] > 65535 || dims[2] > 65535))
        mgpu__idx_fail(&f, "images of %ux%u pixels: each side must be 1 to 65535", dims[1], dims[2]);

    uint64_t payload = dims[0];
    for (int i = 1; i < ndims; i++) payload *= dims[i];
    char announced[96];
    mgpu__idx_announced(announced, sizeof announced, ndims, dims);
    /* Check the size before allocating: an uncompressed file must be
       exactly header + payload; a gzip file cannot hold more than 1032
       times its own size (deflate's largest ratio). */
    if (!compressed) {
        long long want = (long long)(header_bytes + payload);
        if (f.disk_bytes < want)
            mgpu__idx_fail(&f, "truncated: the header announces %s (%lld bytes in all), the file has %lld",
                           announced, want, f.disk_bytes);
        if (f.disk_bytes > want)
            mgpu__idx_fail(&f, "the file is longer than its header says: %lld bytes, %lld expected for %s",
                           f.disk_bytes, want, announced);
    } else if (payload / 1032 > (uint64_t)f.disk_bytes) {
        mgpu__idx_fail(&f, "the header announces %s (%llu bytes), more than a %lld-byte gzip file can hold",
                       announced, (unsigned long long)payload, f.disk_bytes);
    }
    unsigned char *data = (unsigned char *)mgpu__xmalloc((size_t)payload);
    mgpu__idx_read(&f, data, (size_t)payload, kind);
    /* One more byte must not be there. Reading it also makes zlib check the
       gzip trailer (CRC and length) of the data just read. */
    unsigned char extra;
    if (mgpu__idx_read_some(&f, &extra, 1) != 0)
        mgpu__idx_fail(&f, "the file is longer than its header says: more than %llu bytes of data for %s",
                       (unsigned long long)(header_bytes + payload), announced);
    int rc = gzclose(f.gz);
    if (rc != Z_OK) mgpu__idx_fail(&f, "cannot close (zlib error %d)", rc);
    return data;
}

/* ------------------------------------------------------------ data sets */
MGPU_DEF const char *mgpu_data_dir(const char *flag_dir) {
    if (flag_dir) return flag_dir;
    const char *env = getenv("MGPU_DATA");
    if (env && env[0]) return env;
    return "data/fashion-mnist";
}

MGPU_DEF mgpu_dataset *mgpu_dataset_load(const char *images_path, const char *labels_path) {
    uint32_t idims[3], ldims[3];
    unsigned char *images = mgpu__idx_load(images_path, 3, idims);
    unsigned char *labels = mgpu__idx_load(labels_path, 1, ldims);
    if (ldims[0] != idims[0])
        mgpu_fatal("%s: %u labels, but %s holds %u images", labels_path, ldims[0], images_path,
                   idims[0]);
    for (uint32_t i = 0; i < ldims[0]; i++)
        if (labels[i] > 9)
            mgpu_fatal("%s: label %d of sample %u is not in 0..9", labels_path, labels[i], i);
    mgpu_dataset *d = (mgpu_dataset *)mgpu__xcalloc(1, sizeof *d);
    d->n = (int)idims[0];
    d->rows = (int)idims[1];
    d->cols = (int)idims[2];
    d->images = images;
    d->labels = labels;
    return d;
}

/* dir/name.gz if it exists, else dir/name if it exists, into path; 0 if neither. */
static int mgpu__data_find(const char *dir, const char *name, char *path, size_t size) {
    static const char *const suffixes[2] = {".gz", ""};
    for (int i = 0; i < 2; i++) {
        struct stat st;
        int len = snprintf(path, size, "%s/%s%s", dir, name, suffixes[i]);
        MGPU_REQUIRE(len > 0 && (size_t)len < size, "data path too long: %s/%s", dir, name);
        if (stat(path, &st) == 0) return 1;
        /* only a file that is not there sends us on to the next name */
        if (errno != ENOENT) mgpu_fatal("%s: cannot open (%s)", path, strerror(errno));
        if (lstat(path, &st) == 0) mgpu_fatal("%s: a link to a file that is not there", path);
    }
    return 0;
}

static mgpu_dataset *mgpu__fashion_mnist_part(const char *dir, const char *prefix) {
    char names[2][64], paths[2][4096];
    snprintf(names[0], sizeof names[0], "%s-images-idx3-ubyte", prefix);
    snprintf(names[1], sizeof names[1], "%s-labels-idx1-ubyte", prefix);
    for (int i = 0; i < 2; i++)
        if (!mgpu__data_find(dir, names[i], paths[i], sizeof paths[i]))
            mgpu_fatal("Fashion-MNIST not found: no %s/%s.gz nor %s/%s (the folder comes from "
                       "--data, else $MGPU_DATA, else data/fashion-mnist); `make data` fetches "
                       "the data set",
                       dir, names[i], dir, names[i]);
    mgpu_dataset *d = mgpu_dataset_load(paths[0], paths[1]);
    if (d->rows != 28 || d->cols != 28)
        mgpu_fatal("%s: images of %dx%d pixels; Fashion-MNIST's are 28x28", paths[0], d->rows,
                   d->cols);
    return d;
}

MGPU_DEF void mgpu_dataset_load_fashion_mnist(const char *dir, mgpu_dataset **train,
                                              mgpu_dataset **test) {
    if (!dir) dir = mgpu_data_dir(NULL);
    struct stat st;
    if (stat(dir, &st) != 0)
        mgpu_fatal("Fashion-MNIST not found: cannot open the folder %s (%s); it comes from --data, else "
                   "$MGPU_DATA, else data/fashion-mnist, and `make data` fetches the data set",
                   dir, strerror(errno));
    if (!S_ISDIR(st.st_mode))
        mgpu_fatal("%s: not a folder (Fashion-MNIST's folder comes from --data, else $MGPU_DATA, else "
                   "data/fashion-mnist)", dir);
    if (train) *train = mgpu__fashion_mnist_part(dir, "train");
    if (test) *test = mgpu__fashion_mnist_part(dir, "t10k");
}

MGPU_DEF void mgpu_dataset_truncate(mgpu_dataset *d, int n) {
    if (n > 0 && n < d->n) d->n = n;
}

MGPU_DEF mgpu_dataset *mgpu_dataset_subset(const mgpu_dataset *d, int n) {
    MGPU_REQUIRE(n >= 1, "mgpu_dataset_subset: n is %d; take at least one sample", n);
    if (n > d->n) n = d->n;
    size_t pixels = (size_t)d->rows * (size_t)d->cols;
    mgpu_dataset *s = (mgpu_dataset *)mgpu__xcalloc(1, sizeof *s);
    *s = *d;
    s->n = n;
    s->images = (unsigned char *)mgpu__xmalloc((size_t)n * pixels);
    s->labels = (unsigned char *)mgpu__xmalloc((size_t)n);
    memcpy(s->images, d->images, (size_t)n * pixels);
    memcpy(s->labels, d->labels, (size_t)n);
    return s;
}

MGPU_DEF void mgpu_dataset_free(mgpu_dataset *d) {
    if (!d) return;
    free(d->images);
    free(d->labels);
    free(d);
}

/* 64-bit FNV-1a: simple, and any flipped byte changes it. */
static uint64_t mgpu__fnv1a(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = (const unsigned char *)data;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}
#define MGPU__FNV_OFFSET 0xcbf29ce484222325ull

MGPU_DEF uint64_t mgpu_dataset_digest(const mgpu_dataset *d) {
    int size[3] = {d->n, d->rows, d->cols};
    uint64_t h = mgpu__fnv1a(MGPU__FNV_OFFSET, size, sizeof size);
    h = mgpu__fnv1a(h, d->images, (size_t)d->n * (size_t)d->rows * (size_t)d->cols);
    return mgpu__fnv1a(h, d->labels, (size_t)d->n);
}

MGPU_DEF const char *mgpu_fashion_mnist_label(int k) {
    static const char *const names[10] = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                          "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"};
    MGPU_REQUIRE(k >= 0 && k < 10, "mgpu_fashion_mnist_label: %d is not a class (0..9)", k);
    return names[k];
}

/* ------------------------------------------------------------ samplers */
/* The shuffled order of the samples in epoch `epoch`, a shuffling
   loader's and a sampler's: a Fisher-Yates shuffle whose random words
   come from Philox under a key made from (seed, epoch), so the order
   depends on nothing else. Step t (swapping position n-1-t with
   a position j in 0..n-1-t) uses word t: counter t / 4, word t % 4.
   j = word * (i + 1) / 2^32 is uniform up to a bias below (i + 1) / 2^32,
   under 2e-5 for 60000 samples: far below what training could notice. */
static void mgpu__shuffled_order(int *order, int n, uint64_t seed, int epoch) {
    uint32_t r[4];
    mgpu_philox(seed, (uint64_t)epoch, r);
    uint64_t key = (uint64_t)r[0] | (uint64_t)r[1] << 32;
    for (int i = 0; i < n; i++) order[i] = i;
    for (int i = n - 1, t = 0; i > 0; i--, t++) {
        if (t % 4 == 0) mgpu_philox(key, (uint64_t)t / 4, r);
        int j = (int)(((uint64_t)r[t % 4] * (uint64_t)(i + 1)) >> 32);
        int tmp = order[i];
        order[i] = order[j];
        order[j] = tmp;
    }
}

struct mgpu_sampler {
    int n, world, rank, shuffle;
    int num_samples, epoch;
    uint64_t seed;
    int *order; /* the epoch's order of all n samples (mgpu_sampler_indices' room) */
};

MGPU_DEF mgpu_sampler *mgpu_sampler_new(int n, int world, int rank, int shuffle, uint64_t seed,
                                        int drop_last) {
    MGPU_REQUIRE(n >= 1, "mgpu_sampler_new: %d samples; it needs at least 1", n);
    MGPU_REQUIRE(world >= 1, "mgpu_sampler_new: world size %d; it must be at least 1", world);
    MGPU_REQUIRE(rank >= 0 && rank < world, "mgpu_sampler_new: rank %d is not in 0..%d (world size %d)", rank,
                 world - 1, world);
    MGPU_REQUIRE((shuffle == 0 || shuffle == 1) && (drop_last == 0 || drop_last == 1),
                 "mgpu_sampler_new: shuffle %d and drop_last %d; want 0 or 1 each", shuffle, drop_last);
    /* torch's ceil((n - world) / world) with drop_last, where world does
       not divide n, is floor(n / world), which is also its value where it
       does; without, ceil(n / world). */
    long long per_rank = drop_last ? n / world : ((long long)n + world - 1) / world;
    MGPU_REQUIRE(per_rank * world <= INT_MAX,
                 "mgpu_sampler_new: %d samples on %d ranks make an order of %lld, more than an int counts", n,
                 world, per_rank * world);
    mgpu_sampler *s = (mgpu_sampler *)mgpu__xcalloc(1, sizeof *s);
    s->n = n;
    s->world = world;
    s->rank = rank;
    s->shuffle = shuffle;
    s->num_samples = (int)per_rank;
    s->seed = seed;
    s->order = (int *)mgpu__xmalloc((size_t)n * sizeof(int));
    for (int i = 0; i < n; i++) s->order[i] = i;
    return s;
}

MGPU_DEF void mgpu_sampler_set_epoch(mgpu_sampler *s, int epoch) {
    MGPU_REQUIRE(epoch >= 0, "mgpu_sampler_set_epoch: epoch %d is negative", epoch);
    s->epoch = epoch;
}

MGPU_DEF int mgpu_sampler_num_samples(const mgpu_sampler *s) { return s->num_samples; }
MGPU_DEF int mgpu_sampler_total_size(const mgpu_sampler *s) { return s->num_samples * s->world; }

/* Position p of the order made total_size long is order[p % n], whether
   it was cut (p < n) or went on from the start (torch's indices +=
   indices[:padding], repeated as often as needed). */
MGPU_DEF void mgpu_sampler_indices(mgpu_sampler *s, int *out) {
    if (s->shuffle) mgpu__shuffled_order(s->order, s->n, s->seed, s->epoch);
    for (int i = 0; i < s->num_samples; i++) out[i] = s->order[(s->rank + i * s->world) % s->n];
}

MGPU_DEF void mgpu_sampler_free(mgpu_sampler *s) {
    if (!s) return;
    free(s->order);
    free(s);
}

/* ------------------------------------------------------------- loaders
   A producer/consumer pair around a ring of MGPU__LOADER_RING batch
   buffers. Batch k of an epoch goes into slot k % RING. The loader thread
   (the producer) fills batch k once the program (the consumer) has
   released batch k - RING, so with 3 slots it works up to two batches
   ahead of the one the program holds. The program releases a batch when
   it asks for the next one.

   Released is not the same as unused: the program may have enqueued work
   that still reads the batch. Only two kinds of queue can read host
   memory: a copy queue (mgpu_copy of the batch, or of a view of it, onto
   any device) and the compute queue of the CPU device the buffers live
   on. So a release puts a fence in the slot: an event recorded on each of
   those queues at that moment. The producer waits for the fence before it
   overwrites the slot; it never waits for work enqueued after the
   release, so it stays ahead. */
#define MGPU__LOADER_RING 3
#define MGPU__LOADER_FENCE (MGPU_MAX_DEVICES * 4 + 1) /* every copy queue, and cpu's compute queue */

typedef struct mgpu__loader_fence {
    int n;
    mgpu_event *events[MGPU__LOADER_FENCE];
} mgpu__loader_fence;

struct mgpu_loader {
    const mgpu_dataset *data;
    int batch_size, capacity; /* capacity: rows of a buffer, min(batch_size, n) */
    int shuffle, drop_last;
    mgpu_sampler *sampler;    /* NULL: every sample of the data set */
    int count, nbatches;      /* samples and batches an epoch */
    uint64_t seed;
    int *order;               /* the epoch's order of its samples */
    mgpu_tensor *x[MGPU__LOADER_RING], *y[MGPU__LOADER_RING];
    mgpu__loader_fence fence[MGPU__LOADER_RING];
    mgpu_tensor *short_x, *short_y; /* views exposing a short last batch */
    pthread_t thread;
    pthread_mutex_t mutex;
    pthread_cond_t changed;
    /* Under the mutex. Batches [0, produced) of the epoch are ready,
       [0, handed) were given out and [0, released) given back. */
    int active, produced, handed, released;
    int filling;              /* the producer is writing a slot */
    int stop;
};

/* The batches' tensors are the loader's: mgpu_free refuses them. */
#define MGPU__LOADERS_OWN "its loader (a batch of mgpu_loader_next)"
static void mgpu__loader_free_own(mgpu_tensor *t) {
    if (t) t->owner = NULL;
    mgpu_free(t);
}

/* An epoch's samples (the data set's, or the sampler's share of them)
   and its batches: with drop_last, whole ones only. */
static void mgpu__loader_count(mgpu_loader *l) {
    l->count = l->sampler ? l->sampler->num_samples : l->data->n;
    l->nbatches = (int)(l->drop_last ? l->count / l->batch_size
                                     : ((long long)l->count + l->batch_size - 1) / l->batch_size);
}

/* Samples in batch k: batch_size, except for a shorter last batch. */
static int mgpu__loader_batch_n(const mgpu_loader *l, int k) {
    int left = l->count - k * l->batch_size;
    return left < l->batch_size ? left : l->batch_size;
}

/* The program's side: marks "now" on every queue that may read the slot. */
static void mgpu__loader_fence_record(mgpu__loader_fence *f) {
    mgpu_device *cpu = mgpu_cpu();
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&mgpu__library.mutex));
    int ndevices = mgpu__library.ndevices;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__library.mutex));
    for (; f->n < ndevices + 1; f->n++) f->events[f->n] = mgpu_event_new();
    for (int i = 0; i < ndevices; i++)
        mgpu__event_record_on(f->events[i], &mgpu__library.devices[i]->queue[1]);
    mgpu__event_record_on(f->events[ndevices], &cpu->queue[0]);
}

/* The loader thread's side: waits until those queues have passed the marks. */
static void mgpu__loader_fence_wait(mgpu__loader_fence *f) {
    for (int i = 0; i < f->n; i++) mgpu_event_synchronize(f->events[i]);
}

/* The producer's work: batch k into its slot, as ToTensor would (byte / 255). */
static void mgpu__loader_fill(mgpu_loader *l, int k) {
    int slot = k % MGPU__LOADER_RING;
    mgpu__loader_fence_wait(&l->fence[slot]);
    const mgpu_dataset *d = l->data;
    size_t pixels = (size_t)d->rows * (size_t)d->cols;
    int n = mgpu__loader_batch_n(l, k);
    for (int i = 0; i < n; i++) {
        int sample = l->order[k * l->batch_size + i];
        const unsigned char *src = d->images + (size_t)sample * pixels;
        float *dst = l->x[slot]->data + (size_t)i * pixels;
        for (size_t p = 0; p < pixels; p++) dst[p] = (float)src[p] / 255.0f;
        l->y[slot]->data[i] = (float)d->labels[sample];
    }
}

static void *mgpu__loader_thread(void *arg) {
    mgpu_loader *l = (mgpu_loader *)arg;
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&l->mutex));
    for (;;) {
        while (!l->stop && !(l->active && l->produced < l->nbatches &&
                             l->produced - l->released < MGPU__LOADER_RING))
            MGPU__PTHREAD_CHECK(pthread_cond_wait(&l->changed, &l->mutex));
        if (l->stop) break;
        int k = l->produced;
        l->filling = 1;
        MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&l->mutex));
        mgpu__loader_fill(l, k);
        MGPU__PTHREAD_CHECK(pthread_mutex_lock(&l->mutex));
        l->filling = 0;
        l->produced++;
        MGPU__PTHREAD_CHECK(pthread_cond_broadcast(&l->changed));
    }
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&l->mutex));
    return NULL;
}

MGPU_DEF mgpu_loader *mgpu_loader_new(const mgpu_dataset *d, int batch_size, int shuffle,
                                      uint64_t seed) {
    MGPU_REQUIRE(d && d->n >= 1, "mgpu_loader_new: the data set is empty");
    MGPU_REQUIRE(batch_size >= 1, "mgpu_loader_new: batch size %d; it must be at least 1",
                 batch_size);
    mgpu_loader *l = (mgpu_loader *)mgpu__xcalloc(1, sizeof *l);
    l->data = d;
    l->batch_size = batch_size;
    l->capacity = batch_size < d->n ? batch_size : d->n;
    l->shuffle = shuffle;
    mgpu__loader_count(l);
    l->seed = seed;
    l->order = (int *)mgpu__xmalloc((size_t)d->n * sizeof(int));
    for (int i = 0; i < d->n; i++) l->order[i] = i;
    /* Allocated here, on the program's thread, like every tensor. */
    for (int s = 0; s < MGPU__LOADER_RING; s++) {
        l->x[s] = mgpu_empty_pinned(mgpu_shape4(l->capacity, 1, d->rows, d->cols));
        l->y[s] = mgpu_empty_pinned(mgpu_shape1(l->capacity));
        l->x[s]->owner = l->y[s]->owner = MGPU__LOADERS_OWN;
    }
    MGPU__PTHREAD_CHECK(pthread_mutex_init(&l->mutex, NULL));
    MGPU__PTHREAD_CHECK(pthread_cond_init(&l->changed, NULL));
    MGPU__PTHREAD_CHECK(pthread_create(&l->thread, NULL, mgpu__loader_thread, l));
    return l;
}

/* Under the mutex: gives back the batch the program holds, if any. The
   views of a short last batch go with it (copies from them are covered by
   the fence). */
static void mgpu__loader_release_held(mgpu_loader *l) {
    mgpu__loader_free_own(l->short_x);
    mgpu__loader_free_own(l->short_y);
    l->short_x = l->short_y = NULL;
    if (l->handed == l->released) return;
    mgpu__loader_fence_record(&l->fence[(l->handed - 1) % MGPU__LOADER_RING]);
    l->released = l->handed;
    MGPU__PTHREAD_CHECK(pthread_cond_broadcast(&l->changed));
}

/* Batch k of an epoch is the same whichever batch it started at: the
   order is the epoch's, and batch k goes into slot k % RING as ever. */
static void mgpu__loader_start(mgpu_loader *l, int epoch, int first_batch, const char *who) {
    MGPU_REQUIRE(epoch >= 0, "%s: epoch %d is negative", who, epoch);
    MGPU_REQUIRE(first_batch >= 0 && first_batch <= l->nbatches,
                 "%s: first batch %d is not in 0..%d (the epoch's batches)", who, first_batch, l->nbatches);
    MGPU_REQUIRE(!l->sampler || l->sampler->epoch == epoch,
                 "%s: epoch %d, but its sampler is set to epoch %d: call mgpu_sampler_set_epoch(sampler, "
                 "epoch) before each epoch (as DistributedSampler.set_epoch), or every epoch repeats one order",
                 who, epoch, l->sampler ? l->sampler->epoch : 0);
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&l->mutex));
    mgpu__loader_release_held(l);
    /* The producer may be writing a batch of the old epoch: let it finish
       before the order changes under it. */
    while (l->filling) MGPU__PTHREAD_CHECK(pthread_cond_wait(&l->changed, &l->mutex));
    if (l->sampler) mgpu_sampler_indices(l->sampler, l->order);
    else if (l->shuffle) mgpu__shuffled_order(l->order, l->data->n, l->seed, epoch);
    l->active = 1;
    l->produced = l->handed = l->released = first_batch;
    MGPU__PTHREAD_CHECK(pthread_cond_broadcast(&l->changed));
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&l->mutex));
}
MGPU_DEF void mgpu_loader_start_epoch(mgpu_loader *l, int epoch) {
    mgpu__loader_start(l, epoch, 0, "mgpu_loader_start_epoch");
}
MGPU_DEF void mgpu_loader_start_epoch_at(mgpu_loader *l, int epoch, int first_batch) {
    mgpu__loader_start(l, epoch, first_batch, "mgpu_loader_start_epoch_at");
}

MGPU_DEF int mgpu_loader_next(mgpu_loader *l, mgpu_batch *out) {
    /* `active` is written by this thread only: no lock needed to read it. */
    MGPU_REQUIRE(l->active, "mgpu_loader_next: no epoch started; call mgpu_loader_start_epoch first");
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&l->mutex));
    mgpu__loader_release_held(l);
    if (l->handed == l->nbatches) {
        MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&l->mutex));
        return 0;
    }
    while (l->produced <= l->handed)
        MGPU__PTHREAD_CHECK(pthread_cond_wait(&l->changed, &l->mutex));
    int k = l->handed++;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&l->mutex));
    int slot = k % MGPU__LOADER_RING;
    out->n = mgpu__loader_batch_n(l, k);
    out->x = l->x[slot];
    out->y = l->y[slot];
    if (out->n < l->capacity) {
        out->x = l->short_x = mgpu_narrow(l->x[slot], 0, out->n);
        out->y = l->short_y = mgpu_narrow(l->y[slot], 0, out->n);
        l->short_x->owner = l->short_y->owner = MGPU__LOADERS_OWN;
    }
    return 1;
}

MGPU_DEF int mgpu_loader_num_batches(const mgpu_loader *l) { return l->nbatches; }

/* Settings that change an epoch's counts come before the first epoch:
   the loader thread reads the counts only once `active` is set (by this
   thread alone), so no lock is needed here. */
MGPU_DEF void mgpu_loader_set_drop_last(mgpu_loader *l, int drop_last) {
    MGPU_REQUIRE(drop_last == 0 || drop_last == 1, "mgpu_loader_set_drop_last: drop_last %d; want 0 or 1",
                 drop_last);
    MGPU_REQUIRE(!l->active, "mgpu_loader_set_drop_last: the loader's first epoch has started; set it before");
    l->drop_last = drop_last;
    mgpu__loader_count(l);
}

MGPU_DEF void mgpu_loader_set_sampler(mgpu_loader *l, mgpu_sampler *s) {
    MGPU_REQUIRE(s, "mgpu_loader_set_sampler: the sampler is NULL");
    MGPU_REQUIRE(s->n == l->data->n, "mgpu_loader_set_sampler: the sampler is for %d samples, the data set has %d",
                 s->n, l->data->n);
    MGPU_REQUIRE(!l->shuffle,
                 "mgpu_loader_set_sampler: the loader shuffles, and the sampler gives the order; make the loader "
                 "with shuffle 0 (as DataLoader refuses shuffle=True with a sampler)");
    MGPU_REQUIRE(!l->active, "mgpu_loader_set_sampler: the loader's first epoch has started; set it before");
    l->sampler = s;
    mgpu__loader_count(l);
}

MGPU_DEF void mgpu_loader_free(mgpu_loader *l) {
    if (!l) return;
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&l->mutex));
    mgpu__loader_release_held(l);
    l->stop = 1;
    MGPU__PTHREAD_CHECK(pthread_cond_broadcast(&l->changed));
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&l->mutex));
    MGPU__PTHREAD_CHECK(pthread_join(l->thread, NULL));
    /* Work the program enqueued on the batches must end before their memory goes. */
    for (int s = 0; s < MGPU__LOADER_RING; s++) {
        mgpu__loader_fence_wait(&l->fence[s]);
        for (int i = 0; i < l->fence[s].n; i++) mgpu_event_free(l->fence[s].events[i]);
        mgpu__loader_free_own(l->x[s]);
        mgpu__loader_free_own(l->y[s]);
    }
    pthread_mutex_destroy(&l->mutex);
    pthread_cond_destroy(&l->changed);
    free(l->order);
    free(l);
}
/* ======================================================================
   Layers: the public wrappers of kernels/conv.h, pool.h, activation.h
   and linear.h. Each checks shapes and devices, then enqueues the kernels
   on the device's compute queue. A convolution is several kernels in a
   row (im2col, a product, an axis swap, ...), enqueued one after another
   on the same queue, so they run in that order.
   ====================================================================== */

/* Enqueues fn##_cpu / fn##_cuda with `args` on dev's compute queue. */
#define MGPU__ENQUEUE(dev, name, fn, args)                                                 \
    mgpu__launch_on(&(dev)->queue[0], name, fn##_cpu, MGPU__CUDA_FN(fn##_cuda), &(args), \
                    sizeof(args))

/* Enqueues a per-channel sum (kernels/linear.h) on dev, with the scratch
   for the GPU's split sum when it needs one. */
static void mgpu__enqueue_chan_sum(mgpu_device *dev, const char *name, float *out, const float *x,
                                   int outer, int channels, size_t inner, float alpha,
                                   float beta) {
    mgpu__chan_sum_args a = {out, x, outer, channels, inner, alpha, beta, NULL, 1};
    mgpu_tensor *partials = NULL;
    if (mgpu_device_is_gpu(dev)) a.splits = mgpu__chan_sum_splits(outer, channels, inner);
    if (a.splits > 1) {
        partials = mgpu_empty(dev, mgpu_shape1(channels * a.splits));
        a.partials = partials->data;
    }
    MGPU__ENQUEUE(dev, name, mgpu__chan_sum, a);
    mgpu_free(partials); /* reused only by work enqueued after this on the same queue */
}

static void mgpu__require_shape(const mgpu_tensor *t, mgpu_shape want, const char *op,
                                const char *what) {
    char a[64], b[64];
    MGPU_REQUIRE(mgpu_shape_equal(t->shape, want), "%s: %s has shape %s, expected %s", op, what,
                 mgpu_shape_str(t->shape, a, sizeof a), mgpu_shape_str(want, b, sizeof b));
}
/* A channels-last copy of x [N, C, H, W]: [N, H*W, C] on x's device
   (kernels/channels_last.h). */
static void mgpu__require_channels_last_of(const mgpu_tensor *t, const mgpu_tensor *x, const char *op,
                                           const char *what) {
    mgpu__require_device(t, x->device, op);
    mgpu__require_shape(t, mgpu_shape3(x->shape.d[0], x->shape.d[2] * x->shape.d[3], x->shape.d[1]), op,
                        what);
}

/* The GPU kernels index in 32 bits (a 64-bit division is slow on a GPU),
   so the layers take tensors of up to 2^31 - 1 elements (8 GiB). */
#define MGPU__MAX_LAYER_NUMEL ((size_t)0x7fffffff)
static void mgpu__require_indexable(const mgpu_tensor *t, const char *op) {
    char s[64];
    MGPU_REQUIRE(t->numel <= MGPU__MAX_LAYER_NUMEL,
                 "%s: a tensor of shape %s has %zu elements, more than the layers handle "
                 "(2^31 - 1)", op, mgpu_shape_str(t->shape, s, sizeof s), t->numel);
}

/* ----------------------------------------------------------- convolution */

/* Scratch a convolution may use at once, in floats: the col buffer and
   the output in [K, n*P*Q] order, for a chunk of n images. On a GPU, 256
   MiB: one product should cover as many images as it can (fewer, larger
   products beat chunks small enough to stay in the L2 cache: the sweep
   is in bench/RESULTS.md). On
   the CPU, 4 MiB: a chunk whose col buffer stays in the processor's cache between
   im2col and the product is faster than one product over the whole
   batch. Indexed by mgpu_device_is_gpu; variables, so that the tests can
   force many small chunks. */
static size_t mgpu__conv_scratch_floats[2] = {(size_t)1 << 20, (size_t)64 << 20};
/* MGPU_CONV: how a GPU's TF32 convolutions compute y, dx and dW.
     auto      (the default) whichever of the two below is faster for the
               convolution's shape, timed at the first call with that
               shape (as PyTorch's cudnn.benchmark does);
     im2col    conv.h's im2col and cuBLAS products;
     implicit  the implicit GEMMs of kernels/conv_nhwc.h (or winograd.h,
               from the same channels-last copies, and
               conv_few_inputs.h for a first layer), or cuDNN's
               algorithms where cuDNN is built in, for each pass the
               kernel and tile shape that was fastest for it (timed the
               same way); im2col where no such kernel fits;
     cudnn     cuDNN's algorithms alone (kernels/conv_cudnn.h), the
               fastest for each pass; im2col where none fits or cuDNN is
               not built in.
   Float32 convolutions (no TF32) always take im2col; a CPU's, see below. */
typedef enum { MGPU__CONV_AUTO, MGPU__CONV_IM2COL, MGPU__CONV_IMPLICIT, MGPU__CONV_CUDNN } mgpu__conv_mode_kind;
static const char *const mgpu__conv_mode_names[] = {"auto", "im2col", "implicit", "cudnn"};
static mgpu__conv_mode_kind mgpu__conv_mode;
static int mgpu__conv_wgmma_asked; /* MGPU_WGMMA, 1 unless set to 0 */
/* Read when the library starts (mgpu__init): MGPU_CONV chooses the GPU's
   algorithm, MGPU_WGMMA whether the wgmma kernels are among the
   candidates. */
static int mgpu__conv_env_read;
static void mgpu__conv_settings_from_environment(void) {
    if (mgpu__conv_env_read) return;
    mgpu__conv_env_read = 1;
    const char *algorithm = getenv("MGPU_CONV");
    if (!algorithm || !*algorithm || strcmp(algorithm, "auto") == 0) mgpu__conv_mode = MGPU__CONV_AUTO;
    else if (strcmp(algorithm, "im2col") == 0) mgpu__conv_mode = MGPU__CONV_IM2COL;
    else if (strcmp(algorithm, "implicit") == 0) mgpu__conv_mode = MGPU__CONV_IMPLICIT;
    else if (strcmp(algorithm, "cudnn") == 0) mgpu__conv_mode = MGPU__CONV_CUDNN;
    else mgpu_fatal("MGPU_CONV=%s: want auto (the default), im2col, implicit or cudnn", algorithm);
    const char *wgmma = getenv("MGPU_WGMMA");
    MGPU_REQUIRE(!wgmma || !*wgmma || strcmp(wgmma, "0") == 0 || strcmp(wgmma, "1") == 0,
                 "MGPU_WGMMA=%s: want 1 (the default: wgmma too, on sm_90) or 0 (mma.sync alone)", wgmma);
    mgpu__conv_wgmma_asked = !wgmma || strcmp(wgmma, "0") != 0;
}

/* The geometry of conv(x, w) over the whole batch; checks that the shapes fit. */
static mgpu__conv_geom mgpu__conv_geometry(const char *op, mgpu_shape x, mgpu_shape w, int stride,
                                           int pad) {
    char sx[64], sw[64];
    mgpu_shape_str(x, sx, sizeof sx);
    mgpu_shape_str(w, sw, sizeof sw);
    MGPU_REQUIRE(x.ndim == 4 && w.ndim == 4,
                 "%s: input %s and weight %s must both have 4 dimensions ([N, C, H, W] and "
                 "[K, C, R, S])", op, sx, sw);
    MGPU_REQUIRE(x.d[0] >= 1, "%s: input %s is an empty batch", op, sx);
    MGPU_REQUIRE(x.d[1] >= 1 && x.d[2] >= 1 && x.d[3] >= 1 && w.d[0] >= 1 && w.d[2] >= 1 &&
                     w.d[3] >= 1,
                 "%s: input %s and weight %s must have no empty dimension", op, sx, sw);
    MGPU_REQUIRE(x.d[1] == w.d[1],
                 "%s: input %s has %d channels but weight %s expects %d", op, sx, x.d[1], sw,
                 w.d[1]);
    MGPU_REQUIRE(stride >= 1 && pad >= 0, "%s: stride %d must be >= 1 and padding %d >= 0", op,
                 stride, pad);
    MGPU_REQUIRE(x.d[2] + 2 * pad >= w.d[2] && x.d[3] + 2 * pad >= w.d[3],
                 "%s: a %dx%d kernel does not fit in input %s padded by %d", op, w.d[2], w.d[3],
                 sx, pad);
    mgpu__conv_geom g;
    g.n = x.d[0]; g.c = x.d[1]; g.h = x.d[2]; g.w = x.d[3];
    g.k = w.d[0]; g.r = w.d[2]; g.s = w.d[3];
    g.stride = stride;
    g.pad = pad;
    g.p = (g.h + 2 * pad - g.r) / stride + 1;
    g.q = (g.w + 2 * pad - g.s) / stride + 1;
    return g;
}

MGPU_DEF mgpu_shape mgpu_conv2d_output_shape(mgpu_shape x, mgpu_shape w, int stride, int pad) {
    mgpu__conv_geom g = mgpu__conv_geometry("mgpu_conv2d_output_shape", x, w, stride, pad);
    return mgpu_shape4(g.n, g.k, g.p, g.q);
}

/* Images per chunk: as many as the scratch allows, at least one. */
static int mgpu__conv_chunk(const mgpu__conv_geom *g, const mgpu_device *dev) {
    mgpu__conv_settings_from_environment();
    size_t per_image = (size_t)(g->c * g->r * g->s + g->k) * g->p * g->q;
    size_t n = mgpu__conv_scratch_floats[mgpu_device_is_gpu(dev)] / (per_image ? per_image : 1);
    if (n > (size_t)g->n) n = (size_t)g->n;
    return n < 1 ? 1 : (int)n;
}

/* The scratch of a chunked convolution: col [C*R*S, n*P*Q] and the output
   (or its gradient) in product order [K, n*P*Q]. Freed right after the
   kernels are enqueued: the allocator hands the blocks out again only to
   work enqueued later on the same queue. */
typedef struct {
    int chunk;
    mgpu_tensor *col, *kout;
} mgpu__conv_scratch;

static mgpu__conv_scratch mgpu__conv_scratch_new(mgpu_device *dev, const mgpu__conv_geom *g) {
    mgpu__conv_scratch s;
    s.chunk = mgpu__conv_chunk(g, dev);
    MGPU_REQUIRE((size_t)s.chunk * g->c * g->r * g->s * g->p * g->q <= MGPU__MAX_LAYER_NUMEL,
                 "conv2d: one image needs %zu floats of im2col scratch, more than the layers "
                 "handle (2^31 - 1)", (size_t)g->c * g->r * g->s * g->p * g->q);
    int cols = s.chunk * g->p * g->q;
    s.col = mgpu_empty(dev, mgpu_shape2(g->c * g->r * g->s, cols));
    s.kout = mgpu_empty(dev, mgpu_shape2(g->k, cols));
    return s;
}
static void mgpu__conv_scratch_free(mgpu__conv_scratch *s) {
    mgpu_free(s->col);
    mgpu_free(s->kout);
}

/* y = conv(x, w) + b with im2col and products, a chunk of images at a time. */
static void mgpu__conv_forward_im2col(mgpu_tensor *y, const mgpu_tensor *x, const mgpu_tensor *w,
                                      const mgpu_tensor *b, const mgpu__conv_geom *g, int tf32) {
    mgpu_device *dev = x->device;
    size_t pq = (size_t)g->p * g->q, crs = (size_t)g->c * g->r * g->s;
    mgpu__conv_scratch s = mgpu__conv_scratch_new(dev, g);
    for (int n0 = 0; n0 < g->n; n0 += s.chunk) {
        mgpu__conv_geom part = *g;
        part.n = g->n - n0 < s.chunk ? g->n - n0 : s.chunk;
        int cols = part.n * (int)pq;
        mgpu__im2col_args im = {x->data + (size_t)n0 * g->c * g->h * g->w, s.col->data, part};
        MGPU__ENQUEUE(dev, "conv2d im2col", mgpu__im2col, im);
        /* Y [K, n*P*Q] = W [K, C*R*S] col [C*R*S, n*P*Q] */
        mgpu__gemm_args prod = mgpu__gemm_dense(0, 0, g->k, cols, (int)crs, w->data, s.col->data,
                                                s.kout->data, 0.0f, tf32);
        MGPU__ENQUEUE(dev, "conv2d product", mgpu__gemm, prod);
        /* [K, n, P*Q] -> y's [n, K, P*Q] */
        mgpu__swap_outer_args back = {y->data + (size_t)n0 * g->k * pq, s.kout->data, g->k, part.n,
                                      pq, b ? b->data : NULL};
        MGPU__ENQUEUE(dev, "conv2d layout and bias", mgpu__swap_outer, back);
    }
    mgpu__conv_scratch_free(&s);
}

/* dx and dW, with im2col and products; either may be NULL (not asked
   for), and then its half of the work is left out. accumulate: dW += its
   gradient (else dW = it); add_to_dx: the same for dx. */
static void mgpu__conv_backward_im2col(mgpu_tensor *dx, mgpu_tensor *dw, const mgpu_tensor *dy,
                                       const mgpu_tensor *x, const mgpu_tensor *w,
                                       const mgpu__conv_geom *g, int tf32, int accumulate,
                                       int add_to_dx) {
    mgpu_device *dev = x->device;
    size_t pq = (size_t)g->p * g->q, crs = (size_t)g->c * g->r * g->s, chw = (size_t)g->c * g->h * g->w;
    mgpu__conv_scratch s = mgpu__conv_scratch_new(dev, g);
    for (int n0 = 0; n0 < g->n; n0 += s.chunk) {
        mgpu__conv_geom part = *g;
        part.n = g->n - n0 < s.chunk ? g->n - n0 : s.chunk;
        int cols = part.n * (int)pq;
        /* G [K, n*P*Q] from dy's [n, K, P*Q] */
        mgpu__swap_outer_args there = {s.kout->data, dy->data + (size_t)n0 * g->k * pq, part.n,
                                       g->k, pq, NULL};
        MGPU__ENQUEUE(dev, "conv2d_backward layout", mgpu__swap_outer, there);
        if (dw) {
            mgpu__im2col_args im = {x->data + (size_t)n0 * chw, s.col->data, part};
            MGPU__ENQUEUE(dev, "conv2d_backward im2col", mgpu__im2col, im);
            /* dW [K, C*R*S] (+)= G col^T; the chunks after the first add to it. */
            float beta = (accumulate || n0 > 0) ? 1.0f : 0.0f;
            mgpu__gemm_args dwp = mgpu__gemm_dense(0, 1, g->k, (int)crs, cols, s.kout->data,
                                                   s.col->data, dw->data, beta, tf32);
            MGPU__ENQUEUE(dev, "conv2d_backward dW product", mgpu__gemm, dwp);
        }
        if (dx) {
            /* dcol [C*R*S, n*P*Q] = W^T G, into col (no longer needed), then back to pixels. */
            mgpu__gemm_args dcol = mgpu__gemm_dense(1, 0, (int)crs, cols, g->k, w->data,
                                                    s.kout->data, s.col->data, 0.0f, tf32);
            MGPU__ENQUEUE(dev, "conv2d_backward dcol product", mgpu__gemm, dcol);
            mgpu__col2im_args back = {s.col->data, dx->data + (size_t)n0 * chw, part, add_to_dx};
            MGPU__ENQUEUE(dev, "conv2d_backward col2im", mgpu__col2im, back);
        }
    }
    mgpu__conv_scratch_free(&s);
}

/* What a convolution's caller prepares for it, so that a trial does not
   count it against the channels-last kernels: x's channels-last copy (a
   network's batch norm writes it, or the forward pass kept its own for
   the backward), dy's (batch norm writes it, where both gradients read
   dy only through it), the weights' (a network remakes them all in a
   few launches). The public mgpu_conv2d_* prepare nothing. */
enum { MGPU__PREPARED_X = 1, MGPU__PREPARED_DY = 2, MGPU__PREPARED_W = 4 };

/* The ways a gradient of the backward pass may take (the plan below):
   a kernel that reads the NCHW tensors as they are (conv_few_inputs.h's),
   a channels-last one, or its half of the im2col path. Given each way's time for dx (dx_ms; ignored without dx) and for
   dW (dw_ms), the fastest pair, in *by_dx and *by_dw, and its time. The
   channels-last kernels share one copy of dy, which costs dy_ms, or
   nothing where the caller prepares it (dy_prepared) and they read dy
   only through it: dW by channels-last, and dx too when wanted. */
enum { MGPU__BY_NCHW, MGPU__BY_CHANNELS_LAST, MGPU__BY_IM2COL_HALF, MGPU__WAYS };
static inline double mgpu__conv_backward_ways(const double *dx_ms, const double *dw_ms, double dy_ms,
                                              int dy_prepared, int with_dx, int *by_dx, int *by_dw) {
    double best = HUGE_VAL;
    *by_dx = *by_dw = MGPU__BY_NCHW;
    for (int i = 0; i < (with_dx ? MGPU__WAYS : 1); i++)
        for (int j = 0; j < MGPU__WAYS; j++) {
            int reads_dy_t = (with_dx && i == MGPU__BY_CHANNELS_LAST) || j == MGPU__BY_CHANNELS_LAST;
            int dy_t_only = j == MGPU__BY_CHANNELS_LAST && (!with_dx || i == MGPU__BY_CHANNELS_LAST);
            double copy_ms = reads_dy_t && !(dy_t_only && dy_prepared) ? dy_ms : 0.0;
            double ms = (with_dx ? dx_ms[i] : 0.0) + dw_ms[j] + copy_ms;
            if (ms < best) best = ms, *by_dx = i, *by_dw = j;
        }
    return best;
}

#if MGPU_CUDA
/* The implicit GEMM needs TF32 tensor cores: code compiled for sm_80 or
   newer (a plain `nvcc` without -gencode compiles for an older GPU, and
   kernels/conv_nhwc.h leaves the kernels' bodies out). Asked once (the
   library's GPUs are alike). */
static int mgpu__conv_implicit_available(void) {
    static int available = -1;
    if (available < 0) {
        cudaFuncAttributes f;
        MGPU_CUDA_CHECK(cudaFuncGetAttributes(&f, mgpu__conv_nhwc_kernel<64, 64>));
        available = f.ptxVersion >= 80 && f.binaryVersion >= 80;
        if (!available && mgpu__conv_mode == MGPU__CONV_IMPLICIT)
            fprintf(stderr, "mgpu: MGPU_CONV=implicit needs code built for sm_80 or newer (this is "
                    "sm_%d): using im2col\n", f.ptxVersion);
    }
    return available;
}

/* Which kernel computes a pass. conv_nhwc.h's implicit GEMM (direct),
   from channels-last copies of the tensors, in one of the four tiles,
   its sum split into slices or not, by mma.sync or (sm_90a) by wgmma; at
   stride t > 1, dx by its sub-pixel classes. From the same copies, for
   the forward pass and dx of 3x3 convolutions at stride 1, Winograd
   (winograd.h), and for dx of 3x3 windows at stride 2 and padding 1,
   conv_nhwc.h's kernel that takes a quad of dx's pixels, one of each
   class, at a time (stride-2 dx). And from the NCHW tensors as they are, for
   the forward pass and dW of convolutions with C*R*S <= 9,
   conv_few_inputs.h's kernels (float32), and for every pass, where
   MGPU_CUDNN is built in, cuDNN's algorithms (conv_cudnn.h). Winograd,
   stride-2 dx, few inputs and cuDNN take no tile and no slices. */
typedef enum { MGPU__DIRECT, MGPU__WINOGRAD, MGPU__FEW_INPUTS, MGPU__STRIDE2_DX, MGPU__CUDNN, MGPU__METHODS } mgpu__conv_method;
typedef struct {
    mgpu__conv_method method;
    mgpu__implicit_tile tile;
    int splits; /* slices of the sum, over (r, s, c) in the forward pass and dx (0 or 1:
                   none), over the output pixels in dW (0: the kernel's default) */
    int wgmma;  /* the direct kernel by wgmma (64 x 128 and 128 x 128 tiles) */
#if MGPU_CUDNN
    mgpu__cudnn_algorithm cudnn; /* MGPU__CUDNN: which of cuDNN's algorithms (kernels/conv_cudnn.h) */
#endif
} mgpu__implicit_kernel;
/* A kernel with no cuDNN algorithm (the fields are zero where not given). */
static inline mgpu__implicit_kernel mgpu__kernel_of(mgpu__conv_method method, mgpu__implicit_tile tile, int splits,
                                                    int wgmma) {
    mgpu__implicit_kernel k;
    memset(&k, 0, sizeof k);
    k.method = method;
    k.tile = tile;
    k.splits = splits;
    k.wgmma = wgmma;
    return k;
}
/* Whether kernel k reads the channels-last copies (all but few inputs
   and cuDNN's, which read the NCHW tensors as they are). */
static int mgpu__conv_reads_copies(mgpu__implicit_kernel k) {
    return k.method != MGPU__FEW_INPUTS && k.method != MGPU__CUDNN;
}

/* Scratch of `floats` floats for slices' partial tiles, or NULL for none. */
static mgpu_tensor *mgpu__partials(mgpu_device *dev, size_t floats) {
    return floats ? mgpu_empty(dev, mgpu_shape1((int)floats)) : NULL;
}

/* The shape of a copy's output, [outer, cols, rows]. */
static mgpu_shape mgpu__channels_last_shape(const mgpu__channels_last_to *to) {
    return mgpu_shape3(to->outer, to->cols, to->rows);
}
/* A new tensor, the copy `a` describes (its a.to.out is the new tensor's). */
static mgpu_tensor *mgpu__channels_last_copy_of(mgpu_device *dev, mgpu__channels_last_args a) {
    mgpu_tensor *t = mgpu_empty(dev, mgpu__channels_last_shape(&a.to));
    a.to.out = t->data;
    MGPU__ENQUEUE(dev, "conv2d channels-last copy", mgpu__channels_last, a);
    return t;
}
/* A new tensor [outer, cols, rows], the TF32 copy of in [outer, rows, cols]
   made by kernels/channels_last.h (flip: as there). */
static mgpu_tensor *mgpu__channels_last_copy(mgpu_device *dev, const float *in, int outer, int rows,
                                             int cols, int flip) {
    mgpu__channels_last_args a = {{NULL, outer, rows, cols, flip}, in};
    return mgpu__channels_last_copy_of(dev, a);
}

/* The copy of weights w [K, C, R*S] (k, c, rs given) to w_t [K, RS, C],
   or turned, to w'_t [C, RS flipped, K] (the weights of the input
   gradient's convolution: conv_nhwc.h), into out. */
static mgpu__channels_last_args mgpu__weights_copy(float *out, const float *w, int k, int c, int rs,
                                                   int turned) {
    mgpu__channels_last_args a = {{out, k, c, rs, 0}, w};
    mgpu__channels_last_to turned_to = {out, 1, k, c * rs, rs};
    if (turned) a.to = turned_to;
    return a;
}

/* out = conv(in_t, w) + b by Winograd's F(2x2, 3x3) (kernels/winograd.h),
   in geometry g, from the channels-last copy in_t of the input; turned
   and accumulate as below. */
static void mgpu__conv_winograd(mgpu_device *dev, float *out, const float *in_t, const float *w, const float *b,
                                const mgpu__conv_geom *g, int turned, int accumulate) {
    size_t tiles = mgpu__winograd_tiles(g);
    mgpu_tensor *v = mgpu_empty(dev, mgpu_shape1((int)(16 * tiles * g->c)));
    mgpu_tensor *u = mgpu_empty(dev, mgpu_shape1(16 * g->c * g->k));
    mgpu_tensor *m = mgpu_empty(dev, mgpu_shape1((int)(16 * tiles * g->k)));
    mgpu__winograd_args a = {out, in_t, w, b, v->data, u->data, m->data, *g, turned, accumulate};
    mgpu__launch_on(&dev->queue[0], turned ? "conv2d_backward winograd dx" : "conv2d winograd", NULL,
                    mgpu__winograd_cuda, &a, sizeof a);
    mgpu_free(v); /* (all three reused only by work enqueued after this on the same queue) */
    mgpu_free(u);
    mgpu_free(m);
}
/* The weights' channels-last TF32 copy for a product of geometry g: w_t
   [K, RS, C], or turned, w'_t [C, RS flipped, K] (for_dx: the input
   gradient's; g is then mgpu__conv_dx_geometry's, g->c the weights' K and
   g->k their C). keep_w_t: where the caller keeps it; used if there (the
   caller made it from the weights as they are), else made and left there;
   NULL: made, and in *own, to be freed after use. */
static const float *mgpu__weights_channels_last(mgpu_device *dev, const float *w, mgpu_tensor **keep_w_t,
                                                const mgpu__conv_geom *g, int for_dx, mgpu_tensor **own) {
    *own = NULL;
    if (keep_w_t && *keep_w_t) return (*keep_w_t)->data;
    int rs = g->r * g->s;
    mgpu__channels_last_args copy = for_dx ? mgpu__weights_copy(NULL, w, g->c, g->k, rs, 1)
                                           : mgpu__weights_copy(NULL, w, g->k, g->c, rs, 0);
    mgpu_tensor *w_t = mgpu__channels_last_copy_of(dev, copy);
    if (keep_w_t) *keep_w_t = w_t;
    else *own = w_t;
    return w_t->data;
}
/* out = conv(in_t, w) + b with conv_nhwc.h's kernel, in geometry g, from
   the channels-last copy in_t of the input and the weights' channels-last
   TF32 copy; as w' (turned: flipped, filters and channels swapped) when
   the convolution is the input gradient's (for_dx: in_t is dy's copy, g
   is mgpu__conv_dx_geometry). keep_w_t: as mgpu__weights_channels_last
   says. accumulate: out += the product. */
static void mgpu__conv_channels_last(mgpu_device *dev, float *out, const float *in_t, const float *w,
                                     mgpu_tensor **keep_w_t, const float *b, const mgpu__conv_geom *g,
                                     int for_dx, mgpu__implicit_kernel kernel, int accumulate) {
    if (kernel.method == MGPU__WINOGRAD) { /* (which takes the weights as they are) */
        mgpu__conv_winograd(dev, out, in_t, w, b, g, for_dx, accumulate);
        return;
    }
    mgpu_tensor *own_w_t;
    const float *w_t = mgpu__weights_channels_last(dev, w, keep_w_t, g, for_dx, &own_w_t);
    mgpu_tensor *partials = mgpu__partials(dev, mgpu__conv_nhwc_partial_floats(g, kernel.splits));
    mgpu__nhwc_out plain = {0, 0, 0, 0, 0};
    mgpu__conv_nhwc_args a = {out, in_t, w_t, b, *g, kernel.tile, plain, accumulate, kernel.splits, 0,
                              partials ? partials->data : NULL, kernel.wgmma};
    const char *name = for_dx ? "conv2d_backward channels-last dx" : "conv2d channels-last";
    mgpu__launch_on(&dev->queue[0], name, NULL, mgpu__conv_nhwc_cuda, &a, sizeof a);
    mgpu_free(partials); /* (both reused only by work enqueued after this on the same queue) */
    mgpu_free(own_w_t);
}
/* dy's channels-last copy for the backward kernels: the caller's dy_t
   when it made one for both gradients, else a new one, in *own, to be
   freed after use. */
static const float *mgpu__dy_channels_last(const mgpu_tensor *dy, const mgpu_tensor *dy_t,
                                           const mgpu__conv_geom *g, mgpu_tensor **own) {
    *own = dy_t ? NULL : mgpu__channels_last_copy(dy->device, dy->data, g->n, g->k, g->p * g->q, 0);
    return dy_t ? dy_t->data : (*own)->data;
}

#if MGPU_CUDNN
/* The device's cuDNN handle, made at its first call (the library's
   threads that enqueue work are its callers, one at a time), bound to
   its compute stream. */
static cudnnHandle_t mgpu__cudnn_ready(mgpu_device *dev) {
    mgpu__queue *q = &dev->queue[0];
    MGPU_CUDA_CHECK(cudaSetDevice(dev->gpu));
    if (!q->cudnn) {
        MGPU_CUDNN_CHECK(cudnnCreate(&q->cudnn));
        MGPU_CUDNN_CHECK(cudnnSetStream(q->cudnn, q->stream));
    }
    return q->cudnn;
}
/* Where a trial's cuDNN calls leave a refusal (mgpu__cudnn_args), or
   NULL: outside trials a refusal stops the program. */
static __thread cudnnStatus_t *mgpu__cudnn_trial_refusal;
/* out = (a pass by cuDNN's algorithm) + (add ? out : 0), and the bias b
   (the forward pass, where given); its workspace from dev's allocator.
   in_a and in_b: as mgpu__cudnn_args says. */
static void mgpu__conv_cudnn(mgpu_device *dev, float *out, const float *in_a, const float *in_b, const float *b,
                             const mgpu__conv_geom *g, mgpu__cudnn_pass pass, mgpu__cudnn_algorithm algorithm,
                             int add) {
    static const char *const names[MGPU__CUDNN_PASSES] = {"conv2d cuDNN", "conv2d_backward cuDNN dx",
                                                          "conv2d_backward cuDNN dW"};
    mgpu__cudnn_ready(dev);
    size_t floats = (algorithm.workspace + sizeof(float) - 1) / sizeof(float);
    mgpu_tensor *workspace = floats ? mgpu_empty(dev, mgpu_shape1((int)floats)) : NULL;
    mgpu__cudnn_args a = {out, in_a, in_b, b, workspace ? workspace->data : NULL, *g, pass, algorithm,
                          add ? 1.0f : 0.0f, mgpu__cudnn_trial_refusal};
    mgpu__launch_on(&dev->queue[0], names[pass], NULL, mgpu__conv_cudnn_cuda, &a, sizeof a);
    mgpu_free(workspace); /* (reused only by work enqueued after this on the same queue) */
}
#endif

/* The same with the fast kernels (TF32 but few inputs), no col buffers,
   each pass by the given kernel; from x_t and dy_t, the channels-last
   copies of x and dy, where the caller has them (else NULL). A channels-last forward
   without x_t makes the copy, and leaves it in *keep_x_t when the caller
   gives one (a network keeps it for the weight gradient, which needs the
   same copy), else frees it. */
static void mgpu__conv_forward_implicit(mgpu_tensor *y, const mgpu_tensor *x, const mgpu_tensor *x_t,
                                        const mgpu_tensor *w, mgpu_tensor **keep_w_t, const mgpu_tensor *b,
                                        const mgpu__conv_geom *g, mgpu__implicit_kernel kernel,
                                        mgpu_tensor **keep_x_t) {
    mgpu_device *dev = x->device;
#if MGPU_CUDNN
    if (kernel.method == MGPU__CUDNN) {
        mgpu__conv_cudnn(dev, y->data, x->data, w->data, b ? b->data : NULL, g, MGPU__CUDNN_Y, kernel.cudnn, 0);
        return;
    }
#endif
    if (kernel.method == MGPU__FEW_INPUTS) {
        mgpu__conv_few_inputs_args a = {y->data, x->data, w->data, b ? b->data : NULL, *g};
        mgpu__launch_on(&dev->queue[0], "conv2d few inputs", NULL, mgpu__conv_few_inputs_cuda, &a, sizeof a);
        return;
    }
    mgpu_tensor *own = x_t ? NULL : mgpu__channels_last_copy(dev, x->data, g->n, g->c, g->h * g->w, 0);
    mgpu__conv_channels_last(dev, y->data, (x_t ? x_t : own)->data, w->data, keep_w_t, b ? b->data : NULL, g, 0,
                             kernel, 0);
    if (keep_x_t) *keep_x_t = own;
    else mgpu_free(own);
}
static void mgpu__conv_dx_implicit(mgpu_tensor *dx, const mgpu_tensor *dy, const mgpu_tensor *dy_t,
                                   const mgpu_tensor *w, mgpu_tensor **keep_w_t, const mgpu__conv_geom *g,
                                   mgpu__implicit_kernel kernel, int add_to_dx) {
    mgpu_device *dev = dx->device;
#if MGPU_CUDNN
    if (kernel.method == MGPU__CUDNN) {
        mgpu__conv_cudnn(dev, dx->data, w->data, dy->data, NULL, g, MGPU__CUDNN_DX, kernel.cudnn, add_to_dx);
        return;
    }
#endif
    mgpu_tensor *own;
    const float *dy_cl = mgpu__dy_channels_last(dy, dy_t, g, &own);
    if (g->stride == 1) {
        mgpu__conv_geom d = mgpu__conv_dx_geometry(g);
        mgpu__conv_channels_last(dev, dx->data, dy_cl, w->data, keep_w_t, NULL, &d, 1, kernel, add_to_dx);
    } else if (kernel.method == MGPU__STRIDE2_DX) { /* from the turned weights, as at stride 1 */
        mgpu__conv_geom d = mgpu__conv_dx_geometry(g);
        mgpu_tensor *own_w_t;
        const float *w_t = mgpu__weights_channels_last(dev, w->data, keep_w_t, &d, 1, &own_w_t);
        mgpu__conv_nhwc_stride2_dx_args a = {dx->data, dy_cl, w_t, *g, add_to_dx};
        mgpu__launch_on(&dev->queue[0], "conv2d_backward channels-last stride-2 dx", NULL, mgpu__conv_nhwc_stride2_dx_cuda,
                        &a, sizeof a);
        mgpu_free(own_w_t); /* (reused only by work enqueued after this on the same queue) */
    } else { /* the sub-pixel classes, each with its taps of w */
        mgpu_tensor *w_classes = mgpu_empty(dev, mgpu_shape1((int)mgpu__conv_nhwc_subpixel_weight_floats(g)));
        mgpu_tensor *partials = mgpu__partials(dev, mgpu__conv_nhwc_subpixel_partial_floats(g, kernel.splits));
        mgpu__conv_nhwc_subpixel_args a = {dx->data,   dy_cl,        w->data,       w_classes->data,
                                           *g,         kernel.tile,  add_to_dx,     kernel.splits,
                                           partials ? partials->data : NULL,        kernel.wgmma};
        mgpu__launch_on(&dev->queue[0], "conv2d_backward channels-last dx", NULL, mgpu__conv_nhwc_subpixel_cuda, &a,
                        sizeof a);
        mgpu_free(partials); /* (both reused only by work enqueued after this on the same queue) */
        mgpu_free(w_classes);
    }
    mgpu_free(own);
}
/* x_t: x's channels-last copy, if the forward pass kept one (else NULL). */
static void mgpu__conv_dw_implicit(mgpu_tensor *dw, const mgpu_tensor *dy, const mgpu_tensor *dy_t,
                                   const mgpu_tensor *x, const mgpu_tensor *x_t, const mgpu__conv_geom *g,
                                   int accumulate, mgpu__implicit_kernel kernel) {
    mgpu_device *dev = x->device;
    size_t crs = (size_t)g->c * g->r * g->s;
#if MGPU_CUDNN
    if (kernel.method == MGPU__CUDNN) {
        mgpu__conv_cudnn(dev, dw->data, x->data, dy->data, NULL, g, MGPU__CUDNN_DW, kernel.cudnn, accumulate);
        return;
    }
#endif
    if (kernel.method == MGPU__FEW_INPUTS) {
        mgpu__conv_few_inputs_wgrad_args a = {dw->data, dy->data, x->data, NULL, accumulate ? 1.0f : 0.0f,
                                              mgpu__conv_few_inputs_slices(g), *g};
        mgpu_tensor *partials = mgpu_empty(dev, mgpu_shape1(a.slices * g->k * (int)crs));
        a.partials = partials->data;
        mgpu__launch_on(&dev->queue[0], "conv2d_backward few inputs dW", NULL, mgpu__conv_few_inputs_wgrad_cuda,
                        &a, sizeof a);
        mgpu_free(partials); /* reused only by work enqueued after this on the same queue */
        return;
    }
    mgpu_tensor *own, *own_x_t = NULL; /* from channels-last copies of dy and x */
    const float *dy_cl = mgpu__dy_channels_last(dy, dy_t, g, &own);
    if (!x_t) x_t = own_x_t = mgpu__channels_last_copy(dev, x->data, g->n, g->c, g->h * g->w, 0);
    mgpu__conv_nhwc_dw_args a = {dw->data, NULL, dy_cl, x_t->data, accumulate ? 1.0f : 0.0f, kernel.splits, 0, *g,
                                 kernel.tile};
    mgpu__conv_nhwc_dw_slices(&a);
    mgpu_tensor *partials = mgpu_empty(dev, mgpu_shape1(a.splits * g->k * (int)crs));
    a.partials = partials->data;
    mgpu__launch_on(&dev->queue[0], "conv2d_backward channels-last dW", NULL, mgpu__conv_nhwc_dw_cuda, &a, sizeof a);
    mgpu_free(partials); /* (all three reused only by work enqueued after this on the same queue) */
    mgpu_free(own_x_t);
    mgpu_free(own);
}

/* How a convolution's pass runs. The forward pass: with im2col, or with
   an implicit GEMM (implicit, kernel y). The backward pass: with conv.h's
   im2col path for both gradients at once (they share its dy in [K,
   n*P*Q] and its col buffer), or (implicit) each gradient on its own,
   with a fast kernel (kernels dx and dw) or with its half of the im2col
   path (dx_im2col, dw_im2col): at ResNet-18's last stage, im2col's dW
   half can beat the channels-last dW where its dx does not. */
typedef struct {
    int implicit, dx_im2col, dw_im2col;
    mgpu__implicit_kernel y, dx, dw;
} mgpu__conv_plan;

/* The plans measured so far, one for each shape and pass (measured for
   what the first caller with the shape prepares, MGPU__PREPARED_*: in
   ResNet-18 the convolutions of one shape are prepared alike). */
typedef struct {
    mgpu__conv_geom g;
    int backward, with_dx;
    mgpu__conv_plan plan;
} mgpu__conv_choice;
static mgpu__conv_choice mgpu__conv_choices[256];
static int mgpu__conv_choice_count;

/* What a trial runs: a pass (on the pass's own tensors for the forward,
   on scratch gradients for the backward, so that measuring never adds to
   a real gradient), with im2col or with one of the implicit GEMMs; the
   channels-last kernels from copies made before (x_t .. w_turned_t),
   whose cost is counted apart, where the caller does not prepare them. */
typedef struct {
    mgpu_tensor *y, *dx, *dw;
    const mgpu_tensor *x, *w, *b, *dy;
    const mgpu__conv_geom *g;
    int backward, prepared; /* prepared: MGPU__PREPARED_* */
    mgpu_tensor *x_t, *dy_t, *w_t, *w_turned_t;
} mgpu__conv_trial;
typedef enum {
    MGPU__TRY_IM2COL, MGPU__TRY_IM2COL_DX, MGPU__TRY_IM2COL_DW, MGPU__TRY_Y, MGPU__TRY_DX, MGPU__TRY_DW
} mgpu__conv_try;

/* One timed call, synchronised before and after, so that it measures this
   call alone (other queues of the same GPU may still add noise: the best
   of three counts). */
static double mgpu__conv_trial_ms(mgpu__conv_trial *t, mgpu__conv_try what, mgpu__implicit_kernel kernel) {
    mgpu_device *dev = t->x->device;
#if MGPU_CUDNN
    cudnnStatus_t refused = CUDNN_STATUS_SUCCESS; /* a cuDNN algorithm that refused the shape: not a candidate */
    mgpu__cudnn_trial_refusal = &refused;
#endif
    mgpu_synchronize(dev);
    double t0 = mgpu_now();
    switch (what) {
    case MGPU__TRY_IM2COL:
        if (t->backward) mgpu__conv_backward_im2col(t->dx, t->dw, t->dy, t->x, t->w, t->g, 1, 0, 0);
        else mgpu__conv_forward_im2col(t->y, t->x, t->w, t->b, t->g, 1);
        break;
    case MGPU__TRY_IM2COL_DX: mgpu__conv_backward_im2col(t->dx, NULL, t->dy, t->x, t->w, t->g, 1, 0, 0); break;
    case MGPU__TRY_IM2COL_DW: mgpu__conv_backward_im2col(NULL, t->dw, t->dy, t->x, t->w, t->g, 1, 0, 0); break;
    case MGPU__TRY_Y:
        mgpu__conv_forward_implicit(t->y, t->x, t->x_t, t->w, &t->w_t, t->b, t->g, kernel, NULL);
        break;
    case MGPU__TRY_DX:
        mgpu__conv_dx_implicit(t->dx, t->dy, t->dy_t, t->w, &t->w_turned_t, t->g, kernel, 0);
        break;
    case MGPU__TRY_DW: mgpu__conv_dw_implicit(t->dw, t->dy, t->dy_t, t->x, t->x_t, t->g, 0, kernel); break;
    }
    mgpu_synchronize(dev);
    double ms = (mgpu_now() - t0) * 1e3;
#if MGPU_CUDNN
    mgpu__cudnn_trial_refusal = NULL;
    if (refused != CUDNN_STATUS_SUCCESS) return HUGE_VAL;
#endif
    return ms;
}

/* Whether conv_nhwc.h's direct kernel computes a pass of this
   convolution: the forward pass and dx when the channels come in whole
   steps (dx at stride t > 1 also when its sub-pixel classes share a
   padding), and dW when channels and filters come in fours. */
static int mgpu__conv_channels_last_fits(mgpu__conv_try what, const mgpu__conv_geom *g) {
    return what == MGPU__TRY_Y    ? mgpu__conv_nhwc_fits(g)
           : what == MGPU__TRY_DX ? mgpu__conv_nhwc_dx_fits(g)
                                  : what == MGPU__TRY_DW && mgpu__conv_nhwc_dw_fits(g);
}

/* Whether dev runs the wgmma kernels, asked or not (the tests). */
static int mgpu__wgmma_runs(mgpu_device *dev) {
    static int known[MGPU_MAX_DEVICES]; /* per GPU: 0 not asked yet, 1 no, 2 yes */
    if (dev->gpu < 0 || dev->gpu >= MGPU_MAX_DEVICES) return 0;
    if (!known[dev->gpu]) {
        int major, minor;
        MGPU_CUDA_CHECK(cudaSetDevice(dev->gpu));
        MGPU_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev->gpu));
        MGPU_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev->gpu));
        known[dev->gpu] = major == 9 && minor == 0 && mgpu__wgmma_built(dev->queue[0].stream) ? 2 : 1;
    }
    return known[dev->gpu] == 2;
}
/* Whether a trial on dev times the wgmma kernels (conv_nhwc.h): unless
   MGPU_WGMMA=0, on a GPU of compute capability 9.0 whose code has
   them (nvcc built it for sm_90a; asked once a GPU). */
static int mgpu__wgmma_usable(mgpu_device *dev) {
    mgpu__conv_settings_from_environment();
    return mgpu__conv_wgmma_asked && mgpu__wgmma_runs(dev);
}

/* The slices the channels-last forward and dx are tried in (conv_nhwc.h).
   Not only powers of 2: what counts is how full the last wave of blocks
   is. ResNet-18's stage 4 (256 tiles of 64 x 128, 396 places for them on
   an H100) fills 0.65 of a wave whole, 1.3 waves in 2 slices, 1.94 in 3. */
static const int mgpu__conv_slice_choices[] = {1, 2, 3, 4, 6, 8};
/* The channels-last dW is tried in the slices of its pixels that make
   about this many blocks (its default: 512). Stage 4 again: 288 tiles of
   64 x 128 for 264 places (2 a multiprocessor: three steps in flight
   take more shared memory), 2.18 waves in its default 2 slices. */
static const int mgpu__conv_dw_block_choices[] = {256, 384, 512, 768, 1024, 1536};
#define MGPU__KERNEL_CHOICES 6 /* the length of both lists */
static_assert(sizeof mgpu__conv_slice_choices == MGPU__KERNEL_CHOICES * sizeof(int) &&
                  sizeof mgpu__conv_dw_block_choices == MGPU__KERNEL_CHOICES * sizeof(int),
              "a choice of each kind for each i");
/* Choice i (0 .. MGPU__KERNEL_CHOICES - 1) of the direct kernel in a
   tile for a pass (`what`) of geometry g, in *k; returns whether the
   trial times it: the forward pass and dx in mgpu__conv_slice_choices[i]
   slices of their sum, where every slice keeps at least 8 steps of 32
   (dx at stride t in t^2 classes, each with about 1 / t^2 of the taps)
   and the partials (all the classes', which run at once) fit in
   MGPU__PARTIAL_FLOATS_MAX (as dW's); dW in the slices for
   mgpu__conv_dw_block_choices[i] blocks, where they differ from choice
   i - 1's. With wgmma, the forward pass and dx by the wgmma kernels, in
   their tiles, as those by mma.sync. */
static int mgpu__conv_kernel_choice(mgpu__conv_try what, const mgpu__conv_geom *g, mgpu__implicit_tile tile,
                                    int wgmma, int i, mgpu__implicit_kernel *k) {
    mgpu__implicit_kernel kernel = mgpu__kernel_of(MGPU__DIRECT, tile, 1, wgmma);
    *k = kernel;
    if (wgmma && (what == MGPU__TRY_DW || !mgpu__wgmma_tile_fits(tile))) return 0;
    if (!mgpu__conv_channels_last_fits(what, g)) return 0;
    if (what == MGPU__TRY_DW) {
        k->splits = mgpu__conv_nhwc_dw_splits(g, tile, mgpu__conv_dw_block_choices[i]);
        return i == 0 || k->splits != mgpu__conv_nhwc_dw_splits(g, tile, mgpu__conv_dw_block_choices[i - 1]);
    }
    k->splits = mgpu__conv_slice_choices[i];
    int products = what == MGPU__TRY_DX ? g->stride * g->stride : 1;
    int terms = (what == MGPU__TRY_Y ? g->c : g->k) * g->r * g->s / products;
    size_t partials = what == MGPU__TRY_Y ? mgpu__conv_nhwc_partial_floats(g, k->splits)
                                          : mgpu__conv_nhwc_dx_partial_floats(g, k->splits);
    return i == 0 || (terms / MGPU__NHWC_STEP / k->splits >= 8 && partials <= MGPU__PARTIAL_FLOATS_MAX);
}
/* The geometry of the convolution a channels-last forward pass or dx
   computes: g's, or at stride 1 dx's (conv_nhwc.h). */
static mgpu__conv_geom mgpu__conv_pass_geometry(mgpu__conv_try what, const mgpu__conv_geom *g) {
    return what == MGPU__TRY_DX ? mgpu__conv_dx_geometry(g) : *g;
}
/* Whether Winograd computes a pass of geometry g from the channels-last
   copies: the forward pass or dx of a 3x3 convolution at stride 1. */
static int mgpu__conv_winograd_fits(mgpu__conv_try what, const mgpu__conv_geom *g) {
    if (what == MGPU__TRY_DW || g->stride != 1) return 0;
    if (!mgpu__conv_channels_last_fits(what, g)) return 0; /* (it reads their copies) */
    mgpu__conv_geom d = mgpu__conv_pass_geometry(what, g);
    return mgpu__winograd_fits(&d);
}
/* Whether the trial tries Winograd where it fits: where the channels and
   filters are many. Per output pixel it saves 20/36 of 18 C K multiplies
   and adds, 10 C K FLOPs, and writes and reads V and M, 16/4 (C + K)
   floats each way, 32 (C + K) bytes more. With C = K that is 0.16 C
   FLOPs saved a byte moved, against the 40 or so that the direct
   kernel's pace (about 120 TFLOP/s on an H100) over memory's (3 TB/s)
   asks: C of 256 or more, ResNet-18's stages 3 and 4. (Elsewhere the
   trial would only lose time, and stage 1's V and M, 200 MB each, would
   count in the first device's peak memory.) */
static int mgpu__conv_winograd_worth_trying(const mgpu__conv_geom *g) { return g->c >= 256 && g->k >= 256; }
/* Whether conv_nhwc.h's stride-2 dx kernel computes a pass of geometry
   g: dx at stride 2 of a 3x3 window with padding 1, where it fits. */
static int mgpu__conv_stride2_dx_fits(mgpu__conv_try what, const mgpu__conv_geom *g) {
    return what == MGPU__TRY_DX && mgpu__conv_nhwc_stride2_dx_fits(g);
}
/* Whether a method computes a pass of geometry g (the direct kernel: in
   some tile; cuDNN's algorithms are asked apart, mgpu__conv_cudnn_candidates). */
static int mgpu__conv_method_fits(mgpu__conv_method method, mgpu__conv_try what, const mgpu__conv_geom *g) {
    return method == MGPU__CUDNN          ? 0
           : method == MGPU__WINOGRAD     ? mgpu__conv_winograd_fits(what, g)
           : method == MGPU__FEW_INPUTS ? what != MGPU__TRY_DX && mgpu__conv_few_inputs_fits(g)
           : method == MGPU__STRIDE2_DX ? mgpu__conv_stride2_dx_fits(what, g)
                                        : mgpu__conv_channels_last_fits(what, g);
}
/* The kernels a trial times for a pass, into list; returns how many:
   the direct kernel's in every tile and choice that fits, by mma.sync
   and with wgmma (mgpu__wgmma_usable) by wgmma too; Winograd where it is
   worth trying, and conv_few_inputs.h's and the stride-2 dx kernel where
   they fit (the methods other than the direct kernel, one each). */
#define MGPU__CANDIDATES (2 * (int)MGPU__TILE_KINDS * MGPU__KERNEL_CHOICES + (int)MGPU__METHODS - 2)
static int mgpu__conv_candidates(mgpu__conv_try what, const mgpu__conv_geom *g, int wgmma,
                                 mgpu__implicit_kernel *list) {
    int count = 0;
    for (int by_wgmma = 0; by_wgmma <= wgmma; by_wgmma++)
        for (int t = 0; t < MGPU__TILE_KINDS; t++)
            for (int i = 0; i < MGPU__KERNEL_CHOICES; i++)
                count += mgpu__conv_kernel_choice(what, g, (mgpu__implicit_tile)t, by_wgmma, i, &list[count]);
    for (int m = MGPU__DIRECT + 1; m < MGPU__METHODS; m++) {
        mgpu__implicit_kernel k = mgpu__kernel_of((mgpu__conv_method)m, MGPU__TILE_64x64, 1, 0);
        if (mgpu__conv_method_fits(k.method, what, g) &&
            (k.method != MGPU__WINOGRAD || mgpu__conv_winograd_worth_trying(g)))
            list[count++] = k;
    }
    return count;
}

/* cuDNN's algorithms for a pass on dev, into list (at most
   MGPU__CUDNN_MAX_ALGORITHMS); returns how many (none without cuDNN). */
#if MGPU_CUDNN
#define MGPU__CUDNN_CANDIDATES MGPU__CUDNN_MAX_ALGORITHMS
/* cuDNN's name for a trial's pass. */
static mgpu__cudnn_pass mgpu__cudnn_pass_of(mgpu__conv_try what) {
    return what == MGPU__TRY_Y ? MGPU__CUDNN_Y : what == MGPU__TRY_DX ? MGPU__CUDNN_DX : MGPU__CUDNN_DW;
}
static int mgpu__conv_cudnn_candidates(mgpu_device *dev, mgpu__conv_try what, const mgpu__conv_geom *g,
                                       mgpu__implicit_kernel *list) {
    mgpu__cudnn_algorithm algorithms[MGPU__CUDNN_MAX_ALGORITHMS];
    int count = mgpu__cudnn_algorithms(mgpu__cudnn_ready(dev), mgpu__cudnn_pass_of(what), g, 1, algorithms);
    for (int i = 0; i < count; i++) {
        list[i] = mgpu__kernel_of(MGPU__CUDNN, MGPU__TILE_64x64, 1, 0);
        list[i].cudnn = algorithms[i];
    }
    return count;
}
#else
#define MGPU__CUDNN_CANDIDATES 0
static int mgpu__conv_cudnn_candidates(mgpu_device *dev, mgpu__conv_try what, const mgpu__conv_geom *g,
                                       mgpu__implicit_kernel *list) {
    (void)dev, (void)what, (void)g, (void)list;
    return 0;
}
#endif

/* Whether dx of geometry g may read the weights' turned channels-last
   copy (w'_t): at stride 1 (the direct kernel), and where the stride-2 dx kernel fits;
   the sub-pixel classes take their own taps. And whether kernel k, for
   pass `what`, reads the weights' copy (Winograd, few inputs and cuDNN
   take the weights as they are). */
static int mgpu__conv_dx_reads_turned_weights(const mgpu__conv_geom *g) {
    return g->stride == 1 || mgpu__conv_nhwc_stride2_dx_fits(g);
}
static int mgpu__conv_reads_weights_copy(mgpu__conv_try what, const mgpu__conv_geom *g, mgpu__implicit_kernel k) {
    if (k.method == MGPU__FEW_INPUTS || k.method == MGPU__WINOGRAD || k.method == MGPU__CUDNN) return 0;
    return what != MGPU__TRY_DX || g->stride == 1 || k.method == MGPU__STRIDE2_DX;
}

/* The fastest kernel for one pass (`what`) among those that read the
   channels-last copies, or (channels_last 0) the NCHW tensors, in
   *kernel, and its time (HUGE_VAL, *kernel untouched, if none fits): the
   best of three calls of each candidate, the candidates taking turns, so
   that a GPU clock still rising favours none; each one that reads the
   weights' channels-last copy charged w_copy_ms for it (Winograd takes
   the weights as they are, the sub-pixel classes their own taps). */
static double mgpu__conv_fastest_kernel(mgpu__conv_trial *t, mgpu__conv_try what, int channels_last,
                                        double w_copy_ms, mgpu__implicit_kernel *kernel) {
    mgpu__implicit_kernel candidates[MGPU__CANDIDATES + MGPU__CUDNN_CANDIDATES];
    double best[MGPU__CANDIDATES + MGPU__CUDNN_CANDIDATES], fastest = HUGE_VAL;
    mgpu_device *dev = t->x->device;
    int count = 0, fits = mgpu__conv_candidates(what, t->g, mgpu__wgmma_usable(dev), candidates);
    fits += mgpu__conv_cudnn_candidates(dev, what, t->g, candidates + fits);
    for (int i = 0; i < fits; i++)
        if (mgpu__conv_reads_copies(candidates[i]) == channels_last &&
            (mgpu__conv_mode != MGPU__CONV_CUDNN || candidates[i].method == MGPU__CUDNN))
            candidates[count++] = candidates[i];
    for (int i = 0; i < count; i++) best[i] = HUGE_VAL;
    for (int round = 0; round < 3; round++)
        for (int i = 0; i < count; i++) {
            double ms = mgpu__conv_trial_ms(t, what, candidates[i]);
            if (mgpu__conv_reads_weights_copy(what, t->g, candidates[i])) ms += w_copy_ms;
            if (ms < best[i]) best[i] = ms;
            if (round == 2 && best[i] < fastest) { /* the last round: all three are in */
                fastest = best[i];
                *kernel = candidates[i];
            }
        }
    return fastest;
}
/* The best of three calls of an im2col pass (`what`: the forward pass,
   the whole backward pass, or one gradient's half of it). */
static double mgpu__conv_im2col_ms(mgpu__conv_trial *t, mgpu__conv_try what) {
    mgpu__implicit_kernel none = mgpu__kernel_of(MGPU__DIRECT, MGPU__TILE_64x64, 1, 0); /* (im2col takes no kernel) */
    double best = HUGE_VAL;
    for (int round = 0; round < 3; round++) {
        double ms = mgpu__conv_trial_ms(t, what, none);
        if (ms < best) best = ms;
    }
    return best;
}

/* A measured plan in words, for the benchmarks and tests: the shape, and
   each pass's kernel (tile, slices of the sum) or im2col. */
static inline void mgpu__conv_kernel_str(char *out, size_t size, mgpu__implicit_kernel k, mgpu__conv_try what) {
#if MGPU_CUDNN
    if (k.method == MGPU__CUDNN) {
        snprintf(out, size, "cuDNN %s%s", mgpu__cudnn_algorithm_name(mgpu__cudnn_pass_of(what), k.cudnn.algo),
                 k.cudnn.math == CUDNN_FMA_MATH ? " (float32)" : "");
        return;
    }
#endif
    (void)what;
    if (k.method != MGPU__DIRECT) {
        snprintf(out, size, "%s", k.method == MGPU__WINOGRAD ? "channels-last Winograd"
                                  : k.method == MGPU__STRIDE2_DX  ? "channels-last stride-2 dx"
                                                             : "few inputs");
        return;
    }
    snprintf(out, size, "channels-last %s%s", mgpu__implicit_tile_names[k.tile], k.wgmma ? " wgmma" : "");
    if (k.splits > 1) snprintf(out + strlen(out), size - strlen(out), " in %d slices", k.splits);
}
static inline const char *mgpu__conv_choice_str(const mgpu__conv_choice *c, char *out, size_t size) {
    const mgpu__conv_geom *g = &c->g;
    const mgpu__conv_plan *p = &c->plan;
    char y[48], dx[48], dw[48];
    mgpu__conv_kernel_str(y, sizeof y, p->y, MGPU__TRY_Y);
    mgpu__conv_kernel_str(dx, sizeof dx, p->dx, MGPU__TRY_DX);
    mgpu__conv_kernel_str(dw, sizeof dw, p->dw, MGPU__TRY_DW);
    int at = snprintf(out, size, "%dx%d, %d -> %d, stride %d, %d x %dx%d: ", g->r, g->s, g->c, g->k, g->stride,
                      g->n, g->h, g->w);
    if (!c->backward) snprintf(out + at, size - at, "forward by %s", p->implicit ? y : "im2col");
    else if (!p->implicit) snprintf(out + at, size - at, "backward by im2col");
    else
        snprintf(out + at, size - at, "dx by %s, dW by %s", !c->with_dx ? "-" : p->dx_im2col ? "im2col" : dx,
                 p->dw_im2col ? "im2col" : dw);
    return out;
}

/* How a convolution's pass (forward, or backward with or without dx)
   runs: im2col without TF32 or on a CPU; else as MGPU_CONV says, the
   implicit GEMMs in the fastest tiles for the shape, and with auto only
   where they beat im2col: in the backward pass each gradient by the
   faster of its implicit GEMM and its half of the im2col path, unless the
   whole im2col path is faster than the two. Measured at the pass's first call with a shape,
   then remembered (not thread-safe: the chapters enqueue their
   convolutions from one thread). */
/* Whether a convolution on dev may take an implicit GEMM. */
static int mgpu__conv_implicit_allowed(const mgpu_device *dev) {
    mgpu__conv_settings_from_environment();
    return mgpu__tf32_allowed(MGPU__TF32_CONV) && mgpu_device_is_gpu(dev) &&
           mgpu__conv_mode != MGPU__CONV_IM2COL && mgpu__conv_implicit_available();
}
/* The plan measured for this pass and shape, or NULL if none was yet. */
static const mgpu__conv_plan *mgpu__conv_plan_known(const mgpu__conv_geom *g, int backward, int with_dx) {
    for (int i = 0; i < mgpu__conv_choice_count; i++) {
        const mgpu__conv_choice *c = &mgpu__conv_choices[i];
        if (!memcmp(&c->g, g, sizeof c->g) && c->backward == backward && c->with_dx == with_dx)
            return &c->plan;
    }
    return NULL;
}
/* Whether a pass by plan p reads the input x (forward), or the output
   gradient dy (backward), only through its channels-last copy: then a
   network's batch norm writes that copy itself (kernels/batchnorm.h) and
   the convolution makes none. The forward reads x_t for y; the backward
   dy_t for dW and for dx when wanted, and plain dy for the bias gradient
   when wanted (with_db). */
static int mgpu__conv_plan_reads_x_t(const mgpu__conv_plan *p) {
    return p && p->implicit && mgpu__conv_reads_copies(p->y);
}
static int mgpu__conv_plan_dw_reads_x_t(const mgpu__conv_plan *p) {
    return p && p->implicit && !p->dw_im2col && mgpu__conv_reads_copies(p->dw);
}
static int mgpu__conv_plan_reads_dy_t_only(const mgpu__conv_plan *p, int with_dx, int with_db) {
    return p && p->implicit && !with_db && !p->dw_im2col && mgpu__conv_reads_copies(p->dw) &&
           (!with_dx || (!p->dx_im2col && mgpu__conv_reads_copies(p->dx)));
}

/* A trial's copies for the channels-last kernels: made before the
   kernels are timed, each timed apart (the best of three makes), and
   counted 0 where the caller prepares it (dy: where the channels-last
   kernels read dy only through it; dy_prepared says whether it is). */
typedef struct {
    double x, dy, w, w_turned;
    int dy_prepared;
} mgpu__conv_copies_ms;
static mgpu_tensor *mgpu__conv_timed_copy(mgpu_device *dev, mgpu__channels_last_args a, double *ms) {
    mgpu_tensor *copy = mgpu_empty(dev, mgpu__channels_last_shape(&a.to));
    a.to.out = copy->data;
    *ms = HUGE_VAL;
    for (int round = 0; round < 3; round++) {
        mgpu_synchronize(dev);
        double t0 = mgpu_now();
        MGPU__ENQUEUE(dev, "conv2d channels-last copy", mgpu__channels_last, a);
        mgpu_synchronize(dev);
        double elapsed = (mgpu_now() - t0) * 1e3;
        if (elapsed < *ms) *ms = elapsed;
    }
    return copy;
}
static void mgpu__conv_trial_copies(mgpu__conv_trial *t, mgpu__conv_copies_ms *ms) {
    const mgpu__conv_geom *g = t->g;
    mgpu_device *dev = t->x->device;
    int y = !t->backward && mgpu__conv_channels_last_fits(MGPU__TRY_Y, g);
    int dx = t->backward && t->dx && mgpu__conv_channels_last_fits(MGPU__TRY_DX, g);
    int dw = t->backward && mgpu__conv_channels_last_fits(MGPU__TRY_DW, g);
    double unused;
    memset(ms, 0, sizeof *ms);
    t->x_t = t->dy_t = t->w_t = t->w_turned_t = NULL;
    if (y || dw) {
        mgpu__channels_last_args x = {{NULL, g->n, g->c, g->h * g->w, 0}, t->x->data};
        t->x_t = mgpu__conv_timed_copy(dev, x, t->prepared & MGPU__PREPARED_X ? &unused : &ms->x);
    }
    if (dx || dw) {
        mgpu__channels_last_args dy = {{NULL, g->n, g->k, g->p * g->q, 0}, t->dy->data};
        t->dy_t = mgpu__conv_timed_copy(dev, dy, &ms->dy);
        ms->dy_prepared = (t->prepared & MGPU__PREPARED_DY) != 0;
    }
    double *w_ms = t->prepared & MGPU__PREPARED_W ? &unused : &ms->w;
    double *w_turned_ms = t->prepared & MGPU__PREPARED_W ? &unused : &ms->w_turned;
    int rs = g->r * g->s;
    if (y) t->w_t = mgpu__conv_timed_copy(dev, mgpu__weights_copy(NULL, t->w->data, g->k, g->c, rs, 0), w_ms);
    if (dx && mgpu__conv_dx_reads_turned_weights(g)) /* (the sub-pixel classes take their own taps) */
        t->w_turned_t = mgpu__conv_timed_copy(dev, mgpu__weights_copy(NULL, t->w->data, g->k, g->c, rs, 1),
                                              w_turned_ms);
}

static mgpu__conv_plan mgpu__conv_plan_for(mgpu__conv_trial *t) {
    mgpu__conv_plan plan;
    memset(&plan, 0, sizeof plan);
    mgpu_device *dev = t->x->device;
    if (!mgpu__conv_implicit_allowed(dev)) return plan;
    int with_dx = t->dx != NULL;
    const mgpu__conv_plan *known = mgpu__conv_plan_known(t->g, t->backward, with_dx);
    if (known) return *known;
    mgpu_tensor *dx = NULL, *dw = NULL;
    if (t->backward) { /* scratch gradients */
        if (with_dx) t->dx = dx = mgpu_empty(dev, t->x->shape);
        t->dw = dw = mgpu_empty(dev, t->w->shape);
    }
    mgpu__conv_copies_ms copy;
    mgpu__conv_trial_copies(t, &copy);
    int automatic = mgpu__conv_mode == MGPU__CONV_AUTO;
    plan.implicit = 1;
    if (!t->backward) {
        mgpu__implicit_kernel channels_last = plan.y;
        double y_ms = mgpu__conv_fastest_kernel(t, MGPU__TRY_Y, 0, 0.0, &plan.y);
        double cl_ms = mgpu__conv_fastest_kernel(t, MGPU__TRY_Y, 1, copy.w, &channels_last) + copy.x;
        if (cl_ms < y_ms) y_ms = cl_ms, plan.y = channels_last;
        plan.implicit = automatic ? y_ms < mgpu__conv_im2col_ms(t, MGPU__TRY_IM2COL) : y_ms < HUGE_VAL;
    } else {
        /* each gradient's ways (the im2col half with MGPU_CONV=auto, or
           where no kernel fits) */
        double dx_ms[MGPU__WAYS] = {0.0, 0.0, 0.0}, dw_ms[MGPU__WAYS];
        mgpu__implicit_kernel dx_kernel[2] = {plan.dx, plan.dx}, dw_kernel[2] = {plan.dw, plan.dw};
        if (with_dx) {
            dx_ms[MGPU__BY_NCHW] = mgpu__conv_fastest_kernel(t, MGPU__TRY_DX, 0, 0.0, &dx_kernel[0]);
            dx_ms[MGPU__BY_CHANNELS_LAST] =
                mgpu__conv_fastest_kernel(t, MGPU__TRY_DX, 1, copy.w_turned, &dx_kernel[1]);
            dx_ms[MGPU__BY_IM2COL_HALF] = automatic || fmin(dx_ms[MGPU__BY_NCHW], dx_ms[MGPU__BY_CHANNELS_LAST]) == HUGE_VAL
                                              ? mgpu__conv_im2col_ms(t, MGPU__TRY_IM2COL_DX)
                                              : HUGE_VAL;
        }
        dw_ms[MGPU__BY_NCHW] = mgpu__conv_fastest_kernel(t, MGPU__TRY_DW, 0, 0.0, &dw_kernel[0]);
        dw_ms[MGPU__BY_CHANNELS_LAST] = mgpu__conv_fastest_kernel(t, MGPU__TRY_DW, 1, 0.0, &dw_kernel[1]) + copy.x;
        dw_ms[MGPU__BY_IM2COL_HALF] = automatic || fmin(dw_ms[MGPU__BY_NCHW], dw_ms[MGPU__BY_CHANNELS_LAST]) == HUGE_VAL
                                          ? mgpu__conv_im2col_ms(t, MGPU__TRY_IM2COL_DW)
                                          : HUGE_VAL;
        int by_dx, by_dw;
        double best =
            mgpu__conv_backward_ways(dx_ms, dw_ms, copy.dy, copy.dy_prepared, with_dx, &by_dx, &by_dw);
        plan.dx = dx_kernel[by_dx == MGPU__BY_CHANNELS_LAST];
        plan.dx_im2col = by_dx == MGPU__BY_IM2COL_HALF;
        plan.dw = dw_kernel[by_dw == MGPU__BY_CHANNELS_LAST];
        plan.dw_im2col = by_dw == MGPU__BY_IM2COL_HALF;
        /* (without dx, the dW half is the whole path) */
        if (automatic) plan.implicit = !with_dx || best < mgpu__conv_im2col_ms(t, MGPU__TRY_IM2COL);
        else plan.implicit = !(plan.dw_im2col && (!with_dx || plan.dx_im2col)); /* (both halves: the whole path) */
    }
    mgpu_free(dx);
    mgpu_free(dw);
    mgpu_free(t->x_t);
    mgpu_free(t->dy_t);
    mgpu_free(t->w_t);
    mgpu_free(t->w_turned_t);
    if (mgpu__conv_choice_count < (int)(sizeof mgpu__conv_choices / sizeof mgpu__conv_choices[0])) {
        mgpu__conv_choice c = {*t->g, t->backward, with_dx, plan};
        mgpu__conv_choices[mgpu__conv_choice_count++] = c;
    }
    return plan;
}
#endif

/* ------------------------------------------ a CPU's: im2col or oneDNN */
#if MGPU_ONEDNN
/* A CPU device computes a convolution's pass with conv.h's im2col and
   OpenBLAS's products, or with oneDNN's kernels (kernels/conv_onednn.h),
   whichever was faster for the pass and shape. As on a GPU, the first
   call of a pass with a shape on a device times both ways, once each,
   each call alone (the device synchronised before and after it), and
   every later call runs by the faster. Where the call writes its outputs
   (not adding to them), im2col writes them in the trial and oneDNN
   writes scratch copies, which replace them if oneDNN was faster: the
   first call costs the two ways, not three. Where it adds to them, both
   ways write scratch outputs (measuring never adds to a real gradient),
   and the faster then runs for real. Either way every call of a pass with
   a shape computes what the faster way computes, and two identical
   networks compute identical values. MGPU_CONV=im2col keeps im2col;
   implicit takes oneDNN wherever it has a kernel. */
typedef enum { MGPU__CPU_BY_IM2COL, MGPU__CPU_BY_ONEDNN, MGPU__CPU_WAYS } mgpu__cpu_conv_way;
static const char *const mgpu__cpu_conv_way_names[MGPU__CPU_WAYS] = {"im2col", "oneDNN"};
typedef struct {
    const mgpu_device *device; /* (each device its own: each has its share of the cores) */
    mgpu__conv_geom g;
    int backward; /* (with dx or without: dW must not depend on whether dx is asked for) */
    int with_dx;  /* in the trial */
    double trial_ms[MGPU__CPU_WAYS]; /* the trial's times (HUGE_VAL: oneDNN has no kernel) */
    mgpu__cpu_conv_way way;
} mgpu__cpu_conv_choice;
static mgpu__cpu_conv_choice mgpu__cpu_conv_choices[256];
static int mgpu__cpu_conv_choice_count;

/* One call of a pass: the forward (y), or the backward (dx, which may be
   NULL, and dw), with what they add to. */
typedef struct {
    mgpu_tensor *y, *dx, *dw;
    const mgpu_tensor *x, *w, *b, *dy;
    const mgpu__conv_geom *g;
    int backward, accumulate, add_to_dx, tf32;
} mgpu__cpu_conv_call;

/* Enqueues one oneDNN pass on dev, with its chosen-layout copies from the
   allocator; 0 (nothing enqueued) where oneDNN has no kernel for it. */
static int mgpu__onednn_enqueue(mgpu_device *dev, const char *name, const mgpu__conv_geom *g,
                                mgpu__onednn_pass pass, const float *in_a, const float *in_b, float *out,
                                const float *bias, int accumulate) {
    mgpu__onednn_plan *plan = mgpu__onednn_plan_for(g, pass, bias != NULL, accumulate, mgpu__cpu_threads);
    if (!plan) return 0;
    mgpu__onednn_args a = {plan, {(float *)in_a, (float *)in_b, out}, {NULL, NULL, NULL}, NULL, bias};
    mgpu_tensor *scratch[MGPU__ONEDNN_TENSORS + 1] = {NULL, NULL, NULL, NULL}; /* the copies, the scratchpad */
    for (int t = 0; t <= MGPU__ONEDNN_TENSORS; t++) {
        size_t bytes = t < MGPU__ONEDNN_TENSORS ? plan->bytes[t] : plan->scratch_bytes;
        if (!bytes) continue;
        scratch[t] = mgpu_empty(dev, mgpu_shape1((int)((bytes + sizeof(float) - 1) / sizeof(float))));
        if (t < MGPU__ONEDNN_TENSORS) a.copy[t] = scratch[t]->data;
        else a.scratch = scratch[t]->data;
    }
    mgpu__launch_on(&dev->queue[0], name, mgpu__onednn_conv_cpu, NULL, &a, sizeof a);
    for (int t = 0; t <= MGPU__ONEDNN_TENSORS; t++) mgpu_free(scratch[t]); /* (reused only by later work) */
    return 1;
}

/* Whether oneDNN has a kernel for every pass of the call; makes their
   plans (oneDNN compiles its kernels then: milliseconds). */
static int mgpu__cpu_conv_onednn_plans(const mgpu__cpu_conv_call *c) {
    const mgpu__conv_geom *g = c->g;
    int threads = mgpu__cpu_threads;
    if (!c->backward) return mgpu__onednn_plan_for(g, MGPU__ONEDNN_Y, c->b != NULL, 0, threads) != NULL;
    return (!c->dx || mgpu__onednn_plan_for(g, MGPU__ONEDNN_DX, 0, c->add_to_dx, threads)) &&
           mgpu__onednn_plan_for(g, MGPU__ONEDNN_DW, 0, c->accumulate, threads);
}
/* The call by oneDNN; 0 (nothing enqueued) where it has no kernel for a
   pass of it. */
static int mgpu__cpu_conv_by_onednn(const mgpu__cpu_conv_call *c) {
    mgpu_device *dev = c->x->device;
    const mgpu__conv_geom *g = c->g;
    if (!mgpu__cpu_conv_onednn_plans(c)) return 0;
    if (!c->backward)
        return mgpu__onednn_enqueue(dev, "conv2d oneDNN forward", g, MGPU__ONEDNN_Y, c->x->data, c->w->data,
                                    c->y->data, c->b ? c->b->data : NULL, 0);
    if (c->dx)
        mgpu__onednn_enqueue(dev, "conv2d_backward oneDNN dx", g, MGPU__ONEDNN_DX, c->w->data, c->dy->data,
                             c->dx->data, NULL, c->add_to_dx);
    mgpu__onednn_enqueue(dev, "conv2d_backward oneDNN dW", g, MGPU__ONEDNN_DW, c->x->data, c->dy->data,
                         c->dw->data, NULL, c->accumulate);
    return 1;
}
static void mgpu__cpu_conv_by_im2col(const mgpu__cpu_conv_call *c) {
    if (c->backward)
        mgpu__conv_backward_im2col(c->dx, c->dw, c->dy, c->x, c->w, c->g, c->tf32, c->accumulate, c->add_to_dx);
    else
        mgpu__conv_forward_im2col(c->y, c->x, c->w, c->b, c->g, c->tf32);
}

/* The choice made for a pass and shape on dev, or NULL if none was yet. */
static mgpu__cpu_conv_choice *mgpu__cpu_conv_choice_find(const mgpu_device *dev, const mgpu__conv_geom *g,
                                                         int backward) {
    for (int i = 0; i < mgpu__cpu_conv_choice_count; i++) {
        mgpu__cpu_conv_choice *c = &mgpu__cpu_conv_choices[i];
        if (c->device == dev && !memcmp(&c->g, g, sizeof *g) && c->backward == backward) return c;
    }
    return NULL;
}
static mgpu__cpu_conv_choice *mgpu__cpu_conv_choice_new(const mgpu_device *dev, const mgpu__conv_geom *g,
                                                        int backward, int with_dx) {
    MGPU_REQUIRE(mgpu__cpu_conv_choice_count < (int)(sizeof mgpu__cpu_conv_choices / sizeof mgpu__cpu_conv_choices[0]),
                 "conv2d: more than %d convolution shapes", mgpu__cpu_conv_choice_count);
    mgpu__cpu_conv_choice *c = &mgpu__cpu_conv_choices[mgpu__cpu_conv_choice_count++];
    memset(c, 0, sizeof *c);
    c->device = dev;
    c->g = *g;
    c->backward = backward;
    c->with_dx = with_dx;
    c->trial_ms[MGPU__CPU_BY_IM2COL] = c->trial_ms[MGPU__CPU_BY_ONEDNN] = HUGE_VAL;
    return c;
}

/* The trial of a pass (above): each way once, with oneDNN's plans made
   before the clock starts. Returns whether it has done the call (where
   the call writes its outputs). */
static int mgpu__cpu_conv_trial(mgpu__cpu_conv_choice *c, const mgpu__cpu_conv_call *call) {
    mgpu_device *dev = call->x->device;
    int writes = !call->accumulate && !call->add_to_dx; /* (the forward pass always) */
    mgpu__cpu_conv_call t = *call; /* the same, into scratch outputs */
    t.accumulate = t.add_to_dx = 0;
    if (!t.backward) t.y = mgpu_empty(dev, call->y->shape);
    else {
        t.dx = call->dx ? mgpu_empty(dev, call->x->shape) : NULL;
        t.dw = mgpu_empty(dev, call->w->shape);
    }
    int onednn = mgpu__cpu_conv_onednn_plans(&t); /* (no kernel: its time stays HUGE_VAL) */
    for (int way = 0; way < (onednn ? MGPU__CPU_WAYS : 1); way++) {
        mgpu_synchronize(dev);
        double t0 = mgpu_now();
        if (way == MGPU__CPU_BY_IM2COL) mgpu__cpu_conv_by_im2col(writes ? call : &t);
        else mgpu__cpu_conv_by_onednn(&t);
        mgpu_synchronize(dev);
        c->trial_ms[way] = (mgpu_now() - t0) * 1e3;
    }
    c->way = c->trial_ms[MGPU__CPU_BY_ONEDNN] < c->trial_ms[MGPU__CPU_BY_IM2COL] ? MGPU__CPU_BY_ONEDNN
                                                                              : MGPU__CPU_BY_IM2COL;
    mgpu_tensor *outs[3][2] = {{call->y, t.y}, {call->dx, t.dx}, {call->dw, t.dw}}; /* (real, scratch) */
    for (int i = 0; i < 3; i++) {
        if (outs[i][1] && writes && c->way == MGPU__CPU_BY_ONEDNN) {
            mgpu__memcpy_args copy = {outs[i][0]->data, outs[i][1]->data, outs[i][0]->numel * sizeof(float), -1, -1};
            MGPU__ENQUEUE(dev, "conv2d trial's copy", mgpu__memcpy, copy);
        }
        if (outs[i][1] != outs[i][0]) mgpu_free(outs[i][1]); /* (reused only by later work) */
    }
    return writes;
}

/* A pass on a CPU device, by the way its choice says (above). */
static void mgpu__conv_cpu(const mgpu__cpu_conv_call *call) {
    mgpu__conv_settings_from_environment();
    int onednn = mgpu__conv_mode == MGPU__CONV_IMPLICIT;
    if (mgpu__conv_mode == MGPU__CONV_AUTO) {
        mgpu_device *dev = call->x->device;
        mgpu__cpu_conv_choice *c = mgpu__cpu_conv_choice_find(dev, call->g, call->backward);
        if (!c) {
            c = mgpu__cpu_conv_choice_new(dev, call->g, call->backward, call->dx != NULL);
            if (mgpu__cpu_conv_trial(c, call)) return;
        }
        onednn = c->way == MGPU__CPU_BY_ONEDNN;
    }
    if (!onednn || !mgpu__cpu_conv_by_onednn(call)) mgpu__cpu_conv_by_im2col(call);
}

/* A choice in words, for the benchmarks and tests. */
static inline const char *mgpu__cpu_conv_choice_str(const mgpu__cpu_conv_choice *c, char *out, size_t size) {
    const mgpu__conv_geom *g = &c->g;
    snprintf(out, size, "%s: %dx%d, %d -> %d, stride %d, %d x %dx%d: %s by %s (trial: im2col %.2f ms, oneDNN %.2f ms)",
             c->device->name, g->r, g->s, g->c, g->k, g->stride, g->n, g->h, g->w,
             !c->backward ? "forward" : c->with_dx ? "backward" : "backward (dW)",
             mgpu__cpu_conv_way_names[c->way],
             c->trial_ms[MGPU__CPU_BY_IM2COL], c->trial_ms[MGPU__CPU_BY_ONEDNN]);
    return out;
}
#endif

/* mgpu_conv2d_forward; x_t: x's channels-last copy, if the caller has
   one (else NULL); with keep_x_t, a channels-last forward that made its
   own copy of x leaves it there for the backward pass (*keep_x_t is freed
   first, and stays NULL when the forward took another path); keep_w_t:
   where the caller keeps the weights' channels-last copy, or NULL (as
   mgpu__conv_channels_last says); prepared: what the caller prepares for
   it, if measuring the plan (MGPU__PREPARED_*). */
static void mgpu__conv2d_forward(mgpu_tensor *y, const mgpu_tensor *x, const mgpu_tensor *x_t,
                                 const mgpu_tensor *w, mgpu_tensor **keep_w_t, const mgpu_tensor *b, int stride,
                                 int pad, mgpu_tensor **keep_x_t, int prepared) {
    const char *op = "mgpu_conv2d_forward";
    if (keep_x_t) {
        mgpu_free(*keep_x_t); /* before the new copy, which may then take its memory */
        *keep_x_t = NULL;
    }
    mgpu__conv_geom g = mgpu__conv_geometry(op, x->shape, w->shape, stride, pad);
    mgpu_device *dev = x->device;
    mgpu__require_device(w, dev, op);
    mgpu__require_device(y, dev, op);
    mgpu__require_shape(y, mgpu_shape4(g.n, g.k, g.p, g.q), op, "output y");
    mgpu__require_indexable(x, op);
    mgpu__require_indexable(y, op);
    if (b) {
        mgpu__require_device(b, dev, op);
        mgpu__require_shape(b, mgpu_shape1(g.k), op, "bias b");
    }
    if (x_t) mgpu__require_channels_last_of(x_t, x, op, "channels-last x_t");
    mgpu__before_write(y);
    int tf32 = mgpu__tf32_allowed(MGPU__TF32_CONV);
#if MGPU_CUDA
    mgpu__conv_trial t = {y, NULL, NULL, x, w, b, NULL, &g, 0, prepared, NULL, NULL, NULL, NULL};
    mgpu__conv_plan plan = mgpu__conv_plan_for(&t);
    if (plan.implicit) {
        mgpu__conv_forward_implicit(y, x, x_t, w, keep_w_t, b, &g, plan.y, keep_x_t);
        return;
    }
#endif
    (void)keep_w_t;
    (void)prepared;
#if MGPU_ONEDNN
    if (!mgpu_device_is_gpu(dev)) {
        mgpu__cpu_conv_call call = {y, NULL, NULL, x, w, b, NULL, &g, 0, 0, 0, tf32};
        mgpu__conv_cpu(&call);
        return;
    }
#endif
    mgpu__conv_forward_im2col(y, x, w, b, &g, tf32);
}
MGPU_DEF void mgpu_conv2d_forward(mgpu_tensor *y, const mgpu_tensor *x, const mgpu_tensor *w,
                                  const mgpu_tensor *b, int stride, int pad) {
    mgpu__conv2d_forward(y, x, NULL, w, NULL, b, stride, pad, NULL, 0);
}

/* mgpu_conv2d_backward; x_t: x's channels-last copy, or NULL; dy_t:
   dy's, or NULL: given only where the plan reads dy through it alone
   (mgpu__conv_plan_reads_dy_t_only), and then dy's values are not read
   (a network's batch norm wrote dy_t instead of dy); keep_w_t: as in the
   forward pass, for the turned weights of dx's kernel; add_to_dx: dx +=
   the input gradient (else dx = it; `accumulate` is the same for dw and
   db); prepared: as in the forward pass. */
static void mgpu__conv2d_backward(mgpu_tensor *dx, mgpu_tensor *dw, mgpu_tensor *db,
                                  const mgpu_tensor *dy, const mgpu_tensor *dy_t, const mgpu_tensor *x,
                                  const mgpu_tensor *x_t, const mgpu_tensor *w, mgpu_tensor **keep_w_t,
                                  int stride, int pad, int accumulate, int add_to_dx, int prepared) {
    const char *op = "mgpu_conv2d_backward";
    mgpu__conv_geom g = mgpu__conv_geometry(op, x->shape, w->shape, stride, pad);
    mgpu_device *dev = x->device;
    mgpu__require_device(w, dev, op);
    mgpu__require_device(dy, dev, op);
    mgpu__require_device(dw, dev, op);
    mgpu__require_shape(dy, mgpu_shape4(g.n, g.k, g.p, g.q), op, "output gradient dy");
    mgpu__require_shape(dw, w->shape, op, "weight gradient dw");
    mgpu__require_indexable(x, op);
    mgpu__require_indexable(dy, op);
    if (dx) {
        mgpu__require_device(dx, dev, op);
        mgpu__require_shape(dx, x->shape, op, "input gradient dx");
    }
    if (db) {
        mgpu__require_device(db, dev, op);
        mgpu__require_shape(db, mgpu_shape1(g.k), op, "bias gradient db");
    }
    if (dx) mgpu__before_write(dx);
    if (db) mgpu__before_write(db);
    mgpu__before_write(dw);
    int tf32 = mgpu__tf32_allowed(MGPU__TF32_CONV), done = 0; /* done: by a way other than im2col here */
#if MGPU_CUDA
    mgpu__conv_trial t = {NULL, dx, NULL, x, w, NULL, dy, &g, 1, db ? prepared & ~MGPU__PREPARED_DY : prepared,
                          NULL, NULL, NULL, NULL};
    mgpu__conv_plan plan = mgpu__conv_plan_for(&t);
    MGPU_REQUIRE(!dy_t || mgpu__conv_plan_reads_dy_t_only(&plan, dx != NULL, db != NULL),
                 "%s: given dy's channels-last copy alone, but this pass reads dy itself", op);
    if (dy_t) mgpu__require_channels_last_of(dy_t, dy, op, "channels-last dy_t");
    done = plan.implicit;
    if (plan.implicit) {
        /* one channels-last copy of dy for both gradients, when both take one */
        int dx_cl = dx && !plan.dx_im2col && mgpu__conv_reads_copies(plan.dx);
        int dw_cl = !plan.dw_im2col && mgpu__conv_reads_copies(plan.dw);
        mgpu_tensor *own_dy_t = NULL;
        if (!dy_t && dx_cl && dw_cl)
            dy_t = own_dy_t = mgpu__channels_last_copy(dev, dy->data, g.n, g.k, g.p * g.q, 0);
        if (dx && plan.dx_im2col) mgpu__conv_backward_im2col(dx, NULL, dy, x, w, &g, tf32, 0, add_to_dx);
        else if (dx) mgpu__conv_dx_implicit(dx, dy, dy_t, w, keep_w_t, &g, plan.dx, add_to_dx);
        if (plan.dw_im2col) mgpu__conv_backward_im2col(NULL, dw, dy, x, w, &g, tf32, accumulate, 0);
        else mgpu__conv_dw_implicit(dw, dy, dy_t, x, x_t, &g, accumulate, plan.dw);
        mgpu_free(own_dy_t);
    }
#else
    MGPU_REQUIRE(!dy_t, "%s: given dy's channels-last copy alone, but this pass reads dy itself", op);
#endif
#if MGPU_ONEDNN
    if (!mgpu_device_is_gpu(dev)) {
        mgpu__cpu_conv_call call = {NULL, dx, dw, x, w, NULL, dy, &g, 1, accumulate, add_to_dx, tf32};
        mgpu__conv_cpu(&call);
        done = 1;
    }
#endif
    if (!done) mgpu__conv_backward_im2col(dx, dw, dy, x, w, &g, tf32, accumulate, add_to_dx);
    if (db) {
        mgpu__enqueue_chan_sum(dev, "conv2d_backward bias", db->data, dy->data, g.n, g.k,
                               (size_t)g.p * g.q, 1.0f, accumulate ? 1.0f : 0.0f);
    }
#if !MGPU_CUDA
    (void)x_t;
    (void)keep_w_t;
    (void)prepared;
#endif
}
MGPU_DEF void mgpu_conv2d_backward(mgpu_tensor *dx, mgpu_tensor *dw, mgpu_tensor *db,
                                   const mgpu_tensor *dy, const mgpu_tensor *x,
                                   const mgpu_tensor *w, int stride, int pad, int accumulate) {
    mgpu__conv2d_backward(dx, dw, db, dy, NULL, x, NULL, w, NULL, stride, pad, accumulate, 0, 0);
}

/* --------------------------------------------------------------- pooling */
static mgpu_shape mgpu__avg_pool_shape(const char *op, mgpu_shape x, int k) {
    char sx[64];
    MGPU_REQUIRE(x.ndim == 4 && k >= 1 && x.d[2] >= k && x.d[3] >= k,
                 "%s: cannot pool input %s with %dx%d windows (want [N, C, H, W] with "
                 "H, W >= k >= 1)", op, mgpu_shape_str(x, sx, sizeof sx), k, k);
    return mgpu_shape4(x.d[0], x.d[1], x.d[2] / k, x.d[3] / k);
}
MGPU_DEF mgpu_shape mgpu_avg_pool2d_output_shape(mgpu_shape x, int k) {
    return mgpu__avg_pool_shape("mgpu_avg_pool2d_output_shape", x, k);
}

MGPU_DEF void mgpu_avg_pool2d_forward(mgpu_tensor *y, const mgpu_tensor *x, int k) {
    const char *op = "mgpu_avg_pool2d_forward";
    mgpu__require_device(y, x->device, op);
    mgpu__require_shape(y, mgpu__avg_pool_shape(op, x->shape, k), op, "output y");
    mgpu__require_indexable(x, op);
    mgpu__avg_pool_args a = {y->data, x->data, y->numel, x->shape.d[2], x->shape.d[3], k};
    mgpu__before_write(y);
    MGPU__ENQUEUE(x->device, "avg_pool2d", mgpu__avg_pool, a);
}

MGPU_DEF void mgpu_avg_pool2d_backward(mgpu_tensor *dx, const mgpu_tensor *dy, int k) {
    const char *op = "mgpu_avg_pool2d_backward";
    mgpu__require_device(dy, dx->device, op);
    mgpu__require_shape(dy, mgpu__avg_pool_shape(op, dx->shape, k), op, "output gradient dy");
    mgpu__require_indexable(dx, op);
    mgpu__avg_pool_backward_args a = {dx->data, dy->data, dx->numel, dx->shape.d[2],
                                      dx->shape.d[3], k};
    mgpu__before_write(dx);
    MGPU__ENQUEUE(dx->device, "avg_pool2d_backward", mgpu__avg_pool_backward, a);
}

/* images [N, C, H, W] and means [N, C] on one device. The kernels see
   the images as [1, N*C, H*W]: one channel per plane. */
static void mgpu__global_pool_check(const char *op, const mgpu_tensor *images,
                                    const mgpu_tensor *means, const char *means_name) {
    char s[64];
    mgpu__require_device(means, images->device, op);
    MGPU_REQUIRE(images->shape.ndim == 4, "%s: images %s must be [N, C, H, W]", op,
                 mgpu_shape_str(images->shape, s, sizeof s));
    mgpu__require_shape(means, mgpu_shape2(images->shape.d[0], images->shape.d[1]), op,
                        means_name);
    mgpu__require_indexable(images, op);
}

MGPU_DEF void mgpu_global_avg_pool_forward(mgpu_tensor *y, const mgpu_tensor *x) {
    mgpu__global_pool_check("mgpu_global_avg_pool_forward", x, y, "output y");
    size_t hw = (size_t)x->shape.d[2] * x->shape.d[3];
    float mean = 1.0f / (float)hw;
    mgpu__before_write(y);
    mgpu__enqueue_chan_sum(x->device, "global_avg_pool", y->data, x->data, 1, (int)y->numel, hw,
                           mean, 0.0f);
}

MGPU_DEF void mgpu_global_avg_pool_backward(mgpu_tensor *dx, const mgpu_tensor *dy) {
    mgpu__global_pool_check("mgpu_global_avg_pool_backward", dx, dy, "output gradient dy");
    size_t hw = (size_t)dx->shape.d[2] * dx->shape.d[3];
    float share = 1.0f / (float)hw; /* each pixel's part in its plane's mean */
    mgpu__chan_broadcast_args a = {dx->data, dy->data, 1, (int)dy->numel, hw, share, 0.0f};
    mgpu__before_write(dx);
    MGPU__ENQUEUE(dx->device, "global_avg_pool_backward", mgpu__chan_broadcast, a);
}

/* ----------------------------------------------------- ReLU and residuals */
MGPU_DEF void mgpu_relu_forward(mgpu_tensor *y, const mgpu_tensor *x) {
    mgpu__require_device(x, y->device, "mgpu_relu_forward");
    mgpu__require_same_shape(y, x, "mgpu_relu_forward");
    mgpu__relu_args a = {y->data, x->data, y->numel};
    mgpu__before_write(y);
    MGPU__ENQUEUE(y->device, "relu", mgpu__relu, a);
}

MGPU_DEF void mgpu_relu_backward(mgpu_tensor *dx, const mgpu_tensor *dy,
                                 const mgpu_tensor *y_or_x) {
    const char *op = "mgpu_relu_backward";
    mgpu__require_device(dy, dx->device, op);
    mgpu__require_device(y_or_x, dx->device, op);
    mgpu__require_same_shape(dx, dy, op);
    mgpu__require_same_shape(dx, y_or_x, op);
    mgpu__relu_backward_args a = {dx->data, dy->data, y_or_x->data, dx->numel};
    mgpu__before_write(dx);
    MGPU__ENQUEUE(dx->device, "relu_backward", mgpu__relu_backward, a);
}

static void mgpu__residual_launch(const char *op, mgpu_tensor *y, const mgpu_tensor *a,
                                  const mgpu_tensor *b, int relu) {
    mgpu__require_device(a, y->device, op);
    mgpu__require_device(b, y->device, op);
    mgpu__require_same_shape(a, b, op);
    mgpu__require_same_shape(y, a, op);
    mgpu__add_args args = {y->data, a->data, b->data, y->numel, relu};
    mgpu__before_write(y);
    MGPU__ENQUEUE(y->device, relu ? "add_relu" : "add", mgpu__add, args);
}
MGPU_DEF void mgpu_add(mgpu_tensor *y, const mgpu_tensor *a, const mgpu_tensor *b) {
    mgpu__residual_launch("mgpu_add", y, a, b, 0);
}
MGPU_DEF void mgpu_add_relu(mgpu_tensor *y, const mgpu_tensor *a, const mgpu_tensor *b) {
    mgpu__residual_launch("mgpu_add_relu", y, a, b, 1);
}

/* ---------------------------------------------------------------- linear */

/* Checks x [N, in...] against w [in, out]; returns N. */
static int mgpu__linear_check(const char *op, const mgpu_tensor *x, const mgpu_tensor *w) {
    char sx[64], sw[64];
    mgpu_shape_str(x->shape, sx, sizeof sx);
    mgpu_shape_str(w->shape, sw, sizeof sw);
    mgpu__require_device(w, x->device, op);
    MGPU_REQUIRE(w->shape.ndim == 2, "%s: weight %s must be a matrix [in, out]", op, sw);
    MGPU_REQUIRE(x->shape.ndim >= 2, "%s: input %s must be [N, in] (or [N, C, H, W])", op, sx);
    size_t features = x->numel / (size_t)(x->shape.d[0] ? x->shape.d[0] : 1);
    MGPU_REQUIRE(features == (size_t)w->shape.d[0],
                 "%s: input %s has %zu features but weight %s expects %d", op, sx, features, sw,
                 w->shape.d[0]);
    return x->shape.d[0];
}

MGPU_DEF void mgpu_linear_forward(mgpu_tensor *y, const mgpu_tensor *x, const mgpu_tensor *w,
                                  const mgpu_tensor *b) {
    const char *op = "mgpu_linear_forward";
    int n = mgpu__linear_check(op, x, w), in = w->shape.d[0], out = w->shape.d[1];
    mgpu__require_device(y, x->device, op);
    mgpu__require_shape(y, mgpu_shape2(n, out), op, "output y");
    mgpu__require_indexable(y, op);
    if (b) {
        mgpu__require_device(b, x->device, op);
        mgpu__require_shape(b, mgpu_shape1(out), op, "bias b");
    }
    mgpu__before_write(y);
    int tf32 = mgpu__tf32_allowed(MGPU__TF32_MATMUL);
    mgpu__gemm_args prod = mgpu__gemm_dense(0, 0, n, out, in, x->data, w->data, y->data, 0.0f,
                                            tf32);
    MGPU__ENQUEUE(x->device, "linear", mgpu__gemm, prod);
    if (b) {
        mgpu__chan_broadcast_args bias = {y->data, b->data, n, out, 1, 1.0f, 1.0f};
        MGPU__ENQUEUE(x->device, "linear", mgpu__chan_broadcast, bias);
    }
}

MGPU_DEF void mgpu_linear_backward(mgpu_tensor *dx, mgpu_tensor *dw, mgpu_tensor *db,
                                   const mgpu_tensor *dy, const mgpu_tensor *x,
                                   const mgpu_tensor *w, int accumulate) {
    const char *op = "mgpu_linear_backward";
    int n = mgpu__linear_check(op, x, w), in = w->shape.d[0], out = w->shape.d[1];
    mgpu_device *dev = x->device;
    float beta = accumulate ? 1.0f : 0.0f;
    int tf32 = mgpu__tf32_allowed(MGPU__TF32_MATMUL);
    mgpu__require_device(dy, dev, op);
    mgpu__require_device(dw, dev, op);
    mgpu__require_shape(dy, mgpu_shape2(n, out), op, "output gradient dy");
    mgpu__require_indexable(dy, op);
    mgpu__require_shape(dw, w->shape, op, "weight gradient dw");
    if (dx) {
        mgpu__require_device(dx, dev, op);
        mgpu__require_shape(dx, x->shape, op, "input gradient dx");
    }
    if (db) {
        mgpu__require_device(db, dev, op);
        mgpu__require_shape(db, mgpu_shape1(out), op, "bias gradient db");
    }
    if (dx) { /* dx [N, in] = dy [N, out] w^T */
        mgpu__gemm_args dxp = mgpu__gemm_dense(0, 1, n, in, out, dy->data, w->data, dx->data,
                                               0.0f, tf32);
        mgpu__before_write(dx);
        MGPU__ENQUEUE(dev, "linear_backward", mgpu__gemm, dxp);
    }
    /* dw [in, out] (+)= x^T [in, N] dy [N, out] */
    mgpu__gemm_args dwp = mgpu__gemm_dense(1, 0, in, out, n, x->data, dy->data, dw->data, beta,
                                           tf32);
    mgpu__before_write(dw);
    MGPU__ENQUEUE(dev, "linear_backward", mgpu__gemm, dwp);
    if (db) {
        mgpu__before_write(db);
        mgpu__enqueue_chan_sum(dev, "linear_backward", db->data, dy->data, n, out, 1, 1.0f, beta);
    }
}
/* ======================================================================
   Batch norm, losses, optimisers: checks, then one kernel launch each
   (the kernels are in kernels/batchnorm.h, loss.h and sgd.h).
   ====================================================================== */
#ifdef __cplusplus
extern "C" {
#endif

/* A tensor that must be there, on dev. */
static void mgpu__require_tensor(const mgpu_tensor *t, const mgpu_device *dev, const char *op,
                                 const char *what) {
    MGPU_REQUIRE(t != NULL, "%s: %s is NULL", op, what);
    mgpu__require_device(t, dev, op);
}
/* gamma, beta, the running and saved statistics: one value per channel. */
static void mgpu__require_per_channel(const mgpu_tensor *t, int channels, const mgpu_device *dev,
                                      const char *op, const char *what) {
    char s[64];
    mgpu__require_tensor(t, dev, op, what);
    MGPU_REQUIRE(t->numel == (size_t)channels, "%s: %s has shape %s; it needs one value per channel (%d)",
                 op, what, mgpu_shape_str(t->shape, s, sizeof s), channels);
}

/* x is [N, C, spatial...]: the sizes batch norm works with. */
static void mgpu__bn_dims(const mgpu_tensor *x, const char *op, int *n, int *c, int *hw) {
    char s[64];
    MGPU_REQUIRE(x->shape.ndim >= 2, "%s: x has shape %s; it must be [N, C, H, W] or [N, C]", op,
                 mgpu_shape_str(x->shape, s, sizeof s));
    *n = x->shape.d[0];
    *c = x->shape.d[1];
    MGPU_REQUIRE(*c >= 1, "%s: x has shape %s, with no channels", op, mgpu_shape_str(x->shape, s, sizeof s));
    *hw = 1;
    for (int k = 2; k < x->shape.ndim; k++) *hw *= x->shape.d[k];
    MGPU_REQUIRE(!mgpu_device_is_gpu(x->device) || x->numel < ((size_t)1 << 31),
                 "%s: x has shape %s, 2^31 values or more: the GPU's batch norm indexes them "
                 "with 32 bits (split the batch)", op, mgpu_shape_str(x->shape, s, sizeof s));
}

/* The CUDA reduction's scratch (see kernels/batchnorm.h); none on the CPU. */
static mgpu_tensor *mgpu__bn_scratch(mgpu_device *dev, size_t floats) {
    return mgpu_device_is_gpu(dev) ? mgpu_empty(dev, mgpu_shape1((int)floats)) : NULL;
}
/* The counters with which the last block of a channel's reduction knows
   it is the last (kernels/batchnorm.h, "Finishing a channel"), at least
   one a channel: kept by the device for all its batch norms, all 0
   between kernels, as each channel's last block sets its counter back.
   Made (zeroed, in multiples of 512) when a batch norm has more channels
   than any before it on the device; NULL on the CPU. Every batch norm
   runs on the device's compute queue, so no two kernels count at once. */
static unsigned *mgpu__bn_done(mgpu_device *dev, int channels) {
    if (!mgpu_device_is_gpu(dev)) return NULL;
    if (!dev->bn_done || dev->bn_done->numel < (size_t)channels) {
        mgpu_free(dev->bn_done); /* (its last kernels are queued before any that reuses it) */
        dev->bn_done = mgpu_zeros(dev, mgpu_shape1((channels + 511) / 512 * 512));
    }
    return (unsigned *)dev->bn_done->data;
}

/* The backward pass's name in a trace: whether it writes dx, or the
   channels-last copy the convolution before reads instead. */
static const char *mgpu__bn_backward_name(const mgpu__bn_backward_args *a) {
    return a->dx_t ? "batchnorm backward, channels-last dx" : "batchnorm backward";
}

/* A batch norm pass (or, with a phase, a part of one) on the compute queue. */
static void mgpu__bn_forward_launch(mgpu_device *dev, const char *name, const mgpu__bn_forward_args *a) {
    mgpu__launch_on(&dev->queue[0], name, mgpu__bn_forward_cpu, MGPU__CUDA_FN(mgpu__bn_forward_cuda), a, sizeof *a);
}
static void mgpu__bn_backward_launch(mgpu_device *dev, const mgpu__bn_backward_args *a, const char *name) {
    mgpu__launch_on(&dev->queue[0], name ? name : mgpu__bn_backward_name(a), mgpu__bn_backward_cpu,
                    MGPU__CUDA_FN(mgpu__bn_backward_cuda), a, sizeof *a);
}

/* A synchronised batch norm's passes (kernels/batchnorm.h, "Synchronised
   batch norm"): the parts of a, each launched on the compute queue, with
   the group's collective between them (which orders itself after the
   compute queue, and it after the collective). */
static void mgpu__bn_forward_synced(mgpu__bn_forward_args *a, mgpu_group *g, mgpu_device *dev) {
    mgpu_tensor *mine = mgpu_empty(dev, mgpu_shape2(a->c, 3));
    mgpu_tensor *all = mgpu_empty(dev, mgpu_shape3(mgpu_group_size(g), a->c, 3));
    a->phase = MGPU__BN_MOMENTS;
    a->moments = mine->data;
    mgpu__bn_forward_launch(dev, "batchnorm moments", a);
    mgpu_group_all_gather(g, mine, all);
    a->phase = MGPU__BN_MERGE;
    a->moments = all->data;
    a->ranks = mgpu_group_size(g);
    mgpu__bn_forward_launch(dev, "batchnorm merge", a);
    a->phase = MGPU__BN_NORMALISE;
    mgpu__bn_forward_launch(dev, "batchnorm", a);
    mgpu_free(mine);
    mgpu_free(all);
}
/* The group's count of values a channel has comes with the sums: the
   allreduced tensor is [C][2] sums, then this rank's count. */
static void mgpu__bn_backward_synced(mgpu__bn_backward_args *a, mgpu_group *g, mgpu_device *dev) {
    mgpu_tensor *sums = mgpu_empty(dev, mgpu_shape1(2 * a->c + 1));
    mgpu_tensor *count = mgpu_narrow(sums, 2 * a->c, 1);
    mgpu_fill(count, (float)((size_t)a->n * (size_t)a->hw));
    mgpu_free(count);
    a->phase = MGPU__BN_GRAD_SUMS;
    a->sums = sums->data;
    mgpu__bn_backward_launch(dev, a, "batchnorm backward sums");
    mgpu_group_allreduce(g, sums, MGPU_SUM);
    a->phase = MGPU__BN_INPUT_GRAD;
    mgpu__bn_backward_launch(dev, a, NULL);
    mgpu_free(sums);
}

/* mgpu_batchnorm2d_forward, and with skip (not NULL) the residual block's
   y = max(bn(x) + skip, 0) in one pass (kernels/batchnorm.h); with y_t,
   y channels-last in TF32 there too, or there alone if y is NULL. */
static void mgpu__batchnorm2d_forward(const char *op, mgpu_tensor *y, mgpu_tensor *y_t, const mgpu_tensor *x,
                                      const mgpu_tensor *skip, const mgpu_tensor *gamma,
                                      const mgpu_tensor *beta, mgpu_tensor *running_mean,
                                      mgpu_tensor *running_var, mgpu_tensor *save_mean,
                                      mgpu_tensor *save_invstd, int training, float momentum,
                                      float eps, int fuse_relu, mgpu_group *sync) {
    char s[64];
    mgpu_device *dev = x->device;
    mgpu__bn_forward_args a;
    memset(&a, 0, sizeof a);
    mgpu__bn_dims(x, op, &a.n, &a.c, &a.hw);
    if (y || !y_t) {
        mgpu__require_tensor(y, dev, op, "y");
        mgpu__require_same_shape(y, x, op);
        mgpu__before_write(y);
        a.y = y->data;
    }
    if (skip) {
        mgpu__require_device(skip, dev, op);
        mgpu__require_same_shape(skip, x, op);
        a.skip = skip->data;
    }
    mgpu__require_per_channel(gamma, a.c, dev, op, "gamma");
    mgpu__require_per_channel(beta, a.c, dev, op, "beta");
    mgpu__require_per_channel(running_mean, a.c, dev, op, "running_mean");
    mgpu__require_per_channel(running_var, a.c, dev, op, "running_var");
    size_t m = (size_t)a.n * (size_t)a.hw;
    if (training) {
        mgpu__require_per_channel(save_mean, a.c, dev, op, "save_mean");
        mgpu__require_per_channel(save_invstd, a.c, dev, op, "save_invstd");
        MGPU_REQUIRE(m > 1, "%s: training needs more than one value per channel; x has shape %s",
                     op, mgpu_shape_str(x->shape, s, sizeof s));
    }
    if (y_t) {
        mgpu__require_channels_last_of(y_t, x, op, "channels-last y_t");
        mgpu__before_write(y_t);
        a.y_t = y_t->data;
    }
    a.x = x->data;
    a.gamma = gamma->data;
    a.beta = beta->data;
    a.running_mean = running_mean->data;
    a.running_var = running_var->data;
    a.training = training != 0;
    a.fuse_relu = fuse_relu != 0;
    a.momentum = momentum;
    a.eps = eps;
    a.splits = mgpu__bn_splits(m);
    mgpu_tensor *scratch = NULL;
    if (training) {
        a.save_mean = save_mean->data;
        a.save_invstd = save_invstd->data;
        mgpu__before_write(running_mean);
        mgpu__before_write(running_var);
        mgpu__before_write(save_mean);
        mgpu__before_write(save_invstd);
        scratch = mgpu__bn_scratch(dev, (size_t)a.c * a.splits * 3); /* Welford triples */
        a.partials = scratch ? scratch->data : NULL;
        a.done = mgpu__bn_done(dev, a.c);
    }
    if (training && sync && mgpu_group_size(sync) > 1)
        mgpu__bn_forward_synced(&a, sync, dev);
    else
        mgpu__bn_forward_launch(dev, "batchnorm", &a);
    mgpu_free(scratch);
}

MGPU_DEF void mgpu_batchnorm2d_forward(mgpu_tensor *y, const mgpu_tensor *x,
                                       const mgpu_tensor *gamma, const mgpu_tensor *beta,
                                       mgpu_tensor *running_mean, mgpu_tensor *running_var,
                                       mgpu_tensor *save_mean, mgpu_tensor *save_invstd,
                                       int training, float momentum, float eps, int fuse_relu) {
    mgpu__batchnorm2d_forward("mgpu_batchnorm2d_forward", y, NULL, x, NULL, gamma, beta, running_mean,
                              running_var, save_mean, save_invstd, training, momentum, eps,
                              fuse_relu, NULL);
}

/* A residual block's end, for its bn2's backward pass (kernels/batchnorm.h
   says why): the block's output, whose ReLU mask goes on dy; where the
   masked gradient goes (the block's dsum); and the shortcut convolution's
   bias gradient, or NULL. */
typedef struct {
    const mgpu_tensor *output;
    mgpu_tensor *dsum, *dshortcut_bias;
} mgpu__bn_block_end;
/* mgpu_batchnorm2d_backward; with dx_t, dx channels-last in TF32 there
   instead of in dx (which may then be NULL); with end, as a residual
   block's bn2 (dy is then the block's output gradient); with dconv_bias
   (and accumulate 0), the bias gradient of the convolution before, which
   gets its exact value 0 (kernels/batchnorm.h). */
static void mgpu__batchnorm2d_backward(const char *op, mgpu_tensor *dx, mgpu_tensor *dx_t,
                                       mgpu_tensor *dgamma, mgpu_tensor *dbeta, const mgpu_tensor *dy,
                                       const mgpu_tensor *x, const mgpu_tensor *gamma,
                                       const mgpu_tensor *beta, const mgpu_tensor *save_mean,
                                       const mgpu_tensor *save_invstd, int fuse_relu, int accumulate,
                                       const mgpu__bn_block_end *end, mgpu_tensor *dconv_bias,
                                       mgpu_group *sync) {
    mgpu_device *dev = x->device;
    mgpu__bn_backward_args a;
    memset(&a, 0, sizeof a);
    mgpu__bn_dims(x, op, &a.n, &a.c, &a.hw);
    mgpu__require_tensor(dy, dev, op, "dy");
    mgpu__require_same_shape(dy, x, op);
    if (dx_t) {
        mgpu__require_channels_last_of(dx_t, x, op, "channels-last dx_t");
        mgpu__before_write(dx_t);
        a.dx_t = dx_t->data;
    } else {
        mgpu__require_tensor(dx, dev, op, "dx");
        mgpu__require_same_shape(dx, x, op);
        mgpu__before_write(dx);
        a.dx = dx->data;
    }
    mgpu__require_per_channel(dgamma, a.c, dev, op, "dgamma");
    mgpu__require_per_channel(dbeta, a.c, dev, op, "dbeta");
    if (end) {
        MGPU_REQUIRE(!fuse_relu, "%s: a residual block's bn2 has no ReLU of its own", op);
        mgpu__require_tensor(end->output, dev, op, "the block's output");
        mgpu__require_same_shape(end->output, x, op);
        mgpu__require_tensor(end->dsum, dev, op, "the block's dsum");
        mgpu__require_same_shape(end->dsum, x, op);
        mgpu__before_write(end->dsum);
        a.mask = end->output->data;
        a.dsum = end->dsum->data;
        if (end->dshortcut_bias) {
            mgpu__require_per_channel(end->dshortcut_bias, a.c, dev, op, "the shortcut's bias gradient");
            mgpu__before_write(end->dshortcut_bias);
            a.dshortcut_bias = end->dshortcut_bias->data;
        }
    }
    if (dconv_bias) {
        mgpu__require_per_channel(dconv_bias, a.c, dev, op, "the convolution's bias gradient");
        mgpu__before_write(dconv_bias);
        a.dconv_bias = dconv_bias->data;
    }
    mgpu__require_per_channel(gamma, a.c, dev, op, "gamma");
    if (fuse_relu) mgpu__require_per_channel(beta, a.c, dev, op, "beta (needed with fuse_relu)");
    mgpu__require_per_channel(save_mean, a.c, dev, op, "save_mean");
    mgpu__require_per_channel(save_invstd, a.c, dev, op, "save_invstd");
    a.dgamma = dgamma->data;
    a.dbeta = dbeta->data;
    a.dy = dy->data;
    a.x = x->data;
    a.gamma = gamma->data;
    a.beta = fuse_relu ? beta->data : NULL;
    a.save_mean = save_mean->data;
    a.save_invstd = save_invstd->data;
    a.fuse_relu = fuse_relu != 0;
    a.accumulate = accumulate != 0;
    a.splits = mgpu__bn_splits((size_t)a.n * (size_t)a.hw);
    /* Partial sums of g and g xhat per slice, then the two means per channel. */
    mgpu_tensor *scratch = mgpu__bn_scratch(dev, (size_t)a.c * a.splits * 2 + (size_t)a.c * 2);
    a.partials = scratch ? scratch->data : NULL;
    a.done = mgpu__bn_done(dev, a.c);
    mgpu__before_write(dgamma);
    mgpu__before_write(dbeta);
    if (sync && mgpu_group_size(sync) > 1)
        mgpu__bn_backward_synced(&a, sync, dev);
    else
        mgpu__bn_backward_launch(dev, &a, NULL);
    mgpu_free(scratch);
}
MGPU_DEF void mgpu_batchnorm2d_backward(mgpu_tensor *dx, mgpu_tensor *dgamma, mgpu_tensor *dbeta,
                                        const mgpu_tensor *dy, const mgpu_tensor *x,
                                        const mgpu_tensor *gamma, const mgpu_tensor *beta,
                                        const mgpu_tensor *save_mean,
                                        const mgpu_tensor *save_invstd, int fuse_relu,
                                        int accumulate) {
    mgpu__batchnorm2d_backward("mgpu_batchnorm2d_backward", dx, NULL, dgamma, dbeta, dy, x, gamma, beta,
                               save_mean, save_invstd, fuse_relu, accumulate, NULL, NULL, NULL);
}

/* The line for a bad label a GPU's loss kernels reported (kernels/loss.h):
   the CPU's, with the device named. */
static void mgpu__label_error_fail(const mgpu__label_error *e, const mgpu_device *d) {
    mgpu_fatal("%s: label %g of sample %d is not a class index in [0, %d) (on %s)",
               (const char *)(uintptr_t)e->op, (double)e->label, e->row, e->classes, d->name);
}
/* Stops at a bad label, once the host has waited for the device: the
   report is in pinned host memory, so this is a read, not a copy. */
static void mgpu__require_no_label_error(const mgpu_device *d) {
    const volatile mgpu__label_error *e = d->label_error;
    if (e && e->op) mgpu__label_error_fail((const mgpu__label_error *)e, d);
}

/* Checks logits [N, classes] and labels [N] against out's device. The
   messages name op, the function the caller called, and count the samples
   from first_row (a data-parallel step's shard: where its rows start in
   the caller's batch). */
static mgpu__ce_args mgpu__ce_prepare(const char *op, int first_row, mgpu_tensor *out, const mgpu_tensor *logits,
                                      const mgpu_tensor *labels) {
    char sl[64], sy[64];
    mgpu__require_device(logits, out->device, op);
    mgpu__require_device(labels, out->device, op);
    MGPU_REQUIRE(logits->shape.ndim == 2 && logits->shape.d[1] >= 1 &&
                     labels->numel == (size_t)logits->shape.d[0],
                 "%s: logits %s and labels %s do not match; they must be [N, classes] and [N]", op,
                 mgpu_shape_str(logits->shape, sl, sizeof sl),
                 mgpu_shape_str(labels->shape, sy, sizeof sy));
    mgpu__ce_args a;
    memset(&a, 0, sizeof a);
    a.out = out->data;
    a.logits = logits->data;
    a.labels = labels->data;
    a.n = logits->shape.d[0];
    a.classes = logits->shape.d[1];
    a.op = op;
    a.first_row = first_row;
#if MGPU_CUDA
    mgpu_device *d = out->device;
    if (mgpu_device_is_gpu(d)) {
        if (!d->label_error) {
            /* (pinned host memory is the same pointer on a GPU: unified addressing) */
            MGPU_CUDA_CHECK(cudaMallocHost((void **)&d->label_error, sizeof *d->label_error));
            memset(d->label_error, 0, sizeof *d->label_error);
            d->label_claim = mgpu_zeros(d, mgpu_shape1(1)); /* (all bits 0: unclaimed) */
        }
        a.error = d->label_error;
        a.claim = (unsigned *)d->label_claim->data;
    }
#endif
    return a;
}
/* out must have `numel` values, `what` says which. */
static void mgpu__require_numel(const mgpu_tensor *out, size_t numel, const char *op, const char *what) {
    char s[64];
    MGPU_REQUIRE(out->numel == numel, "%s: the output has shape %s; it must be %s (%zu values)", op,
                 mgpu_shape_str(out->shape, s, sizeof s), what, numel);
}

static void mgpu__cross_entropy_forward(const char *op, int first_row, mgpu_tensor *losses,
                                        const mgpu_tensor *logits, const mgpu_tensor *labels) {
    mgpu__ce_args a = mgpu__ce_prepare(op, first_row, losses, logits, labels);
    mgpu__require_numel(losses, (size_t)a.n, op, "[N]");
    mgpu__before_write(losses);
    mgpu__launch_on(&losses->device->queue[0], "cross entropy", mgpu__ce_forward_cpu,
                    MGPU__CUDA_FN(mgpu__ce_forward_cuda), &a, sizeof a);
}

static void mgpu__cross_entropy_backward(const char *op, int first_row, mgpu_tensor *dlogits,
                                         const mgpu_tensor *logits, const mgpu_tensor *labels, float scale) {
    mgpu__ce_args a = mgpu__ce_prepare(op, first_row, dlogits, logits, labels);
    mgpu__require_same_shape(dlogits, logits, op);
    a.scale = scale;
    mgpu__before_write(dlogits);
    mgpu__launch_on(&dlogits->device->queue[0], "cross entropy backward", mgpu__ce_backward_cpu,
                    MGPU__CUDA_FN(mgpu__ce_backward_cuda), &a, sizeof a);
}

static void mgpu__accuracy_count(const char *op, int first_row, mgpu_tensor *count, const mgpu_tensor *logits,
                                 const mgpu_tensor *labels) {
    mgpu__ce_args a = mgpu__ce_prepare(op, first_row, count, logits, labels);
    mgpu__require_numel(count, 1, op, "[1]");
    mgpu__before_write(count);
    mgpu__launch_on(&count->device->queue[0], "accuracy", mgpu__accuracy_cpu,
                    MGPU__CUDA_FN(mgpu__accuracy_cuda), &a, sizeof a);
}
MGPU_DEF void mgpu_cross_entropy_forward(mgpu_tensor *losses, const mgpu_tensor *logits,
                                         const mgpu_tensor *labels) {
    mgpu__cross_entropy_forward("mgpu_cross_entropy_forward", 0, losses, logits, labels);
}
MGPU_DEF void mgpu_cross_entropy_backward(mgpu_tensor *dlogits, const mgpu_tensor *logits,
                                          const mgpu_tensor *labels, float scale) {
    mgpu__cross_entropy_backward("mgpu_cross_entropy_backward", 0, dlogits, logits, labels, scale);
}
MGPU_DEF void mgpu_accuracy_count(mgpu_tensor *count, const mgpu_tensor *logits,
                                  const mgpu_tensor *labels) {
    mgpu__accuracy_count("mgpu_accuracy_count", 0, count, logits, labels);
}

static void mgpu__sum_launch(const char *op, mgpu_tensor *out, const mgpu_tensor *x, double scale) {
    mgpu__require_device(x, out->device, op);
    mgpu__require_numel(out, 1, op, "[1]");
    mgpu__sum_args a = {out->data, x->data, x->numel, scale};
    mgpu__before_write(out);
    mgpu__launch_on(&out->device->queue[0], "sum", mgpu__sum_cpu, MGPU__CUDA_FN(mgpu__sum_cuda),
                    &a, sizeof a);
}
MGPU_DEF void mgpu_sum(mgpu_tensor *out, const mgpu_tensor *x) {
    mgpu__sum_launch("mgpu_sum", out, x, 1.0);
}
MGPU_DEF void mgpu_mean(mgpu_tensor *out, const mgpu_tensor *x) {
    MGPU_REQUIRE(x->numel > 0, "mgpu_mean: the tensor is empty");
    mgpu__sum_launch("mgpu_mean", out, x, 1.0 / (double)x->numel);
}

MGPU_DEF void mgpu_sgd_book(mgpu_tensor *param, mgpu_tensor *grad, float lr, int batch_size) {
    const char *op = "mgpu_sgd_book";
    mgpu__require_device(grad, param->device, op);
    mgpu__require_same_shape(param, grad, op);
    MGPU_REQUIRE(batch_size > 0, "%s: batch_size is %d; it must be positive", op, batch_size);
    mgpu__sgd_book_args a = {param->data, grad->data, param->numel, lr, (float)batch_size};
    mgpu__before_write(param);
    mgpu__before_write(grad);
    mgpu__launch_on(&param->device->queue[0], "sgd", mgpu__sgd_book_cpu,
                    MGPU__CUDA_FN(mgpu__sgd_book_cuda), &a, sizeof a);
}

/* As torch.optim.SGD: a learning rate, momentum and weight decay of 0 or
   more (a negative one would climb the loss), and finite. */
static void mgpu__require_sgd_settings(const char *op, float lr, float momentum, float weight_decay) {
    MGPU_REQUIRE(lr >= 0 && momentum >= 0 && weight_decay >= 0 && isfinite(lr) && isfinite(momentum) &&
                     isfinite(weight_decay),
                 "%s: learning rate %g, momentum %g, weight decay %g: each must be a finite 0 or more", op,
                 (double)lr, (double)momentum, (double)weight_decay);
}

/* torch.optim.SGD's update of count tensors, MGPU__LIST_MAX to a launch
   (kernels/sgd.h); bufs is NULL when momentum is 0. */

static void mgpu__sgd_tensors(const char *op, mgpu_tensor *const *params,
                              const mgpu_tensor *const *grads, mgpu_tensor *const *bufs,
                              int count, float lr, float momentum, float weight_decay,
                              int first_step) {
    mgpu__require_sgd_settings(op, lr, momentum, weight_decay);
    mgpu__sgd_args a;
    memset(&a, 0, sizeof a);
    a.lr = lr;
    a.momentum = momentum;
    a.weight_decay = weight_decay;
    a.first_step = first_step != 0;
    for (int i = 0; i < count; i++) {
        mgpu_tensor *param = params[i];
        mgpu__require_device(param, params[0]->device, op);
        mgpu__require_device(grads[i], param->device, op);
        mgpu__require_same_shape(param, grads[i], op);
        int t = a.list.count;
        if (momentum != 0.0f) {
            mgpu__require_tensor(bufs ? bufs[i] : NULL, param->device, op,
                                 "momentum_buf (needed with momentum)");
            mgpu__require_same_shape(param, bufs[i], op);
            mgpu__before_write(bufs[i]);
            a.buf[t] = bufs[i]->data;
        }
        mgpu__before_write(param);
        a.param[t] = param->data;
        a.grad[t] = grads[i]->data;
        int full = mgpu__list_add(&a.list, param->numel);
        if (full || i == count - 1) {
            mgpu__launch_on(&param->device->queue[0], "sgd", mgpu__sgd_cpu,
                            MGPU__CUDA_FN(mgpu__sgd_cuda), &a, sizeof a);
            a.list.count = 0;
        }
    }
}

/* Sets count tensors of one device to 0, MGPU__LIST_MAX to a launch. */
static void mgpu__zero_tensors(mgpu_tensor *const *tensors, int count) {
    mgpu__zero_args a;
    memset(&a, 0, sizeof a);
    for (int i = 0; i < count; i++) {
        mgpu__before_write(tensors[i]);
        a.data[a.list.count] = tensors[i]->data;
        int full = mgpu__list_add(&a.list, tensors[i]->numel);
        if (full || i == count - 1) {
            mgpu__launch_on(&tensors[i]->device->queue[0], "zero_grad", mgpu__zero_cpu,
                            MGPU__CUDA_FN(mgpu__zero_cuda), &a, sizeof a);
            a.list.count = 0;
        }
    }
}

MGPU_DEF void mgpu_sgd_step(mgpu_tensor *param, const mgpu_tensor *grad,
                            mgpu_tensor *momentum_buf, float lr, float momentum,
                            float weight_decay, int first_step) {
    mgpu__sgd_tensors("mgpu_sgd_step", &param, &grad, &momentum_buf, 1, lr, momentum,
                      weight_decay, first_step);
}

#ifdef __cplusplus
}
#endif
/* ======================================================================
   Communication: the book's functions, the ring allreduce, NCCL
   (see "Communication" above)
   ======================================================================
   Two kinds of code live here. The book's functions (get_params,
   allreduce, scatter) are built from tensor operations: mgpu_to, mgpu_copy
   and mgpu_add_ already order themselves with events, so these read like
   the book's Python. The ring and NCCL run on each device's communication
   queue (queue[1], the copy queue), so that a reduction can go on while
   the compute queue (queue[0]) works; they order themselves with explicit
   events, and the comments say why each wait is there. */
#if MGPU_CUDA && !defined(MGPU_CUDA_EMU)
#include <nccl.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Every collective takes one tensor per device, all of one shape. */
static void mgpu__require_collective(const char *op, mgpu_tensor *const *data, int n) {
    MGPU_REQUIRE(n >= 1 && n <= MGPU_MAX_DEVICES,
                 "%s: %d tensors; the number must be between 1 and %d", op, n, MGPU_MAX_DEVICES);
    for (int i = 0; i < n; i++) {
        MGPU_REQUIRE(data[i] != NULL, "%s: tensor %d is NULL", op, i);
        mgpu__require_same_shape(data[i], data[0], op);
    }
}

static void mgpu__devices_of(mgpu_tensor *const *data, int n, mgpu_device **devices) {
    for (int i = 0; i < n; i++) devices[i] = data[i]->device;
}

/* Peer access (see the manual), for each ordered pair of GPUs once. */
MGPU_DEF void mgpu_enable_peer_access(mgpu_device *const *devices, int n) {
#if MGPU_CUDA
    static unsigned char tried[MGPU_MAX_DEVICES][MGPU_MAX_DEVICES]; /* [from][to] */
    for (int a = 0; a < n; a++)
        for (int b = 0; b < n; b++) {
            int from = devices[a]->gpu, to = devices[b]->gpu, can = 0;
            if (from < 0 || to < 0 || from == to || from >= MGPU_MAX_DEVICES || to >= MGPU_MAX_DEVICES ||
                tried[from][to])
                continue;
            tried[from][to] = 1;
            MGPU_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, from, to));
            if (!can) continue; /* the driver stages the copies through host memory */
            MGPU_CUDA_CHECK(cudaSetDevice(from));
            cudaError_t err = cudaDeviceEnablePeerAccess(to, 0);
            if (err == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError(); /* done before: fine */
            else MGPU_CUDA_CHECK(err);
        }
#else
    (void)devices;
    (void)n;
#endif
}

/* ------------------------------------------------------ the book's functions */
MGPU_DEF void mgpu_get_params(mgpu_param *out, mgpu_tensor *const *params, int n, mgpu_device *dev) {
    MGPU_REQUIRE(dev != NULL, "mgpu_get_params: the device is NULL");
    for (int k = 0; k < n; k++) {
        MGPU_REQUIRE(params[k] != NULL, "mgpu_get_params: parameter %d is NULL", k);
        out[k].value = mgpu_to(params[k], dev, 1);
        out[k].grad = mgpu_zeros(dev, params[k]->shape); /* the book's requires_grad_() */
    }
}

MGPU_DEF void mgpu_params_free(mgpu_param *p, int n) {
    for (int k = 0; k < n; k++) {
        mgpu_free(p[k].value);
        mgpu_free(p[k].grad);
        p[k].value = p[k].grad = NULL;
    }
}

/* The book's allreduce. Each copy waits for the data it reads and the add
   waits for the copy (mgpu_copy's events), so the whole function only
   enqueues work. The staging tensor can be freed at once: its memory goes
   back to device 0's cache, and whatever uses it next is enqueued on
   device 0 after this add. */
MGPU_DEF void mgpu_allreduce(mgpu_tensor **data, int n) {
    mgpu__require_collective("mgpu_allreduce", data, n);
    mgpu_device *devices[MGPU_MAX_DEVICES] = {NULL};
    mgpu__devices_of(data, n, devices);
    mgpu_enable_peer_access(devices, n);
    for (int i = 1; i < n; i++) { /* sum everything into data[0] */
        mgpu_tensor *staged = mgpu_to(data[i], data[0]->device, 1);
        mgpu_add_(data[0], staged);
        mgpu_free(staged);
    }
    for (int i = 1; i < n; i++) mgpu_copy(data[i], data[0], 1); /* send the sum back */
}

/* A copy from a view leaves its mark ("a copy queue may still read this")
   on the view; hand the mark to the tensor the view looks into before the
   view goes, so that a later write to it waits for the copy. */
static void mgpu__free_view_of(mgpu_tensor *base, mgpu_tensor *view) {
    if (view->last_read) mgpu__tensor_track(base, view->last_read);
    mgpu_free(view);
}

/* mgpu_scatter; given kept_free, out[i] may be a tensor of the caller's
   from an earlier call: kept if it still has its part's shape, and the
   copy into it then waits for kept_free[i] (the end of the last work that
   read it) instead of the device's compute queue (else freed and made
   anew, and the copy waits for that queue, as mgpu_copy's). The devices
   left without rows keep their out[i] then (NULL without kept_free). */
static int mgpu__scatter(const mgpu_tensor *x, mgpu_device *const *devices, int n, mgpu_tensor **out,
                         mgpu_event *const *kept_free) {
    char s[64];
    MGPU_REQUIRE(n >= 1, "mgpu_scatter: %d devices; there must be at least one", n);
    int rows = x->shape.d[0];
    MGPU_REQUIRE(rows > 0, "mgpu_scatter: x (shape %s) has no rows to split",
                 mgpu_shape_str(x->shape, s, sizeof s));
    int chunk = (rows + n - 1) / n;                       /* ceil(rows / n), as PyTorch */
    int used = (rows + chunk - 1) / chunk;                /* devices that get rows */
    for (int i = used; i < n && !kept_free; i++) out[i] = NULL;
    for (int i = 0; i < used; i++) {
        int start = i * chunk;
        mgpu_tensor *part = mgpu_narrow(x, start, rows - start < chunk ? rows - start : chunk);
        int kept = kept_free && out[i] && out[i]->device == devices[i] && kept_free[i] &&
                   mgpu_shape_equal(out[i]->shape, part->shape);
        if (!kept) {
            if (kept_free) mgpu_free(out[i]);
            out[i] = mgpu_empty(devices[i], part->shape);
        }
        mgpu__copy(out[i], part, 1, kept ? kept_free[i] : NULL, NULL);
        mgpu__free_view_of((mgpu_tensor *)x, part);
    }
    return used;
}
MGPU_DEF int mgpu_scatter(const mgpu_tensor *x, mgpu_device *const *devices, int n, mgpu_tensor **out) {
    return mgpu__scatter(x, devices, n, out, NULL);
}

/* mgpu_split_batch, with kept_free as in mgpu__scatter. */
static int mgpu__split_batch(const mgpu_tensor *X, const mgpu_tensor *y, mgpu_device *const *devices, int n,
                             mgpu_tensor **X_shards, mgpu_tensor **y_shards, mgpu_event *const *kept_free) {
    char sx[64], sy[64];
    MGPU_REQUIRE(X->shape.d[0] == y->shape.d[0],
                 "mgpu_split_batch: X has %d rows (shape %s) but y has %d (shape %s)", X->shape.d[0],
                 mgpu_shape_str(X->shape, sx, sizeof sx), y->shape.d[0],
                 mgpu_shape_str(y->shape, sy, sizeof sy));
    mgpu__scatter(X, devices, n, X_shards, kept_free);
    return mgpu__scatter(y, devices, n, y_shards, kept_free);
}
MGPU_DEF int mgpu_split_batch(const mgpu_tensor *X, const mgpu_tensor *y, mgpu_device *const *devices,
                              int n, mgpu_tensor **X_shards, mgpu_tensor **y_shards) {
    return mgpu__split_batch(X, y, devices, n, X_shards, y_shards, NULL);
}

/* ------------------------------------------------- communication queues */
/* Queue `waiter` goes no further before `q` has done what it was given so far. */
static void mgpu__queue_wait_queue(mgpu__queue *waiter, mgpu__queue *q) {
    mgpu_event *e = mgpu_event_new();
    mgpu__event_record_on(e, q);
    mgpu__event_wait_on(waiter, e);
    mgpu_event_free(e);
}

/* Before a collective writes data[i] on its device's communication queue:
   that queue waits until the compute queue has produced data[i], and until
   copies that may still read data[i] are done (mgpu__before_write makes the
   compute queue wait for them first). */
static void mgpu__comm_begin(mgpu_tensor *const *data, int n) {
    for (int i = 0; i < n; i++) {
        mgpu__before_write(data[i]);
        mgpu__queue_wait_queue(&data[i]->device->queue[1], &data[i]->device->queue[0]);
    }
}

MGPU_DEF void mgpu_comm_wait(mgpu_device *const *devices, int n) {
    for (int i = 0; i < n; i++) mgpu__queue_wait_queue(&devices[i]->queue[0], &devices[i]->queue[1]);
}

/* A collective's tensors (a[i], and b[i] where b is given: on a[i]'s
   device) are in use on the communication queues until the work enqueued
   there so far is done: freed before mgpu_comm_wait, their memory goes
   back to the cache marked so (mgpu__tensor_track), and is not given out
   again before that. One event a device; the queue first waits for what
   was still reading them, so that the event stands for that too. */
static void mgpu__comm_track(mgpu_tensor *const *a, mgpu_tensor *const *b, int n) {
    for (int i = 0; i < n; i++) {
        mgpu__queue *q = &a[i]->device->queue[1];
        mgpu_tensor *both[2] = {a[i], b ? b[i] : NULL};
        for (int k = 0; k < 2; k++) {
            const mgpu_tensor *base = both[k] && both[k]->base ? both[k]->base : both[k];
            if (base && base->last_read) mgpu__event_wait_on(q, base->last_read);
        }
        mgpu_event *done = mgpu_event_new();
        mgpu__event_record_on(done, q);
        for (int k = 0; k < 2; k++)
            if (both[k]) mgpu__tensor_track(both[k], done);
        mgpu_event_free(done); /* (each tensor keeps its own reference) */
    }
}

static void mgpu__comm_end(mgpu_tensor *const *data, int n) {
    mgpu_device *devices[MGPU_MAX_DEVICES] = {NULL};
    mgpu__devices_of(data, n, devices);
    mgpu_comm_wait(devices, n);
}

/* ------------------------------------------------------ the ring allreduce
   Device i receives from its left neighbour i-1 and sends to its right
   neighbour i+1. The vector is cut into n chunks (chunk c starts at
   c*numel/n, so lengths differ by at most one and short vectors leave
   some chunks empty). Everything runs on the communication queues:

   Each step begins with every device marking how far its queue has got
   (the end of the previous step); then each device i, on its own queue,
   waits for its left neighbour's mark, copies the chunk it needs from the
   neighbour's vector and, in the reduce-scatter, adds it to its own. So
   "device i-1 sends chunk c at step s" is "device i copies chunk c of
   device i-1 as it was after step s-1". Why nothing races:
   - What device i receives at step s+1 is the chunk its neighbour added at
     step s: the mark of step s+1 comes after that add, so a half-added
     chunk is never sent.
   - Device i's receive buffer and vector are written only by its own
     queue, in order: the copy of step s+1 into the buffer comes after the
     add of step s that read it.
   - Device i must not overwrite a chunk that device i+1 is still reading.
     In the reduce-scatter, at step s device i writes chunk (i-1-s) while
     device i+1 reads chunk (i-s): different chunks. In the all-gather
     device i overwrites chunk (i-s) at step s, the chunk device i+1 read
     in reduce-scatter step s. By then device i has waited for device i-1
     after its previous step, which had waited for device i-2 a step
     earlier, and so on round the ring: n-1 hops back is device i+1, n-1
     steps earlier, i.e. after reduce-scatter step s. So it is done.
   - Marks are only ever recorded on their own device's queue, so a queue
     waiting on an old mark is never confused by a newer one.
   The marking is done for all devices before any device is given its
   step: marking device i-1 after device i-1 had been given its own copy
   would make device i wait for that copy too, and the n copies of a step
   would run one after another instead of at once. */
typedef struct mgpu__ring {
    int n;
    size_t numel;
    mgpu_device *dev[MGPU_MAX_DEVICES];
    float *data[MGPU_MAX_DEVICES];
    mgpu_tensor *recv[MGPU_MAX_DEVICES]; /* one chunk: what the left neighbour sent */
    mgpu_event *mark[MGPU_MAX_DEVICES];  /* recorded only on device i's communication queue */
} mgpu__ring;

static int mgpu__mod(int a, int n) { return ((a % n) + n) % n; }

/* Chunk c of the ring's vectors: its first element, and its length in *len. */
static size_t mgpu__ring_chunk(const mgpu__ring *r, int c, size_t *len) {
    size_t start = r->numel * (size_t)c / (size_t)r->n;
    *len = r->numel * (size_t)(c + 1) / (size_t)r->n - start;
    return start;
}

/* The start of a step: every device marks how far its queue has got. */
static void mgpu__ring_mark(mgpu__ring *r) {
    for (int i = 0; i < r->n; i++) mgpu__event_record_on(r->mark[i], &r->dev[i]->queue[1]);
}

/* Device i gets chunk c from its left neighbour and adds it to its own
   chunk c (reduce), or keeps it in place of its own (gather). */
static void mgpu__ring_receive(mgpu__ring *r, int i, int c, int reduce) {
    int left = mgpu__mod(i - 1, r->n);
    mgpu__queue *q = &r->dev[i]->queue[1];
    size_t len, start = mgpu__ring_chunk(r, c, &len);
    mgpu__event_wait_on(q, r->mark[left]);
    if (len == 0) return;
    float *mine = r->data[i] + start;
    mgpu__memcpy_args copy = {reduce ? r->recv[i]->data : mine, r->data[left] + start,
                              len * sizeof(float), r->dev[i]->gpu, r->dev[left]->gpu};
    mgpu__launch_on(q, "ring copy", mgpu__memcpy_cpu, MGPU__CUDA_FN(mgpu__memcpy_cuda), &copy,
                    sizeof copy);
    if (!reduce) return;
    mgpu__axpby_args add = {mine, r->recv[i]->data, len, 1.0f, 1.0f};
    mgpu__launch_on(q, "ring add", mgpu__axpby_cpu, MGPU__CUDA_FN(mgpu__axpby_cuda), &add, sizeof add);
}

/* After the reduce-scatter: device i divides the chunk it owns by n, so
   the all-gather spreads averages (1/n of the work of scaling everything). */
static void mgpu__ring_average(mgpu__ring *r) {
    for (int i = 0; i < r->n; i++) {
        size_t len, start = mgpu__ring_chunk(r, mgpu__mod(i + 1, r->n), &len);
        if (len == 0) continue;
        float *owned = r->data[i] + start;
        mgpu__axpby_args scale = {owned, owned, len, 0.0f, 1.0f / (float)r->n};
        mgpu__launch_on(&r->dev[i]->queue[1], "ring scale", mgpu__axpby_cpu,
                        MGPU__CUDA_FN(mgpu__axpby_cuda), &scale, sizeof scale);
    }
}

/* The ring itself, on the communication queues; the caller orders it
   with the compute queues (mgpu__comm_begin before, mgpu_comm_wait after).
   scratch: the receive buffers, or NULL to take them from the allocator
   for this call (see mgpu_allreduce_start for why a caller keeps its own). */
static void mgpu__ring_run(mgpu_tensor *const *data, int n, int average, mgpu_tensor *const *scratch) {
    mgpu__ring r;
    memset(&r, 0, sizeof r);
    r.n = n;
    r.numel = data[0]->numel;
    for (int i = 0; i < n; i++) {
        r.dev[i] = data[i]->device;
        r.data[i] = data[i]->data;
        r.recv[i] = scratch ? scratch[i] : mgpu_empty(r.dev[i], mgpu_shape1((int)((r.numel + n - 1) / n)));
        r.mark[i] = mgpu_event_new();
    }
    /* Reduce-scatter: at step s device i-1 sends chunk (i-1-s), which
       device i adds to its own. Afterwards device i owns the whole sum of
       chunk (i+1) mod n. */
    for (int s = 0; s < n - 1; s++) {
        mgpu__ring_mark(&r);
        for (int i = 0; i < n; i++) mgpu__ring_receive(&r, i, mgpu__mod(i - 1 - s, n), 1);
    }
    if (average) mgpu__ring_average(&r);
    /* All-gather: at step s device i-1 sends the finished chunk (i-s),
       which device i keeps. */
    for (int s = 0; s < n - 1; s++) {
        mgpu__ring_mark(&r);
        for (int i = 0; i < n; i++) mgpu__ring_receive(&r, i, mgpu__mod(i - s, n), 0);
    }
    /* In the last step device i+1 read data[i]: device i's queue waits for
       it, so that once a device's communication queue is done nothing
       touches its vector any more (mgpu_comm_wait relies on this). A
       receive buffer of our own goes back to the cache marked as in use
       until device i's queue is done with it. */
    mgpu__ring_mark(&r);
    for (int i = 0; i < n; i++) {
        mgpu__event_wait_on(&r.dev[i]->queue[1], r.mark[mgpu__mod(i + 1, n)]);
        if (scratch) continue;
        mgpu__tensor_track(r.recv[i], r.mark[i]);
        mgpu_free(r.recv[i]);
    }
    for (int i = 0; i < n; i++) mgpu_event_free(r.mark[i]);
    mgpu__comm_track(data, scratch, n);
}

/* A CPU queue cannot copy GPU memory, nor a GPU stream wait for a CPU
   queue without stopping the host: a ring is all GPUs or all CPU devices. */
static void mgpu__ring_start(const char *op, mgpu_tensor *const *data, int n, int average,
                             mgpu_tensor *const *scratch) {
    for (int i = 1; i < n; i++)
        MGPU_REQUIRE(mgpu_device_is_gpu(data[i]->device) == mgpu_device_is_gpu(data[0]->device),
                     "%s: %s and %s: the devices of a ring must be all GPUs or all CPU devices", op,
                     data[0]->device->name, data[i]->device->name);
    if (n == 1 || data[0]->numel == 0) return;
    mgpu_device *devices[MGPU_MAX_DEVICES] = {NULL};
    mgpu__devices_of(data, n, devices);
    mgpu_enable_peer_access(devices, n);
    mgpu__comm_begin(data, n);
    mgpu__ring_run(data, n, average, scratch);
}

MGPU_DEF void mgpu_ring_allreduce(mgpu_tensor **data, int n, int average) {
    mgpu__require_collective("mgpu_ring_allreduce", data, n);
    mgpu__ring_start("mgpu_ring_allreduce", data, n, average, NULL);
    mgpu__comm_end(data, n);
}

/* ------------------------------------------------------------------ NCCL */
#if MGPU_CUDA
#define MGPU_NCCL_CHECK(call)                                                         \
    do {                                                                              \
        ncclResult_t mgpu__nr = (call);                                               \
        if (mgpu__nr != ncclSuccess)                                                  \
            mgpu_fatal_at(__FILE__, __LINE__, "%s: %s (NCCL_DEBUG=WARN tells more)",  \
                          #call, ncclGetErrorString(mgpu__nr));                       \
    } while (0)

struct mgpu_nccl_comm {
    int n;
    int gpus[MGPU_MAX_DEVICES];            /* rank i is physical GPU gpus[i] */
    ncclComm_t comms[MGPU_MAX_DEVICES];
    struct mgpu_nccl_comm *next;           /* in mgpu_allreduce_auto's cache */
};

MGPU_DEF mgpu_nccl_comm *mgpu_nccl_init(mgpu_device *const *devices, int n) {
    MGPU_REQUIRE(n >= 1 && n <= MGPU_MAX_DEVICES,
                 "mgpu_nccl_init: %d devices; the number must be between 1 and %d", n, MGPU_MAX_DEVICES);
    for (int i = 0; i < n; i++) {
        if (devices[i]->gpu < 0) return NULL;
        for (int j = 0; j < i; j++)
            if (devices[j]->gpu == devices[i]->gpu) return NULL; /* virtual: one GPU twice */
    }
    mgpu_nccl_comm *c = (mgpu_nccl_comm *)mgpu__xcalloc(1, sizeof *c);
    c->n = n;
    for (int i = 0; i < n; i++) c->gpus[i] = devices[i]->gpu;
    MGPU_NCCL_CHECK(ncclCommInitAll(c->comms, n, c->gpus));
    return c;
}

MGPU_DEF void mgpu_nccl_free(mgpu_nccl_comm *c) {
    if (!c) return;
    for (int i = 0; i < c->n; i++) {
        /* NCCL work still queued must end before its communicator goes. */
        MGPU_CUDA_CHECK(cudaSetDevice(c->gpus[i]));
        MGPU_CUDA_CHECK(cudaDeviceSynchronize());
        MGPU_NCCL_CHECK(ncclCommDestroy(c->comms[i]));
    }
    free(c);
}

/* Rank i's tensor must be on GPU i of the communicator. */
static void mgpu__require_nccl(const char *op, const mgpu_nccl_comm *c, mgpu_tensor *const *t,
                               const char *what) {
    MGPU_REQUIRE(c != NULL, "%s: the communicator is NULL (mgpu_nccl_init gives NULL unless the "
                            "devices are distinct GPUs)", op);
    for (int i = 0; i < c->n; i++) {
        MGPU_REQUIRE(t[i] != NULL, "%s: %s[%d] is NULL", op, what, i);
        MGPU_REQUIRE(t[i]->device->gpu == c->gpus[i], "%s: %s[%d] is on %s, but rank %d is GPU %d", op,
                     what, i, t[i]->device->name, i, c->gpus[i]);
    }
}

/* The tracer's bar for an NCCL call on queue q: NCCL work reaches the
   stream only at ncclGroupEnd, so the bar is opened before the group and
   closed after it (an index, not a pointer: the trace may grow meanwhile). */
static void mgpu__nccl_trace_open(mgpu__queue *q, const char *name, void **bar) {
    bar[0] = bar[1] = NULL;
    if (!mgpu__library.tracing) return;
    MGPU_CUDA_CHECK(cudaSetDevice(q->device->gpu));
    mgpu__trace_add(q, name, mgpu__trace_label_now, 0, 0, bar);
    MGPU_CUDA_CHECK(cudaEventRecord((cudaEvent_t)bar[0], q->stream));
}
static void mgpu__nccl_trace_close(mgpu__queue *q, void **bar) {
    if (!bar[1]) return;
    MGPU_CUDA_CHECK(cudaSetDevice(q->device->gpu));
    MGPU_CUDA_CHECK(cudaEventRecord((cudaEvent_t)bar[1], q->stream));
}

typedef enum {
    MGPU__NCCL_ALLREDUCE, MGPU__NCCL_BROADCAST, MGPU__NCCL_REDUCE_SCATTER, MGPU__NCCL_ALL_GATHER
} mgpu__nccl_kind;

/* One NCCL call per rank on its device's communication queue. In one
   process the calls of all ranks go between ncclGroupStart and
   ncclGroupEnd: a call waits for the other ranks, so making them one by
   one would wait for ever. `arg` is `average` for the reductions and the
   root for the broadcast. */
static void mgpu__nccl_start(const mgpu_nccl_comm *c, const char *name, mgpu__nccl_kind kind,
                             mgpu_tensor *const *in, mgpu_tensor *const *out, int arg) {
    void *bars[MGPU_MAX_DEVICES][2];
    mgpu__comm_begin(out, c->n);
    for (int i = 0; i < c->n; i++) mgpu__nccl_trace_open(&out[i]->device->queue[1], name, bars[i]);
    ncclRedOp_t op = arg ? ncclAvg : ncclSum;
    MGPU_NCCL_CHECK(ncclGroupStart());
    for (int i = 0; i < c->n; i++) {
        cudaStream_t s = out[i]->device->queue[1].stream;
        const void *src = in[i]->data;
        void *dst = out[i]->data;
        switch (kind) {
        case MGPU__NCCL_ALLREDUCE:
            MGPU_NCCL_CHECK(ncclAllReduce(src, dst, out[i]->numel, ncclFloat, op, c->comms[i], s));
            break;
        case MGPU__NCCL_BROADCAST:
            MGPU_NCCL_CHECK(ncclBroadcast(src, dst, out[i]->numel, ncclFloat, arg, c->comms[i], s));
            break;
        case MGPU__NCCL_REDUCE_SCATTER:
            MGPU_NCCL_CHECK(ncclReduceScatter(src, dst, out[i]->numel, ncclFloat, op, c->comms[i], s));
            break;
        case MGPU__NCCL_ALL_GATHER:
            MGPU_NCCL_CHECK(ncclAllGather(src, dst, in[i]->numel, ncclFloat, c->comms[i], s));
            break;
        }
    }
    MGPU_NCCL_CHECK(ncclGroupEnd());
    for (int i = 0; i < c->n; i++) mgpu__nccl_trace_close(&out[i]->device->queue[1], bars[i]);
    mgpu__comm_track(out, in != out ? in : NULL, c->n);
}

MGPU_DEF void mgpu_nccl_allreduce(mgpu_nccl_comm *c, mgpu_tensor **data, int average) {
    mgpu__require_nccl("mgpu_nccl_allreduce", c, data, "data");
    mgpu__require_collective("mgpu_nccl_allreduce", data, c->n);
    mgpu__nccl_start(c, "nccl allreduce", MGPU__NCCL_ALLREDUCE, data, data, average);
    mgpu__comm_end(data, c->n);
}

MGPU_DEF void mgpu_nccl_broadcast(mgpu_nccl_comm *c, mgpu_tensor **data, int root) {
    mgpu__require_nccl("mgpu_nccl_broadcast", c, data, "data");
    mgpu__require_collective("mgpu_nccl_broadcast", data, c->n);
    MGPU_REQUIRE(root >= 0 && root < c->n, "mgpu_nccl_broadcast: root %d of %d ranks", root, c->n);
    mgpu__nccl_start(c, "nccl broadcast", MGPU__NCCL_BROADCAST, data, data, root);
    mgpu__comm_end(data, c->n);
}

/* in[i] holds n times as many elements as out[i]. */
static void mgpu__require_n_times(const char *op, const mgpu_tensor *big, const mgpu_tensor *small, int n) {
    char sb[64], ss[64];
    MGPU_REQUIRE(big->numel == (size_t)n * small->numel,
                 "%s: %s must hold %d times the elements of %s (one part per rank)", op,
                 mgpu_shape_str(big->shape, sb, sizeof sb), n, mgpu_shape_str(small->shape, ss, sizeof ss));
}

MGPU_DEF void mgpu_nccl_reduce_scatter(mgpu_nccl_comm *c, mgpu_tensor *const *in, mgpu_tensor **out,
                                       int average) {
    mgpu__require_nccl("mgpu_nccl_reduce_scatter", c, in, "in");
    mgpu__require_nccl("mgpu_nccl_reduce_scatter", c, out, "out");
    mgpu__require_collective("mgpu_nccl_reduce_scatter", out, c->n);
    for (int i = 0; i < c->n; i++) {
        mgpu__require_device(in[i], out[i]->device, "mgpu_nccl_reduce_scatter");
        mgpu__require_n_times("mgpu_nccl_reduce_scatter", in[i], out[i], c->n);
    }
    mgpu__nccl_start(c, "nccl reduce-scatter", MGPU__NCCL_REDUCE_SCATTER, in, out, average);
    mgpu__comm_end(out, c->n);
}

MGPU_DEF void mgpu_nccl_all_gather(mgpu_nccl_comm *c, mgpu_tensor *const *in, mgpu_tensor **out) {
    mgpu__require_nccl("mgpu_nccl_all_gather", c, in, "in");
    mgpu__require_nccl("mgpu_nccl_all_gather", c, out, "out");
    mgpu__require_collective("mgpu_nccl_all_gather", in, c->n);
    for (int i = 0; i < c->n; i++) {
        mgpu__require_device(in[i], out[i]->device, "mgpu_nccl_all_gather");
        mgpu__require_n_times("mgpu_nccl_all_gather", out[i], in[i], c->n);
    }
    mgpu__nccl_start(c, "nccl all-gather", MGPU__NCCL_ALL_GATHER, in, out, 0);
    mgpu__comm_end(out, c->n);
}

/* The communicators mgpu_allreduce_auto makes, one per list of GPUs, kept
   until the process ends (making one takes a while); like the library's
   other CUDA objects they are left to the end of the process, not
   destroyed at exit (see mgpu__at_exit). */
static mgpu_nccl_comm *mgpu__nccl_cache;
/* NULL when the devices are not distinct GPUs. */
static mgpu_nccl_comm *mgpu__nccl_for(mgpu_device *const *devices, int n) {
    for (mgpu_nccl_comm *c = mgpu__nccl_cache; c; c = c->next) {
        int same = c->n == n;
        for (int i = 0; i < n && same; i++) same = c->gpus[i] == devices[i]->gpu;
        if (same) return c;
    }
    mgpu_nccl_comm *c = mgpu_nccl_init(devices, n);
    if (!c) return NULL;
    c->next = mgpu__nccl_cache;
    mgpu__nccl_cache = c;
    return c;
}

#else /* no nvcc: no GPU, no NCCL, so no communicator can be made */
MGPU_DEF mgpu_nccl_comm *mgpu_nccl_init(mgpu_device *const *devices, int n) {
    (void)devices;
    (void)n;
    return NULL;
}
MGPU_DEF void mgpu_nccl_free(mgpu_nccl_comm *c) { (void)c; }
static void mgpu__no_nccl(const char *op) {
    mgpu_fatal("%s: this program was built without CUDA, so without NCCL (mgpu_nccl_init gives NULL)", op);
}
MGPU_DEF void mgpu_nccl_allreduce(mgpu_nccl_comm *c, mgpu_tensor **data, int average) {
    (void)c; (void)data; (void)average;
    mgpu__no_nccl("mgpu_nccl_allreduce");
}
MGPU_DEF void mgpu_nccl_broadcast(mgpu_nccl_comm *c, mgpu_tensor **data, int root) {
    (void)c; (void)data; (void)root;
    mgpu__no_nccl("mgpu_nccl_broadcast");
}
MGPU_DEF void mgpu_nccl_reduce_scatter(mgpu_nccl_comm *c, mgpu_tensor *const *in, mgpu_tensor **out,
                                       int average) {
    (void)c; (void)in; (void)out; (void)average;
    mgpu__no_nccl("mgpu_nccl_reduce_scatter");
}
MGPU_DEF void mgpu_nccl_all_gather(mgpu_nccl_comm *c, mgpu_tensor *const *in, mgpu_tensor **out) {
    (void)c; (void)in; (void)out;
    mgpu__no_nccl("mgpu_nccl_all_gather");
}
#endif

/* ---------------------------------------------------- choosing an algorithm */
static const char *mgpu__allreduce_start(const char *op, mgpu_tensor **data, int n, int average,
                                         mgpu_tensor *const *scratch) {
    mgpu__require_collective(op, data, n);
    if (n == 1) return "none"; /* the sum of one vector is itself, and so is its average */
    /* checked whichever algorithm runs (NCCL needs no scratch, the ring
       does): a call is right or wrong the same on every kind of device */
    size_t chunk = (data[0]->numel + n - 1) / n; /* the ring's longest chunk */
    for (int i = 0; scratch && i < n; i++) {
        MGPU_REQUIRE(scratch[i] && scratch[i]->device == data[i]->device && scratch[i]->numel >= chunk,
                     "%s: scratch[%d] must hold at least %zu elements on %s", op, i, chunk,
                     data[i]->device->name);
        mgpu__require_apart(scratch[i], data[i], op, 0);
    }
#if MGPU_CUDA
    mgpu_device *devices[MGPU_MAX_DEVICES] = {NULL};
    mgpu__devices_of(data, n, devices);
    mgpu_nccl_comm *c = mgpu__nccl_for(devices, n);
    if (c) {
        mgpu__nccl_start(c, "nccl allreduce", MGPU__NCCL_ALLREDUCE, data, data, average);
        return "nccl";
    }
#endif
    mgpu__ring_start(op, data, n, average, scratch);
    return "ring";
}

MGPU_DEF const char *mgpu_allreduce_start(mgpu_tensor **data, int n, int average, mgpu_tensor *const *scratch) {
    return mgpu__allreduce_start("mgpu_allreduce_start", data, n, average, scratch);
}

MGPU_DEF const char *mgpu_allreduce_auto(mgpu_tensor **data, int n, int average) {
    const char *algorithm = mgpu__allreduce_start("mgpu_allreduce_auto", data, n, average, NULL);
    if (n > 1) mgpu__comm_end(data, n);
    return algorithm;
}

#ifdef __cplusplus
}
#endif
/* ======================================================================
   Networks: layers with parameters, buffers and saved activations.
   ====================================================================== */

/* The `training` of a layer's forward pass: 0 evaluation, 1 training, or
   MGPU__RECOMPUTE, training again for gradient checkpointing (batch norm
   takes the batch's statistics and leaves its running ones). */
#define MGPU__RECOMPUTE 2

/* A layer's channels-last copies on a GPU (kernels/channels_last.h),
   where a convolution reads them: a convolution's of its input (input_t:
   the one the layer before wrote, or own_input_t, its own); a batch
   norm's (or a residual block's) of its output, written beside it, and
   of its input gradient, written instead of it (output_t, dinput_t); a
   convolution's of its weights, for its forward kernel (w_t) and turned
   round for its input gradient's (w'_t), where those read them: made at
   the first pass that does, then remade by each forward pass of the
   network, all in a few launches (mgpu__net_weight_copies). */
struct mgpu__layer_copies {
    int input_from_batch_norm; /* a convolution whose input is a batch norm's output (a block's) */
    const mgpu_tensor *input_t;
    mgpu_tensor *own_input_t, *output_t, *dinput_t;
    mgpu_tensor *weight_t, *weight_turned_t;
};
static mgpu_layer *mgpu__layer_new(mgpu_layer_kind kind, const char *name) {
    mgpu_layer *l = (mgpu_layer *)mgpu__xcalloc(1, sizeof *l);
    l->copies = (struct mgpu__layer_copies *)mgpu__xcalloc(1, sizeof *l->copies);
    l->kind = kind;
    l->need_dinput = 1;
    snprintf(l->name, sizeof l->name, "%s", name);
    return l;
}

/* A parameter: its value and a zero gradient of the same shape. */
static mgpu_param mgpu__param_new(mgpu_tensor *value) {
    mgpu_param p;
    p.value = value;
    p.grad = mgpu_zeros(value->device, value->shape);
    return p;
}

/* PyTorch's default bias initialisation: Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)). */
static mgpu_tensor *mgpu__bias_init(mgpu_device *d, int n, int fan_in) {
    float bound = 1.0f / sqrtf((float)fan_in);
    return mgpu_rand_uniform(d, mgpu_shape1(n), -bound, bound);
}

static mgpu_layer *mgpu__conv_new(const char *name, int in, int out, int kernel, int stride, int pad,
                                  mgpu_device *d) {
    mgpu_layer *l = mgpu__layer_new(MGPU_LAYER_CONV, name);
    l->in_channels = in;
    l->out_channels = out;
    l->kernel = kernel;
    l->stride = stride;
    l->pad = pad;
    l->weight = mgpu__param_new(mgpu_randn(d, mgpu_shape4(out, in, kernel, kernel), 0.0f, 0.01f));
    l->bias = mgpu__param_new(mgpu__bias_init(d, out, in * kernel * kernel));
    return l;
}

static mgpu_layer *mgpu__batchnorm_new(const char *name, int channels, int fuse_relu, mgpu_device *d) {
    mgpu_layer *l = mgpu__layer_new(MGPU_LAYER_BATCHNORM, name);
    l->in_channels = l->out_channels = channels;
    l->fuse_relu = fuse_relu;
    l->weight = mgpu__param_new(mgpu_ones(d, mgpu_shape1(channels)));
    l->bias = mgpu__param_new(mgpu_zeros(d, mgpu_shape1(channels)));
    l->running_mean = mgpu_zeros(d, mgpu_shape1(channels));
    l->running_var = mgpu_ones(d, mgpu_shape1(channels));
    l->save_mean = mgpu_zeros(d, mgpu_shape1(channels));
    l->save_invstd = mgpu_zeros(d, mgpu_shape1(channels));
    return l;
}

/* The batch norms of net, the residual blocks' too, into out (room for
   2 a layer); returns how many. */
static int mgpu__net_batch_norms(const mgpu_net *net, mgpu_layer **out) {
    int count = 0;
    for (int i = 0; i < net->nlayers; i++) {
        mgpu_layer *l = net->layers[i];
        if (l->kind == MGPU_LAYER_BATCHNORM) out[count++] = l;
        if (l->kind == MGPU_LAYER_RESIDUAL) out[count++] = l->bn1, out[count++] = l->bn2;
    }
    return count;
}
/* Whether a batch norm of net is synchronised over a group. */
static int mgpu__net_synced(const mgpu_net *net) {
    mgpu_layer **bns = (mgpu_layer **)mgpu__xmalloc(sizeof *bns * (2 * (size_t)net->nlayers + 1));
    int count = mgpu__net_batch_norms(net, bns), synced = 0;
    for (int i = 0; i < count; i++) synced |= bns[i]->sync != NULL;
    free(bns);
    return synced;
}

/* The book's Residual: conv3x3-BN-ReLU-conv3x3-BN, plus the input (through
   a strided 1x1 convolution when the shape changes), then ReLU. */
static mgpu_layer *mgpu__residual_new(const char *name, int in, int out, int stride, mgpu_device *d) {
    char sub[64];
    mgpu_layer *l = mgpu__layer_new(MGPU_LAYER_RESIDUAL, name);
    l->in_channels = in;
    l->out_channels = out;
    l->stride = stride;
    snprintf(sub, sizeof sub, "%s.conv1", name);
    l->conv1 = mgpu__conv_new(sub, in, out, 3, stride, 1, d);
    snprintf(sub, sizeof sub, "%s.conv2", name);
    l->conv2 = mgpu__conv_new(sub, out, out, 3, 1, 1, d);
    l->conv2->copies->input_from_batch_norm = 1; /* bn1's */
    if (in != out || stride != 1) {
        snprintf(sub, sizeof sub, "%s.conv3", name);
        l->shortcut = mgpu__conv_new(sub, in, out, 1, stride, 0, d);
    }
    snprintf(sub, sizeof sub, "%s.bn1", name);
    l->bn1 = mgpu__batchnorm_new(sub, out, 1, d);
    snprintf(sub, sizeof sub, "%s.bn2", name);
    l->bn2 = mgpu__batchnorm_new(sub, out, 0, d);
    return l;
}

static mgpu_layer *mgpu__linear_new(const char *name, int in, int out, mgpu_device *d) {
    mgpu_layer *l = mgpu__layer_new(MGPU_LAYER_LINEAR, name);
    l->in_channels = in;
    l->out_channels = out;
    /* stored [in, out]: y = x W + b, as the book's from-scratch layers */
    l->weight = mgpu__param_new(mgpu_randn(d, mgpu_shape2(in, out), 0.0f, 0.01f));
    l->bias = mgpu__param_new(mgpu__bias_init(d, out, in));
    return l;
}

/* Lists a layer's parameters and buffers in the net, in PyTorch's order
   (the order of the attributes of the book's modules). */
static void mgpu__net_register(mgpu_net *net, mgpu_layer *l) {
    if (l->kind == MGPU_LAYER_RESIDUAL) {
        mgpu_layer *order[5] = {l->conv1, l->conv2, l->shortcut, l->bn1, l->bn2};
        for (int i = 0; i < 5; i++)
            if (order[i]) mgpu__net_register(net, order[i]);
        return;
    }
    if (net->nparams + 2 > net->params_room) {
        net->params_room = 2 * net->params_room + 16;
        net->params = (mgpu_param **)mgpu__xrealloc(net->params, net->params_room * sizeof *net->params);
        net->momentum = (mgpu_tensor **)mgpu__xrealloc(net->momentum, net->params_room * sizeof *net->momentum);
        net->second_moment = (mgpu_tensor **)mgpu__xrealloc(net->second_moment,
                                                            net->params_room * sizeof *net->second_moment);
        for (int i = net->nparams; i < net->params_room; i++) net->momentum[i] = net->second_moment[i] = NULL;
        net->step_values = (mgpu_tensor **)mgpu__xrealloc(net->step_values,
                                                          net->params_room * sizeof(mgpu_tensor *));
        net->step_grads = (const mgpu_tensor **)mgpu__xrealloc((void *)net->step_grads,
                                                               net->params_room * sizeof(mgpu_tensor *));
    }
    if (net->nbuffers + 2 > net->buffers_room) {
        net->buffers_room = 2 * net->buffers_room + 16;
        net->buffers = (mgpu_tensor ***)mgpu__xrealloc(net->buffers, net->buffers_room * sizeof *net->buffers);
    }
    if (l->weight.value) net->params[net->nparams++] = &l->weight;
    if (l->bias.value) net->params[net->nparams++] = &l->bias;
    if (l->running_mean) {
        net->buffers[net->nbuffers++] = &l->running_mean;
        net->buffers[net->nbuffers++] = &l->running_var;
    }
    /* what its tensors hold counts as the network's (mgpu_memory_category):
       its statistics with the parameters */
    mgpu_tensor *state[] = {l->weight.value, l->bias.value, l->running_mean, l->running_var, l->save_mean,
                            l->save_invstd};
    for (size_t i = 0; i < sizeof state / sizeof *state; i++)
        if (state[i]) mgpu__memory_recount(state[i], MGPU_MEMORY_PARAMETERS);
    if (l->weight.grad) mgpu__memory_recount(l->weight.grad, MGPU_MEMORY_GRADIENTS);
    if (l->bias.grad) mgpu__memory_recount(l->bias.grad, MGPU_MEMORY_GRADIENTS);
}

MGPU_DEF mgpu_net *mgpu_net_new(mgpu_device *dev) {
    mgpu_net *net = (mgpu_net *)mgpu__xcalloc(1, sizeof *net);
    net->device = dev;
    net->training = 1;
    return net;
}

/* Appends layer l and returns it. Nothing before the first layer wants
   its input gradient, so it computes none (batch norm's pass makes one
   anyway). */
/* What holds a network (mgpu_net.wrapped), and the calls that make and
   free it, for the errors that name them. */
#define MGPU__HELD_BY_PIPELINE 2
static const char *mgpu__holder(const mgpu_net *net, int call) {
    static const char *const names[2][3] = {{"a data-parallel wrapper", "mgpu_data_parallel_new", "mgpu_data_parallel_free"},
                                            {"a pipeline", "mgpu_pipeline_new", "mgpu_pipeline_free"}};
    return names[net->wrapped == MGPU__HELD_BY_PIPELINE][call];
}
static mgpu_layer *mgpu__net_add(mgpu_net *net, mgpu_layer *l) {
    MGPU_REQUIRE(!net->wrapped, "%s: the network is held by %s, which copied its layers; add layers before %s",
                 l->name, mgpu__holder(net, 0), mgpu__holder(net, 1));
    if (net->nlayers + 1 >= net->layers_room) { /* (first_param has a place more than layers) */
        net->layers_room = 2 * net->layers_room + 16;
        net->layers = (mgpu_layer **)mgpu__xrealloc(net->layers, net->layers_room * sizeof *net->layers);
        net->first_param = (int *)mgpu__xrealloc(net->first_param, net->layers_room * sizeof *net->first_param);
    }
    if (net->nlayers == 0 && l->kind != MGPU_LAYER_BATCHNORM) l->need_dinput = 0;
    mgpu_layer_kind before = net->nlayers ? net->layers[net->nlayers - 1]->kind : MGPU_LAYER_LINEAR;
    if (before == MGPU_LAYER_BATCHNORM || before == MGPU_LAYER_RESIDUAL) { /* (a block's output is bn2's) */
        if (l->kind == MGPU_LAYER_CONV) l->copies->input_from_batch_norm = 1;
        if (l->kind == MGPU_LAYER_RESIDUAL) {
            l->conv1->copies->input_from_batch_norm = 1;
            if (l->shortcut) l->shortcut->copies->input_from_batch_norm = 1;
        }
    }
    net->first_param[net->nlayers] = net->nparams;
    net->layers[net->nlayers++] = l;
    mgpu__net_register(net, l);
    net->first_param[net->nlayers] = net->nparams;
    return l;
}

/* ---- the network builder (mgpu_net_add_*) ---- */
/* What the output of the net's first `end` layers is: its channels, for
   a layer that takes images; 0 when not known (no layers yet, or only
   ReLUs and pooling, or a layer of yours), -1 when it is no longer images
   (after a linear layer or global pooling). */
static int mgpu__net_channels_after(const mgpu_net *net, int end) {
    for (int i = end - 1; i >= 0; i--) {
        const mgpu_layer *l = net->layers[i];
        if (l->kind == MGPU_LAYER_OWN) return 0;
        if (l->kind == MGPU_LAYER_LINEAR || l->kind == MGPU_LAYER_GLOBAL_AVG_POOL) return -1;
        if (l->kind == MGPU_LAYER_CONV || l->kind == MGPU_LAYER_BATCHNORM || l->kind == MGPU_LAYER_RESIDUAL)
            return l->out_channels;
    }
    return 0;
}
/* The features the net's output has so far, where its layers say: a
   linear layer's, or the channels that global pooling averages; 0 where
   only a forward pass tells (images, flattened by a linear layer). */
static int mgpu__net_out_features(const mgpu_net *net) {
    int last = net->nlayers - 1;
    while (last >= 0 && net->layers[last]->kind == MGPU_LAYER_RELU) last--;
    if (last < 0) return 0;
    if (net->layers[last]->kind == MGPU_LAYER_LINEAR) return net->layers[last]->out_channels;
    if (net->layers[last]->kind == MGPU_LAYER_GLOBAL_AVG_POOL) return mgpu__net_channels_after(net, last);
    return 0;
}
/* A new layer's name, "conv3" for the net's fourth layer, a convolution. */
static const char *mgpu__net_layer_name(const mgpu_net *net, const char *kind, char *buf, size_t size) {
    snprintf(buf, size, "%s%d", kind, net->nlayers);
    return buf;
}
/* Checks that the net's output so far suits layer `op`, which takes
   images of in_channels channels (0: any number). */
static void mgpu__net_require_images(const mgpu_net *net, const char *op, int in_channels) {
    int have = mgpu__net_channels_after(net, net->nlayers);
    MGPU_REQUIRE(have >= 0, "%s: the layer before (%s) gives [N, features], not images [N, C, H, W]", op,
                 net->layers[net->nlayers - 1]->name);
    MGPU_REQUIRE(!in_channels || !have || have == in_channels,
                 "%s: takes %d channels, but the layer before gives %d", op, in_channels, have);
}
MGPU_DEF mgpu_layer *mgpu_net_add_conv(mgpu_net *net, int in_channels, int out_channels, int kernel, int stride,
                                       int pad) {
    MGPU_REQUIRE(in_channels > 0 && out_channels > 0 && kernel > 0 && stride > 0 && pad >= 0,
                 "mgpu_net_add_conv: %d -> %d channels, kernel %d, stride %d, pad %d: channels, kernel and "
                 "stride must be positive, pad not negative", in_channels, out_channels, kernel, stride, pad);
    mgpu__net_require_images(net, "mgpu_net_add_conv", in_channels);
    char name[32];
    return mgpu__net_add(net, mgpu__conv_new(mgpu__net_layer_name(net, "conv", name, sizeof name), in_channels,
                                             out_channels, kernel, stride, pad, net->device));
}
MGPU_DEF mgpu_layer *mgpu_net_add_batchnorm(mgpu_net *net, int channels) {
    MGPU_REQUIRE(channels > 0, "mgpu_net_add_batchnorm: %d channels must be positive", channels);
    mgpu__net_require_images(net, "mgpu_net_add_batchnorm", channels);
    char name[32];
    return mgpu__net_add(net, mgpu__batchnorm_new(mgpu__net_layer_name(net, "batchnorm", name, sizeof name),
                                                  channels, 0, net->device));
}
MGPU_DEF mgpu_layer *mgpu_net_add_relu(mgpu_net *net) {
    mgpu_layer *last = net->nlayers ? net->layers[net->nlayers - 1] : NULL;
    if (last && last->kind == MGPU_LAYER_BATCHNORM && !last->fuse_relu) {
        last->fuse_relu = 1; /* batch norm's pass applies the ReLU as it writes */
        return last;
    }
    char name[32];
    return mgpu__net_add(net,
                         mgpu__layer_new(MGPU_LAYER_RELU, mgpu__net_layer_name(net, "relu", name, sizeof name)));
}
MGPU_DEF mgpu_layer *mgpu_net_add_avg_pool(mgpu_net *net, int kernel) {
    MGPU_REQUIRE(kernel > 0, "mgpu_net_add_avg_pool: kernel %d must be positive", kernel);
    mgpu__net_require_images(net, "mgpu_net_add_avg_pool", 0);
    char name[32];
    mgpu_layer *l = mgpu__net_add(
        net, mgpu__layer_new(MGPU_LAYER_AVG_POOL, mgpu__net_layer_name(net, "avgpool", name, sizeof name)));
    l->kernel = l->stride = kernel;
    return l;
}
MGPU_DEF mgpu_layer *mgpu_net_add_global_avg_pool(mgpu_net *net) {
    mgpu__net_require_images(net, "mgpu_net_add_global_avg_pool", 0);
    char name[32];
    return mgpu__net_add(
        net, mgpu__layer_new(MGPU_LAYER_GLOBAL_AVG_POOL, mgpu__net_layer_name(net, "pool", name, sizeof name)));
}
MGPU_DEF mgpu_layer *mgpu_net_add_residual(mgpu_net *net, int in_channels, int out_channels, int stride) {
    MGPU_REQUIRE(in_channels > 0 && out_channels > 0 && stride > 0,
                 "mgpu_net_add_residual: %d -> %d channels, stride %d must be positive", in_channels, out_channels,
                 stride);
    mgpu__net_require_images(net, "mgpu_net_add_residual", in_channels);
    char name[32];
    return mgpu__net_add(net, mgpu__residual_new(mgpu__net_layer_name(net, "block", name, sizeof name), in_channels,
                                                 out_channels, stride, net->device));
}
MGPU_DEF mgpu_layer *mgpu_net_add_linear(mgpu_net *net, int in_features, int out_features) {
    MGPU_REQUIRE(in_features > 0 && out_features > 0,
                 "mgpu_net_add_linear: %d -> %d features must be positive", in_features, out_features);
    int have = mgpu__net_out_features(net);
    MGPU_REQUIRE(!have || have == in_features,
                 "mgpu_net_add_linear: takes %d features, but the layer before gives %d", in_features, have);
    char name[32];
    return mgpu__net_add(net, mgpu__linear_new(mgpu__net_layer_name(net, "linear", name, sizeof name), in_features,
                                               out_features, net->device));
}

/* A layer with its own loops (mgpu_layer_fns.own_loops) runs on CPU devices only. */
static void mgpu__require_own_loops_on_cpu(const mgpu_layer *l, const mgpu_device *dev, const char *op) {
    MGPU_REQUIRE(l->kind != MGPU_LAYER_OWN || !l->fns->own_loops || !mgpu_device_is_gpu(dev),
                 "%s: %s loops over its values on the host (own_loops 1), and %s is a GPU", op, l->name,
                 dev->name);
}
/* A parameter of a layer of yours: a tensor of its own on the net's
   device, which becomes the net's (to free, once). */
static mgpu_param mgpu__own_param(const mgpu_net *net, mgpu_tensor *value, const char *which, const char *name) {
    mgpu_param p = {NULL, NULL};
    if (!value) return p;
    MGPU_REQUIRE(value->device == net->device, "mgpu_net_add_layer: %s's %s is on %s, the network on %s", name,
                 which, value->device->name, net->device->name);
    MGPU_REQUIRE(!value->base, "mgpu_net_add_layer: %s's %s is a view of another tensor; give it a tensor of its own",
                 name, which);
    for (int i = 0; i < net->nparams; i++)
        MGPU_REQUIRE(net->params[i]->value != value,
                     "mgpu_net_add_layer: %s's %s is already a parameter of the network (parameter %d)", name,
                     which, i);
    return mgpu__param_new(value);
}
MGPU_DEF mgpu_layer *mgpu_net_add_layer(mgpu_net *net, const mgpu_layer_fns *fns, mgpu_tensor *weight,
                                        mgpu_tensor *bias, void *settings) {
    MGPU_REQUIRE(fns && fns->forward && fns->backward,
                 "mgpu_net_add_layer: the layer needs its functions (fns, with forward and backward)");
    MGPU_REQUIRE(!fns->kind || strlen(fns->kind) <= MGPU_LAYER_KIND_MAX,
                 "mgpu_net_add_layer: kind \"%s\" is longer than %d characters", fns->kind,
                 MGPU_LAYER_KIND_MAX);
    MGPU_REQUIRE(fns->own_loops == 0 || fns->own_loops == 1,
                 "mgpu_net_add_layer: own_loops is %d; it is 0 or 1", fns->own_loops);
    MGPU_REQUIRE(!weight || weight != bias, "mgpu_net_add_layer: weight and bias are the same tensor");
    char name[40];
    mgpu_layer *l = mgpu__layer_new(MGPU_LAYER_OWN, mgpu__net_layer_name(net, fns->kind ? fns->kind : "layer",
                                                                         name, sizeof name));
    l->fns = fns;
    mgpu__require_own_loops_on_cpu(l, net->device, "mgpu_net_add_layer");
    l->settings = settings;
    l->weight = mgpu__own_param(net, weight, "weight", l->name);
    l->bias = mgpu__own_param(net, bias, "bias", l->name);
    return mgpu__net_add(net, l);
}

/* Chapter 2's LeNet, as layers (the NETWORKS manual's example). */
MGPU_DEF mgpu_net *mgpu_lenet(mgpu_device *dev) {
    mgpu_net *net = mgpu_net_new(dev);
    mgpu_net_add_conv(net, 1, 20, 3, 1, 0);
    mgpu_net_add_relu(net);
    mgpu_net_add_avg_pool(net, 2);
    mgpu_net_add_conv(net, 20, 50, 5, 1, 0);
    mgpu_net_add_relu(net);
    mgpu_net_add_avg_pool(net, 2);
    mgpu_net_add_linear(net, 800, 128);
    mgpu_net_add_relu(net);
    mgpu_net_add_linear(net, 128, 10);
    return net;
}

MGPU_DEF mgpu_net *mgpu_resnet18(int num_classes, int in_channels, mgpu_device *dev) {
    MGPU_REQUIRE(num_classes > 0 && in_channels > 0,
                 "mgpu_resnet18: %d classes and %d input channels must both be positive",
                 num_classes, in_channels);
    mgpu_net *net = mgpu_net_new(dev);
    mgpu__net_add(net, mgpu__conv_new("stem.conv", in_channels, 64, 3, 1, 1, dev));
    mgpu__net_add(net, mgpu__batchnorm_new("stem.bn", 64, 1, dev));
    static const int channels[4] = {64, 128, 256, 512};
    int in = 64;
    for (int stage = 0; stage < 4; stage++)
        for (int block = 0; block < 2; block++) {
            char name[40];
            snprintf(name, sizeof name, "stage%d.block%d", stage + 1, block + 1);
            int stride = (stage > 0 && block == 0) ? 2 : 1;
            mgpu__net_add(net, mgpu__residual_new(name, in, channels[stage], stride, dev));
            in = channels[stage];
        }
    mgpu__net_add(net, mgpu__layer_new(MGPU_LAYER_GLOBAL_AVG_POOL, "pool"));
    mgpu__net_add(net, mgpu__linear_new("fc", 512, num_classes, dev));
    return net;
}

/* ------------------------------------------------------ channels-last */
/* On a GPU, the convolutions read channels-last copies of their input and
   of their output's gradient (kernels/conv_nhwc.h). Made by a copy of
   their own, each costs a read and a write of the whole tensor; in
   ResNet-18 every such tensor but the first comes from a batch norm, and
   batch norm can write the copy in the pass that computes the tensor
   (kernels/batchnorm.h): beside its output, for the convolution after it,
   and instead of its input gradient, for the convolution before it when
   that one reads the gradient through its copy alone. Whether a
   convolution reads them is its plan's, measured at its first call (so
   the first step still copies). The tests turn this off to compare. */
static int mgpu__batch_norm_writes_channels_last = 1;
/* And the convolutions keep their weights' copies, which the network
   remakes before each forward pass, all in a few launches
   (mgpu__net_weight_copies); the tests turn this off to compare too. */
static int mgpu__network_keeps_weight_copies = 1;

/* Whether convolution layer l, on input shape x, reads x's channels-last
   copy: for y, or for dW (at either pass's first call, not yet); with
   `only`, whether it reads x through that copy alone: for y and for dW. */
static int mgpu__conv_layer_reads_x_t(const mgpu_layer *l, mgpu_shape x, int only) {
#if MGPU_CUDA
    if (!mgpu__conv_implicit_allowed(l->weight.value->device)) return 0;
    mgpu__conv_geom g = mgpu__conv_geometry(l->name, x, l->weight.value->shape, l->stride, l->pad);
    int for_y = mgpu__conv_plan_reads_x_t(mgpu__conv_plan_known(&g, 0, 0));
    if (only) return for_y && mgpu__conv_plan_dw_reads_x_t(mgpu__conv_plan_known(&g, 1, l->need_dinput));
    return for_y || mgpu__conv_plan_dw_reads_x_t(mgpu__conv_plan_known(&g, 1, 0)) ||
           mgpu__conv_plan_dw_reads_x_t(mgpu__conv_plan_known(&g, 1, 1));
#else
    (void)l;
    (void)x;
    (void)only;
    return 0;
#endif
}
/* Whether the layer after a batch norm (next: a convolution, or a
   residual block, whose first convolution and shortcut take the block's
   input) reads the batch norm's output, of shape y, channels-last. */
static int mgpu__next_reads_output_t(const mgpu_layer *next, mgpu_shape y) {
    if (!next || !mgpu__batch_norm_writes_channels_last) return 0;
    if (next->kind == MGPU_LAYER_CONV) return mgpu__conv_layer_reads_x_t(next, y, 0);
    return next->kind == MGPU_LAYER_RESIDUAL &&
           (mgpu__conv_layer_reads_x_t(next->conv1, y, 0) ||
            (next->shortcut && mgpu__conv_layer_reads_x_t(next->shortcut, y, 0)));
}
/* Whether convolution layer l, followed by batch norm `bn`, reads its
   output's gradient through the channels-last copy alone, when its input
   gradient is wanted or not (with_dx). */
static int mgpu__bias_cancelled_by(const mgpu_layer *next);
static int mgpu__conv_layer_reads_dy_t_only(const mgpu_layer *l, int with_dx, const mgpu_layer *bn) {
#if MGPU_CUDA
    if (!l || l->kind != MGPU_LAYER_CONV || !l->input || !mgpu__conv_implicit_allowed(l->input->device))
        return 0;
    mgpu__conv_geom g =
        mgpu__conv_geometry(l->name, l->input->shape, l->weight.value->shape, l->stride, l->pad);
    int with_db = l->bias.grad && !mgpu__bias_cancelled_by(bn);
    return mgpu__conv_plan_reads_dy_t_only(mgpu__conv_plan_known(&g, 1, with_dx), with_dx, with_db);
#else
    (void)l;
    (void)with_dx;
    (void)bn;
    return 0;
#endif
}

/* What the network prepares for convolution layer l (MGPU__PREPARED_*),
   for its trial to count: in the forward pass, or in the backward pass
   (followed by layer `next`). x's copy where batch norm writes it, or in
   the backward where the forward made one (l->copies->input_t); dy's where the
   layer after is a batch norm in training (mgpu__bias_cancelled_by),
   which writes it when the plan reads it alone; the weights' where the
   network keeps them. */
static int mgpu__conv_layer_prepared(const mgpu_layer *l, int backward, const mgpu_layer *next) {
    int bn = mgpu__batch_norm_writes_channels_last, prepared = 0;
    if ((bn && l->copies->input_from_batch_norm) || (backward && l->copies->input_t)) prepared |= MGPU__PREPARED_X;
    if (bn && backward && mgpu__bias_cancelled_by(next)) prepared |= MGPU__PREPARED_DY;
    if (mgpu__network_keeps_weight_copies) prepared |= MGPU__PREPARED_W;
    return prepared;
}

/* ------------------------------------------------------------ forward */
/* Batch norm layer l on x into y, with the ReLU when l has it fused, or
   with skip: y = max(bn(x) + skip, 0); and into y_t, y's channels-last
   copy, when `next` reads that (else *y_t is NULL). When next is a
   convolution that reads its input through that copy alone, y itself is
   not written: nothing else reads it (l's backward pass recomputes the
   ReLU's mask from x; the residual block's, whose bn2 has the skip, reads
   its output, and keeps it). */
static void mgpu__batchnorm_layer_forward(mgpu_layer *l, const mgpu_tensor *x, const mgpu_tensor *skip,
                                          mgpu_tensor *y, mgpu_tensor **y_t, const mgpu_layer *next,
                                          int training) {
    /* (a recomputation: the batch's statistics again, the running ones left) */
    float momentum = training == MGPU__RECOMPUTE ? 0.0f : 0.1f;
    l->input = x;
    l->batch_statistics = training;
    int n = x->shape.d[0], c = x->shape.d[1], hw = x->shape.d[2] * x->shape.d[3];
    mgpu_tensor *y_copy = NULL; /* the channels-last copy of y this pass writes */
    if (mgpu__next_reads_output_t(next, x->shape))
        y_copy = mgpu_ensure(y_t, x->device, mgpu_shape3(n, hw, c));
    if (y_copy && !skip && next->kind == MGPU_LAYER_CONV && mgpu__conv_layer_reads_x_t(next, x->shape, 1))
        y = NULL;
    mgpu__batchnorm2d_forward(l->name, y, y_copy, x, skip, l->weight.value, l->bias.value, l->running_mean,
                              l->running_var, l->save_mean, l->save_invstd, training, momentum, 1e-5f,
                              l->fuse_relu || skip, l->sync);
    if (!y_copy) { /* not written: no stale copy left to read */
        mgpu_free(*y_t);
        *y_t = NULL;
    }
}

/* Guard floats. A layer of yours writes its output y and its input
   gradient dx itself, and a loop that runs past their shape (an
   output_shape that does not say what forward writes, a batch size
   written into the loop) would write over whatever lies after them in
   memory. So both get MGPU__GUARD_FLOATS more floats after their values,
   holding a NaN that no arithmetic makes (its bits are the pattern), and
   the library reads them after the pass: after every pass of own loops
   (on the device's queue, where the values are at hand), and otherwise
   when the tensor is made anew (the first pass, or a batch of another
   size), waiting for the device that once. A write before the start, or
   one that jumps past the guard floats, is not seen. */
#define MGPU__GUARD_FLOATS 16
#define MGPU__GUARD_BITS 0x7fc0deadu
static int mgpu__guard_holds(const float *guard) {
    for (int i = 0; i < MGPU__GUARD_FLOATS; i++) {
        uint32_t bits;
        memcpy(&bits, &guard[i], sizeof bits);
        if (bits != MGPU__GUARD_BITS) return 0;
    }
    return 1;
}
/* A view of t's guard floats. */
static mgpu_tensor *mgpu__guard_view(const mgpu_tensor *t) {
    mgpu_tensor *v = mgpu_view(t, t->shape);
    v->shape = mgpu_shape1(MGPU__GUARD_FLOATS);
    v->numel = MGPU__GUARD_FLOATS;
    v->data = t->data + t->numel;
    return v;
}
/* *slot as mgpu_ensure makes it, with guard floats after its values (set
   on its device's queue); returns whether it was made anew. */
static int mgpu__ensure_guarded(mgpu_tensor **slot, mgpu_device *dev, mgpu_shape shape) {
    if (*slot && (*slot)->device == dev && mgpu_shape_equal((*slot)->shape, shape)) return 0;
    mgpu_free(*slot);
    *slot = mgpu__tensor_alloc(dev, shape, 0, MGPU__GUARD_FLOATS);
    uint32_t bits = MGPU__GUARD_BITS;
    float pattern;
    memcpy(&pattern, &bits, sizeof pattern);
    mgpu_tensor *guard = mgpu__guard_view(*slot);
    mgpu_fill(guard, pattern);
    mgpu_free(guard);
    return 1;
}
/* The one-line error when the guard floats after t (a copy of them in
   host memory, `guard`) were written by layer l's forward (t is y) or
   backward (t is dx). */
static void mgpu__require_guard(const mgpu_layer *l, const float *guard, const mgpu_tensor *t, int backward) {
    char shape[64];
    MGPU_REQUIRE(mgpu__guard_holds(guard), "%s (a layer of yours): its %s wrote past the end of %s, whose shape is %s",
                 l->name, backward ? "backward" : "forward", backward ? "dx" : "y",
                 mgpu_shape_str(t->shape, shape, sizeof shape));
}
/* The same from the calling thread, for t made anew (waits for its device). */
static void mgpu__require_guard_now(const mgpu_layer *l, const mgpu_tensor *t, int backward) {
    float guard[MGPU__GUARD_FLOATS];
    mgpu_tensor *v = mgpu__guard_view(t);
    mgpu_to_host(v, guard);
    mgpu_free(v);
    mgpu__require_guard(l, guard, t, backward);
}

/* A pass of a layer of yours: forward (dy NULL: y = f(x)) or backward
   (dx, dweight, dbias from dy, x and y), after the copies still reading
   what it writes (as the library's operations are, for kernels of yours
   and own loops). On the calling thread; or, with own_loops, on the
   device's queue, with copies of the tensors
   as they are now: by the time the queue runs it, the next forward pass
   may have replaced l->input or l->output (their values are safe: the
   queue runs in order). */
typedef struct mgpu__own_pass_args {
    mgpu_layer *l;
    mgpu_tensor t[6];  /* out (y or dx), dweight, dbias, x, y, dy */
    int given[6];      /* which of them there are */
    int training;
} mgpu__own_pass_args;
static void mgpu__own_pass_call(mgpu_layer *l, mgpu_tensor *const *t, int training) {
    if (t[5])
        l->fns->backward(l, t[0], t[1], t[2], t[5], t[3], t[4]);
    else
        l->fns->forward(l, t[0], t[3], training);
}
static void mgpu__own_pass_run(const void *args, const mgpu__exec *ex) {
    mgpu__own_pass_args a = *(const mgpu__own_pass_args *)args;
    mgpu_tensor *t[6];
    (void)ex;
    for (int i = 0; i < 6; i++) t[i] = a.given[i] ? &a.t[i] : NULL;
    mgpu__queue *q = &a.t[3].device->queue[0]; /* the queue running this: x's device's */
    q->running_layer = a.l->name;              /* for mgpu__require_not_in_worker's line */
    mgpu__own_pass_call(a.l, t, a.training);
    q->running_layer = NULL;
    if (t[0]) mgpu__require_guard(a.l, t[0]->data + t[0]->numel, t[0], t[5] != NULL); /* (y, or dx) */
}
static void mgpu__own_layer_pass(mgpu_layer *l, mgpu_tensor *out, const mgpu_tensor *x, const mgpu_tensor *dy,
                                 mgpu_tensor *dweight, mgpu_tensor *dbias, int training) {
    mgpu_tensor *t[6] = {out, dweight, dbias, (mgpu_tensor *)x, l->output, (mgpu_tensor *)dy};
    if (out) mgpu__before_write(out);
    if (!l->fns->own_loops) {
#if MGPU_CUDA
        if (mgpu_device_is_gpu(x->device)) MGPU_CUDA_CHECK(cudaSetDevice(x->device->gpu)); /* for kernels of yours */
#endif
        mgpu__own_pass_call(l, t, training);
        return;
    }
    mgpu__own_pass_args a;
    memset(&a, 0, sizeof a);
    a.l = l;
    a.training = training;
    for (int i = 0; i < 6; i++)
        if ((a.given[i] = t[i] != NULL)) a.t[i] = *t[i];
    mgpu__launch_on(&x->device->queue[0], "layer of yours", mgpu__own_pass_run, NULL, &a, sizeof a);
}

static mgpu_tensor *mgpu__layer_forward(mgpu_layer *l, const mgpu_tensor *x, const mgpu_tensor *x_t,
                                        const mgpu_layer *next, int training);
static const mgpu_tensor *mgpu__layer_backward(mgpu_layer *l, const mgpu_tensor *dy, const mgpu_tensor *dy_t,
                                               const mgpu_layer *next, const mgpu_layer *prev, int accumulate);

/* Layer l's forward pass from x, and from x_t, x's channels-last copy,
   when the layer before wrote one (else NULL); next: the layer that takes
   l's output (NULL if none). Returns the output; its channels-last copy,
   if l wrote one, is then in l->copies->output_t (else that is NULL), and a batch
   norm may then have left the output's values unwritten (above). */
static mgpu_tensor *mgpu__layer_forward_pass(mgpu_layer *l, const mgpu_tensor *x, const mgpu_tensor *x_t,
                                             const mgpu_layer *next, int training) {
    mgpu_device *d = x->device;
    l->input = x;
    switch (l->kind) {
    case MGPU_LAYER_CONV: { /* (a shape that does not fit is an error naming the layer) */
        mgpu__conv_geom g = mgpu__conv_geometry(l->name, x->shape, l->weight.value->shape, l->stride, l->pad);
        mgpu_ensure(&l->output, d, mgpu_shape4(g.n, g.k, g.p, g.q));
        mgpu__conv2d_forward(l->output, x, x_t, l->weight.value,
                             mgpu__network_keeps_weight_copies ? &l->copies->weight_t : NULL, l->bias.value, l->stride,
                             l->pad, &l->copies->own_input_t, mgpu__conv_layer_prepared(l, 0, NULL));
        l->copies->input_t = x_t ? x_t : l->copies->own_input_t;
        break;
    }
    case MGPU_LAYER_BATCHNORM:
        mgpu__batchnorm_layer_forward(l, x, NULL, mgpu_ensure(&l->output, d, x->shape), &l->copies->output_t, next,
                                      training);
        break;
    case MGPU_LAYER_RELU:
        mgpu_ensure(&l->output, d, x->shape);
        mgpu_relu_forward(l->output, x);
        break;
    case MGPU_LAYER_RESIDUAL: {
        const mgpu_tensor *y = mgpu__layer_forward(l->conv1, x, x_t, l->bn1, training);
        y = mgpu__layer_forward(l->bn1, y, NULL, l->conv2, training); /* with its ReLU */
        y = mgpu__layer_forward(l->conv2, y, l->bn1->copies->output_t, l->bn2, training);
        const mgpu_tensor *skip = l->shortcut ? mgpu__layer_forward(l->shortcut, x, x_t, NULL, training) : x;
        /* bn2, the add and the ReLU in one pass, into the block's output */
        mgpu__batchnorm_layer_forward(l->bn2, y, skip, mgpu_ensure(&l->output, d, y->shape), &l->copies->output_t,
                                      next, training);
        break;
    }
    case MGPU_LAYER_AVG_POOL:
        mgpu_ensure(&l->output, d, mgpu_avg_pool2d_output_shape(x->shape, l->kernel));
        mgpu_avg_pool2d_forward(l->output, x, l->kernel);
        break;
    case MGPU_LAYER_GLOBAL_AVG_POOL:
        mgpu_ensure(&l->output, d, mgpu_shape2(x->shape.d[0], x->shape.d[1]));
        mgpu_global_avg_pool_forward(l->output, x);
        break;
    case MGPU_LAYER_LINEAR:
        mgpu_ensure(&l->output, d, mgpu_shape2(x->shape.d[0], l->out_channels));
        mgpu_linear_forward(l->output, x, l->weight.value, l->bias.value);
        break;
    case MGPU_LAYER_OWN: {
        int made = mgpu__ensure_guarded(&l->output, d,
                                        l->fns->output_shape ? l->fns->output_shape(l, x->shape) : x->shape);
        mgpu__own_layer_pass(l, l->output, x, NULL, NULL, NULL, training != 0);
        if (made && !l->fns->own_loops) mgpu__require_guard_now(l, l->output, 0); /* (own loops: each pass) */
        break;
    }
    }
    return l->output;
}

/* (the pass, with the layer named in the libraries' error lines) */
/* (the pass, with the layer named in the libraries' error lines; what it
   makes counts as workspace, but for what it keeps for the backward pass,
   the activations, and the weights' copies a convolution keeps, counted
   with the parameters) */
static mgpu_tensor *mgpu__layer_forward(mgpu_layer *l, const mgpu_tensor *x, const mgpu_tensor *x_t,
                                        const mgpu_layer *next, int training) {
    const char *outer = mgpu__layer_enqueuing; /* (a block's, around its own layers) */
    mgpu__layer_enqueuing = l->name;
    int scope = mgpu__memory_scope(MGPU_MEMORY_WORKSPACE);
    mgpu_tensor *y = mgpu__layer_forward_pass(l, x, x_t, next, training);
    mgpu_tensor *kept[3] = {l->output, l->copies->output_t, l->copies->own_input_t};
    for (int i = 0; i < 3; i++)
        if (kept[i]) mgpu__memory_recount(kept[i], MGPU_MEMORY_ACTIVATIONS);
    mgpu_tensor *weights[2] = {l->copies->weight_t, l->copies->weight_turned_t};
    for (int i = 0; i < 2; i++)
        if (weights[i]) mgpu__memory_recount(weights[i], MGPU_MEMORY_PARAMETERS);
    mgpu__memory_scope((mgpu_memory_category)scope);
    mgpu__layer_enqueuing = outer;
    return y;
}

/* The weights' channels-last copies the network's convolutions keep
   (weight_t; in training also weight_turned_t, for the backward pass that
   follows), remade from the weights as they are now: 16 copies a launch
   (kernels/channels_last.h), where each convolution made its own twice a
   step before (and the first step still does, as its plans are measured
   there). The weights do not change between a forward pass and its
   backward pass, whose activations are the forward's too. */
static void mgpu__net_weight_copies(mgpu_net *net) {
#if MGPU_CUDA
    mgpu__channels_last_list_args list;
    memset(&list, 0, sizeof list);
    for (int i = 0; i < net->nlayers; i++) {
        mgpu_layer *l = net->layers[i], *convs[3] = {l, NULL, NULL};
        if (l->kind == MGPU_LAYER_RESIDUAL) convs[0] = l->conv1, convs[1] = l->conv2, convs[2] = l->shortcut;
        for (int c = 0; c < 3; c++) {
            mgpu_layer *conv = convs[c];
            if (!conv || conv->kind != MGPU_LAYER_CONV) continue;
            const mgpu_tensor *w = conv->weight.value;
            int filters = w->shape.d[0], channels = w->shape.d[1], taps = w->shape.d[2] * w->shape.d[3];
            for (int turned = 0; turned <= net->training; turned++) {
                mgpu_tensor *copy = turned ? conv->copies->weight_turned_t : conv->copies->weight_t;
                if (copy && mgpu__channels_last_list_add(&list, mgpu__weights_copy(copy->data, w->data, filters,
                                                                                   channels, taps, turned))) {
                    MGPU__ENQUEUE(net->device, "conv2d channels-last weights", mgpu__channels_last_list, list);
                    memset(&list, 0, sizeof list);
                }
            }
        }
    }
    if (list.count) MGPU__ENQUEUE(net->device, "conv2d channels-last weights", mgpu__channels_last_list, list);
#else
    (void)net;
#endif
}

/* ---- gradient checkpointing (mgpu_net_checkpoint) ---- */
/* Frees what layer l's forward pass made for its backward pass: its
   output (unless keep_output) and channels-last copies, its parts' too. */
static void mgpu__layer_free_activations(mgpu_layer *l, int keep_output) {
    if (!keep_output) {
        mgpu_free(l->output);
        l->output = NULL;
        mgpu_free(l->copies->output_t);
        l->copies->output_t = NULL;
    }
    mgpu_free(l->copies->own_input_t);
    l->copies->own_input_t = NULL;
    l->copies->input_t = NULL;
    mgpu_layer *parts[5] = {l->conv1, l->bn1, l->conv2, l->bn2, l->shortcut};
    for (int i = 0; i < 5 && l->kind == MGPU_LAYER_RESIDUAL; i++)
        if (parts[i]) mgpu__layer_free_activations(parts[i], 0);
}
/* Frees the activations' gradients layer l's backward pass made: its
   parts' and its scratch, and its own input gradient with `own`. */
static void mgpu__layer_free_gradients(mgpu_layer *l, int own) {
    /* (a layer of yours keeps its input gradient: a new one's guard floats
       are checked after its pass, which waits for the device) */
    if (own && l->kind != MGPU_LAYER_OWN) {
        mgpu_free(l->dinput);
        l->dinput = NULL;
        mgpu_free(l->copies->dinput_t);
        l->copies->dinput_t = NULL;
    }
    mgpu_free(l->dsum);
    l->dsum = NULL;
    mgpu_layer *parts[5] = {l->conv1, l->bn1, l->conv2, l->bn2, l->shortcut};
    for (int i = 0; i < 5 && l->kind == MGPU_LAYER_RESIDUAL; i++)
        if (parts[i]) mgpu__layer_free_gradients(parts[i], 1);
}
/* Run s's activations freed, all but its output (the next run's input)
   when keep_output. */
static void mgpu__net_free_segment(mgpu_net *net, int s, int keep_output) {
    int last = net->segment_start[s + 1] - 1;
    for (int i = net->segment_start[s]; i <= last; i++)
        mgpu__layer_free_activations(net->layers[i], keep_output && i == last);
    net->segment_freed[s] = 1;
}
/* The runs of this forward pass: one (no checkpointing, or evaluation),
   else net->segments (or about sqrt(n)) of about n / k layers each. */
static void mgpu__net_cut_segments(mgpu_net *net) {
    int n = net->nlayers, k = net->segments == MGPU_SEGMENTS_SQRT ? (int)lround(sqrt((double)n)) : net->segments;
    if (k < 1 || !net->training) k = 1;
    MGPU_REQUIRE(k <= n, "mgpu_net_forward: %d checkpointed runs (mgpu_net_checkpoint) of a network of %d layers; "
                 "at most one a layer", k, n);
    net->segment_start = (int *)mgpu__xrealloc(net->segment_start, (size_t)(n + 1) * sizeof(int));
    net->segment_freed = (unsigned char *)mgpu__xrealloc(net->segment_freed, (size_t)n + 1);
    for (int s = 0; s <= k; s++) net->segment_start[s] = (int)((long)s * n / k);
    memset(net->segment_freed, 0, (size_t)n + 1);
    net->nsegments = k;
}
/* The run whose last layer is layer i, if its activations were freed; else -1. */
static int mgpu__net_freed_segment_ending_at(const mgpu_net *net, int i) {
    for (int s = 0; s < net->nsegments; s++)
        if (net->segment_start[s + 1] - 1 == i && net->segment_freed[s]) return s;
    return -1;
}
/* Run s's forward pass again from its input, which the run before kept
   (or the network's input), for its backward pass. */
static void mgpu__net_recompute_segment(mgpu_net *net, int s) {
    int first = net->segment_start[s], end = net->segment_start[s + 1];
    int scope = mgpu__memory_scope(MGPU_MEMORY_ACTIVATIONS);
    const mgpu_tensor *h = net->layers[first]->input;
    const mgpu_tensor *h_t = first > 0 ? net->layers[first - 1]->copies->output_t : NULL;
    for (int i = first; i < end; i++) {
        mgpu_layer *l = net->layers[i];
        h = mgpu__layer_forward(l, h, h_t, i + 1 < net->nlayers ? net->layers[i + 1] : NULL, MGPU__RECOMPUTE);
        h_t = l->copies->output_t;
    }
    mgpu__memory_scope((mgpu_memory_category)scope);
    net->segment_freed[s] = 0;
}
MGPU_DEF void mgpu_net_free_activations(mgpu_net *net) {
    for (int i = 0; i < net->nlayers; i++) mgpu__layer_free_activations(net->layers[i], i == net->nlayers - 1);
    net->activations_freed = 1;
}
MGPU_DEF void mgpu_net_want_input_grad(mgpu_net *net, int on) {
    MGPU_REQUIRE(net->nlayers > 0, "mgpu_net_want_input_grad: the network has no layers");
    net->layers[0]->need_dinput = on != 0 || net->layers[0]->kind == MGPU_LAYER_BATCHNORM;
}
MGPU_DEF mgpu_tensor *mgpu_net_input_grad(mgpu_net *net) {
    MGPU_REQUIRE(net->nlayers > 0 && net->layers[0]->need_dinput && net->layers[0]->dinput,
                 "mgpu_net_input_grad: no input gradient: call mgpu_net_want_input_grad(net, 1) before the "
                 "backward pass");
    return net->layers[0]->dinput;
}
MGPU_DEF void mgpu_net_checkpoint(mgpu_net *net, int segments) {
    MGPU_REQUIRE(segments >= 1 || segments == MGPU_SEGMENTS_SQRT,
                 "mgpu_net_checkpoint: %d runs; want 1 (one run: no checkpointing) up to the number of layers, or "
                 "MGPU_SEGMENTS_SQRT", segments);
    MGPU_REQUIRE(segments <= net->nlayers,
                 "mgpu_net_checkpoint: %d runs of a network of %d layers; at most one a layer", segments,
                 net->nlayers);
    net->segments = segments;
}

MGPU_DEF mgpu_tensor *mgpu_net_forward(mgpu_net *net, const mgpu_tensor *x) {
    MGPU_REQUIRE(net->nlayers > 0, "mgpu_net_forward: the network has no layers (mgpu_net_add_* adds them)");
    MGPU_REQUIRE(x->device == net->device, "mgpu_net_forward: the input is on %s, the network on %s",
                 x->device->name, net->device->name);
    int scope = mgpu__memory_scope(MGPU_MEMORY_ACTIVATIONS);
    net->activations_freed = 0;
    mgpu__net_weight_copies(net);
    mgpu__net_cut_segments(net);
    /* the last run's activations of the pass before, made again below:
       freed first, so that the runs before it do not meet them */
    for (int i = net->segment_start[net->nsegments - 1]; i < net->nlayers && net->nsegments > 1; i++)
        mgpu__layer_free_activations(net->layers[i], 0);
    const mgpu_tensor *h = x, *h_t = NULL;
    for (int s = 0; s < net->nsegments; s++) {
        for (int i = net->segment_start[s]; i < net->segment_start[s + 1]; i++) {
            mgpu_layer *l = net->layers[i];
            h = mgpu__layer_forward(l, h, h_t, i + 1 < net->nlayers ? net->layers[i + 1] : NULL, net->training);
            h_t = l->copies->output_t;
        }
        if (s + 1 < net->nsegments) mgpu__net_free_segment(net, s, 1);
    }
    mgpu__memory_scope((mgpu_memory_category)scope);
    return (mgpu_tensor *)h;
}

/* ----------------------------------------------------------- backward */
/* Whether a convolution's bias, followed by layer `next`, has no effect on
   the loss. Batch norm in training mode subtracts each channel's batch
   mean, and a bias adds the same number to every value of its channel: the
   mean moves by exactly the bias and the normalised values not at all. So
   the bias's gradient is exactly zero, and summing dy over the batch for it
   (a read of the whole output gradient; 17 of ResNet-18's 20 convolutions)
   would only give zero plus rounding: PyTorch's stem bias gradient in
   tests/fixtures is such noise, below 1e-7 beside weight gradients of 0.03.
   The bias still matters in evaluation mode, through the running mean it
   moved, and SGD's weight decay still shrinks it. */
static int mgpu__bias_cancelled_by(const mgpu_layer *next) {
    return next && next->kind == MGPU_LAYER_BATCHNORM && next->batch_statistics;
}

/* Convolution layer l's backward pass: adds its weight gradient and, with
   with_db, its bias gradient (with accumulate 0: writes them), and writes
   its input gradient to dx, or with add_to_dx adds it there (dx NULL: not
   wanted). dy_t: dy's channels-last copy, when the batch norm after l
   wrote it in place of dy, else NULL. `next` is as below. */
static void mgpu__conv_layer_backward(mgpu_layer *l, const mgpu_tensor *dy, const mgpu_tensor *dy_t,
                                      const mgpu_layer *next, mgpu_tensor *dx, int add_to_dx, int with_db,
                                      int accumulate) {
    mgpu__conv2d_backward(dx, l->weight.grad, with_db && !mgpu__bias_cancelled_by(next) ? l->bias.grad : NULL,
                          dy, dy_t, l->input, l->copies->input_t, l->weight.value,
                          mgpu__network_keeps_weight_copies ? &l->copies->weight_turned_t : NULL, l->stride, l->pad,
                          accumulate, add_to_dx, mgpu__conv_layer_prepared(l, 1, next));
}
/* Batch norm layer l's backward pass; prev: the convolution before it
   whose backward takes its input gradient (with_dx: as there), or NULL.
   When prev reads that gradient through its channels-last copy alone,
   l->copies->dinput_t gets the copy and dx is not written (l->copies->dinput_t is NULL
   otherwise). end: as a residual block's bn2, or NULL. With accumulate 0
   it writes its parameters' gradients, and prev's bias gradient too: the
   0 that l's batch mean makes it (prev's own backward leaves it). */
static void mgpu__batchnorm_layer_backward(mgpu_layer *l, const mgpu_tensor *dy, mgpu_tensor *dx,
                                           const mgpu_layer *prev, int prev_with_dx,
                                           const mgpu__bn_block_end *end, int accumulate) {
    mgpu_tensor *dx_t = NULL;
    if (dx && mgpu__batch_norm_writes_channels_last &&
        mgpu__conv_layer_reads_dy_t_only(prev, prev_with_dx, l)) {
        mgpu_shape x = l->input->shape;
        dx_t = mgpu_ensure(&l->copies->dinput_t, dx->device, mgpu_shape3(x.d[0], x.d[2] * x.d[3], x.d[1]));
    } else {
        mgpu_free(l->copies->dinput_t);
        l->copies->dinput_t = NULL;
    }
    int prev_bias = prev && prev->kind == MGPU_LAYER_CONV && prev->bias.grad && !accumulate;
    mgpu__batchnorm2d_backward(l->name, dx_t ? NULL : dx, dx_t, l->weight.grad, l->bias.grad, dy, l->input,
                               l->weight.value, l->bias.value, l->save_mean, l->save_invstd, l->fuse_relu,
                               accumulate, end, prev_bias ? prev->bias.grad : NULL, l->sync);
}

/* A layer of yours: its backward pass gets its gradients zeroed, the
   parameters' own where they are to be written, else scratch that is then
   added to them; dx_made: dx was made anew (its guard floats are read
   after the pass). */
static void mgpu__own_layer_backward(mgpu_layer *l, const mgpu_tensor *dy, mgpu_tensor *dx, int dx_made,
                                     int accumulate) {
    mgpu_tensor *dweight = l->weight.grad, *dbias = l->bias.grad;
    if (!dx && !dweight && !dbias) return; /* nothing wanted */
    if (accumulate && dweight) dweight = mgpu_ensure(&l->dweight, dweight->device, dweight->shape);
    if (accumulate && dbias) dbias = mgpu_ensure(&l->dbias, dbias->device, dbias->shape);
    mgpu_tensor *written[3] = {dx, dweight, dbias};
    for (int i = 0; i < 3; i++)
        if (written[i]) mgpu_fill(written[i], 0.0f);
    mgpu__own_layer_pass(l, dx, l->input, dy, dweight, dbias, 0);
    if (dx_made && !l->fns->own_loops) mgpu__require_guard_now(l, dx, 1); /* (own loops: each pass) */
    if (dweight != l->weight.grad) mgpu_add_(l->weight.grad, dweight);
    if (dbias != l->bias.grad) mgpu_add_(l->bias.grad, dbias);
}

/* Adds l's parameter gradients (with accumulate 0: writes them) and
   returns dL/d(input), given dy = dL/d(output) and dy_t, its channels-last
   copy if the layer after l wrote one (else NULL; then dy's values were
   not written, and only a convolution takes it); `next` is the layer that
   took l's output (NULL if none), `prev` the one whose output l took
   (NULL if none). The input gradient's channels-last copy, if l wrote
   one, is then in l->copies->dinput_t (else that is NULL). */
static const mgpu_tensor *mgpu__layer_backward_pass(mgpu_layer *l, const mgpu_tensor *dy, const mgpu_tensor *dy_t,
                                                    const mgpu_layer *next, const mgpu_layer *prev, int accumulate) {
    mgpu_device *d = dy->device;
    int dx_made = 0; /* (a layer of yours writes dx itself: with guard floats after it) */
    if (l->need_dinput && l->kind == MGPU_LAYER_OWN)
        dx_made = mgpu__ensure_guarded(&l->dinput, d, l->input->shape);
    mgpu_tensor *dx = l->need_dinput ? mgpu_ensure(&l->dinput, d, l->input->shape) : NULL;
    MGPU_REQUIRE(!dy_t || l->kind == MGPU_LAYER_CONV,
                 "%s: given its output gradient channels-last alone, which only a convolution reads",
                 l->name);
    switch (l->kind) {
    case MGPU_LAYER_CONV:
        mgpu__conv_layer_backward(l, dy, dy_t, next, dx, 0, 1, accumulate);
        break;
    case MGPU_LAYER_BATCHNORM:
        mgpu__batchnorm_layer_backward(l, dy, dx, prev, prev && prev->need_dinput, NULL, accumulate);
        break;
    case MGPU_LAYER_RELU: /* (these three have no parameters: without dx, nothing to do) */
        if (dx) mgpu_relu_backward(dx, dy, l->output);
        break;
    case MGPU_LAYER_AVG_POOL:
        if (dx) mgpu_avg_pool2d_backward(dx, dy, l->kernel);
        break;
    case MGPU_LAYER_RESIDUAL: {
        /* out = relu(main + skip): the gradient of the sum, dsum, goes to
           both paths, and dx is the sum of theirs. Without a shortcut
           the skip path's is dsum itself, written to dx at once, and
           conv1 adds the main path's to it as it writes it: no pass of
           its own for the sum. With one, conv1 writes dx and the shortcut
           adds its own after: its 1x1 window at stride 2 reaches a
           quarter of dx's pixels, so the rest is written once, by conv1,
           not zeroed by the shortcut and read back by conv1. bn2's
           backward computes dsum (the ReLU's mask on dy) as it reads it,
           and adds the shortcut's bias gradient, the sum of dsum that its
           own dbeta is (kernels/batchnorm.h). */
        mgpu_tensor *dsum = dx && !l->shortcut ? dx : mgpu_ensure(&l->dsum, d, l->output->shape);
        mgpu_tensor *g2 = mgpu_ensure(&l->bn2->dinput, d, dsum->shape);
        mgpu__bn_block_end end = {l->output, dsum, l->shortcut ? l->shortcut->bias.grad : NULL};
        mgpu__batchnorm_layer_backward(l->bn2, dy, g2, l->conv2, 1, &end, accumulate);
        const mgpu_tensor *g = mgpu__layer_backward(l->conv2, g2, l->bn2->copies->dinput_t, l->bn2, l->bn1, accumulate);
        /* (conv1's input gradient is the block's: wanted when the block's is) */
        mgpu_tensor *g1 = mgpu_ensure(&l->bn1->dinput, d, g->shape);
        mgpu__batchnorm_layer_backward(l->bn1, g, g1, l->conv1, dx != NULL, NULL, accumulate);
        mgpu__conv_layer_backward(l->conv1, g1, l->bn1->copies->dinput_t, l->bn1, dx, !l->shortcut, 1, accumulate);
        if (l->shortcut) mgpu__conv_layer_backward(l->shortcut, dsum, NULL, NULL, dx, 1, 0, accumulate);
        break;
    }
    case MGPU_LAYER_GLOBAL_AVG_POOL:
        if (dx) mgpu_global_avg_pool_backward(dx, dy);
        break;
    case MGPU_LAYER_LINEAR:
        mgpu_linear_backward(dx, l->weight.grad, l->bias.grad, dy, l->input, l->weight.value, accumulate);
        break;
    case MGPU_LAYER_OWN:
        mgpu__own_layer_backward(l, dy, dx, dx_made, accumulate);
        break;
    }
    return dx;
}

/* (the pass, with the layer named in the libraries' error lines) */
static const mgpu_tensor *mgpu__layer_backward(mgpu_layer *l, const mgpu_tensor *dy, const mgpu_tensor *dy_t,
                                               const mgpu_layer *next, const mgpu_layer *prev, int accumulate) {
    const char *outer = mgpu__layer_enqueuing; /* (a block's, around its own layers) */
    mgpu__layer_enqueuing = l->name;
    const mgpu_tensor *dx = mgpu__layer_backward_pass(l, dy, dy_t, next, prev, accumulate);
    mgpu__layer_enqueuing = outer;
    return dx;
}

/* Refuses a backward pass that cannot run, before any of its work is
   queued (a process that forks to test such a failure cannot use the GPU
   in the child), naming the layer the backward pass would stop at: batch
   norm's backward needs the batch statistics of a forward in training
   mode. */
static void mgpu__require_batch_statistics(const mgpu_layer *l) {
    if (!l) return;
    MGPU_REQUIRE(l->kind != MGPU_LAYER_BATCHNORM || l->batch_statistics,
                 "%s: the last forward ran in evaluation mode; batch norm's backward pass "
                 "needs the batch statistics of a forward in training mode", l->name);
    if (l->kind == MGPU_LAYER_RESIDUAL) {
        mgpu__require_batch_statistics(l->bn2);
        mgpu__require_batch_statistics(l->bn1);
    }
}
static void mgpu__net_require_backward(const mgpu_net *net, const char *who) {
    MGPU_REQUIRE(net->nlayers > 0 && net->layers[net->nlayers - 1]->output,
                 "%s: run mgpu_net_forward first", who);
    MGPU_REQUIRE(!net->activations_freed, "%s: the activations of the last forward pass were freed "
                 "(mgpu_net_free_activations): run mgpu_net_forward again first", who);
    for (int i = net->nlayers - 1; i >= 0; i--) mgpu__require_batch_statistics(net->layers[i]);
}

/* The backward pass of the net's layer i (dy's channels-last copy, if the
   layer after it wrote one, in that layer's dinput_t); accumulate as in
   mgpu__layer_backward. */
static const mgpu_tensor *mgpu__net_layer_backward(mgpu_net *net, int i, const mgpu_tensor *dy, int accumulate) {
    const mgpu_layer *next = i + 1 < net->nlayers ? net->layers[i + 1] : NULL;
    int freed = mgpu__net_freed_segment_ending_at(net, i);
    if (freed >= 0) mgpu__net_recompute_segment(net, freed);
    int scope = mgpu__memory_scope(MGPU_MEMORY_WORKSPACE);
    const mgpu_tensor *dx = mgpu__layer_backward(net->layers[i], dy, next ? next->copies->dinput_t : NULL, next,
                                                 i > 0 ? net->layers[i - 1] : NULL, accumulate);
    mgpu__memory_scope((mgpu_memory_category)scope);
    /* the output gradient layer i read (layer i + 1's input gradient) and
       its parts' scratch are done with: freed, so that the backward pass
       holds the activations' gradients of a layer or two, not of all */
    if (next) mgpu__layer_free_gradients(net->layers[i + 1], 1);
    mgpu__layer_free_gradients(net->layers[i], 0);
    /* a run's activations go as soon as its backward pass is done (the
       last run's but the output: the logits stay valid until the next
       forward pass) */
    for (int s = 0; s < net->nsegments && net->nsegments > 1; s++)
        if (net->segment_start[s] == i) mgpu__net_free_segment(net, s, s + 1 == net->nsegments);
    return dx;
}

/* The whole backward pass: adds every parameter's gradient, or with
   accumulate 0 writes it (a training step, which would zero them first:
   that saves writing zeros to every gradient and reading them back). */
static void mgpu__net_backward(mgpu_net *net, const mgpu_tensor *dlogits, int accumulate) {
    const mgpu_tensor *g = dlogits;
    for (int i = net->nlayers - 1; i >= 0; i--) g = mgpu__net_layer_backward(net, i, g, accumulate);
}
MGPU_DEF void mgpu_net_backward(mgpu_net *net, const mgpu_tensor *dlogits) {
    mgpu__net_require_backward(net, "mgpu_net_backward");
    mgpu__net_backward(net, dlogits, 1);
}

MGPU_DEF void mgpu_net_zero_grad(mgpu_net *net) {
    for (int i = 0; i < net->nparams; i++) net->step_values[i] = net->params[i]->grad;
    mgpu__zero_tensors(net->step_values, net->nparams);
}

/* The top-level layer whose parameters include parameter p (a block's,
   for its parts'). */
static const mgpu_layer *mgpu__param_layer(const mgpu_net *net, int p) {
    int l = 0;
    while (l + 1 < net->nlayers && net->first_param[l + 1] <= p) l++;
    return net->layers[l];
}

/* ---- gradient check (mgpu_net_gradcheck) ---- */
/* L = sum of p_i y_i for the net's output y on x, in double; and in
   *size (if given) the sum of |p_i y_i|, the scale of L's rounding. */
static double mgpu__gradcheck_loss(mgpu_net *net, const mgpu_tensor *x, const float *p, double *size) {
    const mgpu_tensor *y = mgpu_net_forward(net, x);
    float *v = (float *)mgpu__xmalloc(y->numel * sizeof(float));
    mgpu_to_host(y, v);
    double loss = 0, magnitude = 0;
    for (size_t i = 0; i < y->numel; i++) {
        loss += (double)p[i] * v[i];
        magnitude += fabs((double)p[i] * v[i]);
    }
    free(v);
    if (size) *size = magnitude;
    return loss;
}
/* Sets value i of t (on its device) to v. */
static void mgpu__set_value(mgpu_tensor *t, size_t i, float v) {
    mgpu_tensor *one = mgpu__value_view(t, i);
    mgpu_tensor *src = mgpu_from_host(t->device, one->shape, &v);
    mgpu_copy(one, src, 0);
    mgpu_free(src);
    mgpu_free(one);
}
/* The central difference of L in value i of t, step h. */
static double mgpu__gradcheck_slope(mgpu_net *net, const mgpu_tensor *x, const float *p, mgpu_tensor *t, size_t i,
                                    float v, float h) {
    mgpu__set_value(t, i, v + h);
    double up = mgpu__gradcheck_loss(net, x, p, NULL);
    mgpu__set_value(t, i, v - h);
    double down = mgpu__gradcheck_loss(net, x, p, NULL);
    mgpu__set_value(t, i, v);
    return (up - down) / (2.0 * (double)h);
}
MGPU_DEF mgpu_gradcheck_result mgpu_net_gradcheck(mgpu_net *net, const mgpu_tensor *x, int max_values, FILE *report) {
    MGPU_REQUIRE(net && x && net->nlayers > 0 && max_values >= 1,
                 "mgpu_net_gradcheck: want a network with layers, an input and max_values >= 1");
    mgpu__require_device(x, net->device, "mgpu_net_gradcheck");
    mgpu_gradcheck_result r = {0, 0, 0, 0.0};
    mgpu_tensor *x_moved = mgpu_to(x, net->device, 0); /* (the copy whose values move) */
    /* p: fixed draws of a small generator of its own (the library's stays where it was) */
    const mgpu_tensor *y = mgpu_net_forward(net, x_moved);
    float *p = (float *)mgpu__xmalloc(y->numel * sizeof(float));
    uint64_t state = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < y->numel; i++) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        p[i] = (float)((double)(state >> 11) / 9007199254740992.0) * 2.0f - 1.0f;
    }
    /* the backward pass's slopes: dx (the first layer's input gradient, asked for here) and the parameters' */
    mgpu_layer *first = net->layers[0];
    int wanted_dx = first->need_dinput;
    first->need_dinput = 1;
    mgpu_tensor *dy = mgpu_from_host(net->device, y->shape, p);
    mgpu_net_zero_grad(net);
    double size; /* the float outputs' rounding moves L by some float epsilons of it */
    mgpu__gradcheck_loss(net, x_moved, p, &size);
    mgpu_net_backward(net, dy);
    int ntensors = 1 + net->nparams;
    for (int k = 0; k < ntensors; k++) {
        mgpu_tensor *t = k == 0 ? x_moved : net->params[k - 1]->value;
        const mgpu_tensor *grad = k == 0 ? first->dinput : net->params[k - 1]->grad;
        float *values = (float *)mgpu__xmalloc(t->numel * sizeof(float));
        float *slopes = (float *)mgpu__xmalloc(t->numel * sizeof(float));
        mgpu_to_host(t, values);
        mgpu_to_host(grad, slopes);
        size_t tries = t->numel < (size_t)max_values ? t->numel : (size_t)max_values;
        for (size_t j = 0; j < tries; j++) {
            size_t i = tries > 1 ? j * (t->numel - 1) / (tries - 1) : 0;
            /* the step: h, or where the slopes at h and h / 4 disagree (a kink
               within h), h / 4 if it agrees with h / 16 */
            float v = values[i], h = 1e-2f * fmaxf(1.0f, fabsf(v));
            double numeric = mgpu__gradcheck_slope(net, x_moved, p, t, i, v, h), allowed = 0, finer = 0;
            int smooth = 0;
            for (int tries_left = 2; tries_left > 0 && !smooth; tries_left--) {
                double rounding = 8 * FLT_EPSILON * size / h; /* (four times it at h / 4) */
                allowed = 1e-3 + 1e-2 * fabs(numeric) + 5 * rounding;
                finer = mgpu__gradcheck_slope(net, x_moved, p, t, i, v, h / 4);
                smooth = fabs(numeric - finer) <= allowed;
                if (!smooth && tries_left > 1) h /= 4, numeric = finer;
            }
            /* Richardson's extrapolation: a central difference errs by c h^2 + ...,
               so (16 s(h / 4) - s(h)) / 15 leaves out the h^2 term */
            if (smooth) numeric = (16 * finer - numeric) / 15;
            char what[96];
            if (k == 0) snprintf(what, sizeof what, "value %zu of the input x", i);
            else snprintf(what, sizeof what, "value %zu of parameter %d (of layer %s)", i, k - 1,
                          mgpu__param_layer(net, k - 1)->name);
            if (!smooth) { /* the line bends within h / 4 too: a kink */
                r.near_kinks++;
                if (report)
                    fprintf(report, "gradcheck: %s: near a kink (slopes %.6g at step %g, %.6g at %g): not judged\n",
                            what, numeric, h, finer, h / 4);
                continue;
            }
            double error = fabs(slopes[i] - numeric) / allowed;
            r.checked++;
            if (error > r.worst) r.worst = error;
            if (error <= 1.0) continue;
            r.failed++;
            if (report)
                fprintf(report, "gradcheck: %s: backward gives %.6g, central differences %.6g\n", what, slopes[i],
                        numeric);
        }
        free(values);
        free(slopes);
    }
    first->need_dinput = wanted_dx;
    if (report)
        fprintf(report, "gradcheck: %d values checked, %d failed, %d near a kink (worst error %.3g of its tolerance)\n",
                r.checked, r.failed, r.near_kinks, r.worst);
    free(p);
    mgpu_free(dy);
    mgpu_free(x_moved);
    return r;
}
MGPU_DEF void mgpu_net_set_training(mgpu_net *net, int training) { net->training = training; }

/* One update of every parameter: a few launches, not one a tensor. */
MGPU_DEF void mgpu_net_sgd(mgpu_net *net, float lr, float momentum, float weight_decay) {
    mgpu_tensor **values = net->step_values;
    const mgpu_tensor **grads = net->step_grads;
    for (int i = 0; i < net->nparams; i++) {
        mgpu_param *p = net->params[i];
        if (momentum != 0.0f && !net->momentum[i]) {
            int scope = mgpu__memory_scope(MGPU_MEMORY_OPTIMIZER);
            net->momentum[i] = mgpu_zeros(net->device, p->value->shape);
            mgpu__memory_scope((mgpu_memory_category)scope);
        }
        values[i] = p->value;
        grads[i] = p->grad;
    }
    mgpu__sgd_tensors("mgpu_net_sgd", values, grads, momentum != 0.0f ? net->momentum : NULL,
                      net->nparams, lr, momentum, weight_decay, net->steps == 0);
    net->steps++;
    net->changes++; /* (a wrapper's own step then says that it made this change itself) */
}

static int mgpu__net_has_momentum(const mgpu_net *net) { return net->nparams > 0 && net->momentum[0]; }

/* Gives net its optimizer's state tensors (their values still to be
   written) where `present`, else none: momentum buffers, and with Adam
   the second moments. The optimizer makes them all at its first step
   that uses them, so a net has all or none. */
static void mgpu__net_keep_momentum(mgpu_net *net, int present) {
    for (int p = 0; p < net->nparams; p++) {
        mgpu_tensor **state[2] = {&net->momentum[p], &net->second_moment[p]};
        for (int k = 0; k < 2; k++) {
            if (present && (k == 0 || net->adam)) {
                int scope = mgpu__memory_scope(MGPU_MEMORY_OPTIMIZER);
                mgpu_ensure(state[k], net->device, net->params[p]->value->shape);
                mgpu__memory_scope((mgpu_memory_category)scope);
            } else {
                mgpu_free(*state[k]);
                *state[k] = NULL;
            }
        }
    }
}

/* dst takes src's optimizer state: its count of steps, its momentum
   buffers (and Adam's second moments). */
static void mgpu__net_copy_sgd_state(mgpu_net *dst, const mgpu_net *src) {
    dst->steps = src->steps;
    mgpu__net_keep_momentum(dst, mgpu__net_has_momentum(src));
    for (int p = 0; p < src->nparams && src->momentum[p]; p++) {
        mgpu_copy(dst->momentum[p], src->momentum[p], 0);
        if (src->second_moment[p]) mgpu_copy(dst->second_moment[p], src->second_moment[p], 0);
    }
}



MGPU_DEF void mgpu_net_use_adam(mgpu_net *net, float beta1, float beta2, float eps, int decoupled) {
    MGPU_REQUIRE(beta1 >= 0.0f && beta1 < 1.0f && beta2 >= 0.0f && beta2 < 1.0f && eps > 0.0f && isfinite(eps),
                 "mgpu_net_use_adam: betas %g and %g, eps %g: the betas must be in [0, 1), eps above 0",
                 (double)beta1, (double)beta2, (double)eps);
    MGPU_REQUIRE(net->steps == 0 || net->adam,
                 "mgpu_net_use_adam: the network has taken %d SGD steps; choose Adam before the first step (its "
                 "bias corrections count the steps)", net->steps);
    net->adam = 1;
    net->decoupled = decoupled != 0;
    net->beta1 = beta1, net->beta2 = beta2, net->eps = eps;
}

/* Adam's (or AdamW's, as net says) step t = net->steps + 1 of count
   tensors with their gradients and moments, MGPU__LIST_MAX to a launch
   (kernels/adam.h). */
static void mgpu__adam_tensors(const mgpu_net *net, mgpu_tensor *const *params, const mgpu_tensor *const *grads,
                               mgpu_tensor *const *m, mgpu_tensor *const *v, int count, float lr, float weight_decay) {
    const char *op = net->decoupled ? "AdamW" : "Adam";
    MGPU_REQUIRE(lr >= 0.0f && isfinite(lr) && weight_decay >= 0.0f && isfinite(weight_decay),
                 "%s: learning rate %g, weight decay %g: each must be a finite 0 or more", op, (double)lr,
                 (double)weight_decay);
    double t = (double)net->steps + 1.0;
    mgpu__adam_args a;
    memset(&a, 0, sizeof a);
    a.one_minus_beta1 = (float)(1.0 - (double)net->beta1);
    a.beta2 = net->beta2;
    a.one_minus_beta2 = (float)(1.0 - (double)net->beta2);
    a.eps = net->eps;
    a.weight_decay = weight_decay;
    a.decay = (float)(1.0 - (double)lr * (double)weight_decay);
    a.step_size = (float)((double)lr / (1.0 - pow((double)net->beta1, t)));
    a.correction2_sqrt = (float)sqrt(1.0 - pow((double)net->beta2, t));
    a.decoupled = net->decoupled;
    for (int i = 0; i < count; i++) {
        mgpu_tensor *state[3] = {params[i], m[i], v[i]};
        for (int k = 0; k < 3; k++) {
            mgpu__require_device(state[k], params[0]->device, op);
            mgpu__require_same_shape(state[k], grads[i], op);
            mgpu__before_write(state[k]);
        }
        int at = a.list.count;
        a.param[at] = params[i]->data;
        a.grad[at] = grads[i]->data;
        a.m[at] = m[i]->data;
        a.v[at] = v[i]->data;
        if (mgpu__list_add(&a.list, params[i]->numel) || i == count - 1) {
            mgpu__launch_on(&params[0]->device->queue[0], net->decoupled ? "adamw" : "adam", mgpu__adam_cpu,
                            MGPU__CUDA_FN(mgpu__adam_cuda), &a, sizeof a);
            a.list.count = 0;
        }
    }
}

/* Adam's step of every parameter of the net. */
static void mgpu__net_adam(mgpu_net *net, float lr, float weight_decay) {
    for (int i = 0; i < net->nparams; i++) {
        mgpu_param *p = net->params[i];
        mgpu_tensor **moments[2] = {&net->momentum[i], &net->second_moment[i]};
        for (int k = 0; k < 2; k++)
            if (!*moments[k]) {
                int scope = mgpu__memory_scope(MGPU_MEMORY_OPTIMIZER);
                *moments[k] = mgpu_zeros(net->device, p->value->shape);
                mgpu__memory_scope((mgpu_memory_category)scope);
            }
        net->step_values[i] = p->value;
        net->step_grads[i] = p->grad;
    }
    mgpu__adam_tensors(net, net->step_values, net->step_grads, net->momentum, net->second_moment, net->nparams, lr,
                       weight_decay);
    net->steps++;
    net->changes++;
}

MGPU_DEF void mgpu_net_step(mgpu_net *net, float lr, float momentum, float weight_decay) {
    if (!net->adam) {
        mgpu_net_sgd(net, lr, momentum, weight_decay);
        return;
    }
    MGPU_REQUIRE(momentum == 0.0f, "%s: momentum %g, but Adam keeps moments of its own (betas %g, %g): give 0",
                 net->decoupled ? "AdamW" : "Adam", (double)momentum, (double)net->beta1, (double)net->beta2);
    mgpu__net_adam(net, lr, weight_decay);
}

/* A caller's argument `what` is alive and on the net's device: an error
   names the argument and the caller, not an operation deep inside. */
static void mgpu__require_net_argument(const char *who, const char *what, const mgpu_tensor *t, const mgpu_net *net) {
    mgpu__require_alive(t, who);
    MGPU_REQUIRE(t->device == net->device, "%s: %s is on %s, the network on %s; copy it first with mgpu_to", who,
                 what, t->device->name, net->device->name);
}
/* A caller's loss_sum holds one value on the net's device (or is NULL). */
static void mgpu__require_loss_sum(const char *who, const mgpu_tensor *loss_sum, const mgpu_net *net) {
    char s[64];
    if (!loss_sum) return;
    mgpu__require_net_argument(who, "loss_sum", loss_sum, net);
    MGPU_REQUIRE(loss_sum->numel == 1, "%s: loss_sum has shape %s; it must hold one value, [1]", who,
                 mgpu_shape_str(loss_sum->shape, s, sizeof s));
}
/* The loss's gradient with respect to the logits (and the loss, added to
   loss_sum when given): where every backward pass starts. For messages:
   op, the caller's function, and first_row, where these rows start in its
   batch (mgpu__ce_prepare). */
static const mgpu_tensor *mgpu__net_loss_grad(mgpu_net *net, const mgpu_tensor *logits,
                                              const mgpu_tensor *labels, float scale,
                                              mgpu_tensor *loss_sum, const char *op, int first_row) {
    int n = logits->shape.d[0];
    mgpu_ensure(&net->losses, net->device, mgpu_shape1(n));
    mgpu_ensure(&net->dlogits, net->device, logits->shape);
    mgpu__cross_entropy_forward(op, first_row, net->losses, logits, labels);
    if (loss_sum) {
        mgpu_ensure(&net->loss_sum, net->device, mgpu_shape1(1));
        mgpu_sum(net->loss_sum, net->losses);
        mgpu_add_(loss_sum, net->loss_sum);
    }
    mgpu__cross_entropy_backward(op, first_row, net->dlogits, logits, labels, scale);
    return net->dlogits;
}

MGPU_DEF void mgpu_net_loss_backward(mgpu_net *net, const mgpu_tensor *logits,
                                     const mgpu_tensor *labels, float scale,
                                     mgpu_tensor *loss_sum) {
    mgpu__net_require_backward(net, "mgpu_net_loss_backward");
    mgpu__require_net_argument("mgpu_net_loss_backward", "logits", logits, net);
    mgpu__require_net_argument("mgpu_net_loss_backward", "labels", labels, net);
    mgpu__require_loss_sum("mgpu_net_loss_backward", loss_sum, net);
    mgpu_net_backward(net, mgpu__net_loss_grad(net, logits, labels, scale, loss_sum, "mgpu_net_loss_backward", 0));
}

MGPU_DEF void mgpu_net_train_step(mgpu_net *net, const mgpu_tensor *x, const mgpu_tensor *labels,
                                  float lr, float momentum, float weight_decay,
                                  mgpu_tensor *loss_sum) {
    mgpu__require_net_argument("mgpu_net_train_step", "x", x, net);
    mgpu__require_net_argument("mgpu_net_train_step", "labels", labels, net);
    mgpu__require_loss_sum("mgpu_net_train_step", loss_sum, net);
    mgpu__require_sgd_settings("mgpu_net_train_step", lr, momentum, weight_decay);
    mgpu_tensor *logits = mgpu_net_forward(net, x);
    mgpu__net_require_backward(net, "mgpu_net_train_step");
    mgpu__net_backward(net, mgpu__net_loss_grad(net, logits, labels, 1.0f / (float)x->shape.d[0], loss_sum,
                                                "mgpu_net_train_step", 0), 0);
    mgpu_net_step(net, lr, momentum, weight_decay);
}

/* ------------------------------------------------------------ access */
MGPU_DEF int mgpu_net_num_params(const mgpu_net *net) { return net->nparams; }
MGPU_DEF mgpu_param *mgpu_net_param(mgpu_net *net, int i) {
    MGPU_REQUIRE(i >= 0 && i < net->nparams, "mgpu_net_param: index %d of %d", i, net->nparams);
    net->changes++;
    return net->params[i];
}
MGPU_DEF int mgpu_net_num_buffers(const mgpu_net *net) { return net->nbuffers; }
MGPU_DEF mgpu_tensor *mgpu_net_buffer(mgpu_net *net, int i) {
    MGPU_REQUIRE(i >= 0 && i < net->nbuffers, "mgpu_net_buffer: index %d of %d", i, net->nbuffers);
    net->changes++;
    return *net->buffers[i];
}
MGPU_DEF size_t mgpu_net_num_weights(const mgpu_net *net) {
    size_t n = 0;
    for (int i = 0; i < net->nparams; i++) n += net->params[i]->value->numel;
    return n;
}

/* ---------------------------------------------------------- replicas */
static mgpu_tensor *mgpu__clone(const mgpu_tensor *t, mgpu_device *d) {
    return t ? mgpu_to(t, d, 1) : NULL;
}

/* A copy of layer src on device d, with copies of its parameters and
   buffers, or with `share`, src's own (the same tensors: a pipeline
   stage's micro-batch slots); its activations are its own either way. */
static mgpu_layer *mgpu__layer_clone(const mgpu_layer *src, mgpu_device *d, int share) {
    if (!src) return NULL;
    mgpu_layer *l = (mgpu_layer *)mgpu__xcalloc(1, sizeof *l);
    *l = *src; /* the settings */
    l->copies = (struct mgpu__layer_copies *)mgpu__xcalloc(1, sizeof *l->copies);
    l->copies->input_from_batch_norm = src->copies->input_from_batch_norm;
    l->input = NULL;
    l->output = l->dinput = l->dsum = NULL;
    l->dweight = l->dbias = NULL;
    if (!share) {
        if (src->weight.value) l->weight = mgpu__param_new(mgpu__clone(src->weight.value, d));
        if (src->bias.value) l->bias = mgpu__param_new(mgpu__clone(src->bias.value, d));
        l->running_mean = mgpu__clone(src->running_mean, d);
        l->running_var = mgpu__clone(src->running_var, d);
    }
    l->save_mean = mgpu__clone(src->save_mean, d);
    l->save_invstd = mgpu__clone(src->save_invstd, d);
    l->conv1 = mgpu__layer_clone(src->conv1, d, share);
    l->bn1 = mgpu__layer_clone(src->bn1, d, share);
    l->conv2 = mgpu__layer_clone(src->conv2, d, share);
    l->bn2 = mgpu__layer_clone(src->bn2, d, share);
    l->shortcut = mgpu__layer_clone(src->shortcut, d, share);
    return l;
}

/* A new network on dev with net's settings (its mode, checkpointing and
   optimizer), and no layers yet. */
static mgpu_net *mgpu__net_like(const mgpu_net *net, mgpu_device *dev) {
    mgpu_net *copy = mgpu_net_new(dev);
    copy->training = net->training;
    copy->segments = net->segments;
    copy->adam = net->adam, copy->decoupled = net->decoupled;
    copy->beta1 = net->beta1, copy->beta2 = net->beta2, copy->eps = net->eps;
    return copy;
}

MGPU_DEF mgpu_net *mgpu_net_replicate(const mgpu_net *net, mgpu_device *dev) {
    mgpu_net *copy = mgpu__net_like(net, dev);
    for (int i = 0; i < net->nlayers; i++) {
        mgpu__require_own_loops_on_cpu(net->layers[i], dev, "mgpu_net_replicate");
        mgpu__net_add(copy, mgpu__layer_clone(net->layers[i], dev, 0));
    }
    return copy;
}

MGPU_DEF void mgpu_net_copy_params(mgpu_net *dst, const mgpu_net *src, int with_buffers) {
    MGPU_REQUIRE(dst->nparams == src->nparams && dst->nbuffers == src->nbuffers,
                 "mgpu_net_copy_params: the networks differ (%d and %d parameters)", dst->nparams,
                 src->nparams);
    dst->changes++;
    for (int i = 0; i < src->nparams; i++) mgpu_copy(dst->params[i]->value, src->params[i]->value, 1);
    if (with_buffers)
        for (int i = 0; i < src->nbuffers; i++) mgpu_copy(*dst->buffers[i], *src->buffers[i], 1);
}

/* Frees layer l, and its parameters and buffers unless they are another
   layer's (shared: mgpu__layer_clone's). */
static void mgpu__layer_free(mgpu_layer *l, int shared) {
    if (!l) return;
    if (!shared) {
        mgpu_free(l->weight.value);
        mgpu_free(l->weight.grad);
        mgpu_free(l->bias.value);
        mgpu_free(l->bias.grad);
        mgpu_free(l->running_mean);
        mgpu_free(l->running_var);
    }
    mgpu_free(l->save_mean);
    mgpu_free(l->save_invstd);
    mgpu_free(l->output);
    mgpu_free(l->dinput);
    mgpu_free(l->dsum);
    mgpu_free(l->copies->own_input_t);
    mgpu_free(l->copies->output_t);
    mgpu_free(l->copies->dinput_t);
    mgpu_free(l->copies->weight_t);
    mgpu_free(l->copies->weight_turned_t);
    free(l->copies);
    mgpu_free(l->dweight);
    mgpu_free(l->dbias);
    mgpu_layer *parts[5] = {l->conv1, l->bn1, l->conv2, l->bn2, l->shortcut};
    for (int i = 0; i < 5; i++) mgpu__layer_free(parts[i], shared);
    free(l);
}

MGPU_DEF void mgpu_net_free(mgpu_net *net) {
    if (!net) return;
    MGPU_REQUIRE(!net->wrapped, "mgpu_net_free: %s still holds this network; free it first (%s)",
                 mgpu__holder(net, 0), mgpu__holder(net, 2));
    for (int i = 0; i < net->nlayers; i++) mgpu__layer_free(net->layers[i], net->shares_params);
    for (int i = 0; i < net->nparams; i++) {
        mgpu_free(net->momentum[i]);
        mgpu_free(net->second_moment[i]);
    }
    free(net->second_moment);
    free(net->layers);
    free(net->first_param);
    free(net->params);
    free(net->buffers);
    free(net->momentum);
    free(net->segment_start);
    free(net->segment_freed);
    free(net->step_values);
    free((void *)net->step_grads);
    mgpu_free(net->losses);
    mgpu_free(net->dlogits);
    mgpu_free(net->loss_sum);
    free(net);
}

/* -------------------------------------------------------- evaluation */
/* The number of samples of data that forward classifies right. */
static double mgpu__count_correct(mgpu_forward_fn forward, void *model, mgpu_device *dev,
                                  const mgpu_dataset *data, int batch_size) {
    mgpu_loader *loader = mgpu_loader_new(data, batch_size, 0, 0);
    mgpu_loader_start_epoch(loader, 0);
    mgpu_tensor *correct = mgpu_zeros(dev, mgpu_shape1(1));
    mgpu_tensor *count = mgpu_empty(dev, mgpu_shape1(1));
    mgpu_batch b;
    while (mgpu_loader_next(loader, &b)) {
        mgpu_tensor *x = mgpu_to(b.x, dev, 1);
        mgpu_tensor *y = mgpu_to(b.y, dev, 1);
        mgpu_accuracy_count(count, forward(model, x), y);
        mgpu_add_(correct, count); /* counted on the device: one read at the end */
        mgpu_free(x);
        mgpu_free(y);
    }
    double right = mgpu_item(correct, 0);
    mgpu_free(correct);
    mgpu_free(count);
    mgpu_loader_free(loader);
    return right;
}
MGPU_DEF double mgpu_evaluate_accuracy(mgpu_forward_fn forward, void *model, mgpu_device *dev,
                                       const mgpu_dataset *data, int batch_size) {
    return mgpu__count_correct(forward, model, dev, data, batch_size) / (double)data->n;
}

static mgpu_tensor *mgpu__net_forward_fn(void *net, const mgpu_tensor *x) {
    return mgpu_net_forward((mgpu_net *)net, x);
}

/* The net's right answers over data, in evaluation mode. */
static double mgpu__net_count_correct(mgpu_net *net, const mgpu_dataset *data, int batch_size) {
    int was_training = net->training;
    net->training = 0;
    double right = mgpu__count_correct(mgpu__net_forward_fn, net, net->device, data, batch_size);
    net->training = was_training;
    return right;
}
MGPU_DEF double mgpu_net_evaluate_accuracy(mgpu_net *net, const mgpu_dataset *data, int batch_size) {
    return mgpu__net_count_correct(net, data, batch_size) / (double)data->n;
}

/* ---------------------------------------------------- save and load */
/* Two kinds of file, one layout: mgpu_net_save's (the parameters and
   buffers) and a training checkpoint's (mgpu_checkpoint_save: those, the
   momentum buffers and the training's state). */
typedef struct mgpu__net_file_kind {
    const char *magic; /* 8 characters */
    uint32_t version;  /* of the layout this library writes and reads */
    const char *name;  /* for messages: "cannot read the <name>" */
    const char *holds; /* what a file of this kind is, for a load of the other kind */
    const char *older; /* why an older version is refused, or "" */
} mgpu__net_file_kind;
static const mgpu__net_file_kind mgpu__net_files[2] = {
    {"MGPUNET1", 1, "checkpoint", "a network's parameters and buffers (mgpu_net_save): load it with mgpu_net_load",
     ""},
    {"MGPUCKP1", 2, "training checkpoint",
     "a training checkpoint (mgpu_checkpoint_save): load it with mgpu_checkpoint_load",
     " (an older mgpu's, without the training's settings that a resume must match: delete the file to start "
     "afresh)"},
};
/* magic, version and tensor count */
#define MGPU__NET_HEADER_BYTES (8 + 2 * sizeof(uint32_t))
/* A training checkpoint's state, after the header: the info, the
   network's count of steps and the generator's place, then a checksum of
   the file up to it, so that the info can be read and trusted without the
   tensors after it (mgpu_checkpoint_read_info). Numbers of 8 bytes and
   names of whole words: nothing to pad. */
typedef struct mgpu__train_state {
    uint64_t epoch, batch, step, world;
    char model[MGPU_SETTING_BYTES];
    uint64_t batch_size, samples, data;
    char optimizer[MGPU_SETTING_BYTES];
    double lr, momentum, weight_decay; /* (floats, held exactly) */
    uint64_t seed;
    char conv[MGPU_SETTING_BYTES];
    uint64_t net_steps, generator_seed, generator_offset;
    uint64_t checksum;
} mgpu__train_state;

/* The tensors of a file, in order: parameters, then buffers; in a
   training checkpoint, then each parameter's momentum buffer, a slot that
   is empty (NULL) until a step with momentum makes it. */
/* The tensors a file holds: the parameters, the buffers, and in a
   training checkpoint the optimizer's state, a momentum slot a parameter
   (Adam's first moments) and with Adam a second moment's. */
static int mgpu__net_num_saved(const mgpu_net *net, int training) {
    return net->nparams + net->nbuffers + (training ? (1 + net->adam) * net->nparams : 0);
}
static mgpu_tensor **mgpu__net_saved(const mgpu_net *net, int i) {
    int np = net->nparams, nb = net->nbuffers;
    return i < np ? &net->params[i]->value : i < np + nb ? net->buffers[i - np]
         : i < 2 * np + nb ? &net->momentum[i - np - nb] : &net->second_moment[i - 2 * np - nb];
}
/* The tensor whose shape slot i has: an optimizer's has its parameter's. */
static const mgpu_tensor *mgpu__net_saved_like(const mgpu_net *net, int i) {
    int state = i - net->nparams - net->nbuffers;
    return state >= 0 ? net->params[state % net->nparams]->value : *mgpu__net_saved(net, i);
}

/* What tensor i of the file's count is, for messages: "tensor 14 of 22
   (linear4's weight)", "tensor 20 of 22 (block2.bn2's running_mean)",
   "tensor 30 of 36 (linear4's weight's momentum)". */
static const char *mgpu__net_saved_name(const mgpu_net *net, int i, int count, char *buf, size_t size) {
    int np = net->nparams, nb = net->nbuffers, momentum = i >= np + nb, second = i >= 2 * np + nb;
    const void *slot = i < np ? (const void *)net->params[i]
                     : momentum ? (const void *)net->params[(i - np - nb) % np] : (const void *)net->buffers[i - np];
    snprintf(buf, size, "tensor %d of %d", i, count);
    /* a depth-first walk: each layer, then a block's parts (at most 5 a layer) */
    const mgpu_layer **stack = (const mgpu_layer **)mgpu__xmalloc((5 * net->nlayers + 1) * sizeof *stack);
    int n = 0;
    for (int k = net->nlayers - 1; k >= 0; k--) stack[n++] = net->layers[k];
    while (n > 0) {
        const mgpu_layer *l = stack[--n];
        const char *what = slot == &l->weight ? "weight" : slot == &l->bias ? "bias"
                         : slot == &l->running_mean ? "running_mean" : slot == &l->running_var ? "running_var" : NULL;
        if (what) {
            snprintf(buf, size, "tensor %d of %d (%s's %s%s)", i, count, l->name, what,
                     second ? "'s second moment" : momentum ? "'s momentum" : "");
            break;
        }
        const mgpu_layer *parts[5] = {l->shortcut, l->bn2, l->bn1, l->conv2, l->conv1};
        for (int k = 0; k < 5; k++)
            if (parts[k]) stack[n++] = parts[k];
    }
    free(stack);
    return buf;
}

/* The most bytes a file for the network can have: magic, version and
   count, a training checkpoint's state, then a shape and the values of
   each tensor (every momentum slot full), then the checksum. */
static size_t mgpu__net_file_bytes(const mgpu_net *net, int training) {
    size_t bytes = MGPU__NET_HEADER_BYTES + (training ? sizeof(mgpu__train_state) : 0) + sizeof(uint64_t);
    for (int i = 0; i < mgpu__net_num_saved(net, training); i++)
        bytes += (1 + MGPU_MAX_DIMS) * sizeof(uint32_t) + mgpu__net_saved_like(net, i)->numel * sizeof(float);
    return bytes;
}

static int mgpu__write_all(FILE *f, const void *data, size_t n, uint64_t *hash) {
    *hash = mgpu__fnv1a(*hash, data, n);
    return fwrite(data, 1, n, f) == n;
}

/* Writes the network's file, a training checkpoint when state is given
   (its checksum is the writer's to fill), else mgpu_net_save's. An empty
   momentum slot is written as a shape of 0 dimensions and no values. */
static void mgpu__net_write(const mgpu_net *net, const char *path, const mgpu__train_state *state) {
    int training = state != NULL, count = mgpu__net_num_saved(net, training);
    const mgpu__net_file_kind *kind = &mgpu__net_files[training];
    /* Not over what is not a file: a FIFO, say, would be replaced. */
    struct stat st;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode))
        mgpu_fatal("%s: cannot write the %s (not a regular file)", path, kind->name);
    /* Whole or not at all: a full disk leaves the checkpoint before it. */
    mgpu__whole_file w;
    FILE *f = mgpu__whole_file_open(&w, path);
    if (!f) mgpu_fatal("%s: cannot open for writing (%s)", path, strerror(errno));
    uint64_t hash = MGPU__FNV_OFFSET;
    uint32_t header[2] = {kind->version, (uint32_t)count};
    int written = mgpu__write_all(f, kind->magic, 8, &hash);
    written &= mgpu__write_all(f, header, sizeof header, &hash);
    if (training) {
        mgpu__train_state checked = *state;
        written &= mgpu__write_all(f, &checked, offsetof(mgpu__train_state, checksum), &hash);
        checked.checksum = hash;
        written &= mgpu__write_all(f, &checked.checksum, sizeof checked.checksum, &hash);
    }
    for (int i = 0; i < count && written; i++) {
        const mgpu_tensor *t = *mgpu__net_saved(net, i);
        uint32_t shape[1 + MGPU_MAX_DIMS] = {0};
        if (t) {
            shape[0] = (uint32_t)t->shape.ndim;
            for (int k = 0; k < MGPU_MAX_DIMS; k++) shape[1 + k] = (uint32_t)t->shape.d[k];
        }
        written &= mgpu__write_all(f, shape, sizeof shape, &hash);
        if (!t) continue;
        float *values = (float *)mgpu__xmalloc(t->numel * sizeof(float));
        mgpu_to_host(t, values);
        written &= mgpu__write_all(f, values, t->numel * sizeof(float), &hash);
        free(values);
    }
    written &= fwrite(&hash, sizeof hash, 1, f) == 1;
    /* On the disk before the rename: a crash just after it must find the
       new file whole, not a name for blocks that were never written. */
    written = written && fflush(f) == 0 && fsync(fileno(f)) == 0;
    int error = mgpu__whole_file_close(&w, !written);
    if (error) mgpu_fatal("%s: cannot write the %s (%s)", path, kind->name, strerror(error));
}

/* The first `most` bytes of the file at path, of the kind (all of it
   when it is shorter: *readable), and its size in *total. What it is, is
   asked before it is opened: opening a FIFO would wait for a writer. */
static unsigned char *mgpu__net_file_read(const char *path, const mgpu__net_file_kind *kind, size_t most,
                                          size_t *readable, size_t *total) {
    struct stat st;
    if (stat(path, &st) != 0) mgpu_fatal("%s: cannot open the %s (%s)", path, kind->name, strerror(errno));
    if (!S_ISREG(st.st_mode)) mgpu_fatal("%s: cannot read the %s (not a regular file)", path, kind->name);
    FILE *f = fopen(path, "rb");
    if (!f) mgpu_fatal("%s: cannot open the %s (%s)", path, kind->name, strerror(errno));
    *total = (size_t)st.st_size;
    *readable = *total < most ? *total : most;
    unsigned char *bytes = (unsigned char *)mgpu__xmalloc(*readable);
    if (fread(bytes, 1, *readable, f) != *readable)
        mgpu_fatal("%s: cannot read the %s (%s)", path, kind->name, strerror(errno));
    fclose(f);
    return bytes;
}

/* Checks how the file's bytes begin: its kind, its version and, in a
   training checkpoint, the state and its checksum (into *state). Returns
   the count of tensors the header gives; *at: where they start. */
static uint32_t mgpu__net_file_head(const char *path, int training, const unsigned char *bytes, size_t readable,
                                    size_t total, mgpu__train_state *state, size_t *at) {
    const mgpu__net_file_kind *kind = &mgpu__net_files[training], *other = &mgpu__net_files[!training];
    if (total == 0) mgpu_fatal("%s: empty (0 bytes), not an mgpu %s", path, kind->name);
    if (readable >= 8 && memcmp(bytes, other->magic, 8) == 0) mgpu_fatal("%s: holds %s", path, other->holds);
    if (readable < 8 || memcmp(bytes, kind->magic, 8) != 0)
        mgpu_fatal("%s: not an mgpu %s (no \"%s\" header)", path, kind->name, kind->magic);
    if (readable < MGPU__NET_HEADER_BYTES) mgpu_fatal("%s: truncated in the header", path);
    uint32_t header[2];
    memcpy(header, bytes + 8, sizeof header);
    if (header[0] != kind->version)
        mgpu_fatal("%s: %s version %u, this library reads version %u%s", path, kind->name, header[0],
                   kind->version, header[0] < kind->version ? kind->older : "");
    *at = MGPU__NET_HEADER_BYTES;
    if (training) {
        if (readable - *at < sizeof *state) mgpu_fatal("%s: truncated in the training state", path);
        memcpy(state, bytes + *at, sizeof *state);
        *at += sizeof *state;
        if (state->checksum != mgpu__fnv1a(MGPU__FNV_OFFSET, bytes, *at - sizeof state->checksum))
            mgpu_fatal("%s: checksum mismatch in the training state (the file is damaged)", path);
    }
    return header[1];
}

/* Reads the network's file into net, a training checkpoint when state is
   given (which gets its state), else mgpu_net_save's. Everything is
   checked before the network is touched. */
static void mgpu__net_read(mgpu_net *net, const char *path, mgpu__train_state *state) {
    int training = state != NULL, count = mgpu__net_num_saved(net, training);
    const mgpu__net_file_kind *kind = &mgpu__net_files[training];
    /* Only as many bytes as the network's file can have: a longer file is
       an error below, and need not fit in memory to be one. */
    size_t readable, total, at;
    unsigned char *bytes = mgpu__net_file_read(path, kind, mgpu__net_file_bytes(net, training), &readable, &total);
    uint32_t held = mgpu__net_file_head(path, training, bytes, readable, total, state, &at);
    if ((int)held != count)
        mgpu_fatal("%s: holds %u tensors, the network has %d (another network's %s?)", path, held, count,
                   kind->name);
    /* where each tensor's values start; 0 for an empty momentum slot
       (values never start at 0: the header comes first) */
    size_t *offsets = (size_t *)mgpu__xcalloc((size_t)count, sizeof(size_t));
    for (int i = 0; i < count; i++) {
        const mgpu_tensor *t = mgpu__net_saved_like(net, i);
        uint32_t shape[1 + MGPU_MAX_DIMS];
        char name[160];
        if (sizeof shape > readable - at)
            mgpu_fatal("%s: truncated in %s", path, mgpu__net_saved_name(net, i, count, name, sizeof name));
        memcpy(shape, bytes + at, sizeof shape);
        at += sizeof shape;
        if (shape[0] == 0 && i >= net->nparams + net->nbuffers) continue; /* an empty momentum slot */
        /* (the dimensions past ndim, always 1, are the checksum's to check) */
        int same = shape[0] == (uint32_t)t->shape.ndim;
        for (int k = 0; k < t->shape.ndim && same; k++) same = shape[1 + k] == (uint32_t)t->shape.d[k];
        if (!same) {
            char want[64], got[64] = "[";
            for (uint32_t k = 0; k < shape[0] && k < MGPU_MAX_DIMS; k++)
                snprintf(got + strlen(got), sizeof got - strlen(got), "%s%u", k ? ", " : "", shape[1 + k]);
            strcat(got, shape[0] > MGPU_MAX_DIMS ? ", ...]" : "]");
            mgpu_fatal("%s: %s has shape %s, the network's is %s", path,
                       mgpu__net_saved_name(net, i, count, name, sizeof name), got,
                       mgpu_shape_str(t->shape, want, sizeof want));
        }
        offsets[i] = at;
        if (t->numel * sizeof(float) > readable - at)
            mgpu_fatal("%s: truncated in %s", path, mgpu__net_saved_name(net, i, count, name, sizeof name));
        at += t->numel * sizeof(float);
    }
    /* (the bounds are the buffer's, `readable` bytes; `total`, the file's, is for messages) */
    const size_t trailer = sizeof(uint64_t);
    if (readable - at < trailer) mgpu_fatal("%s: truncated in the checksum at its end", path);
    if (total - at > trailer)
        mgpu_fatal("%s: %zu bytes after the last tensor, expected %zu (damaged file)", path,
                   total - at, trailer);
    uint64_t stored;
    memcpy(&stored, bytes + at, sizeof stored);
    if (stored != mgpu__fnv1a(MGPU__FNV_OFFSET, bytes, at))
        mgpu_fatal("%s: checksum mismatch (the file is damaged)", path);
    net->changes++;
    for (int i = 0; i < count; i++) {
        mgpu_tensor **slot = mgpu__net_saved(net, i);
        if (!offsets[i]) { /* as the file has it: no momentum yet */
            mgpu_free(*slot);
            *slot = NULL;
            continue;
        }
        if (!*slot) *slot = mgpu_empty(net->device, mgpu__net_saved_like(net, i)->shape);
        mgpu_tensor *host = mgpu_from_host(mgpu_cpu(), (*slot)->shape, (const float *)(bytes + offsets[i]));
        mgpu_copy(*slot, host, 0);
        mgpu_free(host);
    }
    free(offsets);
    free(bytes);
}

MGPU_DEF void mgpu_net_save(const mgpu_net *net, const char *path) { mgpu__net_write(net, path, NULL); }
MGPU_DEF void mgpu_net_load(mgpu_net *net, const char *path) { mgpu__net_read(net, path, NULL); }

/* ---- a training's settings and checkpoint */
/* v in the fewest digits that read back as v: 0.1f is "0.1", not
   "0.100000001", and two floats that differ are never written alike. */
static const char *mgpu__float_str(float v, char *buf, size_t size) {
    for (int digits = 1; digits <= 9; digits++) { /* (9 always do) */
        snprintf(buf, size, "%.*g", digits, (double)v);
        if (strtof(buf, NULL) == v) break;
    }
    return buf;
}

/* Whether the network computes convolutions (MGPU_CONV's method then
   decides how their sums round). */
static int mgpu__net_has_conv(const mgpu_net *net) {
    for (int i = 0; i < net->nlayers; i++)
        if (net->layers[i]->kind == MGPU_LAYER_CONV || net->layers[i]->kind == MGPU_LAYER_RESIDUAL) return 1;
    return 0;
}

MGPU_DEF mgpu_train_settings mgpu_train_settings_of(const mgpu_net *net, const mgpu_dataset *train_set) {
    MGPU_REQUIRE(net && train_set, "mgpu_train_settings_of: the network and the training set must not be NULL");
    mgpu_train_settings t;
    memset(&t, 0, sizeof t);
    t.samples = train_set->n;
    t.data = mgpu_dataset_digest(train_set);
    if (net->adam) {
        char beta1[16], beta2[16], eps[16];
        snprintf(t.optimizer, sizeof t.optimizer, "%s (betas %s, %s, eps %s)", net->decoupled ? "AdamW" : "Adam",
                 mgpu__float_str(net->beta1, beta1, sizeof beta1), mgpu__float_str(net->beta2, beta2, sizeof beta2),
                 mgpu__float_str(net->eps, eps, sizeof eps));
    } else {
        snprintf(t.optimizer, sizeof t.optimizer, "SGD");
    }
    if (mgpu__net_has_conv(net)) {
        mgpu__conv_settings_from_environment();
        snprintf(t.conv, sizeof t.conv, "%s", mgpu__conv_mode_names[mgpu__conv_mode]);
    }
    return t;
}

/* The settings that mgpu_train_settings_differ compares, in its order,
   each named as the chapters' flags (or the environment) set it */
enum { MGPU__SETTINGS = 10 };
static const char *const mgpu__setting_names[MGPU__SETTINGS] = {
    "--model ", "--batch-size ", "--train-samples ", "the training data of digest ", "the optimizer ",
    "--lr ", "--momentum ", "--weight-decay ", "--seed ", "MGPU_CONV="};
/* Each of t's settings in words, in that order: two settings are the
   same exactly when their words are. */
static void mgpu__settings_words(const mgpu_train_settings *t, char words[MGPU__SETTINGS][MGPU_SETTING_BYTES]) {
    snprintf(words[0], MGPU_SETTING_BYTES, "%s", t->model);
    snprintf(words[1], MGPU_SETTING_BYTES, "%d", t->batch_size);
    snprintf(words[2], MGPU_SETTING_BYTES, "%d", t->samples);
    snprintf(words[3], MGPU_SETTING_BYTES, "%016llx", (unsigned long long)t->data);
    snprintf(words[4], MGPU_SETTING_BYTES, "%s", t->optimizer);
    mgpu__float_str(t->lr, words[5], MGPU_SETTING_BYTES);
    mgpu__float_str(t->momentum, words[6], MGPU_SETTING_BYTES);
    mgpu__float_str(t->weight_decay, words[7], MGPU_SETTING_BYTES);
    snprintf(words[8], MGPU_SETTING_BYTES, "%llu", (unsigned long long)t->seed);
    snprintf(words[9], MGPU_SETTING_BYTES, "%s", t->conv);
}

MGPU_DEF int mgpu_train_settings_differ(const mgpu_train_settings *saved, const mgpu_train_settings *now,
                                        char *why, size_t size) {
    char was[MGPU__SETTINGS][MGPU_SETTING_BYTES], is[MGPU__SETTINGS][MGPU_SETTING_BYTES];
    mgpu__settings_words(saved, was);
    mgpu__settings_words(now, is);
    for (int i = 0; i < MGPU__SETTINGS; i++) {
        if (strcmp(was[i], is[i]) == 0) continue;
        const char *before = *was[i] ? was[i] : "(none)", *after = *is[i] ? is[i] : "(none)";
        const int most = MGPU_SETTING_BYTES - 1; /* (each word's length, for the compiler to see) */
        snprintf(why, size, "saved with %s%.*s, this run has %.*s: resume with %s%.*s", mgpu__setting_names[i],
                 most, before, most, after, mgpu__setting_names[i], most, before);
        return 1;
    }
    return 0;
}

/* A name of the settings into the state, as a string padded with zeros
   (the same info makes the same bytes), or back, cut to its room. */
static void mgpu__setting_copy(char *to, const char *from) {
    memset(to, 0, MGPU_SETTING_BYTES);
    snprintf(to, MGPU_SETTING_BYTES, "%.*s", MGPU_SETTING_BYTES - 1, from);
}

MGPU_DEF void mgpu_checkpoint_save(const mgpu_net *net, const char *path, const mgpu_checkpoint_info *info) {
    MGPU_REQUIRE(!net->sharded, "mgpu_checkpoint_save: %s: the optimizer's state of this network is spread over a "
                 "ZeRO wrapper's members (mgpu_data_parallel_zero); freeing the wrapper gathers it back", path);
    MGPU_REQUIRE(info, "mgpu_checkpoint_save: info is NULL; it says where the training resumes");
    MGPU_REQUIRE(info->epoch >= 0 && info->batch >= 0 && info->step >= 0 && info->world >= 1,
                 "mgpu_checkpoint_save: epoch %d, batch %d, step %ld, world %d: the first three must be 0 or "
                 "more, world 1 or more", info->epoch, info->batch, info->step, info->world);
    const mgpu_train_settings *t = &info->train;
    const char *names[3] = {t->model, t->optimizer, t->conv}, *fields[3] = {"model", "optimizer", "conv"};
    for (int k = 0; k < 3; k++)
        MGPU_REQUIRE(memchr(names[k], 0, MGPU_SETTING_BYTES),
                     "mgpu_checkpoint_save: info's train.%s does not end within its %d bytes (MGPU_SETTING_BYTES)",
                     fields[k], MGPU_SETTING_BYTES);
    mgpu__train_state state;
    memset(&state, 0, sizeof state);
    state.epoch = (uint64_t)info->epoch;
    state.batch = (uint64_t)info->batch;
    state.step = (uint64_t)info->step;
    state.world = (uint64_t)info->world;
    mgpu__setting_copy(state.model, t->model);
    state.batch_size = (uint64_t)t->batch_size;
    state.samples = (uint64_t)t->samples;
    state.data = t->data;
    mgpu__setting_copy(state.optimizer, t->optimizer);
    state.lr = t->lr, state.momentum = t->momentum, state.weight_decay = t->weight_decay;
    state.seed = t->seed;
    mgpu__setting_copy(state.conv, t->conv);
    state.net_steps = (uint64_t)net->steps;
    state.generator_seed = mgpu__library.seed;
    state.generator_offset = mgpu__library.offset;
    mgpu__net_write(net, path, &state);
}

/* The info a training checkpoint's state holds. */
static void mgpu__checkpoint_info_of(const mgpu__train_state *state, mgpu_checkpoint_info *info) {
    mgpu_train_settings *t = &info->train;
    info->epoch = (int)state->epoch;
    info->batch = (int)state->batch;
    info->step = (long)state->step;
    info->world = (int)state->world;
    mgpu__setting_copy(t->model, state->model);
    t->batch_size = (int)state->batch_size;
    t->samples = (int)state->samples;
    t->data = state->data;
    mgpu__setting_copy(t->optimizer, state->optimizer);
    t->lr = (float)state->lr, t->momentum = (float)state->momentum, t->weight_decay = (float)state->weight_decay;
    t->seed = state->seed;
    mgpu__setting_copy(t->conv, state->conv);
}

MGPU_DEF void mgpu_checkpoint_load(mgpu_net *net, const char *path, mgpu_checkpoint_info *info) {
    MGPU_REQUIRE(info, "mgpu_checkpoint_load: info is NULL; it gets where the training resumes");
    MGPU_REQUIRE(!net->sharded, "mgpu_checkpoint_load: %s: the optimizer's state of this network is spread over a "
                 "ZeRO wrapper's members (mgpu_data_parallel_zero); load the checkpoint before making the "
                 "wrapper", path);
    mgpu__train_state state;
    mgpu__net_read(net, path, &state);
    mgpu__checkpoint_info_of(&state, info);
    net->steps = (int)state.net_steps;
    mgpu__library.seed = state.generator_seed;
    mgpu__library.offset = state.generator_offset;
}

MGPU_DEF void mgpu_checkpoint_read_info(const char *path, mgpu_checkpoint_info *info) {
    MGPU_REQUIRE(info, "mgpu_checkpoint_read_info: info is NULL; it gets the checkpoint's info");
    const mgpu__net_file_kind *kind = &mgpu__net_files[1];
    size_t readable, total, at;
    unsigned char *bytes = mgpu__net_file_read(path, kind, MGPU__NET_HEADER_BYTES + sizeof(mgpu__train_state),
                                               &readable, &total);
    mgpu__train_state state;
    mgpu__net_file_head(path, 1, bytes, readable, total, &state, &at);
    free(bytes);
    mgpu__checkpoint_info_of(&state, info);
}
/* ======================================================================
   Data parallelism
   ====================================================================== */
struct mgpu_data_parallel {
    int n;
    mgpu_dp_mode mode;
    const char *algorithm;
    mgpu_device *devices[MGPU_MAX_DEVICES];
    mgpu_net *replicas[MGPU_MAX_DEVICES];   /* replicas[0] is the caller's net */
    unsigned module_changes;                 /* replicas[0]->changes when the others last copied it */
    /* the step's shards of the batch: one of two sets of buffers, used in
       turn, each with the event that ends the last step that used it on
       each device (mgpu__dp_scatter) */
    mgpu_tensor *x_shards[MGPU_MAX_DEVICES], *y_shards[MGPU_MAX_DEVICES];
    mgpu_tensor *x_set[2][MGPU_MAX_DEVICES], *y_set[2][MGPU_MAX_DEVICES];
    mgpu_event *set_free[2][MGPU_MAX_DEVICES];
    int set;
    int used;   /* the devices that got rows this step: all but for a short batch */
    mgpu_tensor *loss_sum[MGPU_MAX_DEVICES], *correct[MGPU_MAX_DEVICES], *count[MGPU_MAX_DEVICES];
    /* gather mode, on device 0: the whole batch's logits, labels and
       logit gradients, and a staging copy of each other replica's gradients */
    mgpu_tensor *logits, *labels, *dlogits, *losses, *batch_loss;
    mgpu_tensor **staged[MGPU_MAX_DEVICES]; /* [device][parameter] */
    /* allreduce mode: the gradients in buckets, each one flat tensor per
       device that the parameters' gradients are views into */
    size_t bucket_bytes;
    int overlap, reduce;
    mgpu_allreduce_fn yours; /* a reduction of the caller's, or NULL */
    const char *yours_name;
    int nbuckets; /* at most one a layer: the arrays have a place for each */
    int *bucket_last_layer;                /* the bucket is complete once backward reaches it */
    mgpu_tensor *(*bucket)[MGPU_MAX_DEVICES];  /* [bucket][device] */
    mgpu_tensor *(*scratch)[MGPU_MAX_DEVICES];
    int check_replicas; /* compare the replicas after each step (mgpu_data_parallel_check_replicas) */
    long steps;
    int accumulated_rows; /* rows whose gradients mgpu_data_parallel_accumulate added since the last step */
    /* a distributed wrapper's group: one replica a process, its buckets
       averaged over the ranks (mgpu_distributed_data_parallel_new) */
    struct mgpu_group *group;
    char algorithm_name[48]; /* "ring, then mpi": several devices a process */
    /* ZeRO (mgpu_data_parallel_zero): the stage; each bucket's length, a
       multiple of the members; the parameters' values as flat buckets too
       (the values views into them); member i's chunk of each bucket's
       gradient (stage 2) and its optimizer state for that chunk (SGD's
       momentum, or Adam's two moments) */
    int zero;
    size_t *bucket_len;
    mgpu_tensor *(*value_bucket)[MGPU_MAX_DEVICES];
    mgpu_tensor *(*grad_chunk)[MGPU_MAX_DEVICES];
    mgpu_tensor *(*chunk_state)[MGPU_MAX_DEVICES][2];
};

MGPU_DEF mgpu_data_parallel *mgpu_data_parallel_new(mgpu_net *net, mgpu_device *const *devices,
                                                    int n, mgpu_dp_mode mode) {
    MGPU_REQUIRE(n >= 1 && n <= MGPU_MAX_DEVICES, "mgpu_data_parallel_new: %d devices", n);
    MGPU_REQUIRE(net->device == devices[0],
                 "mgpu_data_parallel_new: the network is on %s, it must be on devices[0] (%s)",
                 net->device->name, devices[0]->name);
    MGPU_REQUIRE(!net->wrapped, "mgpu_data_parallel_new: another wrapper holds this network already");
    MGPU_REQUIRE(n == 1 || !mgpu__net_synced(net),
                 "mgpu_data_parallel_new: the network's batch norms are synchronised over a group "
                 "(mgpu_net_sync_batchnorm): that needs one device a process, not %d", n);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < i; j++)
            MGPU_REQUIRE(devices[i] != devices[j], "mgpu_data_parallel_new: %s is devices[%d] and devices[%d]; "
                         "give each replica its own device (mgpu_devices makes virtual ones)",
                         devices[i]->name, j, i);
    mgpu_data_parallel *dp = (mgpu_data_parallel *)mgpu__xcalloc(1, sizeof *dp);
    dp->n = n;
    dp->mode = mode;
    for (int i = 0; i < n; i++) {
        dp->devices[i] = devices[i];
        /* Replicas start as exact copies: one broadcast from device 0. */
        dp->replicas[i] = i == 0 ? net : mgpu_net_replicate(net, devices[i]);
        dp->replicas[i]->wrapped = 1;
        dp->loss_sum[i] = mgpu_zeros(devices[i], mgpu_shape1(1));
        dp->correct[i] = mgpu_zeros(devices[i], mgpu_shape1(1));
        dp->count[i] = mgpu_zeros(devices[i], mgpu_shape1(1));
        dp->staged[i] = (mgpu_tensor **)mgpu__xcalloc((size_t)net->nparams + 1, sizeof *dp->staged[i]);
    }
    /* the optimizer's state too (a loaded checkpoint's, or steps taken before) */
    for (int i = 1; i < n; i++) mgpu__net_copy_sgd_state(dp->replicas[i], net);
    dp->module_changes = net->changes;
    dp->algorithm = n == 1 ? "none" : mode == MGPU_DP_GATHER ? "gather" : NULL;
    dp->bucket_bytes = 25u << 20;
    dp->overlap = 1;
    dp->reduce = 1;
    dp->check_replicas = mgpu__check_replicas_setting();
    return dp;
}

MGPU_DEF void mgpu_data_parallel_check_replicas(mgpu_data_parallel *dp, int on) {
    MGPU_REQUIRE(on == 0 || on == 1, "mgpu_data_parallel_check_replicas: %d; want 1 (on) or 0 (off)", on);
    dp->check_replicas = on;
}

/* A tensor's values, hashed on the host (the replicas' check). */
static uint64_t mgpu__values_checksum(const mgpu_tensor *t) {
    float *values = (float *)mgpu__xmalloc(t->numel * sizeof(float));
    mgpu_to_host(t, values);
    uint64_t h = mgpu__fnv1a(MGPU__FNV_OFFSET, values, t->numel * sizeof(float));
    free(values);
    return h;
}
/* In MGPU_DP_ALLREDUCE mode, after a step: every replica's parameters
   must be device 0's, bit for bit (each took the same update from the
   same reduced gradients). The first that differs stops the program.
   (In MGPU_DP_GATHER mode the replicas are copies of device 0's at each
   step's start: nothing to drift.) */
static void mgpu__dp_check_replicas(mgpu_data_parallel *dp) {
    if (!dp->check_replicas || dp->mode != MGPU_DP_ALLREDUCE) return;
    const mgpu_net *module = dp->replicas[0];
    for (int p = 0; p < module->nparams; p++) {
        uint64_t want = mgpu__values_checksum(module->params[p]->value);
        for (int i = 1; i < dp->n; i++) {
            if (mgpu__values_checksum(dp->replicas[i]->params[p]->value) == want) continue;
            char sh[64];
            mgpu_fatal("mgpu_data_parallel_step: after step %ld the replicas differ: parameter %d (of layer %s, "
                       "shape %s) on %s is not the same as on %s; %s (MGPU_CHECK_REPLICAS)", dp->steps, p,
                       mgpu__param_layer(module, p)->name, mgpu_shape_str(module->params[p]->value->shape, sh, sizeof sh),
                       dp->devices[i]->name, dp->devices[0]->name,
                       dp->reduce ? "is the gradients' allreduce right?"
                                  : "the reduction is off (mgpu_data_parallel_configure), so they drift apart");
        }
    }
}

MGPU_DEF void mgpu_data_parallel_configure(mgpu_data_parallel *dp, size_t bucket_bytes,
                                           int overlap, int reduce) {
    MGPU_REQUIRE(dp->nbuckets == 0,
                 "mgpu_data_parallel_configure: call it before the first step");
    dp->bucket_bytes = bucket_bytes;
    dp->overlap = overlap;
    dp->reduce = reduce;
}

MGPU_DEF void mgpu_data_parallel_use_allreduce(mgpu_data_parallel *dp, mgpu_allreduce_fn fn,
                                               const char *name) {
    MGPU_REQUIRE(dp->mode == MGPU_DP_ALLREDUCE,
                 "mgpu_data_parallel_use_allreduce: the wrapper gathers on device 0 (MGPU_DP_GATHER); "
                 "a reduction of yours needs MGPU_DP_ALLREDUCE");
    MGPU_REQUIRE(dp->nbuckets == 0, "mgpu_data_parallel_use_allreduce: call it before the first step");
    MGPU_REQUIRE(!dp->group, "mgpu_data_parallel_use_allreduce: a distributed wrapper reduces over its group");
    MGPU_REQUIRE(dp->zero != 2, "mgpu_data_parallel_use_allreduce: ZeRO stage 2 reduce-scatters the gradients, so "
                 "it cannot take your allreduce");
    MGPU_REQUIRE(fn && name, "mgpu_data_parallel_use_allreduce: give the function and its name");
    dp->yours = fn;
    dp->yours_name = name;
}

static const char *mgpu__group_allreduce(const char *op, struct mgpu_group *g, mgpu_tensor *t,
                                         mgpu_reduce_op how, int wait);
/* Does the wrapper reduce gradients: over several devices, or processes? */
static int mgpu__dp_reduces(const mgpu_data_parallel *dp) {
    return dp->n > 1 || (dp->group && mgpu_group_size(dp->group) > 1);
}
static const char *mgpu__dp_reduce_bucket_over_ranks(mgpu_data_parallel *dp, int b);
/* Starts the reduction of bucket b on every device: the caller's, the
   group's mean over the processes, or the library's (NCCL or the ring, on
   the communication queues). */
static const char *mgpu__dp_reduce_bucket(mgpu_data_parallel *dp, int b) {
    if (dp->group) return mgpu__dp_reduce_bucket_over_ranks(dp, b);
    if (!dp->yours) return mgpu_allreduce_start(dp->bucket[b], dp->n, 0, dp->scratch[b]);
    dp->yours(dp->bucket[b], dp->n);
    return dp->yours_name;
}

/* Groups the gradients into buckets of about bucket_bytes, from the last
   layer back (the order backward produces them), and makes every replica's
   gradients views into one flat tensor per bucket, so a bucket is reduced
   as one vector. A bucket holds whole top-level layers. */
/* The members that share out the optimizer's state under ZeRO: the
   wrapper's devices, or its group's ranks (one device each); and device
   i's place among them. */
static int mgpu__dp_members(const mgpu_data_parallel *dp) { return dp->group ? mgpu_group_size(dp->group) : dp->n; }
static int mgpu__dp_member(const mgpu_data_parallel *dp, int i) { return dp->group ? mgpu_group_rank(dp->group) : i; }

/* Makes the gradients (or with values, the values) of replica r's
   parameters p0 .. p1 - 1 views into flat, in order; the values are
   copied there first. */
static void mgpu__views_into(mgpu_tensor *flat, mgpu_net *r, int p0, int p1, int values) {
    int offset = 0;
    for (int p = p0; p < p1; p++) {
        mgpu_tensor **t = values ? &r->params[p]->value : &r->params[p]->grad;
        mgpu_shape shape = r->params[p]->value->shape;
        int numel = (int)r->params[p]->value->numel;
        mgpu_tensor *rows = mgpu_narrow(flat, offset, numel);
        mgpu_tensor *view = mgpu_view(rows, shape);
        mgpu_free(rows);
        if (values && *t) mgpu_copy(view, *t, 0);
        mgpu_free(*t);
        *t = view;
        offset += numel;
    }
}

/* The first and one past the last parameter of bucket b. */
static void mgpu__dp_bucket_params(const mgpu_data_parallel *dp, int b, int *p0, int *p1) {
    const mgpu_net *net = dp->replicas[0];
    int last = b == 0 ? net->nlayers - 1 : dp->bucket_last_layer[b - 1] - 1;
    *p0 = net->first_param[dp->bucket_last_layer[b]];
    *p1 = net->first_param[last + 1];
}

/* Bucket b's flat gradients on every device, zeros (ZeRO-2 makes them
   for each backward pass and frees them once reduced). */
static void mgpu__dp_grad_bucket_make(mgpu_data_parallel *dp, int b) {
    int p0, p1;
    mgpu__dp_bucket_params(dp, b, &p0, &p1);
    for (int i = 0; i < dp->n; i++) {
        int scope = mgpu__memory_scope(MGPU_MEMORY_GRADIENTS); /* (the gradients become views of it) */
        dp->bucket[b][i] = mgpu_zeros(dp->devices[i], mgpu_shape1((int)dp->bucket_len[b]));
        mgpu__memory_scope((mgpu_memory_category)scope);
        mgpu__views_into(dp->bucket[b][i], dp->replicas[i], p0, p1, 0);
    }
}
static void mgpu__dp_grad_bucket_free(mgpu_data_parallel *dp, int b) {
    int p0, p1;
    mgpu__dp_bucket_params(dp, b, &p0, &p1);
    for (int i = 0; i < dp->n; i++) {
        for (int p = p0; p < p1; p++) {
            mgpu_free(dp->replicas[i]->params[p]->grad);
            dp->replicas[i]->params[p]->grad = NULL;
        }
        mgpu_free(dp->bucket[b][i]);
        dp->bucket[b][i] = NULL;
    }
}

static void mgpu__dp_make_buckets(mgpu_data_parallel *dp) {
    const mgpu_net *net = dp->replicas[0];
    dp->bucket_last_layer = (int *)mgpu__xcalloc((size_t)net->nlayers, sizeof *dp->bucket_last_layer);
    dp->bucket_len = (size_t *)mgpu__xcalloc((size_t)net->nlayers, sizeof *dp->bucket_len);
    dp->bucket = (mgpu_tensor *(*)[MGPU_MAX_DEVICES])mgpu__xcalloc((size_t)net->nlayers, sizeof *dp->bucket);
    dp->scratch = (mgpu_tensor *(*)[MGPU_MAX_DEVICES])mgpu__xcalloc((size_t)net->nlayers, sizeof *dp->scratch);
    dp->value_bucket = (mgpu_tensor *(*)[MGPU_MAX_DEVICES])mgpu__xcalloc((size_t)net->nlayers, sizeof *dp->value_bucket);
    dp->grad_chunk = (mgpu_tensor *(*)[MGPU_MAX_DEVICES])mgpu__xcalloc((size_t)net->nlayers, sizeof *dp->grad_chunk);
    dp->chunk_state = (mgpu_tensor *(*)[MGPU_MAX_DEVICES][2])mgpu__xcalloc((size_t)net->nlayers,
                                                                            sizeof *dp->chunk_state);
    size_t members = (size_t)mgpu__dp_members(dp);
    int last = net->nlayers - 1;
    while (last >= 0) {
        size_t floats = 0;
        int first = last;
        for (; first >= 0; first--) {
            for (int p = net->first_param[first]; p < net->first_param[first + 1]; p++)
                floats += net->params[p]->value->numel;
            if (floats * sizeof(float) >= dp->bucket_bytes) break;
        }
        if (first < 0) first = 0;
        if (floats > 0) {
            int b = dp->nbuckets++;
            dp->bucket_last_layer[b] = first;
            /* (ZeRO: padded with zeros, which stay 0, to equal chunks) */
            dp->bucket_len[b] = dp->zero ? (floats + members - 1) / members * members : floats;
            mgpu__dp_grad_bucket_make(dp, b);
            int p0, p1;
            mgpu__dp_bucket_params(dp, b, &p0, &p1);
            for (int i = 0; i < dp->n; i++) {
                int share = (int)((dp->bucket_len[b] + (size_t)dp->n - 1) / (size_t)dp->n);
                if (dp->n > 1) dp->scratch[b][i] = mgpu_empty(dp->devices[i], mgpu_shape1(share));
                if (!dp->zero) continue;
                int scope = mgpu__memory_scope(MGPU_MEMORY_PARAMETERS);
                dp->value_bucket[b][i] = mgpu_zeros(dp->devices[i], mgpu_shape1((int)dp->bucket_len[b]));
                mgpu__memory_scope((mgpu_memory_category)scope);
                mgpu__views_into(dp->value_bucket[b][i], dp->replicas[i], p0, p1, 1);
            }
            if (dp->zero == 2) mgpu__dp_grad_bucket_free(dp, b); /* (made for each backward pass) */
        }
        last = first - 1;
    }
}

/* Gives replica 0's gradients their own memory again: the caller keeps
   that network after the wrapper is gone. */
static void mgpu__dp_unbucket_module(mgpu_data_parallel *dp) {
    mgpu_net *net = dp->replicas[0];
    for (int p = 0; p < net->nparams && dp->nbuckets; p++) {
        mgpu_param *param = net->params[p];
        int scope = mgpu__memory_scope(MGPU_MEMORY_GRADIENTS);
        mgpu_tensor *own = mgpu_zeros(net->device, param->value->shape); /* (ZeRO-2's between steps: none) */
        if (param->grad) mgpu_copy(own, param->grad, 0);
        mgpu_free(param->grad);
        param->grad = own;
        mgpu__memory_scope(MGPU_MEMORY_PARAMETERS);
        if (dp->zero) { /* (its values, views into ZeRO's buckets, too) */
            own = mgpu_empty(net->device, param->value->shape);
            mgpu_copy(own, param->value, 0);
            mgpu_free(param->value);
            param->value = own;
        }
        mgpu__memory_scope((mgpu_memory_category)scope);
    }
    net->sharded = 0;
}

MGPU_DEF mgpu_net *mgpu_data_parallel_module(mgpu_data_parallel *dp) { return dp->replicas[0]; }
MGPU_DEF mgpu_net *mgpu_data_parallel_replica(mgpu_data_parallel *dp, int i) {
    MGPU_REQUIRE(i >= 0 && i < dp->n, "mgpu_data_parallel_replica: index %d of %d", i, dp->n);
    return dp->replicas[i];
}
MGPU_DEF const char *mgpu_data_parallel_algorithm(const mgpu_data_parallel *dp) {
    return dp->algorithm ? dp->algorithm : "(not run yet)";
}

/* The batch's shards on the devices (mgpu_split_batch's), into the
   buffers of the set whose turn it is. A step's copies wait for the end
   of the step before last, which used the same buffers, so they run on
   the copy queues while the step before computes; copies into new
   tensors would wait for the whole of it, and the GPU for them (on an
   H100, two copies of some 15 us each a ResNet-18 step at batch 256,
   with the GPU idle). Once used, the set's buffers are free again where
   each device's compute queue reaches the end of the step. */
static void mgpu__dp_scatter(mgpu_data_parallel *dp, const mgpu_tensor *X, const mgpu_tensor *y) {
    int set = dp->set;
    dp->used = mgpu__split_batch(X, y, dp->devices, dp->n, dp->x_set[set], dp->y_set[set],
                                 dp->set_free[set]);
    for (int i = 0; i < dp->used; i++) {
        dp->x_shards[i] = dp->x_set[set][i];
        dp->y_shards[i] = dp->y_set[set][i];
    }
}
static void mgpu__dp_shards_used(mgpu_data_parallel *dp) {
    for (int i = 0; i < dp->n; i++) {
        mgpu_event **e = &dp->set_free[dp->set][i];
        mgpu_event_free(*e);
        *e = mgpu_event_new();
        mgpu__event_record_on(*e, &dp->devices[i]->queue[0]);
    }
    dp->set = !dp->set;
}

/* A bucket whose gradients the backward pass has completed: divided by
   the rows they add up where mgpu_data_parallel_accumulate added some,
   and its reduction started (when it overlaps the backward pass). */
/* ---- ZeRO (mgpu_data_parallel_zero) ----
   Bucket b of length L (a multiple of the W members) is cut in W equal
   chunks; member m owns chunk m: [m L/W, (m + 1) L/W). */
static int mgpu__dp_chunk(const mgpu_data_parallel *dp, int b) {
    return (int)(dp->bucket_len[b] / (size_t)mgpu__dp_members(dp));
}
/* ZeRO-2: device i's chunk of bucket b's gradient, summed over the
   devices in their order (the replicas' gradients of a loss already
   divided by the whole batch), or averaged over the ranks, into
   grad_chunk[b][i]; then the whole bucket is freed. */
static void mgpu__dp_reduce_scatter(mgpu_data_parallel *dp, int b) {
    int chunk = mgpu__dp_chunk(dp, b);
    for (int i = 0; i < dp->n; i++)
        if (!dp->grad_chunk[b][i]) {
            int scope = mgpu__memory_scope(MGPU_MEMORY_GRADIENTS);
            dp->grad_chunk[b][i] = mgpu_empty(dp->devices[i], mgpu_shape1(chunk));
            mgpu__memory_scope((mgpu_memory_category)scope);
        }
    if (dp->group && dp->reduce) {
        mgpu_group_reduce_scatter(dp->group, dp->bucket[b][0], dp->grad_chunk[b][0], MGPU_MEAN);
        dp->algorithm = mgpu_group_path(dp->group, dp->devices[0]);
    } else {
        for (int i = 0; i < dp->n; i++) {
            int m = mgpu__dp_member(dp, i);
            for (int j = 0; j < dp->n; j++) {
                int from = dp->reduce ? j : i; /* (without the reduction: its own chunk alone) */
                mgpu_tensor *part = mgpu_narrow(dp->bucket[b][from], m * chunk, chunk);
                if (j == 0) {
                    mgpu_copy(dp->grad_chunk[b][i], part, 1);
                } else if (dp->reduce) {
                    mgpu_tensor *here = mgpu_narrow(dp->scratch[b][i], 0, chunk);
                    mgpu_copy(here, part, 1);
                    mgpu_add_(dp->grad_chunk[b][i], here);
                    mgpu_free(here);
                }
                mgpu_free(part);
            }
        }
        dp->algorithm = dp->reduce && dp->n > 1 ? "reduce-scatter" : "none";
    }
    mgpu__dp_grad_bucket_free(dp, b);
}

/* Member i's optimizer state (k 0: momentum or Adam's first moment, 1:
   Adam's second) for its chunk [start, start + chunk) of bucket b: zeros,
   or the chunk of the state the replica had before (a loaded
   checkpoint's, or steps taken before the wrapper). */
static mgpu_tensor *mgpu__dp_chunk_state_new(mgpu_data_parallel *dp, int i, int b, int k, int start, int chunk) {
    mgpu_net *r = dp->replicas[i];
    mgpu_tensor **full = k == 0 ? r->momentum : r->second_moment;
    int p0, p1, scope = mgpu__memory_scope(MGPU_MEMORY_OPTIMIZER);
    mgpu__dp_bucket_params(dp, b, &p0, &p1);
    mgpu_tensor *state = mgpu_zeros(dp->devices[i], mgpu_shape1(chunk));
    if (full[p0]) {
        mgpu_tensor *flat = mgpu_zeros(dp->devices[i], mgpu_shape1((int)dp->bucket_len[b]));
        int offset = 0;
        for (int p = p0; p < p1; p++) {
            mgpu_tensor *rows = mgpu_narrow(flat, offset, (int)full[p]->numel), *place = mgpu_view(rows, full[p]->shape);
            mgpu_copy(place, full[p], 0);
            offset += (int)full[p]->numel;
            mgpu_free(place);
            mgpu_free(rows);
        }
        mgpu_tensor *mine = mgpu_narrow(flat, start, chunk);
        mgpu_copy(state, mine, 0);
        mgpu_free(mine);
        mgpu_free(flat);
    }
    mgpu__memory_scope((mgpu_memory_category)scope);
    return state;
}

/* Every device's values of bucket b from its members' chunks: copies
   between the devices, or an all-gather over the ranks. */
static void mgpu__dp_gather_values(mgpu_data_parallel *dp, int b) {
    int chunk = mgpu__dp_chunk(dp, b);
    if (dp->group) {
        int m = mgpu_group_rank(dp->group);
        mgpu_tensor *mine = mgpu_narrow(dp->value_bucket[b][0], m * chunk, chunk);
        mgpu_tensor *sent = mgpu_empty(dp->devices[0], mgpu_shape1(chunk)); /* (in and out may not overlap) */
        mgpu_copy(sent, mine, 0);
        mgpu_group_all_gather(dp->group, sent, dp->value_bucket[b][0]);
        mgpu_free(sent);
        mgpu_free(mine);
        return;
    }
    for (int j = 0; j < dp->n; j++)
        for (int i = 0; i < dp->n; i++) {
            if (i == j) continue;
            mgpu_tensor *to = mgpu_narrow(dp->value_bucket[b][j], i * chunk, chunk);
            mgpu_tensor *from = mgpu_narrow(dp->value_bucket[b][i], i * chunk, chunk);
            mgpu_copy(to, from, 1);
            mgpu_free(to);
            mgpu_free(from);
        }
}

/* The ZeRO step: each member updates its chunk of every bucket with its
   own part of the optimizer's state, then the chunks are gathered into
   every device's values. */
static void mgpu__dp_zero_step(mgpu_data_parallel *dp, float lr, float momentum, float weight_decay) {
    for (int i = 0; i < dp->n; i++) {
        mgpu_net *r = dp->replicas[i];
        int m = mgpu__dp_member(dp, i);
        MGPU_REQUIRE(!r->adam || momentum == 0.0f, "%s: momentum %g, but Adam keeps moments of its own: give 0",
                     r->decoupled ? "AdamW" : "Adam", (double)momentum);
        for (int b = 0; b < dp->nbuckets; b++) {
            int chunk = mgpu__dp_chunk(dp, b);
            mgpu_tensor *value = mgpu_narrow(dp->value_bucket[b][i], m * chunk, chunk);
            mgpu_tensor *grad = dp->zero == 2 ? dp->grad_chunk[b][i] : mgpu_narrow(dp->bucket[b][i], m * chunk, chunk);
            mgpu_tensor **state = dp->chunk_state[b][i];
            for (int k = 0; k < (r->adam ? 2 : momentum != 0.0f); k++)
                if (!state[k]) state[k] = mgpu__dp_chunk_state_new(dp, i, b, k, m * chunk, chunk);
            if (r->adam)
                mgpu__adam_tensors(r, &value, (const mgpu_tensor *const *)&grad, &state[0], &state[1], 1, lr,
                                   weight_decay);
            else
                mgpu__sgd_tensors("mgpu_data_parallel_step", &value, (const mgpu_tensor *const *)&grad,
                                  momentum != 0.0f ? &state[0] : NULL, 1, lr, momentum, weight_decay, r->steps == 0);
            mgpu_free(value);
            if (dp->zero != 2) mgpu_free(grad);
        }
        mgpu__net_keep_momentum(r, 0); /* (the chunks hold the state now) */
        r->steps++;
        r->changes++;
    }
    for (int b = 0; b < dp->nbuckets; b++) mgpu__dp_gather_values(dp, b);
}

/* At the wrapper's end: replica 0 gets its whole optimizer state back
   from the members' chunks, so that it trains on as it would have. */
static void mgpu__dp_zero_unshard_state(mgpu_data_parallel *dp) {
    mgpu_net *net = dp->replicas[0];
    if (!dp->zero || dp->nbuckets == 0) return;
    int kinds = dp->chunk_state[0][0][1] ? 2 : dp->chunk_state[0][0][0] ? 1 : 0;
    if (kinds == 0) return;
    mgpu__net_keep_momentum(net, 1);
    for (int k = 0; k < kinds; k++)
        for (int b = 0; b < dp->nbuckets; b++) {
            int chunk = mgpu__dp_chunk(dp, b), p0, p1;
            mgpu_tensor *flat = mgpu_empty(dp->devices[0], mgpu_shape1((int)dp->bucket_len[b]));
            if (dp->group) {
                mgpu_group_all_gather(dp->group, dp->chunk_state[b][0][k], flat);
            } else {
                for (int i = 0; i < dp->n; i++) {
                    mgpu_tensor *place = mgpu_narrow(flat, i * chunk, chunk);
                    mgpu_copy(place, dp->chunk_state[b][i][k], 0);
                    mgpu_free(place);
                }
            }
            mgpu__dp_bucket_params(dp, b, &p0, &p1);
            int offset = 0;
            for (int p = p0; p < p1; p++) {
                mgpu_tensor *full = k == 0 ? net->momentum[p] : net->second_moment[p];
                mgpu_tensor *rows = mgpu_narrow(flat, offset, (int)full->numel), *from = mgpu_view(rows, full->shape);
                mgpu_copy(full, from, 0);
                offset += (int)full->numel;
                mgpu_free(from);
                mgpu_free(rows);
            }
            mgpu_free(flat);
        }
}

MGPU_DEF void mgpu_data_parallel_zero(mgpu_data_parallel *dp, int stage) {
    const char *op = "mgpu_data_parallel_zero";
    MGPU_REQUIRE(stage >= 0 && stage <= 2, "%s: stage %d does not exist here: 0 (none), 1 (the optimizer's state "
                 "sharded) or 2 (the gradients too); stage 3, the parameters too, is not built", op, stage);
    MGPU_REQUIRE(dp->steps == 0 && dp->nbuckets == 0, "%s: call it before the wrapper's first step", op);
    MGPU_REQUIRE(dp->mode == MGPU_DP_ALLREDUCE, "%s: the wrapper gathers on device 0 (MGPU_DP_GATHER); ZeRO "
                 "needs MGPU_DP_ALLREDUCE", op);
    MGPU_REQUIRE(!dp->group || dp->n == 1, "%s: a distributed wrapper of %d devices a process; ZeRO needs one", op,
                 dp->n);
    MGPU_REQUIRE(stage < 2 || !dp->yours, "%s: stage 2 reduce-scatters the gradients, so it cannot take your "
                 "allreduce (%s)", op, dp->yours_name);
    dp->zero = stage;
    for (int i = 0; i < dp->n; i++) dp->replicas[i]->sharded = stage > 0 && mgpu__dp_members(dp) > 1;
}

static void mgpu__dp_bucket_done(mgpu_data_parallel *dp, int b) {
    if (dp->accumulated_rows)
        for (int i = 0; i < dp->n; i++) mgpu_scale_(dp->bucket[b][i], 1.0f / (float)dp->accumulated_rows);
    if (dp->zero == 2) mgpu__dp_reduce_scatter(dp, b);
    else if (dp->reduce && dp->overlap) dp->algorithm = mgpu__dp_reduce_bucket(dp, b);
}

/* DistributedDataParallel's way: each device computes the loss of its own
   shard, scaled by 1/N of the WHOLE batch given to the wrapper, so that
   the allreduced sum of the replicas' gradients is the gradient of the
   batch's mean loss (a distributed wrapper then averages that over the
   ranks, each with its own batch). The backward pass runs layer by layer
   on all devices together, and each bucket's reduction starts on the
   communication queues as soon as the backward of its layers has been
   enqueued everywhere, while the backward of the earlier layers goes on.
   The optimiser waits for the last bucket. A device that got no rows (a
   batch shorter than the devices) still takes part in every reduction,
   with zero gradients, and in the update, so the replicas stay the same.
   take_step 0: mgpu_data_parallel_accumulate's pass, which adds the
   batch's gradients (of the summed loss: the step divides by all the
   rows) and stops there; 1: a step, after such passes or not. */
static void mgpu__dp_step_allreduce(mgpu_data_parallel *dp, int batch, float lr, float momentum,
                                    float weight_decay, int take_step) {
    int reduces = mgpu__dp_reduces(dp);
    if (reduces && dp->nbuckets == 0) mgpu__dp_make_buckets(dp);
    int adding = dp->accumulated_rows > 0; /* to gradients of passes before */
    float scale = take_step && !adding ? 1.0f / (float)batch : 1.0f;
    if (!take_step || adding) dp->accumulated_rows += batch;
    for (int i = dp->used; i < dp->n && !adding; i++) /* (ZeRO-2 makes its buckets zero, below) */
        for (int b = 0; b < dp->nbuckets && dp->zero != 2; b++) mgpu_fill(dp->bucket[b][i], 0.0f);
    const mgpu_tensor *grad[MGPU_MAX_DEVICES];
    const char *op = take_step ? "mgpu_data_parallel_step" : "mgpu_data_parallel_accumulate";
    for (int i = 0, row = 0; i < dp->used; row += dp->x_shards[i]->shape.d[0], i++) {
        mgpu_net *r = dp->replicas[i]; /* (no zero_grad: the backward writes the gradients) */
        mgpu_tensor *logits = mgpu_net_forward(r, dp->x_shards[i]);
        mgpu__net_require_backward(r, op);
        mgpu__accuracy_count(op, row, dp->count[i], logits, dp->y_shards[i]);
        mgpu_add_(dp->correct[i], dp->count[i]);
        grad[i] = mgpu__net_loss_grad(r, logits, dp->y_shards[i], scale, dp->loss_sum[i], op, row);
    }
    int next_bucket = 0;
    for (int layer = dp->replicas[0]->nlayers - 1; layer >= 0; layer--) {
        if (dp->zero == 2 && next_bucket < dp->nbuckets && !dp->bucket[next_bucket][0])
            mgpu__dp_grad_bucket_make(dp, next_bucket);
        for (int i = 0; i < dp->used; i++)
            grad[i] = mgpu__net_layer_backward(dp->replicas[i], layer, grad[i], adding);
        int complete = next_bucket < dp->nbuckets && dp->bucket_last_layer[next_bucket] == layer;
        if (complete && take_step) mgpu__dp_bucket_done(dp, next_bucket);
        next_bucket += complete;
    }
    if (!take_step) return;
    if (dp->reduce && !dp->overlap && dp->zero != 2)
        for (int b = 0; b < dp->nbuckets; b++) dp->algorithm = mgpu__dp_reduce_bucket(dp, b);
    if (reduces) {
        mgpu_comm_wait(dp->devices, dp->n);
    } else {
        mgpu_net *net = dp->replicas[0]; /* one device: no buckets to divide */
        for (int p = 0; p < net->nparams && dp->accumulated_rows; p++)
            mgpu_scale_(net->params[p]->grad, 1.0f / (float)dp->accumulated_rows);
    }
    dp->accumulated_rows = 0;
    if (dp->zero && reduces) {
        mgpu__dp_zero_step(dp, lr, momentum, weight_decay);
        return;
    }
    for (int i = 0; i < dp->n; i++) mgpu_net_step(dp->replicas[i], lr, momentum, weight_decay);
}

/* torch.nn.DataParallel's way, step by step. Like it, a batch shorter
   than the devices runs on the first dp->used of them only. */
static void mgpu__dp_step_gather(mgpu_data_parallel *dp, int batch, float lr, float momentum,
                                 float weight_decay) {
    mgpu_net *module = dp->replicas[0];
    mgpu_device *d0 = dp->devices[0];
    /* 1. replicate: broadcast device 0's parameters and buffers */
    for (int i = 1; i < dp->used; i++) mgpu_net_copy_params(dp->replicas[i], module, 1);
    /* 2. forward on every device, 3. gather the logits on device 0 */
    int classes = 0, row = 0;
    for (int i = 0; i < dp->used; i++) { /* (no zero_grad: the backward writes the gradients) */
        mgpu_net *r = dp->replicas[i];
        mgpu_tensor *logits = mgpu_net_forward(r, dp->x_shards[i]);
        mgpu__net_require_backward(r, "mgpu_data_parallel_step");
        classes = logits->shape.d[1];
        mgpu_ensure(&dp->logits, d0, mgpu_shape2(batch, classes));
        mgpu_ensure(&dp->labels, d0, mgpu_shape1(batch));
        mgpu_tensor *rows = mgpu_narrow(dp->logits, row, logits->shape.d[0]);
        mgpu_tensor *labels = mgpu_narrow(dp->labels, row, logits->shape.d[0]);
        mgpu_copy(rows, logits, 1);
        mgpu_copy(labels, dp->y_shards[i], 1);
        row += logits->shape.d[0];
        mgpu_free(rows);
        mgpu_free(labels);
    }
    /* 4. the loss of the whole batch on device 0 */
    mgpu_ensure(&dp->losses, d0, mgpu_shape1(batch));
    mgpu_ensure(&dp->dlogits, d0, dp->logits->shape);
    mgpu_ensure(&dp->batch_loss, d0, mgpu_shape1(1));
    const char *op = "mgpu_data_parallel_step";
    mgpu__cross_entropy_forward(op, 0, dp->losses, dp->logits, dp->labels);
    mgpu_sum(dp->batch_loss, dp->losses);
    mgpu_add_(dp->loss_sum[0], dp->batch_loss);
    mgpu__accuracy_count(op, 0, dp->count[0], dp->logits, dp->labels);
    mgpu_add_(dp->correct[0], dp->count[0]);
    mgpu__cross_entropy_backward(op, 0, dp->dlogits, dp->logits, dp->labels, 1.0f / (float)batch);
    /* 5. scatter the logits' gradient back, backward on every device */
    row = 0;
    for (int i = 0; i < dp->used; i++) {
        mgpu_net *r = dp->replicas[i];
        int rows_here = dp->x_shards[i]->shape.d[0];
        mgpu_tensor *slice = mgpu_narrow(dp->dlogits, row, rows_here);
        mgpu_tensor *dlogits = i == 0 ? slice : mgpu_to(slice, dp->devices[i], 1);
        mgpu__net_backward(r, dlogits, 0);
        if (dlogits != slice) mgpu_free(dlogits);
        mgpu_free(slice);
        row += rows_here;
    }
    /* 6. sum every replica's gradients into device 0, 7. SGD there only */
    for (int i = 1; i < dp->used; i++)
        for (int p = 0; p < module->nparams; p++) {
            mgpu_tensor *grad = dp->replicas[i]->params[p]->grad;
            mgpu_tensor *staged = mgpu_ensure(&dp->staged[i][p], d0, grad->shape);
            mgpu_copy(staged, grad, 1);
            mgpu_add_(module->params[p]->grad, staged);
        }
    mgpu_net_step(module, lr, momentum, weight_decay);
}

/* What the caller did to replica 0 (the module) between steps reaches the
   others: its training mode always, and its values when they may have
   changed (loaded, or written through mgpu_net_param). In gather mode
   each step copies the values anyway. */
static void mgpu__dp_follow_module(mgpu_data_parallel *dp) {
    mgpu_net *module = dp->replicas[0];
    for (int i = 1; i < dp->n; i++) dp->replicas[i]->training = module->training;
    if (module->changes == dp->module_changes) return;
    if (dp->mode == MGPU_DP_ALLREDUCE)
        for (int i = 1; i < dp->n; i++) mgpu_net_copy_params(dp->replicas[i], module, 1);
    dp->module_changes = module->changes;
}

/* DDP's broadcast_buffers: rank 0's running statistics go to every rank
   before a forward pass reads them. */
static void mgpu__dp_broadcast_buffers(mgpu_data_parallel *dp) {
    if (!dp->group || mgpu_group_size(dp->group) == 1) return;
    mgpu_net *net = dp->replicas[0];
    for (int i = 0; i < net->nbuffers; i++) mgpu_group_broadcast(dp->group, *net->buffers[i], 0);
}

MGPU_DEF void mgpu_data_parallel_accumulate(mgpu_data_parallel *dp, const mgpu_tensor *X,
                                            const mgpu_tensor *y) {
    MGPU_REQUIRE(dp->mode == MGPU_DP_ALLREDUCE,
                 "mgpu_data_parallel_accumulate: the wrapper gathers on device 0 (MGPU_DP_GATHER); "
                 "accumulating gradients needs MGPU_DP_ALLREDUCE");
    MGPU_REQUIRE(dp->zero != 2, "mgpu_data_parallel_accumulate: ZeRO stage 2 keeps only a chunk of each "
                 "gradient, so it cannot add up whole ones over passes (stage 1 can)");
    mgpu__dp_follow_module(dp);
    mgpu__dp_broadcast_buffers(dp);
    mgpu__dp_scatter(dp, X, y);
    mgpu__dp_step_allreduce(dp, X->shape.d[0], 0.0f, 0.0f, 0.0f, 0);
    mgpu__dp_shards_used(dp);
}

MGPU_DEF void mgpu_data_parallel_step(mgpu_data_parallel *dp, const mgpu_tensor *X,
                                      const mgpu_tensor *y, float lr, float momentum,
                                      float weight_decay) {
    int batch = X->shape.d[0];
    mgpu__require_sgd_settings("mgpu_data_parallel_step", lr, momentum, weight_decay);
    mgpu__dp_follow_module(dp);
    mgpu__dp_broadcast_buffers(dp);
    mgpu__dp_scatter(dp, X, y);
    if (dp->mode == MGPU_DP_GATHER)
        mgpu__dp_step_gather(dp, batch, lr, momentum, weight_decay);
    else
        mgpu__dp_step_allreduce(dp, batch, lr, momentum, weight_decay, 1);
    mgpu__dp_shards_used(dp);
    dp->module_changes = dp->replicas[0]->changes; /* (this step's SGD: every replica took it) */
    dp->steps++;
    mgpu__dp_check_replicas(dp);
}

MGPU_DEF void mgpu_data_parallel_take_stats(mgpu_data_parallel *dp, double *loss_sum,
                                            double *correct) {
    *loss_sum = *correct = 0;
    for (int i = 0; i < dp->n; i++) {
        *loss_sum += mgpu_item(dp->loss_sum[i], 0);
        *correct += mgpu_item(dp->correct[i], 0);
        mgpu_fill(dp->loss_sum[i], 0.0f);
        mgpu_fill(dp->correct[i], 0.0f);
    }
}

MGPU_DEF void mgpu_data_parallel_free(mgpu_data_parallel *dp) {
    if (!dp) return;
    mgpu__dp_zero_unshard_state(dp);
    mgpu__dp_unbucket_module(dp);
    for (int i = 0; i < dp->n; i++) {
        dp->replicas[i]->wrapped = 0;
        if (i > 0) mgpu_net_free(dp->replicas[i]);
        for (int set = 0; set < 2; set++) {
            mgpu_free(dp->x_set[set][i]);
            mgpu_free(dp->y_set[set][i]);
            mgpu_event_free(dp->set_free[set][i]);
        }
        mgpu_free(dp->loss_sum[i]);
        mgpu_free(dp->correct[i]);
        mgpu_free(dp->count[i]);
        for (int p = 0; p < dp->replicas[0]->nparams; p++) mgpu_free(dp->staged[i][p]);
        free(dp->staged[i]);
    }
    /* after the replicas, whose gradients were views into the buckets */
    for (int b = 0; b < dp->nbuckets; b++)
        for (int i = 0; i < dp->n; i++) {
            mgpu_free(dp->bucket[b][i]);
            mgpu_free(dp->scratch[b][i]);
            mgpu_free(dp->value_bucket[b][i]);
            mgpu_free(dp->grad_chunk[b][i]);
            mgpu_free(dp->chunk_state[b][i][0]);
            mgpu_free(dp->chunk_state[b][i][1]);
        }
    free(dp->bucket_last_layer);
    free(dp->bucket_len);
    free(dp->bucket);
    free(dp->scratch);
    free(dp->value_bucket);
    free(dp->grad_chunk);
    free(dp->chunk_state);
    mgpu_free(dp->logits);
    mgpu_free(dp->labels);
    mgpu_free(dp->dlogits);
    mgpu_free(dp->losses);
    mgpu_free(dp->batch_loss);
    free(dp);
}
/* ======================================================================
   Pipelines
   ====================================================================== */
/* A send (or receive) of t to (from) rank peer of group g, on t's
   device's communication queue (below, with the group). On a CPU device
   a send waits for `ready` alone: the pipeline knows when t was written,
   and the compute queue has gone on to later work. (A GPU's tensors go
   through the host, which waits for the device.) */
static void mgpu__group_p2p(mgpu_group *g, int send, mgpu_tensor *t, int peer, mgpu_event *ready);

/* A stage: its network, which holds the parameters, their gradients,
   batch norm's buffers and the optimizer's state, and its slots, copies
   of its layers that share those, one for each micro-batch in flight
   (slot[0] is the network itself); where its layers, parameters and
   buffers start in the pipeline's network. */
typedef struct mgpu__pipeline_stage {
    mgpu_net *net;
    mgpu_net **slot;
    int nslots, slots_wanted;
    int *slot_micro_batch;       /* the micro-batch each slot holds during a step, or -1 */
    int first_layer, first_param, first_buffer;
    int backward_passes;         /* done so far in this step: the first writes the gradients */
} mgpu__pipeline_stage;

struct mgpu_pipeline {
    mgpu_net *net;
    int nstages;
    /* across processes (mgpu_pipeline_new_group): the group, and this
       rank's stage (the others' stage[].net are NULL); the shape of each
       stage's output for one row of the batch, found by a forward pass of
       one row through the whole network (x_row: the row's shape it was
       found for) */
    struct mgpu_group *group;
    int rank;
    mgpu_shape row_output[MGPU_MAX_DEVICES], x_row;
    mgpu__pipeline_stage stage[MGPU_MAX_DEVICES];
    int micro_batches;
    mgpu_pipeline_pass *order; /* stage s's passes: order[s * 2m ..], in its order */
    int *sequence;             /* every stage's passes as the host enqueues them: s * 2m + index */
    /* during a step: the batch on the first stage's device and its
       labels on the last's (each copied there whole at the start: a copy
       waits for its source device's work, and the batch's is often the
       first stage's); for stage s and micro-batch j ([s * m + j]), the
       stage's input and the gradient of its output */
    const mgpu_tensor *x, *labels;
    mgpu_tensor *x_moved, *labels_moved;
    mgpu_tensor **input, **output_grad;
    /* what stage s sends for micro-batch j, and when it is written: its
       output (the slot's) and its input's gradient (its own). The next
       stage copies it when it comes to use it: a copy enqueued at once
       would make the receiving queue wait for it before the work the
       schedule puts first there. */
    const mgpu_tensor **output;
    mgpu_tensor **input_grad;
    mgpu_event **output_ready, **input_grad_ready;
};

MGPU_DEF void mgpu_schedule_gpipe(int stage, int stages, int micro_batches, mgpu_pipeline_pass *order) {
    (void)stage, (void)stages;
    for (int j = 0; j < micro_batches; j++) {
        order[j].backward = 0, order[j].micro_batch = j;
        order[micro_batches + j].backward = 1, order[micro_batches + j].micro_batch = j;
    }
}
MGPU_DEF void mgpu_schedule_1f1b(int stage, int stages, int micro_batches, mgpu_pipeline_pass *order) {
    int warmup = stages - stage - 1 < micro_batches ? stages - stage - 1 : micro_batches;
    int n = 0, forward = 0, backward = 0;
    while (forward < warmup) order[n].backward = 0, order[n++].micro_batch = forward++;
    while (forward < micro_batches) { /* the steady state: one forward, one backward */
        order[n].backward = 0, order[n++].micro_batch = forward++;
        order[n].backward = 1, order[n++].micro_batch = backward++;
    }
    while (backward < micro_batches) order[n].backward = 1, order[n++].micro_batch = backward++;
}
MGPU_DEF double mgpu_pipeline_bubble_formula(int stages, int micro_batches) {
    return (stages - 1) / (double)(micro_batches + stages - 1);
}

/* "F3" or "B3": a pass as the trace labels it and the errors name it. */
static const char *mgpu__pass_name(mgpu_pipeline_pass pass, char *buf, size_t size) {
    snprintf(buf, size, "%c%d", pass.backward ? 'B' : 'F', pass.micro_batch);
    return buf;
}

/* A slot for stage st: copies of its layers sharing its parameters and
   buffers. A stage after the first wants its input's gradient, to send
   it back. */
static mgpu_net *mgpu__pipeline_new_slot(const mgpu__pipeline_stage *st, int wants_input_grad) {
    mgpu_net *slot = mgpu__net_like(st->net, st->net->device);
    slot->shares_params = 1;
    for (int i = 0; i < st->net->nlayers; i++)
        mgpu__net_add(slot, mgpu__layer_clone(st->net->layers[i], st->net->device, 1));
    mgpu_net_want_input_grad(slot, wants_input_grad);
    return slot;
}

/* Checks the schedule's passes for every stage and finds how many slots
   each needs (the most micro-batches between forward and backward). */
static void mgpu__pipeline_check_order(mgpu_pipeline *pp, int m) {
    const char *who = "mgpu_pipeline_set_schedule";
    unsigned char *seen = (unsigned char *)mgpu__xcalloc((size_t)2 * m, 1);
    for (int s = 0; s < pp->nstages; s++) {
        const mgpu_pipeline_pass *order = pp->order + (size_t)s * 2 * m;
        int in_flight = 0, most = 0;
        char name[24];
        memset(seen, 0, (size_t)2 * m);
        for (int i = 0; i < 2 * m; i++) {
            mgpu_pipeline_pass pass = order[i];
            MGPU_REQUIRE(pass.backward != -1 || pass.micro_batch != -1,
                         "%s: the schedule left pass %d of stage %d unwritten; it must write 2m = %d passes", who, i,
                         s, 2 * m);
            MGPU_REQUIRE(pass.backward == 0 || pass.backward == 1,
                         "%s: the schedule's pass %d of stage %d has backward %d; want 0 (forward) or 1", who, i, s,
                         pass.backward);
            MGPU_REQUIRE(pass.micro_batch >= 0 && pass.micro_batch < m,
                         "%s: the schedule's pass %d of stage %d is for micro-batch %d; there are %d (0 to %d)",
                         who, i, s, pass.micro_batch, m, m - 1);
            int backward = pass.backward != 0;
            MGPU_REQUIRE(!seen[2 * pass.micro_batch + backward], "%s: the schedule runs %s twice on stage %d", who,
                         mgpu__pass_name(pass, name, sizeof name), s);
            MGPU_REQUIRE(!backward || seen[2 * pass.micro_batch],
                         "%s: the schedule runs %s on stage %d before that micro-batch's forward pass", who,
                         mgpu__pass_name(pass, name, sizeof name), s);
            seen[2 * pass.micro_batch + backward] = 1;
            in_flight += backward ? -1 : 1;
            if (in_flight > most) most = in_flight;
        }
        pp->stage[s].slots_wanted = most;
    }
    free(seen);
}

/* The order in which the host enqueues the passes: round after round,
   each stage's next pass once what it takes has been enqueued (a
   forward pass the stage before's, a backward pass the stage after's),
   so that every device's queue gets its passes in the schedule's order
   and no queue waits for work enqueued after it. A round with nothing
   ready is a schedule that waits for itself. */
static void mgpu__pipeline_sequence(mgpu_pipeline *pp, int m) {
    int p = pp->nstages, total = 2 * m * p, n = 0;
    int *next = (int *)mgpu__xcalloc((size_t)p, sizeof *next);
    unsigned char *done = (unsigned char *)mgpu__xcalloc((size_t)total, 1); /* [(s * m + j) * 2 + backward] */
    pp->sequence = (int *)mgpu__xrealloc(pp->sequence, (size_t)total * sizeof *pp->sequence);
    while (n < total) {
        int progress = 0;
        for (int s = 0; s < p; s++) {
            if (next[s] == 2 * m) continue;
            mgpu_pipeline_pass pass = pp->order[s * 2 * m + next[s]];
            int b = pass.backward != 0, j = pass.micro_batch, from = b ? s + 1 : s - 1;
            if (from >= 0 && from < p && !done[(from * m + j) * 2 + b]) continue;
            done[(s * m + j) * 2 + b] = 1;
            pp->sequence[n++] = s * 2 * m + next[s]++;
            progress = 1;
        }
        if (!progress) {
            char waits[512] = "", pass_name[24];
            size_t used = 0;
            for (int s = 0; s < p && used < sizeof waits; s++)
                if (next[s] < 2 * m)
                    used += (size_t)snprintf(waits + used, sizeof waits - used, "%sstage %d at %s", used ? ", " : "",
                                             s, mgpu__pass_name(pp->order[s * 2 * m + next[s]], pass_name,
                                                                sizeof pass_name));
            mgpu_fatal("mgpu_pipeline_set_schedule: the schedule waits for itself (%s: each needs a pass "
                       "that comes later on its neighbour)", waits);
        }
    }
    free(next);
    free(done);
}

/* The arrays of a step's tensors and events (empty between steps). */
static void mgpu__pipeline_free_step_state(mgpu_pipeline *pp) {
    for (int i = 0; pp->output_ready && i < pp->micro_batches * pp->nstages; i++) {
        mgpu_event_free(pp->output_ready[i]);
        mgpu_event_free(pp->input_grad_ready[i]);
    }
    free(pp->input);
    free(pp->output_grad);
    free((void *)pp->output);
    free(pp->input_grad);
    free(pp->output_ready);
    free(pp->input_grad_ready);
}

MGPU_DEF void mgpu_pipeline_set_schedule(mgpu_pipeline *pp, mgpu_schedule_fn schedule, int micro_batches) {
    MGPU_REQUIRE(schedule, "mgpu_pipeline_set_schedule: no schedule (mgpu_schedule_gpipe, mgpu_schedule_1f1b)");
    /* (each pass is a trace label, of which the library keeps 4096) */
    MGPU_REQUIRE(micro_batches >= 1 && micro_batches <= 2048,
                 "mgpu_pipeline_set_schedule: %d micro-batches; want 1 to 2048", micro_batches);
    int p = pp->nstages, m = micro_batches;
    mgpu__pipeline_free_step_state(pp);
    pp->micro_batches = m;
    /* (one pass more: a schedule that writes past its 2m is caught there) */
    pp->order = (mgpu_pipeline_pass *)mgpu__xrealloc(pp->order, ((size_t)2 * m * p + 1) * sizeof *pp->order);
    for (int s = 0; s < p; s++) {
        mgpu_pipeline_pass *order = pp->order + (size_t)s * 2 * m;
        for (int i = 0; i <= 2 * m; i++) order[i].backward = -1, order[i].micro_batch = -1; /* (unwritten) */
        schedule(s, p, m, order);
        MGPU_REQUIRE(order[2 * m].backward == -1 && order[2 * m].micro_batch == -1,
                     "mgpu_pipeline_set_schedule: the schedule wrote past stage %d's 2m = %d passes", s, 2 * m);
    }
    mgpu__pipeline_check_order(pp, m);
    mgpu__pipeline_sequence(pp, m);
    for (int s = 0; s < p; s++) {
        mgpu__pipeline_stage *st = &pp->stage[s];
        if (st->net && st->slots_wanted > st->nslots) { /* (across processes, this rank's stage alone) */
            st->slot = (mgpu_net **)mgpu__xrealloc(st->slot, (size_t)st->slots_wanted * sizeof *st->slot);
            st->slot_micro_batch =
                (int *)mgpu__xrealloc(st->slot_micro_batch, (size_t)st->slots_wanted * sizeof *st->slot_micro_batch);
            for (int k = st->nslots; k < st->slots_wanted; k++) st->slot[k] = mgpu__pipeline_new_slot(st, s > 0);
            st->nslots = st->slots_wanted;
        }
    }
    size_t n = (size_t)m * p;
    pp->input = (mgpu_tensor **)mgpu__xcalloc(n, sizeof(mgpu_tensor *));
    pp->output_grad = (mgpu_tensor **)mgpu__xcalloc(n, sizeof(mgpu_tensor *));
    pp->output = (const mgpu_tensor **)mgpu__xcalloc(n, sizeof(mgpu_tensor *));
    pp->input_grad = (mgpu_tensor **)mgpu__xcalloc(n, sizeof(mgpu_tensor *));
    pp->output_ready = (mgpu_event **)mgpu__xcalloc(n, sizeof(mgpu_event *));
    pp->input_grad_ready = (mgpu_event **)mgpu__xcalloc(n, sizeof(mgpu_event *));
    for (size_t i = 0; i < n; i++) {
        pp->output_ready[i] = mgpu_event_new();
        pp->input_grad_ready[i] = mgpu_event_new();
    }
}

/* The stage's optimizer state from the pipeline's network (to_stage), or
   back to it: momentum buffers, Adam's moments, the count of steps. */
static void mgpu__pipeline_move_state(mgpu_pipeline *pp, int s, int to_stage) {
    mgpu__pipeline_stage *st = &pp->stage[s];
    mgpu_net *from = to_stage ? pp->net : st->net, *to = to_stage ? st->net : pp->net;
    /* (the stage's parameter i is the network's first_param + i) */
    int from_i = to_stage ? st->first_param : 0, to_i = to_stage ? 0 : st->first_param;
    for (int i = 0; i < st->net->nparams; i++, from_i++, to_i++) {
        mgpu_tensor *state_from[2] = {from->momentum[from_i], from->second_moment[from_i]};
        mgpu_tensor **state_to[2] = {&to->momentum[to_i], &to->second_moment[to_i]};
        for (int k = 0; k < 2; k++) {
            if (!state_from[k]) continue;
            int scope = mgpu__memory_scope(MGPU_MEMORY_OPTIMIZER);
            mgpu_ensure(state_to[k], to->device, state_from[k]->shape);
            mgpu__memory_scope((mgpu_memory_category)scope);
            mgpu_copy(*state_to[k], state_from[k], 0);
        }
    }
    to->steps = from->steps;
}

/* The buffers (batch norm's running statistics) of layer l and its parts. */
static int mgpu__layer_buffers(const mgpu_layer *l) {
    if (!l) return 0;
    int n = l->running_mean ? 2 : 0;
    const mgpu_layer *parts[5] = {l->conv1, l->bn1, l->conv2, l->bn2, l->shortcut};
    for (int i = 0; i < 5 && l->kind == MGPU_LAYER_RESIDUAL; i++) n += mgpu__layer_buffers(parts[i]);
    return n;
}

/* A new pipeline of net in `stages` stages, stage s starting at layer
   first[s] (first[stages]: the end), after checking the cut. */
static mgpu_pipeline *mgpu__pipeline_cut(const char *who, mgpu_net *net, int stages, const int *first_layers,
                                         int *first) {
    MGPU_REQUIRE(stages >= 1 && stages <= MGPU_MAX_DEVICES, "%s: %d stages; want 1 to %d", who, stages,
                 MGPU_MAX_DEVICES);
    MGPU_REQUIRE(stages <= net->nlayers, "%s: %d stages for a network of %d layers; at most one stage a layer",
                 who, stages, net->nlayers);
    MGPU_REQUIRE(!net->wrapped, "%s: a wrapper holds this network already", who);
    MGPU_REQUIRE(!mgpu__net_synced(net), "%s: the network's batch norms are synchronised over a group "
                 "(mgpu_net_sync_batchnorm); a pipeline's stages hold different layers", who);
    for (int s = 0; s < stages; s++) {
        first[s] = first_layers ? first_layers[s] : s * net->nlayers / stages;
        MGPU_REQUIRE(s > 0 || first[0] == 0, "%s: stage 0 starts at layer %d; it must start at layer 0", who,
                     first[0]);
        MGPU_REQUIRE(first[s] >= 0 && first[s] < net->nlayers,
                     "%s: stage %d starts at layer %d, which does not exist (the network has layers 0 to %d)", who,
                     s, first[s], net->nlayers - 1);
        MGPU_REQUIRE(s == 0 || first[s] > first[s - 1],
                     "%s: stage %d starts at layer %d, not after stage %d's first layer (%d)", who, s, first[s],
                     s - 1, first[s - 1]);
    }
    first[stages] = net->nlayers;
    mgpu_pipeline *pp = (mgpu_pipeline *)mgpu__xcalloc(1, sizeof *pp);
    pp->net = net;
    pp->nstages = stages;
    return pp;
}

/* Stage s, layers first .. end - 1 of the pipeline's network, on dev: a
   network of copies of them with their state, and its first slot. */
static void mgpu__pipeline_build_stage(mgpu_pipeline *pp, int s, mgpu_device *dev, int first, int end,
                                       const char *who) {
    mgpu_net *net = pp->net;
    mgpu__pipeline_stage *st = &pp->stage[s];
    mgpu_net *sn = st->net = mgpu__net_like(net, dev);
    st->first_layer = first;
    st->first_param = net->first_param[first];
    for (int i = 0; i < first; i++) st->first_buffer += mgpu__layer_buffers(net->layers[i]);
    for (int i = first; i < end; i++) {
        mgpu__require_own_loops_on_cpu(net->layers[i], dev, who);
        mgpu__net_add(sn, mgpu__layer_clone(net->layers[i], dev, 0));
    }
    /* (the stage's first layer reads its input as it comes, not a batch
       norm's channels-last copy of it) */
    mgpu_layer *l = sn->layers[0];
    l->copies->input_from_batch_norm = 0;
    if (l->kind == MGPU_LAYER_RESIDUAL) {
        l->conv1->copies->input_from_batch_norm = 0;
        if (l->shortcut) l->shortcut->copies->input_from_batch_norm = 0;
    }
    mgpu_net_want_input_grad(sn, s > 0);
    sn->wrapped = MGPU__HELD_BY_PIPELINE; /* (mgpu_pipeline_stage hands it out; the pipeline frees it) */
    mgpu__pipeline_move_state(pp, s, 1);
    st->slot = (mgpu_net **)mgpu__xcalloc(1, sizeof *st->slot);
    st->slot_micro_batch = (int *)mgpu__xcalloc(1, sizeof *st->slot_micro_batch);
    st->slot[0] = sn;
    st->nslots = 1;
}

MGPU_DEF mgpu_pipeline *mgpu_pipeline_new(mgpu_net *net, mgpu_device *const *devices, int stages,
                                          const int *first_layers) {
    const char *who = "mgpu_pipeline_new";
    int first[MGPU_MAX_DEVICES + 1];
    mgpu_pipeline *pp = mgpu__pipeline_cut(who, net, stages, first_layers, first);
    for (int s = 0; s < stages; s++)
        if (!devices[s]) {
            free(pp);
            mgpu_fatal("%s: devices[%d] is NULL", who, s);
        }
    for (int s = 0; s < stages; s++)
        for (int t = 0; t < s; t++)
            if (devices[s] == devices[t]) {
                free(pp);
                mgpu_fatal("%s: %s is devices[%d] and devices[%d]; give each stage its own device (mgpu_devices "
                           "makes virtual ones)", who, devices[s]->name, t, s);
            }
    for (int s = 0; s < stages; s++) mgpu__pipeline_build_stage(pp, s, devices[s], first[s], first[s + 1], who);
    net->wrapped = MGPU__HELD_BY_PIPELINE;
    mgpu_pipeline_set_schedule(pp, mgpu_schedule_gpipe, 1);
    return pp;
}

MGPU_DEF mgpu_pipeline *mgpu_pipeline_new_group(mgpu_net *net, struct mgpu_group *g, const int *first_layers) {
    const char *who = "mgpu_pipeline_new_group";
    int first[MGPU_MAX_DEVICES + 1], stages = mgpu_group_size(g), rank = mgpu_group_rank(g);
    mgpu_pipeline *pp = mgpu__pipeline_cut(who, net, stages, first_layers, first);
    pp->group = g;
    pp->rank = rank;
    mgpu__pipeline_build_stage(pp, rank, net->device, first[rank], first[rank + 1], who);
    for (int s = 0; s < stages; s++) pp->stage[s].first_layer = first[s];
    net->wrapped = MGPU__HELD_BY_PIPELINE;
    mgpu_pipeline_set_schedule(pp, mgpu_schedule_gpipe, 1);
    return pp;
}

/* Rows first .. first + count - 1 of the batch's n are micro-batch j's
   (as torch.tensor_split: the first n mod m micro-batches a row more). */
static void mgpu__micro_batch_rows(int n, int m, int j, int *first, int *count) {
    *count = n / m + (j < n % m);
    *first = j * (n / m) + (j < n % m ? j : n % m);
}

/* Shape `row` (of one row) with `rows` rows. */
static mgpu_shape mgpu__rows_of(mgpu_shape row, int rows) {
    row.d[0] = rows;
    return row;
}

/* t, or where t is on another device, a copy of it on dev (*moved,
   freed after the step). */
static const mgpu_tensor *mgpu__on_device(const mgpu_tensor *t, mgpu_device *dev, mgpu_tensor **moved) {
    *moved = t->device == dev ? NULL : mgpu_to(t, dev, 1);
    return *moved ? *moved : t;
}

/* A copy on dev of what another stage sent (src, written once `ready`
   has passed), counted as category c. */
static mgpu_tensor *mgpu__pipeline_receive(const mgpu_tensor *src, mgpu_event *ready, mgpu_device *dev,
                                           mgpu_memory_category c) {
    int scope = mgpu__memory_scope(c);
    mgpu_tensor *t = mgpu_empty(dev, src->shape);
    mgpu__memory_scope((mgpu_memory_category)scope);
    mgpu__copy(t, src, 1, NULL, ready);
    return t;
}

/* Micro-batch j's forward pass on stage s, in a free slot, on what the
   stage before sent (the first stage: its rows of the batch). */
static void mgpu__pipeline_forward_pass(mgpu_pipeline *pp, int s, int j) {
    mgpu__pipeline_stage *st = &pp->stage[s];
    int m = pp->micro_batches, k = 0, first, count;
    while (st->slot_micro_batch[k] >= 0) k++; /* (the schedule's check counted enough slots) */
    st->slot_micro_batch[k] = j;
    mgpu_tensor **input = &pp->input[s * m + j];
    if (s == 0) {
        mgpu__micro_batch_rows(pp->x->shape.d[0], m, j, &first, &count);
        *input = mgpu_narrow(pp->x, first, count);
    } else if (pp->group) {
        mgpu__micro_batch_rows(pp->x->shape.d[0], m, j, &first, &count);
        int scope = mgpu__memory_scope(MGPU_MEMORY_ACTIVATIONS);
        *input = mgpu_empty(st->net->device, mgpu__rows_of(pp->row_output[s - 1], count));
        mgpu__memory_scope((mgpu_memory_category)scope);
        mgpu__group_p2p(pp->group, 0, *input, s - 1, NULL);
    } else {
        int from = (s - 1) * m + j;
        *input = mgpu__pipeline_receive(pp->output[from], pp->output_ready[from], st->net->device,
                                        MGPU_MEMORY_ACTIVATIONS);
    }
    st->slot[k]->segments = st->net->segments; /* (mgpu_net_checkpoint on the stage reaches its slots) */
    pp->output[s * m + j] = mgpu_net_forward(st->slot[k], *input);
    mgpu_event_record(pp->output_ready[s * m + j], st->net->device);
}

/* Micro-batch j's backward pass on stage s, on the gradient the stage
   after sent (the last stage: from its loss); then what the micro-batch
   held on this stage is freed, but its input's gradient, which the stage
   before takes. */
static void mgpu__pipeline_backward_pass(mgpu_pipeline *pp, int s, int j, mgpu_tensor *loss_sum) {
    const char *who = "mgpu_pipeline_forward_backward";
    mgpu__pipeline_stage *st = &pp->stage[s];
    int m = pp->micro_batches, k = 0, first, count, n = pp->labels->shape.d[0];
    while (st->slot_micro_batch[k] != j) k++;
    mgpu_net *slot = st->slot[k];
    mgpu__net_require_backward(slot, who);
    const mgpu_tensor *dy = NULL;
    if (s < pp->nstages - 1 && pp->group) {
        int scope = mgpu__memory_scope(MGPU_MEMORY_WORKSPACE);
        mgpu_tensor *received = pp->output_grad[s * m + j] = mgpu_empty(slot->device, pp->output[s * m + j]->shape);
        mgpu__memory_scope((mgpu_memory_category)scope);
        mgpu__group_p2p(pp->group, 0, received, s + 1, NULL);
        dy = received;
    } else if (s < pp->nstages - 1) {
        int from = (s + 1) * m + j;
        dy = pp->output_grad[s * m + j] = mgpu__pipeline_receive(pp->input_grad[from], pp->input_grad_ready[from],
                                                                 slot->device, MGPU_MEMORY_WORKSPACE);
        mgpu_free(pp->input_grad[from]); /* (safe once the copy that reads it is enqueued) */
        pp->input_grad[from] = NULL;
    } else {
        mgpu__micro_batch_rows(n, m, j, &first, &count);
        mgpu_tensor *labels = mgpu_narrow(pp->labels, first, count);
        dy = mgpu__net_loss_grad(slot, slot->layers[slot->nlayers - 1]->output, labels, 1.0f / (float)n,
                                 loss_sum, who, first);
        mgpu_free(labels); /* (safe once the work that reads it is enqueued) */
    }
    mgpu__net_backward(slot, dy, st->backward_passes++ > 0);
    if (s > 0) { /* (the layer lets go of it: the slot's next pass makes another) */
        pp->input_grad[s * m + j] = (mgpu_tensor *)mgpu_net_input_grad(slot);
        slot->layers[0]->dinput = NULL;
        mgpu_event_record(pp->input_grad_ready[s * m + j], slot->device);
    }
    for (int i = 0; i < slot->nlayers; i++) {
        mgpu__layer_free_activations(slot->layers[i], 0);
        mgpu__layer_free_gradients(slot->layers[i], 1);
    }
    mgpu_tensor **held[2] = {&pp->input[s * m + j], &pp->output_grad[s * m + j]};
    for (int h = 0; h < 2; h++) {
        mgpu_free(*held[h]);
        *held[h] = NULL;
    }
    st->slot_micro_batch[k] = -1;
}

/* Across processes, what each stage's output is for one row of the
   batch: a rank receives a tensor of that shape from the one before. A
   forward pass of one row of x through the whole network (which every
   rank has) in evaluation mode finds it, once for each shape of row. */
static void mgpu__pipeline_row_shapes(mgpu_pipeline *pp, const mgpu_tensor *x) {
    mgpu_shape row = mgpu__rows_of(x->shape, 1);
    if (mgpu_shape_equal(row, pp->x_row)) return;
    mgpu_net *net = pp->net;
    mgpu_tensor *one = mgpu_narrow(x, 0, 1), *moved = mgpu_to(one, net->device, 0);
    int training = net->training;
    net->training = 0;
    mgpu_net_forward(net, moved);
    net->training = training;
    for (int s = 0; s < pp->nstages; s++) {
        int last = (s + 1 < pp->nstages ? pp->stage[s + 1].first_layer : net->nlayers) - 1;
        pp->row_output[s] = net->layers[last]->output->shape;
    }
    for (int i = 0; i < net->nlayers; i++) mgpu__layer_free_activations(net->layers[i], 0);
    mgpu_free(one);
    mgpu_free(moved);
    pp->x_row = row;
}

MGPU_DEF void mgpu_pipeline_forward_backward(mgpu_pipeline *pp, const mgpu_tensor *x, const mgpu_tensor *labels,
                                             mgpu_tensor *loss_sum) {
    const char *who = "mgpu_pipeline_forward_backward";
    int p = pp->nstages, m = pp->micro_batches;
    mgpu__require_alive(x, who);
    mgpu__require_alive(labels, who);
    int n = x->shape.d[0];
    MGPU_REQUIRE(labels->shape.ndim == 1 && labels->shape.d[0] == n,
                 "%s: %d rows of x but labels of shape [%d%s]; want [%d]", who, n, labels->shape.d[0],
                 labels->shape.ndim == 1 ? "" : ", ...", n);
    MGPU_REQUIRE(n >= m, "%s: a batch of %d rows cannot make %d micro-batches", who, n, m);
    if (pp->stage[p - 1].net) mgpu__require_loss_sum(who, loss_sum, pp->stage[p - 1].net);
    for (int s = 0; s < p; s++) {
        mgpu__pipeline_stage *st = &pp->stage[s];
        st->backward_passes = 0;
        for (int k = 0; k < st->nslots; k++) st->slot_micro_batch[k] = -1;
    }
    pp->x = x;
    pp->labels = labels;
    if (pp->stage[0].net) pp->x = mgpu__on_device(x, pp->stage[0].net->device, &pp->x_moved);
    if (pp->stage[p - 1].net) pp->labels = mgpu__on_device(labels, pp->stage[p - 1].net->device, &pp->labels_moved);
    if (pp->group) mgpu__pipeline_row_shapes(pp, x);
    char label[24];
    for (int i = 0; i < 2 * m * p; i++) {
        int s = pp->sequence[i] / (2 * m), mine; /* (mine: this rank's tensors of the micro-batch) */
        mgpu_pipeline_pass pass = pp->order[pp->sequence[i]];
        if (mgpu__library.tracing) /* (a label looks its text up under the library's lock) */
            mgpu_trace_label(mgpu__pass_name(pass, label, sizeof label));
        if (pp->stage[s].net && pass.backward)
            mgpu__pipeline_backward_pass(pp, s, pass.micro_batch, loss_sum);
        else if (pp->stage[s].net)
            mgpu__pipeline_forward_pass(pp, s, pass.micro_batch);
        else if (!pass.backward && s == pp->rank + 1) { /* (the next rank comes to take our output) */
            mine = pp->rank * m + pass.micro_batch;
            mgpu__group_p2p(pp->group, 1, (mgpu_tensor *)pp->output[mine], s, pp->output_ready[mine]);
        } else if (pass.backward && s == pp->rank - 1) { /* (the rank before, our input's gradient) */
            mine = pp->rank * m + pass.micro_batch;
            mgpu__group_p2p(pp->group, 1, pp->input_grad[mine], s, pp->input_grad_ready[mine]);
            mgpu_free(pp->input_grad[mine]); /* (safe once the send that reads it is enqueued) */
            pp->input_grad[mine] = NULL;
        }
    }
    mgpu_trace_label(NULL);
    mgpu_free(pp->x_moved);
    mgpu_free(pp->labels_moved);
    pp->x = pp->labels = pp->x_moved = pp->labels_moved = NULL;
}

MGPU_DEF void mgpu_pipeline_step(mgpu_pipeline *pp, float lr, float momentum, float weight_decay) {
    for (int s = 0; s < pp->nstages; s++)
        if (pp->stage[s].net) mgpu_net_step(pp->stage[s].net, lr, momentum, weight_decay);
}
MGPU_DEF void mgpu_pipeline_train_step(mgpu_pipeline *pp, const mgpu_tensor *x, const mgpu_tensor *labels,
                                       float lr, float momentum, float weight_decay, mgpu_tensor *loss_sum) {
    mgpu__require_sgd_settings("mgpu_pipeline_train_step", lr, momentum, weight_decay);
    mgpu_pipeline_forward_backward(pp, x, labels, loss_sum);
    mgpu_pipeline_step(pp, lr, momentum, weight_decay);
}

MGPU_DEF void mgpu_pipelines_average_grads(mgpu_pipeline *const *pipes, int n) {
    MGPU_REQUIRE(n >= 1 && n <= MGPU_MAX_DEVICES, "mgpu_pipelines_average_grads: %d pipelines", n);
    for (int k = 0; k < n; k++)
        MGPU_REQUIRE(!pipes[k]->group, "mgpu_pipelines_average_grads: pipeline %d runs across processes; it "
                     "averages the pipelines of one process", k);
    for (int k = 1; k < n; k++) {
        MGPU_REQUIRE(pipes[k]->nstages == pipes[0]->nstages && pipes[k]->net->nparams == pipes[0]->net->nparams,
                     "mgpu_pipelines_average_grads: pipeline %d has %d stages and %d parameters, pipeline 0 %d and "
                     "%d; average pipelines of the same network, cut the same way", k, pipes[k]->nstages,
                     pipes[k]->net->nparams, pipes[0]->nstages, pipes[0]->net->nparams);
        for (int s = 0; s < pipes[0]->nstages; s++)
            MGPU_REQUIRE(pipes[k]->stage[s].first_layer == pipes[0]->stage[s].first_layer,
                         "mgpu_pipelines_average_grads: pipeline %d's stage %d starts at layer %d, pipeline 0's at "
                         "%d; average pipelines cut the same way", k, s, pipes[k]->stage[s].first_layer,
                         pipes[0]->stage[s].first_layer);
    }
    mgpu_tensor *grads[MGPU_MAX_DEVICES];
    for (int s = 0; s < pipes[0]->nstages; s++) {
        mgpu_net *first = pipes[0]->stage[s].net;
        for (int i = 0; i < first->nparams; i++) {
            for (int k = 0; k < n; k++) grads[k] = pipes[k]->stage[s].net->params[i]->grad;
            mgpu_ring_allreduce(grads, n, 1);
        }
        for (int k = 1; k < n; k++) /* (batch norm's statistics: pipeline 0's everywhere, as DDP broadcasts them) */
            for (int i = 0; i < first->nbuffers; i++)
                mgpu_copy(*pipes[k]->stage[s].net->buffers[i], *first->buffers[i], 1);
    }
}

MGPU_DEF void mgpu_pipeline_set_training(mgpu_pipeline *pp, int training) {
    for (int s = 0; s < pp->nstages; s++)
        for (int k = 0; k < pp->stage[s].nslots; k++) pp->stage[s].slot[k]->training = training;
}
MGPU_DEF mgpu_tensor *mgpu_pipeline_forward(mgpu_pipeline *pp, const mgpu_tensor *x) {
    mgpu__require_alive(x, "mgpu_pipeline_forward");
    MGPU_REQUIRE(!pp->group, "mgpu_pipeline_forward: the pipeline's stages are in several processes; run the "
                 "network whole on one of them (mgpu_pipeline_free gives each its stage's values)");
    const mgpu_tensor *h = x;
    for (int s = 0; s < pp->nstages; s++) {
        mgpu_net *sn = pp->stage[s].net;
        mgpu_tensor *moved = h->device == sn->device ? NULL : mgpu_to(h, sn->device, 1);
        h = mgpu_net_forward(sn, moved ? moved : h);
        mgpu_free(moved); /* (safe once the pass that reads it is enqueued) */
    }
    return (mgpu_tensor *)h;
}
static mgpu_tensor *mgpu__pipeline_forward_fn(void *pp, const mgpu_tensor *x) {
    return mgpu_pipeline_forward((mgpu_pipeline *)pp, x);
}
MGPU_DEF double mgpu_pipeline_evaluate_accuracy(mgpu_pipeline *pp, const mgpu_dataset *data, int batch_size) {
    MGPU_REQUIRE(!pp->group, "mgpu_pipeline_evaluate_accuracy: the pipeline's stages are in several processes; "
                 "evaluate the network whole on one of them (mgpu_pipeline_free gives each its stage's values)");
    int training = pp->stage[0].net->training;
    mgpu_pipeline_set_training(pp, 0);
    double accuracy = mgpu_evaluate_accuracy(mgpu__pipeline_forward_fn, pp, pp->stage[pp->nstages - 1].net->device,
                                             data, batch_size);
    mgpu_pipeline_set_training(pp, training);
    return accuracy;
}

MGPU_DEF int mgpu_pipeline_num_stages(const mgpu_pipeline *pp) { return pp->nstages; }
MGPU_DEF mgpu_net *mgpu_pipeline_stage(mgpu_pipeline *pp, int s) {
    MGPU_REQUIRE(s >= 0 && s < pp->nstages, "mgpu_pipeline_stage: stage %d of %d", s, pp->nstages);
    MGPU_REQUIRE(pp->stage[s].net, "mgpu_pipeline_stage: stage %d is rank %d's, this is rank %d", s, s, pp->rank);
    return pp->stage[s].net;
}
MGPU_DEF int mgpu_pipeline_slots(const mgpu_pipeline *pp, int s) {
    MGPU_REQUIRE(s >= 0 && s < pp->nstages, "mgpu_pipeline_slots: stage %d of %d", s, pp->nstages);
    return pp->stage[s].slots_wanted;
}

/* The stage whose compute queue ran a traced operation of this pipeline's
   passes, or -1 (another queue's, or not a pass: unlabelled, or labelled
   by someone else). Its pass in *pass. */
static int mgpu__pipeline_op_stage(const mgpu_pipeline *pp, const mgpu_trace_op *op, mgpu_pipeline_pass *pass) {
    char kind = 0, end = 0;
    if (op->lane != 0 || !op->label || sscanf(op->label, "%c%d%c", &kind, &pass->micro_batch, &end) != 2 ||
        (kind != 'F' && kind != 'B') || pass->micro_batch < 0 || pass->micro_batch >= pp->micro_batches)
        return -1;
    pass->backward = kind == 'B';
    for (int s = 0; s < pp->nstages; s++)
        if (pp->stage[s].net && op->device == pp->stage[s].net->device) return s;
    return -1;
}

MGPU_DEF mgpu_pipeline_timing mgpu_pipeline_measure(const mgpu_pipeline *pp) {
    mgpu_pipeline_timing t;
    memset(&t, 0, sizeof t);
    t.stages = pp->nstages;
    double lo = INFINITY, hi = -INFINITY;
    mgpu_pipeline_pass pass;
    for (int i = 0, n = mgpu_trace_count(); i < n; i++) {
        mgpu_trace_op op = mgpu_trace_get(i);
        int s = mgpu__pipeline_op_stage(pp, &op, &pass);
        if (s < 0) continue;
        t.busy_ms[s] += op.end_ms - op.start_ms;
        lo = fmin(lo, op.start_ms), hi = fmax(hi, op.end_ms);
    }
    MGPU_REQUIRE(hi > lo, "mgpu_pipeline_measure: the trace holds none of this pipeline's passes: run a step "
                          "between mgpu_trace_begin and mgpu_trace_end");
    t.span_ms = hi - lo;
    int measured = 0; /* (across processes, this rank's stage alone) */
    for (int s = 0; s < pp->nstages; s++)
        if (pp->stage[s].net) {
            t.bubble[s] = 1.0 - t.busy_ms[s] / t.span_ms;
            t.bubble_mean += t.bubble[s];
            measured++;
        }
    t.bubble_mean /= measured;
    return t;
}

MGPU_DEF int mgpu_pipeline_write_timeline(const mgpu_pipeline *pp, const char *path, const char *title) {
    int p = pp->nstages, m = pp->micro_batches, nbars = 2 * m * p;
    mgpu_timeline_bar *bars = (mgpu_timeline_bar *)mgpu__xcalloc((size_t)nbars, sizeof *bars);
    for (int b = 0; b < nbars; b++) { /* bar (s * m + j) * 2 + backward */
        mgpu_pipeline_pass pass = {b % 2, b / 2 % m};
        bars[b].lane = b / 2 / m;
        bars[b].start_ms = INFINITY, bars[b].end_ms = -INFINITY;
        snprintf(bars[b].name, sizeof bars[b].name, "%s", pass.backward ? "backward" : "forward");
        mgpu__pass_name(pass, bars[b].label, sizeof bars[b].label);
    }
    mgpu_pipeline_pass pass;
    for (int i = 0, n = mgpu_trace_count(); i < n; i++) {
        mgpu_trace_op op = mgpu_trace_get(i);
        int s = mgpu__pipeline_op_stage(pp, &op, &pass);
        if (s < 0) continue;
        mgpu_timeline_bar *bar = &bars[(s * m + pass.micro_batch) * 2 + pass.backward];
        bar->start_ms = fmin(bar->start_ms, op.start_ms);
        bar->end_ms = fmax(bar->end_ms, op.end_ms);
    }
    char names[MGPU_MAX_DEVICES][48];
    const char *lane_names[MGPU_MAX_DEVICES];
    for (int s = 0; s < p; s++) {
        if (pp->stage[s].net)
            snprintf(names[s], sizeof names[s], "stage %d (%s)", s, pp->stage[s].net->device->name);
        else
            snprintf(names[s], sizeof names[s], "stage %d (rank %d)", s, s);
        lane_names[s] = names[s];
    }
    int rc = mgpu_timeline_write_png(path, title, p, lane_names, nbars, bars);
    free(bars);
    return rc;
}

MGPU_DEF void mgpu_pipeline_free(mgpu_pipeline *pp) {
    if (!pp) return;
    mgpu_net *net = pp->net;
    net->wrapped = 0;
    net->changes++;
    for (int s = 0; s < pp->nstages; s++) {
        mgpu__pipeline_stage *st = &pp->stage[s];
        if (!st->net) continue; /* (another rank's) */
        for (int i = 0; i < st->net->nparams; i++)
            mgpu_copy(net->params[st->first_param + i]->value, st->net->params[i]->value, 0);
        for (int i = 0; i < st->net->nbuffers; i++)
            mgpu_copy(*net->buffers[st->first_buffer + i], *st->net->buffers[i], 0);
        mgpu__pipeline_move_state(pp, s, 0);
        st->net->wrapped = 0;
        for (int k = st->nslots - 1; k >= 0; k--) mgpu_net_free(st->slot[k]); /* (slot 0, the stage's net, last) */
        free(st->slot);
        free(st->slot_micro_batch);
    }
    mgpu__pipeline_free_step_state(pp);
    free(pp->order);
    free(pp->sequence);
    free(pp);
}

/* ======================================================================
   Distributed: process groups over MPI
   ====================================================================== */
struct mgpu_group {
    int rank, size, local_rank, local_size;
    char host[256]; /* (MPI_MAX_PROCESSOR_NAME in Open MPI) */
    long sequence;   /* the collectives of devices' tensors called so far: each one's number */
    long host_sequence; /* the same for the host's (barriers, all-gathers of host memory) */
    uint64_t id;     /* the same on every rank of the group, and no other group's */
    long splits;     /* the groups made from it so far (mgpu_group_first): their ids */
    int *world_ranks; /* each rank's in the job (whose watchers answer for it) */
    double timeout;  /* seconds a rank waits for the others (MGPU_DIST_TIMEOUT) */
    float *received; /* the chunks a reduction receives (used on one queue at a time) */
    size_t received_floats;
    mgpu_tensor *staging; /* pinned host memory that GPU tensors go through */
    mgpu_device *device;  /* the device of its collectives' tensors (set by the first) */
#if MGPU_MPI
    /* Two communicators, so that the collectives a communication queue
       runs and the caller's numbers on the host never meet in one
       communicator's order. */
    MPI_Comm comm, host_comm;
#endif
};

/* What the ranks run, in the order they call it. */
typedef enum {
    MGPU__ALLREDUCE, MGPU__BROADCAST, MGPU__ALL_GATHER, MGPU__REDUCE_SCATTER, MGPU__SEND, MGPU__RECV
} mgpu__coll_kind;
static const char *const mgpu__coll_names[] = {"allreduce", "broadcast", "all-gather", "reduce-scatter",
                                               "send", "receive"};
typedef struct mgpu__coll {
    mgpu_group *group;
    mgpu__coll_kind kind;
    mgpu_reduce_op op;
    int peer;       /* broadcast: the root; send, receive: the other rank */
    long sequence;
    size_t count;   /* the elements of `in` */
    const float *in;
    float *out;     /* (in == out where the collective works in place) */
} mgpu__coll;

/* A mistake that every rank sees at once: rank 0 alone writes the line
   and exits; the others wait to be stopped by the launcher, so that the
   job ends with one line instead of one a rank. */
MGPU_DEF void mgpu_group_fatal(const mgpu_group *g, const char *fmt, ...) {
    mgpu__dist_quiet = g->rank != 0;
    if (g->rank == 0) {
        va_list ap;
        va_start(ap, fmt);
        mgpu__vfatal(NULL, 0, fmt, ap);
    }
    struct timespec pause = {1, 0};
    for (double start = mgpu_now(); mgpu_now() - start < g->timeout;) nanosleep(&pause, NULL);
    _exit(1);
}

#if MGPU_MPI
/* "allreduce #12 of 61706 floats (mean)", "send of 100 floats to rank 2":
   what a collective is, for messages (a send or a receive, between two
   ranks only, has no number in the group's sequence). */
static void mgpu__coll_describe(const mgpu__coll *c, char *buf, size_t size) {
    int at = snprintf(buf, size, "%s", mgpu__coll_names[c->kind]);
    if (c->sequence) at += snprintf(buf + at, size - at, " #%ld", c->sequence);
    at += snprintf(buf + at, size - at, " of %zu floats", c->count);
    if (c->kind == MGPU__ALLREDUCE || c->kind == MGPU__REDUCE_SCATTER)
        snprintf(buf + at, size - at, " (%s)", c->op == MGPU_MEAN ? "mean" : "sum");
    else if (c->kind == MGPU__BROADCAST)
        snprintf(buf + at, size - at, " from rank %d", c->peer);
    else if (c->kind == MGPU__SEND || c->kind == MGPU__RECV)
        snprintf(buf + at, size - at, " %s rank %d", c->kind == MGPU__SEND ? "to" : "from", c->peer);
}

/* The collective this process is in, for the line it writes when the
   launcher stops it (mgpu__dist_on_signal). Two slots, so that the
   handler never reads one half written. */
static char mgpu__dist_doing[2][192];
static volatile sig_atomic_t mgpu__dist_doing_slot;
static void mgpu__dist_set_doing(const char *what) {
    int slot = !mgpu__dist_doing_slot;
    if (what)
        snprintf(mgpu__dist_doing[slot], sizeof mgpu__dist_doing[slot], "in %s", what);
    else
        snprintf(mgpu__dist_doing[slot], sizeof mgpu__dist_doing[slot], "between collectives");
    mgpu__dist_doing_slot = slot;
}
/* mpirun stops the other ranks with SIGTERM when one dies: each says
   where it was, in one line (write(2) alone: this is a signal handler). */
static void mgpu__dist_on_signal(int sig) {
    (void)sig;
    if (mgpu__dist_quiet) _exit(1);
    char line[384];
    size_t n = 0;
    const char *parts[] = {"mgpu: error: ", mgpu__error_prefix, "stopped by SIGTERM ",
                           mgpu__dist_doing[mgpu__dist_doing_slot],
                           " (mpirun stops every rank when one ends: its message names the rank)"};
    /* each part at most its slot's size: another thread may be rewriting
       the other slot, and a slot being rewritten may lack its NUL */
    for (size_t k = 0; k < sizeof parts / sizeof *parts; k++)
        for (size_t i = 0; i < sizeof mgpu__dist_doing[0] && parts[k][i] && n < sizeof line - 1; i++)
            line[n++] = parts[k][i];
    line[n++] = '\n';
    if (write(2, line, n) < 0) _exit(1);
    _exit(1);
}

#define MGPU__MPI_CHECK(call)                                                          \
    do {                                                                               \
        int mgpu__mpi_rc = (call);                                                     \
        if (mgpu__mpi_rc != MPI_SUCCESS) {                                             \
            char mgpu__mpi_text[MPI_MAX_ERROR_STRING];                                 \
            int mgpu__mpi_len = 0;                                                     \
            MPI_Error_string(mgpu__mpi_rc, mgpu__mpi_text, &mgpu__mpi_len);            \
            mgpu_fatal_at(__FILE__, __LINE__, "%s: %s", #call, mgpu__mpi_text);        \
        }                                                                              \
    } while (0)

/* ------------------------------------------------- watching the other ranks
   A rank that waits for the others does not wait blindly. Each process
   runs a watcher thread that answers, on a communicator of its own, what
   its process is doing: how far it has got (mgpu__progress, a count of the
   operations it has launched and run) and where it waits, if it does. A
   rank that has waited half the timeout asks the ranks it waits for, and
   again every half timeout. It goes on waiting while each of them has
   reached the same point or still makes progress; once it has waited the
   whole timeout, a rank that does not answer (stopped or dead), or that
   answers but has made no progress for the timeout (hung, or waiting in
   another collective: the ranks are out of step), is named, and the job
   stops. The lowest rank that sees it says so; a rank that knows a lower
   one waiting too leaves the saying to it. */
typedef enum { MGPU__ON_HOST, MGPU__ON_DEVICES, MGPU__POINT_TO_POINT } mgpu__wait_channel;
typedef struct mgpu__wait_point {
    uint64_t group;  /* the group's id */
    int channel;     /* an mgpu__wait_channel: whose sequence numbers it */
    int peer;        /* a send or a receive: the other rank, in the group */
    long number;     /* a collective: its number in its channel's sequence */
} mgpu__wait_point;

/* Where this process waits now: a slot a waiting thread (the caller's,
   for the host's collectives, and a communication queue's). */
#define MGPU__MAX_WAITS 8
static struct {
    pthread_mutex_t mutex;
    int used[MGPU__MAX_WAITS];
    mgpu__wait_point point[MGPU__MAX_WAITS];
    char what[MGPU__MAX_WAITS][96];
} mgpu__waits = {PTHREAD_MUTEX_INITIALIZER, {0}, {{0, 0, 0, 0}}, {""}};

/* What a watcher answers. */
typedef struct mgpu__watch_reply {
    long progress;
    int nwaits;
    mgpu__wait_point waits[MGPU__MAX_WAITS];
    char doing[96]; /* its first wait, described ("" when it waits in none) */
} mgpu__watch_reply;

/* The job's watchers: their communicator, and every rank's process. */
enum { MGPU__TAG_QUERY = 1, MGPU__TAG_REPLIES = 2 }; /* (a look's replies: a tag of their own, from 2 on) */
static struct {
    MPI_Comm comm;
    int rank, size, running;
    int *pids;
    char (*hosts)[64];
    pthread_t thread;
    int stop;
    int looks; /* the looks this process has made: each replies on a tag of its own */
} mgpu__watch;

static int mgpu__waits_enter(const mgpu__wait_point *at, const char *what) {
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&mgpu__waits.mutex));
    int slot = 0;
    while (slot < MGPU__MAX_WAITS && mgpu__waits.used[slot]) slot++;
    if (slot < MGPU__MAX_WAITS) { /* (more waits at once than slots: the extra ones go unreported) */
        mgpu__waits.used[slot] = 1;
        mgpu__waits.point[slot] = *at;
        snprintf(mgpu__waits.what[slot], sizeof mgpu__waits.what[slot], "%s", what);
    }
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__waits.mutex));
    return slot;
}
static void mgpu__waits_leave(int slot) {
    if (slot >= MGPU__MAX_WAITS) return;
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&mgpu__waits.mutex));
    mgpu__waits.used[slot] = 0;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__waits.mutex));
}

static void *mgpu__watcher(void *arg) {
    (void)arg;
    struct timespec pause = {0, 10000000};
    while (!__atomic_load_n(&mgpu__watch.stop, __ATOMIC_ACQUIRE)) {
        int found = 0, tag = 0;
        MPI_Message message;
        MGPU__MPI_CHECK(MPI_Improbe(MPI_ANY_SOURCE, MGPU__TAG_QUERY, mgpu__watch.comm, &found, &message,
                                    MPI_STATUS_IGNORE));
        if (!found) {
            nanosleep(&pause, NULL);
            continue;
        }
        MPI_Status status;
        MGPU__MPI_CHECK(MPI_Mrecv(&tag, 1, MPI_INT, &message, &status));
        mgpu__watch_reply reply;
        memset(&reply, 0, sizeof reply);
        reply.progress = __atomic_load_n(&mgpu__progress, __ATOMIC_RELAXED);
        MGPU__PTHREAD_CHECK(pthread_mutex_lock(&mgpu__waits.mutex));
        for (int k = 0; k < MGPU__MAX_WAITS; k++) {
            if (!mgpu__waits.used[k]) continue;
            if (!reply.nwaits) memcpy(reply.doing, mgpu__waits.what[k], sizeof reply.doing); /* (both 96 bytes) */
            reply.waits[reply.nwaits++] = mgpu__waits.point[k];
        }
        MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__waits.mutex));
        /* (a small message goes out at once, eagerly: this send does not
           wait for the asker, who may be gone) */
        MGPU__MPI_CHECK(MPI_Send(&reply, (int)sizeof reply, MPI_BYTE, status.MPI_SOURCE, tag, mgpu__watch.comm));
    }
    return NULL;
}

/* What a waiting rank has seen of another. */
typedef struct mgpu__rank_seen {
    int answered;         /* at the last look */
    long progress;
    double progress_since; /* when its progress last moved, as far as the looks saw */
    mgpu__watch_reply reply;
} mgpu__rank_seen;

/* The ranks of g that a wait at `at` needs: all others, or a send's or receive's peer. */
static int mgpu__waits_for(const mgpu_group *g, const mgpu__wait_point *at, int r) {
    return r != g->rank && (at->channel != MGPU__POINT_TO_POINT || r == at->peer);
}
/* Has rank r (its reply) reached the point `at` of rank me? */
static int mgpu__reached(const mgpu__watch_reply *reply, const mgpu__wait_point *at, int me) {
    for (int k = 0; k < reply->nwaits; k++) {
        const mgpu__wait_point *w = &reply->waits[k];
        if (w->group != at->group || w->channel != at->channel) continue;
        if (at->channel == MGPU__POINT_TO_POINT ? w->peer == me : w->number >= at->number) return 1;
    }
    return 0;
}

/* Asks the ranks the wait needs what they do (each answers within 2 s,
   or counts as not answering). Returns 1 if the wait's requests
   completed meanwhile: then nothing was judged. */
static int mgpu__watch_look(mgpu_group *g, const mgpu__wait_point *at, mgpu__rank_seen *seen,
                            MPI_Request *requests, int n) {
    int tag = MGPU__TAG_REPLIES + mgpu__watch.looks++ % 30000;
    MPI_Request *asked = (MPI_Request *)mgpu__xmalloc(sizeof *asked * (size_t)g->size);
    for (int r = 0; r < g->size; r++) {
        asked[r] = MPI_REQUEST_NULL;
        if (!mgpu__waits_for(g, at, r)) continue;
        int to = g->world_ranks[r];
        MGPU__MPI_CHECK(MPI_Irecv(&seen[r].reply, (int)sizeof seen[r].reply, MPI_BYTE, to, tag, mgpu__watch.comm,
                                  &asked[r]));
        MGPU__MPI_CHECK(MPI_Send(&tag, 1, MPI_INT, to, MGPU__TAG_QUERY, mgpu__watch.comm));
    }
    int completed = 0, all = 0;
    struct timespec pause = {0, 1000000};
    for (double start = mgpu_now(); !completed && !all && mgpu_now() - start < 2.0;) {
        MGPU__MPI_CHECK(MPI_Testall(n, requests, &completed, MPI_STATUSES_IGNORE));
        all = 1;
        for (int r = 0; r < g->size; r++) { /* (one at a time: MPI_Testall frees none until all are done) */
            int answered = 1;
            if (asked[r] != MPI_REQUEST_NULL) MGPU__MPI_CHECK(MPI_Test(&asked[r], &answered, MPI_STATUS_IGNORE));
            all &= answered;
        }
        nanosleep(&pause, NULL);
    }
    double now = mgpu_now();
    for (int r = 0; r < g->size; r++) {
        if (!mgpu__waits_for(g, at, r)) continue;
        int answered = asked[r] == MPI_REQUEST_NULL;
        if (!answered) { /* (a late answer comes on a tag no one listens to any more) */
            MGPU__MPI_CHECK(MPI_Cancel(&asked[r]));
            MGPU__MPI_CHECK(MPI_Wait(&asked[r], MPI_STATUS_IGNORE));
        }
        mgpu__rank_seen *s = &seen[r];
        if (answered && (!s->answered || s->reply.progress != s->progress || s->progress_since == 0)) {
            s->progress = s->reply.progress;
            s->progress_since = now;
        }
        s->answered = answered;
    }
    free(asked);
    return completed;
}

/* After a whole timeout: stops the job if a rank the wait needs does not
   answer, or makes no progress without having reached it. */
static void mgpu__watch_judge(mgpu_group *g, const mgpu__wait_point *at, const mgpu__rank_seen *seen,
                              const char *what) {
    char line[1536] = "";
    size_t used = 0;
    int lower_waiting = 0;
    double now = mgpu_now();
    for (int r = 0; r < g->size; r++) {
        if (!mgpu__waits_for(g, at, r)) continue;
        const mgpu__rank_seen *s = &seen[r];
        if (s->answered && r < g->rank && s->reply.nwaits) lower_waiting = 1;
        if (s->answered && (mgpu__reached(&s->reply, at, g->rank) || now - s->progress_since < g->timeout))
            continue;
        char why[160];
        if (!s->answered)
            snprintf(why, sizeof why, "it does not answer (stopped, or dead)");
        else if (s->reply.nwaits)
            snprintf(why, sizeof why, "it waits in %s", s->reply.doing);
        else
            snprintf(why, sizeof why, "it has made no progress for %.0f s", now - s->progress_since);
        int w = g->world_ranks[r];
        used += (size_t)snprintf(line + used, used < sizeof line ? sizeof line - used : 0,
                                 "%srank %d (host %s, pid %d) did not %s %s within %.0f s (MGPU_DIST_TIMEOUT): %s",
                                 used ? "; " : "", r, mgpu__watch.hosts[w], mgpu__watch.pids[w],
                                 at->channel == MGPU__POINT_TO_POINT ? "take part in" : "reach", what, g->timeout, why);
    }
    if (!used) return;
    if (lower_waiting) { /* (it will say it; if the launcher has not stopped us after a timeout, we do) */
        mgpu__dist_quiet = 1;
        struct timespec wait = {(time_t)g->timeout + 1, 0};
        while (nanosleep(&wait, &wait) != 0 && errno == EINTR) {}
        mgpu__dist_quiet = 0;
    }
    mgpu__error_is_mine_alone = 1;
    mgpu_fatal("%s", line);
}

/* Waits for MPI requests of group g at point `at` (`what` describes it),
   polling so that a rank that never comes is an error, not a hang
   (above). The poll yields, then sleeps longer and longer (20 us to
   10 ms): ranks that share cores must not spin on them while another
   rank still computes. */
static void mgpu__dist_wait(mgpu_group *g, const mgpu__wait_point *at, MPI_Request *requests, int n,
                            const char *what) {
    int slot = mgpu__waits_enter(at, what);
    mgpu__rank_seen *seen = NULL;
    double start = mgpu_now(), next_look = start + g->timeout / 2;
    long pause_ns = 20000;
    for (long polls = 0;; polls++) {
        int done = 0;
        MGPU__MPI_CHECK(MPI_Testall(n, requests, &done, MPI_STATUSES_IGNORE));
        if (done) break;
        if (mgpu_now() >= next_look) {
            if (!seen) seen = (mgpu__rank_seen *)mgpu__xcalloc((size_t)g->size, sizeof *seen);
            if (mgpu__watch_look(g, at, seen, requests, n)) break;
            if (mgpu_now() - start >= g->timeout) mgpu__watch_judge(g, at, seen, what);
            next_look = mgpu_now() + g->timeout / 2;
        }
        if (polls < 64) {
            sched_yield();
            continue;
        }
        struct timespec pause = {0, pause_ns};
        nanosleep(&pause, NULL);
        if (polls % 256 == 0 && pause_ns < 10000000) pause_ns *= 2;
    }
    free(seen);
    mgpu__waits_leave(slot);
}

/* The points of a group's collectives: a device collective's, a send's or
   a receive's, and the next host collective's (which numbers it). */
static mgpu__wait_point mgpu__coll_point(const mgpu__coll *c) {
    mgpu__wait_point at = {c->group->id, MGPU__ON_DEVICES, 0, c->sequence};
    if (c->kind == MGPU__SEND || c->kind == MGPU__RECV) {
        at.channel = MGPU__POINT_TO_POINT;
        at.peer = c->peer;
    }
    return at;
}
static void mgpu__coll_wait(const mgpu__coll *c, MPI_Request *request, const char *what) {
    mgpu__wait_point at = mgpu__coll_point(c);
    mgpu__dist_wait(c->group, &at, request, 1, what);
}
static mgpu__wait_point mgpu__host_point(mgpu_group *g) {
    mgpu__wait_point at = {g->id, MGPU__ON_HOST, 0, ++g->host_sequence};
    return at;
}

/* Before a collective the ranks compare what each is about to run. */
static void mgpu__coll_agree(const mgpu__coll *c) {
    mgpu_group *g = c->group;
    long long mine[5] = {c->sequence, c->kind, (long long)c->count, c->peer, c->op};
    long long *all = (long long *)mgpu__xmalloc(sizeof mine * (size_t)g->size);
    char what[128];
    mgpu__coll_describe(c, what, sizeof what);
    MPI_Request request;
    MGPU__MPI_CHECK(MPI_Iallgather(mine, 5, MPI_LONG_LONG, all, 5, MPI_LONG_LONG, g->comm, &request));
    mgpu__coll_wait(c, &request, what);
    for (int r = 0; r < g->size; r++) {
        if (memcmp(all + 5 * r, all, sizeof mine) == 0) continue;
        mgpu__coll calls[2] = {*c, *c}; /* rank 0's, rank r's */
        for (int k = 0; k < 2; k++) {
            const long long *w = all + 5 * (k ? r : 0);
            calls[k].sequence = w[0];
            calls[k].kind = (mgpu__coll_kind)w[1];
            calls[k].count = (size_t)w[2];
            calls[k].peer = (int)w[3];
            calls[k].op = (mgpu_reduce_op)w[4];
        }
        char a[160], b[160];
        mgpu__coll_describe(&calls[0], a, sizeof a);
        mgpu__coll_describe(&calls[1], b, sizeof b);
        free(all);
        mgpu_group_fatal(g, "the ranks are out of step: rank 0 called %s, rank %d called %s "
                             "(every rank must call the same collectives in the same order)", a, r, b);
    }
    free(all);
}

/* The received chunks' room, grown as needed (on the queue that runs the collective). */
static float *mgpu__group_received(mgpu_group *g, size_t floats) {
    if (floats > g->received_floats) {
        g->received = (float *)mgpu__xrealloc(g->received, floats * sizeof(float));
        g->received_floats = floats;
    }
    return g->received;
}

/* out[i] = the sum over ranks, in rank order, of their chunks: received
   holds `size` chunks of len floats, rank 0's first. */
static void mgpu__sum_chunks(float *out, const float *received, size_t len, int size, mgpu_reduce_op op) {
    float scale = 1.0f / (float)size;
    for (size_t i = 0; i < len; i++) {
        float s = received[i];
        for (int r = 1; r < size; r++) s += received[(size_t)r * len + i];
        out[i] = op == MGPU_MEAN ? s * scale : s;
    }
}

/* The allreduce: a reduce-scatter (rank r gets chunk r of every rank's
   vector and adds them in rank order), then an all-gather of the sums.
   Chunk c is [count c / size, count (c+1) / size). */
static void mgpu__mpi_allreduce(const mgpu__coll *c, const char *what) {
    mgpu_group *g = c->group;
    int size = g->size, me = g->rank;
    int *counts = (int *)mgpu__xmalloc(4 * sizeof(int) * (size_t)size);
    int *starts = counts + size, *mine = counts + 2 * size, *mine_at = counts + 3 * size;
    for (int r = 0; r < size; r++) {
        starts[r] = (int)(c->count * (size_t)r / (size_t)size);
        counts[r] = (int)(c->count * (size_t)(r + 1) / (size_t)size) - starts[r];
    }
    for (int r = 0; r < size; r++) {
        mine[r] = counts[me];
        mine_at[r] = r * counts[me];
    }
    float *received = mgpu__group_received(g, (size_t)counts[me] * (size_t)size);
    MPI_Request request;
    MGPU__MPI_CHECK(MPI_Ialltoallv(c->out, counts, starts, MPI_FLOAT, received, mine, mine_at, MPI_FLOAT,
                                   g->comm, &request));
    mgpu__coll_wait(c, &request, what);
    mgpu__sum_chunks(c->out + starts[me], received, (size_t)counts[me], size, c->op);
    MGPU__MPI_CHECK(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, c->out, counts, starts, MPI_FLOAT,
                                    g->comm, &request));
    mgpu__coll_wait(c, &request, what);
    free(counts);
}

/* in holds `size` chunks of count / size floats; rank r gets the sum of every rank's chunk r. */
static void mgpu__mpi_reduce_scatter(const mgpu__coll *c, const char *what) {
    mgpu_group *g = c->group;
    int len = (int)(c->count / (size_t)g->size);
    float *received = mgpu__group_received(g, c->count);
    MPI_Request request;
    MGPU__MPI_CHECK(MPI_Ialltoall(c->in, len, MPI_FLOAT, received, len, MPI_FLOAT, g->comm, &request));
    mgpu__coll_wait(c, &request, what);
    mgpu__sum_chunks(c->out, received, (size_t)len, g->size, c->op);
}

/* Runs a collective on host memory: the agreement, then MPI. */
static void mgpu__coll_run(const mgpu__coll *c) {
    mgpu_group *g = c->group;
    char what[128];
    mgpu__coll_describe(c, what, sizeof what);
    mgpu__dist_set_doing(what);
    if (c->kind != MGPU__SEND && c->kind != MGPU__RECV) mgpu__coll_agree(c);
    MPI_Request request;
    int n = (int)c->count;
    switch (c->kind) {
    case MGPU__ALLREDUCE: mgpu__mpi_allreduce(c, what); break;
    case MGPU__REDUCE_SCATTER: mgpu__mpi_reduce_scatter(c, what); break;
    case MGPU__BROADCAST:
        MGPU__MPI_CHECK(MPI_Ibcast(c->out, n, MPI_FLOAT, c->peer, g->comm, &request));
        mgpu__coll_wait(c, &request, what);
        break;
    case MGPU__ALL_GATHER:
        MGPU__MPI_CHECK(MPI_Iallgather(c->in, n, MPI_FLOAT, c->out, n, MPI_FLOAT, g->comm, &request));
        mgpu__coll_wait(c, &request, what);
        break;
    case MGPU__SEND:
        MGPU__MPI_CHECK(MPI_Isend(c->in, n, MPI_FLOAT, c->peer, 0, g->comm, &request));
        mgpu__coll_wait(c, &request, what);
        break;
    case MGPU__RECV:
        MGPU__MPI_CHECK(MPI_Irecv(c->out, n, MPI_FLOAT, c->peer, 0, g->comm, &request));
        mgpu__coll_wait(c, &request, what);
        break;
    }
    mgpu__dist_set_doing(NULL);
}

static void mgpu__coll_task(const void *args, const mgpu__exec *ex) {
    (void)ex;
    mgpu__coll_run((const mgpu__coll *)args);
}

/* The blocking calls that MPI gives no way to bound otherwise (its start,
   the making of communicators, its end) run under an alarm: a rank that
   does not come within the timeout ends the process with one line (rank
   0's: the others wait, silent, for the launcher, as mgpu__vfatal's do).
   Only write(2) and nanosleep: this is a signal handler. */
static char mgpu__guard_line[320];
static size_t mgpu__guard_length;
static int mgpu__guard_rank;
static void mgpu__guard_on_alarm(int sig) {
    (void)sig;
    if (mgpu__guard_rank > 0) {
        mgpu__dist_quiet = 1;
        struct timespec wait = {MGPU__ALIKE_ERROR_WAIT, 0};
        nanosleep(&wait, NULL);
    }
    if (write(2, mgpu__guard_line, mgpu__guard_length) < 0) _exit(1);
    _exit(1);
}
/* Starts the alarm for `what`, or stops it (what NULL). */
static void mgpu__dist_guard(const char *what, double timeout) {
    if (!what) {
        alarm(0);
        return;
    }
    mgpu__guard_rank = mgpu__launcher_rank();
    if (!mgpu__error_prefix[0] && mgpu__guard_rank >= 0)
        snprintf(mgpu__error_prefix, sizeof mgpu__error_prefix, "rank %d: ", mgpu__guard_rank);
    int n = snprintf(mgpu__guard_line, sizeof mgpu__guard_line,
                     "mgpu: error: %s%s: waited %.0f s for the other ranks (MGPU_DIST_TIMEOUT): a rank is stopped, "
                     "dead, or did not call it\n", mgpu__error_prefix, what, timeout);
    mgpu__guard_length = n < (int)sizeof mgpu__guard_line ? (size_t)n : sizeof mgpu__guard_line - 1;
    struct sigaction on_alarm;
    memset(&on_alarm, 0, sizeof on_alarm);
    on_alarm.sa_handler = mgpu__guard_on_alarm;
    MGPU_REQUIRE(sigaction(SIGALRM, &on_alarm, NULL) == 0, "sigaction: %s", strerror(errno));
    alarm((unsigned)ceil(timeout));
}

/* The job's watchers (above): every rank's process and host, then the thread. */
static void mgpu__watch_start(double timeout) {
    mgpu__dist_guard("start-up", timeout);
    MGPU__MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &mgpu__watch.comm));
    MGPU__MPI_CHECK(MPI_Comm_set_errhandler(mgpu__watch.comm, MPI_ERRORS_RETURN));
    MGPU__MPI_CHECK(MPI_Comm_rank(mgpu__watch.comm, &mgpu__watch.rank));
    MGPU__MPI_CHECK(MPI_Comm_size(mgpu__watch.comm, &mgpu__watch.size));
    size_t size = (size_t)mgpu__watch.size;
    mgpu__watch.pids = (int *)mgpu__xmalloc(sizeof(int) * size);
    mgpu__watch.hosts = (char (*)[64])mgpu__xcalloc(size, sizeof *mgpu__watch.hosts);
    int pid = (int)getpid();
    char host[64] = "";
    if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "unknown");
    MGPU__MPI_CHECK(MPI_Allgather(&pid, 1, MPI_INT, mgpu__watch.pids, 1, MPI_INT, mgpu__watch.comm));
    MGPU__MPI_CHECK(MPI_Allgather(host, sizeof host, MPI_CHAR, mgpu__watch.hosts, sizeof host, MPI_CHAR,
                                  mgpu__watch.comm));
    mgpu__dist_guard(NULL, 0);
    MGPU__PTHREAD_CHECK(pthread_create(&mgpu__watch.thread, NULL, mgpu__watcher, NULL));
    mgpu__watch.running = 1;
}
static void mgpu__watch_stop(void) {
    if (!mgpu__watch.running) return;
    __atomic_store_n(&mgpu__watch.stop, 1, __ATOMIC_RELEASE);
    MGPU__PTHREAD_CHECK(pthread_join(mgpu__watch.thread, NULL));
    mgpu__watch.running = 0;
    MGPU__MPI_CHECK(MPI_Comm_free(&mgpu__watch.comm));
    free(mgpu__watch.pids);
    free(mgpu__watch.hosts);
}

/* A group over comm, called id: its own two communicators, ranks and machine. */
static mgpu_group *mgpu__group_over(MPI_Comm comm, uint64_t id, double timeout) {
    mgpu_group *g = (mgpu_group *)mgpu__xcalloc(1, sizeof *g);
    g->id = id;
    g->timeout = timeout;
    mgpu__dist_guard("making a group", timeout);
    MGPU__MPI_CHECK(MPI_Comm_dup(comm, &g->comm));
    MGPU__MPI_CHECK(MPI_Comm_dup(comm, &g->host_comm));
    MGPU__MPI_CHECK(MPI_Comm_set_errhandler(g->comm, MPI_ERRORS_RETURN));
    MGPU__MPI_CHECK(MPI_Comm_set_errhandler(g->host_comm, MPI_ERRORS_RETURN));
    MGPU__MPI_CHECK(MPI_Comm_rank(comm, &g->rank));
    MGPU__MPI_CHECK(MPI_Comm_size(comm, &g->size));
    MPI_Comm local;
    MGPU__MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, g->rank, MPI_INFO_NULL, &local));
    MGPU__MPI_CHECK(MPI_Comm_rank(local, &g->local_rank));
    MGPU__MPI_CHECK(MPI_Comm_size(local, &g->local_size));
    MGPU__MPI_CHECK(MPI_Comm_free(&local));
    mgpu__dist_guard(NULL, 0);
    /* each rank's number in the job, whose watcher answers for it */
    MPI_Group mine, everyone;
    MGPU__MPI_CHECK(MPI_Comm_group(comm, &mine));
    MGPU__MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &everyone));
    int *ranks = (int *)mgpu__xmalloc(sizeof(int) * (size_t)g->size);
    g->world_ranks = (int *)mgpu__xmalloc(sizeof(int) * (size_t)g->size);
    for (int r = 0; r < g->size; r++) ranks[r] = r;
    MGPU__MPI_CHECK(MPI_Group_translate_ranks(mine, g->size, ranks, everyone, g->world_ranks));
    free(ranks);
    MGPU__MPI_CHECK(MPI_Group_free(&mine));
    MGPU__MPI_CHECK(MPI_Group_free(&everyone));
    char name[MPI_MAX_PROCESSOR_NAME + 1] = "";
    int length = 0;
    MGPU__MPI_CHECK(MPI_Get_processor_name(name, &length));
    memcpy(g->host, name, (size_t)length < sizeof g->host - 1 ? (size_t)length : sizeof g->host - 1);
    return g;
}
#endif /* MGPU_MPI */

/* A group of one: this process alone. */
static mgpu_group *mgpu__group_alone(void) {
    mgpu_group *g = (mgpu_group *)mgpu__xcalloc(1, sizeof *g);
    g->size = g->local_size = 1;
    if (gethostname(g->host, sizeof g->host - 1) != 0) snprintf(g->host, sizeof g->host, "localhost");
    return g;
}

static double mgpu__dist_timeout(void) {
    const char *v = getenv("MGPU_DIST_TIMEOUT");
    if (!v || !*v) return 120.0;
    char *end;
    double t = strtod(v, &end);
    MGPU_REQUIRE(*end == 0 && t > 0 && t <= 1e6, "MGPU_DIST_TIMEOUT=%s: want a number of seconds above 0, "
                 "up to 1000000", v);
    return t;
}

MGPU_DEF mgpu_group *mgpu_dist_init(int *argc, char ***argv) {
    mgpu__init();
    int launched = mgpu__launcher_size();
#if MGPU_MPI
    if (launched > 1) {
        double timeout = mgpu__dist_timeout();
        int provided = 0;
        /* (MPI_Init sizes its shared-memory files: past the file-size limit
           that raises SIGXFSZ, a death without a word, unless ignored as
           the files written whole ignore it; then MPI says what failed) */
        signal(SIGXFSZ, SIG_IGN);
        mgpu__dist_guard("MPI_Init", timeout);
        MGPU__MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided));
        mgpu__dist_guard(NULL, 0);
        MGPU_REQUIRE(provided == MPI_THREAD_MULTIPLE,
                     "mgpu_dist_init: this MPI does not allow calls from several threads "
                     "(MPI_THREAD_MULTIPLE), which the devices' queues make");
        mgpu__watch_start(timeout);
        mgpu_group *g = mgpu__group_over(MPI_COMM_WORLD, MGPU__FNV_OFFSET, timeout);
        snprintf(mgpu__error_prefix, sizeof mgpu__error_prefix, "rank %d: ", g->rank);
        mgpu__dist_set_doing(NULL);
        struct sigaction on_term;
        memset(&on_term, 0, sizeof on_term);
        on_term.sa_handler = mgpu__dist_on_signal;
        MGPU_REQUIRE(sigaction(SIGTERM, &on_term, NULL) == 0, "mgpu_dist_init: sigaction: %s", strerror(errno));
        return g;
    }
#else
    (void)argc;
    (void)argv;
    MGPU_REQUIRE(launched <= 1, "a launcher started %d copies of this program, but it was built without MPI, "
                 "so each would train alone: build it where mpi.h is found (apt-get install libopenmpi-dev)",
                 launched);
#endif
    mgpu_group *g = mgpu__group_alone();
    g->timeout = mgpu__dist_timeout();
    return g;
}

MGPU_DEF void mgpu_group_free(mgpu_group *g) {
    if (!g) return;
    mgpu_synchronize_all(); /* (the communication queues may still run its collectives) */
#if MGPU_MPI
    if (g->size > 1) {
        MGPU__MPI_CHECK(MPI_Comm_free(&g->comm));
        MGPU__MPI_CHECK(MPI_Comm_free(&g->host_comm));
    }
#endif
    free(g->world_ranks);
    mgpu_free(g->staging);
    free(g->received);
    free(g);
}

MGPU_DEF void mgpu_dist_finalize(mgpu_group *world) {
    if (!world) return;
    int distributed = world->size > 1;
    double timeout = world->timeout;
    /* (a barrier that names a rank that does not come: MPI_Finalize would wait for it without a word) */
    if (distributed) mgpu_group_barrier(world);
    mgpu_synchronize_all();
    mgpu_group_free(world);
#if MGPU_MPI
    if (distributed) {
        mgpu__watch_stop();
        mgpu__dist_guard("MPI_Finalize", timeout);
        MGPU__MPI_CHECK(MPI_Finalize());
        mgpu__dist_guard(NULL, 0);
    }
#else
    (void)distributed;
    (void)timeout;
#endif
}

MGPU_DEF int mgpu_group_rank(const mgpu_group *g) { return g->rank; }
MGPU_DEF int mgpu_group_size(const mgpu_group *g) { return g->size; }
MGPU_DEF int mgpu_group_local_rank(const mgpu_group *g) { return g->local_rank; }
MGPU_DEF int mgpu_group_local_size(const mgpu_group *g) { return g->local_size; }
MGPU_DEF const char *mgpu_group_host(const mgpu_group *g) { return g->host; }

MGPU_DEF int mgpu_group_devices(mgpu_group *g, int use_gpu, int n, mgpu_device **out) {
    MGPU_REQUIRE(n >= 1 && n <= MGPU_MAX_DEVICES, "mgpu_group_devices: %d devices; between 1 and %d", n,
                 MGPU_MAX_DEVICES);
    int gpus = use_gpu ? mgpu_num_gpus() : 0;
    for (int i = 0; i < n; i++)
        out[i] = gpus > 0 ? mgpu__device_get((g->local_rank * n + i) % gpus, i / gpus) : mgpu__device_get(-1, i);
    if (gpus == 0) mgpu__share_cpu_cores(g->local_size * n);
    return n;
}
MGPU_DEF mgpu_device *mgpu_group_device(mgpu_group *g, int use_gpu) {
    mgpu_device *dev;
    mgpu_group_devices(g, use_gpu, 1, &dev);
    return dev;
}

MGPU_DEF mgpu_group *mgpu_group_first(mgpu_group *g, int n) {
    MGPU_REQUIRE(n >= 1 && n <= g->size, "mgpu_group_first: %d ranks of a group of %d", n, g->size);
    mgpu_group *sub = NULL;
    long split = ++g->splits;
#if MGPU_MPI
    if (g->size > 1) {
        /* (every rank is here, or one is named, before the split, which cannot be bounded) */
        mgpu_group_barrier(g);
        MPI_Comm part;
        mgpu__dist_guard("mgpu_group_first", g->timeout);
        MGPU__MPI_CHECK(MPI_Comm_split(g->host_comm, g->rank < n ? 0 : MPI_UNDEFINED, g->rank, &part));
        mgpu__dist_guard(NULL, 0);
        if (part == MPI_COMM_NULL) return NULL;
        sub = n > 1 ? mgpu__group_over(part, mgpu__fnv1a(g->id, &split, sizeof split), g->timeout) : NULL;
        MGPU__MPI_CHECK(MPI_Comm_free(&part));
    }
#else
    (void)split;
#endif
    if (!sub) sub = mgpu__group_alone(); /* (n is 1) */
    sub->timeout = g->timeout;
    return sub;
}

MGPU_DEF const char *mgpu_group_path(const mgpu_group *g, const mgpu_device *dev) {
    if (g->size == 1) return "none";
    return dev->gpu >= 0 ? "mpi via host" : "mpi";
}

#if MGPU_MPI
/* Runs collective c for tensors in (read) and out (written; either may be
   NULL, both on one device). On a CPU device it runs on the device's
   communication queue, after what the compute queue was given so far, or
   given `ready` (a send: no out), after that event alone; the compute
   queue waits for it when `wait`. A GPU's tensors go through pinned host
   memory, on the calling thread. */
static const char *mgpu__group_run(mgpu_group *g, mgpu__coll c, const mgpu_tensor *in, mgpu_tensor *out,
                                   int wait, mgpu_event *ready) {
    mgpu_device *dev = (out ? out : in)->device;
    MGPU_REQUIRE(c.count <= INT_MAX, "a group's %s of %zu floats: more than MPI counts (%d)",
                 mgpu__coll_names[c.kind], c.count, INT_MAX);
    /* (one device, so that one thread runs the group's MPI calls, in order) */
    if (!g->device) g->device = dev;
    MGPU_REQUIRE(g->device == dev, "a group's %s: a tensor on %s, but the group's collectives run on %s: "
                 "use a group for one device", mgpu__coll_names[c.kind], dev->name, g->device->name);
    c.group = g;
    c.sequence = c.kind == MGPU__SEND || c.kind == MGPU__RECV ? 0 : ++g->sequence;
    if (g->size == 1) return "none"; /* (the callers did a group of one's work) */
    if (dev->gpu < 0) {
        mgpu_tensor *tensors[2] = {out ? out : (mgpu_tensor *)in, (mgpu_tensor *)in}; /* written (a send: read), read */
        if (ready && !out)
            mgpu__event_wait_on(&dev->queue[1], ready);
        else
            mgpu__comm_begin(tensors, 1);
        c.in = in ? in->data : NULL;
        c.out = out ? out->data : NULL;
        mgpu__launch_on(&dev->queue[1], mgpu__coll_names[c.kind], mgpu__coll_task, NULL, &c, sizeof c);
        mgpu__comm_track(tensors, in && out ? tensors + 1 : NULL, 1);
        if (wait) mgpu_comm_wait(&dev, 1);
        return mgpu_group_path(g, dev);
    }
    mgpu_synchronize(dev); /* (both queues: a collective of the process's own devices may still write t) */
    int in_place = in == out; /* (allreduce, broadcast: staged once) */
    size_t in_n = in && !in_place ? in->numel : 0, out_n = out ? out->numel : 0;
    if (!g->staging || g->staging->numel < in_n + out_n) {
        mgpu_free(g->staging);
        g->staging = mgpu_empty_pinned(mgpu_shape1((int)(in_n + out_n)));
    }
    mgpu_tensor *host_in = NULL, *host_out = NULL;
    if (in && !in_place) {
        mgpu_tensor *rows = mgpu_narrow(g->staging, 0, (int)in_n);
        host_in = mgpu_view(rows, in->shape);
        mgpu_free(rows);
        mgpu_copy(host_in, in, 0);
        c.in = host_in->data;
    }
    if (out) {
        mgpu_tensor *rows = mgpu_narrow(g->staging, (int)in_n, (int)out_n);
        host_out = mgpu_view(rows, out->shape);
        mgpu_free(rows);
        if (in_place) mgpu_copy(host_out, out, 0);
        c.out = host_out->data;
        if (in_place) c.in = c.out;
    }
    mgpu__coll_run(&c);
    if (out) mgpu_copy(out, host_out, 0);
    mgpu_free(host_in);
    mgpu_free(host_out);
    return mgpu_group_path(g, dev);
}

#else
static const char *mgpu__group_run(mgpu_group *g, mgpu__coll c, const mgpu_tensor *in, mgpu_tensor *out,
                                   int wait, mgpu_event *ready) {
    (void)c;
    (void)ready;
    (void)in;
    (void)out;
    (void)wait;
    (void)g;
    return "none"; /* without MPI a group is this process alone, whose work the callers did */
}
#endif

static void mgpu__require_group_tensor(const char *op, const mgpu_tensor *t) {
    MGPU_REQUIRE(t, "%s: the tensor is NULL", op);
    mgpu__require_alive(t, op);
}

static const char *mgpu__group_allreduce(const char *op, mgpu_group *g, mgpu_tensor *t, mgpu_reduce_op how,
                                         int wait) {
    mgpu__require_group_tensor(op, t);
    MGPU_REQUIRE(how == MGPU_SUM || how == MGPU_MEAN, "%s: op %d; want MGPU_SUM or MGPU_MEAN", op, (int)how);
    mgpu__coll c = {NULL, MGPU__ALLREDUCE, how, 0, 0, t->numel, NULL, NULL};
    return mgpu__group_run(g, c, t, t, wait, NULL);
}
MGPU_DEF const char *mgpu_group_allreduce(mgpu_group *g, mgpu_tensor *t, mgpu_reduce_op op) {
    return mgpu__group_allreduce("mgpu_group_allreduce", g, t, op, 1);
}
MGPU_DEF const char *mgpu_group_allreduce_start(mgpu_group *g, mgpu_tensor *t, mgpu_reduce_op op) {
    return mgpu__group_allreduce("mgpu_group_allreduce_start", g, t, op, 0);
}

MGPU_DEF void mgpu_group_broadcast(mgpu_group *g, mgpu_tensor *t, int root) {
    mgpu__require_group_tensor("mgpu_group_broadcast", t);
    MGPU_REQUIRE(root >= 0 && root < g->size, "mgpu_group_broadcast: root %d of a group of %d", root, g->size);
    mgpu__coll c = {NULL, MGPU__BROADCAST, MGPU_SUM, root, 0, t->numel, NULL, NULL};
    mgpu__group_run(g, c, t, t, 1, NULL);
}

MGPU_DEF void mgpu_group_all_gather(mgpu_group *g, const mgpu_tensor *in, mgpu_tensor *out) {
    mgpu__require_group_tensor("mgpu_group_all_gather", in);
    mgpu__require_group_tensor("mgpu_group_all_gather", out);
    MGPU_REQUIRE(out->numel == in->numel * (size_t)g->size && in->device == out->device,
                 "mgpu_group_all_gather: out must hold %d times in's %zu values, on in's device (%s); it holds %zu on %s",
                 g->size, in->numel, in->device->name, out->numel, out->device->name);
    if (g->size == 1) {
        mgpu_tensor *flat = mgpu_view(out, in->shape);
        mgpu_copy(flat, in, 0);
        mgpu_free(flat);
    }
    mgpu__coll c = {NULL, MGPU__ALL_GATHER, MGPU_SUM, 0, 0, in->numel, NULL, NULL};
    mgpu__group_run(g, c, in, out, 1, NULL);
}

MGPU_DEF void mgpu_group_reduce_scatter(mgpu_group *g, const mgpu_tensor *in, mgpu_tensor *out,
                                        mgpu_reduce_op op) {
    mgpu__require_group_tensor("mgpu_group_reduce_scatter", in);
    mgpu__require_group_tensor("mgpu_group_reduce_scatter", out);
    MGPU_REQUIRE(in->numel == out->numel * (size_t)g->size && in->device == out->device,
                 "mgpu_group_reduce_scatter: in must hold %d times out's %zu values, on out's device (%s); "
                 "it holds %zu on %s", g->size, out->numel, out->device->name, in->numel, in->device->name);
    MGPU_REQUIRE(op == MGPU_SUM || op == MGPU_MEAN, "mgpu_group_reduce_scatter: op %d; want MGPU_SUM or MGPU_MEAN",
                 (int)op);
    if (g->size == 1) {
        mgpu_tensor *flat = mgpu_view(in, out->shape);
        mgpu_copy(out, flat, 0);
        mgpu_free(flat);
    }
    mgpu__coll c = {NULL, MGPU__REDUCE_SCATTER, op, 0, 0, in->numel, NULL, NULL};
    mgpu__group_run(g, c, in, out, 1, NULL);
}

static void mgpu__require_peer(const char *op, const mgpu_group *g, int peer) {
    MGPU_REQUIRE(peer >= 0 && peer < g->size && peer != g->rank,
                 "%s: rank %d is not another rank of this group of %d (this is rank %d)", op, peer, g->size, g->rank);
}
MGPU_DEF void mgpu_group_send(mgpu_group *g, const mgpu_tensor *t, int to) {
    mgpu__require_group_tensor("mgpu_group_send", t);
    mgpu__require_peer("mgpu_group_send", g, to);
    mgpu__coll c = {NULL, MGPU__SEND, MGPU_SUM, to, 0, t->numel, NULL, NULL};
    mgpu__group_run(g, c, t, NULL, 1, NULL);
}
MGPU_DEF void mgpu_group_recv(mgpu_group *g, mgpu_tensor *t, int from) {
    mgpu__require_group_tensor("mgpu_group_recv", t);
    mgpu__require_peer("mgpu_group_recv", g, from);
    mgpu__coll c = {NULL, MGPU__RECV, MGPU_SUM, from, 0, t->numel, NULL, NULL};
    mgpu__group_run(g, c, NULL, t, 1, NULL);
}

static void mgpu__group_p2p(mgpu_group *g, int send, mgpu_tensor *t, int peer, mgpu_event *ready) {
    mgpu__require_peer(send ? "a pipeline's send" : "a pipeline's receive", g, peer);
    mgpu__coll c = {NULL, send ? MGPU__SEND : MGPU__RECV, MGPU_SUM, peer, 0, t->numel, NULL, NULL};
    /* (the compute queue waits for a receive, not for a send: the next
       stage takes it when it comes to it) */
    mgpu__group_run(g, c, send ? t : NULL, send ? NULL : t, !send, ready);
}

/* The host's collectives, on the caller's thread and communicator,
   numbered in one sequence: "barrier #7", "mgpu_group_sum_host #8". */
#if MGPU_MPI
static void mgpu__host_wait(mgpu_group *g, MPI_Request *request, const char *op) {
    mgpu__wait_point at = mgpu__host_point(g);
    char what[96];
    snprintf(what, sizeof what, "%s #%ld", op, at.number);
    mgpu__dist_set_doing(what);
    mgpu__dist_wait(g, &at, request, 1, what);
    mgpu__dist_set_doing(NULL);
}
#endif
static void mgpu__group_all_gather_bytes(mgpu_group *g, const void *mine, size_t bytes, void *all, const char *op) {
    MGPU_REQUIRE(bytes <= INT_MAX, "%s: %zu bytes a rank, more than MPI counts (%d)", op, bytes, INT_MAX);
    if (g->size == 1) {
        memcpy(all, mine, bytes);
        return;
    }
#if MGPU_MPI
    MPI_Request request;
    MGPU__MPI_CHECK(MPI_Iallgather(mine, (int)bytes, MPI_BYTE, all, (int)bytes, MPI_BYTE, g->host_comm, &request));
    mgpu__host_wait(g, &request, op);
#endif
}
MGPU_DEF void mgpu_group_all_gather_host(mgpu_group *g, const void *mine, size_t bytes, void *all) {
    mgpu__group_all_gather_bytes(g, mine, bytes, all, "mgpu_group_all_gather_host");
}
/* Summed in rank order, from every rank's numbers: every rank gets the same bits. */
MGPU_DEF void mgpu_group_sum_host(mgpu_group *g, double *values, int n) {
    if (g->size == 1) return;
    double *all = (double *)mgpu__xmalloc(sizeof(double) * (size_t)n * (size_t)g->size);
    mgpu__group_all_gather_bytes(g, values, sizeof(double) * (size_t)n, all, "mgpu_group_sum_host");
    for (int i = 0; i < n; i++) {
        double s = all[i];
        for (int r = 1; r < g->size; r++) s += all[(size_t)r * (size_t)n + (size_t)i];
        values[i] = s;
    }
    free(all);
}
/* Everything enqueued before it is done on every rank. */
MGPU_DEF void mgpu_group_barrier(mgpu_group *g) {
    mgpu_synchronize_all();
#if MGPU_MPI
    if (g->size == 1) return;
    MPI_Request request;
    MGPU__MPI_CHECK(MPI_Ibarrier(g->host_comm, &request));
    mgpu__host_wait(g, &request, "barrier");
#else
    (void)g;
#endif
}

/* -------------------------------------------- data parallelism across processes */
/* A hash of what a network is made of: its parameters' and buffers' shapes. */
static uint64_t mgpu__net_structure_hash(const mgpu_net *net) {
    int counts[2] = {net->nparams, net->nbuffers};
    uint64_t h = mgpu__fnv1a(MGPU__FNV_OFFSET, counts, sizeof counts);
    for (int i = 0; i < mgpu__net_num_saved(net, 0); i++) {
        mgpu_shape s = (*mgpu__net_saved(net, i))->shape;
        h = mgpu__fnv1a(h, &s, sizeof s);
    }
    return h;
}
/* A hash of a network's values: its parameters' and buffers' bits. */
static uint64_t mgpu__net_values_hash(const mgpu_net *net) {
    uint64_t h = MGPU__FNV_OFFSET;
    for (int i = 0; i < mgpu__net_num_saved(net, 0); i++) {
        uint64_t one = mgpu__values_checksum(*mgpu__net_saved(net, i));
        h = mgpu__fnv1a(h, &one, sizeof one);
    }
    return h;
}
/* The first rank whose hash is not rank 0's, or -1. */
static int mgpu__group_first_different(mgpu_group *g, uint64_t mine, const char *op) {
    uint64_t *all = (uint64_t *)mgpu__xmalloc(sizeof mine * (size_t)g->size);
    mgpu__group_all_gather_bytes(g, &mine, sizeof mine, all, op);
    int differs = -1;
    for (int r = 1; r < g->size && differs < 0; r++)
        if (all[r] != all[0]) differs = r;
    free(all);
    return differs;
}

/* The optimizer's state goes with the parameters (a checkpoint that rank
   0 alone loaded): rank 0's count of steps, and its momentum buffers (and
   Adam's second moments) where it has them (none on every rank where it
   has none). */
static void mgpu__group_broadcast_sgd_state(mgpu_group *g, mgpu_net *net) {
    long mine[2] = {net->steps, mgpu__net_has_momentum(net)};
    long *all = (long *)mgpu__xmalloc(sizeof mine * (size_t)g->size);
    mgpu__group_all_gather_bytes(g, mine, sizeof mine, all, "mgpu_distributed_data_parallel_new");
    net->steps = (int)all[0];
    mgpu__net_keep_momentum(net, (int)all[1]);
    for (int p = 0; p < net->nparams && all[1]; p++) {
        mgpu_group_broadcast(g, net->momentum[p], 0);
        if (net->adam) mgpu_group_broadcast(g, net->second_moment[p], 0);
    }
    free(all);
}

MGPU_DEF mgpu_data_parallel *mgpu_distributed_data_parallel_new(mgpu_net *net, mgpu_group *g) {
    return mgpu_distributed_data_parallel_new_devices(net, &net->device, 1, g);
}

MGPU_DEF mgpu_data_parallel *mgpu_distributed_data_parallel_new_devices(mgpu_net *net, mgpu_device *const *devices,
                                                                        int n, mgpu_group *g) {
    const char *op = "mgpu_distributed_data_parallel_new";
    if (n > 1 && mgpu__net_synced(net))
        mgpu_group_fatal(g, "%s: the network's batch norms are synchronised over a group "
                            "(mgpu_net_sync_batchnorm): that needs one device a process, not %d", op, n);
    int r = mgpu__group_first_different(g, mgpu__net_structure_hash(net), op);
    if (r >= 0)
        mgpu_group_fatal(g, "%s: rank %d built another network than rank 0 (its parameters' or buffers' "
                             "shapes differ): every rank must build the same one", op, r);
    for (int i = 0; i < mgpu__net_num_saved(net, 0); i++) mgpu_group_broadcast(g, *mgpu__net_saved(net, i), 0);
    mgpu__group_broadcast_sgd_state(g, net);
    r = mgpu__group_first_different(g, mgpu__net_values_hash(net), op);
    if (r >= 0)
        mgpu_group_fatal(g, "%s: after the broadcast from rank 0, rank %d's parameters differ from rank 0's",
                             op, r);
    net->changes++;
    mgpu_data_parallel *dp = mgpu_data_parallel_new(net, devices, n, MGPU_DP_ALLREDUCE);
    dp->group = g;
    dp->algorithm = mgpu__dp_reduces(dp) ? NULL : "none";
    return dp;
}

/* Bucket b of a distributed wrapper: summed over this process's devices
   (chapter 3's ring, or NCCL), averaged over the ranks from devices[0]
   (whose communication queue runs the group's allreduce after its part
   of the ring), then copied to the other devices, each on its own
   communication queue once devices[0]'s is done. devices[0]'s queue then
   waits for those copies: once it is done, nothing reads its bucket any
   more (mgpu_comm_wait relies on this). */
static const char *mgpu__dp_reduce_bucket_over_ranks(mgpu_data_parallel *dp, int b) {
    mgpu_tensor **bucket = dp->bucket[b];
    const char *local = dp->n > 1 ? mgpu_allreduce_start(bucket, dp->n, 0, dp->scratch[b]) : "none";
    if (mgpu_group_size(dp->group) == 1) return local; /* (chapter 3's wrapper) */
    const char *path = mgpu__group_allreduce("mgpu_data_parallel_step", dp->group, bucket[0], MGPU_MEAN, 0);
    if (dp->n == 1) return path;
    mgpu__queue *first = &dp->devices[0]->queue[1];
    for (int i = 1; i < dp->n; i++) {
        mgpu__queue *q = &dp->devices[i]->queue[1];
        mgpu__queue_wait_queue(q, first);
        mgpu__memcpy_args copy = {bucket[i]->data, bucket[0]->data, bucket[0]->numel * sizeof(float),
                                  dp->devices[i]->gpu, dp->devices[0]->gpu};
        mgpu__launch_on(q, "copy of the ranks' mean", mgpu__memcpy_cpu, MGPU__CUDA_FN(mgpu__memcpy_cuda), &copy,
                        sizeof copy);
    }
    for (int i = 1; i < dp->n; i++) mgpu__queue_wait_queue(first, &dp->devices[i]->queue[1]);
    mgpu__comm_track(bucket, NULL, dp->n);
    snprintf(dp->algorithm_name, sizeof dp->algorithm_name, "%s, then %s", local, path);
    return dp->algorithm_name;
}

/* Rank r of size evaluates rows [n r / size, n (r + 1) / size) of the
   data set, with rank 0's network: the buffers are broadcast first. */
MGPU_DEF void mgpu_net_sync_batchnorm(mgpu_net *net, mgpu_group *g) {
    MGPU_REQUIRE(!net->wrapped, "mgpu_net_sync_batchnorm: a wrapper holds this network already; "
                 "synchronise its batch norms before making the wrapper");
    mgpu_layer **bns = (mgpu_layer **)mgpu__xmalloc(sizeof *bns * (2 * (size_t)net->nlayers + 1));
    int count = mgpu__net_batch_norms(net, bns);
    for (int i = 0; i < count; i++) bns[i]->sync = g;
    free(bns);
}

MGPU_DEF double mgpu_dist_evaluate_accuracy(mgpu_group *g, mgpu_net *net, const mgpu_dataset *data,
                                            int batch_size) {
    int first = (int)((long long)data->n * g->rank / g->size);
    int last = (int)((long long)data->n * (g->rank + 1) / g->size);
    size_t pixels = (size_t)data->rows * (size_t)data->cols;
    mgpu_dataset part = {last - first, data->rows, data->cols, data->images + pixels * (size_t)first,
                         data->labels + first};
    /* rank 0's running statistics: each rank's moved with its own shard since the last step's broadcast */
    for (int i = 0; i < net->nbuffers; i++) mgpu_group_broadcast(g, *net->buffers[i], 0);
    double correct = part.n > 0 ? mgpu__net_count_correct(net, &part, batch_size) : 0.0;
    mgpu_group_sum_host(g, &correct, 1);
    return correct / (double)data->n;
}
/* ======================================================================
   Tensor parallelism: layers split across devices (see the manual)
   ====================================================================== */

MGPU_DEF size_t mgpu_all_gather_bytes(size_t bytes, int k) { return bytes * (size_t)(k - 1) / (size_t)k; }
MGPU_DEF size_t mgpu_allreduce_bytes(size_t bytes, int k) { return 2 * bytes * (size_t)(k - 1) / (size_t)k; }
MGPU_DEF size_t mgpu_data_parallel_bytes(size_t parameters, int k) {
    return mgpu_allreduce_bytes(parameters * sizeof(float), k);
}

/* k devices, distinct (each holds one slice). */
static void mgpu__tp_require_devices(const char *op, mgpu_device *const *devices, int k) {
    MGPU_REQUIRE(k >= 1 && k <= MGPU_MAX_DEVICES, "%s: k = %d; the number of devices must be between 1 and %d",
                 op, k, MGPU_MAX_DEVICES);
    for (int i = 0; i < k; i++) {
        MGPU_REQUIRE(devices[i] != NULL, "%s: devices[%d] is NULL", op, i);
        for (int j = 0; j < i; j++)
            MGPU_REQUIRE(devices[j] != devices[i], "%s: %s is given twice (devices[%d] and [%d]); each device "
                         "holds one slice (mgpu_devices makes virtual devices)", op, devices[i]->name, j, i);
    }
}

static void mgpu__tp_require_shape(const char *op, const char *name, const mgpu_tensor *t, mgpu_shape want) {
    char got[64], expected[64];
    MGPU_REQUIRE(t != NULL, "%s: %s is NULL", op, name);
    mgpu__require_alive(t, op);
    MGPU_REQUIRE(mgpu_shape_equal(t->shape, want), "%s: %s has shape %s; it must be %s", op, name,
                 mgpu_shape_str(t->shape, got, sizeof got), mgpu_shape_str(want, expected, sizeof expected));
}

/* An input of a pass comes on devices[0] (the manual's convention). */
static void mgpu__tp_require_on_first(const char *op, const char *name, const mgpu_tensor *t,
                                      mgpu_device *const *devices) {
    MGPU_REQUIRE(t != NULL, "%s: %s is NULL", op, name);
    mgpu__require_alive(t, op);
    MGPU_REQUIRE(t->device == devices[0], "%s: %s is on %s; it must be on devices[0] (%s)", op, name,
                 t->device->name, devices[0]->name);
}
/* A backward pass's output gradient: after a forward pass (output, its
   output on devices[0], not NULL), on devices[0], of output's shape. */
static void mgpu__tp_require_output_grad(const char *op, const char *name, const mgpu_tensor *t,
                                         const mgpu_tensor *output, mgpu_device *const *devices) {
    MGPU_REQUIRE(output != NULL, "%s: no forward pass before it; the backward pass needs its input", op);
    mgpu__tp_require_on_first(op, name, t, devices);
    mgpu__tp_require_shape(op, name, t, output->shape);
}

/* `shape` with dimension `dim` cut into k equal parts: one device's slice. */
static mgpu_shape mgpu__tp_slice_shape(mgpu_shape shape, int dim, int k) {
    shape.d[dim] /= k;
    return shape;
}

/* Copies slice j of a whole tensor, cut into k equal parts along
   dimension dim, between the whole and a tensor holding that slice alone
   (the part): from src, the whole, into dst, the part (into_whole 0), or
   from src, the part, into dst, the whole (into_whole 1). In row-major memory
   the slice is not one run of values unless dim is 0: call "rows" the
   indices of the dimensions before dim; each row of `whole` holds its k
   slices one after the other, so slice j of a row is one run, and the
   rows lie one whole row apart. One copy a row: [N, C, H, W] cut along
   channels takes one copy an image; [in, hidden] cut along columns, one
   an input row; a cut along dimension 0 is a single copy. Between two
   devices, or on one (a copy into a contiguous tensor). Non-blocking:
   the copies order themselves with the devices' queues. */
static void mgpu__tp_copy_slice(mgpu_tensor *dst, const mgpu_tensor *src, int dim, int j, int k,
                                int into_whole) {
    const mgpu_tensor *whole = into_whole ? dst : src, *part = into_whole ? src : dst;
    int rows = 1;
    for (int d = 0; d < dim; d++) rows *= whole->shape.d[d];
    int run = (int)(part->numel / (size_t)rows); /* values of one slice of one row */
    mgpu_tensor *whole_runs = mgpu_view(whole, mgpu_shape2(rows * k, run)); /* row r, slice j: r k + j */
    mgpu_tensor *part_runs = mgpu_view(part, mgpu_shape2(rows, run));
    for (int r = 0; r < rows; r++) {
        mgpu_tensor *in_whole = mgpu_narrow(whole_runs, r * k + j, 1), *in_part = mgpu_narrow(part_runs, r, 1);
        mgpu_copy(into_whole ? in_whole : in_part, into_whole ? in_part : in_whole, 1);
        mgpu_free(in_whole);
        mgpu_free(in_part);
    }
    mgpu_free(whole_runs);
    mgpu_free(part_runs);
}

/* Device j's slice of a parameter, a new tensor on devices[j] counted
   with the parameters; its gradient (*grad) of the same shape, zero,
   with the gradients. */
static mgpu_tensor *mgpu__tp_parameter_slice(const mgpu_tensor *whole, int dim, int j, int k, mgpu_device *dev,
                                             mgpu_tensor **grad) {
    mgpu_tensor *part = mgpu_empty(dev, mgpu__tp_slice_shape(whole->shape, dim, k));
    mgpu__memory_recount(part, MGPU_MEMORY_PARAMETERS);
    mgpu__tp_copy_slice(part, whole, dim, j, k, 0);
    *grad = mgpu_zeros(dev, part->shape);
    mgpu__memory_recount(*grad, MGPU_MEMORY_GRADIENTS);
    return part;
}

/* The input of a pass on every device: devices[0]'s is the caller's
   tensor itself, the others copies of it into the block's buffers. */
static void mgpu__tp_replicate(const mgpu_tensor *t, mgpu_tensor **copies, mgpu_device *const *devices, int k,
                               const mgpu_tensor **on_device) {
    on_device[0] = t;
    for (int i = 1; i < k; i++) {
        mgpu_copy(mgpu_ensure(&copies[i], devices[i], t->shape), t, 1);
        on_device[i] = copies[i];
    }
}

/* ------------------------------------------- the convolution, split by channels */
struct mgpu_tp_conv {
    int k, stride, pad;
    mgpu_device *devices[MGPU_MAX_DEVICES];
    mgpu_tensor *weight[MGPU_MAX_DEVICES], *bias[MGPU_MAX_DEVICES];   /* device j's filters */
    mgpu_tensor *dweight[MGPU_MAX_DEVICES], *dbias[MGPU_MAX_DEVICES];
    const mgpu_tensor *x[MGPU_MAX_DEVICES];      /* the last forward's input, on each device */
    mgpu_tensor *x_copy[MGPU_MAX_DEVICES];       /* its copies on devices 1.. */
    mgpu_tensor *y_part[MGPU_MAX_DEVICES], *y[MGPU_MAX_DEVICES];     /* device j's channels; all of them */
    mgpu_tensor *dy_part[MGPU_MAX_DEVICES], *dx[MGPU_MAX_DEVICES];   /* dx: device j's part, then the sum */
    mgpu_tp_bytes bytes;
};

MGPU_DEF mgpu_tp_conv *mgpu_tp_conv_new(const mgpu_tensor *weight, const mgpu_tensor *bias, int stride,
                                        int pad, mgpu_device *const *devices, int k) {
    const char *op = "mgpu_tp_conv_new";
    char sw[64];
    mgpu__tp_require_devices(op, devices, k);
    MGPU_REQUIRE(weight != NULL, "%s: weight is NULL", op);
    mgpu__require_alive(weight, op);
    MGPU_REQUIRE(weight->shape.ndim == 4, "%s: weight has shape %s; it must be [K, C, R, S]", op,
                 mgpu_shape_str(weight->shape, sw, sizeof sw));
    int out_channels = weight->shape.d[0];
    mgpu__tp_require_shape(op, "bias", bias, mgpu_shape1(out_channels));
    MGPU_REQUIRE(out_channels % k == 0, "%s: %d output channels do not split into k = %d equal slices "
                 "(k must divide the output channels)", op, out_channels, k);
    MGPU_REQUIRE(stride >= 1 && pad >= 0, "%s: stride %d must be >= 1 and padding %d >= 0", op, stride, pad);
    mgpu_tp_conv *c = (mgpu_tp_conv *)mgpu__xcalloc(1, sizeof *c);
    c->k = k;
    c->stride = stride;
    c->pad = pad;
    for (int j = 0; j < k; j++) {
        c->devices[j] = devices[j];
        c->weight[j] = mgpu__tp_parameter_slice(weight, 0, j, k, devices[j], &c->dweight[j]);
        c->bias[j] = mgpu__tp_parameter_slice(bias, 0, j, k, devices[j], &c->dbias[j]);
    }
    return c;
}

MGPU_DEF mgpu_tensor *mgpu_tp_conv_forward(mgpu_tp_conv *c, const mgpu_tensor *x) {
    const char *op = "mgpu_tp_conv_forward";
    int k = c->k;
    mgpu__tp_require_on_first(op, "x", x, c->devices);
    mgpu__conv_geom g = mgpu__conv_geometry(op, x->shape, c->weight[0]->shape, c->stride, c->pad);
    mgpu_shape slice_shape = mgpu_shape4(g.n, g.k, g.p, g.q), out_shape = mgpu_shape4(g.n, k * g.k, g.p, g.q);
    mgpu__tp_replicate(x, c->x_copy, c->devices, k, c->x);
    /* Each device: its channels of y, for the whole batch. */
    for (int j = 0; j < k; j++)
        mgpu_conv2d_forward(mgpu_ensure(&c->y_part[j], c->devices[j], slice_shape), c->x[j], c->weight[j],
                            c->bias[j], c->stride, c->pad);
    /* The all-gather: every device's channels into every device's y, in
       channel order (its own by a copy on the device itself). */
    for (int i = 0; i < k; i++) {
        mgpu_ensure(&c->y[i], c->devices[i], out_shape);
        for (int j = 0; j < k; j++) mgpu__tp_copy_slice(c->y[i], c->y_part[j], 1, j, k, 1);
    }
    c->bytes.forward = mgpu_all_gather_bytes(c->y[0]->numel * sizeof(float), k);
    return c->y[0];
}

MGPU_DEF mgpu_tensor *mgpu_tp_conv_backward(mgpu_tp_conv *c, const mgpu_tensor *dy) {
    const char *op = "mgpu_tp_conv_backward";
    int k = c->k;
    mgpu__tp_require_output_grad(op, "dy", dy, c->y[0], c->devices);
    for (int j = 0; j < k; j++) {
        mgpu_tensor *dy_part = mgpu_ensure(&c->dy_part[j], c->devices[j], c->y_part[j]->shape);
        mgpu__tp_copy_slice(dy_part, dy, 1, j, k, 0);
        mgpu_conv2d_backward(mgpu_ensure(&c->dx[j], c->devices[j], c->x[j]->shape), c->dweight[j], c->dbias[j],
                             dy_part, c->x[j], c->weight[j], c->stride, c->pad, 0);
    }
    /* Each dx[j] is what device j's filters send back; dx is their sum. */
    mgpu_allreduce_auto(c->dx, k, 0);
    c->bytes.backward = mgpu_allreduce_bytes(c->dx[0]->numel * sizeof(float), k);
    return c->dx[0];
}

static void mgpu__tp_require_index(const char *op, int i, int k) {
    MGPU_REQUIRE(i >= 0 && i < k, "%s: device %d of a block over %d devices", op, i, k);
}
MGPU_DEF mgpu_tensor *mgpu_tp_conv_output(const mgpu_tp_conv *c, int i) {
    mgpu__tp_require_index("mgpu_tp_conv_output", i, c->k);
    return c->y[i];
}
MGPU_DEF mgpu_tensor *mgpu_tp_conv_input_grad(const mgpu_tp_conv *c, int i) {
    mgpu__tp_require_index("mgpu_tp_conv_input_grad", i, c->k);
    return c->dx[i];
}

MGPU_DEF void mgpu_tp_conv_gather_grads(const mgpu_tp_conv *c, mgpu_tensor *dweight, mgpu_tensor *dbias) {
    const char *op = "mgpu_tp_conv_gather_grads";
    mgpu_shape weight_shape = c->weight[0]->shape;
    weight_shape.d[0] *= c->k;
    mgpu__tp_require_shape(op, "dweight", dweight, weight_shape);
    mgpu__tp_require_shape(op, "dbias", dbias, mgpu_shape1(weight_shape.d[0]));
    for (int j = 0; j < c->k; j++) {
        mgpu__tp_copy_slice(dweight, c->dweight[j], 0, j, c->k, 1);
        mgpu__tp_copy_slice(dbias, c->dbias[j], 0, j, c->k, 1);
    }
}

MGPU_DEF mgpu_tp_bytes mgpu_tp_conv_bytes(const mgpu_tp_conv *c) { return c->bytes; }
MGPU_DEF size_t mgpu_tp_conv_parameters(const mgpu_tp_conv *c) {
    return (size_t)c->k * (c->weight[0]->numel + c->bias[0]->numel);
}

MGPU_DEF void mgpu_tp_conv_free(mgpu_tp_conv *c) {
    if (!c) return;
    for (int j = 0; j < c->k; j++) {
        mgpu_tensor *owned[] = {c->weight[j], c->bias[j], c->dweight[j], c->dbias[j], c->x_copy[j],
                                c->y_part[j], c->y[j], c->dy_part[j], c->dx[j]};
        for (size_t t = 0; t < sizeof owned / sizeof owned[0]; t++) mgpu_free(owned[t]);
    }
    free(c);
}

/* -------------------------------------------------------- Megatron's MLP block */
struct mgpu_tp_mlp {
    int k;
    mgpu_device *devices[MGPU_MAX_DEVICES];
    /* device j's columns of A (and of a), and the matching rows of B; b on device 0 */
    mgpu_tensor *A[MGPU_MAX_DEVICES], *a[MGPU_MAX_DEVICES], *B[MGPU_MAX_DEVICES], *b;
    mgpu_tensor *dA[MGPU_MAX_DEVICES], *da[MGPU_MAX_DEVICES], *dB[MGPU_MAX_DEVICES], *db;
    const mgpu_tensor *X[MGPU_MAX_DEVICES], *dY[MGPU_MAX_DEVICES];   /* the passes' inputs, on each device */
    mgpu_tensor *X_copy[MGPU_MAX_DEVICES], *dY_copy[MGPU_MAX_DEVICES];
    mgpu_tensor *H[MGPU_MAX_DEVICES];    /* device j's hidden units, after the ReLU */
    mgpu_tensor *Y[MGPU_MAX_DEVICES];    /* H_j B_j, then (after g) the sum: Y */
    mgpu_tensor *dH[MGPU_MAX_DEVICES];
    mgpu_tensor *dX[MGPU_MAX_DEVICES];   /* device j's part, then (after f) the sum: dX */
    mgpu_tp_bytes bytes;
};

MGPU_DEF mgpu_tp_mlp *mgpu_tp_mlp_new(const mgpu_tensor *A, const mgpu_tensor *a, const mgpu_tensor *B,
                                      const mgpu_tensor *b, mgpu_device *const *devices, int k) {
    const char *op = "mgpu_tp_mlp_new";
    char sa[64], sb[64];
    mgpu__tp_require_devices(op, devices, k);
    MGPU_REQUIRE(A != NULL && B != NULL, "%s: A or B is NULL", op);
    mgpu__require_alive(A, op);
    mgpu__require_alive(B, op);
    MGPU_REQUIRE(A->shape.ndim == 2 && B->shape.ndim == 2 && A->shape.d[1] == B->shape.d[0],
                 "%s: A %s and B %s must be [in, hidden] and [hidden, out]", op,
                 mgpu_shape_str(A->shape, sa, sizeof sa), mgpu_shape_str(B->shape, sb, sizeof sb));
    int hidden = A->shape.d[1];
    mgpu__tp_require_shape(op, "a", a, mgpu_shape1(hidden));
    mgpu__tp_require_shape(op, "b", b, mgpu_shape1(B->shape.d[1]));
    MGPU_REQUIRE(hidden % k == 0, "%s: %d hidden units do not split into k = %d equal slices "
                 "(k must divide the hidden units)", op, hidden, k);
    mgpu_tp_mlp *m = (mgpu_tp_mlp *)mgpu__xcalloc(1, sizeof *m);
    m->k = k;
    for (int j = 0; j < k; j++) {
        m->devices[j] = devices[j];
        m->A[j] = mgpu__tp_parameter_slice(A, 1, j, k, devices[j], &m->dA[j]); /* columns */
        m->a[j] = mgpu__tp_parameter_slice(a, 0, j, k, devices[j], &m->da[j]);
        m->B[j] = mgpu__tp_parameter_slice(B, 0, j, k, devices[j], &m->dB[j]); /* rows */
    }
    m->b = mgpu__tp_parameter_slice(b, 0, 0, 1, devices[0], &m->db);        /* all of it, on device 0 */
    return m;
}

MGPU_DEF mgpu_tensor *mgpu_tp_mlp_forward(mgpu_tp_mlp *m, const mgpu_tensor *X) {
    const char *op = "mgpu_tp_mlp_forward";
    int k = m->k, in = m->A[0]->shape.d[0], out = m->B[0]->shape.d[1];
    char sx[64];
    mgpu__tp_require_on_first(op, "X", X, m->devices);
    MGPU_REQUIRE(X->shape.ndim == 2 && X->shape.d[1] == in && X->shape.d[0] >= 1,
                 "%s: X has shape %s; it must be [N, %d]", op, mgpu_shape_str(X->shape, sx, sizeof sx), in);
    int rows = X->shape.d[0];
    mgpu__tp_replicate(X, m->X_copy, m->devices, k, m->X); /* f: nothing to do, every device has X */
    for (int j = 0; j < k; j++) {
        mgpu_tensor *H = mgpu_ensure(&m->H[j], m->devices[j], mgpu_shape2(rows, m->A[j]->shape.d[1]));
        mgpu_linear_forward(H, m->X[j], m->A[j], m->a[j]);   /* column-parallel */
        mgpu_relu_forward(H, H);
        mgpu_linear_forward(mgpu_ensure(&m->Y[j], m->devices[j], mgpu_shape2(rows, out)), H, m->B[j],
                            j == 0 ? m->b : NULL);             /* row-parallel: a share of Y; b once */
    }
    mgpu_allreduce_auto(m->Y, k, 0);                            /* g: the shares summed, Y everywhere */
    m->bytes.forward = mgpu_allreduce_bytes(m->Y[0]->numel * sizeof(float), k);
    return m->Y[0];
}

MGPU_DEF mgpu_tensor *mgpu_tp_mlp_backward(mgpu_tp_mlp *m, const mgpu_tensor *dY) {
    const char *op = "mgpu_tp_mlp_backward";
    int k = m->k;
    mgpu__tp_require_output_grad(op, "dY", dY, m->Y[0], m->devices);
    mgpu__tp_replicate(dY, m->dY_copy, m->devices, k, m->dY); /* g: nothing to do, every device needs dY */
    for (int j = 0; j < k; j++) {
        mgpu_tensor *dH = mgpu_ensure(&m->dH[j], m->devices[j], m->H[j]->shape);
        mgpu_linear_backward(dH, m->dB[j], j == 0 ? m->db : NULL, m->dY[j], m->H[j], m->B[j], 0);
        mgpu_relu_backward(dH, dH, m->H[j]);
        mgpu_linear_backward(mgpu_ensure(&m->dX[j], m->devices[j], m->X[j]->shape), m->dA[j], m->da[j], dH,
                             m->X[j], m->A[j], 0);
    }
    mgpu_allreduce_auto(m->dX, k, 0);                           /* f: the parts summed, dX everywhere */
    m->bytes.backward = mgpu_allreduce_bytes(m->dX[0]->numel * sizeof(float), k);
    return m->dX[0];
}

MGPU_DEF mgpu_tensor *mgpu_tp_mlp_output(const mgpu_tp_mlp *m, int i) {
    mgpu__tp_require_index("mgpu_tp_mlp_output", i, m->k);
    return m->Y[i];
}
MGPU_DEF mgpu_tensor *mgpu_tp_mlp_input_grad(const mgpu_tp_mlp *m, int i) {
    mgpu__tp_require_index("mgpu_tp_mlp_input_grad", i, m->k);
    return m->dX[i];
}

MGPU_DEF void mgpu_tp_mlp_gather_grads(const mgpu_tp_mlp *m, mgpu_tensor *dA, mgpu_tensor *da, mgpu_tensor *dB,
                                       mgpu_tensor *db) {
    const char *op = "mgpu_tp_mlp_gather_grads";
    int k = m->k, in = m->A[0]->shape.d[0], hidden = k * m->A[0]->shape.d[1], out = m->B[0]->shape.d[1];
    mgpu__tp_require_shape(op, "dA", dA, mgpu_shape2(in, hidden));
    mgpu__tp_require_shape(op, "da", da, mgpu_shape1(hidden));
    mgpu__tp_require_shape(op, "dB", dB, mgpu_shape2(hidden, out));
    mgpu__tp_require_shape(op, "db", db, mgpu_shape1(out));
    for (int j = 0; j < k; j++) {
        mgpu__tp_copy_slice(dA, m->dA[j], 1, j, k, 1);
        mgpu__tp_copy_slice(da, m->da[j], 0, j, k, 1);
        mgpu__tp_copy_slice(dB, m->dB[j], 0, j, k, 1);
    }
    mgpu_copy(db, m->db, 1);
}

MGPU_DEF mgpu_tp_bytes mgpu_tp_mlp_bytes(const mgpu_tp_mlp *m) { return m->bytes; }
MGPU_DEF size_t mgpu_tp_mlp_parameters(const mgpu_tp_mlp *m) {
    return (size_t)m->k * (m->A[0]->numel + m->a[0]->numel + m->B[0]->numel) + m->b->numel;
}

MGPU_DEF void mgpu_tp_mlp_free(mgpu_tp_mlp *m) {
    if (!m) return;
    for (int j = 0; j < m->k; j++) {
        mgpu_tensor *owned[] = {m->A[j], m->a[j], m->B[j], m->dA[j], m->da[j], m->dB[j], m->X_copy[j],
                                m->dY_copy[j], m->H[j], m->Y[j], m->dH[j], m->dX[j]};
        for (size_t t = 0; t < sizeof owned / sizeof owned[0]; t++) mgpu_free(owned[t]);
    }
    mgpu_free(m->b);
    mgpu_free(m->db);
    free(m);
}
/* ===========================================================================
   Plots: implementation (see "Plots" in the manual above)
   ===========================================================================
   Four layers, each built on the one before:
     1. the canvas: an RGB buffer with rectangles, lines and text, saved as
        a PNG by stb_image_write;
     2. the frame: the plot area of a chart, its axes with "nice" ticks and
        the mapping from data values to pixels;
     3. line charts and the Animator that redraws one after every point;
     4. device timelines.
   Out of memory and calls that make no sense (a canvas of no pixels, a
   series an animator does not have) are fatal here as everywhere in mgpu
   (mgpu_fatal); a file that cannot be written is not (see the manual). */
#include <errno.h>
#include <stb/stb_image_write.h>

/* ---- 1. the canvas ------------------------------------------------------ */

/* realloc that does not fail: the animator's arrays grow with it. */
static void *mgpu__plot_grow(void *p, size_t bytes) {
    p = realloc(p, bytes ? bytes : 1);
    if (!p) mgpu_fatal("out of host memory (asked for %zu bytes)", bytes);
    return p;
}

/* A duplicate of s; NULL stays NULL. */
static char *mgpu__plot_strdup(const char *s) {
    char *copy;
    if (!s) return NULL;
    copy = (char *)mgpu__xmalloc(strlen(s) + 1);
    return strcpy(copy, s);
}

/* The font: one glyph per printable ASCII character, 32 (space) to 126 (~).
   A glyph is 9 rows of 5 pixels, top row first; in each row byte bit 4 is
   the leftmost pixel. Rows 0-6 hold capitals and digits, the baseline is
   under row 6, and rows 7-8 are for descenders (g j p q y , _). */
#define MGPU__GLYPH_W 5
#define MGPU__GLYPH_H 9
#define MGPU__CAP_H 7  /* height of capitals and digits, for centring text */
#define MGPU__CELL_W 6 /* a glyph and a blank column before the next one */
static const unsigned char mgpu__font[95][MGPU__GLYPH_H] = {
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00}, /* space */
    {0x04, 0x04, 0x04, 0x04, 0x04, 0x00, 0x04, 0x00, 0x00}, /* ! */
    {0x0A, 0x0A, 0x0A, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00}, /* " */
    {0x0A, 0x0A, 0x1F, 0x0A, 0x1F, 0x0A, 0x0A, 0x00, 0x00}, /* # */
    {0x04, 0x0F, 0x14, 0x0E, 0x05, 0x1E, 0x04, 0x00, 0x00}, /* $ */
    {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03, 0x00, 0x00}, /* % */
    {0x0C, 0x12, 0x14, 0x08, 0x15, 0x12, 0x0D, 0x00, 0x00}, /* & */
    {0x04, 0x04, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00}, /* ' */
    {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02, 0x00, 0x00}, /* ( */
    {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08, 0x00, 0x00}, /* ) */
    {0x00, 0x04, 0x15, 0x0E, 0x15, 0x04, 0x00, 0x00, 0x00}, /* asterisk */
    {0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00, 0x00, 0x00}, /* + */
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08, 0x00}, /* , */
    {0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00, 0x00, 0x00}, /* - */
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C, 0x00, 0x00}, /* . */
    {0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00, 0x00, 0x00}, /* slash */
    {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E, 0x00, 0x00}, /* 0 */
    {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E, 0x00, 0x00}, /* 1 */
    {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F, 0x00, 0x00}, /* 2 */
    {0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E, 0x00, 0x00}, /* 3 */
    {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02, 0x00, 0x00}, /* 4 */
    {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E, 0x00, 0x00}, /* 5 */
    {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E, 0x00, 0x00}, /* 6 */
    {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08, 0x00, 0x00}, /* 7 */
    {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E, 0x00, 0x00}, /* 8 */
    {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C, 0x00, 0x00}, /* 9 */
    {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00, 0x00, 0x00}, /* : */
    {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x04, 0x08, 0x00, 0x00}, /* ; */
    {0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02, 0x00, 0x00}, /* < */
    {0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00, 0x00, 0x00}, /* = */
    {0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08, 0x00, 0x00}, /* > */
    {0x0E, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04, 0x00, 0x00}, /* ? */
    {0x0E, 0x11, 0x01, 0x0D, 0x15, 0x15, 0x0E, 0x00, 0x00}, /* @ */
    {0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11, 0x00, 0x00}, /* A */
    {0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E, 0x00, 0x00}, /* B */
    {0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E, 0x00, 0x00}, /* C */
    {0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C, 0x00, 0x00}, /* D */
    {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F, 0x00, 0x00}, /* E */
    {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10, 0x00, 0x00}, /* F */
    {0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F, 0x00, 0x00}, /* G */
    {0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11, 0x00, 0x00}, /* H */
    {0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E, 0x00, 0x00}, /* I */
    {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C, 0x00, 0x00}, /* J */
    {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11, 0x00, 0x00}, /* K */
    {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F, 0x00, 0x00}, /* L */
    {0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11, 0x00, 0x00}, /* M */
    {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11, 0x00, 0x00}, /* N */
    {0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E, 0x00, 0x00}, /* O */
    {0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10, 0x00, 0x00}, /* P */
    {0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D, 0x00, 0x00}, /* Q */
    {0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11, 0x00, 0x00}, /* R */
    {0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E, 0x00, 0x00}, /* S */
    {0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x00, 0x00}, /* T */
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E, 0x00, 0x00}, /* U */
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04, 0x00, 0x00}, /* V */
    {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A, 0x00, 0x00}, /* W */
    {0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11, 0x00, 0x00}, /* X */
    {0x11, 0x11, 0x0A, 0x04, 0x04, 0x04, 0x04, 0x00, 0x00}, /* Y */
    {0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F, 0x00, 0x00}, /* Z */
    {0x0E, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0E, 0x00, 0x00}, /* [ */
    {0x00, 0x10, 0x08, 0x04, 0x02, 0x01, 0x00, 0x00, 0x00}, /* backslash */
    {0x0E, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0E, 0x00, 0x00}, /* ] */
    {0x04, 0x0A, 0x11, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00}, /* ^ */
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F, 0x00}, /* _ */
    {0x08, 0x04, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00}, /* ` */
    {0x00, 0x00, 0x0E, 0x01, 0x0F, 0x11, 0x0F, 0x00, 0x00}, /* a */
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1E, 0x00, 0x00}, /* b */
    {0x00, 0x00, 0x0E, 0x10, 0x10, 0x11, 0x0E, 0x00, 0x00}, /* c */
    {0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F, 0x00, 0x00}, /* d */
    {0x00, 0x00, 0x0E, 0x11, 0x1F, 0x10, 0x0E, 0x00, 0x00}, /* e */
    {0x06, 0x09, 0x08, 0x1C, 0x08, 0x08, 0x08, 0x00, 0x00}, /* f */
    {0x00, 0x00, 0x0F, 0x11, 0x11, 0x11, 0x0F, 0x01, 0x0E}, /* g */
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11, 0x00, 0x00}, /* h */
    {0x04, 0x00, 0x0C, 0x04, 0x04, 0x04, 0x0E, 0x00, 0x00}, /* i */
    {0x02, 0x00, 0x06, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C}, /* j */
    {0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12, 0x00, 0x00}, /* k */
    {0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E, 0x00, 0x00}, /* l */
    {0x00, 0x00, 0x1A, 0x15, 0x15, 0x15, 0x15, 0x00, 0x00}, /* m */
    {0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11, 0x00, 0x00}, /* n */
    {0x00, 0x00, 0x0E, 0x11, 0x11, 0x11, 0x0E, 0x00, 0x00}, /* o */
    {0x00, 0x00, 0x1E, 0x11, 0x11, 0x11, 0x1E, 0x10, 0x10}, /* p */
    {0x00, 0x00, 0x0F, 0x11, 0x11, 0x11, 0x0F, 0x01, 0x01}, /* q */
    {0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10, 0x00, 0x00}, /* r */
    {0x00, 0x00, 0x0F, 0x10, 0x0E, 0x01, 0x1E, 0x00, 0x00}, /* s */
    {0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06, 0x00, 0x00}, /* t */
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0D, 0x00, 0x00}, /* u */
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x0A, 0x04, 0x00, 0x00}, /* v */
    {0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0A, 0x00, 0x00}, /* w */
    {0x00, 0x00, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x00, 0x00}, /* x */
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x11, 0x0F, 0x01, 0x0E}, /* y */
    {0x00, 0x00, 0x1F, 0x02, 0x04, 0x08, 0x1F, 0x00, 0x00}, /* z */
    {0x02, 0x04, 0x04, 0x08, 0x04, 0x04, 0x02, 0x00, 0x00}, /* { */
    {0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x00, 0x00}, /* | */
    {0x08, 0x04, 0x04, 0x02, 0x04, 0x04, 0x08, 0x00, 0x00}, /* } */
    {0x00, 0x00, 0x08, 0x15, 0x02, 0x00, 0x00, 0x00, 0x00}, /* ~ */
};

/* matplotlib's "tab10": ten colours that are easy to tell apart. */
static const uint32_t mgpu__palette[10] = {0x1F77B4, 0xFF7F0E, 0x2CA02C, 0xD62728, 0x9467BD,
                                           0x8C564B, 0xE377C2, 0x7F7F7F, 0xBCBD22, 0x17BECF};
#define MGPU__INK 0x222222u  /* text, frames and ticks */
#define MGPU__GRID 0xE4E4E4u /* grid lines behind the data */
#define MGPU__WHITE 0xFFFFFFu

MGPU_DEF uint32_t mgpu_palette(int i) { return mgpu__palette[(i % 10 + 10) % 10]; }

MGPU_DEF mgpu_canvas *mgpu_canvas_new(int width, int height, uint32_t background_rgb) {
    mgpu_canvas *c;
    MGPU_REQUIRE(width > 0 && height > 0, "a canvas of %dx%d pixels cannot be made", width, height);
    c = (mgpu_canvas *)mgpu__xmalloc(sizeof *c);
    c->width = width;
    c->height = height;
    c->rgb = (unsigned char *)mgpu__xmalloc((size_t)width * (size_t)height * 3);
    mgpu_canvas_fill_rect(c, 0, 0, width, height, background_rgb);
    return c;
}

MGPU_DEF void mgpu_canvas_free(mgpu_canvas *c) {
    if (!c) return;
    free(c->rgb);
    free(c);
}

static int mgpu__plot_clamp(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* Every other drawing operation ends up here, so this is where clipping to
   the canvas happens. */
MGPU_DEF void mgpu_canvas_fill_rect(mgpu_canvas *c, int x0, int y0, int x1, int y1, uint32_t rgb) {
    x0 = mgpu__plot_clamp(x0, 0, c->width);
    x1 = mgpu__plot_clamp(x1, 0, c->width);
    y0 = mgpu__plot_clamp(y0, 0, c->height);
    y1 = mgpu__plot_clamp(y1, 0, c->height);
    for (int y = y0; y < y1; y++) {
        unsigned char *p = c->rgb + ((size_t)y * (size_t)c->width + (size_t)x0) * 3;
        for (int x = x0; x < x1; x++, p += 3) {
            p[0] = (unsigned char)(rgb >> 16);
            p[1] = (unsigned char)(rgb >> 8);
            p[2] = (unsigned char)rgb;
        }
    }
}

/* A 1-pixel outline around the pixels x0..x1, y0..y1 (both inclusive). */
static void mgpu__plot_outline(mgpu_canvas *c, int x0, int y0, int x1, int y1, uint32_t rgb) {
    mgpu_canvas_fill_rect(c, x0, y0, x1 + 1, y0 + 1, rgb);
    mgpu_canvas_fill_rect(c, x0, y1, x1 + 1, y1 + 1, rgb);
    mgpu_canvas_fill_rect(c, x0, y0, x0 + 1, y1 + 1, rgb);
    mgpu_canvas_fill_rect(c, x1, y0, x1 + 1, y1 + 1, rgb);
}

/* A box of pixel positions, edges included. */
typedef struct mgpu__plot_box {
    double x0, y0, x1, y1;
} mgpu__plot_box;

/* Liang-Barsky clipping. The segment is p(t) = (x0,y0) + t*(dx,dy) for t in
   [0,1]; each side of the box keeps the t on its inner side, and [*t0, *t1]
   ends up as the part inside all four. Returns 0 when nothing is left. */
static int mgpu__plot_clip(mgpu__plot_box box, double x0, double y0, double x1, double y1,
                           double *t0, double *t1) {
    double dx = x1 - x0, dy = y1 - y0;
    double p[4], q[4]; /* side i keeps the t with p[i] * t <= q[i] */
    p[0] = -dx, q[0] = x0 - box.x0;
    p[1] = dx, q[1] = box.x1 - x0;
    p[2] = -dy, q[2] = y0 - box.y0;
    p[3] = dy, q[3] = box.y1 - y0;
    *t0 = 0;
    *t1 = 1;
    for (int i = 0; i < 4; i++) {
        if (p[i] == 0) { /* parallel to this side: wholly inside it or wholly outside */
            if (q[i] < 0) return 0;
        } else if (p[i] < 0) { /* coming in through this side */
            *t0 = fmax(*t0, q[i] / p[i]);
        } else { /* going out through it */
            *t1 = fmin(*t1, q[i] / p[i]);
        }
    }
    return *t0 <= *t1;
}

MGPU_DEF void mgpu_canvas_line(mgpu_canvas *c, double x0, double y0, double x1, double y1,
                               uint32_t rgb, int thickness) {
    mgpu__plot_box near_canvas;
    double t0, t1, ax, ay, bx, by;
    int steps, half;
    if (!isfinite(x0) || !isfinite(y0) || !isfinite(x1) || !isfinite(y1)) return;
    if (thickness < 1) thickness = 1;
    /* Walk only the part that can touch the canvas: a line towards a point
       far outside costs no more than one across the picture. */
    near_canvas.x0 = near_canvas.y0 = -thickness;
    near_canvas.x1 = c->width + thickness;
    near_canvas.y1 = c->height + thickness;
    if (!mgpu__plot_clip(near_canvas, x0, y0, x1, y1, &t0, &t1)) return;
    ax = x0 + t0 * (x1 - x0), ay = y0 + t0 * (y1 - y0);
    bx = x0 + t1 * (x1 - x0), by = y0 + t1 * (y1 - y0);
    /* One step per pixel along the longer direction, and at every step a
       thickness x thickness square (the "brush") centred on the line. */
    steps = (int)ceil(fmax(fabs(bx - ax), fabs(by - ay)));
    half = thickness / 2;
    for (int i = 0; i <= steps; i++) {
        double f = steps ? (double)i / steps : 0;
        int x = (int)lround(ax + f * (bx - ax)) - half, y = (int)lround(ay + f * (by - ay)) - half;
        mgpu_canvas_fill_rect(c, x, y, x + thickness, y + thickness, rgb);
    }
}

/* The segment's part inside `clip`; dashed when dash > 0 (dash pixels on,
   dash pixels off). *travel is the length of the polyline before this
   segment, so the dashes run on from one segment to the next. */
static void mgpu__plot_stroke(mgpu_canvas *c, mgpu__plot_box clip, double x0, double y0, double x1,
                              double y1, uint32_t rgb, int thickness, double dash, double *travel) {
    double len = hypot(x1 - x0, y1 - y0), start = *travel, t0, t1;
    *travel += len;
    if (!mgpu__plot_clip(clip, x0, y0, x1, y1, &t0, &t1)) return;
    if (dash <= 0 || len == 0) {
        mgpu_canvas_line(c, x0 + t0 * (x1 - x0), y0 + t0 * (y1 - y0), x0 + t1 * (x1 - x0),
                         y0 + t1 * (y1 - y0), rgb, thickness);
        return;
    }
    /* s runs along the segment from one dash boundary to the next. */
    for (double s = t0 * len; s < t1 * len;) {
        double phase = fmod(start + s, 2 * dash); /* < dash: in a dash; else in a gap */
        double end = fmin(s + (phase < dash ? dash - phase : 2 * dash - phase), t1 * len);
        if (end <= s) break; /* rounding left nothing to advance over */
        if (phase < dash)
            mgpu_canvas_line(c, x0 + s / len * (x1 - x0), y0 + s / len * (y1 - y0),
                             x0 + end / len * (x1 - x0), y0 + end / len * (y1 - y0), rgb,
                             thickness);
        s = end;
    }
}

static const unsigned char *mgpu__plot_glyph(char ch) {
    unsigned char code = (unsigned char)ch;
    return mgpu__font[(code < 32 || code > 126 ? '?' : code) - 32];
}

MGPU_DEF int mgpu_text_width(const char *text, int scale) {
    int n = text ? (int)strlen(text) : 0;
    return n ? (n * MGPU__CELL_W - 1) * scale : 0; /* no blank column after the last glyph */
}

/* Text in a box whose top-left corner is (x, y); `vertical` turns it a
   quarter turn anticlockwise, to read from bottom to top (a y-axis label). */
static void mgpu__plot_text(mgpu_canvas *c, int x, int y, const char *text, uint32_t rgb, int scale,
                            int vertical) {
    int length = mgpu_text_width(text, scale);
    if (scale < 1 || !text) return;
    for (int i = 0; text[i]; i++) {
        const unsigned char *glyph = mgpu__plot_glyph(text[i]);
        for (int row = 0; row < MGPU__GLYPH_H; row++)
            for (int col = 0; col < MGPU__GLYPH_W; col++) {
                /* (along, across): the font pixel's place along the text and across it */
                int along = (i * MGPU__CELL_W + col) * scale, across = row * scale;
                if (!(glyph[row] & (0x10 >> col))) continue;
                if (vertical)
                    mgpu_canvas_fill_rect(c, x + across, y + length - along - scale,
                                          x + across + scale, y + length - along, rgb);
                else
                    mgpu_canvas_fill_rect(c, x + along, y + across, x + along + scale,
                                          y + across + scale, rgb);
            }
    }
}

MGPU_DEF void mgpu_canvas_text(mgpu_canvas *c, int x, int y, const char *text, uint32_t rgb,
                               int scale) {
    mgpu__plot_text(c, x, y, text, rgb, scale, 0);
}

static int mgpu__output_errors;
MGPU_DEF int mgpu_output_errors(void) {
    /* Standard output's failures count too: past the file-size limit its
       writes fail as a file's do (mgpu__whole_file_open ignores SIGXFSZ),
       and printf says nothing. (The stream keeps only that one failed, not
       why.) Said once. */
    static int stdout_failed;
    if (!stdout_failed && (fflush(stdout) != 0 || ferror(stdout))) {
        stdout_failed = 1;
        fprintf(stderr, "mgpu: error: standard output: cannot write (a write failed: a full disk, or the file-size limit)\n");
        mgpu__output_errors++;
    }
    return mgpu__output_errors;
}

/* One line on stderr about a file that could not be written; returns -1 so
   that callers can `return mgpu__plot_write_failed(...)`. */
static int mgpu__plot_write_failed(const char *path, const char *what, const char *reason) {
    fprintf(stderr, "mgpu: error: %s: cannot write %s (%s)\n", path, what, reason);
    mgpu__output_errors++;
    return -1;
}

/* stb_image_write hands the encoded PNG over piece by piece. A failed fwrite
   is remembered by the FILE and seen by ferror() at the end. */
static void mgpu__plot_png_piece(void *file, void *data, int size) {
    fwrite(data, 1, (size_t)size, (FILE *)file);
}

MGPU_DEF int mgpu_canvas_write_png(const mgpu_canvas *c, const char *path) {
    mgpu__whole_file w;
    if (!mgpu__whole_file_open(&w, path)) return mgpu__plot_write_failed(path, "PNG", strerror(errno));
    int encoded = stbi_write_png_to_func(mgpu__plot_png_piece, w.f, c->width, c->height, 3, c->rgb,
                                         c->width * 3);
    int error = mgpu__whole_file_close(&w, !encoded);
    return error ? mgpu__plot_write_failed(path, "PNG", encoded ? strerror(error) : "encoder failed") : 0;
}

/* ---- 2. the frame: axes, ticks and the data-to-pixel mapping ------------ */

/* An axis shows values lo..hi with a tick every `step`. */
typedef struct mgpu__plot_axis {
    double lo, hi, step;
} mgpu__plot_axis;

/* 1, 2 or 5 times a power of ten, giving about `ticks` ticks over `span`:
   the steps people read easily. */
static double mgpu__plot_nice_step(double span, int ticks) {
    double raw = span / (ticks > 1 ? ticks : 1), magnitude = pow(10, floor(log10(raw))),
           ratio = raw / magnitude;
    return (ratio < 1.5 ? 1 : ratio < 3.5 ? 2 : ratio < 7.5 ? 5 : 10) * magnitude;
}

/* The axis for [lo, hi]: kept as it is when `fixed`; otherwise it comes from
   the data (lo > hi when there was none) and is widened to whole ticks. */
static mgpu__plot_axis mgpu__plot_axis_new(double lo, double hi, int fixed, int ticks) {
    mgpu__plot_axis a;
    if (!fixed && !(lo <= hi)) { /* no data at all */
        lo = 0;
        hi = 1;
    } else if (!fixed && lo == hi) { /* a single value: centre it */
        double pad = lo != 0 ? fabs(lo) / 10 : 1;
        lo -= pad;
        hi += pad;
    }
    a.step = mgpu__plot_nice_step(hi - lo, ticks);
    /* the 1e-9 keeps a value that is a whole tick up to rounding on that tick */
    a.lo = fixed ? lo : floor(lo / a.step + 1e-9) * a.step;
    a.hi = fixed ? hi : ceil(hi / a.step - 1e-9) * a.step;
    return a;
}

/* Tick i of an axis: its value and its label, with as many decimals as the
   step needs (a step of 0.05 gives "0.35"). Returns 0 past the last tick. */
static int mgpu__plot_tick(const mgpu__plot_axis *a, int i, double *value, char label[32]) {
    int decimals = a->step >= 1 ? 0 : (int)ceil(-log10(a->step) - 1e-9);
    *value = (ceil(a->lo / a->step - 1e-9) + i) * a->step;
    if (i >= 100 || *value > a->hi + a->step * 1e-9) return 0;
    if (*value == 0) *value = 0; /* -0.0 would print as "-0" */
    snprintf(label, 32, "%.*f", decimals, *value);
    return 1;
}

/* The frame of a chart: the plot area (pixels x0..x1, y0..y1, edges
   included, where the frame is drawn), its axes and the font scale. */
typedef struct mgpu__plot_frame {
    mgpu_canvas *c;
    int x0, y0, x1, y1;
    mgpu__plot_axis ax, ay;
    int scale;
} mgpu__plot_frame;

static double mgpu__plot_px(const mgpu__plot_frame *f, double x) {
    return f->x0 + (x - f->ax.lo) / (f->ax.hi - f->ax.lo) * (f->x1 - f->x0);
}

static double mgpu__plot_py(const mgpu__plot_frame *f, double y) /* pixel y grows downwards */
{
    return f->y1 - (y - f->ay.lo) / (f->ay.hi - f->ay.lo) * (f->y1 - f->y0);
}

static mgpu__plot_box mgpu__plot_area(const mgpu__plot_frame *f) {
    mgpu__plot_box box;
    box.x0 = f->x0, box.y0 = f->y0, box.x1 = f->x1, box.y1 = f->y1;
    return box;
}

/* The widest tick label of an axis, to size the margin beside it. */
static int mgpu__plot_widest_tick(const mgpu__plot_axis *a, int scale) {
    char label[32];
    double value;
    int widest = 0;
    for (int i = 0; mgpu__plot_tick(a, i, &value, label); i++)
        if (mgpu_text_width(label, scale) > widest) widest = mgpu_text_width(label, scale);
    return widest;
}

/* Grid lines, tick marks and numbers of the x axis (below the frame) or of
   the y axis (left of it). Drawn before the data, so the grid is behind it. */
static void mgpu__plot_ticks(const mgpu__plot_frame *f, int y_axis) {
    int s = f->scale, tick = 3 * s;
    char label[32];
    double value;
    for (int i = 0; mgpu__plot_tick(y_axis ? &f->ay : &f->ax, i, &value, label); i++) {
        int width = mgpu_text_width(label, s);
        if (y_axis) {
            int y = (int)lround(mgpu__plot_py(f, value));
            mgpu_canvas_fill_rect(f->c, f->x0 + 1, y, f->x1, y + 1, MGPU__GRID);
            mgpu_canvas_fill_rect(f->c, f->x0 - tick, y, f->x0, y + 1, MGPU__INK);
            mgpu_canvas_text(f->c, f->x0 - tick - 2 * s - width, y - MGPU__CAP_H * s / 2, label,
                             MGPU__INK, s);
        } else {
            int x = (int)lround(mgpu__plot_px(f, value));
            mgpu_canvas_fill_rect(f->c, x, f->y0 + 1, x + 1, f->y1, MGPU__GRID);
            mgpu_canvas_fill_rect(f->c, x, f->y1 + 1, x + 1, f->y1 + 1 + tick, MGPU__INK);
            mgpu_canvas_text(f->c, x - width / 2, f->y1 + tick + 3 * s, label, MGPU__INK, s);
        }
    }
}

/* The margins: a title line above the plot area, the tick numbers and an
   x label below it. */
static int mgpu__plot_top(const char *title, int s) { return title && *title ? 20 * s : 8 * s; }
static int mgpu__plot_bottom(const char *xlabel, int s) {
    return xlabel && *xlabel ? 32 * s : 18 * s;
}

/* Chooses the x axis for data in [xlo, xhi] (see mgpu__plot_axis_new) and
   places the plot area: `left_width` pixels of numbers or names left of it,
   and `below` pixels for something else (a legend) under its margin. */
static void mgpu__plot_layout(mgpu__plot_frame *f, double xlo, double xhi, int xfixed,
                              int left_width, int below, const char *title, const char *xlabel,
                              const char *ylabel) {
    int s = f->scale;
    f->x0 = 4 * s + (ylabel && *ylabel ? 14 * s : 0) + left_width + 5 * s;
    f->y0 = mgpu__plot_top(title, s);
    f->y1 = f->c->height - 1 - below - mgpu__plot_bottom(xlabel, s);
    /* About one tick per 50 font pixels of width, fewer while the numbers
       would run into each other. The last number is centred on the right
       edge of the frame, so half of it must fit beside the frame. */
    for (int ticks = f->c->width / (50 * s);; ticks--) {
        int widest;
        f->ax = mgpu__plot_axis_new(xlo, xhi, xfixed, ticks);
        widest = mgpu__plot_widest_tick(&f->ax, s);
        f->x1 = f->c->width - 1 - 4 * s - widest / 2;
        if (ticks <= 2 || f->ax.step / (f->ax.hi - f->ax.lo) * (f->x1 - f->x0) >= widest + 6 * s)
            break;
    }
}

/* Title above the plot area, x label under the tick numbers, y label
   turned up the left edge of the picture; each centred on the plot area. */
static void mgpu__plot_labels(const mgpu__plot_frame *f, const char *title, const char *xlabel,
                              const char *ylabel) {
    int s = f->scale, cx = (f->x0 + f->x1) / 2, cy = (f->y0 + f->y1) / 2;
    int title_x = cx - mgpu_text_width(title, s) / 2,
        title_max = f->c->width - 4 * s - mgpu_text_width(title, s);
    /* a long title moves left rather than off the picture */
    mgpu_canvas_text(f->c, title_x < title_max ? title_x : title_max, 5 * s, title, MGPU__INK, s);
    mgpu_canvas_text(f->c, cx - mgpu_text_width(xlabel, s) / 2, f->y1 + 19 * s, xlabel, MGPU__INK,
                     s);
    mgpu__plot_text(f->c, 4 * s, cy - mgpu_text_width(ylabel, s) / 2, ylabel, MGPU__INK, s, 1);
}

/* ---- 3. line charts and the Animator ------------------------------------ */

/* How many pixels of a w x h box at (x, y) are data: neither background nor
   grid. The legend goes where this is smallest. */
static long mgpu__chart_ink(const mgpu_canvas *c, int x, int y, int w, int h) {
    int x0 = mgpu__plot_clamp(x, 0, c->width), x1 = mgpu__plot_clamp(x + w, 0, c->width);
    int y0 = mgpu__plot_clamp(y, 0, c->height), y1 = mgpu__plot_clamp(y + h, 0, c->height);
    long count = 0;
    for (int j = y0; j < y1; j++)
        for (int i = x0; i < x1; i++) {
            const unsigned char *p = c->rgb + ((size_t)j * (size_t)c->width + (size_t)i) * 3;
            uint32_t rgb = (uint32_t)p[0] << 16 | (uint32_t)p[1] << 8 | p[2];
            count += rgb != MGPU__WHITE && rgb != MGPU__GRID;
        }
    return count;
}

static uint32_t mgpu__chart_color(const mgpu_chart *ch, int i) {
    return ch->series[i].color ? ch->series[i].color : mgpu_palette(i);
}

/* One curve. Points with a NaN (or infinite) coordinate are passed over and
   their neighbours joined, as the book's Animator does with missing values. */
static void mgpu__chart_curve(const mgpu__plot_frame *f, const mgpu_series *series, uint32_t rgb) {
    int s = f->scale, points = 0;
    double travel = 0, px = 0, py = 0;
    for (int i = 0; i < series->n; i++) {
        double qx, qy;
        if (!isfinite(series->x[i]) || !isfinite(series->y[i])) continue;
        qx = mgpu__plot_px(f, series->x[i]), qy = mgpu__plot_py(f, series->y[i]);
        if (points++)
            mgpu__plot_stroke(f->c, mgpu__plot_area(f), px, py, qx, qy, rgb, s,
                              series->dashed ? 6 * s : 0, &travel);
        px = qx, py = qy;
    }
    if (points == 1) /* a lone point draws no line: mark it with a dot */
        mgpu__plot_stroke(f->c, mgpu__plot_area(f), px, py, px, py, rgb, 3 * s, 0, &travel);
}

/* A box with a line sample and the name of every named series, in the
   corner of the plot area that hides the fewest data pixels. */
static void mgpu__chart_legend(const mgpu__plot_frame *f, const mgpu_chart *ch) {
    int s = f->scale, pad = 5 * s, row = 12 * s, sample = 18 * s, entries = 0, widest = 0;
    int w, h, x = 0, y = 0;
    long least = -1;
    for (int i = 0; i < ch->nseries; i++) {
        if (!ch->series[i].name) continue;
        entries++;
        if (mgpu_text_width(ch->series[i].name, s) > widest)
            widest = mgpu_text_width(ch->series[i].name, s);
    }
    if (!entries) return;
    w = 3 * pad + sample + widest;
    h = 2 * pad + entries * row - 3 * s;
    /* corners in the order tried: upper right, upper left, lower right, lower left */
    for (int corner = 0; corner < 4; corner++) {
        int cx = corner % 2 ? f->x0 + pad : f->x1 - pad - w,
            cy = corner < 2 ? f->y0 + pad : f->y1 - pad - h;
        long ink = mgpu__chart_ink(f->c, cx, cy, w, h);
        if (least < 0 || ink < least) least = ink, x = cx, y = cy;
    }
    mgpu_canvas_fill_rect(f->c, x, y, x + w, y + h, MGPU__WHITE);
    mgpu__plot_outline(f->c, x, y, x + w - 1, y + h - 1, 0xAAAAAA);
    y += pad;
    for (int i = 0; i < ch->nseries; i++) {
        double travel = 0, mid = y + MGPU__CAP_H * s / 2;
        if (!ch->series[i].name) continue;
        mgpu__plot_stroke(f->c, mgpu__plot_area(f), x + pad, mid, x + pad + sample, mid,
                          mgpu__chart_color(ch, i), s, ch->series[i].dashed ? 6 * s : 0, &travel);
        mgpu_canvas_text(f->c, x + 2 * pad + sample, y, ch->series[i].name, MGPU__INK, s);
        y += row;
    }
}

MGPU_DEF int mgpu_chart_write_png(const mgpu_chart *ch, const char *path) {
    mgpu__plot_frame f;
    double xlo = INFINITY, xhi = -INFINITY, ylo = INFINITY, yhi = -INFINITY;
    int width = ch->width > 0 ? ch->width : 640, height = ch->height > 0 ? ch->height : 480, result;
    int xfixed = ch->xmin < ch->xmax, yfixed = ch->ymin < ch->ymax;
    for (int i = 0; i < ch->nseries; i++)
        for (int j = 0; j < ch->series[i].n; j++) {
            double x = ch->series[i].x[j], y = ch->series[i].y[j];
            if (!isfinite(x) || !isfinite(y)) continue;
            xlo = fmin(xlo, x), xhi = fmax(xhi, x), ylo = fmin(ylo, y), yhi = fmax(yhi, y);
        }
    f.c = mgpu_canvas_new(width, height, MGPU__WHITE);
    f.scale = width >= 480 && height >= 360 ? 2 : 1;
    /* about one y tick per 40 font pixels of height */
    f.ay = mgpu__plot_axis_new(yfixed ? ch->ymin : ylo, yfixed ? ch->ymax : yhi, yfixed,
                               height / (40 * f.scale));
    mgpu__plot_layout(&f, xfixed ? ch->xmin : xlo, xfixed ? ch->xmax : xhi, xfixed,
                      mgpu__plot_widest_tick(&f.ay, f.scale), 0, ch->title, ch->xlabel, ch->ylabel);
    /* back to front: grid, curves, legend, then the frame over the curves' ends */
    mgpu__plot_ticks(&f, 0);
    mgpu__plot_ticks(&f, 1);
    for (int i = 0; i < ch->nseries; i++)
        mgpu__chart_curve(&f, &ch->series[i], mgpu__chart_color(ch, i));
    mgpu__chart_legend(&f, ch);
    mgpu__plot_outline(f.c, f.x0, f.y0, f.x1, f.y1, MGPU__INK);
    mgpu__plot_labels(&f, ch->title, ch->xlabel, ch->ylabel);
    result = mgpu_canvas_write_png(f.c, path);
    mgpu_canvas_free(f.c);
    return result;
}

struct mgpu_animator {
    char *png_path, *csv_path; /* NULL: write nothing */
    char *title, *xlabel, *ylabel;
    double xmin, xmax;
    int nseries;
    char **names;
    int n, capacity; /* points added, and room for */
    double *x;       /* x[i]: the x of point i */
    double **y;      /* y[k][i]: series k at point i, NaN for none */
};

MGPU_DEF mgpu_animator *mgpu_animator_new(const char *png_path, const char *title,
                                          const char *xlabel, const char *ylabel, double xmin,
                                          double xmax, int nseries, const char *const *names) {
    mgpu_animator *a = (mgpu_animator *)mgpu__xmalloc(sizeof *a);
    memset(a, 0, sizeof *a);
    if (png_path) { /* the CSV goes beside the PNG: "run.png" -> "run.csv" */
        size_t stem = strlen(png_path);
        if (stem >= 4 && strcmp(png_path + stem - 4, ".png") == 0) stem -= 4;
        a->png_path = mgpu__plot_strdup(png_path);
        a->csv_path = (char *)mgpu__xmalloc(stem + 5);
        memcpy(a->csv_path, png_path, stem);
        strcpy(a->csv_path + stem, ".csv");
    }
    a->title = mgpu__plot_strdup(title);
    a->xlabel = mgpu__plot_strdup(xlabel);
    a->ylabel = mgpu__plot_strdup(ylabel);
    a->xmin = xmin;
    a->xmax = xmax;
    a->nseries = nseries > 0 ? nseries : 0;
    a->names = (char **)mgpu__xmalloc((size_t)a->nseries * sizeof *a->names);
    a->y = (double **)mgpu__xmalloc((size_t)a->nseries * sizeof *a->y);
    for (int k = 0; k < a->nseries; k++) {
        a->names[k] = mgpu__plot_strdup(names ? names[k] : NULL);
        a->y[k] = NULL;
    }
    return a;
}

MGPU_DEF void mgpu_animator_free(mgpu_animator *a) {
    if (!a) return;
    for (int k = 0; k < a->nseries; k++) {
        free(a->names[k]);
        free(a->y[k]);
    }
    free(a->names);
    free(a->y);
    free(a->x);
    free(a->png_path);
    free(a->csv_path);
    free(a->title);
    free(a->xlabel);
    free(a->ylabel);
    free(a);
}

/* A series number that the animator does not have is a bug in the caller. */
static void mgpu__animator_check(const mgpu_animator *a, int series) {
    MGPU_REQUIRE(series >= 0 && series < a->nseries, "animator has no series %d (it has %d)",
                 series, a->nseries);
}

MGPU_DEF int mgpu_animator_count(const mgpu_animator *a) { return a->n; }

MGPU_DEF double mgpu_animator_last(const mgpu_animator *a, int series) {
    mgpu__animator_check(a, series);
    for (int i = a->n - 1; i >= 0; i--)
        if (!isnan(a->y[series][i])) return a->y[series][i];
    return NAN;
}

/* "x,name1,name2,..." and then one line per point; NaN is an empty field,
   which spreadsheets and pandas read as a missing value. */
static int mgpu__animator_write_csv(const mgpu_animator *a) {
    mgpu__whole_file w;
    if (!mgpu__whole_file_open(&w, a->csv_path)) return mgpu__plot_write_failed(a->csv_path, "CSV", strerror(errno));
    FILE *f = w.f;
    fputs("x", f);
    for (int k = 0; k < a->nseries; k++) fprintf(f, ",%s", a->names[k] ? a->names[k] : "");
    for (int i = 0; i < a->n; i++) {
        fprintf(f, "\n%.9g", a->x[i]);
        for (int k = 0; k < a->nseries; k++) {
            if (isnan(a->y[k][i]))
                fputs(",", f);
            else
                fprintf(f, ",%.9g", a->y[k][i]);
        }
    }
    fputs("\n", f);
    int error = mgpu__whole_file_close(&w, 0);
    return error ? mgpu__plot_write_failed(a->csv_path, "CSV", strerror(error)) : 0;
}

/* The curve of series k, labelled `name`. */
static mgpu_series mgpu__animator_series(const mgpu_animator *a, int k, const char *name) {
    mgpu_series s;
    memset(&s, 0, sizeof s);
    s.name = name;
    s.n = a->n;
    s.x = a->x;
    s.y = a->y[k];
    return s;
}

/* A chart of `nseries` curves with the animator's title, labels and x range. */
static mgpu_chart mgpu__animator_chart(const mgpu_animator *a, int nseries,
                                       const mgpu_series *series) {
    mgpu_chart ch;
    memset(&ch, 0, sizeof ch);
    ch.title = a->title;
    ch.xlabel = a->xlabel;
    ch.ylabel = a->ylabel;
    ch.xmin = a->xmin;
    ch.xmax = a->xmax;
    ch.nseries = nseries;
    ch.series = series;
    return ch;
}

MGPU_DEF void mgpu_animator_add(mgpu_animator *a, double x, const double *ys) {
    mgpu_series *series;
    mgpu_chart ch;
    if (a->n == a->capacity) {
        a->capacity = a->capacity ? 2 * a->capacity : 64;
        a->x = (double *)mgpu__plot_grow(a->x, (size_t)a->capacity * sizeof *a->x);
        for (int k = 0; k < a->nseries; k++)
            a->y[k] = (double *)mgpu__plot_grow(a->y[k], (size_t)a->capacity * sizeof *a->y[k]);
    }
    a->x[a->n] = x;
    for (int k = 0; k < a->nseries; k++) a->y[k][a->n] = ys[k];
    a->n++;
    if (!a->png_path) return;
    series = (mgpu_series *)mgpu__xmalloc((size_t)a->nseries * sizeof *series);
    for (int k = 0; k < a->nseries; k++) series[k] = mgpu__animator_series(a, k, a->names[k]);
    ch = mgpu__animator_chart(a, a->nseries, series);
    /* One error line is enough: after a failed write the animator stops
       writing (rather than repeating the error at every point) and only
       keeps the points. */
    if (mgpu__animator_write_csv(a) != 0 || mgpu_chart_write_png(&ch, a->png_path) != 0) {
        free(a->png_path);
        free(a->csv_path);
        a->png_path = a->csv_path = NULL;
    }
    free(series);
}

MGPU_DEF int mgpu_animator_write_combined(const char *png_path, const char *title, int nanimators,
                                          const mgpu_animator *const *animators, int series,
                                          const char *const *labels) {
    mgpu_series *curves =
        (mgpu_series *)mgpu__xcalloc((size_t)(nanimators > 0 ? nanimators : 0), sizeof *curves);
    mgpu_chart ch;
    int result;
    memset(&ch, 0, sizeof ch);
    for (int i = 0; i < nanimators; i++) {
        const mgpu_animator *a = animators[i];
        mgpu__animator_check(a, series);
        const char *label = labels ? labels[i] : a->title ? a->title : a->names[series];
        curves[i] = mgpu__animator_series(a, series, label);
    }
    if (nanimators > 0) {
        ch = mgpu__animator_chart(animators[0], nanimators, curves);
        /* the legend names the runs, so the y axis says what the curves are */
        if (!ch.ylabel || !*ch.ylabel) ch.ylabel = animators[0]->names[series];
    }
    ch.title = title;
    result = mgpu_chart_write_png(&ch, png_path);
    free(curves);
    return result;
}

/* ---- 4. device timelines ------------------------------------------------ */

/* A distinct bar name and the palette colour it got. */
typedef struct mgpu__timeline_key {
    const char *name;
    int slot;
} mgpu__timeline_key;

/* FNV-1a: a simple hash that spreads short names well. */
static uint32_t mgpu__timeline_hash(const char *s) {
    uint32_t h = 2166136261u;
    while (*s) h = (h ^ (unsigned char)*s++) * 16777619u;
    return h;
}

/* The index of `name` among the keys, adding it on first sight. A new name
   gets the colour its hash points at or, if another name has that one, the
   next free one (linear probing): the same name keeps its colour from one
   picture to the next as far as possible, and two names in a picture share
   a colour only when there are more than ten. */
static int mgpu__timeline_key_of(mgpu__timeline_key *keys, int *nkeys, const char *name) {
    int slot = (int)(mgpu__timeline_hash(name) % 10);
    for (int k = 0; k < *nkeys; k++)
        if (strcmp(keys[k].name, name) == 0) return k;
    for (int tries = 0; tries < 10; tries++, slot = (slot + 1) % 10) {
        int taken = 0;
        for (int k = 0; k < *nkeys; k++) taken |= keys[k].slot == slot;
        if (!taken) break;
    } /* all ten taken: the loop came back round to the hash's colour */
    keys[*nkeys].name = name;
    keys[*nkeys].slot = slot;
    return (*nkeys)++;
}

/* The legend under a timeline: a colour square and a name for each of the
   first ten keys (then "+N more"), in rows wrapped at `width`. Returns its
   height; with c == NULL it only measures. */
static int mgpu__timeline_legend(mgpu_canvas *c, int x0, int y0, int width,
                                 const mgpu__timeline_key *keys, int nkeys, int s) {
    int x = x0, y = y0, row = 14 * s, shown = nkeys < 10 ? nkeys : 10;
    char more[32];
    snprintf(more, sizeof more, "+%d more", nkeys - shown);
    for (int k = 0; k < shown + (nkeys > shown); k++) {
        const char *text = k < shown ? keys[k].name : more;
        int swatch = k < shown ? 11 * s : 0, w = swatch + mgpu_text_width(text, s);
        if (x > x0 && x + w > x0 + width) x = x0, y += row; /* wrap */
        if (c && k < shown)
            mgpu_canvas_fill_rect(c, x, y, x + 7 * s, y + 7 * s, mgpu_palette(keys[k].slot));
        if (c) mgpu_canvas_text(c, x + swatch, y, text, MGPU__INK, s);
        x += w + 14 * s;
    }
    return nkeys ? y + row - y0 : 0;
}

/* Black or white, whichever reads better on `rgb` (by its luminance). */
static uint32_t mgpu__timeline_text_color(uint32_t rgb) {
    double luma = 0.299 * (rgb >> 16 & 255) + 0.587 * (rgb >> 8 & 255) + 0.114 * (rgb & 255);
    return luma > 150 ? 0x000000 : 0xFFFFFF;
}

MGPU_DEF int mgpu_timeline_write_png(const char *path, const char *title, int nlanes,
                                     const char *const *lane_names, int nbars,
                                     const mgpu_timeline_bar *bars) {
    const int s = 2, width = 1000, lane_h = 16 * s;
    const char *xlabel = "time (ms)";
    size_t room = (size_t)(nbars > 0 ? nbars : 0); /* at most one key per bar */
    mgpu__timeline_key *keys = (mgpu__timeline_key *)mgpu__xcalloc(room, sizeof *keys);
    int *key_of = (int *)mgpu__xcalloc(room, sizeof *key_of);
    int nkeys = 0, names_w = 0, legend_h, result;
    double lo = INFINITY, hi = -INFINITY;
    mgpu__plot_frame f;
    for (int b = 0; b < nbars; b++) { /* bars off every lane or with no time span are left out */
        int drawn = bars[b].lane >= 0 && bars[b].lane < nlanes && isfinite(bars[b].start_ms) &&
                    isfinite(bars[b].end_ms) && bars[b].start_ms <= bars[b].end_ms;
        key_of[b] = drawn ? mgpu__timeline_key_of(keys, &nkeys, bars[b].name) : -1;
        if (drawn) lo = fmin(lo, bars[b].start_ms), hi = fmax(hi, bars[b].end_ms);
    }
    for (int l = 0; l < nlanes; l++)
        if (mgpu_text_width(lane_names[l], s) > names_w)
            names_w = mgpu_text_width(lane_names[l], s);
    /* The picture is as tall as its lanes and legend need. */
    legend_h = mgpu__timeline_legend(NULL, 4 * s, 0, width - 8 * s, keys, nkeys, s);
    f.c = mgpu_canvas_new(width,
                          mgpu__plot_top(title, s) + nlanes * lane_h + 1 +
                              mgpu__plot_bottom(xlabel, s) + legend_h + 4 * s,
                          MGPU__WHITE);
    f.scale = s;
    f.ay.lo = f.ay.hi = f.ay.step = 0; /* unused: the vertical direction holds lanes, not values */
    mgpu__plot_layout(&f, lo, hi, 0, names_w, legend_h + 4 * s, title, xlabel, NULL);
    for (int l = 0; l < nlanes; l++) {
        int top = f.y0 + l * lane_h;
        /* every other lane shaded: stripes guide the eye along a lane */
        if (l % 2) mgpu_canvas_fill_rect(f.c, f.x0, top, f.x1, top + lane_h, 0xF4F4F4);
        mgpu_canvas_text(f.c, f.x0 - 5 * s - mgpu_text_width(lane_names[l], s),
                         top + (lane_h - MGPU__CAP_H * s) / 2, lane_names[l], MGPU__INK, s);
    }
    mgpu__plot_ticks(&f, 0);
    for (int b = 0; b < nbars; b++) {
        const mgpu_timeline_bar *bar = &bars[b];
        int x0 = (int)lround(mgpu__plot_px(&f, bar->start_ms)),
            x1 = (int)lround(mgpu__plot_px(&f, bar->end_ms));
        int top = f.y0 + bar->lane * lane_h + 3 * s, bottom = top + lane_h - 6 * s;
        uint32_t rgb;
        if (key_of[b] < 0) continue;
        rgb = mgpu_palette(keys[key_of[b]].slot);
        /* At least one pixel, so that the shortest operation still shows; a
           one-pixel gap at the end, so that back-to-back bars stay apart. */
        x1 = x1 - x0 >= 3 ? x1 - 1 : x0 + 1;
        mgpu_canvas_fill_rect(f.c, x0, top, x1, bottom, rgb);
        const char *text = bar->label[0] ? bar->label : bar->name;
        if (mgpu_text_width(text, s) + 4 * s <= x1 - x0)
            mgpu_canvas_text(f.c, (x0 + x1 - mgpu_text_width(text, s)) / 2,
                             (top + bottom - MGPU__CAP_H * s) / 2, text, mgpu__timeline_text_color(rgb), s);
    }
    mgpu__plot_outline(f.c, f.x0, f.y0, f.x1, f.y1, MGPU__INK);
    mgpu__plot_labels(&f, title, xlabel, NULL);
    mgpu__timeline_legend(f.c, 4 * s, f.y1 + mgpu__plot_bottom(xlabel, s), width - 8 * s, keys,
                          nkeys, s);
    result = mgpu_canvas_write_png(f.c, path);
    mgpu_canvas_free(f.c);
    free(keys);
    free(key_of);
    return result;
}
#endif /* MGPU__IMPLEMENTED */
#endif /* MGPU_IMPLEMENTATION */
