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
   16 x 16, stepping through C*R*S 16 at a time:
     1. 16 threads decode the step's 16 values of (c, r, s) into a table
        in shared memory (the offset of c, r and s in x, and r and s);
     2. all threads load the W tile [64 x 16] (rows of W are contiguous)
        and gather the col tile [16 x 64]: each thread owns one output
        pixel (its column) for the whole kernel, decoded once, so a gather
        is an add, two range tests and a load;
     3. each warp multiplies its tiles with the tensor cores (two WMMA
        steps of k = 8; the inputs rounded to TF32, the sums in float32).
   At the end the accumulators go through shared memory, so that the
   writes to y are consecutive pixels of one filter (coalesced).

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
#define MGPU__IMPLICIT_TILE 64 /* rows (filters or channels) and pixels per block */
#define MGPU__IMPLICIT_STEP 16 /* values of the summed index per step */

/* A block's tiles in shared memory; rows padded by 4 floats, as WMMA wants
   leading dimensions that are multiples of 4. */
typedef struct {
    float a[MGPU__IMPLICIT_TILE][MGPU__IMPLICIT_STEP + 4];   /* rows x step */
    float b[MGPU__IMPLICIT_STEP][MGPU__IMPLICIT_TILE + 4];   /* step x pixels */
    float out[MGPU__IMPLICIT_TILE][MGPU__IMPLICIT_TILE + 4]; /* rows x pixels */
} mgpu__implicit_tiles;

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800 /* TF32 WMMA: sm_80 and newer */
typedef nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 8, float> mgpu__implicit_acc;

/* Warp `warp` of 4 owns the 32 x 32 corner (row, col) of the block's tile. */
static __device__ inline void mgpu__implicit_corner(int warp, int *row, int *col) {
    *row = (warp / 2) * 32;
    *col = (warp % 2) * 32;
}
/* acc += a b for this warp's 2 x 2 tiles of 16 x 16: two steps of k = 8,
   the inputs rounded to TF32. */
static __device__ void mgpu__implicit_multiply(mgpu__implicit_acc (&acc)[2][2],
                                               const mgpu__implicit_tiles *t, int warp) {
    using namespace nvcuda;
    int row, col;
    mgpu__implicit_corner(warp, &row, &col);
    for (int kk = 0; kk < MGPU__IMPLICIT_STEP; kk += 8) {
        wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> fa[2];
        wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> fb[2];
        for (int i = 0; i < 2; i++) {
            wmma::load_matrix_sync(fa[i], &t->a[row + 16 * i][kk], MGPU__IMPLICIT_STEP + 4);
            wmma::load_matrix_sync(fb[i], &t->b[kk][col + 16 * i], MGPU__IMPLICIT_TILE + 4);
            for (int e = 0; e < fa[i].num_elements; e++) fa[i].x[e] = wmma::__float_to_tf32(fa[i].x[e]);
            for (int e = 0; e < fb[i].num_elements; e++) fb[i].x[e] = wmma::__float_to_tf32(fb[i].x[e]);
        }
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 2; j++) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
}
/* The accumulators into t->out (the caller synchronises before reading it). */
static __device__ void mgpu__implicit_store(const mgpu__implicit_acc (&acc)[2][2],
                                            mgpu__implicit_tiles *t, int warp) {
    int row, col;
    mgpu__implicit_corner(warp, &row, &col);
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++)
            nvcuda::wmma::store_matrix_sync(&t->out[row + 16 * i][col + 16 * j], acc[i][j],
                                            MGPU__IMPLICIT_TILE + 4, nvcuda::wmma::mem_row_major);
}
static __device__ void mgpu__implicit_zero(mgpu__implicit_acc (&acc)[2][2]) {
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) nvcuda::wmma::fill_fragment(acc[i][j], 0.0f);
}
#endif

typedef struct {
    float *y;       /* [n, K, P, Q] */
    const float *x; /* [n, C, H, W] */
    const float *w; /* [K, C*R*S] */
    const float *b; /* [K] or NULL */
    mgpu__conv_geom g;
} mgpu__conv_implicit_args;

static __global__ void mgpu__conv_implicit_kernel(mgpu__conv_implicit_args a) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    const mgpu__conv_geom g = a.g;
    const int T = MGPU__IMPLICIT_TILE, S = MGPU__IMPLICIT_STEP;
    __shared__ __align__(32) mgpu__implicit_tiles t;
    __shared__ int k_offset[S], k_r[S], k_s[S]; /* the step's (c, r, s), decoded */

    int tid = threadIdx.x, warp = tid / 32;
    int rs = g.r * g.s, crs = g.c * rs, pq = g.p * g.q, hw = g.h * g.w;
    int filter0 = blockIdx.y * T, pixel0 = blockIdx.x * T, npq = g.n * pq;
    /* this thread's output pixel (column of the col tile), decoded once */
    int column = tid % T, pixel = pixel0 + column;
    int img = pixel / pq, in_image = pixel % pq;
    int h0 = (in_image / g.q) * g.stride - g.pad, w0 = (in_image % g.q) * g.stride - g.pad;
    const float *x_img = a.x + (size_t)img * g.c * hw;

    mgpu__implicit_acc acc[2][2];
    mgpu__implicit_zero(acc);
    for (int k0 = 0; k0 < crs; k0 += S) {
        if (tid < S) { /* 1. decode this step's (c, r, s) */
            int k = k0 + tid, c = k / rs, r = k % rs / g.s, s = k % g.s;
            k_offset[tid] = k < crs ? c * hw + r * g.w + s : 0;
            k_r[tid] = k < crs ? r : -(1 << 20); /* past the end: outside every image */
            k_s[tid] = s;
        }
        __syncthreads(); /* the table is ready, and the last step's tiles are used up */
        /* 2. the W tile (8 values a thread: consecutive threads, consecutive k) */
        for (int e = tid; e < T * S; e += blockDim.x) {
            int m = e / S, kk = e % S, filter = filter0 + m, k = k0 + kk;
            t.a[m][kk] = filter < g.k && k < crs ? a.w[(size_t)filter * crs + k] : 0.0f;
        }
        /* ... and the col tile: this thread's column, rows tid / T, + 2, + 4, ... */
        for (int kk = tid / T; kk < S; kk += blockDim.x / T) {
            int h = h0 + k_r[kk], w = w0 + k_s[kk];
            t.b[kk][column] = pixel < npq && h >= 0 && h < g.h && w >= 0 && w < g.w
                                  ? x_img[k_offset[kk] + (h0 * g.w + w0)]
                                  : 0.0f;
        }
        __syncthreads();
        mgpu__implicit_multiply(acc, &t, warp); /* 3. the tensor cores */
    }
    /* the tile of Y to y [img, filter, p, q], through shared memory */
    mgpu__implicit_store(acc, &t, warp);
    __syncthreads();
    if (pixel >= npq) return;
    float *y_pixel = a.y + (size_t)img * g.k * pq + in_image;
    for (int m = tid / T; m < T; m += blockDim.x / T) {
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

static __global__ void mgpu__conv_implicit_dgrad_kernel(mgpu__conv_implicit_dgrad_args a) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    const mgpu__conv_geom g = a.g;
    const int T = MGPU__IMPLICIT_TILE, S = MGPU__IMPLICIT_STEP;
    __shared__ __align__(32) mgpu__implicit_tiles t;
    __shared__ int k_w[S], k_dy[S], k_r[S], k_s[S]; /* the step's (k, r, s), decoded */

    int tid = threadIdx.x, warp = tid / 32;
    int rs = g.r * g.s, krs = g.k * rs, pq = g.p * g.q, hw = g.h * g.w;
    int channel0 = blockIdx.y * T, pixel0 = blockIdx.x * T, nhw = g.n * hw;
    /* this thread's input pixel, decoded once */
    int column = tid % T, pixel = pixel0 + column;
    int img = pixel / hw, in_image = pixel % hw;
    int h = in_image / g.w + g.pad, w = in_image % g.w + g.pad; /* + d: p*t = h + d - r */
    const float *dy_img = a.dy + (size_t)img * g.k * pq;

    mgpu__implicit_acc acc[2][2];
    mgpu__implicit_zero(acc);
    for (int k0 = 0; k0 < krs; k0 += S) {
        if (tid < S) { /* 1. decode this step's (k, r, s) */
            int k = k0 + tid, filter = k / rs, r = k % rs / g.s, s = k % g.s;
            k_w[tid] = k < krs ? filter * g.c * rs + r * g.s + s : 0;
            k_dy[tid] = k < krs ? filter * pq : 0;
            k_r[tid] = k < krs ? r : (1 << 20); /* past the end: no window */
            k_s[tid] = s;
        }
        __syncthreads();
        /* 2. the W^T tile: rows are channels, w[k, c, r, s] */
        for (int e = tid; e < T * S; e += blockDim.x) {
            int m = e / S, kk = e % S, channel = channel0 + m;
            t.a[m][kk] = channel < g.c && k0 + kk < krs ? a.w[k_w[kk] + channel * rs] : 0.0f;
        }
        /* ... and the dcol tile, gathered from dy: the windows that covered this pixel */
        for (int kk = tid / T; kk < S; kk += blockDim.x / T) {
            int hp = h - k_r[kk], wp = w - k_s[kk], p = hp / g.stride, q = wp / g.stride;
            bool inside = pixel < nhw && hp >= 0 && wp >= 0 && p * g.stride == hp &&
                          q * g.stride == wp && p < g.p && q < g.q;
            t.b[kk][column] = inside ? dy_img[k_dy[kk] + p * g.q + q] : 0.0f;
        }
        __syncthreads();
        mgpu__implicit_multiply(acc, &t, warp);
    }
    mgpu__implicit_store(acc, &t, warp);
    __syncthreads();
    if (pixel >= nhw) return;
    float *dx_pixel = a.dx + (size_t)img * g.c * hw + in_image;
    for (int m = tid / T; m < T; m += blockDim.x / T) {
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

static __global__ void mgpu__conv_implicit_wgrad_kernel(mgpu__conv_implicit_wgrad_args a) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    const mgpu__conv_geom g = a.g;
    const int T = MGPU__IMPLICIT_TILE, S = MGPU__IMPLICIT_STEP;
    __shared__ __align__(32) mgpu__implicit_tiles t;
    __shared__ int l_dy[S], l_x[S], l_h[S], l_w[S]; /* the step's output pixels, decoded */

    int tid = threadIdx.x, warp = tid / 32;
    int rs = g.r * g.s, crs = g.c * rs, pq = g.p * g.q, hw = g.h * g.w;
    int filter0 = blockIdx.y * T, column0 = blockIdx.x * T;
    /* this block's slice of the output pixels */
    int pixels = g.n * pq, per = (pixels + a.splits - 1) / a.splits;
    int first = blockIdx.z * per, end = first + per < pixels ? first + per : pixels;
    /* this thread's (c, r, s), decoded once */
    int column = tid % T, k = column0 + column;
    int c = k / rs, r = k % rs / g.s, s = k % g.s;
    int x_c = c * hw;

    mgpu__implicit_acc acc[2][2];
    mgpu__implicit_zero(acc);
    for (int l0 = first; l0 < end; l0 += S) {
        if (tid < S) { /* 1. decode this step's output pixels (img, p, q) */
            int l = l0 + tid, img = l / pq, in_image = l % pq;
            l_dy[tid] = l < end ? img * g.k * pq + in_image : 0;
            l_x[tid] = l < end ? img * g.c * hw : 0;
            l_h[tid] = l < end ? in_image / g.q * g.stride - g.pad : -(1 << 20);
            l_w[tid] = in_image % g.q * g.stride - g.pad;
        }
        __syncthreads();
        /* 2. the G tile (dy: rows are filters) */
        for (int e = tid; e < T * S; e += blockDim.x) {
            int m = e / S, kk = e % S, filter = filter0 + m;
            t.a[m][kk] = filter < g.k && l0 + kk < end ? a.dy[l_dy[kk] + filter * pq] : 0.0f;
        }
        /* ... and the col^T tile, gathered from x: this thread's (c, r, s) */
        for (int kk = tid / T; kk < S; kk += blockDim.x / T) {
            int h = l_h[kk] + r, w = l_w[kk] + s;
            t.b[kk][column] = k < crs && h >= 0 && h < g.h && w >= 0 && w < g.w
                                  ? a.x[l_x[kk] + x_c + h * g.w + w]
                                  : 0.0f;
        }
        __syncthreads();
        mgpu__implicit_multiply(acc, &t, warp);
    }
    mgpu__implicit_store(acc, &t, warp);
    __syncthreads();
    if (k >= crs) return;
    float *partial = a.partials + (size_t)blockIdx.z * g.k * crs + k;
    for (int m = tid / T; m < T; m += blockDim.x / T) {
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
    mgpu__conv_implicit_kernel<<<grid, 128, 0, (cudaStream_t)ex->stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
}
static void mgpu__conv_implicit_dgrad_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__conv_implicit_dgrad_args *a = (const mgpu__conv_implicit_dgrad_args *)args;
    dim3 grid = mgpu__implicit_grid((size_t)a->g.n * a->g.h * a->g.w, a->g.c, 1);
    mgpu__conv_implicit_dgrad_kernel<<<grid, 128, 0, (cudaStream_t)ex->stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
}
static void mgpu__conv_implicit_wgrad_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__conv_implicit_wgrad_args *a = (const mgpu__conv_implicit_wgrad_args *)args;
    size_t crs = (size_t)a->g.c * a->g.r * a->g.s, n = (size_t)a->g.k * crs;
    dim3 grid = mgpu__implicit_grid(crs, a->g.k, a->splits);
    mgpu__conv_implicit_wgrad_kernel<<<grid, 128, 0, (cudaStream_t)ex->stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
    mgpu__conv_implicit_wgrad_finish_kernel<<<mgpu__grid_for(n, 256), 256, 0,
                                              (cudaStream_t)ex->stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
}
#endif
