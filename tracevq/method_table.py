"""The exchange methods, one entry each. Pure Python (no torch).

An entry says what a method is called, which parameters it takes, how many bits it puts on the
wire per layer, whether it reads codebooks (its family in a bundle is its name), whether it
speaks Trace's wire format (a header byte, then indices at a tree level), and which class
implements it. Everything that knows the methods reads this table: `tracevq.spec` (names and
parameters), `tracevq.payload` (bits per layer), `tracevq.methods.make_method` (the class),
the accuracy study's tables, and the testbed's schema (through `tracevq.spec`) and figures
(this table's order is the order of every table and figure). Adding a method is its module and
one entry here.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tracevq.codec import HEADER_BYTES, index_bits

HEADER_BITS = 8 * HEADER_BYTES
ASTRA_WORD_BITS = 16  # the paper's Astra figures imply 16-bit indices (docs/method.md)


class Parameters(Protocol):
    """What the payload functions read of a method's parameters (`tracevq.spec.MethodSpec`)."""

    K: int
    segment: int
    mean_bits: int
    packed: bool

    @property
    def resolved_level_k(self) -> int: ...


# what a device sends for one layer: (parameters, its tokens, model width, batch) -> bits
MessageBits = Callable[[Parameters, int, int, int], int]


@dataclass(frozen=True)
class MethodEntry:
    name: str
    accepts: tuple[str, ...]  # its parameters, beyond its name
    message_bits: MessageBits
    implementation: str  # "module:Class", imported by `implementation_class`
    codebooks: bool = False
    trace: bool = False

    def implementation_class(self) -> type:
        """The class that implements the method (importing it imports torch)."""
        module, _, name = self.implementation.partition(":")
        return getattr(importlib.import_module(module), name)


def _nothing(spec: Parameters, tokens: int, dim: int, batch: int) -> int:
    return 0


def _activations(spec: Parameters, tokens: int, dim: int, batch: int) -> int:
    return 32 * tokens * batch * dim


def _segment_means(spec: Parameters, tokens: int, dim: int, batch: int) -> int:
    return spec.mean_bits * math.ceil(tokens / spec.segment) * batch * dim


def _codeword_indices(spec: Parameters, tokens: int, dim: int, batch: int) -> int:
    return tokens * batch * (index_bits(spec.K) if spec.packed else ASTRA_WORD_BITS)


def _level_indices(spec: Parameters, tokens: int, dim: int, batch: int) -> int:
    return tokens * batch * index_bits(spec.resolved_level_k) + HEADER_BITS


METHODS: dict[str, MethodEntry] = {
    entry.name: entry
    for entry in (
        MethodEntry("single", (), _nothing, "tracevq.methods.baselines:Voltage"),
        MethodEntry("voltage", (), _activations, "tracevq.methods.baselines:Voltage"),
        MethodEntry(
            "prism", ("segment", "mean_bits"), _segment_means, "tracevq.methods.baselines:Prism"
        ),
        MethodEntry(
            "astra",
            ("K", "packed", "dedup"),
            _codeword_indices,
            "tracevq.methods.baselines:Astra",
            codebooks=True,
        ),
        MethodEntry(
            "trace-nb",
            ("K", "level_k", "level_min_k", "dedup", "placement", "remote_ffn", "search_beam"),
            _level_indices,
            "tracevq.methods.trace:TraceMethod",
            codebooks=True,
            trace=True,
        ),
        MethodEntry(
            "trace-b",
            ("K", "level_k", "level_min_k", "buffers", "dedup", "placement", "search_beam"),
            _level_indices,
            "tracevq.methods.trace:TraceMethod",
            codebooks=True,
            trace=True,
        ),
    )
}


def codebook_methods() -> list[str]:
    """The methods that read codebooks, in the table's order."""
    return [name for name, entry in METHODS.items() if entry.codebooks]
