/* Chapter 6: model parallelism. Splitting the network, pipelines, and
   splitting layers.

   What it teaches. Dive into Deep Learning names three ways to share a
   network's training among devices: split the data (chapters 2 to 5),
   split the network (consecutive layers on different devices), and split
   the layers (each device computes part of every layer's channels). This
   chapter does the other two.

   Splitting the network (model parallelism; mgpu_pipeline): cut the
   layers into p stages, one a device. The activations go forward from
   stage to stage and their gradients come back. Run naively, one batch
   at a time, stage s + 1 waits for stage s and back again: one device
   works at a time. GPipe (Huang et al. 2019) cuts the batch into m
   micro-batches, so the stages work on different micro-batches at once;
   each stage still idles at the start and the end of a step, a fraction
   (p - 1) / (m + p - 1) of it, the bubble. 1F1B (PipeDream-Flush, as in
   Megatron-LM) orders the same passes so that each backward pass starts
   as early as it can: the same bubble, but stage s keeps the activations
   of at most p - s micro-batches instead of m. Batch norm takes each
   micro-batch's statistics, as PyTorch's pipelines do.

   Splitting layers (tensor parallelism; mgpu_tp_conv, mgpu_tp_mlp): a
   convolution's output channels divided among the devices, put back
   together by an all-gather; and Megatron's MLP block, a column-parallel
   layer then a row-parallel one, which talks once forward and once
   backward (an allreduce each). The devices then exchange activations,
   not gradients of parameters, and each holds 1/k of the layer.

   The chapter:
     1. trains the network split in 2 stages with 1F1B on Fashion-MNIST
        (chapter6_test_acc.png);
     2. times a step of naive model parallelism, GPipe and 1F1B for m = 1,
        2, 4 and 8 micro-batches on 2 and 4 devices, with the bubble
        measured from the trace beside the formula and each stage's peak
        activations beside the schedule's bound, and draws one timeline
        per schedule at its most micro-batches
        (chapter6_timeline_<schedule>_<p>_stages.png);
     3. runs the two split layers on 2 and 4 devices against one device,
        with the bytes each moves per step beside data parallelism's;
     4. trains 2 pipelines of 2 stages as data parallelism on 4 devices
        (hybrid parallelism), whose two copies of the network must stay
        equal.

   What you should see (the reduced run on a 2-core CPU): test accuracy
   about 0.5 after 3 epochs of 3072 images. On 2 devices the measured
   bubble falls from 0.50 (naive) towards the formula's 0.2 at m = 4 and
   0.11 at m = 8, and 1F1B's first stage holds 2 micro-batches of
   activations where GPipe's holds all 8 (the whole batch's). Whether the
   step gets faster depends on the machine: two CPU devices share its
   cores, and a smaller micro-batch runs each core less efficiently, so
   on 2 cores that also run other work the gain is small (bench/RESULTS.md
   has measured figures); on a GPU's virtual devices the stages overlap.
   On 4 CPU devices the 2 cores are shared by 4 stages. The split layers
   equal one device to about 1e-6; the MLP moves fewer bytes split than
   data parallelism would, the convolution, whose activations outweigh
   its weights, more.

   Without a GPU it runs a reduced setting (3 epochs of 3072 images, batch
   128, 3 timed steps a schedule); --full, or a GPU, trains on all 60000
   images for 10 epochs with batch 256 and times 10 steps.

   Reads: mgpu/pipelines.h (stages, micro-batches, GPipe and 1F1B),
   mgpu/tensor_parallel.h (split layers), mgpu/groups.h (stages on ranks),
   mgpu/timing.h and mgpu/plots.h (the schedules' timelines),
   mgpu/flags.h. */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"

#define BLOCKS 8 /* equal blocks, so that 2 and 4 stages share them evenly */
#define MAX_STEPS 64 /* timed steps a schedule: their median is printed */

/* The chapter's network: a stem (a 3x3 convolution at stride 2: 28x28
   images to 14x14, batch norm, ReLU), BLOCKS equal blocks (a 3x3
   convolution of `width` channels, batch norm, ReLU), global pooling and
   a linear layer. first[s] gets stage s's first layer, for `stages`
   stages of equal numbers of blocks: the stem goes with the first and
   the head with the last. (A ReLU after batch norm joins it: one layer.) */
static mgpu_net *convnet(mgpu_device *dev, int width, int stages, int *first) {
    mgpu_net *net = mgpu_net_new(dev);
    mgpu_net_add_conv(net, 1, width, 3, 2, 1);
    mgpu_net_add_batchnorm(net, width);
    mgpu_net_add_relu(net);
    first[0] = 0;
    for (int b = 0; b < BLOCKS; b++) {
        if (b > 0 && b * stages % BLOCKS == 0) first[b * stages / BLOCKS] = net->nlayers;
        mgpu_net_add_conv(net, width, width, 3, 1, 1);
        mgpu_net_add_batchnorm(net, width);
        mgpu_net_add_relu(net);
    }
    mgpu_net_add_global_avg_pool(net);
    mgpu_net_add_linear(net, width, 10);
    return net;
}

typedef struct {
    const char *name;
    mgpu_schedule_fn schedule;
} schedule_choice;
static const schedule_choice gpipe = {"GPipe", mgpu_schedule_gpipe}, one_f_one_b = {"1F1B", mgpu_schedule_1f1b};

static double mib(size_t bytes) { return (double)bytes / 1048576.0; }

/* 1. Trains the network in 2 stages, 1F1B, m micro-batches. */
static void train(int width, int batch, int m, int epochs, double lr, int use_gpu, const mgpu_dataset *train_set,
                  const mgpu_dataset *test_set, const mgpu_options *o) {
    mgpu_device *devs[2];
    mgpu_devices(2, use_gpu, devs);
    mgpu_manual_seed(o->seed);
    int first[2];
    mgpu_net *net = convnet(devs[0], width, 2, first);
    mgpu_pipeline *pp = mgpu_pipeline_new(net, devs, 2, first);
    mgpu_pipeline_set_schedule(pp, mgpu_schedule_1f1b, m);
    char list[128], path[1024], title[256];
    mgpu_device_list(list, sizeof list, devs, 2);
    snprintf(title, sizeof title, "%d-channel network in 2 stages on %s, 1F1B, m = %d", width, list, m);
    const char *series[] = {"train loss", "train acc", "test acc"};
    mgpu_animator *animator = mgpu_animator_new(mgpu_out_path(o, "chapter6_test_acc.png", path, sizeof path), title,
                                                "epoch", "", 1, epochs, 3, series);
    mgpu_loader *loader = mgpu_loader_new(train_set, batch, 1, o->seed);
    mgpu_loader_set_drop_last(loader, 1); /* (every step m micro-batches of the same size) */
    mgpu_tensor *loss_sum = mgpu_zeros(devs[1], mgpu_shape1(1));
    printf("\n1. Training in 2 stages on %s: 1F1B, %d micro-batches of %d images, lr %g\n", list, m, batch / m, lr);
    double seconds = 0;
    for (int epoch = 0; epoch < epochs; epoch++) {
        mgpu_loader_start_epoch(loader, epoch);
        mgpu_fill(loss_sum, 0.0f);
        mgpu_batch b;
        int seen = 0;
        double start = mgpu_now();
        while (mgpu_loader_next(loader, &b)) {
            mgpu_pipeline_train_step(pp, b.x, b.y, (float)lr, 0.9f, 0.0f, loss_sum);
            seen += b.n;
        }
        double loss = mgpu_item(loss_sum, 0) / seen; /* (waits for the epoch's steps) */
        seconds += mgpu_now() - start;
        double train_acc = mgpu_pipeline_evaluate_accuracy(pp, train_set, 256);
        double test_acc = mgpu_pipeline_evaluate_accuracy(pp, test_set, 256);
        double ys[3] = {loss, train_acc, test_acc};
        mgpu_animator_add(animator, epoch + 1, ys);
        printf("  epoch %d: loss %.3f, train acc %.3f, test acc %.3f\n", epoch + 1, loss, train_acc, test_acc);
    }
    printf("test acc: %.2f, %.0f images/sec (%s)\n", mgpu_animator_last(animator, 2),
           epochs * (double)(train_set->n / batch * batch) / seconds, path);
    mgpu_free(loss_sum);
    mgpu_loader_free(loader);
    mgpu_animator_free(animator);
    mgpu_pipeline_free(pp);
    mgpu_net_free(net);
}

/* A step's batch: the first `batch` training images. */
static void first_images(const mgpu_dataset *data, int batch, mgpu_tensor **x, mgpu_tensor **y) {
    mgpu_loader *loader = mgpu_loader_new(data, batch, 0, 0);
    mgpu_loader_start_epoch(loader, 0);
    mgpu_batch b;
    MGPU_REQUIRE(mgpu_loader_next(loader, &b), "chapter6: no training images");
    *x = mgpu_to(b.x, mgpu_cpu(), 0);
    *y = mgpu_to(b.y, mgpu_cpu(), 0);
    mgpu_loader_free(loader);
}

typedef struct {
    double step_ms, bubble, peak_mib[MGPU_MAX_DEVICES];
} step_measure;

/* Times `steps` steps of the pipeline (after one to warm up), then
   traces one more: the median step, the bubble, and each stage's peak
   activations over a step. */
static step_measure measure_steps(mgpu_pipeline *pp, mgpu_device **devs, int stages, const mgpu_tensor *x,
                                  const mgpu_tensor *y, int steps) {
    step_measure r;
    double ms[MAX_STEPS];
    mgpu_pipeline_train_step(pp, x, y, 0.01f, 0.0f, 0.0f, NULL);
    mgpu_synchronize_all();
    for (int s = 0; s < stages; s++) mgpu_device_reset_peak(devs[s]);
    for (int i = 0; i < steps; i++) {
        double start = mgpu_now();
        mgpu_pipeline_train_step(pp, x, y, 0.01f, 0.0f, 0.0f, NULL);
        mgpu_synchronize_all();
        ms[i] = 1e3 * (mgpu_now() - start);
    }
    r.step_ms = mgpu_median(ms, steps);
    for (int s = 0; s < stages; s++) r.peak_mib[s] = mib(mgpu_device_memory_peak_of(devs[s], MGPU_MEMORY_ACTIVATIONS));
    mgpu_trace_begin();
    mgpu_pipeline_forward_backward(pp, x, y, NULL);
    mgpu_trace_end();
    r.bubble = mgpu_pipeline_measure(pp).bubble_mean;
    return r;
}

/* 2. Naive model parallelism, GPipe and 1F1B on `stages` devices. */
static void schedules(int stages, int width, int batch, int steps, int use_gpu, const mgpu_tensor *x,
                      const mgpu_tensor *y, const mgpu_options *o) {
    mgpu_device *devs[MGPU_MAX_DEVICES];
    mgpu_devices(stages, use_gpu, devs);
    mgpu_manual_seed(o->seed);
    int first[MGPU_MAX_DEVICES];
    mgpu_net *net = convnet(devs[0], width, stages, first);
    mgpu_pipeline *pp = mgpu_pipeline_new(net, devs, stages, first);
    char list[256];
    printf("\n  %d stages on %s, batch %d:\n", stages, mgpu_device_list(list, sizeof list, devs, stages), batch);
    printf("  %-7s %3s %9s %11s %8s %8s   %s\n", "", "m", "step ms", "images/sec", "bubble", "formula",
           "peak activations a stage (MiB)");
    const schedule_choice *choices[2] = {&gpipe, &one_f_one_b};
    double naive_ms = 0;
    for (int k = 0; k < 2; k++)
        for (int m = k == 0 ? 1 : 2; m <= 8; m *= 2) { /* (m = 1 is the same naive step under both) */
            mgpu_pipeline_set_schedule(pp, choices[k]->schedule, m);
            step_measure r = measure_steps(pp, devs, stages, x, y, steps);
            if (m == 1) naive_ms = r.step_ms;
            printf("  %-7s %3d %9.1f %11.0f %8.3f %8.3f  ", m == 1 ? "naive" : choices[k]->name, m, r.step_ms,
                   batch / (r.step_ms / 1e3), r.bubble, mgpu_pipeline_bubble_formula(stages, m));
            for (int s = 0; s < stages; s++) printf(" %6.2f", r.peak_mib[s]);
            printf(m == 8 ? "   %.2fx naive\n" : "\n", naive_ms / r.step_ms);
            if (m == 1 || m == 8) { /* the picture of each schedule, at its most micro-batches */
                char name[64], path[1024], title[128];
                snprintf(name, sizeof name, "chapter6_timeline_%s_%d_stages.png", m == 1 ? "naive" : choices[k]->name,
                         stages);
                snprintf(title, sizeof title, "%s, %d stages, %d micro-batch%s", m == 1 ? "naive" : choices[k]->name,
                         stages, m, m > 1 ? "es" : "");
                mgpu_pipeline_write_timeline(pp, mgpu_out_path(o, name, path, sizeof path), title);
            }
        }
    mgpu_pipeline_free(pp);
    mgpu_net_free(net);
}

/* 3. The two split layers against one device, and what they move. */
static double max_relative_diff(const mgpu_tensor *a, const mgpu_tensor *b) {
    size_t n = a->numel;
    float *va = (float *)mgpu_malloc(n * sizeof(float)), *vb = (float *)mgpu_malloc(n * sizeof(float));
    mgpu_to_host(a, va);
    mgpu_to_host(b, vb);
    double diff = 0, scale = 1e-30;
    for (size_t i = 0; i < n; i++) {
        diff = fmax(diff, fabs((double)va[i] - vb[i]));
        scale = fmax(scale, fabs((double)vb[i]));
    }
    free(va);
    free(vb);
    return diff / scale;
}
static void split_layers(int width, int batch, int use_gpu) {
    printf("\n3. Splitting layers, batch %d: the largest difference from one device (relative), and the bytes\n"
           "   a device sends per step, beside data parallelism's for the same parameters:\n", batch);
    printf("  %-36s %2s %10s %12s %12s %12s\n", "", "k", "differs", "forward", "backward", "data par.");
    mgpu_device *one = mgpu_cpu(), *devs[4];
    mgpu_manual_seed(3);
    /* a block's convolution at the network's size, and an MLP of Fashion-MNIST's pixels */
    mgpu_tensor *w = mgpu_randn(one, mgpu_shape4(width, width, 3, 3), 0.0f, 0.1f), *bias = mgpu_zeros(one, mgpu_shape1(width));
    mgpu_tensor *x = mgpu_randn(one, mgpu_shape4(batch, width, 14, 14), 0.0f, 1.0f);
    mgpu_tensor *y1 = mgpu_empty(one, mgpu_shape4(batch, width, 14, 14));
    mgpu_conv2d_forward(y1, x, w, bias, 1, 1);
    enum { HIDDEN = 512 };
    mgpu_tensor *A = mgpu_randn(one, mgpu_shape2(784, HIDDEN), 0.0f, 0.03f), *a = mgpu_zeros(one, mgpu_shape1(HIDDEN));
    mgpu_tensor *B = mgpu_randn(one, mgpu_shape2(HIDDEN, 10), 0.0f, 0.05f), *b = mgpu_zeros(one, mgpu_shape1(10));
    mgpu_tensor *X = mgpu_randn(one, mgpu_shape2(batch, 784), 0.0f, 1.0f);
    mgpu_tensor *H = mgpu_empty(one, mgpu_shape2(batch, HIDDEN)), *Y1 = mgpu_empty(one, mgpu_shape2(batch, 10));
    mgpu_linear_forward(H, X, A, a);
    mgpu_relu_forward(H, H);
    mgpu_linear_forward(Y1, H, B, b);
    for (int k = 2; k <= 4; k *= 2) {
        mgpu_devices(k, use_gpu, devs);
        mgpu_tensor *xk = mgpu_to(x, devs[0], 0), *Xk = mgpu_to(X, devs[0], 0);
        mgpu_tp_conv *c = mgpu_tp_conv_new(w, bias, 1, 1, devs, k);
        mgpu_tensor *yk = mgpu_tp_conv_forward(c, xk);
        mgpu_tp_conv_backward(c, yk); /* (any gradient: this counts its bytes) */
        mgpu_tp_bytes cb = mgpu_tp_conv_bytes(c);
        char label[64];
        snprintf(label, sizeof label, "convolution %d->%d, 3x3, 14x14", width, width);
        printf("  %-36s %2d %10.1e %12zu %12zu %12zu\n", label, k, max_relative_diff(yk, y1), cb.forward,
               cb.backward, mgpu_data_parallel_bytes(mgpu_tp_conv_parameters(c), k));
        mgpu_tp_mlp *mlp = mgpu_tp_mlp_new(A, a, B, b, devs, k);
        mgpu_tensor *Yk = mgpu_tp_mlp_forward(mlp, Xk);
        mgpu_tp_mlp_backward(mlp, Yk);
        mgpu_tp_bytes mb = mgpu_tp_mlp_bytes(mlp);
        printf("  %-36s %2d %10.1e %12zu %12zu %12zu\n", "Megatron MLP 784->512->10", k, max_relative_diff(Yk, Y1),
               mb.forward, mb.backward, mgpu_data_parallel_bytes(mgpu_tp_mlp_parameters(mlp), k));
        mgpu_tp_conv_free(c);
        mgpu_tp_mlp_free(mlp);
        mgpu_free(xk);
        mgpu_free(Xk);
    }
    printf("  The convolution sends its output (an all-gather) and its input's gradient (an allreduce): the\n"
           "  activations of the batch. Data parallelism sends the weights' gradients: it depends on the\n"
           "  model, not the batch. The MLP's 400,000 weights outweigh its 10 outputs a row: split, it\n"
           "  moves a small fraction of what data parallelism moves.\n");
    mgpu_tensor *all[] = {w, bias, x, y1, A, a, B, b, X, H, Y1};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) mgpu_free(all[i]);
}

/* 4. Two pipelines of 2 stages as data parallelism on 4 devices. */
static void hybrid(int width, int batch, int m, int steps, int use_gpu, const mgpu_tensor *x, const mgpu_tensor *y,
                   const mgpu_options *o) {
    mgpu_device *devs[4];
    mgpu_devices(4, use_gpu, devs);
    mgpu_net *nets[2];
    mgpu_pipeline *pipes[2];
    int first[2];
    for (int k = 0; k < 2; k++) {
        mgpu_manual_seed(o->seed); /* (the same values in both) */
        nets[k] = convnet(devs[2 * k], width, 2, first);
        pipes[k] = mgpu_pipeline_new(nets[k], devs + 2 * k, 2, first);
        mgpu_pipeline_set_schedule(pipes[k], mgpu_schedule_1f1b, m);
    }
    double ms[MAX_STEPS];
    for (int i = 0; i <= steps; i++) { /* (the first to warm up) */
        double start = mgpu_now();
        for (int k = 0; k < 2; k++) {
            mgpu_tensor *xk = mgpu_narrow(x, k * batch / 2, batch / 2), *yk = mgpu_narrow(y, k * batch / 2, batch / 2);
            mgpu_pipeline_forward_backward(pipes[k], xk, yk, NULL);
            mgpu_free(xk);
            mgpu_free(yk);
        }
        mgpu_pipelines_average_grads(pipes, 2);
        for (int k = 0; k < 2; k++) mgpu_pipeline_step(pipes[k], 0.01f, 0.0f, 0.0f);
        mgpu_synchronize_all();
        if (i > 0) ms[i - 1] = 1e3 * (mgpu_now() - start);
    }
    double step_ms = mgpu_median(ms, steps);
    for (int k = 0; k < 2; k++) mgpu_pipeline_free(pipes[k]);
    double apart = 0; /* the two pipelines' copies of the network after the steps: values and statistics */
    for (int i = 0; i < nets[0]->nparams; i++)
        apart = fmax(apart, max_relative_diff(mgpu_net_param(nets[0], i)->value, mgpu_net_param(nets[1], i)->value));
    for (int i = 0; i < nets[0]->nbuffers; i++)
        apart = fmax(apart, max_relative_diff(mgpu_net_buffer(nets[0], i), mgpu_net_buffer(nets[1], i)));
    printf("\n4. Hybrid: 2 pipelines of 2 stages (1F1B, m = %d, half the batch each) with their gradients\n"
           "   averaged between stages 0 and between stages 1, on 4 devices: %.1f ms a step, %.0f images/sec;\n"
           "   the two copies of the network (values and batch norm's statistics) differ by %.1e after %d\n"
           "   steps (they must stay equal).\n",
           m, step_ms, batch / (step_ms / 1e3), apart, steps + 1);
    for (int k = 0; k < 2; k++) mgpu_net_free(nets[k]);
}

int main(int argc, char **argv) {
    mgpu_options o;
    memset(&o, 0, sizeof o);
    o.seed = 1;
    int train_samples = 0, steps = 0, width = 0, micro = 4;
    const mgpu_flag extra[] = {
        {"--train-samples", 'i', &train_samples, "train on the first N images"},
        {"--steps", 'i', &steps, "timed steps of each schedule (up to 64; the median is printed)"},
        {"--width", 'i', &width, "the network's channels (32)"},
        {"--micro-batches", 'i', &micro, "micro-batches of the training (section 1; default 4)"},
        {"--devices", 'n', NULL, "chapter 6 runs on 2 and 4 devices, its stages"},
    };
    mgpu_options_parse(&o, argc, argv, "chapter6: model parallelism: pipelines (naive, GPipe, 1F1B) and split layers",
                       extra, (int)(sizeof extra / sizeof extra[0]));
    int use_gpu = !o.cpu && mgpu_num_gpus() > 0;
    int reduced = !use_gpu && !o.full;
    if (!width) width = 32;
    if (!steps) steps = reduced ? 3 : 10;
    MGPU_REQUIRE(steps <= MAX_STEPS, "--steps %d: at most %d", steps, MAX_STEPS);
    int batch = o.batch_size ? o.batch_size : reduced ? 128 : 256;
    MGPU_REQUIRE(batch >= 8, "--batch-size %d: at least 8 (8 micro-batches)", batch);
    double lr = o.lr ? o.lr : 0.05;
    if (!o.epochs) o.epochs = reduced ? 3 : 10;
    if (reduced && !train_samples) train_samples = 3072;
    if (reduced)
        printf("No GPU: a reduced run on CPU devices: %d training images, %d epoch%s, batch %d, %d timed\n"
               "step%s a schedule (--full: all the images, 10 epochs, batch 256, 10 timed steps).\n",
               train_samples, o.epochs, o.epochs > 1 ? "s" : "", batch, steps, steps > 1 ? "s" : "");
    if (use_gpu) printf("GPU arithmetic: %s; MGPU_TF32=0 or 1 changes it.\n", mgpu_tf32_str());
    printf("The network: a stem and %d equal blocks of %d channels (3x3 convolution, batch norm, ReLU) at 14x14,\n"
           "global pooling, a linear layer; 2 stages take 4 blocks each, 4 stages 2 each.\n", BLOCKS, width);

    mgpu_dataset *train_set = NULL, *test_set = NULL;
    mgpu_dataset_load_fashion_mnist(mgpu_data_dir(o.data), &train_set, &test_set);
    MGPU_REQUIRE(train_samples <= train_set->n, "--train-samples %d: the training set has %d images", train_samples,
                 train_set->n);
    if (train_samples) {
        mgpu_dataset *subset = mgpu_dataset_subset(train_set, train_samples);
        mgpu_dataset_free(train_set);
        train_set = subset;
        mgpu_dataset_truncate(test_set, train_samples);
    }
    MGPU_REQUIRE(train_set->n >= batch, "--batch-size %d: more than the %d training images", batch, train_set->n);
    MGPU_REQUIRE(micro >= 1 && micro <= batch, "--micro-batches %d: want 1 to the batch, %d", micro, batch);
    train(width, batch, micro, o.epochs, lr, use_gpu, train_set, test_set, &o);

    mgpu_tensor *x, *y;
    first_images(train_set, batch, &x, &y);
    printf("\n2. A training step split in stages: the median of %d steps, the bubble measured from a traced\n"
           "   step (each stage's idle time over the step's), beside (p - 1) / (m + p - 1):\n", steps);
    schedules(2, width, batch, steps, use_gpu, x, y, &o);
    schedules(4, width, batch, steps, use_gpu, x, y, &o);
    char path[1024];
    printf("  timelines: %s and the others beside it\n",
           mgpu_out_path(&o, "chapter6_timeline_1F1B_2_stages.png", path, sizeof path));

    split_layers(width, batch, use_gpu);
    hybrid(width, batch, 4, steps, use_gpu, x, y, &o);
    mgpu_free(x);
    mgpu_free(y);
    mgpu_dataset_free(train_set);
    mgpu_dataset_free(test_set);
    return mgpu_output_errors() ? 1 : 0;
}
