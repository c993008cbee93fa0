# bench/lib.sh: helpers shared by the benchmark scripts (sourced by
# bench/run.sh, bench/ddp.sh, bench/gpu_check.sh and bench/gpu_session.sh).
#
# defines: step, value, result, calc, or_dash, median, run_line, run_secs, run_acc, run_on,
#          epoch_secs, libraries_found, use_carried_libraries
#
# value and result read the log $LOGS/NAME.log, so the caller sets LOGS.

# step NAME COMMAND...: runs COMMAND with its output in $LOGS/NAME.log (for
# at most STEP_TIMEOUT seconds when that is set) and says how long it took;
# a failure shows the end of the log and the caller goes on (that run's
# figures are then missing).
step() {
    local name=$1; shift
    local t0=$SECONDS
    printf -- '-- %-24s %s\n' "$name" "$*"
    timeout "${STEP_TIMEOUT:-0}" "$@" >"$LOGS/$name.log" 2>&1
    local status=$?
    if [ $status -ne 0 ]; then
        echo "   FAILED (exit status $status); the end of $LOGS/$name.log:"
        tail -n 5 "$LOGS/$name.log" | sed 's/^/   | /'
    else
        echo "   done in $((SECONDS - t0)) s"
    fi
}

# value NAME SED_EXPRESSION: the first thing the expression prints from the log.
value() { sed -n "$2" "$LOGS/$1.log" 2>/dev/null | head -n 1; }

# result NAME KEY [MATCH]: KEY=... from the first "RESULT" line (containing
# MATCH) of the log.
result() {
    grep "^RESULT.*${3:-}" "$LOGS/$1.log" 2>/dev/null | head -n 1 |
        sed -n "s/.* $2=\([^ ]*\).*/\1/p"
}

# calc FORMAT EXPRESSION: awk arithmetic; "-" when a number is missing
# (the expression no longer parses) or a division by zero (inf).
calc() {
    awk "BEGIN { x = $2; if (x - x != 0) print \"-\"; else printf \"$1\", x }" 2>/dev/null || echo "-"
}

or_dash() { echo "${1:--}"; }

# median NUMBER...: the median of the numbers (anything else is left out)
median() {
    printf '%s\n' "$@" | grep -E '^[0-9]+([.][0-9]*)?$' | sort -g |
        awk '{ v[NR] = $1 } END { if (NR) print NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

# A chapter's line for its run N (1, 2, ...) in the log NAME:
#     test acc: 0.84, 2.2 sec/epoch, [1234 images/sec, ]on [cuda:0] ...
# and its seconds per epoch, its test accuracy and its devices.
run_line() { grep '^test acc: .* sec/epoch, .*on \[' "$LOGS/$1.log" 2>/dev/null | sed -n "$2p"; }
run_secs() { run_line "$@" | sed -n 's/.*, \([0-9.]*\) sec\/epoch.*/\1/p'; }
run_acc() { run_line "$@" | sed -n 's/^test acc: \([0-9.]*\),.*/\1/p'; }
run_on() { run_line "$@" | sed -n 's/.* on \(\[[^]]*\]\).*/\1/p'; }
# epoch_secs NAME [N]: the seconds of epoch N (default the last) from the
# log's per-epoch lines, "  epoch 2/10: loss ..., 5.312 sec"
epoch_secs() {
    sed -n 's/^  epoch \([0-9]*\)\/[0-9]*: .*, \([0-9.]*\) sec$/\1 \2/p' "$LOGS/$1.log" 2>/dev/null |
        awk -v n="${2:-}" 'n == "" || $1 == n { s = $2 } END { print s }'
}

# use_carried_libraries: on a machine that lacks OpenBLAS, stb or zlib and
# has no package registry (the GPU machines), unpack the Debian packages
# carried in .deps/debs (bench/gpu_check.sh --prepare downloads them)
# under .deps/root and export CPATH, LIBRARY_PATH and LD_LIBRARY_PATH so
# that make and the programs it builds find them. Does nothing where the
# libraries are found (the Makefile looks for them the same way, by
# compiling a tiny program). Returns non-zero when they are still missing.
libraries_found() {
    printf '#include <cblas.h>\n#include <stb/stb_image_write.h>\n#include <zlib.h>\nint main(void) { return 0; }\n' |
        ${CC:-gcc} -x c - -o /dev/null -lopenblas -lstb -lz >/dev/null 2>&1
}
use_carried_libraries() {
    libraries_found && return 0
    if ! ls .deps/debs/*.deb >/dev/null 2>&1; then
        echo "libraries: OpenBLAS, stb or zlib missing, and no .deps/debs (bench/gpu_check.sh --prepare)" >&2
        return 1
    fi
    local root=$PWD/.deps/root deb
    for deb in .deps/debs/*.deb; do dpkg -x "$deb" "$root" || return 1; done
    # zlib1g-dev's libz.so points at /lib/...; point it at the unpacked runtime
    ln -sf ../../../lib/x86_64-linux-gnu/libz.so.1 "$root/usr/lib/x86_64-linux-gnu/libz.so"
    local lib=$root/usr/lib/x86_64-linux-gnu
    export CPATH=$root/usr/include:$root/usr/include/x86_64-linux-gnu/openblas-pthread${CPATH:+:$CPATH}
    export LIBRARY_PATH=$lib:$lib/openblas-pthread:$root/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}
    export LD_LIBRARY_PATH=$LIBRARY_PATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    echo "libraries: from the carried Debian packages under $root"
    libraries_found
}
