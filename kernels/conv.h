/* kernels/conv.h: 2-D convolution through im2col and a matrix product.

   The operation (PyTorch's conv2d, which is a cross-correlation): input x
   [N, C, H, W], weight w [K, C, R, S], bias b [K], stride t, zero padding
   d; output y [N, K, P, Q] with P = (H + 2d - R) / t + 1 (rounded down),
   Q likewise, and
       y[n,k,p,q] = b[k] + sum_{c,r,s} w[k,c,r,s] * x[n, c, p*t + r - d, q*t + s - d]
   where x is 0 outside the image (the padding).

   im2col. Lay the inputs that one output pixel sees out as a column: for
   every (c, r, s) (a row) and every output pixel (n, p, q) (a column),
       col[(c,r,s), (n,p,q)] = x[n, c, p*t + r - d, q*t + s - d]
   Then, with the weight read as a matrix W [K, C*R*S] and the output of a
   batch laid out as Y [K, (n,p,q)],
       Y = W col
   one matrix product that a BLAS runs near the machine's peak, where the
   direct loops above would not.

   Backward. With G = dL/dY laid out like Y, [K, (n,p,q)]:
       dL/dW   = G col^T                 [K, C*R*S]
       dL/db_k = sum over (n,p,q) of G[k, (n,p,q)]
       dL/dcol = W^T G                   [C*R*S, (n,p,q)]
       dL/dx   = col2im(dL/dcol): every entry of dcol goes back, added, to
                 the input pixel that im2col copied it from (a pixel seen
                 by several windows collects several contributions; the
                 padding's are dropped).

   Layout. A tensor is [N, K, P, Q], but the product gives [K, N, P*Q]:
   the two outer axes are swapped. So the forward pass swaps them back
   after the product (mgpu__swap_outer, which adds the bias on the way:
   one pass over y instead of two), and the backward pass swaps dy the
   other way before its products. The batch is processed in chunks of
   images so that the col buffer stays bounded; a chunk holds as many
   images as fit, so one product covers many images (a GPU needs large
   products: one per image would be thousands of small launches).

   This file holds the data movement (im2col, col2im, the axis swap); the
   wrappers in the implementation (mgpu_conv2d_forward, ...) enqueue them
   with the matrix products of matmul.h and the per-channel bias kernels
   of linear.h.

   CPU: for each row (c, r, s) of col, the output positions whose input
   lies inside the image are a contiguous range of rows p and of columns
   q, computed once (mgpu__conv_valid_range), so the innermost loop copies
   a run along one image row without any test. col2im walks the same
   runs backwards, adding instead of copying.
   CUDA: consecutive threads on consecutive elements of what they write.
   im2col: a thread per 4 neighbouring entries of a row of col (a warp
   writes a run of col, reading a run of an image row), their 4 loads
   issued together and their store one 16-byte instruction. col2im: a
   thread per input pixel, which gathers the (at most R*S) entries of
   dcol that came from it: each pixel is written once, by one thread, so
   no atomics are needed and the result does not depend on timing. Both
   move a few bytes a thread, so what bounds them is how many loads each
   thread has on their way at once: one at a time, every thread waits a
   whole trip to memory per value, and the kernels run far below memory's
   bandwidth (bench/history.md). */
#ifndef MGPU_KERNELS_CONV_H
#define MGPU_KERNELS_CONV_H
#include "common.h"


/* The geometry of a convolution over a chunk of n images. */
typedef struct {
    int n, c, h, w; /* input: n images of c channels, h x w */
    int k, r, s;    /* weight: k filters of c x r x s */
    int p, q;       /* output size */
    int stride, pad;
} mgpu__conv_geom;

/* A convolution's three passes, each of which may take a way of its own:
   the forward pass y = conv(x, w) + b, the input gradient dx and the
   weight gradient dW. (A CPU's choices are keyed by them; a GPU's trial
   has kinds of its own, mgpu__conv_try, with im2col's passes apart.) */
typedef enum { MGPU__PASS_Y, MGPU__PASS_DX, MGPU__PASS_DW } mgpu__conv_pass;

/* At stride 1 the input gradient is itself a convolution: of dy with
   the weights turned half a circle, w'[c, k, r, s] = w[k, c, R-1-r, S-1-s],
   and padding R - 1 - pad (conv_nhwc.h and winograd.h compute it so). Its
   geometry: input dy [n, K, P, Q], C filters, output dx [n, C, H, W]. */
static inline mgpu__conv_geom mgpu__conv_dx_geometry(const mgpu__conv_geom *g) {
    mgpu__conv_geom d = {g->n, g->k, g->p, g->q, g->c, g->r, g->s, g->h, g->w, 1, g->r - 1 - g->pad};
    return d;
}

/* The input coordinate that output coordinate o reads through kernel tap
   t (outside [0, size) it is in the padding). */
static MGPU__HOSTDEVICE inline int mgpu__conv_in(int o, int t, int stride, int pad) {
    return o * stride + t - pad;
}

typedef struct {
    const float *x; /* the chunk's first image */
    float *col;     /* [c*r*s, n*p*q] */
    mgpu__conv_geom g;
} mgpu__im2col_args;

typedef struct {
    const float *col; /* [c*r*s, n*p*q] */
    float *dx;        /* the chunk's first image */
    mgpu__conv_geom g;
    int accumulate;   /* 1: dx += the sums; 0: dx = the sums */
} mgpu__col2im_args;

/* in [outer, middle, inner] -> out [middle, outer, inner], plus bias[o]
   on every value of in's run o when bias is not NULL */
typedef struct {
    float *out;
    const float *in;
    int outer, middle;
    size_t inner;
    const float *bias;
} mgpu__swap_outer_args;

/* The output positions o in [0, out) whose input o*stride + t - pad lies
   in [0, in): the range [*lo, *hi). */
static void mgpu__conv_valid_range(int in, int out, int t, int stride, int pad, int *lo, int *hi) {
    int first = pad - t, end = in + pad - t; /* want first <= o*stride < end */
    *lo = first <= 0 ? 0 : (first + stride - 1) / stride;
    *hi = end <= 0 ? 0 : (end + stride - 1) / stride;
    if (*hi > out) *hi = out;
    if (*lo > *hi) *lo = *hi;
}

/* Walks every entry of col with the input pixel it copies. to_col: col =
   that pixel, or 0 in the padding (im2col; x is only read). Otherwise
   x += col for every entry inside the image (the scattering half of
   col2im; the caller zeroes x first). The innermost loops move a run of
   one image row; stride 1, the common case, gets its own loops, which
   the compiler turns into vector instructions. */
static void mgpu__im2col_walk(const mgpu__conv_geom *g, float *x, float *col, int to_col) {
    size_t pq = (size_t)g->p * g->q, cols = (size_t)g->n * pq, plane = (size_t)g->h * g->w;
    int t = g->stride;
    MGPU__CPU_PARALLEL_FOR(cols * g->c * g->r * g->s) /* channel c writes only its rows, or its planes */
    for (int c = 0; c < g->c; c++)
        for (int r = 0; r < g->r; r++) {
            int p_lo, p_hi;
            mgpu__conv_valid_range(g->h, g->p, r, t, g->pad, &p_lo, &p_hi);
            for (int s = 0; s < g->s; s++) {
                int q_lo, q_hi;
                mgpu__conv_valid_range(g->w, g->q, s, t, g->pad, &q_lo, &q_hi);
                int len = q_hi - q_lo, first = mgpu__conv_in(q_lo, s, t, g->pad);
                float *row = col + ((size_t)(c * g->r + r) * g->s + s) * cols;
                for (int img = 0; img < g->n; img++) {
                    float *x_plane = x + ((size_t)img * g->c + c) * plane;
                    float *out = row + (size_t)img * pq;
                    if (to_col) { /* whole rows of padding above and below */
                        memset(out, 0, (size_t)p_lo * g->q * sizeof(float));
                        memset(out + (size_t)p_hi * g->q, 0,
                               (size_t)(g->p - p_hi) * g->q * sizeof(float));
                    }
                    for (int p = p_lo; p < p_hi; p++) {
                        float *cs = out + (size_t)p * g->q;
                        if (to_col) { /* the padding left and right of the run */
                            for (int q = 0; q < q_lo; q++) cs[q] = 0.0f;
                            for (int q = q_hi; q < g->q; q++) cs[q] = 0.0f;
                        }
                        if (len == 0) continue;
                        /* the run: col[.., q_lo + j] <-> x[.., h, first + j*t] for j < len */
                        float *xs = x_plane + (size_t)mgpu__conv_in(p, r, t, g->pad) * g->w + first;
                        cs += q_lo;
                        if (to_col && t == 1)
                            for (int j = 0; j < len; j++) cs[j] = xs[j];
                        else if (to_col)
                            for (int j = 0; j < len; j++) cs[j] = xs[j * t];
                        else if (t == 1)
                            for (int j = 0; j < len; j++) xs[j] += cs[j];
                        else
                            for (int j = 0; j < len; j++) xs[j * t] += cs[j];
                    }
                }
            }
        }
}

static void mgpu__im2col_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__im2col_args *a = (const mgpu__im2col_args *)args;
    mgpu__im2col_walk(&a->g, (float *)a->x, a->col, 1); /* x is only read */
}

static void mgpu__col2im_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__col2im_args *a = (const mgpu__col2im_args *)args;
    if (!a->accumulate) memset(a->dx, 0, (size_t)a->g.n * a->g.c * a->g.h * a->g.w * sizeof(float));
    mgpu__im2col_walk(&a->g, a->dx, (float *)a->col, 0); /* col is only read */
}

static void mgpu__swap_outer_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__swap_outer_args *a = (const mgpu__swap_outer_args *)args;
    MGPU__CPU_PARALLEL_FOR((size_t)a->middle * a->outer * a->inner)
    for (int m = 0; m < a->middle; m++)
        for (int o = 0; o < a->outer; o++) {
            float *out = a->out + ((size_t)m * a->outer + o) * a->inner;
            const float *in = a->in + ((size_t)o * a->middle + m) * a->inner;
            if (!a->bias) {
                memcpy(out, in, a->inner * sizeof(float));
                continue;
            }
            float b = a->bias[o];
            for (size_t i = 0; i < a->inner; i++) out[i] = in[i] + b;
        }
}

#if MGPU_CUDA
/* Index arithmetic on the GPU is 32-bit: the wrappers keep every tensor
   and every chunk's col buffer below 2^31 elements. A 64-bit division is
   a long subroutine on a GPU and would cost more than the memory traffic,
   and even a 32-bit one costs some 20 instructions: the divisions below
   by the convolution's sizes multiply instead (mgpu__div,
   kernels/elementwise.h). im2col uses a 2-D grid, blockIdx.y for a row
   of col (one (c, r, s)), so that per entry only the position along the
   row is decomposed. */

/* Threads per block for rows of n elements: 256, fewer for short rows (a
   4x4 map would leave most of a 256-thread block idle). */
static unsigned mgpu__row_block(unsigned n) { return n >= 256 ? 256 : (n + 31) / 32 * 32; }
static dim3 mgpu__row_grid(unsigned n, unsigned rows) {
    return dim3(mgpu__grid_for(n, mgpu__row_block(n)), rows < 65535 ? rows : 65535);
}
#define MGPU__ROW_LOOP(row, rows) for (unsigned row = blockIdx.y; row < (rows); row += gridDim.y)
#define MGPU__ALONG_ROW_LOOP(j, n) \
    for (unsigned j = blockIdx.x * blockDim.x + threadIdx.x; j < (n); j += gridDim.x * blockDim.x)

/* A thread writes V neighbouring entries of a row of col (V = 4 where
   the rows are whole vectors: mgpu__vector_width). Every entry's load is
   made, a padding entry's from the channel's first value (then replaced
   by 0): a load under a test is a branch the compiler may keep, and then
   each load waits for the one before it. */
template <int V>
static __global__ void mgpu__im2col_kernel(mgpu__im2col_args a, mgpu__divisor by_q, mgpu__divisor by_p) {
    const mgpu__conv_geom g = a.g;
    unsigned cols = g.n * g.p * g.q, rows = g.c * g.r * g.s;
    MGPU__ROW_LOOP(row, rows) {
        int s = row % g.s, r = row / g.s % g.r, c = row / (g.s * g.r);
        const float *x_c = a.x + (size_t)c * g.h * g.w; /* channel c of the first image */
        float *out = a.col + (size_t)row * cols;
        MGPU__ALONG_ROW_LOOP(vector, cols / V) { /* its first entry j = (img, p, q) */
            int j = (int)vector * V, img_p = mgpu__div(j, by_q), q = j - img_p * g.q;
            int img = mgpu__div(img_p, by_p), p = img_p - img * g.p;
            float v[V];
            for (int e = 0; e < V; e++) { /* (unrolled: the loads do not wait for each other) */
                int h = mgpu__conv_in(p, r, g.stride, g.pad), w = mgpu__conv_in(q, s, g.stride, g.pad);
                bool inside = h >= 0 && h < g.h && w >= 0 && w < g.w;
                v[e] = x_c[inside ? ((size_t)img * g.c * g.h + h) * g.w + w : 0];
                if (!inside) v[e] = 0.0f;
                if (++q == g.q) { /* the next entry's pixel */
                    q = 0;
                    if (++p == g.p) p = 0, img++;
                }
            }
            mgpu__store_floats(out + j, v);
        }
    }
}
static void mgpu__im2col_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__im2col_args *a = (const mgpu__im2col_args *)args;
    unsigned cols = a->g.n * a->g.p * a->g.q, rows = a->g.c * a->g.r * a->g.s;
    const void *out[1] = {a->col};
    int vector = mgpu__vector_width(cols, out, 1);
    void (*kernel)(mgpu__im2col_args, mgpu__divisor, mgpu__divisor) =
        vector == 4 ? mgpu__im2col_kernel<4> : mgpu__im2col_kernel<1>;
    kernel<<<mgpu__row_grid(cols / vector, rows), mgpu__row_block(cols / vector), 0, (cudaStream_t)ex->stream>>>(
        *a, mgpu__divisor_for(a->g.q), mgpu__divisor_for(a->g.p));
    MGPU_CUDA_CHECK_LAUNCH();
}

/* The output positions o in [*lo, *hi) whose window covers input
   coordinate i: i = o*stride + t - pad for a tap 0 <= t < taps. */
static __device__ inline void mgpu__conv_covering(int i, int taps, mgpu__divisor stride, int pad, int out,
                                                  int *lo, int *hi) {
    int last = i + pad, first = last - taps + 1; /* first <= o*stride <= last */
    *lo = first <= 0 ? 0 : mgpu__div(first + stride.d - 1, stride);
    *hi = mgpu__div(last, stride) + 1;
    if (*hi > out) *hi = out;
}

/* A thread per input pixel, over the whole chunk (a 7x7 plane a block
   left a quarter of its threads idle). COVER: the most output positions
   along a dimension whose windows cover one input coordinate,
   ceil(taps / stride), known when compiling (the loops unroll and the
   loads go out together), or 0: the loops run as far as they need. */
template <int COVER>
static __global__ void mgpu__col2im_kernel(mgpu__col2im_args a, mgpu__divisor by_w, mgpu__divisor by_hw,
                                           mgpu__divisor by_c, mgpu__divisor by_stride) {
    const mgpu__conv_geom g = a.g;
    unsigned pq = g.p * g.q, cols = g.n * pq, hw = g.h * g.w;
    MGPU__GRID_STRIDE_LOOP(i, (size_t)g.n * g.c * hw) { /* i = (img, c, h, w) */
        int plane = mgpu__div((int)i, by_hw), in_plane = (int)i - plane * (int)hw;
        int img = mgpu__div(plane, by_c), c = plane - img * g.c;
        int h = mgpu__div(in_plane, by_w), w = in_plane - h * g.w, p_lo, p_hi, q_lo, q_hi;
        mgpu__conv_covering(h, g.r, by_stride, g.pad, g.p, &p_lo, &p_hi);
        mgpu__conv_covering(w, g.s, by_stride, g.pad, g.q, &q_lo, &q_hi);
        const float *col_c = a.col + (size_t)c * g.r * g.s * cols + img * pq; /* row (c, 0, 0) */
        float sum = 0.0f;
        for (int dp = 0; dp < (COVER ? COVER : p_hi - p_lo); dp++)
            for (int dq = 0; dq < (COVER ? COVER : q_hi - q_lo); dq++) {
                int p = p_lo + dp, q = q_lo + dq;
                /* the tap through which (p, q) sees (h, w) */
                int r = h + g.pad - p * g.stride, s = w + g.pad - q * g.stride;
                bool covers = p < p_hi && q < q_hi;
                float value = col_c[covers ? (size_t)(r * g.s + s) * cols + p * g.q + q : 0]; /* (as in im2col) */
                sum += covers ? value : 0.0f;
            }
        a.dx[i] = a.accumulate ? a.dx[i] + sum : sum;
    }
}
static void mgpu__col2im_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__col2im_args *a = (const mgpu__col2im_args *)args;
    const mgpu__conv_geom *g = &a->g;
    int taps = g->r > g->s ? g->r : g->s, cover = (taps + g->stride - 1) / g->stride;
    void (*kernel)(mgpu__col2im_args, mgpu__divisor, mgpu__divisor, mgpu__divisor, mgpu__divisor) =
        cover == 1 ? mgpu__col2im_kernel<1> : cover == 2 ? mgpu__col2im_kernel<2>
        : cover == 3 ? mgpu__col2im_kernel<3> : mgpu__col2im_kernel<0>;
    kernel<<<mgpu__grid_for((size_t)g->n * g->c * g->h * g->w, 256), 256, 0, (cudaStream_t)ex->stream>>>(
        *a, mgpu__divisor_for(g->w), mgpu__divisor_for(g->h * g->w), mgpu__divisor_for(g->c),
        mgpu__divisor_for(g->stride));
    MGPU_CUDA_CHECK_LAUNCH();
}

/* A thread moves V neighbouring values of a run (V = 4 where the runs
   are whole vectors). */
template <int V>
static __global__ void mgpu__swap_outer_kernel(mgpu__swap_outer_args a, mgpu__divisor by_inner,
                                               mgpu__divisor by_outer) {
    unsigned inner = (unsigned)a.inner / V, total = a.outer * a.middle * inner;
    MGPU__GRID_STRIDE_LOOP(e, total) { /* e indexes out [middle, outer, inner / V] */
        int i = (int)e, m_o = mgpu__div(i, by_inner), k = i - m_o * (int)inner;
        int m = mgpu__div(m_o, by_outer), o = m_o - m * a.outer;
        float v[V], bias = a.bias ? a.bias[o] : 0.0f;
        mgpu__load_floats(v, a.in + (((size_t)o * a.middle + m) * inner + k) * V);
        for (int j = 0; j < V; j++) v[j] += bias;
        mgpu__store_floats(a.out + (size_t)i * V, v);
    }
}
static void mgpu__swap_outer_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__swap_outer_args *a = (const mgpu__swap_outer_args *)args;
    const void *tensors[2] = {a->in, a->out};
    int vector = mgpu__vector_width(a->inner, tensors, 2);
    size_t vectors = (size_t)a->outer * a->middle * a->inner / vector;
    void (*kernel)(mgpu__swap_outer_args, mgpu__divisor, mgpu__divisor) =
        vector == 4 ? mgpu__swap_outer_kernel<4> : mgpu__swap_outer_kernel<1>;
    kernel<<<mgpu__grid_for(vectors, 256), 256, 0, (cudaStream_t)ex->stream>>>(
        *a, mgpu__divisor_for((int)a->inner / vector), mgpu__divisor_for(a->outer));
    MGPU_CUDA_CHECK_LAUNCH();
}

/* dw = beta dw + the partial tiles [splits, K, C*R*S], added in order
   (the same result from run to run). The partial tiles' columns are in
   runs of `run` channels: in (c / run, r, s, c % run) order. With run 1
   that is dw's own (c, r, s) order; with run C, (r, s, c), channels
   fastest (conv_nhwc.h's weight gradient). They
   go to dw's (c, r, s), read in the partials' order (so that the many
   reads are coalesced, the one write of each value not), each place
   found by three divisions by multiplying (mgpu__div: dw has fewer than
   2^31 values). */
typedef struct {
    float *dw;
    const float *partials;
    float beta;
    int splits, k, c, rs, run;
} mgpu__wgrad_sum_args;
typedef struct {
    mgpu__divisor crs, run_len, run; /* C R S, R S run, run */
} mgpu__wgrad_sum_divisors;
static __global__ void mgpu__wgrad_sum_kernel(mgpu__wgrad_sum_args a, mgpu__wgrad_sum_divisors d) {
    int n = a.k * d.crs.d;
    MGPU__GRID_STRIDE_LOOP(i, (size_t)n) {
        float sum = 0.0f;
        for (int z = 0; z < a.splits; z++) sum += a.partials[(size_t)z * n + i];
        int o = (int)i;
        if (a.run > 1) {
            int filter = mgpu__div(o, d.crs), rest = o - filter * d.crs.d;
            int runs = mgpu__div(rest, d.run_len), in_run = rest - runs * d.run_len.d, rs = mgpu__div(in_run, d.run);
            o = filter * d.crs.d + (runs * a.run + in_run - rs * a.run) * a.rs + rs;
        }
        a.dw[o] = a.beta != 0.0f ? a.beta * a.dw[o] + sum : sum;
    }
}
static void mgpu__wgrad_sum(mgpu__wgrad_sum_args a, cudaStream_t stream) {
    size_t n = (size_t)a.k * a.c * a.rs;
    if (n >> 31) mgpu_fatal("internal: a weight gradient of %zu values, more than 2^31 - 1", n);
    mgpu__wgrad_sum_divisors d = {mgpu__divisor_for(a.c * a.rs), mgpu__divisor_for(a.rs * a.run),
                                  mgpu__divisor_for(a.run)};
    mgpu__wgrad_sum_kernel<<<mgpu__grid_for(n, 256), 256, 0, stream>>>(a, d);
    MGPU_CUDA_CHECK_LAUNCH();
}
#endif
#endif
