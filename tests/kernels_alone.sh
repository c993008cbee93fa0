#!/usr/bin/env bash
# Each file of kernels/ builds on its own, right after mgpu.h's API and
# its core part (mgpu/core.h, the ground floor): no kernel file depends on
# the rest of the implementation, nor on the order mgpu.h includes them
# in. A file that uses another's definitions includes it. Checked for the
# CPU (gcc) and for the CUDA path on the emulated GPUs (g++ with
# tests/cuda_emu.h, on the files rewritten for it in build/emu/kernels/,
# which `make test` writes).
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# mgpu.h up to its core part's include, and the #endif of each
# conditional still open there (a test file holds these lines, the kernel
# file's #include and the #endifs)
core=$(grep -n '^#include "mgpu/core.h"' mgpu.h | head -n 1 | cut -d: -f1)
if [ -z "$core" ]; then
    echo "FAIL kernels_alone: mgpu.h does not include mgpu/core.h"
    echo "test-summary: 0 passed, 1 failed"
    exit 1
fi
head -n "$core" mgpu.h > "$work/core.h"
closers=$(awk '/^#if/ { d++ } /^#endif/ { d-- } END { for (i = 0; i < d; i++) print "#endif" }' "$work/core.h")
passed=0 failed=0
for kernel in kernels/*.h; do
    name=$(basename "$kernel" .h)
    for side in cpu emulated; do
        if [ $side = cpu ]; then
            { echo '#define MGPU_IMPLEMENTATION'; cat "$work/core.h"
              printf '#include "%s/%s"\n%s\n' "$PWD" "$kernel" "$closers"; } > "$work/$name.c"
            cmd=(${CC:-gcc} -std=c11 -Werror=implicit-function-declaration -D_GNU_SOURCE -fsyntax-only -I. "$work/$name.c")
        else
            { echo '#define MGPU_IMPLEMENTATION'; cat "$work/core.h"
              printf '#include "%s/build/emu/%s"\n%s\n' "$PWD" "$kernel" "$closers"; } > "$work/$name.cpp"
            cmd=(${CXX:-g++} -x c++ -std=c++20 -D_GNU_SOURCE -fsyntax-only
                 -include tests/cuda_emu.h -Itests -I. "$work/$name.cpp")
        fi
        if "${cmd[@]}" >"$work/$name.$side.log" 2>&1; then
            echo "ok   ${name}_alone_$side"; passed=$((passed + 1))
        else
            echo "FAIL ${name}_alone_$side"; head -n 5 "$work/$name.$side.log"; failed=$((failed + 1))
        fi
    done
done
echo "test-summary: $passed passed, $failed failed"
