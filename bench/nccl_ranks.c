/* bench/nccl_ranks.c: NCCL between processes, started by MPI.

   mgpu's process groups move GPU tensors between processes with NCCL
   where it can start ("nccl", mgpu.h's DISTRIBUTED section), else through
   host memory ("mpi via host"). NCCL refuses two processes on one GPU
   before version 2.30 ("Duplicate GPU detected"), and 2.30's
   NCCL_MULTI_RANK_GPU_ENABLE=1 is experimental. This program finds out
   what the NCCL at hand does, on the machine at hand:

       mpirun -np 2 ./bench/nccl_ranks [--mib 64]
       NCCL_MULTI_RANK_GPU_ENABLE=1 mpirun -np 2 ./bench/nccl_ranks

   Each rank takes GPU local_rank % gpus and joins a nonblocking
   communicator (the ncclUniqueId sent by MPI_Bcast), polling
   ncclCommGetAsyncError against a timeout of 60 s, and aborting it then:
   NCCL has no timeout of its own. It then allreduces --mib MiB of floats
   (rank r's are r + 1, so every sum is size (size + 1) / 2, checked) 20
   times, each timed with events, and rank 0 prints NCCL's version, the
   median time and the bus bandwidth, 2 (n - 1) / n bytes / time (what
   each GPU sends in a ring). Any failure is one line and exit status 1. */
#include <cuda_runtime.h>
#define OMPI_SKIP_MPICXX 1 /* (nvcc compiles this as C++: no MPI C++ bindings) */
#include <mpi.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int rank = -1;

static void fail(const char *what, const char *why) {
    fprintf(stderr, "nccl_ranks: rank %d: %s: %s\n", rank, what, why);
    exit(1); /* (mpirun stops the other ranks) */
}
#define CUDA_CHECK(call)                                                            \
    do {                                                                            \
        cudaError_t e_ = (call);                                                    \
        if (e_ != cudaSuccess) fail(#call, cudaGetErrorString(e_));                 \
    } while (0)
#define MPI_CHECK(call)                                                             \
    do {                                                                            \
        if ((call) != MPI_SUCCESS) fail(#call, "failed");                           \
    } while (0)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Waits until the communicator's last call is no longer in progress (and,
   given an event, until the GPU has passed it), for at most 60 s. */
static void nccl_wait(ncclComm_t comm, ncclResult_t started, cudaEvent_t done, const char *what) {
    if (started != ncclSuccess && started != ncclInProgress) fail(what, ncclGetErrorString(started));
    for (double start = now();;) {
        ncclResult_t state;
        ncclResult_t asked = ncclCommGetAsyncError(comm, &state);
        if (asked != ncclSuccess) fail("ncclCommGetAsyncError", ncclGetErrorString(asked));
        if (state != ncclSuccess && state != ncclInProgress) {
            ncclCommAbort(comm);
            fail(what, ncclGetErrorString(state));
        }
        cudaError_t gpu = cudaSuccess;
        if (state == ncclSuccess && done) {
            gpu = cudaEventQuery(done);
            if (gpu != cudaSuccess && gpu != cudaErrorNotReady) fail(what, cudaGetErrorString(gpu));
        }
        if (state == ncclSuccess && gpu == cudaSuccess) return;
        if (now() - start > 60) {
            ncclCommAbort(comm);
            fail(what, "no progress in 60 s (the communicator was aborted)");
        }
    }
}

static int by_value(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    MPI_CHECK(MPI_Init(&argc, &argv));
    int size, local_rank, gpus;
    MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
    MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
    MPI_Comm local;
    MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local));
    MPI_CHECK(MPI_Comm_rank(local, &local_rank));
    double mib = 64;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--mib") == 0 && i + 1 < argc && atof(argv[i + 1]) > 0) mib = atof(argv[++i]);
        else fail(argv[i], "unknown flag (usage: mpirun -np N ./bench/nccl_ranks [--mib M])");
    }
    CUDA_CHECK(cudaGetDeviceCount(&gpus));
    int gpu = local_rank % gpus, version;
    CUDA_CHECK(cudaSetDevice(gpu));
    ncclResult_t r = ncclGetVersion(&version);
    if (r != ncclSuccess) fail("ncclGetVersion", ncclGetErrorString(r));
    if (rank == 0) {
        const char *multi = getenv("NCCL_MULTI_RANK_GPU_ENABLE");
        printf("NCCL %d.%d.%d, %d ranks on %d GPU%s, NCCL_MULTI_RANK_GPU_ENABLE=%s\n", version / 10000,
               version / 100 % 100, version % 100, size, gpus, gpus > 1 ? "s" : "", multi ? multi : "(unset)");
        fflush(stdout);
    }

    ncclUniqueId id;
    if (rank == 0) {
        r = ncclGetUniqueId(&id);
        if (r != ncclSuccess) fail("ncclGetUniqueId", ncclGetErrorString(r));
    }
    MPI_CHECK(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm;
    r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
    nccl_wait(comm, r, NULL, "ncclCommInitRankConfig");

    size_t n = (size_t)(mib * (1 << 20) / sizeof(float));
    float *data, *host = (float *)malloc(n * sizeof(float));
    if (!host) fail("malloc", "out of memory");
    CUDA_CHECK(cudaMalloc((void **)&data, n * sizeof(float)));
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaEvent_t begin, end;
    CUDA_CHECK(cudaEventCreate(&begin));
    CUDA_CHECK(cudaEventCreate(&end));
    enum { RUNS = 20 };
    float ms[RUNS];
    for (int run = -2; run < RUNS; run++) { /* (2 to warm up) */
        for (size_t i = 0; i < n; i++) host[i] = (float)(rank + 1);
        CUDA_CHECK(cudaMemcpy(data, host, n * sizeof(float), cudaMemcpyHostToDevice));
        MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
        CUDA_CHECK(cudaEventRecord(begin, stream));
        r = ncclAllReduce(data, data, n, ncclFloat, ncclSum, comm, stream);
        nccl_wait(comm, r, NULL, "ncclAllReduce");
        CUDA_CHECK(cudaEventRecord(end, stream));
        nccl_wait(comm, ncclSuccess, end, "ncclAllReduce");
        if (run >= 0) CUDA_CHECK(cudaEventElapsedTime(&ms[run], begin, end));
    }
    CUDA_CHECK(cudaMemcpy(host, data, n * sizeof(float), cudaMemcpyDeviceToHost));
    float want = (float)(size * (size + 1) / 2);
    size_t wrong = 0;
    for (size_t i = 0; i < n; i++) wrong += host[i] != want;
    qsort(ms, RUNS, sizeof *ms, by_value);
    float median = ms[RUNS / 2];
    double bus = 2.0 * (size - 1) / size * (double)(n * sizeof(float)) / (median * 1e-3) / 1e9;
    if (wrong) fail("ncclAllReduce", "wrong sums");
    if (rank == 0)
        printf("RESULT nccl_ranks ranks=%d gpus=%d mib=%g median_ms=%.3f busbw_gbs=%.1f sums=ok\n", size, gpus, mib,
               median, bus);
    r = ncclCommFinalize(comm);
    nccl_wait(comm, r, NULL, "ncclCommFinalize");
    r = ncclCommDestroy(comm);
    if (r != ncclSuccess) fail("ncclCommDestroy", ncclGetErrorString(r));
    CUDA_CHECK(cudaFree(data));
    free(host);
    MPI_CHECK(MPI_Comm_free(&local));
    MPI_CHECK(MPI_Finalize());
    return 0;
}
