"""Hierarchical codebook: recursive k-medoids over a VQ codebook (docs/method.md, Codebook
tree and levels).

The finest level holds all K codewords; each coarser level clusters the medoids of the level
just finer, so every medoid at every level is an existing codeword and a coarse index maps to an
existing K/V buffer row. Level 0 is the coarsest. A `CodebookTree` knows each level's medoids
(as codebook rows), which medoid represents each leaf at each level, and how to encode
activations at a level by a search over that level's medoids only (`tracevq.search`).
"""

from __future__ import annotations

import difflib
import math

import numpy as np
import torch
import torch.nn.functional as F

from tracevq.codec import MAX_LEVELS, index_bits, level_sizes_for
from tracevq.errors import CheckpointError, ConfigError
from tracevq.search import BeamSearch, CodewordSearch

METRICS = ("euclidean", "cosine", "frequency")


class CodebookTree:
    """Levels of medoids over a codebook, coarsest (m = 0) to finest (all K codewords)."""

    def __init__(
        self,
        codebook: torch.Tensor,
        medoids: list[torch.Tensor],
        leaf_to_position: list[torch.Tensor],
        metric: str,
        branching: int,
    ) -> None:
        assert len(medoids) == len(leaf_to_position)
        self.codebook = codebook.detach()  # (K, D)
        self.medoids = [rows.long() for rows in medoids]
        self.leaf_to_position = [positions.long() for positions in leaf_to_position]
        self.metric = metric
        self.branching = branching
        self.level_sizes = [len(rows) for rows in self.medoids]
        self._searches = [CodewordSearch(self.codebook[rows]) for rows in self.medoids]
        self._beams: dict[tuple[int, int], BeamSearch] = {}  # (level, beam) -> its search

    @property
    def num_levels(self) -> int:
        return len(self.level_sizes)

    @property
    def finest(self) -> int:
        """Index of the finest level (the full codebook)."""
        return self.num_levels - 1

    @property
    def level_bits(self) -> list[int]:
        """Index bit width of each level, coarsest first."""
        return [index_bits(size) for size in self.level_sizes]

    def bits(self, m: int) -> int:
        """Index bit width at level m: ceil(log2 K_m), at least 1."""
        return index_bits(self.level_sizes[self._check_level(m)])

    def level_for_size(self, k_m: int) -> int:
        """Index of the level with exactly k_m codewords."""
        if k_m not in self.level_sizes:
            raise ConfigError(
                f"no codebook tree level has {k_m} codewords; available sizes: {self.level_sizes}"
            )
        return self.level_sizes.index(k_m)

    def encode(self, x: torch.Tensor, m: int, beam: int | None = None) -> torch.Tensor:
        """Positions (0..K_m-1) at level m of the nearest medoid to each row of x.

        Args:
            x: activations (..., D).
            m: level index.
            beam: None for the exact nearest medoid; B for a beam search over the level's
                medoids grouped by `tracevq.search.BeamSearch` (`beam_search`).

        Returns:
            LongTensor of shape x.shape[:-1].
        """
        self._check_level(m)
        if x.shape[-1] != self.codebook.shape[1]:
            raise ConfigError(
                f"encode: activations have dimension {x.shape[-1]}, "
                f"codebook has {self.codebook.shape[1]}"
            )
        flat = x.reshape(-1, x.shape[-1]).to(self.codebook.dtype)  # (n, D)
        search = self._searches[m] if beam is None else self.beam_search(m, beam)
        return search.nearest(flat).reshape(x.shape[:-1])

    def beam_search(self, m: int, beam: int) -> BeamSearch:
        """Level m's beam search (its groups built on the first call: 0.1-0.2 s at K = 1024,
        D = 768)."""
        if (m, beam) not in self._beams:
            self._beams[m, beam] = BeamSearch(self._searches[self._check_level(m)], beam)
        return self._beams[m, beam]

    def rows(self, positions: torch.Tensor, m: int) -> torch.Tensor:
        """Codebook rows (equally K/V buffer rows) of level-m positions."""
        return self.medoids[self._check_level(m)][positions]

    def state_dict(self) -> dict[str, torch.Tensor | int | str]:
        """Plain tensors, ints and strings; the codebook itself is not included."""
        state: dict[str, torch.Tensor | int | str] = {
            "metric": self.metric,
            "branching": self.branching,
            "num_codewords": self.codebook.shape[0],
            "num_levels": self.num_levels,
        }
        for m in range(self.num_levels):
            state[f"medoids.{m}"] = self.medoids[m].clone()
            state[f"leaf_to_position.{m}"] = self.leaf_to_position[m].clone()
        return state

    @classmethod
    def from_state_dict(cls, state: dict, codebook: torch.Tensor) -> CodebookTree:
        """Rebuild a tree saved with `state_dict` over the same codebook."""
        num_codewords = int(_state_item(state, "num_codewords"))
        if codebook.shape[0] != num_codewords:
            raise CheckpointError(
                f"codebook tree was built for {num_codewords} codewords, "
                f"the codebook has {codebook.shape[0]}"
            )
        num_levels = int(_state_item(state, "num_levels"))
        medoids = [_state_item(state, f"medoids.{m}") for m in range(num_levels)]
        positions = [_state_item(state, f"leaf_to_position.{m}") for m in range(num_levels)]
        metric = str(_state_item(state, "metric"))
        branching = int(_state_item(state, "branching"))
        return cls(codebook, medoids, positions, metric, branching)

    def _check_level(self, m: int) -> int:
        if not 0 <= m < self.num_levels:
            raise ConfigError(
                f"level {m} not in the codebook tree (levels 0..{self.num_levels - 1})"
            )
        return m


def _state_item(state: dict, key: str):
    if key not in state:
        raise CheckpointError(f"codebook tree state is missing key {key!r}")
    return state[key]


def build_tree(
    codebook: torch.Tensor,
    branching: int = 2,
    metric: str = "euclidean",
    counts: torch.Tensor | None = None,
    seed: int = 0,
    iterations: int = 20,
) -> CodebookTree:
    """Build the codebook tree by recursive k-medoids, finest level first.

    Args:
        codebook: codewords (K, D).
        branching: finer medoids per coarser medoid (at least 2).
        metric: "euclidean" (squared L2), "cosine" (1 - cosine similarity) or "frequency"
            (squared L2 with each point weighted by its usage count).
        counts: usage count of each codeword (K,); required for the frequency metric.
        seed: seed of the k-means++ initialisation.
        iterations: maximum assign / update rounds per level.
    """
    weights = _check_build_args(codebook, branching, metric, counts)
    sizes = level_sizes_for(codebook.shape[0], branching)
    if len(sizes) > MAX_LEVELS:
        raise ConfigError(
            f"branching={branching} over {codebook.shape[0]} codewords gives {len(sizes)} "
            f"levels; the header holds at most {MAX_LEVELS}"
        )
    generator = torch.Generator().manual_seed(seed)
    finer_rows = torch.arange(codebook.shape[0])
    medoids = [finer_rows]
    leaf_to_position = [finer_rows.clone()]
    all_dist = _pairwise_distance(codebook.double(), metric)  # (K, K); each level's is a part
    for size in reversed(sizes[:-1]):
        dist = all_dist[finer_rows][:, finer_rows]  # (n, n)
        centre_positions, labels = _k_medoids(dist, weights, size, generator, iterations)
        finer_rows = finer_rows[centre_positions]
        weights = _coarser_weights(weights, labels, size, metric)
        medoids.insert(0, finer_rows)
        leaf_to_position.insert(0, labels[leaf_to_position[0]])
    return CodebookTree(codebook, medoids, leaf_to_position, metric, branching)


def _check_build_args(
    codebook: torch.Tensor, branching: int, metric: str, counts: torch.Tensor | None
) -> torch.Tensor:
    """Validate the arguments of `build_tree`; return the per-leaf weights (K,) in float64."""
    if metric not in METRICS:
        hint = difflib.get_close_matches(metric, METRICS, n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(f"metric: unknown value {metric!r}{suggestion}; choose from {METRICS}")
    if codebook.ndim != 2 or codebook.shape[0] < 1:
        raise ConfigError(f"codebook must have shape (K, D) with K >= 1, got {codebook.shape}")
    if branching < 2:
        raise ConfigError(f"branching must be >= 2, got {branching}")
    num_codewords = codebook.shape[0]
    if metric != "frequency":
        return torch.ones(num_codewords, dtype=torch.float64)
    if counts is None:
        raise ConfigError("counts: the frequency metric needs the usage count of every codeword")
    if counts.shape != (num_codewords,):
        raise ConfigError(f"counts must have shape ({num_codewords},), got {tuple(counts.shape)}")
    if (counts < 0).any():
        raise ConfigError("counts must be non-negative")
    return counts.detach().double().cpu()


def _coarser_weights(
    weights: torch.Tensor, labels: torch.Tensor, size: int, metric: str
) -> torch.Tensor:
    """Weights of the coarser points: summed usage counts (frequency metric), else ones."""
    if metric != "frequency":
        return torch.ones(size, dtype=weights.dtype)
    return torch.zeros(size, dtype=weights.dtype).index_add_(0, labels, weights)


def _pairwise_distance(points: torch.Tensor, metric: str) -> torch.Tensor:
    """Distance matrix (n, n) between points (n, D) under `metric`."""
    if metric == "cosine":
        unit = F.normalize(points, dim=1)
        return (1.0 - unit @ unit.T).clamp_min(0.0)
    norms = (points**2).sum(dim=1)
    return (norms[:, None] + norms[None, :] - 2.0 * points @ points.T).clamp_min(0.0)


def _k_medoids(
    dist: torch.Tensor,
    weights: torch.Tensor,
    k: int,
    generator: torch.Generator,
    iterations: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted k-medoids on a distance matrix (n, n).

    Returns:
        (centres, labels): the k medoid positions in ascending order, and for each point the
        index 0..k-1 of its medoid in `centres`.
    """
    centres = _init_centres(dist, weights, k, generator)
    for _ in range(iterations):
        labels = _assign(dist, centres)
        updated = _update_centres(dist, weights, labels, k)
        if torch.equal(updated, centres):
            break
        centres = updated
    centres = centres.sort().values
    return centres, _assign(dist, centres)


def _init_centres(
    dist: torch.Tensor, weights: torch.Tensor, k: int, generator: torch.Generator
) -> torch.Tensor:
    """k-means++ seeding: each next centre drawn with probability ~ weight x distance. The
    sequential draws run in numpy (a torch call per draw costs several numpy calls)."""
    distances, weight = dist.numpy(), weights.numpy()
    uniform = torch.rand(k, generator=generator, dtype=torch.float64).numpy()
    chosen = np.zeros(dist.shape[0], dtype=bool)
    nearest = np.ones(dist.shape[0])  # first draw: by weight alone
    centres = []
    for step in range(k):
        centre = _draw(weight * nearest, chosen, uniform[step])
        centres.append(centre)
        chosen[centre] = True
        nearest = distances[centre] if step == 0 else np.minimum(nearest, distances[centre])
    return torch.tensor(centres)


def _draw(scores: np.ndarray, chosen: np.ndarray, uniform: float) -> int:
    """An unchosen point with probability ~ score (uniformly if all scores are zero), picked
    by one uniform number in [0, 1)."""
    scores = np.where(chosen, 0.0, scores)
    if not scores.sum() > 0:
        scores = (~chosen).astype(np.float64)
    cumulative = np.cumsum(scores)
    pick = int(np.searchsorted(cumulative, uniform * cumulative[-1], side="right"))
    return min(pick, len(scores) - 1)


def _assign(dist: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centre for each point; each centre keeps itself, so none is empty."""
    labels = dist[:, centres].argmin(dim=1)
    labels[centres] = torch.arange(len(centres))
    return labels


def _update_centres(
    dist: torch.Tensor, weights: torch.Tensor, labels: torch.Tensor, k: int
) -> torch.Tensor:
    """For each cluster, the member minimising the weighted sum of distances to its members."""
    # cluster_cost[c, j] = sum over members i of cluster c of weights[i] * dist[i, j]
    cluster_cost = torch.zeros(k, dist.shape[0], dtype=dist.dtype)
    cluster_cost.index_add_(0, labels, weights[:, None] * dist)  # (k, n)
    outside = labels[None, :] != torch.arange(k)[:, None]  # (k, n)
    return cluster_cost.masked_fill(outside, math.inf).argmin(dim=1)
