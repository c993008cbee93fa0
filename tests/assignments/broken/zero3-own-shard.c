/* A broken solution of the ZeRO-3 assignment, with a mistake students
   make: each replica fills the whole value with its own shard, in every
   place, rather than with shard k in place k. The memory is right, and
   the training runs, but every replica trains a network of repeated
   pieces (its checker must fail the values test). */
static void gather(const zero3_context *c, mgpu_param *param, int p) {
    if (param->value) return; /* (whole already) */
    mgpu_tensor *whole = mgpu_empty(c->devices[c->replica], c->shape[p]);
    mgpu_tensor *flat = mgpu_view(whole, mgpu_shape1((int)whole->numel));
    int len = c->shard_len[p], numel = (int)whole->numel;
    for (int k = 0; k < c->world && k * len < numel; k++) {
        int here = numel - k * len < len ? numel - k * len : len; /* (the last shard's padding stays behind) */
        mgpu_tensor *place = mgpu_narrow(flat, k * len, here);
        mgpu_tensor *shard = mgpu_narrow(c->shards[p][c->replica], 0, here);
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
        if (when == MGPU_BEFORE_FORWARD || when == MGPU_BEFORE_BACKWARD) {
            gather(c, param, p);
        } else {
            mgpu_free(param->value);
            param->value = NULL;
        }
    }
}
