#!/usr/bin/env bash
# The GPU check rehearsed without a GPU (bench/gpu_check.sh --rehearse):
# every stage with tiny sizes on the emulated GPUs and the CPU, so that a
# misspelt test name, flag or file fails here, not on a GPU machine's
# scarce minutes. Its last line is the test-summary that tests/run.sh adds up.
cd "$(dirname "$0")/.."
# a flag it does not know is one line and exit status 2, not a folder to fill
out=$(bash bench/gpu_check.sh --help 2>&1)
rc=$?
if [ $rc != 2 ] || [ "$(printf '%s\n' "$out" | wc -l)" != 1 ]; then
    printf 'FAIL bench/gpu_check.sh --help: exit status %s, output:\n%s\n' "$rc" "$out"
    echo "test-summary: 0 passed, 1 failed"
    exit 1
fi
rm -rf build/gpu-check-rehearsal
# (the check picks the tests it runs itself; make test-long's TEST_SET=long
# would leave it only the long ones)
unset TEST_SET
exec bash bench/gpu_check.sh --rehearse build/gpu-check-rehearsal
