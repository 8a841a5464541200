"""The Trace wire codec: a header byte, then codeword indices bit-packed at r bits each.

A Trace message is exactly the paper's payload (docs/method.md, Wire format): one header byte
(low 4 bits = level index m, high 4 bits = block number mod 16), then N_p indices packed at r
bits in little-endian bit order with zero padding up to the byte. Lengths follow from values
agreed at the session handshake, so a message carries no length prefix. Pure numpy: torch
tensors are accepted wherever indices are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tracevq.errors import ConfigError, ProtocolError

MAX_INDEX_BITS = 16
HEADER_BYTES = 1
MAX_LEVELS = 16  # the header holds the level in 4 bits
BLOCK_COUNTER_MODULUS = 16


def index_bits(k: int) -> int:
    """Bits needed for an index into k codewords: ceil(log2 k), at least 1."""
    if k < 1:
        raise ConfigError(f"codebook size k must be >= 1, got {k}")
    return max(1, (k - 1).bit_length())


def level_sizes_for(num_codewords: int, branching: int) -> list[int]:
    """Codewords per level of a codebook tree, coarsest first: ceil(previous / branching)
    until <= branching (the tree of `tracevq.tree`; pure arithmetic, for planning)."""
    sizes = [num_codewords]
    while sizes[-1] > branching:
        sizes.append(-(-sizes[-1] // branching))
    return sizes[::-1]


def packed_bytes(count: int, bits: int) -> int:
    """Bytes taken by `count` indices packed at `bits` each, padded to the byte."""
    return -(-count * bits // 8)


def trace_message_bytes(count: int, bits: int) -> int:
    """Bytes of a whole Trace message: the header byte plus the packed indices."""
    return HEADER_BYTES + packed_bytes(count, bits)


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= MAX_INDEX_BITS:
        raise ConfigError(f"index bits must be in 1..{MAX_INDEX_BITS}, got {bits}")


def _as_index_array(indices: Any) -> np.ndarray:
    """Turn a numpy array, torch tensor or sequence of ints into a 1-D int64 array."""
    if hasattr(indices, "cpu"):
        indices = indices.cpu()
    array = np.asarray(indices)
    if array.ndim != 1:
        raise ConfigError(f"indices must be 1-D, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ConfigError(f"indices must be integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


def _check_index_range(array: np.ndarray, bits: int) -> None:
    if array.size == 0:
        return
    low, high = int(array.min()), int(array.max())
    if low < 0:
        raise ConfigError(f"index {low} is negative")
    if high >= 1 << bits:
        raise ConfigError(f"index {high} does not fit in {bits} bits (max {(1 << bits) - 1})")


def pack_indices(indices: Any, bits: int) -> bytes:
    """Pack non-negative indices at `bits` each, little-endian bit order, zero padded.

    Index i occupies stream bits [i*bits, (i+1)*bits), its bit j at stream bit i*bits + j;
    stream bit t is bit t % 8 (LSB first) of byte t // 8.
    """
    _check_bits(bits)
    array = _as_index_array(indices)
    _check_index_range(array, bits)
    bit_positions = np.arange(bits, dtype=np.int64)
    bit_matrix = ((array[:, None] >> bit_positions) & 1).astype(np.uint8)  # (count, bits)
    return np.packbits(bit_matrix.ravel(), bitorder="little").tobytes()


def unpack_indices(data: bytes, count: int, bits: int) -> np.ndarray:
    """Inverse of `pack_indices`; returns an int64 array of `count` indices.

    Raises:
        ProtocolError: the length is not ceil(count*bits/8) or a padding bit is set.
    """
    _check_bits(bits)
    expected_bytes = packed_bytes(count, bits)
    if len(data) != expected_bytes:
        raise ProtocolError(
            f"packed indices: expected {expected_bytes} bytes for {count} indices at {bits} bits, "
            f"got {len(data)} bytes"
        )
    stream_bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    payload_bits = count * bits
    if stream_bits[payload_bits:].any():
        raise ProtocolError(
            f"packed indices: non-zero padding after {payload_bits} payload bits "
            f"({count} indices at {bits} bits)"
        )
    bit_matrix = stream_bits[:payload_bits].reshape(count, bits).astype(np.int64)
    return bit_matrix @ (np.int64(1) << np.arange(bits, dtype=np.int64))


def encode_header(level: int, block: int) -> int:
    """Header byte: low 4 bits = level index, high 4 bits = block number mod 16."""
    if not 0 <= level < MAX_LEVELS:
        raise ConfigError(f"level must be in 0..{MAX_LEVELS - 1}, got {level}")
    if block < 0:
        raise ConfigError(f"block number must be >= 0, got {block}")
    return (block % BLOCK_COUNTER_MODULUS) << 4 | level


def decode_header(byte: int) -> tuple[int, int]:
    """Split a header byte into (level, block number mod 16)."""
    if not 0 <= byte <= 0xFF:
        raise ProtocolError(f"header must be one byte (0..255), got {byte}")
    return byte & 0x0F, byte >> 4


def encode_trace_message(indices: Any, bits: int, level: int, block: int) -> bytes:
    """A whole Trace message: the header byte, then the indices packed at `bits`."""
    return bytes([encode_header(level, block)]) + pack_indices(indices, bits)


def decode_trace_message(
    data: bytes, count: int, level_bits: Sequence[int], block: int
) -> tuple[int, np.ndarray]:
    """Check and decode a Trace message of `count` indices expected for block `block`.

    Args:
        data: the message bytes, header included.
        count: number of indices agreed at the handshake (N_p).
        level_bits: bit width of each level of the codebook tree, coarsest first.
        block: the block number the receiver expects.

    Returns:
        (level, indices) with indices an int64 array of length `count`.

    Raises:
        ProtocolError: empty message, unknown level, wrong block counter, or wrong length.
    """
    if not data:
        raise ProtocolError(f"empty Trace message for block {block} (expected a header byte)")
    level, block_counter = decode_header(data[0])
    if level >= len(level_bits):
        raise ProtocolError(
            f"level {level} not in the codebook tree (levels 0..{len(level_bits) - 1})"
        )
    expected_counter = block % BLOCK_COUNTER_MODULUS
    if block_counter != expected_counter:
        raise ProtocolError(
            f"block counter mismatch: expected {expected_counter} (block {block} mod "
            f"{BLOCK_COUNTER_MODULUS}), received {block_counter}: the stream is desynchronised"
        )
    return level, unpack_indices(data[HEADER_BYTES:], count, level_bits[level])
