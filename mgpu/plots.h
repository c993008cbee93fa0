/* mgpu/plots.h: pictures as PNG files, with nothing but stb_image_write:
   a canvas, the frame of a chart, line charts and the Animator that
   redraws one after every point (chapters 2 to 6 plot their training with
   it), and device timelines (chapter 1's, and the tracer's). It needs only
   mgpu/core.h, so it comes early: the tracer and the pipelines draw with
   it. The manual's DRAWING.
   defines: mgpu_palette, mgpu_canvas_new, mgpu_canvas_free,
   mgpu_canvas_fill_rect, mgpu_canvas_line, mgpu_text_width,
   mgpu_canvas_text, mgpu_output_errors, mgpu_canvas_write_png,
   mgpu_chart_write_png, mgpu_animator_new, mgpu_animator_free,
   mgpu_animator_count, mgpu_animator_last, mgpu_animator_add,
   mgpu_animator_write_combined, mgpu_timeline_write_png */
/* ===========================================================================
   Plots: implementation (see "Plots" in the manual above)
   ===========================================================================
   Four layers, each built on the one before:
     1. the canvas: an RGB buffer with rectangles, lines and text, saved as
        a PNG by stb_image_write;
     2. the frame: the plot area of a chart, its axes with "nice" ticks and
        the mapping from data values to pixels;
     3. line charts and the Animator that redraws one after every point;
     4. device timelines.
   Out of memory and calls that make no sense (a canvas of no pixels, a
   series an animator does not have) are fatal here as everywhere in mgpu
   (mgpu_fatal); a file that cannot be written is not (see the manual),
   nor is a chart or timeline whose text ran off it: it is written, and
   reported as a failed write (mgpu__plot_write). */
#include <errno.h>
#include <stb/stb_image_write.h>

/* ---- 1. the canvas ------------------------------------------------------ */

/* realloc that does not fail: the animator's arrays grow with it. */
static void *mgpu__plot_grow(void *p, size_t bytes) {
    p = realloc(p, bytes ? bytes : 1);
    if (!p) mgpu_fatal("out of host memory (asked for %zu bytes)", bytes);
    return p;
}

/* A duplicate of s; NULL stays NULL. */
static char *mgpu__plot_strdup(const char *s) {
    char *copy;
    if (!s) return NULL;
    copy = (char *)mgpu__xmalloc(strlen(s) + 1);
    return strcpy(copy, s);
}

/* The font: one glyph per printable ASCII character, 32 (space) to 126 (~).
   A glyph is 9 rows of 5 pixels, top row first; in each row byte bit 4 is
   the leftmost pixel. Rows 0-6 hold capitals and digits, the baseline is
   under row 6, and rows 7-8 are for descenders (g j p q y , _). */
#define MGPU__GLYPH_W 5
#define MGPU__GLYPH_H 9
#define MGPU__CAP_H 7  /* height of capitals and digits, for centring text */
#define MGPU__CELL_W 6 /* a glyph and a blank column before the next one */
static const unsigned char mgpu__font[95][MGPU__GLYPH_H] = {
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00}, /* space */
    {0x04, 0x04, 0x04, 0x04, 0x04, 0x00, 0x04, 0x00, 0x00}, /* ! */
    {0x0A, 0x0A, 0x0A, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00}, /* " */
    {0x0A, 0x0A, 0x1F, 0x0A, 0x1F, 0x0A, 0x0A, 0x00, 0x00}, /* # */
    {0x04, 0x0F, 0x14, 0x0E, 0x05, 0x1E, 0x04, 0x00, 0x00}, /* $ */
    {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03, 0x00, 0x00}, /* % */
    {0x0C, 0x12, 0x14, 0x08, 0x15, 0x12, 0x0D, 0x00, 0x00}, /* & */
    {0x04, 0x04, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00}, /* ' */
    {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02, 0x00, 0x00}, /* ( */
    {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08, 0x00, 0x00}, /* ) */
    {0x00, 0x04, 0x15, 0x0E, 0x15, 0x04, 0x00, 0x00, 0x00}, /* asterisk */
    {0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00, 0x00, 0x00}, /* + */
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08, 0x00}, /* , */
    {0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00, 0x00, 0x00}, /* - */
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C, 0x00, 0x00}, /* . */
    {0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00, 0x00, 0x00}, /* slash */
    {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E, 0x00, 0x00}, /* 0 */
    {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E, 0x00, 0x00}, /* 1 */
    {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F, 0x00, 0x00}, /* 2 */
    {0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E, 0x00, 0x00}, /* 3 */
    {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02, 0x00, 0x00}, /* 4 */
    {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E, 0x00, 0x00}, /* 5 */
    {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E, 0x00, 0x00}, /* 6 */
    {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08, 0x00, 0x00}, /* 7 */
    {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E, 0x00, 0x00}, /* 8 */
    {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C, 0x00, 0x00}, /* 9 */
    {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00, 0x00, 0x00}, /* : */
    {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x04, 0x08, 0x00, 0x00}, /* ; */
    {0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02, 0x00, 0x00}, /* < */
    {0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00, 0x00, 0x00}, /* = */
    {0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08, 0x00, 0x00}, /* > */
    {0x0E, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04, 0x00, 0x00}, /* ? */
    {0x0E, 0x11, 0x01, 0x0D, 0x15, 0x15, 0x0E, 0x00, 0x00}, /* @ */
    {0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11, 0x00, 0x00}, /* A */
    {0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E, 0x00, 0x00}, /* B */
    {0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E, 0x00, 0x00}, /* C */
    {0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C, 0x00, 0x00}, /* D */
    {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F, 0x00, 0x00}, /* E */
    {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10, 0x00, 0x00}, /* F */
    {0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F, 0x00, 0x00}, /* G */
    {0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11, 0x00, 0x00}, /* H */
    {0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E, 0x00, 0x00}, /* I */
    {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C, 0x00, 0x00}, /* J */
    {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11, 0x00, 0x00}, /* K */
    {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F, 0x00, 0x00}, /* L */
    {0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11, 0x00, 0x00}, /* M */
    {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11, 0x00, 0x00}, /* N */
    {0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E, 0x00, 0x00}, /* O */
    {0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10, 0x00, 0x00}, /* P */
    {0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D, 0x00, 0x00}, /* Q */
    {0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11, 0x00, 0x00}, /* R */
    {0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E, 0x00, 0x00}, /* S */
    {0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x00, 0x00}, /* T */
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E, 0x00, 0x00}, /* U */
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04, 0x00, 0x00}, /* V */
    {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A, 0x00, 0x00}, /* W */
    {0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11, 0x00, 0x00}, /* X */
    {0x11, 0x11, 0x0A, 0x04, 0x04, 0x04, 0x04, 0x00, 0x00}, /* Y */
    {0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F, 0x00, 0x00}, /* Z */
    {0x0E, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0E, 0x00, 0x00}, /* [ */
    {0x00, 0x10, 0x08, 0x04, 0x02, 0x01, 0x00, 0x00, 0x00}, /* backslash */
    {0x0E, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0E, 0x00, 0x00}, /* ] */
    {0x04, 0x0A, 0x11, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00}, /* ^ */
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F, 0x00}, /* _ */
    {0x08, 0x04, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00}, /* ` */
    {0x00, 0x00, 0x0E, 0x01, 0x0F, 0x11, 0x0F, 0x00, 0x00}, /* a */
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1E, 0x00, 0x00}, /* b */
    {0x00, 0x00, 0x0E, 0x10, 0x10, 0x11, 0x0E, 0x00, 0x00}, /* c */
    {0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F, 0x00, 0x00}, /* d */
    {0x00, 0x00, 0x0E, 0x11, 0x1F, 0x10, 0x0E, 0x00, 0x00}, /* e */
    {0x06, 0x09, 0x08, 0x1C, 0x08, 0x08, 0x08, 0x00, 0x00}, /* f */
    {0x00, 0x00, 0x0F, 0x11, 0x11, 0x11, 0x0F, 0x01, 0x0E}, /* g */
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11, 0x00, 0x00}, /* h */
    {0x04, 0x00, 0x0C, 0x04, 0x04, 0x04, 0x0E, 0x00, 0x00}, /* i */
    {0x02, 0x00, 0x06, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C}, /* j */
    {0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12, 0x00, 0x00}, /* k */
    {0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E, 0x00, 0x00}, /* l */
    {0x00, 0x00, 0x1A, 0x15, 0x15, 0x15, 0x15, 0x00, 0x00}, /* m */
    {0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11, 0x00, 0x00}, /* n */
    {0x00, 0x00, 0x0E, 0x11, 0x11, 0x11, 0x0E, 0x00, 0x00}, /* o */
    {0x00, 0x00, 0x1E, 0x11, 0x11, 0x11, 0x1E, 0x10, 0x10}, /* p */
    {0x00, 0x00, 0x0F, 0x11, 0x11, 0x11, 0x0F, 0x01, 0x01}, /* q */
    {0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10, 0x00, 0x00}, /* r */
    {0x00, 0x00, 0x0F, 0x10, 0x0E, 0x01, 0x1E, 0x00, 0x00}, /* s */
    {0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06, 0x00, 0x00}, /* t */
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0D, 0x00, 0x00}, /* u */
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x0A, 0x04, 0x00, 0x00}, /* v */
    {0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0A, 0x00, 0x00}, /* w */
    {0x00, 0x00, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x00, 0x00}, /* x */
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x11, 0x0F, 0x01, 0x0E}, /* y */
    {0x00, 0x00, 0x1F, 0x02, 0x04, 0x08, 0x1F, 0x00, 0x00}, /* z */
    {0x02, 0x04, 0x04, 0x08, 0x04, 0x04, 0x02, 0x00, 0x00}, /* { */
    {0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x00, 0x00}, /* | */
    {0x08, 0x04, 0x04, 0x02, 0x04, 0x04, 0x08, 0x00, 0x00}, /* } */
    {0x00, 0x00, 0x08, 0x15, 0x02, 0x00, 0x00, 0x00, 0x00}, /* ~ */
};

/* matplotlib's "tab10": ten colours that are easy to tell apart. */
static const uint32_t mgpu__palette[10] = {0x1F77B4, 0xFF7F0E, 0x2CA02C, 0xD62728, 0x9467BD,
                                           0x8C564B, 0xE377C2, 0x7F7F7F, 0xBCBD22, 0x17BECF};
#define MGPU__INK 0x222222u  /* text, frames and ticks */
#define MGPU__GRID 0xE4E4E4u /* grid lines behind the data */
#define MGPU__WHITE 0xFFFFFFu

MGPU_DEF uint32_t mgpu_palette(int i) { return mgpu__palette[(i % 10 + 10) % 10]; }

MGPU_DEF mgpu_canvas *mgpu_canvas_new(int width, int height, uint32_t background_rgb) {
    mgpu_canvas *c;
    MGPU_REQUIRE(width > 0 && height > 0, "a canvas of %dx%d pixels cannot be made", width, height);
    c = (mgpu_canvas *)mgpu__xmalloc(sizeof *c);
    memset(c, 0, sizeof *c);
    c->width = width;
    c->height = height;
    c->rgb = (unsigned char *)mgpu__xmalloc((size_t)width * (size_t)height * 3);
    mgpu_canvas_fill_rect(c, 0, 0, width, height, background_rgb);
    return c;
}

MGPU_DEF void mgpu_canvas_free(mgpu_canvas *c) {
    if (!c) return;
    free(c->rgb);
    free(c);
}

static int mgpu__plot_clamp(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* Every other drawing operation ends up here, so this is where clipping to
   the canvas happens. */
MGPU_DEF void mgpu_canvas_fill_rect(mgpu_canvas *c, int x0, int y0, int x1, int y1, uint32_t rgb) {
    x0 = mgpu__plot_clamp(x0, 0, c->width);
    x1 = mgpu__plot_clamp(x1, 0, c->width);
    y0 = mgpu__plot_clamp(y0, 0, c->height);
    y1 = mgpu__plot_clamp(y1, 0, c->height);
    for (int y = y0; y < y1; y++) {
        unsigned char *p = c->rgb + ((size_t)y * (size_t)c->width + (size_t)x0) * 3;
        for (int x = x0; x < x1; x++, p += 3) {
            p[0] = (unsigned char)(rgb >> 16);
            p[1] = (unsigned char)(rgb >> 8);
            p[2] = (unsigned char)rgb;
        }
    }
}

/* A 1-pixel outline around the pixels x0..x1, y0..y1 (both inclusive). */
static void mgpu__plot_outline(mgpu_canvas *c, int x0, int y0, int x1, int y1, uint32_t rgb) {
    mgpu_canvas_fill_rect(c, x0, y0, x1 + 1, y0 + 1, rgb);
    mgpu_canvas_fill_rect(c, x0, y1, x1 + 1, y1 + 1, rgb);
    mgpu_canvas_fill_rect(c, x0, y0, x0 + 1, y1 + 1, rgb);
    mgpu_canvas_fill_rect(c, x1, y0, x1 + 1, y1 + 1, rgb);
}

/* A box of pixel positions, edges included. */
typedef struct mgpu__plot_box {
    double x0, y0, x1, y1;
} mgpu__plot_box;

/* Liang-Barsky clipping. The segment is p(t) = (x0,y0) + t*(dx,dy) for t in
   [0,1]; each side of the box keeps the t on its inner side, and [*t0, *t1]
   ends up as the part inside all four. Returns 0 when nothing is left. */
static int mgpu__plot_clip(mgpu__plot_box box, double x0, double y0, double x1, double y1,
                           double *t0, double *t1) {
    double dx = x1 - x0, dy = y1 - y0;
    double p[4], q[4]; /* side i keeps the t with p[i] * t <= q[i] */
    p[0] = -dx, q[0] = x0 - box.x0;
    p[1] = dx, q[1] = box.x1 - x0;
    p[2] = -dy, q[2] = y0 - box.y0;
    p[3] = dy, q[3] = box.y1 - y0;
    *t0 = 0;
    *t1 = 1;
    for (int i = 0; i < 4; i++) {
        if (p[i] == 0) { /* parallel to this side: wholly inside it or wholly outside */
            if (q[i] < 0) return 0;
        } else if (p[i] < 0) { /* coming in through this side */
            *t0 = fmax(*t0, q[i] / p[i]);
        } else { /* going out through it */
            *t1 = fmin(*t1, q[i] / p[i]);
        }
    }
    return *t0 <= *t1;
}

MGPU_DEF void mgpu_canvas_line(mgpu_canvas *c, double x0, double y0, double x1, double y1,
                               uint32_t rgb, int thickness) {
    mgpu__plot_box near_canvas;
    double t0, t1, ax, ay, bx, by;
    int steps, half;
    if (!isfinite(x0) || !isfinite(y0) || !isfinite(x1) || !isfinite(y1)) return;
    if (thickness < 1) thickness = 1;
    /* Walk only the part that can touch the canvas: a line towards a point
       far outside costs no more than one across the picture. */
    near_canvas.x0 = near_canvas.y0 = -thickness;
    near_canvas.x1 = c->width + thickness;
    near_canvas.y1 = c->height + thickness;
    if (!mgpu__plot_clip(near_canvas, x0, y0, x1, y1, &t0, &t1)) return;
    ax = x0 + t0 * (x1 - x0), ay = y0 + t0 * (y1 - y0);
    bx = x0 + t1 * (x1 - x0), by = y0 + t1 * (y1 - y0);
    /* One step per pixel along the longer direction, and at every step a
       thickness x thickness square (the "brush") centred on the line. */
    steps = (int)ceil(fmax(fabs(bx - ax), fabs(by - ay)));
    half = thickness / 2;
    for (int i = 0; i <= steps; i++) {
        double f = steps ? (double)i / steps : 0;
        int x = (int)lround(ax + f * (bx - ax)) - half, y = (int)lround(ay + f * (by - ay)) - half;
        mgpu_canvas_fill_rect(c, x, y, x + thickness, y + thickness, rgb);
    }
}

/* The segment's part inside `clip`; dashed when dash > 0 (dash pixels on,
   dash pixels off). *travel is the length of the polyline before this
   segment, so the dashes run on from one segment to the next. */
static void mgpu__plot_stroke(mgpu_canvas *c, mgpu__plot_box clip, double x0, double y0, double x1,
                              double y1, uint32_t rgb, int thickness, double dash, double *travel) {
    double len = hypot(x1 - x0, y1 - y0), start = *travel, t0, t1;
    *travel += len;
    if (!mgpu__plot_clip(clip, x0, y0, x1, y1, &t0, &t1)) return;
    if (dash <= 0 || len == 0) {
        mgpu_canvas_line(c, x0 + t0 * (x1 - x0), y0 + t0 * (y1 - y0), x0 + t1 * (x1 - x0),
                         y0 + t1 * (y1 - y0), rgb, thickness);
        return;
    }
    /* s runs along the segment from one dash boundary to the next. */
    for (double s = t0 * len; s < t1 * len;) {
        double phase = fmod(start + s, 2 * dash); /* < dash: in a dash; else in a gap */
        double end = fmin(s + (phase < dash ? dash - phase : 2 * dash - phase), t1 * len);
        if (end <= s) break; /* rounding left nothing to advance over */
        if (phase < dash)
            mgpu_canvas_line(c, x0 + s / len * (x1 - x0), y0 + s / len * (y1 - y0),
                             x0 + end / len * (x1 - x0), y0 + end / len * (y1 - y0), rgb,
                             thickness);
        s = end;
    }
}

static const unsigned char *mgpu__plot_glyph(char ch) {
    unsigned char code = (unsigned char)ch;
    return mgpu__font[(code < 32 || code > 126 ? '?' : code) - 32];
}

/* The width of n characters. */
static int mgpu__plot_chars_width(int n, int scale) {
    return n > 0 ? (n * MGPU__CELL_W - 1) * scale : 0; /* no blank column after the last glyph */
}

MGPU_DEF int mgpu_text_width(const char *text, int scale) {
    return mgpu__plot_chars_width(text ? (int)strlen(text) : 0, scale);
}

/* The n characters of text in a box whose top-left corner is (x, y);
   `vertical` turns it a quarter turn anticlockwise, to read from bottom to
   top (a y-axis label). A text with a lit pixel off the canvas is counted
   on it: pictures whose text the reader cannot read whole are found by
   asking the canvas, not by looking. */
static void mgpu__plot_text(mgpu_canvas *c, int x, int y, const char *text, int n, uint32_t rgb,
                            int scale, int vertical) {
    int length = mgpu__plot_chars_width(n, scale), cut = 0;
    if (scale < 1 || !text) return;
    for (int i = 0; i < n; i++) {
        const unsigned char *glyph = mgpu__plot_glyph(text[i]);
        for (int row = 0; row < MGPU__GLYPH_H; row++)
            for (int col = 0; col < MGPU__GLYPH_W; col++) {
                /* (along, across): the font pixel's place along the text and across it */
                int along = (i * MGPU__CELL_W + col) * scale, across = row * scale;
                int px = vertical ? x + across : x + along,
                    py = vertical ? y + length - along - scale : y + across;
                if (!(glyph[row] & (0x10 >> col))) continue;
                cut |= px < 0 || py < 0 || px + scale > c->width || py + scale > c->height;
                mgpu_canvas_fill_rect(c, px, py, px + scale, py + scale, rgb);
            }
    }
    if (cut && c->texts_cut++ == 0)
        snprintf(c->first_cut, sizeof c->first_cut, "%.*s", n, text);
}

MGPU_DEF void mgpu_canvas_text(mgpu_canvas *c, int x, int y, const char *text, uint32_t rgb,
                               int scale) {
    mgpu__plot_text(c, x, y, text, text ? (int)strlen(text) : 0, rgb, scale, 0);
}

static int mgpu__output_errors;
MGPU_DEF int mgpu_output_errors(void) {
    /* Standard output's failures count too: past the file-size limit its
       writes fail as a file's do (mgpu__whole_file_open ignores SIGXFSZ),
       and printf says nothing. (The stream keeps only that one failed, not
       why.) Said once. */
    static int stdout_failed;
    if (!stdout_failed && (fflush(stdout) != 0 || ferror(stdout))) {
        stdout_failed = 1;
        fprintf(stderr, "mgpu: error: standard output: cannot write (a write failed: a full disk, or the file-size limit)\n");
        mgpu__output_errors++;
    }
    return mgpu__output_errors;
}

/* One line on stderr about a file that could not be written; returns -1 so
   that callers can `return mgpu__plot_write_failed(...)`. */
static int mgpu__plot_write_failed(const char *path, const char *what, const char *reason) {
    fprintf(stderr, "mgpu: error: %s: cannot write %s (%s)\n", path, what, reason);
    mgpu__output_errors++;
    return -1;
}

/* stb_image_write hands the encoded PNG over piece by piece. A failed fwrite
   is remembered by the FILE and seen by ferror() at the end. */
static void mgpu__plot_png_piece(void *file, void *data, int size) {
    fwrite(data, 1, (size_t)size, (FILE *)file);
}

MGPU_DEF int mgpu_canvas_write_png(const mgpu_canvas *c, const char *path) {
    mgpu__whole_file w;
    if (!mgpu__whole_file_open(&w, path)) return mgpu__plot_write_failed(path, "PNG", strerror(errno));
    int encoded = stbi_write_png_to_func(mgpu__plot_png_piece, w.f, c->width, c->height, 3, c->rgb,
                                         c->width * 3);
    int error = mgpu__whole_file_close(&w, !encoded);
    return error ? mgpu__plot_write_failed(path, "PNG", encoded ? strerror(error) : "encoder failed") : 0;
}

/* Writes a picture the library laid out itself (a chart, a timeline).
   Text of it that ran off the canvas is a fault of the layout, or of a
   picture too small for its text: it is written all the same, to be
   looked at, and the fault reported as a failed write, so that a program
   (and a test) cannot miss it. */
static int mgpu__plot_write(const mgpu_canvas *c, const char *path) {
    int result = mgpu_canvas_write_png(c, path);
    if (result != 0 || !c->texts_cut) return result;
    fprintf(stderr, "mgpu: error: %s: %d text%s ran off the picture, the first \"%s\"\n", path, c->texts_cut,
            c->texts_cut > 1 ? "s" : "", c->first_cut);
    mgpu__output_errors++;
    return -1;
}

/* ---- 2. the frame: axes, ticks and the data-to-pixel mapping ------------ */

/* An axis shows values lo..hi with a tick every `step`. */
typedef struct mgpu__plot_axis {
    double lo, hi, step;
} mgpu__plot_axis;

/* 1, 2 or 5 times a power of ten, giving about `ticks` ticks over `span`:
   the steps people read easily. */
static double mgpu__plot_nice_step(double span, int ticks) {
    double raw = span / (ticks > 1 ? ticks : 1), magnitude = pow(10, floor(log10(raw))),
           ratio = raw / magnitude;
    return (ratio < 1.5 ? 1 : ratio < 3.5 ? 2 : ratio < 7.5 ? 5 : 10) * magnitude;
}

/* The axis for [lo, hi]: kept as it is when `fixed`; otherwise it comes from
   the data (lo > hi when there was none) and is widened to whole ticks. */
static mgpu__plot_axis mgpu__plot_axis_new(double lo, double hi, int fixed, int ticks) {
    mgpu__plot_axis a;
    if (!fixed && !(lo <= hi)) { /* no data at all */
        lo = 0;
        hi = 1;
    } else if (!fixed && lo == hi) { /* a single value: centre it */
        double pad = lo != 0 ? fabs(lo) / 10 : 1;
        lo -= pad;
        hi += pad;
    }
    a.step = mgpu__plot_nice_step(hi - lo, ticks);
    /* the 1e-9 keeps a value that is a whole tick up to rounding on that tick */
    a.lo = fixed ? lo : floor(lo / a.step + 1e-9) * a.step;
    a.hi = fixed ? hi : ceil(hi / a.step - 1e-9) * a.step;
    return a;
}

/* Tick i of an axis: its value and its label, with as many decimals as the
   step needs (a step of 0.05 gives "0.35"). Returns 0 past the last tick. */
static int mgpu__plot_tick(const mgpu__plot_axis *a, int i, double *value, char label[32]) {
    int decimals = a->step >= 1 ? 0 : (int)ceil(-log10(a->step) - 1e-9);
    *value = (ceil(a->lo / a->step - 1e-9) + i) * a->step;
    if (i >= 100 || *value > a->hi + a->step * 1e-9) return 0;
    if (*value == 0) *value = 0; /* -0.0 would print as "-0" */
    snprintf(label, 32, "%.*f", decimals, *value);
    return 1;
}

/* The frame of a chart: the plot area (pixels x0..x1, y0..y1, edges
   included, where the frame is drawn), its axes and the font scale. */
typedef struct mgpu__plot_frame {
    mgpu_canvas *c;
    int x0, y0, x1, y1;
    mgpu__plot_axis ax, ay;
    int scale;
} mgpu__plot_frame;

static double mgpu__plot_px(const mgpu__plot_frame *f, double x) {
    return f->x0 + (x - f->ax.lo) / (f->ax.hi - f->ax.lo) * (f->x1 - f->x0);
}

static double mgpu__plot_py(const mgpu__plot_frame *f, double y) /* pixel y grows downwards */
{
    return f->y1 - (y - f->ay.lo) / (f->ay.hi - f->ay.lo) * (f->y1 - f->y0);
}

static mgpu__plot_box mgpu__plot_area(const mgpu__plot_frame *f) {
    mgpu__plot_box box;
    box.x0 = f->x0, box.y0 = f->y0, box.x1 = f->x1, box.y1 = f->y1;
    return box;
}

/* The widest tick label of an axis, to size the margin beside it. */
static int mgpu__plot_widest_tick(const mgpu__plot_axis *a, int scale) {
    char label[32];
    double value;
    int widest = 0;
    for (int i = 0; mgpu__plot_tick(a, i, &value, label); i++)
        if (mgpu_text_width(label, scale) > widest) widest = mgpu_text_width(label, scale);
    return widest;
}

/* Grid lines, tick marks and numbers of the x axis (below the frame) or of
   the y axis (left of it). Drawn before the data, so the grid is behind it. */
static void mgpu__plot_ticks(const mgpu__plot_frame *f, int y_axis) {
    int s = f->scale, tick = 3 * s;
    char label[32];
    double value;
    for (int i = 0; mgpu__plot_tick(y_axis ? &f->ay : &f->ax, i, &value, label); i++) {
        int width = mgpu_text_width(label, s);
        if (y_axis) {
            int y = (int)lround(mgpu__plot_py(f, value));
            mgpu_canvas_fill_rect(f->c, f->x0 + 1, y, f->x1, y + 1, MGPU__GRID);
            mgpu_canvas_fill_rect(f->c, f->x0 - tick, y, f->x0, y + 1, MGPU__INK);
            mgpu_canvas_text(f->c, f->x0 - tick - 2 * s - width, y - MGPU__CAP_H * s / 2, label,
                             MGPU__INK, s);
        } else {
            int x = (int)lround(mgpu__plot_px(f, value));
            mgpu_canvas_fill_rect(f->c, x, f->y0 + 1, x + 1, f->y1, MGPU__GRID);
            mgpu_canvas_fill_rect(f->c, x, f->y1 + 1, x + 1, f->y1 + 1 + tick, MGPU__INK);
            mgpu_canvas_text(f->c, x - width / 2, f->y1 + tick + 3 * s, label, MGPU__INK, s);
        }
    }
}

/* A title or label broken into lines that fit, at spaces where it can be
   (a word longer than a line is cut across): line i is the length[i]
   characters from text + start[i]. The last of MGPU__PLOT_LINES lines
   takes whatever is left, too long or not; the writers report text that
   runs off the picture. */
#define MGPU__PLOT_LINES 6
#define MGPU__LINE_H 12 /* font pixels from one line's top to the next's */
typedef struct mgpu__plot_lines {
    int n, start[MGPU__PLOT_LINES], length[MGPU__PLOT_LINES];
} mgpu__plot_lines;

static mgpu__plot_lines mgpu__plot_wrap(const char *text, int width, int s) {
    mgpu__plot_lines w;
    int fit = (width / s + 1) / MGPU__CELL_W; /* the most characters in `width` pixels */
    int at = 0, end = text ? (int)strlen(text) : 0;
    if (fit < 1) fit = 1;
    w.n = 0;
    while (w.n < MGPU__PLOT_LINES) {
        int take, length;
        while (at < end && text[at] == ' ') at++;
        if (at == end) break;
        take = end - at;
        if (take > fit && w.n < MGPU__PLOT_LINES - 1) {
            take = fit; /* then back to the last space that leaves a line that fits */
            for (int k = fit; k > 0; k--)
                if (text[at + k] == ' ') {
                    take = k;
                    break;
                }
        }
        for (length = take; text[at + length - 1] == ' ';) length--;
        w.start[w.n] = at;
        w.length[w.n++] = length;
        at += take;
    }
    return w;
}

/* The lines of a wrapped text, each centred on `centre` along its
   direction (moved in from an edge of the canvas where it would run off
   it), the first one's top (turned: its left side) at `first`. */
static void mgpu__plot_text_lines(mgpu_canvas *c, const char *text, const mgpu__plot_lines *w,
                                  int centre, int first, int s, int vertical) {
    int room = vertical ? c->height : c->width;
    for (int i = 0; i < w->n; i++) {
        int length = mgpu__plot_chars_width(w->length[i], s);
        int along = centre - length / 2, across = first + i * MGPU__LINE_H * s;
        if (along + length > room - 4 * s) along = room - 4 * s - length;
        if (along < 4 * s) along = 4 * s;
        mgpu__plot_text(c, vertical ? across : along, vertical ? along : across, text + w->start[i],
                        w->length[i], MGPU__INK, s, vertical);
    }
}

/* The margins: the title's lines above the plot area, the tick numbers
   and the x label's lines below it, in a picture `width` pixels wide. */
static mgpu__plot_lines mgpu__plot_title_lines(const char *title, int width, int s) {
    return mgpu__plot_wrap(title, width - 8 * s, s);
}
static int mgpu__plot_top(const char *title, int width, int s) {
    int lines = mgpu__plot_title_lines(title, width, s).n;
    return lines ? (8 + MGPU__LINE_H * lines) * s : 8 * s;
}
static int mgpu__plot_bottom(const char *xlabel, int width, int s) {
    int lines = mgpu__plot_title_lines(xlabel, width, s).n;
    return lines ? (20 + MGPU__LINE_H * lines) * s : 18 * s;
}

/* Chooses the x axis for data in [xlo, xhi] (see mgpu__plot_axis_new) and
   places the plot area: `left_width` pixels of numbers or names left of it,
   and `below` pixels for something else (a legend) under its margin. */
static void mgpu__plot_layout(mgpu__plot_frame *f, double xlo, double xhi, int xfixed,
                              int left_width, int below, const char *title, const char *xlabel,
                              const char *ylabel) {
    int s = f->scale, ylines;
    f->y0 = mgpu__plot_top(title, f->c->width, s);
    f->y1 = f->c->height - 1 - below - mgpu__plot_bottom(xlabel, f->c->width, s);
    ylines = mgpu__plot_wrap(ylabel, f->y1 - f->y0 + 1, s).n; /* (turned: as long as the frame is high) */
    f->x0 = 4 * s + (ylines ? (MGPU__LINE_H * ylines + 2) * s : 0) + left_width + 5 * s;
    /* About one tick per 50 font pixels of width, fewer while the numbers
       would run into each other. The last number is centred on the right
       edge of the frame, so half of it must fit beside the frame. */
    for (int ticks = f->c->width / (50 * s);; ticks--) {
        int widest;
        f->ax = mgpu__plot_axis_new(xlo, xhi, xfixed, ticks);
        widest = mgpu__plot_widest_tick(&f->ax, s);
        f->x1 = f->c->width - 1 - 4 * s - widest / 2;
        if (ticks <= 2 || f->ax.step / (f->ax.hi - f->ax.lo) * (f->x1 - f->x0) >= widest + 6 * s)
            break;
    }
}

/* Title above the plot area, x label under the tick numbers, y label
   turned up the left edge of the picture; each centred on the plot area,
   in as many lines as the margins mgpu__plot_layout made for them. */
static void mgpu__plot_labels(const mgpu__plot_frame *f, const char *title, const char *xlabel,
                              const char *ylabel) {
    int s = f->scale, cx = (f->x0 + f->x1) / 2, cy = (f->y0 + f->y1) / 2;
    mgpu__plot_lines t = mgpu__plot_title_lines(title, f->c->width, s),
                     x = mgpu__plot_title_lines(xlabel, f->c->width, s),
                     y = mgpu__plot_wrap(ylabel, f->y1 - f->y0 + 1, s);
    mgpu__plot_text_lines(f->c, title, &t, cx, 5 * s, s, 0);
    mgpu__plot_text_lines(f->c, xlabel, &x, cx, f->y1 + 19 * s, s, 0);
    mgpu__plot_text_lines(f->c, ylabel, &y, cy, 4 * s, s, 1);
}

/* ---- 3. line charts and the Animator ------------------------------------ */

/* How many pixels of a w x h box at (x, y) are data: neither background nor
   grid. The legend goes where this is smallest. */
static long mgpu__chart_ink(const mgpu_canvas *c, int x, int y, int w, int h) {
    int x0 = mgpu__plot_clamp(x, 0, c->width), x1 = mgpu__plot_clamp(x + w, 0, c->width);
    int y0 = mgpu__plot_clamp(y, 0, c->height), y1 = mgpu__plot_clamp(y + h, 0, c->height);
    long count = 0;
    for (int j = y0; j < y1; j++)
        for (int i = x0; i < x1; i++) {
            const unsigned char *p = c->rgb + ((size_t)j * (size_t)c->width + (size_t)i) * 3;
            uint32_t rgb = (uint32_t)p[0] << 16 | (uint32_t)p[1] << 8 | p[2];
            count += rgb != MGPU__WHITE && rgb != MGPU__GRID;
        }
    return count;
}

static uint32_t mgpu__chart_color(const mgpu_chart *ch, int i) {
    return ch->series[i].color ? ch->series[i].color : mgpu_palette(i);
}

/* One curve. Points with a NaN (or infinite) coordinate are passed over and
   their neighbours joined, as the book's Animator does with missing values. */
static void mgpu__chart_curve(const mgpu__plot_frame *f, const mgpu_series *series, uint32_t rgb) {
    int s = f->scale, points = 0;
    double travel = 0, px = 0, py = 0;
    for (int i = 0; i < series->n; i++) {
        double qx, qy;
        if (!isfinite(series->x[i]) || !isfinite(series->y[i])) continue;
        qx = mgpu__plot_px(f, series->x[i]), qy = mgpu__plot_py(f, series->y[i]);
        if (points++)
            mgpu__plot_stroke(f->c, mgpu__plot_area(f), px, py, qx, qy, rgb, s,
                              series->dashed ? 6 * s : 0, &travel);
        px = qx, py = qy;
    }
    if (points == 1) /* a lone point draws no line: mark it with a dot */
        mgpu__plot_stroke(f->c, mgpu__plot_area(f), px, py, px, py, rgb, 3 * s, 0, &travel);
}

/* A box with a line sample and the name of every named series, in the
   corner of the plot area that hides the fewest data pixels. */
static void mgpu__chart_legend(const mgpu__plot_frame *f, const mgpu_chart *ch) {
    int s = f->scale, pad = 5 * s, row = 12 * s, sample = 18 * s, entries = 0, widest = 0;
    int w, h, x = 0, y = 0;
    long least = -1;
    for (int i = 0; i < ch->nseries; i++) {
        if (!ch->series[i].name) continue;
        entries++;
        if (mgpu_text_width(ch->series[i].name, s) > widest)
            widest = mgpu_text_width(ch->series[i].name, s);
    }
    if (!entries) return;
    w = 3 * pad + sample + widest;
    h = 2 * pad + entries * row - 3 * s;
    /* corners in the order tried: upper right, upper left, lower right, lower left */
    for (int corner = 0; corner < 4; corner++) {
        int cx = corner % 2 ? f->x0 + pad : f->x1 - pad - w,
            cy = corner < 2 ? f->y0 + pad : f->y1 - pad - h;
        long ink = mgpu__chart_ink(f->c, cx, cy, w, h);
        if (least < 0 || ink < least) least = ink, x = cx, y = cy;
    }
    mgpu_canvas_fill_rect(f->c, x, y, x + w, y + h, MGPU__WHITE);
    mgpu__plot_outline(f->c, x, y, x + w - 1, y + h - 1, 0xAAAAAA);
    y += pad;
    for (int i = 0; i < ch->nseries; i++) {
        double travel = 0, mid = y + MGPU__CAP_H * s / 2;
        if (!ch->series[i].name) continue;
        mgpu__plot_stroke(f->c, mgpu__plot_area(f), x + pad, mid, x + pad + sample, mid,
                          mgpu__chart_color(ch, i), s, ch->series[i].dashed ? 6 * s : 0, &travel);
        mgpu_canvas_text(f->c, x + 2 * pad + sample, y, ch->series[i].name, MGPU__INK, s);
        y += row;
    }
}

MGPU_DEF int mgpu_chart_write_png(const mgpu_chart *ch, const char *path) {
    mgpu__plot_frame f;
    double xlo = INFINITY, xhi = -INFINITY, ylo = INFINITY, yhi = -INFINITY;
    int width = ch->width > 0 ? ch->width : 640, height = ch->height > 0 ? ch->height : 480, result;
    int xfixed = ch->xmin < ch->xmax, yfixed = ch->ymin < ch->ymax;
    for (int i = 0; i < ch->nseries; i++)
        for (int j = 0; j < ch->series[i].n; j++) {
            double x = ch->series[i].x[j], y = ch->series[i].y[j];
            if (!isfinite(x) || !isfinite(y)) continue;
            xlo = fmin(xlo, x), xhi = fmax(xhi, x), ylo = fmin(ylo, y), yhi = fmax(yhi, y);
        }
    f.c = mgpu_canvas_new(width, height, MGPU__WHITE);
    f.scale = width >= 480 && height >= 360 ? 2 : 1;
    /* about one y tick per 40 font pixels of height */
    f.ay = mgpu__plot_axis_new(yfixed ? ch->ymin : ylo, yfixed ? ch->ymax : yhi, yfixed,
                               height / (40 * f.scale));
    mgpu__plot_layout(&f, xfixed ? ch->xmin : xlo, xfixed ? ch->xmax : xhi, xfixed,
                      mgpu__plot_widest_tick(&f.ay, f.scale), 0, ch->title, ch->xlabel, ch->ylabel);
    /* back to front: grid, curves, legend, then the frame over the curves' ends */
    mgpu__plot_ticks(&f, 0);
    mgpu__plot_ticks(&f, 1);
    for (int i = 0; i < ch->nseries; i++)
        mgpu__chart_curve(&f, &ch->series[i], mgpu__chart_color(ch, i));
    mgpu__chart_legend(&f, ch);
    mgpu__plot_outline(f.c, f.x0, f.y0, f.x1, f.y1, MGPU__INK);
    mgpu__plot_labels(&f, ch->title, ch->xlabel, ch->ylabel);
    result = mgpu__plot_write(f.c, path);
    mgpu_canvas_free(f.c);
    return result;
}

struct mgpu_animator {
    char *png_path, *csv_path; /* NULL: write nothing */
    char *title, *xlabel, *ylabel;
    double xmin, xmax;
    int nseries;
    char **names;
    int n, capacity; /* points added, and room for */
    double *x;       /* x[i]: the x of point i */
    double **y;      /* y[k][i]: series k at point i, NaN for none */
};

MGPU_DEF mgpu_animator *mgpu_animator_new(const char *png_path, const char *title,
                                          const char *xlabel, const char *ylabel, double xmin,
                                          double xmax, int nseries, const char *const *names) {
    mgpu_animator *a = (mgpu_animator *)mgpu__xmalloc(sizeof *a);
    memset(a, 0, sizeof *a);
    if (png_path) { /* the CSV goes beside the PNG: "run.png" -> "run.csv" */
        size_t stem = strlen(png_path);
        if (stem >= 4 && strcmp(png_path + stem - 4, ".png") == 0) stem -= 4;
        a->png_path = mgpu__plot_strdup(png_path);
        a->csv_path = (char *)mgpu__xmalloc(stem + 5);
        memcpy(a->csv_path, png_path, stem);
        strcpy(a->csv_path + stem, ".csv");
    }
    a->title = mgpu__plot_strdup(title);
    a->xlabel = mgpu__plot_strdup(xlabel);
    a->ylabel = mgpu__plot_strdup(ylabel);
    a->xmin = xmin;
    a->xmax = xmax;
    a->nseries = nseries > 0 ? nseries : 0;
    a->names = (char **)mgpu__xmalloc((size_t)a->nseries * sizeof *a->names);
    a->y = (double **)mgpu__xmalloc((size_t)a->nseries * sizeof *a->y);
    for (int k = 0; k < a->nseries; k++) {
        a->names[k] = mgpu__plot_strdup(names ? names[k] : NULL);
        a->y[k] = NULL;
    }
    return a;
}

MGPU_DEF void mgpu_animator_free(mgpu_animator *a) {
    if (!a) return;
    for (int k = 0; k < a->nseries; k++) {
        free(a->names[k]);
        free(a->y[k]);
    }
    free(a->names);
    free(a->y);
    free(a->x);
    free(a->png_path);
    free(a->csv_path);
    free(a->title);
    free(a->xlabel);
    free(a->ylabel);
    free(a);
}

/* A series number that the animator does not have is a bug in the caller. */
static void mgpu__animator_check(const mgpu_animator *a, int series) {
    MGPU_REQUIRE(series >= 0 && series < a->nseries, "animator has no series %d (it has %d)",
                 series, a->nseries);
}

MGPU_DEF int mgpu_animator_count(const mgpu_animator *a) { return a->n; }

MGPU_DEF double mgpu_animator_last(const mgpu_animator *a, int series) {
    mgpu__animator_check(a, series);
    for (int i = a->n - 1; i >= 0; i--)
        if (!isnan(a->y[series][i])) return a->y[series][i];
    return NAN;
}

/* "x,name1,name2,..." and then one line per point; NaN is an empty field,
   which spreadsheets and pandas read as a missing value. */
static int mgpu__animator_write_csv(const mgpu_animator *a) {
    mgpu__whole_file w;
    if (!mgpu__whole_file_open(&w, a->csv_path)) return mgpu__plot_write_failed(a->csv_path, "CSV", strerror(errno));
    FILE *f = w.f;
    fputs("x", f);
    for (int k = 0; k < a->nseries; k++) fprintf(f, ",%s", a->names[k] ? a->names[k] : "");
    for (int i = 0; i < a->n; i++) {
        fprintf(f, "\n%.9g", a->x[i]);
        for (int k = 0; k < a->nseries; k++) {
            if (isnan(a->y[k][i]))
                fputs(",", f);
            else
                fprintf(f, ",%.9g", a->y[k][i]);
        }
    }
    fputs("\n", f);
    int error = mgpu__whole_file_close(&w, 0);
    return error ? mgpu__plot_write_failed(a->csv_path, "CSV", strerror(error)) : 0;
}

/* The curve of series k, labelled `name`. */
static mgpu_series mgpu__animator_series(const mgpu_animator *a, int k, const char *name) {
    mgpu_series s;
    memset(&s, 0, sizeof s);
    s.name = name;
    s.n = a->n;
    s.x = a->x;
    s.y = a->y[k];
    return s;
}

/* A chart of `nseries` curves with the animator's title, labels and x range. */
static mgpu_chart mgpu__animator_chart(const mgpu_animator *a, int nseries,
                                       const mgpu_series *series) {
    mgpu_chart ch;
    memset(&ch, 0, sizeof ch);
    ch.title = a->title;
    ch.xlabel = a->xlabel;
    ch.ylabel = a->ylabel;
    ch.xmin = a->xmin;
    ch.xmax = a->xmax;
    ch.nseries = nseries;
    ch.series = series;
    return ch;
}

MGPU_DEF void mgpu_animator_add(mgpu_animator *a, double x, const double *ys) {
    mgpu_series *series;
    mgpu_chart ch;
    if (a->n == a->capacity) {
        a->capacity = a->capacity ? 2 * a->capacity : 64;
        a->x = (double *)mgpu__plot_grow(a->x, (size_t)a->capacity * sizeof *a->x);
        for (int k = 0; k < a->nseries; k++)
            a->y[k] = (double *)mgpu__plot_grow(a->y[k], (size_t)a->capacity * sizeof *a->y[k]);
    }
    a->x[a->n] = x;
    for (int k = 0; k < a->nseries; k++) a->y[k][a->n] = ys[k];
    a->n++;
    if (!a->png_path) return;
    series = (mgpu_series *)mgpu__xmalloc((size_t)a->nseries * sizeof *series);
    for (int k = 0; k < a->nseries; k++) series[k] = mgpu__animator_series(a, k, a->names[k]);
    ch = mgpu__animator_chart(a, a->nseries, series);
    /* One error line is enough: after a failed write the animator stops
       writing (rather than repeating the error at every point) and only
       keeps the points. */
    if (mgpu__animator_write_csv(a) != 0 || mgpu_chart_write_png(&ch, a->png_path) != 0) {
        free(a->png_path);
        free(a->csv_path);
        a->png_path = a->csv_path = NULL;
    }
    free(series);
}

MGPU_DEF int mgpu_animator_write_combined(const char *png_path, const char *title, int nanimators,
                                          const mgpu_animator *const *animators, int series,
                                          const char *const *labels) {
    mgpu_series *curves =
        (mgpu_series *)mgpu__xcalloc((size_t)(nanimators > 0 ? nanimators : 0), sizeof *curves);
    mgpu_chart ch;
    int result;
    memset(&ch, 0, sizeof ch);
    for (int i = 0; i < nanimators; i++) {
        const mgpu_animator *a = animators[i];
        mgpu__animator_check(a, series);
        const char *label = labels ? labels[i] : a->title ? a->title : a->names[series];
        curves[i] = mgpu__animator_series(a, series, label);
    }
    if (nanimators > 0) {
        ch = mgpu__animator_chart(animators[0], nanimators, curves);
        /* the legend names the runs, so the y axis says what the curves are */
        if (!ch.ylabel || !*ch.ylabel) ch.ylabel = animators[0]->names[series];
    }
    ch.title = title;
    result = mgpu_chart_write_png(&ch, png_path);
    free(curves);
    return result;
}

/* ---- 4. device timelines ------------------------------------------------ */

/* A distinct bar name and the palette colour it got. */
typedef struct mgpu__timeline_key {
    const char *name;
    int slot;
} mgpu__timeline_key;

/* FNV-1a: a simple hash that spreads short names well. */
static uint32_t mgpu__timeline_hash(const char *s) {
    uint32_t h = 2166136261u;
    while (*s) h = (h ^ (unsigned char)*s++) * 16777619u;
    return h;
}

/* The index of `name` among the keys, adding it on first sight. A new name
   gets the colour its hash points at or, if another name has that one, the
   next free one (linear probing): the same name keeps its colour from one
   picture to the next as far as possible, and two names in a picture share
   a colour only when there are more than ten. */
static int mgpu__timeline_key_of(mgpu__timeline_key *keys, int *nkeys, const char *name) {
    int slot = (int)(mgpu__timeline_hash(name) % 10);
    for (int k = 0; k < *nkeys; k++)
        if (strcmp(keys[k].name, name) == 0) return k;
    for (int tries = 0; tries < 10; tries++, slot = (slot + 1) % 10) {
        int taken = 0;
        for (int k = 0; k < *nkeys; k++) taken |= keys[k].slot == slot;
        if (!taken) break;
    } /* all ten taken: the loop came back round to the hash's colour */
    keys[*nkeys].name = name;
    keys[*nkeys].slot = slot;
    return (*nkeys)++;
}

/* The legend under a timeline: a colour square and a name for every key,
   in rows wrapped at `width`. Every name is there: a picture whose
   colours the legend does not all explain cannot be read (the bars'
   makers keep the names few: the tracer gives kinds of work, not
   operations). Returns its height; with c == NULL it only measures. */
static int mgpu__timeline_legend(mgpu_canvas *c, int x0, int y0, int width,
                                 const mgpu__timeline_key *keys, int nkeys, int s) {
    int x = x0, y = y0, row = 14 * s;
    for (int k = 0; k < nkeys; k++) {
        int swatch = 11 * s, w = swatch + mgpu_text_width(keys[k].name, s);
        if (x > x0 && x + w > x0 + width) x = x0, y += row; /* wrap */
        if (c) {
            mgpu_canvas_fill_rect(c, x, y, x + 7 * s, y + 7 * s, mgpu_palette(keys[k].slot));
            mgpu_canvas_text(c, x + swatch, y, keys[k].name, MGPU__INK, s);
        }
        x += w + 14 * s;
    }
    return nkeys ? y + row - y0 : 0;
}

/* Black or white, whichever reads better on `rgb` (by its luminance). */
static uint32_t mgpu__timeline_text_color(uint32_t rgb) {
    double luma = 0.299 * (rgb >> 16 & 255) + 0.587 * (rgb >> 8 & 255) + 0.114 * (rgb & 255);
    return luma > 150 ? 0x000000 : 0xFFFFFF;
}

MGPU_DEF int mgpu_timeline_write_png(const char *path, const char *title, int nlanes,
                                     const char *const *lane_names, int nbars,
                                     const mgpu_timeline_bar *bars) {
    const int s = 2, width = 1000, lane_h = 16 * s;
    const char *xlabel = "time (ms)";
    size_t room = (size_t)(nbars > 0 ? nbars : 0); /* at most one key per bar */
    mgpu__timeline_key *keys = (mgpu__timeline_key *)mgpu__xcalloc(room, sizeof *keys);
    int *key_of = (int *)mgpu__xcalloc(room, sizeof *key_of);
    int nkeys = 0, names_w = 0, legend_h, result;
    double lo = INFINITY, hi = -INFINITY;
    mgpu__plot_frame f;
    for (int b = 0; b < nbars; b++) { /* bars off every lane or with no time span are left out */
        int drawn = bars[b].lane >= 0 && bars[b].lane < nlanes && isfinite(bars[b].start_ms) &&
                    isfinite(bars[b].end_ms) && bars[b].start_ms <= bars[b].end_ms;
        key_of[b] = drawn ? mgpu__timeline_key_of(keys, &nkeys, bars[b].name) : -1;
        if (drawn) lo = fmin(lo, bars[b].start_ms), hi = fmax(hi, bars[b].end_ms);
    }
    for (int l = 0; l < nlanes; l++)
        if (mgpu_text_width(lane_names[l], s) > names_w)
            names_w = mgpu_text_width(lane_names[l], s);
    /* The picture is as tall as its lanes and legend need. */
    legend_h = mgpu__timeline_legend(NULL, 4 * s, 0, width - 8 * s, keys, nkeys, s);
    f.c = mgpu_canvas_new(width,
                          mgpu__plot_top(title, width, s) + nlanes * lane_h + 1 +
                              mgpu__plot_bottom(xlabel, width, s) + legend_h + 4 * s,
                          MGPU__WHITE);
    f.scale = s;
    f.ay.lo = f.ay.hi = f.ay.step = 0; /* unused: the vertical direction holds lanes, not values */
    mgpu__plot_layout(&f, lo, hi, 0, names_w, legend_h + 4 * s, title, xlabel, NULL);
    for (int l = 0; l < nlanes; l++) {
        int top = f.y0 + l * lane_h;
        /* every other lane shaded: stripes guide the eye along a lane */
        if (l % 2) mgpu_canvas_fill_rect(f.c, f.x0, top, f.x1, top + lane_h, 0xF4F4F4);
        mgpu_canvas_text(f.c, f.x0 - 5 * s - mgpu_text_width(lane_names[l], s),
                         top + (lane_h - MGPU__CAP_H * s) / 2, lane_names[l], MGPU__INK, s);
    }
    mgpu__plot_ticks(&f, 0);
    for (int b = 0; b < nbars; b++) {
        const mgpu_timeline_bar *bar = &bars[b];
        int x0 = (int)lround(mgpu__plot_px(&f, bar->start_ms)),
            x1 = (int)lround(mgpu__plot_px(&f, bar->end_ms));
        int top = f.y0 + bar->lane * lane_h + 3 * s, bottom = top + lane_h - 6 * s;
        uint32_t rgb;
        if (key_of[b] < 0) continue;
        rgb = mgpu_palette(keys[key_of[b]].slot);
        /* At least one pixel, so that the shortest operation still shows; a
           one-pixel gap at the end, so that back-to-back bars stay apart. */
        x1 = x1 - x0 >= 3 ? x1 - 1 : x0 + 1;
        mgpu_canvas_fill_rect(f.c, x0, top, x1, bottom, rgb);
        const char *text = bar->label[0] ? bar->label : bar->name;
        if (mgpu_text_width(text, s) + 4 * s <= x1 - x0)
            mgpu_canvas_text(f.c, (x0 + x1 - mgpu_text_width(text, s)) / 2,
                             (top + bottom - MGPU__CAP_H * s) / 2, text, mgpu__timeline_text_color(rgb), s);
    }
    mgpu__plot_outline(f.c, f.x0, f.y0, f.x1, f.y1, MGPU__INK);
    mgpu__plot_labels(&f, title, xlabel, NULL);
    mgpu__timeline_legend(f.c, 4 * s, f.y1 + mgpu__plot_bottom(xlabel, width, s), width - 8 * s, keys,
                          nkeys, s);
    result = mgpu__plot_write(f.c, path);
    mgpu_canvas_free(f.c);
    free(keys);
    free(key_of);
    return result;
}
