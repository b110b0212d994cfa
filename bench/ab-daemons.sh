#!/usr/bin/env bash
# ab-daemons.sh - A/B of daemon builds on one machine: each epd binary given runs the same
# epd-bench workload REPS times, the binaries interleaved within each repetition so that a drift of
# the machine touches all of them alike, and the p50 kernel time (and daemon overhead) of each run
# is printed per binary and op. This is how docs/performance.md's "through the daemon" A/B figures
# are taken (decode: --workload decode --flush-l2 --completion host --iters 200, three
# repetitions).
#
#   bench/ab-daemons.sh OUT_DIR EPD_BIN... [-- EPD_BENCH_ARGS...]
#
# OUT_DIR gets one JSON Lines file and one log per binary and repetition (NAME-rREP.jsonl, NAME
# being the binary's file name, so give them distinct names, e.g. symbolic links epd-before and
# epd-after) and summary.txt. epd-bench is the one beside the first binary unless $EPD_BENCH
# names another, or, with EPD_BENCH_PAIRED=1, the one beside each binary's real path. Without arguments after --: the decode A/B above on the CUDA
# backend with 8 ranks. REPS (default 3) and RUN_TIMEOUT (seconds per run, default 120) come from
# the environment. Exits non-zero when a run fails; the summary still lists what ran.
set -u

usage() {
        echo "usage: $0 OUT_DIR EPD_BIN... [-- EPD_BENCH_ARGS...]" >&2
        exit 2
}

[ $# -ge 2 ] || usage
out=$1
shift
bins=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
        bins+=("$1")
        shift
done
[ $# -gt 0 ] && shift
args=("$@")
[ ${#bins[@]} -ge 1 ] || usage
if [ ${#args[@]} -eq 0 ]; then
        args=(--backend cuda --alloc cumem --ranks 8 --workload decode --flush-l2
              --completion host --iters 200)
fi
for b in "${bins[@]}"; do
        [ -x "$b" ] || { echo "ab-daemons: $b is not an executable" >&2; exit 2; }
done
names=()
for b in "${bins[@]}"; do
        n=$(basename "$b")
        for m in "${names[@]}"; do
                [ "$m" != "$n" ] || { echo "ab-daemons: two binaries named $n" >&2; exit 2; }
        done
        names+=("$n")
done
bench=${EPD_BENCH:-$(dirname "${bins[0]}")/epd-bench}
# EPD_BENCH_PAIRED=1: each daemon runs under the epd-bench of its own build (beside the binary the
# path resolves to), for builds whose wire protocols differ.
bench_for() {
        if [ -n "${EPD_BENCH_PAIRED:-}" ]; then
                echo "$(dirname "$(readlink -f "$1")")/epd-bench"
        else
                echo "$bench"
        fi
}
for b in "${bins[@]}"; do
        [ -x "$(bench_for "$b")" ] ||
                { echo "ab-daemons: no epd-bench at $(bench_for "$b") (set EPD_BENCH)" >&2; exit 2; }
done
reps=${REPS:-3}
run_timeout=${RUN_TIMEOUT:-120}
mkdir -p "$out" || exit 2

rc=0
for r in $(seq 1 "$reps"); do
        for i in "${!bins[@]}"; do
                f="$out/${names[$i]}-r$r"
                EPD_BENCH_DAEMON=$(cd "$(dirname "${bins[$i]}")" && pwd)/${names[$i]} \
                        timeout "$run_timeout" "$(bench_for "${bins[$i]}")" --json "${args[@]}" \
                        > "$f.jsonl" 2> "$f.log"
                s=$?
                if [ $s -ne 0 ]; then
                        echo "ab-daemons: ${names[$i]} repetition $r exited $s (log $f.log)" >&2
                        rc=1
                fi
        done
done

python3 - "$out" "$reps" "${names[@]}" <<'PY' | tee "$out/summary.txt"
import json, os, sys

out, reps, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
print("p50 kernel time / last submitter's daemon overhead (us), one pair per repetition")
for n in names:
    rows, revs = {}, set()
    for r in range(1, reps + 1):
        path = os.path.join(out, "%s-r%d.jsonl" % (n, r))
        if not os.path.exists(path):
            continue
        for line in open(path):
            try:
                o = json.loads(line)
            except ValueError:
                continue
            if "kernel_time_p50_us" not in o or "op" not in o:
                continue
            key = (o["op"], o.get("completion", ""))
            ovh = o.get("daemon_overhead_last_submitter_p50_us", float("nan"))
            rows.setdefault(key, []).append("%.2f/%.1f" % (o["kernel_time_p50_us"], ovh))
            revs.add(o.get("git_rev", "?"))
    if not rows:
        print("%-24s no results" % n)
    for (op, compl), vals in sorted(rows.items()):
        print("%-24s %-9s %-7s %s  (%s)" % (n, op, compl, "  ".join(vals), ",".join(sorted(revs))))
PY
exit $rc
