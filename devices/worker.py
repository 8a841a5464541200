"""`python -m devices.worker`: one device of a P-device sequence-parallel session.

    python -m devices.worker [SPEC.yaml] --rank R --peers h0:p0,h1:p1,... --model vit-tiny \
        --bundle bundle.pt --method trace-b --param K=16 --batch 2 --warmup 1 \
        --inferences 10 --threads 1 --out results/dev0

Flags override the spec file's keys (see devices.spec.RunSpec). The device loads the model,
the bundle and the method, connects to every peer (handshake: fingerprints, partition,
method), runs the warm-ups and the measured inferences and writes its records
(devices.records) to --out. On any error it prints one line `worker R: message` to stderr
and exits 1 (-v adds the traceback and debug logging), closing its sockets so that its peers
fail promptly too.
"""

from __future__ import annotations

import argparse
import logging
import platform
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from devices.errors import SpecError, WorkerError
from devices.spec import RunSpec, resolve_spec

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
    parser.add_argument("spec", nargs="?", type=Path, help="run spec (YAML or JSON)")
    add = parser.add_argument
    add("--rank", type=int)
    add("--peers", help="host:port of every device in rank order, own listen address included")
    add("--model", help="model configuration name (tracevq.config)")
    add("--checkpoint", type=Path, help="timm-format weights for --model (.pth, .safetensors)")
    add("--model-seed", type=int, help="seed of the model's initial weights (default 0)")
    add("--bundle", type=Path, help="codebook bundle (astra, trace-b, trace-nb)")
    add("--method")
    add(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="method parameter, repeatable (K=1024, level_k=auto, buffers=false ...)",
    )
    add("--batch", type=int)
    add("--warmup", type=int, help="unrecorded inferences first")
    add("--inferences", type=int, help="measured inferences")
    add("--threads", type=int, help="torch intra-op threads (the device's CPUs)")
    add("--input-seed", type=int, help="seed of the generated inputs")
    add("--inputs", type=Path, help=".pt file: a tensor or {'inputs', 'labels'}")
    add("--out", type=Path, help="directory for the records")
    add("--connect-timeout-s", type=float, help="deadline of the mesh set-up")
    add("--recv-timeout-s", type=float, help="longest wait for a peer's message")
    add("--rate-mbit", type=float, help="link rate (10^6 bit/s) for level_k=auto")
    add("-v", "--verbose", action="store_true", help="debug logging and tracebacks")
    return parser.parse_args(argv)


def spec_from_args(args: argparse.Namespace) -> RunSpec:
    keys = (
        "rank",
        "peers",
        "model",
        "checkpoint",
        "model_seed",
        "bundle",
        "method",
        "batch",
        "warmup",
        "inferences",
        "threads",
        "input_seed",
        "inputs",
        "out",
        "connect_timeout_s",
        "recv_timeout_s",
        "rate_mbit",
    )
    return resolve_spec(args.spec, {key: getattr(args, key) for key in keys}, args.param)


def load_model(spec: RunSpec) -> Any:
    """The named architecture, with the checkpoint's weights if one is given (else the
    weights initialised from --model-seed)."""
    import tracevq

    model = tracevq.build_model(spec.model, seed=spec.model_seed)
    if spec.checkpoint is not None:
        tracevq.load_checkpoint(model, spec.checkpoint)
    return model.eval()


def load_method(spec: RunSpec, model: Any) -> tuple[Any, Any]:
    """The method bound to the model, and the bundle (None when not given)."""
    from tracevq.bundle import Bundle, model_fingerprint
    from tracevq.methods import make_method

    bundle = Bundle.load(spec.bundle) if spec.bundle is not None else None
    if bundle is not None and bundle.model_fingerprint != model_fingerprint(model):
        raise SpecError(
            f"bundle {spec.bundle} was fitted for a model with fingerprint "
            f"{bundle.model_fingerprint}, this model has {model_fingerprint(model)}"
        )
    return make_method(spec.method, model, bundle, **spec.params), bundle


def run_device(spec: RunSpec) -> None:
    """The whole session of one device; records go to spec.out."""
    import torch

    from devices.device import Device

    torch.set_num_threads(spec.threads)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    began = time.perf_counter()
    model = load_model(spec)
    method, bundle = load_method(spec, model)
    device = Device(spec, method, bundle)
    device.facts["load_s"] = time.perf_counter() - began
    device.facts["switch_interval_s"] = sys.getswitchinterval()
    device.run()


def one_line(error: BaseException) -> str:
    from tracevq.errors import TraceError

    text = (
        str(error)
        if isinstance(error, WorkerError | TraceError)
        else (f"{type(error).__name__}: {error}")
    )
    return " ".join(text.split())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    rank = "?" if args.rank is None else args.rank
    signal.signal(signal.SIGTERM, _terminate)
    try:
        spec = spec_from_args(args)
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


if __name__ == "__main__":
    sys.exit(main())
