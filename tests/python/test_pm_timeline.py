#!/usr/bin/env python3
"""bench/pm_timeline.py against a synthetic Nsight Compute raw CSV: the launches it picks, the
median launch's window and its body, and its refusals. Usage: test_pm_timeline.py PM_TIMELINE."""
import csv
import os
import subprocess
import sys
import tempfile

PREFIX = "FBSP.TriageCompute."
COLS = ["ID", "Kernel Name", "gpu__time_duration.sum", "profiler__pmsampler_interval_time",
        PREFIX + "dramc__read_throughput.avg.pct_of_peak_sustained_elapsed",
        PREFIX + "dramc__write_throughput.avg.pct_of_peak_sustained_elapsed",
        "LTS.TriageCompute.lts__throughput.avg.pct_of_peak_sustained_elapsed",
        "TPC.TriageCompute.sm__inst_executed_realtime.avg.pct_of_peak_sustained_elapsed"]


def cell(values):
    return "%s (%s)" % (values[0], "; ".join(str(v) for v in values))


def launch(i, name, dur, read, write, sm):
    return [str(i), name, "%.3f" % dur, "1.50 (1.50)", cell(read), cell(write),
            cell([10] * len(read)), cell(sm)]


def run(tool, args):
    p = subprocess.run([sys.executable, tool] + args, capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def main():
    tool = sys.argv[1]
    fails = 0
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "raw.csv")
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(COLS)
            w.writerow([""] * len(COLS))  # the units row
            # an old launch of the kernel that LAST_N must drop, then three: durations 30, 31, 29
            w.writerow(launch(0, "void combine_kernel<1>(a)", 99.0, [0, 50, 0], [0, 0, 0],
                              [0, 5, 0]))
            w.writerow(launch(1, "void other_kernel(b)", 5.0, [0, 1, 0], [0, 0, 0], [0, 1, 0]))
            for i, dur in enumerate((30.0, 31.0, 29.0)):
                read = [0, 0, 10, 70, 72, 71, 40 + i, 5, 0, 0]
                write = [0, 0, 2, 18, 16, 17, 10, 1, 0, 0]
                sm = [0, 0, 20, 30, 35, 36, 30, 4, 0, 0]
                w.writerow(launch(i + 2, "void combine_kernel<1>(a)", dur, read, write, sm))
        rc, out = run(tool, [path, "combine_kernel", "3", "combine"])
        expect = [
            (rc == 0, "exit 0"),
            ("combine: 3 launches, duration median 30.0 us (min 29.0, max 31.0)" in out,
             "picks the last three launches and their median"),
            ("the median launch (30.0 us)" in out, "shows the median launch"),
            # window: one sample before the first SM activity (index 2) to two after the last (7)
            ("DRAM read    0  10  70  72  71  40   5   0" in out, "the read samples of the window"),
            # body: traffic >= 0.8 * 90 = 72 -> samples 3..5 (indices 1..3 of the window)
            ("body: samples 2-4 of the window (3 samples), DRAM read 71% + write 17%" in out,
             "the body and its means"),
            ("1 sample(s) of SM activity before it, 2 after it" in out, "activity around the body"),
        ]
        rc2, out2 = run(tool, [path, "no_such_kernel"])
        expect.append((rc2 == 1 and "no launch" in out2, "exit 1 when no launch matches"))
        empty = os.path.join(d, "empty.csv")
        with open(empty, "w") as f:
            f.write(",".join(COLS) + "\n")
        rc3, out3 = run(tool, [empty, "combine_kernel"])
        expect.append((rc3 == 1 and "no launches" in out3, "exit 1 on a file without launches"))
        rc4, out4 = run(tool, [])
        expect.append((rc4 == 2 and "Usage: pm_timeline.py" in out4,
                       "exit 2 and the usage without arguments"))
        rc5, out5 = run(tool, [path, "combine_kernel", "three"])
        expect.append((rc5 == 2, "exit 2 on a LAST_N that is not a number"))
        other = os.path.join(d, "other.csv")
        with open(other, "w") as f:
            f.write("a,b\n1,2\n3,4\n")
        rc6, out6 = run(tool, [other, "combine_kernel"])
        expect.append((rc6 == 1 and "no Kernel Name column" in out6,
                       "exit 1 on a CSV that is not an ncu export"))
        for ok, what in expect:
            print("%s: %s" % ("ok" if ok else "FAIL", what))
            fails += not ok
        if fails:
            print(out)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
