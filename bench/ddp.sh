#!/usr/bin/env bash
# bench/ddp.sh: the distributed data-parallel wrapper (./bench/ddp, under
# mpirun) beside PyTorch's DistributedDataParallel (bench/pytorch/ddp.py,
# gloo, under torchrun), on this machine's CPU, for chapter 4's issue; a
# markdown table of the medians and ratios with the date, the machine and
# the commit, on stdout and in $BENCH_OUT/ddp.md.
#
#   bash bench/ddp.sh            (make bench/ddp first; bench/run.sh calls it)
#
# What a step is, on both sides: one SGD step (lr 0.01) on a batch of
# random images and labels drawn once: the batch copied to the device
# (mgpu), forward, mean cross-entropy, backward with the gradients
# averaged over the processes, the update; then every process waits for
# the others (mgpu: mgpu_synchronize_all and a barrier; PyTorch: a
# barrier), so the step is over everywhere. A step's time is the longest
# over the processes; each run reports the median of its timed steps
# after a few untimed ones, and this script the median over the rounds.
# The models: chapter 2's LeNet at 256 images a process, and chapter 3's
# ResNet-18 at 32 a process, same layer shapes on both sides, 1x28x28.
#
# Runs, per model and round, mgpu (A) and PyTorch (B) in turn:
#   1 process   A and B, each pinned (taskset) to half the cores: the share
#               one process has in the 2-process runs, so that the
#               comparison is one worker against two such workers, as one
#               GPU against two would be;
#   2 processes A: mpirun -np 2 --bind-to none (unbound, as torchrun's);
#               B: torchrun --standalone --nproc-per-node 2; each process
#               takes half the cores. Both time three ways of combining
#               the gradients, wrapper by wrapper, step by step:
#               overlapped (DDP's buckets during backward), after
#               (the same buckets once backward is done), none (no
#               reduction: PyTorch's no_sync());
#   2 devices   A only: one process, chapter 3's wrapper on 2 CPU devices
#               (mgpu_devices(2) + MGPU_DP_ALLREDUCE), the same global batch.
# The figures, per model (targets of chapter 4's issue):
#   cost of distribution   2-process step - 1-process step (overlapped),
#                          in ms: mgpu's at most PyTorch's (and the
#                          ratio of the two steps, for reading);
#   mgpu / PyTorch         the 2-process steps: at most 0.8;
#   processes / devices    images/s of 2 processes over images/s of 2
#                          devices in one process: at least 0.95;
#   overlapped / none      (and after / none), 2 processes: at most 1.05.
# And "fsdp": ResNet-18 with Adam at 16 images a process (bench/zero.c's
# batch), 2 processes, DDP and fully sharded data parallelism taking
# their steps in turn: mgpu's ZeRO-3 (./bench/ddp --adam --reduce
# overlapped,zero3) beside PyTorch's fully_shard (bench/pytorch/fsdp.py,
# each residual block a unit); issue 52's targets: ZeRO-3 / DDP at most
# 1.3 (measured there on 2 devices of one process, bench/zero), and
# mgpu's ZeRO-3 step no slower than fully_shard's.
# Ratios are ratios of the medians. On a machine shared with other work,
# the rounds still see its load: the block says the load average at the
# start.
#
# Environment: PYTHON (the Python that has torch; without it the PyTorch
# runs are skipped, with a line saying so), DDP_ROUNDS (default 3),
# DDP_MODELS (default "lenet resnet18 fsdp"), DDP_STEPS_LENET and
# DDP_STEPS_RESNET18 ("timed warm-up", default "10 2" and "3 1"; fsdp
# takes ResNet-18's),
# BENCH_OUT (logs in $BENCH_OUT/logs/ddp, default build/bench).
set -u
cd "$(dirname "$0")/.."
. bench/lib.sh    # step, result, calc, or_dash, median

PYTHON=${PYTHON:-python3}
ROUNDS=${DDP_ROUNDS:-3}
MODELS=${DDP_MODELS:-lenet resnet18 fsdp}
OUT=${BENCH_OUT:-build/bench}
LOGS=$OUT/logs/ddp
mkdir -p "$LOGS"
# Open MPI refuses root unless told, and more ranks than cores unless told.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1

if [ ! -x bench/ddp ]; then
    echo "bench/ddp.sh: error: no ./bench/ddp (make bench/ddp)" >&2
    exit 1
fi
MPI=1
command -v mpirun >/dev/null || MPI=0
TORCH=1
if ! torch_version=$("$PYTHON" -c "import warnings; warnings.filterwarnings('ignore'); import torch; print(torch.__version__)" 2>/dev/null); then
    TORCH=0
    TORCH_NOTE="PyTorch: skipped: '$PYTHON' cannot import torch"
else
    TORCH_NOTE="PyTorch $torch_version, gloo, torchrun ($PYTHON)"
fi

cpu_model=$(grep -m 1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
CORES=$(nproc)
MACHINE="${cpu_model:-unknown CPU}, $CORES cores"
# the first half of the cores this script may run on: one process's share
HALF=$("$PYTHON" -c 'import os; c = sorted(os.sched_getaffinity(0)); print(",".join(map(str, c[:max(1, len(c) // 2)])))' 2>/dev/null ||
       echo 0)
STAMP=$(date -u '+%Y-%m-%d %H:%M UTC')
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo '(no git)')
git diff --quiet HEAD 2>/dev/null || COMMIT="$COMMIT (with uncommitted changes)"
LOAD=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)

echo "bench/ddp.sh: $STAMP, $MACHINE, commit $COMMIT, load average $LOAD"
echo "$TORCH_NOTE; $ROUNDS round(s) of: $MODELS; 1-process runs on cpu(s) $HALF"
[ $MPI = 1 ] || echo "no mpirun: the 2-process runs are skipped (apt-get install openmpi-bin libopenmpi-dev)"

# (step, bench/lib.sh: a run into $LOGS/NAME.log, at most 900 s)
STEP_TIMEOUT=900

# -------------------------------------------------------------- the runs
for m in $MODELS; do rm -f "$LOGS/$m".*.log; done
for r in $(seq 1 "$ROUNDS"); do
    for m in $MODELS; do
        case $m in
            lenet) read -r steps warmup <<<"${DDP_STEPS_LENET:-10 2}"; batch=256 ;;
            resnet18 | fsdp) read -r steps warmup <<<"${DDP_STEPS_RESNET18:-3 1}"; batch=32 ;;
            *) echo "bench/ddp.sh: error: DDP_MODELS: lenet, resnet18 or fsdp, got '$m'" >&2; exit 1 ;;
        esac
        if [ $m = fsdp ]; then
            flags=(--batch-size 16 --steps $steps --warmup $warmup)
            [ $MPI = 1 ] && step fsdp.mgpu.r$r mpirun -np 2 --bind-to none ./bench/ddp --cpu --model resnet18 \
                "${flags[@]}" --adam --reduce overlapped,zero3
            [ $TORCH = 1 ] && step fsdp.torch.r$r \
                "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 bench/pytorch/fsdp.py "${flags[@]}"
            continue
        fi
        flags=(--model $m --batch-size $batch --steps $steps --warmup $warmup)
        step $m.mgpu-1proc.r$r taskset -c "$HALF" ./bench/ddp --cpu "${flags[@]}"
        [ $TORCH = 1 ] && step $m.torch-1proc.r$r taskset -c "$HALF" \
            "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 bench/pytorch/ddp.py "${flags[@]}"
        if [ $MPI = 1 ]; then
            step $m.mgpu-2proc.r$r mpirun -np 2 --bind-to none ./bench/ddp --cpu "${flags[@]}" --reduce all
        fi
        [ $TORCH = 1 ] && step $m.torch-2proc.r$r \
            "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 bench/pytorch/ddp.py "${flags[@]}" --reduce all
        step $m.mgpu-2dev.r$r ./bench/ddp --cpu --devices 2 "${flags[@]}"
    done
done

# ------------------------------------------------------------ the table
# ms NAME REDUCE: the median over the rounds of run NAME's step_ms for way REDUCE
ms() { median $(for r in $(seq 1 "$ROUNDS"); do result "$1.r$r" step_ms "reduce=$2 "; done); }
# verdict EXPRESSION: met or missed (awk's truth); "-" when a figure is
# missing (the expression then no longer parses)
verdict() {
    local v
    v=$(calc %d "($1) ? 1 : 0")
    case $v in 1) echo met ;; 0) echo missed ;; *) echo - ;; esac
}
ROWS=""
row() { ROWS+="| $1 | $2 | ${3:--} | ${4:--} | ${5:-} |"$'\n'; }
for m in $MODELS; do
    f() { calc %.1f "$1"; }
    if [ $m = fsdp ]; then
        name="ResNet-18 with Adam, 16 a process"
        md=$(ms fsdp.mgpu overlapped) mz=$(ms fsdp.mgpu zero3)
        pd=$(median $(for r in $(seq 1 "$ROUNDS"); do result "fsdp.torch.r$r" step_ms "way=ddp "; done))
        pz=$(median $(for r in $(seq 1 "$ROUNDS"); do result "fsdp.torch.r$r" step_ms "way=fsdp "; done))
        row "$name" "2 processes, DDP / fully sharded (ms per step)" "$(f "$md") / $(f "$mz")" "$(f "$pd") / $(f "$pz")"
        row "$name" "fully sharded / DDP, 2 processes" "$(calc %.3f "$mz / $md")" "$(calc %.3f "$pz / $pd")"
        row "$name" "fully sharded step, mgpu ZeRO-3 / PyTorch fully_shard" "$(calc %.3f "$mz / $pz")" "" \
            "<= 1: $(verdict "$mz / $pz <= 1")"
        continue
    fi
    case $m in lenet) name="LeNet, 256 a process" ;; resnet18) name="ResNet-18, 32 a process" ;; esac
    m1=$(ms $m.mgpu-1proc overlapped) p1=$(ms $m.torch-1proc overlapped)
    m2=$(ms $m.mgpu-2proc overlapped) p2=$(ms $m.torch-2proc overlapped)
    ma=$(ms $m.mgpu-2proc after) pa=$(ms $m.torch-2proc after)
    mn=$(ms $m.mgpu-2proc none) pn=$(ms $m.torch-2proc none)
    md=$(ms $m.mgpu-2dev overlapped)
    row "$name" "1 process (ms per step)" "$(f "$m1")" "$(f "$p1")"
    row "$name" "2 processes, overlapped / after backward / not reduced (ms per step)" \
        "$(f "$m2") / $(f "$ma") / $(f "$mn")" "$(f "$p2") / $(f "$pa") / $(f "$pn")"
    row "$name" "2 devices in one process, chapter 3's wrapper (ms per step)" "$(f "$md")" ""
    row "$name" "cost of distribution: 2-process step - 1-process step (ms)" "$(f "$m2 - $m1")" \
        "$(f "$p2 - $p1")" "mgpu's at most PyTorch's: $(verdict "$m2 - $m1 <= $p2 - $p1")"
    row "$name" "2-process step / 1-process step" "$(calc %.3f "$m2 / $m1")" "$(calc %.3f "$p2 / $p1")"
    row "$name" "2-process step, mgpu / PyTorch" "$(calc %.3f "$m2 / $p2")" "" \
        "<= 0.8: $(verdict "$m2 / $p2 <= 0.8")"
    row "$name" "throughput, 2 processes / 2 devices in one process" "$(calc %.3f "$md / $m2")" "" \
        ">= 0.95: $(verdict "$md / $m2 >= 0.95")"
    row "$name" "after backward / not reduced, 2 processes" "$(calc %.3f "$ma / $mn")" "$(calc %.3f "$pa / $pn")"
    row "$name" "overlapped / not reduced, 2 processes" "$(calc %.3f "$m2 / $mn")" "$(calc %.3f "$p2 / $pn")" \
        "<= 1.05: mgpu $(verdict "$m2 / $mn <= 1.05"), PyTorch $(verdict "$p2 / $pn <= 1.05")"
done

{
    echo "### bench/ddp.sh: $STAMP, $MACHINE"
    echo
    echo "commit $COMMIT; load average at the start $LOAD; $TORCH_NOTE; mgpu on CPU devices (--cpu)."
    echo "Medians over $ROUNDS alternated round(s) (mgpu, PyTorch, ...) of each run's median step;"
    echo "timed steps (warm-up) a run: LeNet ${DDP_STEPS_LENET:-10 2}, ResNet-18 ${DDP_STEPS_RESNET18:-3 1};"
    echo "1 process pinned to cpu(s) $HALF, 2 processes unbound with half the cores each. Logs in $LOGS."
    echo
    echo "| model, batch | figure | mgpu | PyTorch DDP | target |"
    echo "| --- | --- | --- | --- | --- |"
    printf '%s' "$ROWS"
} | tee "$OUT/ddp.md"
