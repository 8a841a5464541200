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
"""

from __future__ import annotations

import functools

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
