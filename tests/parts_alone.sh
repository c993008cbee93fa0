#!/usr/bin/env bash
# Each part of mgpu.h's implementation (mgpu/*.h, in the order mgpu.h
# includes them) stands on the parts before it: a program that includes
# mgpu.h with its list of parts cut after part k compiles, and the object
# it makes needs no function of the library from elsewhere. A call into a
# later part, or a forward declaration standing in for one, fails here:
# a static function of a later part is undeclared (or declared and never
# defined), a public one is left undefined in the object. Checked for the
# CPU build, with the flags the Makefile passes (PARTS_CFLAGS: MPI,
# oneDNN, OpenMP where built in).
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mapfile -t parts < <(sed -n 's/^#include "\(mgpu\/[a-z_]*\.h\)".*/\1/p' mgpu.h)
passed=0 failed=0
if [ "${#parts[@]}" -lt 2 ]; then
    echo "FAIL parts_alone: mgpu.h includes no parts from mgpu/"
    echo "test-summary: 0 passed, 1 failed"
    exit 1
fi
# Every file in mgpu/ is one of mgpu.h's parts.
for file in mgpu/*.h; do
    if ! printf '%s\n' "${parts[@]}" | grep -qx "$file"; then
        echo "FAIL parts_alone: $file is not included by mgpu.h"; failed=$((failed + 1))
    fi
done
for k in "${!parts[@]}"; do
    name=$(basename "${parts[$k]}" .h)
    # mgpu.h with the parts after k left out
    awk -v keep=$((k + 1)) '/^#include "mgpu\// { if (++n > keep) next } { print }' mgpu.h > "$work/mgpu.h"
    printf '#define MGPU_IMPLEMENTATION\n#include "mgpu.h"\n' > "$work/$name.c"
    cp -r kernels "$work/" 2>/dev/null; ln -sfn "$PWD/mgpu" "$work/mgpu"
    if ! ${CC:-gcc} -std=c11 -D_GNU_SOURCE ${PARTS_CFLAGS:-} -Werror -Wno-unused-function -w \
            -Werror=implicit-function-declaration -c -I"$work" -I. "$work/$name.c" -o "$work/$name.o" \
            >"$work/$name.log" 2>&1; then
        echo "FAIL ${name}_alone: does not compile with only the parts before it"
        grep -m 5 -E 'error|warning' "$work/$name.log"
        failed=$((failed + 1))
        continue
    fi
    # (gcc warns, and -Werror stops, where a static function is declared
    # and used but defined in no part so far)
    later=$(nm -u "$work/$name.o" | awk '{ print $2 }' | grep -E '^mgpu_' | sort -u | tr '\n' ' ')
    if [ -n "$later" ]; then
        echo "FAIL ${name}_alone: uses what later parts define: $later"
        failed=$((failed + 1))
    else
        echo "ok   ${name}_alone"
        passed=$((passed + 1))
    fi
done
echo "test-summary: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
