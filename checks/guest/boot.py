"""A batch of commands run in one boot of the guest, each command's exit status and output
returned.

The batch is appended to the cached initramfs as `/batch.sh` (a second cpio archive: no
rebuild), QEMU boots it under TCG (no KVM: a KVM guest hangs at boot on this project's
machines), and the guest's `init` runs each command with its output captured, then writes
`@@exit INDEX STATUS`, its stdout and stderr in base64 and `@@end` to its second serial port,
which QEMU writes to a file; the console (kernel messages, init's own) goes to another, shown
when a boot fails. `tc` and `ip` are the host's (`/sbin/tc`, `/sbin/ip`), never busybox's
applets of the same names. Booting once for many commands is what keeps a batch fast: about
3 s to the first command.

TCG's clock is coarse (a bare veth's ping RTT 0.6-13 ms): what the guest shows is what the
kernel accepts and reports, and what netem draws (counts; delays of several milliseconds),
not sub-millisecond timing.
"""

from __future__ import annotations

import base64
import logging
import shlex
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from checks.errors import GuestError
from checks.guest import cpio
from checks.guest.build import HOST_TOOLS, GuestImage, build
from testbed.kernel.processes import kill_group, start_group

log = logging.getLogger(__name__)

BATCH_TIMEOUT_S = 300.0
MEMORY_MB = 512
CONSOLE_TAIL_LINES = 15


@dataclass(frozen=True)
class Completed:
    """One command of a batch, as it ended in the guest."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def run(
    commands: Sequence[Sequence[str]],
    timeout_s: float = BATCH_TIMEOUT_S,
    image: GuestImage | None = None,
) -> list[Completed]:
    """Boots the guest once (building its image first where it is missing), runs `commands`
    in order (argument lists; a failing one does not stop the next) and returns how each
    ended. Raises GuestError when the guest does not boot or a batch outlasts `timeout_s`."""
    image = image or build()
    with tempfile.TemporaryDirectory(prefix="netem-guest-") as scratch:
        work = Path(scratch)
        initrd, console, results = work / "initrd", work / "console", work / "results"
        initrd.write_bytes(image.initramfs.read_bytes() + batch_archive(commands))
        began = time.monotonic()
        _boot(image, initrd, console, results, timeout_s)
        log.info("guest: %d commands in %.1f s", len(commands), time.monotonic() - began)
        text = results.read_text(errors="replace") if results.exists() else ""
        try:
            return parse_results(text, commands)
        except GuestError as error:
            raise GuestError(f"{error}\n{_console_tail(console)}") from None


def batch_archive(commands: Sequence[Sequence[str]]) -> bytes:
    """The commands as `/batch.sh`, a cpio archive to lay over the image."""
    lines = []
    for index, argv in enumerate(commands):
        if not argv:
            raise GuestError(f"guest batch: command {index} is empty")
        program = f"/sbin/{argv[0]}" if argv[0] in HOST_TOOLS else argv[0]
        words = shlex.join([program, *argv[1:]])
        lines.append(f"{words} </dev/null >/tmp/out 2>/tmp/err\nreport {index} $?")
    script = "\n".join(lines) + "\n"
    return cpio.archive([cpio.regular("batch.sh", script.encode())])


def parse_results(text: str, commands: Sequence[Sequence[str]]) -> list[Completed]:
    """Each command's result from what the guest wrote to its results port."""
    lines = [line.rstrip("\r") for line in text.splitlines()]
    if not any(line.startswith("@@ready") for line in lines):
        failed = [line.removeprefix("@@failed ") for line in lines if line.startswith("@@failed")]
        why = f"setting up failed: {failed[0]}" if failed else "it never came up"
        raise GuestError(f"netem guest: {why}")
    completed: list[Completed] = []
    position = 0
    while position < len(lines):
        line = lines[position]
        position += 1
        if not line.startswith("@@exit "):
            continue
        _, index, status = line.split()
        stdout, position = _block(lines, position, "@@stderr")
        stderr, position = _block(lines, position, "@@end")
        argv = tuple(commands[int(index)])
        completed.append(Completed(argv, int(status), stdout, stderr))
    if len(completed) < len(commands) or "@@done" not in lines:
        stuck = shlex.join(commands[len(completed)]) if len(completed) < len(commands) else ""
        raise GuestError(
            f"netem guest: the batch ended after {len(completed)} of {len(commands)} commands"
            + (f" (in `{stuck}`)" if stuck else "")
        )
    return completed


def _block(lines: list[str], position: int, end: str) -> tuple[str, int]:
    """The base64 lines from `position` up to `end`, decoded; and the line after `end`."""
    encoded = []
    while position < len(lines) and lines[position] != end:
        encoded.append(lines[position])
        position += 1
    return base64.b64decode("".join(encoded)).decode(errors="replace"), position + 1


def _boot(image: GuestImage, initrd: Path, console: Path, results: Path, timeout_s: float) -> None:
    argv = [
        "qemu-system-x86_64",
        *("-accel", "tcg", "-cpu", "max", "-smp", "1", "-m", str(MEMORY_MB)),
        *("-nodefaults", "-display", "none", "-no-reboot"),
        *("-serial", f"file:{console}", "-serial", f"file:{results}"),
        *("-kernel", str(image.kernel), "-initrd", str(initrd)),
        *("-append", "console=ttyS0 panic=-1 quiet loglevel=3"),
    ]
    try:
        process = start_group(argv, "netem guest", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as error:
        raise GuestError(f"netem guest: cannot start qemu-system-x86_64 ({error})") from None
    try:
        _, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(process.pid, "netem guest")
        process.wait()
        raise GuestError(
            f"netem guest: the batch outlasted {timeout_s:g} s\n{_console_tail(console)}"
        ) from None
    finally:
        if process.poll() is None:  # interrupted: no QEMU left behind
            kill_group(process.pid, "netem guest")
            process.wait()
    if process.returncode != 0:
        raise GuestError(
            f"netem guest: qemu-system-x86_64 exited {process.returncode}: "
            f"{stderr.decode(errors='replace').strip()[-500:]}"
        )


def _console_tail(console: Path) -> str:
    text = console.read_text(errors="replace") if console.exists() else ""
    tail = [line.rstrip("\r") for line in text.splitlines()][-CONSOLE_TAIL_LINES:]
    return "guest console:\n" + "\n".join(tail) if tail else "guest console: (empty)"
