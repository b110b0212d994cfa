#!/usr/bin/env bash
# gpu-check.sh - what one call to a GPU host should run after a change, in order of value, each
# step time-limited:
#
# 1. The GPU test suite (tests/gpu/run-gpu-tests.sh: kernels, daemon integration, the
#    client-executed tests without MPS), beside the hostile-tenant benchmark on the host's spare
#    cores (host backend; it does not touch the GPU).
# 2. With MPS on: gpu_cx_integ again (ranks of several processes on one GPU), the Python GPU
#    tests when BUILD_DIR/lib/libepd.so exists, client-executed beside daemon-executed
#    epd-bench runs of decode, tiny and prefill, and client-executed decode and tiny without the
#    start gate (--start free) for the last rank's wait. These run one at a time: a client-executed
#    kernel needs every rank's blocks resident, so other work on the GPU can make it time out.
# 3. The layer loop (bench/layer_loop.py): client, daemon and floor with MPS on, daemon without.
# 4. With BEFORE_BUILD_DIR: the daemon paths of both builds interleaved in one run (each daemon
#    under its own build's epd-bench), MPS off: decode, tiny and prefill host-waited, decode
#    stream-ordered.
#
#   bench/gpu-check.sh OUT_DIR BUILD_DIR [BEFORE_BUILD_DIR]
#
# BUILD_DIR (and BEFORE_BUILD_DIR) hold bin/epd, bin/epd-bench and the GPU test binaries built with
# -DEPD_CUDA=ON (-DEPD_STATIC_DEPS=ON for a host without libuv and friends);
# scripts/stage-gpu.sh makes such a directory, with lib/libepd.so for the Python tests. OUT_DIR
# gets one log per step, summary.txt, and OUT_DIR.tgz of all of it, rewritten after every step.
# STEP_TIMEOUT (default 240 s) bounds each step, TEST_TIMEOUT (default 300 s) each GPU test, and
# DEADLINE (seconds from the start, default 540) the whole run: steps that would start later are
# skipped and say so. Python needs torch with CUDA (the host's python3). Exit: 0 when every step
# that ran passed.
set -u

out=${1:?usage: gpu-check.sh OUT_DIR BUILD_DIR [BEFORE_BUILD_DIR]}
build=$(cd "${2:?usage: gpu-check.sh OUT_DIR BUILD_DIR [BEFORE_BUILD_DIR]}" && pwd)
before=${3:+$(cd "$3" && pwd)}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
step_timeout=${STEP_TIMEOUT:-240}
deadline=${DEADLINE:-540}
t0=$(date +%s)
failed=0

mkdir -p "$out"
out=$(cd "$out" && pwd)
: > "$out/summary.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/machine.txt" 2>&1
nproc >> "$out/machine.txt"

pack() {
        tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" 2>/dev/null
}

# step NAME [LIMIT] -- CMD...: runs CMD with the smaller of LIMIT and the time left.
step() {
        local name=$1 limit=$step_timeout start rc left
        shift
        if [ "$1" != "--" ]; then
                limit=$1
                shift
        fi
        shift
        start=$(date +%s)
        left=$((deadline - (start - t0)))
        if [ "$left" -lt 15 ]; then
                echo "$name: skipped, the run's deadline is near" | tee -a "$out/summary.txt"
                return
        fi
        [ "$limit" -gt "$left" ] && limit=$left
        timeout -k 5 "$limit" "$@" > "$out/$name.log" 2>&1
        rc=$?
        echo "$name: exit $rc after $(($(date +%s) - start)) s" | tee -a "$out/summary.txt"
        [ "$rc" -eq 0 ] || [ "$rc" -eq 77 ] || failed=1
        pack
}

workload_args() {
        case $1 in
        decode) echo "--workload decode --flush-l2" ;;
        *) echo "--workload $1" ;;
        esac
}

mps_ctl=$(command -v nvidia-cuda-mps-control || true)
mps_on() {
        [ -n "$mps_ctl" ] || return 1
        CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d)
        CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
        export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
        "$mps_ctl" -d || return 1
        sleep 1
}
mps_off() {
        echo quit | "$mps_ctl"
        sleep 1
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

# A cuda-backend daemon for the layer loop, on its own socket.
loop_sock=$(mktemp -u /tmp/epd-gpu-check.XXXXXX)
loop_daemon_pid=
loop_daemon_start() {
        "$build/bin/epd" --backend cuda --socket "$loop_sock" --socket-mode 0666 \
                > "$out/epd-$1.log" 2>&1 &
        loop_daemon_pid=$!
        for _ in $(seq 50); do
                [ -S "$loop_sock" ] && return 0
                sleep 0.1
        done
}
loop_daemon_stop() {
        kill "$loop_daemon_pid" 2>/dev/null
        wait "$loop_daemon_pid" 2>/dev/null
        rm -f "$loop_sock"
}
have_libepd() {
        [ -e "$build/lib/libepd.so" ]
}

# 1. The GPU suite; the hostile-tenant benchmark on the upper half of the cores meanwhile.
ncpu=$(nproc)
if [ "$ncpu" -ge 8 ] && [ -x "$build/bin/epd-soak-hostile" ]; then
        step soak-hostile 300 -- taskset -c "$((ncpu / 2))-$((ncpu - 1))" \
                "$build/bin/epd-soak-hostile" --json &
fi
step gpu-suite -- "$repo/tests/gpu/run-gpu-tests.sh" -b "$build" -o "$out/gpu" \
        -t "${TEST_TIMEOUT:-300}"
wait

# 2. MPS on: what several processes on one GPU need.
if mps_on; then
        step gpu-cx-integ-mps 180 -- "$build/bin/gpu_cx_integ"
        if have_libepd; then
                step python-gpu 300 -- env EPD_LIBRARY="$build/lib/libepd.so" \
                        EPD_BIN_DIR="$build/bin" sh "$repo/tests/python/run_gpu.sh" --gpu-only \
                        --no-example
        fi
        for w in decode tiny prefill; do
                for mode in client daemon; do
                        # shellcheck disable=SC2046
                        step "$mode-$w-mps" 90 -- "$build/bin/epd-bench" --backend cuda --json \
                                --alloc cumem --ranks 8 $(workload_args "$w") \
                                --execution "$mode" --iters "${ITERS:-200}"
                done
        done
        # The last rank's wait without the start gate (its wait-value and host-word poll).
        for w in decode tiny; do
                step "client-$w-free-mps" 90 -- "$build/bin/epd-bench" --backend cuda --json \
                        --alloc cumem --ranks 8 --workload "$w" --no-flush-l2 \
                        --execution client --start free --iters "${ITERS:-200}"
        done
        # 3. The layer loop, MPS on.
        if have_libepd; then
                loop_daemon_start mps
                step layer-loop-mps 240 -- env EPD_LIBRARY="$build/lib/libepd.so" \
                        LD_LIBRARY_PATH="$build/lib:${LD_LIBRARY_PATH:-}" python3 \
                        "$here/layer_loop.py" --socket "$loop_sock" --ranks 8 --json --mps on
                loop_daemon_stop
        fi
        mps_off
else
        echo "mps: not available, the MPS steps are skipped" | tee -a "$out/summary.txt"
fi

# 4. The daemon paths before and after, interleaved in one run, MPS off.
if [ -n "$before" ]; then
        mkdir -p "$out/bins"
        ln -sf "$before/bin/epd" "$out/bins/epd-before"
        ln -sf "$build/bin/epd" "$out/bins/epd-after"
        for wc in decode:host tiny:host prefill:host decode:stream; do
                w=${wc%:*}
                c=${wc#*:}
                # shellcheck disable=SC2046
                step "ab-$w-$c" 150 -- env EPD_BENCH_PAIRED=1 REPS="${REPS:-2}" RUN_TIMEOUT=40 \
                        "$here/ab-daemons.sh" "$out/ab-$w-$c" "$out/bins/epd-before" \
                        "$out/bins/epd-after" -- --backend cuda --alloc cumem --ranks 8 \
                        $(workload_args "$w") --completion "$c" --iters "${ITERS:-200}"
        done
fi

# The layer loop's daemon mode without MPS.
if have_libepd; then
        loop_daemon_start nomps
        step layer-loop-nomps 150 -- env EPD_LIBRARY="$build/lib/libepd.so" \
                LD_LIBRARY_PATH="$build/lib:${LD_LIBRARY_PATH:-}" python3 "$here/layer_loop.py" \
                --socket "$loop_sock" --ranks 8 --json --mode daemon --mps off
        loop_daemon_stop
fi

pack
exit $failed
