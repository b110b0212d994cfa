"""ctypes declarations of libepd's public API (include/epd.h) and the loader of libepd.so.

Every structure here mirrors the C declaration field for field; tests/python/test_binding.py
checks the sizes that the layout implies. The library is loaded on first use, not at import,
so the pure-NumPy helpers (bf16 conversion) work without it.

Where the library is looked for, in order:

1. the path in the environment variable ``EPD_LIBRARY`` (a file, or a directory holding
   ``libepd.so``); when it is set, nothing else is tried;
2. ``libepd.so`` (then ``libepd.so.0``) in each directory of ``LD_LIBRARY_PATH``;
3. ``build/lib/libepd.so`` of the source tree this package sits in
   (``client/python/epd/../../../build/lib/libepd.so``);
4. the install prefix: ``lib/libepd.so`` under Python's ``sys.prefix`` (a virtual
   environment or conda prefix that ``cmake --install`` used), then under ``/usr/local``
   (CMake's default prefix), for a package installed with ``pip install ./client/python``;
5. the system loader (``libepd.so.0``, then ``libepd.so``).

A libepd.so built against shared libraries (libuv, protobuf-c, ...) finds them through its
RUNPATH or ``LD_LIBRARY_PATH``, which the dynamic loader reads when the process starts: set it
before starting Python, not from Python.

GPU tensors need a libepd built with CUDA (``cmake -DEPD_CUDA=ON``) to work:
``epd_region_register_device``, ``epd_device_alloc`` / ``epd_device_free`` and the
stream-ordering calls. The binding declares them optional, so a libepd that predates one of
them still loads (a host-only libepd exports them all, as stubs answering UNAVAILABLE). The
administration calls of :mod:`epd.admin` are optional the same way.
"""

import ctypes
import os
import sys
import threading

# enum epd_status
OK = 0
INVALID_ARGUMENT = -1
NOT_FOUND = -2
ALREADY_EXISTS = -3
PERMISSION_DENIED = -4
CAPACITY_EXCEEDED = -5
PEER_LOST = -6
TIMEOUT = -7
ABORTED = -8
UNAVAILABLE = -9
VERSION_MISMATCH = -10
INTERNAL = -11

# enum epd_dtype
DTYPE_INVALID = 0
DTYPE_BF16 = 1
DTYPE_FP8_E4M3 = 2
DTYPE_FP32 = 3
DTYPE_INT32 = 4
DTYPE_INT64 = 5

# enum epd_layout
LAYOUT_NON_EXPAND = 0
LAYOUT_EXPAND = 1

SCALE_FORMAT_FP32 = 0
SCALE_FORMAT_UE8M0 = 1

# enum epd_execution
EXECUTION_DAEMON = 0
EXECUTION_CLIENT = 1

# enum epd_region_kind
REGION_HOST_MEMFD = 1
REGION_CUDA_IPC = 2
REGION_CUMEM_FD = 3

# epd_region_register_device's device: pick the daemon device by the GPU's UUID.
DEVICE_AUTO = 0xFFFFFFFF

# Capability bits of Welcome (epd_client_capabilities).
CAP_HOST_REGIONS = 1
CAP_CUDA_REGIONS = 2
CAP_OUTPUT_ARENA = 4
CAP_ADMIN = 8

TENSOR_MAX_DIMS = 4

_u32 = ctypes.c_uint32
_u64 = ctypes.c_uint64
_i32 = ctypes.c_int32
_int = ctypes.c_int
_size = ctypes.c_size_t


class Tensor(ctypes.Structure):
    """struct epd_tensor."""

    _fields_ = [
        ("dtype", _int),
        ("ndim", _u32),
        ("sizes", _u64 * TENSOR_MAX_DIMS),
        ("strides", _u64 * TENSOR_MAX_DIMS),
        ("region_id", _u64),
        ("offset", _u64),
    ]


class ConnectArgs(ctypes.Structure):
    """struct epd_connect_args."""

    _fields_ = [
        ("size", _size),
        ("socket_path", ctypes.c_char_p),
        ("client_name", ctypes.c_char_p),
        ("protocol_version", _u32),
        ("timeout_ms", _int),
    ]


class DeviceInfo(ctypes.Structure):
    """struct epd_device_info."""

    _fields_ = [
        ("index", _u32),
        ("uuid", ctypes.c_char * 64),
        ("name", ctypes.c_char * 64),
        ("kind", ctypes.c_char * 16),
        ("memory_bytes", _u64),
    ]


class DaemonInfo(ctypes.Structure):
    """struct epd_daemon_info."""

    _fields_ = [
        ("protocol_version", _u32),
        ("daemon_epoch", _u64),
        ("client_id", _u64),
        ("backend", ctypes.c_char * 16),
        ("version", ctypes.c_char * 32),
        ("max_frame_bytes", _u32),
        ("max_fds_per_frame", _u32),
        ("num_devices", _u32),
        ("devices", DeviceInfo * 16),
    ]


class GroupConfig(ctypes.Structure):
    """struct epd_group_config."""

    _fields_ = [
        ("size", _size),
        ("world_size", _u32),
        ("num_experts", _u32),
        ("hidden", _u32),
        ("max_tokens_per_rank", _u32),
        ("max_topk", _u32),
        ("dispatch_dtype", _int),
        ("scale_block", _u32),
        ("op_timeout_ms", _u32),
        ("arena_bytes", _u64),
        ("execution", _int),
        ("max_expert_alignment", _u32),
        ("expert_block_rows", _u32),
        ("quantize", _u32),
        ("num_handle_slots", _u32),
        ("sms_per_rank", _u32),
        ("recv_rows", _u32),
    ]


class GroupArgs(ctypes.Structure):
    """struct epd_group_args."""

    _fields_ = [
        ("size", _size),
        ("name", ctypes.c_char_p),
        ("secret", ctypes.c_void_p),
        ("secret_len", _size),
        ("rank", _u32),
        ("device", _u32),
        ("device_uuid", ctypes.c_char_p),
        ("config", ctypes.POINTER(GroupConfig)),
    ]


class SizeHint(ctypes.Structure):
    """struct epd_size_hint."""

    _fields_ = [
        ("daemon_bytes_per_rank", _u64),
        ("max_rows_non_expand", _u64),
        ("max_rows_expand", _u64),
        ("arena_bytes_non_expand", _u64),
        ("arena_bytes_expand", _u64),
        ("client_buffer_bytes_per_rank", _u64),
    ]


class DispatchArgs(ctypes.Structure):
    """struct epd_dispatch_args."""

    _fields_ = [
        ("size", _size),
        ("num_tokens", _u32),
        ("num_topk", _u32),
        ("x", Tensor),
        ("scales", Tensor),
        ("topk_idx", Tensor),
        ("topk_weights", Tensor),
        ("handle_id", _u64),
        ("layout", _int),
        ("expert_alignment", _u32),
        ("zero_padding", _int),
        ("use_arena", _int),
        ("recv_x", Tensor),
        ("recv_scales", Tensor),
        ("recv_topk_idx", Tensor),
        ("recv_weights", Tensor),
        ("recv_src", Tensor),
        ("recv_topk_slot", Tensor),
        ("wait_inputs", _u64),
    ]


class DispatchResult(ctypes.Structure):
    """struct epd_dispatch_result."""

    _fields_ = [
        ("op_number", _u64),
        ("handle_id", _u64),
        ("num_recv_tokens", _i32),
        ("num_expanded_rows", _i32),
        ("num_local_experts", _u32),
        ("num_recv_tokens_per_expert", ctypes.POINTER(_i32)),
        ("num_recv_tokens_per_expert_aligned", ctypes.POINTER(_i32)),
        ("world_size", _u32),
        ("rank_prefix", ctypes.POINTER(_i32)),
        ("recv_x", Tensor),
        ("recv_scales", Tensor),
        ("recv_topk_idx", Tensor),
        ("recv_weights", Tensor),
        ("recv_src", Tensor),
        ("recv_topk_slot", Tensor),
        ("recv_x_ptr", ctypes.c_void_p),
        ("recv_scales_ptr", ctypes.c_void_p),
        ("recv_topk_idx_ptr", ctypes.c_void_p),
        ("recv_weights_ptr", ctypes.c_void_p),
        ("recv_src_ptr", ctypes.c_void_p),
        ("recv_topk_slot_ptr", ctypes.c_void_p),
        ("exec_ns", _u64),
        ("queue_ns", _u64),
        ("kernel_ns", _u64),
    ]


class CombineArgs(ctypes.Structure):
    """struct epd_combine_args."""

    _fields_ = [
        ("size", _size),
        ("handle_id", _u64),
        ("y", Tensor),
        ("apply_weights", _int),
        ("num_bias", _u32),
        ("bias", Tensor * 2),
        ("combined", Tensor),
        ("combined_topk_weights", Tensor),
        ("wait_inputs", _u64),
        ("recv_weights", Tensor),
        ("source_weights", Tensor),
    ]


class CombineResult(ctypes.Structure):
    """struct epd_combine_result."""

    _fields_ = [
        ("op_number", _u64),
        ("num_tokens", _u32),
        ("exec_ns", _u64),
        ("queue_ns", _u64),
        ("kernel_ns", _u64),
    ]


# ---- client-executed ops (epd.h, "client-executed ops"; docs/client-execution.md) ----

class CxDispatchArgs(ctypes.Structure):
    """struct epd_cx_dispatch_args."""

    _fields_ = [
        ("size", _size),
        ("num_tokens", _u32),
        ("num_topk", _u32),
        ("x", ctypes.c_void_p),
        ("x_stride", _u64),
        ("scales", ctypes.c_void_p),
        ("scales_stride", _u64),
        ("topk_idx", ctypes.c_void_p),
        ("topk_dtype", _int),
        ("topk_weights", ctypes.c_void_p),
        ("layout", _int),
        ("expert_alignment", _u32),
        ("zero_padding", _int),
        ("expert_block_rows", _u32),
        ("quantize", _int),
        ("handle", _u32),
        ("cached", _int),
        ("capacity_rows", _u64),
        ("recv_memory", _u32),
        ("reserved", _u32),
        ("round_scale", _int),
        ("scale_format", _int),
    ]


class CxCombineArgs(ctypes.Structure):
    """struct epd_cx_combine_args."""

    _fields_ = [
        ("size", _size),
        ("handle", _u32),
        ("recv_weights", _int),
        ("apply_weights", _int),
        ("source_weights", ctypes.c_void_p),
        ("num_bias", _u32),
        ("bias", ctypes.c_void_p * 2),
        ("combined", ctypes.c_void_p),
        ("combined_topk_weights", ctypes.c_void_p),
        ("y_memory", _u32),
    ]


class CxStatus(ctypes.Structure):
    """struct epd_cx_status."""

    _fields_ = [
        ("size", _size),
        ("op", _u64),
        ("status", _int),
        ("message", ctypes.c_char * 256),
        ("kind_ops", _u64 * 2),
        ("phase_ns", (_u64 * 3) * 2),
        ("start_ns", _u64),
        ("end_ns", _u64),
        ("dispatch_first_ns", _u64 * 6),
    ]


class CxCounts(ctypes.Structure):
    """struct epd_cx_counts."""

    _fields_ = [
        ("size", _size),
        ("num_recv_tokens", _i32),
        ("num_expanded_rows", _i32),
        ("num_local_experts", _u32),
        ("num_recv_tokens_per_expert", ctypes.c_void_p),
        ("num_recv_tokens_per_expert_aligned", ctypes.c_void_p),
        ("world_size", _u32),
        ("rank_prefix", ctypes.c_void_p),
        ("expert_base", ctypes.c_void_p),
        ("rank_prefix_matrix", ctypes.c_void_p),
    ]


class CxBuffers(ctypes.Structure):
    """struct epd_cx_buffers."""

    _fields_ = [
        ("size", _size),
        ("bytes_per_rank", _u64),
        ("recv_rows", _u32),
        ("num_handle_slots", _u32),
        ("recv_x", ctypes.c_void_p),
        ("recv_scales", ctypes.c_void_p),
        ("recv_topk_idx", ctypes.c_void_p),
        ("recv_weights", ctypes.c_void_p),
        ("recv_src", ctypes.c_void_p),
        ("recv_topk_slot", ctypes.c_void_p),
        ("y", ctypes.c_void_p),
        ("y_weights", ctypes.c_void_p),
        ("recv_area_bytes", _u64),
        ("y_area_bytes", _u64),
    ]


# ---- administration (epd.h, "administration"; the epd.admin module) ----

_c_char_pp = ctypes.POINTER(ctypes.c_char_p)
_u64_p = ctypes.POINTER(_u64)


class AdminDevice(ctypes.Structure):
    """struct epd_admin_device."""

    _fields_ = [
        ("index", _u32),
        ("uuid", ctypes.c_char_p),
        ("name", ctypes.c_char_p),
        ("kind", ctypes.c_char_p),
        ("memory_bytes", _u64),
    ]


class DaemonStatusInfo(ctypes.Structure):
    """struct epd_daemon_status_info."""

    _fields_ = [
        ("version", ctypes.c_char_p),
        ("backend", ctypes.c_char_p),
        ("daemon_epoch", _u64),
        ("uptime_ms", _u64),
        ("pid", _i32),
        ("draining", _int),
        ("num_groups", _u32),
        ("num_clients", _u32),
        ("num_regions", _u32),
        ("region_bytes", _u64),
        ("ops_completed", _u64),
        ("ops_failed", _u64),
        ("num_devices", _u32),
        ("devices", ctypes.POINTER(AdminDevice)),
    ]


class AdminRank(ctypes.Structure):
    """struct epd_admin_rank."""

    _fields_ = [
        ("rank", _u32),
        ("bound", _int),
        ("client_id", _u64),
        ("device", _u32),
        ("next_op", _u64),
    ]


class GroupInfo(ctypes.Structure):
    """struct epd_group_info."""

    _fields_ = [
        ("id", _u64),
        ("name", ctypes.c_char_p),
        ("state", ctypes.c_char_p),
        ("config", GroupConfig),
        ("ops_completed", _u64),
        ("ops_failed", _u64),
        ("num_handles", _u32),
        ("pending_ops", _u32),
        ("num_ranks", _u32),
        ("ranks", ctypes.POINTER(AdminRank)),
        ("client_buffer_bytes_per_rank", _u64),
        ("owner_uid", _u32),
        ("memory_bytes", _u64),
    ]


class ClientInfo(ctypes.Structure):
    """struct epd_client_info."""

    _fields_ = [
        ("id", _u64),
        ("pid", _i32),
        ("uid", _u32),
        ("gid", _u32),
        ("name", ctypes.c_char_p),
        ("num_regions", _u32),
        ("region_bytes", _u64),
        ("outstanding_ops", _u32),
        ("num_bindings", _u32),
        ("bindings", _c_char_pp),
    ]


class AdminOpStats(ctypes.Structure):
    """struct epd_admin_op_stats."""

    _fields_ = [
        ("ops", _u64),
        ("bytes", _u64),
        ("num_errors", _u32),
        ("errors", _u64_p),
        ("latency_p50_ns", _u64),
        ("latency_p90_ns", _u64),
        ("latency_p99_ns", _u64),
        ("latency_max_ns", _u64),
        ("latency_count", _u64),
        ("latency_sum_ns", _u64),
        ("num_latency_buckets", _u32),
        ("latency_buckets", _u64_p),
    ]


class AdminRankStats(ctypes.Structure):
    """struct epd_admin_rank_stats."""

    _fields_ = [
        ("rank", _u32),
        ("bound", _int),
        ("client_id", _u64),
        ("device", _u32),
        ("dispatch", ctypes.POINTER(AdminOpStats)),
        ("combine", ctypes.POINTER(AdminOpStats)),
        ("arena_bytes", _u64),
        ("arena_used_bytes", _u64),
        ("queue_depth", _u32),
        ("next_op", _u64),
        ("client_ops", _u64),
        ("client_rows", _u64),
        ("client_bytes", _u64),
        ("client_failures", _u64),
        ("client_buffer_bytes", _u64),
        ("client_kind_ops", _u64 * 2),
        ("client_phase_ns", (_u64 * 3) * 2),
    ]


class AdminStageStats(ctypes.Structure):
    """struct epd_admin_stage_stats."""

    _fields_ = [
        ("op", ctypes.c_char_p),
        ("stage", ctypes.c_char_p),
        ("latency", ctypes.POINTER(AdminOpStats)),
    ]


class AdminGroupStats(ctypes.Structure):
    """struct epd_admin_group_stats."""

    _fields_ = [
        ("id", _u64),
        ("name", ctypes.c_char_p),
        ("state", ctypes.c_char_p),
        ("world_size", _u32),
        ("dispatch", ctypes.POINTER(AdminOpStats)),
        ("combine", ctypes.POINTER(AdminOpStats)),
        ("pending_ops", _u32),
        ("handles", _u32),
        ("num_ranks", _u32),
        ("ranks", ctypes.POINTER(AdminRankStats)),
        ("num_stages", _u32),
        ("stages", ctypes.POINTER(AdminStageStats)),
    ]


class AdminClientStats(ctypes.Structure):
    """struct epd_admin_client_stats."""

    _fields_ = [
        ("id", _u64),
        ("pid", _i32),
        ("name", ctypes.c_char_p),
        ("requests", _u64),
        ("ops", _u64),
        ("outstanding_ops", _u32),
        ("regions", _u32),
        ("region_bytes", _u64),
    ]


class AdminDeviceStats(ctypes.Structure):
    """struct epd_admin_device_stats."""

    _fields_ = [
        ("index", _u32),
        ("uuid", ctypes.c_char_p),
        ("kind", ctypes.c_char_p),
        ("ops", _u64),
        ("bytes", _u64),
        ("ranks", _u32),
    ]


class AdminDaemonStats(ctypes.Structure):
    """struct epd_admin_daemon_stats."""

    _fields_ = [
        ("backend", ctypes.c_char_p),
        ("uptime_ms", _u64),
        ("ops_completed", _u64),
        ("ops_failed", _u64),
        ("frames_in", _u64),
        ("frames_out", _u64),
        ("protocol_errors", _u64),
        ("clients_accepted", _u64),
        ("clients_refused", _u64),
        ("mailbox_replies", _u64),
        ("mailbox_requests", _u64),
        ("num_groups", _u32),
        ("groups", ctypes.POINTER(AdminGroupStats)),
        ("num_clients", _u32),
        ("clients", ctypes.POINTER(AdminClientStats)),
        ("num_devices", _u32),
        ("devices", ctypes.POINTER(AdminDeviceStats)),
    ]


class DrainResult(ctypes.Structure):
    """struct epd_drain_result."""

    _fields_ = [
        ("groups", _u32),
        ("executing_ops", _u32),
        ("waiting_ops", _u32),
        ("daemon_draining", _int),
    ]


class ResizeRank(ctypes.Structure):
    """struct epd_resize_rank."""

    _fields_ = [
        ("rank", _u32),
        ("old_bytes", _u64),
        ("new_bytes", _u64),
        ("segments", _u32),
        ("used_bytes", _u64),
        ("reserved_bytes", _u64),
    ]


class ResizeInfo(ctypes.Structure):
    """struct epd_resize_info."""

    _fields_ = [
        ("group_id", _u64),
        ("requested_bytes", _u64),
        ("old_bytes", _u64),
        ("new_bytes", _u64),
        ("wait_ns", _u64),
        ("num_ranks", _u32),
        ("ranks", ctypes.POINTER(ResizeRank)),
    ]



def c_struct_name(cls):
    """The C structure a mirror class stands for ("epd_group_config"), from its docstring."""
    return cls.__doc__.split()[1].rstrip(".")


# Every mirror of a public structure; load() checks each one's size against the library's.
STRUCTS = [cls for cls in list(globals().values())
           if isinstance(cls, type) and issubclass(cls, ctypes.Structure) and
           (cls.__doc__ or "").startswith("struct epd_")]

_c_void_pp = ctypes.POINTER(ctypes.c_void_p)
_PROTOTYPES = {
    "epd_status_name": (ctypes.c_char_p, [_int]),
    "epd_abi_struct_size": (_size, [ctypes.c_char_p]),
    "epd_client_connect": (_int, [ctypes.POINTER(ConnectArgs), _c_void_pp, ctypes.c_char_p,
                                  _size]),
    "epd_client_free": (None, [ctypes.c_void_p]),
    "epd_client_last_error": (ctypes.c_char_p, [ctypes.c_void_p]),
    "epd_client_daemon_info": (_int, [ctypes.c_void_p, ctypes.POINTER(DaemonInfo)]),
    "epd_region_register_fd": (_int, [ctypes.c_void_p, _int, _int, _u64, _u32, ctypes.c_void_p,
                                      ctypes.POINTER(_u64)]),
    "epd_region_release": (_int, [ctypes.c_void_p, _u64]),
    "epd_tensor_at": (_int, [ctypes.c_void_p, ctypes.c_void_p, _int, _u32,
                             ctypes.POINTER(_u64), ctypes.POINTER(Tensor)]),
    "epd_group_create": (_int, [ctypes.c_void_p, ctypes.POINTER(GroupArgs), _c_void_pp]),
    "epd_group_join": (_int, [ctypes.c_void_p, ctypes.POINTER(GroupArgs), _c_void_pp]),
    "epd_group_leave": (_int, [ctypes.c_void_p]),
    "epd_group_id": (_u64, [ctypes.c_void_p]),
    "epd_group_rank": (_u32, [ctypes.c_void_p]),
    "epd_group_config": (ctypes.POINTER(GroupConfig), [ctypes.c_void_p]),
    "epd_group_arena": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.POINTER(_u64)]),
    "epd_size_hint": (_int, [ctypes.c_void_p, ctypes.POINTER(GroupConfig), _u32,
                             ctypes.POINTER(SizeHint)]),
    "epd_dispatch_submit": (_int, [ctypes.c_void_p, ctypes.POINTER(DispatchArgs), _c_void_pp]),
    "epd_combine_submit": (_int, [ctypes.c_void_p, ctypes.POINTER(CombineArgs), _c_void_pp]),
    "epd_op_wait": (_int, [ctypes.c_void_p, _int]),
    "epd_op_status": (_int, [ctypes.c_void_p]),
    "epd_op_error": (ctypes.c_char_p, [ctypes.c_void_p]),
    "epd_op_dispatch_result": (_int, [ctypes.c_void_p, ctypes.POINTER(DispatchResult)]),
    "epd_op_combine_result": (_int, [ctypes.c_void_p, ctypes.POINTER(CombineResult)]),
    "epd_op_free": (None, [ctypes.c_void_p]),
    "epd_handle_release": (_int, [ctypes.c_void_p, _u64]),
    "epd_op_sequence": (_u64, [ctypes.c_void_p]),
    "epd_op_stream_wait": (_int, [ctypes.c_void_p, ctypes.c_void_p]),
    "epd_region_register_device": (_int, [ctypes.c_void_p, ctypes.c_void_p, _size, _u32,
                                          ctypes.POINTER(_u64)]),
    "epd_device_alloc": (_int, [ctypes.c_void_p, _u32, _u64, _c_void_pp, ctypes.POINTER(_u64)]),
    "epd_device_free": (_int, [ctypes.c_void_p, ctypes.c_void_p]),
    "epd_group_mark_inputs_ready": (_int, [ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.POINTER(_u64)]),
    "epd_group_mark_inputs_ready_host": (_int, [ctypes.c_void_p, ctypes.POINTER(_u64)]),
    "epd_client_capabilities": (_u64, [ctypes.c_void_p]),
    "epd_cx_dispatch": (_int, [ctypes.c_void_p, ctypes.POINTER(CxDispatchArgs),
                               ctypes.c_void_p]),
    "epd_cx_combine": (_int, [ctypes.c_void_p, ctypes.POINTER(CxCombineArgs), ctypes.c_void_p]),
    "epd_cx_status": (_int, [ctypes.c_void_p, ctypes.POINTER(CxStatus)]),
    "epd_cx_counts": (_int, [ctypes.c_void_p, _u32, ctypes.POINTER(CxCounts)]),
    "epd_cx_buffers": (_int, [ctypes.c_void_p, ctypes.POINTER(CxBuffers)]),
    "epd_bf16_to_float": (ctypes.c_float, [ctypes.c_uint16]),
    "epd_float_to_bf16": (ctypes.c_uint16, [ctypes.c_float]),
    # Administration: snapshots are opaque pointers, read through their accessors.
    "epd_daemon_status_get": (_int, [ctypes.c_void_p, _c_void_pp]),
    "epd_daemon_status_info": (ctypes.POINTER(DaemonStatusInfo), [ctypes.c_void_p]),
    "epd_daemon_status_free": (None, [ctypes.c_void_p]),
    "epd_group_list_get": (_int, [ctypes.c_void_p, _c_void_pp]),
    "epd_group_list_count": (_size, [ctypes.c_void_p]),
    "epd_group_list_at": (ctypes.POINTER(GroupInfo), [ctypes.c_void_p, _size]),
    "epd_group_list_free": (None, [ctypes.c_void_p]),
    "epd_client_list_get": (_int, [ctypes.c_void_p, _c_void_pp]),
    "epd_client_list_count": (_size, [ctypes.c_void_p]),
    "epd_client_list_at": (ctypes.POINTER(ClientInfo), [ctypes.c_void_p, _size]),
    "epd_client_list_free": (None, [ctypes.c_void_p]),
    "epd_stats_get": (_int, [ctypes.c_void_p, _c_void_pp]),
    "epd_stats_daemon": (ctypes.POINTER(AdminDaemonStats), [ctypes.c_void_p]),
    "epd_stats_free": (None, [ctypes.c_void_p]),
    "epd_drain": (_int, [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(DrainResult)]),
    "epd_undrain": (_int, [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(DrainResult)]),
    "epd_evict": (_int, [ctypes.c_void_p, _u64]),
    "epd_resize": (_int, [ctypes.c_void_p, ctypes.c_char_p, _u64, _c_void_pp]),
    "epd_resize_result_info": (ctypes.POINTER(ResizeInfo), [ctypes.c_void_p]),
    "epd_resize_result_free": (None, [ctypes.c_void_p]),
}

# The administration calls (epd.admin): a libepd without them still loads for everything else.
ADMIN_FUNCTIONS = (
    "epd_daemon_status_get", "epd_daemon_status_info", "epd_daemon_status_free",
    "epd_group_list_get", "epd_group_list_count", "epd_group_list_at", "epd_group_list_free",
    "epd_client_list_get", "epd_client_list_count", "epd_client_list_at",
    "epd_client_list_free", "epd_stats_get", "epd_stats_daemon", "epd_stats_free",
    "epd_drain", "epd_undrain", "epd_evict", "epd_resize", "epd_resize_result_info",
    "epd_resize_result_free")

# The client-executed calls (Group.cx_*): a libepd without them loads for daemon-executed groups.
CX_FUNCTIONS = ("epd_cx_dispatch", "epd_cx_combine", "epd_cx_status", "epd_cx_counts",
                "epd_cx_buffers")

# Declared in epd.h but not needed by the binding's host path: a library without them still
# loads (lib.optional[name] is then None). libepd.so of some builds does not export the bf16
# helpers; older ones lack the GPU calls.
_OPTIONAL = {"epd_op_sequence", "epd_op_stream_wait", "epd_bf16_to_float", "epd_float_to_bf16",
             "epd_region_register_device", "epd_device_alloc", "epd_device_free",
             "epd_group_mark_inputs_ready",
             "epd_group_mark_inputs_ready_host", "epd_client_capabilities"} | set(ADMIN_FUNCTIONS) \
    | set(CX_FUNCTIONS)
_NAMES = ("libepd.so", "libepd.so.0")

_lib = None
_lib_lock = threading.Lock()


def _env_library():
    """``$EPD_LIBRARY`` as a file path (a directory means its libepd.so), or None."""
    env = os.environ.get("EPD_LIBRARY")
    if not env:
        return None
    if os.path.isdir(env):
        for name in _NAMES:
            if os.path.exists(os.path.join(env, name)):
                return os.path.join(env, name)
        return os.path.join(env, _NAMES[0])
    return env


def candidate_paths():
    """The places, in order, where :func:`load` looks for libepd (see the module docstring)."""
    env = _env_library()
    if env:
        return [env]
    paths = []
    for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        if d:
            for name in _NAMES:
                p = os.path.join(d, name)
                if os.path.exists(p) and p not in paths:
                    paths.append(p)
    here = os.path.dirname(os.path.abspath(__file__))
    paths.append(os.path.normpath(os.path.join(here, "..", "..", "..", "build", "lib",
                                               "libepd.so")))
    for prefix in (sys.prefix, "/usr/local"):
        for name in _NAMES:
            p = os.path.join(prefix, "lib", name)
            if os.path.exists(p) and p not in paths:
                paths.append(p)
    paths += ["libepd.so.0", "libepd.so"]
    return paths


def load():
    """Returns the loaded libepd (a ctypes.CDLL), loading it on first use.

    Raises OSError naming every place tried when none works. ``EPD_LIBRARY``, when set, is the
    only place tried: a wrong path there is an error, not a reason to pick another library.
    """
    global _lib
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        paths = candidate_paths()
        errors = []
        for path in paths:
            if os.sep in path and not os.path.exists(path):
                errors.append("%s: no such file" % path)
                continue
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                hint = ""
                if "cannot open shared object file" in str(e) and os.sep in path:
                    hint = (" (a library it needs is missing: put the directory holding it in "
                            "LD_LIBRARY_PATH before starting python)")
                errors.append("%s: %s%s" % (path, e, hint))
                continue
            missing = [name for name in _PROTOTYPES
                       if name not in _OPTIONAL and not hasattr(lib, name)]
            if missing:
                errors.append("%s: lacks %s (an older libepd? rebuild it)" %
                              (path, ", ".join(missing)))
                continue
            lib.optional = {}
            for name, (restype, argtypes) in _PROTOTYPES.items():
                if not hasattr(lib, name):
                    lib.optional[name] = None
                    continue
                fn = getattr(lib, name)
                fn.restype = restype
                fn.argtypes = argtypes
                if name in _OPTIONAL:
                    lib.optional[name] = fn
            # A library built from other sources than these mirrors would be read and written
            # past its structures' ends.
            differ = ["struct %s is %d bytes there, %d here" %
                      (c_struct_name(cls), lib.epd_abi_struct_size(c_struct_name(cls).encode()),
                       ctypes.sizeof(cls))
                      for cls in STRUCTS
                      if lib.epd_abi_struct_size(c_struct_name(cls).encode()) !=
                      ctypes.sizeof(cls)]
            if differ:
                errors.append("%s: built from other sources than this binding (%s)" %
                              (path, "; ".join(differ)))
                continue
            lib.path = path
            _lib = lib
            return lib
        raise OSError("cannot load libepd (set EPD_LIBRARY to the path of libepd.so): " +
                      "; ".join(errors))


def status_name(status):
    """The name of a status code ("OK", "INVALID_ARGUMENT", ...), without loading libepd."""
    names = ["OK", "INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED",
             "CAPACITY_EXCEEDED", "PEER_LOST", "TIMEOUT", "ABORTED", "UNAVAILABLE",
             "VERSION_MISMATCH", "INTERNAL"]
    if isinstance(status, int) and -len(names) < status <= 0:
        return names[-status]
    return "UNKNOWN"


def text(value):
    """Decodes a C string returned by libepd (None stays "")."""
    return value.decode("utf-8", "replace") if value else ""
