"""The `provider:` section of an experiment on the `enoslib` backend: which EnOSlib provider
reserves and describes the boards, and what the boards need that a provider does not say
(their fields, and the host keys' check, are the ssh inventory's own:
`testbed.backends.ssh.inventory`).

The provider's own configuration (`conf`) is EnOSlib's, as its `Configuration.from_dictionary`
takes it (https://discovery.gitlabpages.inria.fr/enoslib/, one page per provider); this file
checks its shape and the rest, and the backend has EnOSlib validate `conf` before anything
starts (`testbed.backends.enoslib.providers`). The hosts of `role`, in the provider's order,
are ranks 0..P-1; they are reached over SSH with their host keys checked against
`known_hosts`, as the ssh backend's boards are. Credentials never go here: each provider reads
them from its usual place (Grid'5000: ~/.python-grid5000.yaml; FIT IoT-LAB: ~/.iotlabrc;
Chameleon: the OpenStack RC variables; FABRIC: its fabric_rc), and a key that looks like one
is refused.

    backend: enoslib
    provider:
      kind: g5k
      known_hosts: ~/.ssh/known_hosts
      boards: {user: root, python: /opt/venv/bin/python}
      conf:
        job_name: trace-testbed
        walltime: "01:00:00"
        job_type: [deploy]
        env_name: debian12-min
        resources:
          machines: [{roles: [devices], cluster: paravance, nodes: 4}]
          networks: [{id: n1, type: prod, roles: [devices], site: rennes}]
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from testbed.backends.ssh.inventory import (
    AcceptNewHostKeys,
    BoardCpus,
    BoardInterface,
    ConnectTimeoutS,
    KeyFile,
    KnownHostsFile,
    WorkerPython,
)
from testbed.experiment.sections import Section
from testbed.experiment.strict import Strict

PROVIDER_KINDS = ("static", "g5k", "iotlab", "chameleon", "fabric")
CREDENTIAL_KEY = re.compile(r"pass(word|phrase)|secret|token|api_?key|credential", re.IGNORECASE)
CREDENTIAL_HOMES = (
    "Grid'5000: ~/.python-grid5000.yaml; FIT IoT-LAB: ~/.iotlabrc; Chameleon: the OpenStack RC "
    "variables; FABRIC: fabric_rc"
)


def _credential_path(data: Any, path: str) -> str | None:
    """The path of the first key anywhere in `data` that names a credential, or None."""
    if isinstance(data, dict):
        for key, value in data.items():
            here = f"{path}.{key}"
            if CREDENTIAL_KEY.search(str(key)):
                return here
            if (found := _credential_path(value, here)) is not None:
                return found
    elif isinstance(data, list):
        for index, value in enumerate(data):
            if (found := _credential_path(value, f"{path}[{index}]")) is not None:
                return found
    return None


class BoardDefaults(Strict):
    """What every board of the provider gets where the provider says nothing (a provider
    gives each host's address, and for some its user, key and port)."""

    user: str | None = Field(None, min_length=1, description="default: the host's, else root")
    key_file: KeyFile = Field(None, description="default: the host's, else ssh-agent, ~/.ssh")
    python: WorkerPython = "python3"
    interface: BoardInterface = "auto"
    workdir: str = Field(
        "~/.cache/trace-testbed/{name}",
        min_length=1,
        description="code and run directories on the board; {name} is the board's name (homes "
        "shared between hosts, as on Grid'5000's NFS, need it)",
    )
    cpus: BoardCpus = None


class Provider(Section):
    """The EnOSlib provider (backend `enoslib`) that reserves the boards, or lists them
    (`static`); its hosts of `role`, in order, are ranks 0..P-1, run over SSH as the ssh
    backend's boards. `conf` is EnOSlib's own configuration of the provider, checked against
    EnOSlib's schema before anything starts; credentials stay where the provider reads them
    (~/.python-grid5000.yaml, ~/.iotlabrc, ...) and are refused here. Examples:
    experiments/enoslib/."""

    section = "provider"
    about = (
        "the EnOSlib provider that reserves or lists the boards (backend enoslib); see "
        "Provider below"
    )
    needed = "an EnOSlib provider (see experiments/enoslib-static.yaml)"

    kind: Literal["static", "g5k", "iotlab", "chameleon", "fabric"] = Field(
        description="EnOSlib's provider: static (hosts you have), g5k, iotlab, chameleon, fabric"
    )
    role: str = Field(
        "devices", min_length=1, description="the role whose hosts are the boards, in order"
    )
    known_hosts: KnownHostsFile
    accept_new_host_keys: AcceptNewHostKeys = False
    connect_timeout_s: ConnectTimeoutS = Field(10.0, description="per SSH connection")
    boards: BoardDefaults = BoardDefaults()
    keep: bool = Field(
        False, description="keep the reservation when the run ends (static: nothing to release)"
    )
    conf: dict[str, Any] = Field(
        description="EnOSlib's configuration of that provider, as its from_dictionary takes it"
    )

    @model_validator(mode="before")
    @classmethod
    def _no_credentials(cls, data: Any) -> Any:
        found = _credential_path(data, "provider")
        if found is not None:
            raise ValueError(
                f"{found}: credentials are not accepted here: the "
                f"provider reads them from its usual place ({CREDENTIAL_HOMES}), and nothing "
                "of them reaches the results"
            )
        return data

    @field_validator("conf")
    @classmethod
    def _has_resources(cls, conf: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(conf.get("resources"), dict):
            raise ValueError(
                "provider.conf.resources: EnOSlib's configuration needs `resources` (machines "
                "and networks)"
            )
        return conf
