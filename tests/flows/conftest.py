"""Real local servers for the `server` tests, started and stopped with the project's own
scripts (infra/prefect-server.sh, infra/mlflow-server.sh) on free loopback ports."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script_env(infra_dir: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for k in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PREFECT_HOME"):
        env.pop(k, None)
    env.update(CLMA_INFRA_DIR=str(infra_dir), CLMA_START_TIMEOUT="240", **extra)
    return env


class Server:
    def __init__(self, script: str, env: dict[str, str], url: str) -> None:
        self.script, self.env, self.url = script, env, url

    def start(self) -> None:
        r = subprocess.run([str(ROOT / "infra" / self.script), "start"], env=self.env,
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{self.script} start failed: {r.stdout}{r.stderr}")

    def stop(self) -> None:
        subprocess.run([str(ROOT / "infra" / self.script), "stop"], env=self.env,
                       capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A Prefect server (API + UI) on 127.0.0.1; yields its API URL (``.../api``)."""
    infra = tmp_path_factory.mktemp("infra-prefect")
    port = free_port()
    srv = Server("prefect-server.sh", _script_env(infra, CLMA_PREFECT_PORT=str(port)),
                 f"http://127.0.0.1:{port}/api")
    srv.start()
    try:
        yield srv.url
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """An MLflow tracking server (SQLite store) on 127.0.0.1; yields its URL."""
    infra = tmp_path_factory.mktemp("infra-mlflow")
    port = free_port()
    srv = Server("mlflow-server.sh", _script_env(infra, CLMA_MLFLOW_PORT=str(port)),
                 f"http://127.0.0.1:{port}")
    srv.start()
    try:
        yield srv.url
    finally:
        srv.stop()


def client_env(tmp: Path, *, prefect_api: str | None = None, mlflow_uri: str | None = None,
               **extra: str) -> dict[str, str]:
    """Environment of a `clma` subprocess talking to the given servers."""
    env = dict(os.environ)
    env.pop("PREFECT_API_URL", None)
    env.update(PREFECT_HOME=str(tmp / "client-prefect-home"),
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
               PREFECT_LOGGING_LEVEL="WARNING", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               DO_NOT_TRACK="true", **extra)
    if prefect_api:
        env["PREFECT_API_URL"] = prefect_api
    if mlflow_uri:
        env["MLFLOW_TRACKING_URI"] = mlflow_uri
    return env


@pytest.fixture
def make_client_env():
    """:func:`client_env` (environment of a `clma` subprocess talking to servers)."""
    return client_env
