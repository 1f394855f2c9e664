"""The private evaluation of a round, server side: secure sums, releases, envelopes, alerts.

The server aggregates numbers, it never computes them, and it never sees one client's
metric. One evaluation round, as data (what the server sees in brackets)::

    device   the client computes its 32-value report on its own evaluation data
             (clma.metrics.compute_device_report: accuracy, mean loss with per-example
             loss clipped to [0, L_max], 7-bin error histogram with fixed edges,
             calibration masses, sample-count bucket), clips it and quantises it to
             integers in [0, Q]                                          [nothing]
    secagg   one session per aggregation group (clma.engine.secure_sum over the Clients
             seam): pairwise-masked inputs                 [uniform masked vectors, then
             only the exact integer SUM of the survivors and who survived]
             fewer than the floor -> not unmasked; fewer than t -> aborted
    global   the sum over all groups, by post-processing the group sums (no session of
             its own)
    noise    central (default): Laplace once on each released sum
             (clma.release.aggregate_sum / aggregate_vector_sum), never per client;
             distributed (evaluation.noise): the devices' discrete Gaussian shares are
             already in the accuracy and mean-loss sums, which the server decodes and
             publishes as they are (clma.engine.distributed, clma.privacy.distributed;
             the global value is their sum)                          [noisy sums]
    publish  value clamped to the clip range, error bar from the participant band's
             lower edge, band instead of the count, one closed envelope per release
             (clma.release.build_federated_metric_envelope), suppressed-region count
             as a band only; round-health (dropout rate) through the same path
    alerts   per (metric, group): |now - baseline| > bar_now + bar_base on PUBLISHED
             numbers, baseline per (partition version, bounds version)

No sum below the floor, not even by differencing. The server learns a sum only for the
groups of a PARTITION of the round's participants in which every group has at least ``m``
participants (:func:`aggregation_groups`: a monitored group below the floor is aggregated
with the group of its named neighbour, as the partition file says), so the sets it learns
are disjoint, each at or above the floor, and every difference of unions of them is a
union of them. The global value is the sum of the group sums (post-processing), never a
second secure sum over the same clients. Across rounds, group names, merges and splits, a
client's report is the same unknown wherever it evaluated bit-identical parameters under
the same layout: the server keeps every set it learned a sum over as ``(client, digest)``
elements (:attr:`EvaluationState.learned`; digest of the layout version and the evaluated
parameters, no cohort id or group name) and, before unmasking a new set, checks with
:func:`clma.privacy.differencing.exposed_clients` that no linear combination of all of
them and the new one isolates fewer than m clients; otherwise that session is refused
(status ``refused``, reason ``differencing``) and the round goes on. The set is remembered
when unmasking is allowed, before the sum is known; with a state folder it is first made
durable in a write-ahead journal (:meth:`PrivateEvaluator.attach_journal`), so a crash
before the round's commit forgets nothing. Every set of clients whose sum the
server learned is listed in :attr:`SecureSums.audit` with its digests (``models``; written
to the server's state folder as ``audit/secure_sums_round_NNN.json``, server-internal,
never published).

Cohort floor: ``m = max(config.evaluation.min_cohort, policy.evaluation.minimum_group_size)``
(the envelope refuses a minimum group size below the policy floor, so a config asking for
less is raised to it; recorded in every report as ``min_cohort`` and ``min_cohort_rule``).
The policy is the federation's configured one (``budget.policy``), passed explicitly.

Releases. Every noise draw is one :class:`PlannedRelease` (metric, group or ``"global"``,
mechanism, epsilon, budget line); :meth:`PrivateEvaluator.plan` lists them BEFORE any noise
is drawn from the round's :class:`SecureSums`. The ledger path
(:mod:`clma.engine.budget`) charges per (scope, metric) line entry and then draws
(:meth:`PrivateEvaluator.draw`) or re-records a committed payload
(:meth:`PrivateEvaluator.restore`) into an :class:`EvaluationRound`;
:meth:`PrivateEvaluator.finish` closes the round (suppressed envelopes, alerts, monitoring
merges, clip-bound re-derivation, the published report). Groups are disjoint, so every
group spends the full regional epsilon (parallel composition). In distributed mode with
the ledger, the noised releases are charged before :meth:`PrivateEvaluator.secure_sums`
(:func:`clma.engine.budget.charge_distributed`), whose ``unmask`` names the charged
metrics: the server never unmasks a noisy sum the ledger has not charged.

State across rounds: :class:`EvaluationState` (alert baselines, merge tracker, clip-bound
versions, evaluation count) in ``ServerState.evaluation``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import secrets
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from clma.budget.policy import PrivacyPolicy
from clma.config import FederationConfig
from clma.engine.clients import Clients, ReportRequest, SecAggSession
from clma.engine.distributed import NOISED_METRICS, GroupNoise, group_noise
from clma.engine.secure_sum import run_sessions
from clma.engine.state import ServerState
from clma.metrics import DeviceMetricLayout
from clma.privacy.differencing import exposed_clients
from clma.privacy.distributed import MECHANISM as DDG
from clma.privacy.distributed import MECHANISM_VERSION as DDG_VERSION
from clma.privacy.distributed import decode_sum
from clma.privacy.mechanisms import Mechanism, NoiseSource, error_bar, noise_scale
from clma.privacy.secagg import FixedPointQuantiser, SecAggConfig, secagg_plus_parameters
from clma.regions import RegionPartition
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

__all__ = [
    "GLOBAL",
    "HEALTH_METRIC",
    "HISTOGRAM_METRIC",
    "LINE_GLOBAL",
    "LINE_REGIONAL",
    "QUANTISATION_LEVELS",
    "SCALAR_METRICS",
    "STORED_FORMAT",
    "EvaluationOutcome",
    "EvaluationRound",
    "EvaluationState",
    "GroupSum",
    "PlannedRelease",
    "PrivateEvaluator",
    "ReleasePlan",
    "SecureSums",
]

GLOBAL = "global"
REPORT_SCHEMA = "clma.evaluation/1"
LINE_GLOBAL = "evaluation.global"
LINE_REGIONAL = "evaluation.regional"
#: Scalar metrics released per group: envelope kind and alert direction.
SCALAR_METRICS: dict[str, tuple[str, str]] = {
    "accuracy": ("rate", "decrease"),
    "mean_loss": ("bounded_mean", "increase"),
}
HEALTH_METRIC = "health.dropout_rate"
HISTOGRAM_METRIC = "error_histogram"
MIN_COHORT_RULE = "max(config evaluation.min_cohort, policy evaluation.minimum_group_size)"
#: Format of the server-side payload a ledger entry stores (:meth:`PrivateEvaluator.draw`).
STORED_FORMAT = "clma.evaluation.server/2"
#: Fixed-point levels Q of the on-device quantiser.
QUANTISATION_LEVELS = 2**16 - 1


# ----------------------------------------------------------------------------- state


class EvaluationState(BaseModel):
    """What the evaluation path keeps between rounds (JSON-serialisable).

    Attributes:
        baselines: alert baselines keyed ``"metric|group"`` (published numbers only).
        merges: monitoring-only region merges and below-floor streaks.
        bounds: metric name -> current versioned clip bounds.
        evaluations_done: number of evaluation rounds run so far.
        learned: every set whose sum the server allowed to be unmasked, across rounds:
            ``{"round", "group", "session", "models": {digest: [client ids]}}``
            (the differencing rule's memory; server-internal, never published).
        last_sums: read from folders written before ``learned`` existed; not used.
    """

    model_config = ConfigDict(extra="forbid")

    baselines: AlertBaselines = Field(default_factory=AlertBaselines)
    merges: RegionMergeTracker
    bounds: dict[str, BoundsVersion]
    evaluations_done: int = Field(default=0, ge=0)
    learned: list[dict[str, Any]] = Field(default_factory=list)
    last_sums: dict[str, dict[str, str]] = Field(default_factory=dict)

    def learned_sets(self) -> list[set[tuple[int, str]]]:
        """:attr:`learned` as sets of ``(client, digest)`` elements."""
        return [{(int(c), d) for d, cs in e["models"].items() for c in cs}
                for e in self.learned]

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvaluationState:
        return cls.model_validate(dict(data))

    def layout(self) -> DeviceMetricLayout:
        """The on-device layout in force (``l_max`` = current mean-loss clip bound)."""
        b = self.bounds["mean_loss"]
        return DeviceMetricLayout(l_max=b.clip_high, version=f"1+{b.label}")


# ----------------------------------------------------------------------------- data


@dataclass(frozen=True)
class GroupSum:
    """Server-side result of one group's secure aggregation (never published as is).

    ``status``: ``ok`` (sum available), ``below_floor`` (fewer than m selected or
    surviving clients: nothing released), ``aborted`` (fewer than t survivors: the group
    is not evaluated this round), ``refused`` (the differencing rule), ``not_unmasked``
    (distributed mode: no noised release was charged, so no session was formed).
    ``sum`` is the de-quantised float64 ``(32,)`` sum over the contributors (None unless
    ok). ``noised`` (distributed mode): the metrics whose noisy sums the session carried
    (the other coordinates are 0).
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
    noise: GroupNoise | None = None
    noised: tuple[str, ...] = ()


@dataclass
class SecureSums:
    """All aggregation groups of one evaluation round, plus ``"global"`` (their sum).

    ``audit``: every set of clients whose exact sum the server learned this round
    (``{"group", "session", "clients": [ids], "status"}``; server-internal).
    ``below_alone``: monitored groups below the floor on their own this round (aggregated
    with a neighbour or not evaluated).
    """

    round: int
    min_cohort: int
    groups: dict[str, GroupSum]
    layout: DeviceMetricLayout
    monitoring_version: str
    audit: list[dict[str, Any]] = field(default_factory=list)
    below_alone: list[str] = field(default_factory=list)


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


@dataclass
class EvaluationOutcome:
    """Everything one evaluation round produced.

    Attributes:
        round: round number.
        releases: releases made (noise drawn) — the ledger charges exactly these.
        refused: planned releases not drawn (refused by the ledger, off cadence).
        published: the JSON-able published report (no exact counts, no client ids).
        envelopes: relative path ``<metric>/<group>.json`` -> canonical envelope JSON.
        alerts: fired alerts (published numbers only).
        not_evaluated: group -> reason (secure aggregation aborted below t).
        server: server-side results (exact contributors; NEVER published or logged).
        audit: the sets of clients whose sums the server learned (:attr:`SecureSums.audit`;
            server-internal, NEVER published).
    """

    round: int
    releases: list[PlannedRelease]
    refused: list[PlannedRelease]
    published: dict[str, Any]
    envelopes: dict[str, str]
    alerts: list[Alert]
    not_evaluated: dict[str, str]
    server: dict[str, AggregatedMetric | AggregatedVector] = field(default_factory=dict)
    audit: list[dict[str, Any]] = field(default_factory=list)

    @property
    def alerts_fired(self) -> int:
        return len(self.alerts)


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


@dataclass
class EvaluationRound:
    """One evaluation round in progress: its secure sums, its plan, its draws so far."""

    round: int
    sums: SecureSums
    plan: ReleasePlan
    draws: _Draws


# ----------------------------------------------------------------------------- helpers


def _clamped(m: AggregatedMetric) -> AggregatedMetric:
    """Post-processing: the published value is clamped to the clip range."""
    return m.model_copy(update={"value": float(np.clip(m.value, m.clip_low, m.clip_high))})


def _envelope(name: str, kind: str, value: float, bar: float, lo: float, hi: float, n: int,
              m: int, level: float, policy: PrivacyPolicy, mechanism: str = "laplace") -> str:
    v = float(np.clip(value, lo, hi))
    if n < m:  # suppressed envelope: the builder nulls value and interval
        return build_federated_metric_envelope(
            metric_id=name, metric_kind=kind, aggregate_value=lo, clipping_lower_bound=lo,
            clipping_upper_bound=hi, privacy_mechanism=mechanism,
            privacy_mechanism_version=policy.mechanism_version(mechanism),
            participant_count=n, minimum_group_size=m, policy=policy,
        ).to_json()
    return build_federated_metric_envelope(
        metric_id=name, metric_kind=kind, aggregate_value=v, clipping_lower_bound=lo,
        clipping_upper_bound=hi, privacy_mechanism=mechanism,
        privacy_mechanism_version=policy.mechanism_version(mechanism), participant_count=n,
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


def aggregation_groups(monitored: Mapping[str, Sequence[str]], participants: Mapping[str, int],
                       neighbours: Mapping[str, str], floor: int) -> dict[str, tuple[str, ...]]:
    """Partition of the monitored groups into aggregation groups of >= ``floor``
    participants each (the rule of the module docstring).

    Args:
        monitored: monitored group name -> its regions (a partition of the regions).
        participants: region -> participating clients this round.
        neighbours: region -> the neighbour the partition file names.
        floor: the cohort floor m.

    While some group has between 1 and ``floor - 1`` participants and another group has
    participants, the smallest such group (fewest participants, then name) joins the
    group holding the named neighbour of its first region (sorted) that lies in another
    group with participants, else the smallest other group with participants. Groups
    without participants are kept as they are (nothing is summed for them); a single
    remaining group below the floor is left below it (nothing is summed). Names join the
    sorted member regions with ``+``. Deterministic.
    """
    groups: dict[str, set[str]] = {g: set(m) for g, m in monitored.items()}
    owner = {r: g for g, m in groups.items() for r in m}

    def count(g: str) -> int:
        return sum(int(participants.get(r, 0)) for r in groups[g])

    while True:
        live = [g for g in groups if count(g) > 0]
        small = sorted((g for g in live if count(g) < floor), key=lambda g: (count(g), g))
        if not small or len(live) < 2:
            break
        g = small[0]
        target = None
        for r in sorted(groups[g]):
            nb = neighbours.get(r)
            h = owner.get(nb) if nb is not None else None
            if h is not None and h != g and count(h) > 0:
                target = h
                break
        if target is None:
            target = min((h for h in live if h != g), key=lambda h: (count(h), h))
        groups[target] |= groups.pop(g)
        for r in groups[target]:
            owner[r] = target
    return {"+".join(sorted(m)): tuple(sorted(m)) for m in groups.values()}


def _digest(parts: Sequence[bytes]) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


# ----------------------------------------------------------------------------- evaluator


class PrivateEvaluator:
    """The evaluation path of one federation (module docstring).

    Args:
        config: the federation config (``evaluation`` section, ``seed``).
        partition: the public region partition.
        policy: the configured privacy policy (floor, mechanism versions).
        state: the server state; ``state.evaluation`` is created on first use.

    Raises:
        ValueError: a region of the partition is named ``"global"``.
    """

    def __init__(self, config: FederationConfig, partition: RegionPartition,
                 policy: PrivacyPolicy, state: ServerState) -> None:
        if GLOBAL in partition.region_ids:
            raise ValueError(f"region partition: a region may not be named {GLOBAL!r}")
        self.config = config
        self.partition = partition
        self.policy = policy
        self.server_state = state
        #: ``entry -> None``: makes a learned set durable before its sum is unmasked
        #: (:meth:`attach_journal`); raising refuses the session. None: memory only.
        self.on_learned: Callable[[Mapping[str, Any]], None] | None = None

    def attach_journal(self, append: Callable[[Mapping[str, Any]], None],
                       entries: Sequence[Mapping[str, Any]]) -> int:
        """Keep the differencing rule's memory in a write-ahead journal: ``entries``
        (what the journal holds, e.g. sets learned in an attempt that crashed before its
        commit) join :attr:`EvaluationState.learned`, and every new set is passed to
        ``append`` before its sum is unmasked. Returns the number of entries added."""
        have = {json.dumps(e, sort_keys=True) for e in self.state.learned}
        added = 0
        for e in entries:
            key = json.dumps(dict(e), sort_keys=True)
            if key not in have:
                have.add(key)
                self.state.learned.append(dict(e))
                added += 1
        self.on_learned = append
        return added

    # ---------------------------------------------------------------- state
    @property
    def state(self) -> EvaluationState:
        """The evaluation state in force, created on first use (initial bounds from the
        config)."""
        st = self.server_state.evaluation
        if st is None:
            st = EvaluationState(
                merges=RegionMergeTracker(
                    neighbours=self.partition.neighbours,
                    consecutive_required=self.config.evaluation.merge_after,
                ),
                bounds={
                    "accuracy": BoundsVersion(metric="accuracy", clip_low=0.0, clip_high=1.0,
                                              version=1),
                    "mean_loss": BoundsVersion(metric="mean_loss", clip_low=0.0,
                                               clip_high=self.config.evaluation.loss_max,
                                               version=1),
                },
            )
            self.server_state.evaluation = st
        return st

    @property
    def min_cohort(self) -> int:
        """``max(config.evaluation.min_cohort, policy.evaluation.minimum_group_size)``."""
        return max(self.config.evaluation.min_cohort, self.policy.evaluation.minimum_group_size)

    def metric_specs(self) -> dict[str, MetricSpec]:
        """Current specs of the scalar metrics (versioned clip bounds)."""
        return {name: self.state.bounds[name].spec() for name in SCALAR_METRICS}

    def bounds_due(self) -> bool:
        """Whether this evaluation re-derives the loss clip bound (histogram release)."""
        k = self.config.evaluation.bounds_every
        return k > 0 and (self.state.evaluations_done + 1) % k == 0

    # ---------------------------------------------------------------- secure sums
    def session_config(self, name: str, members: Sequence[int], round_number: int,
                       dim: int, metrics: Sequence[str] = NOISED_METRICS
                       ) -> SecAggConfig | None:
        """The secure-aggregation parameters of one group (None: no safe parameters).

        Degree k and threshold t come from the group size and the configured assumptions
        (``evaluation.secagg_corrupted_fraction``, ``secagg_dropout_fraction``,
        ``secagg_statistical_security``, ``secagg_correctness``) by
        :func:`clma.privacy.secagg.secagg_plus_parameters` (Bell et al. 2020). The dropouts
        tolerated are at most what the cohort floor allows (a sum over fewer than m
        clients is never unmasked: clients refuse it, ``min_survivors = m``). The graph
        seed is HMAC-SHA256 of (round, group) under the server's secret key (32 bytes from
        ``secrets``, kept in the state folder, ``ServerState.selection_key``), never derived
        from the published federation seed -- except with seeded noise (experiments and tests,
        labelled not private), where it is derived from (seed, round, group) so that a
        simulation with dropouts is reproducible. ``metrics`` (distributed mode): the
        noised metrics the session carries (their coordinates get the devices' shares;
        every other coordinate is sent as 0).
        """
        ev = self.config.evaluation
        n, m = len(members), self.min_cohort
        delta = ev.secagg_dropout_fraction
        if n - math.ceil(delta * n) < m:
            delta = max(0.0, (n - m) / n * (1.0 - 1e-9))  # ceil(delta n) <= n - m
        noise = self.group_noise(n, dim, metrics) if self.distributed else None
        if self.distributed and noise is None:
            return None
        extra: dict[str, Any] = {}
        if noise is not None:  # distributed DP: ring, survivor floor and share per group
            delta = noise.dropout_fraction
            extra = {"modulus_bits": noise.modulus_bits, "noise": noise.share()}
        try:
            p = secagg_plus_parameters(
                n, corrupted_fraction=ev.secagg_corrupted_fraction, dropout_fraction=delta,
                statistical_security=ev.secagg_statistical_security,
                correctness=ev.secagg_correctness)
            return SecAggConfig(
                n_clients=n, threshold=p.threshold, vector_length=dim,
                quantisation_levels=QUANTISATION_LEVELS,
                neighbour_degree=None if p.degree >= n - 1 else p.degree,
                round_id=f"eval-{round_number}-{name}", graph_seed=(
                    region_seed(self.config.seed * 1000 + round_number, name) % 2**63
                    if ev.noise_seeded else self._graph_seed(round_number, name)),
                corrupted_fraction=ev.secagg_corrupted_fraction, dropout_fraction=delta,
                statistical_security=ev.secagg_statistical_security,
                correctness=ev.secagg_correctness,
                min_survivors=noise.min_survivors if noise is not None else max(m, 2),
                client_ids=tuple(sorted(int(c) for c in members)), **extra)
        except ValueError:
            return None

    def _graph_seed(self, round_number: int, name: str) -> int:
        """HMAC-SHA256(server secret, round, group) as a 63-bit graph seed: as unpredictable
        as a fresh CSPRNG draw to anyone without the server's state folder, and the same
        for a re-run of the round from durable state, so that a resumed round re-sends the
        exact request the devices already answered (a fresh draw made every resumed
        exchange differ from the recorded one: devices refused it and the round's
        evaluation was lost)."""
        st = self.server_state
        if st.selection_key is None:
            st.selection_key = secrets.token_bytes(32)
        digest = hmac.new(st.selection_key, f"clma-secagg-graph|{round_number}|{name}".encode(),
                          hashlib.sha256).digest()
        return int.from_bytes(digest[:8], "little") % 2**63

    @property
    def distributed(self) -> bool:
        """``evaluation.noise == "distributed"``: noise shares added on the devices."""
        return self.config.evaluation.noise == "distributed"

    def group_noise(self, n: int, dim: int, metrics: Sequence[str] = NOISED_METRICS
                    ) -> GroupNoise | None:
        """The distributed-noise parameters of a group of n (:mod:`clma.engine.distributed`)
        noising the coordinates of ``metrics`` (a subset of ``NOISED_METRICS``)."""
        ev = self.config.evaluation
        layout = self.state.layout()
        unknown = sorted(set(metrics) - set(NOISED_METRICS))
        if unknown or not metrics:
            raise ValueError(f"metrics: must be a non-empty subset of {NOISED_METRICS}")
        coords = tuple(i for name in NOISED_METRICS if name in metrics
                       for i in range(*layout.slices[name].indices(dim)))
        return group_noise(n, epsilon=ev.epsilon, delta=ev.delta,
                           dropout_fraction=ev.secagg_dropout_fraction,
                           corrupted_fraction=ev.secagg_corrupted_fraction,
                           floor=self.min_cohort, levels=QUANTISATION_LEVELS,
                           security=ev.secagg_statistical_security, coordinates=coords)

    def _grouping(self, participants: Sequence[int], region_of: Mapping[int, str]
                  ) -> tuple[list[int], list[str], dict[str, tuple[str, ...]],
                             dict[str, list[int]]]:
        """Sorted ids, monitored groups below the floor alone, the aggregation groups and
        each group's clients (no client is contacted)."""
        m = self.min_cohort
        ids = sorted(int(c) for c in participants)
        monitored = self.state.merges.groups(self.partition.region_ids)
        per_region: dict[str, int] = {}
        for c in ids:
            per_region[region_of[c]] = per_region.get(region_of[c], 0) + 1
        below_alone = sorted(g for g, mem in monitored.items()
                             if 0 < sum(per_region.get(r, 0) for r in mem) < m)
        groups = aggregation_groups(monitored, per_region, self.partition.neighbours, m)
        clients_of = {g: [c for c in ids if region_of[c] in mem] for g, mem in groups.items()}
        return ids, below_alone, groups, clients_of

    def session_groups(self, round_number: int, participants: Sequence[int],
                       region_of: Mapping[int, str]) -> tuple[str, ...]:
        """The aggregation groups a secure-aggregation session would be formed for this
        round (at least ``max(m, 2)`` participants and safe parameters), known before any
        client is contacted: in distributed mode, the groups the ledger charges before
        secure aggregation (:func:`clma.engine.budget.charge_distributed`)."""
        layout = self.state.layout()
        dim = FixedPointQuantiser(layout.lower_bounds(), layout.upper_bounds()).dim
        _, _, _, clients_of = self._grouping(participants, region_of)
        return tuple(g for g, cs in sorted(clients_of.items())
                     if len(cs) >= max(self.min_cohort, 2)
                     and self.session_config(g, cs, round_number, dim) is not None)

    def secure_sums(self, clients: Clients, round_number: int, participants: Sequence[int],
                    region_of: Mapping[int, str], assignments: Mapping[int, int],
                    models: Mapping[int, np.ndarray], *,
                    unmask: Collection[str] | None = None) -> SecureSums:
        """Secure aggregation over a partition of the participants into groups at or
        above the floor (:func:`aggregation_groups`), through the ``Clients`` seam; the
        global sum by post-processing (module docstring).

        Args:
            clients: the transport.
            round_number: the round.
            participants: the client ids evaluated this round.
            region_of: client id -> region (public partition).
            assignments: client id -> cohort whose model it evaluates.
            models: cohort id -> float32 model vector.
            unmask: distributed mode only: the noised metrics whose release the ledger
                charged before this call (None: all of them, no ledger). Sessions carry
                only these metrics' coordinates; with none, no session is formed and
                every group that would have had one gets status ``not_unmasked``
                (nothing is sent to or asked of its clients).

        Raises:
            ValueError: ``unmask`` given in central mode, or naming an unknown metric.
        """
        state = self.state
        layout = state.layout()
        m = self.min_cohort
        dim = FixedPointQuantiser(layout.lower_bounds(), layout.upper_bounds()).dim
        if unmask is not None and not self.distributed:
            raise ValueError("unmask: only in distributed mode (evaluation.noise)")
        metrics = tuple(NOISED_METRICS if unmask is None
                        else [n for n in NOISED_METRICS if n in set(unmask)])
        if unmask is not None and set(unmask) - set(NOISED_METRICS):
            raise ValueError(f"unmask: must be a subset of {NOISED_METRICS}")
        ids, below_alone, groups, clients_of = self._grouping(participants, region_of)
        not_unmasked: set[str] = set()
        sessions: dict[str, SecAggSession] = {}
        no_parameters: set[str] = set()
        name_of: dict[str, str] = {}
        thresholds: dict[str, int] = {}
        noise_of: dict[str, GroupNoise] = {}
        # a client's report is one unknown per (layout, parameters): no cohort id, no name
        param_digest = {int(k): _digest([layout.version.encode(), np.ascontiguousarray(
            models[k], dtype="<f4").tobytes()]) for k in {int(assignments[c]) for c in ids}}
        for g, cs in sorted(clients_of.items()):
            if len(cs) < max(m, 2):
                continue
            cfg = self.session_config(g, cs, round_number, dim, metrics or NOISED_METRICS)
            if cfg is None:
                no_parameters.add(g)
                continue
            if not metrics:  # distributed, nothing charged: the session is never formed
                not_unmasked.add(g)
                continue
            sessions[cfg.round_id] = SecAggSession(cfg.round_id, cfg, tuple(cs))
            name_of[cfg.round_id] = g
            thresholds[g] = cfg.threshold
            if cfg.noise is not None:
                gn = self.group_noise(len(cs), dim, metrics)
                assert gn is not None
                noise_of[g] = gn

        def by_digest(members: Collection[int]) -> dict[str, list[int]]:
            out: dict[str, list[int]] = {}
            for c in sorted(int(x) for x in members):
                out.setdefault(param_digest[int(assignments[c])], []).append(c)
            return out

        known = state.learned_sets()

        def may_unmask(sid: str, survivors: frozenset[int]) -> str | None:
            new = {(int(c), param_digest[int(assignments[c])]) for c in survivors}
            if exposed_clients([*known, new], m, touching=new) is not None:
                return ("differencing: with the sums learned before, a linear combination "
                        "would isolate fewer than the floor's clients")
            entry = {"round": int(round_number), "group": name_of[sid], "session": sid,
                     "models": by_digest(survivors)}
            if self.on_learned is not None:
                try:  # durable before the sum is known (write-ahead)
                    self.on_learned(entry)
                except OSError:
                    return "journal: the learned set could not be recorded durably"
            known.append(new)
            state.learned.append(entry)
            return None

        results = {}
        if sessions:
            request = ReportRequest(
                round=round_number, assignments={c: int(assignments[c]) for c in ids},
                models={k: models[k] for k in sorted({int(assignments[c]) for c in ids})},
                layout=layout, quantisation_levels=QUANTISATION_LEVELS, sessions=sessions)
            results = {name_of[s]: r for s, r in
                       run_sessions(clients, request, floor=m, may_unmask=may_unmask).items()}
        quant = FixedPointQuantiser(layout.lower_bounds(), layout.upper_bounds(),
                                    QUANTISATION_LEVELS)
        out: dict[str, GroupSum] = {}
        audit: list[dict[str, Any]] = []
        total_q = np.zeros(dim, dtype=np.int64 if self.distributed else np.uint64)
        total_n = 0
        sel = drop = 0
        for g in sorted(clients_of):
            n = len(clients_of[g])
            res = results.get(g)
            if g in not_unmasked:  # no session: nothing observed, not in the health counts
                out[g] = GroupSum(g, groups[g], n, 0, "not_unmasked")
                continue
            sel += n
            if res is None:
                out[g] = GroupSum(g, groups[g], n, 0,
                                  "aborted" if g in no_parameters else "below_floor")
                continue
            drop += len(res.dropped)
            if res.summed is not None:
                audit.append({"group": g, "session": res.session_id,
                              "clients": sorted(res.summed), "status": res.status,
                              "models": by_digest(res.summed)})
            t = thresholds[g]
            if res.status != "ok":
                out[g] = GroupSum(g, groups[g], n, len(res.dropped), res.status, threshold=t)
                continue
            gn = noise_of.get(g)
            q_sum = (res.sum_quantised if gn is None else  # the noisy sum, centred decoding
                     decode_sum(res.sum_quantised, gn.modulus_bits, n, QUANTISATION_LEVELS))
            out[g] = GroupSum(g, groups[g], n, len(res.dropped), "ok",
                              contributors=res.contributors,
                              sum=quant.dequantise_sum(q_sum, res.contributors),
                              sum_quantised=q_sum, threshold=t, noise=gn,
                              noised=metrics if gn is not None else ())
            total_q = total_q + np.asarray(q_sum, dtype=total_q.dtype)
            total_n += res.contributors
        if total_n >= m:
            # distributed: the global noise is the sum of every group's shares; its bar
            # uses the largest per-client sigma (conservative)
            gnoise = (max((out[g].noise for g in out if out[g].noise is not None
                           and out[g].status == "ok"), key=lambda x: x.sigma, default=None)
                      if self.distributed else None)
            out[GLOBAL] = GroupSum(GLOBAL, (GLOBAL,), sel, drop, "ok", contributors=total_n,
                                   sum=quant.dequantise_sum(total_q, total_n),
                                   sum_quantised=total_q, noise=gnoise,
                                   noised=metrics if self.distributed else ())
        else:
            out[GLOBAL] = GroupSum(GLOBAL, (GLOBAL,), sel, drop, "below_floor")
        return SecureSums(round_number, m, out, layout,
                          state.merges.monitoring_version(self.partition.version),
                          audit=audit, below_alone=below_alone)

    # ---------------------------------------------------------------- plan
    def plan(self, sums: SecureSums) -> ReleasePlan:
        """The releases of this round (groups with status ``ok``; health wherever at
        least m clients were selected)."""
        ev = self.config.evaluation
        eps_g = ev.global_epsilon if ev.global_epsilon is not None else ev.epsilon
        out: list[PlannedRelease] = []
        for gname, g in sorted(sums.groups.items()):
            line = LINE_GLOBAL if gname == GLOBAL else LINE_REGIONAL
            eps = eps_g if gname == GLOBAL else ev.epsilon
            if g.status in ("ok", "not_unmasked") and self.distributed:
                # the devices' noise is in the sums; the global is their sum (post-processing,
                # charged nothing); the ring's wrap bound is added to delta
                wrap = 2.0 ** -ev.secagg_statistical_security
                for name in SCALAR_METRICS:
                    out.append(PlannedRelease(
                        name, gname, DDG, 0.0 if gname == GLOBAL else ev.epsilon,
                        None if gname == GLOBAL else ev.delta + wrap, line, sums.round))
            elif g.status == "ok":
                for name in SCALAR_METRICS:
                    out.append(PlannedRelease(name, gname, "laplace", eps, None, line, sums.round))
                if gname == GLOBAL and self.bounds_due():
                    out.append(PlannedRelease(HISTOGRAM_METRIC, gname, "laplace", eps, None,
                                              line, sums.round))
            if g.selected >= sums.min_cohort and g.status != "not_unmasked":
                out.append(PlannedRelease(HEALTH_METRIC, gname, "laplace", ev.health_epsilon,
                                          None, line, sums.round))
        return ReleasePlan(sums.round, tuple(out))

    def open_round(self, sums: SecureSums) -> EvaluationRound:
        """An :class:`EvaluationRound` with its plan and no draws yet."""
        d = _Draws()
        d.metrics = {name: {"regions": {}, "global": None,
                            "bounds_version": self.state.bounds[name].label}
                     for name in SCALAR_METRICS}
        d.released = {name: {} for name in SCALAR_METRICS}
        return EvaluationRound(sums.round, sums, self.plan(sums), d)

    # ---------------------------------------------------------------- draws
    def _seed(self, round_number: int, key: str) -> int | None:
        if not self.config.evaluation.noise_seeded:
            return None
        base = int(np.random.default_rng([self.config.seed, round_number, 101]).integers(2**31))
        return region_seed(base, key)

    def compute(self, sums: SecureSums, rel: PlannedRelease) -> AggregatedMetric | AggregatedVector:
        """Draw the noise of ONE planned release (after its charge): the server-side
        result (exact contributor count inside; never published). Records nothing."""
        state = self.state
        m = sums.min_cohort
        slices = sums.layout.slices
        g = sums.groups[rel.region]
        seed = self._seed(sums.round, f"{rel.name}|{rel.region}")
        if rel.name in SCALAR_METRICS and self.distributed:
            return _clamped(self._distributed_metric(sums, rel))
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
        dspec = MetricSpec(HEALTH_METRIC, 0.0, 1.0)  # dropout rate over selected clients
        return _clamped(aggregate_sum(float(g.dropped), g.selected, dspec,
                                      epsilon=rel.epsilon, min_cohort=m, seed=seed))

    def _distributed_metric(self, sums: SecureSums, rel: PlannedRelease) -> AggregatedMetric:
        """A scalar release of a group (or the global post-processing) in distributed
        mode: the decoded noisy sum over n, no noise drawn here; bar exact for n shares of
        the group's sigma (the global: the largest sigma of its groups)."""
        g = sums.groups[rel.region]
        spec = self.state.bounds[rel.name].spec()
        gn = g.noise
        if gn is None:
            raise ValueError(f"release {rel.name}/{rel.region}: no distributed noise in its sum")
        n = g.contributors
        s = float(np.clip(g.sum[sums.layout.slices[rel.name]][0], n * spec.clip_low,
                          n * spec.clip_high))
        quantum = spec.sensitivity / QUANTISATION_LEVELS
        agg = AggregatedMetric(
            name=rel.name, value=s / n, error_bar=0.0, contributors=n, epsilon=rel.epsilon,
            delta=rel.delta, mechanism=Mechanism.DISTRIBUTED_DISCRETE_GAUSSIAN,
            noise_scale=gn.sigma * quantum, sensitivity=spec.sensitivity,
            clip_low=spec.clip_low, clip_high=spec.clip_high, min_cohort=sums.min_cohort,
            noise_source=NoiseSource.OPENDP, rho=gn.rho, quantum=quantum,
            honest_floor=gn.honest_floor,
            wrap_probability=2.0 ** -self.config.evaluation.secagg_statistical_security)
        return agg.model_copy(update={"error_bar": agg.bar_at(n)})

    def record(self, ev: EvaluationRound, rel: PlannedRelease,
               agg: AggregatedMetric | AggregatedVector) -> dict:
        """Record ONE release's server-side result into the round (published view,
        envelopes, alert inputs, health, histogram); draws no noise. Everything recorded
        is a function of ``agg`` (its exact count only through the participant band), so a
        result restored from the ledger records exactly what the original draw recorded.
        Returns the release's published view."""
        state, policy, d, sums = self.state, self.policy, ev.draws, ev.sums
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
                agg.clip_low, agg.clip_high, agg.contributors, m, agg.level, policy,
                agg.mechanism.value)
        elif rel.name == HISTOGRAM_METRIC:
            pub = agg.to_published_dict()
            pub["values"] = [float(np.clip(v, 0.0, 1.0)) for v in agg.values]
            pub["edges"] = list(sums.layout.error_edges)
            d.histogram = pub
            for i, v in enumerate(pub["values"]):
                d.envelopes[f"{HISTOGRAM_METRIC}.b{i}/{rel.region}.json"] = _envelope(
                    f"{HISTOGRAM_METRIC}.b{i}", "rate", v, agg.published_error_bar, 0.0, 1.0,
                    agg.contributors, m, agg.level, policy)
        else:
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

    def releases_of(self, ev: EvaluationRound, entry_name: str) -> list[PlannedRelease]:
        """The planned releases (one per group) of one ledger entry ``<scope>.<metric>``."""
        scope, metric = str(entry_name).split(".", 1)
        return [rel for rel in ev.plan.releases
                if rel.name == metric and (rel.region == GLOBAL) == (scope == "global")]

    def draw(self, ev: EvaluationRound, entry_name: str) -> dict[str, Any]:
        """Draw the noise of one granted ledger entry (all its groups) WITHOUT recording
        it. Returns the server-side payload the ledger stores with the entry's commit
        (:data:`STORED_FORMAT`): ``{"format": STORED_FORMAT, "server": {group:
        AggregatedMetric | AggregatedVector as JSON}}``; it holds exact contributor counts:
        server-side state, never published or logged. Record it with :meth:`restore`."""
        return {"format": STORED_FORMAT,
                "server": {rel.region: self.compute(ev.sums, rel).model_dump(mode="json")
                           for rel in self.releases_of(ev, entry_name)
                           if self.has_sum(ev.sums, rel)}}

    def has_sum(self, sums: SecureSums, rel: PlannedRelease) -> bool:
        """Whether the release has a sum to publish: always in central mode (the plan
        lists only groups with a sum); in distributed mode a charged group lost to
        dropouts, whose session was not formed, or whose session did not carry the metric
        (an entry reused from a crashed attempt) has none (it stays charged; nothing is
        drawn)."""
        g = sums.groups[rel.region]
        return (not self.distributed or rel.name not in SCALAR_METRICS
                or (g.status == "ok" and rel.name in g.noised))

    def _from_published(self, rel: PlannedRelease, pub: Mapping[str, Any], g: GroupSum
                        ) -> AggregatedMetric | AggregatedVector:
        """Rebuild a server-side result from a published view stored by an older version
        (``{"releases": {group: published}}``): the exact count is taken from this round's
        secure sums and must fall in the stored participant band; the noise scale and
        exact-n error bar are recomputed from the stored parameters."""
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

    def restore(self, ev: EvaluationRound, entry_name: str, stored: Mapping[str, Any]
                ) -> dict[str, Any]:
        """Record one ledger entry's committed results into the round WITHOUT drawing
        noise (a fresh draw committed first, or a re-run after a crash). ``stored``: the
        payload of :meth:`draw` (or, from an older version, the published view
        ``{"releases": {group: published}}``). Returns ``{"releases": {group:
        published}}`` (no counts).

        Raises:
            ValueError: an unknown payload format, or a stored group the round does not
                plan (the re-run's secure sums differ from the committed run's).
        """
        rels = {rel.region: rel for rel in self.releases_of(ev, entry_name)}
        if stored.get("format") == STORED_FORMAT:
            items = stored["server"]
        elif "format" not in stored and isinstance(stored.get("releases"), Mapping):
            items = stored["releases"]
        else:
            raise ValueError(f"stored release {entry_name}: unknown stored payload format")
        out: dict[str, Any] = {}
        for region, data in items.items():
            rel = rels.get(region)
            if rel is None:
                raise ValueError(f"stored release {entry_name}: group {region!r} is not "
                                 "planned in this round")
            if stored.get("format") == STORED_FORMAT:
                cls = AggregatedVector if rel.name == HISTOGRAM_METRIC else AggregatedMetric
                agg = cls.model_validate(data)
            else:
                agg = self._from_published(rel, data, ev.sums.groups[region])
            out[region] = self.record(ev, rel, agg)
        return {"releases": out}

    def release_all(self, ev: EvaluationRound, approved: Collection[str] | None = None
                    ) -> EvaluationOutcome:
        """Without a ledger: draw every planned release (or those whose key is in
        ``approved``; the rest refused) and :meth:`finish`."""
        for rel in ev.plan.releases:
            if approved is not None and rel.key not in approved:
                ev.draws.refused.append(rel)
            elif self.has_sum(ev.sums, rel):
                self.record(ev, rel, self.compute(ev.sums, rel))
        return self._finalize(ev.sums, ev.draws)

    def finish(self, ev: EvaluationRound, budget_view: Mapping[str, Any] | None = None
               ) -> EvaluationOutcome:
        """Close a ledger-driven evaluation round: planned releases not drawn are recorded
        as refused (off cadence / over budget); the ledger's view is attached as
        ``budget``."""
        drawn = {r.key for r in ev.draws.made}
        ev.draws.refused = [r for r in ev.plan.releases if r.key not in drawn]
        outcome = self._finalize(ev.sums, ev.draws)
        if budget_view is not None and "budget" in budget_view:
            outcome.published["budget"] = budget_view["budget"]
        return outcome

    def _finalize(self, sums: SecureSums, d: _Draws) -> EvaluationOutcome:
        """Envelopes of suppressed groups, alerts, merges, bounds, the published report."""
        state, policy = self.state, self.policy
        m = sums.min_cohort
        rnd = sums.round
        made, refused, server, envelopes = d.made, d.refused, d.server, d.envelopes
        metrics_pub, health_pub, released, hist_pub = d.metrics, d.health, d.released, d.histogram

        reasons = {
            "aborted": "secure aggregation aborted: fewer than t survivors; region not "
                       "evaluated this round",
            "refused": "differencing: with the sums learned before (same parameters), this "
                       "set would let a combination isolate fewer than the floor's clients; "
                       "not summed",
        }
        not_evaluated = {g: reasons[gs.status] for g, gs in sums.groups.items()
                         if gs.status in reasons}
        monitored = state.merges.groups(self.partition.region_ids)
        unpublished = [g for g in monitored
                       if g not in sums.groups
                       or sums.groups[g].status not in ("ok", "not_unmasked")]
        for name in SCALAR_METRICS:
            gone = [g for g, gs in sums.groups.items()
                    if gs.status not in ("ok", "not_unmasked")]
            for g in gone:
                bv = state.bounds[name]
                envelopes.setdefault(f"{name}/{g}.json", _envelope(
                    name, SCALAR_METRICS[name][0], bv.clip_low, 0.0, bv.clip_low, bv.clip_high,
                    0, m, 0.95, policy, DDG if self.distributed else "laplace"))
        band = suppressed_region_band(len(unpublished)).value
        for name in SCALAR_METRICS:
            metrics_pub[name]["suppressed_regions_band"] = band
            metrics_pub[name]["epsilon_charged"] = max(
                [r.epsilon for r in made if r.name == name and r.region != GLOBAL], default=0.0)
            metrics_pub[name]["composition"] = "parallel (disjoint regions)"
        merged = {g: list(gs.members) for g, gs in sums.groups.items()
                  if g != GLOBAL and len(gs.members) > 1}
        if merged:
            for name in SCALAR_METRICS:
                metrics_pub[name]["merged_regions"] = merged
                metrics_pub[name]["granularity_note"] = (
                    "merged regions are the finest granularity actually monitored: a region "
                    "below the cohort floor is aggregated with its named neighbour")

        alerts: list[Alert] = []
        new_baselines: dict[str, dict[str, str]] = {}
        if rnd >= self.config.evaluation.baseline_from_round:
            for name, (_, direction) in SCALAR_METRICS.items():
                rule = AlertRule(metric=name, direction=direction)
                label = state.bounds[name].label
                res = rule.evaluate(released[name], state.baselines,
                                    partition_version=sums.monitoring_version,
                                    bounds_version=label, round=rnd)
                alerts += res.alerts
                nb = dict(res.new_baselines)
                gkey = f"{name}|{GLOBAL}"
                if gkey in server:
                    gres = rule.evaluate({GLOBAL: server[gkey]}, state.baselines,
                                         partition_version=self.partition.version,
                                         bounds_version=label, round=rnd)
                    alerts += gres.alerts
                    nb.update(gres.new_baselines)
                if nb:
                    new_baselines[name] = nb

        below = sorted({r for g in sums.below_alone for r in monitored.get(g, ())}
                       | {r for g, gs in sums.groups.items()
                          if g != GLOBAL and gs.status == "below_floor" for r in gs.members})
        newly = state.merges.observe(self.partition.region_ids, below)
        bounds_event = None
        if hist_pub is not None:
            proposal = propose_clip_bound(hist_pub["values"], sums.layout.error_edges)
            cur = state.bounds["mean_loss"]
            nxt = update_bounds(cur, proposal, round=rnd)
            bounds_event = {"proposal": proposal.model_dump(), "from": cur.label,
                            "to": nxt.label, "changed": nxt.version != cur.version}
            state.bounds["mean_loss"] = nxt
        state.evaluations_done += 1

        seeded = self.config.evaluation.noise_seeded
        published: dict[str, Any] = {
            "schema": REPORT_SCHEMA,
            "round": rnd,
            "noise": {"source": "seeded-simulation" if seeded else "opendp",
                      "private": not seeded,
                      "mode": self.config.evaluation.noise,
                      **({"mechanism": DDG, "mechanism_version": DDG_VERSION,
                          "added_on": "devices (OpenDP discrete Gaussian shares); the server "
                                      "adds none to accuracy and mean_loss",
                          "global": "sum of the groups' noisy sums (post-processing)"}
                         if self.distributed else {}),
                      **({"warning": "seeded noise: reproducible and NOT private"}
                         if seeded else {})},
            "min_cohort": m,
            "min_cohort_rule": MIN_COHORT_RULE,
            "partition_version": self.partition.version,
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
        if self.distributed:
            published["not_unmasked"] = sorted(g for g, gs in sums.groups.items()
                                               if gs.status == "not_unmasked")
        if hist_pub is not None:
            published["error_histogram"] = hist_pub
        if bounds_event is not None:
            published["bounds_update"] = bounds_event
        return EvaluationOutcome(rnd, made, refused, published, envelopes, alerts,
                                 not_evaluated, server, list(sums.audit))
