/* mgpu/memory.h: the caching allocator behind every tensor. Freed blocks
   wait in a per-device cache for the next request of their size, as
   PyTorch's do; what a device holds is counted by category (parameters,
   gradients, optimizer state, activations, ...) for chapter 5's tables
   and pictures.
   defines: mgpu_memory_category_name
   internal: mgpu__block_alloc, mgpu__block_release */
static size_t mgpu__round_bytes(size_t bytes) {
    /* 512-byte granules keep blocks aligned for vector loads and make
       repeated requests of similar sizes share blocks. */
    return (bytes + 511) / 512 * 512;
}

/* Refuses host memory past the machine's: the CPU devices' blocks (in
   use and cached) and this request against its physical memory. Past it,
   the kernel would sooner or later kill the process without a word. */
static void mgpu__require_host_memory(const mgpu_device *d, size_t bytes) {
    mgpu_device *devices[MGPU_MAX_DEVICES * 4];
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&mgpu__library.mutex));
    int n = mgpu__library.ndevices;
    memcpy(devices, mgpu__library.devices, (size_t)n * sizeof devices[0]);
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__library.mutex));
    size_t held = 0;
    for (int i = 0; i < n; i++) {
        if (devices[i]->gpu >= 0) continue;
        MGPU__PTHREAD_CHECK(pthread_mutex_lock(&devices[i]->alloc_mutex));
        held += devices[i]->in_use + devices[i]->cached;
        MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&devices[i]->alloc_mutex));
    }
    double machine = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
    if ((double)held + (double)bytes > machine)
        mgpu_fatal("out of host memory on %s: asked for %.1f MiB with %.1f MiB held by the CPU devices; "
                   "the machine has %.1f MiB", d->name, bytes / 1048576.0, held / 1048576.0, machine / 1048576.0);
}

/* The category that the calling thread's allocations count under (see
   mgpu__memory_scope). */
static __thread int mgpu__memory_category;
/* Makes this thread's allocations count under category c until the
   returned category is given back to it. */
static int mgpu__memory_scope(mgpu_memory_category c) {
    int before = mgpu__memory_category;
    mgpu__memory_category = (int)c;
    return before;
}

/* An allocation that cannot be had (why: past what): one line, with the
   device's largest holders. */
static void mgpu__out_of_memory(const mgpu_device *d, size_t bytes, int category, const char *why) {
    char holders[256] = "";
    int order[MGPU_MEMORY_CATEGORIES], at = 0;
    for (int c = 0; c < MGPU_MEMORY_CATEGORIES; c++) order[c] = c;
    for (int i = 0; i < MGPU_MEMORY_CATEGORIES; i++) /* largest first */
        for (int j = i + 1; j < MGPU_MEMORY_CATEGORIES; j++)
            if (d->held[order[j]] > d->held[order[i]]) {
                int t = order[i];
                order[i] = order[j];
                order[j] = t;
            }
    for (int i = 0; i < 3 && d->held[order[i]] > 0; i++)
        at += snprintf(holders + at, sizeof holders - (size_t)at, "%s%s %.1f MiB", i ? ", " : "",
                       mgpu_memory_category_name((mgpu_memory_category)order[i]), d->held[order[i]] / 1048576.0);
    mgpu_fatal("out of memory on %s: asked for %.1f MiB (%s) with %.1f MiB in use, past %s; the largest "
               "holders: %s%s%s", d->name, bytes / 1048576.0, mgpu_memory_category_name((mgpu_memory_category)category),
               d->in_use / 1048576.0, why, at ? holders : "none", MGPU__IN_LAYER(mgpu__layer_enqueuing));
}

static void *mgpu__raw_alloc(mgpu_device *d, size_t bytes, int pinned) {
    void *p = NULL;
#if MGPU_CUDA
    if (d->gpu >= 0) {
        MGPU_CUDA_CHECK(cudaSetDevice(d->gpu));
        cudaError_t err = cudaMalloc(&p, bytes);
        if (err != cudaSuccess) {
            char why[96];
            snprintf(why, sizeof why, "what the GPU has (cudaMalloc: %s)", cudaGetErrorString(err));
            mgpu__out_of_memory(d, bytes, mgpu__memory_category, why);
        }
        return p;
    }
    if (pinned && mgpu__library.num_gpus > 0) {
        MGPU_CUDA_CHECK(cudaMallocHost(&p, bytes));
        return p;
    }
#else
    (void)pinned;
#endif
    mgpu__require_host_memory(d, bytes);
    if (posix_memalign(&p, 64, bytes))
        mgpu_fatal("out of host memory on %s: asked for %.1f MiB", d->name, bytes / 1048576.0);
    return p;
}

static void mgpu__raw_free(mgpu_device *d, void *p, int pinned) {
#if MGPU_CUDA
    if (d->gpu >= 0) {
        MGPU_CUDA_CHECK(cudaFree(p));
        return;
    }
    if (pinned && mgpu__library.num_gpus > 0) {
        MGPU_CUDA_CHECK(cudaFreeHost(p));
        return;
    }
#else
    (void)d;
    (void)pinned;
#endif
    free(p);
}

/* Counts bytes taken (taken 1) or given back (0) under category c, and
   the peaks, with d's allocation mutex held. */
static void mgpu__memory_count(mgpu_device *d, int c, size_t bytes, int taken) {
    if (taken) {
        d->in_use += bytes;
        d->held[c] += bytes;
        if (d->held[c] > d->held_peak[c]) d->held_peak[c] = d->held[c];
        if (d->in_use > d->peak) {
            d->peak = d->in_use;
            memcpy(d->held_at_peak, d->held, sizeof d->held);
        }
    } else {
        d->in_use -= bytes;
        d->held[c] -= bytes;
    }
    if (d->recording && d->nsamples < (1 << 20)) {
        if (d->nsamples == d->samples_room) {
            d->samples_room = 2 * d->samples_room + 1024;
            d->samples = (mgpu_memory_sample *)mgpu__xrealloc(d->samples, d->samples_room * sizeof *d->samples);
        }
        mgpu_memory_sample *s = &d->samples[d->nsamples++];
        s->seconds = mgpu_now();
        s->in_use = d->in_use;
        memcpy(s->held, d->held, sizeof d->held);
    }
}
/* Moves tensor t's bytes to category c (a parameter made by a caller,
   then registered). */
static void mgpu__memory_recount(mgpu_tensor *t, mgpu_memory_category c) {
    if (!t->block || t->block->category == (int)c) return;
    mgpu_device *d = t->device;
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&d->alloc_mutex));
    mgpu__memory_count(d, t->block->category, t->block->bytes, 0);
    t->block->category = (int)c;
    mgpu__memory_count(d, (int)c, t->block->bytes, 1);
    if (d->in_use == d->peak) memcpy(d->held_at_peak, d->held, sizeof d->held); /* (the peak's, recounted) */
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&d->alloc_mutex));
}

static mgpu__block *mgpu__block_alloc(mgpu_device *d, size_t bytes, int pinned) {
    bytes = mgpu__round_bytes(bytes);
    /* the bytes counted before they are taken, under the mutex, so that
       two threads cannot both pass the limit's check */
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&d->alloc_mutex));
    int over = d->limit && d->in_use + bytes > d->limit;
    if (!over) mgpu__memory_count(d, mgpu__memory_category, bytes, 1);
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&d->alloc_mutex));
    if (over) {
        char why[96];
        snprintf(why, sizeof why, "its limit of %.1f MiB (mgpu_device_set_memory_limit)", d->limit / 1048576.0);
        mgpu__out_of_memory(d, bytes, mgpu__memory_category, why);
    }
    mgpu__block *b = NULL;
    if (!pinned) {
        MGPU__PTHREAD_CHECK(pthread_mutex_lock(&d->alloc_mutex));
        for (mgpu__block **link = &d->cache; *link; link = &(*link)->next) {
            if ((*link)->bytes == bytes) {
                b = *link;
                *link = b->next;
                d->cached -= bytes;
                break;
            }
        }
        MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&d->alloc_mutex));
    }
    if (b && b->pending) {
        /* A copy may still be reading this block: the compute queue waits. */
        mgpu__event_wait_on(&d->queue[0], b->pending);
        mgpu__event_wait_on(&d->queue[1], b->pending);
        mgpu_event_free(b->pending);
        b->pending = NULL;
    }
    int fresh = !b;
    if (fresh) {
        b = (mgpu__block *)mgpu__xcalloc(1, sizeof *b);
        b->bytes = bytes;
        b->ptr = mgpu__raw_alloc(d, bytes, pinned);
    }
    b->category = mgpu__memory_category;
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&d->alloc_mutex));
    d->allocations += (size_t)fresh;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&d->alloc_mutex));
    return b;
}

static void mgpu__block_release(mgpu_device *d, mgpu__block *b, int pinned, mgpu_event *pending) {
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&d->alloc_mutex));
    mgpu__memory_count(d, b->category, b->bytes, 0);
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&d->alloc_mutex));
    if (pinned) {
        /* Pinned host memory is rare and large: give it straight back, once
           nothing reads it. */
        if (pending) mgpu_event_synchronize(pending);
        mgpu_event_free(pending);
        mgpu_synchronize(d);
        mgpu__raw_free(d, b->ptr, 1);
        free(b);
        return;
    }
    b->pending = pending;
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&d->alloc_mutex));
    b->next = d->cache;
    d->cache = b;
    d->cached += b->bytes;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&d->alloc_mutex));
}

static void mgpu__allocator_release(mgpu_device *d) {
    while (d->cache) {
        mgpu__block *b = d->cache;
        d->cache = b->next;
        mgpu_event_free(b->pending);
        mgpu__raw_free(d, b->ptr, 0);
        free(b);
    }
    d->cached = 0;
    free(d->samples);
    d->samples = NULL;
    d->nsamples = d->samples_room = 0;
}

static void mgpu__require_category(mgpu_memory_category c, const char *op) {
    MGPU_REQUIRE((int)c >= 0 && c < MGPU_MEMORY_CATEGORIES, "%s: memory category %d does not exist", op, (int)c);
}
MGPU_DEF const char *mgpu_memory_category_name(mgpu_memory_category c) {
    static const char *const names[MGPU_MEMORY_CATEGORIES] = {"other", "parameters", "gradients",
                                                              "optimizer state", "activations", "workspace"};
    mgpu__require_category(c, "mgpu_memory_category_name");
    return names[c];
}
