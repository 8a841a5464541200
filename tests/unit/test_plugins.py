"""Adding a plug-in is one class and one table entry: a toy backend and a toy emulator,
registered here and nowhere else, carry an experiment through the schema, the preflight and
a dry run; the toy emulator's own refusal is what the preflight says."""

from __future__ import annotations

import pandas as pd
import pytest

from testbed.backends.base import Backend
from testbed.backends.table import BACKENDS, backend_class, backend_names
from testbed.experiment.profiles import LinkProfile
from testbed.experiment.schema import load_experiment
from testbed.link.emulator import Emulator, Refusal
from testbed.link.emulators import EMULATORS, emulator_class
from testbed.link.rates import LinkRates
from testbed.run import main
from testbed.sweep.preflight import check_experiment


class ToyBackend(Backend):
    """Boards somewhere else, shaped by the toy link; nothing here starts them."""

    name = "toy"
    on_this_host = False
    default_emulator = "toy-link"

    def start(self, spec):
        raise NotImplementedError

    def spawn(self, device, argv):
        raise NotImplementedError

    def stop(self) -> None:
        pass


class ToyLink(Emulator):
    """A link that takes any rate and no impairment."""

    name = "toy-link"

    @classmethod
    def refusal(cls, profile: LinkProfile, backend: type[Backend], pair_rates: bool, paths=None):
        if (shared := super().refusal(profile, backend, pair_rates, paths)) is not None:
            return shared  # later hops' impairments: the toy link impairs nothing
        if profile.needs_netem:
            return Refusal("link.profile", f"the toy link adds nothing to '{profile.name}'")
        return None

    def set_rates(self, rates: LinkRates, in_place: bool) -> None:
        self.rates = rates


@pytest.fixture
def toys(monkeypatch):
    monkeypatch.setitem(BACKENDS, ToyBackend.name, ToyBackend)
    monkeypatch.setitem(EMULATORS, ToyLink.name, ToyLink)


def write(tmp_path, link: str) -> str:
    path = tmp_path / "toy.yaml"
    path.write_text(
        "name: toy\nmodel: {name: vit-tiny}\nbackend: toy\n"
        f"link: {{{link}bandwidth_mbit: [1, 5]}}\n"
        "methods: [{name: voltage}, {name: trace-b, K: 16}]\n"
    )
    return str(path)


def test_a_registered_backend_and_emulator_carry_an_experiment_to_a_dry_run(toys, tmp_path, capsys):
    path = write(tmp_path, "")
    experiment = load_experiment(path)
    checked = check_experiment(experiment, experiment.backend, path)
    assert checked.backend is ToyBackend and checked.emulator is ToyLink  # its default
    assert "toy" in backend_names() and backend_class("toy") is ToyBackend
    assert emulator_class(None, ToyBackend) is ToyLink

    out = tmp_path / "out"
    assert main([path, "--dry-run", "--out", str(out)]) == 0
    (plan,) = out.glob("toy/*/plan.csv")
    assert sorted(pd.read_csv(plan)["trial_id"].unique()) == [
        "p2-trace-b-K16-1mbit",
        "p2-trace-b-K16-5mbit",
        "p2-voltage-1mbit",
        "p2-voltage-5mbit",
    ]
    assert main([path, "--dry-run", "--backend", "toy", "--out", str(out)]) == 0
    capsys.readouterr()


def test_the_emulators_refusal_is_the_preflights(toys, tmp_path, capsys):
    path = write(tmp_path, "profile: wifi, ")
    assert main([path, "--dry-run", "--out", str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"testbed.run: {path}: link.profile: the toy link adds nothing to 'wifi'"
    # the serial emulator, asked for on the toy backend, says why not with the toy's names
    path = write(tmp_path, "emulator: serial, ")
    assert main([path, "--dry-run", "--out", str(tmp_path / "out")]) == 2
    line = capsys.readouterr().err.strip()
    assert "link.emulator: serial needs the devices on this host" in line
    assert "the toy backend's devices are shaped with toy-link" in line
    assert not (tmp_path / "out").exists()


def test_without_the_entries_the_names_are_unknown(tmp_path, capsys):
    path = write(tmp_path, "emulator: toy-link, ")
    assert main([path, "--dry-run", "--out", str(tmp_path / "out")]) == 2
    line = capsys.readouterr().err.strip()
    assert line.endswith("backend: unknown backend 'toy'; known: auto, docker, local, ssh, enoslib")
