/* tests/gpu_memory.c: tests/test_memory.c on a GPU (emulated ones in make
   test): memory by category, limits and gradient checkpointing there. */
#define TEST_ON_GPU 1
#include "test_memory.c"
