"""Prefect tasks of the private evaluation path (issue 4 items 4-7, issue 5 envelopes).

The server aggregates numbers, it never computes them, and it never sees one client's
metric. One evaluation round, as data (what the server sees in brackets)::

    device   compute_device_report (clma.metrics): accuracy, mean loss (per-example
             loss clipped to [0, L_max]), 7-bin error histogram with fixed edges,
             calibration masses, sample-count bucket -> 32 values, clipped, quantised
             to integers in [0, Q]                                    [nothing]
    secagg   per monitored region group with >= m selected clients, and once over the
             whole cohort: pairwise-masked inputs (clma.privacy.secagg), dropouts
             simulated at a seeded rate                 [uniform masked vectors, then
             only the exact integer SUM of the survivors and who survived]
             fewer than t survivors -> SecAggAbort -> "not evaluated this round"
    noise    Laplace once on each released sum (clma.release.aggregate_sum /
             aggregate_vector_sum), never per client                  [noisy sums]
    publish  value clamped to the clip range, error bar from the participant band's
             lower edge, band instead of the count, one closed envelope per release
             (clma.release.build_federated_metric_envelope), suppressed-region count
             as a band only; round-health (dropout rate) through the same path
    alerts   per (metric, group): |now - baseline| > bar_now + bar_base on PUBLISHED
             numbers, baseline per (partition version, bounds version)

Cohort floor. The floor in force is ``m = max(config.evaluation.min_cohort,
policy.evaluation.minimum_group_size)``: the envelope refuses a minimum group size below
the policy floor (5), so a config asking for less is raised to it (decision recorded in
every report as ``min_cohort`` and ``min_cohort_rule``); a config asking for more keeps
its larger value.

Budget. Every noise draw is one :class:`PlannedRelease` (name, region or ``"global"``,
mechanism, epsilon, delta, budget line). :func:`plan_releases` lists them BEFORE any
noise is drawn; :func:`evaluate_regions_task` takes an optional ``approve`` callable
(the ledger's hook) that receives the :class:`ReleasePlan` and returns the keys it
approves: unapproved releases draw no noise and are recorded as refused. Groups are
disjoint, so every group spends the full regional epsilon (parallel composition).

State across rounds lives on the federation object as ``fed.evaluation_state``
(:class:`EvaluationState`: alert baselines, merge tracker, clip-bound versions,
evaluation count; JSON round trip via ``to_dict`` / ``from_dict``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict, Field

from clma.budget.policy import PrivacyPolicy, default_policy
from clma.metrics import DeviceMetricLayout, compute_device_report
from clma.privacy.mechanisms import error_bar, noise_scale
from clma.privacy.secagg import (
    FixedPointQuantiser,
    SecAggAbort,
    SecAggConfig,
    run_secure_aggregation,
    secagg_plus_degree,
)
from clma.release import (
    Alert,
    AlertBaselines,
    AlertRule,
    BoundsVersion,
    MetricSpec,
    RegionMergeTracker,
    aggregate_sum,
    aggregate_vector_sum,
    build_federated_metric_envelope,
    propose_clip_bound,
    region_seed,
    suppressed_region_band,
    update_bounds,
)
from clma.release.aggregate import AggregatedMetric, AggregatedVector, participant_band
from clma.sim.federation import SimClient, SimulatedFederation
from clma.sim.training import predict_proba

__all__ = [
    "GLOBAL",
    "DeviceSubmission",
    "EvaluationOutcome",
    "EvaluationState",
    "GroupSum",
    "PlannedRelease",
    "ReleasePlan",
    "SecureSums",
    "device_reports",
    "device_reports_task",
    "effective_min_cohort",
    "evaluate_regions_task",
    "evaluation_state",
    "draw_planned",
    "finish_evaluation",
    "planned_releases",
    "restore_planned",
    "log_evaluation",
    "plan_releases",
    "private_evaluation",
    "secure_sums",
]

GLOBAL = "global"
REPORT_SCHEMA = "clma.evaluation/1"
LINE_GLOBAL = "evaluation.global"
LINE_REGIONAL = "evaluation.regional"
#: Scalar metrics released per group, their layout slot, envelope kind and alert direction.
SCALAR_METRICS: dict[str, tuple[str, str]] = {
    "accuracy": ("rate", "decrease"),
    "mean_loss": ("bounded_mean", "increase"),
}
HEALTH_METRIC = "health.dropout_rate"
HISTOGRAM_METRIC = "error_histogram"
MIN_COHORT_RULE = "max(config evaluation.min_cohort, policy evaluation.minimum_group_size)"
#: Format of the server-side payload a ledger entry stores (:func:`draw_planned`).
STORED_FORMAT = "clma.evaluation.server/2"


# ----------------------------------------------------------------------------- state


class EvaluationState(BaseModel):
    """What the evaluation path keeps between rounds (JSON-serialisable).

    Attributes:
        baselines: alert baselines keyed ``"metric|group"`` (published numbers only).
        merges: monitoring-only region merges and below-floor streaks.
        bounds: metric name -> current versioned clip bounds.
        evaluations_done: number of evaluation rounds run so far.
    """

    model_config = ConfigDict(extra="forbid")

    baselines: AlertBaselines = Field(default_factory=AlertBaselines)
    merges: RegionMergeTracker
    bounds: dict[str, BoundsVersion]
    evaluations_done: int = Field(default=0, ge=0)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvaluationState:
        return cls.model_validate(dict(data))

    def layout(self) -> DeviceMetricLayout:
        """The on-device layout in force (``l_max`` = current mean-loss clip bound)."""
        b = self.bounds["mean_loss"]
        return DeviceMetricLayout(l_max=b.clip_high, version=f"1+{b.label}")


def evaluation_state(fed: SimulatedFederation) -> EvaluationState:
    """``fed.evaluation_state``, created on first use (initial bounds from the config)."""
    state = getattr(fed, "evaluation_state", None)
    if state is None:
        if GLOBAL in fed.partition.region_ids:
            raise ValueError(f"region partition: a region may not be named {GLOBAL!r}")
        state = EvaluationState(
            merges=RegionMergeTracker(
                neighbours=fed.partition.neighbours,
                consecutive_required=fed.config.evaluation.merge_after,
            ),
            bounds={
                "accuracy": BoundsVersion(metric="accuracy", clip_low=0.0, clip_high=1.0, version=1),
                "mean_loss": BoundsVersion(
                    metric="mean_loss", clip_low=0.0,
                    clip_high=fed.config.evaluation.loss_max, version=1,
                ),
            },
        )
        fed.evaluation_state = state  # type: ignore[attr-defined]
    return state


def _policy(fed: SimulatedFederation) -> PrivacyPolicy:
    return getattr(fed, "policy", None) or default_policy()


def effective_min_cohort(fed: SimulatedFederation) -> int:
    """``max(config.evaluation.min_cohort, policy.evaluation.minimum_group_size)``."""
    return max(fed.config.evaluation.min_cohort, _policy(fed).evaluation.minimum_group_size)


# ----------------------------------------------------------------------------- device


@dataclass(frozen=True)
class DeviceSubmission:
    """What leaves one device for secure aggregation: its quantised clipped report.

    ``quantised`` is uint64 ``(32,)`` in ``[0, Q]``; in the real protocol it leaves the
    device only masked (:mod:`clma.privacy.secagg`). ``region`` is public (partition).
    """

    client_id: int
    region: str
    quantised: np.ndarray


def device_reports(
    clients: Sequence[SimClient],
    models: Mapping[int, np.ndarray],
    spec: Any,
    layout: DeviceMetricLayout,
    levels: int = 2**16 - 1,
) -> list[DeviceSubmission]:
    """On-device step: evaluate the cohort model on local data, clip, quantise.

    Args:
        clients: the devices; each uses its current (drifted) local evaluation data.
        models: client id -> float32 parameter vector ``(n_params,)`` of its cohort.
        spec: the model spec (:class:`clma.sim.models.MLPSpec`).
        layout: the fixed metric layout in force (edges and L_max announced by the server).
        levels: quantisation levels Q.
    """
    quant = FixedPointQuantiser(layout.lower_bounds(), layout.upper_bounds(), levels)
    out = []
    for cl in clients:
        _, _, ex, ey = cl.current()
        report = compute_device_report(predict_proba(spec, models[cl.client_id], ex), ey, layout)
        out.append(DeviceSubmission(cl.client_id, cl.region, quant.quantise(report.vector)))
    return out


@task(name="device-metric-reports", cache_policy=NO_CACHE, persist_result=False)
def device_reports_task(
    clients: list[SimClient], models: dict[int, np.ndarray], spec: Any, layout: DeviceMetricLayout
) -> list[DeviceSubmission]:
    """Prefect wrapper of :func:`device_reports` for one chunk of clients."""
    return device_reports(clients, models, spec, layout)


# ----------------------------------------------------------------------------- secagg


@dataclass(frozen=True)
class GroupSum:
    """Server-side result of one group's secure aggregation (never published as is).

    ``status``: ``ok`` (sum available), ``below_floor`` (fewer than m selected or
    surviving clients: nothing released), ``aborted`` (fewer than t survivors:
    :class:`~clma.privacy.secagg.SecAggAbort`, the group is not evaluated this round).
    ``sum`` is the de-quantised float64 ``(32,)`` sum over survivors (None unless ok).
    """

    group: str
    members: tuple[str, ...]
    selected: int
    dropped: int
    status: str
    contributors: int = 0
    sum: np.ndarray | None = None
    sum_quantised: np.ndarray | None = None
    threshold: int = 0


@dataclass
class SecureSums:
    """All groups of one evaluation round, plus the global group ``"global"``."""

    round: int
    min_cohort: int
    groups: dict[str, GroupSum]
    layout: DeviceMetricLayout
    monitoring_version: str


def _threshold(holders: int, fraction: float) -> int:
    return max(2, holders // 2 + 1, math.ceil(fraction * holders))


def _dropouts(fed: SimulatedFederation, ids: Sequence[int], round_number: int) -> dict[int, str]:
    """Seeded simulated dropouts: client id -> stage (before masked input / unmasking)."""
    rate = fed.config.evaluation.dropout_rate
    if rate <= 0.0:
        return {}
    rng = np.random.default_rng([fed.config.seed, round_number, 211])
    out = {}
    for c in sorted(ids):
        drop, stage = rng.random(), rng.random()
        if drop < rate:
            out[c] = "masked_input" if stage < 0.5 else "unmasking"
    return out


def _secure_group(
    name: str, members: tuple[str, ...], subs: list[DeviceSubmission], dropped: Mapping[int, str],
    m: int, fraction: float, quant: FixedPointQuantiser, round_number: int, graph_seed: int,
) -> GroupSum:
    n = len(subs)
    n_drop = sum(1 for s in subs if s.client_id in dropped)
    if n < max(m, 2) or n - n_drop < m:
        return GroupSum(name, members, n, n_drop, "below_floor")
    degree = secagg_plus_degree(n)
    holders = n if degree >= n - 1 else degree + 1
    t = _threshold(holders, fraction)
    cfg = SecAggConfig(
        n_clients=n, threshold=t, vector_length=quant.dim, quantisation_levels=quant.levels,
        neighbour_degree=degree, round_id=f"eval-{round_number}-{name}", graph_seed=graph_seed,
    )
    ids = {s.client_id for s in subs}
    try:
        res = run_secure_aggregation(
            {s.client_id: s.quantised for s in subs}, cfg,
            drop_before_masked_input=sorted(
                c for c, st in dropped.items() if st == "masked_input" and c in ids),
            drop_before_unmasking=sorted(
                c for c, st in dropped.items() if st == "unmasking" and c in ids),
        )
    except SecAggAbort:
        return GroupSum(name, members, n, n_drop, "aborted", threshold=t)
    if res.contributors < m:
        return GroupSum(name, members, n, n_drop, "below_floor", threshold=t)
    return GroupSum(
        name, members, n, n_drop, "ok", contributors=res.contributors,
        sum=quant.dequantise_sum(res.sum_quantised, res.contributors),
        sum_quantised=res.sum_quantised, threshold=t,
    )


def secure_sums(
    fed: SimulatedFederation, submissions: Sequence[DeviceSubmission], round_number: int
) -> SecureSums:
    """Secure aggregation per monitored group (merged regions replace their members) and
    once over the whole cohort. Groups with fewer than m selected clients are not run
    (their sum would be a small-group aggregate the server does not need)."""
    state = evaluation_state(fed)
    ev = fed.config.evaluation
    layout = state.layout()
    quant = FixedPointQuantiser(layout.lower_bounds(), layout.upper_bounds())
    m = effective_min_cohort(fed)
    dropped = _dropouts(fed, [s.client_id for s in submissions], round_number)
    groups = state.merges.groups(fed.partition.region_ids)
    out: dict[str, GroupSum] = {}
    for gname, members in sorted(groups.items()):
        subs = [s for s in submissions if s.region in members]
        gseed = region_seed(fed.config.seed * 1000 + round_number, gname) % 2**31
        out[gname] = _secure_group(gname, members, subs, dropped, m, ev.secagg_threshold,
                                   quant, round_number, gseed)
    gseed = region_seed(fed.config.seed * 1000 + round_number, GLOBAL) % 2**31
    out[GLOBAL] = _secure_group(GLOBAL, (GLOBAL,), list(submissions), dropped, m,
                                ev.secagg_threshold, quant, round_number, gseed)
    return SecureSums(round_number, m, out, layout,
                      state.merges.monitoring_version(fed.partition.version))


# ----------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class PlannedRelease:
    """One noise draw: what the ledger charges.

    ``region`` is a monitored group (``"west"``, ``"south+west"``) or ``"global"``;
    ``line`` is the budget line (``evaluation.global`` / ``evaluation.regional``).
    """

    name: str
    region: str
    mechanism: str
    epsilon: float
    delta: float | None
    line: str
    round: int

    @property
    def key(self) -> str:
        """Idempotency key of the release within a run: ``round:name:region``."""
        return f"{self.round}:{self.name}:{self.region}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "region": self.region, "mechanism": self.mechanism,
                "epsilon": self.epsilon, "delta": self.delta, "line": self.line,
                "round": self.round, "key": self.key}


@dataclass(frozen=True)
class ReleasePlan:
    """All releases an evaluation round will make, known before any noise is drawn."""

    round: int
    releases: tuple[PlannedRelease, ...]

    def epsilon_by_line(self) -> dict[str, float]:
        """Epsilon each line is charged: max over groups (parallel), sum over metrics."""
        per: dict[tuple[str, str], float] = {}
        for r in self.releases:
            per[(r.line, r.region)] = per.get((r.line, r.region), 0.0) + r.epsilon
        out: dict[str, float] = {}
        for (line, _), eps in per.items():
            out[line] = max(out.get(line, 0.0), eps)
        return out


def _bounds_due(fed: SimulatedFederation) -> bool:
    k = fed.config.evaluation.bounds_every
    return k > 0 and (evaluation_state(fed).evaluations_done + 1) % k == 0


def plan_releases(fed: SimulatedFederation, sums: SecureSums) -> ReleasePlan:
    """List the releases of this round (groups with status ``ok`` only)."""
    ev = fed.config.evaluation
    eps_g = ev.global_epsilon if ev.global_epsilon is not None else ev.epsilon
    out: list[PlannedRelease] = []
    for gname, g in sorted(sums.groups.items()):
        line = LINE_GLOBAL if gname == GLOBAL else LINE_REGIONAL
        eps = eps_g if gname == GLOBAL else ev.epsilon
        if g.status == "ok":
            for name in SCALAR_METRICS:
                out.append(PlannedRelease(name, gname, "laplace", eps, None, line, sums.round))
            if gname == GLOBAL and _bounds_due(fed):
                out.append(PlannedRelease(HISTOGRAM_METRIC, gname, "laplace", eps, None, line,
                                          sums.round))
        if g.selected >= sums.min_cohort:
            out.append(PlannedRelease(HEALTH_METRIC, gname, "laplace", ev.health_epsilon, None,
                                      line, sums.round))
    return ReleasePlan(sums.round, tuple(out))


# ----------------------------------------------------------------------------- release


@dataclass
class EvaluationOutcome:
    """Everything one evaluation round produced.

    Attributes:
        round: round number.
        releases: releases made (noise drawn) — the ledger charges exactly these.
        refused: planned releases the ``approve`` hook did not approve (no noise drawn).
        published: the JSON-able published report (no exact counts, no client ids).
        envelopes: relative path ``<metric>/<group>.json`` -> canonical envelope JSON.
        alerts: fired alerts (published numbers only).
        not_evaluated: group -> reason (secure aggregation aborted below t).
        server: server-side results (exact contributors; NEVER published or logged).
    """

    round: int
    releases: list[PlannedRelease]
    refused: list[PlannedRelease]
    published: dict[str, Any]
    envelopes: dict[str, str]
    alerts: list[Alert]
    not_evaluated: dict[str, str]
    server: dict[str, AggregatedMetric | AggregatedVector] = field(default_factory=dict)

    @property
    def alerts_fired(self) -> int:
        return len(self.alerts)


def _seed(fed: SimulatedFederation, round_number: int, key: str) -> int | None:
    if not fed.config.evaluation.noise_seeded:
        return None
    base = int(np.random.default_rng([fed.config.seed, round_number, 101]).integers(2**31))
    return region_seed(base, key)


def _clamped(m: AggregatedMetric) -> AggregatedMetric:
    """Post-processing: the published value is clamped to the clip range."""
    return m.model_copy(update={"value": float(np.clip(m.value, m.clip_low, m.clip_high))})


def _envelope(name: str, kind: str, value: float, bar: float, lo: float, hi: float, n: int,
              m: int, level: float, policy: PrivacyPolicy) -> str:
    v = float(np.clip(value, lo, hi))
    if n < m:  # suppressed envelope: the builder nulls value and interval
        return build_federated_metric_envelope(
            metric_id=name, metric_kind=kind, aggregate_value=lo, clipping_lower_bound=lo,
            clipping_upper_bound=hi, privacy_mechanism="laplace",
            privacy_mechanism_version=policy.mechanism_version("laplace"),
            participant_count=n, minimum_group_size=m, policy=policy,
        ).to_json()
    return build_federated_metric_envelope(
        metric_id=name, metric_kind=kind, aggregate_value=v, clipping_lower_bound=lo,
        clipping_upper_bound=hi, privacy_mechanism="laplace",
        privacy_mechanism_version=policy.mechanism_version("laplace"), participant_count=n,
        minimum_group_size=m, uncertainty_method="confidence_interval",
        uncertainty_lower_bound=max(lo, v - bar), uncertainty_upper_bound=min(hi, v + bar),
        confidence_level=level, policy=policy,
    ).to_json()


def _dropout_band(rate: float) -> str:
    if rate < 0.05:
        return "under_5pct"
    if rate < 0.2:
        return "5_to_under_20pct"
    return "20pct_or_more"


@dataclass
class _Draws:
    """Noise draws of one evaluation round, accumulated release by release."""

    made: list[PlannedRelease] = field(default_factory=list)
    refused: list[PlannedRelease] = field(default_factory=list)
    server: dict[str, Any] = field(default_factory=dict)
    envelopes: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    health: dict[str, Any] = field(default_factory=lambda: {"regions": {}, "global": None})
    released: dict[str, dict[str, AggregatedMetric]] = field(default_factory=dict)
    histogram: dict[str, Any] | None = None


def _new_draws(state: EvaluationState) -> _Draws:
    d = _Draws()
    d.metrics = {name: {"regions": {}, "global": None, "bounds_version": state.bounds[name].label}
                 for name in SCALAR_METRICS}
    d.released = {name: {} for name in SCALAR_METRICS}
    return d


def _compute(fed: SimulatedFederation, sums: SecureSums, rel: PlannedRelease
             ) -> AggregatedMetric | AggregatedVector:
    """Draw the noise of ONE planned release (after its charge): the server-side result
    (exact contributor count inside; never published). Records nothing."""
    state = evaluation_state(fed)
    m = sums.min_cohort
    slices = sums.layout.slices
    g = sums.groups[rel.region]
    seed = _seed(fed, sums.round, f"{rel.name}|{rel.region}")
    if rel.name in SCALAR_METRICS:
        spec = state.bounds[rel.name].spec()
        s = float(np.clip(g.sum[slices[rel.name]][0], g.contributors * spec.clip_low,
                          g.contributors * spec.clip_high))
        return _clamped(aggregate_sum(s, g.contributors, spec, epsilon=rel.epsilon,
                                      min_cohort=m, seed=seed))
    if rel.name == HISTOGRAM_METRIC:
        return aggregate_vector_sum(
            g.sum[slices["error_histogram"]], g.contributors, name=HISTOGRAM_METRIC,
            l1_sensitivity=sums.layout.l1_sensitivity("error_histogram"),
            epsilon=rel.epsilon, min_cohort=m, seed=seed)
    # health: dropout rate over the group's selected clients
    dspec = MetricSpec(HEALTH_METRIC, 0.0, 1.0)
    return _clamped(aggregate_sum(float(g.dropped), g.selected, dspec,
                                  epsilon=rel.epsilon, min_cohort=m, seed=seed))


def _record(fed: SimulatedFederation, sums: SecureSums, rel: PlannedRelease,
            agg: AggregatedMetric | AggregatedVector, d: _Draws) -> dict:
    """Record ONE release's server-side result into the round's draws (published view,
    envelopes, alert inputs, health, histogram); draws no noise. Everything recorded is
    a function of ``agg`` (its exact count only through the participant band), so a
    result restored from the ledger records exactly what the original draw recorded.
    Returns the release's published view."""
    state = evaluation_state(fed)
    policy = _policy(fed)
    m = sums.min_cohort
    if rel.name in SCALAR_METRICS:
        pub = agg.to_published_dict()
        pub["bounds_version"] = state.bounds[rel.name].label
        if rel.region == GLOBAL:
            d.metrics[rel.name]["global"] = pub
        else:
            d.metrics[rel.name]["regions"][rel.region] = pub
            d.released[rel.name][rel.region] = agg
        d.envelopes[f"{rel.name}/{rel.region}.json"] = _envelope(
            rel.name, SCALAR_METRICS[rel.name][0], agg.value, agg.published_error_bar,
            agg.clip_low, agg.clip_high, agg.contributors, m, agg.level, policy)
    elif rel.name == HISTOGRAM_METRIC:
        pub = agg.to_published_dict()
        pub["values"] = [float(np.clip(v, 0.0, 1.0)) for v in agg.values]
        pub["edges"] = list(sums.layout.error_edges)
        d.histogram = pub
        for i, v in enumerate(pub["values"]):
            d.envelopes[f"{HISTOGRAM_METRIC}.b{i}/{rel.region}.json"] = _envelope(
                f"{HISTOGRAM_METRIC}.b{i}", "rate", v, agg.published_error_bar, 0.0, 1.0,
                agg.contributors, m, agg.level, policy)
    else:  # health: dropout rate over the group's selected clients
        pub = agg.to_published_dict()
        pub["band"] = _dropout_band(agg.value)
        if rel.region == GLOBAL:
            d.health["global"] = pub
        else:
            d.health["regions"][rel.region] = pub
        d.envelopes[f"{HEALTH_METRIC}/{rel.region}.json"] = _envelope(
            HEALTH_METRIC, "rate", agg.value, agg.published_error_bar, 0.0, 1.0,
            agg.contributors, m, agg.level, policy)
    d.server[f"{rel.name}|{rel.region}"] = agg
    d.made.append(rel)
    return pub


def _draw(fed: SimulatedFederation, sums: SecureSums, rel: PlannedRelease, d: _Draws) -> dict:
    """Draw the noise of ONE planned release (after its charge) and record it; returns
    its published view."""
    return _record(fed, sums, rel, _compute(fed, sums, rel), d)


def _release_round(
    fed: SimulatedFederation, sums: SecureSums, plan: ReleasePlan, approved: Collection[str] | None,
) -> EvaluationOutcome:
    d = _new_draws(evaluation_state(fed))
    for rel in plan.releases:
        if approved is not None and rel.key not in approved:
            d.refused.append(rel)
        else:
            _draw(fed, sums, rel, d)
    return _finalize(fed, sums, d)


def _finalize(fed: SimulatedFederation, sums: SecureSums, d: _Draws) -> EvaluationOutcome:
    """Envelopes of suppressed groups, alerts, merges, bounds, the published report."""
    state = evaluation_state(fed)
    policy = _policy(fed)
    m = sums.min_cohort
    rnd = sums.round
    made, refused, server, envelopes = d.made, d.refused, d.server, d.envelopes
    metrics_pub, health_pub, released, hist_pub = d.metrics, d.health, d.released, d.histogram

    # suppressed / not evaluated groups: suppressed envelopes, so every group has one
    not_evaluated = {
        g: "secure aggregation aborted: fewer than t survivors; region not evaluated this round"
        for g, gs in sums.groups.items() if gs.status == "aborted"
    }
    unpublished = [g for g, gs in sums.groups.items() if g != GLOBAL and gs.status != "ok"]
    for name in SCALAR_METRICS:
        gone = [g for g, gs in sums.groups.items() if gs.status != "ok"]
        for g in gone:
            bv = state.bounds[name]
            envelopes.setdefault(f"{name}/{g}.json", _envelope(
                name, SCALAR_METRICS[name][0], bv.clip_low, 0.0, bv.clip_low, bv.clip_high, 0, m,
                0.95, policy))
    band = suppressed_region_band(len(unpublished)).value
    for name in SCALAR_METRICS:
        metrics_pub[name]["suppressed_regions_band"] = band
        metrics_pub[name]["epsilon_charged"] = max(
            [r.epsilon for r in made if r.name == name and r.region != GLOBAL], default=0.0)
        metrics_pub[name]["composition"] = "parallel (disjoint regions)"
    merged = {g: list(mem) for g, mem in state.merges.groups(fed.partition.region_ids).items()
              if len(mem) > 1}
    if merged:
        for name in SCALAR_METRICS:
            metrics_pub[name]["merged_regions"] = merged
            metrics_pub[name]["granularity_note"] = (
                "merged regions are the finest granularity actually monitored")

    # alerts on published (clamped) numbers, after the baseline round
    alerts: list[Alert] = []
    new_baselines: dict[str, dict[str, str]] = {}
    if rnd >= fed.config.evaluation.baseline_from_round:
        for name, (_, direction) in SCALAR_METRICS.items():
            rule = AlertRule(metric=name, direction=direction)
            label = state.bounds[name].label
            res = rule.evaluate(released[name], state.baselines,
                                partition_version=sums.monitoring_version, bounds_version=label,
                                round=rnd)
            alerts += res.alerts
            nb = dict(res.new_baselines)
            gkey = f"{name}|{GLOBAL}"
            if gkey in server:
                gres = rule.evaluate({GLOBAL: server[gkey]}, state.baselines,
                                     partition_version=fed.partition.version,
                                     bounds_version=label, round=rnd)
                alerts += gres.alerts
                nb.update(gres.new_baselines)
            if nb:
                new_baselines[name] = nb

    # strata over time: below-floor streaks -> monitoring-only merges
    below = [mem for g, gs in sums.groups.items() if g != GLOBAL and gs.status == "below_floor"
             for mem in gs.members]
    newly = state.merges.observe(fed.partition.region_ids, below)
    # bounds over time: re-derive the loss clip bound from the published histogram
    bounds_event = None
    if hist_pub is not None:
        proposal = propose_clip_bound(hist_pub["values"], sums.layout.error_edges)
        cur = state.bounds["mean_loss"]
        nxt = update_bounds(cur, proposal, round=rnd)
        bounds_event = {"proposal": proposal.model_dump(), "from": cur.label, "to": nxt.label,
                        "changed": nxt.version != cur.version}
        state.bounds["mean_loss"] = nxt
    state.evaluations_done += 1

    published: dict[str, Any] = {
        "schema": REPORT_SCHEMA,
        "round": rnd,
        "min_cohort": m,
        "min_cohort_rule": MIN_COHORT_RULE,
        "partition_version": fed.partition.version,
        "monitoring_version": sums.monitoring_version,
        "layout_version": sums.layout.version,
        "metrics": metrics_pub,
        "health": {HEALTH_METRIC: health_pub},
        "suppressed_regions_band": band,
        "not_evaluated": sorted(not_evaluated),
        "newly_merged": {r: state.merges.merged[r] for r in newly},
        "alerts": [a.model_dump() for a in alerts],
        "alerts_fired": len(alerts),
        "new_baselines": new_baselines,
        "releases": [r.to_dict() for r in made],
        "refused_releases": [r.to_dict() for r in refused],
        "epsilon_by_line": ReleasePlan(rnd, tuple(made)).epsilon_by_line(),
        "epsilon_spent": sum(ReleasePlan(rnd, tuple(made)).epsilon_by_line().values()),
    }
    if hist_pub is not None:
        published["error_histogram"] = hist_pub
    if bounds_event is not None:
        published["bounds_update"] = bounds_event
    return EvaluationOutcome(rnd, made, refused, published, envelopes, alerts, not_evaluated,
                             server)


@task(name="evaluate-regions", cache_policy=NO_CACHE, persist_result=False)
def evaluate_regions_task(
    fed: SimulatedFederation,
    submissions: list[DeviceSubmission],
    round_number: int,
    approve: Callable[[ReleasePlan], Collection[str]] | None = None,
) -> EvaluationOutcome:
    """Secure sums per group and global, the release plan, noise once per approved
    release, envelopes, alerts, merges and bound re-derivation (see module docstring).

    Args:
        fed: the federation (its ``evaluation_state`` is read and updated).
        submissions: the devices' quantised reports (:func:`device_reports`).
        round_number: current round.
        approve: optional budget hook: receives the :class:`ReleasePlan` before any
            noise is drawn and returns the keys (:attr:`PlannedRelease.key`) it approves.
    """
    sums = secure_sums(fed, submissions, round_number)
    plan = plan_releases(fed, sums)
    approved = None if approve is None else set(approve(plan))
    return _release_round(fed, sums, plan, approved)


def private_evaluation(
    fed: SimulatedFederation,
    client_ids: Sequence[int],
    round_number: int,
    approve: Callable[[ReleasePlan], Collection[str]] | None = None,
) -> EvaluationOutcome:
    """Run the evaluation path inside a flow: mapped on-device reports, then
    :func:`evaluate_regions_task`."""
    layout = evaluation_state(fed).layout()
    size = fed.config.orchestration.chunk_size
    ids = list(client_ids)
    futures = [
        device_reports_task.submit([fed.clients[c] for c in ids[i:i + size]],
                                   fed.models_for(ids[i:i + size]), fed.spec, layout)
        for i in range(0, len(ids), size)
    ]
    subs = [s for f in futures for s in f.result()]
    return evaluate_regions_task(fed, subs, round_number, approve=approve)


# ----------------------------------------------------------------------------- ledger adapter
# tasks/budget.py charges the ledger per (scope, metric) line entry before any noise:
# it calls planned_releases(fed, round) for the list; for each granted entry
# draw_planned(...) (noise drawn there, after the charge), commits that server-side payload
# into the ledger and records what the ledger holds with restore_planned(...); an entry
# already committed (re-run after a crash or a retry) goes to restore_planned(...) only
# (no noise). The flow then calls finish_evaluation(...) for envelopes, alerts, merges and
# bounds, which therefore cover republished entries exactly like freshly drawn ones.


def _metric_specs(fed: SimulatedFederation) -> dict[str, MetricSpec]:
    """Current specs of the scalar metrics (versioned clip bounds)."""
    state = evaluation_state(fed)
    return {name: state.bounds[name].spec() for name in SCALAR_METRICS}


def planned_releases(fed: SimulatedFederation, round_number: int) -> list[dict[str, Any]]:
    """Ledger-level plan, known before the round's data: one entry per (scope, metric),
    ``name = metric = "<scope>.<metric>"``; a regional entry covers every group at the
    full epsilon (parallel composition). Groups that end up suppressed draw nothing."""
    ev = fed.config.evaluation
    eps_g = ev.global_epsilon if ev.global_epsilon is not None else ev.epsilon
    out = []
    for scope, eps in (("global", eps_g), ("regional", ev.epsilon)):
        for name in SCALAR_METRICS:
            out.append({"name": f"{scope}.{name}", "metric": f"{scope}.{name}", "scope": scope,
                        "epsilon": eps})
        out.append({"name": f"{scope}.{HEALTH_METRIC}", "metric": f"{scope}.{HEALTH_METRIC}",
                    "scope": scope, "epsilon": ev.health_epsilon})
    if _bounds_due(fed):
        out.append({"name": f"global.{HISTOGRAM_METRIC}", "metric": f"global.{HISTOGRAM_METRIC}",
                    "scope": "global", "epsilon": eps_g})
    return out


@dataclass
class _RoundContext:
    round: int
    sums: SecureSums
    plan: ReleasePlan
    draws: _Draws


def _context(fed: SimulatedFederation, client_ids: Sequence[int], round_number: int
             ) -> _RoundContext:
    ctx = getattr(fed, "_evaluation_round", None)
    if ctx is None or ctx.round != round_number:
        ids = sorted(client_ids)
        subs = device_reports([fed.clients[c] for c in ids], fed.models_for(ids), fed.spec,
                              evaluation_state(fed).layout())
        sums = secure_sums(fed, subs, round_number)
        ctx = _RoundContext(round_number, sums, plan_releases(fed, sums),
                            _new_draws(evaluation_state(fed)))
        fed._evaluation_round = ctx  # type: ignore[attr-defined]
    return ctx


def _entry_releases(ctx: _RoundContext, plan: Any) -> list[PlannedRelease]:
    """The planned releases (one per group) of one ledger entry ``<scope>.<metric>``."""
    scope, metric = str(plan.name).split(".", 1)
    return [rel for rel in ctx.plan.releases
            if rel.name == metric and (rel.region == GLOBAL) == (scope == "global")]


def draw_planned(fed: SimulatedFederation, evaluations: Sequence[Any], round_number: int,
                 plan: Any) -> dict[str, Any]:
    """Draw the noise of one granted ledger entry (all its groups) WITHOUT recording it.

    Returns the server-side payload the ledger stores with the entry's commit
    (:data:`STORED_FORMAT`): ``{"format": STORED_FORMAT, "server": {group:
    AggregatedMetric | AggregatedVector as JSON}}``. It holds the exact contributor
    counts: it is server-side state (the ledger), never published or logged. Record it
    with :func:`restore_planned` (the same call re-publishes it after a crash).
    """
    ctx = _context(fed, [e.client_id for e in evaluations], round_number)
    return {"format": STORED_FORMAT,
            "server": {rel.region: _compute(fed, ctx.sums, rel).model_dump(mode="json")
                       for rel in _entry_releases(ctx, plan)}}


def _from_published(rel: PlannedRelease, pub: Mapping[str, Any], g: GroupSum
                    ) -> AggregatedMetric | AggregatedVector:
    """Rebuild a server-side result from a published view stored by an older version
    (``{"releases": {group: published}}``): the exact count is taken from this round's
    secure sums (deterministic for a re-run of the same round) and must fall in the
    stored participant band; the noise scale and exact-n error bar are recomputed from
    the stored parameters. The histogram comes back with its published (clamped) values.
    """
    n = g.selected if rel.name == HEALTH_METRIC else g.contributors
    if participant_band(n, int(pub["min_cohort"])).value != pub["participant_band"]:
        raise ValueError(f"stored release {rel.name}/{rel.region}: the round's contributor "
                         "count does not match the stored participant band")
    level = float(pub["error_bar_level"])
    if rel.name == HISTOGRAM_METRIC:
        scale = noise_scale(float(pub["l1_sensitivity"]), float(pub["epsilon"]))
        return AggregatedVector(
            name=pub["name"], values=[float(v) for v in pub["values"]],
            error_bar=error_bar(scale, level=level, n=n), contributors=n,
            epsilon=float(pub["epsilon"]), l1_sensitivity=float(pub["l1_sensitivity"]),
            noise_scale=scale, level=level, min_cohort=int(pub["min_cohort"]),
            noise_source=pub["noise_source"])
    mech = pub.get("mechanism", "laplace")
    delta = pub.get("delta")
    scale = noise_scale(float(pub["sensitivity"]), float(pub["epsilon"]), mechanism=mech,
                        delta=delta)
    return AggregatedMetric(
        name=pub["name"], value=float(pub["value"]),
        error_bar=error_bar(scale, mechanism=mech, level=level, n=n), contributors=n,
        epsilon=float(pub["epsilon"]), delta=delta, mechanism=mech, noise_scale=scale,
        sensitivity=float(pub["sensitivity"]), clip_low=float(pub["clip_low"]),
        clip_high=float(pub["clip_high"]), level=level, min_cohort=int(pub["min_cohort"]),
        noise_source=pub["noise_source"])


def restore_planned(fed: SimulatedFederation, evaluations: Sequence[Any], round_number: int,
                    plan: Any, stored: Mapping[str, Any]) -> dict[str, Any]:
    """Record one ledger entry's committed results into the round WITHOUT drawing noise.

    ``stored``: the payload of :func:`draw_planned` as committed in the ledger (or, from
    an older version, the published view ``{"releases": {group: published}}``). The
    round's report, envelopes and alert inputs then hold exactly the committed values,
    so :func:`finish_evaluation` publishes the same report as the run that drew them.
    Returns the published view ``{"releases": {group: published}}`` (no counts).

    Raises:
        ValueError: an unknown payload format, or a stored group the round does not
            plan (the re-run's secure sums differ from the committed run's).
    """
    ctx = _context(fed, [e.client_id for e in evaluations], round_number)
    rels = {rel.region: rel for rel in _entry_releases(ctx, plan)}
    if stored.get("format") == STORED_FORMAT:
        items = stored["server"]
    elif "format" not in stored and isinstance(stored.get("releases"), Mapping):
        items = stored["releases"]
    else:
        raise ValueError(f"stored release {plan.name}: unknown stored payload format")
    out: dict[str, Any] = {}
    for region, data in items.items():
        rel = rels.get(region)
        if rel is None:
            raise ValueError(f"stored release {plan.name}: group {region!r} is not planned "
                             "in this round")
        if stored.get("format") == STORED_FORMAT:
            cls = AggregatedVector if rel.name == HISTOGRAM_METRIC else AggregatedMetric
            agg = cls.model_validate(data)
        else:
            agg = _from_published(rel, data, ctx.sums.groups[region])
        out[region] = _record(fed, ctx.sums, rel, agg, ctx.draws)
    return {"releases": out}


def finish_evaluation(fed: SimulatedFederation, client_ids: Sequence[int], round_number: int,
                      budget_view: Mapping[str, Any] | None = None) -> EvaluationOutcome:
    """Close a ledger-driven evaluation round: planned releases not drawn are recorded as
    refused (off cadence / over budget); the ledger's view is attached as ``budget``."""
    ctx = _context(fed, client_ids, round_number)
    drawn = {r.key for r in ctx.draws.made}
    ctx.draws.refused = [r for r in ctx.plan.releases if r.key not in drawn]
    outcome = _finalize(fed, ctx.sums, ctx.draws)
    fed._evaluation_round = None  # type: ignore[attr-defined]
    if budget_view is not None and "budget" in budget_view:
        outcome.published["budget"] = budget_view["budget"]
    return outcome


# ----------------------------------------------------------------------------- logging


def log_evaluation(outcome: EvaluationOutcome, tracker: Any = None, out_dir: str | None = None
                   ) -> None:
    """Write the round's envelopes and alerts (MLflow artifacts and/or the out folder).

    MLflow (``tracker``: :class:`tasks.tracking.FederationTracker`): metrics
    ``eval.global.<metric>`` / ``.error_bar`` and ``alerts_fired`` at step = round;
    artifacts ``envelopes/round_NNN/<metric>/<group>.json`` and ``alerts/round_NNN.json``.
    ``out_dir``: the same files under ``out_dir/envelopes`` and ``out_dir/alerts``.
    Nothing per client: envelopes carry bands, alerts published numbers.
    """
    r = outcome.round
    alerts_doc = {"round": r, "alerts_fired": outcome.alerts_fired,
                  "alerts": [a.model_dump() for a in outcome.alerts]}
    metrics: dict[str, float] = {"alerts_fired": float(outcome.alerts_fired)}
    for name, rep in outcome.published["metrics"].items():
        if rep.get("global"):
            metrics[f"eval.global.{name}"] = rep["global"]["value"]
            metrics[f"eval.global.{name}.error_bar"] = rep["global"]["error_bar"]
    roots: list[Path] = []
    if out_dir:
        roots.append(Path(out_dir))
    tmp = None
    if tracker is not None and not out_dir:
        import tempfile

        tmp = tempfile.TemporaryDirectory(prefix="clma-envelopes-")
        roots.append(Path(tmp.name))
    try:
        for root in roots:
            base = root / "envelopes" / f"round_{r:03d}"
            for rel, text in outcome.envelopes.items():
                p = base / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(text)
            a = root / "alerts" / f"round_{r:03d}.json"
            a.parent.mkdir(parents=True, exist_ok=True)
            a.write_text(json.dumps(alerts_doc, indent=2, sort_keys=True) + "\n")
        if tracker is not None:
            tracker.log_metrics(metrics, step=r)
            tracker.client.log_artifacts(
                tracker.run_id, str(roots[0] / "envelopes" / f"round_{r:03d}"),
                f"envelopes/round_{r:03d}")
            tracker.log_dict(alerts_doc, f"alerts/round_{r:03d}.json")
    finally:
        if tmp is not None:
            tmp.cleanup()
