"""The simulated federation: clients with private data, regions, a drift schedule.

:func:`build_federation` turns a :class:`clma.config.FederationConfig` into a
:class:`SimulatedFederation`: the dataset's fixed held-out split (test + probe), the
client pool divided IID or Dirichlet(alpha), each client's data split into local training
and local evaluation parts, regions from the versioned partition file, and the initial
model. It is the simulated *world*: the devices' data belong to the simulated clients
(:class:`clma.sim.clients.SimulatedClients`, the transport that plays them), the public
parts to the server (:meth:`SimulatedFederation.assets`). The server's state (cohorts,
models, ledger) lives in the round engine, not here.

Drift is a function of the round: a client's data at round r carry every event of the
config's drift schedule with ``event.round <= r`` (:meth:`SimulatedFederation.drifts_for`).
Everything is seeded: the same config gives the same clients, training and numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from clma.config import FederationConfig
from clma.datasets.builtin import Dataset, DatasetError, holdout_split, load_dataset
from clma.datasets.partition import dirichlet_partition, iid_partition
from clma.engine.state import ServerAssets
from clma.models.checks import check_model_on_features, load_probe
from clma.models.factory import FactoryModelSpec
from clma.models.mlp import MLPSpec
from clma.params import model_to_vector
from clma.regions import PartitionError, RegionPartition, load_partition
from clma.sim.drift import AppliedDrift, apply_drifts

__all__ = [
    "SimClient",
    "ClientEvaluation",
    "SimulatedFederation",
    "build_federation",
]


@dataclass
class SimClient:
    """One simulated device's private data (never sent) and region.

    ``train_*`` / ``eval_*`` are the data before any drift; :meth:`current` applies
    ``drifts`` (set from the schedule, see :meth:`SimulatedFederation.drifts_for`).
    """

    client_id: int
    region: str
    train_x: np.ndarray
    train_y: np.ndarray
    eval_x: np.ndarray
    eval_y: np.ndarray
    n_classes: int
    drifts: list[AppliedDrift] = field(default_factory=list)

    def current(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Current (drifted) ``train_x, train_y, eval_x, eval_y``."""
        tx, ty = apply_drifts(self.train_x, self.train_y, self.drifts, self.n_classes)
        ex, ey = apply_drifts(self.eval_x, self.eval_y, self.drifts, self.n_classes)
        return tx, ty, ex, ey

    @property
    def families(self) -> list[str]:
        return [d.family for d in self.drifts]


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
    """The simulated world of a federation (module docstring)."""

    config: FederationConfig
    spec: ModelSpec
    clients: dict[int, SimClient]
    partition: RegionPartition
    test_x: np.ndarray
    test_y: np.ndarray
    probe_x: np.ndarray
    probe_indices: np.ndarray
    initial_model: np.ndarray
    dataset_name: str

    @property
    def client_ids(self) -> list[int]:
        return sorted(self.clients)

    def region_of(self) -> dict[int, str]:
        return {c: cl.region for c, cl in self.clients.items()}

    def assets(self) -> ServerAssets:
        """What the server may hold: architecture, initial model, the shared probe set
        (held-out public data) and the region partition."""
        return ServerAssets(model_spec=self.spec, initial_model=self.initial_model,
                            probe_x=self.probe_x, partition=self.partition,
                            dataset_name=self.dataset_name)

    def drifts_for(self, client_id: int, round_number: int) -> list[AppliedDrift]:
        """The drifts client ``client_id`` has undergone by round ``round_number`` (every
        schedule event with ``event.round <= round_number`` naming it, in round order, then
        schedule order). Noise seeds are derived from (seed, event round, client, event)."""
        out = []
        events = sorted(enumerate(self.config.drift.events), key=lambda p: (p[1].round, p[0]))
        for i, ev in events:
            if ev.round > round_number or client_id not in ev.clients:
                continue
            noise_seed = int(
                np.random.default_rng([self.config.seed, ev.round, client_id, i]).integers(2**31))
            out.append(AppliedDrift(ev.round, ev.kind, ev.family, ev.shift, ev.magnitude,
                                    noise_seed))
        return out

    def drifted_at(self, round_number: int) -> dict[int, str]:
        """Simulation ground truth: client id -> family for the clients drifted AT
        ``round_number`` (events of that round)."""
        hit: dict[int, str] = {}
        for ev in self.config.drift.events:
            if ev.round == round_number:
                for c in ev.clients:
                    if c in self.clients:
                        hit[c] = ev.family
        return dict(sorted(hit.items()))

    def drifted_clients(self, round_number: int) -> list[int]:
        """Clients drifted at least once by ``round_number`` (ground truth)."""
        return sorted(c for c in self.clients if self.drifts_for(c, round_number))

    def stationary_clients(self, round_number: int) -> list[int]:
        return sorted(c for c in self.clients if not self.drifts_for(c, round_number))


#: The architecture of a simulated federation: the built-in MLP or the user's factory.
ModelSpec = MLPSpec | FactoryModelSpec


def build_federation(config: FederationConfig) -> SimulatedFederation:
    """Build the simulated federation described by ``config`` (deterministic in its seed).

    Raises :class:`clma.datasets.DatasetError` (message prefixed ``data.data_dir:``),
    :class:`clma.regions.PartitionError` (prefixed ``data.region_partition:``) or
    ValueError naming the field when the data cannot host the configured clients.
    """
    if config.data.source is not None:
        from clma.datasets import load_source

        dataset: Dataset = load_source(config.data.source)
    else:
        try:
            dataset = load_dataset(config.data.dataset, config.data.data_dir)
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
        if ev.kind not in ("label_rotation", "feature_scale") and dataset.images.ndim != 4:
            raise ValueError(f"drift.events[{i}].kind: {ev.kind!r} drifts images; the "
                             "features of data.source are not images (N, C, H, W)")
    spec: ModelSpec = (FactoryModelSpec(config.model.factory) if config.model.factory
                       else MLPSpec(dataset.n_features, tuple(config.model.hidden),
                                    dataset.n_classes))
    from clma.params import AllParams

    model = spec.build(seed=config.seed)
    if config.model.weights:
        from clma.models.factory import load_weights

        load_weights(model, config.model.weights)
    probe_x = dataset.images[split.probe]
    if config.data.probe:
        probe_x = load_probe(config.data.probe, dataset.images.shape[1:])
    if config.model.factory:
        check_model_on_features(model, probe_x, dataset.n_classes,
                                needs_relu=config.divergence.enabled)
    initial = model_to_vector(model, AllParams())
    return SimulatedFederation(
        config=config,
        spec=spec,
        clients=clients,
        partition=partition,
        test_x=dataset.images[split.test],
        test_y=dataset.labels[split.test],
        probe_x=probe_x,
        probe_indices=split.probe,
        initial_model=initial,
        dataset_name=dataset.name,
    )
