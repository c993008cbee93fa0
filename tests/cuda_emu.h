/* tests/cuda_emu.h: runs the CUDA kernels of kernels/ on the CPU, so that
   `make test` checks them against their CPU references on a machine with
   no GPU (tests/emu_kernels.cpp; tests/gpu_*.c do the same on a real GPU).

   How a GPU runs a kernel, written out on one CPU thread: a launch
   kernel<<<grid, block>>>(args) runs grid.x * grid.y * grid.z blocks, and
   every block runs block.x threads that see their own threadIdx and the
   block's blockIdx. Here the blocks run one after another, and the
   threads of a block are fibers (ucontext): each has its own stack, and
   they take turns, each running until it must wait for the others, so that
     __syncthreads()      is a barrier of the block's threads, and
     __shfl_*_sync(...)   is an exchange among the 32 threads of a warp,
                          with a barrier of the warp before and after;
   __shared__ variables are static, shared by the threads of the block
   (blocks run one at a time, so they do not share them with another).
   Fibers rather than OS threads: switching between them costs no system
   call to create or wake a thread, which made these tests 5 times slower.

   What it checks beyond the arithmetic: launch configurations a GPU
   refuses (an empty grid, gridDim.y or .z above 65535, more than 1024
   threads), warp shuffles with a partial mask or after some threads of
   the warp have returned (undefined on a GPU), and the leading dimensions
   cuBLAS would reject. What it cannot check: timing, memory coalescing,
   races between blocks (blocks run in order here).

   The build (see the Makefile) rewrites every launch in kernels/,
   name<<<config>>>(args);  ->  MGPU_EMU_LAUNCH((config), [&] { name(args); });
   into build/emu/kernels.h, which this header's user includes next. */
#ifndef MGPU_CUDA_EMU_H
#define MGPU_CUDA_EMU_H
#include <cblas.h>
#include <functional>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <vector>

/* ----------------------------------------------- the language's pieces */
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
static dim3 blockIdx, threadIdx; /* of the fiber running now */
static dim3 blockDim, gridDim;
#define __global__
#define __device__
#define __launch_bounds__(...)
#define __host__
#define __shared__ static
#define MGPU_CUDA 1
#define MGPU__HOSTDEVICE

static void mgpu_emu_fail(const char *what) {
    fprintf(stderr, "cuda_emu: %s\n", what);
    abort();
}

/* ---------------------------------------- the runtime and cuBLAS calls */
typedef void *cudaStream_t;
typedef int cudaError_t;
#define cudaSuccess 0
static int cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t) {
    memset(p, v, n);
    return 0;
}
#define MGPU_CUDA_CHECK(call) do { if ((call) != 0) mgpu_emu_fail(#call " failed"); } while (0)
#define MGPU_CUDA_CHECK_LAUNCH() do { } while (0) /* a bad launch has aborted already */
#define MGPU_CUBLAS_CHECK(call) do { if ((call) != 0) mgpu_emu_fail(#call " was refused"); } while (0)
static void mgpu_fatal(const char *fmt, ...) { mgpu_emu_fail(fmt); }

typedef struct mgpu__exec {
    int on_gpu;
    void *stream;
    void *cublas;
} mgpu__exec;

typedef void *cublasHandle_t;
enum cublasOperation_t { CUBLAS_OP_N, CUBLAS_OP_T };
enum { CUDA_R_32F };
enum { CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32 };
enum { CUBLAS_GEMM_DEFAULT };
/* cuBLAS's product, column-major, in double; it refuses leading dimensions
   below max(1, rows) as cuBLAS does. */
static int cublasGemmEx(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                        int k, const float *alpha, const float *a, int, int lda, const float *b,
                        int, int ldb, const float *beta, float *c, int, int ldc, int, int) {
    int a_rows = ta == CUBLAS_OP_N ? m : k, b_rows = tb == CUBLAS_OP_N ? k : n;
    if (lda < (a_rows > 1 ? a_rows : 1) || ldb < (b_rows > 1 ? b_rows : 1) ||
        ldc < (m > 1 ? m : 1))
        return 7; /* CUBLAS_STATUS_INVALID_VALUE */
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            double s = 0;
            for (int p = 0; p < k; p++)
                s += (double)(ta == CUBLAS_OP_N ? a[i + (size_t)p * lda] : a[p + (size_t)i * lda]) *
                     (tb == CUBLAS_OP_N ? b[p + (size_t)j * ldb] : b[j + (size_t)p * ldb]);
            float *out = &c[i + (size_t)j * ldc];
            *out = *alpha * (float)s + (*beta == 0.0f ? 0.0f : *beta * *out);
        }
    return 0;
}

/* ------------------------------------------------ fibers and barriers */
/* A barrier of `expected` threads: the last to arrive opens it (a new
   generation) and the others, switched out meanwhile, go on. A thread that
   returns from the kernel leaves every barrier it belongs to. */
struct mgpu_emu_barrier {
    unsigned expected, arrived;
    unsigned long generation;
};
struct mgpu_emu_fiber {
    ucontext_t context;
    void *stack;
    int done;
};
static const size_t mgpu_emu_stack_bytes = 256 << 10;
static mgpu_emu_fiber mgpu_emu_fibers[1024];
static ucontext_t mgpu_emu_scheduler;
static unsigned mgpu_emu_current;         /* the fiber running now */
static unsigned long mgpu_emu_progress;   /* arrivals, openings and returns so far */
static const std::function<void()> *mgpu_emu_kernel;
static mgpu_emu_barrier mgpu_emu_block_barrier, mgpu_emu_warp_barrier[32];
static unsigned char mgpu_emu_slot[1024][16]; /* each thread's value during a shuffle */
static unsigned mgpu_emu_warp_exited[32];     /* a bit for each thread that has returned */

static void mgpu_emu_yield() { swapcontext(&mgpu_emu_fibers[mgpu_emu_current].context, &mgpu_emu_scheduler); }
static void mgpu_emu_open(mgpu_emu_barrier *b) {
    b->arrived = 0;
    b->generation++;
    mgpu_emu_progress++;
}
static void mgpu_emu_arrive_and_wait(mgpu_emu_barrier *b) {
    unsigned long generation = b->generation;
    mgpu_emu_progress++;
    if (++b->arrived == b->expected) mgpu_emu_open(b);
    while (b->generation == generation) mgpu_emu_yield();
}
static void mgpu_emu_leave(mgpu_emu_barrier *b) {
    b->expected--;
    if (b->arrived && b->arrived == b->expected) mgpu_emu_open(b);
}
static void mgpu_emu_fiber_main() {
    (*mgpu_emu_kernel)();
    unsigned tx = threadIdx.x;
    mgpu_emu_warp_exited[tx / 32] |= 1u << (tx % 32);
    mgpu_emu_leave(&mgpu_emu_block_barrier);
    mgpu_emu_leave(&mgpu_emu_warp_barrier[tx / 32]);
    mgpu_emu_fibers[tx].done = 1;
    mgpu_emu_progress++;
} /* returns to the scheduler (uc_link) */

/* Runs one block: every fiber in turn until all have returned. A round in
   which nobody arrives, opens or returns means the threads wait at
   barriers the others never reach (a GPU would hang). The turns go up the
   threads in even blocks and down in odd ones, so that a missing barrier
   shows whichever thread reads what another writes. */
static void mgpu_emu_run_block(unsigned threads, int downwards) {
    mgpu_emu_block_barrier = {threads, 0, 0};
    for (unsigned w = 0; w < threads / 32; w++) {
        mgpu_emu_warp_barrier[w] = {32, 0, 0};
        mgpu_emu_warp_exited[w] = 0;
    }
    for (unsigned t = 0; t < threads; t++) {
        mgpu_emu_fiber *f = &mgpu_emu_fibers[t];
        if (!f->stack) {
            f->stack = mmap(NULL, mgpu_emu_stack_bytes, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (f->stack == MAP_FAILED) mgpu_emu_fail("no memory for a fiber's stack");
        }
        getcontext(&f->context);
        f->context.uc_stack.ss_sp = f->stack;
        f->context.uc_stack.ss_size = mgpu_emu_stack_bytes;
        f->context.uc_link = &mgpu_emu_scheduler;
        makecontext(&f->context, mgpu_emu_fiber_main, 0);
        f->done = 0;
    }
    for (unsigned left = threads; left;) {
        unsigned long before = mgpu_emu_progress;
        for (unsigned turn = 0; turn < threads; turn++) {
            unsigned t = downwards ? threads - 1 - turn : turn;
            if (mgpu_emu_fibers[t].done) continue;
            mgpu_emu_current = t;
            threadIdx = dim3(t, 0, 0);
            swapcontext(&mgpu_emu_scheduler, &mgpu_emu_fibers[t].context);
            left -= mgpu_emu_fibers[t].done;
        }
        if (left && mgpu_emu_progress == before)
            mgpu_emu_fail("threads wait at a barrier the others of their block or warp never reach");
    }
}

/* ------------------------------------------------------------- warps */
template <typename T> static T mgpu_emu_shuffle(unsigned mask, T v, int (*source)(int, int), int arg) {
    static_assert(sizeof(T) <= 16, "shuffled values are at most 16 bytes here");
    if (mask != 0xffffffffu) mgpu_emu_fail("a shuffle with a partial mask");
    unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (mgpu_emu_warp_exited[warp]) mgpu_emu_fail("a shuffle after some threads of the warp returned");
    memcpy(mgpu_emu_slot[threadIdx.x], &v, sizeof v);
    mgpu_emu_arrive_and_wait(&mgpu_emu_warp_barrier[warp]);
    T r;
    memcpy(&r, mgpu_emu_slot[warp * 32 + source(lane, arg)], sizeof r);
    mgpu_emu_arrive_and_wait(&mgpu_emu_warp_barrier[warp]);
    return r;
}
static int mgpu_emu_xor_lane(int lane, int mask) { return lane ^ mask; }
static int mgpu_emu_down_lane(int lane, int delta) { return lane + delta < 32 ? lane + delta : lane; }
template <typename T> static T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    return mgpu_emu_shuffle(mask, v, mgpu_emu_xor_lane, lane_mask);
}
template <typename T> static T __shfl_down_sync(unsigned mask, T v, int delta) {
    return mgpu_emu_shuffle(mask, v, mgpu_emu_down_lane, delta);
}
static void __syncthreads() { mgpu_emu_arrive_and_wait(&mgpu_emu_block_barrier); }
static float atomicAdd(float *address, float value) { /* fibers switch only at barriers */
    float old = *address;
    *address = old + value;
    return old;
}

/* -------------------------------------------------- WMMA (tensor cores) */
/* The WMMA fragments the kernels use (TF32 inputs, row-major, float
   accumulators). On a GPU a fragment is spread over the 32 threads of a
   warp; here every thread holds all of it and does the whole product, so
   the results are the same (each thread's copy is identical). The rules a
   GPU enforces are checked: 32-byte aligned pointers, leading dimensions
   that are multiples of 4 floats. */
namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
namespace precision { struct tf32 {}; }
enum layout_t { mem_row_major, mem_col_major };
template <typename Use, int M, int N, int K, typename T, typename Layout = void> struct fragment;
template <int M, int N, int K> struct fragment<matrix_a, M, N, K, precision::tf32, row_major> {
    static const int num_elements = M * K;
    float x[M * K];
};
template <int M, int N, int K> struct fragment<matrix_b, M, N, K, precision::tf32, row_major> {
    static const int num_elements = K * N;
    float x[K * N];
};
template <int M, int N, int K> struct fragment<accumulator, M, N, K, float, void> {
    static const int num_elements = M * N;
    float x[M * N];
};
static void mgpu_emu_check_tile(const void *p, unsigned ldm) {
    if ((uintptr_t)p % 32) mgpu_emu_fail("a WMMA pointer that is not 32-byte aligned");
    if (ldm % 4) mgpu_emu_fail("a WMMA leading dimension that is not a multiple of 4 floats");
}
template <int M, int N, int K>
static void load_matrix_sync(fragment<matrix_a, M, N, K, precision::tf32, row_major> &f,
                             const float *p, unsigned ldm) {
    mgpu_emu_check_tile(p, ldm);
    for (int i = 0; i < M; i++)
        for (int k = 0; k < K; k++) f.x[i * K + k] = p[(size_t)i * ldm + k];
}
template <int M, int N, int K>
static void load_matrix_sync(fragment<matrix_b, M, N, K, precision::tf32, row_major> &f,
                             const float *p, unsigned ldm) {
    mgpu_emu_check_tile(p, ldm);
    for (int k = 0; k < K; k++)
        for (int j = 0; j < N; j++) f.x[k * N + j] = p[(size_t)k * ldm + j];
}
static void mgpu_emu_check_tf32(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    if (bits & 0x1fffu) mgpu_emu_fail("a TF32 WMMA input not rounded with __float_to_tf32");
}
template <int M, int N, int K>
static void fill_fragment(fragment<accumulator, M, N, K, float, void> &f, float v) {
    for (float &x : f.x) x = v;
}
template <int M, int N, int K>
static void mma_sync(fragment<accumulator, M, N, K, float, void> &d,
                     const fragment<matrix_a, M, N, K, precision::tf32, row_major> &a,
                     const fragment<matrix_b, M, N, K, precision::tf32, row_major> &b,
                     const fragment<accumulator, M, N, K, float, void> &c) {
    /* the CUDA guide: a TF32 fragment holds values already rounded with
       __float_to_tf32 (the tensor cores read only their top 19 bits) */
    for (float v : a.x) mgpu_emu_check_tf32(v);
    for (float v : b.x) mgpu_emu_check_tf32(v);
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            float s = c.x[i * N + j];
            for (int k = 0; k < K; k++) s += a.x[i * K + k] * b.x[k * N + j];
            d.x[i * N + j] = s;
        }
}
/* Collective on a GPU; here one thread writes (the others hold the same values). */
template <int M, int N, int K>
static void store_matrix_sync(float *p, const fragment<accumulator, M, N, K, float, void> &f,
                              unsigned ldm, layout_t layout) {
    mgpu_emu_check_tile(p, ldm);
    if (layout != mem_row_major) mgpu_emu_fail("only row-major WMMA stores are emulated");
    if (threadIdx.x % 32 != 0) return;
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) p[(size_t)i * ldm + j] = f.x[i * N + j];
}
/* float to TF32: 10 bits of mantissa, rounded to nearest, ties away from zero (cvt.rna) */
static float __float_to_tf32(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    if ((bits & 0x7f800000u) != 0x7f800000u) bits = (bits + 0x1000u) & ~0x1fffu;
    memcpy(&v, &bits, sizeof v);
    return v;
}
} // namespace wmma
} // namespace nvcuda
#define __align__(n) __attribute__((aligned(n)))

/* ------------------------------------------------------------ launches */
static long mgpu_emu_launches;
static void mgpu_emu_launch(dim3 grid, dim3 block, size_t, cudaStream_t,
                            const std::function<void()> &kernel) {
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535)
        mgpu_emu_fail("a grid a GPU refuses (empty, or y or z above 65535)");
    if (block.x == 0 || block.x > 1024 || block.y != 1 || block.z != 1 || block.x % 32)
        mgpu_emu_fail("a block of other than 1 to 32 whole warps in x");
    mgpu_emu_launches++;
    gridDim = grid;
    blockDim = block;
    mgpu_emu_kernel = &kernel;
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                blockIdx = dim3(bx, by, bz);
                mgpu_emu_run_block(block.x, (bx + by + bz) % 2);
            }
}
#define MGPU_EMU_UNPAREN(...) __VA_ARGS__
#define MGPU_EMU_CALL(f, ...) f(__VA_ARGS__)
#define MGPU_EMU_LAUNCH(config, kernel) MGPU_EMU_CALL(mgpu_emu_launch, MGPU_EMU_UNPAREN config, kernel)

/* The fill kernels draw random numbers through mgpu.h's generator, which is
   not part of kernels/: any function of the same arguments will do, as the
   CPU reference calls the same one. */
static inline float mgpu__random_at(uint64_t key, uint64_t offset, uint64_t i, int normal) {
    return (float)((key + offset + i) % 1000) / 1000.0f - (normal ? 0.5f : 0.0f);
}
#endif
