/* kernels/conv_halo.h: conv_nhwc.h's forward kernel for 3x3 convolutions
   at stride 1 and padding 1 (ResNet-18's, and their input gradients,
   which are the same convolution of dy), with each run of 32 channels of a
   tile's pixels and of the ring of pixels around them (the halo) copied
   into shared memory once for all nine taps (GPU only, TF32).

   Why. conv_nhwc.h's kernel copies, at every step (one tap, 32 channels),
   the window value of each of its TN output pixels from L2 or L1 into
   shared memory: nine copies of nearly every input value a tile, 16 KB a
   step for 128 pixels beside the weights' 8 KB. On the H100 that traffic
   is what bounds it (Nsight Compute, bench/RESULTS.md: L2 at 60% of its
   peak, a warp eligible to issue a third of the cycles), and where a
   layer has only 64 filters (ResNet-18's stage 1) no taller tile can
   spread a copied value over more filters. Here the nine taps read their
   windows from one copy: for 128 pixels of 28-wide images, at most 260
   positions a run of 32 channels instead of 9 x 128.

   The halo. In the input padded by one pixel of zeros all round, [n, H +
   2, W + 2, C], output pixel (img, p, q)'s window at tap (r, s) is padded
   pixel (img, p + r, q + s), whose index there is
       base(img, p, q) + r (W + 2) + s,   base = (img (H + 2) + p) (W + 2) + q.
   Bases grow with the pixel's index, so all of a block's windows lie
   between base(its first pixel) and base(its last) + 2 (W + 2) + 2. The
   halo is that run of padded positions (the padding's zeros made by
   cp.async's zero fill, x_t itself has no padding), each a row of 32
   channels in shared memory, and each tap is one offset into it, the same
   for every pixel. ldmatrix takes a row address from each lane, so the
   multiply (conv_nhwc.h's mgpu__nhwc_multiply) reads each pixel's window
   straight from the halo: the lane's pixel's base, less the first
   pixel's, plus the tap's offset.

   The steps are conv_nhwc.h's (a tap and 32 channels, taps fastest, two
   steps in flight): the weights' tile is copied every step, the halo at
   the first tap of each 32 channels, into one of two halo buffers, as the
   last tap of the previous channels still reads the other.

   Shared memory: the weights' two tiles (TM rows of 36 floats, as in
   conv_nhwc.h), and two halos of mgpu__conv_halo_positions rows of 36.
   For stage 1 (28x28) in the 64 x 128 tile: 18 KB and 2 x 37 KB, two
   blocks a multiprocessor where conv_nhwc.h's kernel holds three. Whether
   less traffic is worth fewer warps, the trial in mgpu.h measures: this
   kernel is a candidate beside conv_nhwc.h's for every tile.

   The same halo serves the weight gradient of these layers (the second
   kernel of this file): there a block's columns are all nine taps of 16
   channels, and each step of 32 output pixels copies its pixels' halo
   once instead of each tap's windows. */

#if MGPU_CUDA
/* The most positions a halo of a tile of `tn` pixels takes: a run of tn
   pixels ends at most ceil((tn - 1) / W) rows and as many images, and the
   base steps 1 from pixel to pixel, 2 more at the end of a row and 2 (W +
   2) more at the end of an image; then 2 (W + 2) + 3 for the last
   pixel's window. */
static int mgpu__conv_halo_positions(const mgpu__conv_geom *g, int tn) {
    int image = g->h * g->w, row_ends = (tn - 1 + g->w - 1) / g->w, image_ends = (tn - 1 + image - 1) / image;
    return tn - 1 + 2 * row_ends + 2 * (g->w + 2) * image_ends + 2 * (g->w + 2) + 3;
}
/* The shared memory of a block of the kernel below. */
static size_t mgpu__conv_halo_bytes(const mgpu__conv_geom *g, mgpu__implicit_tile tile) {
    int tm = mgpu__implicit_tile_rows[tile], tn = mgpu__implicit_tile_columns[tile];
    size_t steps = (size_t)MGPU__NHWC_STAGES * (tm + mgpu__conv_halo_positions(g, tn)) * (MGPU__NHWC_STEP + 4);
    size_t out = (size_t)MGPU__IMPLICIT_OUT_ROWS * (tn + 4); /* the finished tile on its way out */
    return 4 * (steps > out ? steps : out);
}
/* At most what an sm_80 block may ask for (163 KB): ResNet-18's 4x4
   images take 124 KB in the 128 x 128 tile, its wider ones less. */
#define MGPU__HALO_BYTES_MAX (160 << 10)
/* Whether the kernel computes conv(x, w) of geometry g in this tile: 3x3,
   stride 1, padding 1, whole steps of 32 channels, and a halo that fits. */
static int mgpu__conv_halo_fits(const mgpu__conv_geom *g, mgpu__implicit_tile tile) {
    return g->r == 3 && g->s == 3 && g->stride == 1 && g->pad == 1 && mgpu__conv_nhwc_fits(g) &&
           mgpu__conv_halo_bytes(g, tile) <= MGPU__HALO_BYTES_MAX;
}

/* The divisions both kernels below make often, as multiplications
   (mgpu__div): by the output's P Q and Q, and by the padded input's (H +
   2) (W + 2) and W + 2. */
typedef struct {
    mgpu__divisor image, row, padded_image, padded_row;
} mgpu__halo_divisors;
static mgpu__halo_divisors mgpu__halo_divisors_for(const mgpu__conv_geom *g) {
    mgpu__halo_divisors d = {mgpu__divisor_for(g->p * g->q), mgpu__divisor_for(g->q),
                             mgpu__divisor_for((g->h + 2) * (g->w + 2)), mgpu__divisor_for(g->w + 2)};
    return d;
}
/* Output pixel `pixel`'s base: the padded position of its window at tap
   (0, 0). */
static __device__ inline int mgpu__halo_base(const mgpu__conv_geom &g, const mgpu__halo_divisors &d, int pixel) {
    int img = mgpu__div(pixel, d.image), in_image = pixel - img * d.image.d, p = mgpu__div(in_image, d.row);
    return (img * (g.h + 2) + p) * (g.w + 2) + in_image - p * g.q;
}
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
/* Starts the copies of a halo: `span` padded positions from base0, each
   a row of ld floats at `to` (a shared address) of channels c0 .. c0 + 4
   CHUNKS - 1 of x_t, zeros in the padding; the block's threads each the
   same 16 bytes (chunk) of every (threads / CHUNKS)-th position, from L2
   alone (a block reads them once). */
template <int CHUNKS>
static __device__ void mgpu__halo_copy(mgpu__shared_address to, int ld, const float *x_t, const mgpu__conv_geom &g,
                                       const mgpu__halo_divisors &d, int base0, int span, int c0) {
    const int APART = MGPU__IMPLICIT_THREADS / CHUNKS;
    int chunk = threadIdx.x % CHUNKS, image_len = d.padded_image.d, row_len = d.padded_row.d;
    to += 4 * chunk * 4;
    for (int at = threadIdx.x / CHUNKS; at < span; at += APART) {
        int padded = base0 + at, img = mgpu__div(padded, d.padded_image), in_image = padded - img * image_len;
        int h = mgpu__div(in_image, d.padded_row), w = in_image - h * row_len;
        h -= 1, w -= 1; /* the padding's one pixel */
        bool inside = (unsigned)h < (unsigned)g.h && (unsigned)w < (unsigned)g.w;
        mgpu__copy_async16<MGPU__SKIP_L1>(to + 4 * at * ld,
                                          inside ? x_t + ((img * g.h + h) * g.w + w) * g.c + c0 + chunk * 4 : x_t,
                                          inside);
    }
}
#endif

/* y = conv(x_t, w_t) + b (a as conv_nhwc.h's kernel takes it, the sum
   whole): halo_rows rows a halo buffer. */
template <int TM, int TN>
static __global__ void __launch_bounds__(MGPU__IMPLICIT_THREADS, MGPU__NHWC_BLOCKS_PER_SM(TM, TN))
mgpu__conv_halo_kernel(mgpu__conv_nhwc_args a, int halo_rows, mgpu__halo_divisors d) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    typedef mgpu__nhwc_warp<TM, TN> W;
    const mgpu__conv_geom g = a.g;
    const int STEP = MGPU__NHWC_STEP, LD = STEP + 4, TAPS = 9, row_len = g.w + 2;
    float *shared = (float *)mgpu__dynamic_shared();
    mgpu__shared_address a_tiles = mgpu__shared_address_of(shared);
    mgpu__shared_address halos = a_tiles + 4 * MGPU__NHWC_STAGES * TM * LD;
    int npq = g.n * g.p * g.q, pixel0 = blockIdx.x * TN, last = (pixel0 + TN < npq ? pixel0 + TN : npq) - 1;
    auto base = [&](int pixel) { return mgpu__halo_base(g, d, pixel); };
    int base0 = base(pixel0), span = base(last) - base0 + 2 * row_len + 3;
    /* this lane's rows for ldmatrix, tiles 2j and 2j + 1: its pixel's
       window in the halo at tap 0 (a pixel past the end reads any row) */
    int window[W::NT / 2];
    for (int j = 0; j < W::NT / 2; j++) {
        int pixel = pixel0 + mgpu__nhwc_lane_pixel<TN>() + 16 * j;
        window[j] = pixel < npq ? base(pixel) - base0 : 0;
    }

    /* Starts the copies of a step: at its first tap, those of the halo
       of channels c0 .. c0 + 31 into halo buffer (c0 / 32) % 2; always
       the weights of the tap. */
    int tap = 0, c0 = 0;
    auto load = [&](int stage) {
        if (tap == 0)
            mgpu__halo_copy<STEP / 4>(halos + 4 * (c0 / STEP % 2) * halo_rows * LD, LD, a.x_t, g, d, base0, span, c0);
        mgpu__nhwc_load_weights<TM>(a, a_tiles, stage, tap, c0);
        if (++tap == TAPS) tap = 0, c0 += STEP;
    };

    typename W::acc acc = {};
    int multiplied = 0; /* steps */
    mgpu__shared_address lane_halos = halos + 4 * mgpu__nhwc_lane_channel();
    mgpu__nhwc_steps<MGPU__NHWC_STAGES>(TAPS * g.c / STEP, load, [&](int stage) {
        int run = multiplied / TAPS, at_tap = multiplied - run * TAPS, r = at_tap / 3, s = at_tap - 3 * r;
        mgpu__shared_address halo = lane_halos + 4 * ((run % 2) * halo_rows + r * row_len + s) * LD;
        mgpu__nhwc_multiply<TM, TN>(acc, a_tiles, stage, [&](int j) { return halo + 4 * window[j / 2] * LD; });
        multiplied++;
    });
    mgpu__nhwc_finish<TM, TN>(a, acc, (float(*)[TN + 4])shared, 0); /* (the sum whole) */
#endif
}

static void mgpu__conv_halo_cuda(const void *args, const mgpu__exec *ex) {
    mgpu__conv_nhwc_args a = *(const mgpu__conv_nhwc_args *)args;
    a.splits = 1; /* (the sum whole) */
    void (*kernel)(mgpu__conv_nhwc_args, int, mgpu__halo_divisors) =
        MGPU__IMPLICIT_INSTANCE(mgpu__conv_halo_kernel, a.tile);
    int bytes = (int)mgpu__conv_halo_bytes(&a.g, a.tile);
    MGPU_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    int halo_rows = mgpu__conv_halo_positions(&a.g, mgpu__implicit_tile_columns[a.tile]);
    dim3 grid = mgpu__implicit_grid(a.tile, (size_t)a.g.n * a.g.p * a.g.q, a.g.k, 1);
    cudaStream_t stream = (cudaStream_t)ex->stream;
    kernel<<<grid, MGPU__IMPLICIT_THREADS, bytes, stream>>>(a, halo_rows, mgpu__halo_divisors_for(&a.g));
    MGPU_CUDA_CHECK_LAUNCH();
}

/* ------------------------------------------------- the weight gradient */
/* dW of a 3x3 convolution at stride 1 and padding 1 from each step's
   halo (GPU only, TF32).

   conv_nhwc.h's weight gradient multiplies, a step of 32 output pixels
   at a time, TM filters of dy_t's rows by TN columns (r, s, c) of col,
   and copies col's tile anew at every step: for each column, the value
   of each pixel's window there. Where a block's columns take all nine
   taps of some channels, that is nine copies of nearly every input value
   it sums over. Here a block's columns are the nine taps of 16 channels
   (144 columns), and a step copies the halo of its 32 pixels once: the
   run of padded positions their windows lie in (as the forward kernel
   above does for a tile), about 100 positions for 28-wide images instead
   of 9 x 32 windows. The B fragment of tap (r, s) for a pixel is the
   halo's row at the pixel's base less the step's first, plus r (W + 2)
   + s; the pixels' rows are in a table of 32 that the step's copies
   write beside the halo.

   A block: 64 filters x 144 columns (its 2 x 2 warps each 32 x 72: 2 x 9
   tensor-core tiles, 72 accumulators a thread), three steps in flight,
   as conv_nhwc.h's weight gradient. Per step it copies 8 KB of dy_t and
   about 6 KB of halo (28-wide images) for 64 x 144 x 32 multiply-adds:
   20 a byte copied, where conv_nhwc.h's 64 x 128 tile copies 24 KB for
   64 x 128 x 32 (11 a byte), its 128 x 128 tile 32 KB for 128 x 128 x 32
   (16 a byte). On the H100 (bench/RESULTS.md) that kernel's forward twin
   was bound by those copies' trip from L2.

   Halo rows are 16 channels and 8 floats of padding (96 bytes): the four
   pixels t = 0..3 whose rows a fragment load reads (lane l: pixel l % 4,
   channel l / 4) are neighbours in the halo, except across the end of an
   image row, so their rows start on banks 0, 24, 16 and 8, and the 32
   lanes hit 32 banks (two ways where a row ends among them). The partial
   tiles' columns are in (c / 16, r, s, c % 16) order, a block's 144 one
   after the other; mgpu__wgrad_sum puts them in dw's (c, r, s) order.
   Slices of the sum over the pixels as conv_nhwc.h's (a.per pixels,
   whole steps). */
#define MGPU__HALO_DW_FILTERS 64 /* a block's rows */
#define MGPU__HALO_DW_RUN 16     /* a block's channels, at all nine taps: 144 columns */
#define MGPU__HALO_DW_LD (MGPU__HALO_DW_RUN + 8)
/* A step's rows of the halo: those of mgpu__conv_halo_positions for 32 pixels. */
static int mgpu__conv_halo_dw_rows(const mgpu__conv_geom *g) {
    return mgpu__conv_halo_positions(g, MGPU__NHWC_STEP);
}
/* The shared memory of a block: dy_t's tiles (as conv_nhwc.h's), the
   halos, and their tables of the pixels' rows, for each step in flight. */
static size_t mgpu__conv_halo_dw_bytes(const mgpu__conv_geom *g) {
    size_t step = (size_t)MGPU__NHWC_STEP * (MGPU__HALO_DW_FILTERS + 8) +
                  (size_t)mgpu__conv_halo_dw_rows(g) * MGPU__HALO_DW_LD + MGPU__NHWC_STEP;
    return 4 * MGPU__NHWC_DW_STAGES * step;
}
/* Three blocks' in sm_90's 227 KB of shared memory a multiprocessor,
   less the 1 KB a block that the GPU keeps: the 28-wide images' longest
   halos take 73.5 KB. */
#define MGPU__HALO_DW_BYTES_MAX ((227 << 10) / 3 - (1 << 10))
/* Whether the kernel computes dW of geometry g: 3x3, stride 1, padding 1,
   channels in runs of 16, filters in fours (conv_nhwc.h's copies of dy_t),
   and three blocks' halos in a multiprocessor's shared memory. */
static int mgpu__conv_halo_dw_fits(const mgpu__conv_geom *g) {
    return g->r == 3 && g->s == 3 && g->stride == 1 && g->pad == 1 && g->c % MGPU__HALO_DW_RUN == 0 &&
           g->k % 4 == 0 && (g->k + MGPU__HALO_DW_FILTERS - 1) / MGPU__HALO_DW_FILTERS < 65535 &&
           mgpu__conv_halo_dw_bytes(g) <= MGPU__HALO_DW_BYTES_MAX;
}
/* The slices of the pixels for about `blocks` blocks (as conv_nhwc.h's). */
static int mgpu__conv_halo_dw_splits(const mgpu__conv_geom *g, size_t blocks) {
    size_t tiles = (size_t)(g->k + MGPU__HALO_DW_FILTERS - 1) / MGPU__HALO_DW_FILTERS * (g->c / MGPU__HALO_DW_RUN);
    return mgpu__conv_wgrad_splits_of(g, tiles, blocks, 512);
}

/* dW (a as conv_nhwc.h's weight gradient takes it; its tile unused):
   halo_rows rows a halo. */
static __global__ void __launch_bounds__(MGPU__IMPLICIT_THREADS, 3)
mgpu__conv_halo_dw_kernel(mgpu__conv_nhwc_dw_args a, int halo_rows, mgpu__halo_divisors d) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    const int TM = MGPU__HALO_DW_FILTERS, TN = 9 * MGPU__HALO_DW_RUN, STEP = MGPU__NHWC_STEP;
    const int STAGES = MGPU__NHWC_DW_STAGES, LA = TM + 8, LH = MGPU__HALO_DW_LD;
    typedef mgpu__nhwc_warp<TM, TN> W;
    const mgpu__conv_geom g = a.g;
    /* shared memory: a [STAGES][STEP][LA], halos [STAGES][halo_rows][LH], rows [STAGES][STEP] */
    uint32_t *shared = (uint32_t *)mgpu__dynamic_shared();
    uint32_t (*a_steps)[STEP][LA] = (uint32_t(*)[STEP][LA])shared;
    uint32_t *halos = shared + STAGES * STEP * LA;
    int *rows = (int *)(halos + STAGES * halo_rows * LH);
    mgpu__shared_address a_tiles = mgpu__shared_address_of(shared), halo_tiles = mgpu__shared_address_of(halos);
    int tid = threadIdx.x, npq = g.n * g.p * g.q, c0 = blockIdx.x * MGPU__HALO_DW_RUN;
    /* this block's slice of the pixels: count of them from first */
    int first = blockIdx.z * a.per, count = first + a.per < npq ? a.per : npq - first, end = first + count;
    mgpu__nhwc_dy_rows<TM> dy_rows(a.dy_t, g.k, first, count);

    /* Starts the copies of the next step (32 pixels from `next`): dy_t's
       rows, the halo of their windows, and each pixel's row in it (the
       first's for a pixel past the slice: dy_t's zeros take its place) */
    int next = first;
    auto load = [&](int stage) {
        dy_rows.copy(a_tiles, stage, a.dy_t);
        int last = (next + STEP < end ? next + STEP : end) - 1;
        int base0 = mgpu__halo_base(g, d, next), span = mgpu__halo_base(g, d, last) - base0 + 2 * (g.w + 2) + 3;
        mgpu__halo_copy<MGPU__HALO_DW_RUN / 4>(halo_tiles + 4 * stage * halo_rows * LH, LH, a.x_t, g, d, base0, span,
                                               c0);
        if (tid < STEP) rows[stage * STEP + tid] = next + tid <= last ? mgpu__halo_base(g, d, next + tid) - base0 : 0;
        next += STEP;
    };

    /* This warp's 8-column tiles j: tap (j' / 2), channels (j' % 2) 8 .. + 7
       of the block's 144 columns (j' = j + 9 (warp % 2)), at the halo's
       offset tap_at[j] from a pixel's row, plus this lane's channel g. */
    int lane = tid % 32, warp = tid / 32, g_lane = lane / 4, t_lane = lane % 4;
    int tap_at[W::NT];
    for (int j = 0; j < W::NT; j++) {
        int column_tile = j + W::NT * (warp % 2), tap = column_tile / 2, r = tap / 3, s = tap - 3 * r;
        tap_at[j] = (r * (g.w + 2) + s) * LH + (column_tile % 2) * 8 + g_lane;
    }
    typename W::acc acc = {};
    mgpu__nhwc_steps<STAGES>((count + STEP - 1) / STEP, load, [&](int stage) {
        const uint32_t *halo = halos + stage * halo_rows * LH;
        const int *step_rows = rows + stage * STEP;
        mgpu__nhwc_dw_multiply<TM, TN>(acc, a_steps[stage], [&](int kk, uint32_t(&fb)[W::NT][2]) {
            const uint32_t *pixel = halo + step_rows[kk + t_lane] * LH;
            const uint32_t *pixel_4 = halo + step_rows[kk + t_lane + 4] * LH;
            for (int j = 0; j < W::NT; j++) fb[j][0] = pixel[tap_at[j]], fb[j][1] = pixel_4[tap_at[j]];
        });
    });

    /* the slice's tile straight from the accumulators to its partial */
    int crs = 9 * g.c;
    mgpu__nhwc_store_partial<TM, TN>(acc, a.partials + (size_t)blockIdx.z * g.k * crs, crs, g.k, crs);
#endif
}

static void mgpu__conv_halo_dw_cuda(const void *args, const mgpu__exec *ex) {
    const mgpu__conv_nhwc_dw_args *a = (const mgpu__conv_nhwc_dw_args *)args;
    int bytes = (int)mgpu__conv_halo_dw_bytes(&a->g);
    MGPU_CUDA_CHECK(
        cudaFuncSetAttribute(mgpu__conv_halo_dw_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    dim3 grid(a->g.c / MGPU__HALO_DW_RUN, (a->g.k + MGPU__HALO_DW_FILTERS - 1) / MGPU__HALO_DW_FILTERS, a->splits);
    cudaStream_t stream = (cudaStream_t)ex->stream;
    mgpu__conv_halo_dw_kernel<<<grid, MGPU__IMPLICIT_THREADS, bytes, stream>>>(*a, mgpu__conv_halo_dw_rows(&a->g),
                                                                               mgpu__halo_divisors_for(&a->g));
    MGPU_CUDA_CHECK_LAUNCH();
    mgpu__wgrad_sum_args sum = {a->dw, a->partials, a->beta, a->splits, a->g.k, a->g.c, 9, MGPU__HALO_DW_RUN};
    mgpu__wgrad_sum(sum, stream);
}
#endif
