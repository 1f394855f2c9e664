"""infra/: server scripts refuse what they must (no server started here; the `server`
tests start real ones through the same scripts), the compose file publishes on loopback
only with the pinned versions, and prefect.yaml's deployment points at the real flow."""

from __future__ import annotations

import inspect
import os
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"


def _run(script, tmp_path, *args, **env):
    e = {k: v for k, v in os.environ.items()
         if k not in ("CLMA_ENV_FILE", "CLMA_REQUIRE_AUTH", "CLMA_MLFLOW_AUTH",
                      "PREFECT_SERVER_API_AUTH_STRING", "MLFLOW_AUTH_ADMIN_PASSWORD")}
    e.update(CLMA_INFRA_DIR=str(tmp_path), **env)
    return subprocess.run([str(INFRA / script), *args], env=e, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("script,host_var", [("prefect-server.sh", "CLMA_PREFECT_HOST"),
                                             ("mlflow-server.sh", "CLMA_MLFLOW_HOST")])
def test_scripts_refuse_a_non_loopback_host(tmp_path, script, host_var):
    r = _run(script, tmp_path, "start", **{host_var: "0.0.0.0"})
    assert r.returncode == 1
    assert "not a loopback address" in r.stderr


@pytest.mark.parametrize("script,port_var", [("prefect-server.sh", "CLMA_PREFECT_PORT"),
                                             ("mlflow-server.sh", "CLMA_MLFLOW_PORT")])
def test_scripts_refuse_a_busy_port_and_start_nothing(tmp_path, script, port_var):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = _run(script, tmp_path, "start", **{port_var: str(port)})
    assert r.returncode == 1
    assert f"port {port} on 127.0.0.1 is already in use" in r.stderr
    assert not list(tmp_path.glob("*.pid"))


def test_status_and_stop_of_a_server_not_running(tmp_path):
    r = _run("mlflow-server.sh", tmp_path, "status", CLMA_MLFLOW_PORT="5999")
    assert (r.returncode, r.stdout.strip()) == (3, "MLflow server not running")
    r = _run("prefect-server.sh", tmp_path, "stop", CLMA_PREFECT_PORT="4999")
    assert (r.returncode, r.stdout.strip()) == (0, "Prefect server not running")
    r = _run("prefect-server.sh", tmp_path, "restart")
    assert r.returncode == 2 and "usage" in r.stderr
    r = _run("prefect-server.sh", tmp_path, "start", CLMA_PREFECT_PORT="70000")
    assert r.returncode == 1 and "outside 1..65535" in r.stderr


def _secrets(folder: Path, text: str, mode: int = 0o600) -> Path:
    path = folder / "secrets.env"
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_env_file_must_be_private_and_outside_the_checkout(tmp_path):
    loose = _secrets(tmp_path, "PREFECT_SERVER_API_AUTH_STRING=a:b\n", 0o640)
    r = _run("prefect-server.sh", tmp_path, "status", CLMA_ENV_FILE=str(loose))
    assert r.returncode == 1 and "mode 640 lets group or others read it" in r.stderr
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    inside = _secrets(repo, "CLMA_MLFLOW_AUTH=basic\n")
    r = _run("mlflow-server.sh", tmp_path, "status", CLMA_ENV_FILE=str(inside),
             CLMA_ROOT=str(repo), CLMA_MLFLOW_PORT="5999")
    assert r.returncode == 1 and "inside the checkout and not git-ignored" in r.stderr
    (repo / ".gitignore").write_text("secrets.env\n")
    r = _run("mlflow-server.sh", tmp_path, "status", CLMA_ENV_FILE=str(inside),
             CLMA_ROOT=str(repo), CLMA_MLFLOW_PORT="5999")
    assert (r.returncode, r.stdout.strip()) == (3, "MLflow server not running")


@pytest.mark.parametrize(("script", "env", "message"), [
    ("prefect-server.sh", {"CLMA_REQUIRE_AUTH": "true"},
     "CLMA_REQUIRE_AUTH is set but PREFECT_SERVER_API_AUTH_STRING is not"),
    ("prefect-server.sh", {"PREFECT_SERVER_API_AUTH_STRING": "no-colon"},
     "must be 'user:password'"),
    ("prefect-server.sh", {"PREFECT_SERVER_API_AUTH_STRING": ""}, "must be 'user:password'"),
    ("mlflow-server.sh", {"CLMA_REQUIRE_AUTH": "true"}, "start MLflow with CLMA_MLFLOW_AUTH=basic"),
    ("mlflow-server.sh", {"CLMA_MLFLOW_AUTH": "basic"}, "MLFLOW_AUTH_ADMIN_PASSWORD is required"),
    ("mlflow-server.sh", {"CLMA_MLFLOW_AUTH": "basic", "MLFLOW_AUTH_ADMIN_PASSWORD": "short"},
     "at least 12 characters"),
    ("mlflow-server.sh", {"CLMA_MLFLOW_AUTH": "basic", "MLFLOW_AUTH_ADMIN_PASSWORD": "x" * 12,
                          "CLMA_MLFLOW_READER_USERNAME": "reader"},
     "CLMA_MLFLOW_READER_PASSWORD is required"),
    ("mlflow-server.sh", {"CLMA_MLFLOW_AUTH": "ldap"}, "use basic or off"),
])
def test_scripts_refuse_incomplete_authentication(tmp_path, script, env, message):
    r = _run(script, tmp_path, "start", CLMA_PREFECT_PORT="4998", CLMA_MLFLOW_PORT="5998", **env)
    assert r.returncode == 1 and message in r.stderr
    assert not list(tmp_path.glob("*.pid"))


def test_compose_file_publishes_on_loopback_with_pinned_versions():
    doc = yaml.safe_load((INFRA / "docker-compose.yml").read_text())
    services = doc["services"]
    assert set(services) == {"prefect-server", "mlflow-server", "postgres"}
    for name, svc in services.items():
        for port in svc["ports"]:
            assert port.startswith("127.0.0.1:"), (name, port)
        assert "healthcheck" in svc
    assert services["prefect-server"]["image"] == "prefecthq/prefect:3.7.7-python3.11"
    assert "v3.17.2" in services["mlflow-server"]["image"]
    assert services["postgres"]["profiles"] == ["postgres"]
    cmd = services["mlflow-server"]["command"]
    assert cmd[cmd.index("--workers") + 1] == "1"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"prefect==3.7.7"' in pyproject and '"mlflow==3.17.2"' in pyproject


def test_prefect_yaml_deployment_points_at_the_scheduled_flow():
    doc = yaml.safe_load((INFRA / "prefect.yaml").read_text())
    (dep,) = doc["deployments"]
    path, name = dep["entrypoint"].split(":")
    assert (ROOT / path).is_file()
    import importlib

    mod = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    flow = getattr(mod, name)
    assert flow.name == "clma-scheduled-federation"
    assert set(dep["parameters"]) <= set(inspect.signature(flow.fn).parameters)
    assert dep["work_pool"]["name"] == "clma-process"
    assert dep["concurrency_limit"] == 1
    assert [s.get("interval") for s in dep["schedules"]] == [3600]
