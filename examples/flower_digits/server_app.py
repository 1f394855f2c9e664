"""ServerApp of the Flower digits example: CLMA (or plain FedAvg) on the drift schedule.

The federation config (``clma/configs/clma_vs_fedavg.toml`` unless the run config's
``config-path`` names another) gives the seed, rounds, clients, model and cohorter; the
strategy is :class:`clma.flower.CLMA` when ``cohort.enabled`` (else Flower's ``FedAvg``,
the baseline), with every node sampled every round (``training.participation`` must be
1.0), wrapped in :class:`clma.flower.private.PrivateEvaluation` (accuracy and clipped
loss, secure-aggregated through Flower messages, Laplace noise once on each sum;
run config ``private-evaluation = "false"`` turns it off). Nodes are first asked their partition id (one ``query`` round-trip), which becomes
the client id in the cohort registry, so cohort ids and members compare one-to-one with
the Prefect flow's on the same config.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from clma.flower import CLMA
from clma.flower.private import PrivateEvaluation
from clma.release import MetricSpec

try:
    from .task import config_from, federation_at, make_cohorter
except ImportError:  # loaded as a top-level module (tests, run_simulation)
    from task import config_from, federation_at, make_cohorter

#: The last run's outcome in this process (tests and notebooks read it).
LAST_RUN: dict[str, Any] = {}


def partition_ids(grid: Grid, n_nodes: int, timeout: float = 120.0) -> dict[int, int]:
    """node id -> partition id, asked once from every node (waits for ``n_nodes``)."""
    deadline = time.monotonic() + timeout
    nodes = list(grid.get_node_ids())
    while len(nodes) < n_nodes:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(nodes)} of {n_nodes} nodes connected")
        time.sleep(0.2)
        nodes = list(grid.get_node_ids())
    replies = grid.send_and_receive(
        [Message(content=RecordDict(), message_type="query", dst_node_id=n) for n in nodes],
        timeout=timeout)
    out = {}
    for r in replies:
        if r.has_error():
            raise RuntimeError(f"node {r.metadata.src_node_id} did not answer the query")
        out[r.metadata.src_node_id] = int(r.content["info"]["partition-id"])
    return out


def make_server_app(config_path: str | None = None) -> ServerApp:
    """A ServerApp bound to ``config_path`` (None: the run config's ``config-path``)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        cfg = config_from(context.run_config, config_path)
        if cfg.training.participation != 1.0:
            raise ValueError("training.participation: the example samples every node (1.0)")
        fed = federation_at(cfg, 0)
        to_client = partition_ids(grid, cfg.clients)
        common = dict(fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=cfg.clients,
                      min_evaluate_nodes=cfg.clients, min_available_nodes=cfg.clients)
        if cfg.cohort.enabled:
            strategy = CLMA(cohorter=make_cohorter(cfg),
                            merge_cohorts_threshold=cfg.cohort.merge_cohorts_threshold,
                            client_id_of=to_client.__getitem__, **common)
        else:
            strategy = FedAvg(**common)
        if str(context.run_config.get("private-evaluation", "true")).lower() == "true":
            # on-device clipped metrics, secure sum over Flower messages, noise once
            strategy = PrivateEvaluation(
                strategy,
                metrics=[MetricSpec("accuracy", 0.0, 1.0),
                         MetricSpec("loss", 0.0, cfg.evaluation.loss_max)],
                epsilon=cfg.evaluation.epsilon, min_cohort=max(cfg.evaluation.min_cohort, 5),
                secagg_threshold=cfg.evaluation.secagg_threshold,
                seed=cfg.seed if cfg.evaluation.noise_seeded else None)
        initial = ArrayRecord(fed.spec.build(seed=cfg.seed).state_dict())
        result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=cfg.rounds)
        history = getattr(strategy, "cohort_history", {})
        LAST_RUN.clear()
        LAST_RUN.update(strategy=strategy, result=result, cohort_history=history,
                        partition_of_node=to_client)
        out = str(context.run_config.get("out", "") or "")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            doc = {"config": cfg.name, "seed": cfg.seed,
                   "cohort_history": {str(r): {str(c): m for c, m in snap.items()}
                                      for r, snap in history.items()},
                   "evaluate": {str(r): dict(m) for r, m in
                                result.evaluate_metrics_clientapp.items()}}
            (Path(out) / "flower_summary.json").write_text(json.dumps(doc, indent=2) + "\n")

    return app


app = make_server_app()
