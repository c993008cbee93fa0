/* kernels/batchnorm.h: batch normalisation over channels (PyTorch's
   BatchNorm2d), with an optional fused ReLU.

   Forward. x is [N, C, H, W]; channel c is normalised over its m = N*H*W
   values:
       mean_c = (1/m) sum x          var_c = (1/m) sum (x - mean_c)^2  (biased)
       invstd_c = 1 / sqrt(var_c + eps)
       xhat = (x - mean_c) invstd_c           y = gamma_c xhat + beta_c
   and with the fused ReLU, y = max(y, 0). In training mode these are the
   batch's statistics, and the running ones move towards them:
       running_mean = (1 - momentum) running_mean + momentum mean_c
       running_var  = (1 - momentum) running_var  + momentum var_c m/(m-1)
   (the running variance is the unbiased estimate, as in PyTorch). In
   evaluation mode the running statistics take the place of the batch's.
   Training saves mean_c and invstd_c for the backward pass.

   Backward (training mode). Let g = dL/dy, set to 0 where the fused ReLU
   clipped (where gamma xhat + beta <= 0, so y = 0). Every x of a channel
   moves its mean and variance, so dx has two terms more than the
   per-value chain rule:
       dbeta_c  = sum g                 dgamma_c = sum g xhat
       dx = gamma_c invstd_c (g - dbeta_c / m - xhat dgamma_c / m)
   The two sums are the only reductions; the rest is elementwise.
   The residual block's end (below) fuses two steps of the block's
   backward pass into its bn2's: the ReLU's mask, given the block's output
   (mask): g = dy where mask > 0, else 0, the gradient of the sum that bn2
   and the skip path feed; the pass that sums g also writes it (dsum), for
   the skip path, and the pass that writes dx reads it back. And the
   shortcut convolution takes that same g as its output gradient, so its
   bias gradient is dbeta_c's very sum: given dshortcut_bias, the backward
   adds it there too. The block's backward pass so saves the ReLU's own
   pass (g read once less) and the shortcut's bias gradient's (dsum read
   once less). Likewise the bias of a convolution right before batch norm
   has a gradient of exactly 0 (the batch mean cancels it: mgpu/networks.h,
   mgpu__bias_cancelled_by); when the gradients are written rather than
   added (a network's training step, mgpu/net_training.h), given dconv_bias, the
   backward writes that 0 there with its own.

   Why fuse the ReLU: both steps do a few flops per value and are limited
   by memory bandwidth. A separate ReLU would read and write the whole
   activation once more, forward and backward; fused, y is written once.
   The backward pass does not even read y for the ReLU's mask: it reads x
   anyway, and recomputes y's sign from it with the very operations the
   forward used (mgpu__bn_scale_shift and mgpu__bn_affine: fused
   multiply-adds, rounded alike on a CPU and a GPU), so the mask is the
   forward's bit for bit, and y is not read at all (two reads of a whole
   tensor saved).

   The residual block's end, y = max(bn(x) + skip, 0), fuses one step
   more: with `skip` given, the forward adds it before the ReLU, and the
   normalised values are never stored on their own. That saves writing
   them and reading them back for the add (two of the five passes a
   separate add takes over the block's output). The backward of this form
   is the block's (mgpu/networks.h): the ReLU's mask from the block's output gives
   the gradient of the sum, which goes to skip as it is and through this
   file's backward (without fuse_relu) to x.

   Synchronised batch norm (PyTorch's SyncBatchNorm; mgpu/networks.h,
   mgpu_net_sync_batchnorm) takes the statistics over every rank's batch.
   Each pass is then cut in parts (the phase), with a collective between
   them that mgpu/training_ops.h runs:
     forward:  MOMENTS    each channel's (count, mean, sum of squared
                          deviations) over this rank's values; the ranks'
                          triples are all-gathered;
               MERGE      merges them in rank order (Chan et al., in
                          double, so every rank gets the same bits),
                          saves the statistics, moves the running ones;
               NORMALISE  y, from the saved statistics.
     backward: GRAD_SUMS  the sums of g and g xhat over this rank's values
                          (dgamma and dbeta are this rank's sums, as any
                          parameter's gradient: the data-parallel wrapper
                          averages them); the sums are allreduced;
               INPUT_GRAD dx, from the group's sums over its count.
   Every part reuses the kernels below; the whole pass is phase WHOLE.

   The CUDA version. A channel's values are not contiguous (one run of H*W
   values per image), and one block per channel would leave most of a GPU
   idle for ResNet's 64 channels. So each channel is cut into S slices
   (mgpu__bn_splits: about 4096 values each, at most 64) and the work is
   two kernels:
     1. a grid of C x S blocks: each reduces its slice to one partial
        result (warp shuffles, then one value per warp in shared memory),
        and the last of a channel's S blocks to finish merges the S
        partials and writes the channel's results (statistics and running
        statistics forward, dgamma and dbeta backward; "Finishing a
        channel", below);
     2. a grid over the whole tensor writes y, or dx; or, when a network
        asks for it (y_t, dx_t), a tile kernel of kernels/channels_last.h
        writes them channels-last, y beside y or alone and dx instead of
        dx, for the convolution next to this batch norm (mgpu/networks.h says
        when).
   Every kernel here does a few flops per byte it moves, so what decides
   its speed is how few instructions it spends per byte: too many, and the
   GPU cannot issue them as fast as memory delivers the bytes. Two things
   keep them few:
     - Vectors of V = 4 values: when H*W is a multiple of 4 (28x28, 14x14
       and 4x4 planes; not 7x7) and the tensors are 16-byte aligned, a
       thread loads and stores 4 neighbouring values of one plane, so of
       one channel, with one instruction (mgpu__load_floats), and finds
       their channel once. Otherwise V = 1.
     - A vector's channel, (i / (H*W/V)) mod C, and the place of a
       channel's j-th vector, take divisions by numbers fixed for the
       launch: done by multiplying (mgpu__div), as the GPU's integer
       division would cost more than the rest of the work on the vector.

   Variance. The CPU reference takes the textbook two passes (the mean,
   then the squared deviations): each image's run of a channel summed in
   8 float lanes (vector instructions), the runs' sums added in double. The one-pass formula
   E[x^2] - E[x]^2 would read x once, but it subtracts two large, nearly
   equal numbers: with a mean of 1000 and a standard deviation of 1,
   E[x^2] is about 1e6, which float stores only to within 0.06, so the
   variance 1 is lost. The GPU keeps both advantages: each thread loads 16
   values into registers at once and takes the two passes over those (no
   memory traffic, and one division for all 16), giving their (count,
   mean, sum of squared deviations); these triples are then merged, thread
   with thread and slice with slice, by Chan et al.'s formula, which never
   subtracts large numbers either. (Welford's update, the usual way to
   merge one value at a time, costs a division per value: with it this
   kernel would take more instructions a value than the GPU can issue
   while memory delivers 4 bytes; bench/history.md has the counts.) */
#ifndef MGPU_KERNELS_BATCHNORM_H
#define MGPU_KERNELS_BATCHNORM_H
#include "common.h"
#include "activation.h"
#include "channels_last.h"


typedef enum {
    MGPU__BN_WHOLE,     /* a pass on its own */
    MGPU__BN_MOMENTS,   /* the parts of a synchronised forward, */
    MGPU__BN_MERGE,
    MGPU__BN_NORMALISE,
    MGPU__BN_GRAD_SUMS, /* and backward (above) */
    MGPU__BN_INPUT_GRAD
} mgpu__bn_phase;

/* ---------------------------------------------------------------- forward */
typedef struct {
    float *y;                       /* NULL where y_t alone is wanted */
    float *y_t;                     /* y channels-last too (kernels/channels_last.h), or NULL */
    const float *x, *gamma, *beta;
    const float *skip;              /* added before the ReLU, or NULL (see above) */
    float *running_mean, *running_var;
    float *save_mean, *save_invstd; /* written in training mode */
    float *partials;                /* CUDA scratch: [C][S] Welford partials */
    unsigned *done;                 /* CUDA: the device's counters of finished slices, [C] (below) */
    int n, c, hw, splits;           /* x is [n, c, hw]; splits = S */
    int training, fuse_relu;
    float momentum, eps;
    int phase;                      /* mgpu__bn_phase */
    float *moments;                 /* MOMENTS: [C][3] written; MERGE: [ranks][C][3] read */
    int ranks;                      /* MERGE: how many ranks' triples */
} mgpu__bn_forward_args;

/* The statistics that normalise channel c: the batch's (saved by the
   reduction) in training mode, the running ones in evaluation mode. */
static MGPU__HOSTDEVICE inline void mgpu__bn_stats(const mgpu__bn_forward_args *a, int c,
                                                   float *mean, float *invstd) {
    if (a->training) {
        *mean = a->save_mean[c];
        *invstd = a->save_invstd[c];
    } else {
        *mean = a->running_mean[c];
        *invstd = 1.0f / sqrtf(a->running_var[c] + a->eps);
    }
}

/* Batch norm of a channel is an affine map, gamma (x - mean) invstd + beta
   = scale x + shift. Both are computed with explicit fused multiply-adds
   (fmaf: one rounding, the same on a CPU and a GPU, where a compiler may
   otherwise fuse a * b + c on one and not the other), because the backward
   pass recomputes the forward's values from x to find the ReLU's mask and
   must get the very same bits. */
static MGPU__HOSTDEVICE inline void mgpu__bn_scale_shift(float gamma, float beta, float mean,
                                                         float invstd, float *scale, float *shift) {
    *scale = gamma * invstd;
    *shift = fmaf(-mean, *scale, beta);
}
static MGPU__HOSTDEVICE inline float mgpu__bn_affine(float scale, float x, float shift) {
    return fmaf(scale, x, shift);
}
/* The scale and shift of channel c in the forward pass. */
static MGPU__HOSTDEVICE inline void mgpu__bn_forward_affine(const mgpu__bn_forward_args *a, int c,
                                                            float *scale, float *shift) {
    float mean, invstd;
    mgpu__bn_stats(a, c, &mean, &invstd);
    mgpu__bn_scale_shift(a->gamma[c], a->beta[c], mean, invstd, scale, shift);
}
/* y from x (and the skip value, 0 when there is none). */
static MGPU__HOSTDEVICE inline float mgpu__bn_output(const mgpu__bn_forward_args *a, float x, float skip,
                                                     float scale, float shift) {
    float y = mgpu__bn_affine(scale, x, shift) + skip;
    return a->fuse_relu && y < 0.0f ? 0.0f : y;
}

/* Once channel c's batch mean and (biased) variance over m values are
   known: save them for backward and move the running statistics. */
static MGPU__HOSTDEVICE inline void mgpu__bn_finish_stats(const mgpu__bn_forward_args *a, int c,
                                                          double mean, double var, double m) {
    a->save_mean[c] = (float)mean;
    a->save_invstd[c] = (float)(1.0 / sqrt(var + a->eps));
    a->running_mean[c] = (1.0f - a->momentum) * a->running_mean[c] + a->momentum * (float)mean;
    a->running_var[c] =
        (1.0f - a->momentum) * a->running_var[c] + a->momentum * (float)(var * m / (m - 1.0));
}
/* Channel c's count, mean and sum of squared deviations m2 over this
   rank's batch: the statistics (phase WHOLE), or the triple for the other
   ranks (MOMENTS). */
static MGPU__HOSTDEVICE inline void mgpu__bn_channel_done(const mgpu__bn_forward_args *a, int c, double count,
                                                          double mean, double m2) {
    if (a->phase == MGPU__BN_MOMENTS) {
        float *t = a->moments + (size_t)c * 3;
        t[0] = (float)count, t[1] = (float)mean, t[2] = (float)m2;
    } else {
        mgpu__bn_finish_stats(a, c, mean, m2 / count, count);
    }
}
/* MERGE: channel c's triples of every rank, merged in rank order by Chan
   et al.'s formula, then its statistics as above. */
static MGPU__HOSTDEVICE inline void mgpu__bn_merge_channel(const mgpu__bn_forward_args *a, int c) {
    double count = 0, mean = 0, m2 = 0;
    for (int r = 0; r < a->ranks; r++) {
        const float *t = a->moments + ((size_t)r * a->c + c) * 3;
        double more = t[0], delta = t[1] - mean, total = count + more;
        if (more == 0) continue;
        mean += delta * more / total;
        m2 += t[2] + delta * delta * count * more / total;
        count = total;
    }
    mgpu__bn_finish_stats(a, c, mean, m2 / count, count);
}

/* The CPU walks each channel image by image: a channel of one image is
   hw contiguous values, so the inner loops read memory in order, and
   each image's run is summed in float lanes that become vector
   instructions (a single running sum is a chain of dependent
   additions): 8 explicit lanes forward, an OpenMP simd reduction
   backward (mgpu__bn_backward_run_sums says why). The channels are
   shared among the device's threads (MGPU__CPU_PARALLEL_FOR,
   kernels/common.h): each channel's sums stay on one thread, in one
   order. The float lanes take blocks of at most MGPU__BN_CPU_BLOCK
   values, whose sums are added in double: a float sum loses about
   sqrt(count) units of its last place, too many over a whole image of
   270000 values. */
#define MGPU__BN_CPU_BLOCK 512
static float mgpu__squares_run(const float *v, int n, float mean) {
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) lane[j] += (v[i + j] - mean) * (v[i + j] - mean);
    float sum = 0.0f;
    for (; i < n; i++) sum += (v[i] - mean) * (v[i] - mean);
    for (int j = 0; j < 8; j++) sum += lane[j];
    return sum;
}
static void mgpu__bn_forward_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__bn_forward_args *a = (const mgpu__bn_forward_args *)args;
    size_t m = (size_t)a->n * (size_t)a->hw;
    if (a->phase == MGPU__BN_MERGE) {
        for (int c = 0; c < a->c; c++) mgpu__bn_merge_channel(a, c);
        return;
    }
    MGPU__CPU_PARALLEL_FOR(m * a->c)
    for (int c = 0; c < a->c; c++) {
        if (a->training && a->phase != MGPU__BN_NORMALISE) { /* two passes: the mean, then the squared deviations */
            double sum = 0, squares = 0;
            for (int n = 0; n < a->n; n++)
                for (int p = 0; p < a->hw; p += MGPU__BN_CPU_BLOCK)
                    sum += mgpu__sum_run(a->x + ((size_t)n * a->c + c) * a->hw + p,
                                         (size_t)(a->hw - p < MGPU__BN_CPU_BLOCK ? a->hw - p : MGPU__BN_CPU_BLOCK));
            double mean = sum / (double)m;
            for (int n = 0; n < a->n; n++)
                for (int p = 0; p < a->hw; p += MGPU__BN_CPU_BLOCK)
                    squares += mgpu__squares_run(a->x + ((size_t)n * a->c + c) * a->hw + p,
                                                 a->hw - p < MGPU__BN_CPU_BLOCK ? a->hw - p : MGPU__BN_CPU_BLOCK, (float)mean);
            mgpu__bn_channel_done(a, c, (double)m, mean, squares);
            if (a->phase == MGPU__BN_MOMENTS) continue;
        }
        /* after the statistics, so y may be x itself */
        float scale, shift;
        mgpu__bn_forward_affine(a, c, &scale, &shift);
        for (int n = 0; n < a->n; n++) {
            size_t at = ((size_t)n * a->c + c) * a->hw;
            const float *x = a->x + at, *skip = a->skip ? a->skip + at : NULL;
            float *y = a->y ? a->y + at : NULL;
            if (y && !a->y_t && !skip) { /* the common case, in a loop the compiler vectorises */
                for (int p = 0; p < a->hw; p++) y[p] = mgpu__bn_output(a, x[p], 0.0f, scale, shift);
                continue;
            }
            for (int p = 0; p < a->hw; p++) {
                float v = mgpu__bn_output(a, x[p], skip ? skip[p] : 0.0f, scale, shift);
                if (y) y[p] = v;
                if (a->y_t) a->y_t[mgpu__channels_last_index(n, c, p, a->c, a->hw)] = mgpu__tf32_round(v);
            }
        }
    }
}

/* --------------------------------------------------------------- backward */
typedef struct {
    float *dx, *dgamma, *dbeta;
    const float *mask;     /* the residual block's output (above), or NULL */
    float *dsum;           /* with mask: g written there */
    float *dshortcut_bias; /* also gets sum g (above), or NULL */
    float *dconv_bias;     /* gets 0 (above) unless accumulating, or NULL */
    float *dx_t;       /* dx channels-last (kernels/channels_last.h) instead, or NULL */
    const float *dy, *x, *gamma, *save_mean, *save_invstd;
    const float *beta; /* only with fuse_relu, for the ReLU's mask */
    float *partials;   /* CUDA scratch: [C][S] partial sums, then [C] channel means */
    unsigned *done;    /* CUDA: as the forward's */
    int n, c, hw, splits;
    int fuse_relu, accumulate; /* accumulate: dgamma += ..., dbeta += ... */
    int phase;                 /* mgpu__bn_phase */
    float *sums;               /* GRAD_SUMS: [C][2] sums of g and g xhat written; INPUT_GRAD: the
                                  group's read, and at [2C] the values a channel has over the group */
} mgpu__bn_backward_args;

/* The forward's scale and shift of channel c (for the ReLU's mask). */
static MGPU__HOSTDEVICE inline void mgpu__bn_backward_affine(const mgpu__bn_backward_args *a, int c,
                                                             float *scale, float *shift) {
    if (a->fuse_relu)
        mgpu__bn_scale_shift(a->gamma[c], a->beta[c], a->save_mean[c], a->save_invstd[c], scale, shift);
    else
        *scale = *shift = 0.0f;
}
/* g: dy, except where the fused ReLU clipped, which is where the forward's
   scale x + shift was not above 0. */
static MGPU__HOSTDEVICE inline float mgpu__bn_grad_out(const mgpu__bn_backward_args *a, float dy, float x,
                                                       float scale, float shift) {
    /* (& rather than &&: no branch, so that the CPU's loops become vector instructions) */
    return (a->fuse_relu & !(mgpu__bn_affine(scale, x, shift) > 0.0f)) ? 0.0f : dy;
}
static MGPU__HOSTDEVICE inline float mgpu__bn_xhat(const mgpu__bn_backward_args *a, float x, int c) {
    return (x - a->save_mean[c]) * a->save_invstd[c];
}
/* dbeta_c and dgamma_c from the channel's sums of g and of g xhat (and
   the shortcut's bias gradient, when given, from the first; and the
   cancelled convolution bias's 0, when given and not accumulating). */
static MGPU__HOSTDEVICE inline void mgpu__bn_param_grads(const mgpu__bn_backward_args *a, int c,
                                                         float sum_g, float sum_g_xhat) {
    a->dbeta[c] = (a->accumulate ? a->dbeta[c] : 0.0f) + sum_g;
    a->dgamma[c] = (a->accumulate ? a->dgamma[c] : 0.0f) + sum_g_xhat;
    if (a->dshortcut_bias) a->dshortcut_bias[c] = (a->accumulate ? a->dshortcut_bias[c] : 0.0f) + sum_g;
    if (a->dconv_bias && !a->accumulate) a->dconv_bias[c] = 0.0f;
}
/* dx at a value of channel c with gradient g (after the mask), given the
   channel's means of g and g xhat. */
static MGPU__HOSTDEVICE inline float mgpu__bn_input_grad(const mgpu__bn_backward_args *a, float g, float x,
                                                         int c, float mean_g, float mean_g_xhat) {
    return a->gamma[c] * a->save_invstd[c] * (g - mean_g - mgpu__bn_xhat(a, x, c) * mean_g_xhat);
}

/* The sums of g and of g xhat over n values of one image's run of channel
   c (a block: see above), in a vector register's float lanes
   (MGPU__SIMD_SUMS, kernels/common.h). What mgpu__bn_grad_out and
   mgpu__bn_xhat compute, from the channel's numbers in locals: read
   through a, they would stop the compiler from vectorising the loop; and
   out of line, as inlined into the channel loop GCC 12 does not either.
   dy is read before the ReLU's test: a load under the test is not
   vectorised either. Runs are short in ResNet-18's later stages (49
   values at 7 x 7, 16 at 4 x 4), and GCC vectorises a loop of 8
   explicit lanes here only over 64 values and more; the simd reduction
   is one 8-float vector loop at any length, 3 times as fast over the
   four stages (bench/RESULTS.md). The same change to the forward's
   loops gained nothing measurable. */
static __attribute__((noinline)) void mgpu__bn_backward_run_sums(const mgpu__bn_backward_args *a, int c, const float *dy,
                                                                  const float *x, int n, float scale, float shift,
                                                                  double *sum_g, double *sum_g_xhat) {
    const float mean = a->save_mean[c], invstd = a->save_invstd[c];
    const int relu = a->fuse_relu;
    float g_sum = 0.0f, gx_sum = 0.0f;
    MGPU__SIMD_SUMS(g_sum, gx_sum)
    for (int p = 0; p < n; p++) {
        float d = dy[p], g = (relu & !(mgpu__bn_affine(scale, x[p], shift) > 0.0f)) ? 0.0f : d;
        g_sum += g;
        gx_sum += g * ((x[p] - mean) * invstd);
    }
    *sum_g += g_sum;
    *sum_g_xhat += gx_sum;
}

static void mgpu__bn_backward_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__bn_backward_args *a = (const mgpu__bn_backward_args *)args;
    size_t m = (size_t)a->n * (size_t)a->hw;
    MGPU__CPU_PARALLEL_FOR(m * a->c)
    for (int c = 0; c < a->c; c++) {
        float scale, shift;
        mgpu__bn_backward_affine(a, c, &scale, &shift);
        double sum_g = 0, sum_g_xhat = 0;
        const float *dy = a->mask ? a->dsum : a->dy; /* (masked first, below) */
        for (int n = 0; n < a->n && a->phase != MGPU__BN_INPUT_GRAD; n++) {
            size_t at = ((size_t)n * a->c + c) * a->hw;
            if (a->mask)
                for (size_t i = at; i < at + (size_t)a->hw; i++) a->dsum[i] = mgpu__relu_grad(a->dy[i], a->mask[i]);
            for (int p = 0; p < a->hw; p += MGPU__BN_CPU_BLOCK)
                mgpu__bn_backward_run_sums(a, c, dy + at + p, a->x + at + p,
                                           a->hw - p < MGPU__BN_CPU_BLOCK ? a->hw - p : MGPU__BN_CPU_BLOCK, scale, shift,
                                           &sum_g, &sum_g_xhat);
        }
        double count = (double)m;
        if (a->phase == MGPU__BN_INPUT_GRAD) {
            sum_g = a->sums[2 * c], sum_g_xhat = a->sums[2 * c + 1], count = a->sums[2 * a->c];
        } else {
            mgpu__bn_param_grads(a, c, (float)sum_g, (float)sum_g_xhat);
            if (a->phase == MGPU__BN_GRAD_SUMS) {
                a->sums[2 * c] = (float)sum_g, a->sums[2 * c + 1] = (float)sum_g_xhat;
                continue;
            }
        }
        float mean_g = (float)(sum_g / count), mean_g_xhat = (float)(sum_g_xhat / count);
        for (int n = 0; n < a->n; n++) {
            size_t at = ((size_t)n * a->c + c) * a->hw;
            const float *g_in = dy + at, *x = a->x + at;
            if (!a->dx_t) { /* the common case, in a loop the compiler vectorises */
                float *dx = a->dx + at;
                for (int p = 0; p < a->hw; p++)
                    dx[p] = mgpu__bn_input_grad(a, mgpu__bn_grad_out(a, g_in[p], x[p], scale, shift), x[p], c,
                                                mean_g, mean_g_xhat);
                continue;
            }
            for (int p = 0; p < a->hw; p++) {
                float g = mgpu__bn_grad_out(a, g_in[p], x[p], scale, shift);
                float dx = mgpu__bn_input_grad(a, g, x[p], c, mean_g, mean_g_xhat);
                a->dx_t[mgpu__channels_last_index(n, c, p, a->c, a->hw)] = mgpu__tf32_round(dx);
            }
        }
    }
}

/* How many slices the CUDA reduction cuts a channel of m values into:
   about 4096 values a block, so that even 64 channels fill a large GPU,
   and at most 64, so that merging the partials stays trivial. */
static int mgpu__bn_splits(size_t m) {
    size_t s = (m + 4095) / 4096;
    return (int)(s < 1 ? 1 : s > 64 ? 64 : s);
}

#if MGPU_CUDA
/* Welford's statistics of a set of values, reduced with common.h's
   warp and block reductions: a shuffle and an operator of their own. */
typedef struct { float n, mean, m2; } mgpu__welford; /* count, mean, sum of squared deviations */

static __device__ inline mgpu__welford mgpu__shfl_xor(mgpu__welford v, int mask) {
    v.n = mgpu__shfl_xor(v.n, mask);
    v.mean = mgpu__shfl_xor(v.mean, mask);
    v.m2 = mgpu__shfl_xor(v.m2, mask);
    return v;
}
/* Chan et al.: the statistics of two sets from those of each. */
struct mgpu__welford_op {
    __device__ mgpu__welford operator()(mgpu__welford x, mgpu__welford y) const {
        if (y.n == 0) return x;
        if (x.n == 0) return y;
        mgpu__welford r;
        float delta = y.mean - x.mean;
        r.n = x.n + y.n;
        r.mean = x.mean + delta * (y.n / r.n);
        r.m2 = x.m2 + y.m2 + delta * delta * (x.n * (y.n / r.n));
        return r;
    }
};

/* --------------------------------------------------- batch norm kernels */
#define MGPU__BN_BLOCK 256
#define MGPU__BN_HELD 16 /* values a thread of the statistics kernel holds at once */

/* Where the vectors of x are (indices below 2^31: mgpu_batchnorm2d_*
   refuse larger tensors on a GPU). Vector i lies in plane i / per_plane,
   and the plane's channel is that plane mod C. */
typedef struct {
    mgpu__divisor per_plane, c; /* vectors per plane (H*W / V), channels */
} mgpu__bn_layout;
static mgpu__bn_layout mgpu__bn_layout_for(int c, int hw, int v) {
    mgpu__bn_layout l = {mgpu__divisor_for(hw / v), mgpu__divisor_for(c)};
    return l;
}
/* The channel of vector i. */
static __device__ inline int mgpu__bn_channel(int i, mgpu__bn_layout l) {
    int plane = mgpu__div(i, l.per_plane); /* image * C + channel */
    return plane - mgpu__div(plane, l.c) * l.c.d;
}
/* Where the j-th of channel c's N*H*W/V vectors is, counted in vectors. */
static __device__ inline int mgpu__bn_offset(int j, int c, mgpu__bn_layout l) {
    int image = mgpu__div(j, l.per_plane), in_plane = j - image * l.per_plane.d;
    return (image * l.c.d + c) * l.per_plane.d + in_plane;
}
/* The vectors [begin, end) of its channel that block (c, blockIdx.y) of
   the C x S grid reduces. (Channels on x: the grid's y and z are limited
   to 65535, its x to 2^31 - 1.) */
static __device__ inline void mgpu__bn_slice(int vectors, int splits, int *begin, int *end) {
    int chunk = (vectors + splits - 1) / splits;
    *begin = (int)blockIdx.y * chunk;
    *end = *begin + chunk < vectors ? *begin + chunk : vectors;
}

/* Finishing a channel. Each of a channel's S blocks writes its slice's
   partial result, and the last of them to do so merges the S partials
   and finishes the channel (the "last block" of the memory fences'
   section of the CUDA C++ Programming Guide). The block's thread 0 writes
   its partial, makes it visible to every other block (__threadfence: the
   write has reached L2, where they read, before anything this thread does
   next), then counts it on the channel's counter, done[c]. The block that
   counts the S-th knows that every partial is written. It sets the
   counter back to 0 (so that a device's counters are all 0 between
   kernels, ready for the next) and merges the partials in warp 0 (whose
   lanes __syncwarp orders after thread 0's write, as __syncthreads orders
   a block's threads in the Guide's example): lane l
   those of slices l and l + 32 (S <= 64), then the lanes' in the same
   order every time, so the result does not depend on which block came
   last. (A warp, not a thread: one thread merging a channel's partials
   one after the other waits for each merge's load in turn, longer than
   the statistics themselves take: bench/history.md.) Finishing here,
   rather than in a kernel of its own after the reduction, saves a launch
   a pass (30 a ResNet-18 step), each a few microseconds for a
   microsecond's work.
   With S = 1 (N*H*W of 4096 or fewer, as ResNet-18's stage 4 at batch
   256) the block is its channel's only one and finishes it at once. */

/* Called by warp 0 once thread 0 has written this block's partial of
   channel c: whether this block is the channel's last to finish. */
static __device__ inline bool mgpu__bn_last_slice(unsigned *done, int c, int splits) {
    unsigned finished = 0;
    if (threadIdx.x == 0) {
        __threadfence();
        finished = atomicAdd(&done[c], 1u) + 1;
        if (finished == (unsigned)splits) done[c] = 0; /* every block of c has counted */
    }
    bool last = __shfl_sync(0xffffffffu, finished, 0) == (unsigned)splits;
    __syncwarp(); /* (thread 0's own partial, for the warp's other lanes to read) */
    if (last) __threadfence(); /* the others' partials are read after the count */
    return last;
}
/* Partials that other blocks wrote in this kernel, read through volatile,
   so from L2, never from a stale line of this multiprocessor's L1. */
static __device__ inline mgpu__welford mgpu__bn_partial(const mgpu__welford *p) {
    const volatile float *v = (const volatile float *)p;
    mgpu__welford w = {v[0], v[1], v[2]};
    return w;
}
static __device__ inline mgpu__pair mgpu__bn_partial(const mgpu__pair *p) {
    const volatile float *v = (const volatile float *)p;
    mgpu__pair sums = {v[0], v[1]};
    return sums;
}
/* The end of a reducing block of channel c, in warp 0, thread 0 holding
   the block's result *v: whether this block finishes the channel, and if
   so, the channel's result in *v (lane 0's is the one to use). partials:
   [C][S]. */
template <typename T, typename Op>
static __device__ bool mgpu__bn_slice_done(T *v, T *partials, unsigned *done, int c, int splits, Op op,
                                           T none) {
    if (splits == 1) return true;
    T *channel = partials + (size_t)c * splits;
    if (threadIdx.x == 0) channel[blockIdx.y] = *v;
    if (!mgpu__bn_last_slice(done, c, splits)) return false;
    T merged = none;
    for (int s = threadIdx.x; s < splits; s += 32) merged = op(merged, mgpu__bn_partial(channel + s));
    *v = mgpu__warp_allreduce(merged, op);
    return true;
}

/* Each thread loads MGPU__BN_HELD values of its slice into registers (all
   the loads in flight together), takes their mean and squared deviations
   there, and merges the triple into its running one (Chan et al.). */
template <int V>
static __global__ void mgpu__bn_stats_kernel(mgpu__bn_forward_args a, mgpu__bn_layout l) {
    const int held = MGPU__BN_HELD / V; /* vectors */
    int c = blockIdx.x, begin, end;
    mgpu__bn_slice(a.n * (a.hw / V), a.splits, &begin, &end);
    mgpu__welford w = {0, 0, 0};
    for (int first = begin + threadIdx.x; first < end; first += held * blockDim.x) {
        float v[held][V], sum = 0.0f;
        int count = 0;
        for (int k = 0; k < held; k++) {
            int j = first + k * blockDim.x;
            for (int e = 0; e < V; e++) v[k][e] = 0.0f;
            if (j < end) {
                mgpu__load_floats(v[k], a.x + (size_t)mgpu__bn_offset(j, c, l) * V);
                count += V;
            }
            for (int e = 0; e < V; e++) sum += v[k][e];
        }
        mgpu__welford held_values = {(float)count, sum / (float)count, 0.0f};
        for (int k = 0; k < held; k++)
            if (first + k * (int)blockDim.x < end)
                for (int e = 0; e < V; e++) {
                    float deviation = v[k][e] - held_values.mean;
                    held_values.m2 += deviation * deviation;
                }
        w = mgpu__welford_op()(w, held_values);
    }
    mgpu__welford none = {0, 0, 0};
    w = mgpu__block_reduce(w, mgpu__welford_op(), none);
    if (threadIdx.x >= 32) return; /* warp 0 finishes */
    if (mgpu__bn_slice_done(&w, (mgpu__welford *)a.partials, a.done, c, a.splits, mgpu__welford_op(), none) &&
        threadIdx.x == 0)
        mgpu__bn_channel_done(&a, c, w.n, w.mean, w.m2);
}
static __global__ void mgpu__bn_merge_kernel(mgpu__bn_forward_args a) {
    MGPU__GRID_STRIDE_LOOP(c, (size_t)a.c) mgpu__bn_merge_channel(&a, (int)c);
}

/* y at offset `at` of x, of channel c, written to a.y there too (unless
   y_t alone is wanted); as a source of kernels/channels_last.h, which
   then writes y_t. */
struct mgpu__bn_output_source {
    mgpu__bn_forward_args a;
    template <int V> __device__ void operator()(size_t at, int c, float (&y)[V]) const {
        float scale, shift, x[V], skip[V] = {};
        mgpu__bn_forward_affine(&a, c, &scale, &shift);
        mgpu__load_floats(x, a.x + at);
        if (a.skip) mgpu__load_floats(skip, a.skip + at);
        for (int e = 0; e < V; e++) y[e] = mgpu__bn_output(&a, x[e], skip[e], scale, shift);
        if (a.y) mgpu__store_floats(a.y + at, y);
    }
};
/* The last kernel of either pass: a source's values (y, or dx) over the
   whole tensor [n, c, hw], written by the source itself in place, a
   thread a vector; or, given `channels_last_copy`, written channels-last
   there too by kernels/channels_last.h's tile kernel. */
template <int V, class Source>
static __global__ void mgpu__bn_values_kernel(Source src, int n, int c, int hw, mgpu__bn_layout l) {
    MGPU__GRID_STRIDE_LOOP(i, (size_t)n * c * (hw / V)) {
        float v[V];
        src(i * V, mgpu__bn_channel((int)i, l), v);
    }
}
template <int V, class Source>
static void mgpu__bn_values(Source src, float *channels_last_copy, int n, int c, int hw, mgpu__bn_layout l,
                            cudaStream_t stream) {
    if (channels_last_copy) { /* [n, c, hw] -> [n, hw, c] */
        mgpu__channels_last_to to = {channels_last_copy, n, c, hw, 0};
        mgpu__channels_last_launch(src, to, V == 4 && c % 4 == 0, stream);
        return;
    }
    size_t vectors = (size_t)n * c * (hw / V);
    mgpu__bn_values_kernel<V, Source><<<mgpu__grid_for(vectors, 256), 256, 0, stream>>>(src, n, c, hw, l);
    MGPU_CUDA_CHECK_LAUNCH();
}

template <int V> static void mgpu__bn_forward_launch(const mgpu__bn_forward_args *a, cudaStream_t stream) {
    mgpu__bn_layout l = mgpu__bn_layout_for(a->c, a->hw, V);
    if (a->phase == MGPU__BN_MERGE) {
        mgpu__bn_merge_kernel<<<mgpu__grid_for((size_t)a->c, 128), 128, 0, stream>>>(*a);
        MGPU_CUDA_CHECK_LAUNCH();
        return;
    }
    if (a->training && a->phase != MGPU__BN_NORMALISE) {
        mgpu__bn_stats_kernel<V><<<dim3(a->c, a->splits), MGPU__BN_BLOCK, 0, stream>>>(*a, l);
        MGPU_CUDA_CHECK_LAUNCH();
    }
    if (a->phase == MGPU__BN_MOMENTS) return;
    mgpu__bn_output_source src = {*a};
    mgpu__bn_values<V>(src, a->y_t, a->n, a->c, a->hw, l, stream);
}
static void mgpu__bn_forward_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__bn_forward_args *a = (const mgpu__bn_forward_args *)args;
    const void *tensors[] = {a->y, a->x, a->skip, a->y_t};
    if (mgpu__vector_width((size_t)a->hw, tensors, 4) == 4) /* planes of whole vectors */
        mgpu__bn_forward_launch<4>(a, (cudaStream_t)ex->stream);
    else
        mgpu__bn_forward_launch<1>(a, (cudaStream_t)ex->stream);
}

/* Channel c's dbeta and dgamma, and the means of g and g xhat for dx
   (after the partials), from its sums of g and g xhat. */
static __device__ inline void mgpu__bn_finish_grads(const mgpu__bn_backward_args &a, int c, mgpu__pair total) {
    mgpu__bn_param_grads(&a, c, total.a, total.b);
    if (a.phase == MGPU__BN_GRAD_SUMS) {
        a.sums[2 * c] = total.a, a.sums[2 * c + 1] = total.b;
        return;
    }
    float m = (float)((size_t)a.n * a.hw);
    mgpu__pair *means = (mgpu__pair *)a.partials + (size_t)a.c * a.splits;
    means[c].a = total.a / m;
    means[c].b = total.b / m;
}
template <int V>
static __global__ void mgpu__bn_grad_sums_kernel(mgpu__bn_backward_args a, mgpu__bn_layout l) {
    int c = blockIdx.x, begin, end;
    mgpu__bn_slice(a.n * (a.hw / V), a.splits, &begin, &end);
    float scale, shift;
    mgpu__bn_backward_affine(&a, c, &scale, &shift);
    mgpu__pair sums = {0, 0}; /* sum of g, sum of g xhat */
    for (int j = begin + threadIdx.x; j < end; j += blockDim.x) {
        size_t at = (size_t)mgpu__bn_offset(j, c, l) * V;
        float dy[V], x[V];
        mgpu__load_floats(dy, a.dy + at);
        mgpu__load_floats(x, a.x + at);
        if (a.mask) {
            float mask[V];
            mgpu__load_floats(mask, a.mask + at);
            for (int e = 0; e < V; e++) dy[e] = mgpu__relu_grad(dy[e], mask[e]);
            mgpu__store_floats(a.dsum + at, dy);
        }
        for (int e = 0; e < V; e++) {
            float g = mgpu__bn_grad_out(&a, dy[e], x[e], scale, shift);
            sums.a += g;
            sums.b += g * mgpu__bn_xhat(&a, x[e], c);
        }
    }
    mgpu__pair zero = {0, 0};
    sums = mgpu__block_reduce(sums, mgpu__sum_op(), zero);
    if (threadIdx.x >= 32) return; /* warp 0 finishes */
    if (mgpu__bn_slice_done(&sums, (mgpu__pair *)a.partials, a.done, c, a.splits, mgpu__sum_op(), zero) &&
        threadIdx.x == 0)
        mgpu__bn_finish_grads(a, c, sums);
}

/* dx at offset `at` of x, of channel c, written to a.dx there too unless
   kernels/channels_last.h writes it channels-last (a.dx_t) instead. */
struct mgpu__bn_input_grad_source {
    mgpu__bn_backward_args a;
    template <int V> __device__ void operator()(size_t at, int c, float (&dx)[V]) const {
        mgpu__pair mean; /* of g and of g xhat: this pass's, or the group's (INPUT_GRAD) */
        if (a.phase == MGPU__BN_INPUT_GRAD)
            mean.a = a.sums[2 * c] / a.sums[2 * a.c], mean.b = a.sums[2 * c + 1] / a.sums[2 * a.c];
        else
            mean = ((const mgpu__pair *)a.partials)[(size_t)a.c * a.splits + c];
        float scale, shift, dy[V], x[V];
        mgpu__bn_backward_affine(&a, c, &scale, &shift);
        mgpu__load_floats(dy, a.dy + at);
        mgpu__load_floats(x, a.x + at);
        for (int e = 0; e < V; e++) {
            float g = mgpu__bn_grad_out(&a, dy[e], x[e], scale, shift);
            dx[e] = mgpu__bn_input_grad(&a, g, x[e], c, mean.a, mean.b);
        }
        if (!a.dx_t) mgpu__store_floats(a.dx + at, dx);
    }
};

template <int V> static void mgpu__bn_backward_launch(const mgpu__bn_backward_args *a, cudaStream_t stream) {
    mgpu__bn_layout l = mgpu__bn_layout_for(a->c, a->hw, V);
    if (a->phase != MGPU__BN_INPUT_GRAD) {
        mgpu__bn_grad_sums_kernel<V><<<dim3(a->c, a->splits), MGPU__BN_BLOCK, 0, stream>>>(*a, l);
        MGPU_CUDA_CHECK_LAUNCH();
    }
    if (a->phase == MGPU__BN_GRAD_SUMS) return;
    mgpu__bn_input_grad_source src = {*a};
    if (a->mask) src.a.dy = a->dsum; /* g, masked by the sums' pass */
    mgpu__bn_values<V>(src, a->dx_t, a->n, a->c, a->hw, l, stream);
}
static void mgpu__bn_backward_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__bn_backward_args *a = (const mgpu__bn_backward_args *)args;
    const void *tensors[] = {a->dx, a->dy, a->x, a->dx_t, a->mask, a->dsum};
    if (mgpu__vector_width((size_t)a->hw, tensors, 6) == 4)
        mgpu__bn_backward_launch<4>(a, (cudaStream_t)ex->stream);
    else
        mgpu__bn_backward_launch<1>(a, (cudaStream_t)ex->stream);
}
#endif
#endif
