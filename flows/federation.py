"""Prefect flows: one federated round, and a federation of N rounds.

``federation_flow`` builds the simulated federation, opens one MLflow run, and runs
``round_flow`` once per round (each round is its own Prefect flow run, nested under the
federation's, with named tasks: select-clients, train-clients (mapped over chunks),
detect-drift, score-divergence, aggregate-per-cohort, cohort, merge-cohorts, evaluate-clients (mapped),
evaluate-regions, log-round). It runs on the embedded default: with no
``PREFECT_API_URL`` Prefect starts a temporary local API; nothing to start by hand.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from clma.config import FederationConfig
from clma.sim.federation import ClientEvaluation, SimulatedFederation, build_federation
from clma.sim.truth import drift_event_ari, families_separated, mean_or_none
from tasks.budget import (
    BudgetState,
    budgeted_evaluation,
    dp_aggregate_task,
    dp_commit_training,
    dp_new_cohort_model,
    open_budget,
    report_budget_round,
)
from tasks.divergence import DivergenceOutcome, probe_sha256, score_divergence_task
from tasks.durable import FederationSession
from tasks.evaluate import finish_evaluation, log_evaluation, private_evaluation
from tasks.round import (
    aggregate_task,
    chunked,
    cohort_task,
    detect_drift_task,
    evaluate_clients_task,
    inject_drift_task,
    merge_task,
    select_clients_task,
    train_clients_task,
)
from tasks.scale_out import ClientRunner, open_client_runner
from tasks.tracking import FederationTracker

__all__ = ["RoundRecord", "federation_flow", "round_flow", "run_federation", "SUMMARY_SCHEMA"]

SUMMARY_SCHEMA = "clma.summary/1"


@dataclass
class RoundRecord:
    """What one round produced (operator view; no client ids in published parts)."""

    round: int
    cohorts: dict[int, int]
    flagged: int
    quarantined: int
    new_cohorts: dict[int, dict[str, Any]]
    merges: list[dict[str, Any]]
    regional: dict[str, Any] | None
    truth: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    divergence: dict | None = None  # DivergenceOutcome.summary(): statistics, no client ids
    evaluation: Any = None  # tasks.evaluate.EvaluationOutcome (envelopes, alerts, releases)


def _truth(
    fed: SimulatedFederation,
    evaluations: list[ClientEvaluation],
    drifted_now: dict[int, str],
) -> dict[str, Any]:
    acc = {e.client_id: e.accuracy for e in evaluations}
    stationary = [acc[c] for c in fed.stationary_clients() if c in acc]
    drifted = [acc[c] for c in fed.drifted_clients() if c in acc]
    out: dict[str, Any] = {
        "stationary_accuracy": mean_or_none(stationary),
        "drifted_accuracy": mean_or_none(drifted),
    }
    if drifted_now:
        cohort_of = {c: fed.registry.cohort_of(c) for c in drifted_now}
        out["drift_event"] = {
            "ari": drift_event_ari(drifted_now, cohort_of),
            "families_separated": families_separated(drifted_now, cohort_of),
            "n_drifted": len(drifted_now),
        }
    return out


@flow(name="clma-round", flow_run_name="round-{round_number}")
def round_flow(
    fed: SimulatedFederation,
    round_number: int,
    on_divergence: Callable[[DivergenceOutcome], None] | None = None,
    budget: BudgetState | None = None,
) -> RoundRecord:
    """One federated round of CLMA (or plain FedAvg when cohorting is disabled).

    ``on_divergence`` (simulations, experiments) receives the round's full
    :class:`tasks.divergence.DivergenceOutcome`, client ids included; the record keeps only
    its id-free summary.
    """
    t0 = time.perf_counter()
    cfg = fed.config
    selected = select_clients_task(fed, round_number)
    drifted_now = inject_drift_task(fed, round_number)
    cohort_of = {c: fed.registry.cohort_of(c) for c in selected}
    chunks = chunked(selected, cfg.orchestration.chunk_size)
    futures = [
        train_clients_task.submit(
            [fed.clients[c] for c in chunk],
            fed.models_for(chunk),
            {c: cohort_of[c] for c in chunk},
            cfg,
            fed.spec,
            round_number,
        )
        for chunk in chunks
    ]
    results = [r for f in futures for r in f.result()]
    for r in results:  # client side: each device keeps its own detector state
        fed.clients[r.update.client_id].detector_state = r.detector_state
    updates = [r.update for r in results]
    quarantined = detect_drift_task(updates, cfg.cohort.enabled)
    start_models = dict(fed.cohort_models)
    if quarantined and fed.merge_reference is None:
        first_source = next(u.cohort_id for u in updates if u.client_id in set(quarantined))
        fed.merge_reference = start_models[first_source].copy()
    div = None
    if cfg.divergence.enabled:
        div = score_divergence_task(fed, updates, start_models, round_number)
        if on_divergence is not None:
            on_divergence(div)
    # div.flagged (under divergence.signal) is the atypical set; div.weights is None for
    # action 'report', else flagged client -> FedAvg weight multiplier (0 for 'exclude').
    new_model = None
    training = None
    if cfg.training.dp.enabled:  # DP-FedAvg, charged to the training line (tasks/budget.py)
        models, training = dp_aggregate_task(fed, budget, updates, quarantined, start_models,
                                             round_number, div.weights if div else None)
        new_model = dp_new_cohort_model(fed, training, round_number)  # new cohorts: DP too
    else:
        models = aggregate_task(updates, quarantined, start_models, div.weights if div else None)
    models, outcome = cohort_task(fed, updates, quarantined, models, round_number, start_models,
                                  new_model, div.weights if div else None,
                                  div.flagged if div else ())
    if training is not None:  # commit the charge with every model released under DP
        models = dp_commit_training(training, models, outcome.new_cohorts)
    models, merges = merge_task(fed, models, round_number)
    fed.cohort_models = {c: models[c] for c in fed.registry.active_cohorts()}
    fed.registry.record_round(round_number)

    regional = None
    evaluation = None
    evaluations: list[ClientEvaluation] = []
    cohort_of = {c: fed.registry.cohort_of(c) for c in selected}
    eval_futures = [
        evaluate_clients_task.submit(
            [fed.clients[c] for c in chunk], fed.models_for(chunk),
            {c: cohort_of[c] for c in chunk}, fed.spec, cfg.evaluation.loss_max,
        )
        for chunk in chunks
    ]
    evaluations = [e for f in eval_futures for e in f.result()]
    if round_number % cfg.evaluation.every == 0:
        if budget is not None:  # every release charged before its noise (tasks/budget.py)
            from flows.approval import borrow_gate

            view = budgeted_evaluation(fed, budget, evaluations, round_number,
                                       gate=borrow_gate, run_id=str(flow_run.id or ""))
            evaluation = finish_evaluation(fed, selected, round_number, budget_view=view)
        else:
            evaluation = private_evaluation(fed, selected, round_number)
        regional = evaluation.published
    fed.rounds_done = round_number
    return RoundRecord(
        round=round_number,
        cohorts={c: len(fed.registry.members(c)) for c in fed.registry.active_cohorts()},
        flagged=sum(u.drift_flag for u in updates),
        quarantined=len(quarantined),
        new_cohorts={
            k: {"parent": outcome.parents[k], "size": len(v)}
            for k, v in outcome.new_cohorts.items()
        },
        merges=[{"merged": g, "into": n} for g, n in merges],
        regional=regional,
        truth=_truth(fed, evaluations, drifted_now),
        seconds=time.perf_counter() - t0,
        divergence=None if div is None else {
            **div.summary(),
            # quarantined (drift-flagged) clients that the divergence signal flagged too
            "quarantined_atypical": sum(d.get("n_atypical", 0)
                                        for d in outcome.diagnostics.values()),
        },
        evaluation=evaluation,
    )


def _round_metrics(rec: RoundRecord) -> dict[str, float]:
    m: dict[str, float] = {
        "n_cohorts": len(rec.cohorts),
        "quarantined_clients": rec.quarantined,
        "flagged_clients": rec.flagged,
        "new_cohorts": len(rec.new_cohorts),
        "merges": len(rec.merges),
        "round_seconds": rec.seconds,
    }
    if rec.regional:
        for metric, rep in rec.regional["metrics"].items():
            for region, pub in rep["regions"].items():
                m[f"regional.{region}.{metric}"] = pub["value"]
                m[f"regional.{region}.{metric}.error_bar"] = pub["error_bar"]
    for k in ("stationary_accuracy", "drifted_accuracy"):
        if rec.truth.get(k) is not None:
            m[f"sim_truth.{k}"] = rec.truth[k]
    if "drift_event" in rec.truth:
        m["sim_truth.drift_event_ari"] = rec.truth["drift_event"]["ari"]
    if rec.divergence:  # distribution and count only: nothing per client
        for signal in ("representation", "parameter"):
            for k in ("median", "mad", "max_z", "n_flagged"):
                v = rec.divergence[signal][k]
                if v is not None:
                    m[f"divergence.{signal}.{k}"] = v
        m["divergence.n_flagged"] = rec.divergence["n_flagged"]  # under divergence.signal
        m["divergence.quarantined_atypical"] = rec.divergence["quarantined_atypical"]
    return m


def cohort_history_artifact(fed: SimulatedFederation) -> dict[str, Any]:
    """Cohort history without client ids: per round, cohort id -> member count; lineage."""
    return {
        "rounds": {
            str(r): {str(c): len(m) for c, m in cohorts.items()}
            for r, cohorts in fed.registry.history.items()
        },
        "lineage": [
            {
                "kind": e.kind,
                "round": e.round,
                "parents": e.parents,
                "children": e.children,
                "n_clients": len(e.clients),
                "reason": e.reason,
            }
            for e in fed.registry.lineage
        ],
    }


def build_summary(
    fed: SimulatedFederation,
    records: list[RoundRecord],
    *,
    mlflow_run_id: str | None,
    tracking_uri: str | None,
    prefect_flow_run_id: str | None,
) -> dict[str, Any]:
    """The ``summary.json`` document (schema ``clma.summary/1``, see README)."""
    cfg = fed.config
    events = {
        str(r.round): r.truth["drift_event"]["ari"] for r in records if "drift_event" in r.truth
    }
    last = records[-1].truth if records else {}
    return {
        "schema": SUMMARY_SCHEMA,
        "federation": {
            "name": cfg.name,
            "seed": cfg.seed,
            "rounds": cfg.rounds,
            "clients": cfg.clients,
            "dataset": fed.dataset_name,
            "cohorting": "clma" if cfg.cohort.enabled else "fedavg",
            "config_fingerprint": cfg.fingerprint(),
        },
        "region_partition": {
            "version": fed.partition.version,
            "content_hash": fed.partition.content_hash,
            "source": fed.partition.source,
        },
        "mlflow": {"run_id": mlflow_run_id, "tracking_uri": tracking_uri},
        "prefect": {"flow_run_id": prefect_flow_run_id},
        "rounds": [
            {
                "round": r.round,
                "cohorts": {str(k): v for k, v in sorted(r.cohorts.items())},
                "flagged_clients": r.flagged,
                "quarantined_clients": r.quarantined,
                "new_cohorts": {str(k): v for k, v in r.new_cohorts.items()},
                "merges": r.merges,
                "regional": r.regional,
                # atypical-client scores: distribution statistics and counts only, no ids
                "divergence": r.divergence,
                "seconds": round(r.seconds, 3),
            }
            for r in records
        ],
        "final_cohorts": {
            str(c): len(fed.registry.members(c)) for c in fed.registry.active_cohorts()
        },
        "ground_truth": {
            "note": "simulation ground truth; never part of a private release",
            "ari_per_drift_event": events,
            "families_separated_every_event": all(
                r.truth["drift_event"]["families_separated"]
                for r in records
                if "drift_event" in r.truth
            ),
            "stationary_final_accuracy": last.get("stationary_accuracy"),
            "drifted_final_accuracy": last.get("drifted_accuracy"),
            "per_round": [
                {
                    "round": r.round,
                    "stationary_accuracy": r.truth.get("stationary_accuracy"),
                    "drifted_accuracy": r.truth.get("drifted_accuracy"),
                }
                for r in records
            ],
        },
    }


@flow(name="clma-federation", flow_run_name="{config.name}-seed{config.seed}")
def federation_flow(
    config: FederationConfig,
    out_dir: str | None = None,
    parent_mlflow_run_id: str | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    on_divergence: Callable[[DivergenceOutcome], None] | None = None,
    state_dir: str | None = None,
    max_new_rounds: int | None = None,
    resume: bool | None = None,
) -> dict[str, Any]:
    """A federation of ``config.rounds`` rounds, tracked in one MLflow run.

    Writes ``summary.json`` (and the per-round regional reports) to ``out_dir`` when
    given and returns the summary dict.

    Durable state (``tasks/durable.py``, ``clma/state.py``): with ``state_dir`` the
    federation continues from the round committed there (``resume=True`` requires one,
    ``False`` refuses one, ``None`` accepts both), re-uses its MLflow run, runs at most
    ``max_new_rounds`` more rounds (up to ``config.rounds``) and commits the state
    atomically after each round.
    """
    import torch

    torch.set_num_threads(1)  # small models; also makes float results thread-independent
    session = FederationSession.open(  # durable state (None: off), lineage, dashboards
        config, state_dir, out_dir,
        require=None if resume is None else ("existing" if resume else "fresh"))
    tracker: FederationTracker | None = None
    try:  # set-up; the round loop's own try/finally releases everything after it
        config = session.config  # with a state dir, the ledger lives in it
        fed = build_federation(config)
        first_round = session.restore(fed) + 1
        budget = open_budget(config) if config.budget.enabled else None
        prefect_id = str(flow_run.id) if flow_run.id else None
        if config.tracking.enabled:
            tracker = session.make_tracker()  # re-attaches to the federation's run on resume
            tracker.start(
                config.tracking.experiment or config.name,
                run_name=f"{config.name}-seed{config.seed}",
                params=config.flat_params(),
                tags={
                    "clma.seed": str(config.seed),
                    "clma.config_fingerprint": config.fingerprint(),
                    "clma.region_partition.version": fed.partition.version,
                    "clma.region_partition.content_hash": fed.partition.content_hash,
                    "clma.prefect_flow_run_id": prefect_id or "",
                    "clma.cohorting": "clma" if config.cohort.enabled else "fedavg",
                    "clma.noise_source": "seeded-simulation"
                    if config.evaluation.noise_seeded
                    else "opendp",
                    "clma.sim_truth_metrics": "true",
                    "clma.probe_sha256": probe_sha256(fed),
                },
                parent_run_id=parent_mlflow_run_id,
            )
            if budget is not None:
                tracker.set_tags(budget.tags())
    except BaseException:
        # release the state-dir lock (a long-lived `clma serve` process would otherwise
        # refuse every later run of this federation) and close the MLflow run if it opened
        if tracker is not None:
            with contextlib.suppress(Exception):
                tracker.finish("FAILED")
        session.close("FAILED")
        raise
    records: list[RoundRecord] = []
    status = "FAILED"
    runner = ClientRunner()  # client tasks: thread pool, or Dask (tasks/scale_out.py)
    try:
        runner = open_client_runner(config)
        run_round = runner.apply(round_flow)
        for r in range(first_round, session.last_round(max_new_rounds) + 1):
            session.round_started(r)
            rec = run_round(fed, r, on_divergence=on_divergence, budget=budget)
            records.append(rec)
            if tracker:
                tracker.log_metrics(_round_metrics(rec), step=r)
                if rec.regional:
                    tracker.log_dict(rec.regional, f"reports/round_{r:03d}.json")
            if rec.evaluation is not None:  # envelopes + alerts (MLflow and out folder)
                log_evaluation(rec.evaluation, tracker, out_dir)
            if budget is not None:
                report_budget_round(budget, tracker, r)
            session.round_done(fed, rec, tracker, budget)  # lineage, dashboards, commit
            if on_round:
                on_round(rec)
        status = "FINISHED"
    finally:
        runner.close()
        if tracker:
            if records:
                tracker.log_dict(cohort_history_artifact(fed), "cohort_history.json")
            tracker.finish(status)
        session.close(status)
    summary = build_summary(
        fed,
        session.previous_records(RoundRecord) + records,
        mlflow_run_id=tracker.run_id if tracker else None,
        tracking_uri=tracker.tracking_uri if tracker else None,
        prefect_flow_run_id=prefect_id,
    )
    if tracker:
        tracker.client.log_dict(tracker.run_id, summary, "summary.json")
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        tmp.replace(out / "summary.json")
    return summary


def run_federation(config: FederationConfig, out_dir: str | None = None, **kw: Any) -> dict:
    """Run :func:`federation_flow` (convenience for scripts and tests)."""
    return federation_flow(config, out_dir=out_dir, **kw)
