/* kernels/conv_few_inputs.h: the forward pass and the weight gradient of
   a convolution whose output pixel sees few inputs, C*R*S <= 9, in
   float32 (on a CPU the weight gradient alone): a network's first layer
   on grayscale images, as ResNet-18's stem (1 channel, 3x3) and LeNet's
   first convolution.

   Why. With so few terms a value, these passes are not products worth the
   tensor cores: the forward pass does 9 multiplies and adds for each value
   it writes, and the weight gradient [K, C*R*S] is a few hundred sums,
   each over every output pixel. What takes the time is memory: writing y,
   reading dy, each 51 MB for ResNet-18's stem at batch 256 (17 us at 3
   TB/s). An implicit GEMM's tiles, whose 64 or 128
   columns of (c, r, s) would hold 9, would be mostly waste (and
   conv_nhwc.h needs whole steps of 32 channels).

   The forward pass: a thread an output pixel (img, p, q) and a group of
   MGPU__FEW_FILTERS filters (grid.y). It loads its pixel's C*R*S inputs
   once (0 in the padding), takes the group's weights and biases from
   shared memory, and writes MGPU__FEW_FILTERS values: consecutive threads
   write consecutive pixels of a filter (coalesced).

   The weight gradient,
       dw[k, (c,r,s)] = sum over (img,p,q) of dy[img, k, p, q] * x[img, c, p*t + r - d, q*t + s - d]:
   a block sums a slice of the output pixels for a group of
   MGPU__FEW_WGRAD_FILTERS filters: each thread takes every 256th pixel
   of the slice (two at a time), loads its inputs and the group's dy
   there (coalesced), and adds their products to its C*R*S x
   MGPU__FEW_WGRAD_FILTERS sums.
   Then the block adds its threads' sums (each warp by shuffles, then the
   warps' in order through shared memory) into the slice's partial
   [K, C*R*S], and mgpu__wgrad_sum (conv.h) adds the slices'
   partials in order into dw: the same result from run to run.

   CPU: the weight gradient alone (mgpu/convolution.h takes it for a
   first layer on CPU devices; their forward pass is oneDNN's), an output
   row (img, p) at a time. The row's inputs are first laid out as C*R*S
   rows, in[i][q] (0 in the padding and past Q up to a whole number of
   vector lanes), and its K rows of dy copied likewise, so that every loop
   after runs along q over contiguous values, in vector lanes. For its
   slice of the output rows it keeps K*C*R*S sums of MGPU__FEW_LANES
   lanes in its part of the scratch, acc[k][i][j] += dy[k][q] in[i][q]
   for the q of lane j. The slices, a fixed share of the output rows each
   (as many as the CUDA kernel's), are the threads' units; at the end
   each slice's lanes, then the slices, are added in order into dw: as
   with the library's other CPU kernels, the result does not depend on
   the number of threads. What it replaces: oneDNN's weight gradient for these
   shapes, which works in its blocked layout (8 channels a vector: x's one
   channel uses one lane in 8) and copies x and dy into it. */
#ifndef MGPU_KERNELS_CONV_FEW_INPUTS_H
#define MGPU_KERNELS_CONV_FEW_INPUTS_H
#include "common.h"
#include "conv.h"


#define MGPU__FEW_INPUTS_MAX 9    /* C*R*S at most */
#define MGPU__FEW_FILTERS 16      /* filters a thread of the forward pass writes */
#define MGPU__FEW_WGRAD_FILTERS 4 /* filters a block of the weight gradient sums */
#define MGPU__FEW_THREADS 256

/* Whether these kernels compute a convolution of geometry g. */
static inline int mgpu__conv_few_inputs_fits(const mgpu__conv_geom *g) {
    return g->c * g->r * g->s <= MGPU__FEW_INPUTS_MAX;
}
/* The slices of the output pixels the weight gradient sums apart: about
   4096 pixels each (16 a thread), at most 64 (the partials' sum reads
   them one after the other). */
static inline int mgpu__conv_few_inputs_slices(const mgpu__conv_geom *g) {
    size_t pixels = (size_t)g->n * g->p * g->q, slices = (pixels + 4095) / 4096;
    return (int)(slices < 1 ? 1 : slices > 64 ? 64 : slices);
}

typedef struct {
    float *y;         /* [n, K, P, Q] */
    const float *x;   /* [n, C, H, W] */
    const float *w;   /* [K, C, R, S] */
    const float *b;   /* [K], or NULL */
    mgpu__conv_geom g;
} mgpu__conv_few_inputs_args;

typedef struct {
    float *dw;        /* [K, C*R*S]: beta * dw + the gradient */
    const float *dy;  /* [n, K, P, Q] */
    const float *x;   /* [n, C, H, W] */
    float *partials;  /* [slices, K, C*R*S] scratch (the CPU kernel's: [slices, K, C*R*S, MGPU__FEW_LANES]) */
    float beta;
    int slices;
    mgpu__conv_geom g;
} mgpu__conv_few_inputs_wgrad_args;

/* ---- CPU ---- */
#define MGPU__FEW_INPUTS_CPU_Q 256 /* the output rows' width, at most, that the CPU kernel takes */
#define MGPU__FEW_LANES 8          /* values a vector register holds (AVX2's 8 floats) */
static inline int mgpu__conv_few_inputs_cpu_fits(const mgpu__conv_geom *g) {
    return mgpu__conv_few_inputs_fits(g) && g->q <= MGPU__FEW_INPUTS_CPU_Q;
}
/* Output row (img, p)'s inputs: in[i][q] = x[img, c, p t + r - d, q t + s - d]
   for i = (c, r, s), 0 in the padding and past Q up to a whole number of
   lanes. Returns that rounded-up width. */
static int mgpu__few_inputs_row(const mgpu__conv_geom *g, const float *x, int img, int p,
                                float (*in)[MGPU__FEW_INPUTS_CPU_Q]) {
    int rs = g->r * g->s, width = (g->q + MGPU__FEW_LANES - 1) / MGPU__FEW_LANES * MGPU__FEW_LANES;
    for (int i = 0; i < g->c * rs; i++) {
        int c = i / rs, r = (i - c * rs) / g->s, s = i - c * rs - r * g->s;
        int h = p * g->stride + r - g->pad;
        if (h < 0 || h >= g->h) { /* a row of the padding */
            for (int q = 0; q < width; q++) in[i][q] = 0.0f;
            continue;
        }
        const float *row = x + (((size_t)img * g->c + c) * g->h + h) * g->w;
        for (int q = 0; q < width; q++) {
            int w = q * g->stride + s - g->pad;
            in[i][q] = q < g->q && w >= 0 && w < g->w ? row[w] : 0.0f;
        }
    }
    return width;
}
static void mgpu__conv_few_inputs_wgrad_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    enum { L = MGPU__FEW_LANES };
    const mgpu__conv_few_inputs_wgrad_args *a = (const mgpu__conv_few_inputs_wgrad_args *)args;
    const mgpu__conv_geom *g = &a->g;
    int crs = g->c * g->r * g->s, rows = g->n * g->p;
    size_t pq = (size_t)g->p * g->q, per_slice = (size_t)g->k * crs;
    MGPU__CPU_PARALLEL_FOR((size_t)rows * g->q * g->k)
    for (int slice = 0; slice < a->slices; slice++) {
        float in[MGPU__FEW_INPUTS_MAX][MGPU__FEW_INPUTS_CPU_Q], dy[MGPU__FEW_INPUTS_CPU_Q];
        float *acc = a->partials + (size_t)slice * per_slice * L; /* [K][C*R*S][L] */
        for (size_t j = 0; j < per_slice * L; j++) acc[j] = 0.0f;
        int first = (int)((long)rows * slice / a->slices), end = (int)((long)rows * (slice + 1) / a->slices);
        for (int row = first; row < end; row++) {
            int img = row / g->p, p = row - img * g->p;
            int width = mgpu__few_inputs_row(g, a->x, img, p, in);
            for (int k = 0; k < g->k; k++) {
                memcpy(dy, a->dy + ((size_t)img * g->k + k) * pq + (size_t)p * g->q, (size_t)g->q * sizeof(float));
                for (int q = g->q; q < width; q++) dy[q] = 0.0f;
                for (int i = 0; i < crs; i++) {
                    float *sum = acc + ((size_t)k * crs + i) * L;
                    for (int q0 = 0; q0 < width; q0 += L)
                        for (int j = 0; j < L; j++) sum[j] += dy[q0 + j] * in[i][q0 + j];
                }
            }
        }
    }
    for (size_t j = 0; j < per_slice; j++) { /* each slice's lanes, then the slices, in order */
        float total = 0.0f;
        for (int slice = 0; slice < a->slices; slice++)
            total += mgpu__sum_run(a->partials + ((size_t)slice * per_slice + j) * L, L);
        a->dw[j] = a->beta == 0.0f ? total : a->beta * a->dw[j] + total;
    }
}

#if MGPU_CUDA
/* The divisors the kernels use (mgpu__div, kernels/common.h), made once
   per launch from the geometry: the kernels find each output pixel's
   image and row by dividing by P*Q and Q. */
typedef struct {
    mgpu__divisor pq, q;
} mgpu__conv_divisors;
static mgpu__conv_divisors mgpu__conv_divisors_for(const mgpu__conv_geom *g) {
    mgpu__conv_divisors v = {mgpu__divisor_for(g->p * g->q), mgpu__divisor_for(g->q)};
    return v;
}
/* The inputs (c, r, s), decoded once a block into shared memory: r, s,
   and the offset in an image, c H W + r W + s (past C*R*S: r far outside,
   so that the input reads as 0). */
typedef struct {
    int r[MGPU__FEW_INPUTS_MAX], s[MGPU__FEW_INPUTS_MAX], offset[MGPU__FEW_INPUTS_MAX];
} mgpu__few_inputs_table;
static __device__ inline void mgpu__few_inputs_decode(const mgpu__conv_geom &g, mgpu__few_inputs_table *t) {
    int i = threadIdx.x, rs = g.r * g.s;
    if (i >= MGPU__FEW_INPUTS_MAX) return;
    int c = i / rs, r = (i - c * rs) / g.s, s = i - c * rs - r * g.s;
    t->r[i] = i < g.c * rs ? r : -(1 << 20);
    t->s[i] = s;
    t->offset[i] = (c * g.h + r) * g.w + s;
}
/* The inputs that output pixel l = (img, p, q) sees, in[(c, r, s)] (0 in
   the padding and past C*R*S), and where its output values go: dy's or
   y's offset of (img, 0, p, q). Filters are pq apart from there. */
static __device__ inline size_t mgpu__few_inputs_of(const mgpu__conv_geom &g, const mgpu__conv_divisors &dv,
                                                    const mgpu__few_inputs_table *t, const float *x, int l,
                                                    float (&in)[MGPU__FEW_INPUTS_MAX]) {
    int img = mgpu__div(l, dv.pq), in_image = l - img * dv.pq.d, p = mgpu__div(in_image, dv.q);
    int h0 = p * g.stride - g.pad, w0 = (in_image - p * g.q) * g.stride - g.pad;
    const float *image = x + (size_t)img * g.c * g.h * g.w;
    int corner = h0 * g.w + w0; /* (c, r, s) = 0's place, maybe in the padding */
    for (int i = 0; i < MGPU__FEW_INPUTS_MAX; i++) {
        int h = h0 + t->r[i], w = w0 + t->s[i];
        in[i] = (unsigned)h < (unsigned)g.h && (unsigned)w < (unsigned)g.w /* 0 <= h < H */
                    ? image[corner + t->offset[i]]
                    : 0.0f;
    }
    return (size_t)img * g.k * dv.pq.d + in_image;
}

static __global__ void __launch_bounds__(MGPU__FEW_THREADS)
mgpu__conv_few_inputs_kernel(mgpu__conv_few_inputs_args a, mgpu__conv_divisors dv) {
    const mgpu__conv_geom g = a.g;
    __shared__ float w[MGPU__FEW_FILTERS][MGPU__FEW_INPUTS_MAX], bias[MGPU__FEW_FILTERS];
    __shared__ mgpu__few_inputs_table table;
    mgpu__few_inputs_decode(g, &table);
    int crs = g.c * g.r * g.s, filter0 = blockIdx.y * MGPU__FEW_FILTERS;
    for (int i = threadIdx.x; i < MGPU__FEW_FILTERS * MGPU__FEW_INPUTS_MAX; i += blockDim.x) {
        int f = i / MGPU__FEW_INPUTS_MAX, j = i - f * MGPU__FEW_INPUTS_MAX;
        w[f][j] = filter0 + f < g.k && j < crs ? a.w[(size_t)(filter0 + f) * crs + j] : 0.0f;
    }
    if (threadIdx.x < MGPU__FEW_FILTERS)
        bias[threadIdx.x] = a.b && filter0 + (int)threadIdx.x < g.k ? a.b[filter0 + threadIdx.x] : 0.0f;
    __syncthreads();
    int pixels = g.n * g.p * g.q, pq = g.p * g.q;
    int l = blockIdx.x * blockDim.x + threadIdx.x;
    if (l >= pixels) return;
    float in[MGPU__FEW_INPUTS_MAX];
    float *out = a.y + mgpu__few_inputs_of(g, dv, &table, a.x, l, in) + (size_t)filter0 * pq;
    for (int f = 0; f < MGPU__FEW_FILTERS; f++) {
        float sum = bias[f];
        for (int i = 0; i < MGPU__FEW_INPUTS_MAX; i++) sum += w[f][i] * in[i];
        if (filter0 + f < g.k) out[(size_t)f * pq] = sum;
    }
}

static __global__ void __launch_bounds__(MGPU__FEW_THREADS)
mgpu__conv_few_inputs_wgrad_kernel(mgpu__conv_few_inputs_wgrad_args a, mgpu__conv_divisors dv) {
    enum { F = MGPU__FEW_WGRAD_FILTERS, I = MGPU__FEW_INPUTS_MAX, WARPS = MGPU__FEW_THREADS / 32 };
    const mgpu__conv_geom g = a.g;
    __shared__ float per_warp[WARPS][F * I];
    __shared__ mgpu__few_inputs_table table;
    mgpu__few_inputs_decode(g, &table);
    __syncthreads();
    int crs = g.c * g.r * g.s, pq = g.p * g.q, filter0 = blockIdx.y * F;
    int pixels = g.n * pq, per = (pixels + a.slices - 1) / a.slices;
    int first = blockIdx.x * per, end = first + per < pixels ? first + per : pixels;
    float sum[F][I] = {};
    /* Two pixels a trip, their loads all issued before the products: with
       only dy's 4 values a pixel from memory, one pixel's loads would keep
       too few bytes in flight for memory's latency. */
    auto load = [&](int l, float (&in)[I], float (&dy)[F]) {
        const float *at = a.dy + mgpu__few_inputs_of(g, dv, &table, a.x, l < end ? l : first, in) +
                          (size_t)filter0 * pq;
        for (int f = 0; f < F; f++) dy[f] = l < end && filter0 + f < g.k ? at[(size_t)f * pq] : 0.0f;
    };
    for (int l = first + threadIdx.x; l < end; l += 2 * blockDim.x) {
        float in[2][I], dy[2][F];
        load(l, in[0], dy[0]);
        load(l + blockDim.x, in[1], dy[1]); /* (past the slice: dy 0) */
        for (int p = 0; p < 2; p++)
            for (int f = 0; f < F; f++)
                for (int i = 0; i < I; i++) sum[f][i] += dy[p][f] * in[p][i];
    }
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int f = 0; f < F; f++)
        for (int i = 0; i < I; i++) {
            float v = mgpu__warp_allreduce(sum[f][i], mgpu__sum_op());
            if (lane == 0) per_warp[warp][f * I + i] = v;
        }
    __syncthreads();
    int f = threadIdx.x / I, i = threadIdx.x - f * I;
    if (f < F && i < crs && filter0 + f < g.k) {
        float total = 0.0f;
        for (int v = 0; v < WARPS; v++) total += per_warp[v][f * I + i];
        a.partials[((size_t)blockIdx.x * g.k + filter0 + f) * crs + i] = total;
    }
}

static void mgpu__conv_few_inputs_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__conv_few_inputs_args *a = (const mgpu__conv_few_inputs_args *)args;
    size_t pixels = (size_t)a->g.n * a->g.p * a->g.q;
    dim3 grid((unsigned)((pixels + MGPU__FEW_THREADS - 1) / MGPU__FEW_THREADS),
              (unsigned)((a->g.k + MGPU__FEW_FILTERS - 1) / MGPU__FEW_FILTERS));
    mgpu__conv_few_inputs_kernel<<<grid, MGPU__FEW_THREADS, 0, (cudaStream_t)ex->stream>>>(
        *a, mgpu__conv_divisors_for(&a->g));
    MGPU_CUDA_CHECK_LAUNCH();
}
static void mgpu__conv_few_inputs_wgrad_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__conv_few_inputs_wgrad_args *a = (const mgpu__conv_few_inputs_wgrad_args *)args;
    dim3 grid((unsigned)a->slices, (unsigned)((a->g.k + MGPU__FEW_WGRAD_FILTERS - 1) / MGPU__FEW_WGRAD_FILTERS));
    mgpu__conv_few_inputs_wgrad_kernel<<<grid, MGPU__FEW_THREADS, 0, (cudaStream_t)ex->stream>>>(
        *a, mgpu__conv_divisors_for(&a->g));
    MGPU_CUDA_CHECK_LAUNCH();
    mgpu__wgrad_sum_args sum = {a->dw, a->partials, a->beta, a->slices, a->g.k, a->g.c, a->g.r * a->g.s, 1};
    mgpu__wgrad_sum(sum, (cudaStream_t)ex->stream);
}
#endif
#endif
