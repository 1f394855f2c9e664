"""CLMA cohorting of quarantined clients (Algorithm 3 of CLMA, with documented improvements).

Published algorithm (Adarsh N L, Amarlingam, Sharma, CODS-COMAD 2024,
doi 10.1145/3703323.3703341, Algorithm 3): for each quarantined client, the signed KS
statistic of its parameter vector against the reference (the cohort model it started
from); the sign splits the clients into two direction groups; within each group, PCA of the
parameter vectors (uncentered, via the Gram matrix) keeping ``variance_threshold`` of the
variance, then k-means with k = 2. That exact form is
``CLMACohorter(center=False, clusterer=AutoKMeans(fixed_k=2))`` (its ``direction_rule``
"auto" then resolves to "sign", i.e. the sign is always trusted).

Defaults, and why they differ from the published form:

* ``center=True``. Uncentered, the first component is the shared global component (the
  common initialisation plus the common drift), it absorbs ~all the variance, and the 1-D
  scores of *identically drifted* clients (which differ only by noise) look clusterable:
  k-means splits one family in two. Centered PCA removes the shared component, so only
  between-client structure remains (tested: identical drifts -> 1 cohort centered, > 1
  uncentered with the silhouette rule).
* ``AutoKMeans()`` (k by silhouette with a 0.25 floor) instead of k = 2: a direction group
  may hold one family or several.
* ``direction_rule="established"`` (what "auto" means when centering): the KS sign is only
  trusted when the direction is statistically established, ``|D+ - D-|`` greater than the
  asymptotic two-sample KS critical value at ``direction_alpha`` for the two sample sizes
  (:func:`clma.cohort.ks.ks_critical_value`). A drift that only widens the parameter
  distribution (zero-mean displacement) has ``D+ ~ D-`` and a sign that is noise; the
  published rule then scatters each family over both sign groups (issue 3, item 6a: three
  zero-mean families of four clients came out as ~6 cohorts). Such clients go to an
  "undirected" group that is clustered like the others. Opposite mean shifts have a clear
  gap and keep their sign groups.
* ``min_ks_magnitude``: clients whose ``|signed KS|`` is below it are pooled in one
  "no_shift" cohort (not clustered) instead of being forced into a direction group.
* ``spread_floor`` (default 1e-5 when centering): a direction group whose spread is
  floating-point noise relative to the vectors' scale is one cohort, never clustered.
  Rule: with ``m`` members, ``spread = sqrt(trace(centered Gram) / m)`` (the RMS distance
  of the members to their mean) and ``scale = sqrt(||r||^2 + max_i ||x_i - r||^2)`` (``r``
  the reference), the group stays one cohort when ``spread <= spread_floor * scale``.
  Why: bit-identical client vectors (clients that drifted identically) give a centered
  Gram matrix that is zero up to round-off (~1e-16 of ``||x - r||^2``); its PCA scores are
  pure noise, and the silhouette is scale-free, so k-means "found" 2-4 cohorts with
  silhouettes 0.56-0.92 in about one trial in ten (issue 14, item 6). A float32 vector has
  a relative resolution of ~6e-8, so a spread below 1e-5 of the vectors' scale (~170
  ulps) is not a drift that float32 training can represent; real families are apart by
  1e-2 and more of that scale. The published form (``center=False``) keeps no floor.

Label-skewed clients (``components="broken_stick"``, off by default). A fixed variance
share keeps too many components when the clients' own noise grows: on the default scenario
with Dirichlet(alpha) label skew (docs/realistic_drift.md), the split between two opposite
drift families is still the leading component of the centered Gram matrix (eigenvalue
4.4-5.6 against 1.5-2.1 for the next one at alpha 1 and 0.5), but it holds only 17-23 % of
the variance, so 80 % keeps 11-14 components of client noise per direction group, the
silhouette falls below its floor and both families become one cohort; and the KS sign
follows the clients' own noise more than the drift (both families mostly "undirected", the
"positive" group mixed), hence ``direction_rule="none"`` with it. The broken-stick rule keeps the components that
explain more than random sticks would (there: only the family split; for one family,
none, so it stays one cohort).

Four further departures, measured in docs/realistic_drift.md section 8 and off in this
class by default (the library's "improved" method turns them on): a split along one
direction whose two sides point the same way (``leading_split_family_ratio``) is one
family drifting by two magnitudes and is undone; a group with one component above the
broken stick is split by the exact 1-D 2-means (``one_component``); a clustered split is
refined over the full displacements (``cosine_refinement``, :func:`cosine_refine`), which
puts back clients that a few noisy components placed on the wrong side; and a group is
split again without its outlying clients (``refit_without_outliers``: a client carrying a
principal component, or left alone by k-means), so one client cannot take a component.

Groups are processed in the order positive, negative, undirected, no_shift; the returned
local cohort ids are contiguous from 0 in order of first appearance over ``client_ids``.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from clma.cohort.clustering import AutoKMeans, Clusterer
from clma.cohort.ks import (
    KSComponents,
    SortedReference,
    ks_components_from_sorted,
    ks_critical_value,
)
from clma.cohort.projection import (
    DEFAULT_BLOCK_BYTES,
    centered_subgram,
    displacement_gram,
    gram_matrix,
    gram_pca_details,
    gram_pca_from_gram,
)
from clma.cohort.split import cluster_index, leading_split_test
from clma.params.errors import NonFiniteParameterError, ParameterAlignmentError

__all__ = [
    "DIRECTIONS",
    "CLMACohorter",
    "CohortAssignment",
    "Cohorter",
    "GroupDiagnostics",
    "validate_client_stack",
]

ClientId = Hashable
DirectionRule = Literal["auto", "established", "sign", "none"]
DIRECTIONS = ("positive", "negative", "undirected", "no_shift")
DEFAULT_SPREAD_FLOOR = 1e-5


@dataclass(frozen=True)
class GroupDiagnostics:
    """What happened inside one direction group.

    ``direction`` one of :data:`DIRECTIONS`; ``members`` client ids in input order;
    ``cohort_ids`` the local cohort id of each member; ``n_components`` and
    ``retained_variance`` of the Gram PCA (0 when not projected); ``k`` clusters found;
    ``silhouettes`` k -> score for the k tried; ``reason`` how k was chosen.
    """

    direction: str
    members: tuple[ClientId, ...]
    cohort_ids: tuple[int, ...]
    n_components: int
    retained_variance: float
    k: int
    silhouettes: dict[int, float] = field(default_factory=dict)
    reason: str = ""


@dataclass(frozen=True)
class CohortAssignment:
    """Result of one cohorting call.

    Attributes
    ----------
    assignments:
        client id -> local cohort id (ints contiguous from 0, in order of first appearance).
    ks_statistics:
        client id -> signed KS statistic against the reference (see
        :func:`clma.cohort.signed_ks_statistic`).
    directions:
        client id -> "positive" | "negative" | "undirected" | "no_shift".
    d_plus, d_minus:
        client id -> one-sided KS distances.
    direction_threshold:
        The ``|D+ - D-|`` critical value used ("established" rule), else None.
    groups:
        Per direction group diagnostics (:class:`GroupDiagnostics`).
    """

    assignments: dict[ClientId, int]
    ks_statistics: dict[ClientId, float]
    directions: dict[ClientId, str] = field(default_factory=dict)
    d_plus: dict[ClientId, float] = field(default_factory=dict)
    d_minus: dict[ClientId, float] = field(default_factory=dict)
    direction_threshold: float | None = None
    groups: tuple[GroupDiagnostics, ...] = ()

    @property
    def n_cohorts(self) -> int:
        """Number of distinct local cohort ids."""
        return len(set(self.assignments.values()))

    def members(self, cohort_id: int) -> list[ClientId]:
        """Client ids assigned to local cohort ``cohort_id`` (input order)."""
        return [c for c, g in self.assignments.items() if g == cohort_id]

    def groups_by_cohort(self) -> dict[int, list[ClientId]]:
        """local cohort id -> member client ids (the shape ``CohortRegistry.split`` takes)."""
        out: dict[int, list[ClientId]] = {}
        for c, g in self.assignments.items():
            out.setdefault(g, []).append(c)
        return out

    def labels(self, client_ids: Sequence[ClientId]) -> np.ndarray:
        """Cohort ids as an int64 array in the order of ``client_ids``."""
        return np.array([self.assignments[c] for c in client_ids], dtype=np.int64)


class Cohorter(ABC):
    """Extension point: group quarantined clients into cohorts.

    ``cohort(client_ids, matrix, reference)`` takes ``n`` client ids, their parameter stack
    ``(n, n_params)`` (float32) and the reference vector ``(n_params,)`` and returns a
    :class:`CohortAssignment`.
    """

    @abstractmethod
    def cohort(self, client_ids: Sequence[ClientId], matrix: np.ndarray,
               reference: np.ndarray) -> CohortAssignment:
        """Assign each client a local cohort id."""


def validate_client_stack(client_ids: Sequence[ClientId], matrix: object,
                          reference: object) -> tuple[list[ClientId], np.ndarray, np.ndarray]:
    """Check a cohorting input and return ``(ids, matrix, reference)`` without copying arrays.

    ``matrix`` may be a 2-D array ``(n_clients, n_params)`` (used as is) or a sequence of
    1-D vectors (stacked once into float32). Errors (:class:`ParameterAlignmentError`,
    :class:`NonFiniteParameterError`, both ``ValueError``) name the field and, for a bad
    row, the client; values are never echoed.
    """
    if isinstance(client_ids, (str, bytes)) or not isinstance(client_ids, Sequence):
        raise TypeError("client_ids: must be a sequence of client ids")
    ids = list(client_ids)
    if len(set(ids)) != len(ids):
        raise ParameterAlignmentError("client_ids: must be unique")
    ref = np.asarray(reference)
    if ref.ndim != 1 or ref.dtype.kind not in "fiu":
        raise ParameterAlignmentError(
            f"reference: must be a 1-D real vector (n_params,), got shape {ref.shape}")
    if ref.dtype.kind == "f" and not np.isfinite(ref).all():
        raise NonFiniteParameterError("reference: must be finite (NaN or inf found)")
    if isinstance(matrix, np.ndarray):
        mat = matrix
    else:
        rows = list(matrix)  # type: ignore[call-overload]
        if len(rows) != len(ids):
            raise ParameterAlignmentError(
                f"matrix: has {len(rows)} rows but client_ids has {len(ids)} entries")
        for cid, row in zip(ids, rows, strict=True):
            r = np.asarray(row)
            if r.ndim != 1 or r.shape[0] != ref.shape[0]:
                raise ParameterAlignmentError(
                    f"matrix: vector of client {cid!r} has shape {r.shape}, expected "
                    f"({ref.shape[0]},) like the reference")
        mat = np.empty((len(rows), ref.shape[0]), dtype=np.float32)
        for i, row in enumerate(rows):
            mat[i] = row
    if mat.ndim != 2 or mat.dtype.kind not in "fiu":
        raise ParameterAlignmentError(
            f"matrix: must be a 2-D real array (n_clients, n_params), got shape {mat.shape}")
    if mat.shape[0] != len(ids):
        raise ParameterAlignmentError(
            f"matrix: has {mat.shape[0]} rows but client_ids has {len(ids)} entries")
    if mat.shape[1] != ref.shape[0]:
        raise ParameterAlignmentError(
            f"matrix: rows have {mat.shape[1]} parameters but reference has {ref.shape[0]}")
    if mat.shape[1] == 0:
        raise ParameterAlignmentError("reference: must hold at least one parameter")
    if mat.dtype.kind == "f":
        for i, cid in enumerate(ids):
            if not np.isfinite(mat[i]).all():
                raise NonFiniteParameterError(
                    f"matrix: parameters of client {cid!r} contain NaN or inf")
    return ids, mat, ref


#: The cosine refinement runs only when every part's coherence (mean displacement cosine
#: between its clients) is positive and at least this fraction of the largest: spherical
#: k-means assumes parts of equal concentration and pulls the clients of a diffuse part
#: (clients without a common drift, e.g. false flags) into a coherent one.
REFINE_COHERENCE_RATIO = 0.5


def _cosines(gram: np.ndarray) -> np.ndarray:
    """``(n, n)`` float64 cosines of the vectors whose Gram is ``gram`` (0 for a zero one)."""
    g = np.asarray(gram, dtype=np.float64)
    norms = np.sqrt(np.clip(np.diag(g), 0.0, None))
    safe = np.where(norms > 0.0, norms, 1.0)
    cos = g / np.outer(safe, safe)
    cos[norms == 0.0, :] = 0.0
    cos[:, norms == 0.0] = 0.0
    return cos


def group_coherences(gram: np.ndarray, labels: np.ndarray) -> list[float]:
    """Mean displacement cosine over pairs of distinct clients of each group (in order of
    the group labels; 0.0 for a group of one). ``gram`` ``(n, n)`` displacement Gram,
    ``labels`` ``(n,)`` int."""
    cos = _cosines(gram)
    out = []
    for k in np.unique(labels):
        m = np.flatnonzero(np.asarray(labels) == k)
        if len(m) < 2:
            out.append(0.0)
            continue
        block = cos[np.ix_(m, m)]
        out.append(float((block.sum() - np.trace(block)) / (len(m) * (len(m) - 1))))
    return out


def cosine_refine(gram: np.ndarray, labels: np.ndarray, max_iter: int = 10
                  ) -> tuple[np.ndarray, int]:
    """Reassign each client to the group whose mean displacement is closest in angle.

    The split of a group is made on a few principal components (k-means or the leading
    split); a client whose own sampling noise dominates those components can land on the
    wrong side although its whole displacement points to its family. This step re-reads
    the full displacements: client ``i`` goes to the group ``g`` maximising

        cos(d_i, sum_{j in g, j != i} d_j)
          = (sum_{j in g, j != i} G_ij) / sqrt(G_ii * sum_{j, l in g; j, l != i} G_jl),

    (leave-one-out: a client's own displacement is not in the centroid it is compared
    with), all clients at once, repeated until no client moves (at most ``max_iter``
    passes): spherical k-means (Dhillon and Modha, Machine Learning 42, 2001) started
    from the split, in the full parameter space through the Gram matrix. A documented
    departure from CLMA (docs/realistic_drift.md section 8). Its bias: a client's cosine
    to a family's centroid grows with the family's coherence, so between a coherent and a
    diffuse family it leans towards the coherent one (hence the cohorter's guard,
    :data:`REFINE_COHERENCE_RATIO`, and no refinement of leading splits).

    Args:
        gram: ``(n, n)`` float displacement Gram ``G = D D^T`` of the group's clients.
        labels: ``(n,)`` int group of each client.
        max_iter: passes at most (>= 1).

    Returns:
        ``(labels, moved)``: the refined ``(n,)`` int64 labels, contiguous from 0 in order
        of first appearance, and the number of clients whose group changed. A client with
        a zero displacement, and every client when a pass would leave one group, keep their
        group.
    """
    g = np.asarray(gram, dtype=np.float64)
    start = np.asarray(labels, dtype=np.int64)
    lab = start.copy()
    diag = np.clip(np.diag(g), 0.0, None)
    for _ in range(int(max_iter)):
        ks = np.unique(lab)
        score = np.full((len(lab), len(ks)), -np.inf)
        for j, k in enumerate(ks):
            m = lab == k
            s_all = g[:, m].sum(axis=1)
            t_all = float(g[np.ix_(m, m)].sum())
            s = np.where(m, s_all - diag, s_all)
            t = np.where(m, t_all - 2.0 * s_all + diag, t_all)
            ok = (t > 0.0) & (diag > 0.0)
            score[ok, j] = s[ok] / np.sqrt(diag[ok] * t[ok])
        best = ks[np.argmax(score, axis=1)]
        new = np.where(np.isfinite(score.max(axis=1)) & (diag > 0.0), best, lab)
        if len(np.unique(new)) < 2 or (new == lab).all():
            break
        lab = new
    return _in_order_of_appearance(lab), int((lab != start).sum())


def _in_order_of_appearance(labels: np.ndarray) -> np.ndarray:
    """``(n,)`` int64 labels renumbered 0, 1, ... in order of first appearance."""
    _, first = np.unique(labels, return_index=True)
    order = {int(k): i for i, k in enumerate(labels[np.sort(first)])}
    return np.array([order[int(k)] for k in labels], dtype=np.int64)


def _family_ratio(disp: np.ndarray, rows: list[int], labels: np.ndarray) -> float:
    """Mean displacement cosine across the two sides of a split over the pooled mean within
    them (pairs of distinct clients); ``disp`` the ``(n, n)`` displacement Gram, ``rows`` the
    group's rows, ``labels`` ``(len(rows),)`` 0/1. ``-inf`` when a side has no within pair
    on either side or the across mean is not positive (two families either way)."""
    idx = np.asarray(rows)
    cos = _cosines(disp[np.ix_(idx, idx)])
    a, b = np.flatnonzero(labels == 0), np.flatnonzero(labels == 1)
    across = float(cos[np.ix_(a, b)].mean())
    pairs = len(a) * (len(a) - 1) + len(b) * (len(b) - 1)
    if pairs == 0 or across <= 0.0:
        return float("-inf")
    within = (float(cos[np.ix_(a, a)].sum() - np.trace(cos[np.ix_(a, a)]))
              + float(cos[np.ix_(b, b)].sum() - np.trace(cos[np.ix_(b, b)]))) / pairs
    return across / within if within > 0.0 else float("inf")


def _ratio_note(ratio: float | None) -> str:
    """The family test's figure for a split that was kept, as the diagnostics print it."""
    if ratio is None:
        return ""
    if ratio == float("-inf"):
        return "; across displacement cosine <= 0: the sides drift apart"
    return f"; across/within displacement cosine {ratio:.2f}"


def _below_floor(disp: np.ndarray, rows: list[int], ref_sq: float, floor: float) -> bool:
    """Whether the group's RMS spread about its mean is at most ``floor`` times the
    vectors' scale ``sqrt(||r||^2 + max ||x_i - r||^2)`` (``CLMACohorter.spread_floor``)."""
    centered = centered_subgram(disp, rows)
    spread_sq = max(float(np.trace(centered)), 0.0) / len(rows)
    scale_sq = ref_sq + float(np.max(np.diag(disp)[rows]))
    return spread_sq <= (floor * floor) * scale_sq


#: A variance threshold that keeps exactly the leading component (gram_pca_from_gram).
_ONE_COMPONENT = 1e-12

#: A client whose squared score is more than this share of a retained component's sum of
#: squares carries that component: it is the client's own direction, not a family's (the
#: outlier refit). Measured on label2 (docs/realistic_drift.md section 8): components of
#: one outlying client 0.82-0.95, components that separate two families at most 0.24.
CARRIER_SHARE = 0.5

#: An outlier set aside by the refit joins the closest part only when its cosine with that
#: part is at least this multiple of its cosine with the next one; otherwise its update
#: does not say which family it belongs to and it keeps a part of its own (label2, alpha
#: 0.3, seed 11, round 4: 0.142 against 0.123, and it belonged to the second).
JOIN_MARGIN = 2.0


class CLMACohorter(Cohorter):
    """CLMA Algorithm 3: signed KS direction groups, Gram-trick PCA, clustering.

    Parameters
    ----------
    clusterer:
        :class:`Clusterer` applied to each direction group's PCA scores (default
        ``AutoKMeans()``: k by silhouette, 0.25 floor).
    variance_threshold:
        Fraction of variance the retained components must exceed, in (0, 1].
    center:
        Mean-center each group before PCA (default True; False is the published form).
    min_ks_magnitude:
        Clients with ``|signed KS| < min_ks_magnitude`` form one "no_shift" cohort.
    spread_floor:
        Variance floor relative to the vectors' scale, in [0, 1) (see the module docs): a
        direction group whose RMS spread about its mean is at most ``spread_floor`` times
        ``sqrt(||r||^2 + max ||x_i - r||^2)`` is one cohort (reason "spread below the
        floor"), so floating-point noise never splits identically drifted clients. "auto"
        (default): 1e-5 when centering, ``None`` (no floor: the published form) otherwise.
    components:
        How many principal components each direction group keeps. "variance" (default,
        the published rule): the fewest reaching ``variance_threshold``. "broken_stick": the
        leading components whose share of variance exceeds the broken-stick expectation
        (:func:`clma.cohort.projection.broken_stick_components`); a group with none is one
        cohort (reason "no component above the broken stick"), unless
        ``leading_split_alpha`` splits it. A documented departure (module docs,
        "Label-skewed clients").
    leading_split_alpha:
        ``None`` (default: off). With ``components="broken_stick"``, a group with no
        component above the broken stick is split in two along its leading principal
        component when :func:`clma.cohort.split.leading_split_test` (exact 1-D 2-means
        cluster index against its null under isotropic noise, after SigClust) gives a
        p-value at most this level, in (0, 1); reason "leading component split". Why: a
        covariate-drift family split lives in one component whose variance share stays
        below the broken stick (:mod:`clma.cohort.split`; docs/realistic_drift.md sec. 6).
    leading_split_min_size:
        Smallest group of such a split (default 5), an integer >= 1. A group of ``n``
        clients is tested with ``min(leading_split_min_size, max(2, n // 2))``: below
        ``2 * leading_split_min_size`` clients a fixed minimum would make every split
        impossible (two families of two drifted sites in a six-site federation were one
        cohort), and a lone client is still never split off (groups of 2-3 are not split).
    leading_split_family_ratio:
        ``None`` (default: off) or a level in (0, 1]. A significant leading split is undone
        (one group; reason "leading component split undone: one family") when the mean
        displacement cosine across its two sides is at least this fraction of the pooled
        mean within them: the leading split test's null (isotropic noise) cannot tell two
        magnitudes of one drift (ratio near or above 1) from two drifts (measured: two
        covariate families 0.43-0.53, two label families ~0.1; one family's parts
        0.84-0.88; docs/realistic_drift.md section 8). The ratio is reported in the reason.
    cosine_refinement:
        False (default). When True, a split made by the clusterer (k-means) or by
        ``one_component="two_means"`` (both on components above the broken stick or the
        variance share) is refined by :func:`cosine_refine` over the full displacements
        (reason "...; cosine refinement moved m") when the parts' coherences are comparable
        (:data:`REFINE_COHERENCE_RATIO`; else "...; not refined (coherences ...)").
        Leading splits (a direction below the broken stick) are not refined: the
        refinement leans towards the more coherent family, which moved clients of two
        covariate families to the wrong side.
    one_component:
        "clusterer" (default): a group with exactly one component above the broken stick is
        clustered by ``clusterer`` on that component. "two_means": it is split in two along
        it by the exact 1-D 2-means (:func:`clma.cohort.split.cluster_index`, the leading
        split's groups of at least ``max(2, min(leading_split_min_size, n // 2))``; no test:
        the component is above the broken stick), undone as a leading split is by
        ``leading_split_family_ratio`` (reason "one component above the broken stick: 2-means
        split"), then refined by ``cosine_refinement``. Why: k-means' silhouette over
        k = 2..10 on one dimension split two families of 15 into 5 groups
        (docs/realistic_drift.md section 8). "tested_two_means": as "two_means", only if
        the 2-means split is significant by the leading split's test
        (:func:`clma.cohort.split.leading_split_test` at ``leading_split_alpha``; else one
        group, reason "... not significant"): a component above the broken stick carries
        more variance than its share, which one family's spread of drift magnitudes can do
        too (one family of 15 split 4 / 11 at cluster index 0.46, p 0.94:
        docs/realistic_drift.md section 8).
    refit_without_outliers:
        False (default). When True, the outliers of a group are set aside: with
        ``components="broken_stick"``, a client whose squared score is more than
        :data:`CARRIER_SHARE` of a retained component's sum of squares (it carries that
        component), and a client that a split by the clusterer or the one-component
        2-means left alone in a part. If there are any, and at least 4 other clients, the
        group without them is split again by the same procedure (refinement included, no
        second refit), then each outlier joins the new part whose summed displacement has
        the largest positive cosine with its own, if that cosine is at least
        :data:`JOIN_MARGIN` times the next part's, or else stays a part of its own (its
        update does not tell the families apart; reason "...; refit without m
        outlier(s) (a client carrying a component or a part of one client in: <first
        split>), j joined the closest part"). Why
        (label2, docs/realistic_drift.md section 8): at alpha 0.3, seed 11, round 4, one
        client's displacement (2.9 times the median) carried 0.95 of the leading
        component, and k-means split 28 + 1 with both families in the 28 (ARI -0.00);
        without it the 28 split exactly. At round 7 (seeds 10 and 11) one family drifting
        again was cut in two along a component one client carried (0.82, 0.87).
    direction_rule:
        "sign": trust the KS sign always (published). "established": trust it only when
        ``|D+ - D-| > ks_critical_value(direction_alpha, n_params, n_params)``, otherwise the
        client is "undirected". "none": no sign is trusted, every client (above
        ``min_ks_magnitude``) is "undirected", so one Gram PCA sees all of them (used with
        ``components="broken_stick"`` under label-skewed clients, where the KS sign follows
        the client's label mix more than its drift: module docs). "auto" (default):
        "established" if ``center`` else "sign".
    direction_alpha:
        Significance level of the "established" rule, in (0, 1) (default 0.05).
    n_jobs:
        Threads for the per-client KS step (numpy releases the GIL in sort/searchsorted);
        default ``min(2, os.cpu_count())``.
    block_bytes:
        Bound on the float64 column block used to accumulate Gram matrices.
    reconcile_similarity:
        Relative similarity in (0, 1] at which two groups that ended up in *different*
        direction groups are merged; ``None`` disables it. "auto" (default): 0.5 under the
        "established" direction rule, ``None`` under "sign" (the published form). Rule: with
        ``cos`` the cosine similarity of two clients' displacements from the reference,
        groups g and h merge when ``mean cos(g x h) > 0`` and
        ``mean cos(g x h) >= reconcile_similarity * mean cos(within g and within h)``
        (pairs of distinct clients; two singletons compare ``cos`` with the threshold
        itself). Why: the per-client direction test is a hard threshold, so one
        identically drifted family whose clients sit near it splits into a directed and an
        undirected part (seen on the digits: a family of 5 split 1+4, and a client of a
        family of 15 split off alone). Across such parts the pair cosines are as high as
        within them (ratio ~1), while opposite shifts (negative), independent zero-mean
        families and different concepts (~0 on the digits) stay apart. The rule is relative
        because the typical within-family cosine depends on the clients' own noise (0.4 with
        18 samples per client, 0.7 with 54 on the digits), so no absolute cosine fits all.
        Only groups from different direction groups are compared, so the silhouette decision
        inside a direction group stands; "no_shift" never merges. The cosines come from the
        ``(n, n)`` displacement Gram matrix
        (:func:`clma.cohort.projection.displacement_gram`): no ``(n, n_params)`` copy.

    Memory: the stack is used in place (float32, no copy); the reference is sorted once per
    :meth:`cohort` call; per client one sorted copy plus O(n_params) int64/float64
    temporaries per thread; per group one Gram matrix and one float64 column block.
    """

    def __init__(self, clusterer: Clusterer = AutoKMeans(),  # noqa: B008 (stateless)
                 variance_threshold: float = 0.95, center: bool = True,
                 min_ks_magnitude: float = 0.0, *, direction_rule: DirectionRule = "auto",
                 direction_alpha: float = 0.05, n_jobs: int | None = None,
                 block_bytes: int = DEFAULT_BLOCK_BYTES,
                 reconcile_similarity: float | None | Literal["auto"] = "auto",
                 spread_floor: float | None | Literal["auto"] = "auto",
                 components: Literal["variance", "broken_stick"] = "variance",
                 leading_split_alpha: float | None = None,
                 leading_split_min_size: int = 5,
                 leading_split_family_ratio: float | None = None,
                 cosine_refinement: bool = False,
                 one_component: Literal["clusterer", "two_means",
                                        "tested_two_means"] = "clusterer",
                 refit_without_outliers: bool = False) -> None:
        if not isinstance(clusterer, Clusterer):
            raise TypeError("clusterer: must be a clma.cohort.Clusterer")
        v = float(variance_threshold)
        if not (0.0 < v <= 1.0):
            raise ValueError("variance_threshold: must lie in (0, 1]")
        m = float(min_ks_magnitude)
        if not (0.0 <= m <= 1.0):
            raise ValueError("min_ks_magnitude: must lie in [0, 1]")
        if direction_rule not in ("auto", "established", "sign", "none"):
            raise ValueError("direction_rule: must be 'auto', 'established', 'sign' or 'none'")
        if not (0.0 < float(direction_alpha) < 1.0):
            raise ValueError("direction_alpha: must lie in (0, 1)")
        if n_jobs is not None and (int(n_jobs) != n_jobs or n_jobs < 1):
            raise ValueError("n_jobs: must be None or an integer >= 1")
        if reconcile_similarity != "auto" and reconcile_similarity is not None:
            try:
                rs = float(reconcile_similarity)
            except (TypeError, ValueError):
                rs = float("nan")
            if not (0.0 < rs <= 1.0) or not np.isfinite(rs):
                raise ValueError("reconcile_similarity: must be 'auto', None or lie in (0, 1]")
            reconcile_similarity = rs
        if spread_floor != "auto" and spread_floor is not None:
            try:
                sf = float(spread_floor)
            except (TypeError, ValueError):
                sf = float("nan")
            if not (0.0 <= sf < 1.0):
                raise ValueError("spread_floor: must be 'auto', None or lie in [0, 1)")
            spread_floor = sf
        if components not in ("variance", "broken_stick"):
            raise ValueError("components: must be 'variance' or 'broken_stick'")
        if leading_split_alpha is not None and not (0.0 < float(leading_split_alpha) < 1.0):
            raise ValueError("leading_split_alpha: must be None or lie in (0, 1)")
        if int(leading_split_min_size) != leading_split_min_size or leading_split_min_size < 1:
            raise ValueError("leading_split_min_size: must be an integer >= 1")
        if leading_split_family_ratio is not None:
            fr = float(leading_split_family_ratio)
            if not (0.0 < fr <= 1.0) or not np.isfinite(fr):
                raise ValueError("leading_split_family_ratio: must be None or lie in (0, 1]")
            leading_split_family_ratio = fr
        self.leading_split_family_ratio = leading_split_family_ratio
        self.cosine_refinement = bool(cosine_refinement)
        self.refit_without_outliers = bool(refit_without_outliers)
        if one_component not in ("clusterer", "two_means", "tested_two_means"):
            raise ValueError("one_component: must be 'clusterer', 'two_means' or "
                             "'tested_two_means'")
        self.one_component = one_component
        self.components = components
        self.leading_split_alpha = (None if leading_split_alpha is None
                                    else float(leading_split_alpha))
        self.leading_split_min_size = int(leading_split_min_size)
        self.spread_floor = spread_floor
        self.reconcile_similarity = reconcile_similarity
        self.clusterer = clusterer
        self.variance_threshold = v
        self.center = bool(center)
        self.min_ks_magnitude = m
        self.direction_rule = direction_rule
        self.direction_alpha = float(direction_alpha)
        self.n_jobs = n_jobs
        self.block_bytes = int(block_bytes)

    @property
    def effective_reconcile_similarity(self) -> float | None:
        """The reconciliation threshold in force ("auto": 0.5 if "established", else None)."""
        if self.reconcile_similarity == "auto":
            return 0.5 if self.effective_direction_rule == "established" else None
        return self.reconcile_similarity

    @property
    def effective_spread_floor(self) -> float | None:
        """The variance floor in force ("auto": 1e-5 when centering, else None)."""
        if self.spread_floor == "auto":
            return DEFAULT_SPREAD_FLOOR if self.center else None
        return self.spread_floor

    @property
    def effective_direction_rule(self) -> Literal["established", "sign", "none"]:
        """The rule in force: "auto" resolves to "established" if centering, else "sign"."""
        if self.direction_rule == "auto":
            return "established" if self.center else "sign"
        return self.direction_rule

    def __repr__(self) -> str:
        return (f"CLMACohorter(clusterer={self.clusterer!r}, "
                f"variance_threshold={self.variance_threshold}, center={self.center}, "
                f"min_ks_magnitude={self.min_ks_magnitude}, "
                f"direction_rule={self.direction_rule!r}, direction_alpha={self.direction_alpha}, "
                f"reconcile_similarity={self.reconcile_similarity!r}, "
                f"spread_floor={self.spread_floor!r}, components={self.components!r}, "
                f"leading_split_alpha={self.leading_split_alpha!r}, "
                f"leading_split_min_size={self.leading_split_min_size}, "
                f"leading_split_family_ratio={self.leading_split_family_ratio!r}, "
                f"cosine_refinement={self.cosine_refinement}, "
                f"one_component={self.one_component!r}, "
                f"refit_without_outliers={self.refit_without_outliers})")

    def ks_components(self, matrix: np.ndarray, reference: np.ndarray) -> list[KSComponents]:
        """One-sided KS distances of every row against the reference (sorted once)."""
        sorted_ref = SortedReference(reference)
        n_jobs = self.n_jobs or min(2, os.cpu_count() or 1)

        def one(i: int) -> KSComponents:
            return ks_components_from_sorted(matrix[i], sorted_ref, field=f"matrix[{i}]")

        if n_jobs == 1 or matrix.shape[0] < 2:
            return [one(i) for i in range(matrix.shape[0])]
        with ThreadPoolExecutor(max_workers=n_jobs) as pool:
            return list(pool.map(one, range(matrix.shape[0])))

    def _split_min_size(self, n: int) -> int:
        """The leading split's smallest group for a group of ``n`` clients (parameter docs)."""
        return min(self.leading_split_min_size, max(2, n // 2))

    def _direction(self, comp: KSComponents, threshold: float | None) -> str:
        if abs(comp.signed) < self.min_ks_magnitude:
            return "no_shift"
        if self.effective_direction_rule == "none":
            return "undirected"
        if threshold is not None and not comp.direction_gap > threshold:
            return "undirected"
        return "positive" if comp.sign > 0 else "negative"

    def _reconcile(self, mat: np.ndarray, ref: np.ndarray, keys: list[tuple[str, int]],
                   disp: np.ndarray | None = None) -> dict[tuple[str, int], tuple[str, int]]:
        """Map each (direction, group) key to the key of the merged group it joins.

        Union-find over pairs of groups from different direction groups (never "no_shift")
        whose across-group displacement cosines reach the threshold relative to their
        within-group cosines (see ``reconcile_similarity``).
        """
        thr = self.effective_reconcile_similarity
        groups = sorted({k for k in keys if k[0] != "no_shift"})
        if thr is None or len({d for d, _ in groups}) < 2:
            return {}
        gram = disp if disp is not None else displacement_gram(mat, ref,
                                                               block_bytes=self.block_bytes)
        cos = _cosines(gram)
        members = {g: [r for r, k in enumerate(keys) if k == g] for g in groups}

        def within_pairs(rows: list[int]) -> tuple[float, int]:
            m = len(rows)
            if m < 2:
                return 0.0, 0
            block = cos[np.ix_(rows, rows)]
            return float(block.sum() - np.trace(block)), m * (m - 1)

        parent = list(range(len(groups)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for i in range(len(groups)):
            for j in range(i + 1, len(groups)):
                if groups[i][0] == groups[j][0]:
                    continue
                a, b = members[groups[i]], members[groups[j]]
                across = float(cos[np.ix_(a, b)].mean())
                sa, na = within_pairs(a)
                sb, nb = within_pairs(b)
                within = (sa + sb) / (na + nb) if na + nb else 1.0
                if across > 0.0 and across >= thr * within:
                    parent[find(j)] = find(i)
        return {g: groups[find(i)] for i, g in enumerate(groups) if find(i) != i}

    def _split_group(self, direction: str, rows: list[int], mat: np.ndarray,
                     disp: np.ndarray | None, ref_sq: float
                     ) -> tuple[np.ndarray, tuple, bool, list[int]]:
        """Split one direction group: ``(labels, diagnostics, clustered, carriers)``, the
        ``(m,)`` int64 part of each of ``rows``, the :class:`GroupDiagnostics` fields,
        whether the split was made by the clusterer or the one-component 2-means (the
        inputs of the refinement and the outlier refit), and the positions in ``rows`` of
        the clients that carry a component above the broken stick
        (:data:`CARRIER_SHARE`)."""
        floor = self.effective_spread_floor
        clustered = False  # split by the clusterer (the cosine refinement's input)
        carriers: list[int] = []
        if direction == "no_shift" or len(rows) == 1:
            sub = np.zeros(len(rows), dtype=np.int64)
            diag = (direction, rows, 0, 0.0, 1, {},
                    "pooled" if direction == "no_shift" else "single client")
        elif floor is not None and disp is not None and _below_floor(
                disp, rows, ref_sq, floor):
            sub = np.zeros(len(rows), dtype=np.int64)
            diag = (direction, rows, 0, 0.0, 1, {},
                    "spread below the floor (floating-point noise)")
        else:
            gram = None
            if disp is not None and self.center:  # centered Gram from the one pass
                gram = centered_subgram(disp, rows)
            elif self.components == "broken_stick":
                gram = gram_matrix(mat, np.asarray(rows), center=self.center,
                                   block_bytes=self.block_bytes)
            if gram is not None:
                pca = gram_pca_from_gram(gram, self.variance_threshold, self.components)
            else:
                pca = gram_pca_details(mat, self.variance_threshold, self.center,
                                       rows=np.asarray(rows), block_bytes=self.block_bytes)
            if self.components == "broken_stick":
                for c in range(pca.n_components):
                    sq = pca.scores[:, c] ** 2
                    top = int(np.argmax(sq))
                    if sq[top] > CARRIER_SHARE * sq.sum() and top not in carriers:
                        carriers.append(top)
            split = None
            if (self.components == "broken_stick" and pca.n_components == 0
                    and self.leading_split_alpha is not None and gram is not None):
                lead = gram_pca_from_gram(gram, _ONE_COMPONENT, "variance")
                if lead.n_components:
                    split = leading_split_test(lead.scores[:, 0], self.leading_split_alpha,
                                               self._split_min_size(len(rows)))
            one = (self.components == "broken_stick" and pca.n_components == 1
                   and self.one_component in ("two_means", "tested_two_means")
                   and len(rows) >= 2 * self._split_min_size(len(rows)))
            one_test = None
            if one and (self.one_component == "tested_two_means"
                        and self.leading_split_alpha is not None):
                # the test's own 2-means split (the same exact 1-D 2-means), not a second one
                one_test = leading_split_test(pca.scores[:, 0], self.leading_split_alpha,
                                              self._split_min_size(len(rows)))
                ci, two = one_test.cluster_index, one_test.labels
            elif one:
                ci, two = cluster_index(pca.scores[:, 0], self._split_min_size(len(rows)))
            ratio = None
            if (split is not None and split.significant and disp is not None
                    and self.leading_split_family_ratio is not None):
                ratio = _family_ratio(disp, rows, split.labels)
            test = (f"2-means cluster index {split.cluster_index:.3f}, "
                    f"p = {split.p_value:.4f}" if split is not None else "")
            if one:
                ratio = (_family_ratio(disp, rows, two) if disp is not None
                         and self.leading_split_family_ratio is not None else None)
                what = (f"one component above the broken stick: 2-means split (cluster "
                        f"index {ci:.3f}")
                if one_test is not None and not one_test.significant:
                    sub = np.zeros(len(rows), dtype=np.int64)
                    diag = (direction, rows, 1, pca.retained_variance, 1, {},
                            f"{what}, p = {one_test.p_value:.4f}) not significant")
                elif ratio is not None and ratio >= self.leading_split_family_ratio:
                    sub = np.zeros(len(rows), dtype=np.int64)
                    diag = (direction, rows, 1, pca.retained_variance, 1, {},
                            f"{what}) undone: one family (across/within "
                            f"displacement cosine {ratio:.2f} >= "
                            f"{self.leading_split_family_ratio:.2f})")
                else:
                    sub = two
                    clustered = True  # a split on a component above the broken stick
                    diag = (direction, rows, 1, pca.retained_variance, 2, {},
                            what + _ratio_note(ratio) + ")")
            elif ratio is not None and ratio >= self.leading_split_family_ratio:
                sub = np.zeros(len(rows), dtype=np.int64)
                diag = (direction, rows, 0, 0.0, 1, {},
                        f"leading component split undone: one family ({test}; "
                        f"across/within displacement cosine {ratio:.2f} >= "
                        f"{self.leading_split_family_ratio:.2f})")
            elif split is not None and split.significant:
                sub = split.labels
                diag = (direction, rows, 1, float(lead.explained_variance_ratio[0]),
                        2, {}, f"leading component split ({test}"
                        + _ratio_note(ratio) + ")")
            elif self.components == "broken_stick" and pca.n_components == 0:
                sub = np.zeros(len(rows), dtype=np.int64)
                diag = (direction, rows, 0, 0.0, 1, {},
                        "no component above the broken stick"
                        + ("" if split is None else
                           f"; leading split not significant (p = "
                           f"{split.p_value:.4f})"))
            else:
                res = self.clusterer.fit_predict_details(pca.scores)
                sub = res.labels
                clustered = True
                diag = (direction, rows, pca.n_components,
                        pca.retained_variance, res.k, dict(res.silhouettes),
                        res.reason)
        if (self.cosine_refinement and clustered and disp is not None
                and len(set(sub.tolist())) > 1):
            block = disp[np.ix_(rows, rows)]
            rho = group_coherences(block, sub)
            comparable = (min(rho) > 0.0
                          and min(rho) >= REFINE_COHERENCE_RATIO * max(rho))
            refined, moved = cosine_refine(block, sub) if comparable else (sub, 0)
            if not comparable:
                d, rw, nc, rv, k, sil, reason = diag
                diag = (d, rw, nc, rv, k, sil,
                        f"{reason}; not refined (coherences "
                        f"{', '.join(f'{x:.2f}' for x in rho)})")
            elif moved:
                sub = refined
                d, rw, nc, rv, k, sil, reason = diag
                diag = (d, rw, nc, rv, int(len(set(sub.tolist()))), sil,
                        f"{reason}; cosine refinement moved {moved}")
        return sub, diag, clustered, carriers

    def _refit_without_outliers(self, direction: str, rows: list[int], mat: np.ndarray,
                                disp: np.ndarray, ref_sq: float, sub: np.ndarray,
                                diag: tuple, clustered: bool, carriers: list[int]
                                ) -> tuple[np.ndarray, tuple]:
        """The outlier refit (``refit_without_outliers``): the clients that carry a
        component above the broken stick, or that a clustered split left in parts of one,
        are set aside; the group is split again without them, then each of them joins the
        new part whose summed displacement is closest in angle by :data:`JOIN_MARGIN`, or
        keeps a part of its own (the class's parameter docs)."""
        sizes = np.bincount(sub)
        alone = ({i for i in range(len(rows)) if sizes[sub[i]] == 1}
                 if clustered and len(sizes) > 1 else set())
        lone = sorted(set(carriers) | alone)
        kept = [i for i in range(len(rows)) if i not in alone and i not in carriers]
        if not lone or len(kept) < 4:
            return sub, diag
        kept_rows = [rows[i] for i in kept]
        sub2, diag2, _, _ = self._split_group(direction, kept_rows, mat, disp, ref_sq)
        labels = np.empty(len(rows), dtype=np.int64)
        labels[kept] = sub2
        parts = {int(k): [kept_rows[j] for j in np.flatnonzero(sub2 == k)]
                 for k in np.unique(sub2)}
        fresh = int(sub2.max()) + 1
        joined = 0
        for i in lone:
            r = rows[i]
            d = float(disp[r, r])
            cos = {}
            for k, m in parts.items():
                t = float(disp[np.ix_(m, m)].sum())
                if t > 0.0 and d > 0.0:
                    cos[k] = float(disp[r, m].sum()) / np.sqrt(d * t)
            ranked = sorted(cos.items(), key=lambda kv: -kv[1])
            best = None
            if ranked and ranked[0][1] > 0.0 and (
                    len(ranked) == 1 or ranked[0][1] >= JOIN_MARGIN * max(ranked[1][1], 0.0)):
                best = ranked[0][0]
            if best is None:
                labels[i], fresh = fresh, fresh + 1
            else:
                labels[i], joined = best, joined + 1
        labels = _in_order_of_appearance(labels)
        _, _, nc, rv, _, sil, reason = diag2
        return labels, (direction, rows, nc, rv, int(labels.max()) + 1, sil,
                        f"{reason}; refit without {len(lone)} outlier(s) (a client carrying "
                        f"a component or a part of one client in: {diag[6]}), {joined} "
                        f"joined the closest part")

    def cohort(self, client_ids: Sequence[ClientId], matrix: np.ndarray,
               reference: np.ndarray) -> CohortAssignment:
        """Cohort the quarantined clients.

        Parameters
        ----------
        client_ids:
            ``n`` unique client ids, row order of ``matrix``.
        matrix:
            ``(n, n_params)`` float32 stack of the clients' parameter vectors (or a sequence
            of ``(n_params,)`` vectors).
        reference:
            ``(n_params,)`` parameter vector of the cohort model the clients started from.

        Returns
        -------
        CohortAssignment
            Local cohort ids contiguous from 0; ``n == 0`` gives an empty assignment, one
            client gets cohort 0.

        Raises
        ------
        ParameterAlignmentError
            Rows/ids count mismatch, vectors of different lengths, duplicate ids.
        NonFiniteParameterError
            NaN or inf in a client's parameters (names the client) or in the reference.
        """
        ids, mat, ref = validate_client_stack(client_ids, matrix, reference)
        n, p = mat.shape
        if n == 0:
            return CohortAssignment({}, {})
        comps = self.ks_components(mat, ref)
        threshold = (ks_critical_value(self.direction_alpha, p, p)
                     if self.effective_direction_rule == "established" else None)
        directions = [self._direction(c, threshold) for c in comps]

        # One pass over the stack when centering: the displacement Gram D = (X - r)(X - r)^T
        # gives every direction group's centered Gram exactly (J D_SS J, J the centering
        # matrix) and the reconciliation's cosines, so the stack is read once, not once per
        # direction group plus once for the reconciliation.
        floor = self.effective_spread_floor
        disp = (displacement_gram(mat, ref, block_bytes=self.block_bytes)
                if (self.center or floor is not None) and n > 1 else None)
        ref64 = ref.astype(np.float64, copy=False)
        ref_sq = float(ref64 @ ref64)
        group_labels: list[tuple[str, int] | None] = [None] * n
        diag_parts: list[tuple[str, list[int], int, float, int, dict[int, float], str]] = []
        for direction in DIRECTIONS:
            rows = [i for i in range(n) if directions[i] == direction]
            if not rows:
                continue
            sub, diag, clustered, carriers = self._split_group(direction, rows, mat, disp,
                                                               ref_sq)
            if self.refit_without_outliers and disp is not None:
                sub, diag = self._refit_without_outliers(direction, rows, mat, disp, ref_sq,
                                                         sub, diag, clustered, carriers)
            diag_parts.append(diag)
            for r, s in zip(rows, sub.tolist(), strict=True):
                group_labels[r] = (direction, int(s))

        keys = [k for k in group_labels if k is not None]
        alias = self._reconcile(mat, ref, keys, disp)
        local: dict[tuple[str, int], int] = {}
        assignments: dict[ClientId, int] = {}
        for cid, key in zip(ids, group_labels, strict=True):
            assert key is not None
            key = alias.get(key, key)
            if key not in local:
                local[key] = len(local)
            assignments[cid] = local[key]

        groups = tuple(
            GroupDiagnostics(direction=d, members=tuple(ids[r] for r in rows),
                             cohort_ids=tuple(assignments[ids[r]] for r in rows),
                             n_components=nc, retained_variance=rv, k=k,
                             silhouettes=sil, reason=reason)
            for d, rows, nc, rv, k, sil, reason in diag_parts)
        return CohortAssignment(
            assignments=assignments,
            ks_statistics={cid: c.signed for cid, c in zip(ids, comps, strict=True)},
            directions=dict(zip(ids, directions, strict=True)),
            d_plus={cid: c.d_plus for cid, c in zip(ids, comps, strict=True)},
            d_minus={cid: c.d_minus for cid, c in zip(ids, comps, strict=True)},
            direction_threshold=threshold,
            groups=groups,
        )
