"""Running an experiment: the trial plan (`plan`), the checks against this host (`preflight`),
the files devices load (`bundles`), the runner that starts devices, shapes links and runs one
worker session per device count and rate (`runner`, `sessions`), and what a run holds while it
runs: its lock (`lock`), its progress bar (`progress`), Ctrl-C (`interrupts`) and the facts of
its environment (`environment`).
"""
