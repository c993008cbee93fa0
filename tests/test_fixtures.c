/* tests/test_fixtures.c: whole models against PyTorch.

   The numbers come from tests/make_fixtures.py (PyTorch, float32, CPU),
   for parameters and inputs both sides make from the same formula. The
   tolerances allow for float32 sums taken in a different order: relative
   1e-3 on values of order one, with an absolute floor set by the size of
   each quantity. tests/gpu_fixtures.c includes this file with TEST_ON_GPU
   1: the same comparisons for the models on a GPU. */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"
#include "test.h"
#include "fixture.h"

/* The chapter's own LeNet code is what is checked: include it, renaming its main. */
#define main chapter2_main
#include "../chapters/02_multi_gpu_from_scratch.c"
#undef main

#ifndef FIXTURES
#define FIXTURES "tests/fixtures/"
#endif

TEST(lenet_losses_and_gradients_match_pytorch) {
    fixture f = fixture_load(FIXTURES "lenet.bin");
    mgpu_device *d = test_device();
    static const int shapes[NUM_PARAMS][4] = {{20, 1, 3, 3}, {20}, {50, 20, 5, 5}, {50},
                                              {800, 128}, {128}, {128, 10}, {10}};
    static const int ndims[NUM_PARAMS] = {4, 1, 4, 1, 2, 1, 2, 1};
    mgpu_tensor *params[NUM_PARAMS];
    for (int k = 0; k < NUM_PARAMS; k++) {
        mgpu_shape s = mgpu_shape4(shapes[k][0], shapes[k][1], shapes[k][2], shapes[k][3]);
        s.ndim = ndims[k];
        for (int i = ndims[k]; i < 4; i++) s.d[i] = 1;
        params[k] = formula_tensor(d, s, k, 0.0, 0.1);
    }
    replica r;
    memset(&r, 0, sizeof r);
    r.device = d;
    mgpu_get_params(r.params, params, NUM_PARAMS, d);
    mgpu_tensor *x = formula_tensor(d, mgpu_shape4(8, 1, 28, 28), 1000, 0.5, 0.5);
    mgpu_tensor *y = fixture_tensor_on(fixture_get(&f, "labels"), d);
    mgpu_tensor *logits = lenet_forward(&r, x);
    mgpu_tensor *losses = mgpu_empty(d, mgpu_shape1(8));
    mgpu_cross_entropy_forward(losses, logits, y);
    lenet_backward(&r, x, y);
    CHECK(fixture_compare(losses, fixture_get(&f, "losses"), 1e-5, 1e-4) <= 1);
    for (int k = 0; k < NUM_PARAMS; k++) {
        char name[32];
        snprintf(name, sizeof name, "grad.%s", param_names[k]);
        /* gradients of a sum of 8 losses: entries of order 1e-3..1 */
        CHECK(fixture_compare(r.params[k].grad, fixture_get(&f, name), 1e-5, 1e-3) <= 1);
    }
    replica_free(&r);
    for (int k = 0; k < NUM_PARAMS; k++) mgpu_free(params[k]);
    mgpu_free(x);
    mgpu_free(y);
    mgpu_free(losses);
    fixture_free(&f);
}

/* The layer that owns parameter p (searching inside residual blocks). */
static const mgpu_layer *owner(const mgpu_layer *l, const mgpu_param *p) {
    if (!l) return NULL;
    if (&l->weight == p || &l->bias == p) return l;
    const mgpu_layer *subs[5] = {l->conv1, l->bn1, l->conv2, l->bn2, l->shortcut};
    for (int i = 0; i < 5; i++) {
        const mgpu_layer *o = owner(subs[i], p);
        if (o) return o;
    }
    return NULL;
}

/* The script's formula for every parameter, by the kind of its layer. */
static void resnet_formula_params(mgpu_net *net) {
    for (int k = 0; k < mgpu_net_num_params(net); k++) {
        mgpu_param *p = mgpu_net_param(net, k);
        const mgpu_layer *l = NULL;
        for (int i = 0; i < net->nlayers && !l; i++) l = owner(net->layers[i], p);
        int is_weight = p == &l->weight;
        if (l->kind == MGPU_LAYER_BATCHNORM && is_weight) formula_into(p->value, k, 1.0, 0.1);
        else if (!is_weight) formula_into(p->value, k, 0.0, 0.1);
        else formula_into(p->value, k, 0.0, 0.05);
    }
}

static const mgpu_layer *find_layer(const mgpu_layer *l, const char *name) {
    if (!l) return NULL;
    if (strcmp(l->name, name) == 0) return l;
    const mgpu_layer *subs[5] = {l->conv1, l->bn1, l->conv2, l->bn2, l->shortcut};
    for (int i = 0; i < 5; i++) {
        const mgpu_layer *o = find_layer(subs[i], name);
        if (o) return o;
    }
    return NULL;
}
static const mgpu_layer *net_layer(const mgpu_net *net, const char *name) {
    for (int i = 0; i < net->nlayers; i++) {
        const mgpu_layer *l = find_layer(net->layers[i], name);
        if (l) return l;
    }
    mgpu_fatal("no layer %s", name);
    return NULL;
}

TEST(resnet18_training_step_matches_pytorch) {
    fixture f = fixture_load(FIXTURES "resnet18_step.bin");
    mgpu_device *d = test_device();
    mgpu_net *net = mgpu_resnet18(10, 1, d);
    resnet_formula_params(net);
    mgpu_tensor *x = formula_tensor(d, mgpu_shape4(4, 1, 28, 28), 1000, 0.5, 0.5);
    mgpu_tensor *y = fixture_tensor_on(fixture_get(&f, "labels"), d);
    mgpu_tensor *loss = mgpu_zeros(d, mgpu_shape1(1));
    mgpu_net_zero_grad(net);
    mgpu_tensor *logits = mgpu_net_forward(net, x);
    CHECK(fixture_compare(logits, fixture_get(&f, "logits"), 1e-4, 1e-3) <= 1);
    mgpu_net_loss_backward(net, logits, y, 0.25f, loss);
    mgpu_scale_(loss, 0.25f); /* the summed loss of 4 samples -> the mean */
    CHECK(fixture_compare(loss, fixture_get(&f, "loss"), 1e-5, 1e-4) <= 1);
    /* Gradients through 18 layers of batch norm: relative 2e-3, absolute
       floors at about 1e-3 of each tensor's typical size. */
    const mgpu_layer *stem = net_layer(net, "stem.conv"), *bn = net_layer(net, "stage2.block1.bn1");
    const mgpu_layer *fc = net_layer(net, "fc"), *stem_bn = net_layer(net, "stem.bn");
    CHECK(fixture_compare(stem->weight.grad, fixture_get(&f, "grad.stem.conv.weight"), 1e-5, 2e-3) <= 1);
    /* the stem's bias comes before batch norm: its gradient is exactly 0
       here, PyTorch's is rounding noise below 1e-7 (mgpu__bias_cancelled_by) */
    CHECK(fixture_compare(stem->bias.grad, fixture_get(&f, "grad.stem.conv.bias"), 1e-7, 2e-3) <= 1);
    CHECK(fixture_compare(bn->weight.grad, fixture_get(&f, "grad.stage2.block1.bn1.weight"), 1e-5, 2e-3) <= 1);
    CHECK(fixture_compare(bn->bias.grad, fixture_get(&f, "grad.stage2.block1.bn1.bias"), 1e-5, 2e-3) <= 1);
    CHECK(fixture_compare(fc->weight.grad, fixture_get(&f, "grad.fc.weight"), 1e-5, 2e-3) <= 1);
    CHECK(fixture_compare(fc->bias.grad, fixture_get(&f, "grad.fc.bias"), 1e-5, 2e-3) <= 1);
    mgpu_net_sgd(net, 0.1f, 0.0f, 0.0f);
    CHECK(fixture_compare(stem_bn->running_mean, fixture_get(&f, "stem.bn.running_mean"), 1e-6, 1e-3) <= 1);
    CHECK(fixture_compare(stem_bn->running_var, fixture_get(&f, "stem.bn.running_var"), 1e-6, 1e-3) <= 1);
    CHECK(fixture_compare(bn->running_mean, fixture_get(&f, "stage2.block1.bn1.running_mean"), 1e-6, 1e-3) <= 1);
    CHECK(fixture_compare(bn->running_var, fixture_get(&f, "stage2.block1.bn1.running_var"), 1e-6, 1e-3) <= 1);
    CHECK(fixture_compare(fc->bias.value, fixture_get(&f, "after.fc.bias"), 1e-6, 1e-4) <= 1);
    mgpu_free(x);
    mgpu_free(y);
    mgpu_free(loss);
    mgpu_net_free(net);
    fixture_free(&f);
}


/* Trains the chapter's LeNet for `steps` batches on n devices from the same
   start; returns the parameters of device 0 in host memory. */
static float *lenet_after_steps(mgpu_tensor **params, int n, int steps, size_t *count) {
    mgpu_device *devices[2];
    mgpu_devices(n, TEST_ON_GPU, devices);
    replica replicas[2];
    memset(replicas, 0, sizeof replicas);
    mgpu_tensor *loss_sum[2], *correct[2];
    for (int i = 0; i < n; i++) {
        replicas[i].device = devices[i];
        mgpu_get_params(replicas[i].params, params, NUM_PARAMS, devices[i]);
        loss_sum[i] = mgpu_zeros(devices[i], mgpu_shape1(1));
        correct[i] = mgpu_zeros(devices[i], mgpu_shape1(1));
    }
    for (int s = 0; s < steps; s++) {
        mgpu_tensor *x = formula_tensor(mgpu_cpu(), mgpu_shape4(32, 1, 28, 28), 2000 + s, 0.5, 0.5);
        float labels[32];
        for (int i = 0; i < 32; i++) labels[i] = (float)((i * 3 + s) % 10);
        mgpu_tensor *y = mgpu_from_host(mgpu_cpu(), mgpu_shape1(32), labels);
        train_batch(x, y, replicas, n, 0.2f, loss_sum, correct);
        mgpu_synchronize_all();
        mgpu_free(x);
        mgpu_free(y);
    }
    *count = 0;
    for (int k = 0; k < NUM_PARAMS; k++) *count += params[k]->numel;
    float *out = (float *)malloc(*count * sizeof(float)), *at = out;
    for (int k = 0; k < NUM_PARAMS; k++) {
        mgpu_to_host(replicas[0].params[k].value, at);
        at += params[k]->numel;
    }
    for (int i = 0; i < n; i++) {
        replica_free(&replicas[i]);
        mgpu_free(loss_sum[i]);
        mgpu_free(correct[i]);
    }
    return out;
}

/* Five steps of Adam (L2 weight decay) and of AdamW (decoupled) from
   given gradients, against torch.optim's: every parameter within 1e-6
   (of values about 0.5: the last bits of the steps' rounding). */
TEST(adam_and_adamw_match_pytorch) {
    fixture f = fixture_load(FIXTURES "adam.bin");
    mgpu_device *d = test_device();
    for (int decoupled = 0; decoupled <= 1; decoupled++) {
        mgpu_net *net = mgpu_net_new(d);
        mgpu_layer *l = mgpu_net_add_linear(net, 6, 5);
        formula_into(l->weight.value, 0, 0.0, 0.5);
        formula_into(l->bias.value, 1, 0.0, 0.5);
        mgpu_net_use_adam(net, 0.9f, 0.999f, 1e-8f, decoupled);
        for (int step = 0; step < 5; step++) {
            formula_into(l->weight.grad, 100 + 10 * step, 0.0, 1.0);
            formula_into(l->bias.grad, 100 + 10 * step + 1, 0.0, 1.0);
            mgpu_net_step(net, 0.01f, 0.0f, 0.01f);
        }
        const char *name = decoupled ? "adamw" : "adam";
        char weight[32], bias[32];
        snprintf(weight, sizeof weight, "%s.weight", name);
        snprintf(bias, sizeof bias, "%s.bias", name);
        CHECK(fixture_compare(l->weight.value, fixture_get(&f, weight), 1e-6, 0.0) <= 1);
        CHECK(fixture_compare(l->bias.value, fixture_get(&f, bias), 1e-6, 0.0) <= 1);
        CHECK(net->steps == 5);
        EXPECT_DIES(mgpu_net_step(net, 0.01f, 0.9f, 0.0f), "momentum 0.9, but Adam keeps moments of its own");
        mgpu_net_free(net);
    }
    fixture_free(&f);
}

TEST(lenet_on_two_devices_trains_like_on_one) {
    mgpu_manual_seed(11);
    mgpu_tensor *params[NUM_PARAMS];
    lenet_init(params);
    /* the book's scale 0.01 barely moves in 20 steps: start from larger weights */
    for (int k = 0; k < NUM_PARAMS; k += 2) mgpu_scale_(params[k], 20.0f);
    size_t n;
    float *one = lenet_after_steps(params, 1, 20, &n);
    float *two = lenet_after_steps(params, 2, 20, &n);
    float *start = (float *)malloc(n * sizeof(float)), *at = start;
    for (int k = 0; k < NUM_PARAMS; k++) {
        mgpu_to_host(params[k], at);
        at += params[k]->numel;
    }
    double diff = 0, scale = 0, moved = 0;
    for (size_t i = 0; i < n; i++) {
        diff = fmax(diff, fabs((double)one[i] - two[i]));
        scale = fmax(scale, fabs((double)one[i]));
        moved = fmax(moved, fabs((double)one[i] - start[i]));
    }
    /* relative to the largest parameter, as the rounding of a float sum */
    if (diff > 1e-5 * scale) fprintf(stderr, "  1 and 2 devices differ by %g (scale %g)\n", diff, scale);
    CHECK(diff <= 1e-5 * scale);
    CHECK(moved > 1e-3 * scale); /* and training moved them */
    free(one);
    free(two);
    free(start);
    for (int k = 0; k < NUM_PARAMS; k++) mgpu_free(params[k]);
}

TEST_MAIN()
