/* mgpu/data.h: data. The IDX reader (Fashion-MNIST's files, gzipped or
   not, checked as they are read), data sets in memory, samplers (the
   distributed sampler that gives each rank its share of an epoch) and
   loaders that make batches on a device. Chapters 2 to 6 train on it.
   defines: mgpu_data_dir, mgpu_dataset_load,
   mgpu_dataset_load_fashion_mnist, mgpu_dataset_truncate,
   mgpu_dataset_subset, mgpu_dataset_digest, mgpu_dataset_free,
   mgpu_fashion_mnist_label, mgpu_sampler_new, mgpu_sampler_set_epoch,
   mgpu_sampler_num_samples, mgpu_sampler_total_size,
   mgpu_sampler_indices, mgpu_sampler_free, mgpu_loader_new,
   mgpu_loader_start_epoch, mgpu_loader_start_epoch_at, mgpu_loader_next,
   mgpu_loader_num_batches, mgpu_loader_set_drop_last,
   mgpu_loader_set_sampler, mgpu_loader_free */
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

enum { MGPU__GZ_BUFFER = 1 << 17 };
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
    if (gzbuffer(f.gz, MGPU__GZ_BUFFER) != 0) mgpu__idx_fail(&f, "cannot set up zlib's buffer");
    return f;
}

/* Reads up to n bytes; a zlib error (corrupt or cut gzip data) is fatal.
   Returns how many bytes there were before the end of the data. */
static size_t mgpu__idx_read_some(mgpu__idx_file *f, unsigned char *buf, size_t n) {
    size_t got = 0;
    while (got < n) {
        /* In chunks of half zlib's buffer (set in mgpu__idx_open): a read
           larger than the buffer inflates straight into buf, and that way
           zlib lets a stream cut just before its trailer (CRC and length)
           pass unnoticed. */
        size_t chunk = n - got < MGPU__GZ_BUFFER / 2 ? n - got : MGPU__GZ_BUFFER / 2;
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
        /* only a file that is not there sends us on to the next name */
        if (errno != ENOENT) mgpu_fatal("%s: cannot open (%s)", path, strerror(errno));
        if (lstat(path, &st) == 0) mgpu_fatal("%s: a link to a file that is not there", path);
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
    struct stat st;
    if (stat(dir, &st) != 0)
        mgpu_fatal("Fashion-MNIST not found: cannot open the folder %s (%s); it comes from --data, else "
                   "$MGPU_DATA, else data/fashion-mnist, and `make data` fetches the data set",
                   dir, strerror(errno));
    if (!S_ISDIR(st.st_mode))
        mgpu_fatal("%s: not a folder (Fashion-MNIST's folder comes from --data, else $MGPU_DATA, else "
                   "data/fashion-mnist)", dir);
    if (train) *train = mgpu__fashion_mnist_part(dir, "train");
    if (test) *test = mgpu__fashion_mnist_part(dir, "t10k");
}

MGPU_DEF void mgpu_dataset_truncate(mgpu_dataset *d, int n) {
    if (n > 0 && n < d->n) d->n = n;
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

/* 64-bit FNV-1a: simple, and any flipped byte changes it. */
static uint64_t mgpu__fnv1a(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = (const unsigned char *)data;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}
#define MGPU__FNV_OFFSET 0xcbf29ce484222325ull

MGPU_DEF uint64_t mgpu_dataset_digest(const mgpu_dataset *d) {
    int size[3] = {d->n, d->rows, d->cols};
    uint64_t h = mgpu__fnv1a(MGPU__FNV_OFFSET, size, sizeof size);
    h = mgpu__fnv1a(h, d->images, (size_t)d->n * (size_t)d->rows * (size_t)d->cols);
    return mgpu__fnv1a(h, d->labels, (size_t)d->n);
}

MGPU_DEF const char *mgpu_fashion_mnist_label(int k) {
    static const char *const names[10] = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                          "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"};
    MGPU_REQUIRE(k >= 0 && k < 10, "mgpu_fashion_mnist_label: %d is not a class (0..9)", k);
    return names[k];
}

/* ------------------------------------------------------------ samplers */
/* The shuffled order of the samples in epoch `epoch`, a shuffling
   loader's and a sampler's: a Fisher-Yates shuffle whose random words
   come from Philox under a key made from (seed, epoch), so the order
   depends on nothing else. Step t (swapping position n-1-t with
   a position j in 0..n-1-t) uses word t: counter t / 4, word t % 4.
   j = word * (i + 1) / 2^32 is uniform up to a bias below (i + 1) / 2^32,
   under 2e-5 for 60000 samples: far below what training could notice. */
static void mgpu__shuffled_order(int *order, int n, uint64_t seed, int epoch) {
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

struct mgpu_sampler {
    int n, world, rank, shuffle;
    int num_samples, epoch;
    uint64_t seed;
    int *order; /* the epoch's order of all n samples (mgpu_sampler_indices' room) */
};

MGPU_DEF mgpu_sampler *mgpu_sampler_new(int n, int world, int rank, int shuffle, uint64_t seed,
                                        int drop_last) {
    MGPU_REQUIRE(n >= 1, "mgpu_sampler_new: %d samples; it needs at least 1", n);
    MGPU_REQUIRE(world >= 1, "mgpu_sampler_new: world size %d; it must be at least 1", world);
    MGPU_REQUIRE(rank >= 0 && rank < world, "mgpu_sampler_new: rank %d is not in 0..%d (world size %d)", rank,
                 world - 1, world);
    MGPU_REQUIRE((shuffle == 0 || shuffle == 1) && (drop_last == 0 || drop_last == 1),
                 "mgpu_sampler_new: shuffle %d and drop_last %d; want 0 or 1 each", shuffle, drop_last);
    /* torch's ceil((n - world) / world) with drop_last, where world does
       not divide n, is floor(n / world), which is also its value where it
       does; without, ceil(n / world). */
    long long per_rank = drop_last ? n / world : ((long long)n + world - 1) / world;
    MGPU_REQUIRE(per_rank * world <= INT_MAX,
                 "mgpu_sampler_new: %d samples on %d ranks make an order of %lld, more than an int counts", n,
                 world, per_rank * world);
    mgpu_sampler *s = (mgpu_sampler *)mgpu__xcalloc(1, sizeof *s);
    s->n = n;
    s->world = world;
    s->rank = rank;
    s->shuffle = shuffle;
    s->num_samples = (int)per_rank;
    s->seed = seed;
    s->order = (int *)mgpu__xmalloc((size_t)n * sizeof(int));
    for (int i = 0; i < n; i++) s->order[i] = i;
    return s;
}

MGPU_DEF void mgpu_sampler_set_epoch(mgpu_sampler *s, int epoch) {
    MGPU_REQUIRE(epoch >= 0, "mgpu_sampler_set_epoch: epoch %d is negative", epoch);
    s->epoch = epoch;
}

MGPU_DEF int mgpu_sampler_num_samples(const mgpu_sampler *s) { return s->num_samples; }
MGPU_DEF int mgpu_sampler_total_size(const mgpu_sampler *s) { return s->num_samples * s->world; }

/* Position p of the order made total_size long is order[p % n], whether
   it was cut (p < n) or went on from the start (torch's indices +=
   indices[:padding], repeated as often as needed). */
MGPU_DEF void mgpu_sampler_indices(mgpu_sampler *s, int *out) {
    if (s->shuffle) mgpu__shuffled_order(s->order, s->n, s->seed, s->epoch);
    for (int i = 0; i < s->num_samples; i++) out[i] = s->order[(s->rank + i * s->world) % s->n];
}

MGPU_DEF void mgpu_sampler_free(mgpu_sampler *s) {
    if (!s) return;
    free(s->order);
    free(s);
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
    int shuffle, drop_last;
    mgpu_sampler *sampler;    /* NULL: every sample of the data set */
    int count, nbatches;      /* samples and batches an epoch */
    uint64_t seed;
    int *order;               /* the epoch's order of its samples */
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

/* The batches' tensors are the loader's: mgpu_free refuses them. */
#define MGPU__LOADERS_OWN "its loader (a batch of mgpu_loader_next)"
static void mgpu__loader_free_own(mgpu_tensor *t) {
    if (t) t->owner = NULL;
    mgpu_free(t);
}

/* An epoch's samples (the data set's, or the sampler's share of them)
   and its batches: with drop_last, whole ones only. */
static void mgpu__loader_count(mgpu_loader *l) {
    l->count = l->sampler ? l->sampler->num_samples : l->data->n;
    l->nbatches = (int)(l->drop_last ? l->count / l->batch_size
                                     : ((long long)l->count + l->batch_size - 1) / l->batch_size);
}

/* Samples in batch k: batch_size, except for a shorter last batch. */
static int mgpu__loader_batch_n(const mgpu_loader *l, int k) {
    int left = l->count - k * l->batch_size;
    return left < l->batch_size ? left : l->batch_size;
}

/* The program's side: marks "now" on every queue that may read the slot. */
static void mgpu__loader_fence_record(mgpu__loader_fence *f) {
    mgpu_device *cpu = mgpu_cpu();
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&mgpu__library.mutex));
    int ndevices = mgpu__library.ndevices;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__library.mutex));
    for (; f->n < ndevices + 1; f->n++) f->events[f->n] = mgpu_event_new();
    for (int i = 0; i < ndevices; i++)
        mgpu__event_record_on(f->events[i], &mgpu__library.devices[i]->queue[1]);
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
    mgpu__loader_count(l);
    l->seed = seed;
    l->order = (int *)mgpu__xmalloc((size_t)d->n * sizeof(int));
    for (int i = 0; i < d->n; i++) l->order[i] = i;
    /* Allocated here, on the program's thread, like every tensor. */
    for (int s = 0; s < MGPU__LOADER_RING; s++) {
        l->x[s] = mgpu_empty_pinned(mgpu_shape4(l->capacity, 1, d->rows, d->cols));
        l->y[s] = mgpu_empty_pinned(mgpu_shape1(l->capacity));
        l->x[s]->owner = l->y[s]->owner = MGPU__LOADERS_OWN;
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
    mgpu__loader_free_own(l->short_x);
    mgpu__loader_free_own(l->short_y);
    l->short_x = l->short_y = NULL;
    if (l->handed == l->released) return;
    mgpu__loader_fence_record(&l->fence[(l->handed - 1) % MGPU__LOADER_RING]);
    l->released = l->handed;
    MGPU__PTHREAD_CHECK(pthread_cond_broadcast(&l->changed));
}

/* Batch k of an epoch is the same whichever batch it started at: the
   order is the epoch's, and batch k goes into slot k % RING as ever. */
static void mgpu__loader_start(mgpu_loader *l, int epoch, int first_batch, const char *who) {
    MGPU_REQUIRE(epoch >= 0, "%s: epoch %d is negative", who, epoch);
    MGPU_REQUIRE(first_batch >= 0 && first_batch <= l->nbatches,
                 "%s: first batch %d is not in 0..%d (the epoch's batches)", who, first_batch, l->nbatches);
    MGPU_REQUIRE(!l->sampler || l->sampler->epoch == epoch,
                 "%s: epoch %d, but its sampler is set to epoch %d: call mgpu_sampler_set_epoch(sampler, "
                 "epoch) before each epoch (as DistributedSampler.set_epoch), or every epoch repeats one order",
                 who, epoch, l->sampler ? l->sampler->epoch : 0);
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&l->mutex));
    mgpu__loader_release_held(l);
    /* The producer may be writing a batch of the old epoch: let it finish
       before the order changes under it. */
    while (l->filling) MGPU__PTHREAD_CHECK(pthread_cond_wait(&l->changed, &l->mutex));
    if (l->sampler) mgpu_sampler_indices(l->sampler, l->order);
    else if (l->shuffle) mgpu__shuffled_order(l->order, l->data->n, l->seed, epoch);
    l->active = 1;
    l->produced = l->handed = l->released = first_batch;
    MGPU__PTHREAD_CHECK(pthread_cond_broadcast(&l->changed));
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&l->mutex));
}
MGPU_DEF void mgpu_loader_start_epoch(mgpu_loader *l, int epoch) {
    mgpu__loader_start(l, epoch, 0, "mgpu_loader_start_epoch");
}
MGPU_DEF void mgpu_loader_start_epoch_at(mgpu_loader *l, int epoch, int first_batch) {
    mgpu__loader_start(l, epoch, first_batch, "mgpu_loader_start_epoch_at");
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
        l->short_x->owner = l->short_y->owner = MGPU__LOADERS_OWN;
    }
    return 1;
}

MGPU_DEF int mgpu_loader_num_batches(const mgpu_loader *l) { return l->nbatches; }

/* Settings that change an epoch's counts come before the first epoch:
   the loader thread reads the counts only once `active` is set (by this
   thread alone), so no lock is needed here. */
MGPU_DEF void mgpu_loader_set_drop_last(mgpu_loader *l, int drop_last) {
    MGPU_REQUIRE(drop_last == 0 || drop_last == 1, "mgpu_loader_set_drop_last: drop_last %d; want 0 or 1",
                 drop_last);
    MGPU_REQUIRE(!l->active, "mgpu_loader_set_drop_last: the loader's first epoch has started; set it before");
    l->drop_last = drop_last;
    mgpu__loader_count(l);
}

MGPU_DEF void mgpu_loader_set_sampler(mgpu_loader *l, mgpu_sampler *s) {
    MGPU_REQUIRE(s, "mgpu_loader_set_sampler: the sampler is NULL");
    MGPU_REQUIRE(s->n == l->data->n, "mgpu_loader_set_sampler: the sampler is for %d samples, the data set has %d",
                 s->n, l->data->n);
    MGPU_REQUIRE(!l->shuffle,
                 "mgpu_loader_set_sampler: the loader shuffles, and the sampler gives the order; make the loader "
                 "with shuffle 0 (as DataLoader refuses shuffle=True with a sampler)");
    MGPU_REQUIRE(!l->active, "mgpu_loader_set_sampler: the loader's first epoch has started; set it before");
    l->sampler = s;
    mgpu__loader_count(l);
}

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
        mgpu__loader_free_own(l->x[s]);
        mgpu__loader_free_own(l->y[s]);
    }
    pthread_mutex_destroy(&l->mutex);
    pthread_cond_destroy(&l->changed);
    free(l->order);
    free(l);
}
