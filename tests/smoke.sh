#!/usr/bin/env bash
# tests/smoke.sh: runs the chapters the way a student does, on small
# settings, and checks what they print and write; also bad flags.
# Prints "test-summary: P passed, F failed" like the C test programs.
cd "$(dirname "$0")/.."
passed=0
failed=0
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# check NAME EXPECTED_STATUS PATTERN... -- COMMAND...: runs COMMAND, and
# passes when its exit status is EXPECTED_STATUS and its output (stdout and
# stderr) matches every extended-regex PATTERN.
check() {
    local name=$1 want=$2; shift 2
    local patterns=()
    while [ "$1" != "--" ]; do patterns+=("$1"); shift; done
    shift
    local log="$out/$name.log"
    timeout 600 "$@" >"$log" 2>&1
    local status=$?
    local ok=1
    [ "$status" -eq "$want" ] || { ok=0; echo "  $name: exit status $status, want $want"; }
    for p in "${patterns[@]}"; do
        grep -Eq -- "$p" "$log" || { ok=0; echo "  $name: output lacks /$p/"; }
    done
    if [ $ok = 1 ]; then
        echo "ok   $name"; passed=$((passed + 1))
    else
        echo "FAIL $name"; sed 's/^/    | /' "$log" | tail -n 20; failed=$((failed + 1))
    fi
}

# The second image must be a PNG with a non-trivial size.
png_ok() { [ -s "$1" ] && [ "$(head -c 4 "$1" | tail -c 3)" = "PNG" ]; }

check chapter1_runs 0 \
    '^dev1 \(cpu\) time: [0-9]+\.[0-9]{4} sec$' '^dev2 \(cpu#1\) time: ' '^dev1 & dev2: ' \
    '^run on dev1 \(cpu\): ' '^copy to host: ' '^run on dev1 \(cpu\) and copy to host: ' \
    'timeline: ' -- ./chapter1 --cpu --size 300 --reps 10 --out "$out/ch1"
if png_ok "$out/ch1/chapter1_timeline.png"; then echo "ok   chapter1_timeline_png"; passed=$((passed + 1));
else echo "FAIL chapter1_timeline_png"; failed=$((failed + 1)); fi
check chapter1_help 0 '--devices' '--size' -- ./chapter1 --help
check chapter1_unknown_flag 1 "^mgpu: error: unknown flag '--bogus' \(try --help\)$" -- ./chapter1 --bogus
check chapter1_bad_number 1 "^mgpu: error: --size: expected a positive whole number, got 'ten'$" -- ./chapter1 --size ten
check chapter1_missing_value 1 "^mgpu: error: --reps needs a value" -- ./chapter1 --reps

for extra in tests/smoke_*.sh; do
    [ -e "$extra" ] && . "$extra"
done

echo "test-summary: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
