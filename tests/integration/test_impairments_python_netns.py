"""The Python loop of the serial switch (`--core python`, where gcc is missing) under the
impairments that exercise its own schedule: jittered delays (one frame at a time, the queue
in the socket) and duplicates with reordering (reading ahead, the queue its own). Its draws
are the C core's frame by frame (tests/unit/test_serial_core.py); the rest of
test_impairments_netns runs on the C core. One jitter distribution is enough here: the
schedule under jitter is the loop's own, the draws are the C core's."""

from __future__ import annotations

import pytest

from testbed.link.serial.switch import SerialSwitch
from tests.integration import test_impairments_netns as on_the_c_core
from tests.integration.conftest import Devices
from tests.integration.test_impairments_netns import (
    test_a_pairs_and_a_downlinks_delays_add_after_the_line,
    test_duplicates_and_reorders_are_counted_where_they_arrive,
)

pytestmark = [pytest.mark.netns, pytest.mark.slow]
SWITCH_CORE = "python"

__all__ = [
    "test_a_pairs_and_a_downlinks_delays_add_after_the_line",
    "test_duplicates_and_reorders_are_counted_where_they_arrive",
]


@pytest.mark.parametrize(
    ("distribution", "jitter_ms", "reference"), [("uniform", 5.0, ("uniform", (15.0, 10.0)))]
)
def test_delays_follow_the_configured_distribution(
    devices: Devices, switch: SerialSwitch, distribution, jitter_ms, reference
) -> None:
    on_the_c_core.test_delays_follow_the_configured_distribution(
        devices, switch, distribution, jitter_ms, reference
    )
