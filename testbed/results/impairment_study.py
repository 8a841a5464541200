"""What delay and loss do to each method, from a run that swept them (`link.impairments`).

Delay (`delay_table`, `hidden_delay`): the extended model of communication beside the
measurement. Per message, communication = serialisation (the frames' wire time) + the path's
fixed cost (what a message takes beyond its wire time over the undelayed link) + the one-way
delay. A device waits for a message only as far as it exceeds the message's *window*, the
time from its departure to the moment its receiver needs it: Trace sends block b + 1's message
before block b's FFN, so its window is that FFN and what follows it; Voltage and Prism need
their message at once. So

    wait per message = max(0, serialisation + path + delay - window)

and a method hides a one-way delay up to `window - serialisation - path` (its crossover:
beyond it, every further millisecond of delay costs a millisecond per message). The windows,
FFN times and paths are the run's own (medians over its layers), the prediction is checked
against the measured wait at every delay.

Loss (`loss_table`): per link the median, p95 and p99 of the slowest device's effective
latency with the frames the emulator lost and TCP's retransmissions per inference, and the
share of inferences that had one: a lost segment of a small message has no duplicate ACKs
behind it, so TCP recovers it by a tail-loss probe or a retransmission timeout (200 ms at
least), which shows in the tail, not the median. What makes the tail (`late_messages`): each
message's lateness, its communication beyond its wire time and one-way delay; a message
`LATE_MS` late met a recovery (the path costs 0.1 ms, a stall of the machine a few), one
`RTO_MS` late a retransmission timeout; and the worst repetition's effective latency above
the median beside its latest message.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from testbed.results.stats import tails
from testbed.results.store import Results
from testbed.results.variants import (
    link_labels,
    swept_impairments,
    variant,
    variant_order,
)

KEYS = ["variant", "devices", "bandwidth_mbit"]
LATE_MS = 5.0  # beyond wire time and delay: a loss's recovery, not the path or a stall
RTO_MS = 200.0  # Linux's least retransmission timeout (TCP_RTO_MIN)


def _messages(results: Results) -> pd.DataFrame:
    """The layers that received a message, with their trial's delay and their window."""
    ok = results.ok_trials()
    layers = results.layers
    if layers.empty or "link_delay_ms" not in ok:
        return pd.DataFrame()
    # the delay a device's messages come through: its peers' uplinks' (the slowest's)
    delays = ok.drop_duplicates(["trial_id", "rank"]).set_index(["trial_id", "rank"])
    delays = delays["link_delay_ms"]
    trials = ok[["trial_id", "rank", "repeat"]].drop_duplicates()
    trials["link_delay_ms"] = [
        max((d for (t, r), d in delays.items() if t == trial and r != rank), default=0.0)
        for trial, rank in zip(trials["trial_id"], trials["rank"], strict=True)
    ]
    layers = layers.merge(trials, on=["trial_id", "rank", "repeat"])
    layers = layers[layers["received_bytes"].fillna(0) > 0].copy()
    layers["variant"] = variant(layers)
    layers["window_ms"] = layers["wait_start_ms"] - layers["departed_ms"]
    layers["ffn_ms"] = layers["ffn_end_ms"] - layers["ffn_start_ms"]
    return layers


def delay_table(results: Results) -> pd.DataFrame:
    """Per variant, device count, rate and one-way delay: the medians per message of its
    window, FFN, wire time, communication and wait, the path's cost and the predicted wait.
    Empty where the run did not sweep the delay."""
    if not swept_impairments(results.ok_trials()):
        return pd.DataFrame()
    layers = _messages(results)
    if layers.empty or layers["link_delay_ms"].nunique() < 2:
        return pd.DataFrame()
    columns = ["window_ms", "ffn_ms", "wire_comm_ms", "comm_ms", "wait_ms"]
    table = layers.groupby([*KEYS, "link_delay_ms"])[columns].median().reset_index()
    order = {name: index for index, name in enumerate(variant_order(layers))}
    table.insert(1, "order", table["variant"].map(order))
    table = table.sort_values(["devices", "bandwidth_mbit", "order", "link_delay_ms"])
    path = (layers["comm_ms"] - layers["wire_comm_ms"] - layers["link_delay_ms"]).rename("path")
    least = layers.groupby(KEYS)["link_delay_ms"].transform("min") == layers["link_delay_ms"]
    paths = path[least].groupby([layers[k][least] for k in KEYS]).median().rename("path_ms")
    table = table.join(paths, on=KEYS)
    reach = table["wire_comm_ms"] + table["path_ms"] + table["link_delay_ms"]
    table["predicted_wait_ms"] = np.maximum(0.0, reach - table["window_ms"])
    return table


def hidden_delay(table: pd.DataFrame) -> pd.DataFrame:
    """Per variant, device count and rate: the window, FFN, wire time and path (medians over
    the delays) and the one-way delay it hides (window - wire - path, at least 0)."""
    columns = ["window_ms", "ffn_ms", "wire_comm_ms", "path_ms"]
    hidden = table.groupby([*KEYS, "order"])[columns].median().reset_index()
    reach = hidden["window_ms"] - hidden["wire_comm_ms"] - hidden["path_ms"]
    hidden["hides_ms"] = reach.clip(lower=0.0)
    return hidden.sort_values(["devices", "bandwidth_mbit", "order"]).reset_index(drop=True)


def loss_table(results: Results) -> pd.DataFrame:
    """Per link (rate and impairments) and variant: the slowest device's effective latency
    (median, p95, p99 over repetitions), the lost frames and TCP's retransmissions per
    inference (mean) and the share of inferences with a retransmission. Empty without
    impairments."""
    ok = results.ok_trials()
    if "impairments" not in ok or not ok["impairments"].fillna("").astype(str).str.len().any():
        return pd.DataFrame()
    ok["link"], links = link_labels(ok, "bandwidth_mbit")
    per = ok.groupby(["link", "variant", "devices", "repeat"]).agg(
        effective_ms=("effective_ms", "max"),
        lost=("link_lost_frames", "max"),  # every device's row counts every port
        retransmits=("tcp_retransmits", "sum"),
    )
    per = per.reset_index()
    keys = ["link", "variant", "devices"]
    table = per.groupby(keys).agg(
        n=("effective_ms", "size"),
        effective_ms=("effective_ms", "median"),
        lost_per_inference=("lost", "mean"),
        retransmits_per_inference=("retransmits", "mean"),
        retransmitted_share=("retransmits", lambda r: float((r > 0).mean())),
    )
    table = table.join(tails(per, keys, "effective_ms").set_index(keys)).reset_index()
    links_at = {name: index for index, name in enumerate(links)}
    variants_at = {name: index for index, name in enumerate(variant_order(ok))}
    table["order"] = table["link"].map(links_at) * len(variants_at) + table["variant"].map(
        variants_at
    )
    return table.sort_values(["devices", "order"]).drop(columns="order").reset_index(drop=True)


def late_messages(results: Results) -> pd.DataFrame:
    """Per link and variant: messages sent, those `LATE_MS` and `RTO_MS` late or more (their
    communication beyond wire time and their sender's one-way delay), the median and largest
    lateness of the late ones, and the worst repetition (the slowest device's effective
    latency): how far it and that device's compute are above their medians, and how late
    its latest message was. Empty without impairments."""
    ok = results.ok_trials()
    layers = results.layers
    if layers.empty or "impairments" not in ok or not swept_impairments(ok):
        return pd.DataFrame()
    ok["link"], links = link_labels(ok, "bandwidth_mbit")
    ok["variant"] = variant(ok)
    rows = ok[["trial_id", "rank", "repeat", "link", "variant", "link_delay_ms"]]
    sent = layers[layers["message_bytes"] > 0].merge(rows, on=["trial_id", "rank", "repeat"])
    sent["late_ms"] = sent["comm_ms"] - sent["wire_comm_ms"] - sent["link_delay_ms"].fillna(0.0)
    keys = ["link", "variant", "devices"]
    late = sent[sent["late_ms"] >= LATE_MS]
    table = sent.groupby(keys).agg(messages=("late_ms", "size"))
    table = table.join(
        late.groupby(keys).agg(
            late=("late_ms", "size"),
            timeouts=("late_ms", lambda ms: int((ms >= RTO_MS).sum())),
            late_median_ms=("late_ms", "median"),
            late_max_ms=("late_ms", "max"),
        )
    )
    table[["late", "timeouts"]] = table[["late", "timeouts"]].fillna(0).astype(int)
    slowest = ok.loc[ok.groupby([*keys, "repeat"])["effective_ms"].idxmax()]
    per = slowest.set_index([*keys, "repeat"])[["effective_ms", "compute_ms"]]
    latest = sent.groupby([*keys, "repeat"])["late_ms"].max().rename("latest_ms")
    per = pd.concat([per, latest], axis=1).reset_index()
    for column in ("effective_ms", "compute_ms"):
        median = per.groupby(keys)[column].transform("median")
        per[column.replace("_ms", "_above_ms")] = per[column] - median
    worst = per.loc[per.groupby(keys)["effective_ms"].idxmax()].set_index(keys)
    columns = ["effective_above_ms", "compute_above_ms", "latest_ms"]
    table = table.join(worst[columns].rename(columns=lambda c: f"worst_{c}"))
    table = table.reset_index()
    links_at = {name: index for index, name in enumerate(links)}
    variants_at = {name: index for index, name in enumerate(variant_order(ok))}
    order = table["link"].map(links_at) * len(variants_at) + table["variant"].map(variants_at)
    return table.assign(order=order).sort_values(["devices", "order"]).drop(columns="order")
