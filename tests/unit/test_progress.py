"""What a run says: durations, phases, and the time-left estimate of the trial bar."""

import pytest

from testbed import voice
from testbed.sweep import progress
from testbed.sweep.progress import TrialProgress


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.44, "0.4 s"), (25.2, "25 s"), (185, "3m05s"), (3725, "1h02m")],
)
def test_durations_read_as_a_person_would_say_them(seconds, text):
    assert voice.duration(seconds) == text


def test_a_phase_says_what_it_does_and_how_long_it_took(capsys, monkeypatch):
    clock = iter([100.0, 100.0, 100.0, 112.5, 112.5])  # restart, say, start; end, say
    monkeypatch.setattr(voice.time, "monotonic", lambda: next(clock))
    voice.restart()
    with voice.phase("codebooks K=64", "fitting") as step:
        step.outcome = "fitted"
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "[ 0:00] codebooks K=64: fitting ...",
        "[ 0:12] codebooks K=64: fitted in 12 s",
    ]


def test_quiet_says_nothing(capsys):
    voice.quiet()
    try:
        voice.say("anything")
    finally:
        voice.quiet(False)
    assert capsys.readouterr().err == ""


def test_time_left_is_link_time_until_a_session_ran_then_link_time_plus_measured_excess(
    monkeypatch,
):
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    bar = TrialProgress("sweep", {(2, 1.0): (5, 100.0), (2, 10.0): (5, 10.0)})
    assert bar.remaining() == "at least 1m50s left (link time alone)"
    assert bar.expected_s((2, 10.0)) is None
    bar.start((2, 1.0), "P=2 1 Mbit/s")
    now[0] = 160.0  # 60 s beyond its link time: compute, loading, probes
    bar.finish((2, 1.0), "P=2 1 Mbit/s", "ok")
    assert bar.expected_s((2, 10.0)) == pytest.approx(70.0)
    assert bar.remaining() == "about 1m10s left"
    bar.close()
