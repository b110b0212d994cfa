"""Tests of the Python binding (client/python/epd) against a real host-backend epd.

Run by ctest as ``python_binding`` (tests/python.cmake), or by hand::

    EPD_LIBRARY=build/lib/libepd.so PATH=build/bin:$PATH \\
        python3 -m unittest discover -s tests/python -v

The daemon binary is ``epd`` on PATH, else ``build/bin/epd``. Every argument of the binding
is exercised, dispatch and combine outputs are compared bit for bit with an independent NumPy
reference of docs/semantics.md (reference.py), each status code maps to its exception, and the
DeepEP front and the MoE example run at small size.
"""

import concurrent.futures
import contextlib
import ctypes
import importlib.util
import os
import pickle
import re
import shutil
import signal
import socket as socketlib
import subprocess
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import epd  # noqa: E402
from epd import _lib  # noqa: E402
from epd.compat.deep_ep import Buffer, DispatchHandle, EventOverlap  # noqa: E402
from reference import Routing  # noqa: E402

SECRET = b"0123456789abcdef-python-binding"
DAEMON = {}


def find_epd():
    path = shutil.which("epd")
    if path:
        return path
    return os.path.join(REPO, "build", "bin", "epd")


def start_daemon(extra=()):
    workdir = tempfile.mkdtemp(prefix="epd-pytest-")
    sock = os.path.join(workdir, "epd.sock")
    log = open(os.path.join(workdir, "epd.log"), "wb")
    proc = subprocess.Popen([find_epd(), "--backend", "host", "--socket", sock, "--config",
                             "/dev/null"] + list(extra), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_SEQPACKET) as s:
                s.connect(sock)
            return {"proc": proc, "socket": sock, "dir": workdir, "log": log}
        except OSError:
            time.sleep(0.01)
    proc.kill()
    raise RuntimeError("epd did not start: " + open(os.path.join(workdir, "epd.log")).read())


def stop_daemon(d):
    proc = d["proc"]
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    d["log"].close()
    shutil.rmtree(d["dir"], ignore_errors=True)


def setUpModule():
    DAEMON.update(start_daemon())


def tearDownModule():
    if DAEMON:
        stop_daemon(DAEMON)


_names = iter(range(1 << 30))


def unique(prefix):
    return "%s-%d-%d" % (prefix, os.getpid(), next(_names))


class World:
    """R clients, each with one rank of one group; closed by close()."""

    def __init__(self, R, name=None, **cfg):
        cfg.setdefault("num_experts", 4 * R)
        cfg.setdefault("hidden", 64)
        cfg.setdefault("max_tokens_per_rank", 16)
        cfg.setdefault("max_topk", 4)
        cfg.setdefault("op_timeout_ms", 20000)
        self.name = name or unique("g")
        self.clients = [epd.connect(DAEMON["socket"], name="test-%d" % r) for r in range(R)]
        self.groups = [epd.Group.create(self.clients[0], self.name, SECRET, 0, world_size=R,
                                        **cfg)]
        for r in range(1, R):
            self.groups.append(epd.Group.join(self.clients[r], self.name, SECRET, r))
        self.R = R
        self.cfg = cfg

    def close(self):
        for c in self.clients:
            c.close()

    def collective(self, fn):
        """Runs fn(rank, group) -> Future on every rank, then waits them all.

        Returns the results, or the exceptions where a rank failed.
        """
        futs = [fn(r, g) for r, g in enumerate(self.groups)]
        out = []
        for f in futs:
            try:
                out.append(f.wait(timeout=30))
            except epd.Error as e:
                out.append(e)
        return out


def make_inputs(R, E, H, T, K, seed, dtype="bf16", tokens=None, minus_one=0.2,
                topk_dtype=np.int64):
    """Per-rank payloads, scales (fp8), routing (unique experts, some -1) and weights."""
    rng = np.random.default_rng(seed)
    xs, scales, topks, ws = [], [], [], []
    for s in range(R):
        n = T - s if tokens is None else tokens[s]
        if dtype == "bf16":
            xs.append(epd.float_to_bf16(rng.standard_normal((n, H), dtype=np.float32)))
            scales.append(None)
        else:
            xs.append(rng.integers(0, 255, (n, H), dtype=np.uint8))
            scales.append(rng.uniform(0.5, 2, (n, H // 128 if H >= 128 else 1))
                          .astype(np.float32))
        tk = np.stack([rng.permutation(E)[:K] for _ in range(n)]) if n else \
            np.zeros((0, K), np.int64)
        tk = np.where(rng.random((n, K)) < minus_one, -1, tk).astype(topk_dtype)
        if n > 1:
            tk[1] = -1  # a token that goes nowhere
        topks.append(tk)
        ws.append(rng.random((n, K), dtype=np.float32))
    return xs, scales, topks, ws


class TestBf16(unittest.TestCase):
    def test_known_values(self):
        f = np.array([1.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 3.4028235e38,
                      1.00390625, 1.01171875], np.float32)
        # 1 + 2^-8 is a tie: rounds to even (1.0); 1 + 3*2^-8 rounds up to 1 + 2^-6.
        want = [0x3F80, 0x8000, 0x7F80, 0xFF80, 0x7FFF, 0x7FFF, 0x7F80, 0x3F80, 0x3F82]
        self.assertEqual(epd.float_to_bf16(f).tolist(), want)
        self.assertEqual(epd.float_to_bf16(f).dtype, np.uint16)

    def test_round_trip_all_patterns(self):
        bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
        f = epd.bf16_to_float(bits)
        self.assertEqual(f.dtype, np.float32)
        back = epd.float_to_bf16(f)
        nan = np.isnan(f)
        np.testing.assert_array_equal(back[~nan], bits[~nan])
        self.assertTrue(np.all(back[nan] == 0x7FFF))
        np.testing.assert_array_equal(epd.bf16_to_float(bits.view(np.int16)), f)

    def test_matches_libepd(self):
        lib = _lib.load()
        fn = lib.optional.get("epd_float_to_bf16")
        if fn is None:
            self.skipTest("this libepd.so does not export epd_float_to_bf16")
        rng = np.random.default_rng(1)
        vals = np.concatenate([rng.standard_normal(2000).astype(np.float32),
                               rng.integers(0, 2**32, 2000, dtype=np.uint64)
                               .astype(np.uint32).view(np.float32)])
        got = epd.float_to_bf16(vals)
        for v, g in zip(vals, got):
            self.assertEqual(fn(float(v)), int(g))

    def test_rejects_floats_as_bits(self):
        with self.assertRaises(TypeError):
            epd.bf16_to_float(np.zeros(3, np.float16))
        self.assertEqual(epd.round_bf16(np.float32(1.00390625)).item(), 1.0)


class TestLibrary(unittest.TestCase):
    def test_struct_sizes(self):
        # Every mirror matches the library (load() refuses one that does not), and the library
        # knows every structure of the public header.
        lib = _lib.load()
        with open(os.path.join(REPO, "include", "epd.h")) as f:
            header = re.findall(r"^struct (epd_\w+) \{", f.read(), re.M)
        names = [_lib.c_struct_name(cls) for cls in _lib.STRUCTS]
        self.assertGreaterEqual(len(names), 31)
        self.assertLessEqual(set(names), set(header))
        for name in header:
            self.assertGreater(lib.epd_abi_struct_size(name.encode()), 0, name)
        for cls, name in zip(_lib.STRUCTS, names):
            self.assertEqual(ctypes.sizeof(cls), lib.epd_abi_struct_size(name.encode()), name)
        self.assertEqual(lib.epd_abi_struct_size(b"epd_no_such_struct"), 0)

    def test_library_path(self):
        path = epd.library_path()
        self.assertTrue(os.path.exists(path) or os.sep not in path)
        if os.environ.get("EPD_LIBRARY"):
            self.assertEqual(path, os.environ["EPD_LIBRARY"])

    def test_bad_library_path(self):
        env = dict(os.environ, EPD_LIBRARY="/nonexistent/libepd.so")
        code = ("import sys; sys.path.insert(0, %r); import epd\n"
                "try:\n    epd.connect('/nonexistent.sock')\n"
                "except OSError as e:\n    print('OSError', e)\n") % \
            os.path.join(REPO, "client", "python")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=60)
        self.assertIn("OSError", out.stdout)
        self.assertIn("/nonexistent/libepd.so", out.stdout)

    def test_status_names(self):
        self.assertEqual(_lib.status_name(-5), "CAPACITY_EXCEEDED")
        self.assertEqual(_lib.status_name(3), "UNKNOWN")
        self.assertEqual(_lib.text(_lib.load().epd_status_name(-4)), "PERMISSION_DENIED")


class TestErrors(unittest.TestCase):
    def test_classes(self):
        for status in range(-1, -12, -1):
            cls = epd.error_class(status)
            e = cls("msg", status)
            self.assertIsInstance(e, epd.Error)
            self.assertEqual(e.status, status)
            self.assertEqual(e.status_name, _lib.status_name(status))
            self.assertEqual(str(e), "%s: msg" % e.status_name)
            again = pickle.loads(pickle.dumps(e))
            self.assertIs(type(again), cls)
            self.assertEqual((again.status, again.message), (status, "msg"))
        self.assertIs(epd.error_class(-99), epd.Internal)
        self.assertTrue(issubclass(epd.InvalidArgument, ValueError))
        self.assertTrue(issubclass(epd.Timeout, TimeoutError))
        self.assertTrue(issubclass(epd.PermissionDenied, PermissionError))
        self.assertTrue(issubclass(epd.NotFound, LookupError))
        self.assertTrue(issubclass(epd.PeerLost, ConnectionError))
        self.assertIsNone(epd.Timeout("x").errno)


class TestClient(unittest.TestCase):
    def test_connect_info(self):
        with epd.connect(socket=DAEMON["socket"], name="info", timeout_ms=5000) as c:
            info = c.info()
            self.assertEqual(info["backend"], "host")
            self.assertEqual(info["protocol_version"], 2)
            self.assertGreater(info["client_id"], 0)
            self.assertFalse(c.closed)
        self.assertTrue(c.closed)
        with self.assertRaises(epd.Unavailable):
            c.info()
        c.close()  # idempotent

    def test_socket_from_environment(self):
        old = os.environ.get("EPD_SOCKET")
        os.environ["EPD_SOCKET"] = DAEMON["socket"]
        try:
            with epd.Client() as c:
                self.assertEqual(c.info()["backend"], "host")
        finally:
            if old is None:
                del os.environ["EPD_SOCKET"]
            else:
                os.environ["EPD_SOCKET"] = old

    def test_no_daemon(self):
        with self.assertRaises(epd.Unavailable) as cm:
            epd.connect(os.path.join(DAEMON["dir"], "missing.sock"))
        self.assertIn("missing.sock", cm.exception.message)

    def test_version_mismatch(self):
        with self.assertRaises(epd.VersionMismatch) as cm:
            epd.connect(DAEMON["socket"], protocol_version=999)
        self.assertTrue(cm.exception.message)

    def test_size_hint(self):
        with epd.connect(DAEMON["socket"]) as c:
            h = c.size_hint(world_size=4, num_experts=16, hidden=128, max_tokens_per_rank=32,
                            max_topk=8, dtype="bf16", expert_alignment=16)
            self.assertEqual(h["max_rows_non_expand"], 4 * 32)
            self.assertEqual(h["max_rows_expand"], 4 * 32 * 4 + 4 * 15)
            self.assertGreater(h["arena_bytes_expand"], 0)
            h8 = c.size_hint(4, 16, 256, 32, 8, dtype="fp8", scale_block=128)
            self.assertEqual(h8["max_rows_non_expand"], 128)
            with self.assertRaises(epd.InvalidArgument):
                c.size_hint(3, 16, 128, 32, 8)  # 16 experts over 3 ranks

    def test_empty_and_regions(self):
        c = epd.connect(DAEMON["socket"])
        a = epd.empty(c, (3, 5), "bf16")
        self.assertEqual((a.shape, a.dtype), ((3, 5), np.uint16))
        self.assertTrue(np.all(a == 0))
        self.assertEqual(c.empty((7,), "fp8").dtype, np.uint8)
        self.assertEqual(c.empty(4, np.float32).shape, (4,))
        self.assertEqual(c.empty((2, 2), "int64").dtype, np.int64)
        self.assertIsNotNone(c._locate_range(a))
        self.assertIsNotNone(c._locate_range(a[1:, 1:4]))  # a row-strided view
        self.assertIsNone(c._locate_range(a[:, ::2]))
        self.assertIsNone(c._locate_range(np.zeros((3, 5), np.uint16)))
        self.assertTrue(c.release(a))
        self.assertIsNone(c._locate_range(a))
        self.assertFalse(c.release(np.zeros(3)))
        with c.region(1000) as r:
            v = r.array((10, 10), np.float32)
            w = r.array((4,), "int32", offset=400)
            self.assertFalse(r.released)
            self.assertIsNotNone(c._locate_range(w))
            with self.assertRaises(epd.InvalidArgument):
                r.array((2000,), np.float32)
        self.assertTrue(r.released)
        v[:] = 1.0  # the memory outlives the registration
        with self.assertRaises(epd.InvalidArgument):
            c.region(0)
        b = c.empty((4,), np.int32)
        c.close()
        b[:] = 7  # and the connection
        self.assertEqual(b.tolist(), [7] * 4)

    def test_device_alloc_unavailable(self):
        # A host daemon cannot import GPU memory, and a libepd without CUDA cannot allocate
        # it: epd_device_alloc says so (after its argument checks) without touching CUDA.
        lib = _lib.load()
        self.assertIn("epd_device_alloc", lib.optional)
        self.assertIn("epd_device_free", lib.optional)
        with epd.connect(DAEMON["socket"]) as c:
            with self.assertRaises(epd.InvalidArgument):
                c.device_alloc(0)
            with self.assertRaises(epd.Unavailable) as cm:
                c.device_alloc(4096)
            self.assertTrue(cm.exception.message)
            self.assertEqual(c._device_allocs, {})
            if lib.optional["epd_device_alloc"] is not None:
                ptr, rid = ctypes.c_void_p(), ctypes.c_uint64()
                self.assertEqual(lib.epd_device_alloc(c._ptr, 0, 0, ctypes.byref(ptr),
                                                      ctypes.byref(rid)), _lib.INVALID_ARGUMENT)
                self.assertEqual(lib.epd_device_alloc(c._ptr, 0, 64, None, ctypes.byref(rid)),
                                 _lib.INVALID_ARGUMENT)
                self.assertEqual(lib.epd_device_free(c._ptr, None), _lib.OK)
                word = ctypes.c_int()
                self.assertEqual(lib.epd_device_free(c._ptr, ctypes.byref(word)),
                                 _lib.INVALID_ARGUMENT)
                self.assertIn("epd_device_alloc", c.last_error)
            self.assertEqual(c.info()["backend"], "host")  # the connection is unharmed

    def test_locate_among_many_regions(self):
        # Arrays in many regions are found in theirs, at the right offset, before and after a
        # scattered half of the regions is released; arrays outside every region are not.
        with epd.connect(DAEMON["socket"]) as c:
            regions = [c.region(4096 * (1 + i % 3)) for i in range(120)]
            arrays = [r.array((64,), np.uint8, offset=r.nbytes - 64) for r in regions]
            for round_ in range(2):
                for r, a in zip(regions, arrays):
                    if r.released:
                        self.assertIsNone(c._locate_range(a))
                        continue
                    where = c._locate_range(a)
                    self.assertIsNotNone(where)
                    self.assertEqual(where[:2], (r.region_id, r.nbytes - 64))
                    self.assertIsNone(c._locate_range(np.zeros(64, np.uint8)))
                for r in regions[round_::2][::3]:
                    r.release()

    def test_region_released_with_last_array(self):
        c = epd.connect(DAEMON["socket"])
        a = c.empty((16,), np.float32)
        region_id = c._locate_range(a)[0]
        view = a[4:]
        del a
        self.assertIn(region_id, c._ranges)
        del view
        import gc
        gc.collect()
        self.assertNotIn(region_id, c._ranges)
        c.close()


class TestGroups(unittest.TestCase):
    def test_create_join_properties(self):
        w = World(2, num_experts=8, hidden=128, max_tokens_per_rank=12, max_topk=3,
                  dtype="fp8", scale_block=64, arena_bytes=1 << 20, op_timeout_ms=5000)
        try:
            g0, g1 = w.groups
            self.assertEqual((g0.rank, g1.rank), (0, 1))
            self.assertEqual(g0.id, g1.id)
            cfg = g1.config
            self.assertEqual(cfg, {"world_size": 2, "num_experts": 8, "hidden": 128,
                                   "max_tokens_per_rank": 12, "max_topk": 3, "dtype": "fp8",
                                   "scale_block": 64, "op_timeout_ms": 5000,
                                   "arena_bytes": 1 << 20})
            self.assertEqual(g0.num_local_experts, 4)
            self.assertIn("rank=1/2", repr(g1))
        finally:
            w.close()

    def test_wrong_secret(self):
        w = World(2)
        try:
            with epd.connect(DAEMON["socket"]) as c:
                with self.assertRaises(epd.PermissionDenied) as cm:
                    epd.Group.join(c, w.name, b"x" * 16, 1)
                self.assertTrue(cm.exception.message)
        finally:
            w.close()

    def test_not_found_and_exists(self):
        with epd.connect(DAEMON["socket"]) as c:
            with self.assertRaises(epd.NotFound):
                epd.Group.join(c, unique("nope"), SECRET, 1)
            t0 = time.monotonic()
            with self.assertRaises(epd.NotFound):
                epd.Group.join(c, unique("nope"), SECRET, 1, retry_timeout=0.2)
            self.assertGreaterEqual(time.monotonic() - t0, 0.2)
            name = unique("dup")
            g = epd.Group.create(c, name, SECRET, 0, world_size=2, num_experts=2, hidden=64,
                                 max_tokens_per_rank=4, max_topk=1)
            with epd.connect(DAEMON["socket"]) as c2:
                with self.assertRaises(epd.AlreadyExists):
                    epd.Group.create(c2, name, SECRET, 0, world_size=2, num_experts=2,
                                     hidden=64, max_tokens_per_rank=4, max_topk=1)
                with self.assertRaises(epd.AlreadyExists):
                    epd.Group.join(c2, name, SECRET, 0)  # rank 0 is bound
            g.leave()

    def test_bad_config_and_secret(self):
        with epd.connect(DAEMON["socket"]) as c:
            with self.assertRaises(epd.InvalidArgument):
                epd.Group.create(c, unique("short"), b"short", 0, world_size=1, num_experts=2,
                                 hidden=64, max_tokens_per_rank=4, max_topk=1)
            with self.assertRaises(epd.InvalidArgument):
                epd.Group.create(c, unique("bad"), SECRET, 0, world_size=3, num_experts=4,
                                 hidden=64, max_tokens_per_rank=4, max_topk=1)
            with self.assertRaises(epd.InvalidArgument):
                epd.Group.create(c, unique("bad"), SECRET, 0, world_size=1, num_experts=4,
                                 hidden=64, max_tokens_per_rank=4, max_topk=1, dtype="fp16")
            with self.assertRaises(epd.InvalidArgument):
                epd.Group.create(c, unique("bad"), 12345, 0, world_size=1, num_experts=4,
                                 hidden=64, max_tokens_per_rank=4, max_topk=1)

    def test_devices(self):
        with epd.connect(DAEMON["socket"]) as c:
            uuid = c.info()["devices"][0]["uuid"]
            shape = dict(world_size=1, num_experts=2, hidden=64, max_tokens_per_rank=4,
                         max_topk=1)
            with epd.Group.create(c, unique("dev"), SECRET, 0, device_uuid=uuid, **shape):
                pass
            with epd.Group.create(c, unique("dev"), SECRET, 0, device=0, **shape):
                pass
            with self.assertRaises(epd.InvalidArgument):
                epd.Group.create(c, unique("dev"), SECRET, 0, device=99, **shape)
            with self.assertRaises(epd.NotFound):
                epd.Group.create(c, unique("dev"), SECRET, 0, device_uuid="HOST-nope", **shape)

    def test_join_waits_for_create(self):
        name = unique("late")
        with epd.connect(DAEMON["socket"]) as c0, epd.connect(DAEMON["socket"]) as c1:
            box = {}
            th = threading.Thread(target=lambda: box.update(g=epd.Group.join(
                c1, name, SECRET.decode(), 1, retry_timeout=10)))
            th.start()
            time.sleep(0.1)
            with epd.Group.create(c0, name, SECRET.decode(), 0, world_size=2, num_experts=2,
                                  hidden=64, max_tokens_per_rank=4, max_topk=1) as g0:
                th.join(10)
                self.assertEqual(box["g"].rank, 1)
                box["g"].leave()
                box["g"].leave()  # idempotent
                self.assertTrue(box["g"].closed)
            self.assertTrue(g0.closed)
            with self.assertRaises(epd.Unavailable):
                g0.dispatch(np.zeros((1, 64), np.uint16), np.zeros((1, 1), np.int64))


class TestDispatchCombine(unittest.TestCase):
    """Every argument of dispatch and combine, compared with the reference bit for bit."""

    def run_case(self, R=2, layout="non_expand", dtype="bf16", topk_dtype=np.int64,
                 weights=True, alignment=1, zero_padding=False, shared=False, floats=False,
                 use_arena=True, copy_outputs=False, biases=0, apply_weights=False,
                 tokens=None, cached=False, row_padding=0, seed=7, recv_weights=False,
                 source_weights=False):
        E, H, T, K = 4 * R, 128 if dtype == "fp8" else 64, 12, 3
        w = World(R, num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K,
                  dtype=dtype)
        try:
            xs, scales, topks, ws = make_inputs(R, E, H, T, K, seed, dtype, tokens,
                                                topk_dtype=topk_dtype)
            ref = Routing(R, E, T, xs, topks, ws if weights else None, scales=scales,
                          layout=layout, alignment=alignment)

            def x_arg(r):
                x = xs[r]
                if floats:
                    return epd.bf16_to_float(x)  # converted back exactly by the binding
                if shared:
                    big = epd.empty(w.clients[r], (max(1, x.shape[0]), H + row_padding),
                                    x.dtype)
                    big[:x.shape[0], :H] = x
                    return big[:x.shape[0], :H]
                return x

            def dispatch(r, g, handle=None, new_w=None):
                return g.dispatch(
                    x_arg(r), topk_idx=None if handle else topks[r],
                    topk_weights=(new_w[r] if new_w is not None else ws[r]) if weights
                    else None,
                    x_scales=scales[r], handle=handle,
                    expert_alignment=None if handle else alignment,
                    layout=None if handle else layout,
                    zero_padding=None if handle else zero_padding, async_op=True,
                    use_arena=use_arena, copy_outputs=copy_outputs)

            results = w.collective(dispatch)
            for r, res in enumerate(results):
                self.assertIsInstance(res, epd.DispatchResult, res)
                self.check_dispatch(ref, r, res, layout, dtype, topk_dtype, weights,
                                    zero_padding)
            if cached:
                ws2 = [x * 2 for x in ws]
                again = w.collective(lambda r, g: dispatch(r, g, results[r].handle, ws2))
                ref = Routing(R, E, T, xs, topks, ws2 if weights else None, scales=scales,
                              layout=layout, alignment=alignment)
                for r, res in enumerate(again):
                    self.assertIs(res.handle, results[r].handle)
                    self.check_dispatch(ref, r, res, layout, dtype, topk_dtype, weights,
                                        zero_padding)
                results = again
            if dtype != "bf16":
                return
            # Combine: y is a seeded function of the rows; in place in the arena when possible.
            rng = np.random.default_rng(seed + 1)
            ys = [epd.float_to_bf16(rng.standard_normal((res.num_rows, H), np.float32))
                  for res in results]
            bs = [[epd.float_to_bf16(rng.standard_normal((len(xs[r]), H), np.float32))
                   for _ in range(biases)] for r in range(R)]
            # combine's weight inputs: per received row on each destination, per token on
            # each source (docs/semantics.md section 3)
            rws = [rng.standard_normal((res.num_rows, K)).astype(np.float32) for res in results]
            sws = [rng.standard_normal((len(xs[r]), K)).astype(np.float32) for r in range(R)]

            def combine(r, g):
                res = results[r]
                if use_arena and not copy_outputs:
                    res.recv_x[...] = ys[r]
                    y = res.recv_x
                else:
                    y = epd.bf16_to_float(ys[r]) if floats else ys[r]
                bias = None if not biases else (bs[r][0] if biases == 1 else tuple(bs[r]))
                return g.combine(y, res.handle, bias=bias, apply_weights=apply_weights,
                                 async_op=True,
                                 recv_weights=rws[r] if recv_weights else None,
                                 source_weights=sws[r] if source_weights else None)

            out = w.collective(combine)
            for r in range(R):
                self.assertIsInstance(out[r], tuple, out[r])
                combined, cw = out[r]
                want = ref.combine(r, ys, bs[r], apply_weights,
                                   sws[r] if source_weights else None)
                np.testing.assert_array_equal(combined, want)
                if recv_weights:
                    np.testing.assert_array_equal(cw, ref.combined_weights(r, rws))
                elif weights:
                    np.testing.assert_array_equal(cw, ref.combined_weights(r))
                else:
                    self.assertIsNone(cw)
            for res in results:
                with res.handle as h:
                    self.assertFalse(h.released)
                self.assertTrue(res.handle.released)
                res.handle.release()
        finally:
            w.close()

    def check_dispatch(self, ref, r, res, layout, dtype, topk_dtype, weights, zero_padding):
        want = ref.dest(r)
        self.assertEqual(res.layout, layout)
        self.assertEqual(res.num_recv_tokens, want["num_recv_tokens"])
        self.assertEqual(res.num_expanded_rows, want["num_expanded_rows"])
        self.assertEqual(res.num_recv_tokens_per_expert.tolist(), want["per_expert"])
        self.assertEqual(res.num_recv_tokens_per_expert_aligned.tolist(), want["aligned"])
        self.assertEqual(res.num_recv_tokens_per_expert_list, want["aligned"])
        self.assertEqual(res.rank_prefix.tolist(), want["rank_prefix"])
        rows = res.num_rows
        self.assertEqual(res.recv_x.shape[0], rows)
        self.assertEqual(res.recv_x.dtype, np.uint16 if dtype == "bf16" else np.uint8)
        for i, xr in enumerate(ref.recv_x(r)):
            if xr is not None:
                np.testing.assert_array_equal(res.recv_x[i], xr)
            elif zero_padding:
                self.assertTrue(np.all(res.recv_x[i] == 0))
        np.testing.assert_array_equal(res.recv_src, want["recv_src"])
        if dtype == "fp8":
            self.assertEqual(res.recv_x_scales.shape, (rows, res.recv_x.shape[1] // 128))
            for i, row in enumerate(want["rows"]):
                if row is not None:
                    np.testing.assert_array_equal(res.recv_x_scales[i], ref.scales[row[0]][row[1]])
        else:
            self.assertIsNone(res.recv_x_scales)
        if layout == "non_expand":
            self.assertEqual(res.recv_topk_idx.dtype, topk_dtype)
            np.testing.assert_array_equal(res.recv_topk_idx, want["recv_topk_idx"])
            self.assertIsNone(res.recv_topk_slot)
        else:
            self.assertIsNone(res.recv_topk_idx)
            np.testing.assert_array_equal(res.recv_topk_slot, want["recv_topk_slot"])
        if weights:
            self.assertIs(res.recv_topk_weights, res.recv_weights)
            got, exp = res.recv_weights, want["recv_weights"]
            if layout == "expand" and not zero_padding:
                keep = want["recv_src"] >= 0
                got, exp = got[keep], exp[keep]
            np.testing.assert_array_equal(got, exp)
        else:
            self.assertIsNone(res.recv_weights)

    def test_non_expand_bf16(self):
        self.run_case()

    def test_expand_bf16_apply_weights_alignment(self):
        self.run_case(layout="expand", alignment=4, apply_weights=True, biases=2)

    def test_expand_zero_padding_int32_shared(self):
        self.run_case(R=3, layout="expand", alignment=8, zero_padding=True,
                      topk_dtype=np.int32, shared=True, biases=1)

    def test_non_expand_no_weights_floats(self):
        self.run_case(R=3, weights=False, floats=True, tokens=[12, 0, 5])

    def test_client_outputs(self):
        self.run_case(use_arena=False, biases=1)
        self.run_case(layout="expand", use_arena=False, alignment=2, apply_weights=True)

    def test_copy_outputs(self):
        self.run_case(layout="expand", copy_outputs=True)

    def test_cached(self):
        self.run_case(cached=True, shared=True)
        self.run_case(layout="expand", cached=True, apply_weights=True, use_arena=False)

    def test_row_strided_input(self):
        self.run_case(shared=True, row_padding=8)

    def test_fp8(self):
        self.run_case(dtype="fp8")
        self.run_case(dtype="fp8", layout="expand", alignment=4, zero_padding=True,
                      shared=True, use_arena=False)

    def test_single_rank(self):
        self.run_case(R=1, layout="expand", apply_weights=True)

    def test_recv_weights(self):
        self.run_case(recv_weights=True, biases=1)
        self.run_case(R=3, weights=False, recv_weights=True, tokens=[12, 0, 5])
        self.run_case(recv_weights=True, cached=True, use_arena=False)

    def test_source_weights(self):
        self.run_case(layout="expand", alignment=2, apply_weights=True, source_weights=True,
                      weights=False, biases=1)
        self.run_case(R=3, layout="expand", zero_padding=True, apply_weights=True,
                      source_weights=True, use_arena=False)

    def test_combine_out_and_unpacking(self):
        w = World(2)
        try:
            xs, _, topks, ws = make_inputs(2, 8, 64, 16, 2, 3)
            res = w.collective(lambda r, g: g.dispatch(xs[r], topks[r], ws[r], async_op=True))
            x, idx, wts, counts, handle = res[0]
            self.assertIs(x, res[0].recv_x)
            self.assertIs(handle, res[0].handle)
            self.assertEqual(counts, res[0].num_recv_tokens_per_expert_list)
            self.assertIn("rows=", repr(res[0]))
            self.assertIn("handle", repr(res[0].handle).lower())
            outs = [w.clients[0].empty((len(xs[0]), 64), "bf16"),
                    np.zeros((len(xs[1]), 64), np.uint16)]
            got = w.collective(lambda r, g: g.combine(res[r].recv_x, res[r].handle,
                                                      out=outs[r], async_op=True))
            for r in range(2):
                self.assertIs(got[r][0], outs[r])
                self.assertTrue(np.any(outs[r] != 0))
            # The blocking form, from threads (every rank must take part).
            with concurrent.futures.ThreadPoolExecutor(2) as ex:
                blocking = list(ex.map(lambda r: w.groups[r].combine(
                    res[r].recv_x, res[r].handle), range(2)))
            for r in range(2):
                np.testing.assert_array_equal(blocking[r][0], outs[r])
        finally:
            w.close()


class TestAsync(unittest.TestCase):
    def test_wait_timeout_then_complete(self):
        w = World(2)
        try:
            xs, _, topks, ws = make_inputs(2, 8, 64, 16, 2, 5)
            f0 = w.groups[0].dispatch(xs[0], topks[0], ws[0], async_op=True)
            self.assertFalse(f0.done())
            with self.assertRaises(epd.Timeout) as cm:
                f0.wait(timeout=0.05)
            self.assertTrue(cm.exception.op_pending)
            try:
                f0.stream_wait(0)
            except epd.StreamWaitUnavailable as e:
                self.assertIsInstance(e, NotImplementedError)
                self.assertIsInstance(e, epd.Unavailable)
            f1 = w.groups[1].dispatch(xs[1], topks[1], ws[1], async_op=True)
            r0, r1 = f0.wait(), f1.wait(timeout=10)
            self.assertTrue(f0.done())
            self.assertIs(f0.wait(), r0)  # a completed future answers again
            f0.stream_wait(0)  # completed: nothing to wait for
            self.assertIn("done", repr(f0))
            self.assertEqual(r0.handle.id, r1.handle.id)
        finally:
            w.close()

    def test_close_abandons_pending(self):
        w = World(2)
        xs, _, topks, ws = make_inputs(2, 8, 64, 16, 2, 5)
        f0 = w.groups[0].dispatch(xs[0], topks[0], async_op=True)
        w.clients[0].close()
        with self.assertRaises(epd.Unavailable):
            f0.wait()
        w.close()


class TestOpErrors(unittest.TestCase):
    """Each collective failure reaches every rank as the same exception."""

    def expect_all(self, results, cls, *fragments):
        for r, res in enumerate(results):
            self.assertIsInstance(res, cls, "rank %d: %r" % (r, res))
            for f in fragments:
                self.assertIn(f, res.message)

    def test_capacity_arena(self):
        w = World(2, arena_bytes=4096, hidden=256)
        try:
            xs, _, topks, ws = make_inputs(2, 8, 256, 16, 4, 9, minus_one=0)
            res = w.collective(lambda r, g: g.dispatch(xs[r], topks[r], ws[r], async_op=True))
            self.expect_all(res, epd.CapacityExceeded, "rows")
            self.assertEqual(res[0].status, _lib.CAPACITY_EXCEEDED)
        finally:
            w.close()

    def test_capacity_client_outputs(self):
        w = World(2)
        try:
            xs, _, topks, ws = make_inputs(2, 8, 64, 16, 2, 9, minus_one=0)
            res = w.collective(lambda r, g: g.dispatch(xs[r], topks[r], ws[r], async_op=True,
                                                       use_arena=False, recv_capacity=1))
            self.expect_all(res, epd.CapacityExceeded, "capacity")
        finally:
            w.close()

    def test_bad_topk(self):
        w = World(2)
        try:
            xs, _, topks, ws = make_inputs(2, 8, 64, 16, 2, 9)
            bad = [t.copy() for t in topks]
            bad[1][0, 0] = 8  # expert 8 of 8
            res = w.collective(lambda r, g: g.dispatch(xs[r], bad[r], async_op=True))
            self.expect_all(res, epd.InvalidArgument)
            dup = [t.copy() for t in topks]
            dup[0][2] = [3, 3]
            res = w.collective(lambda r, g: g.dispatch(xs[r], dup[r], async_op=True))
            self.expect_all(res, epd.InvalidArgument)
            wide = [np.zeros((len(xs[r]), 5), np.int64) for r in range(2)]  # K 5 > max_topk
            res = w.collective(lambda r, g: g.dispatch(xs[r], wide[r], async_op=True))
            self.expect_all(res, epd.InvalidArgument)
            cols = [x[:, :32] for x in xs]  # hidden 32, the group's is 64
            res = w.collective(lambda r, g: g.dispatch(cols[r], topks[r], async_op=True))
            self.expect_all(res, epd.InvalidArgument, "x")
            # The group still works afterwards.
            res = w.collective(lambda r, g: g.dispatch(xs[r], topks[r], async_op=True))
            self.assertIsInstance(res[0], epd.DispatchResult)
        finally:
            w.close()

    def test_combine_errors(self):
        w = World(2)
        try:
            xs, _, topks, ws = make_inputs(2, 8, 64, 16, 2, 9)
            res = w.collective(lambda r, g: g.dispatch(xs[r], topks[r], ws[r], async_op=True))
            out = w.collective(lambda r, g: g.combine(res[r].recv_x, res[r].handle,
                                                      apply_weights=True, async_op=True))
            self.expect_all(out, epd.InvalidArgument, "apply_weights")
            wide = [np.zeros((res[r].num_rows, 3), np.float32) for r in range(2)]  # K is 2
            out = w.collective(lambda r, g: g.combine(res[r].recv_x, res[r].handle,
                                                      recv_weights=wide[r], async_op=True))
            self.expect_all(out, epd.InvalidArgument, "recv_weights")
            long = [np.zeros((len(xs[r]) + 1, 2), np.float32) for r in range(2)]
            out = w.collective(lambda r, g: g.combine(res[r].recv_x, res[r].handle,
                                                      source_weights=long[r], async_op=True))
            self.expect_all(out, epd.InvalidArgument, "source_weights")
            for x in res:
                x.handle.release()
            out = w.collective(lambda r, g: g.combine(res[r].recv_x, res[r].handle,
                                                      async_op=True))
            self.expect_all(out, epd.NotFound)
        finally:
            w.close()

    def test_timeout(self):
        w = World(2, op_timeout_ms=300)
        try:
            xs, _, topks, ws = make_inputs(2, 8, 64, 16, 2, 9)
            t0 = time.monotonic()
            with self.assertRaises(epd.Timeout) as cm:
                w.groups[0].dispatch(xs[0], topks[0])
            self.assertFalse(cm.exception.op_pending)
            self.assertLess(time.monotonic() - t0, 10)
            self.assertTrue(cm.exception.message)
        finally:
            w.close()

    def test_peer_lost(self):
        w = World(2)
        try:
            xs, _, topks, ws = make_inputs(2, 8, 64, 16, 2, 9)
            f0 = w.groups[0].dispatch(xs[0], topks[0], async_op=True)
            time.sleep(0.05)
            w.clients[1].close()
            with self.assertRaises(epd.PeerLost):
                f0.wait(timeout=10)
        finally:
            w.close()

    def test_local_argument_errors(self):
        w = World(1)
        try:
            g = w.groups[0]
            x = np.zeros((2, 64), np.uint16)
            with self.assertRaises(epd.InvalidArgument):
                g.dispatch(x)  # no topk_idx, no handle
            with self.assertRaises(epd.InvalidArgument):
                g.dispatch(x, np.zeros((2, 1), np.float32))
            with self.assertRaises(epd.InvalidArgument):
                g.dispatch(np.zeros((2, 64), np.int32), np.zeros((2, 1), np.int64))
            with self.assertRaises(epd.InvalidArgument):
                g.dispatch(x, np.zeros((2, 1), np.int64), layout="diagonal")
            with self.assertRaises(epd.InvalidArgument):
                g.dispatch(x, np.zeros((2, 1), np.int64), topk_weights=np.array([["a"]]))
            res = g.dispatch(x, np.zeros((2, 1), np.int8), layout=epd.EXPAND)  # int8 -> int64
            self.assertEqual(res.num_expanded_rows, 2)
            with self.assertRaises(epd.InvalidArgument):
                g.dispatch(x, np.zeros((2, 1), np.int64), handle=res.handle)
            with self.assertRaises(epd.InvalidArgument):
                g.combine(res.recv_x, res.handle, bias=(x, x, x))
            with self.assertRaises(epd.InvalidArgument):
                g.combine(res.recv_x, "not a handle")
            with self.assertRaises(epd.InvalidArgument):
                g.combine(res.recv_x, res.handle, out=np.zeros((3, 64), np.uint16))
        finally:
            w.close()


@contextlib.contextmanager
def socket_in_environment():
    """$EPD_SOCKET names the test daemon while the block runs."""
    old = os.environ.get("EPD_SOCKET")
    os.environ["EPD_SOCKET"] = DAEMON["socket"]
    try:
        yield
    finally:
        if old is None:
            del os.environ["EPD_SOCKET"]
        else:
            os.environ["EPD_SOCKET"] = old


class ThreadGroup:
    """A process group of threads of this process: rank(), size() and
    all_gather_object(obj), what epd.compat.deep_ep.Buffer needs of a torch.distributed
    group. ``calls[r]`` counts rank r's collectives."""

    def __init__(self, shared, rank):
        self.shared, self.r = shared, rank

    @classmethod
    def world(cls, R):
        shared = {"barrier": threading.Barrier(R, timeout=60), "slots": [None] * R,
                  "calls": [0] * R}
        return [cls(shared, r) for r in range(R)]

    def rank(self):
        return self.r

    def size(self):
        return len(self.shared["slots"])

    def all_gather_object(self, obj):
        sh = self.shared
        sh["slots"][self.r] = obj
        sh["barrier"].wait()
        out = list(sh["slots"])
        sh["barrier"].wait()
        sh["calls"][self.r] += 1
        return out


class MpiLikeComm:
    """One rank of an mpi4py-style communicator (Get_rank, Get_size, allgather)."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def allgather(self, obj):
        return [obj]


class TestDeepEPCompat(unittest.TestCase):
    """DeepEP's normal mode through epd.compat.deep_ep over daemon-executed groups
    (TestDeepEPCompatClient: the same over client-executed groups)."""

    EXECUTION = "daemon"

    def buffers(self, R, max_topk=4, **kw):
        name = unique("deepep")
        kw.setdefault("num_experts", 4 * R)
        kw.setdefault("hidden", 64)
        kw.setdefault("execution", self.EXECUTION)
        bufs = [Buffer(name, rank=0, secret=SECRET, socket=DAEMON["socket"], world_size=R,
                       max_tokens_per_rank=16, max_topk=max_topk, **kw)]
        local = {k: kw[k] for k in ("execution", "copy_outputs") if k in kw}
        for r in range(1, R):
            bufs.append(Buffer(name, rank=r, secret=SECRET, socket=DAEMON["socket"], **local))
        for b in bufs:
            self.assertEqual(b.execution, kw["execution"] or "client")
        return bufs

    def parallel(self, bufs, fn):
        with concurrent.futures.ThreadPoolExecutor(len(bufs)) as ex:
            return list(ex.map(lambda r: fn(r, bufs[r]), range(len(bufs))))

    def test_layout_dispatch_combine(self):
        R, E, H, T, K = 2, 8, 64, 16, 3
        bufs = self.buffers(R)
        try:
            xs, _, topks, ws = make_inputs(R, E, H, T, K, 21)
            ref = Routing(R, E, T, xs, topks, ws)
            for r in range(R):
                ntr, nrdma, nte, in_rank, ev = bufs[r].get_dispatch_layout(topks[r], E)
                self.assertIsNone(nrdma)
                self.assertIsInstance(ev, EventOverlap)
                ev.current_stream_wait()  # nothing to wait for
                dest = np.where(topks[r] >= 0, topks[r] // (E // R), -1)
                want_in = np.stack([(dest == d).any(1) for d in range(R)], axis=1)
                np.testing.assert_array_equal(in_rank, want_in)
                np.testing.assert_array_equal(ntr, want_in.sum(0))
                np.testing.assert_array_equal(
                    nte, np.bincount(topks[r][topks[r] >= 0], minlength=E))
                self.assertEqual((ntr.dtype, nte.dtype, in_rank.dtype),
                                 (np.int32, np.int32, bool))
            with self.assertRaises(epd.InvalidArgument):
                bufs[0].get_dispatch_layout(topks[0], E + 1)

            def dispatch(r, b):
                ntr, _, nte, in_rank, _ = b.get_dispatch_layout(topks[r], E)
                return b.dispatch(xs[r], num_tokens_per_rank=ntr, is_token_in_rank=in_rank,
                                  num_tokens_per_expert=nte, topk_idx=topks[r],
                                  topk_weights=ws[r], expert_alignment=2)

            out = self.parallel(bufs, dispatch)
            for r, (rx, ridx, rw, counts, handle, ev) in enumerate(out):
                want = ref.dest(r)
                self.assertIsInstance(ev, EventOverlap)
                with ev:
                    pass
                np.testing.assert_array_equal(rx, np.array(
                    [xs[s][t] for s, t in want["rows"]]).reshape(-1, H))
                np.testing.assert_array_equal(ridx, want["recv_topk_idx"])
                np.testing.assert_array_equal(rw, want["recv_weights"])
                self.assertEqual(counts, [(c + 1) // 2 * 2 for c in want["per_expert"]])
                self.assertIsInstance(handle, DispatchHandle)
                if self.EXECUTION == "daemon":
                    self.assertIsInstance(handle.epd, epd.Handle)
                else:
                    self.assertEqual((handle.epd, handle.slot), (None, 0))
                check_deepep_handle(self, handle, r, R, T, topks, E // R, want["rows"])
            bias = [epd.float_to_bf16(np.full((len(xs[r]), H), 0.5, np.float32))
                    for r in range(R)]
            comb = self.parallel(bufs, lambda r, b: b.combine(out[r][0], out[r][4],
                                                              topk_weights=out[r][2],
                                                              bias=bias[r]))
            for r, (cx, cw, ev) in enumerate(comb):
                np.testing.assert_array_equal(cx, ref.combine(r, [o[0] for o in out],
                                                              [bias[r]]))
                np.testing.assert_array_equal(cw, ref.combined_weights(r))
                self.assertIsInstance(ev, EventOverlap)
            comb = self.parallel(bufs, lambda r, b: b.combine(out[r][0], out[r][4]))
            self.assertIsNone(comb[0][1])
            # Cached dispatch: DeepEP's (recv_x, None, None, None, None, event); new weights
            # come back in the third place. Then the handles go with their last reference.
            cached = self.parallel(bufs, lambda r, b: b.dispatch(xs[r], handle=out[r][4]))
            for r, c in enumerate(cached):
                np.testing.assert_array_equal(c[0], out[r][0])
                self.assertEqual(c[1:5], (None,) * 4)
                self.assertIsInstance(c[5], EventOverlap)
            cached = self.parallel(bufs, lambda r, b: b.dispatch(xs[r], handle=out[r][4],
                                                                 topk_weights=ws[r] * 3))
            for r, (rx, ridx, rw, counts, handle, ev) in enumerate(cached):
                np.testing.assert_array_equal(rx, out[r][0])
                self.assertEqual((ridx, counts, handle), (None, None, None))
                np.testing.assert_array_equal(rw, out[r][2] * 3)
            self.assertEqual(Buffer.get_dispatch_config(R).num_sms, Buffer.num_sms)
            self.assertEqual(Buffer.get_combine_config(R).num_sms, Buffer.num_sms)
            for r, b in enumerate(bufs):
                self.assertEqual(b.rank, r)
                self.assertEqual(b.group_size, R)
            if self.EXECUTION == "client":
                return
            handle_ids = [o[4].epd.id for o in out]
            out = cached = comb = None
            import gc
            gc.collect()
            # The released handle is gone on the daemon: combine on its id fails everywhere.
            ghost = [epd.Handle(b.group, handle_ids[r], "non_expand", len(xs[r]), K,
                                _lib.DTYPE_INT64, True, 0, 1, False)
                     for r, b in enumerate(bufs)]
            fail = self.parallel(bufs, lambda r, b: _catch(lambda: b.group.combine(
                np.zeros((0, H), np.uint16), ghost[r])))
            for f in fail:
                self.assertIsInstance(f, epd.NotFound)
        finally:
            for b in bufs:
                b.destroy()

    def test_combine_reduces_topk_weights(self):
        """combine(topk_weights=W) returns the reduction of W (changed weights and gradients
        pass through), also after a dispatch without weights and a cached dispatch."""
        R, E, H, T, K = 3, 12, 64, 16, 3
        bufs = self.buffers(R, num_experts=E, hidden=H)
        try:
            xs, _, topks, ws = make_inputs(R, E, H, T, K, 23)
            ref = Routing(R, E, T, xs, topks, ws)
            rng = np.random.default_rng(23)
            out = self.parallel(bufs, lambda r, b: b.dispatch(xs[r], topk_idx=topks[r],
                                                              topk_weights=ws[r]))
            new = [rng.standard_normal(o[2].shape).astype(np.float32) for o in out]
            comb = self.parallel(bufs, lambda r, b: b.combine(out[r][0], out[r][4],
                                                              topk_weights=new[r]))
            for r, (cx, cw, _) in enumerate(comb):
                np.testing.assert_array_equal(cw, ref.combined_weights(r, new))
                self.assertFalse(np.array_equal(cw, ref.combined_weights(r)))
                np.testing.assert_array_equal(cx, ref.combine(r, [o[0] for o in out]))
            # Unchanged recv_topk_weights give the dispatch's weights back (0 == -0 here).
            comb = self.parallel(bufs, lambda r, b: b.combine(out[r][0], out[r][4],
                                                              topk_weights=out[r][2]))
            for r, (_, cw, _) in enumerate(comb):
                np.testing.assert_array_equal(cw, ref.combined_weights(r))
            # No weights at dispatch, then a cached dispatch without them either.
            plain = self.parallel(bufs, lambda r, b: b.dispatch(xs[r], topk_idx=topks[r]))
            self.assertIsNone(plain[0][2])
            cached = self.parallel(bufs, lambda r, b: b.dispatch(xs[r], handle=plain[r][4]))
            W = [rng.standard_normal((len(c[0]), K)).astype(np.float32) for c in cached]
            comb = self.parallel(bufs, lambda r, b: b.combine(cached[r][0], plain[r][4],
                                                              topk_weights=W[r]))
            unweighted = Routing(R, E, T, xs, topks)
            for r, (cx, cw, _) in enumerate(comb):
                self.assertIsNotNone(cw)
                np.testing.assert_array_equal(cw, unweighted.combined_weights(r, W))
                np.testing.assert_array_equal(cx, unweighted.combine(r, [c[0] for c in cached]))
        finally:
            for b in bufs:
                b.destroy()

    def test_fp8_and_wrapped_group(self):
        R, E, H, T, K = 2, 8, 128, 16, 2
        w = World(R, num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K, dtype="fp8",
                  execution=self.EXECUTION)
        try:
            bufs = [Buffer(g) for g in w.groups]
            self.assertEqual([b.execution for b in bufs], [self.EXECUTION] * R)
            xs, scales, topks, ws = make_inputs(R, E, H, T, K, 22, dtype="fp8")
            ref = Routing(R, E, T, xs, topks, ws)
            out = self.parallel(bufs, lambda r, b: b.dispatch((xs[r], scales[r]),
                                                              topk_idx=topks[r]))
            for r, (rx, ridx, rw, counts, handle, ev) in enumerate(out):
                recv_x, recv_scales = rx
                want = ref.dest(r)
                for i, (s, t) in enumerate(want["rows"]):
                    np.testing.assert_array_equal(recv_x[i], xs[s][t])
                    np.testing.assert_array_equal(recv_scales[i], scales[s][t])
                self.assertIsNone(rw)
            with self.assertRaisesRegex(epd.InvalidArgument, "wraps an epd group of dtype fp8"):
                bufs[0].dispatch(np.zeros((2, H), np.uint16), topk_idx=topks[0][:2])
            for b in bufs:
                b.destroy()  # a wrapped group stays the caller's
            self.assertFalse(w.groups[0].closed)
        finally:
            w.close()

    def pg_buffers(self, R, **kw):
        """R Buffers made DeepEP's way, from a process group (ThreadGroup), the daemon's
        socket from $EPD_SOCKET. Returns (buffers, groups)."""
        groups = ThreadGroup.world(R)
        kw.setdefault("execution", self.EXECUTION)
        with socket_in_environment():
            with concurrent.futures.ThreadPoolExecutor(R) as ex:
                bufs = list(ex.map(lambda g: Buffer(g, 1 << 20, 0, **kw), groups))
        return bufs, groups

    def test_process_group_serves_both_dtypes(self):
        R, E, H, T, K = 2, 8, 128, 16, 3
        bufs, groups = self.pg_buffers(R)
        other, _ = self.pg_buffers(R)
        try:
            # The name and secret rank 0 drew reached every rank; another Buffer draws anew.
            self.assertEqual({b._name for b in bufs}, {bufs[0]._name})
            self.assertEqual({b._secret for b in bufs}, {bufs[0]._secret})
            self.assertGreaterEqual(len(bufs[0]._secret), 16)
            self.assertNotEqual(bufs[0]._name, other[0]._name)
            self.assertNotEqual(bufs[0]._secret, other[0]._secret)
            self.assertEqual([(b.rank, b.group_size) for b in bufs], [(0, R), (1, R)])
            self.assertEqual([b.process_group for b in bufs], groups)
            with self.assertRaises(epd.Unavailable):
                bufs[0].group
            xs, _, topks, ws = make_inputs(R, E, H, T, K, 31)
            x8, sc8, topks8, _ = make_inputs(R, E, H, T, K, 32, dtype="fp8")

            def dispatch(r, b, x, tk, w=None):
                ntr, _, nte, in_rank, _ = b.get_dispatch_layout(tk, E)
                return b.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=in_rank,
                                  num_tokens_per_expert=nte, topk_idx=tk, topk_weights=w)

            out = self.parallel(bufs, lambda r, b: dispatch(r, b, xs[r], topks[r], ws[r]))
            ref = Routing(R, E, T, xs, topks, ws)
            for r, b in enumerate(bufs):
                want = ref.dest(r)
                np.testing.assert_array_equal(out[r][0], np.array(
                    [xs[s][t] for s, t in want["rows"]]).reshape(-1, H))
                np.testing.assert_array_equal(out[r][2], want["recv_weights"])
                g = b.group
                # The shape agreed by the first call: the most tokens of any rank.
                self.assertEqual((g.dtype, g.world_size, g.num_experts, g.hidden,
                                  g.max_tokens_per_rank, g.max_topk),
                                 ("bf16", R, E, H, max(len(x) for x in xs), K))
            calls = list(groups[0].shared["calls"])
            again = self.parallel(bufs, lambda r, b: dispatch(r, b, xs[r], topks[r]))
            self.assertEqual(groups[0].shared["calls"], calls)  # later calls: no collective
            for r in range(R):
                np.testing.assert_array_equal(again[r][0], out[r][0])
            # fp8 on the same Buffer: a second epd group, made by this first fp8 call.
            out8 = self.parallel(bufs, lambda r, b: dispatch(r, b, (x8[r], sc8[r]),
                                                             topks8[r]))
            # One all-gather agrees the shape; over a client-executed group a second one waits
            # until every rank has joined, before any rank's first op.
            made = 2 if self.EXECUTION == "client" else 1
            self.assertEqual([c + made for c in calls], groups[0].shared["calls"])
            ref8 = Routing(R, E, T, x8, topks8)
            for r, b in enumerate(bufs):
                self.assertEqual(sorted(b._groups), ["bf16", "fp8"])
                self.assertEqual(b._groups["fp8"].dtype, "fp8")
                self.assertEqual(b.group.dtype, "bf16")
                rx, rs = out8[r][0]
                rows = ref8.dest(r)["rows"]
                np.testing.assert_array_equal(rx, np.array(
                    [x8[s][t] for s, t in rows]).reshape(-1, H))
                np.testing.assert_array_equal(rs, np.array(
                    [sc8[s][t] for s, t in rows]).reshape(len(rows), -1))
            # Combine each dispatch on its own group.
            ys = [epd.float_to_bf16(np.full((len(o[0][0]), H), r + 1, np.float32))
                  for r, o in enumerate(out8)]
            comb8 = self.parallel(bufs, lambda r, b: b.combine(ys[r], out8[r][4]))
            comb = self.parallel(bufs, lambda r, b: b.combine(out[r][0], out[r][4],
                                                              topk_weights=out[r][2]))
            for r in range(R):
                np.testing.assert_array_equal(comb8[r][0], ref8.combine(r, ys))
                np.testing.assert_array_equal(comb[r][0],
                                              ref.combine(r, [o[0] for o in out]))
                np.testing.assert_array_equal(comb[r][1], ref.combined_weights(r))
        finally:
            for b in bufs + other:
                b.destroy()

    def test_process_group_needs_num_experts(self):
        R, H = 2, 64
        bufs, _ = self.pg_buffers(R)
        try:
            x = np.zeros((4, H), np.uint16)
            tk = np.tile(np.array([[0, -1]], np.int64), (4, 1))
            errs = self.parallel(bufs, lambda r, b: _catch(lambda: b.dispatch(x, topk_idx=tk)))
            for e in errs:
                self.assertIsInstance(e, epd.InvalidArgument)
                self.assertIn("num_experts", str(e))
        finally:
            for b in bufs:
                b.destroy()
        # Given to the constructor, the first dispatch needs nothing else.
        bufs, _ = self.pg_buffers(R, num_experts=2 * R, max_tokens_per_rank=8)
        try:
            out = self.parallel(bufs, lambda r, b: b.dispatch(x, topk_idx=tk))
            self.assertEqual(bufs[1].group.max_tokens_per_rank, 8)
            self.assertEqual(len(out[0][0]), 2 * 4)  # expert 0 lives on rank 0
            # More tokens than the agreed bound: refused on every rank.
            x9, tk9 = np.zeros((9, H), np.uint16), np.tile(tk[:1], (9, 1))
            errs = self.parallel(bufs, lambda r, b: _catch(lambda: b.dispatch(x9, topk_idx=tk9)))
            for e in errs:
                self.assertIsInstance(e, epd.InvalidArgument)
                self.assertIn("max_tokens_per_rank 8" if self.EXECUTION == "daemon" else
                              "num_tokens above max_tokens", str(e))
        finally:
            for b in bufs:
                b.destroy()

    def test_process_group_low_latency(self):
        """low_latency_mode from a process group: the constructor makes the client-executed
        group from the shape keywords, which every rank must give."""
        R, T, H, K = 2, 4, 256, 2
        with self.assertRaisesRegex(epd.InvalidArgument, "hidden, max_tokens_per_rank"):
            Buffer(ThreadGroup.world(1)[0], low_latency_mode=True, num_experts=4, max_topk=K)
        bufs, _ = self.pg_buffers(R, low_latency_mode=True, num_experts=4 * R, hidden=H,
                                  max_tokens_per_rank=T, max_topk=K, op_timeout_ms=20000,
                                  execution=None)
        try:
            for b in bufs:
                g = b.group
                self.assertEqual((g.execution, g.expert_block_rows, g.world_size, g.quantize),
                                 ("client", R * T, R, True))
            x = [epd.float_to_bf16(np.full((T, H), r + 1, np.float32)) for r in range(R)]
            tk = [np.tile(np.array([[0, 4 * R - 1]], np.int64), (T, 1)) for _ in range(R)]
            out = self.parallel(bufs, lambda r, b: b.low_latency_dispatch(
                x[r], tk[r], T, 4 * R, use_fp8=False))
            for r, (recv_x, recv_count, handle, _, _) in enumerate(out):
                # Expert 0 lives on rank 0, the last expert on the last rank.
                local = 0 if r == 0 else 3
                self.assertEqual(int(recv_count[local]), R * T)
                got = epd.bf16_to_float(recv_x[local])
                np.testing.assert_array_equal(got[:, 0], np.repeat(np.arange(1, R + 1), T))
        finally:
            for b in bufs:
                b.destroy()

    def test_mpi_style_comm(self):
        with socket_in_environment():
            b = Buffer(None, comm=MpiLikeComm(), num_experts=2, execution=self.EXECUTION)
        try:
            x = epd.float_to_bf16(np.arange(8 * 64, dtype=np.float32).reshape(8, 64))
            tk = np.array([[0], [1], [-1], [0], [1], [0], [-1], [1]], np.int64)
            rx, ridx, _, counts, handle, _ = b.dispatch(x, topk_idx=tk)
            np.testing.assert_array_equal(rx, x[tk[:, 0] >= 0])
            self.assertEqual(counts, [3, 3])
            cx, _, _ = b.combine(rx, handle)
            np.testing.assert_array_equal(cx[tk[:, 0] >= 0], x[tk[:, 0] >= 0])
        finally:
            b.destroy()

    def test_dispatch_by_is_token_in_rank(self):
        """Without topk_idx a token goes to the ranks is_token_in_rank names: one row per
        (source, token) on each, recv_topk_idx and recv_topk_weights None; the expert counts
        come from num_tokens_per_expert through the process group."""
        R, E, H, T, K = 3, 6, 64, 16, 2
        L = E // R
        rng = np.random.default_rng(41)
        xs, in_rank, rank_topk, ntes = [], [], [], []
        for s in range(R):
            n = T - 2 * s
            xs.append(epd.float_to_bf16(rng.standard_normal((n, H), dtype=np.float32)))
            m = np.zeros((n, R), bool)
            for t in range(n):
                m[t, rng.permutation(R)[:rng.integers(0, K + 1)]] = True
            in_rank.append(m)
            rank_topk.append(np.array([[d * L for d in np.nonzero(row)[0]] +
                                       [-1] * (K - row.sum()) for row in m], np.int64))
            ntes.append(rng.integers(0, 9, E).astype(np.int32))
        ref = Routing(R, E, T, xs, rank_topk)
        want_counts = [[(int(sum(ntes[s][d * L + i] for s in range(R))) + 1) // 2 * 2
                        for i in range(L)] for d in range(R)]
        kw = dict(num_experts=E, hidden=H, max_topk=K)
        by_name = self.buffers(R, **kw)
        by_pg, _ = self.pg_buffers(R, max_tokens_per_rank=T, **kw)
        try:
            for bufs, counts_known in ((by_name, False), (by_pg, True)):
                out = self.parallel(bufs, lambda r, b: b.dispatch(
                    xs[r], is_token_in_rank=in_rank[r], num_tokens_per_expert=ntes[r],
                    expert_alignment=2))
                for r, (rx, ridx, rw, counts, handle, ev) in enumerate(out):
                    rows = ref.dest(r)["rows"]
                    np.testing.assert_array_equal(rx, np.array(
                        [xs[s][t] for s, t in rows]).reshape(-1, H))
                    self.assertEqual((ridx, rw), (None, None))
                    self.assertEqual(counts, want_counts[r] if counts_known else None)
                    check_deepep_handle(self, handle, r, R, T, rank_topk, L, rows)
                rng_w = np.random.default_rng(42)
                Wr = [rng_w.standard_normal((len(o[0]), K)).astype(np.float32) for o in out]
                comb = self.parallel(bufs, lambda r, b: b.combine(out[r][0], out[r][4],
                                                                  topk_weights=Wr[r]))
                for r, (cx, cw, _) in enumerate(comb):
                    np.testing.assert_array_equal(cx, ref.combine(r, [o[0] for o in out]))
                    np.testing.assert_array_equal(cw, ref.combined_weights(r, Wr))
                cached = self.parallel(bufs, lambda r, b: b.dispatch(xs[r], handle=out[r][4]))
                for r in range(R):
                    np.testing.assert_array_equal(cached[r][0], out[r][0])
            b = by_name[0]
            x0 = xs[0]
            for kwargs, what in (
                    ({}, "is_token_in_rank"),
                    ({"is_token_in_rank": in_rank[0][:, :2]}, "is_token_in_rank"),
                    ({"is_token_in_rank": in_rank[0].astype(np.int32)}, "is_token_in_rank"),
                    ({"is_token_in_rank": in_rank[0],
                      "topk_weights": np.zeros((len(x0), K), np.float32)}, "topk_weights")):
                with self.assertRaisesRegex(epd.InvalidArgument, what):
                    b.dispatch(x0, **kwargs)
            # A token sent to more ranks than the group's max_topk: refused on every rank.
            wide = [np.ones((len(x), R), bool) for x in xs]
            errs = self.parallel(by_name, lambda r, b: _catch(
                lambda: b.dispatch(xs[r], is_token_in_rank=wide[r])))
            for e in errs:
                self.assertIsInstance(e, epd.InvalidArgument)
                self.assertRegex(str(e), "is_token_in_rank.*3 ranks.*max_topk is 2")
        finally:
            for b in by_name + by_pg:
                b.destroy()

    def test_num_worst_tokens(self):
        """Outputs of num_worst_tokens rows: the received rows first, then top-k ids -1 and
        weights 0; an empty count list; combine takes the padded rows."""
        R, E, H, T, K = 2, 8, 128, 16, 3
        bufs = self.buffers(R, num_experts=E, hidden=H)
        try:
            xs, _, topks, ws = make_inputs(R, E, H, T, K, 51)
            ref = Routing(R, E, T, xs, topks, ws)
            W = R * T
            plain = self.parallel(bufs, lambda r, b: b.dispatch(xs[r], topk_idx=topks[r],
                                                                topk_weights=ws[r]))
            out = self.parallel(bufs, lambda r, b: b.dispatch(
                xs[r], topk_idx=topks[r], topk_weights=ws[r], num_worst_tokens=W))
            for r, (rx, ridx, rw, counts, handle, ev) in enumerate(out):
                n = len(plain[r][0])
                self.assertEqual([len(rx), len(ridx), len(rw)], [W] * 3)
                self.assertEqual(counts, [])
                np.testing.assert_array_equal(rx[:n], plain[r][0])
                np.testing.assert_array_equal(ridx[:n], plain[r][1])
                np.testing.assert_array_equal(rw[:n], plain[r][2])
                np.testing.assert_array_equal(ridx[n:], -1)
                np.testing.assert_array_equal(rw[n:], 0)
                self.assertLess(n, W)
                self.assertEqual(handle.num_recv_tokens, n)
                self.assertEqual(len(handle[3]), n)
                self.assertIsInstance(ev, EventOverlap)
            comb = self.parallel(bufs, lambda r, b: b.combine(out[r][0], out[r][4],
                                                              topk_weights=out[r][2]))
            for r, (cx, cw, _) in enumerate(comb):
                np.testing.assert_array_equal(cx, ref.combine(r, [p[0] for p in plain]))
                np.testing.assert_array_equal(cw, ref.combined_weights(r))
            # fp8 on the same Buffer, cached dispatches padded as well.
            x8, sc8, tk8, _ = make_inputs(R, E, H, T, K, 52, dtype="fp8")
            out8 = self.parallel(bufs, lambda r, b: b.dispatch((x8[r], sc8[r]), topk_idx=tk8[r],
                                                               num_worst_tokens=W))
            cached = self.parallel(bufs, lambda r, b: b.dispatch(
                (x8[r], sc8[r]), handle=out8[r][4], num_worst_tokens=W))
            rows8 = Routing(R, E, T, x8, tk8)
            for r in range(R):
                (rx, rs), (cx8, cs8) = out8[r][0], cached[r][0]
                rows = rows8.dest(r)["rows"]
                self.assertEqual((len(rx), len(rs), len(cx8)), (W, W, W))
                np.testing.assert_array_equal(rx[:len(rows)], np.array(
                    [x8[s][t] for s, t in rows]).reshape(-1, H))
                np.testing.assert_array_equal(cx8[:len(rows)], rx[:len(rows)])
                np.testing.assert_array_equal(cs8[:len(rows)], rs[:len(rows)])
            # More than the group can deliver: refused before the op, naming the bound.
            with self.assertRaisesRegex(epd.InvalidArgument, "num_worst_tokens 33.* 32 rows"):
                bufs[0].dispatch(xs[0], topk_idx=topks[0], num_worst_tokens=W + 1)
            # Fewer than some rank receives: the op fails on every rank.
            errs = self.parallel(bufs, lambda r, b: _catch(lambda: b.dispatch(
                xs[r], topk_idx=topks[r], num_worst_tokens=2)))
            for e in errs:
                self.assertIsInstance(e, epd.CapacityExceeded)
        finally:
            for b in bufs:
                b.destroy()

    def test_keyword_buffer_second_dtype(self):
        """A Buffer made by name serves the other dtype with a group named <name>.<dtype>."""
        R, E, H, T, K = 2, 8, 128, 16, 2
        bufs = self.buffers(R, num_experts=E, hidden=H)
        try:
            x8, sc8, tk8, _ = make_inputs(R, E, H, T, K, 61, dtype="fp8")
            out = self.parallel(bufs, lambda r, b: b.dispatch((x8[r], sc8[r]), topk_idx=tk8[r]))
            ref = Routing(R, E, T, x8, tk8)
            for r, b in enumerate(bufs):
                g = b._groups["fp8"]
                self.assertEqual(b._group_name("fp8"), b._name + ".fp8")
                self.assertEqual((g.dtype, g.num_experts, g.hidden, g.max_tokens_per_rank,
                                  g.max_topk), ("fp8", E, H, 16, 4))
                rows = ref.dest(r)["rows"]
                np.testing.assert_array_equal(out[r][0][0], np.array(
                    [x8[s][t] for s, t in rows]).reshape(-1, H))
        finally:
            for b in bufs:
                b.destroy()

    def test_names_and_events(self):
        import epd.compat.deep_ep as de
        R = 2
        bufs = self.buffers(R)
        try:
            b = bufs[0]
            for call, name in ((lambda: b.runtime, "runtime"),
                               (lambda: b.get_local_buffer_tensor(np.uint8),
                                "get_local_buffer_tensor"),
                               (lambda: b.get_comm_stream(), "get_comm_stream")):
                with self.assertRaisesRegex(NotImplementedError, name):
                    call()
            with self.assertRaisesRegex(NotImplementedError, "enable_shrink"):
                Buffer(unique("shrink"), rank=0, secret=SECRET, socket=DAEMON["socket"],
                       enable_shrink=True)
            with self.assertRaisesRegex(epd.InvalidArgument, "process group"):
                Buffer(object())
            torch = epd.tensors.torch_module()
            self.assertEqual(de.topk_idx_t, torch.int64 if torch else np.dtype(np.int64))
            ns = {}
            exec("from epd.compat.deep_ep import *", ns)
            for name in ("Buffer", "Config", "EventOverlap", "topk_idx_t", "is_sm90_compiled"):
                self.assertIn(name, ns)
            self.assertIsInstance(de.is_sm90_compiled(), bool)
            self.assertEqual(Buffer.is_sm90_compiled(), de.is_sm90_compiled())
            cfg = Buffer.get_dispatch_config(R)
            self.assertIsInstance(cfg, de.Config)
            self.assertIsInstance(Buffer.get_combine_config(R), de.Config)
            self.assertEqual(cfg.get_nvl_buffer_size_hint(7168 * 2, R), 0)
            old = Buffer.num_sms
            try:
                Buffer.set_num_sms(old + 2)
                self.assertEqual(Buffer.get_dispatch_config(R).num_sms, old + 2)
                self.assertEqual(b.num_sms, old + 2)
            finally:
                Buffer.set_num_sms(old)
            ev = Buffer.capture()
            self.assertIsInstance(ev, EventOverlap)
            with ev as inside:
                self.assertIs(inside, ev)
            self.assertEqual((b.num_nvl_bytes, b.num_rdma_bytes, b.low_latency_mode),
                             (0, 0, False))
        finally:
            for b in bufs:
                b.destroy()

    def test_creator_needs_shape(self):
        with self.assertRaises(epd.InvalidArgument):
            Buffer(unique("noshape"), rank=0, secret=SECRET, socket=DAEMON["socket"])
        with self.assertRaises(epd.InvalidArgument):
            Buffer(unique("nosecret"), socket=DAEMON["socket"])

    @unittest.skipUnless(importlib.util.find_spec("torch"), "torch not installed")
    def test_torch_tensors(self):
        import torch
        R, E, H, T, K = 2, 8, 64, 16, 2
        bufs = self.buffers(R, num_experts=E, hidden=H)
        try:
            xs, _, topks, ws = make_inputs(R, E, H, T, K, 23)
            tx = [torch.from_numpy(epd.bf16_to_float(x)).to(torch.bfloat16) for x in xs]
            tk = [torch.from_numpy(t) for t in topks]
            tw = [torch.from_numpy(w) for w in ws]
            lay = bufs[0].get_dispatch_layout(tk[0], E)
            self.assertIsInstance(lay[3], torch.Tensor)
            self.assertEqual(lay[3].dtype, torch.bool)
            out = self.parallel(bufs, lambda r, b: b.dispatch(tx[r], topk_idx=tk[r],
                                                              topk_weights=tw[r]))
            ref = Routing(R, E, T, xs, topks, ws)
            for r, (rx, ridx, rw, counts, handle, ev) in enumerate(out):
                self.assertEqual(rx.dtype, torch.bfloat16)
                self.assertEqual(ridx.dtype, torch.int64)
                got = rx.view(torch.int16).numpy().view(np.uint16)
                want = ref.dest(r)
                np.testing.assert_array_equal(
                    got, np.array([xs[s][t] for s, t in want["rows"]]).reshape(-1, H))
            comb = self.parallel(bufs, lambda r, b: b.combine(out[r][0], out[r][4],
                                                              topk_weights=out[r][2]))
            for r, (cx, cw, _) in enumerate(comb):
                self.assertEqual(cx.dtype, torch.bfloat16)
                np.testing.assert_array_equal(
                    cx.view(torch.int16).numpy().view(np.uint16),
                    ref.combine(r, [o[0].view(torch.int16).numpy().view(np.uint16)
                                    for o in out]))
                self.assertEqual(cw.dtype, torch.float32)
        finally:
            for b in bufs:
                b.destroy()


class TestDeepEPCompatClient(TestDeepEPCompat):
    """TestDeepEPCompat over client-executed groups (Buffer(execution='client')): the ops run
    on the calling thread over the groups' buffers. Also the choice of execution, outputs that
    outlive the next dispatch, and handles whose slot a later dispatch filled."""

    EXECUTION = "client"

    def test_execution_default(self):
        """Without execution=, a Buffer's groups are client-executed where the backend runs
        the inputs that way: on the host backend, NumPy arrays (and CPU tensors)."""
        R, E, H = 2, 8, 64
        by_name = self.buffers(R, execution=None)
        by_pg, _ = self.pg_buffers(R, execution=None, num_experts=E)
        daemon, _ = self.pg_buffers(R, execution="daemon", num_experts=E)
        try:
            self.assertEqual([b.execution for b in by_name], ["client"] * R)
            self.assertEqual([b.execution for b in by_pg + daemon], [None] * R + ["daemon"] * R)
            x = epd.float_to_bf16(np.ones((4, H), np.float32))
            tk = np.tile(np.array([[0, E - 1]], np.int64), (4, 1))
            for bufs in (by_pg, daemon):
                out = self.parallel(bufs, lambda r, b: b.dispatch(x, topk_idx=tk))
                for o in out:
                    self.assertEqual(len(o[0]), R * 4)
            self.assertEqual([b.group.execution for b in by_pg + daemon],
                             ["client"] * R + ["daemon"] * R)
            self.assertEqual([b._groups["bf16"].execution for b in by_pg], ["client"] * R)
            with self.assertRaisesRegex(epd.InvalidArgument, "execution"):
                Buffer(unique("bad"), rank=0, secret=SECRET, socket=DAEMON["socket"],
                       execution="both")
            with self.assertRaisesRegex(epd.InvalidArgument, "execution"):
                Buffer(daemon[0].group, execution="client")
            with self.assertRaisesRegex(epd.InvalidArgument, "low_latency_mode"):
                Buffer(unique("ll"), rank=0, secret=SECRET, socket=DAEMON["socket"],
                       low_latency_mode=True, execution="daemon")
        finally:
            for b in by_name + by_pg + daemon:
                b.destroy()
        # A joining rank that asks for the other execution than the group's is refused.
        name = unique("mismatch")
        first = Buffer(name, rank=0, secret=SECRET, socket=DAEMON["socket"], world_size=2,
                       num_experts=E, hidden=H, max_tokens_per_rank=4, max_topk=2,
                       execution="client")
        try:
            with self.assertRaisesRegex(epd.InvalidArgument, "client-executed, not daemon"):
                Buffer(name, rank=1, secret=SECRET, socket=DAEMON["socket"],
                       execution="daemon")
        finally:
            first.destroy()

    def test_outputs_outlive_the_next_dispatch(self):
        """recv_x and the rest are copies: a later dispatch into the receive area leaves them;
        with copy_outputs=False they are views of it, rewritten by the next dispatch."""
        R, E, H, T, K = 2, 8, 64, 16, 2
        xs, _, topks, ws = make_inputs(R, E, H, T, K, 71)
        ref = Routing(R, E, T, xs, topks, ws)
        for copy in (True, False):
            bufs = self.buffers(R, num_experts=E, hidden=H, copy_outputs=copy)
            try:
                first = self.parallel(bufs, lambda r, b: b.dispatch(xs[r], topk_idx=topks[r],
                                                                    topk_weights=ws[r]))
                kept = [(o[0].copy(), o[1].copy(), o[2].copy()) for o in first]
                other = [np.full_like(x, 7) for x in xs]
                flip = [np.where(t >= 0, (t + 1) % E, -1) for t in topks]
                self.parallel(bufs, lambda r, b: b.dispatch(other[r], topk_idx=flip[r],
                                                            topk_weights=ws[r] * 2))
                for r in range(R):
                    same = [np.array_equal(a, b) for a, b in zip(first[r][:3], kept[r])]
                    self.assertEqual(same, [True] * 3 if copy else [False] * 3)
                # The first handle still combines the first routing.
                comb = self.parallel(bufs, lambda r, b: b.combine(kept[r][0], first[r][4],
                                                                  topk_weights=kept[r][2]))
                for r, (cx, cw, _) in enumerate(comb):
                    np.testing.assert_array_equal(cx, ref.combine(r, [k[0] for k in kept]))
                    np.testing.assert_array_equal(cw, ref.combined_weights(r))
            finally:
                for b in bufs:
                    b.destroy()

    def test_handle_of_a_refilled_slot(self):
        """A Buffer fills its group's handle slots in turn: a handle whose slot a later
        dispatch filled is refused by combine and cached dispatch, on every rank, before
        anything runs; its tuple stays readable and the group goes on."""
        R, E, H, T, K = 2, 8, 64, 16, 2
        xs, _, topks, _ = make_inputs(R, E, H, T, K, 72)
        ref = Routing(R, E, T, xs, topks)
        for slots in (2, 3):
            bufs = self.buffers(R, num_experts=E, hidden=H, num_handle_slots=slots)
            try:
                self.assertEqual(bufs[0].group.num_handle_slots, slots)
                out = [self.parallel(bufs, lambda r, b: b.dispatch(xs[r], topk_idx=topks[r]))
                       for _ in range(slots + 1)]
                self.assertEqual([o[0][4].slot for o in out], list(range(slots)) + [0])
                for call in (lambda r, b: b.combine(out[0][r][0], out[0][r][4]),
                             lambda r, b: b.dispatch(xs[r], handle=out[0][r][4])):
                    errs = self.parallel(bufs, lambda r, b: _catch(lambda: call(r, b)))
                    for e in errs:
                        self.assertIsInstance(e, epd.InvalidArgument)
                        self.assertRegex(str(e), "slot 0 was filled by a later dispatch.*%d "
                                         "dispatches" % slots)
                for r in range(R):
                    check_deepep_handle(self, out[0][r][4], r, R, T, topks, E // R,
                                        ref.dest(r)["rows"])
                for o in out[1:]:
                    comb = self.parallel(bufs, lambda r, b: b.combine(o[r][0], o[r][4]))
                    for r, (cx, _, _) in enumerate(comb):
                        np.testing.assert_array_equal(cx, ref.combine(r, [p[0] for p in o]))
            finally:
                for b in bufs:
                    b.destroy()


def _catch(fn):
    try:
        return fn()
    except epd.Error as e:
        return e


def check_deepep_handle(tc, handle, rank, R, T, topks, L, rows):
    """The DeepEP tuple entries of a dispatch handle on ``rank``: ``rows`` are the (source,
    token) pairs it received, ``topks`` every rank's routing."""
    tc.assertEqual(len(handle), 6)
    rpm, chan, recv_chan, src_idx, in_rank, head = handle
    tc.assertEqual((rpm.shape, rpm.dtype), ((R, R), np.int32))
    per_source = [sum(1 for s, _ in rows if s == src) for src in range(R)]
    np.testing.assert_array_equal(rpm[:, rank], np.cumsum(per_source))
    if getattr(handle, "slot", None) is None:
        # Daemon-executed: only this rank's column is known.
        np.testing.assert_array_equal(np.delete(rpm, rank, axis=1), -1)
    else:
        # Client-executed: every column, from every rank's routing.
        sent = np.zeros((R, R), np.int64)
        for src in range(R):
            tks = np.asarray(topks[src])
            dst = np.where(tks >= 0, tks // L, -1)
            for d in range(R):
                sent[src, d] = int((dst == d).any(1).sum())
        np.testing.assert_array_equal(rpm, np.cumsum(sent, axis=0))
    np.testing.assert_array_equal(recv_chan[:, 0], np.cumsum(per_source) - per_source)
    np.testing.assert_array_equal(src_idx, np.array([t for _, t in rows], np.int32))
    tc.assertEqual(src_idx.dtype, np.int32)
    tk = np.asarray(topks[rank])
    dest = np.where(tk >= 0, tk // L, -1)
    want_in = np.stack([(dest == d).any(1) for d in range(R)], axis=1)
    np.testing.assert_array_equal(in_rank, want_in)
    np.testing.assert_array_equal(chan[:, 0], want_in.sum(0))
    for d in range(R):
        sent = np.nonzero(want_in[:, d])[0]
        want_head = np.full(len(tk), -1, np.int32)
        want_head[sent] = np.arange(len(sent))
        np.testing.assert_array_equal(head[:, d], want_head)


class TestAdmin(unittest.TestCase):
    """epd.admin against a daemon of its own, so that drains cannot hold other tests' ops.

    This process is an admin of it: as root by itself, otherwise through an admin_group naming
    its group. The socket is open to everyone, for the test that plays a client without rights.
    """

    NOBODY = 65534

    @classmethod
    def setUpClass(cls):
        extra = ["--socket-mode", "0666"]
        cls.conf = None
        if os.geteuid() != 0:
            import grp
            fd, cls.conf = tempfile.mkstemp(prefix="epd-admin-", suffix=".conf")
            with os.fdopen(fd, "w") as f:
                f.write("[daemon]\nadmin_group = %s\n" % grp.getgrgid(os.getegid()).gr_name)
            extra += ["--config", cls.conf]
        cls.daemon = start_daemon(extra)
        os.chmod(cls.daemon["dir"], 0o711)

    @classmethod
    def tearDownClass(cls):
        stop_daemon(cls.daemon)
        if cls.conf:
            os.unlink(cls.conf)

    def connect(self, name):
        c = epd.connect(self.daemon["socket"], name=name)
        self.addCleanup(c.close)
        return c

    def group(self, client, name, rank=0, world_size=1, **cfg):
        shape = dict(num_experts=4, hidden=64, max_tokens_per_rank=8, max_topk=2,
                     arena_bytes=1 << 20, op_timeout_ms=20000)
        shape.update(cfg)
        if rank:
            g = epd.Group.join(client, name, SECRET, rank)
        else:
            g = epd.Group.create(client, name, SECRET, 0, world_size=world_size, **shape)
        self.addCleanup(self.leave, g)  # and a reference: a Group garbage collected leaves
        return g

    @staticmethod
    def leave(group):
        try:
            group.leave()
        except epd.Unavailable:  # an evicted client's connection is gone
            pass

    @staticmethod
    def dispatch(group, async_op=False):
        x = np.zeros((4, 64), np.uint16)
        topk = np.array([[0, 1], [1, 2], [2, 3], [3, 0]], np.int64)
        return group.dispatch(x, topk, async_op=async_op)

    def find(self, items, key, value):
        found = [i for i in items if i[key] == value]
        self.assertEqual(len(found), 1, "%s=%r in %r" % (key, value, items))
        return found[0]

    def test_status_groups_clients(self):
        a, b = self.connect("adm-a"), self.connect("adm-b")
        name = unique("pair")
        ga = self.group(a, name, 0, 2)
        self.group(b, name, 1)
        ia, ib = a.info(), b.info()

        st = epd.admin.status(a)
        self.assertEqual(st["backend"], "host")
        self.assertEqual(st["version"], ia["version"])
        self.assertEqual(st["daemon_epoch"], ia["daemon_epoch"])
        self.assertEqual(st["pid"], self.daemon["proc"].pid)
        self.assertIs(st["draining"], False)
        self.assertEqual(st["num_clients"], 2)
        self.assertEqual(st["num_groups"], 1)
        self.assertEqual([d["uuid"] for d in st["devices"]],
                         [d["uuid"] for d in ia["devices"]])

        g = self.find(epd.admin.groups(b), "name", name)
        self.assertEqual(g["id"], ga.id)
        self.assertEqual(g["state"], "READY")
        # As created; the daemon reports scale_block 0 for bf16, Group.config the fp8 default.
        self.assertEqual(dict(g["config"], scale_block=128), ga.config)
        self.assertEqual([(r["rank"], r["bound"], r["client_id"]) for r in g["ranks"]],
                         [(0, True, ia["client_id"]), (1, True, ib["client_id"])])

        cl = epd.admin.clients(a)
        self.assertEqual(len(cl), 2)
        ca = self.find(cl, "id", ia["client_id"])
        self.assertEqual((ca["name"], ca["pid"], ca["uid"]), ("adm-a", os.getpid(),
                                                              os.geteuid()))
        self.assertEqual(ca["bindings"], [name + "/0"])
        self.assertEqual(self.find(cl, "id", ib["client_id"])["bindings"], [name + "/1"])

    def test_stats(self):
        a = self.connect("adm-stats")
        name = unique("solo")
        g = self.group(a, name)
        self.dispatch(g).handle.release()
        s = epd.admin.stats(a)
        self.assertEqual(s["backend"], "host")
        self.assertGreaterEqual(s["ops_completed"], 1)
        gs = self.find(s["groups"], "name", name)
        self.assertEqual((gs["id"], gs["world_size"], gs["state"]), (g.id, 1, "READY"))
        rank = gs["ranks"][0]
        self.assertEqual(rank["dispatch"]["ops"], 1)
        self.assertEqual(rank["dispatch"]["latency_count"], 1)
        self.assertEqual(sum(rank["dispatch"]["latency_buckets"]), 1)
        self.assertEqual(rank["dispatch"]["errors"], {})
        self.assertEqual(rank["combine"]["ops"], 0)
        self.assertEqual(rank["arena_bytes"], 1 << 20)
        self.assertIn(("dispatch", "peers"), [(x["op"], x["stage"]) for x in gs["stages"]])
        self.assertEqual(self.find(s["clients"], "name", "adm-stats")["ops"], 1)
        self.assertEqual(len(s["devices"]), len(a.info()["devices"]))

    def test_drain_undrain(self):
        a = self.connect("adm-drain")
        name = unique("held")
        g = self.group(a, name)
        state = lambda: self.find(epd.admin.groups(a), "name", name)["state"]  # noqa: E731
        self.assertEqual(epd.admin.drain(a, name)["groups"], 1)
        self.assertEqual(state(), "DRAINING")
        fut = self.dispatch(g, async_op=True)
        with self.assertRaises(epd.Timeout) as cm:
            fut.wait(timeout=0.3)
        self.assertTrue(cm.exception.op_pending)
        r = epd.admin.drain(a, name)
        self.assertEqual((r["groups"], r["waiting_ops"], r["daemon_draining"]), (0, 1, False))
        self.assertEqual(epd.admin.undrain(a, name)["groups"], 1)
        fut.wait(timeout=10).handle.release()
        self.assertEqual(state(), "READY")
        # By id, and the whole daemon.
        epd.admin.drain(a, g.id)
        self.assertEqual(state(), "DRAINING")
        epd.admin.undrain(a, str(g.id))
        self.assertEqual(state(), "READY")
        self.assertIs(epd.admin.drain(a)["daemon_draining"], True)
        self.assertIs(epd.admin.status(a)["draining"], True)
        fut = self.dispatch(g, async_op=True)
        with self.assertRaises(epd.Timeout):
            fut.wait(timeout=0.3)
        self.assertIs(epd.admin.undrain(a)["daemon_draining"], False)
        fut.wait(timeout=10).handle.release()
        self.assertIs(epd.admin.status(a)["draining"], False)

    def test_resize(self):
        a, b = self.connect("adm-r0"), self.connect("adm-r1")
        name = unique("grow")
        g = self.group(a, name, 0, 2)
        self.group(b, name, 1)
        r = epd.admin.resize(a, name, 2 << 20)
        self.assertEqual((r["group_id"], r["requested_bytes"], r["old_bytes"], r["new_bytes"]),
                         (g.id, 2 << 20, 1 << 20, 2 << 20))
        self.assertEqual([(k["rank"], k["old_bytes"], k["new_bytes"]) for k in r["ranks"]],
                         [(0, 1 << 20, 2 << 20), (1, 1 << 20, 2 << 20)])
        self.assertEqual(self.find(epd.admin.groups(a), "id", g.id)["config"]["arena_bytes"],
                         2 << 20)
        r = epd.admin.resize(a, g.id, 512 << 10)
        self.assertEqual(r["new_bytes"], 512 << 10)
        ranks = self.find(epd.admin.stats(a)["groups"], "id", g.id)["ranks"]
        self.assertEqual([k["arena_bytes"] for k in ranks], [512 << 10] * 2)

    def test_evict(self):
        a, b = self.connect("adm-survivor"), self.connect("adm-victim")
        name = unique("pair")
        ga = self.group(a, name, 0, 2)
        self.group(b, name, 1)
        victim = b.info()["client_id"]
        fut = self.dispatch(ga, async_op=True)
        epd.admin.evict(a, victim)
        with self.assertRaises(epd.PeerLost):
            fut.wait(timeout=10)
        self.assertNotIn(victim, [c["id"] for c in epd.admin.clients(a)])
        with self.assertRaises(epd.NotFound) as cm:
            epd.admin.evict(a, victim)
        self.assertIn(str(victim), cm.exception.message)
        with self.assertRaises(epd.InvalidArgument) as cm:
            epd.admin.evict(a, a.info()["client_id"])
        self.assertIn("itself", cm.exception.message)

    def test_bad_arguments(self):
        a = self.connect("adm-careless")
        with self.assertRaises(epd.NotFound) as cm:
            epd.admin.drain(a, "no-such-group")
        self.assertIn("no-such-group", cm.exception.message)
        with self.assertRaises(epd.NotFound):
            epd.admin.resize(a, "no-such-group", 1 << 20)
        name = unique("forming")
        self.group(a, name, 0, 2)
        with self.assertRaises(epd.InvalidArgument) as cm:
            epd.admin.drain(a, name)
        self.assertIn("FORMING", cm.exception.message)
        for bad in ("", 0, -3, 1.5, True, b"name"):
            with self.assertRaises(epd.InvalidArgument):
                epd.admin.drain(a, bad)
        for bad in (0, -1, 1 << 64, 2.0, "1M"):
            with self.assertRaises(epd.InvalidArgument):
                epd.admin.resize(a, name, bad)
        with self.assertRaises(epd.InvalidArgument):
            epd.admin.resize(a, None, 1 << 20)
        with self.assertRaises(epd.InvalidArgument) as cm:
            epd.admin.resize(a, name, 1 << 50)
        self.assertIn("max_arena_bytes", cm.exception.message)
        for bad in (-1, "7", None):
            with self.assertRaises(epd.InvalidArgument):
                epd.admin.evict(a, bad)
        c = epd.connect(self.daemon["socket"])
        c.close()
        with self.assertRaises(epd.Unavailable):
            epd.admin.status(c)

    def test_not_admin(self):
        """Reading is open to all; the verbs answer PermissionDenied and change nothing."""
        if os.geteuid() != 0:
            self.check_not_admin(DAEMON["socket"])  # no admin_group: only root is an admin
            return
        a = self.connect("adm-owner")
        name = unique("guarded")
        self.group(a, name)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setgroups([])
                os.setgid(self.NOBODY)
                os.setuid(self.NOBODY)
                self.check_not_admin(self.daemon["socket"], name)
                code = 0
            except BaseException as e:  # reported through the exit status
                sys.stderr.write("as nobody: %r\n" % (e,))
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        self.assertEqual(status, 0)
        self.assertEqual(self.find(epd.admin.groups(a), "name", name)["state"], "READY")
        self.assertIs(epd.admin.status(a)["draining"], False)

    def check_not_admin(self, socket, group="any"):
        with epd.connect(socket, name="not-admin") as c:
            self.assertFalse(c.capabilities() & _lib.CAP_ADMIN)
            self.assertGreaterEqual(epd.admin.status(c)["num_clients"], 1)
            epd.admin.groups(c)
            for verb in (lambda: epd.admin.drain(c, group), lambda: epd.admin.drain(c),
                         lambda: epd.admin.undrain(c), lambda: epd.admin.evict(c, 1),
                         lambda: epd.admin.resize(c, group, 2 << 20)):
                with self.assertRaises(epd.PermissionDenied) as cm:
                    verb()
                self.assertIn("admin", cm.exception.message)


class TestExample(unittest.TestCase):
    def run_example(self, *args):
        cmd = [sys.executable, os.path.join(REPO, "examples", "moe_worker.py"),
               "--socket", DAEMON["socket"], "--ranks", "2", "--experts", "4", "--hidden",
               "64", "--tokens", "16", "--topk", "2"] + list(args)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("PASS", out.stdout)
        return out.stdout

    def test_expand(self):
        self.run_example("--layout", "expand", "--alignment", "4")

    def test_non_expand(self):
        self.run_example("--layout", "non_expand", "--steps", "3")

    def test_detects_wrong_results(self):
        cmd = [sys.executable, os.path.join(REPO, "examples", "moe_worker.py"),
               "--socket", DAEMON["socket"], "--ranks", "2", "--experts", "4", "--hidden",
               "64", "--tokens", "16", "--topk", "2", "--tol", "1e-7"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertIn("FAIL", out.stdout)


if __name__ == "__main__":
    unittest.main()
