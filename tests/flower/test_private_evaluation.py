"""PrivateEvaluation's four secure-aggregation round-trips driven through a grid that
hands each Flower message to the ClientApp handlers of register_private_evaluation (no
Ray): exact secure sum with a dropout, noise once on the sum, envelopes, secrets kept on
the node and cleared."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from clma.flower.private import STEPS, PrivateEvaluation, register_private_evaluation
from clma.privacy.secagg import FixedPointQuantiser
from clma.release import FederatedMetricEnvelope, MetricSpec, aggregate_sum

NODES = [11, 22, 33, 44, 55, 66, 77]
VALUES = {n: {"accuracy": n / 100.0, "loss": n / 20.0} for n in NODES}  # loss 0.55..3.85
SPECS = [MetricSpec("accuracy", 0.0, 1.0), MetricSpec("loss", 0.0, 2.0)]


@pytest.fixture
def run_id():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 1, 1
    yield
    TaskIdentity._run_id = TaskIdentity._node_id = TaskIdentity._task_id = None


class LoopbackGrid:
    """Delivers each message to the node's ClientApp; ``drop`` = {step: nodes that go
    silent from that step on}."""

    def __init__(self, app: ClientApp, drop: dict[str, set[int]]):
        self.app, self.drop = app, drop
        self.contexts = {n: Context(run_id=7, node_id=n, node_config={}, state=RecordDict(),
                                    run_config={}) for n in NODES}
        self.seen: list[tuple[str, int, RecordDict]] = []
        self.gone: set[int] = set()

    def get_node_ids(self):
        return list(NODES)

    def send_and_receive(self, messages, timeout=None):
        out = []
        for m in messages:
            node, kind = m.metadata.dst_node_id, m.metadata.message_type
            self.gone |= self.drop.get(kind.split(".")[1], set())
            if node in self.gone:
                continue
            reply = self.app(m, self.contexts[node])
            self.seen.append((kind, node, reply.content))
            out.append(SimpleNamespace(content=reply.content, has_error=lambda: False,
                                       metadata=SimpleNamespace(src_node_id=node)))
        return out


def _run(drop):
    app = ClientApp()
    register_private_evaluation(app, lambda msg, ctx: VALUES[ctx.node_id])
    grid = LoopbackGrid(app, drop)
    strategy = PrivateEvaluation(
        FedAvg(min_available_nodes=7, min_evaluate_nodes=7), metrics=SPECS, epsilon=2.0,
        min_cohort=5, seed=123)
    arrays = ArrayRecord([np.zeros(2, np.float32)])
    first = grid.send_and_receive(strategy.configure_evaluate(1, arrays, ConfigRecord(), grid))
    published = strategy.aggregate_evaluate(1, first)
    return strategy, grid, published


def test_secure_sum_over_survivors_with_a_dropout_then_noise_once(run_id):
    strategy, grid, published = _run({STEPS[2]: {44}})  # 44 silent before masked input
    assert strategy.protocol[1] == {"advertised": 7, "survivors": 6, "dropped": 1,
                                    "aborted": None}
    quant = FixedPointQuantiser([0.0, 0.0], [1.0, 2.0])
    survivors = [n for n in NODES if n != 44]
    q = sum(quant.quantise([VALUES[n]["accuracy"], VALUES[n]["loss"]]) for n in survivors)
    sums = quant.dequantise_sum(q, 6)
    assert sums[1] <= 6 * 2.0  # losses were clipped on the device to [0, 2]
    for j, spec in enumerate(SPECS):
        expected = aggregate_sum(float(sums[j]), 6, spec, epsilon=2.0, min_cohort=5,
                                 seed=np.random.default_rng([123, 1, j]))
        got = strategy.releases[1][spec.name]
        assert got.value == expected.value
        assert got.contributors == 6 and got.noise_scale == spec.sensitivity / 2.0
        assert published[spec.name] == float(np.clip(expected.value, 0.0, spec.clip_high))
        assert published[f"{spec.name}.error-bar"] == got.published_error_bar
        env = FederatedMetricEnvelope.from_json(strategy.envelopes[1][spec.name])
        assert env.aggregate_value == pytest.approx(published[spec.name])
        assert env.participant_count_band.value != "suppressed"


def test_one_round_trip_per_step_and_no_plain_metric_or_secret_leaves_a_node(run_id):
    strategy, grid, _ = _run({})
    kinds = [k.split(".")[1] for k, _, _ in grid.seen]
    assert kinds == [STEPS[0]] * 7 + [STEPS[1]] * 7 + [STEPS[2]] * 7 + [STEPS[3]] * 7
    for kind, node, content in grid.seen:
        rec = content["clma-private"]
        if kind.endswith(STEPS[2]):  # masked vector: not the quantised input
            q = FixedPointQuantiser([0.0, 0.0], [1.0, 2.0]).quantise(
                [VALUES[node]["accuracy"], VALUES[node]["loss"]])
            assert list(rec["masked"]) != [int(x) for x in q]
        assert set(rec.keys()).isdisjoint({"q", "c-sk", "s-sk", "b", "accuracy", "loss"})
    for ctx in grid.contexts.values():  # secrets dropped after unmasking
        assert "clma-secagg-state" not in ctx.state.config_records


def test_too_few_survivors_aborts_and_releases_nothing(run_id):
    # threshold: strict majority of 7 holders = 5 (>= 0.6 * 7); 3 survivors abort
    strategy, _, published = _run({STEPS[2]: {11, 22, 33, 44}})
    assert published is None and 1 not in strategy.releases
    assert "threshold" in strategy.protocol[1]["aborted"]


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="metrics: at least one"):
        PrivateEvaluation(FedAvg(), metrics=[], epsilon=1.0)
    with pytest.raises(ValueError, match="min_cohort"):
        PrivateEvaluation(FedAvg(), metrics=SPECS, epsilon=1.0, min_cohort=1)
    with pytest.raises(ValueError, match="distinct"):
        PrivateEvaluation(FedAvg(), metrics=[SPECS[0], SPECS[0]], epsilon=1.0)
