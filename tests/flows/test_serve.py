"""`clma serve` against a real local Prefect server (started and stopped by the test via
infra/prefect-server.sh): the deployment is registered with its schedule, and each
`prefect deployment run` advances the federation by rounds_per_run rounds from its
durable state, in the same MLflow run; runs are named by the rounds they advance and log
them; the deployment has a concurrency limit of 1, is paused when `clma serve` gets SIGTERM
and when the federation completes; MLflow records every flow run of the federation."""

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


def _start_serve(env, state, log):
    return subprocess.Popen(
        [str(BIN / "clma"), "serve", "--config", str(TINY), "--state-dir", str(state),
         "--rounds-per-run", "2", "--name", "tiny", "--cron", "0 0 1 1 *"],
        env=env, stdout=log, stderr=log, start_new_session=True)


def _stop(serve) -> None:
    if serve.poll() is None:
        os.killpg(serve.pid, signal.SIGTERM)
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait(timeout=30)


def _wait(predicate, what: str, timeout: float = 240, serve=None, log_path=None):
    deadline = time.monotonic() + timeout
    while True:
        if serve is not None:
            assert serve.poll() is None, log_path.read_text()[-3000:]
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(1)


def _run_logs(api: str, run_id: str) -> list[str]:
    r = httpx.post(f"{api}/logs/filter", json={"logs": {"flow_run_id": {"any_": [run_id]}}},
                   timeout=10)
    return [lg["message"] for lg in r.json()]


def _logs_with(api: str, run_id: str, text: str, timeout: float = 30) -> list[str]:
    """The run's logs once one contains ``text`` (the API log handler sends in batches)."""
    deadline = time.monotonic() + timeout
    while True:
        logs = _run_logs(api, run_id)
        if any(text in m for m in logs) or time.monotonic() > deadline:
            return logs
        time.sleep(1)


def test_served_deployment_advances_the_federation(prefect_server, make_client_env, tmp_path):
    state = tmp_path / "state"
    env = make_client_env(tmp_path, prefect_api=prefect_server,
                          mlflow_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    log_path = tmp_path / "serve.log"
    log = open(log_path, "ab")  # noqa: SIM115
    url = f"{prefect_server}/deployments/name/clma-scheduled-federation/tiny"

    def deployment(paused=None):
        r = httpx.get(url, timeout=10)
        if r.status_code != 200:
            return None
        dep = r.json()
        return dep if paused is None or dep["paused"] is paused else None

    serve = _start_serve(env, state, log)
    try:
        t0 = time.perf_counter()
        dep = _wait(deployment, "deployment never registered", serve=serve, log_path=log_path)
        crons = [s["schedule"].get("cron") for s in dep["schedules"]]
        assert crons == ["0 0 1 1 *"]
        assert dep["parameters"]["rounds_per_run"] == 2
        assert dep["parameters"]["state_dir"] == str(state.resolve())
        assert dep["paused"] is False
        assert (dep.get("global_concurrency_limit") or {}).get("limit") == 1, dep
        assert "concurrency limit 1" in dep["description"]
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
            runs = httpx.post(f"{prefect_server}/flow_runs/filter", timeout=10, json={
                "flow_runs": {"deployment_id": {"any_": [dep["id"]]}}}).json()
            names = sorted(r["name"] for r in runs)
            assert f"durable-tiny-rounds-{expected - 1}-{expected}" in names, names
            run = next(r for r in runs if r["name"].endswith(f"-{expected}"))
            last = "advancing rounds" if expected == 2 else "federation complete"
            logs = _logs_with(prefect_server, run["id"], last)
            assert f"federation durable-tiny: advancing rounds {expected - 1} to {expected} " \
                   "of 4" in logs
            print(f"deployment run to round {expected}: {time.perf_counter() - t1:.1f} s")
            if expected == 2:  # not complete: still scheduled; SIGTERM pauses it
                assert deployment()["paused"] is False
                assert not any("federation complete" in m for m in logs)
                _stop(serve)
                assert _wait(lambda: deployment(paused=True), "SIGTERM left it unpaused",
                             timeout=60)
                serve = _start_serve(env, state, log)  # serving again resumes the schedule
                _wait(lambda: deployment(paused=False), "serve did not resume it",
                      serve=serve, log_path=log_path)
            else:  # complete: paused by the run itself while serve still runs
                assert "federation complete: durable-tiny, all 4 rounds committed" in logs
                assert serve.poll() is None
                assert _wait(lambda: deployment(paused=True), "complete but not paused",
                             timeout=30)
        assert run_ids[0] == run_ids[1]  # the same federation, the same MLflow run
        from mlflow import MlflowClient

        tags = MlflowClient(env["MLFLOW_TRACKING_URI"]).get_run(run_ids[0]).data.tags
        recorded = {k for k in tags if k.startswith("clma.prefect_flow_run.")}
        assert len(recorded) == 2, tags  # both federation flow runs, not only the last
        print(f"serve registered the deployment in {registered:.1f} s")
    finally:
        _stop(serve)
        log.close()
