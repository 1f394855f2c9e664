"""examples/hospitals-tabular's "Over a local Flower deployment" commands run as written:
the README's bash block, line by line, in a working folder laid out as the repository is
(the example copied in, ``.venv`` and ``infra`` linked), on free loopback ports instead of
9093/9110 (the deployment config's superlink line is the only text changed). Ten SuperNode
processes of ``infra/flower-local.sh`` read the hospitals' own records through the
example's data source; ``clma run`` governs eight rounds through a ServerApp that holds
only the model factory and the public probe set. ``stop`` leaves no process behind.
Temporary Prefect home and MLflow store.

Slow (about a quarter of an hour on 2 cores: Flower starts a ClientApp process per node
and message). The CIFAR-10 example's deployment commands follow the same pattern; its
data source runs over the CLMA ClientApp in process (tests/examples/test_cifar10_cnn.py),
not over a second ten-node deployment, which would add as much again to the suite."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.flower.test_deployment import _free_ports, _leftovers  # the loopback helpers

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.server]


def _deployment_block(example: str) -> list[str]:
    text = (ROOT / "examples" / example / "README.md").read_text("utf-8")
    (part,) = re.findall(r"## Over a local Flower deployment.*?```bash\n(.*?)```", text, re.S)
    return part.strip().splitlines()


def _workdir(tmp: Path, example: str) -> Path:
    """A folder laid out as the repository root, as the README's commands expect."""
    work = tmp / "repo"
    shutil.copytree(ROOT / "examples" / example, work / "examples" / example,
                    ignore=shutil.ignore_patterns("data", "probe.npz", "__pycache__"))
    (work / ".venv").symlink_to(VENV)
    (work / "infra").symlink_to(ROOT / "infra")
    return work


def _run_block(work: Path, example: str, config: str, tmp: Path) -> subprocess.CompletedProcess:
    lines = _deployment_block(example)
    assert lines[-1] == "infra/flower-local.sh stop"
    port = _free_ports(1, 9800)
    node_port = _free_ports(10, port + 20)
    cfg = work / "examples" / example / config
    shipped = cfg.read_text("utf-8")
    cfg.write_text(shipped.replace('superlink = "127.0.0.1:9093"',
                                   f'superlink = "127.0.0.1:{port}"'))
    assert cfg.read_text("utf-8") != shipped
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env.update(CLMA_FLOWER_DIR=str(tmp / "flower"), CLMA_FLOWER_PORT=str(port),
               CLMA_FLOWER_NODE_PORT=str(node_port), CLMA_VENV=str(VENV),
               CLMA_START_TIMEOUT="300", PREFECT_HOME=str(tmp / "prefect"),
               MLFLOW_TRACKING_URI=f"sqlite:///{tmp / 'mlflow.db'}",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
               FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1")
    # every line but the last as written; the last (stop) runs whatever happened
    script = "\n".join(lines[:-1])
    try:
        return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=work, env=env,
                              capture_output=True, text=True, timeout=3600)
    finally:
        stop = subprocess.run(["bash", "-c", lines[-1]], cwd=work, env=env,
                              capture_output=True, text=True, timeout=300)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        left = _leftovers(str(tmp / "flower"))
        assert not left, f"processes left after stop: {sorted(left)}"


def _run_log(out: Path) -> str:
    (log,) = (out / "flower").glob("run-*.log")
    return log.read_text("utf-8")


def test_hospitals_over_ten_supernodes(tmp_path):
    from clma.release import count_band

    work = _workdir(tmp_path, "hospitals-tabular")
    r = _run_block(work, "hospitals-tabular", "federation-flower.toml", tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = work / "runs" / "hospitals-flower"
    s = json.loads((out / "summary.json").read_text())
    assert s["federation"]["transport"] == "flower"
    assert s["federation"]["dataset"] == "device data (node config data-source)"
    assert s["sim_truth"] is None and s["federation"]["noise"]["source"] == "opendp"
    assert "roster: 10 of 10 SuperNodes are clients [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]" \
        in _run_log(out)
    rounds = s["rounds"]
    assert [x["round"] for x in rounds] == list(range(1, 9))
    m = s["federation"]["min_cohort"]  # the floor in force (the policy's, 5)
    # one cohort until the recalibration at round 5; then the three recalibrated hospitals
    # (0, 3, 6, flagged on their own devices) form a new cohort, published as bands
    assert all(len(x["cohorts"]) == 1 for x in rounds[:4])
    assert rounds[4]["flagged_clients"] == count_band(3, m)
    (new,) = rounds[4]["new_cohorts"].values()
    assert new["band"] == count_band(3, m)
    assert sorted(s["final_cohorts"].values()) == sorted([count_band(3, m),
                                                         count_band(7, m)])
