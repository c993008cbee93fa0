/* mgpu/zero.h: ZeRO (chapter 5): the wrapper's members each keep the
   optimizer's state of a 1/w share of the parameters (stage 1), and the
   gradients of that share too (stage 2): a reduce-scatter instead of an
   allreduce, a step on the share, an all-gather of the new values.
   defines: mgpu_data_parallel_zero */
/* ---- ZeRO (mgpu_data_parallel_zero) ----
   Bucket b of length L (a multiple of the W members) is cut in W equal
   chunks; member m owns chunk m: [m L/W, (m + 1) L/W). */
static int mgpu__dp_chunk(const mgpu_data_parallel *dp, int b) {
    return (int)(dp->bucket_len[b] / (size_t)mgpu__dp_members(dp));
}
/* ZeRO-2: device i's chunk of bucket b's gradient, summed over the
   devices in their order (the replicas' gradients of a loss already
   divided by the whole batch), or averaged over the ranks, into
   grad_chunk[b][i]; then the whole bucket is freed. */
static void mgpu__dp_reduce_scatter(mgpu_data_parallel *dp, int b) {
    int chunk = mgpu__dp_chunk(dp, b);
    for (int i = 0; i < dp->n; i++)
        if (!dp->grad_chunk[b][i]) {
            int scope = mgpu__memory_scope(MGPU_MEMORY_GRADIENTS);
            dp->grad_chunk[b][i] = mgpu_empty(dp->devices[i], mgpu_shape1(chunk));
            mgpu__memory_scope((mgpu_memory_category)scope);
        }
    if (dp->group && dp->reduce) {
        mgpu_group_reduce_scatter(dp->group, dp->bucket[b][0], dp->grad_chunk[b][0], MGPU_MEAN);
        dp->algorithm = mgpu_group_path(dp->group, dp->devices[0]);
    } else {
        for (int i = 0; i < dp->n; i++) {
            int m = mgpu__dp_member(dp, i);
            for (int j = 0; j < dp->n; j++) {
                int from = dp->reduce ? j : i; /* (without the reduction: its own chunk alone) */
                mgpu_tensor *part = mgpu_narrow(dp->bucket[b][from], m * chunk, chunk);
                if (j == 0) {
                    mgpu_copy(dp->grad_chunk[b][i], part, 1);
                } else if (dp->reduce) {
                    mgpu_tensor *here = mgpu_narrow(dp->scratch[b][i], 0, chunk);
                    mgpu_copy(here, part, 1);
                    mgpu_add_(dp->grad_chunk[b][i], here);
                    mgpu_free(here);
                }
                mgpu_free(part);
            }
        }
        dp->algorithm = dp->reduce && dp->n > 1 ? "reduce-scatter" : "none";
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
        mgpu_tensor *flat = mgpu_zeros(dp->devices[i], mgpu_shape1((int)dp->bucket_len[b]));
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
    if (dp->group) {
        int m = mgpu_group_rank(dp->group);
        mgpu_tensor *mine = mgpu_narrow(dp->value_bucket[b][0], m * chunk, chunk);
        mgpu_tensor *sent = mgpu_empty(dp->devices[0], mgpu_shape1(chunk)); /* (in and out may not overlap) */
        mgpu_copy(sent, mine, 0);
        mgpu_group_all_gather(dp->group, sent, dp->value_bucket[b][0]);
        mgpu_free(sent);
        mgpu_free(mine);
        return;
    }
    for (int j = 0; j < dp->n; j++)
        for (int i = 0; i < dp->n; i++) {
            if (i == j) continue;
            mgpu_tensor *to = mgpu_narrow(dp->value_bucket[b][j], i * chunk, chunk);
            mgpu_tensor *from = mgpu_narrow(dp->value_bucket[b][i], i * chunk, chunk);
            mgpu_copy(to, from, 1);
            mgpu_free(to);
            mgpu_free(from);
        }
}

/* The ZeRO step: each member updates its chunk of every bucket with its
   own part of the optimizer's state, then the chunks are gathered into
   every device's values. */
static void mgpu__dp_zero_step(mgpu_data_parallel *dp, float lr, float momentum, float weight_decay) {
    for (int i = 0; i < dp->n; i++) {
        mgpu_net *r = dp->replicas[i];
        int m = mgpu__dp_member(dp, i);
        MGPU_REQUIRE(!r->adam || momentum == 0.0f, "%s: momentum %g, but Adam keeps moments of its own: give 0",
                     r->decoupled ? "AdamW" : "Adam", (double)momentum);
        for (int b = 0; b < dp->nbuckets; b++) {
            int chunk = mgpu__dp_chunk(dp, b);
            mgpu_tensor *value = mgpu_narrow(dp->value_bucket[b][i], m * chunk, chunk);
            mgpu_tensor *grad = dp->zero == 2 ? dp->grad_chunk[b][i] : mgpu_narrow(dp->bucket[b][i], m * chunk, chunk);
            mgpu_tensor **state = dp->chunk_state[b][i];
            for (int k = 0; k < (r->adam ? 2 : momentum != 0.0f); k++)
                if (!state[k]) state[k] = mgpu__dp_chunk_state_new(dp, i, b, k, m * chunk, chunk);
            if (r->adam)
                mgpu__adam_tensors(r, &value, (const mgpu_tensor *const *)&grad, &state[0], &state[1], 1, lr,
                                   weight_decay);
            else
                mgpu__sgd_tensors("mgpu_data_parallel_step", &value, (const mgpu_tensor *const *)&grad,
                                  momentum != 0.0f ? &state[0] : NULL, 1, lr, momentum, weight_decay, r->steps == 0);
            mgpu_free(value);
            if (dp->zero != 2) mgpu_free(grad);
        }
        mgpu__net_keep_momentum(r, 0); /* (the chunks hold the state now) */
        r->steps++;
        r->changes++;
    }
    for (int b = 0; b < dp->nbuckets; b++) mgpu__dp_gather_values(dp, b);
}

/* At the wrapper's end: replica 0 gets its whole optimizer state back
   from the members' chunks, so that it trains on as it would have. */
static void mgpu__dp_zero_unshard_state(mgpu_data_parallel *dp) {
    mgpu_net *net = dp->replicas[0];
    if (!dp->zero || dp->nbuckets == 0) return;
    int kinds = dp->chunk_state[0][0][1] ? 2 : dp->chunk_state[0][0][0] ? 1 : 0;
    if (kinds == 0) return;
    mgpu__net_keep_momentum(net, 1);
    for (int k = 0; k < kinds; k++)
        for (int b = 0; b < dp->nbuckets; b++) {
            int chunk = mgpu__dp_chunk(dp, b), p0, p1;
            mgpu_tensor *flat = mgpu_empty(dp->devices[0], mgpu_shape1((int)dp->bucket_len[b]));
            if (dp->group) {
                mgpu_group_all_gather(dp->group, dp->chunk_state[b][0][k], flat);
            } else {
                for (int i = 0; i < dp->n; i++) {
                    mgpu_tensor *place = mgpu_narrow(flat, i * chunk, chunk);
                    mgpu_copy(place, dp->chunk_state[b][i][k], 0);
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

MGPU_DEF void mgpu_data_parallel_zero(mgpu_data_parallel *dp, int stage) {
    const char *op = "mgpu_data_parallel_zero";
    MGPU_REQUIRE(stage >= 0 && stage <= 2, "%s: stage %d does not exist here: 0 (none), 1 (the optimizer's state "
                 "sharded) or 2 (the gradients too); stage 3, the parameters too, is not built", op, stage);
    MGPU_REQUIRE(dp->steps == 0 && dp->nbuckets == 0, "%s: call it before the wrapper's first step", op);
    MGPU_REQUIRE(dp->mode == MGPU_DP_ALLREDUCE, "%s: the wrapper gathers on device 0 (MGPU_DP_GATHER); ZeRO "
                 "needs MGPU_DP_ALLREDUCE", op);
    MGPU_REQUIRE(!dp->group || dp->n == 1, "%s: a distributed wrapper of %d devices a process; ZeRO needs one", op,
                 dp->n);
    MGPU_REQUIRE(stage < 2 || !dp->yours, "%s: stage 2 reduce-scatters the gradients, so it cannot take your "
                 "allreduce (%s)", op, dp->yours_name);
    dp->zero = stage;
    for (int i = 0; i < dp->n; i++) dp->replicas[i]->sharded = stage > 0 && mgpu__dp_members(dp) > 1;
}
