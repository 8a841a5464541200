"""Unit tests of the Trace wire codec: bit packing, header, whole messages, error paths."""

import time

import numpy as np
import pytest
import torch

from tracevq.codec import (
    decode_header,
    decode_trace_message,
    encode_header,
    encode_trace_message,
    index_bits,
    pack_indices,
    packed_bytes,
    trace_message_bytes,
    unpack_indices,
)
from tracevq.errors import ConfigError, ProtocolError

LEVEL_BITS_K1024_B2 = list(range(1, 11))  # levels of sizes 2, 4, ..., 1024


@pytest.mark.parametrize(("k", "bits"), [(1, 1), (2, 1), (3, 2), (32, 5), (1024, 10), (1025, 11)])
def test_index_bits(k, bits):
    assert index_bits(k) == bits


def test_index_bits_rejects_empty_codebook():
    with pytest.raises(ConfigError, match="k must be >= 1"):
        index_bits(0)


@pytest.mark.parametrize("bits", range(1, 17))
def test_round_trip_every_width(bits):
    rng = np.random.default_rng(bits)
    for count in (1, 7, 99, 333):
        indices = rng.integers(0, 1 << bits, size=count)
        data = pack_indices(indices, bits)
        assert len(data) == packed_bytes(count, bits) == -(-count * bits // 8)
        decoded = unpack_indices(data, count, bits)
        assert decoded.dtype == np.int64
        np.testing.assert_array_equal(decoded, indices)


@pytest.mark.parametrize(
    ("indices", "bits", "expected"),
    [
        ([1, 2, 3], 2, bytes([0b00111001])),
        ([5], 3, bytes([0x05])),
        ([1023, 1], 10, bytes([0xFF, 0x07, 0x00])),
        ([1, 0, 1, 1, 0, 0, 0, 0, 1], 1, bytes([0x0D, 0x01])),
        ([0xABCD], 16, bytes([0xCD, 0xAB])),
    ],
)
def test_hand_worked_bytes(indices, bits, expected):
    assert pack_indices(indices, bits) == expected
    np.testing.assert_array_equal(unpack_indices(expected, len(indices), bits), indices)


def test_accepts_torch_tensor():
    indices = torch.tensor([3, 0, 7, 1])
    assert pack_indices(indices, 3) == pack_indices(np.array([3, 0, 7, 1]), 3)


def test_empty_indices():
    assert pack_indices(np.array([], dtype=np.int64), 4) == b""
    assert unpack_indices(b"", 0, 4).shape == (0,)


def test_paper_payload_length():
    # N_p = 99 indices at r = 10 bits: 990 bits + the 8-bit header = the paper's 998 bits
    assert trace_message_bytes(99, 10) == 125
    message = encode_trace_message(np.arange(99), bits=10, level=9, block=0)
    assert len(message) == 125 == -(-99 * 10 // 8) + 1


@pytest.mark.parametrize(("count", "bits"), [(99, 1), (99, 10), (1, 16), (98, 4)])
def test_message_length_formula(count, bits):
    message = encode_trace_message(np.zeros(count, dtype=np.int64), bits, level=0, block=3)
    assert len(message) == trace_message_bytes(count, bits) == -(-count * bits // 8) + 1


def test_pack_is_fast():
    indices = np.random.default_rng(0).integers(0, 1024, size=100_000)
    best_s = min(_time_pack(indices) for _ in range(3))
    assert best_s < 0.05


def _time_pack(indices: np.ndarray) -> float:
    start = time.perf_counter()
    pack_indices(indices, 10)
    return time.perf_counter() - start


@pytest.mark.parametrize("bits", [0, 17])
def test_pack_rejects_bad_width(bits):
    with pytest.raises(ConfigError, match=f"index bits must be in 1..16, got {bits}"):
        pack_indices([0], bits)


def test_pack_rejects_out_of_range_index():
    with pytest.raises(ConfigError, match="index 8 does not fit in 3 bits"):
        pack_indices([1, 8, 2], 3)
    with pytest.raises(ConfigError, match="index -1 is negative"):
        pack_indices([1, -1], 3)


def test_pack_rejects_non_integer_and_2d():
    with pytest.raises(ConfigError, match="integers"):
        pack_indices(np.array([1.0, 2.0]), 3)
    with pytest.raises(ConfigError, match="1-D"):
        pack_indices(np.zeros((2, 2), dtype=np.int64), 3)


def test_unpack_rejects_wrong_length():
    with pytest.raises(ProtocolError, match="expected 3 bytes .* got 2 bytes"):
        unpack_indices(bytes(2), 2, 10)
    with pytest.raises(ProtocolError, match="expected 3 bytes .* got 4 bytes"):
        unpack_indices(bytes(4), 2, 10)


def test_unpack_rejects_non_zero_padding():
    # 3 indices at 2 bits use 6 bits: bit 6 of the single byte is padding
    with pytest.raises(ProtocolError, match="non-zero padding after 6 payload bits"):
        unpack_indices(bytes([0b01000000]), 3, 2)


def test_header_packing():
    assert encode_header(9, 17) == 0x19
    assert decode_header(0x19) == (9, 1)
    for level in range(16):
        for block in (0, 5, 15, 16, 31, 1000):
            assert decode_header(encode_header(level, block)) == (level, block % 16)


def test_header_rejects_bad_values():
    with pytest.raises(ConfigError, match="level must be in 0..15, got 16"):
        encode_header(16, 0)
    with pytest.raises(ConfigError, match="block number must be >= 0"):
        encode_header(0, -1)
    with pytest.raises(ProtocolError, match="one byte"):
        decode_header(256)


def test_message_round_trip():
    indices = np.random.default_rng(1).integers(0, 1 << 7, size=99)
    message = encode_trace_message(indices, bits=7, level=6, block=35)
    assert message[0] == encode_header(6, 35)
    level, decoded = decode_trace_message(message, 99, LEVEL_BITS_K1024_B2, block=35)
    assert level == 6
    np.testing.assert_array_equal(decoded, indices)


def test_decode_rejects_empty_message():
    with pytest.raises(ProtocolError, match="empty Trace message for block 4"):
        decode_trace_message(b"", 99, LEVEL_BITS_K1024_B2, block=4)


def test_decode_rejects_unknown_level():
    message = bytes([encode_header(12, 0)]) + bytes(packed_bytes(99, 10))
    with pytest.raises(ProtocolError, match=r"level 12 not in the codebook tree \(levels 0..9\)"):
        decode_trace_message(message, 99, LEVEL_BITS_K1024_B2, block=0)


def test_decode_rejects_wrong_block_counter():
    message = encode_trace_message(np.zeros(99, dtype=np.int64), bits=10, level=9, block=3)
    with pytest.raises(ProtocolError, match="expected 4 .* received 3.*desynchronised"):
        decode_trace_message(message, 99, LEVEL_BITS_K1024_B2, block=20)


def test_decode_rejects_wrong_length():
    message = encode_trace_message(np.zeros(99, dtype=np.int64), bits=10, level=9, block=0)
    with pytest.raises(ProtocolError, match="expected 124 bytes .* got 123 bytes"):
        decode_trace_message(message[:-1], 99, LEVEL_BITS_K1024_B2, block=0)
    # the header says level 8 (9 bits) but the payload was packed at 10 bits
    relabelled = bytes([encode_header(8, 0)]) + message[1:]
    with pytest.raises(ProtocolError, match="expected 112 bytes .* got 124 bytes"):
        decode_trace_message(relabelled, 99, LEVEL_BITS_K1024_B2, block=0)


def test_decode_rejects_non_zero_padding():
    message = bytearray(encode_trace_message(np.zeros(3, dtype=np.int64), 2, level=1, block=0))
    message[-1] |= 0x80
    with pytest.raises(ProtocolError, match="non-zero padding"):
        decode_trace_message(bytes(message), 3, LEVEL_BITS_K1024_B2, block=0)
