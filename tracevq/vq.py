"""Vector quantiser: one per exchange point. Nearest codeword by `tracevq.search` (cached).

A quantiser may project its input to d_q dimensions before the search (`project_in`) and
decode a codeword back to D (`project_out`). The EMA statistics (`ema_counts`, `ema_sums`) are
kept as buffers so that training can update the codebook in place.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from tracevq.search import CodewordSearch, full_search


class VectorQuantizer(nn.Module):
    def __init__(self, num_codes: int, dim: int, code_dim: int | None = None):
        super().__init__()
        code_dim = code_dim or dim
        self.dim = dim
        self.code_dim = code_dim
        self.register_buffer("codebook", torch.zeros(num_codes, code_dim))
        self.register_buffer("ema_counts", torch.zeros(num_codes))
        self.register_buffer("ema_sums", torch.zeros(num_codes, code_dim))
        self.project_in = nn.Linear(dim, code_dim) if code_dim != dim else None
        self.project_out = nn.Linear(code_dim, dim) if code_dim != dim else None
        self._search: tuple[tuple[int, int], CodewordSearch] | None = None  # (codebook version, .)

    @property
    def num_codes(self) -> int:
        return self.codebook.shape[0]

    def set_codebook(self, codebook: Tensor) -> None:
        self.codebook.copy_(codebook)

    def project(self, x: Tensor) -> Tensor:
        """Input rows in codebook space: (..., D) -> (..., d_q)."""
        return x if self.project_in is None else self.project_in(x)

    def decode(self, indices: Tensor) -> Tensor:
        """Codewords back in model space: (...,) -> (..., D)."""
        codes = self.codebook[indices]
        return codes if self.project_out is None else self.project_out(codes)

    def decoded_codebook(self) -> Tensor:
        """Every codeword in model space: (K, D)."""
        return self.decode(torch.arange(self.num_codes, device=self.codebook.device))

    @torch.no_grad()
    def nearest(self, x: Tensor) -> Tensor:
        """Index of the nearest codeword (squared euclidean) of each row of x: (..., D) -> (...)."""
        flat = self.project(x).reshape(-1, self.code_dim)
        return self.search().nearest(flat).reshape(x.shape[:-1])

    def search(self) -> CodewordSearch:
        """The codebook's search, rebuilt whenever the codebook tensor changed: an in-place
        write or `load_state_dict` bumps its version, an assignment its identity."""
        key = (id(self.codebook), self.codebook._version)
        if self._search is None or self._search[0] != key:
            self._search = (key, CodewordSearch(self.codebook))
        return self._search[1]


GRAM_ROWS = 4096  # k-means++ seeding: the (n, n) Gram matrix up to 64 MB


def kmeans(x: Tensor, k: int, iterations: int = 20, seed: int = 0) -> Tensor:
    """k-means++ initialisation then Lloyd iterations on rows of x (n, dim): (k, dim) centroids.

    Lloyd stops early once no row changes its centroid and none is empty (a fixed point).
    With fewer rows than k, the remaining centroids are rows perturbed by small noise.
    """
    generator = torch.Generator().manual_seed(seed)
    x = x.detach().float().reshape(-1, x.shape[-1])
    centroids = _kmeans_plus_plus(x, k, generator)
    previous = None
    for _ in range(iterations):
        assign = full_search(x, centroids, centroids.pow(2).sum(1))
        counts = torch.bincount(assign, minlength=k)
        used = counts > 0
        if previous is not None and used.all() and torch.equal(assign, previous):
            break
        previous = assign
        sums = torch.zeros_like(centroids).index_add_(0, assign, x)
        centroids[used] = sums[used] / counts[used].unsqueeze(1).float()
        empty = (~used).nonzero().squeeze(1)
        if len(empty):  # dead centroid: restart it on a random row
            rows = torch.randint(len(x), (len(empty),), generator=generator)
            centroids[empty] = x[rows]
    return centroids


def _kmeans_plus_plus(x: Tensor, k: int, generator: torch.Generator) -> Tensor:
    n = len(x)
    if n <= k:
        extra = x[torch.randint(n, (k - n,), generator=generator)]
        noise = torch.randn(extra.shape, generator=generator) * x.std() * 1e-2
        return torch.cat([x, extra + noise])
    # The draws are sequential, so the loop runs in numpy: a torch call costs several times
    # a numpy call at these sizes, and the loop is k of them. Up to GRAM_ROWS rows the dot
    # products come from one Gram matrix instead of a matrix-vector product per draw.
    rows = x.numpy()
    gram = rows @ rows.T if n <= GRAM_ROWS else None
    sq_norms = np.einsum("ij,ij->i", rows, rows).astype(np.float64)  # (n,)
    uniform = torch.rand(k, generator=generator, dtype=torch.float64).numpy()

    def distances(pick: int) -> np.ndarray:
        dots = gram[pick] if gram is not None else rows @ rows[pick]
        return np.maximum(sq_norms + sq_norms[pick] - 2 * dots, 0)

    chosen = [int(uniform[0] * n)]
    closest = distances(chosen[0])
    for step in range(1, k):
        cumulative = np.cumsum(closest)
        # sample proportionally to the squared distance to the closest chosen centroid
        pick = min(int(np.searchsorted(cumulative, uniform[step] * cumulative[-1])), n - 1)
        chosen.append(pick)
        np.minimum(closest, distances(pick), out=closest)
    return x[chosen].clone()
