"""The Python loop of the serial switch (`--core python`, where gcc is missing) under the
impairments that exercise its own schedule: jittered delays (one frame at a time, the queue
in the socket) and duplicates with reordering (reading ahead, the queue its own). Its draws
are the C core's frame by frame (tests/unit/test_serial_core.py); the rest of
test_impairments_netns runs on the C core."""

from __future__ import annotations

import pytest

from tests.integration.test_impairments_netns import (
    test_a_pairs_and_a_downlinks_delays_add_after_the_line,
    test_delays_follow_the_configured_distribution,
    test_duplicates_and_reorders_are_counted_where_they_arrive,
)

pytestmark = [pytest.mark.netns, pytest.mark.slow]
SWITCH_CORE = "python"

__all__ = [
    "test_a_pairs_and_a_downlinks_delays_add_after_the_line",
    "test_delays_follow_the_configured_distribution",
    "test_duplicates_and_reorders_are_counted_where_they_arrive",
]
