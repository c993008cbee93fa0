#!/usr/bin/env bash
# tests/assignments.sh: the assignments' checkers (docs/assignments.md)
# judge the library's reference solutions (tests/assignments/solutions/)
# as passing and a broken solution of each (tests/assignments/broken/),
# with a mistake students make, as failing.
cd "$(dirname "$0")/.."
passed=0 failed=0
for solution in tests/assignments/solutions/*.c; do
    name=$(basename "$solution" .c)
    for kind in solutions broken; do
        log=$(mktemp)
        make -s check-assignment NAME="$name" FILE="tests/assignments/$kind/$name.c" >"$log" 2>&1
        status=$?
        if { [ $kind = solutions ] && [ $status = 0 ]; } || { [ $kind = broken ] && [ $status != 0 ] &&
             grep -q '^FAIL ' "$log"; }; then
            echo "ok   $name: the $kind one $([ $kind = solutions ] && echo passes || echo fails)"
            passed=$((passed + 1))
        else
            echo "FAIL $name: the $kind one (exit status $status):"
            sed 's/^/    /' "$log"
            failed=$((failed + 1))
        fi
        rm -f "$log"
    done
done
echo "test-summary: $passed passed, $failed failed"
[ "$failed" = 0 ]
