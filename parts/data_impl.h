/* ======================================================================
   Data: the IDX reader, the data set and the loaders (see "Data" above)
   ======================================================================
   The reader trusts nothing in a file: every size it reads is checked
   against what the file can hold before memory is allocated or bytes are
   read, and every read is checked for errors, so a bad file gives one line
   naming it and the problem, never a crash or a read past the end. */
#include <limits.h>
#include <sys/stat.h>
#include <zlib.h>

/* ------------------------------------------------------------ IDX files */
typedef struct mgpu__idx_file {
    const char *path;
    gzFile gz;
    long long disk_bytes; /* the file's size on disk (compressed or not) */
} mgpu__idx_file;

static void mgpu__idx_fail(const mgpu__idx_file *f, const char *fmt, ...) MGPU__PRINTF(2, 3);
static void mgpu__idx_fail(const mgpu__idx_file *f, const char *fmt, ...) {
    char problem[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(problem, sizeof problem, fmt, ap);
    va_end(ap);
    mgpu_fatal("%s: %s", f->path, problem);
}

/* Opens path for reading: a regular file, gzip-compressed or not. */
static mgpu__idx_file mgpu__idx_open(const char *path) {
    mgpu__idx_file f;
    f.path = path;
    f.gz = NULL;
    struct stat st;
    if (stat(path, &st) != 0) mgpu__idx_fail(&f, "cannot open (%s)", strerror(errno));
    if (S_ISDIR(st.st_mode)) mgpu__idx_fail(&f, "is a directory, not an IDX file");
    if (!S_ISREG(st.st_mode)) mgpu__idx_fail(&f, "is not a regular file");
    f.disk_bytes = (long long)st.st_size;
    f.gz = gzopen(path, "rb");
    if (!f.gz) mgpu__idx_fail(&f, "cannot open (%s)", errno ? strerror(errno) : "out of memory");
    /* Large reads go faster through a larger buffer (zlib's default is 8 KiB). */
    if (gzbuffer(f.gz, 1 << 17) != 0) mgpu__idx_fail(&f, "cannot set up zlib's buffer");
    return f;
}

/* Reads up to n bytes; a zlib error (corrupt or cut gzip data) is fatal.
   Returns how many bytes there were before the end of the data. */
static size_t mgpu__idx_read_some(mgpu__idx_file *f, unsigned char *buf, size_t n) {
    size_t got = 0;
    while (got < n) {
        /* gzread takes and returns int-sized counts: read in chunks of 1 GiB. */
        size_t chunk = n - got < ((size_t)1 << 30) ? n - got : ((size_t)1 << 30);
        int r = gzread(f->gz, buf + got, (unsigned)chunk);
        int err = Z_OK;
        const char *msg = gzerror(f->gz, &err);
        /* zlib's message starts with the path, which ours already names. */
        size_t len = strlen(f->path);
        if (strncmp(msg, f->path, len) == 0 && strncmp(msg + len, ": ", 2) == 0) msg += len + 2;
        if (err == Z_BUF_ERROR)
            mgpu__idx_fail(f, "truncated gzip stream (%s)", msg);
        if (r < 0 || err != Z_OK)
            mgpu__idx_fail(f, "corrupt gzip data (%s)", err == Z_ERRNO ? strerror(errno) : msg);
        if (r == 0) break;
        got += (size_t)r;
    }
    return got;
}

/* Reads exactly n bytes of `what` ("images" or "labels"). */
static void mgpu__idx_read(mgpu__idx_file *f, unsigned char *buf, size_t n, const char *what) {
    size_t got = mgpu__idx_read_some(f, buf, n);
    if (got < n)
        mgpu__idx_fail(f, "truncated: the file ends in the middle of the %s (%zu of %zu bytes)",
                       what, got, n);
}

static uint32_t mgpu__big_endian32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

/* What a header announces, for messages: "5 images of 28x28" or "5 labels". */
static void mgpu__idx_announced(char *buf, size_t size, int ndims, const uint32_t *dims) {
    if (ndims == 3)
        snprintf(buf, size, "%u images of %ux%u", dims[0], dims[1], dims[2]);
    else
        snprintf(buf, size, "%u labels", dims[0]);
}

/* Reads a whole IDX file of unsigned bytes with ndims dimensions (3 for
   images: count, rows, cols; 1 for labels: count) into dims and a new
   buffer. The magic number is 0x00000800 + ndims: two zero bytes, the type
   (0x08, unsigned byte) and the number of dimensions. */
static unsigned char *mgpu__idx_load(const char *path, int ndims, uint32_t dims[3]) {
    const char *kind = ndims == 3 ? "images" : "labels";
    const uint32_t magic = 0x00000800u | (uint32_t)ndims;
    mgpu__idx_file f = mgpu__idx_open(path);

    /* The magic number first: a wrong file is named as such, even when it
       is too short for the header it should have. */
    unsigned char header[16] = {0};
    size_t header_bytes = 4 + 4 * (size_t)ndims;
    size_t got = mgpu__idx_read_some(&f, header, header_bytes);
    int compressed = !gzdirect(f.gz); /* zlib knows after the first read */
    uint32_t found = mgpu__big_endian32(header);
    if (got >= 4 && found != magic)
        mgpu__idx_fail(&f, "wrong magic number 0x%08x: not an IDX %s file (0x%08x)%s", found, kind,
                       magic, compressed ? "" : ", and not gzip-compressed either");
    if (got < header_bytes)
        mgpu__idx_fail(&f, "truncated: the file ends in the middle of the header (%zu of %zu bytes)",
                       got, header_bytes);
    for (int i = 0; i < ndims; i++) dims[i] = mgpu__big_endian32(header + 4 + 4 * i);
    if (dims[0] == 0) mgpu__idx_fail(&f, "holds no %s", kind);
    /* Sizes must fit the int fields of mgpu_dataset. */
    if (dims[0] > INT_MAX) mgpu__idx_fail(&f, "%u %s are too many (at most %d)", dims[0], kind, INT_MAX);
    if (ndims == 3 && (dims[1] == 0 || dims[2] == 0 || dims[1] > 65535 || dims[2] > 65535))
        mgpu__idx_fail(&f, "images of %ux%u pixels: each side must be 1 to 65535", dims[1], dims[2]);

    uint64_t payload = dims[0];
    for (int i = 1; i < ndims; i++) payload *= dims[i];
    char announced[96];
    mgpu__idx_announced(announced, sizeof announced, ndims, dims);
    /* Check the size before allocating: an uncompressed file must be
       exactly header + payload; a gzip file cannot hold more than 1032
       times its own size (deflate's largest ratio). */
    if (!compressed) {
        long long want = (long long)(header_bytes + payload);
        if (f.disk_bytes < want)
            mgpu__idx_fail(&f, "truncated: the header announces %s (%lld bytes in all), the file has %lld",
                           announced, want, f.disk_bytes);
        if (f.disk_bytes > want)
            mgpu__idx_fail(&f, "the file is longer than its header says: %lld bytes, %lld expected for %s",
                           f.disk_bytes, want, announced);
    } else if (payload / 1032 > (uint64_t)f.disk_bytes) {
        mgpu__idx_fail(&f, "the header announces %s (%llu bytes), more than a %lld-byte gzip file can hold",
                       announced, (unsigned long long)payload, f.disk_bytes);
    }
    unsigned char *data = (unsigned char *)mgpu__xmalloc((size_t)payload);
    mgpu__idx_read(&f, data, (size_t)payload, kind);
    /* One more byte must not be there. Reading it also makes zlib check the
       gzip trailer (CRC and length) of the data just read. */
    unsigned char extra;
    if (mgpu__idx_read_some(&f, &extra, 1) != 0)
        mgpu__idx_fail(&f, "the file is longer than its header says: more than %llu bytes of data for %s",
                       (unsigned long long)(header_bytes + payload), announced);
    int rc = gzclose(f.gz);
    if (rc != Z_OK) mgpu__idx_fail(&f, "cannot close (zlib error %d)", rc);
    return data;
}

/* ------------------------------------------------------------ data sets */
MGPU_DEF const char *mgpu_data_dir(const char *flag_dir) {
    if (flag_dir) return flag_dir;
    const char *env = getenv("MGPU_DATA");
    if (env && env[0]) return env;
    return "data/fashion-mnist";
}

MGPU_DEF mgpu_dataset *mgpu_dataset_load(const char *images_path, const char *labels_path) {
    uint32_t idims[3], ldims[3];
    unsigned char *images = mgpu__idx_load(images_path, 3, idims);
    unsigned char *labels = mgpu__idx_load(labels_path, 1, ldims);
    if (ldims[0] != idims[0])
        mgpu_fatal("%s: %u labels, but %s holds %u images", labels_path, ldims[0], images_path,
                   idims[0]);
    for (uint32_t i = 0; i < ldims[0]; i++)
        if (labels[i] > 9)
            mgpu_fatal("%s: label %d of sample %u is not in 0..9", labels_path, labels[i], i);
    mgpu_dataset *d = (mgpu_dataset *)mgpu__xcalloc(1, sizeof *d);
    d->n = (int)idims[0];
    d->rows = (int)idims[1];
    d->cols = (int)idims[2];
    d->images = images;
    d->labels = labels;
    return d;
}

/* dir/name.gz if it exists, else dir/name if it exists, into path; 0 if neither. */
static int mgpu__data_find(const char *dir, const char *name, char *path, size_t size) {
    static const char *const suffixes[2] = {".gz", ""};
    for (int i = 0; i < 2; i++) {
        struct stat st;
        int len = snprintf(path, size, "%s/%s%s", dir, name, suffixes[i]);
        MGPU_REQUIRE(len > 0 && (size_t)len < size, "data path too long: %s/%s", dir, name);
        if (stat(path, &st) == 0) return 1;
    }
    return 0;
}

static mgpu_dataset *mgpu__fashion_mnist_part(const char *dir, const char *prefix) {
    char names[2][64], paths[2][4096];
    snprintf(names[0], sizeof names[0], "%s-images-idx3-ubyte", prefix);
    snprintf(names[1], sizeof names[1], "%s-labels-idx1-ubyte", prefix);
    for (int i = 0; i < 2; i++)
        if (!mgpu__data_find(dir, names[i], paths[i], sizeof paths[i]))
            mgpu_fatal("Fashion-MNIST not found: no %s/%s.gz nor %s/%s (the folder comes from "
                       "--data, else $MGPU_DATA, else data/fashion-mnist); `make data` fetches "
                       "the data set",
                       dir, names[i], dir, names[i]);
    mgpu_dataset *d = mgpu_dataset_load(paths[0], paths[1]);
    if (d->rows != 28 || d->cols != 28)
        mgpu_fatal("%s: images of %dx%d pixels; Fashion-MNIST's are 28x28", paths[0], d->rows,
                   d->cols);
    return d;
}

MGPU_DEF void mgpu_dataset_load_fashion_mnist(const char *dir, mgpu_dataset **train,
                                              mgpu_dataset **test) {
    if (!dir) dir = mgpu_data_dir(NULL);
    if (train) *train = mgpu__fashion_mnist_part(dir, "train");
    if (test) *test = mgpu__fashion_mnist_part(dir, "t10k");
}

MGPU_DEF mgpu_dataset *mgpu_dataset_subset(const mgpu_dataset *d, int n) {
    MGPU_REQUIRE(n >= 1, "mgpu_dataset_subset: n is %d; take at least one sample", n);
    if (n > d->n) n = d->n;
    size_t pixels = (size_t)d->rows * (size_t)d->cols;
    mgpu_dataset *s = (mgpu_dataset *)mgpu__xcalloc(1, sizeof *s);
    *s = *d;
    s->n = n;
    s->images = (unsigned char *)mgpu__xmalloc((size_t)n * pixels);
    s->labels = (unsigned char *)mgpu__xmalloc((size_t)n);
    memcpy(s->images, d->images, (size_t)n * pixels);
    memcpy(s->labels, d->labels, (size_t)n);
    return s;
}

MGPU_DEF void mgpu_dataset_free(mgpu_dataset *d) {
    if (!d) return;
    free(d->images);
    free(d->labels);
    free(d);
}

MGPU_DEF const char *mgpu_fashion_mnist_label(int k) {
    static const char *const names[10] = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                          "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"};
    MGPU_REQUIRE(k >= 0 && k < 10, "mgpu_fashion_mnist_label: %d is not a class (0..9)", k);
    return names[k];
}

/* ------------------------------------------------------------- loaders
   A producer/consumer pair around a ring of MGPU__LOADER_RING batch
   buffers. Batch k of an epoch goes into slot k % RING. The loader thread
   (the producer) fills batch k once the program (the consumer) has
   released batch k - RING, so with 3 slots it works up to two batches
   ahead of the one the program holds. The program releases a batch when
   it asks for the next one.

   Released is not the same as unused: the program may have enqueued work
   that still reads the batch. Only two kinds of queue can read host
   memory: a copy queue (mgpu_copy of the batch, or of a view of it, onto
   any device) and the compute queue of the CPU device the buffers live
   on. So a release puts a fence in the slot: an event recorded on each of
   those queues at that moment. The producer waits for the fence before it
   overwrites the slot; it never waits for work enqueued after the
   release, so it stays ahead. */
#define MGPU__LOADER_RING 3
#define MGPU__LOADER_FENCE (MGPU_MAX_DEVICES * 4 + 1) /* every copy queue, and cpu's compute queue */

typedef struct mgpu__loader_fence {
    int n;
    mgpu_event *events[MGPU__LOADER_FENCE];
} mgpu__loader_fence;

struct mgpu_loader {
    const mgpu_dataset *data;
    int batch_size, capacity; /* capacity: rows of a buffer, min(batch_size, n) */
    int shuffle, nbatches;
    uint64_t seed;
    int *order;               /* the epoch's order of the samples */
    mgpu_tensor *x[MGPU__LOADER_RING], *y[MGPU__LOADER_RING];
    mgpu__loader_fence fence[MGPU__LOADER_RING];
    mgpu_tensor *short_x, *short_y; /* views exposing a short last batch */
    pthread_t thread;
    pthread_mutex_t mutex;
    pthread_cond_t changed;
    /* Under the mutex. Batches [0, produced) of the epoch are ready,
       [0, handed) were given out and [0, released) given back. */
    int active, produced, handed, released;
    int filling;              /* the producer is writing a slot */
    int stop;
};

/* The order of the samples in epoch `epoch`: a Fisher-Yates shuffle whose
   random words come from Philox under a key made from (seed, epoch), so
   the order depends on nothing else. Step t (swapping position n-1-t with
   a position j in 0..n-1-t) uses word t: counter t / 4, word t % 4.
   j = word * (i + 1) / 2^32 is uniform up to a bias below (i + 1) / 2^32,
   under 2e-5 for 60000 samples: far below what training could notice. */
static void mgpu__loader_shuffle(int *order, int n, uint64_t seed, int epoch) {
    uint32_t r[4];
    mgpu_philox(seed, (uint64_t)epoch, r);
    uint64_t key = (uint64_t)r[0] | (uint64_t)r[1] << 32;
    for (int i = 0; i < n; i++) order[i] = i;
    for (int i = n - 1, t = 0; i > 0; i--, t++) {
        if (t % 4 == 0) mgpu_philox(key, (uint64_t)t / 4, r);
        int j = (int)(((uint64_t)r[t % 4] * (uint64_t)(i + 1)) >> 32);
        int tmp = order[i];
        order[i] = order[j];
        order[j] = tmp;
    }
}

/* Samples in batch k: batch_size, except for a shorter last batch. */
static int mgpu__loader_batch_n(const mgpu_loader *l, int k) {
    int left = l->data->n - k * l->batch_size;
    return left < l->batch_size ? left : l->batch_size;
}

/* The program's side: marks "now" on every queue that may read the slot. */
static void mgpu__loader_fence_record(mgpu__loader_fence *f) {
    mgpu_device *cpu = mgpu_cpu();
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&mgpu__g.mutex));
    int ndevices = mgpu__g.ndevices;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__g.mutex));
    for (; f->n < ndevices + 1; f->n++) f->events[f->n] = mgpu_event_new();
    for (int i = 0; i < ndevices; i++) mgpu__event_record_on(f->events[i], &mgpu__g.devices[i]->queue[1]);
    mgpu__event_record_on(f->events[ndevices], &cpu->queue[0]);
}

/* The loader thread's side: waits until those queues have passed the marks. */
static void mgpu__loader_fence_wait(mgpu__loader_fence *f) {
    for (int i = 0; i < f->n; i++) mgpu_event_synchronize(f->events[i]);
}

/* The producer's work: batch k into its slot, as ToTensor would (byte / 255). */
static void mgpu__loader_fill(mgpu_loader *l, int k) {
    int slot = k % MGPU__LOADER_RING;
    mgpu__loader_fence_wait(&l->fence[slot]);
    const mgpu_dataset *d = l->data;
    size_t pixels = (size_t)d->rows * (size_t)d->cols;
    int n = mgpu__loader_batch_n(l, k);
    for (int i = 0; i < n; i++) {
        int sample = l->order[k * l->batch_size + i];
        const unsigned char *src = d->images + (size_t)sample * pixels;
        float *dst = l->x[slot]->data + (size_t)i * pixels;
        for (size_t p = 0; p < pixels; p++) dst[p] = (float)src[p] / 255.0f;
        l->y[slot]->data[i] = (float)d->labels[sample];
    }
}

static void *mgpu__loader_thread(void *arg) {
    mgpu_loader *l = (mgpu_loader *)arg;
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&l->mutex));
    for (;;) {
        while (!l->stop && !(l->active && l->produced < l->nbatches &&
                             l->produced - l->released < MGPU__LOADER_RING))
            MGPU__PTHREAD_CHECK(pthread_cond_wait(&l->changed, &l->mutex));
        if (l->stop) break;
        int k = l->produced;
        l->filling = 1;
        MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&l->mutex));
        mgpu__loader_fill(l, k);
        MGPU__PTHREAD_CHECK(pthread_mutex_lock(&l->mutex));
        l->filling = 0;
        l->produced++;
        MGPU__PTHREAD_CHECK(pthread_cond_broadcast(&l->changed));
    }
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&l->mutex));
    return NULL;
}

MGPU_DEF mgpu_loader *mgpu_loader_new(const mgpu_dataset *d, int batch_size, int shuffle,
                                      uint64_t seed) {
    MGPU_REQUIRE(d && d->n >= 1, "mgpu_loader_new: the data set is empty");
    MGPU_REQUIRE(batch_size >= 1, "mgpu_loader_new: batch size %d; it must be at least 1",
                 batch_size);
    mgpu_loader *l = (mgpu_loader *)mgpu__xcalloc(1, sizeof *l);
    l->data = d;
    l->batch_size = batch_size;
    l->capacity = batch_size < d->n ? batch_size : d->n;
    l->shuffle = shuffle;
    l->nbatches = (int)(((long long)d->n + batch_size - 1) / batch_size);
    l->seed = seed;
    l->order = (int *)mgpu__xmalloc((size_t)d->n * sizeof(int));
    for (int i = 0; i < d->n; i++) l->order[i] = i;
    /* Allocated here, on the program's thread, like every tensor. */
    for (int s = 0; s < MGPU__LOADER_RING; s++) {
        l->x[s] = mgpu_empty_pinned(mgpu_shape4(l->capacity, 1, d->rows, d->cols));
        l->y[s] = mgpu_empty_pinned(mgpu_shape1(l->capacity));
    }
    MGPU__PTHREAD_CHECK(pthread_mutex_init(&l->mutex, NULL));
    MGPU__PTHREAD_CHECK(pthread_cond_init(&l->changed, NULL));
    MGPU__PTHREAD_CHECK(pthread_create(&l->thread, NULL, mgpu__loader_thread, l));
    return l;
}

/* Under the mutex: gives back the batch the program holds, if any. The
   views of a short last batch go with it (copies from them are covered by
   the fence). */
static void mgpu__loader_release_held(mgpu_loader *l) {
    mgpu_free(l->short_x);
    mgpu_free(l->short_y);
    l->short_x = l->short_y = NULL;
    if (l->handed == l->released) return;
    mgpu__loader_fence_record(&l->fence[(l->handed - 1) % MGPU__LOADER_RING]);
    l->released = l->handed;
    MGPU__PTHREAD_CHECK(pthread_cond_broadcast(&l->changed));
}

MGPU_DEF void mgpu_loader_start_epoch(mgpu_loader *l, int epoch) {
    MGPU_REQUIRE(epoch >= 0, "mgpu_loader_start_epoch: epoch %d is negative", epoch);
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&l->mutex));
    mgpu__loader_release_held(l);
    /* The producer may be writing a batch of the old epoch: let it finish
       before the order changes under it. */
    while (l->filling) MGPU__PTHREAD_CHECK(pthread_cond_wait(&l->changed, &l->mutex));
    if (l->shuffle) mgpu__loader_shuffle(l->order, l->data->n, l->seed, epoch);
    l->active = 1;
    l->produced = l->handed = l->released = 0;
    MGPU__PTHREAD_CHECK(pthread_cond_broadcast(&l->changed));
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&l->mutex));
}

MGPU_DEF int mgpu_loader_next(mgpu_loader *l, mgpu_batch *out) {
    /* `active` is written by this thread only: no lock needed to read it. */
    MGPU_REQUIRE(l->active, "mgpu_loader_next: no epoch started; call mgpu_loader_start_epoch first");
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&l->mutex));
    mgpu__loader_release_held(l);
    if (l->handed == l->nbatches) {
        MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&l->mutex));
        return 0;
    }
    while (l->produced <= l->handed)
        MGPU__PTHREAD_CHECK(pthread_cond_wait(&l->changed, &l->mutex));
    int k = l->handed++;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&l->mutex));
    int slot = k % MGPU__LOADER_RING;
    out->n = mgpu__loader_batch_n(l, k);
    out->x = l->x[slot];
    out->y = l->y[slot];
    if (out->n < l->capacity) {
        out->x = l->short_x = mgpu_narrow(l->x[slot], 0, out->n);
        out->y = l->short_y = mgpu_narrow(l->y[slot], 0, out->n);
    }
    return 1;
}

MGPU_DEF int mgpu_loader_num_batches(const mgpu_loader *l) { return l->nbatches; }

MGPU_DEF void mgpu_loader_free(mgpu_loader *l) {
    if (!l) return;
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&l->mutex));
    mgpu__loader_release_held(l);
    l->stop = 1;
    MGPU__PTHREAD_CHECK(pthread_cond_broadcast(&l->changed));
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&l->mutex));
    MGPU__PTHREAD_CHECK(pthread_join(l->thread, NULL));
    /* Work the program enqueued on the batches must end before their memory goes. */
    for (int s = 0; s < MGPU__LOADER_RING; s++) {
        mgpu__loader_fence_wait(&l->fence[s]);
        for (int i = 0; i < l->fence[s].n; i++) mgpu_event_free(l->fence[s].events[i]);
        mgpu_free(l->x[s]);
        mgpu_free(l->y[s]);
    }
    pthread_mutex_destroy(&l->mutex);
    pthread_cond_destroy(&l->changed);
    free(l->order);
    free(l);
}
