/* tests/gpu_fixtures.c: the whole models against PyTorch on a GPU (make
   test-gpu): every test of tests/test_fixtures.c with the models on GPU
   devices. Without a GPU it says "skipped: no GPU" and passes. */
#define TEST_ON_GPU 1
#include "test_fixtures.c"
