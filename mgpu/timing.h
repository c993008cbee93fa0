/* mgpu/timing.h: measuring. Timers and benchmarks (the book's Timer and
   Benchmark), and the tracer: every operation a queue runs, with its
   start and end, drawn as a timeline (by kind of work) or summed per
   operation. Chapter 1 shows with it that two devices compute at once;
   chapter 4 draws each rank's.
   defines: mgpu_timer_init, mgpu_timer_start, mgpu_timer_stop,
   mgpu_timer_sum, mgpu_timer_avg, mgpu_median, mgpu_timer_cumsum,
   mgpu_benchmark_begin, mgpu_benchmark_end, mgpu_bound_line,
   mgpu_bound_hold, mgpu_trace_begin,
   mgpu_trace_end, mgpu_trace_write_png, mgpu_trace_summary,
   mgpu_trace_count, mgpu_trace_get, mgpu_trace_label, mgpu_trace_span_ms,
   mgpu_trace_busy_ms */
/* ======================================================================
   Timers
   ====================================================================== */
MGPU_DEF void mgpu_timer_init(mgpu_timer *t) { memset(t, 0, sizeof *t); }
MGPU_DEF void mgpu_timer_start(mgpu_timer *t) { t->started = mgpu_now(); }
MGPU_DEF double mgpu_timer_stop(mgpu_timer *t) {
    double dt = mgpu_now() - t->started;
    if (t->n < MGPU_TIMER_MAX) t->times[t->n++] = dt;
    return dt;
}
MGPU_DEF double mgpu_timer_sum(const mgpu_timer *t) { return mgpu_timer_cumsum(t, t->n - 1); }
MGPU_DEF double mgpu_timer_avg(const mgpu_timer *t) { return t->n ? mgpu_timer_sum(t) / t->n : 0.0; }
static int mgpu__double_order(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
MGPU_DEF double mgpu_median(double *values, int n) {
    MGPU_REQUIRE(n >= 1, "mgpu_median: %d values; want 1 or more", n);
    qsort(values, (size_t)n, sizeof *values, mgpu__double_order);
    return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}
MGPU_DEF double mgpu_timer_cumsum(const mgpu_timer *t, int i) {
    double s = 0;
    for (int k = 0; k <= i && k < t->n; k++) s += t->times[k];
    return s;
}
MGPU_DEF mgpu_benchmark mgpu_benchmark_begin(const char *description) {
    mgpu_benchmark b;
    b.description = description;
    b.done = 0;
    b.started = mgpu_now();
    return b;
}
MGPU_DEF double mgpu_benchmark_end(mgpu_benchmark *b) {
    mgpu_synchronize_all();
    double seconds = mgpu_now() - b->started;
    printf("%s: %.4f sec\n", b->description, seconds);
    fflush(stdout);
    b->done = 1;
    return seconds;
}

/* ======================================================================
   Bounds: what a measured figure cannot be
   ====================================================================== */
/* A figure past its bound is not a discovery: on a machine shared with
   other work, or with fewer cores than workers, a baseline is slowed or a
   run is starved. The chapters say so beside the figure rather than
   explain it. */
MGPU_DEF int mgpu_bound_line(char *line, size_t size, const char *figure, double value, mgpu_bound_side side,
                             double bound, double tolerance, const char *advice) {
    MGPU_REQUIRE(line && size > 0 && figure && tolerance >= 0,
                 "mgpu_bound_line: want a buffer, a figure's name and a tolerance >= 0");
    line[0] = '\0';
    int above = side == MGPU_AT_MOST;
    double slack = tolerance * fabs(bound);
    if (above ? value <= bound + slack : value >= bound - slack) return 1;
    snprintf(line, size, "  ! %s %.3g is %s its bound %.3g: the machine was busy or too small for it%s%s", figure,
             value, above ? "above" : "below", bound, advice && *advice ? "; " : ".",
             advice && *advice ? advice : "");
    return 0;
}
MGPU_DEF int mgpu_bound_hold(const char *figure, double value, mgpu_bound_side side, double bound,
                             double tolerance, const char *advice) {
    char line[512];
    if (mgpu_bound_line(line, sizeof line, figure, value, side, bound, tolerance, advice)) return 1;
    printf("%s\n", line);
    fflush(stdout);
    return 0;
}

/* ======================================================================
   Tracing
   ====================================================================== */

MGPU_DEF void mgpu_trace_begin(void) {
    mgpu_synchronize_all();
    mgpu__library.trace_n = 0;
#if MGPU_CUDA
    /* One reference event per GPU: GPU times are measured from it. */
    for (int g = 0; g < mgpu__library.num_gpus && g < MGPU_MAX_DEVICES; g++) {
        MGPU_CUDA_CHECK(cudaSetDevice(g));
        if (!mgpu__library.trace_cuda_start[g])
            MGPU_CUDA_CHECK(cudaEventCreate(&mgpu__library.trace_cuda_start[g]));
        MGPU_CUDA_CHECK(cudaEventRecord(mgpu__library.trace_cuda_start[g], 0));
        MGPU_CUDA_CHECK(cudaEventSynchronize(mgpu__library.trace_cuda_start[g]));
    }
#endif
    mgpu__library.trace_start = mgpu_now();
    mgpu__library.tracing = 1;
}

MGPU_DEF void mgpu_trace_end(void) {
    mgpu_synchronize_all();
    mgpu__library.tracing = 0;
    mgpu__library.trace_stop = mgpu_now();
}

/* A record's start and end in milliseconds since mgpu_trace_begin. */
static void mgpu__trace_times(const mgpu__trace_record *r, double *start_ms, double *end_ms) {
    *start_ms = 1e3 * (r->start - mgpu__library.trace_start);
    *end_ms = 1e3 * (r->end - mgpu__library.trace_start);
#if MGPU_CUDA
    const mgpu_device *d = mgpu__library.devices[r->queue_id / 2];
    if (d->gpu >= 0) {
        float s = 0, e = 0;
        MGPU_CUDA_CHECK(cudaEventElapsedTime(&s, mgpu__library.trace_cuda_start[d->gpu], r->cuda_start));
        MGPU_CUDA_CHECK(cudaEventElapsedTime(&e, mgpu__library.trace_cuda_start[d->gpu], r->cuda_end));
        *start_ms = s;
        *end_ms = e;
    }
#endif
}

/* What kind of work an operation is, for the timelines' colours and
   legends: a step of a network runs twenty-odd operations, and a legend
   of a few kinds can be read at a glance where twenty names (most of
   them too short to see) cannot. The first row whose part is in the name
   gives its kind; a name in no row is a kind of its own ("matmul"). */
static const struct {
    const char *part, *kind;
} mgpu__trace_kinds[] = {
    {"wait", "waiting for the other ranks"}, /* (mgpu/groups.h: a collective until every rank came) */
    {"backward", "backward"},
    {"allreduce", "communication"}, {"broadcast", "communication"}, {"all-gather", "communication"},
    {"reduce-scatter", "communication"}, {"send", "communication"}, {"receive", "communication"},
    {"ring ", "communication"}, {"ranks' mean", "communication"},
    {"sgd", "optimizer"}, {"adam", "optimizer"}, {"zero_grad", "optimizer"},
    {"cross entropy", "loss and accuracy"}, {"accuracy", "loss and accuracy"},
    {"conv2d", "forward"}, {"linear", "forward"}, {"relu", "forward"}, {"pool", "forward"},
    {"batchnorm", "forward"}, {"layer", "forward"},
    {"copy", "copy"},
    {"add", "tensor arithmetic"}, {"sum", "tensor arithmetic"}, {"scale", "tensor arithmetic"},
    {"fill", "tensor arithmetic"},
};
static const char *mgpu__trace_kind(const char *name) {
    for (size_t i = 0; i < sizeof mgpu__trace_kinds / sizeof mgpu__trace_kinds[0]; i++)
        if (strstr(name, mgpu__trace_kinds[i].part)) return mgpu__trace_kinds[i].kind;
    return name;
}

MGPU_DEF int mgpu_trace_write_png(const char *path, const char *title) {
    mgpu__init();
    if (mgpu__library.tracing) mgpu_trace_end(); /* every traced operation must have finished */
    /* Lanes: only the queues that did something, in device order. */
    int lane_of[MGPU_MAX_DEVICES * 8];
    const char *lane_names[MGPU_MAX_DEVICES * 8];
    int nqueues = 2 * mgpu__library.ndevices, nlanes = 0;
    for (int id = 0; id < nqueues; id++) {
        lane_of[id] = -1;
        for (int i = 0; i < mgpu__library.trace_n; i++)
            if (mgpu__library.trace[i].queue_id == id) {
                lane_of[id] = nlanes;
                lane_names[nlanes++] = mgpu__library.devices[id / 2]->queue[id % 2].name;
                break;
            }
    }
    mgpu_timeline_bar *bars =
        (mgpu_timeline_bar *)mgpu__xcalloc((size_t)mgpu__library.trace_n + 1, sizeof *bars);
    for (int i = 0; i < mgpu__library.trace_n; i++) {
        const mgpu__trace_record *r = &mgpu__library.trace[i];
        mgpu_timeline_bar *b = &bars[i];
        b->lane = lane_of[r->queue_id];
        snprintf(b->name, sizeof b->name, "%s", mgpu__trace_kind(r->name));
        mgpu__trace_times(r, &b->start_ms, &b->end_ms);
    }
    int rc = mgpu_timeline_write_png(path, title, nlanes, lane_names, mgpu__library.trace_n, bars);
    free(bars);
    return rc;
}

typedef struct { const char *name; int calls; double total_ms; } mgpu__trace_total;
static int mgpu__trace_total_cmp(const void *a, const void *b) {
    double x = ((const mgpu__trace_total *)a)->total_ms, y = ((const mgpu__trace_total *)b)->total_ms;
    return x < y ? 1 : x > y ? -1 : 0;
}

MGPU_DEF void mgpu_trace_summary(FILE *f) {
    mgpu__init();
    if (mgpu__library.tracing) mgpu_trace_end(); /* every traced operation must have finished */
    mgpu__trace_total *totals =
        (mgpu__trace_total *)mgpu__xcalloc((size_t)mgpu__library.trace_n + 1, sizeof *totals);
    int ntotals = 0;
    double all_ms = 0;
    for (int i = 0; i < mgpu__library.trace_n; i++) {
        const mgpu__trace_record *r = &mgpu__library.trace[i];
        double start, end;
        mgpu__trace_times(r, &start, &end);
        int t = 0;
        while (t < ntotals && strcmp(totals[t].name, r->name) != 0) t++;
        if (t == ntotals) totals[ntotals++].name = r->name;
        totals[t].calls++;
        totals[t].total_ms += end - start;
        all_ms += end - start;
    }
    qsort(totals, (size_t)ntotals, sizeof *totals, mgpu__trace_total_cmp);
    int width = (int)strlen("operation"); /* the names' column: as wide as the longest */
    for (int t = 0; t < ntotals; t++)
        if ((int)strlen(totals[t].name) > width) width = (int)strlen(totals[t].name);
    fprintf(f, "%-*s %7s %11s %10s %7s\n", width, "operation", "calls", "total ms", "mean us", "share");
    for (int t = 0; t < ntotals; t++)
        fprintf(f, "%-*s %7d %11.3f %10.1f %6.1f%%\n", width, totals[t].name, totals[t].calls,
                totals[t].total_ms, 1e3 * totals[t].total_ms / totals[t].calls,
                all_ms > 0 ? 100.0 * totals[t].total_ms / all_ms : 0.0);
    fprintf(f, "%-*s %7d %11.3f   (summed over the queues; %.3f ms from begin to end)\n", width, "all",
            mgpu__library.trace_n, all_ms, 1e3 * (mgpu__library.trace_stop - mgpu__library.trace_start));
    free(totals);
}

MGPU_DEF int mgpu_trace_count(void) {
    mgpu__init();
    if (mgpu__library.tracing) mgpu_trace_end(); /* every traced operation must have finished */
    return mgpu__library.trace_n;
}
MGPU_DEF mgpu_trace_op mgpu_trace_get(int i) {
    int n = mgpu_trace_count();
    MGPU_REQUIRE(i >= 0 && i < n, "mgpu_trace_get: operation %d of %d recorded", i, n);
    const mgpu__trace_record *r = &mgpu__library.trace[i];
    const mgpu_device *d = mgpu__library.devices[r->queue_id / 2];
    mgpu_trace_op op = {d, r->queue_id % 2, d->queue[r->queue_id % 2].name, r->name, mgpu__trace_kind(r->name),
                        0, 0, r->label};
    mgpu__trace_times(r, &op.start_ms, &op.end_ms);
    return op;
}
#define MGPU__TRACE_LABELS_MAX 4096
MGPU_DEF void mgpu_trace_label(const char *label) {
    mgpu__init();
    if (!label) {
        mgpu__trace_label_now = NULL;
        return;
    }
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&mgpu__library.mutex));
    int i = 0;
    while (i < mgpu__library.trace_nlabels && strcmp(mgpu__library.trace_labels[i], label) != 0) i++;
    if (i == mgpu__library.trace_nlabels) {
        if (i == MGPU__TRACE_LABELS_MAX) {
            MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__library.mutex));
            mgpu_fatal("mgpu_trace_label: more than %d distinct labels (\"%s\")", MGPU__TRACE_LABELS_MAX, label);
        }
        if (i % 64 == 0)
            mgpu__library.trace_labels =
                (char **)mgpu__xrealloc(mgpu__library.trace_labels, (size_t)(i + 64) * sizeof(char *));
        size_t bytes = strlen(label) + 1;
        mgpu__library.trace_labels[i] = (char *)memcpy(mgpu__xmalloc(bytes), label, bytes);
        mgpu__library.trace_nlabels++;
    }
    mgpu__trace_label_now = mgpu__library.trace_labels[i];
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__library.mutex));
}
MGPU_DEF double mgpu_trace_span_ms(void) {
    mgpu_trace_count();
    return 1e3 * (mgpu__library.trace_stop - mgpu__library.trace_start);
}
/* A queue runs its operations one at a time: its busy time is the sum
   of theirs. */
MGPU_DEF double mgpu_trace_busy_ms(const mgpu_device *d, int lane) {
    MGPU_REQUIRE(d && (lane == 0 || lane == 1), "mgpu_trace_busy_ms: want a device and lane 0 (compute) or 1 (copy)");
    double busy = 0;
    for (int i = 0, n = mgpu_trace_count(); i < n; i++) {
        mgpu_trace_op op = mgpu_trace_get(i);
        if (op.device == d && op.lane == lane) busy += op.end_ms - op.start_ms;
    }
    return busy;
}
