"""Released aggregates: metric specs, one noisy mean per cohort, regional reports.

Neighbouring relation and sensitivity
-------------------------------------
Privacy is at the **client level** under **replace-one** adjacency: two
evaluation rounds are neighbours when they have the same set of participating
positions (the same n) and differ in the *entire* contribution of one client.
Each client contributes one value clipped to ``[clip_low, clip_high]``, so the
L1 (and L2) sensitivity of the SUM is ``clip_high - clip_low``
(:attr:`MetricSpec.sensitivity`).  Under replace-one the number of
contributors n is not protected by the DP guarantee; we nevertheless never
*publish* it exactly (DESIGN "Trust model"): the published view shows a
participant band and an error bar computed from the band's lower edge.

The mechanism (Dwork et al. 2006): values are clipped (on the device; clipped
again here defensively), summed (by secure aggregation in the real protocol),
noise of scale ``b = sensitivity / epsilon`` is added ONCE to the sum, and
``value = noisy_sum / n``.  The 95 % error bar is ``b * ln(20) / n`` for the
Laplace mechanism, which is exact: ``P(|Z| <= b ln 20) = 0.95`` for
``Z ~ Laplace(0, b)``.  (The normal approximation ``1.96 sqrt(2) b / n``
covers only ~93.7 %.)  It is known before the round: it depends only on the
spec, epsilon and n.

Cohort floor
------------
A release with fewer than ``min_cohort`` contributors is refused:
:func:`aggregate_metric` raises :class:`BelowCohortFloor` before any noise is
drawn, so no budget is spent; :func:`regional_report` omits such regions.

Regions and parallel composition
--------------------------------
Regions of a partition are disjoint sets of clients, so releasing one noisy
sum per region at ``epsilon_total`` each costs ``epsilon_total`` in total
(parallel composition, McSherry 2009, Thm 4).  The per-region epsilon is never
divided by the number of regions.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from clma.privacy.distributed import MECHANISM_VERSION as DDG_VERSION
from clma.privacy.mechanisms import (
    Mechanism,
    NoiseSource,
    PrivacyParameterError,
    error_bar,
    gaussian_rho,
    interval_quantile,
    noise_scale,
    sample,
)

__all__ = [
    "AggregatedMetric",
    "AggregatedVector",
    "aggregate_vector_sum",
    "BelowCohortFloor",
    "count_band",
    "MetricSpec",
    "ParticipantBand",
    "RegionalReport",
    "SuppressedRegionBand",
    "SuppressedRelease",
    "aggregate_metric",
    "aggregate_sum",
    "participant_band",
    "participant_band_lower_edge",
    "region_seed",
    "regional_report",
    "suppressed_region_band",
]

DEFAULT_LEVEL = 0.95


class MetricSpec(BaseModel):
    """A bounded metric: name and finite, increasing clip bounds.

    Attributes:
        name: metric name (non-empty).
        clip_low, clip_high: clipping bounds, finite, ``clip_low < clip_high``,
            in the metric's units.

    Raises:
        ValueError (pydantic ``ValidationError``) naming the field and the rule
        for non-finite or non-increasing bounds.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    clip_low: float
    clip_high: float

    def __init__(self, name: str | None = None, clip_low: float | None = None,
                 clip_high: float | None = None, **data: Any) -> None:
        # Positional construction MetricSpec(name, low, high) as in DESIGN.md.
        if name is not None:
            data["name"] = name
        if clip_low is not None:
            data["clip_low"] = clip_low
        if clip_high is not None:
            data["clip_high"] = clip_high
        super().__init__(**data)

    @field_validator("clip_low", "clip_high")
    @classmethod
    def _finite(cls, v: float, info: Any) -> float:
        if not math.isfinite(v):
            raise ValueError(f"{info.field_name} must be finite")
        return v

    @model_validator(mode="after")
    def _increasing(self) -> MetricSpec:
        if not self.clip_low < self.clip_high:
            raise ValueError("clip_high must be strictly greater than clip_low")
        return self

    @property
    def sensitivity(self) -> float:
        """L1/L2 sensitivity of the SUM under replace-one client adjacency:
        ``clip_high - clip_low``."""
        return self.clip_high - self.clip_low

    def clip(self, values: Any) -> np.ndarray:
        """Clip values to ``[clip_low, clip_high]`` (vectorised).

        Args:
            values: scalar or array of any shape, real numbers.
        Returns:
            float64 array of the same shape.
        Raises:
            ValueError: NaN values (a NaN cannot be clipped meaningfully).
        """
        arr = np.asarray(values, dtype=np.float64)
        if np.isnan(arr).any():
            raise ValueError(f"values for metric {self.name!r} must not contain NaN")
        return np.clip(arr, self.clip_low, self.clip_high)


class SuppressedRelease(ValueError):
    """A release was refused (nothing is published, no budget is spent)."""


class BelowCohortFloor(SuppressedRelease):
    """Fewer contributors than the cohort floor (``min_cohort``)."""


class ParticipantBand(StrEnum):
    """Coarse number of contributors relative to the cohort floor m.

    ``minimum_to_under_double``: m <= n < 2m; ``double_to_under_fourfold``:
    2m <= n < 4m; ``fourfold_or_more``: n >= 4m.
    """

    MINIMUM_TO_UNDER_DOUBLE = "minimum_to_under_double"
    DOUBLE_TO_UNDER_FOURFOLD = "double_to_under_fourfold"
    FOURFOLD_OR_MORE = "fourfold_or_more"


_BAND_MULTIPLIER = {
    ParticipantBand.MINIMUM_TO_UNDER_DOUBLE: 1,
    ParticipantBand.DOUBLE_TO_UNDER_FOURFOLD: 2,
    ParticipantBand.FOURFOLD_OR_MORE: 4,
}


def participant_band(n: int, min_cohort: int) -> ParticipantBand:
    """Band of ``n`` contributors relative to the floor ``min_cohort``.

    Raises:
        BelowCohortFloor: ``n < min_cohort`` (such counts are never banded,
            they are suppressed).
    """
    if min_cohort < 1:
        raise ValueError("min_cohort must be >= 1")
    if n < min_cohort:
        raise BelowCohortFloor("contributors below the cohort floor: release suppressed")
    if n < 2 * min_cohort:
        return ParticipantBand.MINIMUM_TO_UNDER_DOUBLE
    if n < 4 * min_cohort:
        return ParticipantBand.DOUBLE_TO_UNDER_FOURFOLD
    return ParticipantBand.FOURFOLD_OR_MORE


def count_band(n: int, min_cohort: int) -> str:
    """Published band of a count of clients (a cohort's members, flagged clients...):
    ``none`` (0), ``below_minimum`` (1 to m - 1) or the :class:`ParticipantBand` value;
    never the count itself."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError("n: must be an integer >= 0")
    if n == 0:
        return "none"
    if n < min_cohort:
        return "below_minimum"
    return participant_band(int(n), min_cohort).value


def participant_band_lower_edge(band: ParticipantBand | str, min_cohort: int) -> int:
    """Smallest n in ``band`` (``m``, ``2m`` or ``4m``)."""
    return _BAND_MULTIPLIER[ParticipantBand(band)] * int(min_cohort)


class AggregatedMetric(BaseModel):
    """Server-side result of one release (holds the EXACT contributor count).

    Attributes:
        name: metric name.
        value: ``noisy_sum / contributors`` (metric units).
        error_bar: half-width of the ``level`` interval for exactly this n
            (exact coverage for the mechanism).
        contributors: exact n (server side only; never published).
        epsilon, delta: privacy parameters of this release (delta None for
            Laplace).
        mechanism: ``laplace`` or ``gaussian``.
        noise_scale: Laplace b or Gaussian sigma on the SUM.
        sensitivity: sensitivity of the sum (``clip_high - clip_low``).
        clip_low, clip_high: bounds of the spec used.
        level: coverage of ``error_bar`` (0.95).
        min_cohort: cohort floor in force (defines the participant band).
        noise_source: ``opendp`` or ``seeded-simulation``.
        rho: zCDP rho of the Gaussian draw, or the charged rho of a distributed release
            (None for Laplace).
        quantum: distributed mode only: metric units per quantisation step; then
            ``noise_scale`` is the per-client discrete Gaussian sigma in metric units and
            the bar is the exact quantile of the sum of n such shares
            (:func:`clma.privacy.distributed.sum_noise_quantile`), over n.
        honest_floor: distributed mode only: the fewest honest contributors the share
            was sized for (the guarantee holds whenever the sum is unmasked).
        wrap_probability: distributed mode only: bound on a ring wrap-around (added to
            ``delta``).

    The PUBLISHED view is :meth:`to_published_dict`: participant band instead of
    n, and :attr:`published_error_bar` computed from the band's lower edge.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    value: float
    error_bar: float
    contributors: int
    epsilon: float
    delta: float | None = None
    mechanism: Mechanism = Mechanism.LAPLACE
    noise_scale: float
    sensitivity: float
    clip_low: float
    clip_high: float
    level: float = DEFAULT_LEVEL
    min_cohort: int
    noise_source: NoiseSource
    rho: float | None = None
    quantum: float | None = None
    honest_floor: int | None = None
    wrap_probability: float | None = None

    def bar_at(self, n: int) -> float:
        """Half-width of the exact ``level`` interval of this mechanism for n contributors."""
        if self.mechanism is Mechanism.DISTRIBUTED_DISCRETE_GAUSSIAN:
            from clma.privacy.distributed import sum_noise_quantile

            q = float(self.quantum)  # type: ignore[arg-type]
            return sum_noise_quantile(self.noise_scale / q, int(n), self.level) * q / n
        return error_bar(self.noise_scale, mechanism=self.mechanism, level=self.level, n=n)

    @property
    def participant_band(self) -> ParticipantBand:
        """Coarse band of the contributor count (see :class:`ParticipantBand`)."""
        return participant_band(self.contributors, self.min_cohort)

    @property
    def published_error_bar(self) -> float:
        """Error bar computed from the band's LOWER edge (>= :attr:`error_bar`).

        Conservative: its coverage is at least ``level`` for every n in the
        band, and it reveals only the band, not n.
        """
        lower = participant_band_lower_edge(self.participant_band, self.min_cohort)
        return self.bar_at(lower)

    def is_significant(self, other: AggregatedMetric, *, published: bool = True) -> bool:
        """True iff ``|self.value - other.value| > bar(self) + bar(other)``.

        Uses the PUBLISHED bars by default: an alert decision is itself
        published, so it must be reproducible from published numbers alone, and
        the published bars (coverage >= level) make the rule conservative.
        ``published=False`` uses the exact-n bars (server-side analysis).

        Raises:
            ValueError: the two metrics have different names.
        """
        if not isinstance(other, AggregatedMetric):
            raise TypeError("other must be an AggregatedMetric")
        if other.name != self.name:
            raise ValueError("is_significant compares releases of the same metric name")
        if published:
            bars = self.published_error_bar + other.published_error_bar
        else:
            bars = self.error_bar + other.error_bar
        return abs(self.value - other.value) > bars

    def to_published_dict(self) -> dict[str, Any]:
        """What may leave the server: never the exact contributor count."""
        return {
            "name": self.name,
            "value": self.value,
            "error_bar": self.published_error_bar,
            "error_bar_level": self.level,
            "error_bar_basis": "participant_band_lower_edge",
            "participant_band": self.participant_band.value,
            "min_cohort": self.min_cohort,
            "mechanism": self.mechanism.value,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "sensitivity": self.sensitivity,
            "clip_low": self.clip_low,
            "clip_high": self.clip_high,
            "noise_source": self.noise_source.value,
            **({"mechanism_version": DDG_VERSION, "noise_added": "on_devices",
                "per_client_sigma": self.noise_scale, "honest_floor": self.honest_floor,
                "rho": self.rho, "wrap_probability": self.wrap_probability}
               if self.mechanism is Mechanism.DISTRIBUTED_DISCRETE_GAUSSIAN else {}),
        }


def _check_min_cohort(min_cohort: int) -> int:
    if isinstance(min_cohort, bool) or not isinstance(min_cohort, (int, np.integer)):
        raise TypeError("min_cohort must be an integer")
    if min_cohort < 1:
        raise ValueError("min_cohort must be >= 1")
    return int(min_cohort)


def aggregate_sum(
    clipped_sum: float,
    contributors: int,
    spec: MetricSpec,
    *,
    epsilon: float,
    min_cohort: int = 50,
    seed: int | np.random.Generator | None = None,
    mechanism: Mechanism | str = Mechanism.LAPLACE,
    delta: float | None = None,
    level: float = DEFAULT_LEVEL,
) -> AggregatedMetric:
    """Release a mean from an already-aggregated sum of clipped values.

    The secure-aggregation path: the server holds only the sum (e.g. the
    de-quantised output of :mod:`clma.privacy.secagg`) and the number of
    contributors.  Noise is added ONCE to the sum.

    Args:
        clipped_sum: sum over the n clients of values clipped to the spec.
        contributors: n (int >= 1).
        spec: the metric spec (gives sensitivity).
        epsilon: epsilon of this release.
        min_cohort: cohort floor; below it :class:`BelowCohortFloor`.
        seed: None -> OpenDP sampler; int / Generator -> numpy (simulation).
        mechanism: ``laplace`` (default) or ``gaussian`` (needs ``delta``).
        delta: (epsilon, delta) for the Gaussian mechanism.
        level: coverage of the error bar (default 0.95).

    Raises:
        BelowCohortFloor: n < min_cohort (nothing drawn, nothing spent).
        PrivacyParameterError: invalid epsilon/delta/level.
        ValueError: a sum outside ``[n clip_low, n clip_high]`` (not clipped).
    """
    m = _check_min_cohort(min_cohort)
    if isinstance(contributors, bool) or not isinstance(contributors, (int, np.integer)):
        raise TypeError("contributors must be an integer")
    n = int(contributors)
    if n < 1:
        raise ValueError("contributors must be >= 1")
    if n < m:
        raise BelowCohortFloor(
            f"metric {spec.name!r}: contributors below the cohort floor min_cohort={m}; "
            "release suppressed"
        )
    s = float(clipped_sum)
    tol = 1e-9 * n * max(1.0, abs(spec.clip_low), abs(spec.clip_high))
    if not math.isfinite(s) or s < n * spec.clip_low - tol or s > n * spec.clip_high + tol:
        raise ValueError(
            f"clipped_sum for metric {spec.name!r} must lie in [n*clip_low, n*clip_high]"
        )
    mech = Mechanism(mechanism)
    if mech is Mechanism.LAPLACE and delta is not None:
        raise PrivacyParameterError("delta must be None for the laplace mechanism")
    scale = noise_scale(spec.sensitivity, epsilon, mechanism=mech, delta=delta)
    noisy, source = sample(s, scale, mechanism=mech, seed=seed)
    return AggregatedMetric(
        name=spec.name,
        value=float(noisy) / n,
        error_bar=error_bar(scale, mechanism=mech, level=level, n=n),
        contributors=n,
        epsilon=float(epsilon),
        delta=None if delta is None else float(delta),
        mechanism=mech,
        noise_scale=scale,
        sensitivity=spec.sensitivity,
        clip_low=spec.clip_low,
        clip_high=spec.clip_high,
        level=level,
        min_cohort=m,
        noise_source=source,
        rho=gaussian_rho(spec.sensitivity, scale) if mech is Mechanism.GAUSSIAN else None,
    )


def aggregate_metric(
    values: Any,
    spec: MetricSpec,
    *,
    epsilon: float,
    min_cohort: int = 50,
    seed: int | np.random.Generator | None = None,
    mechanism: Mechanism | str = Mechanism.LAPLACE,
    delta: float | None = None,
    level: float = DEFAULT_LEVEL,
) -> AggregatedMetric:
    """Noisy mean of one value per client, noise added once to the clipped sum.

    Args:
        values: per-client values, shape ``(n,)``, real (simulation stand-in
            for the secure sum: only their sum is used).
        spec: :class:`MetricSpec` (clip bounds, sensitivity).
        epsilon: epsilon of this release (> 0).
        min_cohort: cohort floor (default 50).
        seed: None -> OpenDP sampler; int -> reproducible numpy noise
            (``noise_source="seeded-simulation"``).
        mechanism, delta, level: see :func:`aggregate_sum`.

    Returns:
        :class:`AggregatedMetric` with ``value = (sum(clip(values)) + Z) / n``
        and ``error_bar = b * ln(1/(1-level)) / n`` (Laplace) or
        ``sigma * Phi^{-1}((1+level)/2) / n`` (Gaussian).

    Raises:
        BelowCohortFloor: fewer than ``min_cohort`` values (nothing released).
        ValueError: values not 1-D or containing NaN.
    """
    if not isinstance(spec, MetricSpec):
        raise TypeError("spec must be a MetricSpec")
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError("values must be a 1-D sequence of real numbers") from None
    if arr.ndim != 1:
        raise ValueError("values must be a 1-D array of per-client values")
    clipped = spec.clip(arr)
    return aggregate_sum(
        float(clipped.sum()), int(arr.size), spec, epsilon=epsilon, min_cohort=min_cohort,
        seed=seed, mechanism=mechanism, delta=delta, level=level,
    )


class AggregatedVector(BaseModel):
    """Server-side release of a vector sum (e.g. the error histogram), noise once per coordinate.

    ``values = noisy_sum / contributors`` (float64 list, length d); every
    coordinate has the same ``error_bar`` (exact coverage per coordinate).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    values: list[float]
    error_bar: float
    contributors: int
    epsilon: float
    l1_sensitivity: float
    noise_scale: float
    level: float = DEFAULT_LEVEL
    min_cohort: int
    noise_source: NoiseSource

    @property
    def participant_band(self) -> ParticipantBand:
        return participant_band(self.contributors, self.min_cohort)

    @property
    def published_error_bar(self) -> float:
        lower = participant_band_lower_edge(self.participant_band, self.min_cohort)
        return error_bar(self.noise_scale, level=self.level, n=lower)

    def to_published_dict(self) -> dict[str, Any]:
        """Published view: no exact contributor count."""
        return {
            "name": self.name, "values": list(self.values),
            "error_bar": self.published_error_bar, "error_bar_level": self.level,
            "participant_band": self.participant_band.value, "min_cohort": self.min_cohort,
            "mechanism": "laplace", "epsilon": self.epsilon,
            "l1_sensitivity": self.l1_sensitivity, "noise_source": self.noise_source.value,
        }


def aggregate_vector_sum(
    clipped_sum: Any,
    contributors: int,
    *,
    name: str,
    l1_sensitivity: float,
    epsilon: float,
    min_cohort: int = 50,
    seed: int | np.random.Generator | None = None,
    level: float = DEFAULT_LEVEL,
) -> AggregatedVector:
    """Laplace release of a vector sum with L1 sensitivity ``l1_sensitivity``.

    One Laplace draw of scale ``b = l1_sensitivity / epsilon`` per coordinate
    is epsilon-DP for the whole vector (Dwork et al. 2006).  For the on-device
    error histogram (fractions summing to 1 per client) ``l1_sensitivity = 2``
    under replace-one (see :mod:`clma.metrics.device`).

    Args:
        clipped_sum: float ``(d,)`` sum over clients of clipped vectors.
        contributors: n.

    Raises:
        BelowCohortFloor: n < min_cohort.
    """
    m = _check_min_cohort(min_cohort)
    n = int(contributors)
    if n < m:
        raise BelowCohortFloor(f"{name!r}: contributors below the cohort floor; release suppressed")
    vec = np.asarray(clipped_sum, dtype=np.float64)
    if vec.ndim != 1 or vec.size == 0:
        raise ValueError("clipped_sum must be a non-empty 1-D vector")
    scale = noise_scale(l1_sensitivity, epsilon)
    noisy, source = sample(vec, scale, seed=seed)
    return AggregatedVector(
        name=name, values=(np.asarray(noisy) / n).tolist(),
        error_bar=error_bar(scale, level=level, n=n), contributors=n, epsilon=float(epsilon),
        l1_sensitivity=float(l1_sensitivity), noise_scale=scale, level=level, min_cohort=m,
        noise_source=source,
    )


class SuppressedRegionBand(StrEnum):
    """Coarsened number of suppressed regions (the count is never published exactly)."""

    NONE = "none"
    ONE_TO_TWO = "1_to_2"
    THREE_TO_FIVE = "3_to_5"
    SIX_OR_MORE = "6_or_more"


def suppressed_region_band(n_suppressed: int) -> SuppressedRegionBand:
    """Bucket the number of suppressed regions: 0 / 1-2 / 3-5 / 6+."""
    if isinstance(n_suppressed, bool) or not isinstance(n_suppressed, (int, np.integer)):
        raise TypeError("n_suppressed must be an integer")
    if n_suppressed < 0:
        raise ValueError("n_suppressed must be >= 0")
    if n_suppressed == 0:
        return SuppressedRegionBand.NONE
    if n_suppressed <= 2:
        return SuppressedRegionBand.ONE_TO_TWO
    if n_suppressed <= 5:
        return SuppressedRegionBand.THREE_TO_FIVE
    return SuppressedRegionBand.SIX_OR_MORE


def region_seed(seed: int, region: str) -> int:
    """Deterministic per-region seed from a report seed and the region name.

    Derived through SHA-256 of the region name, so adding or removing another
    region never changes this region's noise.
    """
    digest = hashlib.sha256(region.encode("utf-8")).digest()
    ss = np.random.SeedSequence([int(seed) & (2**63 - 1), int.from_bytes(digest[:8], "little")])
    return int(ss.generate_state(1, dtype=np.uint64)[0])


class RegionalReport(dict):
    """``dict[str, AggregatedMetric]`` of published regions, plus metadata.

    Suppressed regions are absent from the mapping.  Extra attributes:

    - ``epsilon_total``: the evaluation epsilon each region spent.
    - ``epsilon_charged``: what the whole report costs under parallel
      composition: ``epsilon_total`` if any region was released, else 0.
    - ``suppressed_band``: :class:`SuppressedRegionBand` (coarsened count).
    - ``merged_regions``: monitored region -> tuple of partition regions it
      covers (set by :func:`clma.release.bounds.merge_regions`); a merged
      region is the finest granularity actually monitored.
    - ``delta_charged``: delta (Gaussian) or None.

    The exact number and names of suppressed regions are kept private
    (``_suppressed``) for server-side bookkeeping (e.g. the merge rule).
    Note: when the partition is public, an absent region name reveals that it
    was suppressed; the band matters for summaries that do not list regions.
    """

    def __init__(
        self,
        released: Mapping[str, AggregatedMetric],
        *,
        suppressed: tuple[str, ...],
        epsilon_total: float,
        delta: float | None = None,
        merged_regions: Mapping[str, tuple[str, ...]] | None = None,
    ) -> None:
        super().__init__(released)
        self.epsilon_total = float(epsilon_total)
        self.delta_charged = delta if released else None
        self.epsilon_charged = self.epsilon_total if released else 0.0
        self._suppressed = tuple(suppressed)
        self.suppressed_band = suppressed_region_band(len(self._suppressed))
        self.merged_regions = dict(merged_regions or {})

    @property
    def suppressed_regions(self) -> tuple[str, ...]:
        """Names of suppressed regions (server side; do not publish the count)."""
        return self._suppressed

    def to_published_dict(self) -> dict[str, Any]:
        """Published JSON-able view: no exact counts anywhere."""
        out: dict[str, Any] = {
            "regions": {k: v.to_published_dict() for k, v in sorted(self.items())},
            "suppressed_regions_band": self.suppressed_band.value,
            "epsilon_charged": self.epsilon_charged,
            "composition": "parallel (disjoint regions)",
        }
        if self.merged_regions:
            out["merged_regions"] = {k: list(v) for k, v in self.merged_regions.items()}
            out["granularity_note"] = (
                "merged regions are the finest granularity actually monitored"
            )
        return out


def regional_report(
    by_region: Mapping[str, Any],
    spec: MetricSpec,
    *,
    epsilon_total: float,
    min_cohort: int = 50,
    seed: int | None = None,
    mechanism: Mechanism | str = Mechanism.LAPLACE,
    delta: float | None = None,
    level: float = DEFAULT_LEVEL,
) -> RegionalReport:
    """One release per region, each at the FULL ``epsilon_total``.

    Args:
        by_region: region name -> per-client values ``(n_r,)``.  Regions must
            be disjoint sets of clients (the region partition guarantees it);
            that is what makes parallel composition valid.
        spec: metric spec.
        epsilon_total: the evaluation epsilon; each region spends all of it.
        min_cohort: floor; regions below it are absent from the result.
        seed: None -> OpenDP; int -> per-region seeds from :func:`region_seed`.
        mechanism, delta, level: see :func:`aggregate_sum`.

    Returns:
        :class:`RegionalReport` (a ``dict[str, AggregatedMetric]``).
    """
    if not isinstance(by_region, Mapping):
        raise TypeError("by_region must be a mapping region -> values")
    released: dict[str, AggregatedMetric] = {}
    suppressed: list[str] = []
    for region in sorted(by_region):
        if not isinstance(region, str) or not region:
            raise TypeError("region names must be non-empty strings")
        rseed = None if seed is None else region_seed(seed, region)
        if np.size(by_region[region]) == 0:  # no contributor at all: below any floor
            suppressed.append(region)
            continue
        try:
            released[region] = aggregate_metric(
                by_region[region], spec, epsilon=epsilon_total, min_cohort=min_cohort,
                seed=rseed, mechanism=mechanism, delta=delta, level=level,
            )
        except BelowCohortFloor:
            suppressed.append(region)
    return RegionalReport(
        released, suppressed=tuple(suppressed), epsilon_total=epsilon_total, delta=delta,
    )


# Re-exported for callers that catch privacy-parameter problems generically.
__all__ += ["PrivacyParameterError", "interval_quantile"]
