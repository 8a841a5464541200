"""Errors of the device worker. The CLI prints the message (one line) and exits non-zero.

A peer is never trusted: whatever it sends that breaks the protocol (a malformed, oversized
or mismatched handshake, a message that cannot be delimited or decoded, an index beyond its
codebook, a non-finite activation) raises `ProtocolError`, naming the peer (rank and
address) and, once the session runs, the block and the inference. The method library
raises its own `tracevq.errors.ProtocolError` (here `MessageError`) for a bad message; the
worker's `ProtocolError` is a subclass of both, so that one `except MessageError` catches
every protocol violation.
"""

from tracevq.errors import ProtocolError as MessageError

__all__ = [
    "printable",
    "WorkerError",
    "SpecError",
    "ConnectError",
    "PeerLostError",
    "ProtocolError",
    "MessageError",
]


def printable(text: str) -> str:
    """`text` with every character that is not printable (escape sequences, carriage
    returns, bells) written as its Python escape: a string a peer controls (a hello's model,
    a refusal's reason) reaches a terminal or a log as text, never as a command to it."""
    return "".join(
        char if char.isprintable() else char.encode("unicode_escape").decode("ascii")
        for char in text
    )


class WorkerError(Exception):
    """Base class of the errors the worker raises on purpose."""


class SpecError(WorkerError):
    """The run spec (file or flags) is invalid; the message names the key."""


class ConnectError(WorkerError):
    """The mesh could not be set up in time; the message names the peer and its address."""


class PeerLostError(WorkerError):
    """A peer closed its connection, failed or went silent mid-session; names peer and block."""


class ProtocolError(WorkerError, MessageError):
    """A peer broke the protocol; the message names the peer (rank and address) and, after
    the handshake, the block and the inference."""
