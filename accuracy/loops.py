"""Training loops: the single-device model from scratch, and the VQ fine-tuning."""

from __future__ import annotations

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
    step by step. Returns the loss of every step."""
    generator = torch.Generator().manual_seed(seed)
    parameters = [*model.parameters(), *codec.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=section.lr, weight_decay=section.weight_decay)
    model.train()
    codec.train()
    data = endless_batches(train, section.batch_size, generator)
    losses = []
    bar = tqdm(range(section.steps), desc=f"fine-tune {method.name}", disable=not progress)
    for step in bar:
        images, labels = next(data)
        set_lr(optimizer, section.lr * cosine_lr(step, section.steps, section.steps // 10 + 1))
        devices = section.devices[step % len(section.devices)]
        images = augmented(images, augment, generator)
        logits = distributed_logits(model, images, devices, method, codec)
        task = F.cross_entropy(logits, labels, label_smoothing=augment.label_smoothing)
        loss = task + codec.loss()
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
