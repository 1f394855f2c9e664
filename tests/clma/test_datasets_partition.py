"""clma.datasets.partition: IID shards and Dirichlet(alpha) label skew."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import entropy

from clma.datasets.partition import dirichlet_partition, iid_partition


def _check_disjoint_cover(shards, n):
    allidx = np.concatenate(shards)
    assert allidx.dtype == np.int64
    np.testing.assert_array_equal(np.sort(allidx), np.arange(n))
    for s in shards:
        assert np.all(np.diff(s) > 0)  # sorted, no duplicates


def test_iid_sizes_disjoint_cover_and_seeded():
    shards = iid_partition(103, 10, np.random.default_rng(0))
    assert len(shards) == 10
    assert sorted(len(s) for s in shards) == [10] * 7 + [11] * 3
    _check_disjoint_cover(shards, 103)
    again = iid_partition(103, 10, np.random.default_rng(0))
    assert all(np.array_equal(a, b) for a, b in zip(shards, again, strict=True))
    other = iid_partition(103, 10, np.random.default_rng(1))
    assert not all(np.array_equal(a, b) for a, b in zip(shards, other, strict=True))


def test_iid_too_many_clients():
    assert len(iid_partition(20, 10, np.random.default_rng(0))) == 10
    with pytest.raises(ValueError, match="at least 2 samples"):
        iid_partition(19, 10, np.random.default_rng(0))
    with pytest.raises(ValueError, match="at least 2 samples"):
        iid_partition(10, 0, np.random.default_rng(0))


LABELS = np.repeat(np.arange(10), 100)  # 1000 samples, balanced


def _mean_label_entropy(shards, labels):
    ents = []
    for s in shards:
        counts = np.bincount(labels[s], minlength=10)
        ents.append(entropy(counts, base=2))
    return float(np.mean(ents))


def test_dirichlet_disjoint_cover_min_size():
    for alpha in (0.1, 1.0, 100.0):
        shards = dirichlet_partition(LABELS, 10, alpha, np.random.default_rng(3), min_size=20)
        assert len(shards) == 10
        _check_disjoint_cover(shards, LABELS.shape[0])
        assert min(len(s) for s in shards) >= 20


def test_dirichlet_skew_increases_as_alpha_decreases():
    # mean per-client label entropy (bits), averaged over 5 seeds; log2(10) = 3.32 is IID
    ent = {}
    for alpha in (0.05, 0.3, 1.0, 10.0, 1000.0):
        ent[alpha] = np.mean([
            _mean_label_entropy(
                dirichlet_partition(LABELS, 10, alpha, np.random.default_rng(s), min_size=5),
                LABELS,
            )
            for s in range(5)
        ])
    vals = [ent[a] for a in (0.05, 0.3, 1.0, 10.0, 1000.0)]
    assert all(a < b for a, b in zip(vals, vals[1:], strict=False)), ent
    assert ent[1000.0] > 3.25  # close to uniform over 10 labels
    assert ent[0.05] < 1.5  # most clients hold one or two labels


def test_dirichlet_reproducible_with_same_seed():
    a = dirichlet_partition(LABELS, 8, 0.5, np.random.default_rng(11))
    b = dirichlet_partition(LABELS, 8, 0.5, np.random.default_rng(11))
    c = dirichlet_partition(LABELS, 8, 0.5, np.random.default_rng(12))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_dirichlet_errors():
    with pytest.raises(ValueError, match="dirichlet_alpha must be positive"):
        dirichlet_partition(LABELS, 5, 0.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="minimum client size"):
        dirichlet_partition(LABELS[:50], 10, 1.0, np.random.default_rng(0), min_size=8)
    # min_size just feasible in count but (almost) never reached with extreme skew
    with pytest.raises(ValueError, match="no partition with at least 90 samples"):
        dirichlet_partition(LABELS, 10, 0.01, np.random.default_rng(0), min_size=90,
                            max_tries=5)
