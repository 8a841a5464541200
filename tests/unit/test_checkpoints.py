"""Checkpoints in the layouts real weights come in: timm's (plain, wrapped, `module.`,
training checkpoints with `args` and EMA weights) and Hugging Face's ViT and ViViT
(save_pretrained folders, safetensors, sharded, transformers 5's in-memory names).

The HF files are written here under HF's own names (spelled out below, from transformers'
ViT/ViViT modules: checked once against transformers 5.24's save_pretrained, logits within
3.3e-7), from a model of ours; loading them back must give that model's logits bit for bit."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import tracevq
from testbed.errors import ConfigError
from tracevq.checkpoint import load_checkpoint
from tracevq.config import ModelConfig
from tracevq.errors import CheckpointError, InputShapeError
from tracevq.models import VisionTransformer


def hf_names(model: VisionTransformer, prefix: str, v5: bool = False) -> dict:
    """Our state dict under HF's names (transformers 4's on-disk ones, or 5's in memory)."""
    state = model.state_dict()
    out = {
        f"{prefix}.embeddings.cls_token": state["cls_token"],
        f"{prefix}.embeddings.position_embeddings": state["pos_embed"],
        f"{prefix}.embeddings.patch_embeddings.projection.weight": state["patch_embed.proj.weight"],
        f"{prefix}.embeddings.patch_embeddings.projection.bias": state["patch_embed.proj.bias"],
        f"{prefix}.layernorm.weight": state["norm.weight"],
        f"{prefix}.layernorm.bias": state["norm.bias"],
        "classifier.weight": state["head.weight"],
        "classifier.bias": state["head.bias"],
    }
    for i in range(model.config.depth):
        layer = f"{prefix}.layers.{i}" if v5 else f"{prefix}.encoder.layer.{i}"
        for kind in ("weight", "bias"):
            q, k, v = state[f"blocks.{i}.attn.qkv.{kind}"].chunk(3)
            if v5:
                names = {"attention.q_proj": q, "attention.k_proj": k, "attention.v_proj": v}
                names |= {"attention.o_proj": state[f"blocks.{i}.attn.proj.{kind}"]}
                names |= {"mlp.fc1": state[f"blocks.{i}.mlp.fc1.{kind}"]}
                names |= {"mlp.fc2": state[f"blocks.{i}.mlp.fc2.{kind}"]}
            else:
                names = {
                    "attention.attention.query": q,
                    "attention.attention.key": k,
                    "attention.attention.value": v,
                    "attention.output.dense": state[f"blocks.{i}.attn.proj.{kind}"],
                    "intermediate.dense": state[f"blocks.{i}.mlp.fc1.{kind}"],
                    "output.dense": state[f"blocks.{i}.mlp.fc2.{kind}"],
                }
            names |= {
                "layernorm_before": state[f"blocks.{i}.norm1.{kind}"],
                "layernorm_after": state[f"blocks.{i}.norm2.{kind}"],
            }
            out |= {f"{layer}.{name}.{kind}": t.clone().contiguous() for name, t in names.items()}
    return out


def hf_config(config: ModelConfig, hidden_act: str, eps: float) -> dict:
    """The fields of an HF ViTConfig / VivitConfig that describe our model."""
    fields = {
        "image_size": config.image_size,
        "num_channels": config.in_chans,
        "hidden_size": config.dim,
        "num_hidden_layers": config.depth,
        "num_attention_heads": config.heads,
        "intermediate_size": config.mlp_dim,
        "hidden_act": hidden_act,
        "layer_norm_eps": eps,
        "qkv_bias": True,
        "id2label": {str(i): f"class {i}" for i in range(config.num_classes)},
    }
    if config.is_video:
        fields |= {
            "model_type": "vivit",
            "num_frames": config.frames,
            "tubelet_size": [config.tubelet, config.patch_size, config.patch_size],
        }
    else:
        fields |= {"model_type": "vit", "patch_size": config.patch_size}
    return fields


def logits(model, seed: int = 3) -> torch.Tensor:
    x = torch.randn(model.config.input_shape(2), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize(
    ("name", "prefix", "hidden_act", "eps", "act"),
    [
        ("vit-tiny", "vit", "gelu", 1e-12, "gelu"),
        ("vivit-tiny", "vivit", "gelu_fast", 1e-6, "gelu_tanh"),
    ],
)
def test_a_save_pretrained_folder_loads_strictly_with_its_numerics(
    tmp_path: Path, name, prefix, hidden_act, eps, act
):
    config = tracevq.model_config(name, act=act, norm_eps=eps)
    saved = VisionTransformer(config).eval()
    save_file(hf_names(saved, prefix), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config(config, hidden_act, eps)))
    loaded = load_checkpoint(tracevq.build_model(name), tmp_path)  # built with gelu, 1e-6
    assert (loaded.config.act, loaded.config.norm_eps) == (act, eps)
    assert torch.equal(logits(loaded), logits(saved))
    if act == "gelu_tanh":  # the activation matters: exact GELU gives other logits
        assert not torch.equal(logits(VisionTransformer(config)), logits(saved))


def test_transformers_5_names_and_a_sharded_folder_load(tmp_path: Path):
    saved = tracevq.build_model("vit-tiny", seed=4)
    torch.save(hf_names(saved, "vit", v5=True), tmp_path / "in-memory.pth")
    assert torch.equal(
        logits(load_checkpoint(tracevq.build_model("vit-tiny"), tmp_path / "in-memory.pth")),
        logits(saved),
    )
    folder = tmp_path / "sharded"
    folder.mkdir()
    state = hf_names(saved, "vit")
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(folder / shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert torch.equal(
        logits(load_checkpoint(tracevq.build_model("vit-tiny"), folder)), logits(saved)
    )


def test_an_hf_config_for_another_shape_or_activation_is_refused(tmp_path: Path):
    model = tracevq.build_model("vit-tiny")
    save_file(hf_names(model, "vit"), str(tmp_path / "model.safetensors"))
    config = hf_config(model.config, "gelu", 1e-12)
    (tmp_path / "config.json").write_text(json.dumps(config | {"num_attention_heads": 8}))
    with pytest.raises(
        CheckpointError, match=r"another model than 'vit-tiny': heads 8 \(model: 4\)"
    ):
        load_checkpoint(tracevq.build_model("vit-tiny"), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config | {"hidden_act": "quick_gelu"}))
    with pytest.raises(CheckpointError, match=r"hidden_act 'quick_gelu' is not supported"):
        load_checkpoint(tracevq.build_model("vit-tiny"), tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=r"has none of model.safetensors"):
        load_checkpoint(tracevq.build_model("vit-tiny"), empty)


def test_timm_layouts_load_and_a_training_checkpoint_gives_its_ema_when_asked(tmp_path: Path):
    weights, ema = tracevq.build_model("vit-tiny", seed=5), tracevq.build_model("vit-tiny", seed=6)
    plain, wrapped = tmp_path / "plain.pth", tmp_path / "wrapped.pth"
    torch.save(weights.state_dict(), plain)
    torch.save({"state_dict": {f"module.{k}": v for k, v in weights.state_dict().items()}}, wrapped)
    training = tmp_path / "checkpoint-9.pth.tar"  # as timm's train.py saves it
    torch.save(
        {
            "epoch": 9,
            "arch": "vit_tiny",
            "state_dict": weights.state_dict(),
            "optimizer": torch.optim.AdamW(weights.parameters()).state_dict(),
            "version": 2,
            "args": argparse.Namespace(model="vit_tiny", lr=1e-3, epochs=10, amp=False),
            "state_dict_ema": ema.state_dict(),
            "metric": 81.5,
        },
        training,
    )
    for path in (plain, wrapped, training):
        assert torch.equal(
            logits(load_checkpoint(tracevq.build_model("vit-tiny"), path)), logits(weights)
        )
    loaded = load_checkpoint(tracevq.build_model("vit-tiny"), training, ema=True)
    assert torch.equal(logits(loaded), logits(ema))
    with pytest.raises(CheckpointError, match=r"plain.pth holds no EMA weights"):
        load_checkpoint(tracevq.build_model("vit-tiny"), plain, ema=True)


class Payload:
    """Anything but tensors and containers: unpickling it would run code from the file."""

    ran = False

    def __reduce__(self):
        return (Payload.mark, ())

    @staticmethod
    def mark():
        Payload.ran = True


def test_a_checkpoint_that_would_run_code_is_refused_with_what_to_do(tmp_path: Path):
    path = tmp_path / "pickled.pth"
    torch.save(
        {"state_dict": tracevq.build_model("vit-tiny").state_dict(), "hook": Payload()}, path
    )
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(tracevq.build_model("vit-tiny"), path)
    assert not Payload.ran
    message = str(caught.value)
    assert "refers to getattr (beyond tensors and containers)" in message, message
    assert "weights_only=False" in message and "\n" not in message


@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [
        (
            "vit-tiny",
            (1, 32, 32, 3),
            r"\(B, 3, 32, 32\), i\.e\. \(batch, C, H, W\), channels first; given \(1, 32, 32, 3\)",
        ),
        ("vit-tiny", (1, 3, 256, 256), r".*given \(1, 3, 256, 256\)"),
        ("vivit-tiny", (1, 4, 3, 32, 32), r"\(B, 3, 4, 32, 32\), i\.e\. \(batch, C, T, H, W\)"),
    ],
)
def test_an_input_of_the_wrong_shape_or_layout_is_one_line(name, shape, expected):
    model = tracevq.build_model(name)
    with pytest.raises(InputShapeError, match=f"model '{name}' takes input {expected}") as caught:
        model(torch.zeros(shape))
    assert "\n" not in str(caught.value)


def test_a_runs_copy_keeps_the_numerics_and_devices_read_it(tmp_path: Path):
    """The orchestrator reads a checkpoint once (here an HF folder with the tanh GELU) and
    gives the devices one safetensors file of our names whose metadata carries the numerics."""
    from testbed.experiment.schema import Experiment
    from testbed.sweep.bundles import prepare_checkpoint

    config = tracevq.model_config("vit-tiny", act="gelu_tanh", norm_eps=1e-12)
    saved = VisionTransformer(config).eval()
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file(hf_names(saved, "vit"), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf_config(config, "gelu_new", 1e-12)))
    experiment = Experiment.model_validate(
        {
            "name": "hf",
            "methods": [{"name": "voltage"}],
            "model": {"name": "vit-tiny", "checkpoint": str(folder)},
        }
    )
    copy = prepare_checkpoint(experiment, tmp_path)
    assert copy == tmp_path / "checkpoint.safetensors"
    device = load_checkpoint(tracevq.build_model("vit-tiny"), copy)
    assert (device.config.act, device.config.norm_eps) == ("gelu_tanh", 1e-12)
    assert torch.equal(logits(device), logits(saved))
    wrong = Experiment.model_validate(
        {
            "name": "hf",
            "methods": [{"name": "voltage"}],
            "model": {"name": "vit-digits", "checkpoint": str(folder)},
        }
    )
    with pytest.raises(
        ConfigError,
        match=r"^model\.checkpoint: checkpoint .* another model than .vit-digits.",
    ):
        prepare_checkpoint(wrong, tmp_path)
