"""Clustering of projected client coordinates (CLMA, Algorithm 3, step 3).

:class:`Clusterer` is the extension point; :class:`AutoKMeans` is the default: scikit-learn
k-means with the number of clusters chosen by the silhouette score (scikit-learn
``silhouette_score``), falling back to a single cluster when no k reaches
``min_silhouette``. ``AutoKMeans(fixed_k=2)`` is the published algorithm's k-means with k=2.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
from scipy.cluster.hierarchy import fcluster, linkage
from sklearn.cluster import KMeans
from sklearn.exceptions import ConvergenceWarning
from sklearn.metrics import silhouette_score

__all__ = ["AutoKMeans", "ClusteringResult", "Clusterer", "OneCohortPerClient",
           "canonical_labels"]


def canonical_labels(labels: np.ndarray) -> np.ndarray:
    """Relabel so labels are 0, 1, ... in order of first appearance (int64 ``(n,)``)."""
    labels = np.asarray(labels)
    out = np.empty(labels.shape[0], dtype=np.int64)
    mapping: dict[object, int] = {}
    for i, lab in enumerate(labels.tolist()):
        if lab not in mapping:
            mapping[lab] = len(mapping)
        out[i] = mapping[lab]
    return out


@dataclass(frozen=True)
class ClusteringResult:
    """Labels plus diagnostics of one clustering.

    ``labels`` int64 ``(n,)`` contiguous from 0 in order of first appearance; ``k`` the number
    of clusters returned; ``silhouettes`` maps each k tried to its silhouette score;
    ``reason`` says how k was chosen.
    """

    labels: np.ndarray
    k: int
    silhouettes: dict[int, float] = field(default_factory=dict)
    reason: str = ""


class Clusterer(ABC):
    """Extension point: assign each row of ``X`` ``(n, d)`` to a cluster."""

    @abstractmethod
    def fit_predict(self, X: np.ndarray) -> np.ndarray:
        """Return int labels ``(n,)``, contiguous from 0 in order of first appearance."""

    def fit_predict_details(self, X: np.ndarray) -> ClusteringResult:
        """Labels with diagnostics; the default wraps :meth:`fit_predict`."""
        labels = canonical_labels(self.fit_predict(X))
        k = int(labels.max()) + 1 if labels.size else 0
        return ClusteringResult(labels, k, {}, type(self).__name__)


def _validate_X(X: object) -> np.ndarray:
    arr = np.asarray(X, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"X: must be 2-D (n_samples, n_features), got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError("X: must be finite (NaN or inf found)")
    return arr


def _n_distinct(arr: np.ndarray, rel_tol: float = 1e-9) -> int:
    """Number of distinct points, counting points within ``rel_tol`` times the largest
    coordinate magnitude of each other (single linkage) as one: projections of identical
    parameter vectors differ only by round-off and must not be split."""
    scale = float(np.abs(arr).max()) if arr.size else 0.0
    if scale == 0.0:
        return 1
    return int(fcluster(linkage(arr, method="single"), t=rel_tol * scale,
                        criterion="distance").max())


class AutoKMeans(Clusterer):
    """k-means with k chosen by silhouette, or pinned by ``fixed_k``.

    Parameters
    ----------
    fixed_k:
        If given (>= 1), use exactly ``min(fixed_k, n_samples, n_distinct_points)`` clusters.
    max_k:
        Largest k tried when choosing by silhouette (>= 2). Candidates are
        ``2 .. min(max_k, n - 1, n_distinct)`` (the silhouette is defined for 2 <= k <= n-1).
    min_silhouette:
        Floor in [-1, 1]: if the best silhouette is below it, one cluster is returned.
        Ties between k go to the smaller k.
    random_state:
        Seed of scikit-learn's k-means initialisation (``n_init`` restarts).
    n_init:
        Number of k-means restarts (default 10).

    Defined behaviour on small inputs: ``n == 0`` gives no labels; ``n == 1``, all points
    identical (up to round-off: within 1e-9 of the largest coordinate magnitude), or zero
    features give one cluster; ``n == 2`` with automatic k gives one
    cluster (no silhouette exists for 2 points), with ``fixed_k >= 2`` two singletons.
    """

    def __init__(self, fixed_k: int | None = None, max_k: int = 10,
                 min_silhouette: float = 0.25, random_state: int = 0, n_init: int = 10) -> None:
        if fixed_k is not None and (int(fixed_k) != fixed_k or fixed_k < 1):
            raise ValueError("fixed_k: must be None or an integer >= 1")
        if int(max_k) != max_k or max_k < 2:
            raise ValueError("max_k: must be an integer >= 2")
        if not (-1.0 <= float(min_silhouette) <= 1.0):
            raise ValueError("min_silhouette: must lie in [-1, 1]")
        if int(n_init) != n_init or n_init < 1:
            raise ValueError("n_init: must be an integer >= 1")
        self.fixed_k = None if fixed_k is None else int(fixed_k)
        self.max_k = int(max_k)
        self.min_silhouette = float(min_silhouette)
        self.random_state = int(random_state)
        self.n_init = int(n_init)

    def __repr__(self) -> str:
        return (f"AutoKMeans(fixed_k={self.fixed_k}, max_k={self.max_k}, "
                f"min_silhouette={self.min_silhouette}, random_state={self.random_state})")

    def _kmeans(self, X: np.ndarray, k: int) -> np.ndarray:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            km = KMeans(n_clusters=k, n_init=self.n_init, random_state=self.random_state)
            return km.fit_predict(X)

    def fit_predict(self, X: np.ndarray) -> np.ndarray:
        """Labels ``(n,)`` int64, contiguous from 0 in order of first appearance."""
        return self.fit_predict_details(X).labels

    def fit_predict_details(self, X: np.ndarray) -> ClusteringResult:
        arr = _validate_X(X)
        n = arr.shape[0]
        if n == 0:
            return ClusteringResult(np.zeros(0, dtype=np.int64), 0, {}, "empty")
        one = np.zeros(n, dtype=np.int64)
        if n == 1:
            return ClusteringResult(one, 1, {}, "single point")
        if arr.shape[1] == 0:
            return ClusteringResult(one, 1, {}, "no variance (zero features)")
        n_distinct = _n_distinct(arr)
        if n_distinct == 1:
            return ClusteringResult(one, 1, {}, "all points identical")
        if self.fixed_k is not None:
            k = min(self.fixed_k, n, n_distinct)
            if k == 1:
                return ClusteringResult(one, 1, {}, "fixed_k")
            labels = canonical_labels(self._kmeans(arr, k))
            return ClusteringResult(labels, int(labels.max()) + 1, {}, "fixed_k")
        upper = min(self.max_k, n - 1, n_distinct)
        if upper < 2:
            return ClusteringResult(one, 1, {}, "too few points for a silhouette")
        scores: dict[int, float] = {}
        best_k, best_s, best_labels = 1, -np.inf, one
        for k in range(2, upper + 1):
            labels = self._kmeans(arr, k)
            n_lab = np.unique(labels).size
            if n_lab < 2 or n_lab > n - 1:
                continue
            s = float(silhouette_score(arr, labels))
            scores[k] = s
            if s > best_s:
                best_k, best_s, best_labels = k, s, labels
        if best_k == 1 or best_s < self.min_silhouette:
            return ClusteringResult(one, 1, scores, "best silhouette below min_silhouette")
        labels = canonical_labels(best_labels)
        return ClusteringResult(labels, int(labels.max()) + 1, scores, "silhouette")


class OneCohortPerClient(Clusterer):
    """Every row its own cluster (fed-clma's maximally conservative baseline: no drifted
    client shares a cohort). Labels ``0 .. n-1`` int64."""

    def fit_predict(self, X: np.ndarray) -> np.ndarray:
        return np.arange(_validate_X(X).shape[0], dtype=np.int64)

    def __repr__(self) -> str:
        return "OneCohortPerClient()"
