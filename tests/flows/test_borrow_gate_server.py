"""End to end with a real Prefect server: a federation that exhausts its evaluation line
pauses at the borrow-approval gate; another process answers with ``clma approve``.

Two federations run at the same time against one ``prefect server start`` on 127.0.0.1
(started and stopped here, temporary PREFECT_HOME):

- A is resumed by ``privacy-officer`` (on the policy's allow-list) with the paused run's
  id: it completes having borrowed exactly once (ledger), and MLflow holds the decision.
- B is resumed by ``mallory`` (not on the list) with the *federation's* run id (the
  command finds the paused approval run below it): it completes without borrowing; the
  ledger records the refusal and training backs off (no training charge afterwards).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.server, pytest.mark.slow]

ROOT = Path(__file__).parents[2]
CLMA = [sys.executable, "-m", "flows.cli"]
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"

CONFIG = """
name = "{name}"
seed = 1
rounds = 2
clients = 6

[data]
probe_size = 32

[training]
local_epochs = 1

[training.dp]
enabled = true
clipping_bound = 5.0
noise_multiplier = 3.0

[divergence]
enabled = false

[evaluation]
epsilon = 1.0

[budget]
state_dir = "{state}"
policy = "{policy}"
approval_gate = "pause"
approval_timeout_seconds = 120
approval_poll_seconds = 1.0
"""


def write_policy(tmp: Path, *, epsilon_cap: float, epoch_rounds: int, cadence: int) -> Path:
    """The shipped policy with another cap, epoch length and regional cadence."""
    text = (ROOT / "clma" / "policy" / "privacy_policy_v1.toml").read_text()
    for key, value in (("epsilon_per_client_per_epoch", repr(epsilon_cap)),
                       ("epoch_length_rounds", str(epoch_rounds)),
                       ("regional_cadence_rounds", str(cadence))):
        text = re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
    text = text.replace('"clma-privacy-policy-v1"', '"clma-privacy-policy-test"')
    p = tmp / "policy.toml"
    p.write_text(text)
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    import httpx

    return httpx.get(url, timeout=10).json()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-server-home")
    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "DO_NOT_TRACK": "true", "PREFECT_SERVER_LOGGING_LEVEL": "WARNING"}
    env.pop("PREFECT_API_URL", None)
    log = open(home / "server.log", "wb")
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("prefect")), "server", "start", "--host", "127.0.0.1",
         "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    api = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if _get(f"{api}/health") is True:
                    break
            except Exception:  # not up yet
                pass
            assert proc.poll() is None, (home / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "prefect server not healthy in 120 s"
            time.sleep(0.5)
        yield api
    finally:
        _stop(proc)
        log.close()


def _start_federation(tmp: Path, name: str, policy: Path, api: str):
    state = tmp / f"state-{name}"
    cfg = tmp / f"{name}.toml"
    cfg.write_text(CONFIG.format(name=name, state=state, policy=policy))
    err = tmp / f"{name}.stderr"
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(tmp / f"home-{name}"),
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / (name + '-mlflow.db')}",
           "PREFECT_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.Popen(
        [*CLMA, "run", "--config", str(cfg), "--out", str(tmp / f"out-{name}"), "--quiet"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(err, "wb"),
        start_new_session=True,
    )
    return proc, err, state


def _wait_paused(proc, err: Path, api: str, timeout: float = 150) -> str:
    """The paused approval run's id: printed by the gate, and Paused on the server."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(rf"borrow request paused, flow run ({UUID})", err.read_text(errors="replace"))
        if m:
            run = _get(f"{api}/flow_runs/{m.group(1)}")
            if run["state"]["type"] == "PAUSED":
                return m.group(1)
        assert proc.poll() is None, err.read_text()[-3000:]
        time.sleep(1)
    raise AssertionError("the federation never paused:\n" + err.read_text()[-3000:])


def _root_run(api: str, run_id: str) -> str:
    """Walk up from a subflow run to the top-level (federation) flow run."""
    run = _get(f"{api}/flow_runs/{run_id}")
    while run.get("parent_task_run_id"):
        task = _get(f"{api}/task_runs/{run['parent_task_run_id']}")
        run = _get(f"{api}/flow_runs/{task['flow_run_id']}")
    return run["id"]


def _approve(api: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_API_URL": api}
    return subprocess.run([*CLMA, "approve", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def two_runs(prefect_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("borrow")
    # cap 10 -> each evaluation line holds 1.5: one release at epsilon 1, not two
    policy = write_policy(tmp, epsilon_cap=10.0, epoch_rounds=2, cadence=1)
    api = prefect_server
    t0 = time.monotonic()
    a, a_err, a_state = _start_federation(tmp, "borrow-ok", policy, api)
    b, b_err, b_state = _start_federation(tmp, "borrow-refused", policy, api)
    try:
        a_paused = _wait_paused(a, a_err, api)
        b_paused = _wait_paused(b, b_err, api)
        t_paused = time.monotonic() - t0
        bad_id = _approve(api, "not-a-run-id", "--approver", "privacy-officer")
        ok = _approve(api, a_paused, "--approver", "privacy-officer", "--reason", "quarterly review")
        b_root = _root_run(api, b_paused)
        bad = _approve(api, b_root, "--approver", "mallory", "--reason", "let me in")
        a.wait(180)
        b.wait(180)
        again = _approve(api, a_paused, "--approver", "privacy-officer")
    finally:
        _stop(a)
        _stop(b)
    return {
        "tmp": tmp, "policy": policy, "api": api, "a": (a, a_err, a_state, a_paused),
        "b": (b, b_err, b_state, b_paused, b_root), "ok": ok, "bad": bad, "bad_id": bad_id,
        "again": again, "seconds_to_pause": t_paused, "seconds": time.monotonic() - t0,
    }


def _ledger(state: Path, policy: Path):
    from clma.budget import PrivacyLedger, load_policy

    return PrivacyLedger(state, load_policy(policy))


def test_allowed_approver_resumes_and_the_flow_borrows_once(two_runs):
    a, a_err, a_state, a_paused = two_runs["a"]
    assert two_runs["ok"].returncode == 0, two_runs["ok"].stderr
    assert json.loads(two_runs["ok"].stdout)["resumed"] == a_paused
    assert a.returncode == 0, a_err.read_text()[-3000:]
    run = _get(f"{two_runs['api']}/flow_runs/{a_paused}")
    assert run["state"]["type"] == "COMPLETED"  # the approval run itself
    ledger = _ledger(a_state, two_runs["policy"])
    borrows = ledger.borrows()
    assert [(b["epoch"], b["approved"], b["approver"], b["approver_reason"]) for b in borrows] == [
        (0, 1, "privacy-officer", "quarterly review")]
    assert all(b["policy_version"] == "clma-privacy-policy-test" for b in borrows)
    line = borrows[0]["line"]
    row = next(r for r in ledger.table(0) if r.line_item == line)
    assert row.borrowed_epsilon == pytest.approx(borrows[0]["epsilon"])
    assert row.spent_epsilon > 1.5  # it spent beyond the base line: the borrow was used
    assert row.spent_epsilon <= row.cap_epsilon + 1e-12
    nxt = next(r for r in ledger.table(1) if r.line_item == line)
    assert nxt.lent_epsilon == pytest.approx(borrows[0]["epsilon"])
    assert not next(r for r in ledger.table(0) if r.line_item == "training").training_frozen


def test_allowed_approval_is_recorded_in_mlflow(two_runs):
    from mlflow import MlflowClient

    tmp = two_runs["tmp"]
    summary = json.loads((tmp / "out-borrow-ok" / "summary.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'borrow-ok-mlflow.db'}")
    run = client.get_run(summary["mlflow"]["run_id"])
    tags = run.data.tags
    assert tags["clma.policy.version"] == "clma-privacy-policy-test"
    assert len(tags["clma.policy.content_hash"]) == 64
    dec = [k for k in tags if k.startswith("clma.budget.borrow.e0.") and k.endswith(".decision")]
    assert len(dec) == 1 and tags[dec[0]] == "approved"
    assert tags[dec[0].replace(".decision", ".approver")] == "privacy-officer"
    doc = json.loads(Path(client.download_artifacts(run.info.run_id, "budget/decisions.json"))
                     .read_text())
    assert [b["approver"] for b in doc["borrows"]] == ["privacy-officer"]
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "budget/ledger.json"))
                       .read_text())
    assert {"line_item", "spent_epsilon", "remaining_epsilon", "approver"} <= set(table["columns"])


def test_approver_not_on_the_list_does_not_borrow_and_training_backs_off(two_runs):
    b, b_err, b_state, b_paused, b_root = two_runs["b"]
    assert b_root != b_paused  # resumed through the federation run's id
    assert two_runs["bad"].returncode == 0, two_runs["bad"].stderr
    assert json.loads(two_runs["bad"].stdout)["resumed"] == b_paused
    assert b.returncode == 0, b_err.read_text()[-3000:]
    ledger = _ledger(b_state, two_runs["policy"])
    borrows = ledger.borrows()
    assert [(x["approved"], x["refusal"], x["approver"], x["training_frozen"]) for x in borrows] == [
        (0, "not_on_allow_list", "mallory", 1)]
    line = borrows[0]["line"]
    row = next(r for r in ledger.table(0) if r.line_item == line)
    assert row.borrowed_epsilon == 0.0 and row.spent_epsilon <= 1.5 + 1e-12
    # training backed off: round 1 (ledger round 0) was charged before the gate, round 2 not
    training = [e for e in ledger.entries() if e["line"] == "training"]
    assert [e["round"] for e in training] == [0]
    assert any(d["kind"] == "charge_refused" and d["detail"]["reason"] == "training_frozen"
               for d in ledger.decisions())


def test_approve_command_errors(two_runs):
    assert two_runs["bad_id"].returncode == 2
    assert "not a flow run id" in two_runs["bad_id"].stderr
    again = two_runs["again"]  # the run is no longer paused
    assert again.returncode == 2 and "not paused" in again.stderr
    print(f"seconds to both paused: {two_runs['seconds_to_pause']:.1f}, "
          f"total: {two_runs['seconds']:.1f}")
