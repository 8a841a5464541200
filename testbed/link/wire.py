"""The arithmetic of frames on a link: TCP segments and their frames, wire times, the
schedule of a serial link's port and the size of its queue.

Pure functions, used by the serial emulator (`testbed.link.serial.program`, whose docstring gives
its decisions), the result rows (`wire_comm_ms`) and the rate probe. Rates are bit/s of whole
Ethernet frames as AF_PACKET and tbf see them: header included, no FCS, preamble or inter-frame gap.
MTU 1500 and TCP timestamps (Linux's default) are assumed throughout.
"""

from __future__ import annotations

import math

# the worker's own TCP arithmetic (its level choice needs it too), re-exported
from devices.transport import TCP_FRAME_HEADER_BYTES as TCP_FRAME_HEADER_BYTES
from devices.transport import TCP_MSS_BYTES as TCP_MSS_BYTES
from devices.transport import tcp_frame_bytes as tcp_frame_bytes
from testbed.errors import ShapingError

FULL_FRAME_BYTES = 1514  # MTU 1500 + Ethernet header
QUEUE_MS = 50.0  # as tbf's queue_latency_ms
QUEUE_BURST_FRAMES = 2  # as tbf's bucket
MIN_QUEUE_FRAMES = 32  # TCP's initial window (10 segments) with room to spare
TRUESIZE_BYTES = 2304  # kernel memory a queued full frame costs (measured: 2280)


def wire_time_s(frame_bytes: int, rate_bit_s: float) -> float:
    """Seconds a frame (Ethernet header included, no FCS) occupies a line of `rate_bit_s`."""
    if rate_bit_s <= 0:
        raise ShapingError(f"a serial link's rate must be positive, got {rate_bit_s} bit/s")
    return frame_bytes * 8 / rate_bit_s


def departure_s(
    arrival_s: float, free_at_s: float, frame_bytes: int, rate_bit_s: float
) -> tuple[float, float]:
    """When a frame starts and ends on the line: (start, end); it is sent at `end`.

    Args:
        arrival_s: when the frame reached the port (kernel receive timestamp).
        free_at_s: the scheduled end of the port's previous frame.
        frame_bytes: the frame's length as AF_PACKET reads it.
        rate_bit_s: the port's rate.
    """
    start = max(arrival_s, free_at_s)
    return start, start + wire_time_s(frame_bytes, rate_bit_s)


def tcp_message_wire_s(payload_bytes: int, rate_bit_s: float) -> float:
    """Wire time of a TCP message, headers of every segment included."""
    return wire_time_s(tcp_frame_bytes(payload_bytes), rate_bit_s)


def queue_frames(rate_bit_s: float, queue_ms: float = QUEUE_MS) -> int:
    """Full frames a port queues: `queue_ms` of traffic at the rate plus tbf's two-frame burst."""
    frames = math.ceil(rate_bit_s / 8 * queue_ms / 1000 / FULL_FRAME_BYTES) + QUEUE_BURST_FRAMES
    return max(frames, MIN_QUEUE_FRAMES)


def queue_held_ms(rate_bit_s: float, queue_ms: float = QUEUE_MS) -> float:
    """How long a port's queue (`queue_frames`) holds at the rate, its two-frame burst aside:
    `queue_ms`, or longer where the floor of `MIN_QUEUE_FRAMES` holds more (below 7.3 Mbit/s
    at 50 ms). The bound of the tbf in front of the port (`testbed.link.serial.switch`), so
    that the two queues hold the same frames and TCP is held back before the port, not dropped
    in front of it."""
    floor_ms = (MIN_QUEUE_FRAMES - QUEUE_BURST_FRAMES) * FULL_FRAME_BYTES * 8 / rate_bit_s * 1e3
    return max(queue_ms, floor_ms)


def rcvbuf_request_bytes(frames: int) -> int:
    """The SO_RCVBUFFORCE value for a queue of `frames` (the kernel doubles what it is given)."""
    return math.ceil(frames * TRUESIZE_BYTES / 2)
