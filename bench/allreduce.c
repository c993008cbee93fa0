/* bench/allreduce.c: how fast is an allreduce? The book's, the ring, NCCL.

   make bench/allreduce && ./bench/allreduce [--devices 4] [--cpu] [--out DIR]

   For vectors of 4 KiB to 256 MiB per device (64 MiB on the CPU), on k
   devices, it times each allreduce and reports, as nccl-tests does:
     time    per allreduce (the average over enough calls to fill ~0.1 s)
     algbw   bytes / time, with bytes the size of ONE device's vector
     busbw   algbw * 2(k-1)/k: what each device must send (and receive) at
             least, per second. It does not depend on k, so it can be held
             against the speed of a link.

   Floors. In the same run it measures how fast the devices copy: each of
   the k devices copies a large vector to the next one, all at once (the
   ring's own pattern). Then, for each algorithm, the bytes it must move
   divided by that rate is a floor no implementation of it can beat, and
   time / floor says how close this one comes. Which bytes count depends on
   where the devices are:

   Devices sharing one memory (virtual devices of one GPU, or CPU devices):
   a "transfer" is a copy inside that memory, and the price is memory
   traffic, bytes read + bytes written. With N the bytes of one vector:
     book  for each of the k-1 other devices: copy it to device 0 (read N,
           write N), add it there (read 2N, write N), copy the sum back
           (read N, write N): 7(k-1)N.
     ring  reduce-scatter: k-1 steps, each device copies one chunk of N/k
           (2N/k) and adds it (3N/k): 5(k-1)N; all-gather: k-1 steps of k
           chunk copies: 2(k-1)N. In all 7(k-1)N, as much as the book's
           version: inside one memory the ring only spreads the same work
           over the devices' queues.
     best  read each of the k inputs once and write each of the k outputs
           once: 2kN. (One kernel that sums all k vectors and writes the
           sum k times; no algorithm can do less.)
   The rate is the traffic of the k copies: 2kB / time for B bytes each.

   Distinct GPUs: the links are the bottleneck; each GPU sends and
   receives at the same time over its own link, so the floor is the bytes
   the busiest GPU must send (or receive), over the rate of one copy:
     book  device 0 receives (k-1)N and sends (k-1)N: (k-1)N.
     ring  every device sends 2(k-1)/k N: busbw is then the link rate.
     nccl  the same bound as the ring (its rings and trees cannot beat it).
     best  2(k-1)/k N: every device must receive the other k-1 devices'
           contributions to what it ends up with, in some combined form.

   Devices spread unevenly (more devices than GPUs, but more than one GPU)
   fit neither picture; the floors are then left out.

   Output: a table, bench_allreduce.csv and bench_allreduce.png (busbw
   against log2 of the size) in --out. */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"

#define MAX_SIZES 16
#define MAX_ALGORITHMS 3

typedef enum { SHARED_MEMORY, LINKS, UNEVEN } topology;

typedef struct {
    const char *name;
    void (*run)(mgpu_tensor **data, int k, mgpu_nccl_comm *nccl);
    int through_device0; /* the book's: everything goes over device 0's link */
} algorithm;

static void run_book(mgpu_tensor **data, int k, mgpu_nccl_comm *nccl) {
    (void)nccl;
    mgpu_allreduce(data, k);
}
static void run_ring(mgpu_tensor **data, int k, mgpu_nccl_comm *nccl) {
    (void)nccl;
    mgpu_ring_allreduce(data, k, 0);
}
static void run_nccl(mgpu_tensor **data, int k, mgpu_nccl_comm *nccl) {
    (void)k;
    mgpu_nccl_allreduce(nccl, data, 0);
}

/* The floor of an algorithm for vectors of n bytes, in seconds (the
   counts are in the comment at the top); 0 when there is none. */
static double floor_seconds(topology where, const algorithm *a, int k, double n, double rate) {
    if (where == SHARED_MEMORY) return 7.0 * (k - 1) * n / rate; /* the book's and the ring alike */
    if (where == LINKS) return (a->through_device0 ? k - 1.0 : 2.0 * (k - 1) / k) * n / rate;
    return 0;
}
static double best_floor_seconds(topology where, int k, double n, double rate) {
    if (where == SHARED_MEMORY) return 2.0 * k * n / rate;
    if (where == LINKS) return 2.0 * (k - 1) / k * n / rate;
    return 0;
}

static topology where_are(mgpu_device *const *dev, int k) {
    int distinct = 0, gpus = 0;
    for (int i = 0; i < k; i++) {
        int seen = 0;
        for (int j = 0; j < i; j++) seen |= mgpu_device_gpu_index(dev[j]) == mgpu_device_gpu_index(dev[i]);
        distinct += !seen;
        gpus += mgpu_device_is_gpu(dev[i]);
    }
    if (distinct == 1) return SHARED_MEMORY; /* one GPU, or the CPU */
    if (gpus == k && distinct == k) return LINKS;
    return UNEVEN;
}

/* The copy rate: every device copies `bytes` to the next one, all at once.
   Returns bytes per second of one copy. */
static double measure_copy_rate(mgpu_device *const *dev, int k, size_t bytes) {
    mgpu_tensor *from[MGPU_MAX_DEVICES], *to[MGPU_MAX_DEVICES];
    mgpu_shape s = mgpu_shape1((int)(bytes / sizeof(float)));
    for (int i = 0; i < k; i++) {
        from[i] = mgpu_zeros(dev[i], s);
        to[i] = mgpu_empty(dev[i], s);
    }
    double best = 1e30;
    for (int rep = 0; rep < 8; rep++) { /* the first one warms up; keep the fastest */
        mgpu_synchronize_all();
        double t0 = mgpu_now();
        for (int i = 0; i < k; i++) mgpu_copy(to[(i + 1) % k], from[i], 1);
        mgpu_synchronize_all();
        if (rep > 0 && mgpu_now() - t0 < best) best = mgpu_now() - t0;
    }
    for (int i = 0; i < k; i++) {
        mgpu_free(from[i]);
        mgpu_free(to[i]);
    }
    return (double)bytes / best;
}

/* One call, then the sum checked on every device (device i holds i+1, so
   each must hold k(k+1)/2); then zeros, whose sums stay zeros. */
static void check_once(const algorithm *a, mgpu_tensor **data, int k, mgpu_nccl_comm *nccl) {
    for (int i = 0; i < k; i++) mgpu_fill(data[i], (float)(i + 1));
    a->run(data, k, nccl);
    float want = (float)k * (k + 1) / 2;
    for (int i = 0; i < k; i++) {
        float first = mgpu_item(data[i], 0), last = mgpu_item(data[i], data[i]->numel - 1);
        MGPU_REQUIRE(first == want && last == want,
                     "%s allreduce: device %d holds %g and %g, not %g", a->name, i, first, last, want);
        mgpu_fill(data[i], 0.0f);
    }
}

/* Seconds per call: enough calls back to back to fill about 0.1 s. */
static double seconds_per_call(const algorithm *a, mgpu_tensor **data, int k, mgpu_nccl_comm *nccl) {
    mgpu_synchronize_all();
    double t0 = mgpu_now();
    a->run(data, k, nccl);
    mgpu_synchronize_all();
    double one = mgpu_now() - t0;
    int calls = one > 0.1 ? 1 : one < 1e-5 ? 10000 : (int)(0.1 / one) + 1;
    t0 = mgpu_now();
    for (int c = 0; c < calls; c++) a->run(data, k, nccl);
    mgpu_synchronize_all();
    return (mgpu_now() - t0) / calls;
}

static const char *size_str(double bytes, char *buf, size_t size) {
    if (bytes >= 1 << 20) snprintf(buf, size, "%g MiB", bytes / (1 << 20));
    else snprintf(buf, size, "%g KiB", bytes / 1024);
    return buf;
}

int main(int argc, char **argv) {
    mgpu_options o;
    memset(&o, 0, sizeof o);
    o.devices = 2;
    int max_mib = 0;
    const mgpu_flag extra[] = {
        {"--max-mib", 'i', &max_mib, "largest vector per device in MiB (default 256, 64 on the CPU)"},
    };
    mgpu_options_parse(&o, argc, argv,
                       "bench/allreduce: the book's allreduce, the ring and NCCL, from 4 KiB to 256 MiB "
                       "per device, against floors from the measured copy rate",
                       extra, 1);
    MGPU_REQUIRE(max_mib <= 4096, "--max-mib %d: at most 4096 (a tensor holds fewer than 2^31 values)",
                 max_mib);
    int k = o.devices;
    MGPU_REQUIRE(k >= 2, "--devices: an allreduce needs at least 2 devices, not %d", k);
    mgpu_device *dev[MGPU_MAX_DEVICES];
    mgpu_devices(k, !o.cpu, dev);
    int on_gpu = mgpu_device_is_gpu(dev[0]);
    if (!max_mib) max_mib = on_gpu ? 256 : 64;

    char list[256];
    printf("allreduce on %d devices %s\n", k, mgpu_device_list(list, sizeof list, dev, k));
    if (!on_gpu && max_mib < 256)
        printf("On the CPU the sizes stop at %d MiB (--max-mib to change).\n", max_mib);
    topology where = where_are(dev, k);
    if (where == SHARED_MEMORY)
        printf("The %d devices are virtual: they share one memory (%s), so a transfer between two of "
               "them is a copy inside it. The floors count memory traffic: bytes read + bytes written.\n",
               k, on_gpu ? "one GPU's" : "the host's");
    else if (where == LINKS)
        printf("The %d devices are distinct GPUs; the floors count the bytes the busiest GPU sends over "
               "its link.\n", k);
    else
        printf("The devices share some GPUs and not others: no simple floor, so none is shown.\n");

    mgpu_enable_peer_access(dev, k);
    mgpu_nccl_comm *nccl = mgpu_nccl_init(dev, k);
    if (!nccl)
        printf("NCCL: not used: %s.\n", !on_gpu ? "CPU devices have no NCCL"
                                                : "it needs distinct GPUs, and NCCL before 2.30 refuses "
                                                  "two ranks on one GPU");

    size_t largest = (size_t)max_mib << 20;
    double rate = measure_copy_rate(dev, k, largest);
    char s1[32];
    if (where == SHARED_MEMORY)
        printf("copy rate: %d copies of %s at once, device i to device i+1: %.1f GB/s each, "
               "%.1f GB/s of memory traffic (read + write)\n",
               k, size_str((double)largest, s1, sizeof s1), rate / 1e9, 2.0 * k * rate / 1e9);
    else
        printf("copy rate: %d copies of %s at once, device i to device i+1: %.1f GB/s each\n", k,
               size_str((double)largest, s1, sizeof s1), rate / 1e9);
    double floor_rate = where == SHARED_MEMORY ? 2.0 * k * rate : rate;

    const algorithm all[MAX_ALGORITHMS] = {
        {"book", run_book, 1}, {"ring", run_ring, 0}, {"nccl", run_nccl, 0}};
    int nalgorithms = nccl ? 3 : 2;

    double log2_bytes[MAX_SIZES], busbw[MAX_ALGORITHMS][MAX_SIZES], best_busbw[MAX_SIZES];
    int nsizes = 0, below_floor = 0;
    char csv_path[1024], png_path[1024];
    mgpu_out_path(&o, "bench_allreduce.csv", csv_path, sizeof csv_path);
    mgpu_out_path(&o, "bench_allreduce.png", png_path, sizeof png_path);
    FILE *csv = fopen(csv_path, "w");
    MGPU_REQUIRE(csv != NULL, "%s: cannot write (%s)", csv_path, strerror(errno));
    fprintf(csv, "bytes,algorithm,time_us,algbw_GBps,busbw_GBps,floor_us,time_over_floor,best_floor_us\n");

    printf("\n%9s  %-9s %11s %11s %11s %11s %10s\n", "size", "algorithm", "time (us)", "algbw GB/s",
           "busbw GB/s", "floor (us)", "time/floor");
    for (size_t bytes = 4096; bytes <= largest && nsizes < MAX_SIZES; bytes *= 4, nsizes++) {
        mgpu_tensor *data[MGPU_MAX_DEVICES];
        for (int i = 0; i < k; i++) data[i] = mgpu_empty(dev[i], mgpu_shape1((int)(bytes / sizeof(float))));
        double n = (double)bytes, best = best_floor_seconds(where, k, n, floor_rate);
        log2_bytes[nsizes] = log2(n);
        best_busbw[nsizes] = best > 0 ? n / best * 2.0 * (k - 1) / k / 1e9 : NAN;
        for (int a = 0; a < nalgorithms; a++) {
            check_once(&all[a], data, k, nccl);
            double t = seconds_per_call(&all[a], data, k, nccl);
            double algbw = n / t / 1e9, fl = floor_seconds(where, &all[a], k, n, floor_rate);
            busbw[a][nsizes] = algbw * 2.0 * (k - 1) / k;
            char ratio[32] = "", floor_us[32] = "", best_us[32] = "";
            if (fl > 0) {
                below_floor |= t < fl;
                snprintf(ratio, sizeof ratio, "%.2f", t / fl);
                snprintf(floor_us, sizeof floor_us, "%.1f", fl * 1e6);
                snprintf(best_us, sizeof best_us, "%.1f", best * 1e6);
            }
            printf("%9s  %-9s %11.1f %11.2f %11.2f %11s %10s\n", a ? "" : size_str(n, s1, sizeof s1),
                   all[a].name, t * 1e6, algbw, busbw[a][nsizes], fl > 0 ? floor_us : "-",
                   fl > 0 ? ratio : "-");
            fprintf(csv, "%zu,%s,%.3f,%.4f,%.4f,%s,%s,%s\n", bytes, all[a].name, t * 1e6, algbw,
                    busbw[a][nsizes], floor_us, ratio, best_us);
        }
        if (best > 0)
            printf("%9s  %-9s %11s %11s %11.2f %11.1f\n", "", "(best)", "-", "-", best_busbw[nsizes],
                   best * 1e6);
        for (int i = 0; i < k; i++) mgpu_free(data[i]);
    }
    fclose(csv);
    if (below_floor)
        printf("time/floor below 1: the rate behind the floors was beaten. Data used again while it "
               "is still in the caches moves faster than the large copies that measured the rate, and "
               "on a busy machine the rate itself varies.\n");

    mgpu_series series[MAX_ALGORITHMS + 1];
    memset(series, 0, sizeof series);
    for (int a = 0; a < nalgorithms; a++) {
        series[a].name = all[a].name;
        series[a].n = nsizes;
        series[a].x = log2_bytes;
        series[a].y = busbw[a];
    }
    int nseries = nalgorithms;
    if (where != UNEVEN) {
        series[nseries].name = "best possible (floor)";
        series[nseries].n = nsizes;
        series[nseries].x = log2_bytes;
        series[nseries].y = best_busbw;
        series[nseries].dashed = 1;
        nseries++;
    }
    char title[300];
    snprintf(title, sizeof title, "allreduce on %s%s", list,
             where == SHARED_MEMORY ? ", one shared memory" : "");
    mgpu_chart chart;
    memset(&chart, 0, sizeof chart);
    chart.title = title;
    chart.width = 800;
    chart.xlabel = "log2(bytes per device); 20 is 1 MiB"; /* the charts have no log scale */
    chart.ylabel = "busbw (GB/s)";
    chart.nseries = nseries;
    chart.series = series;
    mgpu_chart_write_png(&chart, png_path);
    printf("\nwrote %s and %s\n", csv_path, png_path);
    mgpu_nccl_free(nccl);
    return 0;
}
