/* mgpu/events.h: events, the marks one queue leaves for another (or for
   the host) to wait on: how a copy waits for the computation that wrote
   its source, without stopping the host. Chapter 1 times with them.
   defines: mgpu_event_new, mgpu_event_free, mgpu_event_record,
   mgpu_event_wait, mgpu_event_synchronize, mgpu_event_elapsed_ms */
MGPU_DEF mgpu_event *mgpu_event_new(void) {
    mgpu_event *e = (mgpu_event *)mgpu__xcalloc(1, sizeof *e);
    e->refs = 1;
    MGPU__PTHREAD_CHECK(pthread_mutex_init(&e->mutex, NULL));
    MGPU__PTHREAD_CHECK(pthread_cond_init(&e->done_cond, NULL));
    return e;
}

/* An event lives until its owner has freed it and no queued task still
   records or waits on it: freeing never has to wait for the queues. */
static void mgpu__event_retain(mgpu_event *e) {
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&e->mutex));
    e->refs++;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&e->mutex));
}
static void mgpu__event_release(mgpu_event *e) {
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&e->mutex));
    int last = --e->refs == 0;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&e->mutex));
    if (!last) return;
#if MGPU_CUDA
    /* A forked child cannot call CUDA (the context is the parent's): there
       the CUDA event is left alone, and goes with the child's exit. */
    if (e->cuda_created && !mgpu__library.forked) MGPU_CUDA_CHECK(cudaEventDestroy(e->cuda));
#endif
    pthread_mutex_destroy(&e->mutex);
    pthread_cond_destroy(&e->done_cond);
    free(e);
}
MGPU_DEF void mgpu_event_free(mgpu_event *e) {
    if (e) mgpu__event_release(e);
}

typedef struct { mgpu_event *event; uint64_t generation; } mgpu__event_args;
static void mgpu__event_complete(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__event_args *a = (const mgpu__event_args *)args;
    mgpu_event *e = a->event;
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&e->mutex));
    if (e->completed < a->generation) e->completed = a->generation;
    e->time = mgpu_now();
    MGPU__PTHREAD_CHECK(pthread_cond_broadcast(&e->done_cond));
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&e->mutex));
    mgpu__event_release(e);
}

static void mgpu__event_record_on(mgpu_event *e, mgpu__queue *q) {
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&e->mutex));
    uint64_t generation = ++e->recorded;
    e->queue = q;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&e->mutex));
#if MGPU_CUDA
    if (mgpu__queue_on_gpu(q)) {
        MGPU_CUDA_CHECK(cudaSetDevice(q->device->gpu));
        if (e->cuda_created && e->cuda_gpu != q->device->gpu) {
            /* a CUDA event belongs to one GPU: recorded on another, it is made anew */
            MGPU_CUDA_CHECK(cudaEventSynchronize(e->cuda));
            MGPU_CUDA_CHECK(cudaEventDestroy(e->cuda));
            e->cuda_created = 0;
        }
        if (!e->cuda_created) {
            MGPU_CUDA_CHECK(cudaEventCreate(&e->cuda));
            e->cuda_created = 1;
            e->cuda_gpu = q->device->gpu;
        }
        MGPU_CUDA_CHECK(cudaEventRecord(e->cuda, q->stream));
        return;
    }
#endif
    mgpu__event_args a = {e, generation};
    mgpu__event_retain(e);
    mgpu__queue_push(q, NULL, mgpu__event_complete, &a, sizeof a);
}

/* The host waits for generation g of e. */
static void mgpu__event_host_wait(mgpu_event *e, uint64_t generation, mgpu__queue *q) {
#if MGPU_CUDA
    if (q && mgpu__queue_on_gpu(q)) {
        MGPU_CUDA_CHECK(cudaEventSynchronize(e->cuda));
        return;
    }
#else
    (void)q;
#endif
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&e->mutex));
    while (e->completed < generation)
        MGPU__PTHREAD_CHECK(pthread_cond_wait(&e->done_cond, &e->mutex));
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&e->mutex));
}

typedef struct { mgpu_event *event; uint64_t generation; mgpu__queue *source; } mgpu__wait_args;
static void mgpu__event_wait_task(const void *args, const mgpu__exec *ex) {
    (void)ex;
    const mgpu__wait_args *a = (const mgpu__wait_args *)args;
    mgpu__event_host_wait(a->event, a->generation, a->source);
    mgpu__event_release(a->event);
}

/* Queue q waits (in order, without blocking the host) for e's last record. */
static void mgpu__event_wait_on(mgpu__queue *q, mgpu_event *e) {
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&e->mutex));
    uint64_t generation = e->recorded;
    mgpu__queue *source = e->queue;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&e->mutex));
    if (!source || source == q) return; /* never recorded, or same queue: in order already */
#if MGPU_CUDA
    if (mgpu__queue_on_gpu(q)) {
        if (mgpu__queue_on_gpu(source)) {
            MGPU_CUDA_CHECK(cudaStreamWaitEvent(q->stream, e->cuda, 0));
        } else {
            /* A CUDA stream cannot wait for a CPU thread: the host waits. */
            mgpu__event_host_wait(e, generation, source);
        }
        return;
    }
#endif
    mgpu__wait_args a = {e, generation, source};
    mgpu__event_retain(e);
    mgpu__queue_push(q, NULL, mgpu__event_wait_task, &a, sizeof a);
}

MGPU_DEF void mgpu_event_record(mgpu_event *e, mgpu_device *d) { mgpu__event_record_on(e, &d->queue[0]); }
MGPU_DEF void mgpu_event_wait(mgpu_device *d, mgpu_event *e) { mgpu__event_wait_on(&d->queue[0], e); }
MGPU_DEF void mgpu_event_synchronize(mgpu_event *e) {
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&e->mutex));
    uint64_t generation = e->recorded;
    mgpu__queue *source = e->queue;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&e->mutex));
    if (source) mgpu__event_host_wait(e, generation, source);
    if (source && mgpu__queue_on_gpu(source)) mgpu__require_no_label_error(source->device);
}
MGPU_DEF double mgpu_event_elapsed_ms(mgpu_event *start, mgpu_event *end) {
    MGPU_REQUIRE(start && end && start->queue && end->queue,
                 "mgpu_event_elapsed_ms: %s event was never recorded (mgpu_event_record it first)",
                 !start || !start->queue ? "the start" : "the end");
    mgpu_event_synchronize(start);
    mgpu_event_synchronize(end);
#if MGPU_CUDA
    if (mgpu__queue_on_gpu(start->queue) && mgpu__queue_on_gpu(end->queue)) {
        float ms = 0;
        MGPU_REQUIRE(start->cuda_gpu == end->cuda_gpu,
                     "mgpu_event_elapsed_ms: the events were recorded on GPUs %d and %d; "
                     "time two events of one GPU", start->cuda_gpu, end->cuda_gpu);
        MGPU_CUDA_CHECK(cudaEventElapsedTime(&ms, start->cuda, end->cuda));
        return ms;
    }
    MGPU_REQUIRE(!mgpu__queue_on_gpu(start->queue) && !mgpu__queue_on_gpu(end->queue),
                 "mgpu_event_elapsed_ms: both events must be on GPUs or both on CPUs");
#endif
    return 1e3 * (end->time - start->time);
}
