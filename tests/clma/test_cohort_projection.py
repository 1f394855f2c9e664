"""Gram-trick PCA against the literal eigendecomposition of S^T S; AutoKMeans edge cases."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.spatial.distance import pdist
from sklearn.decomposition import PCA

from clma.cohort import AutoKMeans, Clusterer, gram_matrix, gram_pca, gram_pca_details


def literal_projection(S: np.ndarray, threshold: float, center: bool):
    """The literal route: eig of the p x p matrix S^T S, project S on the top components."""
    X = S.astype(np.float64)
    if center:
        X = X - X.mean(axis=0)
    lam, V = np.linalg.eigh(X.T @ X)
    order = np.argsort(lam)[::-1]
    lam, V = np.clip(lam[order], 0, None), V[:, order]
    ratio = lam / lam.sum()
    k = int(np.searchsorted(np.cumsum(ratio), threshold, side="right")) + 1
    return X @ V[:, :k], ratio[:k]


@pytest.mark.parametrize("center", [True, False])
@pytest.mark.parametrize("threshold", [0.5, 0.8, 0.95])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gram_trick_equals_literal_eig(center: bool, threshold: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, p = 9, 40
    S = (rng.normal(size=(n, 3)) @ rng.normal(size=(3, p)) + 0.3 * rng.normal(size=(n, p))
         + rng.normal(size=p)).astype(np.float32)
    res = gram_pca_details(S, threshold, center, block_bytes=8 * n * 7)  # several blocks
    lit_scores, lit_ratio = literal_projection(S, threshold, center)
    assert res.n_components == lit_scores.shape[1]
    np.testing.assert_allclose(res.explained_variance_ratio, lit_ratio, rtol=1e-9, atol=1e-12)
    assert res.retained_variance == pytest.approx(lit_ratio.sum(), rel=1e-10)
    np.testing.assert_allclose(pdist(res.scores), pdist(lit_scores), rtol=1e-8, atol=1e-10)
    # Same columns up to sign.
    for j in range(res.n_components):
        a, b = res.scores[:, j], lit_scores[:, j]
        assert min(np.abs(a - b).max(), np.abs(a + b).max()) < 1e-8 * max(1.0, np.abs(b).max())


def test_centered_matches_sklearn_pca() -> None:
    rng = np.random.default_rng(3)
    S = rng.normal(size=(12, 30)).astype(np.float32) * np.linspace(0.1, 3, 30)
    ours = gram_pca(S, 0.9, center=True)
    pca = PCA(n_components=0.9, svd_solver="full").fit(S.astype(np.float64))
    ref = pca.transform(S.astype(np.float64))
    assert ours.shape == ref.shape
    np.testing.assert_allclose(pdist(ours), pdist(ref), rtol=1e-6)


def test_rows_subset_and_no_full_copy() -> None:
    rng = np.random.default_rng(4)
    S = rng.normal(size=(10, 50)).astype(np.float32)
    rows = np.array([7, 2, 5, 0])
    a = gram_pca(S, 0.99, True, rows=rows)
    b = gram_pca(S[rows].copy(), 0.99, True)
    np.testing.assert_allclose(pdist(a), pdist(b), rtol=1e-10)
    g = gram_matrix(S, rows, center=False, block_bytes=64)
    np.testing.assert_allclose(g, S[rows].astype(np.float64) @ S[rows].T.astype(np.float64),
                               rtol=1e-12)


def test_threshold_one_keeps_all_nonzero_components() -> None:
    rng = np.random.default_rng(5)
    S = rng.normal(size=(6, 20)).astype(np.float32)
    res = gram_pca_details(S, 1.0, center=True)
    assert res.n_components == 5  # centering removes one dimension
    np.testing.assert_allclose(pdist(res.scores), pdist(S.astype(np.float64)), rtol=1e-9)


def test_zero_variance_cases() -> None:
    v = np.arange(10, dtype=np.float32)
    same = np.tile(v, (4, 1))
    res = gram_pca_details(same, 0.95, center=True)
    assert res.n_components == 0 and res.scores.shape == (4, 0)
    assert gram_pca_details(np.zeros((3, 10), np.float32), 0.95, center=False).n_components == 0
    # Uncentered identical rows: one component, all scores equal.
    unc = gram_pca(same, 0.95, center=False)
    assert unc.shape == (4, 1) and np.ptp(unc) < 1e-9


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="variance_threshold"):
        gram_pca(np.ones((2, 3), np.float32), 0.0)
    with pytest.raises(ValueError, match="matrix"):
        gram_pca(np.ones(3, np.float32))
    bad = np.ones((2, 3), np.float32)
    bad[1, 1] = np.inf
    with pytest.raises(ValueError, match="finite"):
        gram_pca(bad)


# ---------------------------------------------------------------- AutoKMeans


def blobs(rng: np.random.Generator, centers: list[float], per: int) -> np.ndarray:
    return np.concatenate([rng.normal(c, 0.05, size=(per, 2)) for c in centers])


def test_autokmeans_is_clusterer_and_chooses_k_by_silhouette() -> None:
    rng = np.random.default_rng(0)
    km = AutoKMeans()
    assert isinstance(km, Clusterer)
    X = blobs(rng, [0.0, 5.0, 10.0], 5)
    res = km.fit_predict_details(X)
    assert res.k == 3 and res.reason == "silhouette"
    assert list(res.labels) == [0] * 5 + [1] * 5 + [2] * 5
    assert max(res.silhouettes, key=res.silhouettes.get) == 3


def test_autokmeans_floor_returns_one_cluster() -> None:
    rng = np.random.default_rng(1)
    X = rng.normal(size=(40, 3))  # one Gaussian blob: best silhouette well below 0.5
    res = AutoKMeans(min_silhouette=0.5).fit_predict_details(X)
    assert res.k == 1 and max(res.silhouettes.values()) < 0.5
    assert AutoKMeans(min_silhouette=-1.0).fit_predict_details(X).k >= 2


@pytest.mark.parametrize("X, fixed_k, expected", [
    (np.zeros((0, 2)), None, []),
    (np.array([[1.0, 2.0]]), None, [0]),
    (np.array([[1.0, 2.0]]), 2, [0]),
    (np.array([[0.0], [9.0]]), None, [0, 0]),      # no silhouette for 2 points
    (np.array([[0.0], [9.0]]), 2, [0, 1]),
    (np.array([[0.0], [9.0]]), 5, [0, 1]),         # fixed_k capped by n
    (np.ones((5, 3)), None, [0] * 5),              # identical points
    (np.ones((5, 3)), 2, [0] * 5),
    (np.zeros((4, 0)), 3, [0] * 4),                # zero features (zero variance)
    (np.array([[0.0], [0.0], [9.0]]), 3, [0, 0, 1]),  # capped by distinct points
    (np.array([[1.0], [1.0 + 1e-12], [1.0 - 1e-12]]), 2, [0, 0, 0]),  # round-off only
])
def test_autokmeans_small_inputs(X, fixed_k, expected) -> None:
    assert AutoKMeans(fixed_k=fixed_k).fit_predict(X).tolist() == expected


def test_autokmeans_validation() -> None:
    with pytest.raises(ValueError, match="fixed_k"):
        AutoKMeans(fixed_k=0)
    with pytest.raises(ValueError, match="max_k"):
        AutoKMeans(max_k=1)
    with pytest.raises(ValueError, match="min_silhouette"):
        AutoKMeans(min_silhouette=2)
    with pytest.raises(ValueError, match="X"):
        AutoKMeans().fit_predict(np.array([[np.nan, 1.0], [1.0, 2.0]]))
