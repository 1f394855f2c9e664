"""Real local servers for the `server` tests, started and stopped with the project's own
scripts (infra/prefect-server.sh, infra/mlflow-server.sh) on free loopback ports: plain
ones, and ones with authentication whose secrets come from a 0600 env file (CLMA_ENV_FILE)
outside the repository, as on the documented production path."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script_env(infra_dir: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for k in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PREFECT_HOME", "CLMA_ENV_FILE",
              "PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_AUTH_STRING", "CLMA_MLFLOW_AUTH",
              "CLMA_REQUIRE_AUTH"):
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


@dataclass(frozen=True)
class LoggedPrefect:
    """A Prefect server of its own: ``api`` URL and the server's ``log`` file."""

    api: str
    log: Path


@pytest.fixture(scope="module")
def own_prefect_server(tmp_path_factory):
    """A Prefect server for one test module only (so its log holds only that module's
    traffic), started with infra/prefect-server.sh as an operator would; yields
    :class:`LoggedPrefect`."""
    infra = tmp_path_factory.mktemp("infra-prefect-own")
    port = free_port()
    srv = Server("prefect-server.sh", _script_env(infra, CLMA_PREFECT_PORT=str(port)),
                 f"http://127.0.0.1:{port}/api")
    srv.start()
    try:
        yield LoggedPrefect(srv.url, infra / f"prefect-server-{port}.log")
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


def _env_file(folder: Path, values: dict[str, str]) -> Path:
    path = folder / "secrets.env"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.writelines(f"{k}={v}\n" for k, v in values.items())
    return path


@dataclass(frozen=True)
class AuthPrefect:
    """An authenticated Prefect server: ``api`` URL and the ``auth_string`` (user:password)."""

    api: str
    auth_string: str
    infra_dir: Path

    @property
    def basic_auth(self) -> tuple[str, str]:
        user, _, password = self.auth_string.partition(":")
        return user, password


@dataclass(frozen=True)
class AuthMlflow:
    """An MLflow basic-auth server: ``url``, the operator and read-only accounts."""

    url: str
    admin: tuple[str, str]
    operator: tuple[str, str]
    reader: tuple[str, str]
    infra_dir: Path


@pytest.fixture(scope="session")
def auth_prefect_server(tmp_path_factory):
    """A Prefect server with basic authentication (PREFECT_SERVER_API_AUTH_STRING from a
    0600 env file); yields :class:`AuthPrefect`."""
    infra = tmp_path_factory.mktemp("infra-prefect-auth")
    port = free_port()
    auth = f"clma-operator:{secrets.token_urlsafe(18)}"
    env_file = _env_file(infra, {"PREFECT_SERVER_API_AUTH_STRING": auth})
    env = _script_env(infra, CLMA_PREFECT_PORT=str(port), CLMA_ENV_FILE=str(env_file),
                      CLMA_REQUIRE_AUTH="true")
    srv = Server("prefect-server.sh", env, f"http://127.0.0.1:{port}/api")
    srv.start()
    try:
        yield AuthPrefect(srv.url, auth, infra)
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def auth_mlflow_server(tmp_path_factory):
    """An MLflow server with the basic-auth app, an operator and a read-only account
    (created by the script); yields :class:`AuthMlflow`."""
    infra = tmp_path_factory.mktemp("infra-mlflow-auth")
    port = free_port()
    admin = ("clma-admin", secrets.token_urlsafe(18))
    operator = ("clma-operator", secrets.token_urlsafe(18))
    reader = ("clma-reader", secrets.token_urlsafe(18))
    env_file = _env_file(infra, {
        "CLMA_MLFLOW_AUTH": "basic",
        "MLFLOW_AUTH_ADMIN_USERNAME": admin[0], "MLFLOW_AUTH_ADMIN_PASSWORD": admin[1],
        "CLMA_MLFLOW_OPERATOR_USERNAME": operator[0], "CLMA_MLFLOW_OPERATOR_PASSWORD": operator[1],
        "CLMA_MLFLOW_READER_USERNAME": reader[0], "CLMA_MLFLOW_READER_PASSWORD": reader[1],
    })
    env = _script_env(infra, CLMA_MLFLOW_PORT=str(port), CLMA_ENV_FILE=str(env_file),
                      CLMA_REQUIRE_AUTH="true")
    srv = Server("mlflow-server.sh", env, f"http://127.0.0.1:{port}")
    srv.start()
    try:
        yield AuthMlflow(srv.url, admin, operator, reader, infra)
    finally:
        srv.stop()


def client_env(tmp: Path, *, prefect_api: str | None = None, mlflow_uri: str | None = None,
               **extra: str) -> dict[str, str]:
    """Environment of a `clma` subprocess talking to the given servers."""
    env = dict(os.environ)
    for k in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_USERNAME",
              "MLFLOW_TRACKING_PASSWORD"):
        env.pop(k, None)
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
