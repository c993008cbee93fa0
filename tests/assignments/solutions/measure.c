/* The measuring-parallelism assignment, the reference solution
   (docs/assignments.md): from the trace just recorded, how many queues
   were busy on average, the sum of every queue's busy time (the union of
   its operations' intervals) over the trace's span. */
static int by_start(const void *a, const void *b) {
    const double *x = (const double *)a, *y = (const double *)b;
    return (x[0] > y[0]) - (x[0] < y[0]);
}
double queues_busy_on_average(void) {
    int n = mgpu_trace_count();
    double busy = 0, (*interval)[2] = malloc(sizeof *interval * (size_t)(n + 1));
    for (int lane = 0; lane < 2; lane++)
        for (int i = 0; i < n; i++) { /* each queue once: at its first operation */
            mgpu_trace_op first = mgpu_trace_get(i);
            int seen = first.lane != lane, count = 0;
            for (int j = 0; j < i && !seen; j++) {
                mgpu_trace_op before = mgpu_trace_get(j);
                seen = before.device == first.device && before.lane == lane;
            }
            if (seen) continue;
            for (int j = i; j < n; j++) {
                mgpu_trace_op op = mgpu_trace_get(j);
                if (op.device == first.device && op.lane == lane)
                    interval[count][0] = op.start_ms, interval[count++][1] = op.end_ms;
            }
            qsort(interval, (size_t)count, sizeof *interval, by_start);
            double start = interval[0][0], end = interval[0][1];
            for (int k = 1; k <= count; k++) {
                if (k == count || interval[k][0] > end) { /* a gap, or the end: the run so far counts */
                    busy += end - start;
                    if (k < count) start = interval[k][0], end = interval[k][1];
                } else if (interval[k][1] > end) {
                    end = interval[k][1];
                }
            }
        }
    free(interval);
    return busy / mgpu_trace_span_ms();
}
