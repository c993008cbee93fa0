/* kernels/adam.h: Adam and AdamW updates (PyTorch's torch.optim.Adam and
   torch.optim.AdamW, without amsgrad).

   defines: mgpu__adam_args, mgpu__adam_update, mgpu__adam_cpu, mgpu__adam_cuda

   At step t (1, 2, ...), for a parameter p with gradient g, and its two
   moments m and v (zero before the first step):
       AdamW only:  p = p (1 - lr weight_decay)          (decoupled decay)
       Adam only:   g = g + weight_decay p               (L2 in the gradient)
       m = m + (1 - beta1) (g - m)                       (torch's lerp)
       v = beta2 v + (1 - beta2) g^2
       p = p - (lr / (1 - beta1^t)) m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
   in that order and with those groupings, as PyTorch's single-tensor
   path computes them, so that a fixture's parameters agree to float32's
   rounding. The numbers that do not change within a step (1 - beta1,
   1 - beta2, AdamW's factor, the step size and the square root of the
   second bias correction) are computed on the host in double and passed
   as floats, as PyTorch computes them in Python floats (double) before
   its float32 tensor operations take them.

   Like SGD (kernels/sgd.h) it is elementwise and bound by memory: it
   reads p, g, m and v and writes p, m and v, 28 bytes a value, and takes
   up to MGPU__LIST_MAX tensors a launch through sgd.h's tensor list. */
#ifndef MGPU_KERNELS_ADAM_H
#define MGPU_KERNELS_ADAM_H
#include "common.h"
#include "sgd.h"

typedef struct {
    float *param[MGPU__LIST_MAX];
    const float *grad[MGPU__LIST_MAX];
    float *m[MGPU__LIST_MAX], *v[MGPU__LIST_MAX];
    mgpu__tensor_list list;
    float one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay;
    float decay;                /* AdamW: 1 - lr weight_decay; Adam: 1 */
    float step_size;            /* lr / (1 - beta1^t) */
    float correction2_sqrt;     /* sqrt(1 - beta2^t) */
    int decoupled;              /* AdamW */
} mgpu__adam_args;

/* The updated parameter, given its gradient; its moments updated in place. */
static MGPU__HOSTDEVICE inline float mgpu__adam_update(const mgpu__adam_args *a, float param, float grad, float *m,
                                                       float *v) {
    if (a->decoupled) param = param * a->decay;
    else grad = grad + a->weight_decay * param;
    *m = *m + a->one_minus_beta1 * (grad - *m);
    *v = *v * a->beta2 + a->one_minus_beta2 * grad * grad;
    float denom = sqrtf(*v) / a->correction2_sqrt + a->eps;
    return param - a->step_size * (*m / denom);
}

static void mgpu__adam_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__adam_args *a = (const mgpu__adam_args *)args;
    for (int t = 0; t < a->list.count; t++) {
        float *param = a->param[t], *m = a->m[t], *v = a->v[t];
        const float *grad = a->grad[t];
        MGPU__CPU_PARALLEL_FOR(a->list.n[t])
        for (size_t i = 0; i < a->list.n[t]; i++) param[i] = mgpu__adam_update(a, param[i], grad[i], &m[i], &v[i]);
    }
}

#if MGPU_CUDA
struct mgpu__adam_values {
    const mgpu__adam_args *a;
    __device__ int tensors(int t, const void **out) const {
        out[0] = a->param[t], out[1] = a->grad[t], out[2] = a->m[t], out[3] = a->v[t];
        return 4;
    }
    template <int V> __device__ void at(int t, size_t i) const {
        float param[V], grad[V], m[V], v[V];
        mgpu__load_floats(param, a->param[t] + i);
        mgpu__load_floats(grad, a->grad[t] + i);
        mgpu__load_floats(m, a->m[t] + i);
        mgpu__load_floats(v, a->v[t] + i);
        for (int e = 0; e < V; e++) param[e] = mgpu__adam_update(a, param[e], grad[e], &m[e], &v[e]);
        mgpu__store_floats(a->param[t] + i, param);
        mgpu__store_floats(a->m[t] + i, m);
        mgpu__store_floats(a->v[t] + i, v);
    }
};
static __global__ void mgpu__adam_kernel(mgpu__adam_args a) {
    mgpu__adam_values values = {&a};
    mgpu__list_values(&a.list, values);
}
static void mgpu__adam_cuda(const void *args, const mgpu__exec *ex) {
    mgpu__list_launch(mgpu__adam_kernel, (const mgpu__adam_args *)args, ex);
}
#endif
#endif
