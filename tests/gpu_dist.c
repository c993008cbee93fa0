/* tests/gpu_dist.c: tests/dist_tests.c on GPU devices, one a rank: the
   collectives and the distributed wrapper through host memory ("mpi via
   host"). tests/dist.sh runs it under mpirun on emulated GPUs; alone, or
   on a machine without a GPU, it is a group of one on the CPU. */
#define TEST_ON_GPU 1
#include "dist_tests.c"
