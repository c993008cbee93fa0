/* A leaky ReLU whose backward forgets the slope on the negative side
   (its checker must fail). */
static void leaky_forward(mgpu_layer *l, mgpu_tensor *y, const mgpu_tensor *x, int training) {
    float slope = *(const float *)l->settings;
    (void)training;
    for (size_t i = 0; i < x->numel; i++) y->data[i] = x->data[i] > 0 ? x->data[i] : slope * x->data[i];
}
static void leaky_backward(mgpu_layer *l, mgpu_tensor *dx, mgpu_tensor *dweight, mgpu_tensor *dbias,
                           const mgpu_tensor *dy, const mgpu_tensor *x, const mgpu_tensor *y) {
    (void)l, (void)dweight, (void)dbias, (void)y;
    for (size_t i = 0; i < dy->numel; i++) dx->data[i] = x->data[i] > 0 ? dy->data[i] : 0.0f;
}
const mgpu_layer_fns leaky_relu = {"leaky_relu", NULL, leaky_forward, leaky_backward, 1};
