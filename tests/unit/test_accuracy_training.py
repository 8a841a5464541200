"""Training pieces: the differentiable P-device forward equals the byte-exact simulation, the
codebook update rules, fine-tuning steps, and the trained model + bundle round trip."""

import copy

import pytest
import torch
import torch.nn.functional as F

import tracevq
from accuracy.loops import parameter_groups, task_loss
from accuracy.quantizer import CodebookRule, TrainableQuantizer, TrainingCodec
from accuracy.settings import DistillSection, FinetuneSection
from tracevq.bundle import Bundle, FitSettings, fit_bundle, model_fingerprint
from tracevq.checkpoint import load_checkpoint
from tracevq.distributed import ExactCodec, distributed_logits, remote_kv_error
from tracevq.errors import ConfigError
from tracevq.method_table import METHODS
from tracevq.tree import build_tree
from tracevq.vq import VectorQuantizer

K = 16
VQ_FAMILIES = ("astra", "trace-b", "trace-nb")


@pytest.fixture(scope="module")
def model():
    return tracevq.build_model("vit-tiny", seed=4)


@pytest.fixture(scope="module")
def bundle(model):
    calibration = torch.randn(
        model.config.input_shape(16), generator=torch.Generator().manual_seed(1)
    )
    return fit_bundle(model, calibration, FitSettings(K))


@pytest.fixture(scope="module")
def inputs(model):
    return torch.randn(model.config.input_shape(4), generator=torch.Generator().manual_seed(2))


def _codec(family, quantizers, trees, level=None):
    """The exact codec of `family`: with its trees where the method has levels."""
    return ExactCodec(quantizers, trees if METHODS[family].trace else None, level)


def _simulated(model, inputs, family, devices, bundle, level=None):
    params = {"K": bundle.K}
    if level is not None:
        params["level_k"] = bundle.trees[family][0].level_sizes[level]
    return tracevq.simulate(model, inputs, family, devices, bundle=bundle, **params).logits


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("family", VQ_FAMILIES)
def test_eval_forward_equals_simulate(model, bundle, inputs, family, devices):
    quantizers, trees = bundle.family(family)
    with torch.no_grad():
        mine = distributed_logits(model, inputs, devices, family, _codec(family, quantizers, trees))
    expected = _simulated(model, inputs, family, devices, bundle)
    torch.testing.assert_close(mine, expected, atol=1e-5, rtol=1e-5)
    assert (mine - model(inputs)).abs().max() > 1e-3  # the codebooks do change the logits


@pytest.mark.parametrize(
    ("family", "placement", "remote_ffn"),
    [("trace-nb", p, False) for p in ("1 A.i", "1 A.ii", "1 A.iii", "1 B")]
    + [("trace-nb", "1 B", True), ("trace-nb", "1 A.i", True)]
    + [("trace-b", "2 A", False), ("trace-b", "2 B", False)],
)
def test_eval_forward_equals_simulate_at_every_placement(
    model, bundle, inputs, family, placement, remote_ffn
):
    quantizers, trees = bundle.family(family)
    extra = {"remote_ffn": remote_ffn} if family == "trace-nb" else {}
    with torch.no_grad():
        mine = distributed_logits(
            model,
            inputs,
            3,
            family,
            _codec(family, quantizers, trees),
            placement=placement,
            **extra,
        )
    expected = tracevq.simulate(
        model, inputs, family, 3, bundle=bundle, K=bundle.K, placement=placement, **extra
    ).logits
    torch.testing.assert_close(mine, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["trace-b", "trace-nb"])
def test_eval_forward_equals_simulate_at_a_coarse_level(model, bundle, inputs, family):
    quantizers, trees = bundle.family(family)
    codec = _codec(family, quantizers, trees, level=1)
    with torch.no_grad():
        mine = distributed_logits(model, inputs, 3, family, codec)
    torch.testing.assert_close(mine, _simulated(model, inputs, family, 3, bundle, level=1))


def test_voltage_forward_is_the_single_device_model(model, inputs):
    with torch.no_grad():
        torch.testing.assert_close(
            distributed_logits(model, inputs, 3, "voltage"), model(inputs), atol=1e-5, rtol=1e-5
        )
    with pytest.raises(ConfigError, match="no differentiable forward for 'prism'"):
        distributed_logits(model, inputs, 2, "prism")


def test_training_forward_in_eval_mode_equals_simulate_after_finetuning(model, bundle, inputs):
    """Fine-tune codebooks and weights a few steps, then the trained pair must still agree."""
    tuned, trained = _finetuned(model, bundle, "trace-b", code_dim=None)
    quantizers, trees = trained.family("trace-b")
    with torch.no_grad():
        mine = distributed_logits(tuned, inputs, 2, "trace-b", _codec("trace-b", quantizers, trees))
    torch.testing.assert_close(mine, _simulated(tuned, inputs, "trace-b", 2, trained))


def _finetuned(model, bundle, family, code_dim, steps=3, rule=None):
    """(model, bundle) after `steps` fine-tuning steps on random data, trees rebuilt."""
    tuned = copy.deepcopy(model).train()
    calibration = torch.randn(
        model.config.input_shape(8), generator=torch.Generator().manual_seed(5)
    )
    fitted = fit_bundle(tuned, calibration, FitSettings(K, families=(family,), code_dim=code_dim))
    codec = TrainingCodec(fitted.quantizers[family], rule or CodebookRule(decay=0.5))
    optimizer = torch.optim.AdamW([*tuned.parameters(), *codec.parameters()], lr=1e-3)
    generator = torch.Generator().manual_seed(6)
    for step in range(steps):
        images = torch.randn(model.config.input_shape(4), generator=generator)
        labels = torch.randint(10, (4,), generator=generator)
        logits = distributed_logits(tuned, images, 2 + step % 2, family, codec)
        loss = F.cross_entropy(logits, labels) + codec.loss()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        codec.update()
    codec.sync()
    tuned.eval()
    quantizers = fitted.quantizers[family]
    trees = [build_tree(vq.codebook, 2, "euclidean", vq.ema_counts) for vq in quantizers]
    trained = Bundle(
        tuned.config.name, model_fingerprint(tuned), K, {family: quantizers}, {family: trees}
    )
    return tuned, trained


@pytest.mark.parametrize("family", VQ_FAMILIES)
@pytest.mark.parametrize("code_dim", [None, 8])
def test_trained_model_and_bundle_round_trip(model, bundle, inputs, tmp_path, family, code_dim):
    tuned, trained = _finetuned(model, bundle, family, code_dim)
    torch.save(tuned.state_dict(), tmp_path / "model.pth")
    trained.save(tmp_path / "bundle.pt")
    loaded_model = load_checkpoint(tracevq.build_model("vit-tiny"), tmp_path / "model.pth")
    loaded = Bundle.load(tmp_path / "bundle.pt")
    assert loaded.model_fingerprint == model_fingerprint(loaded_model)
    assert loaded.fingerprint == trained.fingerprint
    assert loaded.quantizers[family][1].code_dim == (code_dim or model.config.dim)
    for devices in (2, 3):
        expected = _simulated(tuned, inputs, family, devices, trained)
        got = _simulated(loaded_model, inputs, family, devices, loaded)
        torch.testing.assert_close(got, expected)
        quantizers, trees = loaded.family(family)
        with torch.no_grad():
            mine = distributed_logits(
                loaded_model, inputs, devices, family, _codec(family, quantizers, trees)
            )
        torch.testing.assert_close(mine, got, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("placement", ["1 B", "1 A.i"])
def test_straight_through_gradients_reach_the_senders(model, bundle, inputs, placement):
    tuned = copy.deepcopy(model).train()
    quantizers = copy.deepcopy(bundle.quantizers["trace-nb"])
    codec = TrainingCodec(quantizers, CodebookRule())
    logits = distributed_logits(tuned, inputs, 2, "trace-nb", codec, placement=placement)
    (logits.sum() + codec.loss()).backward()
    # the patch embedding only reaches peers through quantised rows: gradient flows through
    assert tuned.patch_embed.proj.weight.grad.abs().sum() > 0
    used = codec.quantizers if placement == "1 B" else codec.quantizers[1:]  # 1 A.i: no VQ_0
    assert all(q.loss > 0 for q in used)


def _vq_with(codebook):
    vq = VectorQuantizer(len(codebook), codebook.shape[1])
    vq.set_codebook(codebook)
    return vq


def test_ema_update_moves_codewords_towards_assigned_rows():
    codebook = torch.tensor([[0.0, 0.0], [10.0, 10.0], [-10.0, 5.0]])
    vq = _vq_with(codebook)
    vq.ema_counts.copy_(torch.tensor([10.0, 10.0, 10.0]))
    quantizer = TrainableQuantizer(vq, CodebookRule(decay=0.9, dead_fraction=0.0)).train()
    rows = torch.tensor([[1.0, 1.0], [1.2, 0.8], [11.0, 9.0]])
    for _ in range(20):
        quantizer(rows)
        quantizer.update()
    assert torch.dist(vq.codebook[0], torch.tensor([1.1, 0.9])) < 0.15
    assert torch.dist(vq.codebook[1], torch.tensor([11.0, 9.0])) < 0.2
    assert torch.dist(vq.codebook[2], codebook[2]) < 0.1  # unassigned: stays (EMA shrinks both)


def test_first_ema_step_does_not_jump():
    """Statistics start at the fitted codebook, so a batch at the codewords changes nothing."""
    codebook = torch.tensor([[0.0, 0.0], [4.0, 4.0]])
    vq = _vq_with(codebook)
    vq.ema_counts.copy_(torch.tensor([300.0, 100.0]))
    quantizer = TrainableQuantizer(vq, CodebookRule(decay=0.99, dead_fraction=0.0)).train()
    quantizer(codebook.repeat(3, 1))
    quantizer.update()
    torch.testing.assert_close(vq.codebook, codebook, atol=1e-3, rtol=0)


def test_dead_codes_restart_on_batch_rows():
    codebook = torch.tensor([[0.0, 0.0], [1.0, 0.0], [100.0, 100.0], [-100.0, 100.0]])
    vq = _vq_with(codebook)
    quantizer = TrainableQuantizer(vq, CodebookRule(decay=0.5, dead_fraction=0.2)).train()
    rows = torch.tensor([[0.1, 0.0], [0.9, 0.1], [0.2, 0.1], [1.1, 0.0]])
    reset = 0
    for _ in range(5):
        quantizer(rows)
        reset += quantizer.update()
    assert reset >= 2
    far = vq.codebook[2:]
    # the two unused codes now sit on batch rows, not at +-100
    assert far.abs().max() < 2.0
    assert (vq.ema_counts > 0).all()


def test_gradient_rule_moves_the_codebook_through_the_optimizer():
    codebook = torch.tensor([[0.0, 0.0], [5.0, 5.0]])
    vq = _vq_with(codebook)
    quantizer = TrainableQuantizer(vq, CodebookRule(update="gradient", dead_fraction=0.0)).train()
    optimizer = torch.optim.SGD(quantizer.parameters(), lr=0.5)
    rows = torch.tensor([[1.0, 1.0], [1.0, 1.0]], requires_grad=True)
    out = quantizer(rows)
    torch.testing.assert_close(out, codebook[[0, 0]])  # forward value: the codeword
    (out.sum() + quantizer.loss).backward()
    # straight-through (1 per element) plus the commitment term 0.25 * 2 (z - e) / 4
    torch.testing.assert_close(rows.grad, torch.full_like(rows, 1.125))
    optimizer.step()
    quantizer.update()
    quantizer.sync()
    assert vq.codebook[0].sum() > 0.1  # moved towards (1, 1)
    torch.testing.assert_close(vq.codebook[1], codebook[1])


def test_finetuning_steps_reduce_the_loss(model):
    """Fitting one fixed batch: the task + commitment loss goes down within a few steps."""
    tuned = copy.deepcopy(model).train()
    generator = torch.Generator().manual_seed(7)
    images = torch.randn(model.config.input_shape(8), generator=generator)
    labels = torch.randint(10, (8,), generator=generator)
    fitted = fit_bundle(tuned, images, FitSettings(8, families=("astra",)))
    codec = TrainingCodec(fitted.quantizers["astra"], CodebookRule())
    optimizer = torch.optim.AdamW([*tuned.parameters(), *codec.parameters()], lr=3e-3)
    losses = []
    for _ in range(12):
        logits = distributed_logits(tuned, images, 2, "astra", codec)
        loss = F.cross_entropy(logits, labels) + codec.loss()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        codec.update()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_remote_kv_error_is_zero_for_voltage_and_falls_with_the_level(model, inputs):
    exact = remote_kv_error(model, inputs, 2, "voltage", ExactCodec([]))
    assert max(exact) < 1e-5 and len(exact) == model.config.depth
    seen = inputs[:2]  # 34 token rows, fewer than K: the full codebook holds them all
    quantizers, trees = fit_bundle(model, seen, FitSettings(64, families=("trace-b",))).family(
        "trace-b"
    )
    coarse, fine = (
        sum(remote_kv_error(model, seen, 2, "trace-b", _codec("trace-b", quantizers, trees, m)))
        for m in (0, trees[0].finest)
    )
    assert fine < 0.1 * coarse


def test_flips_mirror_about_half_the_images_and_leave_the_rest_as_shifted():
    from accuracy.loops import augmented, shift
    from accuracy.settings import BaseSection

    images = torch.rand(400, 1, 8, 8)
    plain = shift(images, 1, torch.Generator().manual_seed(3))
    same = augmented(images, BaseSection(shift_px=1), torch.Generator().manual_seed(3))
    assert torch.equal(same, plain)  # no flips: the draws of before
    flipped = augmented(
        images, BaseSection(shift_px=1, flip=True), torch.Generator().manual_seed(3)
    )
    mirrored = [torch.equal(f, p.flip(-1)) for f, p in zip(flipped, plain, strict=True)]
    kept = [torch.equal(f, p) for f, p in zip(flipped, plain, strict=True)]
    assert all(m or k for m, k in zip(mirrored, kept, strict=True))
    assert 160 <= sum(mirrored) <= 240  # binomial(400, 0.5): 200 +- 40 is beyond 4 sigma


def test_epochs_set_the_steps_by_the_training_split():
    section = FinetuneSection(epochs=1.5, batch_size=64)
    assert section.tunes and section.total_steps(1000) == 24  # ceil(1.5 * 1000 / 64)
    assert FinetuneSection(steps=7).total_steps(1000) == 7
    assert not FinetuneSection(steps=0).tunes


def test_distillation_blends_the_labels_with_the_teachers_softened_distribution():
    generator = torch.Generator().manual_seed(3)
    logits, taught = torch.randn(5, 4, generator=generator), torch.randn(5, 4, generator=generator)
    labels = torch.tensor([0, 1, 2, 3, 0])
    hard = F.cross_entropy(logits, labels, label_smoothing=0.1)
    assert task_loss(logits, labels, taught, FinetuneSection(), 0.1) == hard  # distill off
    section = FinetuneSection(distill=DistillSection(temperature=2.0, weight=0.25))
    teacher = F.softmax(taught / 2, dim=1)
    soft = (teacher * (teacher.log() - F.log_softmax(logits / 2, dim=1))).sum(1).mean()
    expected = 0.75 * hard + 0.25 * 4 * soft
    torch.testing.assert_close(task_loss(logits, labels, taught, section, 0.1), expected)
    alone = FinetuneSection(distill=DistillSection(weight=1.0))
    assert float(task_loss(taught, labels, taught, alone, 0.1)) == pytest.approx(0, abs=1e-6)


def test_decay_on_matrices_spares_norms_biases_embeddings_and_codebooks(model, bundle):
    codec = TrainingCodec(bundle.quantizers["astra"], CodebookRule(update="gradient"))
    section = FinetuneSection(decay="matrices", lr=1e-3, codebook_lr=1e-2, weight_decay=0.05)
    groups = parameter_groups(model, codec, section)
    by_id = {id(p): (g["lr"], g["weight_decay"]) for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert by_id[id(named["blocks.0.attn.qkv.weight"])] == (1e-3, 0.05)
    for name in ("blocks.0.norm1.weight", "blocks.0.attn.qkv.bias", "cls_token", "pos_embed"):
        assert by_id[id(named[name])] == (1e-3, 0.0), name
    assert {by_id[id(p)] for p in codec.parameters()} == {(1e-2, 0.0)}
    assert len(by_id) == len(named) + len(list(codec.parameters()))  # each parameter once
    every = parameter_groups(model, codec, FinetuneSection(weight_decay=0.05))
    assert {g["weight_decay"] for g in every} == {0.05}  # "all": as before the option


def test_a_refresh_moves_each_chosen_codeword_to_the_mean_of_its_rows():
    codebook = torch.tensor([[0.0, 0.0], [10.0, 10.0], [-10.0, 5.0]])
    vq = _vq_with(codebook)
    vq.ema_counts.copy_(torch.tensor([6.0, 3.0, 3.0]))
    codec = TrainingCodec([vq], CodebookRule(dead_fraction=0.0)).eval()
    rows = torch.tensor([[1.0, 1.0], [2.0, 0.0], [3.0, 2.0], [9.0, 11.0]])

    def forward(chunk):
        return codec(0, chunk)

    assert codec.refresh(forward, rows, batch=3) == 2  # two codewords chosen, in two chunks
    torch.testing.assert_close(vq.codebook, torch.tensor([[2.0, 1.0], [9.0, 11.0], [-10.0, 5.0]]))
    torch.testing.assert_close(vq.ema_counts, torch.tensor([9.0, 3.0, 0.0]))  # total kept


def test_noise_augmented_quantisation_follows_the_residual_in_training_only():
    """Astra's noise: per dimension, the residual's spread times lambda; none in evaluation."""
    codebook = torch.tensor([[0.0, 0.0]])
    generator = torch.Generator().manual_seed(5)
    rows = torch.randn(20000, 2, generator=generator) * torch.tensor([1.0, 3.0])
    rule = CodebookRule(noise=0.5, dead_fraction=0.0)
    quantizer = TrainableQuantizer(_vq_with(codebook), rule).train()
    noise = quantizer(rows) - codebook  # the one codeword is 0: what is left is the noise
    torch.testing.assert_close(noise.std(0), 0.5 * rows.std(0), rtol=0.03, atol=0)
    assert noise.mean(0).abs().max() < 0.05
    torch.testing.assert_close(quantizer.eval()(rows), codebook.expand(len(rows), 2))
