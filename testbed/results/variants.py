"""The names and order of method variants and links, shared by the printed answer, the report
and every figure: a variant is a method with its parameters ('trace-b K=1024 level_k=32'), and
variants go in one order (`variant_order`: voltage, prism, astra, trace-nb, trace-b, each by
decreasing tree level), so that a variant has the same place in every table and figure; a link
is a rate with the impairments a run swept (`link_labels`). Gains and compression ratios are
taken against one method, `BASELINE`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from tracevq.method_table import METHODS

METHOD_ORDER = tuple(METHODS)  # the method table's order
MEDIUM_WORDS = {"dedicated": "a line each", "shared": "one shared cell"}
BASELINE = "voltage"  # what the answer's gains and the compression figure compare against


def variant(frame: pd.DataFrame) -> pd.Series:
    """A readable name per method variant: 'trace-b K=1024 level_k=32'."""
    params = frame["params"].astype("string").fillna("").str.replace(",", " ")
    return (frame["method"].astype(str) + " " + params).str.strip()


def variant_order(frame: pd.DataFrame) -> list[str]:
    """The variants of `frame` in the order of every figure: by method (voltage, prism,
    astra, trace-nb, trace-b, then others by name), within one by decreasing tree level
    (level_k, else K), then by name."""
    level = _numbers(frame, "level_k")
    level = level.fillna(_numbers(frame, "K"))
    table = pd.DataFrame(
        {
            "variant": variant(frame),
            "method_rank": frame["method"].map(_method_rank),
            "method": frame["method"].astype(str),
            "minus_level": -level.fillna(np.inf),
        }
    ).drop_duplicates("variant")
    table = table.sort_values(["method_rank", "method", "minus_level", "variant"])
    return list(table["variant"])


def _numbers(frame: pd.DataFrame, column: str) -> pd.Series:
    if column not in frame:
        return pd.Series(np.nan, index=frame.index)
    return pd.to_numeric(frame[column], errors="coerce").astype(float)


def _method_rank(method: str) -> int:
    return METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER)


def link_labels(ok: pd.DataFrame, rate_column: str) -> tuple[pd.Series, list[str]]:
    """Each row's link as the answer and the figures name it ("10 Mbit/s", with its
    impairments where the run swept them, its medium where link.medium did, its fleet where
    devices.variants did) and the
    links in order (rate, one-way delay, then the plan's: the order of link.impairments and
    devices.variants)."""
    rates = ok[rate_column].map(lambda rate: f"{rate:g} Mbit/s")
    words = trial_impairments(ok) if "impairments" in ok else None
    if words is not None and words.nunique() > 1:
        rates = rates + ", " + words.replace("", "no impairment")
    media = ok["medium"].fillna("dedicated").astype(str) if "medium" in ok else None
    if media is not None and media.nunique() > 1:  # link.medium: a line each
        rates = rates + ", " + media.map(MEDIUM_WORDS).fillna(media)
    fleets = ok["fleet"].fillna("").astype(str) if "fleet" in ok else None
    if fleets is not None and fleets.nunique() > 1:  # devices.variants: a line each
        rates = rates + ", " + fleets.replace("", "equal devices")
    labels = rates
    delay = ok["link_delay_ms"].fillna(0) if "link_delay_ms" in ok else 0.0
    order = pd.DataFrame({"label": labels, "rate": ok[rate_column], "delay": delay})
    order["planned"] = ok["planned"] if "planned" in ok else range(len(order))
    order = order.sort_values(["rate", "delay", "planned"]).drop_duplicates("label")
    return labels, list(order["label"])


def trial_impairments(ok: pd.DataFrame) -> pd.Series:
    """Each row's trial's impairments: its devices' uplinks' netem words, one phrase where
    they are all alike, else "device 0: ...; device 1: ..." (link.uplink_impairments)."""
    words = ok["impairments"].fillna("").astype(str)
    if "trial_id" not in ok or "rank" not in ok:
        return words
    by_trial = {}
    for trial, part in ok.assign(words=words).groupby("trial_id"):
        ranks = part.drop_duplicates("rank").sort_values("rank")
        if ranks["words"].nunique() <= 1:
            by_trial[trial] = ranks["words"].iloc[0]
        else:
            by_trial[trial] = "; ".join(
                f"device {rank}: {text or 'none'}"
                for rank, text in zip(ranks["rank"], ranks["words"], strict=True)
            )
    return ok["trial_id"].map(by_trial)


def swept_impairments(ok: pd.DataFrame) -> bool:
    """Whether the rows span several impairment variants (`link.impairments`): figures
    against the rate alone would pool them, the impairment figures take their place."""
    return "impairments" in ok and trial_impairments(ok).nunique() > 1
