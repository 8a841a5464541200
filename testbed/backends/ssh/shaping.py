"""Shaping a board's link over SSH: iproute2 and ethtool run as root (`sudo -n` when the
board's user is not root), sudo's refusals told apart from the commands' own failures, which
qdiscs the board's kernel can attach, and the interface settings that unshaping restores.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import uuid
from typing import Any

from testbed.backends.base import ExecResult
from testbed.backends.ssh.inventory import Board
from testbed.backends.ssh.session import BoardSession
from testbed.errors import ShapingError
from testbed.kernel.shaping import clear_argv

log = logging.getLogger(__name__)

OFFLOADS = {
    "generic-segmentation-offload": "gso",
    "tcp-segmentation-offload": "tso",
    "generic-receive-offload": "gro",
}
PROBES = {  # as testbed.kernel.support probes them
    "tbf": ["root", "handle", "1:", "tbf", "rate", "1mbit", "burst", "8000", "limit", "16000"],
    "htb": ["root", "handle", "1:", "htb", "default", "0"],
    "netem": ["root", "handle", "1:", "netem", "delay", "1ms"],
    "ingress": ["ingress"],
}
SUDO_REFUSED = re.compile(  # sudo's own refusals (with -n), not the failures of what it runs
    r"sudo: a (password|terminal) is required|is not allowed to (execute|run sudo)"
    r"|is not in the sudoers file|sudo: (command )?not found"
)


def sudo_refused(stderr: str) -> bool:
    """Whether a command failed because `sudo -n` would not run it (not because of tc)."""
    return bool(SUDO_REFUSED.search(stderr))


def sudo_advice(board: Board) -> str:
    """How to let the board's user run tc, ip and ethtool through `sudo -n`."""
    return (
        f"let {board.user} run tc and ip without a password (sudoers: `{board.user} ALL=(root) "
        "NOPASSWD: /usr/sbin/tc, /usr/sbin/ip, /usr/sbin/ethtool`) or connect as root"
    )


def run_as_root(session: BoardSession, commands: list[list[str]]) -> list[ExecResult]:
    """iproute2/ethtool commands as root (`sudo -n` when not root), in one round trip."""
    results = session.batch(commands, sudo=True)
    for argv, result in zip(commands, results, strict=True):
        if not result.ok and sudo_refused(result.stderr):
            raise ShapingError(
                f"{session.board.label}: `sudo -n {shlex.join(argv)}` was refused "
                f"({result.tail(1)}); " + sudo_advice(session.board)
            )
    return results


def probe_qdiscs(session: BoardSession) -> dict[str, bool]:
    """Each qdisc tried once on loopback of a throwaway network namespace on the board."""
    name = f"tbprobe-{uuid.uuid4().hex[:8]}"
    tc = ["tc", "-n", name, "qdisc"]
    commands = [["ip", "netns", "add", name]]
    for spec in PROBES.values():
        commands += [[*tc, "add", "dev", "lo", *spec], [*tc, "del", "dev", "lo", spec[0]]]
    results = run_as_root(session, [*commands, ["ip", "netns", "del", name]])
    if not results[0].ok:
        raise ShapingError(
            f"{session.board.label}: cannot probe qdiscs (ip netns add): {results[0].tail(1)}"
        )
    found = {kind: results[1 + 2 * i].ok for i, kind in enumerate(PROBES)}
    log.info("%s: qdisc support %s", session.board.name, found)
    return found


def read_link_settings(session: BoardSession, interface: str) -> dict[str, Any]:
    """The interface's gso_max_segs and offloads, which `stop` restores."""
    shown, features = session.batch(
        [["ip", "-d", "-j", "link", "show", "dev", interface], ["ethtool", "-k", interface]]
    )
    if not shown.ok:
        raise ShapingError(f"{session.board.label}: no interface {interface}: {shown.tail(1)}")
    settings: dict[str, Any] = {"gso_max_segs": json.loads(shown.stdout)[0]["gso_max_segs"]}
    for line in features.stdout.splitlines() if features.ok else []:
        key, _, value = line.partition(":")
        if key.strip() in OFFLOADS and "[fixed]" not in value:
            settings[OFFLOADS[key.strip()]] = value.split()[0]
    return settings


def unshape(session: BoardSession) -> None:
    """Removes the root qdisc; puts gso_max_segs and offloads back as they were."""
    interface, settings = session.board.interface, session.link_settings or {}
    commands = [clear_argv(interface)]
    if "gso_max_segs" in settings:
        segments = str(settings["gso_max_segs"])
        commands.append(["ip", "link", "set", "dev", interface, "gso_max_segs", segments])
    offloads = [
        word for key in OFFLOADS.values() if key in settings for word in (key, settings[key])
    ]
    if offloads:
        commands.append(["ethtool", "-K", interface, *offloads])
    for argv, result in zip(commands, run_as_root(session, commands), strict=True):
        if not result.ok and argv is not commands[0]:
            log.warning("%s: `%s` failed: %s", session.board.name, shlex.join(argv), result.tail(1))
