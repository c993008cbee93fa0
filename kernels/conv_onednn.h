/* kernels/conv_onednn.h: convolutions by oneDNN on CPU devices.

   oneDNN (Intel's deep-learning primitives, Debian's libdnnl-dev) is what
   PyTorch's CPU convolutions run on. Its kernels work in registers on
   its own blocked layouts (for AVX-512, 16 channels innermost:
   nChw16c), with no col buffer. Here it is a candidate beside conv.h's
   im2col and OpenBLAS: mgpu/convolution.h's CPU section takes a way
   for each shape and pass, by rule or by timing them (a pass that
   oneDNN has no kernel for keeps im2col). Compiled where MGPU_ONEDNN is
   1 (the Makefile sets it when oneDNN is installed); without it this
   file is empty.

   Three methods (mgpu__onednn_method):
     direct         the algorithm PyTorch asks for (dnnl_convolution_direct):
                    C R S multiply-adds for each output value, in the
                    layouts oneDNN prefers (below);
     channels-last  the same, on activations in NHWC (dnnl_acdb): with
                    16-float vectors a blocked layout pads the channels
                    to a multiple of 16 and computes on the padding too
                    (20 channels as 32), where channels-last kernels
                    work on the channels there are;
     Winograd       dnnl_convolution_winograd: oneDNN's F(4x4, 3x3), for
                    3x3 windows at stride 1, on AVX-512 only. It turns
                    6 x 6 tiles of the input and the 3 x 3 filters into
                    6 x 6 tiles, multiplies those element by element,
                    summed over the channels (36 products for a 4 x 4
                    tile of output where direct takes 144), and turns
                    the result back: fewer products, more memory
                    traffic, a larger rounding error.
   Where a method has no kernel for a pass, that pass has no plan by it.

   One pass by one method is a plan, made once per shape and then
   reused:
     forward  y  = conv(x, w) + b     reads x and w, writes y
     dx       dx = conv_dx(dy, w)     reads w and dy, writes dx
     dW       dW = conv_dw(x, dy)     reads x and dy, writes dW
   The tensors stay in mgpu's layouts (NCHW, and KCRS for the weights).
   oneDNN chooses the layouts its fastest kernel wants (format "any";
   for the activations, channels-last fixes NHWC), and a plan holds the
   reorders that copy each input into them and the output back: three
   copies of a tensor around one convolution, cheap beside the C R S
   multiply-adds of each output value. Where oneDNN takes a tensor as it
   is, the plan copies nothing. The output's reorder also
   adds to the tensor instead of writing it, where the caller accumulates
   (a sum post-op: dW += its gradient).

   Threads. Debian's oneDNN runs on OpenMP and uses as many threads as
   the calling thread's OpenMP setting allows: the device's worker sets it
   to the device's share of the cores (mgpu/queues.h). Its sums (dW's
   over the batch) are split among them, so its results, unlike the
   library's own kernels', may change with the number of threads.

   defines: MGPU_ONEDNN_CHECK, mgpu__onednn_method, mgpu__onednn_plan,
            mgpu__onednn_plan_for, mgpu__onednn_args, mgpu__onednn_conv_cpu */
#ifndef MGPU_KERNELS_CONV_ONEDNN_H
#define MGPU_KERNELS_CONV_ONEDNN_H
#if MGPU_ONEDNN
#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl_debug.h>
#include "conv.h"

/* Every oneDNN call is checked: a failure stops the program with the
   call, where it was made, the status's name, and the layer whose pass
   was being enqueued (plans are made then). */
#define MGPU_ONEDNN_CHECK(call)                                                              \
    do {                                                                                     \
        dnnl_status_t mgpu__dnnl_status = (call);                                            \
        if (mgpu__dnnl_status != dnnl_success)                                               \
            mgpu_fatal_at(__FILE__, __LINE__, "oneDNN: %s failed: %s%s%s", #call,            \
                          dnnl_status2str(mgpu__dnnl_status),                                \
                          MGPU__IN_LAYER(mgpu__layer_enqueuing));                            \
    } while (0)

typedef enum { MGPU__ONEDNN_DIRECT, MGPU__ONEDNN_CHANNELS_LAST, MGPU__ONEDNN_WINOGRAD } mgpu__onednn_method;

/* A pass's tensors by role: its two inputs, its output. */
enum { MGPU__ONEDNN_IN_A, MGPU__ONEDNN_IN_B, MGPU__ONEDNN_OUT, MGPU__ONEDNN_TENSORS };

typedef struct {
    dnnl_primitive_t conv;
    int arg[MGPU__ONEDNN_TENSORS];                 /* DNNL_ARG_* of each tensor */
    dnnl_memory_desc_t plain[MGPU__ONEDNN_TENSORS]; /* mgpu's layout */
    dnnl_memory_desc_t chosen[MGPU__ONEDNN_TENSORS];/* the kernel's */
    dnnl_primitive_t reorder[MGPU__ONEDNN_TENSORS]; /* plain <-> chosen, or NULL: taken as it is */
    size_t bytes[MGPU__ONEDNN_TENSORS];             /* of a chosen-layout copy (0: none) */
    dnnl_memory_desc_t bias;
    /* each primitive's scratchpad (conv's, then the reorders'); they take turns in one buffer */
    dnnl_memory_desc_t scratch[1 + MGPU__ONEDNN_TENSORS];
    size_t scratch_bytes; /* the largest */
} mgpu__onednn_plan;

/* The CPU engine, made at the first plan (plans are made by the thread
   that enqueues the convolutions). */
static dnnl_engine_t mgpu__onednn_engine(void) {
    static dnnl_engine_t engine;
    if (!engine) MGPU_ONEDNN_CHECK(dnnl_engine_create(&engine, dnnl_cpu, 0));
    return engine;
}

static void mgpu__onednn_md(dnnl_memory_desc_t *md, int n, int c, int h, int w, dnnl_format_tag_t tag) {
    dnnl_dims_t dims = {n, c, h, w};
    MGPU_ONEDNN_CHECK(dnnl_memory_desc_init_by_tag(md, 4, dims, dnnl_f32, tag));
}

/* Attributes that give a primitive's scratch memory to the caller: by
   default oneDNN keeps one per thread, sized when a primitive is made,
   and a primitive made on one thread (the enqueuing one) and run on
   another (the device's worker) would overrun it. The plan takes it from
   the device's allocator instead. */
static dnnl_primitive_attr_t mgpu__onednn_attr(void) {
    dnnl_primitive_attr_t attr;
    MGPU_ONEDNN_CHECK(dnnl_primitive_attr_create(&attr));
    MGPU_ONEDNN_CHECK(dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user));
    return attr;
}
/* Makes the primitive of pd, and keeps its scratchpad's description. */
static dnnl_primitive_t mgpu__onednn_make(mgpu__onednn_plan *p, dnnl_primitive_desc_t pd, int which) {
    dnnl_primitive_t primitive;
    p->scratch[which] = *dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    size_t bytes = dnnl_memory_desc_get_size(&p->scratch[which]);
    if (bytes > p->scratch_bytes) p->scratch_bytes = bytes;
    MGPU_ONEDNN_CHECK(dnnl_primitive_create(&primitive, pd));
    MGPU_ONEDNN_CHECK(dnnl_primitive_desc_destroy(pd));
    return primitive;
}

/* A reorder from one layout to another; add: to what the destination
   holds (a sum post-op), instead of over it. NULL where oneDNN has none. */
static dnnl_primitive_t mgpu__onednn_reorder(mgpu__onednn_plan *p, int t, const dnnl_memory_desc_t *from,
                                             const dnnl_memory_desc_t *to, int add) {
    dnnl_engine_t engine = mgpu__onednn_engine();
    dnnl_primitive_attr_t attr = mgpu__onednn_attr();
    if (add) {
        dnnl_post_ops_t ops;
        MGPU_ONEDNN_CHECK(dnnl_post_ops_create(&ops));
        MGPU_ONEDNN_CHECK(dnnl_post_ops_append_sum(ops, 1.0f));
        MGPU_ONEDNN_CHECK(dnnl_primitive_attr_set_post_ops(attr, ops));
        MGPU_ONEDNN_CHECK(dnnl_post_ops_destroy(ops));
    }
    dnnl_primitive_desc_t pd;
    dnnl_status_t made = dnnl_reorder_primitive_desc_create(&pd, from, engine, to, engine, attr);
    MGPU_ONEDNN_CHECK(dnnl_primitive_attr_destroy(attr));
    return made == dnnl_success ? mgpu__onednn_make(p, pd, 1 + t) : NULL;
}

/* The plans made so far; NULL where oneDNN has no kernel for the pass. */
typedef struct {
    mgpu__conv_geom g;
    mgpu__conv_pass pass;
    mgpu__onednn_method method;
    int with_bias, accumulate, threads;
    mgpu__onednn_plan *plan;
} mgpu__onednn_known;
static mgpu__onednn_known mgpu__onednn_plans[2048]; /* (per shape, pass, method, adding and threads) */
static int mgpu__onednn_plan_count;

/* Makes the pass's plan, or returns NULL if oneDNN has no kernel for it. */
static mgpu__onednn_plan *mgpu__onednn_plan_new(const mgpu__conv_geom *g, mgpu__conv_pass pass,
                                                mgpu__onednn_method method, int with_bias, int accumulate) {
    dnnl_engine_t engine = mgpu__onednn_engine();
    dnnl_alg_kind_t algorithm = method == MGPU__ONEDNN_WINOGRAD ? dnnl_convolution_winograd : dnnl_convolution_direct;
    dnnl_format_tag_t activations = method == MGPU__ONEDNN_CHANNELS_LAST ? dnnl_acdb : dnnl_format_tag_any;
    dnnl_memory_desc_t x_any, w_any, y_any, x, w, y, bias; /* (x_any: x in the layout the kernel takes) */
    mgpu__onednn_md(&x, g->n, g->c, g->h, g->w, dnnl_nchw);
    mgpu__onednn_md(&w, g->k, g->c, g->r, g->s, dnnl_oihw);
    mgpu__onednn_md(&y, g->n, g->k, g->p, g->q, dnnl_nchw);
    mgpu__onednn_md(&x_any, g->n, g->c, g->h, g->w, activations);
    mgpu__onednn_md(&w_any, g->k, g->c, g->r, g->s, dnnl_format_tag_any);
    mgpu__onednn_md(&y_any, g->n, g->k, g->p, g->q, activations);
    dnnl_dims_t bias_dims = {g->k}, strides = {g->stride, g->stride}, padding = {g->pad, g->pad};
    MGPU_ONEDNN_CHECK(dnnl_memory_desc_init_by_tag(&bias, 1, bias_dims, dnnl_f32, dnnl_a));
    /* the forward pass's description: the backward passes take it as a hint */
    dnnl_convolution_desc_t forward, backward;
    dnnl_primitive_desc_t forward_pd, pd;
    dnnl_primitive_attr_t attr = mgpu__onednn_attr();
    MGPU_ONEDNN_CHECK(dnnl_convolution_forward_desc_init(&forward, dnnl_forward_training, algorithm,
                                                         &x_any, &w_any, with_bias ? &bias : NULL, &y_any, strides,
                                                         padding, padding));
    if (dnnl_primitive_desc_create(&forward_pd, &forward, attr, engine, NULL) != dnnl_success) {
        MGPU_ONEDNN_CHECK(dnnl_primitive_attr_destroy(attr));
        return NULL;
    }
    dnnl_status_t made = dnnl_success;
    if (pass == MGPU__PASS_Y) {
        pd = forward_pd;
        forward_pd = NULL;
    } else if (pass == MGPU__PASS_DX) {
        MGPU_ONEDNN_CHECK(dnnl_convolution_backward_data_desc_init(&backward, algorithm, &x_any, &w_any,
                                                                   &y_any, strides, padding, padding));
        made = dnnl_primitive_desc_create(&pd, &backward, attr, engine, forward_pd);
    } else {
        MGPU_ONEDNN_CHECK(dnnl_convolution_backward_weights_desc_init(&backward, algorithm, &x_any,
                                                                      &w_any, NULL, &y_any, strides, padding,
                                                                      padding));
        made = dnnl_primitive_desc_create(&pd, &backward, attr, engine, forward_pd);
    }
    MGPU_ONEDNN_CHECK(dnnl_primitive_attr_destroy(attr));
    if (forward_pd) MGPU_ONEDNN_CHECK(dnnl_primitive_desc_destroy(forward_pd));
    if (made != dnnl_success) return NULL;

    mgpu__onednn_plan *p = (mgpu__onednn_plan *)mgpu__xcalloc(1, sizeof *p);
    p->bias = bias;
    /* each pass's tensors: its inputs a and b, its output */
    static const int args[3][MGPU__ONEDNN_TENSORS] = {
        {DNNL_ARG_SRC, DNNL_ARG_WEIGHTS, DNNL_ARG_DST},
        {DNNL_ARG_WEIGHTS, DNNL_ARG_DIFF_DST, DNNL_ARG_DIFF_SRC},
        {DNNL_ARG_SRC, DNNL_ARG_DIFF_DST, DNNL_ARG_DIFF_WEIGHTS}};
    const dnnl_memory_desc_t *plain[3][MGPU__ONEDNN_TENSORS] = {{&x, &w, &y}, {&w, &y, &x}, {&x, &y, &w}};
    for (int t = 0; t < MGPU__ONEDNN_TENSORS; t++) {
        p->arg[t] = args[pass][t];
        p->plain[t] = *plain[pass][t];
        p->chosen[t] = *dnnl_primitive_desc_query_md(pd, dnnl_query_exec_arg_md, p->arg[t]);
        int output = t == MGPU__ONEDNN_OUT;
        /* (an output added to goes through a reorder even in the same layout: it does the adding) */
        if (dnnl_memory_desc_equal(&p->chosen[t], &p->plain[t]) && !(output && accumulate)) continue;
        p->reorder[t] = output ? mgpu__onednn_reorder(p, t, &p->chosen[t], &p->plain[t], accumulate)
                               : mgpu__onednn_reorder(p, t, &p->plain[t], &p->chosen[t], 0);
        p->bytes[t] = dnnl_memory_desc_get_size(&p->chosen[t]);
        if (!p->reorder[t]) { /* (as a convolution without a kernel: im2col takes the pass) */
            for (int made = 0; made < t; made++)
                if (p->reorder[made]) MGPU_ONEDNN_CHECK(dnnl_primitive_destroy(p->reorder[made]));
            MGPU_ONEDNN_CHECK(dnnl_primitive_desc_destroy(pd));
            free(p);
            return NULL;
        }
    }
    p->conv = mgpu__onednn_make(p, pd, 0);
    return p;
}

/* The plan for a pass, made at its first call with the shape; NULL where
   oneDNN has no kernel. Made with the device's share of the cores as the
   OpenMP setting: some of oneDNN's kernels cut their work for the thread
   count they are made for. Not thread-safe: the chapters enqueue their
   convolutions from one thread, as the GPU's trial assumes too. */
static mgpu__onednn_plan *mgpu__onednn_plan_for(const mgpu__conv_geom *g, mgpu__conv_pass pass,
                                                mgpu__onednn_method method, int with_bias, int accumulate,
                                                int threads) {
    for (int i = 0; i < mgpu__onednn_plan_count; i++) {
        const mgpu__onednn_known *k = &mgpu__onednn_plans[i];
        if (!memcmp(&k->g, g, sizeof *g) && k->pass == pass && k->method == method &&
            k->with_bias == with_bias && k->accumulate == accumulate && k->threads == threads)
            return k->plan;
    }
#ifdef _OPENMP
    int before = omp_get_max_threads();
    omp_set_num_threads(threads);
#endif
    mgpu__onednn_plan *plan = mgpu__onednn_plan_new(g, pass, method, with_bias, accumulate);
#ifdef _OPENMP
    omp_set_num_threads(before);
#endif
    MGPU_REQUIRE(mgpu__onednn_plan_count < (int)(sizeof mgpu__onednn_plans / sizeof mgpu__onednn_plans[0]),
                 "conv2d: more than %d oneDNN plans", (int)(sizeof mgpu__onednn_plans / sizeof mgpu__onednn_plans[0]));
    mgpu__onednn_known k = {*g, pass, method, with_bias, accumulate, threads, plan};
    mgpu__onednn_plans[mgpu__onednn_plan_count++] = k;
    return plan;
}

/* One pass: the tensors (mgpu's layouts), the chosen-layout copies and
   the scratchpad (from the device's allocator; NULL where the plan copies
   nothing or needs none), the bias (forward, or NULL). */
typedef struct {
    const mgpu__onednn_plan *plan;
    float *tensor[MGPU__ONEDNN_TENSORS];
    float *copy[MGPU__ONEDNN_TENSORS];
    void *scratch; /* scratch_bytes of the plan's, or NULL where it needs none */
    const float *bias;
} mgpu__onednn_args;

static dnnl_memory_t mgpu__onednn_memory(const dnnl_memory_desc_t *md, const void *data) {
    dnnl_memory_t m;
    MGPU_ONEDNN_CHECK(dnnl_memory_create(&m, md, mgpu__onednn_engine(), (void *)data));
    return m;
}
/* Runs a primitive with its arguments (room for one more) and its scratchpad. */
static void mgpu__onednn_run(const mgpu__onednn_args *a, int which, dnnl_primitive_t primitive, dnnl_stream_t stream,
                             int n, dnnl_exec_arg_t *args) {
    dnnl_memory_t scratch = mgpu__onednn_memory(&a->plan->scratch[which], a->scratch);
    args[n].arg = DNNL_ARG_SCRATCHPAD;
    args[n].memory = scratch;
    MGPU_ONEDNN_CHECK(dnnl_primitive_execute(primitive, stream, n + 1, args));
    MGPU_ONEDNN_CHECK(dnnl_stream_wait(stream)); /* (before the next primitive takes the scratchpad) */
    MGPU_ONEDNN_CHECK(dnnl_memory_destroy(scratch));
}

/* The inputs into the kernel's layouts, the convolution, the output back. */
static void mgpu__onednn_conv_cpu(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__onednn_args *a = (const mgpu__onednn_args *)args;
    const mgpu__onednn_plan *p = a->plan;
    dnnl_stream_t stream;
    MGPU_ONEDNN_CHECK(dnnl_stream_create(&stream, mgpu__onednn_engine(), dnnl_stream_default_flags));
    dnnl_memory_t plain[MGPU__ONEDNN_TENSORS], chosen[MGPU__ONEDNN_TENSORS], bias = NULL;
    dnnl_exec_arg_t conv_args[MGPU__ONEDNN_TENSORS + 2];
    for (int t = 0; t < MGPU__ONEDNN_TENSORS; t++) {
        plain[t] = mgpu__onednn_memory(&p->plain[t], a->tensor[t]);
        chosen[t] = p->reorder[t] ? mgpu__onednn_memory(&p->chosen[t], a->copy[t]) : plain[t];
        conv_args[t].arg = p->arg[t];
        conv_args[t].memory = chosen[t];
    }
    int nargs = MGPU__ONEDNN_TENSORS;
    if (a->bias) {
        bias = mgpu__onednn_memory(&p->bias, a->bias);
        conv_args[nargs].arg = DNNL_ARG_BIAS;
        conv_args[nargs++].memory = bias;
    }
    for (int t = MGPU__ONEDNN_IN_A; t <= MGPU__ONEDNN_IN_B; t++)
        if (p->reorder[t]) {
            dnnl_exec_arg_t in[3] = {{DNNL_ARG_FROM, plain[t]}, {DNNL_ARG_TO, chosen[t]}};
            mgpu__onednn_run(a, 1 + t, p->reorder[t], stream, 2, in);
        }
    mgpu__onednn_run(a, 0, p->conv, stream, nargs, conv_args);
    if (p->reorder[MGPU__ONEDNN_OUT]) {
        dnnl_exec_arg_t out[3] = {{DNNL_ARG_FROM, chosen[MGPU__ONEDNN_OUT]}, {DNNL_ARG_TO, plain[MGPU__ONEDNN_OUT]}};
        mgpu__onednn_run(a, 1 + MGPU__ONEDNN_OUT, p->reorder[MGPU__ONEDNN_OUT], stream, 2, out);
    }
    for (int t = 0; t < MGPU__ONEDNN_TENSORS; t++) {
        if (chosen[t] != plain[t]) MGPU_ONEDNN_CHECK(dnnl_memory_destroy(chosen[t]));
        MGPU_ONEDNN_CHECK(dnnl_memory_destroy(plain[t]));
    }
    if (bias) MGPU_ONEDNN_CHECK(dnnl_memory_destroy(bias));
    MGPU_ONEDNN_CHECK(dnnl_stream_destroy(stream));
}
#endif
#endif
