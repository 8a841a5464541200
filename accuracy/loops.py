"""Training loops: the single-device model from scratch, and the VQ fine-tuning."""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from accuracy.data import Dataset
from accuracy.quantizer import TrainingCodec
from accuracy.settings import BaseSection, FinetuneSection
from tracevq.distributed import distributed_logits
from tracevq.models import VisionTransformer
from tracevq.spec import MethodSpec

log = logging.getLogger(__name__)


def batches(
    data: Dataset, batch_size: int, generator: torch.Generator, shuffle: bool = True
) -> Iterator[tuple[Tensor, Tensor]]:
    order = torch.randperm(len(data), generator=generator) if shuffle else torch.arange(len(data))
    for start in range(0, len(data), batch_size):
        index = order[start : start + batch_size]
        yield data.take(index), data.labels[index]


def endless_batches(
    data: Dataset, batch_size: int, generator: torch.Generator
) -> Iterator[tuple[Tensor, Tensor]]:
    while True:
        yield from batches(data, batch_size, generator)


def shift(images: Tensor, max_px: int, generator: torch.Generator) -> Tensor:
    """Random translation by up to max_px pixels per axis (one per image), edges replicated."""
    if max_px <= 0:
        return images
    size = images.shape[-1]
    padded = F.pad(images, (max_px,) * 4, mode="replicate")
    offsets = torch.randint(0, 2 * max_px + 1, (len(images), 2), generator=generator)
    rows = [padded[i, :, dy : dy + size, dx : dx + size] for i, (dy, dx) in enumerate(offsets)]
    return torch.stack(rows)


def augmented(images: Tensor, section: BaseSection, generator: torch.Generator) -> Tensor:
    """The training augmentation: random shifts, and with `flip` half the images mirrored
    left-right (drawn after the shifts, so that studies without flips draw as before)."""
    images = shift(images, section.shift_px, generator)
    if section.flip:
        mirrored = torch.rand(len(images), generator=generator) < 0.5
        images = torch.where(mirrored.view(-1, 1, 1, 1), images.flip(-1), images)
    return images


def cosine_lr(step: int, total: int, warmup: int) -> float:
    """Learning-rate factor: linear warm-up then cosine decay to zero."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def train_base(
    model: VisionTransformer, train: Dataset, section: BaseSection, progress: bool = True
) -> list[float]:
    """Train the single-device model from scratch (AdamW, warm-up + cosine, random shifts,
    label smoothing). Returns the mean loss of each epoch."""
    generator = torch.Generator().manual_seed(section.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=section.lr, weight_decay=section.weight_decay
    )
    steps_per_epoch = -(-len(train) // section.batch_size)
    total, warmup = section.epochs * steps_per_epoch, section.warmup_epochs * steps_per_epoch
    model.train()
    losses, step = [], 0
    bar = tqdm(range(section.epochs), desc="base model", unit="epoch", disable=not progress)
    for _ in bar:
        epoch_loss = 0.0
        for images, labels in batches(train, section.batch_size, generator):
            set_lr(optimizer, section.lr * cosine_lr(step, total, warmup))
            logits = model(augmented(images, section, generator))
            loss = F.cross_entropy(logits, labels, label_smoothing=section.label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            epoch_loss += loss.item() / steps_per_epoch
            step += 1
        losses.append(epoch_loss)
        bar.set_postfix(loss=f"{epoch_loss:.3f}")
    return losses


NO_DECAY = ("cls_token", "pos_embed")  # embeddings kept out of weight decay with the norms


def parameter_groups(
    model: VisionTransformer, codec: TrainingCodec, section: FinetuneSection
) -> list[dict[str, object]]:
    """AdamW's groups for fine-tuning, each with its `base_lr`: under `decay: matrices` no weight
    decay on norms, biases, the class token, the position embedding and the codec; the codec
    (gradient codebooks, d_q projections) at `codebook_lr`."""
    matrices_only = section.decay == "matrices"

    def decays(name: str, parameter: Tensor) -> bool:
        return not matrices_only or (parameter.ndim >= 2 and name not in NO_DECAY)

    named = list(model.named_parameters())
    codebook_lr = section.lr if section.codebook_lr is None else section.codebook_lr
    groups = [
        (section.lr, section.weight_decay, [p for n, p in named if decays(n, p)]),
        (section.lr, 0.0, [p for n, p in named if not decays(n, p)]),
        (codebook_lr, 0.0 if matrices_only else section.weight_decay, list(codec.parameters())),
    ]
    return [
        {"params": params, "lr": lr, "base_lr": lr, "weight_decay": decay}
        for lr, decay, params in groups
        if params
    ]


def task_loss(
    logits: Tensor,
    labels: Tensor,
    taught: Tensor | None,
    section: FinetuneSection,
    smoothing: float,
) -> Tensor:
    """Cross-entropy against the labels, or with `section.distill` blended with the KL
    divergence from the teacher's logits `taught` at the distillation's temperature."""
    hard = F.cross_entropy(logits, labels, label_smoothing=smoothing)
    if section.distill is None or taught is None:
        return hard
    temperature, weight = section.distill.temperature, section.distill.weight
    soft = F.kl_div(
        F.log_softmax(logits / temperature, dim=1),
        F.log_softmax(taught / temperature, dim=1),
        log_target=True,
        reduction="batchmean",
    )
    return (1 - weight) * hard + weight * temperature**2 * soft


def finetune(
    model: VisionTransformer,
    codec: TrainingCodec,
    method: MethodSpec,
    train: Dataset,
    section: FinetuneSection,
    augment: BaseSection,
    seed: int,
    progress: bool = False,
) -> list[float]:
    """Fine-tune model and codebooks in the differentiable P-device forward of `method` (a
    Trace method at its placement, with its remote_ffn); P alternates over `section.devices`
    step by step. With `section.distill` the teacher is a frozen copy of `model` as it comes
    in (the base model). Returns the loss of every step."""
    generator = torch.Generator().manual_seed(seed)
    teacher = None
    if section.distill is not None:
        teacher = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(parameter_groups(model, codec, section))
    steps = section.total_steps(len(train))
    warmup = steps // 10 + 1 if section.warmup_steps is None else section.warmup_steps
    model.train()
    codec.train()
    data = endless_batches(train, section.batch_size, generator)
    losses = []
    bar = tqdm(range(steps), desc=f"fine-tune {method.name}", disable=not progress)
    for step in bar:
        images, labels = next(data)
        factor = cosine_lr(step, steps, warmup)
        for group in optimizer.param_groups:
            group["lr"] = group["base_lr"] * factor
        devices = section.devices[step % len(section.devices)]
        images = augmented(images, augment, generator)
        logits = distributed_logits(model, images, devices, method, codec)
        taught = None
        if teacher is not None:
            with torch.no_grad():
                taught = teacher(images)
        loss = task_loss(logits, labels, taught, section, augment.label_smoothing) + codec.loss()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        codec.update()
        losses.append(loss.item())
    codec.sync()
    model.eval()
    codec.eval()
    return losses


@torch.no_grad()
def accuracy(predict: Callable[[Tensor], Tensor], data: Dataset, batch_size: int = 500) -> float:
    """Top-1 accuracy (%) of predict(images) -> logits over data."""
    correct = 0
    for images, labels in batches(data, batch_size, torch.Generator(), shuffle=False):
        correct += int((predict(images).argmax(dim=1) == labels).sum())
    return 100.0 * correct / len(data)
