#!/usr/bin/env bash
# tests/dist.sh: the process group and the distributed wrapper under
# mpirun (tests/dist_tests.c) with 1 to 4 ranks, then the faults: each job
# must end within 30 s, non-zero, with the lines that say what happened.
# Prints "test-summary: P passed, F failed" like the C test programs.
cd "$(dirname "$0")/.."
passed=0
failed=0
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
tests=build/tests/dist_tests
# Open MPI refuses root unless told, and more ranks than cores unless told.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# the same convolution on every run (the trial's choice may differ by timing)
export MGPU_CONV=im2col

if ! command -v mpirun >/dev/null; then
    echo "skipped: no mpirun (apt-get install openmpi-bin libopenmpi-dev)"
    echo "test-summary: 0 passed, 0 failed"
    exit 0
fi

# The tests alone (a group of one), then under mpirun: their own summaries.
for ranks in 1 2 3 4; do
    log="$out/ranks$ranks.log"
    if [ "$ranks" = 1 ]; then timeout 300 $tests >"$log" 2>&1; else timeout 300 mpirun -np $ranks $tests >"$log" 2>&1; fi
    status=$?
    cat "$log"
    summary=$(grep -E '^test-summary: ' "$log" | tail -n 1)
    if [ -z "$summary" ] || [ $status -ne 0 ]; then
        echo "FAIL dist_tests on $ranks ranks (exit status $status)"
        failed=$((failed + 1))
        continue
    fi
    passed=$((passed + $(echo "$summary" | sed -E 's/^test-summary: ([0-9]+) passed.*/\1/')))
    failed=$((failed + $(echo "$summary" | sed -E 's/.* ([0-9]+) failed.*/\1/')))
done

# fault NAME RANKS PATTERN... -- COMMAND...: the job must end within 30 s
# with a non-zero status, and its output match every PATTERN.
fault() {
    local name=$1 ranks=$2; shift 2
    local patterns=()
    while [ "$1" != "--" ]; do patterns+=("$1"); shift; done
    shift
    local log="$out/$name.log" start=$SECONDS
    timeout 60 mpirun -np "$ranks" "$@" >"$log" 2>&1
    local status=$? took=$((SECONDS - start)) ok=1
    [ "$status" -ne 0 ] || { ok=0; echo "  $name: exit status 0"; }
    [ "$status" -ne 124 ] && [ "$took" -le 30 ] || { ok=0; echo "  $name: took $took s"; }
    for p in "${patterns[@]}"; do
        grep -Eq -- "$p" "$log" || { ok=0; echo "  $name: output lacks /$p/"; }
    done
    if [ $ok = 1 ]; then
        echo "ok   $name ($took s)"; passed=$((passed + 1))
    else
        echo "FAIL $name"; sed 's/^/    | /' "$log" | tail -n 20; failed=$((failed + 1))
    fi
}
fault out_of_step 3 \
    '^mgpu: error: rank 0: the ranks are out of step: rank 0 called allreduce #2 of 1000 floats, rank 1 called broadcast #2 of 1000 floats from rank 0' \
    -- $tests --fault out-of-step
# (one line of the error, not one a rank)
if [ "$(grep -c 'out of step' "$out/out_of_step.log")" = 1 ]; then
    echo "ok   out_of_step_one_line"; passed=$((passed + 1))
else
    echo "FAIL out_of_step_one_line"; failed=$((failed + 1))
fi
fault extra_collective 2 \
    '^mgpu: error: rank 0: allreduce #2 of 1000 floats: waited 3 s for the other ranks \(MGPU_DIST_TIMEOUT\)' \
    -- env MGPU_DIST_TIMEOUT=3 $tests --fault extra-collective
fault killed_rank 4 \
    '^mgpu: error: rank [023]: stopped by the launcher in allreduce #[0-9]+ of 1000 floats' \
    'process rank 1 .*exited on signal 9' \
    -- $tests --fault die
fault other_network 2 \
    '^mgpu: error: rank 0: mgpu_distributed_data_parallel_new: rank 1 built another network than rank 0' \
    -- $tests --fault other-network
fault built_without_mpi 2 \
    '^mgpu: error: a launcher started 2 copies of this program, but it was built without MPI' \
    -- build/nompi/dist_tests

# check NAME STATUS PATTERN... -- COMMAND...: chapter 4 as a student runs
# it; passes when COMMAND exits with STATUS and its output matches every
# PATTERN.
check() {
    local name=$1 want=$2; shift 2
    local patterns=()
    while [ "$1" != "--" ]; do patterns+=("$1"); shift; done
    shift
    local log="$out/$name.log"
    timeout 300 "$@" >"$log" 2>&1
    local status=$? ok=1
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
small="--train-samples 2048 --test-samples 256 --batch-size 64 --epochs 2 --momentum 0.9"
check chapter4_two_processes 0 \
    '^Rank: 1 \| Epoch \[2/2\] \| Avg\. Loss: [0-9.]+ \| Accuracy: [0-9.]+%$' \
    '^test acc: 0\.[0-9]+, [0-9.]+ sec/epoch, [0-9]+ images/sec, on 1 process \(gradients: none\)' \
    '^test acc: 0\.[0-9]+, [0-9.]+ sec/epoch, [0-9]+ images/sec, on 2 processes \(gradients: mpi\)' \
    '^ +2 +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$' 'ranks. timeline: ' \
    -- mpirun -np 2 ./chapter4 $small --checkpoint-every 5 --out "$out/whole"
for png in chapter4_test_acc.png chapter4_2_processes.png chapter4_ranks_timeline.png; do
    if [ "$(head -c 4 "$out/whole/$png" 2>/dev/null | tail -c 3)" = PNG ]; then
        echo "ok   chapter4_$png"; passed=$((passed + 1))
    else
        echo "FAIL chapter4_$png"; failed=$((failed + 1))
    fi
done
# Killed at step 17 (after the checkpoint of step 15) and resumed: the end
# is the uninterrupted run's, bit for bit.
fault chapter4_killed 2 'process rank 1 .*exited on signal 9' \
    -- ./chapter4 $small --checkpoint-every 5 --kill-at-step 17 --out "$out/resumed"
check chapter4_resumed 0 '^resumed from .*chapter4_2proc\.ckpt: epoch 1, batch 15, step 15$' \
    -- mpirun -np 2 ./chapter4 $small --checkpoint-every 5 --resume --out "$out/resumed"
whole=$(grep -o "on 2 processes.*hash [0-9a-f]*" "$out/chapter4_two_processes.log")
resumed=$(grep -o "on 2 processes.*hash [0-9a-f]*" "$out/chapter4_resumed.log")
if [ -n "$whole" ] && [ "$whole" = "$resumed" ]; then
    echo "ok   chapter4_resumed_bit_for_bit"; passed=$((passed + 1))
else
    echo "FAIL chapter4_resumed_bit_for_bit: '$whole' against '$resumed'"; failed=$((failed + 1))
fi
check chapter4_alone 0 '^test acc: 0\.[0-9]+, .* on 1 process \(gradients: none\)' \
    -- ./chapter4 --train-samples 512 --test-samples 128 --epochs 1 --out "$out/alone"
check chapter4_more_devices_than_processes 1 '^mgpu: error: --devices 2: the job has 1 processes' \
    -- ./chapter4 --devices 2 --out "$out/alone"
check chapter4_bad_model 1 '^mgpu: error: --model vgg: want lenet or resnet18$' -- ./chapter4 --model vgg

echo "test-summary: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
