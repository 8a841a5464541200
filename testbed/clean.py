"""`python -m testbed.clean [--run RUN_ID] [--all]`: remove what dead runs left behind.

What a run leaves, each backend of the table finds and removes (`Backend.leftovers`,
`Backend.remove`): containers and networks labelled `testbed.run=<run id>` (docker, when an
engine answers), the network namespaces, veths and bridges of the local backend and of the
serial link, named by the run's tag (`tb-<tag>-*`; local, as root), and on boards (ssh and
enoslib) the qdiscs of their shaped interface and the run's directory, which the run's
`board-leftovers.json` lists (`testbed.backends.ssh.leftovers`; the boards are reached as
the run reached them, host keys checked). Whether the run is over is read from
its lock (testbed.sweep.lock): its orchestrator's pid and that process's start time. Without
`--run`, the qdisc probe's throwaway namespaces (`tbprobe-<pid>-*`) whose process is gone go
too.

- no options: removes the leftovers of runs whose orchestrator is gone (its pid dead or reused,
  or the host rebooted), with their stale locks; keeps, and lists with the reason, runs that
  are alive, locked on another host, or have no lock at all (an older testbed's, or made by
  hand: it cannot be told whether they run).
- `--run ID` (a run id, or the 8-hex tag of its namespaces): that run only, also without a
  lock; a live run is kept.
- `--all`: removes everything, live runs included (with `--run`: that run, even if live).
- `--boards RUN_DIR`: undoes what that run left on its boards, as its `board-leftovers.json`
  says (a run whose stop could not reach a board keeps that file and says so).

Exit status: 0 done, 1 a removal failed, 2 bad usage.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from testbed.backends.base import Backend, Leftovers
from testbed.backends.ssh.leftovers import RECORD as BOARD_RECORD
from testbed.backends.ssh.leftovers import undo as undo_boards
from testbed.backends.table import BACKENDS
from testbed.errors import TestbedError
from testbed.kernel.names import run_tag
from testbed.sweep.lock import Holder, read_locks, remove_lock

log = logging.getLogger(__name__)


@dataclass
class RunLeftovers:
    """One run's leftovers, by the backend that found them, and its lock if any."""

    tag: str
    run_id: str | None = None  # None: known by its namespaces' tag alone
    found: list[tuple[type[Backend], Leftovers]] = field(default_factory=list)
    holder: Holder | None = None

    @property
    def label(self) -> str:
        return f"run {self.run_id} (tag {self.tag})" if self.run_id else f"run tag {self.tag}"


@dataclass
class CleanReport:
    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # "<run>: <why>"


def find_leftovers() -> list[RunLeftovers]:
    """Every run that left something here, with its lock (locks without leftovers too)."""
    locks = read_locks()
    run_dirs = {run_id: Path(h.run_dir) for run_id, h in locks.items() if h.run_dir}
    runs: dict[str, RunLeftovers] = {}

    def entry(tag: str, run_id: str | None) -> RunLeftovers:
        found = runs.setdefault(tag, RunLeftovers(tag))
        found.run_id = found.run_id or run_id
        return found

    for run_id, holder in locks.items():
        entry(run_tag(run_id), run_id).holder = holder
    seen: set[Leftovers] = set()
    for backend in BACKENDS.values():
        for leftovers in backend.leftovers(run_dirs):
            if leftovers not in seen:  # a backend may find what another does (its base's)
                seen.add(leftovers)
                entry(leftovers.tag, leftovers.run_id).found.append((backend, leftovers))
    return sorted(runs.values(), key=lambda run: (run.run_id or "", run.tag))


def why_keep(run: RunLeftovers, chosen: bool, everything: bool) -> str | None:
    """Why a run's leftovers stay, or None when they go. `chosen`: named by `--run`."""
    if everything:
        return None
    holder = run.holder
    if holder is None:
        if chosen:
            return None
        return "no lock (an older testbed's run, or made by hand): --run ID or --all removes it"
    alive = holder.alive()
    if alive:
        return f"its orchestrator is running ({holder.describe()}); stop it, or use --all"
    if alive is None:
        return f"locked by {holder.describe()}, which cannot be checked from here; --all removes it"
    return None


def clean(run_id: str | None = None, everything: bool = False) -> CleanReport:
    """Removes the leftovers of dead runs (or of `run_id`; `everything`: regardless of locks)."""
    report = CleanReport()
    for run in find_leftovers():
        chosen = run_id is not None and run_id in (run.run_id, run.tag, run_tag(run_id))
        if run_id is not None and not chosen:
            continue
        reason = why_keep(run, chosen, everything)
        if reason is not None:
            if run.found:
                report.kept.append(f"{run.label}: {reason}")
            continue
        for backend, leftovers in run.found:  # a removal that fails raises: the lock stays
            report.removed += backend.remove(leftovers)
        if run.holder is not None:
            remove_lock(run.holder)
            report.removed.append(f"lock of run {run.holder.run_id} ({run.holder.describe()})")
    if run_id is None and os.geteuid() == 0:
        from testbed.kernel.support import remove_stale_probes

        report.removed += remove_stale_probes()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m testbed.clean",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--run", help="only this run id (or tag)")
    parser.add_argument("--all", action="store_true", help="also runs that are alive")
    parser.add_argument(
        "--boards",
        metavar="RUN_DIR",
        help="undo what the run in RUN_DIR left on its boards (its board-leftovers.json), "
        "whatever its lock says",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    try:
        if args.boards is not None:
            record = Path(args.boards) / BOARD_RECORD
            if not record.is_file():
                print(f"testbed.clean: {record}: no such record", file=sys.stderr)
                return 1
            report = CleanReport(removed=undo_boards(record))
        else:
            report = clean(args.run, args.all)
    except TestbedError as error:
        print(f"testbed.clean: {error}", file=sys.stderr)
        return 1
    for item in report.removed:
        print(f"removed {item}")
    for item in report.kept:
        print(f"kept {item}")
    print(f"{len(report.removed)} leftovers removed, {len(report.kept)} runs kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
