#!/usr/bin/env bash
# bench/run.sh (run by `make bench`): the chapters' workloads in mgpu and in
# PyTorch, side by side in one session, and a block of results with the
# date and the device, on stdout and in bench/results-<date>-<device>.md.
#
# What is measured, and how (each program's own header says more):
#   chapter 1  ./chapter1: the book's Benchmark lines. Two devices alone and
#              together: together / (dev1 + dev2) is 0.5 when they overlap
#              fully, 1 when they take turns. Compute, copy, and both with
#              non-blocking copies into pinned memory: both / max(compute,
#              the same pinned copies alone), target at
#              most 1.1 on a GPU (issue 2).
#              ./bench/matmul: mgpu_matmul against cuBLAS (cblas on the
#              CPU) called directly, 2 N^3 FLOPs per N x N product; the
#              time ratio mgpu / direct, target at most 1.05 (issue 2).
#   chapter 2  ./chapter2 and bench/pytorch/chapter2.py (the book's PyTorch
#              code, same IDX files, same batches of 256, lr 0.2) on 1 and
#              2 devices: seconds per epoch (the training loop, averaged
#              over the epochs) and the final test accuracy (issue 3).
#   chapter 3  ./chapter3 --devices 1 and bench/pytorch/chapter3.py,
#              the book's code ("seed") and a tuned version ("tuned"):
#              seconds per epoch (the last epoch when there are several:
#              the first one includes start-up) and TFLOP/s, with
#                FLOP per epoch = 2 * 3 * MACs per image * training images
#              where MACs per image, the multiply-adds of one forward pass
#              of the book's ResNet-18 on a 1x28x28 image, are summed over
#              its convolutions (H_out * W_out * C_out * C_in * k * k each)
#              and its linear layer (512 * 10); 2 FLOPs per multiply-add,
#              and a training step costs three forward passes (issue 4).
#              Both sides at PyTorch's default precision on a GPU (TF32 in
#              the convolutions, float32 matrix products), which mgpu
#              follows; on a GPU the tuned variant and mgpu run once more
#              in float32 everywhere (MGPU_TF32=0, --tf32 0), one epoch.
#   profile    ./bench/profile: chapter 3's step on one device (batch 256
#              on a GPU), its time and TFLOP/s, and the tracer's table of
#              where the time goes (copied below the results table).
#   conv       ./bench/convolutions and bench/pytorch/conv.py: each of ResNet-18's
#              convolutions (forward, dx, dW) with im2col, with each fast
#              kernel and tile (GPU), and with cuDNN (NCHW and NHWC); the
#              tables, and a step's convolutions summed; on a GPU, each
#              of bench/conv/'s variants (its check and its timing).
#   overlap    ./bench/overlap: a ResNet-18 step on 2 devices with the
#              gradients not reduced, reduced after backward, and reduced
#              in buckets overlapped with backward; overlapped / not
#              reduced, target at most 1.05 on one GPU (issue 5).
#   checkpoint ./bench/checkpoint and bench/pytorch/checkpoint.py: a ResNet-18
#              step plain and in about sqrt(n) = 3 checkpointed runs,
#              alternated step by step; the ratio of the medians (at most
#              1.4, chapter 5's issue) beside checkpoint_sequential's
#   zero       ./bench/zero: ResNet-18 with Adam on 2 devices under DDP,
#              ZeRO-1, ZeRO-2 and ZeRO-3, alternated step by step; ZeRO-2 /
#              DDP at most 1.1 (chapter 5's issue), ZeRO-3 / DDP at most 1.3
#              on the CPU (issue 52)
#   pipeline   ./bench/pipeline --stages 2 and 4, and bench/pytorch/pipeline.py
#              (on the CPU, 2 stages): an MLP of 16 blocks in stages, naive
#              model parallelism, GPipe, 1F1B, ZB-H1 (PyTorch: its
#              ScheduleInterleavedZeroBubble on the same 2 stages) and
#              interleaved 1F1B (2 chunks a device) with 8 micro-batches,
#              alternated step by step; 1F1B / naive throughput at least
#              1.6 on 2 CPU devices (chapter 6's issue), the bubbles beside
#              their formulas, and mgpu / PyTorch per schedule (issue 52).
#   allreduce  ./bench/allreduce --devices 2 and 4: each algorithm's time
#              over its floor (the bytes it must move at the copy rate
#              measured in the same run) at 64 MiB and the largest size
#              (issue 5).
#   ddp        bash bench/ddp.sh, where mpirun is found: ./bench/ddp (the
#              distributed wrapper, 1 and 2 processes) beside PyTorch's
#              DDP (bench/pytorch/ddp.py, gloo), both on the CPU; one round
#              of LeNet here (its header says what is measured).
#
# Rounds: without a GPU, chapters 2 and 3 run BENCH_ROUNDS times (default
# 3), mgpu and PyTorch in turn, and their rows give the medians: a shared
# machine's speed drifts within minutes. On a GPU, once (the GPU check's
# time is short).
#
# Settings: on a GPU the book's, except that chapter 3 trains 2 epochs (not
# 10) and chapter 1 and 2 run as they do by default there. Without a GPU,
# smaller settings that keep the whole run under ~10 minutes on 2 cores;
# the results block states them.
#
# Environment: PYTHON, the Python that has torch (default python3; without
# torch the PyTorch parts are skipped, with a line saying so); MGPU_DATA,
# the Fashion-MNIST folder (else data/fashion-mnist); BENCH_OUT, where the
# programs' logs, PNGs and CSVs go (default build/bench).
set -u
cd "$(dirname "$0")/.."
. bench/lib.sh    # step, value, result, calc, or_dash, median

PYTHON=${PYTHON:-python3}
DATA=${MGPU_DATA:-data/fashion-mnist}
OUT=${BENCH_OUT:-build/bench}
LOGS=$OUT/logs
mkdir -p "$LOGS"
if ! ls "$DATA"/train-images-idx3-ubyte* >/dev/null 2>&1; then
    echo "bench/run.sh: error: no Fashion-MNIST in $DATA (set MGPU_DATA, or run \`make data\`)" >&2
    exit 1
fi

# ------------------------------------------------------------ the machine
if gpu_names=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null) && [ -n "$gpu_names" ]; then
    ON_GPU=1
    ngpus=$(echo "$gpu_names" | wc -l)
    DEVICE="$(echo "$gpu_names" | head -n 1) x$ngpus, $(nproc) CPU cores"
    SLUG=$(echo "$gpu_names" | head -n 1)
else
    ON_GPU=0
    cpu_model=$(grep -m 1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
    DEVICE="CPU: ${cpu_model:-unknown}, $(nproc) cores (no GPU)"
    SLUG="cpu ${cpu_model:-unknown} $(nproc)cores"
fi
SLUG=$(echo "$SLUG" | tr 'A-Z' 'a-z' | sed 's/[^a-z0-9]\{1,\}/-/g; s/^-//; s/-$//')
STAMP=$(date -u '+%Y-%m-%d %H:%M UTC')
# Other work on the machine slows everything, PyTorch's CPU threads most:
# the results say how busy the machine was when the run started.
LOAD=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)
RESULTS=bench/results-$(date -u '+%Y-%m-%d-%H%M')-$SLUG.md

# The workloads' sizes. Chapter 3's are passed to mgpu and PyTorch alike.
if [ $ON_GPU = 1 ]; then
    CH1_FLAGS=(--full)
    CH2_EPOCHS=10 CH2_SAMPLES=60000
    CH3_EPOCHS=2 CH3_SAMPLES=60000 CH3_TEST=10000 CH3_BATCH=256 CH3_LR=0.1
    SETTINGS="the book's: chapter 1 at 4000x4000, matmul 4000x4000, chapter 2 10 epochs of 60000 images; chapter 3 2 epochs of 60000 images at batch 256 (the last one is reported)"
else
    CH1_FLAGS=()
    CH2_EPOCHS=1 CH2_SAMPLES=60000
    CH3_EPOCHS=1 CH3_SAMPLES=512 CH3_TEST=256 CH3_BATCH=32 CH3_LR=0.05
    SETTINGS="reduced for a CPU: chapter 1 at 1250x1250 (its default without a GPU), matmul 1000x1000, chapter 2 one epoch of 60000 images, chapter 3 one epoch of 512 images at batch 32 (chapter 3's reduced default)"
fi

# --------------------------------------------------------------- helpers
# (step, bench/lib.sh: runs a command into $LOGS/NAME.log)
ROUNDS=${BENCH_ROUNDS:-$([ $ON_GPU = 1 ] && echo 1 || echo 3)}
# rounds NAME: the logs of NAME's rounds (NAME, NAME.r2, NAME.r3, ...)
rounds() { echo "$1"; for r in $(seq 2 "$ROUNDS"); do echo "$1.r$r"; done; }

ROWS=""
# row WORKLOAD FIGURE VALUE TARGET: a line of the results table.
row() { ROWS+="| $1 | $2 | ${3:--} | ${4:-} |"$'\n'; }

# Multiply-adds of one forward pass of the book's ResNet-18 on a 1x28x28
# image (the formula is in the header; chapter3.py counts the same with
# hooks, and the two are compared below).
resnet18_macs() {
    awk 'function conv(hw, cout, cin, k) { return hw * hw * cout * cin * k * k }
    BEGIN {
        hw = 28; c = 64; macs = conv(hw, 64, 1, 3)          # stem: 3x3, stride 1
        for (stage = 0; stage < 4; stage++) {
            out = 64 * 2 ^ stage
            if (stage == 0) macs += conv(hw, out, c, 3)
            else {                                          # stride 2, and the 1x1 shortcut
                hw = int((hw - 1) / 2) + 1
                macs += conv(hw, out, c, 3) + conv(hw, out, c, 1)
            }
            macs += 3 * conv(hw, out, out, 3)               # the three other 3x3 convolutions
            c = out
        }
        printf "%.0f", macs + 512 * 10                      # and the linear layer
    }'
}

# ---------------------------------------------------- is PyTorch there?
TORCH=0
if ! torch_version=$("$PYTHON" -c "import torch; print(torch.__version__)" 2>/dev/null); then
    TORCH_NOTE="PyTorch: skipped: '$PYTHON' cannot import torch (PYTHON=/path/to/python make bench picks another)"
elif [ $ON_GPU = 1 ] && ! "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    TORCH_NOTE="PyTorch: skipped: torch $torch_version sees no GPU, and a CPU run beside mgpu on the GPU compares nothing"
else
    TORCH=1
    TORCH_NOTE="PyTorch $torch_version ($PYTHON)"
    TORCH_DEVICE=$([ $ON_GPU = 1 ] && echo cuda || echo cpu)
fi

echo "make bench: $STAMP, $DEVICE, load average $LOAD"
echo "settings: $SETTINGS"
echo "$TORCH_NOTE"
echo "logs, PNGs and CSVs: $OUT"

# ------------------------------------------------------------- chapter 1
step chapter1 ./chapter1 "${CH1_FLAGS[@]}" --out "$OUT"
step matmul ./bench/matmul
t1=$(value chapter1 's/^dev1 (.*) time: \([0-9.]*\) sec$/\1/p')
t2=$(value chapter1 's/^dev2 (.*) time: \([0-9.]*\) sec$/\1/p')
t12=$(value chapter1 's/^dev1 & dev2: \([0-9.]*\) sec$/\1/p')
trun=$(value chapter1 's/^run on dev1 ([^)]*): \([0-9.]*\) sec$/\1/p')
tcopy=$(value chapter1 's/^copy to host: \([0-9.]*\) sec$/\1/p')
tpinned=$(value chapter1 's/^copy to pinned host memory: \([0-9.]*\) sec$/\1/p')
tboth=$(value chapter1 's/^run on dev1 (.*) and copy to host: \([0-9.]*\) sec$/\1/p')
gbps=$(value chapter1 's/.*copies moved \([0-9.]*\) GB\/s.*/\1/p')
gbps_pinned=$(value chapter1 's/.* GB\/s to ordinary memory, \([0-9.]*\) GB\/s.*/\1/p')
devs=$(value chapter1 's/^dev1 (\(.*\)) time: .*/\1/p'),$(value chapter1 's/^dev2 (\(.*\)) time: .*/\1/p')
row "chapter 1 ($devs)" "dev1 alone / dev2 alone / together (s)" "$(or_dash "$t1") / $(or_dash "$t2") / $(or_dash "$t12")"
row "chapter 1" "together / (dev1 + dev2)" "$(calc %.2f "$t12 / ($t1 + $t2)")" \
    "< 0.75 on 2 CPU cores (issue 2); on one GPU ~1 (virtual devices take turns)"
row "chapter 1" "compute / copy to host / copy to pinned memory / compute with pinned copies (s)" \
    "$(or_dash "$trun") / $(or_dash "$tcopy") / $(or_dash "$tpinned") / $(or_dash "$tboth")"
row "chapter 1" "both / max(compute, pinned copy)" \
    "$(calc %.2f "$tboth / ($trun > $tpinned ? $trun : $tpinned)")" "<= 1.1 on a GPU (issue 2)"
row "chapter 1" "copy to host / to pinned memory (GB/s)" "$(or_dash "$gbps") / $(or_dash "$gbps_pinned")"
mm_unit=$([ $ON_GPU = 1 ] && echo "TFLOP/s" || echo "GFLOP/s")
mm_div=$([ $ON_GPU = 1 ] && echo 1000 || echo 1)
row "matmul $(result matmul size)x$(result matmul size) ($(result matmul device))" \
    "mgpu_matmul / BLAS direct ($mm_unit)" \
    "$(calc %.2f "$(result matmul mgpu_gflops) / $mm_div") / $(calc %.2f "$(result matmul direct_gflops) / $mm_div")"
row "matmul" "time ratio mgpu / direct" "$(calc %.3f "$(result matmul ratio)")" "<= 1.05 on a GPU (issue 2)"

# ------------------------------------------------------------- chapter 2
CH2_COMMON=(--epochs $CH2_EPOCHS --train-samples $CH2_SAMPLES --batch-size 256 --data "$DATA")
for log in $(rounds chapter2); do
    step $log ./chapter2 "${CH2_COMMON[@]}" --out "$OUT"
    [ $TORCH = 1 ] && step ${log/chapter2/chapter2.py} "$PYTHON" -u bench/pytorch/chapter2.py "${CH2_COMMON[@]}" \
        --device $TORCH_DEVICE
done
m1=$(median $(for log in $(rounds chapter2); do run_secs $log 1; done))
m2=$(median $(for log in $(rounds chapter2); do run_secs $log 2; done))
p1=$(median $(for log in $(rounds chapter2.py); do result $log sec_per_epoch devices=1; done))
p2=$(median $(for log in $(rounds chapter2.py); do result $log sec_per_epoch devices=2; done))
ch2_what="$CH2_EPOCHS epoch(s) of $CH2_SAMPLES images, batch 256; median of $ROUNDS"
row "chapter 2 mgpu, 1 device $(run_on chapter2 1)" "sec/epoch, test acc ($ch2_what)" \
    "$(or_dash "$m1"), $(or_dash "$(run_acc chapter2 1)")" \
    "<= 0.15 s on an H100/H200; <= 20 s on 2 CPU cores; acc >= 0.80 after 10 epochs (issue 3)"
row "chapter 2 mgpu, 2 devices $(run_on chapter2 2)" "sec/epoch, test acc" \
    "$(or_dash "$m2"), $(or_dash "$(run_acc chapter2 2)")"
row "chapter 2" "mgpu 2 devices / 1 device" "$(calc %.2f "$m2 / $m1")" "<= 1.3 with 2 virtual devices on one GPU (issue 3)"
if [ $TORCH = 1 ]; then
    row "chapter 2 PyTorch (book's code), 1 device $(result chapter2.py on devices=1)" "sec/epoch, test acc" \
        "$(calc %.2f "$p1"), $(calc %.2f "$(result chapter2.py test_acc devices=1)")"
    row "chapter 2 PyTorch (book's code), 2 devices $(result chapter2.py on devices=2)" "sec/epoch, test acc" \
        "$(calc %.2f "$p2"), $(calc %.2f "$(result chapter2.py test_acc devices=2)")"
    row "chapter 2" "PyTorch / mgpu, 1 device" "$(calc %.2f "$p1 / $m1")" ">= 10 on an H100/H200 (issue 3); >= 1.2 on 2 CPU cores (issue 35)"
    row "chapter 2" "PyTorch / mgpu, 2 devices" "$(calc %.2f "$p2 / $m2")"
fi

# ------------------------------------------------------------- chapter 3
CH3_COMMON=(--epochs $CH3_EPOCHS --train-samples $CH3_SAMPLES --test-samples $CH3_TEST
            --batch-size $CH3_BATCH --lr $CH3_LR --data "$DATA")
for log in $(rounds chapter3); do
    step $log ./chapter3 --devices 1 "${CH3_COMMON[@]}" --out "$OUT"
    [ $TORCH = 1 ] && step ${log/chapter3/chapter3.py} "$PYTHON" -u bench/pytorch/chapter3.py "${CH3_COMMON[@]}" \
        --device $TORCH_DEVICE
done
MACS=$(resnet18_macs)
FLOP=$(calc %.6e "2 * 3 * $MACS * $CH3_SAMPLES")
# per-epoch lines on stderr: "  epoch 2/2: loss 0.41, train acc 0.85, test acc 0.86, 5.312 sec"
c_first=$(median $(for log in $(rounds chapter3); do epoch_secs $log 1; done))
c_last=$(median $(for log in $(rounds chapter3); do epoch_secs $log; done))
c_acc=$(value chapter3 's/^test acc: \([0-9.]*\), .*/\1/p')
c_on=$(value chapter3 's/^test acc: .* on \(\[[^]]*\]\).*/\1/p')
ch3_what="$CH3_SAMPLES images, batch $CH3_BATCH; median of $ROUNDS"
row "chapter 3 ResNet-18" "FLOP per epoch ($CH3_SAMPLES images; $(calc %.1f "$MACS / 1e6") M MACs per image)" "$FLOP"
row "chapter 3 mgpu $c_on" "sec/epoch, last (first) epoch; TFLOP/s; test acc ($ch3_what)" \
    "$(or_dash "$c_last") ($(or_dash "$c_first")); $(calc %.3f "$FLOP / $c_last / 1e12"); $(or_dash "$c_acc")" \
    "<= 2.0 s on an H100/H200 at batch 256 (issue 4)"
if [ $TORCH = 1 ]; then
    hook_macs=$(result chapter3.py macs_per_image)
    [ -n "$hook_macs" ] && [ "$hook_macs" != "$MACS" ] &&
        echo "note: chapter3.py counts $hook_macs multiply-adds per image, this script $MACS"
    # torch_epochs KEY VARIANT: the median over the rounds
    torch_epochs() { median $(for log in $(rounds chapter3.py); do result $log "$1" "variant=$2"; done); }
    for v in seed tuned; do
        last=$(torch_epochs last_epoch $v)
        row "chapter 3 PyTorch $v $(result chapter3.py on "variant=$v")" "sec/epoch, last (first) epoch; TFLOP/s; test acc" \
            "$(calc %.2f "$last") ($(calc %.2f "$(torch_epochs first_epoch $v)")); $(calc %.3f "$FLOP / $last / 1e12"); $(calc %.2f "$(result chapter3.py test_acc "variant=$v")")"
    done
    p_seed=$(torch_epochs last_epoch seed) p_tuned=$(torch_epochs last_epoch tuned)
    row "chapter 3" "PyTorch seed / mgpu (last epochs)" "$(calc %.2f "$p_seed / $c_last")" ">= 1.5 on an H100/H200 (issue 4); >= 1.2 on 2 CPU cores (issue 35)"
    row "chapter 3" "PyTorch tuned / mgpu (last epochs)" "$(calc %.2f "$p_tuned / $c_last")" ">= 1.0 on an H100/H200 (issue 4) and on 2 CPU cores (issue 35)"
fi
if [ $ON_GPU = 1 ]; then
    # the same in float32 everywhere: one epoch (the first, so start-up included on both sides)
    CH3_FP32=(--epochs 1 --train-samples $CH3_SAMPLES --test-samples $CH3_TEST
              --batch-size $CH3_BATCH --lr $CH3_LR --data "$DATA")
    step chapter3-fp32 env MGPU_TF32=0 ./chapter3 --devices 1 "${CH3_FP32[@]}" --out "$OUT/fp32"
    c32=$(value chapter3-fp32 's/^  epoch 1\/[0-9]*: .*, \([0-9.]*\) sec$/\1/p')
    row "chapter 3 mgpu, float32 everywhere (MGPU_TF32=0)" "sec/epoch (first epoch); TFLOP/s" \
        "$(or_dash "$c32"); $(calc %.3f "$FLOP / $c32 / 1e12")"
    if [ $TORCH = 1 ]; then
        step chapter3.py-fp32 "$PYTHON" -u bench/pytorch/chapter3.py "${CH3_FP32[@]}" --device $TORCH_DEVICE \
            --variant tuned --tf32 0
        t32=$(result chapter3.py-fp32 first_epoch variant=tuned)
        row "chapter 3 PyTorch tuned, float32 everywhere (--tf32 0)" "sec/epoch (first epoch); TFLOP/s" \
            "$(calc %.2f "$t32"); $(calc %.3f "$FLOP / $t32 / 1e12")"
        row "chapter 3, float32 everywhere" "PyTorch tuned / mgpu (first epochs)" "$(calc %.2f "$t32 / $c32")"
    fi
fi

# ------------------------------------------------------------- profile
step profile ./bench/profile --data "$DATA"
p_ms=$(result profile step_ms)
p_batch=$(result profile batch)
row "ResNet-18 step $(result profile on), batch $(or_dash "$p_batch")" "ms per step; TFLOP/s" \
    "$(calc %.2f "$p_ms"); $(calc %.3f "6 * $MACS * $p_batch / ($p_ms / 1e3) / 1e12")" \
    "an epoch is 235 such steps at batch 256"

# ------------------------------------------------------- convolutions
# A step's convolutions (forward, dx, dW of each, summed with how often
# each occurs): mgpu's im2col, its implicit GEMMs, and cuDNN.
step conv ./bench/convolutions
row "ResNet-18's convolutions $(result conv on), batch $(or_dash "$(result conv batch)")" \
    "ms per step: im2col / implicit, fastest kernels / the faster per pass" \
    "$(calc %.2f "$(result conv im2col_ms)") / $(calc %.2f "$(result conv implicit_ms)") / $(calc %.2f "$(result conv best_ms)")"
if [ $TORCH = 1 ]; then
    step conv.py "$PYTHON" -u bench/pytorch/conv.py --device $TORCH_DEVICE
    row "ResNet-18's convolutions, PyTorch $TORCH_DEVICE$([ $ON_GPU = 1 ] && echo ' (cuDNN, benchmark on)'), batch $(or_dash "$(result conv.py batch)")" \
        "ms per step: NCHW / NHWC / the better per pass" \
        "$(calc %.2f "$(result conv.py nchw_ms)") / $(calc %.2f "$(result conv.py nhwc_ms)") / $(calc %.2f "$(result conv.py best_ms)")"
fi
# The variants out of the product (bench/conv/), each checked and timed
# on its own; their tables are in their logs.
if [ $ON_GPU = 1 ]; then
    for variant in bench/conv/[0-9][0-9]_*.cu; do
        step "$(basename "$variant" .cu)" "${variant%.cu}"
    done
fi

# ------------------------------------------------------------- overlap
step overlap ./bench/overlap --data "$DATA"
row "overlap, ResNet-18 step on $(value overlap 's/^ResNet-18 step on \(\[[^]]*\]\).*/\1/p'), batch $(result overlap batch)" \
    "ms per step: no reduction / after backward / overlapped ($(result overlap algorithm))" \
    "$(calc %.1f "$(result overlap none_ms)") / $(calc %.1f "$(result overlap after_ms)") / $(calc %.1f "$(result overlap overlapped_ms)")"
row "overlap" "overlapped / no reduction" "$(calc %.3f "$(result overlap ratio)")" \
    "<= 1.05 on 2 virtual devices of one GPU (issue 5)"

# ------------------------------------------------------------ checkpoint
step checkpoint ./bench/checkpoint
[ $TORCH = 1 ] && step checkpoint.py "$PYTHON" -u bench/pytorch/checkpoint.py --device $TORCH_DEVICE
row "checkpointing, ResNet-18 step $(result checkpoint on), batch $(result checkpoint batch)" \
    "ms per step: plain / $(result checkpoint runs) runs; activations (MiB)" \
    "$(calc %.1f "$(result checkpoint plain_ms)") / $(calc %.1f "$(result checkpoint checkpointed_ms)"); $(result checkpoint plain_act_mib) / $(result checkpoint checkpointed_act_mib)"
row "checkpointing" "checkpointed / plain" "$(calc %.3f "$(result checkpoint ratio)")" \
    "<= 1.4 at about sqrt(n) runs (chapter 5's issue)"
[ $TORCH = 1 ] && row "checkpointing, PyTorch checkpoint_sequential" "checkpointed / plain" \
    "$(calc %.3f "$(result checkpoint.py ratio)") ($(calc %.1f "$(result checkpoint.py plain_ms)") / $(calc %.1f "$(result checkpoint.py checkpointed_ms)") ms)"

# ------------------------------------------------------------------ zero
step zero ./bench/zero
row "ZeRO, ResNet-18 with Adam $(result zero on), batch $(result zero batch)" \
    "ms per step: DDP / ZeRO-1 / ZeRO-2 / ZeRO-3" \
    "$(calc %.1f "$(result zero ddp_ms)") / $(calc %.1f "$(result zero zero1_ms)") / $(calc %.1f "$(result zero zero2_ms)") / $(calc %.1f "$(result zero zero3_ms)")"
row "ZeRO" "ZeRO-2 / DDP" "$(calc %.3f "$(result zero zero2_ratio)")" "<= 1.1 on the same devices (chapter 5's issue)"
row "ZeRO" "ZeRO-3 / DDP" "$(calc %.3f "$(result zero zero3_ratio)")" "<= 1.3 on the CPU (issue 52)"

# -------------------------------------------------------------- pipeline
# PIPE_SCHEDULES: each schedule's RESULT key in both programs and its name
PIPE_SCHEDULES=(naive:naive gpipe:GPipe one_f_one_b:1F1B zero_bubble:ZB-H1 interleaved:"interleaved 1F1B")
for stages in 2 4; do
    log=pipeline-$stages
    step $log ./bench/pipeline --stages $stages
    ms="" bubbles=""
    for entry in "${PIPE_SCHEDULES[@]}"; do
        key=${entry%%:*}
        ms+="${ms:+ / }$(calc %.1f "$(result $log ${key}_ms)")"
        [ $key = naive ] && continue
        bubbles+="${bubbles:+, }${entry#*:} $(calc %.3f "$(result $log ${key}_bubble)") ($(calc %.3f "$(result $log ${key}_formula)"))"
    done
    row "pipeline, an MLP in $stages stages $(value $log 's/^RESULT pipeline on=\(\[[^]]*\]\).*/\1/p'), batch $(result $log batch)" \
        "ms per step: naive / GPipe / 1F1B / ZB-H1 / interleaved 1F1B ($(result $log chunks) chunks a device), m = $(result $log micro_batches)" "$ms"
    row "pipeline, $stages stages" "bubble, measured (formula)" "$bubbles"
done
row "pipeline, 2 stages" "1F1B (m = 8) / naive throughput" "$(calc %.3f "$(result pipeline-2 one_f_one_b_speedup)")" \
    ">= 1.6 on 2 CPU devices (chapter 6's issue)"
if [ $TORCH = 1 ] && [ $ON_GPU = 0 ]; then
    step pipeline.py "$PYTHON" -u bench/pytorch/pipeline.py
    for entry in "${PIPE_SCHEDULES[@]}"; do
        key=${entry%%:*} mgpu_ms=$(result pipeline-2 ${key}_ms) torch_ms=$(result pipeline.py ${key}_ms)
        figure="ms per step mgpu / PyTorch, time ratio mgpu / PyTorch" speedups=""
        if [ $key != naive ]; then
            figure+="; speed-up over naive mgpu, PyTorch"
            speedups="; $(calc %.3f "$(result pipeline-2 ${key}_speedup)"), $(calc %.3f "$(result pipeline.py ${key}_speedup)")"
        fi
        torch_name=""
        [ $key = zero_bubble ] && torch_name=" (PyTorch's ScheduleInterleavedZeroBubble on the same 2 stages)"
        row "pipeline, 2 stages, ${entry#*:}$torch_name: mgpu beside torch.distributed.pipelining (2 processes, gloo)" \
            "$figure" \
            "$(calc %.1f "$mgpu_ms") / $(calc %.1f "$torch_ms"), $(calc %.3f "$mgpu_ms / $torch_ms")$speedups"
    done
fi

# ------------------------------------------------------------- allreduce
for k in 2 4; do
    step allreduce-$k ./bench/allreduce --devices $k --out "$OUT/allreduce-$k"
    csv=$OUT/allreduce-$k/bench_allreduce.csv
    # columns: bytes,algorithm,time_us,algbw_GBps,busbw_GBps,floor_us,time_over_floor,best_floor_us
    largest=$(tail -n +2 "$csv" 2>/dev/null | cut -d, -f1 | sort -n | tail -n 1)
    for bytes in 67108864 $largest; do
        best=""
        for alg in book ring nccl; do
            line=$(grep "^$bytes,$alg," "$csv" 2>/dev/null) || continue
            IFS=, read -r _ _ us _ busbw _ over best <<<"$line"
            target=""
            [ $alg = ring ] && target="<= 1.25 on 2 and 4 virtual devices of one GPU, >= 64 MiB (issue 5)"
            row "allreduce $k devices, $((bytes >> 20)) MiB" "$alg: time (us), busbw (GB/s), time / its floor" \
                "$(calc %.1f "$us"), $(calc %.2f "$busbw"), $(or_dash "$over")" "$target"
        done
        [ -n "$best" ] && row "allreduce $k devices, $((bytes >> 20)) MiB" \
            "best possible allreduce's floor (us)" "$best"
        [ "$bytes" = "$largest" ] && break
    done
    rate=$(value allreduce-$k 's/^copy rate: \(.*\)/\1/p')
    row "allreduce $k devices $(value allreduce-$k 's/^allreduce on [0-9]* devices \(.*\)/\1/p')" "copy rate" "$(or_dash "$rate")"
done

# ------------------------------------------------------------------ ddp
# The distributed wrapper beside PyTorch's DDP on the CPU (bench/ddp.sh;
# its table is copied below the results table): a short configuration,
# one round of LeNet. `bash bench/ddp.sh` alone runs both models, 3 rounds.
if command -v mpirun >/dev/null; then
    step ddp env DDP_ROUNDS=1 DDP_MODELS=lenet PYTHON="$PYTHON" BENCH_OUT="$OUT" bash bench/ddp.sh
else
    echo "-- ddp: skipped: no mpirun (apt-get install openmpi-bin libopenmpi-dev)"
fi

# --------------------------------------------------------------- results
{
    echo "### make bench: $STAMP, $DEVICE"
    echo
    echo "mgpu $(git describe --always --dirty 2>/dev/null || echo '(no git)'); load average at the start $LOAD;"
    echo "settings: $SETTINGS."
    echo "$TORCH_NOTE. Logs, PNGs and CSVs in $OUT."
    echo
    echo "| workload | figure | value | target |"
    echo "| --- | --- | --- | --- |"
    printf '%s' "$ROWS"
    if grep -q '^operation' "$LOGS/profile.log" 2>/dev/null; then
        echo
        echo "Where a ResNet-18 step's time goes (./bench/profile):"
        echo
        echo '```'
        sed -n '/^ResNet-18 training step/,/^all /p' "$LOGS/profile.log"
        echo '```'
    fi
    if grep -q '^### bench/ddp.sh' "$LOGS/ddp.log" 2>/dev/null; then
        echo
        echo "The distributed wrapper beside PyTorch's DDP (bench/ddp.sh, short):"
        echo
        sed -n '/^### bench\/ddp.sh/,$p' "$LOGS/ddp.log" | tail -n +2
    fi
    for log in conv conv.py; do
        grep -q '^convolution' "$LOGS/$log.log" 2>/dev/null || continue
        echo
        echo "ResNet-18's convolutions one by one ($log):"
        echo
        echo '```'
        grep -v '^RESULT' "$LOGS/$log.log"
        echo '```'
    done
} | tee "$RESULTS"
echo
echo "written to $RESULTS"
