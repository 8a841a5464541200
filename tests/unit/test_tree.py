"""Unit tests of the hierarchical codebook: level sizes, medoid structure, encoding, metrics."""

import pytest
import torch

from tracevq.errors import ConfigError
from tracevq.tree import CodebookTree, build_tree, level_sizes_for

METRICS = ("euclidean", "cosine", "frequency")


def _random_codebook(num_codewords: int, dim: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_codewords, dim, generator=torch.Generator().manual_seed(seed))


def _blobs(num_blobs: int = 4, per_blob: int = 16, dim: int = 8) -> torch.Tensor:
    """Codewords in well-separated blobs along distinct axes (far apart in angle too)."""
    generator = torch.Generator().manual_seed(1)
    centres = 10.0 * torch.eye(dim)[:num_blobs]  # (num_blobs, dim)
    noise = 0.3 * torch.randn(num_blobs, per_blob, dim, generator=generator)
    return (centres[:, None, :] + noise).reshape(-1, dim)  # blob b = rows b*per_blob ...


@pytest.fixture(scope="module")
def tree_1024() -> CodebookTree:
    return build_tree(_random_codebook(1024, 16), branching=2)


def test_level_sizes_k1024_b2(tree_1024):
    assert tree_1024.level_sizes == [2**i for i in range(1, 11)]
    assert tree_1024.num_levels == 10
    assert tree_1024.finest == 9
    assert tree_1024.level_bits == list(range(1, 11))
    assert tree_1024.bits(0) == 1 and tree_1024.bits(9) == 10


def test_level_sizes_k48_b4():
    assert level_sizes_for(48, 4) == [3, 12, 48]
    tree = build_tree(_random_codebook(48, 8), branching=4)
    assert tree.level_sizes == [3, 12, 48]
    assert tree.level_bits == [2, 4, 6]


def test_level_sizes_odd_counts():
    assert level_sizes_for(100, 2) == [2, 4, 7, 13, 25, 50, 100]
    assert level_sizes_for(5, 4) == [2, 5]
    assert level_sizes_for(3, 4) == [3]


def test_too_many_levels():
    with pytest.raises(ConfigError, match="17 levels; the header holds at most 16"):
        build_tree(torch.zeros(2**17, 1), branching=2)


def test_medoids_nest_and_are_distinct(tree_1024):
    finest = tree_1024.finest
    assert torch.equal(tree_1024.medoids[finest], torch.arange(1024))
    for m in range(finest):
        coarse, fine = tree_1024.medoids[m], tree_1024.medoids[m + 1]
        assert len(coarse.unique()) == len(coarse) == tree_1024.level_sizes[m]
        assert torch.isin(coarse, fine).all()


def test_leaf_to_position_consistent(tree_1024):
    finest = tree_1024.finest
    leaves = torch.arange(1024)
    assert torch.equal(tree_1024.leaf_to_position[finest], leaves)
    assert torch.equal(tree_1024.rows(tree_1024.leaf_to_position[finest], finest), leaves)
    for m in range(finest):
        representative = tree_1024.rows(tree_1024.leaf_to_position[m], m)  # (K,)
        # composed through the hierarchy: the level-m representative of a leaf is the level-m
        # representative of its level-(m+1) representative
        via_finer = tree_1024.rows(tree_1024.leaf_to_position[m + 1], m + 1)
        assert torch.equal(representative, representative[via_finer])
        # each medoid represents itself, and every position is used
        medoids = tree_1024.medoids[m]
        assert torch.equal(representative[medoids], medoids)
        assert len(tree_1024.leaf_to_position[m].unique()) == tree_1024.level_sizes[m]


def test_encode_finest_is_nearest_codeword(tree_1024):
    x = torch.randn(300, 16, generator=torch.Generator().manual_seed(5))
    brute = torch.cdist(x, tree_1024.codebook).argmin(dim=1)
    assert torch.equal(tree_1024.encode(x, tree_1024.finest), brute)


@pytest.mark.parametrize("m", [0, 3, 6, 8])
def test_encode_level_is_nearest_medoid(tree_1024, m):
    x = torch.randn(300, 16, generator=torch.Generator().manual_seed(6))
    medoid_vectors = tree_1024.codebook[tree_1024.medoids[m]]
    brute = torch.cdist(x, medoid_vectors).argmin(dim=1)
    positions = tree_1024.encode(x, m)
    assert torch.equal(positions, brute)
    assert positions.dtype == torch.long and positions.max() < tree_1024.level_sizes[m]


def test_encode_keeps_leading_shape(tree_1024):
    x = torch.randn(2, 5, 16)
    assert tree_1024.encode(x, 4).shape == (2, 5)


@pytest.mark.parametrize("metric", METRICS)
def test_blobs_separate_at_four_medoids(metric):
    codebook = _blobs()
    counts = torch.randint(1, 100, (64,), generator=torch.Generator().manual_seed(2))
    tree = build_tree(codebook, branching=2, metric=metric, counts=counts)
    level = tree.level_for_size(4)
    positions = tree.leaf_to_position[level].reshape(4, 16)  # (blob, codeword in blob)
    assert (positions == positions[:, :1]).all(), "a blob is split"
    assert len(positions[:, 0].unique()) == 4, "two blobs share a medoid"


def test_frequency_moves_medoid_to_heavy_codewords():
    # two far-apart groups of three codewords on a line; in the first group codeword 0 is used
    # far more than the others, so the usage-weighted medoid moves from the middle (1) to it
    codebook = torch.tensor([[0.0], [1.0], [2.0], [100.0], [101.0], [102.0]])
    counts = torch.tensor([1000, 1, 1, 1, 1, 1])
    plain = build_tree(codebook, branching=3)
    weighted = build_tree(codebook, branching=3, metric="frequency", counts=counts)
    assert plain.level_sizes == weighted.level_sizes == [2, 6]
    assert plain.medoids[0].tolist() == [1, 4]
    assert weighted.medoids[0].tolist() == [0, 4]


def test_state_dict_round_trip(tree_1024):
    state = tree_1024.state_dict()
    assert all(isinstance(value, torch.Tensor | int | str) for value in state.values())
    restored = CodebookTree.from_state_dict(state, tree_1024.codebook)
    assert restored.level_sizes == tree_1024.level_sizes
    x = torch.randn(200, 16, generator=torch.Generator().manual_seed(7))
    for m in range(tree_1024.num_levels):
        assert torch.equal(restored.encode(x, m), tree_1024.encode(x, m))
        assert torch.equal(restored.leaf_to_position[m], tree_1024.leaf_to_position[m])


def test_build_is_deterministic_for_a_seed():
    codebook = _random_codebook(64, 4)
    first, second = build_tree(codebook, seed=3), build_tree(codebook, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(first.medoids, second.medoids, strict=True))


def test_bad_metric_suggests_a_name():
    with pytest.raises(ConfigError, match="metric: unknown value 'cosin' .*did you mean 'cosine'"):
        build_tree(_random_codebook(8, 2), metric="cosin")


def test_frequency_needs_counts():
    with pytest.raises(ConfigError, match="counts: the frequency metric needs"):
        build_tree(_random_codebook(8, 2), metric="frequency")


def test_absent_level_size_lists_sizes(tree_1024):
    with pytest.raises(ConfigError, match=r"no codebook tree level has 3 codewords.*\[2, 4, 8"):
        tree_1024.level_for_size(3)
    assert tree_1024.level_for_size(32) == 4


def test_level_out_of_range(tree_1024):
    with pytest.raises(ConfigError, match=r"level 10 not in the codebook tree \(levels 0..9\)"):
        tree_1024.encode(torch.zeros(1, 16), 10)
