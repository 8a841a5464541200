"""What the enoslib backend refuses before anything starts: a provider's configuration that
EnOSlib's own schema refuses, fewer static hosts than devices, a
known_hosts file or a key file that is not there. Nothing is reserved here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from testbed.backends.enoslib import providers
from testbed.backends.enoslib.provider_section import Provider
from testbed.backends.ssh.refusal import known_hosts_refusal
from testbed.errors import ConfigError

if TYPE_CHECKING:
    from testbed.experiment.schema import Experiment


def provider_refusal(experiment: Experiment) -> str | None:
    """Why the experiment's provider cannot carry its devices (one line naming the field), or
    None (also where it gives none: `Backend.refusal` says so first)."""
    provider = experiment.section(Provider.section)
    if not isinstance(provider, Provider):
        return None
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
    refused = known_hosts_refusal(Provider.section, provider, "the hosts' keys")
    if refused is not None:
        return refused
    key_file = provider.boards.key_file
    if key_file is not None and not Path(key_file).is_file():
        return f"provider.boards.key_file: file not found: {key_file}"
    return None
