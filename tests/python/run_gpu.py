#!/usr/bin/env python3
"""Runs the Python binding's tests on a GPU host; one PASS / FAIL / SKIP line per test.

    EPD_LIBRARY=/path/to/libepd.so EPD_BIN_DIR=/path/to/bin tests/python/run_gpu.sh

(run_gpu.sh puts EPD_LIBRARY's directory on LD_LIBRARY_PATH and EPD_BIN_DIR on PATH, then runs
this.) What runs:

1. test_gpu: torch CUDA tensors on a cuda-backend epd, bitwise against NumPy on a host-backend
   epd (2 and 4 ranks as processes); DeepEP's intranode test through epd.compat.deep_ep (2, 4
   and 8 ranks, the Buffer by group name and from a torch.distributed process group; over
   daemon- and client-executed groups, the latter at several ranks only under CUDA MPS);
   DeepEP's low-latency test through it (1 rank, and 2 and 8 ranks under CUDA MPS);
   registration cache, stream ordering, caller outputs, capacity, arena, kernel_ns.
   EPD_GPU_REQUIRED=1 is set, so a missing GPU, torch, CUDA libepd or daemon fails instead of
   skipping (--allow-skip keeps skips).
2. test_torch and test_binding: the host paths, under this machine's torch and NumPy
   (--gpu-only leaves them out).
3. examples/moe_worker.py --device cuda at 2 ranks (EXPAND, alignment 4) and 4 ranks
   (NON_EXPAND) (--no-example leaves them out).

Exit 0 when nothing failed, 1 otherwise. -k PATTERN runs only tests whose id contains PATTERN.
"""

import argparse
import os
import subprocess
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


class LineResult(unittest.TestResult):
    """Prints one line per test as it ends, and the traceback of each failure."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.t0 = time.monotonic()
        self.passed = 0

    @staticmethod
    def name(test):
        tid = test.id() if hasattr(test, "id") else str(test)
        return tid.replace("__main__.", "")

    def startTest(self, test):
        super().startTest(test)
        self.t0 = time.monotonic()

    def _line(self, verdict, test, extra=""):
        print("%s %s (%.1f s)%s" % (verdict, self.name(test), time.monotonic() - self.t0, extra),
              flush=True)

    def addSuccess(self, test):
        super().addSuccess(test)
        self.passed += 1
        self._line("PASS", test)

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._line("FAIL", test)
        print(self._exc_info_to_string(err, test), flush=True)

    def addError(self, test, err):
        super().addError(test, err)
        self._line("FAIL", test, " [error]")
        print(self._exc_info_to_string(err, test), flush=True)

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._line("SKIP", test, ": " + reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._line("PASS", test, " (expected failure)")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._line("FAIL", test, " (unexpected success)")


def flatten(suite):
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            yield from flatten(t)
        else:
            yield t


def run_modules(names, pattern):
    loader = unittest.defaultTestLoader
    suite = unittest.TestSuite()
    for name in names:
        for t in flatten(loader.loadTestsFromName(name)):
            if not pattern or pattern in t.id():
                suite.addTest(t)
    result = LineResult()
    suite.run(result)
    return result


def run_example(label, args):
    cmd = [sys.executable, os.path.join(REPO, "examples", "moe_worker.py")] + args
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
        ok = out.returncode == 0 and "PASS" in out.stdout
        text = out.stdout + out.stderr
    except subprocess.TimeoutExpired as e:
        ok, text = False, "timed out after 400 s\n%s" % (e.stdout or "")
    print("%s %s (%.1f s)" % ("PASS" if ok else "FAIL", label, time.monotonic() - t0),
          flush=True)
    lines = [ln for ln in text.splitlines() if ln.startswith("  ")]
    for ln in (lines if ok else text.splitlines()[-60:]):
        print("    " + ln.strip(), flush=True)
    return ok


def _have_gpu():
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def environment():
    sys.path.insert(0, os.path.join(REPO, "client", "python"))
    import epd
    print("python %s (%s)" % (sys.version.split()[0], sys.executable))
    try:
        import numpy
        print("numpy %s" % numpy.__version__)
    except ImportError:
        print("numpy: not installed")
    try:
        import torch
        print("torch %s, CUDA %s, %d GPU(s)%s" % (
            torch.__version__, torch.version.cuda, torch.cuda.device_count(),
            "".join(", %s" % torch.cuda.get_device_name(i)
                    for i in range(torch.cuda.device_count()))))
    except ImportError:
        print("torch: not installed")
    try:
        print("libepd %s" % epd.library_path())
    except OSError as e:
        print("libepd: %s" % e)
    print("epd binary %s" % os.path.join(os.environ.get("EPD_BIN_DIR", "?"), "epd"))
    print("PYTORCH_CUDA_ALLOC_CONF=%s" % os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
          flush=True)


def main():
    p = argparse.ArgumentParser(description="GPU tests of the epd Python binding")
    p.add_argument("-k", dest="pattern", help="only tests whose id contains this")
    p.add_argument("--gpu-only", action="store_true", help="skip the host-path suites")
    p.add_argument("--no-example", action="store_true", help="skip moe_worker.py --device cuda")
    p.add_argument("--allow-skip", action="store_true",
                   help="let the GPU tests skip where no GPU is usable")
    args = p.parse_args()
    if not args.allow_skip:
        os.environ["EPD_GPU_REQUIRED"] = "1"
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.path.insert(0, HERE)
    environment()
    t0 = time.monotonic()
    modules = ["test_gpu"] + ([] if args.gpu_only else ["test_torch", "test_binding"])
    result = run_modules(modules, args.pattern)
    failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
    passed, skipped = result.passed, len(result.skipped)
    if not args.no_example and not args.pattern and args.allow_skip and not _have_gpu():
        print("SKIP moe_worker --device cuda: torch sees no CUDA GPU", flush=True)
        skipped += 1
    elif not args.no_example and not args.pattern:
        for label, ex in (("moe_worker --device cuda --ranks 2 expand",
                           ["--device", "cuda", "--ranks", "2", "--layout", "expand",
                            "--alignment", "4"]),
                          ("moe_worker --device cuda --ranks 4 non_expand",
                           ["--device", "cuda", "--ranks", "4", "--layout", "non_expand"])):
            if run_example(label, ex):
                passed += 1
            else:
                failed += 1
    print("passed %d, failed %d, skipped %d in %.0f s" % (passed, failed, skipped,
                                                          time.monotonic() - t0))
    print("FAIL" if failed else "PASS", flush=True)
    return 1 if failed else 0


# Guarded: the tests start rank processes with multiprocessing's 'spawn', which imports the main
# module again in every child.
if __name__ == "__main__":
    sys.exit(main())
