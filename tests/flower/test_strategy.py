"""clma.flower.CLMA and PrivateEvaluation on the round engine, driven by Flower's own
Strategy.start over a loopback grid of CLMA ClientApps (no Ray): the same cohorts,
bit-identical models, the same published reports and ledger as the engine's bare loop on
the same config and seed (seeded noise); replies checked before any state changes; the
constructor's options kept working; and ArrayRecord <-> vector layouts."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord
from flwr.serverapp.strategy import FedAvg

from clma.engine import FederationEngine, make_cohorter, open_budget
from clma.flower import CLMA, ArrayLayout
from clma.flower.device_data import DEMO_SOURCE
from clma.flower.private import PrivateEvaluation
from clma.params import AllParams, LastLayers, ParameterAlignmentError, model_to_vector
from clma.sim.clients import SimulatedClients
from clma.sim.federation import build_federation
from clma.sim.models import MLPSpec

from .conftest import LoopbackGrid, tiny_config
from .test_flower_transport import _grid


@pytest.fixture(scope="module")
def world():
    import torch

    torch.set_num_threads(1)
    cfg = tiny_config()
    return cfg, build_federation(cfg)


def _ledgered(cfg, tmp):
    return cfg.model_copy(update={"budget": cfg.budget.model_copy(update={"state_dir": str(tmp)})})


def _strategy(cfg, fed, tmp, **kw):
    c = _ledgered(cfg, tmp)
    return PrivateEvaluation(CLMA(config=c, assets=fed.assets(), cohorter=make_cohorter(c),
                                  min_available_nodes=cfg.clients, **kw))


def _initial(cfg, fed):
    return ArrayRecord(fed.spec.build(seed=cfg.seed).state_dict())


@pytest.fixture(scope="module")
def reference(world, tmp_path_factory):
    cfg, fed = world
    c = _ledgered(cfg, tmp_path_factory.mktemp("ledger-ref"))
    eng = FederationEngine(c, fed.assets(), SimulatedClients(fed), budget=open_budget(c))
    return eng, [eng.run_round(r) for r in range(1, cfg.rounds + 1)]


@pytest.fixture(scope="module")
def flower_run(run_id_module, world, tmp_path_factory):
    cfg, fed = world
    strategy = _strategy(cfg, fed, tmp_path_factory.mktemp("ledger-flower"))
    grid = _grid(cfg)
    result = strategy.start(grid=grid, initial_arrays=_initial(cfg, fed), num_rounds=cfg.rounds)
    return strategy, result, grid


@pytest.fixture(scope="module")
def run_id_module():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 1, 1
    yield
    TaskIdentity._run_id = TaskIdentity._node_id = TaskIdentity._task_id = None


def test_flower_strategy_rounds_equal_the_engine_bit_for_bit(flower_run, reference):
    strategy, result, _ = flower_run
    ref_eng, ref = reference
    assert strategy.cohort_history == ref_eng.state.registry.history
    assert {tuple(m) for m in strategy.cohort_history[3].values()} == {(4, 5), (0, 2), (1, 3)}
    assert [e.model_dump() for e in strategy.registry.lineage] == [
        e.model_dump() for e in ref_eng.state.registry.lineage]
    for c, v in ref_eng.state.cohort_models.items():
        np.testing.assert_array_equal(strategy.cohort_models[c], v)
    for r in ref:
        assert strategy.results[r.round].regional == r.regional
        assert strategy.envelopes[r.round] == r.evaluation.envelopes
        pub = r.regional["metrics"]["accuracy"]["global"]
        got = result.evaluate_metrics_clientapp.get(r.round, {})
        if pub is not None:
            assert got["accuracy"] == pub["value"] and got["accuracy.error-bar"] == pub["error_bar"]
    largest = strategy.layout.to_vector(result.arrays)
    sizes = {c: len(strategy.registry.members(c)) for c in strategy.cohort_models}
    np.testing.assert_array_equal(largest, strategy.cohort_models[min(sizes, key=lambda c: (-sizes[c], c))])
    assert result.train_metrics_clientapp[3]["n-cohorts"] == 3


def test_the_flower_path_charges_each_release_once_and_refuses_an_overspend(flower_run, reference):
    strategy, _, _ = flower_run
    ref_eng, _ = reference
    entries = strategy.engine.budget.ledger.entries()
    keys = [(e["epoch"], e["round"], e["release"]) for e in entries]
    assert len(keys) == len(set(keys)) and keys  # each release charged once
    assert [(e["release"], e["status"]) for e in entries] == [
        (e["release"], e["status"]) for e in ref_eng.budget.ledger.entries()]
    refused = {(r, name): why for r, o in strategy.outcomes.items()
               for name, why in o.published["budget"]["refused"].items()}
    assert "exceeds_line_cap" in refused.values()  # the policy's cap is reached
    for (r, name), _ in refused.items():  # a refused charge drew no noise
        scope, metric = name.split(".", 1)
        if scope == "global" and metric in ("accuracy", "mean_loss"):
            assert strategy.outcomes[r].published["metrics"][metric]["global"] is None


def test_replies_are_checked_before_the_round_changes_anything(run_id, world, tmp_path):
    cfg, fed = world

    def zero(kind, node, reply):
        if kind == "train":
            reply.content["metrics"]["num-examples"] = 0 if node % 2 else -4
        return reply

    strategy = _strategy(cfg, fed, tmp_path)
    grid = _grid(cfg, tamper=zero)
    result = strategy.start(grid=grid, initial_arrays=_initial(cfg, fed), num_rounds=1)
    res = strategy.results[1]
    assert res.participants == 0 and res.dropouts == cfg.clients  # every reply a dropout
    assert strategy.cohort_history[1] == {0: list(range(cfg.clients))}
    np.testing.assert_array_equal(strategy.cohort_models[0], fed.initial_model)  # unchanged
    assert 1 not in result.evaluate_metrics_clientapp  # nobody to evaluate


def test_constructor_options_keep_working(run_id, world, tmp_path):
    cfg, fed = world
    with pytest.raises(ValueError, match="merge_cohorts_threshold"):
        CLMA(merge_cohorts_threshold=2.5)
    with pytest.raises(ValueError, match="fraction_train: differs"):
        CLMA(config=cfg, fraction_train=0.5)
    with pytest.raises(ValueError, match="weighted_by_key"):
        CLMA(weighted_by_key="n")
    with pytest.raises(TypeError, match="wraps clma.flower.CLMA"):
        PrivateEvaluation(FedAvg())
    with pytest.raises(ValueError, match="metrics: must be"):
        PrivateEvaluation(CLMA(config=cfg), metrics=["f1"])
    s = CLMA(config=cfg, fraction_train=1.0, merge_cohorts_threshold=0.3)
    assert s.config.cohort.merge_cohorts_threshold == 0.3
    pe = PrivateEvaluation(CLMA(config=cfg), epsilon=2.0, min_cohort=6)
    assert pe.strategy.config.evaluation.epsilon == 2.0 and pe.config.evaluation.min_cohort == 6
    pe = PrivateEvaluation(CLMA(config=cfg), secagg_dropout_fraction=0.2)
    assert pe.config.evaluation.secagg_dropout_fraction == 0.2
    with pytest.raises(ValueError, match="secagg_corrupted_fraction"):
        PrivateEvaluation(CLMA(config=cfg), secagg_corrupted_fraction=0.6)
    # client_id_of: no roster query; param_selector reaches the engine's cohorting vector
    nodes = {1000 + i: {"partition-id": i, "data-source": DEMO_SOURCE}
             for i in range(cfg.clients)}
    grid = LoopbackGrid(__import__("clma.flower.clientapp", fromlist=["x"]).make_client_app(), nodes,
                        run_config={"config-json": cfg.model_dump_json()})
    strat = CLMA(config=_ledgered(cfg, tmp_path), assets=fed.assets(), min_available_nodes=6,
                 client_id_of=lambda n: n - 1000, param_selector=LastLayers(1))
    strat.start(grid=grid, initial_arrays=_initial(cfg, fed), num_rounds=1)
    assert all(k != "query.clma_roster" for k, _ in grid.sent)
    last = fed.spec.build(seed=0)
    n_last = sum(p.numel() for p in list(last.modules())[-1].parameters())
    assert strat.engine._selector(fed.initial_model).shape == (n_last,)


def test_a_min_cohort_below_the_policy_floor_is_refused_at_construction(world):
    cfg, _ = world
    from clma.engine.budget import policy_of

    floor = policy_of(cfg).evaluation.minimum_group_size
    assert floor == 5  # the shipped policy's cohort floor
    inner = CLMA(config=cfg)
    before = inner.config
    with pytest.raises(ValueError, match=r"^min_cohort: must be >= the privacy policy's cohort "
                       r"floor \(evaluation\.minimum_group_size = 5 .*got 3\."):
        PrivateEvaluation(inner, min_cohort=3)
    assert inner.config is before and inner.engine is None  # nothing changed, no round ran
    with pytest.raises(ValueError, match="min_cohort: must be >= .* got 4"):
        PrivateEvaluation(CLMA(config=cfg), min_cohort=floor - 1)
    assert PrivateEvaluation(CLMA(config=cfg), min_cohort=floor).config.evaluation.min_cohort == 5


def test_a_user_model_without_assets_runs_with_divergence_off(run_id, world, tmp_path):
    cfg, fed = world
    strat = CLMA(config=_ledgered(cfg, tmp_path), model_fn=fed.spec.build, min_available_nodes=6)
    strat.start(grid=_grid(cfg), initial_arrays=_initial(cfg, fed), num_rounds=1)
    assert strat.config.divergence.enabled is False and strat.results[1].participants == 6
    with pytest.raises(ValueError, match="model_fn: its state_dict keys differ"):
        CLMA(config=cfg, model_fn=lambda: torch.nn.Linear(2, 2)).start(
            grid=_grid(cfg), initial_arrays=_initial(cfg, fed), num_rounds=1)
    # without model_fn (fed-clma's CLMA()): the same round, selectors mapped onto the record
    plain = CLMA(config=_ledgered(cfg, tmp_path / "plain"), min_available_nodes=6)
    plain.start(grid=_grid(cfg), initial_arrays=_initial(cfg, fed), num_rounds=1)
    assert plain.cohort_history == strat.cohort_history
    np.testing.assert_array_equal(plain.cohort_models[0], strat.cohort_models[0])


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




def test_dp_fedavg_on_flower_charges_the_training_line_each_round(run_id, world, tmp_path):
    cfg, fed = world
    data = cfg.model_dump()
    # z = 4: both rounds fit the training line's cap (at z = 1 the engine backs off round 2)
    data["training"]["dp"] = {"enabled": True, "clipping_bound": 1.0, "noise_multiplier": 4.0,
                              "noise_seeded": True}  # bitwise comparison below
    from clma.config import validate_config

    dp = _ledgered(validate_config(data), tmp_path / "flower")
    strat = CLMA(config=dp, assets=fed.assets(), cohorter=make_cohorter(dp),
                 min_available_nodes=6)
    strat.start(grid=_grid(cfg), initial_arrays=_initial(cfg, fed), num_rounds=2)
    ref_cfg = _ledgered(validate_config(data), tmp_path / "engine")
    eng = FederationEngine(ref_cfg, fed.assets(), SimulatedClients(fed), budget=open_budget(ref_cfg))
    for r in (1, 2):
        eng.run_round(r)
    training = [e for e in strat.engine.budget.ledger.entries() if e["line"] == "training"]
    assert [(e["round"], e["release"], e["status"]) for e in training] == [
        (0, "training.dp-fedavg", "committed"), (1, "training.dp-fedavg", "committed")]
    assert training == [e for e in eng.budget.ledger.entries()  # the engine's charges
                        if e["line"] == "training"]
    for c, v in eng.state.cohort_models.items():  # the same DP-FedAvg release, bitwise
        np.testing.assert_array_equal(strat.cohort_models[c], v)
    assert sorted(strat.cohort_models) == sorted(eng.state.cohort_models)
    assert all(not np.array_equal(v, fed.initial_model) for v in strat.cohort_models.values())


def test_distributed_dp_on_flower_is_charged_before_the_secure_sums(run_id, world, tmp_path):
    """Distributed DP with the ledger through the Flower strategy: the strategy charges the
    noised entries before secure aggregation (it would raise otherwise), its ledger holds
    the engine's charges, and a refused noised entry publishes no regional value."""
    cfg, fed = world
    data = cfg.model_dump(mode="json")
    data["evaluation"].update(noise="distributed", noise_seeded=False)
    from clma.config import validate_config

    dcfg = validate_config(data)
    strat = _strategy(dcfg, fed, tmp_path / "flower")
    strat.start(grid=_grid(dcfg), initial_arrays=_initial(dcfg, fed), num_rounds=dcfg.rounds)
    ref_cfg = _ledgered(dcfg, tmp_path / "ref")
    eng = FederationEngine(ref_cfg, fed.assets(), SimulatedClients(fed),
                           budget=open_budget(ref_cfg))
    for r in range(1, dcfg.rounds + 1):
        eng.run_round(r)
    entries = [(e["round"], e["release"], e["status"])
               for e in strat.engine.budget.ledger.entries()]
    assert entries == [(e["round"], e["release"], e["status"])
                       for e in eng.budget.ledger.entries()]
    assert any(rel == "regional.accuracy" and st == "committed" for _, rel, st in entries)
    for o in strat.outcomes.values():
        for name in o.published["budget"]["refused"]:
            scope, metric = name.split(".", 1)
            if scope == "regional" and metric in ("accuracy", "mean_loss"):
                assert o.published["metrics"][metric]["regions"] == {}
