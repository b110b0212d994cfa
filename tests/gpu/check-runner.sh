#!/usr/bin/env bash
# check-runner.sh - checks run-gpu-tests.sh on a fake build directory, with no GPU needed: a
# passing test passes, a failing one fails the run, and a test that hangs is killed after the
# per-test limit (-t) and fails the run instead of hanging it.
#
# Usage: check-runner.sh [RUNNER]   (default: run-gpu-tests.sh beside this script)
set -u

runner=${1:-$(cd "$(dirname "$0")" && pwd)/run-gpu-tests.sh}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fails=0
check() { # description, then a command that must succeed
        local what=$1
        shift
        if "$@"; then
                echo "ok: $what"
        else
                echo "FAILED: $what"
                fails=$((fails + 1))
        fi
}

fake() { # directory, then NAME=BODY pairs: one executable per test, listed in order
        local dir=$1
        shift
        mkdir -p "$dir/bin" "$dir/tests/gpu"
        : > "$dir/tests/gpu/gpu-tests.list"
        for pair in "$@"; do
                printf '#!/bin/sh\n%s\n' "${pair#*=}" > "$dir/bin/${pair%%=*}"
                chmod +x "$dir/bin/${pair%%=*}"
                echo "bin/${pair%%=*}" >> "$dir/tests/gpu/gpu-tests.list"
        done
}

fake "$work/good" "a_gpu_test=exit 0" "b_gpu_test=echo fine; exit 0"
bash "$runner" -b "$work/good" -o "$work/good-out" > "$work/good.log" 2>&1
check "every test passing gives exit 0" [ $? -eq 0 ]
check "the summary names both tests as passed" \
        [ "$(grep -c ': PASS' "$work/good-out/summary.txt")" -eq 2 ]

fake "$work/bad" "a_gpu_test=exit 0" "b_gpu_test=exit 3"
bash "$runner" -b "$work/bad" -o "$work/bad-out" > "$work/bad.log" 2>&1
check "a failing test gives exit 1" [ $? -eq 1 ]
check "the summary names the failure" grep -q 'b_gpu_test: FAIL (exit 3)' \
        "$work/bad-out/summary.txt"

fake "$work/hang" "a_gpu_test=exit 0" "b_gpu_test=exec sleep 30" "c_gpu_test=exit 0"
start=$(date +%s)
bash "$runner" -b "$work/hang" -o "$work/hang-out" -t 2 > "$work/hang.log" 2>&1
rc=$?
secs=$(( $(date +%s) - start ))
check "a hung test gives exit 1" [ $rc -eq 1 ]
check "the hung test is killed after its limit (run took ${secs}s)" [ "$secs" -lt 15 ]
check "the summary says it timed out" grep -q 'b_gpu_test: FAIL (killed after 2s' \
        "$work/hang-out/summary.txt"
check "the tests after it still ran" grep -q 'c_gpu_test: PASS' "$work/hang-out/summary.txt"

EPD_GPU_TEST_TIMEOUT=1 bash "$runner" -b "$work/hang" -o "$work/env-out" > /dev/null 2>&1
check "EPD_GPU_TEST_TIMEOUT sets the limit" grep -q 'b_gpu_test: FAIL (killed after 1s' \
        "$work/env-out/summary.txt"

if [ $fails -ne 0 ]; then
        echo "check-runner: $fails check(s) failed; logs:"
        cat "$work"/*.log
        exit 1
fi
echo "check-runner: all checks passed"
