/* bench/matmul.c: does mgpu_matmul run as fast as the BLAS under it?

   make bench/matmul && ./bench/matmul [--size N] [--reps N] [--trials N] [--cpu]

   mgpu_matmul computes nothing itself: it checks the shapes and enqueues
   cuBLAS's sgemm on the device's stream (OpenBLAS's sgemm on a CPU
   device's worker thread). What it adds is the queue, and this measures
   what the queue costs, against the same BLAS called directly:
     mgpu    `reps` calls of mgpu_matmul(C, A, B), then mgpu_synchronize;
     direct  `reps` calls of cublasSgemm with this program's own cuBLAS
             handle on its own stream, then cudaStreamSynchronize; on the
             CPU, cblas_sgemm on this thread (with the same number of
             OpenBLAS threads as the device).
   Both multiply the same N x N matrices (N = 4000 on a GPU, as the book's
   chapter 1; 1000 on the CPU), in float32 (cuBLAS's default math mode, no
   TF32, in both).

   A product is N^3 multiply-adds, 2 N^3 FLOPs, so
       rate = 2 N^3 reps / seconds.
   After an untimed warm-up of each way, each of `trials` trials times the
   two ways one after the other (a slow moment of a busy machine then hits
   both alike), and the fastest trial of each way is kept.
       ratio = mgpu seconds / direct seconds      target: at most 1.05
   The two must also compute the same C; the largest difference is shown.
   The last line is for bench/run.sh:
       RESULT matmul device=cuda:0 size=4000 reps=50 mgpu_gflops=... direct_gflops=... ratio=... */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"

/* The BLAS called directly: its own cuBLAS handle and stream on a GPU,
   cblas on this thread on the CPU. */
typedef struct {
    int on_gpu;
#if MGPU_CUDA
    cublasHandle_t handle;
    cudaStream_t stream;
#endif
} direct_blas;

static void direct_init(direct_blas *d, mgpu_device *dev) {
    d->on_gpu = mgpu_device_is_gpu(dev);
#if MGPU_CUDA
    if (d->on_gpu) {
        MGPU_CUDA_CHECK(cudaSetDevice(mgpu_device_gpu_index(dev)));
        MGPU_CUDA_CHECK(cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking));
        MGPU_CUBLAS_CHECK(cublasCreate(&d->handle));
        MGPU_CUBLAS_CHECK(cublasSetStream(d->handle, d->stream));
    }
#endif
}

static void direct_free(direct_blas *d) {
#if MGPU_CUDA
    if (d->on_gpu) {
        MGPU_CUBLAS_CHECK(cublasDestroy(d->handle));
        MGPU_CUDA_CHECK(cudaStreamDestroy(d->stream));
    }
#else
    (void)d;
#endif
}

/* `reps` row-major products c = a b of n x n matrices, waited for. */
static void direct_products(direct_blas *d, float *c, const float *a, const float *b, int n, int reps) {
#if MGPU_CUDA
    if (d->on_gpu) {
        const float one = 1.0f, zero = 0.0f;
        /* cuBLAS is column-major: compute C^T = B^T A^T, the operands
           swapped, as kernels/matmul.h does */
        for (int r = 0; r < reps; r++)
            MGPU_CUBLAS_CHECK(cublasSgemm(d->handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, b, n, a, n,
                                          &zero, c, n));
        MGPU_CUDA_CHECK(cudaStreamSynchronize(d->stream));
        return;
    }
#endif
    (void)d;
    for (int r = 0; r < reps; r++)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
}

static void mgpu_products(mgpu_tensor *c, const mgpu_tensor *a, const mgpu_tensor *b, int reps) {
    for (int r = 0; r < reps; r++) mgpu_matmul(c, a, b);
    mgpu_synchronize(c->device);
}

static double largest_difference(const mgpu_tensor *x, const mgpu_tensor *y) {
    float *hx = (float *)malloc(x->numel * sizeof(float)), *hy = (float *)malloc(y->numel * sizeof(float));
    MGPU_REQUIRE(hx && hy, "out of host memory for two %zu-float matrices", x->numel);
    mgpu_to_host(x, hx);
    mgpu_to_host(y, hy);
    double most = 0;
    for (size_t i = 0; i < x->numel; i++) most = fmax(most, fabs((double)hx[i] - hy[i]));
    free(hx);
    free(hy);
    return most;
}

int main(int argc, char **argv) {
    mgpu_options o;
    memset(&o, 0, sizeof o);
    int size = 0, reps = 50, trials = 5;
    const mgpu_flag extra[] = {
        {"--size", 'i', &size, "matrix size N (default 4000 on a GPU, 1000 on the CPU)"},
        {"--reps", 'i', &reps, "products per trial"},
        {"--trials", 'i', &trials, "timed trials of each way; the fastest is kept"},
    };
    mgpu_options_parse(&o, argc, argv,
                       "bench/matmul: mgpu_matmul against cuBLAS (or cblas) called directly", extra, 3);
    mgpu_device *dev;
    mgpu_devices(1, !o.cpu, &dev); /* on the CPU: one device, all the cores */
    int on_gpu = mgpu_device_is_gpu(dev);
    if (!size) size = on_gpu ? 4000 : 1000;
    const char *direct_name = on_gpu ? "cublasSgemm, direct" : "cblas_sgemm, direct";

    mgpu_manual_seed(1);
    mgpu_shape s = mgpu_shape2(size, size);
    mgpu_tensor *a = mgpu_rand(dev, s), *b = mgpu_rand(dev, s);
    mgpu_tensor *c_mgpu = mgpu_empty(dev, s), *c_direct = mgpu_empty(dev, s);
    mgpu_synchronize(dev);
    direct_blas direct;
    direct_init(&direct, dev);

    mgpu_products(c_mgpu, a, b, 1); /* warm-up: library start-up, clocks */
    direct_products(&direct, c_direct->data, a->data, b->data, size, 1);
    double best_mgpu = 1e30, best_direct = 1e30;
    for (int t = 0; t < trials; t++) {
        double t0 = mgpu_now();
        mgpu_products(c_mgpu, a, b, reps);
        best_mgpu = fmin(best_mgpu, mgpu_now() - t0);
        t0 = mgpu_now();
        direct_products(&direct, c_direct->data, a->data, b->data, size, reps);
        best_direct = fmin(best_direct, mgpu_now() - t0);
    }

    double flop = 2.0 * size * (double)size * size * reps;
    double unit = on_gpu ? 1e12 : 1e9;
    const char *unit_name = on_gpu ? "TFLOP/s" : "GFLOP/s";
    printf("matmul: C = A B, %dx%d, %d products per trial, fastest of %d trials, on %s\n", size, size,
           reps, trials, mgpu_device_name(dev));
    printf("  %-22s %9.4f sec  %8.2f %s\n", "mgpu_matmul", best_mgpu, flop / best_mgpu / unit, unit_name);
    printf("  %-22s %9.4f sec  %8.2f %s\n", direct_name, best_direct, flop / best_direct / unit, unit_name);
    printf("  mgpu / direct: %.3f (target: at most 1.05); largest difference between the two C: %g\n",
           best_mgpu / best_direct, largest_difference(c_mgpu, c_direct));
    printf("RESULT matmul device=%s size=%d reps=%d mgpu_gflops=%.2f direct_gflops=%.2f ratio=%.4f\n",
           mgpu_device_name(dev), size, reps, flop / best_mgpu / 1e9, flop / best_direct / 1e9,
           best_mgpu / best_direct);

    direct_free(&direct);
    mgpu_free(a);
    mgpu_free(b);
    mgpu_free(c_mgpu);
    mgpu_free(c_direct);
    return 0;
}
