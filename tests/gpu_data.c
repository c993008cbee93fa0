/* tests/gpu_data.c: the loader feeding GPUs (run by `make test-gpu`).

   Batches are copied non-blocking from the loader's pinned buffers onto
   the GPU devices, whole and scattered in halves through views that are
   freed at once, while the loader thread refills its buffers. Every copy
   must hold its own batch: the loader waits for the GPU copy streams
   before it reuses a buffer. Without a GPU it prints a note and passes. */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"
#include "test.h"
#include "datasets.h"


TEST(loader_batches_copied_to_gpus) {
    enum { N = 20000, BS = 256 };
    mgpu_dataset *d = indexed_dataset(N);
    mgpu_device *devs[2];
    mgpu_devices(2, 1, devs);
    mgpu_loader *l = mgpu_loader_new(d, BS, 0, 0);
    int nb = mgpu_loader_num_batches(l);
    mgpu_tensor **whole = (mgpu_tensor **)calloc((size_t)nb, sizeof *whole);
    mgpu_tensor **halves = (mgpu_tensor **)calloc((size_t)nb * 2, sizeof *halves);
    int *sizes = (int *)calloc((size_t)nb, sizeof *sizes);
    mgpu_loader_start_epoch(l, 0);
    mgpu_batch b;
    int k = 0;
    while (mgpu_loader_next(l, &b)) {
        sizes[k] = b.n;
        whole[k] = mgpu_to(b.x, devs[0], 1);
        int first = b.n / 2;
        for (int h = 0; h < 2; h++) {
            mgpu_tensor *part = mgpu_narrow(b.x, h ? first : 0, h ? b.n - first : first);
            halves[2 * k + h] = mgpu_to(part, devs[h], 1);
            mgpu_free(part);
        }
        k++;
    }
    CHECK_EQ_INT(k, nb);
    mgpu_synchronize_all();
    float *host = (float *)malloc(BS * 4 * sizeof(float));
    int bad = 0, start = 0;
    for (int j = 0; j < k; j++) {
        const unsigned char *want = d->images + (size_t)start * 4;
        mgpu_to_host(whole[j], host);
        for (int i = 0; i < sizes[j] * 4; i++) bad += host[i] != (float)want[i] / 255.0f;
        int offset = 0;
        for (int h = 0; h < 2; h++) {
            mgpu_to_host(halves[2 * j + h], host);
            for (size_t i = 0; i < halves[2 * j + h]->numel; i++)
                bad += host[i] != (float)want[offset + i] / 255.0f;
            offset += (int)halves[2 * j + h]->numel;
            mgpu_free(halves[2 * j + h]);
        }
        mgpu_free(whole[j]);
        start += sizes[j];
    }
    CHECK_EQ_INT(start, N);
    CHECK_EQ_INT(bad, 0);
    free(host);
    free(whole);
    free(halves);
    free(sizes);
    mgpu_loader_free(l);
    mgpu_dataset_free(d);
}

TEST_MAIN_GPU((void)0)
