#!/usr/bin/env python3
"""pm_timeline.py - a kernel's DRAM, L2 and SM activity over its run, from Nsight Compute's PM
sampling (the PmSampling section), as bench/profile-h200.sh's pm steps collect it.

Usage: pm_timeline.py RAW_CSV KERNEL_SUBSTRING [LAST_N] [LABEL]

RAW_CSV is `ncu --import REPORT --page raw --csv --print-metric-instances values`: one row per
profiled launch, each PM metric's samples between parentheses. Of the launches whose kernel name
contains KERNEL_SUBSTRING, the last LAST_N (default all) are summarised: their median duration,
and for the launch of median duration one line per metric with a value per sample (percent of
the unit's peak; DRAM's peak is the HBM's), from the sample before the kernel's first SM activity
to two samples after its last. Then, for that launch, the body: the samples between the first and
the last sample whose DRAM traffic (read + write) reaches 80% of the launch's highest, with their
mean read and write percentages, and how many samples before the body showed SM activity.

Exit 1 when no launch matches or the file is not such an export or has no PM samples; 2 on bad
arguments.
"""
import csv
import statistics
import sys

METRICS = (
    ("DRAM read", "dramc__read_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("DRAM write", "dramc__write_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("L2", "lts__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("SM inst", "sm__inst_executed_realtime.avg.pct_of_peak_sustained_elapsed"),
)


def num(cell):
    """A plain value as ncu prints it (thousands separated by commas)."""
    return float(cell.replace(",", ""))


def samples(cell):
    """The values between the parentheses of an instanced cell, or None."""
    if "(" not in cell:
        return None
    body = cell[cell.index("(") + 1:cell.rindex(")")]
    return [num(x) for x in body.split(";") if x.strip()]


def main(argv):
    if len(argv) < 3 or len(argv) > 5 or (len(argv) > 3 and not argv[3].isdigit()):
        usage = [l for l in __doc__.splitlines() if l.startswith("Usage:")]
        print(usage[0], file=sys.stderr)
        return 2
    path, want = argv[1], argv[2]
    last = int(argv[3]) if len(argv) > 3 else 0
    label = argv[4] if len(argv) > 4 else want
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f)]
    if len(rows) < 3:
        print("pm_timeline: %s holds no launches" % path, file=sys.stderr)
        return 1
    head = rows[0]
    for need in ("Kernel Name", "gpu__time_duration.sum"):
        if need not in head:
            print("pm_timeline: %s has no %s column (an `ncu --page raw --csv` export?)"
                  % (path, need), file=sys.stderr)
            return 1
    col = {}
    for key, suffix in METRICS:
        hits = [i for i, h in enumerate(head) if h.endswith(suffix)]
        if not hits:
            print("pm_timeline: %s has no PM metric ending in %s" % (path, suffix), file=sys.stderr)
            return 1
        col[key] = hits[0]
    name = head.index("Kernel Name")
    dur = head.index("gpu__time_duration.sum")
    interval = head.index("profiler__pmsampler_interval_time") \
        if "profiler__pmsampler_interval_time" in head else None
    runs = [r for r in rows[2:] if want in r[name]]
    if last:
        runs = runs[-last:]
    if not runs:
        print("pm_timeline: no launch of a kernel named like %s" % want, file=sys.stderr)
        return 1
    times = [num(r[dur]) for r in runs]
    med = statistics.median(times)
    pick = min(runs, key=lambda r: abs(num(r[dur]) - med))
    step = pick[interval].split()[0] if interval is not None else "?"
    print("%s: %d launches, duration median %.1f us (min %.1f, max %.1f); PM sample every %s us"
          % (label, len(runs), med, min(times), max(times), step))
    series = {k: samples(pick[c]) for k, c in col.items()}
    if any(v is None for v in series.values()):
        print("pm_timeline: the launch has no PM samples", file=sys.stderr)
        return 1
    sm = series["SM inst"]
    active = [i for i, v in enumerate(sm) if v > 0.5]
    if not active:
        print("pm_timeline: no SM activity in the median launch", file=sys.stderr)
        return 1
    lo, hi = max(0, active[0] - 1), min(len(sm), active[-1] + 3)
    print("  the median launch (%.1f us), %% of peak per sample:" % num(pick[dur]))
    for key, _ in METRICS:
        print("    %-10s %s" % (key, " ".join("%3d" % round(v) for v in series[key][lo:hi])))
    traffic = [r + w for r, w in zip(series["DRAM read"], series["DRAM write"])]
    top = max(traffic[lo:hi])
    body = [i for i in range(lo, hi) if traffic[i] >= 0.8 * top]
    b0, b1 = body[0], body[-1]
    inner = range(b0, b1 + 1)
    print("  body: samples %d-%d of the window (%d samples), DRAM read %.0f%% + write %.0f%% of"
          " peak on average; %d sample(s) of SM activity before it, %d after it"
          % (b0 - lo, b1 - lo, len(inner),
             statistics.mean(series["DRAM read"][i] for i in inner),
             statistics.mean(series["DRAM write"][i] for i in inner),
             b0 - active[0], active[-1] - b1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
