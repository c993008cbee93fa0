/* kernels/conv_implicit.h: the convolution's forward pass and both its
   gradients as implicit GEMMs on the tensor cores (GPU only, TF32), an
   experiment beside conv.h's im2col.

   Why. conv.h writes the col buffer [C*R*S, n*P*Q] to memory and the
   product reads it back: for a 3x3 convolution that is 9 times its input,
   twice. bench/traffic.py counts 31 GB of memory traffic per ResNet-18
   step at batch 256, most of it col buffers, against 3 GB without them.
   An implicit GEMM computes the same product, Y = W col, but gathers each
   tile of col from x while loading it into shared memory, so col never
   exists in device memory (cuDNN's main algorithm works this way).

   The product. Y [K, n*P*Q] = W [K, C*R*S] col [C*R*S, n*P*Q], with
       col[(c,r,s), (img,p,q)] = x[img, c, p*t + r - d, q*t + s - d]
   (0 in the padding), written straight to y[img, k, p, q] with the bias.

   The kernel. A block computes a tile of Y, 64 x 64 (64 filters, 64
   output pixels), 128 x 64, 64 x 128 or 128 x 128 (the fastest for the
   shape, measured: mgpu__conv_plan_for in mgpu.h), with 4 warps, each a
   quarter of it as 16 x 16 WMMA tiles, stepping through C*R*S 16 at a
   time. For each step:
     1. 16 threads decode the step's 16 values of (c, r, s) into a table
        in shared memory (the offset of c, r and s in x, and r and s);
     2. all threads load the W tile [rows x 16] (rows of W are contiguous)
        and gather the col tile [16 x pixels] into registers: each thread
        owns one output pixel (its column) for the whole kernel, decoded
        once, so a gather is an add, two range tests and a load;
     3. the values go to shared memory, rounded to TF32;
     4. each warp multiplies its tiles with the tensor cores (two WMMA
        steps of k = 8, the sums in float32).
   The steps overlap (mgpu__implicit_product): the loads of step i + 1 are
   in flight while the tensor cores multiply step i, from a second copy of
   the tiles. At the end the accumulators go through shared memory, 64
   rows at a time, so that the writes to y are consecutive pixels of one
   filter (coalesced). Resources a block on sm_90 (ptxas -v; spills in
   bytes, of forward / dx / dW):
       tile       registers a thread  blocks a multiprocessor  shared memory  spills
       64 x 64           128                   4                  19.5 KB      0 / 0 / 0
       128 x 64          168                   3                  29.5 KB      0 / 0 / 0
       64 x 128          168                   3                  33.5 KB      0 / 0 / 0
       128 x 128         255                   2                  37.5 KB      8 / 0 / 0

   The input gradient is the same machine on another product: dx [C,
   n*H*W] = W^T dcol with dcol never written either,
       dx[img, c, h, w] = sum over (k, r, s) of w[k, c, r, s] * dy[img, k, p, q]
   where p = (h + d - r) / t and q = (w + d - s) / t must be whole and
   inside the output (the windows that covered the pixel). Rows are input
   channels, columns input pixels, steps (k, r, s).

   And the weight gradient, dW [K, C*R*S] = G col^T:
       dw[k, (c,r,s)] = sum over (img,p,q) of dy[img, k, p, q] * x[img, c, p*t + r - d, q*t + s - d]
   Rows are filters, columns (c, r, s), steps output pixels. The output is
   small (for stage 1, 64 x 576: 9 tiles) and the sum long (n*P*Q =
   200704 values at batch 256), so the sum is split over blocks (grid.z):
   each adds up a slice of the pixels into its own partial tile, and a
   second kernel adds the partial tiles in order (the same result from run
   to run) into dw.

   Used for a convolution that may use TF32 (mgpu_set_tf32) when
   MGPU_CONV=implicit, or with MGPU_CONV=auto (the default) when it is
   faster than conv.h's im2col for the convolution's shape; either way in
   the tile that was fastest, timed at the first call (mgpu__conv_plan_for
   in mgpu.h). bench/conv times each tile against im2col and cuDNN. */
#ifndef MGPU_KERNELS_CONV_IMPLICIT_H
#define MGPU_KERNELS_CONV_IMPLICIT_H
#include "common.h"
#include "conv.h"


#if MGPU_CUDA
#define MGPU__IMPLICIT_STEP 16     /* values of the summed index per step */
#define MGPU__IMPLICIT_THREADS 128 /* 4 warps, in 2 x 2 over the block's tile */
#define MGPU__IMPLICIT_OUT_ROWS 64 /* rows of the finished tile written out at a time */
/* Blocks a multiprocessor should hold: 65536 registers / (128 threads x
   blocks) caps a thread's registers, 128 for 64 x 64, 168 for the middle
   tiles, 255 for 128 x 128 (whose 16 accumulator tiles alone take 128). */
#define MGPU__IMPLICIT_BLOCKS_PER_SM(TM, TN) ((TM) * (TN) <= 64 * 64 ? 4 : (TM) * (TN) <= 128 * 64 ? 3 : 2)

/* The divisors the kernels use (mgpu__div, kernels/elementwise.h), made
   once per launch from the geometry: the kernels divide in every step
   (decoding the summed index, in the warp that the others then wait for
   at the barrier) and, for dx, twice in every value they gather. */
typedef struct {
    mgpu__divisor rs, s, pq, q, hw, w, stride;
} mgpu__conv_divisors;
static mgpu__conv_divisors mgpu__conv_divisors_for(const mgpu__conv_geom *g) {
    mgpu__conv_divisors v = {mgpu__divisor_for(g->r * g->s), mgpu__divisor_for(g->s),
                             mgpu__divisor_for(g->p * g->q), mgpu__divisor_for(g->q),
                             mgpu__divisor_for(g->h * g->w), mgpu__divisor_for(g->w),
                             mgpu__divisor_for(g->stride)};
    return v;
}

/* The block tiles compiled, rows x columns of the product (rows: filters
   or channels; columns: pixels, or (c, r, s) for dW). A larger tile reads
   fewer values from shared memory per multiply-add (a warp's 16 x 16
   fragments: 64 x 64, 1 per 16; 128 x 64 and 64 x 128, 1 per 21; 128 x
   128, 1 per 32) but gives fewer blocks, and a 128-row tile wastes half
   its work on a layer of 64 filters. mgpu.h times each tile on each
   shape and keeps the fastest; bench/conv shows them all. */
typedef enum {
    MGPU__TILE_64x64, MGPU__TILE_128x64, MGPU__TILE_64x128, MGPU__TILE_128x128, MGPU__TILE_KINDS
} mgpu__implicit_tile;
static const int mgpu__implicit_tile_rows[MGPU__TILE_KINDS] = {64, 128, 64, 128};
static const int mgpu__implicit_tile_columns[MGPU__TILE_KINDS] = {64, 64, 128, 128};
static const char *const mgpu__implicit_tile_names[MGPU__TILE_KINDS] = {"64x64", "128x64", "64x128",
                                                                        "128x128"};

/* A block's tiles in shared memory, for a TM x TN tile of the product:
   two copies of the step's tiles (one being multiplied, the next being
   filled), and at the end, in the same bytes, 64 rows of the finished
   tile on their way to memory. Rows are padded, as WMMA wants leading
   dimensions that are multiples of 4 floats, and by as much as keeps the
   warps' fragment loads free of bank conflicts. A TF32 fragment of a
   (row-major, as PTX's mma.m16n8k8 lays it out) has lane l read row l/4,
   column l%4: with rows 20 floats apart, the 8 rows start on banks 0, 20,
   8, 28, 16, 4, 24, 12, and the 32 lanes hit 32 banks. A fragment of b
   has lane l read row l%4, column l/4: rows TN + 8 apart (8 banks) put the
   4 rows on banks 0, 8, 16, 24 and the 32 lanes on 32 banks, where TN + 4
   would have two lanes on each of 16 banks, reading b at half speed. */
template <int TM, int TN> union mgpu__implicit_tiles {
    static_assert(TM % MGPU__IMPLICIT_OUT_ROWS == 0, "the tile is written out 64 rows at a time");
    struct {
        float a[2][TM][MGPU__IMPLICIT_STEP + 4]; /* rows x step */
        float b[2][MGPU__IMPLICIT_STEP][TN + 8]; /* step x columns */
    } step;
    float out[MGPU__IMPLICIT_OUT_ROWS][TN + 4]; /* rows x columns */
};

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800 /* TF32 WMMA: sm_80 and newer */
typedef nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 8, float> mgpu__implicit_acc;

/* What one thread loads of a step's tiles, for a TM x TN block tile. In
   the rows x step tile a: always the same step column (tid % STEP) and
   every ROWS_APART-th row from tid / STEP, A_PER of them; in the step x
   columns tile b: always the same column (tid % TN) and every
   B_APART-th step row from tid / TN, B_PER of them. Each warp owns a
   (TM/2) x (TN/2) corner of the tile as FM x FN WMMA tiles of 16 x 16. */
template <int TM, int TN> struct mgpu__implicit_layout {
    static const int A_PER = TM * MGPU__IMPLICIT_STEP / MGPU__IMPLICIT_THREADS;
    static const int A_APART = MGPU__IMPLICIT_THREADS / MGPU__IMPLICIT_STEP;
    static const int B_PER = TN * MGPU__IMPLICIT_STEP / MGPU__IMPLICIT_THREADS;
    static const int B_APART = MGPU__IMPLICIT_THREADS / TN;
    static const int FM = TM / 32, FN = TN / 32;
    static_assert(TN <= MGPU__IMPLICIT_THREADS && MGPU__IMPLICIT_THREADS % TN == 0,
                  "a column per thread");
};

/* The values loaded from memory into the tiles of copy `slot`, rounded to
   TF32 here once rather than by every warp that reads them. */
template <int TM, int TN>
static __device__ void mgpu__implicit_stage(mgpu__implicit_tiles<TM, TN> *t, int slot,
                                            const float (&a)[mgpu__implicit_layout<TM, TN>::A_PER],
                                            const float (&b)[mgpu__implicit_layout<TM, TN>::B_PER]) {
    typedef mgpu__implicit_layout<TM, TN> L;
    int tid = threadIdx.x;
    for (int j = 0; j < L::A_PER; j++)
        t->step.a[slot][tid / MGPU__IMPLICIT_STEP + j * L::A_APART][tid % MGPU__IMPLICIT_STEP] =
            nvcuda::wmma::__float_to_tf32(a[j]);
    for (int j = 0; j < L::B_PER; j++)
        t->step.b[slot][tid / TN + j * L::B_APART][tid % TN] = nvcuda::wmma::__float_to_tf32(b[j]);
}

/* acc += a b for warp `warp`'s FM x FN tiles of 16 x 16, from copy
   `slot`: two tensor-core steps of k = 8. */
template <int TM, int TN>
static __device__ void mgpu__implicit_multiply(mgpu__implicit_acc (&acc)[TM / 32][TN / 32],
                                               const mgpu__implicit_tiles<TM, TN> *t, int slot, int warp) {
    using namespace nvcuda;
    const int FM = TM / 32, FN = TN / 32;
    int row = (warp / 2) * (TM / 2), col = (warp % 2) * (TN / 2);
    for (int kk = 0; kk < MGPU__IMPLICIT_STEP; kk += 8) {
        wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> fa[FM];
        wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> fb[FN];
        for (int i = 0; i < FM; i++)
            wmma::load_matrix_sync(fa[i], &t->step.a[slot][row + 16 * i][kk], MGPU__IMPLICIT_STEP + 4);
        for (int j = 0; j < FN; j++)
            wmma::load_matrix_sync(fb[j], &t->step.b[slot][kk][col + 16 * j], TN + 8);
        for (int i = 0; i < FM; i++)
            for (int j = 0; j < FN; j++) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
}

/* The block's finished tile of TM rows, in the warps' accumulators, to
   memory through a buffer `out` of 64 rows in shared memory, 64 rows at a
   time: store(m0) puts the thread's accumulators of rows m0 .. m0 + 63
   of the tile (if it has any) into out; write(m0) takes those rows from
   out to memory. The caller has made sure no warp still reads the bytes
   of out. (Used by conv_nhwc.h too, whose accumulators are laid out
   otherwise.) */
template <int TM, typename Store, typename Write>
static __device__ void mgpu__implicit_finish(Store store, Write write) {
    MGPU__UNROLL
    for (int m0 = 0; m0 < TM; m0 += MGPU__IMPLICIT_OUT_ROWS) {
        store(m0);
        __syncthreads();
        write(m0);
        __syncthreads(); /* out is read before the next rows take it */
    }
}

/* This thread's column of the finished rows in `out` to memory: row
   row0 + m goes to column[(row0 + m) * row_stride], plus bias[row0 + m]
   when there is a bias, and added to what is there with accumulate, for
   the rows below `rows`. Consecutive threads hold consecutive columns, so
   the writes of a row are coalesced. */
template <int TN>
static __device__ void mgpu__implicit_write(const float (*out)[TN + 4], float *column, size_t row_stride,
                                            int row0, int rows, const float *bias, int accumulate) {
    int tid = threadIdx.x;
    for (int m = tid / TN; m < MGPU__IMPLICIT_OUT_ROWS; m += MGPU__IMPLICIT_THREADS / TN) {
        int row = row0 + m;
        if (row >= rows) continue;
        float *to = column + (size_t)row * row_stride, value = out[m][tid % TN] + (bias ? bias[row] : 0.0f);
        *to = accumulate ? *to + value : value;
    }
}

/* The loop the three kernels share: acc = the block's tile of the product,
   summed over `total` values of the inner index, MGPU__IMPLICIT_STEP at a
   time; then the tile to memory, 64 rows at a time through t->out. Each
   kernel says how to load a step and where the tile goes:
     decode(k0, slot)    run by threads tid < STEP: writes the kernel's
                         table (in shared memory, copy `slot`) of what the
                         step's inner index values k0 + tid mean;
     gather(k0, slot, a, b)  loads this thread's values of the step's two
                         tiles from memory into a and b, using the table;
     write(m0)           run by every thread: rows m0 .. m0 + 63 of the
                         tile, now in t->out, to memory (mgpu__implicit_write).
   Double buffered, so that memory and the tensor cores work at once:
   while the warps multiply step i from one copy of the tiles, the loads
   of step i + 1 are in flight into registers, and go to the other copy
   after the multiply; the table of step i + 2 is decoded meanwhile. One
   barrier per step. At the end the tile goes through shared memory, so
   that the kernel can write it out in whatever order memory wants. */
template <int TM, int TN, typename Decode, typename Gather, typename Write>
static __device__ void mgpu__implicit_product(mgpu__implicit_tiles<TM, TN> *t, int total,
                                              Decode decode, Gather gather, Write write) {
    using namespace nvcuda;
    typedef mgpu__implicit_layout<TM, TN> L;
    const int S = MGPU__IMPLICIT_STEP;
    int tid = threadIdx.x, warp = tid / 32;
    float a[L::A_PER], b[L::B_PER];
    mgpu__implicit_acc acc[L::FM][L::FN];
    for (int i = 0; i < L::FM; i++)
        for (int j = 0; j < L::FN; j++) wmma::fill_fragment(acc[i][j], 0.0f);
    if (tid < S) decode(0, 0);
    __syncthreads();
    gather(0, 0, a, b);
    if (tid < S) decode(S, 1);
    mgpu__implicit_stage(t, 0, a, b);
    __syncthreads();
    for (int k0 = 0, slot = 0; k0 < total; k0 += S, slot ^= 1) {
        bool more = k0 + S < total;
        if (more) gather(k0 + S, slot ^ 1, a, b);    /* loads in flight ... */
        mgpu__implicit_multiply(acc, t, slot, warp); /* ... while the tensor cores work */
        if (tid < S) decode(k0 + 2 * S, slot); /* this copy's table was last read before the barrier */
        if (more) mgpu__implicit_stage(t, slot ^ 1, a, b); /* and so was this copy of the tiles */
        __syncthreads();
    }
    /* the product is over (every warp is past the last barrier): out can
       take the bytes of the step tiles */
    int row = (warp / 2) * (TM / 2), col = (warp % 2) * (TN / 2);
    auto store = [&](int m0) { /* (a warp's rows lie in one block of 64) */
        if (row / MGPU__IMPLICIT_OUT_ROWS != m0 / MGPU__IMPLICIT_OUT_ROWS) return;
        for (int i = 0; i < L::FM; i++)
            for (int j = 0; j < L::FN; j++)
                wmma::store_matrix_sync(&t->out[row - m0 + 16 * i][col + 16 * j], acc[i][j], TN + 4,
                                        wmma::mem_row_major);
    };
    mgpu__implicit_finish<TM>(store, write);
}

#endif

typedef struct {
    float *y;       /* [n, K, P, Q] */
    const float *x; /* [n, C, H, W] */
    const float *w; /* [K, C*R*S] */
    const float *b; /* [K] or NULL */
    mgpu__conv_geom g;
    mgpu__implicit_tile tile;
} mgpu__conv_implicit_args;

template <int TM, int TN>
static __global__ void __launch_bounds__(MGPU__IMPLICIT_THREADS, MGPU__IMPLICIT_BLOCKS_PER_SM(TM, TN))
mgpu__conv_implicit_kernel(mgpu__conv_implicit_args a, mgpu__conv_divisors dv) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    typedef mgpu__implicit_layout<TM, TN> L;
    const mgpu__conv_geom g = a.g;
    const int S = MGPU__IMPLICIT_STEP;
    __shared__ __align__(32) mgpu__implicit_tiles<TM, TN> t;
    __shared__ int k_offset[2][S], k_r[2][S], k_s[2][S]; /* a step's (c, r, s), decoded */

    int tid = threadIdx.x;
    int rs = g.r * g.s, crs = g.c * rs, pq = g.p * g.q, hw = g.h * g.w;
    int filter0 = blockIdx.y * TM, pixel0 = blockIdx.x * TN, npq = g.n * pq;
    /* this thread's output pixel (column of the col tile), decoded once */
    int column = tid % TN, pixel = pixel0 + column;
    int img = mgpu__div(pixel, dv.pq), in_image = pixel - img * pq, p = mgpu__div(in_image, dv.q);
    int h0 = p * g.stride - g.pad, w0 = (in_image - p * g.q) * g.stride - g.pad;
    const float *x_pixel = a.x + (size_t)img * g.c * hw + (h0 * g.w + w0);

    auto decode = [&](int k0, int slot) { /* k = (c, r, s) */
        int k = k0 + tid, c = mgpu__div(k, dv.rs), r = mgpu__div(k - c * rs, dv.s), s = k - c * rs - r * g.s;
        k_offset[slot][tid] = k < crs ? c * hw + r * g.w + s : 0;
        k_r[slot][tid] = k < crs ? r : -(1 << 20); /* past the end: outside every image */
        k_s[slot][tid] = s;
    };
    auto gather = [&](int k0, int slot, float (&wv)[L::A_PER], float (&colv)[L::B_PER]) {
        int k = k0 + tid % S; /* W's rows are contiguous in k */
        for (int j = 0; j < L::A_PER; j++) {
            int filter = filter0 + tid / S + j * L::A_APART;
            wv[j] = filter < g.k && k < crs ? a.w[(size_t)filter * crs + k] : 0.0f;
        }
        for (int j = 0; j < L::B_PER; j++) { /* col: this thread's pixel, gathered from x */
            int kk = tid / TN + j * L::B_APART, h = h0 + k_r[slot][kk], w = w0 + k_s[slot][kk];
            colv[j] = pixel < npq && (unsigned)h < (unsigned)g.h && (unsigned)w < (unsigned)g.w /* 0 <= h < H */
                          ? x_pixel[k_offset[slot][kk]]
                          : 0.0f;
        }
    };
    auto write = [&](int m0) { /* the tile of Y to y [img, filter, p, q], with the bias */
        if (pixel < npq)
            mgpu__implicit_write<TN>(t.out, a.y + (size_t)img * g.k * pq + in_image, pq, filter0 + m0, g.k, a.b, 0);
    };
    mgpu__implicit_product(&t, crs, decode, gather, write);
#endif
}

typedef struct {
    float *dx;       /* [n, C, H, W] */
    const float *dy; /* [n, K, P, Q] */
    const float *w;  /* [K, C, R, S] */
    mgpu__conv_geom g;
    mgpu__implicit_tile tile;
    int accumulate;  /* 1: dx += the gradient; 0: dx = it */
} mgpu__conv_implicit_dgrad_args;

template <int TM, int TN>
static __global__ void __launch_bounds__(MGPU__IMPLICIT_THREADS, MGPU__IMPLICIT_BLOCKS_PER_SM(TM, TN))
mgpu__conv_implicit_dgrad_kernel(mgpu__conv_implicit_dgrad_args a, mgpu__conv_divisors dv) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    typedef mgpu__implicit_layout<TM, TN> L;
    const mgpu__conv_geom g = a.g;
    const int S = MGPU__IMPLICIT_STEP;
    __shared__ __align__(32) mgpu__implicit_tiles<TM, TN> t;
    __shared__ int k_w[2][S], k_dy[2][S], k_r[2][S], k_s[2][S]; /* a step's (k, r, s), decoded */

    int tid = threadIdx.x;
    int rs = g.r * g.s, krs = g.k * rs, pq = g.p * g.q, hw = g.h * g.w;
    int channel0 = blockIdx.y * TM, pixel0 = blockIdx.x * TN, nhw = g.n * hw;
    /* this thread's input pixel, decoded once */
    int column = tid % TN, pixel = pixel0 + column;
    int img = mgpu__div(pixel, dv.hw), in_image = pixel - img * hw, row_in_image = mgpu__div(in_image, dv.w);
    int h = row_in_image + g.pad, w = in_image - row_in_image * g.w + g.pad; /* + d: p*t = h + d - r */
    const float *dy_img = a.dy + (size_t)img * g.k * pq;

    auto decode = [&](int k0, int slot) { /* k = (filter, r, s) */
        int k = k0 + tid, filter = mgpu__div(k, dv.rs), r = mgpu__div(k - filter * rs, dv.s);
        int s = k - filter * rs - r * g.s;
        k_w[slot][tid] = k < krs ? filter * g.c * rs + r * g.s + s : 0;
        k_dy[slot][tid] = k < krs ? filter * pq : 0;
        k_r[slot][tid] = k < krs ? r : (1 << 20); /* past the end: no window */
        k_s[slot][tid] = s;
    };
    auto gather = [&](int k0, int slot, float (&wv)[L::A_PER], float (&dcolv)[L::B_PER]) {
        int kk = tid % S; /* W^T: rows are channels, w[k, c, r, s] */
        for (int j = 0; j < L::A_PER; j++) {
            int channel = channel0 + tid / S + j * L::A_APART;
            wv[j] = channel < g.c && k0 + kk < krs ? a.w[k_w[slot][kk] + channel * rs] : 0.0f;
        }
        for (int j = 0; j < L::B_PER; j++) { /* dcol, gathered from dy: the windows that covered this pixel */
            int row = tid / TN + j * L::B_APART;
            int hp = h - k_r[slot][row], wp = w - k_s[slot][row];
            int p = mgpu__div(hp, dv.stride), q = mgpu__div(wp, dv.stride); /* used if hp, wp >= 0 */
            bool inside = pixel < nhw && hp >= 0 && wp >= 0 && p * g.stride == hp &&
                          q * g.stride == wp && p < g.p && q < g.q;
            dcolv[j] = inside ? dy_img[k_dy[slot][row] + p * g.q + q] : 0.0f;
        }
    };
    auto write = [&](int m0) {
        if (pixel < nhw)
            mgpu__implicit_write<TN>(t.out, a.dx + (size_t)img * g.c * hw + in_image, hw, channel0 + m0, g.c, NULL,
                                     a.accumulate);
    };
    mgpu__implicit_product(&t, krs, decode, gather, write);
#endif
}

typedef struct {
    float *dw;         /* [K, C*R*S]: beta * dw + the gradient */
    const float *dy;   /* [n, K, P, Q] */
    const float *x;    /* [n, C, H, W] */
    float *partials;   /* [splits, K, C*R*S] scratch */
    float beta;
    int splits;        /* slices of the sum over the output pixels */
    mgpu__conv_geom g;
    mgpu__implicit_tile tile;
} mgpu__conv_implicit_wgrad_args;

/* The most floats a product's slices' partial tiles take (64 MB). */
#define MGPU__PARTIAL_FLOATS_MAX ((size_t)16 << 20)
/* Slices of the sum over output pixels for a weight gradient of `tiles`
   tiles: about `blocks` blocks in all, each summing at least `least`
   pixels, the partial tiles at most MGPU__PARTIAL_FLOATS_MAX. */
static int mgpu__conv_wgrad_splits_of(const mgpu__conv_geom *g, size_t tiles, size_t blocks, size_t least) {
    size_t crs = (size_t)g->c * g->r * g->s, pixels = (size_t)g->n * g->p * g->q;
    size_t splits = (blocks + tiles - 1) / tiles;
    if (splits > pixels / least) splits = pixels / least;
    size_t most = MGPU__PARTIAL_FLOATS_MAX / ((size_t)g->k * crs);
    if (splits > most) splits = most;
    if (splits > 65535) splits = 65535; /* grid.z */
    return splits < 1 ? 1 : (int)splits;
}
/* The same in a tile kind. This kernel takes 1024 blocks of 256 pixels or
   more (mgpu__conv_implicit_wgrad_splits); conv_nhwc.h's fewer and longer
   ones (it multiplies faster, in less time than reading and writing more
   partial tiles would take). */
static int mgpu__conv_wgrad_splits(const mgpu__conv_geom *g, mgpu__implicit_tile tile, size_t blocks,
                                   size_t least) {
    size_t crs = (size_t)g->c * g->r * g->s, rows = mgpu__implicit_tile_rows[tile],
           columns = mgpu__implicit_tile_columns[tile];
    return mgpu__conv_wgrad_splits_of(g, ((size_t)g->k + rows - 1) / rows * ((crs + columns - 1) / columns), blocks,
                                      least);
}
static int mgpu__conv_implicit_wgrad_splits(const mgpu__conv_geom *g, mgpu__implicit_tile tile) {
    return mgpu__conv_wgrad_splits(g, tile, 1024, 256);
}

template <int TM, int TN>
static __global__ void __launch_bounds__(MGPU__IMPLICIT_THREADS, MGPU__IMPLICIT_BLOCKS_PER_SM(TM, TN))
mgpu__conv_implicit_wgrad_kernel(mgpu__conv_implicit_wgrad_args a, mgpu__conv_divisors dv) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    typedef mgpu__implicit_layout<TM, TN> L;
    const mgpu__conv_geom g = a.g;
    const int S = MGPU__IMPLICIT_STEP;
    __shared__ __align__(32) mgpu__implicit_tiles<TM, TN> t;
    __shared__ int l_dy[2][S], l_x[2][S], l_h[2][S], l_w[2][S]; /* a step's output pixels, decoded */

    int tid = threadIdx.x;
    int rs = g.r * g.s, crs = g.c * rs, pq = g.p * g.q, hw = g.h * g.w;
    int filter0 = blockIdx.y * TM, column0 = blockIdx.x * TN;
    /* this block's slice of the output pixels */
    int pixels = g.n * pq, per = (pixels + a.splits - 1) / a.splits;
    int first = blockIdx.z * per, count = (first + per < pixels ? first + per : pixels) - first;
    /* this thread's (c, r, s), decoded once */
    int column = tid % TN, k = column0 + column;
    int c = mgpu__div(k, dv.rs), r = mgpu__div(k - c * rs, dv.s), s = k - c * rs - r * g.s;
    const float *x_c = a.x + (size_t)c * hw;

    auto decode = [&](int l0, int slot) { /* l = first + l0 + tid = (img, p, q) */
        int l = first + l0 + tid, img = mgpu__div(l, dv.pq), in_image = l - img * pq;
        int p = mgpu__div(in_image, dv.q);
        bool inside = l0 + tid < count;
        l_dy[slot][tid] = inside ? img * g.k * pq + in_image : 0;
        l_x[slot][tid] = inside ? img * g.c * hw : 0;
        l_h[slot][tid] = inside ? p * g.stride - g.pad : -(1 << 20);
        l_w[slot][tid] = (in_image - p * g.q) * g.stride - g.pad;
    };
    auto gather = [&](int l0, int slot, float (&gv)[L::A_PER], float (&colv)[L::B_PER]) {
        int kk = tid % S; /* G (dy): rows are filters */
        for (int j = 0; j < L::A_PER; j++) {
            int filter = filter0 + tid / S + j * L::A_APART;
            gv[j] = filter < g.k && l0 + kk < count ? a.dy[l_dy[slot][kk] + filter * pq] : 0.0f;
        }
        for (int j = 0; j < L::B_PER; j++) { /* col^T, gathered from x: this thread's (c, r, s) */
            int row = tid / TN + j * L::B_APART, h = l_h[slot][row] + r, w = l_w[slot][row] + s;
            colv[j] = k < crs && (unsigned)h < (unsigned)g.h && (unsigned)w < (unsigned)g.w /* 0 <= h < H */
                          ? x_c[l_x[slot][row] + h * g.w + w]
                          : 0.0f;
        }
    };
    auto write = [&](int m0) {
        if (k < crs)
            mgpu__implicit_write<TN>(t.out, a.partials + (size_t)blockIdx.z * g.k * crs + k, crs, filter0 + m0, g.k, NULL,
                                     0);
    };
    mgpu__implicit_product(&t, count, decode, gather, write);
#endif
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

/* A block per tile: the columns on x (up to 2^31 - 1 blocks), the rows on
   y, the slices of a split sum on z. */
static dim3 mgpu__implicit_grid(mgpu__implicit_tile tile, size_t columns, int rows, int slices) {
    size_t tm = mgpu__implicit_tile_rows[tile], tn = mgpu__implicit_tile_columns[tile];
    return dim3((unsigned)((columns + tn - 1) / tn), (unsigned)((rows + tm - 1) / tm), (unsigned)slices);
}
/* The instance of a kernel template for a tile kind. */
#define MGPU__IMPLICIT_INSTANCE(kernel, tile)                                              \
    ((tile) == MGPU__TILE_128x64    ? kernel<128, 64>                                       \
     : (tile) == MGPU__TILE_64x128  ? kernel<64, 128>                                       \
     : (tile) == MGPU__TILE_128x128 ? kernel<128, 128>                                      \
                                    : kernel<64, 64>)
static void mgpu__conv_implicit_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__conv_implicit_args *a = (const mgpu__conv_implicit_args *)args;
    void (*kernel)(mgpu__conv_implicit_args, mgpu__conv_divisors) =
        MGPU__IMPLICIT_INSTANCE(mgpu__conv_implicit_kernel, a->tile);
    dim3 grid = mgpu__implicit_grid(a->tile, (size_t)a->g.n * a->g.p * a->g.q, a->g.k, 1);
    kernel<<<grid, MGPU__IMPLICIT_THREADS, 0, (cudaStream_t)ex->stream>>>(*a, mgpu__conv_divisors_for(&a->g));
    MGPU_CUDA_CHECK_LAUNCH();
}
static void mgpu__conv_implicit_dgrad_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__conv_implicit_dgrad_args *a = (const mgpu__conv_implicit_dgrad_args *)args;
    void (*kernel)(mgpu__conv_implicit_dgrad_args, mgpu__conv_divisors) =
        MGPU__IMPLICIT_INSTANCE(mgpu__conv_implicit_dgrad_kernel, a->tile);
    dim3 grid = mgpu__implicit_grid(a->tile, (size_t)a->g.n * a->g.h * a->g.w, a->g.c, 1);
    kernel<<<grid, MGPU__IMPLICIT_THREADS, 0, (cudaStream_t)ex->stream>>>(*a, mgpu__conv_divisors_for(&a->g));
    MGPU_CUDA_CHECK_LAUNCH();
}
static void mgpu__conv_implicit_wgrad_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__conv_implicit_wgrad_args *a = (const mgpu__conv_implicit_wgrad_args *)args;
    void (*kernel)(mgpu__conv_implicit_wgrad_args, mgpu__conv_divisors) =
        MGPU__IMPLICIT_INSTANCE(mgpu__conv_implicit_wgrad_kernel, a->tile);
    size_t crs = (size_t)a->g.c * a->g.r * a->g.s;
    dim3 grid = mgpu__implicit_grid(a->tile, crs, a->g.k, a->splits);
    kernel<<<grid, MGPU__IMPLICIT_THREADS, 0, (cudaStream_t)ex->stream>>>(*a, mgpu__conv_divisors_for(&a->g));
    MGPU_CUDA_CHECK_LAUNCH();
    mgpu__wgrad_sum_args sum = {a->dw, a->partials, a->beta, a->splits, a->g.k, a->g.c, a->g.r * a->g.s, 1};
    mgpu__wgrad_sum(sum, (cudaStream_t)ex->stream);
}
#endif
#endif
