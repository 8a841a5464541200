"""The inventory of boards the `ssh` backend runs on (its section of the experiment,
`inventory:`): one entry per board, in rank order.

A board knows how to reach it (address, port, user, key file), which Python runs the worker
there, which interface carries its traffic to the other boards (the one shaped), and its CPUs.
The inventory also names the known_hosts file that every board's host key is checked against.

An experiment gives its inventory as a path to a YAML file or inline (`inventory:`). Relative
paths inside a file are taken from the file's directory; inline, from the working directory.
Both are stored resolved, so a run's saved config finds them again. Validation is the
experiment's: unknown keys get a "did you mean", every error names its field path
(`boards[1].port`), and a password anywhere is refused: boards are reached by key only.

The fields a board shares with the enoslib backend's board defaults, and an inventory's host
keys with its provider's, are defined once here (`WorkerPython`, `KnownHostsFile`, ...);
`testbed.backends.enoslib.provider_section` uses them.

    known_hosts: ~/.ssh/known_hosts     # filled with `ssh-keyscan -p PORT HOST >> FILE`
    boards:
      - {name: pi1, address: 192.168.1.21, user: pi, key_file: ~/.ssh/id_ed25519,
         python: /home/pi/venv/bin/python, interface: eth0, cpus: 4}
      - {name: pi2, address: 192.168.1.22, user: pi, key_file: ~/.ssh/id_ed25519}
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field, ValidationError, model_validator

from testbed.errors import ConfigError
from testbed.experiment.sections import Section
from testbed.experiment.strict import Strict, describe
from testbed.experiment.yamlfile import load_yaml

SECRET_KEY = re.compile(r"pass(word|phrase)|secret", re.IGNORECASE)
PATH_FIELDS = ("key_file", "known_hosts")


def _refuse_secrets(data: Any) -> Any:
    if isinstance(data, dict):
        for key in data:
            if SECRET_KEY.search(str(key)):
                raise ValueError(
                    f"'{key}' is not accepted: boards are reached with an SSH key only, never a "
                    "password kept in a file (key_file, or ssh-agent when key_file is left out)"
                )
    return data


def absolute_path(path: str) -> str:
    """`~` expanded, relative to the working directory (a file's paths are made absolute
    against the file's directory before validation)."""
    return str(Path(path).expanduser().absolute())


def _absolute_or_none(path: str | None) -> str | None:
    return None if path is None else absolute_path(path)


# A board's fields, wherever a board is described: an inventory's boards and the enoslib
# provider's defaults for its hosts. Each class gives the default (and where the two differ,
# the description) itself.
KeyFile = Annotated[str | None, AfterValidator(_absolute_or_none)]
WorkerPython = Annotated[str, Field(min_length=1, description="the interpreter of the worker")]
BoardInterface = Annotated[
    str,
    Field(
        min_length=1,
        max_length=15,
        description="the interface to the other boards; auto: the one holding its address",
    ),
]
BoardCpus = Annotated[
    float | None,
    Field(gt=0, le=1024, description="its CPUs (default: the experiment's devices.cpus)"),
]
# ... and how the boards' host keys are checked, in an inventory and in a provider
KnownHostsFile = Annotated[
    str,
    Field(min_length=1, description="the file every board's host key is checked against"),
    AfterValidator(absolute_path),
]
AcceptNewHostKeys = Annotated[
    bool, Field(description="first use only: unknown keys are added to known_hosts")
]
ConnectTimeoutS = Annotated[float, Field(gt=0, le=3600)]


class Board(Strict):
    """One board. `address` is where the controller connects; `data_address` is where the
    other boards reach it (default: `address`) and where its worker listens, so it must be
    an address the board itself holds (not one translated by NAT; an IP address rather than
    a host name that the board may resolve to 127.0.1.1)."""

    name: str = Field(
        min_length=1, pattern=r"^[A-Za-z0-9_.-]+$", description="default: board<index>"
    )
    address: str = Field(min_length=1, description="where the controller connects")
    port: int = Field(22, ge=1, le=65535, description="its SSH port")
    user: str = Field(min_length=1, description="the user to log in as (key authentication)")
    key_file: KeyFile = Field(None, description="the private key; default: ssh-agent, ~/.ssh")
    python: WorkerPython = "python3"
    interface: BoardInterface = "eth0"
    data_address: str | None = Field(
        None, description="where the other boards reach it (default: address)"
    )
    cpus: BoardCpus = None
    cpuset: str | None = Field(
        None,
        pattern=r"^\d+(-\d+)?(,\d+(-\d+)?)*$",
        description="the cores to pin the worker to (taskset -c)",
    )
    workdir: str = Field(
        "~/.cache/trace-testbed", description="code and run directories on the board"
    )

    _secrets = model_validator(mode="before")(_refuse_secrets)

    @property
    def peer_address(self) -> str:
        return self.data_address or self.address

    @property
    def label(self) -> str:
        """How errors name the board: `board 'pi1' (pi@192.168.1.21:22)`."""
        return f"board '{self.name}' ({self.user}@{self.address}:{self.port})"


class Inventory(Section):
    """The boards a backend runs on, in rank order, and how their host keys are checked."""

    section = "inventory"
    about = (
        "the boards of a backend that needs them (ssh): a YAML file's path, or inline; see "
        "Inventory below"
    )
    needed = "an inventory of boards (a file's path or inline; see experiments/ssh-smoke.yaml)"

    known_hosts: KnownHostsFile
    accept_new_host_keys: AcceptNewHostKeys = False
    connect_timeout_s: ConnectTimeoutS = Field(10.0, description="per connection")
    boards: list[Board] = Field(min_length=1, description="one device per board, rank order")

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        """Refuses secrets; a board without a name is called `board<index>`."""
        _refuse_secrets(data)
        if isinstance(data, dict) and isinstance(data.get("boards"), list):
            boards = [
                {"name": f"board{index}", **board} if isinstance(board, dict) else board
                for index, board in enumerate(data["boards"])
            ]
            data = {**data, "boards": boards}
        return data

    @classmethod
    def given(cls, value: Any) -> Any:
        return inventory_input(value)

    @model_validator(mode="after")
    def _distinct(self) -> Inventory:
        names: dict[str, int] = {}
        endpoints: dict[tuple[str, int], int] = {}
        for index, board in enumerate(self.boards):
            if board.name in names:
                raise ValueError(
                    f"boards[{index}].name: '{board.name}' is also boards[{names[board.name]}]"
                )
            endpoint = (board.address, board.port)
            if endpoint in endpoints:
                raise ValueError(
                    f"boards[{index}]: {board.address}:{board.port} is also "
                    f"boards[{endpoints[endpoint]}] (one worker per board)"
                )
            names[board.name], endpoints[endpoint] = index, index
        return self


def _relative_to(data: Any, directory: Path) -> Any:
    """A file's relative paths made absolute against its directory (other values untouched)."""
    if not isinstance(data, dict):
        return data

    def fix(entry: Any) -> Any:
        if not isinstance(entry, dict):
            return entry
        return {
            key: str(directory / Path(value).expanduser())
            if key in PATH_FIELDS and isinstance(value, str)
            else value
            for key, value in entry.items()
        }

    fixed = fix(data)
    if isinstance(fixed.get("boards"), list):
        fixed["boards"] = [fix(board) for board in fixed["boards"]]
    return fixed


def parse_inventory(data: Any, source: str = "<inventory>") -> Inventory:
    """Validates an inventory mapping; raises ConfigError naming `source` and the fields."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: an inventory is a mapping, got {type(data).__name__}")
    try:
        return Inventory.model_validate(data)
    except ValidationError as error:
        raise ConfigError(f"{source}: {describe(error, Inventory)}") from None


def load_inventory(path: str | Path) -> Inventory:
    """Reads and validates an inventory file (relative paths in it: from its directory)."""
    path = Path(path).expanduser()
    data = load_yaml(path, "inventory file")
    return parse_inventory(_relative_to(data, path.absolute().parent), str(path))


def inventory_input(value: Any) -> Any:
    """For the experiment's `inventory:` field: a path is loaded here (its errors name the
    file); a mapping is left to the schema, which validates it as an `Inventory`."""
    if isinstance(value, str | Path):
        try:
            return load_inventory(value)
        except ConfigError as error:
            raise ValueError(str(error)) from None
    return value
