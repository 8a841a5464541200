"""The testbed orchestrator (docs/architecture.md). Must not import torch at import time.

The folders are the layers. Each module imports only from its own layer or the layers below
it (tests/unit/test_layers.py reads every import against `LAYERS`):

- the command doors: `run` (`python -m testbed.run`), `clean`, `reproduce`, `report` (its
  sections: the paper's tables, delay and loss), `guide`;
- `sweep/`: running an experiment: the trial plan, the preflight, the runner, its sessions;
- `figures/`: the PNG figures of a run directory;
- `results/`: result rows and their columns, the run directory's tables, statistics, the
  printed answer;
- `link/`: the run's links: the emulator table, the serial emulator, rates, the rate probe,
  bandwidth traces and their replay;
- `backends/`: where devices live: the backend table, Docker containers, network namespaces
  on this host, boards over SSH (with their inventory), boards reserved through EnOSlib (with
  their provider); each backend with its own section of the experiment;
- `kernel/`: what the kernel is asked to do: qdisc parameters and the shaping plan, netlink,
  the qdisc probe, network namespaces, interface names, processes;
- `experiment/`: what the user writes: the experiment schema (a backend's own section
  registers in it from the backend's folder), link profiles, device profiles, the accuracy
  study's table of top-1 per level that an experiment names;
- the ground: `errors`, `voice`, `source` (this checkout's folders), `units`, `atomic` (a file
  written whole).
"""

# Top to bottom; a name is a folder or a module directly under testbed/.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("run", "clean", "reproduce", "report", "guide"),
    ("sweep",),
    ("figures",),
    ("results",),
    ("link",),
    ("backends",),
    ("kernel",),
    ("experiment",),
    ("errors", "voice", "source", "units", "atomic"),
)
