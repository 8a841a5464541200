"""One worker session per group of trials that share devices and a link (device count, rate,
impairment variant, fleet variant): the trials of that group, interleaved.

The testbed writes a `devices.spec.RunSpec` file per device (each trial is one of the spec's
runs; the spec names the backend's run secret file, never the secret: see
`testbed.backends.base`), starts `python -m devices.worker SPEC` on every device, and reads
back what each wrote (`devices.records`). Within the session the workers run one inference of
each trial in turn, so a slow minute of the shared host falls on every method alike and the
model is loaded once. A worker that fails fails every trial of its session (their rows say
why and the workers' logs are kept); the sweep goes on with the next session. A device that
leaves on the timeline (testbed.sweep.session_timeline) ends the session too, but the inferences
every device finished before are kept, and only the rest fail, naming the event.

    <run dir>/sessions/<session id>/rank<r>/   spec.json, session.json, records.jsonl, logits/
    <run dir>/sessions/<session id>/rank<r>.log
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from devices.pace import LEAST_SAMPLES, knows_run, run_kind
from devices.records import DeviceRecords, read_records
from devices.spec import MethodRun, RunSpec
from testbed.backends.base import Backend, Device, ExecResult, Process
from testbed.errors import TestbedError
from testbed.experiment.schema import Experiment
from testbed.link.emulator import LinkCounters, PortCounts, port_counts
from testbed.link.links import LinkState
from testbed.link.replay import TraceReplay
from testbed.results.facts import AppliedEvent, HostSessionFacts
from testbed.results.store import write_atomic, write_text
from testbed.sweep import stretch_costs
from testbed.sweep.bundles import RunFiles
from testbed.sweep.plan import Trial, fleet_label, impairment_label
from testbed.sweep.session_timeline import Hands, SessionTimeline

log = logging.getLogger(__name__)

WORKER_PORT = 7100
CONNECT_TIMEOUT_S = 60.0
WATCH_S = 0.5  # how often a running session checks that its devices and emulator live
PEER_GRACE_S = 10.0  # what the other workers get to end on their own after one failed
LAST_WORDS = 5  # lines of a dead device's worker log that its trials' error quotes


@dataclass
class SessionOutcome:
    """What a session gave: its facts, and per trial each rank's records of the trial's run,
    or why there are none (the session failed: `error`; or that trial's records are missing)."""

    facts: HostSessionFacts
    error: str = ""
    runs: dict[str, dict[int, DeviceRecords]] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    lost: str = ""  # a device or the emulator died: no later session of these devices can run
    # a device left on the timeline: per trial, the inferences not every device finished
    unfinished: dict[str, list[int]] = field(default_factory=dict)
    left: str = ""  # what the departure's failed rows say

    @property
    def ok(self) -> bool:
        return not self.error and not self.left

    def records(self, trial_id: str) -> tuple[dict[int, DeviceRecords] | None, str]:
        """A trial's records (None where it failed) and its error (empty when it did not)."""
        error = self.error or self.failures.get(trial_id, "")
        return (None if error else self.runs[trial_id]), error


@dataclass
class SessionFleet:
    """What the session's devices are: each one's tokens and speed at the start, and the
    timeline played on them (None: no event in this session)."""

    sizes: list[int]
    speeds: list[float]
    timeline: SessionTimeline | None = None
    set_link: Callable[[int, dict[str, object]], str] | None = None  # Links.set_device
    dilation: float = 1.0  # virtual time (testbed.experiment.dilation): the host's x it
    # by rank, the device's threads folded into its worker's one (virtual time on this host:
    # a device of c cores is one host thread at c times its speed per core; 1: none folded)
    folded: list[int] = field(default_factory=list)

    def threads(self, device: Device) -> int:
        """The worker's torch threads on `device`."""
        return 1 if self.fold(device.rank) > 1 else device.threads

    def fold(self, rank: int) -> int:
        return self.folded[rank] if self.folded else 1

    def worker_speed(self, rank: int) -> float:
        """Device `rank`'s speed at the start as its worker paces to it (the host's clock)."""
        return self.speeds[rank] * self.fold(rank) / self.dilation


@dataclass
class Session:
    """One session as the runner plans it: its trials, its directory (whose name is the
    session's id), its worker port, the link as shaped and probed for it, the files its
    devices load, and what is played while its workers run: the fleet's partition, speeds and
    timeline (None: even, full speed, no event) and a bandwidth trace on the links."""

    trials: list[Trial]
    directory: Path
    port: int
    link: LinkState
    files: RunFiles
    fleet: SessionFleet | None = None
    replay: TraceReplay | None = None


class SessionLinks(Protocol):
    """What a session asks of the run's links (`testbed.link.links.Links` is one)."""

    @property
    def devices(self) -> list[Device]:
        """The devices as the links reach them (at the emulator's addresses, if any)."""
        ...

    def counters(self) -> dict[int, LinkCounters]:
        """Each device's link counters, read before and after the session."""
        ...

    def gone(self) -> str | None:
        """Why a device or the emulator died (None: all live), watched while workers run."""
        ...


TURN_FILE = "turn"  # in the session's directory: its devices' turns at warm-up (devices.pace)


def session_id(trial: Trial) -> str:
    """The session a trial runs in: its device count, rate, impairment and fleet variant."""
    name = f"p{trial.devices}-{trial.bandwidth_mbit:g}mbit"
    if trial.impairment:
        name += f"-{impairment_label(trial.impairments)}"
    return f"{name}-{fleet_label(trial.fleet)}" if trial.fleet else name


def device_spec(
    backend: Backend,
    experiment: Experiment,
    session: Session,
    device: Device,
    devices: list[Device],
    out: Path,
) -> RunSpec:
    """What `device`, one of the session's `devices`, runs: every trial of the session, paths
    as the device sees it."""

    def seen(path: Path | None) -> Path | None:
        return None if path is None else Path(backend.device_path(path))

    files, link, fleet = session.files, session.link, session.fleet
    timeline = None if fleet is None else fleet.timeline
    references = stretch_costs.known(experiment.model.name) if type(backend).on_this_host else {}
    d = 1.0 if fleet is None else fleet.dilation

    runs = [
        MethodRun(
            id=trial.trial_id,
            method=trial.method,
            params=trial.method_params,
            bundle=seen(files.bundle_for(trial)),
            inferences=files.batches or experiment.repeats,
        )
        for trial in session.trials
    ]
    return RunSpec(
        rank=device.rank,
        peers=[f"{peer.address}:{session.port}" for peer in devices],
        model=experiment.model.name,
        checkpoint=seen(files.checkpoint),
        model_seed=experiment.model.seed,
        runs=runs,
        batch=experiment.batch,
        warmup=session_warmup(experiment, session, devices, references),
        threads=device.threads if fleet is None else fleet.threads(device),
        inputs=seen(files.inputs),
        out=Path(backend.output_path(device, out)),
        connect_timeout_s=CONNECT_TIMEOUT_S * d,
        recv_timeout_s=experiment.timeout_s * d,
        rate_mbit=link.measured_mbit.get(device.rank, link.rate_mbit) / d,
        clock_skew_s=backend.clock_skews_s.get(device.rank, 0.0),
        references=references,
        secret_file=backend.secret_files.get(device.rank),
        partition=None if fleet is None else fleet.sizes,
        speed=1.0 if fleet is None else fleet.worker_speed(device.rank),
        control_file=None if timeline is None else seen(timeline.controls[device.rank]),
        turn_file=seen(session.directory / TURN_FILE) if type(backend).on_this_host else None,
        holds=[] if timeline is None else timeline.holds(device.rank),
    )


def session_warmup(
    experiment: Experiment, session: Session, devices: list[Device], references: dict[str, float]
) -> int:
    """The session's warm-ups: the experiment's, or LEAST_SAMPLES where a paced device's run
    has no references on this host yet. A warm-up samples a run's embedding and its first
    block's stretches once (devices.pace.knows_run): a reference from one sample is the
    host's mood at the run's first inference (Astra's first block 6.5 ms in one run, 18.3 ms
    beside a busy process in the next), and it is never kept."""
    fleet = session.fleet
    if fleet is None or experiment.warmup >= LEAST_SAMPLES:
        return experiment.warmup
    paced = [device for device in devices if fleet.worker_speed(device.rank) < 1.0]
    for trial in session.trials:
        params = trial.spec.params()
        for device in paced:
            tokens, threads = fleet.sizes[device.rank], fleet.threads(device)
            kind = run_kind(
                experiment.model.name, trial.method, params, tokens, experiment.batch, threads
            )
            if not knows_run(references, kind):
                return LEAST_SAMPLES
    return experiment.warmup


def run_workers(
    backend: Backend,
    devices: Sequence[Device],
    argvs: list[list[str]],
    timeout_s: float,
    why: str = "timeout_s",
    gone: Callable[[], str | None] | None = None,
    started: Callable[[list[Process]], None] | None = None,
) -> tuple[list[ExecResult], int | None]:
    """Start every worker on `devices` (by rank, one argv each), wait for all; returns their
    results and the rank of the first that failed (None: none did). The rest are killed on the
    deadline (`why` explains it in the error), on what `gone()` reports every WATCH_S (a
    device or the link emulator that died: the workers would wait out their timeout on a link
    that no longer carries anything), and PEER_GRACE_S after a worker failed (its peers
    normally fail at once naming it; a peer slowed to a crawl, e.g. by a memory limit, would
    not). `started(processes)` is called once every worker is spawned."""
    processes = [backend.spawn(device, argv) for device, argv in zip(devices, argvs, strict=True)]
    if started is not None:
        started(processes)
    deadline = time.monotonic() + timeout_s
    results: list[ExecResult | None] = [None] * len(processes)
    first: int | None = None
    failed_at = 0.0
    try:
        while pending := [rank for rank, done in enumerate(results) if done is None]:
            now = time.monotonic()
            if now >= deadline:
                message = f"worker {pending[0]}: no result within {timeout_s:g} s ({why})"
                results[pending[0]] = ExecResult(-1, "", message)
                first = pending[0] if first is None else first
                break
            if first is not None and now - failed_at > PEER_GRACE_S:
                break
            if gone is not None and gone() is not None:
                break  # the workers are killed: what they said is collected below
            for rank in pending:
                try:
                    result = processes[rank].wait(min(deadline - now, WATCH_S) / len(pending))
                except TimeoutError:
                    continue
                results[rank] = result
                if not result.ok and first is None:
                    first, failed_at = rank, time.monotonic()
    finally:
        for process in processes:
            process.kill()
    for rank, process in enumerate(processes):
        if results[rank] is None:
            try:
                results[rank] = process.wait(5)
            except TimeoutError:
                results[rank] = ExecResult(-1, "", f"worker {rank}: killed")
    return [r for r in results if r is not None], first


def run_session(
    backend: Backend, experiment: Experiment, session: Session, links: SessionLinks
) -> SessionOutcome:
    """Run the session's trials on the links' devices, in its directory. The links' counters
    are read before and after the session; the session's replay plays on the links while the
    workers run (from their start to their end), and so does its fleet's timeline; what
    `links.gone()` says is watched while the workers run: a device or the emulator that died
    fails the session at once, naming it, with the workers' last lines, and no trial of it
    counts as run on an emulated link."""
    trials, directory, files = session.trials, session.directory, session.files
    fleet, replay, gone = session.fleet, session.replay, links.gone
    devices = list(links.devices)
    outs = {d.rank: directory / f"rank{d.rank}" for d in devices}
    timeline = None if fleet is None else fleet.timeline
    if timeline is not None:
        timeline.write_controls()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / TURN_FILE).touch()
    argvs = []
    for device in devices:
        outs[device.rank].mkdir(parents=True, exist_ok=True)
        spec = device_spec(backend, experiment, session, device, devices, outs[device.rank])
        path = write_atomic(outs[device.rank] / "spec.json", spec.write)  # a full disk: named
        argvs.append([backend.python, "-m", "devices.worker", backend.device_path(path)])
    before = links.counters()
    started, started_ns = time.monotonic(), time.time_ns()
    d = 1.0 if fleet is None else fleet.dilation
    deadline_s = experiment.timeout_s * len(trials) * d
    why = f"timeout_s {experiment.timeout_s:g} s x {len(trials)} trials"
    if d != 1:
        why += f" x dilation {d:g}"

    def play(processes: list[Process]) -> None:
        if timeline is not None:
            assert fleet is not None and fleet.set_link is not None
            timeline.start(Hands(backend, devices, fleet.set_link, processes))

    try:
        with replay or contextlib.nullcontext():
            results, first = run_workers(backend, devices, argvs, deadline_s, why, gone, play)
    finally:
        if timeline is not None:
            timeline.stop()
    session_s = round(time.monotonic() - started, 3)
    lost = gone() or ""
    after = {} if lost else links.counters()
    for device in devices:
        backend.collect(device, outs[device.rank])
    if type(backend).on_this_host:
        stretch_costs.keep(list(outs.values()))
    for rank, result in enumerate(results):
        write_text(
            directory / f"rank{rank}.log",
            f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}",
        )
    facts = HostSessionFacts(
        session_id=directory.name,
        session_s=session_s,
        sent_bytes={rank: after[rank].sent_bytes - before[rank].sent_bytes for rank in after},
        stalls=_session_stalls(after, started_ns) if after else None,
        events=_session_events(after, started_ns) if after else None,
        ports=_port_counts(before, after, started_ns),
        replay=replay,
        timeline=None if timeline is None else timeline.applied,
    )
    left = None if timeline is None or lost else timeline.left
    if left is not None:
        return _after_leave(trials, outs, facts, left, files.batches or experiment.repeats)
    error = (
        "" if first is None else _worker_error(backend, devices[first], experiment, results[first])
    )
    if lost:
        words = "; ".join(
            f"worker {rank}: "
            + (" | ".join(r.tail(LAST_WORDS).splitlines()) or f"exit {r.returncode}")
            for rank, r in enumerate(results)
        )
        error = f"{lost}, {session_s:g} s into session {directory.name} (last lines: {words})"
    outcome = SessionOutcome(facts, error, lost=lost)
    if error:
        return outcome
    try:
        records = {rank: read_records(out) for rank, out in outs.items()}
    except (OSError, ValueError, TypeError, KeyError) as problem:
        outcome.error = f"the workers' records cannot be read: {problem}"
        return outcome
    for trial in trials:
        try:
            outcome.runs[trial.trial_id] = {
                rank: only_run(device, trial.trial_id) for rank, device in records.items()
            }
        except TestbedError as problem:
            outcome.failures[trial.trial_id] = str(problem)
    return outcome


def _after_leave(
    trials: list[Trial],
    outs: dict[int, Path],
    facts: HostSessionFacts,
    left: AppliedEvent,
    inferences: int,
) -> SessionOutcome:
    """A session a device left: per trial, the inferences every device finished (the workers
    keep them when they end), and the rest unfinished, naming the departure."""
    since = (left.applied_ns or 0) - (left.asked_ns or 0)
    words = f"device {left.device} left the session (timeline[{left.index}]: {left.label}"
    outcome = SessionOutcome(facts, left=f"{words}, {since / 1e6:.1f} ms after its time)")
    records: dict[int, DeviceRecords] = {}
    for rank, out in outs.items():
        try:
            records[rank] = read_records(out)
        except (OSError, ValueError, TypeError, KeyError):  # it left before writing any
            continue
    for trial in trials:
        runs = {rank: _run_or_none(r, trial.trial_id) for rank, r in records.items()}
        done = set(range(inferences))
        for rank in outs:
            run = runs.get(rank)
            done &= {r.inference for r in run.inferences} if run is not None else set()
        outcome.unfinished[trial.trial_id] = sorted(set(range(inferences)) - done)
        outcome.runs[trial.trial_id] = {
            rank: _only_inferences(run, done) for rank, run in runs.items() if run is not None
        }
        if not done:
            outcome.failures[trial.trial_id] = outcome.left
    return outcome


def _run_or_none(records: DeviceRecords, run: str) -> DeviceRecords | None:
    try:
        return only_run(records, run)
    except TestbedError:
        return None


def _only_inferences(records: DeviceRecords, keep: set[int]) -> DeviceRecords:
    return DeviceRecords(
        records.session,
        [r for r in records.inferences if r.inference in keep],
        [r for r in records.blocks if r.inference in keep],
        [r for r in records.arrivals if r.inference in keep],
    )


def _worker_error(
    backend: Backend, device: Device, experiment: Experiment, result: ExecResult
) -> str:
    """Why the first worker to fail failed: its last line, or its exit status, with the
    kernel's out-of-memory kill named where the backend can tell."""
    said = result.tail(1) or f"worker {device.rank}: exit status {result.returncode}"
    if result.returncode in (137, -9) and backend.out_of_memory(device):
        memory = experiment.devices.memory_mb
        return f"{said}: the kernel killed it for memory (the device has memory_mb {memory})"
    return said


def only_run(records: DeviceRecords, run: str) -> DeviceRecords:
    """A device's records of one run of its session."""
    inferences = [r for r in records.inferences if r.run == run]
    if not inferences:
        raise TestbedError(f"device {records.session.rank} recorded nothing of run {run}")
    return DeviceRecords(
        records.session,
        inferences,
        [r for r in records.blocks if r.run == run],
        [r for r in records.arrivals if r.run == run],
    )


def _session_events(
    counters: dict[int, LinkCounters], since_ns: int
) -> list[tuple[int, str]] | None:
    """Every port's impairment events since `since_ns`, sorted; None where the emulator does
    not draw impairments itself."""
    logs = [c.events for c in counters.values()]
    if any(log is None for log in logs):
        return None
    return sorted(e for log in logs for e in log or [] if e[0] >= since_ns)


def _port_counts(
    before: dict[int, LinkCounters], after: dict[int, LinkCounters], since_ns: int
) -> dict[int, PortCounts] | None:
    """Each link's counts within the session, by rank (those the emulator counts: tbf's where
    a netem is); None where it counts none, or the session lost it (`after` empty)."""
    counts = {rank: port_counts(before[rank], after[rank], since_ns) for rank in after}
    return {rank: count for rank, count in counts.items() if count is not None} or None


def _session_stalls(
    counters: dict[int, LinkCounters], since_ns: int
) -> list[tuple[int, int]] | None:
    """Every port's stalls since `since_ns` (the log spans the switch's life), sorted: a device
    waits for messages that cross its peers' ports. None where the links are not clocked."""
    logs = [c.stalls for c in counters.values()]
    if any(log is None for log in logs):
        return None
    return sorted(s for log in logs for s in log or [] if s[0] + s[1] >= since_ns)
