/* kernels/elementwise.h: filling tensors and y = a*y + b*x.

   Each operation is an argument struct, a CPU reference that reads like
   the maths, and (under nvcc) a CUDA kernel with a launcher of the same
   signature, void f(const void *args, const mgpu__exec *ex), so the
   library can run either on a device's queue. One thread per element:
   these operations move bytes and do almost no arithmetic, so all that
   matters on a GPU is that a warp touches consecutive addresses. */

enum { MGPU__FILL_CONSTANT, MGPU__FILL_UNIFORM, MGPU__FILL_NORMAL, MGPU__FILL_ARANGE };

typedef struct {
    float *y;
    size_t n;
    int kind;             /* MGPU__FILL_* */
    float a, b;           /* constant: a; uniform: [a, b); normal: mean a, std b */
    uint64_t key, offset; /* the random draw (see mgpu__random_at) */
} mgpu__fill_args;

static MGPU__HOSTDEVICE inline float mgpu__fill_value(const mgpu__fill_args *f, size_t i) {
    switch (f->kind) {
    case MGPU__FILL_CONSTANT: return f->a;
    case MGPU__FILL_UNIFORM: return f->a + (f->b - f->a) * mgpu__random_at(f->key, f->offset, i, 0);
    case MGPU__FILL_NORMAL: return f->a + f->b * mgpu__random_at(f->key, f->offset, i, 1);
    default: return (float)i; /* arange */
    }
}

static void mgpu__fill_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__fill_args *f = (const mgpu__fill_args *)args;
    for (size_t i = 0; i < f->n; i++) f->y[i] = mgpu__fill_value(f, i);
}

typedef struct {
    float *y;
    const float *x;
    size_t n;
    float a, b; /* y = a*y + b*x */
} mgpu__axpby_args;

static void mgpu__axpby_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__axpby_args *p = (const mgpu__axpby_args *)args;
    for (size_t i = 0; i < p->n; i++) p->y[i] = p->a * p->y[i] + p->b * p->x[i];
}

#if MGPU_CUDA
/* Division by a number fixed for a whole launch (a tensor's size), as a
   multiply and a shift. A GPU has no integer divider: n / d with d known
   only at run time costs some 20 instructions, more than the rest of an
   elementwise kernel's work on a value, and kernels that find a value's
   channel, pixel or image from its index divide for every value
   (kernels/batchnorm.h, conv.h, conv_implicit.h). With l = ceil(log2 d) and
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

static __global__ void mgpu__fill_kernel(mgpu__fill_args f) {
    MGPU__GRID_STRIDE_LOOP(i, f.n) f.y[i] = mgpu__fill_value(&f, i);
}
static void mgpu__fill_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__fill_args *f = (const mgpu__fill_args *)args;
    mgpu__fill_kernel<<<mgpu__grid_for(f->n, 256), 256, 0, (cudaStream_t)ex->stream>>>(*f);
    MGPU_CUDA_CHECK_LAUNCH();
}

static __global__ void mgpu__axpby_kernel(mgpu__axpby_args p) {
    MGPU__GRID_STRIDE_LOOP(i, p.n) p.y[i] = p.a * p.y[i] + p.b * p.x[i];
}
static void mgpu__axpby_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__axpby_args *p = (const mgpu__axpby_args *)args;
    mgpu__axpby_kernel<<<mgpu__grid_for(p->n, 256), 256, 0, (cudaStream_t)ex->stream>>>(*p);
    MGPU_CUDA_CHECK_LAUNCH();
}
#endif
