"""torch tensors through the binding on CPU, against a real host-backend epd.

The torch path of epd.Group.dispatch / combine (epd/tensors.py) is the one CUDA tensors take;
only where memory comes from differs (CPU tensors: shared-memory regions and staging; CUDA
tensors: registered device allocations). These tests run that plumbing here, without a GPU:
descriptors from tensor pointers, strided and non-contiguous inputs, zero-token ranks, output
tensors allocated per dispatch or given by the caller (``out=``), capacity errors, dtypes, the
CombineResult, cached dispatch, the DeepEP front's torch layout and its intranode check (a
Buffer by group name, from a process group of threads, and from a torch.distributed gloo
group of processes; over client- and daemon-executed groups), and the loader's search order. Skipped without torch. tests/python/test_gpu.py covers CUDA tensors on a GPU host.
"""

import ctypes
import importlib.util
import os
import pickle
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import epd  # noqa: E402
import test_binding as tb  # noqa: E402
from epd import _lib, tensors  # noqa: E402
from epd.compat.deep_ep import Buffer, EventOverlap  # noqa: E402
from reference import Routing  # noqa: E402

HAVE_TORCH = importlib.util.find_spec("torch") is not None
if HAVE_TORCH:
    import torch


def setUpModule():
    if HAVE_TORCH:
        tb.DAEMON.clear()
        tb.DAEMON.update(tb.start_daemon())


def tearDownModule():
    if tb.DAEMON:
        tb.stop_daemon(tb.DAEMON)
        tb.DAEMON.clear()


def bits(t):
    """bf16 bits of a CPU tensor (or a NumPy array) as uint16."""
    if isinstance(t, np.ndarray):
        return t.view(np.uint16)
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def tbf16(a):
    """A bf16 tensor holding uint16 bits ``a``."""
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)


@unittest.skipUnless(HAVE_TORCH, "torch not installed")
class TestTorchHelpers(unittest.TestCase):
    def test_normalise_and_extent(self):
        t = torch.zeros(4, 8, dtype=torch.bfloat16)
        self.assertIs(tensors._normalise(t), t)
        self.assertEqual(tensors._extent(t), (64, 0))
        wide = torch.zeros(4, 12, dtype=torch.float32)
        v = wide[:, 2:10]
        self.assertIs(tensors._normalise(v), v)
        self.assertEqual(tensors._extent(v), ((3 * 12 + 8) * 4, 12))
        tr = wide.t()  # column stride != 1
        n = tensors._normalise(tr)
        self.assertIsNot(n, tr)
        self.assertTrue(n.is_contiguous())
        col = wide[:, 3]  # 1-D with stride 12
        self.assertTrue(tensors._normalise(col).is_contiguous())
        self.assertEqual(tensors._extent(torch.zeros(0, 8)), (0, 0))
        one = wide[1:2, :5]
        self.assertIs(tensors._normalise(one), one)
        self.assertEqual(tensors._extent(one), (20, 0))

    def test_dtypes(self):
        x, dt = tensors.payload(torch.zeros(2, 2, dtype=torch.float32), _lib.DTYPE_BF16, "x")
        self.assertEqual((x.dtype, dt), (torch.bfloat16, torch.bfloat16))
        x, dt = tensors.payload(torch.zeros(2, 2, dtype=torch.int16), _lib.DTYPE_BF16, "x")
        self.assertEqual(dt, torch.int16)
        x, dt = tensors.payload(torch.zeros(2, 2, dtype=torch.uint8), _lib.DTYPE_FP8_E4M3, "x")
        self.assertEqual(dt, torch.uint8)
        with self.assertRaises(epd.InvalidArgument):
            tensors.payload(torch.zeros(2, 2, dtype=torch.int32), _lib.DTYPE_BF16, "x")
        with self.assertRaises(epd.InvalidArgument):
            tensors.payload(torch.zeros(2, 2, dtype=torch.bfloat16), _lib.DTYPE_FP8_E4M3, "x")
        with self.assertRaises(epd.InvalidArgument):
            tensors._topk(torch.zeros(2, 2))
        self.assertEqual(tensors._topk(torch.zeros(2, 2, dtype=torch.int16)).dtype, torch.int64)
        self.assertEqual(tensors.torch_dtype(_lib.DTYPE_INT32), torch.int32)
        fp8 = getattr(torch, "float8_e4m3fn", None)
        if fp8 is not None:
            self.assertEqual(tensors.torch_dtype(_lib.DTYPE_FP8_E4M3), fp8)
            _, dt = tensors.payload(torch.zeros(2, 2, dtype=torch.uint8).view(fp8),
                                    _lib.DTYPE_FP8_E4M3, "x")
            self.assertEqual(dt, fp8)

    def test_numpy_round_trip(self):
        a = epd.float_to_bf16(np.array([[1.5, -2.0]], np.float32))
        t = tensors.from_numpy(a, torch.bfloat16)
        self.assertEqual(t.float().tolist(), [[1.5, -2.0]])
        np.testing.assert_array_equal(tensors.to_numpy(t), a)
        ro = np.arange(4, dtype=np.int64)
        ro.setflags(write=False)
        self.assertEqual(tensors.from_numpy(ro).tolist(), [0, 1, 2, 3])
        self.assertFalse(tensors.is_tensor(a))
        self.assertTrue(tensors.is_tensor(t))
        self.assertFalse(tensors.is_cuda(t))


@unittest.skipUnless(HAVE_TORCH, "torch not installed")
class TestTorchOps(unittest.TestCase):
    def world(self, R, **cfg):
        w = tb.World(R, **cfg)
        self.addCleanup(w.close)
        return w

    def check_dispatch(self, ref, r, res, H, layout="non_expand", zero_padding=False,
                       weights=True):
        want = ref.dest(r)
        self.assertEqual(res.num_recv_tokens, want["num_recv_tokens"])
        self.assertEqual(res.num_expanded_rows, want["num_expanded_rows"])
        self.assertEqual(list(res.num_recv_tokens_per_expert), want["per_expert"])
        np.testing.assert_array_equal(res.rank_prefix, want["rank_prefix"])
        self.assertIsInstance(res.recv_x, torch.Tensor)
        rows = ref.recv_x(r)
        got = bits(res.recv_x)
        self.assertEqual(got.shape[0], len(rows))
        for i, row in enumerate(rows):
            if row is not None:
                np.testing.assert_array_equal(got[i], row)
            elif zero_padding:
                self.assertFalse(got[i].any())
        np.testing.assert_array_equal(res.recv_src.numpy(), want["recv_src"])
        self.assertEqual(res.recv_src.dtype, torch.int64)
        if layout == "non_expand":
            np.testing.assert_array_equal(res.recv_topk_idx.numpy(), want["recv_topk_idx"])
        else:
            np.testing.assert_array_equal(res.recv_topk_slot.numpy(), want["recv_topk_slot"])
            self.assertEqual(res.recv_topk_slot.dtype, torch.int32)
        if weights:
            np.testing.assert_array_equal(res.recv_topk_weights.numpy(), want["recv_weights"])
        else:
            self.assertIsNone(res.recv_topk_weights)

    def run_case(self, layout, use_arena, alignment=1, zero_padding=False, topk_dtype=np.int64,
                 shared_inputs=False, R=2):
        E, H, T, K = 4 * R, 64, 16, 3
        w = self.world(R, num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K)
        xs, _, topks, ws = tb.make_inputs(R, E, H, T, K, 40 + R, topk_dtype=topk_dtype,
                                          tokens=[T, 0] + [5] * (R - 2))
        ref = Routing(R, E, T, xs, topks, ws, layout=layout, alignment=alignment)
        if shared_inputs:  # tensors over epd.empty arrays: described in place
            tx = []
            for r in range(R):
                a = w.clients[r].empty((T, H + 8), "bf16")
                a[:len(xs[r]), :H] = xs[r]
                tx.append(tensors.from_numpy(a, torch.bfloat16)[:len(xs[r]), :H])
        else:
            tx = [tbf16(x) for x in xs]
        tk = [torch.from_numpy(t) for t in topks]
        tw = [torch.from_numpy(x) for x in ws]
        self.last_x = tx
        res = w.collective(lambda r, g: g.dispatch(
            tx[r], topk_idx=tk[r], topk_weights=tw[r], layout=layout,
            expert_alignment=alignment, zero_padding=zero_padding, use_arena=use_arena,
            async_op=True))
        for r in range(R):
            self.assertIsInstance(res[r], epd.DispatchResult, res[r])
            self.check_dispatch(ref, r, res[r], H, layout, zero_padding)
            self.assertEqual(res[r].recv_x.dtype, torch.bfloat16)
            self.assertEqual(res[r].recv_topk_weights.dtype, torch.float32)
            self.assertEqual(res[r].kernel_ns, 0)  # host backend
            if layout == "non_expand":
                self.assertEqual(res[r].recv_topk_idx.dtype,
                                 torch.int32 if topk_dtype == np.int32 else torch.int64)
        # Combine: y = received rows (untouched), one bias, weights applied for EXPAND.
        bias = [tbf16(epd.float_to_bf16(np.full((len(xs[r]), H), 0.25, np.float32)))
                for r in range(R)]
        comb = w.collective(lambda r, g: g.combine(
            res[r].recv_x, res[r].handle, bias=bias[r],
            apply_weights=layout == "expand", async_op=True))
        ys = [bits(x.recv_x) for x in res]
        for r in range(R):
            self.assertIsInstance(comb[r], epd.CombineResult, comb[r])
            cx, cw = comb[r]
            self.assertEqual(cx.dtype, torch.bfloat16)
            np.testing.assert_array_equal(
                bits(cx), ref.combine(r, ys, [bits(bias[r])], apply_weights=layout == "expand"))
            np.testing.assert_array_equal(cw.numpy(), ref.combined_weights(r))
            self.assertEqual(comb[r].kernel_ns, 0)
            self.assertEqual(comb[r].num_tokens, len(xs[r]))
        return w, res, ref, xs

    def test_non_expand_client_outputs(self):
        self.run_case("non_expand", use_arena=False)

    def test_non_expand_arena(self):
        self.run_case("non_expand", use_arena=None)

    def test_expand_client_outputs_int32(self):
        self.run_case("expand", use_arena=False, alignment=4, zero_padding=True,
                      topk_dtype=np.int32)

    def test_expand_arena_r3(self):
        self.run_case("expand", use_arena=True, alignment=2, R=3)

    def test_combine_weight_inputs(self):
        # recv_weights (NON_EXPAND): combined_topk_weights is their reduction over the ranks.
        w, res, ref, xs = self.run_case("non_expand", use_arena=True)
        R, K = len(xs), 3
        rng = np.random.default_rng(61)
        rws = [rng.standard_normal((x.num_rows, K)).astype(np.float32) for x in res]
        comb = w.collective(lambda r, g: g.combine(
            res[r].recv_x, res[r].handle, recv_weights=torch.from_numpy(rws[r]),
            async_op=True))
        for r in range(R):
            cx, cw = comb[r]
            self.assertEqual(cw.dtype, torch.float32)
            np.testing.assert_array_equal(cw.numpy(), ref.combined_weights(r, rws))
        # source_weights (EXPAND, apply_weights): w(t, k) instead of the dispatch's weights.
        w, res, ref, xs = self.run_case("expand", use_arena=False, alignment=2)
        sws = [rng.standard_normal((len(x), K)).astype(np.float32) for x in xs]
        comb = w.collective(lambda r, g: g.combine(
            res[r].recv_x, res[r].handle, apply_weights=True,
            source_weights=torch.from_numpy(sws[r]), async_op=True))
        ys = [bits(x.recv_x) for x in res]
        for r in range(R):
            cx, _ = comb[r]
            np.testing.assert_array_equal(
                bits(cx), ref.combine(r, ys, apply_weights=True, source_weights=sws[r]))

    def test_shared_inputs_in_place(self):
        # Inputs over shared memory (row-strided) must not be copied.
        orig = tensors._HostMemory.copy_target
        copies = []

        def spy(self, t, op):
            copies.append(t.data_ptr())
            return orig(self, t, op)

        tensors._HostMemory.copy_target = spy
        try:
            self.run_case("non_expand", use_arena=True, shared_inputs=True)
        finally:
            tensors._HostMemory.copy_target = orig
        # topk, weights and biases are ordinary tensors: copied; x never.
        self.assertTrue(copies)
        for x in self.last_x:
            self.assertNotIn(x.data_ptr(), copies)

    def test_cached_float_input_and_copy_outputs(self):
        R, E, H, T, K = 2, 8, 64, 16, 2
        w = self.world(R, num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K)
        xs, _, topks, ws = tb.make_inputs(R, E, H, T, K, 51)
        fx = [torch.from_numpy(epd.bf16_to_float(x)) for x in xs]  # float32: rounded exactly
        res = w.collective(lambda r, g: g.dispatch(fx[r], topk_idx=torch.from_numpy(topks[r]),
                                                   topk_weights=ws[r], copy_outputs=True,
                                                   async_op=True))
        ref = Routing(R, E, T, xs, topks, ws)
        for r in range(R):
            self.check_dispatch(ref, r, res[r], H)
        w2 = [torch.from_numpy(x * 2) for x in ws]
        cached = w.collective(lambda r, g: g.dispatch(tbf16(xs[r]), handle=res[r].handle,
                                                      topk_weights=w2[r], use_arena=False,
                                                      async_op=True))
        ref2 = Routing(R, E, T, xs, topks, [x * 2 for x in ws])
        for r in range(R):
            self.assertIs(cached[r].handle, res[r].handle)
            self.check_dispatch(ref2, r, cached[r], H)
        for r in range(R):
            res[r].handle.release()  # copies outlive the handle's arena space
        np.testing.assert_array_equal(bits(res[0].recv_x),
                                      np.array(ref.recv_x(0)).reshape(-1, H))

    def test_out_tensors_and_capacity(self):
        R, E, H, T, K = 2, 8, 64, 16, 2
        w = self.world(R, num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K)
        xs, _, topks, ws = tb.make_inputs(R, E, H, T, K, 52, minus_one=0)
        ref = Routing(R, E, T, xs, topks, ws)
        cap = R * T
        # rank 0: outputs in shared memory (in place); rank 1: plain tensors (copied back).
        outs = []
        for r in range(R):
            if r == 0:
                c = w.clients[0]
                o = {"recv_x": tensors.from_numpy(c.empty((cap, H), "bf16"), torch.bfloat16),
                     "recv_topk_idx": tensors.from_numpy(c.empty((cap, K), np.int64)),
                     "recv_topk_weights": tensors.from_numpy(c.empty((cap, K), np.float32))}
            else:
                o = {"recv_x": torch.zeros(cap, H, dtype=torch.bfloat16),
                     "recv_src": torch.zeros(cap, dtype=torch.int64)}
            outs.append(o)
        res = w.collective(lambda r, g: g.dispatch(tbf16(xs[r]), topk_idx=topks[r],
                                                   topk_weights=ws[r], use_arena=False,
                                                   out=outs[r], async_op=True))
        for r in range(R):
            self.check_dispatch(ref, r, res[r], H)
            n = res[r].num_recv_tokens
            self.assertEqual(res[r].recv_x.data_ptr(), outs[r]["recv_x"].data_ptr())
            np.testing.assert_array_equal(bits(outs[r]["recv_x"][:n]), bits(res[r].recv_x))
        np.testing.assert_array_equal(outs[1]["recv_src"][:res[1].num_recv_tokens].numpy(),
                                      ref.dest(1)["recv_src"])
        # combine into a caller tensor outside shared memory: copied back.
        out_c = [torch.full((len(xs[r]), H), 7.0, dtype=torch.bfloat16) for r in range(R)]
        comb = w.collective(lambda r, g: g.combine(res[r].recv_x, res[r].handle, out=out_c[r],
                                                   async_op=True))
        ys = [bits(x.recv_x) for x in res]
        for r in range(R):
            self.assertIs(comb[r][0], out_c[r])
            np.testing.assert_array_equal(bits(out_c[r]), ref.combine(r, ys))
        # Too few rows: CAPACITY_EXCEEDED on every rank.
        res = w.collective(lambda r, g: g.dispatch(tbf16(xs[r]), topk_idx=topks[r],
                                                   use_arena=False, recv_capacity=1,
                                                   async_op=True))
        tb.TestOpErrors.expect_all(self, res, epd.CapacityExceeded)

    def test_zero_tokens_single_rank(self):
        w = self.world(1, num_experts=4, hidden=64, max_tokens_per_rank=8, max_topk=2)
        g = w.groups[0]
        x = torch.zeros(0, 64, dtype=torch.bfloat16)
        tk = torch.zeros(0, 2, dtype=torch.int64)
        for use_arena in (True, False):
            res = g.dispatch(x, topk_idx=tk, use_arena=use_arena)
            self.assertEqual(res.num_recv_tokens, 0)
            self.assertEqual(tuple(res.recv_x.shape), (0, 64))
            cx, cw = g.combine(res.recv_x, res.handle)
            self.assertEqual(tuple(cx.shape), (0, 64))
            self.assertIsNone(cw)
            res.handle.release()

    def test_local_errors_and_futures(self):
        w = self.world(1, num_experts=4, hidden=64, max_tokens_per_rank=8, max_topk=2)
        g = w.groups[0]
        x = torch.zeros(2, 64, dtype=torch.bfloat16)
        tk = torch.tensor([[0, 1], [2, -1]])
        with self.assertRaises(epd.InvalidArgument):
            g.dispatch(torch.zeros(2, 64, dtype=torch.int32), topk_idx=tk)
        with self.assertRaises(epd.InvalidArgument):
            g.dispatch(x, topk_idx=tk.float())
        with self.assertRaises(epd.InvalidArgument):
            g.dispatch(x)  # no topk_idx
        with self.assertRaises(epd.InvalidArgument):
            g.dispatch(x, topk_idx=tk, out={"recv_x": x}, use_arena=True)
        with self.assertRaises(epd.InvalidArgument):
            g.dispatch(x, topk_idx=tk, use_arena=False, out={"recv_topk_slot": x})
        with self.assertRaises(epd.InvalidArgument):
            g.dispatch(x, topk_idx=tk, use_arena=False, out={"recvx": x})
        with self.assertRaises(epd.InvalidArgument):
            g.dispatch(x, topk_idx=tk, use_arena=False,
                       out={"recv_x": torch.zeros(8, 32, dtype=torch.bfloat16)})
        with self.assertRaises(epd.InvalidArgument):
            g.dispatch(np.zeros((2, 64), np.uint16), topk_idx=tk.numpy(), out={})
        fut = g.dispatch(x, topk_idx=tk, async_op=True)
        self.assertIsNone(fut.outputs)  # CPU: outputs only through wait()
        self.assertIsNone(fut.device)
        with self.assertRaises(epd.InvalidArgument):
            fut.stream_wait()  # no CUDA device to take the current stream of
        res = fut.wait(timeout=10)
        self.assertEqual(res.num_recv_tokens, 2)
        with self.assertRaises(epd.InvalidArgument):
            g.combine(res.recv_x, res.handle, out=torch.zeros(3, 64, dtype=torch.bfloat16))
        with self.assertRaises(epd.InvalidArgument):
            g.combine(res.recv_x, res.handle, bias=(x, x, x))
        with self.assertRaises(epd.InvalidArgument):
            g.combine(res.recv_x.float().to(torch.int32), res.handle)
        # Row-strided recv_x view and float y: accepted (copied/rounded).
        y = torch.zeros(res.num_recv_tokens, 80)[:, :64] + 1.0
        cx, _ = g.combine(y, res.handle)
        self.assertEqual(cx.float().tolist(), [[1.0] * 64] * 2)

    def test_gpu_calls_unavailable_here(self):
        with epd.connect(tb.DAEMON["socket"]) as c:
            self.assertFalse(c.gpu_memory)
            self.assertEqual(c.capabilities() & _lib.CAP_CUDA_REGIONS, 0)
            if _lib.load().optional.get("epd_client_capabilities") is not None:
                self.assertTrue(c.capabilities() & _lib.CAP_HOST_REGIONS)
            else:
                self.assertEqual(c.capabilities(), 0)  # an older libepd cannot tell
            with self.assertRaises(epd.Unavailable):
                c.register_device(0x7F0000000000, 64)
            with self.assertRaises(epd.InvalidArgument):
                c.register_device(0x7F0000000000)
            self.assertEqual(c.release_device_memory(), 0)


@unittest.skipUnless(HAVE_TORCH, "torch not installed")
class TestDeepEPTorch(unittest.TestCase):
    def test_layout_matches_numpy(self):
        R, E = 4, 16
        w = tb.World(R, num_experts=E)
        try:
            b = Buffer(w.groups[0])
            rng = np.random.default_rng(3)
            tk = np.where(rng.random((20, 4)) < 0.2, -1,
                          np.stack([rng.permutation(E)[:4] for _ in range(20)]))
            a = b.get_dispatch_layout(tk, E)
            t = b.get_dispatch_layout(torch.from_numpy(tk), E, async_finish=True)
            for i in (0, 2, 3):
                self.assertIsInstance(t[i], torch.Tensor)
                np.testing.assert_array_equal(t[i].numpy(), a[i])
                self.assertEqual(t[i].numpy().dtype, a[i].dtype)
            self.assertIsInstance(t[4], EventOverlap)
            t[4].current_stream_wait()  # nothing to wait for
            with self.assertRaises(epd.InvalidArgument):
                b.get_dispatch_layout(torch.from_numpy(tk) + 100, E)
        finally:
            w.close()

    def test_intranode_rank_pattern(self):
        """DeepEP's intranode test on CPU tensors: see test_gpu.deepep_intranode. By default
        over client-executed groups (the host backend runs CPU tensors so), and over
        daemon-executed ones."""
        R = 3
        for execution in (None, "daemon"):
            name = tb.unique("deepep-cpu")
            bufs = self.run_ranks(R, lambda r: Buffer(
                name, rank=r, secret=tb.SECRET, socket=tb.DAEMON["socket"], world_size=R,
                num_experts=4 * R, hidden=128, max_tokens_per_rank=32, max_topk=4,
                execution=execution), seed=5)
            self.assertEqual([b.execution for b in bufs], [execution or "client"] * R)

    def test_intranode_process_group(self):
        """The same through Buffers made from a process group (threads), DeepEP's way."""
        R, T, H = 2, 32, 128
        for execution in (None, "daemon"):
            groups = tb.ThreadGroup.world(R)
            with tb.socket_in_environment():
                bufs = self.run_ranks(R, lambda r: Buffer(
                    groups[r], 1 << 20, 0, max_tokens_per_rank=T, device=0,
                    execution=execution), seed=6, shape=(T, H, 4 * R, 4))
            self.assertEqual([b.execution for b in bufs], [execution or "client"] * R)

    def test_intranode_torch_process_group(self):
        """Buffer(torch.distributed group) in one process per rank (gloo), CPU tensors: the
        Buffer chooses client-executed groups."""
        import torch.distributed as dist
        import test_gpu
        if not dist.is_available():
            self.skipTest("torch without torch.distributed")
        R = 2
        names = test_gpu.run_ranks(test_gpu.deepep_pg_worker, R,
                                   (R, tb.DAEMON["socket"], test_gpu._free_port(), 7, True,
                                    False, "client"))
        self.assertEqual(len(set(names.values())), 1, names)

    def run_ranks(self, R, make, **kw):
        """test_gpu.deepep_intranode on CPU tensors, one thread per rank with make(rank)'s
        Buffer."""
        import threading
        import traceback
        import test_gpu
        bufs = [None] * R
        errors = []

        def run(r):
            try:
                bufs[r] = make(r)
                test_gpu.deepep_intranode(bufs[r], r, R, torch.device("cpu"), **kw)
            except Exception:
                errors.append(traceback.format_exc())

        threads = [threading.Thread(target=run, args=(r,)) for r in range(R)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for b in bufs:
            if b is not None:
                b.destroy()
        self.assertEqual(errors, [])
        return bufs


class TestCombineResult(unittest.TestCase):
    def test_tuple_and_pickle(self):
        r = epd.CombineResult(np.zeros(2), None, exec_ns=5, kernel_ns=7, queue_ns=1,
                              op_number=3, num_tokens=2)
        x, w = r
        self.assertIsNone(w)
        self.assertIs(r.combined_x, x)
        self.assertEqual((r.exec_ns, r.kernel_ns), (5, 7))
        again = pickle.loads(pickle.dumps(r))
        self.assertEqual(again.kernel_ns, 7)
        self.assertIsInstance(again, epd.CombineResult)
        self.assertIn("kernel_ns=7", repr(r))


class TestLoader(unittest.TestCase):
    """Where libepd is looked for: EPD_LIBRARY (file or directory), then LD_LIBRARY_PATH."""

    def probe(self, env):
        code = ("import sys; sys.path.insert(0, %r); import epd; print(epd.library_path())" %
                os.path.join(REPO, "client", "python"))
        base = {k: v for k, v in os.environ.items()
                if k not in ("EPD_LIBRARY", "LD_LIBRARY_PATH")}
        base.update(env)
        return subprocess.run([sys.executable, "-c", code], env=base, capture_output=True,
                              text=True, timeout=60)

    def lib(self):
        path = epd.library_path()
        if os.sep not in path:
            self.skipTest("libepd came from the system loader")
        return os.path.realpath(path)

    def test_directory_in_epd_library(self):
        d = os.path.dirname(self.lib())
        env = {"EPD_LIBRARY": d}
        # libepd's own dependencies may live on LD_LIBRARY_PATH (a GPU host without them
        # installed); EPD_LIBRARY still decides which libepd is loaded.
        if "LD_LIBRARY_PATH" in os.environ:
            env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
        out = self.probe(env)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(os.path.dirname(out.stdout.strip()), d)

    def test_ld_library_path(self):
        d = os.path.dirname(self.lib())
        out = self.probe({"LD_LIBRARY_PATH": "/nonexistent:" + d})
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), os.path.join(d, "libepd.so")
                         if os.path.exists(os.path.join(d, "libepd.so"))
                         else os.path.join(d, "libepd.so.0"))
        self.assertEqual(_lib.candidate_paths()[0], os.environ.get("EPD_LIBRARY") or
                         _lib.candidate_paths()[0])

    def test_wrong_epd_library_wins(self):
        d = os.path.dirname(self.lib())
        out = self.probe({"EPD_LIBRARY": "/nonexistent/dir/libepd.so", "LD_LIBRARY_PATH": d})
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("/nonexistent/dir/libepd.so", out.stderr)

    def test_optional_symbols(self):
        lib = _lib.load()
        for name in ("epd_region_register_device", "epd_group_mark_inputs_ready",
                     "epd_device_alloc", "epd_device_free"):
            self.assertIn(name, lib.optional)
        self.assertEqual(ctypes.sizeof(_lib.DispatchArgs), 928)


if __name__ == "__main__":
    unittest.main()
