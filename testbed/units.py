"""Units every layer counts in. Standard library only.

Rates follow tc's convention: 1 mbit is 10^6 bit/s (not 2^20), of whole link-layer frames.
"""

from __future__ import annotations

BIT_PER_MBIT = 1_000_000  # tc's `mbit`
