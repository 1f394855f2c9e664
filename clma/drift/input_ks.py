"""Covariate-drift detection on the device's own inputs: per-feature two-sample KS tests
with a Bonferroni correction, optionally joined with the loss-threshold flag.

A covariate drift changes ``p(x)``: the loss of the received model may barely move (the
loss-based detectors miss it), but the inputs themselves differ from what the device saw
before. :class:`InputKSDetector` keeps a reference sample of the device's inputs and
tests each round's inputs against it (Rabanser, Günnemann, Lipton, "Failing Loudly: An
Empirical Study of Methods for Detecting Dataset Shift", NeurIPS 2019, sec. 3):

* inputs ``(n, ...)`` are flattened to ``(n, d)`` float32 rows; a sample of more than
  ``reference_size`` rows is replaced by a uniform subsample of ``reference_size`` rows
  without replacement (``numpy.random.default_rng(seed)``: the device passes a seed made
  of its client id and the round, so a round asked again draws the same rows);
* features with a single value across both samples carry no information (``D = 0``) and
  are skipped; the other ``d`` features are tested with ``scipy.stats.ks_2samp``
  (two-sided, ``method="auto"``: exact for these sample sizes; with ties, as on pixel
  grids, the p-value is conservative; where scipy's exact computation does not converge
  it warns and uses the asymptotic p-value -- seen only at ``D = 1/n``, ``p ~ 1``);
* with ``summaries`` (default) the four per-row summary statistics of
  :func:`row_summaries` (mean, standard deviation, fraction of zeros, mean absolute
  difference of consecutive features) are tested the same way, as four more features
  (a departure from the paper, measured: on the default federation's 18-row shards,
  Gaussian noise of std 0.5 is flagged on 33 of 60 clients by the pixels alone and on
  60 of 60 with the summaries; rotation and blur on 60 of 60 either way,
  tests/clma/test_drift_input_ks.py);
* flag iff ``min_j p_j <= alpha / d`` over all ``d`` tests (Bonferroni): under no drift, with the current
  sample drawn independently of the reference from the same distribution, the
  probability of a flag in one round is at most ``alpha``
  (``1 - (1 - alpha / d)^d <= alpha`` for independent features, and ``<= alpha`` by the
  union bound for any dependence);
* with ``with_loss_threshold`` it also flags a rise of the received model's loss of more
  than ``gamma`` over the previous round (exactly :class:`clma.drift.LossThresholdDetector`'s
  rule), so one detector covers concept drift (inputs unchanged) and covariate drift;
* the first observation never flags and becomes the reference; after a flag the current
  sample becomes the reference (a client drifted for good is flagged at the change, not
  every round after); without a flag the reference is kept.

State: parameters, ``gamma``, the previous loss, counters and the reference sample as
zlib-compressed little-endian float32 bytes in base64 (with its shape).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import Field

from clma.drift._arrays import decode_array, encode_array
from clma.drift.cusum import DetectorParams, _params
from clma.drift.detectors import DriftDetector, check_loss

__all__ = ["InputKSDetector", "InputKSParams", "as_feature_rows", "feature_ks_pvalues",
           "row_summaries", "subsample_rows"]

#: Stream tag mixed into the subsample seed (``default_rng([*seed, SUBSAMPLE_STREAM])``).
SUBSAMPLE_STREAM = 5171


class InputKSParams(DetectorParams):
    """Declared parameters of :class:`InputKSDetector` (also ``drift.input_ks``).

    ``alpha`` family-wise false-flag rate per round under no drift, in (0, 1);
    ``reference_size`` rows kept and tested (>= 2); ``with_loss_threshold`` also flag a
    loss rise above ``drift.gamma``; ``summaries`` also test the per-row summary
    statistics of :func:`row_summaries`.
    """


    alpha: Annotated[float, Field(gt=0.0, lt=1.0)] = Field(
        default=0.01, description="Family-wise false-flag rate per round under no drift "
        "(Bonferroni: a feature flags at p <= alpha / d).")
    reference_size: Annotated[int, Field(ge=2, le=100_000)] = Field(
        default=256, description="Rows of inputs kept as the reference and tested each "
        "round (a seeded uniform subsample of a larger sample).")
    with_loss_threshold: bool = Field(
        default=True, description="Also flag a rise of the loss above drift.gamma (the "
        "loss-threshold rule), so concept drift is caught too.")
    summaries: bool = Field(
        default=True, description="Also test four per-row summary statistics (mean, "
        "standard deviation, fraction of zeros, mean absolute difference of consecutive "
        "features), Bonferroni over all tests: a shift spread thinly over many features "
        "(noise) moves each feature little but every row's summaries at once.")


def as_feature_rows(inputs: Any, field: str = "inputs") -> np.ndarray:
    """``inputs`` ``(n, ...)`` as float32 ``(n, d)`` rows (``(n,)`` gives ``d = 1``).

    Raises:
        ValueError: not numeric, zero-dimensional, no row, no feature or not finite
            (names ``field``).
    """
    try:
        x = np.asarray(inputs, dtype=np.float32)
    except (TypeError, ValueError):
        raise ValueError(f"{field}: must be a numeric array (n, ...)") from None
    if x.ndim == 0 or x.shape[0] < 1:
        raise ValueError(f"{field}: must hold at least one row (shape (n, ...))")
    x = x.reshape(x.shape[0], -1)
    if x.shape[1] < 1:
        raise ValueError(f"{field}: must hold at least one feature per row")
    if not np.isfinite(x).all():
        raise ValueError(f"{field}: must be finite")
    return x


def subsample_rows(x: np.ndarray, size: int, seed: Any) -> np.ndarray:
    """``x`` itself when it has at most ``size`` rows, else ``size`` rows drawn uniformly
    without replacement by ``numpy.random.default_rng(seed).choice`` (kept in their
    original order)."""
    if x.shape[0] <= size:
        return x
    idx = np.sort(np.random.default_rng(seed).choice(x.shape[0], size=size, replace=False))
    return x[idx]


def row_summaries(x: np.ndarray) -> np.ndarray:
    """Four summary statistics of each row of ``x`` ``(n, d)``: float64 ``(n, 4)`` of the
    mean, the standard deviation (``ddof=0``), the fraction of features exactly 0 and the
    mean absolute difference of consecutive features (``0`` when ``d == 1``).

    For images flattened row-major these are brightness, contrast, sparsity and
    roughness (horizontal total variation per pixel): additive noise leaves each pixel's
    distribution moderately changed but raises every image's roughness and lowers its
    sparsity; blur does the opposite; a rotation moves the pixel marginals themselves.
    """
    x = np.asarray(x, dtype=np.float64)
    rough = (np.abs(np.diff(x, axis=1)).mean(axis=1) if x.shape[1] > 1
             else np.zeros(x.shape[0]))
    return np.stack([x.mean(axis=1), x.std(axis=1), (x == 0.0).mean(axis=1), rough], axis=1)


def feature_ks_pvalues(reference: np.ndarray, current: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Two-sided two-sample KS p-value of every informative feature.

    Args:
        reference: ``(n, d)`` float rows; current: ``(m, d)`` float rows (same ``d``).

    Returns:
        ``(pvalues, tested)``: float64 p-values ``(d_tested,)`` of the features in
        ``tested`` (bool ``(d,)``: the features with more than one value across both
        samples), from ``scipy.stats.ks_2samp(reference, current, axis=0)``.

    Raises:
        ValueError: a sample is not 2-D, or the samples have different numbers of
            features.
    """
    if reference.ndim != 2 or current.ndim != 2:
        raise ValueError("reference, current: must be 2-D arrays (n, d) of feature rows")
    if reference.shape[1] != current.shape[1]:
        raise ValueError(f"inputs: must have the reference's {reference.shape[1]} features "
                         f"per row, got {current.shape[1]}")
    lo = np.minimum(reference.min(axis=0), current.min(axis=0))
    hi = np.maximum(reference.max(axis=0), current.max(axis=0))
    tested = hi > lo
    if not tested.any():
        return np.zeros(0, dtype=np.float64), tested
    from scipy import stats  # lazy: every ClientApp process imports this module

    res = stats.ks_2samp(reference[:, tested].astype(np.float64),
                         current[:, tested].astype(np.float64), axis=0)
    return np.atleast_1d(np.asarray(res.pvalue, dtype=np.float64)), tested


class InputKSDetector(DriftDetector):
    """Per-feature KS tests of the device's inputs against a reference sample, Bonferroni
    corrected, or-ed with the loss-threshold rule (module docstring for the method).

    Args:
        gamma: loss-threshold ``gamma`` (nats, finite, >= 0; used when
            ``with_loss_threshold``).
        **params: the fields of :class:`InputKSParams` (defaults there).

    Raises:
        ValueError: a parameter outside its declared domain (the message names it).

    Source: S. Rabanser, S. Günnemann, Z. C. Lipton, "Failing Loudly", NeurIPS 2019, sec. 3
    (univariate KS tests with Bonferroni correction); CLMA (CODS-COMAD 2024) loss threshold.
    """

    needs_inputs: ClassVar[bool] = True
    kind = "InputKSDetector"

    def __init__(self, gamma: float, **params: Any) -> None:
        g = check_loss(gamma, "gamma")
        if g < 0:
            raise ValueError("gamma: must be >= 0")
        self.gamma = g
        self.params: InputKSParams = _params(InputKSParams, params, "")
        self.reset()

    def __repr__(self) -> str:
        p = self.params
        return (f"InputKSDetector(gamma={self.gamma}, alpha={p.alpha}, "
                f"reference_size={p.reference_size}, "
                f"with_loss_threshold={p.with_loss_threshold}, summaries={p.summaries})")

    def update(self, loss: float, inputs: Any = None, *,
               seed: int | Sequence[int] | None = None) -> bool:
        """Record one round: the received model's loss and the device's current inputs
        ``(n, ...)``; True if drift is flagged.

        ``seed``: entropy of the subsample (``default_rng([*seed, SUBSAMPLE_STREAM])``;
        None: the update count), used only when ``n > reference_size``.

        Raises:
            ValueError: ``inputs`` missing or malformed, or with another number of
                features than the reference (the state is then unchanged).
        """
        value = check_loss(loss)
        if inputs is None:
            raise ValueError("inputs: drift.detector input_ks needs the device's current "
                             "inputs")
        entropy = [self.n_updates] if seed is None else list(np.atleast_1d(seed).tolist())
        x = subsample_rows(as_feature_rows(inputs), self.params.reference_size,
                           [*(int(s) for s in entropy), SUBSAMPLE_STREAM])
        ks_flag = False
        if self.reference is None:
            self.last_min_pvalue, self.last_n_tested = None, 0
        else:
            ref, cur = self.reference, x
            if self.params.summaries:
                ref = np.hstack([ref, row_summaries(ref)])
                cur = np.hstack([cur, row_summaries(cur)])
            pvals, tested = feature_ks_pvalues(ref, cur)
            d = int(tested.sum())
            self.last_n_tested = d
            self.last_min_pvalue = float(pvals.min()) if d else None
            ks_flag = d > 0 and float(pvals.min()) <= self.params.alpha / d
        loss_flag = (self.params.with_loss_threshold and self.previous_loss is not None
                     and (value - self.previous_loss) > self.gamma)
        flag = bool(ks_flag or loss_flag)
        if self.reference is None or flag:
            self.reference = x.copy()
        self.previous_loss = value
        self.n_updates += 1
        self.n_flags += int(flag)
        return flag

    def reset(self) -> None:
        self.reference: np.ndarray | None = None
        self.previous_loss: float | None = None
        self.last_min_pvalue: float | None = None
        self.last_n_tested = 0
        self.n_updates = 0
        self.n_flags = 0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "params": self.params.model_dump(), "gamma": self.gamma,
                "previous_loss": self.previous_loss,
                "reference": None if self.reference is None else encode_array(self.reference),
                "last_min_pvalue": self.last_min_pvalue, "last_n_tested": self.last_n_tested,
                "n_updates": self.n_updates, "n_flags": self.n_flags}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("kind") != self.kind:
            raise ValueError(f"state: not a {self.kind} state_dict")
        params = _params(InputKSParams, dict(state.get("params") or {}), "state.params.")
        gamma = check_loss(state.get("gamma"), "state.gamma")
        if gamma < 0:
            raise ValueError("state.gamma: must be >= 0")
        prev = state.get("previous_loss")
        prev = None if prev is None else check_loss(prev, "state.previous_loss")
        ref = state.get("reference")
        ref = None if ref is None else decode_array(ref, "state.reference", 2, params.reference_size)
        last_p = state.get("last_min_pvalue")
        if last_p is not None:
            last_p = check_loss(last_p, "state.last_min_pvalue")
            if not 0.0 <= last_p <= 1.0:
                raise ValueError("state.last_min_pvalue: must be in [0, 1]")
        counts = {}
        for name in ("last_n_tested", "n_updates", "n_flags"):
            v = state.get(name, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"state.{name}: must be an integer >= 0")
            counts[name] = v
        if counts["n_flags"] > counts["n_updates"]:
            raise ValueError("state.n_flags: must be <= state.n_updates")
        if (ref is None) != (counts["n_updates"] == 0):
            raise ValueError("state.reference: must be present exactly when n_updates > 0")
        self.params, self.gamma, self.previous_loss, self.reference = params, gamma, prev, ref
        self.last_min_pvalue, self.last_n_tested = last_p, counts["last_n_tested"]
        self.n_updates, self.n_flags = counts["n_updates"], counts["n_flags"]

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> InputKSDetector:
        """A detector restored from :meth:`state_dict` output."""
        det = cls(gamma=check_loss(state.get("gamma") if isinstance(state, dict) else None,
                                   "state.gamma"))
        det.load_state_dict(state)
        return det

