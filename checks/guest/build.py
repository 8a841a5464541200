"""The guest's image, built from Debian's packages and cached under `.cache/netem-guest/`.

Two parts, each made once:

- the kernel: Debian's `linux-image-cloud-amd64` (its versioned package, fetched with
  `apt-get download`, the only step that needs a mirror), of which `vmlinuz` and the modules
  the shaping plans need (`MODULES`, with what they depend on) are kept in
  `kernel/<release>/`;
- the initramfs: busybox (its applets: the guest's shell, ping, base64), this host's own `tc`
  and `ip` with their libraries and netem's distribution tables, those modules and the guest's
  `init`. Its file name carries a digest of what went into it, so a host whose iproute2 or
  busybox changed gets a new one (seconds, no network).

The image is what the host has: the guest's `tc` is the one the testbed runs on this host.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import lzma
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from checks.errors import GuestError
from checks.guest import cpio
from testbed.source import CACHE_DIR

log = logging.getLogger(__name__)

GUEST_DIR = CACHE_DIR / "netem-guest"
KERNEL_PACKAGE = "linux-image-cloud-amd64"
# what every shaping plan needs (testbed.kernel.shaping), and the veth the guest's link is
MODULES = ("veth", "ifb", "sch_tbf", "sch_netem", "sch_htb", "sch_ingress", "cls_u32", "act_mirred")
MODULE_PARAMETERS = {"ifb": ["numifbs=0"]}  # no ifb0/ifb1: a plan makes its own
HOST_TOOLS = ("tc", "ip")  # the host's, at /sbin/NAME in the guest (busybox has applets of both)
# the guest's link, up before a batch runs: a veth from `va` in the guest's own namespace to
# `vb` in namespace `b`. Each end knows the other's address for good (a permanent neighbour):
# no ARP crosses the link, so a netem on it never loses or delays a resolution (a lost ARP
# request held the first pings a second, and the queue behind it dropped hundreds). Nor does
# IPv6's, off in both namespaces (no address, so no neighbour discovery, router solicitation
# or MLD): the link carries what a batch sends and nothing else, either way.
LINK_INTERFACE, LINK_ADDRESS, LINK_MAC = "va", "10.9.0.1", "02:00:0a:09:00:01"
PEER_INTERFACE, PEER_ADDRESS, PEER_MAC, PEER_NETNS = "vb", "10.9.0.2", "02:00:0a:09:00:02", "b"
LINK_SETUP = (
    ["sysctl", "-w", "net.ipv6.conf.all.disable_ipv6=1"],
    ["sysctl", "-w", "net.ipv6.conf.default.disable_ipv6=1"],
    ["/sbin/ip", "link", "set", "lo", "up"],
    ["/sbin/ip", "netns", "add", PEER_NETNS],
    ["/sbin/ip", "netns", "exec", PEER_NETNS, "sysctl", "-w", "net.ipv6.conf.all.disable_ipv6=1"],
    ["/sbin/ip", "netns", "exec", PEER_NETNS]
    + ["sysctl", "-w", "net.ipv6.conf.default.disable_ipv6=1"],
    ["/sbin/ip", "link", "add", LINK_INTERFACE, "address", LINK_MAC, "type", "veth"]
    + ["peer", "name", PEER_INTERFACE, "address", PEER_MAC],
    ["/sbin/ip", "link", "set", PEER_INTERFACE, "netns", PEER_NETNS],
    ["/sbin/ip", "addr", "add", f"{LINK_ADDRESS}/24", "dev", LINK_INTERFACE],
    ["/sbin/ip", "-n", PEER_NETNS, "addr", "add", f"{PEER_ADDRESS}/24", "dev", PEER_INTERFACE],
    ["/sbin/ip", "link", "set", LINK_INTERFACE, "up"],
    ["/sbin/ip", "-n", PEER_NETNS, "link", "set", PEER_INTERFACE, "up"],
    ["/sbin/ip", "-n", PEER_NETNS, "link", "set", "lo", "up"],
    ["/sbin/ip", "neigh", "replace", PEER_ADDRESS, "lladdr", PEER_MAC]
    + ["dev", LINK_INTERFACE, "nud", "permanent"],
    ["/sbin/ip", "-n", PEER_NETNS, "neigh", "replace", LINK_ADDRESS, "lladdr", LINK_MAC]
    + ["dev", PEER_INTERFACE, "nud", "permanent"],
)
RESULTS_PORT = "/dev/ttyS1"  # the second serial port; the console is the first
IMAGE_FORMAT = 2  # raised when the initramfs's layout changes: every cached one is rebuilt
COMMAND_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class GuestImage:
    kernel: Path  # vmlinuz
    initramfs: Path  # the base archive; a batch is appended to it
    release: str  # the kernel's `uname -r`


def build(directory: Path = GUEST_DIR) -> GuestImage:
    """The cached image, built first where it is missing or stale (see the module)."""
    kernel_dir = _cached_kernel(directory) or _download_kernel(directory)
    release = kernel_dir.name
    initramfs = _initramfs(directory, kernel_dir)
    return GuestImage(kernel_dir / "vmlinuz", initramfs, release)


def build_problem() -> str | None:
    """Why the guest cannot be built or booted here, or None (a cached kernel makes apt
    unnecessary)."""
    missing = [tool for tool in ("qemu-system-x86_64", "busybox", *HOST_TOOLS) if not _which(tool)]
    if _cached_kernel(GUEST_DIR) is None:
        missing += [tool for tool in ("apt-get", "apt-cache", "dpkg-deb") if not _which(tool)]
    if missing:
        return (
            f"the netem guest needs {', '.join(missing)} (Debian: qemu-system-x86, "
            "busybox-static, iproute2; scripts/host-setup --for-tests installs them)"
        )
    return None


def _which(tool: str) -> str | None:
    return shutil.which(
        tool, path=os.pathsep.join([os.environ.get("PATH", ""), "/sbin", "/usr/sbin"])
    )


def _cached_kernel(directory: Path) -> Path | None:
    found = sorted(directory.glob("kernel/*/kernel.json"), key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


def _download_kernel(directory: Path) -> Path:
    """The versioned package behind `KERNEL_PACKAGE`, fetched and unpacked; its vmlinuz and
    modules kept."""
    began = time.monotonic()
    package = kernel_package(_run(["apt-cache", "depends", KERNEL_PACKAGE], "finding the kernel"))
    with tempfile.TemporaryDirectory(prefix="netem-guest-") as scratch:
        _run(["apt-get", "download", package], f"downloading {package}", cwd=scratch)
        (deb,) = Path(scratch).glob(f"{package}_*.deb")
        unpacked = Path(scratch) / "root"
        _run(["dpkg-deb", "-x", str(deb), str(unpacked)], f"unpacking {deb.name}")
        (modules_root,) = (unpacked / "lib/modules").iterdir()
        release = modules_root.name
        target = directory / "kernel" / release
        shutil.rmtree(target, ignore_errors=True)
        (target / "modules").mkdir(parents=True)
        shutil.copy(unpacked / "boot" / f"vmlinuz-{release}", target / "vmlinuz")
        order = _copy_modules(modules_root, target / "modules")
        manifest = {"package": package, "deb": deb.name, "release": release, "modules": order}
        (target / "kernel.json").write_text(json.dumps(manifest, indent=1) + "\n")
    log.info("guest kernel %s fetched in %.1f s", release, time.monotonic() - began)
    return target


def kernel_package(depends_text: str) -> str:
    """The versioned kernel package in `apt-cache depends linux-image-cloud-amd64`'s output."""
    match = re.search(r"Depends:\s*(linux-image-\S+)", depends_text)
    if match is None:
        raise GuestError(
            f"apt knows no {KERNEL_PACKAGE} (a Debian mirror in /etc/apt and `apt-get update` "
            "make it known)"
        )
    return match.group(1)


def _copy_modules(modules_root: Path, target: Path) -> list[str]:
    """`MODULES` and what they depend on (modinfo's `depends=`), decompressed, in load order."""
    files = {_module_name(path): path for path in modules_root.rglob("*.ko*")}
    order: list[str] = []

    def add(name: str) -> None:
        if name in order:
            return
        if name not in files:
            raise GuestError(f"the guest kernel has no module {name} (in {modules_root})")
        data = _module_bytes(files[name])
        for needed in module_depends(data):
            add(needed)
        (target / f"{name}.ko").write_bytes(data)
        order.append(name)

    for name in MODULES:
        add(name)
    return order


def _module_name(path: Path) -> str:
    return path.name.split(".ko")[0].replace("-", "_")


def _module_bytes(path: Path) -> bytes:
    if path.name.endswith(".ko.xz"):
        return lzma.decompress(path.read_bytes())
    if not path.name.endswith(".ko"):
        raise GuestError(f"{path}: a module compressed in a way busybox's insmod cannot read")
    return path.read_bytes()


def module_depends(module: bytes) -> list[str]:
    """The modules a module needs loaded first (its `.modinfo` `depends=` field)."""
    match = re.search(rb"(?:^|\0)depends=([^\0]*)\0", module)
    if match is None or not match.group(1):
        return []
    return [name.replace("-", "_") for name in match.group(1).decode().split(",")]


def _initramfs(directory: Path, kernel_dir: Path) -> Path:
    """The base archive for this kernel and this host's tools, built when missing."""
    files = _host_files()
    modules = json.loads((kernel_dir / "kernel.json").read_text())["modules"]
    digest = hashlib.sha256(f"{IMAGE_FORMAT}:{kernel_dir.name}:{init_script(modules)}".encode())
    for guest_path, host_path in sorted(files.items()):
        digest.update(guest_path.encode() + b"\0" + Path(host_path).read_bytes())
    path = directory / f"initramfs-{digest.hexdigest()[:16]}.cpio"
    if path.exists():
        return path
    began = time.monotonic()
    entries = _layout(files, modules, kernel_dir / "modules")
    scratch = path.with_suffix(".partial")
    scratch.write_bytes(cpio.archive(entries))
    scratch.replace(path)
    for stale in directory.glob("initramfs-*.cpio"):
        if stale != path:
            stale.unlink()
    log.info("guest initramfs %s built in %.1f s", path.name, time.monotonic() - began)
    return path


def _host_files() -> dict[str, str]:
    """{path in the guest: file on this host}: busybox, tc and ip, the libraries they load,
    netem's distribution tables."""
    busybox = _which("busybox")
    if busybox is None:
        raise GuestError("the netem guest needs busybox (Debian: busybox-static)")
    files = {"bin/busybox": os.path.realpath(busybox)}
    binaries = []
    for tool in HOST_TOOLS:
        found = _which(tool)
        if found is None:
            raise GuestError(f"the netem guest needs this host's `{tool}` (Debian: iproute2)")
        files[f"sbin/{tool}"] = os.path.realpath(found)
        binaries.append(found)
    for library in shared_libraries(_run(["ldd", *binaries, busybox], "", check=False)):
        files[library.lstrip("/")] = os.path.realpath(library)
    tables = glob.glob("/usr/lib/*/tc/*.dist") + glob.glob("/usr/lib/tc/*.dist")
    if not tables:
        raise GuestError("no netem distribution tables (/usr/lib/*/tc/*.dist; Debian: iproute2)")
    files.update({table.lstrip("/"): table for table in tables})
    return files


def shared_libraries(ldd_text: str) -> list[str]:
    """The absolute paths `ldd` resolved (the loader's included), in order, once each."""
    found: list[str] = []
    for line in ldd_text.splitlines():
        match = re.search(r"(?:=>\s*)?(/\S+)\s+\(0x", line)
        if match and match.group(1) not in found:
            found.append(match.group(1))
    return found


def _layout(files: dict[str, str], modules: list[str], modules_dir: Path) -> list[cpio.Entry]:
    """The archive's entries: folders, busybox's applets as links, the host's files, the
    modules and `init`."""
    applets = _run([files["bin/busybox"], "--list"], "listing busybox's applets").split()
    paths = {*files, *(f"lib/guest-modules/{m}.ko" for m in modules), "init", "var/run"}
    paths |= {"dev/", "proc/", "sys/", "tmp/", "run/netns/"}
    folders = {str(parent) for path in paths for parent in Path(path).parents}
    folders |= {path.rstrip("/") for path in paths if path.endswith("/")}
    folders.discard(".")
    entries = [cpio.directory(folder) for folder in sorted(folders)]
    entries.append(cpio.char_device("dev/console", 5, 1))
    entries.append(cpio.symlink("var/run", "../run"))
    for guest_path, host_path in sorted(files.items()):
        entries.append(cpio.regular(guest_path, Path(host_path).read_bytes(), executable=True))
    shadowed = set(HOST_TOOLS) | {"busybox"}
    entries += [cpio.symlink(f"bin/{a}", "busybox") for a in applets if a not in shadowed]
    for name in modules:
        data = (modules_dir / f"{name}.ko").read_bytes()
        entries.append(cpio.regular(f"lib/guest-modules/{name}.ko", data))
    entries.append(cpio.regular("init", init_script(modules).encode(), executable=True))
    return entries


def init_script(modules: list[str]) -> str:
    """The guest's /init (busybox sh): the modules, the link (`LINK_SETUP`), then the batch
    appended as /batch.sh, each command's result on the results port."""
    loads = "\n".join(
        f"insmod /lib/guest-modules/{m}.ko {' '.join(MODULE_PARAMETERS.get(m, []))} "
        f'|| fail "insmod {m}"'
        for m in modules
    )
    setup = "\n".join(f'{" ".join(argv)} || fail "{" ".join(argv)}"' for argv in LINK_SETUP)
    return f"""#!/bin/sh
export PATH=/sbin:/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
fail() {{ echo "@@failed $1" > {RESULTS_PORT}; poweroff -f; }}
report() {{
    {{ echo "@@exit $1 $2"; base64 /tmp/out; echo "@@stderr"; base64 /tmp/err; echo "@@end"; }} \\
        > {RESULTS_PORT}
}}
{loads}
{setup}
echo "@@ready $(uname -r)" > {RESULTS_PORT}
[ -f /batch.sh ] && . /batch.sh
echo "@@done" > {RESULTS_PORT}
poweroff -f
"""


def _run(argv: list[str], doing: str, cwd: str | None = None, check: bool = True) -> str:
    log.debug("guest build: %s", " ".join(argv))
    try:
        result = subprocess.run(
            argv, capture_output=True, text=True, cwd=cwd, timeout=COMMAND_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise GuestError(f"netem guest: {doing}: `{' '.join(argv)}` failed: {error}") from None
    if check and result.returncode != 0:
        tail = " ".join(result.stderr.strip().splitlines()[-2:])
        raise GuestError(f"netem guest: {doing}: `{' '.join(argv)}` failed: {tail}")
    return result.stdout
