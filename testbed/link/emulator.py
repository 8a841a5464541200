"""What every link emulator offers: the one rule that refuses what it cannot emulate, and the
verbs `Links` uses (start, set rates, counters, stats, stop).

An emulator shapes the links of one backend's started devices from a link profile and a
trial's rates (`testbed.link.rates.LinkRates`). Its `refusal` is asked twice with the same
answer: by the preflight before anything starts (a `ConfigError` naming the field), and by
`Links` before the emulator is built (a `ShapingError`), so a profile is never half-emulated.
An emulator whose traffic must cross a link of its own gives the devices an address and an
interface on it (`start` says which, `Attachment`); the backend's devices stay as they are,
and `devices` is them as the links reach them. The table of emulators is
`testbed.link.emulators`.
"""

from __future__ import annotations

import abc
import inspect
import sys
from dataclasses import dataclass, replace

from testbed.backends.base import Backend, Device
from testbed.experiment.profiles import LinkProfile
from testbed.link.paths import PathImpairments
from testbed.link.rates import LinkRates


@dataclass(frozen=True)
class Refusal:
    """Why an emulator cannot emulate what it is asked, and the experiment field at fault."""

    field: str  # "link.profile", "link.emulator", ...
    why: str


@dataclass(frozen=True)
class Attachment:
    """Where an emulator's link reaches a device: the address its peers send to, and the
    interface (as the device sees it) that carries that traffic."""

    address: str
    interface: str


@dataclass(frozen=True)
class LinkCounters:
    """A device's link so far: bytes carried, and the serial emulator's stalls of its port as
    (start ns, length ns) and the frames its impairments lost, duplicated or reordered as
    (ns, what), by CLOCK_REALTIME (None on links whose emulator does not clock or draw)."""

    sent_bytes: int
    stalls: list[tuple[int, int]] | None = None
    events: list[tuple[int, str]] | None = None
    # the device's counters so far (of PORT_COUNTED: the serial emulator's port has all, tbf's
    # netem "frames" and "lost"), else None
    port: dict[str, int] | None = None


PORT_COUNTED = ("frames", "lost", "duplicated", "reordered", "drops")


@dataclass(frozen=True)
class PortCounts:
    """What one device's link did within a session: the frames it sent (every copy), those
    its impairments lost, duplicated and reordered, those a full queue dropped, and the
    machine's stalls of it (frames that left more than 1 ms late). The serial emulator's port
    counts them all; tbf's netem (`testbed.kernel.netem.netem_counters`) the frames and the
    losses, with its full queue's drops among them; None: not counted."""

    frames: int
    lost: int
    duplicated: int | None
    reordered: int | None
    drops: int | None
    stalls: int | None
    stalled_ms: float | None


def port_counts(before: LinkCounters, after: LinkCounters, since_ns: int) -> PortCounts | None:
    """The link's counts between two readings, its stalls since `since_ns` (the first
    reading's time); None where the emulator does not count, or where a counter went back
    (its qdisc made anew between the readings)."""
    if before.port is None or after.port is None:
        return None
    done = {
        name: after.port[name] - before.port[name] for name in after.port if name in before.port
    }
    if "frames" not in done or "lost" not in done or min(done.values()) < 0:
        return None
    stalls = None
    if after.stalls is not None:
        stalls = [length for start, length in after.stalls if start + length >= since_ns]
    return PortCounts(
        frames=done["frames"],
        lost=done["lost"],
        duplicated=done.get("duplicated"),
        reordered=done.get("reordered"),
        drops=done.get("drops"),
        stalls=None if stalls is None else len(stalls),
        stalled_ms=None if stalls is None else sum(stalls) / 1e6,
    )


class Emulator(abc.ABC):
    """The links of `backend`'s started devices, shaped after `profile`."""

    name: str = ""
    # whether it draws the receivers' downlink and the pairs' impairments (testbed.link.paths)
    impairs_paths: bool = False
    shares_medium: bool = False  # it can put every device's frames on one line (a cell)
    seeds: dict[str, int]  # each hop's seed in the current session, where it draws them

    @classmethod
    def description(cls) -> str:
        """What it is, in a paragraph: the first of its module's docstring."""
        text = inspect.getdoc(sys.modules[cls.__module__]) or cls.name
        return " ".join(text.split("\n\n")[0].split())

    def __init__(self, backend: Backend, profile: LinkProfile, run_id: str):
        self.backend, self.profile, self.run_id = backend, profile, run_id
        self.uplinks: dict[int, LinkProfile] = {}  # a device's own (link.uplink_impairments)
        self.paths = PathImpairments()  # the later hops (impairs_paths emulators only)
        self.step: dict[str, float] = {}  # a replayed trace's step: its delay and loss
        self.dilation = 1.0  # the sessions' (testbed.experiment.dilation): times x it
        self.seeds = {}
        self.attachments: dict[int, Attachment] = {}  # what `start` gave, by rank (Links)

    @property
    def devices(self) -> list[Device]:
        """The backend's devices as the links reach them: at the address and interface this
        emulator gave each (`start`), else their own."""
        return [_attached(d, self.attachments.get(d.rank)) for d in self.backend.devices]

    def virtual_uplink(self, rank: int) -> LinkProfile:
        """What the device of `rank` sends through: its own profile, else the link's, with
        the impairments of the trace's step in force laid over it."""
        profile = self.uplinks.get(rank, self.profile)
        return profile.with_impairments(self.step) if self.step else profile

    def uplink(self, rank: int) -> LinkProfile:
        """The same on the host's clock (its times x the dilation): what the emulator makes."""
        return self.virtual_uplink(rank).dilated(self.dilation)

    @classmethod
    def refusal(
        cls,
        profile: LinkProfile,
        backend: type[Backend],
        pair_rates: bool,
        paths: PathImpairments | None = None,
    ) -> Refusal | None:
        """Why `profile` cannot be emulated on `backend`'s devices (`pair_rates`: the
        experiment caps pairs, link.pair_mbit; `paths`: the later hops' impairments, for an
        emulator that `impairs_paths`), or None when it can. Here: a shared medium on an emulator
        that does not share one, the later hops' impairments
        on an emulator that impairs uplinks only; a subclass adds its own rules."""
        if profile.medium == "shared" and not cls.shares_medium:
            able = " or ".join(name for name, kind in EMULATORS.items() if kind.shares_medium)
            return Refusal(
                "link.medium",
                f"a shared medium is scheduled by the {able} emulator (link.emulator: {able}); "
                f"{cls.name} shapes each device's own egress",
            )
        if not paths or cls.impairs_paths:
            return None
        able = " or ".join(name for name, kind in EMULATORS.items() if kind.impairs_paths)
        field = "link.downlink_impairments" if paths.downlink else "link.pair_impairments"
        return Refusal(
            field,
            f"the {cls.name} emulator impairs uplinks only (link.uplink_impairments); downlink "
            f"and per-pair impairments need {able}",
        )

    def start(self) -> dict[int, Attachment]:
        """Builds what the emulator needs once the devices run. Returns, by rank, the address
        and interface it gives a device whose traffic must cross a link of its own (none: the
        devices are reached as the backend made them)."""
        return {}

    @abc.abstractmethod
    def set_rates(self, rates: LinkRates, in_place: bool) -> None:
        """Every device's rates: applied anew, or changed in place (`in_place`: a replayed
        trace's step, which must never leave a link unshaped for a moment)."""

    def impair(self, rates: LinkRates, step: int = 0) -> None:  # noqa: B027 - optional hook
        """Adds the profile's impairments to links shaped at `rates` and probed (the probe
        checks the rate alone), or, for a trace's `step` > 0, changes them to that step's.
        Emulators that put them in the shaping itself (tbf's netem) leave this alone."""

    def counters(self) -> dict[int, LinkCounters]:
        """Per rank, what its link carried so far (its egress qdisc's counter)."""
        control = self.backend.traffic_control
        return {
            device.rank: LinkCounters(qdisc_sent_bytes(control.stats(device)))
            for device in self.devices
        }

    def stats(self) -> dict[int, dict[str, object]] | None:
        """The emulator's own counters by rank, saved with each shaping (None: it has none)."""
        return None

    def gone(self) -> str | None:
        """Why the emulator no longer emulates (its process died), or None while it does:
        what a session that lost it says. Kernel qdiscs cannot die on their own: None."""
        return None

    def stop(self) -> None:  # noqa: B027 - optional hook
        """Removes what `start` built (idempotent)."""


EMULATORS: dict[str, type[Emulator]] = {}  # the table, filled by testbed.link.emulators


def _attached(device: Device, attachment: Attachment | None) -> Device:
    if attachment is None:
        return device
    return replace(device, address=attachment.address, interface=attachment.interface)


def qdisc_sent_bytes(text: str) -> int:
    """The `Sent N bytes` counter of `tc -s qdisc show` text (the root qdisc's, listed first)."""
    for line in text.splitlines():
        parts = line.split()
        if parts[:1] == ["Sent"] and len(parts) > 1 and parts[1].isdigit():
            return int(parts[1])
    return 0
