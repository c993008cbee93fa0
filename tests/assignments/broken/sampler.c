/* A distributed sampler with a mistake students make: each rank takes a
   block of the order, positions r * count to (r + 1) * count - 1, rather
   than every world-th position from r. The counts, the padding and the
   ranks' union are right; which rank has which sample is not the
   library's (its checker must fail). */
int distributed_sampler(const int *order, int n, int world, int rank, int drop_last, int *out) {
    int count = drop_last ? n / world : (n + world - 1) / world;
    for (int i = 0; i < count; i++) out[i] = order[(rank * count + i) % n];
    return count;
}
