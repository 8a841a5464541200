"""The int8-screened codeword search finds the float64 nearest codeword on every path; the beam
search finds the nearest member of the groups it searches."""

import pytest
import torch

from tracevq.search import (
    BLOCK_ROWS,
    SCREEN_MIN_DIM,
    SCREEN_MIN_WORK,
    BeamSearch,
    CodewordSearch,
    _argmin_rows,
    balanced_kmeans,
    search_groups,
)

DIM = SCREEN_MIN_DIM  # the narrowest rows the screen takes


def clustered(n: int, k: int, dim: int, spread: float, seed: int = 0):
    """Codewords of unequal norms and rows scattered around them: nearest decided by a wide
    margin for some rows, by a hair for others."""
    generator = torch.Generator().manual_seed(seed)
    codewords = torch.randn(k, dim, generator=generator) * torch.rand(k, 1, generator=generator)
    owners = torch.randint(0, k, (n,), generator=generator)
    scale = spread * torch.rand(n, 1, generator=generator)
    rows = codewords[owners] + scale * torch.randn(n, dim, generator=generator)
    return rows, codewords


def check_nearest(search: CodewordSearch, rows: torch.Tensor) -> torch.Tensor:
    """The chosen codeword is as near as the float64 nearest (within float32 rounding), and is
    that very codeword wherever the runner-up is not within it; returns the choice."""
    chosen = search.nearest(rows)
    distances = torch.cdist(rows.double(), search.codewords.double()) ** 2  # (n, K)
    best = distances.min(dim=1)
    magnitude = (rows.double().norm(dim=1) + search.codewords.double().norm(dim=1).max()) ** 2
    tolerance = 1e-5 * magnitude
    assert (distances.gather(1, chosen[:, None]).squeeze(1) - best.values <= tolerance).all()
    runner_up = distances.topk(2, dim=1, largest=False).values[:, 1]
    clear = runner_up - best.values > tolerance
    assert torch.equal(chosen[clear], best.indices[clear])
    return chosen


def forbid_full_search(monkeypatch):
    def refuse(self, x):
        raise AssertionError("the full float32 search ran")

    monkeypatch.setattr(CodewordSearch, "full", refuse)


@pytest.mark.parametrize("spread", [0.05, 0.3, 0.8])
def test_the_screen_decides_clustered_rows_without_a_full_search(monkeypatch, spread):
    rows, codewords = clustered(300, 512, DIM, spread)
    search = CodewordSearch(codewords)
    forbid_full_search(monkeypatch)
    check_nearest(search, rows)


def test_rows_between_two_codewords_are_rescored_exactly(monkeypatch):
    generator = torch.Generator().manual_seed(1)
    codewords = torch.randn(512, DIM, generator=generator)
    a, b = codewords[:200], codewords[200:400]
    # just off the bisecting plane: the int8 screen alone cannot tell a from b
    t = 0.5 + 1e-3 * torch.randn(200, 1, generator=generator)
    rows = a + t * (b - a)
    search = CodewordSearch(codewords)
    forbid_full_search(monkeypatch)
    chosen = check_nearest(search, rows)
    assert set(chosen.tolist()) <= set(range(400))


def test_equidistant_random_codewords_fall_back_to_the_full_search():
    generator = torch.Generator().manual_seed(2)
    rows = torch.randn(200, 512, generator=generator)
    codewords = torch.randn(1024, 512, generator=generator)
    search = CodewordSearch(codewords)
    calls = []
    full = CodewordSearch.full

    def counted(self, x):
        calls.append(len(x))
        return full(self, x)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CodewordSearch, "full", counted)
        check_nearest(search, rows)
    assert calls == [200]


def test_zero_rows_codeword_rows_and_one_huge_coordinate():
    _, codewords = clustered(1, 256, DIM, 0.1, seed=3)
    zeros = torch.zeros(100, DIM)
    exact = codewords[:100]
    spiky = codewords[100:200].clone()
    spiky[:, 0] = 1e4  # the int8 scale is set by this coordinate: the rest rounds to zero
    rows = torch.cat([zeros, exact, spiky])
    assert len(rows) * len(codewords) >= SCREEN_MIN_WORK
    chosen = check_nearest(CodewordSearch(codewords), rows)
    assert torch.equal(chosen[100:200], torch.arange(100))


@pytest.mark.parametrize("n, k, dim", [(50, 64, DIM), (300, 1024, DIM // 2)])
def test_small_or_narrow_searches_run_in_float32_only(monkeypatch, n, k, dim):
    rows, codewords = clustered(n, k, dim, 0.3)
    assert n * k < SCREEN_MIN_WORK or dim < SCREEN_MIN_DIM
    monkeypatch.setattr(torch, "_int_mm", None)
    check_nearest(CodewordSearch(codewords), rows)


def test_the_full_search_over_many_rows_goes_block_by_block_to_the_same_answer():
    rows, codewords = clustered(2 * BLOCK_ROWS + 17, 300, 32, 0.3, seed=4)
    search = CodewordSearch(codewords)
    blocks = []
    addmm = torch.addmm

    def counted(*args, **kwargs):
        blocks.append(len(args[1]))
        return addmm(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "addmm", counted)
        check_nearest(search, rows)
    assert blocks == [BLOCK_ROWS, BLOCK_ROWS, 17]


def test_the_two_stage_argmin_takes_the_first_of_equal_minima():
    generator = torch.Generator().manual_seed(5)
    scores = torch.randint(0, 50, (500, 1024), generator=generator).float()  # many ties
    scores[:, 1000] = -1.0  # in the last group
    scores[7, 3] = scores[7, 900] = -2.0  # two minima in different groups
    scores[8, 64:] = -3.0  # a whole tail of equal minima
    assert torch.equal(_argmin_rows(scores), scores.argmin(dim=1))
    assert _argmin_rows(scores)[7] == 3 and _argmin_rows(scores)[8] == 64


def test_search_groups_are_the_power_of_two_nearest_the_square_root():
    assert [search_groups(k) for k in (2, 8, 64, 100, 1024, 65536)] == [1, 4, 8, 8, 32, 256]


@pytest.mark.parametrize("k", [1024, 1000, 992])
def test_balanced_groups_hold_at_most_their_size(k):
    generator = torch.Generator().manual_seed(3)
    points = torch.randn(k, 8, generator=generator) * torch.rand(k, 1, generator=generator)
    assign, _ = balanced_kmeans(points, 32, 32)
    counts = torch.bincount(assign, minlength=32)
    assert len(assign) == k and int(assign.min()) >= 0 and int(assign.max()) < 32
    assert int(counts.max()) <= 32 and int(counts.sum()) == k


@pytest.mark.parametrize("k", [1024, 1000, 992])
@pytest.mark.parametrize("beam", [1, 2, 5])
def test_the_beam_returns_the_nearest_member_of_its_nearest_groups(k, beam):
    """By definition, checked in float64: the row's `beam` nearest centres, then the nearest
    codeword among their members. Over more rows than a block, and with groups left part
    empty (k below 32 x 32)."""
    rows, codewords = clustered(BLOCK_ROWS + 300, k, 16, 0.5, seed=4)
    search = BeamSearch(CodewordSearch(codewords), beam)
    chosen = search.nearest(rows)
    members = search.index.view(search.groups, -1)  # (groups, size), place -> codeword
    real = torch.isfinite(search.member_sq_norms.view(search.groups, -1))
    to_centres = torch.cdist(rows.double(), search.centres.double())
    to_centres[:, ~real.any(dim=1)] = float("inf")
    near_groups = to_centres.topk(beam, dim=1, largest=False).indices  # (n, beam)
    distances = torch.cdist(rows.double(), codewords.double()) ** 2
    for row in range(0, len(rows), 7):
        candidates = members[near_groups[row]][real[near_groups[row]]]
        best = distances[row, candidates].min()
        assert distances[row, chosen[row]] <= best + 1e-4 * (1 + best)
        assert bool((candidates == chosen[row]).any())
    assert len(torch.unique(search.index[real.reshape(-1)])) == k  # every codeword has a place


def test_a_beam_as_wide_as_the_groups_is_the_exact_search():
    rows, codewords = clustered(400, 1024, DIM, 0.3)
    exact = CodewordSearch(codewords).nearest(rows)
    assert torch.equal(BeamSearch(CodewordSearch(codewords), 32).nearest(rows), exact)
    assert torch.equal(BeamSearch(CodewordSearch(codewords), 100).nearest(rows), exact)


def test_well_separated_groups_need_a_beam_of_one():
    """32 far-apart clumps of 32 codewords, rows near codewords: the row's clump is its
    nearest group, so a beam of one finds the exact nearest codeword of every row."""
    generator = torch.Generator().manual_seed(5)
    centres = 20 * torch.randn(32, 24, generator=generator)
    codewords = (centres.unsqueeze(1) + torch.randn(32, 32, 24, generator=generator)).reshape(
        1024, 24
    )
    owners = torch.randint(0, 1024, (600,), generator=generator)
    rows = codewords[owners] + 0.3 * torch.randn(600, 24, generator=generator)
    exact = CodewordSearch(codewords).nearest(rows)
    assert torch.equal(BeamSearch(CodewordSearch(codewords), 1).nearest(rows), exact)
