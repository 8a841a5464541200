"""dedup: attention over the distinct remote codewords with log(count) gives the same output."""

import pytest
import torch

import tracevq
from tracevq.bundle import FitSettings, fit_bundle
from tracevq.engine import DeviceRun
from tracevq.errors import ConfigError
from tracevq.methods import make_method
from tracevq.partition import partition_sizes
from tracevq.spec import method_spec

K = 64
CODEBOOK_METHODS = [
    ("astra", {}),
    ("astra", {"packed": True}),
    ("trace-b", {}),
    ("trace-b", {"buffers": False}),
    ("trace-nb", {}),
    ("trace-nb", {"placement": "1 A.ii"}),
    ("trace-nb", {"placement": "1 A.iii"}),
    ("trace-nb", {"placement": "1 B"}),
    ("trace-nb", {"placement": "1 B", "remote_ffn": True}),
    ("trace-b", {"placement": "2 A"}),
]
LEVELS = [2, 8, 32, None]  # None: the finest level, K


@pytest.fixture(scope="module")
def model():
    return tracevq.build_model("vit-tiny", seed=5)


@pytest.fixture(scope="module")
def bundle(model):
    calibration = torch.randn(
        model.config.input_shape(24), generator=torch.Generator().manual_seed(1)
    )
    return fit_bundle(model, calibration, FitSettings(K))


@pytest.fixture(scope="module")
def inputs(model):
    return torch.randn(model.config.input_shape(3), generator=torch.Generator().manual_seed(2))


def _cases():
    for method, params in CODEBOOK_METHODS:
        levels = LEVELS if method.startswith("trace") else [None]
        for level_k in levels:
            extra = {} if level_k is None else {"level_k": level_k}
            yield method, {"K": K, **params, **extra}


@pytest.mark.parametrize(("method", "params"), list(_cases()))
@pytest.mark.parametrize("devices", [2, 3, 4])
def test_dedup_gives_the_same_logits(model, bundle, inputs, method, params, devices):
    on = tracevq.simulate(model, inputs, method, devices, bundle=bundle, **params)
    off = tracevq.simulate(model, inputs, method, devices, bundle=bundle, dedup=False, **params)
    torch.testing.assert_close(on.logits, off.logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(on.logits.argmax(-1), off.logits.argmax(-1))
    assert (on.wire_bytes == off.wire_bytes).all()


def _unique_keys_per_block(method, model, inputs, devices):
    """Device 0's distinct remote rows at each block, from a run driven by hand."""
    runs = [DeviceRun(method, rank, devices, inputs) for rank in range(devices)]
    inbox, counts = {}, []  # (block, sender) -> message
    for block in range(model.config.depth):
        for run in runs:
            inbox[block, run.rank] = run.begin_block(block) or inbox.get((block, run.rank))
        for run in runs:
            message = run.attend(block, {peer: inbox[block, peer] for peer in run.peers})
            inbox[block + 1, run.rank] = message
        counts.append([run.unique_remote_keys for run in runs])
        for run in runs:
            run.finish_block(block)
    return counts


def test_unique_counts_are_recorded_per_block(model, bundle, inputs):
    coarse = make_method("trace-b", model, bundle, K=K, level_k=2)
    counts = _unique_keys_per_block(coarse, model, inputs, devices=2)
    # level 2: at most two distinct rows, whatever the batch and the peer's 8 or 9 tokens
    assert all(1 <= c <= 2 for per_block in counts for c in per_block)
    plain = make_method("trace-b", model, bundle, K=K, dedup=False)
    assert all(
        c is None
        for per_block in _unique_keys_per_block(plain, model, inputs, 2)
        for c in per_block
    )

    # a batch of 16 at the finest level: where the batch's rows have as many distinct ones as
    # an input has remote tokens, each input attends over its own tokens' rows instead, so
    # dedup never attends more keys than the tokens, with the same logits
    fine = make_method("trace-b", model, bundle, K=K)
    batch = torch.randn(model.config.input_shape(16), generator=torch.Generator().manual_seed(3))
    remote = partition_sizes(model.config.tokens, 2)[1]  # device 1's tokens, remote to 0
    counts = [c[0] for c in _unique_keys_per_block(fine, model, batch, 2)]
    assert all(c <= remote for c in counts) and remote in counts, counts
    off = make_method("trace-b", model, bundle, K=K, dedup=False)
    torch.testing.assert_close(
        tracevq.simulate(model, batch, fine, 2).logits,
        tracevq.simulate(model, batch, off, 2).logits,
        atol=1e-5,
        rtol=1e-5,
    )

    def nb_counts(placement):
        nb = make_method("trace-nb", model, bundle, K=K, level_k=8, placement=placement)
        counts = _unique_keys_per_block(nb, model, inputs, devices=2)
        # per block: True where K/V were a function of the row alone (dedup), False where not
        assert all(c is None or 1 <= c <= 8 for per_block in counts for c in per_block)
        return [all(c is not None for c in per_block) for per_block in counts]

    later = model.config.depth - 2
    # 1 B: the VQ_0 codeword at block 0, then the copy carries every earlier codeword
    assert nb_counts("1 B") == [True, False] + [False] * later
    # A cases: block 0 from the exact embedding; 1 A.ii's first update lands on nothing
    assert nb_counts("1 A.i") == [False, False] + [False] * later
    assert nb_counts("1 A.ii") == [False, True] + [False] * later
    assert nb_counts("1 A.iii") == [False, True] + [True] * later  # no residual: index alone


def test_dedup_is_validated_like_the_other_flags():
    with pytest.raises(ConfigError, match="dedup must be true or false") as error:
        method_spec("trace-b", dedup="yes")
    assert error.value.field == "dedup"
    with pytest.raises(ConfigError, match="unknown parameter 'dedupe'.*did you mean 'dedup'"):
        method_spec("astra", dedupe=False)
    with pytest.raises(ConfigError, match="unknown parameter 'dedup'"):
        method_spec("voltage", dedup=True)
    assert method_spec("trace-nb").params()["dedup"] is True
    assert method_spec("astra", dedup=False).params()["dedup"] is False
