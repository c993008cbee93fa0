/* kernels/common.h: what the kernels of every kernel file share: the CPU
   loops' threads; for CUDA, division by a launch's constant, the grid and
   its loop, 16-byte loads and stores, and warp and block reductions. Each
   kernel file includes it; it needs mgpu/core.h (MGPU_CUDA,
   MGPU__HOSTDEVICE) before it.

   defines: MGPU__CPU_PARALLEL_FOR, MGPU__PARALLEL_MIN, MGPU__SIMD_SUMS, mgpu__sum_run,
            mgpu__divisor, mgpu__divisor_for, mgpu__div, mgpu__grid_for,
            MGPU__GRID_STRIDE_LOOP, MGPU__UNROLL, mgpu__load_floats,
            mgpu__store_floats, mgpu__aligned16, mgpu__vector_width,
            mgpu__pair, mgpu__shfl_xor, mgpu__sum_op, mgpu__max_op,
            mgpu__warp_allreduce, mgpu__block_reduce */
#ifndef MGPU_KERNELS_COMMON_H
#define MGPU_KERNELS_COMMON_H

/* The CPU kernels' outer loops: split over the OpenMP threads of the
   worker that runs them (mgpu/queues.h sets how many), where the
   program was compiled with -fopenmp; else on the worker alone. Each
   thread takes whole iterations and no sum is split between two, so the
   results do not depend on the number of threads. A loop over fewer than
   MGPU__PARALLEL_MIN values stays on one thread: waking the others would
   cost more than it saves.
   MGPU__SIMD_SUMS(a, b) before a loop lets the compiler sum a and b in
   the lanes of a vector register and add the lanes at the end (OpenMP's
   simd reduction): an order of its own, the same at every run of one
   build, but set by the build's vector width (8 floats with AVX2).
   Without OpenMP it is empty: one running sum, in order, and slower. */
#define MGPU__PARALLEL_MIN 32768
#ifdef _OPENMP
#include <omp.h>
#define MGPU__PRAGMA(x) _Pragma(#x)
#define MGPU__CPU_PARALLEL_FOR(values) \
    MGPU__PRAGMA(omp parallel for num_threads((values) < MGPU__PARALLEL_MIN ? 1 : omp_get_max_threads()))
#define MGPU__SIMD_SUMS(...) MGPU__PRAGMA(omp simd reduction(+ : __VA_ARGS__))
#else
#define MGPU__CPU_PARALLEL_FOR(values)
#define MGPU__SIMD_SUMS(...)
#endif

/* The sum of a run of floats, with 8 independent partial sums: the
   additions need not wait for one another, and the compiler can put the
   8 lanes in one vector register. (A single running sum is a chain of
   dependent additions, several times slower.) */
static inline float mgpu__sum_run(const float *v, size_t n) {
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) lane[j] += v[i + j];
    float sum = 0.0f;
    for (; i < n; i++) sum += v[i];
    for (int j = 0; j < 8; j++) sum += lane[j];
    return sum;
}

#if MGPU_CUDA
/* Division by a number fixed for a whole launch (a tensor's size), as a
   multiply and a shift. A GPU has no integer divider: n / d with d known
   only at run time costs some 20 instructions, more than the rest of an
   elementwise kernel's work on a value, and kernels that find a value's
   channel, pixel or image from its index divide for every value
   (kernels/batchnorm.h, conv.h, conv_few_inputs.h). With l = ceil(log2 d) and
   m = ceil(2^(31 + l) / d), which fits in 32 bits,
       n / d = floor(n m / 2^(31 + l))  for every 0 <= n < 2^31
   (the error n (m d - 2^(31 + l)) / (d 2^(31 + l)) stays below 1/d;
   Granlund and Montgomery, PLDI 1994; CUTLASS's FastDivmod is the same).
   The product's high 32 bits take one multiply instruction. d = 1 keeps
   n (m = 0). A negative n gives a wrong quotient: callers test n >= 0. */
typedef struct {
    int d;
    uint32_t m, shift; /* shift = l - 1: the high word is already n m / 2^32 */
} mgpu__divisor;
static inline mgpu__divisor mgpu__divisor_for(int d) {
    mgpu__divisor v = {d, 0, 0};
    if (d > 1) {
        int l = 0;
        while (((uint64_t)1 << l) < (uint64_t)d) l++;
        v.m = (uint32_t)((((uint64_t)1 << (31 + l)) + (uint64_t)d - 1) / (uint64_t)d);
        v.shift = (uint32_t)(l - 1);
    }
    return v;
}
static MGPU__HOSTDEVICE inline int mgpu__div(int n, mgpu__divisor v) {
    return v.m ? (int)((uint32_t)(((uint64_t)(uint32_t)n * v.m) >> 32) >> v.shift) : n;
}

/* Grid size for one thread per element, capped: the kernels loop. */
static unsigned mgpu__grid_for(size_t n, unsigned block) {
    size_t blocks = (n + block - 1) / block;
    return (unsigned)(blocks < 65535 * 8 ? (blocks ? blocks : 1) : 65535 * 8);
}
#define MGPU__GRID_STRIDE_LOOP(i, n) \
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n); i += (size_t)gridDim.x * blockDim.x)
/* Unrolls the loop that follows, on a GPU: where a loop indexes a
   register array, each index must be a constant, or the array goes to
   (slow) local memory. */
#ifdef __CUDA_ARCH__
#define MGPU__UNROLL _Pragma("unroll")
#else
#define MGPU__UNROLL
#endif

/* V neighbouring floats at p into v, or from v to p, in one memory
   instruction: V = 4 is a 16-byte access, and p must then be 16-byte
   aligned (the emulator of tests/ checks). A kernel that mostly moves
   bytes spends a quarter of the load, store and index instructions so. */
static __device__ inline void mgpu__load_floats(float (&v)[1], const float *p) { v[0] = *p; }
static __device__ inline void mgpu__store_floats(float *p, const float (&v)[1]) { *p = v[0]; }
#ifndef MGPU_CUDA_EMU
static __device__ inline void mgpu__load_floats(float (&v)[4], const float *p) {
    float4 q = *reinterpret_cast<const float4 *>(p);
    v[0] = q.x;
    v[1] = q.y;
    v[2] = q.z;
    v[3] = q.w;
}
static __device__ inline void mgpu__store_floats(float *p, const float (&v)[4]) {
    *reinterpret_cast<float4 *>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
#endif
/* Whether every one of count tensors starts 16-byte aligned (NULL too: a
   tensor a kernel does without). */
static MGPU__HOSTDEVICE inline int mgpu__aligned16(const void *const *tensors, int count) {
    for (int t = 0; t < count; t++)
        if ((uintptr_t)tensors[t] % 16) return 0;
    return 1;
}
/* The vector width V for tensors whose runs of `run` values the kernel
   takes in vectors (a whole tensor, or a plane): 4 when the runs are whole
   vectors and every tensor starts 16-byte aligned, else 1. */
static int mgpu__vector_width(size_t run, const void *const *tensors, int count) {
    return run % 4 == 0 && mgpu__aligned16(tensors, count) ? 4 : 1;
}

/* Reductions. A value type needs a shuffle (mgpu__shfl_xor) and an
   operator that combines two values (batchnorm.h adds Welford's
   statistics to these). */
typedef struct { float a, b; } mgpu__pair;            /* two sums at once */

static __device__ inline float mgpu__shfl_xor(float v, int mask) {
    return __shfl_xor_sync(0xffffffffu, v, mask);
}
static __device__ inline double mgpu__shfl_xor(double v, int mask) {
    return __shfl_xor_sync(0xffffffffu, v, mask);
}
static __device__ inline mgpu__pair mgpu__shfl_xor(mgpu__pair v, int mask) {
    v.a = mgpu__shfl_xor(v.a, mask);
    v.b = mgpu__shfl_xor(v.b, mask);
    return v;
}

struct mgpu__sum_op {
    __device__ float operator()(float x, float y) const { return x + y; }
    __device__ double operator()(double x, double y) const { return x + y; }
    __device__ mgpu__pair operator()(mgpu__pair x, mgpu__pair y) const {
        x.a += y.a;
        x.b += y.b;
        return x;
    }
};
struct mgpu__max_op {
    __device__ float operator()(float x, float y) const { return fmaxf(x, y); }
};
/* Butterfly reduction: every lane of the warp ends with the combination of
   all 32 lanes' values (combined in different orders, so the last bits
   may differ from lane to lane: callers use lane 0's). */
template <typename T, typename Op>
static __device__ inline T mgpu__warp_allreduce(T v, Op op) {
    for (int mask = 16; mask > 0; mask >>= 1) v = op(v, mgpu__shfl_xor(v, mask));
    return v;
}
/* Reduction over a block (blockDim.x a multiple of 32): each warp reduces,
   one value per warp goes through shared memory, the first warp reduces
   those. Thread 0 has the result. Once per kernel: the buffer is reused. */
template <typename T, typename Op>
static __device__ T mgpu__block_reduce(T v, Op op, T identity) {
    __shared__ T per_warp[32];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = mgpu__warp_allreduce(v, op);
    if (lane == 0) per_warp[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x / 32) ? per_warp[lane] : identity;
        v = mgpu__warp_allreduce(v, op);
    }
    return v;
}
#endif
#endif
