"""Client-executed groups from Python (Group.cx_dispatch / Group.cx_combine, epd.cx) on the host
backend: every layout, bit for bit against reference.py (docs/semantics.md §2, §2.6, §2.7, §3),
the counts and statuses, zero-copy views, and collective failures; and DeepEP's low-latency
front on NumPy arrays (test_gpu.deepep_low_latency at 2 and 8 ranks among them).
"""

import concurrent.futures
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

from test_binding import SECRET, start_daemon, stop_daemon, unique  # noqa: E402

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
                # bytes: fp32 scales bit for bit, or ue8m0's e + 127
                self.assertEqual(res.recv_x_scales.dtype, fp8_scales[s].dtype)
                np.testing.assert_array_equal(res.recv_x_scales[i].view(np.uint8),
                                              fp8_scales[s][t].view(np.uint8))
            else:
                np.testing.assert_array_equal(res.recv_x[i], ref.xs[s][t])

    def layout_case(self, R, layout, alignment=1, zero_padding=False, block_rows=0,
                    quant=False, weights=True, topk_dtype=np.int64, seed=1, group_quant=None,
                    round_scale=False, ue8m0=False, H=256):
        E, K, T = 4 * R, 4, 12
        rng = np.random.default_rng(seed)
        xs, topks, ws = make_inputs(rng, R, [T - s for s in range(R)], E, K, H, weights,
                                    topk_dtype)
        ref = Routing(R, E, T, xs, topks, ws, layout=layout, alignment=alignment,
                      block_rows=block_rows)
        q = [quantize(x, round_scale=round_scale, ue8m0=ue8m0) for x in xs] if quant else None
        with CxWorld(R, num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K,
                     max_expert_alignment=alignment, expert_block_rows=block_rows,
                     quantize=quant if group_quant is None else group_quant) as w:
            def go(r, g):
                res = g.cx_dispatch(xs[r], topk_idx=topks[r],
                                    topk_weights=ws[r] if weights else None, layout=layout,
                                    expert_alignment=alignment, zero_padding=zero_padding,
                                    expert_block_rows=block_rows, quantize=quant,
                                    round_scale=round_scale,
                                    scale_format="ue8m0" if ue8m0 else "fp32")
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
        # bf16 rows in a group that may quantize: no scales are read or sent.
        self.layout_case(2, "expand", block_rows=24, seed=7, group_quant=True)
        self.layout_case(3, "non_expand", seed=8, group_quant=True)

    def test_round_scale_and_ue8m0(self):
        # §2.7's options: power-of-two scales as fp32, and as ue8m0 bytes in rows of 2 blocks
        # (every row starts at an even byte) and of 4 blocks (one int32 word).
        self.layout_case(2, "non_expand", quant=True, round_scale=True, seed=9)
        self.layout_case(3, "expand", quant=True, round_scale=True, ue8m0=True, alignment=2,
                         zero_padding=True, seed=10)
        self.layout_case(2, "expand", quant=True, round_scale=True, ue8m0=True, block_rows=24,
                         seed=11, H=512)
        self.layout_case(2, "non_expand", quant=True, round_scale=True, ue8m0=True, seed=12,
                         H=384)

    def test_scale_option_refusals(self):
        # Collective INVALID_ARGUMENT naming the field, on every rank.
        for kw, text in (({"quantize": True, "scale_format": "ue8m0"},
                          "scale_format UE8M0 needs round_scale"),
                         ({"round_scale": True}, "round_scale and scale_format need quantize"),
                         ({"round_scale": True, "scale_format": "ue8m0"},
                          "round_scale and scale_format need quantize")):
            with CxWorld(2, hidden=128, max_tokens_per_rank=4, max_topk=2, quantize=True) as w:
                def go(r, g):
                    try:
                        g.cx_dispatch(np.zeros((2, 128), np.uint16),
                                      topk_idx=np.array([[0], [5]], np.int64), **kw)
                    except epd.InvalidArgument as e:
                        return str(e)
                    return None
                errs = w.run(go)
                for e in errs:
                    self.assertIsNotNone(e, kw)
                    self.assertIn(text, e)
        with CxWorld(1, hidden=128, max_tokens_per_rank=4, max_topk=2, quantize=True) as w:
            with self.assertRaisesRegex(epd.InvalidArgument, "scale_format"):
                w.groups[0].cx_dispatch(np.zeros((2, 128), np.uint16),
                                        topk_idx=np.zeros((2, 1), np.int64), quantize=True,
                                        round_scale=True, scale_format="e8m0")

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
                return first, g.cx_status(), b.op_number
            for first, second, op in w.run(go):
                self.assertEqual((first["op"], second["op"], op), (0, 1, 1))
                # Phase times of the rank's OK ops, by kind: one dispatch more, no combine.
                d0, d1 = first["phases"]["dispatch"], second["phases"]["dispatch"]
                self.assertEqual(d1["ops"], d0["ops"] + 1)
                self.assertEqual(second["phases"]["combine"]["ops"],
                                 first["phases"]["combine"]["ops"])
                t0 = d0["exchange_ns"] + d0["move_ns"] + d0["finish_ns"]
                t1 = d1["exchange_ns"] + d1["move_ns"] + d1["finish_ns"]
                self.assertGreater(t1, t0)
                # Each op's window, on the host's monotonic clock: the second after the first.
                self.assertLessEqual(first["window"][0], first["window"][1])
                self.assertLessEqual(first["window"][1], second["window"][0])
                self.assertLessEqual(second["window"][0], second["window"][1])
                # The first phase's parts are counted on the GPU only.
                self.assertEqual(set(second["dispatch_first_ns"].values()), {0})

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
                # The failed dispatch left its slot empty: asking for its counts raises the
                # op's failure, not NOT_FOUND.
                try:
                    g.cx_counts(0)
                    counts_error = None
                except epd.Error as e:
                    counts_error = e
                return errs, g.cx_status(), counts_error
            for errs, st, counts_error in w.run(go):
                self.assertEqual(len(errs), 2)
                self.assertIn("expert_block_rows", errs[0])
                self.assertEqual(st["status_name"], "CAPACITY_EXCEEDED")
                self.assertIsInstance(counts_error, epd.CapacityExceeded)

    def test_recv_rows(self):
        # A group with fewer receive rows than its worst case (R * T * min(K, L) = 32 here): an
        # op that fits runs, one that does not ends CapacityExceeded naming the rows; the group
        # and the size hint report them.
        R, E, K, H, T = 2, 4, 2, 128, 8
        x = np.zeros((T, H), np.uint16)
        # Each rank's tokens to its own first expert: T rows each; then all to rank 0: 4T.
        fits = [np.tile(np.array([[2 * r, -1]], np.int64), (T, 1)) for r in range(R)]
        over = np.tile(np.array([[0, 1]], np.int64), (T, 1))
        c = epd.connect(DAEMON["socket"])
        try:
            hint = c.size_hint(R, E, H, T, K, execution="client", recv_rows=T)
            full = c.size_hint(R, E, H, T, K, execution="client")
        finally:
            c.close()
        self.assertLess(hint["client_buffer_bytes_per_rank"],
                        full["client_buffer_bytes_per_rank"])
        with CxWorld(R, num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K,
                     recv_rows=T) as w:
            def go(r, g):
                ok = g.cx_dispatch(x, topk_idx=fits[r], layout="expand")
                try:
                    g.cx_dispatch(x, topk_idx=over, layout="expand")
                    err = None
                except epd.CapacityExceeded as e:
                    err = str(e)
                return g.recv_rows, ok.num_rows, err
            for r, (rows, got, err) in enumerate(w.run(go)):
                self.assertEqual(rows, T)
                self.assertEqual(got, T)
                self.assertIn("capacity %d" % T, err or "")
        with self.assertRaises(epd.InvalidArgument) as cm:
            with CxWorld(1, num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K,
                         recv_rows=T * K + 1):
                pass
        self.assertIn("recv_rows", str(cm.exception))

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


class TestDeepEPLowLatency(unittest.TestCase):
    """What DeepEP's low-latency test checks, through epd.compat.deep_ep on NumPy arrays."""

    R, T, H, K = 3, 6, 256, 3
    E = 4 * R
    OFFSET = 128  # values rank - OFFSET stay exact in bf16

    def buffers(self, hidden=None, **kw):
        from epd.compat.deep_ep import Buffer
        name = unique("ll")
        bufs = []
        try:
            for r in range(self.R):
                bufs.append(Buffer(name, rank=r, secret=SECRET, socket=DAEMON["socket"],
                                   world_size=self.R, num_experts=self.E,
                                   hidden=hidden or self.H,
                                   max_tokens_per_rank=self.T, max_topk=self.K,
                                   op_timeout_ms=20000, low_latency_mode=True, **kw))
        except BaseException:
            for b in bufs:
                b.destroy()
            raise
        return bufs

    def inputs(self, seed, H=None):
        R, T, K, E = self.R, self.T, self.K, self.E
        H = H or self.H
        rng = np.random.default_rng(seed)
        xs, topks, ws = [], [], []
        for r in range(R):
            x = np.full((T, H), r - self.OFFSET, np.float32)
            x[:, -128:] = np.arange(T, dtype=np.float32)[:, None]
            xs.append(epd.float_to_bf16(x))
            t = np.stack([rng.choice(E, size=K, replace=False) for _ in range(T)])
            t[rng.integers(0, T), rng.integers(0, K)] = -1
            topks.append(t.astype(np.int64))
            ws.append(rng.random((T, K)).astype(np.float32))
        return xs, topks, ws

    def test_dispatch_and_combine(self):
        from epd.compat.deep_ep import LowLatencyHandle
        R, T, H, E = self.R, self.T, self.H, self.E
        L, C = E // R, R * T
        bufs = self.buffers()
        pool = concurrent.futures.ThreadPoolExecutor(R)
        try:
            for case, (use_fp8, zero_copy) in enumerate([(False, False), (False, True),
                                                         (True, False), (True, True)]):
                xs, topks, ws = self.inputs(case)
                all_topk = np.stack(topks)
                q = [quantize(x) for x in xs]

                def go(r):
                    b = bufs[r]
                    stats = np.zeros(L, np.int32)
                    recv_x, recv_count, handle, event, hook = b.low_latency_dispatch(
                        xs[r], topks[r], T, E, cumulative_local_expert_recv_stats=stats,
                        use_fp8=use_fp8, async_finish=True)
                    event.current_stream_wait()
                    hook()
                    self.assertIsInstance(handle, LowLatencyHandle)
                    data = recv_x[0] if use_fp8 else recv_x
                    self.assertEqual(data.shape, (L, C, H))
                    got = {"count": recv_count.copy(), "stats": stats,
                           "src_info": handle[0].copy(), "layout": handle[1].copy(),
                           "data": data.copy(),
                           "scales": recv_x[1].copy() if use_fp8 else None,
                           "meta": tuple(handle[2:])}
                    # The expert: its input as bf16 (DeepEP's simulated GEMM), unchanged.
                    sim = data.copy() if not use_fp8 else epd.float_to_bf16(
                        (reference_dequant(recv_x[0], recv_x[1])))
                    if zero_copy:
                        b.get_next_low_latency_combine_buffer(handle)[...] = sim
                    out = np.empty((T, H), np.uint16)
                    combined, event, hook = b.low_latency_combine(
                        sim, topks[r], ws[r], handle, zero_copy=zero_copy, out=out)
                    hook()
                    self.assertIs(combined, out)
                    got["sim"], got["combined"] = sim.reshape(L * C, H), combined.copy()
                    return got

                res = [f.result(60) for f in [pool.submit(go, r) for r in range(R)]]
                ref = Routing(R, E, T, [a for a, _ in q] if use_fp8 else xs, topks, ws,
                              layout="expand", block_rows=C)
                for r, g in enumerate(res):
                    self.assertEqual(g["meta"], (T, H, E))
                    for i in range(L):
                        e = r * L + i
                        n = int(g["count"][i])
                        self.assertEqual(n, int((all_topk == e).sum()))
                        self.assertEqual(g["stats"][i], n)
                        lay = g["layout"][i]
                        self.assertEqual(int((lay & 0xFFFFFFFF).sum()), n)
                        rows = g["data"][i][:n]
                        src = g["src_info"][i][:n]
                        if not use_fp8:
                            vals = epd.bf16_to_float(rows)
                            np.testing.assert_array_equal(vals[:, :-128].min(1),
                                                          vals[:, :-128].max(1))
                            np.testing.assert_array_equal(vals[:, -128:],
                                                          np.repeat(src[:, None], 128, 1))
                            for j in range(R):
                                begin, cnt = int(lay[j] >> 32), int(lay[j] & 0xFFFFFFFF)
                                self.assertEqual(cnt, int((all_topk[j] == e).sum()))
                                np.testing.assert_array_equal(
                                    vals[begin:begin + cnt, :-128], j - self.OFFSET)
                        self.assertTrue((g["src_info"][i][n:] == -1).all())
                    exp = ref.dest(r)
                    keep = exp["recv_src"] >= 0
                    np.testing.assert_array_equal(g["data"].reshape(L * C, H)[keep],
                                                  np.stack([r_ for r_ in ref.recv_x(r)
                                                            if r_ is not None]))
                    if use_fp8:
                        np.testing.assert_array_equal(
                            g["scales"].reshape(L * C, -1)[keep],
                            np.stack([q[s][1][t] for s, t, _ in
                                      [x for x in exp["rows"] if x is not None]]))
                ys = [g["sim"] for g in res]
                for s in range(R):
                    want = ref.combine(s, ys, apply_weights=True, source_weights=ws[s])
                    np.testing.assert_array_equal(res[s]["combined"], want)
                    if not use_fp8:
                        # DeepEP's check: x times the sum of the token's unmasked weights.
                        approx = epd.bf16_to_float(xs[s]) * \
                            np.where(topks[s] >= 0, ws[s], 0).sum(1)[:, None]
                        np.testing.assert_allclose(epd.bf16_to_float(want), approx,
                                                   rtol=1e-2, atol=1e-2)
        finally:
            pool.shutdown()
            for b in bufs:
                b.destroy()

    def test_unsupported_options_and_names(self):
        import epd.compat.deep_ep as de
        bufs = self.buffers()
        try:
            b = bufs[0]
            x = np.zeros((self.T, self.H), np.uint16)
            tk = np.zeros((self.T, self.K), np.int64)
            for kw, text in (({"round_scale": True, "use_fp8": False}, "need use_fp8"),
                             ({"use_ue8m0": True}, "use_ue8m0 needs round_scale"),
                             ({"use_ue8m0": True, "round_scale": True},
                              "multiple of 512")):
                with self.assertRaisesRegex(epd.InvalidArgument, text):
                    b.low_latency_dispatch(x, tk, self.T, self.E, **kw)
            with self.assertRaisesRegex(NotImplementedError, "use_logfmt"):
                b.low_latency_combine(x, tk, None, None, use_logfmt=True)
            with self.assertRaisesRegex(epd.InvalidArgument, "num_experts"):
                b.low_latency_dispatch(x, tk, self.T, self.E + 1)
            with self.assertRaisesRegex(epd.InvalidArgument, "num_max_dispatch_tokens"):
                b.clean_low_latency_buffer(self.T + 1, self.H, self.E)
            self.assertIsNone(b.clean_low_latency_buffer(self.T, self.H, self.E))
            for call, name in ((lambda: b.runtime, "runtime"),
                               (lambda: b.get_local_buffer_tensor(np.uint8),
                                "get_local_buffer_tensor"),
                               (lambda: b.low_latency_update_mask_buffer(1, True),
                                "low_latency_update_mask_buffer")):
                with self.assertRaisesRegex(NotImplementedError, name):
                    call()
            if epd.tensors.torch_module() is None:
                with self.assertRaisesRegex(NotImplementedError, "get_comm_stream"):
                    b.get_comm_stream()
                self.assertEqual(de.topk_idx_t, np.dtype(np.int64))
            cfg = de.Buffer.get_dispatch_config(self.R)
            self.assertIsInstance(cfg, de.Config)
            old = de.Buffer.num_sms
            try:
                de.Buffer.set_num_sms(24)
                self.assertEqual(de.Buffer.get_combine_config().num_sms, 24)
                with self.assertRaises(epd.InvalidArgument):
                    de.Buffer.set_num_sms(23)
            finally:
                de.Buffer.set_num_sms(old)
            self.assertIsInstance(de.Buffer.capture(), de.EventOverlap)
            self.assertIsInstance(de.is_sm90_compiled(), bool)
            small = de.Buffer.get_low_latency_rdma_size_hint(4, 256, 2, 8,
                                                             socket=DAEMON["socket"])
            big = de.Buffer.get_low_latency_rdma_size_hint(64, 256, 2, 8,
                                                           socket=DAEMON["socket"])
            self.assertGreater(small, 0)
            self.assertGreater(big, small)
        finally:
            for b in bufs:
                b.destroy()


class TestDeepEPLowLatencyScales(unittest.TestCase):
    """low_latency_dispatch's round_scale and use_ue8m0 (§2.7), hidden 512 as ue8m0 needs."""

    R, T, H, K = 3, 6, 512, 3
    E = 4 * R
    OFFSET = TestDeepEPLowLatency.OFFSET
    buffers = TestDeepEPLowLatency.buffers
    inputs = TestDeepEPLowLatency.inputs

    def test_round_scale_and_ue8m0(self):
        R, T, H, E = self.R, self.T, self.H, self.E
        L, C = E // R, R * T
        bufs = self.buffers()
        pool = concurrent.futures.ThreadPoolExecutor(R)
        try:
            for case, ue8m0 in enumerate([False, True]):
                xs, topks, ws = self.inputs(20 + case)
                q = [quantize(x, round_scale=True, ue8m0=ue8m0) for x in xs]

                def go(r):
                    recv_x, recv_count, handle, event, hook = bufs[r].low_latency_dispatch(
                        xs[r], topks[r], T, E, use_fp8=True, round_scale=True,
                        use_ue8m0=ue8m0)
                    data, scales = recv_x
                    self.assertEqual(data.shape, (L, C, H))
                    # DeepEP's shapes: fp32 [L, R·T, H/128], or int32 [L, R·T, H/512]
                    self.assertEqual(scales.shape, (L, C, H // (512 if ue8m0 else 128)))
                    self.assertEqual(scales.dtype, np.int32 if ue8m0 else np.float32)
                    out = {"data": data.copy(), "scales": scales.copy()}
                    # the combine that the dispatch's handle slot expects next
                    sim = epd.float_to_bf16(np.zeros((L, C, H), np.float32))
                    bufs[r].low_latency_combine(sim, topks[r], ws[r], handle)
                    return out

                res = [f.result(60) for f in [pool.submit(go, r) for r in range(R)]]
                ref = Routing(R, E, T, [a for a, _ in q], topks, ws, layout="expand",
                              block_rows=C)
                for r, g in enumerate(res):
                    exp = ref.dest(r)
                    keep = exp["recv_src"] >= 0
                    rows = [x for x in exp["rows"] if x is not None]
                    np.testing.assert_array_equal(g["data"].reshape(L * C, H)[keep],
                                                  np.stack([q[s][0][t] for s, t, _ in rows]))
                    got = g["scales"].reshape(L * C, -1)[keep]
                    want = np.stack([q[s][1][t] for s, t, _ in rows])
                    if ue8m0:  # word w holds blocks 4w .. 4w+3, the lowest byte first
                        want = want.astype("<u4").reshape(len(want), -1, 4)
                        want = (want << np.array([0, 8, 16, 24], "<u4")).sum(-1)
                        np.testing.assert_array_equal(got.view("<u4"), want)
                    else:
                        vals = got.view(np.uint32)
                        self.assertTrue(((vals & 0x7FFFFF) == 0).all(), "powers of two")
                        np.testing.assert_array_equal(vals, want.view(np.uint32))
        finally:
            pool.shutdown()
            for b in bufs:
                b.destroy()


class TestDeepEPLowLatencyRanks(unittest.TestCase):
    """test_gpu.deepep_low_latency (what test_gpu.TestDeepEPLowLatency runs on CUDA tensors)
    on NumPy arrays at 2 and 8 ranks, one thread per rank, in test_gpu's shapes."""

    def run_r(self, R):
        import test_gpu
        from epd.compat.deep_ep import Buffer
        T, H, E, K = test_gpu.TestDeepEPLowLatency.SHAPES[R]
        name = unique("ll-ranks")

        def go(r):
            buf = Buffer(name, rank=r, secret=SECRET, socket=DAEMON["socket"], world_size=R,
                         num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K,
                         op_timeout_ms=60000, low_latency_mode=True)
            try:
                return test_gpu.deepep_low_latency(buf, r, R, None, 970 + R)
            finally:
                buf.destroy()

        with concurrent.futures.ThreadPoolExecutor(R) as pool:
            futs = [pool.submit(go, r) for r in range(R)]
            self.assertEqual([f.result(timeout=300) for f in futs], [True] * R)

    def test_r2(self):
        self.run_r(2)

    def test_r8(self):
        self.run_r(8)


def reference_dequant(data, scales):
    """fp8 e4m3 bytes times their per-128-channel scales, as float32 (DeepEP's
    per_token_cast_back)."""
    from reference import _E4M3
    mag = _E4M3[np.minimum(data & 0x7F, 0x7E)].astype(np.float32)
    val = np.where(data & 0x80, -mag, mag).astype(np.float32)
    return val * np.repeat(scales, 128, axis=-1)


if __name__ == "__main__":
    unittest.main()
