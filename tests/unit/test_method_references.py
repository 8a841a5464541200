"""Methods against references written out here, on inputs where a wrong method shows.

A freshly initialised model changes the residual by about 1% per block, so quantising the block
input X instead of the post-attention residual Z gives the same logits; the model here has its
attention and FFN outputs scaled until each block's attention moves the residual by at least
half its norm. Prism is checked at segments of several tokens, where its log(count) bias
matters.
"""

import pytest
import torch

import tracevq
import tracevq.partition
from tracevq.bundle import FitSettings, fit_bundle
from tracevq.engine import DeviceRun
from tracevq.errors import ConfigError
from tracevq.methods import make_method
from tracevq.partition import partition_ranges

K = 64
STRONG_SCALE = 20.0  # on W_O and (half of it) on fc2: every block's |Z - X| / |X| >= 0.5


@pytest.fixture(scope="module")
def strong_model():
    model = tracevq.build_model("vit-tiny", seed=7)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.mul_(3.0)
            block.attn.proj.weight.mul_(STRONG_SCALE)
            block.mlp.fc2.weight.mul_(STRONG_SCALE / 2)
    return model


@pytest.fixture(scope="module")
def inputs(strong_model):
    shape = strong_model.config.input_shape(3)
    return torch.randn(shape, generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def bundle(strong_model):
    shape = strong_model.config.input_shape(24)
    calibration = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    return fit_bundle(strong_model, calibration, FitSettings(K))


@torch.no_grad()
def residual_ratios(model, inputs) -> list[float]:
    """|Z - X| / |X| of every block: how far attention moves the residual stream."""
    x, ratios = model.embed(inputs), []
    for block in model.blocks:
        z = x + block.attn.attend(*block.attn.qkv_heads(block.norm1(x)))
        ratios.append(float((z - x).norm() / x.norm()))
        x = block.ffn(z)
    return ratios


@torch.no_grad()
def reference(model, inputs, devices, remote_kv):
    """Sequence-parallel inference written out: device p's queries attend over its own exact
    K/V and every peer's `remote_kv(block, peer_state)` (keys, values); a peer's state holds
    its block input `x`, and its previous block's input `x_prev` and residual `z_prev`."""
    ranges = partition_ranges(model.config.tokens, devices)
    states = [{"x": model.embed(inputs, a, b)} for a, b in ranges]
    for index, block in enumerate(model.blocks):
        remote = [remote_kv(index, state) for state in states]
        for p, state in enumerate(states):
            q, k, v = block.attn.qkv_heads(block.norm1(state["x"]))
            peers = [remote[o] for o in range(devices) if o != p]
            keys = torch.cat([k, *(kv[0] for kv in peers)], dim=2)  # (B, H, N, d)
            values = torch.cat([v, *(kv[1] for kv in peers)], dim=2)
            state["z"] = state["x"] + block.attn.attend(q, keys, values)
        for state in states:
            state["x_prev"], state["z_prev"] = state["x"], state.pop("z")
            state["x"] = block.ffn(state["z_prev"])
    return model.classify(states[0]["x"][:, 0])


def trace_b_reference(model, bundle, coded: str):
    """Trace-b at the finest level: peers see g(nearest codeword of `coded`) ("z_prev" is the
    method; "x_prev", the block input, is the mistake this file must catch)."""
    quantizers, _ = bundle.family("trace-b")

    def remote_kv(index, state):
        source = state["x"] if index == 0 else state[coded]
        quantizer = quantizers[index]
        codewords = quantizer.decode(quantizer.nearest(source))  # (B, n, D)
        if index > 0:
            codewords = model.blocks[index - 1].ffn(codewords)
        return model.blocks[index].remote_kv(codewords)

    return remote_kv


def trace_b_exact_first_reference(model, bundle):
    """Trace-b at placement "2 A": block 0 sees the peer's exact embedding X^(0), which the
    receiver computes from the input; after it, g(codeword of Z) as in "2 B"."""
    coded = trace_b_reference(model, bundle, "z_prev")

    def remote_kv(index, state):
        return model.blocks[0].remote_kv(state["x"]) if index == 0 else coded(index, state)

    return remote_kv


# Table VI's pre-residual cases written out: block 0's K/V source, what the first update lands
# on, whether later updates land on the copy's previous state (docs/method.md, VQ placement)
NB_CASES = {
    "1 A.i": ("exact X0", "exact X0", True),
    "1 A.ii": ("exact X0", "nothing", True),
    "1 A.iii": ("exact X0", "nothing", False),
    "1 B": ("VQ_0 codeword", "VQ_0 codeword", True),
}


def trace_nb_reference(model, bundle, placement: str, remote_ffn: bool = False):
    """Trace-nb at the finest level: a peer's copy Z~ = residual + codeword of the update
    Z - X; its K/V come from LN1(Z~), or with `remote_ffn` from LN1(Z~ + FFN(LN2(Z~)))."""
    quantizers, _ = bundle.family("trace-nb")
    first_kv, first_residual, carries = NB_CASES[placement]

    def code(index, rows):
        return quantizers[index].decode(quantizers[index].nearest(rows))  # (B, n, D)

    def remote_kv(index, state):
        if index == 0:
            seen = state["x"] if first_kv == "exact X0" else code(0, state["x"])
            state["copy"] = {"exact X0": state["x"], "nothing": None}.get(first_residual, seen)
        else:
            update = code(index, state["z_prev"] - state["x_prev"])
            z = update if state["copy"] is None else state["copy"] + update
            seen = model.blocks[index - 1].ffn(z) if remote_ffn else z
            state["copy"] = seen if carries else None
        return model.blocks[index].remote_kv(seen)

    return remote_kv


PLACEMENT_CASES = [
    ("trace-nb", "1 A.i", False),
    ("trace-nb", "1 A.ii", False),
    ("trace-nb", "1 A.iii", False),
    ("trace-nb", "1 B", False),
    ("trace-nb", "1 B", True),  # the Trace-nb of before placements
    ("trace-b", "2 A", False),
    ("trace-b", "2 B", False),
]


def placement_reference(model, bundle, method, placement, remote_ffn):
    if method == "trace-nb":
        return trace_nb_reference(model, bundle, placement, remote_ffn)
    if placement == "2 A":
        return trace_b_exact_first_reference(model, bundle)
    return trace_b_reference(model, bundle, "z_prev")


def _placement_params(method, placement, remote_ffn):
    return {"placement": placement, **({"remote_ffn": True} if remote_ffn else {})}


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize(("method", "placement", "remote_ffn"), PLACEMENT_CASES)
def test_every_placement_is_its_reference(
    strong_model, bundle, inputs, devices, dedup, method, placement, remote_ffn
):
    params = _placement_params(method, placement, remote_ffn)
    real = tracevq.simulate(
        strong_model, inputs, method, devices, bundle=bundle, K=K, dedup=dedup, **params
    )
    expected = reference(
        strong_model,
        inputs,
        devices,
        placement_reference(strong_model, bundle, method, placement, remote_ffn),
    )
    torch.testing.assert_close(real.logits, expected, atol=1e-4, rtol=1e-4)
    # payload: one N_p r + 8 message per exchange; the exact-embedding cases skip block 0
    analytic = tracevq.payload_bits("vit-tiny", method, devices, batch=3, K=K, **params)
    first = [0] * devices if placement in ("1 A.i", "1 A.ii", "1 A.iii", "2 A") else analytic
    assert real.payload_bits[0].tolist() == first
    assert all(bits.tolist() == analytic for bits in real.payload_bits[1:])
    assert analytic == [n * 3 * 6 + 8 for n in tracevq.partition.partition_sizes(17, devices)]


def _name(case) -> str:
    return case[1] + (" +ffn" if case[2] else "")


def test_the_placements_are_seven_different_methods(strong_model, bundle, inputs):
    """On the strong model every case (and 1 B with the FFN) gives other logits than every
    other: a receiver that ran the wrong case would fail the reference test above."""
    logits = {
        case: reference(strong_model, inputs, 2, placement_reference(strong_model, bundle, *case))
        for case in PLACEMENT_CASES
    }
    gaps = {
        f"{_name(a)} / {_name(b)}": float((logits[a] - logits[b]).abs().max())
        for i, a in enumerate(PLACEMENT_CASES)
        for b in PLACEMENT_CASES[i + 1 :]
    }
    print("max |logit gap| between cases:", {k: round(v, 3) for k, v in gaps.items()})
    assert min(gaps.values()) > 0.05


def test_the_strong_model_moves_the_residual_by_half_its_norm(strong_model, inputs):
    ratios = residual_ratios(strong_model, inputs)
    print("|Z - X| / |X| per block:", [round(r, 2) for r in ratios])
    assert min(ratios) >= 0.5


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("params", [{}, {"dedup": False}, {"buffers": False}])
def test_trace_b_codes_z_not_x(strong_model, bundle, inputs, devices, params):
    real = tracevq.simulate(strong_model, inputs, "trace-b", devices, bundle=bundle, K=K, **params)
    z_coded = reference(
        strong_model, inputs, devices, trace_b_reference(strong_model, bundle, "z_prev")
    )
    x_coded = reference(
        strong_model, inputs, devices, trace_b_reference(strong_model, bundle, "x_prev")
    )
    torch.testing.assert_close(real.logits, z_coded, atol=1e-4, rtol=1e-4)
    gap = float((x_coded - z_coded).abs().max())
    print(f"max |logits(X coded) - logits(Z coded)| = {gap:.3f}")
    assert gap > 0.05  # a Trace-b that coded X would fail the assert above


def prism_reference(model, segment: int, repeat: bool):
    """Prism's means of LN1(X) over runs of `segment` tokens; each mean key and value repeated
    `count` times (what the log(count) bias must equal), or once (a Prism without the bias)."""

    def remote_kv(index, state):
        block = model.blocks[index]
        h = block.norm1(state["x"])  # (B, n, D)
        groups = h.split(segment, dim=1)
        k, v = block.attn.kv_heads(torch.stack([g.mean(dim=1) for g in groups], dim=1))
        if not repeat:
            return k, v
        counts = torch.tensor([g.shape[1] for g in groups])
        return k.repeat_interleave(counts, dim=2), v.repeat_interleave(counts, dim=2)

    return remote_kv


@pytest.mark.parametrize("devices", [2, 3])
def test_prism_mean_keys_weigh_as_their_run(strong_model, inputs, devices):
    segment = 4  # 17 tokens: runs of 4 and shorter last runs, so counts differ
    real = tracevq.simulate(strong_model, inputs, "prism", devices, segment=segment)
    repeated = reference(
        strong_model, inputs, devices, prism_reference(strong_model, segment, True)
    )
    once = reference(strong_model, inputs, devices, prism_reference(strong_model, segment, False))
    torch.testing.assert_close(real.logits, repeated, atol=1e-4, rtol=1e-4)
    assert float((once - repeated).abs().max()) > 0.05  # a Prism without the bias would fail


ALL = [
    ("voltage", {}),
    ("single", {}),
    ("prism", {"segment": 4}),
    ("astra", {"K": K}),
    ("trace-b", {"K": K}),
    ("trace-b", {"K": K, "dedup": False}),
    ("trace-nb", {"K": K}),
    *((m, {"K": K, **_placement_params(m, p, f)}) for m, p, f in PLACEMENT_CASES),
]


@pytest.mark.parametrize(("method", "params"), ALL)
def test_one_device_through_the_engine_is_the_plain_model(
    strong_model, bundle, inputs, method, params
):
    run = DeviceRun(make_method(method, strong_model, bundle, **params), 0, 1, inputs)
    for block in range(strong_model.config.depth):
        assert run.begin_block(block) is None  # no peers: nothing is made or sent
        assert run.attend(block, {}) is None
        run.finish_block(block)
    with torch.no_grad():
        torch.testing.assert_close(run.logits(), strong_model(inputs), atol=1e-5, rtol=1e-5)


def test_single_is_refused_on_more_than_one_device(strong_model, inputs):
    with pytest.raises(ConfigError, match="'single' runs on one device, not 2.*voltage"):
        tracevq.simulate(strong_model, inputs, "single", 2)
    with pytest.raises(ConfigError, match="'single' runs on one device, not 3"):
        tracevq.payload_bits("vit-tiny", "single", 3)
    assert tracevq.simulate(strong_model, inputs, "single", 1).payload_bits.sum() == 0
    assert tracevq.payload_bits("vit-tiny", "single", 1) == [0]
