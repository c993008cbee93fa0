/* kernels/sgd.h: stochastic gradient descent updates.

   The book's d2l.sgd, for gradients of a loss *summed* over a minibatch:
       param -= lr * grad / batch_size;   grad = 0
   in one pass (the book zeroes the gradient right after the update; doing
   both in one kernel reads and writes each gradient once).

   PyTorch's torch.optim.SGD (no dampening, no Nesterov):
       g = grad + weight_decay * param
       buf = g                       at the first step
       buf = momentum * buf + g      after it
       param -= lr * buf             (param -= lr * g when momentum is 0)
   It leaves the gradient alone; zeroing it is the caller's zero_grad.

   Both are elementwise, one thread per value on a GPU: a few flops for
   every 8 to 16 bytes moved, so memory bandwidth is all that counts. The
   same per-value function serves the CPU loop and the CUDA kernel. */

typedef struct {
    float *param, *grad;
    size_t n;
    float lr, batch_size;
} mgpu__sgd_book_args;

static MGPU__HOSTDEVICE inline void mgpu__sgd_book_at(const mgpu__sgd_book_args *a, size_t i) {
    a->param[i] -= a->lr * a->grad[i] / a->batch_size;
    a->grad[i] = 0.0f;
}

typedef struct {
    float *param;
    const float *grad;
    float *buf; /* the momentum buffer; NULL when momentum is 0 */
    size_t n;
    float lr, momentum, weight_decay;
    int first_step;
} mgpu__sgd_args;

static MGPU__HOSTDEVICE inline void mgpu__sgd_at(const mgpu__sgd_args *a, size_t i) {
    float g = a->grad[i] + a->weight_decay * a->param[i];
    if (a->buf) {
        a->buf[i] = a->first_step ? g : a->momentum * a->buf[i] + g;
        g = a->buf[i];
    }
    a->param[i] -= a->lr * g;
}

static void mgpu__sgd_book_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__sgd_book_args *a = (const mgpu__sgd_book_args *)args;
    for (size_t i = 0; i < a->n; i++) mgpu__sgd_book_at(a, i);
}
static void mgpu__sgd_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__sgd_args *a = (const mgpu__sgd_args *)args;
    for (size_t i = 0; i < a->n; i++) mgpu__sgd_at(a, i);
}

#if MGPU_CUDA
static __global__ void mgpu__sgd_book_kernel(mgpu__sgd_book_args a) {
    MGPU__GRID_STRIDE_LOOP(i, a.n) mgpu__sgd_book_at(&a, i);
}
static __global__ void mgpu__sgd_kernel(mgpu__sgd_args a) {
    MGPU__GRID_STRIDE_LOOP(i, a.n) mgpu__sgd_at(&a, i);
}
static void mgpu__sgd_book_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__sgd_book_args *a = (const mgpu__sgd_book_args *)args;
    mgpu__sgd_book_kernel<<<mgpu__grid_for(a->n, 256), 256, 0, (cudaStream_t)ex->stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
}
static void mgpu__sgd_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__sgd_args *a = (const mgpu__sgd_args *)args;
    mgpu__sgd_kernel<<<mgpu__grid_for(a->n, 256), 256, 0, (cudaStream_t)ex->stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
}
#endif
