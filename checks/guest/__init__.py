"""The netem reference guest: a kernel that has `sch_netem`, for a host whose kernel has not.

Debian's cloud kernel boots under QEMU (TCG) from an initramfs of busybox, this host's own
`tc` and `ip`, netem's distribution tables and the modules every shaping plan needs; one boot
runs a batch of commands and returns each one's exit status and output. It is what the
kernel path of the tbf emulator is held against (the plans `testbed.kernel.shaping` builds,
applied as the backends apply them), not an emulator of its own.

- `build`: the image, from Debian's packages, cached in `.cache/netem-guest/` (the kernel is
  fetched once; nothing after that needs a network);
- `boot`: a batch run in one boot (`run`), its results read back;
- `cpio`: the initramfs format, written from Python;
- `python -m checks.guest run -- CMD ... [-- CMD ...]` runs commands from a shell.

Importing the package loads nothing: callers import the module they need.
"""
