/* tests/assignments/check_ring.c: the checker of the ring allreduce
   assignment (docs/assignments.md). Built with the student's file by
       make check-assignment NAME=ring FILE=student.c
   which must define void ring_allreduce(mgpu_tensor **data, int n). */
#include "mgpu.h"
#include "tests/test.h"
#include STUDENT_FILE

/* Every device's vector is the sum of all of them, within float's
   rounding of n terms of the double sum, and the same bits on every
   device (replicas that differ drift apart); at lengths that leave
   chunks short or empty, on 2 to 4 devices. */
TEST(sums_at_awkward_lengths_and_device_counts) {
    static const int lengths[] = {1, 2, 3, 7, 1000, 4099};
    for (int n = 2; n <= 4; n++)
        for (size_t k = 0; k < sizeof lengths / sizeof lengths[0]; k++) {
            int numel = lengths[k];
            mgpu_device *devs[4];
            mgpu_devices(n, 0, devs);
            mgpu_tensor *data[4];
            double *want = (double *)calloc((size_t)numel, sizeof(double));
            float *got = (float *)malloc((size_t)numel * sizeof(float)), *first = (float *)malloc((size_t)numel * sizeof(float));
            for (int i = 0; i < n; i++) {
                data[i] = mgpu_randn(devs[i], mgpu_shape1(numel), 0.0f, 1.0f);
                mgpu_to_host(data[i], got);
                for (int j = 0; j < numel; j++) want[j] += got[j];
            }
            ring_allreduce(data, n);
            int wrong = -1, differs = -1;
            for (int i = 0; i < n; i++) {
                mgpu_to_host(data[i], got);
                if (i == 0) memcpy(first, got, (size_t)numel * sizeof(float));
                for (int j = 0; j < numel && wrong < 0; j++)
                    if (!(fabs(got[j] - want[j]) <= 1e-5 * (1 + fabs(want[j])))) wrong = j;
                if (differs < 0 && memcmp(got, first, (size_t)numel * sizeof(float)) != 0) differs = i;
                if (wrong >= 0) {
                    printf("  %d devices, %d values: device %d's value %d is %g, the sum is %g\n", n, numel, i, wrong,
                           got[wrong], want[wrong]);
                    break;
                }
            }
            if (differs >= 0) printf("  %d devices, %d values: device %d's sums are not device 0's, bit for bit\n", n,
                                     numel, differs);
            CHECK(wrong < 0 && differs < 0);
            for (int i = 0; i < n; i++) mgpu_free(data[i]);
            free(want), free(got), free(first);
        }
}

/* Trained with it (mgpu_data_parallel_use_allreduce) on 2 devices, a
   small network takes the same steps as with the library's reduction,
   and its replicas stay the same, bit for bit. */
static double largest_difference(const mgpu_net *a, const mgpu_net *b) {
    double worst = 0;
    for (int p = 0; p < mgpu_net_num_params(a); p++) {
        const mgpu_tensor *x = ((mgpu_net *)a)->params[p]->value, *y = ((mgpu_net *)b)->params[p]->value;
        for (size_t i = 0; i < x->numel; i++) worst = fmax(worst, fabs(mgpu_item(x, i) - mgpu_item(y, i)));
    }
    return worst;
}
static mgpu_net *trained(mgpu_allreduce_fn reduction, double *replicas_apart) {
    mgpu_device *devs[2];
    mgpu_devices(2, 0, devs);
    mgpu_manual_seed(5);
    mgpu_net *net = mgpu_net_new(devs[0]);
    mgpu_scale_(mgpu_net_add_conv(net, 1, 6, 3, 1, 1)->weight.value, 30.0f);
    mgpu_net_add_batchnorm(net, 6);
    mgpu_net_add_relu(net);
    mgpu_net_add_global_avg_pool(net);
    mgpu_net_add_linear(net, 6, 10);
    mgpu_data_parallel *dp = mgpu_data_parallel_new(net, devs, 2, MGPU_DP_ALLREDUCE);
    if (reduction) mgpu_data_parallel_use_allreduce(dp, reduction, "yours");
    for (int step = 0; step < 3; step++) {
        mgpu_tensor *x = mgpu_rand(devs[0], mgpu_shape4(12, 1, 8, 8));
        float labels[12];
        for (int i = 0; i < 12; i++) labels[i] = (float)((i * 7 + step) % 10);
        mgpu_tensor *y = mgpu_from_host(devs[0], mgpu_shape1(12), labels);
        mgpu_data_parallel_step(dp, x, y, 0.1f, 0.9f, 0.0f);
        mgpu_free(x);
        mgpu_free(y);
    }
    *replicas_apart = largest_difference(net, mgpu_data_parallel_replica(dp, 1));
    mgpu_data_parallel_free(dp);
    return net;
}
TEST(trains_like_the_librarys_reduction) {
    double library_apart, yours_apart;
    mgpu_net *library = trained(NULL, &library_apart), *yours = trained(ring_allreduce, &yours_apart);
    double worst = largest_difference(library, yours);
    printf("  after 3 steps: largest difference from the library's training %.3g; between your replicas %.3g\n",
           worst, yours_apart);
    CHECK(worst <= 1e-4 && yours_apart == 0 && library_apart == 0);
    mgpu_net_free(library);
    mgpu_net_free(yours);
}

TEST_MAIN()
