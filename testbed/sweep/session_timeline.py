"""The experiment's timeline played on one session's devices (testbed.experiment.timeline_section).

Each device of the session has a control file (`devices.pace`: its speed, and how many of its
holds the orchestrator has released), written here before its worker starts, and reports in
its output folder which measured round it starts (`progress`). One thread of ours polls those
every POLL_S and acts:

- the session's clock starts when device 0 starts its first measured round; an event `at_s`
  is applied at that start plus at_s (its delay after the moment asked for is kept);
- an event `at_inference: i` is in the worker's holds: the device stops before round i until
  released; the thread applies the event, then releases it, so the event is in force for the
  whole of round i and nothing of it runs before;
- speed: the control file's speed; pause: the device frozen (`Backend.pause`), thawed
  pause_s later; leave: the worker sent SIGTERM (its finished inferences are kept); link: the
  device's uplink changed in place (`Links.set_device`).

What was applied and when (CLOCK_REALTIME, the workers' clock on this host) is kept as
`AppliedEvent`s for the rows; events the session ended before are kept as missed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from devices.pace import PROGRESS_FILE, read_progress, write_control
from testbed.backends.base import Backend, Device, Process
from testbed.errors import TestbedError
from testbed.experiment.timeline_section import Event
from testbed.results.facts import AppliedEvent

log = logging.getLogger(__name__)

POLL_S = 0.002
CONTROL_FILE = "control"


@dataclass
class Hands:
    """What the timeline can do to a session's devices."""

    backend: Backend
    devices: list[Device]  # by rank
    set_link: Callable[[int, dict[str, object]], str]  # Links.set_device
    processes: list[Process] | None = None  # the workers, once started


class SessionTimeline:
    """The events of a session with `count` devices; `directory` is the session's folder."""

    def __init__(
        self,
        events: list[Event],
        count: int,
        directory: Path,
        speeds: list[float],
        live_out: Callable[[int], Path | None],
        dilation: float = 1.0,
        folded: list[int] | None = None,
    ):
        """`speeds`: each device's at the start; `live_out(rank)`: the host path of the
        worker's output folder while it runs (None: the backend cannot show it); `dilation`:
        the session's (its times x it on the host, the speeds the workers get / it); `folded`:
        each device's threads folded into its worker's one (its speed is then times them)."""
        self.dilation = dilation
        self.folded = folded or [1] * count
        self.events = [(i, e) for i, e in enumerate(events) if e.device < count]
        self.controls = {rank: directory / f"rank{rank}" / CONTROL_FILE for rank in range(count)}
        self.speeds = list(speeds)
        self.released = [0] * count
        self.live_out = live_out
        self.applied: list[AppliedEvent] = []
        self.hands: Hands | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.origin_ns: int | None = None

    def holds(self, rank: int) -> list[int]:
        """The rounds device `rank` waits before (its events at an inference)."""
        return sorted(
            e.at_inference
            for _, e in self.events
            if e.device == rank and e.at_inference is not None
        )

    def write_controls(self) -> None:
        for rank, path in self.controls.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_control(path, self.worker_speed(rank), 0)

    @property
    def left(self) -> AppliedEvent | None:
        return next((a for a in self.applied if a.kind == "leave" and a.applied_ns), None)

    def start(self, hands: Hands) -> None:
        self.hands = hands
        self._thread = threading.Thread(target=self._run, name="timeline", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops playing; a paused device is thawed; events not reached are kept as missed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for applied in self.applied:
            if applied.kind == "pause" and applied.ended_ns is None and applied.applied_ns:
                self._resume(applied)
        done = {a.index for a in self.applied}
        for index, event in self.events:
            if index not in done:
                self.applied.append(
                    AppliedEvent(index, event.kind_name, event.device, event.label())
                )
        self.applied.sort(key=lambda a: (a.applied_ns or 0, a.index))
        if self._error is not None:
            error, self._error = self._error, None
            raise TestbedError(f"timeline: {error}") from error

    def _run(self) -> None:
        pending = list(self.events)
        try:
            while not self._stop.is_set() and (pending or self._pauses()):
                now = time.time_ns()
                if self.origin_ns is None:
                    self.origin_ns = self._round_start(0, 0)
                for item in list(pending):
                    asked_ns = self._due_ns(item[1], now)
                    if asked_ns is not None:
                        pending.remove(item)
                        self._apply(*item, asked_ns=asked_ns)
                for applied in self._pauses():
                    if now >= applied.due_end_ns:
                        self._resume(applied)
                self._stop.wait(POLL_S)
        except BaseException as error:  # noqa: BLE001 - raised by stop()
            log.debug("timeline: %s", error)
            self._error = error

    def _pauses(self) -> list[AppliedEvent]:
        return [a for a in self.applied if a.kind == "pause" and a.ended_ns is None]

    def _round_start(self, rank: int, round_index: int) -> int | None:
        """When device `rank` started round `round_index` or later (ns), or None."""
        out = self.live_out(rank)
        seen = None if out is None else read_progress(out / PROGRESS_FILE)
        return seen[1] if seen is not None and seen[0] >= round_index else None

    def _due_ns(self, event: Event, now_ns: int) -> int | None:
        """When the event was due (ns) once it is, else None: an inference's when its device
        reached the boundary (it waits there for us), a time's when the session's clock
        says."""
        if event.at_inference is not None:
            return self._round_start(event.device, event.at_inference)
        if self.origin_ns is None or event.at_s is None:
            return None
        due = self.origin_ns + round(event.at_s * self.dilation * 1e9)
        return due if now_ns >= due else None

    def _apply(self, index: int, event: Event, asked_ns: int) -> None:
        hands, rank = self.hands, event.device
        assert hands is not None
        applied = AppliedEvent(
            index, event.kind_name, rank, event.label(), asked_ns=asked_ns, began_ns=time.time_ns()
        )
        if event.speed is not None:
            self.speeds[rank] = event.speed
            self._control(rank)
            self._supersede("speed", rank)
        elif event.pause_s is not None:
            hands.backend.pause(hands.devices[rank])
            applied.due_end_ns = time.time_ns() + round(event.pause_s * self.dilation * 1e9)
        elif event.leave:
            assert hands.processes is not None, "the workers run before an event is applied"
            hands.processes[rank].terminate()
        elif event.link is not None:
            applied.detail = hands.set_link(rank, dict(event.link))
            rate = event.link.get("rate_mbit")
            applied.rate_mbit = float(rate) if isinstance(rate, int | float) else None
            self._supersede("link", rank)
        applied.applied_ns = time.time_ns()
        self.applied.append(applied)
        log.debug("timeline: %s applied %.1f ms after its time", event.label(), applied.delay_ms)
        if event.at_inference is not None and not event.leave:
            self.released[rank] += 1
            self._control(rank)

    def _control(self, rank: int) -> None:
        """The device's control file: its speed (on the host's clock) and its releases."""
        write_control(self.controls[rank], self.worker_speed(rank), self.released[rank])

    def worker_speed(self, rank: int) -> float:
        """Device `rank`'s speed in force as its worker paces to it (on the host's clock)."""
        return self.speeds[rank] * self.folded[rank] / self.dilation

    def _supersede(self, kind: str, rank: int) -> None:
        """An earlier speed or link event of the device ends where this one starts."""
        for applied in self.applied:
            if applied.kind == kind and applied.device == rank and applied.ended_ns is None:
                applied.ended_ns = time.time_ns()

    def _resume(self, applied: AppliedEvent) -> None:
        hands = self.hands
        assert hands is not None
        hands.backend.resume(hands.devices[applied.device])
        applied.ended_ns = time.time_ns()
