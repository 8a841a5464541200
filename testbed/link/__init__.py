"""The links between devices: what shapes them, what measures them, what replays a trace.

One module per concept, as pyroute2 keeps one per qdisc:
- `tbf`, `netem`, `htb`, `fifo`, `u32`, `ingress`, `ifb`: a qdisc kind's (or filter's, or
  device's) parameters and `tc`/`ip` argv from rates or a profile (pure, no kernel).
- `plan`: one interface's qdiscs for a profile at a rate, as `tc` argv and pyroute2 keywords:
  a root tbf (and netem), or an htb with per-peer classes, and an ifb for a downlink.
- `rates`: a trial's uplinks, downlinks and pair caps, and the transfers that probe them.
- `support`: which qdiscs this kernel can attach (probed once in a throwaway namespace).
- `netlink`: a plan applied, changed in place or cleared inside a device's namespace.
- `probe`: the achieved rate between two devices, measured by the receiver.
- `links`: `Links`, a run's links under one emulator (tbf or serial), shaped then probed.
  (The serial emulator itself is `testbed.serial_switch` and `testbed.serial_link`.)
- `traces`, `replay`: a rate over time, read or generated, and played on live links.

Importing the package loads neither pyroute2 nor the backends: callers import the module
they need.
"""
