"""The serial link's C core as the program sees it: built from the checkout, its counters'
layout the same on both sides, its setters refusing what core.c refuses, a missing compiler
leaving the Python loop, and a C switch refusing impairments (it draws none)."""

from __future__ import annotations

import ctypes
import logging

import pytest

from testbed.link.serial import core
from testbed.link.serial.program import Switch


@pytest.fixture(scope="module")
def library():
    loaded = core.load()
    assert loaded is not None, "gcc builds core.c on this machine"
    return loaded


def test_the_core_builds_once_per_source_and_matches_its_counters(library) -> None:
    assert core.library_path().exists()
    assert core.build() == core.library_path()  # built already: not again
    assert library.serial_counters_size() == ctypes.sizeof(core.Counters)


def test_the_setters_refuse_what_the_core_cannot_hold(library) -> None:
    assert library.serial_init(0) < 0 and library.serial_init(65) < 0
    assert library.serial_init(2) == 0
    assert library.serial_port(0, 3, 1e6) == 0
    assert library.serial_rate(1, 0.0) < 0  # a rate is positive
    assert library.serial_down(1, 0.0) == 0  # 0: unshaped
    assert library.serial_pair(0, 2, 1e6) < 0  # no port 2
    assert library.serial_serve(1) < 0  # port 1 has no socket
    counters, stalls = core.counters(library, 0)
    assert (counters.frames, counters.bytes, stalls) == (0, 0, [])


def test_without_a_compiler_the_python_loop_runs(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(core, "BUILD_DIR", tmp_path)
    monkeypatch.setattr(core.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING):
        assert core.load() is None
    assert "no C compiler (gcc) on this host" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_a_switch_on_the_core_refuses_impairments() -> None:
    switch = Switch([], core=object())
    switch.ports = {"p0": None}  # type: ignore[dict-item]
    answer = switch.execute('impair p0 1 {"delay_ms": 5}')
    assert answer == (
        "error impair p0: this switch runs the C core, which draws no impairments (start it "
        "with --core python)"
    )
    assert switch.execute('impair-down p0 1 {"loss_pct": 1}').startswith("error impair-down p0")
