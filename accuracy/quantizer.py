"""A `VectorQuantizer` in training: straight-through codewords, commitment loss, and the
codebook update rule.

The wrapped quantizer's own buffers are what gets trained, so after fine-tuning the very same
`VectorQuantizer` objects go into the bundle. Two update rules (docs/method.md, Vector
quantiser; the paper's Table VIII):

- `ema` (default): per code, exponential moving averages of the assignment count N and of the
  sum S of assigned rows (decay ~0.99); codeword = S / N~ with N~ the Laplace-smoothed count
  (N + eps) / (n + K eps) * n, n = sum(N). The statistics start from the k-means fit, scaled
  to one training step's worth of rows, so the codebook does not jump at the first step.
- `gradient`: the codebook is a parameter moved by the optimiser through the codebook loss
  ||sg(z) - e||^2 (VQ-VAE); usage is still tracked by the EMA counts.

With `noise` (Astra's noise-augmented quantisation, its authors' lambda), training adds to
every codeword a receiver sees Gaussian noise with, per dimension, the batch's residual
z - e standard deviation times lambda; evaluation sees the codeword alone.

Either way a code is dead when its EMA count falls below `dead_fraction` times the mean
count; a dead code restarts on a random row of the current batch, with the mean count.
The commitment loss ||z - sg(e)||^2 pulls the encoder output z towards its codeword. With a
d_q projection the search, the codebook and the EMA statistics live in the projected space,
and `project_in` / `project_out` are trained by gradient.

`TrainingCodec` is the codec of every exchange point in training: what the differentiable
P-device forward (`tracevq.distributed.distributed_logits`) takes its codewords from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tracevq.vq import VectorQuantizer


@dataclass(frozen=True)
class CodebookRule:
    """How codewords learn. Fields mirror the `codebooks` section of the training config."""

    update: str = "ema"  # "ema" or "gradient"
    decay: float = 0.99
    epsilon: float = 1e-5  # Laplace smoothing of the EMA counts
    dead_fraction: float = 0.03  # dead below this fraction of the mean EMA count
    commitment: float = 0.25  # weight of ||z - sg(e)||^2
    noise: float = 0.0  # Astra's noise-augmented quantisation: lambda (0: off)


class TrainableQuantizer(nn.Module):
    """Straight-through quantisation with the update rule `rule` on `vq`'s codebook."""

    def __init__(self, vq: VectorQuantizer, rule: CodebookRule, seed: int = 0):
        super().__init__()
        if rule.update not in ("ema", "gradient"):
            raise ValueError(f"unknown codebook update rule {rule.update!r}")
        self.vq, self.rule = vq, rule
        self.codebook = nn.Parameter(vq.codebook.clone()) if rule.update == "gradient" else None
        self.generator = torch.Generator().manual_seed(seed)
        self.loss = torch.zeros(())  # commitment (+ codebook) loss of the last forward
        self._batch: tuple[Tensor, Tensor] | None = None  # (rows, indices) awaiting the update
        self._primed = False

    def codewords(self) -> Tensor:
        """(K, d_q): the parameter in gradient mode, else the quantizer's buffer."""
        return self.vq.codebook if self.codebook is None else self.codebook

    def forward(self, x: Tensor) -> Tensor:
        """Codewords of the rows of x in model space, with straight-through gradients to x."""
        z = self.vq.project(x).reshape(-1, self.vq.code_dim)  # (n, d_q)
        book = self.codewords()
        with torch.no_grad():
            scores = torch.addmm(book.pow(2).sum(1), z, book.t(), alpha=-2.0)  # (n, K)
            indices = scores.argmin(dim=1)
        chosen = book[indices]  # (n, d_q); carries the codebook gradient in gradient mode
        self.loss = self.rule.commitment * F.mse_loss(z, chosen.detach())
        if self.codebook is not None:
            self.loss = self.loss + F.mse_loss(chosen, z.detach())
        self._batch = (z.detach(), indices)
        straight = z + (chosen - z).detach()
        if self.training and self.rule.noise > 0:
            straight = straight + self._noise(z.detach() - chosen.detach())
        decoded = straight if self.vq.project_out is None else self.vq.project_out(straight)
        return decoded.reshape(x.shape)

    def _noise(self, residual: Tensor) -> Tensor:
        """Gaussian noise shaped like the quantisation residual: per dimension the residual's
        standard deviation over the batch's rows, times the rule's lambda."""
        scale = self.rule.noise * residual.std(dim=0, keepdim=True)
        return scale * torch.randn(residual.shape, generator=self.generator)

    @torch.no_grad()
    def update(self) -> int:
        """Apply the update rule to the rows of the last forward; returns codes reset."""
        if self._batch is None:
            return 0
        rows, indices = self._batch
        self._batch = None
        vq, decay = self.vq, self.rule.decay
        self._prime(len(rows))
        counts = torch.bincount(indices, minlength=vq.num_codes).to(rows.dtype)
        sums = torch.zeros_like(vq.ema_sums).index_add_(0, indices, rows)
        vq.ema_counts.mul_(decay).add_(counts, alpha=1 - decay)
        vq.ema_sums.mul_(decay).add_(sums, alpha=1 - decay)
        if self.codebook is None:
            total, eps = vq.ema_counts.sum(), self.rule.epsilon
            smoothed = (vq.ema_counts + eps) / (total + vq.num_codes * eps) * total
            vq.set_codebook(vq.ema_sums / smoothed.unsqueeze(1))
        return self._reset_dead(rows)

    def _prime(self, rows_per_step: int) -> None:
        """Scale the fitted counts to one step's rows and make the sums match the codebook."""
        if self._primed:
            return
        vq, total = self.vq, float(self.vq.ema_counts.sum())
        if total > 0:
            vq.ema_counts.mul_(rows_per_step / total)
        else:
            vq.ema_counts.fill_(rows_per_step / vq.num_codes)
        vq.ema_sums.copy_(self.codewords().detach() * vq.ema_counts.unsqueeze(1))
        self._primed = True

    def _reset_dead(self, rows: Tensor) -> int:
        vq = self.vq
        mean_count = vq.ema_counts.mean()
        dead = (vq.ema_counts < self.rule.dead_fraction * mean_count).nonzero().squeeze(1)
        if len(dead) == 0:
            return 0
        picks = rows[torch.randint(len(rows), (len(dead),), generator=self.generator)]
        vq.ema_counts[dead] = mean_count
        vq.ema_sums[dead] = picks * mean_count
        codebook = self.codewords().detach().clone()
        codebook[dead] = picks
        self.sync(codebook)
        return len(dead)

    @torch.no_grad()
    def sync(self, codebook: Tensor | None = None) -> None:
        """Make the quantizer's buffer hold the trained codewords (gradient mode)."""
        codebook = self.codewords().detach() if codebook is None else codebook
        if self.codebook is not None:
            self.codebook.copy_(codebook)
        self.vq.set_codebook(codebook)


class TrainingCodec(nn.Module):
    """Straight-through codewords; `loss` and `update` collect and apply every exchange point."""

    def __init__(self, quantizers: Sequence[VectorQuantizer], rule: CodebookRule, seed: int = 0):
        super().__init__()
        self.quantizers = nn.ModuleList(
            TrainableQuantizer(vq, rule, seed + b) for b, vq in enumerate(quantizers)
        )

    def forward(self, block: int, x: Tensor) -> Tensor:
        return self.quantizers[block](x)

    def loss(self) -> Tensor:
        return sum((q.loss for q in self.quantizers), torch.zeros(()))

    def update(self) -> int:
        return sum(q.update() for q in self.quantizers)

    def sync(self) -> None:
        for q in self.quantizers:
            q.sync()

    @torch.no_grad()
    def refresh(self, forward: Callable[[Tensor], Tensor], images: Tensor, batch: int) -> int:
        """One Lloyd step on the final model: every codeword chosen by some row that the
        exchange points see over `forward(images)` becomes the mean of those rows (the EMA
        counts follow, at their old total); the others stay. Returns the codewords moved."""
        sums = [torch.zeros_like(q.codewords()) for q in self.quantizers]
        counts = [torch.zeros(q.vq.num_codes) for q in self.quantizers]
        for chunk in images.split(batch):
            forward(chunk)
            for q, total, count in zip(self.quantizers, sums, counts, strict=True):
                assert q._batch is not None, "an exchange point saw no rows"
                rows, indices = q._batch
                q._batch = None
                total.index_add_(0, indices, rows)
                count += torch.bincount(indices, minlength=len(count)).to(count.dtype)
        moved = 0
        for q, total, count in zip(self.quantizers, sums, counts, strict=True):
            used = count > 0
            codebook = q.codewords().detach().clone()
            codebook[used] = total[used] / count[used].unsqueeze(1)
            q.sync(codebook)
            q.vq.ema_counts.copy_(count * (q.vq.ema_counts.sum() / count.sum()))
            moved += int(used.sum())
        return moved
