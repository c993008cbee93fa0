/* tests/assignments/check_zero3.c: the checker of the ZeRO-3 assignment
   (docs/assignments.md). Built with the student's file by
       make check-assignment NAME=zero3 FILE=student.c
   which must define
       void zero3_layer_hook(void *ctx, mgpu_net *net, int layer, int when);
   a layer hook (mgpu_net_set_layer_hook) that gathers a layer's whole
   parameters from their shards before its forward and backward passes
   and frees them after. The checker owns the rest: replicas of a small
   MLP on 2 and 4 CPU devices, each parameter cut into one shard a
   device, each replica's passes on its share of the batch, the
   gradients averaged and SGD with momentum on the shards, 20 steps. One
   device's training on the whole batch, no whole parameter between
   steps, and at most one layer's whole parameters during a step are the
   answer. */
#include "mgpu.h"
#include "tests/test.h"
#include "tests/assignments/child.h"
#include <stdarg.h>
#include <sys/mman.h>

/* What the hook is given (ctx): one replica's view of the shards. */
typedef struct zero3_context {
    int world;               /* W: the devices, and the shards of every parameter */
    mgpu_device **devices;   /* devices[k] holds shard k of every parameter */
    int replica;             /* this replica's index: its network runs on devices[replica] */
    mgpu_tensor ***shards;   /* shards[p][k]: shard k of parameter p (net->params[p]), on devices[k] */
    const int *shard_len;    /* shard_len[p]: each shard's length, ceil(numel / W) floats: parameter p's
                                flattened values [k shard_len[p], (k + 1) shard_len[p]) are shard k's,
                                the last shard padded with zeros past the end */
    const mgpu_shape *shape; /* shape[p]: parameter p's whole shape */
} zero3_context;

#include STUDENT_FILE

/* ---- the training ---- */
#define STEPS 20
#define ROWS 32
#define LR 0.1f
#define MOMENTUM 0.9f
#define TOLERANCE 1e-5
#define MAX_WORLD 4
#define NPARAMS 6 /* (3 linear layers: weight and bias each) */
#define MAX_NUMEL 300
static const int worlds[] = {2, 4};
#define NWORLDS 2

/* The MLP: 12 -> 20 -> 15 -> 10, ReLUs between (layers 0, 2, 4 linear,
   1 and 3 ReLU). Parameters of 240, 20, 300, 15, 150 and 10 values: on 4
   devices the biases of 15 and 10 leave their last shards padded. */
static mgpu_net *mlp(mgpu_device *dev) {
    mgpu_manual_seed(7);
    mgpu_net *net = mgpu_net_new(dev);
    mgpu_net_add_linear(net, 12, 20);
    mgpu_net_add_relu(net);
    mgpu_net_add_linear(net, 20, 15);
    mgpu_net_add_relu(net);
    mgpu_net_add_linear(net, 15, 10);
    return net;
}
static void batch(mgpu_tensor **x, mgpu_tensor **y) {
    mgpu_manual_seed(11);
    *x = mgpu_randn(mgpu_cpu(), mgpu_shape2(ROWS, 12), 0.0f, 1.0f);
    float labels[ROWS];
    for (int i = 0; i < ROWS; i++) labels[i] = (float)((i * 7 + 3) % 10);
    *y = mgpu_from_host(mgpu_cpu(), mgpu_shape1(ROWS), labels);
}

/* One device's training on the whole batch: the answer's parameters. */
static float reference[NPARAMS][MAX_NUMEL];
static void train_one_device(void) {
    mgpu_tensor *x, *y;
    batch(&x, &y);
    mgpu_net *net = mlp(mgpu_cpu());
    for (int s = 0; s < STEPS; s++) {
        mgpu_net_zero_grad(net);
        mgpu_net_loss_backward(net, mgpu_net_forward(net, x), y, 1.0f / ROWS, NULL);
        mgpu_net_sgd(net, LR, MOMENTUM, 0.0f);
    }
    for (int p = 0; p < NPARAMS; p++) mgpu_to_host(net->params[p]->value, reference[p]);
    mgpu_free(x), mgpu_free(y);
    mgpu_net_free(net);
}

/* What the training on W devices left, written by the child process
   that runs it (memory shared with the checker): how far it got (the
   step, and the hook's last call), the parameters after the last step
   (gathered from the shards), the first whole parameter held between
   steps, and each device's peak parameter memory during the steps
   against one layer's whole parameters. */
static const char *const when_said[] = {"MGPU_BEFORE_FORWARD", "MGPU_AFTER_FORWARD", "MGPU_BEFORE_BACKWARD",
                                        "MGPU_AFTER_BACKWARD"};
typedef struct outcome {
    int ran, finished, step, layer, when, in_hook;
    char stopped[512];         /* the checker's line, where it stopped the training itself */
    float value[NPARAMS][MAX_NUMEL];
    char held[256];            /* the first whole parameter held between steps */
    size_t peak[MAX_WORLD], bound;
} outcome;
static outcome *outcomes; /* [NWORLDS], shared with the children */

static outcome *now; /* (the child's) */
static mgpu_device *devs[MAX_WORLD];
static void stop(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void stop(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(now->stopped, sizeof now->stopped, fmt, ap);
    va_end(ap);
    _exit(3);
}

/* The hook the replicas get: yours, then a look at what it left. Before
   a pass, the layer's parameters must be whole, alive, on this replica's
   device. */
static void checked_hook(void *ctx, mgpu_net *net, int layer, int when) {
    zero3_context *c = (zero3_context *)ctx;
    now->layer = layer, now->when = when, now->in_hook = 1;
    zero3_layer_hook(ctx, net, layer, when);
    now->in_hook = 0;
    if (when != MGPU_BEFORE_FORWARD && when != MGPU_BEFORE_BACKWARD) return;
    for (int p = net->first_param[layer]; p < net->first_param[layer + 1]; p++) {
        const mgpu_tensor *v = net->params[p]->value;
        char want[64], got[64];
        mgpu_shape_str(c->shape[p], want, sizeof want);
        if (!v)
            stop("step %d, replica %d, layer %d: after your hook's %s call, parameter %d's value is NULL: gather "
                 "it there", now->step + 1, c->replica, layer, when_said[when], p);
        if (!v->alive)
            stop("step %d, replica %d, layer %d: after your hook's %s call, parameter %d's value is a freed "
                 "tensor: gather it again there (and set param->value = NULL when you free it)",
                 now->step + 1, c->replica, layer, when_said[when], p);
        if (!mgpu_shape_equal(v->shape, c->shape[p]) || v->device != c->devices[c->replica])
            stop("step %d, replica %d, layer %d: after your hook's %s call, parameter %d is %s on %s; want %s "
                 "on %s, this replica's device", now->step + 1, c->replica, layer, when_said[when], p,
                 mgpu_shape_str(v->shape, got, sizeof got), mgpu_device_name(v->device), want,
                 mgpu_device_name(c->devices[c->replica]));
    }
}

/* Parameter p's whole values from its shards, on the host. */
static void from_shards(const zero3_context *c, int p, float *out) {
    float part[MAX_NUMEL];
    size_t numel = mgpu_shape_numel(c->shape[p]), len = (size_t)c->shard_len[p];
    for (int k = 0; k < c->world; k++) {
        mgpu_to_host(c->shards[p][k], part);
        for (size_t i = 0; i < len && k * len + i < numel; i++) out[k * len + i] = part[i];
    }
}

/* The training on W devices, in the child. */
static void train_sharded(int w, outcome *o) {
    now = o;
    mgpu_tensor *x, *y;
    batch(&x, &y);
    mgpu_net *nets[MAX_WORLD];
    nets[0] = mlp(devs[0]);
    for (int r = 1; r < w; r++) nets[r] = mgpu_net_replicate(nets[0], devs[r]);
    /* each parameter cut into W shards, shard k on device k; then every
       replica's whole values freed */
    static mgpu_tensor *shard_store[NPARAMS][MAX_WORLD], **shards[NPARAMS];
    static int shard_len[NPARAMS];
    static mgpu_shape shape[NPARAMS];
    static float momentum[NPARAMS][MAX_NUMEL];
    for (int p = 0; p < NPARAMS; p++) {
        const mgpu_tensor *v = nets[0]->params[p]->value;
        float flat[MAX_NUMEL] = {0};
        shape[p] = v->shape;
        shard_len[p] = (int)((v->numel + (size_t)w - 1) / (size_t)w);
        mgpu_to_host(v, flat);
        shards[p] = shard_store[p];
        for (int k = 0; k < w; k++)
            shards[p][k] = mgpu_from_host(devs[k], mgpu_shape1(shard_len[p]), flat + k * shard_len[p]);
    }
    zero3_context ctx[MAX_WORLD];
    for (int r = 0; r < w; r++) {
        ctx[r] = (zero3_context){w, devs, r, shards, shard_len, shape};
        for (int p = 0; p < NPARAMS; p++) {
            mgpu_free(nets[r]->params[p]->value);
            nets[r]->params[p]->value = NULL;
        }
        mgpu_net_set_layer_hook(nets[r], checked_hook, &ctx[r]);
    }
    /* the parameter memory each device holds now (the shards count
       apart), and one layer's whole parameters, as the allocator rounds
       them: the most it may hold more during a step */
    size_t baseline[MAX_WORLD];
    mgpu_synchronize_all();
    for (int l = 0; l < nets[0]->nlayers; l++) {
        mgpu_tensor *whole[NPARAMS];
        size_t before = mgpu_device_memory_in_use(devs[0]);
        int first = nets[0]->first_param[l], end = nets[0]->first_param[l + 1];
        for (int p = first; p < end; p++) whole[p] = mgpu_empty(devs[0], shape[p]);
        size_t bytes = mgpu_device_memory_in_use(devs[0]) - before;
        for (int p = first; p < end; p++) mgpu_free(whole[p]);
        if (bytes > o->bound) o->bound = bytes;
    }
    for (int r = 0; r < w; r++) {
        baseline[r] = mgpu_device_memory_of(devs[r], MGPU_MEMORY_PARAMETERS);
        mgpu_device_reset_peak(devs[r]);
    }
    mgpu_tensor *xs[MAX_WORLD], *ys[MAX_WORLD];
    int share = ROWS / w;
    for (int r = 0; r < w; r++) {
        mgpu_tensor *xr = mgpu_narrow(x, r * share, share), *yr = mgpu_narrow(y, r * share, share);
        xs[r] = mgpu_to(xr, devs[r], 0), ys[r] = mgpu_to(yr, devs[r], 0);
        mgpu_free(xr), mgpu_free(yr);
    }
    for (int s = 0; s < STEPS; s++) {
        o->step = s;
        for (int r = 0; r < w; r++) {
            mgpu_net_zero_grad(nets[r]);
            mgpu_net_loss_backward(nets[r], mgpu_net_forward(nets[r], xs[r]), ys[r], 1.0f / (float)share, NULL);
        }
        mgpu_synchronize_all();
        /* the replicas' gradients averaged, and each shard's SGD step
           with momentum (PyTorch's: the first step's momentum is the
           gradient) */
        for (int p = 0; p < NPARAMS; p++) {
            float grad[MAX_WORLD * MAX_NUMEL] = {0}, one[MAX_NUMEL], value[MAX_WORLD * MAX_NUMEL] = {0};
            size_t numel = mgpu_shape_numel(shape[p]);
            for (int r = 0; r < w; r++) {
                mgpu_to_host(nets[r]->params[p]->grad, one);
                for (size_t i = 0; i < numel; i++) grad[i] += one[i] / (float)w;
            }
            from_shards(&ctx[0], p, value);
            for (size_t i = 0; i < numel; i++) {
                momentum[p][i] = s == 0 ? grad[i] : MOMENTUM * momentum[p][i] + grad[i];
                value[i] -= LR * momentum[p][i];
            }
            for (int k = 0; k < w; k++) {
                mgpu_tensor *stepped = mgpu_from_host(devs[k], mgpu_shape1(shard_len[p]), value + k * shard_len[p]);
                mgpu_copy(shards[p][k], stepped, 0);
                mgpu_free(stepped);
            }
        }
        /* between steps: no whole parameter */
        for (int r = 0; r < w && !o->held[0]; r++) {
            for (int p = 0; p < NPARAMS && !o->held[0]; p++)
                if (nets[r]->params[p]->value)
                    snprintf(o->held, sizeof o->held, "after step %d, replica %d's parameter %d still holds a "
                             "value: free it after the layer's backward pass and set param->value = NULL",
                             s + 1, r, p);
            size_t more = mgpu_device_memory_of(devs[r], MGPU_MEMORY_PARAMETERS) - baseline[r];
            if (more && !o->held[0])
                snprintf(o->held, sizeof o->held, "after step %d, %s holds %zu bytes of parameters besides its "
                         "shards (one layer's whole parameters are at most %zu): free what your hook makes",
                         s + 1, mgpu_device_name(devs[r]), more, o->bound);
        }
    }
    for (int r = 0; r < w; r++) o->peak[r] = mgpu_device_memory_peak_of(devs[r], MGPU_MEMORY_PARAMETERS) - baseline[r];
    for (int p = 0; p < NPARAMS; p++) from_shards(&ctx[0], p, o->value[p]);
    o->finished = 1;
}

/* Runs the training on W devices in a child process, so that a hook that
   crashes, or that leaves a layer without its parameters, is a failed
   test with one line rather than the checker's end; the library's error
   line, if it stopped the training, is kept. */
static char child_said[NWORLDS][2400];
static void train_in_the_child(void *arg) {
    int i = *(const int *)arg;
    train_sharded(worlds[i], &outcomes[i]);
}
static void run_training_in_a_child(int i) {
    outcome *o = &outcomes[i];
    if (o->ran) return;
    o->ran = 1;
    char line[2048];
    int status = run_in_a_child(train_in_the_child, &i, 60, line, sizeof line);
    char where[160];
    snprintf(where, sizeof where, "step %d, layer %d, %s your hook's %s call", o->step + 1, o->layer,
             o->in_hook ? "in" : "after", when_said[o->when]);
    char *said = child_said[i];
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0 && o->finished)
        said[0] = 0;
    else if (WIFEXITED(status) && WEXITSTATUS(status) == 3)
        snprintf(said, sizeof child_said[0], "%s", o->stopped);
    else if (WIFEXITED(status))
        snprintf(said, sizeof child_said[0], "the library stopped the training (%s): %s", where,
                 line[0] ? line : "(it said nothing)");
    else if (WTERMSIG(status) == SIGALRM)
        snprintf(said, sizeof child_said[0], "the training did not end within 60 s (%s: a loop that never ends?)",
                 where);
    else
        snprintf(said, sizeof child_said[0], "the training crashed (%s, %s): does the hook read a shard past "
                 "its end, or a value it freed?", strsignal(WTERMSIG(status)), where);
}
/* Whether the training on worlds[i] devices ran to its end (the first
   test says why not; the others count it). */
static int trained(int i) {
    if (!outcomes) { /* (first: the answer, and room the children write in) */
        outcomes = (outcome *)mmap(NULL, NWORLDS * sizeof *outcomes, PROT_READ | PROT_WRITE,
                                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (outcomes == MAP_FAILED) { perror("mmap"); exit(2); }
        mgpu_devices(MAX_WORLD, 0, devs);
        train_one_device();
    }
    run_training_in_a_child(i);
    return outcomes[i].finished;
}
static void say_not_trained(int left_out) {
    if (left_out) printf("  %d of %d settings left out: the training did not run to its end (see "
                         "training_runs_to_its_end)\n", left_out, NWORLDS);
}

/* ---- the tests ---- */

/* 20 steps on 2 and on 4 devices end, the hook leaving each layer's
   parameters whole, alive and on the replica's device before its passes. */
TEST(training_runs_to_its_end) {
    int stopped = 0;
    for (int i = 0; i < NWORLDS; i++)
        if (!trained(i) && ++stopped) printf("  %d devices: %s\n", worlds[i], child_said[i]);
    CHECK(stopped == 0);
}

/* The parameters after 20 steps are one device's training on the whole
   batch, within 1e-5 of each parameter's largest value: a whole value
   gathered wrong (a shard in the wrong place, or its own shard alone)
   trains another network. */
TEST(parameters_are_one_devices_training) {
    int wrong = 0, left_out = 0;
    for (int i = 0; i < NWORLDS; i++) {
        if (!trained(i)) {
            left_out++;
            continue;
        }
        double worst = 0;
        int worst_param = 0;
        for (int p = 0; p < NPARAMS; p++) {
            double diff = 0, scale = 1e-30;
            for (int j = 0; j < MAX_NUMEL; j++) {
                diff = fmax(diff, fabs((double)outcomes[i].value[p][j] - reference[p][j]));
                scale = fmax(scale, fabs((double)reference[p][j]));
            }
            if (diff / scale > worst) worst = diff / scale, worst_param = p;
        }
        if (!(worst <= TOLERANCE) && ++wrong)
            printf("  %d devices: after %d steps parameter %d is %.3g off one device's training (relative); want "
                   "within %g: does each shard land in its place, and is each layer gathered anew at each step?\n",
                   worlds[i], STEPS, worst_param, worst, TOLERANCE);
    }
    say_not_trained(left_out);
    CHECK(wrong == 0 && left_out == 0);
}

/* Between steps every replica's param->value is NULL, and no device holds
   parameter memory (MGPU_MEMORY_PARAMETERS, where what the hook makes
   counts) besides the shards. */
TEST(no_whole_parameter_between_steps) {
    int held = 0, left_out = 0;
    for (int i = 0; i < NWORLDS; i++) {
        if (!trained(i)) {
            left_out++;
            continue;
        }
        if (outcomes[i].held[0] && ++held) printf("  %d devices: %s\n", worlds[i], outcomes[i].held);
    }
    say_not_trained(left_out);
    CHECK(held == 0 && left_out == 0);
}

/* During a step each device holds, besides its shards, at most one
   layer's whole parameters at a time: each layer's are freed before the
   next one's are gathered. */
TEST(at_most_one_layers_parameters_during_a_step) {
    int over = 0, left_out = 0;
    for (int i = 0; i < NWORLDS; i++) {
        if (!trained(i)) {
            left_out++;
            continue;
        }
        for (int r = 0; r < worlds[i]; r++)
            if (outcomes[i].peak[r] > outcomes[i].bound && ++over)
                printf("  %d devices: device %d held %zu bytes of whole parameters at its peak besides its shards; "
                       "one layer's take %zu: free each layer's after its passes, and copy the shards straight "
                       "into place\n",
                       worlds[i], r, outcomes[i].peak[r], outcomes[i].bound);
    }
    say_not_trained(left_out);
    CHECK(over == 0 && left_out == 0);
}

TEST_MAIN()
