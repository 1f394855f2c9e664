"""The example Flower app (examples/flower_digits) in Flower's simulation engine (Ray)
against the round engine's bare loop (FederationEngine.run_round, the Prefect flow's steps)
on the same config and seed with seeded noise: same cohorts and lineage, bit-identical
cohort models, the same published reports; the ledger charges each release once over the
rounds and refuses an overspend."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from clma.config import load_config

from .conftest import TINY, tiny_toml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "flower_digits"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def example_modules():
    sys.path.insert(0, str(EXAMPLE))
    old = os.environ.get("PYTHONPATH")
    # Ray's worker processes import client_app/server_app from here
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLE), old) if p)
    import client_app
    import server_app

    yield server_app, client_app
    sys.path.remove(str(EXAMPLE))
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module")
def flower_run(example_modules, tmp_path_factory):
    import ray
    from flwr.simulation import run_simulation

    server_app, client_app = example_modules
    # the Flower path refuses seeded noise unless a test allows it (it compares values)
    tiny = tiny_toml(tmp_path_factory.mktemp("flower-config"))
    cfg = load_config(tiny)
    ledger = tmp_path_factory.mktemp("flower-ledger")
    try:
        run_simulation(
            server_app=server_app.make_server_app(str(tiny), str(ledger)),
            client_app=client_app.make_client_app(str(tiny)),
            num_supernodes=cfg.clients,
            backend_config={"client_resources": {"num_cpus": 1},
                            "init_args": {"num_cpus": 2, "include_dashboard": False}},
        )
    finally:
        if ray.is_initialized():
            ray.shutdown()
    return dict(server_app.LAST_RUN)


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    import torch

    from clma.engine import FederationEngine, open_budget
    from clma.sim.clients import SimulatedClients
    from clma.sim.federation import build_federation

    torch.set_num_threads(1)  # as federation_flow does
    cfg = load_config(TINY)
    cfg = cfg.model_copy(update={"budget": cfg.budget.model_copy(
        update={"state_dir": str(tmp_path_factory.mktemp("engine-ledger"))})})
    assert cfg.evaluation.noise_seeded  # seeded noise: both paths draw the same numbers
    fed = build_federation(cfg)
    eng = FederationEngine(cfg, fed.assets(), SimulatedClients(fed), budget=open_budget(cfg))
    return eng, [eng.run_round(r) for r in range(1, cfg.rounds + 1)]


def test_flower_cohorts_and_models_match_the_engine_exactly(flower_run, engine_run):
    import ray

    assert not ray.is_initialized()  # the simulation's Ray was shut down
    eng, results = engine_run
    strategy = flower_run["strategy"]
    history = flower_run["cohort_history"]
    assert history == eng.state.registry.history
    # the drift at round 3 split the two label-rotation families from the stationary pair
    assert history[2] == {0: [0, 1, 2, 3, 4, 5]}
    assert {tuple(m) for m in history[3].values()} == {(4, 5), (0, 2), (1, 3)}
    assert [e.model_dump() for e in strategy.registry.lineage] == [
        e.model_dump() for e in eng.state.registry.lineage]
    assert sorted(strategy.cohort_models) == sorted(eng.state.cohort_models)
    for c, v in eng.state.cohort_models.items():
        np.testing.assert_array_equal(strategy.cohort_models[c], v)
    for r in results:
        assert strategy.results[r.round].regional == r.regional
        assert strategy.envelopes.get(r.round, {}) == r.evaluation.envelopes


def test_flower_ledger_charges_each_release_once_and_refuses_an_overspend(flower_run, engine_run):
    eng, _ = engine_run
    strategy = flower_run["strategy"]
    entries = strategy.engine.budget.ledger.entries()
    keys = [(e["epoch"], e["round"], e["release"]) for e in entries]
    assert len(keys) == len(set(keys)) >= 3  # several rounds, each release once
    assert len({e["round"] for e in entries}) >= 2  # charges over several rounds
    assert [(e["release"], e["status"]) for e in entries] == [
        (e["release"], e["status"]) for e in eng.budget.ledger.entries()]
    refused = [why for o in strategy.outcomes.values()
               for why in o.published["budget"]["refused"].values()]
    assert "exceeds_line_cap" in refused
    result = flower_run["result"]
    for r, o in strategy.outcomes.items():
        pub = o.published["metrics"]["accuracy"]["global"]
        got = result.evaluate_metrics_clientapp.get(r)
        if pub is None:
            assert got is None or "accuracy" not in got
        else:
            assert got["accuracy"] == pub["value"]
