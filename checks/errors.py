"""Errors of the checks: `TestbedError`s (a CLI prints the message and exits 1), each naming
what it could not build or start."""

from testbed.errors import TestbedError


class GuestError(TestbedError):
    """The netem reference guest could not be built or booted, or a batch did not finish."""


class LabError(TestbedError):
    """The SSH boards in network namespaces could not be built (a missing tool, an sshd that
    did not come up)."""
