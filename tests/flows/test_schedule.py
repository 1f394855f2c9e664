"""Recurring rounds as an operator meets them: a real Prefect server started with
infra/prefect-server.sh, `clma serve --interval 15 --rounds-per-run 1`, and nobody
triggering anything: the server's scheduler alone creates the runs that commit the rounds.
Also the serve lifecycle: a second `clma serve` on the same state is refused naming the
first; Ctrl-C and SIGTERM end it cleanly with the deployment paused; serving a complete
federation says so and leaves the deployment paused. The server log holds no traceback."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

SCHEDULE = Path(__file__).with_name("schedule_tiny.toml")
TINY = Path(__file__).with_name("durable_tiny.toml")
BIN = Path(sys.executable).parent
FLOW = "clma-scheduled-federation"

pytestmark = [pytest.mark.server, pytest.mark.slow]

_RECORD = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} \| (\w+)\s*\| (\S+) - (.*)$")


def server_log_tracebacks(text: str) -> list[str]:
    """The records of a Prefect server log that carry a traceback, except docket's
    scheduled retries of a transient SQLite "database is locked" (Prefect's
    ``mark_deployments_ready`` opens a DEFERRED transaction on SQLite and docket retries
    it; each retry is logged with its traceback although nothing failed)."""
    records: list[list[str]] = [[]]
    for line in text.splitlines():
        if _RECORD.match(line):
            records.append([])
        records[-1].append(line)
    bad = []
    for rec in records:
        body = "\n".join(rec)
        if "Traceback (most recent call last)" not in body:
            continue
        head = _RECORD.match(rec[0]) if rec else None
        retried = (head is not None and head.group(2) == "docket.dependencies"
                   and head.group(3).startswith("↩") and "database is locked" in body)
        if not retried:
            bad.append(body[-2500:])
    return bad


def test_the_traceback_filter_keeps_everything_but_sqlite_lock_retries():
    retry = ("04:07:08.316 | ERROR   | docket.dependencies - ↩ [    14ms] mark_deployments_ready()\n"
             "Traceback (most recent call last):\n  File \"x\"\n"
             "sqlite3.OperationalError: database is locked\n")
    scheduler = ("04:08:00.000 | ERROR   | prefect.server.services.scheduler - Unexpected error\n"
                 "Traceback (most recent call last):\n"
                 "sqlalchemy.exc.InvalidRequestError: Can't evaluate bulk DML statement\n")
    info = "04:08:01.000 | INFO    | prefect.server - started\n"
    assert server_log_tracebacks(info + retry + info) == []
    assert len(server_log_tracebacks(retry + scheduler + info)) == 1
    assert len(server_log_tracebacks("Traceback (most recent call last):\nboom\n" + info)) == 1
    other = retry.replace("database is locked", "no such table: deployment")
    assert len(server_log_tracebacks(other)) == 1


def _committed(state: Path) -> int:
    from clma.state import StateStore

    snap = StateStore(state).load()
    return 0 if snap is None else snap.round


def _serve_cmd(config: Path, state: Path, *args: str) -> list[str]:
    return [str(BIN / "clma"), "serve", "--config", str(config), "--state-dir", str(state),
            *args]


def _wait(predicate, what: str, timeout: float, serve=None, log_path=None):
    deadline = time.monotonic() + timeout
    while True:
        if serve is not None:
            assert serve.poll() is None, log_path.read_text()[-3000:]
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(1)


def _deployment(api: str, name: str) -> dict | None:
    r = httpx.get(f"{api}/deployments/name/{FLOW}/{name}", timeout=10)
    return r.json() if r.status_code == 200 else None


def _end(serve: subprocess.Popen, sig: int) -> int:
    """Send ``sig`` to the serving process group (as a terminal's Ctrl-C does) and wait."""
    if serve.poll() is None:
        os.killpg(serve.pid, sig)
    try:
        return serve.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(serve.pid, signal.SIGKILL)
        serve.wait(timeout=30)
        raise


def test_the_schedule_alone_commits_rounds(own_prefect_server, make_client_env, tmp_path):
    api = own_prefect_server.api
    state = tmp_path / "state"
    env = make_client_env(tmp_path, prefect_api=api,
                          mlflow_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    log_path = tmp_path / "serve.log"
    with open(log_path, "ab") as log:
        serve = subprocess.Popen(
            _serve_cmd(SCHEDULE, state, "--interval", "15", "--rounds-per-run", "1"),
            env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        _wait(lambda: "serving deployment" in log_path.read_text(), "serve never got ready",
              timeout=180, serve=serve, log_path=log_path)
        dep = _deployment(api, "schedule-tiny")
        assert dep["schedules"][0]["schedule"]["interval"] == 15.0
        assert dep["paused"] is False

        # a second serve on the same state folder is refused, naming the running one
        second = subprocess.run(_serve_cmd(SCHEDULE, state, "--interval", "15"), env=env,
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr
        assert f"is already served (deployment '{FLOW}/schedule-tiny', pid {serve.pid} " \
               in second.stderr

        # nobody triggers a run: the server's scheduler creates them
        _wait(lambda: _committed(state) >= 2, "the schedule did not commit 2 rounds",
              timeout=420, serve=serve, log_path=log_path)

        def completed() -> list[dict]:
            runs = httpx.post(f"{api}/flow_runs/filter", timeout=10, json={"flow_runs": {
                "deployment_id": {"any_": [dep["id"]]},
                "state": {"type": {"any_": ["COMPLETED"]}}}}).json()
            return runs if len(runs) >= 2 else []

        # a run is Completed shortly after its round's commit
        done = _wait(completed, "two committed rounds but not two completed runs",
                     timeout=120, serve=serve, log_path=log_path)
        assert all(r["auto_scheduled"] for r in done)  # created by the schedule, not by hand
        assert {"schedule-tiny-round-1", "schedule-tiny-round-2"} <= {r["name"] for r in done}
        # the run that completed the federation paused the deployment
        _wait(lambda: _deployment(api, "schedule-tiny")["paused"], "complete but not paused",
              timeout=60)

        # Ctrl-C ends serve cleanly
        assert _end(serve, signal.SIGINT) == 0
        text = log_path.read_text()
        assert "clma serve: stopped; the deployment is paused" in text
        assert "Traceback" not in text, text[-3000:]
        # the lock went with it: serving the complete federation says so, leaves it paused
        again = subprocess.run(_serve_cmd(SCHEDULE, state, "--interval", "15"), env=env,
                               capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr
        assert "federation 'schedule-tiny' is complete (all 2 rounds committed" in again.stderr
        assert "Traceback" not in again.stderr
        time.sleep(2)
        assert _deployment(api, "schedule-tiny")["paused"] is True
        assert _committed(state) == 2
    finally:
        if serve.poll() is None:
            _end(serve, signal.SIGTERM)
    bad = server_log_tracebacks(own_prefect_server.log.read_text())
    assert not bad, bad[0]


def test_sigterm_ends_serve_cleanly_and_pauses(own_prefect_server, make_client_env, tmp_path):
    api = own_prefect_server.api
    env = make_client_env(tmp_path, prefect_api=api,
                          mlflow_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    log_path = tmp_path / "serve.log"
    with open(log_path, "ab") as log:
        serve = subprocess.Popen(
            _serve_cmd(TINY, tmp_path / "state", "--name", "yearly", "--cron", "0 0 1 1 *"),
            env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        _wait(lambda: "serving deployment" in log_path.read_text(), "serve never got ready",
              timeout=180, serve=serve, log_path=log_path)
        assert _deployment(api, "yearly")["paused"] is False
        assert _end(serve, signal.SIGTERM) == 0
    finally:
        if serve.poll() is None:
            _end(serve, signal.SIGKILL)
    text = log_path.read_text()
    assert "clma serve: stopped; the deployment is paused" in text
    assert "Traceback" not in text and "never awaited" not in text, text[-3000:]
    assert _deployment(api, "yearly")["paused"] is True
    assert (tmp_path / "state" / "serve.lock").read_text() == ""  # released
    bad = server_log_tracebacks(own_prefect_server.log.read_text())
    assert not bad, bad[0]
