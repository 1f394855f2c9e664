"""ClientApp of the Flower digits example: one simulated digits client per SuperNode.

``train``: the received cohort model is trained with
:func:`clma.sim.federation.train_clients` (which also runs the on-device
``LossThresholdDetector``; its state lives in ``context.state`` via
:mod:`clma.flower.client`); the reply carries the arrays, ``num-examples`` and the
``drift-flag`` bit. ``evaluate``: accuracy and clipped loss of the received model on the
local evaluation split. ``query``: the node's partition id (the example's client id).
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clma.flower import ArrayLayout, load_detector_state, save_detector_state, train_reply_content
from clma.flower.private import register_private_evaluation
from clma.sim.federation import evaluate_clients, train_clients

try:
    from .task import client_at, config_from, federation_at
except ImportError:  # loaded as a top-level module (tests, run_simulation)
    from task import client_at, config_from, federation_at


def make_client_app(config_path: str | None = None) -> ClientApp:
    """A ClientApp bound to ``config_path`` (None: the run config's ``config-path``)."""
    app = ClientApp()

    def _setup(msg: Message, context: Context):
        torch.set_num_threads(1)  # as the Prefect flow: thread-independent float results
        cfg = config_from(context.run_config, config_path)
        pid = int(context.node_config["partition-id"])
        rnd = int(msg.content["config"]["server-round"])
        arrays: ArrayRecord = msg.content["arrays"]
        layout = ArrayLayout.of(arrays)
        return cfg, pid, rnd, layout, layout.to_vector(arrays)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        cfg, pid, rnd, layout, vector = _setup(msg, context)
        client = client_at(cfg, pid, rnd, load_detector_state(context))
        cohort = int(msg.content["config"].get("cohort-id", 0))
        fed = federation_at(cfg, rnd)
        res = train_clients([client], {pid: vector}, {pid: cohort}, fed.spec, cfg.training,
                            cfg.drift.gamma, cfg.seed, rnd)[0]
        save_detector_state(context, res.detector_state)
        content = train_reply_content(layout.to_record(res.update.params),
                                      res.update.n_samples, res.update.drift_flag)
        return Message(content=content, reply_to=msg)

    def local_metrics(msg: Message, context: Context):
        """Accuracy and mean cross-entropy (clipped to loss_max) on the local eval split."""
        cfg, pid, rnd, _, vector = _setup(msg, context)
        client = client_at(cfg, pid, rnd, None)
        fed = federation_at(cfg, rnd)
        return evaluate_clients([client], {pid: vector}, {pid: 0}, fed.spec,
                                cfg.evaluation.loss_max)[0]

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:  # plain (non-private) path
        ev = local_metrics(msg, context)
        metrics = MetricRecord({"num-examples": ev.n_eval, "accuracy": ev.accuracy,
                                "loss": ev.loss})
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

    def private_metrics(msg: Message, context: Context) -> dict[str, float]:
        ev = local_metrics(msg, context)
        return {"accuracy": ev.accuracy, "loss": ev.loss}

    register_private_evaluation(app, private_metrics)  # evaluate.private_* steps

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        info = ConfigRecord({"partition-id": int(context.node_config["partition-id"])})
        return Message(content=RecordDict({"info": info}), reply_to=msg)

    return app


app = make_client_app()
