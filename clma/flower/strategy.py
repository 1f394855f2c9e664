"""CLMA as a Flower message-API strategy: a drop-in replacement for ``FedAvg``.

``CLMA`` subclasses :class:`flwr.serverapp.strategy.FedAvg` (sampling, message
validation, metric aggregation and ``start(grid=..., initial_arrays=..., num_rounds=...)``
are inherited) and keeps one model per cohort (CLMA, Adarsh N L et al., CODS-COMAD 2024,
Algorithms 1-3). Per round:

* ``configure_train`` / ``configure_evaluate``: FedAvg samples the nodes; each node gets
  its cohort's model (``ArrayRecord``) and ``config["cohort-id"]``.
* ``aggregate_train``: each reply must hold one ``ArrayRecord`` (the trained model) and
  one ``MetricRecord`` with ``num-examples`` (FedAvg weight) and the on-device integer
  ``drift-flag`` (0/1; see :mod:`clma.flower.client`); no loss is needed. Then the very
  server steps the Prefect flow runs (:mod:`clma.rounds`): :func:`quarantine` of flagged
  clients, :func:`aggregate_per_cohort` (FedAvg inside each cohort over the non-quarantined
  members), :func:`cohort_quarantined` (signed KS -> Gram PCA -> clustering with the
  ``cohorter``, new child cohorts in the :class:`clma.cohort.CohortRegistry`) and
  :func:`merge_reconverged` (``merge_cohorts_threshold``; None = off).

Client ids are the node ids unless ``client_id_of`` maps a node id to another id (the
example app maps simulation nodes to their partition ids). Updates are processed in
ascending client-id order, the merge reference is the start model of the first
quarantined client's cohort at the first quarantine (before that, the initial model), as
in ``flows.federation``; so the same clients, training and seed give the same cohorts.

Returned "global" arrays (``Result.arrays``, the ``arrays`` argument of the next
``configure_*``): the model of the largest active cohort (lowest id on ties). Every
cohort's model: :meth:`CLMA.cohort_arrays`; membership per round: :attr:`CLMA.cohort_history`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from clma.cohort import CLMACohorter, Cohorter, CohortRegistry
from clma.flower.arrays import ArrayLayout
from clma.params import ParamSelector
from clma.rounds import (
    ClientUpdate,
    aggregate_per_cohort,
    cohort_quarantined,
    merge_reconverged,
    quarantine,
)

__all__ = ["CLMA", "DRIFT_FLAG_KEY", "COHORT_ID_KEY"]

DRIFT_FLAG_KEY = "drift-flag"
COHORT_ID_KEY = "cohort-id"


class CLMA(FedAvg):
    """Cohort-based FedAvg with on-device drift quarantine (see module docstring).

    Args:
        cohorter: groups quarantined clients (default ``CLMACohorter()``).
        param_selector: which arrays form the cohorting vector (a
            :class:`clma.params.ParamSelector`; default ``DefaultSelector()``: every
            floating array). Averaging always uses every array.
        merge_cohorts_threshold: displacement-cosine threshold in [0, 2] at which
            reconverged cohorts merge; None disables merging.
        client_id_of: node id -> client id (int or str) used in the registry; default:
            the node id.
        drift_flag_key: MetricRecord key of the drift flag (default ``"drift-flag"``).
        **fedavg_kwargs: FedAvg's options (``fraction_train``, ``min_train_nodes``,
            ``weighted_by_key``, ...).

    Raises:
        ValueError: ``merge_cohorts_threshold`` outside [0, 2].
    """

    def __init__(
        self,
        *,
        cohorter: Cohorter | None = None,
        param_selector: ParamSelector | None = None,
        merge_cohorts_threshold: float | None = None,
        client_id_of: Callable[[int], int | str] | None = None,
        drift_flag_key: str = DRIFT_FLAG_KEY,
        **fedavg_kwargs: Any,
    ) -> None:
        super().__init__(**fedavg_kwargs)
        if merge_cohorts_threshold is not None and not 0.0 <= merge_cohorts_threshold <= 2.0:
            raise ValueError("merge_cohorts_threshold: must be in [0, 2] or None")
        self.cohorter = cohorter if cohorter is not None else CLMACohorter()
        self.param_selector = param_selector
        self.merge_cohorts_threshold = merge_cohorts_threshold
        self.client_id_of = client_id_of if client_id_of is not None else (lambda n: int(n))
        self.drift_flag_key = drift_flag_key
        self.registry = CohortRegistry()
        self.cohort_models: dict[int, np.ndarray] = {}
        self.layout: ArrayLayout | None = None
        self.merge_reference: np.ndarray | None = None
        self.initial_model: np.ndarray | None = None
        self.round_log: dict[int, dict[str, Any]] = {}
        self._select_idx: np.ndarray | None = None
        self._sent: dict[int | str, int] = {}
        self._start_models: dict[int, np.ndarray] = {}

    # ------------------------------------------------------------------ views
    @property
    def cohort_history(self) -> dict[int, dict[int, list[int | str]]]:
        """round -> {cohort id: member client ids} (the registry's history)."""
        return self.registry.history

    def cohort_arrays(self) -> dict[int, ArrayRecord]:
        """Every active cohort's model as an ``ArrayRecord``."""
        if self.layout is None:
            return {}
        return {c: self.layout.to_record(v) for c, v in sorted(self.cohort_models.items())}

    def summary(self) -> None:
        super().summary()
        log(INFO, "\t└──> CLMA: cohorter=%r, param_selector=%r, merge_cohorts_threshold=%s",
            self.cohorter, self.param_selector, self.merge_cohorts_threshold)

    # ------------------------------------------------------------------ helpers
    def _select(self, v: np.ndarray) -> np.ndarray:
        return v if self._select_idx is None else v[self._select_idx]

    def _ensure_started(self, arrays: ArrayRecord, grid: Grid) -> None:
        if self.layout is not None:
            return
        self.layout = ArrayLayout.of(arrays)
        self._select_idx = self.layout.selector_indices(self.param_selector)
        self.initial_model = self.layout.to_vector(arrays)
        clients = sorted({self.client_id_of(n) for n in grid.get_node_ids()},
                         key=lambda c: (str(type(c)), c))
        root = self.registry.create_root(clients, 0)
        self.cohort_models = {root: self.initial_model.copy()}

    def _cohort_of(self, client: int | str, round_number: int) -> int:
        try:
            return self.registry.cohort_of(client)
        except KeyError:  # a node that joined after the start: into the oldest cohort
            target = self.registry.active_cohorts()[0]
            self.registry.assign(client, target, round_number, reason="joined")
            return target

    def _per_cohort(self, messages: Iterable[Message], server_round: int,
                    train: bool = False) -> list[Message]:
        out = []
        for msg in messages:
            client = self.client_id_of(msg.metadata.dst_node_id)
            cohort = self._cohort_of(client, server_round)
            if train:
                self._sent[client] = cohort
            config = ConfigRecord(dict(msg.content.config_records[self.configrecord_key]))
            config[COHORT_ID_KEY] = int(cohort)
            content = RecordDict({
                self.arrayrecord_key: self.layout.to_record(self.cohort_models[cohort]),
                self.configrecord_key: config,
            })
            out.append(Message(content=content, message_type=msg.metadata.message_type,
                               dst_node_id=msg.metadata.dst_node_id))
        return out

    def _largest_cohort_arrays(self) -> ArrayRecord:
        sizes = {c: len(self.registry.members(c)) for c in self.cohort_models}
        best = min(sizes, key=lambda c: (-sizes[c], c))
        return self.layout.to_record(self.cohort_models[best])

    # ------------------------------------------------------------------ training
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's sampling; each sampled node gets its cohort's model."""
        self._ensure_started(arrays, grid)
        self._sent = {}
        self._start_models = {c: v.copy() for c, v in self.cohort_models.items()}
        return self._per_cohort(super().configure_train(server_round, arrays, config, grid),
                                server_round, train=True)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Quarantine, per-cohort FedAvg, cohorting and merging (module docstring)."""
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid or self.layout is None:
            return None, None
        updates = []
        for msg in valid:
            client = self.client_id_of(msg.metadata.src_node_id)
            if client not in self._sent:
                continue  # a reply to a message this round did not send
            content = msg.content
            arrays = next(iter(content.array_records.values()))
            metrics = next(iter(content.metric_records.values()))
            if self.drift_flag_key not in metrics:
                raise ValueError(f"reply MetricRecord: missing the '{self.drift_flag_key}' key "
                                 "(0 or 1, set by clma.flower.client)")
            flag = metrics[self.drift_flag_key]
            if isinstance(flag, list) or flag not in (0, 1):
                raise ValueError(f"reply MetricRecord: '{self.drift_flag_key}' must be 0 or 1")
            updates.append(ClientUpdate(
                client_id=client, cohort_id=self._sent[client],
                params=self.layout.to_vector(arrays),
                n_samples=int(metrics[self.weighted_by_key]), drift_flag=bool(flag)))
        updates.sort(key=lambda u: (str(type(u.client_id)), u.client_id))
        start = self._start_models
        quarantined = quarantine(updates)
        if quarantined and self.merge_reference is None:
            first = next(u.cohort_id for u in updates if u.client_id in set(quarantined))
            self.merge_reference = start[first].copy()
        models = aggregate_per_cohort(updates, quarantined, start)
        new_cohorts: dict[int, list] = {}
        if quarantined:
            models, outcome = cohort_quarantined(
                updates, quarantined, models, self.registry, self.cohorter, server_round,
                select=self._select, start_models=start)
            new_cohorts = outcome.new_cohorts
        sizes = {c: len(self.registry.members(c)) for c in self.registry.active_cohorts()}
        reference = self.merge_reference if self.merge_reference is not None \
            else self.initial_model
        models, merges = merge_reconverged(
            models, self.registry, reference, self.merge_cohorts_threshold, server_round,
            sizes, select=self._select)
        self.cohort_models = {c: models[c] for c in self.registry.active_cohorts()}
        self.registry.record_round(server_round)
        self.round_log[server_round] = {
            "flagged": sum(u.drift_flag for u in updates), "quarantined": len(quarantined),
            "new_cohorts": {k: len(v) for k, v in new_cohorts.items()},
            "merges": [(g, n) for g, n in merges],
        }
        metrics = self.train_metrics_aggr_fn([m.content for m in valid], self.weighted_by_key)
        metrics["n-cohorts"] = len(self.cohort_models)
        metrics["quarantined"] = len(quarantined)
        return self._largest_cohort_arrays(), metrics

    # ------------------------------------------------------------------ evaluation
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's sampling; each sampled node evaluates its cohort's model."""
        self._ensure_started(arrays, grid)
        return self._per_cohort(
            super().configure_evaluate(server_round, arrays, config, grid), server_round)
