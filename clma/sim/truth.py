"""Simulation ground truth: how well cohorts match the injected drift families.

Only a simulation knows which clients drifted and how; these numbers are tagged as
simulation truth wherever they are logged and are never part of a private release.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from sklearn.metrics import adjusted_rand_score

__all__ = ["drift_event_ari", "families_separated", "mean_or_none"]


def drift_event_ari(families: Mapping[int, str], cohort_of: Mapping[int, int]) -> float:
    """Adjusted Rand index (sklearn) of the cohorts of the clients drifted at one event
    against their injected families. 1.0 = every family in its own cohort and no cohort
    shared between families. Raises ValueError if a client has no cohort."""
    ids = sorted(families)
    if not ids:
        raise ValueError("families: no drifted clients at this event")
    missing = [c for c in ids if c not in cohort_of]
    if missing:
        raise ValueError("cohort_of: a drifted client has no cohort")
    truth = [families[c] for c in ids]
    pred = [cohort_of[c] for c in ids]
    if len(set(truth)) == 1 and len(set(pred)) == 1:
        return 1.0
    return float(adjusted_rand_score(truth, pred))


def families_separated(families: Mapping[int, str], cohort_of: Mapping[int, int]) -> bool:
    """True iff no cohort holds clients of two different families."""
    seen: dict[int, str] = {}
    for c, fam in families.items():
        k = cohort_of[c]
        if seen.setdefault(k, fam) != fam:
            return False
    return True


def mean_or_none(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None
