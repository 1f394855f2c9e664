"""A user's own model and data through the whole governed simulation, as the user runs it:
`clma run` with `[model] factory` and `[data] source` naming a package outside the project
(on PYTHONPATH), a drift event at round 3, Prefect's embedded API and an MLflow store.

- a CNN with BatchNorm on 8x8 digit images: the run completes, the drift is flagged and
  the drifted clients leave the first cohort; the registered cohort model loads back with
  `mlflow.pytorch` and gives logits for the user's images;
- a user-defined MLP: CLMA's cohorts separate the two drift families exactly (ARI 1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CLMA = str(Path(sys.executable).with_name("clma"))

MODEL = '''
from torch import nn


def small_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 2 * 2, 32), nn.ReLU(), nn.Linear(32, 10))


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32),
                         nn.ReLU(), nn.Linear(32, 10))
'''

DATA = '''
import numpy as np
from sklearn.datasets import load_digits


def digit_images():
    d = load_digits()
    return (d.images / 16.0).astype(np.float32)[:, None, :, :], d.target.astype(np.int64)
'''

CONFIG = '''
name = "{name}"
seed = 5
rounds = 5
clients = 8

[model]
factory = "myfed.model:{factory}"

[data]
source = "myfed.data:digit_images"
probe_size = 32

[[drift.events]]
round = 3
kind = "label_rotation"
shift = 1
family = "plus"
clients = [0, 2, 4]

[[drift.events]]
round = 3
kind = "label_rotation"
shift = -1
family = "minus"
clients = [1, 3, 5]

[evaluation]
# seeded noise: a test federation (reproducible, NOT private)
noise_seeded = true
min_cohort = 2
epsilon = 0.1
health_epsilon = 0.05
merge_after = 50

[testing]
allow_seeded_noise_not_private = true
'''


def _run(tmp: Path, name: str, factory: str) -> dict:
    (tmp / f"{name}.toml").write_text(CONFIG.format(name=name, factory=factory))
    env = dict(os.environ, PYTHONPATH=str(tmp / "user"), PREFECT_HOME=str(tmp / "ph"),
               MLFLOW_TRACKING_URI=f"sqlite:///{tmp / 'mlflow.db'}")
    env.pop("PREFECT_API_URL", None)
    r = subprocess.run([CLMA, "run", "--config", str(tmp / f"{name}.toml"), "--out",
                        str(tmp / name), "--quiet"], cwd=tmp, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((tmp / name / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("user-model")
    pkg = tmp / "user" / "myfed"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(textwrap.dedent(MODEL))
    (pkg / "data.py").write_text(textwrap.dedent(DATA))
    return tmp, _run(tmp, "user-cnn", "small_cnn"), _run(tmp, "user-mlp", "mlp")


def test_the_users_cnn_runs_the_governed_federation(runs, monkeypatch):
    tmp, cnn, _ = runs
    assert [r["round"] for r in cnn["rounds"]] == [1, 2, 3, 4, 5]
    r3 = cnn["rounds"][2]
    assert r3["flagged_clients"] != "none"  # the drift flag on the user's model
    assert len(r3["cohorts"]) >= 2  # the flagged clients left the first cohort
    assert cnn["rounds"][1]["regional"]  # private evaluation released at round 2
    import mlflow.pytorch  # binds mlflow too
    import torch

    monkeypatch.syspath_prepend(str(tmp / "user"))
    from myfed.data import digit_images

    mlflow.set_tracking_uri(f"sqlite:///{tmp / 'mlflow.db'}")
    name = "user-cnn-seed5-cohorts"
    cohort = sorted(cnn["rounds"][-1]["cohorts"])[-1]
    model = mlflow.pytorch.load_model(f"models:/{name}@cohort-{cohort}")
    x, y = digit_images()
    with torch.no_grad():
        out = model(torch.from_numpy(x[:16]))
    assert tuple(out.shape) == (16, 10) and torch.isfinite(out).all()


def test_the_users_mlp_separates_the_drift_families(runs):
    _, _, mlp = runs
    assert mlp["sim_truth"]["ari_per_drift_event"] == {"3": 1.0}
    assert mlp["sim_truth"]["stationary_final_accuracy"] > 0.7
