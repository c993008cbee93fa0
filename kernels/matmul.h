/* kernels/matmul.h: the matrix product, C = alpha * op(A) op(B) + beta * C.

   Everything in mgpu is row-major. cuBLAS is column-major, and a row-major
   matrix read as column-major is its transpose, so row-major C = A B is
   computed as column-major C^T = B^T A^T: swap the operands and m with n.
   On the CPU, cblas takes the layout as an argument. The convolutions and
   linear layers call mgpu__gemm_cpu / mgpu__gemm_cuda directly from their
   own kernels with the same argument struct. */
#ifndef MGPU_KERNELS_MATMUL_H
#define MGPU_KERNELS_MATMUL_H
#include "common.h"


typedef struct {
    int trans_a, trans_b; /* use A^T / B^T */
    int m, n, k;          /* C is m x n, op(A) m x k, op(B) k x n */
    float alpha, beta;
    const float *a;
    int lda;
    const float *b;
    int ldb;
    float *c;
    int ldc;
    int tf32; /* GPU: may round the inputs to TF32 (mgpu_set_tf32); the CPU ignores it */
} mgpu__gemm_args;

static void mgpu__gemm_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__gemm_args *g = (const mgpu__gemm_args *)args;
    if (g->m == 0 || g->n == 0) return;
    cblas_sgemm(CblasRowMajor, g->trans_a ? CblasTrans : CblasNoTrans,
                g->trans_b ? CblasTrans : CblasNoTrans, g->m, g->n, g->k, g->alpha, g->a, g->lda,
                g->b, g->ldb, g->beta, g->c, g->ldc);
}

#if MGPU_CUDA
static void mgpu__gemm_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__gemm_args *g = (const mgpu__gemm_args *)args;
    if (g->m == 0 || g->n == 0) return;
    /* The compute type says, per call, whether the tensor cores may take
       TF32 inputs; the handle stays in its default (float32) math mode. */
    MGPU_CUBLAS_CHECK(cublasGemmEx((cublasHandle_t)ex->cublas, g->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                   g->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, g->n, g->m, g->k, &g->alpha,
                                   g->b, CUDA_R_32F, g->ldb, g->a, CUDA_R_32F, g->lda, &g->beta,
                                   g->c, CUDA_R_32F, g->ldc,
                                   g->tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT));
}
#endif

/* Runs the product on the queue the caller's kernel is already running on. */
static inline void mgpu__gemm(const mgpu__exec *ex, const mgpu__gemm_args *g) {
#if MGPU_CUDA
    if (ex->on_gpu) {
        mgpu__gemm_cuda(g, ex);
        return;
    }
#endif
    mgpu__gemm_cpu(g, ex);
}
#endif
