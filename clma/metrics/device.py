"""On-device bounded metrics, computed and clipped BEFORE anything leaves the device.

Every function here runs on the client, on its own evaluation data, and
returns values inside bounds fixed in advance by a spec; the server only ever
receives secure-aggregated sums of them.  Per-value sensitivities (replace-one
adjacency at the client level: one client's whole report replaced):

==========================  =================  ======================================
value                       bounds             sensitivity of the SUM over clients
==========================  =================  ======================================
accuracy                    [0, 1]             1
mean loss                   [0, L_max]         L_max
error histogram (B bins)    fractions, sum 1   L1 = 2, L2 = sqrt(2) (whole vector)
calibration (B bins) x 3    fractions, sum<=1  L1 = 2 per vector (mass, confidence,
                                               outcome), so L1 = 6 for the three
sample-count bucket         one-hot            L1 = 2 (one client moves one unit)
==========================  =================  ======================================

Calibration follows the reliability diagram of Guo et al. (ICML 2017, §2):
examples are bucketed by their confidence (max predicted probability) with
FIXED edges; per bucket the client reports, as fractions of its local n,
``mass_b = |B_b| / n``, ``confidence_b = sum_{i in B_b} conf_i / n`` and
``outcome_b = sum_{i in B_b} correct_i / n``.  After aggregation the server
forms ``sum confidence_b / sum mass_b`` (mean predicted probability) and
``sum outcome_b / sum mass_b`` (mean outcome) from the noisy sums — a
client-weighted reliability diagram with known sensitivity.

:class:`DeviceMetricReport` packs all of it into one float vector of
``REPORT_LENGTH = 32`` values with the layout of :class:`DeviceMetricLayout`
(default: ``[0]`` accuracy, ``[1]`` mean loss, ``[2:9]`` 7-bin error
histogram, ``[9:14]`` calibration mass, ``[14:19]`` calibration confidence,
``[19:24]`` calibration outcome, ``[24:29]`` sample-count bucket one-hot,
``[29:32]`` zero padding), ready for :mod:`clma.privacy.secagg`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "REPORT_LENGTH",
    "DeviceMetricLayout",
    "DeviceMetricReport",
    "accuracy",
    "calibration_buckets",
    "compute_device_report",
    "error_histogram",
    "mean_loss",
    "per_example_loss",
    "sample_count_bucket",
]

REPORT_LENGTH = 32
_EPS_PROB = 1e-12


def _check_probs_labels(probabilities: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(probabilities, dtype=np.float64)
    y = np.asarray(labels)
    if p.ndim != 2:
        raise ValueError("probabilities must have shape (n_examples, n_classes)")
    if y.ndim != 1 or y.shape[0] != p.shape[0]:
        raise ValueError("labels must have shape (n_examples,) matching probabilities")
    if p.shape[0] == 0:
        raise ValueError("probabilities must hold at least one example")
    if not np.issubdtype(y.dtype, np.integer):
        raise TypeError("labels must be integers")
    if y.min() < 0 or y.max() >= p.shape[1]:
        raise ValueError("labels must lie in [0, n_classes)")
    if not np.all(np.isfinite(p)) or p.min() < 0.0:
        raise ValueError("probabilities must be finite and non-negative")
    if not np.allclose(p.sum(axis=1), 1.0, atol=1e-4):
        raise ValueError("probabilities rows must sum to 1 (apply softmax first)")
    return p, y.astype(np.int64)


def per_example_loss(probabilities: Any, labels: Any) -> np.ndarray:
    """Cross-entropy ``-ln p_i[y_i]`` per example, float64 ``(n_examples,)``.

    Probabilities are floored at 1e-12 so the loss is finite (<= 27.6).
    """
    p, y = _check_probs_labels(probabilities, labels)
    return -np.log(np.maximum(p[np.arange(y.size), y], _EPS_PROB))


def mean_loss(probabilities: Any, labels: Any, *, l_max: float) -> float:
    """Mean cross-entropy with each example's loss clipped to ``[0, l_max]``.

    Clipping per example bounds the mean in ``[0, l_max]`` (the metric spec's
    bounds) and limits one example's influence on the local mean.

    Args:
        probabilities: ``(n_examples, n_classes)`` float, rows sum to 1.
        labels: ``(n_examples,)`` int in ``[0, n_classes)``.
        l_max: clip bound L_max (> 0, finite), in nats.
    """
    if not (isinstance(l_max, (int, float)) and math.isfinite(l_max) and l_max > 0):
        raise ValueError("l_max must be finite and > 0")
    return float(np.clip(per_example_loss(probabilities, labels), 0.0, l_max).mean())


def accuracy(probabilities: Any, labels: Any) -> float:
    """Fraction of examples whose arg-max class equals the label, in [0, 1]."""
    p, y = _check_probs_labels(probabilities, labels)
    return float(np.mean(p.argmax(axis=1) == y))


def _check_edges(edges: Any, field: str, *, n_min: int, n_max: int) -> np.ndarray:
    e = np.asarray(edges, dtype=np.float64)
    if e.ndim != 1 or not (n_min + 1 <= e.size <= n_max + 1):
        raise ValueError(f"{field} must define between {n_min} and {n_max} buckets")
    if not np.all(np.isfinite(e)) or not np.all(np.diff(e) > 0):
        raise ValueError(f"{field} must be finite and strictly increasing")
    return e


def _bucket_index(x: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Bucket b holds ``edges[b] <= x < edges[b+1]``; values below the first
    edge go to bucket 0 and values at or above the last inner edge go to the
    last bucket (open-ended)."""
    return np.clip(np.searchsorted(edges, x, side="right") - 1, 0, edges.size - 2)


def error_histogram(errors: Any, edges: Any) -> np.ndarray:
    """Fractions of per-example errors in fixed buckets (sums to 1).

    Args:
        errors: ``(n_examples,)`` per-example errors (e.g. :func:`per_example_loss`).
        edges: fixed bucket edges from the spec, 6 to 10 finite increasing
            values (5 to 9 buckets); never derived from the data.  The last
            bucket is open-ended (it collects every error >= its lower edge).

    Returns:
        float64 ``(n_buckets,)`` of fractions in [0, 1] summing to 1.
    """
    e = _check_edges(edges, "edges", n_min=5, n_max=9)
    x = np.asarray(errors, dtype=np.float64)
    if x.ndim != 1 or x.size == 0 or not np.all(np.isfinite(x)):
        raise ValueError("errors must be a non-empty finite 1-D array")
    counts = np.bincount(_bucket_index(x, e), minlength=e.size - 1)
    return counts / x.size


def calibration_buckets(
    probabilities: Any, labels: Any, edges: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-confidence-bucket (mass, confidence, outcome) as fractions of local n.

    Args:
        probabilities: ``(n_examples, n_classes)``.
        labels: ``(n_examples,)``.
        edges: fixed confidence edges in [0, 1], 2 to 10 buckets.

    Returns:
        three float64 ``(n_buckets,)`` arrays, each entry in [0, 1], each
        vector summing to <= 1 (mass sums to exactly 1).
    """
    p, y = _check_probs_labels(probabilities, labels)
    e = _check_edges(edges, "calibration edges", n_min=2, n_max=9)
    if e[0] < 0.0 or e[-1] > 1.0:
        raise ValueError("calibration edges must lie in [0, 1]")
    conf = p.max(axis=1)
    correct = (p.argmax(axis=1) == y).astype(np.float64)
    idx = _bucket_index(conf, e)
    nb, n = e.size - 1, y.size
    mass = np.bincount(idx, minlength=nb) / n
    conf_mass = np.bincount(idx, weights=conf, minlength=nb) / n
    outcome_mass = np.bincount(idx, weights=correct, minlength=nb) / n
    return mass, conf_mass, outcome_mass


def sample_count_bucket(n_examples: int, edges: Any) -> np.ndarray:
    """One-hot bucket of the local sample count (the exact count never leaves).

    Args:
        n_examples: local evaluation-set size (>= 0).
        edges: fixed increasing count edges, e.g. ``(0, 10, 50, 200, 1000, 5000)``
            for buckets [0,10), [10,50), [50,200), [200,1000), >=1000.
    Returns:
        float64 one-hot ``(n_buckets,)``.
    """
    if isinstance(n_examples, bool) or not isinstance(n_examples, (int, np.integer)):
        raise TypeError("n_examples must be an integer")
    if n_examples < 0:
        raise ValueError("n_examples must be >= 0")
    e = _check_edges(edges, "count edges", n_min=2, n_max=9)
    out = np.zeros(e.size - 1)
    out[int(_bucket_index(np.asarray([float(n_examples)]), e)[0])] = 1.0
    return out


class DeviceMetricLayout(BaseModel):
    """Fixed layout of the on-device metric vector (all edges fixed in advance).

    Attributes:
        l_max: clip bound of the mean loss (nats).
        error_edges: per-example loss histogram edges (5-9 buckets).
        calibration_edges: confidence bucket edges in [0, 1].
        count_edges: sample-count bucket edges.
        version: layout version string, recorded with each release.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    l_max: float = 5.0
    error_edges: tuple[float, ...] = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)
    calibration_edges: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    count_edges: tuple[float, ...] = (0.0, 10.0, 50.0, 200.0, 1000.0, 5000.0)
    version: str = Field(default="1", min_length=1)

    @field_validator("l_max")
    @classmethod
    def _lmax(cls, v: float) -> float:
        if not math.isfinite(v) or v <= 0:
            raise ValueError("l_max must be finite and > 0")
        return v

    @model_validator(mode="after")
    def _fits(self) -> DeviceMetricLayout:
        _check_edges(self.error_edges, "error_edges", n_min=5, n_max=9)
        c = _check_edges(self.calibration_edges, "calibration_edges", n_min=2, n_max=9)
        if c[0] < 0.0 or c[-1] > 1.0:
            raise ValueError("calibration_edges must lie in [0, 1]")
        _check_edges(self.count_edges, "count_edges", n_min=2, n_max=9)
        if self.used_length > REPORT_LENGTH:
            raise ValueError(f"layout needs more than REPORT_LENGTH={REPORT_LENGTH} values")
        return self

    @property
    def n_error_buckets(self) -> int:
        return len(self.error_edges) - 1

    @property
    def n_calibration_buckets(self) -> int:
        return len(self.calibration_edges) - 1

    @property
    def n_count_buckets(self) -> int:
        return len(self.count_edges) - 1

    @property
    def used_length(self) -> int:
        return 2 + self.n_error_buckets + 3 * self.n_calibration_buckets + self.n_count_buckets

    @property
    def slices(self) -> dict[str, slice]:
        """Name -> slice of the report vector."""
        out: dict[str, slice] = {"accuracy": slice(0, 1), "mean_loss": slice(1, 2)}
        pos = 2
        for name, size in (
            ("error_histogram", self.n_error_buckets),
            ("calibration_mass", self.n_calibration_buckets),
            ("calibration_confidence", self.n_calibration_buckets),
            ("calibration_outcome", self.n_calibration_buckets),
            ("sample_count_bucket", self.n_count_buckets),
        ):
            out[name] = slice(pos, pos + size)
            pos += size
        out["padding"] = slice(pos, REPORT_LENGTH)
        return out

    def lower_bounds(self) -> np.ndarray:
        """Per-coordinate lower clip bound, float64 ``(32,)`` (all 0)."""
        return np.zeros(REPORT_LENGTH)

    def upper_bounds(self) -> np.ndarray:
        """Per-coordinate upper clip bound, float64 ``(32,)`` (l_max for the
        loss, 1 for fractions, 0 for padding)."""
        hi = np.ones(REPORT_LENGTH)
        hi[self.slices["mean_loss"]] = self.l_max
        hi[self.slices["padding"]] = 0.0
        return hi

    def l1_sensitivity(self, group: str) -> float:
        """L1 sensitivity of the SUM of group ``group`` (replace-one client)."""
        table = {
            "accuracy": 1.0,
            "mean_loss": self.l_max,
            "error_histogram": 2.0,
            "calibration_mass": 2.0,
            "calibration_confidence": 2.0,
            "calibration_outcome": 2.0,
            "sample_count_bucket": 2.0,
        }
        try:
            return table[group]
        except KeyError:
            raise ValueError(f"unknown report group {group!r}") from None


class DeviceMetricReport(BaseModel):
    """One client's clipped metric vector, float64 ``(32,)`` in layout order."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    layout: DeviceMetricLayout
    values: tuple[float, ...]

    @model_validator(mode="after")
    def _bounded(self) -> DeviceMetricReport:
        v = np.asarray(self.values, dtype=np.float64)
        if v.shape != (REPORT_LENGTH,):
            raise ValueError(f"values must hold exactly REPORT_LENGTH={REPORT_LENGTH} numbers")
        if not np.all(np.isfinite(v)):
            raise ValueError("values must be finite")
        if np.any(v < self.layout.lower_bounds()) or np.any(v > self.layout.upper_bounds()):
            raise ValueError("values must lie inside the layout's clip bounds")
        return self

    @property
    def vector(self) -> np.ndarray:
        """float64 ``(32,)``."""
        return np.asarray(self.values, dtype=np.float64)

    def group(self, name: str) -> np.ndarray:
        return self.vector[self.layout.slices[name]]


def compute_device_report(
    probabilities: Any, labels: Any, layout: DeviceMetricLayout | None = None
) -> DeviceMetricReport:
    """All on-device metrics of one client, clipped, packed in the fixed layout.

    Args:
        probabilities: ``(n_examples, n_classes)`` predicted probabilities.
        labels: ``(n_examples,)`` integer labels.
        layout: the fixed layout (default :class:`DeviceMetricLayout()`).
    """
    lay = layout or DeviceMetricLayout()
    losses = per_example_loss(probabilities, labels)
    vec = np.zeros(REPORT_LENGTH)
    s = lay.slices
    vec[s["accuracy"]] = accuracy(probabilities, labels)
    vec[s["mean_loss"]] = float(np.clip(losses, 0.0, lay.l_max).mean())
    vec[s["error_histogram"]] = error_histogram(losses, lay.error_edges)
    mass, conf, outcome = calibration_buckets(probabilities, labels, lay.calibration_edges)
    vec[s["calibration_mass"]] = mass
    vec[s["calibration_confidence"]] = conf
    vec[s["calibration_outcome"]] = outcome
    vec[s["sample_count_bucket"]] = sample_count_bucket(int(losses.size), lay.count_edges)
    vec = np.clip(vec, lay.lower_bounds(), lay.upper_bounds())  # defensive, exact no-op
    return DeviceMetricReport(layout=lay, values=tuple(float(x) for x in vec))
