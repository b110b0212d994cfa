"""The connection to epd, shared-memory regions, and how NumPy arrays become epd tensors.

A :class:`Client` is one connection to the daemon (``epd_client_connect``). Tensors never travel
through the socket: every input and output of an op lives in shared memory that the daemon maps
too, a *region*. The binding gets NumPy arrays there in two ways:

* :func:`empty` / :meth:`Client.empty` allocate an array straight in a new region (a memfd
  registered with the daemon). Passing such an array, or a view of it, to an op costs no copy.
* Any other array is copied into a *staging* region the client caches and reuses; the copy is
  the only cost.

Arrays from :func:`empty` stay valid memory for as long as Python references them, whatever
happens to the region's registration or the connection: the mapping belongs to Python (an
``mmap`` object), not to libepd. The region is unregistered from the daemon when it is released
explicitly (:meth:`Region.release`, ``with``), when the last array over it is garbage collected,
or when the client closes. After that the array is an ordinary array: passing it to an op copies
it through staging.

torch tensors (CPU and CUDA) are described by :mod:`epd.tensors`; CUDA memory is registered with
the daemon per allocation (:meth:`Client.register_device`) and stays registered until
:meth:`Client.release_device_memory` or the client's close. :meth:`Client.device_alloc` gives
GPU memory that the daemon's kernels reach at full speed (:class:`DeviceAllocation`).

Thread safety: a client may be used from several threads (libepd serialises calls on one client;
the binding's own tables have a lock). ctypes releases the GIL during every libepd call.
"""

import bisect
import ctypes
import mmap
import os
import threading
import weakref

import numpy as np

from . import _lib
from .errors import InvalidArgument, Unavailable, make_error

#: Names accepted wherever the binding takes an epd dtype.
_DTYPE_NAMES = {
    "bf16": _lib.DTYPE_BF16, "bfloat16": _lib.DTYPE_BF16,
    "fp8": _lib.DTYPE_FP8_E4M3, "fp8_e4m3": _lib.DTYPE_FP8_E4M3, "e4m3": _lib.DTYPE_FP8_E4M3,
    "float8_e4m3fn": _lib.DTYPE_FP8_E4M3,
    "fp32": _lib.DTYPE_FP32, "float32": _lib.DTYPE_FP32,
    "int32": _lib.DTYPE_INT32, "int64": _lib.DTYPE_INT64,
}

#: The NumPy dtype that carries each epd dtype (bf16 as its bits, fp8 as its bytes).
NUMPY_DTYPE = {
    _lib.DTYPE_BF16: np.dtype(np.uint16),
    _lib.DTYPE_FP8_E4M3: np.dtype(np.uint8),
    _lib.DTYPE_FP32: np.dtype(np.float32),
    _lib.DTYPE_INT32: np.dtype(np.int32),
    _lib.DTYPE_INT64: np.dtype(np.int64),
}

_ALIGN = 64
_STAGING_MIN_BYTES = 1 << 20
_STAGING_KEEP = 4


def epd_dtype(value):
    """Converts a dtype name ("bf16", "fp8", ...) or an ``epd_dtype`` number to the number."""
    if isinstance(value, int):
        if value in NUMPY_DTYPE:
            return value
    elif isinstance(value, str) and value.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.lower()]
    raise InvalidArgument("unknown dtype %r (use 'bf16' or 'fp8')" % (value,))


def numpy_dtype(dtype):
    """The NumPy dtype for ``dtype``: an epd dtype name/number ('bf16' -> uint16) or a NumPy one."""
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        return NUMPY_DTYPE[_DTYPE_NAMES[dtype.lower()]]
    if isinstance(dtype, int) and not isinstance(dtype, bool) and dtype in NUMPY_DTYPE:
        return NUMPY_DTYPE[dtype]
    return np.dtype(dtype)


def _align(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def check(client, rc):
    """Raises the epd exception for a negative status, with the client's last message."""
    if rc < 0:
        msg = _lib.text(_lib.load().epd_client_last_error(client._ptr)) if client._ptr else ""
        raise make_error(rc, msg)
    return rc


def _release_registration(client_ref, region_id):
    """Finalizer of a region's mapping: unregisters it if the client is still open."""
    client = client_ref()
    if client is None:
        return
    client._forget_range(region_id)
    if client._ptr:
        _lib.load().epd_region_release(client._ptr, region_id)


class Region:
    """A host shared-memory region (memfd) registered with the daemon.

    ``Region(client, nbytes)`` creates, maps and registers ``nbytes`` of zeroed memory;
    :meth:`array` hands out NumPy views of it. ``with Region(...) as r:`` releases the
    registration on exit; the views stay valid memory (see the module docstring).
    """

    def __init__(self, client, nbytes):
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise InvalidArgument("a region needs at least one byte, not %d" % nbytes)
        client._check_open()
        lib = _lib.load()
        page = mmap.PAGESIZE
        size = (nbytes + page - 1) // page * page
        fd = os.memfd_create("epd-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
            self._bytes = np.frombuffer(mm, dtype=np.uint8)
            region_id = ctypes.c_uint64()
            check(client, lib.epd_region_register_fd(
                client._ptr, _lib.REGION_HOST_MEMFD, fd, size, 0,
                ctypes.c_void_p(self._bytes.ctypes.data), ctypes.byref(region_id)))
        finally:
            os.close(fd)
        self.client = client
        self.region_id = region_id.value
        self.address = self._bytes.ctypes.data
        self.nbytes = size
        # Unregister when the mapping dies (the region object and every array over it).
        self._finalizer = weakref.finalize(mm, _release_registration, weakref.ref(client),
                                           self.region_id)
        self._finalizer.atexit = False  # the connection's close releases it at exit
        client._add_range(self.address, size, self.region_id, self._finalizer)

    @property
    def released(self):
        """True once the region is no longer registered with the daemon."""
        return not self._finalizer.alive

    def array(self, shape, dtype, offset=0):
        """A C-contiguous NumPy view of ``shape`` and ``dtype`` at byte ``offset``.

        ``dtype`` is a NumPy dtype or an epd dtype name ('bf16' gives uint16, 'fp8' uint8).
        """
        dt = numpy_dtype(dtype)
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        end = offset + count * dt.itemsize
        if offset < 0 or offset % dt.alignment or end > self.nbytes:
            raise InvalidArgument("%d bytes at offset %d do not fit the %d-byte region" %
                                  (count * dt.itemsize, offset, self.nbytes))
        return self._bytes[offset:end].view(dt).reshape(shape)

    def release(self):
        """Unregisters the region from the daemon now (idempotent). Views stay valid memory."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class _CudaArrayInterface:
    """``__cuda_array_interface__`` (version 3) of bytes in a :class:`DeviceAllocation`, for
    ``torch.as_tensor``. The tensor keeps this object, and with it the allocation object (not
    the memory: see :class:`DeviceAllocation`)."""

    def __init__(self, alloc, address, nbytes):
        self.alloc = alloc
        self.__cuda_array_interface__ = {
            "version": 3, "shape": (nbytes,), "typestr": "|u1", "data": (address, False),
            "strides": None,
        }


class DeviceAllocation:
    """GPU memory from ``epd_device_alloc``, registered with the daemon as one region.

    Made by :meth:`Client.device_alloc`. The memory is a cuMem allocation that the daemon
    imports from a POSIX fd and maps itself, so its kernels reach it at full speed; memory from
    PyTorch's default allocator (cudaMalloc) is opened through legacy CUDA IPC, measured about
    2x slower in the daemon's kernels on an H200. Tensors made by :meth:`tensor` are passed to
    ops in place, with no registration round trip.

    Attributes: ``ptr`` (the device address, an int), ``nbytes`` (as asked; the allocation is
    rounded up to the device's granularity), ``region_id``, ``device`` (the CUDA device
    ordinal), ``freed``.

    The memory is freed by :meth:`free`, at the end of a ``with`` block, or when the client
    closes, never by garbage collection: tensors over it do not keep it allocated and must not
    be used once it is freed. Contents are uninitialised.
    """

    def __init__(self, client, nbytes, device=0):
        nbytes = int(nbytes)
        device = int(device)
        if nbytes <= 0:
            raise InvalidArgument("device_alloc needs at least one byte, not %d" % nbytes)
        if device < 0:
            raise InvalidArgument("device must be a CUDA device ordinal, not %d" % device)
        client._check_open()
        lib = _lib.load()
        fn = lib.optional.get("epd_device_alloc")
        if fn is None or lib.optional.get("epd_device_free") is None:
            raise Unavailable("this libepd (%s) has no epd_device_alloc; rebuild it" % lib.path)
        ptr = ctypes.c_void_p()
        region_id = ctypes.c_uint64()
        check(client, fn(client._ptr, device, nbytes, ctypes.byref(ptr),
                         ctypes.byref(region_id)))
        self.client = client
        self.ptr = ptr.value
        self.nbytes = nbytes
        self.region_id = region_id.value
        self.device = device
        self.freed = False
        with client._lock:
            client._device_allocs[self.ptr] = self

    def tensor(self, shape, dtype=None, offset=0):
        """A torch tensor of ``shape`` and ``dtype`` (default ``torch.uint8``) over this
        memory at byte ``offset``, C-contiguous, on ``cuda:<device>``; no copy. Needs torch
        imported by the program."""
        from . import tensors
        torch = tensors.torch_module()
        if torch is None:
            raise Unavailable("DeviceAllocation.tensor needs torch: import torch first")
        if self.freed:
            raise InvalidArgument("the device allocation at 0x%x was freed" % self.ptr)
        dtype = torch.uint8 if dtype is None else dtype
        shape = tuple(int(n) for n in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        item = torch.empty(0, dtype=dtype).element_size()
        count = 1
        for n in shape:
            if n < 0:
                raise InvalidArgument("negative size in shape %s" % (shape,))
            count *= n
        offset = int(offset)
        if offset < 0 or offset % item or offset + count * item > self.nbytes:
            raise InvalidArgument("%d bytes of %s at offset %d do not fit the %d-byte allocation"
                                  % (count * item, dtype, offset, self.nbytes))
        # Described as bytes (the interface has no bf16 or fp8 type string), then viewed.
        raw = torch.as_tensor(_CudaArrayInterface(self, self.ptr + offset, count * item),
                              device="cuda:%d" % self.device)
        return raw.view(dtype).view(shape)

    def free(self):
        """Releases the region and frees the memory (``epd_device_free``; idempotent)."""
        client = self.client
        with client._lock:
            if self.freed:
                return
            self.freed = True
            client._device_allocs.pop(self.ptr, None)
        if client._ptr:
            check(client, _lib.load().epd_device_free(client._ptr, ctypes.c_void_p(self.ptr)))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def __repr__(self):
        return "<epd.DeviceAllocation 0x%x %d bytes cuda:%d region %d%s>" % (
            self.ptr, self.nbytes, self.device, self.region_id, " freed" if self.freed else "")


class _Lease:
    """A staging region lent to one op: a bump allocator over it, returned when the op ends."""

    def __init__(self, pool, region):
        self.pool = pool
        self.region = region
        self.used = 0

    def take(self, shape, dtype):
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        off = _align(self.used)
        self.used = off + count * dt.itemsize
        return self.region.array(shape, dt, off)

    def give_back(self):
        if self.region is not None:
            self.pool._give_back(self.region)
            self.region = None


class _StagingPool:
    """Staging regions of one client, reused across ops; at most _STAGING_KEEP kept idle."""

    def __init__(self, client):
        self.client = client
        self.lock = threading.Lock()
        self.idle = []

    def lease(self, nbytes):
        with self.lock:
            fits = [r for r in self.idle if r.nbytes >= nbytes and not r.released]
            if fits:
                region = min(fits, key=lambda r: r.nbytes)
                self.idle.remove(region)
                return _Lease(self, region)
        size = _STAGING_MIN_BYTES
        while size < nbytes:
            size *= 2
        return _Lease(self, Region(self.client, size))

    def _give_back(self, region):
        drop = None
        with self.lock:
            if region.released:
                return
            self.idle.append(region)
            if len(self.idle) > _STAGING_KEEP:
                drop = min(self.idle, key=lambda r: r.nbytes)
                self.idle.remove(drop)
        if drop is not None:
            drop.release()

    def clear(self):
        with self.lock:
            idle, self.idle = self.idle, []
        for region in idle:
            region.release()


class Client:
    """A connection to the epd daemon.

    ``socket`` is the daemon's Unix socket (None: ``$EPD_SOCKET``, else ``/run/epd/epd.sock``);
    ``name`` is shown by ``epctl clients``; ``timeout_ms`` bounds each control request (0: 30 s);
    ``protocol_version`` overrides the protocol version sent (tests only).

    Closing the client (:meth:`close`, ``with``, or garbage collection) leaves its groups and
    makes the daemon release every region, binding and handle it held.
    """

    def __init__(self, socket=None, name=None, timeout_ms=0, protocol_version=0):
        lib = _lib.load()
        self._ptr = None
        # Reentrant: a region's finalizer (which takes it) may run from garbage collection
        # while this thread holds it.
        self._lock = threading.RLock()
        self._ranges = {}             # region id -> (start, end, releaser)
        # The same ranges as (start, region id), sorted, and the longest one's length, so that
        # _locate_range bisects rather than scans (a process may hold many regions).
        self._starts = []
        self._max_span = 0
        self._groups = weakref.WeakSet()
        self._pending = set()
        self._tensor_memory = {}     # torch device -> epd.tensors memory strategy
        self._device_regions = set()  # regions from epd_region_register_device
        self._device_allocs = {}      # address -> DeviceAllocation not yet freed
        args = _lib.ConnectArgs(
            size=ctypes.sizeof(_lib.ConnectArgs),
            socket_path=os.fsencode(socket) if socket is not None else None,
            client_name=(name or "python-epd").encode(),
            protocol_version=int(protocol_version), timeout_ms=int(timeout_ms))
        ptr = ctypes.c_void_p()
        err = ctypes.create_string_buffer(1024)
        rc = lib.epd_client_connect(ctypes.byref(args), ctypes.byref(ptr), err, len(err))
        if rc < 0:
            raise make_error(rc, _lib.text(err.value))
        self._ptr = ptr.value
        self._staging = _StagingPool(self)
        self.socket = socket

    # ---- lifetime ----

    @property
    def closed(self):
        """True once the connection is closed."""
        return not self._ptr

    def _check_open(self):
        if not self._ptr:
            raise Unavailable("the client is closed")

    def close(self):
        """Leaves every group, abandons pending ops and closes the connection (idempotent).

        An op still in flight is not waited for: its future raises ``Unavailable`` when
        waited on. Arrays from :func:`empty` stay valid memory; arena views of dispatch
        results do not (the arenas are unmapped with the groups).
        """
        if not self._ptr:
            return
        for group in list(self._groups):
            try:
                group.leave()
            except Exception:  # the connection goes anyway, and with it the binding
                pass
        with self._lock:
            pending, self._pending = self._pending, set()
        for fut in pending:
            fut._abandon()
        self._staging.clear()
        ptr, self._ptr = self._ptr, None
        with self._lock:
            self._ranges.clear()
            self._starts.clear()
            self._max_span = 0
            self._device_regions.clear()
            mems, self._tensor_memory = self._tensor_memory, {}
            # epd_client_free frees their memory.
            allocs, self._device_allocs = self._device_allocs, {}
            for alloc in allocs.values():
                alloc.freed = True
        mems.clear()  # outside the lock: their scratch regions' finalizers take it
        _lib.load().epd_client_free(ptr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---- information ----

    @property
    def last_error(self):
        """The message of this client's last failed call (``epd_client_last_error``)."""
        return _lib.text(_lib.load().epd_client_last_error(self._ptr)) if self._ptr else ""

    def info(self):
        """What the daemon said at connection (``epd_client_daemon_info``), as a dict."""
        self._check_open()
        di = _lib.DaemonInfo()
        check(self, _lib.load().epd_client_daemon_info(self._ptr, ctypes.byref(di)))
        return {
            "protocol_version": di.protocol_version, "daemon_epoch": di.daemon_epoch,
            "client_id": di.client_id, "backend": _lib.text(di.backend),
            "version": _lib.text(di.version), "max_frame_bytes": di.max_frame_bytes,
            "max_fds_per_frame": di.max_fds_per_frame,
            "devices": [{"index": d.index, "uuid": _lib.text(d.uuid), "name": _lib.text(d.name),
                         "kind": _lib.text(d.kind), "memory_bytes": d.memory_bytes}
                        for d in di.devices[:min(di.num_devices, 16)]],
        }

    def size_hint(self, world_size, num_experts, hidden, max_tokens_per_rank, max_topk,
                  dtype="bf16", scale_block=0, expert_alignment=1, execution="daemon",
                  max_expert_alignment=0, expert_block_rows=0, quantize=False,
                  num_handle_slots=0, recv_rows=0):
        """The daemon's sizing for a group shape (``epd_size_hint``, docs/semantics.md section 5).

        The shape's keywords are :meth:`epd.Group.create`'s. Returns a dict:
        daemon_bytes_per_rank, max_rows_non_expand, max_rows_expand, arena_bytes_non_expand,
        arena_bytes_expand, client_buffer_bytes_per_rank (``execution='client'``).
        """
        self._check_open()
        cfg = _lib.GroupConfig(
            size=ctypes.sizeof(_lib.GroupConfig), world_size=world_size, num_experts=num_experts,
            hidden=hidden, max_tokens_per_rank=max_tokens_per_rank, max_topk=max_topk,
            dispatch_dtype=epd_dtype(dtype), scale_block=scale_block,
            execution=_lib.EXECUTION_CLIENT if execution == "client" else _lib.EXECUTION_DAEMON,
            max_expert_alignment=max_expert_alignment, expert_block_rows=expert_block_rows,
            quantize=int(bool(quantize)), num_handle_slots=num_handle_slots,
            recv_rows=recv_rows)
        hint = _lib.SizeHint()
        check(self, _lib.load().epd_size_hint(self._ptr, ctypes.byref(cfg), expert_alignment,
                                              ctypes.byref(hint)))
        return {name: getattr(hint, name) for name, _ in _lib.SizeHint._fields_}

    def capabilities(self):
        """The ``EPD_CAP_*`` bits the daemon granted this connection (``epd_client_capabilities``):
        1 host regions, 2 GPU memory regions (cuda backend and a libepd with CUDA), 4 output
        arena, 8 admin. 0 with a libepd that predates the call."""
        self._check_open()
        fn = _lib.load().optional.get("epd_client_capabilities")
        return int(fn(self._ptr)) if fn is not None else 0

    @property
    def gpu_memory(self):
        """True when tensors in GPU memory can be passed: the daemon imports GPU memory and this
        libepd can register it. (A libepd without ``epd_client_capabilities`` cannot say
        whether it was built with CUDA: then a cuda-backend daemon is taken as enough.)"""
        lib = _lib.load()
        if lib.optional.get("epd_region_register_device") is None:
            return False
        if lib.optional.get("epd_client_capabilities") is None:
            return self.info()["backend"] == "cuda"
        return bool(self.capabilities() & _lib.CAP_CUDA_REGIONS)

    # ---- memory ----

    def register_device(self, tensor_or_ptr, nbytes=None, device=None):
        """Registers GPU memory with the daemon (``epd_region_register_device``); returns the
        region id.

        ``tensor_or_ptr`` is a CUDA torch tensor (its bytes are registered) or a device pointer
        as an int with ``nbytes``. The whole CUDA allocation holding it is registered once;
        later calls inside it are answered from libepd's cache. ``device`` is the daemon's
        device index (None: found by the GPU's UUID). Ops register their tensors themselves;
        this is for registering ahead of time. The memory must stay allocated until
        :meth:`release_device_memory` or :meth:`close`.
        """
        from . import tensors
        if tensors.is_tensor(tensor_or_ptr):
            t = tensor_or_ptr
            ptr = t.data_ptr()
            nbytes = max(1, tensors._extent(t)[0]) if nbytes is None else nbytes
        else:
            ptr = int(tensor_or_ptr)
            if nbytes is None:
                raise InvalidArgument("register_device(pointer) needs nbytes")
        return tensors.register_device(self, ptr, nbytes, device)

    def release_device_memory(self):
        """Releases every GPU memory region the binding registered for this client.

        Call it before memory those regions cover goes back to CUDA (for PyTorch:
        ``torch.cuda.empty_cache()``), and only while no op uses them. Later ops register
        again. The regions of :meth:`device_alloc` memory stay: they go with the allocation.
        Returns the number of regions released.
        """
        with self._lock:
            owned = {a.region_id for a in self._device_allocs.values()}
            ids = sorted(set(self._device_regions) - owned)
            self._device_regions = set()
            # Their scratch tensors may lie in released regions; dropped outside the lock.
            mems, self._tensor_memory = self._tensor_memory, {}
        mems.clear()
        if not self._ptr:
            return 0
        lib = _lib.load()
        for region_id in ids:
            lib.epd_region_release(self._ptr, region_id)
        return len(ids)

    def device_alloc(self, nbytes, device=0):
        """GPU memory the daemon's kernels reach at full speed (``epd_device_alloc``): a
        :class:`DeviceAllocation` of ``nbytes`` on CUDA device ``device`` (an ordinal, or a
        ``torch.device`` / ``"cuda:N"``), registered with the daemon. View it with
        ``alloc.tensor(shape, dtype)``; free it with ``alloc.free()``, ``with``, or the
        client's close. Needs a libepd built with CUDA and the cuda backend
        (:class:`epd.Unavailable` otherwise)."""
        if isinstance(device, str) or hasattr(device, "type"):
            from . import tensors
            torch = tensors.torch_module()
            if torch is None:
                raise InvalidArgument("device must be a CUDA device ordinal, not %r" % (device,))
            d = torch.device(device)
            if d.type != "cuda":
                raise InvalidArgument("device must be a CUDA device, not %s" % d)
            device = d.index if d.index is not None else torch.cuda.current_device()
        return DeviceAllocation(self, nbytes, int(device))

    def empty(self, shape, dtype):
        """A new array of ``shape`` and ``dtype`` in its own shared region (zero-filled).

        ``dtype`` is a NumPy dtype or an epd dtype name ('bf16' -> uint16 bits, 'fp8' -> uint8).
        Ops take it without a copy. See :class:`Region` for its lifetime.
        """
        dt = numpy_dtype(dtype)
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * dt.itemsize if shape else
                     dt.itemsize)
        return Region(self, nbytes).array(shape, dt)

    def region(self, nbytes):
        """A new :class:`Region` of ``nbytes``."""
        return Region(self, nbytes)

    def release(self, array):
        """Unregisters the region that ``array`` (from :meth:`empty`) lives in.

        Returns True when a region was released, False when ``array`` is in none.
        """
        found = self._locate_range(array)
        if not found or found[3] is None:
            return False
        found[3]()
        return True

    def _track(self, future):
        with self._lock:
            self._pending.add(future)

    def _untrack(self, future):
        with self._lock:
            self._pending.discard(future)

    def _add_range(self, address, nbytes, region_id, releaser=None):
        with self._lock:
            self._forget_range(region_id)
            self._ranges[region_id] = (address, address + nbytes, releaser)
            bisect.insort(self._starts, (address, region_id))
            self._max_span = max(self._max_span, nbytes)

    def _forget_range(self, region_id):
        with self._lock:
            known = self._ranges.pop(region_id, None)
            if known is not None:
                i = bisect.bisect_left(self._starts, (known[0], region_id))
                del self._starts[i]

    def _locate_range(self, array):
        """(region_id, offset, row_stride_elems, releaser) of an array in a known region."""
        if not isinstance(array, np.ndarray) or not self._ptr:
            return None
        item = array.itemsize
        start = array.ctypes.data
        if array.size == 0:
            span, row_stride = 0, 0
        elif array.ndim == 1:
            if array.strides[0] != item:
                return None
            span, row_stride = array.shape[0] * item, 0
        elif array.ndim == 2:
            rows, cols = array.shape
            s0, s1 = array.strides
            if s1 != item and cols > 1:
                return None
            if rows > 1 and (s0 < cols * item or s0 % item):
                return None
            span = (rows - 1) * s0 + cols * item
            row_stride = s0 // item if rows > 1 and s0 != cols * item else 0
        else:
            return None
        with self._lock:
            # The ranges that start at or below the array, nearest first, back to the longest
            # range's length below it: no range starting further down can hold it.
            i = bisect.bisect_right(self._starts, (start, float("inf")))
            while i > 0:
                i -= 1
                lo, region_id = self._starts[i]
                if lo < start - self._max_span:
                    break
                _, hi, releaser = self._ranges[region_id]
                if start + span <= hi:
                    return region_id, start - lo, row_stride, releaser
        return None

    def _region_of_pointer(self, address, nbytes):
        """Registers an address range that libepd knows (an arena) in the binding's table."""
        t = _lib.Tensor()
        size = (ctypes.c_uint64 * 1)(max(1, nbytes))
        rc = _lib.load().epd_tensor_at(self._ptr, ctypes.c_void_p(address),
                                       _lib.DTYPE_FP8_E4M3, 1, size, ctypes.byref(t))
        check(self, rc)
        return t.region_id


class Staging:
    """Builds the epd tensors of one op from NumPy arrays.

    Arrays already in a registered region are described in place; the others are copied into
    one staging lease. Outputs the binding allocates for the op (combine's ``combined``) come
    from the same lease. ``keep`` holds every array the daemon will read or write, so they
    outlive the op.
    """

    def __init__(self, client):
        self.client = client
        self.items = []
        self.keep = []
        self.lease = None

    def input(self, array, epd_dt):
        """Adds an input; returns a slot whose ``tensor`` is filled by :meth:`build`."""
        slot = {"array": array, "dtype": epd_dt, "where": self.client._locate_range(array),
                "out": False}
        self.items.append(slot)
        return slot

    def output(self, shape, np_dt, epd_dt):
        """Adds an output of ``shape`` in staging; its array is ``slot['array']`` after build."""
        slot = {"shape": tuple(shape), "np_dtype": np.dtype(np_dt), "dtype": epd_dt,
                "where": None, "out": True}
        self.items.append(slot)
        return slot

    def build(self):
        need = 0
        for s in self.items:
            if s["where"] is None:
                nbytes = (s["array"].nbytes if not s["out"] else
                          int(np.prod(s["shape"], dtype=np.int64)) * s["np_dtype"].itemsize)
                need += _align(nbytes) + _ALIGN
        if need:
            self.lease = self.client._staging.lease(need)
        for s in self.items:
            if s["where"] is None:
                if s["out"]:
                    arr = self.lease.take(s["shape"], s["np_dtype"])
                else:
                    src = s["array"]
                    arr = self.lease.take(src.shape, src.dtype)
                    np.copyto(arr, src, casting="no")
                s["array"] = arr
                region_id = self.lease.region.region_id
                offset = arr.ctypes.data - self.lease.region.address
                row_stride = 0
            else:
                region_id, offset, row_stride, _ = s["where"]
            s["tensor"] = describe(s["array"], s["dtype"], region_id, offset, row_stride)
            self.keep.append(s["array"])

    def done(self):
        """Returns the staging lease; call once the op has completed."""
        if self.lease is not None:
            self.lease.give_back()
            self.lease = None


def describe(array, epd_dt, region_id, offset, row_stride=0):
    """An ``epd_tensor`` for ``array`` at ``offset`` in region ``region_id``."""
    t = _lib.Tensor()
    t.dtype = epd_dt
    t.ndim = array.ndim
    for i, n in enumerate(array.shape):
        t.sizes[i] = n
    if row_stride and array.ndim == 2:
        t.strides[0] = row_stride
        t.strides[1] = 1
    t.region_id = region_id
    t.offset = offset
    return t


def connect(socket=None, name=None, timeout_ms=0, protocol_version=0):
    """Connects to the epd daemon; returns a :class:`Client`. Arguments as for ``Client``."""
    return Client(socket=socket, name=name, timeout_ms=timeout_ms,
                  protocol_version=protocol_version)


def empty(client, shape, dtype):
    """A new zero-filled array in shared memory registered with ``client``'s daemon.

    Same as :meth:`Client.empty`. Ops take such arrays (and views of them) without a copy.
    """
    return client.empty(shape, dtype)
