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
sent back (plus the biases) in fp32 and rounds once to bf16 (SEMANTICS.md section 3).

What differs from DeepEP:

* The constructor takes the epd group's name, this process's rank, the group secret and the
  daemon's socket (or an existing :class:`epd.Group`) instead of a torch process group and
  buffer sizes; the group's shape (world size, experts, hidden, token and top-k bounds, dtype)
  is given to the rank that creates it (rank 0 unless ``create`` says otherwise).
* Events are ``None``: the host backend completes every op before returning, so
  ``previous_event``, ``async_finish`` and ``allocate_on_comm_stream`` are accepted and
  ignored. ``config`` is ignored (epd sizes its own buffers).
* ``num_tokens_per_rank``, ``num_tokens_per_rdma_rank``, ``is_token_in_rank`` and
  ``num_tokens_per_expert`` are accepted and ignored by ``dispatch``: epd derives the routing
  from ``topk_idx`` itself.
* The handle is an :class:`epd.Handle`, released when it is garbage collected (as DeepEP's
  tensors are freed). A cached dispatch returns the same handle (DeepEP returns None), and the
  received weights when new ``topk_weights`` are given.
* ``combine`` takes ``topk_weights`` only to decide whether to return
  ``combined_topk_weights``: epd sends back the weights the dispatch carried (masked to 0 where
  ``topk_idx`` is -1), which is what DeepEP's sum of the received weights gives.
* Arrays are NumPy: bf16 as uint16 bits (floats are rounded to bf16 on the way in), fp8 as
  uint8 e4m3 bytes with float32 scales, passed as ``(x, x_scales)`` as in DeepEP. When torch is
  importable, CPU torch tensors are accepted too and the results come back as torch tensors
  (bf16 as ``torch.bfloat16``); CUDA tensors are not supported on this path yet.
* Outputs are copies by default (``copy_outputs=True``); ``copy_outputs=False`` returns views
  of the output arena, valid until the handle is released.
* Not supported: low-latency mode (``low_latency_dispatch`` / ``low_latency_combine``),
  internode (RDMA) buffers, ``num_worst_tokens`` > 0, and the EXPAND layout (use
  :meth:`epd.Group.dispatch` with ``layout='expand'``).
"""

import numpy as np

from ..client import Client
from ..errors import InvalidArgument
from ..group import NON_EXPAND, Group

try:  # torch is optional: only used when the caller passes torch tensors
    import torch as _torch
except Exception:  # pragma: no cover - depends on the machine
    _torch = None


def _is_torch(value):
    return _torch is not None and isinstance(value, _torch.Tensor)


def _to_numpy(value):
    """A NumPy array for a torch tensor (bf16 as uint16 bits), or ``value`` unchanged."""
    if not _is_torch(value):
        return value
    if value.device.type != "cpu":
        raise NotImplementedError("epd.compat.deep_ep takes CPU tensors on the host backend, "
                                  "not %s tensors" % value.device.type)
    t = value.detach().contiguous()
    if t.dtype == _torch.bfloat16:
        return t.view(_torch.int16).numpy().view(np.uint16)
    fp8 = getattr(_torch, "float8_e4m3fn", None)
    if fp8 is not None and t.dtype == fp8:
        return t.view(_torch.uint8).numpy()
    return t.numpy()


def _to_torch(value, bf16=False):
    """A torch tensor for a NumPy result (uint16 bits as bfloat16 when ``bf16``)."""
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(_to_torch(v) for v in value)
    value = np.ascontiguousarray(value)
    if value.dtype == np.uint16:  # torch has no uint16: carry the bits as int16
        t = _torch.from_numpy(value.view(np.int16))
        return t.view(_torch.bfloat16) if bf16 else t
    return _torch.from_numpy(value)


class Buffer:
    """DeepEP's ``deep_ep.Buffer`` (normal mode) over an epd group. See the module docstring.

    ``group`` is the epd group's name, or an :class:`epd.Group` to wrap (then the other
    arguments are unused). With a name: ``rank`` is this process's rank, ``secret`` the
    group's secret (bytes or str, at least 16 bytes), ``socket`` the daemon's socket (None:
    ``$EPD_SOCKET`` or ``/run/epd/epd.sock``) or ``client`` an open :class:`epd.Client`. The
    creating rank (``create``; default: rank 0) also gives the group's shape: ``world_size``,
    ``num_experts``, ``hidden``, ``max_tokens_per_rank``, ``max_topk``, ``dtype`` ('bf16' or
    'fp8'), ``arena_bytes``, ``op_timeout_ms``. The others join, retrying for ``join_timeout``
    seconds while the group does not exist yet.
    """

    def __init__(self, group, rank=None, secret=None, socket=None, *, client=None,
                 world_size=None, num_experts=None, hidden=None, max_tokens_per_rank=None,
                 max_topk=None, dtype="bf16", arena_bytes=None, op_timeout_ms=0, create=None,
                 join_timeout=30.0, copy_outputs=True):
        self._owns_client = False
        self._owns_group = False
        self.copy_outputs = copy_outputs
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
                    self.group = Group.create(
                        client, group, secret, rank, world_size=world_size,
                        num_experts=num_experts, hidden=hidden,
                        max_tokens_per_rank=max_tokens_per_rank, max_topk=max_topk,
                        dtype=dtype, arena_bytes=arena_bytes, op_timeout_ms=op_timeout_ms)
                else:
                    self.group = Group.join(client, group, secret, rank,
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

    def destroy(self):
        """Leaves the group (and closes the connection the buffer opened)."""
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
    def get_dispatch_config(num_ranks=None):
        """DeepEP's tuning config: epd has none. Returns None."""
        return None

    @staticmethod
    def get_combine_config(num_ranks=None):
        """DeepEP's tuning config: epd has none. Returns None."""
        return None

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None,
                            async_finish=False, allocate_on_comm_stream=False):
        """Counts where tokens go, computed locally from ``topk_idx`` ``[N, K]`` (-1: none).

        Returns ``(num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32,
        is_token_in_rank [N, R] bool, None)``, as DeepEP (no RDMA ranks, no event).
        """
        was_torch = _is_torch(topk_idx)
        tk = np.asarray(_to_numpy(topk_idx))
        if tk.ndim != 2 or tk.dtype.kind not in "iu":
            raise InvalidArgument("topk_idx must be an integer [num_tokens, num_topk] array")
        R, E = self.group_size, int(num_experts)
        if E != self.num_experts:
            raise InvalidArgument("num_experts %d differs from the group's %d" %
                                  (E, self.num_experts))
        if np.any((tk < -1) | (tk >= E)):
            raise InvalidArgument("topk_idx holds expert ids outside [-1, %d)" % E)
        L = E // R
        valid = tk >= 0
        num_tokens_per_expert = np.bincount(tk[valid].astype(np.int64),
                                            minlength=E).astype(np.int32)
        dest = np.where(valid, tk // L, -1)
        is_token_in_rank = np.zeros((tk.shape[0], R), dtype=bool)
        for r in range(R):
            is_token_in_rank[:, r] = np.any(dest == r, axis=1)
        num_tokens_per_rank = is_token_in_rank.sum(axis=0).astype(np.int32)
        if was_torch:
            return (_to_torch(num_tokens_per_rank), None, _to_torch(num_tokens_per_expert),
                    _to_torch(is_token_in_rank), None)
        return num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, None

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None,
                 previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        """DeepEP's normal dispatch. ``x`` is an array, or ``(x, x_scales)`` for fp8.

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, None)``; ``recv_x`` is ``(recv_x, recv_x_scales)`` for fp8. A cached dispatch
        (``handle`` given) returns ``(recv_x, None, recv_topk_weights or None, None, handle,
        None)``.
        """
        if num_worst_tokens:
            raise NotImplementedError("num_worst_tokens is not supported by epd's DeepEP front")
        was_torch = _is_torch(x[0] if isinstance(x, tuple) else x)
        x_scales = None
        if isinstance(x, tuple):
            x, x_scales = x
        res = self.group.dispatch(
            _to_numpy(x), topk_idx=_to_numpy(topk_idx), topk_weights=_to_numpy(topk_weights),
            x_scales=_to_numpy(x_scales), handle=handle,
            expert_alignment=expert_alignment if handle is None else None,
            layout=NON_EXPAND, copy_outputs=self.copy_outputs)
        if handle is None:
            res.handle.auto_release()
        recv_x = res.recv_x if res.recv_x_scales is None else (res.recv_x, res.recv_x_scales)
        bf16 = self.group.dtype == "bf16"
        if was_torch:
            recv_x = _to_torch(recv_x, bf16=bf16)
        conv = _to_torch if was_torch else (lambda v: v)
        if handle is not None:
            return recv_x, None, conv(res.recv_topk_weights), None, res.handle, None
        return (recv_x, conv(res.recv_topk_idx), conv(res.recv_topk_weights),
                res.num_recv_tokens_per_expert_list, res.handle, None)

    def combine(self, x, handle, topk_weights=None, bias=None, config=None,
                previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        """DeepEP's normal combine: ``x`` ``[num_recv_tokens, hidden]`` in dispatch order.

        ``bias`` is None, one array or a tuple of two ``[N, hidden]``. Returns
        ``(combined_x, combined_topk_weights, None)``; ``combined_topk_weights`` is None unless
        ``topk_weights`` is given (its values are not used: see the module docstring).
        """
        was_torch = _is_torch(x)
        if isinstance(bias, tuple):
            bias = tuple(_to_numpy(b) for b in bias)
        else:
            bias = _to_numpy(bias)
        combined, weights = self.group.combine(_to_numpy(x), handle, bias=bias)
        if topk_weights is None:
            weights = None
        if was_torch:
            return _to_torch(combined, bf16=True), _to_torch(weights), None
        return combined, weights, None


__all__ = ["Buffer"]
