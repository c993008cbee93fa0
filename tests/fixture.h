/* tests/fixture.h: reads the files tests/make_fixtures.py writes, and makes
   the same formula-defined parameters and inputs the script uses. */
#ifndef MGPU_FIXTURE_H
#define MGPU_FIXTURE_H

typedef struct { char name[64]; mgpu_shape shape; size_t numel; float *values; } fixture_tensor;
typedef struct { int n; fixture_tensor *tensors; } fixture;

static fixture fixture_load(const char *path) {
    fixture f = {0, NULL};
    FILE *file = fopen(path, "rb");
    if (!file) mgpu_fatal("%s: cannot open the fixture (%s)", path, strerror(errno));
    char magic[8];
    uint32_t count;
    if (fread(magic, 1, 8, file) != 8 || memcmp(magic, "MGPUFIX1", 8) != 0 ||
        fread(&count, 4, 1, file) != 1 || count > 1000)
        mgpu_fatal("%s: not a fixture file", path);
    f.n = (int)count;
    f.tensors = (fixture_tensor *)calloc(count, sizeof(fixture_tensor));
    for (uint32_t i = 0; i < count; i++) {
        fixture_tensor *t = &f.tensors[i];
        uint32_t dims[5];
        if (fread(t->name, 1, 64, file) != 64 || fread(dims, 4, 5, file) != 5 || dims[0] < 1 ||
            dims[0] > 4)
            mgpu_fatal("%s: truncated fixture", path);
        t->name[63] = 0;
        t->shape.ndim = (int)dims[0];
        for (int k = 0; k < 4; k++) t->shape.d[k] = (int)dims[1 + k];
        t->numel = mgpu_shape_numel(t->shape);
        t->values = (float *)malloc(t->numel * sizeof(float));
        if (fread(t->values, sizeof(float), t->numel, file) != t->numel)
            mgpu_fatal("%s: truncated fixture", path);
    }
    fclose(file);
    return f;
}

static const fixture_tensor *fixture_get(const fixture *f, const char *name) {
    for (int i = 0; i < f->n; i++)
        if (strcmp(f->tensors[i].name, name) == 0) return &f->tensors[i];
    mgpu_fatal("fixture has no tensor '%s'", name);
    return NULL;
}

static void fixture_free(fixture *f) {
    for (int i = 0; i < f->n; i++) free(f->tensors[i].values);
    free(f->tensors);
}

/* Element i of tensor k: base + amp * sin(0.7 i + 1.3 k + 0.1), as the script. */
static mgpu_tensor *formula_tensor(mgpu_device *d, mgpu_shape s, int k, double base, double amp) {
    size_t n = mgpu_shape_numel(s);
    float *v = (float *)malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) v[i] = (float)(base + amp * sin(0.7 * (double)i + 1.3 * k + 0.1));
    mgpu_tensor *t = mgpu_from_host(d, s, v);
    free(v);
    return t;
}

/* Fills an existing tensor with the formula (for parameters a model made). */
static void formula_into(mgpu_tensor *t, int k, double base, double amp) {
    mgpu_tensor *src = formula_tensor(mgpu_cpu(), t->shape, k, base, amp);
    mgpu_copy(t, src, 0);
    mgpu_free(src);
}

static mgpu_tensor *fixture_tensor_on(const fixture_tensor *t, mgpu_device *d) {
    return mgpu_from_host(d, t->shape, t->values);
}

/* Largest |got - want| / (atol + rtol |want|); the check passes when <= 1. */
static double fixture_compare(const mgpu_tensor *got, const fixture_tensor *want, double atol,
                              double rtol) {
    if (got->numel != want->numel) {
        fprintf(stderr, "  %s: %zu values, want %zu\n", want->name, got->numel, want->numel);
        return 1e30;
    }
    float *v = (float *)malloc(got->numel * sizeof(float));
    mgpu_to_host(got, v);
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < got->numel; i++) {
        double r = fabs((double)v[i] - want->values[i]) / (atol + rtol * fabs(want->values[i]));
        if (r > worst) { worst = r; at = i; }
    }
    if (worst > 1)
        fprintf(stderr, "  %s[%zu] = %.8g, PyTorch %.8g (atol %g, rtol %g)\n", want->name, at,
                v[at], want->values[at], atol, rtol);
    free(v);
    return worst;
}
#endif
