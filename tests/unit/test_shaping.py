"""Shaping parameters are pure functions: burst, queue limit, tc rendering, netem checks."""

import subprocess
import sys

import pytest

from testbed.errors import ShapingError
from testbed.experiment.profiles import LinkProfile
from testbed.kernel.interfaces import offload_argv
from testbed.kernel.netem import LinkImpairments, NetemCounters, netem_counters, netem_params
from testbed.kernel.shaping import (
    ShapingPlan,
    check_support,
    clear_argv,
    gso_argv,
    netlink_requests,
    tc_argv,
)
from testbed.kernel.tbf import TbfParams, tbf_params
from testbed.link.token_bucket import profile_plan

NO_NETEM = {"tbf": True, "htb": True, "netem": False, "ingress": True}
WITH_NETEM = {**NO_NETEM, "netem": True}
IDEAL = LinkProfile(name="ideal", rate_mbit=10)
WIFI = LinkProfile(name="wifi", rate_mbit=20, delay_ms=4, jitter_ms=2, loss_pct=0.1)


@pytest.mark.parametrize("rate_mbit", [1, 10, 20, 100])
def test_burst_is_two_frames_at_every_rate(rate_mbit: float) -> None:
    assert tbf_params(rate_mbit).burst_bytes == 2 * 1514


def test_explicit_burst_is_kept_above_the_floor_and_raised_below_it() -> None:
    assert tbf_params(20, burst_bytes=32_000).burst_bytes == 32_000
    assert tbf_params(20, burst_bytes=1_000).burst_bytes == 3028


def test_rate_uses_tc_mbit_convention() -> None:
    assert tbf_params(1).rate_bit_s == 1_000_000
    assert tbf_params(2.5).rate_bit_s == 2_500_000


def test_limit_is_latency_bound_at_rate_plus_burst() -> None:
    # 20 Mbit/s = 2.5 MB/s; 50 ms of it is 125,000 B, plus the 3,028 B bucket
    assert tbf_params(20, queue_latency_ms=50).limit_bytes == 128_028
    # 5 Mbit/s, 100 ms: 62,500 B plus the 2-frame bucket
    assert tbf_params(5, queue_latency_ms=100).limit_bytes == 62_500 + 3028


def test_non_positive_rate_is_refused() -> None:
    with pytest.raises(ShapingError, match="positive"):
        tbf_params(0)


def test_plan_without_impairments_has_no_netem() -> None:
    shaping = profile_plan(IDEAL, support=NO_NETEM)
    assert shaping.netem is None and not shaping.needs_netem
    assert shaping.rate_mbit == 10.0  # the profile's own rate is the default
    assert profile_plan(IDEAL, rate_mbit=2).tbf.rate_bit_s == 2_000_000  # the sweep's rate wins


def test_plan_with_impairments_has_netem_child() -> None:
    shaping = profile_plan(WIFI, rate_mbit=5)
    assert shaping.netem is not None
    assert (shaping.netem.delay_us, shaping.netem.jitter_us) == (4000, 2000)
    assert shaping.netem.impairments["loss_pct"] == 0.1


def test_netem_limit_keeps_the_latency_bound() -> None:
    tbf = tbf_params(5, queue_latency_ms=50)  # 31,250 + 3,028 B
    wifi = LinkImpairments(WIFI.name, WIFI.impairments())
    netem = netem_params(wifi, tbf)
    assert netem is not None
    in_flight = 625_000 * 0.006  # 6 ms of delay + jitter at 5 Mbit/s
    assert netem.limit_packets == -(-(34_278 + in_flight) // 1514)
    assert netem_params(wifi).limit_packets == 1000  # without tbf: the kernel default
    assert netem_params(LinkImpairments(IDEAL.name, IDEAL.impairments())) is None


def test_plan_without_any_rate_fails() -> None:
    with pytest.raises(ShapingError, match="no rate_mbit"):
        profile_plan(LinkProfile(name="bare"))


def test_netem_needed_but_unsupported_fails_loudly() -> None:
    expected = (
        "profile 'wifi' needs netem's impairments (sch_netem), which this kernel does not "
        "have; the serial emulator draws them itself"
    )
    with pytest.raises(ShapingError) as raised:
        profile_plan(WIFI, rate_mbit=10, support=NO_NETEM)
    assert str(raised.value) == expected
    check_support(profile_plan(WIFI, rate_mbit=10), WITH_NETEM)  # fine where netem exists
    check_support(profile_plan(IDEAL), NO_NETEM)  # rate-only needs tbf alone


def test_missing_tbf_fails() -> None:
    with pytest.raises(ShapingError, match="sch_tbf"):
        check_support(profile_plan(IDEAL), {**NO_NETEM, "tbf": False})


def test_tc_argv_rate_only() -> None:
    assert tc_argv("eth0", profile_plan(IDEAL, rate_mbit=20)) == [
        ["tc", "qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "tbf"]
        + ["rate", "20000000bit", "burst", "3028", "limit", "128028"]
    ]


def test_tc_argv_with_netem() -> None:
    profile = LinkProfile(name="lte", delay_ms=30, jitter_ms=7.5, loss_pct=0.5)
    commands = tc_argv("veth0", profile_plan(profile, rate_mbit=1))
    assert commands[0] == (
        ["tc", "qdisc", "replace", "dev", "veth0", "root", "handle", "1:", "tbf"]
        + ["rate", "1000000bit", "burst", "3028", "limit", "9278"]
    )
    # limit: (9,278 B + 125,000 B/s x 37.5 ms) / 1514 B -> 10 packets
    assert commands[1] == (
        ["tc", "qdisc", "add", "dev", "veth0", "parent", "1:1", "handle", "10:", "netem"]
        + ["limit", "10", "delay", "30ms", "7500us", "loss", "random", "0.5%"]
    )


def test_tc_argv_netem_loss_only() -> None:
    commands = tc_argv("eth0", profile_plan(LinkProfile(name="lossy", loss_pct=1), rate_mbit=1))
    assert commands[1][-5:] == ["limit", "7", "loss", "random", "1%"]


def test_clear_offload_and_gso_argv() -> None:
    assert clear_argv("eth0") == ["tc", "qdisc", "del", "dev", "eth0", "root"]
    assert gso_argv("eth0") == ["ip", "link", "set", "dev", "eth0", "gso_max_segs", "1"]
    assert " ".join(offload_argv("eth0")) == "ethtool -K eth0 gso off tso off gro off"


def test_netlink_requests_match_the_plan() -> None:
    """A rate alone goes through pyroute2; a plan with netem goes as tc's argv (it may name a
    distribution table, which pyroute2 cannot load)."""
    shaping = profile_plan(IDEAL, rate_mbit=20)
    requests = netlink_requests("eth0", shaping)
    assert [kind for _, _, kind, _ in requests] == ["tbf"]
    _, argv, _, tbf = requests[0]
    assert argv == tc_argv("eth0", shaping)[0]
    assert tbf == {"handle": 0x10000, "rate": "20000000bit", "burst": 3028, "limit": 128_028}
    assert shaping.is_tbf_only and not profile_plan(WIFI, rate_mbit=20).is_tbf_only


def test_every_impairment_has_its_tc_words() -> None:
    """netem's argv for each parameter, as tc-netem(8) spells it (this machine has no
    sch_netem: the tbf path is tested by its argv only)."""
    profile = LinkProfile(
        name="all",
        delay_ms=20,
        jitter_ms=2.5,
        delay_correlation_pct=25,
        delay_distribution="normal",
        loss_gemodel={"p_pct": 1, "r_pct": 30},
        duplicate_pct=0.5,
        duplicate_correlation_pct=10,
        reorder_pct=5,
        reorder_gap=4,
    )
    words = " ".join(tc_argv("eth0", profile_plan(profile, rate_mbit=10))[1][10:])
    assert words == (
        "limit 62 delay 20ms 2500us 25% distribution normal loss gemodel 1% 30% 100% 0% "
        "duplicate 0.5% 10% reorder 5% gap 4"
    )
    state = LinkProfile(name="s", loss_state={"p13_pct": 2}, reorder_pct=0)
    assert " ".join(tc_argv("eth0", profile_plan(state, rate_mbit=1))[1][12:]) == (
        "loss state 2% 98% 0% 100% 0%"
    )
    random = LinkProfile(name="r", delay_ms=5, loss_pct=1, loss_correlation_pct=25, reorder_pct=1)
    assert " ".join(tc_argv("eth0", profile_plan(random, rate_mbit=1))[1][12:]) == (
        "delay 5ms loss random 1% 25% reorder 1% gap 1"
    )


def test_a_duplication_correlation_alone_is_carried_by_a_delay_correlation_of_zero():
    """iproute2 6.1's tc sends the duplication's correlation only beside a delay or a loss
    correlation (the guest's kernel reads it back: tests/integration/test_netem_guest.py)."""

    def words(**fields: float) -> str:
        shaping = profile_plan(LinkProfile(name="d", reorder_pct=0, **fields), rate_mbit=1)
        return " ".join(tc_argv("eth0", shaping)[1][12:])

    assert words(duplicate_pct=10, duplicate_correlation_pct=50) == (
        "delay 0ms 0ms 0% duplicate 10% 50%"
    )
    assert words(delay_ms=20, loss_pct=1, duplicate_pct=10, duplicate_correlation_pct=50) == (
        "delay 20ms 0ms 0% loss random 1% duplicate 10% 50%"
    )
    assert words(
        loss_pct=1, loss_correlation_pct=5, duplicate_pct=10, duplicate_correlation_pct=50
    ) == ("loss random 1% 5% duplicate 10% 50%")
    assert words(duplicate_pct=10) == "duplicate 10%"


def test_plan_as_dict_is_plain_data() -> None:
    data = profile_plan(IDEAL, rate_mbit=5).as_dict()
    assert data["tbf"] == {"rate_bit_s": 5_000_000, "burst_bytes": 3028, "limit_bytes": 34_278}
    assert data["netem"] is None
    assert ShapingPlan("x", 5.0, TbfParams(**data["tbf"])).tbf == profile_plan(IDEAL, 5).tbf


def test_importing_shaping_loads_neither_pyroute2_nor_torch() -> None:
    code = (
        "import sys, testbed.kernel.shaping; "
        "print(sorted({'pyroute2', 'torch'} & set(sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# `tc -s qdisc show` of the netem reference guest's link, as `netlink.qdisc_stats` gives it
# (its lines' trailing spaces taken off): an uplink's tbf with its netem after 100 pings,
# then the downlink's ifb with its own
NETEM_BLOCK = """\
qdisc netem 10: parent 1:1 limit 48 delay 5ms loss 10%
 Sent 8820 bytes 90 pkt (dropped 10, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
"""
UPLINK_STATISTICS = (
    """\
qdisc tbf 1: root refcnt 2 rate 10Mbit burst 3027b lat 50ms
 Sent 8820 bytes 90 pkt (dropped 10, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
"""
    + NETEM_BLOCK
    + """\
qdisc ingress ffff: parent ffff:fff1 ----------------
 Sent 7768 bytes 93 pkt (dropped 0, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
downlink (ifb-va):
qdisc tbf 1: root refcnt 2 rate 8Mbit burst 3027b lat 50ms
 Sent 7698 bytes 79 pkt (dropped 14, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
qdisc netem 10: parent 1:1 limit 38 delay 4ms loss 5%
 Sent 7698 bytes 79 pkt (dropped 14, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
"""
)


def test_netems_counters_are_the_interfaces_own_with_what_it_holds():
    """The uplink's netem, not the downlink's; what its queue holds counts as let through;
    two netems (a pair's leaves) summed; none where the interface has no netem."""
    assert netem_counters(UPLINK_STATISTICS) == NetemCounters(passed=90, dropped=10)
    holding = NETEM_BLOCK.replace("backlog 0b 0p", "backlog 196b 2p")
    assert netem_counters(holding) == NetemCounters(passed=92, dropped=10)
    assert netem_counters(NETEM_BLOCK + holding) == NetemCounters(passed=182, dropped=20)
    assert netem_counters(UPLINK_STATISTICS.replace(NETEM_BLOCK, "")) is None
