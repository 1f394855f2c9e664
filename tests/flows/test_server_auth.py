"""Authenticated servers, started with the infra scripts as on the production path (secrets
from a 0600 env file): Prefect refuses a client without the auth string and serves one with
it; MLflow's basic-auth app refuses an unauthenticated client, lets the operator write and
the read-only account read but not write. The secrets never reach the servers' logs."""

from __future__ import annotations

import stat

import httpx
import pytest

pytestmark = [pytest.mark.server, pytest.mark.slow]


def test_prefect_refuses_a_client_without_the_auth_string(auth_prefect_server):
    api, (user, password) = auth_prefect_server.api, auth_prefect_server.basic_auth
    query = {"limit": 1}
    assert httpx.post(f"{api}/flow_runs/filter", json=query, timeout=10).status_code == 401
    assert httpx.post(f"{api}/flow_runs/filter", json=query, timeout=10,
                      auth=(user, password + "x")).status_code == 401
    assert httpx.post(f"{api}/flow_runs/filter", json=query, timeout=10,
                      auth=(user, password)).status_code == 200
    # health probes stay open (the scripts and orchestrators wait on them)
    assert httpx.get(f"{api}/health", timeout=10).json() is True


def test_prefect_client_with_and_without_the_auth_string(auth_prefect_server):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: auth_prefect_server.api}):
        with get_client(sync_client=True) as client, pytest.raises(httpx.HTTPStatusError) as err:
            client.read_flow_runs(limit=1)
        assert err.value.response.status_code == 401
    with temporary_settings({PREFECT_API_URL: auth_prefect_server.api,
                             PREFECT_API_AUTH_STRING: auth_prefect_server.auth_string}):
        with get_client(sync_client=True) as client:
            assert isinstance(client.read_flow_runs(limit=1), list)
    log = next(auth_prefect_server.infra_dir.glob("prefect-server-*.log")).read_text()
    assert auth_prefect_server.basic_auth[1] not in log


def _client(url: str, account: tuple[str, str] | None, monkeypatch):
    from mlflow import MlflowClient

    for var in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(var, raising=False)
    if account is not None:
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", account[0])
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", account[1])
    return MlflowClient(tracking_uri=url)


def _refused(call) -> int:
    """The HTTP status with which the server refused ``call()`` (MLflow's REST errors, or
    requests' for artifact uploads through the server)."""
    import requests
    from mlflow.exceptions import MlflowException

    try:
        call()
    except requests.HTTPError as exc:
        return exc.response.status_code
    except MlflowException as exc:
        return int(str(exc).split("error code ")[1].split()[0])
    raise AssertionError("the server accepted it")


def test_mlflow_refuses_unauthenticated_and_wrong_passwords(auth_mlflow_server, monkeypatch):
    url = auth_mlflow_server.url
    r = httpx.post(f"{url}/api/2.0/mlflow/experiments/search", json={"max_results": 1},
                   timeout=10)
    assert r.status_code == 401
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert _refused(_client(url, None, monkeypatch).search_experiments) == 401
    user, password = auth_mlflow_server.reader
    assert _refused(_client(url, (user, password + "x"), monkeypatch).search_experiments) == 401


def test_mlflow_reader_reads_but_does_not_write(auth_mlflow_server, monkeypatch, tmp_path):
    url = auth_mlflow_server.url
    op = _client(url, auth_mlflow_server.operator, monkeypatch)
    exp = op.create_experiment("auth-test-federation")
    run = op.create_run(exp, run_name="federation").info.run_id
    op.log_metric(run, "accuracy", 0.875, step=1)
    op.set_tag(run, "clma.kind", "federation")
    art = tmp_path / "report.json"
    art.write_text('{"accuracy": 0.875}')
    op.log_artifact(run, str(art), "reports")

    reader = _client(url, auth_mlflow_server.reader, monkeypatch)
    got = reader.get_run(run)
    assert got.data.metrics == {"accuracy": 0.875} and got.data.tags["clma.kind"] == "federation"
    assert [r.info.run_id for r in reader.search_runs([exp])] == [run]
    local = reader.download_artifacts(run, "reports/report.json", str(tmp_path / "dl"))
    assert open(local).read() == '{"accuracy": 0.875}'
    writes = {
        "log_metric": lambda: reader.log_metric(run, "accuracy", 0.1, step=2),
        "set_tag": lambda: reader.set_tag(run, "clma.kind", "forged"),
        "create_run": lambda: reader.create_run(exp),
        "delete_run": lambda: reader.delete_run(run),
        "rename_experiment": lambda: reader.rename_experiment(exp, "mine"),
        "log_artifact": lambda: reader.log_artifact(run, str(art), "forged"),
    }
    assert {name: _refused(write) for name, write in writes.items()} == dict.fromkeys(writes, 403)
    after = op.get_run(run)
    assert after.data.metrics == {"accuracy": 0.875} and after.data.tags["clma.kind"] == "federation"
    assert [a.path for a in op.list_artifacts(run)] == ["reports"]
    assert op.get_experiment(exp).name == "auth-test-federation"


def test_mlflow_secrets_stay_out_of_logs_and_files(auth_mlflow_server):
    infra = auth_mlflow_server.infra_dir
    store = infra / "mlflow"
    texts = [p.read_bytes() for p in infra.glob("*.log")] + [(store / "basic_auth.ini").read_bytes()]
    for _, secret in (auth_mlflow_server.admin, auth_mlflow_server.operator,
                      auth_mlflow_server.reader):
        assert all(secret.encode() not in t for t in texts)
    assert stat.S_IMODE((store / "basic_auth.db").stat().st_mode) == 0o600
    assert stat.S_IMODE((store / "basic_auth.ini").stat().st_mode) == 0o600
    assert "default_permission = READ" in (store / "basic_auth.ini").read_text()
