#!/usr/bin/env bash
# tests/smoke.sh: runs the chapters the way a student does, on small
# settings, and checks what they print and write; also bad flags.
# Prints "test-summary: P passed, F failed" like the C test programs.
cd "$(dirname "$0")/.."
. tests/check.sh

check chapter1_runs 0 \
    '^dev1 \(cpu\) time: [0-9]+\.[0-9]{4} sec$' '^dev2 \(cpu#1\) time: ' '^dev1 & dev2: ' \
    '^run on dev1 \(cpu\): ' '^copy to host: ' '^run on dev1 \(cpu\) and copy to host: ' \
    'timeline: ' -- $chapters/chapter1 --cpu --size 300 --reps 10 --out "$out/ch1"
if png_ok "$out/ch1/chapter1_timeline.png"; then echo "ok   chapter1_timeline_png"; passed=$((passed + 1));
else echo "FAIL chapter1_timeline_png"; failed=$((failed + 1)); fi
check chapter1_help 0 '--devices' '--size' -- $chapters/chapter1 --help
check chapter1_unknown_flag 1 "^mgpu: error: unknown flag '--bogus' \(try --help\)$" -- $chapters/chapter1 --bogus
check chapter1_bad_number 1 "^mgpu: error: --size: expected a positive whole number, got 'ten'$" -- $chapters/chapter1 --size ten
check chapter1_missing_value 1 "^mgpu: error: --reps needs a value" -- $chapters/chapter1 --reps
check chapter1_trains_nothing 1 "^mgpu: error: --epochs: chapter 1 trains nothing and reads no data" -- $chapters/chapter1 --epochs 7
lacks chapter1_help '--(epochs|batch-size|lr|data) '
check chapter1_number_after_a_space 1 "^mgpu: error: --size: expected a positive whole number, got ' 64'$" -- $chapters/chapter1 --size ' 64'
check chapter1_seed_0 0 '^dev1 \(cpu\) time: ' -- $chapters/chapter1 --cpu --seed 0 --size 64 --reps 2 --out "$out/ch1seed"
check chapter1_negative_seed 1 "^mgpu: error: --seed: expected a whole number of 0 or more, got '-1'$" -- $chapters/chapter1 --seed -1
check chapter1_number_after_a_plus 1 "^mgpu: error: --reps: expected a positive whole number, got '\+2'$" -- $chapters/chapter1 --reps +2
# The environment's settings are read when the library starts, before any work
check chapter1_bad_environment 1 "^mgpu: error: MGPU_CONV=bogus: want rule" -- env MGPU_CONV=bogus $chapters/chapter1 --cpu --size 64 --reps 2
lacks chapter1_bad_environment '^dev1'
check chapter1_two_devices_only 1 "^mgpu: error: --devices 3: chapter 1 compares exactly two devices$" -- $chapters/chapter1 --devices 3

# OpenBLAS on a processor it does not know takes its oldest kernels: a
# stand-in for it reports Prescott's, and the program starts again, once,
# before main, with kernels the processor runs (none better without AVX2
# and FMA: no restart); a coretype the user set is left alone. (The
# first runs unset any coretype the machine's environment sets: it would
# stop the restart.)
blas_shim=$out/prescott.so
printf 'char *openblas_get_corename(void) { return "Prescott"; }\n' | ${CC:-gcc} -shared -fPIC -x c - -o "$blas_shim"
if grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo; then
    want=Haswell
    grep -qw avx512f /proc/cpuinfo && grep -qw avx512bw /proc/cpuinfo && grep -qw avx512vl /proc/cpuinfo &&
        grep -qw avx512dq /proc/cpuinfo && want=SkylakeX
    check blas_kernels_restart 0 \
        "^mgpu: OpenBLAS took its Prescott kernels on a processor with AVX.*; starting again with OPENBLAS_CORETYPE=$want$" \
        '^dev1 \(cpu\) time: ' -- env -u OPENBLAS_CORETYPE LD_PRELOAD="$blas_shim" OPENBLAS_VERBOSE=2 \
        $chapters/chapter1 --cpu --size 64 --reps 2 --out "$out/ch1blas"
    # (OpenBLAS, verbose, names its kernels each time it is loaded: twice)
    if [ "$(grep -c 'starting again' "$out/blas_kernels_restart.log")" = 1 ] &&
        [ "$(grep -c '^Core: ' "$out/blas_kernels_restart.log")" = 2 ]; then
        echo "ok   blas_kernels_restart_once"; passed=$((passed + 1))
    else echo "FAIL blas_kernels_restart_once"; failed=$((failed + 1)); fi
else
    check blas_kernels_nothing_better 0 '^dev1 \(cpu\) time: ' -- \
        env -u OPENBLAS_CORETYPE LD_PRELOAD="$blas_shim" $chapters/chapter1 --cpu --size 64 --reps 2 \
        --out "$out/ch1blas"
    lacks blas_kernels_nothing_better 'starting again'
fi
check blas_kernels_coretype_set 0 '^dev1 \(cpu\) time: ' -- \
    env LD_PRELOAD="$blas_shim" OPENBLAS_CORETYPE=Prescott $chapters/chapter1 --cpu --size 64 --reps 2 --out "$out/ch1blas2"
lacks blas_kernels_coretype_set 'starting again'


# Chapter 2 on a few hundred images: the demos print as in the book, both
# runs print their seed-style line, and the plots are written. 513 images
# in batches of 256 end in a batch of 1 row, which leaves device 1 of the
# 2-device run without rows: that run still trains.
check chapter2_runs 0 \
    '^b1 grad: tensor\(\[0\., 0\.' '^ tensor\(\[\[3\., 3\.\]\], device=.cpu#1.\)$' \
    '^load into \[cpu, cpu#1\]$' \
    '^test acc: [0-9]\.[0-9]{2}, [0-9.]+ sec/epoch, on \[cpu\]$' \
    '^test acc: [0-9]\.[0-9]{2}, [0-9.]+ sec/epoch, on \[cpu, cpu#1\]$' \
    -- $chapters/chapter2 --cpu --train-samples 513 --epochs 2 --out "$out/ch2"
for f in chapter2_test_acc.png chapter2_1_device.png chapter2_2_devices.png chapter2_1_device.csv; do
    if [ -s "$out/ch2/$f" ]; then echo "ok   chapter2_writes_$f"; passed=$((passed + 1));
    else echo "FAIL chapter2_writes_$f"; failed=$((failed + 1)); fi
done
check chapter2_missing_data 1 "^mgpu: error: .*nonexistent.*" -- $chapters/chapter2 --cpu --data /nonexistent
check chapter2_more_samples_than_the_set 1 "^mgpu: error: --train-samples 70000: the training set has 60000 images$" \
    -- $chapters/chapter2 --cpu --train-samples 70000
# --devices 1: one run, not the 1-device run twice
check chapter2_one_device 0 '^test acc: .* on \[cpu\]$' -- $chapters/chapter2 --cpu --devices 1 --train-samples 256 --epochs 1 --out "$out/ch2one"
lacks chapter2_one_device 'on \[cpu, '
if [ "$(grep -c '^test acc' "$out/chapter2_one_device.log")" = 1 ]; then echo "ok   chapter2_one_device_runs_once"; passed=$((passed + 1));
else echo "FAIL chapter2_one_device_runs_once"; failed=$((failed + 1)); fi
# A plot that cannot be written (files limited to 2 KiB here, as a full
# disk would stop them; the write past the limit fails, where SIGXFSZ
# would kill): one line each, no 'plots:' line naming a file that is not
# there, the files of the run before kept whole, and exit status 1. (The
# limit is the chapter's alone: its output goes through a pipe to the
# log, which it would cut short.)
$chapters/chapter2 --cpu --train-samples 256 --epochs 1 --out "$out/ch2full" >/dev/null 2>&1
cp -r "$out/ch2full" "$out/ch2before"
check chapter2_cannot_write 1 '^mgpu: error: .*chapter2_test_acc.png: cannot write PNG \(File too large\)$' \
    -- bash -c "set -o pipefail; ( ulimit -f 2; exec $chapters/chapter2 --cpu --train-samples 256 --epochs 1 --out '$out/ch2full' ) 2>&1 | cat"
lacks chapter2_cannot_write '^plots:'
if diff -r "$out/ch2before" "$out/ch2full" >/dev/null; then echo "ok   chapter2_cannot_write_keeps_the_files_before"; passed=$((passed + 1));
else echo "FAIL chapter2_cannot_write_keeps_the_files_before"; diff -r "$out/ch2before" "$out/ch2full"; failed=$((failed + 1)); fi
check chapter2_bad_lr 1 "^mgpu: error: --lr: expected a positive number, got '-1'$" -- $chapters/chapter2 --lr -1
# Flags are checked before any work: ranges, empty folders, a flag where a
# value should be, an --out that is a file.
check chapter2_lr_beyond_float 1 "^mgpu: error: --lr: 1e300 is out of float's range" -- $chapters/chapter2 --lr 1e300
check chapter2_empty_data 1 "^mgpu: error: --data: expected a folder, got ''$" -- $chapters/chapter2 --data ''
check chapter2_flag_for_a_value 1 "^mgpu: error: --out needs a value \(try --help\)$" -- $chapters/chapter2 --out --cpu
touch "$out/a_file"
check chapter2_out_is_a_file 1 "^mgpu: error: --out $out/a_file: not a folder$" -- $chapters/chapter2 --out "$out/a_file"
check chapter3_too_many_epochs 1 "^mgpu: error: --epochs 5000: at most 4096" -- $chapters/chapter3 --epochs 5000
check chapter3_too_many_devices 1 "^mgpu: error: --devices 17: at most 16 devices$" -- $chapters/chapter3 --devices 17
check chapter4_help_names_values 0 '--model NAME ' '--out DIR ' -- $chapters/chapter4 --help
check chapter3_help_batch_per_device 0 '--batch-size N +batch per device' '--lr X +learning rate of one device' -- $chapters/chapter3 --help
check chapter3_batch_too_large 1 "^mgpu: error: --batch-size 600000000: 4 devices would take a batch of more than 10\^9$" \
    -- $chapters/chapter3 --cpu --batch-size 600000000

# Chapter 3 on a handful of images: three runs (1, 2, 4 devices), the
# memory table, the step timeline, and a training loss that falls.
check chapter3_runs 0 \
    '^test acc: [0-9]\.[0-9]{2}, [0-9.]+ sec/epoch, [0-9]+ images/sec, on \[cpu\] \(gradients: none\)$' \
    '^test acc: [0-9]\.[0-9]{2}, [0-9.]+ sec/epoch, [0-9]+ images/sec, on \[cpu, cpu#1\] \(gradients: ring\)$' \
    '^test acc: .* on \[cpu, cpu#1, cpu#2, cpu#3\] \(gradients: ring\)$' \
    '^  gather on device 0 \(DataParallel\) ' '^  allreduce \(DDP\) ' '^step timeline \(ring' \
    -- $chapters/chapter3 --cpu --train-samples 64 --test-samples 32 --epochs 2 --batch-size 8 --out "$out/ch3"
# the reduced run tests 3 times an epoch (6 points in 2 epochs), and the
# training loss of epoch 2 (x = 2) is below that of epoch 1 (x = 1)
if awk -F, 'NR>1{n++} $1==1{a=$2} $1==2{b=$2} END{exit !(n == 6 && b < a)}' \
       "$out/ch3/chapter3_1_device.csv" 2>/dev/null; then
    echo "ok   chapter3_loss_falls"; passed=$((passed + 1));
else echo "FAIL chapter3_loss_falls"; cat "$out/ch3/chapter3_1_device.csv"; failed=$((failed + 1)); fi
for f in chapter3_test_acc.png chapter3_step_timeline.png chapter3_4_devices.png; do
    if png_ok "$out/ch3/$f"; then echo "ok   chapter3_writes_$f"; passed=$((passed + 1));
    else echo "FAIL chapter3_writes_$f"; failed=$((failed + 1)); fi
done

# Chapter 4 in one process (tests/dist.sh runs it under mpirun). Files
# limited to 16 KiB, less than its checkpoint: one line and exit status 1,
# not a death by SIGXFSZ (status 153), and no .tmp file left.
ch4="--train-samples 512 --test-samples 128 --epochs 1"
check chapter4_file_size_limit 1 \
    '^mgpu: error: .*/chapter4_1proc\.ckpt: cannot write the training checkpoint \(File too large\)$' \
    -- bash -c "set -o pipefail; ( ulimit -f 16; exec $chapters/chapter4 $ch4 --out '$out/ch4limit' ) 2>&1 | cat"
if [ "$(grep -c 'mgpu: error' "$out/chapter4_file_size_limit.log")" = 1 ] &&
    [ -z "$(find "$out/ch4limit" -name '*.tmp')" ]; then
    echo "ok   chapter4_file_size_limit_one_line_no_tmp"; passed=$((passed + 1))
else echo "FAIL chapter4_file_size_limit_one_line_no_tmp"; ls "$out/ch4limit"; failed=$((failed + 1)); fi
# --momentum 0 is the default, as --help says: the same parameters, bit
# for bit; 0.9 others.
check chapter4_momentum_default 0 '^test acc: ' -- $chapters/chapter4 $ch4 --out "$out/ch4m"
for m in 0 0.9; do
    check chapter4_momentum_$m 0 '^test acc: ' -- $chapters/chapter4 $ch4 --momentum $m --out "$out/ch4m"
done
hash_of() { grep -o "parameters' hash [0-9a-f]*" "$out/chapter4_momentum_$1.log"; }
if [ -n "$(hash_of default)" ] && [ "$(hash_of 0)" = "$(hash_of default)" ] && [ "$(hash_of 0.9)" != "$(hash_of default)" ]; then
    echo "ok   chapter4_momentum_0_is_the_default"; passed=$((passed + 1))
else echo "FAIL chapter4_momentum_0_is_the_default: $(hash_of default), $(hash_of 0), $(hash_of 0.9)"; failed=$((failed + 1)); fi
# A CUDA build (it holds the line below) on a machine without a GPU says
# so once a job, in its own words: the driver's would suggest a broken one.
if ! [ -e /dev/nvidia0 ] && ! [ -e /dev/nvidiactl ] && grep -q 'no GPU found' $chapters/chapter4 &&
    command -v mpirun >/dev/null; then
    check chapter4_without_a_gpu 0 '^test acc: ' -- mpirun -np 2 $chapters/chapter4 $ch4 --out "$out/ch4nogpu"
    count chapter4_without_a_gpu 1 '^mgpu: no GPU found: running on the CPU$'
    lacks chapter4_without_a_gpu 'driver|usable'
fi
check chapter4_negative_momentum 1 "^mgpu: error: --momentum: expected a number of 0 or more, got '-0.5'$" \
    -- $chapters/chapter4 --momentum -0.5
check chapter4_more_samples_than_the_set 1 '^mgpu: error: --train-samples 70000: the training set has 60000 images$' \
    -- $chapters/chapter4 --train-samples 70000
check chapter4_batch_past_the_images 1 '^mgpu: error: --batch-size 256: more than the 128 training images$' \
    -- $chapters/chapter4 --train-samples 128 --test-samples 128
check chapter4_too_many_devices_a_process 1 '^mgpu: error: --devices-per-process 17: at most 16 devices$' \
    -- $chapters/chapter4 --devices-per-process 17

# Chapter 5, small: the memory table (P = 11.2 million: 42.6 MiB a copy
# of the parameters), the checkpointing table at k = 1, 2, 3 and 12, the
# largest batches under 170 MiB, checkpointing's the larger, and the
# model's state a device holds under DDP, ZeRO-1 and ZeRO-2 on 4 devices,
# and the closing lines drawn from them.
check chapter5_runs 0 '^  parameters +42\.7 +42\.7 +4P = 42\.6' '^  optimizer state +42\.6 +85\.3 +4P = 42\.6 / 8P = 85\.3$' \
    '^ +1 +[0-9.]+ MiB +[0-9.]+ MiB +[0-9.]+ +1\.00x$' '^ +3 +[0-9.]+ MiB' '^ +12 +[0-9.]+ MiB' \
    '^  without checkpointing +batch [0-9]+$' '^  checkpointed \(sqrt n runs\) batch [0-9]+$' \
    'the first that did not fit said: mgpu: error: out of memory on cpu: asked for .* past its limit of 170\.0 MiB' \
    '^    allreduce \(DDP\) +42\.7 +42\.6 +85\.3 +170\.6 +170\.5 ' '^    ZeRO-1 +42\.7 +42\.6 +21\.3 +106\.6 +106\.6 ' \
    '^    ZeRO-2 +42\.7 +10\.7 +21\.3 +74\.7 +74\.6 ' '^What this run shows:$' \
    -- $chapters/chapter5 --cpu --batch-size 4 --steps 1 --limit-mib 170 --out "$out/ch5"
if awk '/^  without checkpointing/{a=$NF} /^  checkpointed/{b=$NF} END{exit !(a > 0 && b > a)}' \
       "$out/chapter5_runs.log"; then echo "ok   chapter5_checkpointing_fits_a_larger_batch"; passed=$((passed + 1));
else echo "FAIL chapter5_checkpointing_fits_a_larger_batch"; failed=$((failed + 1)); fi
if png_ok "$out/ch5/chapter5_memory_timeline.png"; then echo "ok   chapter5_writes_its_timeline"; passed=$((passed + 1));
else echo "FAIL chapter5_writes_its_timeline"; failed=$((failed + 1)); fi
check chapter5_refuses_epochs 1 '^mgpu: error: --epochs: chapter 5 times steps, not epochs \(--steps\)$' \
    -- $chapters/chapter5 --epochs 3
# It reads no data and draws nothing at random that matters: --data and
# --seed are refused, not ignored, and --help leaves them out.
check chapter5_refuses_data 1 '^mgpu: error: --data: chapter 5 reads no data: its batches are random images$' \
    -- $chapters/chapter5 --data /nonexistent
check chapter5_refuses_seed 1 '^mgpu: error: --seed: chapter 5.s weights and batches are fixed' -- $chapters/chapter5 --seed 3
check chapter5_help 0 '--steps N' '--limit-mib X' -- $chapters/chapter5 --help
lacks chapter5_help '--(data|seed) '
# Bounds, before any work
check chapter5_too_many_steps 1 '^mgpu: error: --steps 1000000000: at most 64$' -- $chapters/chapter5 --steps 1000000000
check chapter5_limit_past_1_tib 1 '^mgpu: error: --limit-mib 2e\+06: want 1 to 1048576 \(MiB: up to 1 TiB\)$' \
    -- $chapters/chapter5 --limit-mib 2000000
lacks chapter5_limit_past_1_tib '^No GPU'

# Chapter 6, small: training in 2 stages, every schedule on 2 and 4
# devices of layers of fixed duration and of the network's (ZB-H1 and
# interleaved 1F1B on those of fixed duration), beside the formula, a
# timeline per schedule, the split layers equal to one device
# with their bytes (the MLP's forward allreduce of Y [32, 10] on 4
# devices: 2 (3/4) 1280 bytes), the hybrid's two copies of the network
# equal, and the run's last lines.
check chapter6_runs 0 '^test acc: [0-9]\.[0-9]{2}, after 1 epoch ' \
    '^  Layers of fixed duration, 2 stages' '^  naive +1 +[0-9.]+ +[0-9.]+ +0\.500 +[0-9.]+ +[0-9.]+$' \
    '^  1F1B +8 +[0-9.]+ +[0-9.]+ +0\.111 ' '^  1F1B +8 +[0-9.]+ +[0-9.]+ +0\.273 ' \
    '^  ZB-H1 +8 +[0-9.]+ +[0-9.]+ +0\.040 ' '^  ZB-H1 +4 +[0-9.]+ +[0-9.]+ +0\.200 ' \
    '^  interleaved +8 +[0-9.]+ +[0-9.]+ +0\.059 ' '^  interleaved +4 +[0-9.]+ +[0-9.]+ +0\.273 ' \
    '^  1F1B +8 +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$' '^  Why: at m = 8 ' \
    '^  Megatron MLP 784->512->10 +4 +[0-9]\.[0-9]e-0[6-9] +1920 +150528 +2442300$' \
    'differ by 0\.0e\+00 after [0-9]+ steps' '^What this run shows:$' \
    -- $chapters/chapter6 --cpu --train-samples 256 --epochs 1 --batch-size 32 --steps 1 --width 8 --out "$out/ch6"
for f in chapter6_test_acc.png chapter6_timeline_naive_2_stages.png chapter6_timeline_GPipe_2_stages.png \
         chapter6_timeline_1F1B_4_stages.png chapter6_timeline_1F1B_2_stages_fixed.png \
         chapter6_timeline_GPipe_4_stages_fixed.png chapter6_timeline_ZB-H1_2_stages_fixed.png \
         chapter6_timeline_interleaved_4_stages_fixed.png; do
    if png_ok "$out/ch6/$f"; then echo "ok   chapter6_writes_$f"; passed=$((passed + 1));
    else echo "FAIL chapter6_writes_$f"; failed=$((failed + 1)); fi
done
check chapter6_more_samples_than_the_set 1 '^mgpu: error: --train-samples 70000: the training set has 60000 images$' \
    -- $chapters/chapter6 --train-samples 70000
check chapter6_refuses_devices 1 '^mgpu: error: --devices: chapter 6 runs on 2 and 4 devices, its stages$' \
    -- $chapters/chapter6 --devices 2


# The README's example program, built the way the README says, with gcc
# (C11, strict warnings, no -D_GNU_SOURCE: the header asks for POSIX) and,
# when there is one, nvcc: a program that uses only what the documentation
# shows compiles and runs.
awk '/^```c$/{on=1; next} /^```$/{on=0} on' README.md > "$out/readme_example.c"
check readme_example_gcc 0 'both: [0-9.]+ sec' \
    -- bash -c "gcc -std=c11 -Wall -Wextra -Werror -I. '$out/readme_example.c' -o '$out/readme_gcc' -lopenblas -lstb -lz -lpthread -lm && '$out/readme_gcc'"
# (nvcc's build in make test-long, TEST_SET=long, with the nvcc-built chapters)
if [ "${TEST_SET:-}" != quick ] && command -v "${NVCC:-/usr/local/cuda/bin/nvcc}" >/dev/null 2>&1; then
    check readme_example_nvcc 0 'both: [0-9.]+ sec' \
        -- bash -c "'${NVCC:-/usr/local/cuda/bin/nvcc}' -x cu -std=c++17 -I. '$out/readme_example.c' -o '$out/readme_nvcc' -lcublas -lnccl -lopenblas -lstb -lz -lpthread -lm && '$out/readme_nvcc'"
fi

# The manual's layer of your own (a leaky ReLU of host loops), as it
# stands there, in a program that trains it on 2 CPU devices.
{
    printf '#define MGPU_IMPLEMENTATION\n#include "mgpu.h"\n'
    awk '/static void leaky_forward\(/{on=1} on{print substr($0, 8)} /static const mgpu_layer_fns leaky_relu/{on=0}' mgpu.h
    cat <<'PROGRAM'
int main(void) {
    mgpu_device *devs[2];
    mgpu_devices(2, 0, devs);
    mgpu_net *net = mgpu_net_new(devs[0]);
    mgpu_net_add_conv(net, 1, 4, 3, 1, 1);
    static float slope = 0.1f;
    mgpu_net_add_layer(net, &leaky_relu, NULL, NULL, &slope);
    mgpu_net_add_global_avg_pool(net);
    mgpu_net_add_linear(net, 4, 10);
    mgpu_data_parallel *dp = mgpu_data_parallel_new(net, devs, 2, MGPU_DP_ALLREDUCE);
    mgpu_tensor *x = mgpu_randn(mgpu_cpu(), mgpu_shape4(8, 1, 8, 8), 0, 1);
    float labels[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    mgpu_tensor *y = mgpu_from_host(mgpu_cpu(), mgpu_shape1(8), labels);
    mgpu_data_parallel_step(dp, x, y, 0.1f, 0, 0);
    double loss, right;
    mgpu_data_parallel_take_stats(dp, &loss, &right);
    printf("%s trained on 2 devices: loss %.3f\n", net->layers[1]->name, loss / 8);
    mgpu_data_parallel_free(dp);
    mgpu_net_free(net);
    mgpu_free(x);
    mgpu_free(y);
    return 0;
}
PROGRAM
} > "$out/manual_layer.c"
check manual_layer_example 0 '^leaky_relu1 trained on 2 devices: loss [0-9]+\.[0-9]{3}$' \
    -- bash -c "gcc -std=c11 -Wall -Wextra -Werror -Wno-unused-parameter -I. '$out/manual_layer.c' -o '$out/manual_layer' -lopenblas -lstb -lz -lpthread -lm && '$out/manual_layer'"

summary
