/* mgpu/data_parallel.h: the data-parallel wrapper (chapter 3's
   DataParallel, chapter 4's DistributedDataParallel): replicas of a
   network on each device, its gradients in buckets reduced while the
   backward pass goes on, over devices or over a process group. Here:
   making the wrapper, one bucket's memory (its flat gradient, which each
   replica's gradients become views of) and its reduction. Grouping the
   parameters into buckets (at the first step, sized for ZeRO, so after
   mgpu/zero.h) and the step itself are in mgpu/data_parallel_step.h.
   defines: mgpu_data_parallel_new, mgpu_data_parallel_configure,
   mgpu_data_parallel_use_allreduce, mgpu_data_parallel_check_replicas,
   mgpu_data_parallel_module, mgpu_data_parallel_replica,
   mgpu_data_parallel_algorithm, mgpu_distributed_data_parallel_new,
   mgpu_distributed_data_parallel_new_devices, mgpu_dist_evaluate_accuracy */
/* The wrapper's state: what every mode needs, then one group of fields
   for each way it works (the gather mode's, the buckets of the allreduce
   mode, a distributed wrapper's group, ZeRO's shares). */
struct mgpu_data_parallel {
    int n;
    mgpu_dp_mode mode;
    const char *algorithm;
    mgpu_device *devices[MGPU_MAX_DEVICES];
    mgpu_net *replicas[MGPU_MAX_DEVICES];   /* replicas[0] is the caller's net */
    unsigned module_changes;                 /* replicas[0]->changes when the others last copied it */
    /* the step's shards of the batch: one of two sets of buffers, used in
       turn, each with the event that ends the last step that used it on
       each device (mgpu__dp_scatter) */
    mgpu_tensor *x_shards[MGPU_MAX_DEVICES], *y_shards[MGPU_MAX_DEVICES];
    mgpu_tensor *x_set[2][MGPU_MAX_DEVICES], *y_set[2][MGPU_MAX_DEVICES];
    mgpu_event *set_free[2][MGPU_MAX_DEVICES];
    int set;
    int used;   /* the devices that got rows this step: all but for a short batch */
    mgpu_tensor *loss_sum[MGPU_MAX_DEVICES], *correct[MGPU_MAX_DEVICES], *count[MGPU_MAX_DEVICES];
    int check_replicas; /* compare the replicas after each step (mgpu_data_parallel_check_replicas) */
    long steps;
    int accumulated_rows; /* rows whose gradients mgpu_data_parallel_accumulate added since the last step */
    /* MGPU_DP_GATHER, on device 0: the whole batch's logits, labels and
       logit gradients, and a staging copy of each other replica's gradients */
    struct {
        mgpu_tensor *logits, *labels, *dlogits, *losses, *batch_loss;
        mgpu_tensor **staged[MGPU_MAX_DEVICES]; /* [device][parameter] */
    } gather;
    /* MGPU_DP_ALLREDUCE: the gradients in buckets, each one flat tensor
       per device that the parameters' gradients are views into */
    struct {
        size_t bytes;       /* about this many a bucket (mgpu_data_parallel_configure) */
        int overlap, reduce;
        mgpu_allreduce_fn yours; /* a reduction of the caller's, or NULL */
        const char *yours_name;
        int count;          /* at most one a layer: the arrays have a place for each */
        int *last_layer;    /* the bucket is complete once backward reaches it */
        size_t *len;        /* its floats (under ZeRO, padded to a multiple of the members) */
        mgpu_tensor *(*grads)[MGPU_MAX_DEVICES];   /* [bucket][device] */
        mgpu_tensor *(*scratch)[MGPU_MAX_DEVICES];
    } buckets;
    /* a distributed wrapper (mgpu_distributed_data_parallel_new): one
       replica a process, its buckets averaged over the group's ranks */
    struct {
        struct mgpu_group *group;
        char path[48]; /* "ring, then mpi": several devices a process */
    } dist;
    /* ZeRO (mgpu_data_parallel_zero): the stage; the parameters' values as
       flat buckets too (the values views into them; under stage 3 only
       while the bucket, a unit, is gathered); member i's chunk of each
       bucket's gradient (stages 2 and 3) and its optimizer state for that
       chunk (SGD's momentum, or Adam's two moments) */
    struct {
        int stage;
        mgpu_tensor *(*values)[MGPU_MAX_DEVICES];
        mgpu_tensor *(*grad_chunk)[MGPU_MAX_DEVICES];
        mgpu_tensor *(*state)[MGPU_MAX_DEVICES][2];
        /* stage 3: member i's chunk of each bucket's values, all it keeps
           between steps; the gather into values[b][i] that is under way
           (its copies' event, which the compute queue waits for before
           the unit runs); whether the backward pass holds the unit (a
           recomputed forward pass must not free it); each layer's bucket
           (-1: a layer without parameters outside every bucket); and
           member i's chunks as its last step left them (an event its
           compute queue recorded after the step: what a gather of them
           waits for) */
        mgpu_tensor *(*shard)[MGPU_MAX_DEVICES];
        mgpu_event *stepped[MGPU_MAX_DEVICES];
        mgpu_event *(*gathering)[MGPU_MAX_DEVICES];
        unsigned char (*held)[MGPU_MAX_DEVICES];
        int *unit_of_layer;
    } zero;
};

MGPU_DEF mgpu_data_parallel *mgpu_data_parallel_new(mgpu_net *net, mgpu_device *const *devices,
                                                    int n, mgpu_dp_mode mode) {
    MGPU_REQUIRE(n >= 1 && n <= MGPU_MAX_DEVICES, "mgpu_data_parallel_new: %d devices", n);
    MGPU_REQUIRE(net->device == devices[0],
                 "mgpu_data_parallel_new: the network is on %s, it must be on devices[0] (%s)",
                 net->device->name, devices[0]->name);
    MGPU_REQUIRE(!net->wrapped, "mgpu_data_parallel_new: another wrapper holds this network already");
    MGPU_REQUIRE(n == 1 || !mgpu__net_synced(net),
                 "mgpu_data_parallel_new: the network's batch norms are synchronised over a group "
                 "(mgpu_net_sync_batchnorm): that needs one device a process, not %d", n);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < i; j++)
            MGPU_REQUIRE(devices[i] != devices[j], "mgpu_data_parallel_new: %s is devices[%d] and devices[%d]; "
                         "give each replica its own device (mgpu_devices makes virtual ones)",
                         devices[i]->name, j, i);
    mgpu_data_parallel *dp = (mgpu_data_parallel *)mgpu__xcalloc(1, sizeof *dp);
    dp->n = n;
    dp->mode = mode;
    for (int i = 0; i < n; i++) {
        dp->devices[i] = devices[i];
        /* Replicas start as exact copies: one broadcast from device 0. */
        dp->replicas[i] = i == 0 ? net : mgpu_net_replicate(net, devices[i]);
        dp->replicas[i]->wrapped = 1;
        dp->loss_sum[i] = mgpu_zeros(devices[i], mgpu_shape1(1));
        dp->correct[i] = mgpu_zeros(devices[i], mgpu_shape1(1));
        dp->count[i] = mgpu_zeros(devices[i], mgpu_shape1(1));
        dp->gather.staged[i] = (mgpu_tensor **)mgpu__xcalloc((size_t)net->nparams + 1, sizeof *dp->gather.staged[i]);
    }
    /* the optimizer's state too (a loaded checkpoint's, or steps taken before) */
    for (int i = 1; i < n; i++) mgpu__net_copy_sgd_state(dp->replicas[i], net);
    dp->module_changes = net->changes;
    dp->algorithm = n == 1 ? "none" : mode == MGPU_DP_GATHER ? "gather" : NULL;
    dp->buckets.bytes = 25u << 20;
    dp->buckets.overlap = 1;
    dp->buckets.reduce = 1;
    dp->check_replicas = mgpu__check_replicas_setting();
    return dp;
}

MGPU_DEF void mgpu_data_parallel_check_replicas(mgpu_data_parallel *dp, int on) {
    MGPU_REQUIRE(on == 0 || on == 1, "mgpu_data_parallel_check_replicas: %d; want 1 (on) or 0 (off)", on);
    dp->check_replicas = on;
}

/* A tensor's values, hashed on the host (the replicas' check). */
static uint64_t mgpu__values_checksum(const mgpu_tensor *t) {
    float *values = (float *)mgpu__xmalloc(t->numel * sizeof(float));
    mgpu_to_host(t, values);
    uint64_t h = mgpu__fnv1a(MGPU__FNV_OFFSET, values, t->numel * sizeof(float));
    free(values);
    return h;
}
/* In MGPU_DP_ALLREDUCE mode, after a step: every replica's parameters
   must be device 0's, bit for bit (each took the same update from the
   same reduced gradients). The first that differs stops the program.
   (In MGPU_DP_GATHER mode the replicas are copies of device 0's at each
   step's start: nothing to drift.) */
static void mgpu__dp_check_replicas(mgpu_data_parallel *dp) {
    if (!dp->check_replicas || dp->mode != MGPU_DP_ALLREDUCE) return;
    const mgpu_net *module = dp->replicas[0];
    for (int p = 0; p < module->nparams; p++) {
        uint64_t want = mgpu__values_checksum(module->params[p]->value);
        for (int i = 1; i < dp->n; i++) {
            if (mgpu__values_checksum(dp->replicas[i]->params[p]->value) == want) continue;
            char sh[64];
            mgpu_fatal("mgpu_data_parallel_step: after step %ld the replicas differ: parameter %d (of layer %s, "
                       "shape %s) on %s is not the same as on %s; %s (MGPU_CHECK_REPLICAS)", dp->steps, p,
                       mgpu__param_layer(module, p)->name, mgpu_shape_str(module->params[p]->value->shape, sh, sizeof sh),
                       dp->devices[i]->name, dp->devices[0]->name,
                       dp->zero.stage == 3 ? "are ZeRO-3's gathers of the members' chunks right?"
                       : dp->buckets.reduce ? "is the gradients' allreduce right?"
                                  : "the reduction is off (mgpu_data_parallel_configure), so they drift apart");
        }
    }
}

MGPU_DEF void mgpu_data_parallel_configure(mgpu_data_parallel *dp, size_t bucket_bytes,
                                           int overlap, int reduce) {
    MGPU_REQUIRE(dp->buckets.count == 0,
                 "mgpu_data_parallel_configure: call it before the first step");
    dp->buckets.bytes = bucket_bytes;
    dp->buckets.overlap = overlap;
    dp->buckets.reduce = reduce;
}

MGPU_DEF void mgpu_data_parallel_use_allreduce(mgpu_data_parallel *dp, mgpu_allreduce_fn fn,
                                               const char *name) {
    MGPU_REQUIRE(dp->mode == MGPU_DP_ALLREDUCE,
                 "mgpu_data_parallel_use_allreduce: the wrapper gathers on device 0 (MGPU_DP_GATHER); "
                 "a reduction of yours needs MGPU_DP_ALLREDUCE");
    MGPU_REQUIRE(dp->buckets.count == 0, "mgpu_data_parallel_use_allreduce: call it before the first step");
    MGPU_REQUIRE(!dp->dist.group, "mgpu_data_parallel_use_allreduce: a distributed wrapper reduces over its group");
    MGPU_REQUIRE(dp->zero.stage < 2, "mgpu_data_parallel_use_allreduce: ZeRO stage %d reduce-scatters the gradients, "
                 "so it cannot take your allreduce", dp->zero.stage);
    MGPU_REQUIRE(fn && name, "mgpu_data_parallel_use_allreduce: give the function and its name");
    dp->buckets.yours = fn;
    dp->buckets.yours_name = name;
}

/* Does the wrapper reduce gradients: over several devices, or processes? */
static int mgpu__dp_reduces(const mgpu_data_parallel *dp) {
    return dp->n > 1 || (dp->dist.group && mgpu_group_size(dp->dist.group) > 1);
}
/* Bucket b of a distributed wrapper: summed over this process's devices
   (chapter 3's ring, or NCCL), averaged over the ranks from devices[0]
   (whose communication queue runs the group's allreduce after its part
   of the ring), then copied to the other devices, each on its own
   communication queue once devices[0]'s is done. devices[0]'s queue then
   waits for those copies: once it is done, nothing reads its bucket any
   more (mgpu_comm_wait relies on this). */
static const char *mgpu__dp_reduce_bucket_over_ranks(mgpu_data_parallel *dp, int b) {
    mgpu_tensor **bucket = dp->buckets.grads[b];
    const char *local = dp->n > 1 ? mgpu_allreduce_start(bucket, dp->n, 0, dp->buckets.scratch[b]) : "none";
    if (mgpu_group_size(dp->dist.group) == 1) return local; /* (chapter 3's wrapper) */
    const char *path = mgpu__group_allreduce("mgpu_data_parallel_step", dp->dist.group, bucket[0], MGPU_MEAN, 0);
    if (dp->n == 1) return path;
    mgpu__queue *first = &dp->devices[0]->queue[1];
    for (int i = 1; i < dp->n; i++) {
        mgpu__queue *q = &dp->devices[i]->queue[1];
        mgpu__queue_wait_queue(q, first);
        mgpu__memcpy_args copy = {bucket[i]->data, bucket[0]->data, bucket[0]->numel * sizeof(float),
                                  dp->devices[i]->gpu, dp->devices[0]->gpu};
        mgpu__launch_on(q, "copy of the ranks' mean", mgpu__memcpy_cpu, MGPU__CUDA_FN(mgpu__memcpy_cuda), &copy,
                        sizeof copy);
    }
    for (int i = 1; i < dp->n; i++) mgpu__queue_wait_queue(first, &dp->devices[i]->queue[1]);
    mgpu__comm_track(bucket, NULL, dp->n);
    snprintf(dp->dist.path, sizeof dp->dist.path, "%s, then %s", local, path);
    return dp->dist.path;
}
static size_t mgpu__dp_bucket_floats(const mgpu_data_parallel *dp, int b);
/* Starts the reduction of bucket b on every device: the caller's, the
   group's mean over the processes, or the library's (NCCL or the ring, on
   the communication queues). The library's reduces the bucket's values
   alone, not ZeRO-1's padding after them: the ring then cuts it where
   it cuts the unsharded wrapper's, and adds each value in the same order. */
static const char *mgpu__dp_reduce_bucket(mgpu_data_parallel *dp, int b) {
    if (dp->dist.group) return mgpu__dp_reduce_bucket_over_ranks(dp, b);
    if (dp->buckets.yours) {
        dp->buckets.yours(dp->buckets.grads[b], dp->n);
        return dp->buckets.yours_name;
    }
    mgpu_tensor *values[MGPU_MAX_DEVICES];
    int floats = (int)mgpu__dp_bucket_floats(dp, b);
    for (int i = 0; i < dp->n; i++) values[i] = mgpu_narrow(dp->buckets.grads[b][i], 0, floats);
    const char *algorithm = mgpu_allreduce_start(values, dp->n, 0, dp->buckets.scratch[b]);
    for (int i = 0; i < dp->n; i++) mgpu_free(values[i]); /* (views: the reduction tracks their bucket) */
    return algorithm;
}

/* The members that share out the optimizer's state under ZeRO: the
   wrapper's devices, or its group's ranks (one device each); and device
   i's place among them. */
static int mgpu__dp_members(const mgpu_data_parallel *dp) { return dp->dist.group ? mgpu_group_size(dp->dist.group) : dp->n; }
static int mgpu__dp_member(const mgpu_data_parallel *dp, int i) { return dp->dist.group ? mgpu_group_rank(dp->dist.group) : i; }

/* Makes the gradients (or with values, the values) of replica r's
   parameters p0 .. p1 - 1 views into flat, in order; with keep, the
   values are copied there first. */
static void mgpu__views_into(mgpu_tensor *flat, mgpu_net *r, int p0, int p1, int values, int keep) {
    int offset = 0;
    for (int p = p0; p < p1; p++) {
        mgpu_tensor **t = values ? &r->params[p]->value : &r->params[p]->grad;
        mgpu_shape shape = r->params[p]->value->shape;
        int numel = (int)r->params[p]->value->numel;
        mgpu_tensor *rows = mgpu_narrow(flat, offset, numel);
        mgpu_tensor *view = mgpu_view(rows, shape);
        mgpu_free(rows);
        if (keep && *t) mgpu_copy(view, *t, 0);
        mgpu_free(*t);
        *t = view;
        offset += numel;
    }
}

/* The way back from mgpu__views_into, for a whole network: each
   parameter's gradient (or with values, its value) gets memory of its own
   again, holding what it held; a gradient that does not exist (ZeRO-2's,
   between steps) becomes zeros. */
static void mgpu__own_memory(mgpu_net *net, int values) {
    mgpu_memory_category category = values ? MGPU_MEMORY_PARAMETERS : MGPU_MEMORY_GRADIENTS;
    for (int p = 0; p < net->nparams; p++) {
        mgpu_tensor **t = values ? &net->params[p]->value : &net->params[p]->grad;
        int scope = mgpu__memory_scope(category);
        mgpu_tensor *own = mgpu_zeros(net->device, net->params[p]->value->shape);
        mgpu__memory_scope((mgpu_memory_category)scope);
        if (*t) mgpu_copy(own, *t, 0);
        mgpu_free(*t);
        *t = own;
    }
}

/* Bucket b's layers, first to last (buckets are made from the last
   layer back: bucket 0 ends the network). */
static void mgpu__dp_bucket_layers(const mgpu_data_parallel *dp, int b, int *first, int *last) {
    *first = dp->buckets.last_layer[b];
    *last = b == 0 ? dp->replicas[0]->nlayers - 1 : dp->buckets.last_layer[b - 1] - 1;
}
/* The first and one past the last parameter of bucket b. */
static void mgpu__dp_bucket_params(const mgpu_data_parallel *dp, int b, int *p0, int *p1) {
    const mgpu_net *net = dp->replicas[0];
    int first, last;
    mgpu__dp_bucket_layers(dp, b, &first, &last);
    *p0 = net->first_param[first];
    *p1 = net->first_param[last + 1];
}
/* How many values bucket b holds: its parameters' (ZeRO pads the bucket
   past them to a multiple of its members). */
static size_t mgpu__dp_bucket_floats(const mgpu_data_parallel *dp, int b) {
    int p0, p1;
    size_t floats = 0;
    mgpu__dp_bucket_params(dp, b, &p0, &p1);
    for (int p = p0; p < p1; p++) floats += dp->replicas[0]->params[p]->value->numel;
    return floats;
}

/* Bucket b's flat gradients on every device, zeros (ZeRO-2 makes them
   for each backward pass and frees them once reduced). */
static void mgpu__dp_grad_bucket_make(mgpu_data_parallel *dp, int b) {
    int p0, p1;
    mgpu__dp_bucket_params(dp, b, &p0, &p1);
    for (int i = 0; i < dp->n; i++) {
        int scope = mgpu__memory_scope(MGPU_MEMORY_GRADIENTS); /* (the gradients become views of it) */
        dp->buckets.grads[b][i] = mgpu_zeros(dp->devices[i], mgpu_shape1((int)dp->buckets.len[b]));
        mgpu__memory_scope((mgpu_memory_category)scope);
        mgpu__views_into(dp->buckets.grads[b][i], dp->replicas[i], p0, p1, 0, 0);
    }
}
static void mgpu__dp_grad_bucket_free(mgpu_data_parallel *dp, int b) {
    int p0, p1;
    mgpu__dp_bucket_params(dp, b, &p0, &p1);
    for (int i = 0; i < dp->n; i++) {
        for (int p = p0; p < p1; p++) {
            mgpu_free(dp->replicas[i]->params[p]->grad);
            dp->replicas[i]->params[p]->grad = NULL;
        }
        mgpu_free(dp->buckets.grads[b][i]);
        dp->buckets.grads[b][i] = NULL;
    }
}

MGPU_DEF mgpu_net *mgpu_data_parallel_module(mgpu_data_parallel *dp) { return dp->replicas[0]; }
MGPU_DEF mgpu_net *mgpu_data_parallel_replica(mgpu_data_parallel *dp, int i) {
    MGPU_REQUIRE(i >= 0 && i < dp->n, "mgpu_data_parallel_replica: index %d of %d", i, dp->n);
    return dp->replicas[i];
}
MGPU_DEF const char *mgpu_data_parallel_algorithm(const mgpu_data_parallel *dp) {
    return dp->algorithm ? dp->algorithm : "(not run yet)";
}

/* The batch's shards on the devices (mgpu_split_batch's), into the
   buffers of the set whose turn it is. A step's copies wait for the end
   of the step before last, which used the same buffers, so they run on
   the copy queues while the step before computes; copies into new
   tensors would wait for the whole of it, and the GPU, idle, for them
   (bench/history.md has what that cost). Once used, the set's buffers
   are free again where
   each device's compute queue reaches the end of the step. */
static void mgpu__dp_scatter(mgpu_data_parallel *dp, const mgpu_tensor *X, const mgpu_tensor *y) {
    int set = dp->set;
    dp->used = mgpu__split_batch(X, y, dp->devices, dp->n, dp->x_set[set], dp->y_set[set],
                                 dp->set_free[set]);
    for (int i = 0; i < dp->used; i++) {
        dp->x_shards[i] = dp->x_set[set][i];
        dp->y_shards[i] = dp->y_set[set][i];
    }
}
static void mgpu__dp_shards_used(mgpu_data_parallel *dp) {
    for (int i = 0; i < dp->n; i++) {
        mgpu_event **e = &dp->set_free[dp->set][i];
        mgpu_event_free(*e);
        *e = mgpu_event_new();
        mgpu__event_record_on(*e, &dp->devices[i]->queue[0]);
    }
    dp->set = !dp->set;
}

/* -------------------------------------------- data parallelism across processes */
/* A hash of what a network is made of: its parameters' and buffers' shapes. */
static uint64_t mgpu__net_structure_hash(const mgpu_net *net) {
    int counts[2] = {net->nparams, net->nbuffers};
    uint64_t h = mgpu__fnv1a(MGPU__FNV_OFFSET, counts, sizeof counts);
    for (int i = 0; i < mgpu__net_num_saved(net, 0); i++) {
        mgpu_shape s = (*mgpu__net_saved(net, i))->shape;
        h = mgpu__fnv1a(h, &s, sizeof s);
    }
    return h;
}
/* A hash of a network's values: its parameters' and buffers' bits. */
static uint64_t mgpu__net_values_hash(const mgpu_net *net) {
    uint64_t h = MGPU__FNV_OFFSET;
    for (int i = 0; i < mgpu__net_num_saved(net, 0); i++) {
        uint64_t one = mgpu__values_checksum(*mgpu__net_saved(net, i));
        h = mgpu__fnv1a(h, &one, sizeof one);
    }
    return h;
}
/* The first rank whose hash is not rank 0's, or -1. */
static int mgpu__group_first_different(mgpu_group *g, uint64_t mine, const char *op) {
    uint64_t *all = (uint64_t *)mgpu__xmalloc(sizeof mine * (size_t)g->size);
    mgpu__group_all_gather_bytes(g, &mine, sizeof mine, all, op);
    int differs = -1;
    for (int r = 1; r < g->size && differs < 0; r++)
        if (all[r] != all[0]) differs = r;
    free(all);
    return differs;
}

/* The optimizer's state goes with the parameters (a checkpoint that rank
   0 alone loaded): rank 0's count of steps, and its momentum buffers (and
   Adam's second moments) where it has them (none on every rank where it
   has none). */
static void mgpu__group_broadcast_sgd_state(mgpu_group *g, mgpu_net *net) {
    long mine[2] = {net->steps, mgpu__net_has_momentum(net)};
    long *all = (long *)mgpu__xmalloc(sizeof mine * (size_t)g->size);
    mgpu__group_all_gather_bytes(g, mine, sizeof mine, all, "mgpu_distributed_data_parallel_new");
    net->steps = (int)all[0];
    mgpu__net_keep_momentum(net, (int)all[1]);
    for (int p = 0; p < net->nparams && all[1]; p++) {
        mgpu_group_broadcast(g, net->momentum[p], 0);
        if (net->adam) mgpu_group_broadcast(g, net->second_moment[p], 0);
    }
    free(all);
}

MGPU_DEF mgpu_data_parallel *mgpu_distributed_data_parallel_new(mgpu_net *net, mgpu_group *g) {
    return mgpu_distributed_data_parallel_new_devices(net, &net->device, 1, g);
}

MGPU_DEF mgpu_data_parallel *mgpu_distributed_data_parallel_new_devices(mgpu_net *net, mgpu_device *const *devices,
                                                                        int n, mgpu_group *g) {
    const char *op = "mgpu_distributed_data_parallel_new";
    if (n > 1 && mgpu__net_synced(net))
        mgpu_group_fatal(g, "%s: the network's batch norms are synchronised over a group "
                            "(mgpu_net_sync_batchnorm): that needs one device a process, not %d", op, n);
    int r = mgpu__group_first_different(g, mgpu__net_structure_hash(net), op);
    if (r >= 0)
        mgpu_group_fatal(g, "%s: rank %d built another network than rank 0 (its parameters' or buffers' "
                             "shapes differ): every rank must build the same one", op, r);
    for (int i = 0; i < mgpu__net_num_saved(net, 0); i++) mgpu_group_broadcast(g, *mgpu__net_saved(net, i), 0);
    mgpu__group_broadcast_sgd_state(g, net);
    r = mgpu__group_first_different(g, mgpu__net_values_hash(net), op);
    if (r >= 0)
        mgpu_group_fatal(g, "%s: after the broadcast from rank 0, rank %d's parameters differ from rank 0's",
                             op, r);
    net->changes++;
    mgpu_data_parallel *dp = mgpu_data_parallel_new(net, devices, n, MGPU_DP_ALLREDUCE);
    dp->dist.group = g;
    dp->algorithm = mgpu__dp_reduces(dp) ? NULL : "none";
    return dp;
}

/* Rank r of size evaluates rows [n r / size, n (r + 1) / size) of the
   data set, with rank 0's network: the buffers are broadcast first. */
MGPU_DEF double mgpu_dist_evaluate_accuracy(mgpu_group *g, mgpu_net *net, const mgpu_dataset *data,
                                            int batch_size) {
    MGPU_REQUIRE(!(net->layer_hook && net->sharded && g->size > 1), "mgpu_dist_evaluate_accuracy: the network's "
                 "values are sharded over the ranks (ZeRO-3): each forward pass gathers them, which every rank "
                 "must do alike; evaluate after mgpu_data_parallel_free");
    int first = (int)((long long)data->n * g->rank / g->size);
    int last = (int)((long long)data->n * (g->rank + 1) / g->size);
    size_t pixels = (size_t)data->rows * (size_t)data->cols;
    mgpu_dataset part = {last - first, data->rows, data->cols, data->images + pixels * (size_t)first,
                         data->labels + first};
    /* rank 0's running statistics: each rank's moved with its own shard since the last step's broadcast */
    for (int i = 0; i < net->nbuffers; i++) mgpu_group_broadcast(g, *net->buffers[i], 0);
    double correct = part.n > 0 ? mgpu__net_count_correct(net, &part, batch_size) : 0.0;
    mgpu_group_sum_host(g, &correct, 1);
    return correct / (double)data->n;
}
