/* A broken solution of the pipeline-schedule assignment, with a mistake
   students make: the warm-up counted from the wrong end, s forward passes
   on stage s instead of p - s - 1. Stage 0 then waits for B0 before it
   sends F1, while stage 1 waits for F1 before it runs B0: the schedule
   waits for itself, and the library refuses it (its checker must report
   that, and fail). */
void schedule_1f1b(int stage, int stages, int micro_batches, mgpu_pipeline_pass *order) {
    (void)stages;
    int m = micro_batches, warmup = stage < m ? stage : m;
    int n = 0, forward = 0, backward = 0;
    while (forward < warmup) order[n].backward = 0, order[n++].micro_batch = forward++;
    while (forward < m) {
        order[n].backward = 0, order[n++].micro_batch = forward++;
        order[n].backward = 1, order[n++].micro_batch = backward++;
    }
    while (backward < m) order[n].backward = 1, order[n++].micro_batch = backward++;
}
