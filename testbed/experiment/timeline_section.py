"""The `timeline` of an experiment: what happens to a device during every session.

An event happens at a time from the session's start (`at_s`: the start of its first measured
inference on device 0, so that loading and warm-ups do not count) or at an inference
boundary (`at_inference: i`: before the device starts its i-th measured round, every run's
inference i), on one device (`device`: its rank), and is one of:

- `speed: s`: the device's speed becomes s from then on (a straggler appears, or recovers);
- `pause_s: d`: the device is frozen for d seconds (a scheduler stall, a page-fault storm),
  then runs on;
- `leave: true`: the device stops; the session's remaining inferences are failed rows whose
  error names the event (the device is back for the next session);
- `link: {rate_mbit, delay_ms, loss_pct, ...}`: the device's uplink changes (what a trace
  does to every device, done to one): its rate and netem's parameters, laid over the trial's.

Every session plays the whole timeline. Events on a device beyond a trial's count do not
happen in that trial's sessions. What is refused here, before anything starts: an unknown
device, an inference past the session's repeats, a time past the session's timeout, a speed
outside (0, 100], a pause that overlaps a leave or anything after a device left, two events at
the same moment on one device.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from testbed.experiment.devices_section import MAX_SPEED
from testbed.experiment.link_section import RATE_RANGE_MBIT
from testbed.experiment.netem_parameters import ImpairmentError, checked
from testbed.experiment.strict import Strict

KINDS = ("speed", "pause_s", "leave", "link")
MAX_PAUSE_S = 3600.0


class Event(Strict):
    """One event of a session's timeline."""

    at_s: float | None = Field(
        None,
        ge=0,
        description="seconds from the start of the session's first measured "
        "inference on device 0 (after the warm-ups); refused at or past timeout_s",
    )
    at_inference: int | None = Field(
        None,
        ge=0,
        description="before every trial's measured inference with this index (0-based; "
        "the trials of a session interleave, so all of them see it at the same round)",
    )
    device: int = Field(ge=0, description="the device's rank")
    speed: float | None = Field(
        None, description="the device's new speed, a fraction of a host core (as devices.speed)"
    )
    pause_s: float | None = Field(None, gt=0, le=MAX_PAUSE_S, description="frozen this long")
    leave: bool | None = Field(None, description="true: the device stops")
    link: dict[str, Any] | None = Field(
        None,
        description="the device's uplink from then on: rate_mbit and netem's parameters, "
        "e.g. {rate_mbit: 2, delay_ms: 40, loss_pct: 1}",
    )

    @field_validator("speed")
    @classmethod
    def _speed(cls, speed: float | None) -> float | None:
        if speed is not None and not 0 < speed <= MAX_SPEED:
            raise ValueError(
                f"{speed:g} is not a speed in (0, {MAX_SPEED:g}]: a fraction of a host core "
                "(above 1 in virtual time, experiment.dilation)"
            )
        return speed

    @field_validator("leave")
    @classmethod
    def _leave(cls, leave: bool | None) -> bool | None:
        if leave is False:
            raise ValueError("leave: true, or leave it out")
        return leave

    @field_validator("link")
    @classmethod
    def _link(cls, link: dict[str, Any] | None) -> dict[str, Any] | None:
        if link is None:
            return None
        if not link:
            raise ValueError("name the rate_mbit or netem's parameters that change")
        rate = link.get("rate_mbit")
        low, high = RATE_RANGE_MBIT
        if rate is not None and (
            isinstance(rate, bool) or not isinstance(rate, int | float) or not low <= rate <= high
        ):
            raise ValueError(f"rate_mbit: a number of Mbit/s in {low:g}..{high:,.0f}, got {rate!r}")
        try:
            checked({k: v for k, v in link.items() if k != "rate_mbit"}, whole=False)
        except ImpairmentError as error:
            raise ValueError(str(error)) from None
        return link

    @model_validator(mode="after")
    def _one_time_one_kind(self) -> Event:
        if (self.at_s is None) == (self.at_inference is None):
            raise ValueError("give at_s (seconds from the session's start) or at_inference")
        kinds = [kind for kind in KINDS if getattr(self, kind) is not None]
        if len(kinds) != 1:
            named = " and ".join(kinds) or "none"
            raise ValueError(f"an event is one of {', '.join(KINDS)}; this one has {named}")
        return self

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) is not None)

    @property
    def kind_name(self) -> str:
        """speed, pause, leave or link."""
        return self.kind.removesuffix("_s")

    @property
    def when(self) -> str:
        return f"{self.at_s:g} s" if self.at_s is not None else f"inference {self.at_inference}"

    def label(self) -> str:
        """E.g. `speed d1=0.5 at 2 s`, `pause d0 0.3 s at inference 4`."""
        d = f"d{self.device}"
        if self.kind == "speed":
            what = f"speed {d}={self.speed:g}"
        elif self.kind == "pause_s":
            what = f"pause {d} {self.pause_s:g} s"
        elif self.kind == "leave":
            what = f"leave {d}"
        else:
            what = f"link {d} " + ",".join(f"{k}={v}" for k, v in sorted(self.link.items()))
        return f"{what} at {self.when}"


def check_timeline(
    events: list[Event], most_devices: int, inferences: int | None, timeout_s: float
) -> None:
    """What depends on the rest of the experiment (`inferences`: per trial, None where the
    evaluation's batches decide); ValueError names the event's index."""
    for index, event in enumerate(events):
        where = f"timeline[{index}]"
        if event.device >= most_devices:
            raise ValueError(
                f"{where}.device: device {event.device} does not exist: devices.count is at most "
                f"{most_devices} (ranks 0..{most_devices - 1})"
            )
        late = inferences is not None and event.at_inference is not None
        if late and event.at_inference >= inferences:
            raise ValueError(
                f"{where}.at_inference: {event.at_inference} is past the session: each trial "
                f"measures {inferences} inferences (0..{inferences - 1})"
            )
        if event.at_s is not None and event.at_s >= timeout_s:
            raise ValueError(
                f"{where}.at_s: {event.at_s:g} s is past the session: a trial's session is cut "
                f"at timeout_s ({timeout_s:g} s)"
            )
    _check_order(events)


def _check_order(events: list[Event]) -> None:
    """On one device and one clock (seconds or inferences): nothing at the same moment, and
    nothing once the device has left, a pause's end included."""
    for basis in ("at_s", "at_inference"):
        timed = sorted(
            (getattr(e, basis), i, e) for i, e in enumerate(events) if getattr(e, basis) is not None
        )
        for device in {e.device for _, _, e in timed}:
            own = [(t, i, e) for t, i, e in timed if e.device == device]
            for (t0, i0, e0), (t1, i1, e1) in zip(own, own[1:], strict=False):
                if t0 == t1:
                    raise ValueError(
                        f"timeline[{i1}]: device {device} has two events at {e1.when} "
                        f"(timeline[{i0}]); one event per moment"
                    )
                if e0.kind == "leave":
                    raise ValueError(
                        f"timeline[{i1}]: device {device} left at {e0.when} (timeline[{i0}]); "
                        f"nothing happens to it after that"
                    )
            leaves = [(t, i) for t, i, e in own if e.kind == "leave"]
            for t, i, e in own:
                if e.kind != "pause_s" or basis != "at_s":
                    continue
                for leave_t, leave_i in leaves:
                    if t < leave_t < t + (e.pause_s or 0):
                        raise ValueError(
                            f"timeline[{i}]: device {device}'s pause ({e.pause_s:g} s from "
                            f"{t:g} s) overlaps its leave at {leave_t:g} s (timeline[{leave_i}])"
                        )
