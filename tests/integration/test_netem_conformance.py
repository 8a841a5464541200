"""The serial emulator held against a real netem, two rows of `python -m bench.netem_conformance`
(docs/netem-conformance.md has them all): random loss and uniform jitter, 1,000 packets each
side, in one boot of the netem reference guest (about 20 s)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from checks import netem_conformance as conformance
from checks import netem_verdicts as verdicts

pytestmark = [pytest.mark.guest, pytest.mark.slow]

PACKETS = 1000
ROWS = [r for r in conformance.ROWS if r.name in ("random loss 10%", "uniform 50 ms ± 20 ms")]
P_FLOOR = 0.001  # one CI run in a thousand may see an agreeing row fail by chance


def test_random_loss_and_uniform_jitter_agree_with_the_kernels_netem(
    netem_guest: Callable[..., list[Any]],
) -> None:
    assert len(ROWS) == 2
    results = conformance.conformance(ROWS, PACKETS, seed=3, boot=netem_guest)
    print("\n" + verdicts.markdown(results))
    for result in results:
        assert result.p_value >= P_FLOOR, f"{result.row}: {result.netem} against {result.serial}"
    lost = int(results[0].netem.split()[1])  # "lost 103 (10.30%), ..."
    half = 3.29 * math.sqrt(PACKETS * 0.1 * 0.9)  # the 99.9% binomial interval
    assert abs(lost - PACKETS * 0.1) <= half
