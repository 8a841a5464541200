"""The links between a run's devices: what emulates them, what measures them, what replays a
trace.

- `links`: `Links`, a run's links under one emulator, shaped at a trial's rates and probed.
- `emulator`, `emulators`: the `Emulator` interface and the table of emulators (`tbf`, the
  kernel's token bucket, in `token_bucket`; `serial`, the userspace serial link, in `serial/`).
- `rates`: a trial's uplinks, downlinks and pair caps, and the transfers that probe them.
- `probe`: the achieved rate between two devices, measured by the receiver.
- `wire`: the arithmetic of frames on a link (segments, frames, wire times, queues).
- `traces`, `replay`: a rate over time, read or generated, and played on live links.

Importing the package loads nothing: callers import the module they need.
"""
