"""What is known of a result row before and beside the workers' records, as typed facts.

Every column of a row that the workers do not measure comes from one of these, and
`testbed.results.rows.assemble` is the one place that turns them (and the records) into
columns: nothing adds to a row afterwards.

- `PlanRow`: one trial at one rank, from the experiment alone (`testbed.sweep.plan`); the
  dry run's plan.csv is made of these.
- `RunFacts`: where the trial ran (backend, emulator, the devices' allotment, the trace).
- `HostSessionFacts`: what the worker session around the trial did: its id, wall time, each
  link's bytes, the emulator's stalls and per-port counts, the trace it replayed.
The link's rates and probes are `testbed.link.links.LinkState`, the accuracy study's table
`testbed.experiment.level_accuracy.LevelAccuracy`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from testbed.link.emulator import PortCounts
from testbed.link.replay import TraceReplay


@dataclass(frozen=True)
class PlanRow:
    trial_id: str
    experiment: str
    model: str
    method: str
    devices: int
    rank: int
    bandwidth_mbit: float
    K: int | None
    level_k: int | None
    r_bits: int | None
    params: str
    payload_bits_per_layer: int
    analytic_comm_ms: float
    analytic_comm_ms_paper: float
    analytic_delay_ms: float
    fleet: str = ""  # the fleet variant's label (devices.variants); empty without variants
    partition: str = ""  # every device's tokens, "131-66"
    tokens: int = 0  # this device's
    cpus: float = 1.0
    memory_mb: int = 0
    device_speed: float = 1.0  # at the session's start (a measured row: when its inference began)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RunFacts:
    run_id: str
    backend: str
    emulator: str
    batch: int
    threads: dict[int, int]  # the workers' torch threads, by rank
    oversubscribed: bool
    trace: str = ""  # the replayed trace's name, or empty
    # the devices read one kernel's clock (containers, namespaces): no offset to apply, and
    # the handshake's estimate would be off by half of any asymmetry in the delays
    shared_clock: bool = False
    # each device's GEMM rate at full speed when the devices started (GFLOP/s), by rank
    gflops: dict[int, float] = field(default_factory=dict)
    dilation: float = 1.0  # virtual time: the session ran this many times slower on the host


@dataclass(frozen=True)
class HostSessionFacts:
    session_id: str
    session_s: float = 0.0  # the workers' wall time, start to last exit
    sent_bytes: dict[int, int] = field(default_factory=dict)  # each link's, by rank
    # the serial emulator's stalls of every port within the session, (start ns, length ns)
    # sorted; None where the emulator does not clock frames
    stalls: list[tuple[int, int]] | None = None
    # what the serial emulator's impairments did within the session, (ns, lost / duplicated /
    # reordered) sorted; None where the emulator does not draw them itself
    events: list[tuple[int, str]] | None = None
    # what each device's port of the serial emulator counted within the session, by rank;
    # None where the emulator does not count per port (testbed.results.fidelity reads them)
    ports: dict[int, PortCounts] | None = None
    replay: TraceReplay | None = None  # the trace played on the links during the session
    timeline: list[AppliedEvent] | None = None  # the experiment's timeline as it was applied


@dataclass
class AppliedEvent:
    """An event of the timeline as a session applied it (testbed.sweep.session_timeline); times are
    CLOCK_REALTIME ns, the clock of the workers' records on this host."""

    index: int  # its place in the experiment's timeline
    kind: str  # speed, pause, leave or link
    device: int
    label: str  # e.g. "pause d1 0.5 s at 2 s"
    asked_ns: int | None = None  # when it was due
    applied_ns: int | None = None  # when it was in force; None: the session ended before
    ended_ns: int | None = None  # a pause thawed, a speed or link changed again; None: in force
    due_end_ns: int = 0  # a pause's planned end
    detail: str = ""  # a link event's uplink as netem's words
    rate_mbit: float | None = None  # the uplink rate a link event set
    began_ns: int | None = None  # when applying it began (a freeze takes hold within the call)

    @property
    def delay_ms(self) -> float:
        """How long after its time it was in force."""
        if self.applied_ns is None or self.asked_ns is None:
            return float("nan")
        return (self.applied_ns - self.asked_ns) / 1e6

    def overlaps(self, start_ns: int, end_ns: int) -> bool:
        """Whether it acted during [start_ns, end_ns] (or before it and is still in force),
        from when applying it began."""
        if self.applied_ns is None or (self.began_ns or self.applied_ns) > end_ns:
            return False
        return self.ended_ns is None or self.ended_ns >= start_ns
