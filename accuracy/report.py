"""Tables and figures of an accuracy study, mirroring the paper's Tables III, VII and VIII,
plus the comparison across codebook sizes that digits needs (README.md, Accuracy; issue 6).

Every table aggregates over seeds: mean, sample standard deviation (the spread quoted as
mean ± std), min, max and the number of seeds. Baselines without codebooks (single, voltage,
prism) are deterministic and appear with n = 1. Written next to `results.csv`:

- `table3_methods.csv` / `fig_methods.png`: each method at each P, finest level, at the main K
  (the largest fine-tuned K) with the default update rule, and the k-means-only codebooks.
- `table_codebook_sizes.csv` / `fig_codebook_sizes.png`: VQ methods across K, both variants.
- `table7_levels.csv` / `fig_levels.png`: Trace at every tree level, per hierarchy metric.
- `table8_rules.csv` / `fig_rules.png`: the codebook update rules.
- `table6_placements.csv` / `fig_placements.png` (studies that list `codebooks.placements`):
  Trace at each Table VI case, finest level, with the test split's 95% sampling interval
  (half-width, binomial) beside the spread over seeds, and the paper's CIFAR-100 figure.
  The other tables keep each family's default placement only.
- `table_kv_error.csv`: per block, the relative error of the K/V receivers reconstruct for a
  peer's tokens (||seen - exact|| / ||exact||), the mechanism behind the accuracy differences.
- `summary.md`: the same tables as Markdown (mean ± std).
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from accuracy.settings import Settings  # noqa: E402
from tracevq.method_table import METHODS, codebook_methods, exact_methods  # noqa: E402
from tracevq.placement import PLACEMENTS, at_default_placement  # noqa: E402


def aggregate(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    grouped = frame.groupby(keys, dropna=False)["accuracy"]
    table = grouped.agg(["mean", "std", "min", "max", "count"]).reset_index()
    table["std"] = table["std"].fillna(0.0)
    return table.rename(columns={"count": "n"})


def label(row: pd.Series) -> str:
    if row["method"] in exact_methods() and row["variant"] != "base":
        return f"{row['method']} (fine-tuned, {row['variant']})"
    if pd.notna(row.get("segment")):  # prism's rows, one per segment size
        return f"{row['method']} (s={int(row['segment'])})"
    if row["method"] in codebook_methods():
        variant = "k-means" if row["variant"] == "kmeans" else f"fine-tuned, {row['variant']}"
        return f"{row['method']} (K={int(row['K'])}, {variant})"
    return str(row["method"])


def _pm(table: pd.DataFrame) -> pd.Series:
    return table.apply(lambda r: f"{r['mean']:.2f} ± {r['std']:.2f}", axis=1)


def _order(row: pd.Series) -> tuple:
    """Baselines first, then each VQ method with its k-means row before the fine-tuned one."""
    segment = row.get("segment")
    return (
        list(METHODS).index(row["method"]),
        0 if pd.isna(segment) else int(segment),
        row["variant"] not in ("base", "kmeans"),
    )


def method_table(frame: pd.DataFrame, main_K: int, rules: list[str]) -> pd.DataFrame:
    """Table III: the baselines, and each codebook method at main_K, k-means and fine-tuned by
    the first of `rules` (and by the others: a method's own recipe)."""
    default_rule = rules[0]
    exact = frame["method"].isin(exact_methods())
    baseline = frame[(frame["variant"] == "base") | (exact & (frame["variant"] == default_rule))]
    vq = frame[
        frame["method"].isin(codebook_methods())
        & (frame["K"] == main_K)
        & (frame["finest"] == True)  # noqa: E712 - pandas element-wise comparison
        & (frame["metric"] == frame["metric"].dropna().iloc[0])
        & frame["variant"].isin(["kmeans", *rules])
    ]
    table = pd.concat([baseline, vq])
    order = {label(row): _order(row) for _, row in table.iterrows()}
    table = table.assign(label=table.apply(label, axis=1))
    result = aggregate(table, ["label", "devices"])
    result["order"] = result["label"].map(order)
    return result.sort_values(["order", "devices"]).drop(columns="order")


def write_report(rows: list[dict[str, object]], settings: Settings, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(rows)
    for column in ("K", "level", "level_k", "segment", "seed"):
        if column in frame:
            frame[column] = frame[column].astype("Int64")
    frame.to_csv(directory / "results.csv", index=False)
    placements = placement_table(frame, settings)
    frame = at_default_placement(frame)
    rules = list(settings.finetune.rules)
    main_K = max(settings.finetune.K) if settings.finetune.K else max(settings.codebooks.K)
    metric = settings.codebooks.metrics[0]
    vq = frame[frame["method"].isin(codebook_methods())]
    finest = vq[(vq["finest"] == True) & (vq["metric"] == metric)]  # noqa: E712
    tables: dict[str, pd.DataFrame] = {}
    own = [name for name, rule in settings.finetune.rules.items() if rule.families is not None]
    tables["table3_methods"] = method_table(frame, main_K, [rules[0], *own])
    tables["table_codebook_sizes"] = aggregate(
        finest[finest["variant"].isin(["kmeans", rules[0]])], ["method", "variant", "K", "devices"]
    )
    levels = vq[(vq["K"] == main_K) & vq["variant"].isin(["kmeans", rules[0]])]
    levels = levels[levels["method"].isin(settings.evaluation.all_levels)]
    tables["table7_levels"] = aggregate(
        levels, ["method", "variant", "metric", "devices", "level", "level_k"]
    )
    tables["table8_rules"] = aggregate(
        finest[(finest["K"] == main_K) & finest["variant"].isin(rules)],
        ["method", "variant", "devices"],
    )
    if placements is not None:
        tables["table6_placements"] = placements
    for name, table in tables.items():
        table.to_csv(directory / f"{name}.csv", index=False)
    kv_error = kv_error_table(directory / "jobs.json")
    if kv_error is not None:
        kv_error.to_csv(directory / "table_kv_error.csv", index=False)
    base = frame[frame["variant"] == "base"]
    single = float(base.loc[base["devices"] == 1, "accuracy"].iloc[0])  # the single device
    header = _noise_note(single, int(frame["test_images"].iloc[0]), settings.data.task)
    _write_markdown(tables, kv_error, directory / "summary.md", header)
    _plot_methods(tables["table3_methods"], single, directory / "fig_methods.png")
    _plot_sizes(tables["table_codebook_sizes"], single, directory / "fig_codebook_sizes.png")
    _plot_levels(tables["table7_levels"], single, directory / "fig_levels.png")
    _plot_rules(tables["table8_rules"], single, directory / "fig_rules.png")
    if placements is not None:
        _plot_placements(placements, single, directory / "fig_placements.png")


def sampling_half_width(accuracy: float, images: int) -> float:
    """The 95% half-width (points) of an accuracy measured on `images` test images (Wilson)."""
    p, z = accuracy / 100, 1.96
    centre_spread = z * math.sqrt(p * (1 - p) / images + z * z / (4 * images * images))
    return 100 * centre_spread / (1 + z * z / images)


def placement_table(frame: pd.DataFrame, settings: Settings) -> pd.DataFrame | None:
    """Table VI: each Trace placement at the finest level with the first metric, per variant,
    K and P; None unless the study lists placements."""
    if not settings.codebooks.placements or "placement" not in frame:
        return None
    rows = frame[
        frame["placement"].notna()
        & (frame["finest"] == True)  # noqa: E712 - pandas element-wise comparison
        & (frame["metric"] == settings.codebooks.metrics[0])
    ]
    rows = rows.assign(case=rows["placement"] + rows["remote_ffn"].map({True: " + FFN", False: ""}))
    table = aggregate(rows, ["method", "case", "placement", "variant", "K", "devices"])
    images = int(frame["test_images"].iloc[0])
    table["sampling_95"] = table["mean"].map(lambda a: sampling_half_width(a, images))
    table["paper"] = [
        PLACEMENTS[p].paper[d - 2] if d in (2, 3) else math.nan
        for p, d in zip(table["placement"], table["devices"], strict=True)
    ]
    table["order"] = table["placement"].map(list(PLACEMENTS).index) + table["case"].str.len() / 100
    return table.sort_values(["variant", "K", "order", "devices"]).drop(columns="order")


def placement_markdown(table: pd.DataFrame) -> pd.DataFrame:
    """Table VI wide: per P, ours as mean ± std over seeds [95% sampling half-width], and the
    paper's."""
    wide = table[["method", "case", "variant", "K"]].drop_duplicates().reset_index(drop=True)
    for devices in sorted(table["devices"].unique()):
        part = table[table["devices"] == devices].set_index(["case", "variant", "K"])
        index = list(zip(wide["case"], wide["variant"], wide["K"], strict=True))
        rows = part.reindex(index)
        wide[f"P={devices}"] = [
            f"{r['mean']:.2f} ± {r['std']:.2f} [±{r['sampling_95']:.2f}]"
            for _, r in rows.iterrows()
        ]
        wide[f"paper P={devices}"] = rows["paper"].to_numpy()
    return wide


def _ranked(part: pd.DataFrame, column: str) -> str:
    ordered = part.sort_values(column, ascending=False)
    pairs = zip(ordered["case"], ordered[column], strict=True)
    return " > ".join(f"{p} {m:.2f}" for p, m in pairs)


def placement_orderings(table: pd.DataFrame) -> list[str]:
    """Per (variant, K, P), the placements from the most to the least accurate, ours and the
    paper's, as Markdown lines."""
    return [
        f"- {variant}, K={K}, P={devices}: ours {_ranked(part, 'mean')}; "
        f"paper {_ranked(part[part['case'] == part['placement']], 'paper')}"
        for (variant, K, devices), part in table.groupby(["variant", "K", "devices"], sort=False)
    ]


def markdown(table: pd.DataFrame) -> str:
    """A pipe table (pandas' own needs the optional `tabulate`)."""
    cells = [[str(c) for c in table.columns]]
    cells += [["" if pd.isna(v) else str(v) for v in row] for row in table.itertuples(index=False)]
    lines = ["| " + " | ".join(row) + " |" for row in cells]
    lines.insert(1, "|" + "---|" * len(table.columns))
    return "\n".join(lines)


def kv_error_table(records_path: Path) -> pd.DataFrame | None:
    """Relative error of the remote K/V per block (mean ± std over seeds), from jobs.json."""
    if not records_path.is_file():
        return None
    records = pd.read_json(records_path)
    if records.empty or "kv_error" not in records:
        return None
    records = records.dropna(subset=["kv_error"]).reset_index(drop=True)  # not the control
    long = records.explode("kv_error").assign(
        block=lambda r: r.groupby(level=0).cumcount(), error=lambda r: r["kv_error"].astype(float)
    )
    keys = ["family", "placement", "remote_ffn"] if "placement" in long else ["family"]
    grouped = long.groupby([*keys, "variant", "K", "block"], dropna=False)["error"]
    table = grouped.agg(["mean", "std"]).reset_index()
    return table.assign(std=table["std"].fillna(0.0))


def _noise_note(single: float, test_size: int, task: str) -> str:
    """The sampling noise of the test split, to read differences against."""
    error = 100.0 * math.sqrt(single / 100 * (1 - single / 100) / test_size)
    return (
        f"{task}: {test_size} test images (one image = {100 / test_size:.2g} points); "
        f"binomial standard error at the single-device accuracy {single:.2f}%: "
        f"{error:.2f} points. Spread below = sample std over seeds."
    )


def _write_markdown(
    tables: dict[str, pd.DataFrame], kv_error: pd.DataFrame | None, path: Path, header: str
) -> None:
    lines = [header, ""]
    for name, table in tables.items():
        if table.empty or name == "table6_placements":
            continue
        shown = table.assign(accuracy=_pm(table)).drop(columns=["mean", "std", "min", "max"])
        pivot_keys = [c for c in shown.columns if c not in ("devices", "accuracy", "n")]
        wide = shown.pivot_table(
            index=pivot_keys, columns="devices", values="accuracy", aggfunc="first", sort=False
        )
        wide.columns = [f"P={p}" for p in wide.columns]
        lines += [f"## {name}", "", markdown(wide.reset_index()), ""]
    if "table6_placements" in tables:
        lines += [
            "## table6_placements",
            "",
            markdown(placement_markdown(tables["table6_placements"])),
            "",
        ]
        lines += ["## Table VI orderings (mean over seeds)", ""]
        lines += [*placement_orderings(tables["table6_placements"]), ""]
    if kv_error is not None:
        shown = kv_error.assign(error=kv_error.apply(lambda r: f"{r['mean']:.3f}", axis=1))
        keys = [c for c in shown.columns if c not in ("block", "mean", "std", "error")]
        wide = shown.pivot_table(
            index=keys, columns="block", values="error", aggfunc="first", dropna=False
        ).dropna(how="all")
        wide.columns = [f"block {b}" for b in wide.columns]
        lines += ["## remote K/V relative error (validation, first P)", ""]
        lines += [markdown(wide.reset_index()), ""]
    path.write_text("\n".join(lines))


def _finish(figure: plt.Figure, axes, single: float, path: Path, ylabel: str = "top-1 (%)"):
    for axis in axes:
        axis.axhline(single, color="k", linestyle="--", linewidth=1, label="single device")
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _by_devices(table: pd.DataFrame):
    devices = sorted(d for d in table["devices"].unique() if d > 1)
    figure, axes = plt.subplots(1, len(devices), figsize=(5.5 * len(devices), 4), squeeze=False)
    return figure, list(axes[0]), devices


def _plot_methods(table: pd.DataFrame, single: float, path: Path) -> None:
    figure, axes, devices = _by_devices(table)
    for axis, p in zip(axes, devices, strict=True):
        part = table[table["devices"] == p]
        axis.barh(part["label"], part["mean"], xerr=part["std"], color="tab:blue", alpha=0.8)
        axis.axvline(single, color="k", linestyle="--", linewidth=1)
        low = max(0.0, part["min"].min() - 5)
        axis.set_xlim(low, 100)
        axis.set_title(f"P = {p}")
        axis.set_xlabel("top-1 (%)")
        axis.tick_params(axis="y", labelsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _plot_sizes(table: pd.DataFrame, single: float, path: Path) -> None:
    figure, axes, devices = _by_devices(table)
    for axis, p in zip(axes, devices, strict=True):
        for (method, variant), part in table[table["devices"] == p].groupby(["method", "variant"]):
            style = "--" if variant == "kmeans" else "-"
            axis.errorbar(
                part["K"],
                part["mean"],
                part["std"],
                linestyle=style,
                marker="o",
                capsize=3,
                label=f"{method} ({variant})",
            )
        axis.set_xscale("log", base=2)
        axis.set_xlabel("codebook size K")
        axis.set_title(f"P = {p}")
    _finish(figure, axes, single, path)


def _plot_levels(table: pd.DataFrame, single: float, path: Path) -> None:
    if table.empty:
        return
    figure, axes, devices = _by_devices(table)
    for axis, p in zip(axes, devices, strict=True):
        part = table[table["devices"] == p]
        for (method, variant, metric), line in part.groupby(["method", "variant", "metric"]):
            style = "--" if variant == "kmeans" else "-"
            axis.errorbar(
                line["level_k"],
                line["mean"],
                line["std"],
                linestyle=style,
                marker=".",
                capsize=2,
                label=f"{method} {variant} {metric}",
            )
        axis.set_xscale("log", base=2)
        axis.set_xlabel("codewords at the level, K_m (r = log2 K_m bits)")
        axis.set_title(f"P = {p}")
    _finish(figure, axes, single, path)


def _plot_placements(table: pd.DataFrame, single: float, path: Path) -> None:
    """Per P, each placement's mean with its spread over seeds, one bar group per
    (variant, K); the paper's figures as black ticks for the ordering (another task)."""
    figure, axes, devices = _by_devices(table)
    groups = list(dict.fromkeys(zip(table["variant"], table["K"], strict=True)))
    width = 0.8 / max(1, len(groups))
    for axis, p in zip(axes, devices, strict=True):
        part = table[table["devices"] == p]
        names = list(dict.fromkeys(part["case"]))  # the table's order
        for g, (variant, K) in enumerate(groups):
            bars = part[(part["variant"] == variant) & (part["K"] == K)].set_index("case")
            bars = bars.reindex(names)
            x = [i + (g - (len(groups) - 1) / 2) * width for i in range(len(names))]
            axis.bar(x, bars["mean"], width, yerr=bars["std"], capsize=3, label=f"K={K}, {variant}")
        axis.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        low = part["min"].min()
        axis.set_ylim(max(0.0, low - 3), min(100.0, max(single, part["max"].max()) + 1))
        axis.set_title(f"P = {p}")
        axis.set_xlabel("Table VI case")
    _finish(figure, axes, single, path)


def _plot_rules(table: pd.DataFrame, single: float, path: Path) -> None:
    if table.empty:
        return
    figure, axes, devices = _by_devices(table)
    for axis, p in zip(axes, devices, strict=True):
        part = table[table["devices"] == p]
        names = part["method"] + " " + part["variant"]
        axis.bar(names, part["mean"], yerr=part["std"], capsize=4, color="tab:green", alpha=0.8)
        axis.set_ylim(max(0.0, part["min"].min() - 5), min(100.0, single + 3))
        axis.set_title(f"P = {p}")
        axis.tick_params(axis="x", labelsize=7, rotation=20)
    _finish(figure, axes, single, path)
