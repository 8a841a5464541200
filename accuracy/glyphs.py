"""Glyph pairs: a many-class image task the project generates itself, as large as a study needs.

The digits tasks have 400 and 1,000 test images, a sampling error (0.8 and 1.4 points) as large
as the differences between the methods. This task draws as many images as asked from a seed:

- `glyphs` prototypes, each a few strokes (polylines of random points in a 12 x 12 cell),
  fixed by one seed (the study's split seed) so that every split shares them;
- an image is a 24 x 24 canvas with a glyph in each quadrant; each sample moves every stroke
  point by Gaussian jitter, draws its strokes with a random width and ink, and adds faint noise,
  so that no two images are alike and some are ambiguous (the task has a Bayes error);
- the label is the pair (top-left, bottom-right) as `a * glyphs + b` (64 classes for 8
  glyphs); the two other quadrants hold distractor glyphs that the label ignores, so the
  model must tell where a glyph lies as well as what it is.

With patch 4 in row-major order, two devices split the canvas into top and bottom halves: the
CLS token and glyph a on device 0, glyph b wholly on device 1, so the class needs what the peer
sends. Three devices cut through glyph a too.
"""

from __future__ import annotations

import torch
from torch import Tensor

CELL = 12  # pixels per glyph cell; the canvas is two cells square


def glyph_prototypes(glyphs: int, seed: int, strokes: int = 3, points: int = 3) -> Tensor:
    """(glyphs, strokes, points, 2) stroke points in cell pixels, away from the cell's border."""
    generator = torch.Generator().manual_seed(seed)
    return 2.0 + (CELL - 4.0) * torch.rand(glyphs, strokes, points, 2, generator=generator)


def render(points: Tensor, width: Tensor, ink: Tensor) -> Tensor:
    """(n, cell, cell) images of strokes `points` (n, strokes, points, 2): each pixel's ink is
    `ink * exp(-(d / width)^2)`, d its distance to the nearest stroke segment."""
    start = points[:, :, :-1].reshape(len(points), -1, 1, 2)  # (n, segments, 1, 2)
    stop = points[:, :, 1:].reshape(len(points), -1, 1, 2)
    ys, xs = torch.meshgrid(torch.arange(CELL) + 0.5, torch.arange(CELL) + 0.5, indexing="ij")
    pixels = torch.stack([xs.flatten(), ys.flatten()], -1)  # (cell^2, 2)
    along = stop - start
    t = ((pixels - start) * along).sum(-1) / (along * along).sum(-1).clamp_min(1e-6)
    nearest = start + t.clamp(0.0, 1.0).unsqueeze(-1) * along  # (n, segments, cell^2, 2)
    distance = (pixels - nearest).norm(dim=-1).amin(dim=1)  # (n, cell^2)
    image = ink[:, None] * torch.exp(-((distance / width[:, None]) ** 2))
    return image.reshape(-1, CELL, CELL)


def glyph_pairs(
    prototypes: Tensor,
    count: int,
    seed: int,
    jitter: float = 1.0,
    noise: float = 0.05,
    chunk: int = 4096,
) -> tuple[Tensor, Tensor]:
    """`count` images (count, 1, 24, 24) in [0, 1] and labels a * glyphs + b, from `seed`."""
    glyphs = len(prototypes)
    generator = torch.Generator().manual_seed(seed)
    images = torch.empty(count, 1, 2 * CELL, 2 * CELL)
    labels = torch.empty(count, dtype=torch.long)
    for first in range(0, count, chunk):
        n = min(chunk, count - first)
        which = torch.randint(glyphs, (n, 4), generator=generator)  # tl, tr, bl, br
        shape = (n, 4, *prototypes.shape[1:])
        moved = prototypes[which] + jitter * torch.randn(shape, generator=generator)
        width = 0.7 + 0.6 * torch.rand(n * 4, generator=generator)
        ink = 0.6 + 0.4 * torch.rand(n * 4, generator=generator)
        cells = render(moved.reshape(n * 4, *prototypes.shape[1:]), width, ink)
        cells = cells.reshape(n, 2, 2, CELL, CELL).permute(0, 1, 3, 2, 4)
        canvas = cells.reshape(n, 2 * CELL, 2 * CELL)
        canvas = canvas + noise * torch.rand(canvas.shape, generator=generator)
        images[first : first + n, 0] = canvas.clamp(0.0, 1.0)
        labels[first : first + n] = which[:, 0] * glyphs + which[:, 3]
    return images, labels
