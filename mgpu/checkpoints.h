/* mgpu/checkpoints.h: a training on disk. A network's parameters and
   buffers (mgpu_net_save), and a checkpoint: those, the optimizer's state,
   where the training stopped and the settings it ran with, so that a
   resume refuses a changed setting instead of training something else.
   Files are written whole or not at all (through mgpu/core.h's
   mgpu__whole_file_open and mgpu__whole_file_close: a .tmp file, synced,
   then renamed). Chapter 4 resumes from one.
   defines: mgpu_net_save, mgpu_net_load, mgpu_train_settings_of,
   mgpu_train_settings_differ, mgpu_checkpoint_save, mgpu_checkpoint_load,
   mgpu_checkpoint_read_info */
/* ---------------------------------------------------- save and load */
/* Two kinds of file, one layout: mgpu_net_save's (the parameters and
   buffers) and a training checkpoint's (mgpu_checkpoint_save: those, the
   momentum buffers and the training's state). */
typedef struct mgpu__net_file_kind {
    const char *magic; /* 8 characters */
    uint32_t version;  /* of the layout this library writes and reads */
    const char *name;  /* for messages: "cannot read the <name>" */
    const char *holds; /* what a file of this kind is, for a load of the other kind */
    const char *older; /* why an older version is refused, or "" */
} mgpu__net_file_kind;
static const mgpu__net_file_kind mgpu__net_files[2] = {
    {"MGPUNET1", 1, "checkpoint", "a network's parameters and buffers (mgpu_net_save): load it with mgpu_net_load",
     ""},
    {"MGPUCKP1", 2, "training checkpoint",
     "a training checkpoint (mgpu_checkpoint_save): load it with mgpu_checkpoint_load",
     " (an older mgpu's, without the training's settings that a resume must match: delete the file to start "
     "afresh)"},
};
/* magic, version and tensor count */
#define MGPU__NET_HEADER_BYTES (8 + 2 * sizeof(uint32_t))
/* A training checkpoint's state, after the header: the info, the
   network's count of steps and the generator's place, then a checksum of
   the file up to it, so that the info can be read and trusted without the
   tensors after it (mgpu_checkpoint_read_info). Numbers of 8 bytes and
   names of whole words: nothing to pad. */
typedef struct mgpu__train_state {
    uint64_t epoch, batch, step, world;
    char model[MGPU_SETTING_BYTES];
    uint64_t batch_size, samples, data;
    char optimizer[MGPU_SETTING_BYTES];
    double lr, momentum, weight_decay; /* (floats, held exactly) */
    uint64_t seed;
    char conv[MGPU_SETTING_BYTES];
    uint64_t net_steps, generator_seed, generator_offset;
    uint64_t checksum;
} mgpu__train_state;

/* The tensors of a file, in order: parameters, then buffers; in a
   training checkpoint, then each parameter's momentum buffer, a slot that
   is empty (NULL) until a step with momentum makes it. */
/* The tensors a file holds: the parameters, the buffers, and in a
   training checkpoint the optimizer's state, a momentum slot a parameter
   (Adam's first moments) and with Adam a second moment's. */
static int mgpu__net_num_saved(const mgpu_net *net, int training) {
    return net->nparams + net->nbuffers + (training ? (1 + net->adam) * net->nparams : 0);
}
static mgpu_tensor **mgpu__net_saved(const mgpu_net *net, int i) {
    int np = net->nparams, nb = net->nbuffers;
    return i < np ? &net->params[i]->value : i < np + nb ? net->buffers[i - np]
         : i < 2 * np + nb ? &net->momentum[i - np - nb] : &net->second_moment[i - 2 * np - nb];
}
/* The tensor whose shape slot i has: an optimizer's has its parameter's. */
static const mgpu_tensor *mgpu__net_saved_like(const mgpu_net *net, int i) {
    int state = i - net->nparams - net->nbuffers;
    return state >= 0 ? net->params[state % net->nparams]->value : *mgpu__net_saved(net, i);
}

/* What tensor i of the file's count is, for messages: "tensor 14 of 22
   (linear4's weight)", "tensor 20 of 22 (block2.bn2's running_mean)",
   "tensor 30 of 36 (linear4's weight's momentum)". */
static const char *mgpu__net_saved_name(const mgpu_net *net, int i, int count, char *buf, size_t size) {
    int np = net->nparams, nb = net->nbuffers, momentum = i >= np + nb, second = i >= 2 * np + nb;
    const void *slot = i < np ? (const void *)net->params[i]
                     : momentum ? (const void *)net->params[(i - np - nb) % np] : (const void *)net->buffers[i - np];
    snprintf(buf, size, "tensor %d of %d", i, count);
    /* a depth-first walk: each layer, then a block's parts (at most 5 a layer) */
    const mgpu_layer **stack = (const mgpu_layer **)mgpu__xmalloc((5 * net->nlayers + 1) * sizeof *stack);
    int n = 0;
    for (int k = net->nlayers - 1; k >= 0; k--) stack[n++] = net->layers[k];
    while (n > 0) {
        const mgpu_layer *l = stack[--n];
        const char *what = slot == &l->weight ? "weight" : slot == &l->bias ? "bias"
                         : slot == &l->running_mean ? "running_mean" : slot == &l->running_var ? "running_var" : NULL;
        if (what) {
            snprintf(buf, size, "tensor %d of %d (%s's %s%s)", i, count, l->name, what,
                     second ? "'s second moment" : momentum ? "'s momentum" : "");
            break;
        }
        const mgpu_layer *parts[5] = {l->shortcut, l->bn2, l->bn1, l->conv2, l->conv1};
        for (int k = 0; k < 5; k++)
            if (parts[k]) stack[n++] = parts[k];
    }
    free(stack);
    return buf;
}

/* The most bytes a file for the network can have: magic, version and
   count, a training checkpoint's state, then a shape and the values of
   each tensor (every momentum slot full), then the checksum. */
static size_t mgpu__net_file_bytes(const mgpu_net *net, int training) {
    size_t bytes = MGPU__NET_HEADER_BYTES + (training ? sizeof(mgpu__train_state) : 0) + sizeof(uint64_t);
    for (int i = 0; i < mgpu__net_num_saved(net, training); i++)
        bytes += (1 + MGPU_MAX_DIMS) * sizeof(uint32_t) + mgpu__net_saved_like(net, i)->numel * sizeof(float);
    return bytes;
}

static int mgpu__write_all(FILE *f, const void *data, size_t n, uint64_t *hash) {
    *hash = mgpu__fnv1a(*hash, data, n);
    return fwrite(data, 1, n, f) == n;
}

/* Writes the network's file, a training checkpoint when state is given
   (its checksum is the writer's to fill), else mgpu_net_save's. An empty
   momentum slot is written as a shape of 0 dimensions and no values. */
static void mgpu__net_write(const mgpu_net *net, const char *path, const mgpu__train_state *state) {
    int training = state != NULL, count = mgpu__net_num_saved(net, training);
    const mgpu__net_file_kind *kind = &mgpu__net_files[training];
    /* Not over what is not a file: a FIFO, say, would be replaced. */
    struct stat st;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode))
        mgpu_fatal("%s: cannot write the %s (not a regular file)", path, kind->name);
    /* Whole or not at all: a full disk leaves the checkpoint before it. */
    mgpu__whole_file w;
    FILE *f = mgpu__whole_file_open(&w, path);
    if (!f) mgpu_fatal("%s: cannot open for writing (%s)", path, strerror(errno));
    uint64_t hash = MGPU__FNV_OFFSET;
    uint32_t header[2] = {kind->version, (uint32_t)count};
    int written = mgpu__write_all(f, kind->magic, 8, &hash);
    written &= mgpu__write_all(f, header, sizeof header, &hash);
    if (training) {
        mgpu__train_state checked = *state;
        written &= mgpu__write_all(f, &checked, offsetof(mgpu__train_state, checksum), &hash);
        checked.checksum = hash;
        written &= mgpu__write_all(f, &checked.checksum, sizeof checked.checksum, &hash);
    }
    for (int i = 0; i < count && written; i++) {
        const mgpu_tensor *t = *mgpu__net_saved(net, i);
        uint32_t shape[1 + MGPU_MAX_DIMS] = {0};
        if (t) {
            shape[0] = (uint32_t)t->shape.ndim;
            for (int k = 0; k < MGPU_MAX_DIMS; k++) shape[1 + k] = (uint32_t)t->shape.d[k];
        }
        written &= mgpu__write_all(f, shape, sizeof shape, &hash);
        if (!t) continue;
        float *values = (float *)mgpu__xmalloc(t->numel * sizeof(float));
        mgpu_to_host(t, values);
        written &= mgpu__write_all(f, values, t->numel * sizeof(float), &hash);
        free(values);
    }
    written &= fwrite(&hash, sizeof hash, 1, f) == 1;
    /* On the disk before the rename: a crash just after it must find the
       new file whole, not a name for blocks that were never written. */
    written = written && fflush(f) == 0 && fsync(fileno(f)) == 0;
    int error = mgpu__whole_file_close(&w, !written);
    if (error) mgpu_fatal("%s: cannot write the %s (%s)", path, kind->name, strerror(error));
}

/* The first `most` bytes of the file at path, of the kind (all of it
   when it is shorter: *readable), and its size in *total. What it is, is
   asked before it is opened: opening a FIFO would wait for a writer. */
static unsigned char *mgpu__net_file_read(const char *path, const mgpu__net_file_kind *kind, size_t most,
                                          size_t *readable, size_t *total) {
    struct stat st;
    if (stat(path, &st) != 0) mgpu_fatal("%s: cannot open the %s (%s)", path, kind->name, strerror(errno));
    if (!S_ISREG(st.st_mode)) mgpu_fatal("%s: cannot read the %s (not a regular file)", path, kind->name);
    FILE *f = fopen(path, "rb");
    if (!f) mgpu_fatal("%s: cannot open the %s (%s)", path, kind->name, strerror(errno));
    *total = (size_t)st.st_size;
    *readable = *total < most ? *total : most;
    unsigned char *bytes = (unsigned char *)mgpu__xmalloc(*readable);
    if (fread(bytes, 1, *readable, f) != *readable)
        mgpu_fatal("%s: cannot read the %s (%s)", path, kind->name, strerror(errno));
    fclose(f);
    return bytes;
}

/* Checks how the file's bytes begin: its kind, its version and, in a
   training checkpoint, the state and its checksum (into *state). Returns
   the count of tensors the header gives; *at: where they start. */
static uint32_t mgpu__net_file_head(const char *path, int training, const unsigned char *bytes, size_t readable,
                                    size_t total, mgpu__train_state *state, size_t *at) {
    const mgpu__net_file_kind *kind = &mgpu__net_files[training], *other = &mgpu__net_files[!training];
    if (total == 0) mgpu_fatal("%s: empty (0 bytes), not an mgpu %s", path, kind->name);
    if (readable >= 8 && memcmp(bytes, other->magic, 8) == 0) mgpu_fatal("%s: holds %s", path, other->holds);
    if (readable < 8 || memcmp(bytes, kind->magic, 8) != 0)
        mgpu_fatal("%s: not an mgpu %s (no \"%s\" header)", path, kind->name, kind->magic);
    if (readable < MGPU__NET_HEADER_BYTES) mgpu_fatal("%s: truncated in the header", path);
    uint32_t header[2];
    memcpy(header, bytes + 8, sizeof header);
    if (header[0] != kind->version)
        mgpu_fatal("%s: %s version %u, this library reads version %u%s", path, kind->name, header[0],
                   kind->version, header[0] < kind->version ? kind->older : "");
    *at = MGPU__NET_HEADER_BYTES;
    if (training) {
        if (readable - *at < sizeof *state) mgpu_fatal("%s: truncated in the training state", path);
        memcpy(state, bytes + *at, sizeof *state);
        *at += sizeof *state;
        if (state->checksum != mgpu__fnv1a(MGPU__FNV_OFFSET, bytes, *at - sizeof state->checksum))
            mgpu_fatal("%s: checksum mismatch in the training state (the file is damaged)", path);
    }
    return header[1];
}

/* Reads the network's file into net, a training checkpoint when state is
   given (which gets its state), else mgpu_net_save's. Everything is
   checked before the network is touched. */
static void mgpu__net_read(mgpu_net *net, const char *path, mgpu__train_state *state) {
    int training = state != NULL, count = mgpu__net_num_saved(net, training);
    const mgpu__net_file_kind *kind = &mgpu__net_files[training];
    /* Only as many bytes as the network's file can have: a longer file is
       an error below, and need not fit in memory to be one. */
    size_t readable, total, at;
    unsigned char *bytes = mgpu__net_file_read(path, kind, mgpu__net_file_bytes(net, training), &readable, &total);
    uint32_t held = mgpu__net_file_head(path, training, bytes, readable, total, state, &at);
    if ((int)held != count)
        mgpu_fatal("%s: holds %u tensors, the network has %d (another network's %s?)", path, held, count,
                   kind->name);
    /* where each tensor's values start; 0 for an empty momentum slot
       (values never start at 0: the header comes first) */
    size_t *offsets = (size_t *)mgpu__xcalloc((size_t)count, sizeof(size_t));
    for (int i = 0; i < count; i++) {
        const mgpu_tensor *t = mgpu__net_saved_like(net, i);
        uint32_t shape[1 + MGPU_MAX_DIMS];
        char name[160];
        if (sizeof shape > readable - at)
            mgpu_fatal("%s: truncated in %s", path, mgpu__net_saved_name(net, i, count, name, sizeof name));
        memcpy(shape, bytes + at, sizeof shape);
        at += sizeof shape;
        if (shape[0] == 0 && i >= net->nparams + net->nbuffers) continue; /* an empty momentum slot */
        /* (the dimensions past ndim, always 1, are the checksum's to check) */
        int same = shape[0] == (uint32_t)t->shape.ndim;
        for (int k = 0; k < t->shape.ndim && same; k++) same = shape[1 + k] == (uint32_t)t->shape.d[k];
        if (!same) {
            char want[64], got[64] = "[";
            for (uint32_t k = 0; k < shape[0] && k < MGPU_MAX_DIMS; k++)
                snprintf(got + strlen(got), sizeof got - strlen(got), "%s%u", k ? ", " : "", shape[1 + k]);
            strcat(got, shape[0] > MGPU_MAX_DIMS ? ", ...]" : "]");
            mgpu_fatal("%s: %s has shape %s, the network's is %s", path,
                       mgpu__net_saved_name(net, i, count, name, sizeof name), got,
                       mgpu_shape_str(t->shape, want, sizeof want));
        }
        offsets[i] = at;
        if (t->numel * sizeof(float) > readable - at)
            mgpu_fatal("%s: truncated in %s", path, mgpu__net_saved_name(net, i, count, name, sizeof name));
        at += t->numel * sizeof(float);
    }
    /* (the bounds are the buffer's, `readable` bytes; `total`, the file's, is for messages) */
    const size_t trailer = sizeof(uint64_t);
    if (readable - at < trailer) mgpu_fatal("%s: truncated in the checksum at its end", path);
    if (total - at > trailer)
        mgpu_fatal("%s: %zu bytes after the last tensor, expected %zu (damaged file)", path,
                   total - at, trailer);
    uint64_t stored;
    memcpy(&stored, bytes + at, sizeof stored);
    if (stored != mgpu__fnv1a(MGPU__FNV_OFFSET, bytes, at))
        mgpu_fatal("%s: checksum mismatch (the file is damaged)", path);
    net->changes++;
    for (int i = 0; i < count; i++) {
        mgpu_tensor **slot = mgpu__net_saved(net, i);
        if (!offsets[i]) { /* as the file has it: no momentum yet */
            mgpu_free(*slot);
            *slot = NULL;
            continue;
        }
        if (!*slot) *slot = mgpu_empty(net->device, mgpu__net_saved_like(net, i)->shape);
        mgpu_tensor *host = mgpu_from_host(mgpu_cpu(), (*slot)->shape, (const float *)(bytes + offsets[i]));
        mgpu_copy(*slot, host, 0);
        mgpu_free(host);
    }
    free(offsets);
    free(bytes);
}

MGPU_DEF void mgpu_net_save(const mgpu_net *net, const char *path) { mgpu__net_write(net, path, NULL); }
MGPU_DEF void mgpu_net_load(mgpu_net *net, const char *path) { mgpu__net_read(net, path, NULL); }

/* ---- a training's settings and checkpoint */
/* v in the fewest digits that read back as v: 0.1f is "0.1", not
   "0.100000001", and two floats that differ are never written alike. */
static const char *mgpu__float_str(float v, char *buf, size_t size) {
    for (int digits = 1; digits <= 9; digits++) { /* (9 always do) */
        snprintf(buf, size, "%.*g", digits, (double)v);
        if (strtof(buf, NULL) == v) break;
    }
    return buf;
}

/* Whether the network computes convolutions (MGPU_CONV's method then
   decides how their sums round). */
static int mgpu__net_has_conv(const mgpu_net *net) {
    for (int i = 0; i < net->nlayers; i++)
        if (net->layers[i]->kind == MGPU_LAYER_CONV || net->layers[i]->kind == MGPU_LAYER_RESIDUAL) return 1;
    return 0;
}

MGPU_DEF mgpu_train_settings mgpu_train_settings_of(const mgpu_net *net, const mgpu_dataset *train_set) {
    MGPU_REQUIRE(net && train_set, "mgpu_train_settings_of: the network and the training set must not be NULL");
    mgpu_train_settings t;
    memset(&t, 0, sizeof t);
    t.samples = train_set->n;
    t.data = mgpu_dataset_digest(train_set);
    if (net->adam) {
        char beta1[16], beta2[16], eps[16];
        snprintf(t.optimizer, sizeof t.optimizer, "%s (betas %s, %s, eps %s)", net->decoupled ? "AdamW" : "Adam",
                 mgpu__float_str(net->beta1, beta1, sizeof beta1), mgpu__float_str(net->beta2, beta2, sizeof beta2),
                 mgpu__float_str(net->eps, eps, sizeof eps));
    } else {
        snprintf(t.optimizer, sizeof t.optimizer, "SGD");
    }
    if (mgpu__net_has_conv(net)) {
        mgpu__conv_settings_from_environment();
        snprintf(t.conv, sizeof t.conv, "%s", mgpu__conv_mode_names[mgpu__conv_mode]);
    }
    return t;
}

/* The settings that mgpu_train_settings_differ compares, in its order,
   each named as the chapters' flags (or the environment) set it */
enum { MGPU__SETTINGS = 10 };
static const char *const mgpu__setting_names[MGPU__SETTINGS] = {
    "--model ", "--batch-size ", "--train-samples ", "the training data of digest ", "the optimizer ",
    "--lr ", "--momentum ", "--weight-decay ", "--seed ", "MGPU_CONV="};
/* Each of t's settings in words, in that order: two settings are the
   same exactly when their words are. */
static void mgpu__settings_words(const mgpu_train_settings *t, char words[MGPU__SETTINGS][MGPU_SETTING_BYTES]) {
    snprintf(words[0], MGPU_SETTING_BYTES, "%s", t->model);
    snprintf(words[1], MGPU_SETTING_BYTES, "%d", t->batch_size);
    snprintf(words[2], MGPU_SETTING_BYTES, "%d", t->samples);
    snprintf(words[3], MGPU_SETTING_BYTES, "%016llx", (unsigned long long)t->data);
    snprintf(words[4], MGPU_SETTING_BYTES, "%s", t->optimizer);
    mgpu__float_str(t->lr, words[5], MGPU_SETTING_BYTES);
    mgpu__float_str(t->momentum, words[6], MGPU_SETTING_BYTES);
    mgpu__float_str(t->weight_decay, words[7], MGPU_SETTING_BYTES);
    snprintf(words[8], MGPU_SETTING_BYTES, "%llu", (unsigned long long)t->seed);
    snprintf(words[9], MGPU_SETTING_BYTES, "%s", t->conv);
}

MGPU_DEF int mgpu_train_settings_differ(const mgpu_train_settings *saved, const mgpu_train_settings *now,
                                        char *why, size_t size) {
    char was[MGPU__SETTINGS][MGPU_SETTING_BYTES], is[MGPU__SETTINGS][MGPU_SETTING_BYTES];
    mgpu__settings_words(saved, was);
    mgpu__settings_words(now, is);
    for (int i = 0; i < MGPU__SETTINGS; i++) {
        if (strcmp(was[i], is[i]) == 0) continue;
        const char *before = *was[i] ? was[i] : "(none)", *after = *is[i] ? is[i] : "(none)";
        const int most = MGPU_SETTING_BYTES - 1; /* (each word's length, for the compiler to see) */
        snprintf(why, size, "saved with %s%.*s, this run has %.*s: resume with %s%.*s", mgpu__setting_names[i],
                 most, before, most, after, mgpu__setting_names[i], most, before);
        return 1;
    }
    return 0;
}

/* A name of the settings into the state, as a string padded with zeros
   (the same info makes the same bytes), or back, cut to its room. */
static void mgpu__setting_copy(char *to, const char *from) {
    memset(to, 0, MGPU_SETTING_BYTES);
    snprintf(to, MGPU_SETTING_BYTES, "%.*s", MGPU_SETTING_BYTES - 1, from);
}

MGPU_DEF void mgpu_checkpoint_save(const mgpu_net *net, const char *path, const mgpu_checkpoint_info *info) {
    MGPU_REQUIRE(!net->sharded, "mgpu_checkpoint_save: %s: the optimizer's state of this network is spread over a "
                 "ZeRO wrapper's members (mgpu_data_parallel_zero); freeing the wrapper gathers it back", path);
    MGPU_REQUIRE(info, "mgpu_checkpoint_save: info is NULL; it says where the training resumes");
    MGPU_REQUIRE(info->epoch >= 0 && info->batch >= 0 && info->step >= 0 && info->world >= 1,
                 "mgpu_checkpoint_save: epoch %d, batch %d, step %ld, world %d: the first three must be 0 or "
                 "more, world 1 or more", info->epoch, info->batch, info->step, info->world);
    const mgpu_train_settings *t = &info->train;
    const char *names[3] = {t->model, t->optimizer, t->conv}, *fields[3] = {"model", "optimizer", "conv"};
    for (int k = 0; k < 3; k++)
        MGPU_REQUIRE(memchr(names[k], 0, MGPU_SETTING_BYTES),
                     "mgpu_checkpoint_save: info's train.%s does not end within its %d bytes (MGPU_SETTING_BYTES)",
                     fields[k], MGPU_SETTING_BYTES);
    mgpu__train_state state;
    memset(&state, 0, sizeof state);
    state.epoch = (uint64_t)info->epoch;
    state.batch = (uint64_t)info->batch;
    state.step = (uint64_t)info->step;
    state.world = (uint64_t)info->world;
    mgpu__setting_copy(state.model, t->model);
    state.batch_size = (uint64_t)t->batch_size;
    state.samples = (uint64_t)t->samples;
    state.data = t->data;
    mgpu__setting_copy(state.optimizer, t->optimizer);
    state.lr = t->lr, state.momentum = t->momentum, state.weight_decay = t->weight_decay;
    state.seed = t->seed;
    mgpu__setting_copy(state.conv, t->conv);
    state.net_steps = (uint64_t)net->steps;
    state.generator_seed = mgpu__library.seed;
    state.generator_offset = mgpu__library.offset;
    mgpu__net_write(net, path, &state);
}

/* The info a training checkpoint's state holds. */
static void mgpu__checkpoint_info_of(const mgpu__train_state *state, mgpu_checkpoint_info *info) {
    mgpu_train_settings *t = &info->train;
    info->epoch = (int)state->epoch;
    info->batch = (int)state->batch;
    info->step = (long)state->step;
    info->world = (int)state->world;
    mgpu__setting_copy(t->model, state->model);
    t->batch_size = (int)state->batch_size;
    t->samples = (int)state->samples;
    t->data = state->data;
    mgpu__setting_copy(t->optimizer, state->optimizer);
    t->lr = (float)state->lr, t->momentum = (float)state->momentum, t->weight_decay = (float)state->weight_decay;
    t->seed = state->seed;
    mgpu__setting_copy(t->conv, state->conv);
}

MGPU_DEF void mgpu_checkpoint_load(mgpu_net *net, const char *path, mgpu_checkpoint_info *info) {
    MGPU_REQUIRE(info, "mgpu_checkpoint_load: info is NULL; it gets where the training resumes");
    MGPU_REQUIRE(!net->sharded, "mgpu_checkpoint_load: %s: the optimizer's state of this network is spread over a "
                 "ZeRO wrapper's members (mgpu_data_parallel_zero); load the checkpoint before making the "
                 "wrapper", path);
    mgpu__train_state state;
    mgpu__net_read(net, path, &state);
    mgpu__checkpoint_info_of(&state, info);
    net->steps = (int)state.net_steps;
    mgpu__library.seed = state.generator_seed;
    mgpu__library.offset = state.generator_offset;
}

MGPU_DEF void mgpu_checkpoint_read_info(const char *path, mgpu_checkpoint_info *info) {
    MGPU_REQUIRE(info, "mgpu_checkpoint_read_info: info is NULL; it gets the checkpoint's info");
    const mgpu__net_file_kind *kind = &mgpu__net_files[1];
    size_t readable, total, at;
    unsigned char *bytes = mgpu__net_file_read(path, kind, MGPU__NET_HEADER_BYTES + sizeof(mgpu__train_state),
                                               &readable, &total);
    mgpu__train_state state;
    mgpu__net_file_head(path, 1, bytes, readable, total, &state, &at);
    free(bytes);
    mgpu__checkpoint_info_of(&state, info);
}
