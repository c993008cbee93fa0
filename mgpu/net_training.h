/* mgpu/net_training.h: training a network: its loss and step, the
   optimizers over all its parameters, the gradient check against finite
   differences, replicas on other devices (chapter 3's wrapper makes them),
   evaluation, and freeing.
   defines: mgpu_net_set_training, mgpu_net_set_batchnorm_momentum, mgpu_net_sgd, mgpu_net_use_adam,
   mgpu_net_step, mgpu_net_loss_backward, mgpu_net_train_step,
   mgpu_net_gradcheck, mgpu_net_num_params, mgpu_net_param,
   mgpu_net_num_buffers, mgpu_net_buffer, mgpu_net_num_weights,
   mgpu_net_replicate, mgpu_net_copy_params, mgpu_net_free,
   mgpu_evaluate_accuracy, mgpu_net_evaluate_accuracy */
/* ---- gradient check (mgpu_net_gradcheck) ---- */
/* L = sum of p_i y_i for the net's output y on x, in double; and in
   *size (if given) the sum of |p_i y_i|, the scale of L's rounding. */
static double mgpu__gradcheck_loss(mgpu_net *net, const mgpu_tensor *x, const float *p, double *size) {
    const mgpu_tensor *y = mgpu_net_forward(net, x);
    float *v = (float *)mgpu__xmalloc(y->numel * sizeof(float));
    mgpu_to_host(y, v);
    double loss = 0, magnitude = 0;
    for (size_t i = 0; i < y->numel; i++) {
        loss += (double)p[i] * v[i];
        magnitude += fabs((double)p[i] * v[i]);
    }
    free(v);
    if (size) *size = magnitude;
    return loss;
}
/* Sets value i of t (on its device) to v. */
static void mgpu__set_value(mgpu_tensor *t, size_t i, float v) {
    mgpu_tensor *one = mgpu__value_view(t, i);
    mgpu_tensor *src = mgpu_from_host(t->device, one->shape, &v);
    mgpu_copy(one, src, 0);
    mgpu_free(src);
    mgpu_free(one);
}
/* The central difference of L in value i of t, step h. */
static double mgpu__gradcheck_slope(mgpu_net *net, const mgpu_tensor *x, const float *p, mgpu_tensor *t, size_t i,
                                    float v, float h) {
    mgpu__set_value(t, i, v + h);
    double up = mgpu__gradcheck_loss(net, x, p, NULL);
    mgpu__set_value(t, i, v - h);
    double down = mgpu__gradcheck_loss(net, x, p, NULL);
    mgpu__set_value(t, i, v);
    return (up - down) / (2.0 * (double)h);
}
MGPU_DEF mgpu_gradcheck_result mgpu_net_gradcheck(mgpu_net *net, const mgpu_tensor *x, int max_values, FILE *report) {
    MGPU_REQUIRE(net && x && net->nlayers > 0 && max_values >= 1,
                 "mgpu_net_gradcheck: want a network with layers, an input and max_values >= 1");
    mgpu__require_device(x, net->device, "mgpu_net_gradcheck");
    mgpu_gradcheck_result r = {0, 0, 0, 0.0};
    mgpu_tensor *x_moved = mgpu_to(x, net->device, 0); /* (the copy whose values move) */
    /* p: fixed draws of a small generator of its own (the library's stays where it was) */
    const mgpu_tensor *y = mgpu_net_forward(net, x_moved);
    float *p = (float *)mgpu__xmalloc(y->numel * sizeof(float));
    uint64_t state = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < y->numel; i++) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        p[i] = (float)((double)(state >> 11) / 9007199254740992.0) * 2.0f - 1.0f;
    }
    /* the backward pass's slopes: dx (the first layer's input gradient, asked for here) and the parameters' */
    mgpu_layer *first = net->layers[0];
    int wanted_dx = first->need_dinput;
    first->need_dinput = 1;
    mgpu_tensor *dy = mgpu_from_host(net->device, y->shape, p);
    mgpu_net_zero_grad(net);
    double size; /* the float outputs' rounding moves L by some float epsilons of it */
    mgpu__gradcheck_loss(net, x_moved, p, &size);
    mgpu_net_backward(net, dy);
    int ntensors = 1 + net->nparams;
    for (int k = 0; k < ntensors; k++) {
        mgpu_tensor *t = k == 0 ? x_moved : net->params[k - 1]->value;
        const mgpu_tensor *grad = k == 0 ? first->dinput : net->params[k - 1]->grad;
        float *values = (float *)mgpu__xmalloc(t->numel * sizeof(float));
        float *slopes = (float *)mgpu__xmalloc(t->numel * sizeof(float));
        mgpu_to_host(t, values);
        mgpu_to_host(grad, slopes);
        size_t tries = t->numel < (size_t)max_values ? t->numel : (size_t)max_values;
        for (size_t j = 0; j < tries; j++) {
            size_t i = tries > 1 ? j * (t->numel - 1) / (tries - 1) : 0;
            /* the step: h, or where the slopes at h and h / 4 disagree (a kink
               within h), h / 4 if it agrees with h / 16 */
            float v = values[i], h = 1e-2f * fmaxf(1.0f, fabsf(v));
            double numeric = mgpu__gradcheck_slope(net, x_moved, p, t, i, v, h), allowed = 0, finer = 0;
            int smooth = 0;
            for (int tries_left = 2; tries_left > 0 && !smooth; tries_left--) {
                double rounding = 8 * FLT_EPSILON * size / h; /* (four times it at h / 4) */
                allowed = 1e-3 + 1e-2 * fabs(numeric) + 5 * rounding;
                finer = mgpu__gradcheck_slope(net, x_moved, p, t, i, v, h / 4);
                smooth = fabs(numeric - finer) <= allowed;
                if (!smooth && tries_left > 1) h /= 4, numeric = finer;
            }
            /* Richardson's extrapolation: a central difference errs by c h^2 + ...,
               so (16 s(h / 4) - s(h)) / 15 leaves out the h^2 term */
            if (smooth) numeric = (16 * finer - numeric) / 15;
            char what[96];
            if (k == 0) snprintf(what, sizeof what, "value %zu of the input x", i);
            else snprintf(what, sizeof what, "value %zu of parameter %d (of layer %s)", i, k - 1,
                          mgpu__param_layer(net, k - 1)->name);
            if (!smooth) { /* the line bends within h / 4 too: a kink */
                r.near_kinks++;
                if (report)
                    fprintf(report, "gradcheck: %s: near a kink (slopes %.6g at step %g, %.6g at %g): not judged\n",
                            what, numeric, h, finer, h / 4);
                continue;
            }
            double error = fabs(slopes[i] - numeric) / allowed;
            r.checked++;
            if (error > r.worst) r.worst = error;
            if (error <= 1.0) continue;
            r.failed++;
            if (report)
                fprintf(report, "gradcheck: %s: backward gives %.6g, central differences %.6g\n", what, slopes[i],
                        numeric);
        }
        free(values);
        free(slopes);
    }
    first->need_dinput = wanted_dx;
    if (report)
        fprintf(report, "gradcheck: %d values checked, %d failed, %d near a kink (worst error %.3g of its tolerance)\n",
                r.checked, r.failed, r.near_kinks, r.worst);
    free(p);
    mgpu_free(dy);
    mgpu_free(x_moved);
    return r;
}
MGPU_DEF void mgpu_net_set_training(mgpu_net *net, int training) { net->training = training; }
MGPU_DEF void mgpu_net_set_batchnorm_momentum(mgpu_net *net, float momentum) {
    MGPU_REQUIRE(net && momentum >= 0.0f && momentum <= 1.0f,
                 "mgpu_net_set_batchnorm_momentum: want a network and a momentum from 0 to 1, got %g",
                 (double)momentum);
    mgpu_layer **bns = (mgpu_layer **)mgpu__xmalloc(sizeof *bns * (2 * (size_t)net->nlayers + 1));
    int count = mgpu__net_batch_norms(net, bns);
    for (int i = 0; i < count; i++) bns[i]->momentum = momentum;
    free(bns);
}

/* One update of every parameter: a few launches, not one a tensor. */
MGPU_DEF void mgpu_net_sgd(mgpu_net *net, float lr, float momentum, float weight_decay) {
    mgpu_tensor **values = net->step_values;
    const mgpu_tensor **grads = net->step_grads;
    for (int i = 0; i < net->nparams; i++) {
        mgpu_param *p = net->params[i];
        if (momentum != 0.0f && !net->momentum[i]) {
            int scope = mgpu__memory_scope(MGPU_MEMORY_OPTIMIZER);
            net->momentum[i] = mgpu_zeros(net->device, p->value->shape);
            mgpu__memory_scope((mgpu_memory_category)scope);
        }
        values[i] = p->value;
        grads[i] = p->grad;
    }
    mgpu__sgd_tensors("mgpu_net_sgd", values, grads, momentum != 0.0f ? net->momentum : NULL,
                      net->nparams, lr, momentum, weight_decay, net->steps == 0);
    net->steps++;
    net->changes++; /* (a wrapper's own step then says that it made this change itself) */
}

static int mgpu__net_has_momentum(const mgpu_net *net) { return net->nparams > 0 && net->momentum[0]; }

/* Gives net its optimizer's state tensors (their values still to be
   written) where `present`, else none: momentum buffers, and with Adam
   the second moments. The optimizer makes them all at its first step
   that uses them, so a net has all or none. */
static void mgpu__net_keep_momentum(mgpu_net *net, int present) {
    for (int p = 0; p < net->nparams; p++) {
        mgpu_tensor **state[2] = {&net->momentum[p], &net->second_moment[p]};
        for (int k = 0; k < 2; k++) {
            if (present && (k == 0 || net->adam)) {
                int scope = mgpu__memory_scope(MGPU_MEMORY_OPTIMIZER);
                mgpu_ensure(state[k], net->device, net->params[p]->value->shape);
                mgpu__memory_scope((mgpu_memory_category)scope);
            } else {
                mgpu_free(*state[k]);
                *state[k] = NULL;
            }
        }
    }
}

/* dst takes src's optimizer state: its count of steps, its momentum
   buffers (and Adam's second moments). */
static void mgpu__net_copy_sgd_state(mgpu_net *dst, const mgpu_net *src) {
    dst->steps = src->steps;
    mgpu__net_keep_momentum(dst, mgpu__net_has_momentum(src));
    for (int p = 0; p < src->nparams && src->momentum[p]; p++) {
        mgpu_copy(dst->momentum[p], src->momentum[p], 0);
        if (src->second_moment[p]) mgpu_copy(dst->second_moment[p], src->second_moment[p], 0);
    }
}

MGPU_DEF void mgpu_net_use_adam(mgpu_net *net, float beta1, float beta2, float eps, int decoupled) {
    MGPU_REQUIRE(beta1 >= 0.0f && beta1 < 1.0f && beta2 >= 0.0f && beta2 < 1.0f && eps > 0.0f && isfinite(eps),
                 "mgpu_net_use_adam: betas %g and %g, eps %g: the betas must be in [0, 1), eps above 0",
                 (double)beta1, (double)beta2, (double)eps);
    MGPU_REQUIRE(net->steps == 0 || net->adam,
                 "mgpu_net_use_adam: the network has taken %d SGD steps; choose Adam before the first step (its "
                 "bias corrections count the steps)", net->steps);
    net->adam = 1;
    net->decoupled = decoupled != 0;
    net->beta1 = beta1, net->beta2 = beta2, net->eps = eps;
}

/* Adam's (or AdamW's, as net says) step t = net->steps + 1 of count
   tensors with their gradients and moments, MGPU__LIST_MAX to a launch
   (kernels/adam.h). */
static void mgpu__adam_tensors(const mgpu_net *net, mgpu_tensor *const *params, const mgpu_tensor *const *grads,
                               mgpu_tensor *const *m, mgpu_tensor *const *v, int count, float lr, float weight_decay) {
    const char *op = net->decoupled ? "AdamW" : "Adam";
    MGPU_REQUIRE(lr >= 0.0f && isfinite(lr) && weight_decay >= 0.0f && isfinite(weight_decay),
                 "%s: learning rate %g, weight decay %g: each must be a finite 0 or more", op, (double)lr,
                 (double)weight_decay);
    double t = (double)net->steps + 1.0;
    mgpu__adam_args a;
    memset(&a, 0, sizeof a);
    a.one_minus_beta1 = (float)(1.0 - (double)net->beta1);
    a.beta2 = net->beta2;
    a.one_minus_beta2 = (float)(1.0 - (double)net->beta2);
    a.eps = net->eps;
    a.weight_decay = weight_decay;
    a.decay = (float)(1.0 - (double)lr * (double)weight_decay);
    a.step_size = (float)((double)lr / (1.0 - pow((double)net->beta1, t)));
    a.correction2_sqrt = (float)sqrt(1.0 - pow((double)net->beta2, t));
    a.decoupled = net->decoupled;
    for (int i = 0; i < count; i++) {
        mgpu_tensor *state[3] = {params[i], m[i], v[i]};
        for (int k = 0; k < 3; k++) {
            mgpu__require_device(state[k], params[0]->device, op);
            mgpu__require_same_shape(state[k], grads[i], op);
            mgpu__before_write(state[k]);
        }
        int at = a.list.count;
        a.param[at] = params[i]->data;
        a.grad[at] = grads[i]->data;
        a.m[at] = m[i]->data;
        a.v[at] = v[i]->data;
        if (mgpu__list_add(&a.list, params[i]->numel) || i == count - 1) {
            mgpu__launch_on(&params[0]->device->queue[0], net->decoupled ? "adamw" : "adam", mgpu__adam_cpu,
                            MGPU__CUDA_FN(mgpu__adam_cuda), &a, sizeof a);
            a.list.count = 0;
        }
    }
}

/* Adam's step of every parameter of the net. */
static void mgpu__net_adam(mgpu_net *net, float lr, float weight_decay) {
    for (int i = 0; i < net->nparams; i++) {
        mgpu_param *p = net->params[i];
        mgpu_tensor **moments[2] = {&net->momentum[i], &net->second_moment[i]};
        for (int k = 0; k < 2; k++)
            if (!*moments[k]) {
                int scope = mgpu__memory_scope(MGPU_MEMORY_OPTIMIZER);
                *moments[k] = mgpu_zeros(net->device, p->value->shape);
                mgpu__memory_scope((mgpu_memory_category)scope);
            }
        net->step_values[i] = p->value;
        net->step_grads[i] = p->grad;
    }
    mgpu__adam_tensors(net, net->step_values, net->step_grads, net->momentum, net->second_moment, net->nparams, lr,
                       weight_decay);
    net->steps++;
    net->changes++;
}

MGPU_DEF void mgpu_net_step(mgpu_net *net, float lr, float momentum, float weight_decay) {
    if (!net->adam) {
        mgpu_net_sgd(net, lr, momentum, weight_decay);
        return;
    }
    MGPU_REQUIRE(momentum == 0.0f, "%s: momentum %g, but Adam keeps moments of its own (betas %g, %g): give 0",
                 net->decoupled ? "AdamW" : "Adam", (double)momentum, (double)net->beta1, (double)net->beta2);
    mgpu__net_adam(net, lr, weight_decay);
}

/* A caller's argument `what` is alive and on the net's device: an error
   names the argument and the caller, not an operation deep inside. */
static void mgpu__require_net_argument(const char *who, const char *what, const mgpu_tensor *t, const mgpu_net *net) {
    mgpu__require_alive(t, who);
    MGPU_REQUIRE(t->device == net->device, "%s: %s is on %s, the network on %s; copy it first with mgpu_to", who,
                 what, t->device->name, net->device->name);
}
/* A caller's loss_sum holds one value on the net's device (or is NULL). */
static void mgpu__require_loss_sum(const char *who, const mgpu_tensor *loss_sum, const mgpu_net *net) {
    char s[64];
    if (!loss_sum) return;
    mgpu__require_net_argument(who, "loss_sum", loss_sum, net);
    MGPU_REQUIRE(loss_sum->numel == 1, "%s: loss_sum has shape %s; it must hold one value, [1]", who,
                 mgpu_shape_str(loss_sum->shape, s, sizeof s));
}
/* The loss's gradient with respect to the logits (and the loss, added to
   loss_sum when given): where every backward pass starts. For messages:
   op, the caller's function, and first_row, where these rows start in its
   batch (mgpu__ce_prepare). */
static const mgpu_tensor *mgpu__net_loss_grad(mgpu_net *net, const mgpu_tensor *logits,
                                              const mgpu_tensor *labels, float scale,
                                              mgpu_tensor *loss_sum, const char *op, int first_row) {
    int n = logits->shape.d[0];
    mgpu_ensure(&net->losses, net->device, mgpu_shape1(n));
    mgpu_ensure(&net->dlogits, net->device, logits->shape);
    mgpu__cross_entropy_forward(op, first_row, net->losses, logits, labels);
    if (loss_sum) {
        mgpu_ensure(&net->loss_sum, net->device, mgpu_shape1(1));
        mgpu_sum(net->loss_sum, net->losses);
        mgpu_add_(loss_sum, net->loss_sum);
    }
    mgpu__cross_entropy_backward(op, first_row, net->dlogits, logits, labels, scale);
    return net->dlogits;
}

MGPU_DEF void mgpu_net_loss_backward(mgpu_net *net, const mgpu_tensor *logits,
                                     const mgpu_tensor *labels, float scale,
                                     mgpu_tensor *loss_sum) {
    mgpu__net_require_backward(net, "mgpu_net_loss_backward");
    mgpu__require_net_argument("mgpu_net_loss_backward", "logits", logits, net);
    mgpu__require_net_argument("mgpu_net_loss_backward", "labels", labels, net);
    mgpu__require_loss_sum("mgpu_net_loss_backward", loss_sum, net);
    mgpu_net_backward(net, mgpu__net_loss_grad(net, logits, labels, scale, loss_sum, "mgpu_net_loss_backward", 0));
}

MGPU_DEF void mgpu_net_train_step(mgpu_net *net, const mgpu_tensor *x, const mgpu_tensor *labels,
                                  float lr, float momentum, float weight_decay,
                                  mgpu_tensor *loss_sum) {
    mgpu__require_net_argument("mgpu_net_train_step", "x", x, net);
    mgpu__require_net_argument("mgpu_net_train_step", "labels", labels, net);
    mgpu__require_loss_sum("mgpu_net_train_step", loss_sum, net);
    mgpu__require_sgd_settings("mgpu_net_train_step", lr, momentum, weight_decay);
    mgpu_tensor *logits = mgpu_net_forward(net, x);
    mgpu__net_require_backward(net, "mgpu_net_train_step");
    mgpu__net_backward(net, mgpu__net_loss_grad(net, logits, labels, 1.0f / (float)x->shape.d[0], loss_sum,
                                                "mgpu_net_train_step", 0), 0);
    mgpu_net_step(net, lr, momentum, weight_decay);
}

/* ------------------------------------------------------------ access */
MGPU_DEF int mgpu_net_num_params(const mgpu_net *net) { return net->nparams; }
MGPU_DEF mgpu_param *mgpu_net_param(mgpu_net *net, int i) {
    MGPU_REQUIRE(i >= 0 && i < net->nparams, "mgpu_net_param: index %d of %d", i, net->nparams);
    net->changes++;
    return net->params[i];
}
MGPU_DEF int mgpu_net_num_buffers(const mgpu_net *net) { return net->nbuffers; }
MGPU_DEF mgpu_tensor *mgpu_net_buffer(mgpu_net *net, int i) {
    MGPU_REQUIRE(i >= 0 && i < net->nbuffers, "mgpu_net_buffer: index %d of %d", i, net->nbuffers);
    net->changes++;
    return *net->buffers[i];
}
MGPU_DEF size_t mgpu_net_num_weights(const mgpu_net *net) {
    size_t n = 0;
    for (int i = 0; i < net->nparams; i++) n += net->params[i]->value->numel;
    return n;
}

/* ---------------------------------------------------------- replicas */
static mgpu_tensor *mgpu__clone(const mgpu_tensor *t, mgpu_device *d) {
    return t ? mgpu_to(t, d, 1) : NULL;
}

/* A copy of layer src on device d, with copies of its parameters and
   buffers, or with `share`, src's own (the same tensors: a pipeline
   stage's micro-batch slots); its activations are its own either way. */
static mgpu_layer *mgpu__layer_clone(const mgpu_layer *src, mgpu_device *d, int share) {
    if (!src) return NULL;
    mgpu_layer *l = (mgpu_layer *)mgpu__xcalloc(1, sizeof *l);
    *l = *src; /* the settings */
    l->copies = (struct mgpu__layer_copies *)mgpu__xcalloc(1, sizeof *l->copies);
    l->copies->input_from_batch_norm = src->copies->input_from_batch_norm;
    l->input = NULL;
    l->output = l->dinput = l->dsum = NULL;
    l->dweight = l->dbias = NULL;
    if (!share) {
        if (src->weight.value) l->weight = mgpu__param_new(mgpu__clone(src->weight.value, d));
        if (src->bias.value) l->bias = mgpu__param_new(mgpu__clone(src->bias.value, d));
        l->running_mean = mgpu__clone(src->running_mean, d);
        l->running_var = mgpu__clone(src->running_var, d);
    }
    l->save_mean = mgpu__clone(src->save_mean, d);
    l->save_invstd = mgpu__clone(src->save_invstd, d);
    l->conv1 = mgpu__layer_clone(src->conv1, d, share);
    l->bn1 = mgpu__layer_clone(src->bn1, d, share);
    l->conv2 = mgpu__layer_clone(src->conv2, d, share);
    l->bn2 = mgpu__layer_clone(src->bn2, d, share);
    l->shortcut = mgpu__layer_clone(src->shortcut, d, share);
    return l;
}

/* A new network on dev with net's settings (its mode, checkpointing and
   optimizer), and no layers yet. */
static mgpu_net *mgpu__net_like(const mgpu_net *net, mgpu_device *dev) {
    mgpu_net *copy = mgpu_net_new(dev);
    copy->training = net->training;
    copy->segments = net->segments;
    copy->adam = net->adam, copy->decoupled = net->decoupled;
    copy->beta1 = net->beta1, copy->beta2 = net->beta2, copy->eps = net->eps;
    return copy;
}

MGPU_DEF mgpu_net *mgpu_net_replicate(const mgpu_net *net, mgpu_device *dev) {
    mgpu_net *copy = mgpu__net_like(net, dev);
    for (int i = 0; i < net->nlayers; i++) {
        mgpu__require_own_loops_on_cpu(net->layers[i], dev, "mgpu_net_replicate");
        mgpu__net_add(copy, mgpu__layer_clone(net->layers[i], dev, 0));
    }
    return copy;
}

MGPU_DEF void mgpu_net_copy_params(mgpu_net *dst, const mgpu_net *src, int with_buffers) {
    MGPU_REQUIRE(dst->nparams == src->nparams && dst->nbuffers == src->nbuffers,
                 "mgpu_net_copy_params: the networks differ (%d and %d parameters)", dst->nparams,
                 src->nparams);
    dst->changes++;
    for (int i = 0; i < src->nparams; i++) mgpu_copy(dst->params[i]->value, src->params[i]->value, 1);
    if (with_buffers)
        for (int i = 0; i < src->nbuffers; i++) mgpu_copy(*dst->buffers[i], *src->buffers[i], 1);
}

/* Frees layer l, and its parameters and buffers unless they are another
   layer's (shared: mgpu__layer_clone's). */
static void mgpu__layer_free(mgpu_layer *l, int shared) {
    if (!l) return;
    if (!shared) {
        mgpu_free(l->weight.value);
        mgpu_free(l->weight.grad);
        mgpu_free(l->bias.value);
        mgpu_free(l->bias.grad);
        mgpu_free(l->running_mean);
        mgpu_free(l->running_var);
    }
    mgpu_free(l->save_mean);
    mgpu_free(l->save_invstd);
    mgpu_free(l->output);
    mgpu_free(l->dinput);
    mgpu_free(l->dsum);
    mgpu_free(l->copies->own_input_t);
    mgpu_free(l->copies->output_t);
    mgpu_free(l->copies->dinput_t);
    mgpu_free(l->copies->weight_t);
    mgpu_free(l->copies->weight_turned_t);
    free(l->copies);
    mgpu_free(l->dweight);
    mgpu_free(l->dbias);
    mgpu_layer *parts[5] = {l->conv1, l->bn1, l->conv2, l->bn2, l->shortcut};
    for (int i = 0; i < 5; i++) mgpu__layer_free(parts[i], shared);
    free(l);
}

MGPU_DEF void mgpu_net_free(mgpu_net *net) {
    if (!net) return;
    MGPU_REQUIRE(!net->wrapped, "mgpu_net_free: %s still holds this network; free it first (%s)",
                 mgpu__holder(net, 0), mgpu__holder(net, 2));
    for (int i = 0; i < net->nlayers; i++) mgpu__layer_free(net->layers[i], net->shares_params);
    for (int i = 0; i < net->nparams; i++) {
        mgpu_free(net->momentum[i]);
        mgpu_free(net->second_moment[i]);
    }
    free(net->second_moment);
    free(net->layers);
    free(net->first_param);
    free(net->params);
    free(net->buffers);
    free(net->momentum);
    free(net->segment_start);
    free(net->segment_freed);
    free(net->step_values);
    free((void *)net->step_grads);
    mgpu_free(net->losses);
    mgpu_free(net->dlogits);
    mgpu_free(net->loss_sum);
    free(net);
}

/* -------------------------------------------------------- evaluation */
/* The number of samples of data that forward classifies right. */
static double mgpu__count_correct(mgpu_forward_fn forward, void *model, mgpu_device *dev,
                                  const mgpu_dataset *data, int batch_size) {
    mgpu_loader *loader = mgpu_loader_new(data, batch_size, 0, 0);
    mgpu_loader_start_epoch(loader, 0);
    mgpu_tensor *correct = mgpu_zeros(dev, mgpu_shape1(1));
    mgpu_tensor *count = mgpu_empty(dev, mgpu_shape1(1));
    mgpu_batch b;
    while (mgpu_loader_next(loader, &b)) {
        mgpu_tensor *x = mgpu_to(b.x, dev, 1);
        mgpu_tensor *y = mgpu_to(b.y, dev, 1);
        mgpu_accuracy_count(count, forward(model, x), y);
        mgpu_add_(correct, count); /* counted on the device: one read at the end */
        mgpu_free(x);
        mgpu_free(y);
    }
    double right = mgpu_item(correct, 0);
    mgpu_free(correct);
    mgpu_free(count);
    mgpu_loader_free(loader);
    return right;
}
MGPU_DEF double mgpu_evaluate_accuracy(mgpu_forward_fn forward, void *model, mgpu_device *dev,
                                       const mgpu_dataset *data, int batch_size) {
    return mgpu__count_correct(forward, model, dev, data, batch_size) / (double)data->n;
}

static mgpu_tensor *mgpu__net_forward_fn(void *net, const mgpu_tensor *x) {
    return mgpu_net_forward((mgpu_net *)net, x);
}

/* The net's right answers over data, in evaluation mode. */
static double mgpu__net_count_correct(mgpu_net *net, const mgpu_dataset *data, int batch_size) {
    int was_training = net->training;
    net->training = 0;
    double right = mgpu__count_correct(mgpu__net_forward_fn, net, net->device, data, batch_size);
    net->training = was_training;
    return right;
}
MGPU_DEF double mgpu_net_evaluate_accuracy(mgpu_net *net, const mgpu_dataset *data, int batch_size) {
    return mgpu__net_count_correct(net, data, batch_size) / (double)data->n;
}
