"""A significance test for a two-group split along the leading principal component.

Why (a departure from CLMA, measured in docs/realistic_drift.md section 6). Under
covariate drift two families of quarantined clients (30-degree rotation and pixel noise,
or blur and rotation) are told apart by the first principal component of the clients'
displacements ``d_i = x_i - r``: on the digits with IID clients the true families'
scores along it are 4-8 pooled standard deviations apart. But that component carries only
10-16 % of the variance (the rest is each client's own sampling noise spread over many
directions), below the broken-stick expectation (``H_(n-1) / (n-1)``: 13.7 % for 30
clients), so ``components = "broken_stick"`` keeps no component and the families share a
cohort. A variance share cannot tell "one component carries a split" from "one component
is a bit larger"; a test of the scores' shape can.

Test (after SigClust: Liu, Hayes, Nobel and Marron, "Statistical significance of
clustering for high-dimension, low-sample-size data", JASA 103(483), 2008, sec. 2; here in
one dimension, on the leading component). The statistic is the 2-means cluster index of
the leading component's scores ``z`` (length ``n``), the smallest within-group sum of
squares over total sum of squares,

    CI(z) = min over splits (A, B), |A|, |B| >= m, of
            [ sum_A (z_j - mean_A)^2 + sum_B (z_j - mean_B)^2 ] / sum_j (z_j - mean z)^2,

computed exactly (1-D 2-means splits are contiguous in sorted order: every split point is
tried). Small ``CI`` = two well separated groups. Null: the displacements are one Gaussian
cloud with isotropic noise, ``d_i = mu + sigma e_i``, ``e_i ~ N(0, I_p)`` i.i.d. Then the
centered data ``J D`` (``J = I - 11^T / n``) has the same law as ``Q J D`` for every
orthogonal ``Q`` fixing ``1``, so its leading left singular vector is uniform on the unit
sphere of ``1^perp``, and ``CI`` (scale-free) is distributed exactly as ``CI(u)`` for ``u``
a centered, normalised standard Gaussian vector of length ``n``, whatever ``p``, ``mu``
and ``sigma``. That law is simulated (``draws`` vectors, a fixed seed per ``(n, m)``: the
same clients give the same decision on a retried round) and the Monte-Carlo p-value is
``(1 + #{null CI <= CI(z)}) / (1 + draws)``. Real client noise is not isotropic; the false
split rate of single families under the simulation's drifts and label skews is measured in
docs/realistic_drift.md section 6.

The minimum group size ``m`` keeps a lone outlying client from being split off as a
"family" (the cohort floor of the evaluation applies later in any case).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

__all__ = ["LeadingSplit", "cluster_index", "leading_split_test", "null_cluster_indices"]


@dataclass(frozen=True)
class LeadingSplit:
    """Result of :func:`leading_split_test`.

    Attributes:
        cluster_index: ``CI(z)`` in [0, 1] (smaller = more separated).
        p_value: Monte-Carlo p-value in ``(0, 1]`` (``1 / (1 + draws)`` at the smallest).
        labels: ``(n,)`` int64 0/1 group of each score (the optimal split; group 0 holds
            the smaller scores).
        significant: ``p_value <= alpha``.
    """

    cluster_index: float
    p_value: float
    labels: np.ndarray
    significant: bool


def _batched_ci(z: np.ndarray, min_size: int) -> tuple[np.ndarray, np.ndarray]:
    """CI of each row of ``z`` (``(b, n)`` float64) and the split point in sorted order."""
    s = np.sort(z, axis=1)
    n = s.shape[1]
    c1 = np.cumsum(s, axis=1)
    c2 = np.cumsum(s * s, axis=1)
    tot1, tot2 = c1[:, -1:], c2[:, -1:]
    i = np.arange(min_size, n - min_size + 1)  # size of the lower group
    left = c2[:, i - 1] - c1[:, i - 1] ** 2 / i
    r1, r2 = tot1 - c1[:, i - 1], tot2 - c2[:, i - 1]
    right = r2 - r1 ** 2 / (n - i)
    within = left + right
    best = np.argmin(within, axis=1)
    tss = (tot2 - tot1 ** 2 / n)[:, 0]
    ci = within[np.arange(len(s)), best] / np.where(tss > 0, tss, np.inf)
    return np.where(tss > 0, ci, 1.0), i[best]


def cluster_index(z: np.ndarray, min_size: int = 1) -> tuple[float, np.ndarray]:
    """Exact 1-D 2-means cluster index of ``z`` (module docs) and the 0/1 labels.

    Args:
        z: ``(n,)`` finite scores, ``n >= 2 * min_size``.
        min_size: smallest group, ``>= 1``.

    Returns:
        ``(CI, labels)``: CI in [0, 1] (1.0 when all scores are equal), labels ``(n,)``
        int64, 0 for the lower group.

    Raises:
        ValueError: ``min_size < 1``, ``n < 2 * min_size``, or a non-finite score.
    """
    z = np.asarray(z, dtype=np.float64)
    if int(min_size) != min_size or min_size < 1:
        raise ValueError("min_size: must be an integer >= 1")
    if z.ndim != 1 or len(z) < 2 * min_size:
        raise ValueError(f"z: must be a vector of at least 2 * min_size = {2 * min_size} "
                         "scores")
    if not np.isfinite(z).all():
        raise ValueError("z: scores must be finite")
    ci, split = _batched_ci(z[None, :], int(min_size))
    labels = np.zeros(len(z), dtype=np.int64)
    labels[np.argsort(z, kind="stable")[int(split[0]):]] = 1
    return float(ci[0]), labels


@lru_cache(maxsize=64)
def null_cluster_indices(n: int, min_size: int, draws: int = 999, seed: int = 0
                         ) -> np.ndarray:
    """``(draws,)`` CI of centered standard Gaussian vectors of length ``n`` (the null law
    of the module docs), sorted; seeded by ``(seed, n, min_size)``."""
    rng = np.random.default_rng([int(seed), int(n), int(min_size)])
    z = rng.standard_normal((int(draws), int(n)))
    z -= z.mean(axis=1, keepdims=True)
    ci, _ = _batched_ci(z, int(min_size))
    out = np.sort(ci)
    out.setflags(write=False)
    return out


def leading_split_test(scores: np.ndarray, alpha: float, min_size: int = 5,
                       draws: int = 999) -> LeadingSplit:
    """Test a two-group split of the leading principal component's scores (module docs).

    Args:
        scores: ``(n,)`` float scores of the ``n`` clients on the leading component.
        alpha: significance level in (0, 1).
        min_size: smallest group of a split, ``>= 1``.
        draws: Monte-Carlo draws of the null (``>= 99``).

    Returns:
        :class:`LeadingSplit`. Fewer than ``2 * min_size`` clients: not significant
        (p-value 1, one group).

    Raises:
        ValueError: ``alpha`` outside (0, 1), ``draws < 99``, ``min_size < 1``, or a
            non-finite score.
    """
    if not (0.0 < float(alpha) < 1.0):
        raise ValueError("alpha: must lie in (0, 1)")
    if int(draws) != draws or draws < 99:
        raise ValueError("draws: must be an integer >= 99")
    if int(min_size) != min_size or min_size < 1:
        raise ValueError("min_size: must be an integer >= 1")
    z = np.asarray(scores, dtype=np.float64).ravel()
    if not np.isfinite(z).all():
        raise ValueError("scores: must be finite")
    if len(z) < 2 * min_size:
        return LeadingSplit(1.0, 1.0, np.zeros(len(z), dtype=np.int64), False)
    ci, labels = cluster_index(z, min_size)
    null = null_cluster_indices(len(z), int(min_size), int(draws))
    below = int(np.searchsorted(null, ci, side="right"))  # null CI <= observed
    p = (1 + below) / (1 + int(draws))
    return LeadingSplit(ci, p, labels, p <= alpha)
