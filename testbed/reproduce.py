"""`python -m testbed.reproduce [--quick]`: run the paper's latency study and write REPORT.md.

Runs `experiments/reproduce/latency.yaml` (Table IV, Fig. 6; Table II and Figs. 7-8 follow
from the payload arithmetic) and `experiments/reproduce/buffers.yaml` (Table V), then
`testbed.report` into `results/reproduce/REPORT.md`, with a section on delayed and lossy
links from `experiments/sweep-delay.yaml` and `sweep-loss.yaml` (not in the paper). About an
hour and a quarter on a 2-core host. `--quick`
runs the same pipeline on tiny stand-in models (vit-tiny, vivit-tiny) in a few minutes: the
tables are filled, the numbers are not the paper's scale (CI runs this).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from testbed.backends.table import AUTO, BACKENDS, backend_names
from testbed.errors import ConfigError, TestbedError
from testbed.experiment.schema import load_experiment
from testbed.report import build
from testbed.results.store import write_text
from testbed.source import EXPERIMENTS_DIR
from testbed.sweep.runner import Runner, new_run_id

EXPERIMENTS = EXPERIMENTS_DIR / "reproduce"


def run(name: str, out: Path, backend: str, directory: Path = EXPERIMENTS) -> tuple[Path, int]:
    experiment = load_experiment(directory / f"{name}.yaml")
    run_id = new_run_id()
    run_dir = (out / experiment.name / run_id).resolve()
    outcome = Runner(experiment, run_dir, backend, run_id).run()
    print(f"{experiment.name}: {outcome.ok} trials ok, {outcome.failed} failed -> {run_dir}")
    return run_dir, outcome.failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m testbed.reproduce",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="tiny models, for CI")
    parser.add_argument("--out", type=Path, default=Path("results"))
    on_this_host = [n for n in backend_names() if n == AUTO or BACKENDS[n].on_this_host]
    parser.add_argument("--backend", choices=on_this_host, default=AUTO)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    prefix = "quick-" if args.quick else ""
    try:
        latency, failed_latency = run(f"{prefix}latency", args.out, args.backend)
        buffers, failed_buffers = run(f"{prefix}buffers", args.out, args.backend)
        delay = loss = None
        failed_links = 0
        if not args.quick:  # not the paper's: delayed and lossy links
            delay, failed_delay = run("sweep-delay", args.out, args.backend, EXPERIMENTS_DIR)
            loss, failed_loss = run("sweep-loss", args.out, args.backend, EXPERIMENTS_DIR)
            failed_links = failed_delay + failed_loss
        report = args.out / "reproduce" / "REPORT.md"
        write_text(report, build(latency, buffers, delay, loss))
    except ConfigError as error:
        print(f"testbed.reproduce: {error}", file=sys.stderr)
        return 2
    except TestbedError as error:
        print(f"testbed.reproduce: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("testbed.reproduce: interrupted", file=sys.stderr)
        return 130
    print(f"wrote {report}")
    return 1 if failed_latency or failed_buffers or failed_links else 0


if __name__ == "__main__":
    sys.exit(main())
