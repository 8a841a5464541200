"""`python -m testbed.run EXPERIMENT.yaml`: run an experiment on real devices and links.

    python -m testbed.run experiments/sweep-bandwidth.yaml [--out results] [--backend docker]
    python -m testbed.run experiments/smoke.yaml --dry-run
    python -m testbed.run --resume results/smoke/20261130-101500-ab12

Exit status: 0 every trial ok, 1 some trials failed (all else still written), 2 bad input,
130 interrupted. Errors print one line (`-v` adds details and debug logging).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import traceback
from pathlib import Path

from testbed import voice
from testbed.errors import ConfigError, TestbedError

EXIT_OK, EXIT_FAILED, EXIT_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m testbed.run", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("experiment", nargs="?", type=Path, help="experiment YAML file")
    parser.add_argument("--out", type=Path, default=Path("results"), help="results root")
    parser.add_argument(
        "--backend",
        choices=("auto", "docker", "local", "ssh"),
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


_MAIN_PID = os.getpid()


def _raise_interrupt(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so the backend removes what it made. Only in this
    process: a child forked by a library (pyroute2 enters namespaces that way) inherits the
    handler and must simply die, not run our clean-up on its copy of the stack."""
    if os.getpid() != _MAIN_PID:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise KeyboardInterrupt


def print_plan(plan_rows: list[dict]) -> None:
    print(f"{'trial':44} {'rank':>4} {'payload bits/layer':>18} {'analytic comm ms':>16}")
    for row in plan_rows:
        print(
            f"{row['trial_id']:44} {row['rank']:>4} {row['payload_bits_per_layer']:>18,} "
            f"{row['analytic_comm_ms']:>16.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    signal.signal(signal.SIGTERM, _raise_interrupt)
    voice.restart()
    voice.quiet(args.quiet)
    try:
        return _run(args)
    except KeyboardInterrupt:
        print(
            "testbed.run: interrupted; devices and networks removed, finished trials kept",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    except ConfigError as error:
        print(f"testbed.run: {error}", file=sys.stderr)
        return EXIT_INPUT
    except TestbedError as error:
        if args.verbose:
            traceback.print_exc()
        print(f"testbed.run: {error}", file=sys.stderr)
        return EXIT_FAILED


def _run(args: argparse.Namespace) -> int:
    from testbed.link import emulator_for
    from testbed.plan import plan_rows, plan_trials
    from testbed.runner import Runner, new_run_id, prepare_run_dir
    from testbed.schema import load_experiment

    if args.resume is not None:
        run_dir = args.resume.resolve()
        experiment = load_experiment(run_dir / "config.yaml")
        run_id = run_dir.name
    else:
        experiment = load_experiment(args.experiment)
        run_id = new_run_id()
        run_dir = (args.out / experiment.name / run_id).resolve()
    backend = args.backend or experiment.backend
    emulator_for(experiment.link.emulator, backend)  # refuses serial on ssh boards
    trials = plan_trials(experiment)
    if args.dry_run:
        prepare_run_dir(experiment, run_dir, trials)
        print_plan(plan_rows(experiment, trials))
        print(f"plan written to {run_dir / 'plan.csv'}")
        return EXIT_OK
    voice.say(
        f"{experiment.name}: {len(trials)} trials ({_grid(trials)}), {experiment.warmup} warm-up "
        f"+ {experiment.repeats} measured inferences each, {backend} backend; into {run_dir}"
    )
    outcome = Runner(experiment, run_dir, backend, run_id).run(resume=args.resume is not None)
    _report(outcome, run_dir)
    return EXIT_FAILED if outcome.failed else EXIT_OK


def _grid(trials) -> str:
    """'5 method variants x 5 rates x 1 device count'."""
    sizes = [
        (len({(t.method, t.params) for t in trials}), "method variant"),
        (len({t.bandwidth_mbit for t in trials}), "rate"),
        (len({t.devices for t in trials}), "device count"),
    ]
    return " x ".join(f"{n} {what}{'s' if n != 1 else ''}" for n, what in sizes)


def _report(outcome, run_dir: Path) -> None:
    """The answer table, where everything is, and the failures."""
    from testbed.answer import answer_lines
    from testbed.results import load

    if (run_dir / "trials.parquet").is_file():
        for line in answer_lines(load(run_dir)):
            print(line)
    print(
        f"\n{outcome.ok} trials ok, {outcome.failed} failed, {outcome.skipped} already done; "
        f"results in {run_dir}"
    )
    figures = sorted((run_dir / "figures").glob("*.png"))
    if figures:
        print(f"figures in {run_dir / 'figures'}: {', '.join(f.name for f in figures)}")
    notebook = Path(__file__).resolve().parents[1] / "results" / "analysis.ipynb"
    jupyter = Path(sys.executable).parent / "jupyter"
    print(
        f"notebook (tables and figures of this run, written to {run_dir / 'analysis.ipynb'}): "
        f"RUN_DIR={run_dir} {jupyter} execute {notebook} --output={run_dir / 'analysis'}"
    )
    for failure in outcome.failures:
        print(f"  failed: {failure}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
