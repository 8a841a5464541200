"""Which qdiscs this kernel can attach: each tried once in a throwaway network namespace; and
whether this host's `tc` takes netem's `seed`.

A plan that needs a qdisc the kernel lacks fails with a message saying so
(`testbed.kernel.shaping.check_support`): an impairment is never dropped silently.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import subprocess
from typing import Any

from testbed.errors import ShapingError
from testbed.kernel.netem import TC_SEED_PROBE_ARGV, tc_takes_netem_seed
from testbed.kernel.netns import NETNS_DIR
from testbed.kernel.processes import COMMAND_TIMEOUT_S, pid_alive
from testbed.kernel.tbf import TBF_HANDLE

log = logging.getLogger(__name__)

ROOT = 0xFFFFFFFF
PROBED_QDISCS = ("tbf", "htb", "netem", "ingress")
PROBE_PREFIX = "tbprobe-"  # + the probing process's pid + 6 hex digits


def qdisc_support() -> dict[str, bool]:
    """Which of tbf, htb, netem and ingress this kernel can attach (probed once, then cached).

    Each qdisc is added to the loopback interface of a throwaway network namespace, then
    removed with the namespace (loopback needs no module, unlike dummy, which some kernels
    lack). Raises ShapingError when the probe itself cannot run (no root, no pyroute2).
    """
    return dict(_probe_qdiscs())


@functools.cache
def _probe_qdiscs() -> tuple[tuple[str, bool], ...]:
    try:
        from pyroute2 import IPRoute, NetlinkError, netns
    except ImportError as error:
        raise ShapingError(f"cannot probe qdisc support: pyroute2 is missing ({error})") from None
    name = f"{PROBE_PREFIX}{os.getpid()}-{os.urandom(3).hex()}"
    try:
        netns.create(name)
    except OSError as error:
        raise ShapingError(
            f"cannot probe qdisc support: creating a netns failed ({error})"
        ) from None
    log.debug("probe: created netns %s", name)
    found: dict[str, bool] = {}
    try:
        with IPRoute(netns=name, flags=0) as ipr:
            index = ipr.link_lookup(ifname="lo")[0]
            for kind in PROBED_QDISCS:
                found[kind] = _try_qdisc(ipr, NetlinkError, index, kind)
    except OSError as error:
        raise ShapingError(f"cannot probe qdisc support in netns {name}: {error}") from None
    finally:
        try:
            netns.remove(name)
            log.debug("probe: removed netns %s", name)
        except OSError as error:
            log.warning("probe: could not remove netns %s: %s", name, error)
    log.info("qdisc support: %s", found)
    return tuple(found.items())


def _try_qdisc(ipr: Any, netlink_error: type[Exception], index: int, kind: str) -> bool:
    keywords: dict[str, Any] = {
        "tbf": {"handle": TBF_HANDLE, "rate": "1000000bit", "burst": 8000, "limit": 16000},
        "htb": {"handle": TBF_HANDLE, "default": 0},
        "netem": {"handle": TBF_HANDLE, "delay": 1000},
        "ingress": {},
    }[kind]
    try:
        ipr.tc("add", kind, index, **keywords)
    except netlink_error as error:
        code = getattr(error, "code", None)
        if code == errno.EPERM:
            raise ShapingError(f"cannot probe qdisc {kind}: permission denied") from None
        log.debug("probe: qdisc %s unavailable (%s)", kind, error)
        return False
    log.debug("probe: qdisc %s available", kind)
    try:  # the next kind is added where this one sits
        if kind == "ingress":
            ipr.tc("del", "ingress", index)
        else:
            ipr.tc("del", index=index, parent=ROOT)
    except netlink_error as error:
        raise ShapingError(f"cannot probe qdiscs: removing {kind} failed ({error})") from None
    return True


def stale_probe_namespaces() -> list[str]:
    """Probe namespaces whose process is gone (killed between create and remove)."""
    try:
        names = os.listdir(NETNS_DIR)
    except OSError:
        return []
    stale = []
    for name in names:
        pid = name.removeprefix(PROBE_PREFIX).split("-")[0]
        if name.startswith(PROBE_PREFIX) and pid.isdigit() and not pid_alive(int(pid)):
            stale.append(name)
    return sorted(stale)


def remove_stale_probes() -> list[str]:
    """Removes `stale_probe_namespaces()`; returns what it removed ("netns NAME")."""
    from pyroute2 import netns

    removed = []
    for name in stale_probe_namespaces():
        try:
            netns.remove(name)
        except OSError as error:
            log.warning("could not remove the probe's netns %s: %s", name, error)
            continue
        removed.append(f"netns {name}")
    return removed


@functools.cache
def netem_takes_seed() -> bool:
    """Whether this host's `tc` takes netem's `seed` (iproute2 6.5 and later): asked once, of
    tc alone (`TC_SEED_PROBE_ARGV` adds nothing and needs no privilege)."""
    try:
        result = subprocess.run(
            TC_SEED_PROBE_ARGV, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        log.debug("tc's netem seed: cannot ask tc (%s)", error)
        return False
    takes = tc_takes_netem_seed(result.stdout + result.stderr)
    log.debug("tc's netem seed: %s", "taken" if takes else "not known to this tc")
    return takes
