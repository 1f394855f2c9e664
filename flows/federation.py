"""Prefect flows: one federated round, and a federation of N rounds.

``federation_flow`` opens the transport (simulated clients by default), the server's
round engine (:class:`clma.engine.FederationEngine`) and one MLflow run, and runs
``round_flow`` once per round. Each round is its own Prefect flow run, nested under the
federation's, whose tasks are the engine's steps, in order: select-clients,
train-clients (one task run for in-process clients, else mapped over chunks of
clients: :func:`tasks.round.train_task_chunks`), detect-drift, score-divergence,
aggregate-per-cohort, cohort, merge-cohorts, then on evaluation rounds
secure-aggregation and the ledger's charge-evaluation / release-evaluation steps (or
evaluate-regions without a ledger). Each round run is named ``<federation>-round-<r>`` and
tells its story on itself (:mod:`tasks.story`: run logs, a markdown and a table artifact
with the bands, splits, merges and every release published or refused with its reason).
The federation run ``<federation>-seed<seed>`` logs what it runs (rounds, clients,
transport, noise source, MLflow run), one line per committed round (cohort ids, how many
releases were published / refused / not released, the round run's name) and how it ended.
It runs on the embedded default: with no
``PREFECT_API_URL`` Prefect starts a temporary local API; nothing to start by hand.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.runtime import flow_run
from prefect.utilities.annotations import quote

from clma.config import ConfigError, FederationConfig
from clma.divergence import probe_digest
from clma.engine import FederationEngine, RoundResult, open_budget
from clma.engine.divergence import DivergenceOutcome
from clma.release import count_band
from flows.transport import Transport, open_transport
from tasks.budget import report_budget_round
from tasks.durable import FederationSession
from tasks.evaluate import evaluate_regions, log_evaluation, secure_aggregation_task
from tasks.round import (
    aggregate_task,
    cohort_task,
    detect_drift_task,
    merge_task,
    prefect_step,
    score_divergence_task,
    select_clients_task,
    train_clients_task,
    train_task_chunks,
)
from tasks.story import federation_round_line, publish_round_story, round_story, run_logger
from tasks.tracking import FederationTracker, error_bar_key

__all__ = ["RoundRecord", "federation_flow", "round_flow", "run_federation", "SUMMARY_SCHEMA"]

SUMMARY_SCHEMA = "clma.summary/2"
LEDGER_SUBDIR = "ledger"  # the ledger of a run without a state dir: <out>/ledger


@dataclass
class RoundRecord:
    """What one round produced (server side: exact counts, kept in the server's state
    folder; everything published from it goes through :func:`published_round`, which
    shows participant bands instead of counts)."""

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
    evaluation: Any = None  # clma.engine.EvaluationOutcome (envelopes, alerts, releases)

    @classmethod
    def from_result(cls, res: RoundResult, truth: dict[str, Any]) -> RoundRecord:
        return cls(round=res.round, cohorts=res.cohorts, flagged=res.flagged,
                   quarantined=res.quarantined, new_cohorts=res.new_cohorts,
                   merges=res.merges, regional=res.regional, truth=truth,
                   seconds=res.seconds, divergence=res.divergence, evaluation=res.evaluation)


def _truth(transport: Transport, engine: FederationEngine, round_number: int,
           participants: list[int]) -> dict[str, Any]:
    """Simulation ground truth of a round (empty for real clients): accuracy of the
    stationary and drifted clients, and the cohorts' agreement with the injected
    families at a drift event."""
    sim, view = transport.simulation, transport.truth
    if sim is None or view is None:
        return {}
    from clma.sim.truth import drift_event_ari, families_separated, mean_or_none

    reg = engine.state.registry
    assignments = {c: int(reg.cohort_of(c)) for c in participants}
    evaluations = view.truth(round_number, assignments, engine.state.cohort_models,
                             engine.config.evaluation.loss_max)
    acc = {e.client_id: e.accuracy for e in evaluations}
    drifted_now = sim.drifted_at(round_number)
    out: dict[str, Any] = {
        "stationary_accuracy": mean_or_none(
            [acc[c] for c in sim.stationary_clients(round_number) if c in acc]),
        "drifted_accuracy": mean_or_none(
            [acc[c] for c in sim.drifted_clients(round_number) if c in acc]),
    }
    if drifted_now:
        cohort_of = {c: reg.cohort_of(c) for c in drifted_now}
        out["drift_event"] = {
            "ari": drift_event_ari(drifted_now, cohort_of),
            "families_separated": families_separated(drifted_now, cohort_of),
            "n_drifted": len(drifted_now),
        }
    return out


@flow(name="clma-round", flow_run_name="{engine.config.name}-round-{round_number}")
def round_flow(
    engine: FederationEngine,
    transport: Transport,
    round_number: int,
    on_divergence: Callable[[DivergenceOutcome], None] | None = None,
) -> RoundRecord:
    """One federated round of CLMA (or plain FedAvg when cohorting is disabled): the
    engine's steps as Prefect tasks (module docstring).

    ``on_divergence`` (simulations, experiments) receives the round's full
    :class:`clma.engine.divergence.DivergenceOutcome`, client ids included; the record
    keeps only its id-free summary.
    """
    # Arguments go in quote(): Prefect would otherwise walk every argument's contents
    # (lists, dicts, dataclasses: the round context's updates, the secure sums) twice per
    # task looking for futures; there are none, and the task receives the object itself.
    eng = quote(engine)
    ctx = select_clients_task(eng, round_number)
    q = quote(ctx)
    per_task = train_task_chunks(ctx.selected, engine.config.orchestration.chunk_size,
                                 in_process=transport.executor == "in-process")
    if len(per_task) == 1:  # in-process clients: one task run, chunks in order
        replies = train_clients_task(eng, q, per_task[0])
    else:  # remote clients: one mapped task run per chunk, in parallel
        futures = [train_clients_task.submit(eng, q, chunks) for chunks in per_task]
        replies = [r for f in futures for r in f.result()]
    engine.accept(ctx, replies)
    detect_drift_task(eng, q)
    div = score_divergence_task(eng, q)
    if div is not None and on_divergence is not None:
        on_divergence(div)
    aggregate_task(eng, q)
    cohort_task(eng, q)
    merge_task(eng, q)  # also installs the models and records the round
    if engine.evaluation_due(round_number) and ctx.participants:
        from flows.approval import borrow_gate

        run_id = str(flow_run.id or "")
        # distributed DP: charged (borrow gate included) in the flow's body, before the
        # secure sums, so the server only unmasks what the ledger charged
        engine.charge_before_sums(ctx, gate=borrow_gate, run_id=run_id, step=prefect_step)
        sums = secure_aggregation_task(eng, q)
        evaluate_regions(engine, ctx, sums, gate=borrow_gate, run_id=run_id)
    result = engine.finish(ctx)
    rec = RoundRecord.from_result(result, _truth(transport, engine, round_number,
                                                 ctx.participants))
    m = engine.evaluator.min_cohort
    publish_round_story(round_story(published_round(rec, m), federation=engine.config.name,
                                    min_cohort=m,
                                    participants_band=count_band(len(ctx.participants), m)),
                        engine.config.name)
    return rec


def round_run_settings() -> contextlib.AbstractContextManager[Any]:
    """Prefect settings of a round's nested flow run: no heartbeat thread of its own.

    Prefect's flow engine starts a heartbeat thread per flow run (every
    ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` seconds, 180 by default) that sleeps in 1 s steps
    and is joined when the run ends, so every nested run waited 0.5 s on average for it
    (0.43 s per round measured, docs/overhead.md). The round runs in the federation run's
    process and thread, whose own heartbeat thread keeps running: a process that dies is
    still seen by the federation run's missing heartbeats (Prefect marks that run Crashed
    where a zombie-run automation is set up); the round run in progress stays Running and
    the federation run's log names the round it failed in.
    """
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    return temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


def _round_metrics(rec: RoundRecord) -> dict[str, float]:
    m: dict[str, float] = {  # counts of cohorts, never of clients (those are bands)
        "n_cohorts": len(rec.cohorts),
        "new_cohorts": len(rec.new_cohorts),
        "merges": len(rec.merges),
        "round_seconds": rec.seconds,
    }
    if rec.regional:
        for metric, rep in rec.regional["metrics"].items():
            for region, pub in rep["regions"].items():
                m[f"regional.{region}.{metric}"] = pub["value"]
                m[error_bar_key(f"regional.{region}.{metric}")] = pub["error_bar"]
    for k in ("stationary_accuracy", "drifted_accuracy"):
        if rec.truth.get(k) is not None:
            m[f"sim_truth.{k}"] = rec.truth[k]
    if "drift_event" in rec.truth:
        m["sim_truth.drift_event_ari"] = rec.truth["drift_event"]["ari"]
    if rec.divergence:  # distribution statistics only: no client, no count of clients
        for signal in ("representation", "parameter"):
            for k in ("median", "mad", "max_z"):
                v = rec.divergence[signal][k]
                if v is not None:
                    m[f"divergence.{signal}.{k}"] = v
    return m


_DIVERGENCE_COUNTS = ("n_flagged", "n_flagged_one_sided", "n_flagged_two_sided", "n_persistent",
                      "quarantined_atypical", "n_reweighted", "n_clients")


def _banded_divergence(div: dict[str, Any] | None, min_cohort: int) -> dict[str, Any] | None:
    """The id-free divergence summary with every count of clients as a band."""
    if div is None:
        return None
    out: dict[str, Any] = {}
    for k, v in div.items():
        if isinstance(v, dict):
            out[k] = _banded_divergence(v, min_cohort)
        elif k in _DIVERGENCE_COUNTS and isinstance(v, int):
            out[f"{k}_band"] = count_band(v, min_cohort)
        else:
            out[k] = v
    return out


def cohort_history_artifact(engine: FederationEngine) -> dict[str, Any]:
    """Cohort history without client ids or counts: per round, cohort id -> members' band;
    lineage events with the band of the clients concerned."""
    m = engine.evaluator.min_cohort
    return {
        "rounds": {
            str(r): {str(c): count_band(len(mem), m) for c, mem in cohorts.items()}
            for r, cohorts in engine.state.registry.history.items()
        },
        "lineage": [
            {
                "kind": e.kind,
                "round": e.round,
                "parents": e.parents,
                "children": e.children,
                "clients_band": count_band(len(e.clients), m),
                "reason": e.reason,
            }
            for e in engine.state.registry.lineage
        ],
    }


def noise_label(config: FederationConfig) -> dict[str, Any]:
    """Where the run's DP noise comes from, and whether its releases are private."""
    seeded = config.seeded_noise
    return {"source": "seeded-simulation" if seeded else "opendp", "private": not seeded,
            **({"warning": "seeded noise: reproducible and NOT private (experiments and "
                           "tests only)"} if seeded else {})}


def published_round(r: RoundRecord, min_cohort: int) -> dict[str, Any]:
    """One round as published (``summary.json``): every count of clients as a band
    (:func:`clma.release.count_band`), no client ids."""
    return {
        "round": r.round,
        "cohorts": {str(k): count_band(v, min_cohort) for k, v in sorted(r.cohorts.items())},
        "flagged_clients": count_band(r.flagged, min_cohort),
        "quarantined_clients": count_band(r.quarantined, min_cohort),
        "new_cohorts": {str(k): {"parent": v["parent"],
                                 "band": count_band(v["size"], min_cohort)}
                        for k, v in sorted(r.new_cohorts.items())},
        "merges": r.merges,
        "regional": r.regional,
        # atypical-client scores: distribution statistics and bands, no ids
        "divergence": _banded_divergence(r.divergence, min_cohort),
        "seconds": round(r.seconds, 3),
    }


def build_summary(
    engine: FederationEngine,
    transport: Transport,
    records: list[RoundRecord],
    *,
    mlflow_run_id: str | None,
    tracking_uri: str | None,
    prefect_flow_run_id: str | None,
) -> dict[str, Any]:
    """The ``summary.json`` document (schema ``clma.summary/2``, see README)."""
    cfg = engine.config
    partition = engine.assets.partition
    reg = engine.state.registry
    m = engine.evaluator.min_cohort
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
            "dataset": engine.assets.dataset_name,
            "cohorting": "clma" if cfg.cohort.enabled else "fedavg",
            "config_fingerprint": cfg.fingerprint(),
            "transport": transport.name,
            "executor": transport.executor,
            "noise": noise_label(cfg),
            "min_cohort": m,
            **({"transport_details": transport.details} if transport.details else {}),
        },
        "region_partition": {
            "version": partition.version,
            "content_hash": partition.content_hash,
            "source": partition.source,
        },
        "mlflow": {"run_id": mlflow_run_id, "tracking_uri": tracking_uri},
        "prefect": {"flow_run_id": prefect_flow_run_id},
        "rounds": [published_round(r, m) for r in records],
        "final_cohorts": {
            str(c): count_band(len(reg.members(c)), m) for c in reg.active_cohorts()
        },
        "sim_truth": None if transport.simulation is None else {
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
    transport: Transport | None = None,
) -> dict[str, Any]:
    """A federation of ``config.rounds`` rounds, tracked in one MLflow run.

    Writes ``summary.json`` (and the per-round regional reports) to ``out_dir`` when
    given and returns the summary dict.

    Durable state (``tasks/durable.py``, ``clma/state.py``): with ``state_dir`` the
    federation continues from the round committed there (``resume=True`` requires one,
    ``False`` refuses one, ``None`` accepts both), re-uses its MLflow run, runs at most
    ``max_new_rounds`` more rounds (up to ``config.rounds``) and commits the state
    atomically after each round.

    ``transport``: an open :class:`flows.transport.Transport` (the Flower ServerApp passes
    its SuperNodes); default: the one ``config.federation`` names, opened here and closed
    at the end.
    """
    import torch

    torch.set_num_threads(1)  # small models; also makes float results thread-independent
    session = FederationSession.open(  # durable state (None: off), lineage, dashboards
        config, state_dir, out_dir,
        require=None if resume is None else ("existing" if resume else "fresh"))
    tracker: FederationTracker | None = None
    budget = None
    own_transport = transport is None
    try:  # set-up; the round loop's own try/finally releases everything after it
        config = session.config  # with a state dir, the ledger lives in it
        refusal = config.seeded_noise_refusal(real_server=bool(os.environ.get("PREFECT_API_URL")))
        if refusal is not None:
            raise ConfigError(refusal)
        if transport is None:
            transport = open_transport(config, state_dir)
        if config.budget.enabled:  # budget.state_dir / the state dir, else <out>/ledger
            budget = open_budget(config, fresh=True, default_dir=(
                str(Path(out_dir) / LEDGER_SUBDIR) if out_dir else None))
        engine = FederationEngine(config, transport.assets, transport.clients, budget=budget,
                                  state=session.restore_state())
        session.attach_engine(engine)  # the differencing rule's write-ahead journal
        first_round = engine.state.rounds_done + 1
        prefect_id = str(flow_run.id) if flow_run.id else None
        if config.tracking.enabled:
            tracker = session.make_tracker()  # re-attaches to the federation's run on resume
            partition = transport.assets.partition
            tracker.start(
                config.tracking.experiment or config.name,
                run_name=f"{config.name}-seed{config.seed}",
                params=config.flat_params(),
                tags={
                    "clma.seed": str(config.seed),
                    "clma.config_fingerprint": config.fingerprint(),
                    "clma.region_partition.version": partition.version,
                    "clma.region_partition.content_hash": partition.content_hash,
                    "clma.prefect_flow_run_id": prefect_id or "",
                    "clma.cohorting": "clma" if config.cohort.enabled else "fedavg",
                    "clma.transport": transport.name,
                    "clma.noise_source": noise_label(config)["source"],
                    "clma.releases_private": str(noise_label(config)["private"]).lower(),
                    "clma.sim_truth_metrics": "true" if transport.simulation else "false",
                    "clma.probe_sha256": probe_digest(transport.assets.probe_x),
                },
                parent_run_id=parent_mlflow_run_id,
            )
            if budget is not None:
                tracker.set_tags(budget.tags())
            tracker.record_prefect_run(prefect_id, first_round)
    except BaseException:
        # release the state-dir lock (a long-lived `clma serve` process would otherwise
        # refuse every later run of this federation) and close the MLflow run if it opened
        if tracker is not None:
            with contextlib.suppress(Exception):
                tracker.finish("FAILED")
        if own_transport and transport is not None:
            with contextlib.suppress(Exception):
                transport.close()
        session.close("FAILED")
        if budget is not None:
            budget.close()  # a temporary ledger is removed
        raise
    records: list[RoundRecord] = []
    status = "FAILED"
    log = run_logger()  # the federation run's own logs (API-only under the quiet default)
    last = session.last_round(max_new_rounds)
    log.info(f"federation {config.name}: rounds {first_round} to {last} of {config.rounds}, "
             f"{config.clients} clients, transport {transport.name}, noise "
             f"{noise_label(config)['source']}; MLflow run "
             f"{tracker.run_id if tracker else 'off (tracking disabled)'}")
    try:
        for r in range(first_round, last + 1):
            session.round_started(r)
            with round_run_settings():
                rec = round_flow(engine, transport, r, on_divergence=on_divergence)
            records.append(rec)
            log.info(federation_round_line(published_round(rec, engine.evaluator.min_cohort),
                                           config.name))
            if tracker:
                tracker.log_metrics(_round_metrics(rec), step=r)
                if rec.regional:
                    tracker.log_dict(rec.regional, f"reports/round_{r:03d}.json")
            if rec.evaluation is not None:  # envelopes + alerts (MLflow and out folder)
                log_evaluation(rec.evaluation, tracker, out_dir)
            if budget is not None:
                report_budget_round(budget, tracker, r)
            session.round_done(engine, rec, tracker, last=r == last)  # lineage, dashboards, commit
            if on_round:
                on_round(rec)
        session.flush()  # the last dashboards drawn off the round, logged before the end
        status = "FINISHED"
        log.info(f"federation {config.name}: {len(records)} round(s) run, "
                 f"{engine.state.rounds_done} of {config.rounds} done")
    finally:
        if status != "FINISHED":
            log.warning(f"federation {config.name}: failed during round "
                        f"{first_round + len(records)}")
        if own_transport:
            transport.close()
        if tracker:
            if records:
                tracker.log_dict(cohort_history_artifact(engine), "cohort_history.json")
            tracker.finish(status)
        session.close(status)
        if budget is not None:
            budget.close()  # a temporary ledger is removed
    summary = build_summary(
        engine, transport,
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
