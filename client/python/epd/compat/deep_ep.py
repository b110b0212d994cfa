"""DeepEP's ``Buffer`` over epd groups.

Code written for ``deep_ep.Buffer`` keeps its calls and their results::

    from epd.compat.deep_ep import Buffer

    buf = Buffer(group, num_nvl_bytes)          # a torch.distributed process group
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = \\
        buf.get_dispatch_layout(topk_idx, E)
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = \\
        buf.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                     num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
                     num_tokens_per_expert=num_tokens_per_expert)
    combined_x, combined_topk_weights, event = buf.combine(expert_out, handle,
                                                           topk_weights=recv_topk_weights)

Results follow DeepEP's normal (NON_EXPAND) dispatch: one row per (source rank, token) that
goes to this rank, ordered by source rank then token (DeepEP's reference order);
``recv_topk_idx`` holds local expert ids and -1 for experts elsewhere; combine sums the rows
sent back (plus the biases) in fp32 and rounds once to bf16 (docs/semantics.md section 3).

The Buffer:

* ``Buffer(group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, ...)`` takes a
  ``torch.distributed`` process group (or ``comm=``, an mpi4py communicator; or any object
  with ``rank()``, ``size()`` and ``all_gather_object(obj)``). Rank and world size come from
  it; the constructor is collective: rank 0 draws a random epd group name and secret and
  every rank receives them through the group. The daemon is at ``socket=`` (None:
  ``$EPD_SOCKET``, else ``/run/epd/epd.sock``), the device torch's current CUDA device.
* The epd group name, ``rank=`` and ``secret=`` (and on the creating rank the shape:
  ``world_size``, ``num_experts``, ``hidden``, ``max_tokens_per_rank``, ``max_topk``,
  ``dtype``) still make a Buffer; so does an :class:`epd.Group` (served alone, one dtype).
* One Buffer serves bf16 and fp8 calls: an epd group per dtype, ``<name>.bf16`` and
  ``<name>.fp8`` (by name: the given name for the constructor's ``dtype``, ``<name>.<dtype>``
  for the other). **The first call of each dtype is collective**: every rank makes it
  together (as every dispatch is), the creating rank makes the group and the others join it.
  Made from a process group, that first call also agrees the group's shape through it (one
  all-gather): ``hidden`` from ``x``; ``max_topk`` the widest ``topk_idx`` (the world size for
  a dispatch without ``topk_idx``); ``max_tokens_per_rank`` the most tokens of any rank; and
  ``num_experts`` from ``get_dispatch_layout`` or ``num_tokens_per_expert``. Keywords of the
  same names fix them instead; give ``max_tokens_per_rank`` when later calls may carry more
  tokens than the first, which epd refuses (INVALID_ARGUMENT). Later dtypes' groups take the
  first group's shape. Later calls make no collective of their own (but see dispatch without
  ``topk_idx``).
* ``execution=`` (``'client'``, ``'daemon'`` or None) says how the groups the Buffer makes
  run their ops; see "Execution" below. ``Buffer.execution`` tells which they do.
* ``self.group`` is the epd group of the first dtype (DeepEP's process group is
  ``self.process_group``);
  ``num_nvl_bytes``, ``num_rdma_bytes``, ``num_qps_per_rank``, ``allow_nvlink_*``,
  ``allow_mnnvl`` and ``explicitly_destroy`` are kept and unused (epd sizes its buffers from
  the group's shape); ``destroy()`` leaves the groups.

dispatch:

* With ``topk_idx`` the routing comes from it; ``num_tokens_per_rank``, ``is_token_in_rank``
  and ``num_tokens_per_expert`` are then not read.
* Without ``topk_idx`` (and without ``topk_weights``), ``is_token_in_rank`` bool ``[N, R]``
  routes: token t goes once to every rank r with ``is_token_in_rank[t, r]``. epd runs it as a
  NON_EXPAND dispatch whose top-k ids are, for each such r, the first expert of r (``r·L``),
  packed into ``min(R, max_topk)`` columns; a token sent to more ranks than that is
  INVALID_ARGUMENT (checking it waits on the host when ``R > max_topk``).
  ``recv_topk_idx`` and ``recv_topk_weights`` are None, as in DeepEP;
  ``num_recv_tokens_per_expert_list`` is DeepEP's (every rank's ``num_tokens_per_expert`` for
  this rank's experts, summed and aligned) when the Buffer has a process group (one
  all-gather per call), else None. A later combine with ``topk_weights`` takes ``[rows,
  min(R, max_topk)]``.
* ``num_worst_tokens`` > 0: every output has that many rows, the received ones first; the
  padding rows have top-k ids -1 and weights 0 (``recv_x`` padding is unspecified); the
  count list is empty. At most ``world_size * max_tokens_per_rank`` (else INVALID_ARGUMENT
  naming it); a rank receiving more rows fails the op on every rank (CAPACITY_EXCEEDED). With
  CUDA tensors the call does not wait on the host: the outputs are written when the op
  reaches them on the stream (``async_finish``: after ``event.current_stream_wait()``), and
  the handle waits on the host at its first use (an index, a combine, a cached dispatch).
  NumPy arrays and CPU tensors are padded after the op. combine takes the padded rows.
* A cached dispatch (``handle=``) returns ``(recv_x, None, None, None, None, event)`` as
  DeepEP's; new ``topk_weights`` are allowed and come back in the third place. Combine uses
  the first dispatch's handle; after a cached dispatch without weights,
  ``combine(..., topk_weights=W)`` returns the reduction of ``W``.
* ``num_tokens_per_rdma_rank``, ``config``, ``allocate_on_comm_stream`` are not read.

The handle (:class:`DispatchHandle`) indexes as DeepEP's intranode tuple
``(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
is_token_in_rank, send_head)``, computed on first access: ``[0]`` int32 ``[R, R]``, DeepEP's
(``[s][d]`` the tokens ranks ``0..s`` sent to rank ``d``) over a client-executed group; over a
daemon-executed one only column ``rank`` is known and the others are -1; ``[1]`` int32 ``[R, 1]``
the tokens sent to each rank (one channel); ``[2]`` int32 ``[R, 1]`` the first row from each
source; ``[3]`` int32 each row's token index on its source; ``[4]`` the sender's
``is_token_in_rank``; ``[5]`` int32 ``[N, R]`` a token's position among those sent to that
rank, -1 where not sent. ``handle.epd`` is the :class:`epd.Handle` of a daemon-executed
dispatch (released when the DispatchHandle is garbage collected, as DeepEP's tensors are
freed; None when client-executed), ``handle.slot`` the handle slot of a client-executed one
(None when daemon-executed), ``handle.rank_prefix`` the rows per source as ``[R + 1]``
offsets.

Execution. Normal mode runs over daemon-executed groups (the daemon runs each op) or
client-executed ones (docs/client-execution.md: each rank runs its ops itself, on the calling
thread on the host backend, on a CUDA stream on the cuda backend; no daemon message per op).
The results are the same. ``Buffer(execution=None)`` (the default) makes client-executed
groups where the daemon's backend runs the inputs that way: on the host backend NumPy arrays
and CPU tensors (as NumPy views), on the cuda backend torch CUDA tensors with every rank on one
GPU (the GPU of the group's buffers). A Buffer made from a process group judges that from
every rank's input at the first call of each dtype; one made by name from the daemon's
backend alone (so its ranks must then be on the creating rank's GPU, else give
``execution='daemon'``). Where the daemon refuses the client-executed group (Unavailable:
ranks of several processes on one GPU without CUDA MPS) the group is daemon-executed. The
second dtype's group takes the first's execution; a wrapped :class:`epd.Group` keeps its own;
a joining rank that asks for another execution than the group's is refused.
``low_latency_mode`` is always client-executed.

Over a client-executed group:

* A dispatch is a NON_EXPAND ``Group.cx_dispatch`` into the receive area; the Buffer fills
  the group's handle slots in turn (``num_handle_slots=``, default 2, at most 8; given by the
  creating rank), and a cached dispatch reuses its handle's slot. The handles of the last
  ``num_handle_slots`` dispatches can be combined and cached; an older one (whose slot a later
  dispatch filled) is refused with INVALID_ARGUMENT before anything runs (on every rank alike,
  as they issue the same calls). Its tuple stays readable.
* The outputs are copies of the ``num_recv_tokens`` received rows (``copy_outputs=False``:
  views of the receive area, rewritten by the group's next dispatch). On CUDA the dispatch
  waits on the host for its stream to pass the op and reads the counts, as DeepEP's normal mode
  does; with ``num_worst_tokens`` it does not (except at the first dispatch into each handle
  slot, which reads where its counts live): the W rows are copied on the stream and the
  padding's top-k ids set to -1 and weights to 0 there, from the count in device memory.
* combine copies ``x`` (and ``topk_weights`` as ``recv_weights``) into the slot's y area and
  runs ``Group.cx_combine``. On CUDA it is queued on the current stream (no host wait, with or
  without ``async_finish``); its outputs are ready for the current stream's later work.
* On CUDA, the ops run on the current stream, or after ``previous_event`` on a side stream
  that the current stream waits for at once (``async_finish``: at
  ``event.current_stream_wait()``). A failed op is found at the next host wait: a dispatch
  without ``num_worst_tokens``, the first use of a ``num_worst_tokens`` dispatch's handle, or
  :meth:`Buffer.synchronize`, which raise its error (a failure sticks: every later op of the
  group fails alike).

Events: every op returns an :class:`EventOverlap` (``current_stream_wait()``, a context
manager). ``previous_event`` (an EventOverlap or a ``torch.cuda.Event``) is waited for on the
GPU before the op reads its inputs; with CUDA tensors every op also waits for the work queued
on the current stream, without a host synchronisation. dispatch waits for its op on the host
(its output sizes come from the counts, as in DeepEP's CPU-synchronised normal mode) unless
``num_worst_tokens`` is given; combine with ``async_finish=True`` returns at once with its
output tensors, which the current stream may use after ``event.current_stream_wait()``.
Errors of such ops are raised by the buffer's next call (or :meth:`Buffer.synchronize`).
Without ``async_finish`` the event has nothing to wait for. (That is daemon-executed; for
client-executed ops see "Execution".)

Tensors: torch CUDA tensors (the cuda backend; see :mod:`epd.tensors`) stay on the GPU:
outputs are device tensors; a daemon-executed dispatch allocates them with room for the
group's worst case unless the buffer's ``recv_capacity`` bounds the rows. CPU torch tensors
and NumPy arrays (bf16 as uint16 bits, floats rounded to bf16 on the way in; fp8 as uint8 e4m3
bytes with float32 scales, passed as ``(x, x_scales)`` as in DeepEP) go through host shared
memory; their outputs
are copies by default (``copy_outputs=True``); ``copy_outputs=False`` returns views of the
output arena, valid until the handle is released (client-executed: of the receive area,
valid until the next dispatch).

Other names: ``Config`` (kept, never read; size hints 0), ``topk_idx_t`` (int64),
``Buffer.capture``, ``is_sm90_compiled`` (libepd has its CUDA kernels), ``set_num_sms`` /
``num_sms``, ``get_dispatch_config`` / ``get_combine_config`` (a Config with ``num_sms``),
``get_comm_stream`` (torch's current stream: epd orders its ops there).

Not supported, raising NotImplementedError that names them: internode (RDMA) buffers,
``runtime`` (DeepEP's C++ runtime), ``get_local_buffer_tensor``, ``enable_shrink``. The EXPAND
layout is :meth:`epd.Group.dispatch` with ``layout='expand'``.

Low-latency mode (``Buffer(..., low_latency_mode=True)``) runs over a client-executed group
(docs/client-execution.md) whose buffers hold fixed expert blocks of C = R·T rows
(docs/semantics.md §2.6) and, for a bf16 group with hidden a multiple of 128, the quantizing
dispatch (§2.7)::

    buf = Buffer("ll0", rank=rank, secret=secret, world_size=R, num_experts=E, hidden=H,
                 max_tokens_per_rank=T, max_topk=K, low_latency_mode=True)
    recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(x, topk_idx, T, E)
    y = experts(recv_x, recv_count)                      # [L, R*T, H] bf16
    combined_x, event, hook = buf.low_latency_combine(y, topk_idx, topk_weights, handle)

* ``recv_x`` is ``[num_local_experts, R·T, hidden]``; with ``use_fp8`` it is the pair
  ``(e4m3 data, float32 scales [L, R·T, hidden/128])``. ``round_scale=True`` makes every scale
  a power of two (§2.7: the data is x times 2^-e, the scale 2^e, e = ⌈log2(amax/448)⌉);
  ``use_ue8m0=True`` (which needs ``round_scale``, and hidden a multiple of 512) returns the
  scales as DeepEP does, int32 ``[L, R·T, hidden/512]``, each word four bytes e + 127 of
  consecutive blocks, little-endian. ``recv_count`` int32 ``[L]`` is the
  rows received per local expert; ``cumulative_local_expert_recv_stats`` gets them added.
  ``handle[0]`` int32 ``[L, R·T]`` is the source token (its index on the source rank) of each
  row, ``handle[1]`` int64 ``[L, R]`` the rows of each source rank, ``begin << 32 | count``;
  ``handle[2:5]`` are T, hidden and the number of experts, as in DeepEP.
* Combine is the EXPAND combine with ``apply_weights`` and ``topk_weights`` as the source's
  weights (§3); ``zero_copy=True`` means the expert output is already in
  :meth:`Buffer.get_next_low_latency_combine_buffer`.
* NumPy arrays (host backend) and torch CUDA tensors (cuda backend, ops on the current
  stream, capturable in a CUDA graph) are both accepted. The event is an
  :class:`EventOverlap` with nothing to wait for: the op is ordered on the current stream.
  ``return_recv_hook=True`` returns a hook that does nothing: the op is whole when the call
  returns (its receive is not split from its send).
* Not supported, raising NotImplementedError that names them: ``use_logfmt`` and the mask
  calls (``low_latency_update_mask_buffer``, ...).
"""

import secrets

import numpy as np

from .. import _lib, tensors
from ..client import Client
from ..errors import InvalidArgument, NotFound, Unavailable, make_error
from ..group import EXPAND, NON_EXPAND, Group, Handle


def __getattr__(name):
    # DeepEP's topk_idx_t: the dtype of topk_idx, torch.int64 once the program imported torch.
    if name == "topk_idx_t":
        torch = tensors.torch_module()
        return torch.int64 if torch is not None else np.dtype(np.int64)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def is_sm90_compiled():
    """True when libepd has its CUDA kernels, which are built for sm_90."""
    return hasattr(_lib.load(), "epd_cx_preload")


def _unsupported(what):
    raise NotImplementedError("%s is not supported by epd's DeepEP front" % what)


class Config:
    """DeepEP's tuning ``Config``. epd sizes and schedules its own buffers, so the values are
    kept for the caller and never read; the size hints are 0 (the Buffer takes no sizes)."""

    def __init__(self, num_sms=20, num_max_nvl_chunked_send_tokens=6,
                 num_max_nvl_chunked_recv_tokens=256, num_max_rdma_chunked_send_tokens=6,
                 num_max_rdma_chunked_recv_tokens=256):
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        return 0

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        return 0


class LowLatencyHandle(tuple):
    """DeepEP's low-latency handle ``(src_info, layout_range, num_max_dispatch_tokens_per_rank,
    hidden, num_experts)``, with the epd handle ``slot`` its dispatch filled."""

    def __new__(cls, items, slot):
        self = tuple.__new__(cls, items)
        self.slot = slot
        return self


def _ll_layout(recv_src, L, C, R, T):
    """(src_info int32 [L, C], layout_range int64 [L, R]) from a fixed-block dispatch's
    ``recv_src`` (``s*T + t``, -1 on padding): each row's source token, and each source rank's
    rows in each block as ``begin << 32 | count`` (rows of a block are ordered by source)."""
    src = recv_src.reshape(L, C)
    if tensors.is_tensor(src):
        torch = tensors.torch_module()
        valid = src >= 0
        rank = torch.where(valid, torch.div(src, T, rounding_mode="floor"), -1)
        info = torch.where(valid, src % T, -1).int()
        counts = (rank.unsqueeze(-1) == torch.arange(R, device=src.device)).sum(1).long()
        begin = torch.cumsum(counts, 1) - counts
    else:
        valid = src >= 0
        rank = np.where(valid, src // T, -1)
        info = np.where(valid, src % T, -1).astype(np.int32)
        counts = (rank[..., None] == np.arange(R)).sum(1).astype(np.int64)
        begin = np.cumsum(counts, 1) - counts
    return info, (begin << 32) | counts


def _is_torch(value):
    return tensors.is_tensor(value)


def _torch_distributed():
    """torch.distributed when the program imported torch and it has it, else None."""
    if tensors.torch_module() is None:
        return None
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() else None


class _Comm:
    """The collectives a Buffer made from a process group needs: its rank and size, and an
    all-gather of small picklable objects.

    Adapts a ``torch.distributed`` process group, an mpi4py communicator (``Get_rank``,
    ``Get_size``, ``allgather``), or any object with ``rank()``, ``size()`` and
    ``all_gather_object(obj)`` returning the list of every rank's ``obj`` in rank order.
    """

    def __init__(self, group):
        dist = _torch_distributed()
        if dist is not None and isinstance(group, dist.ProcessGroup):
            self.rank, self.size = group.rank(), group.size()

            def gather(obj):
                out = [None] * self.size
                dist.all_gather_object(out, obj, group=group)
                return out
        elif all(callable(getattr(group, n, None)) for n in ("Get_rank", "Get_size",
                                                               "allgather")):
            self.rank, self.size = group.Get_rank(), group.Get_size()
            gather = group.allgather
        elif all(callable(getattr(group, n, None)) for n in ("rank", "size",
                                                               "all_gather_object")):
            self.rank, self.size = group.rank(), group.size()
            gather = group.all_gather_object
        else:
            raise InvalidArgument("group must be a torch.distributed process group, an mpi4py "
                                  "communicator, an object with rank(), size() and "
                                  "all_gather_object(obj), an epd group name or an epd.Group, "
                                  "not %r" % (group,))
        self.rank, self.size = int(self.rank), int(self.size)
        self.all_gather = gather

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        return self.all_gather(obj if self.rank == 0 else None)[0]


def _current_device():
    """torch's current CUDA device when the program uses torch with CUDA, else 0 (the
    daemon's first device)."""
    torch = tensors.torch_module()
    if torch is not None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return 0


class EventOverlap:
    """DeepEP's ``EventOverlap``: what every op returns as its event.

    :meth:`current_stream_wait` makes torch's current stream wait for the op (or the CUDA
    event) on the GPU; for an op that already completed on the host, or one ordered on the
    current stream, it does nothing. As a context manager it waits on exit, like DeepEP's.
    """

    def __init__(self, future=None, event=None, extra_tensors=None):
        self.future = future
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self):
        if self.future is not None:
            if self.future.device is not None:
                self.future.current_stream_wait()
        elif self.event is not None:
            tensors.torch_module().cuda.current_stream().wait_event(self.event)

    def _wait_on(self, stream):
        if self.future is not None:
            if self.future.device is not None:
                self.future.stream_wait(stream)
        elif self.event is not None:
            stream.wait_event(self.event)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.current_stream_wait()


def _layout(topk_idx, R, E):
    """(num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E], is_token_in_rank
    bool [N, R]) of ``topk_idx`` [N, K], on its device for a tensor."""
    L = E // R
    if _is_torch(topk_idx):
        torch = tensors.torch_module()
        tk = topk_idx
        if tk.dim() != 2 or tk.is_floating_point() or tk.dtype == torch.bool:
            raise InvalidArgument("topk_idx must be an integer [num_tokens, num_topk] tensor")
        if tk.numel() and bool(((tk < -1) | (tk >= E)).any()):
            raise InvalidArgument("topk_idx holds expert ids outside [-1, %d)" % E)
        tk = tk.long()
        valid = tk >= 0
        num_tokens_per_expert = torch.bincount(tk[valid], minlength=E).int()
        dest = torch.where(valid, torch.div(tk, L, rounding_mode="floor"),
                           torch.full_like(tk, -1))
        ranks = torch.arange(R, device=tk.device)
        is_token_in_rank = (dest.unsqueeze(-1) == ranks).any(dim=1)
        return is_token_in_rank.sum(dim=0).int(), num_tokens_per_expert, is_token_in_rank
    tk = np.asarray(topk_idx)
    if tk.ndim != 2 or tk.dtype.kind not in "iu":
        raise InvalidArgument("topk_idx must be an integer [num_tokens, num_topk] array")
    if np.any((tk < -1) | (tk >= E)):
        raise InvalidArgument("topk_idx holds expert ids outside [-1, %d)" % E)
    valid = tk >= 0
    num_tokens_per_expert = np.bincount(tk[valid].astype(np.int64),
                                        minlength=E).astype(np.int32)
    dest = np.where(valid, tk // L, -1)
    is_token_in_rank = np.zeros((tk.shape[0], R), dtype=bool)
    for r in range(R):
        is_token_in_rank[:, r] = np.any(dest == r, axis=1)
    return is_token_in_rank.sum(axis=0).astype(np.int32), num_tokens_per_expert, \
        is_token_in_rank


def _rank_topk(is_token_in_rank, num_tokens, R, L, K):
    """The top-k ids that route like ``is_token_in_rank`` [N, R] (bool): for each rank r a
    token goes to, the first expert of r (``r * L``), packed into at most ``K`` columns
    (``min(R, K)`` wide), -1 elsewhere."""
    m = is_token_in_rank
    if _is_torch(m):
        torch = tensors.torch_module()
        shape, is_bool = tuple(m.shape), m.dtype == torch.bool
    else:
        m = np.asarray(m)
        shape, is_bool = m.shape, m.dtype == np.bool_
    if not is_bool or shape != (num_tokens, R):
        raise InvalidArgument("is_token_in_rank must be bool [%d, %d] (tokens, ranks), not %s "
                              "%s" % (num_tokens, R, m.dtype, shape))
    if _is_torch(m):
        first = torch.arange(R, device=m.device, dtype=torch.int64) * L
        tk = torch.where(m, first, torch.full_like(first, -1))
        if R > K:
            most = int(m.sum(dim=1).max()) if num_tokens else 0
            if most > K:
                raise InvalidArgument("is_token_in_rank sends a token to %d ranks; the group's "
                                      "max_topk is %d" % (most, K))
            order = torch.sort((~m).to(torch.int8), dim=1, stable=True)[1]
            tk = tk.gather(1, order)[:, :K].contiguous()
        return tk
    first = np.arange(R, dtype=np.int64) * L
    tk = np.where(m, first, -1)
    if R > K:
        most = int(m.sum(axis=1).max()) if num_tokens else 0
        if most > K:
            raise InvalidArgument("is_token_in_rank sends a token to %d ranks; the group's "
                                  "max_topk is %d" % (most, K))
        order = np.argsort(~m, axis=1, kind="stable")
        tk = np.ascontiguousarray(np.take_along_axis(tk, order, axis=1)[:, :K])
    return tk


def _like(array, ref):
    """NumPy ``array`` as ``ref`` holds its data: a tensor on ``ref``'s device for a tensor."""
    if _is_torch(ref):
        return tensors.from_numpy(np.ascontiguousarray(array)).to(ref.device)
    return array


def _pad_rows(value, rows, fill):
    """``value`` [n, ...] in a new array or tensor of ``rows`` rows, the rest ``fill``."""
    if value is None:
        return None
    if _is_torch(value):
        torch = tensors.torch_module()
        shape = (rows,) + tuple(value.shape[1:])
        if fill == 0:  # as bytes: fp8 tensors cannot be filled
            nbytes = int(np.prod(shape, dtype=np.int64)) * value.element_size()
            out = torch.zeros(nbytes, dtype=torch.uint8, device=value.device).view(
                value.dtype).view(shape)
        else:
            out = torch.full(shape, fill, dtype=value.dtype, device=value.device)
    else:
        out = np.full((rows,) + value.shape[1:], fill, dtype=value.dtype)
    out[:value.shape[0]] = value
    return out


class DispatchHandle:
    """The handle of a normal-mode dispatch: DeepEP's intranode handle tuple, indexable and
    iterable as ``(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
    recv_src_idx, is_token_in_rank, send_head)``, over the epd :class:`epd.Handle`
    (:attr:`epd`) that combine and cached dispatches use.

    * ``[0]`` int32 ``[R, R]``, DeepEP's rank prefix matrix: ``[s][d]`` the tokens ranks
      ``0..s`` sent to rank ``d`` (rows ``[s-1][rank]:[s][rank]`` came from rank s). Exact in
      every column for a client-executed dispatch; a daemon-executed one reports only this
      rank's column, and the other entries are -1.
    * ``[1]`` int32 ``[R, 1]``: the tokens this rank sent to each rank (one channel).
    * ``[2]`` int32 ``[R, 1]``: the first row received from each source (one channel).
    * ``[3]`` int32 ``[rows]``: each received row's token index on its source rank.
    * ``[4]`` bool ``[N, R]``: the ranks each of this rank's tokens went to.
    * ``[5]`` int32 ``[N, R]``: a token's position among the tokens this rank sent to that
      rank, -1 where it was not sent.

    The entries are computed on first access (tensors on the input's device for torch
    inputs). A handle of a ``num_worst_tokens`` dispatch on CUDA tensors waits on the host for
    that dispatch at its first use (an index, :attr:`epd`, or combine).
    """

    #: the handle slot of a client-executed dispatch (None: daemon-executed)
    slot = None

    def __init__(self, group, result=None, future=None, is_token_in_rank=None, topk_idx=None,
                 padded_rows=0):
        self._group = group
        self._result = result
        self._future = future
        self._in_rank = is_token_in_rank
        self._topk_idx = topk_idx
        self.padded_rows = padded_rows  # num_worst_tokens of the dispatch, 0: none
        self._items = None
        if result is not None:
            result.handle.auto_release()

    # ---- the dispatch behind it ----

    def done(self):
        return self._future is None or self._future.done()

    def wait(self):
        """The dispatch's :class:`epd.DispatchResult` (waits for it on the host)."""
        if self._result is None:
            self._result = self._future.wait()
            self._future = None
            self._result.handle.auto_release()
        return self._result

    @property
    def epd(self):
        """The :class:`epd.Handle`."""
        return self.wait().handle

    @property
    def rank_prefix(self):
        """int32 ``[R + 1]``: rows ``rank_prefix[s]:rank_prefix[s + 1]`` came from rank s."""
        return self.wait().rank_prefix

    @property
    def num_recv_tokens(self):
        return self.wait().num_recv_tokens

    # ---- DeepEP's tuple ----

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return self._tuple()[i]

    def __iter__(self):
        return iter(self._tuple())

    def _tuple(self):
        if self._items is None:
            self._items = self._build()
        return self._items

    def _rank_prefix_matrix(self):
        """int32 ``[R, R]``, every column known, or None (daemon-executed: this rank's only)."""
        return None

    def _recv_src(self):
        """recv_src of the received rows (``[num_recv_tokens]``)."""
        res = self.wait()
        return res.recv_src[:res.num_recv_tokens]

    def _build(self):
        g = self._group
        R, rank, T, L = g.world_size, g.rank, g.max_tokens_per_rank, g.num_local_experts
        prefix = np.asarray(self.rank_prefix, dtype=np.int32)
        rpm = self._rank_prefix_matrix()
        if rpm is None:
            rpm = np.full((R, R), -1, np.int32)
            rpm[:, rank] = prefix[1:]
        in_rank = self._in_rank
        if in_rank is None:
            in_rank = _layout(self._topk_idx, R, L * R)[2]
        src = self._recv_src()
        ref = src if _is_torch(src) else in_rank
        if _is_torch(in_rank):
            torch = tensors.torch_module()
            sent = in_rank.sum(dim=0).to(torch.int32).reshape(R, 1)
            head = torch.where(in_rank, torch.cumsum(in_rank.to(torch.int32), 0) - 1,
                               torch.full_like(in_rank, -1, dtype=torch.int32)).to(torch.int32)
        else:
            in_rank = np.asarray(in_rank)
            sent = in_rank.sum(axis=0).astype(np.int32).reshape(R, 1)
            head = np.where(in_rank, np.cumsum(in_rank, axis=0) - 1, -1).astype(np.int32)
        src_idx = (src % T).to(tensors.torch_module().int32) if _is_torch(src) else \
            (np.asarray(src) % T).astype(np.int32)
        self._topk_idx = None
        return (_like(rpm, ref), sent, _like(prefix[:R].reshape(R, 1), ref), src_idx, in_rank,
                head)

    def __repr__(self):
        return "<deep_ep DispatchHandle %s>" % (
            "pending" if self._result is None else repr(self._result.handle))


def _keep_for(stream, *values):
    """Marks the CUDA tensors among ``values`` as used on ``stream`` (a side stream, None:
    none), so that the caching allocator does not reuse their memory before ``stream``'s work
    that reads or writes them is done."""
    if stream is None:
        return
    for v in values:
        if tensors.is_cuda(v):
            v.record_stream(stream)


def _cx_check(group):
    """Raises the error of the rank's last client-executed op (after a host wait on CUDA): a
    failure sticks, so an OK last op means every earlier one of the epoch ended OK."""
    st = group.cx_status()
    if st["status"] < 0:
        raise make_error(st["status"], st["message"] or st["status_name"])


class _CxDispatchHandle(DispatchHandle):
    """A :class:`DispatchHandle` of a client-executed dispatch: the handle slot it filled
    (:attr:`slot`), and copies of what the tuple is computed from (the rows per source and
    recv_src), taken when the op completes.

    The slot keeps the routing for combine and cached dispatches until a later (not cached)
    dispatch of the group fills it again: each Buffer fills the slots in turn, so the handles of
    the last ``num_handle_slots`` dispatches stay usable; an older one is refused
    (INVALID_ARGUMENT) before anything runs, on every rank alike. Its tuple stays readable.
    """

    def __init__(self, group, slot, slots, alignment, num_topk, padded_rows, prefix, src,
                 event=None, matrix=None):
        DispatchHandle.__init__(self, group, padded_rows=padded_rows)
        self.slot = slot
        self.alignment = alignment
        self.num_topk = num_topk
        self._slots = slots                  # the Buffer's slot record of the group
        self._generation = slots["filled"][slot]
        self._prefix = prefix                # int32 [R + 1]; a device tensor until waited
        self._src = src                      # recv_src rows; [:W] on the device until waited
        self._matrix = matrix                # int32 [R, R]; a device tensor until waited
        self._event = event                  # CUDA: the op's end on its stream, until waited

    def done(self):
        return self._event is None or self._event.query()

    def wait(self):
        """Waits on the host for the dispatch (CUDA ``num_worst_tokens``) and raises its error.
        Returns the handle."""
        if self._event is not None:
            self._event.synchronize()
            _cx_check(self._group)  # raised at every use of the handle of a failed op
            self._event = None
            self._prefix = self._prefix.cpu().numpy().astype(np.int32)
            if self._matrix is not None:
                self._matrix = self._matrix.cpu().numpy().astype(np.int32)
            self._src = self._src[:int(self._prefix[-1])]
        return self

    @property
    def epd(self):
        """None: a client-executed dispatch has no :class:`epd.Handle` (see :attr:`slot`)."""
        return None

    @property
    def rank_prefix(self):
        return self.wait()._prefix

    @property
    def num_recv_tokens(self):
        return int(self.rank_prefix[-1])

    def _rank_prefix_matrix(self):
        return self.wait()._matrix

    def _recv_src(self):
        return self.wait()._src

    def check_live(self):
        """Refuses a handle whose slot a later dispatch filled."""
        if self._slots["filled"][self.slot] != self._generation:
            raise InvalidArgument(
                "handle: its slot %d was filled by a later dispatch (a client-executed group "
                "keeps the handles of its last %d dispatches; Buffer(num_handle_slots=...) "
                "keeps more)" % (self.slot, len(self._slots["filled"])))

    def __repr__(self):
        return "<deep_ep DispatchHandle slot %d%s>" % (self.slot,
                                                       " pending" if self._event else "")


def _epd_handle(handle):
    """(epd.Handle, DispatchHandle or None) of a normal-mode dispatch's handle."""
    if isinstance(handle, DispatchHandle):
        return handle.epd, handle
    if isinstance(handle, Handle):
        return handle, None
    raise InvalidArgument("handle must be the handle a dispatch of this Buffer returned")


class Buffer:
    """DeepEP's ``deep_ep.Buffer`` over epd groups. See the module docstring.

    ``group`` is one of:

    * a ``torch.distributed`` process group (or, with ``group=None``, ``comm`` an mpi4py
      communicator), as DeepEP takes it; also any object with ``rank()``, ``size()`` and
      ``all_gather_object(obj)`` (the list of every rank's ``obj``). The constructor is then
      collective: rank 0 draws a random epd group name and secret and every rank receives
      them through the process group. The daemon is at ``socket`` (None: ``$EPD_SOCKET``, else
      ``/run/epd/epd.sock``); ``device`` defaults to torch's current CUDA device. The epd
      groups are made on first use, one per dtype (see :meth:`dispatch`);
    * the epd group's name, with ``rank`` and ``secret`` (bytes or str, at least 16 bytes);
      the creating rank (``create``; default: rank 0) also gives the group's shape:
      ``world_size``, ``num_experts``, ``hidden``, ``max_tokens_per_rank``, ``max_topk``,
      ``dtype`` ('bf16' or 'fp8'), ``arena_bytes``, ``op_timeout_ms``. The others join,
      retrying for ``join_timeout`` seconds while the group does not exist yet. The group of
      the other dtype is named ``<name>.<dtype>`` and made on first use with the same shape;
    * an :class:`epd.Group` to wrap; the Buffer then serves that group's dtype only.

    With a process group, ``num_experts``, ``hidden``, ``max_tokens_per_rank`` and
    ``max_topk`` may be given; what is not given is agreed by the first dispatch (see the
    module docstring). ``client`` is an open :class:`epd.Client` to use instead of a new
    connection, ``device`` this rank's daemon device index or a torch device (``"cuda:0"``,
    matched to the daemon's GPU by UUID).

    ``copy_outputs`` (default True) makes host-memory outputs copies instead of arena views,
    and a client-executed dispatch's outputs copies instead of views of the receive area;
    ``recv_capacity`` bounds the rows of the device tensors a daemon-executed CUDA dispatch
    allocates for its outputs (None: the group's worst case).

    ``execution`` is ``'client'``, ``'daemon'`` or None (choose; see the module docstring's
    "Execution"): how the groups of normal-mode calls run their ops. ``num_handle_slots``
    (the creating rank; 0: the group's default, 2) is how many dispatches' handles a
    client-executed group keeps.

    ``low_latency_mode=True`` makes the creating rank create a client-executed group for
    :meth:`low_latency_dispatch` and :meth:`low_latency_combine` (see the module docstring):
    fixed expert blocks of ``world_size * max_tokens_per_rank`` rows and, for a bf16 group
    whose hidden is a multiple of 128, the quantizing dispatch; with a process group it needs
    the shape keywords and is made by the constructor. ``num_nvl_bytes``,
    ``num_rdma_bytes``, ``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode``,
    ``allow_mnnvl`` and ``explicitly_destroy`` are kept as attributes and unused: epd sizes
    its buffers from the group's shape. ``enable_shrink`` (masking ranks) is not supported.
    """

    #: DeepEP's SM count for normal-mode kernels (:meth:`set_num_sms`); epd's SM budget is the
    #: group's ``sms_per_rank``.
    num_sms = 20

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True,
                 allow_mnnvl=False, explicitly_destroy=False, enable_shrink=False, comm=None,
                 *, rank=None, secret=None, socket=None, client=None, world_size=None,
                 num_experts=None, hidden=None, max_tokens_per_rank=None, max_topk=None,
                 dtype="bf16", arena_bytes=None, op_timeout_ms=0, create=None,
                 join_timeout=30.0, copy_outputs=True, recv_capacity=None, device=None,
                 execution=None, num_handle_slots=0):
        if enable_shrink:
            _unsupported("enable_shrink (masking ranks)")
        if execution not in (None, "client", "daemon"):
            raise InvalidArgument("execution must be 'client', 'daemon' or None, not %r" %
                                  (execution,))
        if low_latency_mode and execution == "daemon":
            raise InvalidArgument("low_latency_mode runs over a client-executed group, not "
                                  "execution='daemon'")
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
        self.allow_mnnvl = allow_mnnvl
        self.explicitly_destroy = explicitly_destroy
        self.low_latency_mode = bool(low_latency_mode)
        self.copy_outputs = copy_outputs
        self.recv_capacity = recv_capacity
        self._execution = execution  # as asked; None: chosen when a group is made
        self._num_handle_slots = num_handle_slots
        self._slots = {}     # client-executed group id -> {"next": slot, "filled": [count]}
        self._cx_events = {}  # client-executed group id -> (group, CUDA event of its last op)
        self._inflight = []  # async_finish combines and num_worst_tokens dispatches
        self._side = {}      # device -> stream for ops after a previous_event
        self._groups = {}    # dtype -> epd.Group
        self._owns_groups = True
        self._owns_client = False
        self._client = client
        self._comm = None
        self.process_group = None
        self._join_timeout = join_timeout
        self._shape = {"world_size": world_size, "num_experts": num_experts, "hidden": hidden,
                       "max_tokens_per_rank": max_tokens_per_rank, "max_topk": max_topk,
                       "arena_bytes": arena_bytes, "op_timeout_ms": op_timeout_ms}
        self._dtype = dtype
        if isinstance(group, Group):
            if execution is not None and execution != group.execution:
                raise InvalidArgument("execution %r differs from the epd group's %r" %
                                      (execution, group.execution))
            self._owns_groups = False
            self._dtype = group.dtype
            self._groups[group.dtype] = group
            self.rank, self.group_size = group.rank, group.world_size
            return
        if isinstance(group, str):
            if rank is None or secret is None:
                raise InvalidArgument("Buffer(name, ...) needs rank and secret")
            self._name, self._secret, self.rank = group, secret, int(rank)
            self._creates = bool(create) if create is not None else self.rank == 0
            self._device = 0 if device is None else device
        else:
            if group is None and comm is None:
                raise InvalidArgument("Buffer needs a process group, comm=, an epd group name "
                                      "or an epd.Group")
            self.process_group = group if group is not None else comm
            self._comm = _Comm(self.process_group)
            self.rank = self._comm.rank
            if world_size is not None and int(world_size) != self._comm.size:
                raise InvalidArgument("world_size %d differs from the process group's size %d"
                                      % (world_size, self._comm.size))
            self._shape["world_size"] = self._comm.size
            if self.low_latency_mode:
                missing = [k for k in ("num_experts", "hidden", "max_tokens_per_rank",
                                       "max_topk") if self._shape[k] is None]
                if missing:
                    raise InvalidArgument("low_latency_mode with a process group needs " +
                                          ", ".join(missing))
            ident = None
            if self.rank == 0:
                ident = ("deep_ep-" + secrets.token_hex(8), secrets.token_hex(32))
            self._name, self._secret = self._comm.broadcast(ident)
            self._creates = self.rank == 0
            self._device = _current_device() if device is None else device
        self.group_size = self._shape["world_size"]
        if client is None:
            self._client = Client(socket=socket, name="deep_ep-compat")
            self._owns_client = True
        try:
            if self._comm is None or self.low_latency_mode:
                self._open(dtype)
        except BaseException:
            if self._owns_client:
                self._client.close()
            raise

    # ---- the epd groups ----

    @property
    def group(self):
        """The epd group of the Buffer's first dtype (the constructor's, else the first one
        made)."""
        g = self._groups.get(self._dtype)
        if g is None and self._groups:
            g = next(iter(self._groups.values()))
        if g is None:
            raise Unavailable("no epd group yet: the Buffer's first dispatch of each dtype "
                              "makes it")
        return g

    @property
    def num_experts(self):
        g = self._groups.get(self._dtype) or next(iter(self._groups.values()), None)
        return g.num_experts if g is not None else self._shape["num_experts"]

    @property
    def hidden(self):
        g = self._groups.get(self._dtype) or next(iter(self._groups.values()), None)
        return g.hidden if g is not None else self._shape["hidden"]

    def _group_name(self, dtype):
        if self._comm is None and dtype == self._dtype:
            return self._name
        return "%s.%s" % (self._name, dtype)

    def _open(self, dtype, kinds=None):
        """Creates (the creating rank) or joins the epd group of ``dtype``. ``kinds``: every
        rank's input kind where the ranks agreed them (see :meth:`_execution_for`)."""
        name = self._group_name(dtype)
        s = self._shape
        if self._creates:
            missing = [k for k in ("world_size", "num_experts", "hidden", "max_tokens_per_rank",
                                   "max_topk") if s[k] is None]
            if missing:
                raise InvalidArgument("the creating rank must give " + ", ".join(missing))
            mode = self._execution_for(kinds)
            opts = {}
            if self.low_latency_mode:
                opts = {"execution": "client",
                        "expert_block_rows": s["world_size"] * s["max_tokens_per_rank"],
                        "quantize": dtype == "bf16" and s["hidden"] % 128 == 0,
                        "num_handle_slots": self._num_handle_slots}
            elif mode == "client":
                # Normal mode sends NON_EXPAND rows only: R·T a rank at most, not the EXPAND
                # worst case that the buffers would otherwise hold (K times more).
                opts = {"execution": "client", "num_handle_slots": self._num_handle_slots,
                        "recv_rows": s["world_size"] * s["max_tokens_per_rank"]}

            def create(**opts):
                return Group.create(self._client, name, self._secret, self.rank,
                                    world_size=s["world_size"], num_experts=s["num_experts"],
                                    hidden=s["hidden"],
                                    max_tokens_per_rank=s["max_tokens_per_rank"],
                                    max_topk=s["max_topk"], dtype=dtype,
                                    arena_bytes=s["arena_bytes"],
                                    op_timeout_ms=s["op_timeout_ms"], device=self._device,
                                    **opts)
            try:
                g = create(**opts)
            except Unavailable as e:
                # A client-executed group the daemon cannot make here (CUDA: ranks of several
                # processes on a GPU without MPS): daemon-executed, unless asked for. A refusal
                # by a memory budget is the caller's to see, not a reason to switch modes.
                if self.low_latency_mode or self._execution is not None or not opts or \
                        "max_group_bytes" in str(e):
                    raise
                g = create()
        else:
            g = Group.join(self._client, name, self._secret, self.rank, device=self._device,
                           retry_timeout=self._join_timeout)
        if g.dtype != dtype and dtype != self._dtype:
            g.leave()
            raise InvalidArgument("epd group %r is %s, not %s" % (name, g.dtype, dtype))
        if self._execution is not None and g.execution != self._execution:
            g.leave()
            raise InvalidArgument("epd group %r is %s-executed, not %s" %
                                  (name, g.execution, self._execution))
        if not self._groups:
            self._dtype = g.dtype  # a joining rank learns the group's dtype
        self._groups[g.dtype] = g
        if g.execution == "client" and self._comm is not None:
            # Every rank has joined, and so loaded epd's kernels, before any rank's first op:
            # a kernel loading in a rank still joining can wait for a peer's op that waits
            # for that rank (docs/client-execution.md, "Co-residency").
            self._comm.all_gather(None)
        # A later dtype's group is made alike.
        for k in ("world_size", "num_experts", "hidden", "max_tokens_per_rank", "max_topk",
                  "arena_bytes", "op_timeout_ms"):
            s[k] = getattr(g, k)
        self.group_size = g.world_size
        return g

    def _group_for(self, dtype, num_tokens, hidden, num_topk, num_experts=None, x=None):
        """The epd group of ``dtype``, made on its first call (collective: every rank makes
        its first call of a dtype together, as every dispatch is collective)."""
        g = self._groups.get(dtype)
        if g is not None:
            return g
        if not self._owns_groups:
            raise InvalidArgument("this Buffer wraps an epd group of dtype %s; %s calls need a "
                                  "Buffer made from a process group or a group name" %
                                  (self._dtype, dtype))
        kinds = None
        if self._comm is not None:
            E = self._shape["num_experts"] or num_experts
            every = self._comm.all_gather((int(num_tokens), int(hidden), int(num_topk),
                                           None if E is None else int(E), self._kind(x)))
            kinds = [e[4] for e in every]
            s = self._shape
            if s["hidden"] is None:
                hs = sorted({e[1] for e in every})
                if len(hs) != 1:
                    raise InvalidArgument("hidden differs across ranks: %s" % hs)
                s["hidden"] = hs[0]
            if s["max_tokens_per_rank"] is None:
                s["max_tokens_per_rank"] = max(1, max(e[0] for e in every))
            if s["max_topk"] is None:
                s["max_topk"] = max(1, max(e[2] for e in every))
            if s["num_experts"] is None:
                es = sorted({e[3] for e in every if e[3] is not None})
                if len(es) != 1:
                    raise InvalidArgument(
                        "num_experts is unknown or differs across ranks (%s): give "
                        "Buffer(num_experts=...), call get_dispatch_layout first or pass "
                        "num_tokens_per_expert" % es)
                s["num_experts"] = es[0]
        return self._open(dtype, kinds)

    def _kind(self, x):
        """What a rank's input is, for choosing the execution: 'numpy', 'cpu' (a CPU tensor)
        or 'cuda:N' (N: the daemon's index of its GPU)."""
        if tensors.is_cuda(x):
            return "cuda:%d" % tensors.daemon_device(self._client, x.device)
        return "cpu" if _is_torch(x) else "numpy"

    def _execution_for(self, kinds):
        """The execution of a group this Buffer makes: as asked; else its first group's; else
        client-executed where the daemon's backend runs the inputs that way (host backend:
        NumPy arrays and CPU tensors; cuda backend: CUDA tensors, every rank's on one GPU),
        judged from every rank's input kind (``kinds``, a process group's first call) or, for
        a Buffer made by name, from the backend alone."""
        if self._execution is not None:
            return self._execution
        if self._groups:
            return next(iter(self._groups.values())).execution
        if kinds is None:
            return "client"
        if self._client.info()["backend"] == "cuda":
            one_gpu = len(set(kinds)) == 1 and kinds[0].startswith("cuda:")
            return "client" if one_gpu else "daemon"
        return "client" if all(k in ("numpy", "cpu") for k in kinds) else "daemon"

    @property
    def execution(self):
        """'client' or 'daemon': how the Buffer's groups run their ops (None before its first
        group exists, unless asked for)."""
        if self._groups:
            return next(iter(self._groups.values())).execution
        return self._execution

    def _slot_record(self, g):
        """The Buffer's record of a client-executed group's handle slots: the next slot a
        dispatch fills, and how often each was filled."""
        rec = self._slots.get(g.id)
        if rec is None:
            rec = self._slots[g.id] = {"next": 0, "filled": [0] * g.num_handle_slots}
        return rec

    def _next_slot(self, g):
        rec = self._slot_record(g)
        return rec["next"], rec

    @staticmethod
    def _filled(rec, slot):
        """Notes that a (not cached) dispatch filled ``slot``; the next one takes the next."""
        rec["filled"][slot] += 1
        rec["next"] = (slot + 1) % len(rec["filled"])

    # ---- lifetime ----

    def synchronize(self):
        """Waits on the host for the buffer's ``async_finish`` combines and
        ``num_worst_tokens`` dispatches, and for its client-executed ops queued on CUDA;
        raises their errors."""
        self._reap(block=True)
        events, self._cx_events = list(self._cx_events.values()), {}
        for g, ev in events:
            ev.synchronize()
            _cx_check(g)

    def _reap(self, block):
        """Waits for the async ops that completed (all of them with ``block``); raises the
        first error after letting go of every finished one."""
        keep, error = [], None
        for fut in self._inflight:
            if block or fut.done():
                try:
                    fut.wait()
                except Exception as e:  # noqa: PERF203
                    error = error or e
            else:
                keep.append(fut)
        self._inflight = keep
        if error is not None:
            raise error

    def _stream_after(self, previous_event, x):
        """The stream an op waits on: None (the current stream), or with a previous_event, a
        side stream that waits for both the current stream and the event."""
        if previous_event is None or not tensors.is_cuda(x):
            return None
        torch = tensors.torch_module()
        device = x.device
        side = self._side.get(device)
        if side is None:
            side = self._side[device] = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        if isinstance(previous_event, EventOverlap):
            previous_event._wait_on(side)
        else:
            side.wait_event(previous_event)
        return side

    def destroy(self):
        """Leaves the groups (and closes the connection the buffer opened)."""
        try:
            self.synchronize()
        except Exception:
            pass
        if self._owns_groups:
            for g in self._groups.values():
                g.leave()
        if self._owns_client:
            self._client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

    # ---- DeepEP's calls ----

    @staticmethod
    def is_sm90_compiled():
        return is_sm90_compiled()

    @classmethod
    def set_num_sms(cls, new_num_sms):
        """Sets :attr:`num_sms` (even, as DeepEP requires), carried by the configs."""
        if int(new_num_sms) % 2 != 0 or int(new_num_sms) <= 0:
            raise InvalidArgument("the SM count must be a positive even number")
        cls.num_sms = int(new_num_sms)

    @staticmethod
    def capture():
        """An :class:`EventOverlap` of the work queued on torch's current stream so far
        (nothing to wait for without torch)."""
        torch = tensors.torch_module()
        if torch is None or not torch.cuda.is_available():
            return EventOverlap()
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return EventOverlap(event=event)

    @staticmethod
    def get_dispatch_config(num_ranks=None):
        """A :class:`Config` with :attr:`num_sms` (epd reads none of it)."""
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks=None):
        """A :class:`Config` with :attr:`num_sms` (epd reads none of it)."""
        return Config(Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                       num_experts, num_topk=8, socket=None):
        """The bytes per rank of the buffers of a low-latency group of this shape, as the
        daemon (at ``socket``, else ``$EPD_SOCKET`` or the default) sizes them."""
        with Client(socket=socket, name="deep_ep-size-hint") as c:
            T = int(num_max_dispatch_tokens_per_rank)
            return c.size_hint(num_ranks, num_experts, hidden, T, num_topk,
                               execution="client", expert_block_rows=num_ranks * T,
                               quantize=hidden % 128 == 0)["client_buffer_bytes_per_rank"]

    @property
    def runtime(self):
        _unsupported("Buffer.runtime (DeepEP's C++ runtime; the epd group is Buffer.group)")

    def get_comm_stream(self):
        """The stream epd's client-executed ops run on: torch's current stream."""
        torch = tensors.torch_module()
        if torch is None or not torch.cuda.is_available():
            _unsupported("get_comm_stream without torch and CUDA")
        return torch.cuda.current_stream()

    def get_local_buffer_tensor(self, dtype, size=None, offset=0, use_rdma_buffer=False):
        _unsupported("get_local_buffer_tensor (epd's buffers are reached through the ops' "
                     "results and get_next_low_latency_combine_buffer)")

    def low_latency_update_mask_buffer(self, rank_to_mask, mask=False):
        _unsupported("low_latency_update_mask_buffer")

    def low_latency_query_mask_buffer(self, mask_status):
        _unsupported("low_latency_query_mask_buffer")

    def low_latency_clean_mask_buffer(self):
        _unsupported("low_latency_clean_mask_buffer")

    # ---- low-latency mode ----

    def _ll_check(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        g = self.group
        if g.execution != "client" or not g.expert_block_rows:
            raise InvalidArgument("low-latency calls need a Buffer made with "
                                  "low_latency_mode=True (a client-executed group with fixed "
                                  "expert blocks)")
        T = int(num_max_dispatch_tokens_per_rank)
        if not 0 < T <= g.max_tokens_per_rank or g.world_size * T > g.expert_block_rows:
            raise InvalidArgument("num_max_dispatch_tokens_per_rank %d: the group holds at "
                                  "most %d" % (T, min(g.max_tokens_per_rank,
                                                      g.expert_block_rows // g.world_size)))
        if hidden is not None and int(hidden) != g.hidden:
            raise InvalidArgument("hidden %d differs from the group's %d" % (hidden, g.hidden))
        if int(num_experts) != g.num_experts:
            raise InvalidArgument("num_experts %d differs from the group's %d" %
                                  (num_experts, g.num_experts))
        return T

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Checks the shape; epd's buffers need no cleaning (every op carries its number)."""
        self._ll_check(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None, use_fp8=True,
                             round_scale=False, use_ue8m0=False, async_finish=False,
                             return_recv_hook=False):
        """DeepEP's low-latency dispatch. Returns ``(recv_x, recv_count, handle, event,
        hook)`` (see the module docstring)."""
        g = self.group
        T = self._ll_check(num_max_dispatch_tokens_per_rank, None, num_experts)
        if use_fp8 and not g.quantize:
            raise InvalidArgument("use_fp8 needs a bf16 group with hidden a multiple of 128")
        if (round_scale or use_ue8m0) and not use_fp8:
            raise InvalidArgument("round_scale and use_ue8m0 need use_fp8=True")
        if use_ue8m0 and not round_scale:
            raise InvalidArgument("use_ue8m0 needs round_scale=True")
        R, L, H = g.world_size, g.num_local_experts, g.hidden
        if use_ue8m0 and H % 512:
            raise InvalidArgument("use_ue8m0 needs hidden a multiple of 512 (scales int32 "
                                  "[.., hidden/512]), not %d" % H)
        C = R * T
        slot, rec = self._next_slot(g)
        res = g.cx_dispatch(x, topk_idx=topk_idx, handle=slot, layout=EXPAND,
                            expert_block_rows=C, quantize=bool(use_fp8),
                            round_scale=bool(round_scale),
                            scale_format="ue8m0" if use_ue8m0 else "fp32")
        self._filled(rec, slot)
        data = res.recv_x.reshape(L, C, H)
        if use_fp8:
            scales = res.recv_x_scales.reshape(L, C, H // 128)
            if use_ue8m0:  # four bytes to a little-endian word
                scales = scales.view(np.int32 if isinstance(scales, np.ndarray)
                                     else tensors.torch_module().int32)
            recv_x = (data, scales)
        else:
            recv_x = data
        recv_count = res.num_recv_tokens_per_expert
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += recv_count
        info, layout_range = _ll_layout(res.recv_src, L, C, R, g.max_tokens_per_rank)
        handle = LowLatencyHandle((info, layout_range, T, H, g.num_experts), slot)
        return recv_x, recv_count, handle, EventOverlap(), _no_hook

    def get_next_low_latency_combine_buffer(self, handle):
        """The y area as ``[num_local_experts, R·T, hidden]`` bf16: the expert output written
        there is combined by ``low_latency_combine(..., zero_copy=True)`` without a copy."""
        if not isinstance(handle, LowLatencyHandle):
            raise InvalidArgument("handle must be a low_latency_dispatch handle")
        g = self.group
        device = handle[0].device if tensors.is_tensor(handle[0]) else None
        y, _ = g.cx_y(handle.slot, device)
        return y.reshape(g.num_local_experts, g.world_size * handle[2], g.hidden)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False,
                            zero_copy=False, async_finish=False, return_recv_hook=False,
                            out=None):
        """DeepEP's low-latency combine: every row of ``x`` ``[L, R·T, hidden]`` times its
        selection's weight in ``topk_weights``, reduced on its source. Returns
        ``(combined_x, event, hook)``."""
        if use_logfmt:
            _unsupported("use_logfmt")
        if not isinstance(handle, LowLatencyHandle):
            raise InvalidArgument("handle must be a low_latency_dispatch handle")
        g = self.group
        y = None
        if not zero_copy:
            y = x.reshape(-1, g.hidden)
        elif out is None and tensors.is_tensor(x):
            out = tensors.torch_module().empty((len(topk_weights), g.hidden), dtype=x.dtype,
                                               device=x.device)
        combined, _ = g.cx_combine(y, handle=handle.slot, apply_weights=True,
                                   source_weights=topk_weights, out=out)
        return combined, EventOverlap(), _no_hook

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None,
                            async_finish=False, allocate_on_comm_stream=False):
        """Counts where tokens go, computed locally from ``topk_idx`` ``[N, K]`` (-1: none).

        Returns ``(num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32,
        is_token_in_rank [N, R] bool, event)``, as DeepEP (no RDMA ranks). For a torch
        ``topk_idx`` they are tensors on its device, computed there. Before the Buffer's first
        group exists, ``num_experts`` becomes the Buffer's.
        """
        E = int(num_experts)
        if self.num_experts is None:
            if E <= 0 or E % self.group_size:
                raise InvalidArgument("num_experts %d is not a positive multiple of the %d "
                                      "ranks" % (E, self.group_size))
            self._shape["num_experts"] = E
        elif E != self.num_experts:
            raise InvalidArgument("num_experts %d differs from the group's %d" %
                                  (E, self.num_experts))
        ntr, nte, in_rank = _layout(topk_idx, self.group_size, E)
        return ntr, None, nte, in_rank, EventOverlap()

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None,
                 previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        """DeepEP's normal dispatch. ``x`` is an array, or ``(x, x_scales)`` for fp8.

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event)``; ``recv_x`` is ``(recv_x, recv_x_scales)`` for fp8, ``handle`` a
        :class:`DispatchHandle`. Without ``topk_idx`` the tokens go where
        ``is_token_in_rank`` says and ``recv_topk_idx`` / ``recv_topk_weights`` are None. A
        cached dispatch (``handle`` given) returns ``(recv_x, None, None, None, None, event)``
        (``recv_topk_weights`` in place of the first None after ``recv_x`` when new
        ``topk_weights`` are given). ``num_worst_tokens`` > 0 pads every output to that many
        rows and returns an empty list. See the module docstring.
        """
        x_scales = None
        if isinstance(x, tuple):
            x, x_scales = x
        dtype = "fp8" if x_scales is not None else "bf16"
        cuda = tensors.is_cuda(x)
        W = int(num_worst_tokens)
        stream = self._stream_after(previous_event, x)
        if handle is not None:
            if topk_idx is not None:
                raise InvalidArgument("a cached dispatch (handle given) takes no topk_idx")
            if getattr(handle, "slot", None) is not None:
                self._check_bound(handle._group, W)
                recv_x, _, recv_w, _, _, event = self._cx_dispatch_op(
                    handle._group, x, x_scales, None, topk_weights, handle, None, W, stream,
                    async_finish)
                return recv_x, None, recv_w if topk_weights is not None else None, None, \
                    None, event
            ehandle, _ = _epd_handle(handle)
            g = ehandle.group
            recv_x, _, recv_w, _, res = self._dispatch_op(
                g, x, x_scales, None, topk_weights, ehandle, None, W, cuda, stream,
                async_finish)
            if topk_weights is None:
                recv_w = None
            return recv_x, None, recv_w, None, None, self._event(res, async_finish)
        by_rank = topk_idx is None
        if by_rank:
            if is_token_in_rank is None:
                raise InvalidArgument("dispatch needs topk_idx or is_token_in_rank (or a "
                                      "handle)")
            if topk_weights is not None:
                raise InvalidArgument("topk_weights needs topk_idx")
        shape = tuple(x.shape) if _is_torch(x) else np.shape(x)
        if len(shape) != 2:
            raise InvalidArgument("x must be [num_tokens, hidden], not %s" % (shape,))
        E = self.num_experts
        if E is None and num_tokens_per_expert is not None:
            E = len(num_tokens_per_expert)
        if by_rank:
            K = self.group_size
        else:
            kshape = tuple(topk_idx.shape) if _is_torch(topk_idx) else np.shape(topk_idx)
            if len(kshape) != 2:
                raise InvalidArgument("topk_idx must be [num_tokens, num_topk], not %s" %
                                      (kshape,))
            K = kshape[1]
        g = self._group_for(dtype, shape[0], shape[1], K, E, x)
        if by_rank:
            topk_idx = _rank_topk(is_token_in_rank, shape[0], g.world_size,
                                  g.num_local_experts, g.max_topk)
        if g.execution == "client":
            self._check_bound(g, W)
            recv_x, recv_idx, recv_w, counts, handle, event = self._cx_dispatch_op(
                g, x, x_scales, topk_idx, topk_weights, None, expert_alignment, W, stream,
                async_finish)
            handle._in_rank = is_token_in_rank
            handle._topk_idx = topk_idx
            if by_rank:
                recv_idx = recv_w = None
                if not W:
                    counts = self._expert_counts_by_rank(g, num_tokens_per_expert,
                                                         expert_alignment)
            return recv_x, recv_idx, recv_w, counts, handle, event
        recv_x, recv_idx, recv_w, counts, res = self._dispatch_op(
            g, x, x_scales, topk_idx, topk_weights, None, expert_alignment, W, cuda, stream,
            async_finish)
        if isinstance(res, DispatchHandle):
            handle = res
            handle._in_rank = is_token_in_rank
            handle._topk_idx = topk_idx
        else:
            handle = DispatchHandle(g, result=res, is_token_in_rank=is_token_in_rank,
                                    topk_idx=topk_idx, padded_rows=W)
        if by_rank:
            recv_idx = recv_w = None
            if not W:
                counts = self._expert_counts_by_rank(g, num_tokens_per_expert, expert_alignment)
        return recv_x, recv_idx, recv_w, counts, handle, self._event(res, async_finish)

    def _dispatch_op(self, g, x, x_scales, topk_idx, topk_weights, ehandle, alignment, W, cuda,
                     stream, async_finish):
        """Runs one dispatch. Returns (recv_x, recv_topk_idx, recv_topk_weights, counts,
        result), ``result`` a DispatchResult, or for a CUDA ``num_worst_tokens`` dispatch a
        DispatchHandle whose op is still in flight."""
        self._check_bound(g, W)
        if W and cuda:
            torch = tensors.torch_module()
            if topk_idx is not None:
                # recv_topk_idx has topk_idx's dtype: int32 stays int32, others become int64.
                if not _is_torch(topk_idx):
                    topk_idx = tensors.from_numpy(np.asarray(topk_idx))
                K = topk_idx.shape[1]
                kdt = topk_idx.dtype if topk_idx.dtype == torch.int32 else torch.int64
            else:
                K, kdt = ehandle.num_topk, tensors.torch_dtype(ehandle.topk_dtype)
            # Rows past the count are never written: their top-k ids stay -1, weights 0.
            out = {"recv_topk_idx": torch.full((W, K), -1, dtype=kdt, device=x.device)}
            if topk_weights is not None:
                out["recv_topk_weights"] = torch.zeros((W, K), dtype=torch.float32,
                                                       device=x.device)
            fut = g.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, x_scales=x_scales,
                             handle=ehandle, expert_alignment=alignment, layout=NON_EXPAND,
                             use_arena=False, recv_capacity=W, out=out, async_op=True,
                             stream=stream)
            o = fut.outputs
            pending = DispatchHandle(g, future=fut, padded_rows=W)
            self._inflight.append(pending)
            self._reap(block=False)
            if not async_finish:
                fut.current_stream_wait()
            recv_x = o["recv_x"] if x_scales is None else (o["recv_x"], o["recv_x_scales"])
            return recv_x, o["recv_topk_idx"], o.get("recv_topk_weights"), [], pending
        # With num_worst_tokens the outputs have W rows: more rows fail the op on every rank
        # (CAPACITY_EXCEEDED).
        res = g.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, x_scales=x_scales, handle=ehandle,
            expert_alignment=alignment, layout=NON_EXPAND, copy_outputs=self.copy_outputs,
            use_arena=False if W else None,
            recv_capacity=W if W else self.recv_capacity if cuda else None, stream=stream)
        self._reap(block=True)  # ops run in order: older async ops are complete
        recv_x, scales = res.recv_x, res.recv_x_scales
        idx, w, counts = res.recv_topk_idx, res.recv_topk_weights, \
            res.num_recv_tokens_per_expert_list
        if W:
            recv_x, scales, idx = _pad_rows(recv_x, W, 0), _pad_rows(scales, W, 0), \
                _pad_rows(idx, W, -1)
            w, counts = _pad_rows(w, W, 0), []
        return (recv_x if scales is None else (recv_x, scales)), idx, w, counts, res

    @staticmethod
    def _check_bound(g, W):
        if W:
            most = g.worst_case_rows()
            if not 0 < W <= most:
                raise InvalidArgument("num_worst_tokens %d: the group delivers at most %d rows "
                                      "per rank (world_size * max_tokens_per_rank)" % (W, most))

    def _cx_dispatch_op(self, g, x, x_scales, topk_idx, topk_weights, cached, alignment, W,
                        stream, async_finish):
        """One NON_EXPAND dispatch of a client-executed group (``cached``: the DispatchHandle
        of a cached dispatch). Returns (recv_x, recv_topk_idx, recv_topk_weights, counts,
        handle, event)."""
        if cached is not None:
            cached.check_live()
            slot, rec, alignment = cached.slot, cached._slots, cached.alignment
        else:
            slot, rec = self._next_slot(g)
            alignment = max(1, int(alignment or 1))
        _keep_for(stream, x, x_scales, topk_idx, topk_weights)
        cpu_dtype = None
        if _is_torch(x) and not tensors.is_cuda(x):
            # CPU tensors on the host backend: NumPy views in, tensors out.
            cpu_dtype = x.dtype
            x, x_scales, topk_idx, topk_weights = (
                None if v is None else np.asarray(tensors.to_numpy(v))
                for v in (x, x_scales, topk_idx, topk_weights))
        try:
            res = g.cx_dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                                x_scales=x_scales, handle=slot, cached=cached is not None,
                                layout=NON_EXPAND, expert_alignment=alignment, capacity_rows=W,
                                stream=stream)
        except NotFound:
            # CUDA, a slot's first dispatch: its counts were not written, as the op failed.
            if tensors.is_cuda(x):
                _cx_check(g)
            raise
        if cached is None:
            self._filled(rec, slot)
        K = res.recv_topk_idx.shape[1]
        if tensors.is_cuda(x):
            return self._cx_cuda_outputs(g, x, res, slot, rec, alignment, K, W, stream,
                                         async_finish, cached)
        n = res.num_recv_tokens
        outs = [res.recv_x, res.recv_x_scales, res.recv_topk_idx, res.recv_weights]
        if W:
            outs = [_pad_rows(v, W, f) for v, f in zip(outs, (0, 0, -1, 0))]
            counts = []
        else:
            if self.copy_outputs:
                outs = [None if v is None else v.copy() for v in outs]
            counts = [int(v) for v in res.num_recv_tokens_per_expert_aligned]
        src = res.recv_src[:n].copy()
        if cpu_dtype is not None:
            dts = (cpu_dtype, None, None, None)
            outs = [None if v is None else tensors.from_numpy(v, d) for v, d in zip(outs, dts)]
            src = tensors.from_numpy(src)
        if cached is None:
            cached = _CxDispatchHandle(g, slot, rec, alignment, K, W,
                                       np.asarray(res.rank_prefix, np.int32), src,
                                       matrix=np.asarray(res.rank_prefix_matrix, np.int32).copy())
        recv_x, scales, idx, w = outs
        return (recv_x if scales is None else (recv_x, scales)), idx, w, counts, cached, \
            EventOverlap()

    def _cx_cuda_outputs(self, g, x, res, slot, rec, alignment, K, W, stream, async_finish,
                         cached):
        """The outputs of a client-executed dispatch queued on CUDA (see _cx_dispatch_op):
        copies (or with ``copy_outputs=False`` views) of the received rows after a host wait
        for the counts; with ``num_worst_tokens`` W rows copied on the stream, no host wait."""
        torch = tensors.torch_module()
        current = torch.cuda.current_stream(x.device)
        s = stream if stream is not None else current
        R = g.world_size
        outs = [res.recv_x, res.recv_x_scales, res.recv_topk_idx, res.recv_weights]
        with torch.cuda.stream(s):
            if W:
                # The rows past the count are padding: top-k ids -1, weights 0.
                prefix = res.rank_prefix.clone()
                matrix = res.rank_prefix_matrix.clone()
                pad = (torch.arange(W, device=x.device) >= prefix[R]).unsqueeze(1)
                recv_x, scales, idx, w = [None if v is None else v[:W] for v in outs]
                outs = [recv_x.clone(), None if scales is None else scales.clone(),
                        idx.masked_fill(pad, -1), None if w is None else w.masked_fill(pad, 0)]
                src = res.recv_src[:W].clone()
                done = torch.cuda.Event()
                done.record(s)
                counts = []
            else:
                s.synchronize()  # the counts size the outputs, as in DeepEP's normal mode
                _cx_check(g)
                prefix = res.rank_prefix.cpu().numpy().astype(np.int32)
                matrix = res.rank_prefix_matrix.cpu().numpy().astype(np.int32)
                counts = [int(v) for v in res.num_recv_tokens_per_expert_aligned.cpu()]
                n = int(prefix[R])
                outs = [None if v is None else v[:n].clone() if self.copy_outputs else v[:n]
                        for v in outs]
                src = res.recv_src[:n].clone()
                done = None
        self._note_cx_op(g, s)
        _keep_for(None if s is current else current, *outs)
        if cached is None:
            cached = _CxDispatchHandle(g, slot, rec, alignment, K, W, prefix, src, done,
                                       matrix=matrix)
        recv_x, scales, idx, w = outs
        return (recv_x if scales is None else (recv_x, scales)), idx, w, counts, cached, \
            self._cx_event(s, current, async_finish)

    def _note_cx_op(self, g, s):
        """Records the end of a client-executed op queued on ``s`` for :meth:`synchronize`."""
        ev = tensors.torch_module().cuda.Event()
        ev.record(s)
        self._cx_events[g.id] = (g, ev)

    @staticmethod
    def _cx_event(s, current, async_finish):
        """The EventOverlap of a client-executed op queued on ``s``: nothing to wait for on the
        current stream; on a side stream (``previous_event``) the current stream waits for it
        now, or with ``async_finish`` at ``event.current_stream_wait()``."""
        if s is current:
            return EventOverlap()
        if async_finish:
            ev = tensors.torch_module().cuda.Event()
            ev.record(s)
            return EventOverlap(event=ev)
        current.wait_stream(s)
        return EventOverlap()

    def _event(self, res, async_finish):
        if async_finish and isinstance(res, DispatchHandle):
            return EventOverlap(res._future)
        return EventOverlap()

    def _expert_counts_by_rank(self, g, num_tokens_per_expert, alignment):
        """DeepEP's num_recv_tokens_per_expert_list of a dispatch routed by is_token_in_rank:
        every rank's ``num_tokens_per_expert`` summed over the sources for this rank's experts,
        aligned. Needs the process group (an all-gather); None without it or the counts."""
        if self._comm is None or num_tokens_per_expert is None:
            return None
        nte = num_tokens_per_expert
        nte = nte.tolist() if _is_torch(nte) else np.asarray(nte).tolist()
        if len(nte) != g.num_experts:
            raise InvalidArgument("num_tokens_per_expert has %d entries; the group has %d "
                                  "experts" % (len(nte), g.num_experts))
        every = self._comm.all_gather([int(v) for v in nte])
        L, a = g.num_local_experts, max(1, int(alignment))
        mine = [sum(e[g.rank * L + i] for e in every) for i in range(L)]
        return [(c + a - 1) // a * a for c in mine]

    def combine(self, x, handle, topk_weights=None, bias=None, config=None,
                previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        """DeepEP's normal combine: ``x`` ``[num_recv_tokens, hidden]`` in dispatch order
        (``[num_worst_tokens, hidden]`` after such a dispatch: the padding rows are not read).

        ``bias`` is None, one array or a tuple of two ``[N, hidden]``. ``topk_weights``
        ``[num_recv_tokens, K]`` float32 are this rank's weights per received row (every rank
        passes them, or none does). Returns ``(combined_x, combined_topk_weights, event)``;
        ``combined_topk_weights`` is None unless ``topk_weights`` is given, and then their sum
        over the ranks each token went to (see the module docstring).
        """
        if getattr(handle, "slot", None) is not None:
            return self._cx_combine(x, handle, topk_weights, bias, previous_event, async_finish)
        ehandle, dh = _epd_handle(handle)
        if dh is not None and dh.padded_rows:
            n = ehandle.num_rows
            x = x[:n]
            topk_weights = topk_weights[:n] if topk_weights is not None else None
        g = ehandle.group
        if isinstance(bias, list):
            bias = tuple(bias)
        stream = self._stream_after(previous_event, x)
        if async_finish and tensors.is_cuda(x):
            fut = g.combine(x, ehandle, bias=bias, async_op=True, stream=stream,
                            recv_weights=topk_weights)
            self._inflight.append(fut)
            self._reap(block=False)
            weights = fut.outputs["combined_topk_weights"] if topk_weights is not None else None
            return fut.outputs["combined_x"], weights, EventOverlap(fut)
        combined, weights = g.combine(x, ehandle, bias=bias, stream=stream,
                                      recv_weights=topk_weights)
        self._reap(block=True)
        if topk_weights is None:
            weights = None
        return combined, weights, EventOverlap()

    def _cx_combine(self, x, handle, topk_weights, bias, previous_event, async_finish):
        """combine of a client-executed dispatch: the rows of ``x`` (and ``topk_weights``) go
        to the y area of the handle's slot, then the combine runs (host backend: now; CUDA:
        queued on the current stream, or after ``previous_event`` on a side stream)."""
        handle.check_live()
        g = handle._group
        if isinstance(bias, list):
            bias = tuple(bias)
        cpu = _is_torch(x) and not tensors.is_cuda(x)
        if cpu:
            torch = tensors.torch_module()
            x, topk_weights = (None if v is None else np.asarray(tensors.to_numpy(v))
                               for v in (x, topk_weights))
            if bias is not None:
                bias = tuple(None if b is None else np.asarray(tensors.to_numpy(b)) for b in
                             (bias if isinstance(bias, tuple) else (bias,)))
        stream = self._stream_after(previous_event, x)
        _keep_for(stream, x, topk_weights, *(bias if isinstance(bias, tuple) else (bias,)))
        combined, weights = g.cx_combine(x, handle=handle.slot, recv_weights=topk_weights,
                                         bias=bias, stream=stream)
        if topk_weights is None:
            weights = None
        if cpu:
            combined = tensors.from_numpy(combined, torch.bfloat16)
            weights = None if weights is None else tensors.from_numpy(weights)
        if not tensors.is_cuda(x):
            return combined, weights, EventOverlap()
        torch = tensors.torch_module()
        current = torch.cuda.current_stream(x.device)
        s = stream if stream is not None else current
        self._note_cx_op(g, s)
        _keep_for(None if s is current else current, combined, weights)
        return combined, weights, self._cx_event(s, current, async_finish)


def _no_hook():
    """The receive hook of an op that completed at its call."""


__all__ = ["Buffer", "Config", "DispatchHandle", "EventOverlap", "LowLatencyHandle",
           "is_sm90_compiled", "topk_idx_t"]
