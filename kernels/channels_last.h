/* kernels/channels_last.h: tensors written channels-last and rounded to
   TF32, the form conv_nhwc.h's products read.

   A matrix in [outer, rows, cols] goes to [outer, cols, rows]: x [n, C,
   H, W] to x_t [n, H, W, C] (outer n, rows C, cols H*W), the weights [K,
   C, R, S] to w_t [K, R, S, C] (outer K, rows C, cols R*S), each value
   rounded to TF32 on the way, so that the product's loop has no rounding
   to do. The tile kernels below only move memory: a tile at a time
   through shared memory, so that reads (along a row) and writes (along a
   column) are both coalesced.

   Where the values come from. A tile kernel asks a source for them: the
   plain copy reads them from the tensor, and batch norm
   (kernels/batchnorm.h) computes them, its output forward and its input
   gradient backward. A source is a struct with
       template <int V> void operator()(size_t at, int i, float (&v)[V])
   that gives the V values at offset `at` of [outer, rows, cols] (columns
   j .. j + V - 1 of row i: a run never crosses a row). So a network whose
   convolution reads a batch norm's output has it written channels-last
   in the same pass that computes it, and its gradient likewise, instead
   of written plainly and then copied: a read and a write of the whole
   tensor saved. */
#ifndef MGPU_KERNELS_CHANNELS_LAST_H
#define MGPU_KERNELS_CHANNELS_LAST_H
#include "common.h"


/* The blocks of 256 threads a multiprocessor holds at once, the tile
   kernels' launch bound (which caps their registers so that all fit):
   8 (2048 threads) from sm_80 on, 4 on Turing (sm_75, nvcc's default
   target), where 8 would be out of range. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define MGPU__BLOCKS_OF_256_PER_SM 4
#else
#define MGPU__BLOCKS_OF_256_PER_SM 8
#endif

/* x to TF32: 10 bits of mantissa, rounded to nearest, ties away from zero
   (as cvt.rna.tf32.f32 and WMMA's __float_to_tf32 round). */
static MGPU__HOSTDEVICE inline float mgpu__tf32_round(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    if ((bits & 0x7f800000u) != 0x7f800000u) bits = (bits + 0x1000u) & ~0x1fffu; /* not inf, NaN */
    memcpy(&v, &bits, sizeof v);
    return v;
}
/* Column j of a matrix whose runs of `flip` columns are reversed (flip 0: j). */
static MGPU__HOSTDEVICE inline int mgpu__flipped(int j, int flip) {
    return flip ? j + flip - 1 - 2 * (j % flip) : j;
}
/* Where element (o, i, j) of [outer, rows, cols] goes in [outer, cols, rows]. */
static MGPU__HOSTDEVICE inline size_t mgpu__channels_last_index(int o, int i, int j, int rows, int cols) {
    return ((size_t)o * cols + j) * rows + i;
}

#if MGPU_CUDA
/* Where a tile kernel writes: out [outer, cols, rows]; with flip > 0 (it
   divides cols), each run of `flip` consecutive j is written in reverse
   order. The weights to w'_t for the input gradient (conv_nhwc.h): outer
   1, rows K, cols C*R*S, flip R*S. */
typedef struct {
    float *out;
    int outer, rows, cols, flip;
} mgpu__channels_last_to;
/* The plain copy: out[o, j, i] = tf32(in[o, i, j]). */
typedef struct {
    mgpu__channels_last_to to;
    const float *in;
} mgpu__channels_last_args;

static void mgpu__channels_last_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__channels_last_args *a = (const mgpu__channels_last_args *)args;
    const mgpu__channels_last_to *to = &a->to;
    for (int o = 0; o < to->outer; o++)
        for (int i = 0; i < to->rows; i++)
            for (int j = 0; j < to->cols; j++)
                to->out[mgpu__channels_last_index(o, i, mgpu__flipped(j, to->flip), to->rows, to->cols)] =
                    mgpu__tf32_round(a->in[((size_t)o * to->rows + i) * to->cols + j]);
}

/* The plain copy's source. */
struct mgpu__copy_source {
    const float *in;
    template <int V> __device__ void operator()(size_t at, int i, float (&v)[V]) const {
        (void)i;
        mgpu__load_floats(v, in + at);
    }
};

/* A block moves a 32 x 32 tile (rows i0.., columns j0..) of each of its
   `outer` matrices: 8 warps take 8 rows at a time along j, and write 8
   columns at a time along i, through a tile padded to 33 columns so that
   reading it by columns hits 32 banks. What bounds a copy is how many
   loads are in flight: every thread's four are issued before the barrier,
   and at most 32 registers a thread let 8 blocks (all 64 warps a
   multiprocessor holds) share one. (With more registers, from index
   arithmetic in 64 bits, half as many blocks fit, and the copy runs far
   below memory's rate: bench/history.md.) The tile of matrices o0, o0 +
   o_step, ...: */
template <class Source>
static __device__ __forceinline__ void mgpu__channels_last_tile(const Source &src,
                                                                const mgpu__channels_last_to &a, int i0, int j0,
                                                                int o0, int o_step, float (*tile)[33]) {
    int lane = threadIdx.x % 32, row = threadIdx.x / 32;
    bool reads = j0 + lane < a.cols, writes = i0 + lane < a.rows; /* this lane's column, then row */
    size_t matrix = (size_t)a.rows * a.cols;
    for (int o = o0; o < a.outer; o += o_step) {
        size_t at = o * matrix + (size_t)i0 * a.cols + j0 + lane; /* [o, i0, j0 + lane] */
        float *out = a.out + o * matrix + i0 + lane;             /* out[o, 0, i0 + lane] */
        for (int k = 0; k < 4; k++) {
            int di = row + 8 * k;
            float v[1];
            if (reads && i0 + di < a.rows) {
                src(at + (size_t)di * a.cols, i0 + di, v);
                tile[di][lane] = v[0];
            }
        }
        __syncthreads();
        for (int k = 0; k < 4; k++) {
            int dj = row + 8 * k, j = j0 + dj;
            if (writes && j < a.cols)
                out[(size_t)mgpu__flipped(j, a.flip) * a.rows] = mgpu__tf32_round(tile[lane][dj]);
        }
        __syncthreads(); /* the tile is read before the next matrix takes it */
    }
}
template <class Source>
static __global__ void __launch_bounds__(256, MGPU__BLOCKS_OF_256_PER_SM)
mgpu__channels_last_kernel(Source src, mgpu__channels_last_to a) {
    __shared__ float tile[32][33];
    mgpu__channels_last_tile(src, a, blockIdx.y * 32, blockIdx.x * 32, blockIdx.z, gridDim.z, tile);
}
/* The same in 16-byte accesses, where rows and columns are whole vectors
   and nothing is flipped (the activations but those of 7x7 images): a
   block moves a 64 x 64 tile, every thread four vectors of 4 in and four
   out, all four loads issued before the first is stored: four times the
   bytes in flight a thread of the kernel above has, which makes this one
   the faster on the activations (bench/history.md). A line of the tile
   is 16 vectors: 16 lanes take one, so a warp's stores to the tile, and
   its loads from it, hit each bank at most twice. */
template <class Source>
static __global__ void __launch_bounds__(256)
mgpu__channels_last_vectors_kernel(Source src, mgpu__channels_last_to a) {
    __shared__ float tile[64][65];
    int part = threadIdx.x % 16, line = threadIdx.x / 16; /* a vector of a line; 16 lines at a time */
    int i0 = blockIdx.y * 64, j0 = blockIdx.x * 64;
    size_t matrix = (size_t)a.rows * a.cols;
    for (int o = blockIdx.z; o < a.outer; o += gridDim.z) {
        float *out = a.out + o * matrix;
        float v[4][4] = {};
        for (int k = 0; k < 4; k++) { /* row i0 + line + 16 k, columns j0 + 4 part .. + 3 */
            int i = i0 + line + 16 * k, j = j0 + 4 * part;
            if (i < a.rows && j < a.cols) src(o * matrix + (size_t)i * a.cols + j, i, v[k]);
        }
        for (int k = 0; k < 4; k++)
            for (int e = 0; e < 4; e++) tile[line + 16 * k][4 * part + e] = v[k][e];
        __syncthreads();
        for (int k = 0; k < 4; k++) { /* column j0 + line + 16 k, rows i0 + 4 part .. + 3 */
            int j = j0 + line + 16 * k, i = i0 + 4 * part;
            for (int e = 0; e < 4; e++) v[k][e] = mgpu__tf32_round(tile[4 * part + e][line + 16 * k]);
            if (j < a.cols && i < a.rows) mgpu__store_floats(out + (size_t)j * a.rows + i, v[k]);
        }
        __syncthreads(); /* the tile is read before the next matrix takes it */
    }
}
/* Matrices of short rows, fewer than 16 values: the weights [K, C, R, S]
   to w_t [K, R, S, C] (rows of R*S = 9 values, or 1; the activations'
   rows are 16 or longer, 4x4 images). There a 32 x 32 tile would be
   mostly empty, and every block would move one filter's 32 x 9 values
   with two barriers. Instead a thread moves a whole row, row r of all
   the matrices' rows (matrix r / rows): it reads the row's values, which
   the next thread's follow, and writes each `rows` apart, beside the next
   thread's; so both are coalesced, with no shared memory and no barrier. */
static MGPU__HOSTDEVICE inline int mgpu__channels_last_by_rows(const mgpu__channels_last_to *to) {
    return to->cols < 16;
}
static __device__ __forceinline__ void mgpu__channels_last_row(const float *in, const mgpu__channels_last_to &a,
                                                               size_t r) {
    size_t o = r / a.rows, i = r - o * a.rows;
    const float *from = in + r * a.cols;
    float *out = a.out + o * a.rows * a.cols + i;
    for (int j = 0; j < a.cols; j++) out[(size_t)mgpu__flipped(j, a.flip) * a.rows] = mgpu__tf32_round(from[j]);
}
static __global__ void mgpu__channels_last_rows_kernel(mgpu__channels_last_args a) {
    MGPU__GRID_STRIDE_LOOP(r, (size_t)a.to.outer * a.to.rows) mgpu__channels_last_row(a.in, a.to, r);
}

/* Writes src's values to `to`, in vectors if the caller says they fit
   (rows and columns whole vectors, every tensor 16-byte aligned, no flip). */
template <class Source>
static void mgpu__channels_last_launch(Source src, mgpu__channels_last_to to, bool vectors,
                                       cudaStream_t stream) {
    unsigned outer = to.outer < 65535 ? to.outer : 65535;
    if (vectors) {
        dim3 grid((to.cols + 63) / 64, (to.rows + 63) / 64, outer);
        mgpu__channels_last_vectors_kernel<Source><<<grid, 256, 0, stream>>>(src, to);
    } else {
        dim3 grid((to.cols + 31) / 32, (to.rows + 31) / 32, outer);
        mgpu__channels_last_kernel<Source><<<grid, 256, 0, stream>>>(src, to);
    }
    MGPU_CUDA_CHECK_LAUNCH();
}
static void mgpu__channels_last_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__channels_last_args *a = (const mgpu__channels_last_args *)args;
    if (mgpu__channels_last_by_rows(&a->to)) {
        size_t rows = (size_t)a->to.outer * a->to.rows;
        mgpu__channels_last_rows_kernel<<<mgpu__grid_for(rows, 256), 256, 0, (cudaStream_t)ex->stream>>>(*a);
        MGPU_CUDA_CHECK_LAUNCH();
        return;
    }
    const void *tensors[] = {a->to.out, a->in};
    bool vectors =
        !a->to.flip && a->to.rows % 4 == 0 && mgpu__vector_width((size_t)a->to.cols, tensors, 2) == 4;
    mgpu__copy_source src = {a->in};
    mgpu__channels_last_launch(src, a->to, vectors, (cudaStream_t)ex->stream);
}

/* Many plain copies in one launch: a network's weights, to w_t before its
   forward pass and to w'_t before its backward pass (mgpu/networks.h). ResNet-18
   has 20 convolutions, most of whose weights are a few hundred KB: one
   launch each, each too small to fill the GPU, would cost about as much
   as a copy of a whole batch of activations (bench/history.md). As in
   kernels/sgd.h's lists, copy c takes blocks first_block[c] ..
   end_block[c] - 1 of the launch for its kind, by tiles (a 32 x 32 tile
   a block) or by rows (256 rows a block), and a block finds its copy by
   walking the short list. The two kinds are two launches: a kernel's
   blocks all meet the same barriers, which the tiles take and the rows
   do not. */
#define MGPU__COPIES_MAX 16
typedef struct {
    int count;
    mgpu__channels_last_args copy[MGPU__COPIES_MAX];
    int first_block[MGPU__COPIES_MAX], end_block[MGPU__COPIES_MAX];
    int blocks[2]; /* of each kind's launch, by tiles and by rows */
} mgpu__channels_last_list_args;

/* The tiles of a copy: 32 x 32 of each of its `outer` matrices. */
static MGPU__HOSTDEVICE int mgpu__channels_last_tiles(const mgpu__channels_last_to *to, int *across) {
    *across = (to->cols + 31) / 32;
    return *across * ((to->rows + 31) / 32) * to->outer;
}
/* Appends a copy to the list; returns 1 once the list is full. */
static int mgpu__channels_last_list_add(mgpu__channels_last_list_args *l, mgpu__channels_last_args copy) {
    int c = l->count++, across, by_rows = mgpu__channels_last_by_rows(&copy.to);
    l->copy[c] = copy;
    l->first_block[c] = l->blocks[by_rows];
    l->blocks[by_rows] += by_rows ? (copy.to.outer * copy.to.rows + 255) / 256
                                  : mgpu__channels_last_tiles(&copy.to, &across);
    l->end_block[c] = l->blocks[by_rows];
    return l->count == MGPU__COPIES_MAX;
}

static void mgpu__channels_last_list_cpu(const void *args, const mgpu__exec *ex) {
    const mgpu__channels_last_list_args *l = (const mgpu__channels_last_list_args *)args;
    for (int c = 0; c < l->count; c++) mgpu__channels_last_cpu(&l->copy[c], ex);
}

template <int BY_ROWS>
static __global__ void __launch_bounds__(256, MGPU__BLOCKS_OF_256_PER_SM)
mgpu__channels_last_list_kernel(mgpu__channels_last_list_args l) {
    int c = 0, block = blockIdx.x;
    while (mgpu__channels_last_by_rows(&l.copy[c].to) != BY_ROWS || block >= l.end_block[c]) c++;
    const mgpu__channels_last_to &to = l.copy[c].to;
    int rest = block - l.first_block[c];
    if (BY_ROWS) {
        size_t r = (size_t)rest * 256 + threadIdx.x;
        if (r < (size_t)to.outer * to.rows) mgpu__channels_last_row(l.copy[c].in, to, r);
        return;
    }
    __shared__ float tile[32][33];
    int across;
    mgpu__channels_last_tiles(&to, &across);
    int tiles = across * ((to.rows + 31) / 32), o = rest / tiles, t = rest - o * tiles;
    mgpu__copy_source src = {l.copy[c].in};
    mgpu__channels_last_tile(src, to, t / across * 32, t % across * 32, o, to.outer, tile); /* (one matrix) */
}
static void mgpu__channels_last_list_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__channels_last_list_args *l = (const mgpu__channels_last_list_args *)args;
    cudaStream_t stream = (cudaStream_t)ex->stream;
    if (l->blocks[0]) {
        mgpu__channels_last_list_kernel<0><<<l->blocks[0], 256, 0, stream>>>(*l);
        MGPU_CUDA_CHECK_LAUNCH();
    }
    if (l->blocks[1]) {
        mgpu__channels_last_list_kernel<1><<<l->blocks[1], 256, 0, stream>>>(*l);
        MGPU_CUDA_CHECK_LAUNCH();
    }
}
#endif
#endif
