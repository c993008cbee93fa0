/* kernels/conv_nhwc.h: the convolution's forward pass, its input
   gradient (at strides above 1 by sub-pixel convolutions, or for 3x3
   windows at stride 2 and padding 1 a quad of pixels at a time) and its
   weight
   gradient, as implicit GEMMs over
   channels-last copies of the tensors (GPU only, TF32), with
   asynchronous copies straight from memory into shared memory.

   Why channels last. An implicit GEMM that gathers its values from NCHW
   tensors (bench/conv/01_gather_implicit_gemm.cu) loads them one at a
   time: there a pixel's neighbours lie side by side, not
   its channels, so for every value a thread tests the window's edges,
   loads 4 bytes, rounds to TF32 and stores to shared memory, and those
   instructions are what bound it (its profile: bench/history.md). In a
   channels-last copy, x_t[img, h, w, c], a pixel's channels are
   contiguous: 4 of them move as one 16-byte copy, with one edge test for
   all 4, and never pass through registers. cuDNN's
   fastest convolutions work on NHWC too.

   The copies (kernels/channels_last.h). Before the product, x [n, C, H,
   W] goes to x_t [n, H, W, C] and the weights [K, C, R, S] to w_t [K, R,
   S, C], both rounded to TF32 on the way, so that the product's loop has
   no rounding to do. (In a network, batch norm writes x_t itself when a
   convolution follows it: mgpu/networks.h.)

   The product. Y [K, n*P*Q] = W_t [K, R*S*C] col [R*S*C, n*P*Q], where
   im2col's col (kernels/conv.h) is never written: each block loads the
   tiles of col it needs straight from x_t. The summed index is in (r, s,
   c) order, channels fastest:
       col[(r,s,c), (img,p,q)] = x_t[img, p*t + r - d, q*t + s - d, c]
   (0 in the padding). A step is 32 consecutive channels at one (r, s), so
   C must be a multiple of 32: a step's row of W_t is 128 contiguous
   bytes, and so is a step's column of col, for each output pixel (or 128
   bytes of zeros where the window hangs over the padding).

   The input gradient at stride 1 is the same product on other tensors:
       dx[img, c, h, w] = sum over (k, r, s) of w[k, c, r, s] dy[img, k, h + d - r, w + d - s]
   is the convolution of dy with the weights turned half a circle and
   filters and channels swapped, w'[c, k, r', s'] = w[k, c, R-1-r', S-1-s'],
   padded by R - 1 - d. So the forward kernel computes it from dy_t and
   w'_t (mgpu__channels_last with `flip`). At stride t > 1 the windows
   skip pixels and this does not hold as it stands: split dx by the
   remainders of h and w mod t, and each of the t^2 classes is again a
   stride-1 convolution of dy, with some of the taps (the sub-pixel
   convolutions, below the forward kernel).

   The kernel. A block of 128 threads (4 warps, 2 x 2 over the tile)
   computes a TM x TN tile of Y (TM filters, TN pixels; the four tiles below), stepping through R*S*C 32 at a time. For each step
   every thread starts eight or four 16-byte copies of W_t's tile [TM x
   32] and as many of col's [32 x TN] (cp.async: memory to shared memory
   without registers, zero-filled where the window is outside the image),
   and the warps multiply: ldmatrix loads the tensor cores' operands from
   shared memory, four 32-bit values a lane in one instruction, and
   mma.sync multiplies them (PTX, below: WMMA's TF32 loads compile to one
   64-bit generic load per value here, more instructions than the
   multiplies they feed). Two steps are in flight: while the tensor cores
   multiply step i, the copies of step i + 1 are on their way. One barrier
   a step. At the end the tile goes through shared memory to y, with the
   bias (or, where a layer has few tiles, each
   block takes a slice of the steps and another kernel sums the slices:
   "Slices of the sum", below). (Three steps in flight hide more of a
   copy's trip, but take half as much shared memory again, so that two
   blocks of 64 x 128 fit on a multiprocessor instead of three: 8 warps a
   multiprocessor instead of 12, and on the whole a slower ResNet-18 step
   (bench/history.md). The weight gradient's kernel, below, is faster
   with three.)

   Instructions. The loop over steps issues a few instructions per
   tensor-core multiply (16 x 8 x 8), fewer in the larger tiles; the
   gathering kernels issue several times as many for the same work (the
   counts, from the SASS: bench/history.md). So instructions do not bound
   this kernel; the operands' trip from L2 does (Nsight Compute: L2 busy,
   and a warp seldom eligible to issue; hence the copies through L1, and
   two steps in flight for 12 warps a multiprocessor). On ResNet-18's 3x3
   layers at stride 1 it is about twice as fast as the gathering kernels,
   and still slower than cuDNN; so is the weight gradient (at the end of
   this file). The figures are in bench/history.md.

   Shared memory, two copies of the step's tiles, rows padded from 32 to
   36 floats (144 bytes: 16-byte copies stay aligned, and the 8 rows a
   fragment load touches start on banks 0, 4, ..., 28, so that its 32
   lanes hit 32 banks); above 48 KB, more than a kernel gets unless it
   asks (cudaFuncSetAttribute at the launch):
       tile       shared memory
       64 x 64        36 KB
       128 x 64       54 KB
       64 x 128       54 KB
       128 x 128      72 KB
   On Hopper (sm_90a code), the same kernel may multiply its steps with
   the warpgroup products instead (wgmma: mgpu__wgmma_engine, below), in
   the 64 x 128 and 128 x 128 tiles: the tensor cores read both tiles from
   shared memory themselves, so the warps load no fragments, and the 128
   x 128 tile, which brings a third fewer bytes per multiply than 64 x
   128, fits in 210 registers. (Tried unless MGPU_WGMMA=0.)
   Used when MGPU_CONV (mgpu/settings.h) allows the implicit GEMMs and the trial at
   the first call with a shape finds it the fastest. */
#ifndef MGPU_KERNELS_CONV_NHWC_H
#define MGPU_KERNELS_CONV_NHWC_H
#include "common.h"
#include "channels_last.h"
#include "conv.h"
#include "ptx.h"


#if MGPU_CUDA
/* ------------------------------------------------------------- the tiles */
#define MGPU__IMPLICIT_THREADS 128 /* 4 warps a block (the stride-2 dx kernel's and dW's too) */
#define MGPU__IMPLICIT_OUT_ROWS 64 /* rows of the finished tile written out at a time */

/* The block tiles compiled, rows x columns of the product (rows: filters
   or channels; columns: pixels, or (c, r, s) for dW). A larger tile reads
   fewer values from shared memory per multiply-add but gives fewer
   blocks, and a 128-row tile wastes half
   its work on a layer of 64 filters. mgpu/convolution.h times each tile on each
   shape and keeps the fastest; bench/convolutions shows them all. */
typedef enum {
    MGPU__TILE_64x64, MGPU__TILE_128x64, MGPU__TILE_64x128, MGPU__TILE_128x128, MGPU__TILE_KINDS
} mgpu__implicit_tile;
static const int mgpu__implicit_tile_rows[MGPU__TILE_KINDS] = {64, 128, 64, 128};
static const int mgpu__implicit_tile_columns[MGPU__TILE_KINDS] = {64, 64, 128, 128};
static const char *const mgpu__implicit_tile_names[MGPU__TILE_KINDS] = {"64x64", "128x64", "64x128",
                                                                        "128x128"};

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

/* The block's finished tile of TM rows, in the warps' accumulators, to
   memory through a buffer `out` of 64 rows in shared memory, 64 rows at a
   time: store(m0) puts the thread's accumulators of rows m0 .. m0 + 63
   of the tile (if it has any) into out; write(m0) takes those rows from
   out to memory. The caller has made sure no warp still reads the bytes
   of out. */
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

/* The most floats a product's slices' partial tiles take (64 MB). */
#define MGPU__PARTIAL_FLOATS_MAX ((size_t)16 << 20)
/* ------------------------------------------------------------ the product */
#define MGPU__NHWC_STEP 32   /* channels per step: 8 copies of 16 bytes a row */
#define MGPU__NHWC_STAGES 2     /* steps in flight: the forward kernel's, */
#define MGPU__NHWC_DW_STAGES 3  /* and the weight gradient's */

/* Where a step tile's row `row`, 16-byte chunk `chunk`, lies, in bytes
   from the start of the tile, and the bytes from one row to the next:
   - for mma.sync (ldmatrix reads the rows), rows padded to 36 floats, so
     that the 8 rows one ldmatrix reads start on 8 different 16-byte
     groups of banks;
   - for wgmma, rows of 32 floats, in the layout wgmma calls the 128-byte
     swizzle: chunk c of row r at chunk c ^ (r % 8) of its row. The
     tensor cores read 8 rows' same chunk at once, and so those 8 reads
     land on 8 different 16-byte groups of banks. The pattern repeats
     every 8 rows (1024 bytes), and the tensor cores take it from the
     address itself, so a tile must start 1024 bytes aligned. */
struct mgpu__padded_rows {
    static const int BYTES = 4 * (MGPU__NHWC_STEP + 4), ALIGN = 16;
    static __host__ __device__ int at(int row, int chunk) { return row * BYTES + 16 * chunk; }
};
struct mgpu__swizzled_rows {
    static const int BYTES = 4 * MGPU__NHWC_STEP, ALIGN = 1024;
    static __host__ __device__ int at(int row, int chunk) { return row * BYTES + 16 * ((chunk ^ row) & 7); }
};

/* A block's shared memory for a TM x TN tile: the steps' tiles of W_t
   (a: TM rows of 32 channels) and of col (b: TN pixels, each a column of
   32 channels, so b is column-major), their rows laid out as Rows says,
   and at the end, in the same bytes, 64 rows of the finished tile on
   their way to memory. The wgmma kernels' (below) in the swizzle. */
template <int TM, int TN, typename Rows = mgpu__padded_rows> union mgpu__nhwc_tiles {
    struct {
        float a[MGPU__NHWC_STAGES][TM][Rows::BYTES / 4];
        float b[MGPU__NHWC_STAGES][TN][Rows::BYTES / 4];
    } step;
    float out[MGPU__IMPLICIT_OUT_ROWS][TN + 4];
};
template <int TM, int TN> using mgpu__wgmma_tiles = mgpu__nhwc_tiles<TM, TN, mgpu__swizzled_rows>;

/* Whether the kernel computes conv(x, w) of geometry g: whole steps of
   32 channels, and grids a GPU launches. */
static int mgpu__conv_nhwc_fits(const mgpu__conv_geom *g) {
    return g->c % MGPU__NHWC_STEP == 0 && g->c / 32 < 65535 && g->k / 64 < 65535;
}
static int mgpu__conv_nhwc_subpixel_fits(const mgpu__conv_geom *g);
/* Whether dx of geometry g has a channels-last kernel: the one above at
   stride 1, the sub-pixel classes (below) at larger strides. */
static int mgpu__conv_nhwc_dx_fits(const mgpu__conv_geom *g) {
    if (g->stride > 1) return mgpu__conv_nhwc_subpixel_fits(g);
    mgpu__conv_geom d = mgpu__conv_dx_geometry(g);
    return g->r == g->s && g->pad <= g->r - 1 && mgpu__conv_nhwc_fits(&d);
}

/* Where the output pixels go: with step 0, output pixel (p, q) to (p, q)
   of y [n, K, P, Q]; else to (p step + row, q step + col) of y [n, K, h,
   w] (a sub-pixel class of an input gradient, below). */
typedef struct {
    int step, row, col, h, w;
} mgpu__nhwc_out;

typedef struct {
    float *y;          /* [n, K, P, Q], or as `out` says */
    const float *x_t;  /* [n, H, W, C], TF32 */
    const float *w_t;  /* [K, R, S, C], TF32 */
    const float *b;    /* [K] or NULL */
    mgpu__conv_geom g; /* of the convolution of x with w */
    mgpu__implicit_tile tile;
    mgpu__nhwc_out out;
    int accumulate;    /* 1: y += the product; 0: y = it */
    int splits;        /* slices of the sum over (r, s, c), one a block (grid.z; 0 or 1: one), */
    int per;           /* `per` steps each (set at the launch: mgpu__conv_nhwc_slices), */
    float *partials;   /* each slice's tile: [splits, K, mgpu__nhwc_partial_ld(n*P*Q)] scratch */
    int wgmma;         /* 1: by wgmma (tiles 64 x 128 and 128 x 128, sm_90a); 0: by mma.sync */
} mgpu__conv_nhwc_args;

/* Slices of the sum. A block computes its tile over all of R*S*C, so a
   layer with few output tiles and a long sum (ResNet-18's last stage:
   4096 pixels, 512 filters, 4608 terms; 256 tiles of 64 x 128 for 132
   multiprocessors that hold 3 each) leaves the GPU mostly idle. Split
   into slices, the sum runs in more blocks at once; each slice's tile
   goes to its own partial, and mgpu__conv_nhwc_slices_sum_kernel adds
   them up in order (so the result does not depend on which block ends
   first) with the bias, into y. The cost: a write and a read of the
   partials. The trial in mgpu/convolution.h times each tile in 1 to 8 slices
   (mgpu__conv_slice_choices), where a slice keeps at least 8 steps and
   the partials fit in MGPU__PARTIAL_FLOATS_MAX.

   A partial's rows are n*P*Q long, rounded up to even so that a lane's
   two neighbouring values go out as one 8-byte store. */
static __host__ __device__ size_t mgpu__nhwc_partial_ld(size_t pixels) { return (pixels + 1) / 2 * 2; }
/* Sets a->per for a->splits slices of whole steps, and a->splits to the
   slices that takes (fewer when the steps run out; 1 for no split). */
static void mgpu__conv_nhwc_slices(mgpu__conv_nhwc_args *a) {
    int steps = a->g.r * a->g.s * a->g.c / MGPU__NHWC_STEP;
    int splits = a->splits > 1 && steps > 1 ? a->splits : 1;
    a->per = (steps + splits - 1) / splits;
    a->splits = a->per ? (steps + a->per - 1) / a->per : 1;
}
/* The floats of the partials for a product of geometry g in `splits` slices. */
static size_t mgpu__conv_nhwc_partial_floats(const mgpu__conv_geom *g, int splits) {
    return splits > 1 ? (size_t)splits * g->k * mgpu__nhwc_partial_ld((size_t)g->n * g->p * g->q) : 0;
}
/* Where output pixel in_image (= p Q + q) of an image goes in its plane of
   y, and that plane's size (mgpu__nhwc_out). */
static __host__ __device__ size_t mgpu__nhwc_out_at(const mgpu__conv_nhwc_args &a, int in_image,
                                                    size_t *plane) {
    if (!a.out.step) {
        *plane = (size_t)a.g.p * a.g.q;
        return in_image;
    }
    int p = in_image / a.g.q, q = in_image - p * a.g.q;
    *plane = (size_t)a.out.h * a.out.w;
    return (size_t)(p * a.out.step + a.out.row) * a.out.w + q * a.out.step + a.out.col;
}
/* Which accumulators a thread holds, as 16 x 8 tensor-core tiles, MT x
   NT of them, each laid out as mgpu__mma_tf32's d: tile (i, j) of warp w
   starts at row row(w) + ROWS_APART i, column col(w) + 8 j of the block's
   TM x TN tile. For mma.sync the warps are 2 x 2 over the tile, each
   computing a (TM/2) x (TN/2) quarter; for wgmma (mgpu__wgmma_tf32_n128),
   each 64 rows of the tile are one product, and warp w holds rows 16 w ..
   16 w + 15 of each, every column. */
template <int TM, int TN> struct mgpu__nhwc_warp {
    static const int MT = TM / 2 / 16, NT = TN / 2 / 8, ROWS_APART = 16;
    typedef float acc[MT][NT][4];
    static __device__ int row(int warp) { return (warp / 2) * (TM / 2); }
    static __device__ int col(int warp) { return (warp % 2) * (TN / 2); }
};
template <int TM, int TN> struct mgpu__wgmma_warp {
    static const int MT = TM / 64, NT = TN / 8, ROWS_APART = 64;
    typedef float acc[MT][NT][4];
    static __device__ int row(int warp) { return 16 * warp; }
    static __device__ int col(int) { return 0; }
};
/* The two ways of multiplying a step (below; declared here for the
   kernels' template arguments, which a build for GPUs before sm_80 also
   names, with empty kernels). */
template <int TM, int TN> struct mgpu__mma_sync_engine;
template <int TM, int TN> struct mgpu__wgmma_engine;

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
/* The lanes' addresses for ldmatrix (mgpu__load_matrices lists the
   blocks): for a, row lane % 16 of the warp's rows, at column (lane / 16)
   4; for b, whose pixels are its rows here, the pixel (of the tile) and
   the channel (of the step) below, then every 16 pixels on for the next
   two 8-column tiles of the product (mgpu__nhwc_lane_a_row: a's row of
   a tile, at the step's first channel, as a shared address). */
template <int TN> static __device__ int mgpu__nhwc_lane_pixel(void) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    return (warp % 2) * (TN / 2) + lane % 8 + (lane / 16) * 8;
}
static __device__ int mgpu__nhwc_lane_channel(void) { return (threadIdx.x % 32 / 8 % 2) * 4; }

template <int TM> static __device__ mgpu__shared_address mgpu__nhwc_lane_a_row(mgpu__shared_address a_tile) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    return a_tile + mgpu__padded_rows::at((warp / 2) * (TM / 2) + lane % 16, lane / 16);
}
/* b's likewise, in copy `stage` of the b tiles from b_tiles (TN rows each). */
template <int TN>
static __device__ mgpu__shared_address mgpu__nhwc_lane_b_row(mgpu__shared_address b_tiles, int stage) {
    return b_tiles + mgpu__padded_rows::at(stage * TN + mgpu__nhwc_lane_pixel<TN>(), 0) + 4 * mgpu__nhwc_lane_channel();
}

/* A warp's operands for one tensor-core step of k = 8, by ldmatrix from
   step tiles of padded rows, and their products: load_a(a_row, kk) loads
   a's for the warp's rows, channels kk.. of the step, a_row being the
   shared address of this lane's row of a tile at the step's first channel
   (mgpu__nhwc_lane_a_row); load_b(b_row, kk) likewise b's for the warp's
   columns, b_row the address of this lane's row of b for the first two
   8-column tiles (the next two tiles' rows are 16 rows on); multiply(acc):
   acc += a b, as mgpu__mma_tf32 lays the accumulators out. */
template <int TM, int TN> struct mgpu__nhwc_fragments {
    typedef mgpu__nhwc_warp<TM, TN> W;
    static const int LD = MGPU__NHWC_STEP + 4; /* floats: a row of mgpu__padded_rows */
    uint32_t a[W::MT][4], b[W::NT][2];
    __device__ void load_a(mgpu__shared_address a_row, int kk) {
        for (int i = 0; i < W::MT; i++) mgpu__load_matrices(a[i], a_row + 4 * (16 * i * LD + kk));
    }
    __device__ void load_b(mgpu__shared_address b_row, int kk) {
        for (int j = 0; j < W::NT; j += 2) {
            uint32_t pair[4];
            mgpu__load_matrices(pair, b_row + 4 * (8 * j * LD + kk));
            b[j][0] = pair[0], b[j][1] = pair[1], b[j + 1][0] = pair[2], b[j + 1][1] = pair[3];
        }
    }
    __device__ void multiply(typename W::acc &acc) const {
        for (int i = 0; i < W::MT; i++)
            for (int j = 0; j < W::NT; j++) mgpu__mma_tf32(acc[i][j], a[i], b[j]);
    }
};

/* acc += a b for this warp's quarter of the tile, from copy `stage` of
   the step tiles a (at shared address a_tiles) and b (this lane's row of
   it: b_row, as above): four tensor-core steps of k = 8. Per step of k, a
   warp of the 128 x 128 tile loads its operands with 8 ldmatrix and
   multiplies them with 32 mma. */
template <int TM, int TN>
static __device__ void mgpu__nhwc_multiply(typename mgpu__nhwc_warp<TM, TN>::acc &acc,
                                           mgpu__shared_address a_tiles, int stage, mgpu__shared_address b_row) {
    mgpu__shared_address a_row = mgpu__nhwc_lane_a_row<TM>(a_tiles + mgpu__padded_rows::at(stage * TM, 0));
    mgpu__nhwc_fragments<TM, TN> f;
    for (int kk = 0; kk < MGPU__NHWC_STEP; kk += 8) {
        f.load_a(a_row, kk);
        f.load_b(b_row, kk);
        f.multiply(acc);
    }
}

/* The descriptor wgmma reads a tile of a step by: rows of 32 floats in
   the 128-byte swizzle (mgpu__swizzled_rows) from shared address `rows`
   on. Bits 0-13: the address, in 16-byte units; bits 32-45: the bytes
   from one block of 8 rows to the next (1024), in 16-byte units; bits
   62-63: the swizzle (1: 128 bytes). (Bits 16-29, the bytes between
   blocks along the summed index, are not read for this swizzle, as a
   product's 8 values of a row, 32 bytes, lie in one 128-byte row; 1, as
   CUTLASS sets them.) The address 32 bytes on is the next 8 values of
   every row. */
static __device__ uint64_t mgpu__wgmma_descriptor(mgpu__shared_address rows) {
    uint64_t start = (mgpu__shared_window_offset(rows) & 0x3FFFF) >> 4;
    uint64_t eight_rows = 8 * mgpu__swizzled_rows::BYTES >> 4;
    return start | (uint64_t)1 << 16 | eight_rows << 32 | (uint64_t)1 << 62;
}

/* The two ways the product kernels below multiply a step's tiles (their
   template argument): each says how the step tiles' rows lie in shared
   memory (and so the kernel's shared memory, mgpu__nhwc_tiles), which
   accumulators a thread holds, and multiply(acc, a_tiles, b_tiles,
   stage): acc += copy `stage` of the step tiles, a times b's transpose.
   - mma.sync (sm_80 and newer): each warp its quarter of the tile, its
     operands loaded by ldmatrix (mgpu__nhwc_multiply).
   - wgmma (sm_90a): for each 8 channels of the step, one 64 x 128 x 8
     product for each 64 rows of the tile, issued by the block's four
     warps together, its operands read by the tensor cores from shared
     memory; then the block waits for them, as the next step's copies go
     into the tiles they read. No fragments in registers, no ldmatrix:
     the 128 x 128 tile's 128 accumulators a thread fit beside little
     else, where mma.sync's 4 warps of 64 x 64 take 230 registers. */
template <int TM, int TN> struct mgpu__mma_sync_engine {
    typedef mgpu__padded_rows rows;
    typedef mgpu__nhwc_warp<TM, TN> warp;
    static const bool ASYNC_READS = false;
    static __device__ void multiply(typename warp::acc &acc, mgpu__shared_address a_tiles,
                                    mgpu__shared_address b_tiles, int stage) {
        mgpu__nhwc_multiply<TM, TN>(acc, a_tiles, stage, mgpu__nhwc_lane_b_row<TN>(b_tiles, stage));
    }
};
template <int TM, int TN> struct mgpu__wgmma_engine {
    static_assert(TN == 128 && TM % 64 == 0, "wgmma tiles: 64 or 128 rows, 128 columns");
    typedef mgpu__swizzled_rows rows;
    typedef mgpu__wgmma_warp<TM, TN> warp;
    static const bool ASYNC_READS = true;
    static __device__ void multiply(typename warp::acc &acc, mgpu__shared_address a_tiles,
                                    mgpu__shared_address b_tiles, int stage) {
#if defined(MGPU__WGMMA_BUILT) || defined(MGPU_CUDA_EMU)
        MGPU__UNROLL
        for (int i = 0; i < warp::MT; i++) mgpu__wgmma_keep(acc[i]);
        mgpu__wgmma_fence();
        MGPU__UNROLL
        for (int kk = 0; kk < MGPU__NHWC_STEP / 8; kk++) {
            uint64_t b = mgpu__wgmma_descriptor(b_tiles + rows::at(stage * TN, 0) + 32 * kk);
            MGPU__UNROLL
            for (int i = 0; i < warp::MT; i++)
                mgpu__wgmma_tf32_n128(acc[i], mgpu__wgmma_descriptor(a_tiles + rows::at(stage * TM + 64 * i, 0) + 32 * kk),
                                      b);
        }
        mgpu__wgmma_commit();
        mgpu__wgmma_wait<0>();
        MGPU__UNROLL
        for (int i = 0; i < warp::MT; i++) mgpu__wgmma_keep(acc[i]);
#endif
    }
};
/* The block's dynamic shared memory from its first address aligned to
   ALIGN bytes (the launch asks for ALIGN - 16 bytes more; it is 128
   bytes aligned as declared). */
template <int ALIGN> static __device__ void *mgpu__aligned_shared(void) {
    unsigned char *p = (unsigned char *)mgpu__dynamic_shared();
    if (ALIGN <= 128) return p;
    unsigned offset = mgpu__shared_window_offset(mgpu__shared_address_of(p));
    return p + (ALIGN - offset % ALIGN) % ALIGN;
}
#endif

/* Whether this device's code has the wgmma kernels (nvcc built it for
   sm_90a): *built = 1, else 0. */
static __global__ void mgpu__wgmma_built_kernel(int *built) {
    if (threadIdx.x) return;
#if defined(MGPU__WGMMA_BUILT) || defined(MGPU_CUDA_EMU)
    *built = 1;
#else
    *built = 0;
#endif
}
/* The same on the host, for the GPU of `stream` (one launch, waited for). */
static int mgpu__wgmma_built(cudaStream_t stream) {
    int *built, on_host = 0;
    MGPU_CUDA_CHECK(cudaMalloc((void **)&built, sizeof *built));
    mgpu__wgmma_built_kernel<<<1, 32, 0, stream>>>(built); /* (a warp: the emulator's least block) */
    MGPU_CUDA_CHECK_LAUNCH();
    MGPU_CUDA_CHECK(cudaMemcpyAsync(&on_host, built, sizeof on_host, cudaMemcpyDeviceToHost, stream));
    MGPU_CUDA_CHECK(cudaStreamSynchronize(stream));
    MGPU_CUDA_CHECK(cudaFree(built));
    return on_host;
}

/* The loop over steps both kernels share, STAGES - 1 steps in flight
   ahead of the one being multiplied: load(stage) starts the copies of
   the next step into copy `stage` of the step tiles, multiply(stage)
   multiplies copy `stage` (ASYNC_READS: by wgmma, which must see the
   copies through mgpu__fence_async_reads). One barrier a step. At the
   end every warp has multiplied its last step, so the tiles' bytes may
   take other data. */
template <int STAGES, bool ASYNC_READS = false, typename Load, typename Multiply>
static __device__ void mgpu__nhwc_steps(int steps, Load load, Multiply multiply) {
    for (int stage = 0; stage < STAGES - 1; stage++) {
        if (stage < steps) load(stage);
        mgpu__copies_commit(); /* a group even when empty, so that each step is one group */
    }
    for (int step = 0; step < steps; step++) {
        mgpu__copies_wait<STAGES - 2>(); /* this thread's copies of `step` have landed, */
        if (ASYNC_READS) mgpu__fence_async_reads();
        __syncthreads(); /* and everyone's; and every warp is done with step - 1 */
        if (step + STAGES - 1 < steps) load((step + STAGES - 1) % STAGES); /* step - 1's copy */
        mgpu__copies_commit();
        multiply(step % STAGES);
    }
    mgpu__copies_wait<0>(); /* (only empty groups are left) */
    __syncthreads();
}

/* Calls f(row, col, value) for each of this thread's accumulators, with
   the row and column of the block's tile where mgpu__mma_tf32 (or wgmma)
   put it. */
template <typename W, typename F>
static __device__ __forceinline__ void mgpu__nhwc_each_value(const typename W::acc &acc, F f) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    MGPU__UNROLL
    for (int i = 0; i < W::MT; i++)
        MGPU__UNROLL
        for (int j = 0; j < W::NT; j++)
            MGPU__UNROLL
            for (int e = 0; e < 4; e++)
                f(W::row(warp) + W::ROWS_APART * i + lane / 4 + 8 * (e / 2),
                  W::col(warp) + 8 * j + 2 * (lane % 4) + e % 2, acc[i][j][e]);
}

/* A block's tile (the accumulators of its 4 warps, as mgpu__mma_tf32
   lays them out) to its slice's partial [rows, ld] (rows and columns of
   the grid's tiles: blockIdx.y and blockIdx.x), those of it inside rows
   x cols: a lane's two neighbouring values of a row as one 8-byte store,
   4 lanes a row of 32 bytes (ld and the partial's start even). */
template <int TM, int TN, typename W = mgpu__nhwc_warp<TM, TN>>
static __device__ void mgpu__nhwc_store_partial(const typename W::acc &acc, float *partial, size_t ld, int rows,
                                                int cols) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int row0 = blockIdx.y * TM + W::row(warp) + lane / 4;
    int col0 = blockIdx.x * TN + W::col(warp) + 2 * (lane % 4);
    MGPU__UNROLL
    for (int i = 0; i < W::MT; i++)
        MGPU__UNROLL
        for (int j = 0; j < W::NT; j++)
            MGPU__UNROLL
            for (int half = 0; half < 2; half++) {
                int row = row0 + W::ROWS_APART * i + 8 * half, col = col0 + 8 * j; /* col even */
                if (row < rows && col < cols)
                    *(float2 *)&partial[(size_t)row * ld + col] =
                        make_float2(acc[i][j][2 * half], acc[i][j][2 * half + 1]);
            }
}

/* The block's finished tile (its warps' accumulators) to y, or with
   slices, to the partial of its slice (`slice`; the sum comes after). To y [img,
   filter, p, q] with the bias, as mgpu__implicit_write writes it: each lane's
   values go to out (shared memory that no warp reads any more) where
   mgpu__mma_tf32 says they are, then along the rows to y, coalesced. */
template <int TM, int TN, typename W = mgpu__nhwc_warp<TM, TN>>
static __device__ void mgpu__nhwc_finish(const mgpu__conv_nhwc_args &a, const typename W::acc &acc,
                                         float (*out)[TN + 4], int slice) {
    const mgpu__conv_geom &g = a.g;
    int pq = g.p * g.q, npq = g.n * pq;
    if (a.splits > 1) {
        size_t ld = mgpu__nhwc_partial_ld(npq);
        mgpu__nhwc_store_partial<TM, TN, W>(acc, a.partials + (size_t)slice * g.k * ld, ld, g.k, npq);
        return;
    }
    int tid = threadIdx.x, pixel = blockIdx.x * TN + tid % TN, img = pixel / pq, in_image = pixel - img * pq;
    auto store = [&](int m0) { /* rows m0 .. m0 + 63 */
        mgpu__nhwc_each_value<W>(acc, [&](int row, int col, float value) {
            if (row >= m0 && row < m0 + MGPU__IMPLICIT_OUT_ROWS) out[row - m0][col] = value;
        });
    };
    size_t plane, at = mgpu__nhwc_out_at(a, in_image, &plane); /* y's plane, this pixel's place in it */
    mgpu__implicit_finish<TM>(store, [&](int m0) {
        if (pixel < npq)
            mgpu__implicit_write<TN>(out, a.y + (size_t)img * g.k * plane + at, plane, blockIdx.y * TM + m0, g.k, a.b,
                                     a.accumulate);
    });
}

/* Starts the copies of a step's tile of W_t into copy `stage` of a (at
   shared address a_tiles, its rows laid out as Rows says): channels c0 ..
   c0 + 31 of tap `tap` (r S + s) of the block's TM filters, a thread the
   same 16 bytes of every 16th row from tid / 8. Through L1: every block
   of the grid's row reads them. */
#define MGPU__NHWC_ROWS_APART (MGPU__IMPLICIT_THREADS / (MGPU__NHWC_STEP / 4)) /* (a multiple of 8: */
static_assert(MGPU__NHWC_ROWS_APART % 8 == 0, "a thread's rows all take the same place in the swizzle)");
template <int TM, typename Rows = mgpu__padded_rows>
static __device__ void mgpu__nhwc_load_weights(const float *w_t, const mgpu__conv_geom &g,
                                               mgpu__shared_address a_tiles, int stage, int tap, int c0) {
    const int CHUNKS = MGPU__NHWC_STEP / 4, APART = MGPU__NHWC_ROWS_APART;
    int chunk = threadIdx.x % CHUNKS, first_row = threadIdx.x / CHUNKS, filter0 = blockIdx.y * TM;
    int rsc = g.r * g.s * g.c;
    const float *w_step = w_t + tap * g.c + c0 + chunk * 4; /* w_t[0, r, s, c0 + 4 chunk] */
    mgpu__shared_address to_a = a_tiles + Rows::at(stage * TM + first_row, chunk);
    for (int j = 0; j < TM / APART; j++) {
        int filter = filter0 + first_row + j * APART;
        bool valid = filter < g.k;
        mgpu__copy_async16<MGPU__KEEP_IN_L1>(to_a + j * APART * Rows::BYTES,
                                             valid ? w_step + (size_t)filter * rsc : w_t, valid);
    }
}

/* The copies of a step's tile of b: TN output pixels of geometry g (the
   block's from pixel0 on), for each one 32 channels of x_t at one tap of
   its window; a thread always the same 16 bytes (chunk) of every APART-th
   pixel from tid / 8, PER pixels. Decoded once: where each of a thread's
   pixels has its window in x_t (top, left: its first row and column,
   which may lie in the padding; window: the offset of x_t[img, top,
   left, 0]). copy(b_tiles, stage, x_t, g, r, s, c0) starts the copies of
   tap (r, s), channels c0.., into copy `stage` of the b tiles (rows laid
   out as Rows says): zeros where the tap falls outside the image, or the
   pixel past the last. */
template <int TN, typename Rows> struct mgpu__nhwc_pixels {
    static const int CHUNKS = MGPU__NHWC_STEP / 4, APART = MGPU__NHWC_ROWS_APART, PER = TN / APART;
    int window[PER], top[PER], left[PER];
    __device__ mgpu__nhwc_pixels(const mgpu__conv_geom &g, int pixel0) {
        int first_row = threadIdx.x / CHUNKS, pq = g.p * g.q, npq = g.n * pq;
        for (int j = 0; j < PER; j++) {
            int pixel = pixel0 + first_row + j * APART, img = pixel / pq, in_image = pixel - img * pq;
            int p = in_image / g.q;
            top[j] = pixel < npq ? p * g.stride - g.pad : -(1 << 20); /* past the end: outside every image */
            left[j] = (in_image - p * g.q) * g.stride - g.pad;
            window[j] = pixel < npq ? ((img * g.h + top[j]) * g.w + left[j]) * g.c : 0;
        }
    }
    __device__ void copy(mgpu__shared_address b_tiles, int stage, const float *x_t, const mgpu__conv_geom &g, int r,
                         int s, int c0) const {
        int chunk = threadIdx.x % CHUNKS, first_row = threadIdx.x / CHUNKS;
        int shift = (r * g.w + s) * g.c + c0 + chunk * 4;
        mgpu__shared_address to_b = b_tiles + Rows::at(stage * TN + first_row, chunk);
        for (int j = 0; j < PER; j++) {
            int h = top[j] + r, w = left[j] + s;
            bool inside = (unsigned)h < (unsigned)g.h && (unsigned)w < (unsigned)g.w; /* 0 <= h < H */
            mgpu__copy_async16<MGPU__KEEP_IN_L1>(to_b + j * APART * Rows::BYTES,
                                                 inside ? x_t + (window[j] + shift) : x_t, inside);
        }
    }
};

/* Blocks a multiprocessor should hold; the registers a thread follow
   (65536 / (128 threads x blocks)). The forward kernel: 4 of 64 x 64 (128
   registers), 3 of 128 x 64 and 64 x 128 (170: they use about 150 to
   160, and 4 blocks' 128 would spill), 2 of 128 x 128 (its accumulators
   alone take 128). With two steps in flight that many fit in sm_90's
   227 KB of shared memory. The weight gradient's kernel, three steps in
   flight: as many as its shared memory allows, 4 of 64 x 64, else 2. On
   sm_80's 163 KB fewer fit. */
#define MGPU__NHWC_BLOCKS_PER_SM(TM, TN) ((TM) * (TN) <= 64 * 64 ? 4 : (TM) * (TN) <= 64 * 128 ? 3 : 2)
#define MGPU__NHWC_DW_BLOCKS_PER_SM(TM, TN) ((TM) * (TN) <= 64 * 64 ? 4 : 2)

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
/* The block's tile (blockIdx.x: its pixels, .y: its filters) of the
   product `a`, over slice `slice` of the sum (the kernels below), its
   steps multiplied by Engine (mma.sync or wgmma, above). */
template <int TM, int TN, template <int, int> class Engine>
static __device__ __forceinline__ void mgpu__conv_nhwc_tile(const mgpu__conv_nhwc_args &a, int slice) {
    typedef Engine<TM, TN> E;
    typedef typename E::rows Rows;
    const mgpu__conv_geom g = a.g;
    const int STEP = MGPU__NHWC_STEP;
    mgpu__nhwc_tiles<TM, TN, Rows> *t = (mgpu__nhwc_tiles<TM, TN, Rows> *)mgpu__aligned_shared<Rows::ALIGN>();
    mgpu__shared_address a_tiles = mgpu__shared_address_of(t->step.a),
                         b_tiles = mgpu__shared_address_of(t->step.b);
    int rsc = g.r * g.s * g.c;
    const mgpu__nhwc_pixels<TN, Rows> pixels(g, blockIdx.x * TN); /* this thread's pixels of b */
    /* Starts the copies of a step into copy `stage`: channels c0.. of tap
       (r, s). The copies go through L1, and the steps take the taps of
       one run of 32 channels one after the other, so that the next tap's
       window is still there: the windows of taps (r, s) and (r, s + 1)
       are the same pixels but one, and those of (r, s) and (r + 1, s)
       share all but an image row of them. L2's bandwidth is what bounds
       this kernel. Through L1 the forward pass and dx are faster; the
       weight gradient's copies (below) are slower that way, and skip it
       (bench/history.md). */
    /* this block's slice of the steps: `steps` from first_step, step i
       being channels 32 (i / RS).. of tap i % RS */
    int first_step = slice * a.per, after = rsc / STEP - first_step;
    int steps = a.per < after ? a.per : after;
    int r = first_step % (g.r * g.s) / g.s, s = first_step % g.s, c0 = first_step / (g.r * g.s) * STEP;
    auto load = [&](int stage) {
        mgpu__nhwc_load_weights<TM, Rows>(a.w_t, g, a_tiles, stage, r * g.s + s, c0);
        pixels.copy(b_tiles, stage, a.x_t, g, r, s, c0);
        if (++s == g.s) {
            s = 0;
            if (++r == g.r) r = 0, c0 += STEP;
        }
    };

    typename E::warp::acc acc = {};
    mgpu__nhwc_steps<MGPU__NHWC_STAGES, E::ASYNC_READS>(steps, load, [&](int stage) {
        E::multiply(acc, a_tiles, b_tiles, stage);
    });
    mgpu__nhwc_finish<TM, TN, typename E::warp>(a, acc, t->out, slice);
}
#endif

/* One product, each block a tile over a slice of the sum (blockIdx.z). */
template <int TM, int TN, template <int, int> class Engine = mgpu__mma_sync_engine>
static __global__ void __launch_bounds__(MGPU__IMPLICIT_THREADS, MGPU__NHWC_BLOCKS_PER_SM(TM, TN))
mgpu__conv_nhwc_kernel(mgpu__conv_nhwc_args a) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    mgpu__conv_nhwc_tile<TM, TN, Engine>(a, blockIdx.z);
#endif
}

/* Several products of the same filters (dx's sub-pixel classes, below)
   in one launch, side by side in the grid: blockIdx.z is slice z %
   splits of product z / splits. One product a launch, the classes of a
   small layer each filled a fraction of the GPU in turn (ResNet-18's
   stage 4 at stride 2: 128 tiles of 64 x 128 a class, for 396 places on
   an H100); together they fill it at once. The parameter is one copy for
   the whole grid (__grid_constant__), so that a block picking its product
   by blockIdx reads it there rather than from a copy of its own. */
#define MGPU__NHWC_PRODUCTS_MAX 4
typedef struct {
    mgpu__conv_nhwc_args product[MGPU__NHWC_PRODUCTS_MAX];
    int count, splits; /* the products, and the most slices of one */
} mgpu__conv_nhwc_products;

template <int TM, int TN, template <int, int> class Engine = mgpu__mma_sync_engine>
static __global__ void __launch_bounds__(MGPU__IMPLICIT_THREADS, MGPU__NHWC_BLOCKS_PER_SM(TM, TN))
mgpu__conv_nhwc_products_kernel(const __grid_constant__ mgpu__conv_nhwc_products p) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    int z = blockIdx.z, slice = z % p.splits;
    const mgpu__conv_nhwc_args &a = p.product[z / p.splits];
    /* The grid covers the largest product in the most slices: a block
       past its own product's tiles or slices leaves, all its threads
       before any barrier. */
    if (slice >= a.splits || (int)blockIdx.x * TN >= a.g.n * a.g.p * a.g.q) return;
    mgpu__conv_nhwc_tile<TM, TN, Engine>(a, slice);
#endif
}

/* The bytes of a tile kind's shared memory, `tiles` one of the unions above. */
#define MGPU__NHWC_BYTES(tiles, tile)                                                     \
    ((tile) == MGPU__TILE_128x64    ? (int)sizeof(tiles<128, 64>)                         \
     : (tile) == MGPU__TILE_64x128  ? (int)sizeof(tiles<64, 128>)                         \
     : (tile) == MGPU__TILE_128x128 ? (int)sizeof(tiles<128, 128>)                        \
                                    : (int)sizeof(tiles<64, 64>))
/* The wgmma kernels' tiles: 64 x 128 and 128 x 128. */
static int mgpu__wgmma_tile_fits(mgpu__implicit_tile tile) {
    return tile == MGPU__TILE_64x128 || tile == MGPU__TILE_128x128;
}
#define MGPU__WGMMA_INSTANCE(kernel, tile) \
    ((tile) == MGPU__TILE_128x128 ? kernel<128, 128, mgpu__wgmma_engine> : kernel<64, 128, mgpu__wgmma_engine>)

/* y = (y if accumulate, else 0) + the bias + the slices' partial tiles,
   summed in slice order, each value to where `out` puts it. */
static __global__ void mgpu__conv_nhwc_slices_sum_kernel(mgpu__conv_nhwc_args a) {
    const mgpu__conv_geom &g = a.g;
    int pq = g.p * g.q, npq = g.n * pq;
    size_t ld = mgpu__nhwc_partial_ld(npq), slice = (size_t)g.k * ld;
    MGPU__GRID_STRIDE_LOOP(i, (size_t)g.k * npq) { /* consecutive threads, consecutive pixels */
        int filter = (int)(i / npq), pixel = (int)(i - (size_t)filter * npq), img = pixel / pq;
        const float *partial = a.partials + (size_t)filter * ld + pixel;
        float value = 0.0f;
        for (int z = 0; z < a.splits; z++) value += partial[z * slice];
        if (a.b) value += a.b[filter];
        size_t plane, at = mgpu__nhwc_out_at(a, pixel - img * pq, &plane);
        float *to = a.y + ((size_t)img * g.k + filter) * plane + at;
        *to = a.accumulate ? *to + value : value;
    }
}

/* Launches the products p->product[0 .. count - 1], each already sliced
   (mgpu__conv_nhwc_slices), all in one kernel (one alone in the plain
   kernel, which reads its parameter straight from the constant bank),
   then the sums of those in slices. */
static void mgpu__conv_nhwc_launch(mgpu__conv_nhwc_products *p, cudaStream_t stream) {
    mgpu__implicit_tile tile = p->product[0].tile;
    size_t pixels = 0;
    p->splits = 1;
    for (int i = 0; i < p->count; i++) {
        const mgpu__conv_geom &g = p->product[i].g;
        if ((size_t)g.n * g.p * g.q > pixels) pixels = (size_t)g.n * g.p * g.q;
        if (p->product[i].splits > p->splits) p->splits = p->product[i].splits;
    }
    dim3 grid = mgpu__implicit_grid(tile, pixels, p->product[0].g.k, p->count * p->splits);
    /* More than 48 KB of shared memory must be asked for, on each device
       (a call without the GPU's involvement, cheap enough to make at every
       launch, which saves remembering which devices have been asked). The
       wgmma kernels' tiles start 1024 bytes aligned, which may take up to
       1008 bytes more (the window's own alignment is 16). */
    int wgmma = p->product[0].wgmma;
    if (wgmma && !mgpu__wgmma_tile_fits(tile))
        mgpu_fatal("internal: a wgmma product in a %s tile", mgpu__implicit_tile_names[tile]);
    int bytes = wgmma ? MGPU__NHWC_BYTES(mgpu__wgmma_tiles, tile) + mgpu__swizzled_rows::ALIGN - 16
                      : MGPU__NHWC_BYTES(mgpu__nhwc_tiles, tile);
    if (p->count == 1) {
        void (*kernel)(mgpu__conv_nhwc_args) = wgmma ? MGPU__WGMMA_INSTANCE(mgpu__conv_nhwc_kernel, tile)
                                                     : MGPU__IMPLICIT_INSTANCE(mgpu__conv_nhwc_kernel, tile);
        MGPU_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
        kernel<<<grid, MGPU__IMPLICIT_THREADS, bytes, stream>>>(p->product[0]);
    } else {
        void (*kernel)(mgpu__conv_nhwc_products) =
            wgmma ? MGPU__WGMMA_INSTANCE(mgpu__conv_nhwc_products_kernel, tile)
                  : MGPU__IMPLICIT_INSTANCE(mgpu__conv_nhwc_products_kernel, tile);
        MGPU_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
        kernel<<<grid, MGPU__IMPLICIT_THREADS, bytes, stream>>>(*p);
    }
    MGPU_CUDA_CHECK_LAUNCH();
    for (int i = 0; i < p->count; i++) {
        const mgpu__conv_nhwc_args &a = p->product[i];
        if (a.splits < 2) continue;
        size_t values = (size_t)a.g.k * a.g.n * a.g.p * a.g.q;
        mgpu__conv_nhwc_slices_sum_kernel<<<mgpu__grid_for(values, 256), 256, 0, stream>>>(a);
        MGPU_CUDA_CHECK_LAUNCH();
    }
}
static void mgpu__conv_nhwc_cuda(const void *args, const mgpu__exec *ex) {
    mgpu__conv_nhwc_products one;
    one.product[0] = *(const mgpu__conv_nhwc_args *)args;
    one.count = 1;
    mgpu__conv_nhwc_slices(&one.product[0]);
    mgpu__conv_nhwc_launch(&one, (cudaStream_t)ex->stream);
}

/* ------------------------------ the input gradient at stride t > 1 */
/* Sub-pixel convolutions. In the forward pass y[p] = sum over r of
   w[r] x[t p + r - d] (one dimension; the other is the same), so
       dx[h] = sum over the (p, r) with t p + r - d = h of w[r] dy[p].
   For the rows h = t u + e of one remainder e, only the taps r = first +
   t i (first = (e + d) mod t) meet a row of dy, p = u + (e + d - first)
   / t - i. Numbered backwards, j = taps - 1 - i, that is
       dx[t u + e] = sum over j of w[first + t (taps - 1 - j)] dy[u + j - pad']
   with pad' = taps - 1 - (e + d - first) / t: a stride-1 convolution of
   dy with `taps` of the R taps, turned round. In two dimensions the t^2
   classes (e_h, e_w) share the work out: a 3x3 window at stride 2 and
   padding 1 gives classes of 1x1, 1x2, 2x1 and 2x2 taps, with pad' 0,
   and their products add up to the one of the whole input gradient. A
   class without taps (a 1x1 window at stride 2 reaches only even rows)
   has zeros for its pixels (or leaves them as they were, when the
   gradient is added to dx).

   Each class is the forward kernel on dy_t, with the class's taps of w
   copied to [C, taps_r, taps_s, K] (mgpu__subpixel_weights_kernel,
   TF32), and its output pixels (u, v) written to (t u + e_h, t v + e_w)
   of dx (mgpu__nhwc_out). The classes run side by side in one launch
   (mgpu__conv_nhwc_products_kernel), each block a tile of one of them.

   The kernel takes one padding for both dimensions: classes whose pads
   differ between rows and columns do not fit (none
   of ResNet's do). */

/* One dimension of a class: its taps (the count), the first one, and pad'. */
static int mgpu__subpixel_taps(int window, int pad, int t, int e, int *first, int *pad_out) {
    *first = (e + pad) % t;
    int taps = window > *first ? (window - *first + t - 1) / t : 0;
    *pad_out = taps - 1 - (e + pad - *first) / t;
    return taps;
}

typedef struct {
    mgpu__conv_geom g;  /* the product: a stride-1 convolution of dy [n, K, P, Q] */
    mgpu__nhwc_out out; /* where its pixels go in dx */
    int first_r, first_s, pad_s; /* the first of w's rows and columns it takes; its columns' pad */
} mgpu__subpixel_class;

/* Class (e_h, e_w). */
static mgpu__subpixel_class mgpu__subpixel_class_of(const mgpu__conv_geom *g, int e_h, int e_w) {
    mgpu__subpixel_class k;
    int t = g->stride, pad_r;
    int taps_r = mgpu__subpixel_taps(g->r, g->pad, t, e_h, &k.first_r, &pad_r);
    int taps_s = mgpu__subpixel_taps(g->s, g->pad, t, e_w, &k.first_s, &k.pad_s);
    int rows = e_h < g->h ? (g->h - e_h + t - 1) / t : 0, cols = e_w < g->w ? (g->w - e_w + t - 1) / t : 0;
    mgpu__conv_geom d = {g->n, g->k, g->p, g->q, g->c, taps_r, taps_s, rows, cols, 1, pad_r};
    mgpu__nhwc_out out = {t, e_h, e_w, g->h, g->w};
    k.g = d;
    k.out = out;
    return k;
}
/* The products of dx at stride t, its t^2 classes; and product i of them, in the order of their taps, most first
   (of equal taps, in the order of their classes). A launch's products lie
   one after another in its grid, and a GPU starts blocks in the grid's
   order (in practice: CUDA promises no order), so the longest blocks
   start first and the short ones fill in the places they leave, as in
   longest-first scheduling. In the order of the classes, a 3x3 window at
   stride 2 would put the 2x2 class last, and the launch would end on a
   wave of its blocks alone. ResNet-18's stage 3 in 128 x 128 tiles: 392
   blocks of 8, 16, 16 and 32 steps for 264 places; a block counted as its
   steps and 3 more (its start and its end), the launch takes 54
   step-times in the order of the classes, 38 the other way round, 31 if
   it were even. */
static int mgpu__subpixel_products(const mgpu__conv_geom *g) { return g->stride * g->stride; }
static mgpu__subpixel_class mgpu__subpixel_product(const mgpu__conv_geom *g, int i) {
    int n = mgpu__subpixel_products(g);
    for (int j = 0; j < n; j++) { /* the class with i products before it */
        mgpu__subpixel_class k = mgpu__subpixel_class_of(g, j / g->stride, j % g->stride);
        int before = 0;
        for (int o = 0; o < n; o++) {
            mgpu__subpixel_class other = mgpu__subpixel_class_of(g, o / g->stride, o % g->stride);
            int taps = other.g.r * other.g.s, own = k.g.r * k.g.s;
            before += taps > own || (taps == own && o < j);
        }
        if (before == i) return k;
    }
    mgpu_fatal("internal: sub-pixel product %d of %d", i, n);
}

/* Whether product k has anything to compute: pixels of dx, and taps
   (else its pixels are zeros, or dx as it was). */
static int mgpu__subpixel_runs(const mgpu__subpixel_class *k) { return k->g.p && k->g.q && k->g.r && k->g.s; }

/* Whether the sub-pixel classes compute dx of geometry g (stride > 1). */
static int mgpu__conv_nhwc_subpixel_fits(const mgpu__conv_geom *g) {
    if (g->stride < 2) return 0;
    for (int i = 0; i < mgpu__subpixel_products(g); i++) {
        mgpu__subpixel_class k = mgpu__subpixel_product(g, i);
        if (!mgpu__conv_nhwc_fits(&k.g)) return 0;
        if (k.g.r > 0 && k.g.s > 0 && k.g.pad != k.pad_s) return 0;
    }
    return 1;
}

/* out[c, j_r, j_s, k] = tf32(w[k, c, r, s]): the weights of product k,
   (j_r, j_s) the tap's place in the class's window, turned round,
   filters and channels swapped. One
   thread a value (the weights are small), a row of the grid (blockIdx.y)
   for each product, one launch for the products that run together (as
   many as their batch, mgpu__conv_nhwc_products, holds). */
typedef struct {
    const float *w; /* [K, C, R, S] */
    mgpu__conv_geom g;
    mgpu__subpixel_class k[MGPU__NHWC_PRODUCTS_MAX];
    float *out[MGPU__NHWC_PRODUCTS_MAX];
} mgpu__subpixel_weights_args;

static __host__ __device__ size_t mgpu__subpixel_weight_floats(const mgpu__conv_geom *g,
                                                                const mgpu__subpixel_class *k) {
    return (size_t)k->g.k * k->g.r * k->g.s * g->k;
}
static __global__ void mgpu__subpixel_weights_kernel(const __grid_constant__ mgpu__subpixel_weights_args a) {
    const mgpu__conv_geom &g = a.g;
    const mgpu__subpixel_class &product = a.k[blockIdx.y];
    const mgpu__conv_geom &d = product.g;
    float *out = a.out[blockIdx.y];
    int t = g.stride;
    MGPU__GRID_STRIDE_LOOP(i, mgpu__subpixel_weight_floats(&g, &product)) {
        int k = (int)(i % g.k), rest = (int)(i / g.k);
        int j_s = rest % d.s, j_r = rest / d.s % d.r, c = rest / d.s / d.r;
        int r = product.first_r + t * (d.r - 1 - j_r), s = product.first_s + t * (d.s - 1 - j_s);
        out[i] = mgpu__tf32_round(a.w[(((size_t)k * g.c + c) * g.r + r) * g.s + s]);
    }
}

typedef struct {
    float *dx;          /* [n, C, H, W] */
    const float *dy_t;  /* [n, P, Q, K], TF32 */
    const float *w;     /* [K, C, R, S] */
    float *w_classes;   /* scratch of mgpu__conv_nhwc_subpixel_weight_floats: the products' taps */
    mgpu__conv_geom g;  /* of the convolution (stride > 1) */
    mgpu__implicit_tile tile;
    int accumulate;     /* 1: dx += the gradient; 0: dx = it */
    int splits;         /* each product's sum in slices (0 or 1: none) */
    float *partials;    /* their scratch: mgpu__conv_nhwc_subpixel_partial_floats */
    int wgmma;          /* 1: the products by wgmma (mgpu__conv_nhwc_args) */
} mgpu__conv_nhwc_subpixel_args;

/* The floats of the products' weights, one after another. */
static size_t mgpu__conv_nhwc_subpixel_weight_floats(const mgpu__conv_geom *g) {
    size_t floats = 0;
    for (int i = 0; i < mgpu__subpixel_products(g); i++) {
        mgpu__subpixel_class k = mgpu__subpixel_product(g, i);
        floats += mgpu__subpixel_weight_floats(g, &k);
    }
    return floats;
}
/* The floats of the partials for the products of dx of geometry g that
   run, one after another (they run at once). */
static size_t mgpu__conv_nhwc_subpixel_partial_floats(const mgpu__conv_geom *g, int splits) {
    size_t floats = 0;
    for (int i = 0; i < mgpu__subpixel_products(g); i++) {
        mgpu__subpixel_class k = mgpu__subpixel_product(g, i);
        if (mgpu__subpixel_runs(&k)) floats += mgpu__conv_nhwc_partial_floats(&k.g, splits);
    }
    return floats;
}

/* The floats of the partials for dx of geometry g in `splits` slices: of
   the stride-1 product (mgpu__conv_dx_geometry), or of the largest
   sub-pixel product. */
static inline size_t mgpu__conv_nhwc_dx_partial_floats(const mgpu__conv_geom *g, int splits) {
    if (g->stride > 1) return mgpu__conv_nhwc_subpixel_partial_floats(g, splits);
    mgpu__conv_geom d = mgpu__conv_dx_geometry(g);
    return mgpu__conv_nhwc_partial_floats(&d, splits);
}

/* A batch of products: their weights (weights->k[i] and out[i] for
   product i of the batch) in one launch, then the products in another;
   the batch emptied after. */
static void mgpu__subpixel_launch(mgpu__subpixel_weights_args *weights, mgpu__conv_nhwc_products *batch,
                                  cudaStream_t stream) {
    size_t most = 0;
    for (int i = 0; i < batch->count; i++) {
        size_t floats = mgpu__subpixel_weight_floats(&weights->g, &weights->k[i]);
        if (floats > most) most = floats;
    }
    dim3 grid(mgpu__grid_for(most, 256), batch->count);
    mgpu__subpixel_weights_kernel<<<grid, 256, 0, stream>>>(*weights);
    MGPU_CUDA_CHECK_LAUNCH();
    mgpu__conv_nhwc_launch(batch, stream);
    batch->count = 0;
}

/* dx: the products' taps, then the products, each in one launch
   (MGPU__NHWC_PRODUCTS_MAX products at a time). Where products have no taps and
   dx is not added to, all of dx is zeroed first (one memset), and those
   products are skipped: run as products of no steps,
   the 3 empty classes of a 1x1 window at stride 2 take far longer than
   the memset (their zeros go out through the product's epilogue, to
   every other pixel: bench/history.md). */
static void mgpu__conv_nhwc_subpixel_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__conv_nhwc_subpixel_args *a = (const mgpu__conv_nhwc_subpixel_args *)args;
    int products = mgpu__subpixel_products(&a->g), empty = 0;
    for (int i = 0; i < products; i++) {
        mgpu__subpixel_class k = mgpu__subpixel_product(&a->g, i);
        empty += k.g.r * k.g.s == 0;
    }
    cudaStream_t stream = (cudaStream_t)ex->stream;
    if (empty && !a->accumulate)
        MGPU_CUDA_CHECK(cudaMemsetAsync(a->dx, 0, sizeof(float) * a->g.n * a->g.c * a->g.h * a->g.w, stream));
    float *w_class = a->w_classes;
    size_t partials = 0; /* (floats into a->partials) */
    mgpu__subpixel_weights_args weights;
    weights.w = a->w, weights.g = a->g;
    mgpu__conv_nhwc_products batch;
    batch.count = 0;
    for (int i = 0; i < products; i++) {
        mgpu__subpixel_class k = mgpu__subpixel_product(&a->g, i);
        if (!mgpu__subpixel_runs(&k)) continue; /* no pixels of dx, or zeros (or dx as it was) */
        weights.k[batch.count] = k, weights.out[batch.count] = w_class;
        mgpu__conv_nhwc_args product = {a->dx, a->dy_t, w_class, NULL, k.g, a->tile, k.out,
                                        a->accumulate, a->splits, 0, a->partials ? a->partials + partials : NULL,
                                        a->wgmma};
        mgpu__conv_nhwc_slices(&product);
        batch.product[batch.count++] = product;
        w_class += mgpu__subpixel_weight_floats(&a->g, &k);
        partials += mgpu__conv_nhwc_partial_floats(&k.g, a->splits);
        if (batch.count == MGPU__NHWC_PRODUCTS_MAX) mgpu__subpixel_launch(&weights, &batch, stream);
    }
    if (batch.count) mgpu__subpixel_launch(&weights, &batch, stream);
}

/* ------------------- the input gradient at stride 2, a quad at a time */
/* The sub-pixel classes above are products of their own, each block one
   class: ResNet-18's stage 2 (3x3, stride 2, padding 1, 64 channels of
   dx, 128 filters) sums 4, 8, 8 and 16 steps a class, and a class writes
   every other value of every other row of dx. They run far behind
   cuDNN's pace (bench/history.md): too few
   steps a block to hide its start and its end.

   Here a block computes all four classes. For a 3x3 window at stride 2
   and padding 1, in one dimension: the forward pass puts x's row 2p + r -
   1 under tap r of dy's row p, so dx's row h takes the (p, r) with 2p +
   r - 1 = h. The even row 2u takes tap 1 at dy's row u; the odd row 2u +
   1 takes tap 2 at row u and tap 0 at row u + 1. So the quad of dx's pixels
   (2u + e_h, 2v + e_w), e_h and e_w 0 or 1, one of each class, reads dy
   at four pixels only, (u, v) shifted by (i, j) = (0, 0), (0, 1), (1, 0)
   or (1, 1), and each of the 9 taps (r, s) takes one shift to one class:
       shift (0, 0): taps (1,1) (1,2) (2,1) (2,2) to classes (0,0) (0,1) (1,0) (1,1)
       shift (0, 1): taps (1,0) (2,0)             to classes (0,1) (1,1)
       shift (1, 0): taps (0,1) (0,2)             to classes (1,0) (1,1)
       shift (1, 1): tap  (0,0)                   to class (1,1)
   A block takes 64 pixels (u, v) of dy and 64 channels of dx, and keeps
   four 64 x 64 tiles of sums, one a class (each warp its quarter of
   each, 128 accumulators a thread, as many as the 128 x 128 tile's). A
   step is 32 of dy's K channels at one shift: the tile of dy_t at the
   shifted pixels (as the forward kernel's b, zeros past dy's edge) and
   the tiles of w'_t of the shift's taps (the turned weights the stride-1
   dx reads: tap (r, s) at (2 - r, 2 - s)), 1 to 4 of them; each warp
   loads its fragments of dy once a step for all of them. K / 32 runs of
   4 steps take each tap once, so that the quad's four values sum K, 2K,
   2K and 4K terms: at stage 2 (K = 128) 16 steps a block, 36 products of
   64 x 64 x 32 tiles, where a class's block takes 4 to 16 steps. A run of
   4 steps copies 0.09 bytes into shared memory a multiply-add (13 tiles
   of 64 x 32 for 9 products), as the forward kernel's 64 x 128 tile does
   a step. At the end the four tiles go through shared memory, and each
   quad's four values to dx: consecutive threads, consecutive columns of
   a row of dx, so that whole rows go out together. */
#define MGPU__QUAD_TILE 64 /* channels of dx, and pixels of dy, a block */
#define MGPU__QUAD_PLANE (MGPU__QUAD_TILE * (MGPU__QUAD_TILE + 4) + 16) /* floats of a class's finished tile */
typedef struct {
    float *dx;         /* [n, C, H, W] */
    const float *dy_t; /* [n, P, Q, K], TF32 */
    const float *w_t;  /* w'_t [C, 3, 3, K]: the weights turned (mgpu__weights_copy), TF32 */
    mgpu__conv_geom g; /* of the convolution: 3x3, stride 2, padding 1 */
    int accumulate;    /* 1: dx += the gradient; 0: dx = it */
} mgpu__conv_nhwc_stride2_dx_args;

static int mgpu__conv_nhwc_stride2_dx_fits(const mgpu__conv_geom *g) {
    return g->r == 3 && g->s == 3 && g->stride == 2 && g->pad == 1 && g->k % MGPU__NHWC_STEP == 0 &&
           g->c / MGPU__QUAD_TILE < 65535;
}

/* A block's shared memory: two copies of a step's tiles, the taps' (up to
   4) and dy's, and at the end, in the same bytes, the classes' finished
   tiles [4][64 channels][64 pixels + 4], 16 floats between them so that
   a warp's reads of two classes' values (below) hit 32 banks. */
union mgpu__nhwc_quad_tiles {
    struct {
        float w[MGPU__NHWC_STAGES][4][MGPU__QUAD_TILE][MGPU__NHWC_STEP + 4];
        float dy[MGPU__NHWC_STAGES][MGPU__QUAD_TILE][MGPU__NHWC_STEP + 4];
    } step;
    float out[4][MGPU__QUAD_PLANE];
};

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
/* The taps of shift (I, J), as in the table above. In one dimension,
   shift 0 serves tap 1 (of class e = 0) and tap 2 (e = 1), shift 1 only
   tap 0 (e = 1). The shift's tap (i, j), i < ROWS and j < COLS, is the
   window's tap (r(i), s(j)); its weights lie in the step's tile i COLS +
   j, and it adds to the tile of sums of class (e_h, e_w), quad_class(i,
   j) = 2 e_h + e_w. */
template <int I, int J> struct mgpu__quad_shift {
    static const int ROWS = I ? 1 : 2, COLS = J ? 1 : 2;
    static __host__ __device__ int r(int i) { return I ? 0 : 1 + i; }
    static __host__ __device__ int s(int j) { return J ? 0 : 1 + j; }
    static __host__ __device__ int quad_class(int i, int j) { return 2 * (I ? 1 : i) + (J ? 1 : j); }
};
typedef mgpu__nhwc_warp<MGPU__QUAD_TILE, MGPU__QUAD_TILE> mgpu__quad_warp;

/* Starts the copies of a step into copy `stage`: dy's channels c0 .. c0
   + 31 at shift (I, J), and the same channels of w'_t for each of the
   shift's taps (`reads`: the kernel's, below). */
template <int I, int J>
static __device__ void mgpu__quad_load(const mgpu__conv_nhwc_stride2_dx_args &a, const mgpu__conv_geom &reads,
                                       const mgpu__nhwc_pixels<MGPU__QUAD_TILE, mgpu__padded_rows> &pixels,
                                       mgpu__shared_address w_tiles, mgpu__shared_address dy_tiles, int stage,
                                       int c0) {
    typedef mgpu__quad_shift<I, J> S;
    pixels.copy(dy_tiles, stage, a.dy_t, reads, I, J, c0);
    for (int i = 0; i < S::ROWS; i++)
        for (int j = 0; j < S::COLS; j++)
            mgpu__nhwc_load_weights<MGPU__QUAD_TILE>(a.w_t, reads, w_tiles, 4 * stage + i * S::COLS + j,
                                                    (2 - S::r(i)) * 3 + 2 - S::s(j), c0);
}
/* acc[class] += the shift's taps times dy, from copy `stage` of the step
   tiles: each step of k = 8, dy's fragments once, then each tap's. */
template <int I, int J>
static __device__ void mgpu__quad_multiply(mgpu__quad_warp::acc (&acc)[4], mgpu__shared_address w_tiles,
                                           mgpu__shared_address dy_tiles, int stage) {
    typedef mgpu__quad_shift<I, J> S;
    const int T = MGPU__QUAD_TILE;
    mgpu__shared_address b_row = mgpu__nhwc_lane_b_row<T>(dy_tiles, stage);
    mgpu__shared_address a_row = mgpu__nhwc_lane_a_row<T>(w_tiles + mgpu__padded_rows::at(4 * stage * T, 0));
    mgpu__nhwc_fragments<T, T> f;
    for (int kk = 0; kk < MGPU__NHWC_STEP; kk += 8) {
        f.load_b(b_row, kk);
        MGPU__UNROLL
        for (int i = 0; i < S::ROWS; i++)
            MGPU__UNROLL
            for (int j = 0; j < S::COLS; j++) {
                f.load_a(a_row + mgpu__padded_rows::at((i * S::COLS + j) * T, 0), kk);
                f.multiply(acc[S::quad_class(i, j)]);
            }
    }
}
#endif

static __global__ void __launch_bounds__(MGPU__IMPLICIT_THREADS, 2)
mgpu__conv_nhwc_stride2_dx_kernel(const mgpu__conv_nhwc_stride2_dx_args a) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    const mgpu__conv_geom g = a.g;
    const int T = MGPU__QUAD_TILE;
    /* What the copies read, in the terms of the forward kernel's pieces
       (mgpu__nhwc_pixels, mgpu__nhwc_load_weights): dy [n, P, Q, K] as
       their input, its P x Q pixels as their output grid, a window that
       moves one pixel at a time from (0, 0), of which only the taps (0,
       0) .. (1, 1) are read, the shifts (each checked against dy's edge);
       and w'_t as C filters of 3 x 3 x K (only that R and S make a row of
       w'_t 9 K long). Not a convolution the kernel computes. */
    mgpu__conv_geom reads = {g.n, g.k, g.p, g.q, g.c, 3, 3, g.p, g.q, 1, 0};
    mgpu__nhwc_quad_tiles *t = (mgpu__nhwc_quad_tiles *)mgpu__dynamic_shared();
    mgpu__shared_address w_tiles = mgpu__shared_address_of(t->step.w), dy_tiles = mgpu__shared_address_of(t->step.dy);
    const mgpu__nhwc_pixels<T, mgpu__padded_rows> pixels(reads, blockIdx.x * T);
    /* mgpu__nhwc_steps names only the copy of the tiles (the stage) a
       load or multiply takes; the steps go in order, so these count them:
       step i is dy's channels 32 (i / 4).. at shift i % 4 */
    int loaded = 0, multiplied = 0;
    auto load = [&](int stage) {
        int c0 = loaded / 4 * MGPU__NHWC_STEP;
        switch (loaded++ % 4) {
        case 0: mgpu__quad_load<0, 0>(a, reads, pixels, w_tiles, dy_tiles, stage, c0); break;
        case 1: mgpu__quad_load<0, 1>(a, reads, pixels, w_tiles, dy_tiles, stage, c0); break;
        case 2: mgpu__quad_load<1, 0>(a, reads, pixels, w_tiles, dy_tiles, stage, c0); break;
        default: mgpu__quad_load<1, 1>(a, reads, pixels, w_tiles, dy_tiles, stage, c0);
        }
    };
    mgpu__quad_warp::acc acc[4] = {};
    mgpu__nhwc_steps<MGPU__NHWC_STAGES>(g.k / MGPU__NHWC_STEP * 4, load, [&](int stage) {
        switch (multiplied++ % 4) {
        case 0: mgpu__quad_multiply<0, 0>(acc, w_tiles, dy_tiles, stage); break;
        case 1: mgpu__quad_multiply<0, 1>(acc, w_tiles, dy_tiles, stage); break;
        case 2: mgpu__quad_multiply<1, 0>(acc, w_tiles, dy_tiles, stage); break;
        default: mgpu__quad_multiply<1, 1>(acc, w_tiles, dy_tiles, stage);
        }
    });

    /* the four tiles to shared memory (the steps' bytes: every warp is
       done with them), each value where mgpu__mma_tf32 put it */
    MGPU__UNROLL
    for (int k = 0; k < 4; k++)
        mgpu__nhwc_each_value<mgpu__quad_warp>(acc[k], [&](int row, int col, float value) {
            t->out[k][row * (T + 4) + col] = value;
        });
    __syncthreads();
    /* then to dx: thread 2 i + e_w takes column class e_w of the block's
       pixel i of dy, (u, v), for each channel and row class: dx's column
       2 v + e_w of rows 2 u and 2 u + 1 */
    int tid = threadIdx.x, e_w = tid % 2, pixel = blockIdx.x * T + tid / 2, pq = g.p * g.q, img = pixel / pq;
    int u = (pixel - img * pq) / g.q, v = pixel - img * pq - u * g.q, col = 2 * v + e_w;
    if (pixel >= g.n * pq || col >= g.w) return; /* (no barrier follows) */
    size_t plane = (size_t)g.h * g.w;
    float *to = a.dx + ((size_t)img * g.c + blockIdx.y * T) * plane + (size_t)2 * u * g.w + col;
    const float *from = t->out[e_w] + tid / 2;
    int channels = g.c - (int)blockIdx.y * T; /* (of this block and those after it) */
    for (int c = 0; c < T && c < channels; c++)
        for (int e_h = 0; e_h < 2 && 2 * u + e_h < g.h; e_h++) {
            float value = from[2 * e_h * MGPU__QUAD_PLANE + c * (T + 4)];
            float *at = to + c * plane + e_h * g.w;
            *at = a.accumulate ? *at + value : value;
        }
#endif
}

static void mgpu__conv_nhwc_stride2_dx_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__conv_nhwc_stride2_dx_args *a = (const mgpu__conv_nhwc_stride2_dx_args *)args;
    int bytes = (int)sizeof(mgpu__nhwc_quad_tiles);
    MGPU_CUDA_CHECK(cudaFuncSetAttribute(mgpu__conv_nhwc_stride2_dx_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         bytes));
    size_t pixels = (size_t)a->g.n * a->g.p * a->g.q;
    dim3 grid((unsigned)((pixels + MGPU__QUAD_TILE - 1) / MGPU__QUAD_TILE),
              (unsigned)((a->g.c + MGPU__QUAD_TILE - 1) / MGPU__QUAD_TILE));
    mgpu__conv_nhwc_stride2_dx_kernel<<<grid, MGPU__IMPLICIT_THREADS, bytes, (cudaStream_t)ex->stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
}

/* ------------------------------------------------- the weight gradient */
/* dW_t [K, (r,s,c)] = G col^T, summed over the output pixels l = (img,p,q):
       dw_t[k, (r,s,c)] = sum over l of dy_t[l, k] x_t[img, p*t + r - d, q*t + s - d, c]
   from channels-last copies of dy [n, K, P, Q] and x. Rows are filters,
   columns (r, s, c), channels fastest; a step is 32 output pixels. For
   each, the tile of a holds TM contiguous filters of dy_t's row, the
   tile of b TN columns of x_t: 4 channels at a time, one 16-byte copy,
   from the pixel the window position (r, s) of the column puts under
   it (so C and K must be multiples of 4; any stride, padding and window).

   Both tiles are stored by the summed index (a[pixel][filter],
   b[pixel][column]), as they lie in memory, which is the transpose of
   what ldmatrix gives mma for 32-bit values: the lanes load their
   fragments with one 32-bit load each instead. Lane l (g = l / 4, t =
   l % 4) reads row t or t + 4 and column g (+ 8, + 16 ...): with rows
   TM + 8 floats apart (8 banks), the 4 rows start on banks 0, 8, 16, 24
   and the 32 lanes hit 32 banks. For the 128 x 128 tile a warp loads 32
   values a lane for 32 multiplies per 8 pixels (4 ldmatrix would do it
   in the forward kernel); the shared memory read is the same.

   The sum is long and the output small (stage 1: 200704 pixels, 64 x 576
   values), so it is split over blocks (grid.z) in slices of whole steps
   (how many: the trial in mgpu/convolution.h times several, for 256 to 1536 blocks);
   each slice's tile goes to its own partial [K, R*S*C], and
   mgpu__wgrad_sum (conv.h) adds the slices in order into dw,
   from (r, s, c) to dw's (c, r, s).

   Instructions a step per multiply: more than the forward kernel's in
   the same tile, the more the smaller the tile, about half of them the
   copies' address arithmetic (the counts, from the SASS:
   bench/history.md). */
typedef struct {
    float *dw;         /* [K, C, R, S]: beta * dw + the gradient */
    float *partials;   /* [splits, K, R*S*C] scratch */
    const float *dy_t; /* [n, P, Q, K], TF32 */
    const float *x_t;  /* [n, H, W, C], TF32 */
    float beta;
    int splits, per;   /* slices of the sum, `per` output pixels each (whole steps) */
    mgpu__conv_geom g;
    mgpu__implicit_tile tile;
} mgpu__conv_nhwc_dw_args;

static int mgpu__conv_nhwc_dw_fits(const mgpu__conv_geom *g) {
    return g->c % 4 == 0 && g->k % 4 == 0 && g->k / 64 < 65535;
}
/* Slices of the sum over output pixels: about `blocks` blocks in all,
   each summing at least 512 pixels (fewer, longer slices than the
   gathering kernels' in bench/conv: this kernel multiplies faster than
   it could read and write more partial tiles), the partial tiles at
   most MGPU__PARTIAL_FLOATS_MAX. */
static int mgpu__conv_nhwc_dw_splits(const mgpu__conv_geom *g, mgpu__implicit_tile tile, size_t blocks) {
    size_t crs = (size_t)g->c * g->r * g->s, pixels = (size_t)g->n * g->p * g->q;
    size_t rows = mgpu__implicit_tile_rows[tile], columns = mgpu__implicit_tile_columns[tile];
    size_t tiles = ((size_t)g->k + rows - 1) / rows * ((crs + columns - 1) / columns);
    size_t splits = (blocks + tiles - 1) / tiles;
    if (splits > pixels / 512) splits = pixels / 512;
    size_t most = MGPU__PARTIAL_FLOATS_MAX / ((size_t)g->k * crs);
    if (splits > most) splits = most;
    if (splits > 65535) splits = 65535; /* grid.z */
    return splits < 1 ? 1 : (int)splits;
}
/* Sets a->per, a whole number of steps, for about a->splits slices (0:
   for about 512 blocks), and a->splits to the slices that takes. */
static void mgpu__conv_nhwc_dw_slices(mgpu__conv_nhwc_dw_args *a) {
    int pixels = a->g.n * a->g.p * a->g.q;
    int splits = a->splits > 0 ? a->splits : mgpu__conv_nhwc_dw_splits(&a->g, a->tile, 512);
    int steps = (pixels + MGPU__NHWC_STEP - 1) / MGPU__NHWC_STEP;
    a->per = (steps + splits - 1) / splits * MGPU__NHWC_STEP;
    a->splits = (pixels + a->per - 1) / a->per;
}

template <int TM, int TN> struct mgpu__nhwc_dw_tiles {
    uint32_t a[MGPU__NHWC_DW_STAGES][MGPU__NHWC_STEP][TM + 8];
    uint32_t b[MGPU__NHWC_DW_STAGES][MGPU__NHWC_STEP][TN + 8];
};

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
/* acc += a b for this warp's quarter of the tile from one copy of the
   step tiles, a [32 pixels][TM + 8] and b: four tensor-core steps of k =
   8, each lane loading its fragments as mgpu__mma_tf32 lays them out
   (A[m][k] = a[k][m], B[k][n] = b[k][n]). load_b(kk, fb) loads this
   lane's fragments of b for the 8 pixels from kk: B[t][g] and B[t + 4][g]
   of each of the warp's 8-column tiles j, in fb[j][0] and fb[j][1]. */
template <int TM, int TN, typename LoadB>
static __device__ void mgpu__nhwc_dw_multiply(typename mgpu__nhwc_warp<TM, TN>::acc &acc,
                                              const uint32_t (*a_step)[TM + 8], LoadB load_b) {
    typedef mgpu__nhwc_warp<TM, TN> W;
    const int LA = TM + 8;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const uint32_t *a = &a_step[t][(warp / 2) * (TM / 2) + g];
    for (int kk = 0; kk < MGPU__NHWC_STEP; kk += 8) {
        uint32_t fa[W::MT][4], fb[W::NT][2];
        for (int i = 0; i < W::MT; i++) {
            fa[i][0] = a[kk * LA + 16 * i], fa[i][1] = a[kk * LA + 16 * i + 8];
            fa[i][2] = a[(kk + 4) * LA + 16 * i], fa[i][3] = a[(kk + 4) * LA + 16 * i + 8];
        }
        load_b(kk, fb);
        for (int i = 0; i < W::MT; i++)
            for (int j = 0; j < W::NT; j++) mgpu__mma_tf32(acc[i][j], fa[i], fb[j]);
    }
}

/* The copies of a weight gradient's a tiles: TM filters (4 a copy) of
   dy_t's rows, a step of 32 output pixels at a time, from a slice of
   `count` pixels from `first`; a thread always the same 16 bytes (chunk)
   of every APART-th row, zeros past the slice or past K. */
template <int TM> struct mgpu__nhwc_dy_rows {
    static const int CHUNKS = TM / 4, APART = MGPU__IMPLICIT_THREADS / CHUNKS, PER = MGPU__NHWC_STEP / APART;
    const float *rows; /* this thread's next row's 4 filters */
    int chunk, row, left, k;
    __device__ mgpu__nhwc_dy_rows(const float *dy_t, int k_, int first, int count) {
        int tid = threadIdx.x, filter = blockIdx.y * TM + (tid % CHUNKS) * 4;
        chunk = tid % CHUNKS, row = tid / CHUNKS, k = k_;
        rows = dy_t + (size_t)(first + row) * k + filter;
        left = filter < k ? count - row : 0; /* the slice's rows from this thread's next one */
    }
    /* Starts the next step's copies into copy `stage` of the tiles a
       [stages][32][TM + 8]; `any`: an address the zero-filling copies
       name but do not read. */
    __device__ void copy(mgpu__shared_address a_tiles, int stage, const float *any) {
        const int LA = TM + 8;
        mgpu__shared_address to = a_tiles + 4 * ((stage * MGPU__NHWC_STEP + row) * LA + chunk * 4);
        for (int j = 0; j < PER; j++) {
            bool valid = j * APART < left;
            mgpu__copy_async16<MGPU__SKIP_L1>(to + 4 * j * APART * LA, valid ? rows + j * APART * k : any, valid);
        }
        rows += MGPU__NHWC_STEP * k, left -= MGPU__NHWC_STEP;
    }
};
#endif

template <int TM, int TN>
static __global__ void __launch_bounds__(MGPU__IMPLICIT_THREADS, MGPU__NHWC_DW_BLOCKS_PER_SM(TM, TN))
mgpu__conv_nhwc_dw_kernel(mgpu__conv_nhwc_dw_args a) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    typedef mgpu__nhwc_warp<TM, TN> W;
    const mgpu__conv_geom g = a.g;
    const int STEP = MGPU__NHWC_STEP, LB = TN + 8;
    /* a thread's copies of b: always the same 16 bytes (chunk) of a row,
       in every B_APART-th row (pixel), B_PER rows */
    const int B_CHUNKS = TN / 4, B_APART = MGPU__IMPLICIT_THREADS / B_CHUNKS, B_PER = STEP / B_APART;
    mgpu__nhwc_dw_tiles<TM, TN> *t = (mgpu__nhwc_dw_tiles<TM, TN> *)mgpu__dynamic_shared();
    mgpu__shared_address a_tiles = mgpu__shared_address_of(t->a), b_tiles = mgpu__shared_address_of(t->b);
    int tid = threadIdx.x, pq = g.p * g.q, rsc = g.r * g.s * g.c;
    /* this block's slice of the pixels: count of them from first */
    int first = blockIdx.z * a.per, count = first + a.per < g.n * pq ? a.per : g.n * pq - first;

    mgpu__nhwc_dy_rows<TM> dy_rows(a.dy_t, g.k, first, count);
    /* b: this thread's 4 columns (r, s, c..c+3), and for each of its
       pixels where the column's values lie in x_t: row h and column w
       (outside 0..H-1, 0..W-1 in the padding) and the offset of x_t[img,
       h, w, c]. Decoded once here; each load moves them on by a step. */
    int b_chunk = tid % B_CHUNKS, b_row = tid / B_CHUNKS, column = blockIdx.x * TN + b_chunk * 4;
    int rs = column / g.c, c = column - rs * g.c, r = rs / g.s, s = rs - r * g.s;
    int b_left = column < rsc ? count - b_row : 0;
    const int row_floats = g.w * g.c, image_floats = g.h * row_floats;
    int h[B_PER], w[B_PER], at[B_PER];
    for (int j = 0; j < B_PER; j++) {
        int pixel = first + b_row + j * B_APART, img = pixel / pq, p = (pixel - img * pq) / g.q;
        h[j] = p * g.stride + r - g.pad, w[j] = (pixel - img * pq - p * g.q) * g.stride + s - g.pad;
        at[j] = img * image_floats + h[j] * row_floats + w[j] * g.c + c;
    }
    /* A step is 32 output pixels: step_img images, step_p rows and step_q
       columns on, and one row more when q passes Q (w reaches w_end), one
       image more when p passes P (h reaches h_end). */
    const int step_q = STEP % g.q, step_p = STEP / g.q % g.p, step_img = STEP / pq;
    const int w_step = step_q * g.stride, h_step = step_p * g.stride;
    const int at_step = w_step * g.c + h_step * row_floats + step_img * image_floats;
    const int w_back = g.q * g.stride, w_end = w_back + s - g.pad;
    const int h_back = g.p * g.stride, h_end = h_back + r - g.pad;
    const int at_next_row = g.stride * row_floats - w_back * g.c, at_next_image = image_floats - h_back * row_floats;
    auto load = [&](int stage) {
        dy_rows.copy(a_tiles, stage, a.dy_t);
        mgpu__shared_address to_b = b_tiles + 4 * ((stage * STEP + b_row) * LB + b_chunk * 4);
        for (int j = 0; j < B_PER; j++) {
            bool inside = j * B_APART < b_left && (unsigned)h[j] < (unsigned)g.h && /* 0 <= h < H */
                          (unsigned)w[j] < (unsigned)g.w;
            mgpu__copy_async16<MGPU__SKIP_L1>(to_b + 4 * j * B_APART * LB, inside ? a.x_t + at[j] : a.x_t, inside);
            w[j] += w_step, h[j] += h_step, at[j] += at_step;
            if (w[j] >= w_end) w[j] -= w_back, h[j] += g.stride, at[j] += at_next_row;
            if (h[j] >= h_end) h[j] -= h_back, at[j] += at_next_image;
        }
        b_left -= STEP;
    };
    typename W::acc acc = {};
    int lane = tid % 32, warp = tid / 32;
    mgpu__nhwc_steps<MGPU__NHWC_DW_STAGES>((count + STEP - 1) / STEP, load, [&](int stage) {
        const uint32_t *b = &t->b[stage][lane % 4][(warp % 2) * (TN / 2) + lane / 4];
        mgpu__nhwc_dw_multiply<TM, TN>(acc, t->a[stage], [&](int kk, uint32_t(&fb)[W::NT][2]) {
            for (int j = 0; j < W::NT; j++) fb[j][0] = b[kk * LB + 8 * j], fb[j][1] = b[(kk + 4) * LB + 8 * j];
        });
    });

    /* the slice's tile straight from the accumulators to its partial (rsc a multiple of 4) */
    mgpu__nhwc_store_partial<TM, TN>(acc, a.partials + (size_t)blockIdx.z * g.k * rsc, rsc, g.k, rsc);
#endif
}

static void mgpu__conv_nhwc_dw_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__conv_nhwc_dw_args *a = (const mgpu__conv_nhwc_dw_args *)args;
    void (*kernel)(mgpu__conv_nhwc_dw_args) = MGPU__IMPLICIT_INSTANCE(mgpu__conv_nhwc_dw_kernel, a->tile);
    int bytes = MGPU__NHWC_BYTES(mgpu__nhwc_dw_tiles, a->tile);
    MGPU_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    dim3 grid = mgpu__implicit_grid(a->tile, (size_t)a->g.r * a->g.s * a->g.c, a->g.k, a->splits);
    kernel<<<grid, MGPU__IMPLICIT_THREADS, bytes, (cudaStream_t)ex->stream>>>(*a);
    MGPU_CUDA_CHECK_LAUNCH();
    mgpu__wgrad_sum_args sum = {a->dw, a->partials, a->beta, a->splits, a->g.k, a->g.c, a->g.r * a->g.s, a->g.c};
    mgpu__wgrad_sum(sum, (cudaStream_t)ex->stream);
}
#endif
#endif
