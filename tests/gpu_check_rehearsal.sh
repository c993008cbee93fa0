#!/usr/bin/env bash
# The GPU check rehearsed without a GPU (bench/gpu_check.sh --rehearse):
# every stage with tiny sizes on the emulated GPUs and the CPU, so that a
# misspelt test name, flag or file fails here, not on a GPU machine's
# scarce minutes. Its last line is the test-summary that tests/run.sh adds up.
cd "$(dirname "$0")/.."
rm -rf build/gpu-check-rehearsal
exec bash bench/gpu_check.sh --rehearse build/gpu-check-rehearsal
