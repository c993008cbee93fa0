/* The checkpointing assignment's reference solution (docs/assignments.md). */
#define MAX_RUNS 64

void checkpointed_pass(mgpu_net **runs, int k, const mgpu_tensor *x, const mgpu_tensor *labels) {
    const mgpu_tensor *inputs[MAX_RUNS], *h = x;
    for (int i = 0; i < k; i++) { /* forward, keeping each run's output only */
        inputs[i] = h;
        if (i > 0) mgpu_net_want_input_grad(runs[i], 1);
        h = mgpu_net_forward(runs[i], h);
        if (i < k - 1) mgpu_net_free_activations(runs[i]);
    }
    mgpu_net_loss_backward(runs[k - 1], (mgpu_tensor *)h, labels, 1.0f / (float)x->shape.d[0], NULL);
    mgpu_net_free_activations(runs[k - 1]); /* (a run's activations go once its backward pass is done) */
    for (int i = k - 2; i >= 0; i--) {
        /* the run's forward pass again, with its running statistics put back after it */
        int nb = mgpu_net_num_buffers(runs[i]);
        mgpu_tensor **saved = (mgpu_tensor **)malloc(sizeof *saved * (size_t)(nb + 1));
        for (int b = 0; b < nb; b++) {
            const mgpu_tensor *buffer = mgpu_net_buffer(runs[i], b);
            saved[b] = mgpu_empty(buffer->device, buffer->shape);
            mgpu_copy(saved[b], buffer, 0);
        }
        mgpu_net_forward(runs[i], inputs[i]);
        for (int b = 0; b < nb; b++) {
            mgpu_copy(mgpu_net_buffer(runs[i], b), saved[b], 0);
            mgpu_free(saved[b]);
        }
        free(saved);
        mgpu_net_backward(runs[i], mgpu_net_input_grad(runs[i + 1]));
        mgpu_net_free_activations(runs[i]);
    }
}
