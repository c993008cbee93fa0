#!/usr/bin/env bash
# tests/assignments.sh: the assignments' checkers (docs/assignments.md)
# judge the library's reference solutions (tests/assignments/solutions/)
# as passing and the broken solutions of each (tests/assignments/broken/
# NAME.c, and NAME-WHAT.c where there are more), each with a mistake
# students make, as failing.
cd "$(dirname "$0")/.."
shopt -s nullglob # (no NAME-WHAT.c: none)
passed=0 failed=0
for solution in tests/assignments/solutions/*.c; do
    name=$(basename "$solution" .c)
    for file in "$solution" tests/assignments/broken/"$name".c tests/assignments/broken/"$name"-*.c; do
        kind=$(basename "$(dirname "$file")")
        one="the $kind one"
        [ "$(basename "$file")" = "$name.c" ] || one="$one $(basename "$file")"
        log=$(mktemp)
        make -s check-assignment NAME="$name" FILE="$file" >"$log" 2>&1
        status=$?
        if { [ $kind = solutions ] && [ $status = 0 ]; } || { [ $kind = broken ] && [ $status != 0 ] &&
             grep -q '^FAIL ' "$log"; }; then
            echo "ok   $name: $one $([ $kind = solutions ] && echo passes || echo fails)"
            passed=$((passed + 1))
        else
            echo "FAIL $name: $one (exit status $status):"
            sed 's/^/    /' "$log"
            failed=$((failed + 1))
        fi
        rm -f "$log"
    done
done
echo "test-summary: $passed passed, $failed failed"
[ "$failed" = 0 ]
