/* tests/test_memory.c: where a device's memory goes, its limit, and
   gradient checkpointing (chapter 5).

   - checkpointed gradients are bit for bit the plain ones, for ResNet-18
     and for a network with a layer of one's own, at 2, about sqrt(n) and
     n runs, and batch norm's running statistics move once a step;
   - in both data-parallel wrappers' steps too;
   - the activations held by a chain of equal layers, at their peak,
     within 10% of n/k + k - 1 layers' outputs;
   - a training step's memory by category: the parameters', gradients'
     and momentum's bytes exactly; its recorded samples reach the peak;
   - a device's limit: one line naming the device, the request, the limit
     and the largest holders; other devices are not limited;
   - ZeRO stages 1 and 2 on 2 devices train like the unsharded wrapper,
     with half the optimizer's state (and gradients) a device;
   - bad settings refused by name.
   tests/gpu_memory.c runs them on GPUs (emulated ones in make test). */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"
#include "test.h"

static mgpu_device *dev;

#define own_relu test_own_relu /* (test.h's: recomputed like the library's layers) */

static mgpu_net *resnet(uint64_t seed) {
    mgpu_manual_seed(seed);
    return mgpu_resnet18(10, 1, dev);
}
static mgpu_net *with_own_layers(uint64_t seed) {
    mgpu_manual_seed(seed);
    mgpu_net *net = mgpu_net_new(dev);
    mgpu_net_add_conv(net, 1, 6, 3, 1, 1);
    mgpu_net_add_layer(net, &own_relu, NULL, NULL, NULL);
    mgpu_net_add_conv(net, 6, 8, 3, 2, 1);
    mgpu_net_add_batchnorm(net, 8);
    mgpu_net_add_layer(net, &own_relu, NULL, NULL, NULL);
    mgpu_net_add_conv(net, 8, 8, 3, 1, 1);
    mgpu_net_add_layer(net, &own_relu, NULL, NULL, NULL);
    mgpu_net_add_global_avg_pool(net);
    mgpu_net_add_linear(net, 8, 10);
    for (int i = 0; i < net->nparams; i++) mgpu_scale_(net->params[i]->value, 30.0f);
    return net;
}

static void batch(int n, int size, mgpu_tensor **x, mgpu_tensor **y) {
    mgpu_manual_seed(77);
    *x = mgpu_randn(dev, mgpu_shape4(n, 1, size, size), 0.0f, 1.0f);
    float labels[64];
    for (int i = 0; i < n; i++) labels[i] = (float)(i * 3 % 10);
    *y = mgpu_from_host(dev, mgpu_shape1(n), labels);
}

#define same_bits test_same_bits

/* NaN-filled tensors of the shapes of every output of `shapes`' layers
   (their parts' too), into out; returns how many. Made between a
   checkpointed forward pass and its backward pass, they take the blocks
   that the freed activations gave back to the allocator: a backward pass
   that read those instead of recomputing them would meet NaN. */
static int poison_like(const mgpu_layer *l, mgpu_tensor **out) {
    int count = 0;
    if (l->output) out[count++] = mgpu_full(dev, l->output->shape, NAN);
    const mgpu_layer *parts[5] = {l->conv1, l->bn1, l->conv2, l->bn2, l->shortcut};
    for (int i = 0; i < 5; i++)
        if (parts[i]) count += poison_like(parts[i], out + count);
    return count;
}

/* One forward and backward pass of a fresh network with `segments`
   checkpointed runs, beside one without: every gradient and running
   statistic the same bits. */
static void checkpointed_like_plain(const char *name, mgpu_net *(*make)(uint64_t), int segments, int size) {
    mgpu_net *plain = make(3), *cut = make(3);
    mgpu_net_recompute(cut, segments);
    mgpu_tensor *x, *y;
    batch(4, size, &x, &y);
    mgpu_net *nets[2] = {plain, cut};
    mgpu_tensor *poison[256];
    int poisoned = 0;
    for (int k = 0; k < 2; k++) {
        mgpu_tensor *logits = mgpu_net_forward(nets[k], x);
        mgpu_synchronize(dev); /* (the freed blocks back in the allocator's cache) */
        for (int i = 0; i < plain->nlayers && k == 1; i++) poisoned += poison_like(plain->layers[i], poison + poisoned);
        mgpu_net_loss_backward(nets[k], logits, y, 0.25f, NULL);
    }
    for (int i = 0; i < poisoned; i++) mgpu_free(poison[i]);
    int same = 1;
    for (int p = 0; p < plain->nparams; p++) same &= same_bits(plain->params[p]->grad, cut->params[p]->grad);
    for (int b = 0; b < plain->nbuffers; b++) same &= same_bits(*plain->buffers[b], *cut->buffers[b]);
    if (!same) printf("  %s, %d runs: not the plain pass's bits\n", name, segments);
    CHECK(same);
    CHECK(cut->nsegments == (segments == MGPU_SEGMENTS_SQRT ? (int)lround(sqrt(cut->nlayers)) : segments));
    mgpu_free(x);
    mgpu_free(y);
    mgpu_net_free(plain);
    mgpu_net_free(cut);
}
TEST_LONG(checkpointed_gradients_are_the_plain_ones_bit_for_bit) {
    checkpointed_like_plain("ResNet-18", resnet, MGPU_SEGMENTS_SQRT, 8);
    if (!TEST_ON_GPU) { /* (the emulated GPUs' convolutions are slow) */
        checkpointed_like_plain("ResNet-18", resnet, 2, 8);
        checkpointed_like_plain("ResNet-18", resnet, 12, 8); /* a run a layer */
    }
    checkpointed_like_plain("own layers", with_own_layers, 2, 8);
    checkpointed_like_plain("own layers", with_own_layers, 9, 8);
}

/* The running statistics move once a step, as without checkpointing:
   after one step from mean 0 and variance 1 they are 0.1 of the batch's
   (PyTorch's checkpoint would move them twice, to 0.19 of it). */
TEST(running_statistics_move_once_a_step) {
    mgpu_net *net = with_own_layers(5), *plain = with_own_layers(5);
    mgpu_net_recompute(net, 9);
    mgpu_tensor *x, *y;
    batch(4, 8, &x, &y);
    mgpu_net_train_step(net, x, y, 0.0f, 0.0f, 0.0f, NULL);
    mgpu_net_train_step(plain, x, y, 0.0f, 0.0f, 0.0f, NULL);
    mgpu_layer *bn = net->layers[3];
    CHECK(bn->kind == MGPU_LAYER_BATCHNORM);
    float moved[8], batch_mean[8];
    mgpu_to_host(bn->running_mean, moved);
    mgpu_to_host(bn->save_mean, batch_mean);
    for (int c = 0; c < 8; c++) CHECK_CLOSE(moved[c], 0.1 * batch_mean[c], 1e-6, 1e-5);
    CHECK(same_bits(bn->running_mean, plain->layers[3]->running_mean));
    CHECK(same_bits(bn->running_var, plain->layers[3]->running_var));
    mgpu_free(x);
    mgpu_free(y);
    mgpu_net_free(net);
    mgpu_net_free(plain);
}

/* Chapter 3's wrapper on 2 devices: 3 steps with and without
   checkpointing give the same parameters, bit for bit: a network with
   batch norm and layers of one's own, in about sqrt(n) runs. */
TEST(checkpointing_inside_the_data_parallel_wrapper) {
    mgpu_device *devs[2];
    mgpu_devices(2, TEST_ON_GPU, devs);
    mgpu_net *nets[2];
    mgpu_data_parallel *dps[2];
    for (int k = 0; k < 2; k++) {
        mgpu_manual_seed(11);
        nets[k] = mgpu_net_new(devs[0]);
        mgpu_net_add_conv(nets[k], 1, 6, 3, 1, 1);
        mgpu_net_add_batchnorm(nets[k], 6);
        mgpu_net_add_layer(nets[k], &own_relu, NULL, NULL, NULL);
        mgpu_net_add_conv(nets[k], 6, 8, 3, 2, 1);
        mgpu_net_add_layer(nets[k], &own_relu, NULL, NULL, NULL);
        mgpu_net_add_global_avg_pool(nets[k]);
        mgpu_net_add_linear(nets[k], 8, 10);
        if (k) mgpu_net_recompute(nets[k], MGPU_SEGMENTS_SQRT);
        dps[k] = mgpu_data_parallel_new(nets[k], devs, 2, MGPU_DP_ALLREDUCE);
    }
    for (int s = 0; s < 3; s++) {
        mgpu_tensor *x, *y;
        batch(8, 8, &x, &y);
        for (int k = 0; k < 2; k++) mgpu_data_parallel_step(dps[k], x, y, 0.1f, 0.9f, 0.0f);
        mgpu_free(x);
        mgpu_free(y);
    }
    int same = 1;
    for (int p = 0; p < nets[0]->nparams; p++) same &= same_bits(nets[0]->params[p]->value, nets[1]->params[p]->value);
    CHECK(same);
    CHECK(mgpu_data_parallel_replica(dps[1], 1)->segments == MGPU_SEGMENTS_SQRT);
    for (int k = 0; k < 2; k++) {
        mgpu_data_parallel_free(dps[k]);
        mgpu_net_free(nets[k]);
    }
}

/* 16 equal linear layers of 128 features, batch 32: each output is A =
   16 KiB. The activations held at their peak are the kept inputs of the
   first k - 1 runs and one run's outputs: n/k + k - 1 outputs (n without
   checkpointing). Within 10%. */
TEST(peak_activations_follow_the_formula) {
    const int n = 16, width = 128, rows = 32;
    const double a = rows * width * sizeof(float);
    int runs[] = {1, 2, 4, 8, 16};
    mgpu_manual_seed(1);
    mgpu_tensor *x = mgpu_randn(dev, mgpu_shape2(rows, width), 0.0f, 1.0f);
    float labels[32];
    for (int i = 0; i < rows; i++) labels[i] = (float)(i % 10);
    mgpu_tensor *y = mgpu_from_host(dev, mgpu_shape1(rows), labels);
    for (size_t r = 0; r < sizeof runs / sizeof *runs; r++) {
        double before = (double)mgpu_device_memory_of(dev, MGPU_MEMORY_ACTIVATIONS);
        mgpu_net *net = mgpu_net_new(dev);
        for (int i = 0; i < n; i++) mgpu_net_add_linear(net, width, width);
        mgpu_net_recompute(net, runs[r]);
        mgpu_net_train_step(net, x, y, 0.01f, 0.0f, 0.0f, NULL); /* (the first step makes the scratch) */
        mgpu_synchronize(dev);
        mgpu_device_reset_peak(dev);
        mgpu_net_train_step(net, x, y, 0.01f, 0.0f, 0.0f, NULL);
        mgpu_synchronize(dev);
        int k = runs[r];
        double want = (n / k + k - 1) * a;
        double got = (double)mgpu_device_memory_peak_of(dev, MGPU_MEMORY_ACTIVATIONS) - before;
        printf("  %2d runs: peak activations %.0f KiB, formula %.0f KiB\n", runs[r], got / 1024, want / 1024);
        CHECK_CLOSE(got, want, 0.0, 0.10);
        mgpu_net_free(net);
    }
    mgpu_free(x);
    mgpu_free(y);
}

/* size's bytes as the allocator counts them (512-byte granules) */
static size_t held_bytes(const mgpu_tensor *t) { return (t->numel * sizeof(float) + 511) / 512 * 512; }

/* After a training step with momentum: the parameters (with batch norm's
   statistics), their gradients and their momentum, each exactly. */
TEST(a_training_steps_memory_by_category) {
    size_t before[MGPU_MEMORY_CATEGORIES];
    for (int c = 0; c < MGPU_MEMORY_CATEGORIES; c++) before[c] = mgpu_device_memory_of(dev, (mgpu_memory_category)c);
    mgpu_net *net = with_own_layers(8);
    mgpu_tensor *x, *y;
    batch(4, 8, &x, &y);
    mgpu_device_reset_peak(dev);
    mgpu_device_record_memory(dev, 1);
    mgpu_net_train_step(net, x, y, 0.1f, 0.9f, 0.0f, NULL);
    mgpu_synchronize(dev);
    mgpu_device_record_memory(dev, 0);
    const mgpu_memory_sample *samples;
    int n = mgpu_device_memory_samples(dev, &samples);
    size_t most = 0; /* the samples' highest point is the peak */
    for (int i = 0; i < n; i++) most = samples[i].in_use > most ? samples[i].in_use : most;
    CHECK(n > 10);
    CHECK(most == mgpu_device_memory_peak(dev));
    CHECK(n > 0 && samples[n - 1].held[MGPU_MEMORY_ACTIVATIONS] == mgpu_device_memory_of(dev, MGPU_MEMORY_ACTIVATIONS));
    size_t params = 0, grads = 0, momentum = 0;
    for (int p = 0; p < net->nparams; p++) {
        params += held_bytes(net->params[p]->value);
        grads += held_bytes(net->params[p]->grad);
        momentum += held_bytes(net->momentum[p]);
    }
    mgpu_layer *bn = net->layers[3];
    params += held_bytes(bn->running_mean) + held_bytes(bn->running_var) + held_bytes(bn->save_mean) +
              held_bytes(bn->save_invstd);
    CHECK(mgpu_device_memory_of(dev, MGPU_MEMORY_PARAMETERS) - before[MGPU_MEMORY_PARAMETERS] == params);
    CHECK(mgpu_device_memory_of(dev, MGPU_MEMORY_GRADIENTS) - before[MGPU_MEMORY_GRADIENTS] == grads);
    CHECK(mgpu_device_memory_of(dev, MGPU_MEMORY_OPTIMIZER) - before[MGPU_MEMORY_OPTIMIZER] == momentum);
    size_t outputs = 0; /* what the forward pass keeps: every layer's output */
    for (int i = 0; i < net->nlayers; i++) outputs += held_bytes(net->layers[i]->output);
    CHECK(mgpu_device_memory_at_peak(dev, MGPU_MEMORY_ACTIVATIONS) >= outputs);
    CHECK(mgpu_device_memory_peak_of(dev, MGPU_MEMORY_WORKSPACE) > 0); /* the activations' gradients */
    CHECK(strcmp(mgpu_memory_category_name(MGPU_MEMORY_OPTIMIZER), "optimizer state") == 0);
    mgpu_free(x);
    mgpu_free(y);
    mgpu_net_free(net);
    for (int c = 0; c < MGPU_MEMORY_CATEGORIES; c++) /* all given back */
        CHECK(mgpu_device_memory_of(dev, (mgpu_memory_category)c) == before[c]);
}

/* A device's limit: past it, one line; another device has none. */
TEST(a_memory_limit_is_one_line_naming_the_holders) {
    mgpu_device *devs[2];
    mgpu_devices(2, TEST_ON_GPU, devs);
    mgpu_tensor *kept = mgpu_full(devs[0], mgpu_shape1(1 << 18), 3.0f); /* 1 MiB */
    size_t base = mgpu_device_memory_in_use(devs[1]);
    mgpu_device_set_memory_limit(devs[1], base + (3u << 19)); /* 1.5 MiB more */
    mgpu_tensor *one = mgpu_zeros(devs[1], mgpu_shape1(1 << 18));
    char line[512];
    snprintf(line, sizeof line,
             "out of memory on %s: asked for 1.0 MiB (other) with %.1f MiB in use, past its limit of %.1f MiB "
             "(mgpu_device_set_memory_limit); the largest holders: other %.1f MiB",
             mgpu_device_name(devs[1]), (base + (1u << 20)) / 1048576.0, (base + (3u << 19)) / 1048576.0,
             (mgpu_device_memory_of(devs[1], MGPU_MEMORY_OTHER)) / 1048576.0);
    EXPECT_DIES(mgpu_zeros(devs[1], mgpu_shape1(1 << 18)), line);
    mgpu_tensor *more = mgpu_zeros(devs[0], mgpu_shape1(1 << 20)); /* 4 MiB where there is no limit */
    CHECK(mgpu_item(kept, 12345) == 3.0f);
    mgpu_device_set_memory_limit(devs[1], 0);
    mgpu_free(more);
    mgpu_free(one);
    mgpu_free(kept);
}

/* ZeRO on 2 devices: 20 steps (SGD with momentum, and Adam) leave the
   parameters of the unsharded wrapper, within 1e-6 (in fact bit for bit:
   a + b is b + a); each device holds half the optimizer's state, and with
   stage 2 half the gradients between steps; the wrapper's end gives the
   module the whole state back. */
static mgpu_net *small_net(mgpu_device *d) {
    mgpu_manual_seed(11);
    mgpu_net *net = mgpu_net_new(d);
    mgpu_net_add_conv(net, 1, 6, 3, 1, 1);
    mgpu_net_add_batchnorm(net, 6);
    mgpu_net_add_relu(net);
    mgpu_net_add_conv(net, 6, 8, 3, 2, 1);
    mgpu_net_add_global_avg_pool(net);
    mgpu_net_add_linear(net, 8, 10);
    return net;
}
static size_t held_all(mgpu_device *const *devs, int n, mgpu_memory_category c, size_t *each) {
    size_t total = 0;
    for (int i = 0; i < n; i++) total += each[i] = mgpu_device_memory_of(devs[i], c);
    return total;
}
static void zero_like_unsharded(int stage, int adam) {
    mgpu_device *devs[2];
    mgpu_devices(2, TEST_ON_GPU, devs);
    mgpu_net *nets[2];
    mgpu_data_parallel *dps[2];
    size_t optimizer[2][2], grads[2][2];
    for (int k = 0; k < 2; k++) {
        nets[k] = small_net(devs[0]);
        if (adam) mgpu_net_use_adam(nets[k], 0.9f, 0.999f, 1e-8f, 1);
        dps[k] = mgpu_data_parallel_new(nets[k], devs, 2, MGPU_DP_ALLREDUCE);
        mgpu_data_parallel_configure(dps[k], 256, 1, 1); /* a bucket a layer */
        if (k) mgpu_data_parallel_zero(dps[k], stage);
    }
    size_t before_opt[2], before_grad[2];
    for (int k = 0; k < 2; k++) {
        held_all(devs, 2, MGPU_MEMORY_OPTIMIZER, before_opt);
        held_all(devs, 2, MGPU_MEMORY_GRADIENTS, before_grad);
        for (int s = 0; s < 20; s++) {
            mgpu_tensor *x, *y;
            mgpu_manual_seed(100 + (uint64_t)s);
            x = mgpu_randn(dev, mgpu_shape4(8, 1, 8, 8), 0.0f, 1.0f);
            float labels[8];
            for (int i = 0; i < 8; i++) labels[i] = (float)((i * 3 + s) % 10);
            y = mgpu_from_host(dev, mgpu_shape1(8), labels);
            mgpu_data_parallel_step(dps[k], x, y, adam ? 0.01f : 0.1f, adam ? 0.0f : 0.9f, 0.01f);
            mgpu_free(x);
            mgpu_free(y);
        }
        mgpu_synchronize_all();
        size_t now[2];
        held_all(devs, 2, MGPU_MEMORY_OPTIMIZER, now);
        for (int i = 0; i < 2; i++) optimizer[k][i] = now[i] - before_opt[i];
        held_all(devs, 2, MGPU_MEMORY_GRADIENTS, now);
        for (int i = 0; i < 2; i++) grads[k][i] = now[i]; /* (held between steps) */
    }
    double diff = test_max_param_diff(nets[1], nets[0]);
    if (diff > 0) printf("  ZeRO-%d%s: parameters differ by %.3g\n", stage, adam ? ", AdamW" : "", diff);
    CHECK_CLOSE(diff, 0.0, 1e-6, 0);
    /* per device: half the optimizer's state (and with stage 2, of the gradients), give or take a chunk's
       padding and the allocator's 512-byte granules (a bucket a layer: 5 buckets) */
    for (int i = 0; i < 2; i++) {
        CHECK(optimizer[0][i] > 0);
        CHECK_CLOSE((double)optimizer[1][i], optimizer[0][i] / 2.0, 5 * 2 * 512.0, 0);
    }
    if (stage == 2) for (int i = 0; i < 2; i++) CHECK(grads[1][i] < grads[0][i] * 0.6);
    for (int k = 0; k < 2; k++) mgpu_data_parallel_free(dps[k]);
    /* the whole state is back in the module, the same bits */
    int same = 1;
    for (int p = 0; p < nets[0]->nparams; p++) {
        same &= nets[1]->momentum[p] != NULL && same_bits(nets[1]->momentum[p], nets[0]->momentum[p]);
        if (adam) same &= same_bits(nets[1]->second_moment[p], nets[0]->second_moment[p]);
    }
    CHECK(same);
    CHECK(nets[1]->steps == 20 && !nets[1]->sharded);
    for (int k = 0; k < 2; k++) mgpu_net_free(nets[k]);
}
TEST(zero_stages_train_like_the_unsharded_wrapper) {
    for (int stage = 1; stage <= 2; stage++)
        for (int adam = 0; adam <= 1; adam++) zero_like_unsharded(stage, adam);
}

/* ZeRO-3 against DDP (ZeRO off) and ZeRO-2 on w devices: 20 steps of a
   small network with a residual block, in three units (buckets of 256
   bytes or more: the layers 0-2, 3-4 and 5), so that each unit is
   gathered and freed around its layers and the next one prefetched;
   with momentum SGD or Adam, and with `segments` recomputed runs (of 3,
   the middle one spans two units: its forward pass again, within the
   backward pass of one, gathers the other again; of 2, the first one is
   a unit, which its backward pass holds through the recomputed forward
   pass that ends at its last layer, and which must prefetch nothing: a
   unit gathered then would keep the values of before the step). Without
   recomputation each step also runs the replicas' check, which under
   stage 3 compares every device's gathered values. Between the steps and
   the end the module evaluates: its forward pass gathers as it goes.
   ZeRO-3 takes ZeRO-2's steps on the same chunks, so their parameters
   (and logits) are the same bits; and ZeRO-2's reduce-scatter adds each
   gradient in the order DDP's allreduce does (the ring's, mgpu/zero.h),
   as ZeRO-1's ring does (over the bucket's values, not its padding), so
   all three are DDP's bits, on 2 and 4 devices, accumulating or not.
   (A real GPU's DDP takes NCCL's allreduce, whose order is NCCL's own:
   there 1e-5 of the largest value, 20 steps through batch norm and Adam
   growing the rounding to a few 1e-6.) */
static mgpu_net *residual_net(mgpu_device *d) {
    mgpu_manual_seed(13);
    mgpu_net *net = mgpu_net_new(d);
    mgpu_net_add_conv(net, 1, 6, 3, 1, 1);
    mgpu_net_add_batchnorm(net, 6);
    mgpu_net_add_relu(net);
    mgpu_net_add_residual(net, 6, 8, 2);
    mgpu_net_add_global_avg_pool(net);
    mgpu_net_add_linear(net, 8, 10);
    return net;
}
static void zero3_like_ddp(int w, int adam, int segments, int accumulate) {
    mgpu_device *devs[4];
    mgpu_devices(w, TEST_ON_GPU, devs);
    mgpu_net *nets[4]; /* DDP, ZeRO-1, ZeRO-2, ZeRO-3: nets[k] under stage k */
    mgpu_data_parallel *dps[4];
    for (int k = 0; k < 4; k++) {
        nets[k] = residual_net(devs[0]);
        if (adam) mgpu_net_use_adam(nets[k], 0.9f, 0.999f, 1e-8f, 1);
        if (segments > 1) mgpu_net_recompute(nets[k], segments);
        dps[k] = mgpu_data_parallel_new(nets[k], devs, w, MGPU_DP_ALLREDUCE);
        mgpu_data_parallel_configure(dps[k], 256, 1, 1);
        if (k) mgpu_data_parallel_zero(dps[k], k);
    }
    mgpu_data_parallel_check_replicas(dps[3], segments == 1); /* (its gathers and frees, each step, would hide a
                                                                 unit left gathered) */
    for (int s = 0; s < 20; s++) {
        mgpu_tensor *x, *y;
        mgpu_manual_seed(100 + (uint64_t)s);
        x = mgpu_randn(dev, mgpu_shape4(8, 1, 8, 8), 0.0f, 1.0f);
        float labels[8];
        for (int i = 0; i < 8; i++) labels[i] = (float)((i * 3 + s) % 10);
        y = mgpu_from_host(dev, mgpu_shape1(8), labels);
        for (int k = 0; k < 4; k++) {
            /* accumulate: the batch in two passes, the first without a step (no_sync) */
            mgpu_tensor *xs = accumulate ? mgpu_narrow(x, 4, 4) : x, *ys = accumulate ? mgpu_narrow(y, 4, 4) : y;
            if (accumulate) {
                mgpu_tensor *xa = mgpu_narrow(x, 0, 4), *ya = mgpu_narrow(y, 0, 4);
                mgpu_data_parallel_accumulate(dps[k], xa, ya);
                mgpu_free(xa), mgpu_free(ya);
            }
            mgpu_data_parallel_step(dps[k], xs, ys, adam ? 0.01f : 0.1f, adam ? 0.0f : 0.9f, 0.01f);
            if (accumulate) mgpu_free(xs), mgpu_free(ys);
        }
        mgpu_free(x);
        mgpu_free(y);
    }
    mgpu_tensor *x = mgpu_randn(devs[0], mgpu_shape4(4, 1, 8, 8), 0.0f, 1.0f), *logits[4];
    for (int k = 0; k < 4; k++) {
        mgpu_net_set_training(nets[k], 0);
        logits[k] = mgpu_net_forward(nets[k], x);
    }
    int same = same_bits(logits[3], logits[2]);
    double logits_diff = test_relative_diff(logits[3], logits[0]);
    mgpu_free(x);
    for (int k = 0; k < 4; k++) mgpu_data_parallel_free(dps[k]); /* (stage 3 gathers the values into the module) */
    for (int p = 0; p < nets[0]->nparams; p++) same &= same_bits(nets[3]->params[p]->value, nets[2]->params[p]->value);
    for (int b = 0; b < nets[0]->nbuffers; b++) same &= same_bits(*nets[3]->buffers[b], *nets[2]->buffers[b]);
    double diff = test_max_param_diff(nets[3], nets[0]), running = test_max_diff(nets[3], nets[0], 1);
    double zero1 = test_max_param_diff(nets[1], nets[0]);
    double tolerance = TEST_EXACT_BUT_ON_NCCL(1e-5);
    if (!same || diff > tolerance || running > tolerance || zero1 > tolerance)
        printf("  ZeRO-3 on %d devices%s, %d runs%s: %s ZeRO-2's; from DDP's, parameters differ by %.3g, running "
               "statistics by %.3g (ZeRO-1's parameters by %.3g)\n", w, adam ? ", AdamW" : "", segments,
               accumulate ? ", accumulating" : "", same ? "the same bits as" : "NOT", diff, running, zero1);
    CHECK(same);
    CHECK_CLOSE(diff, 0.0, tolerance, 0);
    CHECK_CLOSE(running, 0.0, tolerance, 0);
    CHECK_CLOSE(logits_diff, 0.0, tolerance, 0);
    CHECK_CLOSE(zero1, 0.0, tolerance, 0);
    CHECK(nets[3]->steps == 20 && !nets[3]->sharded && !nets[3]->layer_hook);
    for (int k = 0; k < 4; k++) mgpu_net_free(nets[k]);
}
TEST(zero3_trains_like_ddp) {
    for (int w = 2; w <= 4; w *= 2)
        for (int adam = 0; adam <= 1; adam++) zero3_like_ddp(w, adam, 1, 0);
}
/* (long on emulated GPUs: each setting is three trainings of 20 steps) */
TEST_LONG(zero3_recomputing_or_accumulating_trains_like_ddp) {
    zero3_like_ddp(2, 1, 3, 0);
    zero3_like_ddp(2, 0, 2, 0);
    zero3_like_ddp(2, 1, 2, 0);
    /* accumulation (no_sync): stages 2 and 3 keep whole gradients between
       passes */
    for (int w = 2; w <= 4; w *= 2) zero3_like_ddp(w, 0, 1, 1);
    zero3_like_ddp(2, 1, 2, 1);
    zero3_like_ddp(4, 1, 2, 1);
}

/* ZeRO-3's memory on w devices with Adam, three linear layers (a unit
   each): between steps a device holds (4P + 4P + 8P) / w of the model's
   state, P counted with each unit padded to w equal chunks, within 1%
   (the allocator's 512-byte granules); over a step its parameters peak at
   most at its chunks and the two largest units whole (the one that runs
   and the next one, prefetched), and at least at its chunks and the
   largest unit. */
static void zero3_memory(int w) {
    mgpu_device *devs[4];
    mgpu_devices(w, TEST_ON_GPU, devs);
    size_t base[3][4];
    const mgpu_memory_category cats[3] = {MGPU_MEMORY_PARAMETERS, MGPU_MEMORY_GRADIENTS, MGPU_MEMORY_OPTIMIZER};
    mgpu_synchronize_all();
    for (int k = 0; k < 3; k++) held_all(devs, w, cats[k], base[k]);
    mgpu_manual_seed(5);
    mgpu_net *net = mgpu_net_new(devs[0]);
    const int features[4] = {256, 512, 512, 10};
    double padded = 0, units[3];
    for (int l = 0; l < 3; l++) {
        mgpu_net_add_linear(net, features[l], features[l + 1]);
        if (l < 2) mgpu_net_add_relu(net);
        double p = features[l] * features[l + 1] + features[l + 1];
        units[l] = ceil(p / w) * w;
        padded += units[l];
    }
    mgpu_net_use_adam(net, 0.9f, 0.999f, 1e-8f, 1);
    mgpu_data_parallel *dp = mgpu_data_parallel_new(net, devs, w, MGPU_DP_ALLREDUCE);
    mgpu_data_parallel_configure(dp, 256, 1, 1);
    mgpu_data_parallel_zero(dp, 3);
    mgpu_tensor *x = mgpu_randn(dev, mgpu_shape4(8, 1, 16, 16), 0.0f, 1.0f), *y = mgpu_zeros(dev, mgpu_shape1(8));
    for (int s = 0; s < 3; s++) {
        if (s == 2) for (int i = 0; i < w; i++) mgpu_device_reset_peak(devs[i]);
        mgpu_data_parallel_step(dp, x, y, 0.01f, 0.0f, 0.0f);
    }
    mgpu_synchronize_all();
    double formula = (4 + 4 + 8) * padded / w, chunks = 4 * padded / w; /* (bytes) */
    double two_units = 4 * (units[1] + units[0]), largest = 4 * units[1];
    for (int i = 0; i < w; i++) {
        double state = 0;
        for (int k = 0; k < 3; k++) state += (double)(mgpu_device_memory_of(devs[i], cats[k]) - base[k][i]);
        double params_peak = (double)(mgpu_device_memory_peak_of(devs[i], MGPU_MEMORY_PARAMETERS) - base[0][i]);
        CHECK_CLOSE(state, formula, 0.01 * formula, 0);
        int peak_ok = params_peak <= (chunks + two_units) * 1.01 && params_peak >= chunks + largest;
        if (!peak_ok)
            printf("  ZeRO-3 on %d devices, %s: the parameters' peak %.0f bytes; chunks %.0f, the largest unit %.0f, "
                   "two units %.0f\n", w, mgpu_device_name(devs[i]), params_peak, chunks, largest, two_units);
        CHECK(peak_ok);
    }
    mgpu_free(x);
    mgpu_free(y);
    mgpu_data_parallel_free(dp);
    mgpu_net_free(net);
}
TEST(zero3_memory_follows_the_formula) {
    for (int w = 2; w <= 4; w *= 2) zero3_memory(w);
}

/* The tracer shows ZeRO-3's gathers on each device's copy queue, under
   a kind of their own: in a step, each unit gathered twice (for its
   forward and its backward pass) by a copy from each of the w members. */
TEST(zero3_gathers_show_on_the_copy_queues) {
    const int w = 2, units = 3; /* (small_net with a bucket a layer) */
    mgpu_device *devs[2];
    mgpu_devices(w, TEST_ON_GPU, devs);
    mgpu_net *net = small_net(devs[0]);
    mgpu_data_parallel *dp = mgpu_data_parallel_new(net, devs, w, MGPU_DP_ALLREDUCE);
    mgpu_data_parallel_configure(dp, 256, 1, 1);
    mgpu_data_parallel_zero(dp, 3);
    mgpu_tensor *x = mgpu_randn(dev, mgpu_shape4(8, 1, 8, 8), 0.0f, 1.0f), *y = mgpu_zeros(dev, mgpu_shape1(8));
    mgpu_data_parallel_step(dp, x, y, 0.1f, 0.9f, 0.0f); /* (the first step makes the buckets) */
    mgpu_trace_begin();
    mgpu_data_parallel_step(dp, x, y, 0.1f, 0.9f, 0.0f);
    mgpu_trace_end();
    int gathers[2][2] = {{0, 0}, {0, 0}}; /* [device][lane] */
    for (int i = 0; i < mgpu_trace_count(); i++) {
        mgpu_trace_op op = mgpu_trace_get(i);
        if (strcmp(op.name, "ZeRO-3 gather") != 0) continue;
        CHECK(strcmp(op.kind, "ZeRO-3 gather") == 0);
        for (int d = 0; d < w; d++) gathers[d][op.lane] += op.device == devs[d];
    }
    for (int d = 0; d < w; d++) {
        CHECK_EQ_INT(gathers[d][1], 2 * units * w);
        CHECK_EQ_INT(gathers[d][0], 0);
    }
    mgpu_free(x);
    mgpu_free(y);
    mgpu_data_parallel_free(dp);
    mgpu_net_free(net);
}

TEST(bad_zero_settings_are_refused_by_name) {
    mgpu_device *devs[2];
    mgpu_devices(2, TEST_ON_GPU, devs);
    mgpu_net *net = small_net(devs[0]);
    mgpu_data_parallel *dp = mgpu_data_parallel_new(net, devs, 2, MGPU_DP_ALLREDUCE);
    EXPECT_DIES(mgpu_data_parallel_zero(dp, 4), "mgpu_data_parallel_zero: stage 4 does not exist: 0 (none), "
                                                "1 (the optimizer's state sharded), 2 (the gradients too) or 3");
    mgpu_data_parallel_zero(dp, 3);
    mgpu_tensor *x = mgpu_randn(dev, mgpu_shape4(4, 1, 8, 8), 0.0f, 1.0f), *y = mgpu_zeros(dev, mgpu_shape1(4));
    mgpu_data_parallel_step(dp, x, y, 0.1f, 0.9f, 0.0f);
    EXPECT_DIES(mgpu_data_parallel_zero(dp, 1), "mgpu_data_parallel_zero: call it before the wrapper's first step");
    EXPECT_DIES(mgpu_net_set_layer_hook(net, NULL, NULL), "mgpu_net_set_layer_hook: a ZeRO-3 wrapper "
                                                           "(mgpu_data_parallel_zero(dp, 3)) holds this network");
    EXPECT_DIES(mgpu_checkpoint_save(net, "/tmp/never.ckpt", NULL), "mgpu_checkpoint_save: /tmp/never.ckpt: the "
                                                                   "optimizer's state of this network is spread");
    mgpu_checkpoint_info info;
    EXPECT_DIES(mgpu_checkpoint_load(net, "/tmp/never.ckpt", &info), "mgpu_checkpoint_load: /tmp/never.ckpt: the "
                                                                    "optimizer's state of this network is spread");
    mgpu_free(x);
    mgpu_free(y);
    mgpu_data_parallel_free(dp);
    mgpu_net_free(net);
}

/* A layer hook of the program's own and ZeRO-3's cannot both hold a
   network: stage 3 refuses a network that has one, by name. */
static void no_hook(void *ctx, mgpu_net *net, int layer, int when) { (void)ctx, (void)net, (void)layer, (void)when; }
TEST(zero3_refuses_a_network_with_a_hook_of_yours) {
    mgpu_device *devs[2];
    mgpu_devices(2, TEST_ON_GPU, devs);
    mgpu_net *net = small_net(devs[0]);
    mgpu_net_set_layer_hook(net, no_hook, NULL);
    mgpu_data_parallel *dp = mgpu_data_parallel_new(net, devs, 2, MGPU_DP_ALLREDUCE);
    EXPECT_DIES(mgpu_data_parallel_zero(dp, 3), "mgpu_data_parallel_zero: stage 3 gathers the parameters with a "
                                                "layer hook, and the network has one of yours");
    mgpu_data_parallel_free(dp);
    mgpu_net_free(net);
}

TEST(bad_checkpoint_settings_are_refused_by_name) {
    mgpu_net *net = with_own_layers(1);
    EXPECT_DIES(mgpu_net_recompute(net, 0), "mgpu_net_recompute: 0 runs; want 1 (one run: no recomputation) up "
                                             "to the number of layers, or MGPU_SEGMENTS_SQRT");
    EXPECT_DIES(mgpu_net_recompute(net, -3), "mgpu_net_recompute: -3 runs; want 1");
    EXPECT_DIES(mgpu_net_recompute(net, 10), "mgpu_net_recompute: 10 runs of a network of 9 layers; "
                                              "at most one a layer");
    EXPECT_DIES(mgpu_device_memory_of(dev, (mgpu_memory_category)9), "mgpu_device_memory_of: memory category 9 "
                                                                     "does not exist");
    /* a backward pass after the activations were freed, and Adam after SGD's steps */
    mgpu_tensor *x, *y;
    batch(4, 8, &x, &y);
    mgpu_tensor *logits = mgpu_net_forward(net, x);
    mgpu_net_free_activations(net);
    EXPECT_DIES(mgpu_net_loss_backward(net, logits, y, 0.25f, NULL),
                "the activations of the last forward pass were freed (mgpu_net_free_activations): run "
                "mgpu_net_forward again first");
    mgpu_net_train_step(net, x, y, 0.1f, 0.0f, 0.0f, NULL);
    EXPECT_DIES(mgpu_net_use_adam(net, 0.9f, 0.999f, 1e-8f, 0), "mgpu_net_use_adam: the network has taken 1 SGD "
                                                               "steps; choose Adam before the first step");
    mgpu_free(x);
    mgpu_free(y);
    mgpu_net_free(net);
}

#if TEST_ON_GPU
TEST_MAIN_GPU((dev = mgpu_try_gpu(0), setenv("MGPU_CONV", "im2col", 1), mgpu__conv_settings_from_environment()))
#else
int main(int argc, char **argv) {
    dev = mgpu_cpu();
    setenv("MGPU_CONV", "im2col", 1); /* (one method: the bits do not depend on a trial) */
    mgpu__conv_settings_from_environment();
    return test__run_all(argc, argv);
}
#endif
