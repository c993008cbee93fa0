/* ======================================================================
   Batch norm, losses, optimisers: checks, then one kernel launch each
   (the kernels are in kernels/batchnorm.h, loss.h and sgd.h).
   ====================================================================== */
#ifdef __cplusplus
extern "C" {
#endif

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
}

/* The CUDA reduction's scratch (see kernels/batchnorm.h); none on the CPU. */
static mgpu_tensor *mgpu__bn_scratch(mgpu_device *dev, size_t floats) {
    return mgpu_device_is_gpu(dev) ? mgpu_empty(dev, mgpu_shape1((int)floats)) : NULL;
}

MGPU_DEF void mgpu_batchnorm2d_forward(mgpu_tensor *y, const mgpu_tensor *x,
                                       const mgpu_tensor *gamma, const mgpu_tensor *beta,
                                       mgpu_tensor *running_mean, mgpu_tensor *running_var,
                                       mgpu_tensor *save_mean, mgpu_tensor *save_invstd,
                                       int training, float momentum, float eps, int fuse_relu) {
    const char *op = "mgpu_batchnorm2d_forward";
    char s[64];
    mgpu_device *dev = y->device;
    mgpu__bn_forward_args a;
    memset(&a, 0, sizeof a);
    mgpu__bn_dims(x, op, &a.n, &a.c, &a.hw);
    mgpu__require_device(x, dev, op);
    mgpu__require_same_shape(y, x, op);
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
    a.y = y->data;
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
    mgpu__before_write(y);
    if (training) {
        a.save_mean = save_mean->data;
        a.save_invstd = save_invstd->data;
        mgpu__before_write(running_mean);
        mgpu__before_write(running_var);
        mgpu__before_write(save_mean);
        mgpu__before_write(save_invstd);
        scratch = mgpu__bn_scratch(dev, (size_t)a.c * a.splits * 3); /* Welford triples */
        a.partials = scratch ? scratch->data : NULL;
    }
    mgpu__launch_on(&dev->queue[0], "batchnorm", mgpu__bn_forward_cpu,
                    MGPU__CUDA_FN(mgpu__bn_forward_cuda), &a, sizeof a);
    mgpu_free(scratch);
}

MGPU_DEF void mgpu_batchnorm2d_backward(mgpu_tensor *dx, mgpu_tensor *dgamma, mgpu_tensor *dbeta,
                                        const mgpu_tensor *dy, const mgpu_tensor *x,
                                        const mgpu_tensor *y, const mgpu_tensor *gamma,
                                        const mgpu_tensor *save_mean,
                                        const mgpu_tensor *save_invstd, int fuse_relu,
                                        int accumulate) {
    const char *op = "mgpu_batchnorm2d_backward";
    mgpu_device *dev = dx->device;
    mgpu__bn_backward_args a;
    memset(&a, 0, sizeof a);
    mgpu__bn_dims(x, op, &a.n, &a.c, &a.hw);
    mgpu__require_device(x, dev, op);
    mgpu__require_tensor(dy, dev, op, "dy");
    mgpu__require_same_shape(dx, x, op);
    mgpu__require_same_shape(dy, x, op);
    if (fuse_relu) {
        mgpu__require_tensor(y, dev, op, "y (needed with fuse_relu)");
        mgpu__require_same_shape(y, x, op);
    }
    mgpu__require_per_channel(dgamma, a.c, dev, op, "dgamma");
    mgpu__require_per_channel(dbeta, a.c, dev, op, "dbeta");
    mgpu__require_per_channel(gamma, a.c, dev, op, "gamma");
    mgpu__require_per_channel(save_mean, a.c, dev, op, "save_mean");
    mgpu__require_per_channel(save_invstd, a.c, dev, op, "save_invstd");
    a.dx = dx->data;
    a.dgamma = dgamma->data;
    a.dbeta = dbeta->data;
    a.dy = dy->data;
    a.x = x->data;
    a.y = fuse_relu ? y->data : NULL;
    a.gamma = gamma->data;
    a.save_mean = save_mean->data;
    a.save_invstd = save_invstd->data;
    a.fuse_relu = fuse_relu != 0;
    a.accumulate = accumulate != 0;
    a.splits = mgpu__bn_splits((size_t)a.n * (size_t)a.hw);
    /* Partial sums of g and g xhat per slice, then the two means per channel. */
    mgpu_tensor *scratch = mgpu__bn_scratch(dev, (size_t)a.c * a.splits * 2 + (size_t)a.c * 2);
    a.partials = scratch ? scratch->data : NULL;
    mgpu__before_write(dx);
    mgpu__before_write(dgamma);
    mgpu__before_write(dbeta);
    mgpu__launch_on(&dev->queue[0], "batchnorm backward", mgpu__bn_backward_cpu,
                    MGPU__CUDA_FN(mgpu__bn_backward_cuda), &a, sizeof a);
    mgpu_free(scratch);
}

/* Checks logits [N, classes] and labels [N] against out's device. */
static mgpu__ce_args mgpu__ce_prepare(const char *op, mgpu_tensor *out, const mgpu_tensor *logits,
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
    return a;
}
/* out must have `numel` values, `what` says which. */
static void mgpu__require_numel(const mgpu_tensor *out, size_t numel, const char *op, const char *what) {
    char s[64];
    MGPU_REQUIRE(out->numel == numel, "%s: the output has shape %s; it must be %s (%zu values)", op,
                 mgpu_shape_str(out->shape, s, sizeof s), what, numel);
}

MGPU_DEF void mgpu_cross_entropy_forward(mgpu_tensor *losses, const mgpu_tensor *logits,
                                         const mgpu_tensor *labels) {
    const char *op = "mgpu_cross_entropy_forward";
    mgpu__ce_args a = mgpu__ce_prepare(op, losses, logits, labels);
    mgpu__require_numel(losses, (size_t)a.n, op, "[N]");
    mgpu__before_write(losses);
    mgpu__launch_on(&losses->device->queue[0], "cross entropy", mgpu__ce_forward_cpu,
                    MGPU__CUDA_FN(mgpu__ce_forward_cuda), &a, sizeof a);
}

MGPU_DEF void mgpu_cross_entropy_backward(mgpu_tensor *dlogits, const mgpu_tensor *logits,
                                          const mgpu_tensor *labels, float scale) {
    const char *op = "mgpu_cross_entropy_backward";
    mgpu__ce_args a = mgpu__ce_prepare(op, dlogits, logits, labels);
    mgpu__require_same_shape(dlogits, logits, op);
    a.scale = scale;
    mgpu__before_write(dlogits);
    mgpu__launch_on(&dlogits->device->queue[0], "cross entropy backward", mgpu__ce_backward_cpu,
                    MGPU__CUDA_FN(mgpu__ce_backward_cuda), &a, sizeof a);
}

MGPU_DEF void mgpu_accuracy_count(mgpu_tensor *count, const mgpu_tensor *logits,
                                  const mgpu_tensor *labels) {
    const char *op = "mgpu_accuracy_count";
    mgpu__ce_args a = mgpu__ce_prepare(op, count, logits, labels);
    mgpu__require_numel(count, 1, op, "[1]");
    mgpu__before_write(count);
    mgpu__launch_on(&count->device->queue[0], "accuracy", mgpu__accuracy_cpu,
                    MGPU__CUDA_FN(mgpu__accuracy_cuda), &a, sizeof a);
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

MGPU_DEF void mgpu_sgd_step(mgpu_tensor *param, const mgpu_tensor *grad,
                            mgpu_tensor *momentum_buf, float lr, float momentum,
                            float weight_decay, int first_step) {
    const char *op = "mgpu_sgd_step";
    mgpu__require_device(grad, param->device, op);
    mgpu__require_same_shape(param, grad, op);
    mgpu__sgd_args a = {param->data, grad->data, NULL, param->numel, lr, momentum, weight_decay,
                        first_step != 0};
    if (momentum != 0.0f) {
        mgpu__require_tensor(momentum_buf, param->device, op, "momentum_buf (needed with momentum)");
        mgpu__require_same_shape(param, momentum_buf, op);
        mgpu__before_write(momentum_buf);
        a.buf = momentum_buf->data;
    }
    mgpu__before_write(param);
    mgpu__launch_on(&param->device->queue[0], "sgd", mgpu__sgd_cpu, MGPU__CUDA_FN(mgpu__sgd_cuda),
                    &a, sizeof a);
}

#ifdef __cplusplus
}
#endif
