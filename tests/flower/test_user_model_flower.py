"""The user's own model and data on Flower, over the CLMA ClientApp in this process (a
loopback grid, no SuperLink): the server's assets from ``[model] factory`` and the probe
file without the simulation; SuperNodes whose node config names a data source
(``siteuser.data:...``, a package outside the project) train the user's model class in
governed rounds -- drift flagged on the devices' own data, cohorts split; a data source
that does not import or breaks a rule is that node's failure while the others go on; a
node whose model differs from the server's is refused at the roster with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from clma.config import validate_config
from clma.engine import FederationEngine, open_budget
from clma.engine.assets import DEVICE_DATA_NAME, deployment_assets
from clma.engine.clients import TrainRequest, TrainSettings
from clma.flower import codec
from clma.flower.clientapp import make_client_app
from clma.flower.transport import FlowerTransport
from clma.models.checks import model_layout, spec_to_json
from flows.flower_serverapp import device_config

from .conftest import LoopbackGrid, tiny_config
from .user_site import on_path, write_package, write_probe

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    root = write_package(tmp_path_factory.mktemp("site"))
    on_path(root)
    probe = write_probe(root / "probe.npz")
    yield root, probe
    sys.path.remove(str(root))


def _config(probe: Path, rounds: int = 4, **extra):
    data = tiny_config().model_dump(mode="json")
    data.update(rounds=rounds, **extra)
    data["model"]["factory"] = "siteuser.model:site_mlp"
    data["data"]["probe"] = str(probe)
    data["drift"]["events"] = []  # the devices' own data drift (siteuser.data), not the config's
    data["federation"]["transport"] = "flower"
    data["evaluation"]["every"] = 2
    return validate_config(data)


def _run_config(cfg, assets) -> dict:
    return {"config-json": json.dumps(device_config(cfg)),
            "model-spec": spec_to_json(assets.model_spec)}


def _grid(cfg, assets, source="siteuser.data:local_arrays", **kw) -> LoopbackGrid:
    sources = source if isinstance(source, dict) else {i: source for i in range(cfg.clients)}
    nodes = {1000 + i: {"partition-id": i, "data-source": sources[i]}
             for i in range(cfg.clients)}
    return LoopbackGrid(make_client_app(), nodes, run_config=_run_config(cfg, assets), **kw)


def _transport(grid, cfg, assets) -> FlowerTransport:
    return FlowerTransport(grid, cfg, partition=assets.partition, n_params=assets.n_params,
                           model_layout=model_layout(assets.model_spec.build()))


def _held_out():
    from sklearn.datasets import load_digits

    d = load_digits()
    idx = np.random.default_rng(11).permutation(len(d.target))[1200:]  # no shard holds them
    return (d.images[idx] / 16.0).astype(np.float32).reshape(-1, 64), d.target[idx]


def _accuracy(spec, vector, x, y) -> float:
    import torch

    from clma.params import AllParams, vector_to_model

    model = vector_to_model(vector, spec.build(), AllParams())
    model.eval()
    with torch.no_grad():
        return float((model(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


def test_server_assets_come_from_the_factory_and_the_probe_file(site):
    root, probe = site
    cfg = _config(probe)
    a = deployment_assets(cfg)
    from clma.models import FactoryModelSpec
    from clma.params import AllParams, model_to_vector

    assert a.model_spec == FactoryModelSpec("siteuser.model:site_mlp")
    want = model_to_vector(FactoryModelSpec("siteuser.model:site_mlp").build(seed=cfg.seed),
                           AllParams())
    np.testing.assert_array_equal(a.initial_model, want)
    # 64 * 24 + 24 weights and biases, BatchNorm weight, bias, running mean and variance,
    # then 24 * 10 + 10
    assert a.n_params == 64 * 24 + 24 + 4 * 24 + 24 * 10 + 10
    with np.load(probe) as z:
        np.testing.assert_array_equal(a.probe_x, z["features"])
    assert a.dataset_name == DEVICE_DATA_NAME


def test_the_demo_assets_equal_the_simulations_without_building_it():
    from clma.config import load_config
    from clma.sim.federation import build_federation

    cfg = load_config(ROOT / "clma" / "configs" / "flower_local.toml")
    a, b = deployment_assets(cfg), build_federation(cfg).assets()
    np.testing.assert_array_equal(a.initial_model, b.initial_model)
    np.testing.assert_array_equal(a.probe_x, b.probe_x)
    assert (a.model_spec, a.partition, a.dataset_name) == (b.model_spec, b.partition,
                                                          b.dataset_name)


SERVER_SIDE = """
import json, sys
from clma.config import validate_config
import flows.flower_serverapp as app, flows.federation, flows.flower_launch, flows.cli, flows.serve
from clma.flower.transport import FlowerTransport
a = app.server_assets(validate_config(json.loads(sys.argv[1])))
print(json.dumps({"n_params": a.n_params,
                  "sim": sorted(m for m in sys.modules if m.startswith("clma.sim"))}))
"""


def test_the_serverapp_and_the_orchestrator_import_no_simulation(site):
    root, probe = site
    cfg = _config(probe)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(ROOT)]))
    r = subprocess.run([sys.executable, "-c", SERVER_SIDE, cfg.model_dump_json()], env=env,
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc == {"n_params": deployment_assets(cfg).n_params, "sim": []}


def test_the_config_refuses_what_a_deployment_cannot_do(site):
    root, probe = site
    data = _config(probe).model_dump(mode="json")
    no_probe = json.loads(json.dumps(data))
    no_probe["data"]["probe"] = None
    with pytest.raises(ValueError, match=r"data\.probe: a federation of real clients with "
                                         "model.factory needs a probe file"):
        validate_config(no_probe)
    source = json.loads(json.dumps(data))
    source["data"]["source"] = "siteuser.data:local_arrays"
    with pytest.raises(ValueError, match=r"data\.source: on the 'flower' transport each "
                                         "device's data come from its SuperNode's node config"):
        validate_config(source)


def test_governed_rounds_train_the_users_model_on_the_devices_own_data(run_id, site, tmp_path):
    root, probe = site
    cfg = _config(probe)
    cfg = cfg.model_copy(update={"budget": cfg.budget.model_copy(
        update={"state_dir": str(tmp_path)})})
    assets = deployment_assets(cfg)
    grid = _grid(cfg, assets)
    transport = _transport(grid, cfg, assets)
    eng = FederationEngine(cfg, assets, transport, budget=open_budget(cfg))
    x, y = _held_out()
    before = _accuracy(assets.model_spec, assets.initial_model, x, y)
    results = [eng.run_round(r) for r in (1, 2)]
    assert transport.roster_failures == {}
    assert sorted(transport.node_of) == list(range(cfg.clients))
    # rounds 1-2: one cohort learns the digits on the devices' shards
    assert sorted(eng.state.cohort_models) == [0]
    after = _accuracy(assets.model_spec, eng.state.cohort_models[0], x, y)
    assert before < 0.3 and after > 0.8, (before, after)
    results += [eng.run_round(r) for r in (3, 4)]
    # round 3: clients 0-3 rotate their own labels; the devices flag it and the cohorts split
    hist = eng.state.registry.history
    assert hist[3] != hist[2]
    cohort_of = {c: eng.state.registry.cohort_of(c) for c in range(cfg.clients)}
    assert cohort_of[4] == cohort_of[5]
    assert len({cohort_of[0], cohort_of[1], cohort_of[4]}) == 3, cohort_of
    assert cohort_of[0] == cohort_of[2] and cohort_of[1] == cohort_of[3]
    # BatchNorm's running statistics travel and are averaged like the weights
    spec_model = assets.model_spec.build()
    names = [n for n, _ in spec_model.state_dict().items()]
    assert "body.2.running_mean" in names
    stationary = eng.state.cohort_models[cohort_of[4]]
    assert _accuracy(assets.model_spec, stationary, x, y) > 0.8
    # private evaluation ran on the devices' own evaluation data (rounds 2 and 4)
    assert [r.regional is not None for r in results] == [False, True, False, True]


def test_data_loaders_are_a_data_source_too(run_id, site):
    root, probe = site
    cfg = _config(probe, rounds=2)
    assets = deployment_assets(cfg)
    transport = _transport(_grid(cfg, assets, "siteuser.data:local_loaders"), cfg, assets)
    t = cfg.training
    req = TrainRequest(1, dict.fromkeys(range(cfg.clients), 0), {0: assets.initial_model},
                       TrainSettings(t.local_epochs, t.learning_rate, t.batch_size,
                                     cfg.drift.gamma))
    got = transport.train(req)
    assert got.failed == {}
    assert [got.ok[c].n_samples for c in range(cfg.clients)] == [150] * cfg.clients
    assert all(not np.array_equal(got.ok[c].params, assets.initial_model) for c in got.ok)


def test_a_bad_data_source_is_that_nodes_failure_and_the_others_go_on(run_id, site):
    root, probe = site
    cfg = _config(probe, rounds=2)
    assets = deployment_assets(cfg)
    sources = {0: "siteuser.broken:local", 1: "siteuser.data:wrong_width",
               2: "siteuser.data:not_data", 3: "siteuser.data:float_labels",
               4: "siteuser.data:raises", 5: "siteuser.data:local_arrays"}
    transport = _transport(_grid(cfg, assets, sources), cfg, assets)
    t = cfg.training
    req = TrainRequest(1, dict.fromkeys(range(cfg.clients), 0), {0: assets.initial_model},
                       TrainSettings(t.local_epochs, t.learning_rate, t.batch_size,
                                     cfg.drift.gamma))
    got = transport.train(req)
    assert sorted(got.ok) == [5] and sorted(got.failed) == [0, 1, 2, 3, 4]
    field = "node config 'data-source'"
    for why in got.failed.values():
        assert why.startswith("error reply (code 4500): clma: train: device error: ") \
            and field in why, why
    assert "module 'siteuser.broken' does not import (ModuleNotFoundError" in got.failed[0]
    assert "the model rejects the features of shape (50,) per sample" in got.failed[1]
    assert "must return {'train': ..., 'eval': ...} or (train, eval)" in got.failed[2]
    assert "'train' labels must be integers (got float32)" in got.failed[3]
    assert "raised OSError: the site's disk is not mounted" in got.failed[4]
    # the same node answers the next request (the ClientApp keeps running)
    again = transport.train(TrainRequest(2, {5: 0}, {0: got.ok[5].params}, req.settings))
    assert sorted(again.ok) == [5]


def test_a_node_whose_model_differs_is_refused_at_the_roster(run_id, site):
    root, probe = site
    cfg = _config(probe, rounds=2)
    assets = deployment_assets(cfg)
    grid = _grid(cfg, assets)
    # node 1003 has another install of the user's package: its site_mlp is wider
    grid.contexts[1003].run_config["model-spec"] = spec_to_json(
        type(assets.model_spec)("siteuser.model:wider_mlp"))

    def tamper(kind, node, reply):
        if kind == "query.clma_roster" and node == 1004:
            reply.content["clma"]["model-layout"] = "0" * 64  # same count, other tensors
        if kind == "query.clma_roster" and node == 1005:
            del reply.content["clma"]["n-params"], reply.content["clma"]["model-layout"]
        return reply

    grid.tamper = tamper
    transport = _transport(grid, cfg, assets)
    roster = transport.roster()
    assert [c.client_id for c in roster.clients] == [0, 1, 2]
    n = assets.n_params
    wider = 64 * 32 + 32 + 4 * 32 + 32 * 10 + 10
    assert transport.roster_failures == {
        1003: f"model layout: the node's model has {wider:,} parameters, the server's {n:,} "
              "(install the same model.factory on both)",
        1004: f"model layout: the node's tensors differ from the server's in names, shapes "
              f"or dtypes ({n:,} parameters on both; install the same model.factory on both)",
        1005: "model layout: the node reports none (its clma is older than the server's, or "
              "its ClientApp is not CLMA's)",
    }
    assert transport.journal.lines[-1]["refused"] == {
        str(k): v for k, v in transport.roster_failures.items()}


def test_a_factory_the_device_cannot_import_is_refused_at_the_roster(run_id, site):
    root, probe = site
    cfg = _config(probe, rounds=2)
    assets = deployment_assets(cfg)
    grid = _grid(cfg, assets)
    grid.contexts[1002].run_config["model-spec"] = json.dumps(
        {"kind": "factory", "factory": "siteuser.broken:site_mlp"})
    transport = _transport(grid, cfg, assets)
    transport.roster()
    assert sorted(transport.roster_failures) == [1002]
    why = transport.roster_failures[1002]
    assert why.startswith("error reply (code 4500): clma: roster: device error: ValueError: "
                          "model.factory: module 'siteuser.broken' does not import"), why
    assert codec.MESSAGE_TYPES["roster"] == "query.clma_roster"


def test_a_supernode_with_a_users_data_source_imports_no_simulation(site):
    """The same check runs in the lean device install (tests/test_device_install.py)."""
    from .user_site import DEVICE_CHECK

    root, probe = site
    cfg = _config(probe)
    assets = deployment_assets(cfg)
    rc = _run_config(cfg, assets)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(ROOT)]))
    r = subprocess.run([sys.executable, "-c", DEVICE_CHECK, rc["config-json"],
                        rc["model-spec"], str(assets.n_params)], env=env, cwd=root,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {
        "n_params": assets.n_params, "n_samples": 150, "loaded": []}
