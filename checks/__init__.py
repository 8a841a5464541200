"""What the testbed is held against, and the rigs that hold it there: the code that the tests
and the benchmarks share. It sits above `testbed`: it imports `testbed`, `devices` and
`tracevq`, and no library imports it (tests/unit/test_package_layers.py checks both).

- `guest/`: the netem reference guest, Debian's kernel under QEMU with a batch of commands per
  boot (`python -m checks.guest build|run`). It is a reference, not part of a run: no
  backend, emulator or worker uses it, so it is here and not in `testbed.kernel`;
- `netem_conformance`: the serial emulator's draws against netem in the guest, row by row
  (its rows, both samples, the table); `netem_verdicts`: the tests that judge each row, the
  table and its CSV. `python -m bench.netem_conformance` is the command;
- `cell`: devices in network namespaces on one shared serial cell, every device sending bulk
  at once, what each port carried and Jain's index (`python -m bench.cell` and
  tests/integration/test_cell_netns.py);
- `boards`: SSH boards in network namespaces, each running Debian's sshd (the ssh and enoslib
  backends' integration tests, `python -m bench.scale`, `python -m bench.board_channels`);
- `errors`: what these raise, under `testbed.errors.TestbedError`.

Importing the package loads nothing: callers import the module they need.
"""
