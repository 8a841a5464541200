"""Figures of a run, as PNG files readable without the code.

- latency.png: compute / communication / effective latency per method at one bandwidth
  (the paper's Fig. 5 kind);
- comm_vs_bandwidth.png: communication latency against bandwidth, log axes (Fig. 6 kind);
- compression.png: payload compression ratio against Voltage per method and level (Fig. 7);
- measured_vs_analytic.png: measured communication against payload bits / link rate.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from testbed.results import Results  # noqa: E402


def variant(frame: pd.DataFrame) -> pd.Series:
    """A readable name per method variant: 'trace-b K=1024 level_k=32'."""
    params = frame["params"].fillna("").str.replace(",", " ")
    return (frame["method"] + " " + params).str.strip()


def _ok(results: Results) -> pd.DataFrame:
    trials = results.trials
    ok = trials[trials["status"] == "ok"].copy()
    ok["variant"] = variant(ok)
    return ok


def latency_breakdown(
    results: Results, path: Path, bandwidth_mbit: float | None = None
) -> Path | None:
    ok = _ok(results)
    if ok.empty:
        return None
    if bandwidth_mbit is None:
        rates = sorted(ok["bandwidth_mbit"].unique())
        bandwidth_mbit = 10.0 if 10.0 in rates else rates[len(rates) // 2]
    at = ok[ok["bandwidth_mbit"] == bandwidth_mbit]
    table = at.groupby(["variant", "devices"])[["compute_ms", "effective_ms"]].mean()
    table = table.sort_values("effective_ms")
    labels = [f"{v} (P={p})" for v, p in table.index]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(table) + 1.5))
    ax.barh(labels, table["compute_ms"], color="#2f5d8a", label="compute")
    ax.barh(
        labels,
        table["effective_ms"] - table["compute_ms"],
        left=table["compute_ms"],
        color="#9cc3e6",
        label="waiting for peers (the link, or a slower peer)",
    )
    ax.set_xlabel("effective latency per inference (ms)")
    ax.set_title(f"Per-device latency at {bandwidth_mbit:g} Mbit/s")
    ax.legend(loc="lower right")
    return _save(fig, path)


def comm_vs_bandwidth(results: Results, path: Path) -> Path | None:
    ok = _ok(results)
    if ok.empty or ok["bandwidth_mbit"].nunique() < 2:
        return None
    table = ok.groupby(["variant", "bandwidth_mbit"])["comm_ms"].mean().unstack(0)
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in table.columns:
        ax.plot(table.index, table[name].clip(lower=1e-3), marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate (Mbit/s, tc convention: 10^6 bit/s)")
    ax.set_ylabel("communication per inference (ms, log)")
    ax.set_title("Communication latency against bandwidth")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, path)


def compression(results: Results, path: Path) -> Path | None:
    plan = results.plan
    if plan.empty or "voltage" not in set(plan["method"]):
        return None
    plan = plan[plan["rank"] == 0].copy()
    plan["variant"] = variant(plan)
    table = plan.groupby(["variant", "devices"])["payload_bits_per_layer"].mean().reset_index()
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(table) + 1.5))
    for devices, group in table.groupby("devices"):
        voltage = group.loc[group["variant"] == "voltage", "payload_bits_per_layer"]
        if voltage.empty:
            continue
        ratio = voltage.iloc[0] / group["payload_bits_per_layer"]
        bars = ax.barh([f"{v} (P={devices})" for v in group["variant"]], ratio)
        ax.bar_label(bars, labels=[f"{r:,.0f}x" for r in ratio], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("compression ratio against Voltage (payload bits per layer, log)")
    ax.set_title("Compression ratio")
    return _save(fig, path)


def measured_vs_analytic(results: Results, path: Path) -> Path | None:
    ok = _ok(results)
    ok = ok[ok["analytic_comm_ms"] > 0]
    if ok.empty:
        return None
    table = ok.groupby(["variant", "bandwidth_mbit"])[["analytic_comm_ms", "comm_ms"]].mean()
    fig, ax = plt.subplots(figsize=(6, 6))
    for name, group in table.groupby(level=0):
        ax.scatter(group["analytic_comm_ms"], group["comm_ms"].clip(lower=1e-3), label=name)
    low = min(table["analytic_comm_ms"].min(), table["comm_ms"].clip(lower=1e-3).min())
    high = max(table["analytic_comm_ms"].max(), table["comm_ms"].max())
    ax.plot([low, high], [low, high], color="grey", linestyle="--", label="measured = analytic")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("analytic: payload bits / link rate (ms)")
    ax.set_ylabel("measured: queued to last peer's arrival (ms)")
    ax.set_title("Measured against analytic communication")
    ax.legend(fontsize=7)
    return _save(fig, path)


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def make_figures(results: Results) -> list[Path]:
    directory = results.run_dir / "figures"
    made = [
        latency_breakdown(results, directory / "latency.png"),
        comm_vs_bandwidth(results, directory / "comm_vs_bandwidth.png"),
        compression(results, directory / "compression.png"),
        measured_vs_analytic(results, directory / "measured_vs_analytic.png"),
    ]
    return [p for p in made if p is not None]
