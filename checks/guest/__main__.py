"""`python -m checks.guest build` makes (or finds) the cached image;
`python -m checks.guest run [--file FILE] [--timeout S] -- CMD ... [-- CMD ...]` runs
the commands (each `--` starts one; FILE holds one a line, split as a shell would, never run by
one) in one boot of the guest and prints each with its output and exit status. Exits 0 when
every command succeeded, 1 when one failed or the guest did, 2 on bad arguments."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import time
from pathlib import Path

from checks.errors import GuestError
from checks.guest.boot import BATCH_TIMEOUT_S, run
from checks.guest.build import build


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    head, commands = _split(words)
    parser = argparse.ArgumentParser(prog="python -m checks.guest", description=__doc__)
    parser.add_argument("action", choices=("build", "run"))
    parser.add_argument("--file", type=Path, help="commands, one a line")
    parser.add_argument("--timeout", type=float, default=BATCH_TIMEOUT_S, help="seconds")
    parser.add_argument("-v", "--verbose", action="store_true")
    options = parser.parse_args(head)
    logging.basicConfig(
        level=logging.DEBUG if options.verbose else logging.INFO, format="%(message)s"
    )
    try:
        if options.file is not None:
            commands += _read_commands(options.file)
        if options.action == "build":
            began = time.monotonic()
            image = build()
            took_s = time.monotonic() - began
            print(f"{image.kernel} {image.initramfs} ({image.release}, {took_s:.1f} s)")
            return 0
        if not commands or not all(commands):
            print(
                "guest run: no command given (-- CMD ... [-- CMD ...] or --file FILE)",
                file=sys.stderr,
            )
            return 2
        results = run(commands, timeout_s=options.timeout)
    except (GuestError, ValueError) as error:
        print(f"guest: {error}", file=sys.stderr)
        return 2 if isinstance(error, ValueError) else 1
    for result in results:
        print(f"$ {shlex.join(result.argv)}")
        sys.stdout.write(result.stdout + result.stderr)
        print(f"[exit {result.returncode}]")
    return 0 if all(result.ok for result in results) else 1


def _split(words: list[str]) -> tuple[list[str], list[list[str]]]:
    """The options before the first `--`, and the commands after it, one per `--`."""
    if "--" not in words:
        return words, []
    first = words.index("--")
    commands: list[list[str]] = [[]]
    for word in words[first + 1 :]:
        if word == "--":
            commands.append([])
        else:
            commands[-1].append(word)
    return words[:first], commands


def _read_commands(path: Path) -> list[list[str]]:
    """One command a line (blank lines and `#` comments skipped); ValueError on a bad one."""
    try:
        text = path.read_text()
    except OSError as error:
        raise ValueError(f"{path}: {error.strerror}") from None
    commands = []
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            words = shlex.split(line, comments=True)
        except ValueError as error:
            raise ValueError(f"{path}:{number}: {error}") from None
        if words:
            commands.append(words)
    return commands


if __name__ == "__main__":
    sys.exit(main())
