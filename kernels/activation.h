/* kernels/activation.h: ReLU and the residual sum.

   ReLU, forward and backward:
       y = max(x, 0)
       dL/dx = dL/dy * [x > 0]
   The mask [x > 0] equals [y > 0] (y is x where x is positive, 0 elsewhere),
   so the backward pass may be given either the input or the output of the
   forward pass: keeping y alone lets a network overwrite x in place. At
   x = 0 exactly, ReLU has no derivative; like PyTorch we take 0.

   The residual sum of a ResNet block:
       y = a + b
       dL/da = dL/dy,  dL/db = dL/dy
   Its backward pass is the identity on both branches, so it needs no
   kernel: the caller hands the same dy to both branches (adding it, with
   mgpu_add_, to whatever gradient a branch has already received).
   A ResNet block ends with ReLU(a + b); fused, that is one pass over
   memory instead of two (the sum is never written), and its backward is
   ReLU's, masked by the block's output.

   As in elementwise.h, the value of each output element is a small
   function of its index, shared by the CPU loop and the CUDA grid-stride
   loop (one thread per element, consecutive threads on consecutive
   addresses, so every warp reads and writes whole cache lines). The output
   may be the same memory as an input: element i reads only element i. */
#ifndef MGPU_KERNELS_ACTIVATION_H
#define MGPU_KERNELS_ACTIVATION_H
#include "common.h"


typedef struct {
    float *y;
    const float *x;
    size_t n;
} mgpu__relu_args;

typedef struct {
    float *dx;
    const float *dy;
    const float *mask; /* the forward input x or output y: only its sign is used */
    size_t n;
} mgpu__relu_backward_args;

typedef struct {
    float *y;
    const float *a, *b;
    size_t n;
    int relu; /* y = max(a + b, 0) */
} mgpu__add_args;

static MGPU__HOSTDEVICE inline float mgpu__relu_value(const mgpu__relu_args *p, size_t i) {
    return p->x[i] > 0.0f ? p->x[i] : 0.0f;
}
static MGPU__HOSTDEVICE inline float mgpu__relu_grad(float dy, float mask) { return mask > 0.0f ? dy : 0.0f; }
static MGPU__HOSTDEVICE inline float mgpu__relu_backward_value(const mgpu__relu_backward_args *p,
                                                               size_t i) {
    return mgpu__relu_grad(p->dy[i], p->mask[i]);
}
static MGPU__HOSTDEVICE inline float mgpu__add_value(const mgpu__add_args *p, size_t i) {
    float sum = p->a[i] + p->b[i];
    return p->relu && !(sum > 0.0f) ? 0.0f : sum;
}

static void mgpu__relu_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__relu_args *p = (const mgpu__relu_args *)args;
    MGPU__CPU_PARALLEL_FOR(p->n)
    for (size_t i = 0; i < p->n; i++) p->y[i] = mgpu__relu_value(p, i);
}
static void mgpu__relu_backward_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__relu_backward_args *p = (const mgpu__relu_backward_args *)args;
    MGPU__CPU_PARALLEL_FOR(p->n)
    for (size_t i = 0; i < p->n; i++) p->dx[i] = mgpu__relu_backward_value(p, i);
}
static void mgpu__add_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__add_args *p = (const mgpu__add_args *)args;
    MGPU__CPU_PARALLEL_FOR(p->n)
    for (size_t i = 0; i < p->n; i++) p->y[i] = mgpu__add_value(p, i);
}

#if MGPU_CUDA
static __global__ void mgpu__relu_kernel(mgpu__relu_args p) {
    MGPU__GRID_STRIDE_LOOP(i, p.n) p.y[i] = mgpu__relu_value(&p, i);
}
static void mgpu__relu_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__relu_args *p = (const mgpu__relu_args *)args;
    mgpu__relu_kernel<<<mgpu__grid_for(p->n, 256), 256, 0, (cudaStream_t)ex->stream>>>(*p);
    MGPU_CUDA_CHECK_LAUNCH();
}

/* In vectors of V values (16-byte accesses for V = 4): the residual
   blocks' backward runs this over whole activations, and one value a
   thread keeps too few bytes in flight to use memory's full rate
   (bench/history.md). */
template <int V> static __global__ void mgpu__relu_backward_kernel(mgpu__relu_backward_args p) {
    MGPU__GRID_STRIDE_LOOP(i, p.n / V) {
        float dy[V], mask[V], dx[V];
        mgpu__load_floats(dy, p.dy + i * V);
        mgpu__load_floats(mask, p.mask + i * V);
        for (int e = 0; e < V; e++) dx[e] = mgpu__relu_grad(dy[e], mask[e]);
        mgpu__store_floats(p.dx + i * V, dx);
    }
}
static void mgpu__relu_backward_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__relu_backward_args *p = (const mgpu__relu_backward_args *)args;
    const void *tensors[] = {p->dx, p->dy, p->mask};
    cudaStream_t stream = (cudaStream_t)ex->stream;
    if (mgpu__vector_width(p->n, tensors, 3) == 4)
        mgpu__relu_backward_kernel<4><<<mgpu__grid_for(p->n / 4, 256), 256, 0, stream>>>(*p);
    else
        mgpu__relu_backward_kernel<1><<<mgpu__grid_for(p->n, 256), 256, 0, stream>>>(*p);
    MGPU_CUDA_CHECK_LAUNCH();
}

static __global__ void mgpu__add_kernel(mgpu__add_args p) {
    MGPU__GRID_STRIDE_LOOP(i, p.n) p.y[i] = mgpu__add_value(&p, i);
}
static void mgpu__add_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__add_args *p = (const mgpu__add_args *)args;
    mgpu__add_kernel<<<mgpu__grid_for(p->n, 256), 256, 0, (cudaStream_t)ex->stream>>>(*p);
    MGPU_CUDA_CHECK_LAUNCH();
}
#endif
#endif
