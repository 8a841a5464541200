import math

import pytest
import torch

import tracevq
import tracevq.spec
from tracevq.bundle import Bundle, FitSettings, fit_bundle
from tracevq.engine import DeviceRun
from tracevq.errors import ConfigError, ProtocolError
from tracevq.methods import auto_level, make_method
from tracevq.payload import exchanges

K = 16
ALL = [
    ("voltage", {}),
    ("prism", {"segment": 3}),
    ("astra", {"K": K}),
    ("astra", {"K": K, "packed": True}),
    ("trace-b", {"K": K}),
    ("trace-b", {"K": K, "buffers": False}),
    ("trace-nb", {"K": K}),
    ("trace-nb", {"K": K, "placement": "1 A.ii"}),
    ("trace-nb", {"K": K, "placement": "1 A.iii"}),
    ("trace-nb", {"K": K, "placement": "1 B"}),
    ("trace-nb", {"K": K, "placement": "1 B", "remote_ffn": True}),
    ("trace-b", {"K": K, "placement": "2 A"}),
]


@pytest.fixture(scope="module")
def model():
    return tracevq.build_model("vit-tiny")


@pytest.fixture(scope="module")
def bundle(model):
    generator = torch.Generator().manual_seed(1)
    calibration = torch.randn(model.config.input_shape(16), generator=generator)
    return fit_bundle(model, calibration, FitSettings(K))


@pytest.fixture(scope="module")
def inputs(model):
    return torch.randn(model.config.input_shape(3), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("devices", [2, 3])
def test_voltage_reproduces_the_single_device_model(model, inputs, devices):
    result = tracevq.simulate(model, inputs, "voltage", devices)
    torch.testing.assert_close(result.logits, model(inputs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("video", [False, True])
def test_voltage_on_video_reproduces_the_single_device_model(video):
    model = tracevq.build_model("vivit-tiny" if video else "vit-tiny", seed=3)
    x = torch.randn(model.config.input_shape(2))
    result = tracevq.simulate(model, x, "voltage", 4)
    torch.testing.assert_close(result.logits, model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("method", "params"), ALL)
def test_one_device_is_the_plain_model(model, bundle, inputs, method, params):
    result = tracevq.simulate(model, inputs, method, 1, bundle=bundle, **params)
    torch.testing.assert_close(result.logits, model(inputs))
    assert result.payload_bits.sum() == 0


def test_prism_with_segments_of_one_token_is_exact(model, inputs):
    result = tracevq.simulate(model, inputs, "prism", 2, segment=1)
    torch.testing.assert_close(result.logits, model(inputs), atol=1e-5, rtol=1e-5)


def test_trace_b_buffers_give_the_same_outputs_as_the_full_chain(model, bundle, inputs):
    on = tracevq.simulate(model, inputs, "trace-b", 3, bundle=bundle, K=K)
    off = tracevq.simulate(model, inputs, "trace-b", 3, bundle=bundle, K=K, buffers=False)
    torch.testing.assert_close(on.logits, off.logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("method", "params"), ALL)
@pytest.mark.parametrize("devices", [2, 3])
def test_payload_bits_and_wire_bytes_match_the_analytic_table(
    model, bundle, inputs, method, params, devices
):
    result = tracevq.simulate(model, inputs, method, devices, bundle=bundle, **params)
    analytic = tracevq.payload_bits("vit-tiny", method, devices, batch=3, **params)
    spec = tracevq.spec.method_spec(method, **params)
    depth = model.config.depth
    assert result.payload_bits.shape == (depth, devices)
    # exact-embedding placements ("1 A.*", "2 A") send nothing for block 0
    sent = [
        block > 0 or spec.resolved_placement is None or spec.resolved_placement.sends_vq0
        for block in range(depth)
    ]
    for block, block_bits in enumerate(result.payload_bits):
        assert block_bits.tolist() == (analytic if sent[block] else [0] * devices)
    assert (result.payload_bits.sum(axis=0) == [exchanges(spec, depth) * a for a in analytic]).all()
    assert (result.wire_bytes == -(-result.payload_bits // 8)).all()


def test_paper_payload_figures_for_vit_b16():
    # Table II with N_p = 99 on device 0 of P = 2 (the paper's 998-bit Trace message)
    bits = {
        ("voltage", ()): 32 * 99 * 768,
        ("prism", ()): 32 * 10 * 768,
        ("astra", ()): 16 * 99,
        ("astra", (("packed", True),)): 10 * 99,
        ("trace-b", ()): 998,
        ("trace-nb", (("level_k", 32),)): 99 * 5 + 8,
        ("trace-b", (("level_k", 2),)): 99 + 8,
    }
    for (method, params), expected in bits.items():
        assert tracevq.payload_bits("vit-b16", method, 2, **dict(params))[0] == expected
    voltage = tracevq.payload_bits("vit-b16", "voltage", 2)[0]
    assert round(voltage / 998) == 2438  # the paper: 2,426x, with N_p = 98.5 for Voltage
    assert round(32 * 98.5 * 768 / 998) == 2426


def test_coarser_levels_lose_more_accuracy(model, bundle, inputs):
    reference = model(inputs)
    errors = []
    for level_k in (2, 4, 16):
        logits = tracevq.simulate(
            model, inputs, "trace-b", 2, bundle=bundle, K=K, level_k=level_k
        ).logits
        errors.append((logits - reference).pow(2).mean().item())
    assert errors[0] > errors[2]
    assert errors[2] > 0


def test_level_can_change_between_inferences_without_new_buffers(model, bundle, inputs):
    method = make_method("trace-b", model, bundle, K=K)
    buffers = method.buffers
    fine = tracevq.simulate(model, inputs, method, 2).logits
    method.set_level(0)
    coarse = tracevq.simulate(model, inputs, method, 2).logits
    expected = tracevq.simulate(model, inputs, "trace-b", 2, bundle=bundle, K=K, level_k=2)
    torch.testing.assert_close(coarse, expected.logits)
    assert not torch.allclose(fine, coarse)
    assert method.buffers is buffers
    assert method.buffer_bytes == model.config.depth * K * 2 * model.config.dim * 4


def test_codebook_methods_need_a_matching_bundle(model, bundle):
    with pytest.raises(ConfigError, match="needs a bundle"):
        make_method("trace-b", model, None, K=K)
    with pytest.raises(ConfigError, match="asks for K=1024 but the bundle's codebooks have K=16"):
        make_method("astra", model, bundle)
    with pytest.raises(ConfigError, match=r"unknown parameter 'segment'.*accepts K, level_k"):
        make_method("trace-b", model, bundle, K=K, segment=3)
    with pytest.raises(ConfigError, match=r"level_k must be 'auto' or an integer in 2..K=16"):
        make_method("trace-b", model, bundle, K=K, level_k=64)
    with pytest.raises(ConfigError, match=r"level_min_k bounds level_k: auto from below"):
        make_method("trace-b", model, bundle, K=K, level_k=8, level_min_k=4)
    with pytest.raises(ConfigError, match=r"level_min_k must be an integer in 2..K=16, got 32"):
        make_method("trace-nb", model, bundle, K=K, level_k="auto", level_min_k=32)
    with pytest.raises(ConfigError, match=r"no codebook tree level has 3 codewords"):
        make_method("trace-b", model, bundle, K=K, level_k="auto", level_min_k=3)


def test_auto_never_goes_below_its_floor():
    bits = [1, 2, 3, 4]  # levels 0..3
    assert auto_level(bits, 1000, 1e6, budget_ms=0.1) == 0  # nothing fits: the coarsest
    assert auto_level(bits, 1000, 1e6, budget_ms=0.1, floor=2) == 2
    assert auto_level(bits, 1000, 1e6, budget_ms=4.5, floor=2) == 3  # 4,008 bits in 4.0 ms
    assert auto_level(bits, 1000, 1e6, budget_ms=3.5, floor=1) == 2  # above it, as without


def _messages(method, model, inputs, rank=1):
    run = DeviceRun(method, rank, 2, inputs)
    first = run.begin_block(0)
    return run, first


def test_a_desynchronised_trace_message_names_peer_and_block(model, bundle, inputs):
    method = make_method("trace-b", model, bundle, K=K)
    _, message = _messages(method, model, inputs)
    receiver = DeviceRun(method, 0, 2, inputs).receivers[1]
    with pytest.raises(ProtocolError, match=r"device 1 for block 3: .*block counter"):
        receiver.remote_kv(3, message)
    with pytest.raises(ProtocolError, match=r"device 1 for block 0: .*byte"):
        receiver.remote_kv(0, message[:-1])


def test_a_truncated_voltage_message_is_refused(model, inputs):
    method = make_method("voltage", model)
    _, message = _messages(method, model, inputs)
    receiver = DeviceRun(method, 0, 2, inputs).receivers[1]
    expected = 3 * 8 * model.config.dim * 4
    with pytest.raises(ProtocolError, match=f"expected {expected} bytes, got {expected - 4}"):
        receiver.remote_kv(0, message[:-4])


def test_bundle_round_trip_keeps_fingerprint_and_outputs(tmp_path, model, bundle, inputs):
    path = bundle.save(tmp_path / "bundle.pt")
    loaded = Bundle.load(path)
    assert loaded.fingerprint == bundle.fingerprint
    assert loaded.model_fingerprint == bundle.model_fingerprint
    for method in ("astra", "trace-nb"):
        a = tracevq.simulate(model, inputs, method, 2, bundle=bundle, K=K).logits
        b = tracevq.simulate(model, inputs, method, 2, bundle=loaded, K=K).logits
        torch.testing.assert_close(a, b)


def test_bundle_fingerprint_depends_on_the_codebooks(model):
    calibration = torch.randn(model.config.input_shape(4))
    a = fit_bundle(model, calibration, FitSettings(8, families=("trace-b",), seed=0))
    b = fit_bundle(model, calibration, FitSettings(8, families=("trace-b",), seed=5))
    assert a.fingerprint != b.fingerprint


def test_projected_codebooks_fold_into_the_buffers(model, inputs):
    calibration = torch.randn(model.config.input_shape(16))
    bundle = fit_bundle(model, calibration, FitSettings(K, families=("trace-b",), code_dim=8))
    assert bundle.quantizers["trace-b"][1].codebook.shape == (K, 8)
    on = tracevq.simulate(model, inputs, "trace-b", 2, bundle=bundle, K=K)
    off = tracevq.simulate(model, inputs, "trace-b", 2, bundle=bundle, K=K, buffers=False)
    torch.testing.assert_close(on.logits, off.logits, atol=1e-5, rtol=1e-5)
    assert on.payload_bits[0, 0] == 3 * 9 * math.ceil(math.log2(K)) + 8


def test_bad_bundle_file_is_a_config_error(tmp_path):
    path = tmp_path / "junk.pt"
    path.write_bytes(b"not a bundle")
    with pytest.raises(ConfigError, match="cannot be read"):
        Bundle.load(path)


def test_placement_is_validated_and_named():
    from tracevq.spec import method_spec

    assert method_spec("trace-nb").placement == "1 A.i"
    assert method_spec("trace-b").placement == "2 B"
    assert method_spec("trace-nb", placement="1 B").params()["placement"] == "1 B"
    with pytest.raises(ConfigError, match=r"placement must be one of '1 A.i'.*did you mean '1 B'"):
        method_spec("trace-nb", placement="1B")
    with pytest.raises(ConfigError, match="placement '2 A' is a case of 'trace-b'") as error:
        method_spec("trace-nb", placement="2 A")
    assert error.value.field == "placement"
    with pytest.raises(ConfigError, match="placement '1 A.i' is a case of 'trace-nb'"):
        method_spec("trace-b", placement="1 A.i")
    with pytest.raises(ConfigError, match="placement must be one of") as error:
        method_spec("trace-b", placement=2)
    assert error.value.field == "placement"
    with pytest.raises(ConfigError, match="unknown parameter 'placement'"):
        method_spec("astra", placement="2 B")
    with pytest.raises(ConfigError, match="unknown parameter 'remote_ffn'"):
        method_spec("trace-b", remote_ffn=True)
    with pytest.raises(ConfigError, match="remote_ffn must be true or false"):
        method_spec("trace-nb", remote_ffn="no")


def test_exact_embedding_placements_count_one_message_fewer():
    from tracevq.spec import method_spec

    # ViT-B/16, P = 2, device 0: 99 indices of 10 bits and the header, per message
    assert tracevq.payload_bits("vit-b16", "trace-nb", 2) == [998, 988]
    assert exchanges(method_spec("trace-nb"), 12) == 11  # 1 A.i: X^(0) embedded locally
    assert exchanges(method_spec("trace-nb", placement="1 B"), 12) == 12
    assert exchanges(method_spec("trace-b", placement="2 A"), 12) == 11
    assert exchanges(method_spec("trace-b"), 12) == 12
    assert exchanges(method_spec("astra"), 12) == 12


def test_a_receiver_decodes_at_the_level_in_the_header(model, bundle, inputs):
    """A message encoded at level 0 read by a receiver whose own method is at the finest
    level: the rows of level 0 (the header's), not of the receiver's level."""
    coarse = make_method("trace-b", model, bundle, K=K, level_k=2)
    _, message = _messages(coarse, model, inputs)
    expected = DeviceRun(coarse, 0, 2, inputs).receivers[1].remote_kv(0, message)
    fine = make_method("trace-b", model, bundle, K=K)
    got = DeviceRun(fine, 0, 2, inputs).receivers[1].remote_kv(0, message)
    torch.testing.assert_close(got.rows, expected.rows)
    assert len(torch.unique(got.rows)) <= 2  # level 0: two codewords


def test_a_session_of_devices_at_different_levels(model, bundle, inputs):
    """`simulate(levels=...)`: each device encodes at its own level. Both at level 0 is the
    uniform run at level_k 2; device 0 coarse and device 1 fine is neither uniform run."""
    method = make_method("trace-b", model, bundle, K=K)
    finest = len(method.level_bits) - 1
    uniform = tracevq.simulate(model, inputs, "trace-b", 2, bundle=bundle, K=K, level_k=2)
    both = tracevq.simulate(model, inputs, method, 2, levels=[0, 0])
    torch.testing.assert_close(both.logits, uniform.logits)
    assert method.level == finest  # as given
    mixed = tracevq.simulate(model, inputs, method, 2, levels=[0, finest])
    fine = tracevq.simulate(model, inputs, method, 2)
    assert not torch.allclose(mixed.logits, uniform.logits)
    assert not torch.allclose(mixed.logits, fine.logits)
    assert mixed.payload_bits[1, 0] < mixed.payload_bits[1, 1]  # device 0 sends fewer bits
    with pytest.raises(ConfigError, match=r"levels \[0\]: one per device"):
        tracevq.simulate(model, inputs, method, 2, levels=[0])


def test_search_beam_is_a_trace_parameter_checked_in_one_line():
    from tracevq.spec import method_spec

    assert method_spec("trace-b", search_beam=2).params()["search_beam"] == 2
    assert method_spec("trace-nb").params()["search_beam"] is None
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="search_beam must be a positive integer") as error:
            method_spec("trace-b", search_beam=bad)
        assert error.value.field == "search_beam"
    with pytest.raises(ConfigError, match="unknown parameter 'search_beam'"):
        method_spec("astra", search_beam=2)


@pytest.mark.parametrize("method", ["trace-b", "trace-nb"])
def test_a_beam_search_sends_indices_the_exact_search_would_send_or_near_ones(
    model, bundle, inputs, method
):
    """K = 16 makes 4 groups of 4: a beam of 4 is the exact search, byte for byte; a beam of
    one sends messages of the same size whose codewords lie no nearer than the exact ones."""
    exact = tracevq.simulate(model, inputs, method, 2, bundle=bundle, K=K)
    wide = tracevq.simulate(model, inputs, method, 2, bundle=bundle, K=K, search_beam=4)
    torch.testing.assert_close(wide.logits, exact.logits, rtol=0, atol=0)
    narrow = tracevq.simulate(model, inputs, method, 2, bundle=bundle, K=K, search_beam=1)
    assert (narrow.wire_bytes == exact.wire_bytes).all()
    assert torch.isfinite(narrow.logits).all()
    tree = bundle.trees[method][3]
    rows = torch.randn(200, tree.codebook.shape[1], generator=torch.Generator().manual_seed(7))
    finest = tree.num_levels - 1
    found, nearest = tree.encode(rows, finest, beam=1), tree.encode(rows, finest)
    distance = ((rows - tree.codebook[found]) ** 2).sum(1)
    assert (distance >= ((rows - tree.codebook[nearest]) ** 2).sum(1) - 1e-5).all()
    assert 0 < int((found == nearest).sum()) < len(rows)


# unequal partitions (devices.partition): every method runs and is exact where it was
UNEQUAL = [[12, 5], [1, 16], [3, 9, 5], [2, 2, 13]]  # vit-tiny has 17 tokens


@pytest.mark.parametrize("sizes", [[150, 47], [40, 80, 77], [196, 1]])
def test_voltage_with_an_unequal_partition_is_the_single_device_model(sizes):
    model = tracevq.build_model("vit-b16", seed=5)
    x = torch.randn(model.config.input_shape(1), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        single = model(x)
        result = tracevq.simulate(model, x, "voltage", sizes)
    torch.testing.assert_close(result.logits, single, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("method", "params"), ALL)
@pytest.mark.parametrize("sizes", UNEQUAL)
def test_payload_bits_per_device_follow_an_unequal_partition(
    model, bundle, inputs, method, params, sizes
):
    devices, depth = len(sizes), model.config.depth
    result = tracevq.simulate(model, inputs, method, sizes, bundle=bundle, **params)
    analytic = tracevq.payload_bits("vit-tiny", method, devices, batch=3, sizes=sizes, **params)
    spec = tracevq.spec.method_spec(method, **params)
    if method == "voltage":  # every token's activations, fp32, batch of 3
        assert analytic == [32 * 3 * model.config.dim * n for n in sizes]
    for block, block_bits in enumerate(result.payload_bits):
        sent = block > 0 or spec.resolved_placement is None or spec.resolved_placement.sends_vq0
        assert block_bits.tolist() == (analytic if sent else [0] * devices)
    assert (result.payload_bits.sum(axis=0) == [exchanges(spec, depth) * a for a in analytic]).all()


@pytest.mark.parametrize("sizes", UNEQUAL[2:])
def test_trace_b_buffers_are_exact_at_an_unequal_partition(model, bundle, inputs, sizes):
    on = tracevq.simulate(model, inputs, "trace-b", sizes, bundle=bundle, K=K)
    off = tracevq.simulate(model, inputs, "trace-b", sizes, bundle=bundle, K=K, buffers=False)
    torch.testing.assert_close(on.logits, off.logits, atol=1e-5, rtol=1e-5)


def test_partitions_by_rate_and_their_refusals():
    from tracevq.partition import partition_ranges, sizes_by_rates

    assert sizes_by_rates(197, [1, 0.5]) == [131, 66]
    assert sizes_by_rates(197, [1, 1]) == [99, 98]
    assert sizes_by_rates(197, [0.6, 0.3, 0.6]) == [79, 40, 78]
    assert sizes_by_rates(5, [1, 1e-9]) == [4, 1]  # every device holds at least one token
    assert partition_ranges(17, 3, [3, 9, 5]) == [(0, 3), (3, 12), (12, 17)]
    with pytest.raises(ConfigError, match=r"holds 16 tokens, the model has 17"):
        partition_ranges(17, 2, [12, 4])
    with pytest.raises(ConfigError, match="is for 2 devices, not 3"):
        partition_ranges(17, 3, [12, 5])
    with pytest.raises(ConfigError, match="at least 1"):
        partition_ranges(17, 2, [17, 0])
