/* The ring allreduce assignment, the reference solution (docs/assignments.md).
   Each vector is cut into n chunks. Reduce-scatter: in n-1 steps device i
   adds its chunk (i - s) mod n into device i+1's, after which device i
   holds the whole sum of chunk i+1. All-gather: n-1 steps pass the
   finished chunks round the ring. Only the library's public operations. */
void ring_allreduce(mgpu_tensor **data, int n) {
    int numel = (int)data[0]->numel, chunk = (numel + n - 1) / n;
    for (int phase = 0; phase < 2; phase++) /* reduce-scatter, then all-gather */
        for (int s = 0; s < n - 1; s++)
            for (int i = 0; i < n; i++) {
                int to = (i + 1) % n, c = ((i - s + phase) % n + n) % n, start = c * chunk;
                if (start >= numel) continue;
                int length = numel - start < chunk ? numel - start : chunk;
                mgpu_tensor *mine = mgpu_narrow(data[i], start, length);
                mgpu_tensor *theirs = mgpu_narrow(data[to], start, length);
                mgpu_tensor *sent = mgpu_to(mine, theirs->device, 1);
                if (phase == 0)
                    mgpu_add_(theirs, sent);
                else
                    mgpu_copy(theirs, sent, 1);
                mgpu_free(sent);
                mgpu_free(mine);
                mgpu_free(theirs);
            }
}
