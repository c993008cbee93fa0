#!/usr/bin/env bash
# bench/gpu_check.sh: every GPU figure the project owes, in one command of
# at most 9 minutes on a GPU machine.
#
#   bash bench/gpu_check.sh --prepare        # here, with the package registries:
#                                            # .devdata (Fashion-MNIST) and .deps/debs
#   bash bench/gpu_check.sh LOGDIR           # there, on the GPU machine
#   bash bench/gpu_check.sh --rehearse LOGDIR  # anywhere: the same stages on the
#                                            # emulated GPUs and the CPU, tiny sizes
#
# A GPU machine may have no package registry. --prepare fills two folders
# that git ignores: .devdata, the four Fashion-MNIST .gz files (from
# $MGPU_DATA or ../shared/fashion-mnist, 30 MiB), and .deps/debs, the Debian
# packages of OpenBLAS, stb and zlib (14 MiB); copy the checkout with both
# to the GPU machine. There the script unpacks the packages only if the
# libraries are missing (bench/lib.sh: use_carried_libraries).
#
# The stages, in order of importance, each with a time budget; a stage
# that would start after the deadline (520 s on a GPU, so that the whole
# script stays under 9 minutes) is skipped, and one that outruns its
# budget is stopped. Each writes its programs' logs under LOGDIR.
#   build      make for sm_90 alone (CUDA_ARCHS=90) of what the stages run
#   tests      the GPU tests (tests/gpu_*.c): every CUDA kernel of the
#              product against its CPU reference, the collectives, the
#              data-parallel wrapper
#   sanitize   compute-sanitizer memcheck and racecheck on the small
#              kernel tests
#   resnet18   chapter 3's epoch on one device, batch 256, beside the
#              book's PyTorch code and the tuned one (targets 9 to 11),
#              and ./bench/profile's step
#   lenet      chapter 2 on 1 and 2 devices beside the book's PyTorch
#              code (targets 4 to 6), the book's 10 epochs
#   comm       ./bench/overlap (target 14) and ./bench/allreduce on 2 and
#              4 virtual devices up to 64 MiB (target 13)
#   conv       ./bench/convolutions beside cuDNN (bench/pytorch/conv.py);
#              on the GPU, bench/conv/'s variants, each checked and timed
#   full       ./chapter3 --full on one device (target 12)
#   dist       processes (chapter 4) sharing the GPU: tests/gpu_dist.c
#              under mpirun -np 2 ("mpi via host", after the line saying
#              NCCL cannot start with two ranks on one GPU), ./chapter4 for an
#              epoch on 1 and 2 processes, with --sync-bn too, and
#              ./bench/nccl_ranks: what NCCL does with two processes on
#              one GPU, with and without NCCL_MULTI_RANK_GPU_ENABLE=1
#   memory     ./chapter5 (a step's memory by category, checkpointing, the
#              largest batch under a limit) and ./bench/checkpoint beside
#              bench/pytorch/checkpoint.py (chapter 5's target: a
#              checkpointed step at most 1.4 times a plain one)
#   models     ./bench/zero (chapter 5's target: a ZeRO-2 step at most 1.1
#              times DDP's), ./bench/pipeline on 2 and 4 virtual devices
#              (naive, GPipe and 1F1B), and ./chapter6 for an epoch
# The last lines printed are the summary table, one row per target with
# its value, threshold and "met" or "missed" (also LOGDIR/summary.md), so
# that a log cut short still ends on it. The exit status is non-zero when
# a stage failed or was skipped (a missed target is not a failure of the
# script). LOGDIR must be new or empty.
#
# The rehearsal (in `make test`) runs every stage with tiny sizes: the
# GPU tests and the sanitizer's list on the emulated GPUs (build/emu/,
# one chosen test each, without compute-sanitizer), the programs on CPU
# devices, the PyTorch scripts only compiled when torch is missing. It
# ends with "test-summary: P passed, F failed", a check per stage and one
# for the table, so a misspelt test name, flag or file fails it here
# instead of on the GPU's minutes. REHEARSE_BENCH names where the built
# benchmark programs are (default bench/; the Makefile passes its checked
# builds).
set -uo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0") # (the stages run it again, from the root)
CALLER_DIR=$PWD
cd "$(dirname "$0")/.."
. bench/lib.sh

# ------------------------------------------------------------- --prepare
if [ "${1:-}" = --prepare ]; then
    src=${MGPU_DATA:-../shared/fashion-mnist}
    mkdir -p .devdata .deps/debs || exit 1
    cp "$src"/*-ubyte.gz .devdata/ || { echo "gpu_check.sh: no Fashion-MNIST .gz files in $src" >&2; exit 1; }
    (cd .deps/debs && apt-get download libopenblas-pthread-dev libopenblas0-pthread libgfortran5 \
        libquadmath0 libstb-dev libstb0 zlib1g-dev zlib1g) || exit 1
    du -sh .devdata .deps/debs
    echo "carry .devdata and .deps to the GPU machine, then: bash bench/gpu_check.sh LOGDIR"
    exit 0
fi

REHEARSE=0 STAGE=
[ "${1:-}" = --rehearse ] && { REHEARSE=1; shift; }
[ "${1:-}" = --stage ] && { STAGE=$2; shift 2; }
case "${1:-}" in -*) set -- ;; esac # (a flag it does not know, --help included, is not a folder)
[ $# = 1 ] || { echo "usage: bash bench/gpu_check.sh [--rehearse] LOGDIR | --prepare" >&2; exit 2; }
LOGS=$1
case $LOGS in /*) ;; *) LOGS=$CALLER_DIR/$LOGS ;; esac
# an earlier run's logs would give this run's table figures it did not make
if [ -z "$STAGE" ] && [ -n "$(ls -A "$LOGS" 2>/dev/null)" ]; then
    echo "gpu_check.sh: $LOGS is not empty; give a new or empty folder" >&2
    exit 2
fi
mkdir -p "$LOGS" || exit 1
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
[ -d .devdata ] && export MGPU_DATA=${MGPU_DATA:-$PWD/.devdata}
DATA=${MGPU_DATA:-data/fashion-mnist}
if ! ls "$DATA"/train-images-idx3-ubyte* >/dev/null 2>&1; then
    echo "gpu_check.sh: no Fashion-MNIST in '$DATA' (set MGPU_DATA, or bench/gpu_check.sh --prepare)" >&2
    exit 1
fi
JOBS=$(nproc)
GPU_TESTS=$(cd tests && ls gpu_*.c | sed 's/\.c$//')

if [ $REHEARSE = 1 ]; then
    # (its budgets are the GPU's; here they only stop a hang: a busy
    # machine's slowness must not fail a rehearsal of names and flags)
    DEADLINE=2400 BUDGET_SCALE=6
    TEST_DIR=build/emu
    BENCH=${REHEARSE_BENCH:-bench/}
    CPU=--cpu
    MAKE_ARGS=()
    # chapter 3: 2 steps of 32 images; chapter 2: 512 images; the rest one step
    CH3=(--epochs 1 --train-samples 64 --test-samples 64 --batch-size 32 --lr 0.05)
    CH3_FULL=(--epochs 1 --train-samples 32 --test-samples 32 --batch-size 16)
    CH2=(--epochs 1 --train-samples 512 --batch-size 256)
    PROFILE=(--batch-size 8 --steps 1 --scratch-mb 4) OVERLAP=(--batch-size 8 --steps 1 --trials 1)
    ALLREDUCE_MIB=1 CONV=(--batch-size 2 --steps 1)
    CH4=(--cpu --train-samples 32 --test-samples 32 --batch-size 16)
    CH5=(--cpu --batch-size 4 --steps 1 --limit-mib 170) CKPT=(--cpu --batch-size 4 --steps 1)
    ZERO=(--cpu --batch-size 4 --steps 1) PIPE=(--cpu --batch-size 16 --steps 1)
    CH6=(--cpu --epochs 1 --train-samples 256 --batch-size 32 --steps 1 --width 8)
else
    DEADLINE=520 BUDGET_SCALE=1
    TEST_DIR=build/cuda
    BENCH=bench/
    CPU=
    MAKE_ARGS=(CUDA_ARCHS=90)
    CH3=(--epochs 2 --train-samples 60000 --test-samples 10000 --batch-size 256 --lr 0.1)
    CH3_FULL=(--full)
    CH2=(--epochs 10 --train-samples 60000 --batch-size 256)
    PROFILE=() OVERLAP=() ALLREDUCE_MIB=64 CONV=()
    CH4=(--train-samples 30720 --test-samples 10000 --batch-size 256)
    CH5=() CKPT=()
    ZERO=() PIPE=() CH6=(--epochs 1 --batch-size 256)
fi
# mpirun as root (the GPU machines), with more ranks than cores allowed
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1

# A test binary and the part of it that a stage runs: the rehearsal runs
# one small test of each on the emulator (the rest run in `make test`).
declare -A REHEARSAL_TEST=([gpu_comm]=nccl_broadcast [gpu_data]=loader [gpu_dist]=broadcast_all_gather
                           [gpu_fixtures]=lenet [gpu_layers]=relu_and_add [gpu_memory]=running_statistics
                           [gpu_parallel]=resnet18_has [gpu_pipeline]=gpipe_1f1b_and_zb_h1
                           [gpu_tensor_parallel]=megatrons_mlp [gpu_train_ops]=sgd_plain)
# The sanitizer's list: small shapes of every kernel family.
SANITIZED=("gpu_layers conv2d_small" "gpu_layers implicit_gemm_small" "gpu_layers pooling"
           "gpu_layers relu" "gpu_layers linear" "gpu_layers first_layer" "gpu_layers residual_block"
           "gpu_train_ops batchnorm_one" "gpu_train_ops ragged" "gpu_train_ops cross_entropy_10"
           "gpu_train_ops cross_entropy_one" "gpu_train_ops sum_of" "gpu_train_ops sgd")

# torch with a GPU? (asked once: the stages inherit the answer)
if [ -z "${GPU_CHECK_TORCH:-}" ]; then
    GPU_CHECK_TORCH=0
    "$PYTHON" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null && GPU_CHECK_TORCH=1
    export GPU_CHECK_TORCH
fi
TORCH=$GPU_CHECK_TORCH

# ---------------------------------------------------------------- stages
STATUS=()     # one line per stage: "name: ok, 12 s" and the like
FAILED=0
# stage NAME BUDGET: runs do_NAME with at most BUDGET seconds, fewer if
# the deadline is nearer, its output in $LOGS/NAME.log. The stage runs
# as this script again (--stage NAME), under timeout, which stops it and
# every program it started.
stage() {
    local name=$1 budget=$(($2 * BUDGET_SCALE)) left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 20 ]; then # (a skipped stage's figures are missing: it counts as failed)
        STATUS+=("$name: skipped, ${left} s left of the deadline")
        FAILED=$((FAILED + 1))
        printf -- '-- %-9s skipped (%d s left)\n' "$name" "$left"
        return
    fi
    [ "$budget" -gt "$left" ] && budget=$left
    local t0=$SECONDS
    printf -- '-- %-9s (at most %d s) ' "$name" "$budget"
    timeout -k 5 "$budget" bash "$SELF" $([ $REHEARSE = 1 ] && echo --rehearse) --stage "$name" "$LOGS" \
        >"$LOGS/$name.log" 2>&1
    local rc=$? took=$((SECONDS - t0)) what
    case $rc in
    0) what="ok" ;;
    124|137) what="STOPPED at its budget of $budget s"; FAILED=$((FAILED + 1)) ;;
    *) what="FAILED (exit status $rc)"; FAILED=$((FAILED + 1)) ;;
    esac
    STATUS+=("$name: $what, $took s")
    echo "$what, $took s"
    [ $rc = 0 ] || tail -n 5 "$LOGS/$name.log" | sed 's/^/   | /'
}

# run NAME COMMAND...: COMMAND's output in $LOGS/NAME.log (and a line in
# the stage's log); the stage goes on when it fails.
run() {
    local name=$1; shift
    echo "-- $name: $*"
    "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    [ $rc = 0 ] || { echo "   FAILED (exit status $rc):"; tail -n 5 "$LOGS/$name.log"; }
    return $rc
}

do_build() {
    [ $REHEARSE = 1 ] || { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv; nvcc --version | tail -n 2; }
    make -s print-CUDNN_HOME print-NCCL_HOME # (cuDNN's convolutions are candidates where it is found)
    local targets=(chapter2 chapter3 chapter4 chapter5 chapter6) t
    for t in $GPU_TESTS; do targets+=("$TEST_DIR/$t"); done
    for t in profile overlap allreduce convolutions checkpoint zero pipeline; do targets+=("$BENCH$t"); done
    [ $REHEARSE = 1 ] || targets+=(bench/nccl_ranks)
    make -j"$JOBS" "${MAKE_ARGS[@]}" "${targets[@]}"
}

# sums the "test-summary: P passed, F failed" lines of the logs given; a
# log without one (a test program that crashed, or was not built) counts
# as one failure, as in tests/run.sh
sum_summaries() {
    local log p=0 f=0 line
    for log in "$@"; do
        line=$(sed -n 's/^test-summary: \([0-9]*\) passed, \([0-9]*\) failed.*/\1 \2/p' "$log" | tail -n 1)
        if [ -z "$line" ]; then f=$((f + 1)); continue; fi
        set -- $line
        p=$((p + $1)) f=$((f + $2))
    done
    echo "$p passed, $f failed"
}

do_tests() {
    local t rc=0
    for t in $GPU_TESTS; do
        if [ $REHEARSE = 1 ]; then
            run "test-$t" "$TEST_DIR/$t" "${REHEARSAL_TEST[$t]}" || rc=1
            grep -q '^test-summary: [1-9]' "$LOGS/test-$t.log" || { echo "   no test of $t ran"; rc=1; }
        else
            run "test-$t" "$TEST_DIR/$t" || rc=1
        fi
    done
    echo "tests: $(sum_summaries "$LOGS"/test-gpu_*.log)"
    return $rc
}

# Each listed test under memcheck and racecheck (plain on the emulator):
# a run is clean when it ran at least one test, passed them all, and the
# tool reported no error. The summary counts the runs' logs, so a stage
# stopped at its budget still reports those it finished.
SANITIZE_TOOLS=(memcheck racecheck)
[ $REHEARSE = 1 ] && SANITIZE_TOOLS=(plain) # each test once: the names are what is rehearsed
sanitize_log() { echo "sanitize-$1-$2-$3"; }
sanitize_clean() {
    local log=$LOGS/$(sanitize_log "$@").log
    grep -q '^test-summary: [1-9][0-9]* passed, 0 failed' "$log" 2>/dev/null &&
        { [ $REHEARSE = 1 ] || grep -qE '(ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards)' "$log"; }
}
sanitize_count() {
    local tool entry clean=0 runs=0
    for tool in "${SANITIZE_TOOLS[@]}"; do
        for entry in "${SANITIZED[@]}"; do
            runs=$((runs + 1))
            sanitize_clean "$tool" $entry && clean=$((clean + 1))
        done
    done
    echo "$clean of $runs runs clean"
}
do_sanitize() {
    local cs=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
    local tool entry rc=0
    for tool in "${SANITIZE_TOOLS[@]}"; do
        for entry in "${SANITIZED[@]}"; do
            set -- $entry
            if [ $REHEARSE = 1 ]; then
                run "$(sanitize_log "$tool" "$1" "$2")" "$TEST_DIR/$1" "$2"
            else
                run "$(sanitize_log "$tool" "$1" "$2")" "$cs" --tool "$tool" --error-exitcode 3 "$TEST_DIR/$1" "$2"
            fi
            sanitize_clean "$tool" "$1" "$2" || { echo "   not clean: $tool $1 $2"; rc=1; }
        done
    done
    echo "sanitize: $(sanitize_count)"
    return $rc
}

# The PyTorch scripts run where torch sees a GPU; elsewhere they are only
# compiled, so that a syntax error shows before the GPU's minutes.
torch_or_compile() {
    local name=$1 script=$2; shift 2
    if [ $TORCH = 1 ]; then
        run "$name" "$PYTHON" -u "$script" "$@" --device cuda
    else
        echo "-- $name: torch cannot use a GPU here: $script only compiled"
        "$PYTHON" -m py_compile "$script"
    fi
}

do_resnet18() {
    local rc=0
    run chapter3 ./chapter3 $CPU --devices 1 "${CH3[@]}" --data "$DATA" --out "$LOGS/out" || rc=1
    torch_or_compile chapter3.py bench/pytorch/chapter3.py "${CH3[@]}" --data "$DATA" || rc=1
    run profile "${BENCH}profile" $CPU "${PROFILE[@]}" --data "$DATA" || rc=1
    run profile-timed env MGPU_CONV=timed "${BENCH}profile" $CPU "${PROFILE[@]}" --data "$DATA" || rc=1
    return $rc
}

do_lenet() {
    local rc=0
    run chapter2 ./chapter2 $CPU "${CH2[@]}" --data "$DATA" --out "$LOGS/out" || rc=1
    torch_or_compile chapter2.py bench/pytorch/chapter2.py "${CH2[@]}" --data "$DATA" || rc=1
    return $rc
}

do_comm() {
    local rc=0 k
    run overlap "${BENCH}overlap" $CPU "${OVERLAP[@]}" --data "$DATA" || rc=1
    for k in 2 4; do
        run "allreduce-$k" "${BENCH}allreduce" $CPU --devices $k --max-mib $ALLREDUCE_MIB \
            --out "$LOGS/allreduce-$k" || rc=1
    done
    return $rc
}

do_conv() {
    local rc=0
    run conv "${BENCH}convolutions" $CPU "${CONV[@]}" || rc=1
    torch_or_compile conv.py bench/pytorch/conv.py "${CONV[@]}" || rc=1
    if [ $REHEARSE = 0 ]; then # (built here: a variant that fails to build fails this stage alone)
        local variant name
        for variant in bench/conv/[0-9][0-9]_*.cu; do
            name=$(basename "$variant" .cu)
            run "build-$name" make "${MAKE_ARGS[@]}" "${variant%.cu}" && run "$name" "${variant%.cu}" --steps 5 || rc=1
        done
    fi
    return $rc
}

do_dist() {
    local rc=0
    if [ $REHEARSE = 1 ]; then
        run dist-tests mpirun -np 2 "$TEST_DIR/gpu_dist" "${REHEARSAL_TEST[gpu_dist]}" || rc=1
    else
        run dist-tests mpirun -np 2 "$TEST_DIR/gpu_dist" || rc=1
    fi
    echo "dist tests: $(sum_summaries "$LOGS/dist-tests.log")"
    run chapter4 mpirun -np 2 ./chapter4 --model resnet18 --epochs 1 "${CH4[@]}" --out "$LOGS/out4" || rc=1
    run chapter4-sync mpirun -np 2 ./chapter4 --model resnet18 --epochs 1 --devices 2 --sync-bn "${CH4[@]}" \
        --out "$LOGS/out4-sync" || rc=1
    if [ $REHEARSE = 0 ]; then # (what NCCL does is the finding: a refusal is not this stage's failure)
        run nccl-ranks mpirun -np 2 bench/nccl_ranks
        NCCL_MULTI_RANK_GPU_ENABLE=1 run nccl-ranks-multi mpirun -x NCCL_MULTI_RANK_GPU_ENABLE -np 2 bench/nccl_ranks
    fi
    return $rc
}

do_memory() {
    local rc=0
    run chapter5 ./chapter5 "${CH5[@]}" --out "$LOGS/out5" || rc=1
    run checkpoint "${BENCH}checkpoint" "${CKPT[@]}" || rc=1
    torch_or_compile checkpoint.py bench/pytorch/checkpoint.py || rc=1
    return $rc
}

do_models() {
    local rc=0 stages
    run zero "${BENCH}zero" "${ZERO[@]}" || rc=1
    for stages in 2 4; do run "pipeline-$stages" "${BENCH}pipeline" --stages $stages "${PIPE[@]}" || rc=1; done
    run chapter6 ./chapter6 "${CH6[@]}" --out "$LOGS/out6" || rc=1
    return $rc
}

do_full() {
    run full ./chapter3 $CPU --devices 1 "${CH3_FULL[@]}" --data "$DATA" --out "$LOGS/out-full"
}

if [ -n "$STAGE" ]; then
    use_carried_libraries >/dev/null
    "do_$STAGE"
    exit
fi

echo "gpu_check.sh$([ $REHEARSE = 1 ] && echo ' --rehearse'): $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), logs in $LOGS"
use_carried_libraries || FAILED=$((FAILED + 1))
stage build 200
stage tests 100
stage sanitize 120
stage resnet18 100
stage lenet 80
stage comm 60
stage conv 50
stage full 60
stage dist 90
stage memory 120
stage models 60

# ----------------------------------------------------------------- summary
ROWS=""
MISSING=0
# row TARGET VALUE THRESHOLD TEST [X]: TEST an awk condition on x, X or
# else the value's first number; empty for a figure without a threshold.
row() {
    local verdict="-" x=${5:-${2%%[!0-9.]*}}
    if [ -z "$2" ] || [ "$2" = - ]; then
        verdict="no figure"
        MISSING=$((MISSING + 1))
    elif [ -n "${4:-}" ] && [ $REHEARSE = 0 ]; then
        verdict=$(awk "BEGIN { x = $x; print ($4) ? \"met\" : \"missed\" }")
    fi
    ROWS+="| $1 | $2 | ${3:--} | $verdict |"$'\n'
}
# a figure that needs torch on a GPU: "-" and not counted as missing without one
torch_row() {
    if [ $TORCH = 1 ]; then row "$@"; else ROWS+="| $1 | (no torch with a GPU) | ${3:--} | - |"$'\n'; fi
}

tests_line=$(value tests 's/^tests: //p')
# (none passed counts as a failure)
row "GPU tests ($TEST_DIR/gpu_*)" "$tests_line" "0 failed" "x == 0" "$(echo "$tests_line" | awk '{ print $3 + ($1 == 0) }')"
sanitized=$(sanitize_count)
row "compute-sanitizer memcheck and racecheck$([ $REHEARSE = 1 ] && echo ', rehearsed without it')" \
    "$sanitized" "every run clean" "x == 0" "$(echo "$sanitized" | awk '{ print $3 - $1 }')"

m1=$(run_secs chapter2 1) m2=$(run_secs chapter2 2)
p1=$(result chapter2.py sec_per_epoch devices=1)
row "4: chapter 2, 1 device $(run_on chapter2 1), sec/epoch" "$(or_dash "$m1")" "<= 0.15" "x <= 0.15"
torch_row "5: chapter 2, book's PyTorch / mgpu, 1 device" "$(calc %.2f "$p1 / $m1")" ">= 10" "x >= 10"
row "6: chapter 2, 2 virtual devices / 1 device" "$(calc %.2f "$m2 / $m1")" "<= 1.3" "x <= 1.3"

c_last=$(epoch_secs chapter3)
row "9: chapter 3, 1 device, batch 256, sec/epoch (last epoch)" "$(or_dash "$c_last")" "<= 2.0" "x <= 2.0"
torch_row "10: chapter 3, book's PyTorch / mgpu" \
    "$(calc %.2f "$(result chapter3.py last_epoch variant=seed) / $c_last")" ">= 1.5" "x >= 1.5"
torch_row "11: chapter 3, tuned PyTorch / mgpu" \
    "$(calc %.2f "$(result chapter3.py last_epoch variant=tuned) / $c_last")" ">= 1.0" "x >= 1.0"
full_acc=$(sed -n 's/^  epoch [0-9]*\/[0-9]*: .*, test acc \([0-9.]*\), .*/\1/p' "$LOGS/full.log" 2>/dev/null | tail -n 1)
row "12: ./chapter3 --full, 1 device, test accuracy" "$(or_dash "$full_acc")" ">= 0.90" "x >= 0.90"

# ring at 64 MiB (the largest size the run reached, if smaller)
ring_over() {
    local csv=$LOGS/allreduce-$1/bench_allreduce.csv size
    size=$(grep ',ring,' "$csv" 2>/dev/null | cut -d, -f1 | sort -n | awk '$1 <= 67108864' | tail -n 1)
    grep "^$size,ring," "$csv" 2>/dev/null | cut -d, -f7
}
for k in 2 4; do
    row "13: ring allreduce, $k virtual devices, 64 MiB, time / floor" "$(or_dash "$(ring_over $k)")" "<= 1.25" "x <= 1.25"
done
row "14: ResNet-18 step on 2 virtual devices, overlapped / no reduction" \
    "$(or_dash "$(result overlap ratio)")" "<= 1.05" "x <= 1.05"
dist_line=$(value dist 's/^dist tests: //p')
row "chapter 4's tests, 2 processes on one device (mpirun -np 2 $TEST_DIR/gpu_dist)" "$dist_line" "0 failed" "x == 0" \
    "$(echo "$dist_line" | awk '{ print $3 + ($1 == 0) }')"
c4_1=$(sed -n 's/^test acc: .*, \([0-9]*\) images\/sec, on 1 process .*/\1/p' "$LOGS/chapter4.log" 2>/dev/null)
c4_2=$(sed -n 's/^test acc: .*, \([0-9]*\) images\/sec, on 2 processes .*/\1/p' "$LOGS/chapter4.log" 2>/dev/null)
row "chapter 4, ResNet-18, images/sec: 1 process / 2 sharing the device ($(sed -n 's/.*on 2 processes (gradients: \([^)]*\)).*/\1/p' "$LOGS/chapter4.log" 2>/dev/null))" \
    "$([ -n "$c4_1" ] && [ -n "$c4_2" ] && echo "$c4_1 / $c4_2")" "" ""
row "chapter 4 --sync-bn, 2 processes, test accuracy after an epoch" \
    "$(sed -n 's/^test acc: \([0-9.]*\), .* on 2 processes .*/\1/p' "$LOGS/chapter4-sync.log" 2>/dev/null)" "" ""
if [ $REHEARSE = 0 ]; then
    for v in nccl-ranks nccl-ranks-multi; do
        ROWS+="| NCCL, 2 processes on one GPU$([ $v = nccl-ranks-multi ] && echo ', NCCL_MULTI_RANK_GPU_ENABLE=1') | $(head -n 1 "$LOGS/$v.log" 2>/dev/null | cut -c1-40): $(grep -hoE 'RESULT.*|nccl_ranks: rank [0-9]+: .*' "$LOGS/$v.log" 2>/dev/null | head -n 1 | cut -c1-160) | - | - |"$'\n'
    done
fi
row "chapter 5's checkpointed ResNet-18 step / plain ($(result checkpoint on), batch $(result checkpoint batch), $(result checkpoint runs) runs)" \
    "$(or_dash "$(result checkpoint ratio)")" "<= 1.4" "x <= 1.4"
torch_row "PyTorch checkpoint_sequential's step / plain (same cut)" "$(or_dash "$(result checkpoint.py ratio)")" "" ""
row "chapter 5, largest batch under its limit: plain / checkpointed" \
    "$(sed -n 's/^  without checkpointing *batch \([0-9]*\)$/\1/p' "$LOGS/chapter5.log" 2>/dev/null) / $(sed -n 's/^  checkpointed (sqrt n runs) batch \([0-9]*\)$/\1/p' "$LOGS/chapter5.log" 2>/dev/null)" "" ""
row "23: ZeRO-2 / DDP, ResNet-18 with Adam ($(value zero 's/^RESULT zero on=\(\[[^]]*\]\).*/\1/p'), batch $(result zero batch))" \
    "$(or_dash "$(result zero zero2_ratio)")" "<= 1.1" "x <= 1.1"
row "ResNet-18 step, 1 device, ms ($(result profile on), batch $(result profile batch))" \
    "$(or_dash "$(result profile step_ms)")" "" ""
row "51: ResNet-18 step, convolutions by rule (the default) / timed (MGPU_CONV=timed)" \
    "$(calc %.4f "$(result profile step_ms) / $(result profile-timed step_ms)")" "<= 1.03" "x <= 1.03"
# "a / b / c", or "-" when one of the parts needed is missing (the CPU has
# im2col alone, so the rehearsal needs only the first)
parts() {
    local needed=$1; shift
    local i
    for ((i = 1; i <= $#; i++)); do
        [ "$i" -le "$needed" ] && [ -z "${!i}" ] && { echo -; return; }
    done
    local IFS=/
    echo "$*" | sed 's|/| / |g'
}
conv_needed=$([ $REHEARSE = 1 ] && echo 1 || echo 3)
row "ResNet-18's convolutions, ms a step: mgpu im2col / implicit / best" \
    "$(parts $conv_needed "$(result conv im2col_ms)" "$(result conv implicit_ms)" "$(result conv best_ms)")" "" ""
torch_row "ResNet-18's convolutions, ms a step: cuDNN NCHW / NHWC / best" \
    "$(parts 3 "$(result conv.py nchw_ms)" "$(result conv.py nhwc_ms)" "$(result conv.py best_ms)")" "" ""
for stages in 2 4; do
    row "pipeline, MLP in $stages stages ($(value pipeline-$stages 's/^RESULT pipeline on=\(\[[^]]*\]\).*/\1/p')): GPipe / 1F1B throughput over naive, m = 8" \
        "$(parts 2 "$(result pipeline-$stages gpipe_speedup)" "$(result pipeline-$stages one_f_one_b_speedup)")" "" ""
done
row "chapter 6, 1F1B in 2 stages, test accuracy after an epoch" \
    "$(sed -n 's/^test acc: \([0-9.]*\), .*/\1/p' "$LOGS/chapter6.log" 2>/dev/null)" "" ""

{
    echo
    echo "### gpu_check.sh$([ $REHEARSE = 1 ] && echo ' --rehearse'), $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    [ $REHEARSE = 1 ] || echo "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1), $JOBS CPU cores"
    printf '%s\n' "${STATUS[@]}" | sed 's/^/stage /'
    echo
    echo "| target | value | threshold | status |"
    echo "| --- | --- | --- | --- |"
    printf '%s' "$ROWS"
} | tee "$LOGS/summary.md"

if [ $REHEARSE = 1 ]; then
    # a check per stage, and one for the table: every figure there
    passed=$(printf '%s\n' "${STATUS[@]}" | grep -c ': ok,')
    failed=$(( ${#STATUS[@]} - passed + (MISSING > 0 ? 1 : 0) ))
    [ $MISSING = 0 ] && passed=$((passed + 1)) || echo "$MISSING rows without a figure"
    echo "test-summary: $passed passed, $failed failed"
fi
[ $FAILED = 0 ]
