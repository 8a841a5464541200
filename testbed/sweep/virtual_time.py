"""A dilated session's records brought back to virtual time, once, before rows are assembled.

The workers, the emulator and the timeline of a session with dilation d (testbed.experiment.
dilation) record the host's time, in which everything took d times as long. `virtual`
maps every mark t of the session (CLOCK_REALTIME ns: the workers' marks and the kernel's
receive timestamps, the emulator's stalls and impairment events, the timeline's moments) to
origin + (t - origin) / d, with one origin for all of them (the session's first measured
inference), divides every duration by d (but the session's own wall time, `session_s`: what
it cost here) and multiplies the workers' rate estimates by d, and their speeds by d over the
threads folded into each worker's one (testbed.sweep.fleets.folded_threads: a speed per core
again): the rows, the fidelity report and the figures then read in the experiment's own
units, and nothing downstream knows of d but the `dilation` column.
"""

from __future__ import annotations

import copy
import dataclasses

from devices.records import ArrivalRecord, BlockRecord, DeviceRecords, InferenceRecord
from testbed.results.facts import AppliedEvent, HostSessionFacts
from testbed.sweep.sessions import SessionOutcome

_MS = ("compute_ms", "wait_ms", "effective_ms")


class Dilated:
    """The map from a session's host time to its virtual time."""

    def __init__(self, factor: float, origin_ns: int, folded: list[int] | None = None):
        self.factor, self.origin_ns = factor, origin_ns
        self.folded = folded or []

    def ns(self, t: int | None) -> int | None:
        if t is None:
            return t
        return self.origin_ns + round((t - self.origin_ns) / self.factor)

    def ms(self, value: float) -> float:
        return round(value / self.factor, 4)

    def inference(self, r: InferenceRecord, fold: int = 1) -> InferenceRecord:
        times = {name: self.ms(getattr(r, name)) for name in _MS}
        rate = None if r.est_rate_mbit is None else r.est_rate_mbit * self.factor
        return dataclasses.replace(
            r,
            **times,
            start_ns=self.ns(r.start_ns),
            end_ns=self.ns(r.end_ns),
            est_rate_mbit=rate,
            speed=r.speed * self.factor / fold,
        )

    def block(self, r: BlockRecord) -> BlockRecord:
        marks = ("start_ns", "departed_ns", "written_ns", "wait_start_ns", "wait_end_ns")
        marks += ("ffn_start_ns", "ffn_end_ns")
        return dataclasses.replace(
            r,
            compute_ms=self.ms(r.compute_ms),
            wait_ms=self.ms(r.wait_ms),
            **{name: self.ns(getattr(r, name)) for name in marks},
        )

    def arrival(self, r: ArrivalRecord) -> ArrivalRecord:
        echo = r.echo_ps_per_byte
        return dataclasses.replace(
            r,
            kernel_ns=self.ns(r.kernel_ns),
            read_ns=self.ns(r.read_ns),
            sent_ns=self.ns(r.sent_ns),
            echo_ps_per_byte=None if echo is None else round(echo / self.factor),
        )

    def records(self, device: DeviceRecords, rank: int) -> DeviceRecords:
        fold = self.folded[rank] if self.folded else 1
        return DeviceRecords(
            device.session,
            [self.inference(r, fold) for r in device.inferences],
            [self.block(r) for r in device.blocks],
            [self.arrival(r) for r in device.arrivals],
        )

    def event(self, applied: AppliedEvent) -> AppliedEvent:
        return dataclasses.replace(
            applied,
            asked_ns=self.ns(applied.asked_ns),
            applied_ns=self.ns(applied.applied_ns),
            ended_ns=self.ns(applied.ended_ns),
            began_ns=self.ns(applied.began_ns),
            due_end_ns=self.ns(applied.due_end_ns) or 0,
        )

    def facts(self, facts: HostSessionFacts) -> HostSessionFacts:
        stalls = facts.stalls
        if stalls is not None:
            stalls = [(self.ns(s), round(n / self.factor)) for s, n in stalls]
        events = facts.events
        if events is not None:
            events = [(self.ns(t), what) for t, what in events]
        timeline = facts.timeline
        if timeline is not None:
            timeline = [self.event(a) for a in timeline]
        ports = facts.ports
        if ports is not None:
            ports = {
                rank: dataclasses.replace(
                    p, stalled_ms=None if p.stalled_ms is None else p.stalled_ms / self.factor
                )
                for rank, p in ports.items()
            }
        replay = facts.replay
        if replay is not None:
            replay = copy.copy(replay)
            replay.start_ns = self.ns(replay.start_ns) or 0
            replay.asked_ns = [self.ns(t) or 0 for t in replay.asked_ns]
            replay.applied_ns = [self.ns(t) or 0 for t in replay.applied_ns]
        return dataclasses.replace(
            facts,
            replay=replay,
            stalls=stalls,
            events=events,
            timeline=timeline,
            ports=ports,
        )


def virtual(
    outcome: SessionOutcome, factor: float, folded: list[int] | None = None
) -> SessionOutcome:
    """A session's outcome in virtual time: every record and fact of it (see above), with
    the session's first measured inference (on any device) as the origin; `folded`: by rank,
    the threads folded into each worker's one."""
    if factor == 1:
        return outcome
    starts = [
        r.start_ns for run in outcome.runs.values() for d in run.values() for r in d.inferences
    ]
    dilated = Dilated(factor, min(starts) if starts else 0, folded)
    return dataclasses.replace(
        outcome,
        facts=dilated.facts(outcome.facts),
        runs={
            trial: {rank: dilated.records(d, rank) for rank, d in run.items()}
            for trial, run in outcome.runs.items()
        },
    )
