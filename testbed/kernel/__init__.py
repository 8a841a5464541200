"""What the kernel is asked to do, and nothing about why.

- `tbf`, `netem`, `htb`, `fifo`, `u32`, `ingress`, `ifb`: one qdisc kind (or filter, or
  device) each: its parameters and `tc`/`ip` argument lists (pure functions, as pyroute2
  keeps one module per qdisc).
- `shaping`: one interface's qdiscs for a profile at a rate (the shaping plan).
- `netlink`: a plan applied, changed in place or cleared inside a network namespace.
- `support`: which qdiscs this kernel can attach (probed once in a throwaway namespace).
- `netns`, `interfaces`, `processes`: network namespaces, interface names and settings,
  processes and commands: the host plumbing every layer above shares.

Importing the package loads nothing: callers import the module they need.
"""
