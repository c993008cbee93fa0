/* parts/plot_standalone.h: the plot section of mgpu.h on its own.

   It let tests/test_plot.c build before the rest of mgpu.h existed, and
   still lets the section be tried in isolation: it includes what mgpu.h
   includes ahead of the section, stands in for what the section takes from
   mgpu.h's core (MGPU_DEF, mgpu_fatal with MGPU_REQUIRE, mgpu__xmalloc and
   mgpu__xcalloc), and pastes the declarations and the definitions into the
   one translation unit that includes it. A test that includes mgpu.h with
   MGPU_IMPLEMENTATION defined gets the same section from there. */
#ifndef MGPU_PLOT_STANDALONE_H
#define MGPU_PLOT_STANDALONE_H
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MGPU_DEF extern

/* As in mgpu.h: one line "mgpu: error: <message>", then exit status 1. */
static void mgpu_fatal(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fflush(stdout);
    fprintf(stderr, "mgpu: error: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    _exit(1);
}
#define MGPU_REQUIRE(cond, ...)                                                                    \
    do {                                                                                           \
        if (!(cond)) mgpu_fatal(__VA_ARGS__);                                                      \
    } while (0)
static void *mgpu__xmalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) mgpu_fatal("out of host memory (asked for %zu bytes)", bytes);
    return p;
}
static void *mgpu__xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) mgpu_fatal("out of host memory (asked for %zu x %zu bytes)", n, size);
    return p;
}

#include "plot_decl.h"
#include "plot_impl.h"
#endif
