"""The netem reference guest's pure parts, without booting it: the batch it is handed, the
results it writes back, the initramfs format, what the build reads from apt, ldd and modules,
and the command line's refusals. Booting it is tests/integration/test_netem_guest.py."""

from __future__ import annotations

import base64
import stat

import pytest

from checks.errors import GuestError
from checks.guest import cpio
from checks.guest.__main__ import main
from checks.guest.boot import batch_archive, parse_results
from checks.guest.build import kernel_package, module_depends, shared_libraries

COMMANDS = [["tc", "qdisc", "show", "dev", "va"], ["ping", "-c", "1", "it's"]]


def read_archive(data: bytes) -> dict[str, tuple[int, bytes]]:
    """{path: (mode, data)} of a newc archive, read back by its header fields."""
    members, position = {}, 0
    while True:
        header = data[position : position + 110]
        assert header[:6] == cpio.MAGIC
        fields = [int(header[6 + 8 * i : 14 + 8 * i], 16) for i in range(13)]
        mode, size, name_size = fields[1], fields[6], fields[11]
        name_end = position + 110 + name_size
        name = data[position + 110 : name_end - 1].decode()
        start = name_end + (-name_end % 4)
        if name == cpio.TRAILER:
            assert start == len(data)
            return members
        members[name] = (mode, data[start : start + size])
        position = start + size + (-(start + size) % 4)


def test_a_batch_is_one_script_with_the_hosts_tc_and_each_word_quoted() -> None:
    members = read_archive(batch_archive(COMMANDS))
    mode, script = members["batch.sh"]
    assert stat.S_ISREG(mode)
    lines = script.decode().splitlines()
    assert lines[0] == "/sbin/tc qdisc show dev va </dev/null >/tmp/out 2>/tmp/err"
    assert lines[1] == "report 0 $?"
    assert lines[2].startswith("ping -c 1 'it'\"'\"'s' ")  # busybox's ping, a quoted word
    with pytest.raises(GuestError, match="command 1 is empty"):
        batch_archive([["ip"], []])


def test_an_archive_holds_folders_files_links_and_devices() -> None:
    entries = [
        cpio.directory("bin"),
        cpio.regular("bin/x", b"12345", executable=True),
        cpio.symlink("bin/sh", "busybox"),
        cpio.char_device("dev/console", 5, 1),
    ]
    members = read_archive(cpio.archive(entries))
    assert list(members) == ["bin", "bin/x", "bin/sh", "dev/console"]
    assert members["bin/x"] == (stat.S_IFREG | 0o755, b"12345")
    assert members["bin/sh"] == (stat.S_IFLNK | 0o777, b"busybox")
    assert stat.S_ISCHR(members["dev/console"][0])


def encoded(text: str) -> list[str]:
    return [base64.b64encode(text.encode()).decode()] if text else []


def results_text(*ended: tuple[int, int, str, str], done: bool = True) -> str:
    lines = ["@@ready 6.1.0-57-cloud-amd64"]
    for index, status, out, err in ended:
        lines += [f"@@exit {index} {status}", *encoded(out), "@@stderr", *encoded(err), "@@end"]
    return "\r\n".join(lines + (["@@done"] if done else [])) + "\r\n"


def test_results_come_back_per_command_with_status_and_both_outputs() -> None:
    text = results_text((0, 0, "qdisc noqueue 0: root\n", ""), (1, 1, "", "ping: bad address\n"))
    first, second = parse_results(text, COMMANDS)
    assert first.argv == tuple(COMMANDS[0]) and first.ok and first.stdout.startswith("qdisc")
    assert (second.returncode, second.stdout, second.stderr) == (1, "", "ping: bad address\n")


def test_a_batch_cut_short_or_a_guest_that_never_came_up_is_an_error() -> None:
    with pytest.raises(GuestError, match=r"after 1 of 2 commands \(in `ping -c 1"):
        parse_results(results_text((0, 0, "x", ""), done=False), COMMANDS)
    with pytest.raises(GuestError, match="setting up failed: insmod sch_netem"):
        parse_results("@@failed insmod sch_netem\n", COMMANDS)
    with pytest.raises(GuestError, match="never came up"):
        parse_results("", COMMANDS)


def test_the_build_reads_apt_ldd_and_modinfo() -> None:
    depends = "linux-image-cloud-amd64\n  Depends: linux-image-6.1.0-57-cloud-amd64\n"
    assert kernel_package(depends) == "linux-image-6.1.0-57-cloud-amd64"
    with pytest.raises(GuestError, match="apt knows no linux-image-cloud-amd64"):
        kernel_package("")
    ldd = (
        "/sbin/tc:\n\tlinux-vdso.so.1 (0x00007f)\n"
        "\tlibbpf.so.1 => /lib/x86_64-linux-gnu/libbpf.so.1 (0x00007f)\n"
        "\t/lib64/ld-linux-x86-64.so.2 (0x00007f)\n"
        "/sbin/ip:\n\tlibbpf.so.1 => /lib/x86_64-linux-gnu/libbpf.so.1 (0x00007f)\n"
        "/bin/busybox:\n\tnot a dynamic executable\n"
    )
    assert shared_libraries(ldd) == [
        "/lib/x86_64-linux-gnu/libbpf.so.1",
        "/lib64/ld-linux-x86-64.so.2",
    ]
    assert module_depends(b"\x00license=GPL\x00depends=\x00name=veth\x00") == []
    assert module_depends(b"\x00depends=nf_conntrack,nf-defrag-ipv4\x00") == [
        "nf_conntrack",
        "nf_defrag_ipv4",
    ]


def test_the_command_line_refuses_bad_input_in_one_line_with_exit_2(tmp_path, capsys) -> None:
    assert main(["run"]) == 2
    assert main(["run", "--file", str(tmp_path / "missing")]) == 2
    (tmp_path / "bad").write_text("tc qdisc 'unclosed\n")
    assert main(["run", "--file", str(tmp_path / "bad")]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert errors[0].startswith("guest run: no command given")
    assert "missing: No such file or directory" in errors[1]
    assert errors[2].startswith(f"guest: {tmp_path / 'bad'}:1: No closing quotation")
    with pytest.raises(SystemExit) as exit_info:
        main(["boot"])
    assert exit_info.value.code == 2
