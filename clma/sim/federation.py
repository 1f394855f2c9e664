"""The simulated federation: clients with private data, regions, a drift schedule.

:func:`build_federation` turns a :class:`clma.config.FederationConfig` into a
:class:`SimulatedFederation`: the dataset's fixed held-out split (test + probe), the
client pool divided IID or Dirichlet(alpha), each client's data split into local training
and local evaluation parts, regions from the versioned partition file, the initial model,
and the cohort registry with every client in root cohort 0.

Client work is done by pure functions (:func:`train_clients`, :func:`evaluate_clients`)
that take the clients' data and the models and return results, so an orchestrator can run
them in threads, processes or on a cluster. Everything is seeded: the same config gives
the same clients, the same training and the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from clma.cohort import CohortRegistry
from clma.config import FederationConfig, TrainingConfig
from clma.drift import LossThresholdDetector
from clma.params import model_to_vector
from clma.regions import PartitionError, RegionPartition, load_partition
from clma.rounds import ClientUpdate
from clma.sim.data import Dataset, DatasetError, holdout_split, load_dataset
from clma.sim.drift import AppliedDrift, apply_drifts
from clma.sim.models import MLPSpec
from clma.sim.partition import dirichlet_partition, iid_partition
from clma.sim.training import local_train, predict_proba

__all__ = [
    "SimClient",
    "ClientTrainResult",
    "ClientEvaluation",
    "SimulatedFederation",
    "build_federation",
    "train_clients",
    "evaluate_clients",
]


@dataclass
class SimClient:
    """One simulated device: its private data (never sent), region and drift history.

    ``train_*`` / ``eval_*`` are the data before any drift; :meth:`current` applies the
    drifts. ``detector_state`` is the on-device drift detector's state (client side).
    """

    client_id: int
    region: str
    train_x: np.ndarray
    train_y: np.ndarray
    eval_x: np.ndarray
    eval_y: np.ndarray
    n_classes: int
    drifts: list[AppliedDrift] = field(default_factory=list)
    detector_state: dict[str, Any] | None = None

    def current(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Current (drifted) ``train_x, train_y, eval_x, eval_y``."""
        tx, ty = apply_drifts(self.train_x, self.train_y, self.drifts, self.n_classes)
        ex, ey = apply_drifts(self.eval_x, self.eval_y, self.drifts, self.n_classes)
        return tx, ty, ex, ey

    @property
    def families(self) -> list[str]:
        return [d.family for d in self.drifts]


@dataclass(frozen=True)
class ClientTrainResult:
    """The update sent to the server, and the new on-device detector state (kept local)."""

    update: ClientUpdate
    detector_state: dict[str, Any]


@dataclass(frozen=True)
class ClientEvaluation:
    """One client's on-device evaluation of its cohort's model.

    ``accuracy`` in [0, 1] and ``loss`` (mean cross-entropy, nats) already clipped to
    ``[0, loss_max]`` on the device. In the real protocol these leave the device only
    inside a secure-aggregation sum; the simulation holds them in memory and never logs
    them.
    """

    client_id: int
    region: str
    cohort_id: int
    accuracy: float
    loss: float
    n_eval: int
    probabilities: np.ndarray | None = None
    labels: np.ndarray | None = None


@dataclass
class SimulatedFederation:
    """State of a simulated federation between rounds."""

    config: FederationConfig
    spec: MLPSpec
    clients: dict[int, SimClient]
    partition: RegionPartition
    test_x: np.ndarray
    test_y: np.ndarray
    probe_x: np.ndarray
    probe_indices: np.ndarray
    initial_model: np.ndarray
    registry: CohortRegistry
    cohort_models: dict[int, np.ndarray]
    dataset_name: str
    rounds_done: int = 0
    merge_reference: np.ndarray | None = None

    @property
    def client_ids(self) -> list[int]:
        return sorted(self.clients)

    def region_of(self) -> dict[int, str]:
        return {c: cl.region for c, cl in self.clients.items()}

    def drifted_clients(self) -> list[int]:
        """Clients that have undergone at least one injected drift (ground truth)."""
        return sorted(c for c, cl in self.clients.items() if cl.drifts)

    def stationary_clients(self) -> list[int]:
        return sorted(c for c, cl in self.clients.items() if not cl.drifts)

    def inject_drift(self, round_number: int) -> dict[int, str]:
        """Apply the schedule's events of ``round_number`` to the clients' data.

        Returns client id -> family for the clients drifted now (simulation ground truth).
        """
        hit: dict[int, str] = {}
        for i, ev in enumerate(self.config.drift.events):
            if ev.round != round_number:
                continue
            for c in ev.clients:
                if c not in self.clients:
                    continue
                noise_seed = int(
                    np.random.default_rng([self.config.seed, round_number, c, i]).integers(2**31)
                )
                self.clients[c].drifts.append(
                    AppliedDrift(round_number, ev.kind, ev.family, ev.shift, ev.magnitude,
                                 noise_seed)
                )
                hit[c] = ev.family
        return dict(sorted(hit.items()))

    def models_for(self, client_ids: Sequence[int]) -> dict[int, np.ndarray]:
        """The cohort model each listed client starts from: client id -> float32 vector."""
        return {c: self.cohort_models[self.registry.cohort_of(c)] for c in client_ids}


def build_federation(config: FederationConfig) -> SimulatedFederation:
    """Build the simulated federation described by ``config`` (deterministic in its seed).

    Raises :class:`clma.sim.data.DatasetError` (message prefixed ``data.data_dir:``),
    :class:`clma.regions.PartitionError` (prefixed ``data.region_partition:``) or
    ValueError naming the field when the data cannot host the configured clients.
    """
    try:
        dataset: Dataset = load_dataset(config.data.dataset, config.data.data_dir)
    except DatasetError as exc:
        raise DatasetError(f"data.data_dir: {exc}") from None
    split = holdout_split(
        dataset.labels,
        holdout_fraction=config.data.holdout_fraction,
        probe_size=config.data.probe_size,
        seed=config.seed,
    )
    rng = np.random.default_rng([config.seed, 1])
    pool_labels = dataset.labels[split.pool]
    if config.data.partition == "iid":
        shards = iid_partition(split.pool.shape[0], config.clients, rng)
    else:
        shards = dirichlet_partition(pool_labels, config.clients, config.data.dirichlet_alpha, rng)
    try:
        partition = load_partition(config.data.region_partition)
    except PartitionError as exc:
        raise PartitionError(f"data.region_partition: {exc}") from None
    regions = partition.assign(config.clients, config.seed)
    clients: dict[int, SimClient] = {}
    for cid, shard in enumerate(shards):
        idx = split.pool[rng.permutation(shard)]
        n_eval = max(1, int(round(config.data.local_eval_fraction * idx.shape[0])))
        if idx.shape[0] - n_eval < 1:
            raise ValueError("clients: too many clients for the data (a client has no training data)")
        ev, tr = idx[:n_eval], idx[n_eval:]
        clients[cid] = SimClient(
            client_id=cid,
            region=regions[cid],
            train_x=dataset.images[tr],
            train_y=dataset.labels[tr],
            eval_x=dataset.images[ev],
            eval_y=dataset.labels[ev],
            n_classes=dataset.n_classes,
        )
    for i, ev in enumerate(config.drift.events):
        if ev.kind == "label_rotation" and ev.shift % dataset.n_classes == 0:
            raise ValueError(
                f"drift.events[{i}].shift: a rotation by a multiple of the number of classes "
                f"({dataset.n_classes}) changes no label"
            )
    spec = MLPSpec(dataset.n_features, tuple(config.model.hidden), dataset.n_classes)
    from clma.params import AllParams

    initial = model_to_vector(spec.build(seed=config.seed), AllParams())
    registry = CohortRegistry()
    root = registry.create_root(sorted(clients), 0)
    return SimulatedFederation(
        config=config,
        spec=spec,
        clients=clients,
        partition=partition,
        test_x=dataset.images[split.test],
        test_y=dataset.labels[split.test],
        probe_x=dataset.images[split.probe],
        probe_indices=split.probe,
        initial_model=initial,
        registry=registry,
        cohort_models={root: initial.copy()},
        dataset_name=dataset.name,
    )


def train_clients(
    clients: Sequence[SimClient],
    models: Mapping[int, np.ndarray],
    cohort_of: Mapping[int, int],
    spec: MLPSpec,
    training: TrainingConfig,
    gamma: float,
    seed: int,
    round_number: int,
) -> list[ClientTrainResult]:
    """On-device work of a round for a chunk of clients (pure; runs anywhere).

    Each client loads its cohort's model (``models[client_id]``), computes that model's
    loss on its current local data, updates its :class:`clma.drift.LossThresholdDetector`
    (flag when the loss rose by more than ``gamma`` over its previous round), trains
    ``training.local_epochs`` epochs of SGD, and returns its update with the flag bit.
    The loss itself never leaves the device.
    """
    out = []
    for cl in clients:
        tx, ty, _, _ = cl.current()
        rng = np.random.default_rng([seed, round_number, cl.client_id, 7])
        res = local_train(
            spec,
            models[cl.client_id],
            tx,
            ty,
            epochs=training.local_epochs,
            learning_rate=training.learning_rate,
            batch_size=training.batch_size,
            rng=rng,
        )
        det = LossThresholdDetector(gamma)
        if cl.detector_state is not None:
            det.load_state_dict(cl.detector_state)
        flag = bool(det.update(res.pre_loss))
        out.append(
            ClientTrainResult(
                ClientUpdate(cl.client_id, int(cohort_of[cl.client_id]), res.vector, res.n_samples,
                             flag),
                det.state_dict(),
            )
        )
    return out


def evaluate_clients(
    clients: Sequence[SimClient],
    models: Mapping[int, np.ndarray],
    cohort_of: Mapping[int, int],
    spec: MLPSpec,
    loss_max: float,
    *,
    keep_probabilities: bool = False,
) -> list[ClientEvaluation]:
    """On-device evaluation of each client's cohort model on its local evaluation data.

    Accuracy and mean cross-entropy are computed on the device and the loss is clipped to
    ``[0, loss_max]`` before it leaves. ``keep_probabilities`` also returns the predicted
    probabilities (for on-device histogram / calibration metrics).
    """
    out = []
    for cl in clients:
        _, _, ex, ey = cl.current()
        proba = predict_proba(spec, models[cl.client_id], ex)
        p_true = np.clip(proba[np.arange(ey.shape[0]), ey], 1e-12, 1.0)
        loss = float(np.clip(-np.log(p_true).mean(), 0.0, loss_max))
        acc = float((proba.argmax(axis=1) == ey).mean())
        out.append(
            ClientEvaluation(
                cl.client_id, cl.region, int(cohort_of[cl.client_id]), acc, loss,
                int(ey.shape[0]),
                proba if keep_probabilities else None,
                ey if keep_probabilities else None,
            )
        )
    return out
