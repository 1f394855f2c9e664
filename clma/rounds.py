"""Server-side steps of one CLMA round, free of any orchestrator.

One round (CLMA, Adarsh N L et al., CODS-COMAD 2024, Algorithms 1-3):

1. :func:`select_clients` — which clients take part (seeded).
2. Clients train locally from their cohort's model and send a :class:`ClientUpdate`
   (parameters, sample count, on-device drift flag; never their loss).
3. :func:`quarantine` — flagged clients' updates are held back from their cohort.
4. :func:`aggregate_per_cohort` — FedAvg within each cohort over the non-quarantined
   members, weighted by sample counts.
5. :func:`cohort_quarantined` — per source cohort, the quarantined clients are grouped
   by the direction of their parameter shift against that cohort's model (signed KS,
   Gram-trick PCA, clustering: :class:`clma.cohort.CLMACohorter`); each group becomes a new
   child cohort whose model is the FedAvg of its members' updates.
6. :func:`merge_reconverged` — optionally, cohorts whose models reconverged merge.

Vectors are float32 ``(n_params,)``: the full model state (``AllParams``) for averaging,
and the ``param_selector``'s sub-vector for cohorting.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the cohorting stack (scikit-learn) is imported where it is used
    from clma.cohort import Cohorter, CohortRegistry


__all__ = [
    "ClientUpdate",
    "CohortingOutcome",
    "select_clients",
    "quarantine",
    "fedavg",
    "aggregate_per_cohort",
    "cohort_quarantined",
    "merge_reconverged",
    "DPFedAvgResult",
    "clip_update",
    "dp_fedavg",
    "dp_aggregate_per_cohort",
]


@dataclass(frozen=True)
class ClientUpdate:
    """What a client sends after local training.

    ``params``: float32 ``(n_params,)`` full model state after training; ``n_samples``:
    local training examples (FedAvg weight); ``drift_flag``: the on-device detector's bit;
    ``cohort_id``: the cohort whose model the client started from.
    """

    client_id: int
    cohort_id: int
    params: np.ndarray
    n_samples: int
    drift_flag: bool


@dataclass
class CohortingOutcome:
    """Result of :func:`cohort_quarantined` for one round."""

    new_cohorts: dict[int, list[int]] = field(default_factory=dict)
    parents: dict[int, int] = field(default_factory=dict)
    ks_statistics: dict[int, float] = field(default_factory=dict)
    diagnostics: dict[int, dict[str, Any]] = field(default_factory=dict)


def select_clients(
    client_ids: Sequence[int], participation: float, rng: np.random.Generator
) -> list[int]:
    """Seeded uniform selection of ``ceil(participation * n)`` clients (all when 1.0)."""
    ids = sorted(client_ids)
    if not ids:
        raise ValueError("client_ids: no clients to select from")
    if not 0.0 < participation <= 1.0:
        raise ValueError("participation must be in (0, 1]")
    k = int(np.ceil(participation * len(ids)))
    if k >= len(ids):
        return ids
    return sorted(int(c) for c in rng.choice(ids, size=k, replace=False))


def quarantine(updates: Sequence[ClientUpdate]) -> list[int]:
    """Client ids whose on-device drift flag is set (sorted)."""
    return sorted(u.client_id for u in updates if u.drift_flag)


def fedavg(vectors: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Weighted mean of float32 vectors (FedAvg, McMahan et al. 2017, eq. in Alg. 1).

    Accumulates in float64, returns float32 ``(n_params,)``. Raises ValueError on empty
    input, non-positive total weight or mismatched lengths.
    """
    if not vectors:
        raise ValueError("vectors: nothing to average")
    w = np.asarray(weights, dtype=np.float64)
    if (w.shape != (len(vectors),) or not np.all(np.isfinite(w)) or np.any(w < 0)
            or w.sum() <= 0):
        raise ValueError(
            "weights must be finite and non-negative, one per vector, with a positive sum"
        )
    n = vectors[0].shape
    acc = np.zeros(n, dtype=np.float64)
    for v, wi in zip(vectors, w, strict=True):
        if v.shape != n:
            raise ValueError("vectors must all have the same shape")
        acc += wi * v
    return (acc / w.sum()).astype(np.float32)


def _usable_by_cohort(
    updates: Sequence[ClientUpdate], quarantined: Sequence[int]
) -> dict[int, list[ClientUpdate]]:
    """Cohort id -> its members' updates, quarantined clients left out (input order)."""
    held = set(quarantined)
    groups: dict[int, list[ClientUpdate]] = defaultdict(list)
    for u in updates:
        if u.client_id not in held:
            groups[u.cohort_id].append(u)
    return groups


def aggregate_per_cohort(
    updates: Sequence[ClientUpdate],
    quarantined: Sequence[int],
    cohort_models: Mapping[int, np.ndarray],
    weights: Mapping[int, float] | None = None,
) -> dict[int, np.ndarray]:
    """FedAvg within each cohort over its non-quarantined members' updates.

    ``weights`` optionally scales a client's FedAvg weight (e.g. 0 to exclude, 0.5 to
    down-weight an atypical client). A cohort with no usable update keeps its model.
    Returns a new mapping cohort id -> float32 vector.
    """
    groups = _usable_by_cohort(updates, quarantined)
    out = dict(cohort_models)
    for cid, members in groups.items():
        w = [u.n_samples * (1.0 if weights is None else weights.get(u.client_id, 1.0))
             for u in members]
        if sum(w) > 0:
            out[cid] = fedavg([u.params for u in members], w)
    return out


def cohort_quarantined(
    updates: Sequence[ClientUpdate],
    quarantined: Sequence[int],
    cohort_models: Mapping[int, np.ndarray],
    registry: CohortRegistry,
    cohorter: Cohorter,
    round_number: int,
    select: Any = None,
    start_models: Mapping[int, np.ndarray] | None = None,
    new_model: Callable[[int, list[ClientUpdate], np.ndarray], np.ndarray] | None = None,
    weights: Mapping[int, float] | None = None,
    atypical: Collection[int] = (),
) -> tuple[dict[int, np.ndarray], CohortingOutcome]:
    """Group quarantined clients into new child cohorts (CLMA Algorithm 3).

    For each source cohort, its quarantined clients' parameter vectors (restricted by
    ``select``, a callable mapping a full float32 vector to the cohorting sub-vector;
    identity when None) are cohorted by ``cohorter`` against the reference: the model
    the clients *started the round from* (``start_models[source]``; defaults to
    ``cohort_models[source]``, which is only right if it was not yet re-aggregated).
    ``new_model(new_id, member_updates, reference)`` builds a new cohort's model (default:
    FedAvg of the members' updates weighted by sample counts; under DP-FedAvg pass the DP
    step, so a new cohort's model is released like every other cohort model).
    Each local group becomes a child cohort in ``registry`` (lineage: parent, round,
    reason "drift"); its model is the FedAvg of its members' updates. Returns the new
    cohort-model mapping and a :class:`CohortingOutcome`.

    Atypical clients (issue 6): ``weights`` (client id -> FedAvg weight multiplier, as in
    :func:`aggregate_per_cohort`) scales a member's share of its new cohort's first model,
    so ``downweight`` / ``exclude`` act on new cohorts as on existing ones; with ``new_model``
    (DP-FedAvg) members of weight 0 are left out and other multipliers are ignored (the DP
    step averages clipped updates unweighted). A new cohort whose members all weigh 0 starts
    from the reference (its source's start model). Membership is not changed: an atypical
    client still joins the cohort its update clusters with, because a drifted client is
    atypical for its old cohort by construction and must not be stranded there.
    ``atypical`` (the round's flagged clients) is counted per source in
    ``outcome.diagnostics[source]["n_atypical"]``.
    """
    pick = select if select is not None else (lambda v: v)
    flagged = {int(c) for c in atypical}
    by_id = {u.client_id: u for u in updates}
    by_source: dict[int, list[int]] = defaultdict(list)
    for c in sorted(quarantined):
        by_source[by_id[c].cohort_id].append(c)
    models = dict(cohort_models)
    refs = start_models if start_models is not None else cohort_models
    outcome = CohortingOutcome()
    for source, members in sorted(by_source.items()):
        matrix = np.stack([pick(by_id[c].params) for c in members]).astype(np.float32, copy=False)
        reference = np.asarray(pick(refs[source]), dtype=np.float32)
        assignment = cohorter.cohort(members, matrix, reference)
        groups: dict[int, list[int]] = defaultdict(list)
        for c in members:
            groups[int(assignment.assignments[c])].append(c)
        new_ids = registry.split(source, dict(groups), round_number, reason="drift")
        for local, new_id in sorted(new_ids.items()):
            ms = groups[local]
            share = [1.0 if weights is None else float(weights.get(c, 1.0)) for c in ms]
            if not any(share):
                models[new_id] = np.asarray(refs[source], dtype=np.float32).copy()
            elif new_model is None:
                models[new_id] = fedavg([by_id[c].params for c in ms],
                                        [by_id[c].n_samples * w for c, w in zip(ms, share,
                                                                                 strict=True)])
            else:
                models[new_id] = new_model(
                    new_id, [by_id[c] for c, w in zip(ms, share, strict=True) if w > 0],
                    refs[source])
            outcome.new_cohorts[new_id] = ms
            outcome.parents[new_id] = source
        outcome.ks_statistics.update({c: float(assignment.ks_statistics[c]) for c in members})
        outcome.diagnostics[source] = {"n_quarantined": len(members), "n_groups": len(groups),
                                       "n_atypical": len(set(members) & flagged)}
    return models, outcome


def merge_reconverged(
    cohort_models: Mapping[int, np.ndarray],
    registry: CohortRegistry,
    reference: np.ndarray,
    threshold: float | None,
    round_number: int,
    sizes: Mapping[int, int],
    select: Any = None,
) -> tuple[dict[int, np.ndarray], list[tuple[list[int], int]]]:
    """Merge active cohorts whose models reconverged (off when ``threshold`` is None).

    Distances compare cohort models by their displacement from ``reference`` (see
    :func:`clma.cohort.merge_candidates`). A merged cohort's model is the member-count
    weighted mean of the merged models. Returns the new model mapping and a list of
    ``(merged ids, new id)``.
    """
    if threshold is None:
        return dict(cohort_models), []
    pick = select if select is not None else (lambda v: v)
    active = [c for c in registry.active_cohorts() if c in cohort_models]
    if len(active) < 2:
        return dict(cohort_models), []
    from clma.cohort import merge_candidates

    groups = merge_candidates(
        {c: pick(cohort_models[c]) for c in active}, pick(reference), threshold
    )
    models = dict(cohort_models)
    merges = []
    for group in groups:
        group = sorted(group)
        new_id = registry.merge(group, round_number, reason=f"reconverged (threshold {threshold})")
        models[new_id] = fedavg([models[c] for c in group], [max(sizes.get(c, 1), 1) for c in group])
        merges.append((group, new_id))
    return models, merges


# --------------------------------------------------------------------------- DP-FedAvg


@dataclass(frozen=True)
class DPFedAvgResult:
    """Result of :func:`dp_fedavg` for one cohort.

    ``model``: float32 ``(n_params,)`` = reference + noisy mean of the clipped updates;
    ``sigma``: standard deviation of the Gaussian noise added to each coordinate of the
    mean (``noise_multiplier * clipping_bound / n_clients``); ``n_clients``; ``n_clipped``:
    updates whose L2 norm exceeded the bound; ``noise_source``: ``opendp`` or
    ``seeded-simulation``.
    """

    model: np.ndarray
    sigma: float
    n_clients: int
    n_clipped: int
    noise_source: str


def clip_update(update: np.ndarray, clipping_bound: float) -> tuple[np.ndarray, bool]:
    """Scale ``update`` to L2 norm at most ``clipping_bound``: ``u * min(1, C / ||u||)``.

    Returns ``(clipped float64 (n_params,), was_clipped)``. Raises ValueError for a
    non-positive bound or a non-finite update.
    """
    c = float(clipping_bound)
    if not (math.isfinite(c) and c > 0.0):
        raise ValueError("clipping_bound must be a positive finite number")
    u = np.asarray(update, dtype=np.float64)
    if u.ndim != 1 or not np.all(np.isfinite(u)):
        raise ValueError("update must be a finite 1-D vector")
    norm = float(np.linalg.norm(u))
    if norm <= c:
        return u, False
    return u * (c / norm), True


def dp_fedavg(
    client_params: Sequence[np.ndarray],
    reference: np.ndarray,
    *,
    clipping_bound: float,
    noise_multiplier: float,
    seed: int | np.random.Generator | None = None,
) -> DPFedAvgResult:
    """DP-FedAvg server step for one cohort (McMahan, Ramage, Talwar & Zhang, ICLR 2018,
    Algorithm 1 with the fixed-denominator estimator).

    Each client's update ``params - reference`` is clipped to L2 norm ``clipping_bound``
    (:func:`clip_update`); the clipped updates are averaged with equal weights over the
    ``n`` clients, and Gaussian noise ``N(0, sigma^2 I)`` with
    ``sigma = noise_multiplier * clipping_bound / n`` is added once to the mean (the L2
    sensitivity of the mean to adding or removing one client is ``clipping_bound / n``,
    so the release is the Gaussian mechanism with noise multiplier ``noise_multiplier``;
    charge it as ``MechanismEvent.gaussian(noise_multiplier, sampling_probability)``).

    Args:
        client_params: the cohort's client vectors, each float32 ``(n_params,)``.
        reference: the cohort model the clients started from, float32 ``(n_params,)``.
        clipping_bound: L2 bound ``C`` of one update (> 0).
        noise_multiplier: ``z`` (> 0).
        seed: ``None`` draws from OpenDP's Gaussian sampler
            (:func:`clma.privacy.mechanisms.sample`); an int or Generator uses numpy
            (reproducible simulation, ``noise_source="seeded-simulation"``).

    Returns:
        :class:`DPFedAvgResult` (model float32 ``(n_params,)``).

    Raises:
        ValueError: no clients, mismatched shapes, non-finite vectors or bad parameters.
    """
    from clma.privacy.mechanisms import sample

    if not client_params:
        raise ValueError("client_params: a cohort needs at least one client update")
    z = float(noise_multiplier)
    if not (math.isfinite(z) and z > 0.0):
        raise ValueError("noise_multiplier must be a positive finite number")
    ref = np.asarray(reference, dtype=np.float64)
    if ref.ndim != 1 or not np.all(np.isfinite(ref)):
        raise ValueError("reference must be a finite 1-D vector")
    total = np.zeros_like(ref)
    n_clipped = 0
    for p in client_params:
        v = np.asarray(p, dtype=np.float64)
        if v.shape != ref.shape:
            raise ValueError("client_params must all have the reference's shape")
        clipped, was = clip_update(v - ref, clipping_bound)
        total += clipped
        n_clipped += int(was)
    n = len(client_params)
    sigma = z * float(clipping_bound) / n
    noisy_mean, source = sample(total / n, sigma, mechanism="gaussian", seed=seed)
    model = (ref + np.asarray(noisy_mean, dtype=np.float64)).astype(np.float32)
    return DPFedAvgResult(model=model, sigma=sigma, n_clients=n, n_clipped=n_clipped,
                          noise_source=str(source))


def dp_aggregate_per_cohort(
    updates: Sequence[ClientUpdate],
    quarantined: Sequence[int],
    cohort_models: Mapping[int, np.ndarray],
    *,
    clipping_bound: float,
    noise_multiplier: float,
    seed: int | None = None,
) -> tuple[dict[int, np.ndarray], dict[int, DPFedAvgResult]]:
    """:func:`dp_fedavg` within each cohort over its non-quarantined members (the DP
    counterpart of :func:`aggregate_per_cohort`; equal client weights). A cohort with no
    usable update keeps its model. ``seed`` (int) derives one numpy stream per cohort;
    ``None`` uses OpenDP. Returns the new models and the per-cohort results."""
    groups = _usable_by_cohort(updates, quarantined)
    out = dict(cohort_models)
    results: dict[int, DPFedAvgResult] = {}
    for cid, members in sorted(groups.items()):
        s = None if seed is None else np.random.default_rng([int(seed), int(cid)])
        res = dp_fedavg([u.params for u in members], cohort_models[cid],
                        clipping_bound=clipping_bound, noise_multiplier=noise_multiplier, seed=s)
        out[cid] = res.model
        results[cid] = res
    return out, results
