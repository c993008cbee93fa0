/* mgpu/testing.h: the testing interface, the internals that the tests
   (tests/) and the benchmarks (bench/) reach. They include mgpu.h with
   MGPU_IMPLEMENTATION, so the static mgpu__ functions and variables and
   the MGPU__ macros are within their reach: a test forces a choice the
   library would make by itself, reads its state, or runs one piece
   alone, and a benchmark times one. This is the list of those they use,
   and so of what a change of the library must keep or change with them.
   No chapter reads it. It comes last, after every part it names.
   A function is declared again with its definition's signature, and a
   variable with extern (allowed after its static definition in C, and in
   C++, as which the emulated GPUs' tests are built): the compiler checks
   the list against the code, and a changed signature or type stops the
   build here. A type or a macro has one definition; it is named in a
   comment instead. The groups follow the parts' include order, each
   headed by its part and why the tests or benchmarks need it, under the
   part's own #if conditions. The kernels' entry points are not here: the
   kernel files are their own interface (tests/emu_kernels.cpp includes
   them alone). tests/internals_listed.sh checks that this list names
   every internal a test or benchmark uses, and nothing else.
   defines: nothing (it declares what the parts before it define) */

/* ---- mgpu/core.h: the tests write tasks of their own, and name a layer by hand for its error lines */
/* type: mgpu__exec (where a task runs: its argument, as every kernel's) */
extern __thread const char *mgpu__layer_enqueuing;

/* ---- mgpu/settings.h: the tests set the settings anew, as a restart with other variables would */
/* types and constants: mgpu__conv_mode_kind (MGPU__CONV_RULE, MGPU__CONV_TIMED, MGPU__CONV_IM2COL, MGPU__CONV_IMPLICIT,
   MGPU__CONV_CUDNN), MGPU__TF32_CONV (which product mgpu__tf32_allowed asks about) */
extern int mgpu__tf32[2];
static int mgpu__tf32_allowed(int which);
extern mgpu__conv_mode_kind mgpu__conv_mode;
extern int mgpu__conv_wgmma_asked;
extern int mgpu__conv_env_read;
static void mgpu__conv_settings_from_environment(void);

/* ---- mgpu/plots.h: the tests check a chart's pieces (ticks, dashes, lines of a title, a timeline's colours) one by one */
/* types and macros: mgpu__plot_box, mgpu__plot_axis, mgpu__plot_lines, mgpu__timeline_key; MGPU__INK (the
   frames' colour), MGPU__PLOT_LINES (the most lines of a title or label) */
static void mgpu__plot_stroke(mgpu_canvas *c, mgpu__plot_box clip, double x0, double y0, double x1,
                              double y1, uint32_t rgb, int thickness, double dash, double *travel);
static mgpu__plot_axis mgpu__plot_axis_new(double lo, double hi, int fixed, int ticks);
static int mgpu__plot_tick(const mgpu__plot_axis *a, int i, double *value, char label[32]);
static mgpu__plot_lines mgpu__plot_wrap(const char *text, int width, int s);
static int mgpu__timeline_key_of(mgpu__timeline_key *keys, int *nkeys, const char *name);

/* ---- mgpu/queues.h: the tests run their own tasks on a queue and read the tracer's records */
/* type: mgpu__trace_record (one operation the tracer saw) */
extern int mgpu__cpu_threads;
extern struct mgpu__library_state mgpu__library;
static void mgpu__queue_synchronize(mgpu__queue *q);
static void mgpu__launch_on(mgpu__queue *q, const char *name, mgpu__kernel_fn cpu,
                            mgpu__kernel_fn cuda, const void *args, size_t args_size);
static void mgpu__label_error_fail(const mgpu__label_error *e, const mgpu_device *d);
static void mgpu__require_no_label_error(const mgpu_device *d);

/* ---- mgpu/tensors.h: a test frees many tensors and sees the freed headers' queue stay bounded */
/* macro: MGPU__FREED_HEADERS (the queue's length) */
extern struct mgpu__header_queue mgpu__headers;

/* ---- mgpu/devices.h: the tests check the BLAS kernels chosen for a processor, and the cores counted */
static inline const char *mgpu__blas_better_core(const char *core, int avx2_fma, int avx512);
static inline int mgpu__blas_core_avx512(const char *core);
#if defined(__x86_64__) && defined(__GNUC__) && defined(__GLIBC__)
static void mgpu__processor_vectors(int *avx2_fma, int *avx512);
#endif
static int mgpu__cores(void);

/* ---- mgpu/timing.h: the tests read a trace record's times, a GPU's from its CUDA events */
static void mgpu__trace_times(const mgpu__trace_record *r, double *start_ms, double *end_ms);

/* ---- mgpu/convolution.h: the tests force and inspect the choice of method; the benchmarks time each */
/* constants: MGPU__BY_NCHW, MGPU__BY_CHANNELS_LAST, MGPU__BY_IM2COL_HALF (a backward pass's ways) */
extern size_t mgpu__conv_scratch_floats[2];
static mgpu__conv_geom mgpu__conv_geometry(const char *op, mgpu_shape x, mgpu_shape w, int stride,
                                           int pad);
static int mgpu__conv_chunk(const mgpu__conv_geom *g, const mgpu_device *dev);
static void mgpu__conv_forward_im2col(mgpu_tensor *y, const mgpu_tensor *x, const mgpu_tensor *w,
                                      const mgpu_tensor *b, const mgpu__conv_geom *g, int tf32);
static void mgpu__conv_backward_im2col(mgpu_tensor *dx, mgpu_tensor *dw, const mgpu_tensor *dy,
                                       const mgpu_tensor *x, const mgpu_tensor *w,
                                       const mgpu__conv_geom *g, int tf32, int accumulate,
                                       int add_to_dx);
extern int mgpu__onednn_avx512, mgpu__blas_avx512; /* (a test takes another CPU's rule) */
static void mgpu__cpu_vector_widths(void);
static inline double mgpu__conv_backward_ways(const double *dx_ms, const double *dw_ms, double dy_ms,
                                              int dy_prepared, int with_dx, int *by_dx, int *by_dw);
#if MGPU_CUDA
/* types, constants and macros: mgpu__conv_method (MGPU__DIRECT, MGPU__WINOGRAD, MGPU__FEW_INPUTS,
   MGPU__STRIDE2_DX, MGPU__CUDNN), mgpu__implicit_kernel, mgpu__conv_plan, mgpu__conv_choice,
   mgpu__conv_try (MGPU__TRY_Y, MGPU__TRY_DX, MGPU__TRY_DW); MGPU__KERNEL_CHOICES (the length of the
   slices' and blocks' lists), MGPU__CANDIDATES and MGPU__CUDNN_CANDIDATES (room for a pass's candidates) */
static int mgpu__conv_implicit_available(void);
static mgpu__conv_plan mgpu__conv_plan_by_rule(mgpu_device *dev, const mgpu__conv_geom *g, int backward,
                                               int with_dx);
static inline mgpu__implicit_kernel mgpu__kernel_of(mgpu__conv_method method, mgpu__implicit_tile tile, int splits,
                                                    int wgmma);
#if MGPU_CUDNN
static cudnnHandle_t mgpu__cudnn_ready(mgpu_device *dev);
extern __thread cudnnStatus_t *mgpu__cudnn_trial_refusal;
#endif
static void mgpu__conv_forward_implicit(mgpu_tensor *y, const mgpu_tensor *x, const mgpu_tensor *x_t,
                                        const mgpu_tensor *w, mgpu_tensor **keep_w_t, const mgpu_tensor *b,
                                        const mgpu__conv_geom *g, mgpu__implicit_kernel kernel,
                                        mgpu_tensor **keep_x_t);
static void mgpu__conv_dx_implicit(mgpu_tensor *dx, const mgpu_tensor *dy, const mgpu_tensor *dy_t,
                                   const mgpu_tensor *w, mgpu_tensor **keep_w_t, const mgpu__conv_geom *g,
                                   mgpu__implicit_kernel kernel, int add_to_dx);
static void mgpu__conv_dw_implicit(mgpu_tensor *dw, const mgpu_tensor *dy, const mgpu_tensor *dy_t,
                                   const mgpu_tensor *x, const mgpu_tensor *x_t, const mgpu__conv_geom *g,
                                   int accumulate, mgpu__implicit_kernel kernel);
extern mgpu__conv_choice mgpu__conv_choices[256];
extern int mgpu__conv_choice_count;
static int mgpu__wgmma_runs(mgpu_device *dev);
static int mgpu__wgmma_usable(mgpu_device *dev);
extern const int mgpu__conv_slice_choices[];
extern const int mgpu__conv_dw_block_choices[];
static int mgpu__conv_kernel_choice(mgpu__conv_try what, const mgpu__conv_geom *g, mgpu__implicit_tile tile,
                                    int wgmma, int i, mgpu__implicit_kernel *k);
static int mgpu__conv_winograd_fits(mgpu__conv_try what, const mgpu__conv_geom *g);
static int mgpu__conv_method_fits(mgpu__conv_method method, mgpu__conv_try what, const mgpu__conv_geom *g);
static int mgpu__conv_candidates(mgpu__conv_try what, const mgpu__conv_geom *g, int wgmma,
                                 mgpu__implicit_kernel *list);
/* (defined with cuDNN and without: without, it finds none) */
static int mgpu__conv_cudnn_candidates(mgpu_device *dev, mgpu__conv_try what, const mgpu__conv_geom *g,
                                       mgpu__implicit_kernel *list);
static int mgpu__conv_dx_reads_turned_weights(const mgpu__conv_geom *g);
static int mgpu__conv_reads_weights_copy(mgpu__conv_try what, const mgpu__conv_geom *g, mgpu__implicit_kernel k);
static inline void mgpu__conv_kernel_str(char *out, size_t size, mgpu__implicit_kernel k, mgpu__conv_try what);
static inline const char *mgpu__conv_choice_str(const mgpu__conv_choice *c, char *out, size_t size);
#endif
/* types and constants: mgpu__cpu_conv_choice, mgpu__cpu_conv_call, mgpu__cpu_conv_way; MGPU__CPU_BY_IM2COL,
   MGPU__CPU_BY_MGPU_WINOGRAD, MGPU__CPU_BY_ONEDNN_DIRECT, MGPU__CPU_BY_ONEDNN_CHANNELS_LAST,
   MGPU__CPU_BY_ONEDNN_WINOGRAD, MGPU__CPU_WAYS (a CPU's ways) */
extern mgpu__cpu_conv_choice mgpu__cpu_conv_choices[1024];
extern int mgpu__cpu_conv_choice_count;
static mgpu__cpu_conv_choice *mgpu__cpu_conv_choice_find(const mgpu_device *dev, const mgpu__conv_geom *g,
                                                         mgpu__conv_pass pass);
static inline const char *mgpu__cpu_conv_choice_str(const mgpu__cpu_conv_choice *c, char *out, size_t size);
static int mgpu__cpu_conv_computes(mgpu__cpu_conv_way way, const mgpu__cpu_conv_call *c);
static int mgpu__cpu_conv_by(mgpu__cpu_conv_way way, const mgpu__cpu_conv_call *c);
static void mgpu__conv2d_backward(mgpu_tensor *dx, mgpu_tensor *dw, mgpu_tensor *db,
                                  const mgpu_tensor *dy, const mgpu_tensor *dy_t, const mgpu_tensor *x,
                                  const mgpu_tensor *x_t, const mgpu_tensor *w, mgpu_tensor **keep_w_t,
                                  int stride, int pad, int accumulate, int add_to_dx, int prepared);

/* ---- mgpu/training_ops.h: the tests call batch norm and the loss as a network does, with its options */
static void mgpu__batchnorm2d_forward(const char *op, mgpu_tensor *y, mgpu_tensor *y_t, const mgpu_tensor *x,
                                      const mgpu_tensor *skip, const mgpu_tensor *gamma,
                                      const mgpu_tensor *beta, mgpu_tensor *running_mean,
                                      mgpu_tensor *running_var, mgpu_tensor *save_mean,
                                      mgpu_tensor *save_invstd, int training, float momentum,
                                      float eps, int fuse_relu, mgpu_group *sync);
static void mgpu__cross_entropy_forward(const char *op, int first_row, mgpu_tensor *losses,
                                        const mgpu_tensor *logits, const mgpu_tensor *labels);

/* ---- mgpu/networks.h: the tests build and run single layers, with the networks' shortcuts on and off */
/* macro: MGPU__GUARD_FLOATS (the guard's length after an output) */
static mgpu_layer *mgpu__conv_new(const char *name, int in, int out, int kernel, int stride, int pad,
                                  mgpu_device *d);
static mgpu_layer *mgpu__residual_new(const char *name, int in, int out, int stride, mgpu_device *d);
static mgpu_layer *mgpu__net_add(mgpu_net *net, mgpu_layer *l);
extern int mgpu__batch_norm_writes_channels_last;
extern int mgpu__network_keeps_weight_copies;
static int mgpu__guard_holds(const float *guard);
static mgpu_tensor *mgpu__guard_view(const mgpu_tensor *t);
static int mgpu__ensure_guarded(mgpu_tensor **slot, mgpu_device *dev, mgpu_shape shape);
static mgpu_tensor *mgpu__layer_forward(mgpu_layer *l, const mgpu_tensor *x, const mgpu_tensor *x_t,
                                        const mgpu_layer *next, int training);
static const mgpu_tensor *mgpu__layer_backward(mgpu_layer *l, const mgpu_tensor *dy, const mgpu_tensor *dy_t,
                                               const mgpu_layer *next, const mgpu_layer *prev, int accumulate);

/* ---- mgpu/net_training.h: a test copies one layer to a GPU, as a replica is made, to compare passes */
static mgpu_layer *mgpu__layer_clone(const mgpu_layer *src, mgpu_device *d, int share);
static void mgpu__layer_free(mgpu_layer *l, int shared);

/* ---- mgpu/checkpoints.h: a test flips bits in a checkpoint's state, at its fields' offsets */
/* type: mgpu__train_state (the state after a checkpoint's header) */
