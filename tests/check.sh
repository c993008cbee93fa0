# tests/check.sh: what the test scripts (tests/smoke.sh, tests/dist.sh)
# share; sourced. Each counts its passes and failures, keeps its logs in
# $out (removed at exit), and ends with `summary`, which prints
# "test-summary: P passed, F failed" like the C test programs.
passed=0
failed=0
# The chapters under test: those make builds in the checkout, or
# CHAPTER_DIR's (make test's CPU builds, where nvcc builds the checkout's).
chapters=${CHAPTER_DIR:-.}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# Open MPI refuses root unless told, and more ranks than cores unless told.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1

# check NAME STATUS PATTERN... -- COMMAND...: runs COMMAND, and passes when
# its exit status is STATUS and its output (stdout and stderr) matches every
# extended-regex PATTERN. STATUS "dies": any status but 0, by the job
# itself: a distributed job that must end, not hang. The patterns say what
# ended it (the watcher's line, say); the guard of 120 s only tells a hang
# from an end, so a slow or busy machine does not fail it. TEST_TIMES=1
# adds each command's seconds to its line.
check() {
    local name=$1 want=$2; shift 2
    local patterns=()
    while [ "$1" != "--" ]; do patterns+=("$1"); shift; done
    shift
    local log="$out/$name.log" guard=600 start=$SECONDS
    [ "$want" = dies ] && guard=120
    timeout $guard "$@" >"$log" 2>&1
    local status=$? ok=1 took=""
    [ "${TEST_TIMES:-}" = 1 ] && took=" ($((SECONDS - start)) s)"
    if [ "$status" -eq 124 ]; then
        ok=0; echo "  $name: still running after $guard s (a hang): stopped"
    elif [ "$want" = dies ]; then
        [ "$status" -ne 0 ] || { ok=0; echo "  $name: exit status 0, want non-zero"; }
    else
        [ "$status" -eq "$want" ] || { ok=0; echo "  $name: exit status $status, want $want"; }
    fi
    for p in "${patterns[@]}"; do
        grep -Eq -- "$p" "$log" || { ok=0; echo "  $name: output lacks /$p/"; }
    done
    if [ $ok = 1 ]; then
        echo "ok   $name$took"; passed=$((passed + 1))
    else
        echo "FAIL $name$took"; sed 's/^/    | /' "$log" | tail -n 20; failed=$((failed + 1))
    fi
}

# lacks NAME PATTERN: passes when the log of check NAME has no line
# matching PATTERN.
lacks() {
    if grep -Eq -- "$2" "$out/$1.log"; then
        echo "FAIL $1_lacks /$2/"; failed=$((failed + 1))
    else
        echo "ok   $1_lacks /$2/"; passed=$((passed + 1))
    fi
}

# count NAME N PATTERN: passes when the log of check NAME has exactly N
# lines matching PATTERN (one error line for a job, not one a rank).
count() {
    local n
    n=$(grep -Ec -- "$3" "$out/$1.log")
    if [ "$n" = "$2" ]; then
        echo "ok   $1_has_$2_of /$3/"; passed=$((passed + 1))
    else
        echo "FAIL $1_has_$2_of /$3/: $n lines"; failed=$((failed + 1))
    fi
}

# The file must be a PNG with a non-trivial size.
png_ok() { [ -s "$1" ] && [ "$(head -c 4 "$1" | tail -c 3)" = "PNG" ]; }

summary() {
    echo "test-summary: $passed passed, $failed failed"
    [ "$failed" -eq 0 ]
}
