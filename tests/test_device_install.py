"""The device install (a Flower SuperNode: ``pip install -e '.[device]'``) in a fresh venv.

Plain pip (no ``--no-deps``, no requirements file) must resolve it; it must bring flwr,
torch and the client side of the library but neither Prefect nor MLflow; the client
modules import without them; and the ``clma`` console script, which the install also
brings, names the ``server`` extra instead of failing with a traceback.

Slow (~1 min on 2 cores: most of it is unpacking the CPU torch wheel; pip's cache serves
the rest), so the quick subset (``-m "not slow ..."``) skips it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What a ClientApp imports: the client side of the Clients seam (clma.device: training,
# the on-device drift detector, the on-device metric report and clipping, the
# secure-aggregation client), the simulated clients, Flower's client helpers.
DEVICE_MODULES = [
    "clma.device", "clma.drift", "clma.params", "clma.metrics", "clma.release",
    "clma.privacy.secagg", "clma.sim.models", "clma.sim.training", "clma.sim.federation",
    "clma.sim.clients", "clma.config", "clma.flower.clientapp", "clma.flower.codec",
    "clma.flower.learner",
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

    r = subprocess.run([str(venv / "bin" / "clma"), "run", "--quiet"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "clma run: needs the server side (Prefect, MLflow), not installed here: "
        "pip install 'clma[server]'"]
