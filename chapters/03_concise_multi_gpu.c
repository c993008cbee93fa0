/* Chapter 3: concise multi-GPU training.

   What it teaches. The same data parallelism as chapter 2, now behind a
   library wrapper (mgpu_data_parallel, the book's nn.DataParallel) and on a
   network big enough for it to pay: ResNet-18. The wrapper keeps a replica
   per device, splits each batch, runs forward and backward on all devices at
   once, combines the gradients and updates. Scaling the batch with the
   number of devices (256, 512, 1024) keeps each device's share of the work
   the same, and the learning rate grows with it (0.1, 0.2, 0.4).

   What you should see.
       test acc: 0.91, 18.1 sec/epoch, on [cuda:0]
       test acc: 0.92, 12.6 sec/epoch, on [cuda:0, cuda:1]
       test acc: 0.92, 13.0 sec/epoch, on [cuda:0, cuda:1, cuda:2, cuda:3]
   (the book's numbers on its machine), chapter3_test_acc.png with every
   run's curve, one PNG per run with its training loss and accuracy, and a
   table of the memory each device holds: with torch.nn.DataParallel's way
   of combining gradients (gather everything on device 0) device 0 carries
   more than the others; with an allreduce, as DistributedDataParallel does,
   the devices are even.

   On one GPU the extra devices are virtual (queues on the same GPU), so
   more devices cannot be faster, only as fast; without a GPU the chapter
   runs a reduced setting on CPU devices, to show the mechanics, and
   --full runs the book's. The reduced runs train every device count on
   the same 768 images in the same batches of 32 at the same lr, split
   among the devices, so that the runs differ in the devices alone; the
   lr falls to 0 over the run and batch norm's running statistics move
   0.3 of the way a step (PyTorch's 0.1 would take most of the run to
   forget their start, and a test would see every image alike). They
   test 3 times an epoch on 400 images, take about 4 minutes on 2 cores,
   and end with lines like
       What this run shows:
         1, 2 and 4 devices reached test accuracies of 0.76, 0.73 and 0.74 on the same batches:
         the same model, as expected. ...
         More devices did 1.05 to 1.05 times one device's images/sec: on a CPU the devices
         share its 2 cores, which one device already uses.
   images/sec being the median of the stretches between tests, held to
   the cores (or GPUs) under the devices: a figure past that bound is
   flagged, not explained.

   Reads: mgpu/data_parallel.h, mgpu/data_parallel_step.h (the wrapper and its
   step), mgpu/communication.h (the ring and NCCL), mgpu/networks.h and
   mgpu/net_training.h (ResNet-18 and its training), mgpu/data.h,
   mgpu/settings.h (MGPU_CONV, MGPU_CHECK_REPLICAS), mgpu/flags.h. */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"

typedef struct {
    int devices, batch_size, epochs;
    float lr;
    int evals_per_epoch; /* test accuracy this many times an epoch (the book: once) */
    int lr_to_zero;      /* lr falls linearly to 0 over the run (the reduced run) */
    float bn_momentum;   /* batch norm's running statistics (PyTorch's 0.1) */
} run_config;

/* What a run leaves for the chapter's last lines. */
typedef struct {
    mgpu_animator *curves;
    double test_acc, images_per_second;
} run_result;

/* Trains a fresh ResNet-18 on `devices` devices. */
static run_result train(const run_config *c, int use_gpu, const mgpu_dataset *train_set,
                            const mgpu_dataset *test_set, const mgpu_options *o) {
    mgpu_device *devices[MGPU_MAX_DEVICES];
    mgpu_devices(c->devices, use_gpu, devices);
    mgpu_manual_seed(o->seed);
    mgpu_net *net = mgpu_resnet18(10, 1, devices[0]);
    mgpu_net_set_batchnorm_momentum(net, c->bn_momentum);
    mgpu_data_parallel *dp = mgpu_data_parallel_new(net, devices, c->devices, MGPU_DP_ALLREDUCE);
    /* The weights' random initialisation and their copies to the devices
       are queued work: waiting for them here keeps building the model out
       of the first epoch's time, as in the book, where PyTorch builds it
       before the timer starts. */
    mgpu_synchronize_all();

    char list[256], name[64], path[1024], title[320];
    mgpu_device_list(list, sizeof list, devices, c->devices);
    snprintf(name, sizeof name, "chapter3_%d_device%s.png", c->devices, c->devices > 1 ? "s" : "");
    snprintf(title, sizeof title, "ResNet-18 on %s, batch %d, lr %.2f", list, c->batch_size, c->lr);
    const char *series[] = {"train loss", "train acc", "test acc"};
    /* (several evaluations an epoch put points between the epochs, from 0) */
    mgpu_animator *animator = mgpu_animator_new(mgpu_out_path(o, name, path, sizeof path), title, "epoch", "",
                                                c->evals_per_epoch > 1 ? 0 : 1, c->epochs, 3, series);
    mgpu_loader *loader = mgpu_loader_new(train_set, c->batch_size, 1, o->seed);
    int steps = mgpu_loader_num_batches(loader), total_steps = steps * c->epochs;
    /* images/sec: the median of the stretches between tests (each ends
       waiting for its steps), so that a burst of other work on a shared
       machine slows one stretch, not the figure */
    double train_seconds = 0, segment_seconds = 0, rates[MGPU_TIMER_MAX * 4];
    int segment_images = 0, nrates = 0;
    for (int epoch = 0; epoch < c->epochs; epoch++) {
        mgpu_loader_start_epoch(loader, epoch);
        double epoch_seconds = 0, loss = 0, correct = 0;
        int seen = 0, evals = 0;
        mgpu_net_set_training(net, 1); /* (evaluation puts it back as it found it) */
        for (int step = 0; step < steps; step++) {
            double start = mgpu_now();
            mgpu_batch b;
            MGPU_REQUIRE(mgpu_loader_next(loader, &b), "chapter3: the loader ended before step %d", step);
            int done = epoch * steps + step; /* steps before this one */
            float lr = c->lr_to_zero ? c->lr * (float)(total_steps - done) / (float)total_steps : c->lr;
            mgpu_data_parallel_step(dp, b.x, b.y, lr, 0.0f, 0.0f);
            seen += b.n;
            segment_images += b.n;
            /* evaluate after each evals_per_epoch-th of the steps, the last one included */
            int eval_now = (long long)(step + 1) * c->evals_per_epoch / steps > evals;
            if (!eval_now) {
                epoch_seconds += mgpu_now() - start;
                segment_seconds += mgpu_now() - start;
                continue;
            }
            double segment_loss, segment_correct;
            mgpu_data_parallel_take_stats(dp, &segment_loss, &segment_correct); /* waits for the steps */
            epoch_seconds += mgpu_now() - start;
            segment_seconds += mgpu_now() - start;
            if (nrates < (int)(sizeof rates / sizeof rates[0])) rates[nrates++] = segment_images / segment_seconds;
            segment_images = 0, segment_seconds = 0;
            loss += segment_loss;
            correct += segment_correct;
            evals++;
            /* evaluation on device 0 with the plain network (the seed's .module), untimed */
            double test_acc = mgpu_net_evaluate_accuracy(net, test_set, 256);
            double ys[3] = {loss / seen, correct / seen, test_acc}; /* the epoch so far */
            mgpu_animator_add(animator, epoch + (step + 1.0) / steps, ys);
            if (step + 1 == steps) /* (to the millisecond: bench/run.sh reads these lines) */
                fprintf(stderr, "  epoch %d/%d: loss %.3f, train acc %.3f, test acc %.3f, %.3f sec\n",
                        epoch + 1, c->epochs, ys[0], ys[1], test_acc, epoch_seconds);
        }
        train_seconds += epoch_seconds;
    }
    double per_epoch = train_seconds / c->epochs;
    run_result r = {animator, mgpu_animator_last(animator, 2), mgpu_median(rates, nrates)};
    printf("test acc: %.2f, %.*f sec/epoch, %.0f images/sec, on %s (gradients: %s)\n", r.test_acc,
           MGPU_SECONDS(per_epoch), r.images_per_second, list, mgpu_data_parallel_algorithm(dp));
    fflush(stdout);
    mgpu_loader_free(loader);
    mgpu_data_parallel_free(dp);
    mgpu_net_free(net);
    return r;
}

/* A few steps with each way of combining gradients, then every device's
   peak memory: where DataParallel's device 0 pays for gathering. */
static void memory_table(int ndevices, int batch_size, int use_gpu, const mgpu_dataset *train_set) {
    mgpu_device *devices[MGPU_MAX_DEVICES];
    mgpu_devices(ndevices, use_gpu, devices);
    static const char *mode_names[2] = {"gather on device 0 (DataParallel)", "allreduce (DDP)"};
    printf("\npeak memory per device, %d devices, batch %d (MiB):\n", ndevices, batch_size);
    printf("  %-36s", "");
    for (int i = 0; i < ndevices; i++) printf(" %10s", mgpu_device_name(devices[i]));
    printf("\n");
    for (int mode = 0; mode < 2; mode++) {
        mgpu_synchronize_all();
        for (int i = 0; i < ndevices; i++) mgpu_device_reset_peak(devices[i]);
        size_t base[MGPU_MAX_DEVICES];
        for (int i = 0; i < ndevices; i++) base[i] = mgpu_device_memory_in_use(devices[i]);
        mgpu_net *net = mgpu_resnet18(10, 1, devices[0]);
        mgpu_data_parallel *dp = mgpu_data_parallel_new(
            net, devices, ndevices, mode == 0 ? MGPU_DP_GATHER : MGPU_DP_ALLREDUCE);
        mgpu_loader *loader = mgpu_loader_new(train_set, batch_size, 1, 1);
        mgpu_loader_start_epoch(loader, 0);
        mgpu_batch b;
        for (int step = 0; step < 2 && mgpu_loader_next(loader, &b); step++)
            mgpu_data_parallel_step(dp, b.x, b.y, 0.1f, 0.0f, 0.0f);
        mgpu_synchronize_all();
        printf("  %-36s", mode_names[mode]);
        for (int i = 0; i < ndevices; i++)
            printf(" %10.1f", (mgpu_device_memory_peak(devices[i]) - base[i]) / 1048576.0);
        printf("\n");
        mgpu_loader_free(loader);
        mgpu_data_parallel_free(dp);
        mgpu_net_free(net);
    }
}

/* One traced training step on 2 devices: the timeline shows each bucket's
   reduction (on the copy queues) running under the rest of the backward
   pass (on the compute queues). */
static void step_timeline(int batch_size, int use_gpu, const mgpu_dataset *train_set,
                          const mgpu_options *o) {
    mgpu_device *devices[2];
    mgpu_devices(2, use_gpu, devices);
    mgpu_net *net = mgpu_resnet18(10, 1, devices[0]);
    mgpu_data_parallel *dp = mgpu_data_parallel_new(net, devices, 2, MGPU_DP_ALLREDUCE);
    mgpu_loader *loader = mgpu_loader_new(train_set, batch_size, 0, 0);
    mgpu_loader_start_epoch(loader, 0);
    mgpu_batch b;
    if (mgpu_loader_next(loader, &b)) {
        mgpu_data_parallel_step(dp, b.x, b.y, 0.1f, 0.0f, 0.0f); /* warm-up: buckets, caches */
        mgpu_trace_begin();
        mgpu_data_parallel_step(dp, b.x, b.y, 0.1f, 0.0f, 0.0f);
        mgpu_trace_end();
        char path[1024];
        if (mgpu_trace_write_png(mgpu_out_path(o, "chapter3_step_timeline.png", path, sizeof path),
                                 "one ResNet-18 step on 2 devices: gradient buckets reduced under backward") == 0)
            printf("step timeline (%s, buckets of 25 MiB): %s\n", mgpu_data_parallel_algorithm(dp), path);
    }
    mgpu_loader_free(loader);
    mgpu_data_parallel_free(dp);
    mgpu_net_free(net);
}

/* The chapter's last lines, from its own numbers: whether the runs
   trained the same model, and whether more devices were faster than the
   hardware under them allows. */
static void what_this_run_shows(const run_result *r, int nruns, int same_batches, int use_gpu) {
    double lowest = r[0].test_acc, highest = r[0].test_acc;
    char accuracies[128] = "", devices[64] = "";
    for (int i = 0; i < nruns; i++) {
        lowest = fmin(lowest, r[i].test_acc), highest = fmax(highest, r[i].test_acc);
        const char *sep = i == 0 ? "" : i + 1 == nruns ? " and " : ", ";
        snprintf(accuracies + strlen(accuracies), sizeof accuracies - strlen(accuracies), "%s%.2f", sep, r[i].test_acc);
        snprintf(devices + strlen(devices), sizeof devices - strlen(devices), "%s%d", sep, 1 << i);
    }
    printf("\nWhat this run shows:\n");
    if (nruns < 2) {
        printf("  one run alone: give --devices 2 or more to compare devices.\n");
        return;
    }
    if (same_batches && highest - lowest <= 0.05)
        printf("  %s devices reached test accuracies of %s on the same batches:\n"
               "  the same model, as expected. Each device computed the gradient of its share,\n"
               "  and the shares were summed: only the order of the sums (and batch norm's\n"
               "  statistics, taken per device) changed.\n",
               devices, accuracies);
    else if (same_batches)
        printf("  %s devices reached %s on the same batches: %.2f apart, more than the 0.05 that\n"
               "  the order of the sums and batch norm's per-device statistics explain. Train\n"
               "  longer (--epochs) for the runs to settle.\n",
               devices, accuracies, highest - lowest);
    else
        printf("  %s devices, k times the batch and the learning rate, reached %s.\n", devices, accuracies);
    /* k devices share what is under them: the CPU's cores, or the GPUs */
    int units = use_gpu ? mgpu_num_gpus() : mgpu_num_cores();
    int held = 1;
    double least = HUGE_VAL, most = 0;
    for (int i = 1; i < nruns; i++) {
        int k = 1 << i;
        double ratio = r[i].images_per_second / r[0].images_per_second;
        char figure[64];
        snprintf(figure, sizeof figure, "%d devices' images/sec over one device's", k);
        held &= mgpu_bound_hold(figure, ratio, MGPU_AT_MOST, k < units ? k : units, 0.05, "rerun on a quiet machine");
        least = fmin(least, ratio), most = fmax(most, ratio);
    }
    if (!held) return;
    printf("  More devices did %.2f to %.2f times one device's images/sec", least, most);
    if (use_gpu)
        printf(", on %d GPU%s.\n", units, units > 1 ? "s" : "");
    else
        printf(": on a CPU the devices\n  share its %d cores, which one device already uses.\n", units);
}

int main(int argc, char **argv) {
    mgpu_options o;
    memset(&o, 0, sizeof o);
    o.seed = 1; /* epochs: 0 until parsed, then the book's 10 or the reduced run's 2 */
    int train_samples = 0, test_samples = 0;
    const mgpu_flag extra[] = {
        {"--train-samples", 'i', &train_samples,
         "training images per device: a run on k devices takes the first k N (all 60000 at most); "
         "reduced run: every run's"},
        {"--test-samples", 'i', &test_samples, "use the first N test images"},
        {"--batch-size", 'i', &o.batch_size,
         "batch per device (the book's 256): k devices take k times it; reduced run: every run's whole batch"},
        {"--lr", 'd', &o.lr,
         "learning rate of one device (the book's 0.1): k devices take k times it; reduced run: every "
         "run's, falling to 0"},
        {"--devices", 'i', &o.devices, "runs on 1, 2, 4, ... devices, up to N"},
    };
    mgpu_options_parse(&o, argc, argv,
                       "chapter3: ResNet-18 on 1, 2 and 4 devices with a DataParallel-style wrapper",
                       extra, (int)(sizeof extra / sizeof extra[0]));
    int max_devices = o.devices ? o.devices : 4; /* runs on 1, 2, 4, ... up to this many */
    int use_gpu = !o.cpu && mgpu_num_gpus() > 0;
    int reduced = !use_gpu && !o.full;
    /* The book: batch 256 per device and lr 0.1 per 256, so k devices take
       k times both (and, with --train-samples, k times the images). The
       reduced run: every run the same images in the same batches of 32 at
       the same lr, split among its k devices, so that the runs differ in
       the devices alone; the lr falls to 0 over the run so that the last
       tests see a settled network, not the noise of its last steps. And
       batch norm's running statistics move 0.3 of the way a step, not
       0.1: the book's weights (Normal(0, 0.01)) give activations of a
       variance near 1e-3, and from its start of 1 the running variance
       would take some 70 steps at 0.1 to reach them; until then a test
       sees every image alike. */
    int batch = o.batch_size ? o.batch_size : reduced ? 32 : 256;
    double lr = o.lr ? o.lr : reduced ? 0.05 : 0.1;
    if ((long long)batch * max_devices > 1000000000)
        mgpu_fatal("--batch-size %d: %d devices would take a batch of more than 10^9", batch, max_devices);
    if (reduced && batch % max_devices)
        mgpu_fatal("--batch-size %d: the reduced run splits it among up to %d devices; want a multiple of %d",
                   batch, max_devices, max_devices);
    if (reduced) {
        if (!train_samples) train_samples = 768;
        if (!test_samples) test_samples = 400;
        if (!o.epochs) o.epochs = 2;
        printf("No GPU: a reduced run on CPU devices: %d training images, %d test images, %d epochs, batch "
               "%d, lr %g falling to 0, tested 3 times an epoch (--full: the book's setting).\n",
               train_samples, test_samples, o.epochs, batch, lr);
        printf("Every run trains on the same batches, split among its devices: k devices should train "
               "the same model as one.\n");
    }
    if (!o.epochs) o.epochs = 10;
    if (use_gpu) printf("GPU arithmetic: %s; MGPU_TF32=0 or 1 changes it.\n", mgpu_tf32_str());
    mgpu_dataset *train_set = NULL, *test_set = NULL;
    mgpu_dataset_load_fashion_mnist(mgpu_data_dir(o.data), &train_set, &test_set);
    if ((long long)train_samples * (reduced ? 1 : max_devices) > train_set->n) /* (every run the same steps) */
        mgpu_fatal("--train-samples %d: %d devices would take %lld images, the training set has %d",
                   train_samples, reduced ? 1 : max_devices,
                   (long long)train_samples * (reduced ? 1 : max_devices), train_set->n);
    if (test_samples > test_set->n)
        mgpu_fatal("--test-samples %d: the test set has %d images", test_samples, test_set->n);
    mgpu_dataset_truncate(test_set, test_samples);

    mgpu_animator *runs[8];
    run_result results[8];
    char labels[8][32];
    const char *label_ptrs[8];
    int nruns = 0;
    for (int k = 1; k <= max_devices && nruns < 8; k *= 2, nruns++) {
        run_config book = {k, batch * k, o.epochs, (float)(lr * k), 1, 0, 0.1f};
        run_config same_batches = {k, batch, o.epochs, (float)lr, 3, 1, 0.3f};
        run_config c = reduced ? same_batches : book;
        int images = !train_samples ? train_set->n : reduced ? train_samples : train_samples * k;
        mgpu_dataset *subset = mgpu_dataset_subset(train_set, images);
        results[nruns] = train(&c, use_gpu, subset, test_set, &o);
        runs[nruns] = results[nruns].curves;
        mgpu_dataset_free(subset);
        if (train_samples && !reduced)
            snprintf(labels[nruns], sizeof labels[nruns], "%d device%s, %d images", k, k > 1 ? "s" : "", images);
        else
            snprintf(labels[nruns], sizeof labels[nruns], "%d device%s", k, k > 1 ? "s" : "");
        label_ptrs[nruns] = labels[nruns];
    }
    char path[1024];
    if (mgpu_animator_write_combined(mgpu_out_path(&o, "chapter3_test_acc.png", path, sizeof path),
                                     "ResNet-18 test accuracy", nruns,
                                     (const mgpu_animator *const *)runs, 2, label_ptrs) == 0 &&
        !mgpu_output_errors()) /* (the runs' own plots too) */
        printf("plots: %s, and one chapter3_<N>_device(s).png per run beside it\n", path);

    int per_device = reduced ? batch / max_devices : batch;
    memory_table(max_devices >= 2 ? 2 : 1, per_device * 2, use_gpu, train_set);
    step_timeline(per_device * 2, use_gpu, train_set, &o);
    what_this_run_shows(results, nruns, reduced, use_gpu);

    for (int i = 0; i < nruns; i++) mgpu_animator_free(runs[i]);
    mgpu_dataset_free(train_set);
    mgpu_dataset_free(test_set);
    return mgpu_output_errors() ? 1 : 0; /* (each said so on stderr) */
}
