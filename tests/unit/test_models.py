import pytest
import torch

import tracevq
from tracevq.checkpoint import load_checkpoint
from tracevq.errors import CheckpointError, ConfigError
from tracevq.partition import partition_ranges, partition_sizes


def test_named_configs_have_the_papers_token_counts():
    assert tracevq.model_config("vit-b16").tokens == 197
    assert tracevq.model_config("vivit-b").tokens == 3137
    assert tracevq.model_config("vit-b16").head_dim == 64


def test_unknown_model_and_override_are_named_with_a_hint():
    with pytest.raises(ConfigError, match=r"unknown model 'vit-b61'.*did you mean 'vit-b16'"):
        tracevq.model_config("vit-b61")
    with pytest.raises(ConfigError, match=r"unknown override 'depht'.*did you mean 'depth'"):
        tracevq.model_config("vit-tiny", depht=2)


@pytest.mark.parametrize(
    ("tokens", "devices", "sizes"),
    [(197, 2, [99, 98]), (197, 3, [66, 66, 65]), (3137, 10, [314] * 7 + [313] * 3), (17, 1, [17])],
)
def test_partitions_differ_by_at_most_one(tokens, devices, sizes):
    assert partition_sizes(tokens, devices) == sizes
    ranges = partition_ranges(tokens, devices)
    assert ranges[0][0] == 0 and ranges[-1][1] == tokens
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_more_devices_than_tokens_is_refused():
    with pytest.raises(ConfigError, match="exceed the sequence length"):
        partition_sizes(3, 4)


@pytest.mark.parametrize("name", ["vit-tiny", "vivit-tiny"])
def test_partial_embedding_matches_the_convolution(name):
    model = tracevq.build_model(name)
    x = torch.randn(model.config.input_shape(2))
    reference = model.patch_embed.proj(x).flatten(2).transpose(1, 2)
    torch.testing.assert_close(model.patch_embed(x), reference, atol=1e-5, rtol=1e-5)
    full = model.embed(x)
    torch.testing.assert_close(model.embed(x, 5, 11), full[:, 5:11])
    assert model(x).shape == (2, model.config.num_classes)


def test_parameter_names_follow_timm():
    names = set(tracevq.build_model("vit-tiny").state_dict())
    for name in (
        "cls_token",
        "pos_embed",
        "patch_embed.proj.weight",
        "blocks.0.norm1.weight",
        "blocks.3.attn.qkv.bias",
        "blocks.0.attn.proj.weight",
        "blocks.0.mlp.fc1.weight",
        "blocks.0.mlp.fc2.bias",
        "norm.weight",
        "head.weight",
    ):
        assert name in names


def test_build_model_is_deterministic_per_seed():
    a, b, c = (tracevq.build_model("vit-tiny", seed=s) for s in (0, 0, 1))
    assert torch.equal(a.pos_embed, b.pos_embed)
    assert not torch.equal(a.pos_embed, c.pos_embed)


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_checkpoint_round_trip(tmp_path, suffix):
    source, target = tracevq.build_model("vit-tiny", seed=1), tracevq.build_model("vit-tiny")
    path = tmp_path / f"weights{suffix}"
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(path))
    else:
        torch.save({"model": source.state_dict()}, path)
    load_checkpoint(target, path)
    x = torch.randn(source.config.input_shape(1))
    torch.testing.assert_close(target(x), source(x))


def test_checkpoint_mismatch_names_every_kind_of_bad_key(tmp_path):
    state = tracevq.build_model("vit-tiny").state_dict()
    del state["blocks.1.mlp.fc1.bias"]
    state["fc_norm.weight"] = torch.ones(64)
    state["head.weight"] = torch.zeros(1000, 64)
    path = tmp_path / "bad.pt"
    torch.save(state, path)
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(tracevq.build_model("vit-tiny"), path)
    message = str(caught.value)
    assert "missing: blocks.1.mlp.fc1.bias" in message
    assert "unexpected: fc_norm.weight" in message
    assert "wrong shape: head.weight (1000, 64) (model: (10, 64))" in message


def test_missing_checkpoint_file_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint file not found"):
        load_checkpoint(tracevq.build_model("vit-tiny"), tmp_path / "nope.pth")
