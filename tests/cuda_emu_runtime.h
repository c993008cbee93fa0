/* tests/cuda_emu_runtime.h: the CUDA runtime, cuBLAS, cuDNN and NCCL calls that
   mgpu.h makes, on the CPU (included by tests/cuda_emu.h, which runs the
   kernels themselves). With it the library's whole CUDA path, streams,
   events, copies, the allocator, cuBLAS and NCCL included, runs in
   `make test` on emulated GPUs (MGPU_EMU_GPUS of them, default 2), and
   host code that would be wrong on a real GPU fails here too:

   - Streams run asynchronously: each is a thread that takes its work in
     order, so that host code reading a result before it synchronises, or
     a stream using another's result without waiting for its event, reads
     stale memory as it would on a GPU (the emulated kernels are slow, so
     the host is usually far ahead). The legacy default stream (0) runs
     its work at once, in the calling thread; like CUDA's, it does not
     wait for the non-blocking streams mgpu uses.
   - Kernels run one at a time in the whole process (the emulator keeps a
     block's state in globals), taking turns in the order their streams
     reached them, so that the streams of two devices progress together as
     two GPUs would; a launch into a stream of a device other than the
     current one fails, as on a GPU.
   - Device memory is known by its allocations: a copy whose direction
     says "device" for a pointer outside them, or that runs past the end of
     one, fails with cudaErrorInvalidValue, as does cudaFree of a pointer
     cudaMalloc did not give. cudaFree waits for the device's streams.
   - Events belong to the device that was current when they were made:
     recording one on another device's stream fails (cudaEventRecord),
     and timing two of different devices too (cudaEventElapsedTime). An
     event used after cudaEventDestroy aborts.
   - A cuBLAS or cuDNN handle belongs to the device current when it was
     made, and its calls must find that device current.
   - NCCL: ncclCommInitAll refuses a device twice; a collective's calls
     from every rank are matched in order, and each rank's stream waits in
     it until all ranks' streams have reached it. Communicators between
     processes (ncclCommInitRank[Config]) carry their collectives over MPI
     from the stream; each process's GPUs are GPUs of their own (their
     UUIDs), and faults can be played inside a collective (the NCCL
     section says how).

   What it cannot check: host code that reads or writes device memory
   directly (both are host memory here), kernels that read memory of a
   device without peer access, and anything about timing. */
#ifndef MGPU_CUDA_EMU_RUNTIME_H
#define MGPU_CUDA_EMU_RUNTIME_H
#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <signal.h>
#if MGPU_MPI
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>
#endif

/* ------------------------------------------------------------- errors */
typedef int cudaError_t;
enum {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorPeerAccessAlreadyEnabled = 704,
};
static thread_local cudaError_t mgpu_emu_last_error;
static inline cudaError_t mgpu_emu_error(cudaError_t e) { return mgpu_emu_last_error = e; }
static inline const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorPeerAccessAlreadyEnabled: return "cudaErrorPeerAccessAlreadyEnabled";
    default: return "cudaErrorUnknown";
    }
}
static inline const char *cudaGetErrorString(cudaError_t e) { return cudaGetErrorName(e); }
static inline cudaError_t cudaGetLastError() {
    cudaError_t e = mgpu_emu_last_error;
    mgpu_emu_last_error = cudaSuccess;
    return e;
}

/* ------------------------------------------------------------ devices */
static thread_local int mgpu_emu_device; /* cudaSetDevice's, per host thread */
static inline int mgpu_emu_device_count() {
    const char *s = getenv("MGPU_EMU_GPUS");
    return s ? atoi(s) : 2;
}
static inline cudaError_t cudaGetDeviceCount(int *count) {
    *count = mgpu_emu_device_count();
    return *count > 0 ? cudaSuccess : mgpu_emu_error(100 /* cudaErrorNoDevice */);
}
static inline cudaError_t cudaSetDevice(int d) {
    if (d < 0 || d >= mgpu_emu_device_count()) return mgpu_emu_error(cudaErrorInvalidDevice);
    mgpu_emu_device = d;
    return cudaSuccess;
}
static inline cudaError_t cudaDeviceCanAccessPeer(int *can, int d, int peer) {
    *can = d != peer;
    return cudaSuccess;
}
static std::mutex mgpu_emu_peer_mutex;
static std::vector<std::pair<int, int>> mgpu_emu_peers;
static inline cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned) {
    if (peer == mgpu_emu_device || peer < 0 || peer >= mgpu_emu_device_count())
        return mgpu_emu_error(cudaErrorInvalidDevice);
    std::lock_guard<std::mutex> hold(mgpu_emu_peer_mutex);
    std::pair<int, int> link(mgpu_emu_device, peer);
    if (std::find(mgpu_emu_peers.begin(), mgpu_emu_peers.end(), link) != mgpu_emu_peers.end())
        return mgpu_emu_error(cudaErrorPeerAccessAlreadyEnabled);
    mgpu_emu_peers.push_back(link);
    return cudaSuccess;
}
/* Emulated GPUs are of compute capability 9.0 (an H100's). */
enum cudaDeviceAttr { cudaDevAttrComputeCapabilityMajor, cudaDevAttrComputeCapabilityMinor };
static inline cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int d) {
    if (d < 0 || d >= mgpu_emu_device_count()) return mgpu_emu_error(cudaErrorInvalidDevice);
    *value = attr == cudaDevAttrComputeCapabilityMajor ? 9 : 0;
    return cudaSuccess;
}
/* A GPU's UUID: emulated GPUs of different processes are different GPUs
   (the launcher's rank is in the UUID), unless MGPU_EMU_SHARED_GPUS=1 makes
   every process's GPU d the same one, as processes that share a machine's
   GPUs see them. */
typedef struct {
    char bytes[16];
} cudaUUID_t;
struct cudaDeviceProp {
    cudaUUID_t uuid;
};
static inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int d) {
    if (d < 0 || d >= mgpu_emu_device_count()) return mgpu_emu_error(cudaErrorInvalidDevice);
    const char *shared = getenv("MGPU_EMU_SHARED_GPUS"), *rank = getenv("OMPI_COMM_WORLD_RANK");
    int process = shared && strcmp(shared, "1") == 0 ? 0 : rank ? atoi(rank) + 1 : 0;
    memset(p, 0, sizeof *p);
    memcpy(p->uuid.bytes, "emu-", 4);
    memcpy(p->uuid.bytes + 4, &process, sizeof process);
    memcpy(p->uuid.bytes + 8, &d, sizeof d);
    return cudaSuccess;
}
struct cudaFuncAttributes {
    int ptxVersion, binaryVersion;
};
template <typename F> static inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *a, F) {
    a->ptxVersion = a->binaryVersion = 90; /* as if built for sm_90 */
    return cudaSuccess;
}
/* A kernel may take more than 48 KiB of dynamic shared memory only if it
   said so first, on the device it runs on, up to sm_90's 227 KiB. */
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
static std::mutex mgpu_emu_shared_limit_mutex;
static std::map<std::pair<uintptr_t, int>, int> mgpu_emu_shared_limit; /* (kernel, device): bytes */
template <typename... P>
static inline cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute, int bytes) {
    if (bytes < 0 || bytes > 227 << 10) return mgpu_emu_error(cudaErrorInvalidValue);
    std::lock_guard<std::mutex> hold(mgpu_emu_shared_limit_mutex);
    mgpu_emu_shared_limit[{reinterpret_cast<uintptr_t>(kernel), mgpu_emu_device}] = bytes;
    return cudaSuccess;
}
static inline void mgpu_emu_check_shared(uintptr_t kernel, size_t bytes) {
    if (bytes <= 48 << 10) return;
    std::lock_guard<std::mutex> hold(mgpu_emu_shared_limit_mutex);
    auto limit = mgpu_emu_shared_limit.find({kernel, mgpu_emu_device});
    if (limit == mgpu_emu_shared_limit.end() || bytes > (size_t)limit->second)
        mgpu_emu_fail("a launch with more than 48 KiB of dynamic shared memory that "
                      "cudaFuncSetAttribute did not allow on this device");
}

/* ------------------------------------------------------------ streams */
struct mgpu_emu_stream {
    int device;
    std::mutex mutex;
    std::condition_variable changed;
    std::deque<std::function<void()>> work;
    bool running = false, stop = false;
    std::thread worker;
};
typedef mgpu_emu_stream *cudaStream_t;
enum { cudaStreamNonBlocking = 1 };
static std::mutex mgpu_emu_streams_mutex;
static std::vector<mgpu_emu_stream *> mgpu_emu_streams;

static inline void mgpu_emu_stream_main(mgpu_emu_stream *s) {
    std::unique_lock<std::mutex> lock(s->mutex);
    for (;;) {
        s->changed.wait(lock, [s] { return s->stop || !s->work.empty(); });
        if (s->work.empty()) return;
        std::function<void()> next = std::move(s->work.front());
        s->work.pop_front();
        s->running = true;
        lock.unlock();
        next();
        lock.lock();
        s->running = false;
        s->changed.notify_all();
    }
}
/* Work in stream order; on the legacy default stream (0), at once. */
static inline void mgpu_emu_submit(cudaStream_t s, std::function<void()> work) {
    if (!s) {
        work();
        return;
    }
    std::lock_guard<std::mutex> hold(s->mutex);
    s->work.push_back(std::move(work));
    s->changed.notify_all();
}
static inline void mgpu_emu_stream_wait_idle(mgpu_emu_stream *s) {
    std::unique_lock<std::mutex> lock(s->mutex);
    s->changed.wait(lock, [s] { return s->work.empty() && !s->running; });
}
static inline void mgpu_emu_device_wait_idle(int device) {
    std::vector<mgpu_emu_stream *> streams;
    {
        std::lock_guard<std::mutex> hold(mgpu_emu_streams_mutex);
        streams = mgpu_emu_streams;
    }
    for (mgpu_emu_stream *s : streams)
        if (s->device == device) mgpu_emu_stream_wait_idle(s);
}
static inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t *out, unsigned) {
    mgpu_emu_stream *s = new mgpu_emu_stream;
    s->device = mgpu_emu_device;
    s->worker = std::thread(mgpu_emu_stream_main, s);
    std::lock_guard<std::mutex> hold(mgpu_emu_streams_mutex);
    mgpu_emu_streams.push_back(s);
    *out = s;
    return cudaSuccess;
}
static inline cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    if (s) mgpu_emu_stream_wait_idle(s);
    return cudaSuccess;
}
static inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
    {
        std::lock_guard<std::mutex> hold(mgpu_emu_streams_mutex);
        mgpu_emu_streams.erase(std::find(mgpu_emu_streams.begin(), mgpu_emu_streams.end(), s));
    }
    { /* as CUDA: the stream's work still runs to the end */
        std::lock_guard<std::mutex> hold(s->mutex);
        s->stop = true;
        s->changed.notify_all();
    }
    s->worker.join();
    delete s;
    return cudaSuccess;
}
static inline cudaError_t cudaDeviceSynchronize() {
    mgpu_emu_device_wait_idle(mgpu_emu_device);
    return cudaSuccess;
}

/* ------------------------------------------------------------- events */
struct mgpu_emu_event {
    int device;
    bool destroyed = false;
    std::mutex mutex;
    std::condition_variable changed;
    unsigned long recorded = 0, completed = 0; /* generations, as in mgpu.h */
    std::chrono::steady_clock::time_point time;
};
typedef mgpu_emu_event *cudaEvent_t;
static inline void mgpu_emu_check_event(cudaEvent_t e) {
    if (!e || e->destroyed) mgpu_emu_fail("an event used after cudaEventDestroy (or never made)");
}
static inline cudaError_t cudaEventCreate(cudaEvent_t *out) {
    *out = new mgpu_emu_event;
    (*out)->device = mgpu_emu_device;
    return cudaSuccess;
}
/* Kept (marked) rather than deleted, so that a later use is caught; the
   work still queued with it finishes as CUDA's would. */
static inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
    mgpu_emu_check_event(e);
    e->destroyed = true;
    return cudaSuccess;
}
static inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    mgpu_emu_check_event(e);
    if (e->device != (s ? s->device : mgpu_emu_device))
        return mgpu_emu_error(cudaErrorInvalidResourceHandle);
    unsigned long generation;
    {
        std::lock_guard<std::mutex> hold(e->mutex);
        generation = ++e->recorded;
    }
    mgpu_emu_submit(s, [e, generation] {
        std::lock_guard<std::mutex> hold(e->mutex);
        e->time = std::chrono::steady_clock::now();
        e->completed = std::max(e->completed, generation);
        e->changed.notify_all();
    });
    return cudaSuccess;
}
/* Waits for the last record made before the call (at once if none). */
static inline void mgpu_emu_event_wait(cudaEvent_t e, unsigned long generation) {
    std::unique_lock<std::mutex> lock(e->mutex);
    e->changed.wait(lock, [e, generation] { return e->completed >= generation; });
}
static inline unsigned long mgpu_emu_event_recorded(cudaEvent_t e) {
    mgpu_emu_check_event(e);
    std::lock_guard<std::mutex> hold(e->mutex);
    return e->recorded;
}
static inline cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    mgpu_emu_event_wait(e, mgpu_emu_event_recorded(e));
    return cudaSuccess;
}
static inline cudaError_t cudaEventQuery(cudaEvent_t e) {
    unsigned long generation = mgpu_emu_event_recorded(e);
    std::lock_guard<std::mutex> hold(e->mutex);
    return e->completed >= generation ? cudaSuccess : cudaErrorNotReady; /* (not an error: not kept as the last) */
}
static inline cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
    unsigned long generation = mgpu_emu_event_recorded(e);
    mgpu_emu_submit(s, [e, generation] { mgpu_emu_event_wait(e, generation); });
    return cudaSuccess;
}
static inline cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    mgpu_emu_check_event(start);
    mgpu_emu_check_event(end);
    if (start->device != end->device) return mgpu_emu_error(cudaErrorInvalidResourceHandle);
    std::unique_lock<std::mutex> hold_start(start->mutex), hold_end;
    if (end != start) hold_end = std::unique_lock<std::mutex>(end->mutex);
    if (!start->recorded || !end->recorded) return mgpu_emu_error(cudaErrorInvalidResourceHandle);
    if (start->completed < start->recorded || end->completed < end->recorded)
        return mgpu_emu_error(cudaErrorNotReady);
    *ms = std::chrono::duration<float, std::milli>(end->time - start->time).count();
    return cudaSuccess;
}

/* ------------------------------------------------------------- memory */
enum cudaMemcpyKind {
    cudaMemcpyHostToHost,
    cudaMemcpyHostToDevice,
    cudaMemcpyDeviceToHost,
    cudaMemcpyDeviceToDevice,
    cudaMemcpyDefault
};
struct mgpu_emu_allocation {
    size_t bytes;
    int device; /* or MGPU_EMU_PINNED */
};
/* What mgpu_emu_owner finds, besides a device number. */
enum { MGPU_EMU_PINNED = -1, MGPU_EMU_PAGEABLE = -2, MGPU_EMU_OVERRUN = -3 };
static std::mutex mgpu_emu_memory_mutex;
static std::map<uintptr_t, mgpu_emu_allocation> mgpu_emu_allocations; /* by start */

/* The device of the allocation that holds [p, p + bytes); MGPU_EMU_PINNED
   for pinned host memory, MGPU_EMU_PAGEABLE for memory the emulator did
   not give, MGPU_EMU_OVERRUN for a range that starts in an allocation and
   runs past it. */
static inline int mgpu_emu_owner(const void *p, size_t bytes) {
    std::lock_guard<std::mutex> hold(mgpu_emu_memory_mutex);
    auto it = mgpu_emu_allocations.upper_bound((uintptr_t)p);
    if (it == mgpu_emu_allocations.begin()) return MGPU_EMU_PAGEABLE;
    --it;
    uintptr_t start = it->first, end = start + it->second.bytes;
    if ((uintptr_t)p >= end) return MGPU_EMU_PAGEABLE;
    return (uintptr_t)p + bytes <= end ? it->second.device : MGPU_EMU_OVERRUN;
}
static inline cudaError_t mgpu_emu_alloc(void **p, size_t bytes, int device) {
    *p = aligned_alloc(256, (bytes / 256 + 1) * 256); /* a multiple of the alignment, never 0 */
    if (!*p) return mgpu_emu_error(cudaErrorMemoryAllocation);
    std::lock_guard<std::mutex> hold(mgpu_emu_memory_mutex);
    mgpu_emu_allocations[(uintptr_t)*p] = {bytes, device};
    return cudaSuccess;
}
/* (not inlined: the compiler would see free() reached with a pointer the emulator refuses first) */
static __attribute__((noinline)) cudaError_t mgpu_emu_free(void *p, bool pinned) {
    int device;
    {
        std::lock_guard<std::mutex> hold(mgpu_emu_memory_mutex);
        auto it = mgpu_emu_allocations.find((uintptr_t)p);
        if (it == mgpu_emu_allocations.end() || (it->second.device < 0) != pinned)
            return mgpu_emu_error(cudaErrorInvalidValue);
        device = it->second.device;
    }
    if (!pinned) mgpu_emu_device_wait_idle(device); /* cudaFree synchronises */
    std::lock_guard<std::mutex> hold(mgpu_emu_memory_mutex);
    mgpu_emu_allocations.erase((uintptr_t)p);
    free(p);
    return cudaSuccess;
}
static inline cudaError_t cudaMalloc(void **p, size_t bytes) { return mgpu_emu_alloc(p, bytes, mgpu_emu_device); }
static inline cudaError_t cudaMallocHost(void **p, size_t bytes) { return mgpu_emu_alloc(p, bytes, MGPU_EMU_PINNED); }
static inline cudaError_t cudaFree(void *p) { return p ? mgpu_emu_free(p, false) : cudaSuccess; }
static inline cudaError_t cudaFreeHost(void *p) { return p ? mgpu_emu_free(p, true) : cudaSuccess; }

/* Whether a copy's pointers are what its kind says: device memory where
   it says device, and never past the end of an allocation. */
static inline bool mgpu_emu_copy_is_valid(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind) {
    int to = mgpu_emu_owner(dst, bytes), from = mgpu_emu_owner(src, bytes);
    if (to == MGPU_EMU_OVERRUN || from == MGPU_EMU_OVERRUN) return false;
    bool to_device = to >= 0, from_device = from >= 0;
    switch (kind) {
    case cudaMemcpyHostToDevice: return to_device && !from_device;
    case cudaMemcpyDeviceToHost: return !to_device && from_device;
    case cudaMemcpyDeviceToDevice: return to_device && from_device;
    default: return true;
    }
}
static inline cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                                   cudaStream_t s) {
    if (!mgpu_emu_copy_is_valid(dst, src, bytes, kind)) return mgpu_emu_error(cudaErrorInvalidValue);
    mgpu_emu_submit(s, [dst, src, bytes] { memcpy(dst, src, bytes); });
    return cudaSuccess;
}
/* On the legacy default stream: at once, without waiting for other streams. */
static inline cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind) {
    return cudaMemcpyAsync(dst, src, bytes, kind, 0);
}
static inline cudaError_t cudaMemcpyPeerAsync(void *dst, int dst_device, const void *src, int src_device,
                                       size_t bytes, cudaStream_t s) {
    if (mgpu_emu_owner(dst, bytes) != dst_device || mgpu_emu_owner(src, bytes) != src_device)
        return mgpu_emu_error(cudaErrorInvalidValue);
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s);
}
/* Memory the emulator did not give is allowed: tests/emu_kernels.cpp runs
   kernels on host vectors. */
static inline cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s) {
    if (mgpu_emu_owner(p, bytes) == MGPU_EMU_OVERRUN) return mgpu_emu_error(cudaErrorInvalidValue);
    mgpu_emu_submit(s, [p, value, bytes] { memset(p, value, bytes); });
    return cudaSuccess;
}

/* ------------------------------------------------------------ launches */
/* The build rewrites every launch in kernels/,
       name<<<config>>>(args);  ->  mgpu_emu_launcher(config)(name, args);
   so that the arguments are evaluated and copied at the launch, as CUDA
   does, and the kernel runs later on its stream. */
/* One kernel at a time, first come first served (a ticket lock: a plain
   mutex would let one stream's worker take it again and again). */
static std::mutex mgpu_emu_turn_mutex;
static std::condition_variable mgpu_emu_turn_changed;
static unsigned long mgpu_emu_next_ticket, mgpu_emu_serving;
struct mgpu_emu_turn {
    mgpu_emu_turn() {
        std::unique_lock<std::mutex> lock(mgpu_emu_turn_mutex);
        unsigned long ticket = mgpu_emu_next_ticket++;
        mgpu_emu_turn_changed.wait(lock, [ticket] { return mgpu_emu_serving == ticket; });
    }
    ~mgpu_emu_turn() {
        std::lock_guard<std::mutex> hold(mgpu_emu_turn_mutex);
        mgpu_emu_serving++;
        mgpu_emu_turn_changed.notify_all();
    }
};
struct mgpu_emu_launcher {
    dim3 grid, block;
    size_t shared_bytes;
    cudaStream_t stream;
    mgpu_emu_launcher(dim3 g, dim3 b, size_t shared = 0, cudaStream_t s = 0)
        : grid(g), block(b), shared_bytes(shared), stream(s) {}
    template <typename... P, typename... A> void operator()(void (*kernel)(P...), A... args) {
        if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535)
            mgpu_emu_fail("a grid a GPU refuses (empty, or y or z above 65535)");
        if (block.x == 0 || block.x > 1024 || block.y != 1 || block.z != 1 || block.x % 32)
            mgpu_emu_fail("a block of other than 1 to 32 whole warps in x");
        if (stream && stream->device != mgpu_emu_device)
            mgpu_emu_fail("a launch into a stream of a device that is not the current one");
        mgpu_emu_check_shared(reinterpret_cast<uintptr_t>(kernel), shared_bytes);
        dim3 g = grid, b = block;
        mgpu_emu_submit(stream, [g, b, kernel, args...] {
            mgpu_emu_turn turn;
            mgpu_emu_run_grid(g, b, reinterpret_cast<uintptr_t>(kernel), [&] { kernel(args...); });
        });
    }
};

/* -------------------------------------------------------------- cuBLAS */
/* A library's handle (cuBLAS's, cuDNN's): the device current when it was
   made, and the stream its calls run on (0: at once). */
struct mgpu_emu_handle {
    int device = mgpu_emu_device;
    cudaStream_t stream = 0;
    bool takes(cudaStream_t s) const { return !s || s->device == device; }
};
typedef int cublasStatus_t;
enum { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_INVALID_VALUE = 7, CUBLAS_STATUS_EXECUTION_FAILED = 13 };
struct mgpu_emu_cublas : mgpu_emu_handle {};
typedef mgpu_emu_cublas *cublasHandle_t;
enum cublasOperation_t { CUBLAS_OP_N, CUBLAS_OP_T };
enum { CUDA_R_32F };
enum { CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32 };
enum { CUBLAS_GEMM_DEFAULT };
static inline const char *cublasGetStatusString(cublasStatus_t s) {
    return s == CUBLAS_STATUS_SUCCESS         ? "CUBLAS_STATUS_SUCCESS"
           : s == CUBLAS_STATUS_INVALID_VALUE ? "CUBLAS_STATUS_INVALID_VALUE"
                                              : "CUBLAS_STATUS_EXECUTION_FAILED";
}
static inline cublasStatus_t cublasCreate(cublasHandle_t *h) {
    *h = new mgpu_emu_cublas;
    return CUBLAS_STATUS_SUCCESS;
}
static inline cublasStatus_t cublasDestroy(cublasHandle_t h) {
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}
static inline cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) {
    if (!h->takes(s)) return CUBLAS_STATUS_INVALID_VALUE;
    h->stream = s;
    return CUBLAS_STATUS_SUCCESS;
}
/* A column-major matrix of `cols` columns ld apart, its values rounded to
   TF32 as the tensor cores read them. */
static inline std::vector<float> mgpu_emu_tf32_copy(const float *p, int rows, int cols, int ld) {
    std::vector<float> v(cols ? (size_t)ld * (cols - 1) + rows : 0);
    for (size_t i = 0; i < v.size(); i++) v[i] = mgpu_emu_tf32(p[i]);
    return v;
}
/* cuBLAS's product, column-major, on the handle's stream (no handle: at
   once). It refuses leading dimensions below max(1, rows) as cuBLAS does,
   and a handle used while another device is current. alpha and beta are
   read at the call (host pointer mode). CUBLAS_COMPUTE_32F_FAST_TF32
   rounds the inputs to TF32, with float sums. */
static inline cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                                   int n, int k, const float *alpha, const float *a, int, int lda,
                                   const float *b, int, int ldb, const float *beta, float *c, int,
                                   int ldc, int compute, int) {
    int a_rows = ta == CUBLAS_OP_N ? m : k, b_rows = tb == CUBLAS_OP_N ? k : n;
    if (lda < std::max(1, a_rows) || ldb < std::max(1, b_rows) || ldc < std::max(1, m))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (h && h->device != mgpu_emu_device) return CUBLAS_STATUS_EXECUTION_FAILED;
    float al = *alpha, be = *beta;
    mgpu_emu_submit(h ? h->stream : 0, [=] {
        std::vector<float> a32, b32;
        const float *a_in = a, *b_in = b;
        if (compute == CUBLAS_COMPUTE_32F_FAST_TF32) {
            a32 = mgpu_emu_tf32_copy(a, a_rows, ta == CUBLAS_OP_N ? k : m, lda);
            b32 = mgpu_emu_tf32_copy(b, b_rows, tb == CUBLAS_OP_N ? n : k, ldb);
            a_in = a32.data();
            b_in = b32.data();
        }
        cblas_sgemm(CblasColMajor, ta == CUBLAS_OP_N ? CblasNoTrans : CblasTrans,
                    tb == CUBLAS_OP_N ? CblasNoTrans : CblasTrans, m, n, k, al, a_in, lda, b_in, ldb,
                    be, c, ldc);
    });
    return CUBLAS_STATUS_SUCCESS;
}

/* `batch` products, each operand's matrices `stride` floats apart. */
static inline cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta,
                                                        cublasOperation_t tb, int m, int n, int k,
                                                        const float *alpha, const float *a, int a_type, int lda,
                                                        long long stride_a, const float *b, int b_type, int ldb,
                                                        long long stride_b, const float *beta, float *c,
                                                        int c_type, int ldc, long long stride_c, int batch,
                                                        int compute, int algo) {
    for (int i = 0; i < batch; i++) {
        cublasStatus_t s = cublasGemmEx(h, ta, tb, m, n, k, alpha, a + i * stride_a, a_type, lda,
                                        b + i * stride_b, b_type, ldb, beta, c + i * stride_c, c_type, ldc,
                                        compute, algo);
        if (s != CUBLAS_STATUS_SUCCESS) return s;
    }
    return CUBLAS_STATUS_SUCCESS;
}

/* cuBLAS's classic float product: float32 (the handle's default math mode). */
static inline cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb,
                                         int m, int n, int k, const float *alpha, const float *a,
                                         int lda, const float *b, int ldb, const float *beta, float *c,
                                         int ldc) {
    return cublasGemmEx(h, ta, tb, m, n, k, alpha, a, CUDA_R_32F, lda, b, CUDA_R_32F, ldb, beta, c,
                        CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

/* --------------------------------------------------------------- cuDNN */
/* The legacy convolution API that kernels/conv_cudnn.h calls, computed by
   a direct loop in double from the inputs (rounded to TF32 unless the
   math type is CUDNN_FMA_MATH). Which algorithms "exist" is made up, but
   shaped like cuDNN's answers, so that the library's filtering is
   exercised: some refuse some shapes (Winograd: 3x3 at stride 1 only),
   some are non-deterministic, some need a workspace, one runs in float32,
   and one (the forward pass's nonfused Winograd) is listed by the
   heuristics but refuses to run, as cuDNN's sometimes do.
   Refused as cuDNN would: a descriptor not set or not matching the
   others, an algorithm that does not fit the shape, a workspace smaller
   than the algorithm asked for, a tensor or workspace outside the
   handle's device's memory, a stream of another device, and a handle
   used while another device is current. */
typedef int cudnnStatus_t;
enum {
    CUDNN_STATUS_SUCCESS = 0,
    CUDNN_STATUS_BAD_PARAM = 2000,
    CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH = 2007,
    CUDNN_STATUS_NOT_SUPPORTED = 3000,
    CUDNN_STATUS_EXECUTION_FAILED = 5000,
};
static inline const char *cudnnGetErrorString(cudnnStatus_t s) {
    return s == CUDNN_STATUS_SUCCESS                    ? "CUDNN_STATUS_SUCCESS"
           : s == CUDNN_STATUS_BAD_PARAM                ? "CUDNN_STATUS_BAD_PARAM"
           : s == CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH ? "CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH"
           : s == CUDNN_STATUS_NOT_SUPPORTED            ? "CUDNN_STATUS_NOT_SUPPORTED"
                                                        : "CUDNN_STATUS_EXECUTION_FAILED";
}
struct mgpu_emu_cudnn : mgpu_emu_handle {};
typedef mgpu_emu_cudnn *cudnnHandle_t;
static inline cudnnStatus_t cudnnCreate(cudnnHandle_t *h) {
    *h = new mgpu_emu_cudnn;
    return CUDNN_STATUS_SUCCESS;
}
static inline cudnnStatus_t cudnnDestroy(cudnnHandle_t h) {
    delete h;
    return CUDNN_STATUS_SUCCESS;
}
static inline cudnnStatus_t cudnnSetStream(cudnnHandle_t h, cudaStream_t s) {
    if (!h->takes(s)) return CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH;
    h->stream = s;
    return CUDNN_STATUS_SUCCESS;
}

typedef enum { CUDNN_TENSOR_NCHW = 0, CUDNN_TENSOR_NHWC = 1 } cudnnTensorFormat_t;
typedef enum { CUDNN_DATA_FLOAT = 0 } cudnnDataType_t;
typedef enum { CUDNN_CONVOLUTION = 0, CUDNN_CROSS_CORRELATION = 1 } cudnnConvolutionMode_t;
typedef enum { CUDNN_DEFAULT_MATH = 0, CUDNN_TENSOR_OP_MATH = 1, CUDNN_FMA_MATH = 3 } cudnnMathType_t;
typedef enum { CUDNN_NON_DETERMINISTIC = 0, CUDNN_DETERMINISTIC = 1 } cudnnDeterminism_t;
typedef enum { CUDNN_CONVOLUTION_FWD_ALGO_COUNT = 8 } cudnnConvolutionFwdAlgo_t;
typedef enum { CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT = 6 } cudnnConvolutionBwdDataAlgo_t;
typedef enum { CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT = 7 } cudnnConvolutionBwdFilterAlgo_t;

struct mgpu_emu_cudnn_tensor { int n = 0, c = 0, h = 0, w = 0; };        /* NCHW; n 0: not set */
struct mgpu_emu_cudnn_filter { int k = 0, c = 0, r = 0, s = 0; };
struct mgpu_emu_cudnn_convolution { int pad = -1, stride = 0, math = CUDNN_DEFAULT_MATH; };
typedef mgpu_emu_cudnn_tensor *cudnnTensorDescriptor_t;
typedef mgpu_emu_cudnn_filter *cudnnFilterDescriptor_t;
typedef mgpu_emu_cudnn_convolution *cudnnConvolutionDescriptor_t;
static inline cudnnStatus_t cudnnCreateTensorDescriptor(cudnnTensorDescriptor_t *d) { *d = new mgpu_emu_cudnn_tensor; return 0; }
static inline cudnnStatus_t cudnnCreateFilterDescriptor(cudnnFilterDescriptor_t *d) { *d = new mgpu_emu_cudnn_filter; return 0; }
static inline cudnnStatus_t cudnnCreateConvolutionDescriptor(cudnnConvolutionDescriptor_t *d) {
    *d = new mgpu_emu_cudnn_convolution;
    return 0;
}
static inline cudnnStatus_t cudnnDestroyTensorDescriptor(cudnnTensorDescriptor_t d) { delete d; return 0; }
static inline cudnnStatus_t cudnnDestroyFilterDescriptor(cudnnFilterDescriptor_t d) { delete d; return 0; }
static inline cudnnStatus_t cudnnDestroyConvolutionDescriptor(cudnnConvolutionDescriptor_t d) { delete d; return 0; }
static inline cudnnStatus_t cudnnSetTensor4dDescriptor(cudnnTensorDescriptor_t d, cudnnTensorFormat_t format,
                                                       cudnnDataType_t, int n, int c, int h, int w) {
    if (format != CUDNN_TENSOR_NCHW || n < 1 || c < 1 || h < 1 || w < 1) return CUDNN_STATUS_BAD_PARAM;
    *d = {n, c, h, w};
    return CUDNN_STATUS_SUCCESS;
}
static inline cudnnStatus_t cudnnSetFilter4dDescriptor(cudnnFilterDescriptor_t d, cudnnDataType_t,
                                                       cudnnTensorFormat_t format, int k, int c, int r, int s) {
    if (format != CUDNN_TENSOR_NCHW || k < 1 || c < 1 || r < 1 || s < 1) return CUDNN_STATUS_BAD_PARAM;
    *d = {k, c, r, s};
    return CUDNN_STATUS_SUCCESS;
}
/* (the library's convolutions have one padding, one stride and no dilation) */
static inline cudnnStatus_t cudnnSetConvolution2dDescriptor(cudnnConvolutionDescriptor_t d, int pad_h, int pad_w,
                                                            int u, int v, int dilation_h, int dilation_w,
                                                            cudnnConvolutionMode_t mode, cudnnDataType_t) {
    if (pad_h < 0 || u < 1 || pad_h != pad_w || u != v || dilation_h != 1 || dilation_w != 1 ||
        mode != CUDNN_CROSS_CORRELATION)
        return CUDNN_STATUS_BAD_PARAM;
    d->pad = pad_h;
    d->stride = u;
    return CUDNN_STATUS_SUCCESS;
}
static inline cudnnStatus_t cudnnSetConvolutionMathType(cudnnConvolutionDescriptor_t d, cudnnMathType_t math) {
    d->math = math;
    return CUDNN_STATUS_SUCCESS;
}

/* One convolution's shapes, checked against each other. */
struct mgpu_emu_cudnn_shapes {
    mgpu_emu_cudnn_tensor x, y;
    mgpu_emu_cudnn_filter w;
    int pad, stride, math;
};
static inline bool mgpu_emu_cudnn_consistent(const mgpu_emu_cudnn_shapes &a) {
    if (!a.x.n || !a.y.n || !a.w.k || a.pad < 0) return false; /* a descriptor not set */
    int p = (a.x.h + 2 * a.pad - a.w.r) / a.stride + 1, q = (a.x.w + 2 * a.pad - a.w.s) / a.stride + 1;
    return a.x.c == a.w.c && a.y.n == a.x.n && a.y.c == a.w.k && a.y.h == p && a.y.w == q;
}
enum mgpu_emu_cudnn_pass { MGPU_EMU_CUDNN_Y, MGPU_EMU_CUDNN_DX, MGPU_EMU_CUDNN_DW };
/* Whether an algorithm of a pass computes these shapes, and with what. */
struct mgpu_emu_cudnn_answer {
    cudnnStatus_t status;
    size_t workspace;
    bool deterministic;
    int math;
    bool runs = true; /* false: listed, but refused when called */
};
enum { MGPU_EMU_CUDNN_LISTED_BUT_REFUSED = 7 }; /* the forward pass's */
static inline mgpu_emu_cudnn_answer mgpu_emu_cudnn_algorithm(mgpu_emu_cudnn_pass pass, int algo,
                                                            const mgpu_emu_cudnn_shapes &a) {
    int asked = a.math == CUDNN_FMA_MATH ? CUDNN_FMA_MATH : CUDNN_DEFAULT_MATH;
    bool winograd = a.w.r == 3 && a.w.s == 3 && a.stride == 1;
    size_t col = sizeof(float) * a.w.c * a.w.r * a.w.s * a.y.h * a.y.w; /* one image's im2col */
    mgpu_emu_cudnn_answer no = {CUDNN_STATUS_NOT_SUPPORTED, 0, true, asked};
    if (pass == MGPU_EMU_CUDNN_Y) {
        switch (algo) {
        case 0: return {CUDNN_STATUS_SUCCESS, 0, true, asked};                  /* implicit GEMM */
        case 1: return {CUDNN_STATUS_SUCCESS, 4096, true, asked};               /* precomputed */
        case 2: return {CUDNN_STATUS_SUCCESS, col, true, CUDNN_FMA_MATH};       /* GEMM, float32 */
        case 6: return winograd ? mgpu_emu_cudnn_answer{CUDNN_STATUS_SUCCESS, 0, true, asked} : no;
        case MGPU_EMU_CUDNN_LISTED_BUT_REFUSED: /* nonfused Winograd: refused at 3x3, runs at 5x5 */
            if (winograd) return {CUDNN_STATUS_SUCCESS, 0, true, asked, false};
            return a.w.r == 5 && a.w.s == 5 && a.stride == 1 ? mgpu_emu_cudnn_answer{CUDNN_STATUS_SUCCESS, 0, true, asked}
                                                            : no;
        default: return no;
        }
    }
    if (pass == MGPU_EMU_CUDNN_DX) {
        switch (algo) {
        case 0: return {CUDNN_STATUS_SUCCESS, 0, false, asked};                 /* atomics */
        case 1: return {CUDNN_STATUS_SUCCESS, col, true, asked};
        case 4: return winograd ? mgpu_emu_cudnn_answer{CUDNN_STATUS_SUCCESS, 1024, true, asked} : no;
        default: return no;
        }
    }
    switch (algo) {
    case 0: return {CUDNN_STATUS_SUCCESS, 0, false, asked};
    case 1: return {CUDNN_STATUS_SUCCESS, 2048, true, asked};
    case 3: return {CUDNN_STATUS_SUCCESS, 0, false, asked};
    default: return no;
    }
}

/* The heuristics' answer: every algorithm, with its status. */
#define MGPU_EMU_CUDNN_PERF(name, algo_type)                                                          \
    typedef struct {                                                                                  \
        algo_type algo;                                                                               \
        cudnnStatus_t status;                                                                         \
        float time;                                                                                   \
        size_t memory;                                                                                \
        cudnnDeterminism_t determinism;                                                               \
        cudnnMathType_t mathType;                                                                     \
        int reserved[3];                                                                              \
    } name;
MGPU_EMU_CUDNN_PERF(cudnnConvolutionFwdAlgoPerf_t, cudnnConvolutionFwdAlgo_t)
MGPU_EMU_CUDNN_PERF(cudnnConvolutionBwdDataAlgoPerf_t, cudnnConvolutionBwdDataAlgo_t)
MGPU_EMU_CUDNN_PERF(cudnnConvolutionBwdFilterAlgoPerf_t, cudnnConvolutionBwdFilterAlgo_t)
#undef MGPU_EMU_CUDNN_PERF
template <typename Perf>
static inline cudnnStatus_t mgpu_emu_cudnn_heuristics(cudnnHandle_t h, mgpu_emu_cudnn_pass pass, int algorithms,
                                                      const mgpu_emu_cudnn_shapes &a, int requested, int *returned,
                                                      Perf *perf) {
    if (h->device != mgpu_emu_device) return CUDNN_STATUS_EXECUTION_FAILED;
    if (!mgpu_emu_cudnn_consistent(a) || requested < 1) return CUDNN_STATUS_BAD_PARAM;
    *returned = std::min(requested, algorithms);
    for (int i = 0; i < *returned; i++) {
        mgpu_emu_cudnn_answer answer = mgpu_emu_cudnn_algorithm(pass, i, a);
        perf[i] = Perf{};
        perf[i].algo = (decltype(perf[i].algo))i;
        perf[i].status = answer.status;
        perf[i].time = -1.0f;
        perf[i].memory = answer.workspace;
        perf[i].determinism = answer.deterministic ? CUDNN_DETERMINISTIC : CUDNN_NON_DETERMINISTIC;
        perf[i].mathType = (cudnnMathType_t)answer.math;
    }
    return CUDNN_STATUS_SUCCESS;
}
static inline cudnnStatus_t cudnnGetConvolutionForwardAlgorithm_v7(cudnnHandle_t h, cudnnTensorDescriptor_t x,
                                                                   cudnnFilterDescriptor_t w,
                                                                   cudnnConvolutionDescriptor_t conv,
                                                                   cudnnTensorDescriptor_t y, int requested,
                                                                   int *returned, cudnnConvolutionFwdAlgoPerf_t *perf) {
    return mgpu_emu_cudnn_heuristics(h, MGPU_EMU_CUDNN_Y, CUDNN_CONVOLUTION_FWD_ALGO_COUNT,
                                     {*x, *y, *w, conv->pad, conv->stride, conv->math}, requested, returned, perf);
}
static inline cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithm_v7(cudnnHandle_t h, cudnnFilterDescriptor_t w,
                                                                        cudnnTensorDescriptor_t dy,
                                                                        cudnnConvolutionDescriptor_t conv,
                                                                        cudnnTensorDescriptor_t dx, int requested,
                                                                        int *returned,
                                                                        cudnnConvolutionBwdDataAlgoPerf_t *perf) {
    return mgpu_emu_cudnn_heuristics(h, MGPU_EMU_CUDNN_DX, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT,
                                     {*dx, *dy, *w, conv->pad, conv->stride, conv->math}, requested, returned, perf);
}
static inline cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithm_v7(cudnnHandle_t h, cudnnTensorDescriptor_t x,
                                                                          cudnnTensorDescriptor_t dy,
                                                                          cudnnConvolutionDescriptor_t conv,
                                                                          cudnnFilterDescriptor_t dw, int requested,
                                                                          int *returned,
                                                                          cudnnConvolutionBwdFilterAlgoPerf_t *perf) {
    return mgpu_emu_cudnn_heuristics(h, MGPU_EMU_CUDNN_DW, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT,
                                     {*x, *dy, *dw, conv->pad, conv->stride, conv->math}, requested, returned, perf);
}

/* One pass: out = alpha * (the pass's result) + beta * out, on the
   handle's stream, after the checks above. */
static inline cudnnStatus_t mgpu_emu_cudnn_run(cudnnHandle_t h, mgpu_emu_cudnn_pass pass, int algo,
                                               const mgpu_emu_cudnn_shapes &a, const float *x, const float *w,
                                               const float *y, float *out, void *workspace, size_t workspace_bytes,
                                               float alpha, float beta) {
    if (h->device != mgpu_emu_device) return CUDNN_STATUS_EXECUTION_FAILED;
    if (!mgpu_emu_cudnn_consistent(a)) return CUDNN_STATUS_BAD_PARAM;
    mgpu_emu_cudnn_answer answer = mgpu_emu_cudnn_algorithm(pass, algo, a);
    if (answer.status != CUDNN_STATUS_SUCCESS) return answer.status;
    if (!answer.runs) return CUDNN_STATUS_NOT_SUPPORTED;
    if (workspace_bytes < answer.workspace || (answer.workspace && !workspace)) return CUDNN_STATUS_BAD_PARAM;
    size_t xs = sizeof(float) * a.x.n * a.x.c * a.x.h * a.x.w, ys = sizeof(float) * a.y.n * a.y.c * a.y.h * a.y.w,
           ws = sizeof(float) * a.w.k * a.w.c * a.w.r * a.w.s;
    if (mgpu_emu_owner(x, xs) != h->device || mgpu_emu_owner(w, ws) != h->device ||
        mgpu_emu_owner(y, ys) != h->device || (workspace && mgpu_emu_owner(workspace, workspace_bytes) != h->device))
        return CUDNN_STATUS_BAD_PARAM;
    bool tf32 = a.math != CUDNN_FMA_MATH && answer.math != CUDNN_FMA_MATH;
    mgpu_emu_submit(h->stream, [=] {
        auto in = [tf32](float v) { return (double)(tf32 ? mgpu_emu_tf32(v) : v); };
        int n = a.x.n, c = a.x.c, hh = a.x.h, ww = a.x.w, k = a.w.k, r = a.w.r, s = a.w.s, p = a.y.h, q = a.y.w;
        size_t count = pass == MGPU_EMU_CUDNN_Y ? (size_t)n * k * p * q
                       : pass == MGPU_EMU_CUDNN_DX ? (size_t)n * c * hh * ww : (size_t)k * c * r * s;
        std::vector<double> sum(count, 0.0);
        for (int ni = 0; ni < n; ni++)
            for (int ki = 0; ki < k; ki++)
                for (int pi = 0; pi < p; pi++)
                    for (int qi = 0; qi < q; qi++) {
                        size_t yi = (((size_t)ni * k + ki) * p + pi) * q + qi;
                        double dy = pass == MGPU_EMU_CUDNN_Y ? 0.0 : in(y[yi]);
                        for (int ci = 0; ci < c; ci++)
                            for (int ri = 0; ri < r; ri++) {
                                int row = pi * a.stride + ri - a.pad;
                                if (row < 0 || row >= hh) continue;
                                for (int si = 0; si < s; si++) {
                                    int col = qi * a.stride + si - a.pad;
                                    if (col < 0 || col >= ww) continue;
                                    size_t xi = (((size_t)ni * c + ci) * hh + row) * ww + col;
                                    size_t wi = (((size_t)ki * c + ci) * r + ri) * s + si;
                                    if (pass == MGPU_EMU_CUDNN_Y) sum[yi] += in(x[xi]) * in(w[wi]);
                                    else if (pass == MGPU_EMU_CUDNN_DX) sum[xi] += dy * in(w[wi]);
                                    else sum[wi] += dy * in(x[xi]);
                                }
                            }
                    }
        for (size_t i = 0; i < count; i++)
            out[i] = (float)(alpha * sum[i] + (beta != 0.0f ? beta * (double)out[i] : 0.0));
    });
    return CUDNN_STATUS_SUCCESS;
}
static inline cudnnStatus_t cudnnConvolutionForward(cudnnHandle_t h, const void *alpha, cudnnTensorDescriptor_t xd,
                                                    const void *x, cudnnFilterDescriptor_t wd, const void *w,
                                                    cudnnConvolutionDescriptor_t conv, cudnnConvolutionFwdAlgo_t algo,
                                                    void *workspace, size_t workspace_bytes, const void *beta,
                                                    cudnnTensorDescriptor_t yd, void *y) {
    return mgpu_emu_cudnn_run(h, MGPU_EMU_CUDNN_Y, algo, {*xd, *yd, *wd, conv->pad, conv->stride, conv->math},
                              (const float *)x, (const float *)w, (const float *)y, (float *)y, workspace,
                              workspace_bytes, *(const float *)alpha, *(const float *)beta);
}
static inline cudnnStatus_t cudnnConvolutionBackwardData(cudnnHandle_t h, const void *alpha, cudnnFilterDescriptor_t wd,
                                                         const void *w, cudnnTensorDescriptor_t dyd, const void *dy,
                                                         cudnnConvolutionDescriptor_t conv,
                                                         cudnnConvolutionBwdDataAlgo_t algo, void *workspace,
                                                         size_t workspace_bytes, const void *beta,
                                                         cudnnTensorDescriptor_t dxd, void *dx) {
    return mgpu_emu_cudnn_run(h, MGPU_EMU_CUDNN_DX, algo, {*dxd, *dyd, *wd, conv->pad, conv->stride, conv->math},
                              (const float *)dx, (const float *)w, (const float *)dy, (float *)dx, workspace,
                              workspace_bytes, *(const float *)alpha, *(const float *)beta);
}
static inline cudnnStatus_t cudnnConvolutionBackwardFilter(cudnnHandle_t h, const void *alpha,
                                                           cudnnTensorDescriptor_t xd, const void *x,
                                                           cudnnTensorDescriptor_t dyd, const void *dy,
                                                           cudnnConvolutionDescriptor_t conv,
                                                           cudnnConvolutionBwdFilterAlgo_t algo, void *workspace,
                                                           size_t workspace_bytes, const void *beta,
                                                           cudnnFilterDescriptor_t dwd, void *dw) {
    return mgpu_emu_cudnn_run(h, MGPU_EMU_CUDNN_DW, algo, {*xd, *dyd, *dwd, conv->pad, conv->stride, conv->math},
                              (const float *)x, (const float *)dw, (const float *)dy, (float *)dw, workspace,
                              workspace_bytes, *(const float *)alpha, *(const float *)beta);
}
/* y = alpha * b + beta * y, b [1, C, 1, 1] broadcast over y [N, C, H, W]
   (the only broadcast the library asks for). */
static inline cudnnStatus_t cudnnAddTensor(cudnnHandle_t h, const void *alpha, cudnnTensorDescriptor_t bd,
                                           const void *b, const void *beta, cudnnTensorDescriptor_t yd, void *y) {
    if (h->device != mgpu_emu_device) return CUDNN_STATUS_EXECUTION_FAILED;
    mgpu_emu_cudnn_tensor bs = *bd, ys = *yd;
    if (!bs.n || !ys.n || bs.n != 1 || bs.h != 1 || bs.w != 1 || bs.c != ys.c) return CUDNN_STATUS_BAD_PARAM;
    float al = *(const float *)alpha, be = *(const float *)beta;
    const float *bias = (const float *)b;
    float *out = (float *)y;
    mgpu_emu_submit(h->stream, [=] {
        size_t plane = (size_t)ys.h * ys.w;
        for (size_t i = 0; i < (size_t)ys.n * ys.c * plane; i++)
            out[i] = al * bias[i / plane % ys.c] + be * out[i];
    });
    return CUDNN_STATUS_SUCCESS;
}

/* ---------------------------------------------------------------- NCCL
   Communicators of one process's GPUs (ncclCommInitAll), and, built with
   MPI, of GPUs in different processes (ncclGetUniqueId, then
   ncclCommInitRank or ncclCommInitRankConfig in each): their collectives
   go over MPI from the stream, in stream order, as a GPU's NCCL kernels
   run in stream order. A nonblocking communicator (config.blocking = 0)
   starts on a thread of its own: ncclCommInitRankConfig returns
   ncclInProgress, and ncclCommGetAsyncError says ncclInProgress until it
   has joined the others. ncclGetVersion says MGPU_EMU_NCCL_VERSION where
   set (an older NCCL, to test what a program does then).
   MGPU_EMU_NCCL_FAULT plays a fault in the communicators between
   processes, for the tests of what the library does then:
     stop:R:N        rank R stops (SIGSTOP, the whole process: a hung
                     machine) inside its N-th collective
     die:R:N         rank R dies (SIGKILL) there
     hang:R:N        rank R's stream hangs there, until ncclCommAbort (a
                     GPU or NCCL that hangs, its process still alive)
     init-error:R    rank R's communicator fails to start (ncclSystemError)
   ncclCommAbort writes "cuda_emu: ncclCommAbort (rank R of N)" on stderr,
   so that a test sees that it was called. */
typedef int ncclResult_t;
enum {
    ncclSuccess = 0,
    ncclSystemError = 2,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7
};
#define NCCL_VERSION(X, Y, Z) (((X) <= 2 && (Y) <= 8) ? (X) * 1000 + (Y) * 100 + (Z) : (X) * 10000 + (Y) * 100 + (Z))
#define NCCL_VERSION_CODE NCCL_VERSION(2, 28, 9)
typedef enum { ncclFloat } ncclDataType_t;
typedef enum { ncclSum, ncclAvg } ncclRedOp_t;
static inline const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclSystemError: return "unhandled system error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}
static inline ncclResult_t ncclGetVersion(int *version) {
    const char *asked = getenv("MGPU_EMU_NCCL_VERSION");
    *version = asked ? atoi(asked) : NCCL_VERSION_CODE;
    return ncclSuccess;
}
#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
    char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;
typedef struct { /* (NCCL's has more fields: the ones a caller sets are here) */
    size_t size;
    int blocking;
} ncclConfig_t;
#define NCCL_CONFIG_INITIALIZER {sizeof(ncclConfig_t), 1}
enum mgpu_emu_collective_kind { MGPU_EMU_ALLREDUCE, MGPU_EMU_BROADCAST, MGPU_EMU_REDUCE_SCATTER, MGPU_EMU_ALL_GATHER };
/* One collective: every rank's call fills its slot; the last rank's
   stream to arrive computes it, and the others' streams wait until then. */
struct mgpu_emu_collective {
    mgpu_emu_collective_kind kind;
    size_t count;
    int arg; /* the root, or the reduction */
    std::vector<const float *> send;
    std::vector<float *> recv;
    int arrived = 0;
    bool done = false;
    std::mutex mutex;
    std::condition_variable changed;
};
struct mgpu_emu_clique { /* the communicators of one ncclCommInitAll */
    int n;
    std::mutex mutex;
    std::vector<unsigned long> calls;                                  /* per rank */
    std::map<unsigned long, std::shared_ptr<mgpu_emu_collective>> pending; /* by call number */
};
struct mgpu_emu_comm {
    mgpu_emu_comm(std::shared_ptr<mgpu_emu_clique> q, int r, int d) : clique(q), rank(r), device(d) {}
    std::shared_ptr<mgpu_emu_clique> clique; /* one process's GPUs (else NULL) */
    int rank, device;
#if MGPU_MPI
    /* between processes */
    int nranks = 0;
    MPI_Comm mpi = MPI_COMM_NULL;
    std::atomic<int> state{ncclSuccess}; /* what ncclCommGetAsyncError says */
    std::atomic<bool> aborted{false};
    unsigned long calls = 0; /* collectives called so far */
    std::thread starting;    /* a nonblocking start */
#endif
};
typedef mgpu_emu_comm *ncclComm_t;
static thread_local int mgpu_emu_group_depth;
static inline ncclResult_t ncclGroupStart() {
    mgpu_emu_group_depth++;
    return ncclSuccess;
}
static inline ncclResult_t ncclGroupEnd() {
    if (mgpu_emu_group_depth == 0) return ncclInvalidUsage; /* no group to end */
    mgpu_emu_group_depth--;
    return ncclSuccess;
}
static inline ncclResult_t ncclCommInitAll(ncclComm_t *comms, int n, const int *devices) {
    for (int i = 0; i < n; i++) {
        if (devices[i] < 0 || devices[i] >= mgpu_emu_device_count()) return ncclInvalidArgument;
        for (int j = 0; j < i; j++)
            if (devices[j] == devices[i]) return ncclInvalidUsage; /* "Duplicate GPU detected" */
    }
    auto clique = std::make_shared<mgpu_emu_clique>();
    clique->n = n;
    clique->calls.assign(n, 0);
    for (int i = 0; i < n; i++) comms[i] = new mgpu_emu_comm(clique, i, devices[i]);
    return ncclSuccess;
}
static inline int mgpu_emu_ranks(ncclComm_t c) {
#if MGPU_MPI
    if (!c->clique) return c->nranks;
#endif
    return c->clique->n;
}

#if MGPU_MPI
static inline void mgpu_emu_mpi_check(int rc, const char *what) {
    if (rc != MPI_SUCCESS) mgpu_emu_fail(what);
}
/* MGPU_EMU_NCCL_FAULT's fault, if it is this rank's: `kind` ("stop",
   "die", "init-error") with `number` the collective (0 at the start). */
static inline bool mgpu_emu_nccl_fault(const char *kind, int rank, unsigned long number) {
    const char *fault = getenv("MGPU_EMU_NCCL_FAULT");
    char name[16];
    int r = -1;
    unsigned long n = 0;
    if (!fault || sscanf(fault, "%15[a-z-]:%d:%lu", name, &r, &n) < 2) return false;
    return strcmp(name, kind) == 0 && r == rank && n == number;
}
/* The id says which process is rank 0 and which of its communicators
   this is: the others send it their place in MPI_COMM_WORLD, it answers
   with everyone's, and they make an MPI communicator of them. */
static inline ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    static std::atomic<int> made{0};
    int me;
    mgpu_emu_mpi_check(MPI_Comm_rank(MPI_COMM_WORLD, &me), "ncclGetUniqueId: MPI_Comm_rank");
    memset(id, 0, sizeof *id);
    snprintf(id->internal, sizeof id->internal, "mgpu-emu %d %d", me, made++);
    return ncclSuccess;
}
static inline void mgpu_emu_nccl_join(mgpu_emu_comm *c, int root, int tag) {
    int me, n = c->nranks;
    mgpu_emu_mpi_check(MPI_Comm_rank(MPI_COMM_WORLD, &me), "NCCL's start: MPI_Comm_rank");
    std::vector<int> world(n);
    if (c->rank == 0) {
        world[0] = me;
        for (int k = 1; k < n; k++) {
            int who[2]; /* its rank in the communicator, and in MPI_COMM_WORLD */
            mgpu_emu_mpi_check(MPI_Recv(who, 2, MPI_INT, MPI_ANY_SOURCE, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE),
                               "NCCL's start: MPI_Recv");
            if (who[0] <= 0 || who[0] >= n) mgpu_emu_fail("ncclCommInitRank: a rank out of range, or twice");
            world[who[0]] = who[1];
        }
        for (int r = 1; r < n; r++)
            mgpu_emu_mpi_check(MPI_Send(world.data(), n, MPI_INT, world[r], tag, MPI_COMM_WORLD),
                               "NCCL's start: MPI_Send");
    } else {
        int who[2] = {c->rank, me};
        mgpu_emu_mpi_check(MPI_Send(who, 2, MPI_INT, root, tag, MPI_COMM_WORLD), "NCCL's start: MPI_Send");
        mgpu_emu_mpi_check(MPI_Recv(world.data(), n, MPI_INT, root, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE),
                           "NCCL's start: MPI_Recv");
    }
    MPI_Group everyone, members;
    mgpu_emu_mpi_check(MPI_Comm_group(MPI_COMM_WORLD, &everyone), "NCCL's start: MPI_Comm_group");
    mgpu_emu_mpi_check(MPI_Group_incl(everyone, n, world.data(), &members), "NCCL's start: MPI_Group_incl");
    mgpu_emu_mpi_check(MPI_Comm_create_group(MPI_COMM_WORLD, members, tag, &c->mpi),
                       "NCCL's start: MPI_Comm_create_group");
    MPI_Group_free(&members);
    MPI_Group_free(&everyone);
    c->state = mgpu_emu_nccl_fault("init-error", c->rank, 0) ? ncclSystemError : ncclSuccess;
}
static inline ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                                  ncclConfig_t *config) {
    int root = -1, number = -1;
    if (sscanf(id.internal, "mgpu-emu %d %d", &root, &number) != 2 || nranks < 1 || rank < 0 || rank >= nranks)
        return ncclInvalidArgument;
    mgpu_emu_comm *c = new mgpu_emu_comm(nullptr, rank, mgpu_emu_device);
    c->nranks = nranks;
    *comm = c;
    int tag = 0x4e00 + number % 4096; /* (this communicator's messages in MPI_COMM_WORLD) */
    if (config && config->blocking == 0) {
        c->state = ncclInProgress;
        c->starting = std::thread(mgpu_emu_nccl_join, c, root, tag);
        return ncclInProgress;
    }
    mgpu_emu_nccl_join(c, root, tag);
    return c->state;
}
static inline ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
    return ncclCommInitRankConfig(comm, nranks, id, rank, nullptr);
}
static inline ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t *state) {
    *state = c->state;
    return ncclSuccess;
}
/* Its collectives still queued or running stop where they are; the
   communicator itself is left (a stream may still hold its last task). */
static inline ncclResult_t ncclCommAbort(ncclComm_t c) {
    if (!c) return ncclSuccess;
    c->aborted = true;
    fprintf(stderr, "cuda_emu: ncclCommAbort (rank %d of %d)\n", c->rank, mgpu_emu_ranks(c));
    if (c->starting.joinable()) c->starting.detach(); /* (it may wait for a rank that never comes) */
    return ncclSuccess;
}
static inline ncclResult_t ncclCommFinalize(ncclComm_t c) {
    (void)c; /* (the collectives ran in their streams' order, which the caller waited for) */
    return ncclSuccess;
}
#endif /* MGPU_MPI */
static inline ncclResult_t ncclCommDestroy(ncclComm_t c) {
#if MGPU_MPI
    if (c->starting.joinable()) c->starting.join();
    if (c->mpi != MPI_COMM_NULL) mgpu_emu_mpi_check(MPI_Comm_free(&c->mpi), "ncclCommDestroy: MPI_Comm_free");
#endif
    delete c;
    return ncclSuccess;
}
static inline void mgpu_emu_compute(mgpu_emu_collective *k, int n) {
    size_t m = k->count;
    switch (k->kind) {
    case MGPU_EMU_ALLREDUCE:
    case MGPU_EMU_REDUCE_SCATTER: {
        size_t total = k->kind == MGPU_EMU_ALLREDUCE ? m : m * n;
        std::vector<float> sum(total, 0.0f); /* every input is read before any output is written */
        for (int r = 0; r < n; r++)
            for (size_t i = 0; i < total; i++) sum[i] += k->send[r][i];
        if (k->arg == ncclAvg)
            for (float &v : sum) v /= (float)n;
        for (int r = 0; r < n; r++)
            memcpy(k->recv[r], sum.data() + (k->kind == MGPU_EMU_ALLREDUCE ? 0 : r * m), m * sizeof(float));
        break;
    }
    case MGPU_EMU_BROADCAST: {
        std::vector<float> root(k->send[k->arg], k->send[k->arg] + m);
        for (int r = 0; r < n; r++) memcpy(k->recv[r], root.data(), m * sizeof(float));
        break;
    }
    case MGPU_EMU_ALL_GATHER: {
        std::vector<float> all(m * n);
        for (int r = 0; r < n; r++) memcpy(all.data() + r * m, k->send[r], m * sizeof(float));
        for (int r = 0; r < n; r++) memcpy(k->recv[r], all.data(), m * n * sizeof(float));
        break;
    }
    }
}
#if MGPU_MPI
/* Collective `number` of communicator c, on its stream: every rank's
   input reaches every rank (an all-gather over MPI, polled so that
   ncclCommAbort stops it), and each computes its own output from them in
   rank order, as the in-process collectives do. */
static inline void mgpu_emu_collective_between_processes(mgpu_emu_collective_kind kind, const void *send,
                                                         void *recv, size_t count, int arg, ncclComm_t c,
                                                         unsigned long number) {
    if (mgpu_emu_nccl_fault("stop", c->rank, number)) raise(SIGSTOP); /* (this thread: it stops before going on) */
    if (mgpu_emu_nccl_fault("die", c->rank, number)) raise(SIGKILL);
    if (mgpu_emu_nccl_fault("hang", c->rank, number))
        while (!c->aborted) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    int n = c->nranks;
    size_t in = kind == MGPU_EMU_REDUCE_SCATTER ? count * n : count;
    size_t out = kind == MGPU_EMU_ALL_GATHER ? count * n : count;
    if (in > INT_MAX) mgpu_emu_fail("NCCL between processes: more floats than MPI counts");
    std::vector<float> inputs(in * n), others(out * n);
    MPI_Request request;
    mgpu_emu_mpi_check(MPI_Iallgather(send, (int)in, MPI_FLOAT, inputs.data(), (int)in, MPI_FLOAT, c->mpi, &request),
                       "NCCL between processes: MPI_Iallgather");
    for (int done = 0; !done;) {
        if (c->aborted) return;
        mgpu_emu_mpi_check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "NCCL between processes: MPI_Test");
        if (!done) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    mgpu_emu_collective k;
    k.kind = kind;
    k.count = count;
    k.arg = arg;
    for (int r = 0; r < n; r++) {
        k.send.push_back(inputs.data() + r * in);
        k.recv.push_back(r == c->rank ? (float *)recv : others.data() + r * out);
    }
    mgpu_emu_compute(&k, n);
}
#endif
static inline ncclResult_t mgpu_emu_collective_call(mgpu_emu_collective_kind kind, const void *send, void *recv,
                                             size_t count, int arg, ncclComm_t c, cudaStream_t s) {
    /* a created stream of the rank's device (the legacy stream, which runs
       at once here, would wait in the collective for ranks not yet called) */
    if (!s || s->device != c->device) return ncclInvalidArgument;
    int n = mgpu_emu_ranks(c);
    size_t in = kind == MGPU_EMU_REDUCE_SCATTER ? count * n : count;
    size_t out = kind == MGPU_EMU_ALL_GATHER ? count * n : count;
    if (mgpu_emu_owner(send, in * sizeof(float)) != c->device ||
        mgpu_emu_owner(recv, out * sizeof(float)) != c->device)
        return ncclInvalidArgument;
#if MGPU_MPI
    if (!c->clique) {
        if (c->state != ncclSuccess || c->aborted) return ncclInvalidUsage; /* (not started, failed or aborted) */
        unsigned long number = ++c->calls;
        mgpu_emu_submit(s, [=] { mgpu_emu_collective_between_processes(kind, send, recv, count, arg, c, number); });
        return ncclSuccess;
    }
#endif
    mgpu_emu_clique *q = c->clique.get();
    std::shared_ptr<mgpu_emu_collective> k;
    {
        std::lock_guard<std::mutex> hold(q->mutex);
        unsigned long call = q->calls[c->rank]++;
        std::shared_ptr<mgpu_emu_collective> &slot = q->pending[call];
        if (!slot) {
            slot = std::make_shared<mgpu_emu_collective>();
            slot->kind = kind;
            slot->count = count;
            slot->arg = arg;
            slot->send.assign(q->n, nullptr);
            slot->recv.assign(q->n, nullptr);
        } else if (slot->kind != kind || slot->count != count || slot->arg != arg) {
            mgpu_emu_fail("NCCL: the ranks' calls of one collective disagree (kind, count or root)");
        }
        slot->send[c->rank] = (const float *)send;
        slot->recv[c->rank] = (float *)recv;
        k = slot;
        if (std::count(k->recv.begin(), k->recv.end(), nullptr) == 0) q->pending.erase(call);
    }
    mgpu_emu_submit(s, [k, n] {
        std::unique_lock<std::mutex> lock(k->mutex);
        if (++k->arrived == n) {
            mgpu_emu_compute(k.get(), n);
            k->done = true;
            k->changed.notify_all();
        }
        k->changed.wait(lock, [&] { return k->done; });
    });
    return ncclSuccess;
}
static inline ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t,
                                  ncclRedOp_t op, ncclComm_t c, cudaStream_t s) {
    return mgpu_emu_collective_call(MGPU_EMU_ALLREDUCE, send, recv, count, op, c, s);
}
static inline ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t, int root,
                                  ncclComm_t c, cudaStream_t s) {
    return mgpu_emu_collective_call(MGPU_EMU_BROADCAST, send, recv, count, root, c, s);
}
static inline ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, ncclDataType_t,
                                      ncclRedOp_t op, ncclComm_t c, cudaStream_t s) {
    return mgpu_emu_collective_call(MGPU_EMU_REDUCE_SCATTER, send, recv, count, op, c, s);
}
static inline ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t,
                                  ncclComm_t c, cudaStream_t s) {
    return mgpu_emu_collective_call(MGPU_EMU_ALL_GATHER, send, recv, count, 0, c, s);
}
#endif
