/* kernels/sgd.h: stochastic gradient descent updates, and zeroing gradients.

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

   Both are elementwise: a few flops for every 8 to 16 bytes moved, so
   memory bandwidth is all that counts, and the CUDA kernels move 16 bytes
   an access (4 values) where the tensors allow (mgpu__list_values). The
   same update of values in registers serves the CPU loop and the CUDA
   kernels.

   Many tensors in one launch. A network's update touches every parameter
   tensor, and zero_grad every gradient: ResNet-18 has 62 of each, half of
   them a batch norm's 64 to 512 values. Launched one by one, that is 124
   launches a step, which take far longer than the work's bytes need
   (bench/history.md). So torch.optim.SGD's update (with PyTorch's
   "foreach" path) and zeroing take a list of up to MGPU__LIST_MAX tensors
   per launch (mgpu__tensor_list): tensor t gets the blocks first_block[t] ..
   first_block[t+1] - 1, each block MGPU__LIST_CHUNK of its values, and a
   block finds its tensor by walking the short list. Kept short, the list
   stays well inside the 4 KB a kernel's arguments may take, and inside a
   CPU queue's task (MGPU__TASK_ARGS). The book's sgd works on one tensor
   at a time, as in the book. */
#ifndef MGPU_KERNELS_SGD_H
#define MGPU_KERNELS_SGD_H
#include "common.h"


#define MGPU__LIST_MAX 16
#define MGPU__LIST_CHUNK 4096
typedef struct {
    int count;
    size_t n[MGPU__LIST_MAX];             /* tensor t holds n[t] values */
    int first_block[MGPU__LIST_MAX + 1];  /* first_block[0] = 0 */
} mgpu__tensor_list;

/* Appends a tensor of n values; returns 1 once the list is full. */
static inline int mgpu__list_add(mgpu__tensor_list *l, size_t n) {
    int t = l->count++;
    l->n[t] = n;
    l->first_block[t + 1] = l->first_block[t] + (int)((n + MGPU__LIST_CHUNK - 1) / MGPU__LIST_CHUNK);
    return l->count == MGPU__LIST_MAX;
}

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
    float *param[MGPU__LIST_MAX];
    const float *grad[MGPU__LIST_MAX];
    float *buf[MGPU__LIST_MAX]; /* the momentum buffers; NULL when momentum is 0 */
    mgpu__tensor_list list;
    float lr, momentum, weight_decay;
    int first_step;
} mgpu__sgd_args;

/* The updated value of a parameter with its gradient, and its momentum
   buffer's value, updated in *buf (buf NULL: momentum 0). */
static MGPU__HOSTDEVICE inline float mgpu__sgd_update(const mgpu__sgd_args *a, float param, float grad,
                                                      float *buf) {
    float g = grad + a->weight_decay * param;
    if (buf) {
        *buf = a->first_step ? g : a->momentum * *buf + g;
        g = *buf;
    }
    return param - a->lr * g;
}

typedef struct {
    float *data[MGPU__LIST_MAX];
    mgpu__tensor_list list;
} mgpu__zero_args;

static void mgpu__sgd_book_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__sgd_book_args *a = (const mgpu__sgd_book_args *)args;
    MGPU__CPU_PARALLEL_FOR(a->n)
    for (size_t i = 0; i < a->n; i++) mgpu__sgd_book_at(a, i);
}
static void mgpu__sgd_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__sgd_args *a = (const mgpu__sgd_args *)args;
    for (int t = 0; t < a->list.count; t++) {
        float *param = a->param[t], *buf = a->buf[t];
        MGPU__CPU_PARALLEL_FOR(a->list.n[t])
        for (size_t i = 0; i < a->list.n[t]; i++)
            param[i] = mgpu__sgd_update(a, param[i], a->grad[t][i], buf ? &buf[i] : NULL);
    }
}
static void mgpu__zero_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__zero_args *a = (const mgpu__zero_args *)args;
    for (int t = 0; t < a->list.count; t++) memset(a->data[t], 0, a->list.n[t] * sizeof(float));
}

#if MGPU_CUDA
static __global__ void mgpu__sgd_book_kernel(mgpu__sgd_book_args a) {
    MGPU__GRID_STRIDE_LOOP(i, a.n) mgpu__sgd_book_at(&a, i);
}
/* This block's tensor t, and its values [*begin, *end). */
static __device__ inline int mgpu__list_block(const mgpu__tensor_list *l, size_t *begin, size_t *end) {
    int t = 0;
    while ((int)blockIdx.x >= l->first_block[t + 1]) t++;
    *begin = (size_t)((int)blockIdx.x - l->first_block[t]) * MGPU__LIST_CHUNK;
    *end = *begin + MGPU__LIST_CHUNK < l->n[t] ? *begin + MGPU__LIST_CHUNK : l->n[t];
    return t;
}
/* Runs values.template at<V>(t, i) over this block's values of its tensor
   t, V values from i on: in vectors of V = 4 (16-byte accesses) where the
   tensors it reads and writes (values.tensors(t, ...)) all start 16-byte
   aligned, then one by one for the last few. (A block's values start at a
   multiple of MGPU__LIST_CHUNK, 4 values, so its vectors are aligned too.)
   One value a thread keeps too few bytes in flight to use memory's full
   rate (bench/history.md). */
template <typename Values>
static __device__ inline void mgpu__list_values(const mgpu__tensor_list *l, Values values) {
    size_t begin, end;
    int t = mgpu__list_block(l, &begin, &end);
    const void *tensors[4];
    int count = values.tensors(t, tensors);
    size_t vectors_end = begin + (mgpu__aligned16(tensors, count) ? (end - begin) / 4 * 4 : 0);
    for (size_t i = begin + 4 * threadIdx.x; i < vectors_end; i += 4 * blockDim.x) values.template at<4>(t, i);
    for (size_t i = vectors_end + threadIdx.x; i < end; i += blockDim.x) values.template at<1>(t, i);
}
struct mgpu__sgd_values {
    const mgpu__sgd_args *a;
    __device__ int tensors(int t, const void **out) const {
        out[0] = a->param[t], out[1] = a->grad[t], out[2] = a->buf[t];
        return 3;
    }
    template <int V> __device__ void at(int t, size_t i) const {
        float param[V], grad[V], buf[V];
        mgpu__load_floats(param, a->param[t] + i);
        mgpu__load_floats(grad, a->grad[t] + i);
        if (a->buf[t]) mgpu__load_floats(buf, a->buf[t] + i);
        for (int e = 0; e < V; e++) param[e] = mgpu__sgd_update(a, param[e], grad[e], a->buf[t] ? &buf[e] : NULL);
        mgpu__store_floats(a->param[t] + i, param);
        if (a->buf[t]) mgpu__store_floats(a->buf[t] + i, buf);
    }
};
struct mgpu__zero_values {
    const mgpu__zero_args *a;
    __device__ int tensors(int t, const void **out) const {
        out[0] = a->data[t];
        return 1;
    }
    template <int V> __device__ void at(int t, size_t i) const {
        float zeros[V] = {};
        mgpu__store_floats(a->data[t] + i, zeros);
    }
};
static __global__ void mgpu__sgd_kernel(mgpu__sgd_args a) {
    mgpu__sgd_values values = {&a};
    mgpu__list_values(&a.list, values);
}
static __global__ void mgpu__zero_kernel(mgpu__zero_args a) {
    mgpu__zero_values values = {&a};
    mgpu__list_values(&a.list, values);
}
static void mgpu__sgd_book_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__sgd_book_args *a = (const mgpu__sgd_book_args *)args;
    mgpu__sgd_book_kernel<<<mgpu__grid_for(a->n, 256), 256, 0, (cudaStream_t)ex->stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
}
/* A list kernel on the list of its arguments `a`: the blocks the list
   asks for (none when every tensor is empty). */
template <typename Args>
static void mgpu__list_launch(void (*kernel)(Args), const Args *a, const mgpu__exec *ex) {
    int blocks = a->list.first_block[a->list.count];
    if (blocks == 0) return;
    kernel<<<blocks, 256, 0, (cudaStream_t)ex->stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
}
static void mgpu__sgd_cuda(const void *args, const mgpu__exec *ex) {
    mgpu__list_launch(mgpu__sgd_kernel, (const mgpu__sgd_args *)args, ex);
}
static void mgpu__zero_cuda(const void *args, const mgpu__exec *ex) {
    mgpu__list_launch(mgpu__zero_kernel, (const mgpu__zero_args *)args, ex);
}
#endif
#endif
