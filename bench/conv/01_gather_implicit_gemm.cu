/* bench/conv/01_gather_implicit_gemm.cu: a convolution's forward pass and
   both its gradients as "gathering" implicit GEMMs on the tensor cores
   (WMMA, TF32), as a program of its own: the kernels, a CPU reference, a
   check of every kernel in every tile shape against it, and the kernels'
   times at the shapes of ResNet-18's convolutions.

   Build and run, from the repository's root, on a GPU of compute
   capability 8.0 or newer:
       make bench/conv/01_gather_implicit_gemm
   or by hand:
       nvcc -O3 -std=c++17 -gencode=arch=compute_80,code=sm_80 \
            -gencode=arch=compute_90a,code=sm_90a \
            bench/conv/01_gather_implicit_gemm.cu -o bench/conv/01_gather_implicit_gemm
       ./bench/conv/01_gather_implicit_gemm [--steps N] [--check-only]
   --steps N: timed runs per figure (default 20); --check-only: no timing.

   Where they stand. On an H100 and on an H200 these kernels won no pass of
   ResNet-18's step: the channels-last kernels of kernels/conv_nhwc.h (and
   for a few passes im2col, Winograd or the first layer's own kernel) were
   faster (bench/RESULTS.md, "Which kernels win a pass"). So they live here
   and not in mgpu.h; a variant returns to the library only when a GPU
   measurement shows it winning a pass of the step by at least 3%.

   The convolution (NCHW, PyTorch's conv2d): x [n, C, H, W], w [K, C, R, S],
   bias b [K], stride t, padding d; y [n, K, P, Q]. As a matrix product,
       Y [K, n*P*Q] = W [K, C*R*S] col [C*R*S, n*P*Q],
       col[(c,r,s), (img,p,q)] = x[img, c, p*t + r - d, q*t + s - d]   (0 in the padding).
   im2col writes col to memory and the product reads it back: for a 3x3
   convolution, 9 times the input, twice. An implicit GEMM gathers each
   tile of col from x while loading it into shared memory, so col never
   exists in device memory (cuDNN's main algorithm works this way).

   The kernel. A block of 128 threads (4 warps) computes a tile of Y,
   64 x 64, 128 x 64, 64 x 128 or 128 x 128 (filters x output pixels),
   stepping through C*R*S 16 at a time: it loads the step's tile of W,
   gathers the step's tile of col from x (each thread owns one output
   pixel, decoded once, so a gather is an add, two range tests and a
   load), stores both to shared memory rounded to TF32, and the warps
   multiply them on the tensor cores (WMMA, float32 sums) while the loads
   of the next step are in flight. The finished tile goes to y, with the
   bias, through shared memory, so that the writes are coalesced.

   The input gradient is the same machine on dx [C, n*H*W] = W^T dcol:
       dx[img, c, h, w] = sum over (k, r, s) of w[k, c, r, s] * dy[img, k, p, q]
   where p = (h + d - r) / t and q = (w + d - s) / t must be whole and
   inside the output. Rows are channels, columns input pixels, steps (k, r, s).
   The weight gradient, dW [K, C*R*S] = G col^T with G = dy as [K, n*P*Q]:
   rows are filters, columns (c, r, s), steps output pixels. The output is
   small and the sum long (200704 pixels at batch 256 in the first stage),
   so the sum is split over blocks (grid.z), each into its own partial
   tile, and a second kernel adds the partial tiles in order (the same
   result on every run). */
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "TF32 WMMA needs compute capability 8.0 or newer: build for sm_80 or newer"
#endif

/* Every CUDA call is checked: on an error, where and what, and exit. */
#define CUDA_CHECK(call)                                                                               \
    do {                                                                                               \
        cudaError_t err_ = (call);                                                                     \
        if (err_ != cudaSuccess) {                                                                     \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
            exit(1);                                                                                   \
        }                                                                                              \
    } while (0)

/* ------------------------------------------------------------ geometry */
struct Geom {
    int n, c, h, w; /* input: n images of c channels, h x w */
    int k, r, s;    /* weight: k filters of c x r x s */
    int p, q;       /* output size */
    int stride, pad;
};
/* Square images and kernels, as in ResNet-18. */
static Geom geom_for(int n, int c, int h, int k, int r, int stride, int pad) {
    int p = (h + 2 * pad - r) / stride + 1;
    return Geom{n, c, h, h, k, r, r, p, p, stride, pad};
}

/* Division by a number fixed for a whole launch, as a multiply and a
   shift (a GPU has no integer divider: n / d costs some 20 instructions,
   and the kernels divide in every step, dx twice in every value it
   gathers). With l = ceil(log2 d) and m = ceil(2^(31 + l) / d), n / d =
   floor(n m / 2^(31 + l)) for 0 <= n < 2^31 (Granlund and Montgomery). */
struct Divisor {
    int d;
    uint32_t m, shift; /* shift = l - 1: the high word is already n m / 2^32 */
};
static Divisor divisor_for(int d) {
    Divisor v = {d, 0, 0};
    if (d > 1) {
        int l = 0;
        while (((uint64_t)1 << l) < (uint64_t)d) l++;
        v.m = (uint32_t)((((uint64_t)1 << (31 + l)) + (uint64_t)d - 1) / (uint64_t)d);
        v.shift = (uint32_t)(l - 1);
    }
    return v;
}
/* n / v.d for n >= 0 (a negative n gives a wrong quotient: callers test). */
__device__ inline int div_by(int n, Divisor v) {
    return v.m ? (int)((uint32_t)(((uint64_t)(uint32_t)n * v.m) >> 32) >> v.shift) : n;
}
struct Divisors { Divisor rs, s, pq, q, hw, w, stride; };
static Divisors divisors_for(const Geom &g) {
    return Divisors{divisor_for(g.r * g.s), divisor_for(g.s), divisor_for(g.p * g.q), divisor_for(g.q),
                    divisor_for(g.h * g.w), divisor_for(g.w), divisor_for(g.stride)};
}

/* ---------------------------------------------------- the shared machine */
constexpr int STEP = 16;     /* values of the summed index per step */
constexpr int THREADS = 128; /* 4 warps, in 2 x 2 over the block's tile */
constexpr int OUT_ROWS = 64; /* rows of the finished tile written out at a time */
/* Blocks a multiprocessor should hold: 65536 registers / (128 threads x
   blocks) caps a thread's registers, 128 for 64 x 64, 168 for the middle
   tiles, 255 for 128 x 128 (whose 16 accumulator tiles alone take 128). */
#define BLOCKS_PER_SM(TM, TN) ((TM) * (TN) <= 64 * 64 ? 4 : (TM) * (TN) <= 128 * 64 ? 3 : 2)

/* The block tiles, rows x columns of the product. A larger tile reads
   fewer values from shared memory per multiply-add (64 x 64: 1 per 16;
   128 x 64 and 64 x 128: 1 per 21; 128 x 128: 1 per 32) but gives fewer
   blocks, and a 128-row tile wastes half its work on 64 filters. */
enum Tile { TILE_64x64, TILE_128x64, TILE_64x128, TILE_128x128, TILES };
static const int tile_rows[TILES] = {64, 128, 64, 128};
static const int tile_columns[TILES] = {64, 64, 128, 128};
static const char *const tile_names[TILES] = {"64x64", "128x64", "64x128", "128x128"};

/* A block's tiles in shared memory: two copies of the step's tiles (one
   multiplied, the next filled) and at the end, in the same bytes, 64 rows
   of the finished tile. The padding keeps the fragment loads free of bank
   conflicts: a fragment of a has lane l read row l/4, column l%4, and
   rows 20 floats apart put its 8 rows on banks 0, 20, 8, 28, 16, 4, 24,
   12; one of b has lane l read row l%4, column l/4, and rows TN + 8 apart
   put its 4 rows on banks 0, 8, 16, 24 (TN + 4: b at half speed). */
template <int TM, int TN> union Tiles {
    static_assert(TM % OUT_ROWS == 0, "the tile is written out 64 rows at a time");
    struct {
        float a[2][TM][STEP + 4]; /* rows x step */
        float b[2][STEP][TN + 8]; /* step x columns */
    } step;
    float out[OUT_ROWS][TN + 4]; /* rows x columns */
};
typedef nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 8, float> Acc;

/* What one thread loads of a step's tiles: of a, column tid % STEP of
   every A_APART-th row from tid / STEP; of b, column tid % TN of every
   B_APART-th row from tid / TN. A warp owns FM x FN 16 x 16 tiles. */
template <int TM, int TN> struct Layout {
    static const int A_PER = TM * STEP / THREADS, A_APART = THREADS / STEP;
    static const int B_PER = TN * STEP / THREADS, B_APART = THREADS / TN;
    static const int FM = TM / 32, FN = TN / 32;
    static_assert(TN <= THREADS && THREADS % TN == 0, "a column per thread");
};

/* The loaded values into copy `slot` of the tiles, rounded to TF32 here
   once rather than by every warp that reads them. */
template <int TM, int TN>
__device__ void stage(Tiles<TM, TN> *t, int slot, const float (&a)[Layout<TM, TN>::A_PER],
                      const float (&b)[Layout<TM, TN>::B_PER]) {
    typedef Layout<TM, TN> L;
    int tid = threadIdx.x;
    for (int j = 0; j < L::A_PER; j++)
        t->step.a[slot][tid / STEP + j * L::A_APART][tid % STEP] = nvcuda::wmma::__float_to_tf32(a[j]);
    for (int j = 0; j < L::B_PER; j++)
        t->step.b[slot][tid / TN + j * L::B_APART][tid % TN] = nvcuda::wmma::__float_to_tf32(b[j]);
}

/* acc += a b for warp `warp`'s FM x FN tiles, from copy `slot`: two
   tensor-core steps of k = 8. */
template <int TM, int TN>
__device__ void multiply(Acc (&acc)[TM / 32][TN / 32], const Tiles<TM, TN> *t, int slot, int warp) {
    using namespace nvcuda;
    const int FM = TM / 32, FN = TN / 32;
    int row = (warp / 2) * (TM / 2), col = (warp % 2) * (TN / 2);
    for (int kk = 0; kk < STEP; kk += 8) {
        wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> fa[FM];
        wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> fb[FN];
        for (int i = 0; i < FM; i++) wmma::load_matrix_sync(fa[i], &t->step.a[slot][row + 16 * i][kk], STEP + 4);
        for (int j = 0; j < FN; j++) wmma::load_matrix_sync(fb[j], &t->step.b[slot][kk][col + 16 * j], TN + 8);
        for (int i = 0; i < FM; i++)
            for (int j = 0; j < FN; j++) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
}

/* This thread's column of the rows in `out` to memory: row row0 + m to
   column[(row0 + m) * row_stride] (+ bias[row0 + m]), for rows below
   `rows`. Consecutive threads write consecutive columns (coalesced). */
template <int TN>
__device__ void write_rows(const float (*out)[TN + 4], float *column, size_t row_stride, int row0, int rows,
                           const float *bias) {
    int tid = threadIdx.x;
    for (int m = tid / TN; m < OUT_ROWS; m += THREADS / TN) {
        int row = row0 + m;
        if (row < rows) column[(size_t)row * row_stride] = out[m][tid % TN] + (bias ? bias[row] : 0.0f);
    }
}

/* The loop the three kernels share: the block's tile of the product,
   summed over `total` values of the inner index, STEP at a time, then to
   memory. Each kernel says how to load a step and where the tile goes:
     decode(k0, slot)        threads tid < STEP: the table (copy `slot`) of
                             what the inner index values k0 + tid mean;
     gather(k0, slot, a, b)  this thread's values of the step's two tiles,
                             from memory into a and b, by the table;
     write(m0)               rows m0 .. m0 + 63 of the tile, in t->out, to
                             memory (write_rows).
   Double buffered, one barrier per step: while the warps multiply step i
   from one copy, the loads of step i + 1 are in flight, to go to the other
   copy after the multiply; the table of step i + 2 is decoded meanwhile. */
template <int TM, int TN, typename Decode, typename Gather, typename Write>
__device__ void implicit_product(Tiles<TM, TN> *t, int total, Decode decode, Gather gather, Write write) {
    using namespace nvcuda;
    typedef Layout<TM, TN> L;
    int tid = threadIdx.x, warp = tid / 32;
    float a[L::A_PER], b[L::B_PER];
    Acc acc[L::FM][L::FN];
    for (int i = 0; i < L::FM; i++)
        for (int j = 0; j < L::FN; j++) wmma::fill_fragment(acc[i][j], 0.0f);
    if (tid < STEP) decode(0, 0);
    __syncthreads();
    gather(0, 0, a, b);
    if (tid < STEP) decode(STEP, 1);
    stage(t, 0, a, b);
    __syncthreads();
    for (int k0 = 0, slot = 0; k0 < total; k0 += STEP, slot ^= 1) {
        bool more = k0 + STEP < total;
        if (more) gather(k0 + STEP, slot ^ 1, a, b); /* loads in flight ... */
        multiply(acc, t, slot, warp);                /* ... while the tensor cores work */
        if (tid < STEP) decode(k0 + 2 * STEP, slot); /* this copy's table was last read before the barrier */
        if (more) stage(t, slot ^ 1, a, b);          /* and so was this copy of the tiles */
        __syncthreads();
    }
    /* Every warp is past the last barrier: out can take the bytes of the
       step tiles. A warp's rows lie in one block of 64. */
    int row = (warp / 2) * (TM / 2), col = (warp % 2) * (TN / 2);
#pragma unroll
    for (int m0 = 0; m0 < TM; m0 += OUT_ROWS) {
        if (row / OUT_ROWS == m0 / OUT_ROWS)
            for (int i = 0; i < L::FM; i++)
                for (int j = 0; j < L::FN; j++)
                    wmma::store_matrix_sync(&t->out[row - m0 + 16 * i][col + 16 * j], acc[i][j], TN + 4,
                                            wmma::mem_row_major);
        __syncthreads();
        write(m0);
        __syncthreads(); /* out is read before the next rows take it */
    }
}

/* ------------------------------------------------------------- kernels */
/* y = conv(x, w) + b: rows filters, columns output pixels, steps (c, r, s). */
template <int TM, int TN>
__global__ void __launch_bounds__(THREADS, BLOCKS_PER_SM(TM, TN))
forward_kernel(float *y, const float *x, const float *w, const float *bias, Geom g, Divisors dv) {
    typedef Layout<TM, TN> L;
    __shared__ __align__(32) Tiles<TM, TN> t;
    __shared__ int k_offset[2][STEP], k_r[2][STEP], k_s[2][STEP]; /* a step's (c, r, s), decoded */
    int tid = threadIdx.x;
    int rs = g.r * g.s, crs = g.c * rs, pq = g.p * g.q, hw = g.h * g.w;
    int filter0 = blockIdx.y * TM, pixel0 = blockIdx.x * TN, npq = g.n * pq;
    /* this thread's output pixel (column of the col tile), decoded once */
    int pixel = pixel0 + tid % TN;
    int img = div_by(pixel, dv.pq), in_image = pixel - img * pq, p = div_by(in_image, dv.q);
    int h0 = p * g.stride - g.pad, w0 = (in_image - p * g.q) * g.stride - g.pad;
    const float *x_pixel = x + (size_t)img * g.c * hw + (h0 * g.w + w0);

    auto decode = [&](int k0, int slot) { /* k = (c, r, s) */
        int k = k0 + tid, c = div_by(k, dv.rs), r = div_by(k - c * rs, dv.s), s = k - c * rs - r * g.s;
        k_offset[slot][tid] = k < crs ? c * hw + r * g.w + s : 0;
        k_r[slot][tid] = k < crs ? r : -(1 << 20); /* past the end: outside every image */
        k_s[slot][tid] = s;
    };
    auto gather = [&](int k0, int slot, float (&wv)[L::A_PER], float (&colv)[L::B_PER]) {
        int k = k0 + tid % STEP; /* W's rows are contiguous in k */
        for (int j = 0; j < L::A_PER; j++) {
            int filter = filter0 + tid / STEP + j * L::A_APART;
            wv[j] = filter < g.k && k < crs ? w[(size_t)filter * crs + k] : 0.0f;
        }
        for (int j = 0; j < L::B_PER; j++) { /* col: this thread's pixel, gathered from x */
            int kk = tid / TN + j * L::B_APART, in_h = h0 + k_r[slot][kk], in_w = w0 + k_s[slot][kk];
            colv[j] = pixel < npq && (unsigned)in_h < (unsigned)g.h && (unsigned)in_w < (unsigned)g.w /* 0 <= h < H */
                          ? x_pixel[k_offset[slot][kk]]
                          : 0.0f;
        }
    };
    auto write = [&](int m0) { /* the tile of Y to y [img, filter, p, q], with the bias */
        if (pixel < npq) write_rows<TN>(t.out, y + (size_t)img * g.k * pq + in_image, pq, filter0 + m0, g.k, bias);
    };
    implicit_product(&t, crs, decode, gather, write);
}

/* dx = W^T dcol: rows input channels, columns input pixels, steps (k, r, s). */
template <int TM, int TN>
__global__ void __launch_bounds__(THREADS, BLOCKS_PER_SM(TM, TN))
dgrad_kernel(float *dx, const float *dy, const float *w, Geom g, Divisors dv) {
    typedef Layout<TM, TN> L;
    __shared__ __align__(32) Tiles<TM, TN> t;
    __shared__ int k_w[2][STEP], k_dy[2][STEP], k_r[2][STEP], k_s[2][STEP]; /* a step's (k, r, s), decoded */
    int tid = threadIdx.x;
    int rs = g.r * g.s, krs = g.k * rs, pq = g.p * g.q, hw = g.h * g.w;
    int channel0 = blockIdx.y * TM, pixel0 = blockIdx.x * TN, nhw = g.n * hw;
    /* this thread's input pixel, decoded once, as (h + d, w + d): p*t = h + d - r */
    int pixel = pixel0 + tid % TN;
    int img = div_by(pixel, dv.hw), in_image = pixel - img * hw, row_in_image = div_by(in_image, dv.w);
    int h_pad = row_in_image + g.pad, w_pad = in_image - row_in_image * g.w + g.pad;
    const float *dy_img = dy + (size_t)img * g.k * pq;

    auto decode = [&](int k0, int slot) { /* k = (filter, r, s) */
        int k = k0 + tid, filter = div_by(k, dv.rs), r = div_by(k - filter * rs, dv.s);
        int s = k - filter * rs - r * g.s;
        k_w[slot][tid] = k < krs ? filter * g.c * rs + r * g.s + s : 0;
        k_dy[slot][tid] = k < krs ? filter * pq : 0;
        k_r[slot][tid] = k < krs ? r : (1 << 20); /* past the end: no window */
        k_s[slot][tid] = s;
    };
    auto gather = [&](int k0, int slot, float (&wv)[L::A_PER], float (&dcolv)[L::B_PER]) {
        int kk = tid % STEP; /* W^T: rows are channels, w[k, c, r, s] */
        for (int j = 0; j < L::A_PER; j++) {
            int channel = channel0 + tid / STEP + j * L::A_APART;
            wv[j] = channel < g.c && k0 + kk < krs ? w[k_w[slot][kk] + channel * rs] : 0.0f;
        }
        for (int j = 0; j < L::B_PER; j++) { /* dcol, gathered from dy: the windows that covered this pixel */
            int row = tid / TN + j * L::B_APART;
            int hp = h_pad - k_r[slot][row], wp = w_pad - k_s[slot][row];
            int p = div_by(hp, dv.stride), q = div_by(wp, dv.stride); /* used if hp, wp >= 0 */
            bool inside = pixel < nhw && hp >= 0 && wp >= 0 && p * g.stride == hp && q * g.stride == wp &&
                          p < g.p && q < g.q;
            dcolv[j] = inside ? dy_img[k_dy[slot][row] + p * g.q + q] : 0.0f;
        }
    };
    auto write = [&](int m0) {
        if (pixel < nhw)
            write_rows<TN>(t.out, dx + (size_t)img * g.c * hw + in_image, hw, channel0 + m0, g.c, nullptr);
    };
    implicit_product(&t, krs, decode, gather, write);
}

/* dW = G col^T, this block's slice of the output pixels into its partial
   tile: rows filters, columns (c, r, s), steps output pixels. */
template <int TM, int TN>
__global__ void __launch_bounds__(THREADS, BLOCKS_PER_SM(TM, TN))
wgrad_kernel(float *partials, const float *dy, const float *x, int splits, Geom g, Divisors dv) {
    typedef Layout<TM, TN> L;
    __shared__ __align__(32) Tiles<TM, TN> t;
    __shared__ int l_dy[2][STEP], l_x[2][STEP], l_h[2][STEP], l_w[2][STEP]; /* a step's output pixels, decoded */
    int tid = threadIdx.x;
    int rs = g.r * g.s, crs = g.c * rs, pq = g.p * g.q, hw = g.h * g.w;
    int filter0 = blockIdx.y * TM, column0 = blockIdx.x * TN;
    /* this block's slice of the output pixels */
    int pixels = g.n * pq, per = (pixels + splits - 1) / splits;
    int first = blockIdx.z * per, count = (first + per < pixels ? first + per : pixels) - first;
    /* this thread's (c, r, s), decoded once */
    int k = column0 + tid % TN;
    int c = div_by(k, dv.rs), r = div_by(k - c * rs, dv.s), s = k - c * rs - r * g.s;
    const float *x_c = x + (size_t)c * hw;

    auto decode = [&](int l0, int slot) { /* l = first + l0 + tid = (img, p, q) */
        int l = first + l0 + tid, img = div_by(l, dv.pq), in_image = l - img * pq;
        int p = div_by(in_image, dv.q);
        bool inside = l0 + tid < count;
        l_dy[slot][tid] = inside ? img * g.k * pq + in_image : 0;
        l_x[slot][tid] = inside ? img * g.c * hw : 0;
        l_h[slot][tid] = inside ? p * g.stride - g.pad : -(1 << 20);
        l_w[slot][tid] = (in_image - p * g.q) * g.stride - g.pad;
    };
    auto gather = [&](int l0, int slot, float (&gv)[L::A_PER], float (&colv)[L::B_PER]) {
        int kk = tid % STEP; /* G (dy): rows are filters */
        for (int j = 0; j < L::A_PER; j++) {
            int filter = filter0 + tid / STEP + j * L::A_APART;
            gv[j] = filter < g.k && l0 + kk < count ? dy[l_dy[slot][kk] + filter * pq] : 0.0f;
        }
        for (int j = 0; j < L::B_PER; j++) { /* col^T, gathered from x: this thread's (c, r, s) */
            int row = tid / TN + j * L::B_APART, in_h = l_h[slot][row] + r, in_w = l_w[slot][row] + s;
            colv[j] = k < crs && (unsigned)in_h < (unsigned)g.h && (unsigned)in_w < (unsigned)g.w /* 0 <= h < H */
                          ? x_c[l_x[slot][row] + in_h * g.w + in_w]
                          : 0.0f;
        }
    };
    auto write = [&](int m0) {
        if (k < crs)
            write_rows<TN>(t.out, partials + (size_t)blockIdx.z * g.k * crs + k, crs, filter0 + m0, g.k, nullptr);
    };
    implicit_product(&t, count, decode, gather, write);
}

/* dw = the partial tiles [splits, K*C*R*S] added, in order. */
__global__ void wgrad_sum_kernel(float *dw, const float *partials, int splits, int n) {
    size_t threads = (size_t)gridDim.x * blockDim.x;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)n; i += threads) {
        float sum = 0.0f;
        for (int z = 0; z < splits; z++) sum += partials[(size_t)z * n + i];
        dw[i] = sum;
    }
}

/* ---------------------------------------------------------- launching */
/* The most floats the partial tiles of a weight gradient take (64 MB). */
constexpr size_t PARTIAL_FLOATS_MAX = (size_t)16 << 20;
/* Slices of dW's sum over the output pixels, in a tile: about 1024
   blocks in all, each summing at least 256 pixels, the partial tiles at
   most PARTIAL_FLOATS_MAX, grid.z at most 65535. */
static int wgrad_splits(const Geom &g, Tile tile) {
    size_t crs = (size_t)g.c * g.r * g.s, pixels = (size_t)g.n * g.p * g.q;
    size_t tiles = ((size_t)g.k + tile_rows[tile] - 1) / tile_rows[tile] *
                   ((crs + tile_columns[tile] - 1) / tile_columns[tile]);
    size_t splits = (1024 + tiles - 1) / tiles;
    splits = std::min({splits, pixels / 256, PARTIAL_FLOATS_MAX / ((size_t)g.k * crs), (size_t)65535});
    return splits < 1 ? 1 : (int)splits;
}

/* A block per tile of the product: its columns on x, rows on y, the slices of a split sum on z. */
static dim3 grid_for(Tile tile, size_t columns, int rows, int slices) {
    size_t tm = tile_rows[tile], tn = tile_columns[tile];
    return dim3((unsigned)((columns + tn - 1) / tn), (unsigned)((rows + tm - 1) / tm), (unsigned)slices);
}
#define TILE_INSTANCE(kernel, tile)                   \
    ((tile) == TILE_128x64    ? kernel<128, 64>       \
     : (tile) == TILE_64x128  ? kernel<64, 128>       \
     : (tile) == TILE_128x128 ? kernel<128, 128>      \
                              : kernel<64, 64>)

enum Pass { FWD, DX, DW, PASSES };
static const char *const pass_names[PASSES] = {"fwd", "dx", "dW"};
/* A convolution's tensors on the GPU, NCHW. */
struct Tensors {
    float *x, *w, *b, *y, *dy, *dx, *dw;
    float *partials; /* PARTIAL_FLOATS_MAX floats, dW's scratch */
};

/* One pass of the convolution in one tile shape, on the default stream. */
static void run_pass(Pass pass, Tile tile, const Geom &g, const Tensors &t) {
    Divisors dv = divisors_for(g);
    if (pass == FWD) {
        dim3 grid = grid_for(tile, (size_t)g.n * g.p * g.q, g.k, 1);
        TILE_INSTANCE(forward_kernel, tile)<<<grid, THREADS>>>(t.y, t.x, t.w, t.b, g, dv);
    } else if (pass == DX) {
        dim3 grid = grid_for(tile, (size_t)g.n * g.h * g.w, g.c, 1);
        TILE_INSTANCE(dgrad_kernel, tile)<<<grid, THREADS>>>(t.dx, t.dy, t.w, g, dv);
    } else {
        int splits = wgrad_splits(g, tile), n = g.k * g.c * g.r * g.s;
        dim3 grid = grid_for(tile, (size_t)g.c * g.r * g.s, g.k, splits);
        TILE_INSTANCE(wgrad_kernel, tile)<<<grid, THREADS>>>(t.partials, t.dy, t.x, splits, g, dv);
        CUDA_CHECK(cudaGetLastError());
        wgrad_sum_kernel<<<std::min((n + 255) / 256, 65535 * 8), 256>>>(t.dw, t.partials, splits, n);
    }
    CUDA_CHECK(cudaGetLastError());
}

/* ------------------------------------------------------ CPU reference */
/* Uniform in [-1, 1), the same numbers on every run. */
static uint64_t rng_state = 42;
static float uniform() {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(rng_state >> 40) * (2.0 / 16777216.0) - 1.0);
}
/* v rounded to TF32's 10 bits of mantissa, to the nearest (ties away from
   zero), as the kernels' __float_to_tf32 rounds: a rounded value passes
   through the kernels unchanged. */
static float tf32_round(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    if ((bits & 0x7f800000u) != 0x7f800000u) bits = (bits + 0x1000u) & ~0x1fffu; /* not inf, NaN */
    memcpy(&v, &bits, sizeof v);
    return v;
}
static std::vector<float> random_floats(size_t n, bool tf32) {
    std::vector<float> v(n);
    for (float &e : v) e = tf32 ? tf32_round(uniform()) : uniform();
    return v;
}

/* The direct loops, summed in double: y = conv(x, w) + b, and for the
   upstream gradient dy, dx and dw (each product adds to all three). */
static void cpu_conv(const Geom &g, const std::vector<float> &x, const std::vector<float> &w,
                     const std::vector<float> &b, const std::vector<float> &dy, std::vector<double> &y,
                     std::vector<double> &dx, std::vector<double> &dw) {
    y.assign((size_t)g.n * g.k * g.p * g.q, 0.0);
    dx.assign(x.size(), 0.0);
    dw.assign(w.size(), 0.0);
    for (int img = 0; img < g.n; img++)
        for (int k = 0; k < g.k; k++)
            for (int p = 0; p < g.p; p++)
                for (int q = 0; q < g.q; q++) {
                    size_t yi = (((size_t)img * g.k + k) * g.p + p) * g.q + q;
                    double sum = b[k], grad = dy[yi];
                    for (int c = 0; c < g.c; c++)
                        for (int r = 0; r < g.r; r++) {
                            int h = p * g.stride + r - g.pad;
                            if (h < 0 || h >= g.h) continue;
                            for (int s = 0; s < g.s; s++) {
                                int wc = q * g.stride + s - g.pad;
                                if (wc < 0 || wc >= g.w) continue;
                                size_t xi = (((size_t)img * g.c + c) * g.h + h) * g.w + wc;
                                size_t wi = (((size_t)k * g.c + c) * g.r + r) * g.s + s;
                                sum += (double)w[wi] * x[xi];
                                dx[xi] += (double)w[wi] * grad;
                                dw[wi] += (double)x[xi] * grad;
                            }
                        }
                    y[yi] = sum;
                }
}

/* ---------------------------------------------------------------- check */
/* The tolerance of the library's TF32 tests (tests/gpu_layers.c):
   max |gpu - cpu| <= 2e-3 * max(1, max |cpu|). TF32 rounds each input of
   a product to 10 bits of mantissa (relative error up to 2^-11) and keeps
   float32 sums: the errors walk randomly, to about 1e-4 of the largest
   output, a few times that at the worst element; with inputs rounded to
   TF32 beforehand the products are exact and only the sums differ. A wrong
   index is off by the size of the outputs, a value never written is NaN. */
constexpr double TOLERANCE = 2e-3;
/* max |got - want| / max(1, max |want|) of a GPU tensor, infinite for a NaN. */
static double relative_error(const float *got_d, const std::vector<double> &want) {
    std::vector<float> got(want.size());
    CUDA_CHECK(cudaMemcpy(got.data(), got_d, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
    double scale = 1.0, err = 0.0;
    for (size_t i = 0; i < want.size(); i++) {
        scale = std::max(scale, std::fabs(want[i]));
        double e = std::fabs((double)got[i] - want[i]);
        if (!(e <= err)) err = std::isnan(e) ? INFINITY : e;
    }
    return err / scale;
}

/* n floats on the GPU, a copy of `from` unless it is NULL */
static float *gpu_floats(size_t n, const float *from = nullptr) {
    float *d;
    CUDA_CHECK(cudaMalloc(&d, n * sizeof(float)));
    if (from) CUDA_CHECK(cudaMemcpy(d, from, n * sizeof(float), cudaMemcpyHostToDevice));
    return d;
}
static float *to_gpu(const std::vector<float> &v) { return gpu_floats(v.size(), v.data()); }
static void free_tensors(Tensors &t) {
    for (float *p : {t.x, t.w, t.b, t.y, t.dy, t.dx, t.dw}) CUDA_CHECK(cudaFree(p));
}

struct CheckShape {
    const char *name;
    int n, c, h, k, r, stride, pad;
};
/* Partial tiles in every direction and a partial step (C*R*S = 45, 9),
   a partial last slice of dW's sum (784 pixels in 3 slices), and a
   layer of each kind of ResNet-18's at a small batch. */
static const CheckShape check_shapes[] = {
    {"partial tiles", 3, 5, 11, 70, 3, 2, 2},
    {"first layer 1->64 3x3", 8, 1, 28, 64, 3, 1, 1},
    {"stage2 64->128 3x3 /2", 4, 64, 28, 128, 3, 2, 1},
    {"stage2 64->128 1x1 /2", 4, 64, 28, 128, 1, 2, 0},
    {"stage4 512->512 3x3", 2, 512, 4, 512, 3, 1, 1},
};

/* Every pass in every tile against the CPU, with the inputs as drawn and
   rounded to TF32 beforehand; a line per shape, inputs and tile. Returns
   the number of failures. */
static int check_all(float *partials) {
    printf("check: max |gpu - cpu| / max(1, max |cpu|) of y, dx and dW, allowed %.0e\n", TOLERANCE);
    int failures = 0;
    for (const CheckShape &cs : check_shapes)
        for (int rounded = 0; rounded <= 1; rounded++) {
            Geom g = geom_for(cs.n, cs.c, cs.h, cs.k, cs.r, cs.stride, cs.pad);
            size_t xs = (size_t)g.n * g.c * g.h * g.w, ws = (size_t)g.k * g.c * g.r * g.s;
            size_t ys = (size_t)g.n * g.k * g.p * g.q;
            std::vector<float> x = random_floats(xs, rounded), w = random_floats(ws, rounded);
            std::vector<float> b = random_floats(g.k, rounded), dy = random_floats(ys, rounded);
            std::vector<double> y_cpu, dx_cpu, dw_cpu;
            cpu_conv(g, x, w, b, dy, y_cpu, dx_cpu, dw_cpu);
            Tensors t = {to_gpu(x), to_gpu(w), to_gpu(b), gpu_floats(ys), to_gpu(dy), gpu_floats(xs), gpu_floats(ws),
                         partials};
            for (int tile = 0; tile < TILES; tile++) {
                /* all bits set: NaN, so that a value never written fails */
                CUDA_CHECK(cudaMemset(t.y, 0xff, ys * sizeof(float)));
                CUDA_CHECK(cudaMemset(t.dx, 0xff, xs * sizeof(float)));
                CUDA_CHECK(cudaMemset(t.dw, 0xff, ws * sizeof(float)));
                for (int pass = 0; pass < PASSES; pass++) run_pass((Pass)pass, (Tile)tile, g, t);
                CUDA_CHECK(cudaDeviceSynchronize());
                double e[PASSES] = {relative_error(t.y, y_cpu), relative_error(t.dx, dx_cpu),
                                    relative_error(t.dw, dw_cpu)};
                bool ok = e[FWD] <= TOLERANCE && e[DX] <= TOLERANCE && e[DW] <= TOLERANCE;
                failures += !ok;
                printf("  %-22s n=%d  %-15s %-7s  y %.1e  dx %.1e  dW %.1e  %s\n", cs.name, cs.n,
                       rounded ? "rounded inputs" : "inputs as drawn", tile_names[tile], e[FWD], e[DX], e[DW],
                       ok ? "ok" : "FAILED");
            }
            free_tensors(t);
        }
    printf("check: %s\n\n", failures ? "FAILED" : "all ok");
    return failures;
}

/* --------------------------------------------------------------- timing */
struct Case {
    const char *name;
    int count; /* occurrences in ResNet-18 */
    int c, k, r, stride, pad, h;
    bool dx; /* whether the step needs dx: the first layer's input is the image */
};
/* ResNet-18's distinct convolutions on 1 x 28 x 28 images. */
static const Case cases[] = {
    {"first 1->64 3x3 28x28", 1, 1, 64, 3, 1, 1, 28, false},
    {"stage1 64->64 3x3 28x28", 4, 64, 64, 3, 1, 1, 28, true},
    {"stage2 64->128 3x3 /2 28x28", 1, 64, 128, 3, 2, 1, 28, true},
    {"stage2 64->128 1x1 /2 28x28", 1, 64, 128, 1, 2, 0, 28, true},
    {"stage2 128->128 3x3 14x14", 3, 128, 128, 3, 1, 1, 14, true},
    {"stage3 128->256 3x3 /2 14x14", 1, 128, 256, 3, 2, 1, 14, true},
    {"stage3 128->256 1x1 /2 14x14", 1, 128, 256, 1, 2, 0, 14, true},
    {"stage3 256->256 3x3 7x7", 3, 256, 256, 3, 1, 1, 7, true},
    {"stage4 256->512 3x3 /2 7x7", 1, 256, 512, 3, 2, 1, 7, true},
    {"stage4 256->512 1x1 /2 7x7", 1, 256, 512, 1, 2, 0, 7, true},
    {"stage4 512->512 3x3 4x4", 3, 512, 512, 3, 1, 1, 4, true},
};
constexpr int BATCH = 256;

/* Microseconds of one run of a pass: one run to warm up, then the median
   of `steps`, each between two events. The runs follow each other with
   no synchronisation, so the GPU never waits for the CPU's launches. */
static double time_us(Pass pass, Tile tile, const Geom &g, const Tensors &t, std::vector<cudaEvent_t> &ev,
                      int steps) {
    run_pass(pass, tile, g, t);
    for (int i = 0; i < steps; i++) {
        CUDA_CHECK(cudaEventRecord(ev[2 * i]));
        run_pass(pass, tile, g, t);
        CUDA_CHECK(cudaEventRecord(ev[2 * i + 1]));
    }
    CUDA_CHECK(cudaEventSynchronize(ev[2 * steps - 1]));
    std::vector<float> ms(steps);
    for (int i = 0; i < steps; i++) CUDA_CHECK(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
    std::sort(ms.begin(), ms.end());
    return 1000.0 * ms[steps / 2];
}

static void time_all(int steps, float *partials) {
    std::vector<cudaEvent_t> ev(2 * steps);
    for (cudaEvent_t &e : ev) CUDA_CHECK(cudaEventCreate(&e));
    printf("time: microseconds a pass (dW: both its kernels) at batch %d, the median of %d runs; * the fastest "
           "tile\n", BATCH, steps);
    printf("%-30s %5s %4s", "convolution", "count", "pass");
    for (int tile = 0; tile < TILES; tile++) printf(" %8s ", tile_names[tile]);
    printf("\n");
    double step_us[PASSES] = {0, 0, 0}; /* a step's convolutions, each pass in its fastest tile */
    for (const Case &cs : cases) {
        Geom g = geom_for(BATCH, cs.c, cs.h, cs.k, cs.r, cs.stride, cs.pad);
        size_t xs = (size_t)g.n * g.c * g.h * g.w, ws = (size_t)g.k * g.c * g.r * g.s;
        size_t ys = (size_t)g.n * g.k * g.p * g.q;
        Tensors t = {to_gpu(random_floats(xs, false)), to_gpu(random_floats(ws, false)),
                     to_gpu(random_floats(g.k, false)), gpu_floats(ys), to_gpu(random_floats(ys, false)),
                     gpu_floats(xs), gpu_floats(ws), partials};
        for (int pass = 0; pass < PASSES; pass++) {
            if (pass == DX && !cs.dx) continue;
            double us[TILES];
            int best = 0;
            for (int tile = 0; tile < TILES; tile++) {
                us[tile] = time_us((Pass)pass, (Tile)tile, g, t, ev, steps);
                if (us[tile] < us[best]) best = tile;
            }
            printf("%-30s %5d %4s", pass == FWD ? cs.name : "", cs.count, pass_names[pass]);
            for (int tile = 0; tile < TILES; tile++) printf(" %8.1f%c", us[tile], tile == best ? '*' : ' ');
            printf("\n");
            step_us[pass] += cs.count * us[best];
        }
        free_tensors(t);
    }
    printf("\na ResNet-18 step's convolutions, each pass in its fastest tile: fwd %.2f ms, dx %.2f ms, "
           "dW %.2f ms, in all %.2f ms\n",
           step_us[FWD] / 1000, step_us[DX] / 1000, step_us[DW] / 1000,
           (step_us[FWD] + step_us[DX] + step_us[DW]) / 1000);
    for (cudaEvent_t &e : ev) CUDA_CHECK(cudaEventDestroy(e));
}

int main(int argc, char **argv) {
    int steps = 20;
    bool check_only = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--steps") && i + 1 < argc && atoi(argv[i + 1]) > 0) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--check-only")) check_only = true;
        else {
            fprintf(stderr, "usage: %s [--steps N] [--check-only]\n", argv[0]);
            return 2;
        }
    }
    int devices = 0;
    cudaError_t err = cudaGetDeviceCount(&devices);
    if (err != cudaSuccess || devices == 0) {
        fprintf(stderr, "no GPU: %s\n", err != cudaSuccess ? cudaGetErrorString(err) : "no CUDA device found");
        return 1;
    }
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    if (prop.major < 8) {
        fprintf(stderr, "no GPU: %s has compute capability %d.%d, TF32 WMMA needs 8.0\n", prop.name, prop.major,
                prop.minor);
        return 1;
    }
    printf("%s, compute capability %d.%d\n", prop.name, prop.major, prop.minor);
    float *partials = gpu_floats(PARTIAL_FLOATS_MAX);
    int failures = check_all(partials);
    if (!failures && !check_only) time_all(steps, partials);
    CUDA_CHECK(cudaFree(partials));
    return failures ? 1 : 0;
}
