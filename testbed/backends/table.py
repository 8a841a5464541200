"""The backends, one entry each, and the choice `backend: auto` makes among them.

A backend is a `testbed.backends.base.Backend` subclass whose class attributes say what it
can do; the experiment's `backend` (or `testbed.run --backend`) names one of this table, or
`auto`: the first entry that may be chosen so (`in_auto`) and is `available()` here (Docker
when an engine answers, else the local backend). Adding a backend is its module (or folder:
with its own section of the experiment, a `testbed.experiment.sections.Section`, its rules in
`refusal`, its leftovers) and one entry here.
"""

from __future__ import annotations

import difflib

from testbed.backends.base import BACKENDS, Backend
from testbed.backends.docker.backend import DockerBackend
from testbed.backends.enoslib.backend import EnoslibBackend
from testbed.backends.local import LocalBackend
from testbed.backends.ssh.backend import SshBackend
from testbed.errors import ConfigError, DeviceError

AUTO = "auto"
# the table lives beside the base class, whose refusal names the backends able to do more
BACKENDS.update({b.name: b for b in (DockerBackend, LocalBackend, SshBackend, EnoslibBackend)})


def backend_names() -> list[str]:
    """What `backend` may say: `auto` and every backend of the table."""
    return [AUTO, *BACKENDS]


def backend_class(name: str) -> type[Backend]:
    """The backend `name` names (`auto`: chosen here, now).

    Raises:
        ConfigError: no such backend ("backend: ..."; the caller adds the file).
        DeviceError: `auto`, and no backend that it may take is available.
    """
    if name == AUTO:
        for backend in BACKENDS.values():
            if backend.in_auto and backend.available():
                return backend
        raise DeviceError("backend auto: no backend it may choose is available on this host")
    if name not in BACKENDS:
        hint = difflib.get_close_matches(name, backend_names(), n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(
            f"backend: unknown backend {name!r}{suggestion}; known: {', '.join(backend_names())}"
        )
    return BACKENDS[name]
