"""The exchange methods, one entry each. Pure Python (no torch).

An entry says what a method is called, which parameters it takes, how many bits it puts on the
wire per layer, what its codebooks quantise if it reads any (its family in a bundle is its
name), whether it exchanges at all, whether it loses no precision, whether it speaks Trace's
wire format (a header byte, then indices at a tree level, with live levels) and at which
placement by default, and which class implements it. Everything that knows the methods reads
this table: `tracevq.spec` (names and parameters), `tracevq.payload` (bits per layer),
`tracevq.bundle` (what each family's codebooks are fitted on), `tracevq.methods.make_method`
(the class, which also owns the method's differentiable receiver view), the accuracy study's
settings and tables, and the testbed's schema (through `tracevq.spec`) and figures (this
table's order is the order of every table and figure). Adding a method is its module and one
entry here.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

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
# what a codebook method's exchange point b quantises: the block input X^(b), the
# post-attention residual Z^(b-1) or the attention update Z^(b-1) - X^(b-1) (VQ_0: X^(0))
Quantises = Literal["inputs", "residuals", "updates"]
QUANTISED = {"inputs": "the block input X", "residuals": "Z", "updates": "the update Z - X"}


@dataclass(frozen=True)
class MethodEntry:
    """One exchange method.

    Attributes:
        name: what experiments and studies call it.
        accepts: its parameters, beyond its name.
        message_bits: the bits one device sends for one layer.
        implementation: "module:Class", imported by `implementation_class`.
        quantises: what its codebooks quantise; None: it reads no codebooks.
        exchanges: False for a method that runs on one device and sends nothing.
        exact: True when its logits are the single-device model's (no loss of precision).
        trace: Trace's wire format (a header byte, indices at a live tree level) and overlap.
        default_placement: Trace's Table VI case when none is given (tracevq.placement).
    """

    name: str
    accepts: tuple[str, ...]
    message_bits: MessageBits
    implementation: str
    quantises: Quantises | None = None
    exchanges: bool = True
    exact: bool = False
    trace: bool = False
    default_placement: str | None = None

    @property
    def codebooks(self) -> bool:
        """Whether the method reads codebooks (a bundle's family of its name)."""
        return self.quantises is not None

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
        MethodEntry(
            "single",
            (),
            _nothing,
            "tracevq.methods.baselines:Voltage",
            exchanges=False,
            exact=True,
        ),
        MethodEntry("voltage", (), _activations, "tracevq.methods.baselines:Voltage", exact=True),
        MethodEntry(
            "prism", ("segment", "mean_bits"), _segment_means, "tracevq.methods.baselines:Prism"
        ),
        MethodEntry(
            "astra",
            ("K", "packed", "dedup"),
            _codeword_indices,
            "tracevq.methods.baselines:Astra",
            quantises="inputs",
        ),
        MethodEntry(
            "trace-nb",
            ("K", "level_k", "level_min_k", "dedup", "placement", "remote_ffn", "search_beam"),
            _level_indices,
            "tracevq.methods.trace:TraceNB",
            quantises="updates",
            trace=True,
            default_placement="1 A.i",
        ),
        MethodEntry(
            "trace-b",
            ("K", "level_k", "level_min_k", "buffers", "dedup", "placement", "search_beam"),
            _level_indices,
            "tracevq.methods.trace:TraceB",
            quantises="residuals",
            trace=True,
            default_placement="2 B",
        ),
    )
}


def codebook_methods() -> list[str]:
    """The methods that read codebooks, in the table's order."""
    return [name for name, entry in METHODS.items() if entry.codebooks]


def trace_methods() -> list[str]:
    """The Trace methods (tree levels, Trace's wire format), in the table's order."""
    return [name for name, entry in METHODS.items() if entry.trace]


def exact_methods() -> list[str]:
    """The methods without any loss of precision, in the table's order."""
    return [name for name, entry in METHODS.items() if entry.exact]


def methods_accepting(parameter: str) -> list[str]:
    """The methods that take `parameter`, in the table's order."""
    return [name for name, entry in METHODS.items() if parameter in entry.accepts]
