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

Under DP-FedAvg, step 4 is :func:`dp_aggregate_per_cohort` (clipped updates summed per
cohort, Gaussian noise ``N(0, (2 z C)^2)`` on the sum, divided by a public per-cohort
denominator: the fixed-denominator estimator), and one round is charged as the Gaussian
mechanism on a sample without replacement of :func:`selection_size` clients, under
replace-one adjacency (:mod:`clma.budget.accounting`).

Vectors are float32 ``(n_params,)``: the full model state (``AllParams``) for averaging,
and the ``param_selector``'s sub-vector for cohorting.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the cohorting stack (scikit-learn) is imported where it is used
    from clma.cohort import Cohorter, CohortRegistry
    from clma.cohort.features import UpdateHistory


__all__ = [
    "ClientUpdate",
    "CohortingOutcome",
    "select_clients",
    "quarantine",
    "fedavg",
    "aggregate_per_cohort",
    "server_step",
    "server_velocity",
    "server_step_cohorts",
    "cohort_quarantined",
    "merge_reconverged",
    "DPFedAvgResult",
    "clip_update",
    "dp_aggregate_per_cohort",
    "dp_fedavg",
    "expected_participants",
    "replace_one_sensitivity",
    "selection_size",
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
    #: client id -> the cohort it chose over the split's (``cohort.client_choice``)
    moved: dict[int, int] = field(default_factory=dict)
    #: new cohorts of this round that the clients' choice emptied (retired this round; their
    #: first models were released, so the DP commit stores them with the others)
    retired: list[int] = field(default_factory=list)


def select_clients(
    client_ids: Sequence[int], participation: float, rng: np.random.Generator
) -> list[int]:
    """Uniform selection without replacement of exactly
    ``selection_size(len(client_ids), participation)`` clients (all when 1.0), sorted.

    Under DP-FedAvg this is the sampling the training charge accounts
    (``MechanismEvent.gaussian_sampled_without_replacement(z, len(client_ids), k)``).
    Privacy amplification by sampling holds only if the sample is secret: ``rng`` must
    not be derivable from published values (e.g. ``np.random.default_rng()``, seeded from
    the OS, or a seed kept server-side), or the charge must be that of the whole
    population (``sample_size == population_size``).
    """
    ids = sorted(client_ids)
    if not ids:
        raise ValueError("client_ids: no clients to select from")
    if not 0.0 < participation <= 1.0:
        raise ValueError("participation must be in (0, 1]")
    k = selection_size(len(ids), participation)
    if k >= len(ids):
        return ids
    return sorted(int(c) for c in rng.choice(ids, size=k, replace=False))


def quarantine(updates: Sequence[ClientUpdate],
               registry: CohortRegistry | None = None) -> list[int]:
    """Client ids whose on-device drift flag is set (sorted).

    With ``registry``, a flagged client that is the only member of its cohort is not
    quarantined: there is no one to separate it from, and a "split" would only rename its
    cohort (a new single-client cohort every round it flags). Its update is aggregated
    into its own cohort as any other (its model follows the drift); the flag still counts.
    """
    flagged = [u for u in updates if u.drift_flag]
    if registry is not None:
        flagged = [u for u in flagged if len(registry.members(u.cohort_id)) > 1]
    return sorted(u.client_id for u in flagged)


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


def server_step(start_models: Mapping[int, np.ndarray], models: Mapping[int, np.ndarray],
                server_learning_rate: float, *, momentum: float = 0.0,
                velocity: Mapping[int, np.ndarray] | None = None) -> dict[int, np.ndarray]:
    """The server's SGD step on each cohort that started the round: ``start + eta * v`` with
    ``v = momentum * c * velocity[c] + (aggregate - start)`` and ``c = min(1, ||aggregate -
    start|| / ||velocity[c]||)``, in float64, returned as float32 (FedOpt with SGD as the
    server optimizer: Reddi et al., "Adaptive Federated Optimization", ICLR 2021,
    Algorithm 1; with momentum, FedAvgM: Hsu et al., "Measuring the Effects of
    Non-Identical Data Distribution for Federated Visual Classification", 2019; ``eta`` = 1
    and ``momentum`` = 0 is FedAvg). The carried velocity is clipped to the length of the
    round's change (this library's addition), so a step is never longer than ``eta * (1 +
    momentum)`` times the change: unclipped, a cohort's large first change after a split
    carried into its next round broke a CNN (docs/realistic_drift.md section 8).
    ``start_models`` / ``models`` / ``velocity``: cohort id -> float32 vector of shape (P,);
    a cohort without a velocity (new, or never stepped) has velocity 0; cohorts without a
    start model (new this round) are returned unchanged. The next round's velocity is
    :func:`server_velocity` of the returned models.

    Raises:
        ValueError: ``server_learning_rate`` not in (0, 10] or ``momentum`` not in [0, 1)
            (the config's rules); a velocity whose shape is not its start model's.
    """
    eta = float(server_learning_rate)
    if not 0.0 < eta <= 10.0:
        raise ValueError("training.server_learning_rate: must be in (0, 10]")
    beta = float(momentum)
    if not 0.0 <= beta < 1.0:
        raise ValueError("training.server_momentum: must be in [0, 1)")
    velocity = velocity or {}
    out = dict(models)
    for cid, start in start_models.items():
        if cid in out:
            s = np.asarray(start, dtype=np.float64)
            v = np.asarray(out[cid], dtype=np.float64) - s
            if beta and cid in velocity:
                prev = np.asarray(velocity[cid], dtype=np.float64)
                if prev.shape != s.shape:
                    raise ValueError(f"velocity: cohort {cid}'s velocity has shape "
                                     f"{prev.shape}, its model {s.shape}")
                # the carried velocity counts at most as much as the round's own change
                scale = min(1.0, float(np.linalg.norm(v)) / max(float(np.linalg.norm(prev)),
                                                                1e-300))
                v = beta * scale * prev + v
            out[cid] = (s + eta * v).astype(np.float32)
    return out


def server_velocity(start_models: Mapping[int, np.ndarray], models: Mapping[int, np.ndarray],
                    server_learning_rate: float) -> dict[int, np.ndarray]:
    """Each stepped cohort's server-momentum velocity after the round: ``(model - start) /
    eta`` in float64 from the released float32 ``models``, as float32 (cohort id -> shape
    (P,), for the cohorts in both mappings). Taken from the released models rather than
    kept from inside :func:`server_step`, so a re-run that republishes a committed round's
    models gives the same velocity bitwise, and under DP-FedAvg the velocity is
    post-processing of released models (no privacy cost).

    Raises:
        ValueError: ``server_learning_rate`` not in (0, 10].
    """
    eta = float(server_learning_rate)
    if not 0.0 < eta <= 10.0:
        raise ValueError("training.server_learning_rate: must be in (0, 10]")
    return {int(c): ((np.asarray(models[c], dtype=np.float64)
                      - np.asarray(start, dtype=np.float64)) / eta).astype(np.float32)
            for c, start in start_models.items() if c in models}


def server_step_cohorts(registry: CohortRegistry, cohort_ids: Iterable[int],
                        scope: str) -> list[int]:
    """The cohorts among ``cohort_ids`` that take the server step under
    ``training.server_learning_rate_scope``: all of them for ``"all"``; for
    ``"drift_cohorts"`` those with a parent in ``registry`` (formed by a split of drifted
    clients or by a merge, a merge with a parentless cohort included). Sorted ids.

    Raises:
        ValueError: ``scope`` not ``"all"`` or ``"drift_cohorts"``.
    """
    if scope == "all":
        return sorted(cohort_ids)
    if scope != "drift_cohorts":
        raise ValueError("training.server_learning_rate_scope: must be 'all' or "
                         "'drift_cohorts'")
    return sorted(c for c in cohort_ids if registry.cohort(c).parents)


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
    history: UpdateHistory | None = None,
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

    ``history`` (``cohort.features = "relative"``): the cohorter gets the rows
    ``r + (d_i - m_i)`` instead of the parameter vectors, ``m_i`` the client's mean previous
    stable update in the source cohort (selected sub-vector; :mod:`clma.cohort.features`);
    the new cohorts' models are still the FedAvg of the members' parameter vectors.
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
        if history is not None:
            from clma.cohort.features import relative_rows

            matrix = relative_rows(matrix, reference,
                                   [history.mean(c, source) for c in members])
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

    ``model``: float32 ``(n_params,)``, the released cohort model. ``sigma``: standard
    deviation of the Gaussian noise in each coordinate of ``model``
    (``noise_multiplier * 2 * clipping_bound / denominator``, whatever the number of
    clients). ``n_clients``: updates summed (server-side, never published);
    ``n_clipped``: updates whose L2 norm exceeded the bound; ``noise_source``: ``opendp``
    or ``seeded-simulation``; ``denominator``: the public denominator;
    ``estimator``: ``fixed_denominator``.
    """

    model: np.ndarray
    sigma: float
    n_clients: int
    n_clipped: int
    noise_source: str
    denominator: float
    estimator: str = "fixed_denominator"


def selection_size(population_size: int, participation: float) -> int:
    """How many clients :func:`select_clients` draws: ``ceil(participation * N)``, at most
    ``N`` (the ``sample_size`` of the round's training charge, ``N`` its
    ``population_size``).

    Raises:
        ValueError: ``population_size`` not a positive integer, or ``participation``
            outside (0, 1].
    """
    if isinstance(population_size, bool) or not isinstance(population_size, int | np.integer) \
            or population_size < 1:
        raise ValueError("population_size must be a positive integer")
    if not 0.0 < participation <= 1.0:
        raise ValueError("participation must be in (0, 1]")
    return min(int(np.ceil(participation * int(population_size))), int(population_size))


def expected_participants(cohort_size: int, *, population_size: int, sample_size: int) -> float:
    """The recommended public denominator of a cohort for :func:`dp_fedavg`: the expected
    number of the cohort's clients in a uniform sample of ``sample_size`` of the
    ``population_size`` clients, ``sample_size * cohort_size / population_size``, at
    least 1 (``participation * cohort_size`` up to the rounding of the sample size).

    ``cohort_size`` is the number of the cohort's members in the population, fixed before
    the round (not how many took part).

    Raises:
        ValueError: a size that is negative, not an integer, or ``sample_size`` outside
            ``[1, population_size]`` / ``cohort_size > population_size``.
    """
    sizes = {"cohort_size": cohort_size, "population_size": population_size,
             "sample_size": sample_size}
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 0:
            raise ValueError(f"{name} must be a non-negative integer")
    if not 1 <= sample_size <= population_size:
        raise ValueError("sample_size must be in [1, population_size]")
    if cohort_size > population_size:
        raise ValueError("cohort_size must be at most population_size")
    return max(1.0, int(sample_size) * int(cohort_size) / int(population_size))


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


def replace_one_sensitivity(clipping_bound: float) -> float:
    """L2 sensitivity of a sum of updates clipped to ``clipping_bound`` when one client's
    update is replaced by any other: ``2 * clipping_bound`` (``||u - u'|| <= ||u|| + ||u'||``,
    attained by opposite updates of norm ``C``)."""
    c = float(clipping_bound)
    if not (math.isfinite(c) and c > 0.0):
        raise ValueError("clipping_bound must be a positive finite number")
    return 2.0 * c


def dp_fedavg(
    client_params: Sequence[np.ndarray],
    reference: np.ndarray,
    *,
    clipping_bound: float,
    noise_multiplier: float,
    denominator: float,
    seed: int | np.random.Generator | None = None,
) -> DPFedAvgResult:
    """DP-FedAvg server step for one cohort with the fixed-denominator estimator
    (McMahan, Ramage, Talwar & Zhang, "Learning Differentially Private Recurrent Language
    Models", ICLR 2018, Algorithm 1, estimator ``f~_f``, client weights 1).

    With ``u_i = params_i - reference``, ``C = clipping_bound``, ``z = noise_multiplier``
    and ``D = denominator``::

        Delta_i = u_i * min(1, C / ||u_i||_2)                  (clip_update)
        S       = sum_i Delta_i                                (float64)
        model   = reference + (S + N(0, (2 z C)^2 I)) / D      (float32)

    The replace-one L2 sensitivity of ``S`` is ``2 C`` (:func:`replace_one_sensitivity`),
    so ``S + noise`` is the Gaussian mechanism with noise multiplier ``z`` under
    replace-one adjacency, and dividing by the public ``D`` is post-processing. The noise
    in each coordinate of the released model has standard deviation ``sigma = 2 z C / D``
    whatever the number of clients ``n`` that took part (``n = 0`` releases
    ``reference + noise / D``). Charge one round (all cohorts together: a client is in one
    cohort per round) as
    ``MechanismEvent.gaussian_sampled_without_replacement(z, population_size,
    sample_size)`` for clients drawn by :func:`select_clients`.

    ``D`` must be fixed before the round and not depend on who took part, e.g. the
    expected number of participants of the cohort (:func:`expected_participants`). It is
    recoverable from the released model (its noise level is ``2 z C / D``), so it must be
    a value that may be published.

    Args:
        client_params: the cohort's client vectors, each float32 ``(n_params,)`` (may be
            empty: ``reference + noise / D`` is released).
        reference: the cohort model the clients started from, float32 ``(n_params,)``.
        clipping_bound: L2 bound ``C`` of one update (> 0).
        noise_multiplier: ``z`` (> 0), noise std over the replace-one sensitivity ``2 C``.
        denominator: ``D`` (> 0, finite), public and fixed before the round.
        seed: ``None`` draws from OpenDP's Gaussian sampler
            (:func:`clma.privacy.mechanisms.sample`); an int or Generator uses numpy
            (reproducible simulation, ``noise_source="seeded-simulation"``, not private).

    Returns:
        :class:`DPFedAvgResult` (model float32 ``(n_params,)``).

    Raises:
        ValueError: mismatched shapes, non-finite vectors, a bad ``clipping_bound``,
            ``noise_multiplier`` or ``denominator``.
    """
    from clma.privacy.mechanisms import sample

    z = float(noise_multiplier)
    if not (math.isfinite(z) and z > 0.0):
        raise ValueError("noise_multiplier must be a positive finite number")
    c = float(clipping_bound)
    if not (math.isfinite(c) and c > 0.0):
        raise ValueError("clipping_bound must be a positive finite number")
    try:
        d = float(denominator)
    except (TypeError, ValueError):
        raise ValueError("denominator must be a positive finite number") from None
    if isinstance(denominator, bool) or not (math.isfinite(d) and d > 0.0):
        raise ValueError("denominator must be a positive finite number")
    ref = np.asarray(reference, dtype=np.float64)
    if ref.ndim != 1 or not np.all(np.isfinite(ref)):
        raise ValueError("reference must be a finite 1-D vector")
    total = np.zeros_like(ref)
    n_clipped = 0
    for p in client_params:
        v = np.asarray(p, dtype=np.float64)
        if v.shape != ref.shape:
            raise ValueError("client_params must all have the reference's shape")
        clipped, was = clip_update(v - ref, c)
        total += clipped
        n_clipped += int(was)
    n = len(client_params)
    noise_std = z * replace_one_sensitivity(c)
    noisy_sum, source = sample(total, noise_std, mechanism="gaussian", seed=seed)
    model = (ref + np.asarray(noisy_sum, dtype=np.float64) / d).astype(np.float32)
    return DPFedAvgResult(model=model, sigma=noise_std / d, n_clients=n, n_clipped=n_clipped,
                          noise_source=str(source), denominator=d,
                          estimator="fixed_denominator")


def dp_aggregate_per_cohort(
    updates: Sequence[ClientUpdate],
    quarantined: Sequence[int],
    cohort_models: Mapping[int, np.ndarray],
    *,
    clipping_bound: float,
    noise_multiplier: float,
    denominators: Mapping[int, float],
    seed: int | np.random.Generator | None = None,
) -> tuple[dict[int, np.ndarray], dict[int, DPFedAvgResult]]:
    """:func:`dp_fedavg` within each cohort over its non-quarantined members (the DP
    counterpart of :func:`aggregate_per_cohort`; equal client weights).

    ``denominators`` (cohort id -> public denominator ``D``, e.g.
    :func:`expected_participants`): the cohorts released this round. Each of them is
    released with the fixed-denominator estimator, also when none of its clients took part
    (its model is then ``reference + noise / D``: whether anyone took part is not
    revealed); cohorts not in it keep their model.

    ``seed``: an int derives one numpy stream per cohort (``default_rng([seed, cohort])``);
    a Generator is drawn from in increasing cohort order; ``None`` uses OpenDP. The
    round's training charge is one
    ``MechanismEvent.gaussian_sampled_without_replacement(noise_multiplier,
    population_size, sample_size)``.

    Returns:
        The new models (cohort id -> float32 ``(n_params,)``) and the per-cohort results.

    Raises:
        ValueError: a denominator for a cohort without a model in ``cohort_models``, a
            cohort with usable updates but no denominator, a bad denominator, or any
            :func:`dp_fedavg` error.
    """
    groups = _usable_by_cohort(updates, quarantined)
    out = dict(cohort_models)
    results: dict[int, DPFedAvgResult] = {}

    def stream(cid: int) -> int | np.random.Generator | None:
        if seed is None or isinstance(seed, np.random.Generator):
            return seed
        return np.random.default_rng([int(seed), int(cid)])

    if not isinstance(denominators, Mapping):
        raise ValueError("denominators must map cohort id -> denominator")
    unknown = sorted(c for c in denominators if c not in cohort_models)
    if unknown:
        raise ValueError(f"denominators: cohort {unknown[0]} has no model in cohort_models")
    missing = sorted(c for c in groups if c not in denominators)
    if missing:
        raise ValueError(f"denominators: cohort {missing[0]} has usable updates but no"
                         " denominator (every released cohort needs its public denominator)")
    for cid in sorted(denominators):
        members = groups.get(cid, [])
        res = dp_fedavg(
            [u.params for u in members], cohort_models[cid],
            clipping_bound=clipping_bound, noise_multiplier=noise_multiplier,
            denominator=denominators[cid], seed=stream(cid))
        out[cid] = res.model
        results[cid] = res
    return out, results
