"""The inventory of boards: defaults, paths, and errors that name the field (and the file)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from testbed.backends.ssh.inventory import load_inventory, parse_inventory
from testbed.errors import ConfigError
from testbed.experiment.schema import parse_experiment

BOARD = {"address": "192.168.1.21", "user": "pi", "key_file": "/keys/id"}
INVENTORY = {"known_hosts": "/keys/known_hosts", "boards": [BOARD]}
EXPERIMENT = {"name": "x", "methods": [{"name": "voltage"}], "backend": "ssh"}


def with_board(**changes):
    return {**INVENTORY, "boards": [{**BOARD, **changes}]}


def test_defaults_and_names():
    inventory = parse_inventory(
        {**INVENTORY, "boards": [BOARD, {**BOARD, "address": "pi2", "name": "second"}]}
    )
    first, second = inventory.boards
    assert (first.name, second.name) == ("board0", "second")
    assert (first.port, first.python, first.interface, first.peer_address) == (
        22,
        "python3",
        "eth0",
        "192.168.1.21",
    )
    assert first.label == "board 'board0' (pi@192.168.1.21:22)"
    assert inventory.accept_new_host_keys is False
    assert parse_inventory(with_board(data_address="10.0.0.1")).boards[0].peer_address == "10.0.0.1"


def test_a_file_s_relative_paths_are_taken_from_its_directory(tmp_path, monkeypatch):
    folder = tmp_path / "lab"
    folder.mkdir()
    path = folder / "boards.yaml"
    data = {"known_hosts": "known_hosts", "boards": [{**BOARD, "key_file": "keys/id"}]}
    path.write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)
    inventory = load_inventory("lab/boards.yaml")
    assert inventory.known_hosts == str(folder / "known_hosts")
    assert inventory.boards[0].key_file == str(folder / "keys" / "id")
    home = parse_inventory(with_board(key_file="~/.ssh/id_ed25519")).boards[0].key_file
    assert home == str(Path.home() / ".ssh" / "id_ed25519")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (with_board(adress="x"), "boards[0].adress: unknown key (did you mean 'address'?)"),
        ({**INVENTORY, "known_host": "k"}, "known_host: unknown key (did you mean 'known_hosts'?)"),
        (with_board(port=70000), "boards[0].port: Input should be less than or equal to 65535"),
        ({**INVENTORY, "boards": []}, "boards: List should have at least 1 item"),
        ({"boards": [BOARD]}, "known_hosts: Field required"),
        ({**INVENTORY, "boards": [{"user": "pi"}]}, "boards[0].address: Field required"),
        (with_board(password="hunter2"), "boards[0]: 'password' is not accepted"),
        ({**INVENTORY, "password": "x"}, "'password' is not accepted: boards are reached"),
        (with_board(key_passphrase="x"), "'key_passphrase' is not accepted"),
        (with_board(cpuset="0-3,x"), "boards[0].cpuset: String should match pattern"),
        (with_board(interface="a-very-long-ifname"), "boards[0].interface: String should have"),
        (
            {**INVENTORY, "boards": [BOARD, {**BOARD, "name": "board0", "address": "other"}]},
            "boards[1].name: 'board0' is also boards[0]",
        ),
        (
            {**INVENTORY, "boards": [BOARD, {**BOARD, "name": "b"}]},
            "boards[1]: 192.168.1.21:22 is also boards[0] (one worker per board)",
        ),
    ],
)
def test_errors_name_the_field_and_the_file(data, message):
    with pytest.raises(ConfigError) as caught:
        parse_inventory(data, "inv.yaml")
    assert str(caught.value).startswith("inv.yaml: ")
    assert message in str(caught.value)


def test_an_inventory_is_a_mapping():
    with pytest.raises(ConfigError, match="inv.yaml: an inventory is a mapping, got list"):
        parse_inventory([BOARD], "inv.yaml")
    with pytest.raises(ConfigError, match="inventory file not found"):
        load_inventory("/nonexistent/boards.yaml")


@pytest.mark.parametrize(
    ("inventory", "message"),
    [
        (with_board(adress="x"), "e.yaml: inventory.boards[0].adress: unknown key (did you mean"),
        ({**INVENTORY, "bords": []}, "inventory.bords: unknown key (did you mean 'boards'?)"),
        (with_board(password="x"), "e.yaml: inventory.boards[0]: 'password' is not accepted"),
        ("/nonexistent/boards.yaml", "e.yaml: inventory: inventory file not found"),
    ],
)
def test_the_experiment_validates_its_inventory(inventory, message):
    with pytest.raises(ConfigError) as caught:
        parse_experiment({**EXPERIMENT, "inventory": inventory}, "e.yaml")
    assert message in str(caught.value)


def test_an_inventory_file_s_errors_name_that_file(tmp_path):
    path = tmp_path / "boards.yaml"
    path.write_text(yaml.safe_dump(with_board(prot=22)))
    with pytest.raises(ConfigError) as caught:
        parse_experiment({**EXPERIMENT, "inventory": str(path)}, "e.yaml")
    assert str(caught.value) == (
        f"e.yaml: inventory: {path}: boards[0].prot: unknown key (did you mean 'port'?)"
    )


def test_the_saved_config_holds_the_resolved_inventory(tmp_path):
    path = tmp_path / "boards.yaml"
    path.write_text(yaml.safe_dump({**INVENTORY, "boards": [{**BOARD, "key_file": "id"}]}))
    experiment = parse_experiment({**EXPERIMENT, "inventory": str(path)})
    saved = experiment.model_dump(mode="json")
    assert saved["inventory"]["boards"][0]["key_file"] == str(tmp_path / "id")
    assert parse_experiment(saved) == experiment  # a resumed run finds the same boards
    assert parse_experiment({"name": "x", "methods": [{"name": "voltage"}]}).inventory is None
