/* mgpu/devices.h: the devices, and the library's start and end. The
   library starts at its first call (mgpu__init: it counts the GPUs, reads
   the settings, shares the cores among CPU devices) and waits for every
   queue at exit. Virtual devices (more devices than GPUs, or CPU devices
   for a machine without one) are made here. Chapter 1 reads it.
   defines: mgpu_num_gpus, mgpu_num_cores, mgpu_cpu, mgpu_try_gpu, mgpu_try_all_gpus,
   mgpu_devices, mgpu_device_name, mgpu_device_is_gpu,
   mgpu_device_gpu_index, mgpu_device_stream, mgpu_synchronize_all,
   mgpu_device_memory_in_use, mgpu_device_memory_peak,
   mgpu_device_reset_peak, mgpu_device_memory_of,
   mgpu_device_memory_peak_of, mgpu_device_memory_at_peak,
   mgpu_device_set_memory_limit, mgpu_device_record_memory,
   mgpu_device_memory_samples, mgpu_device_allocations, mgpu_device_list,
   mgpu_shutdown */
/* OpenBLAS picks its kernels for the processor's family and model. On a
   processor it does not know (cloud machines may report a generic name,
   "Intel(R) Xeon(R) Processor") it takes its oldest x86-64 kernels,
   Prescott's, with neither AVX2 nor AVX-512: its products then run
   several times slower than the processor allows (bench/RESULTS.md). It
   chooses when it is loaded, reading OPENBLAS_CORETYPE only then; so
   where it took kernels without AVX2 on a processor with AVX2 and FMA,
   the program starts again before main, with OPENBLAS_CORETYPE naming
   the kernels the processor runs, and says so in one line. A coretype
   the user set is left alone. */
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
/* Whether OpenBLAS's kernels of this name run AVX-512 (mgpu/convolution.h's
   CPU rule asks). */
static inline int mgpu__blas_core_avx512(const char *core) {
    static const char *const avx512[] = {"SkylakeX", "Cooperlake", "SapphireRapids"};
    for (size_t i = 0; core && i < sizeof avx512 / sizeof avx512[0]; i++)
        if (strcasecmp(core, avx512[i]) == 0) return 1;
    return 0;
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
/* The cores this process may run on: its affinity's (a container or
   taskset may give it fewer than the machine has). Where a launcher
   started several processes on this machine and bound none to its own
   cores (Open MPI binds none when the processes outnumber the cores), an
   even share of them: processes that compute at once then do not take
   turns on the same cores, and a run on some of the job's processes
   computes as each process does in a run on all of them. */
static int mgpu__cores(void) {
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    int cores = online > 0 ? (int)online : 1;
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) cores = CPU_COUNT(&set);
    static const char *const local_size[3] = {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"};
    int here = mgpu__launcher_variable(local_size);
    if (here > 1 && cores >= online) cores = cores / here > 1 ? cores / here : 1;
    return cores;
}
static void mgpu__share_cpu_cores(int ncpu_devices) {
    int cores = mgpu__cores();
    int per_device = cores / (ncpu_devices > 0 ? ncpu_devices : 1);
    mgpu__cpu_threads = per_device > 0 ? per_device : 1;
    openblas_set_num_threads(mgpu__cpu_threads);
}
MGPU_DEF size_t mgpu_device_allocations(const mgpu_device *d) { return d->allocations; }
MGPU_DEF const char *mgpu_device_list(char *buf, size_t size, mgpu_device *const *devices, int n) {
    size_t used = (size_t)snprintf(buf, size, "[");
    for (int i = 0; i < n && used < size; i++)
        used += (size_t)snprintf(buf + used, size - used, "%s%s", i ? ", " : "", devices[i]->name);
    if (used < size) snprintf(buf + used, size - used, "]");
    return buf;
}

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

#if MGPU_CUDA
/* Whether the machine has an NVIDIA GPU with its driver loaded, whatever
   CUDA says of it: the driver's device files exist. */
static int mgpu__gpu_installed(void) { return access("/dev/nvidia0", F_OK) == 0 || access("/dev/nvidiactl", F_OK) == 0; }
/* Whether this process speaks for its job: it runs alone, or is the
   launcher's rank 0. */
static int mgpu__first_process_of_job(void) { return mgpu__launcher_rank() <= 0; }
#endif

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
        /* Not an error: a CUDA build on a machine without a GPU runs on the
           CPU. Said once a job (by its first process), and in the driver's
           words only where a GPU is there but cannot be used. */
        cudaGetLastError();
        if (mgpu__first_process_of_job()) {
            if (err == cudaErrorNoDevice || !mgpu__gpu_installed())
                fprintf(stderr, "mgpu: no GPU found: running on the CPU\n");
            else
                fprintf(stderr, "mgpu: a GPU is installed but cannot be used (%s): running on the CPU\n",
                        cudaGetErrorString(err));
        }
    }
#endif
    atexit(mgpu__at_exit);
    pthread_atfork(NULL, NULL, mgpu__after_fork_in_child);
    /* The environment's settings now: a bad value stops the program before
       its work, not at its first convolution. */
    mgpu__tf32_allowed(0);
    mgpu__conv_settings_from_environment();
    mgpu__check_replicas_setting();
    mgpu_get_dist_backend();
}
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

/* (its affinity: mpirun may bind a process to fewer than the machine's) */
MGPU_DEF int mgpu_num_cores(void) { return mgpu__cores(); }
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
