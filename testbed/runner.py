"""Executes an experiment: devices started once per device count, links reshaped per
bandwidth, one worker session per trial; every finished trial written to disk at once.

A trial that fails (a worker crashes, times out or refuses its peer) is recorded with its
error and the workers' logs, and the sweep goes on. Whatever happens, the backend removes
what it created (containers, networks, namespaces, qdiscs) on the way out.
"""

from __future__ import annotations

import itertools
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import yaml
from tqdm import tqdm

from testbed import environment
from testbed.backends.base import Backend, DeviceSpec
from testbed.bundles import RunFiles, prepare_run_files
from testbed.inventory import Inventory
from testbed.link import LinkState, shape_and_probe
from testbed.plan import Trial, plan_rows, plan_trials
from testbed.plots import make_figures
from testbed.profiles import load_profile
from testbed.results import combine, finished_trials, load, save_trial, write_frame, write_text
from testbed.schema import Experiment
from testbed.trial import run_trial

log = logging.getLogger(__name__)


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def make_backend(
    name: str, run_id: str, run_dir: Path, inventory: Inventory | None = None
) -> Backend:
    """The backend by name; `auto` takes Docker when an engine answers, else local. `ssh`
    runs on the inventory's boards."""
    if name == "ssh":
        from testbed.backends.ssh import SshBackend

        return SshBackend(run_id, run_dir, inventory)
    from testbed.backends.docker import DockerBackend, engine_available

    if name == "docker" or (name == "auto" and engine_available()):
        return DockerBackend(run_id, run_dir)
    from testbed.backends.local import LocalBackend

    return LocalBackend(run_id, run_dir)


@dataclass
class RunOutcome:
    run_dir: Path
    ok: int = 0
    failed: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)


def prepare_run_dir(experiment: Experiment, run_dir: Path, trials: list[Trial]) -> pd.DataFrame:
    run_dir.mkdir(parents=True, exist_ok=True)
    config = experiment.model_dump(mode="json")
    write_text(run_dir / "config.yaml", yaml.safe_dump(config, sort_keys=False))
    plan = pd.DataFrame(plan_rows(experiment, trials))
    write_frame(plan, run_dir / "plan.csv")
    return plan


class Runner:
    def __init__(self, experiment: Experiment, run_dir: Path, backend: str, run_id: str):
        self.experiment, self.run_dir = experiment, Path(run_dir)
        self.backend_name, self.run_id = backend, run_id
        self.trials = plan_trials(experiment)
        self.profile = load_profile(experiment.link.profile)

    def run(self, resume: bool = False) -> RunOutcome:
        plan = prepare_run_dir(self.experiment, self.run_dir, self.trials)
        done = finished_trials(self.run_dir) if resume else set()
        outcome = RunOutcome(self.run_dir, skipped=len(done & {t.trial_id for t in self.trials}))
        files = prepare_run_files(self.experiment, self.trials, self.run_dir)
        todo = [t for t in self.trials if t.trial_id not in done]
        progress = tqdm(total=len(todo), unit="trial", desc=self.experiment.name)
        try:
            for count, group in itertools.groupby(todo, key=lambda t: t.devices):
                self._run_count(count, list(group), plan, files, outcome, progress)
        finally:
            progress.close()
            if (self.run_dir / "trials").is_dir():
                combine(self.run_dir)
        make_figures(load(self.run_dir))
        return outcome

    def _run_count(
        self,
        count: int,
        trials: list[Trial],
        plan: pd.DataFrame,
        files: RunFiles,
        outcome: RunOutcome,
        progress: tqdm,
    ) -> None:
        devices = self.experiment.devices
        inventory = self.experiment.inventory
        with make_backend(self.backend_name, self.run_id, self.run_dir, inventory) as backend:
            backend.start(DeviceSpec(count, devices.cpus, devices.memory_mb))
            self._write_environment(backend)
            for rate, group in itertools.groupby(trials, key=lambda t: t.bandwidth_mbit):
                progress.set_postfix_str(f"P={count} shaping {rate:g} Mbit/s")
                link = shape_and_probe(backend, self.profile, rate, self.experiment.link.probe_s)
                self._save_link(link, count)
                for trial in group:
                    progress.set_postfix_str(f"{trial.trial_id}")
                    self._run_one(backend, trial, plan, files, link, outcome)
                    progress.update()

    def _run_one(
        self,
        backend: Backend,
        trial: Trial,
        plan: pd.DataFrame,
        files: RunFiles,
        link: LinkState,
        outcome: RunOutcome,
    ) -> None:
        index = self.trials.index(trial)
        rows = plan[plan["trial_id"] == trial.trial_id].set_index("rank")
        per_rank = {int(rank): row.to_dict() for rank, row in rows.iterrows()}
        base = {
            "run_id": self.run_id, "backend": backend.name, "batch": self.experiment.batch,
            "cpus": self.experiment.devices.cpus, "threads": backend.devices[0].threads,
            "oversubscribed": backend.oversubscribed,
        }  # fmt: skip
        before = {d.rank: _qdisc_sent(backend, d) for d in backend.devices}
        result = run_trial(backend, self.experiment, trial, index, base, per_rank, link, files)
        sent = {d.rank: _qdisc_sent(backend, d) - before[d.rank] for d in backend.devices}
        result.trials["qdisc_sent_bytes"] = result.trials["rank"].map(sent)
        save_trial(self.run_dir, trial.trial_id, result.trials, result.layers)
        combine(self.run_dir)
        if result.ok:
            outcome.ok += 1
        else:
            outcome.failed += 1
            outcome.failures.append(f"{trial.trial_id}: {result.error}")
            log.warning("trial %s failed: %s", trial.trial_id, result.error)

    def _write_environment(self, backend: Backend) -> None:
        plan = backend.cpu_plan
        extra = {
            "qdisc_support": backend.qdisc_support(),
            "cpusets": plan.cpusets if plan else None,
            "oversubscribed": backend.oversubscribed,
            "devices": [d.__dict__ for d in backend.devices],
        }
        write_text(
            self.run_dir / "environment.json",
            json.dumps(environment.collect(backend.name, extra), indent=2, default=str),
        )

    def _save_link(self, link: LinkState, count: int) -> None:
        path = self.run_dir / "links" / f"p{count}-{link.rate_mbit:g}mbit.json"
        write_text(path, json.dumps(link.__dict__, indent=2, default=str))


def _qdisc_sent(backend: Backend, device) -> int:
    text = backend.qdisc_stats(device)
    for line in text.splitlines():
        parts = line.split()
        if parts[:1] == ["Sent"] and len(parts) > 1 and parts[1].isdigit():
            return int(parts[1])
    return 0
