"""Errors of the device worker. The CLI prints the message (one line) and exits non-zero.

Protocol violations (a handshake mismatch, a corrupted or desynchronised message) raise
`tracevq.errors.ProtocolError`, the codec's error, so that callers catch one type for both.
"""

from tracevq.errors import ProtocolError

__all__ = ["WorkerError", "SpecError", "ConnectError", "PeerLostError", "ProtocolError"]


class WorkerError(Exception):
    """Base class of the errors the worker raises on purpose."""


class SpecError(WorkerError):
    """The run spec (file or flags) is invalid; the message names the key."""


class ConnectError(WorkerError):
    """The mesh could not be set up in time; the message names the peer and its address."""


class PeerLostError(WorkerError):
    """A peer closed its connection, failed or went silent mid-session; names peer and block."""
