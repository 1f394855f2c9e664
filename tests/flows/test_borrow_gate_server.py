"""End to end through authenticated servers: a federation that overspends its evaluation
lines pauses at the borrow-approval gate once per budget epoch, and each pause is answered
with a signed token, from the CLI or through Prefect's resume API with the form's input
(what the UI sends).

One federation, five rounds, one round per budget epoch, against a Prefect server with
basic authentication and an MLflow basic-auth server (operator account), both started with
the infra scripts (tests/flows/conftest.py). Keys come from ``clma keygen``; the policy lists
privacy-officer's and dpo-deputy's public keys.

======  ======================================================  ==============================
epoch   answer                                                  recorded
======  ======================================================  ==============================
0       CLI, privacy-officer's key (right after the pause msg)  approved, privacy-officer's key id
1       CLI, privacy-officer's name, another key (forged)       approver_key_unknown
2       UI, dpo-deputy's token from ``--token-only``            approved, dpo-deputy's key id
3       UI, dpo-deputy's token with the amount altered          approval_signature_invalid
4       UI, epoch 0's accepted token again (replayed)           approval_token_replayed
======  ======================================================  ==============================

Then: no private key and no server password in the federation's log, the Prefect server's
log, the Prefect API's logs and artifacts, or the MLflow server's store and artifacts.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.server, pytest.mark.slow]

ROOT = Path(__file__).parents[2]
CLMA = [sys.executable, "-m", "flows.cli"]
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
ROUNDS = 5

CONFIG = """
name = "borrow-signed"
seed = 1
rounds = {rounds}
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
approval_timeout_seconds = 150
approval_poll_seconds = 1.0
"""


def write_policy(tmp: Path, entries: str, *, epsilon_cap: float, epoch_rounds: int,
                 cadence: int) -> Path:
    """The shipped policy with another cap, epoch length and cadence, and ``entries``."""
    text = (ROOT / "clma" / "policy" / "privacy_policy_v3.toml").read_text()
    for key, value in (("epsilon_per_client_per_epoch", repr(epsilon_cap)),
                       ("epoch_length_rounds", str(epoch_rounds)),
                       ("regional_cadence_rounds", str(cadence))):
        text = re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
    text = text.replace('"clma-privacy-policy-v3"', '"clma-privacy-policy-test"')
    p = tmp / "policy.toml"
    p.write_text(text + "\n" + entries)
    return p


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


class Api:
    """The authenticated Prefect API, as the browser (or curl) would call it."""

    def __init__(self, server) -> None:
        self.url, self.auth = server.api, server.basic_auth

    def get(self, path: str):
        r = httpx.get(f"{self.url}{path}", auth=self.auth, timeout=15)
        r.raise_for_status()
        return r.json()

    def post(self, path: str, body: dict):
        r = httpx.post(f"{self.url}{path}", json=body, auth=self.auth, timeout=15)
        r.raise_for_status()
        return r.json()

    def form_saved(self, run_id: str) -> bool:
        run = self.get(f"/flow_runs/{run_id}")
        keyset = (run["state"] or {}).get("state_details", {}).get("run_input_keyset")
        if run["state"]["type"] != "PAUSED" or not keyset:
            return False
        r = httpx.get(f"{self.url}/flow_runs/{run_id}/input/{keyset['schema']}", auth=self.auth,
                      timeout=15)
        return r.status_code == 200

    def resume_as_ui(self, run_id: str, run_input: dict) -> dict:
        """POST /flow_runs/<id>/resume with the form's input, as the UI's Submit does."""
        return self.post(f"/flow_runs/{run_id}/resume", {"run_input": run_input})


def _keygen(tmp: Path, name: str, out: str) -> tuple[Path, str]:
    r = subprocess.run([*CLMA, "keygen", "--approver", name, "--out", str(tmp / out)],
                       capture_output=True, text=True, timeout=120, cwd=tmp)
    assert r.returncode == 0, r.stderr
    return tmp / out, r.stdout


def _next_pause(proc, err: Path, seen: set[str], timeout: float = 240) -> str:
    """The next paused approval run's id, from the gate's message on stderr."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ids = re.findall(rf"borrow request paused, flow run ({UUID})", err.read_text(errors="replace"))
        new = [i for i in ids if i not in seen]
        if new:
            seen.add(new[0])
            return new[0]
        assert proc.poll() is None, err.read_text()[-3000:]
        time.sleep(0.5)
    raise AssertionError("the federation did not pause:\n" + err.read_text()[-3000:])


def _wait_form(api: Api, run_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not api.form_saved(run_id):
        assert time.monotonic() < deadline, f"run {run_id} never showed its form"
        time.sleep(0.5)


def _alter_epsilon(token: str, epsilon: float) -> str:
    """The token with its signed amount replaced (the signature left as it was)."""
    prefix, claims, sig = token.split(".")
    data = base64.urlsafe_b64decode(claims + "=" * (-len(claims) % 4))
    new = re.sub(rb"\nepsilon:\d+:[^\n]*\n",
                 b"\nepsilon:%d:%s\n" % (len(repr(epsilon)), repr(epsilon).encode()), data)
    assert new != data
    return ".".join([prefix, base64.urlsafe_b64encode(new).rstrip(b"=").decode(), sig])


@pytest.fixture(scope="module")
def signed_gate(auth_prefect_server, auth_mlflow_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("signed-gate")
    t0 = time.monotonic()
    po_key, po_entry = _keygen(tmp, "privacy-officer", "keys/privacy-officer.pem")
    dd_key, dd_entry = _keygen(tmp, "dpo-deputy", "keys/dpo-deputy.pem")
    mallory_key, _ = _keygen(tmp, "privacy-officer", "mallory/privacy-officer.pem")  # not listed
    # cap 10: each evaluation line holds 1.5, one release at epsilon 1, not two
    policy = write_policy(tmp, po_entry + "\n" + dd_entry, epsilon_cap=10.0, epoch_rounds=1,
                          cadence=1)
    state = tmp / "state"
    cfg = tmp / "fed.toml"
    cfg.write_text(CONFIG.format(rounds=ROUNDS, state=state, policy=policy))
    api = Api(auth_prefect_server)
    user, password = auth_mlflow_server.operator
    env = {**os.environ, "PREFECT_API_URL": auth_prefect_server.api,
           "PREFECT_API_AUTH_STRING": auth_prefect_server.auth_string,
           "PREFECT_HOME": str(tmp / "prefect-home"), "PREFECT_LOGGING_LEVEL": "WARNING",
           "MLFLOW_TRACKING_URI": auth_mlflow_server.url,
           "MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password}
    no_auth = {k: v for k, v in env.items() if k != "PREFECT_API_AUTH_STRING"}

    def clma(*args, environ=env):
        return subprocess.run([*CLMA, *args], cwd=tmp, env=environ, capture_output=True,
                              text=True, timeout=180)

    err = tmp / "federation.stderr"
    proc = subprocess.Popen(
        [*CLMA, "run", "--config", str(cfg), "--out", str(tmp / "out"), "--quiet"],
        cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=open(err, "wb"),
        start_new_session=True)
    seen: set[str] = set()
    out: dict = {"tmp": tmp, "policy": policy, "state": state, "api": api, "err": err,
                 "keys": {"po": po_key, "dd": dd_key, "mallory": mallory_key}}
    try:
        # epoch 0: the CLI right after the gate's message (it waits for the pause), first
        # without the Prefect auth string
        run0 = _next_pause(proc, err, seen)
        out["seconds_to_first_pause"] = time.monotonic() - t0
        out["unauthenticated"] = clma("approve", run0, "--approver", "privacy-officer", "--key",
                                      str(po_key), "--reason", "quarterly review",
                                      "--wait", "5", environ=no_auth)
        out["cli_ok"] = clma("approve", run0, "--approver", "privacy-officer", "--key",
                             str(po_key), "--reason", "quarterly review")
        accepted = clma("approve", run0, "--approver", "privacy-officer", "--key", str(po_key),
                        "--reason", "quarterly review", "--token-only", "--wait", "0")
        out["after_resume"] = accepted  # run0 is no longer paused
        # epoch 1: forged with the CLI (privacy-officer's name, mallory's key)
        run1 = _next_pause(proc, err, seen)
        out["cli_forged"] = clma("approve", run1, "--approver", "privacy-officer", "--key",
                                 str(mallory_key), "--reason", "let me in")
        # epoch 2: the UI path, correctly signed by dpo-deputy
        run2 = _next_pause(proc, err, seen)
        tok = clma("approve", run2, "--approver", "dpo-deputy", "--key", str(dd_key),
                   "--reason", "needed for the regional alert", "--token-only")
        assert tok.returncode == 0, tok.stderr
        out["token_only"] = tok
        _wait_form(api, run2)
        out["ui_ok"] = api.resume_as_ui(run2, {
            "approver": "dpo-deputy", "approve": True,
            "reason": "needed for the regional alert", "token": tok.stdout.strip()})
        # epoch 3: the UI path, a genuine token with its amount altered
        run3 = _next_pause(proc, err, seen)
        tok3 = clma("approve", run3, "--approver", "dpo-deputy", "--key", str(dd_key),
                    "--reason", "small top-up", "--token-only")
        assert tok3.returncode == 0, tok3.stderr
        requested = api.get(f"/flow_runs/{run3}")["parameters"]["request"]["epsilon"]
        _wait_form(api, run3)
        out["ui_altered"] = api.resume_as_ui(run3, {
            "approver": "dpo-deputy", "approve": True, "reason": "small top-up",
            "token": _alter_epsilon(tok3.stdout.strip(), requested * 2)})
        # epoch 4: the UI path, epoch 0's accepted token replayed
        run4 = _next_pause(proc, err, seen)
        _wait_form(api, run4)
        epoch0_token = _ledger(state, policy).borrows(0)[0]["approval_token"]
        out["ui_replayed"] = api.resume_as_ui(run4, {
            "approver": "privacy-officer", "approve": True, "reason": "quarterly review",
            "token": epoch0_token})
        proc.wait(300)
        out["runs"] = [run0, run1, run2, run3, run4]
    finally:
        _stop(proc)
    out["returncode"] = proc.returncode
    out["seconds"] = time.monotonic() - t0
    return out


def _ledger(state: Path, policy: Path):
    from clma.budget import PrivacyLedger, load_policy

    return PrivacyLedger(state, load_policy(policy))


def _key_id(key: Path) -> str:
    from clma.budget.approval_token import load_private_key

    return load_private_key(key)[1]


def test_the_federation_completes_and_every_decision_is_recorded(signed_gate):
    g = signed_gate
    assert g["returncode"] == 0, g["err"].read_text()[-3000:]
    borrows = _ledger(g["state"], g["policy"]).borrows()
    po, dd = _key_id(g["keys"]["po"]), _key_id(g["keys"]["dd"])
    got = [(b["epoch"], b["approved"], b["refusal"], b["approver"], b["approver_key_id"])
           for b in borrows]
    assert got == [
        (0, 1, None, "privacy-officer", po),
        (1, 0, "approver_key_unknown", "privacy-officer", None),
        (2, 1, None, "dpo-deputy", dd),
        (3, 0, "approval_signature_invalid", "dpo-deputy", None),
        (4, 0, "approval_token_replayed", "privacy-officer", None),
    ]
    details = [b["refusal_detail"] for b in borrows]
    assert details[0] == details[2] == ""
    assert details[1].startswith(f"key_id: {_key_id(g['keys']['mallory'])} is not a key of "
                                 "'privacy-officer'")
    assert details[3].startswith(f"signature: does not verify with {dd}")
    assert details[4].startswith("nonce: the token was signed for another request")
    assert [b["approver_reason"] for b in borrows][:3] == [
        "quarterly review", "let me in", "needed for the regional alert"]
    assert len({b["request_nonce"] for b in borrows}) == ROUNDS  # a fresh nonce per request
    assert all(b["policy_version"] == "clma-privacy-policy-test" for b in borrows)
    # accepted borrows were spent, refused epochs froze training
    ledger = _ledger(g["state"], g["policy"])
    for b in borrows:
        rows = {r.line_item: r for r in ledger.table(b["epoch"])}
        assert rows["training"].training_frozen == (not b["approved"])
        if b["approved"]:
            assert rows[b["line"]].borrowed_epsilon == pytest.approx(b["epsilon"])
    print(f"seconds to the first pause: {g['seconds_to_first_pause']:.1f}, "
          f"total: {g['seconds']:.1f}")


def test_the_cli_and_the_ui_path_answers(signed_gate):
    g = signed_gate
    ok = g["cli_ok"]
    assert ok.returncode == 0, ok.stderr
    res = json.loads(ok.stdout)
    assert (res["resumed"], res["approver"], res["approve"], res["key_id"]) == (
        g["runs"][0], "privacy-officer", True, _key_id(g["keys"]["po"]))
    assert "signed with ed25519:" in ok.stderr and "nonce" in ok.stderr
    # the forged answer resumed the run (the CLI cannot know the key is not listed) ...
    assert g["cli_forged"].returncode == 0, g["cli_forged"].stderr
    # ... and the UI path's answers were accepted by the server; the flow decided
    for name in ("ui_ok", "ui_altered", "ui_replayed"):
        assert g[name]["status"] == "ACCEPT", (name, g[name])
    assert g["token_only"].stdout.startswith("clma-approval-v1.")
    assert "in the Prefect UI" in g["token_only"].stderr
    again = g["after_resume"]
    assert again.returncode == 2 and "is not paused (state: " in again.stderr


def test_a_client_without_the_prefect_auth_string_is_told_so(signed_gate):
    r = signed_gate["unauthenticated"]
    assert r.returncode == 2
    assert "refused the request (401)" in r.stderr and "PREFECT_API_AUTH_STRING" in r.stderr


def test_decisions_reach_mlflow_through_the_operator_account(signed_gate, auth_mlflow_server,
                                                             monkeypatch):
    from mlflow import MlflowClient

    g = signed_gate
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", auth_mlflow_server.reader[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", auth_mlflow_server.reader[1])
    summary = json.loads((g["tmp"] / "out" / "summary.json").read_text())
    client = MlflowClient(tracking_uri=auth_mlflow_server.url)  # read as the reader
    run = client.get_run(summary["mlflow"]["run_id"])
    tags = run.data.tags
    assert tags["clma.policy.version"] == "clma-privacy-policy-test"
    first = _ledger(g["state"], g["policy"]).borrows(0)[0]
    key = f"clma.budget.borrow.e0.{first['line']}"
    assert (tags[f"{key}.approver"], tags[f"{key}.approver_key_id"]) == (
        "privacy-officer", _key_id(g["keys"]["po"]))
    decisions = [v for k, v in tags.items() if k.endswith(".decision")]
    assert sorted(decisions) == sorted(["approved", "approved", "refused:approver_key_unknown",
                                        "refused:approval_signature_invalid",
                                        "refused:approval_token_replayed"])
    doc = json.loads(Path(client.download_artifacts(run.info.run_id, "budget/decisions.json",
                                                    str(g["tmp"] / "dl"))).read_text())
    assert [b["refusal"] for b in doc["borrows"]] == [
        None, "approver_key_unknown", None, "approval_signature_invalid",
        "approval_token_replayed"]
    assert doc["borrows"][0]["approver_key_id"] == _key_id(g["keys"]["po"])
    refused = [d for d in doc["ledger_decisions"] if d["kind"] == "borrow_refused"]
    assert [d["detail"]["refusal"] for d in refused] == [
        "approver_key_unknown", "approval_signature_invalid", "approval_token_replayed"]


def _secrets(g, auth_prefect_server, auth_mlflow_server) -> dict[str, bytes]:
    """Every spelling of the private keys and the server passwords a leak could take."""
    from cryptography.hazmat.primitives import serialization

    from clma.budget.approval_token import load_private_key

    out: dict[str, bytes] = {}
    for name, path in g["keys"].items():
        key, _ = load_private_key(path)
        raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                serialization.NoEncryption())
        pem_lines = path.read_text().splitlines()[1:-1]
        out[f"{name} raw hex"] = raw.hex().encode()
        out[f"{name} raw b64"] = base64.b64encode(raw).rstrip(b"=")
        out[f"{name} raw b64url"] = base64.urlsafe_b64encode(raw).rstrip(b"=")
        out[f"{name} pem body"] = pem_lines[0].encode()
    out["prefect password"] = auth_prefect_server.basic_auth[1].encode()
    for role in ("admin", "operator", "reader"):
        out[f"mlflow {role} password"] = getattr(auth_mlflow_server, role)[1].encode()
    return out


def _files(*folders: Path):
    for folder in folders:
        for p in folder.rglob("*"):
            if p.is_file():
                yield p


def test_no_key_or_password_in_logs_mlflow_or_prefect_artifacts(signed_gate, auth_prefect_server,
                                                                 auth_mlflow_server):
    g = signed_gate
    secrets = _secrets(g, auth_prefect_server, auth_mlflow_server)
    api = g["api"]
    logs, offset = [], 0
    while True:
        page = api.post("/logs/filter", {"limit": 200, "offset": offset})
        logs += page
        offset += len(page)
        if len(page) < 200:
            break
    artifacts = api.post("/artifacts/filter", {"limit": 200})
    assert logs and artifacts  # there is something to scan
    texts = {"prefect api logs": json.dumps(logs).encode(),
             "prefect api artifacts": json.dumps(artifacts).encode(),
             "federation stderr": g["err"].read_bytes()}
    for p in _files(auth_prefect_server.infra_dir, auth_mlflow_server.infra_dir,
                    g["state"], g["tmp"] / "out"):
        if p.name == "secrets.env":
            continue  # where the server secrets live, by design (mode 0600)
        texts[str(p)] = p.read_bytes()
    leaks = [(what, where) for what, s in secrets.items() for where, t in texts.items() if s in t]
    assert leaks == []
    assert any("mlflow.db" in k for k in texts) and any("/artifacts/" in k for k in texts)
