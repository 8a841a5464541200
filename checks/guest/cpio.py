"""The initramfs format (cpio "newc", as the kernel unpacks it): directories, files, symlinks
and character devices written from Python, so the guest needs no `cpio` tool. Archives may
be concatenated: the kernel unpacks one after the other into the same root, which is how a
batch of commands is laid over the cached image without rebuilding it. Standard library only.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass

MAGIC = b"070701"
TRAILER = "TRAILER!!!"


@dataclass(frozen=True)
class Entry:
    """One member: its path in the guest (no leading slash), mode (type and permissions),
    content (a symlink's target for a link), and a device's (major, minor)."""

    path: str
    mode: int
    data: bytes = b""
    device: tuple[int, int] = (0, 0)


def directory(path: str) -> Entry:
    return Entry(path, stat.S_IFDIR | 0o755)


def regular(path: str, data: bytes, executable: bool = False) -> Entry:
    return Entry(path, stat.S_IFREG | (0o755 if executable else 0o644), data)


def symlink(path: str, target: str) -> Entry:
    return Entry(path, stat.S_IFLNK | 0o777, target.encode())


def char_device(path: str, major: int, minor: int) -> Entry:
    return Entry(path, stat.S_IFCHR | 0o600, device=(major, minor))


def archive(entries: list[Entry]) -> bytes:
    """The entries as one newc archive, trailer included."""
    parts = [_member(inode, entry) for inode, entry in enumerate(entries, start=1)]
    parts.append(_member(0, Entry(TRAILER, 0)))
    return b"".join(parts)


def _member(inode: int, entry: Entry) -> bytes:
    name = entry.path.encode() + b"\0"
    nlink = 2 if stat.S_ISDIR(entry.mode) else 1
    fields = (inode, entry.mode, 0, 0, nlink, 0, len(entry.data), 0, 0, *entry.device)
    fields += (len(name), 0)  # name size (with its NUL), checksum (unused by newc)
    header = MAGIC + b"".join(b"%08x" % value for value in fields)
    return _padded(header + name) + _padded(entry.data)


def _padded(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 4)
