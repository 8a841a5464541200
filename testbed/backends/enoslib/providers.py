"""EnOSlib's providers as the enoslib backend uses them: each kind's configuration validated by
EnOSlib itself, the reservation made and released, and the hosts of the experiment's role
turned into the boards of an inventory.

EnOSlib (GPLv3, the optional extra `.[enoslib]`) is imported here only, when a provider is
checked or started. Its jsonschema errors become one line naming the field
(`provider.conf.resources.machines[0]: 'roles' is a required property`). A provider of
EnOSlib's own extras (iotlab, chameleon, fabric) that is not installed is named with the pip
command that installs it.
"""

from __future__ import annotations

import importlib
import ipaddress
import logging
import re
import socket
from dataclasses import dataclass
from typing import Any

from testbed.backends.enoslib.provider_section import Provider
from testbed.backends.ssh.inventory import Board, Inventory
from testbed.errors import ConfigError, DeviceError

log = logging.getLogger(__name__)

ENOSLIB_PIN = "enoslib==10.9.0"
BOARD_NAME_CHARACTERS = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-"
)


@dataclass(frozen=True)
class Kind:
    """Where EnOSlib keeps one kind of provider, and the EnOSlib extra it needs."""

    configuration: str  # module of its Configuration
    provider: str  # module:class of its Provider
    extra: str | None = None  # `pip install 'enoslib[extra]'`


KINDS = {
    "static": Kind(
        "enoslib.infra.enos_static.configuration", "enoslib.infra.enos_static.provider:Static"
    ),
    "g5k": Kind("enoslib.infra.enos_g5k.configuration", "enoslib.infra.enos_g5k.provider:G5k"),
    "iotlab": Kind(
        "enoslib.infra.enos_iotlab.configuration",
        "enoslib.infra.enos_iotlab.provider:Iotlab",
        "iotlab",
    ),
    "chameleon": Kind(
        "enoslib.infra.enos_chameleonbaremetal.configuration",
        "enoslib.infra.enos_chameleonbaremetal.provider:Chameleonbaremetal",
        "chameleon",
    ),
    "fabric": Kind(
        "enoslib.infra.enos_fabric.configuration",
        "enoslib.infra.enos_fabric.provider:Fabric",
        "fabric",
    ),
}


def _import(kind: str, module: str) -> Any:
    """EnOSlib's `module`; ConfigError saying what to install where it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        extra = KINDS[kind].extra
        wanted = f"'enoslib[{extra}]=={ENOSLIB_PIN.split('==')[1]}'" if extra else "'.[enoslib]'"
        if importlib.util.find_spec("enoslib") is None:
            wanted = "'.[enoslib]' (EnOSlib, GPLv3: see the README)" + (
                f", then {wanted}" if extra else ""
            )
        raise ConfigError(
            f"provider.kind: {kind} needs EnOSlib's {kind} provider, which does not import here "
            f"({error}): pip install {wanted}"
        ) from None


def check(provider: Provider) -> None:
    """`provider.conf` against EnOSlib's schema of that provider (ConfigError naming the field
    at fault). Only the schema: building the configuration may ask the provider's API (g5k
    looks a cluster's site up), which a check must not."""
    module = _import(provider.kind, KINDS[provider.kind].configuration)
    import jsonschema  # EnOSlib's dependency

    try:
        module.Configuration.validate(provider.conf)
    except jsonschema.ValidationError as error:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        raise ConfigError(f"provider.conf{where}: {error.message}") from None


def static_host_count(provider: Provider) -> int | None:
    """How many hosts a static provider lists in the role (None: known once reserved)."""
    if provider.kind != "static":
        return None
    machines = provider.conf.get("resources", {}).get("machines", [])
    return sum(1 for m in machines if provider.role in (m.get("roles") or []))


def start(provider: Provider) -> tuple[Any, list[Any]]:
    """Reserves (or, static, lists) the provider's hosts: (EnOSlib's provider, the hosts of
    `provider.role` in its order). DeviceError naming the provider when it fails."""
    check(provider)
    conf = _import(provider.kind, KINDS[provider.kind].configuration).Configuration
    try:
        conf = conf.from_dictionary(provider.conf)
    except Exception as error:  # noqa: BLE001 - EnOSlib's builders raise anything
        raise DeviceError(
            f"provider {provider.kind}: EnOSlib refuses the configuration: {error}"
        ) from None
    module, name = KINDS[provider.kind].provider.split(":")
    instance = getattr(_import(provider.kind, module), name)(conf)
    try:
        roles, _ = instance.init()
    except Exception as error:  # EnOSlib's and its clients' errors have no common base
        raise DeviceError(
            f"provider {provider.kind}: reserving the hosts failed: {error}"
        ) from None
    hosts = _in_rank_order(provider, list(roles[provider.role]) if provider.role in roles else [])
    log.info("provider %s: %d hosts in role %s", provider.kind, len(hosts), provider.role)
    return instance, hosts


def _in_rank_order(provider: Provider, hosts: list[Any]) -> list[Any]:
    """The static provider's hosts in the order it lists them; another provider's by name
    (digits as numbers: node-2 before node-10), so that a rank is the same host every run.
    EnOSlib's roles keep no order of their own."""
    if provider.kind == "static":
        listed = [m.get("address") for m in provider.conf["resources"].get("machines", [])]
        return sorted(hosts, key=lambda host: listed.index(host.address))

    def natural(host: Any) -> list[Any]:
        parts = re.split(r"(\d+)", str(host.address))
        return [int(part) if part.isdigit() else part for part in parts]

    return sorted(hosts, key=natural)


def release(provider: Provider, instance: Any) -> None:
    """Gives the reservation back unless the experiment keeps it (static: nothing to do)."""
    if provider.keep or provider.kind == "static":
        return
    log.info("provider %s: releasing the reservation", provider.kind)
    instance.destroy()


def _peer_address(address: str) -> str:
    """An IPv4 address as given, else the one the controller resolves it to (a provider may
    name its hosts; a worker listens on an address the board holds)."""
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(address, None, socket.AF_INET)[0][4][0]
    except OSError as error:
        raise DeviceError(f"provider host {address}: cannot resolve it ({error})") from None


def inventory(provider: Provider, hosts: list[Any]) -> Inventory:
    """The boards of `hosts` (EnOSlib Hosts, rank order) with the provider's board defaults.
    A board is named by its host's alias (else board<rank>); a host whose `extra` routes SSH
    through a gateway is refused: the direct channel goes to its address."""
    defaults = provider.boards
    boards = []
    for rank, host in enumerate(hosts):
        extra = " ".join(f"{key}={value}" for key, value in (host.extra or {}).items())
        if "gateway" in extra or "Proxy" in extra:
            raise DeviceError(
                f"provider host {host.address}: its SSH goes through a gateway ({extra}), "
                "which the backend's direct channel does not; run the controller where the "
                "hosts are reachable (the testbed's frontend)"
            )
        alias = str(host.alias or "")
        name = alias if alias and set(alias) <= BOARD_NAME_CHARACTERS else f"board{rank}"
        board = {
            "name": name,
            "address": host.address,
            "port": int(host.port or 22),
            "user": defaults.user or host.user or "root",
            "key_file": defaults.key_file or host.keyfile,
            "python": defaults.python,
            "interface": defaults.interface,
            "workdir": defaults.workdir.replace("{name}", name),
            "cpus": defaults.cpus,
        }
        peer = _peer_address(host.address)
        if peer != host.address:
            board["data_address"] = peer
        boards.append(Board.model_validate(board))
    return Inventory(
        known_hosts=provider.known_hosts,
        accept_new_host_keys=provider.accept_new_host_keys,
        connect_timeout_s=provider.connect_timeout_s,
        boards=boards,
    )
