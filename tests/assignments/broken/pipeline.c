/* A broken solution of the pipeline-schedule assignment: GPipe's order,
   every forward pass, then every backward pass. Its gradients are right,
   but every stage holds all m micro-batches' activations (its checker
   must fail the memory test). */
void schedule_1f1b(int stage, int stages, int micro_batches, mgpu_pipeline_pass *order) {
    (void)stage, (void)stages;
    for (int j = 0; j < micro_batches; j++) {
        order[j].backward = 0, order[j].micro_batch = j;
        order[micro_batches + j].backward = 1, order[micro_batches + j].micro_batch = j;
    }
}
