"""Client-executed ops (docs/client-execution.md): :meth:`Group.cx_dispatch`,
:meth:`Group.cx_combine` and what they read.

In a group created with ``execution="client"`` each rank runs its ops itself over buffers the
daemon allocated. On the host backend an op runs on the calling thread and takes NumPy arrays;
on the cuda backend it is a kernel launch on a CUDA stream and takes torch CUDA tensors (torch
is never imported here: :mod:`epd.tensors` finds it when the program did). Every rank issues the
same sequence of ops, each on its own thread or process: an op waits for its peers.

Outputs are views of the rank's receive area (no copy), valid until the next dispatch that
writes it; copy what must outlive it. The expert writes its output rows into the y area
(:meth:`Group.cx_y`) and combine reads them there; a ``y`` given to combine that is not that
view is copied into it first.

Handles are slot numbers, ``0 .. num_handle_slots - 1``: a dispatch fills its slot, a combine
or a cached dispatch names it.
"""

import ctypes

import numpy as np

from . import _lib, tensors
from .client import NUMPY_DTYPE, check
from .errors import InvalidArgument, Unavailable, make_error

NON_EXPAND = "non_expand"
EXPAND = "expand"


class _CudaArray:
    """Device memory described by ``__cuda_array_interface__``, for torch.as_tensor."""

    def __init__(self, address, shape, typestr):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                         "data": (int(address), False), "version": 2,
                                         "strides": None}


class _Slot:
    """What this rank's Python side knows of the dispatch that last filled a handle slot."""

    def __init__(self, layout, num_tokens, num_topk, topk_code, has_weights, block_rows,
                 quantize):
        self.layout = layout
        self.num_tokens = num_tokens
        self.num_topk = num_topk
        self.topk_code = topk_code
        self.has_weights = has_weights
        self.block_rows = block_rows
        self.quantize = quantize


class CxState:
    """A client-executed group's buffers as mapped in this process, and its handle slots."""

    def __init__(self, group):
        lib = _lib.load()
        fn = lib.optional.get("epd_cx_buffers")
        if fn is None:
            raise Unavailable("this libepd has no client-executed ops (epd_cx_*); rebuild it")
        b = _lib.CxBuffers(size=ctypes.sizeof(_lib.CxBuffers))
        check(group.client, fn(group._ptr, ctypes.byref(b)))
        self.buffers = b
        self.recv_rows = b.recv_rows
        self.num_handle_slots = b.num_handle_slots
        self.on_device = group.client.info()["backend"] == "cuda"
        self.slots = {}
        # slot -> (per_expert, aligned, rank_prefix, expert_base, rank_prefix_matrix)
        self.count_addresses = {}


def state(group):
    """The group's :class:`CxState`; refuses a daemon-executed group."""
    group._check()
    if group.execution != "client":
        raise InvalidArgument("group %d is daemon-executed: use dispatch and combine, or "
                              "create it with execution='client'" % group.id)
    if group._cx is None:
        group._cx = CxState(group)
    return group._cx


def _fn(name):
    return _lib.load().optional[name]


# ---- views of the rank's buffer ----

def host_view(group, address, shape, np_dtype):
    """A writable NumPy view of ``shape`` at ``address`` of the group's host mapping."""
    dt = np.dtype(np_dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if n == 0:
        return np.empty(shape, dt)
    buf = (ctypes.c_uint8 * n).from_address(address)
    buf.group = group  # a view keeps the group (and so the mapping) alive
    return np.frombuffer(buf, dtype=dt).reshape(shape)


def device_view(address, shape, code, device):
    """A torch tensor of epd dtype ``code`` viewing device memory at ``address``."""
    torch = tensors.torch_module()
    dt = tensors.torch_dtype(code)
    if int(np.prod(shape, dtype=np.int64)) == 0:
        return torch.empty(shape, dtype=dt, device=device)
    carrier = np.dtype(NUMPY_DTYPE[code])
    typestr = carrier.str if code != _lib.DTYPE_BF16 else "<i2"
    t = torch.as_tensor(_CudaArray(address, shape, typestr), device=device)
    return t if t.dtype == dt else t.view(dt)


def _view(group, st, address, shape, code, device):
    if st.on_device:
        return device_view(address, shape, code, device)
    return host_view(group, address, shape, NUMPY_DTYPE[code])


def _scale_cols(group):
    return group.hidden // (group.scale_block or 128)


def _byte_view(group, st, address, shape, device):
    """uint8 ``shape`` at ``address`` (ue8m0 scales)."""
    if not st.on_device:
        return host_view(group, address, shape, np.uint8)
    torch = tensors.torch_module()
    if int(np.prod(shape, dtype=np.int64)) == 0:
        return torch.empty(shape, dtype=torch.uint8, device=device)
    return torch.as_tensor(_CudaArray(address, shape, "|u1"), device=device)


def _scale_format(scale_format):
    """The enum epd_scale_format of the ``scale_format`` argument ("fp32" or "ue8m0"); the
    library checks the rest (ue8m0 needs round_scale, both need quantize) on every rank."""
    name = str(scale_format or "fp32").lower()
    if name not in ("fp32", "ue8m0"):
        raise InvalidArgument("scale_format must be 'fp32' or 'ue8m0', not %r" % (scale_format,))
    return _lib.SCALE_FORMAT_UE8M0 if name == "ue8m0" else _lib.SCALE_FORMAT_FP32


# ---- results ----

class CxDispatchResult:
    """What :meth:`Group.cx_dispatch` returns on this rank.

    Views of the receive area: ``recv_x`` ``[rows, hidden]`` (bf16 bits as uint16, or fp8 e4m3
    bytes as uint8 for an fp8 group or a quantizing dispatch), ``recv_x_scales`` float32
    ``[rows, hidden/scale_block]`` (fp8 rows only; a quantizing dispatch's blocks are 128
    channels, and with ``scale_format="ue8m0"`` they are uint8 ``[rows, hidden/128]``, the bytes
    e + 127, four to a little-endian int32 word), ``recv_topk_idx`` ``[rows, K]`` (NON_EXPAND),
    ``recv_weights`` (alias ``recv_topk_weights``; only when weights were given: ``[rows, K]``
    NON_EXPAND, ``[rows]`` EXPAND), ``recv_src`` int64 ``[rows]`` and ``recv_topk_slot`` int32
    ``[rows]`` (EXPAND). Counts (docs/semantics.md §2.3): ``num_recv_tokens``,
    ``num_expanded_rows``, ``num_recv_tokens_per_expert``,
    ``num_recv_tokens_per_expert_aligned``, ``rank_prefix`` ``[R + 1]``, ``expert_base``
    ``[L + 1]`` (the first row of each local expert) and ``rank_prefix_matrix`` ``[R, R]``
    (``[s][d]``: the tokens ranks ``0..s`` sent to rank ``d``, every rank's counts), plus
    ``handle`` (the slot), ``layout`` and ``op_number``.

    Host backend: ``rows`` is the op's row count (``num_recv_tokens`` for NON_EXPAND,
    ``num_expanded_rows`` for EXPAND), the counts are NumPy copies. cuda backend: the op has
    only been queued, so the views have the capacity's rows (``num_local_experts *
    expert_block_rows`` for fixed expert blocks, else the receive area's), the count arrays
    are int32 tensors in device memory, and ``num_recv_tokens``, ``num_expanded_rows`` and
    ``op_number`` are None (read them with :meth:`Group.cx_counts` and :meth:`Group.cx_status`
    once the stream has passed the op).
    """

    def __init__(self, **fields):
        self.__dict__.update(fields)
        self.recv_topk_weights = self.recv_weights

    @property
    def num_rows(self):
        return self.recv_src.shape[0]

    def __repr__(self):
        return "<epd.CxDispatchResult %s slot=%d rows=%d>" % (self.layout, self.handle,
                                                              self.num_rows)


def _layout(layout):
    if isinstance(layout, str) and layout.lower() in (NON_EXPAND, EXPAND):
        return layout.lower()
    raise InvalidArgument("layout must be 'non_expand' or 'expand', not %r" % (layout,))


def _slot(st, handle):
    if isinstance(handle, bool) or not isinstance(handle, (int, np.integer)) or \
            not 0 <= int(handle) < st.num_handle_slots:
        raise InvalidArgument("handle must be a slot number 0..%d, not %r" %
                              (st.num_handle_slots - 1, handle))
    return int(handle)


def _filled(st, handle, what):
    info = st.slots.get(handle)
    if info is None:
        raise InvalidArgument("%s: handle slot %d holds no dispatch of this rank" %
                              (what, handle))
    return info


def _host_payload(group, x, quantize):
    from .group import _payload
    code = _lib.DTYPE_BF16 if quantize else group.dtype_code
    a = _payload(x, code, "x")
    if a.ndim != 2 or a.shape[1] != group.hidden:
        raise InvalidArgument("x must be [num_tokens, %d], not %s" % (group.hidden, a.shape))
    if a.strides[1] != a.itemsize or a.strides[0] < 0:
        a = np.ascontiguousarray(a)
    return a


def _host_matrix(value, dtype, cols, rows, what):
    a = np.ascontiguousarray(np.asarray(value), dtype=dtype)
    if a.shape != (rows, cols):
        raise InvalidArgument("%s must be [%d, %d], not %s" % (what, rows, cols, a.shape))
    return a


def _topk_code(a):
    return _lib.DTYPE_INT32 if a.dtype == np.int32 else _lib.DTYPE_INT64


def dispatch(group, x, topk_idx, topk_weights, x_scales, handle, cached, layout,
             expert_alignment, zero_padding, expert_block_rows, quantize, capacity_rows,
             stream, round_scale=False, scale_format=None):
    """Group.cx_dispatch (see there)."""
    st = state(group)
    fmt = _scale_format(scale_format)
    handle = _slot(st, handle)
    layout = _layout(layout)
    if cached:
        prev = _filled(st, handle, "a cached dispatch")
        if topk_idx is not None:
            raise InvalidArgument("a cached dispatch takes no topk_idx")
    elif topk_idx is None:
        raise InvalidArgument("topk_idx is required unless cached=True")
    fp8_rows = bool(quantize) or group.dtype_code == _lib.DTYPE_FP8_E4M3
    if group.dtype_code == _lib.DTYPE_FP8_E4M3 and x_scales is None:
        raise InvalidArgument("an fp8 group's dispatch needs x_scales")
    args = _lib.CxDispatchArgs(size=ctypes.sizeof(_lib.CxDispatchArgs))
    args.layout = _lib.LAYOUT_EXPAND if layout == EXPAND else _lib.LAYOUT_NON_EXPAND
    args.expert_alignment = int(expert_alignment or 1)
    args.zero_padding = int(bool(zero_padding))
    args.expert_block_rows = int(expert_block_rows or 0)
    args.quantize = int(bool(quantize))
    args.round_scale = int(bool(round_scale))
    args.scale_format = fmt
    args.handle = handle
    args.cached = int(bool(cached))
    args.capacity_rows = int(capacity_rows or 0)
    keep = []
    device = None
    if tensors.is_tensor(x):
        if not st.on_device or not tensors.is_cuda(x):
            raise InvalidArgument("torch tensors need a client-executed group on the cuda "
                                  "backend and CUDA tensors; use NumPy arrays on the host "
                                  "backend")
        device = x.device
        torch = tensors.torch_module()
        torch_stream = tensors._stream_for(device, stream)
        with tensors._using(torch_stream):
            code = _lib.DTYPE_BF16 if quantize else group.dtype_code
            xt = tensors._as_tensor(x, device, "x")
            if xt.dim() != 2 or xt.shape[1] != group.hidden:
                raise InvalidArgument("x must be [num_tokens, %d], not %s" %
                                      (group.hidden, tuple(xt.shape)))
            if xt.element_size() != (2 if code == _lib.DTYPE_BF16 else 1):
                raise InvalidArgument("x must be %s, not %s" %
                                      ("bf16" if code == _lib.DTYPE_BF16 else "fp8", xt.dtype))
            if xt.stride(1) != 1:
                xt = xt.contiguous()
            keep.append(xt)
            n = xt.shape[0]
            args.x, args.x_stride = xt.data_ptr(), xt.stride(0) * xt.element_size()
            if x_scales is not None:
                sc = tensors._as_tensor(x_scales, device, "x_scales").float().contiguous()
                keep.append(sc)
                args.scales = sc.data_ptr()
            if topk_idx is not None:
                tk = tensors._as_tensor(topk_idx, device, "topk_idx")
                if tk.dtype not in (torch.int32, torch.int64):
                    tk = tk.long()
                tk = tk.contiguous()
                keep.append(tk)
                k = tk.shape[1] if tk.dim() == 2 else 0
                topk_code = _lib.DTYPE_INT32 if tk.dtype == torch.int32 else _lib.DTYPE_INT64
                args.topk_idx = tk.data_ptr()
            if topk_weights is not None:
                w = tensors._as_tensor(topk_weights, device, "topk_weights").float()
                w = w.contiguous()
                keep.append(w)
                args.topk_weights = w.data_ptr()
        stream_ptr = tensors.stream_handle(torch_stream)
    else:
        xa = _host_payload(group, x, quantize)
        n = xa.shape[0]
        keep.append(xa)
        args.x, args.x_stride = xa.ctypes.data, xa.strides[0]
        if x_scales is not None:
            sa = _host_matrix(x_scales, np.float32, _scale_cols(group), n, "x_scales")
            keep.append(sa)
            args.scales = sa.ctypes.data
        if topk_idx is not None:
            from .group import _topk
            tk = np.ascontiguousarray(_topk(topk_idx))
            if tk.ndim != 2 or tk.shape[0] != n:
                raise InvalidArgument("topk_idx must be [%d, K], not %s" % (n, tk.shape))
            keep.append(tk)
            k = tk.shape[1]
            topk_code = _topk_code(tk)
            args.topk_idx = tk.ctypes.data
        if topk_weights is not None:
            kk = k if topk_idx is not None else prev.num_topk
            wa = _host_matrix(topk_weights, np.float32, kk, n, "topk_weights")
            keep.append(wa)
            args.topk_weights = wa.ctypes.data
        stream_ptr = None
        if stream is not None:
            raise InvalidArgument("the host backend runs ops on the calling thread; stream "
                                  "must be None")
    if cached:
        k, topk_code = prev.num_topk, prev.topk_code
    args.num_tokens = n
    args.num_topk = k
    args.topk_dtype = topk_code
    rc = _fn("epd_cx_dispatch")(group._ptr, ctypes.byref(args), ctypes.c_void_p(stream_ptr))
    if rc < 0:
        st.slots.pop(handle, None)
        raise make_error(rc, group.client.last_error)
    has_weights = topk_weights is not None
    st.slots[handle] = _Slot(layout, n, k, topk_code, has_weights, args.expert_block_rows,
                             bool(quantize))
    if device is not None:
        st.keep = keep  # the inputs stay referenced until the next launch of this rank
    return _dispatch_result(group, st, handle, device, fp8_rows,
                            bool(quantize) and fmt == _lib.SCALE_FORMAT_UE8M0,
                            torch_stream if device is not None else None)


def _counts(group, st, handle):
    """The slot's epd_cx_counts (host backend; on cuda it copies from device memory). A slot
    that holds no dispatch because the rank's last op failed raises that op's error (a failed
    dispatch leaves its slot empty), not NOT_FOUND."""
    c = _lib.CxCounts(size=ctypes.sizeof(_lib.CxCounts))
    rc = _fn("epd_cx_counts")(group._ptr, handle, ctypes.byref(c))
    if rc == _lib.NOT_FOUND:
        s = _lib.CxStatus(size=ctypes.sizeof(_lib.CxStatus))
        if _fn("epd_cx_status")(group._ptr, ctypes.byref(s)) == 0 and s.status < 0:
            raise make_error(s.status, _lib.text(s.message))
    check(group.client, rc)
    st.count_addresses[handle] = (c.num_recv_tokens_per_expert,
                                  c.num_recv_tokens_per_expert_aligned, c.rank_prefix,
                                  c.expert_base, c.rank_prefix_matrix)
    return c


def _count_views(group, st, handle, device, stream=None):
    """Device views of the slot's counts. Their addresses are fixed per slot; the first time
    a slot is asked for they are read with epd_cx_counts, which needs ``stream`` (None: the
    current stream) to have passed a dispatch into that slot (not allowed while a CUDA graph
    is being captured)."""
    if handle not in st.count_addresses:
        torch = tensors.torch_module()
        if torch.cuda.is_current_stream_capturing():
            raise InvalidArgument("handle slot %d: run one dispatch into it before capturing "
                                  "a CUDA graph (its counts' addresses are read then)" % handle)
        (stream if stream is not None else torch.cuda.current_stream(device)).synchronize()
        _counts(group, st, handle)
    L, R = group.num_local_experts, group.world_size
    pe, al, rp, eb, rm = st.count_addresses[handle]
    return {"num_recv_tokens_per_expert": device_view(pe, (L,), _lib.DTYPE_INT32, device),
            "num_recv_tokens_per_expert_aligned": device_view(al, (L,), _lib.DTYPE_INT32,
                                                              device),
            "rank_prefix": device_view(rp, (R + 1,), _lib.DTYPE_INT32, device),
            "rank_prefix_matrix": device_view(rm, (R, R), _lib.DTYPE_INT32, device),
            "expert_base": device_view(eb, (L + 1,), _lib.DTYPE_INT32, device)}


def _host_counts(group, st, handle):
    c = _counts(group, st, handle)
    L, R = c.num_local_experts, c.world_size

    def arr(addr, n):
        return host_view(group, addr, (n,), np.int32).copy()

    return {"num_recv_tokens": c.num_recv_tokens, "num_expanded_rows": c.num_expanded_rows,
            "num_recv_tokens_per_expert": arr(c.num_recv_tokens_per_expert, L),
            "num_recv_tokens_per_expert_aligned": arr(c.num_recv_tokens_per_expert_aligned, L),
            "rank_prefix": arr(c.rank_prefix, R + 1), "expert_base": arr(c.expert_base, L + 1),
            "rank_prefix_matrix": arr(c.rank_prefix_matrix, R * R).reshape(R, R)}


def _dispatch_result(group, st, handle, device, fp8_rows, ue8m0=False, stream=None):
    info = st.slots[handle]
    b = st.buffers
    expand = info.layout == EXPAND
    if device is None:
        counts = _host_counts(group, st, handle)
        rows = counts["num_expanded_rows"] if expand else counts["num_recv_tokens"]
        status = cx_status(group)
        op_number = status["op"]
    else:
        counts = _count_views(group, st, handle, device, stream)
        counts.update(num_recv_tokens=None, num_expanded_rows=None)
        rows = (group.num_local_experts * info.block_rows if info.block_rows
                else st.recv_rows)
        op_number = None
    H, K = group.hidden, info.num_topk
    x_code = _lib.DTYPE_FP8_E4M3 if fp8_rows else _lib.DTYPE_BF16

    def view(addr, shape, code):
        return _view(group, st, addr, shape, code, device)

    if not fp8_rows:
        scales = None
    elif ue8m0:
        scales = _byte_view(group, st, b.recv_scales, (rows, H // 128), device)
    else:
        scales = view(b.recv_scales, (rows, H // 128 if info.quantize else _scale_cols(group)),
                      _lib.DTYPE_FP32)
    return CxDispatchResult(
        layout=info.layout, handle=handle, op_number=op_number,
        recv_x=view(b.recv_x, (rows, H), x_code),
        recv_x_scales=scales,
        recv_topk_idx=None if expand else view(b.recv_topk_idx, (rows, K), info.topk_code),
        recv_weights=(view(b.recv_weights, (rows,) if expand else (rows, K), _lib.DTYPE_FP32)
                      if info.has_weights else None),
        recv_src=view(b.recv_src, (rows,), _lib.DTYPE_INT64),
        recv_topk_slot=view(b.recv_topk_slot, (rows,), _lib.DTYPE_INT32) if expand else None,
        **counts)


def y_view(group, handle, device=None):
    """The y area as the slot's dispatch lays it out: bf16 ``[rows, hidden]`` (host: the op's
    rows; cuda: the capacity's), and its y_weights ``[rows, K]`` float32."""
    st = state(group)
    handle = _slot(st, handle)
    info = _filled(st, handle, "cx_y")
    if st.on_device:
        if device is None:
            raise InvalidArgument("cx_y on the cuda backend needs the torch device")
        rows = (group.num_local_experts * info.block_rows if info.block_rows
                else st.recv_rows)
    else:
        c = _counts(group, st, handle)
        rows = c.num_expanded_rows if info.layout == EXPAND else c.num_recv_tokens
    y = _view(group, st, st.buffers.y, (rows, group.hidden), _lib.DTYPE_BF16, device)
    yw = _view(group, st, st.buffers.y_weights, (rows, info.num_topk), _lib.DTYPE_FP32, device)
    return y, yw


def _same_memory(a, b):
    if tensors.is_tensor(a):
        return a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and \
        a.strides == b.strides


def combine(group, y, handle, recv_weights, apply_weights, source_weights, bias, out, stream):
    """Group.cx_combine (see there)."""
    from .group import CombineResult, _payload
    st = state(group)
    handle = _slot(st, handle)
    info = _filled(st, handle, "cx_combine")
    n, K, H = info.num_tokens, info.num_topk, group.hidden
    biases = [] if bias is None else [b for b in (bias if isinstance(bias, (tuple, list))
                                                   else (bias,)) if b is not None]
    if len(biases) > 2:
        raise InvalidArgument("at most 2 biases, not %d" % len(biases))
    args = _lib.CxCombineArgs(size=ctypes.sizeof(_lib.CxCombineArgs))
    args.handle = handle
    args.apply_weights = int(bool(apply_weights))
    args.recv_weights = int(recv_weights is not None)
    args.num_bias = len(biases)
    want_weights = info.has_weights or recv_weights is not None
    keep = []
    device = None
    if st.on_device:
        torch = tensors.torch_module()
        ref = y if tensors.is_tensor(y) else out
        if not tensors.is_cuda(ref):
            raise InvalidArgument("cx_combine on the cuda backend takes torch CUDA tensors: "
                                  "y, or out when the expert wrote y in place (cx_y)")
        device = ref.device
        torch_stream = tensors._stream_for(device, stream)
        with tensors._using(torch_stream):
            y_area, yw_area = y_view(group, handle, device)
            if y is not None:
                yt = y.view(torch.bfloat16) if y.dtype != torch.bfloat16 else y
                rows = min(yt.shape[0], y_area.shape[0])
                if not _same_memory(yt, y_area):
                    y_area[:rows].copy_(yt[:rows])
            if recv_weights is not None:
                rw = tensors._as_tensor(recv_weights, device, "recv_weights").float()
                yw_area[:rw.shape[0]].copy_(rw)
            if source_weights is not None:
                sw = tensors._as_tensor(source_weights, device, "source_weights").float()
                sw = sw.contiguous()
                keep.append(sw)
                args.source_weights = sw.data_ptr()
            for i, b in enumerate(biases):
                bt = tensors._as_tensor(b, device, "bias").view(torch.bfloat16).contiguous()
                keep.append(bt)
                args.bias[i] = bt.data_ptr()
            combined = out if out is not None else torch.empty((n, H), dtype=torch.bfloat16,
                                                               device=device)
            if tuple(combined.shape) != (n, H) or not combined.is_contiguous():
                raise InvalidArgument("out must be a contiguous bf16 [%d, %d] tensor" % (n, H))
            cw = (torch.empty((n, K), dtype=torch.float32, device=device) if want_weights
                  else None)
        stream_ptr = tensors.stream_handle(torch_stream)
        args.combined = combined.data_ptr()
        args.combined_topk_weights = cw.data_ptr() if cw is not None else None
    else:
        if stream is not None:
            raise InvalidArgument("the host backend runs ops on the calling thread; stream "
                                  "must be None")
        y_area, yw_area = y_view(group, handle)
        rows = y_area.shape[0]
        if y is not None:
            ya = _payload(y, _lib.DTYPE_BF16, "y")
            if ya.ndim != 2 or ya.shape[1] != H or ya.shape[0] < rows:
                raise InvalidArgument("y must be [%d, %d] (at least the dispatch's rows), not "
                                      "%s" % (rows, H, ya.shape))
            if not _same_memory(ya[:rows], y_area):
                y_area[...] = ya[:rows]
        if recv_weights is not None:
            rw = np.asarray(recv_weights, dtype=np.float32)
            if rw.ndim != 2 or rw.shape[1] != K or rw.shape[0] < rows:
                raise InvalidArgument("recv_weights must be float32 [%d, %d], not %s" %
                                      (rows, K, rw.shape))
            yw_area[...] = rw[:rows]
        if source_weights is not None:
            sw = _host_matrix(source_weights, np.float32, K, n, "source_weights")
            keep.append(sw)
            args.source_weights = sw.ctypes.data
        for i, b in enumerate(biases):
            ba = np.ascontiguousarray(_payload(b, _lib.DTYPE_BF16, "bias"))
            if ba.shape != (n, H):
                raise InvalidArgument("bias must be [%d, %d], not %s" % (n, H, ba.shape))
            keep.append(ba)
            args.bias[i] = ba.ctypes.data
        if out is not None:
            combined = np.asarray(out)
            if combined.shape != (n, H) or combined.dtype.itemsize != 2 or \
                    combined.dtype.kind == "f" or not combined.flags.c_contiguous:
                raise InvalidArgument("out must be a contiguous uint16 [%d, %d] array" % (n, H))
        else:
            combined = np.empty((n, H), np.uint16)
        cw = np.empty((n, K), np.float32) if want_weights else None
        stream_ptr = None
        args.combined = combined.ctypes.data
        args.combined_topk_weights = cw.ctypes.data if cw is not None else None
    rc = _fn("epd_cx_combine")(group._ptr, ctypes.byref(args), ctypes.c_void_p(stream_ptr))
    if rc < 0:
        raise make_error(rc, group.client.last_error)
    if device is not None:
        st.keep = keep
        return CombineResult(combined, cw, op_number=None, num_tokens=n, exec_ns=0,
                             queue_ns=0, kernel_ns=0)
    return CombineResult(combined, cw, op_number=cx_status(group)["op"], num_tokens=n,
                         exec_ns=0, queue_ns=0, kernel_ns=0)


def cx_status(group):
    """The rank's last op (epd_cx_status): a dict with ``op``, ``status`` (0 or a negative
    code), ``status_name`` and ``message``, and ``phases``: per kind (``dispatch``,
    ``combine``) the ops of this rank that ended OK and their summed time in each phase
    (``exchange_ns``, ``move_ns``, ``finish_ns``; docs/client-execution.md); ``window``: the
    op's ``(start_ns, end_ns)`` on its executor's clock (cuda: the GPU's); and
    ``dispatch_first_ns``: on cuda, the OK dispatches' first phase in parts (epd.h). On cuda,
    synchronise the stream first."""
    state(group)
    s = _lib.CxStatus(size=ctypes.sizeof(_lib.CxStatus))
    check(group.client, _fn("epd_cx_status")(group._ptr, ctypes.byref(s)))
    phases = {kind: {"ops": s.kind_ops[i], "exchange_ns": s.phase_ns[i][0],
                     "move_ns": s.phase_ns[i][1], "finish_ns": s.phase_ns[i][2]}
              for i, kind in enumerate(("dispatch", "combine"))}
    return {"op": s.op, "status": s.status, "status_name": _lib.status_name(s.status),
            "message": _lib.text(s.message), "phases": phases,
            "window": (s.start_ns, s.end_ns),
            "dispatch_first_ns": {name: s.dispatch_first_ns[i] for i, name in enumerate(
                ("check", "publish", "wait", "verdict", "place", "counts"))}}


def cx_counts(group, handle):
    """The counts of the slot's last dispatch (epd_cx_counts) as NumPy arrays; on cuda,
    synchronise the stream first."""
    st = state(group)
    handle = _slot(st, handle)
    if not st.on_device:
        return _host_counts(group, st, handle)
    c = _counts(group, st, handle)
    L, R = c.num_local_experts, c.world_size
    torch = tensors.torch_module()
    out = {"num_recv_tokens": c.num_recv_tokens, "num_expanded_rows": c.num_expanded_rows}
    if torch is None:
        return out
    dev = torch.device("cuda", torch.cuda.current_device())
    for name, addr, m in (("num_recv_tokens_per_expert", c.num_recv_tokens_per_expert, L),
                          ("num_recv_tokens_per_expert_aligned",
                           c.num_recv_tokens_per_expert_aligned, L),
                          ("rank_prefix", c.rank_prefix, R + 1),
                          ("expert_base", c.expert_base, L + 1),
                          ("rank_prefix_matrix", c.rank_prefix_matrix, R * R)):
        out[name] = device_view(addr, (m,), _lib.DTYPE_INT32, dev).cpu().numpy()
    out["rank_prefix_matrix"] = out["rank_prefix_matrix"].reshape(R, R)
    return out
