/* The distributed-sampler assignment, the reference solution
   (docs/assignments.md): rank `rank` of `world`'s share of the epoch's
   order, as PyTorch's DistributedSampler takes it. Every rank takes the
   same number of samples, ceil(n / world), or floor(n / world) with
   drop_last, so that the ranks' steps pair up. The order is made that
   many times world long, by going on from its start (round it again and
   again where ranks outnumber samples twice over) or by cutting its
   tail; rank r then takes positions r, r + world, r + 2 world, ... Where
   p runs past the order's end, position p of the longer order is
   order[p % n]. */
int distributed_sampler(const int *order, int n, int world, int rank, int drop_last, int *out) {
    int count = drop_last ? n / world : (n + world - 1) / world;
    for (int i = 0; i < count; i++) out[i] = order[(rank + i * world) % n];
    return count;
}
