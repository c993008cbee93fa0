/* tests/gpu_pipeline.c: pipelines on GPUs (make test-gpu): the tests of
   tests/test_pipeline.c on GPU devices, the physical GPUs first, then
   virtual ones sharing them. Without a GPU it says "skipped: no GPU" and
   passes. */
#define TEST_ON_GPU 1
#include "test_pipeline.c"
