/* mgpu.h: multi-GPU deep learning in C, from the ground up.

   A single-header teaching library (stb style). In exactly ONE source file:

       #define MGPU_IMPLEMENTATION
       #include "mgpu.h"

   and plain `#include "mgpu.h"` everywhere else (in that one file before
   any system header: it asks for the POSIX functions it needs by defining
   _GNU_SOURCE, unless -D_GNU_SOURCE already did). Build with gcc as C11
   for the CPU backend, or with nvcc (as CUDA C++) for the CPU and CUDA
   backends.
   This file is the manual and the API. The implementation is in mgpu/,
   one topic a file, and the kernels in kernels/, one family of operations
   a file (each holds the CPU reference of its operations beside their
   CUDA versions): mgpu.h includes them where MGPU_IMPLEMENTATION is
   defined, so a program still compiles one file.
   Link with: -lopenblas -lstb -lz -lpthread -lm, and with nvcc also
   -lcublas -lnccl. For processes that work as a group (the DISTRIBUTED
   section), add -DMGPU_MPI=1 and MPI's flags (mpicc --showme:compile and
   --showme:link). (The tests also build the CUDA path with g++ on
   emulated GPUs, MGPU_CUDA_EMU: see tests/cuda_emu.h.)

   ======================================================================
   THE MANUAL
   ======================================================================

   Contents: the manual's sections, and the files that implement them.
     1. Errors                       mgpu/core.h (a GPU's bad label:
                                     mgpu/queues.h, at mgpu_synchronize)
     2. Devices are queues           mgpu/queues.h, mgpu/devices.h
     3. Events and timers            mgpu/events.h, mgpu/timing.h
     4. Tensors                      mgpu/tensors.h, mgpu/memory.h
     5. Operations                   mgpu/tensor_ops.h, kernels/elementwise.h,
                                     kernels/matmul.h
     6. Random numbers               mgpu/core.h (Philox), mgpu/tensor_ops.h
     7. Tracing                      mgpu/timing.h
     8. Settings                     mgpu/settings.h
   and, with the API below:
     command-line flags              mgpu/flags.h
     DATA                            mgpu/data.h
     LAYERS                          mgpu/layers.h, mgpu/convolution.h,
                                     kernels/conv*.h, pool.h, activation.h,
                                     linear.h, winograd.h, channels_last.h
     TRAINING                        mgpu/training_ops.h, kernels/batchnorm.h,
                                     loss.h, sgd.h, adam.h
     COMMUNICATION, NCCL             mgpu/communication.h
     NETWORKS                        mgpu/networks.h, mgpu/net_training.h,
                                     mgpu/checkpoints.h
     DATA PARALLELISM                mgpu/data_parallel.h, mgpu/zero.h,
                                     mgpu/data_parallel_step.h
     PIPELINES                       mgpu/pipelines.h
     DISTRIBUTED                     mgpu/groups.h (and the wrapper across
                                     processes in mgpu/data_parallel.h)
     TENSOR PARALLELISM              mgpu/tensor_parallel.h
     DRAWING                         mgpu/plots.h
   and, under the kernels: kernels/common.h (what CPU and CUDA kernels
   share) and kernels/ptx.h (the tensor cores' instructions);
   and, for the tests and benchmarks alone:
     the internals they reach        mgpu/testing.h

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
       int mgpu_num_cores(void);             CPU cores this process may run on
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

       int mgpu_bound_hold(const char *figure, double value, mgpu_bound_side side,
                           double bound, double tolerance, const char *advice)
   A measured figure against what it cannot be: side MGPU_AT_MOST (a
   speedup at most the processes), MGPU_AT_LEAST (a pipeline's bubble at
   least its formula). Returns 1 where value keeps the bound within the
   relative tolerance; else prints one line to stdout, "  ! <figure>
   <value> is above its bound <bound>: the machine was busy or too small
   for it; <advice>", and returns 0. mgpu_bound_line writes that line
   into a buffer instead (returns 1 where the bound holds and the buffer
   is left empty). Chapters check each figure they print this way.

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
   draws one lane per device queue, so overlap can be seen, each bar
   coloured by its operation's kind of work: "forward", "backward", "loss
   and accuracy", "optimizer", "communication" (collectives, the ring's
   copies and adds), "waiting for the other ranks", "copy", "tensor
   arithmetic" (add, sum, scale, fill); an operation of none of them
   ("matmul") is a kind of its own. A collective of a process group
   (DISTRIBUTED) is recorded in two parts: "waiting for the other ranks",
   until the last rank has called it, then the moving of data under its
   own name ("allreduce"), so a timeline tells a slow link from a late
   rank. The summary
   is a profile: per operation name, how often it ran, its total and mean
   time and its share of all traced time, the largest first. On a GPU the
   times come from CUDA events around each operation. A program reads
   what was recorded (ending the trace if it is still on) as data:
       int mgpu_trace_count(void)              operations recorded
       mgpu_trace_op mgpu_trace_get(int i)     the i-th: device, lane (0
                      compute, 1 copy), queue and operation names, its
                      kind, start and end in ms since mgpu_trace_begin
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
     MGPU_CONV=rule|timed|im2col|implicit|cudnn
                        how convolutions compute: rule (the default) a
                        fixed rule per shape and kind of device, so that
                        a run repeats to the bit (the LAYERS section
                        says which); timed times im2col, the library's
                        convolution kernels and (built with cuDNN)
                        cuDNN's algorithms at the first call with each
                        shape and keeps the fastest for each of the
                        forward pass, dx and dW (PyTorch's
                        cudnn.benchmark: two runs may choose, and round,
                        differently); im2col forces im2col and the matrix
                        product; implicit the fastest kernels wherever
                        one fits (the LAYERS section lists what is
                        tried); cudnn cuDNN's fastest algorithm alone. On
                        a CPU, rule takes mgpu's Winograd for wide 3x3
                        layers where oneDNN runs no AVX-512 kernels (or
                        is not built in), and oneDNN elsewhere but for a
                        few backward passes; timed chooses among im2col,
                        oneDNN and mgpu's Winograd by timing; implicit
                        means oneDNN (im2col without it), and cudnn
                        im2col.
     MGPU_WGMMA=1|0     1 (the default): on an H100 or H200 the trial
                        also times the kernels built on Hopper's
                        warpgroup products; 0 leaves them out.
     MGPU_DATA=DIR      the Fashion-MNIST folder when no --data flag
                        names one (else data/fashion-mnist).
     MGPU_CHECK_REPLICAS=0|1
                        1: data parallelism compares its replicas'
                        parameters after every step and stops at the
                        first that differs (DATA PARALLELISM); read at
                        start, like MGPU_TF32.
     MGPU_DIST_TIMEOUT=SECONDS
                        how long a rank waits for the others, at a
                        collective, a barrier or a send, before it names
                        the ranks that stopped and ends the job
                        (DISTRIBUTED; default 120, at most 1e6).
     MGPU_DIST_BACKEND=nccl|mpi
                        how the processes of a group, each with a GPU of
                        its own, move tensors: nccl (the default) with
                        NCCL, GPU to GPU, where it can start (else MPI,
                        said in one line); mpi through host memory
                        (DISTRIBUTED). Read at start, like MGPU_TF32;
                        mgpu_set_dist_backend called after that wins.
     OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_RANK, PMI_SIZE, PMI_RANK,
     SLURM_STEP_NUM_TASKS, SLURM_PROCID
                        read, never set: the launcher's (mpirun's, or
                        srun's) word for how many processes it started
                        and which one this is, before MPI starts. Errors
                        that every rank meets alike are then said once,
                        by rank 0, and each error line names its rank.
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
MGPU_DEF int mgpu_num_cores(void);
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
/* A measured figure's bound: what it cannot exceed, or fall below. */
typedef enum { MGPU_AT_MOST, MGPU_AT_LEAST } mgpu_bound_side;
MGPU_DEF int mgpu_bound_line(char *line, size_t size, const char *figure, double value, mgpu_bound_side side,
                             double bound, double tolerance, const char *advice);
MGPU_DEF int mgpu_bound_hold(const char *figure, double value, mgpu_bound_side side, double bound,
                             double tolerance, const char *advice);
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
                          0 or more, 's' a name, 'f' a folder, 'b' switch, 'n' a common flag this program
                          refuses: giving it fails with help as the message, and --help omits it
                          (value NULL) */
    void *value;       /* int* ('i', 'u', 'b'), double* ('d', 'z'), const char** ('s', 'f') */
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
    const char *kind;       /* its kind of work: "forward", "communication", ... (manual 7) */
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
   dw [K, C, R, S] may be NULL (the input gradient alone, as a zero-bubble
   pipeline's B computes it); db [K] may be NULL (no bias). x and w are the forward
   pass's input and weight. A convolution works through im2col in chunks
   of images whose scratch (the col buffer) is at most 4 MiB on the CPU
   and 256 MiB on a GPU. That is the reference, on every device.
   On a CPU built with oneDNN (MGPU_ONEDNN=1; the Makefile sets it where
   Debian's libdnnl-dev is installed), each pass may instead take oneDNN's
   kernels, PyTorch's CPU convolutions (kernels/conv_onednn.h): its
   direct ones, which PyTorch takes, on its blocked layouts or on
   channels-last activations, or, for 3x3 layers at stride 1 where
   oneDNN runs AVX-512, its Winograd F(4x4, 3x3) ones (fewer products,
   more rounding). By rule (the default), in this order: mgpu's own
   Winograd where it pays (below: where oneDNN runs no AVX-512); 3x3
   layers at stride 1 from 32 channels and filters whose outputs, larger
   than 4 x 4 pixels, fill at least three quarters of their 4 x 4 tiles
   take oneDNN's Winograd where it has it, which took 0.39 to 0.76 of its
   direct kernels' time on ResNet-18's such layers on a 2-core CPU (it
   lost at one channel, and where the tiles were mostly padding); the
   backward passes of 1x1 windows at a stride and of outputs of 4 x 4
   pixels or fewer take im2col, which won the trials on 2-core CPUs (not
   where oneDNN runs AVX-512 kernels and OpenBLAS AVX2 ones: there oneDNN
   won all but one of them); where oneDNN runs AVX-512, layers on 2
   channels or more whose channels or filters are not a multiple of 16
   (LeNet's) take the direct kernels on channels-last activations, as a
   blocked layout computes on channels padded to 16 (LeNet's second
   layer took 0.56 to 0.83 of the blocked kernels' time); every other
   pass takes oneDNN's direct kernels on its blocked layouts. Each pass
   (forward, dx, dW) takes its own way. With MGPU_CONV=timed the first
   call of a pass with a shape times each way (im2col, oneDNN's three
   methods and, for 3x3 layers at stride 1, mgpu's Winograd, below) and
   keeps the fastest (so, as on a GPU, the rounding of the results can
   differ from run to run).
   oneDNN's results depend on the number of threads too. A first layer's
   weight gradient on grayscale images (C*R*S <= 9, no dx asked for)
   takes kernels/conv_few_inputs.h's CPU kernel instead, in every mode
   but im2col, with or without oneDNN. By rule, too, 3x3 layers at
   stride 1 take Winograd's F(2x2, 3x3) (kernels/winograd.h: 16 products
   by OpenBLAS in place of 36 multiplies a 2x2 tile of outputs) for the
   forward pass from 128 channels and filters, dx from 512 and dW from
   64, where it beat oneDNN's AVX2 kernels on a 2-core CPU, with oneDNN
   or without; not where oneDNN runs AVX-512 kernels, which beat it on
   all of ResNet-18's passes but dW at 512 channels. timed times it
   beside the other ways; im2col and implicit leave it out. Its scratch,
   the transformed tensors, is 4 times the input and the output of the
   whole batch, not cut into chunks; its products are OpenBLAS's, whose
   sums, like im2col's, may round differently with the number of
   threads.
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
   MGPU_CONV chooses: rule (the default) takes, with no clock, what the
   timed trials chose for most of ResNet-18's shapes on an H200: the
   first layer by few inputs, the direct kernel in its 64 x 128 tile (by
   wgmma where the GPU has it), dx at stride 2 by quads, and im2col where
   the output has 4 x 4 pixels or fewer; so a run repeats to the bit.
   timed times every candidate at the first call with each shape and
   keeps the fastest for each pass, as PyTorch's cudnn.benchmark does
   (so the rounding of TF32 results can differ from run to run),
   counting the channels-last copies the kernels read (none that a
   network prepares for them); im2col forces
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
   dx (may be NULL) = dy w^T; dw (may be NULL) = x^T dy; db (may be NULL)
   = the sum of the rows of dy.

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
   A zero-bubble pipeline (PIPELINES) splits a backward pass into the
   input's gradient (B) and the parameters' (W, later). A layer of yours
   runs whole in B unless you set l->split_backward = 1 on the layer
   mgpu_net_add_layer returns: then its backward is called twice for a
   pass, first with dx alone (dweight and dbias NULL), later with dweight
   and dbias alone (dx NULL), with the same dy, x and y, so it must
   compute each from those alone (every other pass gives all three at
   once).
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
   mode it uses the running ones (mgpu_net_set_training), which each
   training pass moves a fraction `momentum` of the way to the batch's
   (0.1, PyTorch's default; mgpu_net_set_batchnorm_momentum sets every
   batch norm's, as BatchNorm2d(momentum=...) does: a short run whose
   activations are far from the running variance's start of 1 needs
   more). On a GPU, once
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

       void mgpu_net_recompute(mgpu_net *net, int segments)
   activation recomputation, which the literature calls gradient
   checkpointing (Chen et al. 2016; PyTorch's checkpoint_sequential); this
   library keeps the word "checkpoint" for files (mgpu_checkpoint_save),
   and mgpu_net_checkpoint remains as the old name of this function. The
   layers are cut into `segments` runs of
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
   kernels on the same inputs (with MGPU_CONV=timed, while the trial is
   timing its candidates in the first steps, two passes may take two of
   them). Batch
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

       void mgpu_net_set_layer_hook(net, fn, ctx)
   calls fn(ctx, net, layer, when) around each of the network's layers'
   passes, `when` one of MGPU_BEFORE_FORWARD, MGPU_AFTER_FORWARD (around
   a forward pass, and around the forward pass that recomputation runs
   again within the backward pass, after MGPU_BEFORE_BACKWARD of the
   run's last layer), MGPU_BEFORE_BACKWARD and MGPU_AFTER_BACKWARD
   (around the layer's backward pass); fn NULL removes it. ZeRO-3
   (mgpu_data_parallel_zero) gathers a unit's parameters with one, and
   the ZeRO-3 assignment writes one: what the hook allocates counts under
   MGPU_MEMORY_PARAMETERS. A network that a ZeRO-3 wrapper holds has the
   wrapper's hook: setting another is a one-line error.

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
   way (MGPU_CONV=timed times the ways again in a new process, and may
   choose another, whose sums round differently; the default rule does
   not).
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
    int split_backward;       /* a layer of yours: its backward may compute dx and the parameters'
                                 gradients in two calls (a zero-bubble pipeline's B and W) */
    float momentum;           /* batch norm: how far each training pass moves the running
                                 statistics towards the batch's (0.1) */
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

/* When a layer hook is called (mgpu_net_set_layer_hook). */
enum { MGPU_BEFORE_FORWARD, MGPU_AFTER_FORWARD, MGPU_BEFORE_BACKWARD, MGPU_AFTER_BACKWARD };
typedef struct mgpu_net mgpu_net;
typedef void (*mgpu_layer_hook_fn)(void *ctx, mgpu_net *net, int layer, int when);

struct mgpu_net {
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
    /* called around each of its layers' passes, or NULL
       (mgpu_net_set_layer_hook) */
    mgpu_layer_hook_fn layer_hook;
    void *layer_hook_ctx;
    const char *layer_hook_owner; /* the library's part that set it ("a ZeRO-3 wrapper"), NULL if yours */
    float beta1, beta2, eps;
    /* activation recomputation (mgpu_net_recompute): runs asked for (0, as made, or 1: none),
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
};

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
MGPU_DEF void mgpu_net_set_batchnorm_momentum(mgpu_net *net, float momentum);
#define MGPU_SEGMENTS_SQRT (-1) /* mgpu_net_recompute: about sqrt(n) runs of n layers */
MGPU_DEF void mgpu_net_recompute(mgpu_net *net, int segments);
#define mgpu_net_checkpoint mgpu_net_recompute /* the old name, kept for programs written against it */
MGPU_DEF void mgpu_net_free_activations(mgpu_net *net);
MGPU_DEF void mgpu_net_want_input_grad(mgpu_net *net, int on);
MGPU_DEF mgpu_tensor *mgpu_net_input_grad(mgpu_net *net);
MGPU_DEF void mgpu_net_set_layer_hook(mgpu_net *net, mgpu_layer_hook_fn fn, void *ctx);
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
   wrapper (bit for bit where the sums' order is the same: within a
   process stage 1's ring reduces the bucket's values alone, not its
   padding, and stage 2's reduce-scatter adds each value in the order the
   ring does). Stage 3 (fully sharded data parallelism, PyTorch's FSDP):
   between steps member m keeps chunk m of each bucket's values too, so
   each device holds (4P + 4P + 8P)/W of the model's state with Adam. A
   bucket is the unit gathered (mgpu_data_parallel_configure's size chooses
   it): before its layers' forward pass, and again before their backward
   pass, every device gathers the members' chunks into the whole bucket,
   which the parameters view, and frees it after them; the gradients are
   reduce-scattered and stepped as in stage 2. The next unit's gather runs
   on the copy queue while this unit computes (the timeline shows it as
   "ZeRO-3 gather"): at most two units are whole at a time. Across
   processes it is the group's all-gather ("all-gather" in the timeline),
   on the communication queue: it overlaps the unit's work on CPU
   devices; on GPUs the host waits for it, by MPI through the host or by
   NCCL (mgpu/groups.h), so there it does not. A recomputed forward
   pass (mgpu_net_recompute) gathers its units again. The gathers and
   frees are the replicas' layer hook (mgpu_net_set_layer_hook): stage 3
   refuses a network that has a hook of yours. Between steps
   param.value of a wrapped network points at nothing (a use of it is an
   error line), but mgpu_net_forward on the module still works: it gathers
   as it goes (over a distributed wrapper's ranks each gather is a
   collective, so every rank must run the same forward passes:
   mgpu_dist_evaluate_accuracy, whose ranks each take their own rows,
   refuses such a network until the wrapper is freed). The replicas' check
   compares what there is to compare: every device's gathered values,
   against device 0's, each step. mgpu_data_parallel_accumulate works with
   every stage: under stages 2 and 3 the passes without a step keep each
   bucket's whole gradient, adding to it, and the step's pass
   reduce-scatters it (FSDP's no_sync does the same: between the passes
   the gradients take their unsharded memory again). A checkpoint of a
   sharded network is refused until the wrapper is freed, which gathers
   the state (and under stage 3 the values) back into the module. */
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

   Zero bubble (ZB-H1, Qi et al. 2023). A backward pass is two: B, the
   gradient of the stage's input, which the stage before waits for, and
   W, the gradients of its weights, which nobody waits for. ZB-H1 runs
   1F1B's order with B in place of the backward pass, and stage s puts
   each W off until s more B passes have run; the B passes then travel
   back through the stages without the W passes in their way, and the
   last stages' W passes, put off longest, fill the time they idled at
   the end of 1F1B, waiting for the first stages' backward passes. With F, B
   and W taking TF, TB, TW, each stage idles (p - 1)(TF + TB - TW)
   against m(TF + TB + TW) of work; equal ones, a fraction
   (p - 1) / (3m + p - 1) of the time, a third of 1F1B's (for m >= p).
   The price: a micro-batch keeps its activations and the output
   gradients W reads until its W, so every stage holds p micro-batches
   (1F1B's stage 0 does; its stage s, p - s). What splits: convolutions
   and linear layers (dx in B, dW and db in W), and layers of yours that
   say so (l->split_backward, NETWORKS); batch norm computes dgamma and
   dbeta in B, and a residual block runs whole in B, its convolutions'
   weight gradients too (splitting them would keep the block's inner
   gradients): it costs bubble, not correctness.

   Interleaved 1F1B (Megatron-LM; PyTorch's ScheduleInterleaved1F1B).
   The bubble is p - 1 stage-passes long whatever a stage holds, so
   smaller stages make it shorter: cut the network into p v stages, and
   give device d the v chunks d, d + p, d + 2p, ... A micro-batch then
   goes round the devices v times. Each device runs its chunks' passes
   in rounds of p micro-batches: a warm-up of 2 (p - d - 1) + (v - 1) p
   forward passes (the k-th of chunk (k / p) mod v, of micro-batch
   (k / pv) p + k mod p), then one forward and one backward in turn (the
   backward passes over the chunks the other way), then the backward
   passes left. With equal chunks the bubble is (p - 1) / (vm + p - 1),
   1/v of 1F1B's for m much larger than p; the price is v times as many
   transfers between devices, and device d holds up to 2 (p - d - 1) +
   (v - 1) p + 1 chunks' micro-batches (each 1/v of a stage's). As in
   Megatron, m must be a multiple of p.

   A schedule is the order of each stage's passes, given by a function:
       typedef enum { MGPU_PASS_WHOLE, MGPU_PASS_INPUT_GRAD, MGPU_PASS_WEIGHT_GRAD } mgpu_pass_part;
       typedef struct mgpu_pipeline_pass {
           int backward, micro_batch;
           mgpu_pass_part part;   a backward pass's part: whole, B or W
           int chunk;             an interleaved pipeline's: the device's chunk
       } mgpu_pipeline_pass;
       void schedule(int stage, int stages, int micro_batches, mgpu_pipeline_pass *order);
   writes the 2m passes of `stage` into order, in the order it runs them
   (a schedule that leaves part alone gets whole backward passes), or 3m
   where it splits each backward pass into B (part MGPU_PASS_INPUT_GRAD)
   and W (MGPU_PASS_WEIGHT_GRAD). mgpu_schedule_gpipe, mgpu_schedule_1f1b
   and mgpu_schedule_zb_h1 are the library's; a schedule of your own is
   checked: every pass once, each micro-batch's backward after its
   forward, its W after its B, a stage's backward passes all split or
   none, and no stage waiting for a pass that waits for it (a one-line
   error naming the stages and passes). An interleaved pipeline's
   schedule orders each device's passes over its chunks:
       void schedule(int device, int devices, int chunks, int micro_batches, mgpu_pipeline_pass *order);
   writes device's 2vm passes (3vm split), each with its chunk (0 to
   v - 1: stage chunk * devices + device); mgpu_schedule_interleaved_1f1b
   is the library's, and it is checked as the others are.

   What a step does. The host enqueues every stage's passes in their
   order, each on its stage's device, with the copies between stages
   (manual section 4: a copy waits for its source and its destination),
   and returns: the devices then run the schedule by themselves. Each
   micro-batch's loss is scaled by 1/N, N the batch's rows, so the
   gradients are the whole batch's mean loss's. A stage keeps, for each
   micro-batch in flight, a copy of its layers (a slot) with that
   micro-batch's activations, sharing the parameters, their gradients and
   batch norm's buffers: m slots under GPipe, min(m, p - s) under 1F1B,
   min(m, p) under ZB-H1 (a micro-batch's slot is free after its W).
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
       mgpu_pipeline *mgpu_pipeline_new_interleaved(mgpu_net *net, mgpu_device *const *devices, int ndevices,
                                                    int chunks, const int *first_layers)
   the same cut into ndevices * chunks stages (first_layers has that many;
   NULL: equal numbers of layers), stage s on devices[s mod ndevices]; each
   stage a network of its own, as above. Refused as above, and for more
   than MGPU_MAX_DEVICES stages.
       void mgpu_pipeline_set_schedule(pp, schedule, micro_batches)
   the default is mgpu_schedule_gpipe with 1 micro-batch: naive.
       void mgpu_pipeline_set_interleaved_schedule(pp, schedule, micro_batches)
   an interleaved pipeline's (the default: mgpu_schedule_interleaved_1f1b
   with m = ndevices); mgpu_pipeline_set_schedule refuses such a
   pipeline by name.
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
   schedule, so that no two ranks wait for each other (any schedule: a W
   pass sends nothing). loss_sum is the
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
   stage is labelled "F<j>" in the trace, of its backward pass (or its B)
   "B<j>", of its W "W<j>" (mgpu_trace_label; in an interleaved pipeline
   with the chunk: "F3c1"), so a step between mgpu_trace_begin and
   mgpu_trace_end tells where the time went:
       mgpu_pipeline_timing t = mgpu_pipeline_measure(pp);
   t.span_ms from the first labelled operation's start to the last one's
   end; per stage (an interleaved pipeline's: per device, t.stages of
   them), t.busy_ms[s] (its compute queue's labelled operations) and
   t.bubble[s] = 1 - busy / span; t.bubble_mean, their mean, beside
   mgpu_pipeline_bubble_formula(p, m), (p - 1) / (m + p - 1) (GPipe and
   1F1B), mgpu_pipeline_zb_h1_bubble_formula(p, m), (p - 1) / (3m + p - 1)
   (ZB-H1 with equal F, B and W; m < p is refused by name), or
   mgpu_pipeline_interleaved_bubble_formula(p, v, m), (p - 1) /
   (vm + p - 1) (interleaved 1F1B with equal chunks).
       int mgpu_pipeline_write_timeline(pp, path, title)
   draws it: a lane per stage (per device, interleaved), a bar per pass
   (forward, backward, and a split one's B and W, each in its colour, and
   a colour for each chunk's; labelled by micro-batch and chunk); the
   bubbles are the gaps. */
typedef struct mgpu_pipeline mgpu_pipeline;
typedef enum {
    MGPU_PASS_WHOLE,        /* a backward pass: both gradients (GPipe, 1F1B) */
    MGPU_PASS_INPUT_GRAD,   /* its input's gradient alone: zero-bubble's B */
    MGPU_PASS_WEIGHT_GRAD   /* its weights' gradients alone, after B: zero-bubble's W */
} mgpu_pass_part;
typedef struct mgpu_pipeline_pass {
    int backward, micro_batch;
    mgpu_pass_part part; /* a backward pass's part (left 0: the whole) */
    int chunk;           /* an interleaved pipeline's: which of the device's chunks (left 0: the first) */
} mgpu_pipeline_pass;
typedef void (*mgpu_schedule_fn)(int stage, int stages, int micro_batches, mgpu_pipeline_pass *order);
typedef void (*mgpu_interleaved_schedule_fn)(int device, int devices, int chunks, int micro_batches,
                                             mgpu_pipeline_pass *order);
MGPU_DEF void mgpu_schedule_gpipe(int stage, int stages, int micro_batches, mgpu_pipeline_pass *order);
MGPU_DEF void mgpu_schedule_1f1b(int stage, int stages, int micro_batches, mgpu_pipeline_pass *order);
MGPU_DEF void mgpu_schedule_zb_h1(int stage, int stages, int micro_batches, mgpu_pipeline_pass *order);
MGPU_DEF void mgpu_schedule_interleaved_1f1b(int device, int devices, int chunks, int micro_batches,
                                             mgpu_pipeline_pass *order);
MGPU_DEF mgpu_pipeline *mgpu_pipeline_new(mgpu_net *net, mgpu_device *const *devices, int stages,
                                          const int *first_layers);
MGPU_DEF mgpu_pipeline *mgpu_pipeline_new_interleaved(mgpu_net *net, mgpu_device *const *devices, int ndevices,
                                                      int chunks, const int *first_layers);
MGPU_DEF mgpu_pipeline *mgpu_pipeline_new_group(mgpu_net *net, struct mgpu_group *g, const int *first_layers);
MGPU_DEF void mgpu_pipeline_set_schedule(mgpu_pipeline *pp, mgpu_schedule_fn schedule, int micro_batches);
MGPU_DEF void mgpu_pipeline_set_interleaved_schedule(mgpu_pipeline *pp, mgpu_interleaved_schedule_fn schedule,
                                                     int micro_batches);
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
MGPU_DEF double mgpu_pipeline_zb_h1_bubble_formula(int stages, int micro_batches);
MGPU_DEF double mgpu_pipeline_interleaved_bubble_formula(int devices, int chunks, int micro_batches);
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
     "nccl"          NCCL between the ranks' GPUs, GPU to GPU, on the
                     device's communication queue (below);
     "mpi via host"  GPU tensors copied to host memory, through MPI, and
                     back, with the calling thread waiting for it: the
                     way between GPUs of different processes where NCCL
                     cannot start, or with MGPU_DIST_BACKEND=mpi;
     "none"          a group of one.
   On GPUs both wait on the calling thread for each collective (a
   bucket's reduction does not overlap the backward pass), so that a rank
   that never comes is a timeout (Faults, below), not a hang in a later
   CUDA call.
   NCCL between processes, as PyTorch's DDP on GPUs:
       mgpu_set_dist_backend(MGPU_BACKEND_NCCL or MGPU_BACKEND_MPI)
       mgpu_get_dist_backend()     MGPU_DIST_BACKEND's, unless set
   With MGPU_BACKEND_NCCL (the default) a group's first collective of GPU
   tensors all-gathers the ranks' GPU UUIDs and NCCL versions. Where two
   ranks share a GPU (NCCL refuses it), a rank's NCCL is older than 2.14,
   or a rank's communicator fails to start, rank 0 says why in one line,
       NCCL cannot start between the 2 ranks' GPUs: ranks 0 and 1 share
       GPU GPU-... (NCCL takes one rank a GPU); the group goes through the
       host over MPI
   and the group's collectives go "mpi via host". Else rank 0's
   ncclUniqueId reaches every rank over MPI, and each starts its
   communicator without blocking (ncclCommInitRankConfig, config.blocking
   = 0), polling ncclCommGetAsyncError. Allreduce, broadcast, all-gather
   and reduce-scatter then run with NCCL; sends and receives (a
   pipeline's) still go through the host. NCCL has no timeout of its
   own: every wait for it is watched as MPI's are, polling
   ncclCommGetAsyncError and the collective's event. A rank that stops
   or dies in it is named as above; a collective that every rank has
   reached but that still has not ended a timeout later (a GPU or NCCL's
   network that hangs) ends the job with one line:
       allreduce #5 of 1000 floats (mean) did not end within 120 s of
       every rank's reaching it (MGPU_DIST_TIMEOUT): NCCL hangs, or a GPU
   (about two timeouts after the wait began). A fatal error
   aborts the communicators (ncclCommAbort) on the way out, since their
   kernels may be waiting on the GPU for a rank that is gone.
   mgpu_group_free finalizes and destroys them.
   Through MPI the allreduce is a reduce-scatter then an all-gather, as
   the ring of chapter 3: rank r receives chunk r of every rank's vector,
   adds them in rank order (0, 1, 2, ...) and sends the sum to every rank.
   So every rank gets the same bits, whatever the network did, and the
   replicas of a distributed model never drift apart. (NCCL's ring and
   tree also compute each sum once and send it to every rank, in an order
   of their own: NCCL's and MPI's sums may differ in the last bits.)
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
typedef enum { MGPU_BACKEND_NCCL, MGPU_BACKEND_MPI } mgpu_dist_backend;
MGPU_DEF void mgpu_set_dist_backend(mgpu_dist_backend backend);
MGPU_DEF mgpu_dist_backend mgpu_get_dist_backend(void);
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
   is clipped to the canvas, so drawing partly (or wholly) outside is safe;
   a text that loses pixels so is counted on the canvas (texts_cut, and
   the first of them in first_cut), since a cut title misleads.

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
   where it hides the least of the curves. A title or axis label too long
   for the picture is broken into lines at spaces, and the margins grow to
   hold them (up to 6 lines).

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
   fits, and a legend under the lanes names every name with its colour.
   Give operations of the same kind the same name ("backward", "copy to
   host") rather than numbering them, and number them in the label where
   that helps ("F3": a pipeline's forward pass of micro-batch 3): a legend
   of a few kinds is read at a glance. The tracer's timeline names its
   bars by their kind of work so (manual 7). Zero the bars before filling them
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
   past the file-size limit (ulimit -f) fails as on a full disk. A chart
   or timeline with a text that ran off it (a picture too small for its
   text) is written, and fails all the same, with one line:
       mgpu: error: out/pic.png: 1 text ran off the picture, the first "..."
   Out of memory, a canvas of no pixels or a series an animator does not
   have are bugs, and fatal (mgpu_fatal). */

typedef struct mgpu_canvas {
    int width, height;
    unsigned char *rgb; /* width*height*3 bytes, row by row from the top */
    int texts_cut;      /* texts drawn so far that ran (partly) off the canvas */
    char first_cut[40]; /* the first of them, cut short to fit here */
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
   ======================================================================
   In the folder mgpu/, one topic a file, in an order where each part
   stands on the parts before it alone (tests/parts_alone.sh checks it);
   the kernel families (kernels/) stand on mgpu/core.h alone
   (tests/kernels_alone.sh). Each file opens with what it holds, which
   chapter reads it, and the public functions it defines. The last,
   mgpu/testing.h, defines nothing: it declares the internals that the
   tests and benchmarks use, the one way they reach inside
   (tests/internals_listed.sh checks the list). */
#ifdef MGPU_IMPLEMENTATION
#ifndef MGPU__IMPLEMENTED
#define MGPU__IMPLEMENTED
#include "mgpu/core.h"          /* errors, CHECK macros, files, clock, Philox */

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

#include "mgpu/settings.h"      /* the environment's settings (manual 8) */
#include "mgpu/plots.h"         /* DRAWING: canvas, charts, the Animator, timelines */
#include "mgpu/queues.h"        /* manual 2: a device's queues; the library's state */
#include "mgpu/events.h"        /* manual 3: events */
#include "mgpu/memory.h"        /* the caching allocator, memory by category */
#include "mgpu/tensors.h"       /* manual 4: shapes and tensors */
#include "mgpu/devices.h"       /* manual 2: devices; the library's start and end */
#include "mgpu/tensor_ops.h"    /* manual 5 and 6: filling, random, matmul, copies */
#include "mgpu/timing.h"        /* manual 3 and 7: timers, benchmarks, the tracer */
#include "mgpu/flags.h"         /* command-line flags */
#include "mgpu/data.h"          /* DATA: IDX files, data sets, samplers, loaders */
#include "mgpu/communication.h" /* COMMUNICATION: the book's functions, the ring, NCCL */
#include "mgpu/groups.h"        /* DISTRIBUTED: process groups over MPI */
#include "mgpu/layers.h"        /* LAYERS: pooling, ReLU, residual, linear */
#include "mgpu/convolution.h"   /* LAYERS: the convolution and its methods */
#include "mgpu/training_ops.h"  /* TRAINING: batch norm, losses, optimizers */
#include "mgpu/networks.h"      /* NETWORKS: building, forward, backward, recomputation */
#include "mgpu/net_training.h"  /* NETWORKS: steps, gradient check, replicas, evaluation */
#include "mgpu/checkpoints.h"   /* NETWORKS: saving, loading, checkpoints */
#include "mgpu/data_parallel.h" /* DATA PARALLELISM: the wrapper, buckets, DDP */
#include "mgpu/zero.h"          /* DATA PARALLELISM: ZeRO-1, 2 and 3 */
#include "mgpu/data_parallel_step.h" /* DATA PARALLELISM: the step */
#include "mgpu/pipelines.h"     /* PIPELINES */
#include "mgpu/tensor_parallel.h" /* TENSOR PARALLELISM */
#include "mgpu/testing.h"       /* the internals tests/ and bench/ reach, declared again */
#endif /* MGPU__IMPLEMENTED */
#endif /* MGPU_IMPLEMENTATION */
