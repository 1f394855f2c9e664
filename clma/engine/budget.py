"""The privacy budget of a round: every release is charged before its noise is drawn.

The federation's :class:`~clma.budget.PrivacyLedger` (SQLite, in ``budget.state_dir``) and
its :class:`~clma.budget.PrivacyPolicy` (``budget.policy``, default the shipped
``clma/policy/privacy_policy_v3.toml``) live in a :class:`BudgetState` opened once per
federation run (:func:`open_budget`).

Rounds. Flows count rounds from 1, the ledger from 0: ledger round = ``round - 1`` and the
budget epoch is ``(round - 1) // epoch_length_rounds`` (:func:`ledger_round`).

Evaluation (:func:`budgeted_evaluation`). The round's ledger entries
(:func:`charge_plans`: one per (scope, metric), known before the round's data; a regional
entry covers every group at the full epsilon, parallel composition). For each entry, in
order:

1. an entry with nothing to release (every group of its scope below the floor, aborted or
   not evaluated: the round's secure sums are known before any charge) is skipped
   (``not_charged``: nothing charged for nothing); a regional entry on a round off the
   policy's ``regional_cadence_rounds`` is skipped (``off_cadence``; nothing charged,
   nothing drawn);
2. the charge is reserved with the idempotency key ``(epoch, round, entry name)``
   (regional charges carry the client -> region membership, so a client moving region
   switches the line to the sum);
3. a charge refused because the line would exceed its cap goes to the borrowing gate
   (``gate``) once per budget epoch: not after a borrow was approved in this epoch nor
   after a decided request (the ledger's borrow records make that durable); if the borrow
   is approved the charge is reserved again;
4. only a granted reservation draws noise (:meth:`PrivateEvaluator.draw`); its server-side
   results are committed into the ledger and recorded into the round from what the ledger
   holds (:meth:`PrivateEvaluator.restore`). A re-run (retry, restart after a crash) finds
   the entry committed, records the stored results without drawing noise
   (``republished``); a refused entry draws no noise and is reported with its reason.

Distributed mode (``evaluation.noise = "distributed"``): the server itself is what the
devices' noise protects against, so the noised regional entries go through steps 1-3
BEFORE secure aggregation (:func:`charge_distributed`), and only the metrics of freshly
granted entries are unmasked (:meth:`DistributedCharges.unmask`); step 4 then commits
them with the released results. A charged group lost to dropouts stays charged.

Training (:func:`dp_reserve` / :func:`dp_aggregate` / :func:`dp_commit`): with
``training.dp.enabled``, DP-FedAvg (:func:`clma.rounds.dp_aggregate_per_cohort`) after one
training charge per round. A refused charge means *training backs off*: no aggregation
this round, every cohort keeps its model; evaluation continues on its own lines. The
released models (new cohorts' included) are committed with the charge, so a re-run
republishes them instead of drawing new noise.
"""

from __future__ import annotations

import base64
import json
import math
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from clma.budget import (
    BorrowDecision,
    BorrowRequest,
    LineItem,
    MechanismEvent,
    PrivacyLedger,
    PrivacyPolicy,
    Reservation,
    ReservationStatus,
    default_policy,
    load_policy,
)
from clma.config import FederationConfig
from clma.engine.evaluation import (
    HEALTH_METRIC,
    HISTOGRAM_METRIC,
    SCALAR_METRICS,
    EvaluationRound,
    PrivateEvaluator,
)
from clma.privacy.distributed import rho_for_epsilon
from clma.rounds import (
    ClientUpdate,
    dp_aggregate_per_cohort,
    dp_fedavg,
    expected_participants,
)

__all__ = [
    "TRAINING_RELEASE",
    "BudgetState",
    "ChargePlan",
    "DistributedCharges",
    "Step",
    "budgeted_evaluation",
    "charge_distributed",
    "charge_plans",
    "decisions_document",
    "direct_step",
    "coarse_size",
    "dp_aggregate",
    "dp_commit",
    "dp_denominators",
    "dp_new_cohort_model",
    "ledger_round",
    "open_budget",
    "policy_of",
    "regional_on_cadence",
]

TRAINING_RELEASE = "training.dp-fedavg"

#: ``step(name, fn, *args)`` runs one named sub-step of a round; the orchestration layer
#: passes one that records it (a Prefect task of that name); :func:`direct_step` calls it.
Step = Callable[..., Any]


def direct_step(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` (the bare engine's step runner; ``name`` is ignored)."""
    return fn(*args, **kwargs)


# --------------------------------------------------------------------------- state


@dataclass
class BudgetState:
    """The ledger, its policy and the run's budget settings (one per federation run).

    ``events`` collects what the ledger does not hold itself (entries skipped off the
    regional cadence, how each borrow request was put to the gate).
    """

    ledger: PrivacyLedger
    policy: PrivacyPolicy
    config: FederationConfig
    state_dir: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    temporary: bool = False

    def close(self) -> None:
        """Remove a temporary ledger folder (``temporary``: no ``budget.state_dir`` and no
        ``default_dir``); a durable ledger is left in place."""
        if self.temporary:
            import shutil

            shutil.rmtree(self.state_dir, ignore_errors=True)

    @property
    def ledger_path(self) -> Path:
        return self.ledger.path

    def tags(self) -> dict[str, str]:
        """Tracking tags: policy version and content hash, ledger path, gate mode, DP."""
        dp = self.config.training.dp
        return {
            "clma.policy.version": self.policy.policy_version,
            "clma.policy.content_hash": self.policy.content_hash,
            "clma.policy.rules_hash": self.policy.rules_hash,
            "clma.policy.source": self.policy.source,
            "clma.budget.ledger_path": (
                "temporary (removed at the end of the run: no --out or state dir)"
                if self.temporary else str(self.ledger_path.resolve())),
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


def policy_of(config: FederationConfig) -> PrivacyPolicy:
    """The configured policy (``budget.policy``) or the shipped default. Raises
    :class:`clma.budget.PolicyError` for a bad policy file."""
    return load_policy(config.budget.policy) if config.budget.policy else default_policy()


LEDGER_FILES = ("privacy_ledger.sqlite", "privacy_ledger.sqlite-wal",
                "privacy_ledger.sqlite-shm", "privacy_ledger.sqlite-journal")


def open_budget(config: FederationConfig, *, default_dir: str | Path | None = None,
                fresh: bool = False) -> BudgetState:
    """Open (or create) the federation's ledger with the configured policy.

    Where: ``budget.state_dir`` when set (a durable ledger: reuse it to resume); else
    ``default_dir`` (``clma run`` passes ``<out>/ledger``); else a temporary folder that
    :meth:`BudgetState.close` removes (nothing is left behind, and the tracking tag says the
    ledger was temporary). ``fresh``: start ``default_dir`` empty -- the ledger files of an
    earlier run there are removed, so a new federation never republishes another run's
    stored releases (its idempotency keys are round and release, not the run).

    Raises :class:`clma.budget.PolicyError` for a bad policy file.
    """
    policy = policy_of(config)
    b = config.budget
    temporary = False
    if b.state_dir:
        state_dir = Path(b.state_dir)
    elif default_dir is not None:
        state_dir = Path(default_dir)
        if fresh and state_dir.is_dir():
            for name in LEDGER_FILES:
                (state_dir / name).unlink(missing_ok=True)
    else:
        state_dir = Path(tempfile.mkdtemp(prefix=f"clma-state-{config.name}-"))
        temporary = True
    state_dir.mkdir(parents=True, exist_ok=True)
    ledger = PrivacyLedger(state_dir, policy)
    return BudgetState(ledger=ledger, policy=policy, config=config, state_dir=state_dir,
                       temporary=temporary)


def ledger_round(round_number: int) -> int:
    """Ledger round (from 0) of a flow round (from 1). Raises ValueError below 1."""
    if type(round_number) is not int or round_number < 1:
        raise ValueError("round_number: flow rounds are integers from 1")
    return round_number - 1


def regional_on_cadence(policy: PrivacyPolicy, round_number: int) -> bool:
    """Whether the policy allows regional releases in this flow round: every
    ``regional_cadence_rounds`` rounds, i.e. flow rounds k, 2k, 3k, ... (the convention of
    ``evaluation.every``, so ``every = k`` meets the policy's cadence)."""
    ledger_round(round_number)
    return round_number % policy.evaluation.regional_cadence_rounds == 0


# --------------------------------------------------------------------------- charge plans


class ChargePlan(BaseModel):
    """One ledger charge of a round (no values, no counts): one (scope, metric) entry.

    ``name`` is unique within the round (idempotency key, ``"<scope>.<metric>"``);
    ``scope`` ``global`` (one release over the cohort) or ``regional`` (one per group,
    parallel composition); ``mechanism`` ``laplace`` (``epsilon``) or ``gaussian``
    (``noise_multiplier`` = sigma / L2 sensitivity, with ``delta`` accounted by the line).
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: Annotated[str, Field(min_length=1, max_length=200)]
    metric: Annotated[str, Field(min_length=1, max_length=100)]
    scope: Literal["global", "regional"]
    mechanism: Literal["laplace", "gaussian", "zcdp"] = "laplace"
    epsilon: Annotated[float, Field(gt=0.0, le=1e6)] | None = None
    delta: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    noise_multiplier: Annotated[float, Field(gt=0.0, le=1e6)] | None = None
    rho: Annotated[float, Field(gt=0.0, le=1e6)] | None = None

    @model_validator(mode="after")
    def _parameters(self) -> ChargePlan:
        if self.mechanism == "laplace" and self.epsilon is None:
            raise ValueError("a laplace release needs epsilon")
        if self.mechanism == "gaussian" and self.noise_multiplier is None:
            raise ValueError("a gaussian release needs noise_multiplier")
        if self.mechanism == "zcdp" and self.rho is None:
            raise ValueError("a zcdp release needs rho")
        return self

    @property
    def line(self) -> LineItem:
        return LineItem.EVALUATION_GLOBAL if self.scope == "global" else LineItem.EVALUATION_REGIONAL

    def event(self) -> MechanismEvent:
        if self.mechanism == "laplace":
            return MechanismEvent.laplace(float(self.epsilon))  # type: ignore[arg-type]
        if self.mechanism == "zcdp":
            return MechanismEvent.zcdp(float(self.rho))  # type: ignore[arg-type]
        return MechanismEvent.gaussian(float(self.noise_multiplier))  # type: ignore[arg-type]


def charge_plans(evaluator: PrivateEvaluator) -> list[ChargePlan]:
    """The round's ledger entries, known before the round's data: one per (scope,
    metric), ``name = metric = "<scope>.<metric>"``; the histogram when the clip bound is
    re-derived this evaluation. Groups that end up suppressed draw nothing."""
    ev = evaluator.config.evaluation
    eps_g = ev.global_epsilon if ev.global_epsilon is not None else ev.epsilon
    out = []
    for scope, eps in (("global", eps_g), ("regional", ev.epsilon)):
        for name in (*SCALAR_METRICS, HEALTH_METRIC):
            if evaluator.distributed and name in SCALAR_METRICS:
                # distributed DP: the regional releases are the devices' noise, charged as
                # rho-zCDP (clma.privacy.distributed); the global one is their sum
                # (post-processing, published with the regional entry, charged nothing)
                if scope == "regional":
                    out.append(ChargePlan(
                        name=f"{scope}.{name}", metric=f"{scope}.{name}", scope=scope,
                        mechanism="zcdp", epsilon=ev.epsilon, delta=ev.delta,
                        rho=rho_for_epsilon(ev.epsilon, ev.delta)))
                continue
            e = ev.health_epsilon if name == HEALTH_METRIC else eps
            out.append(ChargePlan(name=f"{scope}.{name}", metric=f"{scope}.{name}",
                                  scope=scope, epsilon=e))
    if evaluator.bounds_due():
        out.append(ChargePlan(name=f"global.{HISTOGRAM_METRIC}",
                              metric=f"global.{HISTOGRAM_METRIC}", scope="global",
                              epsilon=eps_g))
    return out


# --------------------------------------------------------------------------- evaluation


def _reserve(budget: BudgetState, plan: ChargePlan, round_number: int,
             region_of: Mapping[int, str], partition_regions: Sequence[str]) -> Reservation:
    """Phase 1 of one entry: a global charge, or a regional charge with one event per
    region that has participants (parallel composition) and the client -> region map."""
    r = ledger_round(round_number)
    if plan.scope == "global":
        return budget.ledger.reserve(r, plan.name, LineItem.EVALUATION_GLOBAL, [plan.event()])
    regions = sorted(set(region_of.values())) or sorted(partition_regions)
    membership = {str(c): reg for c, reg in sorted(region_of.items())}
    return budget.ledger.reserve(r, plan.name, LineItem.EVALUATION_REGIONAL,
                                 {g: plan.event() for g in regions}, membership=membership)


def charge_entry(budget: BudgetState, plan: ChargePlan, round_number: int,
                 region_of: Mapping[int, str], partition_regions: Sequence[str]
                 ) -> Reservation | None:
    """Reserve one entry in the ledger (phase 1, before its noise). ``None``: a regional
    entry off the policy's cadence (nothing charged)."""
    if plan.scope == "regional" and not regional_on_cadence(budget.policy, round_number):
        return None
    return _reserve(budget, plan, round_number, region_of, partition_regions)


def release_entry(evaluator: PrivateEvaluator, ev: EvaluationRound, plan: ChargePlan,
                  reservation: Reservation) -> dict[str, Any]:
    """Phase 2 of one granted entry: draw the noise, commit the server-side payload into
    the ledger, then record and return (published view) what the ledger holds -- the
    first committed payload wins, so the round always publishes the committed values."""
    if not reservation.may_draw_noise:
        raise ValueError("reservation: only a granted reservation may draw noise")
    payload = evaluator.draw(ev, plan.name)
    stored = reservation.commit(json.dumps(payload, sort_keys=True, allow_nan=False))
    return evaluator.restore(ev, plan.name, json.loads(stored) if stored is not None else payload)


def republish_entry(evaluator: PrivateEvaluator, ev: EvaluationRound, plan: ChargePlan,
                    reservation: Reservation) -> dict[str, Any] | None:
    """An entry already committed (re-run after a crash, retry): record the stored payload
    into the round without drawing noise. ``None``: nothing stored."""
    if not reservation.already_committed:
        raise ValueError("reservation: only a committed reservation can be republished")
    if not reservation.stored_result:
        return None
    return evaluator.restore(ev, plan.name, json.loads(reservation.stored_result))


def _borrow_amount(budget: BudgetState, plans: Sequence[ChargePlan], round_number: int,
                   line: LineItem, reservation: Reservation) -> float:
    """Epsilon to ask for: the refused entry's shortfall plus what this line's entries
    with an epsilon (Laplace, and zCDP entries at the epsilon they were calibrated to:
    basic composition, an upper bound of their RDP composition) need in the epoch's
    remaining rounds of this run, capped at the policy's limit
    (``max_fraction_of_next_epoch`` of the next epoch's line); a shortfall above the limit
    is asked as is (and refused by the rule)."""
    cap = float(reservation.line_cap_epsilon or 0.0)
    after = float(reservation.line_epsilon_after or cap)
    shortfall = max(after - cap, 0.0) + 1e-9 * max(1.0, after)
    policy, cfg = budget.policy, budget.config
    epoch = policy.epoch_of_round(ledger_round(round_number))
    per_round = math.fsum(
        float(p.epsilon) for p in plans
        if p.line is line and p.mechanism in ("laplace", "zcdp") and p.epsilon is not None
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


def _gate_skip_reason(budget: BudgetState, epoch: int) -> str | None:
    """Why no approver is asked (durable, from the ledger's borrow records)."""
    if budget.policy.borrowing.max_borrows_per_epoch == 0:
        return "borrowing_disabled_by_policy"
    borrows = budget.ledger.borrows(epoch)
    if any(b["approved"] for b in borrows):
        return "already_borrowed_this_epoch"
    if borrows:
        return "already_decided_this_epoch"
    return None


def _not_charged(budget: BudgetState, info: dict[str, Any], plan: ChargePlan,
                 round_number: int, epoch: int) -> None:
    info["not_charged"].append(plan.name)
    budget.events.append({"kind": "release_not_charged", "round": round_number,
                          "release": plan.name, "epoch": epoch,
                          "reason": "nothing_to_release"})


def _charge_with_gate(budget: BudgetState, plan: ChargePlan, plans: Sequence[ChargePlan],
                      round_number: int, region_of: Mapping[int, str],
                      regions: Sequence[str], info: dict[str, Any], epoch: int, *,
                      gate: Callable[[BudgetState, BorrowRequest], BorrowDecision] | None,
                      run_id: str, step: Step) -> Reservation | None:
    """Steps 1-3 of the module docstring for one entry that has something to release:
    reserve, and on a line-cap refusal put a borrow request to the gate (once per epoch)
    and reserve again if approved. ``None``: a regional entry off the cadence (recorded
    in ``info``)."""
    res = step("charge-evaluation", charge_entry, budget, plan, round_number, region_of,
               regions)
    if res is None:
        info["off_cadence"].append(plan.name)
        budget.events.append({"kind": "release_off_cadence", "round": round_number,
                              "release": plan.name, "epoch": epoch})
        return None
    skip = (_gate_skip_reason(budget, epoch)
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
            run_id=run_id[:128], federation=budget.config.name[:200],
            reason=f"round {round_number}: release '{plan.name}' would exceed "
                   f"the {plan.line.value} line of epoch {epoch}",
        )
        decision = gate(budget, request)
        info["borrows"].append(decision.model_dump(mode="json"))
        if decision.approved:
            res = _reserve(budget, plan, round_number, region_of, regions)
    return res


def _new_info(budget: BudgetState) -> dict[str, Any]:
    return {"released": [], "republished": [], "refused": {}, "off_cadence": [],
            "borrows": [], "not_charged": [], "policy_version": budget.policy.policy_version}


@dataclass
class DistributedCharges:
    """The distributed-mode charges of one evaluation round, made BEFORE secure
    aggregation (:func:`charge_distributed`).

    Attributes:
        round: flow round.
        groups: the aggregation groups a session would be formed for (what was charged:
            every region of the round's participants, parallel composition).
        entries: ledger entry name -> its reservation (after the borrow gate), or None
            when nothing was charged (no group, off cadence).
        info: the budget report so far (same keys as :func:`budgeted_evaluation`'s).
    """

    round: int
    groups: tuple[str, ...]
    entries: dict[str, Reservation | None]
    info: dict[str, Any]

    def unmask(self) -> tuple[str, ...]:
        """The noised metrics whose sums may be unmasked: those whose entry holds a
        fresh grant. A reservation reused from an earlier attempt (``reused_pending``:
        that attempt may have unmasked already) and a committed one (republished from
        the ledger) are never unmasked again: a second unmasking is a second noisy
        release under one charge."""
        return tuple(name for name in SCALAR_METRICS
                     if (r := self.entries.get(f"regional.{name}")) is not None
                     and r.status is ReservationStatus.GRANTED)


def charge_distributed(evaluator: PrivateEvaluator, budget: BudgetState,
                       groups: Sequence[str], region_of: Mapping[int, str],
                       round_number: int, *,
                       gate: Callable[[BudgetState, BorrowRequest], BorrowDecision] | None
                       = None, run_id: str = "", step: Step = direct_step
                       ) -> DistributedCharges:
    """Distributed mode: charge the noised regional entries before secure aggregation.

    The server itself is the party the devices' noise protects against, so what it sees
    at unmasking is what must be charged: the ``regional.<metric>`` zCDP entries of
    :func:`charge_plans` are reserved here (cadence, line cap, borrow gate, as in
    :func:`budgeted_evaluation`), and only the metrics :meth:`DistributedCharges.unmask`
    returns are carried by the round's sessions
    (:meth:`PrivateEvaluator.secure_sums`, ``unmask``). An entry with no group to form a
    session for (``groups`` empty) is charged nothing (``not_charged``). A group lost to
    dropouts (or refused by the differencing rule) after the charge stays charged: the
    server learned nothing new of it, but the charge was made before the outcome was
    known and the ledger does not refund (listed as ``charged_not_released``).

    Args:
        evaluator: the federation's evaluator (distributed mode).
        budget: the ledger and policy.
        groups: :meth:`PrivateEvaluator.session_groups` of the round.
        region_of: participant client id -> region (the membership charged).
        round_number: flow round.
        gate, run_id, step: as for :func:`budgeted_evaluation`.

    Raises:
        ValueError: the evaluator is in central mode.
    """
    if not evaluator.distributed:
        raise ValueError("charge_distributed: evaluation.noise is not 'distributed'")
    plans = charge_plans(evaluator)
    regions = evaluator.partition.region_ids
    epoch = budget.policy.epoch_of_round(ledger_round(round_number))
    info = _new_info(budget)
    entries: dict[str, Reservation | None] = {}
    for plan in plans:
        if plan.mechanism != "zcdp":
            continue
        on_cadence = regional_on_cadence(budget.policy, round_number)
        if on_cadence and not groups:
            _not_charged(budget, info, plan, round_number, epoch)
            entries[plan.name] = None
            continue
        entries[plan.name] = _charge_with_gate(
            budget, plan, plans, round_number, region_of, regions, info, epoch, gate=gate,
            run_id=run_id, step=step)
    return DistributedCharges(round_number, tuple(groups), entries, info)


def budgeted_evaluation(
    evaluator: PrivateEvaluator,
    ev: EvaluationRound,
    budget: BudgetState,
    region_of: Mapping[int, str],
    *,
    gate: Callable[[BudgetState, BorrowRequest], BorrowDecision] | None = None,
    run_id: str = "",
    step: Step = direct_step,
    charged: DistributedCharges | None = None,
) -> dict[str, Any]:
    """The round's evaluation releases, each charged before its noise (module docstring).

    Args:
        evaluator: the federation's :class:`PrivateEvaluator`.
        ev: the open evaluation round (:meth:`PrivateEvaluator.open_round`).
        budget: the ledger and policy.
        region_of: participant client id -> region (the membership charged).
        gate: the borrowing gate (may pause: call this from the flow's body).
        run_id: the orchestrator's run id, recorded with a borrow request.
        step: runs each sub-step by name (``charge-evaluation``, ``release-evaluation``,
            ``republish-evaluation``).
        charged: distributed mode: the charges made before secure aggregation
            (:func:`charge_distributed`); its entries are not charged again here.

    Returns the ledger's view ``{"round", "metrics": {entry: published}, "epsilon_spent",
    "budget": {"released", "republished", "refused": {name: reason}, "off_cadence",
    "not_charged", "borrows", "policy_version"}}``; in distributed mode also
    ``"charged_not_released": {entry: [groups]}`` and ``"not_unmasked": {entry: reason}``.

    Raises:
        ValueError: distributed mode without ``charged`` (the sums would have been
            unmasked before their charge), or ``charged`` of another round.
    """
    round_number = ev.round
    if evaluator.distributed and (charged is None or charged.round != round_number):
        raise ValueError("charged: distributed mode charges the noised releases before "
                         "secure aggregation (charge_distributed for this round)")
    plans = charge_plans(evaluator)
    regions = evaluator.partition.region_ids
    epoch = budget.policy.epoch_of_round(ledger_round(round_number))
    info = _new_info(budget) if charged is None else {
        k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
        for k, v in charged.info.items()}
    out: dict[str, Any] = {"round": round_number, "metrics": {}, "epsilon_spent": 0.0}
    for plan in plans:  # one at a time: charge, (gate), draw, commit
        if charged is not None and plan.name in charged.entries:
            res = charged.entries[plan.name]  # charged before secure aggregation
            if res is None:
                continue  # not charged / off cadence: recorded by charge_distributed
        else:
            on_cadence = (plan.scope == "global"
                          or regional_on_cadence(budget.policy, round_number))
            if on_cadence and not evaluator.releases_of(ev, plan.name):
                _not_charged(budget, info, plan, round_number, epoch)
                continue
            res = _charge_with_gate(budget, plan, plans, round_number, region_of, regions,
                                    info, epoch, gate=gate, run_id=run_id, step=step)
            if res is None:
                continue
        if res.already_committed:
            out["metrics"][plan.metric] = step("republish-evaluation", republish_entry,
                                               evaluator, ev, plan, res)
            info["republished"].append(plan.name)
        elif res.may_draw_noise:
            out["metrics"][plan.metric] = step("release-evaluation", release_entry,
                                               evaluator, ev, plan, res)
            info["released"].append(plan.name)
            out["epsilon_spent"] += float(plan.epsilon or 0.0)
        else:
            info["refused"][plan.name] = res.refusal
    if charged is not None:
        _distributed_report(evaluator, ev, charged, info)
    if evaluator.distributed:  # the global sums of the granted regional entries
        for name in SCALAR_METRICS:
            if f"regional.{name}" in info["released"] + info["republished"]:
                for rel in evaluator.releases_of(ev, f"global.{name}"):
                    if evaluator.has_sum(ev.sums, rel):
                        evaluator.record(ev, rel, evaluator.compute(ev.sums, rel))
                        info["released"].append(f"global.{name}")
    out["metrics"] = {k: v for k, v in out["metrics"].items() if v is not None}
    out["budget"] = info
    return out


def _distributed_report(evaluator: PrivateEvaluator, ev: EvaluationRound,
                        charged: DistributedCharges, info: dict[str, Any]) -> None:
    """What the pre-aggregation charges came to: charged groups without a released sum
    (lost to dropouts, refused by the differencing rule: they stay charged, conservative) and
    charged entries whose sums were not unmasked (and why)."""
    lost: dict[str, list[str]] = {}
    skipped: dict[str, str] = {}
    for entry, res in charged.entries.items():
        if res is None or res.refused:
            continue
        if res.status is ReservationStatus.REUSED_PENDING:
            skipped[entry] = ("reused_pending: an earlier attempt may have unmasked it; "
                              "not unmasked again under the same charge")
        elif res.already_committed:
            skipped[entry] = "already_committed: republished from the ledger"
        else:
            gone = [g for g in charged.groups if ev.sums.groups[g].status != "ok"]
            if gone:
                lost[entry] = gone
    info["charged_not_released"] = lost
    info["not_unmasked"] = skipped


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


def coarse_size(n: int) -> int:
    """The cohort size as the denominator sees it: the power of two nearest to ``n``
    (ties upwards), at least 1.

    Why: the released model's noise level is ``2 z C / D``, so an exact ``D`` would let
    anyone who estimates the noise of a released model learn the cohort's exact size,
    which is published only as a band. A power of two is as coarse as the bands (a factor
    of 2) while the server step stays within a factor of sqrt(2) of the plain mean.
    """
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise ValueError("n: must be an integer >= 0")
    if n <= 1:
        return 1
    lo = 1 << (int(n).bit_length() - 1)
    return lo if n * n < 2 * lo * lo else 2 * lo  # n < lo * sqrt(2): round down


def dp_denominators(cohort_sizes: Mapping[int, int], population_size: int,
                    sample_size: int) -> dict[int, float]:
    """The fixed public denominators of the round's cohorts (fixed before any update):
    the expected number of participants of a cohort of :func:`coarse_size` members in a
    uniform sample of ``sample_size`` of ``population_size`` clients
    (:func:`clma.rounds.expected_participants`)."""
    return {int(c): expected_participants(min(coarse_size(int(n)), population_size),
                                          population_size=population_size,
                                          sample_size=sample_size)
            for c, n in cohort_sizes.items()}


def dp_aggregate(
    config: FederationConfig,
    budget: BudgetState | None,
    updates: Sequence[ClientUpdate],
    quarantined: Sequence[int],
    cohort_models: Mapping[int, np.ndarray],
    round_number: int,
    weights: Mapping[int, float] | None = None,
    *,
    population_size: int,
    sample_size: int,
    denominators: Mapping[int, float],
) -> tuple[dict[int, np.ndarray], dict[str, Any]]:
    """DP-FedAvg per cohort after one training charge (see module doc).

    The round is charged as the Gaussian mechanism (noise multiplier ``z`` on the sum of
    updates clipped to ``C``, std ``2 z C``: replace-one adjacency) on a uniform sample
    without replacement of ``sample_size`` of ``population_size`` clients
    (``MechanismEvent.gaussian_sampled_without_replacement``, RDP accounting); each cohort
    of ``denominators`` (:func:`dp_denominators`) is released with the fixed-denominator
    estimator.

    ``weights`` (divergence action): clients with weight 0 are left out like quarantined
    ones; DP-FedAvg weighs the remaining clients equally (a down-weight would change the
    sensitivity, so it is not applied).

    Returns the new cohort models and ``{"status": "aggregated" | "republished" |
    "backed_off", "reason", "sigma": {cohort: sigma}, "n_clipped", "noise_source"}``.
    ``budget=None`` aggregates without charging. The charge is reserved (phase 1) here and
    committed by :func:`dp_commit` after cohorting with every model the round releases
    under DP; until then the info dict carries the reservation (``"reservation"``, in
    memory only) and the released models (``"released"``); on a re-run of a committed
    round ``"stored_new"`` holds the stored models of the cohorts created in that round
    (used by :func:`dp_new_cohort_model`).
    """
    dp = config.training.dp
    res: Reservation | None = None
    if budget is not None:
        res = budget.ledger.reserve(
            ledger_round(round_number), TRAINING_RELEASE, LineItem.TRAINING,
            [MechanismEvent.gaussian_sampled_without_replacement(
                dp.noise_multiplier, population_size, sample_size)],
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
    seed = (int(np.random.default_rng([config.seed, round_number, 211]).integers(2**31))
            if dp.noise_seeded else None)
    held = sorted(set(quarantined) | {c for c, w in (weights or {}).items() if w == 0})
    models, results = dp_aggregate_per_cohort(
        updates, held, cohort_models, clipping_bound=dp.clipping_bound,
        noise_multiplier=dp.noise_multiplier, denominators=denominators, seed=seed,
    )
    info: dict[str, Any] = {
        "status": "aggregated", "reason": None,
        "sigma": {str(c): r.sigma for c, r in results.items()},
        "estimator": "fixed_denominator",
        "n_clipped": sum(r.n_clipped for r in results.values()),
        "noise_source": "seeded-simulation" if seed is not None else "opendp",
    }
    if res is not None:
        info["reservation"] = res
        info["released"] = {c: models[c] for c in results}
    return models, info


def dp_commit(training: dict[str, Any], models: Mapping[int, np.ndarray],
              new_cohorts: Iterable[int]) -> dict[int, np.ndarray]:
    """Commit the round's training charge with every model it released (phase 2).

    Args:
        training: the info dict of :func:`dp_aggregate` (no reservation: nothing to commit).
        models: cohort id -> model after cohorting (float32 vectors).
        new_cohorts: ids of the cohorts created this round, those the clients' choice
            retired again included (their models came from :func:`dp_new_cohort_model`).

    Returns ``models`` with the stored payload applied: if another attempt committed the
    same key first, its models are the ones to publish.
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


def dp_new_cohort_model(config: FederationConfig, training: Mapping[str, Any],
                        round_number: int) -> Callable[[int, list[ClientUpdate], np.ndarray],
                                                       np.ndarray]:
    """The ``new_model`` hook of :func:`clma.rounds.cohort_quarantined` under DP-FedAvg.

    A cohort created this round releases its model through the same DP step as every other
    cohort (:func:`clma.rounds.dp_fedavg` on its members' updates against the source
    cohort's start model); its clients are disjoint from the cohorts already aggregated, so
    the round's single training charge covers it. When training backed off the new cohort
    starts from the source model unchanged. Noise: seeded per (seed, round, cohort) when
    ``training.dp.noise_seeded``, else OpenDP. On a re-run of a committed round the stored
    model is republished and no new noise is drawn.
    """
    dp = config.training.dp

    def build(new_id: int, members: list[ClientUpdate], reference: np.ndarray) -> np.ndarray:
        if training.get("status") == "backed_off":
            return np.asarray(reference, dtype=np.float32).copy()
        stored = training.get("stored_new", {})
        if int(new_id) in stored:
            return stored[int(new_id)].copy()
        seed = (np.random.default_rng([config.seed, round_number, 223, int(new_id)])
                if dp.noise_seeded else None)
        # every member took part this round: the denominator is the coarse member count
        return dp_fedavg([u.params for u in members], reference,
                         clipping_bound=dp.clipping_bound,
                         noise_multiplier=dp.noise_multiplier,
                         denominator=float(coarse_size(len(members))), seed=seed).model

    return build


# --------------------------------------------------------------------------- reporting


def decisions_document(budget: BudgetState) -> dict[str, Any]:
    """``budget/decisions.json``: borrowing decisions (approver, reason), ledger decisions
    (refusals, freezes) and skipped releases, with the policy version."""
    return {
        "policy_version": budget.policy.policy_version,
        "policy_content_hash": budget.policy.content_hash,
        "borrows": budget.ledger.borrows(),
        "ledger_decisions": budget.ledger.decisions(),
        "flow_events": list(budget.events),
    }
