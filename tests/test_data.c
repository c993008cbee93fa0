/* tests/test_data.c: the IDX reader, the data set, the loaders and the
   distributed sampler.

   The real-data tests read Fashion-MNIST from $MGPU_DATA, else from
   ../shared/fashion-mnist; without it they print a note and pass. The
   other tests write their own small files into a fresh temporary folder. */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"
#include "test.h"
#include "datasets.h"

#include <sys/stat.h>
#include <zlib.h>

/* ------------------------------------------------------------ real data */
static const char *real_dir(void) {
    const char *env = getenv("MGPU_DATA");
    return env && env[0] ? env : "../shared/fashion-mnist";
}

/* Loaded once and shared by the tests; a test that needs it fails when absent. */
static mgpu_dataset *real_train, *real_test;
static int real_loaded;
static int have_real_data(void) {
    if (!real_loaded) {
        real_loaded = 1;
        char path[4096];
        struct stat st;
        snprintf(path, sizeof path, "%s/train-images-idx3-ubyte.gz", real_dir());
        if (stat(path, &st) != 0) {
            /* make test always has the data (make data fills it): its absence is a failure */
            fprintf(stderr, "  no Fashion-MNIST in %s (set MGPU_DATA or run make data)\n",
                    real_dir());
            test__failures++;
            return 0;
        }
        double start = mgpu_now();
        mgpu_dataset_load_fashion_mnist(real_dir(), &real_train, &real_test);
        printf("  loaded Fashion-MNIST (70000 images) in %.2f s\n", mgpu_now() - start);
    }
    return real_train != NULL;
}

static long long pixel_sum(const mgpu_dataset *d, int first, int count) {
    size_t pixels = (size_t)d->rows * (size_t)d->cols;
    long long sum = 0;
    for (size_t i = (size_t)first * pixels; i < (size_t)(first + count) * pixels; i++)
        sum += d->images[i];
    return sum;
}

/* The sums were computed once from the files with Python's gzip module:
     python3 -c "import gzip; b = gzip.open('train-images-idx3-ubyte.gz').read();
                 print(sum(b[16:16 + 784]), sum(b[16:]))"
   and the same for the last image and for the t10k files. */
TEST(real_files_load) {
    if (!have_real_data()) return;
    CHECK_EQ_INT(real_train->n, 60000);
    CHECK_EQ_INT(real_test->n, 10000);
    CHECK_EQ_INT(real_train->rows, 28);
    CHECK_EQ_INT(real_train->cols, 28);
    CHECK_EQ_INT(real_test->rows, 28);
    CHECK_EQ_INT(real_test->cols, 28);
    CHECK_EQ_INT(real_train->labels[0], 9);
    CHECK(strcmp(mgpu_fashion_mnist_label(real_train->labels[0]), "Ankle boot") == 0);
    CHECK_EQ_INT(real_test->labels[0], 9);
    CHECK_EQ_INT(pixel_sum(real_train, 0, 1), 76247);
    CHECK_EQ_INT(pixel_sum(real_train, 59999, 1), 16684);
    CHECK_EQ_INT(pixel_sum(real_test, 0, 1), 33456);
    CHECK_EQ_INT(pixel_sum(real_test, 9999, 1), 24390);
    CHECK_EQ_INT(pixel_sum(real_train, 0, 60000), 3431114169LL);
    CHECK_EQ_INT(pixel_sum(real_test, 0, 10000), 573469082LL);
    /* The classes are balanced: 6000 and 1000 of each. */
    int train_count[10] = {0}, test_count[10] = {0};
    for (int i = 0; i < real_train->n; i++) train_count[real_train->labels[i]]++;
    for (int i = 0; i < real_test->n; i++) test_count[real_test->labels[i]]++;
    for (int k = 0; k < 10; k++) {
        CHECK_EQ_INT(train_count[k], 6000);
        CHECK_EQ_INT(test_count[k], 1000);
    }
}

TEST(label_names) {
    CHECK(strcmp(mgpu_fashion_mnist_label(0), "T-shirt/top") == 0);
    CHECK(strcmp(mgpu_fashion_mnist_label(7), "Sneaker") == 0);
    CHECK(strcmp(mgpu_fashion_mnist_label(9), "Ankle boot") == 0);
    EXPECT_DIES(mgpu_fashion_mnist_label(10), "10 is not a class");
}

TEST(data_dir_lookup) {
    const char *saved = getenv("MGPU_DATA");
    char *copy = saved ? strdup(saved) : NULL;
    setenv("MGPU_DATA", "/somewhere/else", 1);
    CHECK(strcmp(mgpu_data_dir("flag/dir"), "flag/dir") == 0);
    CHECK(strcmp(mgpu_data_dir(NULL), "/somewhere/else") == 0);
    unsetenv("MGPU_DATA");
    CHECK(strcmp(mgpu_data_dir(NULL), "data/fashion-mnist") == 0);
    setenv("MGPU_DATA", "", 1);
    CHECK(strcmp(mgpu_data_dir(NULL), "data/fashion-mnist") == 0);
    if (copy) setenv("MGPU_DATA", copy, 1);
    else unsetenv("MGPU_DATA");
    free(copy);
}

/* -------------------------------------------------------------- loaders */

/* Takes the rest of a started epoch of an indexed data set, `left`
   samples, checking every batch (shape, pixels exactly byte / 255,
   labels); writes the samples' order and returns the batches taken. */
static int take_indexed_batches(mgpu_loader *l, const mgpu_dataset *d, int batch_size, int left, int *order) {
    mgpu_batch b;
    int seen = 0, batches = 0;
    while (mgpu_loader_next(l, &b)) {
        int want_n = left - seen < batch_size ? left - seen : batch_size;
        CHECK_EQ_INT(b.n, want_n);
        CHECK_EQ_INT(b.x->shape.ndim, 4);
        CHECK_EQ_INT(b.x->shape.d[0], b.n);
        CHECK_EQ_INT(b.x->shape.d[1], 1);
        CHECK_EQ_INT(b.x->shape.d[2], 2);
        CHECK_EQ_INT(b.y->shape.ndim, 1);
        CHECK_EQ_INT(b.y->shape.d[0], b.n);
        CHECK(b.x->device == mgpu_cpu() && b.x->pinned);
        for (int i = 0; i < b.n && seen < left; i++) {
            const float *px = b.x->data + 4 * i;
            int index = (int)lroundf(px[0] * 255.0f) + 256 * (int)lroundf(px[1] * 255.0f);
            if (index < 0 || index >= d->n) {
                CHECK(index >= 0 && index < d->n);
                return batches;
            }
            for (int p = 0; p < 4; p++)
                if (px[p] != (float)d->images[4 * index + p] / 255.0f) {
                    CHECK(px[p] == (float)d->images[4 * index + p] / 255.0f);
                    return batches;
                }
            CHECK(b.y->data[i] == (float)d->labels[index]);
            order[seen++] = index;
        }
        batches++;
    }
    CHECK_EQ_INT(seen, left);
    CHECK_EQ_INT(mgpu_loader_next(l, &b), 0); /* stays at the end */
    return batches;
}

/* One whole epoch, every sample of the data set. */
static void run_indexed_epoch(mgpu_loader *l, const mgpu_dataset *d, int batch_size, int epoch,
                              int *order) {
    mgpu_loader_start_epoch(l, epoch);
    CHECK_EQ_INT(take_indexed_batches(l, d, batch_size, d->n, order), mgpu_loader_num_batches(l));
}

/* Every index once: the order is a permutation. */
static int is_permutation(const int *order, int n) {
    char *seen = (char *)calloc((size_t)n, 1);
    int ok = 1;
    for (int i = 0; i < n && ok; i++) {
        if (order[i] < 0 || order[i] >= n || seen[order[i]]) ok = 0;
        else seen[order[i]] = 1;
    }
    free(seen);
    return ok;
}
static int is_identity(const int *order, int n) {
    for (int i = 0; i < n; i++)
        if (order[i] != i) return 0;
    return 1;
}

TEST(loader_visits_every_sample_once) {
    static const int sizes[2][2] = {{60000, 256}, {50, 7}}; /* last batches of 96 and 1 */
    for (int c = 0; c < 2; c++) {
        int n = sizes[c][0], bs = sizes[c][1];
        mgpu_dataset *d = indexed_dataset(n);
        int *order = (int *)malloc((size_t)n * sizeof(int));
        mgpu_loader *shuffled = mgpu_loader_new(d, bs, 1, 42);
        CHECK_EQ_INT(mgpu_loader_num_batches(shuffled), (n + bs - 1) / bs);
        for (int epoch = 0; epoch < 2; epoch++) {
            run_indexed_epoch(shuffled, d, bs, epoch, order);
            CHECK(is_permutation(order, n));
            CHECK(!is_identity(order, n));
        }
        mgpu_loader *in_order = mgpu_loader_new(d, bs, 0, 42);
        for (int epoch = 0; epoch < 2; epoch++) {
            run_indexed_epoch(in_order, d, bs, epoch, order);
            CHECK(is_identity(order, n));
        }
        mgpu_loader_free(shuffled);
        mgpu_loader_free(in_order);
        mgpu_dataset_free(d);
        free(order);
    }
}

TEST(loader_batch_larger_than_data_set) {
    mgpu_dataset *d = indexed_dataset(5);
    int order[5];
    mgpu_loader *l = mgpu_loader_new(d, 8, 1, 1);
    CHECK_EQ_INT(mgpu_loader_num_batches(l), 1);
    run_indexed_epoch(l, d, 8, 0, order);
    CHECK(is_permutation(order, 5));
    mgpu_loader_free(l);
    mgpu_dataset_free(d);
}

/* drop_last: whole batches only, every epoch. Each epoch leaves out the
   n % batch_size samples its order puts last: others in another epoch
   when shuffled. A data set smaller than a batch then gives no batch. */
static int epoch_without(mgpu_loader *l, int epoch, int n, int batch_size, char *seen) {
    memset(seen, 0, (size_t)n);
    mgpu_loader_start_epoch(l, epoch);
    mgpu_batch b;
    int batches = 0;
    while (mgpu_loader_next(l, &b)) {
        CHECK_EQ_INT(b.n, batch_size);
        for (int i = 0; i < b.n; i++) { /* (the indexed data set's pixels say the sample) */
            int index = (int)lroundf(b.x->data[4 * i] * 255.0f) + 256 * (int)lroundf(b.x->data[4 * i + 1] * 255.0f);
            CHECK(index >= 0 && index < n && !seen[index]);
            if (index >= 0 && index < n) seen[index] = 1;
        }
        batches++;
    }
    int missing = -1, count = 0;
    for (int i = 0; i < n; i++)
        if (!seen[i]) missing = i, count++;
    CHECK_EQ_INT(count, n % batch_size);
    CHECK_EQ_INT(batches, n / batch_size);
    return missing;
}
TEST(loader_drop_last) {
    mgpu_dataset *d = indexed_dataset(50);
    char seen[50];
    mgpu_loader *l = mgpu_loader_new(d, 7, 1, 3);
    CHECK_EQ_INT(mgpu_loader_num_batches(l), 8); /* (by default: 7 of 7 and one of 1) */
    mgpu_loader_set_drop_last(l, 1);
    CHECK_EQ_INT(mgpu_loader_num_batches(l), 7);
    int first = epoch_without(l, 0, 50, 7, seen), second = epoch_without(l, 1, 50, 7, seen);
    CHECK(first != second);
    EXPECT_DIES(mgpu_loader_set_drop_last(l, 0), "mgpu_loader_set_drop_last: the loader's first epoch has started");
    EXPECT_DIES(mgpu_loader_set_drop_last(l, 2), "mgpu_loader_set_drop_last: drop_last 2; want 0 or 1");
    mgpu_loader_free(l);
    /* in order: the last sample is the one left out */
    mgpu_loader *in_order = mgpu_loader_new(d, 7, 0, 3);
    mgpu_loader_set_drop_last(in_order, 1);
    CHECK_EQ_INT(epoch_without(in_order, 0, 50, 7, seen), 49);
    mgpu_loader_free(in_order);
    /* fewer samples than a batch: no batch */
    mgpu_loader *none = mgpu_loader_new(d, 64, 1, 3);
    mgpu_loader_set_drop_last(none, 1);
    CHECK_EQ_INT(mgpu_loader_num_batches(none), 0);
    mgpu_batch b;
    mgpu_loader_start_epoch(none, 0);
    CHECK_EQ_INT(mgpu_loader_next(none, &b), 0);
    mgpu_loader_free(none);
    mgpu_dataset_free(d);
}

TEST(shuffle_depends_only_on_seed_and_epoch) {
    enum { N = 1000, BS = 64 };
    mgpu_dataset *d = indexed_dataset(N);
    static int a[N], b[N], c[N], e[N];
    mgpu_loader *first = mgpu_loader_new(d, BS, 1, 7);
    run_indexed_epoch(first, d, BS, 3, a);
    /* Another loader with the same seed, after other epochs and an
       abandoned one, gives epoch 3 the same order. */
    mgpu_loader *second = mgpu_loader_new(d, BS, 1, 7);
    run_indexed_epoch(second, d, BS, 4, b);
    mgpu_batch batch;
    mgpu_loader_start_epoch(second, 0);
    CHECK(mgpu_loader_next(second, &batch));
    run_indexed_epoch(second, d, BS, 3, c);
    CHECK(memcmp(a, c, sizeof a) == 0);
    CHECK(memcmp(a, b, sizeof a) != 0); /* another epoch, another order */
    mgpu_loader *other_seed = mgpu_loader_new(d, BS, 1, 8);
    run_indexed_epoch(other_seed, d, BS, 3, e);
    CHECK(memcmp(a, e, sizeof a) != 0);
    mgpu_loader_free(first);
    mgpu_loader_free(second);
    mgpu_loader_free(other_seed);
    mgpu_dataset_free(d);
}

/* ------------------------------------------------------------- samplers */

/* DistributedSampler's sizes, worked out by hand from its formulas:
   num_samples = ceil((n - world) / world) with drop_last where world
   does not divide n, else ceil(n / world); total = num_samples * world. */
TEST(sampler_sizes_are_torchs) {
    static const int cases[][5] = {
        /* n, world, drop_last, num_samples, total */
        {10, 4, 0, 3, 12},  {10, 4, 1, 2, 8},          /* ceil(2.5); ceil(1.5) */
        {12, 4, 0, 3, 12},  {12, 4, 1, 3, 12},         /* divides: the same either way */
        {3, 4, 0, 1, 4},    {3, 4, 1, 0, 0},           /* ceil(-0.25) = 0: nothing */
        {2, 5, 0, 1, 5},    {1, 1, 0, 1, 1},
        {60000, 7, 0, 8572, 60004}, {60000, 7, 1, 8571, 59997}, /* ceil(8571.4); ceil(8570.4) */
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        for (int rank = 0; rank < cases[c][1]; rank++) {
            mgpu_sampler *s = mgpu_sampler_new(cases[c][0], cases[c][1], rank, 1, 3, cases[c][2]);
            CHECK_EQ_INT(mgpu_sampler_num_samples(s), cases[c][3]);
            CHECK_EQ_INT(mgpu_sampler_total_size(s), cases[c][4]);
            mgpu_sampler_free(s);
        }
    }
}

/* Rank r's samples of an epoch (num_samples of them, at most 64). */
static int rank_samples(int n, int world, int rank, int shuffle, int drop_last, int epoch, int *out) {
    mgpu_sampler *s = mgpu_sampler_new(n, world, rank, shuffle, 11, drop_last);
    mgpu_sampler_set_epoch(s, epoch);
    mgpu_sampler_indices(s, out);
    int count = mgpu_sampler_num_samples(s);
    mgpu_sampler_free(s);
    return count;
}

/* In order, rank r takes r, r + world, ...; the order is made longer by
   going on from its start, and cut with drop_last. */
TEST(sampler_strides_and_pads_from_the_start) {
    static const int want[4][3] = {{0, 4, 8}, {1, 5, 9}, {2, 6, 0}, {3, 7, 1}};
    int got[3];
    for (int rank = 0; rank < 4; rank++) {
        CHECK_EQ_INT(rank_samples(10, 4, rank, 0, 0, 0, got), 3);
        for (int i = 0; i < 3; i++) CHECK_EQ_INT(got[i], want[rank][i]);
        CHECK_EQ_INT(rank_samples(10, 4, rank, 0, 1, 0, got), 2); /* drop_last: 8 and 9 left out */
        for (int i = 0; i < 2; i++) CHECK_EQ_INT(got[i], want[rank][i]);
    }
    /* 2 samples on 5 ranks: the order goes round more than once, 0 1 0 1 0 */
    for (int rank = 0; rank < 5; rank++) {
        CHECK_EQ_INT(rank_samples(2, 5, rank, 0, 0, 0, got), 1);
        CHECK_EQ_INT(got[0], rank % 2);
    }
    /* shuffled: ranks 2 and 3 end with the first samples of ranks 0 and 1 */
    int ranks[4][3];
    for (int rank = 0; rank < 4; rank++) rank_samples(10, 4, rank, 1, 0, 5, ranks[rank]);
    CHECK_EQ_INT(ranks[2][2], ranks[0][0]);
    CHECK_EQ_INT(ranks[3][2], ranks[1][0]);
    CHECK(!(ranks[0][0] == 0 && ranks[1][0] == 1 && ranks[2][0] == 2)); /* (and it did shuffle) */
}

/* Where world divides n, the ranks' samples together are the data set,
   each sample once, shuffled or not. */
TEST(sampler_ranks_cover_every_sample_once) {
    static const int sizes[][2] = {{12, 4}, {60, 3}, {64, 8}, {7, 7}};
    for (size_t c = 0; c < sizeof sizes / sizeof sizes[0]; c++) {
        int n = sizes[c][0], world = sizes[c][1];
        for (int shuffle = 0; shuffle < 2; shuffle++) {
            int times[64] = {0}, got[64];
            for (int rank = 0; rank < world; rank++) {
                CHECK_EQ_INT(rank_samples(n, world, rank, shuffle, 0, 2, got), n / world);
                for (int i = 0; i < n / world; i++) times[got[i]]++;
            }
            for (int i = 0; i < n; i++) CHECK_EQ_INT(times[i], 1);
        }
    }
}

/* The shuffled order depends on (seed, epoch) alone, whatever was asked
   before; it is the one a shuffling loader with that seed gives. */
TEST(sampler_order_depends_only_on_seed_and_epoch) {
    enum { N = 200 };
    static int a[N], b[N], c[N], loader_order[N];
    mgpu_sampler *s = mgpu_sampler_new(N, 1, 0, 1, 7, 0);
    mgpu_sampler_set_epoch(s, 3);
    mgpu_sampler_indices(s, a);
    mgpu_sampler_set_epoch(s, 4);
    mgpu_sampler_indices(s, b);
    CHECK(memcmp(a, b, sizeof a) != 0); /* another epoch, another order */
    CHECK(is_permutation(a, N) && is_permutation(b, N));
    mgpu_sampler *again = mgpu_sampler_new(N, 1, 0, 1, 7, 0);
    mgpu_sampler_set_epoch(again, 3);
    mgpu_sampler_indices(again, c);
    CHECK(memcmp(a, c, sizeof a) == 0);
    mgpu_sampler_set_epoch(s, 3); /* back, after epoch 4 */
    mgpu_sampler_indices(s, b);
    CHECK(memcmp(a, b, sizeof a) == 0);
    mgpu_sampler *other_seed = mgpu_sampler_new(N, 1, 0, 1, 8, 0);
    mgpu_sampler_set_epoch(other_seed, 3);
    mgpu_sampler_indices(other_seed, c);
    CHECK(memcmp(a, c, sizeof a) != 0);
    mgpu_dataset *d = indexed_dataset(N);
    mgpu_loader *l = mgpu_loader_new(d, 32, 1, 7);
    run_indexed_epoch(l, d, 32, 3, loader_order);
    CHECK(memcmp(a, loader_order, sizeof a) == 0);
    mgpu_loader_free(l);
    mgpu_dataset_free(d);
    mgpu_sampler_free(s);
    mgpu_sampler_free(again);
    mgpu_sampler_free(other_seed);
}

/* A loader with a sampler gives exactly the rank's samples (their
   pixels and labels), in the sampler's order, in its batches. */
TEST(loader_with_a_sampler_yields_the_ranks_samples) {
    mgpu_dataset *d = indexed_dataset(50);
    mgpu_sampler *s = mgpu_sampler_new(50, 4, 2, 1, 9, 0); /* 13 samples */
    mgpu_loader *l = mgpu_loader_new(d, 5, 0, 0);
    CHECK_EQ_INT(mgpu_loader_num_batches(l), 10);
    mgpu_loader_set_sampler(l, s);
    CHECK_EQ_INT(mgpu_loader_num_batches(l), 3); /* 5, 5 and 3 */
    int want[13], got[13], first[13];
    for (int epoch = 0; epoch < 2; epoch++) {
        mgpu_sampler_set_epoch(s, epoch);
        mgpu_sampler_indices(s, want);
        mgpu_loader_start_epoch(l, epoch);
        CHECK_EQ_INT(take_indexed_batches(l, d, 5, 13, got), 3);
        CHECK(memcmp(got, want, sizeof got) == 0);
        if (epoch == 0) memcpy(first, got, sizeof got);
    }
    CHECK(memcmp(first, got, sizeof got) != 0);
    mgpu_loader_free(l);
    /* the loader's drop_last leaves the short batch out, before or after */
    mgpu_loader *whole = mgpu_loader_new(d, 5, 0, 0);
    mgpu_loader_set_drop_last(whole, 1);
    mgpu_loader_set_sampler(whole, s);
    CHECK_EQ_INT(mgpu_loader_num_batches(whole), 2);
    mgpu_loader_start_epoch(whole, 1);
    CHECK_EQ_INT(take_indexed_batches(whole, d, 5, 10, got), 2);
    CHECK(memcmp(got, want, 10 * sizeof(int)) == 0);
    mgpu_loader_free(whole);
    mgpu_sampler_free(s);
    mgpu_dataset_free(d);
}

/* Forgetting set_epoch is an error, not an epoch in the old order. */
TEST(a_sampler_left_at_another_epoch_is_an_error) {
    mgpu_dataset *d = indexed_dataset(20);
    mgpu_sampler *s = mgpu_sampler_new(20, 2, 1, 1, 4, 0);
    mgpu_loader *l = mgpu_loader_new(d, 4, 0, 0);
    mgpu_loader_set_sampler(l, s);
    int got[10];
    mgpu_loader_start_epoch(l, 0); /* a sampler starts at epoch 0 */
    CHECK_EQ_INT(take_indexed_batches(l, d, 4, 10, got), 3);
    EXPECT_DIES(mgpu_loader_start_epoch(l, 1),
                "mgpu: error: mgpu_loader_start_epoch: epoch 1, but its sampler is set to epoch 0: call "
                "mgpu_sampler_set_epoch(sampler, epoch) before each epoch (as DistributedSampler.set_epoch)");
    mgpu_sampler_set_epoch(s, 1);
    mgpu_loader_start_epoch(l, 1);
    mgpu_batch b;
    CHECK(mgpu_loader_next(l, &b));
    mgpu_loader_start_epoch(l, 1); /* the same epoch again is fine */
    CHECK_EQ_INT(take_indexed_batches(l, d, 4, 10, got), 3);
    EXPECT_DIES(mgpu_loader_start_epoch_at(l, 0, 1), "mgpu_loader_start_epoch_at: epoch 0, but its sampler is set to epoch 1");
    mgpu_loader_free(l);
    mgpu_sampler_free(s);
    mgpu_dataset_free(d);
}

/* An epoch started at batch k gives the batches a whole epoch gives from
   batch k on, with a sampler or without, shuffled or not. */
static void check_resumed_epochs(mgpu_loader *l, const mgpu_dataset *d, mgpu_sampler *s, int batch_size) {
    int count = s ? mgpu_sampler_num_samples(s) : d->n, nb = mgpu_loader_num_batches(l);
    int *whole = (int *)malloc((size_t)count * sizeof(int)), *tail = (int *)malloc((size_t)count * sizeof(int));
    for (int epoch = 2; epoch < 4; epoch++) {
        if (s) mgpu_sampler_set_epoch(s, epoch);
        mgpu_loader_start_epoch(l, epoch);
        CHECK_EQ_INT(take_indexed_batches(l, d, batch_size, count, whole), nb);
        for (int k = 0; k <= nb; k++) {
            int skipped = k * batch_size < count ? k * batch_size : count;
            mgpu_loader_start_epoch_at(l, epoch, k);
            CHECK_EQ_INT(take_indexed_batches(l, d, batch_size, count - skipped, tail), nb - k);
            CHECK(memcmp(tail, whole + skipped, (size_t)(count - skipped) * sizeof(int)) == 0);
        }
    }
    free(whole);
    free(tail);
}
TEST(an_epoch_resumed_at_a_batch_gives_the_rest_of_it) {
    mgpu_dataset *d = indexed_dataset(103);
    for (int shuffle = 0; shuffle < 2; shuffle++) {
        mgpu_loader *l = mgpu_loader_new(d, 8, shuffle, 5); /* 13 batches, the last of 7 */
        check_resumed_epochs(l, d, NULL, 8);
        mgpu_loader_free(l);
    }
    mgpu_sampler *s = mgpu_sampler_new(103, 3, 1, 1, 5, 0); /* 35 samples: 5 batches, the last of 3 */
    mgpu_loader *l = mgpu_loader_new(d, 8, 0, 0);
    mgpu_loader_set_sampler(l, s);
    check_resumed_epochs(l, d, s, 8);
    mgpu_batch b;
    mgpu_loader_start_epoch_at(l, 3, 2); /* mid-epoch, then from another batch */
    CHECK(mgpu_loader_next(l, &b));
    mgpu_loader_start_epoch_at(l, 3, 4);
    CHECK(mgpu_loader_next(l, &b));
    CHECK_EQ_INT(b.n, 3);
    CHECK_EQ_INT(mgpu_loader_next(l, &b), 0);
    EXPECT_DIES(mgpu_loader_start_epoch_at(l, 3, 6), "mgpu: error: mgpu_loader_start_epoch_at: first batch 6 is not in 0..5 (the epoch's batches)");
    EXPECT_DIES(mgpu_loader_start_epoch_at(l, 3, -1), "first batch -1 is not in 0..5");
    EXPECT_DIES(mgpu_loader_start_epoch_at(l, -1, 0), "mgpu_loader_start_epoch_at: epoch -1 is negative");
    mgpu_loader_free(l);
    mgpu_sampler_free(s);
    mgpu_dataset_free(d);
}

TEST(sampler_misuse) {
    EXPECT_DIES(mgpu_sampler_new(0, 2, 0, 1, 0, 0), "mgpu: error: mgpu_sampler_new: 0 samples; it needs at least 1");
    EXPECT_DIES(mgpu_sampler_new(10, 0, 0, 1, 0, 0), "mgpu_sampler_new: world size 0; it must be at least 1");
    EXPECT_DIES(mgpu_sampler_new(10, 4, 4, 1, 0, 0), "mgpu_sampler_new: rank 4 is not in 0..3 (world size 4)");
    EXPECT_DIES(mgpu_sampler_new(10, 4, -1, 1, 0, 0), "mgpu_sampler_new: rank -1 is not in 0..3");
    EXPECT_DIES(mgpu_sampler_new(10, 4, 0, 2, 0, 0), "mgpu_sampler_new: shuffle 2 and drop_last 0; want 0 or 1 each");
    EXPECT_DIES(mgpu_sampler_new(2147483647, 2, 0, 1, 0, 0), "make an order of 2147483648, more than an int counts");
    mgpu_sampler *s = mgpu_sampler_new(10, 2, 0, 1, 0, 0);
    EXPECT_DIES(mgpu_sampler_set_epoch(s, -1), "mgpu: error: mgpu_sampler_set_epoch: epoch -1 is negative");
    mgpu_dataset *d = indexed_dataset(12);
    mgpu_loader *l = mgpu_loader_new(d, 4, 0, 0);
    EXPECT_DIES(mgpu_loader_set_sampler(l, s), "mgpu_loader_set_sampler: the sampler is for 10 samples, the data set has 12");
    EXPECT_DIES(mgpu_loader_set_sampler(l, NULL), "mgpu_loader_set_sampler: the sampler is NULL");
    mgpu_sampler *twelve = mgpu_sampler_new(12, 2, 0, 1, 0, 0);
    mgpu_loader *shuffling = mgpu_loader_new(d, 4, 1, 0);
    EXPECT_DIES(mgpu_loader_set_sampler(shuffling, twelve), "mgpu_loader_set_sampler: the loader shuffles, and the sampler gives the order");
    mgpu_loader_start_epoch(l, 0);
    EXPECT_DIES(mgpu_loader_set_sampler(l, twelve), "mgpu_loader_set_sampler: the loader's first epoch has started; set it before");
    mgpu_loader_free(l);
    mgpu_loader_free(shuffling);
    mgpu_sampler_free(s);
    mgpu_sampler_free(twelve);
    mgpu_sampler_free(NULL);
    mgpu_dataset_free(d);
}

TEST(test_iterator_in_order_with_pixels_over_255) {
    if (!have_real_data()) return;
    const mgpu_dataset *d = real_test;
    size_t pixels = 28 * 28;
    mgpu_loader *l = mgpu_loader_new(d, 256, 0, 0);
    CHECK_EQ_INT(mgpu_loader_num_batches(l), 40); /* 39 of 256 and one of 16 */
    mgpu_loader_start_epoch(l, 0);
    mgpu_batch b;
    int seen = 0, bad_pixels = 0, bad_labels = 0;
    while (mgpu_loader_next(l, &b)) {
        CHECK_EQ_INT(b.x->shape.d[0], b.n);
        for (size_t i = 0; i < (size_t)b.n * pixels; i++)
            bad_pixels += b.x->data[i] != (float)d->images[(size_t)seen * pixels + i] / 255.0f;
        for (int i = 0; i < b.n; i++) bad_labels += b.y->data[i] != (float)d->labels[seen + i];
        seen += b.n;
    }
    CHECK_EQ_INT(seen, 10000);
    CHECK_EQ_INT(b.n, 16);
    CHECK_EQ_INT(bad_pixels, 0);
    CHECK_EQ_INT(bad_labels, 0);
    mgpu_loader_free(l);
}

/* The book's setting on the real training set: batches of 256, shuffled;
   every image comes once, so the pixel sum of an epoch is the data set's. */
TEST(real_train_loader_full_epoch) {
    if (!have_real_data()) return;
    mgpu_loader *l = mgpu_loader_new(real_train, 256, 1, 2024);
    CHECK_EQ_INT(mgpu_loader_num_batches(l), 235);
    mgpu_loader_start_epoch(l, 0);
    mgpu_batch b;
    double sum = 0;
    int seen = 0, counts[10] = {0};
    while (mgpu_loader_next(l, &b)) {
        for (size_t i = 0; i < b.x->numel; i++) sum += b.x->data[i];
        for (int i = 0; i < b.n; i++) counts[(int)b.y->data[i]]++;
        seen += b.n;
    }
    CHECK_EQ_INT(seen, 60000);
    CHECK_EQ_INT(b.n, 96);
    CHECK_CLOSE(sum, 3431114169.0 / 255.0, 0, 1e-7);
    for (int k = 0; k < 10; k++) CHECK_EQ_INT(counts[k], 6000);
    mgpu_loader_free(l);
}

/* A subset of 50 real images in batches of 7: each comes exactly once,
   recognised by comparing its pixels with the 50 originals. */
TEST(real_subset_batches_of_7) {
    if (!have_real_data()) return;
    mgpu_dataset *d = mgpu_dataset_subset(real_train, 50);
    CHECK_EQ_INT(d->n, 50);
    CHECK(memcmp(d->images, real_train->images, 50 * 784) == 0);
    CHECK(memcmp(d->labels, real_train->labels, 50) == 0);
    mgpu_loader *l = mgpu_loader_new(d, 7, 1, 5);
    CHECK_EQ_INT(mgpu_loader_num_batches(l), 8);
    int times[50] = {0};
    mgpu_loader_start_epoch(l, 1);
    mgpu_batch b;
    while (mgpu_loader_next(l, &b)) {
        for (int i = 0; i < b.n; i++) {
            for (int j = 0; j < 50; j++) {
                int same = b.y->data[i] == (float)d->labels[j];
                for (int p = 0; p < 784 && same; p++)
                    same = b.x->data[i * 784 + p] == (float)d->images[j * 784 + p] / 255.0f;
                times[j] += same;
            }
        }
    }
    CHECK_EQ_INT(b.n, 1);
    for (int j = 0; j < 50; j++) CHECK_EQ_INT(times[j], 1);
    mgpu_loader_free(l);
    mgpu_dataset_free(d);
    mgpu_dataset *all = mgpu_dataset_subset(real_test, 20000);
    CHECK_EQ_INT(all->n, 10000);
    mgpu_dataset_free(all);
}

/* Batches used asynchronously: summed on the CPU device's queue, copied
   (non-blocking) whole to another device, and half of each through a view
   freed at once, as a scatter does, while the loader refills its buffers.
   Every copy must hold its own batch. */
TEST(loader_batches_used_asynchronously) {
    enum { N = 3000, BS = 100, HALF = BS / 2 * 4 };
    mgpu_dataset *d = indexed_dataset(N);
    mgpu_device *devs[2];
    mgpu_devices(2, 0, devs);
    mgpu_tensor *sum = mgpu_zeros(mgpu_cpu(), mgpu_shape4(BS, 1, 2, 2));
    mgpu_tensor *whole[N / BS], *half[N / BS];
    mgpu_loader *l = mgpu_loader_new(d, BS, 0, 0);
    mgpu_loader_start_epoch(l, 0);
    mgpu_batch b;
    int k = 0;
    while (mgpu_loader_next(l, &b)) {
        mgpu_add_(sum, b.x);
        whole[k] = mgpu_to(b.x, devs[1], 1);
        mgpu_tensor *second_half = mgpu_narrow(b.x, BS / 2, BS / 2);
        half[k] = mgpu_to(second_half, devs[1], 1);
        mgpu_free(second_half);
        k++;
    }
    CHECK_EQ_INT(k, N / BS);
    float *host = (float *)malloc(BS * 4 * sizeof(float));
    int bad = 0;
    for (int j = 0; j < k; j++) {
        const unsigned char *want = d->images + (size_t)j * BS * 4;
        mgpu_to_host(whole[j], host);
        for (int i = 0; i < BS * 4; i++) bad += host[i] != (float)want[i] / 255.0f;
        mgpu_to_host(half[j], host);
        for (int i = 0; i < HALF; i++) bad += host[i] != (float)want[HALF + i] / 255.0f;
        mgpu_free(whole[j]);
        mgpu_free(half[j]);
    }
    CHECK_EQ_INT(bad, 0);
    mgpu_to_host(sum, host);
    double worst = 0;
    for (int i = 0; i < BS * 4; i++) {
        double want = 0;
        for (int j = 0; j < k; j++) want += d->images[(size_t)j * BS * 4 + i] / 255.0;
        worst = fmax(worst, fabs(host[i] - want));
    }
    CHECK_CLOSE(worst, 0, 1e-4, 0);
    free(host);
    mgpu_free(sum);
    mgpu_loader_free(l);
    mgpu_dataset_free(d);
}

TEST(loader_free_mid_epoch) {
    mgpu_dataset *d = indexed_dataset(10000);
    mgpu_batch b;
    /* Never started. */
    mgpu_loader_free(mgpu_loader_new(d, 32, 1, 3));
    /* Started, nothing taken: the thread is busy filling. */
    mgpu_loader *l = mgpu_loader_new(d, 32, 1, 3);
    mgpu_loader_start_epoch(l, 0);
    mgpu_loader_free(l);
    /* Two batches taken, the rest abandoned. */
    l = mgpu_loader_new(d, 32, 1, 3);
    mgpu_loader_start_epoch(l, 0);
    CHECK(mgpu_loader_next(l, &b));
    CHECK(mgpu_loader_next(l, &b));
    mgpu_loader_free(l);
    /* Holding the short last batch (a view). */
    l = mgpu_loader_new(d, 3000, 0, 3);
    mgpu_loader_start_epoch(l, 0);
    for (int i = 0; i < 4; i++) CHECK(mgpu_loader_next(l, &b));
    CHECK_EQ_INT(b.n, 1000);
    mgpu_loader_free(l);
    mgpu_loader_free(NULL);
    mgpu_dataset_free(d);
}

/* ------------------------------------------------------------ bad input */
static char tmp_dir[64];
static char tmp_paths[128][128];
static int tmp_count;

/* A path in the temporary folder, removed at the end. */
static const char *tmp_path(const char *name) {
    if (!tmp_dir[0]) {
        strcpy(tmp_dir, "/tmp/mgpu_test_data_XXXXXX");
        if (!mkdtemp(tmp_dir)) { perror("mkdtemp"); exit(2); }
    }
    if (tmp_count == (int)(sizeof tmp_paths / sizeof tmp_paths[0])) {
        fprintf(stderr, "tmp_path: more than %d files; make tmp_paths larger\n", tmp_count);
        exit(2);
    }
    char *p = tmp_paths[tmp_count++];
    snprintf(p, sizeof tmp_paths[0], "%s/%s", tmp_dir, name);
    return p;
}

static void put_be32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24); p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);  p[3] = (unsigned char)v;
}

/* Writes bytes to path, gzip-compressed or not. */
static void write_bytes(const char *path, const unsigned char *bytes, size_t n, int gzip) {
    if (gzip) {
        gzFile gz = gzopen(path, "wb");
        if (!gz || gzwrite(gz, bytes, (unsigned)n) != (int)n || gzclose(gz) != Z_OK) {
            perror(path);
            exit(2);
        }
        return;
    }
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(bytes, 1, n, f) != n || fclose(f) != 0) { perror(path); exit(2); }
}

/* An IDX image file: the header says `count` images of rows x cols, and
   `body` images follow (pixel values i % 256). */
static const char *images_file(const char *name, uint32_t magic, uint32_t count, uint32_t rows,
                               uint32_t cols, uint32_t body, int gzip) {
    size_t n = 16 + (size_t)body * rows * cols;
    unsigned char *bytes = (unsigned char *)malloc(n);
    put_be32(bytes, magic);
    put_be32(bytes + 4, count);
    put_be32(bytes + 8, rows);
    put_be32(bytes + 12, cols);
    for (size_t i = 16; i < n; i++) bytes[i] = (unsigned char)i;
    const char *path = tmp_path(name);
    write_bytes(path, bytes, n, gzip);
    free(bytes);
    return path;
}

/* An IDX label file holding `count` labels i % 10, with labels[bad_at] = bad. */
static const char *labels_file(const char *name, uint32_t count, int bad_at, int bad, int gzip) {
    unsigned char *bytes = (unsigned char *)malloc(8 + (size_t)count);
    put_be32(bytes, 0x00000801);
    put_be32(bytes + 4, count);
    for (uint32_t i = 0; i < count; i++) bytes[8 + i] = (unsigned char)(i % 10);
    if (bad_at >= 0) bytes[8 + bad_at] = (unsigned char)bad;
    const char *path = tmp_path(name);
    write_bytes(path, bytes, 8 + (size_t)count, gzip);
    free(bytes);
    return path;
}

/* A file's bytes (for cutting and corrupting it). */
static unsigned char *read_bytes(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); exit(2); }
    unsigned char *bytes = (unsigned char *)malloc(1 << 20);
    *n = fread(bytes, 1, 1 << 20, f);
    fclose(f);
    return bytes;
}

/* "mgpu: error: <path>: <problem>": the line must name the file. */
#define EXPECT_BAD_FILE(images, labels, bad_path, problem)                         \
    do {                                                                           \
        char want_[512];                                                           \
        snprintf(want_, sizeof want_, "mgpu: error: %s: %s", bad_path, problem);   \
        EXPECT_DIES(mgpu_dataset_load(images, labels), want_);                     \
    } while (0)

TEST(small_files_load_plain_and_gzip) {
    const char *labels = labels_file("ok-labels", 5, -1, 0, 0);
    for (int gzip = 0; gzip < 2; gzip++) {
        const char *images = images_file(gzip ? "ok.gz" : "ok", 0x803, 5, 3, 4, 5, gzip);
        mgpu_dataset *d = mgpu_dataset_load(images, labels);
        CHECK_EQ_INT(d->n, 5);
        CHECK_EQ_INT(d->rows, 3);
        CHECK_EQ_INT(d->cols, 4);
        for (int i = 0; i < 5 * 12; i++) CHECK_EQ_INT(d->images[i], (16 + i) % 256);
        for (int i = 0; i < 5; i++) CHECK_EQ_INT(d->labels[i], i);
        mgpu_dataset_free(d);
    }
}

TEST(bad_images_files) {
    const char *labels = labels_file("labels5", 5, -1, 0, 1);
    const char *p;
    p = images_file("wrong-magic.gz", 0x804, 5, 4, 4, 5, 1);
    EXPECT_BAD_FILE(p, labels, p, "wrong magic number 0x00000804: not an IDX images file (0x00000803)");
    EXPECT_BAD_FILE(labels, labels, labels, "wrong magic number 0x00000801: not an IDX images file");
    /* Random bytes: neither gzip nor IDX. */
    unsigned char junk[300];
    for (int i = 0; i < 300; i++) junk[i] = (unsigned char)(i * 37 + 11);
    p = tmp_path("random-bytes");
    write_bytes(p, junk, sizeof junk, 0);
    EXPECT_BAD_FILE(p, labels, p, "wrong magic number 0x0b30557a: not an IDX images file (0x00000803), and not gzip-compressed either");
    /* A header cut after 10 bytes, plain and compressed. */
    p = images_file("short-header", 0x803, 5, 4, 4, 0, 0);
    CHECK(truncate(p, 10) == 0);
    EXPECT_BAD_FILE(p, labels, p, "truncated: the file ends in the middle of the header (10 of 16 bytes)");
    p = tmp_path("empty.gz");
    write_bytes(p, junk, 0, 1);
    EXPECT_BAD_FILE(p, labels, p, "truncated: the file ends in the middle of the header (0 of 16 bytes)");
    /* 5 images announced, 3 there. */
    p = images_file("short-body", 0x803, 5, 4, 4, 3, 0);
    EXPECT_BAD_FILE(p, labels, p, "truncated: the header announces 5 images of 4x4 (96 bytes in all), the file has 64");
    p = images_file("short-body.gz", 0x803, 5, 4, 4, 3, 1);
    EXPECT_BAD_FILE(p, labels, p, "truncated: the file ends in the middle of the images (48 of 80 bytes)");
    /* A count far larger than the file holds: refused before allocating. */
    p = images_file("huge-count", 0x803, 2000000000u, 28, 28, 2, 0);
    EXPECT_BAD_FILE(p, labels, p, "truncated: the header announces 2000000000 images of 28x28");
    p = images_file("huge-count.gz", 0x803, 2000000000u, 28, 28, 2, 1);
    EXPECT_BAD_FILE(p, labels, p, "the header announces 2000000000 images of 28x28 (1568000000000 bytes), more than a");
    p = images_file("too-many.gz", 0x803, 0x80000000u, 1, 1, 2, 1);
    EXPECT_BAD_FILE(p, labels, p, "2147483648 images are too many");
    /* Zero images, and images with no pixels. */
    p = images_file("zero.gz", 0x803, 0, 28, 28, 0, 1);
    EXPECT_BAD_FILE(p, labels, p, "holds no images");
    p = images_file("zero-rows.gz", 0x803, 5, 0, 4, 0, 1);
    EXPECT_BAD_FILE(p, labels, p, "images of 0x4 pixels: each side must be 1 to 65535");
    /* More bytes than the header says, plain and compressed. */
    p = images_file("trailing", 0x803, 5, 4, 4, 6, 0);
    EXPECT_BAD_FILE(p, labels, p, "the file is longer than its header says: 112 bytes, 96 expected for 5 images of 4x4");
    p = images_file("trailing.gz", 0x803, 5, 4, 4, 6, 1);
    EXPECT_BAD_FILE(p, labels, p, "the file is longer than its header says: more than 96 bytes of data");
}

TEST(bad_gzip_streams) {
    const char *labels = labels_file("labels-ok", 50, -1, 0, 0);
    const char *good = images_file("good.gz", 0x803, 50, 28, 28, 50, 1);
    size_t n;
    unsigned char *bytes = read_bytes(good, &n);
    /* A valid gzip header (10 bytes), then garbage instead of deflate data. */
    for (size_t i = 10; i < n; i++) bytes[i] = (unsigned char)(0xA5 ^ (i * 131));
    const char *p = tmp_path("garbage.gz");
    write_bytes(p, bytes, n, 0);
    EXPECT_BAD_FILE(p, labels, p, "corrupt gzip data (");
    free(bytes);
    /* The same stream cut in the middle, and cut just before its trailer. */
    bytes = read_bytes(good, &n);
    p = tmp_path("cut-in-half.gz");
    write_bytes(p, bytes, n / 2, 0);
    EXPECT_BAD_FILE(p, labels, p, "truncated gzip stream (unexpected end of file)");
    p = tmp_path("no-trailer.gz");
    write_bytes(p, bytes, n - 8, 0);
    EXPECT_BAD_FILE(p, labels, p, "truncated gzip stream (unexpected end of file)");
    /* A wrong CRC in the trailer: the data is corrupt. */
    bytes[n - 8] ^= 0xFF;
    p = tmp_path("bad-crc.gz");
    write_bytes(p, bytes, n, 0);
    EXPECT_BAD_FILE(p, labels, p, "corrupt gzip data (incorrect data check)");
    free(bytes);
    /* Cut just before its trailer too, in a file of 800 images of random
       pixels, several times zlib's buffer even compressed (the real images
       files are so): zlib notices the missing end only when the data is
       read through its buffer. */
    size_t raw = 16 + 800 * 784;
    bytes = (unsigned char *)malloc(raw);
    put_be32(bytes, 0x803);
    put_be32(bytes + 4, 800);
    put_be32(bytes + 8, 28);
    put_be32(bytes + 12, 28);
    uint32_t state = 1;
    for (size_t i = 16; i < raw; i++) bytes[i] = (unsigned char)((state = state * 1664525u + 1013904223u) >> 24);
    const char *big = tmp_path("big.gz");
    write_bytes(big, bytes, raw, 1);
    free(bytes);
    bytes = read_bytes(big, &n);
    p = tmp_path("big-no-trailer.gz");
    write_bytes(p, bytes, n - 8, 0);
    const char *labels_800 = labels_file("labels-800", 800, -1, 0, 0);
    EXPECT_BAD_FILE(p, labels_800, p, "truncated gzip stream (unexpected end of file)");
    free(bytes);
}

TEST(bad_labels_files) {
    const char *images = images_file("images5.gz", 0x803, 5, 4, 4, 5, 1);
    const char *p;
    p = labels_file("labels4.gz", 4, -1, 0, 1);
    char want[512];
    snprintf(want, sizeof want, "mgpu: error: %s: 4 labels, but %s holds 5 images", p, images);
    EXPECT_DIES(mgpu_dataset_load(images, p), want);
    p = labels_file("label10.gz", 5, 3, 10, 1);
    EXPECT_BAD_FILE(images, p, p, "label 10 of sample 3 is not in 0..9");
    p = labels_file("label255", 5, 4, 255, 0);
    EXPECT_BAD_FILE(images, p, p, "label 255 of sample 4 is not in 0..9");
    EXPECT_BAD_FILE(images, images, images, "wrong magic number 0x00000803: not an IDX labels file (0x00000801)");
    p = labels_file("labels-short", 5, -1, 0, 0);
    CHECK(truncate(p, 11) == 0);
    EXPECT_BAD_FILE(images, p, p, "truncated: the header announces 5 labels (13 bytes in all), the file has 11");
    p = labels_file("labels-zero.gz", 0, -1, 0, 1);
    EXPECT_BAD_FILE(images, p, p, "holds no labels");
}

TEST(bad_paths) {
    const char *labels = labels_file("labels-for-paths", 5, -1, 0, 0);
    const char *dir = tmp_path("a-folder");
    mkdir(dir, 0700);
    EXPECT_BAD_FILE(dir, labels, dir, "is a directory, not an IDX file");
    const char *missing = tmp_path("no-such-file.gz");
    EXPECT_BAD_FILE(missing, labels, missing, "cannot open (No such file or directory)");
    EXPECT_BAD_FILE("/dev/null", labels, "/dev/null", "is not a regular file");
}

/* Looking up Fashion-MNIST in a folder: .gz first, else uncompressed;
   nothing there says where it looked and how to get the data. */
TEST(fashion_mnist_lookup) {
    const char *empty = tmp_path("empty-folder");
    mkdir(empty, 0700);
    mgpu_dataset *train = NULL, *test = NULL;
    char want[512];
    snprintf(want, sizeof want,
             "mgpu: error: Fashion-MNIST not found: no %s/train-images-idx3-ubyte.gz nor "
             "%s/train-images-idx3-ubyte", empty, empty);
    EXPECT_DIES(mgpu_dataset_load_fashion_mnist(empty, &train, &test), want);
    EXPECT_DIES(mgpu_dataset_load_fashion_mnist(empty, &train, &test), "`make data` fetches the data set");
    /* Not there, not a folder, a link to nothing: each says which */
    const char *nowhere = tmp_path("no-such-folder");
    snprintf(want, sizeof want, "Fashion-MNIST not found: cannot open the folder %s (No such file or directory)",
             nowhere);
    EXPECT_DIES(mgpu_dataset_load_fashion_mnist(nowhere, &train, &test), want);
    const char *a_file = labels_file("labels-not-a-folder", 5, -1, 0, 0);
    snprintf(want, sizeof want, "%s: not a folder", a_file);
    EXPECT_DIES(mgpu_dataset_load_fashion_mnist(a_file, &train, &test), want);
    const char *dangling = tmp_path("empty-folder/train-images-idx3-ubyte.gz");
    CHECK(symlink("/nonexistent/mgpu-images.gz", dangling) == 0);
    snprintf(want, sizeof want, "%s: a link to a file that is not there", dangling);
    EXPECT_DIES(mgpu_dataset_load_fashion_mnist(empty, &train, &test), want);
    unlink(dangling);
    /* A folder of small uncompressed files with the right names. */
    const char *folder = tmp_path("small-fashion");
    mkdir(folder, 0700);
    images_file("small-fashion/t10k-images-idx3-ubyte", 0x803, 3, 28, 28, 3, 0);
    labels_file("small-fashion/t10k-labels-idx1-ubyte", 3, -1, 0, 0);
    mgpu_dataset_load_fashion_mnist(folder, NULL, &test);
    CHECK(test != NULL && test->n == 3 && test->rows == 28);
    mgpu_dataset_free(test);
    EXPECT_DIES(mgpu_dataset_load_fashion_mnist(folder, &train, NULL), "train-images-idx3-ubyte");
    /* Right names, wrong image size. */
    const char *odd = images_file("small-fashion/train-images-idx3-ubyte.gz", 0x803, 3, 32, 32, 3, 1);
    labels_file("small-fashion/train-labels-idx1-ubyte.gz", 3, -1, 0, 1);
    snprintf(want, sizeof want, "mgpu: error: %s: images of 32x32 pixels; Fashion-MNIST's are 28x28", odd);
    EXPECT_DIES(mgpu_dataset_load_fashion_mnist(folder, &train, NULL), want);
}

/* A batch belongs to its loader: freeing it, whole or the short last
   one, is a one-line error (its thread would fill freed memory). */
static void free_a_batch(int last) {
    mgpu_dataset *d = indexed_dataset(10);
    mgpu_loader *l = mgpu_loader_new(d, 4, 0, 0);
    mgpu_loader_start_epoch(l, 0);
    mgpu_batch b;
    for (int k = 0; k <= 2 * last; k++) mgpu_loader_next(l, &b);
    mgpu_free(b.y);
}
TEST(batches_are_the_loaders_to_free) {
    EXPECT_DIES(free_a_batch(0), "mgpu: error: mgpu_free: a tensor of shape [4] that belongs to its loader (a batch "
                                 "of mgpu_loader_next); do not free it\n");
    EXPECT_DIES(free_a_batch(1), "mgpu_free: a tensor of shape [2] that belongs to its loader");
}

TEST(loader_misuse) {
    mgpu_dataset *d = indexed_dataset(10);
    mgpu_loader *l = mgpu_loader_new(d, 4, 1, 0);
    mgpu_batch b;
    EXPECT_DIES(mgpu_loader_next(l, &b), "no epoch started; call mgpu_loader_start_epoch first");
    EXPECT_DIES(mgpu_loader_start_epoch(l, -1), "epoch -1 is negative");
    EXPECT_DIES(mgpu_loader_new(d, 0, 1, 0), "batch size 0");
    EXPECT_DIES(mgpu_dataset_subset(d, 0), "take at least one sample");
    mgpu_loader_free(l);
    mgpu_dataset_free(d);
}

/* Runs last (tests run in the order they are written): removes the files. */
TEST(zz_cleanup) {
    for (int i = tmp_count - 1; i >= 0; i--) {
        struct stat st;
        if (stat(tmp_paths[i], &st) == 0 && S_ISDIR(st.st_mode)) rmdir(tmp_paths[i]);
        else unlink(tmp_paths[i]);
    }
    if (tmp_dir[0]) CHECK(rmdir(tmp_dir) == 0);
    mgpu_dataset_free(real_train);
    mgpu_dataset_free(real_test);
}

TEST_MAIN()
