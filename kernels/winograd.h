/* kernels/winograd.h: a 3x3 convolution at stride 1 by Winograd's minimal
   filtering, F(2x2, 3x3), from a channels-last copy of its input (GPU
   only, TF32 products by cuBLAS). For the forward pass and, with the
   weights turned round, the input gradient (conv_nhwc.h says how dx is a
   convolution of dy).

   Why. A 2x2 block of outputs of a 3x3 window reads a 4x4 patch of the
   input and takes 36 multiplies a channel directly; Winograd takes 16.
   Lavin and Gray (2015): with the patch d and the window g,
       y = A^T [ (G g G^T) * (B^T d B) ] A        (* elementwise)
   where
       B^T = | 1  0 -1  0 |    G = | 1    0    0  |    A^T = | 1  1  1  0 |
             | 0  1  1  0 |        | 1/2  1/2  1/2 |          | 0  1 -1 -1 |
             | 0 -1  1  0 |        | 1/2 -1/2  1/2 |
             | 0  1  0 -1 |        | 0    0    1  |
   The sum over channels commutes with A: for each of the 16 positions
   xi of the 4x4 transformed patch it is one matrix product,
       M[xi] [tiles, K] = V[xi] [tiles, C] U[xi] [C, K],
   V[xi][tile][c] = (B^T d B)[xi] of channel c's patch, U[xi][c][k] =
   (G g G^T)[xi] of filter k's window on channel c. So a convolution is
   four passes: the input's transform (a read of x, a write of 16/4 = 4
   times its size: every output pixel's 4x4 patch, a 2x2 step apart), the
   weights' (16/9 of theirs), 16 products by cuBLAS
   (cublasGemmStridedBatchedEx, 16/36 of the direct convolution's
   multiplies) and the output's transform (a read of 4 times y, a write
   of y).

   Where it pays. The transformed tensors are 4 times the input and the
   output, read and written once more each, so the passes over memory
   cost what the products save where the channels are few (ResNet-18's
   stage 1: 64). Where they are many and the images small (stage 4: 512
   channels of 4x4 pixels, one 2x2 grid of tiles an image, 4096 output
   pixels for 512 filters) the direct kernel has too few output tiles to
   fill the GPU, and cuBLAS's products are large. The trial in
   mgpu/convolution.h times it beside the channels-last kernels where it
   fits (3x3, stride 1) and the channels and filters are 256 or more
   (mgpu__conv_winograd_worth_trying says why), and keeps it where it is
   faster.

   Precision. The transforms add and halve in float32; cuBLAS rounds V
   and U to TF32 (CUBLAS_COMPUTE_32F_FAST_TF32), as the direct kernels
   round x and w. The patches' sums make the rounding's error larger: on
   the emulated GPU (tests/gpu_layers.c, 32 to 96 channels) the largest
   error is about twice conv_nhwc.h's on the same shapes, both well within
   the 2e-3 of the largest value that the tests allow (bench/history.md).

   Tiles. Output pixel (p, q) is in tile (p / 2, q / 2) of its image; a
   tile's patch starts at input pixel (2 (p / 2) - pad, 2 (q / 2) - pad),
   with zeros outside the image. An odd P or Q leaves a last row or column
   of tiles half used. */
#ifndef MGPU_KERNELS_WINOGRAD_H
#define MGPU_KERNELS_WINOGRAD_H
#include "common.h"
#include "conv.h"


#if MGPU_CUDA
typedef struct {
    float *out;          /* [n, K, P, Q]: accumulate ? out + y : y */
    const float *in_t;   /* [n, H, W, C], TF32 (conv_nhwc.h's copies) */
    const float *w;      /* [K, C, 3, 3]; turned: [C, K, 3, 3], used as w' (conv_nhwc.h) */
    const float *b;      /* [K] or NULL */
    float *v, *u, *m;    /* scratch: [16, tiles, C], [16, C, K], [16, tiles, K] */
    mgpu__conv_geom g;   /* 3x3, stride 1; C a multiple of 4 */
    int turned, accumulate;
} mgpu__winograd_args;

/* The tiles of an image in each direction, and in all. */
static __host__ __device__ int mgpu__winograd_tile_rows(const mgpu__conv_geom &g) { return (g.p + 1) / 2; }
static __host__ __device__ int mgpu__winograd_tile_cols(const mgpu__conv_geom &g) { return (g.q + 1) / 2; }
static size_t mgpu__winograd_tiles(const mgpu__conv_geom *g) {
    return (size_t)g->n * mgpu__winograd_tile_rows(*g) * mgpu__winograd_tile_cols(*g);
}
/* Whether it computes a convolution of geometry g: 3x3 at stride 1, C a
   multiple of 4, and the transformed tensors indexable by int. */
static int mgpu__winograd_fits(const mgpu__conv_geom *g) {
    size_t widest = g->c > g->k ? g->c : g->k;
    return g->r == 3 && g->s == 3 && g->stride == 1 && g->pad <= 2 && g->c % 4 == 0 &&
           16 * mgpu__winograd_tiles(g) * widest < INT_MAX && 16 * (size_t)g->c * g->k < INT_MAX;
}

/* V[xi][tile][c .. c+3] = (B^T d B)[xi] for 4 channels at once: one
   thread a tile and 4 channels, 16 loads of 16 bytes from in_t and 16
   stores to V. */
static __global__ void mgpu__winograd_input_kernel(mgpu__winograd_args a) {
    const mgpu__conv_geom &g = a.g;
    int quads = g.c / 4, rows = mgpu__winograd_tile_rows(g), cols = mgpu__winograd_tile_cols(g);
    size_t tiles = (size_t)g.n * rows * cols;
    MGPU__GRID_STRIDE_LOOP(i, tiles * quads) {
        size_t tile = i / quads;
        int c = (int)(i % quads) * 4, img = (int)(tile / ((size_t)rows * cols));
        int in_image = (int)(tile % ((size_t)rows * cols));
        int h0 = in_image / cols * 2 - g.pad, w0 = in_image % cols * 2 - g.pad;
        float d[4][4][4], t[4][4][4]; /* [row][column][channel] */
        for (int y = 0; y < 4; y++)
            for (int x = 0; x < 4; x++) {
                int h = h0 + y, w = w0 + x;
                if ((unsigned)h < (unsigned)g.h && (unsigned)w < (unsigned)g.w)
                    mgpu__load_floats(d[y][x], &a.in_t[(((size_t)img * g.h + h) * g.w + w) * g.c + c]);
                else
                    for (int l = 0; l < 4; l++) d[y][x][l] = 0.0f;
            }
        for (int x = 0; x < 4; x++) /* t = B^T d */
            for (int l = 0; l < 4; l++) {
                t[0][x][l] = d[0][x][l] - d[2][x][l], t[1][x][l] = d[1][x][l] + d[2][x][l];
                t[2][x][l] = d[2][x][l] - d[1][x][l], t[3][x][l] = d[1][x][l] - d[3][x][l];
            }
        for (int y = 0; y < 4; y++) { /* t B, a row of 4 positions at a time */
            float v[4][4];
            for (int l = 0; l < 4; l++) {
                v[0][l] = t[y][0][l] - t[y][2][l], v[1][l] = t[y][1][l] + t[y][2][l];
                v[2][l] = t[y][2][l] - t[y][1][l], v[3][l] = t[y][1][l] - t[y][3][l];
            }
            for (int x = 0; x < 4; x++)
                mgpu__store_floats(&a.v[((4 * y + x) * tiles + tile) * g.c + c], v[x]);
        }
    }
}

/* U[xi][c][k] = (G g G^T)[xi] of w's window for filter k on channel c
   (turned: of w[c][k] turned half a circle, the input gradient's
   filters). One thread a window. */
static __global__ void mgpu__winograd_weights_kernel(mgpu__winograd_args a) {
    const mgpu__conv_geom &g = a.g;
    size_t windows = (size_t)g.c * g.k;
    MGPU__GRID_STRIDE_LOOP(i, windows) {
        int k = (int)(i % g.k), c = (int)(i / g.k);
        const float *window = a.turned ? &a.w[((size_t)c * g.k + k) * 9] : &a.w[((size_t)k * g.c + c) * 9];
        float w[3][3], t[4][3];
        for (int j = 0; j < 9; j++) w[j / 3][j % 3] = a.turned ? window[8 - j] : window[j];
        for (int x = 0; x < 3; x++) { /* t = G w */
            t[0][x] = w[0][x];
            t[1][x] = 0.5f * (w[0][x] + w[1][x] + w[2][x]);
            t[2][x] = 0.5f * (w[0][x] - w[1][x] + w[2][x]);
            t[3][x] = w[2][x];
        }
        for (int y = 0; y < 4; y++) { /* t G^T */
            float *u = &a.u[(size_t)(4 * y) * windows + i];
            u[0] = t[y][0];
            u[windows] = 0.5f * (t[y][0] + t[y][1] + t[y][2]);
            u[2 * windows] = 0.5f * (t[y][0] - t[y][1] + t[y][2]);
            u[3 * windows] = t[y][2];
        }
    }
}

/* out[img, k, 2 ty + y, 2 tx + x] (+)= (A^T M A)[y][x] + b[k], one thread
   a tile and filter (filters fastest: the 16 loads of M are
   coalesced). */
static __global__ void mgpu__winograd_output_kernel(mgpu__winograd_args a) {
    const mgpu__conv_geom &g = a.g;
    int rows = mgpu__winograd_tile_rows(g), cols = mgpu__winograd_tile_cols(g);
    size_t tiles = (size_t)g.n * rows * cols, apart = tiles * g.k;
    MGPU__GRID_STRIDE_LOOP(i, apart) {
        size_t tile = i / g.k;
        int k = (int)(i % g.k), img = (int)(tile / ((size_t)rows * cols));
        int in_image = (int)(tile % ((size_t)rows * cols));
        float m[4][4], t[2][4];
        for (int xi = 0; xi < 16; xi++) m[xi / 4][xi % 4] = a.m[xi * apart + i];
        for (int x = 0; x < 4; x++) /* t = A^T m */
            t[0][x] = m[0][x] + m[1][x] + m[2][x], t[1][x] = m[1][x] - m[2][x] - m[3][x];
        float bias = a.b ? a.b[k] : 0.0f;
        int p0 = in_image / cols * 2, q0 = in_image % cols * 2;
        float *plane = &a.out[((size_t)img * g.k + k) * g.p * g.q];
        for (int y = 0; y < 2; y++)
            for (int x = 0; x < 2; x++) {
                /* (t A)[y][x] */
                float value = (x == 0 ? t[y][0] + t[y][1] + t[y][2] : t[y][1] - t[y][2] - t[y][3]) + bias;
                if (p0 + y < g.p && q0 + x < g.q) {
                    float *o = &plane[(size_t)(p0 + y) * g.q + q0 + x];
                    *o = a.accumulate ? *o + value : value;
                }
            }
    }
}

/* The four passes on the queue's stream and cuBLAS handle. M[xi] [tiles,
   K] = V[xi] [tiles, C] U[xi] [C, K], row-major: column-major, as cuBLAS
   reads it, that is M^T = U^T V^T (matmul.h), K x tiles. */
static void mgpu__winograd_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__winograd_args *a = (const mgpu__winograd_args *)args;
    const mgpu__conv_geom *g = &a->g;
    cudaStream_t stream = (cudaStream_t)ex->stream;
    size_t tiles = mgpu__winograd_tiles(g);
    mgpu__winograd_input_kernel<<<mgpu__grid_for(tiles * (g->c / 4), 256), 256, 0, stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
    mgpu__winograd_weights_kernel<<<mgpu__grid_for((size_t)g->c * g->k, 256), 256, 0, stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
    const float one = 1.0f, zero = 0.0f;
    MGPU_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        (cublasHandle_t)ex->cublas, CUBLAS_OP_N, CUBLAS_OP_N, g->k, (int)tiles, g->c, &one, a->u, CUDA_R_32F,
        g->k, (long long)g->c * g->k, a->v, CUDA_R_32F, g->c, (long long)tiles * g->c, &zero, a->m, CUDA_R_32F,
        g->k, (long long)tiles * g->k, 16, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT));
    mgpu__winograd_output_kernel<<<mgpu__grid_for(tiles * g->k, 256), 256, 0, stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
}
#endif
#endif
