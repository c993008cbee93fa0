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
   kernel is a candidate beside conv_nhwc.h's for every tile. */

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

/* y = conv(x_t, w_t) + b (a as conv_nhwc.h's kernel takes it, the sum
   whole): halo_rows rows a halo buffer; padded_image and padded_row
   divide by (H + 2) (W + 2) and W + 2. */
template <int TM, int TN>
static __global__ void __launch_bounds__(MGPU__IMPLICIT_THREADS, MGPU__NHWC_BLOCKS_PER_SM(TM, TN))
mgpu__conv_halo_kernel(mgpu__conv_nhwc_args a, int halo_rows, mgpu__divisor padded_image, mgpu__divisor padded_row) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    typedef mgpu__nhwc_warp<TM, TN> W;
    const mgpu__conv_geom g = a.g;
    const int STEP = MGPU__NHWC_STEP, LD = STEP + 4, CHUNKS = STEP / 4, APART = MGPU__IMPLICIT_THREADS / CHUNKS;
    const int TAPS = 9, row_len = g.w + 2, image_len = (g.h + 2) * row_len;
    float *shared = (float *)mgpu__dynamic_shared();
    mgpu__shared_address a_tiles = mgpu__shared_address_of(shared);
    mgpu__shared_address halos = a_tiles + 4 * MGPU__NHWC_STAGES * TM * LD;
    int tid = threadIdx.x, chunk = tid % CHUNKS, pq = g.p * g.q, npq = g.n * pq;
    int pixel0 = blockIdx.x * TN, last = (pixel0 + TN < npq ? pixel0 + TN : npq) - 1;
    auto base = [&](int pixel) {
        int img = pixel / pq, in_image = pixel - img * pq, p = in_image / g.q;
        return (img * (g.h + 2) + p) * row_len + in_image - p * g.q;
    };
    int base0 = base(pixel0), span = base(last) - base0 + 2 * row_len + 3;
    /* this lane's rows for ldmatrix, tiles 2j and 2j + 1: its pixel's
       window in the halo at tap 0 (a pixel past the end reads any row) */
    int window[W::NT / 2];
    for (int j = 0; j < W::NT / 2; j++) {
        int pixel = pixel0 + mgpu__nhwc_lane_pixel<TN>() + 16 * j;
        window[j] = pixel < npq ? base(pixel) - base0 : 0;
    }

    /* Starts the copies of a step: at its first tap, those of the halo
       of channels c0 .. c0 + 31 into halo buffer (c0 / 32) % 2, a thread
       the same 16 bytes of every 16th position (from L2 alone: a block
       reads them once); always the weights of the tap. */
    int tap = 0, c0 = 0;
    auto load = [&](int stage) {
        if (tap == 0) {
            mgpu__shared_address to = halos + 4 * ((c0 / STEP % 2) * halo_rows * LD + chunk * 4);
            for (int at = tid / CHUNKS; at < span; at += APART) {
                int padded = base0 + at, img = mgpu__div(padded, padded_image), in_image = padded - img * image_len;
                int h = mgpu__div(in_image, padded_row), w = in_image - h * row_len;
                h -= 1, w -= 1; /* the padding's one pixel */
                bool inside = (unsigned)h < (unsigned)g.h && (unsigned)w < (unsigned)g.w;
                mgpu__copy_async16<MGPU__SKIP_L1>(
                    to + 4 * at * LD, inside ? a.x_t + ((img * g.h + h) * g.w + w) * g.c + c0 + chunk * 4 : a.x_t,
                    inside);
            }
        }
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
    mgpu__nhwc_finish<TM, TN>(a, acc, (float(*)[TN + 4])shared);
#endif
}

static void mgpu__conv_halo_cuda(const void *args, const mgpu__exec *ex) {
    mgpu__conv_nhwc_args a = *(const mgpu__conv_nhwc_args *)args;
    a.splits = 1; /* (the sum whole) */
    void (*kernel)(mgpu__conv_nhwc_args, int, mgpu__divisor, mgpu__divisor) =
        MGPU__IMPLICIT_INSTANCE(mgpu__conv_halo_kernel, a.tile);
    int bytes = (int)mgpu__conv_halo_bytes(&a.g, a.tile);
    MGPU_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    int halo_rows = mgpu__conv_halo_positions(&a.g, mgpu__implicit_tile_columns[a.tile]);
    mgpu__divisor padded_image = mgpu__divisor_for((a.g.h + 2) * (a.g.w + 2));
    mgpu__divisor padded_row = mgpu__divisor_for(a.g.w + 2);
    dim3 grid = mgpu__implicit_grid(a.tile, (size_t)a.g.n * a.g.p * a.g.q, a.g.k, 1);
    cudaStream_t stream = (cudaStream_t)ex->stream;
    kernel<<<grid, MGPU__IMPLICIT_THREADS, bytes, stream>>>(a, halo_rows, padded_image, padded_row);
    MGPU_CUDA_CHECK_LAUNCH();
}
#endif
