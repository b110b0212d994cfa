#!/usr/bin/env python3
"""moe_worker.py - a real MoE layer forward through epd, one worker process per rank.

Each worker owns ``experts / ranks`` experts and its own tokens. One step of the layer:

1. router: ``softmax(x @ W_router)``, top-k experts per token, weights renormalised over the k;
2. dispatch the tokens to the ranks of their experts (EXPAND or NON_EXPAND layout);
3. one GEMM per local expert on the received rows (float32 on bf16-rounded inputs and
   weights, output rounded to bf16), written in place into the dispatch's outputs;
4. combine: EXPAND applies the routing weights in combine (``apply_weights``); NON_EXPAND
   weights each rank's experts before sending and combine sums the ranks.

``--device cpu`` (the default): NumPy arrays, a host-backend ``epd``, outputs in the output
arena, workers forked. ``--device cuda``: torch CUDA tensors (one GPU per rank, round robin
over the visible GPUs), a cuda-backend ``epd``, dispatch outputs in device memory, expert GEMMs
on the GPU (TF32 off), workers started with multiprocessing's 'spawn'. The router runs in
NumPy on both, so that each token picks the same experts as the reference does. ``--device
auto`` picks cuda when torch sees a GPU.

The parent starts ``epd`` on a temporary socket (or uses ``--socket``), starts the workers, and
checks their outputs against a single-process dense float32 computation of the same layer with
the same bf16 rounding of the inputs and weights. It prints PASS and exits 0 when the relative
error of the whole layer is at most ``--tol`` (1e-2).

    python3 examples/moe_worker.py --ranks 4
    python3 examples/moe_worker.py --ranks 2 --layout non_expand --tokens 32
    EPD_LIBRARY=/path/libepd.so EPD_BIN_DIR=/path/bin \
        python3 examples/moe_worker.py --device cuda --ranks 4
"""

import os

# One BLAS thread per worker: several workers share the cores, and a BLAS thread pool must not
# exist in the parent when it forks. Set before NumPy is imported.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import shutil  # noqa: E402
import socket as socketlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

try:
    import numpy as np  # noqa: E402
except ImportError:
    # Debian's python3-numpy belongs to /usr/bin/python3; another python3 first on PATH (pyenv,
    # a virtualenv) may lack it.
    if os.path.exists("/usr/bin/python3") and sys.executable != "/usr/bin/python3" and \
            not os.environ.get("EPD_EXAMPLE_REEXEC"):
        os.environ["EPD_EXAMPLE_REEXEC"] = "1"
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    sys.exit("moe_worker.py needs NumPy (Debian: apt-get install python3-numpy)")

sys.path.insert(0, os.path.join(REPO, "client", "python"))
import epd  # noqa: E402


# ---- the layer: everything is a pure function of the seed ----

def rank_tokens(args, rank):
    """Tokens of a rank: uneven on purpose (the last ranks have fewer)."""
    return max(0, args.tokens - (rank % 3) * (args.tokens // 8))


def router_weights(args):
    rng = np.random.default_rng([args.seed, 1])
    w = rng.standard_normal((args.hidden, args.experts), dtype=np.float32)
    return epd.round_bf16(w * np.float32(2.0 / np.sqrt(args.hidden)))


def expert_weights(args, expert):
    rng = np.random.default_rng([args.seed, 2, expert])
    w = rng.standard_normal((args.hidden, args.hidden), dtype=np.float32)
    return epd.round_bf16(w * np.float32(1.0 / np.sqrt(args.hidden)))


def layer_input(args, rank, step):
    """This rank's bf16-rounded input of a step, as float32."""
    rng = np.random.default_rng([args.seed, 3, rank, step])
    return epd.round_bf16(rng.standard_normal((rank_tokens(args, rank), args.hidden),
                                              dtype=np.float32))


def route(x, w_router, k):
    """Top-k routing: softmax over the experts, the k largest (ties to the lower id), weights
    renormalised to sum to 1. Returns (topk_idx int64 [N, k], topk_weights float32 [N, k])."""
    logits = x @ w_router
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    topk = np.argsort(-p, axis=1, kind="stable")[:, :k].astype(np.int64)
    w = np.take_along_axis(p, topk, axis=1)
    return topk, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def dense_reference(args, x, w_router, experts):
    """The layer in one process, float32, no epd: sum_k w_k * (x @ W_{e_k})."""
    topk, w = route(x, w_router, args.topk)
    out = np.zeros_like(x)
    for e in range(args.experts):
        rows, slots = np.nonzero(topk == e)
        if rows.size:
            out[rows] += w[rows, slots][:, None] * (x[rows] @ experts[e])
    return out


# ---- a worker: one rank ----

def run_experts_expand(res, local_w):
    """EXPAND: rows are grouped by local expert; each group is one GEMM, in place."""
    base = 0
    for w, count, aligned in zip(local_w, res.num_recv_tokens_per_expert,
                                 res.num_recv_tokens_per_expert_aligned):
        rows = res.recv_x[base:base + count]
        if count:
            rows[...] = epd.float_to_bf16(epd.bf16_to_float(rows) @ w)
        base += aligned


def run_experts_non_expand(res, local_w):
    """NON_EXPAND: one row per token; sum this rank's experts, each weighted, round once."""
    x = epd.bf16_to_float(res.recv_x)
    acc = np.zeros_like(x)
    for local_id, weight in enumerate(local_w):
        hit = res.recv_topk_idx == local_id
        rows = np.nonzero(hit.any(axis=1))[0]
        if rows.size:
            w = np.where(hit[rows], res.recv_topk_weights[rows], 0).sum(axis=1)
            acc[rows] += w[:, None] * (x[rows] @ weight)
    res.recv_x[...] = epd.float_to_bf16(acc)


def run_experts_expand_torch(res, local_w):
    """EXPAND on the GPU: one GEMM per local expert's rows, in place in the device outputs."""
    import torch
    base = 0
    for w, count, aligned in zip(local_w, res.num_recv_tokens_per_expert,
                                 res.num_recv_tokens_per_expert_aligned):
        count, aligned = int(count), int(aligned)
        if count:
            rows = res.recv_x[base:base + count]
            rows.copy_((rows.float() @ w).to(torch.bfloat16))
        base += aligned


def run_experts_non_expand_torch(res, local_w):
    """NON_EXPAND on the GPU: sum this rank's experts per token, each weighted, round once."""
    import torch
    x = res.recv_x.float()
    acc = torch.zeros_like(x)
    for local_id, weight in enumerate(local_w):
        hit = res.recv_topk_idx == local_id
        rows = hit.any(dim=1).nonzero().squeeze(1)
        if rows.numel():
            w = torch.where(hit[rows], res.recv_topk_weights[rows],
                            torch.zeros((), device=x.device)).sum(dim=1)
            acc[rows] += w.unsqueeze(1) * (x[rows] @ weight)
    res.recv_x.copy_(acc.to(torch.bfloat16))


def worker_cuda(args, rank, sock, group_name, secret, conn):
    """One rank on the GPU: torch CUDA tensors in and out of epd."""
    try:
        import torch
        torch.backends.cuda.matmul.allow_tf32 = False
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        L = args.experts // args.ranks
        w_router = router_weights(args)
        local_w = [torch.from_numpy(expert_weights(args, rank * L + i)).to(dev)
                   for i in range(L)]
        outputs, timings = [], []
        with epd.connect(socket=sock, name="moe_worker") as client:
            if rank == 0:
                group = epd.Group.create(
                    client, group_name, secret, rank, world_size=args.ranks,
                    num_experts=args.experts, hidden=args.hidden,
                    max_tokens_per_rank=args.tokens, max_topk=args.topk, op_timeout_ms=60000,
                    device=dev)
            else:
                group = epd.Group.join(client, group_name, secret, rank, device=dev,
                                       retry_timeout=30.0)
            for step in range(args.steps):
                x = layer_input(args, rank, step)
                topk, w = route(x, w_router, args.topk)
                xt = torch.from_numpy(x).to(dev).to(torch.bfloat16)  # exact: bf16 values
                tk = torch.from_numpy(topk).to(dev)
                tw = torch.from_numpy(w).to(dev)
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                # No host synchronisation needed: the daemon waits for this stream's uploads.
                res = group.dispatch(xt, topk_idx=tk, topk_weights=tw, layout=args.layout,
                                     expert_alignment=args.alignment)
                t1 = time.perf_counter()
                with res.handle:
                    if args.layout == epd.EXPAND:
                        run_experts_expand_torch(res, local_w)
                    else:
                        run_experts_non_expand_torch(res, local_w)
                    torch.cuda.synchronize(dev)
                    t2 = time.perf_counter()
                    comb = group.combine(res.recv_x, res.handle,
                                         apply_weights=args.layout == epd.EXPAND)
                    t3 = time.perf_counter()
                outputs.append(comb[0].float().cpu().numpy())
                timings.append((t1 - t0, t2 - t1, t3 - t2, res.num_rows, res.kernel_ns,
                                comb.kernel_ns))
            group.leave()
            client.release_device_memory()
        conn.send(("ok", rank, outputs, timings))
    except BaseException:
        conn.send(("error", rank, traceback.format_exc(), None))
    finally:
        conn.close()


def worker(args, rank, sock, group_name, secret, conn):
    try:
        L = args.experts // args.ranks
        w_router = router_weights(args)
        local_w = [expert_weights(args, rank * L + i) for i in range(L)]
        outputs, timings = [], []
        with epd.connect(socket=sock, name="moe_worker") as client:
            if rank == 0:
                group = epd.Group.create(
                    client, group_name, secret, rank, world_size=args.ranks,
                    num_experts=args.experts, hidden=args.hidden,
                    max_tokens_per_rank=args.tokens, max_topk=args.topk, op_timeout_ms=60000)
            else:
                group = epd.Group.join(client, group_name, secret, rank, retry_timeout=30.0)
            # The input lives in shared memory: dispatch reads it without a copy.
            x_shared = epd.empty(client, (args.tokens, args.hidden), "bf16")
            for step in range(args.steps):
                x = layer_input(args, rank, step)
                n = x.shape[0]
                topk, w = route(x, w_router, args.topk)
                x_shared[:n] = epd.float_to_bf16(x)
                t0 = time.perf_counter()
                res = group.dispatch(x_shared[:n], topk_idx=topk, topk_weights=w,
                                     layout=args.layout, expert_alignment=args.alignment)
                t1 = time.perf_counter()
                with res.handle:
                    if args.layout == epd.EXPAND:
                        run_experts_expand(res, local_w)
                    else:
                        run_experts_non_expand(res, local_w)
                    t2 = time.perf_counter()
                    combined, _ = group.combine(res.recv_x, res.handle,
                                                apply_weights=args.layout == epd.EXPAND)
                    t3 = time.perf_counter()
                outputs.append(epd.bf16_to_float(combined))
                timings.append((t1 - t0, t2 - t1, t3 - t2, res.num_rows, res.kernel_ns, 0))
            group.leave()
        conn.send(("ok", rank, outputs, timings))
    except BaseException:
        conn.send(("error", rank, traceback.format_exc(), None))
    finally:
        conn.close()


# ---- the parent: daemon, workers, check ----

def find_epd(explicit):
    bin_dir = os.environ.get("EPD_BIN_DIR")
    for path in (explicit, bin_dir and os.path.join(bin_dir, "epd"),
                 os.path.join(REPO, "build", "bin", "epd"), shutil.which("epd")):
        if path and os.access(path, os.X_OK):
            return path
    sys.exit("cannot find the epd binary: build it (make) or pass --epd PATH")


def start_daemon(epd_bin, backend, workdir):
    sock = os.path.join(workdir, "epd.sock")
    log = open(os.path.join(workdir, "epd.log"), "wb")
    proc = subprocess.Popen([epd_bin, "--backend", backend, "--socket", sock,
                             "--config", "/dev/null"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60  # the cuda backend initialises its GPUs first
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_SEQPACKET) as s:
                s.connect(sock)
            return proc, sock
        except OSError:
            time.sleep(0.01)
    stop_daemon(proc)
    with open(os.path.join(workdir, "epd.log"), errors="replace") as f:
        sys.stderr.write(f.read())
    sys.exit("epd did not start")


def stop_daemon(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(args, sock):
    import multiprocessing

    # CUDA cannot be used in a forked child of a process that initialised it: spawn for GPUs.
    cuda = args.device == "cuda"
    ctx = multiprocessing.get_context("spawn" if cuda else "fork")
    target = worker_cuda if cuda else worker
    group_name = "moe-%d-%s" % (os.getpid(), os.urandom(4).hex())
    secret = os.urandom(16)
    pipes, procs = [], []
    for rank in range(args.ranks):
        parent_end, child_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=target, args=(args, rank, sock, group_name, secret, child_end))
        p.start()
        child_end.close()
        pipes.append(parent_end)
        procs.append(p)
    results, failed = {}, False
    deadline = time.monotonic() + args.timeout
    for rank, pipe in enumerate(pipes):
        if not pipe.poll(max(0.0, deadline - time.monotonic())):
            print("rank %d: no result within %d s" % (rank, args.timeout), file=sys.stderr)
            failed = True
            continue
        try:
            status, r, payload, timings = pipe.recv()
        except EOFError:
            print("rank %d: died without a result" % rank, file=sys.stderr)
            failed = True
            continue
        if status != "ok":
            print("rank %d failed:\n%s" % (r, payload), file=sys.stderr)
            failed = True
            continue
        results[r] = (payload, timings)
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
    if failed:
        return False

    # The dense reference, in this process, after the workers are done.
    w_router = router_weights(args)
    experts = [expert_weights(args, e) for e in range(args.experts)]
    num = den = 0.0
    max_abs = 0.0
    for step in range(args.steps):
        for rank in range(args.ranks):
            ref = dense_reference(args, layer_input(args, rank, step), w_router, experts)
            got = results[rank][0][step]
            num += float(np.sum((got - ref).astype(np.float64) ** 2))
            den += float(np.sum(ref.astype(np.float64) ** 2))
            if got.size:
                max_abs = max(max_abs, float(np.max(np.abs(got - ref))))
    rel = (num / den) ** 0.5 if den else 0.0
    timings = [t for rank in results for t in results[rank][1]]
    d = sorted(t[0] for t in timings)
    c = sorted(t[2] for t in timings)
    rows = sum(t[3] for t in timings)
    print("moe_worker: %d ranks, %d experts, hidden %d, <=%d tokens/rank, top-%d, %s, %d steps, "
          "%s" % (args.ranks, args.experts, args.hidden, args.tokens, args.topk, args.layout,
                  args.steps, "torch CUDA tensors" if args.device == "cuda" else "NumPy"))
    print("  dispatch p50 %.2f ms, combine p50 %.2f ms, %d rows received in all"
          % (1e3 * d[len(d) // 2], 1e3 * c[len(c) // 2], rows))
    kd = sorted(t[4] for t in timings)
    kc = sorted(t[5] for t in timings)
    if kd[-1] or kc[-1]:
        print("  GPU kernel time p50: dispatch %.1f us, combine %.1f us"
              % (kd[len(kd) // 2] / 1e3, kc[len(kc) // 2] / 1e3))
    print("  relative error of the layer vs dense float32: %.3e (max abs %.3e), tolerance %.0e"
          % (rel, max_abs, args.tol))
    return rel <= args.tol


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="worker processes (default 4)")
    p.add_argument("--experts", type=int, default=16, help="experts in the layer (default 16)")
    p.add_argument("--hidden", type=int, default=512, help="hidden size (default 512)")
    p.add_argument("--tokens", type=int, default=128, help="max tokens per rank (default 128)")
    p.add_argument("--topk", type=int, default=4, help="experts per token (default 4)")
    p.add_argument("--layout", choices=(epd.EXPAND, epd.NON_EXPAND), default=epd.EXPAND)
    p.add_argument("--alignment", type=int, default=1, help="expert_alignment (default 1)")
    p.add_argument("--steps", type=int, default=2, help="forward passes (default 2)")
    p.add_argument("--seed", type=int, default=20261201)
    p.add_argument("--tol", type=float, default=1e-2, help="relative error bound (1e-2)")
    p.add_argument("--socket", help="use this running epd instead of starting one")
    p.add_argument("--epd", help="the epd binary (default: build/bin/epd, then PATH)")
    p.add_argument("--backend", default=None,
                   help="backend of the started epd (default: cuda with --device cuda, else host)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu",
                   help="cpu: NumPy arrays (default); cuda: torch CUDA tensors; auto: cuda when "
                        "torch sees a GPU")
    p.add_argument("--timeout", type=int, default=300, help="seconds to wait for workers")
    args = p.parse_args(argv)
    if args.ranks < 1 or args.experts % args.ranks:
        p.error("--experts must be a multiple of --ranks")
    if not 1 <= args.topk <= args.experts:
        p.error("--topk must be in 1..experts")
    if args.device != "cpu":
        try:
            import torch
            have_gpu = torch.cuda.is_available()
        except ImportError:
            have_gpu = False
        if args.device == "auto":
            args.device = "cuda" if have_gpu else "cpu"
        elif not have_gpu:
            p.error("--device cuda needs torch with a CUDA GPU")
    if args.backend is None:
        args.backend = "cuda" if args.device == "cuda" else "host"
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.socket:
        ok = run(args, args.socket)
    else:
        with tempfile.TemporaryDirectory(prefix="epd-moe-") as workdir:
            proc, sock = start_daemon(find_epd(args.epd), args.backend, workdir)
            try:
                ok = run(args, sock)
            finally:
                stop_daemon(proc)
                if not ok:
                    with open(os.path.join(workdir, "epd.log"), errors="replace") as f:
                        sys.stderr.write(f.read()[-4000:])
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
