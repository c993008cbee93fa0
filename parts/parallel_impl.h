/* ======================================================================
   Data parallelism
   ====================================================================== */
struct mgpu_data_parallel {
    int n;
    mgpu_dp_mode mode;
    const char *algorithm;
    mgpu_device *devices[MGPU_MAX_DEVICES];
    mgpu_net *replicas[MGPU_MAX_DEVICES];   /* replicas[0] is the caller's net */
    mgpu_tensor *x_shards[MGPU_MAX_DEVICES], *y_shards[MGPU_MAX_DEVICES];
    mgpu_tensor *loss_sum[MGPU_MAX_DEVICES], *correct[MGPU_MAX_DEVICES], *count[MGPU_MAX_DEVICES];
    /* gather mode, on device 0: the whole batch's logits, labels and
       logit gradients, and a staging copy of each other replica's gradients */
    mgpu_tensor *logits, *labels, *dlogits, *losses, *batch_loss;
    mgpu_tensor *staged[MGPU_MAX_DEVICES][128];
};

MGPU_DEF mgpu_data_parallel *mgpu_data_parallel_new(mgpu_net *net, mgpu_device *const *devices,
                                                    int n, mgpu_dp_mode mode) {
    MGPU_REQUIRE(n >= 1 && n <= MGPU_MAX_DEVICES, "mgpu_data_parallel_new: %d devices", n);
    MGPU_REQUIRE(net->device == devices[0],
                 "mgpu_data_parallel_new: the network is on %s, it must be on devices[0] (%s)",
                 net->device->name, devices[0]->name);
    mgpu_data_parallel *dp = (mgpu_data_parallel *)mgpu__xcalloc(1, sizeof *dp);
    dp->n = n;
    dp->mode = mode;
    for (int i = 0; i < n; i++) {
        dp->devices[i] = devices[i];
        /* Replicas start as exact copies: one broadcast from device 0. */
        dp->replicas[i] = i == 0 ? net : mgpu_net_replicate(net, devices[i]);
        dp->loss_sum[i] = mgpu_zeros(devices[i], mgpu_shape1(1));
        dp->correct[i] = mgpu_zeros(devices[i], mgpu_shape1(1));
        dp->count[i] = mgpu_zeros(devices[i], mgpu_shape1(1));
    }
    dp->algorithm = n == 1 ? "none" : mode == MGPU_DP_GATHER ? "gather" : NULL;
    return dp;
}

MGPU_DEF mgpu_net *mgpu_data_parallel_module(mgpu_data_parallel *dp) { return dp->replicas[0]; }
MGPU_DEF mgpu_net *mgpu_data_parallel_replica(mgpu_data_parallel *dp, int i) {
    MGPU_REQUIRE(i >= 0 && i < dp->n, "mgpu_data_parallel_replica: index %d of %d", i, dp->n);
    return dp->replicas[i];
}
MGPU_DEF const char *mgpu_data_parallel_algorithm(const mgpu_data_parallel *dp) {
    return dp->algorithm ? dp->algorithm : "(not run yet)";
}

/* DistributedDataParallel's way: each device computes the loss of its own
   shard, scaled by 1/N of the WHOLE batch, so that the allreduced sum of
   the replicas' gradients is the gradient of the batch's mean loss. */
static void mgpu__dp_step_allreduce(mgpu_data_parallel *dp, int batch, float lr, float momentum,
                                    float weight_decay) {
    for (int i = 0; i < dp->n; i++) {
        mgpu_net *r = dp->replicas[i];
        mgpu_net_zero_grad(r);
        mgpu_tensor *logits = mgpu_net_forward(r, dp->x_shards[i]);
        mgpu_accuracy_count(dp->count[i], logits, dp->y_shards[i]);
        mgpu_add_(dp->correct[i], dp->count[i]);
        mgpu_net_loss_backward(r, logits, dp->y_shards[i], 1.0f / (float)batch, dp->loss_sum[i]);
    }
    if (dp->n > 1) {
        mgpu_tensor *grads[MGPU_MAX_DEVICES];
        for (int p = 0; p < dp->replicas[0]->nparams; p++) {
            for (int i = 0; i < dp->n; i++) grads[i] = dp->replicas[i]->params[p]->grad;
            dp->algorithm = mgpu_allreduce_auto(grads, dp->n, 0);
        }
    }
    for (int i = 0; i < dp->n; i++) mgpu_net_sgd(dp->replicas[i], lr, momentum, weight_decay);
}

/* torch.nn.DataParallel's way, step by step. */
static void mgpu__dp_step_gather(mgpu_data_parallel *dp, int batch, float lr, float momentum,
                                 float weight_decay) {
    mgpu_net *module = dp->replicas[0];
    mgpu_device *d0 = dp->devices[0];
    /* 1. replicate: broadcast device 0's parameters and buffers */
    for (int i = 1; i < dp->n; i++) mgpu_net_copy_params(dp->replicas[i], module, 1);
    /* 2. forward on every device, 3. gather the logits on device 0 */
    int classes = 0, row = 0;
    for (int i = 0; i < dp->n; i++) {
        mgpu_net *r = dp->replicas[i];
        mgpu_net_zero_grad(r);
        mgpu_tensor *logits = mgpu_net_forward(r, dp->x_shards[i]);
        classes = logits->shape.d[1];
        mgpu_ensure(&dp->logits, d0, mgpu_shape2(batch, classes));
        mgpu_ensure(&dp->labels, d0, mgpu_shape1(batch));
        mgpu_tensor *rows = mgpu_narrow(dp->logits, row, logits->shape.d[0]);
        mgpu_tensor *labels = mgpu_narrow(dp->labels, row, logits->shape.d[0]);
        mgpu_copy(rows, logits, 1);
        mgpu_copy(labels, dp->y_shards[i], 1);
        row += logits->shape.d[0];
        mgpu_free(rows);
        mgpu_free(labels);
    }
    /* 4. the loss of the whole batch on device 0 */
    mgpu_ensure(&dp->losses, d0, mgpu_shape1(batch));
    mgpu_ensure(&dp->dlogits, d0, dp->logits->shape);
    mgpu_ensure(&dp->batch_loss, d0, mgpu_shape1(1));
    mgpu_cross_entropy_forward(dp->losses, dp->logits, dp->labels);
    mgpu_sum(dp->batch_loss, dp->losses);
    mgpu_add_(dp->loss_sum[0], dp->batch_loss);
    mgpu_accuracy_count(dp->count[0], dp->logits, dp->labels);
    mgpu_add_(dp->correct[0], dp->count[0]);
    mgpu_cross_entropy_backward(dp->dlogits, dp->logits, dp->labels, 1.0f / (float)batch);
    /* 5. scatter the logits' gradient back, backward on every device */
    row = 0;
    for (int i = 0; i < dp->n; i++) {
        mgpu_net *r = dp->replicas[i];
        int rows_here = dp->x_shards[i]->shape.d[0];
        mgpu_tensor *slice = mgpu_narrow(dp->dlogits, row, rows_here);
        mgpu_tensor *dlogits = i == 0 ? slice : mgpu_to(slice, dp->devices[i], 1);
        mgpu_net_backward(r, dlogits);
        if (dlogits != slice) mgpu_free(dlogits);
        mgpu_free(slice);
        row += rows_here;
    }
    /* 6. sum every replica's gradients into device 0, 7. SGD there only */
    for (int i = 1; i < dp->n; i++)
        for (int p = 0; p < module->nparams; p++) {
            mgpu_tensor *grad = dp->replicas[i]->params[p]->grad;
            mgpu_tensor *staged = mgpu_ensure(&dp->staged[i][p], d0, grad->shape);
            mgpu_copy(staged, grad, 1);
            mgpu_add_(module->params[p]->grad, staged);
        }
    mgpu_net_sgd(module, lr, momentum, weight_decay);
}

MGPU_DEF void mgpu_data_parallel_step(mgpu_data_parallel *dp, const mgpu_tensor *X,
                                      const mgpu_tensor *y, float lr, float momentum,
                                      float weight_decay) {
    int batch = X->shape.d[0];
    for (int i = 0; i < dp->n; i++) {
        mgpu_free(dp->x_shards[i]);
        mgpu_free(dp->y_shards[i]);
    }
    mgpu_split_batch(X, y, dp->devices, dp->n, dp->x_shards, dp->y_shards);
    if (dp->mode == MGPU_DP_GATHER)
        mgpu__dp_step_gather(dp, batch, lr, momentum, weight_decay);
    else
        mgpu__dp_step_allreduce(dp, batch, lr, momentum, weight_decay);
}

MGPU_DEF void mgpu_data_parallel_take_stats(mgpu_data_parallel *dp, double *loss_sum,
                                            double *correct) {
    *loss_sum = *correct = 0;
    for (int i = 0; i < dp->n; i++) {
        *loss_sum += mgpu_item(dp->loss_sum[i], 0);
        *correct += mgpu_item(dp->correct[i], 0);
        mgpu_fill(dp->loss_sum[i], 0.0f);
        mgpu_fill(dp->correct[i], 0.0f);
    }
}

MGPU_DEF void mgpu_data_parallel_free(mgpu_data_parallel *dp) {
    if (!dp) return;
    for (int i = 0; i < dp->n; i++) {
        if (i > 0) mgpu_net_free(dp->replicas[i]);
        mgpu_free(dp->x_shards[i]);
        mgpu_free(dp->y_shards[i]);
        mgpu_free(dp->loss_sum[i]);
        mgpu_free(dp->correct[i]);
        mgpu_free(dp->count[i]);
        for (int p = 0; p < 128; p++) mgpu_free(dp->staged[i][p]);
    }
    mgpu_free(dp->logits);
    mgpu_free(dp->labels);
    mgpu_free(dp->dlogits);
    mgpu_free(dp->losses);
    mgpu_free(dp->batch_loss);
    free(dp);
}
