#!/usr/bin/env bash
# bench/gpu_session.sh STAGE...: the longer GPU work (bench/gpu_check.sh is
# the owed checks in one call), in as few device calls as
# possible, on a GPU machine that has no package registry (the device tool's
# machines: nothing can be installed there, and each call may be at most
# 10 minutes).
#
#   bash bench/gpu_session.sh build test          # make, make test-gpu
#   bash bench/gpu_session.sh chapters            # ./chapter1 --full, ./chapter2, ./chapter3
#   bash bench/gpu_session.sh bench               # make bench beside PyTorch
#   bash bench/gpu_session.sh profile             # bench/convolutions beside cuDNN; ./bench/profile
#   bash bench/gpu_session.sh sanitize            # small GPU tests under compute-sanitizer
#   bash bench/gpu_session.sh ncu                 # Nsight Compute on the convolution kernels
#   AB_BASE=REV bash bench/gpu_session.sh ab      # ./bench/profile and ./bench/convolutions, REV against this tree
#   bash bench/gpu_session.sh wgmma               # ./bench/profile with MGPU_WGMMA=0 and 1
#
# Every stage builds what it needs first (make is quick when nothing
# changed). Logs, PNGs and CSVs go to build/gpu-session/<stage>/; when $OUT
# is set (the device tool sets it), each stage also copies its log and its
# few most useful files there, at most 8 files in all for the stages above
# together (the tool's limit on what comes back).
#
# Before the call, on the machine with the registries, `bash
# bench/gpu_check.sh --prepare` fills .devdata and .deps (ignored by git);
# name both in the call's carry. bench/lib.sh (use_carried_libraries) says
# how the packages are used. Its variables live in this script's process
# only: a command of your own in the same call (a test binary, ncu) needs
#   R=$PWD/.deps/root; L=$R/usr/lib/x86_64-linux-gnu
#   export LD_LIBRARY_PATH=$L:$L/openblas-pthread:$R/lib/x86_64-linux-gnu
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh

SESSION=build/gpu-session
mkdir -p "$SESSION"
JOBS=$(nproc)
export MGPU_DATA=${MGPU_DATA:-$PWD/.devdata}
export PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

say() { printf '\n### %s\n' "$*"; }

use_carried_libraries

# keep LOG FILE...: copies the files to $OUT when it is set
keep() { [ -n "${OUT:-}" ] && cp "$@" "$OUT/" 2>/dev/null; return 0; }

# stage NAME COMMAND...: runs COMMAND with its output shown and in the stage's log
stage() {
    local name=$1; shift
    mkdir -p "$SESSION/$name"
    local t0=$SECONDS
    say "$name: $*"
    "$@" 2>&1 | tee "$SESSION/$name/$name.log"
    local status=${PIPESTATUS[0]}
    echo "== $name: exit status $status, $((SECONDS - t0)) s"
    keep "$SESSION/$name/$name.log"
    return "$status"
}

build() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    nvcc --version | tail -n 2
    make -j"$JOBS" all bench/matmul bench/overlap bench/allreduce bench/profile bench/convolutions
}

chapters() {
    local out=$SESSION/chapters
    ./chapter1 --full --out "$out" &&
        ./chapter2 --out "$out" &&
        ./chapter3 --out "$out"
}

# The kernels' tests at small sizes under compute-sanitizer: memcheck
# (out-of-bounds and misaligned accesses, launch errors) and racecheck
# (shared-memory races in the reductions and the implicit GEMMs' double
# buffering).
sanitize() {
    make -j"$JOBS" build/cuda/gpu_layers build/cuda/gpu_train_ops || return 1
    local cs status=0
    cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    for tool in memcheck racecheck; do
        for t in "gpu_layers conv2d_small" "gpu_layers implicit_gemm_small" "gpu_layers pooling" "gpu_layers relu" \
                 "gpu_layers linear" "gpu_layers first_layer" "gpu_layers residual_block" \
                 "gpu_train_ops batchnorm_one" "gpu_train_ops ragged" \
                 "gpu_train_ops cross_entropy_10" "gpu_train_ops cross_entropy_one" \
                 "gpu_train_ops sum_of" "gpu_train_ops sgd"; do
            set -- $t
            echo "-- $tool: $1 $2"
            "$cs" --tool $tool --error-exitcode 3 "build/cuda/$1" "$2" | tail -n 3 || status=1
        done
    done
    return $status
}

# Nsight Compute on bench/convolutions's first launches of the kernels whose names
# match NCU_KERNELS (default: conv_nhwc.h's;
# NCU_COUNT launches, 24 by default, after NCU_SKIP): how near each runs
# to its compute and memory ceilings, its occupancy, and what its warps
# wait for. The clocks are left alone (--clock-control none: the device
# tool's METHOD.md), so durations are those of the step.
ncu_stage() {
    make -j"$JOBS" bench/convolutions || return 1
    local ncu
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    "$ncu" --clock-control none --kernel-name "regex:${NCU_KERNELS:-conv_nhwc}" \
        --launch-skip "${NCU_SKIP:-0}" --launch-count "${NCU_COUNT:-24}" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        --section LaunchStats --section WarpStateStats ./bench/convolutions --steps 1
}

# The step and its convolutions by an older revision (AB_BASE, which the
# machine's .git must hold) beside this tree's, in one call, so that the
# two are timed on the same machine a minute apart: the older one built
# in a worktree under build/gpu-session/ab/base, then ./bench/profile by
# each in turn, twice (base, this, base, this: a drift of the machine
# shows as a difference between the two runs of one side), then
# ./bench/convolutions by each. AB_ARGS: more arguments for ./bench/profile
# (--cpu --steps 1 to try the stage without a GPU).
ab() {
    [ -n "${AB_BASE:-}" ] || { echo "ab: set AB_BASE to the revision to compare with"; return 2; }
    local base=$SESSION/ab/base
    rm -rf "$base" && git worktree prune &&
        git worktree add --detach "$base" "$AB_BASE" >/dev/null || return 1
    # (the convolutions' benchmark was bench/conv before 740cbfa)
    local conv=convolutions
    [ -f "$base/bench/convolutions.c" ] || conv=conv
    (cd "$base" && make -j"$JOBS" bench/profile bench/$conv >/dev/null) || return 1
    local round side name
    for round in 1 2; do
        for side in "$base" .; do
            name=$([ "$side" = . ] && echo "this tree" || echo "$AB_BASE")
            echo "$name, run $round: $( (cd "$side" && ./bench/profile --data "$MGPU_DATA" ${AB_ARGS:-}) |
                grep '^RESULT')"
        done
    done
    [ -n "${AB_ARGS:-}" ] && return 0 # (bench/convolutions takes no such arguments, and times the GPU alone)
    for side in "$base" .; do
        local program=$([ "$side" = . ] && echo convolutions || echo $conv)
        echo "### ./bench/$program, $side" && (cd "$side" && ./bench/$program) || return 1
    done
}

# The step without and with the wgmma kernels among the trial's
# candidates (MGPU_WGMMA=0 and the default; kernels/conv_nhwc.h), twice each in turn, then
# the profile with them, which names the kernel each convolution keeps,
# and ./bench/convolutions with them (rows "... wgmma"). (make test-gpu checks
# them against the CPU wherever the GPU runs them.)
wgmma_stage() {
    make -j"$JOBS" bench/profile bench/convolutions || return 1
    local round w
    for round in 1 2; do
        for w in 0 1; do
            echo "MGPU_WGMMA=$w, run $round: $(MGPU_WGMMA=$w ./bench/profile --data "$MGPU_DATA" | grep '^RESULT')"
        done
    done
    ./bench/profile --data "$MGPU_DATA" && echo && ./bench/convolutions
}

# Each convolution alone, with im2col, each implicit-GEMM tile and cuDNN;
# then the step's profile at PyTorch's precision with the algorithm chosen
# by rule (MGPU_CONV=rule, the default) and by measuring (timed), with the convolutions
# making their own channels-last copies of x and dy (not batch norm), and
# of their weights (not the network, in a few launches), with each
# algorithm alone, and in float32; then the step time for other sizes of the im2col scratch
# (256 MiB by default on a GPU: the H100 sweep of 2026-11-22 found the
# step faster the larger the scratch, from 16 MiB, which keeps a chunk's
# col buffer in the 50 MB L2 cache, up to 256).
profile() {
    ./bench/convolutions && echo && "$PYTHON" bench/pytorch/conv.py && echo &&
        ./bench/profile --data "$MGPU_DATA" &&
        echo && MGPU_CONV=timed ./bench/profile --data "$MGPU_DATA" &&
        echo && ./bench/profile --data "$MGPU_DATA" --convolutions-copy &&
        echo && ./bench/profile --data "$MGPU_DATA" --weights-copy &&
        echo && MGPU_CONV=im2col ./bench/profile --data "$MGPU_DATA" &&
        echo && MGPU_CONV=implicit ./bench/profile --data "$MGPU_DATA" &&
        echo && MGPU_TF32=0 ./bench/profile --data "$MGPU_DATA" || return 1
    for mb in 16 64 128 512; do
        echo "MGPU_CONV=im2col --scratch-mb $mb: $(MGPU_CONV=im2col \
            ./bench/profile --data "$MGPU_DATA" --scratch-mb $mb | grep '^RESULT')"
    done
}

status=0
for s in "$@"; do
    case $s in
    build) stage build build || status=1 ;;
    test) stage test make -j"$JOBS" test-gpu || status=1 ;;
    wgmma) stage wgmma wgmma_stage || status=1 ;;
    chapters)
        stage build build >/dev/null || { status=1; continue; }
        stage chapters chapters || status=1
        keep "$SESSION"/chapters/chapter1_timeline.png "$SESSION"/chapters/chapter3_test_acc.png \
            "$SESSION"/chapters/chapter3_step_timeline.png ;;
    bench)
        # stopped before the call's 10 minutes run out, so that the logs come back
        stage build build >/dev/null || { status=1; continue; }
        BENCH_OUT=$SESSION/bench/out stage bench timeout "${BENCH_SECONDS:-540}" make bench || status=1
        keep "$(ls -t bench/results-*.md 2>/dev/null | head -n 1)"
        [ -n "${OUT:-}" ] && tar czf "$OUT/bench-logs.tgz" -C "$SESSION/bench/out" logs ;;
    profile)
        stage build build >/dev/null || { status=1; continue; }
        stage profile profile || status=1 ;;
    sanitize) stage sanitize sanitize || status=1 ;;
    ncu) stage ncu ncu_stage || status=1 ;;
    ab)
        stage build build >/dev/null || { status=1; continue; }
        stage ab ab || status=1 ;;
    *) echo "bench/gpu_session.sh: unknown stage '$s' (build, test, chapters, bench, profile, sanitize, ncu, ab)"
       exit 2 ;;
    esac
done
exit $status
