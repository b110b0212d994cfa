"""Administration: what ``epctl`` shows and does, from Python (epd.h, "administration").

Reading is open to every client::

    import epd
    from epd import admin

    with epd.connect() as client:
        print(admin.status(client)["draining"])
        for g in admin.groups(client):
            print(g["name"], g["state"], [r["client_id"] for r in g["ranks"]])
        print(admin.stats(client)["groups"][0]["dispatch"]["latency_p99_ns"])

The verbs :func:`drain`, :func:`undrain`, :func:`evict` and :func:`resize` need root or the
daemon's ``admin_group`` (``client.capabilities()`` has bit 8, ``EPD_CAP_ADMIN``); anyone
else gets :class:`epd.PermissionDenied` and nothing changes. Every failure raises the :class:`epd.Error`
subclass of its status with the daemon's message.

Each reading call asks the daemon once and returns plain Python values (dicts and lists, keys as
the C struct fields), so nothing refers to libepd's snapshot after the call. A ``group`` names a
group by its name, or by its id (an int, or a decimal string) when no group has that name.
"""

import ctypes

from . import _lib
from .client import check
from .errors import InvalidArgument, Unavailable

_DTYPE_NAMES = {_lib.DTYPE_BF16: "bf16", _lib.DTYPE_FP8_E4M3: "fp8"}


def _fn(name):
    lib = _lib.load()
    fn = lib.optional.get(name)
    if fn is None:
        raise Unavailable("%s lacks %s: a libepd without the administration calls "
                          "(rebuild it)" % (lib.path, name))
    return fn


def _open(client):
    client._check_open()
    return client._ptr


def _group_arg(group, what):
    """The C form of a group selector: bytes of its name or decimal id (None stays None)."""
    if group is None:
        return None
    if isinstance(group, bool):
        raise InvalidArgument("%s: a group is a name or an id, not %r" % (what, group))
    if isinstance(group, int):
        if not 0 < group < 1 << 64:
            raise InvalidArgument("%s: group ids start at 1, not %d" % (what, group))
        return str(group).encode()
    if isinstance(group, str):
        if not group:
            raise InvalidArgument("%s: the group name is empty" % what)
        return group.encode()
    raise InvalidArgument("%s: a group is a name (str) or an id (int), not %s" %
                          (what, type(group).__name__))


def _snapshot(client, get, free):
    """Calls get(client, &snapshot); returns the snapshot pointer, to be freed by free."""
    ptr = _open(client)
    snap = ctypes.c_void_p()
    check(client, _fn(get)(ptr, ctypes.byref(snap)))
    return snap, _fn(free)


def _list(client, kind, convert):
    """convert() of every element of an epd_<kind>_list snapshot, in order."""
    snap, free = _snapshot(client, "epd_%s_list_get" % kind, "epd_%s_list_free" % kind)
    try:
        at = _fn("epd_%s_list_at" % kind)
        return [convert(at(snap, i).contents)
                for i in range(_fn("epd_%s_list_count" % kind)(snap))]
    finally:
        free(snap)


def status(client):
    """The daemon's status (``epd_daemon_status_get``) as a dict.

    Keys: version, backend, daemon_epoch, uptime_ms, pid, draining (bool), num_groups,
    num_clients, num_regions, region_bytes, ops_completed, ops_failed, and devices (a list of
    dicts: index, uuid, name, kind, memory_bytes).
    """
    snap, free = _snapshot(client, "epd_daemon_status_get", "epd_daemon_status_free")
    try:
        s = _fn("epd_daemon_status_info")(snap).contents
        return {
            "version": _lib.text(s.version), "backend": _lib.text(s.backend),
            "daemon_epoch": s.daemon_epoch, "uptime_ms": s.uptime_ms, "pid": s.pid,
            "draining": bool(s.draining), "num_groups": s.num_groups,
            "num_clients": s.num_clients, "num_regions": s.num_regions,
            "region_bytes": s.region_bytes, "ops_completed": s.ops_completed,
            "ops_failed": s.ops_failed,
            "devices": [{"index": d.index, "uuid": _lib.text(d.uuid), "name": _lib.text(d.name),
                         "kind": _lib.text(d.kind), "memory_bytes": d.memory_bytes}
                        for d in s.devices[:s.num_devices]],
        }
    finally:
        free(snap)


def _config(c):
    return {
        "world_size": c.world_size, "num_experts": c.num_experts, "hidden": c.hidden,
        "max_tokens_per_rank": c.max_tokens_per_rank, "max_topk": c.max_topk,
        "dtype": _DTYPE_NAMES.get(c.dispatch_dtype, "invalid"), "scale_block": c.scale_block,
        "op_timeout_ms": c.op_timeout_ms, "arena_bytes": c.arena_bytes,
    }


def groups(client):
    """Every group of the daemon (``epd_group_list_get``): a list of dicts.

    Keys: id, name, state ("FORMING", "READY", "DRAINING", "BROKEN", "CLOSED"), config (a dict:
    world_size, num_experts, hidden, max_tokens_per_rank, max_topk, dtype "bf16" or "fp8",
    scale_block, op_timeout_ms, arena_bytes), ops_completed, ops_failed, num_handles,
    pending_ops, owner_uid (who created it), memory_bytes (its output arenas and
    client-executed buffers, what the owner's max_group_bytes_per_uid counts), and ranks
    (dicts: rank, bound, client_id, device, next_op).
    """
    return _list(client, "group", lambda g: {
        "id": g.id, "name": _lib.text(g.name), "state": _lib.text(g.state),
        "config": _config(g.config), "ops_completed": g.ops_completed,
        "ops_failed": g.ops_failed, "num_handles": g.num_handles, "pending_ops": g.pending_ops,
        "owner_uid": g.owner_uid, "memory_bytes": g.memory_bytes,
        "ranks": [{"rank": r.rank, "bound": bool(r.bound), "client_id": r.client_id,
                   "device": r.device, "next_op": r.next_op} for r in g.ranks[:g.num_ranks]],
    })


def clients(client):
    """Every connected client, the caller included (``epd_client_list_get``): dicts.

    Keys: id (what :func:`evict` takes), pid, uid, gid, name ("" when none), num_regions,
    region_bytes, outstanding_ops, bindings (a list of "group/rank").
    """
    return _list(client, "client", lambda c: {
        "id": c.id, "pid": c.pid, "uid": c.uid, "gid": c.gid, "name": _lib.text(c.name),
        "num_regions": c.num_regions, "region_bytes": c.region_bytes,
        "outstanding_ops": c.outstanding_ops,
        "bindings": [_lib.text(b) for b in c.bindings[:c.num_bindings]],
    })


def _op_stats(p):
    o = p.contents
    return {
        "ops": o.ops, "bytes": o.bytes,
        "errors": {_lib.status_name(-i): o.errors[i] for i in range(1, o.num_errors)
                   if o.errors[i]},
        "latency_p50_ns": o.latency_p50_ns, "latency_p90_ns": o.latency_p90_ns,
        "latency_p99_ns": o.latency_p99_ns, "latency_max_ns": o.latency_max_ns,
        "latency_count": o.latency_count, "latency_sum_ns": o.latency_sum_ns,
        "latency_buckets": list(o.latency_buckets[:o.num_latency_buckets]),
    }


def _client_executed(r):
    """A client-executed rank's counters (None for a daemon-executed group's rank): ops, rows,
    bytes, failures, buffer_bytes, and phases per op kind (ops, exchange_ns, move_ns,
    finish_ns: docs/client-execution.md)."""
    if not r.client_buffer_bytes:
        return None
    return {"ops": r.client_ops, "rows": r.client_rows, "bytes": r.client_bytes,
            "failures": r.client_failures, "buffer_bytes": r.client_buffer_bytes,
            "phases": {kind: {"ops": r.client_kind_ops[k],
                              "exchange_ns": r.client_phase_ns[k][0],
                              "move_ns": r.client_phase_ns[k][1],
                              "finish_ns": r.client_phase_ns[k][2]}
                       for k, kind in enumerate(("dispatch", "combine"))}}


def stats(client):
    """The daemon's statistics (``epd_stats_get``) as a dict, as ``epctl stats --json`` has them.

    Op statistics are dicts of ops, bytes, errors ({status name: count}, failures only),
    latency_p50_ns, latency_p90_ns, latency_p99_ns, latency_max_ns, latency_count,
    latency_sum_ns and latency_buckets (ops below 2**i microseconds). The top level has backend,
    uptime_ms, ops_completed, ops_failed, frames_in, frames_out, protocol_errors,
    clients_accepted, clients_refused, mailbox_replies, mailbox_requests, and lists groups (id,
    name, state, world_size, dispatch, combine, pending_ops, handles, stages of op/stage/latency,
    ranks of rank, bound, client_id, device, dispatch, combine, arena_bytes, arena_used_bytes,
    queue_depth, next_op, client: what a client-executed rank's own ops counted, else None),
    clients (id, pid, name, requests, ops, outstanding_ops, regions,
    region_bytes) and devices (index, uuid, kind, ops, bytes, ranks).
    """
    snap, free = _snapshot(client, "epd_stats_get", "epd_stats_free")
    try:
        s = _fn("epd_stats_daemon")(snap).contents
        out = {name: getattr(s, name) for name in (
            "uptime_ms", "ops_completed", "ops_failed", "frames_in", "frames_out",
            "protocol_errors", "clients_accepted", "clients_refused", "mailbox_replies",
            "mailbox_requests")}
        out["backend"] = _lib.text(s.backend)
        out["groups"] = [{
            "id": g.id, "name": _lib.text(g.name), "state": _lib.text(g.state),
            "world_size": g.world_size, "dispatch": _op_stats(g.dispatch),
            "combine": _op_stats(g.combine), "pending_ops": g.pending_ops,
            "handles": g.handles,
            "stages": [{"op": _lib.text(st.op), "stage": _lib.text(st.stage),
                        "latency": _op_stats(st.latency)} for st in g.stages[:g.num_stages]],
            "ranks": [{"rank": r.rank, "bound": bool(r.bound), "client_id": r.client_id,
                       "device": r.device, "dispatch": _op_stats(r.dispatch),
                       "combine": _op_stats(r.combine), "arena_bytes": r.arena_bytes,
                       "arena_used_bytes": r.arena_used_bytes, "queue_depth": r.queue_depth,
                       "next_op": r.next_op, "client": _client_executed(r)}
                      for r in g.ranks[:g.num_ranks]],
        } for g in s.groups[:s.num_groups]]
        out["clients"] = [{
            "id": c.id, "pid": c.pid, "name": _lib.text(c.name), "requests": c.requests,
            "ops": c.ops, "outstanding_ops": c.outstanding_ops, "regions": c.regions,
            "region_bytes": c.region_bytes,
        } for c in s.clients[:s.num_clients]]
        out["devices"] = [{
            "index": d.index, "uuid": _lib.text(d.uuid), "kind": _lib.text(d.kind), "ops": d.ops,
            "bytes": d.bytes, "ranks": d.ranks,
        } for d in s.devices[:s.num_devices]]
        return out
    finally:
        free(snap)


def _drain(client, name, group):
    arg = _group_arg(group, name)
    ptr = _open(client)
    r = _lib.DrainResult()
    check(client, _fn("epd_" + name)(ptr, arg, ctypes.byref(r)))
    return {"groups": r.groups, "executing_ops": r.executing_ops, "waiting_ops": r.waiting_ops,
            "daemon_draining": bool(r.daemon_draining)}


def drain(client, group=None):
    """Stops launching ops of ``group``, or of the whole daemon when None (``epd_drain``).

    Draining fails no op: an op every rank submitted waits until :func:`undrain` (its
    ``Future.wait`` times out meanwhile), the op executing finishes, and submissions are still
    collected. Returns a dict: groups (whose state changed), executing_ops, waiting_ops,
    daemon_draining. NotFound for an unknown group; InvalidArgument for one that is not READY.
    """
    return _drain(client, "drain", group)


def undrain(client, group=None):
    """Resumes ``group``, or the daemon and every drained group when None (``epd_undrain``).

    Returns the same dict as :func:`drain`.
    """
    return _drain(client, "undrain", group)


def evict(client, client_id):
    """Disconnects client ``client_id`` as if it had crashed (``epd_evict``): the peers of its
    ranks get :class:`epd.PeerLost`. NotFound when it is not connected."""
    if isinstance(client_id, bool) or not isinstance(client_id, int) or not \
            0 <= client_id < 1 << 64:
        raise InvalidArgument("evict: a client id is an int >= 0 (see admin.clients), not %r" %
                              (client_id,))
    check(client, _fn("epd_evict")(_open(client), client_id))


def resize(client, group, nbytes):
    """Grows or shrinks every rank's output arena of ``group`` to ``nbytes`` (``epd_resize``).

    The group's ops are held meanwhile; arenas keep their addresses, and a shrink stops above a
    rank's live outputs. Returns a dict: group_id, requested_bytes, old_bytes, new_bytes,
    wait_ns, ranks (dicts: rank, old_bytes, new_bytes, segments, used_bytes, reserved_bytes).
    """
    if group is None:
        raise InvalidArgument("resize: name a group (its name or id)")
    arg = _group_arg(group, "resize")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 < nbytes < 1 << 64:
        raise InvalidArgument("resize: the new arena size is a number of bytes > 0, not %r" %
                              (nbytes,))
    ptr = _open(client)
    res = ctypes.c_void_p()
    check(client, _fn("epd_resize")(ptr, arg, nbytes, ctypes.byref(res)))
    try:
        r = _fn("epd_resize_result_info")(res).contents
        return {
            "group_id": r.group_id, "requested_bytes": r.requested_bytes,
            "old_bytes": r.old_bytes, "new_bytes": r.new_bytes, "wait_ns": r.wait_ns,
            "ranks": [{"rank": k.rank, "old_bytes": k.old_bytes, "new_bytes": k.new_bytes,
                       "segments": k.segments, "used_bytes": k.used_bytes,
                       "reserved_bytes": k.reserved_bytes} for k in r.ranks[:r.num_ranks]],
        }
    finally:
        _fn("epd_resize_result_free")(res)
