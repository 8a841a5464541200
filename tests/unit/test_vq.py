"""The vector quantiser's search and the fitted EMA statistics."""

import torch

from tracevq.bundle import fit_quantizer
from tracevq.vq import VectorQuantizer


def brute_force(vq: VectorQuantizer, x: torch.Tensor) -> torch.Tensor:
    return torch.cdist(vq.project(x), vq.codebook).argmin(dim=1)


def test_nearest_follows_a_codebook_loaded_after_a_search():
    generator = torch.Generator().manual_seed(0)
    vq = VectorQuantizer(32, 8).eval()
    vq.set_codebook(torch.randn(32, 8, generator=generator))
    x = torch.randn(200, 8, generator=generator)
    assert torch.equal(vq.nearest(x), brute_force(vq, x))  # caches the norms
    other = VectorQuantizer(32, 8)
    other.set_codebook(10 * torch.randn(32, 8, generator=generator))
    vq.load_state_dict(other.state_dict())
    assert torch.equal(vq.nearest(x), brute_force(vq, x))
    vq.codebook[:16] *= 0.1  # an in-place write
    assert torch.equal(vq.nearest(x), brute_force(vq, x))
    vq.codebook = torch.randn(32, 8, generator=generator)  # a new tensor
    assert torch.equal(vq.nearest(x), brute_force(vq, x))


def test_fitted_ema_statistics_reproduce_the_codebook():
    rows = torch.randn(500, 12, generator=torch.Generator().manual_seed(1))
    vq = fit_quantizer(rows, K=16, code_dim=6, seed=0)
    counts = vq.ema_counts
    assert counts.sum() == len(rows)
    assert torch.equal(counts, torch.bincount(vq.nearest(rows), minlength=16).float())
    used = counts > 0
    assert torch.allclose(vq.ema_sums[used] / counts[used, None], vq.codebook[used], atol=1e-6)
