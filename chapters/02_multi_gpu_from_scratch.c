/* Chapter 2: multi-GPU training from scratch.

   What it teaches. Data parallelism by hand, on a small LeNet built from
   raw parameter tensors: every device keeps a full copy of the parameters
   (get_params); each minibatch is split across the devices (split_batch);
   every device computes the loss and the gradients of its own part; the
   gradients are summed across devices and the sum sent back to each
   (allreduce); then every device takes the same SGD step, so the copies
   stay identical. With the same batch size and learning rate, 1 device and
   2 devices follow the same path: the split changes where the work is
   done, not what is computed.

   What you should see. The parameters and b1's (zero) gradient on device
   0; a vector on two devices before and after allreduce; a 4x5 matrix
   scattered onto two devices; then two training runs of 10 epochs each:
       test acc: 0.84, 2.2 sec/epoch, on [cuda:0]
       test acc: 0.84, 1.9 sec/epoch, on [cuda:0, cuda:1]
   and chapter2_test_acc.png with both runs' test accuracy, plus one PNG
   per run with train loss, train accuracy and test accuracy.

   The model is too small for two devices to speed it up: most of the time
   goes into moving the data and launching small operations, as in the book.

   Reads: mgpu/communication.h (the book's get_params, allreduce and
   split_batch), mgpu/layers.h and mgpu/convolution.h (LeNet's layers),
   mgpu/training_ops.h (the loss and SGD), mgpu/data.h, mgpu/plots.h (the
   Animator), mgpu/flags.h (the flags). */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"

enum { NUM_PARAMS = 8 };
static const char *param_names[NUM_PARAMS] = {"W1", "b1", "W2", "b2", "W3", "b3", "W4", "b4"};

/* The book's modified LeNet: conv(1->20, 3x3), ReLU, 2x2 average pool,
   conv(20->50, 5x5), ReLU, pool, then 800 -> 128 -> 10 fully connected. */
static void lenet_init(mgpu_tensor **params) {
    const float scale = 0.01f;
    mgpu_device *cpu = mgpu_cpu();
    params[0] = mgpu_randn(cpu, mgpu_shape4(20, 1, 3, 3), 0, scale);
    params[1] = mgpu_zeros(cpu, mgpu_shape1(20));
    params[2] = mgpu_randn(cpu, mgpu_shape4(50, 20, 5, 5), 0, scale);
    params[3] = mgpu_zeros(cpu, mgpu_shape1(50));
    params[4] = mgpu_randn(cpu, mgpu_shape2(800, 128), 0, scale);
    params[5] = mgpu_zeros(cpu, mgpu_shape1(128));
    params[6] = mgpu_randn(cpu, mgpu_shape2(128, 10), 0, scale);
    params[7] = mgpu_zeros(cpu, mgpu_shape1(10));
}

/* Everything one device needs for a step: its copy of the parameters and
   the activations and their gradients, kept between steps so a step
   allocates nothing once the batch shapes have been seen. */
typedef struct {
    mgpu_device *device;
    mgpu_param params[NUM_PARAMS];
    mgpu_tensor *h1, *a1, *p1, *h2, *a2, *p2, *h3, *a3, *logits, *losses, *count;
    mgpu_tensor *dlogits, *da3, *dh3, *dp2, *da2, *dh2, *dp1, *da1, *dh1;
} replica;

static mgpu_tensor *lenet_forward(replica *r, const mgpu_tensor *x) {
    mgpu_device *d = r->device;
    int n = x->shape.d[0];
    mgpu_param *p = r->params;
    mgpu_ensure(&r->h1, d, mgpu_conv2d_output_shape(x->shape, p[0].value->shape, 1, 0));
    mgpu_conv2d_forward(r->h1, x, p[0].value, p[1].value, 1, 0);
    mgpu_relu_forward(mgpu_ensure(&r->a1, d, r->h1->shape), r->h1);
    mgpu_ensure(&r->p1, d, mgpu_avg_pool2d_output_shape(r->a1->shape, 2));
    mgpu_avg_pool2d_forward(r->p1, r->a1, 2);
    mgpu_ensure(&r->h2, d, mgpu_conv2d_output_shape(r->p1->shape, p[2].value->shape, 1, 0));
    mgpu_conv2d_forward(r->h2, r->p1, p[2].value, p[3].value, 1, 0);
    mgpu_relu_forward(mgpu_ensure(&r->a2, d, r->h2->shape), r->h2);
    mgpu_ensure(&r->p2, d, mgpu_avg_pool2d_output_shape(r->a2->shape, 2));
    mgpu_avg_pool2d_forward(r->p2, r->a2, 2);
    mgpu_tensor *flat = mgpu_view(r->p2, mgpu_shape2(n, 800)); /* reshape(n, -1) */
    mgpu_linear_forward(mgpu_ensure(&r->h3, d, mgpu_shape2(n, 128)), flat, p[4].value, p[5].value);
    mgpu_relu_forward(mgpu_ensure(&r->a3, d, r->h3->shape), r->h3);
    mgpu_linear_forward(mgpu_ensure(&r->logits, d, mgpu_shape2(n, 10)), r->a3, p[6].value, p[7].value);
    mgpu_free(flat);
    return r->logits;
}

/* The loss is the SUM of the per-sample losses (the book's l.sum()), so
   d loss / d logits has scale 1; sgd divides by the whole batch size. The
   parameter gradients accumulate (accumulate = 1), like .grad in PyTorch. */
static void lenet_backward(replica *r, const mgpu_tensor *x, const mgpu_tensor *y) {
    mgpu_device *d = r->device;
    mgpu_param *p = r->params;
    int n = x->shape.d[0];
    mgpu_cross_entropy_backward(mgpu_ensure(&r->dlogits, d, r->logits->shape), r->logits, y, 1.0f);
    mgpu_linear_backward(mgpu_ensure(&r->da3, d, r->a3->shape), p[6].grad, p[7].grad, r->dlogits,
                         r->a3, p[6].value, 1);
    mgpu_relu_backward(mgpu_ensure(&r->dh3, d, r->h3->shape), r->da3, r->a3);
    mgpu_tensor *flat = mgpu_view(r->p2, mgpu_shape2(n, 800));
    mgpu_tensor *dflat = mgpu_view(mgpu_ensure(&r->dp2, d, r->p2->shape), mgpu_shape2(n, 800));
    mgpu_linear_backward(dflat, p[4].grad, p[5].grad, r->dh3, flat, p[4].value, 1);
    mgpu_avg_pool2d_backward(mgpu_ensure(&r->da2, d, r->a2->shape), r->dp2, 2);
    mgpu_relu_backward(mgpu_ensure(&r->dh2, d, r->h2->shape), r->da2, r->a2);
    mgpu_conv2d_backward(mgpu_ensure(&r->dp1, d, r->p1->shape), p[2].grad, p[3].grad, r->dh2, r->p1,
                         p[2].value, 1, 0, 1);
    mgpu_avg_pool2d_backward(mgpu_ensure(&r->da1, d, r->a1->shape), r->dp1, 2);
    mgpu_relu_backward(mgpu_ensure(&r->dh1, d, r->h1->shape), r->da1, r->a1);
    mgpu_conv2d_backward(NULL, p[0].grad, p[1].grad, r->dh1, x, p[0].value, 1, 0, 1);
    mgpu_free(flat);
    mgpu_free(dflat);
}

static void replica_free(replica *r) {
    mgpu_params_free(r->params, NUM_PARAMS);
    mgpu_tensor **all[] = {&r->h1, &r->a1, &r->p1, &r->h2, &r->a2, &r->p2, &r->h3, &r->a3,
                           &r->logits, &r->losses, &r->count, &r->dlogits, &r->da3, &r->dh3, &r->dp2,
                           &r->da2, &r->dh2, &r->dp1, &r->da1, &r->dh1};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) mgpu_free(*all[i]);
}

/* One minibatch on every device: the book's train_batch. */
static void train_batch(const mgpu_tensor *X, const mgpu_tensor *y, replica *replicas, int n,
                        float lr, mgpu_tensor **loss_sum, mgpu_tensor **correct) {
    mgpu_device *devices[MGPU_MAX_DEVICES] = {0};
    mgpu_tensor *X_shards[MGPU_MAX_DEVICES], *y_shards[MGPU_MAX_DEVICES];
    for (int i = 0; i < n; i++) devices[i] = replicas[i].device;
    int used = mgpu_split_batch(X, y, devices, n, X_shards, y_shards);
    /* forward and backward on each device: they run at the same time */
    for (int i = 0; i < used; i++) {
        replica *r = &replicas[i];
        mgpu_tensor *logits = lenet_forward(r, X_shards[i]);
        mgpu_cross_entropy_forward(mgpu_ensure(&r->losses, r->device, mgpu_shape1(X_shards[i]->shape.d[0])),
                                   logits, y_shards[i]);
        mgpu_tensor *count = mgpu_ensure(&r->count, r->device, mgpu_shape1(1));
        mgpu_sum(count, r->losses);
        mgpu_add_(loss_sum[i], count);
        mgpu_accuracy_count(count, logits, y_shards[i]);
        mgpu_add_(correct[i], count);
        lenet_backward(r, X_shards[i], y_shards[i]);
    }
    /* a short last batch can leave devices without rows: they add nothing */
    for (int i = used; i < n; i++)
        for (int k = 0; k < NUM_PARAMS; k++) mgpu_fill(replicas[i].params[k].grad, 0.0f);
    /* sum every gradient across the devices, and send the sum back to each */
    for (int k = 0; k < NUM_PARAMS; k++) {
        mgpu_tensor *grads[MGPU_MAX_DEVICES];
        for (int i = 0; i < n; i++) grads[i] = replicas[i].params[k].grad;
        mgpu_allreduce(grads, n);
    }
    /* the same update on each device, with the size of the whole batch */
    for (int i = 0; i < n; i++)
        for (int k = 0; k < NUM_PARAMS; k++)
            mgpu_sgd_book(replicas[i].params[k].value, replicas[i].params[k].grad, lr, X->shape.d[0]);
    for (int i = 0; i < used; i++) {
        mgpu_free(X_shards[i]);
        mgpu_free(y_shards[i]);
    }
}

/* The model for mgpu_evaluate_accuracy: a replica's LeNet. */
static mgpu_tensor *lenet_forward_fn(void *model, const mgpu_tensor *x) {
    return lenet_forward((replica *)model, x);
}

/* The book's train(num_gpus, batch_size, lr). */
static mgpu_animator *train(mgpu_tensor **params, int num_devices, int use_gpu,
                            const mgpu_dataset *train_set, const mgpu_dataset *test_set,
                            int batch_size, float lr, int epochs, const mgpu_options *o,
                            double *seconds_per_epoch) {
    mgpu_device *devices[MGPU_MAX_DEVICES];
    mgpu_devices(num_devices, use_gpu, devices);
    replica replicas[MGPU_MAX_DEVICES];
    memset(replicas, 0, sizeof replicas);
    mgpu_tensor *loss_sum[MGPU_MAX_DEVICES], *correct[MGPU_MAX_DEVICES];
    for (int i = 0; i < num_devices; i++) {
        replicas[i].device = devices[i];
        mgpu_get_params(replicas[i].params, params, NUM_PARAMS, devices[i]);
        loss_sum[i] = mgpu_zeros(devices[i], mgpu_shape1(1));
        correct[i] = mgpu_zeros(devices[i], mgpu_shape1(1));
    }
    char list[256], name[64], path[1024];
    mgpu_device_list(list, sizeof list, devices, num_devices);
    snprintf(name, sizeof name, "chapter2_%d_device%s.png", num_devices, num_devices > 1 ? "s" : "");
    const char *series[] = {"train loss", "train acc", "test acc"};
    char title[300];
    snprintf(title, sizeof title, "LeNet on %s, batch %d, lr %.2f", list, batch_size, lr);
    mgpu_animator *animator = mgpu_animator_new(mgpu_out_path(o, name, path, sizeof path), title,
                                                "epoch", "", 1, epochs, 3, series);
    mgpu_loader *train_loader = mgpu_loader_new(train_set, batch_size, 1, o->seed);
    mgpu_synchronize_all(); /* the copies above are queued: they belong to the set-up, not the epoch */
    mgpu_timer timer;
    mgpu_timer_init(&timer);
    for (int epoch = 0; epoch < epochs; epoch++) {
        mgpu_timer_start(&timer);
        mgpu_loader_start_epoch(train_loader, epoch);
        mgpu_batch b;
        while (mgpu_loader_next(train_loader, &b)) {
            train_batch(b.x, b.y, replicas, num_devices, lr, loss_sum, correct);
            mgpu_synchronize_all(); /* as the book does after every batch */
        }
        double seconds = mgpu_timer_stop(&timer);
        double loss = 0, right = 0;
        for (int i = 0; i < num_devices; i++) {
            loss += mgpu_item(loss_sum[i], 0);
            right += mgpu_item(correct[i], 0);
            mgpu_fill(loss_sum[i], 0);
            mgpu_fill(correct[i], 0);
        }
        /* the book evaluates on device 0 only, the others wait */
        double test_acc = mgpu_evaluate_accuracy(lenet_forward_fn, &replicas[0], devices[0],
                                                 test_set, 256);
        double ys[3] = {loss / train_set->n, right / train_set->n, test_acc};
        mgpu_animator_add(animator, epoch + 1, ys);
        fprintf(stderr, "  epoch %d/%d: loss %.3f, train acc %.3f, test acc %.3f, %.*f sec\n",
                epoch + 1, epochs, ys[0], ys[1], ys[2], MGPU_SECONDS(seconds));
    }
    *seconds_per_epoch = mgpu_timer_avg(&timer);
    printf("test acc: %.2f, %.*f sec/epoch, on %s\n", mgpu_animator_last(animator, 2),
           MGPU_SECONDS(*seconds_per_epoch), list);
    fflush(stdout);
    mgpu_loader_free(train_loader);
    for (int i = 0; i < num_devices; i++) {
        replica_free(&replicas[i]);
        mgpu_free(loss_sum[i]);
        mgpu_free(correct[i]);
    }
    return animator;
}

/* The chapter's last lines, from its own numbers. */
static void what_this_run_shows(mgpu_animator **runs, const double *seconds, const int *sizes, int nruns,
                                int use_gpu) {
    printf("\nWhat this run shows:\n");
    if (nruns < 2) {
        printf("  one run alone: --devices 2 compares two devices with one.\n");
        return;
    }
    double acc1 = mgpu_animator_last(runs[0], 2), acc2 = mgpu_animator_last(runs[1], 2);
    if (fabs(acc1 - acc2) <= 0.05)
        printf("  1 and %d devices reached %.2f and %.2f with the same batches and learning rate:\n"
               "  the same model, as expected. The split changed where the gradients were\n"
               "  computed and the order of their sums, not what was computed.\n",
               sizes[1], acc1, acc2);
    else
        printf("  1 and %d devices reached %.2f and %.2f with the same batches: %.2f apart, more than\n"
               "  the order of the sums explains. Train longer (--epochs) for the runs to settle.\n",
               sizes[1], acc1, acc2, fabs(acc1 - acc2));
    /* k devices are at most k times as fast, and at most as many times as
       the GPUs, or the cores, under them */
    double speedup = seconds[0] / seconds[1];
    int units = use_gpu ? mgpu_num_gpus() : mgpu_num_cores();
    double most = sizes[1] < units ? sizes[1] : units;
    if (!mgpu_bound_hold("speedup of 2 devices", speedup, MGPU_AT_MOST, most, 0.05, "rerun on a quiet machine"))
        return;
    printf("  %d devices took %.2f times one device's time an epoch%s\n", sizes[1], seconds[1] / seconds[0],
           speedup > 1.0 ? ": each computed half of every batch at the same time."
                         : ": LeNet is too small for the split\n  to pay for the copies and the extra launches.");
}

int main(int argc, char **argv) {
    mgpu_options o;
    memset(&o, 0, sizeof o);
    o.lr = 0.2; /* epochs and batch size: 0 until parsed, then the book's or the reduced run's */
    o.seed = 1;
    int train_samples = 0;
    const mgpu_flag extra[] = {
        {"--train-samples", 'i', &train_samples, "use the first N training images (default: all on a GPU)"},
    };
    mgpu_options_parse(&o, argc, argv,
                       "chapter2: data-parallel training of a LeNet from scratch on 1 and 2 devices",
                       extra, (int)(sizeof extra / sizeof extra[0]));
    int use_gpu = !o.cpu && mgpu_num_gpus() > 0;
    int reduced = !use_gpu && !o.full;
    /* A small LeNet starting at scale 0.01 needs a few hundred steps to
       leave its first plateau: the reduced run takes smaller batches. */
    if (!o.epochs) o.epochs = reduced ? 5 : 10;
    if (!o.batch_size) o.batch_size = reduced ? 64 : 256;
    if (reduced) {
        if (!train_samples) train_samples = 10000;
        printf("No GPU: a reduced run, %d training images, %d epochs, batch %d "
               "(--full: 60000, 10 and 256).\n", train_samples, o.epochs, o.batch_size);
    }
    if (use_gpu) printf("GPU arithmetic: %s; MGPU_TF32=0 or 1 changes it.\n", mgpu_tf32_str());

    mgpu_dataset *train_set = NULL, *test_set = NULL;
    mgpu_dataset_load_fashion_mnist(mgpu_data_dir(o.data), &train_set, &test_set);
    if (train_samples > train_set->n)
        mgpu_fatal("--train-samples %d: the training set has %d images", train_samples, train_set->n);
    mgpu_dataset_truncate(train_set, train_samples);

    /* 1. the parameters, and a copy on device 0 */
    mgpu_manual_seed(o.seed);
    mgpu_tensor *params[NUM_PARAMS];
    lenet_init(params);
    printf("LeNet parameters:");
    for (int k = 0; k < NUM_PARAMS; k++) {
        char s[64];
        printf(" %s %s", param_names[k], mgpu_shape_str(params[k]->shape, s, sizeof s));
    }
    printf("\n");
    mgpu_device *dev0 = use_gpu ? mgpu_try_gpu(0) : mgpu_cpu();
    mgpu_param on_dev0[NUM_PARAMS];
    mgpu_get_params(on_dev0, params, NUM_PARAMS, dev0);
    mgpu_print("b1 weight: ", on_dev0[1].value);
    mgpu_print("b1 grad: ", on_dev0[1].grad);
    mgpu_params_free(on_dev0, NUM_PARAMS);

    /* 2. allreduce: add everything up, send the sum back to every device */
    mgpu_device *two[2];
    mgpu_devices(2, use_gpu, two);
    mgpu_tensor *data[2];
    for (int i = 0; i < 2; i++) data[i] = mgpu_full(two[i], mgpu_shape2(1, 2), (float)(i + 1));
    printf("\nbefore allreduce:\n");
    mgpu_print(" ", data[0]);
    mgpu_print(" ", data[1]);
    mgpu_allreduce(data, 2);
    printf("after allreduce:\n");
    mgpu_print(" ", data[0]);
    mgpu_print(" ", data[1]);
    mgpu_free(data[0]);
    mgpu_free(data[1]);

    /* 3. scatter a 4x5 matrix onto two devices */
    mgpu_tensor *x = mgpu_arange(mgpu_cpu(), mgpu_shape2(4, 5));
    mgpu_tensor *split[2];
    char list[128];
    mgpu_scatter(x, two, 2, split);
    printf("\n");
    mgpu_print("input: ", x);
    printf("load into %s\n", mgpu_device_list(list, sizeof list, two, 2));
    mgpu_print("output: ", split[0]);
    mgpu_print("        ", split[1]);
    mgpu_free(split[0]);
    mgpu_free(split[1]);
    mgpu_free(x);

    /* 4. train on 1 and on 2 (--devices) devices, same batch size and learning rate */
    printf("\n");
    int sizes[2] = {1, o.devices ? o.devices : 2}, nruns = sizes[1] > 1 ? 2 : 1;
    mgpu_animator *runs[2];
    double seconds[2];
    char labels[2][32];
    const char *label_ptrs[2];
    for (int k = 0; k < nruns; k++) {
        runs[k] = train(params, sizes[k], use_gpu, train_set, test_set, o.batch_size, (float)o.lr,
                        o.epochs, &o, &seconds[k]);
        snprintf(labels[k], sizeof labels[k], "%d device%s", sizes[k], sizes[k] > 1 ? "s" : "");
        label_ptrs[k] = labels[k];
    }
    char path[1024];
    if (mgpu_animator_write_combined(mgpu_out_path(&o, "chapter2_test_acc.png", path, sizeof path),
                                     "LeNet test accuracy", nruns, (const mgpu_animator *const *)runs, 2,
                                     label_ptrs) == 0 &&
        !mgpu_output_errors()) /* (the runs' own plots too) */
        printf("plots: %s, and chapter2_<N>_device(s).png for each run beside it\n", path);

    what_this_run_shows(runs, seconds, sizes, nruns, use_gpu);

    for (int k = 0; k < nruns; k++) mgpu_animator_free(runs[k]);
    for (int k = 0; k < NUM_PARAMS; k++) mgpu_free(params[k]);
    mgpu_dataset_free(train_set);
    mgpu_dataset_free(test_set);
    return mgpu_output_errors() ? 1 : 0; /* (each said so on stderr) */
}
