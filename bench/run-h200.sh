#!/usr/bin/env bash
# run-h200.sh - the docs/benchmarks.md workloads on the CUDA backend of one H200, with MPS off and on,
# as JSON lines (and each run's human-readable table and log) under an output directory.
#
# Usage: bench/run-h200.sh OUT_DIR [BUILD_DIR]
#   OUT_DIR    created if missing; gets NAME.jsonl (one JSON object per line per result) and
#              NAME.log (the table and progress on stderr) per run, all.jsonl (every run's lines)
#              and summary.txt (one line per result).
#   BUILD_DIR  holds bin/epd and bin/epd-bench built with CUDA (cmake -DEPD_CUDA=ON; add
#              -DEPD_PROBES=ON for bin/epd-floor-probe, and for a machine without libuv,
#              protobuf-c, ... -DEPD_STATIC_DEPS=ON). Default: the repository's build-gpu.
#
# Runs, each with --backend cuda (device memory, client-registered device outputs), 8 ranks on
# GPU 0, --json, first with MPS off, then with MPS on (a private control daemon, quit at the end).
# Worker memory comes from cuMem (--alloc cumem, what epd_device_alloc and PyTorch's expandable
# segments give); with MPS off the two prefill workloads run once more on cudaMalloc memory
# (--alloc cudamalloc, shared through CUDA IPC), for the comparison in docs/performance.md:
#   prefill       fp8, T=4096 (rank r sends T-r), warm L2
#   prefill-bf16  bf16, T=4096, warm L2
#   decode        fp8, T=128, Fresh mode (L2 flushed before every op), host-wait and
#                 stream-ordered completion (--completion both)
#   tiny          bf16, T=8, host-wait and stream-ordered completion
#   tiny-t1       bf16, T=1, the same
# With MPS off and no ONLY, epd-floor-probe as well (floor-probe.jsonl and .log): the decode data's
# bytes with the routing known, the floors docs/performance.md sets the decode targets against.
# A run is limited to RUN_TIMEOUT seconds (default 75) and to what is left of TOTAL_BUDGET
# seconds (default 420) since the script started; no run starts with less than 20 s left. So the
# script ends within about 7.5 minutes even when something hangs (a normal pass takes about 2 to 4
# minutes). ITERS (default 200) sets the measured iterations.
# Not run here: epd-bench --devices 2 (two GPUs) also reports p2p_store_pairs,
# p2p_store_concurrent_gbps and cross_gpu_floor_bytes/_gbps/_fraction_of_p2p (the cross-GPU floor
# against the peer-to-peer store ceiling, docs/benchmarks.md).
#
# Exit: 0 when every run succeeded, 1 otherwise (the logs say why).
set -u

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
out=${1:?usage: run-h200.sh OUT_DIR [BUILD_DIR]}
build=${2:-$repo/build-gpu}
iters=${ITERS:-200}
run_timeout=${RUN_TIMEOUT:-75}
budget=${TOTAL_BUDGET:-420}
bench="$build/bin/epd-bench"
start=$(date +%s)
failed=0

mkdir -p "$out"
out=$(cd "$out" && pwd)
if [ ! -x "$bench" ] || [ ! -x "$build/bin/epd" ]; then
        echo "run-h200: $bench or $build/bin/epd is missing; build with" >&2
        echo "  cmake -S $repo -B $build -DEPD_CUDA=ON && cmake --build $build --target epd-bench" >&2
        exit 1
fi

{
        echo "# run-h200 $(date -u +%FT%TZ) rev $(git -C "$repo" describe --always --dirty 2>/dev/null || echo unknown)"
        echo "# binaries: $("$build/bin/epd" --version 2>&1 | head -1)"
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv 2>&1 || true
        nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv 2>&1 || true
} > "$out/machine.txt"
cat "$out/machine.txt"

# One benchmark run: NAME, then epd-bench's arguments.
run() {
        local name=$1 now rc limit pat match=${ONLY:+0}
        shift
        set -f # the patterns are for names, not files
        for pat in ${ONLY:-}; do
                # shellcheck disable=SC2254
                case "$name" in $pat) match=1 ;; esac
        done
        set +f
        [ "${match:-1}" = 1 ] || return 0
        now=$(date +%s)
        limit=$((start + budget - now))
        [ "$limit" -le "$run_timeout" ] || limit=$run_timeout
        if [ "$limit" -lt 20 ]; then
                echo "run-h200: SKIPPED $name: the ${budget} s budget is spent" | tee -a "$out/summary.txt"
                failed=1
                return
        fi
        echo "run-h200: $name: epd-bench $*" >&2
        timeout -s TERM -k 10 "$limit" "$bench" --backend cuda --json --iters "$iters" \
                --alloc "${alloc:-cumem}" "$@" \
                > "$out/$name.jsonl" 2> "$out/$name.log"
        rc=$?
        echo "run-h200: $name: exit $rc after $(( $(date +%s) - now )) s" >&2
        if [ "$rc" -ne 0 ]; then
                failed=1
                echo "FAILED $name (exit $rc): $(tail -n 3 "$out/$name.log" | tr '\n' ' ')" >> "$out/summary.txt"
                tail -n 20 "$out/$name.log" >&2
        fi
}

workloads() {
        local tag=$1
        run "prefill-$tag" --workload prefill --ranks 8
        run "prefill-bf16-$tag" --workload prefill-bf16 --ranks 8
        run "decode-$tag" --workload decode --ranks 8 --flush-l2 --completion both
        run "tiny-$tag" --workload tiny --ranks 8 --completion both
        run "tiny-t1-$tag" --workload tiny --tokens 1 --ranks 8 --completion both
}

# ---- MPS off: make sure no control daemon of ours is in the environment ----
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
if [ "${MPS:-both}" != on ]; then
        workloads mps-off
        alloc=cudamalloc run prefill-ipc-mps-off --workload prefill --ranks 8
        alloc=cudamalloc run prefill-bf16-ipc-mps-off --workload prefill-bf16 --ranks 8
        # The decode floors of the same machine: the same bytes with the routing known
        # (bench/probes/floor_probe.cu, built with -DEPD_PROBES=ON; a few seconds). Not a
        # result line of all.jsonl.
        if [ -x "$build/bin/epd-floor-probe" ] && [ -z "${ONLY:-}" ]; then
                timeout -s TERM -k 10 60 "$build/bin/epd-floor-probe" --json --reps 100 \
                        > "$out/floor-probe.jsonl" 2> "$out/floor-probe.log" || {
                        echo "run-h200: epd-floor-probe failed: $(tail -n 2 "$out/floor-probe.log" | tr '\n' ' ')" |
                                tee -a "$out/summary.txt"
                        failed=1
                }
        fi
fi

# ---- MPS on: a private control daemon; the benchmark, its daemon and workers inherit the
# pipe directory and so become MPS clients ----
mps_ctl=$(command -v nvidia-cuda-mps-control || true)
[ -n "$mps_ctl" ] || [ ! -x /usr/local/nvidia/bin/nvidia-cuda-mps-control ] ||
        mps_ctl=/usr/local/nvidia/bin/nvidia-cuda-mps-control
if [ "${MPS:-both}" = off ]; then
        :
elif [ -z "$mps_ctl" ]; then
        echo "run-h200: nvidia-cuda-mps-control not found: no MPS runs" | tee -a "$out/summary.txt"
        failed=1
else
        export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
        if "$mps_ctl" -d; then
                sleep 1
                workloads mps-on
                echo quit | "$mps_ctl"
                sleep 2
                cp "$CUDA_MPS_LOG_DIRECTORY"/*.log "$out/" 2>/dev/null || true
        else
                echo "run-h200: nvidia-cuda-mps-control -d failed: no MPS runs" | tee -a "$out/summary.txt"
                failed=1
        fi
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi

cat "$out"/*-mps-*.jsonl > "$out/all.jsonl" 2>/dev/null || true
[ -s "$out/all.jsonl" ] || { echo "run-h200: no results" >&2; exit 1; }
# One line per result; python3 is on the H200 image (it holds PyTorch).
python3 - "$out/all.jsonl" >> "$out/summary.txt" <<'EOF' || true
import json, sys
hdr = ("workload", "tok", "op", "compl", "mps", "alloc", "kern p50", "kern p99", "e2e p50",
       "e2e p99", "e2e max", "ovh p50", "ovh p99", "last p50", "group p50", "log GB/s", "floor GB/s", "floor/d2d",
       "d2d GB/s", "ws/rank MiB")
print("%-13s %4s %-8s %-6s %-3s %-10s" % hdr[:6] + "".join(" %10s" % h for h in hdr[6:]))
def num(v):
    if v is None:
        return float("nan")
    return float(v) if isinstance(v, (int, float)) else v
for line in open(sys.argv[1]):
    line = line.strip()
    if not line:
        continue
    o = json.loads(line)
    o = {k: (num(v) if k.endswith(("_us", "_gbps", "_ceiling", "_per_rank")) else v)
         for k, v in o.items()}
    print("%-13s %4d %-8s %-6s %-3s %-10s" % (o["workload"], o["tokens"], o["op"], o["completion"],
                                           o["mps"], o.get("alloc", "?"))
          + " %10.1f %10.1f %10.1f %10.1f %10.1f %10.1f %10.1f %10.1f %10.1f %10.1f %10.1f %9.1f%% %10.0f %10.2f" % (
              o["kernel_time_p50_us"], o["kernel_time_p99_us"], o["e2e_p50_us"], o["e2e_p99_us"],
              o["e2e_max_us"], o["daemon_overhead_p50_us"], o["daemon_overhead_p99_us"],
              o["daemon_overhead_last_submitter_p50_us"],
              o.get("daemon_overhead_group_p50_us", float("nan")),
              o["logical_gbps"], o["floor_gbps"], 100 * o["floor_fraction_of_ceiling"],
              o["ceiling_d2d_gbps"], o["daemon_workspace_bytes_per_rank"] / 1048576.0))
EOF
cat "$out/summary.txt"
echo "run-h200: done in $(( $(date +%s) - start )) s; results in $out" >&2
exit "$failed"
