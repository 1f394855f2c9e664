"""`clma serve` against a real local Prefect server (started and stopped by the test via
infra/prefect-server.sh): the deployment is registered with its schedule, and each
`prefect deployment run` advances the federation by rounds_per_run rounds from its
durable state, in the same MLflow run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

TINY = Path(__file__).with_name("durable_tiny.toml")
BIN = Path(sys.executable).parent

pytestmark = [pytest.mark.server, pytest.mark.slow]


def _committed(state: Path) -> int | None:
    from clma.state import StateStore

    snap = StateStore(state).load()
    return None if snap is None else snap.round


def test_served_deployment_advances_the_federation(prefect_server, make_client_env, tmp_path):
    state = tmp_path / "state"
    env = make_client_env(tmp_path, prefect_api=prefect_server,
                          mlflow_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    log = open(tmp_path / "serve.log", "ab")  # noqa: SIM115
    serve = subprocess.Popen(
        [str(BIN / "clma"), "serve", "--config", str(TINY), "--state-dir", str(state),
         "--rounds-per-run", "2", "--name", "tiny", "--cron", "0 0 1 1 *"],
        env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        t0 = time.perf_counter()
        url = f"{prefect_server}/deployments/name/clma-scheduled-federation/tiny"
        deadline = time.monotonic() + 240
        while True:
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            r = httpx.get(url, timeout=10)
            if r.status_code == 200:
                break
            assert time.monotonic() < deadline, "deployment never registered"
            time.sleep(1)
        dep = r.json()
        crons = [s["schedule"].get("cron") for s in dep["schedules"]]
        assert crons == ["0 0 1 1 *"]
        assert dep["parameters"]["rounds_per_run"] == 2
        assert dep["parameters"]["state_dir"] == str(state.resolve())
        registered = time.perf_counter() - t0
        run_ids = []
        for expected in (2, 4):
            t1 = time.perf_counter()
            res = subprocess.run(
                [str(BIN / "prefect"), "deployment", "run", "clma-scheduled-federation/tiny",
                 "--watch", "--watch-timeout", "400"],
                env=env, capture_output=True, text=True, timeout=450)
            assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
            assert _committed(state) == expected
            summary = json.loads((state / "out" / "summary.json").read_text())
            assert [r["round"] for r in summary["rounds"]] == list(range(1, expected + 1))
            run_ids.append(summary["mlflow"]["run_id"])
            print(f"deployment run to round {expected}: {time.perf_counter() - t1:.1f} s")
        assert run_ids[0] == run_ids[1]  # the same federation, the same MLflow run
        print(f"serve registered the deployment in {registered:.1f} s")
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGTERM)
            try:
                serve.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
                serve.wait(timeout=30)
        log.close()
