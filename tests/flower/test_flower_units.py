"""clma.flower without a simulation: ArrayRecord layout, the client helpers (detector state
in context.state, the reply), and CLMA.aggregate_train against the clma.rounds steps."""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict

from clma.cohort import AutoKMeans, CLMACohorter, CohortRegistry
from clma.flower import CLMA, ArrayLayout, flag_drift, load_detector_state, train_reply_content
from clma.params import AllParams, LastLayers, ParameterAlignmentError, model_to_vector
from clma.rounds import ClientUpdate, aggregate_per_cohort, cohort_quarantined, quarantine
from clma.sim.models import MLPSpec


@pytest.fixture
def run_id():
    """Messages can only be built with a run id (a ServerApp sets it)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id = 7
    TaskIdentity.node_id = 1
    TaskIdentity.task_id = 1
    yield
    TaskIdentity._run_id = None
    TaskIdentity._node_id = None
    TaskIdentity._task_id = None


def _context() -> Context:
    return Context(run_id=1, node_id=3, node_config={}, state=RecordDict(), run_config={})


# ------------------------------------------------------------------ layout
def test_layout_vector_is_the_flows_model_vector_and_round_trips_exactly():
    model = MLPSpec(64, (8,), 10).build(seed=4)
    record = ArrayRecord(model.state_dict())
    layout = ArrayLayout.of(record)
    vec = layout.to_vector(record)
    np.testing.assert_array_equal(vec, model_to_vector(model, AllParams()))
    assert vec.dtype == np.float32 and layout.n_params == vec.shape[0] == 64 * 8 + 8 + 8 * 10 + 10
    back = layout.to_record(vec)
    assert list(back.keys()) == list(record.keys())
    for a, b in zip(back.to_numpy_ndarrays(), record.to_numpy_ndarrays(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_layout_integer_arrays_are_rounded_back_and_mismatches_are_refused():
    rec = ArrayRecord(OrderedDict([("w", Array(np.array([[1.5, -2.0]], np.float32))),
                                   ("count", Array(np.array([3], np.int64)))]))
    layout = ArrayLayout.of(rec)
    out = layout.to_record(np.array([1.5, -2.0, 3.6], np.float32)).to_numpy_ndarrays()
    assert out[1].dtype == np.int64 and out[1].tolist() == [4]
    other = ArrayRecord(OrderedDict([("v", Array(np.zeros((1, 2), np.float32))),
                                     ("count", Array(np.array([3], np.int64)))]))
    with pytest.raises(ParameterAlignmentError, match="keys differ"):
        layout.to_vector(other)
    with pytest.raises(ParameterAlignmentError, match="expected \\(3,\\)"):
        layout.to_record(np.zeros(4, np.float32))


def test_layout_selector_indices_pick_the_selected_arrays_entries():
    model = MLPSpec(6, (4,), 3).build(seed=0)
    layout = ArrayLayout.of(ArrayRecord(model.state_dict()))
    assert layout.selector_indices(None) is None  # DefaultSelector = every array here
    idx = layout.selector_indices(LastLayers(1))  # the last Linear: weight (3, 4) + bias (3)
    np.testing.assert_array_equal(idx, np.arange(6 * 4 + 4, 6 * 4 + 4 + 12 + 3))


# ------------------------------------------------------------------ client helpers
def test_flag_drift_keeps_state_in_context_and_uses_the_strict_gamma_rule():
    ctx = _context()
    assert load_detector_state(ctx) is None
    assert flag_drift(ctx, 1.0, 0.5) is False  # first observation never flags
    assert load_detector_state(ctx)["previous_loss"] == 1.0
    assert flag_drift(ctx, 1.5, 0.5) is False  # rise of exactly gamma: no flag
    assert flag_drift(ctx, 2.25, 0.5) is True  # rise 0.75 > 0.5
    state = load_detector_state(ctx)
    assert (state["n_updates"], state["n_flags"], state["previous_loss"]) == (3, 1, 2.25)
    with pytest.raises(ValueError, match="loss: must be finite"):
        flag_drift(ctx, float("nan"), 0.5)


def test_train_reply_holds_arrays_num_examples_and_integer_flag_only():
    arrays = ArrayRecord([np.zeros(3, np.float32)])
    content = train_reply_content(arrays, 12, True)
    metrics = content["metrics"]
    assert dict(metrics) == {"num-examples": 12, "drift-flag": 1}
    assert isinstance(metrics["drift-flag"], int) and not isinstance(metrics["drift-flag"], bool)
    assert content["arrays"] is arrays
    with pytest.raises(ValueError, match="num_examples"):
        train_reply_content(arrays, 0, False)


# ------------------------------------------------------------------ strategy
class _Grid:
    def __init__(self, nodes):
        self.nodes = list(nodes)

    def get_node_ids(self):
        return list(self.nodes)


def _reply(node: int, vector: np.ndarray, layout: ArrayLayout, n: int, flag: int):
    content = RecordDict({"arrays": layout.to_record(vector),
                          "metrics": MetricRecord({"num-examples": n, "drift-flag": flag})})
    return SimpleNamespace(content=content, has_error=lambda: False,
                           metadata=SimpleNamespace(src_node_id=node))


def _cohorter():
    return CLMACohorter(clusterer=AutoKMeans(random_state=0))


def test_clma_round_equals_the_clma_rounds_steps(run_id):
    rng = np.random.default_rng(0)
    d = 40
    init = rng.normal(0, 0.1, d).astype(np.float32)
    record = ArrayRecord(OrderedDict([("w", Array(init.copy()))]))
    layout = ArrayLayout.of(record)
    nodes = [101, 102, 103, 104, 105, 106]
    strategy = CLMA(cohorter=_cohorter(), min_available_nodes=6, min_train_nodes=6)
    msgs = list(strategy.configure_train(1, record, ConfigRecord(), _Grid(nodes)))
    assert sorted(m.metadata.dst_node_id for m in msgs) == nodes
    assert all(m.content["config"]["cohort-id"] == 0 for m in msgs)
    np.testing.assert_array_equal(layout.to_vector(msgs[0].content["arrays"]), init)
    # two opposite shifts among the flagged clients, stable clients near the model
    vec = {n: init + rng.normal(0, 0.01, d).astype(np.float32) for n in nodes}
    for n in (101, 102):
        vec[n] = vec[n] + 1.0
    for n in (103, 104):
        vec[n] = vec[n] - 1.0
    flags = {101: 1, 102: 1, 103: 1, 104: 1, 105: 0, 106: 0}
    sizes = {n: 10 + n % 7 for n in nodes}
    replies = [_reply(n, vec[n], layout, sizes[n], flags[n]) for n in reversed(nodes)]
    arrays, metrics = strategy.aggregate_train(1, replies)
    # the same steps by hand
    updates = [ClientUpdate(n, 0, vec[n], sizes[n], bool(flags[n])) for n in nodes]
    reg = CohortRegistry()
    reg.create_root(nodes, 0)
    q = quarantine(updates)
    models = aggregate_per_cohort(updates, q, {0: init})
    models, outcome = cohort_quarantined(updates, q, models, reg, _cohorter(), 1,
                                         start_models={0: init})
    reg.record_round(1)
    assert strategy.cohort_history == reg.history
    assert {tuple(m) for m in reg.history[1].values()} == {(101, 102), (103, 104), (105, 106)}
    for c in reg.active_cohorts():
        np.testing.assert_array_equal(strategy.cohort_models[c], models[c])
    assert metrics["n-cohorts"] == 3 and metrics["quarantined"] == 4
    # the returned arrays are the largest cohort's (all have 2 members: lowest id, 0)
    np.testing.assert_array_equal(layout.to_vector(arrays), models[0])
    # next round: each node is sent its own cohort's model
    nxt = list(strategy.configure_train(2, arrays, ConfigRecord(), _Grid(nodes)))
    for m in nxt:
        c = reg.cohort_of(m.metadata.dst_node_id)
        assert m.content["config"]["cohort-id"] == c
        np.testing.assert_array_equal(layout.to_vector(m.content["arrays"]), models[c])


def test_clma_refuses_a_reply_without_a_valid_drift_flag(run_id):
    record = ArrayRecord(OrderedDict([("w", Array(np.zeros(4, np.float32)))]))
    layout = ArrayLayout.of(record)
    strategy = CLMA(min_available_nodes=2, min_train_nodes=2)
    list(strategy.configure_train(1, record, ConfigRecord(), _Grid([1, 2])))
    bad = [_reply(n, np.zeros(4, np.float32), layout, 5, 2) for n in (1, 2)]
    with pytest.raises(ValueError, match="'drift-flag' must be 0 or 1"):
        strategy.aggregate_train(1, bad)
    with pytest.raises(ValueError, match="merge_cohorts_threshold"):
        CLMA(merge_cohorts_threshold=2.5)
