/* tests/assignments/check_sampler.c: the checker of the distributed-
   sampler assignment (docs/assignments.md). Built with the student's
   file by
       make check-assignment NAME=sampler FILE=student.c
   which must define
       int distributed_sampler(const int *order, int n, int world, int rank,
                               int drop_last, int *out);
   rank's share of the epoch's order of n samples, written into out; it
   returns how many. The library's sampler (mgpu_sampler) is the answer. */
#include "mgpu.h"
#include "tests/test.h"
#include STUDENT_FILE

#define SEED 11
/* Sample counts: short orders, where world divides n and where it does
   not, fewer samples than ranks, and Fashion-MNIST's 60000. */
static const int sizes[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16, 17, 24, 31, 33, 100, 1001, 60000};
static const int worlds[] = {1, 2, 3, 4, 5, 7, 8};
#define NSIZES (int)(sizeof sizes / sizeof sizes[0])
#define NWORLDS (int)(sizeof worlds / sizeof worlds[0])
#define SHOWN 3 /* failing cases printed per test; the rest are counted */

/* The epoch's order of n samples: 0, 1, ..., n-1 without shuffling; with,
   the library's shuffle by (SEED, epoch), read from a sampler of one rank,
   which takes every position of the order, in turn. */
static int *epoch_order(int n, int shuffle, int epoch) {
    int *order = (int *)malloc((size_t)n * sizeof(int));
    mgpu_sampler *s = mgpu_sampler_new(n, 1, 0, shuffle, SEED, 0);
    mgpu_sampler_set_epoch(s, epoch);
    mgpu_sampler_indices(s, order);
    mgpu_sampler_free(s);
    return order;
}

/* The library's share for rank, into a new array; *count gets its length. */
static int *librarys(int n, int world, int rank, int shuffle, int epoch, int drop_last, int *count) {
    mgpu_sampler *s = mgpu_sampler_new(n, world, rank, shuffle, SEED, drop_last);
    mgpu_sampler_set_epoch(s, epoch);
    *count = mgpu_sampler_num_samples(s);
    int *out = (int *)malloc(((size_t)*count + 1) * sizeof(int));
    mgpu_sampler_indices(s, out);
    mgpu_sampler_free(s);
    return out;
}

/* The student's share for rank, into a new array, and the count it
   returns. out has room for ceil(n / world) indices, the most a rank
   gets; a guard after it must stay as it was. Returns -1, after saying
   why, for a count outside 0..ceil(n / world) or a write past the room. */
#define GUARD 16
#define UNTOUCHED (-7777)
static int told; /* such cases printed in this test (each test sets it to 0) */
static int *yours(const int *order, int n, int world, int rank, int drop_last, int *count) {
    int room = (n + world - 1) / world;
    int *out = (int *)malloc((size_t)(room + GUARD) * sizeof(int));
    for (int i = 0; i < room + GUARD; i++) out[i] = UNTOUCHED;
    *count = distributed_sampler(order, n, world, rank, drop_last, out);
    for (int i = room; i < room + GUARD; i++)
        if (out[i] != UNTOUCHED) {
            if (told++ < SHOWN)
                    printf("  n %d, world %d, rank %d, drop_last %d: it wrote out[%d], past out[%d], the last a "
                       "rank can need\n", n, world, rank, drop_last, i, room - 1);
            *count = -1;
            break;
        }
    if (*count < -1 || *count > room) {
        if (told++ < SHOWN)
                printf("  n %d, world %d, rank %d, drop_last %d: it returned %d; a rank gets 0 to %d samples\n", n,
                   world, rank, drop_last, *count, room);
        *count = -1;
    }
    return out;
}

static void print_indices(const char *who, const int *v, int count) {
    printf("    %-10s", who);
    if (count == 0) printf(" (none)");
    for (int i = 0; i < count && i < 12; i++) printf(" %d", v[i]);
    printf(count > 12 ? " ... (%d)\n" : "\n", count);
}

/* Each rank's count is DistributedSampler's num_samples: ceil(n / world),
   or with drop_last ceil((n - world) / world) where world does not divide
   n (which is floor(n / world)), n / world where it does. */
TEST(each_rank_gets_torchs_count) {
    told = 0;
    int wrong = 0;
    for (int a = 0; a < NSIZES; a++) {
        int n = sizes[a], *order = epoch_order(n, 0, 0);
        for (int w = 0; w < NWORLDS; w++)
            for (int drop_last = 0; drop_last < 2; drop_last++)
                for (int rank = 0; rank < worlds[w]; rank++) {
                    int world = worlds[w], want, got;
                    free(librarys(n, world, rank, 0, 0, drop_last, &want));
                    free(yours(order, n, world, rank, drop_last, &got));
                    if (got == want) continue;
                    if (wrong++ < SHOWN && got >= 0)
                        printf("  n %d, world %d, rank %d, drop_last %d: it returned %d, torch's num_samples is "
                               "%d (%s)\n", n, world, rank, drop_last, got, want,
                               drop_last ? "floor(n / world): the tail that does not divide is cut"
                                         : "ceil(n / world): the ranks short of a sample get one again");
                }
        free(order);
    }
    if (wrong > SHOWN) printf("  ... and %d more\n", wrong - SHOWN);
    CHECK(wrong == 0);
}

/* All ranks together take the order made world * num_samples long: every
   rank as many samples (else one rank waits in a step the others never
   take), without drop_last every sample at least once, and the samples
   taken twice are the order's first ones (going on from its start, round
   again where ranks outnumber samples); with drop_last the last
   n % world of the order left out, none twice. */
TEST(ranks_together_take_every_sample_padding_from_the_start) {
    told = 0;
    int wrong = 0;
    for (int a = 0; a < NSIZES; a++)
        for (int shuffle = 0; shuffle < 2; shuffle++) {
            int n = sizes[a], *order = epoch_order(n, shuffle, 1);
            int *times = (int *)malloc((size_t)n * sizeof(int)), *want = (int *)malloc((size_t)n * sizeof(int));
            for (int w = 0; w < NWORLDS; w++)
                for (int drop_last = 0; drop_last < 2; drop_last++) {
                    int world = worlds[w], per_rank;
                    free(librarys(n, world, 0, shuffle, 1, drop_last, &per_rank));
                    memset(times, 0, (size_t)n * sizeof(int));
                    memset(want, 0, (size_t)n * sizeof(int));
                    for (long long p = 0; p < (long long)per_rank * world; p++) want[order[p % n]]++;
                    int first_count = 0, unequal = -1, unequal_count = 0, bad = 0;
                    for (int rank = 0; rank < world; rank++) {
                        int count, *got = yours(order, n, world, rank, drop_last, &count);
                        if (count < 0) bad = 1;
                        else if (rank == 0) first_count = count;
                        else if (count != first_count && unequal < 0) unequal = rank, unequal_count = count;
                        for (int i = 0; i < count; i++)
                            if (got[i] >= 0 && got[i] < n) times[got[i]]++;
                            else bad = 1;
                        free(got);
                    }
                    if (bad) {
                        wrong++;
                        continue;
                    }
                    if (unequal >= 0) {
                        if (wrong++ < SHOWN)
                            printf("  n %d, world %d, drop_last %d: rank 0 gets %d samples, rank %d gets %d; "
                                   "every rank must take as many steps\n", n, world, drop_last, first_count, unequal,
                                   unequal_count);
                        continue;
                    }
                    int p = 0;
                    while (p < n && times[order[p]] == want[order[p]]) p++;
                    if (p == n) continue;
                    if (wrong++ < SHOWN)
                        printf("  n %d, world %d, drop_last %d%s: sample %d, at position %d of the order, is "
                               "taken %d time(s) over the ranks, want %d (the order %s %lld long)\n", n, world,
                               drop_last, shuffle ? ", shuffled" : "", order[p], p, times[order[p]],
                               want[order[p]], drop_last ? "cut to" : "made, by going on from its start,",
                               (long long)per_rank * world);
                }
            free(times), free(want), free(order);
        }
    if (wrong > SHOWN) printf("  ... and %d more\n", wrong - SHOWN);
    CHECK(wrong == 0);
}

/* Rank r takes positions r, r + world, r + 2 world, ... of that longer
   order, exactly the library's samples in the library's order, whether
   the order is 0..n-1 or shuffled (epochs 0 and 3). A block of the order
   per rank covers the same samples, and is named as such. */
TEST(rank_r_takes_positions_r_r_plus_world_and_on) {
    told = 0;
    int wrong = 0, blocks = 0;
    for (int a = 0; a < NSIZES; a++)
        for (int shuffle = 0; shuffle < 2; shuffle++) {
            int n = sizes[a], epoch = shuffle ? 3 : 0, *order = epoch_order(n, shuffle, epoch);
            for (int w = 0; w < NWORLDS; w++)
                for (int drop_last = 0; drop_last < 2; drop_last++)
                    for (int rank = 0; rank < worlds[w]; rank++) {
                        int world = worlds[w], want_count, count;
                        int *want = librarys(n, world, rank, shuffle, epoch, drop_last, &want_count);
                        int *got = yours(order, n, world, rank, drop_last, &count);
                        int same = count == want_count && memcmp(got, want, (size_t)count * sizeof(int)) == 0;
                        if (!same && count == want_count) {
                            int block = 1;
                            for (int i = 0; i < count && block; i++)
                                block = got[i] == order[((long long)rank * count + i) % n];
                            blocks += block;
                        }
                        if (!same && wrong++ < SHOWN && count >= 0) {
                            printf("  n %d, world %d, rank %d, drop_last %d, %s order:\n", n, world, rank,
                                   drop_last, shuffle ? "a shuffled" : "the 0..n-1");
                            print_indices("yours", got, count);
                            print_indices("library's", want, want_count);
                        }
                        free(want), free(got);
                    }
            free(order);
        }
    if (wrong > SHOWN) printf("  ... and %d more\n", wrong - SHOWN);
    if (blocks)
        printf("  %d of these are a block of the order per rank (positions r * count, r * count + 1, ...): rank r "
               "takes positions r, r + world, r + 2 world, ... instead\n", blocks);
    CHECK(wrong == 0);
}

/* ----------------------------------------------------------- training */
/* Two ranks train one network in one process, on 2 CPU devices: each
   step's global batch is rank 0's batch then rank 1's, which the
   data-parallel wrapper splits back into the two halves, one a device
   (what two processes of chapter 4 do, each with its own). Fed from your
   indices, the network must take the steps it takes fed by the library's
   loaders with its samplers (mgpu_loader_set_sampler). */
enum { N_TRAIN = 45, SIDE = 6, PER_RANK_BATCH = 4, EPOCHS = 2 };

/* Images that tell their class apart: a bright pixel where the label
   says, over a noise of the sample's own. */
static mgpu_dataset *made_up_dataset(void) {
    mgpu_dataset *d = (mgpu_dataset *)calloc(1, sizeof *d);
    d->n = N_TRAIN;
    d->rows = d->cols = SIDE;
    d->images = (unsigned char *)malloc((size_t)N_TRAIN * SIDE * SIDE);
    d->labels = (unsigned char *)malloc(N_TRAIN);
    for (int i = 0; i < N_TRAIN; i++) {
        d->labels[i] = (unsigned char)(i * 7 % 10);
        for (int p = 0; p < SIDE * SIDE; p++)
            d->images[i * SIDE * SIDE + p] = (unsigned char)((i * 31 + p * 17) % 97);
        d->images[i * SIDE * SIDE + 3 * d->labels[i]] = 255;
    }
    return d;
}

static mgpu_net *small_net(mgpu_device *dev) {
    mgpu_manual_seed(5);
    mgpu_net *net = mgpu_net_new(dev);
    mgpu_net_add_conv(net, 1, 6, 3, 1, 1);
    mgpu_net_add_relu(net);
    mgpu_net_add_global_avg_pool(net);
    mgpu_net_add_linear(net, 6, 10);
    return net;
}

/* One step on the pixels (as ToTensor: byte / 255) and labels of the
   given samples, rank 0's first. */
static void step_on(mgpu_data_parallel *dp, mgpu_device *dev, const mgpu_dataset *d, const int *samples,
                    int count) {
    float *x = (float *)malloc((size_t)count * SIDE * SIDE * sizeof(float));
    float *y = (float *)malloc((size_t)count * sizeof(float));
    for (int i = 0; i < count; i++) {
        for (int p = 0; p < SIDE * SIDE; p++)
            x[i * SIDE * SIDE + p] = (float)d->images[samples[i] * SIDE * SIDE + p] / 255.0f;
        y[i] = (float)d->labels[samples[i]];
    }
    mgpu_tensor *X = mgpu_from_host(dev, mgpu_shape4(count, 1, SIDE, SIDE), x);
    mgpu_tensor *Y = mgpu_from_host(dev, mgpu_shape1(count), y);
    mgpu_data_parallel_step(dp, X, Y, 0.2f, 0.9f, 0.0f);
    mgpu_free(X), mgpu_free(Y);
    free(x), free(y);
}

/* Which sample a loader's batch row is: its pixels, matched against the
   data set's (the made-up images all differ). */
static int sample_of(const mgpu_dataset *d, const float *pixels) {
    for (int i = 0; i < d->n; i++) {
        int p = 0;
        while (p < SIDE * SIDE && (float)d->images[i * SIDE * SIDE + p] / 255.0f == pixels[p]) p++;
        if (p == SIDE * SIDE) return i;
    }
    return -1;
}

/* Trains EPOCHS epochs; with yours, from distributed_sampler's indices,
   else from the library's loaders. The samples of each step go into
   steps[...] (room for every step of every epoch), their count per step
   into counts. Returns the trained network, or NULL where your indices
   could not make batches. */
static mgpu_net *trained(int with_yours, const mgpu_dataset *d, int *steps, int *counts, int *nsteps) {
    mgpu_device *devs[2];
    mgpu_devices(2, 0, devs);
    mgpu_net *net = small_net(devs[0]);
    mgpu_data_parallel *dp = mgpu_data_parallel_new(net, devs, 2, MGPU_DP_ALLREDUCE);
    mgpu_sampler *samplers[2];
    mgpu_loader *loaders[2];
    for (int r = 0; r < 2 && !with_yours; r++) {
        samplers[r] = mgpu_sampler_new(N_TRAIN, 2, r, 1, SEED, 0);
        loaders[r] = mgpu_loader_new(d, PER_RANK_BATCH, 0, 0);
        mgpu_loader_set_sampler(loaders[r], samplers[r]);
    }
    *nsteps = 0;
    int ok = 1;
    float *pixels = (float *)malloc((size_t)PER_RANK_BATCH * SIDE * SIDE * sizeof(float));
    for (int epoch = 0; epoch < EPOCHS && ok; epoch++) {
        int *mine[2], count[2] = {0, 0};
        if (with_yours) {
            int *order = epoch_order(N_TRAIN, 1, epoch);
            for (int r = 0; r < 2; r++) {
                mine[r] = yours(order, N_TRAIN, 2, r, 0, &count[r]);
                for (int i = 0; i < count[r]; i++) ok = ok && mine[r][i] >= 0 && mine[r][i] < N_TRAIN;
            }
            free(order);
            ok = ok && count[0] >= 0 && count[0] == count[1];
        } else
            for (int r = 0; r < 2; r++) {
                mgpu_sampler_set_epoch(samplers[r], epoch);
                mgpu_loader_start_epoch(loaders[r], epoch);
            }
        for (int k = 0; ok; k++) {
            int *samples = steps + *nsteps * 2 * PER_RANK_BATCH, n = 0;
            for (int r = 0; r < 2; r++)
                if (with_yours)
                    for (int i = k * PER_RANK_BATCH; i < count[r] && i < (k + 1) * PER_RANK_BATCH; i++)
                        samples[n++] = mine[r][i];
                else {
                    mgpu_batch b;
                    if (!mgpu_loader_next(loaders[r], &b)) continue;
                    mgpu_to_host(b.x, pixels);
                    for (int i = 0; i < b.n; i++) samples[n++] = sample_of(d, pixels + i * SIDE * SIDE);
                }
            if (n == 0) break;
            step_on(dp, devs[0], d, samples, n);
            counts[(*nsteps)++] = n;
        }
        if (with_yours)
            for (int r = 0; r < 2; r++) free(mine[r]);
    }
    free(pixels);
    for (int r = 0; r < 2 && !with_yours; r++) {
        mgpu_loader_free(loaders[r]);
        mgpu_sampler_free(samplers[r]);
    }
    mgpu_data_parallel_free(dp);
    if (!ok) {
        mgpu_net_free(net);
        return NULL;
    }
    return net;
}

TEST(trains_as_the_librarys_sampler_does) {
    told = 0;
    enum { MAX_STEPS = EPOCHS * (N_TRAIN / PER_RANK_BATCH + 2) };
    static int want_steps[MAX_STEPS * 2 * PER_RANK_BATCH], got_steps[MAX_STEPS * 2 * PER_RANK_BATCH];
    int want_counts[MAX_STEPS], got_counts[MAX_STEPS], want_n, got_n;
    mgpu_dataset *d = made_up_dataset();
    mgpu_net *library = trained(0, d, want_steps, want_counts, &want_n);
    mgpu_net *mine = trained(1, d, got_steps, got_counts, &got_n);
    if (!mine) {
        printf("  your indices for %d samples on 2 ranks make no batches: the ranks' counts differ, an index "
               "is not a sample or it wrote past its room\n", N_TRAIN);
        CHECK(mine != NULL);
    } else {
        int first_different = -1;
        for (int s = 0; s < want_n && s < got_n && first_different < 0; s++)
            if (want_counts[s] != got_counts[s] ||
                memcmp(want_steps + s * 2 * PER_RANK_BATCH, got_steps + s * 2 * PER_RANK_BATCH,
                       (size_t)want_counts[s] * sizeof(int)) != 0)
                first_different = s;
        if (first_different < 0 && want_n != got_n) first_different = want_n < got_n ? want_n : got_n;
        if (first_different >= 0) printf("  step %d of %d is the first whose samples are not the loader's\n",
                                         first_different + 1, want_n);
        double worst = 0;
        for (int p = 0; p < mgpu_net_num_params(library); p++) {
            const mgpu_tensor *x = library->params[p]->value, *y = mine->params[p]->value;
            for (size_t i = 0; i < x->numel; i++) worst = fmax(worst, fabs(mgpu_item(x, i) - mgpu_item(y, i)));
        }
        printf("  %d steps on 2 devices, %d epochs of %d samples: largest difference from the training fed by "
               "the library's loaders %.3g\n", got_n, EPOCHS, N_TRAIN, worst);
        CHECK(first_different < 0 && want_n == got_n && worst == 0);
        mgpu_net_free(mine);
    }
    mgpu_net_free(library);
    mgpu_dataset_free(d);
}

TEST_MAIN()
