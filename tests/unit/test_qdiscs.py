"""The kernel's per-peer and downlink builders are pure (`testbed.kernel`): htb classes, pfifo
leaves, u32 filters, the ingress qdisc and the ifb, and netem for a pair's and a downlink's
impairments, as exact `tc`/`ip` argument lists (this machine has no netem: its path is tested
by its commands only). The rates they are built from: test_link_rates.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from testbed.errors import ShapingError
from testbed.experiment.profiles import LinkProfile
from testbed.kernel.fifo import pfifo_argv
from testbed.kernel.htb import HtbClass, htb_argv, htb_class_argv, htb_params, htb_root_argv
from testbed.kernel.ifb import ifb_add_argv, ifb_del_argv, ifb_name, ifb_up_argv
from testbed.kernel.ingress import ingress_argv, ingress_clear_argv
from testbed.kernel.netem import netem_argv, tc_takes_netem_seed
from testbed.kernel.shaping import (
    Hops,
    change_argvs,
    check_support,
    downlink_clear_argv,
    keeping_netem,
    tc_argv,
)
from testbed.kernel.u32 import u32_destination_argv, u32_redirect_argv
from testbed.link.token_bucket import profile_plan

IDEAL = LinkProfile(name="ideal", rate_mbit=10)
WIFI = LinkProfile(name="wifi", rate_mbit=20, delay_ms=4)
ALL = {"tbf": True, "htb": True, "netem": False, "ingress": True}


def test_htb_classes_share_the_uplink_and_cap_each_peer() -> None:
    htb = htb_params(10.0, {1: ("10.0.0.2", 4.0), 2: ("10.0.0.3", 20.0)})
    assert htb.uplink == HtbClass(0x1, 10_000_000, 10_000_000, 3028, 0)
    # the three leaves' guaranteed rates sum to the uplink; each may borrow up to its ceil
    assert [k.rate_bit_s for k in htb.leaves] == [3_333_333] * 3
    assert [(k.minor, k.ceil_bit_s, k.address) for k in htb.leaves] == [
        (0x2, 10_000_000, None),
        (0x11, 4_000_000, "10.0.0.2"),
        (0x12, 10_000_000, "10.0.0.3"),  # a cap above the uplink is the uplink
    ]
    # 50 ms at the ceil in full frames, plus the two-frame burst
    assert [k.limit_packets for k in htb.leaves] == [44, 19, 44]


def test_htb_refuses_a_rate_that_is_not_positive() -> None:
    with pytest.raises(ShapingError, match="positive"):
        htb_params(10.0, {1: ("10.0.0.2", 0.0)})


def test_htb_argv() -> None:
    htb = htb_params(10.0, {1: ("10.0.0.2", 4.0)})
    assert (
        " ".join(htb_root_argv("eth0")) == "tc qdisc replace dev eth0 root handle 1: htb default 2"
    )
    assert (
        " ".join(htb_class_argv("eth0", htb.uplink))
        == "tc class add dev eth0 parent 1: classid 1:1 htb rate 10000000bit ceil 10000000bit "
        "burst 3028 cburst 3028 quantum 1514"
    )
    assert (
        " ".join(htb_class_argv("eth0", htb.peers[0], "change")[:10])
        == "tc class change dev eth0 parent 1:1 classid 1:11 htb"
    )
    assert (
        " ".join(pfifo_argv("eth0", 0x11, 19))
        == "tc qdisc add dev eth0 parent 1:11 handle 11: pfifo limit 19"
    )
    assert (
        " ".join(u32_destination_argv("eth0", "10.0.0.2", 0x11))
        == "tc filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst 10.0.0.2/32 "
        "flowid 1:11"
    )
    commands = htb_argv("eth0", htb)
    assert [argv[1:3] for argv in commands] == [
        ["qdisc", "replace"],
        ["class", "add"],
        ["class", "add"],
        ["qdisc", "add"],  # the default class 1:2 and its pfifo
        ["class", "add"],
        ["qdisc", "add"],
        ["filter", "add"],  # the capped peer
    ]


def test_downlink_argv_redirects_ingress_to_an_ifb() -> None:
    assert ifb_name("eth0") == "ifb-eth0"
    assert ifb_name("tb0123abcdd12") == "ifb-tb0123abcdd"  # 15 characters at most
    assert ifb_add_argv("ifb-eth0") == ["ip", "link", "add", "ifb-eth0", "type", "ifb"]
    assert ifb_up_argv("ifb-eth0") == ["ip", "link", "set", "dev", "ifb-eth0", "up"]
    assert ifb_del_argv("ifb-eth0") == ["ip", "link", "del", "ifb-eth0"]
    assert " ".join(ingress_argv("eth0")) == "tc qdisc add dev eth0 handle ffff: ingress"
    assert ingress_clear_argv("eth0") == ["tc", "qdisc", "del", "dev", "eth0", "ingress"]
    assert (
        " ".join(u32_redirect_argv("eth0", "ifb-eth0"))
        == "tc filter add dev eth0 parent ffff: protocol all prio 1 u32 match u32 0 0 action "
        "mirred egress redirect dev ifb-eth0"
    )
    assert downlink_clear_argv("eth0") == [ingress_clear_argv("eth0"), ifb_del_argv("ifb-eth0")]


def test_a_plan_with_a_downlink_keeps_the_uplink_tbf_and_adds_the_ifb() -> None:
    shaping = profile_plan(IDEAL, 10.0, hops=Hops(downlink_mbit=3.0))
    assert not shaping.is_tbf_only and shaping.htb is None
    commands = tc_argv("eth0", shaping)
    assert " ".join(commands[0][:9]) == "tc qdisc replace dev eth0 root handle 1: tbf"
    assert commands[1:] == [
        ifb_add_argv("ifb-eth0"),
        ifb_up_argv("ifb-eth0"),
        ingress_argv("eth0"),
        u32_redirect_argv("eth0", "ifb-eth0"),
        [
            "tc",
            "qdisc",
            "replace",
            "dev",
            "ifb-eth0",
            "root",
            "handle",
            "1:",
            "tbf",
            "rate",
            "3000000bit",
            "burst",
            "3028",
            "limit",
            "21778",
        ],
    ]
    assert change_argvs("eth0", shaping) == [
        ["tc", "qdisc", "change", *commands[0][3:]],
        ["tc", "qdisc", "change", *commands[-1][3:]],
    ]


def test_a_plan_with_peer_caps_has_an_htb_root_changed_class_by_class() -> None:
    shaping = profile_plan(IDEAL, 10.0, hops=Hops(peer_caps_mbit={1: ("10.0.0.2", 4.0)}))
    assert shaping.htb == htb_params(10.0, {1: ("10.0.0.2", 4.0)})
    assert tc_argv("eth0", shaping) == htb_argv("eth0", shaping.htb)
    changes = change_argvs("eth0", shaping)
    assert [argv[1:3] for argv in changes] == [["class", "change"]] + [
        ["class", "change"],
        ["qdisc", "change"],
    ] * 2
    assert profile_plan(IDEAL, 10.0).is_tbf_only  # the simple case is what it always was


def test_support_and_netem_are_checked_for_the_new_kinds() -> None:
    with pytest.raises(ShapingError, match="no htb qdisc"):
        profile_plan(
            IDEAL, 10.0, {**ALL, "htb": False}, hops=Hops(peer_caps_mbit={1: ("10.0.0.2", 4.0)})
        )
    with pytest.raises(ShapingError, match="no ingress qdisc"):
        profile_plan(IDEAL, 10.0, {**ALL, "ingress": False}, hops=Hops(downlink_mbit=3.0))
    check_support(profile_plan(IDEAL, 10.0, hops=Hops(downlink_mbit=3.0)), ALL)
    with pytest.raises(ShapingError, match=r"per-pair classes \(link.pair_mbit\)"):
        profile_plan(WIFI, 10.0, hops=Hops(peer_caps_mbit={1: ("10.0.0.2", 4.0)}))
    with pytest.raises(ShapingError, match=r"per-pair classes \(link.pair_impairments\)"):
        profile_plan(WIFI, 10.0, hops=Hops(peer_impairments={1: ("10.0.0.2", {"loss_pct": 1})}))
    with pytest.raises(ShapingError, match="a downlink or a pair needs netem's impairments"):
        profile_plan(IDEAL, 10.0, ALL, hops=Hops(downlink_impairments={"delay_ms": 5}))


def test_a_pairs_impairments_are_the_netem_leaf_of_its_class() -> None:
    """Device 1 (uncapped) gets a class of the uplink's rate whose leaf is the pair's netem;
    device 2 keeps its cap and its pfifo."""
    caps = {2: ("10.0.0.3", 4.0)}
    pairs = {1: ("10.0.0.2", {"delay_ms": 20, "jitter_ms": 2, "loss_pct": 1}), 2: ("x", {})}
    shaping = profile_plan(IDEAL, 10.0, hops=Hops(peer_caps_mbit=caps, peer_impairments=pairs))
    assert shaping.needs_netem and shaping.netem is None and not shaping.uplink_only
    assert shaping.htb == htb_params(10.0, {1: ("10.0.0.2", 10.0), 2: ("10.0.0.3", 4.0)})
    assert list(shaping.peer_netem) == [0x11]  # an empty hop impairs nothing
    commands = [" ".join(argv) for argv in tc_argv("eth0", shaping)]
    # the class's 50 ms (44 frames) plus 22 ms in flight at 10 Mbit/s: 63 frames
    leaf = "parent 1:11 handle 11: netem limit 63 delay 20ms 2ms loss random 1%"
    assert f"tc qdisc add dev eth0 {leaf}" in commands
    assert "tc qdisc add dev eth0 parent 1:12 handle 12: pfifo limit 19" in commands
    assert "tc qdisc add dev eth0 parent 1:11 handle 11: pfifo limit 44" not in commands
    changes = [" ".join(argv) for argv in change_argvs("eth0", shaping)]
    assert f"tc qdisc change dev eth0 {leaf}" in changes


def test_a_downlinks_impairments_are_netem_on_the_ifb() -> None:
    """Under the downlink's tbf where it has a rate, else the ifb's root."""
    hop = {"delay_ms": 5, "loss_gemodel": {"p_pct": 1, "r_pct": 25}}
    shaping = profile_plan(IDEAL, 10.0, hops=Hops(downlink_mbit=3.0, downlink_impairments=hop))
    assert shaping.htb is None and shaping.has_downlink and shaping.needs_netem
    commands = [" ".join(argv) for argv in tc_argv("eth0", shaping)]
    # tbf's 21,778 bytes plus 5 ms at 3 Mbit/s (1,875 B), in full frames: 16
    netem = "handle 10: netem limit 16 delay 5ms loss gemodel 1% 25% 100% 0%"
    assert commands[-2].startswith("tc qdisc replace dev ifb-eth0 root handle 1: tbf rate")
    assert commands[-1] == f"tc qdisc add dev ifb-eth0 parent 1:1 {netem}"
    assert [" ".join(argv) for argv in change_argvs("eth0", shaping)][-1] == (
        f"tc qdisc change dev ifb-eth0 parent 1:1 {netem}"
    )
    alone = profile_plan(IDEAL, 10.0, hops=Hops(downlink_impairments={"delay_ms": 5}))
    commands = [" ".join(argv) for argv in tc_argv("eth0", alone)]
    assert commands[1:5] == [
        " ".join(argv)
        for argv in (
            ifb_add_argv("ifb-eth0"),
            ifb_up_argv("ifb-eth0"),
            ingress_argv("eth0"),
            u32_redirect_argv("eth0", "ifb-eth0"),
        )
    ]
    assert commands[5:] == ["tc qdisc add dev ifb-eth0 root handle 1: netem limit 1000 delay 5ms"]
    assert len(change_argvs("eth0", alone)) == 1  # the uplink's tbf; the ifb has no rate
    assert profile_plan(IDEAL, 10.0, hops=Hops(downlink_impairments={"loss_pct": 0})).uplink_only


def test_a_steps_in_place_change_carries_its_netem_with_its_rate() -> None:
    """(10 Mbit/s, 20 ms, 1%) -> (5 Mbit/s, 40 ms, 5%): the tbf changed and the netem under it
    replaced (changed where it is, added where the last step had none); a step without
    impairments keeps an idle netem that sets each of them to nothing."""
    step = LinkProfile(name="step", delay_ms=40, loss_pct=5)
    changes = [" ".join(argv) for argv in change_argvs("eth0", profile_plan(step, 5.0))]
    assert changes[0].startswith("tc qdisc change dev eth0 root handle 1: tbf rate 5000000bit")
    assert changes[1] == (
        "tc qdisc replace dev eth0 parent 1:1 handle 10: netem limit 40 delay 40ms loss random 5%"
    )
    idle = keeping_netem(profile_plan(IDEAL, 5.0))
    assert [" ".join(argv) for argv in change_argvs("eth0", idle)][1] == (
        "tc qdisc replace dev eth0 parent 1:1 handle 10: netem limit 23"
    )
    assert keeping_netem(profile_plan(step, 5.0)) == profile_plan(step, 5.0)


def test_netem_is_given_its_seed_only_where_tc_takes_one() -> None:
    netem = profile_plan(WIFI, 20.0).netem
    assert netem is not None and "seed" not in netem_argv("eth0", netem)
    assert netem_argv("eth0", replace(netem, seed=42))[-2:] == ["seed", "42"]
    old = 'What is "seed"?\nUsage: ... netem [ limit PACKETS ]\n'
    assert not tc_takes_netem_seed(old)
    assert tc_takes_netem_seed("Usage: ... netem [ limit PACKETS ]\n  [ seed SEED ]\n")
    assert not tc_takes_netem_seed("")  # no tc answered


def test_a_duplicating_pair_beside_another_impaired_pair_is_refused() -> None:
    """The kernel refuses a duplicating netem beside another in one tree (the guest shows
    it); alone it is a pair's leaf like any other."""
    duplicating = ("10.0.0.2", {"duplicate_pct": 1})
    with pytest.raises(ShapingError, match="pair to device 1 duplicates frames"):
        profile_plan(
            IDEAL,
            10.0,
            hops=Hops(peer_impairments={1: duplicating, 2: ("10.0.0.3", {"delay_ms": 5})}),
        )
    assert profile_plan(IDEAL, 10.0, hops=Hops(peer_impairments={1: duplicating})).peer_netem
