#!/usr/bin/env python3
"""Runs the Python binding's unittest suite (tests/python/test_*.py) for ctest.

Exits 77, which tests/python.cmake declares as SKIP_RETURN_CODE, when this interpreter has no
NumPy; 0 when every test passed; 1 otherwise. test_gpu.py skips itself without torch and a
GPU; tests/python/run_gpu.sh is the runner for GPU hosts.
"""

import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    try:
        import numpy  # noqa: F401
    except ImportError:
        print("SKIP: NumPy is not installed for %s (Debian: python3-numpy)" % sys.executable)
        return 77
    sys.path.insert(0, HERE)
    suite = unittest.defaultTestLoader.discover(HERE, pattern="test_*.py", top_level_dir=HERE)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    return 0 if result.wasSuccessful() else 1


# Guarded: the GPU tests start rank processes with multiprocessing's 'spawn', which imports
# the main module again in every child.
if __name__ == "__main__":
    sys.exit(main())
