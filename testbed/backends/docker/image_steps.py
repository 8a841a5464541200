"""What the pieces of the worker image build share: the project root, build steps (argument
lists; a failing step raises ImageError with its name and the tail of its output), the docker
CLI's view of local images, replacing the image a tag points to, and the short keys that tell
whether a cached piece is current.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shlex
import subprocess
from collections import deque
from collections.abc import Sequence
from textwrap import shorten

from testbed import voice
from testbed.errors import ImageError

log = logging.getLogger(__name__)

OUTPUT_TAIL_LINES = 40
# the line that starts a Dockerfile step: the classic builder's `Step 3/9 : RUN ...`,
# BuildKit's `#7 [deps 2/4] RUN ...`
BUILD_STEP = re.compile(r"^(Step \d+/\d+ : |#\d+ \[[^\]]*\d+/\d+\] )")


def cache_key(*parts: object) -> str:
    """A short key of what a cached piece is made from: new parts give a new key."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:12]


def run_step(
    step: str, args: Sequence[str], *, capture: bool = False, say_steps: bool = False
) -> str:
    """Runs one command; raises ImageError naming `step` with the output's tail on failure.

    With `capture`, stdout is returned and stderr kept apart; otherwise both are merged,
    logged line by line at DEBUG (long steps such as debootstrap stay visible with -v).
    `say_steps`: a `docker build`'s lines that start a Dockerfile step are said as they come.
    """
    log.debug("%s: %s", step, shlex.join(args))
    if capture:
        proc = subprocess.run(args, capture_output=True, text=True, errors="replace")
        if proc.returncode != 0:
            raise _step_error(step, args, proc.returncode, proc.stderr.splitlines())
        return proc.stdout
    tail: deque[str] = deque(maxlen=OUTPUT_TAIL_LINES)
    with subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.debug("  %s", line.rstrip())
            tail.append(line.rstrip())
            if say_steps and BUILD_STEP.match(line):
                voice.say("  " + shorten(line.strip(), 100))
    if proc.returncode != 0:
        raise _step_error(step, args, proc.returncode, list(tail))
    return ""


def _step_error(step: str, args: Sequence[str], code: int, lines: list[str]) -> ImageError:
    tail = "\n".join(lines[-OUTPUT_TAIL_LINES:]) or "(no output)"
    return ImageError(f"{step} failed (exit {code}): {shlex.join(args)}\n{tail}")


def image_id(tag: str) -> str | None:
    """The image's id, or None when no such image is present locally."""
    args = ["docker", "image", "inspect", "--format", "{{.Id}}", tag]
    log.debug("check image: %s", shlex.join(args))
    proc = subprocess.run(args, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def inspect_image(tag: str, template: str) -> str:
    args = ["docker", "image", "inspect", "--format", template, tag]
    return run_step(f"docker image inspect {tag}", args, capture=True)


def image_env(tag: str) -> dict[str, str]:
    out = inspect_image(tag, "{{range .Config.Env}}{{println .}}{{end}}")
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def image_size_bytes(tag: str) -> int:
    return int(inspect_image(tag, "{{.Size}}").strip())


def replace_image(tag: str, step: str, args: list[str], say_steps: bool = False) -> None:
    """Runs a command that (re)makes `tag`, then removes the image the tag pointed to before.

    Without this every rebuild would leave a dangling GB-sized image behind. A removal that
    fails (a container still uses the old image) is only logged.
    """
    previous = image_id(tag)
    run_step(step, args, say_steps=say_steps)
    if previous is not None and previous != image_id(tag):
        removal = ["docker", "image", "rm", previous]
        log.debug("remove replaced image: %s", shlex.join(removal))
        proc = subprocess.run(removal, capture_output=True, text=True)
        if proc.returncode != 0:
            log.debug("kept %s: %s", previous, proc.stderr.strip())
