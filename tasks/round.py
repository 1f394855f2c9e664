"""Prefect tasks, one per step of a federated round. Thin: each calls :mod:`clma`.

Tasks take and return in-memory objects (numpy arrays, dataclasses); none of them is
cached or persisted by Prefect (``NO_CACHE``): the federation's durable state is
committed by the flow, not by Prefect's result store. Client work is mapped over chunks
of clients so that hundreds of clients do not become hundreds of tiny tasks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE

from clma.cohort import AutoKMeans, CLMACohorter
from clma.config import FederationConfig
from clma.params import AllParams, DefaultSelector, flatten_state, unflatten_state
from clma.rounds import (
    ClientUpdate,
    CohortingOutcome,
    aggregate_per_cohort,
    cohort_quarantined,
    merge_reconverged,
    quarantine,
    select_clients,
)
from clma.sim.federation import (
    ClientEvaluation,
    ClientTrainResult,
    SimClient,
    SimulatedFederation,
    evaluate_clients,
    train_clients,
)

__all__ = [
    "select_clients_task",
    "inject_drift_task",
    "train_clients_task",
    "detect_drift_task",
    "aggregate_task",
    "cohort_task",
    "merge_task",
    "evaluate_clients_task",
    "chunked",
    "make_cohorter",
]

_TASK = {"cache_policy": NO_CACHE, "persist_result": False}


def chunked(items: Sequence[int], size: int) -> list[list[int]]:
    """Split ``items`` into consecutive chunks of at most ``size``."""
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def make_cohorter(config: FederationConfig) -> CLMACohorter:
    """The cohorter the config describes."""
    c = config.cohort
    return CLMACohorter(
        clusterer=AutoKMeans(
            fixed_k=c.fixed_k, max_k=c.max_k, min_silhouette=c.min_silhouette,
            random_state=config.seed,
        ),
        variance_threshold=c.variance_threshold,
        center=c.center,
        min_ks_magnitude=c.min_ks_magnitude,
    )


@task(name="select-clients", **_TASK)
def select_clients_task(fed: SimulatedFederation, round_number: int) -> list[int]:
    """Seeded selection of this round's participants."""
    rng = np.random.default_rng([fed.config.seed, round_number, 11])
    return select_clients(fed.client_ids, fed.config.training.participation, rng)


@task(name="inject-drift (simulation)", **_TASK)
def inject_drift_task(fed: SimulatedFederation, round_number: int) -> dict[int, str]:
    """Simulation only: apply the drift schedule's events for this round (ground truth)."""
    return fed.inject_drift(round_number)


@task(name="train-clients", **_TASK)
def train_clients_task(
    clients: list[SimClient],
    models: dict[int, np.ndarray],
    cohort_of: dict[int, int],
    fed_config: FederationConfig,
    spec: Any,
    round_number: int,
) -> list[ClientTrainResult]:
    """On-device local training + drift flag for one chunk of clients."""
    return train_clients(
        clients, models, cohort_of, spec, fed_config.training, fed_config.drift.gamma,
        fed_config.seed, round_number,
    )


@task(name="detect-drift", **_TASK)
def detect_drift_task(updates: Sequence[ClientUpdate], cohorting_enabled: bool) -> list[int]:
    """Quarantine the clients whose on-device flag is set (none under plain FedAvg)."""
    return quarantine(updates) if cohorting_enabled else []


@task(name="aggregate-per-cohort", **_TASK)
def aggregate_task(
    updates: Sequence[ClientUpdate],
    quarantined: Sequence[int],
    cohort_models: Mapping[int, np.ndarray],
    weights: Mapping[int, float] | None = None,
) -> dict[int, np.ndarray]:
    """FedAvg within each cohort over its non-quarantined members."""
    return aggregate_per_cohort(updates, quarantined, cohort_models, weights)


def _selector_fn(fed: SimulatedFederation):
    """Full-state vector -> the DefaultSelector's sub-vector (identity when they agree)."""
    template = fed.spec.build()
    state = template.state_dict()
    full = AllParams().select_module(template)
    chosen = DefaultSelector().select_module(template)
    if chosen == full:
        return lambda v: v
    shapes = {n: state[n] for n in full}
    return lambda v: flatten_state(unflatten_state(v, shapes), chosen)


@task(name="cohort", **_TASK)
def cohort_task(
    fed: SimulatedFederation,
    updates: Sequence[ClientUpdate],
    quarantined: Sequence[int],
    cohort_models: Mapping[int, np.ndarray],
    round_number: int,
    start_models: Mapping[int, np.ndarray],
    new_model: Any = None,
    weights: Mapping[int, float] | None = None,
    atypical: Sequence[int] = (),
) -> tuple[dict[int, np.ndarray], CohortingOutcome]:
    """CLMA Algorithm 3 on the quarantined clients: new child cohorts in the registry.

    ``start_models`` are the cohort models the clients started this round from (the KS
    reference); ``cohort_models`` the models after this round's aggregation. ``weights`` and
    ``atypical`` are the round's divergence outcome (``DivergenceOutcome.weights`` /
    ``.flagged``): the action reaches new cohorts' first models too
    (:func:`clma.rounds.cohort_quarantined`).
    """
    if not quarantined:
        return dict(cohort_models), CohortingOutcome()
    return cohort_quarantined(
        updates, quarantined, cohort_models, fed.registry, make_cohorter(fed.config),
        round_number, select=_selector_fn(fed), start_models=start_models, new_model=new_model,
        weights=weights, atypical=atypical,
    )


@task(name="merge-cohorts", **_TASK)
def merge_task(
    fed: SimulatedFederation, cohort_models: Mapping[int, np.ndarray], round_number: int
) -> tuple[dict[int, np.ndarray], list[tuple[list[int], int]]]:
    """Merge cohorts whose models reconverged (off unless merge_cohorts_threshold is set).

    Displacements are measured from the federation's pre-drift consensus model (the
    source cohort's model when the first drift split happened), so the shared training
    before any drift does not make every pair of cohorts look alike.
    """
    sizes = {c: len(fed.registry.members(c)) for c in fed.registry.active_cohorts()}
    reference = fed.merge_reference if fed.merge_reference is not None else fed.initial_model
    return merge_reconverged(
        cohort_models, fed.registry, reference, fed.config.cohort.merge_cohorts_threshold,
        round_number, sizes, select=_selector_fn(fed),
    )


@task(name="evaluate-clients", **_TASK)
def evaluate_clients_task(
    clients: list[SimClient],
    models: dict[int, np.ndarray],
    cohort_of: dict[int, int],
    spec: Any,
    loss_max: float,
) -> list[ClientEvaluation]:
    """On-device evaluation (clipped accuracy and loss) for one chunk of clients."""
    return evaluate_clients(clients, models, cohort_of, spec, loss_max)
