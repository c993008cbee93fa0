/* kernels/conv_cudnn.h: convolutions by cuDNN on GPUs.

   cuDNN (NVIDIA's deep-learning primitives) is what PyTorch's GPU
   convolutions run on. Here its algorithms are candidates beside the
   library's own kernels: for each pass of a convolution, mgpu/convolution.h's trial
   asks cuDNN which of its algorithms can compute it
   (cudnnGetConvolution*Algorithm_v7, which lists every algorithm with a
   status and the workspace it needs), times each one that can like the
   library's kernels, and keeps the fastest (as PyTorch does with
   torch.backends.cudnn.benchmark). Compiled where MGPU_CUDNN is 1 (the
   Makefile sets it when it finds cuDNN); without it this file is empty.

   The three passes, on the tensors as they are (NCHW, weights KCRS):
     forward  y  = conv(x, w) (+ b)   cudnnConvolutionForward (and cudnnAddTensor)
     dx       dx = conv_dx(dy, w)     cudnnConvolutionBackwardData
     dW       dW = conv_dw(x, dy)     cudnnConvolutionBackwardFilter
   Each computes out = alpha * result + beta * out, so adding to dx or
   accumulating dW is beta = 1.

   TF32. The convolution descriptor's math type says which kernels an
   algorithm may use: CUDNN_DEFAULT_MATH lets it round float inputs to TF32
   for the tensor cores (sm_80 and newer), CUDNN_FMA_MATH keeps float32.
   The heuristics answer with the math type each algorithm runs in, and
   the call uses that one.

   The API is cuDNN's "legacy" one: one call per pass. cuDNN 9 marks it
   deprecated beside its graph API, which would say the same in a graph
   of descriptors ten times as long; it is still what a reader of
   PyTorch's older code knows, and it runs the same kernels.

   Handle and workspace: each GPU device's compute queue has its own
   handle, bound to the queue's stream, made at its first cuDNN call
   (mgpu/convolution.h, mgpu__cudnn_ready). The workspace an algorithm needs comes
   from the device's caching allocator, so a step allocates nothing after
   the first.

   defines: mgpu__cudnn_pass, mgpu__cudnn_algorithm,
            mgpu__cudnn_algorithms, mgpu__cudnn_algorithm_name,
            mgpu__cudnn_args, mgpu__conv_cudnn_cuda */
#ifndef MGPU_KERNELS_CONV_CUDNN_H
#define MGPU_KERNELS_CONV_CUDNN_H
#if MGPU_CUDNN
#if !MGPU_CUDA_EMU
#include <cudnn.h>
#endif
#include "conv.h"

/* Every cuDNN call is checked (MGPU_CUDNN_CHECK, in mgpu/core.h): a failure
   stops the program with the call, where it was made, the status's name,
   and the layer whose pass was being enqueued. */

typedef enum { MGPU__CUDNN_Y, MGPU__CUDNN_DX, MGPU__CUDNN_DW, MGPU__CUDNN_PASSES } mgpu__cudnn_pass;

/* One of cuDNN's algorithms for a pass, in the math type it runs in, and
   the workspace it needs. */
typedef struct {
    int algo;  /* a cudnnConvolution{Fwd,BwdData,BwdFilter}Algo_t */
    int math;  /* a cudnnMathType_t */
    size_t workspace;
} mgpu__cudnn_algorithm;

/* The most algorithms a pass has (cuDNN 9: 8 forward, 6 dx, 7 dW). */
#define MGPU__CUDNN_MAX_ALGORITHMS 8
/* The most workspace an algorithm may ask for to be tried: FFT algorithms
   can ask for gigabytes on large images. */
#define MGPU__CUDNN_WORKSPACE_MAX ((size_t)512 << 20)

/* The descriptors of a convolution of geometry g: x [N, C, H, W],
   y [N, K, P, Q], w [K, C, R, S], the bias [1, K, 1, 1], and the
   convolution itself (cuDNN's "cross-correlation" is PyTorch's conv2d). */
typedef struct {
    cudnnTensorDescriptor_t x, y, bias;
    cudnnFilterDescriptor_t w;
    cudnnConvolutionDescriptor_t conv;
} mgpu__cudnn_descriptors;

static void mgpu__cudnn_descriptors_make(mgpu__cudnn_descriptors *d, const mgpu__conv_geom *g, int math) {
    MGPU_CUDNN_CHECK(cudnnCreateTensorDescriptor(&d->x));
    MGPU_CUDNN_CHECK(cudnnCreateTensorDescriptor(&d->y));
    MGPU_CUDNN_CHECK(cudnnCreateTensorDescriptor(&d->bias));
    MGPU_CUDNN_CHECK(cudnnCreateFilterDescriptor(&d->w));
    MGPU_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&d->conv));
    MGPU_CUDNN_CHECK(cudnnSetTensor4dDescriptor(d->x, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, g->n, g->c, g->h, g->w));
    MGPU_CUDNN_CHECK(cudnnSetTensor4dDescriptor(d->y, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, g->n, g->k, g->p, g->q));
    MGPU_CUDNN_CHECK(cudnnSetTensor4dDescriptor(d->bias, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 1, g->k, 1, 1));
    MGPU_CUDNN_CHECK(cudnnSetFilter4dDescriptor(d->w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, g->k, g->c, g->r, g->s));
    MGPU_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(d->conv, g->pad, g->pad, g->stride, g->stride, 1, 1,
                                                     CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    MGPU_CUDNN_CHECK(cudnnSetConvolutionMathType(d->conv, (cudnnMathType_t)math));
}
static void mgpu__cudnn_descriptors_free(mgpu__cudnn_descriptors *d) {
    MGPU_CUDNN_CHECK(cudnnDestroyConvolutionDescriptor(d->conv));
    MGPU_CUDNN_CHECK(cudnnDestroyFilterDescriptor(d->w));
    MGPU_CUDNN_CHECK(cudnnDestroyTensorDescriptor(d->bias));
    MGPU_CUDNN_CHECK(cudnnDestroyTensorDescriptor(d->y));
    MGPU_CUDNN_CHECK(cudnnDestroyTensorDescriptor(d->x));
}

/* An algorithm's name as cuDNN's enumerations spell it, shortened. */
static inline const char *mgpu__cudnn_algorithm_name(mgpu__cudnn_pass pass, int algo) {
    static const char *const forward[] = {"implicit GEMM", "implicit precomputed GEMM", "GEMM", "direct",
                                          "FFT", "tiled FFT", "Winograd", "nonfused Winograd"};
    static const char *const dx[] = {"algorithm 0", "algorithm 1", "FFT", "tiled FFT", "Winograd",
                                     "nonfused Winograd"};
    static const char *const dw[] = {"algorithm 0", "algorithm 1", "FFT", "algorithm 3", "Winograd",
                                     "nonfused Winograd", "tiled FFT"};
    const char *const *names = pass == MGPU__CUDNN_Y ? forward : pass == MGPU__CUDNN_DX ? dx : dw;
    int count = pass == MGPU__CUDNN_Y ? 8 : pass == MGPU__CUDNN_DX ? 6 : 7;
    return algo >= 0 && algo < count ? names[algo] : "?";
}

/* The algorithms that can compute a pass of geometry g, into out (at
   most MGPU__CUDNN_MAX_ALGORITHMS); returns how many. tf32: whether they
   may use TF32 (else float32 alone). Left out: those needing more
   workspace than MGPU__CUDNN_WORKSPACE_MAX, and those whose results may
   change from run to run (their sums add partial results atomically, in
   whatever order they come: dx's algorithm 0, dW's 0 and 3): the
   library's passes repeat bit for bit, which its tests and a replayed
   step rely on. */
static int mgpu__cudnn_algorithms(cudnnHandle_t handle, mgpu__cudnn_pass pass, const mgpu__conv_geom *g, int tf32,
                                  mgpu__cudnn_algorithm *out) {
    mgpu__cudnn_descriptors d;
    int asked = tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
    mgpu__cudnn_descriptors_make(&d, g, asked);
    /* (the three kinds of answer differ only in the algorithm's type) */
    int status[MGPU__CUDNN_MAX_ALGORITHMS], algo[MGPU__CUDNN_MAX_ALGORITHMS], math[MGPU__CUDNN_MAX_ALGORITHMS];
    int repeats[MGPU__CUDNN_MAX_ALGORITHMS];
    size_t memory[MGPU__CUDNN_MAX_ALGORITHMS];
    int returned = 0;
#define MGPU__CUDNN_ANSWER(i, perf)                                                              \
    (status[i] = (perf).status, algo[i] = (perf).algo, math[i] = (perf).mathType,                \
     repeats[i] = (perf).determinism == CUDNN_DETERMINISTIC, memory[i] = (perf).memory)
    if (pass == MGPU__CUDNN_Y) {
        cudnnConvolutionFwdAlgoPerf_t perf[MGPU__CUDNN_MAX_ALGORITHMS];
        MGPU_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(handle, d.x, d.w, d.conv, d.y,
                                                                MGPU__CUDNN_MAX_ALGORITHMS, &returned, perf));
        for (int i = 0; i < returned; i++)
            MGPU__CUDNN_ANSWER(i, perf[i]);
    } else if (pass == MGPU__CUDNN_DX) {
        cudnnConvolutionBwdDataAlgoPerf_t perf[MGPU__CUDNN_MAX_ALGORITHMS];
        MGPU_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(handle, d.w, d.y, d.conv, d.x,
                                                                     MGPU__CUDNN_MAX_ALGORITHMS, &returned, perf));
        for (int i = 0; i < returned; i++)
            MGPU__CUDNN_ANSWER(i, perf[i]);
    } else {
        cudnnConvolutionBwdFilterAlgoPerf_t perf[MGPU__CUDNN_MAX_ALGORITHMS];
        MGPU_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(handle, d.x, d.y, d.conv, d.w,
                                                                       MGPU__CUDNN_MAX_ALGORITHMS, &returned, perf));
        for (int i = 0; i < returned; i++)
            MGPU__CUDNN_ANSWER(i, perf[i]);
    }
#undef MGPU__CUDNN_ANSWER
    mgpu__cudnn_descriptors_free(&d);
    int count = 0;
    for (int i = 0; i < returned; i++) {
        /* Nonfused Winograd in TF32 at filters larger than 3x3: its
           transforms magnify TF32's rounding of the transformed tiles,
           to errors several times TF32's own (bench/RESULTS.md). */
        int inaccurate = tf32 && math[i] != CUDNN_FMA_MATH && g->r > 3 &&
                         strcmp(mgpu__cudnn_algorithm_name(pass, algo[i]), "nonfused Winograd") == 0;
        if (status[i] == CUDNN_STATUS_SUCCESS && repeats[i] && memory[i] <= MGPU__CUDNN_WORKSPACE_MAX && !inaccurate) {
            /* (without TF32, float32 whatever the answer's math type) */
            mgpu__cudnn_algorithm a = {algo[i], tf32 ? math[i] : CUDNN_FMA_MATH, memory[i]};
            out[count++] = a;
        }
    }
    return count;
}

/* One pass: out = (the pass's result) + beta * out, by the algorithm,
   with its workspace; the forward pass then adds the bias b where given.
   in_a and in_b: the pass's inputs, x and w (forward), w and dy (dx), x
   and dy (dW). refused: NULL, or (a trial) where to leave cuDNN's status
   when it refuses the call, instead of stopping: an algorithm the
   heuristics listed may still refuse a shape (PyTorch, too, moves on to
   the next one then). */
typedef struct {
    float *out;
    const float *in_a, *in_b, *b;
    void *workspace;
    mgpu__conv_geom g;
    mgpu__cudnn_pass pass;
    mgpu__cudnn_algorithm algorithm;
    float beta;
    cudnnStatus_t *refused;
} mgpu__cudnn_args;

static const char *const mgpu__cudnn_calls[MGPU__CUDNN_PASSES] = {
    "cudnnConvolutionForward", "cudnnConvolutionBackwardData", "cudnnConvolutionBackwardFilter"};

static cudnnStatus_t mgpu__cudnn_pass_call(cudnnHandle_t handle, const mgpu__cudnn_args *a,
                                           const mgpu__cudnn_descriptors *d) {
    const float one = 1.0f;
    size_t bytes = a->algorithm.workspace;
    if (a->pass == MGPU__CUDNN_Y) {
        cudnnStatus_t status = cudnnConvolutionForward(handle, &one, d->x, a->in_a, d->w, a->in_b, d->conv,
                                                       (cudnnConvolutionFwdAlgo_t)a->algorithm.algo, a->workspace,
                                                       bytes, &a->beta, d->y, a->out);
        if (status != CUDNN_STATUS_SUCCESS || !a->b) return status;
        return cudnnAddTensor(handle, &one, d->bias, a->b, &one, d->y, a->out);
    }
    if (a->pass == MGPU__CUDNN_DX)
        return cudnnConvolutionBackwardData(handle, &one, d->w, a->in_a, d->y, a->in_b, d->conv,
                                            (cudnnConvolutionBwdDataAlgo_t)a->algorithm.algo, a->workspace, bytes,
                                            &a->beta, d->x, a->out);
    return cudnnConvolutionBackwardFilter(handle, &one, d->x, a->in_a, d->y, a->in_b, d->conv,
                                          (cudnnConvolutionBwdFilterAlgo_t)a->algorithm.algo, a->workspace, bytes,
                                          &a->beta, d->w, a->out);
}

static void mgpu__conv_cudnn_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__cudnn_args *a = (const mgpu__cudnn_args *)args;
    mgpu__cudnn_descriptors d;
    mgpu__cudnn_descriptors_make(&d, &a->g, a->algorithm.math);
    cudnnStatus_t status = mgpu__cudnn_pass_call((cudnnHandle_t)ex->cudnn, a, &d);
    mgpu__cudnn_descriptors_free(&d);
    if (status == CUDNN_STATUS_SUCCESS) return;
    if (a->refused) {
        *a->refused = status;
        return;
    }
    mgpu_fatal_at(__FILE__, __LINE__, "cuDNN: %s (%s, %dx%d, %d -> %d, stride %d, %d x %dx%d) failed: %s%s%s",
                  mgpu__cudnn_calls[a->pass], mgpu__cudnn_algorithm_name(a->pass, a->algorithm.algo), a->g.r,
                  a->g.s, a->g.c, a->g.k, a->g.stride, a->g.n, a->g.h, a->g.w, cudnnGetErrorString(status),
                  MGPU__IN_LAYER(mgpu__layer_enqueuing));
}

#endif /* MGPU_CUDNN */
#endif /* MGPU_KERNELS_CONV_CUDNN_H */
