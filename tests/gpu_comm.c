/* tests/gpu_comm.c: communication on GPUs (make test-gpu).

   Every test of tests/test_comm.c again, on GPU logical devices (the
   physical GPUs, then virtual devices sharing them), and NCCL: a group of
   one GPU, which still goes through ncclCommInitAll and every collective,
   and a group of every GPU when there are several. Without a GPU it says
   "skipped: no GPU" and passes. */
#define TEST_ON_GPU 1
#include "test_comm.c"

/* An NCCL communicator over the first g physical GPUs, made once. */
static mgpu_nccl_comm *group_of(int g, mgpu_device **dev) {
    static mgpu_nccl_comm *groups[MGPU_MAX_DEVICES + 1];
    mgpu_devices(g, 1, dev);
    if (!groups[g]) groups[g] = mgpu_nccl_init(dev, g);
    CHECK(groups[g] != NULL);
    return groups[g];
}

static const char *run_nccl(mgpu_tensor **data, int k, int average) {
    mgpu_device *dev[MGPU_MAX_DEVICES];
    mgpu_nccl_allreduce(group_of(k, dev), data, average);
    return NULL;
}

/* Groups of 1 and of every GPU (the same group on a machine with one). */
static int group_sizes(int *sizes) {
    int g = mgpu_num_gpus() < MGPU_MAX_DEVICES ? mgpu_num_gpus() : MGPU_MAX_DEVICES;
    sizes[0] = 1;
    sizes[1] = g;
    return g > 1 ? 2 : 1;
}

TEST(nccl_allreduce_sums_and_averages) {
    int sizes[2], ngroups = group_sizes(sizes);
    size_t lengths[] = {1, 7, 1009, (size_t)1 << 18};
    for (int s = 0; s < ngroups; s++)
        for (size_t l = 0; l < sizeof lengths / sizeof lengths[0]; l++)
            for (int average = 0; average <= 1; average++)
                check_allreduce(run_nccl, "mgpu_nccl_allreduce", sizes[s], lengths[l], average);
}

TEST(nccl_broadcast_copies_the_root) {
    int sizes[2], ngroups = group_sizes(sizes);
    for (int s = 0; s < ngroups; s++) {
        int g = sizes[s];
        mgpu_device *dev[MGPU_MAX_DEVICES];
        mgpu_tensor *data[MGPU_MAX_DEVICES];
        mgpu_nccl_comm *c = group_of(g, dev);
        for (int i = 0; i < g; i++) data[i] = mgpu_full(dev[i], mgpu_shape1(1000), (float)(i + 1));
        mgpu_nccl_broadcast(c, data, g - 1);
        for (int i = 0; i < g; i++) {
            CHECK_CLOSE(mgpu_item(data[i], 0), g, 0, 0);
            CHECK_CLOSE(mgpu_item(data[i], 999), g, 0, 0);
            mgpu_free(data[i]);
        }
    }
}

/* in[r] = input_value(r, .) of g*m elements: out[i][j] is the sum over
   the ranks r of in[r][i*m + j]. */
TEST(nccl_reduce_scatter_gives_each_rank_its_chunk_of_the_sum) {
    int sizes[2], ngroups = group_sizes(sizes);
    enum { M = 1001 };
    for (int s = 0; s < ngroups; s++) {
        int g = sizes[s];
        mgpu_device *dev[MGPU_MAX_DEVICES];
        mgpu_tensor *in[MGPU_MAX_DEVICES], *out[MGPU_MAX_DEVICES];
        mgpu_nccl_comm *c = group_of(g, dev);
        for (int i = 0; i < g; i++) {
            in[i] = input_on(dev[i], i, (size_t)g * M, 1.0f);
            out[i] = mgpu_empty(dev[i], mgpu_shape1(M));
        }
        mgpu_nccl_reduce_scatter(c, in, out, 0);
        for (int i = 0; i < g; i++)
            for (int j = 0; j < M; j += 100) {
                double want = 0, magnitude = 0;
                for (int r = 0; r < g; r++) {
                    want += input_value(r, (size_t)i * M + (size_t)j);
                    magnitude += fabs(input_value(r, (size_t)i * M + (size_t)j));
                }
                CHECK_CLOSE(mgpu_item(out[i], (size_t)j), want, g * ldexp(1.0, -24) * magnitude, 0);
            }
        for (int i = 0; i < g; i++) {
            mgpu_free(in[i]);
            mgpu_free(out[i]);
        }
    }
}

TEST(nccl_all_gather_puts_every_rank_in_a_row) {
    int sizes[2], ngroups = group_sizes(sizes);
    enum { M = 777 };
    for (int s = 0; s < ngroups; s++) {
        int g = sizes[s];
        mgpu_device *dev[MGPU_MAX_DEVICES];
        mgpu_tensor *in[MGPU_MAX_DEVICES], *out[MGPU_MAX_DEVICES];
        mgpu_nccl_comm *c = group_of(g, dev);
        for (int i = 0; i < g; i++) {
            in[i] = mgpu_full(dev[i], mgpu_shape1(M), (float)(i + 1));
            out[i] = mgpu_empty(dev[i], mgpu_shape1(g * M));
        }
        mgpu_nccl_all_gather(c, in, out);
        for (int i = 0; i < g; i++)
            for (int r = 0; r < g; r++) {
                CHECK_CLOSE(mgpu_item(out[i], (size_t)r * M), r + 1, 0, 0);
                CHECK_CLOSE(mgpu_item(out[i], (size_t)r * M + M - 1), r + 1, 0, 0);
            }
        for (int i = 0; i < g; i++) {
            mgpu_free(in[i]);
            mgpu_free(out[i]);
        }
    }
}

/* NCCL calls are grouped, so the tracer opens their bars by hand. */
TEST(nccl_calls_show_on_the_timeline) {
    mgpu_device *dev[1];
    mgpu_tensor *data[1];
    mgpu_nccl_comm *c = group_of(1, dev);
    data[0] = mgpu_ones(dev[0], mgpu_shape1(1 << 20));
    mgpu_trace_begin();
    mgpu_nccl_allreduce(c, data, 0);
    mgpu_trace_end();
    CHECK(mgpu_trace_write_png("/tmp/mgpu_gpu_comm_timeline.png", "NCCL allreduce") == 0);
    CHECK_CLOSE(mgpu_item(data[0], 0), 1, 0, 0);
    mgpu_free(data[0]);
}

TEST(nccl_wrong_device_is_an_error) {
    mgpu_device *dev[1];
    mgpu_nccl_comm *c = group_of(1, dev);
    mgpu_tensor *on_cpu[1] = {mgpu_zeros(mgpu_cpu(), mgpu_shape1(4))};
    EXPECT_DIES(mgpu_nccl_allreduce(c, on_cpu, 0),
                "mgpu: error: mgpu_nccl_allreduce: data[0] is on cpu, but rank 0 is GPU 0");
    EXPECT_DIES(mgpu_nccl_allreduce(NULL, on_cpu, 0), "mgpu_nccl_allreduce: the communicator is NULL");
    mgpu_free(on_cpu[0]);
}

TEST_MAIN_GPU((void)0)
