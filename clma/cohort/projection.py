"""Exact PCA of a client stack by the Gram trick (CLMA, Algorithm 3, step 2).

For a stack ``S`` of ``n`` client vectors with ``p`` parameters (``n << p``), the principal
components of ``S^T S`` (``p x p``, 8 p^2 bytes: 8 TB at one million parameters) are
obtained from the ``n x n`` Gram matrix ``G = S S^T``: if ``G = U diag(lam) U^T`` then
``S = U diag(sqrt(lam)) V^T`` (thin SVD), the non-zero eigenvalues of ``S^T S`` are ``lam``
and the projection of the rows onto the first ``k`` components is
``S V_k = U_k diag(sqrt(lam_k))``. Nothing ``p x p`` is ever formed.

Centering (``center=True``, the default) replaces ``S`` by ``S - 1 mean(S)`` before the
Gram matrix, i.e. ordinary PCA. ``center=False`` is the published CLMA form (second
moments about the origin).

Precision and memory. ``G`` is accumulated in float64 over blocks of columns: each block
(``n x block`` float32, at most ``block_bytes``) is converted to float64, centered by its own
column means when ``center=True`` (exact centering, no cancellation), and multiplied. The
float32 input is never copied as a whole; the only large allocation is one float64 block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "GramPCAResult",
    "centered_subgram",
    "displacement_gram",
    "gram_matrix",
    "gram_pca",
    "gram_pca_details",
    "gram_pca_from_gram",
]

DEFAULT_BLOCK_BYTES = 64 * 1024 * 1024


def _check_threshold(variance_threshold: float) -> float:
    v = float(variance_threshold)
    if not (0.0 < v <= 1.0) or not np.isfinite(v):
        raise ValueError("variance_threshold: must lie in (0, 1]")
    return v


def gram_matrix(matrix: np.ndarray, rows: np.ndarray | None = None, *, center: bool = True,
                block_bytes: int = DEFAULT_BLOCK_BYTES) -> np.ndarray:
    """Float64 Gram matrix ``S S^T`` of (a row subset of) a stack, by column blocks.

    Parameters
    ----------
    matrix:
        ``(n_clients, n_params)`` real array, float32 in CLMA; not copied.
    rows:
        Optional integer indices of the rows to use (a direction group); default all rows.
    center:
        Subtract the column means of the selected rows first (ordinary PCA).
    block_bytes:
        Upper bound on the float64 block held at once (default 64 MiB).

    Returns
    -------
    np.ndarray
        ``(m, m)`` float64 symmetric matrix, ``m`` = number of selected rows.
    """
    if matrix.ndim != 2:
        raise ValueError(f"matrix: must be 2-D (n_clients, n_params), got shape {matrix.shape}")
    idx = np.arange(matrix.shape[0]) if rows is None else np.asarray(rows, dtype=np.intp)
    m = idx.shape[0]
    p = matrix.shape[1]
    gram = np.zeros((m, m), dtype=np.float64)
    if m == 0 or p == 0:
        return gram
    block = max(1, int(block_bytes) // (8 * m))
    whole = rows is None
    for start in range(0, p, block):
        stop = min(p, start + block)
        part = matrix[:, start:stop] if whole else matrix[idx, start:stop]
        blk = part.astype(np.float64, copy=True)
        if center:
            blk -= blk.mean(axis=0, keepdims=True)
        gram += blk @ blk.T
        del blk, part
    # Symmetrise away round-off in the BLAS accumulation.
    gram += gram.T
    gram *= 0.5
    return gram


def displacement_gram(matrix: np.ndarray, reference: np.ndarray, *,
                      block_bytes: int = DEFAULT_BLOCK_BYTES) -> np.ndarray:
    """Float64 Gram matrix of the displacements ``D = matrix - reference``: ``D D^T``.

    ``matrix`` ``(n, n_params)`` (float32 in CLMA, not copied), ``reference``
    ``(n_params,)``. Accumulated by column blocks of at most ``block_bytes`` float64, so the
    extra memory is one block, never an ``(n, n_params)`` copy. Returns ``(n, n)`` float64.
    Mean displacements of client groups follow from it without touching the stack again:
    for indicator weights ``a_g`` (1/|g| on members), ``c_g . c_h = a_g^T (D D^T) a_h``.
    """
    if matrix.ndim != 2 or reference.shape != (matrix.shape[1],):
        raise ValueError("matrix/reference: need (n, n_params) and (n_params,)")
    n, p = matrix.shape
    gram = np.zeros((n, n), dtype=np.float64)
    if n == 0 or p == 0:
        return gram
    block = max(1, int(block_bytes) // (8 * n))
    for start in range(0, p, block):
        stop = min(p, start + block)
        blk = matrix[:, start:stop].astype(np.float64, copy=True)
        blk -= reference[start:stop]
        gram += blk @ blk.T
        del blk
    gram += gram.T
    gram *= 0.5
    return gram


def centered_subgram(gram: np.ndarray, rows: list[int] | np.ndarray) -> np.ndarray:
    """Mean-centered Gram matrix of a row subset, from any Gram matrix of those rows.

    For rows ``S`` (``m`` of them) of ``Y = X - r`` (any common offset ``r``, e.g. the
    reference), ``(Y_S - mean(Y_S)) (Y_S - mean(Y_S))^T = J G_SS J`` with
    ``J = I - 11^T / m``: the offset cancels, so the displacement Gram of
    :func:`displacement_gram` yields every group's centered Gram without reading the
    stack again. Returns ``(m, m)`` float64, symmetrised.
    """
    idx = np.asarray(rows, dtype=np.intp)
    sub = gram[np.ix_(idx, idx)]
    row_mean = sub.mean(axis=1, keepdims=True)
    col_mean = sub.mean(axis=0, keepdims=True)
    out = sub - row_mean - col_mean + sub.mean()
    out += out.T
    out *= 0.5
    return out


@dataclass(frozen=True)
class GramPCAResult:
    """Projection of the rows onto the retained principal components.

    Attributes
    ----------
    scores:
        ``(n, k)`` float64 coordinates ``U_k sqrt(lam_k)``; ``k == 0`` when the total
        variance is zero (all rows identical after centering, or all zero uncentered).
    eigenvalues:
        ``(r,)`` float64 non-negative eigenvalues of the Gram matrix, descending, with
        ``r`` the numerical rank (eigenvalues below ``1e-12 * max`` are dropped as zero).
        They equal the non-zero eigenvalues of ``S^T S`` (centered ``S`` when centering).
    n_components:
        ``k``: the smallest number of components whose explained-variance ratio exceeds
        ``variance_threshold`` (scikit-learn's rule for a float ``n_components``), capped at
        ``r``; with threshold 1.0 all ``r`` components.
    explained_variance_ratio:
        ``(k,)`` float64 ratio of each retained eigenvalue to the total.
    """

    scores: np.ndarray
    eigenvalues: np.ndarray
    n_components: int
    explained_variance_ratio: np.ndarray

    @property
    def retained_variance(self) -> float:
        """Sum of ``explained_variance_ratio`` (0.0 when nothing is retained)."""
        return float(self.explained_variance_ratio.sum())


def broken_stick_components(ratio: np.ndarray) -> int:
    """Leading components that explain more than the broken-stick expectation.

    With ``r`` components, the broken-stick model (Frontier 1976; Jackson 1993, Ecology
    74(8)) expects the k-th largest share of variance of ``r`` random sticks to be
    ``b_k = (1 / r) * sum_{i=k}^{r} 1 / i``; the rule keeps components 1..k while each
    ``ratio[j] > b_j`` and stops at the first that does not. ``ratio``: ``(r,)``
    descending explained-variance ratios summing to 1. Returns k in [0, r].
    """
    ratio = np.asarray(ratio, dtype=np.float64)
    r = ratio.shape[0]
    if r == 0:
        return 0
    expected = np.cumsum(1.0 / np.arange(r, 0, -1))[::-1] / r
    above = ratio > expected
    return r if above.all() else int(np.argmin(above))


def gram_pca_from_gram(gram: np.ndarray, variance_threshold: float = 0.95,
                       components: str = "variance") -> GramPCAResult:
    """PCA projection from a precomputed ``(n, n)`` Gram matrix (see :func:`gram_pca`).

    ``components``: "variance" keeps the components that reach ``variance_threshold``
    (below); "broken_stick" keeps the leading components above the broken-stick
    expectation (:func:`broken_stick_components`; may keep 0), ignoring the threshold.
    """
    if components not in ("variance", "broken_stick"):
        raise ValueError("components: must be 'variance' or 'broken_stick'")
    v = _check_threshold(variance_threshold)
    n = gram.shape[0]
    if n == 0:
        return GramPCAResult(np.zeros((0, 0)), np.zeros(0), 0, np.zeros(0))
    lam, vec = np.linalg.eigh(gram)
    order = np.argsort(lam)[::-1]
    lam = np.clip(lam[order], 0.0, None)
    vec = vec[:, order]
    top = float(lam[0]) if lam.size else 0.0
    if not top > 0.0:
        return GramPCAResult(np.zeros((n, 0)), np.zeros(0), 0, np.zeros(0))
    rank = int(np.count_nonzero(lam > top * 1e-12))
    lam = lam[:rank]
    vec = vec[:, :rank]
    ratio = lam / lam.sum()
    if components == "broken_stick":
        k = broken_stick_components(ratio)
    elif v >= 1.0:
        k = rank
    else:
        k = int(np.searchsorted(np.cumsum(ratio), v, side="right")) + 1
        k = min(k, rank)
    # Deterministic sign: the largest-magnitude entry of each eigenvector is positive.
    pivots = np.argmax(np.abs(vec[:, :k]), axis=0)
    signs = np.sign(vec[pivots, np.arange(k)])
    signs[signs == 0] = 1.0
    scores = vec[:, :k] * (signs * np.sqrt(lam[:k]))
    return GramPCAResult(scores, lam, k, ratio[:k].copy())


def gram_pca(matrix: np.ndarray, variance_threshold: float = 0.95, center: bool = True, *,
             rows: np.ndarray | None = None,
             block_bytes: int = DEFAULT_BLOCK_BYTES) -> np.ndarray:
    """Projection ``(n, k)`` float64 of the rows onto the retained components.

    Shorthand for ``gram_pca_details(...).scores``; see :func:`gram_pca_details`.
    """
    return gram_pca_details(matrix, variance_threshold, center, rows=rows,
                            block_bytes=block_bytes).scores


def gram_pca_details(matrix: np.ndarray, variance_threshold: float = 0.95, center: bool = True,
                     *, rows: np.ndarray | None = None,
                     block_bytes: int = DEFAULT_BLOCK_BYTES) -> GramPCAResult:
    """Exact PCA projection of the rows of a client stack via the ``n x n`` Gram matrix.

    Parameters
    ----------
    matrix:
        ``(n_clients, n_params)`` float32 stack (any real dtype accepted; never copied whole).
    variance_threshold:
        In (0, 1]: keep the fewest components explaining more than this fraction of the
        variance (scikit-learn's ``PCA(n_components=float)`` rule); 1.0 keeps all non-zero.
    center:
        True: ordinary (mean-centered) PCA. False: the published CLMA form (uncentered).
    rows:
        Optional row indices (a direction group) to project instead of the whole stack.

    Returns
    -------
    GramPCAResult
        ``.scores`` ``(n, k)`` float64, equal up to the sign of each column to the projection
        ``S V_k`` onto the top eigenvectors of ``S^T S`` (pairwise distances identical).
        Zero variance gives ``k == 0`` and ``scores`` of shape ``(n, 0)``.

    Raises
    ------
    ValueError
        ``matrix`` not 2-D or non-finite; ``variance_threshold`` outside (0, 1].

    Source: CLMA Algorithm 3 (PCA of the quarantined clients' parameters); Gram trick as in
    Turk & Pentland's eigenfaces (1991).
    """
    _check_threshold(variance_threshold)
    arr = np.asarray(matrix)
    if arr.ndim != 2:
        raise ValueError(f"matrix: must be 2-D (n_clients, n_params), got shape {arr.shape}")
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"matrix: must hold real numbers, got dtype {arr.dtype}")
    with np.errstate(invalid="ignore", over="ignore"):  # reported below, naming the field
        gram = gram_matrix(arr, rows, center=center, block_bytes=block_bytes)
    if not np.isfinite(gram).all():
        raise ValueError("matrix: must be finite (NaN or inf found)")
    return gram_pca_from_gram(gram, variance_threshold)
