"""netem's impairment model, drawn per frame for one port of the serial emulator. Stdlib only.

What a frame meets is decided when it reaches its port, in netem's order (`netem_enqueue` in
the kernel's net/sched/sch_netem.c): a duplication draw, a loss draw, then for each copy that
is sent a reorder draw and a delay draw. The numbers are netem's: every probability is a
32-bit threshold (`threshold`, as tc's `get_percent`), correlation is netem's `get_crandom`
(each draw a weighted mean of a fresh one and the last, which narrows the distribution as
netem's does), jitter is uniform on [delay - jitter, delay + jitter) or follows the
distribution tables iproute2 installs for tc (`normal`, `pareto`, `paretonormal`: 4096
values of t, the draw being delay + jitter * t / 8192), and the loss models are netem's
random loss, its Gilbert-Elliott model (`loss gemodel p r 1-h 1-k`) and its 4-state model
(`loss state p13 p31 p32 p23 p14`), with tc's defaults for the parameters left out.

Where this differs from netem, by decision:

- Every draw comes from one `random.Random` per port, seeded by the run (netem seeds its
  generator from the kernel's pool unless `seed` is given, and even then draws the first
  `last` of each correlated generator from the pool): a repeated run with the same seeds and
  the same frames meets the same impairments frame by frame. Frames of different methods
  differ, so they meet different draws from the first frame in which they differ on.
- A drawn delay below zero (jitter larger than the delay) is zero: a frame cannot leave
  before it arrives (netem sends it at once too, without saying so).
- The schedule is netem's with `rate`: a frame that is not reordered leaves at
  max(its arrival + its delay, the previous frame's departure) + its wire time, so jitter
  queues frames behind each other instead of reordering them, and the delay comes before
  the line, as netem puts it. A reordered frame skips the delay: it leaves at its arrival
  plus its own wire time, as if on a path of its own, and does not hold the line for later
  frames (netem sends it at once, ahead of everything queued). A lost frame takes no time
  on the line (netem drops it before it is scheduled); a duplicate takes its own.
"""

from __future__ import annotations

import glob
import os
import random
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from testbed.experiment.netem_parameters import ImpairmentError, checked, impaired

U32 = 1 << 32
DIST_SCALE = 8192  # NETEM_DIST_SCALE: a table value t stands for t / 8192 standard deviations
TC_LIB_DIRS = ("/usr/lib/tc", "/usr/lib64/tc", "/usr/local/lib/tc", "/usr/lib/*/tc")


def threshold(percent: float) -> int:
    """A probability in percent as netem's 32-bit threshold (tc's `get_percent`)."""
    return min(round(percent / 100 * (U32 - 1)), U32 - 1)


class Correlated:
    """netem's `get_crandom`: uniform 32-bit draws, each a mean of a fresh draw and the last
    one, weighted by the correlation."""

    def __init__(self, rng: random.Random, correlation_pct: float = 0.0):
        self.rng, self.rho = rng, threshold(correlation_pct)
        self.last = rng.getrandbits(32)

    def draw(self) -> int:
        value = self.rng.getrandbits(32)
        if self.rho == 0:
            return value
        rho = self.rho + 1
        self.last = (value * (U32 - rho) + self.last * rho) >> 32
        return self.last


def distribution_table(name: str, directories: Sequence[str] = TC_LIB_DIRS) -> list[int]:
    """iproute2's table for `name` (normal, pareto, paretonormal), as tc loads it."""
    override = os.environ.get("TC_LIB_DIR")
    patterns = ([override] if override else []) + list(directories)
    for pattern in patterns:
        for directory in sorted(glob.glob(pattern)):
            path = os.path.join(directory, f"{name}.dist")
            if os.path.isfile(path):
                return _read_table(path)
    raise ImpairmentError(
        f"distribution {name!r}: no {name}.dist in {', '.join(patterns)} (iproute2's tc "
        "installs these tables)"
    )


def _read_table(path: str) -> list[int]:
    values = []
    with open(path) as table:
        for line in table:
            values += [int(word) for word in line.split("#", 1)[0].split()]
    if not values:
        raise ImpairmentError(f"{path}: an empty distribution table")
    return values


class Delay:
    """netem's `tabledist`: delay plus jitter drawn uniformly or from a table, in ns."""

    def __init__(
        self,
        rng: random.Random,
        delay_ns: int,
        jitter_ns: int,
        correlation_pct: float,
        table: list[int] | None,
    ):
        self.mu, self.sigma, self.table = delay_ns, jitter_ns, table
        self.random = Correlated(rng, correlation_pct)

    def draw_ns(self) -> int:
        if self.sigma == 0:
            return self.mu
        rnd = self.random.draw()
        if self.table is None:
            return rnd % (2 * self.sigma) + self.mu - self.sigma
        t = self.table[rnd % len(self.table)]
        x = (self.sigma % DIST_SCALE) * t
        x += DIST_SCALE // 2 if x >= 0 else -(DIST_SCALE // 2)
        return int(x / DIST_SCALE) + (self.sigma // DIST_SCALE) * t + self.mu  # C's division


class RandomLoss:
    """netem's random loss, with its correlation."""

    def __init__(self, rng: random.Random, loss_pct: float, correlation_pct: float = 0.0):
        self.threshold = threshold(loss_pct)
        self.random = Correlated(rng, correlation_pct)

    def lost(self) -> bool:
        return bool(self.threshold) and self.threshold >= self.random.draw()


class GilbertElliott:
    """netem's `loss gemodel p r 1-h 1-k`: a good and a bad state; per frame the state moves
    first (good to bad with p, bad to good with r), then the frame is lost with 1-k in the
    good state and 1-h in the bad one."""

    GOOD, BAD = 1, 2

    def __init__(
        self, rng: random.Random, p: float, r: float, one_minus_h: float, one_minus_k: float
    ):
        self.rng = rng
        self.p, self.r = threshold(p), threshold(r)
        self.h, self.k1 = U32 - 1 - threshold(one_minus_h), threshold(one_minus_k)
        self.state = self.GOOD

    def lost(self) -> bool:
        draw = self.rng.getrandbits
        if self.state == self.GOOD:
            if draw(32) < self.p:
                self.state = self.BAD
            return draw(32) < self.k1
        if draw(32) < self.r:
            self.state = self.GOOD
        return draw(32) > self.h


class FourState:
    """netem's `loss state p13 p31 p32 p23 p14`: gaps (1: sent, 4: an isolated loss) and
    bursts (3: lost, 2: sent within a burst), one draw per frame."""

    SENT_IN_GAP, SENT_IN_BURST, LOST_IN_BURST, LOST_IN_GAP = 1, 2, 3, 4

    def __init__(
        self, rng: random.Random, p13: float, p31: float, p32: float, p23: float, p14: float
    ):
        self.rng = rng
        self.p13, self.p31, self.p32 = threshold(p13), threshold(p31), threshold(p32)
        self.p23, self.p14 = threshold(p23), threshold(p14)
        self.state = self.SENT_IN_GAP

    def lost(self) -> bool:
        rnd = self.rng.getrandbits(32)
        if self.state == self.SENT_IN_GAP:
            if rnd < self.p14:
                self.state = self.LOST_IN_GAP
                return True
            if rnd < self.p13 + self.p14:
                self.state = self.LOST_IN_BURST
                return True
        elif self.state == self.SENT_IN_BURST:
            if rnd < self.p23:
                self.state = self.LOST_IN_BURST
                return True
        elif self.state == self.LOST_IN_BURST:
            if rnd < self.p32:
                self.state = self.SENT_IN_BURST
            elif rnd < self.p31 + self.p32:
                self.state = self.SENT_IN_GAP
            else:
                return True
        else:
            self.state = self.SENT_IN_GAP
        return False


@dataclass(frozen=True)
class Copy:
    """One transmission of a frame: its delay before the line, or reordered (no delay)."""

    delay_s: float
    reordered: bool = False


class Impairments:
    """What frames meet on one port, from a mapping of parameters (as a link profile names
    them: `testbed.experiment.netem_parameters`, which checks them) and a seed; `frame()` decides
    for the next frame."""

    def __init__(self, parameters: Mapping[str, Any], seed: int):
        values = checked(parameters)
        self.parameters, self.seed = values, seed
        self.impairing = impaired(values)
        rng = random.Random(seed)
        distribution = values["delay_distribution"]
        table = None if distribution == "uniform" else distribution_table(str(distribution))
        self.delay = Delay(
            rng,
            round(float(values["delay_ms"]) * 1e6),
            round(float(values["jitter_ms"]) * 1e6),
            float(values["delay_correlation_pct"]),
            table,
        )
        self.loss = loss_model(rng, values)
        self.duplicate = threshold(float(values["duplicate_pct"]))
        self.duplicate_random = Correlated(rng, float(values["duplicate_correlation_pct"]))
        self.reorder = threshold(float(values["reorder_pct"]))
        self.reorder_random = Correlated(rng, float(values["reorder_correlation_pct"]))
        self.gap = int(values["reorder_gap"] or (1 if self.reorder else 0))
        self.counter = 0
        self.lock = threading.Lock()  # for a hop that several ports' threads draw from
        # the longest delay it may draw: a table's tail reaches max |t| / 8192 jitters
        reach = 1.0 if table is None else max(map(abs, table)) / DIST_SCALE
        self.max_delay_s = (float(values["delay_ms"]) + float(values["jitter_ms"]) * reach) / 1e3

    def frame(self) -> list[Copy]:
        """The copies of the next frame that are sent (none: it is lost), in the order netem
        schedules them (a duplicate before the original)."""
        count = 1
        if self.duplicate and self.duplicate >= self.duplicate_random.draw():
            count += 1
        if self.loss is not None and self.loss.lost():
            count -= 1
        copies = []
        if count > 1 and not (self.loss is not None and self.loss.lost()):
            copies.append(self._path())  # the duplicate: its own loss, reorder and delay
        if count > 0:
            copies.append(self._path())
        return copies

    def _path(self) -> Copy:
        """netem's reorder decision, then the delay of a frame that is not reordered."""
        if (
            self.gap == 0
            or self.counter < self.gap - 1
            or self.reorder < self.reorder_random.draw()
        ):
            self.counter += 1
            return Copy(max(self.delay.draw_ns(), 0) / 1e9)
        self.counter = 0
        return Copy(0.0, reordered=True)


LossModel = RandomLoss | GilbertElliott | FourState


def loss_model(rng: random.Random, values: Mapping[str, Any]) -> LossModel | None:
    """The loss model checked parameters name; None where nothing is lost."""
    if values["loss_model"] == "gemodel":
        ge = values["loss_gemodel"]
        return GilbertElliott(
            rng, ge["p_pct"], ge["r_pct"], ge["one_minus_h_pct"], ge["one_minus_k_pct"]
        )
    if values["loss_model"] == "state":
        s = values["loss_state"]
        return FourState(rng, s["p13_pct"], s["p31_pct"], s["p32_pct"], s["p23_pct"], s["p14_pct"])
    if values["loss_pct"] > 0:
        return RandomLoss(rng, values["loss_pct"], values["loss_correlation_pct"])
    return None
