"""client/python/pyproject.toml: a wheel builds with pip and setuptools, holds the whole package,
and once installed imports and loads libepd through EPD_LIBRARY. Skipped, with the reason,
where pip or setuptools is missing."""

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PACKAGE = os.path.join(REPO, "client", "python")


def _missing():
    for module in ("pip", "setuptools"):
        if importlib.util.find_spec(module) is None:
            return module
    return None


class TestWheel(unittest.TestCase):

    def setUp(self):
        missing = _missing()
        if missing:
            self.skipTest("%s is not installed for %s" % (missing, sys.executable))
        self.tmp = tempfile.mkdtemp(prefix="epd-wheel-")
        self.addCleanup(shutil.rmtree, self.tmp, True)

    def run_pip(self, *args):
        env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INDEX="1")
        p = subprocess.run([sys.executable, "-m", "pip"] + list(args), env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
        self.assertEqual(p.returncode, 0, p.stdout.decode(errors="replace"))

    def test_wheel_installs_the_package(self):
        # Built from a copy: setuptools writes build/ and *.egg-info next to the sources.
        src = os.path.join(self.tmp, "src")
        shutil.copytree(PACKAGE, src, ignore=shutil.ignore_patterns(
            "__pycache__", "build", "*.egg-info"))
        dist = os.path.join(self.tmp, "dist")
        self.run_pip("wheel", "--no-deps", "--no-build-isolation", "-w", dist, src)
        wheels = glob.glob(os.path.join(dist, "epd-*.whl"))
        self.assertEqual(len(wheels), 1, os.listdir(dist))
        names = set(zipfile.ZipFile(wheels[0]).namelist())
        sources = {os.path.relpath(p, PACKAGE) for p in
                   glob.glob(os.path.join(PACKAGE, "epd", "**", "*.py"), recursive=True)}
        self.assertTrue(sources, "no sources found")
        self.assertEqual(sources - names, set())
        sys.path.insert(0, PACKAGE)
        try:
            import epd
            version = epd.__version__
        finally:
            sys.path.remove(PACKAGE)
        self.assertIn("epd-%s-" % version, os.path.basename(wheels[0]))

        site = os.path.join(self.tmp, "site")
        self.run_pip("install", "--no-deps", "--target", site, wheels[0])
        code = ("import epd, os, sys; f = os.path.realpath(epd.__file__); "
                "assert f.startswith(os.path.realpath(sys.argv[1])), f; "
                "print(epd.library_path())")
        env = dict(os.environ, PYTHONPATH=site)
        p = subprocess.run([sys.executable, "-c", code, site], env=env, cwd=self.tmp,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
        self.assertEqual(p.returncode, 0, p.stdout.decode(errors="replace"))
        if os.environ.get("EPD_LIBRARY"):
            self.assertEqual(os.path.realpath(p.stdout.decode().strip()),
                             os.path.realpath(os.environ["EPD_LIBRARY"]))


if __name__ == "__main__":
    unittest.main()
