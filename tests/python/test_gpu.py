"""GPU tests of the Python binding: torch CUDA tensors against a cuda-backend epd.

* TestTorchMatchesHost: the same dispatch / combine / cached dispatch cases run twice, with
  NumPy arrays against a host-backend daemon and with torch CUDA tensors against a cuda-backend
  daemon, one process per rank (multiprocessing 'spawn'); every output must be bit-identical
  (EXPAND padding rows that are not zero-padded are left out: nobody writes them). Ranks 2 and 4;
  the CUDA tensors come from PyTorch's allocator, or (``*_device_alloc``) every input and the
  caller outputs are views of one ``Client.device_alloc`` allocation per rank.
* TestDeepEPIntranode: DeepEP's intranode test through epd.compat.deep_ep with CUDA tensors:
  x holds its source rank's number, so every received row must equal its source rank (rows are
  ordered by source rank, handle[0] column rank bounds them); combining the untouched received
  rows and dividing by the number of ranks each token reached gives x back, exactly in bf16.
  combine uses async_finish, so its output is read after event.current_stream_wait() without a
  host wait. Also the cached dispatch, dispatch routed by is_token_in_rank alone,
  num_worst_tokens (fixed shapes, no host wait) and fp8 on the same Buffer. Ranks 2, 4 and
  8, with the Buffer made by group name (daemon-executed) and (``*_process_group``) from a
  torch.distributed gloo process group, DeepEP's way (the Buffer chooses the execution). The
  ``*_client`` cases run it over client-executed groups, every rank on GPU 0: 1 rank, and 2,
  4 and 8 ranks (by name, and from a process group whose Buffer must choose client-executed
  groups) where the daemon makes such groups of several processes (CUDA MPS), else skipped.
* TestDeepEPLowLatency: DeepEP's low-latency test through the DeepEP front
  (``low_latency_mode``: a client-executed group, every rank on GPU 0) with CUDA tensors:
  1 rank, and 2 and 8 ranks under CUDA MPS (else skipped). bf16 and fp8 dispatch (fp32
  scales, round_scale, use_ue8m0) of rank-stamped and of random rows: received rows and
  scales bit for bit against reference.py (and each stamped row's source read back from its
  values), dequantized rows against x, recv_count, handle[0] and handle[1],
  cumulative_local_expert_recv_stats, return_recv_hook; combine (copied and zero_copy, with
  and without ``out``) bit for bit against reference.py and within DeepEP's calc_diff bound.
  tests/python/test_cx.py runs the same check on NumPy arrays against a host-backend daemon.
* TestDeepEPClientExecuted: the DeepEP front over a client-executed group of one rank:
  outputs that outlive later dispatches, previous_event on a side stream with async_finish,
  num_worst_tokens without a host wait, a refilled slot's handle refused, and a failed op's
  error raised at the next host wait.
* TestInProcess: the registration cache (one region per CUDA allocation), stream ordering (the
  daemon waits for the stream's earlier work; Future.stream_wait orders the stream after the
  op), caller outputs, recv_capacity and CAPACITY_EXCEEDED, arena outputs copied to the device,
  kernel_ns, and Client.device_alloc's lifetime (tensor views, the cache, free, close).
* TestClientExecuted: a client-executed group of one rank: Group.cx_dispatch / cx_combine on
  torch CUDA tensors bitwise against reference.py (fixed expert blocks, quantizing dispatch,
  weighted combine), and two MoE layers captured with torch.cuda.graph and replayed 100 times
  with new inputs, bitwise equal to eager execution.

Needs torch with CUDA, a GPU, a libepd built with CUDA (EPD_LIBRARY) and the epd binary
(EPD_BIN_DIR, else PATH, else build/bin). Without them every test skips, unless
EPD_GPU_REQUIRED=1 (set by run_gpu.py) makes that a failure.

    EPD_LIBRARY=/path/libepd.so EPD_BIN_DIR=/path/bin python3 -m unittest -v test_gpu
"""

import multiprocessing
import os
import shutil
import signal
import socket as socketlib
import subprocess
import sys
import tempfile
import time
import traceback
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import epd  # noqa: E402
from epd import tensors  # noqa: E402

SECRET = b"0123456789abcdef-python-gpu-tests"
REQUIRED = os.environ.get("EPD_GPU_REQUIRED") == "1"
DAEMONS = {}
WORKER_TIMEOUT = 240
ALLOC_BYTES = 64 << 20  # per rank in the device_alloc cases; every case fits in it


# ---- environment ----

def find_epd():
    d = os.environ.get("EPD_BIN_DIR")
    if d:
        return os.path.join(d, "epd")
    return shutil.which("epd") or os.path.join(REPO, "build", "bin", "epd")


def no_gpu_reason():
    """Why the GPU tests cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed for %s" % sys.executable
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    try:
        lib = epd._lib.load()
    except OSError as e:
        return str(e)
    if lib.optional.get("epd_region_register_device") is None:
        return "libepd (%s) has no epd_region_register_device" % lib.path
    if not os.access(find_epd(), os.X_OK):
        return "no epd binary at %s (set EPD_BIN_DIR)" % find_epd()
    return None


def start_daemon(backend):
    workdir = tempfile.mkdtemp(prefix="epd-gputest-%s-" % backend)
    sock = os.path.join(workdir, "epd.sock")
    logpath = os.path.join(workdir, "epd.log")
    log = open(logpath, "wb")
    proc = subprocess.Popen([find_epd(), "--backend", backend, "--socket", sock, "--config",
                             "/dev/null"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60  # the cuda backend initialises every GPU first
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_SEQPACKET) as s:
                s.connect(sock)
            return {"proc": proc, "socket": sock, "dir": workdir, "log": log, "logpath": logpath}
        except OSError:
            time.sleep(0.02)
    proc.kill()
    proc.wait()
    with open(logpath, errors="replace") as f:
        raise RuntimeError("epd --backend %s did not start: %s" % (backend, f.read()[-3000:]))


def stop_daemon(d):
    proc = d["proc"]
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    d["log"].close()
    shutil.rmtree(d["dir"], ignore_errors=True)


def daemon_log(backend):
    d = DAEMONS.get(backend)
    if not d:
        return ""
    with open(d["logpath"], errors="replace") as f:
        return f.read()[-4000:]


def setUpModule():
    reason = no_gpu_reason()
    if reason:
        if REQUIRED:
            raise RuntimeError("GPU tests required (EPD_GPU_REQUIRED=1) but: " + reason)
        raise unittest.SkipTest(reason)
    DAEMONS["host"] = start_daemon("host")
    DAEMONS["cuda"] = start_daemon("cuda")
    with epd.connect(DAEMONS["cuda"]["socket"]) as c:
        backend = c.info()["backend"]
        gpu = c.gpu_memory
    if backend != "cuda" or not gpu:
        why = ("the daemon runs the '%s' backend" % backend if backend != "cuda" else
               "the connection has no CAP_CUDA_REGIONS (libepd built without CUDA?)")
        tearDownModule()
        if REQUIRED:
            raise RuntimeError("GPU tests required but " + why)
        raise unittest.SkipTest(why)


def tearDownModule():
    for d in DAEMONS.values():
        stop_daemon(d)
    DAEMONS.clear()


# ---- processes, one per rank ----

def run_ranks(target, R, args, timeout=WORKER_TIMEOUT):
    """Runs target(rank, *args, queue) in R 'spawn' processes; returns their results by rank.
    Raises AssertionError with every failing rank's traceback."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(target, r, args, queue)) for r in range(R)]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < R:
        left = deadline - time.monotonic()
        if left <= 0:
            errors.append("timed out after %d s waiting for %d rank(s)" %
                          (timeout, R - len(results) - len(errors)))
            break
        try:
            rank, status, payload = queue.get(timeout=min(left, 1.0))
        except Exception:
            if all(not p.is_alive() for p in procs) and queue.empty():
                errors.append("every rank exited; results from %s only" % sorted(results))
                break
            continue
        if status == "ok":
            results[rank] = payload
        else:
            errors.append("rank %d:\n%s" % (rank, payload))
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return results


def _rank_main(target, rank, args, queue):
    try:
        queue.put((rank, "ok", target(rank, *args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def _enter(client, name, rank, R, **shape):
    if rank == 0:
        return epd.Group.create(client, name, SECRET, 0, world_size=R, op_timeout_ms=60000,
                                **shape)
    device = shape.get("device", 0)
    return epd.Group.join(client, name, SECRET, rank, device=device, retry_timeout=60)


def _cuda_device(rank):
    import torch
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


# ---- (a) torch on the cuda backend vs NumPy on the host backend ----

CASES = {
    2: [dict(name="r2_ne_bf16_w_bias2_cached", E=8, H=256, T=48, K=4, dtype="bf16",
             layout="non_expand", align=1, zp=False, weights=True, topk=np.int64, nbias=2,
             apply=False, cached=True, async_=False, seed=801),
        dict(name="r2_ex_bf16_a4_zp_apply_i32_async", E=8, H=128, T=32, K=3, dtype="bf16",
             layout="expand", align=4, zp=True, weights=True, topk=np.int32, nbias=1,
             apply=True, cached=True, async_=True, seed=802)],
    4: [dict(name="r4_ne_fp8_w_cached_async", E=16, H=256, T=40, K=4, dtype="fp8",
             layout="non_expand", align=1, zp=False, weights=True, topk=np.int64, nbias=0,
             apply=False, cached=True, async_=True, seed=803),
        dict(name="r4_ex_bf16_a2_noweights", E=16, H=512, T=64, K=6, dtype="bf16",
             layout="expand", align=2, zp=False, weights=False, topk=np.int64, nbias=1,
             apply=False, cached=False, async_=False, seed=804),
        dict(name="r4_ne_bf16_i32_bias1", E=8, H=1024, T=128, K=2, dtype="bf16",
             layout="non_expand", align=1, zp=False, weights=True, topk=np.int32, nbias=1,
             apply=False, cached=False, async_=False, seed=805)],
}

FIELDS = ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights", "recv_src",
          "recv_topk_slot")


def case_inputs(case, R):
    import test_binding as tb
    return tb.make_inputs(R, case["E"], case["H"], case["T"], case["K"], case["seed"],
                          dtype=case["dtype"], topk_dtype=case["topk"])


def case_y(case, rank, rows, tag=0):
    rng = np.random.default_rng([case["seed"], 77, rank, tag])
    return epd.float_to_bf16(rng.standard_normal((rows, case["H"]), dtype=np.float32))


def _np(value):
    if value is None:
        return None
    if tensors.is_tensor(value):
        return np.ascontiguousarray(tensors.to_numpy(value.detach().cpu()))
    return np.ascontiguousarray(value)


def _dispatch_record(res):
    rec = {f: _np(getattr(res, f)) for f in FIELDS}
    rec.update(num_recv_tokens=res.num_recv_tokens, num_expanded_rows=res.num_expanded_rows,
               per_expert=np.asarray(res.num_recv_tokens_per_expert).tolist(),
               aligned=np.asarray(res.num_recv_tokens_per_expert_aligned).tolist(),
               rank_prefix=np.asarray(res.rank_prefix).tolist(), kernel_ns=res.kernel_ns)
    return rec


class _Bump:
    """Tensors carved one after another from a DeviceAllocation (256-byte aligned)."""

    def __init__(self, alloc):
        self.alloc = alloc
        self.used = 0

    def take(self, shape, dtype):
        import torch
        item = torch.empty(0, dtype=dtype).element_size()
        n = item
        for d in shape:
            n *= int(d)
        off = (self.used + 255) // 256 * 256
        if off + n > self.alloc.nbytes:
            raise AssertionError("ALLOC_BYTES is too small (test bug)")
        self.used = off + n
        return self.alloc.tensor(tuple(shape), dtype, offset=off)


def case_worker(rank, kind, R, sock, prefix, cases):
    """One rank: every case of ``cases`` on the daemon at ``sock``; NumPy arrays for the host
    backend, torch CUDA tensors for the cuda one ("cuda": PyTorch's allocator; "cuda_alloc":
    inputs and outputs in a Client.device_alloc allocation). Returns {case name: record}."""
    torch = None
    dev = None
    if kind in ("cuda", "cuda_alloc"):
        import torch
        dev = _cuda_device(rank)
    out = {}
    with epd.connect(sock, name="gpu-test-%s-%d" % (kind, rank)) as client:
        alloc = client.device_alloc(ALLOC_BYTES, dev.index) if kind == "cuda_alloc" else None
        for case in cases:
            bump = _Bump(alloc) if alloc is not None else None
            shape = dict(num_experts=case["E"], hidden=case["H"],
                         max_tokens_per_rank=case["T"], max_topk=case["K"], dtype=case["dtype"])
            if dev is not None:
                shape["device"] = dev
            group = _enter(client, prefix + case["name"], rank, R, **shape)
            xs, scales, topks, ws = case_inputs(case, R)
            x, sc, tk = xs[rank], scales[rank], topks[rank]
            w = ws[rank] if case["weights"] else None
            n = len(x)
            if kind != "host":
                def put(a, dt=None):
                    if a is None:
                        return None
                    src = tensors.from_numpy(np.ascontiguousarray(a), dt)
                    if bump is None:
                        return src.to(dev)
                    t = bump.take(src.shape, src.dtype)
                    t.copy_(src)
                    return t
                xdt = torch.bfloat16 if case["dtype"] == "bf16" else \
                    getattr(torch, "float8_e4m3fn", torch.uint8)
                xin, scin, tkin, win = put(x, xdt), put(sc), put(tk), put(w)
                extra = {}
                if bump is not None:
                    # Every dispatch output in the allocation too, at the worst case's rows.
                    cap = group.worst_case_rows(case["layout"], case["K"], case["align"])
                    topk_code = epd._lib.DTYPE_INT32 if case["topk"] == np.int32 else \
                        epd._lib.DTYPE_INT64
                    specs = group._output_specs(case["layout"], case["K"], topk_code,
                                                case["weights"], case["align"], cap)
                    extra["out"] = {name: bump.take(dims, xdt if name == "recv_x" else
                                                    tensors.torch_dtype(code))
                                    for name, dims, code in specs}
            else:
                def put(a, dt=None):
                    return a
                xin, scin, tkin, win = x, sc, tk, w
                extra = {"copy_outputs": True}
            routing = dict(layout=case["layout"], expert_alignment=case["align"],
                           zero_padding=case["zp"])
            res = group.dispatch(xin, topk_idx=tkin, topk_weights=win, x_scales=scin,
                                 async_op=case["async_"], **routing, **extra)
            if case["async_"]:
                if kind != "host":
                    res.current_stream_wait()
                res = res.wait(timeout=120)
            rec = {"dispatch": _dispatch_record(res)}
            rows = res.num_rows
            y = case_y(case, rank, rows)
            biases = [case_y(case, rank, n, tag=1 + i) for i in range(case["nbias"])]
            yin = put(y, torch.bfloat16 if torch else None)
            bin_ = tuple(put(b, torch.bfloat16 if torch else None) for b in biases) or None
            cout = bump.take((n, case["H"]), torch.bfloat16) if bump is not None else None
            comb = group.combine(yin, res.handle, bias=bin_, apply_weights=case["apply"],
                                 async_op=case["async_"], out=cout)
            if case["async_"]:
                if kind != "host":
                    comb.current_stream_wait()
                comb = comb.wait(timeout=120)
            rec["combined_x"] = _np(comb[0])
            rec["combined_topk_weights"] = _np(comb[1])
            rec["combine_kernel_ns"] = comb.kernel_ns
            if case["cached"]:
                w2 = None if w is None else w * np.float32(2)
                again = group.dispatch(xin, handle=res.handle, topk_weights=put(w2),
                                       x_scales=scin, **extra)
                rec["cached"] = _dispatch_record(again)
            res.handle.release()
            group.leave()
            out[case["name"]] = rec
        if alloc is not None:
            alloc.free()
    return out


def _compare(tc, name, rank, host, dev, zero_padding):
    """Bitwise comparison of one dispatch record."""
    for key in ("num_recv_tokens", "num_expanded_rows", "per_expert", "aligned", "rank_prefix"):
        tc.assertEqual(host[key], dev[key], "%s rank %d: %s" % (name, rank, key))
    src = host["recv_src"]
    for f in FIELDS:
        a, b = host[f], dev[f]
        tc.assertEqual(a is None, b is None, "%s rank %d: %s present on one side only" %
                       (name, rank, f))
        if a is None:
            continue
        tc.assertEqual(a.shape, b.shape, "%s rank %d: %s shape" % (name, rank, f))
        if not zero_padding and f in ("recv_x", "recv_x_scales", "recv_topk_weights") and \
                src is not None and len(src) == len(a):
            keep = src >= 0
            a, b = a[keep], b[keep]
        if a.tobytes() != b.tobytes():
            bad = np.nonzero((a.view(np.uint8).reshape(len(a), -1) !=
                              b.view(np.uint8).reshape(len(b), -1)).any(axis=1))[0] \
                if a.ndim and len(a) else []
            tc.fail("%s rank %d: %s differs between host and cuda backends in rows %s" %
                    (name, rank, f, list(bad[:10])))


class TestTorchMatchesHost(unittest.TestCase):
    def run_r(self, R, kind="cuda"):
        cases = CASES[R]
        prefix = "gpu-%d-%d-%s-" % (os.getpid(), R, kind)
        host = run_ranks(case_worker, R, ("host", R, DAEMONS["host"]["socket"], prefix + "h-",
                                          cases))
        try:
            cuda = run_ranks(case_worker, R, (kind, R, DAEMONS["cuda"]["socket"],
                                              prefix + "c-", cases))
        except AssertionError as e:
            raise AssertionError("%s\n--- cuda daemon log ---\n%s" % (e, daemon_log("cuda")))
        from reference import Routing
        for case in cases:
            name = case["name"]
            xs, scales, topks, ws = case_inputs(case, R)
            ref = Routing(R, case["E"], case["T"], xs, topks, ws if case["weights"] else None,
                          layout=case["layout"], alignment=case["align"])
            for r in range(R):
                h, c = host[r][name], cuda[r][name]
                want = ref.dest(r)
                self.assertEqual(h["dispatch"]["per_expert"], want["per_expert"], name)
                np.testing.assert_array_equal(h["dispatch"]["recv_src"], want["recv_src"])
                _compare(self, name, r, h["dispatch"], c["dispatch"], case["zp"])
                for key in ("combined_x", "combined_topk_weights"):
                    a, b = h[key], c[key]
                    self.assertEqual(a is None, b is None, "%s rank %d %s" % (name, r, key))
                    if a is not None:
                        self.assertEqual(a.shape, b.shape)
                        self.assertTrue(a.tobytes() == b.tobytes(),
                                        "%s rank %d: %s differs between host and cuda" %
                                        (name, r, key))
                if case["cached"]:
                    _compare(self, name + "/cached", r, h["cached"], c["cached"], case["zp"])
                self.assertEqual(h["dispatch"]["kernel_ns"], 0)
                self.assertGreater(c["dispatch"]["kernel_ns"], 0, name)
                self.assertGreater(c["combine_kernel_ns"], 0, name)

    def test_r2(self):
        self.run_r(2)

    def test_r4(self):
        self.run_r(4)

    def test_r2_device_alloc(self):
        self.run_r(2, "cuda_alloc")

    def test_r4_device_alloc(self):
        self.run_r(4, "cuda_alloc")


# ---- (b) DeepEP's intranode test through the DeepEP front ----

def deepep_intranode(buf, rank, R, device, seed, steps=2, shape=None):
    """DeepEP's intranode check on ``buf`` (an epd.compat.deep_ep.Buffer) for this rank.

    Every rank derives every rank's routing from ``seed``, so it knows which source each
    received row must come from. ``shape`` is (T, H, E, K) (default: the Buffer's group).
    Works on CPU and CUDA tensors. Per step: dispatch with top-k (async_finish), DeepEP's
    handle[0], combine, cached dispatch (DeepEP's return values), dispatch routed by
    is_token_in_rank alone, num_worst_tokens, and fp8 (a second epd group of the Buffer)
    where torch has float8_e4m3fn.
    """
    import torch
    if shape is None:
        g = buf.group
        shape = (g.max_tokens_per_rank, buf.hidden, buf.num_experts, min(g.max_topk, 4))
    T, H, E, K = shape
    L = E // R
    fp8 = getattr(torch, "float8_e4m3fn", None)
    for step in range(steps):
        topks, weights = [], []
        for s in range(R):
            rng = np.random.default_rng([seed, step, s])
            n = T - (s * 3) % max(1, T // 2)
            tk = np.stack([rng.permutation(E)[:K] for _ in range(n)]).astype(np.int64) \
                if n else np.zeros((0, K), np.int64)
            tk[rng.random((n, K)) < 0.25] = -1
            if n > 2:
                tk[2] = -1  # a token that reaches no rank
            topks.append(tk)
            weights.append(rng.random((n, K), dtype=np.float32))
        n = len(topks[rank])
        x = torch.ones((n, H), dtype=torch.bfloat16, device=device) * rank
        topk_idx = torch.from_numpy(topks[rank]).to(device)
        topk_weights = torch.from_numpy(weights[rank]).to(device)

        ntr, _, nte, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
        dest = [np.where(t >= 0, t // L, -1) for t in topks]
        in_rank_np = [np.stack([(d == r).any(1) for r in range(R)], 1) if len(d)
                      else np.zeros((0, R), bool) for d in dest]
        assert np.array_equal(in_rank.cpu().numpy(), in_rank_np[rank])
        assert np.array_equal(ntr.cpu().numpy(), in_rank_np[rank].sum(0))
        assert np.array_equal(nte.cpu().numpy(),
                              np.bincount(topks[rank][topks[rank] >= 0], minlength=E))

        recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=ntr,
            is_token_in_rank=in_rank, num_tokens_per_expert=nte, async_finish=True)
        event.current_stream_wait()
        per_source = [int(in_rank_np[s][:, rank].sum()) for s in range(R)]
        sources = np.repeat(np.arange(R), per_source)
        nrecv = len(sources)
        assert recv_x.shape == (nrecv, H), (recv_x.shape, nrecv)
        assert recv_x.device == x.device and recv_x.dtype == torch.bfloat16
        rx = recv_x.float()
        assert bool((rx.amax(dim=1) == rx.amin(dim=1)).all()) if nrecv else True
        got = rx[:, 0].cpu().numpy() if nrecv else np.zeros(0)
        assert np.array_equal(got, sources.astype(np.float32)), (got, sources)
        assert list(handle.rank_prefix) == list(np.concatenate([[0], np.cumsum(per_source)]))
        # DeepEP's check_data: rows rank_prefix_matrix[s - 1][rank]:[s][rank] are from s.
        rpm = handle[0]
        assert rpm.shape == (R, R) and rpm.dtype == torch.int32 and rpm.device == x.device
        assert rpm[:, rank].cpu().tolist() == np.cumsum(per_source).tolist()
        assert handle[3].cpu().tolist() == [t for s in range(R)
                                            for t in np.nonzero(in_rank_np[s][:, rank])[0]]
        # Received top-k: local ids of this rank's experts, -1 elsewhere; counts per expert.
        ridx = recv_idx.cpu().numpy()
        want_idx = np.concatenate([np.where(dest[s][in_rank_np[s][:, rank]] == rank,
                                            topks[s][in_rank_np[s][:, rank]] % L, -1)
                                   for s in range(R)]) if nrecv else ridx
        assert np.array_equal(ridx, want_idx)
        assert counts == [int((ridx == i).sum()) for i in range(L)], counts
        want_w = np.concatenate([np.where(dest[s][in_rank_np[s][:, rank]] == rank,
                                          weights[s][in_rank_np[s][:, rank]], 0)
                                 for s in range(R)]) if nrecv else None
        if want_w is not None:
            assert np.array_equal(recv_w.cpu().numpy(), want_w.astype(np.float32))

        # Combine the untouched rows: each token comes back once per rank it reached.
        reached = in_rank.sum(dim=1).to(torch.float32)
        hit = reached > 0

        def check_combined(combined):
            cf = combined.float()
            back = cf[hit] / reached[hit].unsqueeze(1)
            assert bool((back == x.float()[hit]).all()), "combined / reached != x"
            assert bool((cf[~hit] == 0).all()), "tokens that reached no rank did not combine to 0"

        combined, combined_w, event = buf.combine(recv_x, handle, topk_weights=recv_w,
                                                  async_finish=True)
        event.current_stream_wait()  # the current stream reads `combined` after the op
        check_combined(combined)
        assert np.array_equal(combined_w.cpu().numpy(),
                              np.where(topks[rank] >= 0, weights[rank], 0).astype(np.float32))
        # A cached dispatch of 2x: same rows, values doubled; DeepEP's return values.
        recv2, idx2, w2, counts2, handle2, event2 = buf.dispatch(x * 2, handle=handle)
        assert (idx2, w2, counts2, handle2) == (None, None, None, None)
        event2.current_stream_wait()
        if nrecv:
            assert np.array_equal(recv2.float()[:, -1].cpu().numpy(), 2 * sources)

        # Routed by is_token_in_rank alone: the same rows, no top-k outputs.
        recv3, idx3, w3, counts3, handle3, _ = buf.dispatch(
            x, num_tokens_per_rank=ntr, is_token_in_rank=in_rank, num_tokens_per_expert=nte)
        assert idx3 is None and w3 is None
        assert torch.equal(recv3, recv_x)
        # The expert counts come from num_tokens_per_expert through the process group.
        assert counts3 == (counts if buf._comm is not None else None), (counts3, counts)
        assert handle3[0][:, rank].cpu().tolist() == np.cumsum(per_source).tolist()
        combined3, _, _ = buf.combine(recv3, handle3)
        check_combined(combined3)

        # num_worst_tokens: fixed shapes, the rows received first, then top-k ids -1.
        W = R * T
        recv4, idx4, w4, counts4, handle4, event4 = buf.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=ntr,
            is_token_in_rank=in_rank, num_tokens_per_expert=nte, num_worst_tokens=W,
            async_finish=True)
        event4.current_stream_wait()
        assert counts4 == [] and recv4.shape == (W, H) and idx4.shape == (W, K)
        assert torch.equal(recv4[:nrecv], recv_x) and torch.equal(idx4[:nrecv], recv_idx)
        assert bool((idx4[nrecv:] == -1).all())
        assert torch.equal(w4[:nrecv], recv_w)
        combined4, combined_w4, event4 = buf.combine(recv4, handle4, topk_weights=w4,
                                                     async_finish=True)
        event4.current_stream_wait()
        check_combined(combined4)
        assert torch.equal(combined_w4, combined_w)

        if fp8 is not None:
            # fp8 (e4m3 with per-128-channel scales 1): the same rows, through the Buffer's
            # fp8 group, made by this first fp8 call.
            x8 = x.float().to(fp8)
            scales = torch.ones((n, H // 128), dtype=torch.float32, device=device)
            (r8, s8), idx8, _, counts8, handle8, _ = buf.dispatch(
                (x8, scales), topk_idx=topk_idx, num_tokens_per_rank=ntr,
                is_token_in_rank=in_rank, num_tokens_per_expert=nte)
            assert r8.shape == (nrecv, H) and s8.shape == (nrecv, H // 128)
            assert torch.equal(r8.float(), recv_x.float()) and torch.equal(idx8, recv_idx)
            assert counts8 == counts
            combined8, _, _ = buf.combine(recv_x, handle8)
            check_combined(combined8)
        buf.synchronize()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return True


def deepep_worker(rank, R, sock, name, seed, execution="daemon"):
    """deepep_intranode with a Buffer made by group name. Daemon-executed: rank r on GPU
    r % count. Client-executed: every rank on GPU 0 (the GPU of the group's buffers)."""
    import torch
    from epd.compat.deep_ep import Buffer
    if execution == "client":
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
    else:
        dev = _cuda_device(rank)
    buf = Buffer(name, rank=rank, secret=SECRET, socket=sock, world_size=R,
                 num_experts=8 * R, hidden=7168 if R <= 2 else 2048, max_tokens_per_rank=128,
                 max_topk=8, op_timeout_ms=60000, device=dev, execution=execution)
    try:
        assert (buf.execution, buf.group.execution) == (execution, execution)
        return deepep_intranode(buf, rank, R, dev, seed)
    finally:
        buf.destroy()


def deepep_pg_worker(rank, R, sock, port, seed, cpu=False, gpu0=False, expect=None):
    """DeepEP's way: torch.distributed (gloo) first, then Buffer(group); the daemon from
    $EPD_SOCKET; the epd groups made by the first call of each dtype. ``cpu``: CPU tensors
    (a host-backend daemon); ``gpu0``: every rank on GPU 0; ``expect``: the execution the
    Buffer must have chosen. Returns the epd group name the ranks agreed."""
    import torch
    import torch.distributed as dist
    from epd.compat.deep_ep import Buffer
    os.environ["EPD_SOCKET"] = sock
    if cpu:
        dev = torch.device("cpu")
    elif gpu0:
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
    else:
        dev = _cuda_device(rank)
    T, H = (32, 128) if cpu else (128, 2048)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=R)
    try:
        buf = Buffer(dist.group.WORLD, int(1e9), 0, max_tokens_per_rank=T,
                     **({"device": 0} if cpu else {}))
        try:
            # The first dispatch agrees hidden and top-k; num_experts comes from
            # get_dispatch_layout.
            deepep_intranode(buf, rank, R, dev, seed, shape=(T, H, 8 * R, 4))
            if expect is not None:
                assert buf.execution == expect, (buf.execution, expect)
            return buf._name
        finally:
            buf.destroy()
    finally:
        dist.destroy_process_group()


def _free_port():
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mps_refusal():
    """The daemon's refusal of a client-executed group of 2 ranks on GPU 0 (ranks of several
    processes share a GPU only under CUDA MPS), or None when it makes one."""
    import torch
    with epd.connect(DAEMONS["cuda"]["socket"], name="gpu-mps-probe") as c:
        try:
            g = epd.Group.create(c, "mps-probe-%d-%d" % (os.getpid(), time.monotonic_ns()),
                                 SECRET, 0, world_size=2, num_experts=2, hidden=128,
                                 max_tokens_per_rank=1, max_topk=1, execution="client",
                                 device=torch.device("cuda", 0))
        except epd.Unavailable as e:
            return str(e)
        g.leave()
    return None


def skip_without_mps(tc):
    """Skips ``tc`` where the daemon refuses a client-executed group of several processes on
    GPU 0 (no CUDA MPS), naming its reason."""
    why = mps_refusal()
    if why:
        tc.skipTest("client-executed groups of several processes on one GPU: " + why)


class TestDeepEPIntranode(unittest.TestCase):
    """Daemon-executed by group name (rank r on GPU r % count); from a process group the
    Buffer chooses (client-executed where every rank is on one GPU and MPS is on). The
    ``*_client`` cases run client-executed groups, every rank on GPU 0; with several ranks
    they need CUDA MPS and skip without it."""

    def run_r(self, R, pg=False, client=False):
        name = "deepep-gpu-%d-%d-%s" % (os.getpid(), R, "cx" if client else "d")
        sock = DAEMONS["cuda"]["socket"]
        if client and R > 1:
            skip_without_mps(self)
        try:
            if pg:
                run_ranks(deepep_pg_worker, R, (R, sock, _free_port(), 950 + R, False, client,
                                                "client" if client else None))
            else:
                run_ranks(deepep_worker, R, (R, sock, name, 900 + R,
                                             "client" if client else "daemon"))
        except AssertionError as e:
            raise AssertionError("%s\n--- cuda daemon log ---\n%s" % (e, daemon_log("cuda")))

    def test_r2(self):
        self.run_r(2)

    def test_r4(self):
        self.run_r(4)

    def test_r2_process_group(self):
        self.run_r(2, pg=True)

    def test_r4_process_group(self):
        self.run_r(4, pg=True)

    def test_r1_client(self):
        self.run_r(1, client=True)

    def test_r2_client(self):
        self.run_r(2, client=True)

    def test_r4_client(self):
        self.run_r(4, client=True)

    def test_r8(self):
        self.run_r(8)

    def test_r8_client(self):
        self.run_r(8, client=True)

    def test_r2_process_group_client(self):
        """From a process group with every rank's CUDA tensors on GPU 0, the Buffer chooses
        client-executed groups by itself."""
        self.run_r(2, pg=True, client=True)

    def test_r8_process_group_client(self):
        """Eight ranks from a process group on GPU 0: the Buffer's default execution, which
        is client-executed under MPS."""
        self.run_r(8, pg=True, client=True)


# ---- (b2) DeepEP's low-latency test through the DeepEP front ----

LL_CONFIGS = ((False, False, False),  # (use_fp8, round_scale, use_ue8m0): bf16 rows
              (True, False, False),   # fp8, fp32 scales amax / 448
              (True, True, False),    # fp8, power-of-two fp32 scales
              (True, True, True))     # fp8, ue8m0 bytes packed four to an int32
LL_RANK_OFFSET = 128  # a source rank s stamps s - 128 into its rows: exact in bf16
BF16_NAN = 0x7FC0


def calc_diff(x, y):
    """DeepEP's similarity error of two float arrays: 1 - 2<x+1, y+1> / (|x+1|^2 + |y+1|^2),
    0 when they are equal, in float64."""
    a = np.asarray(x, np.float64).ravel() + 1.0
    b = np.asarray(y, np.float64).ravel() + 1.0
    return float(1.0 - 2.0 * np.dot(a, b) / (np.dot(a, a) + np.dot(b, b)))


def pack_ue8m0(exps):
    """ue8m0 bytes ``[..., H/128]`` (uint8 e + 127) as DeepEP's int32 words ``[..., H/512]``:
    word w holds blocks 4w .. 4w+3, the lowest byte first."""
    b = np.asarray(exps, np.uint8).astype("<u4")
    b = b.reshape(b.shape[:-1] + (-1, 4))
    return (b << np.array([0, 8, 16, 24], "<u4")).sum(-1).astype("<u4").view(np.int32)


def block_scales(scales, ue8m0=False):
    """The float32 scale of every 128-channel block: ``scales`` itself, or from ue8m0's int32
    words 2^(byte - 127)."""
    if not ue8m0:
        return np.asarray(scales, np.float32)
    w = np.ascontiguousarray(scales).view("<u4")
    e = (w[..., None] >> np.array([0, 8, 16, 24], "<u4")) & 0xFF
    e = e.reshape(e.shape[:-2] + (-1,)).astype(np.int32) - 127
    return np.ldexp(np.float32(1), e).astype(np.float32)


def fp8_values(data, scales, ue8m0=False):
    """e4m3 bytes ``[..., H]`` times their block's scale (see :func:`block_scales`), in
    float32: DeepEP's per_token_cast_back before its bf16 rounding."""
    from reference import _E4M3
    data = np.asarray(data, np.uint8)
    mag = _E4M3[np.minimum(data & 0x7F, 0x7E)].astype(np.float32)
    val = np.where(data & 0x80, -mag, mag).astype(np.float32)
    return (val * np.repeat(block_scales(scales, ue8m0), 128, axis=-1)).astype(np.float32)


def ll_inputs(R, T, H, E, K, seed, step, stamped):
    """Every rank's low-latency inputs for one step: x bf16 bits ``[N_s, H]`` (``stamped``:
    s - 128 everywhere but the last 128 channels, which hold the token's index, as DeepEP's
    test; else random), top-k ids from random scores with some entries -1 (token 1 goes
    nowhere) and positive weights. N_s is T on rank 0 and up to 2 fewer elsewhere."""
    xs, topks, ws = [], [], []
    for s in range(R):
        rng = np.random.default_rng([seed, step, s])
        n = T - (s % 3 if T > 2 else 0)
        if stamped:
            x = np.full((n, H), s - LL_RANK_OFFSET, np.float32)
            x[:, -128:] = np.arange(n, dtype=np.float32)[:, None]
        else:
            x = rng.standard_normal((n, H)).astype(np.float32) * np.float32(s + 1)
        tk = np.argsort(rng.random((n, E)), axis=1)[:, :K].astype(np.int64)
        for _ in range(max(1, n // 4)):
            tk[rng.integers(0, n), rng.integers(0, K)] = -1
        if n > 1:
            tk[1] = -1
        xs.append(epd.float_to_bf16(x))
        topks.append(tk)
        ws.append((np.abs(rng.standard_normal((n, K))) + 0.1).astype(np.float32))
    return xs, topks, ws


def ll_expected_blocks(R, L, rank, topks):
    """For each local expert of ``rank``: the (source, token) of its rows in order (source,
    then token: docs/semantics.md §2.6) and the rows from each source."""
    blocks = []
    for i in range(L):
        e = rank * L + i
        rows = [(s, int(t)) for s in range(R) for t in np.nonzero((topks[s] == e).any(1))[0]]
        blocks.append((rows, [int((topks[s] == e).sum()) for s in range(R)]))
    return blocks


def ll_expert(values, e):
    """The simulated expert: its input rows (float32) times 1 + (e % 4) / 4, as bf16 bits."""
    return epd.float_to_bf16(values * np.float32(1 + (e % 4) / 4))


class _Arrays:
    """NumPy arrays for a host-backend daemon (``device`` None), else torch tensors on
    ``device``: the inputs handed to the DeepEP front and the outputs read back."""

    def __init__(self, device):
        self.device = device
        self.torch = None
        if device is not None:
            import torch
            self.torch = torch

    def put(self, a):
        a = np.ascontiguousarray(a)
        if self.torch is None:
            return a.copy()
        return tensors.from_numpy(a, self.torch.bfloat16 if a.dtype == np.uint16
                                  else None).to(self.device)

    def get(self, v):
        """A NumPy copy (bf16 as uint16 bits, fp8 as uint8)."""
        return np.array(_np(v), copy=True)

    def zeros_int32(self, n):
        if self.torch is None:
            return np.zeros(n, np.int32)
        return self.torch.zeros(n, dtype=self.torch.int32, device=self.device)

    def empty_bf16(self, shape):
        if self.torch is None:
            return np.empty(shape, np.uint16)
        return self.torch.empty(shape, dtype=self.torch.bfloat16, device=self.device)

    def write(self, dst, a):
        if self.torch is None:
            dst[...] = a
        else:
            dst.copy_(self.put(a))

    def check_meta(self, v, np_dtype, torch_name, shape):
        """``v`` has ``shape`` and the dtype (NumPy, or torch's ``torch_name`` on the
        device)."""
        assert tuple(v.shape) == tuple(shape), (tuple(v.shape), shape)
        if self.torch is None:
            assert isinstance(v, np.ndarray) and v.dtype == np_dtype, (type(v), v.dtype)
        else:
            want = getattr(self.torch, torch_name, None) or self.torch.uint8
            assert v.dtype == want and v.device == self.device, (v.dtype, v.device)


def deepep_low_latency(buf, rank, R, device, seed):
    """DeepEP's low-latency check on ``buf`` (a Buffer made with low_latency_mode=True) for
    this rank. ``device``: a torch CUDA device (CUDA tensors), or None (NumPy arrays on a
    host-backend daemon).

    Every rank derives every rank's inputs from ``seed`` and checks its own results against
    expectations computed from them with NumPy (docs/semantics.md §2.6, §2.7, §3 and
    reference.py). For the bf16 dispatch and the fp8 one (fp32 scales, round_scale,
    use_ue8m0), each with rank-stamped and with random rows: the received rows (a stamped
    row's source rank and token read back from its values; every row bit for bit), the
    scales (powers of two with round_scale; ue8m0's int32 packing), the dequantized rows
    against x, recv_count against every rank's top-k ids, handle[0] (each row's source
    token) and handle[1] (``begin << 32 | count`` of each source's rows),
    cumulative_local_expert_recv_stats summed over every dispatch, and the hook
    (return_recv_hook) or the event. Then four combines of the simulated expert's output
    (padding rows NaN: never read), copied and zero_copy, into a new tensor and into
    ``out``: bit for bit against reference.py, and within DeepEP's calc_diff bound of x
    times the token's summed weights.
    """
    from reference import Routing, quantize
    g = buf.group
    T, H, E, K = g.max_tokens_per_rank, g.hidden, g.num_experts, g.max_topk
    L, C = E // R, R * T
    arr = _Arrays(device)
    stats = arr.zeros_int32(L)
    total = np.zeros(L, np.int64)
    step = 0
    for stamped in (True, False):
        for use_fp8, round_scale, ue8m0 in LL_CONFIGS:
            step += 1
            what = "step %d (stamped=%s fp8=%s round_scale=%s ue8m0=%s)" % (
                step, stamped, use_fp8, round_scale, ue8m0)
            hooked = step % 2 == 0
            xs, topks, ws = ll_inputs(R, T, H, E, K, seed, step, stamped)
            n = len(xs[rank])
            blocks = ll_expected_blocks(R, L, rank, topks)
            x_in, tk_in, w_in = arr.put(xs[rank]), arr.put(topks[rank]), arr.put(ws[rank])
            reps = 1 + step % 2  # a dispatch made twice: the stats add both
            for _ in range(reps):
                recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(
                    x_in, tk_in, T, E, cumulative_local_expert_recv_stats=stats,
                    use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=ue8m0,
                    async_finish=not hooked, return_recv_hook=hooked)
                if hooked:
                    assert callable(hook), what
                    hook()  # the results are read right after it
                else:
                    event.current_stream_wait()
            total += reps * np.array([sum(per_src) for _, per_src in blocks])

            # DeepEP's shapes and dtypes (on the device for CUDA tensors).
            if use_fp8:
                data, scales = recv_x
                arr.check_meta(data, np.uint8, "float8_e4m3fn", (L, C, H))
                if ue8m0:
                    arr.check_meta(scales, np.int32, "int32", (L, C, H // 512))
                else:
                    arr.check_meta(scales, np.float32, "float32", (L, C, H // 128))
                scales = arr.get(scales)
            else:
                data, scales = recv_x, None
                arr.check_meta(data, np.uint16, "bfloat16", (L, C, H))
            data = arr.get(data)
            arr.check_meta(recv_count, np.int32, "int32", (L,))
            arr.check_meta(handle[0], np.int32, "int32", (L, C))
            arr.check_meta(handle[1], np.int64, "int64", (L, R))
            assert tuple(handle[2:]) == (T, H, E), (what, tuple(handle[2:]))
            count, src_info, layout = (arr.get(recv_count), arr.get(handle[0]),
                                       arr.get(handle[1]))
            np.testing.assert_array_equal(arr.get(stats), total, what)

            # Every source's rows as they must arrive: bf16 bits, or §2.7's bytes and scales.
            if use_fp8:
                q = [quantize(x, round_scale=round_scale, ue8m0=ue8m0) for x in xs]
                q = [(qd, pack_ue8m0(qs) if ue8m0 else qs) for qd, qs in q]
                payload = [fp8_values(qd, qs, ue8m0) for qd, qs in q]
            else:
                payload = [epd.bf16_to_float(x) for x in xs]
            for i, (rows, per_src) in enumerate(blocks):
                e = rank * L + i
                m = len(rows)
                where = "%s, local expert %d" % (what, i)
                assert m == sum(int((tk == e).sum()) for tk in topks), where
                assert int(count[i]) == m, (where, int(count[i]), m)
                assert src_info[i][:m].tolist() == [t for _, t in rows], where
                assert (src_info[i][m:] == -1).all(), where
                begin = np.cumsum([0] + per_src[:-1]).astype(np.int64)
                np.testing.assert_array_equal(layout[i],
                                              (begin << 32) | np.array(per_src, np.int64),
                                              where)
                if not m:
                    continue
                src = np.array([s for s, _ in rows])
                tok = np.array([t for _, t in rows])
                x_rows = np.stack([epd.bf16_to_float(xs[s][t]) for s, t in rows])
                if use_fp8:
                    np.testing.assert_array_equal(data[i][:m],
                                                  np.stack([q[s][0][t] for s, t in rows]),
                                                  where)
                    got = scales[i][:m]
                    want = np.stack([q[s][1][t] for s, t in rows])
                    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32),
                                                  where)
                    if round_scale:  # powers of two: positive, normal, no mantissa bits
                        sc = block_scales(got, ue8m0).view(np.uint32)
                        assert ((sc & 0x807FFFFF) == 0).all(), where
                        assert (((sc >> 23) & 0xFF) > 0).all(), where
                    # Dequantized against x: e4m3 keeps 3 mantissa bits (at most 2^-4
                    # relative), its subnormals steps of 2^-9 times the block's scale.
                    vals = fp8_values(data[i][:m], got, ue8m0)
                    step_size = np.repeat(block_scales(got, ue8m0), 128, axis=-1) * 2.0 ** -9
                    bound = np.abs(x_rows) * (1 / 16 + 1e-6) + step_size / 2
                    assert (np.abs(vals - x_rows) <= bound).all(), where
                    assert calc_diff(vals, x_rows) < 2e-3, (where, calc_diff(vals, x_rows))
                    # As DeepEP: without round_scale the stamped rows come back exactly
                    # after the bf16 rounding.
                    decoded = epd.round_bf16(vals) if not round_scale else None
                    if stamped and round_scale:  # DeepEP's bound on the token column
                        assert calc_diff(vals[:, -1], tok) < 0.007, where
                else:
                    np.testing.assert_array_equal(data[i][:m],
                                                  np.stack([xs[s][t] for s, t in rows]),
                                                  where)
                    decoded = epd.bf16_to_float(data[i][:m])
                if stamped and decoded is not None:
                    # A row names its source: s - 128 in all channels but the last 128, its
                    # token's index in those; each source's rows lie in its layout range.
                    body = decoded[:, :-128]
                    assert (body.min(1) == body.max(1)).all(), where
                    np.testing.assert_array_equal(body[:, 0] + LL_RANK_OFFSET, src, where)
                    np.testing.assert_array_equal(decoded[:, -128:],
                                                  np.repeat(tok[:, None], 128, 1), where)
                    for s in range(R):
                        b0, c0 = int(layout[i][s] >> 32), int(layout[i][s] & 0xFFFFFFFF)
                        assert (body[b0:b0 + c0, 0] == s - LL_RANK_OFFSET).all(), (where, s)

            # The simulated expert's output y, its padding rows NaN (combine never reads
            # them); y2 = 2y for the zero_copy combines, so that they must read the buffer.
            y = np.full((L, C, H), BF16_NAN, np.uint16)
            for i, (rows, _) in enumerate(blocks):
                m = len(rows)
                received = fp8_values(data[i][:m], scales[i][:m], ue8m0) if use_fp8 else \
                    epd.bf16_to_float(data[i][:m])
                y[i][:m] = ll_expert(received, rank * L + i)

            def doubled(a):
                return np.where(a == BF16_NAN, a, epd.float_to_bf16(epd.bf16_to_float(a) * 2))

            y2 = doubled(y)
            # Every destination's y from the expected payloads, for reference.py's combine.
            ys = []
            for d in range(R):
                yd = np.full((L * C, H), BF16_NAN, np.uint16)
                for i, (rows, _) in enumerate(ll_expected_blocks(R, L, d, topks)):
                    if rows:
                        yd[i * C:i * C + len(rows)] = ll_expert(
                            np.stack([payload[s][t] for s, t in rows]), d * L + i)
                ys.append(yd)
            ref = Routing(R, E, T, xs, topks, layout="expand", block_rows=C)
            want = ref.combine(rank, ys, apply_weights=True, source_weights=ws[rank])
            want2 = ref.combine(rank, [doubled(yd) for yd in ys], apply_weights=True,
                                source_weights=ws[rank])
            # DeepEP's check: x times the token's summed weights (masked at -1), here each
            # weight times its expert's factor.
            f = np.where(topks[rank] >= 0, 1 + (topks[rank] % 4) / 4, 0).astype(np.float32)
            approx = epd.bf16_to_float(xs[rank]) * (ws[rank] * f).sum(1)[:, None]
            bound = 1e-5 if not use_fp8 else 9e-4 if not round_scale else 2e-3
            y_in, y2_in = arr.put(y), arr.put(y2)
            for zero_copy, use_out in ((False, False), (False, True), (True, True),
                                       (True, False)):
                how = "%s, combine zero_copy=%s out=%s" % (what, zero_copy, use_out)
                if zero_copy:
                    arr.write(buf.get_next_low_latency_combine_buffer(handle), y2)
                out = arr.empty_bf16((n, H)) if use_out else None
                combined, event, hook = buf.low_latency_combine(
                    y2_in if zero_copy else y_in, tk_in, w_in, handle, zero_copy=zero_copy,
                    async_finish=not hooked, return_recv_hook=hooked, out=out)
                if hooked:
                    assert callable(hook), how
                    hook()
                else:
                    event.current_stream_wait()
                if use_out:
                    assert combined is out, how
                arr.check_meta(combined, np.uint16, "bfloat16", (n, H))
                got = arr.get(combined)
                exp = want2 if zero_copy else want
                if got.tobytes() != exp.tobytes():
                    bad = np.nonzero((got != exp).any(1))[0]
                    raise AssertionError("%s: differs from reference.py in tokens %s" %
                                         (how, bad[:10].tolist()))
                diff = calc_diff(epd.bf16_to_float(got), approx * (2 if zero_copy else 1))
                assert diff < bound, (how, diff, bound)
    buf.synchronize()
    if device is not None:
        arr.torch.cuda.synchronize(device)
    status = g.cx_status()
    assert status["status_name"] == "OK", status
    return True


def deepep_ll_worker(rank, R, sock, name, seed, shape):
    """deepep_low_latency in a rank process: a Buffer made by name with low_latency_mode
    (client-executed), every rank on GPU 0. ``shape``: (T, H, E, K)."""
    import torch
    from epd.compat.deep_ep import Buffer
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    T, H, E, K = shape
    buf = Buffer(name, rank=rank, secret=SECRET, socket=sock, world_size=R, num_experts=E,
                 hidden=H, max_tokens_per_rank=T, max_topk=K, op_timeout_ms=60000,
                 device=dev, low_latency_mode=True)
    try:
        assert (buf.execution, buf.group.execution) == ("client", "client")
        return deepep_low_latency(buf, rank, R, dev, seed)
    finally:
        buf.destroy()


class TestDeepEPLowLatency(unittest.TestCase):
    """deepep_low_latency with CUDA tensors, one process per rank, every rank on GPU 0 over
    the client-executed group that low_latency_mode makes: 1 rank, and 2 and 8 ranks where
    the daemon makes such groups of several processes (CUDA MPS), else skipped."""

    # (T, H, E, K) per world size; H a multiple of 512 for use_ue8m0.
    SHAPES = {1: (32, 1024, 8, 4), 2: (64, 7168, 16, 6), 8: (32, 2048, 32, 4)}

    def run_r(self, R):
        if R > 1:
            skip_without_mps(self)
        name = "deepep-ll-gpu-%d-%d-%d" % (os.getpid(), R, time.monotonic_ns())
        try:
            run_ranks(deepep_ll_worker, R, (R, DAEMONS["cuda"]["socket"], name, 970 + R,
                                            self.SHAPES[R]))
        except AssertionError as e:
            raise AssertionError("%s\n--- cuda daemon log ---\n%s" % (e, daemon_log("cuda")))

    def test_r1(self):
        self.run_r(1)

    def test_r2(self):
        self.run_r(2)

    def test_r8(self):
        self.run_r(8)


# ---- (c) in this process ----

def _sleep(torch, ms):
    """Keeps the current stream busy for about ``ms`` milliseconds."""
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(int(ms * 2e6))  # cycles; ~2 GHz
        return
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(max(1, int(ms / 2))):
        a = a @ a
        a = a / a.norm()


class _InProcessCase(unittest.TestCase):
    """One connection to the cuda daemon from this process, on cuda:0."""

    client_name = "gpu-inprocess"

    @classmethod
    def setUpClass(cls):
        import torch
        cls.torch = torch
        cls.dev = torch.device("cuda", 0)
        torch.cuda.set_device(cls.dev)
        cls.client = epd.connect(DAEMONS["cuda"]["socket"], name=cls.client_name)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()


class TestInProcess(_InProcessCase):

    def group(self, H=256, T=64, K=2, E=4, dtype="bf16"):
        name = "inproc-%d-%d" % (os.getpid(), time.monotonic_ns())
        g = epd.Group.create(self.client, name, SECRET, 0, world_size=1, num_experts=E,
                             hidden=H, max_tokens_per_rank=T, max_topk=K, dtype=dtype,
                             op_timeout_ms=60000, device=self.dev)
        self.addCleanup(g.leave)
        return g

    def routing(self, T, K, E, seed=1):
        rng = np.random.default_rng(seed)
        tk = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64)
        tk[rng.random((T, K)) < 0.3] = -1
        tk[3] = -1
        return tk

    def test_registration_cache(self):
        torch, c = self.torch, self.client
        big = torch.empty(48 << 20, dtype=torch.uint8, device=self.dev)
        other = torch.empty(48 << 20, dtype=torch.uint8, device=self.dev)
        segs = [(s["address"], s["address"] + s["total_size"])
                for s in torch.cuda.memory_snapshot()]

        def seg(t):
            p = t.data_ptr()
            return next(i for i, (lo, hi) in enumerate(segs) if lo <= p < hi)

        a = c.register_device(big[:4096])
        b = c.register_device(big[1 << 20:(1 << 20) + 100])
        self.assertEqual(a, b)  # one allocation, one region
        o = c.register_device(other)
        self.assertEqual(o == a, seg(big) == seg(other))
        self.assertGreaterEqual(c.release_device_memory(), 1)
        again = c.register_device(big[:16])
        self.assertNotEqual(again, a)  # released, registered anew
        with self.assertRaises(epd.InvalidArgument):
            c.register_device(torch.zeros(16).pin_memory())  # host memory
        c.release_device_memory()
        del big, other

    def test_stream_order_dispatch_and_combine(self):
        torch = self.torch
        T, H, K, E = 64, 256, 2, 4
        g = self.group(H=H, T=T, K=K, E=E)
        tk = torch.from_numpy(self.routing(T, K, E)).to(self.dev)
        went = (tk >= 0).any(dim=1)
        n_recv = int(went.sum())
        x = torch.zeros(T, H, dtype=torch.bfloat16, device=self.dev)
        out = {"recv_x": torch.full((T, H), -5.0, dtype=torch.bfloat16, device=self.dev)}
        torch.cuda.synchronize()
        # x gets its value only after a long kernel; no host synchronisation before submit.
        _sleep(torch, 150)
        x.fill_(3.0)
        fut = g.dispatch(x, topk_idx=tk, async_op=True, use_arena=False, out=out)
        fut.current_stream_wait()
        snap = fut.outputs["recv_x"].clone()  # queued after the op's completion doorbell
        res = fut.wait(timeout=60)
        torch.cuda.synchronize()
        self.assertEqual(res.num_recv_tokens, n_recv)
        self.assertTrue(bool((snap[:n_recv].float() == 3.0).all()),
                        "the stream read recv_x before the op, or the op read x early")
        self.assertGreater(res.kernel_ns, 0)
        # The blocking form: ordered after the stream too.
        _sleep(torch, 100)
        x.fill_(4.0)
        res = g.dispatch(x, topk_idx=tk, use_arena=False, out=out)
        self.assertTrue(bool((res.recv_x.float() == 4.0).all()))
        # combine: y written after a long kernel, output read on the stream after stream_wait.
        y = torch.zeros(n_recv, H, dtype=torch.bfloat16, device=self.dev)
        combined = torch.full((T, H), -5.0, dtype=torch.bfloat16, device=self.dev)
        torch.cuda.synchronize()
        _sleep(torch, 150)
        y.fill_(2.0)
        fut = g.combine(y, res.handle, out=combined, async_op=True)
        self.assertIs(fut.outputs["combined_x"], combined)
        fut.stream_wait(torch.cuda.current_stream())
        snap = combined.clone()
        comb = fut.wait(timeout=60)
        torch.cuda.synchronize()
        want = (went.float() * 2.0).unsqueeze(1).expand(T, H)
        self.assertTrue(bool((snap.float() == want).all()))
        self.assertGreater(comb.kernel_ns, 0)
        res.handle.release()

    def test_side_stream(self):
        torch = self.torch
        T, H, K, E = 32, 128, 2, 4
        g = self.group(H=H, T=T, K=K, E=E)
        tk = self.routing(T, K, E, seed=2)
        s = torch.cuda.Stream(self.dev)
        x = torch.zeros(T, H, dtype=torch.bfloat16, device=self.dev)
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            _sleep(torch, 100)
            x.fill_(5.0)
        fut = g.dispatch(x, topk_idx=tk, async_op=True, stream=s)  # numpy topk: uploaded
        fut.stream_wait(s)
        with torch.cuda.stream(s):
            snap = fut.outputs["recv_x"].clone()
        res = fut.wait(timeout=60)
        torch.cuda.synchronize()
        n = res.num_recv_tokens
        self.assertTrue(bool((snap[:n].float() == 5.0).all()))
        # A raw cudaStream_t works too.
        res2 = g.dispatch(x, topk_idx=tk, stream=s.cuda_stream)
        self.assertTrue(bool((res2.recv_x.float() == 5.0).all()))

    def test_capacity_out_and_arena(self):
        torch = self.torch
        T, H, K, E = 48, 256, 3, 8
        g = self.group(H=H, T=T, K=K, E=E)
        tk = torch.from_numpy(self.routing(T, K, E, seed=3)).to(self.dev)
        x = torch.randn(T, H, device=self.dev).to(torch.bfloat16)
        w = torch.rand(T, K, device=self.dev)
        dev_res = g.dispatch(x, topk_idx=tk, topk_weights=w, layout="expand",
                             expert_alignment=4)
        self.assertEqual(dev_res.recv_x.device, x.device)
        rows = dev_res.num_expanded_rows
        exact = g.dispatch(x, topk_idx=tk, topk_weights=w, layout="expand",
                           expert_alignment=4, recv_capacity=rows)
        self.assertEqual(exact.recv_x.shape[0], rows)
        with self.assertRaises(epd.CapacityExceeded):
            g.dispatch(x, topk_idx=tk, topk_weights=w, layout="expand", expert_alignment=4,
                       recv_capacity=rows - 1)
        arena = g.dispatch(x, topk_idx=tk, topk_weights=w, layout="expand", expert_alignment=4,
                           use_arena=True)
        self.assertEqual(arena.recv_x.device, x.device)
        keep = dev_res.recv_src >= 0
        for f in ("recv_src", "recv_topk_slot"):
            self.assertTrue(torch.equal(getattr(arena, f), getattr(dev_res, f)), f)
        self.assertTrue(torch.equal(arena.recv_x[keep], dev_res.recv_x[keep]))
        self.assertTrue(torch.equal(arena.recv_topk_weights[keep],
                                    dev_res.recv_topk_weights[keep]))
        # Caller outputs reused across steps.
        cap = g.worst_case_rows("expand", K, 4)
        out = {"recv_x": torch.empty(cap, H, dtype=torch.bfloat16, device=self.dev),
               "recv_src": torch.empty(cap, dtype=torch.int64, device=self.dev)}
        for _ in range(2):
            r = g.dispatch(x, topk_idx=tk, topk_weights=w, layout="expand",
                           expert_alignment=4, out=out)
            self.assertEqual(r.recv_x.data_ptr(), out["recv_x"].data_ptr())
            self.assertTrue(torch.equal(r.recv_x[keep], dev_res.recv_x[keep]))
            r.handle.release()
        for res in (dev_res, exact, arena):
            res.handle.release()

    def test_device_alloc(self):
        torch, c = self.torch, self.client
        with c.device_alloc(3 << 20, device=self.dev) as a:
            self.assertEqual((a.nbytes, a.device), (3 << 20, 0))
            self.assertGreater(a.region_id, 0)
            t = a.tensor((4, 256), torch.bfloat16, offset=4096)
            self.assertEqual((t.device, t.dtype, tuple(t.shape)),
                             (self.dev, torch.bfloat16, (4, 256)))
            self.assertEqual(t.data_ptr(), a.ptr + 4096)
            t.fill_(1.5)
            raw = a.tensor(4 * 256 * 2, offset=4096)  # uint8 bytes over the same memory
            self.assertTrue(torch.equal(raw.view(torch.bfloat16).view(4, 256).float(),
                                        torch.full((4, 256), 1.5, device=self.dev)))
            # The registration cache answers for tensors over it; release_device_memory
            # leaves its region alone.
            self.assertEqual(c.register_device(t), a.region_id)
            c.release_device_memory()
            self.assertEqual(c.register_device(t[1:]), a.region_id)
            with self.assertRaises(epd.InvalidArgument):
                a.tensor((2, 2), torch.float32, offset=2)  # misaligned
            with self.assertRaises(epd.InvalidArgument):
                a.tensor((3 << 20) + 1)  # too big
        self.assertTrue(a.freed)
        a.free()  # idempotent
        with self.assertRaises(epd.InvalidArgument):
            a.tensor(16)
        with self.assertRaises(epd.InvalidArgument):
            c.device_alloc(0)
        with self.assertRaises(epd.InvalidArgument):
            c.device_alloc(4096, device=torch.cuda.device_count())  # no such device
        # An allocation still held at close is freed with the client.
        with epd.connect(DAEMONS["cuda"]["socket"], name="gpu-alloc-close") as other:
            b = other.device_alloc(1 << 20)
            self.assertFalse(b.freed)
        self.assertTrue(b.freed)

    def test_float_input_and_zero_tokens(self):
        torch = self.torch
        g = self.group(H=128, T=16, K=2, E=4)
        x = torch.randn(16, 128, device=self.dev)  # float32: rounded to bf16 on the device
        tk = torch.from_numpy(self.routing(16, 2, 4, seed=4)).to(self.dev)
        res = g.dispatch(x, topk_idx=tk)
        went = (tk >= 0).any(dim=1)
        self.assertTrue(torch.equal(res.recv_x, x[went].to(torch.bfloat16)))
        empty = g.dispatch(x[:0], topk_idx=tk[:0])
        self.assertEqual(tuple(empty.recv_x.shape), (0, 128))
        cx, cw = g.combine(empty.recv_x, empty.handle)
        self.assertEqual(tuple(cx.shape), (0, 128))
        self.assertEqual(cx.device, x.device)


# ---- (d) client-executed groups ----

class TestClientExecuted(_InProcessCase):
    """A client-executed group of one rank on the cuda backend (one rank needs no MPS): torch
    CUDA tensors through Group.cx_dispatch / cx_combine bitwise against reference.py, and two
    MoE layers captured with torch.cuda.graph, replayed 100 times with new inputs, bitwise
    equal to eager execution."""

    client_name = "gpu-cx"

    def group(self, **shape):
        name = "cx-%d-%d" % (os.getpid(), time.monotonic_ns())
        g = epd.Group.create(self.client, name, SECRET, 0, world_size=1, op_timeout_ms=60000,
                             device=self.dev, execution="client", **shape)
        self.addCleanup(g.leave)
        return g

    def bf16(self, bits):
        return tensors.from_numpy(bits).view(self.torch.bfloat16).to(self.dev)

    def test_dispatch_and_combine_match_reference(self):
        from reference import Routing, quantize
        torch = self.torch
        T, H, K, E = 32, 256, 4, 8
        C = T  # R·T with one rank: every expert's selections fit
        g = self.group(num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K,
                       expert_block_rows=C, quantize=True)
        rng = np.random.default_rng(11)
        x = epd.float_to_bf16(rng.standard_normal((T, H)).astype(np.float32))
        tk = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64)
        tk[rng.random((T, K)) < 0.2] = -1
        w = rng.random((T, K)).astype(np.float32)
        sw = rng.random((T, K)).astype(np.float32)
        ys = epd.float_to_bf16(rng.standard_normal((E * C, H)).astype(np.float32))
        # bf16 rows, then §2.7 with fp32 scales, power-of-two scales, and ue8m0 bytes
        for quant, round_scale, ue8m0 in ((False, False, False), (True, False, False),
                                          (True, True, False), (True, True, True)):
            res = g.cx_dispatch(self.bf16(x), topk_idx=torch.from_numpy(tk).to(self.dev),
                                topk_weights=torch.from_numpy(w).to(self.dev),
                                layout="expand", expert_block_rows=C, quantize=quant,
                                round_scale=round_scale,
                                scale_format="ue8m0" if ue8m0 else "fp32")
            torch.cuda.synchronize()
            self.assertEqual(g.cx_status()["status_name"], "OK")
            q = quantize(x, round_scale=round_scale, ue8m0=ue8m0)
            ref = Routing(1, E, T, [q[0] if quant else x], [tk], [w], layout="expand",
                          block_rows=C)
            exp = ref.dest(0)
            keep = exp["recv_src"] >= 0
            np.testing.assert_array_equal(res.recv_src.cpu().numpy(), exp["recv_src"])
            np.testing.assert_array_equal(res.recv_topk_slot.cpu().numpy()[keep],
                                          exp["recv_topk_slot"][keep])
            np.testing.assert_array_equal(res.num_recv_tokens_per_expert.cpu().numpy(),
                                          exp["per_expert"])
            got = tensors.to_numpy(res.recv_x.cpu())
            np.testing.assert_array_equal(got[keep],
                                          np.stack([r for r in ref.recv_x(0) if r is not None]))
            if quant:
                want = np.stack([q[1][t] for _, t, _ in [r for r in exp["rows"] if r]])
                got_scales = res.recv_x_scales.cpu().numpy()[keep]
                self.assertEqual(got_scales.dtype, want.dtype)
                np.testing.assert_array_equal(got_scales.view(np.uint8), want.view(np.uint8))
            self.assertEqual(g.cx_counts(0)["num_expanded_rows"], E * C)
            y, _ = g.cx_y(res.handle, self.dev)
            y.copy_(self.bf16(ys))
            out = torch.empty((T, H), dtype=torch.bfloat16, device=self.dev)
            combined, cw = g.cx_combine(handle=res.handle, apply_weights=True,
                                        source_weights=torch.from_numpy(sw).to(self.dev),
                                        out=out)
            torch.cuda.synchronize()
            self.assertEqual(g.cx_status()["status_name"], "OK")
            self.assertIs(combined, out)
            np.testing.assert_array_equal(tensors.to_numpy(combined.cpu()),
                                          ref.combine(0, [ys], apply_weights=True,
                                                      source_weights=sw))
            np.testing.assert_array_equal(cw.cpu().numpy(), ref.combined_weights(0))

    def test_graph_replays_match_eager(self):
        torch = self.torch
        T, H, K, E, layers, n = 16, 256, 2, 4, 2, 100
        C = T
        g = self.group(num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K,
                       expert_block_rows=C)
        gen = torch.Generator(device=self.dev).manual_seed(5)
        wmat = (torch.randn((H, H), generator=gen, device=self.dev) / 16).to(torch.bfloat16)
        inputs = [((torch.randn((T, H), generator=gen, device=self.dev)).to(torch.bfloat16),
                   torch.argsort(torch.rand((T, E), generator=gen, device=self.dev),
                                 dim=1)[:, :K].contiguous(),
                   torch.rand((T, K), generator=gen, device=self.dev)) for _ in range(n)]
        sx = torch.empty((T, H), dtype=torch.bfloat16, device=self.dev)
        stk = torch.empty((T, K), dtype=torch.int64, device=self.dev)
        sw = torch.empty((T, K), dtype=torch.float32, device=self.dev)
        outs = [torch.empty((T, H), dtype=torch.bfloat16, device=self.dev)
                for _ in range(layers)]

        def moe_layers():
            h = sx
            for layer in range(layers):
                res = g.cx_dispatch(h, topk_idx=stk, layout="expand", expert_block_rows=C)
                y, _ = g.cx_y(0, self.dev)
                torch.matmul(res.recv_x, wmat, out=y)
                g.cx_combine(handle=0, apply_weights=True, source_weights=sw, out=outs[layer])
                h = outs[layer]

        def load(i):
            sx.copy_(inputs[i][0])
            stk.copy_(inputs[i][1])
            sw.copy_(inputs[i][2])

        eager = []
        for i in range(n):
            load(i)
            moe_layers()
            eager.append(outs[-1].clone())
        torch.cuda.synchronize()
        self.assertEqual(g.cx_status()["status_name"], "OK")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            moe_layers()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            moe_layers()
        for i in range(n):
            load(i)
            graph.replay()
            self.assertTrue(torch.equal(outs[-1].view(torch.int16), eager[i].view(torch.int16)),
                            "replay %d differs from eager execution" % i)
        torch.cuda.synchronize()
        status = g.cx_status()
        self.assertEqual(status["status_name"], "OK", status["message"])


class TestDeepEPClientExecuted(_InProcessCase):
    """The DeepEP front over a client-executed group of one rank (no MPS needed) with CUDA
    tensors: outputs that outlive later dispatches into the receive area, ops after a
    previous_event on a side stream with async_finish, num_worst_tokens without a host wait,
    the refusal of a handle whose slot a later dispatch filled, and the error of a failed op
    raised at the next host wait."""

    client_name = "gpu-deepep-cx"

    def test_streams_copies_and_handles(self):
        import torch
        from epd.compat.deep_ep import Buffer
        T, H, K, E = 32, 256, 2, 4
        buf = Buffer("deepep-cx-%d-%d" % (os.getpid(), time.monotonic_ns()), rank=0,
                     secret=SECRET, client=self.client, world_size=1, num_experts=E, hidden=H,
                     max_tokens_per_rank=T, max_topk=K, op_timeout_ms=60000, device=self.dev,
                     execution="client", num_handle_slots=2)
        self.addCleanup(buf.destroy)
        gen = torch.Generator(device=self.dev).manual_seed(3)

        def inputs():
            x = torch.randn((T, H), generator=gen, device=self.dev).to(torch.bfloat16)
            tk = torch.argsort(torch.rand((T, E), generator=gen, device=self.dev),
                               dim=1)[:, :K].contiguous()
            tk[::5] = -1  # tokens that go nowhere
            tk[1::5, 1] = -1
            return x, tk, torch.rand((T, K), generator=gen, device=self.dev)

        x, tk, w = inputs()
        hit = (tk >= 0).any(1)
        n = int(hit.sum())
        rx, ridx, rw, counts, h, _ = buf.dispatch(x, topk_idx=tk, topk_weights=w)
        # One rank: every token with a selection arrives once, in token order.
        self.assertEqual(h.slot, 0)
        self.assertTrue(torch.equal(rx, x[hit]))
        self.assertTrue(torch.equal(ridx, tk[hit]))
        own_w = torch.where(tk >= 0, w, torch.zeros_like(w))
        self.assertTrue(torch.equal(rw, own_w[hit]))
        self.assertEqual(counts, [int((tk == e).sum()) for e in range(E)])
        self.assertEqual(h.num_recv_tokens, n)
        kept = [t.clone() for t in (rx, ridx, rw)]
        x2, tk2, w2 = inputs()
        buf.dispatch(x2, topk_idx=tk2, topk_weights=w2)  # slot 1: the receive area rewritten
        for got, want in zip((rx, ridx, rw), kept):
            self.assertTrue(torch.equal(got, want))
        combined, cw, _ = buf.combine(rx, h, topk_weights=rw)
        torch.cuda.current_stream().synchronize()
        self.assertTrue(torch.equal(combined[hit], x[hit]))
        self.assertTrue(bool((combined[~hit].float() == 0).all()))
        self.assertTrue(torch.equal(cw, own_w))

        # After a previous_event: on a side stream; async_finish: the current stream waits at
        # event.current_stream_wait().
        rx3, ridx3, rw3, _, h3, ev3 = buf.dispatch(x, topk_idx=tk, topk_weights=w,
                                                   previous_event=Buffer.capture(),
                                                   async_finish=True)
        ev3.current_stream_wait()
        self.assertEqual(h3.slot, 0)
        self.assertTrue(torch.equal(rx3, rx) and torch.equal(rw3, rw))
        c3, cw3, ev4 = buf.combine(rx3, h3, topk_weights=rw3, previous_event=ev3,
                                   async_finish=True)
        ev4.current_stream_wait()
        self.assertTrue(torch.equal(c3, combined) and torch.equal(cw3, cw))
        # h's slot 0 was filled again by h3's dispatch.
        with self.assertRaisesRegex(epd.InvalidArgument, "slot 0 was filled by a later"):
            buf.combine(rx, h)
        self.assertEqual(h[3].cpu().tolist(), torch.nonzero(hit).flatten().cpu().tolist())

        # num_worst_tokens: W rows, no host wait; the handle waits at its first use.
        W = T
        r4, i4, w4, c4, h4, ev5 = buf.dispatch(x, topk_idx=tk, topk_weights=w,
                                               num_worst_tokens=W, async_finish=True)
        ev5.current_stream_wait()
        self.assertEqual((c4, tuple(r4.shape), tuple(i4.shape)), ([], (W, H), (W, K)))
        self.assertTrue(torch.equal(r4[:n], rx) and torch.equal(i4[:n], ridx))
        self.assertTrue(bool((i4[n:] == -1).all()) and bool((w4[n:] == 0).all()))
        self.assertTrue(torch.equal(w4[:n], rw))
        c5, cw5, _ = buf.combine(r4, h4, topk_weights=w4)
        self.assertTrue(torch.equal(c5, combined) and torch.equal(cw5, cw))
        self.assertEqual(h4.num_recv_tokens, n)
        cached = buf.dispatch(x2, handle=h4, num_worst_tokens=W)
        self.assertEqual(cached[1:5], (None, None, None, None))
        self.assertTrue(torch.equal(cached[0][:n], x2[hit]))

        # Fewer rows than this rank receives: the op fails (CAPACITY_EXCEEDED), raised at the
        # handle's first use and by synchronize (a failure sticks).
        _, _, _, _, h6, _ = buf.dispatch(x, topk_idx=tk, num_worst_tokens=1)
        with self.assertRaises(epd.CapacityExceeded):
            h6.num_recv_tokens
        with self.assertRaises(epd.CapacityExceeded):
            h6[0]
        with self.assertRaises(epd.CapacityExceeded):
            buf.synchronize()


if __name__ == "__main__":
    unittest.main()
