/* A broken solution of the zero-bubble assignment, with a mistake
   students make: each W at once after its B. It is 1F1B with the backward
   pass cut in two: accepted, the gradients right, the memory 1F1B's, but
   the B passes wait behind W passes on their way back, and the bubble
   lies between ZB-H1's and 1F1B's (its checker must fail the bubble
   test). */
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
        add(order, &n, 1, backward, MGPU_PASS_INPUT_GRAD);
        add(order, &n, 1, backward++, MGPU_PASS_WEIGHT_GRAD);
    }
}
