/* kernels/pool.h: average pooling.

   k x k average pooling with stride k (the LeNet's is k = 2): x [N, C, H, W]
   -> y [N, C, H/k, W/k], sizes rounded down like PyTorch's avg_pool2d (a
   9x9 map pools to 4x4; the last row and column are not seen):
       y[n,c,p,q] = (1/k^2) sum_{i,j < k} x[n, c, p*k + i, q*k + j]
   Backward: each input pixel is in at most one window (the stride equals
   the window), and counts 1/k^2 in it:
       dL/dx[n,c,h,w] = dL/dy[n, c, h/k, w/k] / k^2,  or 0 for the pixels
                        in the rounded-off last rows and columns.
   Every image plane is pooled alone, so the kernels see x as [N*C, H, W].

   Global average pooling, x [N, C, H, W] -> y [N, C], is the mean of each
   plane, and its backward pass spreads dL/dy[n,c] evenly, / (H*W), over
   the plane. Those are the per-channel sum and broadcast of linear.h with
   the planes as channels (outer = 1, channels = N*C, inner = H*W), so they
   have no kernel here.

   CPU: loops over planes and rows, so the innermost loop runs along an
   image row. CUDA: one thread per output element (of y forward, of dx
   backward) computes it from its index, so consecutive threads write
   consecutive addresses; the backward pass gathers from dy and writes
   every dx element, so dx needs no zeroing and no atomics. Both sides add
   the k*k values of a window in the same order and divide the same way,
   so they agree to the last bit. */
#ifndef MGPU_KERNELS_POOL_H
#define MGPU_KERNELS_POOL_H
#include "common.h"


typedef struct {
    float *y;       /* [planes, h/k, w/k] */
    const float *x; /* [planes, h, w] */
    size_t n;       /* elements of y */
    int h, w, k;
} mgpu__avg_pool_args;

typedef struct {
    float *dx;       /* [planes, h, w] */
    const float *dy; /* [planes, h/k, w/k] */
    size_t n;        /* elements of dx */
    int h, w, k;
} mgpu__avg_pool_backward_args;

/* One output row of the forward pass from the k image rows under it, and
   one image row of the backward pass from its output row. The kernels
   call them with k as the literal 2 where k is 2 (LeNet's): inlined, the
   compiler then knows the stride and puts the loops over q in vector
   lanes; with k known only at run time it cannot. */
static inline __attribute__((always_inline)) void mgpu__avg_pool_row(float *out, const float *rows, int W, int Q,
                                                                      int k) {
    for (int q = 0; q < Q; q++) out[q] = 0.0f;
    for (int di = 0; di < k; di++) /* (each window's values added in the order the CUDA kernel adds them) */
        for (int dj = 0; dj < k; dj++)
            for (int q = 0; q < Q; q++) out[q] += rows[(size_t)di * W + q * k + dj];
    for (int q = 0; q < Q; q++) out[q] /= (float)(k * k);
}
static inline __attribute__((always_inline)) void mgpu__avg_pool_backward_row(float *row, const float *g, int Q,
                                                                               int k) {
    for (int q = 0; q < Q; q++)
        for (int dj = 0; dj < k; dj++) row[q * k + dj] = g[q] / (float)(k * k);
}
static void mgpu__avg_pool_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__avg_pool_args *a = (const mgpu__avg_pool_args *)args;
    const int k = a->k, H = a->h, W = a->w, P = H / k, Q = W / k;
    size_t planes = a->n / ((size_t)P * Q);
    MGPU__CPU_PARALLEL_FOR(a->n * k * k)
    for (size_t plane = 0; plane < planes; plane++)
        for (int p = 0; p < P; p++) {
            /* the k image rows under the windows of output row p */
            const float *rows = a->x + (plane * H + (size_t)p * k) * W;
            float *out = a->y + (plane * P + p) * Q;
            if (k == 2) mgpu__avg_pool_row(out, rows, W, Q, 2);
            else mgpu__avg_pool_row(out, rows, W, Q, k);
        }
}

static void mgpu__avg_pool_backward_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__avg_pool_backward_args *a = (const mgpu__avg_pool_backward_args *)args;
    const int k = a->k, H = a->h, W = a->w, P = H / k, Q = W / k;
    size_t planes = a->n / ((size_t)H * W);
    MGPU__CPU_PARALLEL_FOR(a->n)
    for (size_t plane = 0; plane < planes; plane++)
        for (int h = 0; h < H; h++) {
            float *row = a->dx + (plane * H + h) * W;
            int w = 0;
            if (h / k < P) {
                const float *g = a->dy + (plane * P + h / k) * Q;
                if (k == 2) mgpu__avg_pool_backward_row(row, g, Q, 2);
                else mgpu__avg_pool_backward_row(row, g, Q, k);
                w = Q * k;
            }
            for (; w < W; w++) row[w] = 0.0f; /* rounded off: in no window */
        }
}

#if MGPU_CUDA
/* 32-bit index arithmetic: the wrappers keep tensors below 2^31 elements
   (a 64-bit division is a long subroutine on a GPU). */
static __device__ inline float mgpu__avg_pool_value(const mgpu__avg_pool_args *a, unsigned i) {
    int k = a->k;
    unsigned P = a->h / k, Q = a->w / k;
    unsigned q = i % Q, plane_p = i / Q, p = plane_p % P, plane = plane_p / P;
    const float *window = a->x + ((size_t)plane * a->h + p * k) * a->w + q * k;
    float sum = 0.0f;
    for (int di = 0; di < k; di++)
        for (int dj = 0; dj < k; dj++) sum += window[di * a->w + dj];
    return sum / (float)(k * k);
}

static __device__ inline float mgpu__avg_pool_backward_value(const mgpu__avg_pool_backward_args *a,
                                                             unsigned i) {
    int k = a->k;
    unsigned P = a->h / k, Q = a->w / k;
    unsigned w = i % a->w, plane_h = i / a->w, h = plane_h % a->h, plane = plane_h / a->h;
    unsigned p = h / k, q = w / k;
    if (p >= P || q >= Q) return 0.0f; /* rounded off: in no window */
    return a->dy[((size_t)plane * P + p) * Q + q] / (float)(k * k);
}

static __global__ void mgpu__avg_pool_kernel(mgpu__avg_pool_args a) {
    MGPU__GRID_STRIDE_LOOP(i, a.n) a.y[i] = mgpu__avg_pool_value(&a, (unsigned)i);
}
static void mgpu__avg_pool_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__avg_pool_args *a = (const mgpu__avg_pool_args *)args;
    mgpu__avg_pool_kernel<<<mgpu__grid_for(a->n, 256), 256, 0, (cudaStream_t)ex->stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
}

static __global__ void mgpu__avg_pool_backward_kernel(mgpu__avg_pool_backward_args a) {
    MGPU__GRID_STRIDE_LOOP(i, a.n) a.dx[i] = mgpu__avg_pool_backward_value(&a, (unsigned)i);
}
static void mgpu__avg_pool_backward_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__avg_pool_backward_args *a = (const mgpu__avg_pool_backward_args *)args;
    mgpu__avg_pool_backward_kernel<<<mgpu__grid_for(a->n, 256), 256, 0, (cudaStream_t)ex->stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
}
#endif
#endif
