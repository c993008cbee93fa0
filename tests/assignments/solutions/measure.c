/* The measuring-parallelism assignment, the reference solution
   (docs/assignments.md): from the trace just recorded, how many queues
   were busy on average. A queue runs its operations one after another,
   so the time it was busy is the sum of their durations; the sum over
   every queue, over the trace's span. */
double queues_busy_on_average(void) {
    int n = mgpu_trace_count();
    double busy = 0;
    for (int i = 0; i < n; i++) {
        mgpu_trace_op op = mgpu_trace_get(i);
        busy += op.end_ms - op.start_ms;
    }
    return busy / mgpu_trace_span_ms();
}
