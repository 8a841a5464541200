"""Traffic control on boards over SSH, as the ssh backend hands it out: the shaping plan
(`testbed.kernel.shaping`) as `tc` commands run as root on each board
(`testbed.backends.ssh.shaping`), on uplinks only.

A board's first shaping reads its interface's settings (gso_max_segs, offloads), which the
backend's `stop` restores, and records them in the run's `board-leftovers.json` before it
changes anything. Which qdiscs a board's kernel can attach is probed once per board.
"""

from __future__ import annotations

import logging
import shlex
from typing import TYPE_CHECKING, Protocol

from testbed.backends.ssh import leftovers
from testbed.backends.ssh.shaping import probe_qdiscs, read_link_settings, run_as_root
from testbed.backends.traffic_control import Shaped, TrafficControl
from testbed.errors import ShapingError
from testbed.kernel.interfaces import offload_argv
from testbed.kernel.shaping import change_argvs, check_support, clear_argv, gso_argv, tc_argv
from testbed.kernel.support import PROBED_QDISCS

if TYPE_CHECKING:
    import threading
    from pathlib import Path

    from testbed.backends.ssh.inventory import Inventory
    from testbed.backends.ssh.session import BoardSession
    from testbed.kernel.shaping import ShapingPlan

log = logging.getLogger(__name__)


class Boards(Protocol):
    """What traffic control needs of an ssh backend (`SshBackend` has it): its boards'
    sessions, the run's record of what it changed on them, and that record's lock."""

    sessions: list[BoardSession]
    run_dir: Path
    inventory: Inventory
    record_lock: threading.Lock

    def session_of(self, device: Shaped) -> BoardSession: ...


class BoardTrafficControl(TrafficControl):
    """The qdiscs of the boards of one ssh backend, through its SSH sessions."""

    def __init__(self, backend: Boards):
        self.backend = backend

    def support(self) -> dict[str, bool]:
        """What every board's kernel can attach (a qdisc counts when all boards have it)."""
        sessions = self.backend.sessions
        for session in sessions:
            if session.support is None:
                session.support = probe_qdiscs(session)
        kinds = PROBED_QDISCS
        return {kind: all(s.support and s.support[kind] for s in sessions) for kind in kinds}

    def apply(self, device: Shaped, plan: ShapingPlan) -> None:
        """The plan as `tc` commands on the board, after gso_max_segs 1 and offloads off."""
        backend = self.backend
        session = backend.session_of(device)
        if not plan.uplink_only:
            raise ShapingError(
                f"{session.board.label}: downlinks and pairs are not shaped on boards over ssh "
                "(link.downlink_mbit, link.pair_mbit, link.downlink_impairments, "
                "link.pair_impairments); only uplinks"
            )
        check_support(plan, self.support())
        interface = device.interface
        if session.link_settings is None:
            session.link_settings = read_link_settings(session, interface)
            with backend.record_lock:  # boards are shaped at once
                leftovers.write(backend.run_dir, backend.inventory, backend.sessions)
        commands = [gso_argv(interface), offload_argv(interface)]
        commands += [clear_argv(interface), *tc_argv(interface, plan)]
        results = run_as_root(session, commands)
        if not results[1].ok:
            log.warning("%s: offloads left on: %s", session.board.label, results[1].tail(1))
        must = [0, *range(3, len(commands))]  # [1] offloads may fail; [2] clears, maybe nothing
        for argv, result in ((commands[i], results[i]) for i in must):
            if not result.ok:
                run_as_root(session, [clear_argv(interface)])  # no half-shaped link
                raise ShapingError(
                    f"{session.board.label}: `{shlex.join(argv)}` failed: {result.tail(2)}"
                )

    def change(self, device: Shaped, plan: ShapingPlan) -> None:
        """The plan's rate and netem changed in place (`change_argvs`)."""
        session = self.backend.session_of(device)
        commands = change_argvs(device.interface, plan)
        for argv, result in zip(commands, run_as_root(session, commands), strict=True):
            if not result.ok:
                raise ShapingError(
                    f"{session.board.label}: `{shlex.join(argv)}` failed: {result.tail(2)}"
                )

    def stats(self, device: Shaped) -> str:
        session = self.backend.session_of(device)
        result = session.execute(["tc", "-s", "qdisc", "show", "dev", device.interface])
        if not result.ok:
            raise ShapingError(f"{session.board.label}: reading qdisc statistics: {result.tail(1)}")
        return result.stdout
