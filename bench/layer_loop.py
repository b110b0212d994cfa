#!/usr/bin/env python3
"""The layer-loop benchmark of docs/benchmarks.md: what a worker sees per MoE layer when its own
kernels and epd's share the GPU.

Each of R worker processes runs L layers of: a stand-in attention GEMM (bf16 ``[T, H] x [H,
H]``), dispatch, a stand-in expert grouped GEMM over the received rows (``[rows, H] x [H, F]``
per local expert, then ``x [F, H]``), and combine (EXPAND, weighted), each layer's output being
the next layer's input. Modes:

* ``client``: a client-executed group (docs/client-execution.md) with fixed expert blocks; the
  L layers are captured in one CUDA graph with torch.cuda.graph and replayed. The expert GEMM
  writes straight into the group's y area.
* ``daemon``: a daemon-executed group, run eagerly (daemon-executed ops wait on the host and
  cannot be captured); the expert GEMM runs per local expert over its received rows.
* ``floor``: the client loop with dispatch and combine replaced by local device copies of the
  same bytes (the rows this rank receives, then the rows it sends back), captured and replayed.

Each mode is also run without its communication (``compute``), so the share of the layer spent
in dispatch and combine is ``1 - compute / layer``. Times are p50 over the replays of the
slowest rank, per layer. Needs torch with CUDA, a libepd built with CUDA and a daemon on the
cuda backend (``--socket``); MPS for several ranks on one GPU in client mode.

    python3 bench/layer_loop.py --socket /run/epd/epd.sock --ranks 8 --layers 4 --json
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "client", "python"))

SHAPES = {"decode": 128, "prefill": 4096}
SECRET = b"layer-loop-benchmark-secret"


def fail(message):
    print("layer_loop: %s" % message, file=sys.stderr)
    sys.exit(2)


def need_torch_cuda():
    try:
        import torch
    except ImportError:
        fail("needs torch with CUDA (import torch failed); run it on a GPU host")
    if not torch.cuda.is_available():
        fail("needs a CUDA GPU (torch.cuda.is_available() is False)")
    return torch


def revision():
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short=12", "HEAD"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              timeout=10).stdout.decode().strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def routing(torch, args):
    """Every rank's top-k ids and weights (uniform, without repeats, seeded): the same on
    every worker, so each can size the expert blocks from the whole routing."""
    g = torch.Generator().manual_seed(args.seed)
    R, T, E, K = args.ranks, args.tokens, args.experts, args.topk
    topk = torch.stack([torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
                        for _ in range(R)])
    weights = torch.rand((R, T, K), generator=g)
    return topk, weights


def block_rows(torch, topk, args):
    """C: the most selections any expert gets, rounded up to 16 (the expert GEMM's rows)."""
    counts = torch.bincount(topk.reshape(-1), minlength=args.experts)
    return int((int(counts.max()) + 15) // 16 * 16)


def percentile(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


class Model:
    """One worker's weights and static tensors."""

    def __init__(self, torch, args, rank, C):
        self.torch = torch
        dev = torch.device("cuda", args.device)
        g = torch.Generator(device=dev).manual_seed(1000 + rank)
        H, F, T = args.hidden, args.ffn, args.tokens
        self.Lx = args.experts // args.ranks
        self.C = C
        bf = torch.bfloat16

        def rand(*shape):
            return (torch.randn(shape, generator=g, device=dev) * shape[-2] ** -0.5).to(bf)

        self.w_attn = rand(H, H)
        self.w1 = rand(self.Lx, H, F)
        self.w2 = rand(self.Lx, F, H)
        self.x0 = torch.randn((T, H), generator=g, device=dev).to(bf)
        self.xs = [torch.empty((T, H), dtype=bf, device=dev) for _ in range(args.layers + 1)]
        self.h = torch.empty((T, H), dtype=bf, device=dev)
        self.mid = torch.empty((self.Lx, C, F), dtype=bf, device=dev)
        self.dev = dev

    def attention(self, layer):
        self.torch.matmul(self.xs[layer], self.w_attn, out=self.h)

    def experts(self, recv, y):
        """The grouped expert GEMM over [Lx, C, H] blocks, written into y."""
        self.torch.bmm(recv, self.w1, out=self.mid)
        self.torch.bmm(self.mid, self.w2, out=y)


def client_layers(torch, model, group, topk, weights, args, comm):
    """The L layers over a client-executed group (comm=False: without dispatch and combine,
    the expert GEMM over a static block)."""
    Lx, C, H = model.Lx, model.C, args.hidden
    static = torch.zeros((Lx, C, H), dtype=torch.bfloat16, device=model.dev)
    for layer in range(args.layers):
        model.attention(layer)
        if comm:
            res = group.cx_dispatch(model.h, topk_idx=topk, layout="expand",
                                    expert_block_rows=C, handle=0)
            y, _ = group.cx_y(0, model.dev)
            model.experts(res.recv_x.view(Lx, C, H), y.view(Lx, C, H))
            group.cx_combine(handle=0, apply_weights=True, source_weights=weights,
                             out=model.xs[layer + 1])
        else:
            model.experts(static, static)
            model.xs[layer + 1].copy_(model.h)


def floor_layers(torch, model, args, recv_rows, sent_rows):
    """The client loop with dispatch and combine replaced by local copies of the same bytes."""
    Lx, C, H = model.Lx, model.C, args.hidden
    recv = torch.zeros((Lx * C, H), dtype=torch.bfloat16, device=model.dev)
    y = torch.zeros((Lx * C, H), dtype=torch.bfloat16, device=model.dev)
    src = torch.zeros((max(recv_rows, sent_rows, 1), H), dtype=torch.bfloat16,
                      device=model.dev)
    back = torch.zeros((max(sent_rows, 1), H), dtype=torch.bfloat16, device=model.dev)
    sent = min(sent_rows, Lx * C)

    def run():
        for layer in range(args.layers):
            model.attention(layer)
            src[:args.tokens].copy_(model.h)
            recv[:recv_rows].copy_(src[:recv_rows])
            model.experts(recv.view(Lx, C, H), y.view(Lx, C, H))
            back[:sent].copy_(y[:sent])
            model.xs[layer + 1].copy_(model.h)
    return run


def daemon_layers(torch, model, group, topk, weights, args):
    """The L layers over a daemon-executed group, eagerly."""
    H = args.hidden
    for layer in range(args.layers):
        model.attention(layer)
        res = group.dispatch(model.h, topk_idx=topk, layout="expand")
        counts = res.num_recv_tokens_per_expert_list
        y = torch.empty_like(res.recv_x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                part = res.recv_x[start:start + n]
                torch.matmul(torch.matmul(part, model.w1[e]), model.w2[e], out=y[start:start + n])
            start += n
        combined, _ = group.combine(y, res.handle, apply_weights=True, source_weights=weights)
        res.handle.release()
        model.xs[layer + 1].copy_(combined.view(-1, H))


def timed(torch, run, n, barrier):
    """Per-call times (s) of n calls of run, each bracketed by CUDA events, after a barrier."""
    barrier.wait()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        start[i].record()
        run()
        end[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) / 1e3 for s, e in zip(start, end)]


def graphed(torch, run, warmup):
    """run captured in one CUDA graph after `warmup` eager calls; returns graph.replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def worker(rank, args, barrier, results):
    torch = need_torch_cuda()
    import epd
    torch.cuda.set_device(args.device)
    topk_all, w_all = routing(torch, args)
    C = block_rows(torch, topk_all, args)
    model = Model(torch, args, rank, C)
    model.xs[0].copy_(model.x0)
    topk = topk_all[rank].to(model.dev)
    weights = w_all[rank].to(model.dev)
    L = args.layers
    out = {"rank": rank, "block_rows": C}
    name = "%s-%s" % (args.name, args.mode)
    with epd.connect(args.socket, name="layer-loop-%d" % rank) as client:
        group = None
        if args.mode in ("client", "daemon"):
            shape = dict(world_size=args.ranks, num_experts=args.experts, hidden=args.hidden,
                         max_tokens_per_rank=args.tokens, max_topk=args.topk,
                         op_timeout_ms=60000, device="cuda:%d" % args.device)
            if args.mode == "client":
                shape.update(execution="client", expert_block_rows=C,
                             sms_per_rank=args.sms_per_rank)
            if rank == 0:
                group = epd.Group.create(client, name, SECRET, 0, **shape)
            else:
                group = epd.Group.join(client, name, SECRET, rank, device=shape["device"],
                                       retry_timeout=60)
        if args.mode == "client":
            # A client-executed op waits on the GPU for its peers. A kernel that CUDA loads
            # lazily can wait for the device's running work, and so for a peer's op that waits
            # for this rank: the spawned workers load eagerly (CUDA_MODULE_LOADING, set in
            # main), and one step without communication runs on every rank before the first op.
            client_layers(torch, model, group, topk, weights, args, False)
            torch.cuda.synchronize()
            barrier.wait()
            run = graphed(torch, lambda: client_layers(torch, model, group, topk, weights,
                                                       args, True), args.warmup)
            status = group.cx_status()
            if status["status"]:
                raise RuntimeError("client-executed op failed: %s" % status["message"])
        elif args.mode == "floor":
            dest = topk_all // (args.experts // args.ranks)
            recv_rows = int((dest == rank).sum())
            sent_rows = int((topk_all[rank] >= 0).sum())
            run = graphed(torch, floor_layers(torch, model, args, recv_rows, sent_rows),
                          args.warmup)
        else:
            for _ in range(args.warmup):
                daemon_layers(torch, model, group, topk, weights, args)
            torch.cuda.synchronize()

            def run():
                daemon_layers(torch, model, group, topk, weights, args)
        times = timed(torch, run, args.replays, barrier)
        compute = graphed(torch, lambda: client_layers(torch, model, None, None, None, args,
                                                       False), args.warmup)
        ctimes = timed(torch, compute, args.replays, barrier)
        out.update(layer_s=[t / L for t in times], compute_s=[t / L for t in ctimes])
        if group is not None:
            group.leave()
    results.put(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", default=os.environ.get("EPD_SOCKET", "/run/epd/epd.sock"),
                   help="the daemon's socket (a cuda-backend daemon)")
    p.add_argument("--mode", action="append", choices=("client", "daemon", "floor"),
                   help="repeatable; default: all three")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--sms-per-rank", type=int, default=0,
                   help="client mode: blocks of each rank's kernels (0: the daemon's default)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--shape", choices=sorted(SHAPES), default="decode")
    p.add_argument("--tokens", type=int, help="tokens per rank (default: the shape's)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048, help="the expert GEMM's inner size")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--replays", type=int, default=100)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", type=int, default=0, help="the CUDA device of every rank")
    p.add_argument("--mps", choices=("on", "off", "unknown"), default="unknown",
                   help="whether MPS serves the GPU, recorded with the results")
    p.add_argument("--name", default="layer-loop-%d" % os.getpid(), help="group name prefix")
    p.add_argument("--json", action="store_true", help="one JSON object per mode on stdout")
    args = p.parse_args()
    args.tokens = args.tokens or SHAPES[args.shape]
    if args.experts % args.ranks:
        fail("--experts %d is not a multiple of --ranks %d" % (args.experts, args.ranks))
    if args.replays < 1 or args.layers < 1 or args.warmup < 1:
        fail("--replays, --layers and --warmup must be at least 1")
    # Client-executed ops spin on the GPU for their peers; a lazily loaded kernel can wait for
    # them (docs/client-execution.md, "Co-residency"). Workers inherit this.
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    torch = need_torch_cuda()
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    rev = revision()
    rows = []
    for mode in args.mode or ["client", "daemon", "floor"]:
        args.mode = mode
        barrier = ctx.Barrier(args.ranks)
        results = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(r, args, barrier, results))
                 for r in range(args.ranks)]
        for pr in procs:
            pr.start()
        got = []
        deadline = time.monotonic() + 1800
        while len(got) < args.ranks and time.monotonic() < deadline:
            try:
                got.append(results.get(timeout=5))
            except Exception:
                if any(pr.exitcode not in (None, 0) for pr in procs):
                    break
        for pr in procs:
            pr.join(60)
            if pr.exitcode is None:
                pr.terminate()
                pr.join()
        if len(got) < args.ranks:
            fail("mode %s: %d of %d workers reported (exit codes %s)" %
                 (mode, len(got), args.ranks, [pr.exitcode for pr in procs]))
        layer = max(percentile(g["layer_s"], 0.5) for g in got)
        compute = max(percentile(g["compute_s"], 0.5) for g in got)
        row = {"bench": "layer_loop", "mode": mode, "graph": mode != "daemon",
               "shape": args.shape, "ranks": args.ranks, "layers": args.layers,
               "tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn,
               "experts": args.experts, "topk": args.topk, "block_rows": got[0]["block_rows"],
               "replays": args.replays, "mps": args.mps, "device": torch.cuda.get_device_name(
                   args.device), "revision": rev,
               "per_layer_us_p50": layer * 1e6,
               "per_layer_us_p99": max(percentile(g["layer_s"], 0.99) for g in got) * 1e6,
               "compute_us_p50": compute * 1e6,
               "comm_share": max(0.0, 1.0 - compute / layer) if layer else 0.0}
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
    table = sys.stderr if args.json else sys.stdout
    print("%-7s %6s %14s %14s %12s %10s" % ("mode", "graph", "layer p50 us", "layer p99 us",
                                           "compute us", "comm share"), file=table)
    for r in rows:
        print("%-7s %6s %14.1f %14.1f %12.1f %9.1f%%" % (
            r["mode"], "yes" if r["graph"] else "no", r["per_layer_us_p50"],
            r["per_layer_us_p99"], r["compute_us_p50"], 100 * r["comm_share"]), file=table)
    print("ranks %d, %s shape (T=%d), L=%d, MPS %s" % (args.ranks, args.shape, args.tokens,
                                                      args.layers, args.mps), file=table)


if __name__ == "__main__":
    main()
