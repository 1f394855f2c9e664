"""The device install (a Flower SuperNode: ``pip install -e '.[device]'``) in a fresh venv.

Plain pip (no ``--no-deps``, no requirements file) must resolve it; it must bring flwr,
torch and the client side of the library but neither Prefect nor MLflow; the client
modules import without them; and the ``clma`` console script, which the install also
brings, names the ``server`` extra instead of failing with a traceback.

Slow (~1 min on 2 cores: most of it is unpacking the CPU torch wheel; pip's cache serves
the rest), so the quick subset (``-m "not slow ..."``) skips it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clma.config import validate_config
from flows.flower_serverapp import device_config
from tests.flower.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[1]

# What a ClientApp imports: the client side of the Clients seam (clma.device: training,
# the on-device drift detector, the on-device metric report and clipping, the
# secure-aggregation client), the simulated clients, Flower's client helpers.
DEVICE_MODULES = [
    "clma.device", "clma.drift", "clma.params", "clma.metrics", "clma.release",
    "clma.privacy.secagg", "clma.sim.models", "clma.sim.training", "clma.sim.federation",
    "clma.sim.clients", "clma.config", "clma.flower.clientapp", "clma.flower.codec",
    "clma.flower.learner", "clma.flower.device_data", "clma.sim.demo", "clma.models.checks",
    "flwr.clientapp", "torch",
]

CHECK = """
import importlib, importlib.util, json, sys
absent = {m: importlib.util.find_spec(m) is None for m in ("prefect", "mlflow")}
for m in sys.argv[1:]:
    importlib.import_module(m)
loaded = sorted(m for m in ("prefect", "mlflow") if m in sys.modules)
print(json.dumps({"absent": absent, "loaded": loaded}))
"""


@pytest.mark.slow
def test_device_install_has_no_prefect_and_no_mlflow(tmp_path):
    venv = tmp_path / "venv-device"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"

    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "-e", f"{ROOT}[device]"],
                       env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    r = subprocess.run([str(py), "-m", "pip", "check"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr

    # Outside the checkout: its mlflow/ folder (no __init__.py) would be found as a
    # namespace package from the current directory.
    r = subprocess.run([str(py), "-c", CHECK, *DEVICE_MODULES], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.strip().splitlines()[-1] == (
        '{"absent": {"prefect": true, "mlflow": true}, "loaded": []}')

    # a SuperNode with a user's data source (a package outside the project): roster and one
    # training step through the ClientApp load neither the simulation nor Prefect nor MLflow
    from tests.flower.user_site import DEVICE_CHECK, on_path, write_package, write_probe

    site = write_package(tmp_path / "site")
    on_path(site)  # the config names the factory: validating it imports the module
    try:
        cfg = validate_config({**tiny_config().model_dump(mode="json"), "rounds": 2,
                               "model": {"factory": "siteuser.model:site_mlp"},
                               "data": {"probe": str(write_probe(site / "probe.npz"))},
                               "drift": {"events": []}, "federation": {"transport": "flower"}})
    finally:
        sys.path.remove(str(site))
    spec = '{"kind": "factory", "factory": "siteuser.model:site_mlp"}'
    n_params = 64 * 24 + 24 + 4 * 24 + 24 * 10 + 10
    r = subprocess.run([str(py), "-c", DEVICE_CHECK, json.dumps(device_config(cfg)), spec,
                        str(n_params)], cwd=site, env=dict(env, PYTHONPATH=str(site)),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {
        "n_params": n_params, "n_samples": 150, "loaded": []}

    r = subprocess.run([str(venv / "bin" / "clma"), "run", "--quiet"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "clma run: needs the server side (Prefect, MLflow), not installed here: "
        "pip install 'clma[server]'"]
