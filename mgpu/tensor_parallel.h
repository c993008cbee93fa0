/* mgpu/tensor_parallel.h: layers split across devices (chapter 6): a
   convolution split by output channels, and Megatron's MLP block (a
   column-parallel linear, then a row-parallel one, with one allreduce);
   and the bytes each way of splitting moves.
   defines: mgpu_tp_conv_new, mgpu_tp_conv_forward, mgpu_tp_conv_backward,
   mgpu_tp_conv_output, mgpu_tp_conv_input_grad, mgpu_tp_conv_parameters,
   mgpu_tp_conv_gather_grads, mgpu_tp_conv_bytes, mgpu_tp_conv_free,
   mgpu_tp_mlp_new, mgpu_tp_mlp_forward, mgpu_tp_mlp_backward,
   mgpu_tp_mlp_output, mgpu_tp_mlp_input_grad, mgpu_tp_mlp_parameters,
   mgpu_tp_mlp_gather_grads, mgpu_tp_mlp_bytes, mgpu_tp_mlp_free,
   mgpu_allreduce_bytes, mgpu_all_gather_bytes, mgpu_data_parallel_bytes */
MGPU_DEF size_t mgpu_all_gather_bytes(size_t bytes, int k) { return bytes * (size_t)(k - 1) / (size_t)k; }
MGPU_DEF size_t mgpu_allreduce_bytes(size_t bytes, int k) { return 2 * bytes * (size_t)(k - 1) / (size_t)k; }
MGPU_DEF size_t mgpu_data_parallel_bytes(size_t parameters, int k) {
    return mgpu_allreduce_bytes(parameters * sizeof(float), k);
}

/* k devices, distinct (each holds one slice). */
static void mgpu__tp_require_devices(const char *op, mgpu_device *const *devices, int k) {
    MGPU_REQUIRE(k >= 1 && k <= MGPU_MAX_DEVICES, "%s: k = %d; the number of devices must be between 1 and %d",
                 op, k, MGPU_MAX_DEVICES);
    for (int i = 0; i < k; i++) {
        MGPU_REQUIRE(devices[i] != NULL, "%s: devices[%d] is NULL", op, i);
        for (int j = 0; j < i; j++)
            MGPU_REQUIRE(devices[j] != devices[i], "%s: %s is given twice (devices[%d] and [%d]); each device "
                         "holds one slice (mgpu_devices makes virtual devices)", op, devices[i]->name, j, i);
    }
}

static void mgpu__tp_require_shape(const char *op, const char *name, const mgpu_tensor *t, mgpu_shape want) {
    char got[64], expected[64];
    MGPU_REQUIRE(t != NULL, "%s: %s is NULL", op, name);
    mgpu__require_alive(t, op);
    MGPU_REQUIRE(mgpu_shape_equal(t->shape, want), "%s: %s has shape %s; it must be %s", op, name,
                 mgpu_shape_str(t->shape, got, sizeof got), mgpu_shape_str(want, expected, sizeof expected));
}

/* An input of a pass comes on devices[0] (the manual's convention). */
static void mgpu__tp_require_on_first(const char *op, const char *name, const mgpu_tensor *t,
                                      mgpu_device *const *devices) {
    MGPU_REQUIRE(t != NULL, "%s: %s is NULL", op, name);
    mgpu__require_alive(t, op);
    MGPU_REQUIRE(t->device == devices[0], "%s: %s is on %s; it must be on devices[0] (%s)", op, name,
                 t->device->name, devices[0]->name);
}
/* A backward pass's output gradient: after a forward pass (output, its
   output on devices[0], not NULL), on devices[0], of output's shape. */
static void mgpu__tp_require_output_grad(const char *op, const char *name, const mgpu_tensor *t,
                                         const mgpu_tensor *output, mgpu_device *const *devices) {
    MGPU_REQUIRE(output != NULL, "%s: no forward pass before it; the backward pass needs its input", op);
    mgpu__tp_require_on_first(op, name, t, devices);
    mgpu__tp_require_shape(op, name, t, output->shape);
}

/* `shape` with dimension `dim` cut into k equal parts: one device's slice. */
static mgpu_shape mgpu__tp_slice_shape(mgpu_shape shape, int dim, int k) {
    shape.d[dim] /= k;
    return shape;
}

/* Copies slice j of a whole tensor, cut into k equal parts along
   dimension dim, between the whole and a tensor holding that slice alone
   (the part): from src, the whole, into dst, the part (into_whole 0), or
   from src, the part, into dst, the whole (into_whole 1). In row-major memory
   the slice is not one run of values unless dim is 0: call "rows" the
   indices of the dimensions before dim; each row of `whole` holds its k
   slices one after the other, so slice j of a row is one run, and the
   rows lie one whole row apart. One copy a row: [N, C, H, W] cut along
   channels takes one copy an image; [in, hidden] cut along columns, one
   an input row; a cut along dimension 0 is a single copy. Between two
   devices, or on one (a copy into a contiguous tensor). Non-blocking:
   the copies order themselves with the devices' queues. */
static void mgpu__tp_copy_slice(mgpu_tensor *dst, const mgpu_tensor *src, int dim, int j, int k,
                                int into_whole) {
    const mgpu_tensor *whole = into_whole ? dst : src, *part = into_whole ? src : dst;
    int rows = 1;
    for (int d = 0; d < dim; d++) rows *= whole->shape.d[d];
    int run = (int)(part->numel / (size_t)rows); /* values of one slice of one row */
    mgpu_tensor *whole_runs = mgpu_view(whole, mgpu_shape2(rows * k, run)); /* row r, slice j: r k + j */
    mgpu_tensor *part_runs = mgpu_view(part, mgpu_shape2(rows, run));
    for (int r = 0; r < rows; r++) {
        mgpu_tensor *in_whole = mgpu_narrow(whole_runs, r * k + j, 1), *in_part = mgpu_narrow(part_runs, r, 1);
        mgpu_copy(into_whole ? in_whole : in_part, into_whole ? in_part : in_whole, 1);
        mgpu_free(in_whole);
        mgpu_free(in_part);
    }
    mgpu_free(whole_runs);
    mgpu_free(part_runs);
}

/* Device j's slice of a parameter, a new tensor on devices[j] counted
   with the parameters; its gradient (*grad) of the same shape, zero,
   with the gradients. */
static mgpu_tensor *mgpu__tp_parameter_slice(const mgpu_tensor *whole, int dim, int j, int k, mgpu_device *dev,
                                             mgpu_tensor **grad) {
    mgpu_tensor *part = mgpu_empty(dev, mgpu__tp_slice_shape(whole->shape, dim, k));
    mgpu__memory_recount(part, MGPU_MEMORY_PARAMETERS);
    mgpu__tp_copy_slice(part, whole, dim, j, k, 0);
    *grad = mgpu_zeros(dev, part->shape);
    mgpu__memory_recount(*grad, MGPU_MEMORY_GRADIENTS);
    return part;
}

/* The input of a pass on every device: devices[0]'s is the caller's
   tensor itself, the others copies of it into the block's buffers. */
static void mgpu__tp_replicate(const mgpu_tensor *t, mgpu_tensor **copies, mgpu_device *const *devices, int k,
                               const mgpu_tensor **on_device) {
    on_device[0] = t;
    for (int i = 1; i < k; i++) {
        mgpu_copy(mgpu_ensure(&copies[i], devices[i], t->shape), t, 1);
        on_device[i] = copies[i];
    }
}

/* ------------------------------------------- the convolution, split by channels */
struct mgpu_tp_conv {
    int k, stride, pad;
    mgpu_device *devices[MGPU_MAX_DEVICES];
    mgpu_tensor *weight[MGPU_MAX_DEVICES], *bias[MGPU_MAX_DEVICES];   /* device j's filters */
    mgpu_tensor *dweight[MGPU_MAX_DEVICES], *dbias[MGPU_MAX_DEVICES];
    const mgpu_tensor *x[MGPU_MAX_DEVICES];      /* the last forward's input, on each device */
    mgpu_tensor *x_copy[MGPU_MAX_DEVICES];       /* its copies on devices 1.. */
    mgpu_tensor *y_part[MGPU_MAX_DEVICES], *y[MGPU_MAX_DEVICES];     /* device j's channels; all of them */
    mgpu_tensor *dy_part[MGPU_MAX_DEVICES], *dx[MGPU_MAX_DEVICES];   /* dx: device j's part, then the sum */
    mgpu_tp_bytes bytes;
};

MGPU_DEF mgpu_tp_conv *mgpu_tp_conv_new(const mgpu_tensor *weight, const mgpu_tensor *bias, int stride,
                                        int pad, mgpu_device *const *devices, int k) {
    const char *op = "mgpu_tp_conv_new";
    char sw[64];
    mgpu__tp_require_devices(op, devices, k);
    MGPU_REQUIRE(weight != NULL, "%s: weight is NULL", op);
    mgpu__require_alive(weight, op);
    MGPU_REQUIRE(weight->shape.ndim == 4, "%s: weight has shape %s; it must be [K, C, R, S]", op,
                 mgpu_shape_str(weight->shape, sw, sizeof sw));
    int out_channels = weight->shape.d[0];
    mgpu__tp_require_shape(op, "bias", bias, mgpu_shape1(out_channels));
    MGPU_REQUIRE(out_channels % k == 0, "%s: %d output channels do not split into k = %d equal slices "
                 "(k must divide the output channels)", op, out_channels, k);
    MGPU_REQUIRE(stride >= 1 && pad >= 0, "%s: stride %d must be >= 1 and padding %d >= 0", op, stride, pad);
    mgpu_tp_conv *c = (mgpu_tp_conv *)mgpu__xcalloc(1, sizeof *c);
    c->k = k;
    c->stride = stride;
    c->pad = pad;
    for (int j = 0; j < k; j++) {
        c->devices[j] = devices[j];
        c->weight[j] = mgpu__tp_parameter_slice(weight, 0, j, k, devices[j], &c->dweight[j]);
        c->bias[j] = mgpu__tp_parameter_slice(bias, 0, j, k, devices[j], &c->dbias[j]);
    }
    return c;
}

MGPU_DEF mgpu_tensor *mgpu_tp_conv_forward(mgpu_tp_conv *c, const mgpu_tensor *x) {
    const char *op = "mgpu_tp_conv_forward";
    int k = c->k;
    mgpu__tp_require_on_first(op, "x", x, c->devices);
    mgpu__conv_geom g = mgpu__conv_geometry(op, x->shape, c->weight[0]->shape, c->stride, c->pad);
    mgpu_shape slice_shape = mgpu_shape4(g.n, g.k, g.p, g.q), out_shape = mgpu_shape4(g.n, k * g.k, g.p, g.q);
    mgpu__tp_replicate(x, c->x_copy, c->devices, k, c->x);
    /* Each device: its channels of y, for the whole batch. */
    for (int j = 0; j < k; j++)
        mgpu_conv2d_forward(mgpu_ensure(&c->y_part[j], c->devices[j], slice_shape), c->x[j], c->weight[j],
                            c->bias[j], c->stride, c->pad);
    /* The all-gather: every device's channels into every device's y, in
       channel order (its own by a copy on the device itself). */
    for (int i = 0; i < k; i++) {
        mgpu_ensure(&c->y[i], c->devices[i], out_shape);
        for (int j = 0; j < k; j++) mgpu__tp_copy_slice(c->y[i], c->y_part[j], 1, j, k, 1);
    }
    c->bytes.forward = mgpu_all_gather_bytes(c->y[0]->numel * sizeof(float), k);
    return c->y[0];
}

MGPU_DEF mgpu_tensor *mgpu_tp_conv_backward(mgpu_tp_conv *c, const mgpu_tensor *dy) {
    const char *op = "mgpu_tp_conv_backward";
    int k = c->k;
    mgpu__tp_require_output_grad(op, "dy", dy, c->y[0], c->devices);
    for (int j = 0; j < k; j++) {
        mgpu_tensor *dy_part = mgpu_ensure(&c->dy_part[j], c->devices[j], c->y_part[j]->shape);
        mgpu__tp_copy_slice(dy_part, dy, 1, j, k, 0);
        mgpu_conv2d_backward(mgpu_ensure(&c->dx[j], c->devices[j], c->x[j]->shape), c->dweight[j], c->dbias[j],
                             dy_part, c->x[j], c->weight[j], c->stride, c->pad, 0);
    }
    /* Each dx[j] is what device j's filters send back; dx is their sum. */
    mgpu_allreduce_auto(c->dx, k, 0);
    c->bytes.backward = mgpu_allreduce_bytes(c->dx[0]->numel * sizeof(float), k);
    return c->dx[0];
}

static void mgpu__tp_require_index(const char *op, int i, int k) {
    MGPU_REQUIRE(i >= 0 && i < k, "%s: device %d of a block over %d devices", op, i, k);
}
MGPU_DEF mgpu_tensor *mgpu_tp_conv_output(const mgpu_tp_conv *c, int i) {
    mgpu__tp_require_index("mgpu_tp_conv_output", i, c->k);
    return c->y[i];
}
MGPU_DEF mgpu_tensor *mgpu_tp_conv_input_grad(const mgpu_tp_conv *c, int i) {
    mgpu__tp_require_index("mgpu_tp_conv_input_grad", i, c->k);
    return c->dx[i];
}

MGPU_DEF void mgpu_tp_conv_gather_grads(const mgpu_tp_conv *c, mgpu_tensor *dweight, mgpu_tensor *dbias) {
    const char *op = "mgpu_tp_conv_gather_grads";
    mgpu_shape weight_shape = c->weight[0]->shape;
    weight_shape.d[0] *= c->k;
    mgpu__tp_require_shape(op, "dweight", dweight, weight_shape);
    mgpu__tp_require_shape(op, "dbias", dbias, mgpu_shape1(weight_shape.d[0]));
    for (int j = 0; j < c->k; j++) {
        mgpu__tp_copy_slice(dweight, c->dweight[j], 0, j, c->k, 1);
        mgpu__tp_copy_slice(dbias, c->dbias[j], 0, j, c->k, 1);
    }
}

MGPU_DEF mgpu_tp_bytes mgpu_tp_conv_bytes(const mgpu_tp_conv *c) { return c->bytes; }
MGPU_DEF size_t mgpu_tp_conv_parameters(const mgpu_tp_conv *c) {
    return (size_t)c->k * (c->weight[0]->numel + c->bias[0]->numel);
}

MGPU_DEF void mgpu_tp_conv_free(mgpu_tp_conv *c) {
    if (!c) return;
    for (int j = 0; j < c->k; j++) {
        mgpu_tensor *owned[] = {c->weight[j], c->bias[j], c->dweight[j], c->dbias[j], c->x_copy[j],
                                c->y_part[j], c->y[j], c->dy_part[j], c->dx[j]};
        for (size_t t = 0; t < sizeof owned / sizeof owned[0]; t++) mgpu_free(owned[t]);
    }
    free(c);
}

/* -------------------------------------------------------- Megatron's MLP block */
struct mgpu_tp_mlp {
    int k;
    mgpu_device *devices[MGPU_MAX_DEVICES];
    /* device j's columns of A (and of a), and the matching rows of B; b on device 0 */
    mgpu_tensor *A[MGPU_MAX_DEVICES], *a[MGPU_MAX_DEVICES], *B[MGPU_MAX_DEVICES], *b;
    mgpu_tensor *dA[MGPU_MAX_DEVICES], *da[MGPU_MAX_DEVICES], *dB[MGPU_MAX_DEVICES], *db;
    const mgpu_tensor *X[MGPU_MAX_DEVICES], *dY[MGPU_MAX_DEVICES];   /* the passes' inputs, on each device */
    mgpu_tensor *X_copy[MGPU_MAX_DEVICES], *dY_copy[MGPU_MAX_DEVICES];
    mgpu_tensor *H[MGPU_MAX_DEVICES];    /* device j's hidden units, after the ReLU */
    mgpu_tensor *Y[MGPU_MAX_DEVICES];    /* H_j B_j, then (after g) the sum: Y */
    mgpu_tensor *dH[MGPU_MAX_DEVICES];
    mgpu_tensor *dX[MGPU_MAX_DEVICES];   /* device j's part, then (after f) the sum: dX */
    mgpu_tp_bytes bytes;
};

MGPU_DEF mgpu_tp_mlp *mgpu_tp_mlp_new(const mgpu_tensor *A, const mgpu_tensor *a, const mgpu_tensor *B,
                                      const mgpu_tensor *b, mgpu_device *const *devices, int k) {
    const char *op = "mgpu_tp_mlp_new";
    char sa[64], sb[64];
    mgpu__tp_require_devices(op, devices, k);
    MGPU_REQUIRE(A != NULL && B != NULL, "%s: A or B is NULL", op);
    mgpu__require_alive(A, op);
    mgpu__require_alive(B, op);
    MGPU_REQUIRE(A->shape.ndim == 2 && B->shape.ndim == 2 && A->shape.d[1] == B->shape.d[0],
                 "%s: A %s and B %s must be [in, hidden] and [hidden, out]", op,
                 mgpu_shape_str(A->shape, sa, sizeof sa), mgpu_shape_str(B->shape, sb, sizeof sb));
    int hidden = A->shape.d[1];
    mgpu__tp_require_shape(op, "a", a, mgpu_shape1(hidden));
    mgpu__tp_require_shape(op, "b", b, mgpu_shape1(B->shape.d[1]));
    MGPU_REQUIRE(hidden % k == 0, "%s: %d hidden units do not split into k = %d equal slices "
                 "(k must divide the hidden units)", op, hidden, k);
    mgpu_tp_mlp *m = (mgpu_tp_mlp *)mgpu__xcalloc(1, sizeof *m);
    m->k = k;
    for (int j = 0; j < k; j++) {
        m->devices[j] = devices[j];
        m->A[j] = mgpu__tp_parameter_slice(A, 1, j, k, devices[j], &m->dA[j]); /* columns */
        m->a[j] = mgpu__tp_parameter_slice(a, 0, j, k, devices[j], &m->da[j]);
        m->B[j] = mgpu__tp_parameter_slice(B, 0, j, k, devices[j], &m->dB[j]); /* rows */
    }
    m->b = mgpu__tp_parameter_slice(b, 0, 0, 1, devices[0], &m->db);        /* all of it, on device 0 */
    return m;
}

MGPU_DEF mgpu_tensor *mgpu_tp_mlp_forward(mgpu_tp_mlp *m, const mgpu_tensor *X) {
    const char *op = "mgpu_tp_mlp_forward";
    int k = m->k, in = m->A[0]->shape.d[0], out = m->B[0]->shape.d[1];
    char sx[64];
    mgpu__tp_require_on_first(op, "X", X, m->devices);
    MGPU_REQUIRE(X->shape.ndim == 2 && X->shape.d[1] == in && X->shape.d[0] >= 1,
                 "%s: X has shape %s; it must be [N, %d]", op, mgpu_shape_str(X->shape, sx, sizeof sx), in);
    int rows = X->shape.d[0];
    mgpu__tp_replicate(X, m->X_copy, m->devices, k, m->X); /* f: nothing to do, every device has X */
    for (int j = 0; j < k; j++) {
        mgpu_tensor *H = mgpu_ensure(&m->H[j], m->devices[j], mgpu_shape2(rows, m->A[j]->shape.d[1]));
        mgpu_linear_forward(H, m->X[j], m->A[j], m->a[j]);   /* column-parallel */
        mgpu_relu_forward(H, H);
        mgpu_linear_forward(mgpu_ensure(&m->Y[j], m->devices[j], mgpu_shape2(rows, out)), H, m->B[j],
                            j == 0 ? m->b : NULL);             /* row-parallel: a share of Y; b once */
    }
    mgpu_allreduce_auto(m->Y, k, 0);                            /* g: the shares summed, Y everywhere */
    m->bytes.forward = mgpu_allreduce_bytes(m->Y[0]->numel * sizeof(float), k);
    return m->Y[0];
}

MGPU_DEF mgpu_tensor *mgpu_tp_mlp_backward(mgpu_tp_mlp *m, const mgpu_tensor *dY) {
    const char *op = "mgpu_tp_mlp_backward";
    int k = m->k;
    mgpu__tp_require_output_grad(op, "dY", dY, m->Y[0], m->devices);
    mgpu__tp_replicate(dY, m->dY_copy, m->devices, k, m->dY); /* g: nothing to do, every device needs dY */
    for (int j = 0; j < k; j++) {
        mgpu_tensor *dH = mgpu_ensure(&m->dH[j], m->devices[j], m->H[j]->shape);
        mgpu_linear_backward(dH, m->dB[j], j == 0 ? m->db : NULL, m->dY[j], m->H[j], m->B[j], 0);
        mgpu_relu_backward(dH, dH, m->H[j]);
        mgpu_linear_backward(mgpu_ensure(&m->dX[j], m->devices[j], m->X[j]->shape), m->dA[j], m->da[j], dH,
                             m->X[j], m->A[j], 0);
    }
    mgpu_allreduce_auto(m->dX, k, 0);                           /* f: the parts summed, dX everywhere */
    m->bytes.backward = mgpu_allreduce_bytes(m->dX[0]->numel * sizeof(float), k);
    return m->dX[0];
}

MGPU_DEF mgpu_tensor *mgpu_tp_mlp_output(const mgpu_tp_mlp *m, int i) {
    mgpu__tp_require_index("mgpu_tp_mlp_output", i, m->k);
    return m->Y[i];
}
MGPU_DEF mgpu_tensor *mgpu_tp_mlp_input_grad(const mgpu_tp_mlp *m, int i) {
    mgpu__tp_require_index("mgpu_tp_mlp_input_grad", i, m->k);
    return m->dX[i];
}

MGPU_DEF void mgpu_tp_mlp_gather_grads(const mgpu_tp_mlp *m, mgpu_tensor *dA, mgpu_tensor *da, mgpu_tensor *dB,
                                       mgpu_tensor *db) {
    const char *op = "mgpu_tp_mlp_gather_grads";
    int k = m->k, in = m->A[0]->shape.d[0], hidden = k * m->A[0]->shape.d[1], out = m->B[0]->shape.d[1];
    mgpu__tp_require_shape(op, "dA", dA, mgpu_shape2(in, hidden));
    mgpu__tp_require_shape(op, "da", da, mgpu_shape1(hidden));
    mgpu__tp_require_shape(op, "dB", dB, mgpu_shape2(hidden, out));
    mgpu__tp_require_shape(op, "db", db, mgpu_shape1(out));
    for (int j = 0; j < k; j++) {
        mgpu__tp_copy_slice(dA, m->dA[j], 1, j, k, 1);
        mgpu__tp_copy_slice(da, m->da[j], 0, j, k, 1);
        mgpu__tp_copy_slice(dB, m->dB[j], 0, j, k, 1);
    }
    mgpu_copy(db, m->db, 1);
}

MGPU_DEF mgpu_tp_bytes mgpu_tp_mlp_bytes(const mgpu_tp_mlp *m) { return m->bytes; }
MGPU_DEF size_t mgpu_tp_mlp_parameters(const mgpu_tp_mlp *m) {
    return (size_t)m->k * (m->A[0]->numel + m->a[0]->numel + m->B[0]->numel) + m->b->numel;
}

MGPU_DEF void mgpu_tp_mlp_free(mgpu_tp_mlp *m) {
    if (!m) return;
    for (int j = 0; j < m->k; j++) {
        mgpu_tensor *owned[] = {m->A[j], m->a[j], m->B[j], m->dA[j], m->da[j], m->dB[j], m->X_copy[j],
                                m->dY_copy[j], m->H[j], m->Y[j], m->dH[j], m->dX[j]};
        for (size_t t = 0; t < sizeof owned / sizeof owned[0]; t++) mgpu_free(owned[t]);
    }
    mgpu_free(m->b);
    mgpu_free(m->db);
    free(m);
}
