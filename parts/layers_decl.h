/* ---------------------------------------------------------------- layers
   The layers of a LeNet and of a ResNet, forward and backward, on any
   device (the CPU and CUDA versions compute the same thing; see
   kernels/conv.h, pool.h, activation.h and linear.h for the maths).

   Images are NCHW: x [N, C, H, W]. Every function writes into tensors that
   you allocate (mgpu_empty) with the right shapes; the shapes and devices
   are checked, and a mismatch is a one-line error naming the function and
   the shapes. All tensors of a call must be on the same device, and hold
   fewer than 2^31 elements (the GPU kernels index in 32 bits). Like every
   operation, these only enqueue work on the device and return at once.

   Backward functions take dy = dL/dy, the gradient of the loss with
   respect to the layer's output, and produce the gradients of its inputs.
   An input gradient (dx) is always overwritten. Parameter gradients (dw,
   db) are overwritten when accumulate is 0 and added to when it is 1, like
   PyTorch's .grad (which adds up until it is zeroed): use 1 when the same
   parameters are used more than once, or to sum over several batches.

   Convolution (PyTorch's conv2d): x [N, C, H, W], weight w [K, C, R, S],
   bias b [K], stride >= 1, zero padding pad >= 0 on every side;
   y [N, K, P, Q] with P = (H + 2 pad - R) / stride + 1 (rounded down), Q
   likewise.
       mgpu_shape mgpu_conv2d_output_shape(x_shape, w_shape, stride, pad)
   gives [N, K, P, Q] (and checks that the shapes fit together).
       mgpu_conv2d_forward(y, x, w, b, stride, pad)     b may be NULL: no bias
       mgpu_conv2d_backward(dx, dw, db, dy, x, w, stride, pad, accumulate)
   dx [N, C, H, W] may be NULL (the first layer needs no input gradient);
   dw [K, C, R, S]; db [K] may be NULL (no bias). x and w are the forward
   pass's input and weight.

   Average pooling, k x k windows with stride k: x [N, C, H, W] ->
   y [N, C, H/k, W/k], rounded down like PyTorch (a 9x9 map gives 4x4).
       mgpu_shape mgpu_avg_pool2d_output_shape(x_shape, k)
       mgpu_avg_pool2d_forward(y, x, k)
       mgpu_avg_pool2d_backward(dx, dy, k)          dx has the shape of x
   Global average pooling, the mean of each plane: x [N, C, H, W] -> y [N, C].
       mgpu_global_avg_pool_forward(y, x)
       mgpu_global_avg_pool_backward(dx, dy)        dx [N, C, H, W], dy [N, C]

   ReLU, y = max(x, 0), any shape; y may be x itself (in place).
       mgpu_relu_forward(y, x)
       mgpu_relu_backward(dx, dy, y_or_x)     dx = dy where y_or_x > 0, else 0
   The mask can be the forward input or output (both are positive at the
   same places), so an in-place ReLU loses nothing. dx may be dy.

   Residual sum, y = a + b (same shapes; y may be a or b):
       mgpu_add(y, a, b)
   Its backward pass needs no function: dL/da = dL/db = dL/dy. Hand dy to
   both branches (mgpu_add_ adds it to a gradient a branch already has).

   Linear layer, with the weight stored [in, out] as in the book's LeNet
   (torch.mm(x, W) + b): x [N, in], w [in, out], b [out], y [N, out].
   x may also be an image batch [N, C, H, W] with C*H*W = in: it is read
   as [N, in] (flattened), and dx then has x's shape.
       mgpu_linear_forward(y, x, w, b)          b may be NULL: no bias
       mgpu_linear_backward(dx, dw, db, dy, x, w, accumulate)
   dx (may be NULL) = dy w^T; dw = x^T dy; db (may be NULL) = the sum of
   the rows of dy.

   A LeNet step, for instance (h1 = conv + bias, a1 = ReLU, p1 = pooling):
       mgpu_conv2d_forward(h1, x, w1, b1, 1, 0);
       mgpu_relu_forward(a1, h1);
       mgpu_avg_pool2d_forward(p1, a1, 2);
       ...
       mgpu_avg_pool2d_backward(da1, dp1, 2);
       mgpu_relu_backward(dh1, da1, a1);
       mgpu_conv2d_backward(NULL, dw1, db1, dh1, x, w1, 1, 0, 0);
*/
MGPU_DEF mgpu_shape mgpu_conv2d_output_shape(mgpu_shape x, mgpu_shape w, int stride, int pad);
MGPU_DEF void mgpu_conv2d_forward(mgpu_tensor *y, const mgpu_tensor *x, const mgpu_tensor *w,
                                  const mgpu_tensor *b, int stride, int pad);
MGPU_DEF void mgpu_conv2d_backward(mgpu_tensor *dx, mgpu_tensor *dw, mgpu_tensor *db,
                                   const mgpu_tensor *dy, const mgpu_tensor *x,
                                   const mgpu_tensor *w, int stride, int pad, int accumulate);

MGPU_DEF mgpu_shape mgpu_avg_pool2d_output_shape(mgpu_shape x, int k);
MGPU_DEF void mgpu_avg_pool2d_forward(mgpu_tensor *y, const mgpu_tensor *x, int k);
MGPU_DEF void mgpu_avg_pool2d_backward(mgpu_tensor *dx, const mgpu_tensor *dy, int k);
MGPU_DEF void mgpu_global_avg_pool_forward(mgpu_tensor *y, const mgpu_tensor *x);
MGPU_DEF void mgpu_global_avg_pool_backward(mgpu_tensor *dx, const mgpu_tensor *dy);

MGPU_DEF void mgpu_relu_forward(mgpu_tensor *y, const mgpu_tensor *x);
MGPU_DEF void mgpu_relu_backward(mgpu_tensor *dx, const mgpu_tensor *dy, const mgpu_tensor *y_or_x);
MGPU_DEF void mgpu_add(mgpu_tensor *y, const mgpu_tensor *a, const mgpu_tensor *b);

MGPU_DEF void mgpu_linear_forward(mgpu_tensor *y, const mgpu_tensor *x, const mgpu_tensor *w,
                                  const mgpu_tensor *b);
MGPU_DEF void mgpu_linear_backward(mgpu_tensor *dx, mgpu_tensor *dw, mgpu_tensor *db,
                                   const mgpu_tensor *dy, const mgpu_tensor *x,
                                   const mgpu_tensor *w, int accumulate);
