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

   The kernel. A block computes a 64 x 64 tile of Y (64 filters, 64 output
   pixels) with 4 warps, each a 32 x 32 corner of it as 2 x 2 WMMA tiles of
   16 x 16, stepping through C*R*S 16 at a time. For each step:
     1. 16 threads decode the step's 16 values of (c, r, s) into a table
        in shared memory (the offset of c, r and s in x, and r and s);
     2. all threads load the W tile [64 x 16] (rows of W are contiguous)
        and gather the col tile [16 x 64] into registers: each thread owns
        one output pixel (its column) for the whole kernel, decoded once,
        so a gather is an add, two range tests and a load;
     3. the values go to shared memory, rounded to TF32;
     4. each warp multiplies its tiles with the tensor cores (two WMMA
        steps of k = 8, the sums in float32).
   The steps overlap (mgpu__implicit_product): the loads of step i + 1 are
   in flight while the tensor cores multiply step i, from a second copy of
   the tiles. At the end the accumulators go through shared memory, so
   that the writes to y are consecutive pixels of one filter (coalesced).
   On sm_90: 128 registers a thread (4 blocks a multiprocessor), 19 KB of
   shared memory a block, no spills.

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

   Used when MGPU_CONV=implicit is set and the convolution may use TF32
   (mgpu_set_tf32); otherwise conv.h's im2col path runs. Whether it is the
   faster one is for bench/profile to say on a GPU. */

#if MGPU_CUDA
#define MGPU__IMPLICIT_TILE 64     /* rows (filters or channels) and pixels per block */
#define MGPU__IMPLICIT_STEP 16     /* values of the summed index per step */
#define MGPU__IMPLICIT_THREADS 128 /* 4 warps */
#define MGPU__IMPLICIT_BLOCKS_PER_SM 4 /* registers for 16 warps a multiprocessor: at most 128 a thread */
/* values of each of the step's two tiles that one thread loads */
#define MGPU__IMPLICIT_PER_THREAD (MGPU__IMPLICIT_TILE * MGPU__IMPLICIT_STEP / MGPU__IMPLICIT_THREADS)

/* A block's tiles in shared memory: two copies of the step's tiles (one
   being multiplied, the next being filled), and at the end, in the same
   bytes, the finished tile on its way to memory. Rows are padded by 4
   floats, as WMMA wants leading dimensions that are multiples of 4. */
typedef union {
    struct {
        float a[2][MGPU__IMPLICIT_TILE][MGPU__IMPLICIT_STEP + 4]; /* rows x step */
        float b[2][MGPU__IMPLICIT_STEP][MGPU__IMPLICIT_TILE + 4]; /* step x pixels */
    } step;
    float out[MGPU__IMPLICIT_TILE][MGPU__IMPLICIT_TILE + 4]; /* rows x pixels */
} mgpu__implicit_tiles;

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800 /* TF32 WMMA: sm_80 and newer */
typedef nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 8, float> mgpu__implicit_acc;

/* Which values of the step's tiles thread tid loads, the j-th of
   MGPU__IMPLICIT_PER_THREAD each: in the rows x step tile a, always the
   same step column and every 8th row; in the step x pixels tile b, always
   the same pixel and every 2nd step row. */
static __device__ inline int mgpu__implicit_a_row(int tid, int j) {
    return tid / MGPU__IMPLICIT_STEP + j * (MGPU__IMPLICIT_THREADS / MGPU__IMPLICIT_STEP);
}
static __device__ inline int mgpu__implicit_b_row(int tid, int j) {
    return tid / MGPU__IMPLICIT_TILE + j * (MGPU__IMPLICIT_THREADS / MGPU__IMPLICIT_TILE);
}

/* The values loaded from memory into the tiles of copy `slot`, rounded to
   TF32 here once rather than by every warp that reads them. */
static __device__ void mgpu__implicit_stage(mgpu__implicit_tiles *t, int slot,
                                            const float (&a)[MGPU__IMPLICIT_PER_THREAD],
                                            const float (&b)[MGPU__IMPLICIT_PER_THREAD]) {
    int tid = threadIdx.x;
    for (int j = 0; j < MGPU__IMPLICIT_PER_THREAD; j++) {
        t->step.a[slot][mgpu__implicit_a_row(tid, j)][tid % MGPU__IMPLICIT_STEP] = nvcuda::wmma::__float_to_tf32(a[j]);
        t->step.b[slot][mgpu__implicit_b_row(tid, j)][tid % MGPU__IMPLICIT_TILE] = nvcuda::wmma::__float_to_tf32(b[j]);
    }
}

/* Warp `warp` of 4 owns the 32 x 32 corner (row, col) of the block's tile. */
static __device__ inline void mgpu__implicit_corner(int warp, int *row, int *col) {
    *row = (warp / 2) * 32;
    *col = (warp % 2) * 32;
}
/* acc += a b for this warp's 2 x 2 tiles of 16 x 16, from copy `slot`:
   two tensor-core steps of k = 8. */
static __device__ void mgpu__implicit_multiply(mgpu__implicit_acc (&acc)[2][2],
                                               const mgpu__implicit_tiles *t, int slot, int warp) {
    using namespace nvcuda;
    int row, col;
    mgpu__implicit_corner(warp, &row, &col);
    for (int kk = 0; kk < MGPU__IMPLICIT_STEP; kk += 8) {
        wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> fa[2];
        wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> fb[2];
        for (int i = 0; i < 2; i++) {
            wmma::load_matrix_sync(fa[i], &t->step.a[slot][row + 16 * i][kk], MGPU__IMPLICIT_STEP + 4);
            wmma::load_matrix_sync(fb[i], &t->step.b[slot][kk][col + 16 * i], MGPU__IMPLICIT_TILE + 4);
        }
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 2; j++) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
}

/* The loop the three kernels share: acc = the block's tile of the product,
   summed over `total` values of the inner index, MGPU__IMPLICIT_STEP at a
   time. Each kernel says how to load a step:
     decode(k0, slot)    run by threads tid < STEP: writes the kernel's
                         table (in shared memory, copy `slot`) of what the
                         step's inner index values k0 + tid mean;
     gather(k0, slot, a, b)  loads this thread's values of the step's two
                         tiles from memory into a and b, using the table.
   Double buffered, so that memory and the tensor cores work at once:
   while the warps multiply step i from one copy of the tiles, the loads
   of step i + 1 are in flight into registers, and go to the other copy
   after the multiply; the table of step i + 2 is decoded meanwhile. One
   barrier per step. */
template <typename Decode, typename Gather>
static __device__ void mgpu__implicit_product(mgpu__implicit_acc (&acc)[2][2], mgpu__implicit_tiles *t,
                                              int total, Decode decode, Gather gather) {
    const int S = MGPU__IMPLICIT_STEP;
    int tid = threadIdx.x, warp = tid / 32;
    float a[MGPU__IMPLICIT_PER_THREAD], b[MGPU__IMPLICIT_PER_THREAD];
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) nvcuda::wmma::fill_fragment(acc[i][j], 0.0f);
    if (tid < S) decode(0, 0);
    __syncthreads();
    gather(0, 0, a, b);
    if (tid < S) decode(S, 1);
    mgpu__implicit_stage(t, 0, a, b);
    __syncthreads();
    for (int k0 = 0, slot = 0; k0 < total; k0 += S, slot ^= 1) {
        bool more = k0 + S < total;
        if (more) gather(k0 + S, slot ^ 1, a, b); /* loads in flight ... */
        mgpu__implicit_multiply(acc, t, slot, warp); /* ... while the tensor cores work */
        if (tid < S) decode(k0 + 2 * S, slot);  /* this copy's table was last read before the barrier */
        if (more) mgpu__implicit_stage(t, slot ^ 1, a, b); /* and so was this copy of the tiles */
        __syncthreads();
    }
}
/* The accumulators into t->out (the product is over: the caller has
   passed the loop's last barrier; it synchronises before reading out). */
static __device__ void mgpu__implicit_store(const mgpu__implicit_acc (&acc)[2][2],
                                            mgpu__implicit_tiles *t, int warp) {
    int row, col;
    mgpu__implicit_corner(warp, &row, &col);
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++)
            nvcuda::wmma::store_matrix_sync(&t->out[row + 16 * i][col + 16 * j], acc[i][j],
                                            MGPU__IMPLICIT_TILE + 4, nvcuda::wmma::mem_row_major);
}
#endif

typedef struct {
    float *y;       /* [n, K, P, Q] */
    const float *x; /* [n, C, H, W] */
    const float *w; /* [K, C*R*S] */
    const float *b; /* [K] or NULL */
    mgpu__conv_geom g;
} mgpu__conv_implicit_args;

static __global__ void __launch_bounds__(MGPU__IMPLICIT_THREADS, MGPU__IMPLICIT_BLOCKS_PER_SM)
mgpu__conv_implicit_kernel(mgpu__conv_implicit_args a) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    const mgpu__conv_geom g = a.g;
    const int T = MGPU__IMPLICIT_TILE, S = MGPU__IMPLICIT_STEP, PER = MGPU__IMPLICIT_PER_THREAD;
    __shared__ __align__(32) mgpu__implicit_tiles t;
    __shared__ int k_offset[2][S], k_r[2][S], k_s[2][S]; /* a step's (c, r, s), decoded */

    int tid = threadIdx.x;
    int rs = g.r * g.s, crs = g.c * rs, pq = g.p * g.q, hw = g.h * g.w;
    int filter0 = blockIdx.y * T, pixel0 = blockIdx.x * T, npq = g.n * pq;
    /* this thread's output pixel (column of the col tile), decoded once */
    int column = tid % T, pixel = pixel0 + column;
    int img = pixel / pq, in_image = pixel % pq;
    int h0 = (in_image / g.q) * g.stride - g.pad, w0 = (in_image % g.q) * g.stride - g.pad;
    const float *x_pixel = a.x + (size_t)img * g.c * hw + (h0 * g.w + w0);

    auto decode = [&](int k0, int slot) { /* k = (c, r, s) */
        int k = k0 + tid, c = k / rs, r = k % rs / g.s, s = k % g.s;
        k_offset[slot][tid] = k < crs ? c * hw + r * g.w + s : 0;
        k_r[slot][tid] = k < crs ? r : -(1 << 20); /* past the end: outside every image */
        k_s[slot][tid] = s;
    };
    auto gather = [&](int k0, int slot, float (&wv)[PER], float (&colv)[PER]) {
        int k = k0 + tid % S; /* W's rows are contiguous in k */
        for (int j = 0; j < PER; j++) {
            int filter = filter0 + mgpu__implicit_a_row(tid, j);
            wv[j] = filter < g.k && k < crs ? a.w[(size_t)filter * crs + k] : 0.0f;
        }
        for (int j = 0; j < PER; j++) { /* col: this thread's pixel, gathered from x */
            int kk = mgpu__implicit_b_row(tid, j), h = h0 + k_r[slot][kk], w = w0 + k_s[slot][kk];
            colv[j] = pixel < npq && h >= 0 && h < g.h && w >= 0 && w < g.w ? x_pixel[k_offset[slot][kk]] : 0.0f;
        }
    };
    mgpu__implicit_acc acc[2][2];
    mgpu__implicit_product(acc, &t, crs, decode, gather);
    /* the tile of Y to y [img, filter, p, q], through shared memory so
       that the writes are consecutive pixels of one filter */
    mgpu__implicit_store(acc, &t, tid / 32);
    __syncthreads();
    if (pixel >= npq) return;
    float *y_pixel = a.y + (size_t)img * g.k * pq + in_image;
    for (int m = tid / T; m < T; m += MGPU__IMPLICIT_THREADS / T) {
        int filter = filter0 + m;
        if (filter < g.k) y_pixel[(size_t)filter * pq] = t.out[m][column] + (a.b ? a.b[filter] : 0.0f);
    }
#endif
}

typedef struct {
    float *dx;       /* [n, C, H, W], overwritten */
    const float *dy; /* [n, K, P, Q] */
    const float *w;  /* [K, C, R, S] */
    mgpu__conv_geom g;
} mgpu__conv_implicit_dgrad_args;

static __global__ void __launch_bounds__(MGPU__IMPLICIT_THREADS, MGPU__IMPLICIT_BLOCKS_PER_SM)
mgpu__conv_implicit_dgrad_kernel(mgpu__conv_implicit_dgrad_args a) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    const mgpu__conv_geom g = a.g;
    const int T = MGPU__IMPLICIT_TILE, S = MGPU__IMPLICIT_STEP, PER = MGPU__IMPLICIT_PER_THREAD;
    __shared__ __align__(32) mgpu__implicit_tiles t;
    __shared__ int k_w[2][S], k_dy[2][S], k_r[2][S], k_s[2][S]; /* a step's (k, r, s), decoded */

    int tid = threadIdx.x;
    int rs = g.r * g.s, krs = g.k * rs, pq = g.p * g.q, hw = g.h * g.w;
    int channel0 = blockIdx.y * T, pixel0 = blockIdx.x * T, nhw = g.n * hw;
    /* this thread's input pixel, decoded once */
    int column = tid % T, pixel = pixel0 + column;
    int img = pixel / hw, in_image = pixel % hw;
    int h = in_image / g.w + g.pad, w = in_image % g.w + g.pad; /* + d: p*t = h + d - r */
    const float *dy_img = a.dy + (size_t)img * g.k * pq;

    auto decode = [&](int k0, int slot) { /* k = (filter, r, s) */
        int k = k0 + tid, filter = k / rs, r = k % rs / g.s, s = k % g.s;
        k_w[slot][tid] = k < krs ? filter * g.c * rs + r * g.s + s : 0;
        k_dy[slot][tid] = k < krs ? filter * pq : 0;
        k_r[slot][tid] = k < krs ? r : (1 << 20); /* past the end: no window */
        k_s[slot][tid] = s;
    };
    auto gather = [&](int k0, int slot, float (&wv)[PER], float (&dcolv)[PER]) {
        int kk = tid % S; /* W^T: rows are channels, w[k, c, r, s] */
        for (int j = 0; j < PER; j++) {
            int channel = channel0 + mgpu__implicit_a_row(tid, j);
            wv[j] = channel < g.c && k0 + kk < krs ? a.w[k_w[slot][kk] + channel * rs] : 0.0f;
        }
        for (int j = 0; j < PER; j++) { /* dcol, gathered from dy: the windows that covered this pixel */
            int row = mgpu__implicit_b_row(tid, j);
            int hp = h - k_r[slot][row], wp = w - k_s[slot][row], p = hp / g.stride, q = wp / g.stride;
            bool inside = pixel < nhw && hp >= 0 && wp >= 0 && p * g.stride == hp &&
                          q * g.stride == wp && p < g.p && q < g.q;
            dcolv[j] = inside ? dy_img[k_dy[slot][row] + p * g.q + q] : 0.0f;
        }
    };
    mgpu__implicit_acc acc[2][2];
    mgpu__implicit_product(acc, &t, krs, decode, gather);
    mgpu__implicit_store(acc, &t, tid / 32);
    __syncthreads();
    if (pixel >= nhw) return;
    float *dx_pixel = a.dx + (size_t)img * g.c * hw + in_image;
    for (int m = tid / T; m < T; m += MGPU__IMPLICIT_THREADS / T) {
        int channel = channel0 + m;
        if (channel < g.c) dx_pixel[(size_t)channel * hw] = t.out[m][column];
    }
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
} mgpu__conv_implicit_wgrad_args;

/* Slices of the sum: about 1024 blocks in all, each summing at least 256
   output pixels, the partial tiles at most 16M floats. */
static int mgpu__conv_implicit_wgrad_splits(const mgpu__conv_geom *g) {
    size_t crs = (size_t)g->c * g->r * g->s, tiles = ((size_t)g->k + MGPU__IMPLICIT_TILE - 1) /
        MGPU__IMPLICIT_TILE * ((crs + MGPU__IMPLICIT_TILE - 1) / MGPU__IMPLICIT_TILE);
    size_t pixels = (size_t)g->n * g->p * g->q, splits = (1024 + tiles - 1) / tiles;
    if (splits > pixels / 256) splits = pixels / 256;
    if (splits > ((size_t)16 << 20) / ((size_t)g->k * crs)) splits = ((size_t)16 << 20) / ((size_t)g->k * crs);
    return splits < 1 ? 1 : (int)splits;
}

static __global__ void __launch_bounds__(MGPU__IMPLICIT_THREADS, MGPU__IMPLICIT_BLOCKS_PER_SM)
mgpu__conv_implicit_wgrad_kernel(mgpu__conv_implicit_wgrad_args a) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    const mgpu__conv_geom g = a.g;
    const int T = MGPU__IMPLICIT_TILE, S = MGPU__IMPLICIT_STEP, PER = MGPU__IMPLICIT_PER_THREAD;
    __shared__ __align__(32) mgpu__implicit_tiles t;
    __shared__ int l_dy[2][S], l_x[2][S], l_h[2][S], l_w[2][S]; /* a step's output pixels, decoded */

    int tid = threadIdx.x;
    int rs = g.r * g.s, crs = g.c * rs, pq = g.p * g.q, hw = g.h * g.w;
    int filter0 = blockIdx.y * T, column0 = blockIdx.x * T;
    /* this block's slice of the output pixels */
    int pixels = g.n * pq, per = (pixels + a.splits - 1) / a.splits;
    int first = blockIdx.z * per, count = (first + per < pixels ? first + per : pixels) - first;
    /* this thread's (c, r, s), decoded once */
    int column = tid % T, k = column0 + column;
    int c = k / rs, r = k % rs / g.s, s = k % g.s;
    const float *x_c = a.x + (size_t)c * hw;

    auto decode = [&](int l0, int slot) { /* l = first + l0 + tid = (img, p, q) */
        int l = first + l0 + tid, img = l / pq, in_image = l % pq;
        bool inside = l0 + tid < count;
        l_dy[slot][tid] = inside ? img * g.k * pq + in_image : 0;
        l_x[slot][tid] = inside ? img * g.c * hw : 0;
        l_h[slot][tid] = inside ? in_image / g.q * g.stride - g.pad : -(1 << 20);
        l_w[slot][tid] = in_image % g.q * g.stride - g.pad;
    };
    auto gather = [&](int l0, int slot, float (&gv)[PER], float (&colv)[PER]) {
        int kk = tid % S; /* G (dy): rows are filters */
        for (int j = 0; j < PER; j++) {
            int filter = filter0 + mgpu__implicit_a_row(tid, j);
            gv[j] = filter < g.k && l0 + kk < count ? a.dy[l_dy[slot][kk] + filter * pq] : 0.0f;
        }
        for (int j = 0; j < PER; j++) { /* col^T, gathered from x: this thread's (c, r, s) */
            int row = mgpu__implicit_b_row(tid, j), h = l_h[slot][row] + r, w = l_w[slot][row] + s;
            colv[j] = k < crs && h >= 0 && h < g.h && w >= 0 && w < g.w
                          ? x_c[l_x[slot][row] + h * g.w + w]
                          : 0.0f;
        }
    };
    mgpu__implicit_acc acc[2][2];
    mgpu__implicit_product(acc, &t, count, decode, gather);
    mgpu__implicit_store(acc, &t, tid / 32);
    __syncthreads();
    if (k >= crs) return;
    float *partial = a.partials + (size_t)blockIdx.z * g.k * crs + k;
    for (int m = tid / T; m < T; m += MGPU__IMPLICIT_THREADS / T) {
        int filter = filter0 + m;
        if (filter < g.k) partial[(size_t)filter * crs] = t.out[m][column];
    }
#endif
}
/* dw = beta dw + the partial tiles, added in order */
static __global__ void mgpu__conv_implicit_wgrad_finish_kernel(mgpu__conv_implicit_wgrad_args a) {
    size_t n = (size_t)a.g.k * a.g.c * a.g.r * a.g.s;
    MGPU__GRID_STRIDE_LOOP(i, n) {
        float sum = 0.0f;
        for (int z = 0; z < a.splits; z++) sum += a.partials[(size_t)z * n + i];
        a.dw[i] = a.beta != 0.0f ? a.beta * a.dw[i] + sum : sum;
    }
}

/* A block per 64 x 64 tile: the columns on x (up to 2^31 - 1 blocks), the
   rows on y, the slices of a split sum on z. */
static dim3 mgpu__implicit_grid(size_t columns, int rows, int slices) {
    return dim3((unsigned)((columns + MGPU__IMPLICIT_TILE - 1) / MGPU__IMPLICIT_TILE),
                (unsigned)((rows + MGPU__IMPLICIT_TILE - 1) / MGPU__IMPLICIT_TILE), (unsigned)slices);
}
static void mgpu__conv_implicit_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__conv_implicit_args *a = (const mgpu__conv_implicit_args *)args;
    dim3 grid = mgpu__implicit_grid((size_t)a->g.n * a->g.p * a->g.q, a->g.k, 1);
    mgpu__conv_implicit_kernel<<<grid, MGPU__IMPLICIT_THREADS, 0, (cudaStream_t)ex->stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
}
static void mgpu__conv_implicit_dgrad_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__conv_implicit_dgrad_args *a = (const mgpu__conv_implicit_dgrad_args *)args;
    dim3 grid = mgpu__implicit_grid((size_t)a->g.n * a->g.h * a->g.w, a->g.c, 1);
    mgpu__conv_implicit_dgrad_kernel<<<grid, MGPU__IMPLICIT_THREADS, 0, (cudaStream_t)ex->stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
}
static void mgpu__conv_implicit_wgrad_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__conv_implicit_wgrad_args *a = (const mgpu__conv_implicit_wgrad_args *)args;
    size_t crs = (size_t)a->g.c * a->g.r * a->g.s, n = (size_t)a->g.k * crs;
    dim3 grid = mgpu__implicit_grid(crs, a->g.k, a->splits);
    mgpu__conv_implicit_wgrad_kernel<<<grid, MGPU__IMPLICIT_THREADS, 0, (cudaStream_t)ex->stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
    mgpu__conv_implicit_wgrad_finish_kernel<<<mgpu__grid_for(n, 256), 256, 0,
                                              (cudaStream_t)ex->stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
}
#endif
