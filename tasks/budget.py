"""Prefect tasks of the privacy budget: charge every release before its noise is drawn.

The federation's :class:`~clma.budget.PrivacyLedger` (SQLite, in ``budget.state_dir``)
and its :class:`~clma.budget.PrivacyPolicy` (``budget.policy``, default the shipped
``clma/policy/privacy_policy_v1.toml``) live in a :class:`BudgetState` opened once per
federation run (:func:`open_budget`).

Rounds. The flow counts rounds from 1; the ledger from 0: ledger round =
``round_number - 1`` and the budget epoch is ``(round_number - 1) // epoch_length_rounds``
(:func:`ledger_round`).

Evaluation (:func:`budgeted_evaluation`). The round's releases come from
``tasks.evaluate.planned_releases(fed, round_number)`` when that function exists, else from
what :func:`tasks.evaluate.evaluate_regions_task` releases (one regional Laplace release
per metric at ``evaluation.epsilon``, parallel composition across regions). For each
release, in order:

1. a regional release on a round off the policy's ``regional_cadence_rounds`` is skipped
   (``off_cadence``; nothing charged, nothing drawn);
2. the charge is reserved with the idempotency key ``(epoch, round, release name)``
   (``evaluation.global`` or ``evaluation.regional`` line; regional charges carry the
   client -> region membership so a client moving region switches the line to the sum);
3. a charge refused because the line would exceed its cap goes to the borrowing gate
   (``gate``: :func:`flows.approval.borrow_gate`) once per budget epoch: not after a
   borrow was approved in this epoch (a second one would be refused) nor after a refused
   request (training is already frozen) — the ledger's borrow records make that durable
   across re-runs; if the borrow is approved the charge is reserved again;
4. only a granted reservation draws noise (``tasks.evaluate.draw_planned``); its
   server-side results (exact counts included: the ledger is server-side state, nothing
   of it is published) are committed into the ledger and recorded into the round from
   what the ledger holds (``tasks.evaluate.restore_planned``). A re-run (Prefect retry,
   restart after a crash) finds the release committed, records the stored results
   without drawing noise (``republished``), and the round publishes the same values,
   envelopes and alert decisions as the run that drew them; a refused release draws no
   noise and is reported (``refused`` with the reason).

Training (:func:`dp_aggregate_task`): with ``training.dp.enabled``, DP-FedAvg
(:func:`clma.rounds.dp_aggregate_per_cohort`) after one training charge per round
(``MechanismEvent.gaussian(noise_multiplier, sampling_probability=participation)``). A
refused charge (line exhausted, or frozen after a refused borrow) means *training backs
off*: no aggregation this round, every cohort keeps its model; evaluation continues on its
own lines. The released models are committed into the ledger, so a re-run republishes
them instead of drawing new noise.

Reporting (:func:`report_budget_round`): the ledger table in MLflow (``log_table``,
``budget/ledger.json``), the decisions (``budget/decisions.json``), per-line metrics, tags
for the policy and every borrowing decision, and a Prefect table artifact every round.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict, Field, model_validator

from clma.budget import (
    BorrowDecision,
    BorrowRequest,
    LineItem,
    MechanismEvent,
    PrivacyLedger,
    PrivacyPolicy,
    Reservation,
    default_policy,
    load_policy,
)
from clma.config import FederationConfig
from clma.rounds import ClientUpdate, dp_aggregate_per_cohort, dp_fedavg
from clma.sim.federation import ClientEvaluation, SimulatedFederation
from tasks import evaluate

__all__ = [
    "TRAINING_RELEASE",
    "BudgetState",
    "ReleasePlan",
    "budgeted_evaluation",
    "dp_aggregate_task",
    "ledger_round",
    "open_budget",
    "planned_releases",
    "prefect_artifact_key",
    "regional_on_cadence",
    "report_budget_round",
]

TRAINING_RELEASE = "training.dp-fedavg"
_TASK = {"cache_policy": NO_CACHE, "persist_result": False}


# --------------------------------------------------------------------------- state


@dataclass
class BudgetState:
    """The ledger, its policy and the run's budget settings (one per federation run).

    ``events`` collects what the ledger does not hold itself (releases skipped off the
    regional cadence, how each borrow request was put to the gate) for
    ``budget/decisions.json``.
    """

    ledger: PrivacyLedger
    policy: PrivacyPolicy
    config: FederationConfig
    state_dir: Path
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ledger_path(self) -> Path:
        return self.ledger.path

    def tags(self) -> dict[str, str]:
        """MLflow tags: policy version and content hash, ledger path, gate mode, DP."""
        dp = self.config.training.dp
        return {
            "clma.policy.version": self.policy.policy_version,
            "clma.policy.content_hash": self.policy.content_hash,
            "clma.policy.rules_hash": self.policy.rules_hash,
            "clma.policy.source": self.policy.source,
            "clma.budget.ledger_path": str(self.ledger_path),
            "clma.budget.approval_gate": self.config.budget.approval_gate,
            "clma.training.dp": "dp-fedavg" if dp.enabled else "off",
            "clma.training.dp.noise_source": (
                "seeded-simulation" if dp.noise_seeded else "opendp"
            ) if dp.enabled else "none",
        }

    def approval_timeout(self) -> int:
        """Pause timeout (s): ``budget.approval_timeout_seconds`` or the policy's."""
        t = self.config.budget.approval_timeout_seconds
        return int(t if t is not None else self.policy.borrowing.approval_timeout_seconds)


def open_budget(config: FederationConfig) -> BudgetState:
    """Open (or create) the federation's ledger under ``budget.state_dir`` (a fresh
    temporary folder when unset) with the configured policy. Raises
    :class:`clma.budget.PolicyError` for a bad policy file."""
    b = config.budget
    policy = load_policy(b.policy) if b.policy else default_policy()
    if b.state_dir:
        state_dir = Path(b.state_dir)
    else:
        state_dir = Path(tempfile.mkdtemp(prefix=f"clma-state-{config.name}-"))
    state_dir.mkdir(parents=True, exist_ok=True)
    ledger = PrivacyLedger(state_dir, policy)
    return BudgetState(ledger=ledger, policy=policy, config=config, state_dir=state_dir)


def ledger_round(round_number: int) -> int:
    """Ledger round (from 0) of a flow round (from 1). Raises ValueError below 1."""
    if type(round_number) is not int or round_number < 1:
        raise ValueError("round_number: flow rounds are integers from 1")
    return round_number - 1


def regional_on_cadence(policy: PrivacyPolicy, round_number: int) -> bool:
    """Whether the policy allows regional releases in this flow round: every
    ``regional_cadence_rounds`` rounds, i.e. flow rounds k, 2k, 3k, ... -- the same
    convention as the config's ``evaluation.every``, so that ``every = k`` meets the
    policy's cadence (counting from the ledger's 0-based rounds instead made ``every = 2``
    fall on off-cadence rounds only)."""
    ledger_round(round_number)  # validates the flow round
    return round_number % policy.evaluation.regional_cadence_rounds == 0


# --------------------------------------------------------------------------- release plan


class ReleasePlan(BaseModel):
    """One release of a round as the ledger sees it (no values, no counts).

    ``name`` is unique within the round (idempotency key); ``metric`` names the metric;
    ``scope`` ``global`` (one release over the cohort) or ``regional`` (one per region,
    parallel composition); ``mechanism`` ``laplace`` (``epsilon``) or ``gaussian``
    (``noise_multiplier`` = sigma / L2 sensitivity, with ``delta`` accounted by the line).
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: Annotated[str, Field(min_length=1, max_length=200)]
    metric: Annotated[str, Field(min_length=1, max_length=100)]
    scope: Literal["global", "regional"]
    mechanism: Literal["laplace", "gaussian"] = "laplace"
    epsilon: Annotated[float, Field(gt=0.0, le=1e6)] | None = None
    delta: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    noise_multiplier: Annotated[float, Field(gt=0.0, le=1e6)] | None = None

    @model_validator(mode="after")
    def _parameters(self) -> ReleasePlan:
        if self.mechanism == "laplace" and self.epsilon is None:
            raise ValueError("a laplace release needs epsilon")
        if self.mechanism == "gaussian" and self.noise_multiplier is None:
            raise ValueError("a gaussian release needs noise_multiplier")
        return self

    @property
    def line(self) -> LineItem:
        return LineItem.EVALUATION_GLOBAL if self.scope == "global" else LineItem.EVALUATION_REGIONAL

    def event(self) -> MechanismEvent:
        if self.mechanism == "laplace":
            return MechanismEvent.laplace(float(self.epsilon))  # type: ignore[arg-type]
        return MechanismEvent.gaussian(float(self.noise_multiplier))  # type: ignore[arg-type]


def planned_releases(fed: SimulatedFederation, round_number: int) -> list[ReleasePlan]:
    """The releases the evaluation path makes this round
    (``tasks.evaluate.planned_releases``: one entry per (scope, metric), known before the
    round's data), as :class:`ReleasePlan`s."""
    out = []
    for item in evaluate.planned_releases(fed, round_number):
        data = dict(item)
        data.setdefault("metric", data.get("name"))
        out.append(ReleasePlan.model_validate(data))
    return out


# --------------------------------------------------------------------------- evaluation


def _reserve(
    fed: SimulatedFederation, budget: BudgetState, plan: ReleasePlan, round_number: int,
    evaluations: Sequence[ClientEvaluation],
) -> Reservation:
    """Phase 1 of one release: a global charge, or a regional charge with one event per
    region that has evaluators (parallel composition) and the client -> region map."""
    r = ledger_round(round_number)
    if plan.scope == "global":
        return budget.ledger.reserve(r, plan.name, LineItem.EVALUATION_GLOBAL, [plan.event()])
    regions = sorted({e.region for e in evaluations}) or sorted(fed.partition.region_ids)
    membership = {str(e.client_id): e.region for e in evaluations}
    return budget.ledger.reserve(
        r, plan.name, LineItem.EVALUATION_REGIONAL, {g: plan.event() for g in regions},
        membership=membership,
    )


@task(name="charge-evaluation", **_TASK)
def charge_evaluation_task(
    fed: SimulatedFederation, budget: BudgetState, plan: ReleasePlan, round_number: int,
    evaluations: list[ClientEvaluation],
) -> Reservation | None:
    """Reserve one release in the ledger (phase 1, before its noise). ``None``: a
    regional release off the policy's cadence (nothing charged)."""
    if plan.scope == "regional" and not regional_on_cadence(budget.policy, round_number):
        return None
    return _reserve(fed, budget, plan, round_number, evaluations)


def _draw_release(
    fed: SimulatedFederation, evaluations: Sequence[ClientEvaluation], round_number: int,
    plan: ReleasePlan,
) -> dict[str, Any]:
    """Draw one granted release; returns the server-side payload the ledger stores with
    its commit (``tasks.evaluate.draw_planned``)."""
    return evaluate.draw_planned(fed, evaluations, round_number, plan)


def _restore_release(
    fed: SimulatedFederation, evaluations: Sequence[ClientEvaluation], round_number: int,
    plan: ReleasePlan, stored: dict[str, Any],
) -> dict[str, Any]:
    """Record a committed release into the round without noise
    (``tasks.evaluate.restore_planned``); returns its published view."""
    return evaluate.restore_planned(fed, evaluations, round_number, plan, stored)


@task(name="release-evaluation", **_TASK)
def release_evaluation_task(
    fed: SimulatedFederation, evaluations: list[ClientEvaluation], round_number: int,
    plan: ReleasePlan, reservation: Reservation,
) -> dict[str, Any]:
    """Phase 2 of one granted release: draw the noise, commit the server-side payload
    into the ledger, then record and return (published view) what the ledger holds --
    the first committed payload wins, so the round always publishes the committed values."""
    if not reservation.may_draw_noise:
        raise ValueError("reservation: only a granted reservation may draw noise")
    payload = _draw_release(fed, evaluations, round_number, plan)
    stored = reservation.commit(json.dumps(payload, sort_keys=True, allow_nan=False))
    return _restore_release(fed, evaluations, round_number, plan,
                            json.loads(stored) if stored is not None else payload)


@task(name="republish-evaluation", **_TASK)
def republish_evaluation_task(
    fed: SimulatedFederation, evaluations: list[ClientEvaluation], round_number: int,
    plan: ReleasePlan, reservation: Reservation,
) -> dict[str, Any] | None:
    """A release already committed (re-run after a crash, Prefect retry): record the
    stored payload into the round without drawing noise, so the round's report,
    envelopes and alerts carry exactly the committed values. ``None``: nothing stored."""
    if not reservation.already_committed:
        raise ValueError("reservation: only a committed reservation can be republished")
    if not reservation.stored_result:
        return None
    return _restore_release(fed, evaluations, round_number, plan,
                            json.loads(reservation.stored_result))


def _borrow_amount(
    budget: BudgetState, plans: Sequence[ReleasePlan], round_number: int, line: LineItem,
    reservation: Reservation,
) -> float:
    """Epsilon to ask for: the refused release's shortfall plus what this line's pure
    (Laplace) releases need in the epoch's remaining rounds of this run, capped at the
    policy's limit (``max_fraction_of_next_epoch`` of the next epoch's line); a shortfall
    above the limit is asked as is (and refused by the rule)."""
    cap = float(reservation.line_cap_epsilon or 0.0)
    after = float(reservation.line_epsilon_after or cap)
    # a hair above the exact shortfall, so that cap + borrow >= need survives rounding
    shortfall = max(after - cap, 0.0) + 1e-9 * max(1.0, after)
    policy, cfg = budget.policy, budget.config
    epoch = policy.epoch_of_round(ledger_round(round_number))
    per_round = math.fsum(
        float(p.epsilon) for p in plans if p.line is line and p.mechanism == "laplace"  # type: ignore[arg-type]
    )
    later = 0
    for rn in range(round_number + 1, cfg.rounds + 1):
        if policy.epoch_of_round(ledger_round(rn)) != epoch:
            break
        if rn % cfg.evaluation.every != 0:
            continue
        if line is LineItem.EVALUATION_REGIONAL and not regional_on_cadence(policy, rn):
            continue
        later += 1
    limit = policy.borrowing.max_fraction_of_next_epoch * policy.line_cap(line)[0]
    if shortfall > limit:
        return shortfall
    return min(shortfall + later * per_round, limit)


def _gate_skip_reason(budget: BudgetState, epoch: int, line: LineItem) -> str | None:
    """Why no approver is asked (durable: read from the ledger's borrow records): the
    policy allows no borrowing, a borrow was already approved this epoch (a second one
    would be refused), or a request was already decided this epoch (approvers are asked
    at most once per epoch; after a refusal training is frozen for the epoch anyway)."""
    if budget.policy.borrowing.max_borrows_per_epoch == 0:
        return "borrowing_disabled_by_policy"
    borrows = budget.ledger.borrows(epoch)
    if any(b["approved"] for b in borrows):
        return "already_borrowed_this_epoch"
    if borrows:
        return "already_decided_this_epoch"
    return None


def budgeted_evaluation(
    fed: SimulatedFederation,
    budget: BudgetState,
    evaluations: list[ClientEvaluation],
    round_number: int,
    *,
    gate: Callable[[BudgetState, BorrowRequest], BorrowDecision] | None = None,
    run_id: str = "",
) -> dict[str, Any]:
    """The round's evaluation releases, each charged before its noise (see module doc).

    Call it from the round's flow body (the gate may pause the run). Returns the
    published view ``{"round", "metrics": {metric: report}, "epsilon_spent", "budget":
    {"released", "republished", "refused": {name: reason}, "off_cadence", "borrows"}}``;
    ``epsilon_spent`` counts this run's granted charges (republished ones excluded).
    """
    plans = planned_releases(fed, round_number)
    epoch = budget.policy.epoch_of_round(ledger_round(round_number))
    info: dict[str, Any] = {
        "released": [], "republished": [], "refused": {}, "off_cadence": [], "borrows": [],
        "policy_version": budget.policy.policy_version,
    }
    out: dict[str, Any] = {"round": round_number, "metrics": {}, "epsilon_spent": 0.0}
    for plan in plans:  # one at a time: charge, (gate), draw, commit
        res = charge_evaluation_task(fed, budget, plan, round_number, evaluations)
        if res is None:
            info["off_cadence"].append(plan.name)
            budget.events.append({"kind": "release_off_cadence", "round": round_number,
                                  "release": plan.name, "epoch": epoch})
            continue
        skip = (_gate_skip_reason(budget, epoch, plan.line)
                if res.refused and res.refusal == "exceeds_line_cap" and gate is not None
                else "no_gate")
        if res.refused and skip not in (None, "no_gate"):
            budget.events.append({"kind": "borrow_not_requested", "round": round_number,
                                  "epoch": epoch, "line": plan.line.value,
                                  "release": plan.name, "reason": skip})
        if res.refused and skip is None and gate is not None:
            request = BorrowRequest(
                epoch=epoch, line=plan.line,
                epsilon=_borrow_amount(budget, plans, round_number, plan.line, res),
                run_id=run_id[:128],
                reason=f"round {round_number}: release '{plan.name}' would exceed "
                       f"the {plan.line.value} line of epoch {epoch}",
            )
            decision = gate(budget, request)
            info["borrows"].append(decision.model_dump(mode="json"))
            if decision.approved:
                res = _reserve(fed, budget, plan, round_number, evaluations)
        if res.already_committed:
            out["metrics"][plan.metric] = republish_evaluation_task(
                fed, evaluations, round_number, plan, res
            )
            info["republished"].append(plan.name)
        elif res.may_draw_noise:
            out["metrics"][plan.metric] = release_evaluation_task(
                fed, evaluations, round_number, plan, res
            )
            info["released"].append(plan.name)
            out["epsilon_spent"] += float(plan.epsilon or 0.0)
        else:
            info["refused"][plan.name] = res.refusal
    out["metrics"] = {k: v for k, v in out["metrics"].items() if v is not None}
    out["budget"] = info
    return out


# --------------------------------------------------------------------------- training


def _encode_models(models: Mapping[int, np.ndarray]) -> str:
    return json.dumps({
        str(k): base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode("ascii")
        for k, v in sorted(models.items())
    }, sort_keys=True)


def _decode_models(payload: str) -> dict[int, np.ndarray]:
    return {
        int(k): np.frombuffer(base64.b64decode(v), dtype="<f4").astype(np.float32)
        for k, v in json.loads(payload).items()
    }


@task(name="dp-aggregate-per-cohort", **_TASK)
def dp_aggregate_task(
    fed: SimulatedFederation,
    budget: BudgetState | None,
    updates: Sequence[ClientUpdate],
    quarantined: Sequence[int],
    cohort_models: Mapping[int, np.ndarray],
    round_number: int,
    weights: Mapping[int, float] | None = None,
) -> tuple[dict[int, np.ndarray], dict[str, Any]]:
    """DP-FedAvg per cohort after one training charge (see module doc).

    ``weights`` (divergence action): clients with weight 0 are left out like quarantined
    ones; DP-FedAvg weighs the remaining clients equally (a down-weight would change the
    sensitivity, so it is not applied).

    Returns the new cohort models and ``{"status": "aggregated" | "republished" |
    "backed_off", "reason", "sigma": {cohort: sigma}, "n_clipped", "noise_source"}``.
    ``budget=None`` aggregates without charging (no ledger configured).

    The charge is reserved (phase 1) before any noise is drawn but committed only by
    :func:`dp_commit_training`, after cohorting, with every model the round releases under
    DP (these cohorts and the cohorts created this round), so a crash re-run republishes
    all of them and draws no new noise. Until then the info dict carries the reservation
    (``"reservation"``, in memory only) and the released models (``"released"``); on a
    re-run of a committed round, ``"stored_new"`` holds the stored models of the cohorts
    created in that round (used by :func:`dp_new_cohort_model`).
    """
    cfg = fed.config
    dp = cfg.training.dp
    res: Reservation | None = None
    if budget is not None:
        res = budget.ledger.reserve(
            ledger_round(round_number), TRAINING_RELEASE, LineItem.TRAINING,
            [MechanismEvent.gaussian(dp.noise_multiplier, cfg.training.participation)],
        )
        if res.refused:
            budget.events.append({"kind": "training_backed_off", "round": round_number,
                                  "epoch": res.epoch, "reason": res.refusal})
            return dict(cohort_models), {"status": "backed_off", "reason": res.refusal}
        if res.already_committed and res.stored_result:
            models = dict(cohort_models)
            stored = _decode_models(res.stored_result)
            models.update({c: v for c, v in stored.items() if c in cohort_models})
            return models, {"status": "republished", "reason": None,
                            "stored_new": {c: v for c, v in stored.items()
                                           if c not in cohort_models}}
    seed = (
        int(np.random.default_rng([cfg.seed, round_number, 211]).integers(2**31))
        if dp.noise_seeded else None
    )
    held = sorted(set(quarantined) | {c for c, w in (weights or {}).items() if w == 0})
    models, results = dp_aggregate_per_cohort(
        updates, held, cohort_models, clipping_bound=dp.clipping_bound,
        noise_multiplier=dp.noise_multiplier, seed=seed,
    )
    info: dict[str, Any] = {
        "status": "aggregated", "reason": None,
        "sigma": {str(c): r.sigma for c, r in results.items()},
        "n_clipped": sum(r.n_clipped for r in results.values()),
        "noise_source": "seeded-simulation" if seed is not None else "opendp",
    }
    if res is not None:  # committed by dp_commit_training, after cohorting
        info["reservation"] = res
        info["released"] = {c: models[c] for c in results}
    return models, info


def dp_commit_training(training: dict[str, Any], models: Mapping[int, np.ndarray],
                       new_cohorts: Mapping[int, Any]) -> dict[int, np.ndarray]:
    """Commit the round's training charge with every model it released (phase 2).

    Args:
        training: the info dict of :func:`dp_aggregate_task` (no reservation: nothing to
            commit, e.g. backed off, republished or no ledger).
        models: cohort id -> model after cohorting (float32 vectors).
        new_cohorts: the cohorts created this round (``CohortingOutcome.new_cohorts``);
            their models were released by :func:`dp_new_cohort_model`.

    Returns:
        ``models`` with the stored payload applied: if another attempt committed the same
        key first, its models are the ones to publish.
    """
    res = training.pop("reservation", None)
    out = dict(models)
    if res is None:
        return out
    released = {**training.pop("released", {}), **{int(c): out[int(c)] for c in new_cohorts}}
    stored = res.commit(_encode_models(released))
    if stored is not None:
        out.update({c: v for c, v in _decode_models(stored).items() if c in out})
    return out


def dp_new_cohort_model(fed: SimulatedFederation, training: Mapping[str, Any],
                        round_number: int) -> Callable[[int, list[ClientUpdate], np.ndarray],
                                                       np.ndarray]:
    """The ``new_model`` hook of :func:`clma.rounds.cohort_quarantined` under DP-FedAvg.

    A cohort created this round releases its model through the same DP step as every
    other cohort (:func:`clma.rounds.dp_fedavg` on its members' updates against the
    source cohort's start model); its clients are disjoint from the cohorts already
    aggregated, so the round's single training charge covers it. When training backed off
    (``training["status"] == "backed_off"``), the new cohort starts from the source
    model unchanged (nothing is released). Noise: seeded per (seed, round, cohort) when
    ``training.dp.noise_seeded``, else OpenDP. The model is stored in the ledger with the
    round's training charge (:func:`dp_commit_training`); on a crash re-run of a committed
    round the stored model is republished and no new noise is drawn.
    """
    dp = fed.config.training.dp

    def build(new_id: int, members: list[ClientUpdate], reference: np.ndarray) -> np.ndarray:
        if training.get("status") == "backed_off":
            return np.asarray(reference, dtype=np.float32).copy()
        stored = training.get("stored_new", {})
        if int(new_id) in stored:
            return stored[int(new_id)].copy()
        seed = (np.random.default_rng([fed.config.seed, round_number, 223, int(new_id)])
                if dp.noise_seeded else None)
        return dp_fedavg([u.params for u in members], reference,
                         clipping_bound=dp.clipping_bound,
                         noise_multiplier=dp.noise_multiplier, seed=seed).model

    return build


# --------------------------------------------------------------------------- reporting


def prefect_artifact_key(name: str) -> str:
    """Prefect artifact key for a federation: lowercase letters, digits and dashes."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "federation"
    digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:8]
    return f"privacy-ledger-{slug[:40]}-{digest}"


def decisions_document(budget: BudgetState) -> dict[str, Any]:
    """``budget/decisions.json``: borrowing decisions (approver, reason), ledger
    decisions (refusals, freezes) and skipped releases, with the policy version."""
    return {
        "policy_version": budget.policy.policy_version,
        "policy_content_hash": budget.policy.content_hash,
        "borrows": budget.ledger.borrows(),
        "ledger_decisions": budget.ledger.decisions(),
        "flow_events": list(budget.events),
    }


def report_budget_round(budget: BudgetState, tracker: Any | None, round_number: int) -> None:
    """Report the ledger after a round: MLflow table + decisions + metrics + borrow tags
    (when ``tracker`` is a :class:`tasks.tracking.FederationTracker`) and a Prefect table
    artifact (always; requires a Prefect API, which every flow run has)."""
    rows = budget.ledger.table()
    if tracker is not None and tracker.run_id:
        tracker.client.log_table(
            tracker.run_id, data=budget.ledger.table_columns(), artifact_file="budget/ledger.json"
        )
        tracker.log_dict(decisions_document(budget), "budget/decisions.json")
        epoch = budget.policy.epoch_of_round(ledger_round(round_number))
        metrics = {}
        for row in rows:
            if row.epoch == epoch:
                metrics[f"budget.{row.line_item}.spent_epsilon"] = row.spent_epsilon
                metrics[f"budget.{row.line_item}.remaining_epsilon"] = row.remaining_epsilon
        tracker.log_metrics(metrics, step=round_number)
        tags = {}
        for b in budget.ledger.borrows():
            key = f"clma.budget.borrow.e{b['epoch']}.{b['line']}"
            tags[f"{key}.decision"] = "approved" if b["approved"] else f"refused:{b['refusal']}"
            tags[f"{key}.approver"] = b["approver"] or ""
            tags[f"{key}.reason"] = (b["approver_reason"] or "")[:1000]
            tags[f"{key}.epsilon"] = repr(float(b["epsilon"]))
        if tags:
            tracker.set_tags(tags)
    from prefect.artifacts import create_table_artifact

    create_table_artifact(
        key=prefect_artifact_key(budget.config.name),
        table=[r.model_dump(mode="json") for r in rows],
        description=(
            f"Privacy ledger after round {round_number} (per client; epsilon). Policy "
            f"{budget.policy.policy_version}, content hash {budget.policy.content_hash[:12]}."
        ),
    )
