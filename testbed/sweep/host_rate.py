"""This host's core rate: what `speed: 1` means in GFLOP/s, measured once per model and cached.

The GEMM probe (`python -m devices.gemm`: a block's four products on N/2 rows, one thread)
runs pinned to the host's last core for two seconds. The result is cached in
`.cache/host-gemm.json` by CPU model and model, and saved with every run that uses it
(environment.json), so a run's conversion from a device's GFLOP/s to its speed can be
checked later. `TESTBED_HOST_GFLOPS` overrides it (a test, or a host whose rate is known).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from testbed import voice
from testbed.atomic import write_atomically
from testbed.errors import DeviceError
from testbed.source import CACHE_DIR, SOURCE_ROOT, python_env

log = logging.getLogger(__name__)

CACHE_FILE = CACHE_DIR / "host-gemm.json"
PROBE_SECONDS = 2.0
OVERRIDE = "TESTBED_HOST_GFLOPS"


@functools.cache
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def host_core_gflops(model: str, cache: Path = CACHE_FILE) -> float:
    """One host core's GFLOP/s on `model`'s products (cached; measured the first time)."""
    if os.environ.get(OVERRIDE):
        return float(os.environ[OVERRIDE])
    key = f"{cpu_model()} | {model}"
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    if key in known:
        return float(known[key]["gflops"])
    with voice.phase("host rate", f"measuring one core's GEMM rate on {model} (once)") as step:
        found = measure(model)
        step.outcome = f"{found['gflops']:.1f} GFLOP/s"
    known[key] = found
    cache.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(known, indent=1)
    write_atomically(cache, lambda path: path.write_text(text))
    return float(found["gflops"])


def measure(model: str, threads: int = 1) -> dict[str, object]:
    """The probe's JSON line, run on the last core this process may use."""
    core = max(os.sched_getaffinity(0))
    argv = [sys.executable, "-m", "devices.gemm", "--model", model, "--threads", str(threads)]
    argv += ["--seconds", str(PROBE_SECONDS)]
    log.debug("taskset %d: %s", core, argv)
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=SOURCE_ROOT,
            env=python_env(OMP_NUM_THREADS=str(threads)),
            preexec_fn=lambda: os.sched_setaffinity(0, {core}),
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise DeviceError(f"host rate: the GEMM probe did not run: {error}") from None
    if done.returncode != 0:
        raise DeviceError(f"host rate: {done.stderr.strip() or 'the GEMM probe failed'}")
    return json.loads(done.stdout)
