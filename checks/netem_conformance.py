"""The serial emulator held against the kernel's netem: the same parameters, the same number of
packets, side by side, with a two-sample test per row at 5 %.

The command is the bench's, `python -m bench.netem_conformance [--netns]`
(docs/netem-conformance.md); tests/integration/test_netem_conformance.py runs two rows of it.
The netem reference guest, `checks.guest`, is built first where it is missing. The verdicts
are `checks.netem_verdicts`'.

- netem: one boot of the guest. Per row, `netem_argv` as the root of `va` (the project's own
  words for the parameters) and `--packets` pings, 2 ms apart, from `va` to its peer: netem
  acts on the requests only. Per request: lost (no reply), duplicated (two), reordered (a
  reply faster than half the delay: a reordered request skips it), its delay and the order
  of the replies. A delay row is preceded by a baseline, the same pings through a netem of a
  constant 50 ms: the guest's own overhead (TCG's round trip, 0.3-13 ms, and netem's timer
  firing late) is its median less 50 ms, taken off the row's round trips.
- the serial emulator: the same number of frames drawn from its C core
  (`testbed.link.serial.core.draw`, the Python loop's draws where it cannot be built: the two
  agree frame by frame, tests/unit/test_serial_core.py). These draws are what the emulator
  applies to each frame, so their distributions are the emulator's. Its delays get the
  baseline's deviations from its median added (shuffled), the noise the netem side carries,
  so that both samples are "the draw + the same noise". Its order is its schedule's: a frame
  leaves at max(its arrival + its delay, the previous one's departure), never before an
  earlier one. A caller may add rows of its own beside a row (`conformance`'s `beside`):
  the bench's `--netns` adds the real switch's delays in two network namespaces.

Tests: a count (lost, duplicated, reordered of N) against the emulator's own sampling
distribution of it, EMULATOR_RUNS runs of N frames with their own seeds (two-sided Monte
Carlo: a binomial test would take a bursty or correlated model's spread for a difference);
a chi-square test on the burst lengths (bins merged from the longest down until each holds
10 bursts of both sides together); Kolmogorov-Smirnov two-sample on the delays; Fisher's
exact test on the packets out of order. A row's p is the smallest of its tests.
"""

from __future__ import annotations

import logging
import random
import re
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from checks.errors import GuestError
from checks.guest.boot import Completed, run
from checks.guest.build import LINK_INTERFACE, PEER_ADDRESS
from checks.netem_verdicts import COUNTED, Result, Row, Sample, compare, counted
from testbed.kernel.netem import netem_argv, netem_for
from testbed.link.serial import core
from testbed.link.serial.netem_draws import Copy, Impairments

log = logging.getLogger(__name__)

PING_INTERVAL_S = 0.002
REPLY = re.compile(r"seq=(\d+) ttl=\d+ time=([\d.]+) ms( \(DUP!\))?")


ROWS = (
    Row("random loss 10%", "loss", {"loss_pct": 10}),
    Row("correlated loss 10% 25%", "loss", {"loss_pct": 10, "loss_correlation_pct": 25}),
    Row(
        "Gilbert-Elliott p 5% r 30% 1-h 80% 1-k 1%",
        "loss",
        {"loss_gemodel": {"p_pct": 5, "r_pct": 30, "one_minus_h_pct": 80, "one_minus_k_pct": 1}},
    ),
    Row(
        "4-state p13 3% p31 30% p32 20% p23 50% p14 1%",
        "loss",
        {"loss_state": {"p13_pct": 3, "p31_pct": 30, "p32_pct": 20, "p23_pct": 50, "p14_pct": 1}},
    ),
    Row("duplicate 10%", "duplicate", {"duplicate_pct": 10}),
    Row("duplicate 10% 50%", "duplicate", {"duplicate_pct": 10, "duplicate_correlation_pct": 50}),
    Row(
        "duplicate 10% 50%, with a loss correlation (tc then sends the correlation)",
        "duplicate",
        {
            "duplicate_pct": 10,
            "duplicate_correlation_pct": 50,
            "loss_pct": 0.0001,
            "loss_correlation_pct": 1,
        },
    ),
    Row("reorder 25%, delay 40 ms", "reorder", {"delay_ms": 40, "reorder_pct": 25}),
    Row(
        "reorder 25% 50% gap 5, delay 40 ms",
        "reorder",
        {"delay_ms": 40, "reorder_pct": 25, "reorder_correlation_pct": 50, "reorder_gap": 5},
    ),
    Row("uniform 50 ms ± 20 ms", "delay", {"delay_ms": 50, "jitter_ms": 20}),
    Row(
        "uniform 50 ms ± 20 ms, 75% correlated",
        "delay",
        {"delay_ms": 50, "jitter_ms": 20, "delay_correlation_pct": 75},
    ),
    *(
        Row(
            f"{name} 100 ms, jitter 20 ms",
            "delay",
            {"delay_ms": 100, "jitter_ms": 20, "delay_distribution": name},
        )
        for name in ("normal", "pareto", "paretonormal")
    ),
    Row(
        "normal 100 ms, jitter 20 ms, 50% correlated",
        "delay",
        {
            "delay_ms": 100,
            "jitter_ms": 20,
            "delay_distribution": "normal",
            "delay_correlation_pct": 50,
        },
    ),
    Row("order under uniform 50 ms ± 20 ms", "order", {"delay_ms": 50, "jitter_ms": 20}),
)


# the guest's own overhead, read through a netem that adds a constant delay (so that its
# timer's lateness under TCG is in it, which a bare link's round trip lacks)
BASELINE = Row("baseline", "delay", {"delay_ms": 50})
EMULATOR_RUNS = 200  # per count row: the emulator's sampling distribution of the count
PACKETS_RANGE = (100, 20_000)  # per row, on each side


# netem in the guest --------------------------------------------------------------------------


def guest_commands(rows: Sequence[Row], packets: int) -> list[list[str]]:
    """Per row: netem as `va`'s root, and the pings; a delay row's after its own baseline's
    (the guest's overhead drifts with the host's load)."""
    ping = ["ping", "-c", str(packets), "-i", str(PING_INTERVAL_S), PEER_ADDRESS]
    commands = []
    for row in rows:
        for each in [BASELINE, row] if row.measure == "delay" else [row]:
            netem = netem_for(each.parameters)
            assert netem is not None, each
            commands.append(["tc", "qdisc", "del", "dev", LINK_INTERFACE, "root"])
            commands.append(netem_argv(LINK_INTERFACE, netem, parent="root", handle="1:"))
            commands.append(ping)
    return commands


def replies(output: str) -> list[tuple[int, float]]:
    """(sequence number, round trip ms) of each reply, in the order they arrived."""
    return [(int(m[1]), float(m[2])) for m in REPLY.finditer(output)]


def guest_sample(row: Row, output: str, packets: int, overhead_ms: float) -> Sample:
    arrived = replies(output)
    counts = [0] * packets
    first_ms: dict[int, float] = {}
    out_of_order, latest = 0, -1
    for seq, rtt_ms in arrived:
        counts[seq] += 1
        if seq in first_ms:
            continue
        first_ms[seq] = rtt_ms - overhead_ms
        out_of_order += seq < latest
        latest = max(latest, seq)
    half_delay_ms = row.parameters.get("delay_ms", 0) / 2
    return Sample(
        lost=[c == 0 for c in counts],
        duplicated=[c > 1 for c in counts],
        reordered=[seq in first_ms and first_ms[seq] < half_delay_ms for seq in range(packets)],
        delays_ms=[first_ms[seq] for seq in sorted(first_ms)],
        out_of_order=out_of_order,
    )


# the serial emulator's draws -----------------------------------------------------------------


def serial_draws(parameters: dict[str, Any], seed: int, packets: int) -> list[list[Copy]]:
    """The copies of `packets` frames, from the C core (the Python loop's where it cannot be
    built: the same draws)."""
    drawn = Impairments(parameters, seed)
    library = core.load()
    if library is None:
        return [drawn.frame() for _ in range(packets)]
    handle = core.impairments(library, drawn)
    try:
        return core.draw(library, handle, packets)
    finally:
        library.serial_impairments_free(handle)


def serial_sample(frames: list[list[Copy]], noise_ms: list[float]) -> Sample:
    """The draws as the guest's pings would show them, with the guest's noise on the delays.
    The emulator's schedule keeps frames in order: max(arrival + delay, the previous one's
    departure)."""
    arrived = [copies[-1] for copies in frames if copies]
    return Sample(
        lost=[not copies for copies in frames],
        duplicated=[len(copies) > 1 for copies in frames],
        reordered=[bool(copies) and copies[-1].reordered for copies in frames],
        delays_ms=[c.delay_s * 1e3 + noise_ms[i % len(noise_ms)] for i, c in enumerate(arrived)],
        out_of_order=0,
    )


def run_counts(row: Row, packets: int, seed: int) -> list[int]:
    """The count of EMULATOR_RUNS runs of the emulator over `packets` frames, each its own
    seed: its sampling distribution, bursts and correlations included."""
    seeds = range(seed * EMULATOR_RUNS, (seed + 1) * EMULATOR_RUNS)
    return [
        counted(serial_sample(serial_draws(row.parameters, s, packets), [0.0]), row.measure)
        for s in seeds
    ]


# the table -----------------------------------------------------------------------------------

# a caller's own rows beside one: (row, packets, seed, netem's sample, the guest's noise) to
# the rows to add after it (none for most)
Beside = Callable[[Row, int, int, Sample, list[float]], list[Result]]


def chosen_rows(measures: Sequence[str] | None, packets: int) -> list[Row]:
    """The ROWS of `measures` (all of them for None); ValueError, in one line, on a count of
    packets out of PACKETS_RANGE or a measure no row has."""
    known = {row.measure for row in ROWS}
    wanted = set(measures or known)
    low, high = PACKETS_RANGE
    if low <= packets <= high and wanted <= known:
        return [row for row in ROWS if row.measure in wanted]
    what = f"--packets {packets}" if wanted <= known else f"--rows {list(measures or [])}"
    raise ValueError(f"{what}: packets {low}-{high}, rows of {sorted(known)}")


def conformance(
    rows: Sequence[Row],
    packets: int,
    seed: int,
    boot: Callable[..., list[Completed]] = run,
    beside: Beside | None = None,
) -> list[Result]:
    """Every row through netem in one boot of the guest (`boot`: `checks.guest.boot.run` or a
    caller's with its image) and through the emulator's draws, compared; each followed by
    what `beside` adds to it."""
    results = boot(guest_commands(rows, packets), timeout_s=900)
    failed = [r for r in results if not r.ok and r.argv[2] != "del"]
    if failed:
        raise GuestError(f"in the guest: `{' '.join(failed[0].argv)}`: {failed[0].stderr.strip()}")
    pings = iter(r.stdout for r in results if r.argv[0] == "ping")
    table = []
    for index, row in enumerate(rows):
        overhead_ms, noise_ms = (
            baseline(next(pings), seed) if row.measure == "delay" else (0.0, [0.0])
        )
        netem = guest_sample(row, next(pings), packets, overhead_ms)
        serial = serial_sample(serial_draws(row.parameters, seed + index, packets), noise_ms)
        counts = run_counts(row, packets, seed + index) if row.measure in COUNTED else None
        table.append(compare(row, packets, netem, serial, counts))
        if beside is not None:
            table += beside(row, packets, seed + index, netem, noise_ms)
    return table


def baseline(output: str, seed: int) -> tuple[float, list[float]]:
    """The guest's overhead (the median round trip less the baseline's delay), and each
    round trip's deviation from the median, shuffled (a slow spell of the guest spans several
    pings: in order, it would lend the emulator's delays a correlation of its own)."""
    round_trips = [rtt for _, rtt in replies(output)]
    median_ms = statistics.median(round_trips)
    overhead_ms = median_ms - BASELINE.parameters["delay_ms"]
    log.info("baseline: %d round trips, the guest's own %.2f ms", len(round_trips), overhead_ms)
    noise_ms = [rtt - median_ms for rtt in round_trips]
    random.Random(seed).shuffle(noise_ms)
    return overhead_ms, noise_ms
