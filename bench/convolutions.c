/* bench/convolutions.c: each convolution of ResNet-18, one algorithm at a
   time.

   make bench/convolutions && ./bench/convolutions [--batch-size N] [--steps N] [--cpu]

   The book's ResNet-18 on 1x28x28 images has 11 distinct convolutions
   (below, with how often each occurs in the network). For each, at batch
   256 on a GPU (32 on the CPU), this times, in microseconds per call:
     fwd      the forward pass,
     dx, dW   the input gradient and the weight gradient (dx is not needed
              for the first layer, whose input is the image),
   with conv.h's im2col + cuBLAS (the forward through mgpu_conv2d_forward,
   the backward through mgpu_conv2d_backward, dx and dW together), and on
   a GPU with each gradient's half of the im2col path alone (rows "im2col
   alone"), and with each tile shape of kernels/conv_nhwc.h's implicit
   GEMM, launched directly (rows "channels-last": the forward pass, dx,
   and dW; their times include the copies to channels-last; "/N": the
   forward pass or dx with its sum in N slices, "~B": dW in the slices
   for about B blocks, where a tile's differ from the row above's), and
   unless MGPU_WGMMA=0, on a GPU that runs them (sm_90a code on compute
   capability 9.0) by wgmma (rows "... wgmma", in the 64 x 128 and 128 x
   128 tiles), and kernels/winograd.h's (rows "Winograd", one figure,
   under the first tile): the forward pass and dx; for the first layer
   (C*R*S = 9) kernels/conv_few_inputs.h's (rows "few inputs", one
   figure): the forward pass and dW; for dx of the 3x3 convolutions at
   stride 2, conv_nhwc.h's stride-2 dx kernel (rows "channels-last stride-2 dx", one figure,
   the turned weights' copy included). The fastest tile of a
   row is marked *; the fastest of a pass is the one the library's own trial
   should keep. Each figure is the mean of `steps` calls between two
   synchronisations, after one call to warm up. TFLOP/s counts 2 * n * K *
   P * Q * C * R * S FLOPs per pass. Both at PyTorch's default precision
   (TF32 in convolutions); bench/pytorch/conv.py times cuDNN on the same
   shapes.

   Then a ResNet-18 step's convolutions, summed with their counts: all
   im2col (MGPU_CONV=im2col); all implicit, the fastest kernel and tile
   for each pass (MGPU_CONV=implicit); and the library's choice for each
   pass as MGPU_CONV=timed chooses it (the faster of the two for the
   forward pass; each gradient by the faster of its implicit GEMM and its
   half of im2col, unless im2col's whole backward beats the two). On the
   CPU, ResNet-18's and LeNet's passes by oneDNN's three methods and by
   mgpu's Winograd (kernels/winograd.h), from which mgpu/convolution.h's
   rule was set. The last line is for bench/run.sh:
       RESULT conv on=[cuda:0] batch=256 im2col_ms=... implicit_ms=... best_ms=... */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"

typedef struct {
    const char *name;
    int count; /* occurrences in the network */
    int c, k, r, stride, pad, h; /* h: the input's height and width */
} conv_case;

static const conv_case cases[] = {
    {"first 1->64 3x3", 1, 1, 64, 3, 1, 1, 28},
    {"stage1 64->64 3x3", 4, 64, 64, 3, 1, 1, 28},
    {"stage2 64->128 3x3 /2", 1, 64, 128, 3, 2, 1, 28},
    {"stage2 64->128 1x1 /2", 1, 64, 128, 1, 2, 0, 28},
    {"stage2 128->128 3x3", 3, 128, 128, 3, 1, 1, 14},
    {"stage3 128->256 3x3 /2", 1, 128, 256, 3, 2, 1, 14},
    {"stage3 128->256 1x1 /2", 1, 128, 256, 1, 2, 0, 14},
    {"stage3 256->256 3x3", 3, 256, 256, 3, 1, 1, 7},
    {"stage4 256->512 3x3 /2", 1, 256, 512, 3, 2, 1, 7},
    {"stage4 256->512 1x1 /2", 1, 256, 512, 1, 2, 0, 7},
    {"stage4 512->512 3x3", 3, 512, 512, 3, 1, 1, 4},
};
enum { N_CASES = sizeof cases / sizeof cases[0] };
enum { FWD, DX, DW, PASSES };

/* Microseconds per call of `run`, the mean of `steps` calls after one warm-up. */
typedef void (*conv_run)(void *ctx);
static double time_us(mgpu_device *dev, conv_run run, void *ctx, int steps) {
    run(ctx);
    mgpu_synchronize(dev);
    double t0 = mgpu_now();
    for (int s = 0; s < steps; s++) run(ctx);
    mgpu_synchronize(dev);
    return (mgpu_now() - t0) * 1e6 / steps;
}

/* One convolution's tensors */
typedef struct {
    mgpu_device *dev;
    mgpu_tensor *x, *w, *b, *y, *dy, *dx, *dw;
    mgpu__conv_geom g;
    int stride, pad, first;
#if MGPU_CUDA
    mgpu__implicit_kernel kernel;
#endif
} conv_ctx;

static void im2col_forward(void *p) {
    conv_ctx *c = (conv_ctx *)p;
    mgpu_conv2d_forward(c->y, c->x, c->w, c->b, c->stride, c->pad);
}
static void im2col_backward(void *p) {
    conv_ctx *c = (conv_ctx *)p;
    mgpu_conv2d_backward(c->first ? NULL : c->dx, c->dw, NULL, c->dy, c->x, c->w, c->stride, c->pad, 0);
}
#if MGPU_CUDA
static void implicit_forward(void *p) {
    conv_ctx *c = (conv_ctx *)p;
    mgpu__conv_forward_implicit(c->y, c->x, NULL, c->w, NULL, c->b, &c->g, c->kernel, NULL);
}
static void implicit_dx(void *p) {
    conv_ctx *c = (conv_ctx *)p;
    mgpu__conv_dx_implicit(c->dx, c->dy, NULL, c->w, NULL, &c->g, c->kernel, 0);
}
static void implicit_dw(void *p) {
    conv_ctx *c = (conv_ctx *)p;
    mgpu__conv_dw_implicit(c->dw, c->dy, NULL, c->x, NULL, &c->g, 0, c->kernel);
}
/* each gradient alone with its half of the im2col path (TF32) */
static void im2col_dx(void *p) {
    conv_ctx *c = (conv_ctx *)p;
    mgpu__conv_backward_im2col(c->dx, NULL, c->dy, c->x, c->w, &c->g, 1, 0, 0);
}
static void im2col_dw(void *p) {
    conv_ctx *c = (conv_ctx *)p;
    mgpu__conv_backward_im2col(NULL, c->dw, c->dy, c->x, c->w, &c->g, 1, 0, 0);
}
#endif
enum { TILE_COLUMNS = 4 }; /* room for the tile shapes */
#if MGPU_CUDA
static_assert((int)MGPU__TILE_KINDS <= (int)TILE_COLUMNS, "a column for each tile shape");
/* The trial's candidate i in a tile for a pass, in *k (as
   mgpu__conv_kernel_choice): the choices by mma.sync, then again by
   wgmma where `wgmma` (the GPU runs them); returns whether it is one. */
enum { CANDIDATE_ROWS = 2 * MGPU__KERNEL_CHOICES };
static int candidate(mgpu__conv_try what, const mgpu__conv_geom *g, mgpu__implicit_tile tile, int wgmma, int i,
                     mgpu__implicit_kernel *k) {
    int by_wgmma = i >= MGPU__KERNEL_CHOICES;
    return (wgmma || !by_wgmma) && mgpu__conv_kernel_choice(what, g, tile, by_wgmma, i % MGPU__KERNEL_CHOICES, k);
}
#endif

static double tflops(double flop, double us) { return us > 0 ? flop / us * 1e-6 : 0.0; }

/* On the CPU: each pass of ResNet-18's layers (at the bench's batch)
   and of LeNet's two layers (chapter 2's, at its batch of
   256) by oneDNN's three methods (kernels/conv_onednn.h): direct on its
   blocked layouts, direct on channels-last activations, and Winograd's
   F(4x4, 3x3); and by mgpu's Winograd F(2x2, 3x3) (kernels/winograd.h);
   each called directly whatever the rule would take, in microseconds per
   call ("-" where the library has no oneDNN or the method no kernel for
   the shape: oneDNN's Winograd needs AVX-512): the figures
   mgpu/convolution.h's rule rests on. */
static const conv_case lenet_cases[] = {
    {"LeNet 1->20 3x3", 1, 1, 20, 3, 1, 0, 28},
    {"LeNet 20->50 5x5", 1, 20, 50, 5, 1, 0, 13},
};
enum { LENET_BATCH = 256 };
enum { BY_ONEDNN, BY_ONEDNN_CHANNELS_LAST, BY_ONEDNN_WINOGRAD, BY_WINOGRAD, CPU_WAYS };
typedef struct {
    conv_ctx *c;
    int pass, way; /* FWD, DX or DW; BY_* */
} cpu_pass;
/* The columns as the library's ways */
static const mgpu__cpu_conv_way cpu_ways[CPU_WAYS] = {MGPU__CPU_BY_ONEDNN_DIRECT, MGPU__CPU_BY_ONEDNN_CHANNELS_LAST,
                                                      MGPU__CPU_BY_ONEDNN_WINOGRAD, MGPU__CPU_BY_MGPU_WINOGRAD};
static mgpu__cpu_conv_call cpu_call(const cpu_pass *p) {
    conv_ctx *c = p->c;
    mgpu__cpu_conv_call call = {p->pass == FWD ? c->y : NULL, p->pass == DX ? c->dx : NULL,
                                p->pass == DW ? c->dw : NULL, c->x, c->w, p->pass == FWD ? c->b : NULL,
                                c->dy, &c->g, p->pass != FWD, 0, 0, 0};
    return call;
}
static void cpu_pass_run(void *q) {
    const cpu_pass *p = (const cpu_pass *)q;
    mgpu__cpu_conv_call call = cpu_call(p);
    mgpu__cpu_conv_by(cpu_ways[p->way], &call);
}
/* The pass by a way, in microseconds per call; 0 where the way has no kernel for it. */
static double cpu_pass_us(conv_ctx *c, int pass, int way, int steps) {
    cpu_pass p = {c, pass, way};
    mgpu__cpu_conv_call call = cpu_call(&p);
    if (!mgpu__cpu_conv_computes(cpu_ways[way], &call)) return 0;
    return time_us(c->dev, cpu_pass_run, &p, steps);
}
/* One layer's row of passes. */
static void cpu_methods_of(mgpu_device *dev, const conv_case *cc, int batch, int steps) {
    conv_ctx c;
    memset(&c, 0, sizeof c);
    c.dev = dev;
    c.stride = cc->stride;
    c.pad = cc->pad;
    mgpu_manual_seed(1);
    c.x = mgpu_randn(dev, mgpu_shape4(batch, cc->c, cc->h, cc->h), 0, 1);
    c.w = mgpu_randn(dev, mgpu_shape4(cc->k, cc->c, cc->r, cc->r), 0, 0.1f);
    c.b = mgpu_zeros(dev, mgpu_shape1(cc->k));
    c.g = mgpu__conv_geometry("bench/convolutions", c.x->shape, c.w->shape, cc->stride, cc->pad);
    c.y = mgpu_empty(dev, mgpu_shape4(batch, cc->k, c.g.p, c.g.q));
    c.dy = mgpu_randn(dev, c.y->shape, 0, 1);
    c.dx = mgpu_empty(dev, c.x->shape);
    c.dw = mgpu_empty(dev, c.w->shape);
    const char *pass_names[PASSES] = {"fwd", "dx", "dW"};
    for (int pass = 0; pass < PASSES; pass++) {
        printf("%-24s %5d %5d %4s", pass == FWD ? cc->name : "", cc->count, batch, pass_names[pass]);
        for (int way = 0; way < CPU_WAYS; way++) {
            double us = cpu_pass_us(&c, pass, way, steps);
            if (us > 0) printf(" %10.1f", us);
            else printf(" %10s", "-");
        }
        printf("\n");
    }
    mgpu_tensor *all[] = {c.x, c.w, c.b, c.y, c.dy, c.dx, c.dw};
    for (int k = 0; k < 7; k++) mgpu_free(all[k]);
}
static void cpu_methods(mgpu_device *dev, int batch, int steps) {
    printf("on the CPU, by oneDNN's methods and mgpu's Winograd, microseconds per call (mean of %d)\n", steps);
    printf("%-24s %5s %5s %4s %10s %10s %10s %10s\n", "convolution", "count", "batch", "pass", "oneDNN",
           "chan-last", "oneDNN Win", "Winograd");
    for (int i = 0; i < N_CASES; i++) cpu_methods_of(dev, &cases[i], batch, steps);
    for (size_t i = 0; i < sizeof lenet_cases / sizeof lenet_cases[0]; i++)
        cpu_methods_of(dev, &lenet_cases[i], LENET_BATCH, steps);
}

/* One row of the table: a pass, its time with im2col (0: not timed that
   way) and with each of `tiles` tiles (tile_us; NULL when none; 0: not
   timed in that tile), the fastest tile marked. */
static void print_row(const char *name, int count, const char *pass, double flop, double im2col,
                      const double *tile_us, int tiles) {
    printf("%-24s %5d %5s %7.2f", name, count, pass, flop * 1e-9);
    if (im2col > 0) printf(" %9.1f", im2col);
    else printf(" %9s", "-");
    int fastest = -1;
    for (int t = 0; t < tiles; t++)
        if (tile_us[t] > 0 && (fastest < 0 || tile_us[t] < tile_us[fastest])) fastest = t;
    for (int t = 0; t < tiles; t++) {
        if (tile_us[t] > 0) printf(" %8.1f%c", tile_us[t], t == fastest ? '*' : ' ');
        else printf(" %8s ", "-");
    }
    double best = fastest >= 0 && (im2col <= 0 || tile_us[fastest] < im2col) ? tile_us[fastest] : im2col;
    printf(" %9.1f\n", tflops(flop, best));
}

int main(int argc, char **argv) {
    mgpu_options o;
    memset(&o, 0, sizeof o);
    int steps = 0;
    const mgpu_flag extra[] = {
        {"--steps", 'i', &steps, "calls timed per figure (default 20 on a GPU, 2 on the CPU)"},
    };
    mgpu_options_parse(&o, argc, argv,
                       "bench/convolutions: ResNet-18's convolutions, im2col against the fast kernels", extra, 1);
    mgpu_device *dev[1];
    mgpu_devices(1, !o.cpu, dev);
    int on_gpu = mgpu_device_is_gpu(dev[0]);
#if MGPU_CUDA
    int wgmma = on_gpu && mgpu__wgmma_usable(dev[0]);
#endif
    int batch = o.batch_size ? o.batch_size : on_gpu ? 256 : 32;
    if (!steps) steps = on_gpu ? 20 : 2;
    int tiles = 0; /* tile shapes timed: none without the implicit GEMM */
#if MGPU_CUDA
    if (on_gpu && mgpu__tf32_allowed(MGPU__TF32_CONV) && mgpu__conv_implicit_available())
        tiles = MGPU__TILE_KINDS;
    mgpu__conv_settings_from_environment();
    mgpu__conv_mode = MGPU__CONV_IM2COL; /* the public calls below take im2col */
#endif
    printf("ResNet-18's convolutions on [%s], batch %d: microseconds per call (mean of %d)\n",
           mgpu_device_name(dev[0]), batch, steps);
    if (on_gpu) printf("GPU arithmetic: %s\n", mgpu_tf32_str());
    if (on_gpu && !tiles) printf("implicit GEMM not timed: it needs TF32 and code for sm_80 or newer\n");
    printf("%-24s %5s %5s %7s %9s", "convolution", "count", "pass", "GFLOP", "im2col");
#if MGPU_CUDA
    for (int t = 0; t < tiles; t++) printf(" %9s", mgpu__implicit_tile_names[t]);
#endif
    printf(" %9s\n", "TFLOP/s");

    /* a step's convolutions, in microseconds: [0] im2col, [1] implicit with
       the fastest kernels, [2] the faster per pass, as MGPU_CONV=timed chooses */
    double step_us[3] = {0, 0, 0}, step_flop = 0;
    for (int i = 0; i < N_CASES; i++) {
        const conv_case *cc = &cases[i];
        conv_ctx c;
        memset(&c, 0, sizeof c);
        c.dev = dev[0];
        c.stride = cc->stride;
        c.pad = cc->pad;
        c.first = i == 0;
        mgpu_manual_seed(1);
        c.x = mgpu_randn(dev[0], mgpu_shape4(batch, cc->c, cc->h, cc->h), 0, 1);
        c.w = mgpu_randn(dev[0], mgpu_shape4(cc->k, cc->c, cc->r, cc->r), 0, 0.1f);
        c.b = mgpu_zeros(dev[0], mgpu_shape1(cc->k));
        c.g = mgpu__conv_geometry("bench/convolutions", c.x->shape, c.w->shape, cc->stride, cc->pad);
        c.y = mgpu_empty(dev[0], mgpu_shape4(batch, cc->k, c.g.p, c.g.q));
        c.dy = mgpu_randn(dev[0], c.y->shape, 0, 1);
        c.dx = mgpu_empty(dev[0], c.x->shape);
        c.dw = mgpu_empty(dev[0], c.w->shape);
        double flop = 2.0 * batch * cc->k * c.g.p * c.g.q * cc->c * cc->r * cc->r;

        /* im2col: the forward, and the backward (dx and dW together) */
        double fwd = time_us(dev[0], im2col_forward, &c, steps);
        double bwd = time_us(dev[0], im2col_backward, &c, steps);
        print_row(cc->name, cc->count, "fwd", flop, fwd, NULL, 0);
        print_row("", cc->count, c.first ? "dW" : "dx+dW", flop * (c.first ? 1 : 2), bwd, NULL, 0);
        step_us[0] += cc->count * (fwd + bwd);
        step_flop += cc->count * flop * (c.first ? 2 : 3);
        double best_of_all = fwd + bwd;
#if MGPU_CUDA
        if (tiles) { /* each gradient with its half of im2col alone; each pass with
                        each kernel that fits, in each tile */
            double half[PASSES] = {0, c.first ? 0 : time_us(dev[0], im2col_dx, &c, steps),
                                   time_us(dev[0], im2col_dw, &c, steps)};
            if (!c.first) print_row("  im2col alone", cc->count, "dx", flop, half[DX], NULL, 0);
            print_row("  im2col alone", cc->count, "dW", flop, half[DW], NULL, 0);
            double best[PASSES] = {0, 0, 0};
            conv_run runs[PASSES] = {implicit_forward, implicit_dx, implicit_dw};
            const mgpu__conv_try tries[PASSES] = {MGPU__TRY_Y, MGPU__TRY_DX, MGPU__TRY_DW};
            for (int pass = 0; pass < PASSES; pass++) {
                if (pass == DX && c.first) continue;
                for (int i = 0; i < CANDIDATE_ROWS; i++) { /* the trial's candidates */
                    double us[TILE_COLUMNS] = {0}; /* (0: not a candidate) */
                    int timed = 0;
                    for (int t = 0; t < tiles; t++) {
                        if (!candidate(tries[pass], &c.g, (mgpu__implicit_tile)t, wgmma, i, &c.kernel)) continue;
                        us[t] = time_us(dev[0], runs[pass], &c, steps);
                        if (!best[pass] || us[t] < best[pass]) best[pass] = us[t];
                        timed++;
                    }
                    if (!timed) continue;
                    char row[48];
                    int choice = i % MGPU__KERNEL_CHOICES; /* (wgmma: as mma.sync) */
                    const char *by = i >= MGPU__KERNEL_CHOICES ? " wgmma" : "";
                    if (pass == DW) snprintf(row, sizeof row, "  channels-last ~%d", mgpu__conv_dw_block_choices[choice]);
                    else if (choice > 0)
                        snprintf(row, sizeof row, "  channels-last%s /%d", by, mgpu__conv_slice_choices[choice]);
                    else snprintf(row, sizeof row, "  channels-last%s", by);
                    print_row(row, cc->count, pass == FWD ? "fwd" : pass == DX ? "dx" : "dW", flop, 0, us, tiles);
                }
                const mgpu__implicit_kernel untiled[] = { /* (one figure each) */
                    mgpu__kernel_of(MGPU__WINOGRAD, MGPU__TILE_64x64, 1, 0),
                    mgpu__kernel_of(MGPU__FEW_INPUTS, MGPU__TILE_64x64, 1, 0),
                    mgpu__kernel_of(MGPU__STRIDE2_DX, MGPU__TILE_64x64, 1, 0)};
                const char *untiled_names[] = {"  Winograd", "  few inputs", "  channels-last stride-2 dx"};
                for (int m = 0; m < 3; m++) {
                    if (!mgpu__conv_method_fits(untiled[m].method, tries[pass], &c.g)) continue;
                    double us[TILE_COLUMNS] = {0};
                    c.kernel = untiled[m];
                    us[0] = time_us(dev[0], runs[pass], &c, steps);
                    if (!best[pass] || us[0] < best[pass]) best[pass] = us[0];
                    print_row(untiled_names[m], cc->count, pass == FWD ? "fwd" : pass == DX ? "dx" : "dW", flop, 0,
                              us, tiles);
                }
                step_us[1] += cc->count * best[pass];
            }
            /* (as the library's auto plan: each gradient by the faster of
               its implicit GEMM and its half of im2col, the two against
               im2col's whole backward) */
            double fwd_best = best[FWD] < fwd ? best[FWD] : fwd;
            double dx_best = c.first || half[DX] < best[DX] ? half[DX] : best[DX];
            double dw_best = half[DW] < best[DW] ? half[DW] : best[DW];
            double bwd_best = dx_best + dw_best < bwd ? dx_best + dw_best : bwd;
            best_of_all = fwd_best + bwd_best;
        }
#endif
        step_us[2] += cc->count * best_of_all;
        mgpu_free(c.x);
        mgpu_free(c.w);
        mgpu_free(c.b);
        mgpu_free(c.y);
        mgpu_free(c.dy);
        mgpu_free(c.dx);
        mgpu_free(c.dw);
    }
    if (!on_gpu) cpu_methods(dev[0], batch, steps);
    printf("a step's convolutions, %.1f GFLOP: im2col %.3f ms (%.1f TFLOP/s)\n", step_flop * 1e-9,
           step_us[0] * 1e-3, tflops(step_flop, step_us[0]));
    if (tiles)
        printf("  implicit, the fastest kernels: %.3f ms (%.1f TFLOP/s); the library's choice per "
               "pass: %.3f ms (%.1f TFLOP/s)\n",
               step_us[1] * 1e-3, tflops(step_flop, step_us[1]), step_us[2] * 1e-3,
               tflops(step_flop, step_us[2]));
    printf("RESULT conv on=[%s] batch=%d im2col_ms=%.4f", mgpu_device_name(dev[0]), batch,
           step_us[0] * 1e-3);
    if (tiles) printf(" implicit_ms=%.4f best_ms=%.4f", step_us[1] * 1e-3, step_us[2] * 1e-3);
    printf("\n");
    return 0;
}
