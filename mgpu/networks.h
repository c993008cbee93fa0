/* mgpu/networks.h: a network as a list of layers with parameters,
   buffers and saved activations: the builder (mgpu_net_add_*, LeNet,
   ResNet-18), the forward and backward passes, and activation
   recomputation (chapter 5: a segment keeps its input alone and runs its
   forward pass again in the backward pass). Chapters 2 to 6 train these
   networks.
   defines: mgpu_net_new, mgpu_net_add_conv, mgpu_net_add_batchnorm,
   mgpu_net_add_relu, mgpu_net_add_avg_pool, mgpu_net_add_global_avg_pool,
   mgpu_net_add_residual, mgpu_net_add_linear, mgpu_net_add_layer,
   mgpu_resnet18, mgpu_lenet, mgpu_net_forward, mgpu_net_backward,
   mgpu_net_zero_grad, mgpu_net_recompute, mgpu_net_free_activations,
   mgpu_net_input_grad, mgpu_net_want_input_grad, mgpu_net_sync_batchnorm */
/* The `training` of a layer's forward pass: 0 evaluation, 1 training, or
   MGPU__RECOMPUTE, training again for activation recomputation (batch norm
   takes the batch's statistics and leaves its running ones). */
#define MGPU__RECOMPUTE 2

/* A layer's channels-last copies on a GPU (kernels/channels_last.h),
   where a convolution reads them: a convolution's of its input (input_t:
   the one the layer before wrote, or own_input_t, its own); a batch
   norm's (or a residual block's) of its output, written beside it, and
   of its input gradient, written instead of it (output_t, dinput_t); a
   convolution's of its weights, for its forward kernel (w_t) and turned
   round for its input gradient's (w'_t), where those read them: made at
   the first pass that does, then remade by each forward pass of the
   network, all in a few launches (mgpu__net_weight_copies). */
struct mgpu__layer_copies {
    int input_from_batch_norm; /* a convolution whose input is a batch norm's output (a block's) */
    const mgpu_tensor *input_t;
    mgpu_tensor *own_input_t, *output_t, *dinput_t;
    mgpu_tensor *weight_t, *weight_turned_t;
};
static mgpu_layer *mgpu__layer_new(mgpu_layer_kind kind, const char *name) {
    mgpu_layer *l = (mgpu_layer *)mgpu__xcalloc(1, sizeof *l);
    l->copies = (struct mgpu__layer_copies *)mgpu__xcalloc(1, sizeof *l->copies);
    l->kind = kind;
    l->need_dinput = 1;
    snprintf(l->name, sizeof l->name, "%s", name);
    return l;
}

/* A parameter: its value and a zero gradient of the same shape. */
static mgpu_param mgpu__param_new(mgpu_tensor *value) {
    mgpu_param p;
    p.value = value;
    p.grad = mgpu_zeros(value->device, value->shape);
    return p;
}

/* PyTorch's default bias initialisation: Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)). */
static mgpu_tensor *mgpu__bias_init(mgpu_device *d, int n, int fan_in) {
    float bound = 1.0f / sqrtf((float)fan_in);
    return mgpu_rand_uniform(d, mgpu_shape1(n), -bound, bound);
}

static mgpu_layer *mgpu__conv_new(const char *name, int in, int out, int kernel, int stride, int pad,
                                  mgpu_device *d) {
    mgpu_layer *l = mgpu__layer_new(MGPU_LAYER_CONV, name);
    l->in_channels = in;
    l->out_channels = out;
    l->kernel = kernel;
    l->stride = stride;
    l->pad = pad;
    l->weight = mgpu__param_new(mgpu_randn(d, mgpu_shape4(out, in, kernel, kernel), 0.0f, 0.01f));
    l->bias = mgpu__param_new(mgpu__bias_init(d, out, in * kernel * kernel));
    return l;
}

static mgpu_layer *mgpu__batchnorm_new(const char *name, int channels, int fuse_relu, mgpu_device *d) {
    mgpu_layer *l = mgpu__layer_new(MGPU_LAYER_BATCHNORM, name);
    l->in_channels = l->out_channels = channels;
    l->fuse_relu = fuse_relu;
    l->momentum = 0.1f;
    l->weight = mgpu__param_new(mgpu_ones(d, mgpu_shape1(channels)));
    l->bias = mgpu__param_new(mgpu_zeros(d, mgpu_shape1(channels)));
    l->running_mean = mgpu_zeros(d, mgpu_shape1(channels));
    l->running_var = mgpu_ones(d, mgpu_shape1(channels));
    l->save_mean = mgpu_zeros(d, mgpu_shape1(channels));
    l->save_invstd = mgpu_zeros(d, mgpu_shape1(channels));
    return l;
}

/* The batch norms of net, the residual blocks' too, into out (room for
   2 a layer); returns how many. */
static int mgpu__net_batch_norms(const mgpu_net *net, mgpu_layer **out) {
    int count = 0;
    for (int i = 0; i < net->nlayers; i++) {
        mgpu_layer *l = net->layers[i];
        if (l->kind == MGPU_LAYER_BATCHNORM) out[count++] = l;
        if (l->kind == MGPU_LAYER_RESIDUAL) out[count++] = l->bn1, out[count++] = l->bn2;
    }
    return count;
}
/* Whether a batch norm of net is synchronised over a group. */
static int mgpu__net_synced(const mgpu_net *net) {
    mgpu_layer **bns = (mgpu_layer **)mgpu__xmalloc(sizeof *bns * (2 * (size_t)net->nlayers + 1));
    int count = mgpu__net_batch_norms(net, bns), synced = 0;
    for (int i = 0; i < count; i++) synced |= bns[i]->sync != NULL;
    free(bns);
    return synced;
}

/* The book's Residual: conv3x3-BN-ReLU-conv3x3-BN, plus the input (through
   a strided 1x1 convolution when the shape changes), then ReLU. */
static mgpu_layer *mgpu__residual_new(const char *name, int in, int out, int stride, mgpu_device *d) {
    char sub[64];
    mgpu_layer *l = mgpu__layer_new(MGPU_LAYER_RESIDUAL, name);
    l->in_channels = in;
    l->out_channels = out;
    l->stride = stride;
    snprintf(sub, sizeof sub, "%s.conv1", name);
    l->conv1 = mgpu__conv_new(sub, in, out, 3, stride, 1, d);
    snprintf(sub, sizeof sub, "%s.conv2", name);
    l->conv2 = mgpu__conv_new(sub, out, out, 3, 1, 1, d);
    l->conv2->copies->input_from_batch_norm = 1; /* bn1's */
    if (in != out || stride != 1) {
        snprintf(sub, sizeof sub, "%s.conv3", name);
        l->shortcut = mgpu__conv_new(sub, in, out, 1, stride, 0, d);
    }
    snprintf(sub, sizeof sub, "%s.bn1", name);
    l->bn1 = mgpu__batchnorm_new(sub, out, 1, d);
    snprintf(sub, sizeof sub, "%s.bn2", name);
    l->bn2 = mgpu__batchnorm_new(sub, out, 0, d);
    return l;
}

static mgpu_layer *mgpu__linear_new(const char *name, int in, int out, mgpu_device *d) {
    mgpu_layer *l = mgpu__layer_new(MGPU_LAYER_LINEAR, name);
    l->in_channels = in;
    l->out_channels = out;
    /* stored [in, out]: y = x W + b, as the book's from-scratch layers */
    l->weight = mgpu__param_new(mgpu_randn(d, mgpu_shape2(in, out), 0.0f, 0.01f));
    l->bias = mgpu__param_new(mgpu__bias_init(d, out, in));
    return l;
}

/* Lists a layer's parameters and buffers in the net, in PyTorch's order
   (the order of the attributes of the book's modules). */
static void mgpu__net_register(mgpu_net *net, mgpu_layer *l) {
    if (l->kind == MGPU_LAYER_RESIDUAL) {
        mgpu_layer *order[5] = {l->conv1, l->conv2, l->shortcut, l->bn1, l->bn2};
        for (int i = 0; i < 5; i++)
            if (order[i]) mgpu__net_register(net, order[i]);
        return;
    }
    if (net->nparams + 2 > net->params_room) {
        net->params_room = 2 * net->params_room + 16;
        net->params = (mgpu_param **)mgpu__xrealloc(net->params, net->params_room * sizeof *net->params);
        net->momentum = (mgpu_tensor **)mgpu__xrealloc(net->momentum, net->params_room * sizeof *net->momentum);
        net->second_moment = (mgpu_tensor **)mgpu__xrealloc(net->second_moment,
                                                            net->params_room * sizeof *net->second_moment);
        for (int i = net->nparams; i < net->params_room; i++) net->momentum[i] = net->second_moment[i] = NULL;
        net->step_values = (mgpu_tensor **)mgpu__xrealloc(net->step_values,
                                                          net->params_room * sizeof(mgpu_tensor *));
        net->step_grads = (const mgpu_tensor **)mgpu__xrealloc((void *)net->step_grads,
                                                               net->params_room * sizeof(mgpu_tensor *));
    }
    if (net->nbuffers + 2 > net->buffers_room) {
        net->buffers_room = 2 * net->buffers_room + 16;
        net->buffers = (mgpu_tensor ***)mgpu__xrealloc(net->buffers, net->buffers_room * sizeof *net->buffers);
    }
    if (l->weight.value) net->params[net->nparams++] = &l->weight;
    if (l->bias.value) net->params[net->nparams++] = &l->bias;
    if (l->running_mean) {
        net->buffers[net->nbuffers++] = &l->running_mean;
        net->buffers[net->nbuffers++] = &l->running_var;
    }
    /* what its tensors hold counts as the network's (mgpu_memory_category):
       its statistics with the parameters */
    mgpu_tensor *state[] = {l->weight.value, l->bias.value, l->running_mean, l->running_var, l->save_mean,
                            l->save_invstd};
    for (size_t i = 0; i < sizeof state / sizeof *state; i++)
        if (state[i]) mgpu__memory_recount(state[i], MGPU_MEMORY_PARAMETERS);
    if (l->weight.grad) mgpu__memory_recount(l->weight.grad, MGPU_MEMORY_GRADIENTS);
    if (l->bias.grad) mgpu__memory_recount(l->bias.grad, MGPU_MEMORY_GRADIENTS);
}

MGPU_DEF mgpu_net *mgpu_net_new(mgpu_device *dev) {
    mgpu_net *net = (mgpu_net *)mgpu__xcalloc(1, sizeof *net);
    net->device = dev;
    net->training = 1;
    return net;
}

/* Appends layer l and returns it. Nothing before the first layer wants
   its input gradient, so it computes none (batch norm's pass makes one
   anyway). */
/* What holds a network (mgpu_net.wrapped), and the calls that make and
   free it, for the errors that name them. */
#define MGPU__HELD_BY_PIPELINE 2
static const char *mgpu__holder(const mgpu_net *net, int call) {
    static const char *const names[2][3] = {{"a data-parallel wrapper", "mgpu_data_parallel_new", "mgpu_data_parallel_free"},
                                            {"a pipeline", "mgpu_pipeline_new", "mgpu_pipeline_free"}};
    return names[net->wrapped == MGPU__HELD_BY_PIPELINE][call];
}
static mgpu_layer *mgpu__net_add(mgpu_net *net, mgpu_layer *l) {
    MGPU_REQUIRE(!net->wrapped, "%s: the network is held by %s, which copied its layers; add layers before %s",
                 l->name, mgpu__holder(net, 0), mgpu__holder(net, 1));
    if (net->nlayers + 1 >= net->layers_room) { /* (first_param has a place more than layers) */
        net->layers_room = 2 * net->layers_room + 16;
        net->layers = (mgpu_layer **)mgpu__xrealloc(net->layers, net->layers_room * sizeof *net->layers);
        net->first_param = (int *)mgpu__xrealloc(net->first_param, net->layers_room * sizeof *net->first_param);
    }
    if (net->nlayers == 0 && l->kind != MGPU_LAYER_BATCHNORM) l->need_dinput = 0;
    mgpu_layer_kind before = net->nlayers ? net->layers[net->nlayers - 1]->kind : MGPU_LAYER_LINEAR;
    if (before == MGPU_LAYER_BATCHNORM || before == MGPU_LAYER_RESIDUAL) { /* (a block's output is bn2's) */
        if (l->kind == MGPU_LAYER_CONV) l->copies->input_from_batch_norm = 1;
        if (l->kind == MGPU_LAYER_RESIDUAL) {
            l->conv1->copies->input_from_batch_norm = 1;
            if (l->shortcut) l->shortcut->copies->input_from_batch_norm = 1;
        }
    }
    net->first_param[net->nlayers] = net->nparams;
    net->layers[net->nlayers++] = l;
    mgpu__net_register(net, l);
    net->first_param[net->nlayers] = net->nparams;
    return l;
}

/* ---- the network builder (mgpu_net_add_*) ---- */
/* What the output of the net's first `end` layers is: its channels, for
   a layer that takes images; 0 when not known (no layers yet, or only
   ReLUs and pooling, or a layer of yours), -1 when it is no longer images
   (after a linear layer or global pooling). */
static int mgpu__net_channels_after(const mgpu_net *net, int end) {
    for (int i = end - 1; i >= 0; i--) {
        const mgpu_layer *l = net->layers[i];
        if (l->kind == MGPU_LAYER_OWN) return 0;
        if (l->kind == MGPU_LAYER_LINEAR || l->kind == MGPU_LAYER_GLOBAL_AVG_POOL) return -1;
        if (l->kind == MGPU_LAYER_CONV || l->kind == MGPU_LAYER_BATCHNORM || l->kind == MGPU_LAYER_RESIDUAL)
            return l->out_channels;
    }
    return 0;
}
/* The features the net's output has so far, where its layers say: a
   linear layer's, or the channels that global pooling averages; 0 where
   only a forward pass tells (images, flattened by a linear layer). */
static int mgpu__net_out_features(const mgpu_net *net) {
    int last = net->nlayers - 1;
    while (last >= 0 && net->layers[last]->kind == MGPU_LAYER_RELU) last--;
    if (last < 0) return 0;
    if (net->layers[last]->kind == MGPU_LAYER_LINEAR) return net->layers[last]->out_channels;
    if (net->layers[last]->kind == MGPU_LAYER_GLOBAL_AVG_POOL) return mgpu__net_channels_after(net, last);
    return 0;
}
/* A new layer's name, "conv3" for the net's fourth layer, a convolution. */
static const char *mgpu__net_layer_name(const mgpu_net *net, const char *kind, char *buf, size_t size) {
    snprintf(buf, size, "%s%d", kind, net->nlayers);
    return buf;
}
/* Checks that the net's output so far suits layer `op`, which takes
   images of in_channels channels (0: any number). */
static void mgpu__net_require_images(const mgpu_net *net, const char *op, int in_channels) {
    int have = mgpu__net_channels_after(net, net->nlayers);
    MGPU_REQUIRE(have >= 0, "%s: the layer before (%s) gives [N, features], not images [N, C, H, W]", op,
                 net->layers[net->nlayers - 1]->name);
    MGPU_REQUIRE(!in_channels || !have || have == in_channels,
                 "%s: takes %d channels, but the layer before gives %d", op, in_channels, have);
}
MGPU_DEF mgpu_layer *mgpu_net_add_conv(mgpu_net *net, int in_channels, int out_channels, int kernel, int stride,
                                       int pad) {
    MGPU_REQUIRE(in_channels > 0 && out_channels > 0 && kernel > 0 && stride > 0 && pad >= 0,
                 "mgpu_net_add_conv: %d -> %d channels, kernel %d, stride %d, pad %d: channels, kernel and "
                 "stride must be positive, pad not negative", in_channels, out_channels, kernel, stride, pad);
    mgpu__net_require_images(net, "mgpu_net_add_conv", in_channels);
    char name[32];
    return mgpu__net_add(net, mgpu__conv_new(mgpu__net_layer_name(net, "conv", name, sizeof name), in_channels,
                                             out_channels, kernel, stride, pad, net->device));
}
MGPU_DEF mgpu_layer *mgpu_net_add_batchnorm(mgpu_net *net, int channels) {
    MGPU_REQUIRE(channels > 0, "mgpu_net_add_batchnorm: %d channels must be positive", channels);
    mgpu__net_require_images(net, "mgpu_net_add_batchnorm", channels);
    char name[32];
    return mgpu__net_add(net, mgpu__batchnorm_new(mgpu__net_layer_name(net, "batchnorm", name, sizeof name),
                                                  channels, 0, net->device));
}
MGPU_DEF mgpu_layer *mgpu_net_add_relu(mgpu_net *net) {
    mgpu_layer *last = net->nlayers ? net->layers[net->nlayers - 1] : NULL;
    if (last && last->kind == MGPU_LAYER_BATCHNORM && !last->fuse_relu) {
        last->fuse_relu = 1; /* batch norm's pass applies the ReLU as it writes */
        return last;
    }
    char name[32];
    return mgpu__net_add(net,
                         mgpu__layer_new(MGPU_LAYER_RELU, mgpu__net_layer_name(net, "relu", name, sizeof name)));
}
MGPU_DEF mgpu_layer *mgpu_net_add_avg_pool(mgpu_net *net, int kernel) {
    MGPU_REQUIRE(kernel > 0, "mgpu_net_add_avg_pool: kernel %d must be positive", kernel);
    mgpu__net_require_images(net, "mgpu_net_add_avg_pool", 0);
    char name[32];
    mgpu_layer *l = mgpu__net_add(
        net, mgpu__layer_new(MGPU_LAYER_AVG_POOL, mgpu__net_layer_name(net, "avgpool", name, sizeof name)));
    l->kernel = l->stride = kernel;
    return l;
}
MGPU_DEF mgpu_layer *mgpu_net_add_global_avg_pool(mgpu_net *net) {
    mgpu__net_require_images(net, "mgpu_net_add_global_avg_pool", 0);
    char name[32];
    return mgpu__net_add(
        net, mgpu__layer_new(MGPU_LAYER_GLOBAL_AVG_POOL, mgpu__net_layer_name(net, "pool", name, sizeof name)));
}
MGPU_DEF mgpu_layer *mgpu_net_add_residual(mgpu_net *net, int in_channels, int out_channels, int stride) {
    MGPU_REQUIRE(in_channels > 0 && out_channels > 0 && stride > 0,
                 "mgpu_net_add_residual: %d -> %d channels, stride %d must be positive", in_channels, out_channels,
                 stride);
    mgpu__net_require_images(net, "mgpu_net_add_residual", in_channels);
    char name[32];
    return mgpu__net_add(net, mgpu__residual_new(mgpu__net_layer_name(net, "block", name, sizeof name), in_channels,
                                                 out_channels, stride, net->device));
}
MGPU_DEF mgpu_layer *mgpu_net_add_linear(mgpu_net *net, int in_features, int out_features) {
    MGPU_REQUIRE(in_features > 0 && out_features > 0,
                 "mgpu_net_add_linear: %d -> %d features must be positive", in_features, out_features);
    int have = mgpu__net_out_features(net);
    MGPU_REQUIRE(!have || have == in_features,
                 "mgpu_net_add_linear: takes %d features, but the layer before gives %d", in_features, have);
    char name[32];
    return mgpu__net_add(net, mgpu__linear_new(mgpu__net_layer_name(net, "linear", name, sizeof name), in_features,
                                               out_features, net->device));
}

/* A layer with its own loops (mgpu_layer_fns.own_loops) runs on CPU devices only. */
static void mgpu__require_own_loops_on_cpu(const mgpu_layer *l, const mgpu_device *dev, const char *op) {
    MGPU_REQUIRE(l->kind != MGPU_LAYER_OWN || !l->fns->own_loops || !mgpu_device_is_gpu(dev),
                 "%s: %s loops over its values on the host (own_loops 1), and %s is a GPU", op, l->name,
                 dev->name);
}
/* A parameter of a layer of yours: a tensor of its own on the net's
   device, which becomes the net's (to free, once). */
static mgpu_param mgpu__own_param(const mgpu_net *net, mgpu_tensor *value, const char *which, const char *name) {
    mgpu_param p = {NULL, NULL};
    if (!value) return p;
    MGPU_REQUIRE(value->device == net->device, "mgpu_net_add_layer: %s's %s is on %s, the network on %s", name,
                 which, value->device->name, net->device->name);
    MGPU_REQUIRE(!value->base, "mgpu_net_add_layer: %s's %s is a view of another tensor; give it a tensor of its own",
                 name, which);
    for (int i = 0; i < net->nparams; i++)
        MGPU_REQUIRE(net->params[i]->value != value,
                     "mgpu_net_add_layer: %s's %s is already a parameter of the network (parameter %d)", name,
                     which, i);
    return mgpu__param_new(value);
}
MGPU_DEF mgpu_layer *mgpu_net_add_layer(mgpu_net *net, const mgpu_layer_fns *fns, mgpu_tensor *weight,
                                        mgpu_tensor *bias, void *settings) {
    MGPU_REQUIRE(fns && fns->forward && fns->backward,
                 "mgpu_net_add_layer: the layer needs its functions (fns, with forward and backward)");
    MGPU_REQUIRE(!fns->kind || strlen(fns->kind) <= MGPU_LAYER_KIND_MAX,
                 "mgpu_net_add_layer: kind \"%s\" is longer than %d characters", fns->kind,
                 MGPU_LAYER_KIND_MAX);
    MGPU_REQUIRE(fns->own_loops == 0 || fns->own_loops == 1,
                 "mgpu_net_add_layer: own_loops is %d; it is 0 or 1", fns->own_loops);
    MGPU_REQUIRE(!weight || weight != bias, "mgpu_net_add_layer: weight and bias are the same tensor");
    char name[40];
    mgpu_layer *l = mgpu__layer_new(MGPU_LAYER_OWN, mgpu__net_layer_name(net, fns->kind ? fns->kind : "layer",
                                                                         name, sizeof name));
    l->fns = fns;
    mgpu__require_own_loops_on_cpu(l, net->device, "mgpu_net_add_layer");
    l->settings = settings;
    l->weight = mgpu__own_param(net, weight, "weight", l->name);
    l->bias = mgpu__own_param(net, bias, "bias", l->name);
    return mgpu__net_add(net, l);
}

/* Chapter 2's LeNet, as layers (the NETWORKS manual's example). */
MGPU_DEF mgpu_net *mgpu_lenet(mgpu_device *dev) {
    mgpu_net *net = mgpu_net_new(dev);
    mgpu_net_add_conv(net, 1, 20, 3, 1, 0);
    mgpu_net_add_relu(net);
    mgpu_net_add_avg_pool(net, 2);
    mgpu_net_add_conv(net, 20, 50, 5, 1, 0);
    mgpu_net_add_relu(net);
    mgpu_net_add_avg_pool(net, 2);
    mgpu_net_add_linear(net, 800, 128);
    mgpu_net_add_relu(net);
    mgpu_net_add_linear(net, 128, 10);
    return net;
}

MGPU_DEF mgpu_net *mgpu_resnet18(int num_classes, int in_channels, mgpu_device *dev) {
    MGPU_REQUIRE(num_classes > 0 && in_channels > 0,
                 "mgpu_resnet18: %d classes and %d input channels must both be positive",
                 num_classes, in_channels);
    mgpu_net *net = mgpu_net_new(dev);
    mgpu__net_add(net, mgpu__conv_new("stem.conv", in_channels, 64, 3, 1, 1, dev));
    mgpu__net_add(net, mgpu__batchnorm_new("stem.bn", 64, 1, dev));
    static const int channels[4] = {64, 128, 256, 512};
    int in = 64;
    for (int stage = 0; stage < 4; stage++)
        for (int block = 0; block < 2; block++) {
            char name[40];
            snprintf(name, sizeof name, "stage%d.block%d", stage + 1, block + 1);
            int stride = (stage > 0 && block == 0) ? 2 : 1;
            mgpu__net_add(net, mgpu__residual_new(name, in, channels[stage], stride, dev));
            in = channels[stage];
        }
    mgpu__net_add(net, mgpu__layer_new(MGPU_LAYER_GLOBAL_AVG_POOL, "pool"));
    mgpu__net_add(net, mgpu__linear_new("fc", 512, num_classes, dev));
    return net;
}

/* ------------------------------------------------------ channels-last */
/* On a GPU, the convolutions read channels-last copies of their input and
   of their output's gradient (kernels/conv_nhwc.h). Made by a copy of
   their own, each costs a read and a write of the whole tensor; in
   ResNet-18 every such tensor but the first comes from a batch norm, and
   batch norm can write the copy in the pass that computes the tensor
   (kernels/batchnorm.h): beside its output, for the convolution after it,
   and instead of its input gradient, for the convolution before it when
   that one reads the gradient through its copy alone. Whether a
   convolution reads them is its plan's, measured at its first call (so
   the first step still copies). The tests turn this off to compare. */
static int mgpu__batch_norm_writes_channels_last = 1;
/* And the convolutions keep their weights' copies, which the network
   remakes before each forward pass, all in a few launches
   (mgpu__net_weight_copies); the tests turn this off to compare too. */
static int mgpu__network_keeps_weight_copies = 1;

/* Whether convolution layer l, on input shape x, reads x's channels-last
   copy: for y, or for dW (at either pass's first call, not yet); with
   `only`, whether it reads x through that copy alone: for y and for dW. */
static int mgpu__conv_layer_reads_x_t(const mgpu_layer *l, mgpu_shape x, int only) {
#if MGPU_CUDA
    if (!mgpu__conv_implicit_allowed(l->weight.value->device)) return 0;
    mgpu__conv_geom g = mgpu__conv_geometry(l->name, x, l->weight.value->shape, l->stride, l->pad);
    int for_y = mgpu__conv_plan_reads_x_t(mgpu__conv_plan_known(&g, 0, 0));
    if (only) return for_y && mgpu__conv_plan_dw_reads_x_t(mgpu__conv_plan_known(&g, 1, l->need_dinput));
    return for_y || mgpu__conv_plan_dw_reads_x_t(mgpu__conv_plan_known(&g, 1, 0)) ||
           mgpu__conv_plan_dw_reads_x_t(mgpu__conv_plan_known(&g, 1, 1));
#else
    (void)l;
    (void)x;
    (void)only;
    return 0;
#endif
}
/* Whether the layer after a batch norm (next: a convolution, or a
   residual block, whose first convolution and shortcut take the block's
   input) reads the batch norm's output, of shape y, channels-last. */
static int mgpu__next_reads_output_t(const mgpu_layer *next, mgpu_shape y) {
    if (!next || !mgpu__batch_norm_writes_channels_last) return 0;
    if (next->kind == MGPU_LAYER_CONV) return mgpu__conv_layer_reads_x_t(next, y, 0);
    return next->kind == MGPU_LAYER_RESIDUAL &&
           (mgpu__conv_layer_reads_x_t(next->conv1, y, 0) ||
            (next->shortcut && mgpu__conv_layer_reads_x_t(next->shortcut, y, 0)));
}
/* Whether convolution layer l, followed by batch norm `bn`, reads its
   output's gradient through the channels-last copy alone, when its input
   gradient is wanted or not (with_dx). */
/* Whether a convolution's bias, followed by layer `next`, has no effect on
   the loss. Batch norm in training mode subtracts each channel's batch
   mean, and a bias adds the same number to every value of its channel: the
   mean moves by exactly the bias and the normalised values not at all. So
   the bias's gradient is exactly zero, and summing dy over the batch for it
   (a read of the whole output gradient; 17 of ResNet-18's 20 convolutions)
   would only give zero plus rounding: PyTorch's stem bias gradient in
   tests/fixtures is such noise, below 1e-7 beside weight gradients of 0.03.
   The bias still matters in evaluation mode, through the running mean it
   moved, and SGD's weight decay still shrinks it. */
static int mgpu__bias_cancelled_by(const mgpu_layer *next) {
    return next && next->kind == MGPU_LAYER_BATCHNORM && next->batch_statistics;
}
static int mgpu__conv_layer_reads_dy_t_only(const mgpu_layer *l, int with_dx, const mgpu_layer *bn) {
#if MGPU_CUDA
    if (!l || l->kind != MGPU_LAYER_CONV || !l->input || !mgpu__conv_implicit_allowed(l->input->device))
        return 0;
    mgpu__conv_geom g =
        mgpu__conv_geometry(l->name, l->input->shape, l->weight.value->shape, l->stride, l->pad);
    int with_db = l->bias.grad && !mgpu__bias_cancelled_by(bn);
    return mgpu__conv_plan_reads_dy_t_only(mgpu__conv_plan_known(&g, 1, with_dx), with_dx, with_db);
#else
    (void)l;
    (void)with_dx;
    (void)bn;
    return 0;
#endif
}

/* What the network prepares for convolution layer l (MGPU__PREPARED_*),
   for its trial to count: in the forward pass, or in the backward pass
   (followed by layer `next`). x's copy where batch norm writes it, or in
   the backward where the forward made one (l->copies->input_t); dy's where the
   layer after is a batch norm in training (mgpu__bias_cancelled_by),
   which writes it when the plan reads it alone; the weights' where the
   network keeps them. */
static int mgpu__conv_layer_prepared(const mgpu_layer *l, int backward, const mgpu_layer *next) {
    int bn = mgpu__batch_norm_writes_channels_last, prepared = 0;
    if ((bn && l->copies->input_from_batch_norm) || (backward && l->copies->input_t)) prepared |= MGPU__PREPARED_X;
    if (bn && backward && mgpu__bias_cancelled_by(next)) prepared |= MGPU__PREPARED_DY;
    if (mgpu__network_keeps_weight_copies) prepared |= MGPU__PREPARED_W;
    return prepared;
}

/* ------------------------------------------------------------ forward */
/* Batch norm layer l on x into y, with the ReLU when l has it fused, or
   with skip: y = max(bn(x) + skip, 0); and into y_t, y's channels-last
   copy, when `next` reads that (else *y_t is NULL). When next is a
   convolution that reads its input through that copy alone, y itself is
   not written: nothing else reads it (l's backward pass recomputes the
   ReLU's mask from x; the residual block's, whose bn2 has the skip, reads
   its output, and keeps it). */
static void mgpu__batchnorm_layer_forward(mgpu_layer *l, const mgpu_tensor *x, const mgpu_tensor *skip,
                                          mgpu_tensor *y, mgpu_tensor **y_t, const mgpu_layer *next,
                                          int training) {
    /* (a recomputation: the batch's statistics again, the running ones left) */
    float momentum = training == MGPU__RECOMPUTE ? 0.0f : l->momentum;
    l->input = x;
    l->batch_statistics = training;
    int n = x->shape.d[0], c = x->shape.d[1], hw = x->shape.d[2] * x->shape.d[3];
    mgpu_tensor *y_copy = NULL; /* the channels-last copy of y this pass writes */
    if (mgpu__next_reads_output_t(next, x->shape))
        y_copy = mgpu_ensure(y_t, x->device, mgpu_shape3(n, hw, c));
    if (y_copy && !skip && next->kind == MGPU_LAYER_CONV && mgpu__conv_layer_reads_x_t(next, x->shape, 1))
        y = NULL;
    mgpu__batchnorm2d_forward(l->name, y, y_copy, x, skip, l->weight.value, l->bias.value, l->running_mean,
                              l->running_var, l->save_mean, l->save_invstd, training, momentum, 1e-5f,
                              l->fuse_relu || skip, l->sync);
    if (!y_copy) { /* not written: no stale copy left to read */
        mgpu_free(*y_t);
        *y_t = NULL;
    }
}

/* Guard floats. A layer of yours writes its output y and its input
   gradient dx itself, and a loop that runs past their shape (an
   output_shape that does not say what forward writes, a batch size
   written into the loop) would write over whatever lies after them in
   memory. So both get MGPU__GUARD_FLOATS more floats after their values,
   holding a NaN that no arithmetic makes (its bits are the pattern), and
   the library reads them after the pass: after every pass of own loops
   (on the device's queue, where the values are at hand), and otherwise
   when the tensor is made anew (the first pass, or a batch of another
   size), waiting for the device that once. A write before the start, or
   one that jumps past the guard floats, is not seen. */
#define MGPU__GUARD_FLOATS 16
#define MGPU__GUARD_BITS 0x7fc0deadu
static int mgpu__guard_holds(const float *guard) {
    for (int i = 0; i < MGPU__GUARD_FLOATS; i++) {
        uint32_t bits;
        memcpy(&bits, &guard[i], sizeof bits);
        if (bits != MGPU__GUARD_BITS) return 0;
    }
    return 1;
}
/* A view of t's guard floats. */
static mgpu_tensor *mgpu__guard_view(const mgpu_tensor *t) {
    mgpu_tensor *v = mgpu_view(t, t->shape);
    v->shape = mgpu_shape1(MGPU__GUARD_FLOATS);
    v->numel = MGPU__GUARD_FLOATS;
    v->data = t->data + t->numel;
    return v;
}
/* *slot as mgpu_ensure makes it, with guard floats after its values (set
   on its device's queue); returns whether it was made anew. */
static int mgpu__ensure_guarded(mgpu_tensor **slot, mgpu_device *dev, mgpu_shape shape) {
    if (*slot && (*slot)->device == dev && mgpu_shape_equal((*slot)->shape, shape)) return 0;
    mgpu_free(*slot);
    *slot = mgpu__tensor_alloc(dev, shape, 0, MGPU__GUARD_FLOATS);
    uint32_t bits = MGPU__GUARD_BITS;
    float pattern;
    memcpy(&pattern, &bits, sizeof pattern);
    mgpu_tensor *guard = mgpu__guard_view(*slot);
    mgpu_fill(guard, pattern);
    mgpu_free(guard);
    return 1;
}
/* The one-line error when the guard floats after t (a copy of them in
   host memory, `guard`) were written by layer l's forward (t is y) or
   backward (t is dx). */
static void mgpu__require_guard(const mgpu_layer *l, const float *guard, const mgpu_tensor *t, int backward) {
    char shape[64];
    MGPU_REQUIRE(mgpu__guard_holds(guard), "%s (a layer of yours): its %s wrote past the end of %s, whose shape is %s",
                 l->name, backward ? "backward" : "forward", backward ? "dx" : "y",
                 mgpu_shape_str(t->shape, shape, sizeof shape));
}
/* The same from the calling thread, for t made anew (waits for its device). */
static void mgpu__require_guard_now(const mgpu_layer *l, const mgpu_tensor *t, int backward) {
    float guard[MGPU__GUARD_FLOATS];
    mgpu_tensor *v = mgpu__guard_view(t);
    mgpu_to_host(v, guard);
    mgpu_free(v);
    mgpu__require_guard(l, guard, t, backward);
}

/* A pass of a layer of yours: forward (dy NULL: y = f(x)) or backward
   (dx, dweight, dbias from dy, x and y), after the copies still reading
   what it writes (as the library's operations are, for kernels of yours
   and own loops). On the calling thread; or, with own_loops, on the
   device's queue, with copies of the tensors
   as they are now: by the time the queue runs it, the next forward pass
   may have replaced l->input or l->output (their values are safe: the
   queue runs in order). */
typedef struct mgpu__own_pass_args {
    mgpu_layer *l;
    mgpu_tensor t[6];  /* out (y or dx), dweight, dbias, x, y, dy */
    int given[6];      /* which of them there are */
    int training;
} mgpu__own_pass_args;
static void mgpu__own_pass_call(mgpu_layer *l, mgpu_tensor *const *t, int training) {
    if (t[5])
        l->fns->backward(l, t[0], t[1], t[2], t[5], t[3], t[4]);
    else
        l->fns->forward(l, t[0], t[3], training);
}
static void mgpu__own_pass_run(const void *args, const mgpu__exec *ex) {
    mgpu__own_pass_args a = *(const mgpu__own_pass_args *)args;
    mgpu_tensor *t[6];
    (void)ex;
    for (int i = 0; i < 6; i++) t[i] = a.given[i] ? &a.t[i] : NULL;
    mgpu__queue *q = &a.t[3].device->queue[0]; /* the queue running this: x's device's */
    q->running_layer = a.l->name;              /* for mgpu__require_not_in_worker's line */
    mgpu__own_pass_call(a.l, t, a.training);
    q->running_layer = NULL;
    if (t[0]) mgpu__require_guard(a.l, t[0]->data + t[0]->numel, t[0], t[5] != NULL); /* (y, or dx) */
}
static void mgpu__own_layer_pass(mgpu_layer *l, mgpu_tensor *out, const mgpu_tensor *x, const mgpu_tensor *dy,
                                 mgpu_tensor *dweight, mgpu_tensor *dbias, int training) {
    mgpu_tensor *t[6] = {out, dweight, dbias, (mgpu_tensor *)x, l->output, (mgpu_tensor *)dy};
    if (out) mgpu__before_write(out);
    if (!l->fns->own_loops) {
#if MGPU_CUDA
        if (mgpu_device_is_gpu(x->device)) MGPU_CUDA_CHECK(cudaSetDevice(x->device->gpu)); /* for kernels of yours */
#endif
        mgpu__own_pass_call(l, t, training);
        return;
    }
    mgpu__own_pass_args a;
    memset(&a, 0, sizeof a);
    a.l = l;
    a.training = training;
    for (int i = 0; i < 6; i++)
        if ((a.given[i] = t[i] != NULL)) a.t[i] = *t[i];
    mgpu__launch_on(&x->device->queue[0], "layer of yours", mgpu__own_pass_run, NULL, &a, sizeof a);
}

static mgpu_tensor *mgpu__layer_forward(mgpu_layer *l, const mgpu_tensor *x, const mgpu_tensor *x_t,
                                        const mgpu_layer *next, int training);
static const mgpu_tensor *mgpu__layer_backward(mgpu_layer *l, const mgpu_tensor *dy, const mgpu_tensor *dy_t,
                                               const mgpu_layer *next, const mgpu_layer *prev, int accumulate);

/* Layer l's forward pass from x, and from x_t, x's channels-last copy,
   when the layer before wrote one (else NULL); next: the layer that takes
   l's output (NULL if none). Returns the output; its channels-last copy,
   if l wrote one, is then in l->copies->output_t (else that is NULL), and a batch
   norm may then have left the output's values unwritten (above). */
static mgpu_tensor *mgpu__layer_forward_pass(mgpu_layer *l, const mgpu_tensor *x, const mgpu_tensor *x_t,
                                             const mgpu_layer *next, int training) {
    mgpu_device *d = x->device;
    l->input = x;
    switch (l->kind) {
    case MGPU_LAYER_CONV: { /* (a shape that does not fit is an error naming the layer) */
        mgpu__conv_geom g = mgpu__conv_geometry(l->name, x->shape, l->weight.value->shape, l->stride, l->pad);
        mgpu_ensure(&l->output, d, mgpu_shape4(g.n, g.k, g.p, g.q));
        mgpu__conv2d_forward(l->output, x, x_t, l->weight.value,
                             mgpu__network_keeps_weight_copies ? &l->copies->weight_t : NULL, l->bias.value, l->stride,
                             l->pad, &l->copies->own_input_t, mgpu__conv_layer_prepared(l, 0, NULL));
        l->copies->input_t = x_t ? x_t : l->copies->own_input_t;
        break;
    }
    case MGPU_LAYER_BATCHNORM:
        mgpu__batchnorm_layer_forward(l, x, NULL, mgpu_ensure(&l->output, d, x->shape), &l->copies->output_t, next,
                                      training);
        break;
    case MGPU_LAYER_RELU:
        mgpu_ensure(&l->output, d, x->shape);
        mgpu_relu_forward(l->output, x);
        break;
    case MGPU_LAYER_RESIDUAL: {
        const mgpu_tensor *y = mgpu__layer_forward(l->conv1, x, x_t, l->bn1, training);
        y = mgpu__layer_forward(l->bn1, y, NULL, l->conv2, training); /* with its ReLU */
        y = mgpu__layer_forward(l->conv2, y, l->bn1->copies->output_t, l->bn2, training);
        const mgpu_tensor *skip = l->shortcut ? mgpu__layer_forward(l->shortcut, x, x_t, NULL, training) : x;
        /* bn2, the add and the ReLU in one pass, into the block's output */
        mgpu__batchnorm_layer_forward(l->bn2, y, skip, mgpu_ensure(&l->output, d, y->shape), &l->copies->output_t,
                                      next, training);
        break;
    }
    case MGPU_LAYER_AVG_POOL:
        mgpu_ensure(&l->output, d, mgpu_avg_pool2d_output_shape(x->shape, l->kernel));
        mgpu_avg_pool2d_forward(l->output, x, l->kernel);
        break;
    case MGPU_LAYER_GLOBAL_AVG_POOL:
        mgpu_ensure(&l->output, d, mgpu_shape2(x->shape.d[0], x->shape.d[1]));
        mgpu_global_avg_pool_forward(l->output, x);
        break;
    case MGPU_LAYER_LINEAR:
        mgpu_ensure(&l->output, d, mgpu_shape2(x->shape.d[0], l->out_channels));
        mgpu_linear_forward(l->output, x, l->weight.value, l->bias.value);
        break;
    case MGPU_LAYER_OWN: {
        int made = mgpu__ensure_guarded(&l->output, d,
                                        l->fns->output_shape ? l->fns->output_shape(l, x->shape) : x->shape);
        mgpu__own_layer_pass(l, l->output, x, NULL, NULL, NULL, training != 0);
        if (made && !l->fns->own_loops) mgpu__require_guard_now(l, l->output, 0); /* (own loops: each pass) */
        break;
    }
    }
    return l->output;
}

/* (the pass, with the layer named in the libraries' error lines) */
/* (the pass, with the layer named in the libraries' error lines; what it
   makes counts as workspace, but for what it keeps for the backward pass,
   the activations, and the weights' copies a convolution keeps, counted
   with the parameters) */
static mgpu_tensor *mgpu__layer_forward(mgpu_layer *l, const mgpu_tensor *x, const mgpu_tensor *x_t,
                                        const mgpu_layer *next, int training) {
    const char *outer = mgpu__layer_enqueuing; /* (a block's, around its own layers) */
    mgpu__layer_enqueuing = l->name;
    int scope = mgpu__memory_scope(MGPU_MEMORY_WORKSPACE);
    mgpu_tensor *y = mgpu__layer_forward_pass(l, x, x_t, next, training);
    mgpu_tensor *kept[3] = {l->output, l->copies->output_t, l->copies->own_input_t};
    for (int i = 0; i < 3; i++)
        if (kept[i]) mgpu__memory_recount(kept[i], MGPU_MEMORY_ACTIVATIONS);
    mgpu_tensor *weights[2] = {l->copies->weight_t, l->copies->weight_turned_t};
    for (int i = 0; i < 2; i++)
        if (weights[i]) mgpu__memory_recount(weights[i], MGPU_MEMORY_PARAMETERS);
    mgpu__memory_scope((mgpu_memory_category)scope);
    mgpu__layer_enqueuing = outer;
    return y;
}

/* The weights' channels-last copies the network's convolutions keep
   (weight_t; in training also weight_turned_t, for the backward pass that
   follows), remade from the weights as they are now: 16 copies a launch
   (kernels/channels_last.h), where each convolution made its own twice a
   step before (and the first step still does, as its plans are measured
   there). The weights do not change between a forward pass and its
   backward pass, whose activations are the forward's too. */
static void mgpu__net_weight_copies(mgpu_net *net) {
#if MGPU_CUDA
    mgpu__channels_last_list_args list;
    memset(&list, 0, sizeof list);
    for (int i = 0; i < net->nlayers; i++) {
        mgpu_layer *l = net->layers[i], *convs[3] = {l, NULL, NULL};
        if (l->kind == MGPU_LAYER_RESIDUAL) convs[0] = l->conv1, convs[1] = l->conv2, convs[2] = l->shortcut;
        for (int c = 0; c < 3; c++) {
            mgpu_layer *conv = convs[c];
            if (!conv || conv->kind != MGPU_LAYER_CONV) continue;
            const mgpu_tensor *w = conv->weight.value;
            int filters = w->shape.d[0], channels = w->shape.d[1], taps = w->shape.d[2] * w->shape.d[3];
            for (int turned = 0; turned <= net->training; turned++) {
                mgpu_tensor *copy = turned ? conv->copies->weight_turned_t : conv->copies->weight_t;
                if (copy && mgpu__channels_last_list_add(&list, mgpu__weights_copy(copy->data, w->data, filters,
                                                                                   channels, taps, turned))) {
                    MGPU__ENQUEUE(net->device, "conv2d channels-last weights", mgpu__channels_last_list, list);
                    memset(&list, 0, sizeof list);
                }
            }
        }
    }
    if (list.count) MGPU__ENQUEUE(net->device, "conv2d channels-last weights", mgpu__channels_last_list, list);
#else
    (void)net;
#endif
}

/* The network's layer hook (mgpu_net_set_layer_hook), if it has one, at
   `when` of layer `layer`: what it allocates counts with the parameters
   (it gathers them, or makes them some other way). */
static void mgpu__net_hook(mgpu_net *net, int layer, int when) {
    if (!net->layer_hook) return;
    int scope = mgpu__memory_scope(MGPU_MEMORY_PARAMETERS);
    net->layer_hook(net->layer_hook_ctx, net, layer, when);
    mgpu__memory_scope((mgpu_memory_category)scope);
}
/* Layer i's forward pass within the network, with the hook around it. */
static const mgpu_tensor *mgpu__net_layer_forward(mgpu_net *net, int i, const mgpu_tensor *h, const mgpu_tensor *h_t,
                                                  int training) {
    mgpu__net_hook(net, i, MGPU_BEFORE_FORWARD);
    h = mgpu__layer_forward(net->layers[i], h, h_t, i + 1 < net->nlayers ? net->layers[i + 1] : NULL, training);
    mgpu__net_hook(net, i, MGPU_AFTER_FORWARD);
    return h;
}
/* Frees the weights' channels-last copies a convolution keeps (and a
   block's convolutions): its next pass makes them again from the weights. */
static void mgpu__layer_free_weight_copies(mgpu_layer *l) {
    mgpu_free(l->copies->weight_t);
    mgpu_free(l->copies->weight_turned_t);
    l->copies->weight_t = l->copies->weight_turned_t = NULL;
    mgpu_layer *parts[5] = {l->conv1, l->bn1, l->conv2, l->bn2, l->shortcut};
    for (int i = 0; i < 5 && l->kind == MGPU_LAYER_RESIDUAL; i++)
        if (parts[i]) mgpu__layer_free_weight_copies(parts[i]);
}

/* ---- activation recomputation (mgpu_net_recompute) ---- */
/* Frees what layer l's forward pass made for its backward pass: its
   output (unless keep_output) and channels-last copies, its parts' too. */
static void mgpu__layer_free_activations(mgpu_layer *l, int keep_output) {
    if (!keep_output) {
        mgpu_free(l->output);
        l->output = NULL;
        mgpu_free(l->copies->output_t);
        l->copies->output_t = NULL;
    }
    mgpu_free(l->copies->own_input_t);
    l->copies->own_input_t = NULL;
    l->copies->input_t = NULL;
    mgpu_layer *parts[5] = {l->conv1, l->bn1, l->conv2, l->bn2, l->shortcut};
    for (int i = 0; i < 5 && l->kind == MGPU_LAYER_RESIDUAL; i++)
        if (parts[i]) mgpu__layer_free_activations(parts[i], 0);
}
/* Frees the activations' gradients layer l's backward pass made: its
   parts' and its scratch, and its own input gradient with `own`. */
static void mgpu__layer_free_gradients(mgpu_layer *l, int own) {
    /* (a layer of yours keeps its input gradient: a new one's guard floats
       are checked after its pass, which waits for the device) */
    if (own && l->kind != MGPU_LAYER_OWN) {
        mgpu_free(l->dinput);
        l->dinput = NULL;
        mgpu_free(l->copies->dinput_t);
        l->copies->dinput_t = NULL;
    }
    mgpu_free(l->dsum);
    l->dsum = NULL;
    mgpu_layer *parts[5] = {l->conv1, l->bn1, l->conv2, l->bn2, l->shortcut};
    for (int i = 0; i < 5 && l->kind == MGPU_LAYER_RESIDUAL; i++)
        if (parts[i]) mgpu__layer_free_gradients(parts[i], 1);
}
/* Run s's activations freed, all but its output (the next run's input)
   when keep_output. */
static void mgpu__net_free_segment(mgpu_net *net, int s, int keep_output) {
    int last = net->segment_start[s + 1] - 1;
    for (int i = net->segment_start[s]; i <= last; i++)
        mgpu__layer_free_activations(net->layers[i], keep_output && i == last);
    net->segment_freed[s] = 1;
}
/* The runs of this forward pass: one (no recomputation, or evaluation),
   else net->segments (or about sqrt(n)) of about n / k layers each. */
static void mgpu__net_cut_segments(mgpu_net *net) {
    int n = net->nlayers, k = net->segments == MGPU_SEGMENTS_SQRT ? (int)lround(sqrt((double)n)) : net->segments;
    if (k < 1 || !net->training) k = 1;
    MGPU_REQUIRE(k <= n, "mgpu_net_forward: %d recomputed runs (mgpu_net_recompute) of a network of %d layers; "
                 "at most one a layer", k, n);
    net->segment_start = (int *)mgpu__xrealloc(net->segment_start, (size_t)(n + 1) * sizeof(int));
    net->segment_freed = (unsigned char *)mgpu__xrealloc(net->segment_freed, (size_t)n + 1);
    for (int s = 0; s <= k; s++) net->segment_start[s] = (int)((long)s * n / k);
    memset(net->segment_freed, 0, (size_t)n + 1);
    net->nsegments = k;
}
/* The run whose last layer is layer i, if its activations were freed; else -1. */
static int mgpu__net_freed_segment_ending_at(const mgpu_net *net, int i) {
    for (int s = 0; s < net->nsegments; s++)
        if (net->segment_start[s + 1] - 1 == i && net->segment_freed[s]) return s;
    return -1;
}
/* Run s's forward pass again from its input, which the run before kept
   (or the network's input), for its backward pass. */
static void mgpu__net_recompute_segment(mgpu_net *net, int s) {
    int first = net->segment_start[s], end = net->segment_start[s + 1];
    int scope = mgpu__memory_scope(MGPU_MEMORY_ACTIVATIONS);
    const mgpu_tensor *h = net->layers[first]->input;
    const mgpu_tensor *h_t = first > 0 ? net->layers[first - 1]->copies->output_t : NULL;
    for (int i = first; i < end; i++) {
        h = mgpu__net_layer_forward(net, i, h, h_t, MGPU__RECOMPUTE);
        h_t = net->layers[i]->copies->output_t;
    }
    mgpu__memory_scope((mgpu_memory_category)scope);
    net->segment_freed[s] = 0;
}
MGPU_DEF void mgpu_net_free_activations(mgpu_net *net) {
    for (int i = 0; i < net->nlayers; i++) mgpu__layer_free_activations(net->layers[i], i == net->nlayers - 1);
    net->activations_freed = 1;
}
MGPU_DEF void mgpu_net_want_input_grad(mgpu_net *net, int on) {
    MGPU_REQUIRE(net->nlayers > 0, "mgpu_net_want_input_grad: the network has no layers");
    net->layers[0]->need_dinput = on != 0 || net->layers[0]->kind == MGPU_LAYER_BATCHNORM;
}
MGPU_DEF mgpu_tensor *mgpu_net_input_grad(mgpu_net *net) {
    MGPU_REQUIRE(net->nlayers > 0 && net->layers[0]->need_dinput && net->layers[0]->dinput,
                 "mgpu_net_input_grad: no input gradient: call mgpu_net_want_input_grad(net, 1) before the "
                 "backward pass");
    return net->layers[0]->dinput;
}
MGPU_DEF void mgpu_net_set_layer_hook(mgpu_net *net, mgpu_layer_hook_fn fn, void *ctx) {
    MGPU_REQUIRE(!net->layer_hook_owner, "mgpu_net_set_layer_hook: %s holds this network and gathers its "
                 "parameters with a layer hook of its own: set yours after mgpu_data_parallel_free",
                 net->layer_hook_owner);
    net->layer_hook = fn;
    net->layer_hook_ctx = ctx;
}
MGPU_DEF void mgpu_net_recompute(mgpu_net *net, int segments) {
    MGPU_REQUIRE(segments >= 1 || segments == MGPU_SEGMENTS_SQRT,
                 "mgpu_net_recompute: %d runs; want 1 (one run: no recomputation) up to the number of layers, or "
                 "MGPU_SEGMENTS_SQRT", segments);
    MGPU_REQUIRE(segments <= net->nlayers,
                 "mgpu_net_recompute: %d runs of a network of %d layers; at most one a layer", segments,
                 net->nlayers);
    net->segments = segments;
}

MGPU_DEF mgpu_tensor *mgpu_net_forward(mgpu_net *net, const mgpu_tensor *x) {
    MGPU_REQUIRE(net->nlayers > 0, "mgpu_net_forward: the network has no layers (mgpu_net_add_* adds them)");
    MGPU_REQUIRE(x->device == net->device, "mgpu_net_forward: the input is on %s, the network on %s",
                 x->device->name, net->device->name);
    int scope = mgpu__memory_scope(MGPU_MEMORY_ACTIVATIONS);
    net->activations_freed = 0;
    mgpu__net_weight_copies(net);
    mgpu__net_cut_segments(net);
    /* the last run's activations of the pass before, made again below:
       freed first, so that the runs before it do not meet them */
    for (int i = net->segment_start[net->nsegments - 1]; i < net->nlayers && net->nsegments > 1; i++)
        mgpu__layer_free_activations(net->layers[i], 0);
    const mgpu_tensor *h = x, *h_t = NULL;
    for (int s = 0; s < net->nsegments; s++) {
        for (int i = net->segment_start[s]; i < net->segment_start[s + 1]; i++) {
            h = mgpu__net_layer_forward(net, i, h, h_t, net->training);
            h_t = net->layers[i]->copies->output_t;
        }
        if (s + 1 < net->nsegments) mgpu__net_free_segment(net, s, 1);
    }
    mgpu__memory_scope((mgpu_memory_category)scope);
    return (mgpu_tensor *)h;
}

/* ----------------------------------------------------------- backward */

/* Convolution layer l's backward pass: with with_dw, adds its weight
   gradient and, with with_db, its bias gradient (with accumulate 0:
   writes them), and writes its input gradient to dx, or with add_to_dx
   adds it there (dx NULL: not wanted). dy_t: dy's channels-last copy,
   when the batch norm after l wrote it in place of dy, else NULL. `next`
   is as below. */
static void mgpu__conv_layer_backward(mgpu_layer *l, const mgpu_tensor *dy, const mgpu_tensor *dy_t,
                                      const mgpu_layer *next, mgpu_tensor *dx, int add_to_dx, int with_dw,
                                      int with_db, int accumulate) {
    if (!dx && !with_dw) return;
    mgpu__conv2d_backward(dx, with_dw ? l->weight.grad : NULL,
                          with_dw && with_db && !mgpu__bias_cancelled_by(next) ? l->bias.grad : NULL,
                          dy, dy_t, l->input, l->copies->input_t, l->weight.value,
                          mgpu__network_keeps_weight_copies ? &l->copies->weight_turned_t : NULL, l->stride, l->pad,
                          accumulate, add_to_dx, mgpu__conv_layer_prepared(l, 1, next));
}
/* Batch norm layer l's backward pass; prev: the convolution before it
   whose backward takes its input gradient (with_dx: as there), or NULL.
   When prev reads that gradient through its channels-last copy alone,
   l->copies->dinput_t gets the copy and dx is not written (l->copies->dinput_t is NULL
   otherwise). end: as a residual block's bn2, or NULL. With accumulate 0
   it writes its parameters' gradients, and prev's bias gradient too: the
   0 that l's batch mean makes it (prev's own backward leaves it). */
static void mgpu__batchnorm_layer_backward(mgpu_layer *l, const mgpu_tensor *dy, mgpu_tensor *dx,
                                           const mgpu_layer *prev, int prev_with_dx,
                                           const mgpu__bn_block_end *end, int accumulate) {
    mgpu_tensor *dx_t = NULL;
    if (dx && mgpu__batch_norm_writes_channels_last &&
        mgpu__conv_layer_reads_dy_t_only(prev, prev_with_dx, l)) {
        mgpu_shape x = l->input->shape;
        dx_t = mgpu_ensure(&l->copies->dinput_t, dx->device, mgpu_shape3(x.d[0], x.d[2] * x.d[3], x.d[1]));
    } else {
        mgpu_free(l->copies->dinput_t);
        l->copies->dinput_t = NULL;
    }
    int prev_bias = prev && prev->kind == MGPU_LAYER_CONV && prev->bias.grad && !accumulate;
    mgpu__batchnorm2d_backward(l->name, dx_t ? NULL : dx, dx_t, l->weight.grad, l->bias.grad, dy, l->input,
                               l->weight.value, l->bias.value, l->save_mean, l->save_invstd, l->fuse_relu,
                               accumulate, end, prev_bias ? prev->bias.grad : NULL, l->sync);
}

/* Whether layer l's backward pass splits into its input gradient (B)
   and its parameters' gradients (W), for a zero-bubble pipeline:
   convolutions, linear layers, and layers of yours that say they can
   (l->split_backward). Batch norm keeps its dgamma and dbeta in B, and a
   residual block runs whole in B (its convolutions' weight gradients
   too): their W would need the block's inner gradients kept. */
static int mgpu__layer_splits(const mgpu_layer *l) {
    int kind_splits = l->kind == MGPU_LAYER_CONV || l->kind == MGPU_LAYER_LINEAR ||
                      (l->kind == MGPU_LAYER_OWN && l->split_backward);
    return kind_splits && (l->weight.grad || l->bias.grad);
}

/* A layer of yours: its backward pass gets its gradients zeroed, the
   parameters' own where they are to be written, else scratch that is then
   added to them; dx_made: dx was made anew (its guard floats are read
   after the pass). with_dw: the parameters' gradients wanted (a split
   pass's B does without them). */
static void mgpu__own_layer_backward(mgpu_layer *l, const mgpu_tensor *dy, mgpu_tensor *dx, int dx_made,
                                     int with_dw, int accumulate) {
    mgpu_tensor *dweight = with_dw ? l->weight.grad : NULL, *dbias = with_dw ? l->bias.grad : NULL;
    if (!dx && !dweight && !dbias) return; /* nothing wanted */
    if (accumulate && dweight) dweight = mgpu_ensure(&l->dweight, dweight->device, dweight->shape);
    if (accumulate && dbias) dbias = mgpu_ensure(&l->dbias, dbias->device, dbias->shape);
    mgpu_tensor *written[3] = {dx, dweight, dbias};
    for (int i = 0; i < 3; i++)
        if (written[i]) mgpu_fill(written[i], 0.0f);
    mgpu__own_layer_pass(l, dx, l->input, dy, dweight, dbias, 0);
    if (dx_made && !l->fns->own_loops) mgpu__require_guard_now(l, dx, 1); /* (own loops: each pass) */
    if (dweight && dweight != l->weight.grad) mgpu_add_(l->weight.grad, dweight);
    if (dbias && dbias != l->bias.grad) mgpu_add_(l->bias.grad, dbias);
}

/* Adds l's parameter gradients (with accumulate 0: writes them) and
   returns dL/d(input), given dy = dL/d(output) and dy_t, its channels-last
   copy if the layer after l wrote one (else NULL; then dy's values were
   not written, and only a convolution takes it); `next` is the layer that
   took l's output (NULL if none), `prev` the one whose output l took
   (NULL if none). The input gradient's channels-last copy, if l wrote
   one, is then in l->copies->dinput_t (else that is NULL). part: the
   whole pass, or of a layer that splits (mgpu__layer_splits) its input
   gradient alone (B, which returns it) or its parameters' alone (W, after
   B, from the same dy: returns NULL); a layer that does not split runs
   whole in B, and has no W. */
static const mgpu_tensor *mgpu__layer_backward_pass(mgpu_layer *l, const mgpu_tensor *dy, const mgpu_tensor *dy_t,
                                                    const mgpu_layer *next, const mgpu_layer *prev, int accumulate,
                                                    mgpu_pass_part part) {
    mgpu_device *d = dy->device;
    int split = mgpu__layer_splits(l);
    int with_dx = l->need_dinput && part != MGPU_PASS_WEIGHT_GRAD, with_dw = !split || part != MGPU_PASS_INPUT_GRAD;
    int dx_made = 0; /* (a layer of yours writes dx itself: with guard floats after it) */
    if (with_dx && l->kind == MGPU_LAYER_OWN)
        dx_made = mgpu__ensure_guarded(&l->dinput, d, l->input->shape);
    mgpu_tensor *dx = with_dx ? mgpu_ensure(&l->dinput, d, l->input->shape) : NULL;
    MGPU_REQUIRE(!dy_t || l->kind == MGPU_LAYER_CONV,
                 "%s: given its output gradient channels-last alone, which only a convolution reads",
                 l->name);
    switch (l->kind) {
    case MGPU_LAYER_CONV:
        mgpu__conv_layer_backward(l, dy, dy_t, next, dx, 0, with_dw, 1, accumulate);
        break;
    case MGPU_LAYER_BATCHNORM:
        mgpu__batchnorm_layer_backward(l, dy, dx, prev, prev && prev->need_dinput, NULL, accumulate);
        break;
    case MGPU_LAYER_RELU: /* (these three have no parameters: without dx, nothing to do) */
        if (dx) mgpu_relu_backward(dx, dy, l->output);
        break;
    case MGPU_LAYER_AVG_POOL:
        if (dx) mgpu_avg_pool2d_backward(dx, dy, l->kernel);
        break;
    case MGPU_LAYER_RESIDUAL: {
        /* out = relu(main + skip): the gradient of the sum, dsum, goes to
           both paths, and dx is the sum of theirs. Without a shortcut
           the skip path's is dsum itself, written to dx at once, and
           conv1 adds the main path's to it as it writes it: no pass of
           its own for the sum. With one, conv1 writes dx and the shortcut
           adds its own after: its 1x1 window at stride 2 reaches a
           quarter of dx's pixels, so the rest is written once, by conv1,
           not zeroed by the shortcut and read back by conv1. bn2's
           backward computes dsum (the ReLU's mask on dy) as it reads it,
           and adds the shortcut's bias gradient, the sum of dsum that its
           own dbeta is (kernels/batchnorm.h). */
        mgpu_tensor *dsum = dx && !l->shortcut ? dx : mgpu_ensure(&l->dsum, d, l->output->shape);
        mgpu_tensor *g2 = mgpu_ensure(&l->bn2->dinput, d, dsum->shape);
        mgpu__bn_block_end end = {l->output, dsum, l->shortcut ? l->shortcut->bias.grad : NULL};
        mgpu__batchnorm_layer_backward(l->bn2, dy, g2, l->conv2, 1, &end, accumulate);
        const mgpu_tensor *g = mgpu__layer_backward(l->conv2, g2, l->bn2->copies->dinput_t, l->bn2, l->bn1, accumulate);
        /* (conv1's input gradient is the block's: wanted when the block's is) */
        mgpu_tensor *g1 = mgpu_ensure(&l->bn1->dinput, d, g->shape);
        mgpu__batchnorm_layer_backward(l->bn1, g, g1, l->conv1, dx != NULL, NULL, accumulate);
        mgpu__conv_layer_backward(l->conv1, g1, l->bn1->copies->dinput_t, l->bn1, dx, !l->shortcut, 1, 1, accumulate);
        if (l->shortcut) mgpu__conv_layer_backward(l->shortcut, dsum, NULL, NULL, dx, 1, 1, 0, accumulate);
        break;
    }
    case MGPU_LAYER_GLOBAL_AVG_POOL:
        if (dx) mgpu_global_avg_pool_backward(dx, dy);
        break;
    case MGPU_LAYER_LINEAR:
        if (dx || with_dw)
            mgpu_linear_backward(dx, with_dw ? l->weight.grad : NULL, with_dw ? l->bias.grad : NULL, dy, l->input,
                                 l->weight.value, accumulate);
        break;
    case MGPU_LAYER_OWN:
        mgpu__own_layer_backward(l, dy, dx, dx_made, with_dw, accumulate);
        break;
    }
    return dx;
}

/* (the pass, or a part of it, with the layer named in the libraries'
   error lines) */
static const mgpu_tensor *mgpu__layer_backward_part(mgpu_layer *l, const mgpu_tensor *dy, const mgpu_tensor *dy_t,
                                                    const mgpu_layer *next, const mgpu_layer *prev, int accumulate,
                                                    mgpu_pass_part part) {
    const char *outer = mgpu__layer_enqueuing; /* (a block's, around its own layers) */
    mgpu__layer_enqueuing = l->name;
    const mgpu_tensor *dx = mgpu__layer_backward_pass(l, dy, dy_t, next, prev, accumulate, part);
    mgpu__layer_enqueuing = outer;
    return dx;
}
static const mgpu_tensor *mgpu__layer_backward(mgpu_layer *l, const mgpu_tensor *dy, const mgpu_tensor *dy_t,
                                               const mgpu_layer *next, const mgpu_layer *prev, int accumulate) {
    return mgpu__layer_backward_part(l, dy, dy_t, next, prev, accumulate, MGPU_PASS_WHOLE);
}

/* Refuses a backward pass that cannot run, before any of its work is
   queued (a process that forks to test such a failure cannot use the GPU
   in the child), naming the layer the backward pass would stop at: batch
   norm's backward needs the batch statistics of a forward in training
   mode. */
static void mgpu__require_batch_statistics(const mgpu_layer *l) {
    if (!l) return;
    MGPU_REQUIRE(l->kind != MGPU_LAYER_BATCHNORM || l->batch_statistics,
                 "%s: the last forward ran in evaluation mode; batch norm's backward pass "
                 "needs the batch statistics of a forward in training mode", l->name);
    if (l->kind == MGPU_LAYER_RESIDUAL) {
        mgpu__require_batch_statistics(l->bn2);
        mgpu__require_batch_statistics(l->bn1);
    }
}
static void mgpu__net_require_backward(const mgpu_net *net, const char *who) {
    MGPU_REQUIRE(net->nlayers > 0 && net->layers[net->nlayers - 1]->output,
                 "%s: run mgpu_net_forward first", who);
    MGPU_REQUIRE(!net->activations_freed, "%s: the activations of the last forward pass were freed "
                 "(mgpu_net_free_activations): run mgpu_net_forward again first", who);
    for (int i = net->nlayers - 1; i >= 0; i--) mgpu__require_batch_statistics(net->layers[i]);
}

/* The backward pass of the net's layer i (dy's channels-last copy, if the
   layer after it wrote one, in that layer's dinput_t); accumulate as in
   mgpu__layer_backward. */
static const mgpu_tensor *mgpu__net_layer_backward_part(mgpu_net *net, int i, const mgpu_tensor *dy,
                                                        int accumulate, mgpu_pass_part part) {
    mgpu_layer *l = net->layers[i], *next = i + 1 < net->nlayers ? net->layers[i + 1] : NULL;
    mgpu__net_hook(net, i, MGPU_BEFORE_BACKWARD); /* (before the recomputation, which needs it too) */
    int freed = mgpu__net_freed_segment_ending_at(net, i);
    if (freed >= 0) mgpu__net_recompute_segment(net, freed);
    int scope = mgpu__memory_scope(MGPU_MEMORY_WORKSPACE);
    const mgpu_tensor *dx = mgpu__layer_backward_part(l, dy, next ? next->copies->dinput_t : NULL, next,
                                                      i > 0 ? net->layers[i - 1] : NULL, accumulate, part);
    mgpu__memory_scope((mgpu_memory_category)scope);
    /* the output gradient layer i read (layer i + 1's input gradient) and
       its parts' scratch are done with: freed, so that the backward pass
       holds the activations' gradients of a layer or two, not of all
       (but in B, for a layer whose W reads it later) */
    if (next && !(part == MGPU_PASS_INPUT_GRAD && mgpu__layer_splits(l))) mgpu__layer_free_gradients(next, 1);
    mgpu__layer_free_gradients(l, 0);
    /* a run's activations go as soon as its backward pass is done (the
       last run's but the output: the logits stay valid until the next
       forward pass); after B, W still reads them */
    for (int s = 0; s < net->nsegments && net->nsegments > 1 && part != MGPU_PASS_INPUT_GRAD; s++)
        if (net->segment_start[s] == i) mgpu__net_free_segment(net, s, s + 1 == net->nsegments);
    mgpu__net_hook(net, i, MGPU_AFTER_BACKWARD);
    return dx;
}
static const mgpu_tensor *mgpu__net_layer_backward(mgpu_net *net, int i, const mgpu_tensor *dy, int accumulate) {
    return mgpu__net_layer_backward_part(net, i, dy, accumulate, MGPU_PASS_WHOLE);
}

/* The backward pass, or a part of it (a zero-bubble pipeline's). The
   whole adds every parameter's gradient, or with accumulate 0 writes it
   (a training step, which would zero them first: that saves writing zeros
   to every gradient and reading them back). B: every layer's input
   gradient, and the whole pass of the layers that do not split, keeping
   the output gradients of those that do; W, after B and from the same
   dlogits: the parameters' gradients of the layers that split, each from
   the output gradient and input that B left, which then go. accumulate
   as for the whole, for the parameters each part writes. */
static void mgpu__net_backward_part(mgpu_net *net, const mgpu_tensor *dlogits, int accumulate, mgpu_pass_part part) {
    const mgpu_tensor *g = dlogits;
    for (int i = net->nlayers - 1; i >= 0; i--) {
        if (part == MGPU_PASS_WEIGHT_GRAD) {
            const mgpu_layer *next = i + 1 < net->nlayers ? net->layers[i + 1] : NULL;
            g = next ? next->dinput : dlogits;
            if (!mgpu__layer_splits(net->layers[i])) continue; /* (done whole in B) */
        }
        g = mgpu__net_layer_backward_part(net, i, g, accumulate, part);
    }
}
static void mgpu__net_backward(mgpu_net *net, const mgpu_tensor *dlogits, int accumulate) {
    mgpu__net_backward_part(net, dlogits, accumulate, MGPU_PASS_WHOLE);
}
MGPU_DEF void mgpu_net_backward(mgpu_net *net, const mgpu_tensor *dlogits) {
    mgpu__net_require_backward(net, "mgpu_net_backward");
    mgpu__net_backward(net, dlogits, 1);
}

MGPU_DEF void mgpu_net_zero_grad(mgpu_net *net) {
    for (int i = 0; i < net->nparams; i++) net->step_values[i] = net->params[i]->grad;
    mgpu__zero_tensors(net->step_values, net->nparams);
}

/* The top-level layer whose parameters include parameter p (a block's,
   for its parts'). */
static const mgpu_layer *mgpu__param_layer(const mgpu_net *net, int p) {
    int l = 0;
    while (l + 1 < net->nlayers && net->first_param[l + 1] <= p) l++;
    return net->layers[l];
}

/* Every batch norm layer of net takes its statistics over group g's
   ranks (the manual's DISTRIBUTED). */
MGPU_DEF void mgpu_net_sync_batchnorm(mgpu_net *net, mgpu_group *g) {
    MGPU_REQUIRE(!net->wrapped, "mgpu_net_sync_batchnorm: a wrapper holds this network already; "
                 "synchronise its batch norms before making the wrapper");
    mgpu_layer **bns = (mgpu_layer **)mgpu__xmalloc(sizeof *bns * (2 * (size_t)net->nlayers + 1));
    int count = mgpu__net_batch_norms(net, bns);
    for (int i = 0; i < count; i++) bns[i]->sync = g;
    free(bns);
}
