#!/bin/sh
# One device of the docker-compose.yml demo: shape this container's egress (as root, hence
# NET_ADMIN), run the worker as the unprivileged `worker` user (as-worker.sh), keep the
# shaper's counters beside the records. Usage: device.sh RANK RATE_MBIT
set -eu
rank=$1
rate=$2
# Every frame through the token bucket on its own (no GSO super-packets, which tbf would
# drop in pieces on this kind of kernel), and a bucket of two full frames.
ethtool -K eth0 gso off tso off gro off 2>/dev/null || true
ip link set dev eth0 gso_max_segs 1 2>/dev/null || true
tc qdisc replace dev eth0 root tbf rate "${rate}mbit" burst 3028 latency 200ms
sh /compose/as-worker.sh "/results/d${rank}" python -m devices.worker "/compose/d${rank}.yaml"
tc -s qdisc show dev eth0 > "/results/d${rank}/qdisc.txt"
