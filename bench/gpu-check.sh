#!/usr/bin/env bash
# gpu-check.sh - what one short call to a GPU host should run after a change: the GPU test suite
# (including the client-executed tests) and, when a second build is given, the daemon paths of
# both builds interleaved in one run (each daemon under its own build's epd-bench), then the
# client-executed decode and tiny beside the daemon-executed ones with MPS on.
#
#   bench/gpu-check.sh OUT_DIR BUILD_DIR [BEFORE_BUILD_DIR]
#
# BUILD_DIR (and BEFORE_BUILD_DIR) hold bin/epd, bin/epd-bench and the GPU test binaries, built
# with -DEPD_CUDA=ON (-DEPD_STATIC_DEPS=ON for a host without libuv and friends). OUT_DIR gets
# one log per step, the A/B under ab-*/ and summary.txt, and OUT_DIR.tgz of all of it. Each step
# has a time limit (STEP_TIMEOUT, default 240 s; TEST_TIMEOUT for each GPU test, default 300 s),
# so a hang costs one step. Exit: 0 when every step passed.
set -u

out=${1:?usage: gpu-check.sh OUT_DIR BUILD_DIR [BEFORE_BUILD_DIR]}
build=$(cd "${2:?usage: gpu-check.sh OUT_DIR BUILD_DIR [BEFORE_BUILD_DIR]}" && pwd)
before=${3:+$(cd "$3" && pwd)}
here=$(cd "$(dirname "$0")" && pwd)
step_timeout=${STEP_TIMEOUT:-240}
failed=0

mkdir -p "$out"
out=$(cd "$out" && pwd)
: > "$out/summary.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/machine.txt" 2>&1

step() {
        local name=$1 start rc
        shift
        start=$(date +%s)
        timeout -k 5 "$step_timeout" "$@" > "$out/$name.log" 2>&1
        rc=$?
        echo "$name: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"
        [ "$rc" -eq 0 ] || [ "$rc" -eq 77 ] || failed=1
        tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" 2>/dev/null
}

# The GPU suite: every binary of gpu-tests.list (kernels, daemon integration, client-executed).
step gpu-suite "$here/../tests/gpu/run-gpu-tests.sh" -b "$build" -o "$out/gpu" \
        -t "${TEST_TIMEOUT:-300}"

# The daemon paths before and after, interleaved in one run.
if [ -n "$before" ]; then
        mkdir -p "$out/bins"
        ln -sf "$before/bin/epd" "$out/bins/epd-before"
        ln -sf "$build/bin/epd" "$out/bins/epd-after"
        for w in tiny decode prefill; do
                case $w in
                decode) extra=(--flush-l2) ;;
                *) extra=() ;;
                esac
                step "ab-$w" env EPD_BENCH_PAIRED=1 REPS="${REPS:-3}" "$here/ab-daemons.sh" \
                        "$out/ab-$w" "$out/bins/epd-before" "$out/bins/epd-after" -- \
                        --backend cuda --alloc cumem --ranks 8 --workload "$w" "${extra[@]}" \
                        --completion host --iters "${ITERS:-200}"
        done
fi

# Client-executed beside daemon-executed, MPS on (ranks that share a GPU need it).
mps_ctl=$(command -v nvidia-cuda-mps-control || true)
if [ -n "$mps_ctl" ]; then
        export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
        if "$mps_ctl" -d; then
                sleep 1
                for w in decode tiny; do
                        case $w in
                        decode) extra=(--flush-l2) ;;
                        *) extra=() ;;
                        esac
                        for mode in client daemon; do
                                step "$mode-$w-mps" "$build/bin/epd-bench" --backend cuda --json \
                                        --alloc cumem --ranks 8 --workload "$w" "${extra[@]}" \
                                        --execution "$mode" --iters "${ITERS:-200}"
                        done
                done
                echo quit | "$mps_ctl"
        fi
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
else
        echo "mps: nvidia-cuda-mps-control not found, client-executed runs skipped" |
                tee -a "$out/summary.txt"
fi

exit $failed
