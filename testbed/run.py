"""`python -m testbed.run EXPERIMENT.yaml`: run an experiment on real devices and links.

    python -m testbed.run experiments/sweep-bandwidth.yaml [--out results] [--backend docker]
    python -m testbed.run experiments/smoke.yaml --dry-run
    python -m testbed.run --resume results/smoke/20261130-101500-ab12

Exit status: 0 every trial ok, 1 some trials failed (all else still written) or an
unexpected error (one line naming the log that holds its traceback), 2 bad input (one line:
file, field, what is wrong; nothing is written), 130 interrupted. `-v` adds debug logging.

Everything is validated before the run directory is made: the file (testbed.experiment.schema), then
the host, backend and files it names (testbed.sweep.preflight), then `--out`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from devices.errors import printable
from testbed import voice
from testbed.backends.table import backend_names
from testbed.errors import ConfigError, TestbedError
from testbed.experiment.names import SLUG_RULE, is_slug
from testbed.source import SOURCE_ROOT
from testbed.sweep import interrupts

if TYPE_CHECKING:
    from testbed.results.facts import PlanRow

log = logging.getLogger(__name__)
EXIT_OK, EXIT_FAILED, EXIT_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
ERROR_LOG = "error.log"  # in the run directory: the traceback of an unexpected error


class OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line (the usage itself is in --help)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_INPUT, f"{self.prog}: {message} (see --help)\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(
        prog="python -m testbed.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("experiment", nargs="?", type=Path, help="experiment YAML file")
    parser.add_argument("--out", type=Path, default=Path("results"), help="results root")
    parser.add_argument(
        "--backend",
        choices=backend_names(),
        help="overrides the experiment's backend",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print and write the trial plan (plan.csv); start nothing",
    )
    parser.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="finish an earlier run: only trials without results are run",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no step lines or progress bar, the answer only"
    )
    args = parser.parse_args(argv)
    if (args.experiment is None) == (args.resume is None):
        parser.error("give an experiment file, or --resume RUN_DIR (not both)")
    return args


def print_plan(plan_rows: list[PlanRow]) -> None:
    print(f"{'trial':44} {'rank':>4} {'payload bits/layer':>18} {'analytic comm ms':>16}")
    for row in plan_rows:
        print(
            f"{row.trial_id:44} {row.rank:>4} {row.payload_bits_per_layer:>18,} "
            f"{row.analytic_comm_ms:>16.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    interrupts.install()
    voice.restart()
    voice.quiet(args.quiet)
    args.run_dir = None  # set once known: an unexpected error's traceback goes there
    try:
        return _run(args)
    except KeyboardInterrupt:
        # what the interrupt cut short may be collected later with a half-closed socket (an
        # asyncio loop of the netlink library, once in CI): logged, not printed as a traceback
        sys.unraisablehook = _logged_unraisable
        print(
            "testbed.run: interrupted; devices and networks removed, finished trials kept",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    except ConfigError as error:
        print(f"testbed.run: {one_line(str(error))}", file=sys.stderr)
        return EXIT_INPUT
    except TestbedError as error:
        if args.verbose:
            traceback.print_exc()
        print(f"testbed.run: {one_line(str(error))}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as error:  # noqa: BLE001 - no traceback reaches a user: it goes to a log
        log_path = _write_traceback(args.run_dir)
        print(
            f"testbed.run: unexpected error ({type(error).__name__}: {one_line(str(error))}); "
            f"the traceback is in {log_path}",
            file=sys.stderr,
        )
        return EXIT_FAILED


def one_line(text: str) -> str:
    """One line, escaped: the text may hold a worker's or a peer's words."""
    return printable(" ".join(text.split()))


def _write_traceback(run_dir: Path | None) -> Path:
    """The current exception's traceback in the run directory's error.log, or a temp file."""
    text = traceback.format_exc()
    if run_dir is not None and run_dir.is_dir():
        path = run_dir / ERROR_LOG
        with path.open("a") as log_file:
            log_file.write(text)
        return path
    handle, name = tempfile.mkstemp(prefix="testbed-run-", suffix=".log")
    with os.fdopen(handle, "w") as log_file:
        log_file.write(text)
    return Path(name)


def check_out(out: Path) -> Path:
    """`--out` resolved; ConfigError unless it is (or can be made) a writable directory."""
    resolved = out.expanduser().resolve()
    existing = resolved
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"--out {out}: {existing} is not a directory; give a directory")
    try:  # os.access says yes to root on a read-only file system: try it (nothing remains)
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise ConfigError(
            f"--out {out}: cannot write in {existing} ({error.strerror}); give a writable directory"
        ) from None
    return resolved


def new_run_dir(out: Path, experiment_name: str, run_id: str) -> Path:
    """`out/<experiment>/<run-id>`, which must lie under `out` (symbolic links resolved)."""
    run_dir = (out / experiment_name / run_id).resolve()
    if not run_dir.is_relative_to(out):
        raise ConfigError(
            f"--out {out}: the run directory would be {run_dir}, outside it (a symbolic "
            f"link at {out / experiment_name}?)"
        )
    return run_dir


def _run(args: argparse.Namespace) -> int:
    from testbed.experiment.schema import load_experiment
    from testbed.sweep.plan import plan_rows, plan_trials
    from testbed.sweep.preflight import check_experiment
    from testbed.sweep.runner import Runner, new_run_id, prepare_run_dir

    if args.resume is not None:
        run_dir = args.resume.resolve()
        if not run_dir.is_dir():
            raise ConfigError(f"--resume {args.resume}: not a run directory")
        if not is_slug(run_dir.name):
            raise ConfigError(f"--resume {args.resume}: a run id is {SLUG_RULE}")
        source = run_dir / "config.yaml"
        experiment = load_experiment(source)
        run_id = run_dir.name
        args.run_dir = run_dir
    else:
        source = args.experiment
        experiment = load_experiment(source)
        out = check_out(args.out)
        run_id = new_run_id()
        run_dir = new_run_dir(out, experiment.name, run_id)
    backend = args.backend or experiment.backend
    checked = check_experiment(experiment, backend, str(source))
    trials = plan_trials(experiment)
    if args.dry_run:
        rows = plan_rows(experiment, trials, checked.host_gflops)  # every trial's arithmetic
        args.run_dir = run_dir
        prepare_run_dir(experiment, run_dir, trials, rows)
        print_plan(rows)
        for count, dilation in checked.dilations.items():
            print(f"P={count}: virtual time, {dilation.describe()}")
        print(f"plan written to {run_dir / 'plan.csv'}")
        return EXIT_OK
    args.run_dir = run_dir
    voice.say(
        f"{experiment.name}: {len(trials)} trials ({_grid(trials)}), {experiment.warmup} warm-up "
        f"+ {experiment.repeats} measured inferences each, {checked.backend.name} backend; into "
        f"{run_dir}"
    )
    outcome = Runner(experiment, run_dir, checked.backend.name, run_id).run(
        resume=args.resume is not None
    )
    _report(outcome, run_dir)
    return EXIT_FAILED if outcome.failed else EXIT_OK


PLURALS = {"medium": "media"}


def _grid(trials) -> str:
    """'5 method variants x 5 rates x 1 device count' (x 'n impairment variants', 'n media'
    and 'n fleet variants' where link.impairments, link.medium and devices.variants sweep
    them)."""
    sizes = [
        (len({(t.method, t.params) for t in trials}), "method variant"),
        (len({t.bandwidth_mbit for t in trials}), "rate"),
    ]
    if any(t.impairment for t in trials):
        media = {t.impairments.get("medium") for t in trials}
        impairments = {json.dumps({**t.impairments, "medium": None}) for t in trials}
        if any(set(t.impairments) - {"medium"} for t in trials):
            sizes.append((len(impairments), "impairment variant"))
        if len(media) > 1:
            sizes.append((len(media), "medium"))
    if any(t.fleet for t in trials):
        sizes.append((len({t.fleet for t in trials}), "fleet variant"))
    sizes.append((len({t.devices for t in trials}), "device count"))
    words = [f"{n} {what if n == 1 else PLURALS.get(what, what + 's')}" for n, what in sizes]
    return " x ".join(words)


def _report(outcome, run_dir: Path) -> None:
    """The answer table, where everything is, and the failures."""
    from testbed.results import fidelity
    from testbed.results.answer import answer_lines
    from testbed.results.store import load

    if (run_dir / "trials.parquet").is_file():
        for line in answer_lines(load(run_dir)) + fidelity.lines(run_dir):
            print(line)
    early = f" ({outcome.ended_early} ended early by a leave)" if outcome.ended_early else ""
    print(
        f"\n{outcome.ok} trials ok{early}, {outcome.failed} failed, {outcome.skipped} already "
        f"done; results in {run_dir}"
    )
    figures = sorted((run_dir / "figures").glob("*.png"))
    if figures:
        print(f"figures in {run_dir / 'figures'}: {', '.join(f.name for f in figures)}")
    notebook = SOURCE_ROOT / "results" / "analysis.ipynb"
    jupyter = Path(sys.executable).parent / "jupyter"
    print(
        f"notebook (tables and figures of this run, written to {run_dir / 'analysis.ipynb'}): "
        f"RUN_DIR={run_dir} {jupyter} execute {notebook} --output={run_dir / 'analysis'}"
    )
    for failure in outcome.failures:
        print(f"  failed: {failure}", file=sys.stderr)


def _logged_unraisable(unraisable: Any) -> None:
    log.debug("after the interrupt, in %r: %r", unraisable.object, unraisable.exc_value)


if __name__ == "__main__":
    sys.exit(main())
