"""Executes an experiment: devices started (and their GEMM rates measured) once per device count,
links reshaped per rate and impairment variant, one worker session per device count, rate,
impairment variant and fleet variant that runs all of its trials interleaved
(testbed.sweep.sessions) and plays the timeline (testbed.sweep.session_timeline); every trial's rows
written to disk as soon as its session ends.

A session that fails (a worker crashes, times out or refuses its peer) records its trials
with the error and the workers' logs, and the sweep goes on. Whatever happens, the backend
removes what it created (containers, networks, namespaces, qdiscs) on the way out.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import yaml

from testbed import voice
from testbed.backends.base import Backend, Device
from testbed.errors import StorageError
from testbed.experiment.level_accuracy import load_level_accuracy
from testbed.experiment.schema import Experiment
from testbed.figures import make_figures
from testbed.link.links import Links, LinkState
from testbed.link.paths import PathImpairments
from testbed.link.probe import WIRE_PER_PAYLOAD
from testbed.link.rates import rate_overrides
from testbed.link.replay import TraceReplay
from testbed.results import fidelity
from testbed.results.facts import AppliedEvent, HostSessionFacts, PlanRow, RunFacts
from testbed.results.rows import RowFacts, assemble
from testbed.results.store import (
    combine,
    finished_trials,
    load,
    save_trial,
    write_frame,
    write_text,
)
from testbed.sweep import environment, fleets, interrupts
from testbed.sweep.bundles import RunFiles, prepare_run_files
from testbed.sweep.lock import RunLock
from testbed.sweep.plan import (
    Trial,
    device_profiles,
    fleet_label,
    impairment_label,
    link_profile,
    link_trace,
    plan_rows,
    plan_trials,
)
from testbed.sweep.preflight import check_experiment
from testbed.sweep.progress import TrialProgress
from testbed.sweep.sessions import (
    WORKER_PORT,
    Session,
    SessionFleet,
    SessionOutcome,
    run_session,
    session_id,
)
from testbed.sweep.virtual_time import virtual

PlanRows = dict[tuple[str, int], PlanRow]


def _probed(link: LinkState, count: int) -> str:
    """What the probe measured: 'probed 1.00, 0.99 Mbit/s' (frames, as the shaper meters), and
    on a shared medium what all devices achieved at once."""
    if count < 2:
        return "no probe (one device)"
    rates = [link.wire_mbit(rank) for rank in range(count)]
    shown = ", ".join("-" if r is None else f"{r:.3f}" for r in rates)
    flagged = [rank for rank in range(count) if link.flagged(rank)]
    warning = f" (device {', '.join(map(str, flagged))} more than 5% off!)" if flagged else ""
    together = ""
    if link.together_mbit:  # a shared medium: every device at once, their frame rates' sum
        total = sum(link.together_mbit.values()) * WIRE_PER_PAYLOAD
        together = f"; all at once {total:.3f} in all on the shared medium"
    return f"probed {shown} Mbit/s{together}{warning}"


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


@dataclass
class RunOutcome:
    run_dir: Path
    ok: int = 0
    failed: int = 0
    skipped: int = 0
    ended_early: int = 0  # of the ok ones: a device left on the timeline before their end
    failures: list[str] = field(default_factory=list)


def prepare_run_dir(
    experiment: Experiment,
    run_dir: Path,
    trials: list[Trial],
    rows: list[PlanRow] | None = None,
    host_gflops: float | None = None,
) -> PlanRows:
    """Write the resolved experiment and the plan; the plan's rows by (trial id, rank)."""
    rows = plan_rows(experiment, trials, host_gflops) if rows is None else rows
    run_dir.mkdir(parents=True, exist_ok=True)
    config = experiment.model_dump(mode="json")
    write_text(run_dir / "config.yaml", yaml.safe_dump(config, sort_keys=False))
    write_frame(pd.DataFrame([row.as_dict() for row in rows]), run_dir / "plan.csv")
    return {(row.trial_id, row.rank): row for row in rows}


class Runner:
    def __init__(self, experiment: Experiment, run_dir: Path, backend_name: str, run_id: str):
        self.experiment, self.run_dir = experiment, Path(run_dir)
        self.run_id = run_id
        self.trials = plan_trials(experiment)
        # everything is checked before any device starts (testbed.run did it already)
        checked = check_experiment(experiment, backend_name, f"experiment {experiment.name}")
        self.profile, self.backend = checked.profile, checked.backend
        self.emulator, self.host_gflops = checked.emulator, checked.host_gflops
        link = experiment.link
        self.trace = None if link.trace is None else link_trace(link)
        self.level_accuracy = load_level_accuracy(experiment)  # None without report.level_accuracy
        self.sessions = 0  # sessions started: each gets its own worker port
        self.start_s: dict[int, float] = {}  # by device count: how long starting them took
        self.gflops: dict[int, float] = {}  # the started devices' GEMM rates, by rank
        self.dilations = checked.dilations  # by device count (testbed.experiment.dilation)

    def run(self, resume: bool = False) -> RunOutcome:
        """Runs every trial (those without results, when resuming) holding the run's lock."""
        with RunLock(self.run_id, self.run_dir):
            return self._run(resume)

    def _run(self, resume: bool) -> RunOutcome:
        plan = prepare_run_dir(
            self.experiment, self.run_dir, self.trials, host_gflops=self.host_gflops
        )
        if self.level_accuracy is not None:
            write_frame(self.level_accuracy.frame(), self.run_dir / "level_accuracy.csv")
        done = finished_trials(self.run_dir) if resume else set()
        outcome = RunOutcome(self.run_dir, skipped=len(done & {t.trial_id for t in self.trials}))
        files = prepare_run_files(self.experiment, self.trials, self.run_dir)
        todo = [t for t in self.trials if t.trial_id not in done]
        progress = TrialProgress(self.experiment.name, self._link_times(todo, plan, files))
        failed = True
        try:
            for count, group in itertools.groupby(todo, key=lambda t: t.devices):
                self._run_count(count, list(group), plan, files, outcome, progress)
            failed = False
        finally:
            progress.close()
            if (self.run_dir / "trials").is_dir():
                try:
                    combine(self.run_dir)
                except StorageError:
                    if not failed:  # else the first error is the one to report
                        raise
        with voice.phase("figures", f"drawing into {self.run_dir / 'figures'}") as step:
            written = make_figures(load(self.run_dir))
            step.outcome = f"{len(written)} written"
        return outcome

    def _link_times(
        self, trials: list[Trial], plan: PlanRows, files: RunFiles
    ) -> dict[tuple[int, float, str, str], tuple[int, float]]:
        """Per session (device count, rate, impairment): its trials and its analytic link time
        (s: serialisation and delay)."""
        inferences = self.experiment.warmup + (files.batches or self.experiment.repeats)
        sessions: dict[tuple[int, float, str, str], tuple[int, float]] = {}
        for trial in trials:
            key = (trial.devices, trial.bandwidth_mbit, trial.impairment, trial.fleet)
            rows = [plan[(trial.trial_id, rank)] for rank in range(trial.devices)]
            slowest = max(row.analytic_comm_ms + row.analytic_delay_ms for row in rows)
            count, link_s = sessions.get(key, (0, 0.0))
            sessions[key] = (count + 1, link_s + inferences * slowest / 1000)
        return sessions

    def _run_count(
        self,
        count: int,
        trials: list[Trial],
        plan: PlanRows,
        files: RunFiles,
        outcome: RunOutcome,
        progress: TrialProgress,
    ) -> None:
        spec = fleets.device_spec(self.experiment, count)
        with self.backend.create(self.run_id, self.run_dir, self.experiment) as backend:
            doing = f"starting {count} {backend.name} devices ({fleets.describe(spec)})"
            backend.prepare()
            began = time.monotonic()
            with voice.phase(f"devices P={count}", doing):
                backend.start(spec)
            self.start_s[count] = time.monotonic() - began
            model = self.experiment.model.name
            dilation = self.dilations[count]
            self.gflops = fleets.measure_devices(backend, backend.devices, model, dilation.factor)
            overrides = rate_overrides(self.experiment.link)
            paths = PathImpairments.of(self.experiment.link)
            voice.say(f"P={count}: virtual time, {dilation.describe()}")
            with Links(
                backend, self.profile, self.emulator, self.run_id, overrides, paths, dilation.factor
            ) as links:
                self._write_environment(backend, links.devices, count)
                by_link = itertools.groupby(
                    trials, key=lambda t: (t.bandwidth_mbit, t.impairment, t.fleet)
                )
                lost = ""  # a device or the emulator died: these devices run no more sessions
                for (rate, impairment, fleet), grouped in by_link:
                    key = (count, rate, impairment, fleet)
                    group, what = list(grouped), f"P={count} {rate:g} Mbit/s"
                    if self.trace is not None:
                        what = f"P={count} trace {self.trace.name} (mean {rate:g} Mbit/s)"
                    if impairment:
                        what += f" {impairment_label(group[0].impairments)}"
                    if fleet:
                        what += f" {fleet_label(fleet)}"
                    interrupts.check()
                    if lost:
                        self._record_unrun(backend, group, plan, rate, f"not run: {lost}", outcome)
                        progress.skip(key, what, "NOT RUN")
                        continue
                    progress.start(key, what)
                    # a trace's link is shaped and probed at its first step
                    shaped = rate if self.trace is None else self.trace.rates_mbit[0]
                    profile = link_profile(self.experiment, group[0])
                    uplinks = device_profiles(self.experiment, group[0])
                    link = links.shape(shaped, self.experiment.link.probe_s, profile, uplinks)
                    self._save_link(link, count, group[0])
                    voice.say(f"{what}: {self.emulator.name} link, {_probed(link, count)}")
                    result = self._run_session(links, group, plan, files, link, outcome)
                    said = "ok" if result.ok else ("ENDED EARLY" if result.left else "FAILED")
                    progress.finish(key, what, said)
                    lost = result.lost
                    interrupts.check()

    def _run_session(
        self,
        links: Links,
        trials: list[Trial],
        plan: PlanRows,
        files: RunFiles,
        link: LinkState,
        outcome: RunOutcome,
    ) -> SessionOutcome:
        name = session_id(trials[0])
        directory = self.run_dir / "sessions" / name
        if directory.exists():  # a resumed run: keep the earlier session's files
            name += f"-{secrets.token_hex(2)}"
            directory = directory.with_name(name)
        backend = links.backend
        port = WORKER_PORT + self.sessions % 1000
        self.sessions += 1
        dilation = links.dilation
        replay = None
        if self.trace is not None:
            replay = TraceReplay(links.set_rate, self.trace, dilation)
        outs = {d.rank: directory / f"rank{d.rank}" for d in backend.devices}
        live = {rank: backend.live_output(backend.devices[rank], out) for rank, out in outs.items()}
        fleet, session_fleet = fleets.session_fleet(
            self.experiment, trials, directory, self.host_gflops, self.gflops, live, dilation
        )
        session_fleet.set_link = links.set_device
        if fleet.partition == "by_speed":  # the measured rates may move a token or two
            rows = plan_rows(self.experiment, trials, self.host_gflops, self.gflops)
            plan = {**plan, **{(row.trial_id, row.rank): row for row in rows}}
        session = Session(trials, directory, port, link, files, session_fleet, replay)
        result = run_session(backend, self.experiment, session, links)
        # the one place its times are divided by d
        result = virtual(result, dilation, session_fleet.folded)
        if replay is not None:
            self._save_replay(replay, name)
        run = self._run_facts(backend, session_fleet)
        for trial in trials:
            ranks = {rank: plan[(trial.trial_id, rank)] for rank in range(trial.devices)}
            facts = RowFacts(ranks, run, link, result.facts, self.level_accuracy)
            records, error = result.records(trial.trial_id)
            unfinished = result.unfinished.get(trial.trial_id, [])
            rows = assemble(facts, records, error, unfinished, result.left)
            save_trial(self.run_dir, trial.trial_id, *rows)
            if error:
                outcome.failed += 1
                outcome.failures.append(f"{trial.trial_id}: {error}")
            else:
                outcome.ok += 1
                outcome.ended_early += bool(unfinished)
        devices = len(backend.devices)
        fidelity.save(
            self.run_dir,
            name,
            fidelity.report(link, result.facts, result.runs.values(), run, devices),
        )
        if result.left:
            voice.say(f"session {name} ended early: {result.left}")
        elif not result.ok:
            voice.say(f"session {name} failed: {result.error}")
        if result.facts.timeline:
            self._save_timeline(result.facts.timeline, name)
        combine(self.run_dir)
        return result

    def _run_facts(self, backend: Backend, fleet: SessionFleet | None = None) -> RunFacts:
        """What every row of a session's trials shares (`fleet`: the session's, if it ran)."""
        threads = {
            d.rank: d.threads if fleet is None else fleet.threads(d) for d in backend.devices
        }
        return RunFacts(
            dilation=1.0 if fleet is None else fleet.dilation,
            run_id=self.run_id,
            backend=backend.name,
            emulator=self.emulator.name,
            batch=self.experiment.batch,
            threads=threads,
            oversubscribed=backend.oversubscribed,
            trace="" if self.trace is None else self.trace.name,
            shared_clock=type(backend).on_this_host,
            gflops=dict(self.gflops),
        )

    def _record_unrun(
        self,
        backend: Backend,
        trials: list[Trial],
        plan: PlanRows,
        rate_mbit: float,
        error: str,
        outcome: RunOutcome,
    ) -> None:
        """Failed rows for trials whose session could not start (its devices are gone)."""
        run, link = self._run_facts(backend), LinkState(rate_mbit)
        for trial in trials:
            ranks = {rank: plan[(trial.trial_id, rank)] for rank in range(trial.devices)}
            facts = RowFacts(ranks, run, link, HostSessionFacts(""), self.level_accuracy)
            save_trial(self.run_dir, trial.trial_id, *assemble(facts, None, error))
            outcome.failed += 1
            outcome.failures.append(f"{trial.trial_id}: {error}")
        combine(self.run_dir)

    def _write_environment(self, backend: Backend, devices: list[Device], count: int) -> None:
        """environment.json: the host's facts, and per device count its devices' facts (as the
        links reach them)."""
        path = self.run_dir / "environment.json"
        facts = json.loads(path.read_text()) if path.is_file() else {}
        if not facts:
            support = backend.traffic_control.support()
            facts = environment.collect(backend, {"qdisc_support": support})
        cpus = backend.cpu_plan
        facts.setdefault("by_devices", {})[str(count)] = {
            "start_s": round(self.start_s.get(count, 0.0), 3),
            "cpusets": cpus.cpusets if cpus else None,
            "oversubscribed": backend.oversubscribed,
            "devices": [d.__dict__ for d in devices],
            "gflops": self.gflops,
            "dilation": dataclasses.asdict(self.dilations[count]),
        }
        if self.host_gflops is not None:
            facts["host_core_gflops"] = self.host_gflops
        write_text(path, json.dumps(facts, indent=2, default=str))

    def _save_replay(self, replay: TraceReplay, session: str) -> None:
        """What the replay applied and when (CLOCK_REALTIME ns), beside the session's files."""
        steps = {
            "trace": replay.trace.name,
            "start_ns": replay.start_ns,
            "asked_ns": replay.asked_ns,
            "applied_ns": replay.applied_ns,
            "applied_mbit": replay.applied_mbit,
            "applied_impairments": replay.applied_impairments,
            "applied_words": replay.applied_words,
        }
        write_text(self.run_dir / "sessions" / session / "replay.json", json.dumps(steps))

    def _save_timeline(self, applied: list[AppliedEvent], session: str) -> None:
        """When each event of the timeline was due and in force (CLOCK_REALTIME ns)."""
        events = [dataclasses.asdict(event) for event in applied]
        path = self.run_dir / "sessions" / session / "timeline.json"
        write_text(path, json.dumps(events, indent=1))

    def _save_link(self, link: LinkState, count: int, trial: Trial) -> None:
        path = self.run_dir / "links" / f"{session_id(trial)}.json"
        write_text(path, json.dumps(link.__dict__, indent=2, default=str))
