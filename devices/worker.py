"""`python -m devices.worker SPEC`: one device of a P-device sequence-parallel session.

    python -m devices.worker spec.json [-v]

The spec (devices.spec.RunSpec, a JSON or YAML file) says everything: rank, peers, model,
the runs (method variants, each a trial) and their inference counts, inputs, output folder.
The device loads the model, each run's bundle (once per file) and method, connects to every
peer (handshake: fingerprints, partition, runs, clocks), runs the warm-ups and the measured
inferences and writes its records (devices.records) to the spec's `out`. On any error it
prints one line `worker R: message` to stderr and exits 1 (-v adds the traceback and debug
logging), closing its sockets so that its peers fail promptly too.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from devices.errors import SpecError, WorkerError, printable
from devices.spec import RunSpec, load_spec, read_spec_file

log = logging.getLogger("devices.worker")

# The sender and receiver threads need the GIL to hand a message to or from the kernel; with
# Python's default 5 ms switch interval a message could wait that long behind the compute
# thread's Python code, which would show up as comm and wait time that the link never caused.
SWITCH_INTERVAL_S = 2e-4


class Terminated(WorkerError):
    """SIGTERM (docker stop, the orchestrator): unwind so that sockets close and
    session.json records the failure."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated("terminated by SIGTERM")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m devices.worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("spec", type=Path, help="run spec (JSON or YAML, devices.spec.RunSpec)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, tracebacks")
    return parser.parse_args(argv)


def load_model(spec: RunSpec) -> Any:
    """The named architecture, with the checkpoint's weights if one is given (else the
    weights initialised from the spec's model seed)."""
    import tracevq

    model = tracevq.build_model(spec.model, seed=spec.model_seed)
    if spec.checkpoint is not None:
        tracevq.load_checkpoint(model, spec.checkpoint)
    return model.eval()


def load_methods(spec: RunSpec, model: Any) -> dict[str, tuple[Any, Any]]:
    """Each run's method bound to the model, with its bundle (None when not given); a bundle
    file shared by several runs is loaded once."""
    from tracevq.bundle import Bundle, model_fingerprint
    from tracevq.methods import make_method

    bundles: dict[Path, Any] = {}
    methods = {}
    fingerprint = model_fingerprint(model) if any(r.bundle for r in spec.runs) else ""
    for run in spec.runs:
        bundle = None
        if run.bundle is not None:
            if run.bundle not in bundles:
                bundles[run.bundle] = Bundle.load(run.bundle)
            bundle = bundles[run.bundle]
            if bundle.model_fingerprint != fingerprint:
                raise SpecError(
                    f"run {run.id!r}: bundle {run.bundle} was fitted for a model with "
                    f"fingerprint {bundle.model_fingerprint}, this model has {fingerprint}"
                )
        methods[run.id] = (make_method(run.method, model, bundle, **run.params), bundle)
    return methods


def run_device(spec: RunSpec) -> None:
    """The whole session of one device; records go to spec.out."""
    import torch

    from devices.device import Device

    torch.set_num_threads(spec.threads)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    began = time.perf_counter()
    model = load_model(spec)
    device = Device(spec, model, load_methods(spec, model))
    device.timing_s["load_s"] = time.perf_counter() - began
    device.timing_s["switch_interval_s"] = sys.getswitchinterval()
    device.run()


def one_line(error: BaseException) -> str:
    from tracevq.errors import TraceError

    text = (
        str(error)
        if isinstance(error, WorkerError | TraceError)
        else (f"{type(error).__name__}: {error}")
    )
    return printable(" ".join(text.split()))


def _rank_of(path: Path) -> object:
    """The spec file's rank for error lines, before the spec is validated ("?" if none)."""
    try:
        rank = read_spec_file(path).get("rank", "?")
    except SpecError:
        return "?"
    return rank if isinstance(rank, int) else "?"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    rank = _rank_of(args.spec)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        spec = load_spec(args.spec)
        rank = spec.rank
        log.debug("worker %s on %s, python %s", rank, platform.node(), platform.python_version())
        run_device(spec)
    except KeyboardInterrupt:
        print(f"worker {rank}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - the CLI boundary: one line, non-zero exit
        if args.verbose:
            traceback.print_exc()
        print(f"worker {rank}: {one_line(error)}", file=sys.stderr)
        return 143 if isinstance(error, Terminated) else 1
    return 0


def exit_now(status: int) -> None:
    """Leave without the interpreter's teardown: every file is written (atomically) and
    every socket closed by then, and tearing torch down takes 0.3-0.5 s of CPU, seconds on a
    loaded host, during which the peers and the orchestrator would wait for the exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_now(main())
