/* tests/test_plot.c: the PNG drawing and plotting section.

   Pictures are written to a fresh folder under /tmp, read back with
   stb_image and checked pixel by pixel at places whose colour is known:
   inside and outside a rectangle, along a line, the lit pixels of a glyph,
   the frame and a curve of a chart, a timeline's bars. The CSV of the
   Animator is compared as text, and the error line of a file that cannot
   be written is captured from stderr. */
#define MGPU_IMPLEMENTATION
#include "../mgpu.h"
#include "test.h"
#include <ftw.h>
#include <stb/stb_image.h>
#include <sys/resource.h>
#include <sys/stat.h>

/* ---- helpers ---- */

/* The pictures go to a fresh folder, removed when the program ends. */
static char tmp_dir[64];

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st, (void)flag, (void)ftw;
    return remove(path);
}
static void remove_tmp_dir(void) { nftw(tmp_dir, remove_entry, 8, FTW_DEPTH | FTW_PHYS); }

static const char *tmp_path(const char *name) {
    static char path[4][256]; /* a few at a time may be in use */
    static int next;
    if (!tmp_dir[0]) {
        strcpy(tmp_dir, "/tmp/mgpu_test_plot_XXXXXX");
        if (!mkdtemp(tmp_dir)) {
            perror("mkdtemp");
            exit(2);
        }
        atexit(remove_tmp_dir);
    }
    next = (next + 1) % 4;
    snprintf(path[next], sizeof path[next], "%s/%s", tmp_dir, name);
    return path[next];
}

typedef struct {
    int w, h;
    unsigned char *rgb;
} image;

static image load_png(const char *path) {
    image im;
    int channels;
    im.rgb = stbi_load(path, &im.w, &im.h, &channels, 3);
    if (!im.rgb) im.w = im.h = 0;
    return im;
}

static uint32_t at(const image *im, int x, int y) {
    const unsigned char *p;
    if (x < 0 || y < 0 || x >= im->w || y >= im->h) return 0xDEADBEEF; /* no such pixel */
    p = im->rgb + ((size_t)y * im->w + x) * 3;
    return (uint32_t)p[0] << 16 | (uint32_t)p[1] << 8 | p[2];
}

static uint32_t canvas_at(const mgpu_canvas *c, int x, int y) {
    image im;
    im.w = c->width, im.h = c->height, im.rgb = c->rgb;
    return at(&im, x, y);
}

/* The first column (scanning from x by dx) that holds a vertical run of at
   least `run` pixels of colour rgb, or -1: this is how frames are found. */
static int find_column(const image *im, int x, int dx, int run, uint32_t rgb) {
    for (; x >= 0 && x < im->w; x += dx)
        for (int y = 0, length = 0; y < im->h; y++)
            if ((length = at(im, x, y) == rgb ? length + 1 : 0) >= run) return x;
    return -1;
}

static int find_row(const image *im, int y, int dy, int run, uint32_t rgb) {
    for (; y >= 0 && y < im->h; y += dy)
        for (int x = 0, length = 0; x < im->w; x++)
            if ((length = at(im, x, y) == rgb ? length + 1 : 0) >= run) return y;
    return -1;
}

static int near_color(const image *im, int x, int y, uint32_t rgb) /* within one pixel */
{
    for (int j = -1; j <= 1; j++)
        for (int i = -1; i <= 1; i++)
            if (at(im, x + i, y + j) == rgb) return 1;
    return 0;
}

static int file_exists(const char *path) { return access(path, F_OK) == 0; }

static const char *read_text(const char *path) {
    static char text[4096];
    FILE *f = fopen(path, "r");
    size_t n = 0;
    if (f) {
        n = fread(text, 1, sizeof text - 1, f);
        fclose(f);
    }
    text[n] = 0;
    return text;
}

/* stderr goes to a temporary file between capture_begin and capture_end,
   which returns what was written. */
static FILE *capture_file;
static int capture_saved_fd;
static void capture_begin(void) {
    fflush(stderr);
    capture_file = tmpfile();
    capture_saved_fd = dup(2);
    dup2(fileno(capture_file), 2);
}
static const char *capture_end(void) {
    static char text[4096];
    size_t n;
    fflush(stderr);
    dup2(capture_saved_fd, 2);
    close(capture_saved_fd);
    rewind(capture_file);
    n = fread(text, 1, sizeof text - 1, capture_file);
    text[n] = 0;
    fclose(capture_file);
    return text;
}

static int is_palette_color(uint32_t rgb) {
    for (int i = 0; i < 10; i++)
        if (mgpu_palette(i) == rgb) return 1;
    return 0;
}

/* ---- the canvas ---- */

TEST(canvas_fill_rect_png_round_trip) {
    mgpu_canvas *c = mgpu_canvas_new(40, 30, 0x102030);
    const char *path = tmp_path("rect.png");
    char tmp[300];
    image im;
    mgpu_canvas_fill_rect(c, 5, 6, 15, 16, 0xAABBCC);
    mgpu_canvas_fill_rect(c, -10, 25, 100, 100, 0x00FF00); /* clipped to the canvas */
    mgpu_canvas_fill_rect(c, 50, 50, 60, 60, 0xFF0000);    /* wholly outside: nothing */
    CHECK_EQ_INT(mgpu_canvas_write_png(c, path), 0);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    CHECK(!file_exists(tmp)); /* renamed into place */
    im = load_png(path);
    CHECK_EQ_INT(im.w, 40);
    CHECK_EQ_INT(im.h, 30);
    CHECK_EQ_INT(at(&im, 5, 6), 0xAABBCC);
    CHECK_EQ_INT(at(&im, 14, 15), 0xAABBCC);
    CHECK_EQ_INT(at(&im, 15, 15), 0x102030); /* x1 and y1 are excluded */
    CHECK_EQ_INT(at(&im, 14, 16), 0x102030);
    CHECK_EQ_INT(at(&im, 4, 6), 0x102030);
    CHECK_EQ_INT(at(&im, 0, 29), 0x00FF00);
    CHECK_EQ_INT(at(&im, 39, 25), 0x00FF00);
    CHECK_EQ_INT(at(&im, 0, 24), 0x102030);
    stbi_image_free(im.rgb);
    mgpu_canvas_free(c);
}

TEST(canvas_line_thickness_and_clipping) {
    mgpu_canvas *c = mgpu_canvas_new(60, 40, 0xFFFFFF);
    mgpu_canvas_line(c, 5, 10, 50, 10, 0x000000, 1);
    for (int x = 5; x <= 50; x++) CHECK_EQ_INT(canvas_at(c, x, 10), 0x000000);
    CHECK_EQ_INT(canvas_at(c, 4, 10), 0xFFFFFF);
    CHECK_EQ_INT(canvas_at(c, 51, 10), 0xFFFFFF);
    CHECK_EQ_INT(canvas_at(c, 20, 9), 0xFFFFFF);
    CHECK_EQ_INT(canvas_at(c, 20, 11), 0xFFFFFF);

    mgpu_canvas_line(c, 5, 20, 50, 20, 0xFF0000, 3); /* rows 19, 20 and 21 */
    CHECK_EQ_INT(canvas_at(c, 30, 19), 0xFF0000);
    CHECK_EQ_INT(canvas_at(c, 30, 21), 0xFF0000);
    CHECK_EQ_INT(canvas_at(c, 30, 18), 0xFFFFFF);
    CHECK_EQ_INT(canvas_at(c, 30, 22), 0xFFFFFF);

    mgpu_canvas_line(c, 0, 0, 39, 39, 0x00FF00, 1);
    for (int i = 22; i < 40; i++) CHECK_EQ_INT(canvas_at(c, i, i), 0x00FF00);
    CHECK_EQ_INT(canvas_at(c, 30, 29), 0xFFFFFF);

    /* a line between far-away points is clipped, not walked pixel by pixel */
    mgpu_canvas_line(c, -1e12, 35, 1e12, 35, 0x0000FF, 1);
    for (int x = 0; x < 60; x++) CHECK_EQ_INT(canvas_at(c, x, 35), 0x0000FF);
    mgpu_canvas_line(c, NAN, 0, 10, 10, 0x123456, 1); /* ignored */
    CHECK_EQ_INT(canvas_at(c, 10, 30), 0xFFFFFF);
    mgpu_canvas_free(c);
}

TEST(dashed_stroke_runs_on_across_segments) {
    mgpu_canvas *c = mgpu_canvas_new(60, 10, 0xFFFFFF);
    mgpu__plot_box all;
    double travel = 0;
    all.x0 = all.y0 = 0, all.x1 = 59, all.y1 = 9;
    /* dashes of 6: on over [0,6], off over (6,12), on from 12 */
    mgpu__plot_stroke(c, all, 0, 5, 3, 5, 0x000000, 1, 6, &travel);
    mgpu__plot_stroke(c, all, 3, 5, 40, 5, 0x000000, 1, 6, &travel);
    CHECK_CLOSE(travel, 40, 1e-12, 0);
    CHECK_EQ_INT(canvas_at(c, 2, 5), 0x000000);
    CHECK_EQ_INT(canvas_at(c, 5, 5), 0x000000);
    CHECK_EQ_INT(canvas_at(c, 9, 5), 0xFFFFFF);
    CHECK_EQ_INT(canvas_at(c, 14, 5), 0x000000);
    CHECK_EQ_INT(canvas_at(c, 21, 5), 0xFFFFFF);
    CHECK_EQ_INT(canvas_at(c, 45, 5), 0xFFFFFF); /* past the end */
    mgpu_canvas_free(c);
}

TEST(text_glyphs) {
    mgpu_canvas *c = mgpu_canvas_new(80, 40, 0xFFFFFF);
    mgpu_canvas *d;
    /* "A" is .###. / #...# / #...# / ##### / #...# / #...# / #...# */
    mgpu_canvas_text(c, 10, 10, "A", 0x000000, 1);
    CHECK_EQ_INT(canvas_at(c, 10, 10), 0xFFFFFF);
    for (int x = 11; x <= 13; x++) CHECK_EQ_INT(canvas_at(c, x, 10), 0x000000);
    CHECK_EQ_INT(canvas_at(c, 14, 10), 0xFFFFFF);
    for (int x = 10; x <= 14; x++) CHECK_EQ_INT(canvas_at(c, x, 13), 0x000000);
    CHECK_EQ_INT(canvas_at(c, 10, 16), 0x000000);
    CHECK_EQ_INT(canvas_at(c, 12, 16), 0xFFFFFF);
    CHECK_EQ_INT(canvas_at(c, 14, 16), 0x000000);
    CHECK_EQ_INT(canvas_at(c, 12, 17), 0xFFFFFF);
    /* scale 3: every font pixel is a 3x3 block */
    mgpu_canvas_text(c, 30, 0, "A", 0xFF0000, 3);
    CHECK_EQ_INT(canvas_at(c, 32, 2), 0xFFFFFF);
    CHECK_EQ_INT(canvas_at(c, 33, 0), 0xFF0000);
    CHECK_EQ_INT(canvas_at(c, 35, 2), 0xFF0000);
    /* "g" descends below the baseline: its last row is .###. */
    mgpu_canvas_text(c, 60, 10, "g", 0x000000, 1);
    CHECK_EQ_INT(canvas_at(c, 61, 18), 0x000000);
    CHECK_EQ_INT(canvas_at(c, 60, 18), 0xFFFFFF);
    CHECK_EQ_INT(mgpu_text_width("abc", 1), 17);
    CHECK_EQ_INT(mgpu_text_width("abc", 2), 34);
    CHECK_EQ_INT(mgpu_text_width("", 1), 0);
    mgpu_canvas_free(c);

    /* every printable character but the space lights some pixels, and a
       character outside ASCII is drawn as '?' */
    for (int ch = 32; ch < 128; ch++) {
        char text[2];
        int lit = 0, differs = 0;
        c = mgpu_canvas_new(6, 9, 0xFFFFFF);
        d = mgpu_canvas_new(6, 9, 0xFFFFFF);
        text[0] = (char)(ch == 127 ? 200 : ch), text[1] = 0;
        mgpu_canvas_text(c, 0, 0, text, 0x000000, 1);
        mgpu_canvas_text(d, 0, 0, "?", 0x000000, 1);
        for (int i = 0; i < 6 * 9 * 3; i++) {
            lit += c->rgb[i] == 0;
            differs += c->rgb[i] != d->rgb[i];
        }
        if (ch != 32 && !lit) fprintf(stderr, "  character %d has an empty glyph\n", ch);
        CHECK(ch == 32 ? lit == 0 : lit > 0);
        if (ch == 127) CHECK_EQ_INT(differs, 0);
        mgpu_canvas_free(c);
        mgpu_canvas_free(d);
    }
}

TEST(text_off_the_canvas_is_counted) {
    mgpu_canvas *c = mgpu_canvas_new(40, 20, 0xFFFFFF);
    mgpu_canvas_text(c, 1, 1, "ab", 0x000000, 1); /* inside: 11 x 9 pixels at (1, 1) */
    mgpu_canvas_text(c, 29, 0, "ab", 0x000000, 1); /* its last column is x = 39, the canvas's last */
    CHECK_EQ_INT(c->texts_cut, 0);
    mgpu_canvas_text(c, -3, 1, "xy", 0x000000, 1); /* x's first column is off the left edge */
    CHECK_EQ_INT(c->texts_cut, 1);
    CHECK(strcmp(c->first_cut, "xy") == 0);
    mgpu_canvas_text(c, 10, 12, "g", 0x000000, 1); /* its descender's last row is y = 20: off */
    mgpu_canvas_text(c, 10, 11, "a", 0x000000, 1); /* "a" has no descender: on */
    mgpu_canvas_text(c, -100, 1, "  ", 0x000000, 1); /* spaces light no pixel */
    CHECK_EQ_INT(c->texts_cut, 2);
    CHECK(strcmp(c->first_cut, "xy") == 0); /* the first one stays */
    mgpu_canvas_free(c);
}

/* ---- titles and labels in lines ---- */

/* Line i of a wrapped text, as a string. */
static const char *wrapped_line(const char *text, const mgpu__plot_lines *w, int i) {
    static char line[128];
    snprintf(line, sizeof line, "%.*s", w->length[i], text + w->start[i]);
    return line;
}

TEST(titles_and_labels_wrap_at_spaces) {
    /* 3 characters are 17 pixels at scale 1 and 34 at scale 2 */
    const char *text = "one two  three";
    mgpu__plot_lines w = mgpu__plot_wrap(text, 47, 1); /* 8 characters a line */
    CHECK_EQ_INT(w.n, 2);
    CHECK(strcmp(wrapped_line(text, &w, 0), "one two") == 0);
    CHECK(strcmp(wrapped_line(text, &w, 1), "three") == 0); /* the spaces between are dropped */
    w = mgpu__plot_wrap(text, 46, 1); /* 7 characters: "one two" still fits exactly */
    CHECK_EQ_INT(w.n, 2);
    CHECK(strcmp(wrapped_line(text, &w, 0), "one two") == 0);
    w = mgpu__plot_wrap(text, 40, 1); /* 6: "one" alone */
    CHECK_EQ_INT(w.n, 3);
    CHECK(strcmp(wrapped_line(text, &w, 1), "two") == 0);
    w = mgpu__plot_wrap(text, 1000, 2);
    CHECK_EQ_INT(w.n, 1);
    CHECK(strcmp(wrapped_line(text, &w, 0), text) == 0);
    w = mgpu__plot_wrap("abcdefgh", 17, 1); /* a word longer than a line is cut across */
    CHECK_EQ_INT(w.n, 3);
    CHECK(strcmp(wrapped_line("abcdefgh", &w, 2), "gh") == 0);
    w = mgpu__plot_wrap("a b c d e f g h", 5, 1); /* more lines than there is room for: the last takes the rest */
    CHECK_EQ_INT(w.n, MGPU__PLOT_LINES);
    CHECK(strcmp(wrapped_line("a b c d e f g h", &w, MGPU__PLOT_LINES - 1), "f g h") == 0);
    CHECK_EQ_INT(mgpu__plot_wrap(NULL, 100, 1).n, 0);
    CHECK_EQ_INT(mgpu__plot_wrap("   ", 100, 1).n, 0);
}

/* ---- axes ---- */

TEST(nice_axis_and_ticks) {
    mgpu__plot_axis a = mgpu__plot_axis_new(0.05, 0.97, 0, 6);
    const char *want[] = {"0.0", "0.2", "0.4", "0.6", "0.8", "1.0"};
    char label[32];
    double value;
    int i;
    CHECK_CLOSE(a.lo, 0, 1e-12, 0);
    CHECK_CLOSE(a.hi, 1, 1e-12, 0);
    CHECK_CLOSE(a.step, 0.2, 1e-12, 0);
    for (i = 0; mgpu__plot_tick(&a, i, &value, label); i++) {
        CHECK(i < 6 && strcmp(label, want[i]) == 0);
        CHECK_CLOSE(value, 0.2 * i, 1e-12, 0);
    }
    CHECK_EQ_INT(i, 6);

    a = mgpu__plot_axis_new(0.35, 2.3, 0, 6); /* a loss curve */
    CHECK_CLOSE(a.step, 0.2, 1e-12, 0);
    CHECK_CLOSE(a.lo, 0.2, 1e-12, 0);
    CHECK_CLOSE(a.hi, 2.4, 1e-12, 0);

    a = mgpu__plot_axis_new(-1, 1, 0, 4);
    CHECK_CLOSE(a.step, 0.5, 1e-12, 0);
    mgpu__plot_tick(&a, 2, &value, label);
    CHECK(strcmp(label, "0.0") == 0); /* not "-0.0" */

    a = mgpu__plot_axis_new(0, 600, 0, 10);
    CHECK_CLOSE(a.step, 50, 1e-12, 0);
    mgpu__plot_tick(&a, 3, &value, label);
    CHECK(strcmp(label, "150") == 0);

    a = mgpu__plot_axis_new(1, 10, 1, 6); /* fixed: kept as given */
    CHECK_CLOSE(a.lo, 1, 0, 0);
    CHECK_CLOSE(a.hi, 10, 0, 0);
    mgpu__plot_tick(&a, 0, &value, label);
    CHECK(strcmp(label, "2") == 0);

    a = mgpu__plot_axis_new(5, 5, 0, 6); /* one value: centred */
    CHECK(a.lo < 5 && a.hi > 5);
    CHECK_CLOSE((a.lo + a.hi) / 2, 5, 1e-9, 0);
    a = mgpu__plot_axis_new(INFINITY, -INFINITY, 0, 6); /* no data */
    CHECK_CLOSE(a.lo, 0, 0, 0);
    CHECK_CLOSE(a.hi, 1, 0, 0);
}

/* ---- charts ---- */

TEST(chart_frame_curve_and_nan) {
    /* From the bottom-left to the top-right corner of fixed ranges, with a
       NaN in the middle that the curve steps over. */
    double x[3] = {0, 5, 10}, y[3] = {0, NAN, 1};
    mgpu_series s;
    mgpu_chart ch;
    const char *path = tmp_path("chart.png");
    image im;
    int x0, x1, y0, y1, ink_above = 0;
    memset(&s, 0, sizeof s);
    memset(&ch, 0, sizeof ch);
    s.name = "diagonal";
    s.color = 0xD62728;
    s.n = 3, s.x = x, s.y = y;
    ch.title = "Title", ch.xlabel = "epoch", ch.ylabel = "acc";
    ch.xmin = 0, ch.xmax = 10, ch.ymin = 0, ch.ymax = 1;
    ch.nseries = 1, ch.series = &s;
    CHECK_EQ_INT(mgpu_chart_write_png(&ch, path), 0);
    im = load_png(path);
    CHECK_EQ_INT(im.w, 640);
    CHECK_EQ_INT(im.h, 480);
    x0 = find_column(&im, 0, 1, 200, MGPU__INK);
    x1 = find_column(&im, im.w - 1, -1, 200, MGPU__INK);
    y0 = find_row(&im, 0, 1, 300, MGPU__INK);
    y1 = find_row(&im, im.h - 1, -1, 300, MGPU__INK);
    CHECK(x0 > 20 && x1 > x0 + 300 && x1 < im.w - 1);
    CHECK(y0 > 10 && y1 > y0 + 200 && y1 < im.h - 20);
    /* the curve passes through the middle of the frame (the NaN skipped)
       and starts in the bottom-left corner */
    CHECK(near_color(&im, (x0 + x1) / 2, (y0 + y1) / 2, 0xD62728));
    CHECK(near_color(&im, x0 + 3, y1 - 3, 0xD62728));
    CHECK(!near_color(&im, x0 + 20, y0 + 20, 0xD62728) ||
          !near_color(&im, x1 - 20, y1 - 20, 0xD62728));
    /* the legend's box is drawn, and the title above the frame */
    CHECK(find_row(&im, y0 + 1, 1, 50, 0xAAAAAA) > y0);
    for (int yy = 0; yy < y0; yy++)
        for (int xx = 0; xx < im.w; xx++) ink_above += at(&im, xx, yy) == MGPU__INK;
    CHECK(ink_above > 20);
    stbi_image_free(im.rgb);
}

TEST(chart_lone_point_and_default_color) {
    double x[1] = {3}, y[1] = {7};
    mgpu_series s;
    mgpu_chart ch;
    const char *path = tmp_path("lone.png");
    image im;
    int x0, x1, y0, y1;
    memset(&s, 0, sizeof s);
    memset(&ch, 0, sizeof ch);
    s.n = 1, s.x = x, s.y = y; /* no name: no legend; colour 0: palette colour 0 */
    ch.width = 320, ch.height = 240;
    ch.nseries = 1, ch.series = &s;
    CHECK_EQ_INT(mgpu_chart_write_png(&ch, path), 0);
    im = load_png(path);
    CHECK_EQ_INT(im.w, 320);
    x0 = find_column(&im, 0, 1, 100, MGPU__INK);
    x1 = find_column(&im, im.w - 1, -1, 100, MGPU__INK);
    y0 = find_row(&im, 0, 1, 150, MGPU__INK);
    y1 = find_row(&im, im.h - 1, -1, 150, MGPU__INK);
    CHECK(x0 > 0 && y0 > 0);
    /* a single value gets a range centred on it, and a dot */
    CHECK(near_color(&im, (x0 + x1) / 2, (y0 + y1) / 2, mgpu_palette(0)));
    stbi_image_free(im.rgb);
}

/* ---- the Animator ---- */

TEST(animator_csv_png_and_last) {
    const char *names[] = {"loss", "acc"};
    double p1[2] = {0.5, NAN}, p2[2] = {0.25, 0.75};
    mgpu_animator *a =
        mgpu_animator_new(tmp_path("anim.png"), "run", "epoch", NULL, 0, 0, 2, names);
    image im;
    CHECK_EQ_INT(mgpu_animator_count(a), 0);
    CHECK(isnan(mgpu_animator_last(a, 1)));
    mgpu_animator_add(a, 1, p1);
    CHECK(strcmp(read_text(tmp_path("anim.csv")), "x,loss,acc\n1,0.5,\n") == 0);
    CHECK(isnan(mgpu_animator_last(a, 1))); /* no value yet */
    mgpu_animator_add(a, 2, p2);
    CHECK(strcmp(read_text(tmp_path("anim.csv")), "x,loss,acc\n1,0.5,\n2,0.25,0.75\n") == 0);
    p1[0] = 0.125;
    mgpu_animator_add(a, 3, p1);
    CHECK_EQ_INT(mgpu_animator_count(a), 3);
    CHECK_CLOSE(mgpu_animator_last(a, 0), 0.125, 0, 0);
    CHECK_CLOSE(mgpu_animator_last(a, 1), 0.75, 0, 0); /* the last value that is not NaN */
    im = load_png(tmp_path("anim.png"));
    CHECK_EQ_INT(im.w, 640);
    CHECK_EQ_INT(im.h, 480);
    stbi_image_free(im.rgb);
    mgpu_animator_free(a);

    /* a path without ".png" gets ".csv" added; many points grow the arrays */
    a = mgpu_animator_new(tmp_path("curves"), NULL, NULL, NULL, 0, 0, 2, names);
    for (int i = 0; i < 200; i++) mgpu_animator_add(a, i, p2);
    CHECK(file_exists(tmp_path("curves.csv")));
    CHECK_EQ_INT(mgpu_animator_count(a), 200);
    mgpu_animator_free(a);
}

TEST(animator_combined) {
    const char *names[] = {"train loss", "test acc"};
    const char *labels[] = {"1 device", "2 devices"};
    mgpu_animator *runs[2];
    const mgpu_animator *const *all = (const mgpu_animator *const *)runs;
    image im;
    int found[2] = {0, 0};
    for (int r = 0; r < 2; r++) {
        runs[r] = mgpu_animator_new(NULL, labels[r], "epoch", NULL, 1, 5, 2,
                                    names); /* keeps points only */
        for (int e = 1; e <= 5; e++) {
            double ys[2] = {1.0 / e, 0.5 + 0.05 * e + 0.1 * r};
            mgpu_animator_add(runs[r], e, ys);
        }
    }
    CHECK_EQ_INT(
        mgpu_animator_write_combined(tmp_path("combined.png"), "test acc", 2, all, 1, labels), 0);
    CHECK_EQ_INT(mgpu_animator_write_combined(tmp_path("combined2.png"), NULL, 2, all, 1, NULL), 0);
    im = load_png(tmp_path("combined.png"));
    for (int i = 0; i < im.w * im.h; i++)
        for (int r = 0; r < 2; r++) found[r] |= at(&im, i % im.w, i / im.w) == mgpu_palette(r);
    CHECK(found[0] && found[1]); /* one curve per run, in palette colours 0 and 1 */
    stbi_image_free(im.rgb);
    for (int r = 0; r < 2; r++) mgpu_animator_free(runs[r]);
}

/* ---- timelines ---- */

static void add_bar(mgpu_timeline_bar *bar, int lane, double start, double end, const char *name) {
    bar->lane = lane, bar->start_ms = start, bar->end_ms = end;
    snprintf(bar->name, sizeof bar->name, "%s", name);
    bar->label[0] = '\0';
}

TEST(timeline_bars) {
    const char *lanes[] = {"cuda:0", "cuda:1"};
    mgpu_timeline_bar bars[4];
    const char *path = tmp_path("timeline.png");
    image im;
    int x0, x1, y0, y1, lane0, lane1, first = -1, last = -1, legend = 0;
    uint32_t matmul, copy;
    add_bar(&bars[0], 0, 0, 30, "matmul");
    add_bar(&bars[1], 0, 40, 70, "matmul");
    add_bar(&bars[2], 1, 20, 80, "copy");
    add_bar(&bars[3], 7, 0, 10, "no such lane"); /* left out */
    CHECK_EQ_INT(mgpu_timeline_write_png(path, "timeline", 2, lanes, 4, bars), 0);
    im = load_png(path);
    CHECK_EQ_INT(im.w, 1000);
    x0 = find_column(&im, 0, 1, 50, MGPU__INK);
    x1 = find_column(&im, im.w - 1, -1, 50, MGPU__INK);
    y0 = find_row(&im, 0, 1, 500, MGPU__INK);
    y1 = find_row(&im, im.h - 1, -1, 500, MGPU__INK);
    CHECK(x0 > 0 && x1 > x0 && y0 > 0 && y1 > y0);
    lane0 = y0 + (y1 - y0) / 4, lane1 = y0 + 3 * (y1 - y0) / 4;
    /* the time axis is 0..80 ms: the pixel of time t is x0 + t/80*(x1-x0) */
#define TIME_X(t) ((int)lround(x0 + (t) / 80.0 * (x1 - x0)))
    matmul = at(&im, TIME_X(15), lane0 - 5);
    copy = at(&im, TIME_X(50), lane1 - 5);
    CHECK(is_palette_color(matmul) && is_palette_color(copy) && matmul != copy);
    CHECK_EQ_INT(at(&im, TIME_X(55), lane0 - 5), matmul); /* same name, same colour */
    CHECK(at(&im, TIME_X(35), lane0 - 5) != matmul);      /* the gap between them */
    CHECK(at(&im, TIME_X(10), lane1 - 5) != copy);
    for (int x = 0; x < im.w; x++)
        if (at(&im, x, lane1 - 5) == copy) last = x, first = first < 0 ? x : first;
    CHECK(abs(first - TIME_X(20)) <= 2);
    CHECK(abs(last - TIME_X(80)) <= 2);
#undef TIME_X
    for (int y = y1 + 1; y < im.h; y++) /* the legend under the axis */
        for (int x = 0; x < im.w; x++) legend += at(&im, x, y) == copy;
    CHECK(legend > 0);
    stbi_image_free(im.rgb);
}

TEST(timeline_colors_stay_distinct) {
    mgpu__timeline_key keys[12];
    const char *names[12] = {"a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l"};
    int nkeys = 0, used[10] = {0};
    for (int i = 0; i < 12; i++) CHECK_EQ_INT(mgpu__timeline_key_of(keys, &nkeys, names[i]), i);
    CHECK_EQ_INT(mgpu__timeline_key_of(keys, &nkeys, "c"), 2); /* seen before */
    CHECK_EQ_INT(nkeys, 12);
    for (int i = 0; i < 10; i++) used[keys[i].slot]++;
    for (int i = 0; i < 10; i++) CHECK_EQ_INT(used[i], 1); /* the first ten share no colour */
}

/* ---- the chapters' pictures: every text on the canvas ---- */

/* Rows y0..y1-1 of the image hold ink (text, frames) somewhere. */
static int ink_in_rows(const image *im, int y0, int y1) {
    for (int y = y0; y < y1; y++)
        for (int x = 0; x < im->w; x++)
            if (at(im, x, y) == MGPU__INK) return 1;
    return 0;
}

/* The line charts the chapters draw, at their size (640 x 480, the
   default; bench/allreduce's 800 wide), with their titles and labels at
   their longest (the device lists of GPUs): a writer returns non-zero
   when a text ran off the picture. Chapter 6's title takes two lines, and
   the frame starts under the second. */
TEST(the_chapters_charts_keep_their_text_on_the_picture) {
    static const struct {
        const char *title, *xlabel, *ylabel;
        int width;
    } charts[] = {
        {"LeNet on [cuda:0, cuda:1, cuda:2, cuda:3, cuda:4, cuda:5, cuda:6, cuda:7], batch 256, lr 0.90", "epoch",
         "", 0},                                                                          /* chapter 2 */
        {"ResNet-18 on [cuda:0#1, cuda:1#1, cuda:2#1, cuda:3#1], batch 256, lr 0.10", "epoch", "", 0}, /* 3 */
        {"test accuracy, same global batch", "epoch", "test acc", 0},                    /* chapter 4 */
        {"activations held during a ResNet-18 step", "time: the allocator's calls during the step, in order",
         "MiB", 0},                                                                       /* chapter 5 */
        {"32-channel network in 2 stages on [cuda:0, cuda:1], 1F1B, m = 4", "epoch", "", 0}, /* chapter 6 */
        {"allreduce on [cuda:0, cuda:1, cuda:2, cuda:3], one shared memory", "log2(bytes per device); 20 is 1 MiB",
         "busbw (GB/s)", 800},                                                            /* bench/allreduce */
    };
    double x[3] = {1, 2, 3}, y[3] = {0.5, 0.7, 0.8};
    for (size_t i = 0; i < sizeof charts / sizeof charts[0]; i++) {
        mgpu_series s;
        mgpu_chart ch;
        memset(&s, 0, sizeof s);
        memset(&ch, 0, sizeof ch);
        s.name = "a series with a long name", s.n = 3, s.x = x, s.y = y;
        ch.title = charts[i].title, ch.xlabel = charts[i].xlabel, ch.ylabel = charts[i].ylabel;
        ch.width = charts[i].width;
        ch.nseries = 1, ch.series = &s;
        CHECK_EQ_INT(mgpu_chart_write_png(&ch, tmp_path("chapter.png")), 0);
    }
    /* chapter 6's: a first line at y = 10 (5 font pixels), a second 24 lower, and the frame under both */
    mgpu_animator *a = mgpu_animator_new(tmp_path("chapter6.png"), charts[4].title, "epoch", "", 1, 3, 1, NULL);
    mgpu_animator_add(a, 1, y);
    mgpu_animator_add(a, 2, y + 1);
    image im = load_png(tmp_path("chapter6.png"));
    CHECK(ink_in_rows(&im, 10, 24) && ink_in_rows(&im, 34, 48));
    CHECK(find_row(&im, 0, 1, 300, MGPU__INK) >= 48);
    stbi_image_free(im.rgb);
    mgpu_animator_free(a);
}

/* A picture too small for its text is written, and said to be wrong. */
TEST(text_that_cannot_fit_is_reported) {
    double x[2] = {0, 1}, y[2] = {0, 1};
    mgpu_series s;
    mgpu_chart ch;
    memset(&s, 0, sizeof s);
    memset(&ch, 0, sizeof ch);
    s.n = 2, s.x = x, s.y = y;
    ch.width = 100, ch.height = 200; /* 16 characters a line at scale 1, and 6 lines at most */
    ch.title = "a title of far more words than six lines of sixteen characters can hold, however they break";
    ch.nseries = 1, ch.series = &s;
    int errors = mgpu_output_errors();
    capture_begin();
    int rc = mgpu_chart_write_png(&ch, tmp_path("small.png"));
    const char *err = capture_end();
    CHECK(rc != 0);
    CHECK_EQ_INT(mgpu_output_errors(), errors + 1);
    CHECK(strstr(err, "small.png: 1 text ran off the picture, the first \"") != NULL);
    CHECK(file_exists(tmp_path("small.png")));
}

/* How many of the palette's colours the legend under a timeline's frame shows. */
static int legend_colors(const char *path) {
    image im = load_png(path);
    int y1 = find_row(&im, im.h - 1, -1, 500, MGPU__INK), found = 0;
    for (int k = 0; k < 10; k++) {
        int here = 0;
        for (int y = y1 + 1; y < im.h && !here; y++)
            for (int x = 0; x < im.w; x++) here |= at(&im, x, y) == mgpu_palette(k);
        found += here;
    }
    stbi_image_free(im.rgb);
    return found;
}

/* Chapter 4's timeline: two lanes a rank, bars named by their kind of
   work, an allreduce in its two parts. */
TEST(a_ranks_timeline_names_every_kind) {
    const char *lanes[] = {"rank 0 compute", "rank 0 comm", "rank 1 compute", "rank 1 comm"};
    const char *kinds[] = {"forward", "backward", "loss and accuracy", "optimizer", "tensor arithmetic", "copy"};
    mgpu_timeline_bar bars[40];
    int n = 0;
    memset(bars, 0, sizeof bars);
    for (int rank = 0; rank < 2; rank++) {
        for (int k = 0; k < 6; k++) add_bar(&bars[n++], 2 * rank, 10 * k, 10 * k + 9, kinds[k]);
        add_bar(&bars[n++], 2 * rank + 1, 20, 30, "waiting for the other ranks");
        add_bar(&bars[n++], 2 * rank + 1, 30, 35, "communication");
    }
    CHECK_EQ_INT(mgpu_timeline_write_png(tmp_path("ranks.png"),
                                         "one ResNet-18 step on 2 processes: buckets averaged under backward", 4,
                                         lanes, n, bars),
                 0);
    CHECK_EQ_INT(legend_colors(tmp_path("ranks.png")), 8); /* every kind its own colour */
}

/* The tracer's timeline of a data-parallel step: twenty-odd operations
   in a few kinds, every one in the legend, no text off the picture. */
TEST(the_tracers_timeline_groups_operations_by_kind) {
    mgpu_device *devs[2];
    mgpu_devices(2, 0, devs);
    mgpu_manual_seed(1);
    mgpu_net *net = mgpu_lenet(devs[0]);
    mgpu_data_parallel *dp = mgpu_data_parallel_new(net, devs, 2, MGPU_DP_ALLREDUCE);
    mgpu_data_parallel_configure(dp, 64 << 10, 1, 1);
    mgpu_tensor *x = mgpu_rand(devs[0], mgpu_shape4(8, 1, 28, 28));
    float labels[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    mgpu_tensor *y = mgpu_from_host(devs[0], mgpu_shape1(8), labels);
    mgpu_data_parallel_step(dp, x, y, 0.1f, 0, 0);
    mgpu_trace_begin();
    mgpu_data_parallel_step(dp, x, y, 0.1f, 0, 0);
    mgpu_trace_end();
    const char *names[64], *kinds[64];
    int nnames = 0, nkinds = 0;
    for (int i = 0; i < mgpu_trace_count(); i++) {
        mgpu_trace_op op = mgpu_trace_get(i);
        int k = 0;
        while (k < nnames && strcmp(names[k], op.name) != 0) k++;
        if (k == nnames && nnames < 64) names[nnames++] = op.name;
        for (k = 0; k < nkinds && strcmp(kinds[k], op.kind) != 0;) k++;
        if (k == nkinds && nkinds < 64) kinds[nkinds++] = op.kind;
        if (strstr(op.name, "backward")) CHECK(strcmp(op.kind, "backward") == 0);
        if (strncmp(op.name, "ring ", 5) == 0) CHECK(strcmp(op.kind, "communication") == 0);
    }
    printf("  %d operations in %d kinds\n", nnames, nkinds);
    CHECK(nnames >= 15 && nkinds <= 8);
    CHECK_EQ_INT(mgpu_trace_write_png(tmp_path("trace.png"), "one LeNet step on 2 devices: buckets reduced under "
                                                            "backward, the ring's copies and adds on the copy queues"),
                 0);
    CHECK_EQ_INT(legend_colors(tmp_path("trace.png")), nkinds); /* the legend's entries are the kinds */
    mgpu_free(x);
    mgpu_free(y);
    mgpu_data_parallel_free(dp);
    mgpu_net_free(net);
}

/* ---- errors ---- */

TEST(unwritable_paths_report_one_line) {
    mgpu_canvas *c = mgpu_canvas_new(4, 4, 0xFFFFFF);
    const char *names[] = {"loss"};
    double y = 1;
    mgpu_chart ch;
    mgpu_animator *a;
    const char *err;
    int rc;

    capture_begin();
    rc = mgpu_canvas_write_png(c, "/nonexistent/dir/x.png");
    err = capture_end();
    CHECK(rc != 0);
    CHECK(strcmp(err, "mgpu: error: /nonexistent/dir/x.png: cannot write PNG (No such file or "
                      "directory)\n") == 0);

    /* a folder in the way: the rename fails, and no temporary file stays */
    CHECK_EQ_INT(mkdir(tmp_path("folder.png"), 0755), 0);
    capture_begin();
    rc = mgpu_canvas_write_png(c, tmp_path("folder.png"));
    err = capture_end();
    CHECK(rc != 0);
    CHECK(strstr(err, ": cannot write PNG (Is a directory)\n") != NULL);
    CHECK(!file_exists(tmp_path("folder.png.tmp")));

    memset(&ch, 0, sizeof ch);
    capture_begin();
    CHECK(mgpu_chart_write_png(&ch, "/nonexistent/chart.png") != 0);
    CHECK(mgpu_timeline_write_png("/nonexistent/timeline.png", NULL, 1, names, 0, NULL) != 0);
    err = capture_end();
    CHECK(
        strcmp(err,
               "mgpu: error: /nonexistent/chart.png: cannot write PNG (No such file or directory)\n"
               "mgpu: error: /nonexistent/timeline.png: cannot write PNG (No such file or "
               "directory)\n") == 0);

    /* the Animator says it once, then only keeps its points */
    a = mgpu_animator_new("/nonexistent/dir/a.png", NULL, NULL, NULL, 0, 0, 1, names);
    capture_begin();
    mgpu_animator_add(a, 1, &y);
    mgpu_animator_add(a, 2, &y);
    err = capture_end();
    CHECK(strcmp(err, "mgpu: error: /nonexistent/dir/a.csv: cannot write CSV (No such file or "
                      "directory)\n") == 0);
    CHECK_EQ_INT(mgpu_animator_count(a), 2);
    mgpu_animator_free(a);
    mgpu_canvas_free(c);
}

/* Files limited to 1000 bytes (ulimit -f), in a child: the write past the
   limit fails as on a full disk, where SIGXFSZ would kill the process. */
static void write_png_into_1000_bytes(const mgpu_canvas *c, const char *path) {
    struct rlimit small;
    small.rlim_cur = small.rlim_max = 1000;
    setrlimit(RLIMIT_FSIZE, &small);
    _exit(mgpu_canvas_write_png(c, path) != 0);
}
TEST(a_png_past_the_file_size_limit_is_one_line_and_no_file) {
    mgpu_canvas *c = mgpu_canvas_new(64, 64, 0);
    uint32_t noise = 1; /* (which does not compress: 12 KiB of pixels, a PNG of more than 1000 bytes) */
    for (int i = 0; i < 64 * 64 * 3; i++) c->rgb[i] = (unsigned char)((noise = noise * 1664525u + 1013904223u) >> 24);
    const char *path = tmp_path("limited.png");
    char tmp[300], want[400];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    snprintf(want, sizeof want, "mgpu: error: %s: cannot write PNG (File too large)\n", path);
    EXPECT_DIES(write_png_into_1000_bytes(c, path), want);
    CHECK(!file_exists(path));
    CHECK(!file_exists(tmp));
    mgpu_canvas_free(c);
}

/* A ".tmp" in the way that is no file, a FIFO (whose opening waits for a
   reader, and whose writes would raise SIGPIPE), is replaced by the file. */
TEST(a_fifo_in_the_place_of_the_temporary_file_is_replaced) {
    mgpu_canvas *c = mgpu_canvas_new(4, 4, 0x123456);
    const char *path = tmp_path("fifo.png");
    char tmp[300];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    CHECK_EQ_INT(mkfifo(tmp, 0644), 0);
    alarm(20); /* (the test's end, where the open waits) */
    CHECK_EQ_INT(mgpu_canvas_write_png(c, path), 0);
    alarm(0);
    CHECK(!file_exists(tmp));
    image im = load_png(path);
    CHECK_EQ_INT(at(&im, 3, 3), 0x123456);
    stbi_image_free(im.rgb);
    mgpu_canvas_free(c);
}

/* Standard output on a full disk (/dev/full), line by line as the
   chapters write it, in a child: printf says nothing; mgpu_output_errors
   says so, and counts it once however often it is asked (exit status 1
   when it did). */
static void print_onto_a_full_disk(void) {
    if (!freopen("/dev/full", "w", stdout)) _exit(0);
    setvbuf(stdout, NULL, _IOLBF, 0);
    int before = mgpu_output_errors();
    printf("lost\n");
    int after = mgpu_output_errors();
    _exit(after == before + 1 && mgpu_output_errors() == after);
}
TEST(a_failed_write_to_standard_output_is_an_output_error) {
    EXPECT_DIES(print_onto_a_full_disk(),
                "mgpu: error: standard output: cannot write (a write failed: a full disk, or the file-size limit)\n");
}

TEST(caller_bugs_are_fatal_with_a_message) {
    const char *names[] = {"loss"};
    mgpu_animator *a = mgpu_animator_new(NULL, NULL, NULL, NULL, 0, 0, 1, names);
    EXPECT_DIES(mgpu_animator_last(a, 3), "mgpu: error: animator has no series 3 (it has 1)");
    const mgpu_animator *runs[1] = {a}; /* (no labels, no title: the series' name would be read) */
    EXPECT_DIES(mgpu_animator_write_combined("/tmp/mgpu_never.png", NULL, 1, runs, 3, NULL),
                "mgpu: error: animator has no series 3 (it has 1)");
    EXPECT_DIES(mgpu_canvas_new(0, 5, 0), "mgpu: error: a canvas of 0x5 pixels cannot be made");
    mgpu_animator_free(a);
}

TEST_MAIN()
