/* A broken solution of the checkpointing assignment: the recomputation
   moves batch norm's running statistics a second time (as PyTorch's
   checkpoint does unless told not to). */
#define MAX_RUNS 64

void checkpointed_pass(mgpu_net **runs, int k, const mgpu_tensor *x, const mgpu_tensor *labels) {
    const mgpu_tensor *inputs[MAX_RUNS], *h = x;
    for (int i = 0; i < k; i++) {
        inputs[i] = h;
        if (i > 0) mgpu_net_want_input_grad(runs[i], 1);
        h = mgpu_net_forward(runs[i], h);
        if (i < k - 1) mgpu_net_free_activations(runs[i]);
    }
    mgpu_net_loss_backward(runs[k - 1], (mgpu_tensor *)h, labels, 1.0f / (float)x->shape.d[0], NULL);
    mgpu_net_free_activations(runs[k - 1]);
    for (int i = k - 2; i >= 0; i--) {
        mgpu_net_forward(runs[i], inputs[i]);
        mgpu_net_backward(runs[i], mgpu_net_input_grad(runs[i + 1]));
        mgpu_net_free_activations(runs[i]);
    }
}
