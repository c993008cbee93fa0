/* The zero-bubble assignment's reference solution (docs/assignments.md):
   ZB-H1. 1F1B's order with B in place of each backward pass, and stage s
   runs each W once s more B passes have run after its own. */
static void add(mgpu_pipeline_pass *order, int *n, int backward, int micro_batch, mgpu_pass_part part) {
    order[*n].backward = backward, order[*n].micro_batch = micro_batch, order[*n].part = part;
    (*n)++;
}
void schedule_zb_h1(int stage, int stages, int micro_batches, mgpu_pipeline_pass *order) {
    int m = micro_batches, warmup = stages - stage - 1 < m ? stages - stage - 1 : m;
    int n = 0, forward = 0, input_grads = 0, weight_grads = 0;
    while (forward < warmup) add(order, &n, 0, forward++, MGPU_PASS_WHOLE);
    while (input_grads < m) {
        if (forward < m) add(order, &n, 0, forward++, MGPU_PASS_WHOLE);
        add(order, &n, 1, input_grads++, MGPU_PASS_INPUT_GRAD);
        /* W put off: stage s has s B passes in flight ahead of its W's */
        if (input_grads - weight_grads > stage) add(order, &n, 1, weight_grads++, MGPU_PASS_WEIGHT_GRAD);
    }
    while (weight_grads < m) add(order, &n, 1, weight_grads++, MGPU_PASS_WEIGHT_GRAD);
}
