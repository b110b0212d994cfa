"""Groups, dispatch, combine, handles and futures: docs/semantics.md §1 to §3 in Python.

Argument names follow DeepEP's ``Buffer.dispatch`` / ``Buffer.combine`` where the meaning is the
same (``x``, ``topk_idx``, ``topk_weights``, ``handle``, ``expert_alignment``, ``bias``,
``async_op``...). Every dispatch and combine is a collective: every rank of the group must issue
the same sequence of them (docs/semantics.md section 1).

Errors found by the daemon fail the op on every rank alike. The few argument errors the binding
finds itself (an array of a dtype that cannot be carried, a missing ``topk_idx``) raise
:class:`~epd.InvalidArgument` before anything is submitted, so the other ranks' op then ends in
``Timeout`` after the group's op timeout.

torch tensors (CPU or CUDA) are handled by :mod:`epd.tensors`: CUDA tensors are registered in
place, outputs are tensors, and the op is ordered after the current CUDA stream.
"""

import ctypes
import numbers
import threading
import time
import weakref

import numpy as np

from . import _lib, cx, tensors
from .bf16 import float_to_bf16
from .client import NUMPY_DTYPE, Staging, check, describe, epd_dtype
from .errors import InvalidArgument, NotFound, Timeout, Unavailable, make_error

#: ``layout`` values of :meth:`Group.dispatch`.
NON_EXPAND = "non_expand"
EXPAND = "expand"

_LAYOUTS = {NON_EXPAND: _lib.LAYOUT_NON_EXPAND, EXPAND: _lib.LAYOUT_EXPAND}


def _layout_code(layout):
    if isinstance(layout, str) and layout.lower() in _LAYOUTS:
        return _LAYOUTS[layout.lower()]
    if layout in (_lib.LAYOUT_NON_EXPAND, _lib.LAYOUT_EXPAND) and not isinstance(layout, bool):
        return int(layout)
    raise InvalidArgument("layout must be 'non_expand' or 'expand', not %r" % (layout,))


def _secret_bytes(secret):
    if isinstance(secret, str):
        return secret.encode()
    if isinstance(secret, (bytes, bytearray, memoryview)):
        return bytes(secret)
    raise InvalidArgument("secret must be bytes or str")


def _payload(array, epd_dt, what):
    """``array`` as the carrier of an epd payload dtype (bf16 bits, fp8 bytes).

    bf16: uint16/int16 (or any 2-byte non-float type, e.g. ml_dtypes.bfloat16) are taken as
    bits; float arrays are rounded with :func:`epd.float_to_bf16`. fp8: any 1-byte type is taken
    as the e4m3 bytes.
    """
    a = np.asarray(array)
    if epd_dt == _lib.DTYPE_BF16:
        if a.dtype.kind == "f":
            return float_to_bf16(a)
        if a.dtype.itemsize == 2 and a.dtype.kind in "uiV":
            return a.view(np.uint16)
        raise InvalidArgument("%s: a bf16 group takes uint16 bf16 bits or floats, not %s" %
                              (what, a.dtype))
    if a.dtype.itemsize == 1 and a.dtype.kind in "uiV":
        return a.view(np.uint8)
    raise InvalidArgument("%s: an fp8 group takes the e4m3 bytes as uint8, not %s" %
                          (what, a.dtype))


def _float32(array, what):
    a = np.asarray(array)
    if a.dtype == np.float32:
        return a
    if a.dtype.kind in "fiu":
        return a.astype(np.float32)
    raise InvalidArgument("%s must be float32, not %s" % (what, a.dtype))


def _topk(array):
    a = np.asarray(array)
    if a.dtype in (np.int32, np.int64):
        return a
    if a.dtype.kind in "iu":
        return a.astype(np.int64)
    raise InvalidArgument("topk_idx must be int32 or int64, not %s" % a.dtype)


def _dims(a, what):
    if a.ndim < 1 or a.ndim > _lib.TENSOR_MAX_DIMS:
        raise InvalidArgument("%s has %d dimensions" % (what, a.ndim))
    return a


def _release_handle(group_ref, handle_id, state):
    group = group_ref()
    if state[0] or group is None or not group._ptr or not group.client._ptr:
        return
    state[0] = True
    _lib.load().epd_handle_release(group._ptr, handle_id)


class StreamWaitUnavailable(Unavailable, NotImplementedError):
    """Stream ordering is not available here (host backend, or libepd without CUDA)."""


class Handle:
    """The routing state of one dispatch, kept by the daemon until every rank releases it.

    Pass it to :meth:`Group.combine` and to cached dispatches. :meth:`release` (or ``with``)
    releases this rank's share; the daemon then reuses the arena space of the dispatch's
    outputs, so arena views of that dispatch must not be read after it. Handles not released
    are released when the group is left.
    """

    def __init__(self, group, handle_id, layout, num_tokens, num_topk, topk_dtype, has_weights,
                 num_rows, expert_alignment, zero_padding):
        self.group = group
        self.id = handle_id
        self.layout = layout
        self.num_tokens = num_tokens
        self.num_topk = num_topk
        self.topk_dtype = topk_dtype
        self.has_weights = has_weights
        self.num_rows = num_rows
        self.expert_alignment = expert_alignment
        self.zero_padding = zero_padding
        self.rank_prefix = None  # int32 [world_size + 1] of the dispatch that made it
        self._state = [False]  # released; shared with the auto-release finalizer

    @property
    def released(self):
        """True once this rank released the handle."""
        return self._state[0]

    def release(self):
        """Releases this rank's share of the handle (local, not collective; idempotent)."""
        if self._state[0]:
            return
        self._state[0] = True
        g = self.group
        if g._ptr:
            check(g.client, _lib.load().epd_handle_release(g._ptr, self.id))

    def auto_release(self):
        """Releases the handle when this object is garbage collected, unless released before.

        For code written against DeepEP, whose handles are plain tensors that are never
        released. Returns the handle.
        """
        fin = weakref.finalize(self, _release_handle, weakref.ref(self.group), self.id,
                               self._state)
        fin.atexit = False  # the daemon releases everything when the connection closes
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __repr__(self):
        return "<epd.Handle %d %s tokens=%d rows=%d%s>" % (
            self.id, self.layout, self.num_tokens, self.num_rows,
            " released" if self.released else "")


class DispatchResult:
    """What a dispatch returns on this rank (docs/semantics.md §2.1 to 2.3).

    Arrays (None when the op has no such output):

    * ``recv_x`` ``[rows, hidden]``: uint16 bf16 bits, or uint8 fp8 bytes;
    * ``recv_x_scales`` float32 ``[rows, hidden/scale_block]`` (fp8 only);
    * ``recv_topk_idx`` ``[rows, K]``, the input's int dtype (NON_EXPAND only);
    * ``recv_weights`` float32: ``[rows, K]`` for NON_EXPAND, ``[rows]`` for EXPAND (only if
      weights were given); ``recv_topk_weights`` is the same array;
    * ``recv_src`` int64 ``[rows]``: ``source_rank * max_tokens_per_rank + token``, -1 on padding;
    * ``recv_topk_slot`` int32 ``[rows]`` (EXPAND only).

    ``rows`` is ``num_recv_tokens`` for NON_EXPAND and ``num_expanded_rows`` for EXPAND.

    Counts: ``num_recv_tokens``, ``num_expanded_rows`` (ints); ``num_recv_tokens_per_expert``
    and ``num_recv_tokens_per_expert_aligned`` (int32 arrays ``[num_local_experts]``),
    ``num_recv_tokens_per_expert_list`` (the aligned counts as a list, DeepEP's name),
    ``rank_prefix`` (int32 ``[world_size + 1]``: rows ``rank_prefix[s]:rank_prefix[s + 1]``
    of a NON_EXPAND dispatch came from rank s). Also ``handle``, ``op_number``, ``layout`` and
    the op's timing: ``exec_ns`` (backend execution), ``queue_ns`` (submission to launch) and
    ``kernel_ns`` (GPU time of its kernels on the cuda backend, else 0).

    Lifetime: with the output arena (the default for NumPy arrays) the arrays are views of the
    arena, valid until ``handle`` is released and never after the group is left; with
    ``copy_outputs=True`` or ``use_arena=False`` they are ordinary arrays that live as long as
    they are referenced. For torch inputs the arrays are tensors (:mod:`epd.tensors`); the
    counts stay NumPy arrays.
    """

    def __init__(self, **fields):
        self.__dict__.update(fields)
        self.recv_topk_weights = self.recv_weights

    @property
    def num_rows(self):
        """Rows of the arrays: num_expanded_rows for EXPAND, num_recv_tokens for NON_EXPAND."""
        return self.num_expanded_rows if self.layout == EXPAND else self.num_recv_tokens

    def __iter__(self):
        """Unpacks like DeepEP: recv_x, recv_topk_idx, recv_topk_weights, list, handle."""
        x = self.recv_x if self.recv_x_scales is None else (self.recv_x, self.recv_x_scales)
        return iter((x, self.recv_topk_idx, self.recv_topk_weights,
                     self.num_recv_tokens_per_expert_list, self.handle))

    def __repr__(self):
        return "<epd.DispatchResult %s rows=%d tokens=%d handle=%d>" % (
            self.layout, self.num_rows, self.num_recv_tokens, self.handle.id)


class CombineResult(tuple):
    """What a combine returns: the pair ``(combined_x, combined_topk_weights)``, unpacked like
    a tuple, with the op's ``op_number``, ``num_tokens``, ``exec_ns``, ``queue_ns`` and
    ``kernel_ns`` (GPU time of its kernels on the cuda backend, else 0) as attributes."""

    def __new__(cls, combined_x, combined_topk_weights, **stats):
        self = tuple.__new__(cls, (combined_x, combined_topk_weights))
        self.__dict__.update(stats)
        return self

    @property
    def combined_x(self):
        return self[0]

    @property
    def combined_topk_weights(self):
        return self[1]

    def __reduce__(self):
        return (_combine_result, (self[0], self[1], dict(self.__dict__)))

    def __repr__(self):
        return "<epd.CombineResult tokens=%s exec_ns=%s kernel_ns=%s>" % (
            getattr(self, "num_tokens", "?"), getattr(self, "exec_ns", "?"),
            getattr(self, "kernel_ns", "?"))


def _combine_result(x, w, stats):
    return CombineResult(x, w, **stats)


class Future:
    """An op in flight (``async_op=True``). :meth:`wait` returns what the blocking call returns.

    The op's inputs are kept alive by the future until it completes. A future dropped without
    being waited on stays tracked by its client until the client closes: wait on it (or poll
    :meth:`done`) even when a stream waited for it, so that the op is freed.

    ``outputs`` (torch path only, else None): the op's output tensors, available at once —
    for a dispatch ``recv_x``, ``recv_x_scales``, ``recv_topk_idx``, ``recv_topk_weights``,
    ``recv_src``, ``recv_topk_slot`` at full capacity (the rows received are known after
    :meth:`wait`), for a combine ``combined_x`` and ``combined_topk_weights``. After
    :meth:`stream_wait` on a stream, work queued there may read them without a host wait.
    """

    def __init__(self, group, op_ptr, kind, staging, finish, outputs=None, device=None):
        self.group = group
        self.kind = kind
        self.outputs = outputs
        self.device = device
        self._op = op_ptr
        self._staging = staging
        self._finish = finish
        self._lock = threading.Lock()
        self._result = None
        self._error = None
        self._done = False

    def _complete(self, rc):
        lib = _lib.load()
        try:
            if rc < 0:
                self._error = make_error(rc, _lib.text(lib.epd_op_error(self._op)))
            else:
                try:
                    self._result = self._finish(self._op)
                except Exception as e:  # a result that cannot be read fails the future
                    self._error = e
        finally:
            lib.epd_op_free(self._op)
            self._op = None
            self._done = True
            self._staging.done()
            self._finish = None
            self.group.client._untrack(self)

    def _abandon(self):
        # The client closes under a pending op: leak the C op rather than touch a freed client.
        with self._lock:
            if self._done:
                return
            self._op = None
            self._done = True
            self._error = Unavailable("the client was closed before the %s completed" %
                                      self.kind)
            self._finish = None

    def wait(self, timeout=None):
        """Waits for the op; returns its result or raises its :class:`~epd.Error`.

        ``timeout`` in seconds (None: forever). When only the wait times out, raises
        :class:`~epd.Timeout` with ``op_pending = True``; the op goes on and may be waited on
        again.
        """
        if not self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            raise self._wait_timeout(timeout)
        try:
            if not self._done:
                ms = -1 if timeout is None else max(0, int(timeout * 1000))
                lib = _lib.load()
                rc = lib.epd_op_wait(self._op, ms)
                if rc == _lib.TIMEOUT and lib.epd_op_status(self._op) == _lib.UNAVAILABLE:
                    raise self._wait_timeout(timeout)
                self._complete(rc)
        finally:
            self._lock.release()
        if self._error is not None:
            raise self._error
        return self._result

    def _wait_timeout(self, timeout):
        e = Timeout("the %s did not complete within %.3f s (still pending)" %
                    (self.kind, timeout))
        e.op_pending = True
        return e

    def done(self):
        """True when the op has completed (polls without blocking)."""
        if self._done:
            return True
        try:
            self.wait(0)
        except Timeout as e:
            if e.op_pending:
                return False
        except Exception:
            pass
        return True

    def stream_wait(self, stream=None):
        """Makes a CUDA stream wait for the op on the GPU, without blocking the host.

        ``stream`` is a ``cudaStream_t`` as an int, or an object with ``cuda_stream`` (torch)
        or ``ptr`` (CuPy); None means the current torch stream of the op's device (torch CUDA
        tensors only). Uses ``epd_op_stream_wait``; the host still has to :meth:`wait` the
        future to read the result and free the op. An op that already completed needs no
        wait and returns at once.

        Raises :class:`StreamWaitUnavailable` (both :class:`~epd.Unavailable` and
        NotImplementedError) where stream ordering is not available: on the host backend,
        with a libepd built without CUDA, or one that predates the call.
        """
        fn = _lib.load().optional.get("epd_op_stream_wait")
        if fn is None:
            raise StreamWaitUnavailable("this libepd has no epd_op_stream_wait; use wait()")
        if stream is None:
            if self.device is None:
                raise InvalidArgument("stream_wait() without a stream needs an op on torch "
                                      "CUDA tensors")
            stream = tensors.current_stream(self.device)
        handle = tensors.stream_handle(stream)
        with self._lock:
            if self._done:
                return
            with tensors.on_device(self.device):
                rc = fn(self._op, ctypes.c_void_p(handle))
        if rc == _lib.UNAVAILABLE:
            raise StreamWaitUnavailable(
                "stream_wait needs CUDA (host backend or libepd without CUDA): %s; use wait()"
                % self.group.client.last_error)
        check(self.group.client, rc)

    def current_stream_wait(self):
        """:meth:`stream_wait` on torch's current stream of the op's device (DeepEP's name)."""
        self.stream_wait(None)

    def __repr__(self):
        return "<epd.Future %s %s>" % (self.kind, "done" if self._done else "pending")


class Group:
    """One rank's membership of an EP group (``epd_group_create`` / ``epd_group_join``).

    Use :meth:`create` (one rank, usually 0, with the group's shape) and :meth:`join` (the
    others). :meth:`leave` (or ``with``, or closing the client) unbinds the rank.
    """

    def __init__(self, client, ptr, device=0):
        self.client = client
        self._ptr = ptr
        self.device = int(device)  # the daemon device index this rank was bound with
        lib = _lib.load()
        cfg = lib.epd_group_config(ptr).contents
        self.id = lib.epd_group_id(ptr)
        self.rank = lib.epd_group_rank(ptr)
        self.world_size = cfg.world_size
        self.num_experts = cfg.num_experts
        self.num_local_experts = cfg.num_experts // max(1, cfg.world_size)
        self.hidden = cfg.hidden
        self.max_tokens_per_rank = cfg.max_tokens_per_rank
        self.max_topk = cfg.max_topk
        self.dtype_code = cfg.dispatch_dtype
        self.dtype = "fp8" if cfg.dispatch_dtype == _lib.DTYPE_FP8_E4M3 else "bf16"
        self.scale_block = cfg.scale_block or 128
        self.op_timeout_ms = cfg.op_timeout_ms
        self.arena_bytes = cfg.arena_bytes
        self.execution = "client" if cfg.execution == _lib.EXECUTION_CLIENT else "daemon"
        self.max_expert_alignment = cfg.max_expert_alignment
        self.expert_block_rows = cfg.expert_block_rows
        self.quantize = bool(cfg.quantize)
        self.num_handle_slots = cfg.num_handle_slots
        self.sms_per_rank = cfg.sms_per_rank
        self.recv_rows = cfg.recv_rows
        self._cx = None  # epd.cx.CxState of a client-executed group, made on first use
        nbytes = ctypes.c_uint64()
        addr = lib.epd_group_arena(ptr, ctypes.byref(nbytes))
        self._arena = None
        self._arena_keep = None
        if addr and nbytes.value:
            region_id = client._region_of_pointer(addr, nbytes.value)
            self._arena = (addr, nbytes.value, region_id)
            client._add_range(addr, nbytes.value, region_id)
        client._groups.add(self)

    # ---- membership ----

    @classmethod
    def _enter(cls, client, name, secret, rank, device, device_uuid, config):
        client._check_open()
        lib = _lib.load()
        if not isinstance(device, numbers.Integral) or isinstance(device, bool):
            # A torch device ("cuda:1"): the daemon device holding that GPU, by UUID.
            if tensors.torch_module() is None:
                raise InvalidArgument("device must be the daemon's device index, not %r" %
                                      (device,))
            device = tensors.daemon_device(client, device)
        sec = _secret_bytes(secret)
        sec_buf = ctypes.create_string_buffer(sec, len(sec)) if sec else None
        args = _lib.GroupArgs(
            size=ctypes.sizeof(_lib.GroupArgs), name=name.encode(),
            secret=ctypes.cast(sec_buf, ctypes.c_void_p) if sec_buf else None,
            secret_len=len(sec), rank=int(rank), device=int(device),
            device_uuid=device_uuid.encode() if device_uuid else None,
            config=ctypes.pointer(config) if config is not None else None)
        ptr = ctypes.c_void_p()
        fn = lib.epd_group_create if config is not None else lib.epd_group_join
        check(client, fn(client._ptr, ctypes.byref(args), ctypes.byref(ptr)))
        return cls(client, ptr.value, device)

    @classmethod
    def create(cls, client, name, secret, rank, *, world_size, num_experts, hidden,
               max_tokens_per_rank, max_topk, dtype="bf16", scale_block=0, arena_bytes=None,
               op_timeout_ms=0, device=0, device_uuid=None, execution="daemon",
               max_expert_alignment=0, expert_block_rows=0, quantize=False, num_handle_slots=0,
               sms_per_rank=0, recv_rows=0):
        """Creates group ``name`` and binds ``rank`` of it to ``client``.

        ``secret`` (bytes or str) is what the other ranks must present to join. ``dtype`` is
        'bf16' or 'fp8' (e4m3 with one fp32 scale per ``scale_block`` channels, default 128).
        ``arena_bytes`` is each rank's output arena (None: the daemon's default);
        ``op_timeout_ms`` how long an op waits for late ranks (0: the daemon's default).
        ``device`` / ``device_uuid`` name the rank's device: the daemon's device index, or a
        torch device (``"cuda:1"``), which names the daemon device holding that GPU.

        ``execution`` is 'daemon' (the daemon runs each op: :meth:`dispatch`, :meth:`combine`)
        or 'client' (each rank runs its ops itself: :meth:`cx_dispatch`, :meth:`cx_combine`;
        docs/client-execution.md). A client-executed group's buffers are sized at creation
        for ``max_expert_alignment`` (the largest ``expert_alignment`` an op uses, 0: 1),
        ``expert_block_rows`` (the largest C of fixed expert blocks, docs/semantics.md §2.6;
        0: none), ``quantize`` (a bf16 group whose ops may send fp8 rows, §2.7),
        ``num_handle_slots`` (0: 2, at most 8), ``recv_rows`` (rows of each rank's receive
        area, 0: the most one op of the shape can send a rank; an op that needs more ends
        ``CapacityExceeded``; the group's ``recv_rows`` reads back the rows in use) and, on
        CUDA, ``sms_per_rank`` (0: the backend's).
        """
        if execution not in ("daemon", "client"):
            raise InvalidArgument("execution must be 'daemon' or 'client', not %r" %
                                  (execution,))
        cfg = _lib.GroupConfig(
            size=ctypes.sizeof(_lib.GroupConfig), world_size=world_size,
            num_experts=num_experts, hidden=hidden, max_tokens_per_rank=max_tokens_per_rank,
            max_topk=max_topk, dispatch_dtype=epd_dtype(dtype), scale_block=scale_block,
            op_timeout_ms=op_timeout_ms, arena_bytes=arena_bytes or 0,
            execution=_lib.EXECUTION_CLIENT if execution == "client" else _lib.EXECUTION_DAEMON,
            max_expert_alignment=max_expert_alignment, expert_block_rows=expert_block_rows,
            quantize=int(bool(quantize)), num_handle_slots=num_handle_slots,
            sms_per_rank=sms_per_rank, recv_rows=recv_rows)
        return cls._enter(client, name, secret, rank, device, device_uuid, cfg)

    @classmethod
    def join(cls, client, name, secret, rank, *, device=0, device_uuid=None, retry_timeout=0.0):
        """Joins group ``name`` as ``rank``.

        ``retry_timeout`` (seconds) keeps retrying while the group does not exist yet, for
        workers that start before the creator; 0 tries once.
        """
        deadline = time.monotonic() + retry_timeout
        while True:
            try:
                return cls._enter(client, name, secret, rank, device, device_uuid, None)
            except NotFound:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.005)

    @property
    def closed(self):
        """True once the rank has left the group."""
        return not self._ptr

    def leave(self):
        """Unbinds the rank and frees the group object (idempotent).

        The daemon releases this rank's handles; arena views of this group must not be used
        afterwards (the arena is unmapped).
        """
        ptr, self._ptr = self._ptr, None
        if not ptr:
            return
        self.client._groups.discard(self)
        if self._arena:
            self.client._forget_range(self._arena[2])
        if self.client._ptr:
            rc = _lib.load().epd_group_leave(ptr)
            if rc < 0:
                raise make_error(rc, self.client.last_error)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.leave()

    def __del__(self):
        try:
            if self._ptr and self.client._ptr:
                self.leave()
        except Exception:
            pass

    def _check(self):
        if not self._ptr:
            raise Unavailable("the group was left")
        self.client._check_open()

    @property
    def config(self):
        """The group's shape as the daemon holds it, as a dict."""
        return {k: getattr(self, k) for k in (
            "world_size", "num_experts", "hidden", "max_tokens_per_rank", "max_topk", "dtype",
            "scale_block", "op_timeout_ms", "arena_bytes")}

    # ---- dispatch ----

    def dispatch(self, x, topk_idx=None, topk_weights=None, x_scales=None, handle=None,
                 expert_alignment=None, layout=None, zero_padding=None, async_op=False,
                 use_arena=None, copy_outputs=False, recv_capacity=None, out=None, stream=None):
        """Sends each token to the ranks of its selected experts (docs/semantics.md section 2).

        ``x`` ``[N, hidden]``: bf16 bits as uint16 (floats are rounded to bf16), or for an fp8
        group the e4m3 bytes as uint8 with ``x_scales`` float32 ``[N, hidden/scale_block]``.
        ``topk_idx`` ``[N, K]`` int32/int64 expert ids, -1 for none; ``topk_weights`` float32
        ``[N, K]``, optional. ``handle``: a :class:`Handle` for a cached dispatch (same routing,
        no ``topk_idx``; new weights allowed). ``expert_alignment`` (default 1), ``layout``
        ('non_expand' default, or 'expand') and ``zero_padding`` (EXPAND only) default to the
        handle's for a cached dispatch.

        NumPy outputs go to the rank's output arena (``use_arena`` None or True) and come back as
        views of it (``copy_outputs=True`` copies them). ``use_arena=False`` places them in a
        region the binding allocates for this dispatch, ``recv_capacity`` rows (default: the
        worst case, docs/semantics.md section 5).

        torch tensors (:mod:`epd.tensors`): with a CUDA ``x`` the outputs are device tensors of
        ``recv_capacity`` rows (default the worst case), or the caller's tensors given in
        ``out`` (a dict keyed ``recv_x``, ``recv_x_scales``, ``recv_topk_idx``,
        ``recv_topk_weights``, ``recv_src``, ``recv_topk_slot``; its ``recv_x`` rows set the
        capacity), and the results are views sliced to the rows received; ``use_arena=True``
        uses the arena and copies to the device. The op waits for the work queued on ``stream``
        (default: the current stream of ``x``'s device) without a host synchronisation. CPU
        tensors use the arena by default, as NumPy arrays do.

        Returns a :class:`DispatchResult`, or with ``async_op=True`` a :class:`Future` of one.
        """
        self._check()
        if tensors.is_tensor(x):
            return tensors.dispatch(self, x, topk_idx, topk_weights, x_scales, handle,
                                    expert_alignment, layout, zero_padding, async_op, use_arena,
                                    copy_outputs, recv_capacity, out, stream)
        if out is not None:
            raise InvalidArgument("out= is for torch tensors; NumPy outputs use the arena or "
                                  "use_arena=False")
        use_arena = True if use_arena is None else use_arena
        edt = self.dtype_code
        x = _dims(_payload(x, edt, "x"), "x")
        num_tokens = x.shape[0]
        layout, layout_code, expert_alignment, zero_padding = self._routing_options(
            handle, topk_idx, layout, expert_alignment, zero_padding)

        st = Staging(self.client)
        sx = st.input(x, edt)
        ss = sk = sw = None
        if x_scales is not None:
            ss = st.input(_dims(_float32(x_scales, "x_scales"), "x_scales"), _lib.DTYPE_FP32)
        if topk_idx is not None:
            tk = _dims(_topk(topk_idx), "topk_idx")
            topk_code = _lib.DTYPE_INT32 if tk.dtype == np.int32 else _lib.DTYPE_INT64
            num_topk = tk.shape[1] if tk.ndim == 2 else 0
            sk = st.input(tk, topk_code)
        else:
            topk_code, num_topk = handle.topk_dtype, handle.num_topk
        if topk_weights is not None:
            sw = st.input(_dims(_float32(topk_weights, "topk_weights"), "topk_weights"),
                          _lib.DTYPE_FP32)
        has_weights = topk_weights is not None
        st.build()

        args = _lib.DispatchArgs(size=ctypes.sizeof(_lib.DispatchArgs))
        args.num_tokens = num_tokens
        args.num_topk = num_topk
        args.x = sx["tensor"]
        if ss:
            args.scales = ss["tensor"]
        if sk:
            args.topk_idx = sk["tensor"]
        if sw:
            args.topk_weights = sw["tensor"]
        args.handle_id = handle.id if handle is not None else 0
        args.layout = layout_code
        args.expert_alignment = expert_alignment
        args.zero_padding = int(zero_padding)
        args.use_arena = int(bool(use_arena))
        outs = None
        if not use_arena:
            outs = self._client_outputs(args, layout, num_topk, topk_code, has_weights,
                                        expert_alignment, recv_capacity)
            st.keep.append(outs)

        def finish(op):
            return self._dispatch_result(op, layout, handle, num_tokens, num_topk, topk_code,
                                         has_weights, expert_alignment, zero_padding, outs,
                                         copy_outputs)

        return self._submit("dispatch", _lib.load().epd_dispatch_submit, args, st, finish,
                            async_op)

    def _routing_options(self, handle, topk_idx, layout, expert_alignment, zero_padding):
        """(layout name, layout code, alignment, zero_padding) of a dispatch; a cached dispatch
        defaults them to its handle's."""
        if handle is not None:
            if not isinstance(handle, Handle):
                raise InvalidArgument("handle must be the Handle of a dispatch")
            if topk_idx is not None:
                raise InvalidArgument("a cached dispatch (handle given) takes no topk_idx")
            layout = handle.layout if layout is None else layout
            expert_alignment = (handle.expert_alignment if expert_alignment is None
                                else expert_alignment)
            zero_padding = handle.zero_padding if zero_padding is None else zero_padding
        elif topk_idx is None:
            raise InvalidArgument("topk_idx is required unless a handle is given")
        layout_code = _layout_code(NON_EXPAND if layout is None else layout)
        layout = NON_EXPAND if layout_code == _lib.LAYOUT_NON_EXPAND else EXPAND
        expert_alignment = 1 if expert_alignment is None else int(expert_alignment)
        return layout, layout_code, expert_alignment, bool(zero_padding)

    def worst_case_rows(self, layout=NON_EXPAND, num_topk=None, expert_alignment=1):
        """The most rows a dispatch of this group can deliver to one rank (docs/semantics.md §5):
        ``world_size * max_tokens_per_rank`` for NON_EXPAND; for EXPAND that times
        ``min(num_topk, num_local_experts)`` plus the alignment padding of every local expert."""
        R, T, L = self.world_size, self.max_tokens_per_rank, self.num_local_experts
        if _layout_code(layout) == _lib.LAYOUT_EXPAND:
            k = self.max_topk if num_topk is None else num_topk
            return R * T * min(max(k, 1), L) + L * (max(int(expert_alignment), 1) - 1)
        return R * T

    def _output_specs(self, layout, num_topk, topk_code, has_weights, alignment, capacity):
        """[(C field name, shape, epd dtype)] of one dispatch's client-registered outputs."""
        H = self.hidden
        expand = layout == EXPAND
        if capacity is None:
            capacity = self.worst_case_rows(layout, num_topk, alignment)
        capacity = int(capacity)
        if capacity < 0:
            raise InvalidArgument("recv_capacity %d < 0" % capacity)
        fp8 = self.dtype_code == _lib.DTYPE_FP8_E4M3
        specs = [("recv_x", (capacity, H), self.dtype_code)]
        if fp8:
            specs.append(("recv_scales", (capacity, H // self.scale_block), _lib.DTYPE_FP32))
        if not expand:
            specs.append(("recv_topk_idx", (capacity, num_topk), topk_code))
        if has_weights:
            specs.append(("recv_weights", (capacity,) if expand else (capacity, num_topk),
                          _lib.DTYPE_FP32))
        specs.append(("recv_src", (capacity,), _lib.DTYPE_INT64))
        if expand:
            specs.append(("recv_topk_slot", (capacity,), _lib.DTYPE_INT32))
        return specs

    def _client_outputs(self, args, layout, num_topk, topk_code, has_weights, alignment,
                        capacity):
        """Allocates a region for one dispatch's outputs and points ``args`` at it."""
        specs = self._output_specs(layout, num_topk, topk_code, has_weights, alignment,
                                   capacity)
        total = sum((int(np.prod(s)) * NUMPY_DTYPE[d].itemsize + 127) // 64 * 64
                    for _, s, d in specs)
        region = self.client.region(max(total, 1))
        outs, off = {}, 0
        for name, shape, d in specs:
            arr = region.array(shape, NUMPY_DTYPE[d], off)
            off += (arr.nbytes + 127) // 64 * 64
            outs[name] = arr
            setattr(args, name, describe(arr, d, region.region_id,
                                         arr.ctypes.data - region.address))
        # The arrays own the mapping; the registration goes when they do.
        return outs

    def _arena_view(self, ptr, tensor, dtype_code):
        if not ptr or not tensor.region_id:
            return None
        shape = tuple(tensor.sizes[i] for i in range(tensor.ndim))
        dt = NUMPY_DTYPE.get(tensor.dtype, NUMPY_DTYPE[dtype_code])
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if nbytes == 0:
            return np.empty(shape, dt)
        buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
        buf.group = self  # a view keeps the group (and so the arena mapping) alive
        return np.frombuffer(buf, dtype=dt).reshape(shape)

    def _dispatch_result(self, op, layout, handle, num_tokens, num_topk, topk_code, has_weights,
                         alignment, zero_padding, outs, copy_outputs, convert=None):
        lib = _lib.load()
        dr = _lib.DispatchResult()
        check(self.client, lib.epd_op_dispatch_result(op, ctypes.byref(dr)))
        L, R = dr.num_local_experts, dr.world_size
        per_expert = np.ctypeslib.as_array(dr.num_recv_tokens_per_expert, (L,)).copy() \
            if L else np.zeros(0, np.int32)
        aligned = np.ctypeslib.as_array(dr.num_recv_tokens_per_expert_aligned, (L,)).copy() \
            if L else np.zeros(0, np.int32)
        prefix = np.ctypeslib.as_array(dr.rank_prefix, (R + 1,)).copy() \
            if R else np.zeros(1, np.int32)
        rows = dr.num_expanded_rows if layout == EXPAND else dr.num_recv_tokens
        if handle is None:
            handle = Handle(self, dr.handle_id, layout, num_tokens, num_topk, topk_code,
                            has_weights, rows, alignment, zero_padding)
            handle.rank_prefix = prefix
        else:
            handle.has_weights = has_weights  # a cached dispatch replaces the weights
        names = {"recv_x": ("recv_x", self.dtype_code),
                 "recv_x_scales": ("recv_scales", _lib.DTYPE_FP32),
                 "recv_topk_idx": ("recv_topk_idx", topk_code),
                 "recv_weights": ("recv_weights", _lib.DTYPE_FP32),
                 "recv_src": ("recv_src", _lib.DTYPE_INT64),
                 "recv_topk_slot": ("recv_topk_slot", _lib.DTYPE_INT32)}
        arrays = {}
        for field, (cname, code) in names.items():
            if outs is not None:
                arr = outs.get(cname)
                arr = arr[:rows] if arr is not None else None
            else:
                arr = self._arena_view(getattr(dr, cname + "_ptr"), getattr(dr, cname), code)
            if arr is not None and convert is not None:
                arr = convert(cname, arr)
            elif arr is not None and copy_outputs:
                arr = arr.copy()
            arrays[field] = arr
        return DispatchResult(
            layout=layout, handle=handle, op_number=dr.op_number, exec_ns=dr.exec_ns,
            queue_ns=dr.queue_ns, kernel_ns=dr.kernel_ns, num_recv_tokens=dr.num_recv_tokens,
            num_expanded_rows=dr.num_expanded_rows, num_recv_tokens_per_expert=per_expert,
            num_recv_tokens_per_expert_aligned=aligned,
            num_recv_tokens_per_expert_list=[int(v) for v in aligned], rank_prefix=prefix,
            **arrays)

    # ---- combine ----

    def combine(self, x, handle, bias=None, apply_weights=False, async_op=False, out=None,
                stream=None, recv_weights=None, source_weights=None):
        """Sends rows back to their sources and reduces them (docs/semantics.md section 3).

        ``x`` is the experts' output in the dispatch layout of ``handle``: ``[rows, hidden]``
        bf16 bits as uint16 (floats are rounded to bf16). It may be the dispatch's own
        ``recv_x`` arena view, overwritten in place (no copy). ``bias`` is None, one array or
        a tuple of up to two arrays ``[N, hidden]`` added on this (source) rank.
        ``apply_weights`` multiplies each row by its selection's weight w(t, k) (EXPAND only):
        ``source_weights`` when given, else the dispatch's. ``out`` optionally receives
        ``combined_x`` (an array from :func:`epd.empty` avoids a copy).

        ``recv_weights`` (NON_EXPAND, optional): float32 ``[rows, K]``, this rank's weights per
        received row, for example its ``recv_topk_weights``, possibly changed. Every rank gives
        them or none does (a rank without rows passes a ``[0, K]`` array);
        ``combined_topk_weights`` is then
        their sum over the ranks each token went to, in ascending rank (DeepEP's
        ``combine(topk_weights=...)``), even when the dispatch carried no weights.
        ``source_weights`` (optional): float32 ``[N, K]``, this rank's own weights for
        ``apply_weights``, so that a dispatch without weights can be combined weighted.

        Returns a :class:`CombineResult`, the pair ``(combined_x, combined_topk_weights)``:
        uint16 ``[N, hidden]`` and float32 ``[N, K]``: the reduction of ``recv_weights`` when
        given, else the weights the dispatch carried with 0 where ``topk_idx`` was -1 (None when
        the dispatch carried none), with the op's timing as attributes. With ``async_op=True``,
        a :class:`Future` of that.

        torch tensors (:mod:`epd.tensors`): ``combined_x`` is a bf16 tensor on ``x``'s device
        (``out`` if given), ``combined_topk_weights`` a float32 one; a CUDA combine waits for
        the work queued on ``stream`` (default: the current stream) before reading ``x``.
        """
        self._check()
        if not isinstance(handle, Handle):
            raise InvalidArgument("combine needs the Handle of a dispatch")
        if tensors.is_tensor(x):
            return tensors.combine(self, x, handle, bias, apply_weights, async_op, out, stream,
                                   recv_weights, source_weights)
        y = _dims(_payload(x, _lib.DTYPE_BF16, "x"), "x")
        if bias is None:
            biases = []
        elif isinstance(bias, (tuple, list)):
            biases = [b for b in bias if b is not None]
        else:
            biases = [bias]
        if len(biases) > 2:
            raise InvalidArgument("at most 2 biases, not %d" % len(biases))
        n, H = handle.num_tokens, self.hidden
        st = Staging(self.client)
        sy = st.input(y, _lib.DTYPE_BF16)
        sb = [st.input(_dims(_payload(b, _lib.DTYPE_BF16, "bias"), "bias"), _lib.DTYPE_BF16)
              for b in biases]
        out_arr = where = None
        if out is not None:
            out_arr = np.asarray(out)
            if out_arr.shape != (n, H) or out_arr.dtype.itemsize != 2 or \
                    out_arr.dtype.kind == "f":
                raise InvalidArgument("out must be uint16 [%d, %d]" % (n, H))
            where = self.client._locate_range(out_arr.view(np.uint16))
        if out_arr is not None and where is not None:
            sc = st.input(out_arr.view(np.uint16), _lib.DTYPE_BF16)
        else:
            sc = st.output((n, H), np.uint16, _lib.DTYPE_BF16)
        srw = ssw = None
        if recv_weights is not None:
            srw = st.input(_dims(_float32(recv_weights, "recv_weights"), "recv_weights"),
                           _lib.DTYPE_FP32)
        if source_weights is not None:
            ssw = st.input(_dims(_float32(source_weights, "source_weights"), "source_weights"),
                           _lib.DTYPE_FP32)
        sw = None
        if handle.has_weights or recv_weights is not None:
            sw = st.output((n, handle.num_topk), np.float32, _lib.DTYPE_FP32)
        st.build()
        args = _lib.CombineArgs(size=ctypes.sizeof(_lib.CombineArgs))
        args.handle_id = handle.id
        args.y = sy["tensor"]
        args.apply_weights = int(bool(apply_weights))
        args.num_bias = len(sb)
        for i, s in enumerate(sb):
            args.bias[i] = s["tensor"]
        args.combined = sc["tensor"]
        if sw:
            args.combined_topk_weights = sw["tensor"]
        if srw:
            args.recv_weights = srw["tensor"]
        if ssw:
            args.source_weights = ssw["tensor"]

        def finish(op):
            res = _lib.CombineResult()
            check(self.client, _lib.load().epd_op_combine_result(op, ctypes.byref(res)))
            combined = sc["array"]
            if out_arr is not None:
                if where is None:
                    out_arr.view(np.uint16)[...] = combined
                combined = out_arr
            else:
                combined = combined.copy()
            weights = sw["array"].copy() if sw else None
            return CombineResult(combined, weights, op_number=res.op_number,
                                 num_tokens=res.num_tokens, exec_ns=res.exec_ns,
                                 queue_ns=res.queue_ns, kernel_ns=res.kernel_ns)

        return self._submit("combine", _lib.load().epd_combine_submit, args, st, finish,
                            async_op)

    # ---- client-executed ops (epd.cx, docs/client-execution.md) ----

    def cx_dispatch(self, x, topk_idx=None, topk_weights=None, x_scales=None, handle=0,
                    cached=False, layout=NON_EXPAND, expert_alignment=1, zero_padding=False,
                    expert_block_rows=0, quantize=False, capacity_rows=0, stream=None,
                    round_scale=False, scale_format="fp32"):
        """This rank's dispatch in a client-executed group (docs/semantics.md §2).

        ``x`` ``[N, hidden]`` (bf16 bits as uint16 or floats rounded to bf16; an fp8 group's
        e4m3 bytes with ``x_scales``), ``topk_idx`` ``[N, K]``, ``topk_weights`` ``[N, K]``
        as in :meth:`dispatch`. ``handle`` is the slot the dispatch fills; ``cached=True``
        reuses that slot's routing (§2.4, no ``topk_idx``). ``expert_block_rows`` C > 0
        (EXPAND): fixed expert blocks of C rows (§2.6). ``quantize`` (a bf16 group created
        with it): fp8 rows and scales (§2.7); with it ``round_scale=True`` makes every scale a
        power of two (x times 2^-e, ``recv_x_scales`` 2^e) and ``scale_format="ue8m0"`` (which
        needs ``round_scale``) returns the scales as uint8 ``[rows, hidden/128]`` bytes e + 127,
        four to a little-endian int32 word. ``capacity_rows``: the rows this rank accepts
        (0: its receive area).

        Host backend: NumPy arrays, the op runs now; cuda backend: torch CUDA tensors, the op
        is queued on ``stream`` (default: the current stream of ``x``'s device) and may be
        captured in a CUDA graph. Returns a :class:`epd.cx.CxDispatchResult` of views of the
        receive area; failures raise the op's :class:`~epd.Error` (host) or are read later
        with :meth:`cx_status` (cuda).
        """
        return cx.dispatch(self, x, topk_idx, topk_weights, x_scales, handle, cached, layout,
                           expert_alignment, zero_padding, expert_block_rows, quantize,
                           capacity_rows, stream, round_scale, scale_format)

    def cx_y(self, handle=0, device=None):
        """``(y, y_weights)``: views of this rank's y area laid out as the slot's dispatch,
        bf16 ``[rows, hidden]`` and float32 ``[rows, K]``. The expert writes its output there
        (and combine's ``recv_weights``), so that :meth:`cx_combine` copies nothing. On cuda,
        ``device`` is the torch device and the views have the capacity's rows."""
        return cx.y_view(self, handle, device)

    def cx_combine(self, y=None, handle=0, recv_weights=None, apply_weights=False,
                   source_weights=None, bias=None, out=None, stream=None):
        """This rank's combine in a client-executed group (docs/semantics.md §3).

        ``y`` is the experts' output in the layout of the slot's dispatch, copied into the y
        area unless it is the :meth:`cx_y` view (None: already there). ``recv_weights``
        (NON_EXPAND) ``[rows, K]``, ``apply_weights`` and ``source_weights`` ``[N, K]`` (EXPAND),
        ``bias`` (up to two ``[N, hidden]``) and ``out`` as in :meth:`combine`. Returns a
        :class:`CombineResult` ``(combined_x, combined_topk_weights)``; on cuda the tensors are
        written when ``stream`` reaches the op.
        """
        return cx.combine(self, y, handle, recv_weights, apply_weights, source_weights, bias,
                          out, stream)

    def cx_status(self):
        """The status of this rank's last client-executed op (a dict: op, status,
        status_name, message)."""
        return cx.cx_status(self)

    def cx_counts(self, handle=0):
        """The counts (docs/semantics.md §2.3) of the slot's last dispatch, as a dict."""
        return cx.cx_counts(self, handle)

    # ---- common ----

    def _submit(self, kind, fn, args, staging, finish, async_op, outputs=None, device=None):
        op = ctypes.c_void_p()
        try:
            check(self.client, fn(self._ptr, ctypes.byref(args), ctypes.byref(op)))
        except BaseException:
            staging.done()
            raise
        fut = Future(self, op.value, kind, staging, finish, outputs=outputs, device=device)
        self.client._track(fut)
        if async_op:
            return fut
        return fut.wait()

    def __repr__(self):
        return "<epd.Group id=%d rank=%d/%d %s%s>" % (
            self.id, self.rank, self.world_size, self.dtype, " left" if self.closed else "")
