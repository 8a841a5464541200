"""A bandwidth trace played on live links: at each of its steps a thread sets the rate of
every device's uplink in place (`Links.set_rate`: the serial emulator's `rate` command, or
`tc qdisc change` on tbf; never a delete and re-add, which would leave the link unshaped for
a moment), and the step's delay and loss where the trace gives them. What was set and when
(CLOCK_REALTIME, the clock of the workers' records) is kept, so the rate and impairments in
force at any instant of a session are known from what was applied, not from what was meant.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable

from testbed.errors import ShapingError
from testbed.link.traces import RateTrace


class TraceReplay:
    def __init__(self, set_rate: Callable[..., None], trace: RateTrace, dilation: float = 1.0):
        """`set_rate(rate_mbit)`, or for a trace with impairments `set_rate(rate_mbit,
        impairments, step)` (`Links.set_rate`); `dilation`: the session's, which makes
        every step that many times as long on the host."""
        self.set_rate, self.trace, self.dilation = set_rate, trace, dilation
        self.asked_ns: list[int] = []  # when each change was started
        self.applied_ns: list[int] = []  # when each rate was in force (the change returned)
        self.applied_mbit: list[float] = []
        self.applied_impairments: list[dict[str, float]] = []
        self.applied_words: list[dict[int, str]] = []  # by rank, netem's words after each
        self.start_ns = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> TraceReplay:
        """The first step now, then each later one at its time from now."""
        self.start_ns = time.time_ns()
        self._apply(0.0, self.trace.rates_mbit[0])
        self._thread = threading.Thread(target=self._run, name="trace-replay", daemon=True)
        self._thread.start()
        return self

    def _apply(self, at_s: float, rate_mbit: float) -> None:
        self.asked_ns.append(time.time_ns())
        if self.trace.impairments:
            impairments = self.trace.impairments_at(at_s)
            words = self.set_rate(rate_mbit, impairments, len(self.applied_ns))
            self.applied_impairments.append(impairments)
            self.applied_words.append(words or {})
        else:
            self.set_rate(rate_mbit)
        self.applied_ns.append(time.time_ns())
        self.applied_mbit.append(rate_mbit)

    def _run(self) -> None:
        steps = self.trace.changes(0.0)
        next(steps)  # applied by start()
        try:
            for at_s, rate in steps:
                delay = self.start_ns / 1e9 + at_s * self.dilation - time.time()
                if self._stop.wait(max(delay, 0.0)):
                    return
                self._apply(at_s, rate)
        except BaseException as error:  # noqa: BLE001 - re-raised by stop()
            self._error = error

    def rate_at_ns(self, ns: int) -> float | None:
        """The rate applied at CLOCK_REALTIME `ns` (None before the replay started)."""
        index = bisect.bisect_right(self.applied_ns, ns) - 1
        return self.applied_mbit[index] if index >= 0 else None

    def impairments_at_ns(self, ns: int) -> dict[str, float]:
        """The trace's impairments applied at CLOCK_REALTIME `ns` (empty where none)."""
        index = bisect.bisect_right(self.applied_ns, ns) - 1
        return self.applied_impairments[index] if index >= 0 and self.applied_impairments else {}

    def words_at_ns(self, ns: int, rank: int) -> str | None:
        """Netem's words for `rank`'s uplink as applied at `ns` (None where the trace gives
        no impairments, or before the replay started)."""
        index = bisect.bisect_right(self.applied_ns, ns) - 1
        return self.applied_words[index].get(rank) if index >= 0 and self.applied_words else None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise ShapingError(f"replaying trace {self.trace.name}: {error}") from error

    def __enter__(self) -> TraceReplay:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
