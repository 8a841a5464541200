"""What a board must have before the ssh backend deploys to it: a Python at least as new as
the project's, the modules the worker imports (torch against the project's pin), iproute2's
`tc`, `sudo -n` for tc and ip when the user is not root (shaping needs it), and that the
board holds the address its worker will listen on (`data_address`, else `address`). A board
whose `interface` is `auto` gets the interface that holds that address.
"""

from __future__ import annotations

import json
import logging
import re
import tomllib
from pathlib import Path

from testbed.backends.ssh.scripts import CHECK
from testbed.backends.ssh.session import BoardSession
from testbed.backends.ssh.shaping import sudo_advice
from testbed.errors import DeviceError
from testbed.source import SOURCE_ROOT

log = logging.getLogger(__name__)

AUTO_INTERFACE = "auto"  # a board's interface, found by the address it holds
WORKER_MODULES = {"torch": "torch", "numpy": "numpy", "yaml": "pyyaml", "pydantic": "pydantic"}


def project_requirements(root: Path = SOURCE_ROOT) -> tuple[tuple[int, int], str | None]:
    """(lowest Python, torch's pinned version or None) from pyproject.toml."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    match = re.search(r">=\s*(\d+)\.(\d+)", project.get("requires-python", ""))
    python = (int(match[1]), int(match[2])) if match else (3, 0)
    pins = [d.split("==", 1)[1] for d in project["dependencies"] if d.startswith("torch==")]
    return python, (pins[0].strip() if pins else None)


def check_board(session: BoardSession) -> None:
    """The board's Python, what the worker imports, tc, and sudo when not root."""
    board = session.board
    python_min, torch_pin = project_requirements()
    result = session.execute(
        [board.python, "-c", CHECK, json.dumps(WORKER_MODULES), board.peer_address]
    )
    if not result.ok:
        raise DeviceError(
            f"{board.label}: python '{board.python}' does not run there ({result.tail(1)}); "
            f"set boards[{session.rank}].python in the inventory to an interpreter with torch"
        )
    facts = session.facts = json.loads(result.stdout.strip().splitlines()[-1])
    if tuple(int(part) for part in facts["python"].split(".")[:2]) < python_min:
        raise DeviceError(
            f"{board.label}: {board.python} is Python {facts['python']}; the worker needs "
            f"Python >= {'.'.join(map(str, python_min))}"
        )
    missing = [WORKER_MODULES[m] for m in WORKER_MODULES if m not in facts["modules"]]
    if missing:
        wanted = [f"torch=={torch_pin}" if name == "torch" else name for name in missing]
        raise DeviceError(
            f"{board.label}: {board.python} (Python {facts['python']}) lacks "
            f"{', '.join(missing)}, which the worker needs: pip install {' '.join(wanted)}"
        )
    torch_version = facts["modules"]["torch"]
    if torch_pin and torch_version.split("+")[0] != torch_pin:
        log.warning(
            "%s has torch %s, the project pins %s: logits may differ",
            board.label,
            torch_version,
            torch_pin,
        )
    _check_tools(session)
    _check_address(session)
    if board.interface == AUTO_INTERFACE:
        interface = interface_holding(session.facts.get("addresses"), board.peer_address)
        if interface is None:
            raise DeviceError(
                f"{board.label}: interface auto: no interface of the board holds "
                f"{board.peer_address}; name the interface that carries its traffic to the "
                "other boards (and data_address, where address is not one the board holds)"
            )
        log.debug("%s: interface auto is %s", board.label, interface)
        session.board = board.model_copy(update={"interface": interface})


def interface_holding(addresses: list | None, address: str) -> str | None:
    """The interface that holds `address`, from the board's `ip -o -4 addr show`
    ([status, text]: `2: eth0    inet 10.0.0.1/24 brd ... scope global eth0 ...`)."""
    if not addresses or addresses[0] != 0:
        return None
    for line in addresses[1].splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[2] == "inet" and fields[3].split("/")[0] == address:
            return fields[1].split("@")[0]
    return None


def _check_address(session: BoardSession) -> None:
    """The worker listens on the board's peer address only: the board must hold it."""
    board, binds = session.board, session.facts.get("binds")
    if binds and binds[0] != 0:
        raise DeviceError(
            f"{board.label}: its worker listens on {board.peer_address}, which the board "
            f"cannot bind ({binds[1]}); set boards[{session.rank}].data_address to an address "
            "the board holds on the network the boards share (not one translated by NAT)"
        )


def _check_tools(session: BoardSession) -> None:
    board, facts = session.board, session.facts
    if facts["tc"][0] != 0:
        raise DeviceError(f"{board.label}: iproute2's `tc` is missing ({facts['tc'][1]})")
    if facts["ethtool"][0] != 0:
        log.warning("%s: no ethtool: offloads stay on when shaping", board.label)
    for tool, (code, output) in facts["sudo"].items():
        if code != 0:
            raise DeviceError(
                f"{board.label}: user {board.user} may not run `sudo -n {tool}` "
                f"({output or 'refused'}); " + sudo_advice(board)
            )
