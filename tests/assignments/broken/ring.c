/* A ring allreduce with a mistake students make: the reduce-scatter
   alone, without the all-gather, so each device holds the sum of one
   chunk only (its checker must fail). */
void ring_allreduce(mgpu_tensor **data, int n) {
    int numel = (int)data[0]->numel, chunk = (numel + n - 1) / n;
    for (int s = 0; s < n - 1; s++)
        for (int i = 0; i < n; i++) {
            int to = (i + 1) % n, start = ((i - s) % n + n) % n * chunk;
            if (start >= numel) continue;
            int length = numel - start < chunk ? numel - start : chunk;
            mgpu_tensor *mine = mgpu_narrow(data[i], start, length);
            mgpu_tensor *theirs = mgpu_narrow(data[to], start, length);
            mgpu_tensor *sent = mgpu_to(mine, theirs->device, 1);
            mgpu_add_(theirs, sent);
            mgpu_free(sent);
            mgpu_free(mine);
            mgpu_free(theirs);
        }
}
