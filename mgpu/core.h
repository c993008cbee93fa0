/* mgpu/core.h: the ground floor, what every other part and every kernel
   file (kernels/) stands on. The system headers; errors (mgpu_fatal,
   MGPU_REQUIRE, and the CHECK macros for CUDA, cuBLAS, cuDNN and
   pthreads: one line that says what and where, then exit); allocations
   that cannot fail silently; files written whole or not at all; the
   clock; where a kernel runs (mgpu__exec); MGPU__HOSTDEVICE; and the
   Philox generator, so that a CPU thread and a GPU thread draw the same
   numbers. Every chapter reads it.
   defines: mgpu_fatal, mgpu_fatal_at, mgpu_malloc, mgpu_now */
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

/* ---------------------------------------------------------------- errors */
/* "rank 2: " in a process of a distributed job, so that its errors say
   whose they are; else empty. */
static char mgpu__error_prefix[32];
static void mgpu__error_prefix_set(int rank) {
    snprintf(mgpu__error_prefix, sizeof mgpu__error_prefix, "rank %d: ", rank);
}

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
    static const char *const variables[3] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"};
    int size = mgpu__launcher_variable(variables);
    return size > 0 ? size : 1;
}
/* This process's rank in the launcher's job, or -1 when it runs alone. */
static int mgpu__launcher_rank(void) {
    static const char *const variables[3] = {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"};
    return mgpu__launcher_size() > 1 ? mgpu__launcher_variable(variables) : -1;
}

/* 1 while a rank waits, silent, for the launcher to stop it: the SIGTERM
   handler (mgpu__dist_on_signal) then ends it without a word. */
static volatile sig_atomic_t mgpu__dist_quiet;
/* Seconds a rank other than 0 keeps an error to itself (below). */
#define MGPU__ALIKE_ERROR_WAIT 5
/* 1 in the thread that reports an error of its own rank alone (a
   timeout that names the ranks it waited for): said at once. */
static __thread int mgpu__error_is_mine_alone;

/* What must be let go even on the way out of a fatal error, before its
   line: the groups' NCCL communicators (mgpu/groups.h), whose kernels may
   be waiting on the GPU for a rank that is gone. */
static void (*mgpu__on_fatal)(void);

MGPU__NORETURN static void mgpu__vfatal(const char *file, int line, const char *fmt, va_list ap) {
    /* One line, written whole, by the first thread that fails: two devices'
       workers failing at once (the same bug in each replica) would
       otherwise interleave their lines. A later one waits for the first's
       _exit. */
    static int failing;
    if (__atomic_exchange_n(&failing, 1, __ATOMIC_SEQ_CST))
        for (;;) pause();
    if (mgpu__on_fatal) mgpu__on_fatal();
    /* Under a launcher most errors are every rank's alike (a bad flag, a
       missing file, memory that no rank has): rank 0 says it, and the
       others wait silently for the launcher, which stops them all once
       rank 0 has exited, so that a job prints one line, not one a rank.
       A rank that is still running after the wait had an error of its
       own, and says it. */
    int rank = mgpu__launcher_rank();
    if (rank >= 0 && !mgpu__error_prefix[0]) mgpu__error_prefix_set(rank);
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

#define MGPU__TASK_ARGS 768 /* room for a list of tensors (kernels/sgd.h), or six tensors (a layer of yours) */
/* Where a kernel runs: the CUDA stream and cuBLAS handle of a GPU queue,
   or nothing on the CPU. Every kernel in kernels/ takes one. */
typedef struct mgpu__exec {
    int on_gpu;
    void *stream; /* cudaStream_t */
    void *cublas; /* cublasHandle_t */
    void *cudnn;  /* cudnnHandle_t, once the queue made one (kernels/conv_cudnn.h), else NULL */
} mgpu__exec;
typedef void (*mgpu__kernel_fn)(const void *args, const mgpu__exec *ex);
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
