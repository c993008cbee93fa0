/* The pipeline-schedule assignment's reference solution
   (docs/assignments.md): 1F1B. */
void schedule_1f1b(int stage, int stages, int micro_batches, mgpu_pipeline_pass *order) {
    int m = micro_batches, warmup = stages - stage - 1 < m ? stages - stage - 1 : m;
    int n = 0, forward = 0, backward = 0;
    while (forward < warmup) { /* warm-up: the forward passes that fill the stages after this one */
        order[n].backward = 0, order[n++].micro_batch = forward++;
    }
    while (forward < m) { /* steady state: one forward, then the oldest micro-batch's backward */
        order[n].backward = 0, order[n++].micro_batch = forward++;
        order[n].backward = 1, order[n++].micro_batch = backward++;
    }
    while (backward < m) { /* cool-down: the backward passes left */
        order[n].backward = 1, order[n++].micro_batch = backward++;
    }
}
