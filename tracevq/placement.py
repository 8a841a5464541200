"""Where Trace's quantiser sits and what a receiver stands a remote token on: the six cases of
the paper's Table VI (docs/method.md, VQ placement). Pure Python (no torch).

Each case answers three questions about the receiver's quantised copy of a peer's token:
- block 0 (the paper's block 1): are its K/V those of the exact embedding X^(0), which the
  receiver computes itself from the input (`first_kv="exact"`, no message for block 0), or of
  its VQ_0 codeword (`first_kv="vq0"`, one message)?
- pre-residual cases (Trace-nb, the VQ codes the attention update A): what residual does the
  first update land on (`first_residual`: the exact X^(0), the VQ_0 codeword, or none), and
  does the copy carry its residual from block to block (`carries_residual`)?
- post-residual cases (Trace-b, the VQ codes Z): the codeword is the whole state, no residual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from tracevq.method_table import METHODS

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True)
class Placement:
    """One Table VI case.

    Attributes:
        name: the paper's label ("1 A.i").
        method: the method whose codebooks it uses: "trace-nb" (pre-residual VQ, codes the
            update A) or "trace-b" (post-residual VQ, codes Z). Each method's default case is
            its entry's `default_placement` (tracevq.method_table).
        first_kv: block 0's remote K/V from the exact X^(0) or from the VQ_0 codeword.
        first_residual: what block 0's update is added to (pre-residual cases only).
        carries_residual: each later update is added to the copy's previous state
            (pre-residual cases only; False: the codeword of the update alone).
        paper: the paper's CIFAR-100 accuracy (%) at P = 2 and P = 3.
    """

    name: str
    method: str
    first_kv: Literal["exact", "vq0"]
    first_residual: Literal["exact", "vq0", "none"] | None
    carries_residual: bool | None
    paper: tuple[float, float]

    @property
    def sends_vq0(self) -> bool:
        """True when peers send VQ_0 indices for block 0; False: the receiver embeds itself."""
        return self.first_kv == "vq0"

    def exchanges(self, depth: int) -> int:
        """Messages a device sends each peer per inference."""
        return depth if self.sends_vq0 else depth - 1


PLACEMENTS: dict[str, Placement] = {
    p.name: p
    for p in (
        Placement("1 A.i", "trace-nb", "exact", "exact", True, (91.23, 90.58)),
        Placement("1 A.ii", "trace-nb", "exact", "none", True, (90.78, 89.03)),
        Placement("1 A.iii", "trace-nb", "exact", "none", False, (90.51, 88.59)),
        Placement("1 B", "trace-nb", "vq0", "vq0", True, (90.90, 89.56)),
        Placement("2 A", "trace-b", "exact", None, None, (90.52, 88.61)),
        Placement("2 B", "trace-b", "vq0", None, None, (90.51, 89.90)),
    )
}


def placements_of(method: str) -> list[str]:
    return [name for name, p in PLACEMENTS.items() if p.method == method]


def at_default_placement(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of an accuracy table (the study's `results.csv` or `table7_levels.csv`: a
    `method` column, `placement` and `remote_ffn` where the study ran placements) of methods
    without a placement, and of Trace at its method's default one without the receiver's FFN.
    Takes the frame as it is: the library itself does not need pandas."""
    if "placement" not in frame:
        return frame
    defaults = {n: e.default_placement for n, e in METHODS.items() if e.default_placement}
    default = frame["method"].map(defaults)
    plain = True  # without a remote_ffn column no row ran the receiver's FFN
    if "remote_ffn" in frame:
        plain = frame["remote_ffn"].fillna(False) == False  # noqa: E712 - element-wise
    return frame[frame["placement"].isna() | ((frame["placement"] == default) & plain)]
