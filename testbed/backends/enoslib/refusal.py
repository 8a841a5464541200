"""What the enoslib backend refuses before anything starts: no provider, a provider's
configuration that EnOSlib's own schema refuses, fewer static hosts than devices, a
known_hosts file or a key file that is not there. Nothing is reserved here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from testbed.backends.enoslib import providers
from testbed.errors import ConfigError
from testbed.experiment.provider import Provider

if TYPE_CHECKING:
    from testbed.experiment.schema import Experiment


def provider_refusal(experiment: Experiment, backend: str) -> str | None:
    """Why `backend` cannot run on the experiment's provider (one line naming the field), or
    None."""
    provider = experiment.section(Provider.section)
    if not isinstance(provider, Provider):
        return (
            f"provider: backend '{backend}' needs an EnOSlib provider (see "
            "experiments/enoslib-static.yaml)"
        )
    try:
        providers.check(provider)
    except ConfigError as error:
        return str(error)
    most, listed = max(experiment.devices.count), providers.static_host_count(provider)
    if listed is not None and most > listed:
        return (
            f"devices.count: {most} devices, but the static provider lists {listed} hosts in "
            f"role {provider.role} (one device per host)"
        )
    if not provider.accept_new_host_keys and not Path(provider.known_hosts).is_file():
        return (
            f"provider.known_hosts: file not found: {provider.known_hosts}; record the hosts' "
            "keys (`ssh-keyscan -p PORT ADDRESS >> FILE`), or say accept_new_host_keys: true "
            "for a first connection"
        )
    key_file = provider.boards.key_file
    if key_file is not None and not Path(key_file).is_file():
        return f"provider.boards.key_file: file not found: {key_file}"
    return None
