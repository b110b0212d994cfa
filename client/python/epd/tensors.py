"""torch tensors in dispatch and combine: CUDA tensors in place, stream ordering.

:meth:`epd.Group.dispatch` and :meth:`epd.Group.combine` hand torch tensors to this module.
torch is never imported by epd: a tensor can only be passed by a program that imported it.

**CUDA tensors** stay where they are. The binding registers the memory of each tensor with
``epd_region_register_device``, which shares the whole CUDA allocation the tensor lives in (for
PyTorch's caching allocator: the cudaMalloc segment holding the block) and answers later
registrations inside the same allocation from libepd's cache, so after the first steps an op
costs no registration round trip. Descriptors come from ``epd_tensor_at`` on the tensor's device
pointer. Needs a libepd built with CUDA and a daemon running the ``cuda`` backend.

* Outputs of a dispatch are device tensors on the input's device, allocated per dispatch from
  PyTorch's allocator with room for ``recv_capacity`` rows (default: the worst case of the group,
  docs/semantics.md section 5), or the caller's own tensors (``out=``). The results are views of them
  sliced to the rows received. ``use_arena=True`` instead places the outputs in the rank's output
  arena (host memory on the cuda backend) and copies them to the device after the op.
* Stream ordering: the inputs are marked ready on the current stream of the tensors' device (or
  ``stream=``) with ``epd_group_mark_inputs_ready`` and the op carries that doorbell value in
  ``wait_inputs``, so the daemon's kernels start after the work queued before the call and no
  host synchronisation is needed before the submission. The blocking form then waits for the op
  on the host; ``async_op=True`` returns a :class:`epd.Future` whose
  :meth:`~epd.Future.stream_wait` / :meth:`~epd.Future.current_stream_wait` make a stream wait
  for the op on the GPU (``epd_op_stream_wait``). ``Future.outputs`` holds the output tensors
  at once (full capacity for a dispatch), so a combine's output can be used on the stream before
  the host has seen the op complete. The inputs are held by the future until it is waited on.
* dtypes: ``torch.bfloat16`` -> bf16 (float tensors are rounded with ``.to(torch.bfloat16)``;
  ``torch.int16`` is taken as bf16 bits), ``torch.float8_e4m3fn`` (or ``uint8``/``int8`` bytes)
  -> fp8, ``int32``/``int64`` top-k ids, ``float32`` weights and scales. Inputs given as NumPy
  arrays or tensors of another device next to a CUDA ``x`` are copied to ``x``'s device.

**CPU tensors** take the same path over host shared memory: tensors in a registered region (an
``epd.empty`` array wrapped by ``torch.from_numpy``, or a view of the output arena) are passed in
place, others are copied into the client's staging regions. Dispatch outputs go to the arena by
default (views of it as tensors; ``copy_outputs=True`` clones them), or with ``use_arena=False``
to tensors in a region of their own.

Lifetime of registrations: a CUDA allocation stays registered with the daemon until the client
closes or :meth:`epd.Client.release_device_memory` is called. CUDA requires the memory to stay
allocated while the daemon has it open, so call ``client.release_device_memory()`` before
``torch.cuda.empty_cache()`` (or anything else that returns PyTorch's cached segments to CUDA).
Memory from ``cudaMallocAsync`` pools (``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``) and
managed memory cannot be shared and are refused with :class:`epd.InvalidArgument`.
"""

import contextlib
import ctypes
import sys

import numpy as np

from . import _lib
from .client import check
from .errors import InvalidArgument, NotFound, Unavailable

_ALIGN = 64


def torch_module():
    """The torch module when the program imported it, else None (epd never imports torch)."""
    return sys.modules.get("torch")


def is_tensor(value):
    """True for a torch tensor."""
    torch = torch_module()
    return torch is not None and isinstance(value, torch.Tensor)


def is_cuda(value):
    """True for a torch tensor on a CUDA device."""
    return is_tensor(value) and value.device.type == "cuda"


def _fp8(torch):
    return getattr(torch, "float8_e4m3fn", None)


def _u16(torch):
    return getattr(torch, "uint16", None)


# ---- NumPy <-> torch on the host ----

def to_numpy(value):
    """A NumPy view of a CPU tensor (bf16 as uint16 bits, fp8 as uint8), or ``value``."""
    if not is_tensor(value):
        return value
    torch = torch_module()
    if value.device.type != "cpu":
        raise InvalidArgument("a %s tensor has no NumPy view" % value.device.type)
    t = value.detach()
    if t.dtype == torch.bfloat16 or t.dtype == _u16(torch):
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == _fp8(torch):
        return t.view(torch.uint8).numpy()
    return t.numpy()


def from_numpy(array, dtype=None):
    """A CPU tensor sharing ``array``'s memory, reinterpreted as ``dtype`` (same item size)."""
    torch = torch_module()
    a = np.asarray(array)
    if not a.flags.writeable:
        a = a.copy()
    if a.dtype == np.uint16:  # torch before 2.3 has no uint16: carry the bits as int16
        t = torch.from_numpy(a.view(np.int16))
    else:
        t = torch.from_numpy(a)
    if dtype is not None and t.dtype != dtype:
        t = t.view(dtype)
    return t


def _as_tensor(value, device, what):
    """``value`` (tensor, NumPy array, list) as a tensor on ``device``."""
    if not is_tensor(value):
        try:
            value = from_numpy(np.asarray(value))
        except (TypeError, ValueError) as e:
            raise InvalidArgument("%s: %s" % (what, e))
    if value.device != device:
        value = value.to(device)
    return value


# ---- dtypes ----

def payload(t, code, what):
    """``(carrier, result_dtype)``: ``t`` as the carrier of payload dtype ``code`` and the torch
    dtype that outputs of the same payload should have."""
    torch = torch_module()
    if code == _lib.DTYPE_BF16:
        if t.dtype == torch.bfloat16:
            return t, t.dtype
        if t.dtype == torch.int16 or (_u16(torch) is not None and t.dtype == _u16(torch)):
            return t, t.dtype  # bits
        if t.is_floating_point() and t.dtype != _fp8(torch):
            return t.to(torch.bfloat16), torch.bfloat16
        raise InvalidArgument("%s: a bf16 payload is torch.bfloat16 (or int16 bits, or floats "
                              "to round), not %s" % (what, t.dtype))
    if (_fp8(torch) is not None and t.dtype == _fp8(torch)) or \
            t.dtype in (torch.uint8, torch.int8):
        return t, t.dtype
    raise InvalidArgument("%s: an fp8 group takes torch.float8_e4m3fn or uint8 e4m3 bytes, not %s"
                          % (what, t.dtype))


def _float32(t, what):
    torch = torch_module()
    if t.dtype == torch.float32:
        return t
    if t.dtype != torch.bool and not t.is_complex() and t.dtype != _fp8(torch):
        return t.to(torch.float32)  # other floats and integers
    raise InvalidArgument("%s must be float32, not %s" % (what, t.dtype))


def _topk(t):
    torch = torch_module()
    if t.dtype in (torch.int32, torch.int64):
        return t
    if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
        return t.to(torch.int64)
    raise InvalidArgument("topk_idx must be int32 or int64, not %s" % t.dtype)


def torch_dtype(code):
    """The torch dtype of an epd dtype (bf16 -> bfloat16, fp8 -> float8_e4m3fn or uint8)."""
    torch = torch_module()
    return {_lib.DTYPE_BF16: torch.bfloat16,
            _lib.DTYPE_FP8_E4M3: _fp8(torch) or torch.uint8,
            _lib.DTYPE_FP32: torch.float32, _lib.DTYPE_INT32: torch.int32,
            _lib.DTYPE_INT64: torch.int64}[code]


def _topk_code(t):
    return _lib.DTYPE_INT32 if t.dtype == torch_module().int32 else _lib.DTYPE_INT64


def _dims(t, what, ndims=(1, 2)):
    if t.dim() not in ndims:
        raise InvalidArgument("%s has %d dimensions" % (what, t.dim()))
    return t


# ---- layout ----

def _normalise(t):
    """``t`` itself when epd can describe it (unit column stride, rows at a fixed stride), else a
    contiguous copy."""
    if t.dim() == 1:
        return t if t.numel() <= 1 or t.stride(0) == 1 else t.contiguous()
    if t.dim() == 2:
        rows, cols = t.shape
        ok = (cols <= 1 or t.stride(1) == 1) and (rows <= 1 or t.stride(0) >= cols)
        return t if ok else t.contiguous()
    return t.contiguous()


def _extent(t):
    """(bytes spanned by ``t``, row stride in elements or 0 when contiguous)."""
    item = t.element_size()
    if t.numel() == 0:
        return 0, 0
    if t.dim() == 2:
        rows, cols = t.shape
        if rows > 1 and t.stride(0) != cols:
            return ((rows - 1) * t.stride(0) + cols) * item, t.stride(0)
    return t.numel() * item, 0


def _descriptor(t, code, region_id, offset, row_stride):
    d = _lib.Tensor()
    d.dtype = code
    d.ndim = t.dim()
    for i, n in enumerate(t.shape):
        d.sizes[i] = n
    if row_stride and t.dim() == 2:
        d.strides[0] = row_stride
        d.strides[1] = 1
    d.region_id = region_id
    d.offset = offset
    return d


def resolve(client, address, nbytes):
    """(region_id, offset) of ``nbytes`` at ``address`` in a region libepd knows; NotFound
    otherwise."""
    t = _lib.Tensor()
    size = (ctypes.c_uint64 * 1)(max(1, nbytes))
    rc = _lib.load().epd_tensor_at(client._ptr, ctypes.c_void_p(address), _lib.DTYPE_FP8_E4M3, 1,
                                   size, ctypes.byref(t))
    check(client, rc)
    return t.region_id, t.offset


# ---- where tensors live ----

class _Memory:
    """How tensors of one device become epd tensors, for one client."""

    def __init__(self, client, device):
        self.client = client
        self.device = device
        self._scratch = None

    def scratch(self, group):
        """A small registered tensor: the address given to zero-sized tensors."""
        if self._scratch is None:
            t = self.alloc(_ALIGN)
            self.register(t.data_ptr(), _ALIGN, group)
            self._scratch = t
        return self._scratch

    def alloc(self, nbytes):
        raise NotImplementedError

    def register(self, address, nbytes, group):
        """Makes sure [address, address + nbytes) is in a region; False when it cannot be."""
        raise NotImplementedError

    def copy_target(self, t, op):
        """A registered tensor like ``t`` (contents not copied), for tensors outside regions."""
        raise NotImplementedError


class _CudaMemory(_Memory):
    """CUDA tensors: their allocations are registered with epd_region_register_device."""

    def alloc(self, nbytes):
        torch = torch_module()
        return torch.empty(max(1, int(nbytes)), dtype=torch.uint8, device=self.device)

    def register(self, address, nbytes, group):
        register_device(self.client, address, nbytes,
                        fallback=None if group is None else getattr(group, "device", None))
        return True

    def copy_target(self, t, op):  # pragma: no cover - register() raises instead
        raise AssertionError("CUDA tensors are registered, never copied")


class _HostMemory(_Memory):
    """CPU tensors: described where they lie in a registered region, else copied to staging."""

    def alloc(self, nbytes):
        return from_numpy(self.client.empty((max(1, int(nbytes)),), np.uint8))

    def register(self, address, nbytes, group):
        try:
            resolve(self.client, address, nbytes)
            return True
        except NotFound:
            return False

    def copy_target(self, t, op):
        nbytes = t.numel() * t.element_size()
        lease = self.client._staging.lease(nbytes + _ALIGN)
        op.leases.append(lease)
        raw = from_numpy(lease.take((max(1, nbytes),), np.uint8))[:nbytes]
        return raw.view(t.dtype).view(t.shape) if nbytes else raw.view(t.dtype).reshape(t.shape)


def memory_for(client, device):
    """The client's :class:`_Memory` for a torch device."""
    key = (device.type, device.index)
    with client._lock:
        mem = client._tensor_memory.get(key)
        if mem is None:
            cls = _CudaMemory if device.type == "cuda" else _HostMemory
            if device.type not in ("cuda", "cpu"):
                raise InvalidArgument("epd takes CPU or CUDA tensors, not %s" % device.type)
            mem = client._tensor_memory[key] = cls(client, device)
    return mem


def register_device(client, address, nbytes, device=None, fallback=None):
    """Registers the CUDA allocation holding [address, address + nbytes); returns the region id.

    ``device`` is the daemon's device index; None picks it by the GPU's UUID
    (``EPD_DEVICE_AUTO``), and when the daemon lists no such UUID, uses ``fallback`` if given.
    """
    lib = _lib.load()
    fn = lib.optional.get("epd_region_register_device")
    if fn is None:
        raise Unavailable("this libepd cannot register GPU memory (build it with -DEPD_CUDA=ON "
                          "and point EPD_LIBRARY at it)")
    client._check_open()
    rid = ctypes.c_uint64()
    want = _lib.DEVICE_AUTO if device is None else int(device)
    rc = fn(client._ptr, ctypes.c_void_p(address), max(1, int(nbytes)), want, ctypes.byref(rid))
    if rc == _lib.NOT_FOUND and device is None and fallback is not None:
        rc = fn(client._ptr, ctypes.c_void_p(address), max(1, int(nbytes)), int(fallback),
                ctypes.byref(rid))
    check(client, rc)
    with client._lock:
        client._device_regions.add(rid.value)
    return rid.value


class TensorOp:
    """The tensors of one op: descriptors, what the op must keep alive, staging leases, and
    outputs to copy back to the caller's tensors."""

    def __init__(self, group, mem):
        self.group = group
        self.mem = mem
        self.keep = []
        self.leases = []
        self.copy_back = []
        self.staged_outputs = False  # outputs in staging: cloned when the op completes

    def fresh(self, nbytes):
        """A new uint8 buffer of ``nbytes`` for outputs the binding allocates: device memory
        for CUDA; for the host a staging lease, whose contents finish() must clone."""
        if isinstance(self.mem, _HostMemory):
            lease = self.group.client._staging.lease(int(nbytes) + _ALIGN)
            self.leases.append(lease)
            self.staged_outputs = True
            return from_numpy(lease.take((max(1, int(nbytes)),), np.uint8))
        return self.mem.alloc(nbytes)

    def result(self, t):
        """An output the binding allocated, as handed to the caller."""
        return t.clone() if self.staged_outputs and t is not None else t

    def describe(self, t, code, output=False):
        """An epd_tensor for ``t``; returns (descriptor, the tensor the op uses)."""
        t = _normalise(t) if not output else t
        if output and _normalise(t) is not t:
            raise InvalidArgument("an output tensor needs unit column stride and a row stride "
                                  "of at least its width")
        nbytes, row_stride = _extent(t)
        if nbytes == 0:
            s = self.mem.scratch(self.group)
            region_id, offset = resolve(self.group.client, s.data_ptr(), 1)
            self.keep.append(t)
            return _descriptor(t, code, region_id, offset, 0), t
        used = t
        if not self.mem.register(t.data_ptr(), nbytes, self.group):
            used = self.mem.copy_target(t, self)
            row_stride = 0
            if output:
                self.copy_back.append((t, used))
            else:
                used.copy_(t)
        region_id, offset = resolve(self.group.client, used.data_ptr(),
                                    nbytes if used is t else used.numel() * used.element_size())
        self.keep.append(used)
        return _descriptor(used, code, region_id, offset, row_stride), used

    def finish_outputs(self):
        for dst, src in self.copy_back:
            dst.copy_(src)
        self.copy_back = []

    def done(self):
        """Releases what the op held; called once it has completed."""
        for lease in self.leases:
            lease.give_back()
        self.leases = []
        self.keep = []
        self.copy_back = []


# ---- streams ----

def current_stream(device):
    torch = torch_module()
    return torch.cuda.current_stream(device)


def stream_handle(stream):
    """A cudaStream_t as an int from a torch/CuPy stream object or an int."""
    return int(getattr(stream, "cuda_stream", getattr(stream, "ptr", stream)) or 0)


@contextlib.contextmanager
def on_device(device):
    """Makes ``device`` current (for stream 0, the legacy default stream of its context)."""
    torch = torch_module()
    if device is None or device.type != "cuda" or torch is None:
        yield
        return
    with torch.cuda.device(device):
        yield


def mark_inputs_ready(group, stream, device):
    """Writes the group's inputs_ready doorbell on ``stream`` after its queued work; returns the
    value for wait_inputs. Where stream ordering is unavailable, synchronises the stream and
    returns 0 (the daemon then reads at once)."""
    fn = _lib.load().optional.get("epd_group_mark_inputs_ready")
    seq = ctypes.c_uint64()
    rc = _lib.UNAVAILABLE
    if fn is not None:
        with on_device(device):
            rc = fn(group._ptr, ctypes.c_void_p(stream_handle(stream)), ctypes.byref(seq))
    if rc == _lib.UNAVAILABLE:
        stream.synchronize()
        return 0
    check(group.client, rc)
    return seq.value


# ---- dispatch and combine ----

_DTYPE_SIZE = {_lib.DTYPE_BF16: 2, _lib.DTYPE_FP8_E4M3: 1, _lib.DTYPE_FP32: 4,
               _lib.DTYPE_INT32: 4, _lib.DTYPE_INT64: 8}


def _nbytes(shape, code):
    n = 1
    for s in shape:
        n *= int(s)
    return n * _DTYPE_SIZE[code]


_RESULT_NAMES = {"recv_x": "recv_x", "recv_scales": "recv_x_scales",
                 "recv_topk_idx": "recv_topk_idx", "recv_weights": "recv_topk_weights",
                 "recv_src": "recv_src", "recv_topk_slot": "recv_topk_slot"}


def _out_lookup(out, cname):
    """The caller's tensor for output ``cname`` (keyed by the C or the result name)."""
    if not out:
        return None
    for key in (cname, _RESULT_NAMES[cname]):
        if key in out:
            return out[key]
    return None


def _stream_for(device, stream):
    """The torch stream an op on ``device`` is ordered after (None for CPU tensors)."""
    if device.type != "cuda":
        return None
    if stream is None:
        return current_stream(device)
    torch = torch_module()
    if isinstance(stream, torch.cuda.Stream):
        return stream
    # A raw cudaStream_t (int) or a CuPy stream: wrap it, so that the copies the binding makes
    # (dtype conversions, contiguous copies) are queued on it too.
    return torch.cuda.ExternalStream(stream_handle(stream), device=device)


@contextlib.contextmanager
def _using(stream):
    """Makes ``stream`` torch's current stream (None: leaves it)."""
    if stream is None:
        yield
        return
    with torch_module().cuda.stream(stream):
        yield


def dispatch(group, x, topk_idx, topk_weights, x_scales, handle, expert_alignment, layout,
             zero_padding, async_op, use_arena, copy_outputs, recv_capacity, out, stream):
    """Group.dispatch for a torch ``x`` (see the module docstring)."""
    torch = torch_module()
    client = group.client
    device = x.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    if use_arena is None:
        use_arena = not cuda
    if out is not None and use_arena:
        raise InvalidArgument("out= gives the outputs' memory: it needs use_arena=False")
    mem = memory_for(client, device)
    s = _stream_for(device, stream)
    layout, layout_code, expert_alignment, zero_padding = group._routing_options(
        handle, topk_idx, layout, expert_alignment, zero_padding)
    edt = group.dtype_code
    op = TensorOp(group, mem)
    try:
        with on_device(device if cuda else None), _using(s):
            xt, x_dtype = payload(_as_tensor(x, device, "x"), edt, "x")
            _dims(xt, "x", (2,))
            num_tokens = xt.shape[0]
            args = _lib.DispatchArgs(size=ctypes.sizeof(_lib.DispatchArgs))
            args.num_tokens = num_tokens
            args.x, _ = op.describe(xt, edt)
            if x_scales is not None:
                st = _dims(_float32(_as_tensor(x_scales, device, "x_scales"), "x_scales"),
                           "x_scales")
                args.scales, _ = op.describe(st, _lib.DTYPE_FP32)
            if topk_idx is not None:
                tk = _dims(_topk(_as_tensor(topk_idx, device, "topk_idx")), "topk_idx")
                topk_code = _topk_code(tk)
                num_topk = tk.shape[1] if tk.dim() == 2 else 0
                args.topk_idx, _ = op.describe(tk, topk_code)
            else:
                topk_code, num_topk = handle.topk_dtype, handle.num_topk
            has_weights = topk_weights is not None
            if has_weights:
                tw = _dims(_float32(_as_tensor(topk_weights, device, "topk_weights"),
                                    "topk_weights"), "topk_weights")
                args.topk_weights, _ = op.describe(tw, _lib.DTYPE_FP32)
            args.num_topk = num_topk
            args.handle_id = handle.id if handle is not None else 0
            args.layout = layout_code
            args.expert_alignment = expert_alignment
            args.zero_padding = int(zero_padding)
            args.use_arena = int(bool(use_arena))
            outs = None
            dtypes = {"recv_x": x_dtype, "recv_scales": torch.float32,
                      "recv_topk_idx": torch_dtype(topk_code), "recv_weights": torch.float32,
                      "recv_src": torch.int64, "recv_topk_slot": torch.int32}
            if not use_arena:
                outs = _dispatch_outputs(group, op, args, layout, num_topk, topk_code,
                                         has_weights, expert_alignment, recv_capacity, out,
                                         dtypes)
            if cuda:
                args.wait_inputs = mark_inputs_ready(group, s, device)
    except BaseException:
        op.done()
        raise

    if use_arena:
        def convert(cname, arr):
            t = from_numpy(arr, dtypes[cname])
            if cuda:
                return t.to(device)
            return t.clone() if copy_outputs else t
    else:
        mine = {cname for cname in (outs or {}) if _out_lookup(out, cname) is None}

        def convert(cname, t):
            return op.result(t) if cname in mine else t

    def finish(op_ptr):
        op.finish_outputs()
        return group._dispatch_result(op_ptr, layout, handle, num_tokens, num_topk, topk_code,
                                      has_weights, expert_alignment, zero_padding, outs,
                                      False, convert=convert)

    return group._submit("dispatch", _lib.load().epd_dispatch_submit, args, op, finish,
                         async_op, outputs={_RESULT_NAMES[k]: v for k, v in outs.items()}
                         if outs and cuda else None,
                         device=device if cuda else None)


def _dispatch_outputs(group, op, args, layout, num_topk, topk_code, has_weights, alignment,
                      capacity, out, dtypes):
    """Output tensors of one dispatch: the caller's (``out``) or carved from one new buffer."""
    torch = torch_module()
    if out is not None and not isinstance(out, dict):
        raise InvalidArgument("out must be a dict of output tensors")
    names = set(_RESULT_NAMES) | set(_RESULT_NAMES.values())
    strange = sorted(set(out or ()) - names)
    if strange:
        raise InvalidArgument("out has unknown outputs %s (known: %s)" % (
            ", ".join(strange), ", ".join(sorted(_RESULT_NAMES.values()))))
    given = {}
    for cname in _RESULT_NAMES:
        t = _out_lookup(out, cname)
        if t is not None:
            if not is_tensor(t) or t.device != op.mem.device:
                raise InvalidArgument("out[%r] must be a tensor on %s" %
                                      (cname, op.mem.device))
            given[cname] = t
    if capacity is None and "recv_x" in given:
        capacity = given["recv_x"].shape[0]
    specs = group._output_specs(layout, num_topk, topk_code, has_weights, alignment, capacity)
    unknown = set(given) - {name for name, _, _ in specs}
    if unknown:
        raise InvalidArgument("this dispatch has no output %s" % ", ".join(sorted(unknown)))
    need = 0
    for cname, shape, code in specs:
        if cname not in given:
            need += (_nbytes(shape, code) + _ALIGN - 1) // _ALIGN * _ALIGN
    buf = op.fresh(need) if need else None
    outs, off = {}, 0
    for cname, shape, code in specs:
        t = given.get(cname)
        if t is None:
            n = _nbytes(shape, code)
            t = buf[off:off + n].view(dtypes[cname]).view(shape)
            off += (n + _ALIGN - 1) // _ALIGN * _ALIGN
        elif tuple(t.shape[1:]) != tuple(shape[1:]) or t.dim() != len(shape):
            raise InvalidArgument("out[%r] has shape %s; it needs [rows%s]" % (
                cname, tuple(t.shape), "".join(", %d" % s for s in shape[1:])))
        elif t.element_size() != torch.empty(0, dtype=dtypes[cname]).element_size():
            raise InvalidArgument("out[%r] is %s; it needs %s" % (cname, t.dtype, dtypes[cname]))
        desc, _ = op.describe(t, code, output=True)
        setattr(args, cname, desc)
        outs[cname] = t
    return outs


def combine(group, x, handle, bias, apply_weights, async_op, out, stream, recv_weights=None,
            source_weights=None):
    """Group.combine for a torch ``x``. Returns an epd.CombineResult (or a Future of one)."""
    from .group import CombineResult  # circular import at load time

    torch = torch_module()
    client = group.client
    device = x.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    mem = memory_for(client, device)
    s = _stream_for(device, stream)
    if bias is None:
        biases = []
    elif isinstance(bias, (tuple, list)):
        biases = [b for b in bias if b is not None]
    else:
        biases = [bias]
    if len(biases) > 2:
        raise InvalidArgument("at most 2 biases, not %d" % len(biases))
    n, H = handle.num_tokens, group.hidden
    op = TensorOp(group, mem)
    try:
        with on_device(device if cuda else None), _using(s):
            y, y_dtype = payload(_as_tensor(x, device, "x"), _lib.DTYPE_BF16, "x")
            _dims(y, "x", (2,))
            args = _lib.CombineArgs(size=ctypes.sizeof(_lib.CombineArgs))
            args.handle_id = handle.id
            args.y, _ = op.describe(y, _lib.DTYPE_BF16)
            args.apply_weights = int(bool(apply_weights))
            args.num_bias = len(biases)
            for i, b in enumerate(biases):
                bt, _ = payload(_as_tensor(b, device, "bias"), _lib.DTYPE_BF16, "bias")
                args.bias[i], _ = op.describe(_dims(bt, "bias", (2,)), _lib.DTYPE_BF16)
            for name, w in (("recv_weights", recv_weights), ("source_weights", source_weights)):
                if w is not None:
                    wt = _dims(_float32(_as_tensor(w, device, name), name), name)
                    setattr(args, name, op.describe(wt, _lib.DTYPE_FP32)[0])
            want_weights = handle.has_weights or recv_weights is not None
            if out is not None:
                if not is_tensor(out) or out.device != device:
                    raise InvalidArgument("out must be a tensor on %s" % device)
                if tuple(out.shape) != (n, H) or out.element_size() != 2 or \
                        (out.is_floating_point() and out.dtype != torch.bfloat16):
                    raise InvalidArgument("out must be bf16 [%d, %d], not %s %s" % (
                        n, H, out.dtype, tuple(out.shape)))
                combined = out
            else:
                combined = None
            weights = None
            need = 0 if combined is not None else (n * H * 2 + _ALIGN - 1) // _ALIGN * _ALIGN
            if want_weights:
                need += n * handle.num_topk * 4
            buf = op.fresh(max(need, 1))
            off = 0
            if combined is None:
                combined = buf[:n * H * 2].view(y_dtype).view(n, H)
                off = (n * H * 2 + _ALIGN - 1) // _ALIGN * _ALIGN
            args.combined, _ = op.describe(combined, _lib.DTYPE_BF16, output=True)
            if want_weights:
                weights = buf[off:off + n * handle.num_topk * 4].view(torch.float32).view(
                    n, handle.num_topk)
                args.combined_topk_weights, _ = op.describe(weights, _lib.DTYPE_FP32,
                                                            output=True)
            if cuda:
                args.wait_inputs = mark_inputs_ready(group, s, device)
    except BaseException:
        op.done()
        raise

    def finish(op_ptr):
        res = _lib.CombineResult()
        check(client, _lib.load().epd_op_combine_result(op_ptr, ctypes.byref(res)))
        op.finish_outputs()
        return CombineResult(combined if out is not None else op.result(combined),
                             op.result(weights), op_number=res.op_number,
                             num_tokens=res.num_tokens, exec_ns=res.exec_ns,
                             queue_ns=res.queue_ns, kernel_ns=res.kernel_ns)

    return group._submit("combine", _lib.load().epd_combine_submit, args, op, finish, async_op,
                         outputs={"combined_x": combined, "combined_topk_weights": weights}
                         if cuda else None, device=device if cuda else None)


def daemon_device(client, device):
    """The daemon's index of the GPU behind a torch device (by UUID), or the CUDA ordinal when
    the daemon does not list it."""
    torch = torch_module()
    if isinstance(device, str):
        device = torch.device(device)
    if getattr(device, "type", None) != "cuda":
        raise InvalidArgument("device must be a daemon device index or a CUDA device, not %r" %
                              (device,))
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = ""
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid).lower()
    except Exception:
        pass
    if uuid:
        uuid = uuid[4:] if uuid.startswith("gpu-") else uuid
        for d in client.info()["devices"]:
            theirs = d["uuid"].lower()
            theirs = theirs[4:] if theirs.startswith("gpu-") else theirs
            if theirs == uuid:
                return d["index"]
    return index
