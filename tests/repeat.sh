#!/usr/bin/env bash
# tests/repeat.sh: the same command prints the same numbers twice. Chapters
# 2 and 3, and chapter 4 under mpirun -np 2, each run twice on small
# settings; every loss, accuracy and parameters' hash they print must be
# the same in both runs (times may differ). A course grades against these.
cd "$(dirname "$0")/.."
. tests/check.sh
export MGPU_DATA=${MGPU_DATA:-data/fashion-mnist}

# The figures of a run's output that must repeat, one a line, in order.
figures() {
    grep -oE "(loss|acc|Loss|Accuracy|hash)[:]? [0-9a-f.]+%?" "$out/$1.log"
}

# twice NAME COMMAND...: runs COMMAND twice; passes when both runs end
# well and print the same figures (and at least one).
twice() {
    local name=$1; shift
    check ${name}_first 0 'test acc' -- "$@"
    check ${name}_second 0 'test acc' -- "$@"
    local a b
    a=$(figures ${name}_first)
    b=$(figures ${name}_second)
    if [ -n "$a" ] && [ "$a" = "$b" ]; then
        echo "ok   ${name}_repeats ($(echo "$a" | wc -l) figures)"; passed=$((passed + 1))
    else
        echo "FAIL ${name}_repeats:"; diff <(echo "$a") <(echo "$b") | head -n 10; failed=$((failed + 1))
    fi
}

twice chapter2 $chapters/chapter2 --cpu --train-samples 1024 --epochs 2 --out "$out/ch2"
twice chapter3 $chapters/chapter3 --cpu --devices 2 --train-samples 64 --test-samples 64 --epochs 1 \
    --batch-size 16 --out "$out/ch3"
if command -v mpirun >/dev/null; then
    twice chapter4 mpirun -np 2 $chapters/chapter4 --cpu --train-samples 1024 --test-samples 256 --epochs 2 \
        --out "$out/ch4"
    # (each run's own hash: the two runs print one each, and 1 and 2
    # processes differ in the order of their sums)
    count chapter4_first 2 "parameters' hash [0-9a-f]{16}"
fi
summary
