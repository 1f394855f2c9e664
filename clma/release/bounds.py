"""Keeping clip bounds and monitoring strata honest over time.

Bound re-derivation (from PUBLISHED aggregates only)
----------------------------------------------------
:func:`propose_clip_bound` reads a released (noisy) error histogram — bucket
values as published, with fixed edges from the metric layout — and proposes
the upper edge of the first bucket at which the cumulative noisy mass reaches
``target_fraction``.  Negative noisy masses are set to 0 and the vector is
renormalised (post-processing of a DP release costs no budget, Dwork & Roth
2014, Prop. 2.1).  It never sees raw data.  If the target is only reached in
the last, open-ended bucket, the proposal is the top edge and is flagged
``saturated`` (the true bound may be higher; widen the histogram edges).
:func:`update_bounds` turns a proposal into a new :class:`BoundsVersion` when it
moves the bound by more than a relative tolerance; a new version starts a new
alert baseline (:mod:`clma.release.alerts` compares only within one version).

Region merge rule (monitoring only)
-----------------------------------
:class:`RegionMergeTracker` counts, per region, consecutive evaluations below
the cohort floor; after ``consecutive_required`` of them the region is merged,
for monitoring only, with the neighbour the partition file names for it.  The
merged group REPLACES both regions in the monitored partition, so groups stay
disjoint and parallel composition still holds.  The regional report records
the merge and states that the merged region is the finest granularity
actually monitored.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from clma.privacy.mechanisms import Mechanism
from clma.release.aggregate import MetricSpec, RegionalReport, regional_report

__all__ = [
    "BoundProposal",
    "BoundsVersion",
    "RegionMergeTracker",
    "merged_regional_report",
    "propose_clip_bound",
    "update_bounds",
]


class BoundProposal(BaseModel):
    """A proposed upper clip bound derived from a published histogram."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    clip_high: float
    bucket: int
    cumulative_fraction: float
    saturated: bool


def propose_clip_bound(
    published_histogram: Sequence[float], edges: Sequence[float], *, target_fraction: float = 0.95
) -> BoundProposal:
    """Smallest bucket upper edge below which ``target_fraction`` of the noisy mass lies.

    Args:
        published_histogram: released noisy bucket sums or fractions, ``(B,)``.
        edges: the fixed edges of that histogram, ``(B + 1,)`` increasing; the
            last bucket is open-ended.
        target_fraction: in (0, 1].
    """
    h = np.asarray(published_histogram, dtype=np.float64)
    e = np.asarray(edges, dtype=np.float64)
    if h.ndim != 1 or e.shape != (h.size + 1,):
        raise ValueError("edges must have one more entry than published_histogram")
    if not np.all(np.isfinite(h)) or not np.all(np.isfinite(e)) or np.any(np.diff(e) <= 0):
        raise ValueError("published_histogram and edges must be finite; edges increasing")
    if not (0.0 < target_fraction <= 1.0):
        raise ValueError("target_fraction must be in (0, 1]")
    mass = np.clip(h, 0.0, None)
    if mass.sum() <= 0:
        raise ValueError("published_histogram has no positive mass after clamping noise")
    cum = np.cumsum(mass) / mass.sum()
    b = int(np.searchsorted(cum, target_fraction - 1e-12, side="left"))
    b = min(b, h.size - 1)
    return BoundProposal(
        clip_high=float(e[b + 1]), bucket=b, cumulative_fraction=float(cum[b]),
        saturated=b == h.size - 1,
    )


class BoundsVersion(BaseModel):
    """Versioned clip bounds of one metric (recorded with each release)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    metric: str
    clip_low: float
    clip_high: float
    version: int = Field(ge=1)
    reason: str = "initial"
    derived_at_round: int | None = None

    @model_validator(mode="after")
    def _valid(self) -> BoundsVersion:
        MetricSpec(self.metric, self.clip_low, self.clip_high)  # same rules as a spec
        return self

    @property
    def label(self) -> str:
        """Version label used by alert baselines, e.g. ``mean_loss@v2``."""
        return f"{self.metric}@v{self.version}"

    def spec(self) -> MetricSpec:
        return MetricSpec(self.metric, self.clip_low, self.clip_high)


def update_bounds(
    current: BoundsVersion, proposal: BoundProposal, *, round: int, min_relative_change: float = 0.1
) -> BoundsVersion:
    """New version if the proposal moves ``clip_high`` by more than the tolerance, else ``current``."""
    if proposal.clip_high <= current.clip_low:
        raise ValueError("proposed clip_high must exceed the current clip_low")
    rel = abs(proposal.clip_high - current.clip_high) / abs(current.clip_high or 1.0)
    if rel <= min_relative_change:
        return current
    return BoundsVersion(
        metric=current.metric, clip_low=current.clip_low, clip_high=proposal.clip_high,
        version=current.version + 1, derived_at_round=round,
        reason=f"re-derived from published histogram (bucket {proposal.bucket}"
               f"{', saturated' if proposal.saturated else ''})",
    )


class RegionMergeTracker(BaseModel):
    """Consecutive below-floor counts and monitoring-only merges (JSON-serialisable).

    Attributes:
        neighbours: region -> the neighbour the partition file names for it.
        consecutive_required: evaluations below the floor before merging (>= 1).
        streaks: region -> current consecutive below-floor count.
        merged: region -> region it is merged into (monitoring only).
    """

    model_config = ConfigDict(extra="forbid")

    neighbours: dict[str, str]
    consecutive_required: int = Field(default=3, ge=1)
    streaks: dict[str, int] = Field(default_factory=dict)
    merged: dict[str, str] = Field(default_factory=dict)

    def observe(self, all_regions: Sequence[str], suppressed: Sequence[str]) -> list[str]:
        """Record one evaluation; returns regions newly merged by it.

        Raises:
            ValueError: a region to merge has no neighbour in the partition.
        """
        sup = set(suppressed)
        newly: list[str] = []
        for r in all_regions:
            self.streaks[r] = self.streaks.get(r, 0) + 1 if r in sup else 0
            if r not in self.merged and self.streaks[r] >= self.consecutive_required:
                target = self.neighbours.get(r)
                if target is None or target == r:
                    raise ValueError(f"region {r!r} has no neighbour named in the partition")
                self.merged[r] = target
                newly.append(r)
        return newly

    def group_of(self, region: str) -> str:
        """Monitoring group name of ``region`` (``"a+b"``, members sorted)."""
        return "+".join(self._members(self._root(region)))

    def _root(self, region: str) -> str:
        seen = {region}
        r = region
        while r in self.merged:
            r = self.merged[r]
            if r in seen:  # cycle: two regions merged into each other
                return min(seen)
            seen.add(r)
        return r

    def _members(self, root: str) -> list[str]:
        regions = set(self.neighbours) | set(self.neighbours.values()) | set(self.merged)
        return sorted(r for r in regions if self._root(r) == root) or [root]

    def groups(self, regions: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """Monitoring group -> member regions, for the given partition regions."""
        out: dict[str, list[str]] = {}
        for r in regions:
            out.setdefault(self.group_of(r), []).append(r)
        return {g: tuple(sorted(m)) for g, m in out.items()}

    def monitoring_version(self, partition_version: str) -> str:
        """Partition version of the MONITORED partition (changes with every merge)."""
        if not self.merged:
            return partition_version
        blob = ",".join(f"{k}>{v}" for k, v in sorted(self.merged.items()))
        return f"{partition_version}+merge-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RegionMergeTracker:
        return cls.model_validate(dict(data))


def merged_regional_report(
    by_region: Mapping[str, Any],
    spec: MetricSpec,
    tracker: RegionMergeTracker,
    *,
    epsilon_total: float,
    min_cohort: int = 50,
    seed: int | None = None,
    mechanism: Mechanism | str = Mechanism.LAPLACE,
    delta: float | None = None,
) -> RegionalReport:
    """Regional report over the MONITORED partition (merged groups replace their members).

    Per-client values of the members of a group are concatenated; groups are
    disjoint, so each spends the full ``epsilon_total``.  The returned report
    has ``merged_regions`` (group -> members) for every merged group; the
    tracker is then updated with this evaluation's suppressed groups' members.
    Merges are sticky until the partition itself changes (use a fresh tracker).
    """
    groups = tracker.groups(list(by_region))
    values = {
        g: np.concatenate([np.asarray(by_region[m], dtype=np.float64).ravel() for m in members])
        for g, members in groups.items()
    }
    rep = regional_report(values, spec, epsilon_total=epsilon_total, min_cohort=min_cohort,
                          seed=seed, mechanism=mechanism, delta=delta)
    rep.merged_regions = {g: m for g, m in groups.items() if len(m) > 1}
    suppressed_members = [m for g in rep.suppressed_regions for m in groups[g]]
    tracker.observe(list(by_region), suppressed_members)
    return rep

