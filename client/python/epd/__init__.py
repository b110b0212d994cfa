"""epd: Python binding of libepd, the client library of the epd expert-parallel daemon.

Pure Python over ctypes; needs NumPy and libepd.so (found through ``$EPD_LIBRARY``, else
``LD_LIBRARY_PATH``, else the source tree's ``build/lib/libepd.so``, else the system loader). A
worker's MoE step::

    import epd

    with epd.connect(socket="/run/epd/epd.sock") as client:
        group = epd.Group.create(client, "layer0", b"secret", rank=0, world_size=2,
                                 num_experts=16, hidden=1024, max_tokens_per_rank=256,
                                 max_topk=4)            # other ranks: epd.Group.join(...)
        res = group.dispatch(x_bf16, topk_idx=topk, topk_weights=w, layout="expand")
        res.recv_x[:] = experts(res)                    # in place, in the output arena
        y, _ = group.combine(res.recv_x, res.handle, apply_weights=True)
        res.handle.release()

bf16 tensors are NumPy ``uint16`` arrays of bf16 bits (:func:`float_to_bf16`,
:func:`bf16_to_float`); fp8 tensors are ``uint8`` e4m3 bytes. Inputs in shared memory from
:func:`empty` travel without a copy; other arrays are copied into a cached staging region.

torch tensors are accepted wherever arrays are (:mod:`epd.tensors`): CUDA tensors are
registered with the daemon in place (cuda backend, libepd built with CUDA), dispatch outputs
are device tensors, and ops are ordered after the current CUDA stream without a host
synchronisation (``async_op=True`` plus :meth:`Future.stream_wait` leaves the host out
entirely). ``Future.stream_wait`` raises :class:`StreamWaitUnavailable`, a
NotImplementedError, where libepd or the daemon has no CUDA.

:mod:`epd.admin` is what ``epctl`` shows and does: the daemon's status, groups, clients and
statistics, and the admin verbs drain, undrain, evict and resize.
"""

from . import admin
from .bf16 import bf16_to_float, float_to_bf16, round_bf16
from .client import Client, DeviceAllocation, Region, connect, empty
from .errors import (Aborted, AlreadyExists, CapacityExceeded, Error, Internal,
                     InvalidArgument, NotFound, PeerLost, PermissionDenied, Timeout,
                     Unavailable, VersionMismatch, error_class)
from .group import (EXPAND, NON_EXPAND, CombineResult, DispatchResult, Future, Group, Handle,
                    StreamWaitUnavailable)

__version__ = "0.1.0"

__all__ = [
    "Aborted", "AlreadyExists", "CapacityExceeded", "Client", "CombineResult",
    "DeviceAllocation", "DispatchResult", "EXPAND",
    "Error", "Future", "Group", "Handle", "Internal", "InvalidArgument", "NON_EXPAND",
    "NotFound", "PeerLost", "PermissionDenied", "Region", "StreamWaitUnavailable", "Timeout",
    "Unavailable",
    "VersionMismatch", "admin", "bf16_to_float", "connect", "empty", "error_class",
    "float_to_bf16", "library_path", "round_bf16",
]


def library_path():
    """The path libepd was (or will be) loaded from; loads it if needed."""
    from . import _lib
    return _lib.load().path
