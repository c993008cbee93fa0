/* kernels/linear.h: the linear layer, and the per-channel bias kernels
   that the convolution and global average pooling share with it.

   The layer, with W stored [in, out] as in the book's LeNet
   (torch.mm(h, W) + b): x [N, in], W [in, out], b [out],
       y = x W + b                                   [N, out]
   Backward, with dy = dL/dy [N, out]:
       dL/dx = dy W^T                                [N, in]
       dL/dW = x^T dy                                [in, out]
       dL/db = the sum of the rows of dy             [out]
   The three products are matmul.h's gemm (the wrappers set the transpose
   flags; see mgpu__gemm_dense); what remains is adding b to every row and
   summing dy over the rows.

   The same two operations, over another axis, are the bias of a
   convolution (one value per channel k of y [N, K, P*Q]) and global
   average pooling (one value per plane of x [N*C, H*W]). So they are
   written once for a tensor viewed as [outer, channels, inner]:
       broadcast:  y[o,k,i] = beta * y[o,k,i] + alpha * v[k]
       sum:        out[k]   = beta * out[k]   + alpha * sum_{o,i} x[o,k,i]
   linear bias: outer = N, inner = 1; conv bias: outer = N, inner = P*Q;
   global pooling: outer = 1, channels = N*C, inner = H*W, alpha = 1/(H*W).
   beta = 1 accumulates (the bias add, and gradients that add up like
   PyTorch's .grad); beta = 0 overwrites without reading the old value (it
   may be uninitialised memory, even NaN).

   CUDA: the broadcast is one thread per element. The sum is one block per
   channel: the block's threads stride over the channel's outer*inner
   values, then add their partial sums in a tree (warp shuffles, then one
   value per warp through shared memory). The order of the additions is
   fixed, so the result is the same from run to run. When inner is large
   (convolutions, pooling) a warp reads runs of consecutive values; the
   linear layer's inner = 1 reads with a stride, but there dy is small.
   Few channels with many values each (the bias gradient of a 64-channel
   convolution at batch 256: 200704 values per channel) would leave most
   of a GPU idle with one block per channel, so the sum is then split:
   `splits` blocks per channel each sum a slab of the outer axis into
   `partials`, and a second kernel adds each channel's partials in order
   (still the same result from run to run). mgpu__chan_sum_splits decides,
   and the wrapper provides the scratch. Many channels with a few values
   each (global average pooling of ResNet-18's last 4x4 maps: 131072
   channels of 16 values) are the other way round: a block per channel
   would be mostly idle threads and the launch mostly the scheduling of
   blocks (many times what its 8 MB need: bench/history.md), so there
   each thread sums whole channels (MGPU__CHAN_SUM_FEW values or fewer),
   one after another. */
#ifndef MGPU_KERNELS_LINEAR_H
#define MGPU_KERNELS_LINEAR_H
#include "common.h"
#include "matmul.h"


static inline int mgpu__max1(int x) { return x > 1 ? x : 1; }

/* Row-major C [m x n] = op(A) op(B) + beta C for dense matrices: op(A) is
   m x k (A is stored k x m when transposed), op(B) is k x n. */
static mgpu__gemm_args mgpu__gemm_dense(int trans_a, int trans_b, int m, int n, int k,
                                        const float *a, const float *b, float *c, float beta,
                                        int tf32) {
    mgpu__gemm_args g;
    memset(&g, 0, sizeof g);
    g.trans_a = trans_a;
    g.trans_b = trans_b;
    g.m = m;
    g.n = n;
    g.k = k;
    g.alpha = 1.0f;
    g.beta = beta;
    g.tf32 = tf32;
    /* BLAS wants every leading dimension >= 1, even for an empty matrix */
    g.a = a;
    g.lda = mgpu__max1(trans_a ? m : k);
    g.b = b;
    g.ldb = mgpu__max1(trans_b ? k : n);
    g.c = c;
    g.ldc = mgpu__max1(n);
    return g;
}

typedef struct {
    float *y;       /* [outer, channels, inner] */
    const float *v; /* [channels] */
    int outer, channels;
    size_t inner;
    float alpha, beta;
} mgpu__chan_broadcast_args;

typedef struct {
    float *out;     /* [channels] */
    const float *x; /* [outer, channels, inner] */
    int outer, channels;
    size_t inner;
    float alpha, beta;
    float *partials; /* GPU, splits > 1: [channels, splits] scratch */
    int splits;      /* blocks per channel on a GPU; 1 on the CPU */
} mgpu__chan_sum_args;

/* Blocks per channel for the GPU's sum: enough blocks in all (512) to
   fill a GPU, but each one summing at least 4096 values, and at most 64
   per channel (and no more than there are slabs of the outer axis). */
static int mgpu__chan_sum_splits(int outer, int channels, size_t inner) {
    size_t count = (size_t)outer * inner, want = (512 + (size_t)channels - 1) / (size_t)channels;
    size_t most = count / 4096;
    if (want > most) want = most;
    if (want > 64) want = 64;
    if (want > (size_t)outer) want = (size_t)outer;
    return want < 1 ? 1 : (int)want;
}

/* Loops over (o, k, i) rather than calling mgpu__chan_broadcast_value per
   element: two integer divisions per element would cost more than the
   addition itself. */
static void mgpu__chan_broadcast_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__chan_broadcast_args *p = (const mgpu__chan_broadcast_args *)args;
    MGPU__CPU_PARALLEL_FOR((size_t)p->outer * p->channels * p->inner)
    for (int o = 0; o < p->outer; o++)
        for (int k = 0; k < p->channels; k++) {
            float *run = p->y + ((size_t)o * p->channels + k) * p->inner, v = p->alpha * p->v[k];
            if (p->beta != 0.0f)
                for (size_t i = 0; i < p->inner; i++) run[i] = p->beta * run[i] + v;
            else
                for (size_t i = 0; i < p->inner; i++) run[i] = v;
        }
}

static void mgpu__chan_sum_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__chan_sum_args *p = (const mgpu__chan_sum_args *)args;
    MGPU__CPU_PARALLEL_FOR((size_t)p->outer * p->channels * p->inner)
    for (int k = 0; k < p->channels; k++) {
        double sum = 0.0; /* runs are added in double: a channel may hold millions of values */
        for (int o = 0; o < p->outer; o++)
            sum += mgpu__sum_run(p->x + ((size_t)o * p->channels + k) * p->inner, p->inner);
        float s = p->alpha * (float)sum;
        p->out[k] = p->beta != 0.0f ? p->beta * p->out[k] + s : s;
    }
}

#if MGPU_CUDA
/* 32-bit index arithmetic: the wrappers keep tensors below 2^31 elements
   (a 64-bit division is a long subroutine on a GPU). */
static __global__ void mgpu__chan_broadcast_kernel(mgpu__chan_broadcast_args p) {
    unsigned inner = (unsigned)p.inner, n = p.outer * p.channels * inner;
    MGPU__GRID_STRIDE_LOOP(i, n) {
        float v = p.alpha * p.v[(unsigned)i / inner % p.channels];
        p.y[i] = p.beta != 0.0f ? p.beta * p.y[i] + v : v;
    }
}
static void mgpu__chan_broadcast_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__chan_broadcast_args *p = (const mgpu__chan_broadcast_args *)args;
    size_t n = (size_t)p->outer * p->channels * p->inner;
    mgpu__chan_broadcast_kernel<<<mgpu__grid_for(n, 256), 256, 0, (cudaStream_t)ex->stream>>>(*p);
    MGPU_CUDA_CHECK_LAUNCH();
}

/* Block (k, s) sums channel k over slab s of the outer axis (the whole
   axis when splits is 1): into out[k] when there is one slab, else into
   partials[k * splits + s] for mgpu__chan_sum_finish_kernel. */
static __global__ void mgpu__chan_sum_kernel(mgpu__chan_sum_args p) {
    unsigned k = blockIdx.x, s = blockIdx.y, inner = (unsigned)p.inner;
    unsigned per = ((unsigned)p.outer + p.splits - 1) / p.splits, first = s * per;
    unsigned last = first + per < (unsigned)p.outer ? first + per : (unsigned)p.outer;
    unsigned count = first < last ? (last - first) * inner : 0;
    float sum = 0.0f;
    for (unsigned j = threadIdx.x; j < count; j += blockDim.x) /* j = (o - first, i) */
        sum += p.x[((size_t)(first + j / inner) * p.channels + k) * inner + j % inner];
    sum = mgpu__block_reduce(sum, mgpu__sum_op(), 0.0f);
    if (threadIdx.x == 0 && p.splits > 1) {
        p.partials[(size_t)k * p.splits + s] = sum;
    } else if (threadIdx.x == 0) {
        float v = p.alpha * sum;
        p.out[k] = p.beta != 0.0f ? p.beta * p.out[k] + v : v;
    }
}
/* Channels of at most MGPU__CHAN_SUM_FEW values: a thread per channel,
   which sums them in order. */
#define MGPU__CHAN_SUM_FEW 64
static __global__ void mgpu__chan_sum_few_kernel(mgpu__chan_sum_args p) {
    unsigned inner = (unsigned)p.inner;
    MGPU__GRID_STRIDE_LOOP(k, (size_t)p.channels) {
        float sum = 0.0f;
        for (int o = 0; o < p.outer; o++) {
            const float *run = p.x + ((size_t)o * p.channels + k) * inner;
            for (unsigned i = 0; i < inner; i++) sum += run[i];
        }
        float v = p.alpha * sum;
        p.out[k] = p.beta != 0.0f ? p.beta * p.out[k] + v : v;
    }
}
/* When the sum is split: each channel's partials, added in order. */
static __global__ void mgpu__chan_sum_finish_kernel(mgpu__chan_sum_args p) {
    MGPU__GRID_STRIDE_LOOP(k, (size_t)p.channels) {
        float sum = 0.0f;
        for (int s = 0; s < p.splits; s++) sum += p.partials[k * p.splits + s];
        float v = p.alpha * sum;
        p.out[k] = p.beta != 0.0f ? p.beta * p.out[k] + v : v;
    }
}
static void mgpu__chan_sum_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__chan_sum_args *p = (const mgpu__chan_sum_args *)args;
    if (p->channels == 0) return;
    cudaStream_t stream = (cudaStream_t)ex->stream;
    if ((size_t)p->outer * p->inner <= MGPU__CHAN_SUM_FEW) {
        mgpu__chan_sum_few_kernel<<<mgpu__grid_for((size_t)p->channels, 256), 256, 0, stream>>>(*p);
        MGPU_CUDA_CHECK_LAUNCH();
        return;
    }
    /* A block no wider than the work */
    size_t count = (size_t)p->outer * p->inner / (size_t)p->splits;
    unsigned block = count >= 256 ? 256 : count > 32 ? 128 : 32;
    mgpu__chan_sum_kernel<<<dim3((unsigned)p->channels, (unsigned)p->splits), block, 0, stream>>>(*p);
    MGPU_CUDA_CHECK_LAUNCH();
    if (p->splits > 1) {
        mgpu__chan_sum_finish_kernel<<<mgpu__grid_for((size_t)p->channels, 256), 256, 0, stream>>>(*p);
        MGPU_CUDA_CHECK_LAUNCH();
    }
}
#endif
#endif
