"""Cohort merging: find cohorts whose models have reconverged (issue 3, items 4 and 6b).

Distance. Cohort models are compared by their *displacement from a common reference*
(e.g. the global model they all descend from), not by their raw parameter vectors:
``d_i = model_i - reference`` and ``distance(i, j) = 1 - cos(d_i, d_j)`` in [0, 2]
(float64). Raw vectors share the initialisation, whose norm dwarfs what training changed,
so the raw cosine distance of clearly different drifts is tiny (about 0.005-0.02 in the
reference package's measurements, merged at threshold 0.05); the displacement cosine sees
only what the cohorts learned. Conventions: two zero displacements have distance 0 (both
unchanged: same model); a zero and a non-zero displacement have distance 1 (no common
direction).

Rule. Cohorts are grouped by complete linkage at ``threshold``: every pair inside a merge
group is at distance ``<= threshold`` (merging happens *at* the threshold, not above), via
``scipy.cluster.hierarchy`` (``fcluster(..., criterion="distance")``). ``threshold=None``
(the default of the federation's ``merge_cohorts_threshold``) disables merging.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import numpy as np
from scipy.cluster.hierarchy import fcluster, linkage

from clma.params.errors import NonFiniteParameterError, ParameterAlignmentError

__all__ = ["displacement_cosine_distances", "merge_candidates", "raw_cosine_distances"]


def _cosine_distance_matrix(vectors: list[np.ndarray]) -> np.ndarray:
    n = len(vectors)
    gram = np.empty((n, n), dtype=np.float64)
    for i in range(n):
        for j in range(i, n):
            gram[i, j] = gram[j, i] = float(np.dot(vectors[i].astype(np.float64, copy=False),
                                                   vectors[j].astype(np.float64, copy=False)))
    norms = np.sqrt(np.clip(np.diag(gram), 0.0, None))
    dist = np.ones((n, n), dtype=np.float64)
    for i in range(n):
        for j in range(n):
            if norms[i] > 0 and norms[j] > 0:
                cos = gram[i, j] / (norms[i] * norms[j])
                dist[i, j] = 1.0 - min(1.0, max(-1.0, cos))
            elif norms[i] == 0 and norms[j] == 0:
                dist[i, j] = 0.0
    np.fill_diagonal(dist, 0.0)
    return dist


def _vectors(models: Mapping[Hashable, np.ndarray], length: int | None) -> list[np.ndarray]:
    out = []
    for cid, v in models.items():
        arr = np.asarray(v)
        if arr.ndim != 1 or (length is not None and arr.shape[0] != length):
            raise ParameterAlignmentError(
                f"models: vector of cohort {cid!r} has shape {arr.shape}, expected "
                f"({length},)")
        if not np.isfinite(arr).all():
            raise NonFiniteParameterError(f"models: vector of cohort {cid!r} contains NaN or inf")
        out.append(arr)
    return out


def displacement_cosine_distances(models: Mapping[Hashable, np.ndarray],
                                  reference: np.ndarray) -> np.ndarray:
    """``(n, n)`` float64 cosine distances between ``model_i - reference`` (mapping order)."""
    ref = np.asarray(reference)
    if ref.ndim != 1 or not np.isfinite(ref).all():
        raise ParameterAlignmentError("reference: must be a finite 1-D vector (n_params,)")
    vecs = _vectors(models, ref.shape[0])
    return _cosine_distance_matrix([v.astype(np.float64) - ref for v in vecs])


def raw_cosine_distances(models: Mapping[Hashable, np.ndarray]) -> np.ndarray:
    """``(n, n)`` cosine distances between the raw model vectors (the reference package's
    rule; kept for comparison, not used for merging)."""
    vecs = _vectors(models, None)
    if len({v.shape[0] for v in vecs}) > 1:
        raise ParameterAlignmentError("models: vectors have different lengths")
    return _cosine_distance_matrix(vecs)


def merge_candidates(models: Mapping[Hashable, np.ndarray], reference: np.ndarray,
                     threshold: float | None) -> list[list[Hashable]]:
    """Groups of cohorts whose models have reconverged and should merge.

    Parameters
    ----------
    models:
        cohort id -> model parameter vector ``(n_params,)`` (float32).
    reference:
        The common reference vector ``(n_params,)`` the displacements are measured from.
    threshold:
        Cosine distance in [0, 2]; ``None`` disables merging (returns ``[]``).

    Returns
    -------
    list of lists
        Each inner list (>= 2 cohort ids, in ``models`` order) is a complete-linkage group
        whose pairwise displacement cosine distances are all ``<= threshold``; groups are
        ordered by their first member. Cohorts merging with nobody are omitted.

    Raises
    ------
    ValueError
        ``threshold`` outside [0, 2]; vectors of different lengths or non-finite (naming the
        cohort).
    """
    if threshold is None:
        return []
    t = float(threshold)
    if not (0.0 <= t <= 2.0):
        raise ValueError("threshold: must be None or lie in [0, 2]")
    ids = list(models)
    if len(ids) < 2:
        return []
    dist = displacement_cosine_distances(models, reference)
    condensed = dist[np.triu_indices(len(ids), k=1)]
    labels = fcluster(linkage(condensed, method="complete"), t=t, criterion="distance")
    groups: dict[int, list[Hashable]] = {}
    for cid, lab in zip(ids, labels.tolist(), strict=True):
        groups.setdefault(lab, []).append(cid)
    return [g for g in groups.values() if len(g) >= 2]
