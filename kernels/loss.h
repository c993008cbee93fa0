/* kernels/loss.h: softmax cross-entropy, accuracy, and the sum of a vector.

   Cross-entropy of one sample with logits z (one per class) and label k:
       loss = -log softmax(z)_k = logsumexp(z) - z_k
   where logsumexp(z) = max(z) + log sum_j exp(z_j - max(z)): subtracting
   the maximum first keeps exp from overflowing (every term is <= 1 and
   one of them is 1, so the log is finite too).
   Backward, for L = scale * sum over samples of loss (scale 1 for the
   book's .sum(), 1/N for a mean):
       dL/dz_j = scale (softmax(z)_j - [j == k]),  softmax(z)_j = exp(z_j - logsumexp(z))

   Accuracy: the number of rows whose argmax (the first index of the
   largest logit, a NaN counting as largest, like torch.argmax) is the
   label, written to a one-element tensor so that it stays on the
   device's queue until someone asks.

   Labels are floats holding class indices. One that is not an integer in
   [0, classes) is a fatal error on the CPU. A GPU kernel cannot stop the
   program cleanly, so it reports the first such sample it meets in the
   device's mgpu__label_error, in pinned host memory that the GPU writes
   directly (no copy back, so reading it costs nothing). The host reads it
   whenever it waits for the device (mgpu_synchronize, mgpu_item,
   mgpu_to_host, mgpu_event_synchronize, and at the latest when the
   program ends) and stops there with the CPU's line, the device named.
   Until then the sample's loss and gradient row are NaN, and it counts as
   wrong in the accuracy.

   The CUDA version gives each row (sample) to one warp: the lanes stride
   over the classes, and the maximum and the sum of exponentials are warp
   shuffles (kernels/batchnorm.h has the reduction helpers). Ten classes
   leave most lanes idle, but the kernels are tiny next to the network; what
   matters is that there is no shared memory and no synchronisation. */
#ifndef MGPU_KERNELS_LOSS_H
#define MGPU_KERNELS_LOSS_H
#include "common.h"


/* A GPU's report of a bad label, in pinned host memory: op is 0 until a
   kernel meets one. The thread that first claims the device's claim word
   (an atomic in device memory) writes row, classes and label, then op (a
   host pointer to the function's name, carried as a number) last. */
typedef struct mgpu__label_error {
    unsigned long long op;
    int row, classes;
    float label;
} mgpu__label_error;

typedef struct {
    float *out;                  /* losses [N], dlogits [N, classes] or a count [1] */
    const float *logits, *labels;
    int n, classes;
    float scale;                 /* backward: of scale * sum of losses */
    const char *op;              /* the public function, for error messages */
    int first_row;               /* row 0's index in the caller's batch (a device's shard), for messages */
    mgpu__label_error *error;    /* on a GPU: where a bad label is reported (NULL on the CPU) */
    unsigned *claim;             /* on a GPU: 0 until a thread claims the report */
} mgpu__ce_args;

/* Whether value a at index ia beats value b at index ib for the argmax,
   as torch.argmax decides: a NaN beats any number (it is the maximum),
   then the larger value wins, then, of equals (or two NaNs), the smaller
   index. One rule for the CPU and the GPU, which combine in other orders. */
static MGPU__HOSTDEVICE inline int mgpu__argmax_beats(float a, int ia, float b, int ib) {
    if (isnan(a) != isnan(b)) return isnan(a);
    if (!isnan(a) && a != b) return a > b;
    return ia < ib;
}

/* The class a label names, or -1 when it is not an integer in [0, classes). */
static MGPU__HOSTDEVICE inline int mgpu__label_class(float label, int classes) {
    return label >= 0.0f && label < (float)classes && label == floorf(label) ? (int)label : -1;
}

static int mgpu__label_class_cpu(const mgpu__ce_args *a, int row) {
    int k = mgpu__label_class(a->labels[row], a->classes);
    if (k < 0)
        mgpu_fatal("%s: label %g of sample %d is not a class index in [0, %d)", a->op,
                   (double)a->labels[row], a->first_row + row, a->classes);
    return k;
}

static double mgpu__logsumexp_cpu(const float *z, int classes) {
    float max = z[0];
    for (int j = 1; j < classes; j++) max = z[j] > max ? z[j] : max;
    double sum = 0;
    for (int j = 0; j < classes; j++) sum += exp((double)z[j] - max);
    return max + log(sum);
}

static void mgpu__ce_forward_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__ce_args *a = (const mgpu__ce_args *)args;
    for (int row = 0; row < a->n; row++) {
        const float *z = a->logits + (size_t)row * a->classes;
        int k = mgpu__label_class_cpu(a, row);
        a->out[row] = (float)(mgpu__logsumexp_cpu(z, a->classes) - z[k]);
    }
}

static void mgpu__ce_backward_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__ce_args *a = (const mgpu__ce_args *)args;
    for (int row = 0; row < a->n; row++) {
        const float *z = a->logits + (size_t)row * a->classes;
        float *dz = a->out + (size_t)row * a->classes;
        int k = mgpu__label_class_cpu(a, row);
        double lse = mgpu__logsumexp_cpu(z, a->classes);
        for (int j = 0; j < a->classes; j++)
            dz[j] = (float)(a->scale * (exp(z[j] - lse) - (j == k)));
    }
}

static void mgpu__accuracy_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__ce_args *a = (const mgpu__ce_args *)args;
    int correct = 0;
    for (int row = 0; row < a->n; row++) {
        const float *z = a->logits + (size_t)row * a->classes;
        int best = 0;
        for (int j = 1; j < a->classes; j++)
            if (mgpu__argmax_beats(z[j], j, z[best], best)) best = j;
        correct += best == mgpu__label_class_cpu(a, row);
    }
    a->out[0] = (float)correct;
}

/* out[0] = scale * (x[0] + ... + x[n-1]): scale 1 for a sum, 1/n for a mean. */
typedef struct {
    float *out;
    const float *x;
    size_t n;
    double scale;
} mgpu__sum_args;

static void mgpu__sum_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__sum_args *a = (const mgpu__sum_args *)args;
    double sum = 0;
    for (size_t i = 0; i < a->n; i++) sum += a->x[i];
    a->out[0] = (float)(a->scale * sum);
}

#if MGPU_CUDA
/* One warp per row: warp w of the grid takes rows w, w + warps, ...
   The bound is the same for every lane of a warp, so whole warps enter
   and leave the loop together, as the shuffles need. */
static __device__ inline int mgpu__warp_index(void) {
    return (int)((blockIdx.x * blockDim.x + threadIdx.x) / 32);
}
static __device__ inline int mgpu__warp_count(void) { return (int)(gridDim.x * blockDim.x / 32); }
static unsigned mgpu__grid_for_rows(int n) { return mgpu__grid_for((size_t)n * 32, 256); }

/* logsumexp of a row of `classes` values, in every lane of the warp. */
static __device__ float mgpu__warp_logsumexp(const float *z, int classes, int lane) {
    float max = -INFINITY;
    for (int j = lane; j < classes; j += 32) max = fmaxf(max, z[j]);
    max = mgpu__warp_allreduce(max, mgpu__max_op());
    float sum = 0;
    for (int j = lane; j < classes; j += 32) sum += expf(z[j] - max);
    return max + logf(mgpu__warp_allreduce(sum, mgpu__sum_op()));
}

/* The class of row's label; lane 0 reports a bad one in a.error
   (mgpu__label_error, top of the file), if no thread has yet. */
static __device__ int mgpu__label_class_gpu(const mgpu__ce_args &a, int row, int lane) {
    int k = mgpu__label_class(a.labels[row], a.classes);
    if (k < 0 && lane == 0 && atomicCAS(a.claim, 0u, 1u) == 0u) {
        a.error->row = a.first_row + row;
        a.error->classes = a.classes;
        a.error->label = a.labels[row];
        __threadfence_system(); /* (the fields reach the host before op says they are there) */
        a.error->op = (unsigned long long)(uintptr_t)a.op;
    }
    return k;
}

static __global__ void mgpu__ce_forward_kernel(mgpu__ce_args a) {
    int lane = threadIdx.x % 32;
    for (int row = mgpu__warp_index(); row < a.n; row += mgpu__warp_count()) {
        const float *z = a.logits + (size_t)row * a.classes;
        int k = mgpu__label_class_gpu(a, row, lane);
        float lse = mgpu__warp_logsumexp(z, a.classes, lane);
        if (lane == 0) a.out[row] = k < 0 ? NAN : lse - z[k];
    }
}

static __global__ void mgpu__ce_backward_kernel(mgpu__ce_args a) {
    int lane = threadIdx.x % 32;
    for (int row = mgpu__warp_index(); row < a.n; row += mgpu__warp_count()) {
        const float *z = a.logits + (size_t)row * a.classes;
        float *dz = a.out + (size_t)row * a.classes;
        int k = mgpu__label_class_gpu(a, row, lane);
        float lse = mgpu__warp_logsumexp(z, a.classes, lane);
        for (int j = lane; j < a.classes; j += 32)
            dz[j] = k < 0 ? NAN : a.scale * (expf(z[j] - lse) - (j == k ? 1.0f : 0.0f));
    }
}

/* mgpu__argmax_beats decides (NaN first, then the larger value, then the smaller index). */
typedef struct { float value; int index; } mgpu__argmax;
static __device__ inline mgpu__argmax mgpu__shfl_xor(mgpu__argmax v, int mask) {
    v.value = __shfl_xor_sync(0xffffffffu, v.value, mask);
    v.index = __shfl_xor_sync(0xffffffffu, v.index, mask);
    return v;
}
struct mgpu__argmax_op {
    __device__ mgpu__argmax operator()(mgpu__argmax x, mgpu__argmax y) const {
        return mgpu__argmax_beats(x.value, x.index, y.value, y.index) ? x : y;
    }
};

static __global__ void mgpu__accuracy_kernel(mgpu__ce_args a) {
    int lane = threadIdx.x % 32;
    for (int row = mgpu__warp_index(); row < a.n; row += mgpu__warp_count()) {
        const float *z = a.logits + (size_t)row * a.classes;
        /* Each lane starts from its first class (lanes past the last class
           from nothing) and keeps the first of its largest. */
        mgpu__argmax best = {-INFINITY, 0x7fffffff};
        for (int j = lane; j < a.classes; j += 32) {
            if (j == lane || mgpu__argmax_beats(z[j], j, best.value, best.index)) {
                best.value = z[j];
                best.index = j;
            }
        }
        best = mgpu__warp_allreduce(best, mgpu__argmax_op());
        /* Counts are small integers: float atomics add them exactly. */
        int k = mgpu__label_class_gpu(a, row, lane);
        if (lane == 0 && best.index == k) atomicAdd(a.out, 1.0f);
    }
}

static void mgpu__ce_forward_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__ce_args *a = (const mgpu__ce_args *)args;
    mgpu__ce_forward_kernel<<<mgpu__grid_for_rows(a->n), 256, 0, (cudaStream_t)ex->stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
}
static void mgpu__ce_backward_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__ce_args *a = (const mgpu__ce_args *)args;
    mgpu__ce_backward_kernel<<<mgpu__grid_for_rows(a->n), 256, 0, (cudaStream_t)ex->stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
}
static void mgpu__accuracy_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__ce_args *a = (const mgpu__ce_args *)args;
    cudaStream_t stream = (cudaStream_t)ex->stream;
    MGPU_CUDA_CHECK(cudaMemsetAsync(a->out, 0, sizeof(float), stream));
    mgpu__accuracy_kernel<<<mgpu__grid_for_rows(a->n), 256, 0, stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
}

/* One block of 1024 threads, in double: this sum is for reporting (a
   loss, a count), so a vector of a few thousand values; one block is
   plenty, the result does not depend on how many blocks a GPU has, and
   double makes it agree with the CPU's. */
static __global__ void mgpu__sum_kernel(mgpu__sum_args a) {
    double sum = 0;
    for (size_t i = threadIdx.x; i < a.n; i += blockDim.x) sum += a.x[i];
    sum = mgpu__block_reduce(sum, mgpu__sum_op(), 0.0);
    if (threadIdx.x == 0) a.out[0] = (float)(a.scale * sum);
}
static void mgpu__sum_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__sum_args *a = (const mgpu__sum_args *)args;
    mgpu__sum_kernel<<<1, 1024, 0, (cudaStream_t)ex->stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
}
#endif
#endif
