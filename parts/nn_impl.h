/* ======================================================================
   Networks: layers with parameters, buffers and saved activations.
   ====================================================================== */

static mgpu_layer *mgpu__layer_new(mgpu_layer_kind kind, const char *name) {
    mgpu_layer *l = (mgpu_layer *)mgpu__xcalloc(1, sizeof *l);
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
    l->weight = mgpu__param_new(mgpu_ones(d, mgpu_shape1(channels)));
    l->bias = mgpu__param_new(mgpu_zeros(d, mgpu_shape1(channels)));
    l->running_mean = mgpu_zeros(d, mgpu_shape1(channels));
    l->running_var = mgpu_ones(d, mgpu_shape1(channels));
    l->save_mean = mgpu_zeros(d, mgpu_shape1(channels));
    l->save_invstd = mgpu_zeros(d, mgpu_shape1(channels));
    return l;
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
    if (l->weight.value) {
        net->params[net->nparams++] = &l->weight;
        net->params[net->nparams++] = &l->bias;
    }
    if (l->running_mean) {
        net->buffers[net->nbuffers++] = &l->running_mean;
        net->buffers[net->nbuffers++] = &l->running_var;
    }
}

static mgpu_net *mgpu__net_new(mgpu_device *d) {
    mgpu_net *net = (mgpu_net *)mgpu__xcalloc(1, sizeof *net);
    net->device = d;
    net->training = 1;
    return net;
}

static void mgpu__net_add(mgpu_net *net, mgpu_layer *l) {
    MGPU_REQUIRE(net->nlayers < (int)(sizeof net->layers / sizeof net->layers[0]),
                 "a network holds at most %d layers", (int)(sizeof net->layers / sizeof net->layers[0]));
    if (net->nlayers == 0) l->need_dinput = 0;
    net->layers[net->nlayers++] = l;
    mgpu__net_register(net, l);
}

MGPU_DEF mgpu_net *mgpu_resnet18(int num_classes, int in_channels, mgpu_device *dev) {
    MGPU_REQUIRE(num_classes > 0 && in_channels > 0,
                 "mgpu_resnet18: %d classes and %d input channels must both be positive",
                 num_classes, in_channels);
    mgpu_net *net = mgpu__net_new(dev);
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

/* ------------------------------------------------------------ forward */
static mgpu_tensor *mgpu__layer_forward(mgpu_layer *l, const mgpu_tensor *x, int training) {
    mgpu_device *d = x->device;
    l->input = x;
    switch (l->kind) {
    case MGPU_LAYER_CONV:
        mgpu_ensure(&l->output, d,
                     mgpu_conv2d_output_shape(x->shape, l->weight.value->shape, l->stride, l->pad));
        mgpu_conv2d_forward(l->output, x, l->weight.value, l->bias.value, l->stride, l->pad);
        break;
    case MGPU_LAYER_BATCHNORM:
        mgpu_ensure(&l->output, d, x->shape);
        mgpu_batchnorm2d_forward(l->output, x, l->weight.value, l->bias.value, l->running_mean,
                                 l->running_var, l->save_mean, l->save_invstd, training, 0.1f,
                                 1e-5f, l->fuse_relu);
        break;
    case MGPU_LAYER_RELU:
        mgpu_ensure(&l->output, d, x->shape);
        mgpu_relu_forward(l->output, x);
        break;
    case MGPU_LAYER_RESIDUAL: {
        const mgpu_tensor *y = mgpu__layer_forward(l->conv1, x, training);
        y = mgpu__layer_forward(l->bn1, y, training); /* with its ReLU */
        y = mgpu__layer_forward(l->conv2, y, training);
        y = mgpu__layer_forward(l->bn2, y, training);
        const mgpu_tensor *skip = l->shortcut ? mgpu__layer_forward(l->shortcut, x, training) : x;
        mgpu_ensure(&l->output, d, y->shape);
        mgpu_add(l->output, y, skip);
        mgpu_relu_forward(l->output, l->output);
        break;
    }
    case MGPU_LAYER_GLOBAL_AVG_POOL:
        mgpu_ensure(&l->output, d, mgpu_shape2(x->shape.d[0], x->shape.d[1]));
        mgpu_global_avg_pool_forward(l->output, x);
        break;
    case MGPU_LAYER_LINEAR:
        mgpu_ensure(&l->output, d, mgpu_shape2(x->shape.d[0], l->out_channels));
        mgpu_linear_forward(l->output, x, l->weight.value, l->bias.value);
        break;
    }
    return l->output;
}

MGPU_DEF mgpu_tensor *mgpu_net_forward(mgpu_net *net, const mgpu_tensor *x) {
    MGPU_REQUIRE(x->device == net->device, "mgpu_net_forward: the input is on %s, the network on %s",
                 x->device->name, net->device->name);
    const mgpu_tensor *h = x;
    for (int i = 0; i < net->nlayers; i++) h = mgpu__layer_forward(net->layers[i], h, net->training);
    return (mgpu_tensor *)h;
}

/* ----------------------------------------------------------- backward */
static const mgpu_tensor *mgpu__layer_backward(mgpu_layer *l, const mgpu_tensor *dy) {
    mgpu_device *d = dy->device;
    mgpu_tensor *dx = l->need_dinput ? mgpu_ensure(&l->dinput, d, l->input->shape) : NULL;
    switch (l->kind) {
    case MGPU_LAYER_CONV:
        mgpu_conv2d_backward(dx, l->weight.grad, l->bias.grad, dy, l->input, l->weight.value,
                             l->stride, l->pad, 1);
        break;
    case MGPU_LAYER_BATCHNORM:
        mgpu_batchnorm2d_backward(dx, l->weight.grad, l->bias.grad, dy, l->input, l->output,
                                  l->weight.value, l->save_mean, l->save_invstd, l->fuse_relu, 1);
        break;
    case MGPU_LAYER_RELU:
        mgpu_relu_backward(dx, dy, l->output);
        break;
    case MGPU_LAYER_RESIDUAL: {
        /* out = relu(main + skip): the gradient of the sum goes to both. */
        mgpu_tensor *dsum = mgpu_ensure(&l->dsum, d, l->output->shape);
        mgpu_relu_backward(dsum, dy, l->output);
        const mgpu_tensor *g = mgpu__layer_backward(l->bn2, dsum);
        g = mgpu__layer_backward(l->conv2, g);
        g = mgpu__layer_backward(l->bn1, g);
        g = mgpu__layer_backward(l->conv1, g);
        const mgpu_tensor *dskip = l->shortcut ? mgpu__layer_backward(l->shortcut, dsum) : dsum;
        mgpu_add(dx, g, dskip);
        break;
    }
    case MGPU_LAYER_GLOBAL_AVG_POOL:
        mgpu_global_avg_pool_backward(dx, dy);
        break;
    case MGPU_LAYER_LINEAR:
        mgpu_linear_backward(dx, l->weight.grad, l->bias.grad, dy, l->input, l->weight.value, 1);
        break;
    }
    return dx;
}

MGPU_DEF void mgpu_net_backward(mgpu_net *net, const mgpu_tensor *dlogits) {
    MGPU_REQUIRE(net->nlayers > 0 && net->layers[net->nlayers - 1]->output,
                 "mgpu_net_backward: run mgpu_net_forward first");
    const mgpu_tensor *g = dlogits;
    for (int i = net->nlayers - 1; i >= 0; i--) g = mgpu__layer_backward(net->layers[i], g);
}

MGPU_DEF void mgpu_net_zero_grad(mgpu_net *net) {
    for (int i = 0; i < net->nparams; i++) mgpu_fill(net->params[i]->grad, 0.0f);
}
MGPU_DEF void mgpu_net_set_training(mgpu_net *net, int training) { net->training = training; }

MGPU_DEF void mgpu_net_sgd(mgpu_net *net, float lr, float momentum, float weight_decay) {
    for (int i = 0; i < net->nparams; i++) {
        mgpu_param *p = net->params[i];
        if (momentum != 0.0f && !net->momentum[i])
            net->momentum[i] = mgpu_zeros(net->device, p->value->shape);
        mgpu_sgd_step(p->value, p->grad, momentum != 0.0f ? net->momentum[i] : NULL, lr, momentum,
                      weight_decay, net->steps == 0);
    }
    net->steps++;
}

MGPU_DEF void mgpu_net_loss_backward(mgpu_net *net, const mgpu_tensor *logits,
                                     const mgpu_tensor *labels, float scale,
                                     mgpu_tensor *loss_sum) {
    int n = logits->shape.d[0];
    mgpu_ensure(&net->losses, net->device, mgpu_shape1(n));
    mgpu_ensure(&net->dlogits, net->device, logits->shape);
    mgpu_cross_entropy_forward(net->losses, logits, labels);
    if (loss_sum) {
        mgpu_ensure(&net->loss_sum, net->device, mgpu_shape1(1));
        mgpu_sum(net->loss_sum, net->losses);
        mgpu_add_(loss_sum, net->loss_sum);
    }
    mgpu_cross_entropy_backward(net->dlogits, logits, labels, scale);
    mgpu_net_backward(net, net->dlogits);
}

MGPU_DEF void mgpu_net_train_step(mgpu_net *net, const mgpu_tensor *x, const mgpu_tensor *labels,
                                  float lr, float momentum, float weight_decay,
                                  mgpu_tensor *loss_sum) {
    mgpu_net_zero_grad(net);
    mgpu_tensor *logits = mgpu_net_forward(net, x);
    mgpu_net_loss_backward(net, logits, labels, 1.0f / (float)x->shape.d[0], loss_sum);
    mgpu_net_sgd(net, lr, momentum, weight_decay);
}

/* ------------------------------------------------------------ access */
MGPU_DEF int mgpu_net_num_params(const mgpu_net *net) { return net->nparams; }
MGPU_DEF mgpu_param *mgpu_net_param(mgpu_net *net, int i) {
    MGPU_REQUIRE(i >= 0 && i < net->nparams, "mgpu_net_param: index %d of %d", i, net->nparams);
    return net->params[i];
}
MGPU_DEF int mgpu_net_num_buffers(const mgpu_net *net) { return net->nbuffers; }
MGPU_DEF mgpu_tensor *mgpu_net_buffer(mgpu_net *net, int i) {
    MGPU_REQUIRE(i >= 0 && i < net->nbuffers, "mgpu_net_buffer: index %d of %d", i, net->nbuffers);
    return *net->buffers[i];
}
MGPU_DEF size_t mgpu_net_num_weights(const mgpu_net *net) {
    size_t n = 0;
    for (int i = 0; i < net->nparams; i++) n += net->params[i]->value->numel;
    return n;
}

/* ---------------------------------------------------------- replicas */
static mgpu_tensor *mgpu__clone(const mgpu_tensor *t, mgpu_device *d) {
    return t ? mgpu_to(t, d, 1) : NULL;
}

static mgpu_layer *mgpu__layer_clone(const mgpu_layer *src, mgpu_device *d) {
    if (!src) return NULL;
    mgpu_layer *l = (mgpu_layer *)mgpu__xcalloc(1, sizeof *l);
    *l = *src; /* the settings */
    l->input = NULL;
    l->output = l->dinput = l->dsum = NULL;
    if (src->weight.value) {
        l->weight = mgpu__param_new(mgpu__clone(src->weight.value, d));
        l->bias = mgpu__param_new(mgpu__clone(src->bias.value, d));
    }
    l->running_mean = mgpu__clone(src->running_mean, d);
    l->running_var = mgpu__clone(src->running_var, d);
    l->save_mean = mgpu__clone(src->save_mean, d);
    l->save_invstd = mgpu__clone(src->save_invstd, d);
    l->conv1 = mgpu__layer_clone(src->conv1, d);
    l->bn1 = mgpu__layer_clone(src->bn1, d);
    l->conv2 = mgpu__layer_clone(src->conv2, d);
    l->bn2 = mgpu__layer_clone(src->bn2, d);
    l->shortcut = mgpu__layer_clone(src->shortcut, d);
    return l;
}

MGPU_DEF mgpu_net *mgpu_net_replicate(const mgpu_net *net, mgpu_device *dev) {
    mgpu_net *copy = mgpu__net_new(dev);
    copy->training = net->training;
    for (int i = 0; i < net->nlayers; i++) mgpu__net_add(copy, mgpu__layer_clone(net->layers[i], dev));
    return copy;
}

MGPU_DEF void mgpu_net_copy_params(mgpu_net *dst, const mgpu_net *src, int with_buffers) {
    MGPU_REQUIRE(dst->nparams == src->nparams && dst->nbuffers == src->nbuffers,
                 "mgpu_net_copy_params: the networks differ (%d and %d parameters)", dst->nparams,
                 src->nparams);
    for (int i = 0; i < src->nparams; i++) mgpu_copy(dst->params[i]->value, src->params[i]->value, 1);
    if (with_buffers)
        for (int i = 0; i < src->nbuffers; i++) mgpu_copy(*dst->buffers[i], *src->buffers[i], 1);
}

static void mgpu__layer_free(mgpu_layer *l) {
    if (!l) return;
    mgpu_free(l->weight.value);
    mgpu_free(l->weight.grad);
    mgpu_free(l->bias.value);
    mgpu_free(l->bias.grad);
    mgpu_free(l->running_mean);
    mgpu_free(l->running_var);
    mgpu_free(l->save_mean);
    mgpu_free(l->save_invstd);
    mgpu_free(l->output);
    mgpu_free(l->dinput);
    mgpu_free(l->dsum);
    mgpu__layer_free(l->conv1);
    mgpu__layer_free(l->bn1);
    mgpu__layer_free(l->conv2);
    mgpu__layer_free(l->bn2);
    mgpu__layer_free(l->shortcut);
    free(l);
}

MGPU_DEF void mgpu_net_free(mgpu_net *net) {
    if (!net) return;
    for (int i = 0; i < net->nlayers; i++) mgpu__layer_free(net->layers[i]);
    for (int i = 0; i < net->nparams; i++) mgpu_free(net->momentum[i]);
    mgpu_free(net->losses);
    mgpu_free(net->dlogits);
    mgpu_free(net->loss_sum);
    free(net);
}

/* -------------------------------------------------------- evaluation */
MGPU_DEF double mgpu_net_evaluate_accuracy(mgpu_net *net, const mgpu_dataset *data, int batch_size) {
    int was_training = net->training;
    net->training = 0;
    mgpu_loader *loader = mgpu_loader_new(data, batch_size, 0, 0);
    mgpu_loader_start_epoch(loader, 0);
    mgpu_tensor *correct = mgpu_zeros(net->device, mgpu_shape1(1));
    mgpu_tensor *count = mgpu_empty(net->device, mgpu_shape1(1));
    mgpu_batch b;
    while (mgpu_loader_next(loader, &b)) {
        mgpu_tensor *x = mgpu_to(b.x, net->device, 1);
        mgpu_tensor *y = mgpu_to(b.y, net->device, 1);
        mgpu_accuracy_count(count, mgpu_net_forward(net, x), y);
        mgpu_add_(correct, count);
        mgpu_free(x);
        mgpu_free(y);
    }
    double accuracy = mgpu_item(correct, 0) / (double)data->n;
    mgpu_free(correct);
    mgpu_free(count);
    mgpu_loader_free(loader);
    net->training = was_training;
    return accuracy;
}

/* ---------------------------------------------------- save and load */
#define MGPU__NET_MAGIC "MGPUNET1"
#define MGPU__NET_VERSION 1u

/* 64-bit FNV-1a: simple, and any flipped byte changes it. */
static uint64_t mgpu__fnv1a(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = (const unsigned char *)data;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}
#define MGPU__FNV_OFFSET 0xcbf29ce484222325ull

/* The tensors of a checkpoint, in order: parameters, then buffers. */
static int mgpu__net_num_saved(const mgpu_net *net) { return net->nparams + net->nbuffers; }
static mgpu_tensor *mgpu__net_saved(const mgpu_net *net, int i) {
    return i < net->nparams ? net->params[i]->value : *net->buffers[i - net->nparams];
}

static void mgpu__write_all(FILE *f, const char *path, const void *data, size_t n, uint64_t *hash) {
    if (fwrite(data, 1, n, f) != n)
        mgpu_fatal("%s: cannot write the checkpoint (%s)", path, strerror(errno));
    *hash = mgpu__fnv1a(*hash, data, n);
}

MGPU_DEF void mgpu_net_save(const mgpu_net *net, const char *path) {
    FILE *f = fopen(path, "wb");
    if (!f) mgpu_fatal("%s: cannot open for writing (%s)", path, strerror(errno));
    uint64_t hash = MGPU__FNV_OFFSET;
    uint32_t header[2] = {MGPU__NET_VERSION, (uint32_t)mgpu__net_num_saved(net)};
    mgpu__write_all(f, path, MGPU__NET_MAGIC, 8, &hash);
    mgpu__write_all(f, path, header, sizeof header, &hash);
    for (int i = 0; i < mgpu__net_num_saved(net); i++) {
        const mgpu_tensor *t = mgpu__net_saved(net, i);
        uint32_t shape[1 + MGPU_MAX_DIMS] = {(uint32_t)t->shape.ndim};
        for (int k = 0; k < MGPU_MAX_DIMS; k++) shape[1 + k] = (uint32_t)t->shape.d[k];
        mgpu__write_all(f, path, shape, sizeof shape, &hash);
        float *values = (float *)mgpu__xmalloc(t->numel * sizeof(float));
        mgpu_to_host(t, values);
        mgpu__write_all(f, path, values, t->numel * sizeof(float), &hash);
        free(values);
    }
    if (fwrite(&hash, sizeof hash, 1, f) != 1 || fclose(f) != 0)
        mgpu_fatal("%s: cannot write the checkpoint (%s)", path, strerror(errno));
}

MGPU_DEF void mgpu_net_load(mgpu_net *net, const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) mgpu_fatal("%s: cannot open the checkpoint (%s)", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode))
        mgpu_fatal("%s: cannot read the checkpoint (not a regular file)", path);
    long size = (long)st.st_size;
    unsigned char *bytes = (unsigned char *)mgpu__xmalloc((size_t)size);
    if (fread(bytes, 1, (size_t)size, f) != (size_t)size)
        mgpu_fatal("%s: cannot read the checkpoint (%s)", path, strerror(errno));
    fclose(f);
    /* Check everything before touching the network. */
    size_t at = 0, total = (size_t)size;
    const size_t header_bytes = 8 + 2 * sizeof(uint32_t), trailer = sizeof(uint64_t);
    if (total < header_bytes + trailer || memcmp(bytes, MGPU__NET_MAGIC, 8) != 0)
        mgpu_fatal("%s: not an mgpu checkpoint (no \"" MGPU__NET_MAGIC "\" header)", path);
    uint32_t header[2];
    memcpy(header, bytes + 8, sizeof header);
    at = header_bytes;
    if (header[0] != MGPU__NET_VERSION)
        mgpu_fatal("%s: checkpoint version %u, this library reads version %u", path, header[0],
                   MGPU__NET_VERSION);
    if ((int)header[1] != mgpu__net_num_saved(net))
        mgpu_fatal("%s: holds %u tensors, the network has %d (another network's checkpoint?)", path,
                   header[1], mgpu__net_num_saved(net));
    size_t *offsets = (size_t *)mgpu__xcalloc((size_t)header[1], sizeof(size_t));
    for (int i = 0; i < (int)header[1]; i++) {
        const mgpu_tensor *t = mgpu__net_saved(net, i);
        uint32_t shape[1 + MGPU_MAX_DIMS];
        if (at + sizeof shape > total - trailer)
            mgpu_fatal("%s: truncated in tensor %d of %u", path, i, header[1]);
        memcpy(shape, bytes + at, sizeof shape);
        at += sizeof shape;
        int same = shape[0] == (uint32_t)t->shape.ndim;
        for (int k = 0; k < MGPU_MAX_DIMS; k++) same &= shape[1 + k] == (uint32_t)t->shape.d[k];
        if (!same) {
            char want[64];
            mgpu_fatal("%s: tensor %d has shape (%u dims: %u, %u, %u, %u), the network's is %s", path,
                       i, shape[0], shape[1], shape[2], shape[3], shape[4],
                       mgpu_shape_str(t->shape, want, sizeof want));
        }
        offsets[i] = at;
        if (t->numel * sizeof(float) > total - trailer - at)
            mgpu_fatal("%s: truncated in tensor %d of %u", path, i, header[1]);
        at += t->numel * sizeof(float);
    }
    if (at != total - trailer)
        mgpu_fatal("%s: %zu bytes after the last tensor, expected %zu (damaged file)", path,
                   total - at, trailer);
    uint64_t stored;
    memcpy(&stored, bytes + at, sizeof stored);
    if (stored != mgpu__fnv1a(MGPU__FNV_OFFSET, bytes, at))
        mgpu_fatal("%s: checksum mismatch (the file is damaged)", path);
    for (int i = 0; i < (int)header[1]; i++) {
        mgpu_tensor *t = mgpu__net_saved(net, i);
        mgpu_tensor *host = mgpu_from_host(mgpu_cpu(), t->shape, (const float *)(bytes + offsets[i]));
        mgpu_copy(t, host, 0);
        mgpu_free(host);
    }
    free(offsets);
    free(bytes);
}
