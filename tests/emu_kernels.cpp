/* tests/emu_kernels.cpp: every CUDA kernel of kernels/ against its CPU
   reference, run on the CPU by tests/cuda_emu.h, so that `make test`
   checks the GPU code's indexing, launch configurations, reductions and
   cuBLAS arguments on a machine without a GPU. (On a GPU, tests/gpu_*.c
   compare the real kernels, at the chapters' sizes.)

   The sizes are small, as every CUDA thread is an OS thread here, but they
   cover the edges: windows that hang over the padding, strides 1 to 3,
   partial blocks and warps, reductions split over several blocks, ties.
   Outputs start as NaN, so an element a kernel fails to write is caught.

   Tolerances, relative to max(1, |CPU value|): copies and elementwise
   operations are exact (0); sums taken in another order 1e-5 (batch norm's
   input gradient 1e-4: a difference of two such sums). */
#include "cuda_emu.h"

/* What the kernels take from mgpu.h, which this program leaves out. */
#define MGPU__HOSTDEVICE
#define MGPU_CUDA_CHECK(call) do { if ((call) != cudaSuccess) mgpu_emu_fail(#call " failed"); } while (0)
#define MGPU_CUDA_CHECK_LAUNCH() do { } while (0) /* a bad launch has aborted already */
#define MGPU_CUBLAS_CHECK(call) do { if ((call) != CUBLAS_STATUS_SUCCESS) mgpu_emu_fail(#call " was refused"); } while (0)
__attribute__((noreturn)) static void mgpu_fatal(const char *fmt, ...) { mgpu_emu_fail(fmt); }
typedef struct mgpu__exec {
    int on_gpu;
    void *stream;
    void *cublas;
} mgpu__exec;
/* The fill kernels draw random numbers through mgpu.h's generator: any
   function of the same arguments will do, as the CPU reference calls the
   same one. */
static inline float mgpu__random_at(uint64_t key, uint64_t offset, uint64_t i, int normal) {
    return (float)((key + offset + i) % 1000) / 1000.0f - (normal ? 0.5f : 0.0f);
}

#include "kernels.h" /* the files of kernels/, their launches rewritten (Makefile) */
#include "test.h"

static unsigned emu_seed = 12345;
static float uniform() { /* in [-0.5, 0.5) */
    emu_seed = emu_seed * 1103515245u + 12345u;
    return (float)((emu_seed >> 8) & 0xffff) / 65536.0f - 0.5f;
}
static std::vector<float> random_values(size_t n, float shift = 0.0f, float scale = 1.0f) {
    std::vector<float> v(n);
    for (float &x : v) x = shift + scale * uniform();
    return v;
}
static std::vector<float> nans(size_t n) { return std::vector<float>(n, NAN); }

static const mgpu__exec on_gpu = {1, NULL, NULL}, on_cpu = {0, NULL, NULL};

/* max over i of |gpu - cpu| / max(1, |cpu|) <= tol; names the first element that is not */
static void same(const char *what, const std::vector<float> &gpu, const std::vector<float> &cpu,
                 double tol) {
    for (size_t i = 0; i < cpu.size(); i++) {
        double err = fabs((double)gpu[i] - cpu[i]), scale = fabs(cpu[i]) > 1 ? fabs(cpu[i]) : 1;
        if (!(err <= tol * scale) && !(isnan(gpu[i]) && isnan(cpu[i]))) {
            fprintf(stderr, "  %s: element %zu is %.9g on the GPU, %.9g on the CPU\n", what, i,
                    gpu[i], cpu[i]);
            test__failures++;
            return;
        }
    }
}

/* ---------------------------------------------------------- convolution */
TEST(im2col_col2im_and_layout_swap) {
    int cases = 0;
    for (int n = 1; n <= 2; n++)
        for (int h = 1; h <= 6; h += 5)
            for (int r = 1; r <= 4; r++) /* windows covered by up to 4 positions (col2im) */
                for (int stride = 1; stride <= 3; stride++)
                    for (int pad = 0; pad <= 2; pad++) {
                        int c = 2, w = h + 1, s = 5 - r; /* non-square images and kernels */
                        if (h + 2 * pad < r || w + 2 * pad < s) continue;
                        mgpu__conv_geom g = {n, c, h, w, 2, r, s, 0, 0, stride, pad};
                        g.p = (h + 2 * pad - r) / stride + 1;
                        g.q = (w + 2 * pad - s) / stride + 1;
                        size_t xs = (size_t)n * c * h * w, cs = (size_t)c * r * s * n * g.p * g.q;
                        std::vector<float> x = random_values(xs), col_c = nans(cs), col_g = nans(cs);
                        mgpu__im2col_args a = {x.data(), col_c.data(), g};
                        mgpu__im2col_cpu(&a, &on_cpu);
                        a.col = col_g.data();
                        mgpu__im2col_cuda(&a, &on_gpu);
                        same("im2col", col_g, col_c, 0);
                        std::vector<float> dcol = random_values(cs), dx_c = nans(xs), dx_g = nans(xs);
                        mgpu__col2im_args b = {dcol.data(), dx_c.data(), g, 0};
                        mgpu__col2im_cpu(&b, &on_cpu);
                        b.dx = dx_g.data();
                        mgpu__col2im_cuda(&b, &on_gpu);
                        same("col2im", dx_g, dx_c, 1e-5);
                        /* added to a gradient already there, on both */
                        std::vector<float> start = random_values(xs), sum = start, added_c = start, added_g = start;
                        for (size_t i = 0; i < xs; i++) sum[i] += dx_c[i];
                        b.accumulate = 1;
                        b.dx = added_c.data();
                        mgpu__col2im_cpu(&b, &on_cpu);
                        b.dx = added_g.data();
                        mgpu__col2im_cuda(&b, &on_gpu);
                        same("col2im added (CPU)", added_c, sum, 1e-5);
                        same("col2im added", added_g, sum, 1e-5);
                        cases++;
                    }
    CHECK(cases > 80);
    /* runs of 37 values a thread at a time, and of 36 in vectors of 4 */
    for (int with_bias = 0; with_bias <= 3; with_bias++) {
        int outer = 3, middle = 5;
        size_t inner = with_bias < 2 ? 37 : 36, total = outer * middle * inner;
        std::vector<float> in = random_values(total), bias = random_values(outer);
        std::vector<float> out_c = nans(total), out_g = nans(total);
        mgpu__swap_outer_args a = {out_c.data(), in.data(), outer, middle, inner,
                                   with_bias % 2 ? bias.data() : NULL};
        mgpu__swap_outer_cpu(&a, &on_cpu);
        a.out = out_g.data();
        mgpu__swap_outer_cuda(&a, &on_gpu);
        same(with_bias % 2 ? "swap with bias" : "swap", out_g, out_c, 0);
    }
}

/* The fast convolution kernels (TF32 on the tensor cores, but few
   inputs') against the CPU's im2col path: y, dx and dw. TF32 keeps 10 bits of mantissa: allowed
   2e-3 of the largest value (tests/gpu_layers.c says why). */
static void close_in_tf32(const char *name, const char *what, const std::vector<float> &gpu,
                          const std::vector<float> &cpu) {
    float largest = 1;
    for (float v : cpu) largest = fabsf(v) > largest ? fabsf(v) : largest;
    for (size_t i = 0; i < cpu.size(); i++)
        if (!(fabsf(gpu[i] - cpu[i]) <= 2e-3f * largest)) {
            fprintf(stderr, "  %s: %s[%zu] is %.7g, want %.7g\n", name, what, i, gpu[i], cpu[i]);
            test__failures++;
            return;
        }
}
/* in [outer, rows, cols] to [outer, cols, rows] in TF32 on the emulated GPU
   (the test below checks it against the CPU) */
static std::vector<float> channels_last(const std::vector<float> &in, int outer, int rows, int cols,
                                        int flip) {
    std::vector<float> out = nans(in.size());
    mgpu__channels_last_args a = {{out.data(), outer, rows, cols, flip}, in.data()};
    mgpu__channels_last_cuda(&a, &on_gpu);
    return out;
}
static int subpixel_cases; /* channels-last dx at stride > 1 checked, by classes alone */
static int stride2_cases;    /* and by the stride-2 dx kernel (3x3, stride 2, padding 1) */
static int wgmma_cases;    /* conv_nhwc.h's products by wgmma: y, dx at stride 1, dx's classes */
static int winograd_cases; /* Winograd's y, dx and dx added checked */
static int winograd_cpu_cases; /* the CPU's Winograd's y, dx and dW checked */
static int few_inputs_cases; /* conv_few_inputs.h's y and dW checked */
/* An r x s window (s = 0: r x r) */
static void implicit_case(int n, int c, int h, int w, int k, int r, int stride, int pad, int bias, int s = 0) {
    if (!s) s = r;
    mgpu__conv_geom g = {n, c, h, w, k, r, s, 0, 0, stride, pad};
    g.p = (h + 2 * pad - r) / stride + 1;
    g.q = (w + 2 * pad - s) / stride + 1;
    size_t pq = (size_t)g.p * g.q, crs = (size_t)c * r * s, ys = (size_t)n * k * pq;
    std::vector<float> x = random_values((size_t)n * c * h * w), wt = random_values(k * crs);
    std::vector<float> b = random_values(k), col = nans(crs * n * pq), prod = nans(k * n * pq);
    std::vector<float> y_c = nans(ys);
    mgpu__im2col_args im = {x.data(), col.data(), g};
    mgpu__im2col_cpu(&im, &on_cpu);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, k, (int)(n * pq), (int)crs, 1.0f,
                wt.data(), (int)crs, col.data(), (int)(n * pq), 0.0f, prod.data(), (int)(n * pq));
    mgpu__swap_outer_args swap = {y_c.data(), prod.data(), k, n, pq, bias ? b.data() : NULL};
    mgpu__swap_outer_cpu(&swap, &on_cpu);
    /* dx: the CPU's dcol = W^T G (G = dy as [K, n*P*Q]) and col2im */
    std::vector<float> dy = random_values(ys), gk = nans(ys), dx_c = nans(x.size());
    mgpu__swap_outer_args there = {gk.data(), dy.data(), n, k, pq, NULL};
    mgpu__swap_outer_cpu(&there, &on_cpu);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)crs, (int)(n * pq), k, 1.0f,
                wt.data(), (int)crs, gk.data(), (int)(n * pq), 0.0f, col.data(), (int)(n * pq));
    mgpu__col2im_args back = {col.data(), dx_c.data(), g, 0};
    mgpu__col2im_cpu(&back, &on_cpu);
    /* and dx added to a gradient already there (a residual block's) */
    std::vector<float> dx_start = random_values(x.size()), dx_sum_c = dx_start;
    for (size_t i = 0; i < x.size(); i++) dx_sum_c[i] += dx_c[i];
    /* dw = G col^T, on top of an existing gradient (beta 1) */
    mgpu__im2col_cpu(&im, &on_cpu);
    std::vector<float> dw_start = random_values(k * crs), dw_c = dw_start;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, k, (int)crs, (int)(n * pq), 1.0f,
                gk.data(), (int)(n * pq), col.data(), (int)(n * pq), 1.0f, dw_c.data(), (int)crs);
    /* conv_nhwc.h's kernel, where it fits: y from the channels-last copies
       of x and w; dx from those of dy and w' (flipped), as mgpu.h calls it */
    int rs = r * s;
    mgpu__conv_geom d = mgpu__conv_dx_geometry(&g);
    std::vector<float> x_t = channels_last(x, n, c, h * w, 0), w_t = channels_last(wt, k, c, rs, 0);
    std::vector<float> dy_t = channels_last(dy, n, k, (int)pq, 0), w_flipped = channels_last(wt, 1, k, c * rs, rs);
    for (int tile = 0; tile < MGPU__TILE_KINDS; tile++) {
        mgpu__implicit_tile kind = (mgpu__implicit_tile)tile;
        char name[128];
        snprintf(name, sizeof name, "channels-last conv %s n%d c%d %dx%d k%d %dx%d stride %d pad %d",
                 mgpu__implicit_tile_names[tile], n, c, h, w, k, r, s, stride, pad);
        /* by mma.sync, and in wgmma's tiles by wgmma too */
        for (int wgmma = 0; wgmma <= mgpu__wgmma_tile_fits(kind); wgmma++) {
            /* y and dx with the sum whole, and in 2 and in 3 slices (the last
               one shorter, or with fewer slices than asked when the steps run out) */
            for (int splits : {0, 2, 3}) {
                char sliced[160];
                snprintf(sliced, sizeof sliced, "%s%s, %d slices", name, wgmma ? " by wgmma" : "", splits);
                if (mgpu__conv_nhwc_fits(&g)) {
                    std::vector<float> y_g = nans(ys), partials = nans(mgpu__conv_nhwc_partial_floats(&g, splits));
                    mgpu__conv_nhwc_args a = {y_g.data(), x_t.data(), w_t.data(), bias ? b.data() : NULL, g, kind, {}, 0,
                                              splits, 0, partials.data(), wgmma};
                    mgpu__conv_nhwc_cuda(&a, &on_gpu);
                    close_in_tf32(sliced, "y", y_g, y_c);
                    wgmma_cases += wgmma;
                }
                /* (every value of dx written: NaN otherwise); then added to one there */
                for (int accumulate = 0; accumulate <= 1; accumulate++) {
                    std::vector<float> dx_g = accumulate ? dx_start : nans(x.size());
                    if (stride == 1 && mgpu__conv_nhwc_dx_fits(&g)) {
                        std::vector<float> partials = nans(mgpu__conv_nhwc_partial_floats(&d, splits));
                        mgpu__conv_nhwc_args a = {dx_g.data(), dy_t.data(), w_flipped.data(), NULL, d, kind, {},
                                                  accumulate, splits, 0, partials.data(), wgmma};
                        mgpu__conv_nhwc_cuda(&a, &on_gpu);
                        close_in_tf32(sliced, accumulate ? "dx added" : "dx", dx_g, accumulate ? dx_sum_c : dx_c);
                        wgmma_cases += wgmma;
                    }
                    if (stride > 1 && mgpu__conv_nhwc_subpixel_fits(&g)) { /* the sub-pixel classes */
                        dx_g = accumulate ? dx_start : nans(x.size());
                        std::vector<float> w_classes = nans(mgpu__conv_nhwc_subpixel_weight_floats(&g));
                        std::vector<float> partials = nans(mgpu__conv_nhwc_subpixel_partial_floats(&g, splits));
                        mgpu__conv_nhwc_subpixel_args a = {dx_g.data(), dy_t.data(), wt.data(), w_classes.data(), g,
                                                           kind, accumulate, splits, partials.data(), wgmma};
                        mgpu__conv_nhwc_subpixel_cuda(&a, &on_gpu);
                        subpixel_cases++;
                        wgmma_cases += wgmma;
                        close_in_tf32(sliced, accumulate ? "dx added" : "dx", dx_g, accumulate ? dx_sum_c : dx_c);
                    }
                    /* the stride-2 dx kernel (no tile, no slices: once) */
                    if (tile == 0 && !wgmma && splits == 0 && mgpu__conv_nhwc_stride2_dx_fits(&g)) {
                        dx_g = accumulate ? dx_start : nans(x.size());
                        mgpu__conv_nhwc_stride2_dx_args a = {dx_g.data(), dy_t.data(), w_flipped.data(), g, accumulate};
                        mgpu__conv_nhwc_stride2_dx_cuda(&a, &on_gpu);
                        stride2_cases++;
                        char label[96];
                        snprintf(label, sizeof label, "stride-2 dx n%d c%d %dx%d k%d", n, c, h, w, k);
                        close_in_tf32(label, accumulate ? "dx added" : "dx", dx_g, accumulate ? dx_sum_c : dx_c);
                    }
                }
            }
        }
        if (mgpu__conv_nhwc_dw_fits(&g)) {
            /* in the library's slices, and in one, and in slices of one step
               (the last one shorter unless the step divides n*P*Q) */
            mgpu__conv_nhwc_dw_args a = {NULL, NULL, dy_t.data(), x_t.data(), 1.0f, 0, 0, g, kind};
            mgpu__conv_nhwc_dw_slices(&a);
            int pixels = n * (int)pq;
            for (int per : {a.per, (pixels + 31) / 32 * 32, 32}) {
                std::vector<float> dw_g = dw_start;
                a.per = per, a.splits = (pixels + per - 1) / per;
                std::vector<float> partials = nans((size_t)a.splits * k * crs);
                a.dw = dw_g.data(), a.partials = partials.data();
                mgpu__conv_nhwc_dw_cuda(&a, &on_gpu);
                close_in_tf32(name, "dw", dw_g, dw_c);
            }
        }
    }
    /* winograd.h's, where it fits: y from x_t, dx from dy_t with the
       weights turned, overwriting dx and adding to it */
    char name[128];
    snprintf(name, sizeof name, "Winograd n%d c%d %dx%d k%d stride %d pad %d", n, c, h, w, k, stride, pad);
    auto winograd = [&](const mgpu__conv_geom &wg, const std::vector<float> &in_t, int turned,
                        std::vector<float> &out, int accumulate) {
        size_t tiles = mgpu__winograd_tiles(&wg);
        std::vector<float> v = nans(16 * tiles * wg.c), u = nans(16 * (size_t)wg.c * wg.k);
        std::vector<float> m = nans(16 * tiles * wg.k);
        mgpu__winograd_args a = {out.data(), in_t.data(), wt.data(), turned || !bias ? NULL : b.data(),
                                 v.data(), u.data(), m.data(), wg, turned, accumulate};
        mgpu__winograd_cuda(&a, &on_gpu);
        winograd_cases++;
    };
    /* and the CPU's, in float32 on the NCHW tensors */
    auto winograd_cpu = [&](const mgpu__conv_geom &wg, const std::vector<float> &in, int turned,
                            std::vector<float> &out, int accumulate) {
        size_t floats[3];
        mgpu__winograd_cpu_floats(&wg, floats);
        std::vector<float> v = nans(floats[0]), u = nans(floats[1]), m = nans(floats[2]);
        mgpu__winograd_cpu_args a = {out.data(), in.data(), wt.data(), turned || !bias ? NULL : b.data(),
                                     v.data(), u.data(), m.data(), wg, turned, accumulate};
        mgpu__winograd_cpu(&a, &on_cpu);
    };
    if (mgpu__winograd_fits(&g)) {
        std::vector<float> y_g = nans(ys);
        winograd(g, x_t, 0, y_g, 0);
        close_in_tf32(name, "y", y_g, y_c);
    }
    if (stride == 1 && mgpu__winograd_fits(&d)) {
        std::vector<float> dx_g = nans(x.size());
        winograd(d, dy_t, 1, dx_g, 0);
        close_in_tf32(name, "dx", dx_g, dx_c);
        dx_g = dx_start;
        winograd(d, dy_t, 1, dx_g, 1);
        close_in_tf32(name, "dx added", dx_g, dx_sum_c);
    }
    /* the CPU's, where it fits (any C), in float32 on the NCHW tensors: y
       written, dx and dW written and added to */
    char cpu_name[160];
    snprintf(cpu_name, sizeof cpu_name, "%s, CPU", name);
    if (mgpu__winograd_cpu_fits_layer(&g)) {
        std::vector<float> y_cpu = nans(ys), dx_cpu = nans(x.size());
        winograd_cpu(g, x, 0, y_cpu, 0);
        same(cpu_name, y_cpu, y_c, 1e-5);
        winograd_cpu(d, dy, 1, dx_cpu, 0);
        same(cpu_name, dx_cpu, dx_c, 1e-5);
        dx_cpu = dx_start;
        winograd_cpu(d, dy, 1, dx_cpu, 1);
        same(cpu_name, dx_cpu, dx_sum_c, 1e-5);
        size_t floats[3];
        mgpu__winograd_cpu_floats(&g, floats);
        std::vector<float> v = nans(floats[0]), du = nans(floats[1]), e = nans(floats[2]);
        std::vector<float> dw_alone_c = dw_c;
        for (size_t i = 0; i < dw_c.size(); i++) dw_alone_c[i] -= dw_start[i];
        for (int accumulate = 0; accumulate <= 1; accumulate++) {
            std::vector<float> dw_cpu = accumulate ? dw_start : nans(dw_c.size());
            mgpu__winograd_dw_cpu_args a = {dw_cpu.data(), x.data(), dy.data(), v.data(), du.data(), e.data(), g,
                                            accumulate};
            mgpu__winograd_dw_cpu(&a, &on_cpu);
            same(cpu_name, dw_cpu, accumulate ? dw_c : dw_alone_c, 1e-5);
        }
        winograd_cpu_cases++;
    }
    /* conv_few_inputs.h's, where it fits, in float32: y; dW in the
       library's slices of the pixels, in one and in 3, written and added
       to a gradient there */
    if (mgpu__conv_few_inputs_fits(&g)) {
        snprintf(name, sizeof name, "few inputs n%d c%d %dx%d k%d r%d stride %d pad %d: y", n, c, h, w, k, r,
                 stride, pad);
        std::vector<float> y_g = nans(ys), dw_alone_c = dw_c;
        mgpu__conv_few_inputs_args a = {y_g.data(), x.data(), wt.data(), bias ? b.data() : NULL, g};
        mgpu__conv_few_inputs_cuda(&a, &on_gpu);
        same(name, y_g, y_c, 1e-5);
        for (size_t i = 0; i < dw_c.size(); i++) dw_alone_c[i] -= dw_start[i];
        for (int slices : {mgpu__conv_few_inputs_slices(&g), 1, 3})
            for (int accumulate = 0; accumulate <= 1; accumulate++) {
                std::vector<float> dw_g = accumulate ? dw_start : nans(dw_c.size());
                std::vector<float> partials = nans((size_t)slices * k * crs);
                mgpu__conv_few_inputs_wgrad_args wg = {dw_g.data(), dy.data(), x.data(), partials.data(),
                                                       accumulate ? 1.0f : 0.0f, slices, g};
                mgpu__conv_few_inputs_wgrad_cuda(&wg, &on_gpu);
                snprintf(name, sizeof name, "few inputs n%d c%d %dx%d k%d r%d stride %d pad %d: dW%s, %d slices", n,
                         c, h, w, k, r, stride, pad, accumulate ? " added" : "", slices);
                same(name, dw_g, accumulate ? dw_c : dw_alone_c, 1e-5);
                /* the CPU's kernel, in the same slices */
                std::vector<float> dw_cpu = accumulate ? dw_start : nans(dw_c.size());
                std::vector<float> lanes = nans((size_t)slices * k * crs * MGPU__FEW_LANES);
                wg.dw = dw_cpu.data(), wg.partials = lanes.data();
                mgpu__conv_few_inputs_wgrad_cpu(&wg, NULL);
                snprintf(name, sizeof name, "few inputs n%d c%d %dx%d k%d r%d stride %d pad %d: CPU dW%s, %d slices",
                         n, c, h, w, k, r, stride, pad, accumulate ? " added" : "", slices);
                same(name, dw_cpu, accumulate ? dw_c : dw_alone_c, 1e-5);
            }
        few_inputs_cases++;
    }
}
/* Channels too few for conv_nhwc.h's steps of 32: conv_few_inputs.h's
   kernels, Winograd and the channels-last dW (C and K in fours) where
   they fit. */
TEST(few_channels_convolution) {
    few_inputs_cases = winograd_cpu_cases = 0; /* count this test's own cases, whichever test ran before */
    /* N  C  H  W   K  R  t  d  bias: partial tiles of filters, pixels and (c, r, s) */
    implicit_case(1, 1, 6, 6, 3, 3, 1, 1, 1);
    implicit_case(2, 3, 7, 5, 70, 3, 2, 1, 0);
    implicit_case(1, 5, 9, 9, 4, 1, 2, 0, 1);
    implicit_case(3, 2, 8, 8, 5, 3, 1, 0, 1);
    implicit_case(1, 70, 5, 5, 6, 3, 2, 2, 0); /* more than one tile of input channels */
    implicit_case(2, 3, 10, 9, 130, 3, 1, 1, 1); /* more than one tile of 128 filters and pixels */
    implicit_case(1, 130, 4, 4, 5, 1, 1, 0, 0);  /* ... and of 128 input channels */
    /* conv_few_inputs.h's (C*R*S <= 9): above, the first and third; and
       more pixels than a block's threads, more filters than a group's */
    implicit_case(3, 1, 20, 19, 20, 3, 1, 1, 1);
    implicit_case(2, 1, 11, 13, 9, 3, 2, 0, 0);
    CHECK_EQ_INT(few_inputs_cases, 4);
    CHECK_EQ_INT(winograd_cpu_cases, 4); /* the CPU's Winograd: the 3x3 stride-1 cases, any C */
}
/* conv_nhwc.h's kernel (through implicit_case): C, and for dx K, multiples
   of its 32-channel step; partial tiles of filters and pixels, windows
   over the padding, strides 1 and 2, 1x1, steps over several (r, s) */
TEST_LONG(channels_last_convolution) {
    /* this test's own cases only */
    subpixel_cases = stride2_cases = wgmma_cases = winograd_cases = winograd_cpu_cases = 0;
    /* N  C   H  W   K  R  t  d  bias (and dW, which needs only C and K in fours) */
    implicit_case(2, 32, 5, 6, 32, 3, 1, 1, 1);  /* y, dx and dW */
    implicit_case(1, 64, 7, 7, 70, 3, 1, 2, 0);  /* no dx or dW (K), 2 tiles of 64 filters */
    implicit_case(2, 32, 9, 9, 64, 3, 2, 1, 1);  /* stride 2: dx in 4 classes of 5 or 4 rows and columns */
    implicit_case(2, 32, 9, 9, 32, 3, 2, 1, 0);  /* K = 32: a class of one step, whole beside sliced ones */
    implicit_case(1, 96, 4, 4, 32, 1, 2, 0, 0);  /* 1x1, stride 2: 3 classes without taps (zeros) */
    implicit_case(2, 32, 8, 7, 96, 3, 2, 1, 0);  /* stride 2, H even and W odd, 3 steps a tap */
    implicit_case(2, 32, 6, 6, 32, 2, 2, 0, 1);  /* 2x2 windows, stride 2: one tap a class */
    /* stride 3: 9 classes, in launches of 4, 4 and 1, of 80, 60 and 45
       pixels: 2 tiles of 64 for some, 1 for others */
    implicit_case(5, 32, 11, 11, 32, 3, 3, 0, 0);
    /* 5x4, stride 2: no sub-pixel classes (the column classes' pads, 1
       and 0, differ) */
    implicit_case(2, 32, 9, 8, 32, 5, 2, 1, 0, 4);
    implicit_case(3, 32, 9, 10, 130, 3, 1, 0, 1); /* more than one tile of 128 filters and pixels */
    implicit_case(2, 64, 6, 6, 36, 3, 1, 1, 0);  /* dW: several tiles of 128 (r, s, c), 2 positions a tile */
    implicit_case(1, 32, 3, 3, 64, 3, 1, 1, 0);  /* dx with K = 64: two steps a window position */
    implicit_case(2, 12, 6, 5, 8, 3, 2, 1, 0);   /* dW only: (r, s) changing within a row of b */
    implicit_case(3, 4, 5, 5, 132, 1, 1, 0, 1);  /* dW only: more than one tile of 128 filters, 1x1 */
    /* 3 runs of 32 channels; tiles that start and end within rows and
       images */
    implicit_case(3, 96, 7, 5, 96, 3, 1, 1, 1);
    implicit_case(2, 32, 11, 13, 32, 3, 1, 1, 0);
    implicit_case(1, 16, 28, 28, 8, 3, 1, 1, 0); /* dW only: stage 1's 28-wide rows */
    /* dx at stride 2 only (C = 70): for the stride-2 dx kernel, 2 tiles of 64 channels
       of dx (the second partial) and of 64 pixels of dy (6 x 6 in each of
       3 images), H and W odd */
    implicit_case(3, 70, 11, 11, 32, 3, 2, 1, 0);
    /* in 3 slicings, overwriting dx and adding to it; in every tile by
       mma.sync, and in 2 by wgmma too */
    CHECK(subpixel_cases == 3 * 2 * 7 * (MGPU__TILE_KINDS + 2));
    CHECK(stride2_cases == 4 * 2); /* the 4 cases of 3x3 windows at stride 2 and padding 1, K in 32s; both ways */
    /* by wgmma, in its 2 tiles and 3 slicings: y of the 14 cases with C in
       32s, dx of the 4 at stride 1 with K in 32s (over dx and added),
       and the sub-pixel classes (7 cases), both ways */
    CHECK(wgmma_cases == 2 * 3 * (14 + 4 * 2 + 7 * 2));
    CHECK(mgpu__wgmma_built((cudaStream_t)on_gpu.stream) == 1); /* (the emulator runs them) */
    CHECK(winograd_cases == 8 + 6 * 2); /* y of the 3x3 stride-1 cases with C in fours, and dx where K is */
    CHECK_EQ_INT(winograd_cpu_cases, 8); /* the CPU's: every 3x3 stride-1 case */
    mgpu__conv_geom unpadded = {1, 32, 9, 9, 32, 3, 3, 4, 4, 2, 0};
    CHECK(!mgpu__conv_nhwc_dx_fits(&unpadded)); /* pad' 1 for even rows, 0 for odd ones */
}

/* The stride-2 dx kernel alone, against dx straight from its definition (in double:
   dx[h, w] sums w[k, c, r, s] dy[k, p, q] over the (p, r) with 2p + r - 1
   = h and the (q, s) with 2q + s - 1 = w), written over NaNs and added
   to a gradient there, with guard floats on both sides of dx that must
   stay as they were (the emulator has no bounds checks of its own).
   Shapes the convolution tests above do not cover: H odd and W even, two
   whole tiles of 64 channels, fewer channels than a tile, a 1 x 1 image,
   a row of dy longer than a block's 64 pixels. */
static void stride2_case(int n, int c, int h, int w, int k) {
    mgpu__conv_geom g = {n, c, h, w, k, 3, 3, (h - 1) / 2 + 1, (w - 1) / 2 + 1, 2, 1};
    size_t pq = (size_t)g.p * g.q, xs = (size_t)n * c * h * w;
    std::vector<float> wt = random_values((size_t)k * c * 9), dy = random_values(n * k * pq);
    std::vector<float> want(xs), start = random_values(xs);
    for (int img = 0; img < n; img++)
        for (int ch = 0; ch < c; ch++)
            for (int y = 0; y < h; y++)
                for (int x = 0; x < w; x++) {
                    double sum = 0;
                    for (int r = 0; r < 3; r++)
                        for (int s = 0; s < 3; s++) {
                            int p = (y + 1 - r) / 2, q = (x + 1 - s) / 2; /* (where 2 divides them) */
                            if ((y + 1 - r) % 2 || (x + 1 - s) % 2 || p < 0 || p >= g.p || q < 0 || q >= g.q) continue;
                            for (int f = 0; f < k; f++)
                                sum += (double)wt[((size_t)f * c + ch) * 9 + r * 3 + s] *
                                       dy[(((size_t)img * k + f) * g.p + p) * g.q + q];
                        }
                    want[(((size_t)img * c + ch) * h + y) * w + x] = (float)sum;
                }
    std::vector<float> dy_t = channels_last(dy, n, k, (int)pq, 0), w_turned = channels_last(wt, 1, k, c * 9, 9);
    const size_t GUARD = 4096;
    const float UNTOUCHED = 12345.0f;
    for (int accumulate = 0; accumulate <= 1; accumulate++) {
        std::vector<float> memory(GUARD + xs + GUARD, UNTOUCHED);
        for (size_t i = 0; i < xs; i++) memory[GUARD + i] = accumulate ? start[i] : NAN;
        mgpu__conv_nhwc_stride2_dx_args a = {memory.data() + GUARD, dy_t.data(), w_turned.data(), g, accumulate};
        mgpu__conv_nhwc_stride2_dx_cuda(&a, &on_gpu);
        std::vector<float> got(memory.begin() + GUARD, memory.begin() + GUARD + xs), expected = want;
        for (size_t i = 0; accumulate && i < xs; i++) expected[i] += start[i];
        char name[96];
        snprintf(name, sizeof name, "stride-2 dx n%d c%d %dx%d k%d%s", n, c, h, w, k, accumulate ? ", added" : "");
        close_in_tf32(name, "dx", got, expected);
        size_t overwritten = 0;
        for (size_t i = 0; i < GUARD; i++)
            overwritten += (memory[i] != UNTOUCHED) + (memory[GUARD + xs + i] != UNTOUCHED);
        if (overwritten) fprintf(stderr, "  %s: %zu floats outside dx written\n", name, overwritten);
        CHECK(overwritten == 0);
    }
}
TEST(stride2_dx_against_the_definition) {
    stride2_case(2, 32, 7, 8, 32);    /* H odd, W even */
    stride2_case(3, 128, 14, 14, 64); /* 2 whole tiles of channels; 147 pixels of dy */
    stride2_case(1, 5, 1, 1, 32);     /* a 1 x 1 image: dy 1 x 1, only class (0, 0) inside dx */
    stride2_case(2, 3, 2, 3, 32);     /* 3 channels of a tile's 64 */
    stride2_case(1, 64, 2, 129, 32);  /* a row of dy 65 pixels long */
    stride2_case(3, 70, 11, 11, 32);  /* (as in channels_last_convolution: a partial tile of each) */
}

/* The sub-pixel products' order (most taps first, so that a launch
   starts its longest blocks first): each class once, the taps never
   rising, classes of equal taps in their own order. */
static std::vector<int> subpixel_taps(int h, int r, int stride, int pad, std::vector<int> *classes) {
    mgpu__conv_geom g = {2, 32, h, h, 32, r, r, 0, 0, stride, pad};
    g.p = (h + 2 * pad - r) / stride + 1, g.q = g.p;
    std::vector<int> taps;
    for (int i = 0; i < mgpu__subpixel_products(&g); i++) {
        mgpu__subpixel_class k = mgpu__subpixel_product(&g, i);
        taps.push_back(k.g.r * k.g.s);
        classes->push_back(k.out.row * stride + k.out.col);
    }
    return taps;
}
TEST(subpixel_products_longest_first) {
    std::vector<int> classes;
    CHECK(subpixel_taps(9, 3, 2, 1, &classes) == std::vector<int>({4, 2, 2, 1})); /* ResNet's 3x3 at stride 2 */
    CHECK(classes == std::vector<int>({3, 1, 2, 0}));
    classes.clear();
    CHECK(subpixel_taps(8, 1, 2, 0, &classes) == std::vector<int>({1, 0, 0, 0})); /* 1x1: 3 without taps */
    CHECK(classes == std::vector<int>({0, 1, 2, 3}));
    classes.clear();
    /* 5x5 at stride 3 and padding 1: 2, 1 and 2 taps in each dimension */
    CHECK(subpixel_taps(11, 5, 3, 1, &classes) == std::vector<int>({4, 4, 4, 4, 2, 2, 2, 2, 1}));
    CHECK(classes == std::vector<int>({0, 2, 6, 8, 1, 3, 5, 7, 4}));
}

/* The channels-last copies: every element where it belongs, rounded to
   TF32 as the CPU rounds (exact), with and without the flip, over
   partial 32 x 32 tiles and several matrices; in vectors of 4 (rows and
   columns multiples of 4, no flip) over partial 64 x 64 tiles; and a
   thread a row, where rows are shorter than 16 (7, 9 and 4 here). */
TEST(channels_last_copy) {
    int shapes[][4] = {{3, 5, 7, 0}, {2, 33, 65, 0}, {1, 40, 45, 9}, {70, 3, 9, 9},
                       {3, 68, 132, 0}, {2, 64, 16, 0}, {1, 8, 4, 4}};
    for (auto &sh : shapes) {
        int outer = sh[0], rows = sh[1], cols = sh[2], flip = sh[3];
        std::vector<float> in = random_values((size_t)outer * rows * cols), out_c = nans(in.size());
        mgpu__channels_last_args a = {{out_c.data(), outer, rows, cols, flip}, in.data()};
        mgpu__channels_last_cpu(&a, &on_cpu);
        same("channels-last copy", channels_last(in, outer, rows, cols, flip), out_c, 0);
        /* and the CPU's by hand, for one element: in[o][i][j] -> out[o][j'][i] */
        int o = outer - 1, i = rows - 1, j = 1, jj = flip ? j - j % flip + flip - 1 - j % flip : j;
        CHECK(out_c[((size_t)o * cols + jj) * rows + i] ==
              mgpu_emu_tf32(in[((size_t)o * rows + i) * cols + j]));
    }
}

/* Many copies in one launch (a network's weights): each exactly as when
   copied alone, over lists of 1 and of MGPU__COPIES_MAX copies of
   matrices with partial tiles, flipped or not, one or several of them;
   the list of 1 by rows alone, the long one by both kinds, interleaved. */
TEST(channels_last_copies_in_one_launch) {
    int shapes[][4] = {{64, 32, 9, 0}, {1, 64, 288, 9}, {3, 33, 65, 0}, {2, 40, 45, 9}, {5, 7, 1, 0}};
    for (int count : {1, MGPU__COPIES_MAX}) {
        std::vector<std::vector<float>> ins, outs;
        mgpu__channels_last_list_args list = {};
        for (int c = 0; c < count; c++) {
            int *sh = shapes[c % 5];
            ins.push_back(random_values((size_t)sh[0] * sh[1] * sh[2]));
            outs.push_back(nans(ins.back().size()));
        }
        for (int c = 0; c < count; c++) {
            int *sh = shapes[c % 5];
            mgpu__channels_last_args a = {{outs[c].data(), sh[0], sh[1], sh[2], sh[3]}, ins[c].data()};
            CHECK(mgpu__channels_last_list_add(&list, a) == (c == MGPU__COPIES_MAX - 1));
        }
        mgpu__channels_last_list_cuda(&list, &on_gpu);
        for (int c = 0; c < count; c++) {
            int *sh = shapes[c % 5];
            same("a list's channels-last copy", outs[c], channels_last(ins[c], sh[0], sh[1], sh[2], sh[3]), 0);
            std::fill(outs[c].begin(), outs[c].end(), NAN); /* (in place: the list points there) */
        }
        mgpu__channels_last_list_cpu(&list, &on_cpu); /* the CPU's, into the same outputs */
        for (int c = 0; c < count; c++) {
            int *sh = shapes[c % 5];
            std::vector<float> alone = channels_last(ins[c], sh[0], sh[1], sh[2], sh[3]);
            same("a list's channels-last copy (CPU)", outs[c], alone, 0);
        }
    }
}

/* The implicit GEMMs' division by multiplying (mgpu__div) against the
   CPU's division: every divisor to 3000 and divisors near powers of two
   up to 2^31 - 1, each with dividends near 0, near multiples of the
   divisor, near 2^31 - 1 and random ones. */
TEST(division_by_multiplying) {
    std::vector<int> divisors;
    for (int d = 1; d <= 3000; d++) divisors.push_back(d);
    for (int b = 12; b <= 31; b++)
        for (long long e = -1; e <= 1; e++) {
            long long d = (1LL << b) + e;
            if (d <= INT32_MAX) divisors.push_back((int)d);
        }
    uint64_t state = 12345;
    auto next = [&] { state = state * 6364136223846793005ULL + 1442695040888963407ULL; return (int)(state >> 33); };
    long long wrong = 0;
    for (int d : divisors) {
        mgpu__divisor v = mgpu__divisor_for(d);
        std::vector<long long> ns;
        for (long long n = 0; n < 64; n++) ns.push_back(n);
        for (long long m = 1; m <= 5; m++)
            for (long long e = -1; e <= 1; e++) ns.push_back(m * d + e);
        for (long long e = 0; e < 4; e++) ns.push_back(INT32_MAX - e);
        for (long long e = -1; e <= 0; e++) ns.push_back((long long)(INT32_MAX / d) * d + e);
        for (int i = 0; i < 200; i++) ns.push_back(next());
        for (long long n : ns) {
            if (n < 0 || n > INT32_MAX) continue;
            int got = mgpu__div((int)n, v), want = (int)(n / d);
            if (got != want && wrong++ < 5)
                fprintf(stderr, "  %lld / %d: %d, want %d\n", n, d, got, want);
        }
    }
    CHECK_EQ_INT((int)wrong, 0);
}

/* cuBLAS's arguments for the four transpose combinations, an empty inner
   dimension and beta 0 over NaN (tests/cuda_emu.h refuses what cuBLAS would). */
/* In float32 and in TF32 (inputs rounded to 10 bits of mantissa: each
   of the 5 products of values below 0.5 off by at most 2^-11 / 4). */
TEST(gemm_arguments_for_cublas) {
    for (int tf32 = 0; tf32 <= 1; tf32++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++)
                for (int k = 0; k <= 5; k += 5)
                    for (int beta = 0; beta <= 1; beta++) {
                        int m = 3, n = 4;
                        std::vector<float> a = random_values(m * 5 + 1), b = random_values(5 * n + 1);
                        std::vector<float> c_c = beta ? random_values(m * n) : nans(m * n), c_g = c_c;
                        mgpu__gemm_args g = mgpu__gemm_dense(ta, tb, m, n, k, a.data(), b.data(),
                                                             c_c.data(), (float)beta, tf32);
                        mgpu__gemm_cpu(&g, &on_cpu);
                        g.c = c_g.data();
                        mgpu__gemm_cuda(&g, &on_gpu);
                        same(tf32 ? "gemm, TF32" : "gemm", c_g, c_c, tf32 ? 2e-3 : 1e-6);
                    }
}

/* ------------------------------------------- pooling, bias, channel sums */
TEST(pooling) {
    for (int h = 4; h <= 9; h += 5)
        for (int k = 1; k <= 3; k++) {
            int planes = 3, w = h - 1; /* the layer wants H, W >= k */
            size_t xs = (size_t)planes * h * w, ys = (size_t)planes * (h / k) * (w / k);
            std::vector<float> x = random_values(xs), y_c = nans(ys), y_g = nans(ys);
            mgpu__avg_pool_args a = {y_c.data(), x.data(), ys, h, w, k};
            mgpu__avg_pool_cpu(&a, &on_cpu);
            a.y = y_g.data();
            mgpu__avg_pool_cuda(&a, &on_gpu);
            same("avg pool", y_g, y_c, 0);
            std::vector<float> dx_c = nans(xs), dx_g = nans(xs);
            mgpu__avg_pool_backward_args b = {dx_c.data(), y_c.data(), xs, h, w, k};
            mgpu__avg_pool_backward_cpu(&b, &on_cpu);
            b.dx = dx_g.data();
            mgpu__avg_pool_backward_cuda(&b, &on_gpu);
            same("avg pool backward", dx_g, dx_c, 0);
        }
}

TEST(channel_broadcast_and_sums) {
    /* outer, channels, inner: a thread per channel (at most 64 values: the
       first four and the last two), one block per channel, and sums split
       over several blocks per channel (mgpu__chan_sum_splits > 1) */
    static const int shapes[][3] = {{1, 3, 16}, {4, 2, 1}, {3, 2, 37}, {40, 3, 1},
                                    {9, 3, 1000}, {10, 1, 2900}, {12, 1, 4096},
                                    {2, 5, 32}, {1, 2, 65}, {1, 600, 16}};
    int split_cases = 0;
    for (const auto &d : shapes)
        for (int beta = 0; beta <= 1; beta++) {
            int outer = d[0], channels = d[1];
            size_t inner = d[2], total = (size_t)outer * channels * inner;
            std::vector<float> x = random_values(total), v = random_values(channels);
            std::vector<float> y_c = beta ? random_values(total) : nans(total), y_g = y_c;
            mgpu__chan_broadcast_args a = {y_c.data(), v.data(), outer, channels, inner, 0.5f,
                                           (float)beta};
            mgpu__chan_broadcast_cpu(&a, &on_cpu);
            a.y = y_g.data();
            mgpu__chan_broadcast_cuda(&a, &on_gpu);
            same("broadcast", y_g, y_c, 0);

            int splits = mgpu__chan_sum_splits(outer, channels, inner);
            split_cases += splits > 1;
            std::vector<float> s_c = beta ? random_values(channels) : nans(channels), s_g = s_c;
            std::vector<float> partials = nans((size_t)channels * splits);
            mgpu__chan_sum_args b = {s_c.data(), x.data(), outer, channels, inner, 0.25f,
                                     (float)beta, NULL, 1};
            mgpu__chan_sum_cpu(&b, &on_cpu);
            b.out = s_g.data();
            b.partials = partials.data();
            b.splits = splits;
            mgpu__chan_sum_cuda(&b, &on_gpu);
            same("channel sum", s_g, s_c, 1e-5);
        }
    CHECK(split_cases >= 6);
}

/* ---------------------------------------------------------- batch norm */
/* v [n, c, hw] channels-last and in TF32, by the CPU's plain copy */
static std::vector<float> channels_last_cpu(const std::vector<float> &v, int n, int c, int hw) {
    std::vector<float> out = nans(v.size());
    mgpu__channels_last_args a = {{out.data(), n, c, hw, 0}, v.data()};
    mgpu__channels_last_cpu(&a, &on_cpu);
    return out;
}
/* relu 0: batch norm alone; 1: with the fused ReLU; 2: the residual
   block's max(bn(x) + skip, 0), whose backward is batch norm's with the
   block's end (block_end_backward). Each also with y written
   channels-last beside y or alone (y_t), and dx channels-last instead of
   dx (dx_t): exactly the TF32 copies of the y and dx that each device
   computes without them, and dx left alone. */
static void block_end_backward(const mgpu__bn_backward_args &plain, const std::vector<float> &out,
                               double sum_tol);
/* The counters of finished slices, as a device keeps them: 0 before every
   kernel, and back to 0 after (every call below uses the same ones). */
static std::vector<unsigned> bn_done(600);
static void check_bn_done_reset(void) {
    for (unsigned v : bn_done) CHECK_EQ_INT(v, 0);
}
static void batchnorm_case(int n, int c, int hw) {
    size_t total = (size_t)n * c * hw;
    int splits = mgpu__bn_splits((size_t)n * hw);
    /* dgamma and dbeta are sums of the channel's N*H*W terms, which the
       GPU adds in another order than the CPU: float's rounding of such a
       sum grows as the square root of the count, and the sum itself may
       be far smaller than its terms' sizes (they cancel) */
    double sum_tol = 1e-5 * fmax(1.0, sqrt((double)n * hw / 4096));
    for (int training = 0; training <= 1; training++)
        for (int relu = 0; relu <= 2; relu++) {
            std::vector<float> x = random_values(total, 3.0f), gamma = random_values(c, 1.0f);
            std::vector<float> skip = random_values(total);
            std::vector<float> beta = random_values(c), rm_c = random_values(c), rv_c = random_values(c, 1.0f);
            std::vector<float> rm_g = rm_c, rv_g = rv_c, y_c = nans(total), y_g = nans(total);
            std::vector<float> mean_c = nans(c), mean_g = nans(c), inv_c = nans(c), inv_g = nans(c);
            std::vector<float> partials = nans((size_t)c * splits * 3);
            mgpu__bn_forward_args a;
            memset(&a, 0, sizeof a);
            a.y = y_c.data(); a.x = x.data(); a.gamma = gamma.data(); a.beta = beta.data();
            a.running_mean = rm_c.data(); a.running_var = rv_c.data();
            a.save_mean = training ? mean_c.data() : NULL;
            a.save_invstd = training ? inv_c.data() : NULL;
            a.n = n; a.c = c; a.hw = hw; a.splits = splits; a.training = training;
            a.fuse_relu = relu > 0; a.momentum = 0.1f; a.eps = 1e-5f;
            a.skip = relu == 2 ? skip.data() : NULL;
            mgpu__bn_forward_args b = a;
            b.y = y_g.data(); b.running_mean = rm_g.data(); b.running_var = rv_g.data();
            b.save_mean = training ? mean_g.data() : NULL;
            b.save_invstd = training ? inv_g.data() : NULL;
            b.partials = partials.data();
            b.done = bn_done.data();
            mgpu__bn_forward_cpu(&a, &on_cpu);
            mgpu__bn_forward_cuda(&b, &on_gpu);
            same("batch norm y", y_g, y_c, 1e-5);
            same("running mean", rm_g, rm_c, 1e-5);
            same("running variance", rv_g, rv_c, 1e-5);
            std::vector<float> y_t_c = nans(total), y_t_g = nans(total);
            a.y_t = y_t_c.data();
            b.y_t = y_t_g.data();
            mgpu__bn_forward_cpu(&a, &on_cpu);
            mgpu__bn_forward_cuda(&b, &on_gpu);
            same("batch norm y beside y_t", y_g, y_c, 1e-5);
            same("batch norm y_t (CPU)", y_t_c, channels_last_cpu(y_c, n, c, hw), 0);
            same("batch norm y_t", y_t_g, channels_last_cpu(y_g, n, c, hw), 0);
            std::vector<float> alone_c = nans(total), alone_g = nans(total); /* y_t without y */
            a.y = b.y = NULL;
            a.y_t = alone_c.data();
            b.y_t = alone_g.data();
            mgpu__bn_forward_cpu(&a, &on_cpu);
            mgpu__bn_forward_cuda(&b, &on_gpu);
            same("batch norm y_t alone (CPU)", alone_c, y_t_c, 0);
            same("batch norm y_t alone", alone_g, y_t_g, 0);
            if (!training) continue;
            same("saved mean", mean_g, mean_c, 1e-5);
            same("saved 1/std", inv_g, inv_c, 1e-5);
            for (int accumulate = 0; accumulate <= 1; accumulate++) {
                std::vector<float> dy = random_values(total), dx_c = nans(total), dx_g = nans(total);
                std::vector<float> dg_c = accumulate ? random_values(c) : nans(c), dg_g = dg_c;
                std::vector<float> db_c = accumulate ? random_values(c) : nans(c), db_g = db_c;
                std::vector<float> scratch = nans((size_t)c * splits * 2 + (size_t)c * 2);
                mgpu__bn_backward_args p;
                memset(&p, 0, sizeof p);
                p.dx = dx_c.data(); p.dgamma = dg_c.data(); p.dbeta = db_c.data(); p.dy = dy.data();
                p.x = x.data(); p.gamma = gamma.data(); p.beta = relu ? beta.data() : NULL;
                p.save_mean = mean_c.data(); p.save_invstd = inv_c.data();
                p.n = n; p.c = c; p.hw = hw; p.splits = splits; p.fuse_relu = relu;
                p.accumulate = accumulate;
                if (relu == 2) {
                    p.fuse_relu = 0; /* (the block's ReLU is its own) */
                    block_end_backward(p, y_c, sum_tol);
                    continue;
                }
                mgpu__bn_backward_args q = p;
                q.dx = dx_g.data(); q.dgamma = dg_g.data(); q.dbeta = db_g.data();
                q.partials = scratch.data();
                q.done = bn_done.data();
                mgpu__bn_backward_cpu(&p, &on_cpu);
                mgpu__bn_backward_cuda(&q, &on_gpu);
                same("batch norm dx", dx_g, dx_c, 1e-4);
                same("dgamma", dg_g, dg_c, sum_tol);
                same("dbeta", db_g, db_c, sum_tol);
                std::vector<float> dx_t_c = nans(total), dx_t_g = nans(total), untouched = nans(total);
                p.dx = q.dx = untouched.data();
                p.dx_t = dx_t_c.data();
                q.dx_t = dx_t_g.data();
                p.accumulate = q.accumulate = 1; /* dgamma and dbeta as they were */
                mgpu__bn_backward_cpu(&p, &on_cpu);
                mgpu__bn_backward_cuda(&q, &on_gpu);
                same("batch norm dx_t (CPU)", dx_t_c, channels_last_cpu(dx_c, n, c, hw), 0);
                same("batch norm dx_t", dx_t_g, channels_last_cpu(dx_g, n, c, hw), 0);
                same("dx left alone beside dx_t", untouched, nans(total), 0);
            }
        }
    check_bn_done_reset();
}
/* The residual block's end (mask: its output): the ReLU's mask on dy
   written to dsum, and batch norm's backward from it, the shortcut's bias
   gradient dbeta's sum; the CPU's exactly as a separate ReLU backward
   pass and `plain` (whose dy it replaces) give, the GPU's within the
   tolerances of batchnorm_case. */
static void block_end_backward(const mgpu__bn_backward_args &plain, const std::vector<float> &out,
                               double sum_tol) {
    size_t total = out.size();
    int c = plain.c;
    std::vector<float> dy(plain.dy, plain.dy + total), dsum_want(total);
    for (size_t i = 0; i < total; i++) dsum_want[i] = out[i] > 0.0f ? dy[i] : 0.0f;
    /* the separate passes, on the CPU */
    std::vector<float> dx_want = nans(total), dg_want(plain.dgamma, plain.dgamma + c),
                       db_want(plain.dbeta, plain.dbeta + c);
    mgpu__bn_backward_args r = plain;
    r.dy = dsum_want.data(), r.dx = dx_want.data(), r.dgamma = dg_want.data(), r.dbeta = db_want.data();
    mgpu__bn_backward_cpu(&r, &on_cpu);
    for (int on = 0; on < 2; on++) {
        std::vector<float> dsum = nans(total), dx = nans(total), dg(plain.dgamma, plain.dgamma + c),
                           db(plain.dbeta, plain.dbeta + c), bias(plain.dbeta, plain.dbeta + c);
        std::vector<float> scratch = nans((size_t)c * plain.splits * 2 + (size_t)c * 2);
        mgpu__bn_backward_args a = plain;
        a.dx = dx.data(), a.dgamma = dg.data(), a.dbeta = db.data(), a.partials = scratch.data();
        a.done = bn_done.data();
        a.mask = out.data(), a.dsum = dsum.data(), a.dshortcut_bias = bias.data();
        if (on) mgpu__bn_backward_cuda(&a, &on_gpu);
        else mgpu__bn_backward_cpu(&a, &on_cpu);
        same(on ? "block end: dsum" : "block end: dsum (CPU)", dsum, dsum_want, 0);
        same(on ? "block end: dx" : "block end: dx (CPU)", dx, dx_want, on ? 1e-4 : 0);
        same(on ? "block end: dgamma" : "block end: dgamma (CPU)", dg, dg_want, on ? sum_tol : 0);
        same(on ? "block end: dbeta" : "block end: dbeta (CPU)", db, db_want, on ? sum_tol : 0);
        same(on ? "block end: shortcut bias" : "block end: shortcut bias (CPU)", bias, db, 0);
    }
}
TEST(batchnorm_one_block_per_channel) {
    batchnorm_case(2, 3, 5);
    batchnorm_case(5, 7, 49); /* a value's channel and image found by dividing by 7 and 49 */
}
TEST_LONG(batchnorm_split_channels) {
    CHECK(mgpu__bn_splits(2 * 4097) > 1); /* the sums really are split */
    batchnorm_case(2, 1, 4097);
    CHECK(mgpu__bn_splits(2 * 3000) == 2);
    batchnorm_case(2, 2, 3000); /* 2 slices: the first of a channel to finish merges nothing */
    /* 40 slices a channel: the last block's lanes 0 to 7 merge two
       partials, the others one */
    CHECK(mgpu__bn_splits(160000) == 40);
    batchnorm_case(1, 6, 160000);
}
/* Planes of whole 4-value vectors (16-byte loads and stores; the
   emulator fails on any that is not 16-byte aligned), and when the
   kernels fall back to single values. */
TEST_LONG(batchnorm_in_vectors_of_four) {
    std::vector<float> buffer(64);
    const void *aligned[] = {buffer.data(), buffer.data() + 4, NULL};
    const void *one_off[] = {buffer.data(), buffer.data() + 1};
    CHECK_EQ_INT(mgpu__vector_width(16, aligned, 3), 4);
    CHECK_EQ_INT(mgpu__vector_width(49, aligned, 3), 1);
    CHECK_EQ_INT(mgpu__vector_width(16, one_off, 2), 1);
    batchnorm_case(4, 3, 6);    /* planes of 6 values: not whole vectors */
    batchnorm_case(3, 5, 16);   /* ResNet-18's 4x4 planes */
    batchnorm_case(2, 3, 196);  /* 14x14: 49 vectors a plane */
    CHECK(mgpu__bn_splits(2 * 4100) == 3);
    batchnorm_case(2, 1, 4100); /* 3 slices of a channel of 2050 vectors */
    batchnorm_case(17, 2, 4);   /* one vector a plane */
    batchnorm_case(3, 68, 16);  /* channels-last in vectors: partial 64 x 64 tiles */
    /* A channel of more than 64 slices of 4096 values: the statistics'
       threads load their 16 values twice, merging the second batch. */
    CHECK(270000 > 64 * 4096);
    batchnorm_case(1, 1, 270000);
}

/* ---------------------------------------------------- loss and the rest */
TEST(cross_entropy_accuracy_and_sum) {
    static const int shapes[][2] = {{1, 1}, {3, 10}, {5, 33}, {7, 100}, {40, 3}};
    for (const auto &d : shapes) {
        int n = d[0], k = d[1];
        std::vector<float> z = random_values((size_t)n * k, 0.0f, 8.0f), labels(n);
        if (k > 3) z[1] = z[2] = z[3] = 5.0f; /* a tie for the first row's largest logit */
        for (int i = 0; i < n; i++) labels[i] = (float)((i * 7) % k);
        mgpu__ce_args a;
        memset(&a, 0, sizeof a);
        a.logits = z.data(); a.labels = labels.data(); a.n = n; a.classes = k; a.scale = 0.5f;
        a.op = "test";
        std::vector<float> loss_c = nans(n), loss_g = nans(n);
        a.out = loss_c.data();
        mgpu__ce_forward_cpu(&a, &on_cpu);
        a.out = loss_g.data();
        mgpu__ce_forward_cuda(&a, &on_gpu);
        same("cross entropy", loss_g, loss_c, 1e-5);
        std::vector<float> dz_c = nans((size_t)n * k), dz_g = nans((size_t)n * k);
        a.out = dz_c.data();
        mgpu__ce_backward_cpu(&a, &on_cpu);
        a.out = dz_g.data();
        mgpu__ce_backward_cuda(&a, &on_gpu);
        same("cross entropy gradient", dz_g, dz_c, 1e-5);
        std::vector<float> right_c = nans(1), right_g = nans(1);
        a.out = right_c.data();
        mgpu__accuracy_cpu(&a, &on_cpu);
        a.out = right_g.data();
        mgpu__accuracy_cuda(&a, &on_gpu);
        same("accuracy", right_g, right_c, 0);
    }
    for (size_t n : {(size_t)0, (size_t)1, (size_t)5, (size_t)1000, (size_t)5000}) {
        std::vector<float> x = random_values(n), s_c = nans(1), s_g = nans(1);
        mgpu__sum_args a = {s_c.data(), x.data(), n, 0.5};
        mgpu__sum_cpu(&a, &on_cpu);
        a.out = s_g.data();
        mgpu__sum_cuda(&a, &on_gpu);
        same("sum", s_g, s_c, 1e-5);
    }
}

/* The elementwise kernels share their per-element function with the CPU:
   what is left to check is that the grid covers every element once. */
TEST(elementwise_relu_add_and_sgd) {
    size_t n = 1000; /* not a multiple of the 256-thread blocks */
    std::vector<float> x = random_values(n), y = random_values(n), g = random_values(n);
    std::vector<float> out_c = nans(n), out_g = nans(n);
    mgpu__fill_args f = {out_c.data(), n, MGPU__FILL_NORMAL, 1.0f, 2.0f, 7, 3};
    mgpu__fill_cpu(&f, &on_cpu);
    f.y = out_g.data();
    mgpu__fill_cuda(&f, &on_gpu);
    same("fill", out_g, out_c, 0);
    mgpu__axpby_args p = {out_c.data(), x.data(), n, 0.5f, -2.0f};
    mgpu__axpby_cpu(&p, &on_cpu);
    p.y = out_g.data();
    mgpu__axpby_cuda(&p, &on_gpu);
    same("axpby", out_g, out_c, 0);
    mgpu__relu_args relu = {out_c.data(), x.data(), n};
    mgpu__relu_cpu(&relu, &on_cpu);
    relu.y = out_g.data();
    mgpu__relu_cuda(&relu, &on_gpu);
    same("ReLU", out_g, out_c, 0);
    mgpu__add_args s = {out_c.data(), x.data(), y.data(), n, 1};
    mgpu__add_cpu(&s, &on_cpu);
    s.y = out_g.data();
    mgpu__add_cuda(&s, &on_gpu);
    same("add and ReLU", out_g, out_c, 0);
    /* ReLU's backward in vectors of 4 (n a multiple of 4, all aligned),
       and one value at a time (an input one float off alignment) */
    for (size_t off = 0; off <= 1; off++) {
        mgpu__relu_backward_args r = {out_c.data(), y.data(), x.data() + off, n - 4 * off};
        const void *tensors[] = {out_g.data(), r.dy, r.mask};
        CHECK_EQ_INT(mgpu__vector_width(r.n, tensors, 3), off ? 1 : 4);
        mgpu__relu_backward_cpu(&r, &on_cpu);
        r.dx = out_g.data();
        mgpu__relu_backward_cuda(&r, &on_gpu);
        same("ReLU backward", out_g, out_c, 0);
    }
    std::vector<float> param_c = random_values(n), param_g = param_c, grad_c = g, grad_g = g;
    mgpu__sgd_book_args book = {param_c.data(), grad_c.data(), n, 0.2f, 256.0f};
    mgpu__sgd_book_cpu(&book, &on_cpu);
    book.param = param_g.data();
    book.grad = grad_g.data();
    mgpu__sgd_book_cuda(&book, &on_gpu);
    same("the book's SGD", param_g, param_c, 0);
    same("the book's SGD zeroes the gradient", grad_g, grad_c, 0);
}

/* SGD and zeroing take lists of tensors: every value of every tensor
   updated once, whatever the sizes (empty, one block and a value more,
   less than a block), and nothing past a tensor's end touched. 21 tensors
   make a full list of 16 and one of 5. Every third one starts a value
   past a 16-byte boundary, where the kernels take no vectors (the
   emulator refuses a misaligned one). */
TEST(sgd_and_zeroing_over_lists_of_tensors) {
    const size_t sizes[21] = {1, 4095, 4096, 4097, 0, 9000, 64, 3, 12289, 512, 1,
                              8192, 7, 100, 4096 * 3 + 5, 2, 0, 33, 4099, 10, 600};
    const size_t guard = 8;
    auto lead = [](int t) { return (size_t)(t % 3 == 2); }; /* values before the tensor */
    for (int first_step = 0; first_step < 2; first_step++) {
        std::vector<std::vector<float>> param_c, param_g, buf_c, buf_g, grad, zero;
        for (int t = 0; t < 21; t++) {
            size_t n = lead(t) + sizes[t];
            param_c.push_back(random_values(n + guard));
            param_g.push_back(param_c.back());
            buf_c.push_back(random_values(n + guard));
            buf_g.push_back(buf_c.back());
            grad.push_back(random_values(n + guard));
            zero.push_back(random_values(n + guard, 5.0f));
        }
        std::vector<std::vector<float>> zero_before = zero, zero_c = zero, start_param = param_c,
                                        start_buf = buf_c;
        mgpu__sgd_args cpu = {}, gpu = {};
        mgpu__zero_args z = {}, z_c = {};
        cpu.lr = gpu.lr = 0.1f;
        cpu.momentum = gpu.momentum = 0.9f;
        cpu.weight_decay = gpu.weight_decay = 5e-4f;
        cpu.first_step = gpu.first_step = first_step;
        for (int t = 0; t < 21; t++) {
            int at = cpu.list.count;
            cpu.param[at] = param_c[t].data() + lead(t);
            gpu.param[at] = param_g[t].data() + lead(t);
            cpu.buf[at] = buf_c[t].data() + lead(t);
            gpu.buf[at] = buf_g[t].data() + lead(t);
            cpu.grad[at] = gpu.grad[at] = grad[t].data() + lead(t);
            z.data[at] = zero[t].data() + lead(t);
            z_c.data[at] = zero_c[t].data() + lead(t);
            mgpu__list_add(&gpu.list, sizes[t]);
            mgpu__list_add(&z.list, sizes[t]);
            mgpu__list_add(&z_c.list, sizes[t]);
            if (mgpu__list_add(&cpu.list, sizes[t]) || t == 20) {
                mgpu__sgd_cpu(&cpu, &on_cpu);
                mgpu__sgd_cuda(&gpu, &on_gpu);
                mgpu__zero_cuda(&z, &on_gpu);
                mgpu__zero_cpu(&z_c, &on_cpu);
                cpu.list.count = gpu.list.count = z.list.count = z_c.list.count = 0;
            }
        }
        for (int t = 0; t < 21; t++) {
            size_t begin = lead(t), end = begin + sizes[t];
            same("SGD parameters", param_g[t], param_c[t], 0);
            same("SGD momentum", buf_g[t], buf_c[t], 0);
            int zeroed = 1, kept = 1;
            for (size_t i = begin; i < end; i++) zeroed &= zero[t][i] == 0.0f;
            for (size_t i = 0; i < zero[t].size(); i++)
                if (i < begin || i >= end) kept &= zero[t][i] == zero_before[t][i];
            CHECK(zeroed);
            CHECK(kept);
            same("zeroing", zero[t], zero_c[t], 0);
        }
        /* and the CPU's list walk is the formula, value by value: g =
           grad + 5e-4 param, buf = g at the first step, else 0.9 buf + g,
           param -= 0.1 buf; past a tensor's end nothing changes */
        double worst = 0;
        for (int t = 0; t < 21; t++)
            for (size_t i = 0; i < param_c[t].size(); i++) {
                double p0 = start_param[t][i], b0 = start_buf[t][i], b = b0, p = p0;
                if (i >= lead(t) && i < lead(t) + sizes[t]) {
                    double g = grad[t][i] + 5e-4 * p0;
                    b = first_step ? g : 0.9 * b0 + g;
                    p = p0 - 0.1 * b;
                }
                worst = std::max(worst, std::fabs(param_c[t][i] - p) / (1 + std::fabs(p)));
                worst = std::max(worst, std::fabs(buf_c[t][i] - b) / (1 + std::fabs(b)));
            }
        CHECK(worst < 1e-6);
    }
}

/* Adam and AdamW (kernels/adam.h) over the same lists: the CUDA kernels
   give the CPU's values exactly (parameters and both moments), with the
   gradients a value past a 16-byte boundary where the others are not
   (the kernels then take no vectors); and the CPU's update is the
   formula, value by value, within 1e-6. */
TEST(adam_over_lists_of_tensors) {
    const size_t sizes[18] = {1, 4095, 4096, 4097, 0, 9000, 64, 3, 12289, 512, 1, 8192, 7, 100, 2, 33, 4099, 10};
    for (int decoupled = 0; decoupled < 2; decoupled++) {
        std::vector<std::vector<float>> p_c, p_g, m_c, m_g, v_c, v_g, grad, p0, m0, v0;
        for (int t = 0; t < 18; t++) {
            size_t n = sizes[t] + 1;
            p_c.push_back(random_values(n));
            m_c.push_back(random_values(n, 0.0f, 0.1f));
            v_c.push_back(random_values(n, 0.5f, 0.2f)); /* (a second moment is not negative) */
            grad.push_back(random_values(n));
            p_g.push_back(p_c.back()), m_g.push_back(m_c.back()), v_g.push_back(v_c.back());
            p0.push_back(p_c.back()), m0.push_back(m_c.back()), v0.push_back(v_c.back());
        }
        mgpu__adam_args cpu = {}, gpu = {};
        for (mgpu__adam_args *a : {&cpu, &gpu}) {
            a->one_minus_beta1 = 0.1f, a->beta2 = 0.999f, a->one_minus_beta2 = 0.001f, a->eps = 1e-8f;
            a->weight_decay = 0.01f, a->decay = 1.0f - 0.001f * 0.01f, a->step_size = 0.001f / 0.19f;
            a->correction2_sqrt = 0.0447101778f, a->decoupled = decoupled;
        }
        for (int t = 0; t < 18; t++) {
            int at = cpu.list.count;
            cpu.param[at] = p_c[t].data(), gpu.param[at] = p_g[t].data();
            cpu.m[at] = m_c[t].data(), gpu.m[at] = m_g[t].data();
            cpu.v[at] = v_c[t].data(), gpu.v[at] = v_g[t].data();
            cpu.grad[at] = gpu.grad[at] = grad[t].data() + (t % 3 == 1); /* (misaligned) */
            mgpu__list_add(&gpu.list, sizes[t]);
            if (mgpu__list_add(&cpu.list, sizes[t]) || t == 17) {
                mgpu__adam_cpu(&cpu, &on_cpu);
                mgpu__adam_cuda(&gpu, &on_gpu);
                cpu.list.count = gpu.list.count = 0;
            }
        }
        double worst = 0;
        for (int t = 0; t < 18; t++) {
            same("Adam parameters", p_g[t], p_c[t], 0);
            same("Adam first moments", m_g[t], m_c[t], 0);
            same("Adam second moments", v_g[t], v_c[t], 0);
            for (size_t i = 0; i < sizes[t]; i++) {
                double g = grad[t][i + (t % 3 == 1)], p = p0[t][i];
                if (decoupled) p *= 1.0 - 0.001 * 0.01;
                else g += 0.01 * p;
                double m = m0[t][i] + 0.1 * (g - m0[t][i]), v = 0.999 * v0[t][i] + 0.001 * g * g;
                p -= 0.001 / 0.19 * m / (std::sqrt(v) / 0.0447101778 + 1e-8);
                worst = std::max(worst, std::fabs(p_c[t][i] - p) / (1 + std::fabs(p)));
            }
            CHECK(p_c[t][sizes[t]] == p0[t][sizes[t]]); /* (nothing past the end) */
        }
        CHECK(worst < 1e-6);
    }
}

/* ------------------------------------------- the emulated runtime itself */
/* The emulator's own checks (tests/cuda_emu_runtime.h), which the GPU
   tests rely on to fail where a GPU would: each refusal is tried here. */
static __global__ void mgpu_emu_test_double(float *x) { x[threadIdx.x] *= 2.0f; }

TEST(emulated_runtime_refuses_what_a_gpu_refuses) {
    float host[64] = {0}, *dev0 = NULL, *dev1 = NULL;
    CHECK_EQ_INT(cudaSetDevice(0), cudaSuccess);
    CHECK_EQ_INT(cudaMalloc((void **)&dev0, sizeof host), cudaSuccess);
    CHECK_EQ_INT(cudaSetDevice(1), cudaSuccess);
    CHECK_EQ_INT(cudaMalloc((void **)&dev1, sizeof host), cudaSuccess);
    /* copies: the kind must match the memory, and stay inside an allocation */
    CHECK_EQ_INT(cudaMemcpy(dev1, host, sizeof host, cudaMemcpyHostToDevice), cudaSuccess);
    CHECK_EQ_INT(cudaMemcpy(host, host + 32, 32 * sizeof(float), cudaMemcpyHostToDevice), cudaErrorInvalidValue);
    CHECK_EQ_INT(cudaMemcpy(dev1 + 1, host, sizeof host, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
    CHECK_EQ_INT(cudaMemcpyPeerAsync(dev1, 0, dev0, 0, sizeof host, 0), cudaErrorInvalidValue);
    std::vector<float> pageable(64);
    CHECK_EQ_INT(cudaFree(pageable.data()), cudaErrorInvalidValue);
    CHECK_EQ_INT(cudaGetLastError(), cudaErrorInvalidValue); /* the last error, then cleared */
    CHECK_EQ_INT(cudaGetLastError(), cudaSuccess);
    /* events and cuBLAS handles belong to the device current when made */
    cudaStream_t s1;
    cudaEvent_t e0, e1;
    CHECK_EQ_INT(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking), cudaSuccess);
    CHECK_EQ_INT(cudaEventCreate(&e1), cudaSuccess);
    CHECK_EQ_INT(cudaSetDevice(0), cudaSuccess);
    CHECK_EQ_INT(cudaEventCreate(&e0), cudaSuccess);
    CHECK_EQ_INT(cudaEventRecord(e0, s1), cudaErrorInvalidResourceHandle);
    CHECK_EQ_INT(cudaEventRecord(e0, 0), cudaSuccess);
    CHECK_EQ_INT(cudaEventRecord(e1, s1), cudaSuccess);
    CHECK_EQ_INT(cudaEventSynchronize(e1), cudaSuccess);
    float ms;
    CHECK_EQ_INT(cudaEventElapsedTime(&ms, e0, e1), cudaErrorInvalidResourceHandle);
    cublasHandle_t h;
    CHECK_EQ_INT(cublasCreate(&h), CUBLAS_STATUS_SUCCESS); /* on device 0 */
    CHECK_EQ_INT(cudaSetDevice(1), cudaSuccess);
    float one = 1.0f;
    CHECK_EQ_INT(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 8, 8, 8, &one, dev0, CUDA_R_32F, 8, dev0,
                              CUDA_R_32F, 8, &one, dev0, CUDA_R_32F, 8, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT),
                 CUBLAS_STATUS_EXECUTION_FAILED);
    CHECK_EQ_INT(cublasDestroy(h), CUBLAS_STATUS_SUCCESS);
    /* a stream runs later, in order, and a kernel launch goes to the current device's streams */
    for (int i = 0; i < 64; i++) host[i] = (float)i;
    CHECK_EQ_INT(cudaMemcpyAsync(dev1, host, sizeof host, cudaMemcpyHostToDevice, s1), cudaSuccess);
    mgpu_emu_launcher(1, 64, 0, s1)(mgpu_emu_test_double, dev1);
    CHECK_EQ_INT(cudaMemcpyAsync(host, dev1, sizeof host, cudaMemcpyDeviceToHost, s1), cudaSuccess);
    CHECK_EQ_INT(cudaStreamSynchronize(s1), cudaSuccess);
    CHECK_CLOSE(host[63], 126.0, 0, 0);
    CHECK_EQ_INT(cudaSetDevice(0), cudaSuccess);
    EXPECT_DIES(mgpu_emu_launcher(1, 64, 0, s1)(mgpu_emu_test_double, dev1),
                "a launch into a stream of a device that is not the current one");
    /* NCCL: one device per rank; each rank's result after every rank has called */
    ncclComm_t comms[2];
    int twice[2] = {0, 0}, both[2] = {0, 1};
    CHECK_EQ_INT(ncclCommInitAll(comms, 2, twice), ncclInvalidUsage);
    CHECK_EQ_INT(ncclCommInitAll(comms, 2, both), ncclSuccess);
    cudaStream_t s0;
    CHECK_EQ_INT(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking), cudaSuccess);
    float ones[64];
    for (float &v : ones) v = 1.0f;
    CHECK_EQ_INT(cudaMemcpy(dev0, ones, sizeof ones, cudaMemcpyHostToDevice), cudaSuccess);
    CHECK_EQ_INT(ncclGroupStart(), ncclSuccess);
    CHECK_EQ_INT(ncclAllReduce(dev0, dev0, 64, ncclFloat, ncclSum, comms[0], s0), ncclSuccess);
    CHECK_EQ_INT(ncclAllReduce(dev1, dev1, 64, ncclFloat, ncclSum, comms[1], s1), ncclSuccess);
    CHECK_EQ_INT(ncclGroupEnd(), ncclSuccess);
    CHECK_EQ_INT(cudaStreamSynchronize(s0), cudaSuccess);
    CHECK_EQ_INT(cudaStreamSynchronize(s1), cudaSuccess);
    CHECK_EQ_INT(cudaMemcpy(host, dev1, sizeof host, cudaMemcpyDeviceToHost), cudaSuccess);
    CHECK_CLOSE(host[63], 1.0 + 126.0, 0, 0);
    CHECK_EQ_INT(ncclCommDestroy(comms[0]), ncclSuccess);
    CHECK_EQ_INT(ncclCommDestroy(comms[1]), ncclSuccess);
    CHECK_EQ_INT(cudaStreamDestroy(s0), cudaSuccess);
    CHECK_EQ_INT(cudaStreamDestroy(s1), cudaSuccess);
    CHECK_EQ_INT(cudaFree(dev0), cudaSuccess);
    CHECK_EQ_INT(cudaFree(dev1), cudaSuccess);
}

TEST_MAIN()
