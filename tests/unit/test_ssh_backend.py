"""The ssh backend without a board: command rendering (tc with sudo, quoting), the checksum
decisions of deployment, the reproducible source archive, and the scripts it runs on a board,
here run by this machine's Python (no SSH, no privileges)."""

from __future__ import annotations

import gzip
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from testbed.backends.base import DeviceSpec
from testbed.backends.ssh.backend import SshBackend
from testbed.backends.ssh.checks import WORKER_MODULES, project_requirements
from testbed.backends.ssh.files import code_is_current, source_archive, source_files, uploads_needed
from testbed.backends.ssh.inventory import parse_inventory
from testbed.backends.ssh.scripts import BATCH, CHECK, LAUNCHER
from testbed.backends.ssh.session import host_key_advice, shell_line, with_sudo
from testbed.backends.ssh.shaping import sudo_refused
from testbed.errors import ConfigError, DeviceError
from testbed.experiment.profiles import LinkProfile
from testbed.kernel import shaping
from testbed.link.token_bucket import profile_plan

INVENTORY = {
    "known_hosts": "/keys/known_hosts",
    "boards": [{"name": "pi1", "address": "192.168.1.21", "user": "pi", "port": 2222}],
}


def run_line(line: str, **kwargs) -> subprocess.CompletedProcess:
    """What a board's shell does with the line SSH hands it."""
    return subprocess.run(["sh", "-c", line], capture_output=True, text=True, **kwargs)


def test_tc_commands_get_sudo_when_the_user_is_not_root():
    plan = profile_plan(LinkProfile(name="p", delay_ms=10), rate_mbit=5)
    commands = [with_sudo(argv, True) for argv in shaping.tc_argv("eth0", plan)]
    assert commands == [
        ["sudo", "-n", "tc", "qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "tbf"]
        + ["rate", "5000000bit", "burst", "3028", "limit", "34278"],
        ["sudo", "-n", "tc", "qdisc", "add", "dev", "eth0", "parent", "1:1", "handle", "10:"]
        + ["netem", "limit", "27", "delay", "10ms"],
    ]
    assert with_sudo(shaping.clear_argv("eth0"), False) == ["tc", "qdisc", "del", "dev", "eth0"] + [
        "root"
    ]


def test_a_rendered_line_gives_the_board_exactly_our_arguments(tmp_path):
    awkward = ["a b", "it's", '"q"', "$HOME", "; rm -rf /", "new\nline", "*", ""]
    argv = [
        sys.executable,
        "-c",
        "import json, os, sys; print(json.dumps([os.getcwd(), os.environ['K'], sys.argv[1:]]))",
        *awkward,
    ]
    line = shell_line(argv, cwd=str(tmp_path), env={"K": "v w"})
    done = run_line(line, check=True)
    assert json.loads(done.stdout) == [str(tmp_path), "v w", awkward]
    assert shell_line(["tc", "-V"]) == 'export PATH="$PATH:/usr/sbin:/sbin"; exec tc -V'


@pytest.mark.parametrize(
    ("stderr", "refused"),
    [
        ("sudo: a password is required\n", True),
        ("Sorry, user pi is not allowed to execute '/usr/sbin/tc qdisc' as root on rpi.\n", True),
        ("pi is not in the sudoers file.  This incident will be reported.\n", True),
        ("sh: 1: sudo: not found\n", True),
        ("RTNETLINK answers: Operation not permitted\n", False),
        ("Error: Exclusivity flag on, cannot modify.\n", False),
    ],
)
def test_sudo_refusals_are_told_from_tc_failures(stderr, refused):
    assert sudo_refused(stderr) is refused


def test_checksums_decide_what_is_uploaded():
    local = {"bundles/a.pt": "aa", "bundles/b.pt": "bb", "bundles/c.pt": "cc"}
    remote = {"bundles/a.pt": "aa", "bundles/b.pt": "old", "bundles/c.pt": None}
    assert uploads_needed(local, remote) == ["bundles/b.pt", "bundles/c.pt"]
    assert uploads_needed(local, {}) == list(local)
    assert uploads_needed(local, {**remote, "bundles/b.pt": "bb", "bundles/c.pt": "cc"}) == []
    assert code_is_current("abc\n", "abc") and not code_is_current("abd", "abc")
    assert not code_is_current(None, "abc")


def make_tree(root: Path) -> None:
    for name in ("tracevq", "devices", "testbed"):
        (root / name / "__pycache__").mkdir(parents=True)
        (root / name / "__init__.py").write_text(f"# {name}\n")
        (root / name / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    (root / "pyproject.toml").write_text("[project]\n")
    (root / "tests").mkdir()
    (root / "tests" / "t.py").write_text("")


def test_the_source_archive_is_reproducible_and_holds_only_the_project(tmp_path):
    make_tree(tmp_path)
    archive, digest = source_archive(tmp_path)
    time.sleep(0.01)
    os.utime(tmp_path / "devices" / "__init__.py")  # a new mtime changes nothing
    assert source_archive(tmp_path) == (archive, digest)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        names = tar.getnames()
        assert {member.mtime for member in tar.getmembers()} == {0}
    expected = ["tracevq/__init__.py", "devices/__init__.py", "testbed/__init__.py"]
    assert names == [*expected, "pyproject.toml"]
    assert gzip.decompress(archive)  # a plain .tar.gz
    (tmp_path / "devices" / "__init__.py").write_text("# changed\n")
    assert source_archive(tmp_path)[1] != digest


def test_the_real_project_archive_has_the_worker_and_the_pins():
    names = {path.relative_to(Path(__file__).parents[2]).as_posix() for path in source_files()}
    assert {"devices/worker.py", "devices/probe.py", "tracevq/__init__.py"} <= names
    assert not any("__pycache__" in name or name.startswith("tests/") for name in names)
    python, torch_pin = project_requirements()
    assert python == (3, 11) and torch_pin == "2.13.0"


def test_host_key_advice_names_the_commands():
    board = parse_inventory(INVENTORY).boards[0]
    unknown = host_key_advice(board, "/k")
    assert "`ssh-keyscan -p 2222 192.168.1.21 >> /k`" in unknown
    assert "accept_new_host_keys: true" in unknown
    changed = host_key_advice(board, "/k", changed=True)
    assert "`ssh-keygen -R '[192.168.1.21]:2222' -f /k`" in changed


def test_the_backend_needs_an_inventory_with_enough_boards(tmp_path):
    with pytest.raises(ConfigError, match="the ssh backend needs an inventory"):
        SshBackend("r1", tmp_path, None)
    backend = SshBackend("r1", tmp_path, parse_inventory(INVENTORY))
    assert isinstance(backend, SshBackend)
    with pytest.raises(ConfigError, match="asks for 2 devices; the inventory lists 1 boards"):
        backend.start(DeviceSpec(count=2))  # before any connection


def test_device_paths_are_relative_to_the_run_directory(tmp_path):
    backend = SshBackend("r1", tmp_path, parse_inventory(INVENTORY))
    bundle = tmp_path / "bundles" / "bundle-K16.pt"
    bundle.parent.mkdir()
    bundle.write_bytes(b"x")
    assert backend.device_path(bundle) == "bundles/bundle-K16.pt"
    assert backend.device_path(tmp_path / "trials" / "t" / "rank0") == "trials/t/rank0"
    with pytest.raises(DeviceError, match="not in the run directory"):
        backend.device_path(Path("/etc/passwd"))


# the scripts run on a board, run here ---------------------------------------------------


def launch(*argv: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_the_launcher_reports_its_group_and_passes_the_exit_status():
    process = launch("sh", "-c", "echo out; echo err >&2; exit 5")
    assert process.wait(timeout=30) == 5  # stdin still open, as an SSH channel keeps it
    pid, rest = process.stdout.read().split("\n", 1)
    assert int(pid) == process.pid and rest == "out\n"
    assert process.stderr.read() == "err\n"
    missing = launch("/nonexistent/tool")
    assert missing.wait(timeout=30) == 127
    assert missing.stderr.read().startswith("/nonexistent/tool: No such file")


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    members = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def test_the_launcher_kills_its_group_when_its_channel_closes():
    process = launch("sh", "-c", "sleep 60 & sleep 60; wait")
    pid = int(process.stdout.readline())
    assert os.getpgid(pid) == pid  # its own group, to be killed as one
    deadline = time.monotonic() + 10
    while len(group_members(pid)) < 4 and time.monotonic() < deadline:  # launcher, sh, 2 sleeps
        time.sleep(0.05)
    assert len(group_members(pid)) == 4
    process.stdin.close()  # what a lost SSH connection looks like from the board
    assert process.wait(timeout=10) == -signal.SIGKILL
    # no sleep of that group survives; a killed process takes a moment to exit (under load,
    # longer than its launcher: once seen still running right after the launcher's exit)
    deadline = time.monotonic() + 10
    while group_members(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group_members(pid) == []


def test_the_check_and_batch_scripts_report_as_json():
    found = json.loads(
        subprocess.run(
            [sys.executable, "-c", CHECK, json.dumps(WORKER_MODULES)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert found["python"].startswith("3.") and found["cores"] >= 1
    assert set(found["modules"]) == set(WORKER_MODULES) and found["modules"]["torch"]
    assert found["binds"] is None
    for address, code in [("127.0.0.1", 0), ("192.0.2.1", 1)]:  # TEST-NET-1: not this host's
        found = json.loads(
            subprocess.run(
                [sys.executable, "-c", CHECK, json.dumps(WORKER_MODULES), address],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        assert found["binds"][0] == code, found["binds"]
    commands = [["sh", "-c", "echo a; exit 2"], ["/nonexistent/tool"]]
    results = json.loads(
        subprocess.run(
            [sys.executable, "-c", BATCH, json.dumps(commands)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert results[0] == [2, "a\n", ""]
    assert results[1][0] == 127 and "/nonexistent/tool" in results[1][2]
    assert shlex.split(shell_line(["a b"]))[-1] == "a b"
