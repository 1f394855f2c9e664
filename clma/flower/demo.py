"""The built-in demo's data source: the simulated digits client of the node's partition id.

``--node-config "partition-id=3 data-source='clma.flower.demo:simulated_shard'"`` makes a
SuperNode play client 3 of the run's federation exactly as the in-process simulation does
(its shard of scikit-learn's digits, drifted by the config's schedule as of the round asked):
:func:`clma.flower.learner.digits_learner` is this source under the ClientApp's learner, and
its training is bit-identical to the simulation's client. A real device names its own data
instead (:mod:`clma.flower.device_data`); only this demo builds the simulated split.
"""

from __future__ import annotations

from typing import Any

__all__ = ["simulated_shard"]


def simulated_shard(node_config: dict[str, Any], federation: Any) -> dict[str, Any]:
    """The data of simulated client ``node_config["partition-id"]`` of ``federation``:
    ``{"train": round -> (x, y), "eval": round -> (x, y)}`` (float32 features, int64
    labels; the schedule's drifts as of the round). Its shard is cached in the node's
    ``state-dir`` when there is one (a ClientApp process starts for every message).

    Raises:
        ValueError: ``partition-id`` is not a client of the federation.
    """
    from clma.flower.learner import simulated_client

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
