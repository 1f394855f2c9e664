"""examples/hospitals-tabular as a user meets it: the README's simulation command run as
written (temporary Prefect home and MLflow store), and the hospitals' own data source
(node config ``data-source = hospitals.data:hospital_data``) trained over the CLMA
ClientApp on a loopback grid of ten SuperNodes with the deployment config."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hospitals-tabular"
CLMA = str(Path(sys.executable).with_name("clma"))


def _readme_commands() -> list[str]:
    text = (EXAMPLE / "README.md").read_text("utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line for b in blocks for line in b.strip().splitlines()]


def test_the_readme_simulation_command_runs_as_written(tmp_path):
    (cmd,) = [c for c in _readme_commands() if "federation.toml" in c]
    argv = shlex.split(cmd)
    env_pairs = [a for a in argv if "=" in a and not a.startswith("-")][:1]
    assert env_pairs == ["PYTHONPATH=examples/hospitals-tabular"]
    argv = argv[1:]
    assert argv[0] == ".venv/bin/clma"
    argv[0] = CLMA  # the suite's venv (a clean clone's .venv on CI)
    argv[argv.index("--out") + 1] = str(tmp_path / "out")
    env = dict(os.environ, PYTHONPATH="examples/hospitals-tabular",
               PREFECT_HOME=str(tmp_path / "prefect"),
               MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")
    env.pop("PREFECT_API_URL", None)
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    truth = s["sim_truth"]
    # the README's seed-0 row
    assert truth["ari_per_drift_event"] == {"5": 1.0}
    assert round(truth["stationary_final_accuracy"], 3) == 0.951
    assert round(truth["drifted_final_accuracy"], 3) == 0.967
    assert s["federation"]["dataset"] == "source:hospitals.data:breast_cancer"
    assert [x["round"] for x in s["rounds"]] == list(range(1, 9))
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    assert client.get_run(s["mlflow"]["run_id"]).data.tags["clma.transport"] == "simulation"


@pytest.fixture
def run_id():
    """Messages can only be built with a run id (a ServerApp sets it)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 1, 1
    yield 7
    TaskIdentity._run_id = TaskIdentity._node_id = TaskIdentity._task_id = None


@pytest.fixture
def hospitals_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    for m in [m for m in sys.modules if m == "hospitals" or m.startswith("hospitals.")]:
        monkeypatch.delitem(sys.modules, m)


def test_the_hospitals_data_source_over_the_clientapp(run_id, hospitals_on_path, tmp_path):
    import torch
    from hospitals.data import write_probe

    from clma.config import load_config
    from clma.engine import FederationEngine, open_budget
    from clma.engine.assets import deployment_assets
    from clma.flower.clientapp import make_client_app
    from clma.flower.transport import FlowerTransport
    from clma.models.checks import model_layout, spec_to_json
    from flows.flower_serverapp import device_config
    from tests.flower.conftest import LoopbackGrid

    torch.set_num_threads(1)
    write_probe(str(tmp_path / "probe.npz"))
    data = load_config(EXAMPLE / "federation-flower.toml").model_dump(mode="json")
    data["data"]["probe"] = str(tmp_path / "probe.npz")
    data["data"]["region_partition"] = str(EXAMPLE / "regions.toml")
    data["budget"]["state_dir"] = str(tmp_path / "ledger")
    data["rounds"] = 6
    from clma.config import validate_config

    cfg = validate_config(data)
    assets = deployment_assets(cfg)
    nodes = {2000 + i: {"partition-id": i, "data-source": "hospitals.data:hospital_data"}
             for i in range(cfg.clients)}
    grid = LoopbackGrid(make_client_app(), nodes, run_config={
        "config-json": json.dumps(device_config(cfg)),
        "model-spec": spec_to_json(assets.model_spec)})
    transport = FlowerTransport(grid, cfg, partition=assets.partition,
                                n_params=assets.n_params,
                                model_layout=model_layout(assets.model_spec.build()))
    eng = FederationEngine(cfg, assets, transport, budget=open_budget(cfg))
    results = [eng.run_round(r) for r in range(1, cfg.rounds + 1)]
    assert transport.roster_failures == {}
    assert [r.round for r in results] == list(range(1, 7))
    reg = eng.state.registry
    assert len(reg.history[4]) == 1  # one cohort before the recalibration
    cohort = {c: reg.cohort_of(c) for c in range(cfg.clients)}
    # the recalibrated hospitals (0, 3, 6) share a cohort no other hospital is in
    drifted = {cohort[c] for c in (0, 3, 6)}
    assert len(drifted) == 1, cohort
    assert not drifted & {cohort[c] for c in range(cfg.clients) if c not in (0, 3, 6)}
    assert np.isfinite(eng.state.cohort_models[next(iter(drifted))]).all()
