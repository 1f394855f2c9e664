"""Prefect tasks of a federated round, one per engine step. Thin: each calls one
:class:`clma.engine.FederationEngine` step and returns its result.

Tasks take and return in-memory objects (the engine, its round context, numpy arrays,
dataclasses); none of them is cached or persisted by Prefect (``NO_CACHE``): the
federation's durable state is committed by the flow, not by Prefect's result store.
Training is split into chunks of clients so that hundreds of clients do not become
hundreds of tiny tasks; each chunk is one call of the transport (``Clients.train``). A
transport whose clients run in this process (the simulation) trains all chunks in one
``train-clients`` task run, one chunk after the other as the bare engine does (parallel
threads would only contend for the GIL, and every task run costs the Prefect API); a
transport with remote clients (Dask, Flower) maps one ``train-clients`` task run per
chunk (:func:`train_task_chunks`).
No task sees a client's data: the engine reaches the clients only through the seam.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote

from clma.engine import FederationEngine, Replies, RoundContext
from clma.engine.divergence import DivergenceOutcome
from clma.rounds import ClientUpdate, CohortingOutcome

__all__ = [
    "TASK_OPTIONS",
    "aggregate_task",
    "chunked",
    "cohort_task",
    "detect_drift_task",
    "merge_task",
    "prefect_step",
    "score_divergence_task",
    "select_clients_task",
    "train_clients_task",
    "train_task_chunks",
]

TASK_OPTIONS: dict[str, Any] = {"cache_policy": NO_CACHE, "persist_result": False}


def chunked(items: Sequence[int], size: int) -> list[list[int]]:
    """Split ``items`` into consecutive chunks of at most ``size``."""
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


@task(name="select-clients", **TASK_OPTIONS)
def select_clients_task(engine: FederationEngine, round_number: int) -> RoundContext:
    """Seeded selection of this round's participants (and the models they start from)."""
    return engine.begin_round(round_number)


def train_task_chunks(selected: Sequence[int], chunk_size: int, *, in_process: bool
                      ) -> list[list[list[int]]]:
    """The chunks of clients of each ``train-clients`` task run: all chunks in one run
    when the clients run in this process (``in_process``), else one run per chunk.

    Raises:
        ValueError: ``chunk_size`` below 1.
    """
    if chunk_size < 1:
        raise ValueError("chunk_size: must be at least 1")
    chunks = chunked(selected, chunk_size)
    if in_process:
        return [chunks] if chunks else []
    return [[c] for c in chunks]


@task(name="train-clients", **TASK_OPTIONS)
def train_clients_task(engine: FederationEngine, ctx: RoundContext,
                       chunks: list[list[int]]) -> list[Replies[ClientUpdate]]:
    """On-device local training and drift flag for ``chunks`` of clients, one transport
    call per chunk, in order; replies checked, a malformed one is a dropout."""
    return [engine.train(ctx, ids) for ids in chunks]


@task(name="detect-drift", **TASK_OPTIONS)
def detect_drift_task(engine: FederationEngine, ctx: RoundContext) -> list[int]:
    """Quarantine the clients whose on-device flag is set (none under plain FedAvg)."""
    return engine.detect_drift(ctx)


@task(name="score-divergence", **TASK_OPTIONS)
def score_divergence_task(engine: FederationEngine, ctx: RoundContext
                          ) -> DivergenceOutcome | None:
    """Atypical-client scores of every client of the round."""
    return engine.score_divergence(ctx)


@task(name="aggregate-per-cohort", **TASK_OPTIONS)
def aggregate_task(engine: FederationEngine, ctx: RoundContext) -> dict[str, Any]:
    """FedAvg (or DP-FedAvg after the training charge) within each cohort."""
    engine.aggregate(ctx)
    return {"cohorts": sorted(ctx.models), "training": None if ctx.training is None else
            {k: v for k, v in ctx.training.items() if k not in ("reservation", "released",
                                                                 "stored_new")}}


@task(name="cohort", **TASK_OPTIONS)
def cohort_task(engine: FederationEngine, ctx: RoundContext) -> CohortingOutcome:
    """CLMA Algorithm 3 on the quarantined clients: new child cohorts in the registry."""
    return engine.cohort(ctx)


@task(name="merge-cohorts", **TASK_OPTIONS)
def merge_task(engine: FederationEngine, ctx: RoundContext) -> list[tuple[list[int], int]]:
    """Merge cohorts whose models reconverged (off unless merge_cohorts_threshold is set)."""
    out = engine.merge(ctx)
    engine.end_training(ctx)
    return out


_STEP_TASKS: dict[str, Any] = {}


def prefect_step(name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """The engine's step runner inside a flow: runs ``fn`` as a Prefect task named
    ``name`` (one task object per name, created on first use)."""
    t = _STEP_TASKS.get(name)
    if t is None:
        t = task(name=name, **TASK_OPTIONS)(lambda f, *a, **k: f(*a, **k))
        _STEP_TASKS[name] = t
    # quote(): the arguments (ledger, plans, the open evaluation round) are not walked for
    # futures (see flows.federation.round_flow); the step receives the objects themselves
    return t(fn, *(quote(a) for a in args), **{k: quote(v) for k, v in kwargs.items()})
