/* ------------------------------------------- batch norm, losses, optimisers
   Training operations. Like every operation they are enqueued on the
   device of their tensors (all on one device) and return at once; the
   caller allocates every tensor, including the outputs.

   Batch normalisation over channels, as PyTorch's BatchNorm2d
   (kernels/batchnorm.h has the maths):

       void mgpu_batchnorm2d_forward(y, x, gamma, beta, running_mean, running_var,
                                     save_mean, save_invstd, training, momentum, eps,
                                     fuse_relu)
   x and y are [N, C, H, W] (or [N, C], or [N, C, L]: every dimension after
   the second is a spatial one); gamma, beta, running_mean, running_var,
   save_mean and save_invstd hold C values each (shape [C]).
   training 1: normalises with the batch's mean and biased variance over
   N*H*W values per channel (N*H*W must be more than 1), writes the mean and
   1/sqrt(var + eps) to save_mean and save_invstd for the backward pass, and
   updates running_mean and running_var with `momentum` (PyTorch: 0.1; the
   running variance takes the unbiased variance, times m/(m-1)).
   training 0: normalises with running_mean and running_var and changes
   nothing else; save_mean and save_invstd may be NULL.
   eps is added to the variance (PyTorch: 1e-5). fuse_relu 1 gives
   y = max(0, batch norm of x) in the same pass. y may be x itself when no
   backward pass will follow (backward needs x).

       void mgpu_batchnorm2d_backward(dx, dgamma, dbeta, dy, x, y, gamma,
                                      save_mean, save_invstd, fuse_relu, accumulate)
   The backward pass of a training-mode forward: from dy = dL/dy, the x and
   gamma that forward used and its save_mean and save_invstd, writes dx
   (shape of x) and dgamma, dbeta ([C]). With fuse_relu, pass the forward's
   y (the ReLU's mask is y > 0; y is not read otherwise and may be NULL).
   accumulate 1 adds to dgamma and dbeta, as PyTorch's .grad does; 0
   overwrites them. dx is always overwritten.

   Softmax cross-entropy (PyTorch's CrossEntropyLoss; kernels/loss.h):
   logits are [N, classes]; labels hold N class indices stored as floats
   (0., 1., ...). A label that is not an integer in [0, classes) is a fatal
   error on a CPU device; on a GPU the sample's loss and gradient row
   become NaN and it counts as wrong in the accuracy.

       void mgpu_cross_entropy_forward(losses, logits, labels)
   losses ([N]): one loss per sample, log sum_j exp(z_j) - z_label
   (reduction='none'; computed stably).
       void mgpu_cross_entropy_backward(dlogits, logits, labels, scale)
   dlogits ([N, classes]): the gradient of scale * (sum of the N losses):
   scale 1 for the book's loss(...).sum(), 1/N for the mean
   (reduction='mean').
       void mgpu_accuracy_count(count, logits, labels)
   count ([1]): how many rows have their largest logit at the label (the
   first largest when several are equal, like torch.argmax). Read it with
   mgpu_item(count, 0); it stays on the device until then.

       void mgpu_sum(out, x)     out ([1]) = the sum of all of x's values
       void mgpu_mean(out, x)    out ([1]) = their mean (x not empty)
   For reporting (a loss, a count): summed in double.

   Stochastic gradient descent (kernels/sgd.h):

       void mgpu_sgd_book(param, grad, lr, batch_size)
   The book's d2l.sgd for a loss summed over a batch:
   param -= lr * grad / batch_size, then grad = 0, in one pass.

       void mgpu_sgd_step(param, grad, momentum_buf, lr, momentum, weight_decay,
                          first_step)
   torch.optim.SGD: g = grad + weight_decay * param; with momentum,
   buf = g at the first step (first_step 1) and momentum * buf + g after,
   and param -= lr * buf; without (momentum 0), param -= lr * g and
   momentum_buf is not used (pass NULL). momentum_buf has the shape of
   param. grad is not changed: zero it with mgpu_fill(grad, 0) before the
   next backward pass, PyTorch's zero_grad(). */
MGPU_DEF void mgpu_batchnorm2d_forward(mgpu_tensor *y, const mgpu_tensor *x,
                                       const mgpu_tensor *gamma, const mgpu_tensor *beta,
                                       mgpu_tensor *running_mean, mgpu_tensor *running_var,
                                       mgpu_tensor *save_mean, mgpu_tensor *save_invstd,
                                       int training, float momentum, float eps, int fuse_relu);
MGPU_DEF void mgpu_batchnorm2d_backward(mgpu_tensor *dx, mgpu_tensor *dgamma, mgpu_tensor *dbeta,
                                        const mgpu_tensor *dy, const mgpu_tensor *x,
                                        const mgpu_tensor *y, const mgpu_tensor *gamma,
                                        const mgpu_tensor *save_mean,
                                        const mgpu_tensor *save_invstd, int fuse_relu,
                                        int accumulate);
MGPU_DEF void mgpu_cross_entropy_forward(mgpu_tensor *losses, const mgpu_tensor *logits,
                                         const mgpu_tensor *labels);
MGPU_DEF void mgpu_cross_entropy_backward(mgpu_tensor *dlogits, const mgpu_tensor *logits,
                                          const mgpu_tensor *labels, float scale);
MGPU_DEF void mgpu_accuracy_count(mgpu_tensor *count, const mgpu_tensor *logits,
                                  const mgpu_tensor *labels);
MGPU_DEF void mgpu_sum(mgpu_tensor *out, const mgpu_tensor *x);
MGPU_DEF void mgpu_mean(mgpu_tensor *out, const mgpu_tensor *x);
MGPU_DEF void mgpu_sgd_book(mgpu_tensor *param, mgpu_tensor *grad, float lr, int batch_size);
MGPU_DEF void mgpu_sgd_step(mgpu_tensor *param, const mgpu_tensor *grad,
                            mgpu_tensor *momentum_buf, float lr, float momentum,
                            float weight_decay, int first_step);
