"""One worker session per device count and bandwidth: the trials of that group, interleaved.

The testbed writes a `devices.spec.RunSpec` file per device (each trial is one of the spec's
runs; the spec names the backend's run secret file, never the secret: see
`testbed.backends.base`), starts `python -m devices.worker SPEC` on every device, and reads
back what each wrote (`devices.records`). Within the session the workers run one inference of
each trial in turn, so a slow minute of the shared host falls on every method alike and the
model is loaded once. A worker that fails fails every trial of its session (their rows say
why and the workers' logs are kept); the sweep goes on with the next session.

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

from devices.records import DeviceRecords, read_records
from devices.spec import MethodRun, RunSpec
from testbed.backends.base import Backend, Device, ExecResult
from testbed.errors import TestbedError
from testbed.experiment.schema import Experiment
from testbed.link.emulator import LinkCounters
from testbed.link.links import LinkState
from testbed.link.replay import TraceReplay
from testbed.results.facts import HostSessionFacts
from testbed.results.store import write_text
from testbed.sweep.bundles import RunFiles
from testbed.sweep.plan import Trial, impairment_label

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

    @property
    def ok(self) -> bool:
        return not self.error

    def records(self, trial_id: str) -> tuple[dict[int, DeviceRecords] | None, str]:
        """A trial's records (None where it failed) and its error (empty when it did not)."""
        error = self.error or self.failures.get(trial_id, "")
        return (None if error else self.runs[trial_id]), error


def session_id(trial: Trial) -> str:
    """The session a trial runs in: its device count, rate and impairment variant."""
    name = f"p{trial.devices}-{trial.bandwidth_mbit:g}mbit"
    return f"{name}-{impairment_label(trial.impairments)}" if trial.impairment else name


def device_spec(
    backend: Backend,
    experiment: Experiment,
    trials: list[Trial],
    device: Device,
    peers: list[str],
    out: Path,
    files: RunFiles,
    link: LinkState,
) -> RunSpec:
    """What `device` runs: every trial of the session, paths as the device sees them."""

    def seen(path: Path | None) -> Path | None:
        return None if path is None else Path(backend.device_path(path))

    runs = [
        MethodRun(
            id=trial.trial_id,
            method=trial.method,
            params=trial.method_params,
            bundle=seen(files.bundle_for(trial)),
            inferences=files.batches or experiment.repeats,
        )
        for trial in trials
    ]
    return RunSpec(
        rank=device.rank,
        peers=peers,
        model=experiment.model.name,
        checkpoint=seen(files.checkpoint),
        model_seed=experiment.model.seed,
        runs=runs,
        batch=experiment.batch,
        warmup=experiment.warmup,
        threads=device.threads,
        inputs=seen(files.inputs),
        out=Path(backend.output_path(device, out)),
        connect_timeout_s=CONNECT_TIMEOUT_S,
        recv_timeout_s=experiment.timeout_s,
        rate_mbit=link.measured_mbit.get(device.rank, link.rate_mbit),
        clock_skew_s=backend.clock_skews_s.get(device.rank, 0.0),
        secret_file=backend.secret_files.get(device.rank),
    )


def run_workers(
    backend: Backend,
    devices: Sequence[Device],
    argvs: list[list[str]],
    timeout_s: float,
    why: str = "timeout_s",
    gone: Callable[[], str | None] | None = None,
) -> tuple[list[ExecResult], int | None]:
    """Start every worker on `devices` (by rank, one argv each), wait for all; returns their
    results and the rank of the first that failed (None: none did). The rest are killed on the
    deadline (`why` explains it in the error), on what `gone()` reports every WATCH_S (a
    device or the link emulator that died: the workers would wait out their timeout on a link
    that no longer carries anything), and PEER_GRACE_S after a worker failed (its peers
    normally fail at once naming it; a peer slowed to a crawl, e.g. by a memory limit, would
    not)."""
    processes = [backend.spawn(device, argv) for device, argv in zip(devices, argvs, strict=True)]
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
    backend: Backend,
    experiment: Experiment,
    trials: list[Trial],
    directory: Path,
    port: int,
    link: LinkState,
    files: RunFiles,
    link_counters: Callable[[], dict[int, LinkCounters]],
    replay: TraceReplay | None = None,
    gone: Callable[[], str | None] | None = None,
    devices: Sequence[Device] | None = None,
) -> SessionOutcome:
    """Run `trials` in one session on the backend's devices, in `directory` (whose name is the
    session's id); `link_counters()` reads each device's link counters (Links.counters),
    before and after the session; `replay`, a trace to play on the links while the workers run
    (from their start to their end); `gone()` says why a device or the emulator died
    (Links.gone), watched while the workers run: the session then fails at once, naming
    it, with the workers' last lines, and no trial of it counts as run on an emulated link.
    `devices`: as the links reach them (Links.devices: at the emulator's addresses); the
    backend's own by default."""
    devices = list(backend.devices if devices is None else devices)
    peers = [f"{d.address}:{port}" for d in devices]
    outs = {d.rank: directory / f"rank{d.rank}" for d in devices}
    argvs = []
    for device in devices:
        outs[device.rank].mkdir(parents=True, exist_ok=True)
        spec = device_spec(
            backend, experiment, trials, device, peers, outs[device.rank], files, link
        )
        path = spec.write(outs[device.rank] / "spec.json")
        argvs.append([backend.python, "-m", "devices.worker", backend.device_path(path)])
    before = link_counters()
    started, started_ns = time.monotonic(), time.time_ns()
    deadline_s = experiment.timeout_s * len(trials)
    why = f"timeout_s {experiment.timeout_s:g} s x {len(trials)} trials"
    with replay or contextlib.nullcontext():
        results, first = run_workers(backend, devices, argvs, deadline_s, why, gone)
    session_s = round(time.monotonic() - started, 3)
    lost = (gone() if gone is not None else None) or ""
    after = {} if lost else link_counters()
    for device in devices:
        backend.collect(device, outs[device.rank])
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
        replay=replay,
    )
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


def _session_stalls(
    counters: dict[int, LinkCounters], since_ns: int
) -> list[tuple[int, int]] | None:
    """Every port's stalls since `since_ns` (the log spans the switch's life), sorted: a device
    waits for messages that cross its peers' ports. None where the links are not clocked."""
    logs = [c.stalls for c in counters.values()]
    if any(log is None for log in logs):
        return None
    return sorted(s for log in logs for s in log or [] if s[0] + s[1] >= since_ns)
