/* tests/cuda_emu.h: runs the CUDA kernels of kernels/ on the CPU, so that
   `make test` checks them against their CPU references on a machine with
   no GPU (tests/emu_kernels.cpp; tests/gpu_*.c do the same on a real GPU).

   How a GPU runs a kernel, written out on one CPU thread: a launch
   kernel<<<grid, block>>>(args) runs grid.x * grid.y * grid.z blocks, and
   every block runs block.x threads that see their own threadIdx and the
   block's blockIdx. Here the blocks run one after another, and the
   threads of a block are fibers: each has its own stack, and they take
   turns, each running until it must wait for the others, so that
     __syncthreads()      is a barrier of the block's threads, and
     __shfl_*_sync(...)   is an exchange among the 32 threads of a warp,
                          with a barrier of the warp before and after;
   __shared__ variables are static, shared by the threads of the block
   (blocks run one at a time, so they do not share them with another).
   Fibers rather than OS threads: switching between them takes no system
   call. A fiber is made once with makecontext and then reused for thread
   after thread; switches are _setjmp/_longjmp, which unlike swapcontext
   leave the signal mask alone. Two shortcuts keep the big tests fast: a
   kernel whose first block meets no barrier runs its threads one after
   another without fibers (tests/emu_kernels.cpp took 57 s with a thread
   per CUDA thread).

   What it checks beyond the arithmetic: launch configurations a GPU
   refuses (an empty grid, gridDim.y or .z above 65535, more than 1024
   threads), warp shuffles with a partial mask or after some threads of
   the warp have returned (undefined on a GPU), barriers that not all
   threads of a block or warp reach, TF32 mma and wgmma inputs not
   rounded, the leading dimensions cuBLAS would reject, more than 48 KiB
   of dynamic shared memory without cudaFuncSetAttribute, unaligned
   asynchronous copies and ldmatrix rows. Asynchronous copies (cp.async)
   land as late as a GPU may let them, when their thread waits, so that
   reading them early shows. What it cannot check: timing, memory
   coalescing, races between blocks (blocks run in order here).

   The build (see the Makefile) rewrites every launch in kernels/,
   name<<<config>>>(args);  ->  mgpu_emu_launcher(config)(name, args);
   into build/emu/kernels.h, which this header's user includes next (or
   mgpu.h includes, built with MGPU_CUDA_EMU). The runtime, cuBLAS and
   NCCL calls are in tests/cuda_emu_runtime.h. */
#ifndef MGPU_CUDA_EMU_H
#define MGPU_CUDA_EMU_H
#undef _FORTIFY_SOURCE /* its longjmp refuses to jump to another stack */
#include <cblas.h>
#include <algorithm>
#include <functional>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#include <vector>

/* ----------------------------------------------- the language's pieces */
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct alignas(8) float2 {
    float x, y;
};
static float2 make_float2(float x, float y) { return float2{x, y}; }
static dim3 blockIdx, threadIdx; /* of the fiber running now */
static dim3 blockDim, gridDim;
#define __global__
#define __device__
#define __launch_bounds__(...)
#define __grid_constant__ /* (blocks run one at a time: every parameter is one copy) */
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define MGPU_CUDA 1
#define MGPU_CUDA_EMU 1

/* What a GPU would refuse: one line and exit status 1, at once (from a
   stream's thread too, where waiting for the others could hang). */
__attribute__((noreturn)) static void mgpu_emu_fail(const char *what) {
    fprintf(stderr, "cuda_emu: %s\n", what);
    fflush(stdout);
    _exit(1);
}

/* ------------------------------------------------ fibers and barriers */
/* A barrier of `expected` threads: the last to arrive opens it (a new
   generation) and the others, switched out meanwhile, go on. A thread that
   returns from the kernel leaves every barrier it belongs to. */
struct mgpu_emu_barrier {
    unsigned expected, arrived;
    unsigned long generation;
};
struct mgpu_emu_fiber {
    jmp_buf resume; /* where it waits: at a barrier, or for its next thread */
    bool made, done;
};
static const size_t mgpu_emu_stack_bytes = 256 << 10;
static mgpu_emu_fiber mgpu_emu_fibers[1024];
static jmp_buf mgpu_emu_scheduler;
static unsigned mgpu_emu_current;         /* the fiber running now */
static unsigned long mgpu_emu_progress;   /* arrivals, openings and returns so far */
static const std::function<void()> *mgpu_emu_kernel;
static mgpu_emu_barrier mgpu_emu_block_barrier, mgpu_emu_warp_barrier[32];
static unsigned char mgpu_emu_slot[1024][16]; /* each thread's value during a shuffle */
static unsigned mgpu_emu_warp_exited[32];     /* a bit for each thread that has returned */

/* Back to the scheduler, until it picks this fiber again. */
static void mgpu_emu_yield() {
    if (!_setjmp(mgpu_emu_fibers[mgpu_emu_current].resume)) _longjmp(mgpu_emu_scheduler, 1);
}
static void mgpu_emu_open(mgpu_emu_barrier *b) {
    b->arrived = 0;
    b->generation++;
    mgpu_emu_progress++;
}
static bool mgpu_emu_direct; /* the block runs its threads one by one, without fibers */
static void mgpu_emu_thread_returned(unsigned t); /* (asynchronous copies, below) */
static void mgpu_emu_arrive_and_wait(mgpu_emu_barrier *b) {
    if (mgpu_emu_direct)
        mgpu_emu_fail("a barrier in a kernel whose first block met none (every block must reach "
                      "the same barriers)");
    unsigned long generation = b->generation;
    mgpu_emu_progress++;
    if (++b->arrived == b->expected) mgpu_emu_open(b);
    while (b->generation == generation) mgpu_emu_yield();
}
static void mgpu_emu_leave(mgpu_emu_barrier *b) {
    b->expected--;
    if (b->arrived && b->arrived == b->expected) mgpu_emu_open(b);
}
/* A fiber's life: it waits for a thread to run, runs it to its end, and
   waits again. */
static void mgpu_emu_fiber_main() {
    for (;;) {
        mgpu_emu_yield();
        (*mgpu_emu_kernel)();
        unsigned tx = threadIdx.x;
        mgpu_emu_thread_returned(tx);
        mgpu_emu_warp_exited[tx / 32] |= 1u << (tx % 32);
        mgpu_emu_leave(&mgpu_emu_block_barrier);
        mgpu_emu_leave(&mgpu_emu_warp_barrier[tx / 32]);
        mgpu_emu_fibers[tx].done = true;
        mgpu_emu_progress++;
    }
}
static void mgpu_emu_make_fiber(unsigned t) {
    void *stack = mmap(NULL, mgpu_emu_stack_bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (stack == MAP_FAILED) mgpu_emu_fail("no memory for a fiber's stack");
    ucontext_t start, here;
    getcontext(&start);
    start.uc_stack.ss_sp = stack;
    start.uc_stack.ss_size = mgpu_emu_stack_bytes;
    start.uc_link = NULL; /* never returns */
    makecontext(&start, mgpu_emu_fiber_main, 0);
    mgpu_emu_current = t;
    if (!_setjmp(mgpu_emu_scheduler)) swapcontext(&here, &start); /* comes back by its first yield */
    mgpu_emu_fibers[t].made = true;
}

/* Runs fiber t until it waits or its thread returns. (A function of its
   own: locals of a function that calls _setjmp may be lost by _longjmp.) */
static __attribute__((noinline)) void mgpu_emu_resume(unsigned t) {
    mgpu_emu_current = t;
    threadIdx = dim3(t, 0, 0);
    if (!_setjmp(mgpu_emu_scheduler)) _longjmp(mgpu_emu_fibers[t].resume, 1);
}

/* Runs one block: every fiber in turn until all have returned. A round in
   which nobody arrives, opens or returns means the threads wait at
   barriers the others never reach (a GPU would hang). The turns go up the
   threads in even blocks and down in odd ones, so that a missing barrier
   shows whichever thread reads what another writes. */
static void mgpu_emu_run_block(unsigned threads, int downwards) {
    if (mgpu_emu_direct) {
        for (unsigned turn = 0; turn < threads; turn++) {
            threadIdx = dim3(downwards ? threads - 1 - turn : turn, 0, 0);
            (*mgpu_emu_kernel)();
            mgpu_emu_thread_returned(threadIdx.x);
        }
        return;
    }
    mgpu_emu_block_barrier = {threads, 0, 0};
    for (unsigned w = 0; w < threads / 32; w++) {
        mgpu_emu_warp_barrier[w] = {32, 0, 0};
        mgpu_emu_warp_exited[w] = 0;
    }
    for (unsigned t = 0; t < threads; t++) {
        if (!mgpu_emu_fibers[t].made) mgpu_emu_make_fiber(t);
        mgpu_emu_fibers[t].done = false;
    }
    for (unsigned left = threads; left;) {
        unsigned long before = mgpu_emu_progress;
        for (unsigned turn = 0; turn < threads; turn++) {
            unsigned t = downwards ? threads - 1 - turn : turn;
            if (mgpu_emu_fibers[t].done) continue;
            mgpu_emu_resume(t);
            left -= mgpu_emu_fibers[t].done;
        }
        if (left && mgpu_emu_progress == before)
            mgpu_emu_fail("threads wait at a barrier the others of their block or warp never reach");
    }
}

/* Runs a whole grid, block after block. A kernel whose first block met no
   barrier (no __syncthreads, no shuffle: most elementwise kernels) runs
   its other blocks, at this and later launches, without fibers, each
   thread to its end in turn, which is several times faster. `kernel`
   names the kernel (its address) for that. */
/* At namespace scope: made before main, so destroyed only after the
   atexit handlers (mgpu.h's waits for the streams' last kernels there). */
static std::vector<uintptr_t> mgpu_emu_barrier_free;
static void mgpu_emu_run_grid(dim3 grid, dim3 block, uintptr_t kernel, const std::function<void()> &body) {
    std::vector<uintptr_t> &barrier_free = mgpu_emu_barrier_free;
    gridDim = grid;
    blockDim = block;
    mgpu_emu_kernel = &body;
    mgpu_emu_direct = std::find(barrier_free.begin(), barrier_free.end(), kernel) != barrier_free.end();
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                unsigned long before = mgpu_emu_progress;
                blockIdx = dim3(bx, by, bz);
                mgpu_emu_run_block(block.x, (bx + by + bz) % 2);
                /* only returns counted: nobody arrived at a barrier (in
                   the first block: a later one may leave at once, as a
                   block past its product's tiles does in conv_nhwc.h) */
                if (!mgpu_emu_direct && bx + by + bz == 0 && mgpu_emu_progress - before == block.x) {
                    barrier_free.push_back(kernel);
                    mgpu_emu_direct = true;
                }
            }
    mgpu_emu_direct = false;
}

/* ------------------------------------------------------------- warps */
template <typename T> static T mgpu_emu_shuffle(unsigned mask, T v, int (*source)(int, int), int arg) {
    static_assert(sizeof(T) <= 16, "shuffled values are at most 16 bytes here");
    if (mask != 0xffffffffu) mgpu_emu_fail("a shuffle with a partial mask");
    unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (mgpu_emu_warp_exited[warp]) mgpu_emu_fail("a shuffle after some threads of the warp returned");
    memcpy(mgpu_emu_slot[threadIdx.x], &v, sizeof v);
    mgpu_emu_arrive_and_wait(&mgpu_emu_warp_barrier[warp]);
    T r;
    memcpy(&r, mgpu_emu_slot[warp * 32 + source(lane, arg)], sizeof r);
    mgpu_emu_arrive_and_wait(&mgpu_emu_warp_barrier[warp]);
    return r;
}
static int mgpu_emu_xor_lane(int lane, int mask) { return lane ^ mask; }
template <typename T> static T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    return mgpu_emu_shuffle(mask, v, mgpu_emu_xor_lane, lane_mask);
}
static int mgpu_emu_given_lane(int lane, int source) { return (void)lane, source; }
template <typename T> static T __shfl_sync(unsigned mask, T v, int source) {
    return mgpu_emu_shuffle(mask, v, mgpu_emu_given_lane, source);
}
static void __syncthreads() { mgpu_emu_arrive_and_wait(&mgpu_emu_block_barrier); }
static void __syncwarp(unsigned mask = 0xffffffffu) {
    if (mask != 0xffffffffu) mgpu_emu_fail("a warp barrier with a partial mask");
    unsigned warp = threadIdx.x / 32;
    if (mgpu_emu_warp_exited[warp]) mgpu_emu_fail("a warp barrier after some threads of the warp returned");
    mgpu_emu_arrive_and_wait(&mgpu_emu_warp_barrier[warp]);
}
/* fibers switch only at barriers, and blocks run one after another: an
   atomic operation is a plain one here, and a fence has nothing to order */
template <typename T> static T atomicAdd(T *address, T value) {
    T old = *address;
    *address = old + value;
    return old;
}
template <typename T> static T atomicCAS(T *address, T compare, T value) {
    T old = *address;
    if (old == compare) *address = value;
    return old;
}
static void __threadfence() {}
static void __threadfence_system() {}

/* ------------------------------------------- shared memory, asynchronous copies */
/* Dynamic shared memory (the launch's third argument): one buffer, as the
   blocks run one at a time; the launch checks its size against what
   cudaFuncSetAttribute allowed (cuda_emu_runtime.h). */
alignas(1024) static unsigned char mgpu_emu_dynamic_shared[228 << 10]; /* (aligned as a GPU's window) */
static void *mgpu__dynamic_shared() { return mgpu_emu_dynamic_shared; }

/* kernels/elementwise.h's 16-byte loads and stores, which a GPU refuses
   at an address not 16-byte aligned. */
static void mgpu_emu_check_vector(const float *p) {
    if ((uintptr_t)p % 16) mgpu_emu_fail("a 16-byte load or store at an address not 16-byte aligned");
}
static void mgpu__load_floats(float (&v)[4], const float *p) {
    mgpu_emu_check_vector(p);
    memcpy(v, p, sizeof v);
}
static void mgpu__store_floats(float *p, const float (&v)[4]) {
    mgpu_emu_check_vector(p);
    memcpy(p, v, sizeof v);
}

/* kernels/conv_nhwc.h's PTX pieces. A shared-memory address is a
   pointer here (a 32-bit offset on a GPU). */
typedef unsigned char *mgpu__shared_address;
static mgpu__shared_address mgpu__shared_address_of(const void *p) { return (unsigned char *)p; }
static unsigned mgpu__shared_window_offset(mgpu__shared_address a) {
    if (a < mgpu_emu_dynamic_shared || a >= mgpu_emu_dynamic_shared + sizeof mgpu_emu_dynamic_shared)
        mgpu_emu_fail("a shared-memory offset of an address outside the dynamic shared memory");
    return (unsigned)(a - mgpu_emu_dynamic_shared);
}

/* cp.async (mgpu__copy_async16 and its groups), written so that a kernel
   that reads shared memory before waiting for the copy sees the old
   bytes, as it may on a GPU: the source is read when the copy starts, the
   destination written only when the thread waits for the copy's group
   (mgpu__copies_wait<N>: all groups but the N most recently committed).
   A thread may not return with copies in flight. */
struct mgpu_emu_copy {
    unsigned char *to;
    float value[4];
    unsigned long group;
};
static std::vector<mgpu_emu_copy> mgpu_emu_copies[1024]; /* each thread's, in flight */
static unsigned long mgpu_emu_groups_committed[1024];
template <int cache> /* where a GPU caches the bytes on the way; one copy here */
static void mgpu__copy_async16(mgpu__shared_address shared, const float *global, bool valid) {
    if ((uintptr_t)shared % 16 || (uintptr_t)global % 16)
        mgpu_emu_fail("a 16-byte asynchronous copy from or to an address not 16-byte aligned");
    mgpu_emu_copy c = {shared, {0, 0, 0, 0}, mgpu_emu_groups_committed[threadIdx.x]};
    if (valid) memcpy(c.value, global, sizeof c.value); /* else zero-filled, global left unread */
    mgpu_emu_copies[threadIdx.x].push_back(c);
}
static void mgpu__copies_commit() { mgpu_emu_groups_committed[threadIdx.x]++; }
template <int N> static void mgpu__copies_wait() {
    std::vector<mgpu_emu_copy> &mine = mgpu_emu_copies[threadIdx.x];
    unsigned long committed = mgpu_emu_groups_committed[threadIdx.x];
    size_t kept = 0;
    for (const mgpu_emu_copy &c : mine) {
        if (c.group + N < committed) memcpy(c.to, c.value, sizeof c.value); /* lands now */
        else mine[kept++] = c;
    }
    mine.resize(kept);
}
static void mgpu_emu_check_tf32_bits(uint32_t bits) { /* (the tensor cores read only the top 19) */
    if (bits & 0x1fffu) mgpu_emu_fail("a TF32 mma input not rounded to TF32");
}
/* ldmatrix.x4: every lane gives a row's address, and takes from each of
   the four 8-row blocks the 4 bytes at row lane / 4, column lane % 4. */
static int mgpu_emu_block_row_lane(int lane, int block) { return 8 * block + lane / 4; }
static void mgpu__load_matrices(uint32_t (&r)[4], mgpu__shared_address row) {
    if ((uintptr_t)row % 16) mgpu_emu_fail("an ldmatrix row address not 16-byte aligned");
    for (int block = 0; block < 4; block++) {
        mgpu__shared_address from = mgpu_emu_shuffle(0xffffffffu, row, mgpu_emu_block_row_lane, block);
        memcpy(&r[block], from + 4 * (threadIdx.x % 32 % 4), sizeof r[block]);
    }
}
/* mma.sync.m16n8k8 (TF32): the warp's fragments put together into A and
   B as conv_nhwc.h lays them out, and each lane's 4 values of D. */
static uint32_t mgpu_emu_mma_in[1024][6]; /* each thread's a[4], b[2] */
static void mgpu__mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (mgpu_emu_warp_exited[warp]) mgpu_emu_fail("an mma after some threads of the warp returned");
    for (uint32_t v : a) mgpu_emu_check_tf32_bits(v);
    for (uint32_t v : b) mgpu_emu_check_tf32_bits(v);
    memcpy(mgpu_emu_mma_in[threadIdx.x], a, sizeof a);
    memcpy(mgpu_emu_mma_in[threadIdx.x] + 4, b, sizeof b);
    mgpu_emu_arrive_and_wait(&mgpu_emu_warp_barrier[warp]);
    float A[16][8], B[8][8];
    for (int l = 0; l < 32; l++) {
        const uint32_t *in = mgpu_emu_mma_in[warp * 32 + l];
        int g = l / 4, t = l % 4;
        memcpy(&A[g][t], &in[0], 4);
        memcpy(&A[g + 8][t], &in[1], 4);
        memcpy(&A[g][t + 4], &in[2], 4);
        memcpy(&A[g + 8][t + 4], &in[3], 4);
        memcpy(&B[t][g], &in[4], 4);
        memcpy(&B[t + 4][g], &in[5], 4);
    }
    int g = lane / 4, t = lane % 4;
    for (int e = 0; e < 4; e++) {
        int i = g + 8 * (e / 2), j = 2 * t + e % 2;
        for (int k = 0; k < 8; k++) d[e] += A[i][k] * B[k][j];
    }
    mgpu_emu_arrive_and_wait(&mgpu_emu_warp_barrier[warp]); /* the inputs are read before the next mma */
}

/* wgmma (mgpu__wgmma_tf32_n128 and its groups), as late as a GPU may run
   it: a product reads shared memory and adds to the accumulators only
   when its thread waits for its group (mgpu__wgmma_wait<N>), so that a
   kernel that overwrites the tiles, or reads the accumulators, before
   waiting sees what it would on a GPU at worst. Each thread computes its
   own 64 values of D from the operands in shared memory, where the
   descriptors say they are and as the 128-byte swizzle places them; the
   descriptor's fields are decoded here from their bits, so that a wrong
   descriptor reads the wrong values. */
struct mgpu_emu_wgmma {
    float (*d)[4];
    uint64_t a, b;
    unsigned long group;
};
static std::vector<mgpu_emu_wgmma> mgpu_emu_wgmmas[1024]; /* each thread's, in flight */
static unsigned long mgpu_emu_wgmma_groups[1024];
static bool mgpu_emu_wgmma_fenced[1024]; /* the thread's accumulators handed to wgmma (wgmma.fence) */
static void mgpu__fence_async_reads() {}
static void mgpu__wgmma_fence() { mgpu_emu_wgmma_fenced[threadIdx.x] = true; }
static void mgpu__wgmma_keep(float (&)[16][4]) {}
/* Value k (0..7) of row `row` of the operand that descriptor `desc` gives. */
static float mgpu_emu_wgmma_operand(uint64_t desc, int row, int k) {
    unsigned start = (unsigned)(desc & 0x3fff) << 4, eight_rows = (unsigned)(desc >> 32 & 0x3fff) << 4;
    if (desc >> 62 != 1) mgpu_emu_fail("a wgmma descriptor without the 128-byte swizzle (the only one emulated)");
    if (desc >> 49 & 7) mgpu_emu_fail("a wgmma descriptor with a base offset (tiles here start 1024-aligned)");
    if (eight_rows % 1024) mgpu_emu_fail("a 128-byte-swizzled wgmma operand whose 8-row blocks are not 1024 bytes apart");
    if (start % 1024 + 4 * 8 > 128) mgpu_emu_fail("a wgmma operand's 8 values crossing its 128-byte row");
    unsigned at = start + (unsigned)(row / 8) * eight_rows + (unsigned)(row % 8) * 128 + 4 * k;
    at ^= (at >> 7 & 7) << 4; /* the swizzle: chunk c of the 8 rows' pattern to c ^ (row % 8) */
    if (at + 4 > sizeof mgpu_emu_dynamic_shared) mgpu_emu_fail("a wgmma operand past the shared memory");
    uint32_t bits;
    memcpy(&bits, mgpu_emu_dynamic_shared + at, 4);
    mgpu_emu_check_tf32_bits(bits);
    float v;
    memcpy(&v, &bits, 4);
    return v;
}
static void mgpu_emu_wgmma_run(const mgpu_emu_wgmma &w) {
    unsigned warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
    for (int j = 0; j < 16; j++)
        for (int e = 0; e < 4; e++) {
            int row = 16 * warp + lane / 4 + 8 * (e / 2), col = 8 * j + 2 * (lane % 4) + e % 2;
            for (int k = 0; k < 8; k++)
                w.d[j][e] += mgpu_emu_wgmma_operand(w.a, row, k) * mgpu_emu_wgmma_operand(w.b, col, k);
        }
}
static void mgpu__wgmma_tf32_n128(float (&d)[16][4], uint64_t a, uint64_t b) {
    if (blockDim.x % 128) mgpu_emu_fail("a wgmma in a block that is not whole warpgroups of 128 threads");
    if (!mgpu_emu_wgmma_fenced[threadIdx.x]) mgpu_emu_fail("a wgmma with no wgmma fence before it");
    mgpu_emu_wgmmas[threadIdx.x].push_back({d, a, b, mgpu_emu_wgmma_groups[threadIdx.x]});
}
static void mgpu__wgmma_commit() { mgpu_emu_wgmma_groups[threadIdx.x]++; }
template <int N> static void mgpu__wgmma_wait() {
    std::vector<mgpu_emu_wgmma> &mine = mgpu_emu_wgmmas[threadIdx.x];
    unsigned long committed = mgpu_emu_wgmma_groups[threadIdx.x];
    size_t kept = 0;
    for (const mgpu_emu_wgmma &w : mine) {
        if (w.group + N < committed) mgpu_emu_wgmma_run(w); /* done now, in the order issued */
        else mine[kept++] = w;
    }
    mine.resize(kept);
    mgpu_emu_wgmma_fenced[threadIdx.x] = false; /* (the accumulators are the thread's again) */
}

static void mgpu_emu_thread_returned(unsigned t) {
    if (!mgpu_emu_copies[t].empty())
        mgpu_emu_fail("a thread returned with asynchronous copies it never waited for");
    if (!mgpu_emu_wgmmas[t].empty()) mgpu_emu_fail("a thread returned with wgmma products it never waited for");
    mgpu_emu_groups_committed[t] = 0;
    mgpu_emu_wgmma_groups[t] = 0;
    mgpu_emu_wgmma_fenced[t] = false;
}

/* float to TF32 as the tensor cores and cuBLAS's TF32 products read it:
   10 bits of mantissa, rounded to nearest, ties away from zero (cvt.rna) */
static float mgpu_emu_tf32(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    if ((bits & 0x7f800000u) != 0x7f800000u) bits = (bits + 0x1000u) & ~0x1fffu;
    memcpy(&v, &bits, sizeof v);
    return v;
}
#define __align__(n) __attribute__((aligned(n)))

#include "cuda_emu_runtime.h"
#endif
