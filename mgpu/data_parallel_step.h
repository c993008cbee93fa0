/* mgpu/data_parallel_step.h: one data-parallel step, as chapters 3 and 4
   take it: each replica's forward pass and loss on its shard, the
   backward pass with each bucket reduced as it fills, then the
   optimizer's step (on a ZeRO share where the wrapper has one), and
   accumulation over several batches. The buckets are grouped here, at
   the first step; one bucket's memory and reduction are in
   mgpu/data_parallel.h.
   defines: mgpu_data_parallel_accumulate, mgpu_data_parallel_step,
   mgpu_data_parallel_take_stats, mgpu_data_parallel_free */
/* Groups the gradients into buckets of about buckets.bytes, from the last
   layer back (the order backward produces them), and makes every replica's
   gradients views into one flat tensor per bucket, so a bucket is reduced
   as one vector. A bucket holds whole top-level layers. */
static void mgpu__dp_make_buckets(mgpu_data_parallel *dp) {
    const mgpu_net *net = dp->replicas[0];
    dp->buckets.last_layer = (int *)mgpu__xcalloc((size_t)net->nlayers, sizeof *dp->buckets.last_layer);
    dp->buckets.len = (size_t *)mgpu__xcalloc((size_t)net->nlayers, sizeof *dp->buckets.len);
    dp->buckets.grads = (mgpu_tensor *(*)[MGPU_MAX_DEVICES])mgpu__xcalloc((size_t)net->nlayers, sizeof *dp->buckets.grads);
    dp->buckets.scratch = (mgpu_tensor *(*)[MGPU_MAX_DEVICES])mgpu__xcalloc((size_t)net->nlayers, sizeof *dp->buckets.scratch);
    mgpu__zero_make_room(dp, net->nlayers);
    int last = net->nlayers - 1;
    while (last >= 0) {
        size_t floats = 0;
        int first = last;
        for (; first >= 0; first--) {
            for (int p = net->first_param[first]; p < net->first_param[first + 1]; p++)
                floats += net->params[p]->value->numel;
            if (floats * sizeof(float) >= dp->buckets.bytes) break;
        }
        if (first < 0) first = 0;
        if (floats > 0) {
            int b = dp->buckets.count++;
            dp->buckets.last_layer[b] = first;
            dp->buckets.len[b] = mgpu__zero_bucket_len(dp, floats);
            mgpu__dp_grad_bucket_make(dp, b);
            for (int i = 0; i < dp->n; i++) {
                int share = (int)((dp->buckets.len[b] + (size_t)dp->n - 1) / (size_t)dp->n);
                if (dp->n > 1) dp->buckets.scratch[b][i] = mgpu_empty(dp->devices[i], mgpu_shape1(share));
            }
            mgpu__zero_bucket_made(dp, b);
        }
        last = first - 1;
    }
}

/* Gives replica 0's gradients their own memory again: the caller keeps
   that network after the wrapper is gone. */
static void mgpu__dp_unbucket_module(mgpu_data_parallel *dp) {
    if (dp->buckets.count) mgpu__own_memory(dp->replicas[0], 0);
    mgpu__zero_unshare_values(dp);
    dp->replicas[0]->sharded = 0;
}

/* A bucket whose gradients the backward pass has completed: divided by
   the rows they add up where mgpu_data_parallel_accumulate added some,
   and its reduction started (when it overlaps the backward pass), or
   ZeRO-2's reduce-scatter. */
static void mgpu__dp_bucket_done(mgpu_data_parallel *dp, int b) {
    if (dp->accumulated_rows)
        for (int i = 0; i < dp->n; i++) mgpu_scale_(dp->buckets.grads[b][i], 1.0f / (float)dp->accumulated_rows);
    if (mgpu__zero_reduce_bucket(dp, b)) return;
    if (dp->buckets.reduce && dp->buckets.overlap) dp->algorithm = mgpu__dp_reduce_bucket(dp, b);
}

/* DistributedDataParallel's way, in three phases (below): each device
   computes the loss of its own shard, scaled by 1/N of the WHOLE batch
   given to the wrapper, so that the allreduced sum of the replicas'
   gradients is the gradient of the batch's mean loss (a distributed
   wrapper then averages that over the ranks, each with its own batch).
   The backward pass runs layer by layer on all devices together, and
   each bucket's reduction starts on the communication queues as soon as
   the backward of its layers has been enqueued everywhere, while the
   backward of the earlier layers goes on. The optimiser waits for the
   last bucket. A device that got no rows (a batch shorter than the
   devices) still takes part in every reduction, with zero gradients, and
   in the update, so the replicas stay the same.
   Accumulation (mgpu_data_parallel_accumulate) runs the first two phases
   alone: they add the batch's gradients (of the summed loss: the step
   divides by all the rows). */

/* Phase 1: each replica's forward pass and loss on its shard; grad[i]
   gets the loss's gradient on device i. `scale` multiplies the loss. */
static void mgpu__dp_forward_and_loss(mgpu_data_parallel *dp, float scale, const char *op,
                                      const mgpu_tensor *grad[MGPU_MAX_DEVICES]) {
    for (int i = 0, row = 0; i < dp->used; row += dp->x_shards[i]->shape.d[0], i++) {
        mgpu_net *r = dp->replicas[i]; /* (no zero_grad: the backward writes the gradients) */
        mgpu_tensor *logits = mgpu_net_forward(r, dp->x_shards[i]);
        mgpu__net_require_backward(r, op);
        mgpu__accuracy_count(op, row, dp->count[i], logits, dp->y_shards[i]);
        mgpu_add_(dp->correct[i], dp->count[i]);
        grad[i] = mgpu__net_loss_grad(r, logits, dp->y_shards[i], scale, dp->loss_sum[i], op, row);
    }
}

/* Phase 2: the backward pass, layer by layer on every device, adding to
   the gradients there (`adding`) or writing them; in a step (reduce),
   each bucket is handed on as soon as its layers are done. */
static void mgpu__dp_backward_with_buckets(mgpu_data_parallel *dp, const mgpu_tensor *grad[MGPU_MAX_DEVICES],
                                           int adding, int reduce) {
    int next_bucket = 0;
    for (int layer = dp->replicas[0]->nlayers - 1; layer >= 0; layer--) {
        if (next_bucket < dp->buckets.count) mgpu__zero_before_bucket(dp, next_bucket);
        for (int i = 0; i < dp->used; i++)
            grad[i] = mgpu__net_layer_backward(dp->replicas[i], layer, grad[i], adding);
        int complete = next_bucket < dp->buckets.count && dp->buckets.last_layer[next_bucket] == layer;
        if (complete && reduce) mgpu__dp_bucket_done(dp, next_bucket);
        next_bucket += complete;
    }
}

/* Phase 3: the reductions not yet started (without overlap), the wait
   for all of them, and the optimizer's step: ZeRO's on each member's
   share, or each replica's on its whole copy. */
static void mgpu__dp_finish_step(mgpu_data_parallel *dp, float lr, float momentum, float weight_decay) {
    int reduces = mgpu__dp_reduces(dp);
    if (dp->buckets.reduce && !dp->buckets.overlap && mgpu__zero_keeps_grads(dp))
        for (int b = 0; b < dp->buckets.count; b++) dp->algorithm = mgpu__dp_reduce_bucket(dp, b);
    if (reduces) {
        mgpu_comm_wait(dp->devices, dp->n);
    } else {
        mgpu_net *net = dp->replicas[0]; /* one device: no buckets to divide */
        for (int p = 0; p < net->nparams && dp->accumulated_rows; p++)
            mgpu_scale_(net->params[p]->grad, 1.0f / (float)dp->accumulated_rows);
    }
    dp->accumulated_rows = 0;
    if (mgpu__zero_step(dp, reduces, lr, momentum, weight_decay)) return;
    for (int i = 0; i < dp->n; i++) mgpu_net_step(dp->replicas[i], lr, momentum, weight_decay);
}

/* take_step 0: mgpu_data_parallel_accumulate's pass; 1: a step, after
   such passes or not. */
static void mgpu__dp_step_allreduce(mgpu_data_parallel *dp, int batch, float lr, float momentum,
                                    float weight_decay, int take_step) {
    if (mgpu__dp_reduces(dp) && dp->buckets.count == 0) mgpu__dp_make_buckets(dp);
    int adding = dp->accumulated_rows > 0; /* to gradients of passes before */
    float scale = take_step && !adding ? 1.0f / (float)batch : 1.0f;
    if (!take_step || adding) dp->accumulated_rows += batch;
    /* a device without rows takes part with zero gradients (ZeRO-2 makes
       its buckets zero) */
    for (int i = dp->used; i < dp->n && !adding && mgpu__zero_keeps_grads(dp); i++)
        for (int b = 0; b < dp->buckets.count; b++) mgpu_fill(dp->buckets.grads[b][i], 0.0f);
    const mgpu_tensor *grad[MGPU_MAX_DEVICES];
    mgpu__dp_forward_and_loss(dp, scale, take_step ? "mgpu_data_parallel_step" : "mgpu_data_parallel_accumulate",
                              grad);
    mgpu__dp_backward_with_buckets(dp, grad, adding, take_step);
    if (take_step) mgpu__dp_finish_step(dp, lr, momentum, weight_decay);
}

/* torch.nn.DataParallel's way, step by step. Like it, a batch shorter
   than the devices runs on the first dp->used of them only. */
static void mgpu__dp_step_gather(mgpu_data_parallel *dp, int batch, float lr, float momentum,
                                 float weight_decay) {
    mgpu_net *module = dp->replicas[0];
    mgpu_device *d0 = dp->devices[0];
    /* 1. replicate: broadcast device 0's parameters and buffers */
    for (int i = 1; i < dp->used; i++) mgpu_net_copy_params(dp->replicas[i], module, 1);
    /* 2. forward on every device, 3. gather the logits on device 0 */
    int classes = 0, row = 0;
    for (int i = 0; i < dp->used; i++) { /* (no zero_grad: the backward writes the gradients) */
        mgpu_net *r = dp->replicas[i];
        mgpu_tensor *logits = mgpu_net_forward(r, dp->x_shards[i]);
        mgpu__net_require_backward(r, "mgpu_data_parallel_step");
        classes = logits->shape.d[1];
        mgpu_ensure(&dp->gather.logits, d0, mgpu_shape2(batch, classes));
        mgpu_ensure(&dp->gather.labels, d0, mgpu_shape1(batch));
        mgpu_tensor *rows = mgpu_narrow(dp->gather.logits, row, logits->shape.d[0]);
        mgpu_tensor *labels = mgpu_narrow(dp->gather.labels, row, logits->shape.d[0]);
        mgpu_copy(rows, logits, 1);
        mgpu_copy(labels, dp->y_shards[i], 1);
        row += logits->shape.d[0];
        mgpu_free(rows);
        mgpu_free(labels);
    }
    /* 4. the loss of the whole batch on device 0 */
    mgpu_ensure(&dp->gather.losses, d0, mgpu_shape1(batch));
    mgpu_ensure(&dp->gather.dlogits, d0, dp->gather.logits->shape);
    mgpu_ensure(&dp->gather.batch_loss, d0, mgpu_shape1(1));
    const char *op = "mgpu_data_parallel_step";
    mgpu__cross_entropy_forward(op, 0, dp->gather.losses, dp->gather.logits, dp->gather.labels);
    mgpu_sum(dp->gather.batch_loss, dp->gather.losses);
    mgpu_add_(dp->loss_sum[0], dp->gather.batch_loss);
    mgpu__accuracy_count(op, 0, dp->count[0], dp->gather.logits, dp->gather.labels);
    mgpu_add_(dp->correct[0], dp->count[0]);
    mgpu__cross_entropy_backward(op, 0, dp->gather.dlogits, dp->gather.logits, dp->gather.labels, 1.0f / (float)batch);
    /* 5. scatter the logits' gradient back, backward on every device */
    row = 0;
    for (int i = 0; i < dp->used; i++) {
        mgpu_net *r = dp->replicas[i];
        int rows_here = dp->x_shards[i]->shape.d[0];
        mgpu_tensor *slice = mgpu_narrow(dp->gather.dlogits, row, rows_here);
        mgpu_tensor *dlogits = i == 0 ? slice : mgpu_to(slice, dp->devices[i], 1);
        mgpu__net_backward(r, dlogits, 0);
        if (dlogits != slice) mgpu_free(dlogits);
        mgpu_free(slice);
        row += rows_here;
    }
    /* 6. sum every replica's gradients into device 0, 7. SGD there only */
    for (int i = 1; i < dp->used; i++)
        for (int p = 0; p < module->nparams; p++) {
            mgpu_tensor *grad = dp->replicas[i]->params[p]->grad;
            mgpu_tensor *staged = mgpu_ensure(&dp->gather.staged[i][p], d0, grad->shape);
            mgpu_copy(staged, grad, 1);
            mgpu_add_(module->params[p]->grad, staged);
        }
    mgpu_net_step(module, lr, momentum, weight_decay);
}

/* What the caller did to replica 0 (the module) between steps reaches the
   others: its training mode always, and its values when they may have
   changed (loaded, or written through mgpu_net_param). In gather mode
   each step copies the values anyway. Under ZeRO-3, once sharded, only
   the buffers: the parameters' values live in the members' chunks (a
   write through the module's param.value is an error line). */
static void mgpu__dp_follow_module(mgpu_data_parallel *dp) {
    mgpu_net *module = dp->replicas[0];
    for (int i = 1; i < dp->n; i++) dp->replicas[i]->training = module->training;
    if (module->changes == dp->module_changes) return;
    int values_sharded = dp->zero.stage == 3 && dp->buckets.count > 0;
    for (int i = 1; i < dp->n && dp->mode == MGPU_DP_ALLREDUCE; i++) {
        if (!values_sharded) mgpu_net_copy_params(dp->replicas[i], module, 1);
        for (int b = 0; b < module->nbuffers && values_sharded; b++)
            mgpu_copy(*dp->replicas[i]->buffers[b], *module->buffers[b], 1);
    }
    dp->module_changes = module->changes;
}

/* DDP's broadcast_buffers: rank 0's running statistics go to every rank
   before a forward pass reads them. */
static void mgpu__dp_broadcast_buffers(mgpu_data_parallel *dp) {
    if (!dp->dist.group || mgpu_group_size(dp->dist.group) == 1) return;
    mgpu_net *net = dp->replicas[0];
    for (int i = 0; i < net->nbuffers; i++) mgpu_group_broadcast(dp->dist.group, *net->buffers[i], 0);
}

MGPU_DEF void mgpu_data_parallel_accumulate(mgpu_data_parallel *dp, const mgpu_tensor *X,
                                            const mgpu_tensor *y) {
    MGPU_REQUIRE(dp->mode == MGPU_DP_ALLREDUCE,
                 "mgpu_data_parallel_accumulate: the wrapper gathers on device 0 (MGPU_DP_GATHER); "
                 "accumulating gradients needs MGPU_DP_ALLREDUCE");
    mgpu__dp_follow_module(dp);
    mgpu__dp_broadcast_buffers(dp);
    mgpu__dp_scatter(dp, X, y);
    mgpu__dp_step_allreduce(dp, X->shape.d[0], 0.0f, 0.0f, 0.0f, 0);
    mgpu__dp_shards_used(dp);
}

MGPU_DEF void mgpu_data_parallel_step(mgpu_data_parallel *dp, const mgpu_tensor *X,
                                      const mgpu_tensor *y, float lr, float momentum,
                                      float weight_decay) {
    int batch = X->shape.d[0];
    mgpu__require_sgd_settings("mgpu_data_parallel_step", lr, momentum, weight_decay);
    mgpu__dp_follow_module(dp);
    mgpu__dp_broadcast_buffers(dp);
    mgpu__dp_scatter(dp, X, y);
    if (dp->mode == MGPU_DP_GATHER)
        mgpu__dp_step_gather(dp, batch, lr, momentum, weight_decay);
    else
        mgpu__dp_step_allreduce(dp, batch, lr, momentum, weight_decay, 1);
    mgpu__dp_shards_used(dp);
    dp->module_changes = dp->replicas[0]->changes; /* (this step's SGD: every replica took it) */
    dp->steps++;
    mgpu__zero_check_replicas(dp);
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
    mgpu__dp_zero_unshard_state(dp);
    mgpu__dp_unbucket_module(dp);
    for (int i = 0; i < dp->n; i++) {
        dp->replicas[i]->wrapped = 0;
        if (i > 0) mgpu_net_free(dp->replicas[i]);
        for (int set = 0; set < 2; set++) {
            mgpu_free(dp->x_set[set][i]);
            mgpu_free(dp->y_set[set][i]);
            mgpu_event_free(dp->set_free[set][i]);
        }
        mgpu_free(dp->loss_sum[i]);
        mgpu_free(dp->correct[i]);
        mgpu_free(dp->count[i]);
        for (int p = 0; p < dp->replicas[0]->nparams; p++) mgpu_free(dp->gather.staged[i][p]);
        free(dp->gather.staged[i]);
    }
    /* after the replicas, whose gradients were views into the buckets */
    for (int b = 0; b < dp->buckets.count; b++)
        for (int i = 0; i < dp->n; i++) {
            mgpu_free(dp->buckets.grads[b][i]);
            mgpu_free(dp->buckets.scratch[b][i]);
        }
    mgpu__zero_free(dp);
    free(dp->buckets.last_layer);
    free(dp->buckets.len);
    free(dp->buckets.grads);
    free(dp->buckets.scratch);
    mgpu_free(dp->gather.logits);
    mgpu_free(dp->gather.labels);
    mgpu_free(dp->gather.dlogits);
    mgpu_free(dp->gather.losses);
    mgpu_free(dp->gather.batch_loss);
    free(dp);
}
