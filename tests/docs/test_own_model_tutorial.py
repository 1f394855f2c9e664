"""docs/own_model.md run as written: its bash blocks, in order, from an empty folder.

Blocks are marked in the page (``<!-- tutorial: setup|simulation|flower -->``). The
setup and simulation blocks run in the quick subset (a temporary folder, Prefect home and
MLflow store); the flower blocks start the local deployment of ``infra/flower-local.sh``
on 127.0.0.1 and run the federation over six SuperNodes (slow, server)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "own_model.md"


def blocks(kind: str) -> list[str]:
    """The page's bash blocks marked ``kind``, in order."""
    text = PAGE.read_text("utf-8")
    return re.findall(r"<!-- tutorial: " + kind + r" -->\n```bash\n(.*?)```", text, re.S)


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env.update(CLMA_HOME=str(ROOT), HOME=str(tmp / "home"),
               PREFECT_HOME=str(tmp / "prefect"),
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    return env


def _bash(script: str, cwd: Path, env: dict[str, str], timeout: float = 1200
          ) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_page_marks_its_blocks():
    assert len(blocks("setup")) == 4 and len(blocks("simulation")) == 1
    assert len(blocks("flower")) == 2
    text = PAGE.read_text("utf-8")
    assert text.count("```bash") == 7  # every block is marked


def test_setup_and_simulation_run_as_written(tmp_path):
    env = _env(tmp_path)
    (tmp_path / "home").mkdir()
    setup = "\n".join(blocks("setup"))
    r = _bash(setup + "\n" + "\n".join(blocks("simulation")), tmp_path, env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    project = tmp_path / "myfed-project"
    assert sorted(p.name for p in (project / "sites").iterdir()) == [
        f"site-{i}.csv" for i in range(6)]
    s = json.loads((project / "runs" / "sim" / "summary.json").read_text())
    assert s["federation"]["name"] == "myfed" and len(s["rounds"]) == 6
    assert s["federation"]["dataset"] == "source:myfed.data:all_records"
    # the drift event at round 4 (clients 0, 1) gets a cohort of its own
    assert s["sim_truth"]["ari_per_drift_event"] == {"4": 1.0}
    assert s["sim_truth"]["stationary_final_accuracy"] > 0.9
    assert (project / "mlflow" / "store" / "mlflow.db").exists()


def _free_port_run(n: int, start: int) -> int:
    """The first port p >= start with p .. p + n - 1 free on 127.0.0.1."""
    import socket

    def free(port: int) -> bool:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    p = start
    while not all(free(p + i) for i in range(n)):
        p += n
    return p


@pytest.mark.slow
@pytest.mark.server
def test_the_flower_part_runs_as_written(tmp_path):
    """The two flower blocks as written, on free loopback ports instead of 9093 (the
    config's superlink line is the only text changed)."""
    env = _env(tmp_path)
    (tmp_path / "home").mkdir()
    prepare, run = blocks("flower")
    r = _bash("\n".join(blocks("setup")) + "\n" + prepare, tmp_path, env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    project = tmp_path / "myfed-project"
    port = _free_port_run(1, 9700)
    node_port = _free_port_run(6, port + 20)
    cfg = project / "federation-flower.toml"
    cfg.write_text(cfg.read_text().replace("127.0.0.1:9093", f"127.0.0.1:{port}"))
    env.update(CLMA_FLOWER_PORT=str(port), CLMA_FLOWER_NODE_PORT=str(node_port))
    try:
        r = _bash("cd myfed-project\n" + run, tmp_path, env, timeout=2400)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    finally:
        subprocess.run([str(ROOT / "infra" / "flower-local.sh"), "stop"], cwd=project,
                       env=dict(env, CLMA_FLOWER_DIR=str(project / "flower")),
                       capture_output=True, timeout=300)
    s = json.loads((project / "runs" / "flower" / "summary.json").read_text())
    assert s["federation"]["transport"] == "flower" and len(s["rounds"]) == 6
    assert s["federation"]["dataset"] == "device data (node config data-source)"
    assert s["sim_truth"] is None
    log = next((project / "runs" / "flower" / "flower").glob("run-*.log")).read_text()
    assert "roster: 6 of 6 SuperNodes are clients [0, 1, 2, 3, 4, 5]" in log, log[-3000:]
