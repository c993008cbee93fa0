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
   Out of memory is fatal here as everywhere in mgpu: a picture is not worth
   a half-working program. */
#include <errno.h>
#include <stb/stb_image_write.h>

/* ---- 1. the canvas ------------------------------------------------------ */

static void *mgpu__plot_alloc(size_t size)
{
    void *p = malloc(size ? size : 1);
    if (!p) {
        fprintf(stderr, "mgpu: error: out of memory (%zu bytes for a plot)\n", size);
        exit(1);
    }
    return p;
}

/* A duplicate of s; NULL stays NULL. */
static char *mgpu__plot_strdup(const char *s)
{
    char *copy;
    if (!s) return NULL;
    copy = (char *)mgpu__plot_alloc(strlen(s) + 1);
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
    {0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00}, /* space */
    {0x04,0x04,0x04,0x04,0x04,0x00,0x04,0x00,0x00}, /* ! */
    {0x0A,0x0A,0x0A,0x00,0x00,0x00,0x00,0x00,0x00}, /* " */
    {0x0A,0x0A,0x1F,0x0A,0x1F,0x0A,0x0A,0x00,0x00}, /* # */
    {0x04,0x0F,0x14,0x0E,0x05,0x1E,0x04,0x00,0x00}, /* $ */
    {0x18,0x19,0x02,0x04,0x08,0x13,0x03,0x00,0x00}, /* % */
    {0x0C,0x12,0x14,0x08,0x15,0x12,0x0D,0x00,0x00}, /* & */
    {0x04,0x04,0x08,0x00,0x00,0x00,0x00,0x00,0x00}, /* ' */
    {0x02,0x04,0x08,0x08,0x08,0x04,0x02,0x00,0x00}, /* ( */
    {0x08,0x04,0x02,0x02,0x02,0x04,0x08,0x00,0x00}, /* ) */
    {0x00,0x04,0x15,0x0E,0x15,0x04,0x00,0x00,0x00}, /* asterisk */
    {0x00,0x04,0x04,0x1F,0x04,0x04,0x00,0x00,0x00}, /* + */
    {0x00,0x00,0x00,0x00,0x00,0x0C,0x04,0x08,0x00}, /* , */
    {0x00,0x00,0x00,0x1F,0x00,0x00,0x00,0x00,0x00}, /* - */
    {0x00,0x00,0x00,0x00,0x00,0x0C,0x0C,0x00,0x00}, /* . */
    {0x00,0x01,0x02,0x04,0x08,0x10,0x00,0x00,0x00}, /* slash */
    {0x0E,0x11,0x13,0x15,0x19,0x11,0x0E,0x00,0x00}, /* 0 */
    {0x04,0x0C,0x04,0x04,0x04,0x04,0x0E,0x00,0x00}, /* 1 */
    {0x0E,0x11,0x01,0x02,0x04,0x08,0x1F,0x00,0x00}, /* 2 */
    {0x1F,0x02,0x04,0x02,0x01,0x11,0x0E,0x00,0x00}, /* 3 */
    {0x02,0x06,0x0A,0x12,0x1F,0x02,0x02,0x00,0x00}, /* 4 */
    {0x1F,0x10,0x1E,0x01,0x01,0x11,0x0E,0x00,0x00}, /* 5 */
    {0x06,0x08,0x10,0x1E,0x11,0x11,0x0E,0x00,0x00}, /* 6 */
    {0x1F,0x01,0x02,0x04,0x08,0x08,0x08,0x00,0x00}, /* 7 */
    {0x0E,0x11,0x11,0x0E,0x11,0x11,0x0E,0x00,0x00}, /* 8 */
    {0x0E,0x11,0x11,0x0F,0x01,0x02,0x0C,0x00,0x00}, /* 9 */
    {0x00,0x0C,0x0C,0x00,0x0C,0x0C,0x00,0x00,0x00}, /* : */
    {0x00,0x0C,0x0C,0x00,0x0C,0x04,0x08,0x00,0x00}, /* ; */
    {0x02,0x04,0x08,0x10,0x08,0x04,0x02,0x00,0x00}, /* < */
    {0x00,0x00,0x1F,0x00,0x1F,0x00,0x00,0x00,0x00}, /* = */
    {0x08,0x04,0x02,0x01,0x02,0x04,0x08,0x00,0x00}, /* > */
    {0x0E,0x11,0x01,0x02,0x04,0x00,0x04,0x00,0x00}, /* ? */
    {0x0E,0x11,0x01,0x0D,0x15,0x15,0x0E,0x00,0x00}, /* @ */
    {0x0E,0x11,0x11,0x1F,0x11,0x11,0x11,0x00,0x00}, /* A */
    {0x1E,0x11,0x11,0x1E,0x11,0x11,0x1E,0x00,0x00}, /* B */
    {0x0E,0x11,0x10,0x10,0x10,0x11,0x0E,0x00,0x00}, /* C */
    {0x1C,0x12,0x11,0x11,0x11,0x12,0x1C,0x00,0x00}, /* D */
    {0x1F,0x10,0x10,0x1E,0x10,0x10,0x1F,0x00,0x00}, /* E */
    {0x1F,0x10,0x10,0x1E,0x10,0x10,0x10,0x00,0x00}, /* F */
    {0x0E,0x11,0x10,0x17,0x11,0x11,0x0F,0x00,0x00}, /* G */
    {0x11,0x11,0x11,0x1F,0x11,0x11,0x11,0x00,0x00}, /* H */
    {0x0E,0x04,0x04,0x04,0x04,0x04,0x0E,0x00,0x00}, /* I */
    {0x07,0x02,0x02,0x02,0x02,0x12,0x0C,0x00,0x00}, /* J */
    {0x11,0x12,0x14,0x18,0x14,0x12,0x11,0x00,0x00}, /* K */
    {0x10,0x10,0x10,0x10,0x10,0x10,0x1F,0x00,0x00}, /* L */
    {0x11,0x1B,0x15,0x15,0x11,0x11,0x11,0x00,0x00}, /* M */
    {0x11,0x11,0x19,0x15,0x13,0x11,0x11,0x00,0x00}, /* N */
    {0x0E,0x11,0x11,0x11,0x11,0x11,0x0E,0x00,0x00}, /* O */
    {0x1E,0x11,0x11,0x1E,0x10,0x10,0x10,0x00,0x00}, /* P */
    {0x0E,0x11,0x11,0x11,0x15,0x12,0x0D,0x00,0x00}, /* Q */
    {0x1E,0x11,0x11,0x1E,0x14,0x12,0x11,0x00,0x00}, /* R */
    {0x0F,0x10,0x10,0x0E,0x01,0x01,0x1E,0x00,0x00}, /* S */
    {0x1F,0x04,0x04,0x04,0x04,0x04,0x04,0x00,0x00}, /* T */
    {0x11,0x11,0x11,0x11,0x11,0x11,0x0E,0x00,0x00}, /* U */
    {0x11,0x11,0x11,0x11,0x11,0x0A,0x04,0x00,0x00}, /* V */
    {0x11,0x11,0x11,0x15,0x15,0x15,0x0A,0x00,0x00}, /* W */
    {0x11,0x11,0x0A,0x04,0x0A,0x11,0x11,0x00,0x00}, /* X */
    {0x11,0x11,0x0A,0x04,0x04,0x04,0x04,0x00,0x00}, /* Y */
    {0x1F,0x01,0x02,0x04,0x08,0x10,0x1F,0x00,0x00}, /* Z */
    {0x0E,0x08,0x08,0x08,0x08,0x08,0x0E,0x00,0x00}, /* [ */
    {0x00,0x10,0x08,0x04,0x02,0x01,0x00,0x00,0x00}, /* backslash */
    {0x0E,0x02,0x02,0x02,0x02,0x02,0x0E,0x00,0x00}, /* ] */
    {0x04,0x0A,0x11,0x00,0x00,0x00,0x00,0x00,0x00}, /* ^ */
    {0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x1F,0x00}, /* _ */
    {0x08,0x04,0x02,0x00,0x00,0x00,0x00,0x00,0x00}, /* ` */
    {0x00,0x00,0x0E,0x01,0x0F,0x11,0x0F,0x00,0x00}, /* a */
    {0x10,0x10,0x16,0x19,0x11,0x11,0x1E,0x00,0x00}, /* b */
    {0x00,0x00,0x0E,0x10,0x10,0x11,0x0E,0x00,0x00}, /* c */
    {0x01,0x01,0x0D,0x13,0x11,0x11,0x0F,0x00,0x00}, /* d */
    {0x00,0x00,0x0E,0x11,0x1F,0x10,0x0E,0x00,0x00}, /* e */
    {0x06,0x09,0x08,0x1C,0x08,0x08,0x08,0x00,0x00}, /* f */
    {0x00,0x00,0x0F,0x11,0x11,0x11,0x0F,0x01,0x0E}, /* g */
    {0x10,0x10,0x16,0x19,0x11,0x11,0x11,0x00,0x00}, /* h */
    {0x04,0x00,0x0C,0x04,0x04,0x04,0x0E,0x00,0x00}, /* i */
    {0x02,0x00,0x06,0x02,0x02,0x02,0x02,0x12,0x0C}, /* j */
    {0x10,0x10,0x12,0x14,0x18,0x14,0x12,0x00,0x00}, /* k */
    {0x0C,0x04,0x04,0x04,0x04,0x04,0x0E,0x00,0x00}, /* l */
    {0x00,0x00,0x1A,0x15,0x15,0x15,0x15,0x00,0x00}, /* m */
    {0x00,0x00,0x16,0x19,0x11,0x11,0x11,0x00,0x00}, /* n */
    {0x00,0x00,0x0E,0x11,0x11,0x11,0x0E,0x00,0x00}, /* o */
    {0x00,0x00,0x1E,0x11,0x11,0x11,0x1E,0x10,0x10}, /* p */
    {0x00,0x00,0x0F,0x11,0x11,0x11,0x0F,0x01,0x01}, /* q */
    {0x00,0x00,0x16,0x19,0x10,0x10,0x10,0x00,0x00}, /* r */
    {0x00,0x00,0x0F,0x10,0x0E,0x01,0x1E,0x00,0x00}, /* s */
    {0x08,0x08,0x1C,0x08,0x08,0x09,0x06,0x00,0x00}, /* t */
    {0x00,0x00,0x11,0x11,0x11,0x13,0x0D,0x00,0x00}, /* u */
    {0x00,0x00,0x11,0x11,0x11,0x0A,0x04,0x00,0x00}, /* v */
    {0x00,0x00,0x11,0x11,0x15,0x15,0x0A,0x00,0x00}, /* w */
    {0x00,0x00,0x11,0x0A,0x04,0x0A,0x11,0x00,0x00}, /* x */
    {0x00,0x00,0x11,0x11,0x11,0x11,0x0F,0x01,0x0E}, /* y */
    {0x00,0x00,0x1F,0x02,0x04,0x08,0x1F,0x00,0x00}, /* z */
    {0x02,0x04,0x04,0x08,0x04,0x04,0x02,0x00,0x00}, /* { */
    {0x04,0x04,0x04,0x04,0x04,0x04,0x04,0x00,0x00}, /* | */
    {0x08,0x04,0x04,0x02,0x04,0x04,0x08,0x00,0x00}, /* } */
    {0x00,0x00,0x08,0x15,0x02,0x00,0x00,0x00,0x00}, /* ~ */
};

/* matplotlib's "tab10": ten colours that are easy to tell apart. */
static const uint32_t mgpu__palette[10] = {0x1F77B4, 0xFF7F0E, 0x2CA02C, 0xD62728, 0x9467BD,
                                           0x8C564B, 0xE377C2, 0x7F7F7F, 0xBCBD22, 0x17BECF};
#define MGPU__INK 0x222222u  /* text, frames and ticks */
#define MGPU__GRID 0xE4E4E4u /* grid lines behind the data */
#define MGPU__WHITE 0xFFFFFFu

MGPU_DEF uint32_t mgpu_palette(int i) { return mgpu__palette[(i % 10 + 10) % 10]; }

MGPU_DEF mgpu_canvas *mgpu_canvas_new(int width, int height, uint32_t background_rgb)
{
    mgpu_canvas *c;
    if (width <= 0 || height <= 0) {
        fprintf(stderr, "mgpu: error: a canvas of %dx%d pixels cannot be made\n", width, height);
        exit(1);
    }
    c = (mgpu_canvas *)mgpu__plot_alloc(sizeof *c);
    c->width = width;
    c->height = height;
    c->rgb = (unsigned char *)mgpu__plot_alloc((size_t)width * (size_t)height * 3);
    mgpu_canvas_fill_rect(c, 0, 0, width, height, background_rgb);
    return c;
}

MGPU_DEF void mgpu_canvas_free(mgpu_canvas *c)
{
    if (!c) return;
    free(c->rgb);
    free(c);
}

static int mgpu__plot_clamp(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* Every other drawing operation ends up here, so this is where clipping to
   the canvas happens. */
MGPU_DEF void mgpu_canvas_fill_rect(mgpu_canvas *c, int x0, int y0, int x1, int y1, uint32_t rgb)
{
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
static void mgpu__plot_outline(mgpu_canvas *c, int x0, int y0, int x1, int y1, uint32_t rgb)
{
    mgpu_canvas_fill_rect(c, x0, y0, x1 + 1, y0 + 1, rgb);
    mgpu_canvas_fill_rect(c, x0, y1, x1 + 1, y1 + 1, rgb);
    mgpu_canvas_fill_rect(c, x0, y0, x0 + 1, y1 + 1, rgb);
    mgpu_canvas_fill_rect(c, x1, y0, x1 + 1, y1 + 1, rgb);
}

/* A box of pixel positions, edges included. */
typedef struct mgpu__plot_box { double x0, y0, x1, y1; } mgpu__plot_box;

/* Liang-Barsky clipping. The segment is p(t) = (x0,y0) + t*(dx,dy) for t in
   [0,1]; each side of the box keeps the t on its inner side, and [*t0, *t1]
   ends up as the part inside all four. Returns 0 when nothing is left. */
static int mgpu__plot_clip(mgpu__plot_box box, double x0, double y0, double x1, double y1,
                           double *t0, double *t1)
{
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
                               uint32_t rgb, int thickness)
{
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
static void mgpu__plot_stroke(mgpu_canvas *c, mgpu__plot_box clip, double x0, double y0,
                              double x1, double y1, uint32_t rgb, int thickness, double dash,
                              double *travel)
{
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
                             x0 + end / len * (x1 - x0), y0 + end / len * (y1 - y0), rgb, thickness);
        s = end;
    }
}

static const unsigned char *mgpu__plot_glyph(char ch)
{
    unsigned char code = (unsigned char)ch;
    return mgpu__font[(code < 32 || code > 126 ? '?' : code) - 32];
}

MGPU_DEF int mgpu_text_width(const char *text, int scale)
{
    int n = text ? (int)strlen(text) : 0;
    return n ? (n * MGPU__CELL_W - 1) * scale : 0; /* no blank column after the last glyph */
}

/* Text in a box whose top-left corner is (x, y); `vertical` turns it a
   quarter turn anticlockwise, to read from bottom to top (a y-axis label). */
static void mgpu__plot_text(mgpu_canvas *c, int x, int y, const char *text, uint32_t rgb,
                            int scale, int vertical)
{
    int length = mgpu_text_width(text, scale);
    if (scale < 1 || !text) return;
    for (int i = 0; text[i]; i++) {
        const unsigned char *glyph = mgpu__plot_glyph(text[i]);
        for (int row = 0; row < MGPU__GLYPH_H; row++)
            for (int col = 0; col < MGPU__GLYPH_W; col++) {
                /* (along, across): the font pixel's place along the text and across it */
                int along = (i * MGPU__CELL_W + col) * scale, across = row * scale;
                if (!(glyph[row] & (0x10 >> col))) continue;
                if (vertical)
                    mgpu_canvas_fill_rect(c, x + across, y + length - along - scale,
                                          x + across + scale, y + length - along, rgb);
                else
                    mgpu_canvas_fill_rect(c, x + along, y + across, x + along + scale,
                                          y + across + scale, rgb);
            }
    }
}

MGPU_DEF void mgpu_canvas_text(mgpu_canvas *c, int x, int y, const char *text, uint32_t rgb, int scale)
{
    mgpu__plot_text(c, x, y, text, rgb, scale, 0);
}

/* One line on stderr about a file that could not be written; returns -1 so
   that callers can `return mgpu__plot_write_failed(...)`. */
static int mgpu__plot_write_failed(const char *path, const char *what, const char *reason)
{
    fprintf(stderr, "mgpu: error: %s: cannot write %s (%s)\n", path, what, reason);
    return -1;
}

/* stb_image_write hands the encoded PNG over piece by piece. A failed fwrite
   is remembered by the FILE and seen by ferror() at the end. */
static void mgpu__plot_png_piece(void *file, void *data, int size)
{
    fwrite(data, 1, (size_t)size, (FILE *)file);
}

MGPU_DEF int mgpu_canvas_write_png(const mgpu_canvas *c, const char *path)
{
    /* The picture goes to "<path>.tmp", which is then renamed over `path`:
       a viewer that reloads the file (the Animator rewrites it after every
       point) sees the old picture or the new one, never half of one. */
    size_t length = strlen(path);
    char *tmp = (char *)mgpu__plot_alloc(length + 5);
    FILE *f;
    int failed, error;
    memcpy(tmp, path, length);
    memcpy(tmp + length, ".tmp", 5);
    errno = 0;
    f = fopen(tmp, "wb");
    if (!f) {
        error = errno;
        free(tmp);
        return mgpu__plot_write_failed(path, "PNG", strerror(error));
    }
    failed = !stbi_write_png_to_func(mgpu__plot_png_piece, f, c->width, c->height, 3, c->rgb,
                                     c->width * 3);
    failed |= ferror(f) != 0;
    failed |= fclose(f) != 0;
    failed = failed || rename(tmp, path) != 0;
    error = errno;
    if (failed) remove(tmp);
    free(tmp);
    if (failed) return mgpu__plot_write_failed(path, "PNG", error ? strerror(error) : "encoder failed");
    return 0;
}

/* ---- 2. the frame: axes, ticks and the data-to-pixel mapping ------------ */

/* An axis shows values lo..hi with a tick every `step`. */
typedef struct mgpu__plot_axis { double lo, hi, step; } mgpu__plot_axis;

/* 1, 2 or 5 times a power of ten, giving about `ticks` ticks over `span`:
   the steps people read easily. */
static double mgpu__plot_nice_step(double span, int ticks)
{
    double raw = span / ticks, magnitude = pow(10, floor(log10(raw))), ratio = raw / magnitude;
    return (ratio < 1.5 ? 1 : ratio < 3.5 ? 2 : ratio < 7.5 ? 5 : 10) * magnitude;
}

/* The axis for [lo, hi]: kept as it is when `fixed`; otherwise it comes from
   the data (lo > hi when there was none) and is widened to whole ticks. */
static mgpu__plot_axis mgpu__plot_axis_new(double lo, double hi, int fixed, int ticks)
{
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
static int mgpu__plot_tick(const mgpu__plot_axis *a, int i, double *value, char label[32])
{
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

static double mgpu__plot_px(const mgpu__plot_frame *f, double x)
{
    return f->x0 + (x - f->ax.lo) / (f->ax.hi - f->ax.lo) * (f->x1 - f->x0);
}

static double mgpu__plot_py(const mgpu__plot_frame *f, double y) /* pixel y grows downwards */
{
    return f->y1 - (y - f->ay.lo) / (f->ay.hi - f->ay.lo) * (f->y1 - f->y0);
}

static mgpu__plot_box mgpu__plot_area(const mgpu__plot_frame *f)
{
    mgpu__plot_box box;
    box.x0 = f->x0, box.y0 = f->y0, box.x1 = f->x1, box.y1 = f->y1;
    return box;
}

/* The widest tick label of an axis, to size the margin beside it. */
static int mgpu__plot_widest_tick(const mgpu__plot_axis *a, int scale)
{
    char label[32];
    double value;
    int widest = 0;
    for (int i = 0; mgpu__plot_tick(a, i, &value, label); i++)
        if (mgpu_text_width(label, scale) > widest) widest = mgpu_text_width(label, scale);
    return widest;
}

/* Grid lines, tick marks and numbers of the x axis (below the frame) or of
   the y axis (left of it). Drawn before the data, so the grid is behind it. */
static void mgpu__plot_ticks(const mgpu__plot_frame *f, int y_axis)
{
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

/* Title above the plot area, x label below the tick numbers, y label
   turned up the left edge of the picture; each centred on the plot area. */
static void mgpu__plot_labels(const mgpu__plot_frame *f, const char *title, const char *xlabel,
                              const char *ylabel)
{
    int s = f->scale, cx = (f->x0 + f->x1) / 2, cy = (f->y0 + f->y1) / 2;
    mgpu_canvas_text(f->c, cx - mgpu_text_width(title, s) / 2, 5 * s, title, MGPU__INK, s);
    mgpu_canvas_text(f->c, cx - mgpu_text_width(xlabel, s) / 2, f->y1 + 15 * s, xlabel, MGPU__INK, s);
    mgpu__plot_text(f->c, 4 * s, cy - mgpu_text_width(ylabel, s) / 2, ylabel, MGPU__INK, s, 1);
}

/* Sizes the margins around the plot area from what goes in them. */
static void mgpu__plot_layout(mgpu__plot_frame *f, int left_numbers, int bottom_lines,
                              const char *title, const char *ylabel)
{
    int s = f->scale, line = (MGPU__GLYPH_H + 3) * s;
    f->x0 = 4 * s + (ylabel && *ylabel ? line : 0) + left_numbers + 5 * s;
    f->y0 = (title && *title ? line + 6 * s : 4 * s) + MGPU__CAP_H * s / 2;
    f->x1 = f->c->width - 1 - 12 * s; /* room for half of the last x tick number */
    f->y1 = f->c->height - 1 - 6 * s - bottom_lines * line;
}
