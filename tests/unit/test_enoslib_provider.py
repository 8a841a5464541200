"""The enoslib backend's provider section without reserving anything: its schema, EnOSlib's
schema of each provider's configuration as one line naming the field, credentials refused,
the static hosts counted against the devices, and EnOSlib's hosts turned into boards."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from testbed.backends.enoslib import providers
from testbed.backends.ssh.checks import interface_holding
from testbed.experiment.schema import parse_experiment
from testbed.run import main

STATIC_CONF = {
    "resources": {
        "machines": [
            {"roles": ["devices"], "address": "127.0.0.1", "alias": "b0", "user": "pi"},
            {"roles": ["devices"], "address": "localhost", "alias": "b 1"},
            {"roles": ["other"], "address": "10.9.9.9"},
        ],
        "networks": [
            {"roles": ["lan"], "cidr": "10.9.9.0/24", "gateway": "10.9.9.1", "dns": "10.9.9.1"}
        ],
    }
}


def experiment(tmp_path: Path, count: int = 2, **provider) -> dict:
    known = tmp_path / "known_hosts"
    known.write_text("")
    section = {"kind": "static", "known_hosts": str(known), "conf": STATIC_CONF, **provider}
    return {
        "name": "e",
        "model": {"name": "vit-tiny"},
        "devices": {"count": [count]},
        "backend": "enoslib",
        "provider": section,
        "methods": [{"name": "voltage"}],
    }


def dry_run(tmp_path: Path, data: dict, capsys) -> tuple[int, str]:
    path = tmp_path / "e.yaml"
    path.write_text(yaml.safe_dump(data))
    status = main([str(path), "--dry-run", "--out", str(tmp_path / "out")])
    return status, capsys.readouterr().err.strip()


@pytest.mark.parametrize("name", ["g5k", "iotlab", "static"])
def test_the_example_files_pass_the_dry_run(name, tmp_path, monkeypatch, capsys):
    """With the user's known_hosts in place (and nothing contacted: the preflight checks
    EnOSlib's schema only)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "known_hosts").write_text("")
    path = Path(__file__).resolve().parents[2] / "experiments" / "enoslib" / f"{name}.yaml"
    assert main([str(path), "--dry-run", "--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().err.count("testbed.run:") == 0


def test_a_static_provider_passes_the_dry_run(tmp_path, capsys):
    status, _ = dry_run(tmp_path, experiment(tmp_path), capsys)
    assert status == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"conf": {"resources": {"machines": [{"roles": ["devices"]}], "networks": []}}},
            "provider.conf.resources.machines[0]: 'address' is a required property",
        ),
        ({"conf": {"walltime": 3}}, "provider.conf.resources: EnOSlib's configuration needs"),
        ({"kind": "openstack"}, "provider.kind: Input should be 'static', 'g5k'"),
        ({"boards": {"password": "x"}}, "provider.boards.password: credentials are not accepted"),
        ({"conf": {**STATIC_CONF, "api_token": "x"}}, "provider.conf.api_token: credentials"),
        ({"role": "nobody"}, "devices.count: 2 devices, but the static provider lists 0 hosts"),
        ({"known_hosts": "/nonexistent/kh"}, "provider.known_hosts: file not found"),
    ],
)
def test_a_bad_provider_is_refused_in_one_line(tmp_path, capsys, change, message):
    status, err = dry_run(tmp_path, experiment(tmp_path, **change), capsys)
    assert status == 2 and len(err.splitlines()) == 1
    assert message in err, err
    assert not (tmp_path / "out").exists()


def test_a_provider_whose_extra_is_missing_says_what_to_install(tmp_path, capsys):
    data = experiment(tmp_path, kind="fabric")
    status, err = dry_run(tmp_path, data, capsys)
    assert status == 2
    assert "provider.kind: fabric needs EnOSlib's fabric provider" in err
    assert "pip install 'enoslib[fabric]==10.9.0'" in err


def test_more_devices_than_static_hosts_are_refused(tmp_path, capsys):
    status, err = dry_run(tmp_path, experiment(tmp_path, count=3), capsys)
    assert status == 2
    assert "devices.count: 3 devices, but the static provider lists 2 hosts in role devices" in err


def test_the_hosts_of_the_role_become_boards_with_the_defaults(tmp_path):
    import enoslib

    section = parse_experiment(experiment(tmp_path, boards={"python": "/opt/py"})).provider
    _, hosts = providers.start(section)  # static: lists, reserves nothing
    assert [h.address for h in hosts] == ["127.0.0.1", "localhost"]
    assert all(isinstance(h, enoslib.Host) for h in hosts)
    inventory = providers.inventory(section, hosts)
    first, second = inventory.boards
    assert (first.name, first.user, first.python, first.interface) == (
        "b0",
        "pi",
        "/opt/py",
        "auto",
    )
    assert first.data_address is None  # an IPv4 address: the board's own
    # an alias that is no board name gives way to board<rank>; a host name resolves here
    assert (second.name, second.user, second.data_address) == ("board1", "root", "127.0.0.1")
    assert inventory.known_hosts == section.known_hosts


def test_the_interface_auto_is_the_one_holding_the_address():
    listing = (
        "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever\n"
        "2: lan0@if7    inet 10.0.0.2/24 brd 10.0.0.255 scope global lan0\\       valid_lft\n"
    )
    assert interface_holding([0, listing], "10.0.0.2") == "lan0"
    assert interface_holding([0, listing], "10.0.0.3") is None
    assert interface_holding([1, "ip: not found"], "10.0.0.2") is None
