"""What runs on a device: the network worker of a P-device sequence-parallel session.

- `devices.spec`: the run spec (one typed file per device: the runs of its session).
- `devices.inputs`: the inputs every device generates (or loads) identically.
- `devices.clock`: the clock of every mark (CLOCK_REALTIME, ns) and the kernel's receive
  timestamps.
- `devices.transport`, `devices.mesh`: the TCP mesh between the P workers; sends from the
  compute thread (a sender thread for what does not fit at once), a receiver thread per peer;
  messages without length prefix; byte counters.
- `devices.handshake`: the once-per-connection agreement (fingerprints, partition, method,
  the run secret's proof) and the clock ping-pong; `devices.frames`: its length-prefixed
  JSON frames, read with bounds, and what each may hold.
- `devices.session`: the inference loop that drives `tracevq.engine.DeviceRun` over the mesh
  and times compute, send and wait per block.
- `devices.records`: the typed records a device writes, and their reader.
- `devices.worker`: the CLI (`python -m devices.worker`).
- `devices.probe`: bulk TCP throughput between two hosts (`python -m devices.probe`).
- `devices.device`: a device's session from set-up to records (mesh, handshake, levels,
  inferences, files).
- `devices.level`: the live choice of a Trace tree level (`level_k: auto`).
- `devices.pace`: a device's speed by dilation, its control file and its progress file.
- `devices.gemm`: the GEMM probe of a device's compute rate (`python -m devices.gemm`).

Depends on `tracevq` only (never on `testbed`).
"""
