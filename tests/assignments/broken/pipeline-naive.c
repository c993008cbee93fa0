/* A broken solution of the pipeline-schedule assignment: no warm-up, each
   micro-batch's forward pass then its backward pass on every stage. It
   runs, its gradients are right and it holds one micro-batch at a time,
   but stage s waits for each micro-batch to go through the stages after
   it and back: the micro-batches go through the pipeline one at a time,
   naive model parallelism's bubble (its checker must fail the warm-up
   test). */
void schedule_1f1b(int stage, int stages, int micro_batches, mgpu_pipeline_pass *order) {
    (void)stage, (void)stages;
    for (int j = 0; j < micro_batches; j++) {
        order[2 * j].backward = 0, order[2 * j].micro_batch = j;
        order[2 * j + 1].backward = 1, order[2 * j + 1].micro_batch = j;
    }
}
