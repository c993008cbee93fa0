/* tests/gpu_tensor_parallel.c: layers split across devices on GPUs (make
   test-gpu): every test of tests/test_tensor_parallel.c but the refusals
   (a forked child cannot use a GPU) on GPU devices, the physical GPUs
   first, then virtual ones sharing them. Without a GPU it says
   "skipped: no GPU" and passes. */
#define TEST_ON_GPU 1
#include "test_tensor_parallel.c"
