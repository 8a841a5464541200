"""What the kernel is asked to do, and nothing about why.

- `tbf`, `netem`, `htb`, `fifo`, `u32`, `ingress`, `ifb`: one qdisc kind (or filter, or
  device) each: its parameters and `tc`/`ip` argument lists (pure functions, as pyroute2
  keeps one module per qdisc).
- `shaping`: one interface's qdiscs for a rate and netem's parameters (the shaping plan);
  the kernel knows no link profile (`netem.LinkImpairments` is what its callers hand it).
- `netlink`: a plan applied, changed in place or cleared inside a network namespace.
- `support`: which qdiscs this kernel can attach (probed once in a throwaway namespace).
- `names`, `netns`, `interfaces`, `addresses`, `processes`: the host plumbing every layer
  above shares, each once: a run's names, network namespaces (entered by `nsenter`), a veth
  into a namespace and interface settings, a run's subnet, processes and process groups.

Importing the package loads nothing: callers import the module they need.
"""
