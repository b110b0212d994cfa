"""DeepEP's normal-mode ``Buffer`` over an epd group.

Code written for ``deep_ep.Buffer`` keeps its calls and their results::

    from epd.compat.deep_ep import Buffer

    buf = Buffer("layer0", rank=rank, secret=secret, socket=sock, world_size=R,
                 num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K)
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = \\
        buf.get_dispatch_layout(topk_idx, E)
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, _ = \\
        buf.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                     num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
                     num_tokens_per_expert=num_tokens_per_expert)
    combined_x, combined_topk_weights, _ = buf.combine(expert_out, handle, topk_weights=...)

Results follow DeepEP's normal (NON_EXPAND) dispatch: one row per (source rank, token) that
selected an expert of this rank, ordered by source rank then token (DeepEP's reference order);
``recv_topk_idx`` holds local expert ids and -1 for experts elsewhere; combine sums the rows
sent back (plus the biases) in fp32 and rounds once to bf16 (docs/semantics.md section 3).

What differs from DeepEP:

* The constructor takes the epd group's name, this process's rank, the group secret and the
  daemon's socket (or an existing :class:`epd.Group`) instead of a torch process group and
  buffer sizes; the group's shape (world size, experts, hidden, token and top-k bounds, dtype)
  is given to the rank that creates it (rank 0 unless ``create`` says otherwise).
* Events: ``previous_event`` (a DeepEP-style :class:`EventOverlap` or a ``torch.cuda.Event``)
  is waited for on the GPU before the op reads its inputs; with CUDA tensors every op also
  waits for the work queued on the current stream, without a host synchronisation. The
  returned event is None unless ``async_finish=True``; then it is an :class:`EventOverlap`
  whose ``current_stream_wait()`` makes the current stream wait for the op. dispatch always
  waits for its op on the host (its output sizes come from the counts, as in DeepEP's
  CPU-synchronised normal mode), so its event has nothing left to wait for; combine with
  ``async_finish=True`` returns at once with its output tensors, which the current stream may
  use after ``event.current_stream_wait()``. Its errors are raised by the buffer's next call
  (or :meth:`Buffer.synchronize`). ``allocate_on_comm_stream`` and ``config`` are ignored
  (epd sizes its own buffers).
* ``num_tokens_per_rank``, ``num_tokens_per_rdma_rank``, ``is_token_in_rank`` and
  ``num_tokens_per_expert`` are accepted and ignored by ``dispatch``: epd derives the routing
  from ``topk_idx`` itself.
* The handle is an :class:`epd.Handle`, released when it is garbage collected (as DeepEP's
  tensors are freed); ``handle.rank_prefix`` holds the rows per source rank (DeepEP's
  ``rank_prefix_matrix`` column of this rank, as a prefix sum). A cached dispatch returns the
  same handle (DeepEP returns None), and the received weights when new ``topk_weights`` are
  given.
* ``combine(topk_weights=W)`` passes ``W`` (``[num_recv_tokens, K]`` float32, this rank's
  weights per received row: its ``recv_topk_weights``, possibly changed) as the combine's
  ``recv_weights``, and ``combined_topk_weights`` is their sum over the ranks each token went
  to, in ascending rank, as DeepEP's combine sums them (in fp32, docs/semantics.md section 3);
  this holds after a dispatch without weights and after a cached dispatch as well.
* Tensors: torch CUDA tensors (the cuda backend; see :mod:`epd.tensors`) stay on the GPU:
  outputs are device tensors, allocated per dispatch with room for the group's worst case
  unless the buffer's ``recv_capacity`` bounds the rows. CPU torch tensors and NumPy arrays
  (bf16 as uint16 bits, floats rounded to bf16 on the way in; fp8 as uint8 e4m3 bytes with
  float32 scales, passed as ``(x, x_scales)`` as in DeepEP) go through host shared memory;
  their outputs are copies by default (``copy_outputs=True``); ``copy_outputs=False``
  returns views of the output arena, valid until the handle is released.
* Not supported: internode (RDMA) buffers, ``num_worst_tokens`` > 0, and the EXPAND layout
  (use :meth:`epd.Group.dispatch` with ``layout='expand'``).

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

import numpy as np

from .. import _lib, tensors
from ..client import Client
from ..errors import InvalidArgument
from ..group import EXPAND, NON_EXPAND, Group


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


class EventOverlap:
    """DeepEP's ``EventOverlap``: what an ``async_finish`` op returns.

    :meth:`current_stream_wait` makes torch's current stream wait for the op (or the CUDA
    event) on the GPU; for an op that already completed on the host it does nothing. As a
    context manager it waits on exit, like DeepEP's.
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


class Buffer:
    """DeepEP's ``deep_ep.Buffer`` (normal mode) over an epd group. See the module docstring.

    ``group`` is the epd group's name, or an :class:`epd.Group` to wrap (then the other
    arguments are unused). With a name: ``rank`` is this process's rank, ``secret`` the
    group's secret (bytes or str, at least 16 bytes), ``socket`` the daemon's socket (None:
    ``$EPD_SOCKET`` or ``/run/epd/epd.sock``) or ``client`` an open :class:`epd.Client`,
    ``device`` this rank's daemon device index or a torch device (``"cuda:0"``, matched to the
    daemon's GPU by UUID). The creating rank (``create``; default: rank 0) also gives the
    group's shape: ``world_size``, ``num_experts``, ``hidden``, ``max_tokens_per_rank``,
    ``max_topk``, ``dtype`` ('bf16' or 'fp8'), ``arena_bytes``, ``op_timeout_ms``. The others
    join, retrying for ``join_timeout`` seconds while the group does not exist yet.

    ``copy_outputs`` (default True) makes host-memory outputs copies instead of arena views;
    ``recv_capacity`` bounds the rows of the device tensors a CUDA dispatch allocates for its
    outputs (None: the group's worst case).

    ``low_latency_mode=True`` makes the creating rank create a client-executed group for
    :meth:`low_latency_dispatch` and :meth:`low_latency_combine` (see the module docstring):
    fixed expert blocks of ``world_size * max_tokens_per_rank`` rows and, for a bf16 group
    whose hidden is a multiple of 128, the quantizing dispatch. ``num_nvl_bytes``,
    ``num_rdma_bytes``, ``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode``,
    ``allow_mnnvl`` and ``explicitly_destroy`` are DeepEP's and unused: epd sizes its
    buffers from the group's shape.
    """

    #: DeepEP's SM count for normal-mode kernels (:meth:`set_num_sms`); epd's SM budget is the
    #: group's ``sms_per_rank``.
    num_sms = 20

    def __init__(self, group, rank=None, secret=None, socket=None, *, client=None,
                 world_size=None, num_experts=None, hidden=None, max_tokens_per_rank=None,
                 max_topk=None, dtype="bf16", arena_bytes=None, op_timeout_ms=0, create=None,
                 join_timeout=30.0, copy_outputs=True, recv_capacity=None, device=0,
                 low_latency_mode=False, num_nvl_bytes=0, num_rdma_bytes=0,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True,
                 allow_mnnvl=False, explicitly_destroy=False):
        self._owns_client = False
        self.low_latency_mode = bool(low_latency_mode)
        self._ll_next = 0  # the handle slot of the next low-latency dispatch
        self._owns_group = False
        self.copy_outputs = copy_outputs
        self.recv_capacity = recv_capacity
        self._inflight = []  # futures of async_finish combines not yet waited on the host
        self._side = {}      # device -> stream for ops after a previous_event
        if isinstance(group, Group):
            self.group = group
        else:
            if rank is None or secret is None:
                raise InvalidArgument("Buffer(name, ...) needs rank and secret")
            if client is None:
                client = Client(socket=socket, name="deep_ep-compat")
                self._owns_client = True
            try:
                if create if create is not None else rank == 0:
                    missing = [n for n, v in (("world_size", world_size),
                                              ("num_experts", num_experts), ("hidden", hidden),
                                              ("max_tokens_per_rank", max_tokens_per_rank),
                                              ("max_topk", max_topk)) if v is None]
                    if missing:
                        raise InvalidArgument("the creating rank must give " +
                                              ", ".join(missing))
                    ll = {}
                    if low_latency_mode:
                        ll = {"execution": "client",
                              "expert_block_rows": world_size * max_tokens_per_rank,
                              "quantize": dtype == "bf16" and hidden % 128 == 0}
                    self.group = Group.create(
                        client, group, secret, rank, world_size=world_size,
                        num_experts=num_experts, hidden=hidden,
                        max_tokens_per_rank=max_tokens_per_rank, max_topk=max_topk,
                        dtype=dtype, arena_bytes=arena_bytes, op_timeout_ms=op_timeout_ms,
                        device=device, **ll)
                else:
                    self.group = Group.join(client, group, secret, rank, device=device,
                                            retry_timeout=join_timeout)
            except BaseException:
                if self._owns_client:
                    client.close()
                raise
            self._owns_group = True
        self.rank = self.group.rank
        self.group_size = self.group.world_size
        self.num_experts = self.group.num_experts
        self.hidden = self.group.hidden

    # ---- lifetime ----

    def synchronize(self):
        """Waits on the host for the buffer's ``async_finish`` combines; raises their errors."""
        self._reap(block=True)

    def _reap(self, block):
        """Waits for async combines that completed (all of them with ``block``); raises the
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
        """Leaves the group (and closes the connection the buffer opened)."""
        try:
            self._reap(block=True)
        except Exception:
            pass
        if self._owns_group:
            self.group.leave()
        if self._owns_client:
            self.group.client.close()

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
        slot = self._ll_next
        self._ll_next = (slot + 1) % g.num_handle_slots
        res = g.cx_dispatch(x, topk_idx=topk_idx, handle=slot, layout=EXPAND,
                            expert_block_rows=C, quantize=bool(use_fp8),
                            round_scale=bool(round_scale),
                            scale_format="ue8m0" if use_ue8m0 else "fp32")
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
        ``topk_idx`` they are tensors on its device, computed there.
        """
        R, E = self.group_size, int(num_experts)
        if E != self.num_experts:
            raise InvalidArgument("num_experts %d differs from the group's %d" %
                                  (E, self.num_experts))
        L = E // R
        event = EventOverlap() if async_finish else None
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
            num_tokens_per_rank = is_token_in_rank.sum(dim=0).int()
            return num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, event
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
        num_tokens_per_rank = is_token_in_rank.sum(axis=0).astype(np.int32)
        return num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, event

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None,
                 previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        """DeepEP's normal dispatch. ``x`` is an array, or ``(x, x_scales)`` for fp8.

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event)``; ``recv_x`` is ``(recv_x, recv_x_scales)`` for fp8. A cached dispatch
        (``handle`` given) returns ``(recv_x, None, recv_topk_weights or None, None, handle,
        event)``. ``event`` is None unless ``async_finish``.
        """
        if num_worst_tokens:
            raise NotImplementedError("num_worst_tokens is not supported by epd's DeepEP front")
        x_scales = None
        if isinstance(x, tuple):
            x, x_scales = x
        cuda = tensors.is_cuda(x)
        res = self.group.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, x_scales=x_scales, handle=handle,
            expert_alignment=expert_alignment if handle is None else None, layout=NON_EXPAND,
            copy_outputs=self.copy_outputs,
            recv_capacity=self.recv_capacity if cuda else None,
            stream=self._stream_after(previous_event, x))
        self._reap(block=True)  # ops run in order: older async combines are complete
        if handle is None:
            res.handle.auto_release()
        recv_x = res.recv_x if res.recv_x_scales is None else (res.recv_x, res.recv_x_scales)
        event = EventOverlap() if async_finish else None
        if handle is not None:
            return recv_x, None, res.recv_topk_weights, None, res.handle, event
        return (recv_x, res.recv_topk_idx, res.recv_topk_weights,
                res.num_recv_tokens_per_expert_list, res.handle, event)

    def combine(self, x, handle, topk_weights=None, bias=None, config=None,
                previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        """DeepEP's normal combine: ``x`` ``[num_recv_tokens, hidden]`` in dispatch order.

        ``bias`` is None, one array or a tuple of two ``[N, hidden]``. ``topk_weights``
        ``[num_recv_tokens, K]`` float32 are this rank's weights per received row (every rank
        passes them, or none does). Returns ``(combined_x, combined_topk_weights, event)``;
        ``combined_topk_weights`` is None unless ``topk_weights`` is given, and then their sum
        over the ranks each token went to (see the module docstring).
        """
        if isinstance(bias, list):
            bias = tuple(bias)
        stream = self._stream_after(previous_event, x)
        if async_finish and tensors.is_cuda(x):
            fut = self.group.combine(x, handle, bias=bias, async_op=True, stream=stream,
                                     recv_weights=topk_weights)
            self._inflight.append(fut)
            self._reap(block=False)
            weights = fut.outputs["combined_topk_weights"] if topk_weights is not None else None
            return fut.outputs["combined_x"], weights, EventOverlap(fut)
        combined, weights = self.group.combine(x, handle, bias=bias, stream=stream,
                                               recv_weights=topk_weights)
        self._reap(block=True)
        if topk_weights is None:
            weights = None
        return combined, weights, EventOverlap() if async_finish else None


def _no_hook():
    """The receive hook of an op that completed at its call."""


__all__ = ["Buffer", "Config", "EventOverlap", "LowLatencyHandle", "is_sm90_compiled"]
