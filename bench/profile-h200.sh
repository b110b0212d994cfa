#!/usr/bin/env bash
# profile-h200.sh - the profiles behind docs/performance.md: the kernels in process and through
# the daemon, with Nsight Compute (ncu --clock-control none: the clocks are left as they are),
# and the allocation comparison (cudaMalloc shared as CUDA IPC handles against cuMem fds).
#
# Usage: bench/profile-h200.sh OUT_DIR [BUILD_DIR] [STEP...]
#   OUT_DIR    gets one NAME.log per step and summary.txt
#   BUILD_DIR  a CUDA build (cmake -DEPD_CUDA=ON -DEPD_STATIC_DEPS=ON); default build-gpu
#   STEP       any of: inproc alloc ncu-inproc ncu-prefill ncu-decode ncu-writeback pm-decode
#              pm-prefill (default: all)
#
# Steps:
#   inproc       gpu_kernels_test's realistic prefill, decode and prefill-bf16 cases: the kernels on the
#                test's own allocations, with per-kernel times
#   alloc        epd-bench prefill and prefill-bf16 (8 ranks, MPS off), --alloc cudamalloc
#                and --alloc cumem, ITERS (default 30) iterations each
#   ncu-inproc   ncu on every kernel of gpu_kernels_test's realistic prefill and decode cases
#   ncu-prefill  ncu on the daemon's copy and combine kernels during epd-bench prefill, for
#                both allocations (--target-processes all: the daemon is a child of the bench)
#   ncu-decode   ncu on every kernel of two decode ops through the daemon (durations only)
#   ncu-writeback  DRAM bytes of the decode case's one-launch dispatch and combine in Fresh mode
#                (gpu_kernels_test's time_fresh: 256 MB written before each launch, then the
#                same after a flush that only reads), with ncu leaving the cache alone
#                (--cache-control none): what the write-back of the flush's dirty lines adds
#   pm-decode    Nsight Compute's PM sampling (the PmSampling section: DRAM, L2 and SM activity
#                per sample, one sample per 1.5 us on an H200) of the decode case's one-launch
#                dispatch and combine in Fresh mode, as the daemon runs them (the last 21 launches
#                of each, application replay so that every launch sees the flush before it), printed
#                by bench/pm_timeline.py: where the DRAM works, and where it waits
#   pm-prefill   the same for a few launches of the prefill case's copy and combine kernels
#                (their steady state, against which the decode kernels' body can be read)
# Each step is bounded by STEP_TIMEOUT seconds (default 120).
set -u

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
out=${1:?usage: profile-h200.sh OUT_DIR [BUILD_DIR] [STEP...]}
build=${2:-$repo/build-gpu}
shift $(( $# >= 2 ? 2 : $# ))
steps=${*:-inproc alloc ncu-inproc ncu-prefill ncu-decode ncu-writeback pm-decode pm-prefill}
iters=${ITERS:-30}
step_timeout=${STEP_TIMEOUT:-120}
mkdir -p "$out"
out=$(cd "$out" && pwd)
bin=$build/bin

ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
# Per kernel: time, DRAM bytes both ways and throughput, L2 hit rate, occupancy and the main
# stall reasons; a handful of passes, so kernel replay stays short.
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
metrics=$metrics,dram__throughput.avg.pct_of_peak_sustained_elapsed
metrics=$metrics,lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex.sum
metrics=$metrics,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size
metrics=$metrics,launch__block_size,launch__registers_per_thread
metrics=$metrics,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
metrics=$metrics,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio
metrics=$metrics,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio
metrics=$metrics,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio
metrics=$metrics,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio
metrics=$metrics,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio

step() {
        local name=$1 rc
        shift
        echo "== $name: $*" | tee -a "$out/summary.txt"
        timeout -s TERM -k 10 "$step_timeout" "$@" > "$out/$name.log" 2>&1
        rc=$?
        echo "   exit $rc" | tee -a "$out/summary.txt"
        tail -n 40 "$out/$name.log"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv \
        > "$out/machine.txt" 2>&1
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
# The realistic cases of gpu_kernels_test, by name.
case_no() {
        "$bin/gpu_kernels_test" --list | awk -v pat="$1" 'index($0, pat) { print $1; exit }'
}
prefill=$(case_no "realistic prefill: R 8")
decode=$(case_no "realistic decode")
prefill_bf16=$(case_no "realistic prefill bf16")

for s in $steps; do
        case $s in
        inproc)
                for c in $prefill $decode $prefill_bf16; do
                        step "inproc-$c" "$bin/gpu_kernels_test" --case "$c"
                done
                ;;
        alloc)
                for w in prefill prefill-bf16; do
                        for a in cudamalloc cumem; do
                                step "alloc-$w-$a" "$bin/epd-bench" --backend cuda --ranks 8 \
                                        --iters "$iters" --json --workload "$w" --alloc "$a"
                                grep -h '"op"' "$out/alloc-$w-$a.log" | python3 -c '
import json, sys
for l in sys.stdin:
    o = json.loads(l)
    print("   %-13s %-9s %-10s kernel p50 %8.1f us  floor/d2d %5.1f%%" % (o["workload"], o["op"],
          o.get("alloc", "?"), o["kernel_time_p50_us"], 100 * o["floor_fraction_of_ceiling"]))
' | tee -a "$out/summary.txt"
                        done
                done
                ;;
        ncu-inproc)
                # Every kernel of the first runs: the step sequence twice, the one-block
                # routing and its copy (decode only), combine twice.
                for c in $prefill $decode; do
                        step "ncu-inproc-$c" "$ncu" --clock-control none --metrics "$metrics" \
                                -k regex:'_kernel' --launch-count 12 \
                                "$bin/gpu_kernels_test" --case "$c" --no-timing
                done
                ;;
        ncu-prefill)
                for a in cudamalloc cumem; do
                        step "ncu-prefill-$a" "$ncu" --clock-control none --target-processes all \
                                --metrics "$metrics" -k regex:'copy_kernel|combine_kernel' \
                                --launch-skip 4 --launch-count 4 \
                                "$bin/epd-bench" --backend cuda --ranks 8 --iters 3 --warmup 1 \
                                --workload prefill --alloc "$a"
                done
                ;;
        ncu-decode)
                step ncu-decode "$ncu" --clock-control none --target-processes all \
                        --metrics gpu__time_duration.sum,launch__grid_size,dram__bytes_read.sum,dram__bytes_write.sum \
                        -k regex:'_kernel' --launch-skip 4 --launch-count 6 \
                        "$bin/epd-bench" --backend cuda --ranks 8 --iters 4 --warmup 1 \
                        --workload decode --flush-l2
                ;;
        ncu-writeback)
                # time_fresh runs last: for dispatch then combine, 21 launches after a write
                # flush, then 21 after a read flush (read_flush_kernel before each); then 21 of
                # each as the daemon runs them (write flush, idle GPU, one graph).
                step ncu-writeback "$ncu" --clock-control none --cache-control none --csv \
                        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
                        -k regex:'dispatch_small_kernel|combine_kernel' \
                        "$bin/gpu_kernels_test" --case "$decode"
                python3 - "$out/ncu-writeback.log" <<'PY' | tee -a "$out/summary.txt"
import csv, statistics, sys
rows = {}
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
for r in csv.DictReader(lines):
    key = (r["ID"], r["Kernel Name"].split("<")[0].split("(")[0])
    v = float(r["Metric Value"].replace(",", ""))
    unit = r["Metric Unit"]
    v *= {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "ns": 1e-3, "nsecond": 1e-3,
          "us": 1, "usecond": 1, "ms": 1e3, "msecond": 1e3}.get(unit, 1)
    rows.setdefault(key, {})[r["Metric Name"]] = v
seq = [(k[1], m) for k, m in sorted(rows.items(), key=lambda kv: int(kv[0][0]))]
for name in ("dispatch_small_kernel", "combine_kernel"):
    ks = [m for n, m in seq if n.endswith(name)]
    # time_fresh's last three runs of each kernel, 21 launches each: events around the launch
    # after a write flush, the same after a read flush, then as the daemon (write flush, GPU
    # idle, events and kernel as one graph).
    if len(ks) < 63:
        print("   ncu-writeback: only %d launches of %s" % (len(ks), name))
        continue
    for label, part in (("after a write flush", ks[-63:-42]), ("after a read flush", ks[-42:-21]),
                        ("as the daemon", ks[-21:])):
        med = lambda m: statistics.median(x[m] for x in part)
        print("   %-22s %-20s %6.1f us  DRAM read %6.1f MB  written %6.1f MB" % (
            name, label, med("gpu__time_duration.sum"), med("dram__bytes_read.sum") / 1e6,
            med("dram__bytes_write.sum") / 1e6))
PY
                ;;
        pm-decode|pm-prefill)
                if [ "$s" = pm-decode ]; then
                        c=$decode sel=(-k regex:'dispatch_small_kernel|combine_kernel')
                        kernels="dispatch_small_kernel combine_kernel" last=21
                else
                        c=$prefill sel=(-k regex:'copy_kernel|combine_kernel' --launch-count 6)
                        kernels="copy_kernel combine_kernel" last=0
                fi
                # each profiled launch sets the PM sampler up and reads it back: at least 300 s
                saved=$step_timeout
                step_timeout=$(( step_timeout > 300 ? step_timeout : 300 ))
                step "$s" "$ncu" --clock-control none --cache-control none \
                        --replay-mode application --section PmSampling "${sel[@]}" \
                        -o "$out/$s" -f "$bin/gpu_kernels_test" --case "$c"
                step_timeout=$saved
                "$ncu" --import "$out/$s.ncu-rep" --page raw --csv --print-metric-instances values \
                        > "$out/$s-raw.csv" 2> "$out/$s-import.log"
                for k in $kernels; do
                        python3 "$here/pm_timeline.py" "$out/$s-raw.csv" "$k" "$last" \
                                "$s $k$([ "$last" = 0 ] || echo ", the last $last launches")" \
                                | tee -a "$out/summary.txt"
                done
                ;;
        *)
                echo "profile-h200: unknown step $s" >&2
                ;;
        esac
done
echo "profile-h200: done; logs in $out"
