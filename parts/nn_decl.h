/* ----------------------------------------------------------- networks
   A network (mgpu_net) is a list of layers on one device, each with its
   parameters (value and gradient, mgpu_param) and buffers (batch norm's
   running statistics). It is what chapter 3's ResNet-18 is made of, and
   what a course extends with its own layer kinds.

       mgpu_net *mgpu_resnet18(int num_classes, int in_channels, mgpu_device *dev);
   The book's ResNet-18 for small images: a 3x3 stem convolution (stride 1,
   padding 1), batch norm, ReLU, no max-pool; four stages of two residual
   blocks (64, 128, 256, 512 channels; a 1x1 strided convolution on the
   shortcut where the shape changes); global average pooling; a linear
   layer. Conv and linear weights ~ Normal(0, 0.01) (the book's
   init_weights); their biases as PyTorch initialises them,
   Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)); batch norm gamma 1, beta 0.
   Draws come from the generator (mgpu_manual_seed first).

       mgpu_tensor *mgpu_net_forward(mgpu_net *net, const mgpu_tensor *x);
   runs the layers in order and returns the logits [N, classes] (owned by
   the net: valid until the next forward). In training mode batch norm
   uses the batch's statistics and updates its running ones; in evaluation
   mode it uses the running ones (mgpu_net_set_training).

       void mgpu_net_backward(mgpu_net *net, const mgpu_tensor *dlogits);
   back-propagates through the layers of the last forward and ADDS every
   parameter's gradient into param.grad, as PyTorch's .backward() does;
   mgpu_net_zero_grad clears them.

       void mgpu_net_train_step(net, x, labels, lr, momentum, weight_decay, loss_sum_or_NULL)
   one SGD step on the mean cross-entropy; adds the batch's summed loss to
   a one-element tensor on the net's device when given one (read it once an
   epoch: reading it every step would make the host wait every step).

       int mgpu_net_num_params(net);   mgpu_param *mgpu_net_param(net, i);
       int mgpu_net_num_buffers(net);  mgpu_tensor *mgpu_net_buffer(net, i);
       size_t mgpu_net_num_weights(net)         number of trainable floats
       mgpu_net *mgpu_net_replicate(const mgpu_net *net, mgpu_device *dev)
   a copy on another device (values and buffers copied, gradients zero).
       void mgpu_net_copy_params(mgpu_net *dst, const mgpu_net *src, int with_buffers)
       void mgpu_net_save(const mgpu_net *net, const char *path)
       void mgpu_net_load(mgpu_net *net, const char *path)
   One file holds every parameter and buffer: a header (magic "MGPUNET1",
   version, tensor count), each tensor's shape and values, and a 64-bit
   FNV-1a checksum of everything before it. Loading a damaged file, another
   network's file or a file from another version is a one-line error. */
typedef enum {
    MGPU_LAYER_CONV,
    MGPU_LAYER_BATCHNORM,
    MGPU_LAYER_RELU,
    MGPU_LAYER_RESIDUAL,
    MGPU_LAYER_GLOBAL_AVG_POOL,
    MGPU_LAYER_LINEAR
} mgpu_layer_kind;

typedef struct mgpu_layer mgpu_layer;
struct mgpu_layer {
    mgpu_layer_kind kind;
    char name[40];
    /* settings */
    int in_channels, out_channels, kernel, stride, pad;
    int fuse_relu;            /* batch norm followed by ReLU, done in one pass */
    int need_dinput;          /* 0 for the first layer: nothing before it wants dx */
    /* parameters: conv/linear weight and bias; batch norm gamma and beta */
    mgpu_param weight, bias;
    /* batch norm buffers, and what its backward pass needs */
    mgpu_tensor *running_mean, *running_var, *save_mean, *save_invstd;
    /* a residual block's layers (shortcut is NULL for the identity) */
    mgpu_layer *conv1, *bn1, *conv2, *bn2, *shortcut;
    /* activations of the last forward, kept for the backward */
    const mgpu_tensor *input;
    mgpu_tensor *output, *dinput, *dsum;
};

typedef struct mgpu_net {
    mgpu_device *device;
    int training;
    int nlayers;
    mgpu_layer *layers[16];
    int nparams, nbuffers;
    mgpu_param *params[128];    /* pointers into the layers, in registration order */
    mgpu_tensor **buffers[128];
    mgpu_tensor *momentum[128]; /* SGD momentum buffers, made at the first step */
    int steps;
    /* scratch of the training step */
    mgpu_tensor *losses, *dlogits, *loss_sum;
} mgpu_net;

MGPU_DEF mgpu_net *mgpu_resnet18(int num_classes, int in_channels, mgpu_device *dev);
MGPU_DEF mgpu_tensor *mgpu_net_forward(mgpu_net *net, const mgpu_tensor *x);
MGPU_DEF void mgpu_net_backward(mgpu_net *net, const mgpu_tensor *dlogits);
MGPU_DEF void mgpu_net_zero_grad(mgpu_net *net);
MGPU_DEF void mgpu_net_set_training(mgpu_net *net, int training);
MGPU_DEF void mgpu_net_sgd(mgpu_net *net, float lr, float momentum, float weight_decay);
MGPU_DEF void mgpu_net_loss_backward(mgpu_net *net, const mgpu_tensor *logits,
                                     const mgpu_tensor *labels, float scale,
                                     mgpu_tensor *loss_sum);
MGPU_DEF void mgpu_net_train_step(mgpu_net *net, const mgpu_tensor *x, const mgpu_tensor *labels,
                                  float lr, float momentum, float weight_decay,
                                  mgpu_tensor *loss_sum);
MGPU_DEF int mgpu_net_num_params(const mgpu_net *net);
MGPU_DEF mgpu_param *mgpu_net_param(mgpu_net *net, int i);
MGPU_DEF int mgpu_net_num_buffers(const mgpu_net *net);
MGPU_DEF mgpu_tensor *mgpu_net_buffer(mgpu_net *net, int i);
MGPU_DEF size_t mgpu_net_num_weights(const mgpu_net *net);
MGPU_DEF mgpu_net *mgpu_net_replicate(const mgpu_net *net, mgpu_device *dev);
MGPU_DEF void mgpu_net_copy_params(mgpu_net *dst, const mgpu_net *src, int with_buffers);
MGPU_DEF void mgpu_net_save(const mgpu_net *net, const char *path);
MGPU_DEF void mgpu_net_load(mgpu_net *net, const char *path);
MGPU_DEF void mgpu_net_free(mgpu_net *net);
/* Counts, on the net's device, the rows of logits whose argmax is the label,
   over a whole data set in evaluation mode; returns the accuracy. */
MGPU_DEF double mgpu_net_evaluate_accuracy(mgpu_net *net, const mgpu_dataset *data, int batch_size);
