"""The trial bar of a run and its estimate of the time left.

A run's trials go in sessions (one per device count and rate, testbed.sweep.sessions). Before a
session has run, all that is known of its cost is its link time: its inferences times the
analytic communication of its slowest device. Once sessions have run, each one's wall time
beyond its link time (compute, model load, handshake, warm-up, probes) is known, and the
estimate of a session still to come is its link time plus the mean of that excess so far.
The bar starts when the first session does, so the set-up before it (codebooks, image,
devices) never counts as a trial's cost.
"""

from __future__ import annotations

import time
from collections.abc import Hashable

from tqdm import tqdm

from testbed import voice


class TrialProgress:
    def __init__(self, name: str, sessions: dict[Hashable, tuple[int, float]]):
        """`sessions`: per session key, its trial count and its link time in seconds."""
        self.name, self.sessions = name, dict(sessions)
        self.excess: list[float] = []  # wall time beyond the link time of finished sessions
        self.bar: tqdm | None = None
        self.started = 0.0

    def expected_s(self, key: Hashable) -> float | None:
        """A session's expected wall time, None before any session has finished."""
        if not self.excess:
            return None
        return self.sessions[key][1] + sum(self.excess) / len(self.excess)

    def remaining(self) -> str:
        link_s = sum(link for _, link in self.sessions.values())
        if not self.excess:
            return f"at least {voice.duration(link_s)} left (link time alone)"
        return f"about {voice.duration(sum(self.expected_s(k) or 0 for k in self.sessions))} left"

    def start(self, key: Hashable, what: str) -> None:
        if self.bar is None:
            total = sum(trials for trials, _ in self.sessions.values())
            self.bar = tqdm(
                total=total,
                desc=self.name,
                unit="trial",
                disable=None if voice.speaking() else True,  # None: only on a terminal
                bar_format="{desc}: {n_fmt}/{total_fmt} trials |{bar}| {elapsed}{postfix}",
            )
        expected = self.expected_s(key)
        guess = (
            f"about {voice.duration(expected)}" if expected else "no estimate before one has run"
        )
        trials, link_s = self.sessions[key]
        link = voice.duration(link_s)
        trials_are = "1 trial" if trials == 1 else f"{trials} trials interleaved"
        voice.say(f"{what}: {trials_are}, {guess} (of it link time {link})")
        self.bar.set_postfix_str(self.remaining())
        self.started = time.monotonic()

    def finish(self, key: Hashable, what: str, outcome: str) -> None:
        elapsed = time.monotonic() - self.started
        trials, link_s = self.sessions.pop(key)
        self.excess.append(max(elapsed - link_s, 0.0))
        voice.say(f"{what}: {outcome} in {voice.duration(elapsed)}")
        assert self.bar is not None
        self.bar.update(trials)
        self.bar.set_postfix_str(self.remaining() if self.sessions else "done")

    def skip(self, key: Hashable, what: str, outcome: str) -> None:
        """A session that could not start: its trials counted, no time learnt from it."""
        trials, _ = self.sessions.pop(key)
        voice.say(f"{what}: {outcome}")
        if self.bar is not None:
            self.bar.update(trials)
            self.bar.set_postfix_str(self.remaining() if self.sessions else "done")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
