#!/usr/bin/env bash
# tests/run.sh BIN... [-- SCRIPT...]: runs each test program (and each
# script after --), shows its output, and adds up the "test-summary: P
# passed, F failed" lines they print. A program that dies before printing
# its summary counts as one failure. The last line is the total:
#     N passed, N failed
# and the exit status is non-zero when anything failed.
passed=0
failed=0
run_one() {
    local name=$1; shift
    echo "== $name"
    local log
    log=$(mktemp)
    "$@" 2>&1 | tee "$log"
    local status=${PIPESTATUS[0]}
    local summary
    summary=$(grep -E '^test-summary: [0-9]+ passed, [0-9]+ failed' "$log" | tail -n 1)
    rm -f "$log"
    if [ -z "$summary" ]; then
        echo "FAIL $name (exit status $status, no summary)"
        failed=$((failed + 1))
        return
    fi
    local p f
    p=$(echo "$summary" | sed -E 's/^test-summary: ([0-9]+) passed.*/\1/')
    f=$(echo "$summary" | sed -E 's/.* ([0-9]+) failed.*/\1/')
    passed=$((passed + p))
    failed=$((failed + f))
    if [ "$status" -ne 0 ] && [ "$f" -eq 0 ]; then
        echo "FAIL $name (exit status $status)"
        failed=$((failed + 1))
    fi
}
scripts=0
for arg in "$@"; do
    if [ "$arg" = "--" ]; then scripts=1; continue; fi
    if [ $scripts = 1 ]; then run_one "$arg" bash "$arg"; else run_one "$arg" "$arg"; fi
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
