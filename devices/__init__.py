"""What runs on a device: the network worker of a P-device sequence-parallel session.

- `devices.spec`: the run spec (a typed file and/or CLI flags), loaded in one place.
- `devices.inputs`: the inputs every device generates (or loads) identically.
- `devices.transport`: the TCP mesh between the P workers; per-peer sender and receiver
  threads; messages without length prefix; byte counters.
- `devices.handshake`: the once-per-connection agreement (fingerprints, partition, method)
  and the clock ping-pong.
- `devices.session`: the inference loop that drives `tracevq.engine.DeviceRun` over the mesh
  and times compute, send and wait per block.
- `devices.records`: the CSV / JSON records a device writes.
- `devices.worker`: the CLI (`python -m devices.worker`).
- `devices.probe`: bulk TCP throughput between two hosts (`python -m devices.probe`).

Depends on `tracevq` only (never on `testbed`).
"""
