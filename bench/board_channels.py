"""What the enoslib backend's choice of channel costs: its own SSH channel (the ssh backend's
paramiko connections) against EnOSlib's Ansible, on the same SSH boards in network namespaces
(`checks.boards`), as root: `python -m bench.board_channels` (about a minute).

Per channel, for `--boards` boards (2): setting them up (direct: the backend's whole
start, i.e. connect, checks, code and run files copied, clock; Ansible: EnOSlib's
`sync_info`, then copying the project's source archive to each board), and a command on every
board (a no-op, and the `tc qdisc change` of a rate change; direct: the backend's traffic
control's `change` board after board, and on every board at once as the tbf emulator does it),
median of ROUNDS. Ansible runs with EnOSlib's defaults (SSH master connections kept 60 s
and reused; host keys checked here against the lab's known_hosts); the masters it leaves are
closed at the end, which a run through Ansible would also need.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

ROUNDS = 7


def timed(action: Callable[[], object], rounds: int = 1) -> float:
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        action()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.board_channels", description=__doc__)
    parser.add_argument("--boards", type=int, default=2)
    count = parser.parse_args(argv).boards
    import enoslib as en

    from bench.scale import static_provider
    from testbed.backends.base import DeviceSpec
    from testbed.backends.enoslib.backend import EnoslibBackend
    from testbed.backends.enoslib.provider_section import Provider
    from testbed.backends.ssh.files import source_archive
    from testbed.experiment.profiles import load_profile
    from testbed.kernel.shaping import change_argv
    from testbed.link.token_bucket import profile_plan

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-channels-") as temporary:
        directory = Path(temporary)
        with static_provider(directory, count) as section:
            provider = Provider.model_validate(section)
            backend = EnoslibBackend(uuid.uuid4().hex[:12], directory / "run", provider)
            try:
                rows.append(("set-up", "direct", timed(lambda: backend.start(DeviceSpec(count)))))
                plan = profile_plan(load_profile("ideal"), 5.0)
                control = backend.traffic_control
                for device in backend.devices:
                    control.apply(device, plan)
                changed = profile_plan(load_profile("ideal"), 2.0)

                def change_in_turn() -> None:
                    for device in backend.devices:
                        control.change(device, changed)

                def change_at_once() -> None:
                    backend.for_each(backend.devices, lambda d: control.change(d, changed))

                rows.append(
                    ("rate change, board after board", "direct", timed(change_in_turn, ROUNDS))
                )
                rows.append(
                    ("rate change, every board at once", "direct", timed(change_at_once, ROUNDS))
                )
                rows.append(
                    (
                        "no-op command",
                        "direct",
                        timed(lambda: [s.execute(["true"]) for s in backend.sessions], ROUNDS),
                    )
                )
                interface = backend.devices[0].interface
                checked = (
                    f"-o StrictHostKeyChecking=yes -o UserKnownHostsFile={provider.known_hosts}"
                )
                hosts = [
                    en.Host(
                        session.board.address,
                        alias=session.board.name,
                        user="root",
                        keyfile=provider.boards.key_file,
                        extra={"ansible_ssh_common_args": checked},
                    )
                    for session in backend.sessions
                ]
                roles = en.Roles({"devices": hosts})
                rows.append(
                    (
                        "sync_info",
                        "ansible",
                        timed(lambda: en.sync_info(roles, en.Networks())),
                    )
                )
                archive, digest = source_archive()
                local = directory / "source.tar.gz"
                local.write_bytes(archive)

                def copy() -> None:
                    with en.actions(roles=roles) as play:
                        play.copy(src=str(local), dest=f"/tmp/bench-{digest[:8]}.tar.gz")

                rows.append(("copy the source archive", "ansible", timed(copy)))
                rows.append(
                    (
                        "no-op command",
                        "ansible",
                        timed(lambda: en.run_command("true", roles=roles), ROUNDS),
                    )
                )
                change = " ".join(change_argv(interface, changed))
                rows.append(
                    (
                        "rate change, every board at once",
                        "ansible",
                        timed(lambda: en.run_command(change, roles=roles), ROUNDS),
                    )
                )
                en.run_command(f"rm -f /tmp/bench-{digest[:8]}.tar.gz", roles=roles)
            finally:
                backend.stop()
                # Ansible's SSH masters (ControlPersist 60 s) and their `sshd: root@notty`
                masters = subprocess.run(
                    ["pgrep", "-f", r"ssh: .*\[mux\]"], capture_output=True, text=True
                )
                for pid in masters.stdout.split():
                    subprocess.run(["kill", pid], check=False)
    print(f"{count} boards")
    print("| what | channel | median s |")
    print("|---|---|---|")
    for what, channel, seconds in rows:
        print(f"| {what} | {channel} | {seconds:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
