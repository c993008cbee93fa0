/* kernels/elementwise.h: filling tensors and y = a*y + b*x.

   Each operation is an argument struct, a CPU reference that reads like
   the maths, and (under nvcc) a CUDA kernel with a launcher of the same
   signature, void f(const void *args, const mgpu__exec *ex), so the
   library can run either on a device's queue. One thread per element:
   these operations move bytes and do almost no arithmetic, so all that
   matters on a GPU is that a warp touches consecutive addresses. */
#ifndef MGPU_KERNELS_ELEMENTWISE_H
#define MGPU_KERNELS_ELEMENTWISE_H
#include "common.h"


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
    MGPU__CPU_PARALLEL_FOR(f->n)
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
    MGPU__CPU_PARALLEL_FOR(p->n)
    for (size_t i = 0; i < p->n; i++) p->y[i] = p->a * p->y[i] + p->b * p->x[i];
}

#if MGPU_CUDA
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
#endif
