#!/usr/bin/env bash
# tests/run.sh TEST...: runs each test, a program or a bash script (a name
# ending in .sh), TEST_JOBS of them at a time (default 1), shows each
# one's output whole and in the order given, with its seconds, and adds
# up the "test-summary: P passed, F failed" lines they print. A program
# that dies before printing its summary counts as one failure. The last
# line is the total:
#     N passed, N failed
# and the exit status is non-zero when anything failed.
jobs_max=${TEST_JOBS:-1}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
names=()
passed=0
failed=0

# Adds up test i's result, once it has finished (its .status written
# after its .log is complete).
report() {
    local i=$1 name=${names[$1]}
    echo "== $name ($(cat "$logs/$1.seconds") s)"
    cat "$logs/$i.log"
    local status summary p f
    status=$(cat "$logs/$i.status")
    summary=$(grep -E '^test-summary: [0-9]+ passed, [0-9]+ failed' "$logs/$i.log" | tail -n 1)
    if [ -z "$summary" ]; then
        echo "FAIL $name (exit status $status, no summary)"
        failed=$((failed + 1))
        return
    fi
    p=$(echo "$summary" | sed -E 's/^test-summary: ([0-9]+) passed.*/\1/')
    f=$(echo "$summary" | sed -E 's/.* ([0-9]+) failed.*/\1/')
    passed=$((passed + p))
    failed=$((failed + f))
    if [ "$status" -ne 0 ] && [ "$f" -eq 0 ]; then
        echo "FAIL $name (exit status $status)"
        failed=$((failed + 1))
    fi
}
# Reports the finished tests that every test before them has been reported.
next=0
report_finished() {
    while [ "$next" -lt "${#names[@]}" ] && [ -f "$logs/$next.status" ]; do
        report "$next"
        next=$((next + 1))
    done
}

for arg in "$@"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do
        wait -n
        report_finished
    done
    i=${#names[@]}
    names+=("$arg")
    if [ "${arg%.sh}" != "$arg" ]; then command=(bash "$arg"); else command=("$arg"); fi
    # (the status by a rename, so that it is never seen half written)
    (start=$SECONDS; "${command[@]}" > "$logs/$i.log" 2>&1; echo $? > "$logs/$i.part"
     echo $((SECONDS - start)) > "$logs/$i.seconds"; mv "$logs/$i.part" "$logs/$i.status") &
done
wait
report_finished
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
