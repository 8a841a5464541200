"""The set-up's frames: length-prefixed JSON, read with bounds and strictly, and what each
frame may hold.

A connection's handshake (devices.handshake) is a few frames each way: a hello, a verdict
and, from the side that connected, a clock estimate. A frame's length is checked before
anything is read (MAX_FRAME_BYTES), its bytes must be strict JSON (no NaN, Infinity or
number that overflows a double; nesting beyond the parser's depth is refused, never a
RecursionError), and its object is validated against a typed schema (`Hello`, `Verdict`,
`ClockEstimate`: strict types, bounded ranges and lengths, no unknown or missing keys)
before any field is used or printed. Every problem is a ProtocolError; the handshake adds
the peer's name.
"""

from __future__ import annotations

import json
import math
import socket
import struct
import time
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from devices.clock import ANCILLARY_BYTES, Clock, enable_rx_timestamps
from devices.errors import ProtocolError, printable
from devices.transport import PeerClosed

FRAME_HEADER = struct.Struct("!I")
# a handshake frame of a session with hundreds of runs takes tens of kB; the limit bounds
# what a peer can make this device allocate before anything is checked
MAX_FRAME_BYTES = 1 << 20
NONCE_BYTES = 16  # of the random nonce in every hello, fresh per connection
CLOCK_ROUNDS = 8  # ping-pongs behind a clock estimate

# Bounds of what a peer's hello may hold: far beyond any real session, small enough that
# checking and printing a hostile hello costs nothing.
MAX_DEVICES = 4096
MAX_RUNS = 4096
MAX_PARAMS = 64
MAX_COUNT = 1 << 40  # inferences, warm-ups, tokens, batch
# what a clock time may be (CLOCK_REALTIME from 1970 to 2116): every offset, round trip and
# one-way time derived from such times, on either side, stays an int64
CLOCK_RANGE_NS = 1 << 62
MAX_SHOWN_CHARS = 2000  # of a value in an error line
MAX_SHOWN_KEY_CHARS = 40  # of each part of a field's path (a peer's key) in an error line
Text = Annotated[str, StringConstraints(max_length=1000)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Param = int | float | bool | Text | None


class _Strict(BaseModel):
    # strict: JSON types as they are (no "1" for 1, no true for 1); unknown keys refused
    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())


class RunHello(_Strict):
    id: Text
    method: Text
    params: dict[Text, Param] = Field(max_length=MAX_PARAMS)
    bundle_fingerprint: Text | None
    inferences: Annotated[int, Field(ge=1, le=MAX_COUNT)]


class Hello(_Strict):
    """What a peer's hello may hold (`make_hello` writes one)."""

    protocol: int
    rank: Annotated[int, Field(ge=0, lt=MAX_DEVICES)]
    devices: Annotated[int, Field(ge=1, le=MAX_DEVICES)]
    runs: list[RunHello] = Field(min_length=1, max_length=MAX_RUNS)
    partition: list[Count] = Field(min_length=1, max_length=MAX_DEVICES)
    batch: Annotated[int, Field(ge=1, le=MAX_COUNT)]
    model: Text
    model_fingerprint: Text
    warmup: Count
    inputs: Text
    authenticated: bool
    nonce: Annotated[str, StringConstraints(pattern=f"^[0-9a-f]{{{2 * NONCE_BYTES}}}$")]


class Verdict(_Strict):
    ok: bool
    error: Annotated[str, StringConstraints(max_length=MAX_SHOWN_CHARS)] | None
    proof: Annotated[str, StringConstraints(pattern="^[0-9a-f]{64}$")] | None = None


ClockSpan = Annotated[int, Field(ge=0, lt=CLOCK_RANGE_NS)]
SignedClockSpan = Annotated[int, Field(gt=-CLOCK_RANGE_NS, lt=CLOCK_RANGE_NS)]


class ClockEstimate(_Strict):
    """What the side that measured the clock tells the other: within the bounds that the
    measuring side's own answers (CLOCK_RANGE_NS) give every quantity it derives."""

    offset_ns: SignedClockSpan
    uncertainty_ns: ClockSpan
    round_trips_ns: list[ClockSpan] = Field(min_length=CLOCK_ROUNDS, max_length=CLOCK_ROUNDS)
    latency_ns: SignedClockSpan


def validated(model: type[_Strict], data: dict[str, Any], what: str) -> _Strict:
    """`data` as `model`, or a ProtocolError naming each bad field (never its value: a
    hostile value may be huge or nested deep; each part of the field's path, which holds the
    peer's keys, shortened)."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        problems = []
        for problem in error.errors(include_input=False, include_url=False)[:5]:
            parts = (shorten(part, MAX_SHOWN_KEY_CHARS) for part in problem["loc"])
            where = ".".join(parts) or what
            problems.append(f"{where}: {problem['msg']}")
        more = error.error_count() - len(problems)
        extra = f" (and {more} more)" if more > 0 else ""
        raise ProtocolError(f"malformed {what}: {'; '.join(problems)}{extra}") from None


def shorten(value: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """A peer's value for an error line, escaped (`printable`) and shortened to `limit`
    characters."""
    text = printable(str(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def brief(value: object) -> str:
    """A peer's value for an error line: a scalar as it is (shortened), else its type."""
    if value is None or isinstance(value, bool | int | float | str):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    return f"a JSON {type(value).__name__}"


class CountingSocket:
    """A socket with exact reads and length-prefixed JSON frames, counting bytes each way.

    With a `deadline` (perf_counter), every read and write ends by then (TimeoutError): a
    peer that trickles one byte at a time cannot stretch the set-up beyond it."""

    def __init__(self, sock: socket.socket, deadline: float | None = None):
        self.sock, self.deadline = sock, deadline
        self.bytes_sent = 0
        self.bytes_received = 0

    def _budget(self) -> None:
        if self.deadline is not None:
            remaining = self.deadline - time.perf_counter()
            if remaining <= 0:
                raise TimeoutError("the handshake's deadline passed")
            self.sock.settimeout(remaining)

    def send(self, data: bytes) -> None:
        self._budget()
        self.sock.sendall(data)
        self.bytes_sent += len(data)

    def recv_exact(self, size: int) -> bytes:
        buffer = bytearray(size)
        view, received = memoryview(buffer), 0
        while received < size:
            self._budget()
            count = self.sock.recv_into(view[received:])
            if count == 0:
                raise PeerClosed(received)
            received += count
        self.bytes_received += size
        return bytes(buffer)

    def recv_exact_stamped(self, size: int, clock: Clock) -> tuple[bytes, int]:
        """`size` bytes and when the last of them reached this host on `clock`: the kernel's
        receive timestamp (the socket's are turned on), else the time they were read."""
        enable_rx_timestamps(self.sock)
        buffer = bytearray(size)
        view, received, stamp = memoryview(buffer), 0, None
        while received < size:
            self._budget()
            count, ancillary, _, _ = self.sock.recvmsg_into([view[received:]], ANCILLARY_BYTES)
            if count == 0:
                raise PeerClosed(received)
            received, stamp = received + count, clock.kernel_ns(ancillary) or stamp
        self.bytes_received += size
        return bytes(buffer), clock.now_ns() if stamp is None else stamp

    def send_frame(self, payload: dict) -> None:
        body = json.dumps(payload, sort_keys=True).encode()
        self.send(FRAME_HEADER.pack(len(body)) + body)

    def recv_frame(self) -> dict:
        """One frame's JSON object. Raises ProtocolError (without naming the peer: the
        caller does) for an oversized frame, bytes that are not JSON (NaN and Infinity are
        not JSON either), nesting too deep for the parser or a value that is not an object;
        the caller validates the object's fields."""
        # the length's first byte is 0 in every frame within the limit: checked alone, so a
        # peer out of step (a clock ping where a frame is due) is refused at once, not held
        # waiting for the rest of a length it never sends
        first = self.recv_exact(1)
        if first != b"\0":
            raise ProtocolError(
                f"handshake frame of at least {first[0] << 24} bytes (limit "
                f"{MAX_FRAME_BYTES}): the peer does not speak this protocol"
            )
        (size,) = FRAME_HEADER.unpack(first + self.recv_exact(FRAME_HEADER.size - 1))
        if size > MAX_FRAME_BYTES:
            raise ProtocolError(
                f"handshake frame of {size} bytes (limit {MAX_FRAME_BYTES}): "
                "the peer does not speak this protocol"
            )
        body = self.recv_exact(size)
        try:
            payload = json.loads(body, parse_constant=_refuse_constant, parse_float=_finite)
        except RecursionError:
            raise ProtocolError("handshake frame is nested too deeply") from None
        except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, int digit limit
            raise ProtocolError(f"handshake frame is not JSON: {error}") from None
        if not isinstance(payload, dict):
            raise ProtocolError(
                f"handshake frame is a JSON {type(payload).__name__}, not an object"
            )
        return payload


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999
        raise ValueError(f"number {text[:20]} overflows a double")
    return value
