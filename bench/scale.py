"""The orchestration at P = 2, 4, 8 and 10 devices, on the local backend and on the enoslib
backend's static provider (SSH boards in network namespaces, `checks.boards`), and
on any other backend named with `--backends` (docker).

Run as root from the repository root: `python -m bench.scale` (about 5 minutes; `--counts`,
`--backends`). Each (backend, P) is one `testbed.run` of vit-tiny, one Trace-b trial at
5 Mbit/s, two inferences, from which it reads what the run recorded:

- start: starting the P devices (`environment.json`, by_devices.P.start_s): the local
  backend's namespaces and processes; for enoslib, the provider's hosts, the SSH connection,
  the checks, the code and the run's files copied, the clock offsets, every board at once;
- shape: setting every device's rate (`links/*.json`, shape_s);
- probe: probing every shaped direction, one transfer after another (probe_s, with the count
  of transfers: P for uplinks alone);
- set-up: one session's set-up: the session's wall time (the rows' session_s, from spawning
  the workers to collecting their records) less its longest inference loop
  (`sessions/*/rank*/session.json`, timing_s inferences_s): starting the interpreters, the
  imports, the model and codebooks, the mesh of connections and handshakes, the collection;
- session: the whole session, set-up and inferences (the rows' session_s).

Two cores run every device here: P devices of one CPU each are oversubscribed beyond P = 2
(recorded as such), and the set-up's imports compete for the cores; the times say how the
orchestration grows with P, not what P boards of their own would take.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from checks.boards import ssh_lab
from testbed.source import SOURCE_ROOT

RATE_MBIT = 5.0


def experiment(count: int, backend: str, provider: dict[str, Any] | None) -> dict[str, Any]:
    data = {
        "name": f"scale-{backend}-p{count}",
        "model": {"name": "vit-tiny"},
        "devices": {"count": [count], "cpus": 1, "memory_mb": 512},
        "backend": backend,
        "link": {"profile": "ideal", "bandwidth_mbit": [RATE_MBIT], "probe_s": 0.25},
        "methods": [{"name": "trace-b", "K": 16}],
        "bundle": {"calibration_inputs": 4},
        "repeats": 2,
        "warmup": 0,
        "timeout_s": 300,
    }
    if provider is not None:
        data["provider"] = provider
    return data


def measured(run_dir: Path, count: int) -> dict[str, float]:
    environment = json.loads((run_dir / "environment.json").read_text())
    (link,) = [json.loads(p.read_text()) for p in (run_dir / "links").glob("*.json")]
    inferences = [
        json.loads(path.read_text())["timing_s"].get("inferences_s", 0.0)
        for path in (run_dir / "sessions").glob("*/rank*/session.json")
    ]
    import pandas as pd

    trials = pd.read_parquet(run_dir / "trials.parquet")
    session_s = float(trials["session_s"].max())
    return {
        "start_s": environment["by_devices"][str(count)]["start_s"],
        "shape_s": link["shape_s"],
        "probe_s": link["probe_s"],
        "transfers": len(link["transfers"]),
        "setup_s": session_s - max(inferences),
        "session_s": session_s,
        "oversubscribed": bool(trials["oversubscribed"].any()),
    }


def run(data: dict[str, Any], directory: Path) -> Path:
    path = directory / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    out = directory / "out"
    done = subprocess.run(
        [sys.executable, "-m", "testbed.run", str(path), "--out", str(out), "-q"],
        cwd=SOURCE_ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{data['name']}: {done.stderr[-2000:]}")
    (run_dir,) = (out / data["name"]).glob("*")
    return run_dir


@contextlib.contextmanager
def static_provider(directory: Path, boards: int) -> Iterator[dict[str, Any]]:
    """The static provider's section over `boards` SSH boards in namespaces."""
    (directory / "lab").mkdir()
    with ssh_lab(directory / "lab", boards) as lab:
        machines = [
            {"roles": ["devices"], "address": address, "alias": f"b{rank}", "user": "root"}
            for rank, address in enumerate(lab.addresses)
        ]
        network = {"roles": ["lan"], "cidr": "10.0.0.0/8", "gateway": "10.0.0.1", "dns": "10.0.0.1"}
        yield {
            "kind": "static",
            "known_hosts": str(lab.known_hosts),
            "boards": {
                "key_file": str(lab.user_key),
                "python": sys.executable,
                "workdir": str(lab.directory / "board-{name}"),
            },
            "conf": {"resources": {"machines": machines, "networks": [network]}},
        }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    parser.add_argument("--counts", type=int, nargs="+", default=[2, 4, 8, 10])
    parser.add_argument("--backends", nargs="+", default=["local", "enoslib"])
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as temporary:
        directory = Path(temporary)
        for backend in args.backends:
            with (
                static_provider(directory, max(args.counts))
                if backend == "enoslib"
                else contextlib.nullcontext()
            ) as provider:
                for count in args.counts:
                    run_dir = run(experiment(count, backend, provider), directory)
                    row = {"backend": backend, "P": count, **measured(run_dir, count)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    print(
        "\n| backend | P | start s | shape s | probe s (transfers) | session set-up s | session s |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['backend']} | {row['P']} | {row['start_s']:.2f} | {row['shape_s']:.3f} | "
            f"{row['probe_s']:.2f} ({row['transfers']}) | {row['setup_s']:.2f} | "
            f"{row['session_s']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
