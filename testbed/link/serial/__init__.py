"""The serial emulator: a userspace link that clocks every frame out at its port's rate.

- `program`: the emulator itself (`python -m testbed.link.serial.program serve ...`), stdlib
  only, run as root in the run's switch namespace;
- `protocol`: what it is told, on its command line and its stdin, parsed;
- `switch`: `SerialSwitch`, which builds the namespace and veth pairs, starts the program and
  talks to it;
- `port`: one port of the switch: its socket, rate, schedule, impairments, counters and
  the Python loop that serves it;
- `core`: the per-frame loop in C (`core.c`, netem's draws in `impair.c`), built on first
  use, which the program runs where gcc is there;
- `netem_draws`: netem's impairment model drawn per frame for one port;
- `emulator`: the serial emulator as the emulator table sees it.
"""
