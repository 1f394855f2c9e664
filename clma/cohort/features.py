"""Cohorting features relative to each client's own update history (a departure from CLMA).

CLMA (Adarsh N L et al., CODS-COMAD 2024, Algorithm 3) cohorts quarantined clients by
their parameter vectors ``x_i`` against the reference ``r`` (the model they started from),
i.e. by the displacement ``d_i = x_i - r``. Under label-skewed (non-IID) clients ``d_i``
could be dominated by a stable component (the pull towards the client's own label mix,
present in every round); this option cancels it. Measured on the default scenario
(docs/realistic_drift.md) it does not help: the label mix explains little of ``d_i``, and
the history mean's common learning direction makes the families *more* alike. The fix
used there is ``components="broken_stick"`` (:mod:`clma.cohort.cohorter`); this option
stays for comparison.

``features = "relative"`` cohorts by the change of the client's update instead:

    f_i = d_i(t) - m_i,    m_i = (1 / n_i) * sum_{s in S_i} d_i(s)

where ``d_i(s) = x_i(s) - r_i(s)`` is the client's update at round ``s`` against the model
it started that round from, and ``S_i`` are the client's previous rounds (``n_i`` of them)
in its current cohort in which it was not quarantined. The stable non-IID component is in
``m_i`` and cancels; the drift (absent from every ``d_i(s)``, ``s < t``) remains. A client
without history (``n_i = 0``) keeps the published feature ``f_i = d_i(t)``. The cohorter
then runs unchanged on the rows ``r + f_i`` against ``r``.

History: a client's running mean restarts when it is quarantined or its update comes from
another cohort than the history's (its updates are then relative to another model).

Trust model. :class:`UpdateHistory` is server-side state: per client id, the running mean
of updates the server already received in the clear (CLMA's design: the server needs the
individual parameter vectors to cohort and aggregate, DESIGN.md "Trust model"). It is a
function of those updates only, so the server learns nothing it did not already hold; it
is never published, logged or sent, and it is kept in the server's state folder like the
cohort models (it must survive between flow runs). It holds one float32 vector of the
cohorting sub-vector's length per client seen in a stable round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

__all__ = ["FEATURES", "CohortFeatures", "UpdateHistory", "relative_features",
           "relative_rows"]

CohortFeatures = Literal["paper", "relative"]
FEATURES: tuple[str, ...] = ("paper", "relative")


@dataclass
class UpdateHistory:
    """Per-client running mean of its previous stable updates (server side; module doc).

    Attributes:
        means: client id -> float32 ``(n_features,)`` mean of its updates ``x - r``.
        counts: client id -> number of updates in the mean (>= 1).
        cohorts: client id -> the cohort id those updates were made in.
    """

    means: dict[int, np.ndarray] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
    cohorts: dict[int, int] = field(default_factory=dict)

    def observe(self, client_id: int, cohort_id: int, update: np.ndarray) -> None:
        """Add one stable update ``x - r`` (float, ``(n_features,)``) of ``client_id`` made
        in ``cohort_id``; a history from another cohort is dropped first.

        Raises:
            ValueError: ``update`` is not a finite 1-D vector of the history's length.
        """
        u = np.asarray(update, dtype=np.float64)
        if u.ndim != 1 or not np.isfinite(u).all():
            raise ValueError("update: must be a finite 1-D vector")
        c = int(client_id)
        if self.cohorts.get(c) != int(cohort_id):
            self.reset(c)
        if c not in self.means:
            self.means[c] = u.astype(np.float32)
            self.counts[c] = 1
            self.cohorts[c] = int(cohort_id)
            return
        if self.means[c].shape != u.shape:
            raise ValueError("update: length differs from the client's history")
        n = self.counts[c] + 1
        mean = self.means[c].astype(np.float64)
        self.means[c] = (mean + (u - mean) / n).astype(np.float32)
        self.counts[c] = n

    def reset(self, client_id: int) -> None:
        """Forget ``client_id``'s history (quarantined, or moved to another cohort)."""
        c = int(client_id)
        self.means.pop(c, None)
        self.counts.pop(c, None)
        self.cohorts.pop(c, None)

    def mean(self, client_id: int, cohort_id: int) -> np.ndarray | None:
        """The client's mean update in ``cohort_id``, or None without history there."""
        c = int(client_id)
        if self.cohorts.get(c) != int(cohort_id):
            return None
        return self.means.get(c)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """``{"client_<id>": mean, "meta": int64 (n, 3) rows (id, count, cohort)}``."""
        ids = sorted(self.means)
        out = {f"client_{c}": self.means[c] for c in ids}
        out["meta"] = np.array([[c, self.counts[c], self.cohorts[c]] for c in ids],
                               dtype=np.int64).reshape(len(ids), 3)
        return out

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> UpdateHistory:
        """Inverse of :meth:`to_arrays`. Raises ValueError for a missing client array."""
        h = cls()
        for c, n, k in np.asarray(arrays["meta"], dtype=np.int64).reshape(-1, 3).tolist():
            key = f"client_{c}"
            if key not in arrays:
                raise ValueError(f"update history: no mean stored for client {c}")
            h.means[c] = np.asarray(arrays[key], dtype=np.float32)
            h.counts[c] = int(n)
            h.cohorts[c] = int(k)
        return h


def relative_features(updates: np.ndarray, means: Sequence[np.ndarray | None]) -> np.ndarray:
    """``f_i = d_i - m_i`` (module doc); a row whose mean is None keeps ``d_i``.

    Args:
        updates: ``(n, p)`` float updates ``d_i = x_i - r``.
        means: ``n`` entries, each a ``(p,)`` mean of the client's previous stable updates
            or None (no history).

    Returns:
        float64 ``(n, p)``.

    Raises:
        ValueError: shapes do not match.
    """
    d = np.asarray(updates, dtype=np.float64)
    if d.ndim != 2 or len(means) != d.shape[0]:
        raise ValueError("means: one entry per row of updates (n, p) is needed")
    out = d.copy()
    for i, m in enumerate(means):
        if m is None:
            continue
        mv = np.asarray(m, dtype=np.float64)
        if mv.shape != (d.shape[1],):
            raise ValueError(f"means[{i}]: shape {mv.shape}, expected ({d.shape[1]},)")
        out[i] -= mv
    return out


def relative_rows(matrix: np.ndarray, reference: np.ndarray,
                  means: Sequence[np.ndarray | None]) -> np.ndarray:
    """The cohorter's input rows ``r + f_i`` (float32 ``(n, p)``) for the parameter stack
    ``matrix`` ``(n, p)`` and the reference ``r`` ``(p,)`` (see :func:`relative_features`)."""
    ref = np.asarray(reference, dtype=np.float64)
    f = relative_features(np.asarray(matrix, dtype=np.float64) - ref, means)
    return (ref + f).astype(np.float32)
