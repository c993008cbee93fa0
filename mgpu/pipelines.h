/* mgpu/pipelines.h: pipeline parallelism (chapter 6): a network cut into
   stages on devices or ranks, a batch into micro-batches, run by a
   schedule (naive, GPipe, 1F1B, zero-bubble ZB-H1, interleaved 1F1B over
   chunks of stages a device); the bubble measured beside its formula,
   and each schedule's timeline.
   defines: mgpu_pipeline_new, mgpu_pipeline_new_interleaved,
   mgpu_pipeline_new_group, mgpu_pipeline_free, mgpu_pipeline_set_schedule,
   mgpu_pipeline_set_interleaved_schedule, mgpu_schedule_gpipe,
   mgpu_schedule_1f1b, mgpu_schedule_zb_h1, mgpu_schedule_interleaved_1f1b,
   mgpu_pipeline_zb_h1_bubble_formula,
   mgpu_pipeline_interleaved_bubble_formula,
   mgpu_pipeline_num_stages, mgpu_pipeline_stage, mgpu_pipeline_slots,
   mgpu_pipeline_set_training, mgpu_pipeline_forward,
   mgpu_pipeline_forward_backward, mgpu_pipeline_step,
   mgpu_pipeline_train_step, mgpu_pipeline_evaluate_accuracy,
   mgpu_pipelines_average_grads, mgpu_pipeline_measure,
   mgpu_pipeline_bubble_formula, mgpu_pipeline_write_timeline */
/* A stage: its network, which holds the parameters, their gradients,
   batch norm's buffers and the optimizer's state, and its slots, copies
   of its layers that share those, one for each micro-batch in flight
   (slot[0] is the network itself); where its layers, parameters and
   buffers start in the pipeline's network. */
typedef struct mgpu__pipeline_stage {
    mgpu_net *net;
    mgpu_net **slot;
    int nslots, slots_wanted;
    int *slot_micro_batch;       /* the micro-batch each slot holds during a step, or -1 */
    int first_layer, first_param, first_buffer;
    /* done so far in this step (B or whole backward passes, W passes):
       the first of each writes the gradients it computes */
    int backward_passes, weight_passes;
} mgpu__pipeline_stage;

struct mgpu_pipeline {
    mgpu_net *net;
    /* stage s on device s mod ndevices: chunks stages a device (1 but in
       an interleaved pipeline) */
    int nstages, ndevices, chunks;
    /* across processes (mgpu_pipeline_new_group): the group, and this
       rank's stage (the others' stage[].net are NULL); the shape of each
       stage's output for one row of the batch, found by a forward pass of
       one row through the whole network (x_row: the row's shape it was
       found for) */
    struct mgpu_group *group;
    int rank;
    mgpu_shape row_output[MGPU_MAX_DEVICES], x_row;
    mgpu__pipeline_stage stage[MGPU_MAX_DEVICES];
    int micro_batches;
    /* device d's passes, in its order: order[d * 3vm ..] (v the chunks),
       npasses[d] of them (2vm, or 3vm where its backward passes split
       into B and W) */
    mgpu_pipeline_pass *order;
    int npasses[MGPU_MAX_DEVICES];
    int *sequence;             /* every device's passes as the host enqueues them: d * 3vm + index */
    /* during a step: the batch on the first stage's device and its
       labels on the last's (each copied there whole at the start: a copy
       waits for its source device's work, and the batch's is often the
       first stage's); for stage s and micro-batch j ([s * m + j]), the
       stage's input and the gradient of its output */
    const mgpu_tensor *x, *labels;
    mgpu_tensor *x_moved, *labels_moved;
    mgpu_tensor **input, **output_grad;
    /* what stage s sends for micro-batch j, and when it is written: its
       output (the slot's) and its input's gradient (its own). The next
       stage copies it when it comes to use it: a copy enqueued at once
       would make the receiving queue wait for it before the work the
       schedule puts first there. */
    const mgpu_tensor **output;
    mgpu_tensor **input_grad;
    mgpu_event **output_ready, **input_grad_ready;
};

MGPU_DEF void mgpu_schedule_gpipe(int stage, int stages, int micro_batches, mgpu_pipeline_pass *order) {
    (void)stage, (void)stages;
    for (int j = 0; j < micro_batches; j++) {
        order[j].backward = 0, order[j].micro_batch = j;
        order[micro_batches + j].backward = 1, order[micro_batches + j].micro_batch = j;
    }
}
MGPU_DEF void mgpu_schedule_1f1b(int stage, int stages, int micro_batches, mgpu_pipeline_pass *order) {
    int warmup = stages - stage - 1 < micro_batches ? stages - stage - 1 : micro_batches;
    int n = 0, forward = 0, backward = 0;
    while (forward < warmup) order[n].backward = 0, order[n++].micro_batch = forward++;
    while (forward < micro_batches) { /* the steady state: one forward, one backward */
        order[n].backward = 0, order[n++].micro_batch = forward++;
        order[n].backward = 1, order[n++].micro_batch = backward++;
    }
    while (backward < micro_batches) order[n].backward = 1, order[n++].micro_batch = backward++;
}
/* Pass n of a schedule's order. */
static void mgpu__schedule_add(mgpu_pipeline_pass *order, int *n, int backward, int micro_batch,
                               mgpu_pass_part part) {
    order[*n].backward = backward, order[*n].micro_batch = micro_batch, order[*n].part = part;
    (*n)++;
}
/* 1F1B's order with each backward pass split into B and W, stage s
   putting W off until s more B passes have run: the last stages, whose
   B passes the others wait for, run their B passes first, and their W
   passes, put off longest, fill the time 1F1B left them idle at the end. */
MGPU_DEF void mgpu_schedule_zb_h1(int stage, int stages, int micro_batches, mgpu_pipeline_pass *order) {
    int m = micro_batches, warmup = stages - stage - 1 < m ? stages - stage - 1 : m;
    int n = 0, forward = 0, backward = 0, weights = 0;
    while (forward < warmup) mgpu__schedule_add(order, &n, 0, forward++, MGPU_PASS_WHOLE);
    while (backward < m) {
        if (forward < m) mgpu__schedule_add(order, &n, 0, forward++, MGPU_PASS_WHOLE);
        mgpu__schedule_add(order, &n, 1, backward++, MGPU_PASS_INPUT_GRAD);
        if (backward - weights > stage) mgpu__schedule_add(order, &n, 1, weights++, MGPU_PASS_WEIGHT_GRAD);
    }
    while (weights < m) mgpu__schedule_add(order, &n, 1, weights++, MGPU_PASS_WEIGHT_GRAD);
}
MGPU_DEF double mgpu_pipeline_bubble_formula(int stages, int micro_batches) {
    return (stages - 1) / (double)(micro_batches + stages - 1);
}
MGPU_DEF double mgpu_pipeline_zb_h1_bubble_formula(int stages, int micro_batches) {
    MGPU_REQUIRE(micro_batches >= stages, "mgpu_pipeline_zb_h1_bubble_formula: %d micro-batches on %d stages; "
                 "the formula holds for at least as many micro-batches as stages", micro_batches, stages);
    return (stages - 1) / (double)(3 * micro_batches + stages - 1);
}

/* The k-th forward (or backward) pass of an interleaved schedule (below). */
static void mgpu__interleaved_add(mgpu_pipeline_pass *order, int *n, int backward, int k, int p, int v) {
    int round = k / p % v;
    mgpu__schedule_add(order, n, backward, k / (p * v) * p + k % p, MGPU_PASS_WHOLE);
    order[*n - 1].chunk = backward ? v - 1 - round : round;
}
/* Megatron-LM's interleaved 1F1B: device d holds v chunks (stages d,
   d + p, ...). Its passes go over the chunks in rounds of p
   micro-batches: the k-th forward pass is of chunk (k / p) mod v, the
   k-th backward pass of chunk v - 1 - (k / p) mod v, both of
   micro-batch (k / pv) p + k mod p. A warm-up of 2 (p - d - 1) + (v - 1) p
   forward passes fills the pipeline, then one forward and one backward
   in turn, then the backward passes left. */
MGPU_DEF void mgpu_schedule_interleaved_1f1b(int device, int devices, int chunks, int micro_batches,
                                             mgpu_pipeline_pass *order) {
    int p = devices, v = chunks, m = micro_batches, total = v * m;
    MGPU_REQUIRE(m % p == 0, "mgpu_schedule_interleaved_1f1b: %d micro-batches on %d devices; Megatron's interleaved "
                 "schedule takes a multiple of the devices", m, p);
    int warmup = 2 * (p - device - 1) + (v - 1) * p, n = 0, forward = 0, backward = 0;
    if (warmup > total) warmup = total;
    while (forward < warmup) mgpu__interleaved_add(order, &n, 0, forward++, p, v);
    while (forward < total) { /* the steady state: one forward, one backward */
        mgpu__interleaved_add(order, &n, 0, forward++, p, v);
        mgpu__interleaved_add(order, &n, 1, backward++, p, v);
    }
    while (backward < total) mgpu__interleaved_add(order, &n, 1, backward++, p, v);
}
MGPU_DEF double mgpu_pipeline_interleaved_bubble_formula(int devices, int chunks, int micro_batches) {
    return (devices - 1) / (double)(chunks * micro_batches + devices - 1);
}

/* Which of a micro-batch's passes on a stage: 0 forward, 1 backward (B,
   or the whole), 2 W. */
static int mgpu__pass_kind(mgpu_pipeline_pass pass) {
    return !pass.backward ? 0 : pass.part == MGPU_PASS_WEIGHT_GRAD ? 2 : 1;
}
/* "F3", "B3" or "W3": a pass as the trace labels it and the errors name
   it; in an interleaved pipeline with its chunk, "F3c1". */
static const char *mgpu__pass_name(const mgpu_pipeline *pp, mgpu_pipeline_pass pass, char *buf, size_t size) {
    /* (a checked pass's micro-batch is below 2048 and its chunk below
       MGPU_MAX_DEVICES: as unsigned shorts they fit a timeline bar's 16
       characters, which the compiler can then see) */
    unsigned short micro_batch = (unsigned short)pass.micro_batch, chunk = (unsigned short)pass.chunk;
    if (pp->chunks > 1)
        snprintf(buf, size, "%c%uc%u", "FBW"[mgpu__pass_kind(pass)], micro_batch, chunk);
    else
        snprintf(buf, size, "%c%d", "FBW"[mgpu__pass_kind(pass)], pass.micro_batch);
    return buf;
}
/* What the errors call a schedule's unit: a device of an interleaved
   pipeline, else a stage. */
static const char *mgpu__pipeline_lane_word(const mgpu_pipeline *pp) { return pp->chunks > 1 ? "device" : "stage"; }

/* A slot for stage st: copies of its layers sharing its parameters and
   buffers. A stage after the first wants its input's gradient, to send
   it back. */
static mgpu_net *mgpu__pipeline_new_slot(const mgpu__pipeline_stage *st, int wants_input_grad) {
    mgpu_net *slot = mgpu__net_like(st->net, st->net->device);
    slot->shares_params = 1;
    for (int i = 0; i < st->net->nlayers; i++)
        mgpu__net_add(slot, mgpu__layer_clone(st->net->layers[i], st->net->device, 1));
    mgpu_net_want_input_grad(slot, wants_input_grad);
    return slot;
}

static int mgpu__pass_unwritten(mgpu_pipeline_pass pass) { return pass.backward == -1 && pass.micro_batch == -1; }

/* Checks the schedule's passes for every device (a stage, but in an
   interleaved pipeline), counts them (2vm, or 3vm where the backward
   passes split; v the chunks, 1 but interleaved) and finds how many
   slots each stage needs (the most micro-batches between forward and
   their last backward pass, whole or W). */
static void mgpu__pipeline_check_order(mgpu_pipeline *pp, int m) {
    const char *who = "mgpu_pipeline_set_schedule", *lane = mgpu__pipeline_lane_word(pp);
    int p = pp->ndevices, v = pp->chunks, vm = v * m;
    unsigned char *seen = (unsigned char *)mgpu__xcalloc((size_t)3 * vm, 1); /* [(c * m + j) * 3 + kind] */
    for (int d = 0; d < p; d++) {
        const mgpu_pipeline_pass *order = pp->order + (size_t)d * 3 * vm;
        int in_flight[MGPU_MAX_DEVICES] = {0}, most[MGPU_MAX_DEVICES] = {0}, written = 0, split = 0; /* [chunk] */
        char name[24], b_name[24];
        while (written < 3 * vm && !mgpu__pass_unwritten(order[written])) written++;
        for (int i = 0; i < written; i++) split |= order[i].backward == 1 && order[i].part != MGPU_PASS_WHOLE;
        int want = split ? 3 * vm : 2 * vm;
        const char *count = split ? (v > 1 ? "3vm" : "3m") : (v > 1 ? "2vm" : "2m");
        const char *why = split ? " (each backward pass split into B and W)" : "";
        MGPU_REQUIRE(written <= want, "%s: the schedule wrote past %s %d's %s = %d passes%s", who, lane, d, count,
                     want, why);
        MGPU_REQUIRE(written == want, "%s: the schedule left pass %d of %s %d unwritten; it must write %s = %d "
                     "passes%s", who, written, lane, d, count, want, why);
        memset(seen, 0, (size_t)3 * vm);
        for (int i = 0; i < want; i++) {
            mgpu_pipeline_pass pass = order[i];
            MGPU_REQUIRE(pass.backward == 0 || pass.backward == 1,
                         "%s: the schedule's pass %d of %s %d has backward %d; want 0 (forward) or 1", who, i, lane,
                         d, pass.backward);
            MGPU_REQUIRE(pass.micro_batch >= 0 && pass.micro_batch < m,
                         "%s: the schedule's pass %d of %s %d is for micro-batch %d; there are %d (0 to %d)",
                         who, i, lane, d, pass.micro_batch, m, m - 1);
            MGPU_REQUIRE(pass.chunk >= 0 && pass.chunk < v,
                         "%s: the schedule's pass %d of %s %d is for chunk %d; there %s %d (0 to %d)", who, i, lane,
                         d, pass.chunk, v > 1 ? "are" : "is", v, v - 1);
            MGPU_REQUIRE(pass.part == MGPU_PASS_WHOLE || (pass.backward && (pass.part == MGPU_PASS_INPUT_GRAD ||
                                                                           pass.part == MGPU_PASS_WEIGHT_GRAD)),
                         "%s: the schedule's pass %d of %s %d has part %d; want MGPU_PASS_WHOLE, or for a "
                         "backward pass MGPU_PASS_INPUT_GRAD (B) or MGPU_PASS_WEIGHT_GRAD (W)", who, i, lane, d,
                         pass.part);
            MGPU_REQUIRE(!split || !pass.backward || pass.part != MGPU_PASS_WHOLE,
                         "%s: the schedule runs %s whole on %s %d but splits other backward passes into B and W; "
                         "split all of a %s's or none", who, mgpu__pass_name(pp, pass, name, sizeof name), lane, d,
                         lane);
            int kind = mgpu__pass_kind(pass), c = pass.chunk, at = (c * m + pass.micro_batch) * 3;
            MGPU_REQUIRE(!seen[at + kind], "%s: the schedule runs %s twice on %s %d", who,
                         mgpu__pass_name(pp, pass, name, sizeof name), lane, d);
            MGPU_REQUIRE(kind != 1 || seen[at],
                         "%s: the schedule runs %s on %s %d before that micro-batch's forward pass", who,
                         mgpu__pass_name(pp, pass, name, sizeof name), lane, d);
            mgpu_pipeline_pass its_b = pass;
            its_b.part = MGPU_PASS_INPUT_GRAD;
            MGPU_REQUIRE(kind != 2 || seen[at + 1], "%s: the schedule runs %s on %s %d before its %s (W reads the "
                         "output gradient B leaves)", who, mgpu__pass_name(pp, pass, name, sizeof name), lane, d,
                         mgpu__pass_name(pp, its_b, b_name, sizeof b_name));
            seen[at + kind] = 1;
            in_flight[c] += kind == 0 ? 1 : pass.part == MGPU_PASS_INPUT_GRAD ? 0 : -1;
            if (in_flight[c] > most[c]) most[c] = in_flight[c];
        }
        pp->npasses[d] = want;
        for (int c = 0; c < v; c++) pp->stage[c * p + d].slots_wanted = most[c];
    }
    free(seen);
}

/* The order in which the host enqueues the passes: round after round,
   each stage's next pass once what it takes has been enqueued (a
   forward pass the stage before's, a backward pass the stage after's),
   so that every device's queue gets its passes in the schedule's order
   and no queue waits for work enqueued after it. A round with nothing
   ready is a schedule that waits for itself. */
static void mgpu__pipeline_sequence(mgpu_pipeline *pp, int m) {
    int p = pp->ndevices, vm = pp->chunks * m, stages = pp->nstages, total = 0, n = 0;
    for (int d = 0; d < p; d++) total += pp->npasses[d];
    int *next = (int *)mgpu__xcalloc((size_t)p, sizeof *next);
    unsigned char *done = (unsigned char *)mgpu__xcalloc((size_t)3 * m * stages, 1); /* [(s * m + j) * 3 + kind] */
    pp->sequence = (int *)mgpu__xrealloc(pp->sequence, (size_t)total * sizeof *pp->sequence);
    while (n < total) {
        int progress = 0;
        for (int d = 0; d < p; d++) {
            if (next[d] == pp->npasses[d]) continue;
            mgpu_pipeline_pass pass = pp->order[d * 3 * vm + next[d]];
            /* (its stage; a W pass takes nothing from another stage) */
            int s = pass.chunk * p + d, kind = mgpu__pass_kind(pass), j = pass.micro_batch;
            int from = kind == 2 ? -1 : kind ? s + 1 : s - 1;
            if (from >= 0 && from < stages && !done[(from * m + j) * 3 + kind]) continue;
            done[(s * m + j) * 3 + kind] = 1;
            pp->sequence[n++] = d * 3 * vm + next[d]++;
            progress = 1;
        }
        if (!progress) {
            char waits[512] = "", pass_name[24];
            size_t used = 0;
            for (int d = 0; d < p && used < sizeof waits; d++)
                if (next[d] < pp->npasses[d])
                    used += (size_t)snprintf(waits + used, sizeof waits - used, "%s%s %d at %s", used ? ", " : "",
                                             mgpu__pipeline_lane_word(pp), d,
                                             mgpu__pass_name(pp, pp->order[d * 3 * vm + next[d]], pass_name,
                                                             sizeof pass_name));
            mgpu_fatal("mgpu_pipeline_set_schedule: the schedule waits for itself (%s: each needs a pass "
                       "that comes later on its neighbour)", waits);
        }
    }
    free(next);
    free(done);
}

/* The arrays of a step's tensors and events (empty between steps). */
static void mgpu__pipeline_free_step_state(mgpu_pipeline *pp) {
    for (int i = 0; pp->output_ready && i < pp->micro_batches * pp->nstages; i++) {
        mgpu_event_free(pp->output_ready[i]);
        mgpu_event_free(pp->input_grad_ready[i]);
    }
    free(pp->input);
    free(pp->output_grad);
    free((void *)pp->output);
    free(pp->input_grad);
    free(pp->output_ready);
    free(pp->input_grad_ready);
}

/* Sets the schedule: `schedule` (a stage's passes), or `interleaved` (a
   device's, over its chunks). */
static void mgpu__pipeline_schedule(mgpu_pipeline *pp, mgpu_schedule_fn schedule,
                                    mgpu_interleaved_schedule_fn interleaved, int micro_batches) {
    const char *who = "mgpu_pipeline_set_schedule";
    MGPU_REQUIRE(schedule || interleaved, "%s: no schedule (mgpu_schedule_gpipe, mgpu_schedule_1f1b, "
                 "mgpu_schedule_zb_h1; mgpu_schedule_interleaved_1f1b for an interleaved pipeline)", who);
    MGPU_REQUIRE(interleaved || pp->chunks == 1, "%s: the pipeline has %d chunks a device; it takes an interleaved "
                 "schedule (mgpu_pipeline_set_interleaved_schedule), which orders each device's passes over its "
                 "chunks", who, pp->chunks);
    /* (each pass is a trace label, of which the library keeps 4096) */
    MGPU_REQUIRE(micro_batches >= 1 && micro_batches <= 2048, "%s: %d micro-batches; want 1 to 2048", who,
                 micro_batches);
    int p = pp->ndevices, v = pp->chunks, m = micro_batches, vm = v * m;
    mgpu__pipeline_free_step_state(pp);
    pp->micro_batches = m;
    /* (room for 3vm passes a device, and one more: a schedule that writes
       past its 3vm is caught there; the part and the chunk are left as
       before, whole and 0, for schedules that do not write them) */
    pp->order = (mgpu_pipeline_pass *)mgpu__xrealloc(pp->order, ((size_t)3 * vm * p + 1) * sizeof *pp->order);
    for (int d = 0; d < p; d++) {
        mgpu_pipeline_pass *order = pp->order + (size_t)d * 3 * vm;
        for (int i = 0; i <= 3 * vm; i++) /* (unwritten) */
            order[i].backward = -1, order[i].micro_batch = -1, order[i].part = MGPU_PASS_WHOLE, order[i].chunk = 0;
        if (interleaved) interleaved(d, p, v, m, order);
        else schedule(d, p, m, order);
        MGPU_REQUIRE(mgpu__pass_unwritten(order[3 * vm]), "%s: the schedule wrote past %s %d's %s = %d passes", who,
                     mgpu__pipeline_lane_word(pp), d, v > 1 ? "3vm" : "3m", 3 * vm);
    }
    mgpu__pipeline_check_order(pp, m);
    /* (each pass's name is a trace label: "F3", "B3", and "W3" where the
       backward passes split, for every chunk) */
    int kinds = 2;
    for (int d = 0; d < p; d++) kinds = pp->npasses[d] > 2 * vm ? 3 : kinds;
    MGPU_REQUIRE(kinds * vm <= MGPU__TRACE_LABELS_MAX, "%s: %d micro-batches%s make %d trace labels (F, B%s for each "
                 "micro-batch%s); want at most %d", who, m, v > 1 ? " over the chunks" : "", kinds * vm,
                 kinds == 3 ? " and W" : "", v > 1 ? " and chunk" : "", MGPU__TRACE_LABELS_MAX);
    mgpu__pipeline_sequence(pp, m);
    for (int s = 0; s < pp->nstages; s++) {
        mgpu__pipeline_stage *st = &pp->stage[s];
        if (st->net && st->slots_wanted > st->nslots) { /* (across processes, this rank's stage alone) */
            st->slot = (mgpu_net **)mgpu__xrealloc(st->slot, (size_t)st->slots_wanted * sizeof *st->slot);
            st->slot_micro_batch =
                (int *)mgpu__xrealloc(st->slot_micro_batch, (size_t)st->slots_wanted * sizeof *st->slot_micro_batch);
            for (int k = st->nslots; k < st->slots_wanted; k++) st->slot[k] = mgpu__pipeline_new_slot(st, s > 0);
            st->nslots = st->slots_wanted;
        }
    }
    size_t n = (size_t)m * pp->nstages;
    pp->input = (mgpu_tensor **)mgpu__xcalloc(n, sizeof(mgpu_tensor *));
    pp->output_grad = (mgpu_tensor **)mgpu__xcalloc(n, sizeof(mgpu_tensor *));
    pp->output = (const mgpu_tensor **)mgpu__xcalloc(n, sizeof(mgpu_tensor *));
    pp->input_grad = (mgpu_tensor **)mgpu__xcalloc(n, sizeof(mgpu_tensor *));
    pp->output_ready = (mgpu_event **)mgpu__xcalloc(n, sizeof(mgpu_event *));
    pp->input_grad_ready = (mgpu_event **)mgpu__xcalloc(n, sizeof(mgpu_event *));
    for (size_t i = 0; i < n; i++) {
        pp->output_ready[i] = mgpu_event_new();
        pp->input_grad_ready[i] = mgpu_event_new();
    }
}
MGPU_DEF void mgpu_pipeline_set_schedule(mgpu_pipeline *pp, mgpu_schedule_fn schedule, int micro_batches) {
    mgpu__pipeline_schedule(pp, schedule, NULL, micro_batches);
}
MGPU_DEF void mgpu_pipeline_set_interleaved_schedule(mgpu_pipeline *pp, mgpu_interleaved_schedule_fn schedule,
                                                     int micro_batches) {
    MGPU_REQUIRE(schedule, "mgpu_pipeline_set_interleaved_schedule: no schedule (mgpu_schedule_interleaved_1f1b)");
    mgpu__pipeline_schedule(pp, NULL, schedule, micro_batches);
}

/* The stage's optimizer state from the pipeline's network (to_stage), or
   back to it: momentum buffers, Adam's moments, the count of steps. */
static void mgpu__pipeline_move_state(mgpu_pipeline *pp, int s, int to_stage) {
    mgpu__pipeline_stage *st = &pp->stage[s];
    mgpu_net *from = to_stage ? pp->net : st->net, *to = to_stage ? st->net : pp->net;
    /* (the stage's parameter i is the network's first_param + i) */
    int from_i = to_stage ? st->first_param : 0, to_i = to_stage ? 0 : st->first_param;
    for (int i = 0; i < st->net->nparams; i++, from_i++, to_i++) {
        mgpu_tensor *state_from[2] = {from->momentum[from_i], from->second_moment[from_i]};
        mgpu_tensor **state_to[2] = {&to->momentum[to_i], &to->second_moment[to_i]};
        for (int k = 0; k < 2; k++) {
            if (!state_from[k]) continue;
            int scope = mgpu__memory_scope(MGPU_MEMORY_OPTIMIZER);
            mgpu_ensure(state_to[k], to->device, state_from[k]->shape);
            mgpu__memory_scope((mgpu_memory_category)scope);
            mgpu_copy(*state_to[k], state_from[k], 0);
        }
    }
    to->steps = from->steps;
}

/* The buffers (batch norm's running statistics) of layer l and its parts. */
static int mgpu__layer_buffers(const mgpu_layer *l) {
    if (!l) return 0;
    int n = l->running_mean ? 2 : 0;
    const mgpu_layer *parts[5] = {l->conv1, l->bn1, l->conv2, l->bn2, l->shortcut};
    for (int i = 0; i < 5 && l->kind == MGPU_LAYER_RESIDUAL; i++) n += mgpu__layer_buffers(parts[i]);
    return n;
}

/* A new pipeline of net in `stages` stages, stage s starting at layer
   first[s] (first[stages]: the end), after checking the cut. */
static mgpu_pipeline *mgpu__pipeline_cut(const char *who, mgpu_net *net, int stages, const int *first_layers,
                                         int *first) {
    MGPU_REQUIRE(stages >= 1 && stages <= MGPU_MAX_DEVICES, "%s: %d stages; want 1 to %d", who, stages,
                 MGPU_MAX_DEVICES);
    MGPU_REQUIRE(stages <= net->nlayers, "%s: %d stages for a network of %d layers; at most one stage a layer",
                 who, stages, net->nlayers);
    MGPU_REQUIRE(!net->wrapped, "%s: a wrapper holds this network already", who);
    MGPU_REQUIRE(!mgpu__net_synced(net), "%s: the network's batch norms are synchronised over a group "
                 "(mgpu_net_sync_batchnorm); a pipeline's stages hold different layers", who);
    for (int s = 0; s < stages; s++) {
        first[s] = first_layers ? first_layers[s] : s * net->nlayers / stages;
        MGPU_REQUIRE(s > 0 || first[0] == 0, "%s: stage 0 starts at layer %d; it must start at layer 0", who,
                     first[0]);
        MGPU_REQUIRE(first[s] >= 0 && first[s] < net->nlayers,
                     "%s: stage %d starts at layer %d, which does not exist (the network has layers 0 to %d)", who,
                     s, first[s], net->nlayers - 1);
        MGPU_REQUIRE(s == 0 || first[s] > first[s - 1],
                     "%s: stage %d starts at layer %d, not after stage %d's first layer (%d)", who, s, first[s],
                     s - 1, first[s - 1]);
    }
    first[stages] = net->nlayers;
    mgpu_pipeline *pp = (mgpu_pipeline *)mgpu__xcalloc(1, sizeof *pp);
    pp->net = net;
    pp->nstages = pp->ndevices = stages;
    pp->chunks = 1;
    return pp;
}

/* Stage s, layers first .. end - 1 of the pipeline's network, on dev: a
   network of copies of them with their state, and its first slot. */
static void mgpu__pipeline_build_stage(mgpu_pipeline *pp, int s, mgpu_device *dev, int first, int end,
                                       const char *who) {
    mgpu_net *net = pp->net;
    mgpu__pipeline_stage *st = &pp->stage[s];
    mgpu_net *sn = st->net = mgpu__net_like(net, dev);
    st->first_layer = first;
    st->first_param = net->first_param[first];
    for (int i = 0; i < first; i++) st->first_buffer += mgpu__layer_buffers(net->layers[i]);
    for (int i = first; i < end; i++) {
        mgpu__require_own_loops_on_cpu(net->layers[i], dev, who);
        mgpu__net_add(sn, mgpu__layer_clone(net->layers[i], dev, 0));
    }
    /* (the stage's first layer reads its input as it comes, not a batch
       norm's channels-last copy of it) */
    mgpu_layer *l = sn->layers[0];
    l->copies->input_from_batch_norm = 0;
    if (l->kind == MGPU_LAYER_RESIDUAL) {
        l->conv1->copies->input_from_batch_norm = 0;
        if (l->shortcut) l->shortcut->copies->input_from_batch_norm = 0;
    }
    mgpu_net_want_input_grad(sn, s > 0);
    sn->wrapped = MGPU__HELD_BY_PIPELINE; /* (mgpu_pipeline_stage hands it out; the pipeline frees it) */
    mgpu__pipeline_move_state(pp, s, 1);
    st->slot = (mgpu_net **)mgpu__xcalloc(1, sizeof *st->slot);
    st->slot_micro_batch = (int *)mgpu__xcalloc(1, sizeof *st->slot_micro_batch);
    st->slot[0] = sn;
    st->nslots = 1;
}

/* A pipeline of ndevices * chunks stages, stage s on devices[s mod
   ndevices]. */
static mgpu_pipeline *mgpu__pipeline_new_on(const char *who, mgpu_net *net, mgpu_device *const *devices,
                                           int ndevices, int chunks, const int *first_layers) {
    int first[MGPU_MAX_DEVICES + 1];
    MGPU_REQUIRE(chunks >= 1 && ndevices >= 1 && ndevices * chunks <= MGPU_MAX_DEVICES,
                 "%s: %d chunks on %d devices; want at least 1 of each, and at most %d stages in all", who, chunks,
                 ndevices, MGPU_MAX_DEVICES);
    mgpu_pipeline *pp = mgpu__pipeline_cut(who, net, ndevices * chunks, first_layers, first);
    pp->ndevices = ndevices, pp->chunks = chunks;
    for (int d = 0; d < ndevices; d++)
        if (!devices[d]) {
            free(pp);
            mgpu_fatal("%s: devices[%d] is NULL", who, d);
        }
    for (int d = 0; d < ndevices; d++)
        for (int e = 0; e < d; e++)
            if (devices[d] == devices[e]) {
                free(pp);
                mgpu_fatal("%s: %s is devices[%d] and devices[%d]; give each %s its own device (mgpu_devices "
                           "makes virtual ones)", who, devices[d]->name, e, d,
                           chunks > 1 ? "device's chunks" : "stage");
            }
    for (int s = 0; s < pp->nstages; s++)
        mgpu__pipeline_build_stage(pp, s, devices[s % ndevices], first[s], first[s + 1], who);
    net->wrapped = MGPU__HELD_BY_PIPELINE;
    if (chunks > 1) mgpu_pipeline_set_interleaved_schedule(pp, mgpu_schedule_interleaved_1f1b, ndevices);
    else mgpu_pipeline_set_schedule(pp, mgpu_schedule_gpipe, 1);
    return pp;
}
MGPU_DEF mgpu_pipeline *mgpu_pipeline_new(mgpu_net *net, mgpu_device *const *devices, int stages,
                                          const int *first_layers) {
    return mgpu__pipeline_new_on("mgpu_pipeline_new", net, devices, stages, 1, first_layers);
}
MGPU_DEF mgpu_pipeline *mgpu_pipeline_new_interleaved(mgpu_net *net, mgpu_device *const *devices, int ndevices,
                                                      int chunks, const int *first_layers) {
    return mgpu__pipeline_new_on("mgpu_pipeline_new_interleaved", net, devices, ndevices, chunks, first_layers);
}

MGPU_DEF mgpu_pipeline *mgpu_pipeline_new_group(mgpu_net *net, struct mgpu_group *g, const int *first_layers) {
    const char *who = "mgpu_pipeline_new_group";
    int first[MGPU_MAX_DEVICES + 1], stages = mgpu_group_size(g), rank = mgpu_group_rank(g);
    mgpu_pipeline *pp = mgpu__pipeline_cut(who, net, stages, first_layers, first);
    pp->group = g;
    pp->rank = rank;
    mgpu__pipeline_build_stage(pp, rank, net->device, first[rank], first[rank + 1], who);
    for (int s = 0; s < stages; s++) pp->stage[s].first_layer = first[s];
    net->wrapped = MGPU__HELD_BY_PIPELINE;
    mgpu_pipeline_set_schedule(pp, mgpu_schedule_gpipe, 1);
    return pp;
}

/* Rows first .. first + count - 1 of the batch's n are micro-batch j's
   (as torch.tensor_split: the first n mod m micro-batches a row more). */
static void mgpu__micro_batch_rows(int n, int m, int j, int *first, int *count) {
    *count = n / m + (j < n % m);
    *first = j * (n / m) + (j < n % m ? j : n % m);
}

/* Shape `row` (of one row) with `rows` rows. */
static mgpu_shape mgpu__rows_of(mgpu_shape row, int rows) {
    row.d[0] = rows;
    return row;
}

/* t, or where t is on another device, a copy of it on dev (*moved,
   freed after the step). */
static const mgpu_tensor *mgpu__on_device(const mgpu_tensor *t, mgpu_device *dev, mgpu_tensor **moved) {
    *moved = t->device == dev ? NULL : mgpu_to(t, dev, 1);
    return *moved ? *moved : t;
}

/* A copy on dev of what another stage sent (src, written once `ready`
   has passed), counted as category c. */
static mgpu_tensor *mgpu__pipeline_receive(const mgpu_tensor *src, mgpu_event *ready, mgpu_device *dev,
                                           mgpu_memory_category c) {
    int scope = mgpu__memory_scope(c);
    mgpu_tensor *t = mgpu_empty(dev, src->shape);
    mgpu__memory_scope((mgpu_memory_category)scope);
    mgpu__copy(t, src, 1, NULL, ready);
    return t;
}

/* Micro-batch j's forward pass on stage s, in a free slot, on what the
   stage before sent (the first stage: its rows of the batch). */
static void mgpu__pipeline_forward_pass(mgpu_pipeline *pp, int s, int j) {
    mgpu__pipeline_stage *st = &pp->stage[s];
    int m = pp->micro_batches, k = 0, first, count;
    while (st->slot_micro_batch[k] >= 0) k++; /* (the schedule's check counted enough slots) */
    st->slot_micro_batch[k] = j;
    mgpu_tensor **input = &pp->input[s * m + j];
    if (s == 0) {
        mgpu__micro_batch_rows(pp->x->shape.d[0], m, j, &first, &count);
        *input = mgpu_narrow(pp->x, first, count);
    } else if (pp->group) {
        mgpu__micro_batch_rows(pp->x->shape.d[0], m, j, &first, &count);
        int scope = mgpu__memory_scope(MGPU_MEMORY_ACTIVATIONS);
        *input = mgpu_empty(st->net->device, mgpu__rows_of(pp->row_output[s - 1], count));
        mgpu__memory_scope((mgpu_memory_category)scope);
        mgpu__group_p2p(pp->group, 0, *input, s - 1, NULL);
    } else {
        int from = (s - 1) * m + j;
        *input = mgpu__pipeline_receive(pp->output[from], pp->output_ready[from], st->net->device,
                                        MGPU_MEMORY_ACTIVATIONS);
    }
    st->slot[k]->segments = st->net->segments; /* (mgpu_net_recompute on the stage reaches its slots) */
    pp->output[s * m + j] = mgpu_net_forward(st->slot[k], *input);
    mgpu_event_record(pp->output_ready[s * m + j], st->net->device);
}

/* What micro-batch j held on stage s, in slot k, freed once its last
   backward pass there is done: its activations and their gradients, its
   input and output gradient; the slot is free again. */
static void mgpu__pipeline_release(mgpu_pipeline *pp, int s, int k, int j) {
    mgpu__pipeline_stage *st = &pp->stage[s];
    mgpu_net *slot = st->slot[k];
    int m = pp->micro_batches;
    for (int i = 0; i < slot->nlayers; i++) {
        mgpu__layer_free_activations(slot->layers[i], 0);
        mgpu__layer_free_gradients(slot->layers[i], 1);
    }
    mgpu_tensor **held[2] = {&pp->input[s * m + j], &pp->output_grad[s * m + j]};
    for (int h = 0; h < 2; h++) {
        mgpu_free(*held[h]);
        *held[h] = NULL;
    }
    st->slot_micro_batch[k] = -1;
}

/* Micro-batch j's W pass on stage s: its weights' gradients from the
   output gradients its B pass kept (the last stage's, its loss's, in the
   slot); then what it held is freed. */
static void mgpu__pipeline_weight_pass(mgpu_pipeline *pp, int s, int j) {
    mgpu__pipeline_stage *st = &pp->stage[s];
    int m = pp->micro_batches, k = 0;
    while (st->slot_micro_batch[k] != j) k++;
    mgpu_net *slot = st->slot[k];
    const mgpu_tensor *dy = s < pp->nstages - 1 ? pp->output_grad[s * m + j] : slot->dlogits;
    mgpu__net_backward_part(slot, dy, st->weight_passes++ > 0, MGPU_PASS_WEIGHT_GRAD);
    mgpu__pipeline_release(pp, s, k, j);
}

/* Micro-batch j's backward pass on stage s (whole, or its B), on the
   gradient the stage after sent (the last stage: from its loss); then,
   after a whole pass, what the micro-batch held on this stage is freed,
   but its input's gradient, which the stage before takes. */
static void mgpu__pipeline_backward_pass(mgpu_pipeline *pp, int s, int j, mgpu_pass_part part,
                                         mgpu_tensor *loss_sum) {
    const char *who = "mgpu_pipeline_forward_backward";
    mgpu__pipeline_stage *st = &pp->stage[s];
    int m = pp->micro_batches, k = 0, first, count, n = pp->labels->shape.d[0];
    while (st->slot_micro_batch[k] != j) k++;
    mgpu_net *slot = st->slot[k];
    mgpu__net_require_backward(slot, who);
    const mgpu_tensor *dy = NULL;
    if (s < pp->nstages - 1 && pp->group) {
        int scope = mgpu__memory_scope(MGPU_MEMORY_WORKSPACE);
        mgpu_tensor *received = pp->output_grad[s * m + j] = mgpu_empty(slot->device, pp->output[s * m + j]->shape);
        mgpu__memory_scope((mgpu_memory_category)scope);
        mgpu__group_p2p(pp->group, 0, received, s + 1, NULL);
        dy = received;
    } else if (s < pp->nstages - 1) {
        int from = (s + 1) * m + j;
        dy = pp->output_grad[s * m + j] = mgpu__pipeline_receive(pp->input_grad[from], pp->input_grad_ready[from],
                                                                 slot->device, MGPU_MEMORY_WORKSPACE);
        mgpu_free(pp->input_grad[from]); /* (safe once the copy that reads it is enqueued) */
        pp->input_grad[from] = NULL;
    } else {
        mgpu__micro_batch_rows(n, m, j, &first, &count);
        mgpu_tensor *labels = mgpu_narrow(pp->labels, first, count);
        dy = mgpu__net_loss_grad(slot, slot->layers[slot->nlayers - 1]->output, labels, 1.0f / (float)n,
                                 loss_sum, who, first);
        mgpu_free(labels); /* (safe once the work that reads it is enqueued) */
    }
    mgpu__net_backward_part(slot, dy, st->backward_passes++ > 0, part);
    if (s > 0) { /* (the layer lets go of it: the slot's next pass makes another) */
        pp->input_grad[s * m + j] = (mgpu_tensor *)mgpu_net_input_grad(slot);
        slot->layers[0]->dinput = NULL;
        mgpu_event_record(pp->input_grad_ready[s * m + j], slot->device);
    }
    if (part == MGPU_PASS_WHOLE) mgpu__pipeline_release(pp, s, k, j);
}

/* Across processes, what each stage's output is for one row of the
   batch: a rank receives a tensor of that shape from the one before. A
   forward pass of one row of x through the whole network (which every
   rank has) in evaluation mode finds it, once for each shape of row. */
static void mgpu__pipeline_row_shapes(mgpu_pipeline *pp, const mgpu_tensor *x) {
    mgpu_shape row = mgpu__rows_of(x->shape, 1);
    if (mgpu_shape_equal(row, pp->x_row)) return;
    mgpu_net *net = pp->net;
    mgpu_tensor *one = mgpu_narrow(x, 0, 1), *moved = mgpu_to(one, net->device, 0);
    int training = net->training;
    net->training = 0;
    mgpu_net_forward(net, moved);
    net->training = training;
    for (int s = 0; s < pp->nstages; s++) {
        int last = (s + 1 < pp->nstages ? pp->stage[s + 1].first_layer : net->nlayers) - 1;
        pp->row_output[s] = net->layers[last]->output->shape;
    }
    for (int i = 0; i < net->nlayers; i++) mgpu__layer_free_activations(net->layers[i], 0);
    mgpu_free(one);
    mgpu_free(moved);
    pp->x_row = row;
}

MGPU_DEF void mgpu_pipeline_forward_backward(mgpu_pipeline *pp, const mgpu_tensor *x, const mgpu_tensor *labels,
                                             mgpu_tensor *loss_sum) {
    const char *who = "mgpu_pipeline_forward_backward";
    int p = pp->nstages, m = pp->micro_batches;
    mgpu__require_alive(x, who);
    mgpu__require_alive(labels, who);
    int n = x->shape.d[0];
    MGPU_REQUIRE(labels->shape.ndim == 1 && labels->shape.d[0] == n,
                 "%s: %d rows of x but labels of shape [%d%s]; want [%d]", who, n, labels->shape.d[0],
                 labels->shape.ndim == 1 ? "" : ", ...", n);
    MGPU_REQUIRE(n >= m, "%s: a batch of %d rows cannot make %d micro-batches", who, n, m);
    if (pp->stage[p - 1].net) mgpu__require_loss_sum(who, loss_sum, pp->stage[p - 1].net);
    for (int s = 0; s < p; s++) {
        mgpu__pipeline_stage *st = &pp->stage[s];
        st->backward_passes = st->weight_passes = 0;
        for (int k = 0; k < st->nslots; k++) st->slot_micro_batch[k] = -1;
    }
    pp->x = x;
    pp->labels = labels;
    if (pp->stage[0].net) pp->x = mgpu__on_device(x, pp->stage[0].net->device, &pp->x_moved);
    if (pp->stage[p - 1].net) pp->labels = mgpu__on_device(labels, pp->stage[p - 1].net->device, &pp->labels_moved);
    if (pp->group) mgpu__pipeline_row_shapes(pp, x);
    char label[24];
    int total = 0;
    for (int d = 0; d < pp->ndevices; d++) total += pp->npasses[d];
    for (int i = 0; i < total; i++) {
        mgpu_pipeline_pass pass = pp->order[pp->sequence[i]];
        int d = pp->sequence[i] / (3 * pp->chunks * m), s = pass.chunk * pp->ndevices + d, kind = mgpu__pass_kind(pass);
        int mine; /* (this rank's tensors of the micro-batch) */
        if (mgpu__library.tracing) /* (a label looks its text up under the library's lock) */
            mgpu_trace_label(mgpu__pass_name(pp, pass, label, sizeof label));
        if (pp->stage[s].net && kind == 2)
            mgpu__pipeline_weight_pass(pp, s, pass.micro_batch);
        else if (pp->stage[s].net && kind == 1)
            mgpu__pipeline_backward_pass(pp, s, pass.micro_batch, pass.part, loss_sum);
        else if (pp->stage[s].net)
            mgpu__pipeline_forward_pass(pp, s, pass.micro_batch);
        else if (kind == 0 && s == pp->rank + 1) { /* (the next rank comes to take our output) */
            mine = pp->rank * m + pass.micro_batch;
            mgpu__group_p2p(pp->group, 1, (mgpu_tensor *)pp->output[mine], s, pp->output_ready[mine]);
        } else if (kind == 1 && s == pp->rank - 1) { /* (the rank before, our input's gradient) */
            mine = pp->rank * m + pass.micro_batch;
            mgpu__group_p2p(pp->group, 1, pp->input_grad[mine], s, pp->input_grad_ready[mine]);
            mgpu_free(pp->input_grad[mine]); /* (safe once the send that reads it is enqueued) */
            pp->input_grad[mine] = NULL;
        }
    }
    mgpu_trace_label(NULL);
    mgpu_free(pp->x_moved);
    mgpu_free(pp->labels_moved);
    pp->x = pp->labels = pp->x_moved = pp->labels_moved = NULL;
}

MGPU_DEF void mgpu_pipeline_step(mgpu_pipeline *pp, float lr, float momentum, float weight_decay) {
    for (int s = 0; s < pp->nstages; s++)
        if (pp->stage[s].net) mgpu_net_step(pp->stage[s].net, lr, momentum, weight_decay);
}
MGPU_DEF void mgpu_pipeline_train_step(mgpu_pipeline *pp, const mgpu_tensor *x, const mgpu_tensor *labels,
                                       float lr, float momentum, float weight_decay, mgpu_tensor *loss_sum) {
    mgpu__require_sgd_settings("mgpu_pipeline_train_step", lr, momentum, weight_decay);
    mgpu_pipeline_forward_backward(pp, x, labels, loss_sum);
    mgpu_pipeline_step(pp, lr, momentum, weight_decay);
}

MGPU_DEF void mgpu_pipelines_average_grads(mgpu_pipeline *const *pipes, int n) {
    MGPU_REQUIRE(n >= 1 && n <= MGPU_MAX_DEVICES, "mgpu_pipelines_average_grads: %d pipelines", n);
    for (int k = 0; k < n; k++)
        MGPU_REQUIRE(!pipes[k]->group, "mgpu_pipelines_average_grads: pipeline %d runs across processes; it "
                     "averages the pipelines of one process", k);
    for (int k = 1; k < n; k++) {
        MGPU_REQUIRE(pipes[k]->nstages == pipes[0]->nstages && pipes[k]->net->nparams == pipes[0]->net->nparams,
                     "mgpu_pipelines_average_grads: pipeline %d has %d stages and %d parameters, pipeline 0 %d and "
                     "%d; average pipelines of the same network, cut the same way", k, pipes[k]->nstages,
                     pipes[k]->net->nparams, pipes[0]->nstages, pipes[0]->net->nparams);
        for (int s = 0; s < pipes[0]->nstages; s++)
            MGPU_REQUIRE(pipes[k]->stage[s].first_layer == pipes[0]->stage[s].first_layer,
                         "mgpu_pipelines_average_grads: pipeline %d's stage %d starts at layer %d, pipeline 0's at "
                         "%d; average pipelines cut the same way", k, s, pipes[k]->stage[s].first_layer,
                         pipes[0]->stage[s].first_layer);
    }
    mgpu_tensor *grads[MGPU_MAX_DEVICES];
    for (int s = 0; s < pipes[0]->nstages; s++) {
        mgpu_net *first = pipes[0]->stage[s].net;
        for (int i = 0; i < first->nparams; i++) {
            for (int k = 0; k < n; k++) grads[k] = pipes[k]->stage[s].net->params[i]->grad;
            mgpu_ring_allreduce(grads, n, 1);
        }
        for (int k = 1; k < n; k++) /* (batch norm's statistics: pipeline 0's everywhere, as DDP broadcasts them) */
            for (int i = 0; i < first->nbuffers; i++)
                mgpu_copy(*pipes[k]->stage[s].net->buffers[i], *first->buffers[i], 1);
    }
}

MGPU_DEF void mgpu_pipeline_set_training(mgpu_pipeline *pp, int training) {
    for (int s = 0; s < pp->nstages; s++)
        for (int k = 0; k < pp->stage[s].nslots; k++) pp->stage[s].slot[k]->training = training;
}
MGPU_DEF mgpu_tensor *mgpu_pipeline_forward(mgpu_pipeline *pp, const mgpu_tensor *x) {
    mgpu__require_alive(x, "mgpu_pipeline_forward");
    MGPU_REQUIRE(!pp->group, "mgpu_pipeline_forward: the pipeline's stages are in several processes; run the "
                 "network whole on one of them (mgpu_pipeline_free gives each its stage's values)");
    const mgpu_tensor *h = x;
    for (int s = 0; s < pp->nstages; s++) {
        mgpu_net *sn = pp->stage[s].net;
        mgpu_tensor *moved = h->device == sn->device ? NULL : mgpu_to(h, sn->device, 1);
        h = mgpu_net_forward(sn, moved ? moved : h);
        mgpu_free(moved); /* (safe once the pass that reads it is enqueued) */
    }
    return (mgpu_tensor *)h;
}
static mgpu_tensor *mgpu__pipeline_forward_fn(void *pp, const mgpu_tensor *x) {
    return mgpu_pipeline_forward((mgpu_pipeline *)pp, x);
}
MGPU_DEF double mgpu_pipeline_evaluate_accuracy(mgpu_pipeline *pp, const mgpu_dataset *data, int batch_size) {
    MGPU_REQUIRE(!pp->group, "mgpu_pipeline_evaluate_accuracy: the pipeline's stages are in several processes; "
                 "evaluate the network whole on one of them (mgpu_pipeline_free gives each its stage's values)");
    int training = pp->stage[0].net->training;
    mgpu_pipeline_set_training(pp, 0);
    double accuracy = mgpu_evaluate_accuracy(mgpu__pipeline_forward_fn, pp, pp->stage[pp->nstages - 1].net->device,
                                             data, batch_size);
    mgpu_pipeline_set_training(pp, training);
    return accuracy;
}

MGPU_DEF int mgpu_pipeline_num_stages(const mgpu_pipeline *pp) { return pp->nstages; }
MGPU_DEF mgpu_net *mgpu_pipeline_stage(mgpu_pipeline *pp, int s) {
    MGPU_REQUIRE(s >= 0 && s < pp->nstages, "mgpu_pipeline_stage: stage %d of %d", s, pp->nstages);
    MGPU_REQUIRE(pp->stage[s].net, "mgpu_pipeline_stage: stage %d is rank %d's, this is rank %d", s, s, pp->rank);
    return pp->stage[s].net;
}
MGPU_DEF int mgpu_pipeline_slots(const mgpu_pipeline *pp, int s) {
    MGPU_REQUIRE(s >= 0 && s < pp->nstages, "mgpu_pipeline_slots: stage %d of %d", s, pp->nstages);
    return pp->stage[s].slots_wanted;
}

/* The stage whose compute queue ran a traced operation of this
   pipeline's passes, or -1 (another queue's, or not a pass: unlabelled,
   or labelled by someone else). Its pass in *pass. */
static int mgpu__pipeline_op_stage(const mgpu_pipeline *pp, const mgpu_trace_op *op, mgpu_pipeline_pass *pass) {
    char kind = 0, end = 0;
    int chars = 0;
    if (op->lane != 0 || !op->label || sscanf(op->label, "%c%d%n", &kind, &pass->micro_batch, &chars) != 2 ||
        (kind != 'F' && kind != 'B' && kind != 'W') || pass->micro_batch < 0 ||
        pass->micro_batch >= pp->micro_batches)
        return -1;
    pass->chunk = 0; /* ("F3", or in an interleaved pipeline "F3c1") */
    if (pp->chunks > 1 && (sscanf(op->label + chars, "c%d%c", &pass->chunk, &end) != 1 || pass->chunk < 0 ||
                           pass->chunk >= pp->chunks))
        return -1;
    if (pp->chunks == 1 && op->label[chars]) return -1;
    pass->backward = kind != 'F';
    pass->part = kind == 'W' ? MGPU_PASS_WEIGHT_GRAD : MGPU_PASS_WHOLE;
    for (int d = 0; d < pp->nstages; d++)
        if (pp->stage[d].net && op->device == pp->stage[d].net->device)
            return pass->chunk * pp->ndevices + d % pp->ndevices;
    return -1;
}

MGPU_DEF mgpu_pipeline_timing mgpu_pipeline_measure(const mgpu_pipeline *pp) {
    mgpu_pipeline_timing t;
    memset(&t, 0, sizeof t);
    t.stages = pp->ndevices; /* (an interleaved pipeline's: its devices) */
    double lo = INFINITY, hi = -INFINITY;
    mgpu_pipeline_pass pass;
    for (int i = 0, n = mgpu_trace_count(); i < n; i++) {
        mgpu_trace_op op = mgpu_trace_get(i);
        int s = mgpu__pipeline_op_stage(pp, &op, &pass);
        if (s < 0) continue;
        t.busy_ms[s % pp->ndevices] += op.end_ms - op.start_ms;
        lo = fmin(lo, op.start_ms), hi = fmax(hi, op.end_ms);
    }
    MGPU_REQUIRE(hi > lo, "mgpu_pipeline_measure: the trace holds none of this pipeline's passes: run a step "
                          "between mgpu_trace_begin and mgpu_trace_end");
    t.span_ms = hi - lo;
    int measured = 0; /* (across processes, this rank's stage alone) */
    for (int d = 0; d < pp->ndevices; d++)
        if (pp->stage[d].net) {
            t.bubble[d] = 1.0 - t.busy_ms[d] / t.span_ms;
            t.bubble_mean += t.bubble[d];
            measured++;
        }
    t.bubble_mean /= measured;
    return t;
}

MGPU_DEF int mgpu_pipeline_write_timeline(const mgpu_pipeline *pp, const char *path, const char *title) {
    int p = pp->ndevices, m = pp->micro_batches, nbars = 3 * m * pp->nstages;
    /* (a whole backward pass's bar is "backward"; split, "B" and "W") */
    static const char *const kind_names[2][3] = {{"forward", "backward", ""},
                                                 {"forward", "B: input gradient", "W: weight gradients"}};
    mgpu_timeline_bar *bars = (mgpu_timeline_bar *)mgpu__xcalloc((size_t)nbars, sizeof *bars);
    for (int b = 0; b < nbars; b++) { /* bar (s * m + j) * 3 + kind; a kind the schedule has not stays undrawn */
        int s = b / 3 / m, kind = b % 3;
        mgpu_pipeline_pass pass = {kind != 0, b / 3 % m, kind == 2 ? MGPU_PASS_WEIGHT_GRAD : MGPU_PASS_WHOLE, s / p};
        const char *name = kind_names[pp->npasses[s % p] > 2 * pp->chunks * m][kind];
        bars[b].lane = s % p;
        bars[b].start_ms = INFINITY, bars[b].end_ms = -INFINITY;
        if (pp->chunks > 1) /* (a colour for each chunk's passes of each kind) */
            snprintf(bars[b].name, sizeof bars[b].name, "%s, chunk %d", name, pass.chunk);
        else
            snprintf(bars[b].name, sizeof bars[b].name, "%s", name);
        mgpu__pass_name(pp, pass, bars[b].label, sizeof bars[b].label);
    }
    mgpu_pipeline_pass pass;
    for (int i = 0, n = mgpu_trace_count(); i < n; i++) {
        mgpu_trace_op op = mgpu_trace_get(i);
        int s = mgpu__pipeline_op_stage(pp, &op, &pass);
        if (s < 0) continue;
        mgpu_timeline_bar *bar = &bars[(s * m + pass.micro_batch) * 3 + mgpu__pass_kind(pass)];
        bar->start_ms = fmin(bar->start_ms, op.start_ms);
        bar->end_ms = fmax(bar->end_ms, op.end_ms);
    }
    char names[MGPU_MAX_DEVICES][48];
    const char *lane_names[MGPU_MAX_DEVICES];
    for (int d = 0; d < p; d++) {
        if (pp->stage[d].net && pp->chunks > 1)
            snprintf(names[d], sizeof names[d], "device %d (%s)", d, pp->stage[d].net->device->name);
        else if (pp->stage[d].net)
            snprintf(names[d], sizeof names[d], "stage %d (%s)", d, pp->stage[d].net->device->name);
        else
            snprintf(names[d], sizeof names[d], "stage %d (rank %d)", d, d);
        lane_names[d] = names[d];
    }
    int rc = mgpu_timeline_write_png(path, title, p, lane_names, nbars, bars);
    free(bars);
    return rc;
}

MGPU_DEF void mgpu_pipeline_free(mgpu_pipeline *pp) {
    if (!pp) return;
    mgpu_net *net = pp->net;
    net->wrapped = 0;
    net->changes++;
    for (int s = 0; s < pp->nstages; s++) {
        mgpu__pipeline_stage *st = &pp->stage[s];
        if (!st->net) continue; /* (another rank's) */
        for (int i = 0; i < st->net->nparams; i++)
            mgpu_copy(net->params[st->first_param + i]->value, st->net->params[i]->value, 0);
        for (int i = 0; i < st->net->nbuffers; i++)
            mgpu_copy(*net->buffers[st->first_buffer + i], *st->net->buffers[i], 0);
        mgpu__pipeline_move_state(pp, s, 0);
        st->net->wrapped = 0;
        for (int k = st->nslots - 1; k >= 0; k--) mgpu_net_free(st->slot[k]); /* (slot 0, the stage's net, last) */
        free(st->slot);
        free(st->slot_micro_batch);
    }
    mgpu__pipeline_free_step_state(pp);
    free(pp->order);
    free(pp->sequence);
    free(pp);
}
