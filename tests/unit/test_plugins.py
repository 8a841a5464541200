"""Adding a plug-in is one class and one table entry: a toy backend and a toy emulator,
registered here and nowhere else, carry an experiment through the schema, the preflight and
a dry run; the toy emulator's own refusal is what the preflight says. A toy codebook method,
registered the same way, runs through the simulation, the payload, the schema, a dry run, the
accuracy study's settings and its differentiable forward. A toy lab, a backend with a section
of its own in the experiment, registers, is validated, refuses what it cannot run and has its
leftovers cleaned up, from this file alone."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pandas as pd
import pytest
import torch
from pydantic import Field
from torch import Tensor

import tracevq
from accuracy.quantizer import CodebookRule, TrainingCodec
from accuracy.settings import parse_settings
from testbed.backends.base import Backend, Leftovers
from testbed.backends.table import BACKENDS, backend_class, backend_names
from testbed.clean import clean
from testbed.experiment.profiles import LinkProfile
from testbed.experiment.schema import load_experiment
from testbed.experiment.sections import SECTIONS, Section
from testbed.kernel.names import run_tag
from testbed.link.emulator import Emulator, Refusal
from testbed.link.emulators import EMULATORS, emulator_class
from testbed.link.rates import LinkRates
from testbed.run import main
from testbed.sweep.lock import RunLock
from testbed.sweep.preflight import check_experiment
from tracevq.bundle import FitSettings, fit_bundle
from tracevq.distributed import ExactCodec, distributed_logits
from tracevq.errors import ConfigError
from tracevq.method_table import METHODS, MethodEntry
from tracevq.methods import Method, Receiver, ReceiverView, Sender
from tracevq.models import RemoteKV
from tracevq.partition import partition_sizes
from tracevq.spec import method_spec


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


class ToyView(ReceiverView):
    """Every receiver sees the codeword of each token's block input."""

    def seen(self, block: int, x: Tensor, previous: Tensor | None, z: Tensor | None) -> Tensor:
        return self.codec(block, x)


class ToySender(Sender):
    def __init__(self, method: ToyVQ):
        self.method = method

    def pre_block(self, block: int, x: Tensor) -> bytes:
        indices = self.method.quantizers[block].nearest(x).reshape(-1)
        return indices.numpy().astype("<u2").tobytes()


class ToyReceiver(Receiver):
    def __init__(self, method: ToyVQ, peer: int, tokens: int, batch: int):
        self.method, self.peer, self.shape = method, peer, (batch, tokens)

    def remote_kv(self, block: int, message: bytes | None) -> RemoteKV:
        assert message is not None
        self.check_length(message, 2 * self.shape[0] * self.shape[1], self.method.name, block)
        indices = np.frombuffer(message, dtype="<u2").astype(np.int64)
        self.check_indices(indices, self.method.spec.K, self.method.name, block)
        rows = torch.from_numpy(indices).reshape(self.shape)
        x = self.method.quantizers[block].decode(rows)  # (B, n, D)
        return RemoteKV(*self.method.model.blocks[block].remote_kv(x))


class ToyVQ(Method):
    """The nearest codeword of each block input, as 16-bit indices."""

    view_class = ToyView

    def __init__(self, spec, model, quantizers, trees):
        super().__init__(spec, model)
        self.quantizers = quantizers

    def sender(self, rank: int, tokens: int, batch: int) -> Sender:
        return ToySender(self)

    def receiver(self, peer: int, tokens: int, batch: int) -> Receiver:
        return ToyReceiver(self, peer, tokens, batch)


TOY_METHOD = MethodEntry(
    "toy-vq",
    ("K",),
    lambda spec, tokens, dim, batch: 16 * tokens * batch,
    f"{__name__}:ToyVQ",
    quantises="inputs",
)


@pytest.fixture
def toy_method(monkeypatch):
    monkeypatch.setitem(METHODS, TOY_METHOD.name, TOY_METHOD)


def test_a_registered_method_runs_simulated_and_in_the_differentiable_forward(toy_method):
    model = tracevq.build_model("vit-tiny", seed=4)
    generator = torch.Generator().manual_seed(1)
    calibration = torch.randn(model.config.input_shape(8), generator=generator)
    bundle = fit_bundle(model, calibration, FitSettings(16, families=("toy-vq",)))
    inputs = torch.randn(model.config.input_shape(2), generator=generator)

    result = tracevq.simulate(model, inputs, "toy-vq", 3, bundle=bundle, K=16)
    sizes = partition_sizes(model.config.tokens, 3)
    assert tracevq.payload_bits("vit-tiny", "toy-vq", 3, K=16) == [16 * n for n in sizes]
    assert list(result.payload_bits_per_layer) == [16 * 2 * n for n in sizes]  # batch 2
    assert list(result.wire_bytes[0]) == [2 * 2 * n for n in sizes]

    spec = method_spec("toy-vq", K=16)
    with torch.no_grad():
        mine = distributed_logits(model, inputs, 3, spec, ExactCodec(bundle.quantizers["toy-vq"]))
    torch.testing.assert_close(mine, result.logits, atol=1e-5, rtol=1e-5)
    assert (mine - model(inputs)).abs().max() > 1e-3  # the codebooks do change the logits

    codec = TrainingCodec(bundle.quantizers["toy-vq"], CodebookRule())
    tuned = tracevq.build_model("vit-tiny", seed=4).train()
    (distributed_logits(tuned, inputs, 2, spec, codec).sum() + codec.loss()).backward()
    assert tuned.patch_embed.proj.weight.grad.abs().sum() > 0  # through the codewords


def test_a_registered_method_is_a_study_choice_and_an_experiments(toy_method, toys, tmp_path):
    settings = parse_settings({"name": "x", "codebooks": {"families": ["toy-vq"]}})
    assert settings.codebooks.families == ["toy-vq"]
    path = tmp_path / "toy.yaml"
    path.write_text(
        "name: toy\nmodel: {name: vit-tiny}\nbackend: toy\n"
        "link: {bandwidth_mbit: [1]}\n"
        "methods: [{name: voltage}, {name: toy-vq, K: 16}]\n"
    )
    experiment = load_experiment(str(path))
    assert [m["name"] for m in experiment.methods] == ["voltage", "toy-vq"]
    out = tmp_path / "out"
    assert main([str(path), "--dry-run", "--out", str(out)]) == 0
    (plan,) = out.glob("toy/*/plan.csv")
    rows = pd.read_csv(plan)
    toy = rows[rows["method"] == "toy-vq"]
    sizes = partition_sizes(tracevq.model_config("vit-tiny").tokens, 2)
    assert sorted(toy["payload_bits_per_layer"]) == sorted(16 * n for n in sizes)


def test_without_its_entry_the_method_is_unknown():
    with pytest.raises(ConfigError, match="unknown method 'toy-vq'"):
        method_spec("toy-vq", K=16)
    with pytest.raises(ConfigError, match=r"codebooks\.families: 'toy-vq' is not a codebook"):
        parse_settings({"name": "x", "codebooks": {"families": ["toy-vq"]}}, "study.yaml")


# A backend with a section of its own -----------------------------------------------------


class ToyLab(ToyBackend):
    """Racks of boards in a toy lab, described by the experiment's `toy_lab:` section; a run
    leaves its racks switched on, which the lab lists until they are switched off."""

    name = "toy-lab"
    settings = "toy_lab"
    switched_on: ClassVar[list[Leftovers]] = []  # what dead runs left, as the lab finds it

    @classmethod
    def section_refusal(cls, experiment):
        most, racks = max(experiment.devices.count), experiment.section(cls.settings).racks
        if most > racks:
            return f"devices.count: {most} devices, but the toy lab has {racks} racks"
        return None

    @classmethod
    def leftovers(cls, run_dirs):
        return list(cls.switched_on)

    @classmethod
    def remove(cls, leftovers):
        cls.switched_on.remove(leftovers)
        return [f"toy lab: {item} switched off" for item in leftovers.items]


def toy_lab_section() -> type[Section]:
    """The toy lab's section. Defining it registers it (`toy_lab` keeps that to one test)."""

    class ToyLabSection(Section):
        """The toy lab: how many racks it has."""

        section = "toy_lab"
        about = "the toy lab's racks (backend toy-lab)"
        needed = "its racks (toy_lab: {racks: N})"
        racks: int = Field(ge=1, description="one device per rack")

    return ToyLabSection


@pytest.fixture
def toy_lab(toys, monkeypatch):
    """The toy lab in the backend table and its section registered, for this test only."""
    registered = dict(SECTIONS)
    monkeypatch.setitem(BACKENDS, ToyLab.name, ToyLab)
    monkeypatch.setattr(ToyLab, "switched_on", [])
    toy_lab_section()
    yield ToyLab
    SECTIONS.clear()
    SECTIONS.update(registered)


def write_lab(tmp_path, lab: str, count: int = 2) -> str:
    path = tmp_path / "lab.yaml"
    path.write_text(
        f"name: lab\nmodel: {{name: vit-tiny}}\nbackend: toy-lab\n{lab}"
        f"devices: {{count: {count}}}\nlink: {{bandwidth_mbit: 5}}\nmethods: [{{name: voltage}}]\n"
    )
    return str(path)


def refused_line(capsys, path: str, out) -> str:
    """The one line `testbed.run PATH --dry-run` refuses it with (exit 2, nothing written)."""
    assert main([path, "--dry-run", "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert not out.exists()
    return line


def test_a_backends_own_section_is_the_schemas_when_it_is_registered(toy_lab, tmp_path, capsys):
    path = write_lab(tmp_path, "toy_lab: {racks: 3}\n")
    experiment = load_experiment(path)
    assert experiment.section("toy_lab").racks == 3  # typed by its own model
    checked = check_experiment(experiment, experiment.backend, path)
    assert checked.backend is ToyLab and checked.emulator is ToyLink
    assert main([path, "--dry-run", "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    path = write_lab(tmp_path, "toy_lab: {racks: 3, rakcs: 1}\n")
    line = refused_line(capsys, path, tmp_path / "refused")
    assert line.endswith(": toy_lab.rakcs: unknown key (did you mean 'racks'?)")


def test_a_backends_refusal_is_the_preflights(toy_lab, tmp_path, capsys):
    path = write_lab(tmp_path, "toy_lab: {racks: 2}\n", count=3)
    line = refused_line(capsys, path, tmp_path / "out")
    assert line == f"testbed.run: {path}: devices.count: 3 devices, but the toy lab has 2 racks"
    path = write_lab(tmp_path, "")
    line = refused_line(capsys, path, tmp_path / "out")
    assert line == (
        f"testbed.run: {path}: toy_lab: backend 'toy-lab' needs its racks (toy_lab: {{racks: N}})"
    )


def test_a_backends_leftovers_are_found_and_removed_by_clean(toy_lab, tmp_path, monkeypatch):
    monkeypatch.setenv("TESTBED_STATE_DIR", str(tmp_path / "state"))
    left = Leftovers(run_tag("toy-run"), "toy-run", ("rack 0", "rack 1"))
    ToyLab.switched_on.append(left)
    with RunLock("toy-run", tmp_path / "toy-run"):  # its orchestrator runs: kept
        report = clean(run_id="toy-run")
        assert report.removed == [] and "its orchestrator is running" in report.kept[0]
    report = clean(run_id="toy-run")
    assert report.removed == ["toy lab: rack 0 switched off", "toy lab: rack 1 switched off"]
    assert ToyLab.switched_on == []


def test_without_its_entries_a_backends_section_is_an_unknown_key(tmp_path, capsys):
    path = write_lab(tmp_path, "toy_lab: {racks: 3}\n")
    line = refused_line(capsys, path, tmp_path / "out")
    assert line == f"testbed.run: {path}: toy_lab: unknown key"
