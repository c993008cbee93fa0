/* ---------------------------------------------------------------------------
   Plots: PNG pictures of curves and device timelines
   ---------------------------------------------------------------------------
   The chapters show what happened as pictures: accuracy and loss curves
   while a model trains, and a timeline of what every device did and when.
   Everything is drawn by a small rasteriser in this file into an RGB pixel
   buffer (a canvas) with a built-in 5x7 bitmap font, and saved as a PNG
   through stb_image_write. No plotting library, no fonts on the system.

   Colours are 0xRRGGBB integers. Coordinates are pixels: x grows to the
   right, y grows downwards, (0, 0) is the top-left pixel. Everything drawn
   is clipped to the canvas, so drawing partly (or wholly) outside is safe.

   Canvas: the building blocks.
       mgpu_canvas *c = mgpu_canvas_new(200, 100, 0xFFFFFF);
       mgpu_canvas_fill_rect(c, 10, 10, 50, 30, 0x1F77B4); // x in [10,50), y in [10,30)
       mgpu_canvas_line(c, 0, 99, 199, 0, 0xD62728, 2);    // 2 pixels thick
       mgpu_canvas_text(c, 60, 10, "loss: 0.25", 0x000000, 2); // twice the font size
       if (mgpu_canvas_write_png(c, "out/pic.png") != 0) { ... }
       mgpu_canvas_free(c);
   The font has every printable ASCII character (32..126). A character is a
   5x7 pixel glyph (descenders of g, j, p, q, y and _ go 2 rows lower) in a
   6-pixel-wide cell; `scale` multiplies every font pixel, so a string is
   mgpu_text_width(s, scale) pixels wide and 9*scale pixels tall.

   Line charts: fill an mgpu_chart with one mgpu_series per curve.
       mgpu_series s[2];  mgpu_chart ch;
       memset(s, 0, sizeof s);  memset(&ch, 0, sizeof ch);
       s[0].name = "train loss"; s[0].n = n; s[0].x = epochs; s[0].y = loss;
       s[1].name = "test acc";   s[1].n = n; s[1].x = epochs; s[1].y = acc;
       s[1].dashed = 1;
       ch.title = "LeNet"; ch.xlabel = "epoch"; ch.nseries = 2; ch.series = s;
       mgpu_chart_write_png(&ch, "out/lenet.png");
   Zeroed fields take defaults: a 640x480 picture, the x and y ranges taken
   from the data and widened to "nice" tick values (steps of 1, 2 or 5 times
   a power of ten), and colour 0 gives series i colour i of the palette
   (matplotlib's "tab10"; mgpu_palette(i) gives them). Points whose x or y
   is NaN are skipped: the curve goes straight from the point before to the
   point after. A legend lists the named series in the corner of the plot
   where it hides the least of the curves.

   Animator (the book's d2l.Animator): a chart that fills in during
   training. Every mgpu_animator_add appends one x and one y per series and
   rewrites both the PNG and a CSV beside it ("curves.png" -> "curves.csv",
   header "x,name1,name2,...", an empty field for NaN), so opening the PNG
   in a viewer that reloads shows the training progress, and the CSV keeps
   the numbers. Pass NaN for a series that has no value at this x (the
   book adds the test accuracy once per epoch, the training loss more
   often). Each add encodes a PNG (a few milliseconds): add a few points
   per epoch, not one per batch. A NULL png_path keeps the points in memory
   and writes nothing.
       const char *names[] = {"train loss", "train acc", "test acc"};
       mgpu_animator *a = mgpu_animator_new("out/ch2.png", "2 devices",
                              "epoch", NULL, 1, 10, 3, names);
       ... mgpu_animator_add(a, epoch + 1.0, ys);
       printf("test acc: %.2f\n", mgpu_animator_last(a, 2));
   mgpu_animator_write_combined puts one series (say the test accuracy) of
   several animators (say the runs on 1, 2 and 4 devices) in one chart.

   Timelines: one horizontal lane per device queue, one bar per operation
   from its start to its end time in milliseconds, so work that overlaps in
   time on different lanes (parallelism) is seen at a glance. The picture
   is 1000 pixels wide and as tall as its lanes and legend need; a bar on
   no lane, or that ends before it starts, is left out. Bars with the
   same name get the same colour (a hash of the name picks it, and names in
   one picture never share a colour while the palette lasts); a name is
   written inside its bar where it fits, and a legend maps names to colours.
   Give operations of the same kind the same name ("matmul", "copy to
   host") rather than numbering them.

   Errors: a picture or CSV that cannot be written prints one line
       mgpu: error: out/pic.png: cannot write PNG (No such file or directory)
   to stderr and the function returns non-zero; the program goes on (an
   Animator says it once and then only keeps its points). PNGs are written
   to "<path>.tmp" and renamed, so a viewer never sees half a file. Out of
   memory, a canvas of no pixels or a series an animator does not have are
   bugs, and fatal (mgpu_fatal). */

typedef struct mgpu_canvas {
    int width, height;
    unsigned char *rgb; /* width*height*3 bytes, row by row from the top */
} mgpu_canvas;

/* A canvas filled with the background colour. */
MGPU_DEF mgpu_canvas *mgpu_canvas_new(int width, int height, uint32_t background_rgb);
MGPU_DEF void mgpu_canvas_free(mgpu_canvas *c);
/* Pixels x0 <= x < x1, y0 <= y < y1. */
MGPU_DEF void mgpu_canvas_fill_rect(mgpu_canvas *c, int x0, int y0, int x1, int y1, uint32_t rgb);
/* A straight line between two pixel positions, `thickness` pixels wide. */
MGPU_DEF void mgpu_canvas_line(mgpu_canvas *c, double x0, double y0, double x1, double y1,
                               uint32_t rgb, int thickness);
/* Text whose top-left corner is (x, y). */
MGPU_DEF void mgpu_canvas_text(mgpu_canvas *c, int x, int y, const char *text, uint32_t rgb,
                               int scale);
MGPU_DEF int mgpu_text_width(const char *text, int scale);
/* 0 on success; non-zero (after a one-line error) when it cannot be written. */
MGPU_DEF int mgpu_canvas_write_png(const mgpu_canvas *c, const char *path);
/* Colour i (any i >= 0, it wraps) of the 10-colour palette charts use. */
MGPU_DEF uint32_t mgpu_palette(int i);

/* ---- line charts ---- */
typedef struct mgpu_series {
    const char *name; /* in the legend; NULL leaves the series out of it */
    uint32_t color;   /* 0xRRGGBB; 0 picks palette colour i for series i */
    int n;            /* number of points */
    const double *x, *y;
    int dashed; /* non-zero draws a dashed line */
} mgpu_series;

typedef struct mgpu_chart {
    const char *title, *xlabel, *ylabel; /* any may be NULL */
    double xmin, xmax, ymin, ymax;       /* a range with min >= max is taken from the data */
    int width, height;                   /* 0 means 640 and 480 */
    int nseries;
    const mgpu_series *series;
} mgpu_chart;

MGPU_DEF int mgpu_chart_write_png(const mgpu_chart *chart, const char *path);

/* ---- the Animator ---- */
typedef struct mgpu_animator mgpu_animator;

/* xmin >= xmax takes the x range from the data; the y range always is.
   ylabel and title may be NULL. The strings are copied. */
MGPU_DEF mgpu_animator *mgpu_animator_new(const char *png_path, const char *title,
                                          const char *xlabel, const char *ylabel, double xmin,
                                          double xmax, int nseries, const char *const *names);
/* ys holds nseries values (NaN: no value for that series at this x). */
MGPU_DEF void mgpu_animator_add(mgpu_animator *a, double x, const double *ys);
MGPU_DEF int mgpu_animator_count(const mgpu_animator *a); /* points added so far */
/* The last value of a series that was not NaN; NaN when there is none. */
MGPU_DEF double mgpu_animator_last(const mgpu_animator *a, int series);
MGPU_DEF void mgpu_animator_free(mgpu_animator *a);
/* Series `series` of every animator as one curve each, labelled labels[i]
   (labels NULL: each animator's title). The x range and x label are the
   first animator's; so is the y label, or else the series' name. */
MGPU_DEF int mgpu_animator_write_combined(const char *png_path, const char *title, int nanimators,
                                          const mgpu_animator *const *animators, int series,
                                          const char *const *labels);

/* ---- device timelines ---- */
typedef struct mgpu_timeline_bar {
    int lane; /* 0 .. nlanes-1 */
    double start_ms, end_ms;
    char name[32]; /* NUL-terminated; bars with equal names share a colour */
} mgpu_timeline_bar;

MGPU_DEF int mgpu_timeline_write_png(const char *path, const char *title, int nlanes,
                                     const char *const *lane_names, int nbars,
                                     const mgpu_timeline_bar *bars);
