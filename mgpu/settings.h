/* mgpu/settings.h: the settings read from the environment when the
   library starts (the manual's SETTINGS lists them all): MGPU_TF32, the
   products that may use TF32 on a GPU; MGPU_CONV, how convolutions are
   computed, on a GPU (the method) and on a CPU (im2col, oneDNN, or
   whichever a trial finds faster); MGPU_WGMMA, whether a GPU's candidates
   include the wgmma kernels; MGPU_CHECK_REPLICAS. A bad value stops the
   program before its work, in one line. Every chapter meets them through
   the manual; chapters 3 and 4 read MGPU_CONV and MGPU_CHECK_REPLICAS
   here (the replicas' check itself is in mgpu/data_parallel.h).
   MGPU_DIST_BACKEND, NCCL or MPI between processes' GPUs, is read here
   and used by mgpu/groups.h. (MGPU_DIST_TIMEOUT is read by
   mgpu/groups.h, MGPU_DATA by mgpu/data.h.)
   defines: mgpu_set_tf32, mgpu_get_tf32, mgpu_tf32_str, mgpu_set_dist_backend,
   mgpu_get_dist_backend */
/* Which products may use TF32 on a GPU: [0] convolutions, [1] mgpu_matmul
   and the linear layers. -1 until first asked: then MGPU_TF32 or
   PyTorch's defaults (conv yes, matmul no). */
static int mgpu__tf32[2] = {-1, -1};
MGPU_DEF void mgpu_set_tf32(int conv, int matmul) {
    mgpu__tf32[0] = conv != 0;
    mgpu__tf32[1] = matmul != 0;
}
enum { MGPU__TF32_CONV, MGPU__TF32_MATMUL };
static int mgpu__tf32_allowed(int which) {
    if (mgpu__tf32[which] < 0) {
        const char *env = getenv("MGPU_TF32");
        MGPU_REQUIRE(!env || !*env || strcmp(env, "0") == 0 || strcmp(env, "1") == 0,
                     "MGPU_TF32=%s: want 0 (float32 everywhere) or 1 (TF32 in every product)",
                     env);
        if (env && *env) mgpu_set_tf32(env[0] == '1', env[0] == '1');
        else mgpu_set_tf32(1, 0);
    }
    return mgpu__tf32[which];
}
MGPU_DEF void mgpu_get_tf32(int *conv, int *matmul) {
    *conv = mgpu__tf32_allowed(MGPU__TF32_CONV);
    *matmul = mgpu__tf32_allowed(MGPU__TF32_MATMUL);
}
MGPU_DEF const char *mgpu_tf32_str(void) {
    static const char *words[2][2] = {
        {"float32 everywhere", "TF32 in matrix products, float32 in convolutions"},
        {"TF32 in convolutions, float32 in matrix products (PyTorch's defaults)",
         "TF32 in every product"}};
    int conv, matmul;
    mgpu_get_tf32(&conv, &matmul);
    return words[conv][matmul];
}
/* MGPU_CONV: how convolutions compute y, dx and dW.
     rule      (the default) a fixed rule per shape and kind of device
               (mgpu__conv_plan_by_rule on a GPU, mgpu__cpu_conv_way_by_rule
               on a CPU): the same command computes the same bits every
               run;
     timed     whichever of im2col and the implicit GEMMs is faster for
               the convolution's shape, timed at the first call with that
               shape (as PyTorch's cudnn.benchmark does). Timing is noisy,
               so two runs may choose differently and round differently;
     im2col    conv.h's im2col and cuBLAS products;
     implicit  the implicit GEMMs of kernels/conv_nhwc.h (or winograd.h,
               from the same channels-last copies, and
               conv_few_inputs.h for a first layer), or cuDNN's
               algorithms where cuDNN is built in, for each pass the
               kernel and tile shape that was fastest for it (timed the
               same way); im2col where no such kernel fits;
     cudnn     cuDNN's algorithms alone (kernels/conv_cudnn.h), the
               fastest for each pass (timed); im2col where none fits or
               cuDNN is not built in.
   Float32 convolutions (no TF32) always take im2col on a GPU. On a CPU
   (mgpu/convolution.h's mgpu__conv_cpu): rule takes, where oneDNN runs
   AVX2 kernels (or is not built in), mgpu's Winograd for 3x3 layers
   with enough channels (mgpu__winograd_cpu_pays); where oneDNN runs
   AVX-512, its Winograd for 3x3 layers at stride 1 where it pays
   (mgpu__onednn_winograd_pays); im2col for a few backward passes
   (unless oneDNN's vectors are wider than OpenBLAS's); and oneDNN's
   direct kernels elsewhere (on channels-last activations where channels
   or filters are not a multiple of 16; im2col without oneDNN); timed
   times im2col, oneDNN's three methods and (3x3 at stride 1) mgpu's
   Winograd at the first call with a shape; im2col takes im2col;
   implicit takes oneDNN's direct kernels where it is built in; every
   mode but im2col takes conv_few_inputs.h's kernel for a first layer's
   weight gradient (C*R*S <= 9, no dx). */
typedef enum { MGPU__CONV_RULE, MGPU__CONV_TIMED, MGPU__CONV_IM2COL, MGPU__CONV_IMPLICIT, MGPU__CONV_CUDNN } mgpu__conv_mode_kind;
static const char *const mgpu__conv_mode_names[] = {"rule", "timed", "im2col", "implicit", "cudnn"};
static mgpu__conv_mode_kind mgpu__conv_mode;
static int mgpu__conv_wgmma_asked; /* MGPU_WGMMA, 1 unless set to 0 */
/* Read when the library starts (mgpu__init): MGPU_CONV chooses the GPU's
   algorithm, MGPU_WGMMA whether the wgmma kernels are among the
   candidates. */
static int mgpu__conv_env_read;
static void mgpu__conv_settings_from_environment(void) {
    if (mgpu__conv_env_read) return;
    mgpu__conv_env_read = 1;
    const char *algorithm = getenv("MGPU_CONV");
    mgpu__conv_mode = MGPU__CONV_RULE;
    if (algorithm && *algorithm) {
        int known = 0;
        for (int m = 0; m < (int)(sizeof mgpu__conv_mode_names / sizeof *mgpu__conv_mode_names); m++)
            if (strcmp(algorithm, mgpu__conv_mode_names[m]) == 0) mgpu__conv_mode = (mgpu__conv_mode_kind)m, known = 1;
        if (!known) mgpu_fatal("MGPU_CONV=%s: want rule (the default), timed, im2col, implicit or cudnn", algorithm);
    }
    const char *wgmma = getenv("MGPU_WGMMA");
    MGPU_REQUIRE(!wgmma || !*wgmma || strcmp(wgmma, "0") == 0 || strcmp(wgmma, "1") == 0,
                 "MGPU_WGMMA=%s: want 1 (the default: wgmma too, on sm_90) or 0 (mma.sync alone)", wgmma);
    mgpu__conv_wgmma_asked = !wgmma || strcmp(wgmma, "0") != 0;
}
/* MGPU_DIST_BACKEND: how a group of processes moves its GPUs' tensors
   (mgpu/groups.h): nccl (the default) where NCCL can start between them,
   else, or with mpi, MPI through host memory. -1 until first asked. */
static int mgpu__dist_backend = -1;
MGPU_DEF void mgpu_set_dist_backend(mgpu_dist_backend backend) {
    MGPU_REQUIRE(backend == MGPU_BACKEND_NCCL || backend == MGPU_BACKEND_MPI,
                 "mgpu_set_dist_backend: %d; want MGPU_BACKEND_NCCL or MGPU_BACKEND_MPI", (int)backend);
    mgpu__dist_backend = backend;
}
MGPU_DEF mgpu_dist_backend mgpu_get_dist_backend(void) {
    if (mgpu__dist_backend < 0) {
        const char *env = getenv("MGPU_DIST_BACKEND");
        MGPU_REQUIRE(!env || !*env || strcmp(env, "nccl") == 0 || strcmp(env, "mpi") == 0,
                     "MGPU_DIST_BACKEND=%s: want nccl (the default: NCCL between GPUs where it can start) or mpi "
                     "(through host memory)", env);
        mgpu__dist_backend = env && strcmp(env, "mpi") == 0 ? MGPU_BACKEND_MPI : MGPU_BACKEND_NCCL;
    }
    return (mgpu_dist_backend)mgpu__dist_backend;
}
/* MGPU_CHECK_REPLICAS: 1 if data parallelism compares its replicas after each step. */
static int mgpu__check_replicas_setting(void) {
    const char *check = getenv("MGPU_CHECK_REPLICAS");
    MGPU_REQUIRE(!check || !*check || strcmp(check, "0") == 0 || strcmp(check, "1") == 0,
                 "MGPU_CHECK_REPLICAS=%s: want 1 (compare the replicas after each step) or 0", check);
    return check && strcmp(check, "1") == 0;
}
