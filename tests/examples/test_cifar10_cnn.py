"""examples/cifar10-cnn as a user meets it, on small files in CIFAR-10's python format
(``cifar.data.write_batches``: not CIFAR-10, the data set cannot be downloaded here): the
README's simulation command with the config's ``data_dir`` pointed at them (the only
change), and the clients' own data source (node config ``data-source =
cifar.data:site_images``, ``data-dir``) over the CLMA ClientApp on a loopback grid."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "cifar10-cnn"
CLMA = str(Path(sys.executable).with_name("clma"))


@pytest.fixture(scope="module")
def small_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cifar") / "cifar-10-batches-py"
    r = subprocess.run([sys.executable, "-m", "cifar.data", "small", str(folder)],
                       env=dict(os.environ, PYTHONPATH=str(EXAMPLE)), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return folder


def test_the_small_files_are_cifar10s_format(small_files):
    from clma.datasets import load_cifar10

    ds = load_cifar10(small_files)
    assert ds.images.shape == (1000, 3, 32, 32) and ds.images.dtype.name == "float32"
    assert ds.labels.shape == (1000,) and set(ds.labels.tolist()) == set(range(10))


def test_the_readme_simulation_command_runs_as_written(small_files, tmp_path):
    text = (EXAMPLE / "README.md").read_text("utf-8")
    (cmd,) = [ln for b in re.findall(r"```bash\n(.*?)```", text, re.S)
              for ln in b.strip().splitlines() if "clma run" in ln and "federation.toml" in ln]
    argv = shlex.split(cmd)
    assert argv[0] == "PYTHONPATH=examples/cifar10-cnn" and argv[1] == ".venv/bin/clma"
    argv = [CLMA, *argv[2:]]
    cfg = tmp_path / "federation.toml"
    shipped = (EXAMPLE / "federation.toml").read_text("utf-8")
    cfg.write_text(shipped.replace('data_dir = "examples/cifar10-cnn/data/cifar-10-batches-py"',
                                   f'data_dir = "{small_files}"'))
    assert cfg.read_text() != shipped
    argv[argv.index("--config") + 1] = str(cfg)
    argv[argv.index("--out") + 1] = str(tmp_path / "out")
    env = dict(os.environ, PYTHONPATH="examples/cifar10-cnn",
               PREFECT_HOME=str(tmp_path / "prefect"),
               MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")
    env.pop("PREFECT_API_URL", None)
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    truth = s["sim_truth"]
    # the README's seed-0 figures on the small files
    assert truth["ari_per_drift_event"] == {"4": 1.0}
    assert truth["stationary_final_accuracy"] == 1.0 and truth["drifted_final_accuracy"] == 1.0
    assert s["federation"]["dataset"] == "cifar10"
    assert len(s["final_cohorts"]) == 3


@pytest.fixture
def run_id():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 1, 1
    yield 7
    TaskIdentity._run_id = TaskIdentity._node_id = TaskIdentity._task_id = None


def test_the_clients_data_source_over_the_clientapp(run_id, small_files, tmp_path,
                                                    monkeypatch):
    import numpy as np
    import torch

    monkeypatch.syspath_prepend(str(EXAMPLE))
    from cifar.data import write_probe

    from clma.config import load_config, validate_config
    from clma.engine.assets import deployment_assets
    from clma.engine.clients import TrainRequest, TrainSettings
    from clma.flower.clientapp import make_client_app
    from clma.flower.transport import FlowerTransport
    from clma.models.checks import model_layout, spec_to_json
    from flows.flower_serverapp import device_config
    from tests.flower.conftest import LoopbackGrid

    torch.set_num_threads(1)
    write_probe(str(small_files), str(tmp_path / "probe.npz"))
    data = load_config(EXAMPLE / "federation-flower.toml").model_dump(mode="json")
    data["data"]["probe"] = str(tmp_path / "probe.npz")
    cfg = validate_config(data)
    assets = deployment_assets(cfg)
    assert assets.probe_x.shape == (64, 3, 32, 32)
    nodes = {3000 + i: {"partition-id": i, "data-source": "cifar.data:site_images",
                        "data-dir": str(small_files)} for i in range(cfg.clients)}
    grid = LoopbackGrid(make_client_app(), nodes, run_config={
        "config-json": json.dumps(device_config(cfg)),
        "model-spec": spec_to_json(assets.model_spec)})
    transport = FlowerTransport(grid, cfg, partition=assets.partition,
                                n_params=assets.n_params,
                                model_layout=model_layout(assets.model_spec.build()))
    assert transport.roster() and transport.roster_failures == {}
    t = cfg.training
    settings = TrainSettings(1, t.learning_rate, t.batch_size, cfg.drift.gamma)
    got = transport.train(TrainRequest(1, dict.fromkeys(range(cfg.clients), 0),
                                       {0: assets.initial_model}, settings))
    assert got.failed == {}
    # 1000 images in 10 IID shards of 100, a quarter kept for evaluation
    assert sorted(u.n_samples for u in got.ok.values()) == [75] * 10
    assert all(np.isfinite(u.params).all() for u in got.ok.values())
