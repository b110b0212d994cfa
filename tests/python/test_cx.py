"""Client-executed groups from Python (Group.cx_dispatch / Group.cx_combine, epd.cx) on the host
backend: every layout, bit for bit against reference.py (docs/semantics.md §2, §2.6, §2.7, §3),
the counts and statuses, zero-copy views, and collective failures.
"""

import concurrent.futures
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

from test_binding import REPO, SECRET, start_daemon, stop_daemon, unique  # noqa: E402,F401

import epd  # noqa: E402
from reference import Routing, quantize  # noqa: E402

DAEMON = {}


def setUpModule():
    DAEMON.update(start_daemon())


def tearDownModule():
    if DAEMON:
        stop_daemon(DAEMON)


class CxWorld:
    """R clients, each holding one rank of one client-executed group."""

    def __init__(self, R, **cfg):
        cfg.setdefault("num_experts", 4 * R)
        cfg.setdefault("hidden", 128)
        cfg.setdefault("max_tokens_per_rank", 12)
        cfg.setdefault("max_topk", 4)
        cfg.setdefault("op_timeout_ms", 20000)
        self.name = unique("cx")
        self.R, self.cfg = R, cfg
        self.clients = [epd.connect(DAEMON["socket"], name="cx-%d" % r) for r in range(R)]
        try:
            self.groups = [epd.Group.create(self.clients[0], self.name, SECRET, 0,
                                            world_size=R, execution="client", **cfg)]
            for r in range(1, R):
                self.groups.append(epd.Group.join(self.clients[r], self.name, SECRET, r))
        except BaseException:
            self.close()
            raise
        self.pool = concurrent.futures.ThreadPoolExecutor(R)

    def run(self, fn):
        """fn(rank, group) on every rank at once (each op waits for its peers); the results in
        rank order, or the first exception."""
        futs = [self.pool.submit(fn, r, g) for r, g in enumerate(self.groups)]
        return [f.result(timeout=60) for f in futs]

    def close(self):
        if hasattr(self, "pool"):
            self.pool.shutdown()
        for c in self.clients:
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def make_inputs(rng, R, N, E, K, H, weights=True, topk_dtype=np.int64):
    xs, topks, ws = [], [], []
    for s in range(R):
        n = N[s] if isinstance(N, (list, tuple)) else N
        x = epd.float_to_bf16(rng.standard_normal((n, H)).astype(np.float32) * (s + 1))
        t = np.full((n, K), -1, topk_dtype)
        for i in range(n):
            k = rng.integers(0, K + 1)
            t[i, :k] = rng.choice(E, size=k, replace=False)
        xs.append(x)
        topks.append(t)
        ws.append(rng.random((n, K)).astype(np.float32) if weights else None)
    return xs, topks, (ws if weights else None)


class TestCxGroup(unittest.TestCase):

    def check_dispatch(self, ref, d, res, fp8_x=None, fp8_scales=None, zero_padding=False):
        exp = ref.dest(d)
        self.assertEqual(res.num_recv_tokens, exp["num_recv_tokens"])
        self.assertEqual(res.num_expanded_rows, exp["num_expanded_rows"])
        np.testing.assert_array_equal(res.num_recv_tokens_per_expert, exp["per_expert"])
        np.testing.assert_array_equal(res.num_recv_tokens_per_expert_aligned, exp["aligned"])
        np.testing.assert_array_equal(res.rank_prefix, exp["rank_prefix"])
        rows = exp["rows"]
        self.assertEqual(res.recv_x.shape[0], len(rows))
        np.testing.assert_array_equal(res.recv_src, exp["recv_src"])
        if ref.layout == "non_expand":
            np.testing.assert_array_equal(res.recv_topk_idx, exp["recv_topk_idx"])
            self.assertIsNone(res.recv_topk_slot)
        else:
            self.assertIsNone(res.recv_topk_idx)
            np.testing.assert_array_equal(res.recv_topk_slot, exp["recv_topk_slot"])
        if exp["recv_weights"] is None:
            self.assertIsNone(res.recv_weights)
        else:
            got = res.recv_weights
            want = exp["recv_weights"]
            if ref.layout == "expand" and not zero_padding:
                keep = exp["recv_src"] >= 0
                got, want = got[keep], want[keep]
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        for i, r in enumerate(rows):
            if r is None:
                if zero_padding:
                    self.assertFalse(res.recv_x[i].any(), "padding row %d" % i)
                continue
            s, t = r[0], r[1]
            if fp8_x is not None:
                np.testing.assert_array_equal(res.recv_x[i], fp8_x[s][t])
                np.testing.assert_array_equal(res.recv_x_scales[i].view(np.uint32),
                                              fp8_scales[s][t].view(np.uint32))
            else:
                np.testing.assert_array_equal(res.recv_x[i], ref.xs[s][t])

    def layout_case(self, R, layout, alignment=1, zero_padding=False, block_rows=0,
                    quant=False, weights=True, topk_dtype=np.int64, seed=1):
        E, K, H, T = 4 * R, 4, 256, 12
        rng = np.random.default_rng(seed)
        xs, topks, ws = make_inputs(rng, R, [T - s for s in range(R)], E, K, H, weights,
                                    topk_dtype)
        ref = Routing(R, E, T, xs, topks, ws, layout=layout, alignment=alignment,
                      block_rows=block_rows)
        q = [quantize(x) for x in xs] if quant else None
        with CxWorld(R, num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K,
                     max_expert_alignment=alignment, expert_block_rows=block_rows,
                     quantize=quant) as w:
            def go(r, g):
                res = g.cx_dispatch(xs[r], topk_idx=topks[r],
                                    topk_weights=ws[r] if weights else None, layout=layout,
                                    expert_alignment=alignment, zero_padding=zero_padding,
                                    expert_block_rows=block_rows, quantize=quant)
                self.check_dispatch(ref, r, res, [a for a, _ in q] if q else None,
                                    [b for _, b in q] if q else None, zero_padding)
                # The expert: y = -recv as bf16 (quantized rows: a function of the row index).
                y, yw = g.cx_y(res.handle)
                if quant:
                    y[...] = epd.float_to_bf16(np.arange(y.size, dtype=np.float32)
                                               .reshape(y.shape) % 97 - r)
                else:
                    y[...] = res.recv_x ^ 0x8000
                ys_local = y.copy()
                src_w = (rng_w[r] if layout == "expand" else None)
                kw = {}
                if layout == "expand":
                    kw = {"apply_weights": True, "source_weights": src_w}
                else:
                    rw = (res.recv_topk_idx >= 0).astype(np.float32) * (r + 0.5)
                    yw[...] = rw  # in place: cx_combine copies nothing
                    kw = {"recv_weights": yw}
                bias = epd.float_to_bf16(np.full((len(xs[r]), H), r, np.float32))
                combined = g.cx_combine(y, res.handle, bias=bias, **kw)
                return ys_local, combined, kw.get("recv_weights", np.zeros(0)).copy()
            rng_w = [np.random.default_rng(100 + r).random((len(xs[r]), K)).astype(np.float32)
                     for r in range(R)]
            out = w.run(go)
        ys = [o[0] for o in out]
        for s in range(R):
            combined, cw = out[s][1]
            bias = epd.float_to_bf16(np.full((len(xs[s]), H), s, np.float32))
            if layout == "expand":
                want = ref.combine(s, ys, biases=(bias,), apply_weights=True,
                                   source_weights=rng_w[s])
                if weights:
                    np.testing.assert_array_equal(cw, ref.combined_weights(s))
                else:
                    self.assertIsNone(cw)
            else:
                want = ref.combine(s, ys, biases=(bias,))
                rws = [o[2] for o in out]
                np.testing.assert_array_equal(cw.view(np.uint32),
                                              ref.combined_weights(s, rws).view(np.uint32))
            np.testing.assert_array_equal(combined, want)

    def test_non_expand(self):
        self.layout_case(2, "non_expand")
        self.layout_case(3, "non_expand", weights=False, topk_dtype=np.int32, seed=2)

    def test_expand(self):
        self.layout_case(2, "expand", alignment=4, zero_padding=True)
        self.layout_case(3, "expand", alignment=2, seed=3)
        self.layout_case(2, "expand", weights=False, seed=4)

    def test_fixed_expert_blocks(self):
        # §2.6 with C = R·T, DeepEP's low-latency shape, and a smaller aligned C.
        self.layout_case(2, "expand", block_rows=2 * 12, zero_padding=True)
        self.layout_case(2, "expand", alignment=2, block_rows=16, seed=5)

    def test_quantizing_dispatch(self):
        self.layout_case(2, "non_expand", quant=True)
        self.layout_case(2, "expand", quant=True, block_rows=24, seed=6)

    def test_fp8_group(self):
        R, E, K, H, T = 2, 8, 2, 256, 8
        rng = np.random.default_rng(7)
        xs, topks, ws = make_inputs(rng, R, T, E, K, H)
        q = [quantize(x) for x in xs]
        ref = Routing(R, E, T, [a for a, _ in q], topks, ws)
        with CxWorld(R, num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K,
                     dtype="fp8") as w:
            def go(r, g):
                res = g.cx_dispatch(q[r][0], topk_idx=topks[r], topk_weights=ws[r],
                                    x_scales=q[r][1])
                self.check_dispatch(ref, r, res, [a for a, _ in q], [b for _, b in q])
                return res.num_recv_tokens
            self.assertEqual(w.run(go), [ref.dest(d)["num_recv_tokens"] for d in range(R)])

    def test_cached_dispatch_and_counts(self):
        R, E, K, H, T = 2, 8, 3, 128, 10
        rng = np.random.default_rng(8)
        xs, topks, ws = make_inputs(rng, R, T, E, K, H)
        xs2, _, ws2 = make_inputs(rng, R, T, E, K, H)
        ref2 = Routing(R, E, T, xs2, topks, ws2, layout="expand", alignment=2)
        with CxWorld(R, num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K,
                     max_expert_alignment=2, num_handle_slots=2) as w:
            def go(r, g):
                a = g.cx_dispatch(xs[r], topk_idx=topks[r], topk_weights=ws[r],
                                  layout="expand", expert_alignment=2, handle=1)
                first = g.cx_status()
                b = g.cx_dispatch(xs2[r], topk_weights=ws2[r], handle=1, cached=True,
                                  layout="expand", expert_alignment=2)
                self.check_dispatch(ref2, r, b)
                # Views of one receive area: the second dispatch rewrote the first's rows.
                self.assertEqual(a.recv_x.ctypes.data, b.recv_x.ctypes.data)
                c = g.cx_counts(1)
                np.testing.assert_array_equal(c["rank_prefix"], b.rank_prefix)
                np.testing.assert_array_equal(
                    c["expert_base"][:-1],
                    np.concatenate([[0], np.cumsum(b.num_recv_tokens_per_expert_aligned)[:-1]]))
                return first["op"], g.cx_status()["op"], b.op_number
            for first, second, op in w.run(go):
                self.assertEqual((first, second, op), (0, 1, 1))

    def test_capacity_failure_is_collective_and_sticky(self):
        R, E, K, H, T = 2, 4, 2, 128, 8
        topk = np.tile(np.array([[0, 2]], np.int64), (T, 1))  # every token to expert 0 and 2
        x = np.zeros((T, H), np.uint16)
        with CxWorld(R, num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K,
                     expert_block_rows=8) as w:
            def go(r, g):
                errs = []
                for _ in range(2):
                    try:
                        g.cx_dispatch(x, topk_idx=topk, layout="expand", expert_block_rows=8)
                    except epd.CapacityExceeded as e:
                        errs.append(str(e))
                return errs, g.cx_status()
            for errs, st in w.run(go):
                self.assertEqual(len(errs), 2)
                self.assertIn("expert_block_rows", errs[0])
                self.assertEqual(st["status_name"], "CAPACITY_EXCEEDED")

    def test_refusals(self):
        with CxWorld(1, num_experts=4, hidden=128, max_tokens_per_rank=4, max_topk=2) as w:
            g = w.groups[0]
            x = np.zeros((2, 128), np.uint16)
            with self.assertRaises(epd.InvalidArgument):
                g.cx_combine(x, 0)  # nothing dispatched into slot 0
            with self.assertRaisesRegex(epd.InvalidArgument, "slot number"):
                g.cx_dispatch(x, topk_idx=np.zeros((2, 1), np.int64), handle=5)
            with self.assertRaisesRegex(epd.InvalidArgument, "stream"):
                g.cx_dispatch(x, topk_idx=np.zeros((2, 1), np.int64), stream=1)
            res = g.cx_dispatch(x, topk_idx=np.array([[0], [3]], np.int64))
            self.assertEqual(res.num_recv_tokens, 2)
            with self.assertRaisesRegex(epd.InvalidArgument, "daemon-executed|client-executed"):
                g.dispatch(x, topk_idx=np.array([[0], [3]], np.int64))
        c = epd.connect(DAEMON["socket"])
        try:
            g = epd.Group.create(c, unique("daemon"), SECRET, 0, world_size=1, num_experts=2,
                                 hidden=64, max_tokens_per_rank=2, max_topk=1)
            self.assertEqual(g.execution, "daemon")
            with self.assertRaisesRegex(epd.InvalidArgument, "daemon-executed"):
                g.cx_dispatch(np.zeros((1, 64), np.uint16), topk_idx=np.zeros((1, 1)))
            with self.assertRaisesRegex(epd.InvalidArgument, "execution"):
                epd.Group.create(c, unique("bad"), SECRET, 0, world_size=1, num_experts=2,
                                 hidden=64, max_tokens_per_rank=2, max_topk=1,
                                 execution="gpu")
        finally:
            c.close()


if __name__ == "__main__":
    unittest.main()
