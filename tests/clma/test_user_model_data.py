"""The user's own model and data (`[model] factory`, `[data] source`): each config field,
each refusal (naming the field and the rule, before anything is written), and a simulated
federation built from a user's CNN and image source in a package outside the project."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from clma.config import ConfigError, validate_config
from clma.datasets import load_source
from clma.models import FactoryModelSpec, import_callable

CNN = '''
from torch import nn


def small_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 10))


def wide_cnn():
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 8 * 8, 7))


def functional_only():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 10)

        def forward(self, x):
            return nn.functional.relu(self.lin(x.flatten(1)))
    return M()


def tab_mlp():
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def not_a_module():
    return "a string"


def broken():
    raise RuntimeError("no weights here")


NOT_CALLABLE = 3
'''

DATA = '''
import numpy as np
from sklearn.datasets import load_digits


def images():
    d = load_digits()
    return (d.images / 16.0).astype(np.float32)[:, None, :, :], d.target.astype(np.int64)


def tabular():
    d = load_digits()
    return (d.data / 16.0).astype(np.float32), d.target


def float64():
    x, y = images()
    return x.astype(np.float64), y


def rank_one():
    x, y = images()
    return x[:, 0, 0, 0].copy(), y


def short_labels():
    x, y = images()
    return x, y[:-1]


def float_labels():
    x, y = images()
    return x, y.astype(np.float32)


def negative_label():
    x, y = images()
    y = y.copy()
    y[3] = -1
    return x, y


def one_class():
    x, y = images()
    return x, np.zeros_like(y)


def nan_feature():
    x, y = images()
    x = x.copy()
    x[0, 0, 0, 0] = np.nan
    return x, y


def not_a_pair():
    return images()[0]
'''


@pytest.fixture
def userpkg(tmp_path, monkeypatch):
    """A package `userfed` (model.py, data.py) outside the project, on sys.path."""
    pkg = tmp_path / "userfed"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(textwrap.dedent(CNN))
    (pkg / "data.py").write_text(textwrap.dedent(DATA))
    monkeypatch.syspath_prepend(str(tmp_path))
    import sys

    for name in [m for m in sys.modules if m == "userfed" or m.startswith("userfed.")]:
        monkeypatch.delitem(sys.modules, name)  # each test imports its own copy
    return tmp_path


@pytest.mark.parametrize(("path", "message"), [
    ("userfed.model", "must be 'package.module:function'"),
    ("userfed.model:a:b", "must be 'package.module:function'"),
    (":small_cnn", "must be 'package.module:function'"),
    ("userfed.nothere:f", "module 'userfed.nothere' does not import (ModuleNotFoundError"),
    ("userfed.model:missing", "'userfed.model' has no attribute 'missing'"),
    ("userfed.model:NOT_CALLABLE", "'userfed.model:NOT_CALLABLE' is not callable"),
])
def test_import_paths_are_refused_naming_the_field(userpkg, path, message):
    with pytest.raises(ValueError, match="^model.factory: ") as info:
        import_callable(path, "model.factory")
    assert message in str(info.value)


@pytest.mark.parametrize("field", ["model.factory", "data.source"])
def test_the_config_validates_the_import_paths(userpkg, field):
    section, key = field.split(".")
    with pytest.raises(ConfigError) as info:
        validate_config({section: {key: "userfed.model:missing"}})
    assert str(info.value) == ("invalid configuration: "
                               f"{field}: 'userfed.model' has no attribute 'missing'")
    cfg = validate_config({"model": {"factory": "userfed.model:small_cnn"},
                           "data": {"source": "userfed.data:images"}})
    assert (cfg.model.factory, cfg.data.source) == ("userfed.model:small_cnn",
                                                     "userfed.data:images")


def test_the_defaults_keep_the_fingerprint_of_earlier_versions():
    from clma.config import default_config
    from clma.state import resume_fingerprint

    cfg = default_config()
    assert cfg.model.factory is None and cfg.data.source is None
    same = validate_config({**cfg.model_dump(mode="json"),
                            "model": {"hidden": cfg.model.hidden}})
    assert resume_fingerprint(same) == resume_fingerprint(cfg)


@pytest.mark.parametrize(("name", "message"), [
    ("float64", "features must be a numpy float32 array (got float64)"),
    ("rank_one", "features must have shape (N, ...) with at least one feature axis"),
    ("short_labels", "labels must have shape (N,) with N = 1797 samples"),
    ("float_labels", "labels must be a numpy integer array (got float32)"),
    ("negative_label", "labels must be classes 0 .. K-1 (a label is negative)"),
    ("one_class", "labels must hold at least two classes"),
    ("nan_feature", "features must be finite (NaN or inf found)"),
    ("not_a_pair", "must return a (features, labels) pair"),
])
def test_bad_sources_are_refused_naming_the_rule(userpkg, name, message):
    with pytest.raises(ValueError, match="^data.source: ") as info:
        load_source(f"userfed.data:{name}")
    assert message in str(info.value)


def test_a_source_gives_the_dataset_as_returned(userpkg):
    from sklearn.datasets import load_digits

    ds = load_source("userfed.data:images")
    d = load_digits()
    assert ds.images.shape == (1797, 1, 8, 8) and ds.images.dtype == np.float32
    np.testing.assert_array_equal(ds.labels, d.target)
    assert ds.n_classes == 10 and ds.labels.dtype == np.int64
    tab = load_source("userfed.data:tabular")  # int32/int64 labels, (N, F) features
    assert tab.images.shape == (1797, 64) and tab.n_features == 64


def test_factory_spec_builds_reproducibly_and_refuses_what_is_not_a_module(userpkg):
    spec = FactoryModelSpec("userfed.model:small_cnn")
    state = torch.random.get_rng_state()
    a, b = spec.build(seed=3), spec.build(seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb)
    assert not torch.equal(a[0].weight, spec.build(seed=4)[0].weight)
    with pytest.raises(ValueError, match=r"^model.factory: 'userfed.model:not_a_module' "
                                         r"returned str, not a torch.nn.Module$"):
        FactoryModelSpec("userfed.model:not_a_module").build()
    with pytest.raises(ValueError, match=r"raised RuntimeError: no weights here$"):
        FactoryModelSpec("userfed.model:broken").build(seed=0)


def _cfg(**over):
    base = {"name": "user", "seed": 1, "rounds": 2, "clients": 6,
            "data": {"probe_size": 16, "source": "userfed.data:images"},
            "model": {"factory": "userfed.model:small_cnn"},
            "tracking": {"enabled": False}}
    for k, v in over.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) else v
    return validate_config(base)


@pytest.mark.parametrize(("over", "message"), [
    ({"model": {"factory": "userfed.model:wide_cnn"}},
     "model.factory: the model's output width 7 does not match the data's 10 classes"),
    ({"data": {"source": "userfed.data:tabular"}},
     "model.factory: the model rejects the features of shape (64,) per sample (RuntimeError"),
    ({"model": {"factory": "userfed.model:functional_only"}},
     "model.factory: divergence scoring reads nn.ReLU modules and the model's forward pass "
     "calls none"),
    ({"model": {"factory": "userfed.model:not_a_module"}},
     "model.factory: 'userfed.model:not_a_module' returned str, not a torch.nn.Module"),
    ({"data": {"source": "userfed.data:tabular"}, "model": {"factory": None},
      "drift": {"events": [{"round": 2, "kind": "blur", "family": "b", "clients": [0],
                                 "magnitude": 1.0}]}},
     "drift.events[0].kind: 'blur' drifts images; the features of data.source are not "
     "images (N, C, H, W)"),
])
def test_start_up_checks_refuse_before_round_one(userpkg, over, message):
    from clma.sim.federation import build_federation

    with pytest.raises(ValueError) as info:
        build_federation(_cfg(**over))
    assert message in str(info.value)


def test_clma_run_refuses_a_bad_model_and_writes_nothing(userpkg, tmp_path, capsys):
    from flows.cli import main

    cfg = tmp_path / "bad.toml"
    cfg.write_text('name = "bad"\nclients = 6\n[data]\nsource = "userfed.data:images"\n'
                   'probe_size = 16\n[model]\nfactory = "userfed.model:wide_cnn"\n')
    rc = main(["run", "--config", str(cfg), "--out", str(tmp_path / "out"), "--state-dir",
               str(tmp_path / "state"), "--quiet"])
    assert rc == 2
    assert "model.factory: the model's output width 7 does not match the data's 10 classes" \
        in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "state").exists()
    assert not list(tmp_path.glob("mlflow*")) and not (tmp_path / "mlruns").exists()


def test_a_simulated_federation_on_the_users_cnn_and_images(userpkg):
    """The assets come from the user's factory and source: the initial model is the
    factory's at the config's seed (BatchNorm running statistics included in the vector),
    and one engine round trains it, cohorts it and scores divergence."""
    from clma.engine import FederationEngine
    from clma.params import AllParams, model_to_vector
    from clma.sim.clients import SimulatedClients
    from clma.sim.federation import build_federation

    cfg = _cfg()
    sim = build_federation(cfg)
    expected = model_to_vector(FactoryModelSpec("userfed.model:small_cnn").build(seed=1),
                               AllParams())
    np.testing.assert_array_equal(sim.initial_model, expected)
    n_params = sum(p.numel() for p in sim.spec.build().parameters())
    assert expected.shape == (n_params + 2 * 8,)  # + BatchNorm running mean and variance
    assert sim.probe_x.shape == (16, 1, 8, 8)
    engine = FederationEngine(cfg, sim.assets(), SimulatedClients(sim))
    res = engine.run_round(1)
    assert res.participants and len(engine.state.cohort_models) == 1
    (model,) = engine.state.cohort_models.values()
    assert model.shape == expected.shape and not np.array_equal(model, expected)


def test_the_flower_transport_takes_a_user_model_with_a_probe_file_and_no_source(userpkg,
                                                                                 tmp_path):
    with pytest.raises(ConfigError, match="data.probe: a federation of real clients with "
                                          "model.factory needs a probe file"):
        validate_config({"model": {"factory": "userfed.model:small_cnn"},
                         "federation": {"transport": "flower"}})
    with pytest.raises(ConfigError, match="data.source: on the 'flower' transport each "
                                          "device's data come from its SuperNode's node config"):
        validate_config({"data": {"source": "userfed.data:images"},
                         "federation": {"transport": "flower"}})
    probe = tmp_path / "probe.npz"
    np.savez(probe, features=np.zeros((4, 1, 8, 8), np.float32))
    cfg = validate_config({"model": {"factory": "userfed.model:small_cnn"},
                           "data": {"probe": str(probe)}, "federation": {"transport": "flower"}})
    assert cfg.model.factory == "userfed.model:small_cnn"


def test_start_from_saved_weights(userpkg, tmp_path):
    from clma.params import AllParams, model_to_vector
    from clma.sim.federation import build_federation

    trained = FactoryModelSpec("userfed.model:small_cnn").build(seed=7)
    with torch.no_grad():
        trained[1].running_mean.fill_(0.25)  # a buffer travels with the weights too
    torch.save(trained.state_dict(), tmp_path / "w.pt")
    sim = build_federation(_cfg(model={"weights": str(tmp_path / "w.pt")}))
    np.testing.assert_array_equal(sim.initial_model, model_to_vector(trained, AllParams()))
    assert not np.array_equal(sim.initial_model, build_federation(_cfg()).initial_model)

    other = FactoryModelSpec("userfed.model:wide_cnn").build(seed=0)
    torch.save(other.state_dict(), tmp_path / "other.pt")
    torch.save({"not": "tensors"}, tmp_path / "junk.pt")
    for name, message in [
        ("missing.pt", "model.weights: '{}' does not exist"),
        ("other.pt", "model.weights: the keys do not fit the model (missing ['1.bias', "),
        ("junk.pt", "model.weights: '{}' must hold a state_dict (name -> tensor)"),
    ]:
        path = str(tmp_path / name)
        with pytest.raises(ValueError) as info:
            build_federation(_cfg(model={"weights": path}))
        assert message.format(path) in str(info.value)
    trained_wrong = FactoryModelSpec("userfed.model:small_cnn").build(seed=7).state_dict()
    trained_wrong["5.weight"] = torch.zeros(10, 3)
    torch.save(trained_wrong, tmp_path / "shape.pt")
    with pytest.raises(ValueError, match=r"model.weights: '5.weight' has shape \(10, 3\), "
                                         r"the model expects \(10, 128\)"):
        build_federation(_cfg(model={"weights": str(tmp_path / "shape.pt")}))


def _register(tmp_path, folder, name, alias):
    import mlflow

    client = mlflow.MlflowClient()
    exp = client.create_experiment(f"e-{name}", artifact_location=str(tmp_path / "art"))
    run = client.create_run(exp)
    client.log_artifacts(run.info.run_id, folder, "model")
    client.create_registered_model(name)
    mv = client.create_model_version(name, f"runs:/{run.info.run_id}/model",
                                     run_id=run.info.run_id)
    client.set_registered_model_alias(name, alias, mv.version)
    return run.info.run_id


def test_start_from_a_cohort_model_registered_in_mlflow(userpkg, tmp_path, monkeypatch):
    """`[model] weights = "models:/name@alias"`: the exact state dict CLMA stores beside a
    registered cohort model's exported graph (BatchNorm buffers included) starts the
    federation; a missing store, alias or state dict is refused naming the field."""
    from clma.models.factory import STATE_DICT_FILE, load_weights
    from clma.params import AllParams, model_to_vector
    from clma.sim.federation import build_federation
    from tasks.lineage import save_model_folder

    db = tmp_path / "store" / "mlflow.db"
    ref = "models:/fed-cohorts@cohort-2"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    with pytest.raises(ValueError, match=r"^model.weights: 'models:/fed-cohorts@cohort-2' "
                                         r"names an MLflow model, but there is no MLflow "
                                         r"store at sqlite:///"):
        build_federation(_cfg(model={"weights": ref}))
    assert not db.parent.exists()  # refused before anything was written

    spec = FactoryModelSpec("userfed.model:small_cnn")
    trained = spec.build(seed=7)
    with torch.no_grad():
        trained[1].running_var.fill_(2.5)
    vector = model_to_vector(trained, AllParams())
    (tmp_path / "export").mkdir()
    folder = save_model_folder(vector, spec, np.zeros((2, 1, 8, 8), np.float32),
                               str(tmp_path / "export"))
    assert (Path(folder) / STATE_DICT_FILE).is_file()
    db.parent.mkdir()
    run_id = _register(tmp_path, folder, "fed-cohorts", "cohort-2")

    sim = build_federation(_cfg(model={"weights": ref}))
    np.testing.assert_array_equal(sim.initial_model, vector)
    same = load_weights(spec.build(seed=0), f"runs:/{run_id}/model")  # the user's own class
    np.testing.assert_array_equal(model_to_vector(same, AllParams()), vector)

    with pytest.raises(ValueError, match=r"^model.weights: 'models:/fed-cohorts@cohort-9' "
                                         r"cannot be read from sqlite:///.* \(.*: no such "
                                         r"registered model, version, alias or run"):
        build_federation(_cfg(model={"weights": "models:/fed-cohorts@cohort-9"}))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "MLmodel").write_text("flavors: {}\n")
    _register(tmp_path, str(plain), "not-clma", "x")
    with pytest.raises(ValueError, match=r"^model.weights: 'models:/not-clma@x' has no "
                                         r"extra_files/state_dict.pt \(only cohort models "
                                         r"CLMA registered carry their state dict\)$"):
        build_federation(_cfg(model={"weights": "models:/not-clma@x"}))


def test_a_probe_set_from_a_file(userpkg, tmp_path):
    from clma.sim.federation import build_federation

    probe = np.random.default_rng(0).random((20, 1, 8, 8), dtype=np.float32)
    np.savez(tmp_path / "probe.npz", features=probe)
    sim = build_federation(_cfg(data={"probe": str(tmp_path / "probe.npz")}))
    np.testing.assert_array_equal(sim.probe_x, probe)
    assert sim.assets().probe_x.shape == (20, 1, 8, 8)
    np.savez(tmp_path / "flat.npz", features=probe.reshape(20, 64))
    np.savez(tmp_path / "named.npz", x=probe)
    for name, message in [
        ("flat.npz", "data.probe: 'features' must be float32 of shape (P, 1, 8, 8) with "
                     "P >= 2 (got float32 (20, 64))"),
        ("named.npz", "has no array 'features'"),
        ("absent.npz", "cannot be read as an .npz file (FileNotFoundError)"),
    ]:
        with pytest.raises(ValueError) as info:
            build_federation(_cfg(data={"probe": str(tmp_path / name)}))
        assert message in str(info.value)


def test_dp_fedavg_trains_the_users_cnn(userpkg):
    """DP-FedAvg on the user's model: clipped updates of the whole state vector (BatchNorm
    statistics included), noised once per cohort and charged to the training line."""
    from clma.engine import FederationEngine, open_budget
    from clma.sim.clients import SimulatedClients
    from clma.sim.federation import build_federation

    cfg = _cfg(training={"dp": {"enabled": True, "noise_multiplier": 1.0,
                                "noise_seeded": True}},
               testing={"allow_seeded_noise_not_private": True})
    sim = build_federation(cfg)
    budget = open_budget(cfg)
    try:
        engine = FederationEngine(cfg, sim.assets(), SimulatedClients(sim), budget=budget)
        engine.run_round(1)
        (model,) = engine.state.cohort_models.values()
        assert np.isfinite(model).all() and not np.array_equal(model, sim.initial_model)
        line = [e for e in budget.ledger.entries() if e["line"].startswith("training")]
        assert line, "the round charged the training line"
    finally:
        budget.close()


@pytest.mark.parametrize(("detector", "source", "factory"), [
    ("input_ks", "images", "small_cnn"),
    ("input_ks", "tabular", "tab_mlp"),
    ("page_hinkley", "tabular", "tab_mlp"),
])
def test_drift_detectors_flag_the_drifted_clients_on_the_users_inputs(userpkg, detector,
                                                                       source, factory):
    """The on-device drift flag on the user's model and features (images and tabular):
    the three clients whose labels rotate at round 3 are flagged at round 3, no one else."""
    if detector == "page_hinkley":
        pytest.importorskip("river")  # the [drift] extra (installed with '.[all]')
    from clma.engine import FederationEngine
    from clma.sim.clients import SimulatedClients
    from clma.sim.federation import build_federation

    cfg = _cfg(rounds=4, data={"source": f"userfed.data:{source}"},
               model={"factory": f"userfed.model:{factory}"},
               drift={"detector": detector, "events": [
                   {"round": 3, "kind": "label_rotation", "shift": 1, "family": "p",
                    "clients": [0, 1, 2]}]})
    sim = build_federation(cfg)
    engine = FederationEngine(cfg, sim.assets(), SimulatedClients(sim))
    flagged = [engine.run_round(r).flagged for r in range(1, 5)]
    assert flagged == [0, 0, 3, 0]
