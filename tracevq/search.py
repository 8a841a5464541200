"""Nearest codeword by an int8 screen and an exact float32 rescoring of the few survivors.

The score of codeword c_j for a row x is ||c_j||^2 - 2 x.c_j (||x||^2 is common to all j). Both
sides are rounded to int8 with one scale per row: x = s q + e, c_j = t_j p_j + f_j. The int8
product q.p_j is exact in int32 (torch._int_mm: several times the throughput of a float32
matmul on CPUs with VNNI), and the rest of the dot product is bounded by Cauchy-Schwarz:

    |x.c_j - s t_j q.p_j| = |s q.f_j + e.c_j| <= ||s q|| max||f|| + ||e|| max||c|| =: beta(x)

so every true score lies within 2 beta(x) of its screened value, and a codeword whose screened
score exceeds the row's screened minimum by more than 4 beta(x) cannot be nearest. A row with
one survivor is done. The survivors of the others (two to five per row on ViT-B's activations)
are rescored in float32, by one matmul against the union of their survivors (a few dozen
codewords on ViT-B) or, when that union is wide, each row against its own, and the argmin is
taken over them: the same codeword as a full float32 search, up to float32 rounding of scores
that tie within it (a slack of 1e-5 of the scores' magnitude covers the rounding of both).
Where the screen would not pay (few rows times codewords, or narrow rows) or leaves too much
to rescore (codewords that all lie about as far from the rows, as random ones do), the full
float32 search runs instead (`full_search`, also k-means' assignment step): block by block of
rows, so that each block's scores are still in cache when their argmin reads them.

`BeamSearch` is the approximate alternative (the methods' `search_beam`): the codewords are
split into about sqrt(K) groups of equal size by a balanced k-means, each row is scored against
the groups' centres, and only the members of its `beam` nearest groups are searched. With 32
groups of 32 at K = 1024 a row visits 32 (1 + beam) codewords instead of 1,024; it may miss its
nearest codeword when that lies in a group whose centre is not among the beam nearest.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

# x86 with AVX2 or AVX-512 has int8 matmul kernels (oneDNN); elsewhere _int_mm may not be faster
SCREEN = torch.backends.cpu.get_cpu_capability().startswith("AVX")
SCREEN_MIN_WORK = 1 << 16  # rows x codewords below which the full float32 search is cheaper
# below it the screen's passes over the (n, K) scores cost more than the float32 matmul saved
# (measured on clustered rows at K = 1024: 3x slower at D = 128 and 192, 3x faster at 384)
SCREEN_MIN_DIM = 256
SCREEN_MAX_RESCORED = 1 / 4  # rescoring work, of the full search's: beyond it, search all
PAIR_COST = 32  # one survivor rescored alone (gathers) costs about 32 scores of a matmul
ROUNDING_SLACK = 1e-5  # of ||c||^2 + 2 ||x|| ||c||: float32 rounding of screened and exact scores
# rows per block of float32 scores: a (1024, K) block is still in cache when its argmin reads it
# (measured at K = 1024 over 18,000 rows: 2.5x faster than one (n, K) matrix at D = 32, 2x at 64)
BLOCK_ROWS = 1024
ARGMIN_GROUP = 64  # codewords per group of the two-stage argmin (see _argmin_rows)
BALANCE_ITERATIONS = 10  # Lloyd steps of the balanced k-means that groups a beam search's codewords


class CodewordSearch:
    """Nearest of a fixed set of codewords (K, D) to each row of x (n, D)."""

    def __init__(self, codewords: Tensor):
        self.codewords = codewords.detach().float().contiguous()
        self.sq_norms = self.codewords.pow(2).sum(dim=1)  # (K,)

    @functools.cached_property
    def _screen(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The codewords in int8, built on the first screened search (a search rebuilt at every
        training step, or over narrow rows, never needs them): their transpose (D, K), scales
        (K,), largest rounding residual and largest norm."""
        quantized, scales, residual = _int8_rows(self.codewords)
        return quantized.t(), scales, residual.norm(dim=1).max(), self.sq_norms.max().sqrt()

    def full(self, x: Tensor) -> Tensor:
        """The full float32 search: every row against every codeword."""
        return full_search(x, self.codewords, self.sq_norms)

    def nearest(self, x: Tensor) -> Tensor:
        """Index of the nearest codeword (squared euclidean) of each row: (n, D) -> (n,)."""
        x = x.float()
        n, k = x.shape[0], self.codewords.shape[0]
        if not SCREEN or n * k < SCREEN_MIN_WORK or x.shape[1] < SCREEN_MIN_DIM:
            return self.full(x)
        codes_t, code_scales, residual_max, norm_max = self._screen
        quantized, scales, residual = _int8_rows(x)
        dots = torch._int_mm(quantized, codes_t).float()  # (n, K), exact
        screened = torch.addcmul(self.sq_norms, dots, scales.unsqueeze(1) * code_scales, value=-2.0)
        norm, error = x.norm(dim=1), residual.norm(dim=1)  # ||s q|| <= norm + error
        beta = (norm + error) * residual_max + error * norm_max
        magnitude = norm_max * (norm_max + 2.0 * norm)
        margin = 4.0 * beta + ROUNDING_SLACK * magnitude  # (n,)
        survivors = screened <= (screened.amin(dim=1) + margin).unsqueeze(1)  # (n, K)
        if survivors.view(torch.uint8).sum(dtype=torch.int32) > SCREEN_MAX_RESCORED * n * k:
            return self.full(x)
        rows, cols = survivors.nonzero(as_tuple=True)
        nearest = torch.empty(n, dtype=torch.long)
        nearest[rows] = cols  # right where a row has one survivor
        counts = torch.bincount(rows, minlength=n)
        several = counts[rows] > 1
        if not several.any():
            return nearest
        rows, cols = rows[several], cols[several]  # the survivors of rows with several
        ambiguous = (counts > 1).nonzero().squeeze(1)  # (r,)
        place = torch.empty(n, dtype=torch.long)
        place[ambiguous] = torch.arange(len(ambiguous))
        place = place[rows]  # each survivor's row among the ambiguous
        union, slot = torch.unique(cols, return_inverse=True)  # (U,), each survivor's column
        union_work, pair_work = len(ambiguous) * len(union), PAIR_COST * len(rows)
        if min(union_work, pair_work) > SCREEN_MAX_RESCORED * n * k:
            return self.full(x)
        if union_work <= pair_work:  # one matmul of those rows against the union
            codewords = self.codewords[union]
            exact = torch.addmm(self.sq_norms[union], x[ambiguous], codewords.t(), alpha=-2.0)
            exact = exact[place, slot]
        else:  # each survivor alone
            exact = self.sq_norms[cols] - 2.0 * (x[rows] * self.codewords[cols]).sum(dim=1)
        rescored = torch.full((len(ambiguous), len(union)), float("inf"))
        rescored[place, slot] = exact
        nearest[ambiguous] = union[rescored.argmin(dim=1)]
        return nearest


def full_search(x: Tensor, codewords: Tensor, sq_norms: Tensor) -> Tensor:
    """Index of the nearest of `codewords` (K, D) to each row of x (n, D) by the float32
    scores ||c||^2 - 2 x.c, BLOCK_ROWS rows at a time; `sq_norms` = ||c||^2 (K,)."""
    nearest = torch.empty(len(x), dtype=torch.long)
    for start in range(0, len(x), BLOCK_ROWS):
        block = torch.addmm(sq_norms, x[start : start + BLOCK_ROWS], codewords.t(), alpha=-2.0)
        nearest[start : start + BLOCK_ROWS] = _argmin_rows(block)
    return nearest


def _argmin_rows(scores: Tensor) -> Tensor:
    """scores.argmin(dim=1), the first index among equal minima as there, in two stages: the
    least of each group of ARGMIN_GROUP columns (torch's amin is vectorised, its argmin is not),
    then the argmin within each row's first least group. 2.5x faster at K = 1024."""
    n, k = scores.shape
    if k % ARGMIN_GROUP or k < 4 * ARGMIN_GROUP:
        return scores.argmin(dim=1)
    groups = scores.view(n, k // ARGMIN_GROUP, ARGMIN_GROUP)
    best = groups.amin(dim=2).argmin(dim=1)  # (n,) each row's first group holding its minimum
    return best * ARGMIN_GROUP + groups[torch.arange(n), best].argmin(dim=1)


def _int8_rows(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x (n, D) as scale * q + residual, q int8 in [-127, 127], one scale per row."""
    scales = (x.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    rounded = torch.round(x / scales.unsqueeze(1)).clamp_(-127, 127)
    residual = x - rounded * scales.unsqueeze(1)
    return rounded.to(torch.int8), scales, residual


def search_groups(k: int) -> int:
    """How many groups a beam search splits k codewords into: the power of two nearest sqrt(k)
    (32 at K = 1024, 8 at 64), so that a row scores as many centres as a group has members."""
    return 2 ** max(0, round(math.log2(k) / 2))


class BeamSearch:
    """The codeword nearest each row among the members of its `beam` nearest groups (module
    docstring), over the codewords of `exact`, the exact search it falls back to when `beam`
    is at or above the number of groups."""

    def __init__(self, exact: CodewordSearch, beam: int):
        self.exact = exact
        codewords = exact.codewords
        k, dim = codewords.shape
        self.groups = search_groups(k)
        self.beam = min(beam, self.groups)
        if self.beam == self.groups:
            return
        size = math.ceil(k / self.groups)
        assign, self.centres = balanced_kmeans(codewords, self.groups, size)
        order = torch.argsort(assign, stable=True)  # codewords group by group
        counts = torch.bincount(assign, minlength=self.groups)
        slot = torch.arange(k) - (torch.cumsum(counts, 0) - counts)[assign[order]]
        place = assign[order] * size + slot  # each codeword's place among groups x size
        members = codewords.new_zeros(self.groups * size, dim)
        members[place] = codewords[order]
        sq_norms = torch.full((self.groups * size,), math.inf)  # empty places never win
        sq_norms[place] = self.exact.sq_norms[order]
        self.index = torch.zeros(self.groups * size, dtype=torch.long)
        self.index[place] = order  # place -> codeword
        self.members_t = members.view(self.groups, size, dim).transpose(1, 2).contiguous()
        self.member_sq_norms = sq_norms.view(self.groups, 1, size)
        # an empty group (k well below groups x size) is never chosen
        self.centre_sq_norms = self.centres.pow(2).sum(1).masked_fill(counts == 0, math.inf)

    def nearest(self, x: Tensor) -> Tensor:
        """Index of the codeword found for each row of x: (n, D) -> (n,)."""
        x = x.float()
        if self.beam == self.groups:
            return self.exact.nearest(x)
        nearest = torch.empty(len(x), dtype=torch.long)
        for start in range(0, len(x), BLOCK_ROWS):
            nearest[start : start + BLOCK_ROWS] = self._block(x[start : start + BLOCK_ROWS])
        return nearest

    def _block(self, x: Tensor) -> Tensor:
        n, beam = len(x), self.beam
        centre_scores = torch.addmm(self.centre_sq_norms, x, self.centres.t(), alpha=-2.0)
        chosen = centre_scores.topk(beam, dim=1, largest=False, sorted=False).indices.reshape(-1)
        # the (row, group) pairs, group by group; each pair's slot within its group
        order = torch.argsort(chosen, stable=True)
        group = chosen[order]
        counts = torch.bincount(group, minlength=self.groups)
        slot = torch.arange(n * beam) - (torch.cumsum(counts, 0) - counts)[group]
        rows = x.new_zeros(self.groups, int(counts.max()), x.shape[1])
        rows[group, slot] = x[order // beam]
        scores = torch.baddbmm(self.member_sq_norms, rows, self.members_t, alpha=-2.0)
        best, member = scores[group, slot].min(dim=1)  # each pair's best in its group
        pair_best, pair_place = torch.empty_like(best), torch.empty_like(member)
        pair_best[order] = best
        pair_place[order] = group * self.members_t.shape[2] + member
        pick = pair_best.view(n, beam).argmin(dim=1)
        return self.index[pair_place.view(n, beam)[torch.arange(n), pick]]


def balanced_kmeans(points: Tensor, groups: int, size: int) -> tuple[Tensor, Tensor]:
    """Each point's group (k,) and the groups' centres (groups, D): Lloyd steps whose
    assignment gives no group more than `size` points, from centres drawn with a fixed seed
    (the grouping is a function of the points). An empty group keeps its previous centre."""
    generator = torch.Generator().manual_seed(0)
    centres = points[torch.randperm(len(points), generator=generator)[:groups]]
    assign = torch.zeros(len(points), dtype=torch.long)
    for _ in range(BALANCE_ITERATIONS):
        distances = torch.cdist(points, centres)  # (k, groups)
        assign = _capacity_assign(distances, size)
        counts = torch.bincount(assign, minlength=groups)
        sums = torch.zeros_like(centres).index_add_(0, assign, points)
        filled = counts > 0
        centres = torch.where(filled.unsqueeze(1), sums / counts.clamp_min(1).unsqueeze(1), centres)
    return assign, centres


def _capacity_assign(distances: Tensor, size: int) -> Tensor:
    """Point -> group with at most `size` points each: in rounds, every unplaced point asks
    for its nearest group with room, and each group takes the nearest of those who asked."""
    k, groups = distances.shape
    assign = torch.full((k,), -1, dtype=torch.long)
    room = torch.full((groups,), size, dtype=torch.long)
    pending = torch.arange(k)
    while len(pending):
        asked = distances[pending].masked_fill((room == 0).unsqueeze(0), math.inf)
        cost, choice = asked.min(dim=1)
        order = torch.argsort(cost, stable=True)
        order = order[torch.argsort(choice[order], stable=True)]  # by group, nearest first
        group = choice[order]
        counts = torch.bincount(group, minlength=groups)
        rank = torch.arange(len(order)) - (torch.cumsum(counts, 0) - counts)[group]
        taken = rank < room[group]
        assign[pending[order[taken]]] = group[taken]
        room -= torch.bincount(group[taken], minlength=groups)
        pending = pending[order[~taken]]
    return assign
