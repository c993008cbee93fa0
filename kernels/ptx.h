/* kernels/ptx.h: the inline-PTX wrappers of the tensor-core kernels
   (conv_nhwc.h): asynchronous copies to shared memory, ldmatrix,
   mma.sync in TF32, and Hopper's warpgroup products (wgmma). Under the
   emulator of tests/, tests/cuda_emu.h defines the same functions.

   defines: mgpu__shared_address, mgpu__shared_address_of,
            mgpu__copy_async16, mgpu__copies_commit, mgpu__copies_wait,
            mgpu__load_matrices, mgpu__mma_tf32, mgpu__dynamic_shared,
            mgpu__shared_window_offset, mgpu__fence_async_reads,
            mgpu__wgmma_fence, mgpu__wgmma_commit, mgpu__wgmma_wait,
            mgpu__wgmma_keep, mgpu__wgmma_tf32_n128, MGPU__WGMMA_BUILT */
#ifndef MGPU_KERNELS_PTX_H
#define MGPU_KERNELS_PTX_H
#if MGPU_CUDA
/* The GPU's pieces the tensor-core kernels take from PTX (sm_80 and
   newer), as CUTLASS does; tests/cuda_emu.h has the same functions for the emulated
   GPU. Shared memory is addressed by mgpu__shared_address, a 32-bit
   offset into the block's shared memory (so that no 64-bit arithmetic is
   spent on addresses), made by mgpu__shared_address_of(pointer).
     mgpu__copy_async16<cache>(to, from, valid)  (cp.async) starts a copy
                          of 16 bytes from memory to shared memory without
                          registers, or of 16 zero bytes when !valid
                          (from is then not read); through the L1 cache
                          too with cache MGPU__KEEP_IN_L1 (.ca), else
                          from L2 alone (MGPU__SKIP_L1, .cg; conv_nhwc.h says
                          which kernel takes which);
     mgpu__copies_commit()  closes the group of copies started since the
                          last commit;
     mgpu__copies_wait<N>()  waits until all but the N most recent groups
                          of this thread's copies have landed (other
                          threads' copies need a barrier after it);
     mgpu__load_matrices(r, row)  (ldmatrix.x4) the warp loads four 8 x 4
                          blocks of 32-bit values: lane l gives the address
                          of row l % 8 of block l / 8, and gets in r[i] the
                          value at row l / 4, column l % 4 of block i;
     mgpu__mma_tf32(d, a, b)  (mma.sync.m16n8k8) D += A B for A 16 x 8 and
                          B 8 x 8 in TF32, D 16 x 8 in float32, spread over
                          the warp's lanes as PTX lays them out: lane l, with
                          g = l / 4 and t = l % 4, holds
                              a = A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4]
                              b = B[t][g], B[t+4][g]
                              d = D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]
   So a lane's a fragment is what mgpu__load_matrices gives it from a 16 x 8
   tile of A stored by rows (its blocks: rows 0-7 and 8-15 of columns 0-3,
   then of columns 4-7), and its b fragments for two 8-column tiles of B
   what it gives from B stored by columns (blocks: columns 0-7 of rows 0-3
   and of rows 4-7, then columns 8-15).

   And Hopper's warpgroup products (wgmma, PTX for the sm_90a target
   only, where nvcc defines __CUDA_ARCH_FEAT_SM90_ALL; the Makefile builds
   its compute capability 9.0 code for it), which the four warps of a
   block issue together and the tensor cores run while the warps go on:
     mgpu__wgmma_tf32_n128(d, a, b)  D += A B for A 64 x 8 and B 8 x 128
                          (TF32), both read by the tensor cores straight
                          from shared memory, where the descriptors a and
                          b say (conv_nhwc.h's mgpu__wgmma_descriptor; B by its
                          columns, as the other kernels store b); D 64 x
                          128 in float32, a thread's 64 values d[j][e]
                          being D[16 w + l / 4 + 8 (e / 2)][8 j + 2 (l % 4)
                          + e % 2] for lane l of warp w: warp w's 16 rows,
                          as 16 tiles of 16 x 8, each laid out as
                          mgpu__mma_tf32's d;
     mgpu__wgmma_fence()  before the first product that reads
                          accumulators the threads wrote themselves;
     mgpu__wgmma_commit(), mgpu__wgmma_wait<N>()  close the group of
                          products issued since the last commit, and wait
                          until all but the N most recent groups are done
                          (until then the accumulators are not to be
                          read, nor their shared memory overwritten);
     mgpu__wgmma_keep(d)  tells the compiler d is in use here, so that it
                          moves no access to d across a wait;
     mgpu__fence_async_reads()  orders this thread's writes to shared
                          memory (cp.async's too) before later reads by
                          the tensor cores, which read through another
                          path (the "async proxy"); then a barrier
                          extends that to the block's other threads. */
enum { MGPU__SKIP_L1, MGPU__KEEP_IN_L1 };
#ifndef MGPU_CUDA_EMU
typedef unsigned mgpu__shared_address;
static __device__ __forceinline__ mgpu__shared_address mgpu__shared_address_of(const void *p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
template <int cache>
static __device__ __forceinline__ void mgpu__copy_async16(mgpu__shared_address to, const float *from,
                                                          bool valid) {
#if __CUDA_ARCH__ >= 800
    int bytes = valid ? 16 : 0;
    if (cache == MGPU__KEEP_IN_L1)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(from), "r"(bytes));
    else
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(from), "r"(bytes));
#endif
}
static __device__ __forceinline__ void mgpu__copies_commit(void) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N> static __device__ __forceinline__ void mgpu__copies_wait(void) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}
static __device__ __forceinline__ void mgpu__load_matrices(uint32_t (&r)[4], mgpu__shared_address row) {
#if __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(row));
#endif
}
static __device__ __forceinline__ void mgpu__mma_tf32(float (&d)[4], const uint32_t (&a)[4],
                                                      const uint32_t (&b)[2]) {
#if __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}
static __device__ __forceinline__ void *mgpu__dynamic_shared(void) {
    extern __shared__ __align__(128) unsigned char mgpu__shared_bytes[];
    return mgpu__shared_bytes;
}
/* The offset of a shared-memory address in the block's window (what a
   wgmma descriptor holds): the address itself on a GPU. */
static __device__ __forceinline__ unsigned mgpu__shared_window_offset(mgpu__shared_address a) { return a; }
static __device__ __forceinline__ void mgpu__fence_async_reads(void) {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MGPU__WGMMA_BUILT 1 /* this pass of nvcc builds the wgmma kernels */
static __device__ __forceinline__ void mgpu__wgmma_fence(void) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
static __device__ __forceinline__ void mgpu__wgmma_commit(void) {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N> static __device__ __forceinline__ void mgpu__wgmma_wait(void) {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* (d[j][e] is register 4 j + e of the product's 64) */
#define MGPU__F4(d, j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define MGPU__F16(d, j) MGPU__F4(d, j), MGPU__F4(d, j + 1), MGPU__F4(d, j + 2), MGPU__F4(d, j + 3)
static __device__ __forceinline__ void mgpu__wgmma_keep(float (&d)[16][4]) {
    asm volatile("" : MGPU__F16(d, 0), MGPU__F16(d, 4), MGPU__F16(d, 8), MGPU__F16(d, 12)::"memory");
}
static __device__ __forceinline__ void mgpu__wgmma_tf32_n128(float (&d)[16][4], uint64_t a, uint64_t b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n" /* p: D += A B, not D = A B */
                 "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
                 "%64, %65, p, 1, 1;\n}\n"
                 : MGPU__F16(d, 0), MGPU__F16(d, 4), MGPU__F16(d, 8), MGPU__F16(d, 12)
                 : "l"(a), "l"(b));
}
#undef MGPU__F16
#undef MGPU__F4
#endif
#endif
#endif
#endif
