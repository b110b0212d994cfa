"""bench/layer_loop.py without torch or a GPU: it refuses with a message that says what it
needs (the benchmark itself runs on a GPU host, docs/benchmarks.md)."""

import importlib.util
import os
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench", "layer_loop.py")


class TestLayerLoopRefusal(unittest.TestCase):

    def test_needs_torch_and_cuda(self):
        if importlib.util.find_spec("torch") is not None:
            import torch
            if torch.cuda.is_available():
                self.skipTest("torch with CUDA is here: the benchmark runs for real")
        p = subprocess.run([sys.executable, SCRIPT, "--ranks", "2"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, timeout=120)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertRegex(p.stderr.decode(), r"layer_loop: needs (torch with CUDA|a CUDA GPU)")


if __name__ == "__main__":
    unittest.main()
