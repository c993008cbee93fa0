/* kernels/conv_implicit.h: the convolution's forward pass and input
   gradient as implicit GEMMs on the tensor cores (GPU only, TF32), an
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
   channels, columns input pixels, steps (k, r, s). (The weight gradient
   still goes through im2col: its long sum over n*P*Q needs a split of
   the sum over blocks, the next step.)

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

/* Grids: pixels on x (up to 2^31 - 1 blocks), rows on y. */
static void mgpu__conv_implicit_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__conv_implicit_args *a = (const mgpu__conv_implicit_args *)args;
    unsigned pixels = (unsigned)a->g.n * a->g.p * a->g.q;
    dim3 grid((pixels + MGPU__IMPLICIT_TILE - 1) / MGPU__IMPLICIT_TILE,
              (a->g.k + MGPU__IMPLICIT_TILE - 1) / MGPU__IMPLICIT_TILE);
    mgpu__conv_implicit_kernel<<<grid, 128, 0, (cudaStream_t)ex->stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
}
static void mgpu__conv_implicit_dgrad_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__conv_implicit_dgrad_args *a = (const mgpu__conv_implicit_dgrad_args *)args;
    unsigned pixels = (unsigned)a->g.n * a->g.h * a->g.w;
    dim3 grid((pixels + MGPU__IMPLICIT_TILE - 1) / MGPU__IMPLICIT_TILE,
              (a->g.c + MGPU__IMPLICIT_TILE - 1) / MGPU__IMPLICIT_TILE);
    mgpu__conv_implicit_dgrad_kernel<<<grid, 128, 0, (cudaStream_t)ex->stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
}
#endif
