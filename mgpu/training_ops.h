/* mgpu/training_ops.h: what training adds to the layers: batch norm (and
   its synchronised form over a process group), the cross-entropy loss and
   accuracy, sums, and the optimizers' steps (SGD as the book writes it,
   SGD with momentum, Adam and AdamW). The manual's TRAINING. Chapter 2.
   defines: mgpu_batchnorm2d_forward, mgpu_batchnorm2d_backward,
   mgpu_cross_entropy_forward, mgpu_cross_entropy_backward,
   mgpu_accuracy_count, mgpu_sum, mgpu_mean, mgpu_sgd_book, mgpu_sgd_step */
/* ======================================================================
   Batch norm, losses, optimisers: checks, then one kernel launch each
   (the kernels are in kernels/batchnorm.h, loss.h and sgd.h). A GPU's
   loss kernel cannot stop the program at a bad label: it writes the
   label to pinned host memory, and mgpu_synchronize (mgpu/queues.h)
   raises the error once the device is waited for.
   ====================================================================== */

/* A tensor that must be there, on dev. */
static void mgpu__require_tensor(const mgpu_tensor *t, const mgpu_device *dev, const char *op,
                                 const char *what) {
    MGPU_REQUIRE(t != NULL, "%s: %s is NULL", op, what);
    mgpu__require_device(t, dev, op);
}
/* gamma, beta, the running and saved statistics: one value per channel. */
static void mgpu__require_per_channel(const mgpu_tensor *t, int channels, const mgpu_device *dev,
                                      const char *op, const char *what) {
    char s[64];
    mgpu__require_tensor(t, dev, op, what);
    MGPU_REQUIRE(t->numel == (size_t)channels, "%s: %s has shape %s; it needs one value per channel (%d)",
                 op, what, mgpu_shape_str(t->shape, s, sizeof s), channels);
}

/* x is [N, C, spatial...]: the sizes batch norm works with. */
static void mgpu__bn_dims(const mgpu_tensor *x, const char *op, int *n, int *c, int *hw) {
    char s[64];
    MGPU_REQUIRE(x->shape.ndim >= 2, "%s: x has shape %s; it must be [N, C, H, W] or [N, C]", op,
                 mgpu_shape_str(x->shape, s, sizeof s));
    *n = x->shape.d[0];
    *c = x->shape.d[1];
    MGPU_REQUIRE(*c >= 1, "%s: x has shape %s, with no channels", op, mgpu_shape_str(x->shape, s, sizeof s));
    *hw = 1;
    for (int k = 2; k < x->shape.ndim; k++) *hw *= x->shape.d[k];
    MGPU_REQUIRE(!mgpu_device_is_gpu(x->device) || x->numel < ((size_t)1 << 31),
                 "%s: x has shape %s, 2^31 values or more: the GPU's batch norm indexes them "
                 "with 32 bits (split the batch)", op, mgpu_shape_str(x->shape, s, sizeof s));
}

/* The CUDA reduction's scratch (see kernels/batchnorm.h); none on the CPU. */
static mgpu_tensor *mgpu__bn_scratch(mgpu_device *dev, size_t floats) {
    return mgpu_device_is_gpu(dev) ? mgpu_empty(dev, mgpu_shape1((int)floats)) : NULL;
}
/* The counters with which the last block of a channel's reduction knows
   it is the last (kernels/batchnorm.h, "Finishing a channel"), at least
   one a channel: kept by the device for all its batch norms, all 0
   between kernels, as each channel's last block sets its counter back.
   Made (zeroed, in multiples of 512) when a batch norm has more channels
   than any before it on the device; NULL on the CPU. Every batch norm
   runs on the device's compute queue, so no two kernels count at once. */
static unsigned *mgpu__bn_done(mgpu_device *dev, int channels) {
    if (!mgpu_device_is_gpu(dev)) return NULL;
    if (!dev->bn_done || dev->bn_done->numel < (size_t)channels) {
        mgpu_free(dev->bn_done); /* (its last kernels are queued before any that reuses it) */
        dev->bn_done = mgpu_zeros(dev, mgpu_shape1((channels + 511) / 512 * 512));
    }
    return (unsigned *)dev->bn_done->data;
}

/* The backward pass's name in a trace: whether it writes dx, or the
   channels-last copy the convolution before reads instead. */
static const char *mgpu__bn_backward_name(const mgpu__bn_backward_args *a) {
    return a->dx_t ? "batchnorm backward, channels-last dx" : "batchnorm backward";
}

/* A batch norm pass (or, with a phase, a part of one) on the compute queue. */
static void mgpu__bn_forward_enqueue(mgpu_device *dev, const char *name, const mgpu__bn_forward_args *a) {
    mgpu__launch_on(&dev->queue[0], name, mgpu__bn_forward_cpu, MGPU__CUDA_FN(mgpu__bn_forward_cuda), a, sizeof *a);
}
static void mgpu__bn_backward_enqueue(mgpu_device *dev, const mgpu__bn_backward_args *a, const char *name) {
    mgpu__launch_on(&dev->queue[0], name ? name : mgpu__bn_backward_name(a), mgpu__bn_backward_cpu,
                    MGPU__CUDA_FN(mgpu__bn_backward_cuda), a, sizeof *a);
}

/* A synchronised batch norm's passes (kernels/batchnorm.h, "Synchronised
   batch norm"): the parts of a, each launched on the compute queue, with
   the group's collective between them (which orders itself after the
   compute queue, and it after the collective). */
static void mgpu__bn_forward_synced(mgpu__bn_forward_args *a, mgpu_group *g, mgpu_device *dev) {
    mgpu_tensor *mine = mgpu_empty(dev, mgpu_shape2(a->c, 3));
    mgpu_tensor *all = mgpu_empty(dev, mgpu_shape3(mgpu_group_size(g), a->c, 3));
    a->phase = MGPU__BN_MOMENTS;
    a->moments = mine->data;
    mgpu__bn_forward_enqueue(dev, "batchnorm moments", a);
    mgpu_group_all_gather(g, mine, all);
    a->phase = MGPU__BN_MERGE;
    a->moments = all->data;
    a->ranks = mgpu_group_size(g);
    mgpu__bn_forward_enqueue(dev, "batchnorm merge", a);
    a->phase = MGPU__BN_NORMALISE;
    mgpu__bn_forward_enqueue(dev, "batchnorm", a);
    mgpu_free(mine);
    mgpu_free(all);
}
/* The group's count of values a channel has comes with the sums: the
   allreduced tensor is [C][2] sums, then this rank's count. */
static void mgpu__bn_backward_synced(mgpu__bn_backward_args *a, mgpu_group *g, mgpu_device *dev) {
    mgpu_tensor *sums = mgpu_empty(dev, mgpu_shape1(2 * a->c + 1));
    mgpu_tensor *count = mgpu_narrow(sums, 2 * a->c, 1);
    mgpu_fill(count, (float)((size_t)a->n * (size_t)a->hw));
    mgpu_free(count);
    a->phase = MGPU__BN_GRAD_SUMS;
    a->sums = sums->data;
    mgpu__bn_backward_enqueue(dev, a, "batchnorm backward sums");
    mgpu_group_allreduce(g, sums, MGPU_SUM);
    a->phase = MGPU__BN_INPUT_GRAD;
    mgpu__bn_backward_enqueue(dev, a, NULL);
    mgpu_free(sums);
}

/* mgpu_batchnorm2d_forward, and with skip (not NULL) the residual block's
   y = max(bn(x) + skip, 0) in one pass (kernels/batchnorm.h); with y_t,
   y channels-last in TF32 there too, or there alone if y is NULL. */
static void mgpu__batchnorm2d_forward(const char *op, mgpu_tensor *y, mgpu_tensor *y_t, const mgpu_tensor *x,
                                      const mgpu_tensor *skip, const mgpu_tensor *gamma,
                                      const mgpu_tensor *beta, mgpu_tensor *running_mean,
                                      mgpu_tensor *running_var, mgpu_tensor *save_mean,
                                      mgpu_tensor *save_invstd, int training, float momentum,
                                      float eps, int fuse_relu, mgpu_group *sync) {
    char s[64];
    mgpu_device *dev = x->device;
    mgpu__bn_forward_args a;
    memset(&a, 0, sizeof a);
    mgpu__bn_dims(x, op, &a.n, &a.c, &a.hw);
    if (y || !y_t) {
        mgpu__require_tensor(y, dev, op, "y");
        mgpu__require_same_shape(y, x, op);
        mgpu__before_write(y);
        a.y = y->data;
    }
    if (skip) {
        mgpu__require_device(skip, dev, op);
        mgpu__require_same_shape(skip, x, op);
        a.skip = skip->data;
    }
    mgpu__require_per_channel(gamma, a.c, dev, op, "gamma");
    mgpu__require_per_channel(beta, a.c, dev, op, "beta");
    mgpu__require_per_channel(running_mean, a.c, dev, op, "running_mean");
    mgpu__require_per_channel(running_var, a.c, dev, op, "running_var");
    size_t m = (size_t)a.n * (size_t)a.hw;
    if (training) {
        mgpu__require_per_channel(save_mean, a.c, dev, op, "save_mean");
        mgpu__require_per_channel(save_invstd, a.c, dev, op, "save_invstd");
        MGPU_REQUIRE(m > 1, "%s: training needs more than one value per channel; x has shape %s",
                     op, mgpu_shape_str(x->shape, s, sizeof s));
    }
    if (y_t) {
        mgpu__require_channels_last_of(y_t, x, op, "channels-last y_t");
        mgpu__before_write(y_t);
        a.y_t = y_t->data;
    }
    a.x = x->data;
    a.gamma = gamma->data;
    a.beta = beta->data;
    a.running_mean = running_mean->data;
    a.running_var = running_var->data;
    a.training = training != 0;
    a.fuse_relu = fuse_relu != 0;
    a.momentum = momentum;
    a.eps = eps;
    a.splits = mgpu__bn_splits(m);
    mgpu_tensor *scratch = NULL;
    if (training) {
        a.save_mean = save_mean->data;
        a.save_invstd = save_invstd->data;
        mgpu__before_write(running_mean);
        mgpu__before_write(running_var);
        mgpu__before_write(save_mean);
        mgpu__before_write(save_invstd);
        scratch = mgpu__bn_scratch(dev, (size_t)a.c * a.splits * 3); /* Welford triples */
        a.partials = scratch ? scratch->data : NULL;
        a.done = mgpu__bn_done(dev, a.c);
    }
    if (training && sync && mgpu_group_size(sync) > 1)
        mgpu__bn_forward_synced(&a, sync, dev);
    else
        mgpu__bn_forward_enqueue(dev, "batchnorm", &a);
    mgpu_free(scratch);
}

MGPU_DEF void mgpu_batchnorm2d_forward(mgpu_tensor *y, const mgpu_tensor *x,
                                       const mgpu_tensor *gamma, const mgpu_tensor *beta,
                                       mgpu_tensor *running_mean, mgpu_tensor *running_var,
                                       mgpu_tensor *save_mean, mgpu_tensor *save_invstd,
                                       int training, float momentum, float eps, int fuse_relu) {
    mgpu__batchnorm2d_forward("mgpu_batchnorm2d_forward", y, NULL, x, NULL, gamma, beta, running_mean,
                              running_var, save_mean, save_invstd, training, momentum, eps,
                              fuse_relu, NULL);
}

/* A residual block's end, for its bn2's backward pass (kernels/batchnorm.h
   says why): the block's output, whose ReLU mask goes on dy; where the
   masked gradient goes (the block's dsum); and the shortcut convolution's
   bias gradient, or NULL. */
typedef struct {
    const mgpu_tensor *output;
    mgpu_tensor *dsum, *dshortcut_bias;
} mgpu__bn_block_end;
/* mgpu_batchnorm2d_backward; with dx_t, dx channels-last in TF32 there
   instead of in dx (which may then be NULL); with end, as a residual
   block's bn2 (dy is then the block's output gradient); with dconv_bias
   (and accumulate 0), the bias gradient of the convolution before, which
   gets its exact value 0 (kernels/batchnorm.h). */
static void mgpu__batchnorm2d_backward(const char *op, mgpu_tensor *dx, mgpu_tensor *dx_t,
                                       mgpu_tensor *dgamma, mgpu_tensor *dbeta, const mgpu_tensor *dy,
                                       const mgpu_tensor *x, const mgpu_tensor *gamma,
                                       const mgpu_tensor *beta, const mgpu_tensor *save_mean,
                                       const mgpu_tensor *save_invstd, int fuse_relu, int accumulate,
                                       const mgpu__bn_block_end *end, mgpu_tensor *dconv_bias,
                                       mgpu_group *sync) {
    mgpu_device *dev = x->device;
    mgpu__bn_backward_args a;
    memset(&a, 0, sizeof a);
    mgpu__bn_dims(x, op, &a.n, &a.c, &a.hw);
    mgpu__require_tensor(dy, dev, op, "dy");
    mgpu__require_same_shape(dy, x, op);
    if (dx_t) {
        mgpu__require_channels_last_of(dx_t, x, op, "channels-last dx_t");
        mgpu__before_write(dx_t);
        a.dx_t = dx_t->data;
    } else {
        mgpu__require_tensor(dx, dev, op, "dx");
        mgpu__require_same_shape(dx, x, op);
        mgpu__before_write(dx);
        a.dx = dx->data;
    }
    mgpu__require_per_channel(dgamma, a.c, dev, op, "dgamma");
    mgpu__require_per_channel(dbeta, a.c, dev, op, "dbeta");
    if (end) {
        MGPU_REQUIRE(!fuse_relu, "%s: a residual block's bn2 has no ReLU of its own", op);
        mgpu__require_tensor(end->output, dev, op, "the block's output");
        mgpu__require_same_shape(end->output, x, op);
        mgpu__require_tensor(end->dsum, dev, op, "the block's dsum");
        mgpu__require_same_shape(end->dsum, x, op);
        mgpu__before_write(end->dsum);
        a.mask = end->output->data;
        a.dsum = end->dsum->data;
        if (end->dshortcut_bias) {
            mgpu__require_per_channel(end->dshortcut_bias, a.c, dev, op, "the shortcut's bias gradient");
            mgpu__before_write(end->dshortcut_bias);
            a.dshortcut_bias = end->dshortcut_bias->data;
        }
    }
    if (dconv_bias) {
        mgpu__require_per_channel(dconv_bias, a.c, dev, op, "the convolution's bias gradient");
        mgpu__before_write(dconv_bias);
        a.dconv_bias = dconv_bias->data;
    }
    mgpu__require_per_channel(gamma, a.c, dev, op, "gamma");
    if (fuse_relu) mgpu__require_per_channel(beta, a.c, dev, op, "beta (needed with fuse_relu)");
    mgpu__require_per_channel(save_mean, a.c, dev, op, "save_mean");
    mgpu__require_per_channel(save_invstd, a.c, dev, op, "save_invstd");
    a.dgamma = dgamma->data;
    a.dbeta = dbeta->data;
    a.dy = dy->data;
    a.x = x->data;
    a.gamma = gamma->data;
    a.beta = fuse_relu ? beta->data : NULL;
    a.save_mean = save_mean->data;
    a.save_invstd = save_invstd->data;
    a.fuse_relu = fuse_relu != 0;
    a.accumulate = accumulate != 0;
    a.splits = mgpu__bn_splits((size_t)a.n * (size_t)a.hw);
    /* Partial sums of g and g xhat per slice, then the two means per channel. */
    mgpu_tensor *scratch = mgpu__bn_scratch(dev, (size_t)a.c * a.splits * 2 + (size_t)a.c * 2);
    a.partials = scratch ? scratch->data : NULL;
    a.done = mgpu__bn_done(dev, a.c);
    mgpu__before_write(dgamma);
    mgpu__before_write(dbeta);
    if (sync && mgpu_group_size(sync) > 1)
        mgpu__bn_backward_synced(&a, sync, dev);
    else
        mgpu__bn_backward_enqueue(dev, &a, NULL);
    mgpu_free(scratch);
}
MGPU_DEF void mgpu_batchnorm2d_backward(mgpu_tensor *dx, mgpu_tensor *dgamma, mgpu_tensor *dbeta,
                                        const mgpu_tensor *dy, const mgpu_tensor *x,
                                        const mgpu_tensor *gamma, const mgpu_tensor *beta,
                                        const mgpu_tensor *save_mean,
                                        const mgpu_tensor *save_invstd, int fuse_relu,
                                        int accumulate) {
    mgpu__batchnorm2d_backward("mgpu_batchnorm2d_backward", dx, NULL, dgamma, dbeta, dy, x, gamma, beta,
                               save_mean, save_invstd, fuse_relu, accumulate, NULL, NULL, NULL);
}

/* Checks logits [N, classes] and labels [N] against out's device. The
   messages name op, the function the caller called, and count the samples
   from first_row (a data-parallel step's shard: where its rows start in
   the caller's batch). */
static mgpu__ce_args mgpu__ce_prepare(const char *op, int first_row, mgpu_tensor *out, const mgpu_tensor *logits,
                                      const mgpu_tensor *labels) {
    char sl[64], sy[64];
    mgpu__require_device(logits, out->device, op);
    mgpu__require_device(labels, out->device, op);
    MGPU_REQUIRE(logits->shape.ndim == 2 && logits->shape.d[1] >= 1 &&
                     labels->numel == (size_t)logits->shape.d[0],
                 "%s: logits %s and labels %s do not match; they must be [N, classes] and [N]", op,
                 mgpu_shape_str(logits->shape, sl, sizeof sl),
                 mgpu_shape_str(labels->shape, sy, sizeof sy));
    mgpu__ce_args a;
    memset(&a, 0, sizeof a);
    a.out = out->data;
    a.logits = logits->data;
    a.labels = labels->data;
    a.n = logits->shape.d[0];
    a.classes = logits->shape.d[1];
    a.op = op;
    a.first_row = first_row;
#if MGPU_CUDA
    mgpu_device *d = out->device;
    if (mgpu_device_is_gpu(d)) {
        if (!d->label_error) {
            /* (pinned host memory is the same pointer on a GPU: unified addressing) */
            MGPU_CUDA_CHECK(cudaMallocHost((void **)&d->label_error, sizeof *d->label_error));
            memset(d->label_error, 0, sizeof *d->label_error);
            d->label_claim = mgpu_zeros(d, mgpu_shape1(1)); /* (all bits 0: unclaimed) */
        }
        a.error = d->label_error;
        a.claim = (unsigned *)d->label_claim->data;
    }
#endif
    return a;
}
/* out must have `numel` values, `what` says which. */
static void mgpu__require_numel(const mgpu_tensor *out, size_t numel, const char *op, const char *what) {
    char s[64];
    MGPU_REQUIRE(out->numel == numel, "%s: the output has shape %s; it must be %s (%zu values)", op,
                 mgpu_shape_str(out->shape, s, sizeof s), what, numel);
}

static void mgpu__cross_entropy_forward(const char *op, int first_row, mgpu_tensor *losses,
                                        const mgpu_tensor *logits, const mgpu_tensor *labels) {
    mgpu__ce_args a = mgpu__ce_prepare(op, first_row, losses, logits, labels);
    mgpu__require_numel(losses, (size_t)a.n, op, "[N]");
    mgpu__before_write(losses);
    mgpu__launch_on(&losses->device->queue[0], "cross entropy", mgpu__ce_forward_cpu,
                    MGPU__CUDA_FN(mgpu__ce_forward_cuda), &a, sizeof a);
}

static void mgpu__cross_entropy_backward(const char *op, int first_row, mgpu_tensor *dlogits,
                                         const mgpu_tensor *logits, const mgpu_tensor *labels, float scale) {
    mgpu__ce_args a = mgpu__ce_prepare(op, first_row, dlogits, logits, labels);
    mgpu__require_same_shape(dlogits, logits, op);
    a.scale = scale;
    mgpu__before_write(dlogits);
    mgpu__launch_on(&dlogits->device->queue[0], "cross entropy backward", mgpu__ce_backward_cpu,
                    MGPU__CUDA_FN(mgpu__ce_backward_cuda), &a, sizeof a);
}

static void mgpu__accuracy_count(const char *op, int first_row, mgpu_tensor *count, const mgpu_tensor *logits,
                                 const mgpu_tensor *labels) {
    mgpu__ce_args a = mgpu__ce_prepare(op, first_row, count, logits, labels);
    mgpu__require_numel(count, 1, op, "[1]");
    mgpu__before_write(count);
    mgpu__launch_on(&count->device->queue[0], "accuracy", mgpu__accuracy_cpu,
                    MGPU__CUDA_FN(mgpu__accuracy_cuda), &a, sizeof a);
}
MGPU_DEF void mgpu_cross_entropy_forward(mgpu_tensor *losses, const mgpu_tensor *logits,
                                         const mgpu_tensor *labels) {
    mgpu__cross_entropy_forward("mgpu_cross_entropy_forward", 0, losses, logits, labels);
}
MGPU_DEF void mgpu_cross_entropy_backward(mgpu_tensor *dlogits, const mgpu_tensor *logits,
                                          const mgpu_tensor *labels, float scale) {
    mgpu__cross_entropy_backward("mgpu_cross_entropy_backward", 0, dlogits, logits, labels, scale);
}
MGPU_DEF void mgpu_accuracy_count(mgpu_tensor *count, const mgpu_tensor *logits,
                                  const mgpu_tensor *labels) {
    mgpu__accuracy_count("mgpu_accuracy_count", 0, count, logits, labels);
}

static void mgpu__sum_launch(const char *op, mgpu_tensor *out, const mgpu_tensor *x, double scale) {
    mgpu__require_device(x, out->device, op);
    mgpu__require_numel(out, 1, op, "[1]");
    mgpu__sum_args a = {out->data, x->data, x->numel, scale};
    mgpu__before_write(out);
    mgpu__launch_on(&out->device->queue[0], "sum", mgpu__sum_cpu, MGPU__CUDA_FN(mgpu__sum_cuda),
                    &a, sizeof a);
}
MGPU_DEF void mgpu_sum(mgpu_tensor *out, const mgpu_tensor *x) {
    mgpu__sum_launch("mgpu_sum", out, x, 1.0);
}
MGPU_DEF void mgpu_mean(mgpu_tensor *out, const mgpu_tensor *x) {
    MGPU_REQUIRE(x->numel > 0, "mgpu_mean: the tensor is empty");
    mgpu__sum_launch("mgpu_mean", out, x, 1.0 / (double)x->numel);
}

MGPU_DEF void mgpu_sgd_book(mgpu_tensor *param, mgpu_tensor *grad, float lr, int batch_size) {
    const char *op = "mgpu_sgd_book";
    mgpu__require_device(grad, param->device, op);
    mgpu__require_same_shape(param, grad, op);
    MGPU_REQUIRE(batch_size > 0, "%s: batch_size is %d; it must be positive", op, batch_size);
    mgpu__sgd_book_args a = {param->data, grad->data, param->numel, lr, (float)batch_size};
    mgpu__before_write(param);
    mgpu__before_write(grad);
    mgpu__launch_on(&param->device->queue[0], "sgd", mgpu__sgd_book_cpu,
                    MGPU__CUDA_FN(mgpu__sgd_book_cuda), &a, sizeof a);
}

/* As torch.optim.SGD: a learning rate, momentum and weight decay of 0 or
   more (a negative one would climb the loss), and finite. */
static void mgpu__require_sgd_settings(const char *op, float lr, float momentum, float weight_decay) {
    MGPU_REQUIRE(lr >= 0 && momentum >= 0 && weight_decay >= 0 && isfinite(lr) && isfinite(momentum) &&
                     isfinite(weight_decay),
                 "%s: learning rate %g, momentum %g, weight decay %g: each must be a finite 0 or more", op,
                 (double)lr, (double)momentum, (double)weight_decay);
}

/* torch.optim.SGD's update of count tensors, MGPU__LIST_MAX to a launch
   (kernels/sgd.h); bufs is NULL when momentum is 0. */

static void mgpu__sgd_tensors(const char *op, mgpu_tensor *const *params,
                              const mgpu_tensor *const *grads, mgpu_tensor *const *bufs,
                              int count, float lr, float momentum, float weight_decay,
                              int first_step) {
    mgpu__require_sgd_settings(op, lr, momentum, weight_decay);
    mgpu__sgd_args a;
    memset(&a, 0, sizeof a);
    a.lr = lr;
    a.momentum = momentum;
    a.weight_decay = weight_decay;
    a.first_step = first_step != 0;
    for (int i = 0; i < count; i++) {
        mgpu_tensor *param = params[i];
        mgpu__require_device(param, params[0]->device, op);
        mgpu__require_device(grads[i], param->device, op);
        mgpu__require_same_shape(param, grads[i], op);
        int t = a.list.count;
        if (momentum != 0.0f) {
            mgpu__require_tensor(bufs ? bufs[i] : NULL, param->device, op,
                                 "momentum_buf (needed with momentum)");
            mgpu__require_same_shape(param, bufs[i], op);
            mgpu__before_write(bufs[i]);
            a.buf[t] = bufs[i]->data;
        }
        mgpu__before_write(param);
        a.param[t] = param->data;
        a.grad[t] = grads[i]->data;
        int full = mgpu__list_add(&a.list, param->numel);
        if (full || i == count - 1) {
            mgpu__launch_on(&param->device->queue[0], "sgd", mgpu__sgd_cpu,
                            MGPU__CUDA_FN(mgpu__sgd_cuda), &a, sizeof a);
            a.list.count = 0;
        }
    }
}

/* Sets count tensors of one device to 0, MGPU__LIST_MAX to a launch. */
static void mgpu__zero_tensors(mgpu_tensor *const *tensors, int count) {
    mgpu__zero_args a;
    memset(&a, 0, sizeof a);
    for (int i = 0; i < count; i++) {
        mgpu__before_write(tensors[i]);
        a.data[a.list.count] = tensors[i]->data;
        int full = mgpu__list_add(&a.list, tensors[i]->numel);
        if (full || i == count - 1) {
            mgpu__launch_on(&tensors[i]->device->queue[0], "zero_grad", mgpu__zero_cpu,
                            MGPU__CUDA_FN(mgpu__zero_cuda), &a, sizeof a);
            a.list.count = 0;
        }
    }
}

MGPU_DEF void mgpu_sgd_step(mgpu_tensor *param, const mgpu_tensor *grad,
                            mgpu_tensor *momentum_buf, float lr, float momentum,
                            float weight_decay, int first_step) {
    mgpu__sgd_tensors("mgpu_sgd_step", &param, &grad, &momentum_buf, 1, lr, momentum,
                      weight_decay, first_step);
}
