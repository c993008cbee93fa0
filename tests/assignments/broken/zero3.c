/* A broken solution of the ZeRO-3 assignment, with a mistake students
   make: the whole values gathered and never freed. The gradients come
   out, but every device ends up holding every layer's whole parameters,
   the memory ZeRO-3 is there to save, and (gathered once) they are the
   first step's values ever after (its checker must fail the memory
   tests). */
static void gather(const zero3_context *c, mgpu_param *param, int p) {
    if (param->value) return; /* (whole already) */
    mgpu_tensor *whole = mgpu_empty(c->devices[c->replica], c->shape[p]);
    mgpu_tensor *flat = mgpu_view(whole, mgpu_shape1((int)whole->numel));
    int len = c->shard_len[p], numel = (int)whole->numel;
    for (int k = 0; k < c->world && k * len < numel; k++) {
        int here = numel - k * len < len ? numel - k * len : len; /* (the last shard's padding stays behind) */
        mgpu_tensor *place = mgpu_narrow(flat, k * len, here), *shard = mgpu_narrow(c->shards[p][k], 0, here);
        mgpu_copy(place, shard, 0);
        mgpu_free(shard);
        mgpu_free(place);
    }
    mgpu_free(flat);
    param->value = whole;
}
void zero3_layer_hook(void *ctx, mgpu_net *net, int layer, int when) {
    const zero3_context *c = (const zero3_context *)ctx;
    for (int p = net->first_param[layer]; p < net->first_param[layer + 1]; p++) {
        mgpu_param *param = net->params[p];
        if (when == MGPU_BEFORE_FORWARD || when == MGPU_BEFORE_BACKWARD) gather(c, param, p);
    }
}
