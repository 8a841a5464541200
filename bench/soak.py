"""A soak: many inferences through the serial emulator on the docker backend, watching what
the workers and the emulator hold. Nothing may grow with the count.

Run as root from the repository root: `python -m bench.soak` (10,000 inferences of vit-tiny,
P = 2, Trace-b K = 16 at 20 Mbit/s: about 2 minutes; `--inferences`, `--rate`, `--method`).
It runs `python -m testbed.run` on a generated experiment and, every `--every-s` seconds,
reads from /proc the resident memory (VmRSS) and the open file descriptors of each
device's worker (found by `docker top` in the run's containers) and of the serial link
program (found by its ports' names, which carry the run's tag). Printed: each process's
first and last sample and the change, the growth per 1,000 inferences, the stalls the
emulator counted (the rows' `link_stalled_ms`), and the run's exit status.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def experiment(args: argparse.Namespace) -> dict:
    method = {"name": args.method}
    if args.method != "voltage":
        method["K"] = 16
    return {
        "name": "soak",
        "model": {"name": "vit-tiny"},
        "devices": {"count": [2], "cpus": 1, "memory_mb": 1024},
        "link": {"profile": "ideal", "emulator": "serial", "bandwidth_mbit": [args.rate]},
        "methods": [method],
        "bundle": {"calibration_inputs": 4},
        "repeats": args.inferences,
        "warmup": 1,
        "timeout_s": 3600,
    }


def proc_facts(pid: int) -> tuple[int, int] | None:
    """(VmRSS in kB, open file descriptors) of a process, or None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except OSError:
        return None
    rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    return rss, fds


def workers(client, run_id: str) -> dict[str, int]:
    """Each device's worker pid (the host's), by container name."""
    found = {}
    import docker

    for container in client.containers.list(filters={"label": f"testbed.run={run_id}"}):
        try:
            top = container.top()
        except docker.errors.APIError:  # stopping: the run is ending
            continue
        titles = top.get("Titles") or []
        column = titles.index("PID") if "PID" in titles else 1
        for row in top.get("Processes") or []:
            if "devices.worker" in " ".join(row):
                found[container.name] = int(row[column])
    return found


def emulator(run_id: str) -> int | None:
    from testbed.kernel.names import run_tag

    tag = run_tag(run_id)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                text = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "testbed.link.serial.program" in text and f"{tag}s0=" in text:
                return int(entry.name)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    parser.add_argument("--inferences", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=20.0, help="Mbit/s")
    parser.add_argument("--method", default="trace-b", choices=["trace-b", "astra", "voltage"])
    parser.add_argument("--every-s", type=float, default=0.5)
    args = parser.parse_args(argv)

    import docker

    from testbed.results.store import load

    client = docker.from_env()
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    path = work / "soak.yaml"
    path.write_text(yaml.safe_dump(experiment(args)))
    out = work / "out"
    command = [sys.executable, "-m", "testbed.run", str(path), "--out", str(out), "-q"]
    run = subprocess.Popen(command + ["--backend", "docker"], cwd=ROOT, text=True)
    samples: dict[str, list[tuple[float, int, int]]] = {}
    began = time.monotonic()
    while run.poll() is None:
        time.sleep(args.every_s)
        runs = [p for p in out.glob("soak/*") if p.is_dir()]
        if not runs:
            continue
        pids = workers(client, runs[0].name)
        switch = emulator(runs[0].name)
        if switch is not None:
            pids["serial link"] = switch
        for name, pid in pids.items():
            facts = proc_facts(pid)
            if facts is not None:
                samples.setdefault(name, []).append((time.monotonic() - began, *facts))
    wall_s = time.monotonic() - began
    print(f"\nexit {run.returncode} after {wall_s:.0f} s, {args.inferences} inferences")
    print(f"{'process':34} {'first RSS MB':>12} {'last':>8} {'change':>8} {'fds':>9}")
    for name, taken in samples.items():
        # the first tenth of the samples is start-up (torch's import, the warm-up)
        first, last = taken[len(taken) // 10], taken[-1]
        change = (last[1] - first[1]) / 1024
        print(
            f"{name:34} {first[1] / 1024:12.1f} {last[1] / 1024:8.1f} {change:+8.1f} "
            f"{first[2]:>4}->{last[2]:<4} ({len(taken)} samples, {first[0]:.0f}-{last[0]:.0f} s)"
        )
    runs = [p for p in out.glob("soak/*") if p.is_dir()]
    if runs and (runs[0] / "trials.parquet").is_file():
        trials = load(runs[0]).trials
        ok = trials[trials.status == "ok"]
        if len(ok):
            held = ok["link_stalled_ms"].fillna(0.0)
            print(
                f"rows ok {len(ok)}; effective ms median {statistics.median(ok.effective_ms):.2f};"
                f" inferences held up by a stall {int((held > 0).sum())}, {held.sum():.1f} ms"
            )
    print(f"run directory: {runs[0] if runs else out}")
    return run.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
