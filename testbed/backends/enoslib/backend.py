"""Devices on boards that an EnOSlib provider reserves or lists (`backend: enoslib`), run over
SSH exactly as the `ssh` backend runs its inventory's boards.

EnOSlib does two things here: its provider reserves the hosts (Grid'5000, FIT IoT-LAB,
Chameleon, FABRIC) or lists them (static), and says which hosts play the experiment's role.
Everything after that goes through the ssh backend's own channel (paramiko, one connection
per board, host keys checked against `provider.known_hosts`): the checks, copying the project
and the run's files (SFTP, skipped where the board has the same digest), the run secret, the
clock offsets, shaping and every rate change, starting and killing workers, reading
counters, and the cleanup. Why not Ansible, which EnOSlib runs its actions through:

- Timing. A rate change while a trace plays must be in force within 250 ms; an Ansible
  round costs 0.25 s per call with SSH master connections reused and 1.7 s without (the
  measurements are in docs/benchmarks.md, Boards through EnOSlib); a command on an open
  paramiko connection costs milliseconds.
- Cleanup. Ansible's SSH masters outlive a play by 60 s (with an `sshd: root@notty` on each
  board), it leaves `~/.ansible/tmp` on the hosts, and EnOSlib's inventory turns host-key
  checking off. The ssh backend leaves nothing and refuses an unknown key.
- One implementation. The ssh backend's boards and these are the same boards once reserved;
  their code paths are the same code (`SshBackend`), tested the same way.

Links are shaped by the project's own plan (`testbed.kernel.shaping`: htb, tbf, u32, ifb,
netem only where the kernel has it), never by EnOSlib's emulation services, which add netem
to every constraint and delete the root qdisc of every interface of a host when destroyed.

The reservation is made when the first set of devices starts and released when the backend
stops (unless `provider.keep`); a run with several device counts reserves once per count.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from testbed.backends.base import Device, DeviceSpec
from testbed.backends.enoslib import providers
from testbed.backends.enoslib.provider_section import Provider
from testbed.backends.enoslib.refusal import provider_refusal
from testbed.backends.ssh.backend import SshBackend
from testbed.errors import ConfigError, DeviceError

if TYPE_CHECKING:
    from testbed.experiment.schema import Experiment

log = logging.getLogger(__name__)


class EnoslibBackend(SshBackend):
    name = "enoslib"
    settings = Provider.section  # its hosts become the ssh backend's inventory at start

    @classmethod
    def section_refusal(cls, experiment: Experiment) -> str | None:
        """Its provider's rules (`testbed.backends.enoslib.refusal`), not the ssh backend's
        inventory's: the provider's hosts become its boards."""
        return provider_refusal(experiment)

    @classmethod
    def versions(cls) -> dict[str, str]:
        try:
            from importlib.metadata import version

            return {"enoslib": version("enoslib")}
        except Exception:  # noqa: BLE001 - a version is a fact, not a requirement
            return {}

    def __init__(self, run_id: str, run_dir: Path, provider: Provider | None):
        if provider is None:
            raise ConfigError(
                "the enoslib backend needs a provider: add a `provider:` section (see "
                "experiments/enoslib-static.yaml)"
            )
        super().__init__(run_id, run_dir, None)
        self.provider = provider
        self.reservation: Any = None

    def start(self, spec: DeviceSpec) -> list[Device]:
        try:
            self.reservation, hosts = providers.start(self.provider)
            if spec.count > len(hosts):
                raise DeviceError(
                    f"provider {self.provider.kind}: the experiment asks for {spec.count} "
                    f"devices; role {self.provider.role} has {len(hosts)} hosts"
                )
            self.inventory = providers.inventory(self.provider, hosts[: spec.count])
        except BaseException:
            self.stop()
            raise
        return super().start(spec)

    def stop(self) -> None:
        super().stop()
        if self.reservation is not None:
            reservation, self.reservation = self.reservation, None
            try:
                providers.release(self.provider, reservation)
            except Exception as error:  # noqa: BLE001 - say it, the run's other cleanup went on
                log.warning("provider %s: releasing failed: %s", self.provider.kind, error)
