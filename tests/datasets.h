/* tests/datasets.h: small made-up data sets for the loader tests. */
#ifndef MGPU_TEST_DATASETS_H
#define MGPU_TEST_DATASETS_H

/* A data set whose 2x2 images spell their own index: pixels 0 and 1 are
   its low and high bytes, so a batch tells which samples it holds. */
static mgpu_dataset *indexed_dataset(int n) {
    mgpu_dataset *d = (mgpu_dataset *)calloc(1, sizeof *d);
    d->n = n;
    d->rows = d->cols = 2;
    d->images = (unsigned char *)malloc((size_t)n * 4);
    d->labels = (unsigned char *)malloc((size_t)n);
    for (int i = 0; i < n; i++) {
        d->images[4 * i + 0] = (unsigned char)(i & 255);
        d->images[4 * i + 1] = (unsigned char)(i >> 8);
        d->images[4 * i + 2] = (unsigned char)(i % 251);
        d->images[4 * i + 3] = 255;
        d->labels[i] = (unsigned char)(i % 10);
    }
    return d;
}
#endif
