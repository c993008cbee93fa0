/* A broken solution of the zero-bubble assignment, with a mistake
   students make: every W put off to the end of the step. Nothing waits
   for a W, so it is accepted and the gradients are right, but each
   micro-batch's activations stay until its W: every stage holds all m
   (its checker must fail the memory test). */
static void add(mgpu_pipeline_pass *order, int *n, int backward, int micro_batch, mgpu_pass_part part) {
    order[*n].backward = backward, order[*n].micro_batch = micro_batch, order[*n].part = part;
    (*n)++;
}
void schedule_zb_h1(int stage, int stages, int micro_batches, mgpu_pipeline_pass *order) {
    int m = micro_batches, warmup = stages - stage - 1 < m ? stages - stage - 1 : m;
    int n = 0, forward = 0, backward = 0;
    while (forward < warmup) add(order, &n, 0, forward++, MGPU_PASS_WHOLE);
    while (backward < m) {
        if (forward < m) add(order, &n, 0, forward++, MGPU_PASS_WHOLE);
        add(order, &n, 1, backward++, MGPU_PASS_INPUT_GRAD);
    }
    for (int j = 0; j < m; j++) add(order, &n, 1, j, MGPU_PASS_WEIGHT_GRAD);
}
