"""The private regional evaluation on Flower: :class:`PrivateEvaluation` wraps a
:class:`clma.flower.CLMA` strategy and runs the engine's evaluation after each round's
training (the steps of the Prefect flow's evaluation, one copy of every rule):

1. :meth:`FederationEngine.secure_sums` through the Flower transport: each node computes
   its 32-value report on its local data with its cohort's new model, clips and quantises
   it on the device, and takes part in one secure-aggregation session per monitored
   group (regions of the public partition, merged below the floor) and the global one --
   four round-trips in all, every session of a node in one message per step;
2. :meth:`FederationEngine.evaluate`: the release plan, one ledger charge per release
   BEFORE its noise (idempotent keys, caps, the policy's regional cadence; a refused charge
   draws nothing; the optional borrowing ``gate``), noise once on each granted sum,
   envelopes, the cohort floor, alerts, clip-bound re-derivation.

``aggregate_evaluate`` returns the published global values (``<metric>`` and
``<metric>.error-bar``) as a ``MetricRecord``; per round, :attr:`outcomes` holds the
:class:`clma.engine.EvaluationOutcome` (published report, envelopes, releases, refused
releases) and :attr:`envelopes` the closed envelopes. Nothing published names a client
or an exact count. The evaluation's parameters are the federation config's
(``evaluation.*``, ``budget.policy``); the keyword arguments override them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from clma.config import validate_config
from clma.flower.strategy import CLMA

__all__ = ["PrivateEvaluation"]

PUBLISHED_METRICS = ("accuracy", "mean_loss")


class PrivateEvaluation(Strategy):
    """Wrap a :class:`CLMA` strategy with the governed private evaluation (module doc).

    Args:
        strategy: the wrapped :class:`clma.flower.CLMA` (its engine holds the cohorts,
            regions, ledger and evaluation state).
        metrics: published metric names (a subset of ``accuracy``, ``mean_loss``) returned
            by ``aggregate_evaluate``; default both.
        epsilon / min_cohort: override ``evaluation.epsilon`` and
            ``evaluation.min_cohort``. An explicit ``min_cohort`` must be at least the
            privacy policy's floor (``evaluation.minimum_group_size`` of
            ``budget.policy``, 5 in the shipped policies): a smaller one is refused here,
            before any round (the floor in force is
            ``max(evaluation.min_cohort, minimum_group_size)``).
        secagg_corrupted_fraction / secagg_dropout_fraction: override the SecAgg+
            assumptions ``evaluation.secagg_corrupted_fraction`` /
            ``evaluation.secagg_dropout_fraction``, from which the engine derives each
            session's degree and threshold (:func:`clma.privacy.secagg.
            secagg_plus_parameters`).
        gate: the borrowing gate ``(budget, request) -> BorrowDecision`` (default: none,
            an overspending release is refused).

    Raises:
        TypeError: ``strategy`` is not a CLMA strategy.
        ValueError: an unknown metric name, ``min_cohort`` below the policy's floor, or an
            override that breaks the config's rules.
    """

    def __init__(self, strategy: CLMA, *, metrics: Iterable[str] | None = None,
                 epsilon: float | None = None, min_cohort: int | None = None,
                 secagg_corrupted_fraction: float | None = None,
                 secagg_dropout_fraction: float | None = None,
                 gate: Callable[..., Any] | None = None) -> None:
        if not isinstance(strategy, CLMA):
            raise TypeError("strategy: PrivateEvaluation wraps clma.flower.CLMA (its engine "
                            "holds the cohorts, regions and ledger); for plain FedAvg use "
                            "CLMA with cohort.enabled = false")
        names = list(metrics) if metrics is not None else list(PUBLISHED_METRICS)
        unknown = [m for m in names if m not in PUBLISHED_METRICS]
        if unknown or not names:
            raise ValueError(f"metrics: must be a non-empty subset of {list(PUBLISHED_METRICS)}")
        if strategy.engine is not None:
            raise ValueError("strategy: wrap it before its first round")
        data = strategy.config.model_dump()
        for key, v in (("epsilon", epsilon), ("min_cohort", min_cohort),
                       ("secagg_corrupted_fraction", secagg_corrupted_fraction),
                       ("secagg_dropout_fraction", secagg_dropout_fraction)):
            if v is not None:
                data["evaluation"][key] = v
        config = validate_config(data)
        if min_cohort is not None:
            from clma.engine.budget import policy_of

            floor = policy_of(config).evaluation.minimum_group_size
            if config.evaluation.min_cohort < floor:
                raise ValueError(
                    f"min_cohort: must be >= the privacy policy's cohort floor "
                    f"(evaluation.minimum_group_size = {floor} in "
                    f"{config.budget.policy or 'the shipped default policy'}); got "
                    f"{config.evaluation.min_cohort}. No release may cover fewer clients "
                    f"than the floor: pass min_cohort >= {floor} or leave it unset")
        strategy.config = config
        self.strategy = strategy
        self.metrics = names
        self.gate = gate
        self.outcomes: dict[int, Any] = {}
        self.envelopes: dict[int, dict[str, str]] = {}

    def __getattr__(self, name: str) -> Any:  # cohort_history, results, engine ...
        if name == "strategy":
            raise AttributeError(name)
        return getattr(self.strategy, name)

    # ---------------------------------------------------------------- delegation
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.strategy.aggregate_train(server_round, replies)

    def summary(self) -> None:
        self.strategy.summary()
        ev = self.strategy.config.evaluation
        log(20, "\t└──> PrivateEvaluation: every %d round(s), epsilon %s per release, "
            "cohort floor >= %d, ledger %s", ev.every, ev.epsilon, ev.min_cohort,
            self.strategy.config.budget.enabled)

    # ---------------------------------------------------------------- evaluation
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """The secure sums and the releases of this round (when due); Flower's loop has
        nothing more to send."""
        s = self.strategy
        ctx = s._ctx
        if ctx is None or ctx.round != server_round or not s.engine.evaluation_due(server_round):
            return []
        if not ctx.participants:
            return []
        run_id = str(s.transport.run_id or "")
        s.engine.charge_before_sums(ctx, gate=self.gate, run_id=run_id)
        sums = s.engine.secure_sums(ctx)
        outcome = s.engine.evaluate(ctx, sums, gate=self.gate, run_id=run_id)
        self.outcomes[server_round] = outcome
        self.envelopes[server_round] = dict(outcome.envelopes)
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        """The published global values of this round (None when nothing was released),
        then the round is closed."""
        self.strategy.aggregate_evaluate(server_round, replies)
        outcome = self.outcomes.get(server_round)
        if outcome is None:
            return None
        out = MetricRecord()
        for name in self.metrics:
            pub = outcome.published["metrics"][name].get("global")
            if pub and pub.get("value") is not None:
                out[name] = float(pub["value"])
                out[f"{name}.error-bar"] = float(pub["error_bar"])
        return out if len(out) else None
