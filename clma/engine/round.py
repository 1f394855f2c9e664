"""The round engine: every server step of a governed CLMA round, behind the Clients seam.

One round (CLMA, Adarsh N L et al., CODS-COMAD 2024, Algorithms 1-3, plus the private
evaluation), as :class:`FederationEngine` steps over one :class:`RoundContext`:

1. :meth:`~FederationEngine.begin_round` — select the round's clients (seeded) and fix the
   cohort models they start from;
2. :meth:`~FederationEngine.train` — ask the clients to train (any chunk of them, through
   :class:`clma.engine.clients.Clients`); :meth:`~FederationEngine.accept` checks every
   reply (a malformed one is a dropout);
3. :meth:`~FederationEngine.detect_drift` — quarantine the clients whose on-device flag is
   set (none under plain FedAvg); the first quarantine fixes the merge reference;
4. :meth:`~FederationEngine.score_divergence` — atypical-client scores (optional);
5. :meth:`~FederationEngine.aggregate` — FedAvg within each cohort over the non-quarantined
   members, or DP-FedAvg after one training charge in the ledger;
6. :meth:`~FederationEngine.cohort` — signed KS -> Gram PCA -> clustering of the
   quarantined clients into new child cohorts; under ``cohort.client_choice``
   (:meth:`~FederationEngine.choose`) the clients of a split then choose among its new
   cohorts on their own data (one more call of the seam; only a cohort id comes back);
7. :meth:`~FederationEngine.merge` — cohorts whose models reconverged merge (optional);
8. :meth:`~FederationEngine.end_training` — commit the DP charge, install the models,
   record the round in the registry;
9. :meth:`~FederationEngine.charge_before_sums` (distributed DP with a ledger: the noised
   releases are charged before the server unmasks anything),
   :meth:`~FederationEngine.secure_sums` and :meth:`~FederationEngine.evaluate` — on
   evaluation rounds, the private regional evaluation (every release charged before its
   noise), envelopes and alerts;
10. :meth:`~FederationEngine.finish` — the round's :class:`RoundResult`.

:meth:`FederationEngine.run_round` runs the ten steps in order without any orchestrator
(the bare engine); ``flows/federation.py`` runs the same steps as Prefect tasks, and
:class:`clma.flower.CLMA` runs them behind Flower's Strategy interface. The server state
(:class:`clma.engine.state.ServerState`) holds no client data and no per-client raw value.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from clma.budget import BorrowDecision, BorrowRequest, PrivacyPolicy
from clma.cohort import AutoKMeans, CLMACohorter, Cohorter
from clma.config import FederationConfig
from clma.engine.budget import (
    BudgetState,
    DistributedCharges,
    Step,
    budgeted_evaluation,
    charge_distributed,
    direct_step,
    dp_aggregate,
    dp_commit,
    dp_denominators,
    dp_new_cohort_model,
    policy_of,
)
from clma.engine.clients import (
    ChoiceRequest,
    Clients,
    Replies,
    TrainRequest,
    TrainSettings,
    check_choice,
    check_update,
)
from clma.engine.divergence import DivergenceOutcome, score_divergence
from clma.engine.evaluation import EvaluationOutcome, PrivateEvaluator, SecureSums
from clma.engine.state import ServerAssets, ServerState
from clma.params import AllParams, DefaultSelector, ParamSelector, flatten_state, unflatten_state
from clma.rounds import (
    ClientUpdate,
    CohortingOutcome,
    aggregate_per_cohort,
    cohort_quarantined,
    merge_reconverged,
    quarantine,
    select_clients,
    server_step,
    server_step_cohorts,
    server_velocity,
)

__all__ = ["FederationEngine", "RoundContext", "RoundResult", "make_cohorter"]

Gate = Callable[[BudgetState, BorrowRequest], BorrowDecision]


def make_cohorter(config: FederationConfig) -> CLMACohorter:
    """The cohorter ``config.cohort`` describes (k-means seeded with ``config.seed``)."""
    c = config.cohort
    return CLMACohorter(
        clusterer=AutoKMeans(fixed_k=c.fixed_k, max_k=c.max_k, min_silhouette=c.min_silhouette,
                             random_state=config.seed),
        variance_threshold=c.variance_threshold,
        center=c.center,
        min_ks_magnitude=c.min_ks_magnitude,
        components=c.components,
        direction_rule=c.direction_rule,
        leading_split_alpha=c.leading_split_alpha,
        leading_split_min_size=c.leading_split_min_size,
        leading_split_family_ratio=c.leading_split_family_ratio,
        cosine_refinement=c.cosine_refinement,
        one_component=c.one_component,
        refit_without_outliers=c.refit_without_outliers,
    )


@dataclass
class RoundContext:
    """One round in progress (server side). Steps fill it in order."""

    round: int
    selected: list[int]
    assignments: dict[int, int]
    start_models: dict[int, np.ndarray]
    t0: float = field(default_factory=time.perf_counter)
    updates: list[ClientUpdate] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    quarantined: list[int] = field(default_factory=list)
    divergence: DivergenceOutcome | None = None
    models: dict[int, np.ndarray] = field(default_factory=dict)
    training: dict[str, Any] | None = None
    cohorting: CohortingOutcome = field(default_factory=CohortingOutcome)
    merges: list[tuple[list[int], int]] = field(default_factory=list)
    evaluation: EvaluationOutcome | None = None
    charges: DistributedCharges | None = None
    stepped: list[int] = field(default_factory=list)

    @property
    def participants(self) -> list[int]:
        """Selected clients that returned a usable update (in selection order)."""
        return [c for c in self.selected if c not in self.failed]

    @property
    def weights(self) -> dict[int, float] | None:
        return self.divergence.weights if self.divergence is not None else None


@dataclass
class RoundResult:
    """What one round did (server side: exact counts; publish through bands).

    Attributes:
        round: the round.
        cohorts: active cohort id -> member count after the round.
        flagged: clients whose on-device drift flag was set.
        quarantined: clients quarantined.
        new_cohorts: new cohort id -> ``{"parent": id, "size": n}``.
        merges: ``[{"merged": [ids], "into": id}]``.
        regional: the published evaluation report (None on rounds without evaluation).
        divergence: the id-free divergence summary (None when disabled).
        evaluation: the evaluation outcome (envelopes, alerts, releases) or None.
        participants: clients whose update was used; ``dropouts``: selected clients whose
            training reply was missing or malformed.
        seconds: wall time of the round.
    """

    round: int
    cohorts: dict[int, int]
    flagged: int
    quarantined: int
    new_cohorts: dict[int, dict[str, Any]]
    merges: list[dict[str, Any]]
    regional: dict[str, Any] | None
    divergence: dict[str, Any] | None
    evaluation: EvaluationOutcome | None
    participants: int
    dropouts: int
    seconds: float


class FederationEngine:
    """The server of one federation: its state and every step of a round (module doc).

    Args:
        config: the federation config.
        assets: the server's public assets (model architecture, initial model, probe set,
            region partition).
        clients: the transport (:class:`clma.engine.clients.Clients`).
        policy: the privacy policy; default: the budget's policy, else ``budget.policy``
            of the config (or the shipped one).
        budget: the ledger (None: releases are not charged).
        state: the server state to continue from (default: a fresh federation, every
            client of the roster in root cohort 0).
        cohorter: the cohorter of quarantined clients (default: :func:`make_cohorter` of
            the config).
        selector: which arrays of the model form the cohorting vector (default
            :class:`clma.params.DefaultSelector`); averaging always uses every array.

    Raises:
        ValueError: the roster names a region the partition does not have, or a roster
            client outside the state's registry.
    """

    def __init__(self, config: FederationConfig, assets: ServerAssets, clients: Clients, *,
                 policy: PrivacyPolicy | None = None, budget: BudgetState | None = None,
                 state: ServerState | None = None, cohorter: Cohorter | None = None,
                 selector: ParamSelector | None = None) -> None:
        self.config = config
        self.assets = assets
        self.clients = clients
        self.budget = budget
        self.policy = policy or (budget.policy if budget is not None else policy_of(config))
        self.roster = clients.roster()
        regions = set(assets.partition.region_ids)
        bad = sorted({c.region for c in self.roster.clients} - regions)
        if bad:
            raise ValueError("roster: a client's region is not in the region partition "
                             f"{assets.partition.version!r}")
        self.region_of = self.roster.region_of()
        self.state = state if state is not None else ServerState.fresh(
            self.roster.client_ids, assets.initial_model)
        self.evaluator = PrivateEvaluator(config, assets.partition, self.policy, self.state)
        self._selector = self._make_selector(selector)
        self.cohorter = cohorter if cohorter is not None else make_cohorter(config)

    # ---------------------------------------------------------------- helpers
    def _make_selector(self, selector: ParamSelector | None = None
                       ) -> Callable[[np.ndarray], np.ndarray]:
        """Full-state vector -> the selector's sub-vector (identity when equal).

        Raises:
            ValueError: the selector keeps no array of the model.
        """
        template = self.assets.model_spec.build()
        st = template.state_dict()
        sel = selector or DefaultSelector()
        if hasattr(template, "named_parameters"):  # a torch module: its AllParams vector
            full = AllParams().select_module(template)
            chosen = sel.select_module(template)
        else:  # name -> array of every entry of the vector (a Flower record's layout)
            full = list(st)
            chosen = sel.select(st)
        if not chosen:
            raise ValueError("selector: selects no array of the model")
        if chosen == full:
            return lambda v: v
        shapes = {n: st[n] for n in full}
        return lambda v: flatten_state(unflatten_state(v, shapes), chosen)

    def train_settings(self) -> TrainSettings:
        t = self.config.training
        return TrainSettings(local_epochs=t.local_epochs, learning_rate=t.learning_rate,
                             batch_size=t.batch_size, drift_gamma=self.config.drift.gamma,
                             detector=self.config.drift.detector_spec())

    # ---------------------------------------------------------------- 1. select
    def select(self, round_number: int) -> list[int]:
        """Uniform selection without replacement of ``ceil(participation * n)`` clients of
        the roster.

        Randomness: under DP-FedAvg with secure noise the sample is drawn from
        HMAC-SHA256(``state.selection_key``, round) — a server secret kept in the state
        folder, so the sample (whose secrecy the privacy amplification by sampling
        assumes) is not derivable from published values; otherwise from the published
        ``(seed, round)`` (reproducible simulations).
        """
        dp = self.config.training.dp
        if dp.enabled and not dp.noise_seeded:
            if self.state.selection_key is None:
                self.state.selection_key = os.urandom(32)
            digest = hmac.new(self.state.selection_key, f"clma-select|{round_number}".encode(),
                              hashlib.sha256).digest()
            rng = np.random.default_rng(int.from_bytes(digest[:16], "little"))
        else:
            rng = np.random.default_rng([self.config.seed, round_number, 11])
        return select_clients(self.roster.client_ids, self.config.training.participation, rng)

    def begin_round(self, round_number: int, selected: Sequence[int] | None = None
                    ) -> RoundContext:
        """A new :class:`RoundContext`: the selection (default :meth:`select`), each
        selected client's cohort and the cohort models it starts from."""
        if type(round_number) is not int or round_number < 1:
            raise ValueError("round_number: rounds are integers from 1")
        chosen = list(self.select(round_number) if selected is None else selected)
        assignments = self.state.assignments(chosen)
        return RoundContext(round_number, chosen, assignments,
                            {c: v.copy() for c, v in self.state.cohort_models.items()})

    # ---------------------------------------------------------------- 2. train
    def train_request(self, ctx: RoundContext, client_ids: Iterable[int] | None = None
                      ) -> TrainRequest:
        ids = list(ctx.selected if client_ids is None else client_ids)
        a = {c: ctx.assignments[c] for c in ids}
        return TrainRequest(ctx.round, a, {k: ctx.start_models[k] for k in sorted(set(a.values()))},
                            self.train_settings())

    def train(self, ctx: RoundContext, client_ids: Iterable[int] | None = None
              ) -> Replies[ClientUpdate]:
        """Ask ``client_ids`` (default: all selected) to train; every reply checked
        (:func:`clma.engine.clients.check_update`): a malformed one is a failure."""
        request = self.train_request(ctx, client_ids)
        try:
            replies = self.clients.train(request)
        except Exception as exc:  # a transport failure is every asked client's dropout
            return Replies({}, {c: f"transport error: {type(exc).__name__}"
                                for c in request.assignments})
        return self.check_replies(request, replies)

    def check_replies(self, request: TrainRequest, replies: Replies) -> Replies[ClientUpdate]:
        if not (isinstance(replies, Replies) and isinstance(replies.ok, Mapping)
                and isinstance(replies.failed, Mapping)):  # a broken transport's answer
            return Replies({}, {c: "transport error: malformed replies"
                                for c in request.assignments})
        out: Replies[ClientUpdate] = Replies({}, dict(replies.failed))
        for c, u in replies.ok.items():
            if c in out.failed:  # reported failed as well: not used
                continue
            why = check_update(u, request, self.assets.n_params)
            if why is None and u.client_id != c:
                why = "reply filed under another client id"
            if why is None:
                out.ok[c] = ClientUpdate(int(u.client_id), int(u.cohort_id), u.params,
                                         int(u.n_samples), bool(u.drift_flag))
            else:
                out.failed[c] = why
        for c in request.assignments:
            if c not in out.ok and c not in out.failed:
                out.failed[c] = "no reply"
        return out

    def accept(self, ctx: RoundContext, replies: Iterable[Replies[ClientUpdate]]) -> None:
        """Collect the checked replies of every chunk into ``ctx`` (selection order).
        Failures of clients the round did not select are not its dropouts; a client
        reported failed is not used even if a reply of it arrived."""
        ok: dict[int, ClientUpdate] = {}
        selected = set(ctx.selected)
        for r in replies:
            ok.update(r.ok)
            ctx.failed.update({c: why for c, why in r.failed.items() if c in selected})
        for c in ctx.selected:
            if c not in ok and c not in ctx.failed:
                ctx.failed[c] = "no reply"
        ctx.updates = [ok[c] for c in ctx.selected if c in ok and c not in ctx.failed]

    # ---------------------------------------------------------------- 3. quarantine
    def detect_drift(self, ctx: RoundContext) -> list[int]:
        """Quarantine flagged clients (none when cohorting is off; a client alone in its
        cohort is not quarantined: :func:`clma.rounds.quarantine`); the first quarantine
        of the federation fixes the merge reference (the start model of the first
        quarantined client's cohort)."""
        ctx.quarantined = (quarantine(ctx.updates, self.state.registry)
                          if self.config.cohort.enabled else [])
        if ctx.quarantined and self.state.merge_reference is None:
            held = set(ctx.quarantined)
            first = next(u.cohort_id for u in ctx.updates if u.client_id in held)
            self.state.merge_reference = ctx.start_models[first].copy()
        return ctx.quarantined

    # ---------------------------------------------------------------- 4. divergence
    def score_divergence(self, ctx: RoundContext) -> DivergenceOutcome | None:
        """Atypical-client scores (None when ``divergence.enabled`` is false or no update);
        updates the server state's persistence EWMA (:mod:`clma.divergence.flags`)."""
        if not self.config.divergence.enabled or not ctx.updates:
            return None
        ctx.divergence = score_divergence(self.config.divergence, self.assets, ctx.updates,
                                          ctx.start_models, ctx.round,
                                          persistence=self.state.divergence_persistence)
        # the persistence EWMA is server state: committed (and restored) with the round
        self.state.divergence_persistence = ctx.divergence.persistence or {}
        return ctx.divergence

    # ---------------------------------------------------------------- 5. aggregate
    def aggregate(self, ctx: RoundContext) -> dict[int, np.ndarray]:
        """FedAvg per cohort over the non-quarantined members (divergence weights
        applied), or DP-FedAvg after the round's training charge; then the server step
        (``training.server_learning_rate``, ``training.server_momentum``) on the cohorts of
        ``training.server_learning_rate_scope`` (without DP: those with a usable update)."""
        if self.config.training.dp.enabled:
            reg = self.state.registry
            n, k = len(self.roster.client_ids), len(ctx.selected)
            denominators = dp_denominators(
                {c: len(reg.members(c)) for c in ctx.start_models}, n, k)
            ctx.models, ctx.training = dp_aggregate(
                self.config, self.budget, ctx.updates, ctx.quarantined, ctx.start_models,
                ctx.round, ctx.weights, population_size=n, sample_size=k,
                denominators=denominators)
        else:
            ctx.models = aggregate_per_cohort(ctx.updates, ctx.quarantined, ctx.start_models,
                                              ctx.weights)
        t = self.config.training
        eta, beta = t.server_learning_rate, t.server_momentum
        status = "aggregated" if ctx.training is None else ctx.training.get("status")
        if (eta != 1.0 or beta != 0.0) and status in ("aggregated", "republished"):
            # FedOpt's server step (post-processing under DP-FedAvg); a republished round's
            # models were stepped when first committed, and only give the velocity
            ctx.stepped = server_step_cohorts(self.state.registry, ctx.start_models,
                                              t.server_learning_rate_scope)
            if ctx.training is None:  # a cohort nobody updated keeps its model (and velocity)
                held, w = set(ctx.quarantined), ctx.weights or {}
                updated = {u.cohort_id for u in ctx.updates
                           if u.client_id not in held and w.get(u.client_id, 1.0) > 0}
                ctx.stepped = [c for c in ctx.stepped if c in updated]
        if ctx.stepped and status == "aggregated":
            ctx.models = server_step({c: ctx.start_models[c] for c in ctx.stepped},
                                     ctx.models, eta, momentum=beta,
                                     velocity=self.state.server_velocity)
            if ctx.training is not None and "released" in ctx.training:
                # the ledger commits (and a re-run republishes) the stepped models
                ctx.training["released"] = {c: ctx.models[c] for c in ctx.training["released"]}
        return ctx.models

    # ---------------------------------------------------------------- 6. cohort
    def cohort(self, ctx: RoundContext) -> CohortingOutcome:
        """CLMA Algorithm 3 on the quarantined clients: new child cohorts in the registry
        (their first models from the members' updates, through DP under DP-FedAvg)."""
        if not ctx.quarantined:
            ctx.cohorting = CohortingOutcome()
            return ctx.cohorting
        new_model = (dp_new_cohort_model(self.config, ctx.training, ctx.round)
                     if ctx.training is not None else None)
        ctx.models, ctx.cohorting = cohort_quarantined(
            ctx.updates, ctx.quarantined, ctx.models, self.state.registry, self.cohorter,
            ctx.round, select=self._selector, start_models=ctx.start_models,
            new_model=new_model, weights=ctx.weights,
            atypical=ctx.divergence.flagged if ctx.divergence is not None else (),
            history=self._history())
        if self.config.cohort.client_choice:
            self.choose(ctx)
        return ctx.cohorting

    def choose(self, ctx: RoundContext) -> dict[int, int]:
        """``cohort.client_choice``: the clients of the cohorts a drift round made choose
        among them on their own data (:class:`ChoiceRequest`,
        :func:`clma.device.choose_cohort`); a client that answers another of its
        candidates is moved there (registry ``move``, reason "client choice"; a cohort the
        moves empty is retired).

        Candidates: a member of a new cohort of two or more clients chooses among the new
        cohorts of two or more clients split from the same source cohort. The member of a
        new cohort of one client (a client the split left alone, e.g. an outlier the refit
        kept apart) chooses between staying alone and every new cohort of two or more
        clients of the round, whatever its source: it is sent, as its own cohort's model,
        the source cohort's start model -- its cohort's model without its own update (the
        leave-one-out model), since the cohort's model, trained on its update alone, would
        fit it best trivially -- so it stays alone only if no other new cohort fits its
        data better than the model it drifted from. So does the one member a split leaves
        in its source cohort (a drifted client its device did not flag, e.g. one whose
        loss was already high, or the one client that did not drift), its cohort scored
        with the model it started the round from; if it moves, its old cohort is retired
        ("emptied by a move"). A cohort of one client is no candidate for anyone else (its
        model is that client's update).

        The moves among the shared new cohorts of one source are applied only if each of
        them is chosen by more than half of its own members (a failed or malformed reply
        counts as keeping the split's cohort); otherwise the split stands for all their
        members, and a client left alone does not join them either: when one model fits
        every client better than the others (as under covariate drift, where every cohort
        model keeps the labels) the choice says nothing about the families.

        The new cohorts' first models stay as the split made them (released once: under
        DP-FedAvg they were charged); a moved client trains in its chosen cohort from the
        next round. A client that fails, or answers something other than one of its
        candidates, keeps the split's cohort; so does every client of a transport without
        ``choose``. Afterwards ``ctx.cohorting.new_cohorts`` holds the members of the
        still-active new cohorts and ``ctx.cohorting.retired`` the emptied ones (their
        released models are committed with the others). Returns client id -> the cohort
        it moved to (also ``ctx.cohorting.moved``)."""
        out = ctx.cohorting
        alone = sorted(k for k, m in out.new_cohorts.items() if len(m) == 1)
        shared = sorted(k for k in out.new_cohorts if k not in alone)
        by_parent: dict[int, list[int]] = {}
        for k in shared:
            by_parent.setdefault(out.parents[k], []).append(k)
        candidates: dict[int, tuple[int, ...]] = {}
        models: dict[int, np.ndarray] = {}
        for kids in by_parent.values():
            if len(kids) < 2:
                continue
            for k in kids:
                models[k] = ctx.models[k]
                for c in out.new_cohorts[k]:
                    candidates[int(c)] = (k, *[j for j in kids if j != k])
        reg = self.state.registry
        active = set(reg.active_cohorts())
        # a source cohort the split left with one member: that client's own drift went
        # unflagged (e.g. its loss was high before) or it alone did not drift; its
        # cohort's model is now its update alone, so it chooses as a client left alone
        left = [p for p in sorted(set(out.parents.values()))
                if p in active and p not in out.new_cohorts and len(reg.members(p)) == 1]
        if shared and (alone or left):
            models.update({j: ctx.models[j] for j in shared})
            for k in alone:
                (c,) = out.new_cohorts[k]
                candidates[int(c)] = (k, *shared)
                models[k] = ctx.start_models[out.parents[k]]  # leave-one-out: no update
            for p in left:
                (c,) = reg.members(p)
                candidates[int(c)] = (p, *shared)
                models[p] = ctx.start_models[p]  # the model it started the round from
        ask = getattr(self.clients, "choose", None)
        if not candidates or ask is None:
            return {}
        request = ChoiceRequest(ctx.round, candidates, models)
        replies = ask(request)
        chosen = {c: candidates[c][0] for c in candidates}  # failures keep the split's
        for c in sorted(candidates):
            if c in replies.ok and c not in replies.failed \
                    and check_choice(replies.ok[c], request, c) is None:
                chosen[c] = int(replies.ok[c])
        # a source's shared cohorts keep their clients' moves only if each of them is the
        # choice of more than half of its own members: else one model fits everyone
        # better (covariate families: docs/realistic_drift.md section 8) and the split
        # stands for the whole group
        held = {k for kids in by_parent.values() if len(kids) >= 2
                if not all(2 * sum(chosen[c] == j for c in out.new_cohorts[j])
                           > len(out.new_cohorts[j]) for j in kids)
                for k in kids}
        for c in sorted(candidates):
            k, own = chosen[c], candidates[c][0]
            if k == own or own in held or k in held:
                continue
            reg.move(c, k, ctx.round, reason="client choice")
            out.moved[c] = k
        active = set(reg.active_cohorts())
        out.retired = sorted(k for k in out.new_cohorts if k not in active)
        out.new_cohorts = {k: reg.members(k) for k in out.new_cohorts if k in active}
        out.parents = {k: p for k, p in out.parents.items() if k in active}
        return dict(out.moved)

    def _history(self) -> Any:
        """The update history under ``cohort.features = "relative"`` (else None)."""
        if self.config.cohort.features != "relative":
            return None
        if self.state.update_history is None:
            from clma.cohort.features import UpdateHistory

            self.state.update_history = UpdateHistory()
        return self.state.update_history

    def record_history(self, ctx: RoundContext) -> None:
        """Under ``cohort.features = "relative"``: add each non-quarantined update
        ``x - r`` (cohorting sub-vector, ``r`` its start model) to its client's history and
        restart the history of each quarantined client (:mod:`clma.cohort.features`)."""
        history = self._history()
        if history is None:
            return
        held = set(ctx.quarantined)
        for u in ctx.updates:
            if u.client_id in held:
                history.reset(u.client_id)
            else:
                start = ctx.start_models[u.cohort_id]
                history.observe(u.client_id, u.cohort_id,
                                self._selector(u.params).astype(np.float64)
                                - self._selector(start).astype(np.float64))

    # ---------------------------------------------------------------- 7. merge
    def merge(self, ctx: RoundContext) -> list[tuple[list[int], int]]:
        """Merge cohorts whose models reconverged (off unless ``merge_cohorts_threshold``);
        displacements from the merge reference (the pre-drift consensus model)."""
        if ctx.training is not None:  # commit the DP charge with every released model
            # every model the round released, a new cohort the choice retired included (a
            # re-run republishes it instead of drawing fresh noise on the same updates)
            ctx.models = dp_commit(ctx.training, ctx.models,
                                   [*ctx.cohorting.new_cohorts, *ctx.cohorting.retired])
        reg = self.state.registry
        sizes = {c: len(reg.members(c)) for c in reg.active_cohorts()}
        ref = (self.state.merge_reference if self.state.merge_reference is not None
               else self.assets.initial_model)
        ctx.models, ctx.merges = merge_reconverged(
            ctx.models, reg, ref, self.config.cohort.merge_cohorts_threshold, ctx.round, sizes,
            select=self._selector)
        return ctx.merges

    # ---------------------------------------------------------------- 8. end training
    def end_training(self, ctx: RoundContext) -> None:
        """Install the round's cohort models (under server momentum, the stepped cohorts'
        velocities from them), record the round in the registry and, under relative
        cohorting features, the round's updates in the clients' histories."""
        reg = self.state.registry
        active = set(reg.active_cohorts())
        self.state.cohort_models = {c: ctx.models[c] for c in sorted(active)}
        if self.config.training.server_momentum:
            # from the models as committed (a stored attempt's, if one committed first)
            velocity = {**self.state.server_velocity, **server_velocity(
                {c: ctx.start_models[c] for c in ctx.stepped}, ctx.models,
                self.config.training.server_learning_rate)}
            self.state.server_velocity = {c: v for c, v in velocity.items() if c in active}
        else:
            self.state.server_velocity = {}
        reg.record_round(ctx.round)
        self.record_history(ctx)

    # ---------------------------------------------------------------- 9. evaluate
    def evaluation_due(self, round_number: int) -> bool:
        return round_number % self.config.evaluation.every == 0

    def charge_before_sums(self, ctx: RoundContext, *, gate: Gate | None = None,
                           run_id: str = "", step: Step = direct_step) -> None:
        """Distributed mode with a ledger: charge the noised releases (borrow gate
        included) BEFORE secure aggregation, so that the server only unmasks what was
        charged (:func:`clma.engine.budget.charge_distributed`); a no-op otherwise. Call
        it from the orchestrator's body (the gate may pause the run)."""
        if self.budget is None or not self.evaluator.distributed:
            return
        ids = ctx.participants
        groups = self.evaluator.session_groups(ctx.round, ids, self.region_of)
        ctx.charges = charge_distributed(self.evaluator, self.budget, groups,
                                         {c: self.region_of[c] for c in ids}, ctx.round,
                                         gate=gate, run_id=run_id, step=step)

    def secure_sums(self, ctx: RoundContext) -> SecureSums:
        """Secure aggregation of the participants' on-device reports (evaluated with the
        round's new cohort models). Distributed mode with a ledger: only the metrics
        :meth:`charge_before_sums` charged are unmasked.

        Raises:
            ValueError: distributed mode with a ledger and no charge made for this round.
        """
        ids = ctx.participants
        reg = self.state.registry
        assignments = {c: int(reg.cohort_of(c)) for c in ids}
        unmask = None
        if self.budget is not None and self.evaluator.distributed:
            if ctx.charges is None or ctx.charges.round != ctx.round:
                raise ValueError("secure_sums: distributed mode with the ledger charges "
                                 "before secure aggregation (call charge_before_sums first)")
            unmask = ctx.charges.unmask()
        return self.evaluator.secure_sums(self.clients, ctx.round, ids, self.region_of,
                                          assignments, self.state.cohort_models,
                                          unmask=unmask)

    def evaluate(self, ctx: RoundContext, sums: SecureSums, *, gate: Gate | None = None,
                 run_id: str = "", step: Step = direct_step) -> EvaluationOutcome:
        """Plan, charge (when a ledger is open), draw noise once per granted release, and
        close the evaluation round (envelopes, alerts, merges, bounds)."""
        ev = self.evaluator.open_round(sums)
        if self.budget is None:
            ctx.evaluation = self.evaluator.release_all(ev)
            return ctx.evaluation
        region_of = {c: self.region_of[c] for c in ctx.participants}
        view = budgeted_evaluation(self.evaluator, ev, self.budget, region_of, gate=gate,
                                   run_id=run_id, step=step, charged=ctx.charges)
        ctx.evaluation = self.evaluator.finish(ev, budget_view=view)
        return ctx.evaluation

    # ---------------------------------------------------------------- 10. finish
    def finish(self, ctx: RoundContext) -> RoundResult:
        """Close the round: ``rounds_done`` and the :class:`RoundResult`."""
        self.state.rounds_done = ctx.round
        reg = self.state.registry
        div = None
        if ctx.divergence is not None:
            div = {**ctx.divergence.summary(),
                   "quarantined_atypical": sum(d.get("n_atypical", 0)
                                               for d in ctx.cohorting.diagnostics.values())}
        return RoundResult(
            round=ctx.round,
            cohorts={c: len(reg.members(c)) for c in reg.active_cohorts()},
            flagged=sum(u.drift_flag for u in ctx.updates),
            quarantined=len(ctx.quarantined),
            new_cohorts={k: {"parent": ctx.cohorting.parents[k], "size": len(v)}
                         for k, v in ctx.cohorting.new_cohorts.items()},
            merges=[{"merged": g, "into": n} for g, n in ctx.merges],
            regional=ctx.evaluation.published if ctx.evaluation is not None else None,
            divergence=div,
            evaluation=ctx.evaluation,
            participants=len(ctx.updates),
            dropouts=len(ctx.failed),
            seconds=time.perf_counter() - ctx.t0,
        )

    # ---------------------------------------------------------------- the bare loop
    def after_training(self, ctx: RoundContext,
                       on_divergence: Callable[[DivergenceOutcome], None] | None = None) -> None:
        """Steps 3-8 on the accepted updates (what a strategy runs once the replies are in)."""
        self.detect_drift(ctx)
        div = self.score_divergence(ctx)
        if div is not None and on_divergence is not None:
            on_divergence(div)
        self.aggregate(ctx)
        self.cohort(ctx)
        self.merge(ctx)
        self.end_training(ctx)

    def run_round(self, round_number: int, *, gate: Gate | None = None, run_id: str = "",
                  on_divergence: Callable[[DivergenceOutcome], None] | None = None,
                  chunk_size: int | None = None) -> RoundResult:
        """One whole round without any orchestrator (the ten steps in order).

        ``chunk_size`` splits the training call into chunks of clients (the Prefect flow
        maps one task per chunk); the result does not depend on it.
        """
        ctx = self.begin_round(round_number)
        size = chunk_size or max(1, len(ctx.selected))
        chunks = [ctx.selected[i:i + size] for i in range(0, len(ctx.selected), size)]
        self.accept(ctx, [self.train(ctx, chunk) for chunk in chunks])
        self.after_training(ctx, on_divergence)
        if self.evaluation_due(round_number) and ctx.participants:
            self.charge_before_sums(ctx, gate=gate, run_id=run_id)
            self.evaluate(ctx, self.secure_sums(ctx), gate=gate, run_id=run_id)
        return self.finish(ctx)

    def cohort_sizes(self) -> Mapping[int, int]:
        reg = self.state.registry
        return {c: len(reg.members(c)) for c in reg.active_cohorts()}
