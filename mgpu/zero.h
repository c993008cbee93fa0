/* mgpu/zero.h: ZeRO (chapter 5): the wrapper's members each keep the
   optimizer's state of a 1/w share of the parameters (stage 1), and the
   gradients of that share too (stage 2): a reduce-scatter instead of an
   allreduce, a step on the share, an all-gather of the new values. Stage
   3 keeps the share's values alone between steps, and gathers a unit's
   whole values around its layers' passes.
   defines: mgpu_data_parallel_zero */
/* ---- ZeRO (mgpu_data_parallel_zero) ----
   Bucket b of length L (a multiple of the W members) is cut in W equal
   chunks; member m owns chunk m: [m L/W, (m + 1) L/W). */
static int mgpu__dp_chunk(const mgpu_data_parallel *dp, int b) {
    return (int)(dp->buckets.len[b] / (size_t)mgpu__dp_members(dp));
}
/* Adds up [start, start + len) of bucket b's gradients over the devices,
   into dst (len floats), starting at device `first` and going round:
   ((g_first + g_first+1) + ...) + g_first-1. Without the reduction, device
   i's own values alone. */
static void mgpu__dp_sum_from(mgpu_data_parallel *dp, int b, int i, int first, size_t start, size_t len,
                              mgpu_tensor *dst) {
    for (int j = 0; j < dp->n; j++) {
        int from = dp->buckets.reduce ? (first + j) % dp->n : i;
        mgpu_tensor *part = mgpu_narrow(dp->buckets.grads[b][from], (int)start, (int)len);
        if (j == 0) {
            mgpu_copy(dst, part, 1);
        } else if (dp->buckets.reduce) {
            mgpu_tensor *here = mgpu_narrow(dp->buckets.scratch[b][i], 0, (int)len);
            mgpu_copy(here, part, 1);
            mgpu_add_(dst, here);
            mgpu_free(here);
        }
        mgpu_free(part);
    }
}
/* ZeRO-2: device i's chunk of bucket b's gradient, summed over the
   devices (the replicas' gradients of a loss already divided by the
   whole batch), or averaged over the ranks, into grad_chunk[b][i]; then
   the whole bucket is freed. Within one process each value is added up
   in the order DDP's ring adds it (mgpu__ring_run): the ring cuts the
   bucket's F values (unpadded) in n chunks, [F c/n, F (c+1)/n), and sums
   chunk c from device c round, so ZeRO's steps are DDP's bit for bit.
   Member i's chunk may straddle two of the ring's: each piece is summed
   in its own order (the padding past F is zeros, in any order). */
static void mgpu__dp_reduce_scatter(mgpu_data_parallel *dp, int b) {
    int chunk = mgpu__dp_chunk(dp, b);
    for (int i = 0; i < dp->n; i++)
        if (!dp->zero.grad_chunk[b][i]) {
            int scope = mgpu__memory_scope(MGPU_MEMORY_GRADIENTS);
            dp->zero.grad_chunk[b][i] = mgpu_empty(dp->devices[i], mgpu_shape1(chunk));
            mgpu__memory_scope((mgpu_memory_category)scope);
        }
    if (dp->dist.group && dp->buckets.reduce) {
        mgpu_group_reduce_scatter(dp->dist.group, dp->buckets.grads[b][0], dp->zero.grad_chunk[b][0], MGPU_MEAN);
        dp->algorithm = mgpu_group_path(dp->dist.group, dp->devices[0]);
    } else {
        size_t floats = mgpu__dp_bucket_floats(dp, b), n = (size_t)dp->n;
        for (int i = 0; i < dp->n; i++) {
            size_t start = (size_t)mgpu__dp_member(dp, i) * (size_t)chunk, end = start + (size_t)chunk;
            for (int c = 0; c <= dp->n; c++) {
                size_t lo = floats * (size_t)c / n, hi = floats * (size_t)(c + 1) / n; /* the ring's chunk c */
                if (c == dp->n) lo = floats, hi = end;                                 /* the padding */
                if (lo < start) lo = start;
                if (hi > end) hi = end;
                if (hi <= lo) continue;
                mgpu_tensor *dst = mgpu_narrow(dp->zero.grad_chunk[b][i], (int)(lo - start), (int)(hi - lo));
                mgpu__dp_sum_from(dp, b, i, c % dp->n, lo, hi - lo, dst);
                mgpu_free(dst);
            }
        }
        dp->algorithm = dp->buckets.reduce && dp->n > 1 ? "reduce-scatter" : "none";
    }
    mgpu__dp_grad_bucket_free(dp, b);
}

/* Member i's optimizer state (k 0: momentum or Adam's first moment, 1:
   Adam's second) for its chunk [start, start + chunk) of bucket b: zeros,
   or the chunk of the state the replica had before (a loaded
   checkpoint's, or steps taken before the wrapper). */
static mgpu_tensor *mgpu__dp_chunk_state_new(mgpu_data_parallel *dp, int i, int b, int k, int start, int chunk) {
    mgpu_net *r = dp->replicas[i];
    mgpu_tensor **full = k == 0 ? r->momentum : r->second_moment;
    int p0, p1, scope = mgpu__memory_scope(MGPU_MEMORY_OPTIMIZER);
    mgpu__dp_bucket_params(dp, b, &p0, &p1);
    mgpu_tensor *state = mgpu_zeros(dp->devices[i], mgpu_shape1(chunk));
    if (full[p0]) {
        mgpu_tensor *flat = mgpu_zeros(dp->devices[i], mgpu_shape1((int)dp->buckets.len[b]));
        int offset = 0;
        for (int p = p0; p < p1; p++) {
            mgpu_tensor *rows = mgpu_narrow(flat, offset, (int)full[p]->numel), *place = mgpu_view(rows, full[p]->shape);
            mgpu_copy(place, full[p], 0);
            offset += (int)full[p]->numel;
            mgpu_free(place);
            mgpu_free(rows);
        }
        mgpu_tensor *mine = mgpu_narrow(flat, start, chunk);
        mgpu_copy(state, mine, 0);
        mgpu_free(mine);
        mgpu_free(flat);
    }
    mgpu__memory_scope((mgpu_memory_category)scope);
    return state;
}

/* Every device's values of bucket b from its members' chunks: copies
   between the devices, or an all-gather over the ranks. */
static void mgpu__dp_gather_values(mgpu_data_parallel *dp, int b) {
    int chunk = mgpu__dp_chunk(dp, b);
    if (dp->dist.group) {
        int m = mgpu_group_rank(dp->dist.group);
        mgpu_tensor *mine = mgpu_narrow(dp->zero.values[b][0], m * chunk, chunk);
        mgpu_tensor *sent = mgpu_empty(dp->devices[0], mgpu_shape1(chunk)); /* (in and out may not overlap) */
        mgpu_copy(sent, mine, 0);
        mgpu_group_all_gather(dp->dist.group, sent, dp->zero.values[b][0]);
        mgpu_free(sent);
        mgpu_free(mine);
        return;
    }
    for (int j = 0; j < dp->n; j++)
        for (int i = 0; i < dp->n; i++) {
            if (i == j) continue;
            mgpu_tensor *to = mgpu_narrow(dp->zero.values[b][j], i * chunk, chunk);
            mgpu_tensor *from = mgpu_narrow(dp->zero.values[b][i], i * chunk, chunk);
            mgpu_copy(to, from, 1);
            mgpu_free(to);
            mgpu_free(from);
        }
}

/* ---- ZeRO-3: the values sharded too ----
   A bucket is the unit gathered (mgpu_data_parallel_configure's size
   chooses it). Before its first layer's forward pass, and before its last
   layer's backward pass, each device gathers the members' chunks into
   the bucket's whole values, which its parameters then view; after its
   last layer's forward pass and its first layer's backward pass the
   whole values are freed, and the parameters' views point at nothing
   (a use of one is an error line) until the next gather. The next unit's
   gather starts on the copy queue as soon as this unit's is waited for,
   so that it runs while this unit computes (prefetch): at most two units
   are whole at a time on a device. */
/* Starts gathering bucket b's values on device i, unless they are there
   or on their way, on the device's copy queue, after what its compute
   queue was given so far (whole's memory is free there): the members'
   chunks copied into a whole bucket, or an all-gather over the ranks. The
   compute queue waits for it where the unit runs (mgpu__zero3_gather). */
static void mgpu__zero3_gather_start(mgpu_data_parallel *dp, int b, int i) {
    if (dp->zero.values[b][i]) return;
    int chunk = mgpu__dp_chunk(dp, b), p0, p1;
    mgpu_device *dev = dp->devices[i];
    int scope = mgpu__memory_scope(MGPU_MEMORY_PARAMETERS);
    mgpu_tensor *whole = dp->zero.values[b][i] = mgpu_empty(dev, mgpu_shape1((int)dp->buckets.len[b]));
    mgpu__memory_scope((mgpu_memory_category)scope);
    mgpu__queue *q = &dev->queue[1];
    if (dp->dist.group) {
        /* (its chunk as the step left it: the collective waits for the
           compute queue) */
        mgpu__group_all_gather("ZeRO-3's gather", dp->dist.group, dp->zero.shard[b][0], whole, 0);
    } else {
        mgpu__queue_wait_queue(q, &dev->queue[0]);
        for (int j = 0; j < dp->n; j++) {
            mgpu_tensor *from = dp->zero.shard[b][j];
            /* the chunk as member j's last step wrote it (not all that its
               compute queue has been given since: the devices' passes run
               side by side), and this gather's event covers the other
               devices' gathers still reading it */
            if (dp->zero.stepped[j]) mgpu__event_wait_on(q, dp->zero.stepped[j]);
            if (from->last_read) mgpu__event_wait_on(q, from->last_read);
            mgpu__memcpy_args copy = {whole->data + (size_t)j * (size_t)chunk, from->data,
                                      (size_t)chunk * sizeof(float), dev->gpu, dp->devices[j]->gpu};
            mgpu__launch_on(q, "ZeRO-3 gather", mgpu__memcpy_cpu, MGPU__CUDA_FN(mgpu__memcpy_cuda), &copy,
                            sizeof copy);
        }
    }
    mgpu_event *done = dp->zero.gathering[b][i] = mgpu_event_new();
    mgpu__event_record_on(done, q);
    for (int j = 0; j < dp->n && !dp->dist.group; j++) mgpu__tensor_track(dp->zero.shard[b][j], done);
    mgpu__dp_bucket_params(dp, b, &p0, &p1);
    mgpu__views_into(whole, dp->replicas[i], p0, p1, 1, 0);
}
/* Bucket b's whole values on device i, for what its compute queue runs next. */
static void mgpu__zero3_gather(mgpu_data_parallel *dp, int b, int i) {
    mgpu__zero3_gather_start(dp, b, i);
    mgpu_event **done = &dp->zero.gathering[b][i];
    if (!*done) return;
    mgpu__event_wait_on(&dp->devices[i]->queue[0], *done);
    mgpu_event_free(*done);
    *done = NULL;
}
/* Frees bucket b's whole values on device i (and the weights' copies its
   convolutions keep, made from them); its member keeps its chunk. */
static void mgpu__zero3_release(mgpu_data_parallel *dp, int b, int i) {
    int first, last;
    mgpu__zero3_gather(dp, b, i); /* (a prefetch still writing it) */
    mgpu__dp_bucket_layers(dp, b, &first, &last);
    for (int l = first; l <= last; l++) mgpu__layer_free_weight_copies(dp->replicas[i]->layers[l]);
    mgpu_free(dp->zero.values[b][i]);
    dp->zero.values[b][i] = NULL;
}
/* Whether device i's backward pass holds a unit: the forward pass that
   runs then is a recomputed one (mgpu_net_recompute). */
static int mgpu__zero3_backward_under_way(const mgpu_data_parallel *dp, int i) {
    for (int b = 0; b < dp->buckets.count; b++)
        if (dp->zero.held[b][i]) return 1;
    return 0;
}
/* The replicas' layer hook (mgpu_net_set_layer_hook): the gathers and frees
   above around each unit's passes. A unit the backward pass holds stays
   whole through the recomputed forward passes of its layers; an earlier
   unit that such a pass runs is gathered again, and freed after its
   layers. A recomputed pass prefetches nothing: the unit after its
   last is the one held, or one whose backward pass is done (a gather of
   that one would stay, and hold old values after the step). */
static void mgpu__zero3_layer_hook(void *ctx, mgpu_net *net, int layer, int when) {
    mgpu_data_parallel *dp = (mgpu_data_parallel *)ctx;
    int b = dp->zero.unit_of_layer[layer], i = 0, first, last;
    if (b < 0) return;
    while (dp->replicas[i] != net) i++;
    mgpu__dp_bucket_layers(dp, b, &first, &last);
    if (when == MGPU_BEFORE_FORWARD) { /* the forward pass goes to bucket b - 1 next */
        mgpu__zero3_gather(dp, b, i);
        if (layer == first && b > 0 && !mgpu__zero3_backward_under_way(dp, i)) mgpu__zero3_gather_start(dp, b - 1, i);
    } else if (when == MGPU_AFTER_FORWARD) {
        if (layer == last && !dp->zero.held[b][i]) mgpu__zero3_release(dp, b, i);
    } else if (when == MGPU_BEFORE_BACKWARD) { /* the backward pass goes to bucket b + 1 next */
        mgpu__zero3_gather(dp, b, i);
        dp->zero.held[b][i] = 1;
        if (layer == last && b + 1 < dp->buckets.count) mgpu__zero3_gather_start(dp, b + 1, i);
    } else if (layer == first) {
        dp->zero.held[b][i] = 0;
        mgpu__zero3_release(dp, b, i);
    }
}
/* Bucket b was just made, its whole values gathered from the replica's:
   member i keeps its chunk of them, the whole goes, and the replica's
   layers get the hook. */
static void mgpu__zero3_shard_bucket(mgpu_data_parallel *dp, int b) {
    int chunk = mgpu__dp_chunk(dp, b), first, last;
    mgpu__dp_bucket_layers(dp, b, &first, &last);
    for (int l = first; l <= last; l++) dp->zero.unit_of_layer[l] = b;
    for (int i = 0; i < dp->n; i++) {
        int scope = mgpu__memory_scope(MGPU_MEMORY_PARAMETERS);
        dp->zero.shard[b][i] = mgpu_empty(dp->devices[i], mgpu_shape1(chunk));
        mgpu__memory_scope((mgpu_memory_category)scope);
        mgpu_tensor *mine = mgpu_narrow(dp->zero.values[b][i], mgpu__dp_member(dp, i) * chunk, chunk);
        mgpu_copy(dp->zero.shard[b][i], mine, 0);
        mgpu_free(mine);
        /* the other devices' gathers read the chunk after its copy (on
           the copy queue, which the compute queue waits for), as after a
           step */
        if (!dp->zero.stepped[i]) dp->zero.stepped[i] = mgpu_event_new();
        mgpu__event_record_on(dp->zero.stepped[i], &dp->devices[i]->queue[0]);
        mgpu__zero3_release(dp, b, i);
        mgpu_net *r = dp->replicas[i];
        MGPU_REQUIRE(!r->layer_hook || r->layer_hook_owner, "ZeRO-3 (mgpu_data_parallel_zero(dp, 3)) gathers the "
                     "parameters with a layer hook, and the network has one of yours (mgpu_net_set_layer_hook): "
                     "remove it first");
        r->layer_hook = mgpu__zero3_layer_hook;
        r->layer_hook_ctx = dp;
        r->layer_hook_owner = "a ZeRO-3 wrapper (mgpu_data_parallel_zero(dp, 3))";
    }
}
/* The replicas' check (mgpu_data_parallel_check_replicas). Under stage 3
   the members hold different chunks between steps: nothing there to
   compare. Each device gathers every unit instead, and its whole values
   must be device 0's, bit for bit: a gather that puts a chunk in the
   wrong place, or an old one, shows. */
static void mgpu__zero_check_replicas(mgpu_data_parallel *dp) {
    int gathers = dp->check_replicas && dp->zero.stage == 3;
    for (int b = 0; b < dp->buckets.count && gathers; b++)
        for (int i = 0; i < dp->n; i++) mgpu__zero3_gather(dp, b, i);
    mgpu__dp_check_replicas(dp);
    for (int b = 0; b < dp->buckets.count && gathers; b++)
        for (int i = 0; i < dp->n; i++) mgpu__zero3_release(dp, b, i);
}

/* The ZeRO step: each member updates its chunk of every bucket with its
   own part of the optimizer's state, then (stages 1 and 2) the chunks are
   gathered into every device's values; stage 3 gathers them where the
   next forward pass needs them. */
static void mgpu__dp_zero_step(mgpu_data_parallel *dp, float lr, float momentum, float weight_decay) {
    for (int i = 0; i < dp->n; i++) {
        mgpu_net *r = dp->replicas[i];
        int m = mgpu__dp_member(dp, i);
        MGPU_REQUIRE(!r->adam || momentum == 0.0f, "%s: momentum %g, but Adam keeps moments of its own: give 0",
                     r->decoupled ? "AdamW" : "Adam", (double)momentum);
        for (int b = 0; b < dp->buckets.count; b++) {
            int chunk = mgpu__dp_chunk(dp, b);
            mgpu_tensor *value = dp->zero.stage == 3 ? dp->zero.shard[b][i]
                                                     : mgpu_narrow(dp->zero.values[b][i], m * chunk, chunk);
            mgpu_tensor *grad = dp->zero.stage >= 2 ? dp->zero.grad_chunk[b][i]
                                                    : mgpu_narrow(dp->buckets.grads[b][i], m * chunk, chunk);
            mgpu_tensor **state = dp->zero.state[b][i];
            for (int k = 0; k < (r->adam ? 2 : momentum != 0.0f); k++)
                if (!state[k]) state[k] = mgpu__dp_chunk_state_new(dp, i, b, k, m * chunk, chunk);
            if (r->adam)
                mgpu__adam_tensors(r, &value, (const mgpu_tensor *const *)&grad, &state[0], &state[1], 1, lr,
                                   weight_decay);
            else
                mgpu__sgd_tensors("mgpu_data_parallel_step", &value, (const mgpu_tensor *const *)&grad,
                                  momentum != 0.0f ? &state[0] : NULL, 1, lr, momentum, weight_decay, r->steps == 0);
            if (dp->zero.stage < 3) mgpu_free(value);
            if (dp->zero.stage < 2) mgpu_free(grad);
        }
        mgpu__net_keep_momentum(r, 0); /* (the chunks hold the state now) */
        r->steps++;
        r->changes++;
        if (dp->zero.stage < 3) continue;
        if (!dp->zero.stepped[i]) dp->zero.stepped[i] = mgpu_event_new();
        mgpu__event_record_on(dp->zero.stepped[i], &dp->devices[i]->queue[0]);
    }
    for (int b = 0; b < dp->buckets.count && dp->zero.stage < 3; b++) mgpu__dp_gather_values(dp, b);
}

/* At the wrapper's end: replica 0 gets its whole optimizer state back
   from the members' chunks, so that it trains on as it would have. */
static void mgpu__dp_zero_unshard_state(mgpu_data_parallel *dp) {
    mgpu_net *net = dp->replicas[0];
    if (!dp->zero.stage || dp->buckets.count == 0) return;
    int kinds = dp->zero.state[0][0][1] ? 2 : dp->zero.state[0][0][0] ? 1 : 0;
    if (kinds == 0) return;
    mgpu__net_keep_momentum(net, 1);
    for (int k = 0; k < kinds; k++)
        for (int b = 0; b < dp->buckets.count; b++) {
            int chunk = mgpu__dp_chunk(dp, b), p0, p1;
            mgpu_tensor *flat = mgpu_empty(dp->devices[0], mgpu_shape1((int)dp->buckets.len[b]));
            if (dp->dist.group) {
                mgpu_group_all_gather(dp->dist.group, dp->zero.state[b][0][k], flat);
            } else {
                for (int i = 0; i < dp->n; i++) {
                    mgpu_tensor *place = mgpu_narrow(flat, i * chunk, chunk);
                    mgpu_copy(place, dp->zero.state[b][i][k], 0);
                    mgpu_free(place);
                }
            }
            mgpu__dp_bucket_params(dp, b, &p0, &p1);
            int offset = 0;
            for (int p = p0; p < p1; p++) {
                mgpu_tensor *full = k == 0 ? net->momentum[p] : net->second_moment[p];
                mgpu_tensor *rows = mgpu_narrow(flat, offset, (int)full->numel), *from = mgpu_view(rows, full->shape);
                mgpu_copy(full, from, 0);
                offset += (int)full->numel;
                mgpu_free(from);
                mgpu_free(rows);
            }
            mgpu_free(flat);
        }
}

/* ---- where ZeRO joins the wrapper's buckets and its step ---- */
/* Room for ZeRO's share of each bucket (a place a layer, as the buckets). */
static void mgpu__zero_make_room(mgpu_data_parallel *dp, int nlayers) {
    dp->zero.values = (mgpu_tensor *(*)[MGPU_MAX_DEVICES])mgpu__xcalloc((size_t)nlayers, sizeof *dp->zero.values);
    dp->zero.grad_chunk = (mgpu_tensor *(*)[MGPU_MAX_DEVICES])mgpu__xcalloc((size_t)nlayers, sizeof *dp->zero.grad_chunk);
    dp->zero.state = (mgpu_tensor *(*)[MGPU_MAX_DEVICES][2])mgpu__xcalloc((size_t)nlayers, sizeof *dp->zero.state);
    dp->zero.shard = (mgpu_tensor *(*)[MGPU_MAX_DEVICES])mgpu__xcalloc((size_t)nlayers, sizeof *dp->zero.shard);
    dp->zero.gathering = (mgpu_event *(*)[MGPU_MAX_DEVICES])mgpu__xcalloc((size_t)nlayers, sizeof *dp->zero.gathering);
    dp->zero.held = (unsigned char (*)[MGPU_MAX_DEVICES])mgpu__xcalloc((size_t)nlayers, sizeof *dp->zero.held);
    dp->zero.unit_of_layer = (int *)mgpu__xmalloc((size_t)nlayers * sizeof(int));
    for (int l = 0; l < nlayers; l++) dp->zero.unit_of_layer[l] = -1;
}
/* A bucket of `floats` gradients: under ZeRO padded with zeros, which
   stay 0, to equal chunks for the members. */
static size_t mgpu__zero_bucket_len(const mgpu_data_parallel *dp, size_t floats) {
    size_t members = (size_t)mgpu__dp_members(dp);
    return dp->zero.stage ? (floats + members - 1) / members * members : floats;
}
/* Bucket b was just made: under ZeRO the parameters' values become views
   into a flat bucket too (each member steps its chunk of it), under
   stages 2 and 3 the gradients exist only while the backward pass fills
   them, and under stage 3 the whole values only around the unit's passes. */
static void mgpu__zero_bucket_made(mgpu_data_parallel *dp, int b) {
    if (!dp->zero.stage) return;
    int p0, p1;
    mgpu__dp_bucket_params(dp, b, &p0, &p1);
    for (int i = 0; i < dp->n; i++) {
        int scope = mgpu__memory_scope(MGPU_MEMORY_PARAMETERS);
        dp->zero.values[b][i] = mgpu_zeros(dp->devices[i], mgpu_shape1((int)dp->buckets.len[b]));
        mgpu__memory_scope((mgpu_memory_category)scope);
        mgpu__views_into(dp->zero.values[b][i], dp->replicas[i], p0, p1, 1, 1);
    }
    if (dp->zero.stage >= 2) mgpu__dp_grad_bucket_free(dp, b);
    if (dp->zero.stage == 3) mgpu__zero3_shard_bucket(dp, b);
}
/* Whether the whole gradients live between passes (stages 0 and 1). */
static int mgpu__zero_keeps_grads(const mgpu_data_parallel *dp) { return dp->zero.stage < 2; }
/* Before the backward pass reaches bucket b's layers: stages 2 and 3
   make its gradients, zeros. */
static void mgpu__zero_before_bucket(mgpu_data_parallel *dp, int b) {
    if (dp->zero.stage >= 2 && !dp->buckets.grads[b][0]) mgpu__dp_grad_bucket_make(dp, b);
}
/* Bucket b is complete: stages 2 and 3 reduce-scatter it to its owners
   and free it. 1 if ZeRO reduced it, 0 if the wrapper's reduction is to. */
static int mgpu__zero_reduce_bucket(mgpu_data_parallel *dp, int b) {
    if (dp->zero.stage < 2) return 0;
    mgpu__dp_reduce_scatter(dp, b);
    return 1;
}
/* The optimizer's step on the members' chunks, where ZeRO shares them
   out (and the wrapper reduces: one member alone steps its whole copy):
   1 if it took the step, 0 if each replica is to take its own. */
static int mgpu__zero_step(mgpu_data_parallel *dp, int reduces, float lr, float momentum, float weight_decay) {
    if (!dp->zero.stage || !reduces) return 0;
    mgpu__dp_zero_step(dp, lr, momentum, weight_decay);
    return 1;
}
/* At the wrapper's end: the module's values get their own memory again
   (they were views into ZeRO's buckets; under stage 3 gathered first),
   and the replicas lose stage 3's hook. */
static void mgpu__zero_unshare_values(mgpu_data_parallel *dp) {
    if (!dp->zero.stage || !dp->buckets.count) return;
    for (int b = 0; b < dp->buckets.count && dp->zero.stage == 3; b++) mgpu__zero3_gather(dp, b, 0);
    mgpu__own_memory(dp->replicas[0], 1);
    for (int i = 0; i < dp->n; i++) {
        dp->replicas[i]->layer_hook = NULL;
        dp->replicas[i]->layer_hook_owner = NULL;
    }
}
/* ZeRO's shares of every bucket, once the replicas no longer view them. */
static void mgpu__zero_free(mgpu_data_parallel *dp) {
    for (int b = 0; b < dp->buckets.count; b++)
        for (int i = 0; i < dp->n; i++) {
            mgpu_free(dp->zero.values[b][i]);
            mgpu_free(dp->zero.grad_chunk[b][i]);
            mgpu_free(dp->zero.state[b][i][0]);
            mgpu_free(dp->zero.state[b][i][1]);
            mgpu_free(dp->zero.shard[b][i]);
            mgpu_event_free(dp->zero.gathering[b][i]);
        }
    for (int i = 0; i < dp->n; i++) mgpu_event_free(dp->zero.stepped[i]);
    free(dp->zero.values);
    free(dp->zero.grad_chunk);
    free(dp->zero.state);
    free(dp->zero.shard);
    free(dp->zero.gathering);
    free(dp->zero.held);
    free(dp->zero.unit_of_layer);
}

MGPU_DEF void mgpu_data_parallel_zero(mgpu_data_parallel *dp, int stage) {
    const char *op = "mgpu_data_parallel_zero";
    MGPU_REQUIRE(stage >= 0 && stage <= 3, "%s: stage %d does not exist: 0 (none), 1 (the optimizer's state "
                 "sharded), 2 (the gradients too) or 3 (the parameters too)", op, stage);
    MGPU_REQUIRE(dp->steps == 0 && dp->buckets.count == 0, "%s: call it before the wrapper's first step", op);
    MGPU_REQUIRE(dp->mode == MGPU_DP_ALLREDUCE, "%s: the wrapper gathers on device 0 (MGPU_DP_GATHER); ZeRO "
                 "needs MGPU_DP_ALLREDUCE", op);
    MGPU_REQUIRE(!dp->dist.group || dp->n == 1, "%s: a distributed wrapper of %d devices a process; ZeRO needs one", op,
                 dp->n);
    MGPU_REQUIRE(stage < 2 || !dp->buckets.yours, "%s: stage %d reduce-scatters the gradients, so it cannot take "
                 "your allreduce (%s)", op, stage, dp->buckets.yours_name);
    MGPU_REQUIRE(stage < 3 || !dp->replicas[0]->layer_hook, "%s: stage 3 gathers the parameters with a layer hook, "
                 "and the network has one of yours (mgpu_net_set_layer_hook): remove it first", op);
    dp->zero.stage = stage;
    for (int i = 0; i < dp->n; i++) dp->replicas[i]->sharded = stage > 0 && mgpu__dp_members(dp) > 1;
}
