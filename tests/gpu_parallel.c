/* tests/gpu_parallel.c: networks and the data-parallel wrapper on GPUs
   (make test-gpu): every test of tests/test_parallel.c on GPU devices,
   the physical GPUs first, then virtual ones sharing them. Without a GPU
   it says "skipped: no GPU" and passes. */
#define TEST_ON_GPU 1
#include "test_parallel.c"
