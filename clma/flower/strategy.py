"""CLMA as a Flower message-API strategy: the round engine behind Flower's Strategy.

:class:`CLMA` subclasses :class:`flwr.serverapp.strategy.FedAvg` (so
``start(grid=..., initial_arrays=..., num_rounds=...)`` and the options are inherited) and
runs every round through :class:`clma.engine.FederationEngine` -- the steps the Prefect
flow runs, one copy of every rule:

* ``configure_train`` -- on the first round the engine is built over a
  :class:`clma.flower.transport.FlowerTransport` on the grid (the roster: each node's
  partition id, or ``client_id_of``); :meth:`~FederationEngine.begin_round` selects the
  clients (seeded, ``training.participation``) and fixes their cohorts' models; one
  ``train`` message per selected node (wire format :mod:`clma.flower.codec`; a node whose
  ClientApp has no query handler -- fed-clma's ClientApp -- gets fed-clma's message format
  and its replies are accepted, :mod:`clma.flower.fedclma`).
* ``aggregate_train`` -- every reply is decoded and checked BEFORE any state changes
  (an error reply, a malformed reply, ``num-examples`` < 1, a wrong length: a dropout of
  the round; :meth:`~FederationEngine.check_replies`), then
  :meth:`~FederationEngine.accept` and :meth:`~FederationEngine.after_training`:
  quarantine on the on-device drift flag, divergence scores, FedAvg or DP-FedAvg per
  cohort (DP-FedAvg charges the ledger's training line), cohorting, merging.
* ``configure_evaluate`` / ``aggregate_evaluate`` -- no plain evaluation (metrics never
  reach the server one client at a time): the round is closed
  (:meth:`~FederationEngine.finish`); :class:`clma.flower.private.PrivateEvaluation` adds
  the private regional evaluation before that.

The federation's rules come from a :class:`clma.config.FederationConfig` (seed,
participation, cohorting, divergence, DP-FedAvg, evaluation, budget policy); the
constructor's CLMA options override it. The ledger (:func:`clma.engine.open_budget`) is
opened on the first round when ``budget.enabled``.

Returned "global" arrays (``Result.arrays``): the model of the largest active cohort
(lowest id on ties). Every cohort's model: :meth:`CLMA.cohort_arrays`; membership per
round: :attr:`CLMA.cohort_history`; each round's :class:`clma.engine.RoundResult`:
:attr:`CLMA.results`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from clma.cohort import Cohorter
from clma.config import FederationConfig, validate_config
from clma.flower import codec
from clma.flower.arrays import ArrayLayout
from clma.params import ParamSelector

__all__ = ["CLMA", "COHORT_ID_KEY", "DRIFT_FLAG_KEY"]

DRIFT_FLAG_KEY = codec.DRIFT_FLAG
COHORT_ID_KEY = "cohort-id"
#: the drift flag's metric keys (this package's ClientApp's, fed-clma's): not aggregated
_DRIFT_KEYS = (codec.DRIFT_FLAG, "clma-drift")
_FIXED_KEYS = {"weighted_by_key": codec.NUM_EXAMPLES, "arrayrecord_key": codec.ARRAYS}


def _config_with(config: FederationConfig | None, fraction_train: float | None,
                 merge_cohorts_threshold: float | None) -> FederationConfig:
    data = (config or FederationConfig()).model_dump()
    if fraction_train is not None:
        if config is not None and config.training.participation != fraction_train:
            raise ValueError("fraction_train: differs from the config's "
                             "training.participation (give one of them)")
        data["training"]["participation"] = float(fraction_train)
    if merge_cohorts_threshold is not None:
        data["cohort"]["merge_cohorts_threshold"] = float(merge_cohorts_threshold)
    return validate_config(data)


class _RecordSpec:
    """The architecture as the initial arrays' layout: ``build()`` gives an object whose
    ``state_dict()`` maps every record key to a zero array of its shape and dtype, so the
    engine maps selectors onto the record by name and dtype (no model needed)."""

    def __init__(self, layout: ArrayLayout) -> None:
        self.layout = layout

    def build(self, seed: int | None = None) -> Any:
        layout = self.layout

        class _Template:
            def state_dict(self) -> dict[str, np.ndarray]:
                return {n: np.zeros(s, dtype=d)
                        for n, s, d in zip(layout.names, layout.shapes, layout.dtypes,
                                           strict=True)}

        return _Template()


def _wait_for_nodes(grid: Grid, count: int, timeout: float) -> int:
    """The number of connected nodes once ``count`` are (or ``timeout`` s passed)."""
    import time

    deadline = time.monotonic() + timeout
    n = len(list(grid.get_node_ids()))
    while n < count and time.monotonic() < deadline:
        time.sleep(1.0)
        n = len(list(grid.get_node_ids()))
    return n


class CLMA(FedAvg):
    """Cohort-based FedAvg with on-device drift quarantine, on the round engine (module
    docstring).

    Args:
        config: the federation's rules (default: :class:`FederationConfig` defaults with
            ``clients`` = the nodes connected at the first round, after waiting for
            ``min_available_nodes`` -- fed-clma's ``CLMA()``).
        assets: the server's public assets (model architecture, initial model, probe set,
            region partition; :class:`clma.engine.ServerAssets`). Default: built from the
            ``initial_arrays`` of ``start`` (selectors are mapped onto its keys by name and
            dtype) and the config's region partition, with divergence scoring off (it needs
            a probe set).
        model_fn: optional; builds the model (``torch.nn.Module``) to check that its
            ``state_dict`` keys are the ``initial_arrays``' (ValueError otherwise).
        cohorter: groups quarantined clients (default: the config's ``CLMACohorter``).
        param_selector: which arrays form the cohorting vector (default
            ``DefaultSelector()``); averaging always uses every array.
        merge_cohorts_threshold: displacement-cosine threshold in [0, 2] at which
            reconverged cohorts merge (overrides ``cohort.merge_cohorts_threshold``).
        client_id_of: node id -> client id; default: each node's ``partition-id``, asked
            once.
        budget: an open :class:`clma.engine.BudgetState`; default: opened from the config
            when ``budget.enabled``.
        timeout: seconds an exchange waits for replies (default
            ``federation.flower.timeout_seconds``).
        **fedavg_kwargs: FedAvg's options. ``fraction_train`` is the engine's
            ``training.participation`` (seeded selection); ``min_available_nodes`` /
            ``min_train_nodes``: nodes to wait for before the first round;
            ``train_metrics_aggr_fn`` aggregates the accepted replies' metrics (the drift
            flags are dropped from the result: their mean would give the exact count of
            drifted clients, a count that leaves the server only as a band). The record
            keys are the CLMA ClientApp's (``weighted_by_key="num-examples"``,
            ``arrayrecord_key="arrays"``).

    Raises:
        ValueError: ``merge_cohorts_threshold`` outside [0, 2]; ``fraction_train``
            differing from the config's participation; other record keys; at the first
            round: ``model_fn``'s keys differing from ``initial_arrays``'.
    """

    def __init__(self, *, config: FederationConfig | None = None, assets: Any = None,
                 model_fn: Callable[[], Any] | None = None, cohorter: Cohorter | None = None,
                 param_selector: ParamSelector | None = None,
                 merge_cohorts_threshold: float | None = None,
                 client_id_of: Callable[[int], int] | None = None, budget: Any = None,
                 timeout: float | None = None, **fedavg_kwargs: Any) -> None:
        if merge_cohorts_threshold is not None and not 0.0 <= merge_cohorts_threshold <= 2.0:
            raise ValueError("merge_cohorts_threshold: must be in [0, 2] or None")
        for k, v in _FIXED_KEYS.items():
            if k in fedavg_kwargs and fedavg_kwargs[k] != v:
                raise ValueError(f"{k}: the CLMA ClientApp's wire format uses {v!r}")
        super().__init__(**fedavg_kwargs)
        self._config_given = config is not None
        self.config = _config_with(config, fedavg_kwargs.get("fraction_train"),
                                   merge_cohorts_threshold)
        self.assets = assets
        self.model_fn = model_fn
        self.cohorter = cohorter
        self.param_selector = param_selector
        self.merge_cohorts_threshold = self.config.cohort.merge_cohorts_threshold
        self.client_id_of = client_id_of
        self.budget = budget
        self.timeout = timeout
        self.engine: Any = None
        self.transport: Any = None
        self.layout: ArrayLayout | None = None
        self.results: dict[int, Any] = {}
        self.evaluations: dict[int, Any] = {}
        self._ctx: Any = None
        self._request: Any = None
        self._sent: list[Message] = []

    # ------------------------------------------------------------------ views
    @property
    def cohort_history(self) -> dict[int, dict[int, list[int]]]:
        """round -> {cohort id: member client ids} (the registry's history)."""
        return self.engine.state.registry.history if self.engine is not None else {}

    @property
    def registry(self) -> Any:
        return self.engine.state.registry if self.engine is not None else None

    @property
    def cohort_models(self) -> dict[int, np.ndarray]:
        return dict(self.engine.state.cohort_models) if self.engine is not None else {}

    def cohort_arrays(self) -> dict[int, ArrayRecord]:
        """Every active cohort's model as an ``ArrayRecord``."""
        if self.layout is None:
            return {}
        return {c: self.layout.to_record(v) for c, v in sorted(self.cohort_models.items())}

    def summary(self) -> None:
        super().summary()
        log(INFO, "\t└──> CLMA on the round engine: cohorter=%r, param_selector=%r, "
            "merge_cohorts_threshold=%s, ledger=%s", self.cohorter, self.param_selector,
            self.merge_cohorts_threshold, self.config.budget.enabled)

    # ------------------------------------------------------------------ start-up
    def _assets(self, arrays: ArrayRecord) -> Any:
        from clma.engine import ServerAssets
        from clma.regions import load_partition

        vector = self.layout.to_vector(arrays)
        if self.assets is not None:
            if self.assets.initial_model.shape != vector.shape or not np.array_equal(
                    self.assets.initial_model, vector):
                raise ValueError("initial_arrays: differ from assets.initial_model")
            return self.assets
        if self.model_fn is not None:
            names = tuple(self.model_fn().state_dict().keys())
            if names != self.layout.names:
                raise ValueError("model_fn: its state_dict keys differ from initial_arrays' keys")
        if self.config.divergence.enabled:
            self.config = self.config.model_copy(update={
                "divergence": self.config.divergence.model_copy(update={"enabled": False})})

        return ServerAssets(model_spec=_RecordSpec(self.layout), initial_model=vector,
                            probe_x=np.zeros((0,), np.float32),
                            partition=load_partition(self.config.data.region_partition),
                            dataset_name="user")

    def _ensure_started(self, arrays: ArrayRecord, grid: Grid) -> None:
        if self.engine is not None:
            return
        from clma.engine import FederationEngine, open_budget
        from clma.flower.transport import FlowerTransport, check_noise_source

        node_count = max(int(self.min_available_nodes), int(self.min_train_nodes), 1)
        if not self._config_given:  # fed-clma's CLMA(): the federation is the grid's nodes
            n = _wait_for_nodes(grid, node_count, self.config.flower.connect_timeout_seconds)
            self.config = validate_config({**self.config.model_dump(), "clients": max(n, 1)})
        check_noise_source(self.config)
        self.layout = ArrayLayout.of(arrays)
        assets = self._assets(arrays)
        self.transport = FlowerTransport(
            grid, self.config, partition=assets.partition, client_id_of=self.client_id_of,
            timeout=self.timeout, n_params=assets.n_params, node_count=node_count)
        self.transport.layout = self.layout  # fed-clma-format replies (clma.flower.fedclma)
        if self.budget is None and self.config.budget.enabled:
            self.budget = open_budget(self.config)
        self.engine = FederationEngine(self.config, assets, self.transport, budget=self.budget,
                                       cohorter=self.cohorter, selector=self.param_selector)

    def _largest_cohort_arrays(self) -> ArrayRecord:
        reg = self.engine.state.registry
        models = self.engine.state.cohort_models
        sizes = {c: len(reg.members(c)) for c in models}
        best = min(sizes, key=lambda c: (-sizes[c], c))
        return self.layout.to_record(models[best])

    # ------------------------------------------------------------------ training
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """The engine's selection; each selected node gets its cohort's model."""
        self._ensure_started(arrays, grid)
        if self._ctx is not None and self._ctx.round != server_round:
            self._close_round()  # a round without aggregate_evaluate (e.g. Flower skipped it)
        self._ctx = self.engine.begin_round(server_round)
        self._request = self.engine.train_request(self._ctx)
        self.transport.train_config = dict(config)  # fed-clma-format messages carry it
        self._sent = self.transport.messages("train", self._request)
        return list(self._sent)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check every reply, then the engine's steps 3-8 (module docstring)."""
        if self._ctx is None or self._ctx.round != server_round:
            return None, None
        got = list(replies)
        decoded, accepted = self.transport.collect("train", self._request, self._sent, got)
        checked = self.engine.check_replies(self._request, decoded)
        self.engine.accept(self._ctx, [checked])
        self.engine.after_training(self._ctx)
        ok = [accepted[c] for c in sorted(checked.ok)]
        metrics = (self.train_metrics_aggr_fn([m.content for m in ok], self.weighted_by_key)
                   if ok else MetricRecord())
        for key in _DRIFT_KEYS:  # their mean times the replies = the exact drifted count
            if key in metrics:
                del metrics[key]
        metrics["n-cohorts"] = len(self.engine.state.cohort_models)
        return self._largest_cohort_arrays(), metrics

    # ------------------------------------------------------------------ evaluation
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """No plain evaluation: metrics leave a device only inside a secure sum
        (:class:`clma.flower.private.PrivateEvaluation`)."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        """Close the round (:meth:`FederationEngine.finish`)."""
        self._close_round()
        return None

    def _close_round(self) -> Any:
        if self._ctx is None:
            return None
        res = self.engine.finish(self._ctx)
        self.results[res.round] = res
        self._ctx = None
        return res
