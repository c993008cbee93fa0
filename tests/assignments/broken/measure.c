/* Queues busy on average with a mistake: divided by the number of
   queues that worked rather than by the time (its checker must fail). */
double queues_busy_on_average(void) {
    int n = mgpu_trace_count();
    double busy = 0;
    for (int i = 0; i < n; i++) {
        mgpu_trace_op op = mgpu_trace_get(i);
        busy += op.end_ms - op.start_ms;
    }
    return busy / n;
}
