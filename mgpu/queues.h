/* mgpu/queues.h: where work runs. Each device has two queues, compute
   and copy: on a GPU two CUDA streams, on the CPU two worker threads that
   take tasks from a ring in order. The structs of a device, an event and
   a trace record, and the library's state, are here too, since a queue
   needs them all. Chapter 1 reads it: enqueueing returns at once, and two
   devices' queues run side by side. Waiting for a device is here, so the
   one error a GPU's kernel reports back is raised here too: a label that
   is not a class index (kernels/loss.h writes it; mgpu/training_ops.h
   sets up where).
   defines: mgpu_synchronize
   internal: mgpu__launch_on (every operation's way onto a queue),
   mgpu__trace_add (the tracer's record of each operation), mgpu__trace_split
   (a task's first part recorded apart: a collective's wait) */
/* ======================================================================
   Queues. A CPU queue is a worker thread that takes tasks from a ring in
   order. A task is a function and a small copy of its arguments, so the
   caller can return at once (the arguments are copied, not pointed to).
   ====================================================================== */

/* A CPU device's share of the machine's cores: cores / CPU devices
   (mgpu_devices sets it). Its compute queue's worker runs each task with
   OpenMP set to that many threads, and its copy queue's with one (a copy
   or a reduction overlapping compute must not take the compute's cores):
   OpenBLAS's products (built for OpenMP), oneDNN's convolutions and the
   library's own kernels (MGPU__CPU_PARALLEL_FOR, kernels/common.h) then
   split their work over them. */
static int mgpu__cpu_threads = 1; /* (all the cores once the library starts) */
#define MGPU__QUEUE_RING 512

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

/* The library's state: its devices, the random generator and the tracer.
   (Its type has a name so that mgpu/testing.h can declare it for the
   tests, which read the tracer's records.) */
static struct mgpu__library_state {
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

/* The label the calling thread gives the operations it enqueues
   (mgpu_trace_label): one of the library's interned copies, or NULL. */
static __thread const char *mgpu__trace_label_now;

/* How far this process has got: the operations it has launched and run.
   A rank that waits for this one asks it (mgpu__dist_wait): a number that
   moves says "busy, not stuck". */
static long mgpu__progress;

static inline int mgpu__queue_on_gpu(const mgpu__queue *q) { return q->device->gpu >= 0; }
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
/* The traced task a queue's worker thread is running: its queue (NULL
   when none is traced), its label, and when what is still to be recorded
   of it began. A task may record its first part as an operation of its
   own and move `start` on (mgpu/groups.h: a collective's wait for the
   other ranks, apart from the moving of data). */
static __thread struct {
    mgpu__queue *queue;
    const char *label;
    double start;
} mgpu__traced_task;
/* Inside a traced task on a queue: its time so far is recorded as an
   operation of its own, `name` (a string literal), and the task's own
   record starts now. Elsewhere (a GPU's collective runs on the calling
   thread), nothing. */
static inline void mgpu__trace_split(const char *name) {
    if (!mgpu__traced_task.queue || !mgpu__library.tracing) return;
    double now = mgpu_now();
    mgpu__trace_add(mgpu__traced_task.queue, name, mgpu__traced_task.label, mgpu__traced_task.start, now, NULL);
    mgpu__traced_task.start = now;
}

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
        mgpu__traced_task.queue = mgpu__library.tracing && task->name ? q : NULL;
        mgpu__traced_task.label = task->label;
        mgpu__traced_task.start = mgpu__library.tracing ? mgpu_now() : 0.0;
#ifdef _OPENMP
        omp_set_num_threads(q->lane ? 1 : mgpu__cpu_threads);
#endif
        task->fn(task->args, &cpu_exec);
        __atomic_add_fetch(&mgpu__progress, 1, __ATOMIC_RELAXED);
        if (mgpu__library.tracing && task->name)
            mgpu__trace_add(q, task->name, task->label, mgpu__traced_task.start, mgpu_now(), NULL);
        mgpu__traced_task.queue = NULL;
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
MGPU_DEF void mgpu_synchronize(mgpu_device *d) {
    mgpu__queue_synchronize(&d->queue[0]);
    mgpu__queue_synchronize(&d->queue[1]);
    mgpu__require_no_label_error(d);
}
