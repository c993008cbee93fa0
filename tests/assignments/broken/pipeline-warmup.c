/* A broken solution of the pipeline-schedule assignment, with a mistake
   students make: a warm-up of p - s forward passes, one too many. The
   schedule runs and its gradients are right, but stage s holds one
   micro-batch's activations more than 1F1B's min(m, p - s) (its checker
   must fail the memory test). */
void schedule_1f1b(int stage, int stages, int micro_batches, mgpu_pipeline_pass *order) {
    int m = micro_batches, warmup = stages - stage < m ? stages - stage : m;
    int n = 0, forward = 0, backward = 0;
    while (forward < warmup) order[n].backward = 0, order[n++].micro_batch = forward++;
    while (forward < m) {
        order[n].backward = 0, order[n++].micro_batch = forward++;
        order[n].backward = 1, order[n++].micro_batch = backward++;
    }
    while (backward < m) order[n].backward = 1, order[n++].micro_batch = backward++;
}
