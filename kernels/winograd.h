/* kernels/winograd.h: a 3x3 convolution at stride 1 by Winograd's minimal
   filtering, F(2x2, 3x3): on a GPU from a channels-last copy of its input
   (TF32 products by cuBLAS), on the CPU from the NCHW tensor itself
   (float32 products by OpenBLAS). For the forward pass and, with the
   weights turned round, the input gradient (conv.h says how dx is a
   convolution of dy); on the CPU also the weight gradient.

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
   faster. On a 2-core CPU, against oneDNN's AVX2 kernels, it won the
   weight gradient from 64 channels, the forward pass from 128 and dx at
   512 (mgpu/convolution.h's rule).

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
#include <limits.h>
#include "common.h"
#include "conv.h"
#include "matmul.h"

/* The tiles of an image in each direction, and in all. */
static MGPU__HOSTDEVICE inline int mgpu__winograd_tile_rows(const mgpu__conv_geom *g) { return (g->p + 1) / 2; }
static MGPU__HOSTDEVICE inline int mgpu__winograd_tile_cols(const mgpu__conv_geom *g) { return (g->q + 1) / 2; }
static inline size_t mgpu__winograd_tiles(const mgpu__conv_geom *g) {
    return (size_t)g->n * mgpu__winograd_tile_rows(g) * mgpu__winograd_tile_cols(g);
}
/* Whether g is a shape that F(2x2, 3x3) computes: 3x3 at stride 1, and
   padding at most 2, so that dx's convolution (conv.h), padded by 2 -
   pad, is one too. */
static inline int mgpu__winograd_shape(const mgpu__conv_geom *g) {
    return g->r == 3 && g->s == 3 && g->stride == 1 && g->pad <= 2;
}
/* Whether the GPU's passes compute a convolution of geometry g: its
   shape, C a multiple of 4 (the loads take 4 channels), and the
   transformed tensors indexable by int. */
static inline int mgpu__winograd_fits(const mgpu__conv_geom *g) {
    size_t widest = g->c > g->k ? g->c : g->k;
    return mgpu__winograd_shape(g) && g->c % 4 == 0 && 16 * mgpu__winograd_tiles(g) * widest < INT_MAX &&
           16 * (size_t)g->c * g->k < INT_MAX;
}

/* The three transforms of one patch, window or tile, on both sides. */
/* v = B^T d B: a 4x4 patch of the input. */
static MGPU__HOSTDEVICE inline void mgpu__winograd_patch(const float d[4][4], float v[4][4]) {
    float t[4][4];
    for (int x = 0; x < 4; x++) { /* t = B^T d */
        t[0][x] = d[0][x] - d[2][x], t[1][x] = d[1][x] + d[2][x];
        t[2][x] = d[2][x] - d[1][x], t[3][x] = d[1][x] - d[3][x];
    }
    for (int y = 0; y < 4; y++) { /* t B */
        v[y][0] = t[y][0] - t[y][2], v[y][1] = t[y][1] + t[y][2];
        v[y][2] = t[y][2] - t[y][1], v[y][3] = t[y][1] - t[y][3];
    }
}
/* u = G w G^T: a 3x3 window of the weights. */
static MGPU__HOSTDEVICE inline void mgpu__winograd_window(const float w[3][3], float u[4][4]) {
    float t[4][3];
    for (int x = 0; x < 3; x++) { /* t = G w */
        t[0][x] = w[0][x];
        t[1][x] = 0.5f * (w[0][x] + w[1][x] + w[2][x]);
        t[2][x] = 0.5f * (w[0][x] - w[1][x] + w[2][x]);
        t[3][x] = w[2][x];
    }
    for (int y = 0; y < 4; y++) { /* t G^T */
        u[y][0] = t[y][0];
        u[y][1] = 0.5f * (t[y][0] + t[y][1] + t[y][2]);
        u[y][2] = 0.5f * (t[y][0] - t[y][1] + t[y][2]);
        u[y][3] = t[y][2];
    }
}
/* o = A^T m A: a tile's 2x2 outputs from its 4x4 products. */
static MGPU__HOSTDEVICE inline void mgpu__winograd_outputs(const float m[4][4], float o[2][2]) {
    float t[2][4];
    for (int x = 0; x < 4; x++) /* t = A^T m */
        t[0][x] = m[0][x] + m[1][x] + m[2][x], t[1][x] = m[1][x] - m[2][x] - m[3][x];
    for (int y = 0; y < 2; y++) /* t A */
        o[y][0] = t[y][0] + t[y][1] + t[y][2], o[y][1] = t[y][1] - t[y][2] - t[y][3];
}
/* The weight gradient runs the forward pass's transforms backwards: with
   y = A^T (U * V) A and U = G w G^T, a tile's dy gives dU = (A dy A^T) * V
   and dw = G^T dU G, each summed over the tiles (and dU over them before
   G^T . G, which is linear). */
/* e = A dy A^T: a tile's 2x2 output gradients spread over 4x4. */
static MGPU__HOSTDEVICE inline void mgpu__winograd_tile_gradient(const float dy[2][2], float e[4][4]) {
    float t[4][2];
    for (int x = 0; x < 2; x++) { /* t = A dy */
        t[0][x] = dy[0][x], t[1][x] = dy[0][x] + dy[1][x];
        t[2][x] = dy[0][x] - dy[1][x], t[3][x] = -dy[1][x];
    }
    for (int y = 0; y < 4; y++) { /* t A^T */
        e[y][0] = t[y][0], e[y][1] = t[y][0] + t[y][1];
        e[y][2] = t[y][0] - t[y][1], e[y][3] = -t[y][1];
    }
}
/* dw = G^T du G: a window's 3x3 gradient from its 4x4 sums. */
static MGPU__HOSTDEVICE inline void mgpu__winograd_window_gradient(const float du[4][4], float dw[3][3]) {
    float t[3][4];
    for (int x = 0; x < 4; x++) { /* t = G^T du */
        t[0][x] = du[0][x] + 0.5f * (du[1][x] + du[2][x]);
        t[1][x] = 0.5f * (du[1][x] - du[2][x]);
        t[2][x] = 0.5f * (du[1][x] + du[2][x]) + du[3][x];
    }
    for (int y = 0; y < 3; y++) { /* t G */
        dw[y][0] = t[y][0] + 0.5f * (t[y][1] + t[y][2]);
        dw[y][1] = 0.5f * (t[y][1] - t[y][2]);
        dw[y][2] = 0.5f * (t[y][1] + t[y][2]) + t[y][3];
    }
}
/* Filter k's window on channel c, as w stores it; turned: the input
   gradient's filters, the layer's weights turned half a circle, with g
   mgpu__conv_dx_geometry's (g->c the layer's filters, g->k its channels,
   so that w is [g->c, g->k, 3, 3]). */
static MGPU__HOSTDEVICE inline void mgpu__winograd_window_of(const float *w, const mgpu__conv_geom *g, int k, int c,
                                                            int turned, float window[3][3]) {
    const float *f = turned ? &w[((size_t)c * g->k + k) * 9] : &w[((size_t)k * g->c + c) * 9];
    for (int j = 0; j < 9; j++) window[j / 3][j % 3] = turned ? f[8 - j] : f[j];
}

/* ------------------------------------------------------------------ CPU
   The same four passes on the NCHW tensors, each of the 16 positions xi a
   plane: V[xi] [C, tiles], U[xi] [K, C], M[xi] [K, tiles] = U[xi] V[xi]
   by OpenBLAS (16 products), tiles in the order of the output's pixels,
   so that an image's plane of x or y is read or written along its rows.
   Each plane is padded by MGPU__WINOGRAD_CPU_PAD floats: the 16 values of
   one patch are written 16 planes apart, and planes a multiple of 4 KiB
   apart (ResNet-18's all are) fall in the same cache set, which made the
   input's transform 3 to 5.6 times slower (bench/RESULTS.md, "Winograd
   on the CPU"). The transforms compute each value in one order whatever
   the number of threads; the products are OpenBLAS's, whose sums, as
   im2col's, can round differently with the number of threads. */
#define MGPU__WINOGRAD_CPU_PAD 16
typedef struct {
    float *out;        /* [n, K, P, Q]: accumulate ? out + y : y */
    const float *in;   /* [n, C, H, W] */
    const float *w;    /* [K, C, 3, 3]; turned: [C, K, 3, 3] (above) */
    const float *b;    /* [K] or NULL */
    float *v, *u, *m;  /* scratch: 16 planes each, mgpu__winograd_cpu_floats */
    mgpu__conv_geom g; /* 3x3, stride 1 */
    int turned, accumulate;
} mgpu__winograd_cpu_args;

/* One plane of V, U or M, in floats (with its padding). */
static inline size_t mgpu__winograd_cpu_plane(size_t rows, size_t cols) {
    return rows * cols + MGPU__WINOGRAD_CPU_PAD;
}
/* Whether the CPU's passes compute a convolution of geometry g: its
   shape, any C, and each scratch tensor (below) indexable by int. */
static inline int mgpu__winograd_cpu_fits(const mgpu__conv_geom *g) {
    size_t tiles = mgpu__winograd_tiles(g), widest = g->c > g->k ? g->c : g->k;
    return mgpu__winograd_shape(g) && 16 * mgpu__winograd_cpu_plane(widest, tiles) < INT_MAX &&
           16 * mgpu__winograd_cpu_plane(g->k, g->c) < INT_MAX;
}
/* Whether the CPU's passes compute all three passes of a layer of
   geometry g: the forward pass and dW in g, dx in conv.h's
   mgpu__conv_dx_geometry. */
static inline int mgpu__winograd_cpu_fits_layer(const mgpu__conv_geom *g) {
    mgpu__conv_geom d = mgpu__conv_dx_geometry(g);
    return mgpu__winograd_cpu_fits(g) && mgpu__winograd_cpu_fits(&d);
}
/* The three scratch tensors of each CPU pass, in floats: the input's side
   [C, tiles] (V), the weights' [K, C] (U, or dU) and the output's [K,
   tiles] (M, or E), 16 planes each. */
static inline void mgpu__winograd_cpu_floats(const mgpu__conv_geom *g, size_t floats[3]) {
    size_t tiles = mgpu__winograd_tiles(g);
    floats[0] = 16 * mgpu__winograd_cpu_plane(g->c, tiles);
    floats[1] = 16 * mgpu__winograd_cpu_plane(g->k, g->c);
    floats[2] = 16 * mgpu__winograd_cpu_plane(g->k, tiles);
}

/* V[xi][c][tile] = (B^T d B)[xi] of the tile's patch of channel c: one
   image's plane at a time. */
static void mgpu__winograd_input_cpu(const float *in, float *v_all, const mgpu__conv_geom *g) {
    int rows = mgpu__winograd_tile_rows(g), cols = mgpu__winograd_tile_cols(g);
    size_t tiles = mgpu__winograd_tiles(g), apart = mgpu__winograd_cpu_plane(g->c, tiles);
    size_t planes = (size_t)g->n * g->c;
    MGPU__CPU_PARALLEL_FOR(planes * g->h * g->w)
    for (size_t plane = 0; plane < planes; plane++) {
        size_t img = plane / g->c, c = plane % g->c;
        const float *x = &in[plane * g->h * g->w];
        float *v = &v_all[c * tiles + img * rows * cols];
        for (int ty = 0; ty < rows; ty++)
            for (int tx = 0; tx < cols; tx++) {
                float d[4][4], t[4][4];
                for (int y = 0; y < 4; y++)
                    for (int xx = 0; xx < 4; xx++) {
                        int h = 2 * ty - g->pad + y, w = 2 * tx - g->pad + xx;
                        int inside = (unsigned)h < (unsigned)g->h && (unsigned)w < (unsigned)g->w;
                        d[y][xx] = inside ? x[h * g->w + w] : 0.0f;
                    }
                mgpu__winograd_patch(d, t);
                for (int xi = 0; xi < 16; xi++) v[xi * apart + (size_t)ty * cols + tx] = t[xi / 4][xi % 4];
            }
    }
}

/* U[xi][k][c] = (G w G^T)[xi] of filter k's window on channel c. */
static void mgpu__winograd_weights_cpu(const mgpu__winograd_cpu_args *a) {
    const mgpu__conv_geom *g = &a->g;
    size_t windows = (size_t)g->k * g->c, apart = mgpu__winograd_cpu_plane(g->k, g->c);
    MGPU__CPU_PARALLEL_FOR(windows * 9)
    for (size_t i = 0; i < windows; i++) {
        float window[3][3], u[4][4];
        mgpu__winograd_window_of(a->w, g, (int)(i / g->c), (int)(i % g->c), a->turned, window);
        mgpu__winograd_window(window, u);
        for (int xi = 0; xi < 16; xi++) a->u[xi * apart + i] = u[xi / 4][xi % 4];
    }
}

/* The output's side, a tile at a time: the images' planes [P, Q] of each
   filter k beside its tiles' 16 planes m[xi][k][tile] (K x tiles, `apart`
   floats apart). With `out`, the forward pass's last transform: out (+)=
   (A^T M A) + b[k] (in: out itself, read where it accumulates). Without,
   the weight gradient's first: M = A dy A^T of each tile's 2x2 of in = dy
   (zeros past the last row or column). */
static void mgpu__winograd_output_side_cpu(const float *in, float *out, float *m, const float *b,
                                           const mgpu__conv_geom *g, int accumulate) {
    int rows = mgpu__winograd_tile_rows(g), cols = mgpu__winograd_tile_cols(g);
    size_t tiles = mgpu__winograd_tiles(g), apart = mgpu__winograd_cpu_plane(g->k, tiles);
    size_t planes = (size_t)g->n * g->k;
    int reads_pixels = !out || accumulate;
    MGPU__CPU_PARALLEL_FOR(planes * g->p * g->q)
    for (size_t i = 0; i < planes; i++) {
        size_t img = i / g->k, k = i % g->k, at = i * g->p * g->q;
        float bias = b ? b[k] : 0.0f;
        for (int ty = 0; ty < rows; ty++)
            for (int tx = 0; tx < cols; tx++) {
                float *tile = &m[k * tiles + (img * rows + ty) * cols + tx], transformed[4][4], pixels[2][2], o[2][2];
                for (int y = 0; y < 2; y++)
                    for (int x = 0; x < 2; x++) {
                        int p = 2 * ty + y, q = 2 * tx + x;
                        pixels[y][x] = reads_pixels && p < g->p && q < g->q ? in[at + p * g->q + q] : 0.0f;
                    }
                if (!out) {
                    mgpu__winograd_tile_gradient(pixels, transformed);
                    for (int xi = 0; xi < 16; xi++) tile[xi * apart] = transformed[xi / 4][xi % 4];
                    continue;
                }
                for (int xi = 0; xi < 16; xi++) transformed[xi / 4][xi % 4] = tile[xi * apart];
                mgpu__winograd_outputs(transformed, o);
                for (int y = 0; y < 2; y++)
                    for (int x = 0; x < 2; x++) {
                        int p = 2 * ty + y, q = 2 * tx + x;
                        if (p >= g->p || q >= g->q) continue; /* (the half-used last tiles) */
                        float value = o[y][x] + bias;
                        out[at + p * g->q + q] = accumulate ? pixels[y][x] + value : value;
                    }
            }
    }
}

static void mgpu__winograd_cpu(const void *args, const mgpu__exec *ex) {
    const mgpu__winograd_cpu_args *a = (const mgpu__winograd_cpu_args *)args;
    const mgpu__conv_geom *g = &a->g;
    size_t tiles = mgpu__winograd_tiles(g);
    mgpu__winograd_input_cpu(a->in, a->v, g);
    mgpu__winograd_weights_cpu(a);
    for (int xi = 0; xi < 16; xi++) {
        mgpu__gemm_args product = {0, 0, g->k, (int)tiles, g->c, 1.0f, 0.0f,
                                   a->u + xi * mgpu__winograd_cpu_plane(g->k, g->c), g->c,
                                   a->v + xi * mgpu__winograd_cpu_plane(g->c, tiles), (int)tiles,
                                   a->m + xi * mgpu__winograd_cpu_plane(g->k, tiles), (int)tiles, 0};
        mgpu__gemm_cpu(&product, ex);
    }
    mgpu__winograd_output_side_cpu(a->out, a->out, a->m, a->b, g, a->accumulate);
}

/* The weight gradient (CPU only), from the same tiles of x: V as above,
   E[xi] [K, tiles] = (A dy A^T)[xi] of each tile's dy, and 16 products
   dU[xi] [K, C] = E[xi] V[xi]^T, each a sum over the tiles; then
   dw[k, c] (+)= G^T dU G. */
typedef struct {
    float *dw;          /* [K, C, 3, 3]: accumulate ? dw + the gradient : it */
    const float *x;     /* [n, C, H, W] */
    const float *dy;    /* [n, K, P, Q] */
    float *v, *du, *e;  /* scratch: 16 planes each, mgpu__winograd_cpu_floats */
    mgpu__conv_geom g;  /* 3x3, stride 1 */
    int accumulate;
} mgpu__winograd_dw_cpu_args;

static void mgpu__winograd_dw_cpu(const void *args, const mgpu__exec *ex) {
    const mgpu__winograd_dw_cpu_args *a = (const mgpu__winograd_dw_cpu_args *)args;
    const mgpu__conv_geom *g = &a->g;
    size_t tiles = mgpu__winograd_tiles(g), apart = mgpu__winograd_cpu_plane(g->k, g->c);
    mgpu__winograd_input_cpu(a->x, a->v, g);
    mgpu__winograd_output_side_cpu(a->dy, NULL, a->e, NULL, g, 0);
    for (int xi = 0; xi < 16; xi++) {
        mgpu__gemm_args product = {0, 1, g->k, g->c, (int)tiles, 1.0f, 0.0f,
                                   a->e + xi * mgpu__winograd_cpu_plane(g->k, tiles), (int)tiles,
                                   a->v + xi * mgpu__winograd_cpu_plane(g->c, tiles), (int)tiles,
                                   a->du + xi * apart, g->c, 0};
        mgpu__gemm_cpu(&product, ex);
    }
    size_t windows = (size_t)g->k * g->c;
    MGPU__CPU_PARALLEL_FOR(windows * 9)
    for (size_t i = 0; i < windows; i++) {
        float du[4][4], window[3][3];
        for (int xi = 0; xi < 16; xi++) du[xi / 4][xi % 4] = a->du[xi * apart + i];
        mgpu__winograd_window_gradient(du, window);
        float *dw = &a->dw[i * 9];
        for (int j = 0; j < 9; j++) dw[j] = a->accumulate ? dw[j] + window[j / 3][j % 3] : window[j / 3][j % 3];
    }
}

#if MGPU_CUDA
/* ------------------------------------------------------------------ GPU */
typedef struct {
    float *out;          /* [n, K, P, Q]: accumulate ? out + y : y */
    const float *in_t;   /* [n, H, W, C], TF32 (conv_nhwc.h's copies) */
    const float *w;      /* [K, C, 3, 3]; turned: [C, K, 3, 3] (above) */
    const float *b;      /* [K] or NULL */
    float *v, *u, *m;    /* scratch: [16, tiles, C], [16, C, K], [16, tiles, K] */
    mgpu__conv_geom g;   /* 3x3, stride 1; C a multiple of 4 */
    int turned, accumulate;
} mgpu__winograd_args;

/* V[xi][tile][c .. c+3] = (B^T d B)[xi] for 4 channels at once: one
   thread a tile and 4 channels, 16 loads of 16 bytes from in_t and 16
   stores to V. */
static __global__ void mgpu__winograd_input_kernel(mgpu__winograd_args a) {
    const mgpu__conv_geom &g = a.g;
    int quads = g.c / 4, rows = mgpu__winograd_tile_rows(&g), cols = mgpu__winograd_tile_cols(&g);
    size_t tiles = (size_t)g.n * rows * cols;
    MGPU__GRID_STRIDE_LOOP(i, tiles * quads) {
        size_t tile = i / quads;
        int c = (int)(i % quads) * 4, img = (int)(tile / ((size_t)rows * cols));
        int in_image = (int)(tile % ((size_t)rows * cols));
        int h0 = in_image / cols * 2 - g.pad, w0 = in_image % cols * 2 - g.pad;
        float d[4][4][4], v[4][4][4]; /* [channel][row][column] */
        for (int y = 0; y < 4; y++)
            for (int x = 0; x < 4; x++) {
                int h = h0 + y, w = w0 + x;
                float quad[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                if ((unsigned)h < (unsigned)g.h && (unsigned)w < (unsigned)g.w)
                    mgpu__load_floats(quad, &a.in_t[(((size_t)img * g.h + h) * g.w + w) * g.c + c]);
                for (int l = 0; l < 4; l++) d[l][y][x] = quad[l];
            }
        for (int l = 0; l < 4; l++) mgpu__winograd_patch(d[l], v[l]);
        for (int xi = 0; xi < 16; xi++) {
            float quad[4] = {v[0][xi / 4][xi % 4], v[1][xi / 4][xi % 4], v[2][xi / 4][xi % 4], v[3][xi / 4][xi % 4]};
            mgpu__store_floats(&a.v[(xi * tiles + tile) * g.c + c], quad);
        }
    }
}

/* U[xi][c][k] = (G g G^T)[xi] of w's window for filter k on channel c.
   One thread a window. */
static __global__ void mgpu__winograd_weights_kernel(mgpu__winograd_args a) {
    const mgpu__conv_geom &g = a.g;
    size_t windows = (size_t)g.c * g.k;
    MGPU__GRID_STRIDE_LOOP(i, windows) {
        float window[3][3], u[4][4];
        mgpu__winograd_window_of(a.w, &g, (int)(i % g.k), (int)(i / g.k), a.turned, window);
        mgpu__winograd_window(window, u);
        for (int xi = 0; xi < 16; xi++) a.u[xi * windows + i] = u[xi / 4][xi % 4];
    }
}

/* out[img, k, 2 ty + y, 2 tx + x] (+)= (A^T M A)[y][x] + b[k], one thread
   a tile and filter (filters fastest: the 16 loads of M are
   coalesced). */
static __global__ void mgpu__winograd_output_kernel(mgpu__winograd_args a) {
    const mgpu__conv_geom &g = a.g;
    int rows = mgpu__winograd_tile_rows(&g), cols = mgpu__winograd_tile_cols(&g);
    size_t tiles = (size_t)g.n * rows * cols, apart = tiles * g.k;
    MGPU__GRID_STRIDE_LOOP(i, apart) {
        size_t tile = i / g.k;
        int k = (int)(i % g.k), img = (int)(tile / ((size_t)rows * cols));
        int in_image = (int)(tile % ((size_t)rows * cols));
        float m[4][4], o[2][2];
        for (int xi = 0; xi < 16; xi++) m[xi / 4][xi % 4] = a.m[xi * apart + i];
        mgpu__winograd_outputs(m, o);
        float bias = a.b ? a.b[k] : 0.0f;
        int p0 = in_image / cols * 2, q0 = in_image % cols * 2;
        float *plane = &a.out[((size_t)img * g.k + k) * g.p * g.q];
        for (int y = 0; y < 2; y++)
            for (int x = 0; x < 2; x++) {
                float value = o[y][x] + bias;
                if (p0 + y < g.p && q0 + x < g.q) {
                    float *out = &plane[(size_t)(p0 + y) * g.q + q0 + x];
                    *out = a.accumulate ? *out + value : value;
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
