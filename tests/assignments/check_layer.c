/* tests/assignments/check_layer.c: the checker of the layer-of-one's-own
   assignment (docs/assignments.md). Built with the student's file by
       make check-assignment NAME=layer FILE=student.c
   which must define const mgpu_layer_fns leaky_relu, a leaky ReLU whose
   slope is the float its settings point to. */
#include "mgpu.h"
#include "tests/test.h"
#include STUDENT_FILE

static float slope = 0.1f;

/* x values away from the kink at 0 (by at least 0.05), half negative. */
static mgpu_tensor *away_from_zero(mgpu_device *d, mgpu_shape shape) {
    mgpu_tensor *x = mgpu_randn(d, shape, 0.0f, 1.0f);
    float *v = (float *)malloc(x->numel * sizeof(float));
    mgpu_to_host(x, v);
    for (size_t i = 0; i < x->numel; i++) v[i] += v[i] > 0 ? 0.05f : -0.05f;
    mgpu_tensor *moved = mgpu_from_host(d, shape, v);
    mgpu_free(x);
    free(v);
    return moved;
}

/* Its output is the leaky ReLU's, exactly. */
TEST(forward_values) {
    mgpu_device *d = mgpu_cpu();
    mgpu_net *alone = mgpu_net_new(d);
    mgpu_net_add_layer(alone, &leaky_relu, NULL, NULL, &slope);
    mgpu_tensor *x = away_from_zero(d, mgpu_shape2(4, 9));
    const mgpu_tensor *y = mgpu_net_forward(alone, x);
    int wrong = 0;
    for (size_t i = 0; i < x->numel; i++) {
        float v = mgpu_item(x, i), want = v > 0 ? v : slope * v;
        wrong += mgpu_item(y, i) != want;
    }
    if (wrong) printf("  %d of %zu outputs are not the leaky ReLU's\n", wrong, x->numel);
    CHECK(wrong == 0);
    mgpu_free(x);
    mgpu_net_free(alone);
}

/* Its backward pass, alone and inside a network, against central
   differences (mgpu_net_gradcheck). */
TEST(gradients_alone_and_in_a_network) {
    mgpu_device *d = mgpu_cpu();
    mgpu_net *alone = mgpu_net_new(d);
    mgpu_net_add_layer(alone, &leaky_relu, NULL, NULL, &slope);
    mgpu_tensor *x = away_from_zero(d, mgpu_shape2(4, 9));
    mgpu_gradcheck_result r = mgpu_net_gradcheck(alone, x, 36, stdout);
    CHECK(r.checked == 36 && r.failed == 0);
    mgpu_free(x);
    mgpu_net_free(alone);
    mgpu_manual_seed(3);
    mgpu_net *net = mgpu_net_new(d);
    mgpu_scale_(mgpu_net_add_conv(net, 1, 4, 3, 1, 1)->weight.value, 30.0f);
    mgpu_net_add_layer(net, &leaky_relu, NULL, NULL, &slope);
    mgpu_net_add_global_avg_pool(net);
    mgpu_net_add_linear(net, 4, 10);
    x = mgpu_rand(d, mgpu_shape4(3, 1, 6, 6));
    r = mgpu_net_gradcheck(net, x, 8, stdout);
    CHECK(r.failed == 0 && r.checked > 0);
    mgpu_free(x);
    mgpu_net_free(net);
}

TEST_MAIN()
