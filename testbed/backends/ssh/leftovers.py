"""What a run changed on its boards, kept on the controller until the backend has undone it,
so that `testbed.clean` can undo it when the controller was killed (no `stop()` ran).

The record, `board-leftovers.json` in the run directory, says how each board was reached (its
inventory entry, with the interface found there), the known_hosts file its key is checked
against, the board's run directory, and, once its link is shaped, the interface settings
that unshaping restores. It is written before the first change on any board, rewritten at
each first shaping of a board, and removed when `stop()` has left every board. Workers need
no record: each runs under the launcher, which kills its process group when its SSH channel
closes, as it does when the controller dies.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from testbed.atomic import write_atomically
from testbed.backends.base import Leftovers
from testbed.backends.ssh.inventory import Board, Inventory
from testbed.backends.ssh.scripts import REMOVE_TREE
from testbed.backends.ssh.session import BoardSession, connect
from testbed.backends.ssh.shaping import unshape
from testbed.errors import TestbedError
from testbed.kernel.names import run_tag

log = logging.getLogger(__name__)

RECORD = "board-leftovers.json"


def write(run_dir: Path, inventory: Inventory, sessions: Sequence[BoardSession]) -> None:
    """Records (atomically) what `sessions` may have changed on their boards."""
    record = {
        "known_hosts": inventory.known_hosts,
        "connect_timeout_s": inventory.connect_timeout_s,
        "boards": [
            {
                "board": session.board.model_dump(),
                "run_dir": session.run_dir,
                "link_settings": session.link_settings,  # None: not shaped
            }
            for session in sessions
        ],
    }
    text = json.dumps(record, indent=2)
    write_atomically(run_dir / RECORD, lambda temporary: temporary.write_text(text))


def recorded(run_dirs: Mapping[str, Path]) -> list[Leftovers]:
    """The runs among `run_dirs` (by run id) that kept a record: one item each, its path."""
    found = []
    for run_id, run_dir in run_dirs.items():
        record = Path(run_dir) / RECORD
        if record.is_file():
            found.append(Leftovers(run_tag(run_id), run_id, (str(record),)))
    return found


def forget(run_dir: Path) -> None:
    (run_dir / RECORD).unlink(missing_ok=True)


def undo(path: Path) -> list[str]:
    """Connects to every board of a record and undoes what it says (unshapes the link,
    removes the run directory); returns what it did, one line each. The record is removed
    when every board was reached; TestbedError naming the boards that were not."""
    record: dict[str, Any] = json.loads(path.read_text())
    boards = [Board.model_validate(entry["board"]) for entry in record["boards"]]
    inventory = Inventory(
        known_hosts=record["known_hosts"],
        connect_timeout_s=record["connect_timeout_s"],
        boards=boards,
    )
    done, failed = [], []
    for rank, (board, entry) in enumerate(zip(boards, record["boards"], strict=True)):
        session = BoardSession(rank, board, link_settings=entry["link_settings"])
        try:
            connect(session, inventory)
            if entry["link_settings"] is not None:
                unshape(session)
                done.append(f"{board.label}: the qdiscs of {board.interface}")
            if entry["run_dir"]:
                session.execute([board.python, "-c", REMOVE_TREE, entry["run_dir"]])
                done.append(f"{board.label}: {entry['run_dir']}")
        except TestbedError as error:
            failed.append(str(error))
        finally:
            if session.client is not None:
                session.client.close()
    if failed:
        raise TestbedError(f"boards of {path.parent} left as they are: " + "; ".join(failed))
    path.unlink()
    return done
