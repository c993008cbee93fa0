/* mgpu/flags.h: the chapters' command-line flags, each checked against
   its type and bounds, with --help built from the same table; and where
   output files go. Every chapter reads it in main's first lines.
   defines: mgpu_options_parse, mgpu_out_path */
static void mgpu__flag_set(const mgpu_flag *f, const char *text) {
    char *end = NULL;
    errno = 0;
    /* The value is the number alone: strtol and strtod would pass over
       spaces before it, and take a '+'. */
    int starts_like_a_number = isdigit((unsigned char)text[0]) || text[0] == '.' || text[0] == '-';
    if (f->type == 'i' || f->type == 'u') {
        long v = strtol(text, &end, 10), least = f->type == 'u' ? 0 : 1;
        if (!starts_like_a_number || errno || *end || end == text || v < least || v > 1000000000)
            mgpu_fatal("%s: expected %s, got '%s'", f->name,
                       least ? "a positive whole number" : "a whole number of 0 or more", text);
        *(int *)f->value = (int)v;
    } else if (f->type == 'd' || f->type == 'z') {
        double v = strtod(text, &end);
        int zero_too = f->type == 'z';
        if (!starts_like_a_number || *end || end == text || !(v > 0 || (zero_too && v == 0)))
            mgpu_fatal("%s: expected %s, got '%s'", f->name, zero_too ? "a number of 0 or more" : "a positive number",
                       text);
        if (errno || (v != 0 && v < FLT_MIN) || v > FLT_MAX) /* (the library computes in float) */
            mgpu_fatal("%s: %s is out of float's range (%g to %g)", f->name, text, FLT_MIN, FLT_MAX);
        *(double *)f->value = v;
    } else {
        if (!*text) mgpu_fatal("%s: expected %s, got ''", f->name, f->type == 'f' ? "a folder" : "a name");
        *(const char **)f->value = text;
    }
}

/* Makes folder dir and the folders above it where missing (mkdir -p),
   and checks that the program can write there. */
static void mgpu__make_out_folder(const char *dir) {
    char path[1024];
    if (strlen(dir) >= sizeof path - 64) /* (room for the file names after it) */
        mgpu_fatal("--out: a folder name of at most %d characters, got %zu", (int)sizeof path - 65, strlen(dir));
    snprintf(path, sizeof path, "%s", dir);
    for (char *p = path + 1; ; p++) { /* one component at a time */
        char c = *p;
        if (c == '/' || c == 0) {
            *p = 0;
            if (mkdir(path, 0777) != 0 && errno != EEXIST)
                mgpu_fatal("--out %s: cannot create folder %s (%s)", dir, path, strerror(errno));
            *p = c;
        }
        if (!c) break;
    }
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) mgpu_fatal("--out %s: not a folder", dir);
    if (access(dir, W_OK) != 0) mgpu_fatal("--out %s: cannot write there (%s)", dir, strerror(errno));
}

static void mgpu__flag_print(const mgpu_flag *f) {
    char value[64] = "";
    if (f->type == 'u') snprintf(value, sizeof value, " N (now %d)", *(int *)f->value);
    if (f->type == 'i' && *(int *)f->value) snprintf(value, sizeof value, " N (now %d)", *(int *)f->value);
    if (f->type == 'i' && !*(int *)f->value) snprintf(value, sizeof value, " N");
    if (f->type == 'd' && *(double *)f->value) snprintf(value, sizeof value, " X (now %g)", *(double *)f->value);
    if (f->type == 'd' && !*(double *)f->value) snprintf(value, sizeof value, " X");
    if (f->type == 'z') snprintf(value, sizeof value, " X (now %g)", *(double *)f->value);
    if (f->type == 's' || f->type == 'f') {
        const char *v = *(const char **)f->value;
        snprintf(value, sizeof value, " %s (now %s)", f->type == 'f' ? "DIR" : "NAME", v ? v : "unset");
    }
    char left[96];
    snprintf(left, sizeof left, "%s%s", f->name, value);
    printf("  %-32s %s\n", left, f->help);
}

MGPU_DEF void mgpu_options_parse(mgpu_options *o, int argc, char **argv, const char *about,
                                 const mgpu_flag *extra, int nextra) {
    /* one line at a time, also into a pipe or a log, so that the lines on
       stdout and the progress lines on stderr come out in order */
    setvbuf(stdout, NULL, _IOLBF, 0);
    int seed = (int)o->seed, help = 0;
    const mgpu_flag common[] = {
        {"--devices", 'i', &o->devices, "number of (logical) devices"},
        {"--epochs", 'i', &o->epochs, "passes over the training data"},
        {"--batch-size", 'i', &o->batch_size, "global batch size, split over the devices"},
        {"--lr", 'd', &o->lr, "learning rate"},
        {"--data", 'f', &o->data, "Fashion-MNIST folder (else $MGPU_DATA, then data/fashion-mnist)"},
        {"--out", 'f', &o->out, "folder for the PNG and CSV files"},
        {"--seed", 'u', &seed, "random seed"},
        {"--cpu", 'b', &o->cpu, "use CPU devices even when there are GPUs"},
        {"--full", 'b', &o->full, "the book's full setting, also without a GPU"},
        {"--help", 'b', &help, "print this help"},
    };
    int ncommon = (int)(sizeof common / sizeof common[0]);
    /* A chapter's own flags first: one may give a common flag its own meaning. */
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        const mgpu_flag *f = NULL;
        for (int k = 0; k < nextra + ncommon && !f; k++) {
            const mgpu_flag *c = k < nextra ? &extra[k] : &common[k - nextra];
            if (strcmp(arg, c->name) == 0) f = c;
        }
        if (!f) mgpu_fatal("unknown flag '%s' (try --help)", arg);
        if (f->type == 'n') mgpu_fatal("%s: %s", arg, f->help);
        if (f->type == 'b') {
            *(int *)f->value = 1;
            continue;
        }
        if (i + 1 >= argc || strncmp(argv[i + 1], "--", 2) == 0)
            mgpu_fatal("%s needs a value (try --help)", arg);
        mgpu__flag_set(f, argv[++i]);
    }
    o->seed = (uint64_t)seed;
    if (help) {
        printf("%s\n\nflags:\n", about);
        for (int k = 0; k < ncommon; k++) {
            int overridden = 0;
            for (int e = 0; e < nextra; e++) overridden |= strcmp(extra[e].name, common[k].name) == 0;
            if (!overridden) mgpu__flag_print(&common[k]);
        }
        for (int k = 0; k < nextra; k++)
            if (extra[k].type != 'n') mgpu__flag_print(&extra[k]);
        exit(0);
    }
    /* Checked now, not when a run has ended: */
    if (o->devices > MGPU_MAX_DEVICES)
        mgpu_fatal("--devices %d: at most %d devices", o->devices, MGPU_MAX_DEVICES);
    if (o->epochs > MGPU_TIMER_MAX)
        mgpu_fatal("--epochs %d: at most %d (a timer keeps that many epochs' times)", o->epochs, MGPU_TIMER_MAX);
    if (!o->out) o->out = ".";
    mgpu__make_out_folder(o->out);
}

MGPU_DEF const char *mgpu_out_path(const mgpu_options *o, const char *name, char *buf, size_t size) {
    const char *dir = o->out ? o->out : ".";
    mgpu__make_out_folder(dir);
    snprintf(buf, size, "%s/%s", dir, name);
    return buf;
}
