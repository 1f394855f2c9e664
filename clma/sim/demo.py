"""The built-in demo on Flower SuperNodes: a device that plays a simulated client.

``--node-config "partition-id=3 data-source='clma.sim.demo:simulated_shard'"`` makes a
SuperNode play client 3 of the run's federation exactly as the in-process simulation does
(its shard of the data set, drifted by the config's schedule as of the round asked):
:func:`digits_learner` is this source under the ClientApp's learner
(:func:`clma.flower.device_data.device_learner`), and its training is bit-identical to the
simulation's client. It lives with the simulation because it builds the simulated split; a
real device names its own data instead (:mod:`clma.flower.device_data`), and
:mod:`clma.flower` imports nothing of :mod:`clma.sim`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from clma.sim.clients import SimLearner
from clma.sim.federation import SimClient, SimulatedFederation, build_federation
from clma.sim.models import MLPSpec

if TYPE_CHECKING:
    from clma.flower.learner import TorchLearner

__all__ = ["digits_learner", "simulated_client", "simulated_shard"]


def simulated_shard(node_config: dict[str, Any], federation: Any) -> dict[str, Any]:
    """The data of simulated client ``node_config["partition-id"]`` of ``federation``:
    ``{"train": round -> (x, y), "eval": round -> (x, y)}`` (float32 features, int64
    labels; the schedule's drifts as of the round). Its shard is cached in the node's
    ``state-dir`` when there is one (a ClientApp process starts for every message).

    Raises:
        ValueError: ``partition-id`` is not a client of the federation.
    """
    state_dir = node_config.get("state-dir")
    sim = simulated_client(federation, node_config.get("partition-id"),
                           state_dir if isinstance(state_dir, str) and state_dir else None)

    def train(round_number: int) -> tuple[Any, Any]:
        tx, ty, _, _ = sim.data(round_number)
        return tx, ty

    def evaluate(round_number: int) -> tuple[Any, Any]:
        _, _, ex, ey = sim.data(round_number)
        return ex, ey

    return {"train": train, "eval": evaluate}


def _shard_key(config: Any, partition_id: int) -> str:
    """What a client's shard depends on: the seed, the number of clients and the data and
    model sections (not the drift schedule: drift is applied per round)."""
    import hashlib
    import json

    d = config.model_dump(mode="json")
    doc = {"seed": d["seed"], "clients": d["clients"], "model": d["model"],
           "data": {k: v for k, v in d["data"].items() if k != "region_partition"},
           "client": int(partition_id), "format": 1}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:24]


def _device_view(config: Any, partition_id: int, cache_dir: Any) -> Any:
    """The simulated world as one device sees it: its own shard only (from the device's
    cache when there is one), the architecture and the drift schedule of the config."""
    import os
    from pathlib import Path

    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"digits-shard-{_shard_key(config, partition_id)}.npz"
        if path.exists():
            try:
                with np.load(path, allow_pickle=False) as z:
                    cl = SimClient(int(partition_id), "-", z["train_x"], z["train_y"],
                                   z["eval_x"], z["eval_y"], int(z["n_classes"]))
                    spec = MLPSpec(int(z["n_features"]), tuple(config.model.hidden),
                                   int(z["n_classes"]))
                    name = str(z["dataset"])
                return SimulatedFederation(config, spec, {cl.client_id: cl}, None, None, None,
                                           None, None, None, name)
            except (OSError, ValueError, KeyError):
                pass  # a torn cache file: build it again
    fed = build_federation(config)
    if partition_id not in fed.clients:
        raise ValueError(f"partition-id: must be in [0, {config.clients}) for this federation")
    cl = fed.clients[partition_id]
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            np.savez(f, train_x=cl.train_x, train_y=cl.train_y, eval_x=cl.eval_x,
                     eval_y=cl.eval_y, n_classes=cl.n_classes,
                     n_features=fed.spec.n_features, dataset=fed.dataset_name)
        os.replace(tmp, path)
    return SimulatedFederation(config, fed.spec, {partition_id: cl}, None, None, None, None,
                               None, None, fed.dataset_name)


def simulated_client(config: Any, partition_id: Any, cache_dir: Any = None) -> Any:
    """The simulated client ``partition_id`` of ``config``'s federation as the device sees it
    (:class:`clma.sim.clients.SimLearner` over its own shard only; the shard kept in
    ``cache_dir`` as ``.npz`` when given).

    Raises:
        ValueError: ``partition_id`` is not a client of the federation.
    """
    if isinstance(partition_id, bool) or not isinstance(partition_id, int) or not (
            0 <= partition_id < config.clients):
        raise ValueError(f"partition-id: must be in [0, {config.clients}) for this federation")
    fed = _device_view(config, int(partition_id), cache_dir)
    return SimLearner(fed, fed.clients[int(partition_id)])


def digits_learner(config: Any, partition_id: int, cache_dir: Any = None) -> TorchLearner:
    """The simulated client ``partition_id`` of ``config``'s federation (its data shard,
    drifted by the config's schedule as of the round asked) as a :class:`TorchLearner`:
    the built-in demo's data source (:func:`simulated_shard`) under the
    ClientApp's learner (:func:`clma.flower.device_data.device_learner`), bit-identical to
    the in-process simulation's client (:class:`clma.sim.clients.SimLearner`).

    ``cache_dir``: the device's own folder; its shard is kept there (``.npz``) so later
    messages skip building the data set (a ClientApp process starts for every message).

    Raises:
        ValueError: ``partition_id`` is not a client of the federation.
    """
    from clma.flower.device_data import DeviceData, device_learner
    from clma.models.checks import model_spec_of

    node = {"partition-id": int(partition_id)}
    if cache_dir is not None:
        node["state-dir"] = str(cache_dir)
    parts = simulated_shard(node, config)
    spec = model_spec_of(config)
    return device_learner(spec.build, DeviceData(parts["train"], parts["eval"]),
                          seed=config.seed, partition_id=int(partition_id),
                          batch_size=config.training.batch_size)
