/* mgpu/groups.h: processes as a group, over MPI (chapter 4). Starting
   and ending a job; a group's collectives on tensors (allreduce,
   broadcast, all-gather, reduce-scatter, send and receive), by MPI or,
   between GPUs of different processes, by NCCL, and on host values; and
   the watch that keeps a job from hanging: every wait on other ranks,
   NCCL's too, is bounded (MGPU_DIST_TIMEOUT), and a rank that stopped is
   named in one line. Without MPI every program is a group of one.
   defines: mgpu_dist_init, mgpu_dist_finalize, mgpu_group_rank,
   mgpu_group_size, mgpu_group_local_rank, mgpu_group_local_size,
   mgpu_group_host, mgpu_group_devices, mgpu_group_device,
   mgpu_group_first, mgpu_group_free, mgpu_group_path,
   mgpu_group_allreduce, mgpu_group_allreduce_start, mgpu_group_broadcast,
   mgpu_group_all_gather, mgpu_group_reduce_scatter, mgpu_group_send,
   mgpu_group_recv, mgpu_group_barrier, mgpu_group_fatal,
   mgpu_group_sum_host, mgpu_group_all_gather_host */
/* NCCL between processes needs its nonblocking start (NCCL 2.14 on), so
   that a rank that never comes is a timeout, not a hang. */
#if MGPU_CUDA && MGPU_MPI
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 14, 0)
#define MGPU__NCCL_BETWEEN_PROCESSES 1
#endif
#endif
#ifndef MGPU__NCCL_BETWEEN_PROCESSES
#define MGPU__NCCL_BETWEEN_PROCESSES 0
#endif
struct mgpu_group {
    int rank, size, local_rank, local_size;
    char host[256]; /* (MPI_MAX_PROCESSOR_NAME in Open MPI) */
    long sequence;   /* the collectives of devices' tensors called so far: each one's number */
    long host_sequence; /* the same for the host's (barriers, all-gathers of host memory) */
    uint64_t id;     /* the same on every rank of the group, and no other group's */
    long splits;     /* the groups made from it so far (mgpu_group_first): their ids */
    int *world_ranks; /* each rank's in the job (whose watchers answer for it) */
    double timeout;  /* seconds a rank waits for the others (MGPU_DIST_TIMEOUT) */
    float *received; /* the chunks a reduction receives (used on one queue at a time) */
    size_t received_floats;
    mgpu_tensor *staging; /* pinned host memory that GPU tensors go through */
    mgpu_device *device;  /* the device of its collectives' tensors (set by the first) */
#if MGPU_MPI
    /* Two communicators, so that the collectives a communication queue
       runs and the caller's numbers on the host never meet in one
       communicator's order. */
    MPI_Comm comm, host_comm;
#endif
    int way_chosen; /* its first collective on a GPU chose NCCL or MPI through the host */
#if MGPU__NCCL_BETWEEN_PROCESSES
    ncclComm_t nccl;       /* NCCL between the ranks' GPUs (NULL: MPI through the host) */
    cudaEvent_t nccl_done; /* the end of its last NCCL collective on the device's stream */
#endif
};
#if MGPU__NCCL_BETWEEN_PROCESSES
static void mgpu__nccl_end(mgpu_group *g);
#endif

/* What the ranks run, in the order they call it. */
typedef enum {
    MGPU__ALLREDUCE, MGPU__BROADCAST, MGPU__ALL_GATHER, MGPU__REDUCE_SCATTER, MGPU__SEND, MGPU__RECV
} mgpu__coll_kind;
static const char *const mgpu__coll_names[] = {"allreduce", "broadcast", "all-gather", "reduce-scatter",
                                               "send", "receive"};
typedef struct mgpu__coll {
    mgpu_group *group;
    mgpu__coll_kind kind;
    mgpu_reduce_op op;
    int peer;       /* broadcast: the root; send, receive: the other rank */
    long sequence;
    size_t count;   /* the elements of `in` */
    const float *in;
    float *out;     /* (in == out where the collective works in place) */
} mgpu__coll;

/* A mistake that every rank sees at once: rank 0 alone writes the line
   and exits; the others wait to be stopped by the launcher, so that the
   job ends with one line instead of one a rank. */
MGPU_DEF void mgpu_group_fatal(const mgpu_group *g, const char *fmt, ...) {
    mgpu__dist_quiet = g->rank != 0;
    if (g->rank == 0) {
        va_list ap;
        va_start(ap, fmt);
        mgpu__vfatal(NULL, 0, fmt, ap);
    }
    struct timespec pause = {1, 0};
    for (double start = mgpu_now(); mgpu_now() - start < g->timeout;) nanosleep(&pause, NULL);
    _exit(1);
}

#if MGPU_MPI
/* "allreduce #12 of 61706 floats (mean)", "send of 100 floats to rank 2":
   what a collective is, for messages (a send or a receive, between two
   ranks only, has no number in the group's sequence). */
static void mgpu__coll_describe(const mgpu__coll *c, char *buf, size_t size) {
    int at = snprintf(buf, size, "%s", mgpu__coll_names[c->kind]);
    if (c->sequence) at += snprintf(buf + at, size - at, " #%ld", c->sequence);
    at += snprintf(buf + at, size - at, " of %zu floats", c->count);
    if (c->kind == MGPU__ALLREDUCE || c->kind == MGPU__REDUCE_SCATTER)
        snprintf(buf + at, size - at, " (%s)", c->op == MGPU_MEAN ? "mean" : "sum");
    else if (c->kind == MGPU__BROADCAST)
        snprintf(buf + at, size - at, " from rank %d", c->peer);
    else if (c->kind == MGPU__SEND || c->kind == MGPU__RECV)
        snprintf(buf + at, size - at, " %s rank %d", c->kind == MGPU__SEND ? "to" : "from", c->peer);
}

/* The collective this process is in, for the line it writes when the
   launcher stops it (mgpu__dist_on_signal). Two slots, so that the
   handler never reads one half written. */
static char mgpu__dist_doing[2][192];
static volatile sig_atomic_t mgpu__dist_doing_slot;
static void mgpu__dist_set_doing(const char *what) {
    int slot = !mgpu__dist_doing_slot;
    if (what)
        snprintf(mgpu__dist_doing[slot], sizeof mgpu__dist_doing[slot], "in %s", what);
    else
        snprintf(mgpu__dist_doing[slot], sizeof mgpu__dist_doing[slot], "between collectives");
    mgpu__dist_doing_slot = slot;
}
/* mpirun stops the other ranks with SIGTERM when one dies: each says
   where it was, in one line (write(2) alone: this is a signal handler). */
static void mgpu__dist_on_signal(int sig) {
    (void)sig;
    if (mgpu__dist_quiet) _exit(1);
    char line[384];
    size_t n = 0;
    const char *parts[] = {"mgpu: error: ", mgpu__error_prefix, "stopped by SIGTERM ",
                           mgpu__dist_doing[mgpu__dist_doing_slot],
                           " (mpirun stops every rank when one ends: its message names the rank)"};
    /* each part at most its slot's size: another thread may be rewriting
       the other slot, and a slot being rewritten may lack its NUL */
    for (size_t k = 0; k < sizeof parts / sizeof *parts; k++)
        for (size_t i = 0; i < sizeof mgpu__dist_doing[0] && parts[k][i] && n < sizeof line - 1; i++)
            line[n++] = parts[k][i];
    line[n++] = '\n';
    if (write(2, line, n) < 0) _exit(1);
    _exit(1);
}

#define MGPU__MPI_CHECK(call)                                                          \
    do {                                                                               \
        int mgpu__mpi_rc = (call);                                                     \
        if (mgpu__mpi_rc != MPI_SUCCESS) {                                             \
            char mgpu__mpi_text[MPI_MAX_ERROR_STRING];                                 \
            int mgpu__mpi_len = 0;                                                     \
            MPI_Error_string(mgpu__mpi_rc, mgpu__mpi_text, &mgpu__mpi_len);            \
            mgpu_fatal_at(__FILE__, __LINE__, "%s: %s", #call, mgpu__mpi_text);        \
        }                                                                              \
    } while (0)

/* ------------------------------------------------- watching the other ranks
   A rank that waits for the others does not wait blindly. Each process
   runs a watcher thread that answers, on a communicator of its own, what
   its process is doing: how far it has got (mgpu__progress, a count of the
   operations it has launched and run) and where it waits, if it does. A
   rank that has waited half the timeout asks the ranks it waits for, and
   again every half timeout. It goes on waiting while each of them has
   reached the same point or still makes progress; once it has waited the
   whole timeout, a rank that does not answer (stopped or dead), or that
   answers but has made no progress for the timeout (hung, or waiting in
   another collective: the ranks are out of step), is named, and the job
   stops. The lowest rank that sees it says so; a rank that knows a lower
   one waiting too leaves the saying to it. */
typedef enum { MGPU__ON_HOST, MGPU__ON_DEVICES, MGPU__POINT_TO_POINT } mgpu__wait_channel;
typedef struct mgpu__wait_point {
    uint64_t group;  /* the group's id */
    int channel;     /* an mgpu__wait_channel: whose sequence numbers it */
    int peer;        /* a send or a receive: the other rank, in the group */
    long number;     /* a collective: its number in its channel's sequence */
} mgpu__wait_point;

/* Where this process waits now: a slot a waiting thread (the caller's,
   for the host's collectives, and a communication queue's). */
#define MGPU__MAX_WAITS 8
static struct {
    pthread_mutex_t mutex;
    int used[MGPU__MAX_WAITS];
    mgpu__wait_point point[MGPU__MAX_WAITS];
    char what[MGPU__MAX_WAITS][96];
} mgpu__waits = {PTHREAD_MUTEX_INITIALIZER, {0}, {{0, 0, 0, 0}}, {""}};

/* What a watcher answers. */
typedef struct mgpu__watch_reply {
    long progress;
    int nwaits;
    mgpu__wait_point waits[MGPU__MAX_WAITS];
    char doing[96]; /* its first wait, described ("" when it waits in none) */
} mgpu__watch_reply;

/* The job's watchers: their communicator, and every rank's process. */
enum { MGPU__TAG_QUERY = 1, MGPU__TAG_REPLIES = 2 }; /* (a look's replies: a tag of their own, from 2 on) */
static struct {
    MPI_Comm comm;
    int rank, size, running;
    int *pids;
    char (*hosts)[64];
    pthread_t thread;
    int stop;
    int looks; /* the looks this process has made: each replies on a tag of its own */
} mgpu__watch;

static int mgpu__waits_enter(const mgpu__wait_point *at, const char *what) {
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&mgpu__waits.mutex));
    int slot = 0;
    while (slot < MGPU__MAX_WAITS && mgpu__waits.used[slot]) slot++;
    if (slot < MGPU__MAX_WAITS) { /* (more waits at once than slots: the extra ones go unreported) */
        mgpu__waits.used[slot] = 1;
        mgpu__waits.point[slot] = *at;
        snprintf(mgpu__waits.what[slot], sizeof mgpu__waits.what[slot], "%s", what);
    }
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__waits.mutex));
    return slot;
}
static void mgpu__waits_leave(int slot) {
    if (slot >= MGPU__MAX_WAITS) return;
    MGPU__PTHREAD_CHECK(pthread_mutex_lock(&mgpu__waits.mutex));
    mgpu__waits.used[slot] = 0;
    MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__waits.mutex));
}

static void *mgpu__watcher(void *arg) {
    (void)arg;
    struct timespec pause = {0, 10000000};
    while (!__atomic_load_n(&mgpu__watch.stop, __ATOMIC_ACQUIRE)) {
        int found = 0, tag = 0;
        MPI_Message message;
        MGPU__MPI_CHECK(MPI_Improbe(MPI_ANY_SOURCE, MGPU__TAG_QUERY, mgpu__watch.comm, &found, &message,
                                    MPI_STATUS_IGNORE));
        if (!found) {
            nanosleep(&pause, NULL);
            continue;
        }
        MPI_Status status;
        MGPU__MPI_CHECK(MPI_Mrecv(&tag, 1, MPI_INT, &message, &status));
        mgpu__watch_reply reply;
        memset(&reply, 0, sizeof reply);
        reply.progress = __atomic_load_n(&mgpu__progress, __ATOMIC_RELAXED);
        MGPU__PTHREAD_CHECK(pthread_mutex_lock(&mgpu__waits.mutex));
        for (int k = 0; k < MGPU__MAX_WAITS; k++) {
            if (!mgpu__waits.used[k]) continue;
            if (!reply.nwaits) memcpy(reply.doing, mgpu__waits.what[k], sizeof reply.doing); /* (both 96 bytes) */
            reply.waits[reply.nwaits++] = mgpu__waits.point[k];
        }
        MGPU__PTHREAD_CHECK(pthread_mutex_unlock(&mgpu__waits.mutex));
        /* (a small message goes out at once, eagerly: this send does not
           wait for the asker, who may be gone) */
        MGPU__MPI_CHECK(MPI_Send(&reply, (int)sizeof reply, MPI_BYTE, status.MPI_SOURCE, tag, mgpu__watch.comm));
    }
    return NULL;
}

/* What a waiting rank has seen of another. */
typedef struct mgpu__rank_seen {
    double answered_at;   /* when it last answered (0: never); a look it does not
                             answer within its window keeps the answer before */
    long progress;
    double progress_since; /* when its progress last moved, as far as the looks saw */
    double reached_at;     /* when a look first saw it at the wait's point (0: not yet) */
    mgpu__watch_reply reply;
} mgpu__rank_seen;

/* The ranks of g that a wait at `at` needs: all others, or a send's or receive's peer. */
static int mgpu__waits_for(const mgpu_group *g, const mgpu__wait_point *at, int r) {
    return r != g->rank && (at->channel != MGPU__POINT_TO_POINT || r == at->peer);
}
/* Has rank r (its reply) reached the point `at` of rank me? */
static int mgpu__reached(const mgpu__watch_reply *reply, const mgpu__wait_point *at, int me) {
    for (int k = 0; k < reply->nwaits; k++) {
        const mgpu__wait_point *w = &reply->waits[k];
        if (w->group != at->group || w->channel != at->channel) continue;
        if (at->channel == MGPU__POINT_TO_POINT ? w->peer == me : w->number >= at->number) return 1;
    }
    return 0;
}

/* What a wait waits for: MPI's requests, or (done set) what done(arg)
   says has come, such as an NCCL collective on a GPU. `stuck` says what
   hangs when it has not come a whole timeout after every rank reached
   it (NULL: nothing does, as MPI's transfers go on while they answer). */
typedef struct mgpu__awaited {
    MPI_Request *requests;
    int n;
    int (*done)(void *arg);
    void *arg;
    const char *stuck;
} mgpu__awaited;
static int mgpu__awaited_done(const mgpu__awaited *w) {
    if (w->done) return w->done(w->arg);
    int done = 0;
    MGPU__MPI_CHECK(MPI_Testall(w->n, w->requests, &done, MPI_STATUSES_IGNORE));
    return done;
}

/* Asks the ranks the wait needs what they do: each answer that comes
   within 2 s replaces the one before, and a rank that gives none keeps
   its last (mgpu__watch_judge counts it as not answering once it has
   been silent a whole timeout). Returns 1 if what the wait awaits came
   meanwhile: then nothing was judged. */
static int mgpu__watch_look(mgpu_group *g, const mgpu__wait_point *at, mgpu__rank_seen *seen,
                            const mgpu__awaited *awaited) {
    int tag = MGPU__TAG_REPLIES + mgpu__watch.looks++ % 30000;
    MPI_Request *asked = (MPI_Request *)mgpu__xmalloc(sizeof *asked * (size_t)g->size);
    mgpu__watch_reply *replies = (mgpu__watch_reply *)mgpu__xmalloc(sizeof *replies * (size_t)g->size);
    for (int r = 0; r < g->size; r++) {
        asked[r] = MPI_REQUEST_NULL;
        if (!mgpu__waits_for(g, at, r)) continue;
        int to = g->world_ranks[r];
        MGPU__MPI_CHECK(MPI_Irecv(&replies[r], (int)sizeof replies[r], MPI_BYTE, to, tag, mgpu__watch.comm,
                                  &asked[r]));
        MGPU__MPI_CHECK(MPI_Send(&tag, 1, MPI_INT, to, MGPU__TAG_QUERY, mgpu__watch.comm));
    }
    int completed = 0, all = 0;
    struct timespec pause = {0, 1000000};
    for (double start = mgpu_now(); !completed && !all && mgpu_now() - start < 2.0;) {
        completed = mgpu__awaited_done(awaited);
        all = 1;
        for (int r = 0; r < g->size; r++) { /* (one at a time: MPI_Testall frees none until all are done) */
            int answered = 1;
            if (asked[r] != MPI_REQUEST_NULL) MGPU__MPI_CHECK(MPI_Test(&asked[r], &answered, MPI_STATUS_IGNORE));
            all &= answered;
        }
        nanosleep(&pause, NULL);
    }
    double now = mgpu_now();
    for (int r = 0; r < g->size; r++) {
        if (!mgpu__waits_for(g, at, r)) continue;
        int answered = asked[r] == MPI_REQUEST_NULL;
        if (!answered) { /* (a later answer comes on a tag no one listens to any more) */
            MPI_Status status;
            int cancelled = 0;
            MGPU__MPI_CHECK(MPI_Cancel(&asked[r]));
            MGPU__MPI_CHECK(MPI_Wait(&asked[r], &status));
            MGPU__MPI_CHECK(MPI_Test_cancelled(&status, &cancelled));
            answered = !cancelled; /* (it came between the last test and the cancel) */
        }
        if (!answered) continue;
        mgpu__rank_seen *s = &seen[r];
        if (s->answered_at == 0 || replies[r].progress != s->progress) {
            s->progress = replies[r].progress;
            s->progress_since = now;
        }
        s->reply = replies[r];
        s->answered_at = now;
        if (!s->reached_at && mgpu__reached(&s->reply, at, g->rank)) s->reached_at = now;
    }
    free(replies);
    free(asked);
    return completed;
}

/* After a whole timeout: stops the job if a rank the wait needs does not
   answer, or makes no progress without having reached it; or, where the
   wait says what is stuck then, if every rank has been there a timeout. */
static void mgpu__watch_judge(mgpu_group *g, const mgpu__wait_point *at, const mgpu__rank_seen *seen,
                              const char *what, const char *stuck) {
    char line[1536] = "";
    size_t used = 0;
    int lower_waiting = 0, all_there = 1;
    double now = mgpu_now();
    for (int r = 0; r < g->size; r++) {
        if (!mgpu__waits_for(g, at, r)) continue;
        const mgpu__rank_seen *s = &seen[r];
        /* answering: within the last timeout (one late answer on a busy
           machine is no sign of a stopped rank) */
        int answering = s->answered_at > 0 && now - s->answered_at < g->timeout;
        if (answering && r < g->rank && s->reply.nwaits) lower_waiting = 1;
        all_there &= answering && s->reached_at > 0 && now - s->reached_at >= g->timeout;
        if (answering && (mgpu__reached(&s->reply, at, g->rank) || now - s->progress_since < g->timeout))
            continue;
        char why[160];
        if (!answering)
            snprintf(why, sizeof why, "it does not answer (stopped, or dead)");
        else if (s->reply.nwaits)
            snprintf(why, sizeof why, "it waits in %s", s->reply.doing);
        else
            snprintf(why, sizeof why, "it has made no progress for %.0f s", now - s->progress_since);
        int w = g->world_ranks[r];
        used += (size_t)snprintf(line + used, used < sizeof line ? sizeof line - used : 0,
                                 "%srank %d (host %s, pid %d) did not %s %s within %.0f s (MGPU_DIST_TIMEOUT): %s",
                                 used ? "; " : "", r, mgpu__watch.hosts[w], mgpu__watch.pids[w],
                                 at->channel == MGPU__POINT_TO_POINT ? "take part in" : "reach", what, g->timeout, why);
    }
    if (!used && stuck && all_there)
        used = (size_t)snprintf(line, sizeof line, "%s did not end within %.0f s of every rank's reaching it "
                                "(MGPU_DIST_TIMEOUT): %s", what, g->timeout, stuck);
    if (!used) return;
    if (lower_waiting) { /* (it will say it; if the launcher has not stopped us after a timeout, we do) */
        mgpu__dist_quiet = 1;
        struct timespec wait = {(time_t)g->timeout + 1, 0};
        while (nanosleep(&wait, &wait) != 0 && errno == EINTR) {}
        mgpu__dist_quiet = 0;
    }
    mgpu__error_is_mine_alone = 1;
    mgpu_fatal("%s", line);
}

/* Waits for what group g awaits at point `at` (`what` describes it),
   polling so that a rank that never comes is an error, not a hang
   (above). The poll yields, then sleeps longer and longer (20 us to
   10 ms): ranks that share cores must not spin on them while another
   rank still computes. */
static void mgpu__dist_wait_for(mgpu_group *g, const mgpu__wait_point *at, const mgpu__awaited *awaited,
                                const char *what) {
    int slot = mgpu__waits_enter(at, what);
    mgpu__rank_seen *seen = NULL;
    double start = mgpu_now(), next_look = start + g->timeout / 2;
    long pause_ns = 20000;
    for (long polls = 0;; polls++) {
        if (mgpu__awaited_done(awaited)) break;
        if (mgpu_now() >= next_look) {
            if (!seen) seen = (mgpu__rank_seen *)mgpu__xcalloc((size_t)g->size, sizeof *seen);
            if (mgpu__watch_look(g, at, seen, awaited)) break;
            if (mgpu_now() - start >= g->timeout) mgpu__watch_judge(g, at, seen, what, awaited->stuck);
            next_look = mgpu_now() + g->timeout / 2;
        }
        if (polls < 64) {
            sched_yield();
            continue;
        }
        struct timespec pause = {0, pause_ns};
        nanosleep(&pause, NULL);
        if (polls % 256 == 0 && pause_ns < 10000000) pause_ns *= 2;
    }
    free(seen);
    mgpu__waits_leave(slot);
}
/* The same for MPI requests. */
static void mgpu__dist_wait(mgpu_group *g, const mgpu__wait_point *at, MPI_Request *requests, int n,
                            const char *what) {
    mgpu__awaited awaited = {requests, n, NULL, NULL, NULL};
    mgpu__dist_wait_for(g, at, &awaited, what);
}

/* The points of a group's collectives: a device collective's, a send's or
   a receive's, and the next host collective's (which numbers it). */
static mgpu__wait_point mgpu__coll_point(const mgpu__coll *c) {
    mgpu__wait_point at = {c->group->id, MGPU__ON_DEVICES, 0, c->sequence};
    if (c->kind == MGPU__SEND || c->kind == MGPU__RECV) {
        at.channel = MGPU__POINT_TO_POINT;
        at.peer = c->peer;
    }
    return at;
}
static void mgpu__coll_wait(const mgpu__coll *c, MPI_Request *request, const char *what) {
    mgpu__wait_point at = mgpu__coll_point(c);
    mgpu__dist_wait(c->group, &at, request, 1, what);
}
static mgpu__wait_point mgpu__host_point(mgpu_group *g) {
    mgpu__wait_point at = {g->id, MGPU__ON_HOST, 0, ++g->host_sequence};
    return at;
}

/* Before a collective the ranks compare what each is about to run. */
static void mgpu__coll_agree(const mgpu__coll *c) {
    mgpu_group *g = c->group;
    long long mine[5] = {c->sequence, c->kind, (long long)c->count, c->peer, c->op};
    long long *all = (long long *)mgpu__xmalloc(sizeof mine * (size_t)g->size);
    char what[128];
    mgpu__coll_describe(c, what, sizeof what);
    MPI_Request request;
    MGPU__MPI_CHECK(MPI_Iallgather(mine, 5, MPI_LONG_LONG, all, 5, MPI_LONG_LONG, g->comm, &request));
    mgpu__coll_wait(c, &request, what);
    for (int r = 0; r < g->size; r++) {
        if (memcmp(all + 5 * r, all, sizeof mine) == 0) continue;
        mgpu__coll calls[2] = {*c, *c}; /* rank 0's, rank r's */
        for (int k = 0; k < 2; k++) {
            const long long *w = all + 5 * (k ? r : 0);
            calls[k].sequence = w[0];
            calls[k].kind = (mgpu__coll_kind)w[1];
            calls[k].count = (size_t)w[2];
            calls[k].peer = (int)w[3];
            calls[k].op = (mgpu_reduce_op)w[4];
        }
        char a[160], b[160];
        mgpu__coll_describe(&calls[0], a, sizeof a);
        mgpu__coll_describe(&calls[1], b, sizeof b);
        free(all);
        mgpu_group_fatal(g, "the ranks are out of step: rank 0 called %s, rank %d called %s "
                             "(every rank must call the same collectives in the same order)", a, r, b);
    }
    free(all);
}

/* The received chunks' room, grown as needed (on the queue that runs the collective). */
static float *mgpu__group_received(mgpu_group *g, size_t floats) {
    if (floats > g->received_floats) {
        g->received = (float *)mgpu__xrealloc(g->received, floats * sizeof(float));
        g->received_floats = floats;
    }
    return g->received;
}

/* out[i] = the sum over ranks, in rank order, of their chunks: received
   holds `size` chunks of len floats, rank 0's first. */
static void mgpu__sum_chunks(float *out, const float *received, size_t len, int size, mgpu_reduce_op op) {
    float scale = 1.0f / (float)size;
    for (size_t i = 0; i < len; i++) {
        float s = received[i];
        for (int r = 1; r < size; r++) s += received[(size_t)r * len + i];
        out[i] = op == MGPU_MEAN ? s * scale : s;
    }
}

/* The allreduce: a reduce-scatter (rank r gets chunk r of every rank's
   vector and adds them in rank order), then an all-gather of the sums.
   Chunk c is [count c / size, count (c+1) / size). */
static void mgpu__mpi_allreduce(const mgpu__coll *c, const char *what) {
    mgpu_group *g = c->group;
    int size = g->size, me = g->rank;
    int *counts = (int *)mgpu__xmalloc(4 * sizeof(int) * (size_t)size);
    int *starts = counts + size, *mine = counts + 2 * size, *mine_at = counts + 3 * size;
    for (int r = 0; r < size; r++) {
        starts[r] = (int)(c->count * (size_t)r / (size_t)size);
        counts[r] = (int)(c->count * (size_t)(r + 1) / (size_t)size) - starts[r];
    }
    for (int r = 0; r < size; r++) {
        mine[r] = counts[me];
        mine_at[r] = r * counts[me];
    }
    float *received = mgpu__group_received(g, (size_t)counts[me] * (size_t)size);
    MPI_Request request;
    MGPU__MPI_CHECK(MPI_Ialltoallv(c->out, counts, starts, MPI_FLOAT, received, mine, mine_at, MPI_FLOAT,
                                   g->comm, &request));
    mgpu__coll_wait(c, &request, what);
    mgpu__sum_chunks(c->out + starts[me], received, (size_t)counts[me], size, c->op);
    MGPU__MPI_CHECK(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, c->out, counts, starts, MPI_FLOAT,
                                    g->comm, &request));
    mgpu__coll_wait(c, &request, what);
    free(counts);
}

/* in holds `size` chunks of count / size floats; rank r gets the sum of every rank's chunk r. */
static void mgpu__mpi_reduce_scatter(const mgpu__coll *c, const char *what) {
    mgpu_group *g = c->group;
    int len = (int)(c->count / (size_t)g->size);
    float *received = mgpu__group_received(g, c->count);
    MPI_Request request;
    MGPU__MPI_CHECK(MPI_Ialltoall(c->in, len, MPI_FLOAT, received, len, MPI_FLOAT, g->comm, &request));
    mgpu__coll_wait(c, &request, what);
    mgpu__sum_chunks(c->out, received, (size_t)len, g->size, c->op);
}

/* Runs a collective on host memory: the agreement, then MPI. */
static void mgpu__coll_run(const mgpu__coll *c) {
    mgpu_group *g = c->group;
    char what[128];
    mgpu__coll_describe(c, what, sizeof what);
    mgpu__dist_set_doing(what);
    if (c->kind != MGPU__SEND && c->kind != MGPU__RECV) {
        /* The agreement ends when the last rank has come: until then this
           rank was waiting for the others, not moving data */
        mgpu__coll_agree(c);
        mgpu__trace_split("waiting for the other ranks");
    }
    MPI_Request request;
    int n = (int)c->count;
    switch (c->kind) {
    case MGPU__ALLREDUCE: mgpu__mpi_allreduce(c, what); break;
    case MGPU__REDUCE_SCATTER: mgpu__mpi_reduce_scatter(c, what); break;
    case MGPU__BROADCAST:
        MGPU__MPI_CHECK(MPI_Ibcast(c->out, n, MPI_FLOAT, c->peer, g->comm, &request));
        mgpu__coll_wait(c, &request, what);
        break;
    case MGPU__ALL_GATHER:
        MGPU__MPI_CHECK(MPI_Iallgather(c->in, n, MPI_FLOAT, c->out, n, MPI_FLOAT, g->comm, &request));
        mgpu__coll_wait(c, &request, what);
        break;
    case MGPU__SEND:
        MGPU__MPI_CHECK(MPI_Isend(c->in, n, MPI_FLOAT, c->peer, 0, g->comm, &request));
        mgpu__coll_wait(c, &request, what);
        break;
    case MGPU__RECV:
        MGPU__MPI_CHECK(MPI_Irecv(c->out, n, MPI_FLOAT, c->peer, 0, g->comm, &request));
        mgpu__coll_wait(c, &request, what);
        break;
    }
    mgpu__dist_set_doing(NULL);
}

static void mgpu__coll_task(const void *args, const mgpu__exec *ex) {
    (void)ex;
    mgpu__coll_run((const mgpu__coll *)args);
}

/* The blocking calls that MPI gives no way to bound otherwise (its start,
   the making of communicators, its end) run under an alarm: a rank that
   does not come within the timeout ends the process with one line (rank
   0's: the others wait, silent, for the launcher, as mgpu__vfatal's do).
   Only write(2) and nanosleep: this is a signal handler. */
static char mgpu__guard_line[320];
static size_t mgpu__guard_length;
static int mgpu__guard_rank;
static void mgpu__guard_on_alarm(int sig) {
    (void)sig;
    if (mgpu__guard_rank > 0) {
        mgpu__dist_quiet = 1;
        struct timespec wait = {MGPU__ALIKE_ERROR_WAIT, 0};
        nanosleep(&wait, NULL);
    }
    if (write(2, mgpu__guard_line, mgpu__guard_length) < 0) _exit(1);
    _exit(1);
}
/* Starts the alarm for `what`, or stops it (what NULL). */
static void mgpu__dist_guard(const char *what, double timeout) {
    if (!what) {
        alarm(0);
        return;
    }
    mgpu__guard_rank = mgpu__launcher_rank();
    if (!mgpu__error_prefix[0] && mgpu__guard_rank >= 0) mgpu__error_prefix_set(mgpu__guard_rank);
    int n = snprintf(mgpu__guard_line, sizeof mgpu__guard_line,
                     "mgpu: error: %s%s: waited %.0f s for the other ranks (MGPU_DIST_TIMEOUT): a rank is stopped, "
                     "dead, or did not call it\n", mgpu__error_prefix, what, timeout);
    mgpu__guard_length = n < (int)sizeof mgpu__guard_line ? (size_t)n : sizeof mgpu__guard_line - 1;
    struct sigaction on_alarm;
    memset(&on_alarm, 0, sizeof on_alarm);
    on_alarm.sa_handler = mgpu__guard_on_alarm;
    MGPU_REQUIRE(sigaction(SIGALRM, &on_alarm, NULL) == 0, "sigaction: %s", strerror(errno));
    alarm((unsigned)ceil(timeout));
}

/* The job's watchers (above): every rank's process and host, then the thread. */
static void mgpu__watch_start(double timeout) {
    mgpu__dist_guard("start-up", timeout);
    MGPU__MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &mgpu__watch.comm));
    MGPU__MPI_CHECK(MPI_Comm_set_errhandler(mgpu__watch.comm, MPI_ERRORS_RETURN));
    MGPU__MPI_CHECK(MPI_Comm_rank(mgpu__watch.comm, &mgpu__watch.rank));
    MGPU__MPI_CHECK(MPI_Comm_size(mgpu__watch.comm, &mgpu__watch.size));
    size_t size = (size_t)mgpu__watch.size;
    mgpu__watch.pids = (int *)mgpu__xmalloc(sizeof(int) * size);
    mgpu__watch.hosts = (char (*)[64])mgpu__xcalloc(size, sizeof *mgpu__watch.hosts);
    int pid = (int)getpid();
    char host[64] = "";
    if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "unknown");
    MGPU__MPI_CHECK(MPI_Allgather(&pid, 1, MPI_INT, mgpu__watch.pids, 1, MPI_INT, mgpu__watch.comm));
    MGPU__MPI_CHECK(MPI_Allgather(host, sizeof host, MPI_CHAR, mgpu__watch.hosts, sizeof host, MPI_CHAR,
                                  mgpu__watch.comm));
    mgpu__dist_guard(NULL, 0);
    MGPU__PTHREAD_CHECK(pthread_create(&mgpu__watch.thread, NULL, mgpu__watcher, NULL));
    mgpu__watch.running = 1;
}
static void mgpu__watch_stop(void) {
    if (!mgpu__watch.running) return;
    __atomic_store_n(&mgpu__watch.stop, 1, __ATOMIC_RELEASE);
    MGPU__PTHREAD_CHECK(pthread_join(mgpu__watch.thread, NULL));
    mgpu__watch.running = 0;
    MGPU__MPI_CHECK(MPI_Comm_free(&mgpu__watch.comm));
    free(mgpu__watch.pids);
    free(mgpu__watch.hosts);
}

/* A group over comm, called id: its own two communicators, ranks and machine. */
static mgpu_group *mgpu__group_over(MPI_Comm comm, uint64_t id, double timeout) {
    mgpu_group *g = (mgpu_group *)mgpu__xcalloc(1, sizeof *g);
    g->id = id;
    g->timeout = timeout;
    mgpu__dist_guard("making a group", timeout);
    MGPU__MPI_CHECK(MPI_Comm_dup(comm, &g->comm));
    MGPU__MPI_CHECK(MPI_Comm_dup(comm, &g->host_comm));
    MGPU__MPI_CHECK(MPI_Comm_set_errhandler(g->comm, MPI_ERRORS_RETURN));
    MGPU__MPI_CHECK(MPI_Comm_set_errhandler(g->host_comm, MPI_ERRORS_RETURN));
    MGPU__MPI_CHECK(MPI_Comm_rank(comm, &g->rank));
    MGPU__MPI_CHECK(MPI_Comm_size(comm, &g->size));
    MPI_Comm local;
    MGPU__MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, g->rank, MPI_INFO_NULL, &local));
    MGPU__MPI_CHECK(MPI_Comm_rank(local, &g->local_rank));
    MGPU__MPI_CHECK(MPI_Comm_size(local, &g->local_size));
    MGPU__MPI_CHECK(MPI_Comm_free(&local));
    mgpu__dist_guard(NULL, 0);
    /* each rank's number in the job, whose watcher answers for it */
    MPI_Group mine, everyone;
    MGPU__MPI_CHECK(MPI_Comm_group(comm, &mine));
    MGPU__MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &everyone));
    int *ranks = (int *)mgpu__xmalloc(sizeof(int) * (size_t)g->size);
    g->world_ranks = (int *)mgpu__xmalloc(sizeof(int) * (size_t)g->size);
    for (int r = 0; r < g->size; r++) ranks[r] = r;
    MGPU__MPI_CHECK(MPI_Group_translate_ranks(mine, g->size, ranks, everyone, g->world_ranks));
    free(ranks);
    MGPU__MPI_CHECK(MPI_Group_free(&mine));
    MGPU__MPI_CHECK(MPI_Group_free(&everyone));
    char name[MPI_MAX_PROCESSOR_NAME + 1] = "";
    int length = 0;
    MGPU__MPI_CHECK(MPI_Get_processor_name(name, &length));
    memcpy(g->host, name, (size_t)length < sizeof g->host - 1 ? (size_t)length : sizeof g->host - 1);
    return g;
}
#endif /* MGPU_MPI */

/* A group of one: this process alone. */
static mgpu_group *mgpu__group_alone(void) {
    mgpu_group *g = (mgpu_group *)mgpu__xcalloc(1, sizeof *g);
    g->size = g->local_size = 1;
    if (gethostname(g->host, sizeof g->host - 1) != 0) snprintf(g->host, sizeof g->host, "localhost");
    return g;
}

static double mgpu__dist_timeout(void) {
    const char *v = getenv("MGPU_DIST_TIMEOUT");
    if (!v || !*v) return 120.0;
    char *end;
    double t = strtod(v, &end);
    MGPU_REQUIRE(*end == 0 && t > 0 && t <= 1e6, "MGPU_DIST_TIMEOUT=%s: want a number of seconds above 0, "
                 "up to 1000000", v);
    return t;
}

MGPU_DEF mgpu_group *mgpu_dist_init(int *argc, char ***argv) {
    mgpu__init();
    int launched = mgpu__launcher_size();
#if MGPU_MPI
    if (launched > 1) {
        double timeout = mgpu__dist_timeout();
        int provided = 0;
        /* (MPI_Init sizes its shared-memory files: past the file-size limit
           that raises SIGXFSZ, a death without a word, unless ignored as
           the files written whole ignore it; then MPI says what failed) */
        signal(SIGXFSZ, SIG_IGN);
        mgpu__dist_guard("MPI_Init", timeout);
        MGPU__MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided));
        mgpu__dist_guard(NULL, 0);
        MGPU_REQUIRE(provided == MPI_THREAD_MULTIPLE,
                     "mgpu_dist_init: this MPI does not allow calls from several threads "
                     "(MPI_THREAD_MULTIPLE), which the devices' queues make");
        mgpu__watch_start(timeout);
        mgpu_group *g = mgpu__group_over(MPI_COMM_WORLD, MGPU__FNV_OFFSET, timeout);
        mgpu__error_prefix_set(g->rank);
        mgpu__dist_set_doing(NULL);
        struct sigaction on_term;
        memset(&on_term, 0, sizeof on_term);
        on_term.sa_handler = mgpu__dist_on_signal;
        MGPU_REQUIRE(sigaction(SIGTERM, &on_term, NULL) == 0, "mgpu_dist_init: sigaction: %s", strerror(errno));
        return g;
    }
#else
    (void)argc;
    (void)argv;
    MGPU_REQUIRE(launched <= 1, "a launcher started %d copies of this program, but it was built without MPI, "
                 "so each would train alone: build it where mpi.h is found (apt-get install libopenmpi-dev)",
                 launched);
#endif
    mgpu_group *g = mgpu__group_alone();
    g->timeout = mgpu__dist_timeout();
    return g;
}

MGPU_DEF void mgpu_group_free(mgpu_group *g) {
    if (!g) return;
    mgpu_synchronize_all(); /* (the communication queues may still run its collectives) */
#if MGPU__NCCL_BETWEEN_PROCESSES
    mgpu__nccl_end(g);
#endif
#if MGPU_MPI
    if (g->size > 1) {
        MGPU__MPI_CHECK(MPI_Comm_free(&g->comm));
        MGPU__MPI_CHECK(MPI_Comm_free(&g->host_comm));
    }
#endif
    free(g->world_ranks);
    mgpu_free(g->staging);
    free(g->received);
    free(g);
}

MGPU_DEF void mgpu_dist_finalize(mgpu_group *world) {
    if (!world) return;
    int distributed = world->size > 1;
    double timeout = world->timeout;
    /* (a barrier that names a rank that does not come: MPI_Finalize would wait for it without a word) */
    if (distributed) mgpu_group_barrier(world);
    mgpu_synchronize_all();
    mgpu_group_free(world);
#if MGPU_MPI
    if (distributed) {
        mgpu__watch_stop();
        mgpu__dist_guard("MPI_Finalize", timeout);
        MGPU__MPI_CHECK(MPI_Finalize());
        mgpu__dist_guard(NULL, 0);
    }
#else
    (void)distributed;
    (void)timeout;
#endif
}

MGPU_DEF int mgpu_group_rank(const mgpu_group *g) { return g->rank; }
MGPU_DEF int mgpu_group_size(const mgpu_group *g) { return g->size; }
MGPU_DEF int mgpu_group_local_rank(const mgpu_group *g) { return g->local_rank; }
MGPU_DEF int mgpu_group_local_size(const mgpu_group *g) { return g->local_size; }
MGPU_DEF const char *mgpu_group_host(const mgpu_group *g) { return g->host; }

MGPU_DEF int mgpu_group_devices(mgpu_group *g, int use_gpu, int n, mgpu_device **out) {
    MGPU_REQUIRE(n >= 1 && n <= MGPU_MAX_DEVICES, "mgpu_group_devices: %d devices; between 1 and %d", n,
                 MGPU_MAX_DEVICES);
    int gpus = use_gpu ? mgpu_num_gpus() : 0;
    for (int i = 0; i < n; i++)
        out[i] = gpus > 0 ? mgpu__device_get((g->local_rank * n + i) % gpus, i / gpus) : mgpu__device_get(-1, i);
    if (gpus == 0) mgpu__share_cpu_cores(g->local_size * n);
    return n;
}
MGPU_DEF mgpu_device *mgpu_group_device(mgpu_group *g, int use_gpu) {
    mgpu_device *dev;
    mgpu_group_devices(g, use_gpu, 1, &dev);
    return dev;
}

MGPU_DEF mgpu_group *mgpu_group_first(mgpu_group *g, int n) {
    MGPU_REQUIRE(n >= 1 && n <= g->size, "mgpu_group_first: %d ranks of a group of %d", n, g->size);
    mgpu_group *sub = NULL;
    long split = ++g->splits;
#if MGPU_MPI
    if (g->size > 1) {
        /* (every rank is here, or one is named, before the split, which cannot be bounded) */
        mgpu_group_barrier(g);
        MPI_Comm part;
        mgpu__dist_guard("mgpu_group_first", g->timeout);
        MGPU__MPI_CHECK(MPI_Comm_split(g->host_comm, g->rank < n ? 0 : MPI_UNDEFINED, g->rank, &part));
        mgpu__dist_guard(NULL, 0);
        if (part == MPI_COMM_NULL) return NULL;
        sub = n > 1 ? mgpu__group_over(part, mgpu__fnv1a(g->id, &split, sizeof split), g->timeout) : NULL;
        MGPU__MPI_CHECK(MPI_Comm_free(&part));
    }
#else
    (void)split;
#endif
    if (!sub) sub = mgpu__group_alone(); /* (n is 1) */
    sub->timeout = g->timeout;
    return sub;
}

MGPU_DEF const char *mgpu_group_path(const mgpu_group *g, const mgpu_device *dev) {
    if (g->size == 1) return "none";
#if MGPU__NCCL_BETWEEN_PROCESSES
    if (g->nccl && dev->gpu >= 0) return "nccl";
#endif
    return dev->gpu >= 0 ? "mpi via host" : "mpi";
}

#if MGPU_MPI
static void mgpu__group_all_gather_bytes(mgpu_group *g, const void *mine, size_t bytes, void *all, const char *op);
static void mgpu__host_wait(mgpu_group *g, MPI_Request *request, const char *op);

/* ------------------------------------------- NCCL between the ranks' GPUs
   A group whose ranks each have a GPU of their own moves its tensors with
   NCCL, GPU to GPU (MGPU_DIST_BACKEND=nccl, the default), as PyTorch's
   DDP does. Its first collective on a GPU chooses: the ranks all-gather
   their GPUs' UUIDs and NCCL's versions, and where two ranks share a GPU
   (NCCL refuses that) or a rank's NCCL is older than 2.14, rank 0 says
   why in one line and the group goes through the host over MPI, as with
   MGPU_DIST_BACKEND=mpi. Else rank 0's ncclUniqueId goes to every rank
   over MPI, and each starts its communicator without blocking
   (ncclCommInitRankConfig with config.blocking = 0), polling
   ncclCommGetAsyncError until it is no longer ncclInProgress. NCCL itself
   has no timeout: a rank that never comes would leave the others in
   NCCL for ever. So every wait for NCCL, its start and each collective,
   is a wait of the group's watch (mgpu__dist_wait_for): it polls
   ncclCommGetAsyncError and the collective's event, and a rank that
   stops or dies is named within MGPU_DIST_TIMEOUT, as at MPI's
   collectives. If any rank's start failed, every rank aborts its
   communicator and the group goes through the host, said in one line.
   A fatal error aborts the live communicators on the way out
   (ncclCommAbort: NCCL's kernels may be spinning on the GPU, waiting for
   a peer that is gone); mgpu_group_free finalizes and destroys them. */
#if MGPU__NCCL_BETWEEN_PROCESSES
#define MGPU__NCCL_LIVE 64
static ncclComm_t mgpu__nccl_live[MGPU__NCCL_LIVE]; /* the groups' communicators now */
static void mgpu__nccl_abort_live(void) {
    for (int i = 0; i < MGPU__NCCL_LIVE; i++) {
        ncclComm_t comm = __atomic_exchange_n(&mgpu__nccl_live[i], NULL, __ATOMIC_SEQ_CST);
        if (comm) ncclCommAbort(comm); /* (on the way out: its result changes nothing) */
    }
}
static void mgpu__nccl_live_set(ncclComm_t comm, ncclComm_t to) {
    for (int i = 0; i < MGPU__NCCL_LIVE; i++) {
        ncclComm_t expected = comm;
        if (__atomic_compare_exchange_n(&mgpu__nccl_live[i], &expected, to, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
            mgpu__on_fatal = mgpu__nccl_abort_live;
            return;
        }
    }
    MGPU_REQUIRE(to == NULL, "more than %d groups use NCCL at once", MGPU__NCCL_LIVE);
}

/* NCCL that every rank has reached but that does not end hangs (a GPU
   or NCCL's network): the watch says so (mgpu__watch_judge). */
#define MGPU__NCCL_STUCK "NCCL hangs, or a GPU (ncclCommGetAsyncError reports nothing)"
/* What a wait for NCCL awaits: its start (done NULL), or a collective,
   whose event is recorded once NCCL has enqueued it. */
typedef struct mgpu__nccl_awaited {
    ncclComm_t comm;
    cudaStream_t stream;
    cudaEvent_t done;
    int recorded;
    ncclResult_t state; /* what ncclCommGetAsyncError said last */
    const char *what;
} mgpu__nccl_awaited;
static int mgpu__nccl_came(void *arg) {
    mgpu__nccl_awaited *w = (mgpu__nccl_awaited *)arg;
    MGPU_NCCL_CHECK(ncclCommGetAsyncError(w->comm, &w->state));
    if (w->state == ncclInProgress) return 0;
    if (!w->done) return 1; /* (a start: it failed or it joined the others) */
    if (w->state != ncclSuccess)
        mgpu_fatal("NCCL failed in %s: %s (NCCL_DEBUG=WARN tells more)", w->what, ncclGetErrorString(w->state));
    if (!w->recorded) {
        MGPU_CUDA_CHECK(cudaEventRecord(w->done, w->stream));
        w->recorded = 1;
    }
    cudaError_t e = cudaEventQuery(w->done);
    if (e == cudaErrorNotReady) return 0;
    MGPU_CUDA_CHECK(e);
    return 1;
}

/* Starts g's communicator; returns NULL, or why it could not start. */
static const char *mgpu__nccl_start(mgpu_group *g, mgpu_device *dev, char *why, size_t size) {
    ncclUniqueId id;
    if (g->rank == 0) MGPU_NCCL_CHECK(ncclGetUniqueId(&id));
    MPI_Request request;
    MGPU__MPI_CHECK(MPI_Ibcast(&id, (int)sizeof id, MPI_BYTE, 0, g->host_comm, &request));
    mgpu__host_wait(g, &request, "NCCL's unique id");
    MGPU_CUDA_CHECK(cudaSetDevice(dev->gpu));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = NULL;
    mgpu__nccl_awaited start = {NULL, NULL, NULL, 0, ncclSuccess, "NCCL's start"};
    start.state = ncclCommInitRankConfig(&comm, g->size, id, g->rank, &config);
    if (comm) mgpu__nccl_live_set(NULL, comm); /* (aborted if the start ends in an error) */
    if (start.state == ncclInProgress || start.state == ncclSuccess) {
        start.comm = comm;
        mgpu__awaited awaited = {NULL, 0, mgpu__nccl_came, &start, MGPU__NCCL_STUCK};
        mgpu__wait_point at = mgpu__host_point(g);
        mgpu__dist_wait_for(g, &at, &awaited, "NCCL's start");
    }
    int *states = (int *)mgpu__xmalloc(sizeof(int) * (size_t)g->size), mine = start.state, failed = -1;
    mgpu__group_all_gather_bytes(g, &mine, sizeof mine, states, "NCCL's start");
    for (int r = g->size - 1; r >= 0; r--)
        if (states[r] != ncclSuccess) failed = r;
    if (failed >= 0) {
        snprintf(why, size, "rank %d's NCCL did not start (%s)", failed,
                 ncclGetErrorString((ncclResult_t)states[failed]));
        if (comm) {
            mgpu__nccl_live_set(comm, NULL);
            MGPU_NCCL_CHECK(ncclCommAbort(comm));
        }
    } else {
        g->nccl = comm;
        MGPU_CUDA_CHECK(cudaEventCreate(&g->nccl_done));
    }
    free(states);
    return failed >= 0 ? why : NULL;
}

/* Finalized, then destroyed, every rank together (mgpu_group_free). */
static void mgpu__nccl_end(mgpu_group *g) {
    if (!g->nccl) return;
    mgpu__nccl_awaited end = {g->nccl, NULL, NULL, 0, ncclSuccess, "NCCL's end"};
    end.state = ncclCommFinalize(g->nccl);
    if (end.state == ncclInProgress) {
        mgpu__awaited awaited = {NULL, 0, mgpu__nccl_came, &end, MGPU__NCCL_STUCK};
        mgpu__wait_point at = mgpu__host_point(g);
        mgpu__dist_wait_for(g, &at, &awaited, "NCCL's end");
    }
    MGPU_REQUIRE(end.state == ncclSuccess, "ncclCommFinalize: %s", ncclGetErrorString(end.state));
    mgpu__nccl_live_set(g->nccl, NULL);
    MGPU_NCCL_CHECK(ncclCommDestroy(g->nccl));
    MGPU_CUDA_CHECK(cudaEventDestroy(g->nccl_done));
    g->nccl = NULL;
}

static const char *const mgpu__nccl_coll_names[] = {"nccl allreduce", "nccl broadcast", "nccl all-gather",
                                                    "nccl reduce-scatter"};
/* Collective c of g's tensors with NCCL, on the device's communication
   queue after what its compute queue was given so far; the calling
   thread waits for it under the watch, and the compute queue waits for
   it when `wait`. */
static void mgpu__nccl_run(mgpu__coll *c, const mgpu_tensor *in, mgpu_tensor *out, int wait) {
    mgpu_group *g = c->group;
    mgpu_device *dev = out->device;
    char what[128];
    mgpu__coll_describe(c, what, sizeof what);
    mgpu__dist_set_doing(what);
    mgpu__coll_agree(c);
    mgpu_tensor *tensors[2] = {out, (mgpu_tensor *)in};
    mgpu__comm_begin(tensors, 1);
    mgpu__queue *q = &dev->queue[1];
    void *bar[2];
    mgpu__nccl_trace_open(q, mgpu__nccl_coll_names[c->kind], bar);
    MGPU_CUDA_CHECK(cudaSetDevice(dev->gpu));
    ncclRedOp_t op = c->op == MGPU_MEAN ? ncclAvg : ncclSum;
    ncclResult_t called = ncclSuccess;
    cudaStream_t s = q->stream;
    switch (c->kind) {
    case MGPU__ALLREDUCE: called = ncclAllReduce(in->data, out->data, out->numel, ncclFloat, op, g->nccl, s); break;
    case MGPU__BROADCAST:
        called = ncclBroadcast(in->data, out->data, out->numel, ncclFloat, c->peer, g->nccl, s);
        break;
    case MGPU__ALL_GATHER: called = ncclAllGather(in->data, out->data, in->numel, ncclFloat, g->nccl, s); break;
    case MGPU__REDUCE_SCATTER:
        called = ncclReduceScatter(in->data, out->data, out->numel, ncclFloat, op, g->nccl, s);
        break;
    case MGPU__SEND:
    case MGPU__RECV: mgpu_fatal("mgpu__nccl_run: a %s goes through the host", mgpu__coll_names[c->kind]);
    }
    /* (nonblocking: ncclInProgress says NCCL is still enqueuing it, which the wait polls) */
    if (called != ncclSuccess && called != ncclInProgress)
        mgpu_fatal("NCCL's %s: %s (NCCL_DEBUG=WARN tells more)", what, ncclGetErrorString(called));
    mgpu__nccl_awaited collective = {g->nccl, s, g->nccl_done, 0, ncclSuccess, what};
    mgpu__awaited awaited = {NULL, 0, mgpu__nccl_came, &collective, MGPU__NCCL_STUCK};
    mgpu__wait_point at = mgpu__coll_point(c);
    mgpu__dist_wait_for(g, &at, &awaited, what);
    mgpu__nccl_trace_close(q, bar);
    mgpu__comm_track(tensors, in != out ? tensors + 1 : NULL, 1);
    if (wait) mgpu_comm_wait(&dev, 1);
    mgpu__dist_set_doing(NULL);
}
#endif /* MGPU__NCCL_BETWEEN_PROCESSES */

/* The way of g's collectives on GPU dev, chosen at the first: NCCL where
   it can start and is asked for (above), else MPI through the host. Every
   rank chooses alike; rank 0 says why NCCL cannot start, once a process
   for each reason. */
static void mgpu__group_choose_way(mgpu_group *g, mgpu_device *dev) {
    g->way_chosen = 1;
    if (mgpu_get_dist_backend() != MGPU_BACKEND_NCCL) return;
    char why[256] = "";
    const char *cannot = why;
#if MGPU__NCCL_BETWEEN_PROCESSES
    typedef struct {
        unsigned char uuid[16];
        int nccl_version;
    } rank_gpu;
    rank_gpu mine, *all = (rank_gpu *)mgpu__xmalloc(sizeof mine * (size_t)g->size);
    memset(&mine, 0, sizeof mine);
    struct cudaDeviceProp prop;
    MGPU_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev->gpu));
    memcpy(mine.uuid, prop.uuid.bytes, sizeof mine.uuid);
    MGPU_NCCL_CHECK(ncclGetVersion(&mine.nccl_version));
    mgpu__group_all_gather_bytes(g, &mine, sizeof mine, all, "the ranks' GPUs");
    cannot = NULL;
    for (int r = 0; r < g->size && !cannot; r++) {
        int v = all[r].nccl_version, major = v >= 10000 ? v / 10000 : v / 1000; /* (NCCL_VERSION's two codes) */
        if (v < NCCL_VERSION(2, 14, 0)) {
            snprintf(why, sizeof why, "rank %d's NCCL is %d.%d.%d, older than 2.14 (whose nonblocking start the "
                     "watch needs)", r, major, v >= 10000 ? v / 100 % 100 : v / 100 % 10, v % 100);
            cannot = why;
        }
        for (int q = 0; q < r && !cannot; q++) {
            const unsigned char *u = all[r].uuid;
            if (memcmp(all[q].uuid, u, sizeof mine.uuid) != 0) continue;
            snprintf(why, sizeof why, "ranks %d and %d share GPU GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
                     "%02x%02x%02x%02x%02x%02x (NCCL takes one rank a GPU)", q, r, u[0], u[1], u[2], u[3], u[4],
                     u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
            cannot = why;
        }
    }
    free(all);
    if (!cannot) cannot = mgpu__nccl_start(g, dev, why, sizeof why);
    if (!cannot) return;
#else
    (void)dev;
    snprintf(why, sizeof why, "this program was built with an NCCL older than 2.14 (whose nonblocking start the "
             "watch needs)");
#endif
    static char said[256];
    if (g->rank == 0 && strcmp(said, cannot) != 0) {
        snprintf(said, sizeof said, "%s", cannot);
        fflush(stdout);
        fprintf(stderr, "mgpu: %sNCCL cannot start between the %d ranks' GPUs: %s; the group goes through the "
                "host over MPI\n", mgpu__error_prefix, g->size, cannot);
    }
}
/* Runs collective c for tensors in (read) and out (written; either may be
   NULL, both on one device). On a CPU device it runs on the device's
   communication queue, after what the compute queue was given so far, or
   given `ready` (a send: no out), after that event alone; the compute
   queue waits for it when `wait`. A GPU's tensors go through pinned host
   memory, on the calling thread. */
static const char *mgpu__group_run(mgpu_group *g, mgpu__coll c, const mgpu_tensor *in, mgpu_tensor *out,
                                   int wait, mgpu_event *ready) {
    mgpu_device *dev = (out ? out : in)->device;
    MGPU_REQUIRE(c.count <= INT_MAX, "a group's %s of %zu floats: more than MPI counts (%d)",
                 mgpu__coll_names[c.kind], c.count, INT_MAX);
    /* (one device, so that one thread runs the group's MPI calls, in order) */
    if (!g->device) g->device = dev;
    MGPU_REQUIRE(g->device == dev, "a group's %s: a tensor on %s, but the group's collectives run on %s: "
                 "use a group for one device", mgpu__coll_names[c.kind], dev->name, g->device->name);
    c.group = g;
    c.sequence = c.kind == MGPU__SEND || c.kind == MGPU__RECV ? 0 : ++g->sequence;
    if (g->size == 1) return "none"; /* (the callers did a group of one's work) */
    int between_two = c.kind == MGPU__SEND || c.kind == MGPU__RECV; /* (only those two ranks are here) */
    if (dev->gpu >= 0 && !g->way_chosen && !between_two) mgpu__group_choose_way(g, dev);
#if MGPU__NCCL_BETWEEN_PROCESSES
    if (dev->gpu >= 0 && g->nccl && !between_two) {
        mgpu__nccl_run(&c, in, out, wait);
        return mgpu_group_path(g, dev);
    }
#endif
    if (dev->gpu < 0) {
        mgpu_tensor *tensors[2] = {out ? out : (mgpu_tensor *)in, (mgpu_tensor *)in}; /* written (a send: read), read */
        if (ready && !out)
            mgpu__event_wait_on(&dev->queue[1], ready);
        else
            mgpu__comm_begin(tensors, 1);
        c.in = in ? in->data : NULL;
        c.out = out ? out->data : NULL;
        mgpu__launch_on(&dev->queue[1], mgpu__coll_names[c.kind], mgpu__coll_task, NULL, &c, sizeof c);
        mgpu__comm_track(tensors, in && out ? tensors + 1 : NULL, 1);
        if (wait) mgpu_comm_wait(&dev, 1);
        return mgpu_group_path(g, dev);
    }
    mgpu_synchronize(dev); /* (both queues: a collective of the process's own devices may still write t) */
    int in_place = in == out; /* (allreduce, broadcast: staged once) */
    size_t in_n = in && !in_place ? in->numel : 0, out_n = out ? out->numel : 0;
    if (!g->staging || g->staging->numel < in_n + out_n) {
        mgpu_free(g->staging);
        g->staging = mgpu_empty_pinned(mgpu_shape1((int)(in_n + out_n)));
    }
    mgpu_tensor *host_in = NULL, *host_out = NULL;
    if (in && !in_place) {
        mgpu_tensor *rows = mgpu_narrow(g->staging, 0, (int)in_n);
        host_in = mgpu_view(rows, in->shape);
        mgpu_free(rows);
        mgpu_copy(host_in, in, 0);
        c.in = host_in->data;
    }
    if (out) {
        mgpu_tensor *rows = mgpu_narrow(g->staging, (int)in_n, (int)out_n);
        host_out = mgpu_view(rows, out->shape);
        mgpu_free(rows);
        if (in_place) mgpu_copy(host_out, out, 0);
        c.out = host_out->data;
        if (in_place) c.in = c.out;
    }
    mgpu__coll_run(&c);
    if (out) mgpu_copy(out, host_out, 0);
    mgpu_free(host_in);
    mgpu_free(host_out);
    return mgpu_group_path(g, dev);
}

#else
static const char *mgpu__group_run(mgpu_group *g, mgpu__coll c, const mgpu_tensor *in, mgpu_tensor *out,
                                   int wait, mgpu_event *ready) {
    (void)c;
    (void)ready;
    (void)in;
    (void)out;
    (void)wait;
    (void)g;
    return "none"; /* without MPI a group is this process alone, whose work the callers did */
}
#endif

static void mgpu__require_group_tensor(const char *op, const mgpu_tensor *t) {
    MGPU_REQUIRE(t, "%s: the tensor is NULL", op);
    mgpu__require_alive(t, op);
}

static const char *mgpu__group_allreduce(const char *op, mgpu_group *g, mgpu_tensor *t, mgpu_reduce_op how,
                                         int wait) {
    mgpu__require_group_tensor(op, t);
    MGPU_REQUIRE(how == MGPU_SUM || how == MGPU_MEAN, "%s: op %d; want MGPU_SUM or MGPU_MEAN", op, (int)how);
    mgpu__coll c = {NULL, MGPU__ALLREDUCE, how, 0, 0, t->numel, NULL, NULL};
    return mgpu__group_run(g, c, t, t, wait, NULL);
}
MGPU_DEF const char *mgpu_group_allreduce(mgpu_group *g, mgpu_tensor *t, mgpu_reduce_op op) {
    return mgpu__group_allreduce("mgpu_group_allreduce", g, t, op, 1);
}
MGPU_DEF const char *mgpu_group_allreduce_start(mgpu_group *g, mgpu_tensor *t, mgpu_reduce_op op) {
    return mgpu__group_allreduce("mgpu_group_allreduce_start", g, t, op, 0);
}

MGPU_DEF void mgpu_group_broadcast(mgpu_group *g, mgpu_tensor *t, int root) {
    mgpu__require_group_tensor("mgpu_group_broadcast", t);
    MGPU_REQUIRE(root >= 0 && root < g->size, "mgpu_group_broadcast: root %d of a group of %d", root, g->size);
    mgpu__coll c = {NULL, MGPU__BROADCAST, MGPU_SUM, root, 0, t->numel, NULL, NULL};
    mgpu__group_run(g, c, t, t, 1, NULL);
}

/* An all-gather that the compute queue waits for (wait), or not yet:
   the caller waits for the communication queue where it needs out
   (ZeRO-3's prefetch). Only on a CPU device does it then run beside the
   compute queue's work: by NCCL the host still waits for the collective
   to end (the watch), and MPI through the host runs it on the calling
   thread. */
static void mgpu__group_all_gather(const char *op, mgpu_group *g, const mgpu_tensor *in, mgpu_tensor *out, int wait) {
    mgpu__require_group_tensor(op, in);
    mgpu__require_group_tensor(op, out);
    MGPU_REQUIRE(out->numel == in->numel * (size_t)g->size && in->device == out->device,
                 "%s: out must hold %d times in's %zu values, on in's device (%s); it holds %zu on %s", op,
                 g->size, in->numel, in->device->name, out->numel, out->device->name);
    if (g->size == 1) {
        mgpu_tensor *flat = mgpu_view(out, in->shape);
        mgpu_copy(flat, in, 0);
        mgpu_free(flat);
    }
    mgpu__coll c = {NULL, MGPU__ALL_GATHER, MGPU_SUM, 0, 0, in->numel, NULL, NULL};
    mgpu__group_run(g, c, in, out, wait, NULL);
}
MGPU_DEF void mgpu_group_all_gather(mgpu_group *g, const mgpu_tensor *in, mgpu_tensor *out) {
    mgpu__group_all_gather("mgpu_group_all_gather", g, in, out, 1);
}

MGPU_DEF void mgpu_group_reduce_scatter(mgpu_group *g, const mgpu_tensor *in, mgpu_tensor *out,
                                        mgpu_reduce_op op) {
    mgpu__require_group_tensor("mgpu_group_reduce_scatter", in);
    mgpu__require_group_tensor("mgpu_group_reduce_scatter", out);
    MGPU_REQUIRE(in->numel == out->numel * (size_t)g->size && in->device == out->device,
                 "mgpu_group_reduce_scatter: in must hold %d times out's %zu values, on out's device (%s); "
                 "it holds %zu on %s", g->size, out->numel, out->device->name, in->numel, in->device->name);
    MGPU_REQUIRE(op == MGPU_SUM || op == MGPU_MEAN, "mgpu_group_reduce_scatter: op %d; want MGPU_SUM or MGPU_MEAN",
                 (int)op);
    if (g->size == 1) {
        mgpu_tensor *flat = mgpu_view(in, out->shape);
        mgpu_copy(out, flat, 0);
        mgpu_free(flat);
    }
    mgpu__coll c = {NULL, MGPU__REDUCE_SCATTER, op, 0, 0, in->numel, NULL, NULL};
    mgpu__group_run(g, c, in, out, 1, NULL);
}

static void mgpu__require_peer(const char *op, const mgpu_group *g, int peer) {
    MGPU_REQUIRE(peer >= 0 && peer < g->size && peer != g->rank,
                 "%s: rank %d is not another rank of this group of %d (this is rank %d)", op, peer, g->size, g->rank);
}
MGPU_DEF void mgpu_group_send(mgpu_group *g, const mgpu_tensor *t, int to) {
    mgpu__require_group_tensor("mgpu_group_send", t);
    mgpu__require_peer("mgpu_group_send", g, to);
    mgpu__coll c = {NULL, MGPU__SEND, MGPU_SUM, to, 0, t->numel, NULL, NULL};
    mgpu__group_run(g, c, t, NULL, 1, NULL);
}
MGPU_DEF void mgpu_group_recv(mgpu_group *g, mgpu_tensor *t, int from) {
    mgpu__require_group_tensor("mgpu_group_recv", t);
    mgpu__require_peer("mgpu_group_recv", g, from);
    mgpu__coll c = {NULL, MGPU__RECV, MGPU_SUM, from, 0, t->numel, NULL, NULL};
    mgpu__group_run(g, c, NULL, t, 1, NULL);
}

/* A send (or receive) of t to (from) rank peer of group g, on t's
   device's communication queue: a pipeline's way between stages on
   different ranks. On a CPU device a send waits for `ready` alone: the
   pipeline knows when t was written, and the compute queue has gone on to
   later work. (A GPU's tensors go through the host, which waits for the
   device.) */
static void mgpu__group_p2p(mgpu_group *g, int send, mgpu_tensor *t, int peer, mgpu_event *ready) {
    mgpu__require_peer(send ? "a pipeline's send" : "a pipeline's receive", g, peer);
    mgpu__coll c = {NULL, send ? MGPU__SEND : MGPU__RECV, MGPU_SUM, peer, 0, t->numel, NULL, NULL};
    /* (the compute queue waits for a receive, not for a send: the next
       stage takes it when it comes to it) */
    mgpu__group_run(g, c, send ? t : NULL, send ? NULL : t, !send, ready);
}

/* The host's collectives, on the caller's thread and communicator,
   numbered in one sequence: "barrier #7", "mgpu_group_sum_host #8". */
#if MGPU_MPI
static void mgpu__host_wait(mgpu_group *g, MPI_Request *request, const char *op) {
    mgpu__wait_point at = mgpu__host_point(g);
    char what[96];
    snprintf(what, sizeof what, "%s #%ld", op, at.number);
    mgpu__dist_set_doing(what);
    mgpu__dist_wait(g, &at, request, 1, what);
    mgpu__dist_set_doing(NULL);
}
#endif
static void mgpu__group_all_gather_bytes(mgpu_group *g, const void *mine, size_t bytes, void *all, const char *op) {
    MGPU_REQUIRE(bytes <= INT_MAX, "%s: %zu bytes a rank, more than MPI counts (%d)", op, bytes, INT_MAX);
    if (g->size == 1) {
        memcpy(all, mine, bytes);
        return;
    }
#if MGPU_MPI
    MPI_Request request;
    MGPU__MPI_CHECK(MPI_Iallgather(mine, (int)bytes, MPI_BYTE, all, (int)bytes, MPI_BYTE, g->host_comm, &request));
    mgpu__host_wait(g, &request, op);
#endif
}
MGPU_DEF void mgpu_group_all_gather_host(mgpu_group *g, const void *mine, size_t bytes, void *all) {
    mgpu__group_all_gather_bytes(g, mine, bytes, all, "mgpu_group_all_gather_host");
}
/* Summed in rank order, from every rank's numbers: every rank gets the same bits. */
MGPU_DEF void mgpu_group_sum_host(mgpu_group *g, double *values, int n) {
    if (g->size == 1) return;
    double *all = (double *)mgpu__xmalloc(sizeof(double) * (size_t)n * (size_t)g->size);
    mgpu__group_all_gather_bytes(g, values, sizeof(double) * (size_t)n, all, "mgpu_group_sum_host");
    for (int i = 0; i < n; i++) {
        double s = all[i];
        for (int r = 1; r < g->size; r++) s += all[(size_t)r * (size_t)n + (size_t)i];
        values[i] = s;
    }
    free(all);
}
/* Everything enqueued before it is done on every rank. */
MGPU_DEF void mgpu_group_barrier(mgpu_group *g) {
    mgpu_synchronize_all();
#if MGPU_MPI
    if (g->size == 1) return;
    MPI_Request request;
    MGPU__MPI_CHECK(MPI_Ibarrier(g->host_comm, &request));
    mgpu__host_wait(g, &request, "barrier");
#else
    (void)g;
#endif
}
