"""ClientApp of the Flower digits example: the CLMA ClientApp (clma.flower.clientapp)
with one simulated digits client per SuperNode -- the client of the node's partition id,
same data and drift schedule as the Prefect flow's simulation.

Your own model and data instead: ``make_client_app(lambda context: TorchLearner(model_fn,
train_loader, eval_loader))`` (:class:`clma.flower.learner.TorchLearner`).
"""

from __future__ import annotations

from typing import Any

from flwr.app import Context
from flwr.clientapp import ClientApp

from clma.flower.clientapp import make_client_app as clma_client_app

try:
    from .server_app import config_from
except ImportError:  # loaded as a top-level module (tests, run_simulation)
    from server_app import config_from

_LEARNERS: dict[tuple[str, int], Any] = {}


def make_client_app(config_path: str | None = None) -> ClientApp:
    """A ClientApp bound to ``config_path`` (None: the run config's ``config-path``)."""

    def learner(context: Context) -> Any:
        from clma.sim.demo import digits_learner

        cfg = config_from(context.run_config, config_path)
        pid = int(context.node_config["partition-id"])
        key = (cfg.fingerprint(), pid)
        if key not in _LEARNERS:  # a simulation reuses its worker processes
            _LEARNERS[key] = digits_learner(cfg, pid)
        return _LEARNERS[key]

    return clma_client_app(learner)


app = make_client_app()
