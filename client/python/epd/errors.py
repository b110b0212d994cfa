"""Exceptions: one class per epd status code (docs/semantics.md section 4).

Every exception the binding raises for a failed call is an :class:`Error` carrying ``status``
(the negative ``enum epd_status`` value), ``status_name`` ("CAPACITY_EXCEEDED", ...) and
``message``, the daemon's or libepd's own text (``epd_client_last_error`` / ``epd_op_error``).
Where a Python built-in exception means the same thing, the class derives from it too, so
``except TimeoutError`` or ``except ValueError`` also work.
"""

from . import _lib


class Error(Exception):
    """A failed epd call. ``status``, ``status_name`` and ``message`` say why."""

    status = _lib.INTERNAL

    def __new__(cls, message="", status=None):
        # Only the message reaches the built-in base: OSError subclasses (TimeoutError, ...)
        # would read a second positional argument as errno.
        return super().__new__(cls, message)

    def __init__(self, message="", status=None):
        if status is not None:
            self.status = status
        self.message = message
        Exception.__init__(self, message)

    @property
    def status_name(self):
        """The status's name, e.g. "PERMISSION_DENIED"."""
        return _lib.status_name(self.status)

    def __str__(self):
        return "%s: %s" % (self.status_name, self.message) if self.message else self.status_name

    def __reduce__(self):
        # Exceptions cross process boundaries (multiprocessing); keep class, message, status.
        return (_rebuild, (type(self), self.message, self.status))


def _rebuild(cls, message, status):
    return cls(message, status)


class InvalidArgument(Error, ValueError):
    """INVALID_ARGUMENT: the request is malformed or inconsistent across ranks."""

    status = _lib.INVALID_ARGUMENT


class NotFound(Error, LookupError):
    """NOT_FOUND: no such group, handle or region (or a pointer outside every region)."""

    status = _lib.NOT_FOUND


class AlreadyExists(Error):
    """ALREADY_EXISTS: the group exists, or the rank is already bound."""

    status = _lib.ALREADY_EXISTS


class PermissionDenied(Error, PermissionError):
    """PERMISSION_DENIED: wrong group secret, or a resource of another client."""

    status = _lib.PERMISSION_DENIED


class CapacityExceeded(Error):
    """CAPACITY_EXCEEDED: the outputs of some rank do not fit (no token is ever dropped)."""

    status = _lib.CAPACITY_EXCEEDED


class PeerLost(Error, ConnectionError):
    """PEER_LOST: another rank's client went away before the op completed everywhere."""

    status = _lib.PEER_LOST


class Timeout(Error, TimeoutError):
    """TIMEOUT: a peer did not submit within the group's op timeout, or a wait timed out.

    ``op_pending`` is True when only the local wait timed out (``Future.wait(timeout=...)``):
    the op itself is still in flight and may be waited on again.
    """

    status = _lib.TIMEOUT
    op_pending = False


class Aborted(Error):
    """ABORTED: aborted by an operator or by group teardown."""

    status = _lib.ABORTED


class Unavailable(Error, ConnectionError):
    """UNAVAILABLE: the daemon, the connection, the backend or the device is not usable."""

    status = _lib.UNAVAILABLE


class VersionMismatch(Error):
    """VERSION_MISMATCH: the daemon speaks another protocol version."""

    status = _lib.VERSION_MISMATCH


class Internal(Error):
    """INTERNAL: a bug or an unexpected condition inside epd."""

    status = _lib.INTERNAL


_BY_STATUS = {cls.status: cls for cls in (
    InvalidArgument, NotFound, AlreadyExists, PermissionDenied, CapacityExceeded, PeerLost,
    Timeout, Aborted, Unavailable, VersionMismatch, Internal)}


def error_class(status):
    """The :class:`Error` subclass for a status code (``Internal`` for unknown codes)."""
    return _BY_STATUS.get(status, Internal)


def make_error(status, message):
    """An exception instance for a failed call."""
    cls = error_class(status)
    return cls(message, status if status in _BY_STATUS else _lib.INTERNAL)
