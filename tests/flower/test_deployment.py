"""Real clients on Flower's deployment engine (not the simulation runtime): a
flower-superlink and six flower-supernode processes on 127.0.0.1, started and stopped with
infra/flower-local.sh, and `clma run` with the flower transport.

1. The local config (clma/configs/flower_local.toml) completes over the script's
   deployment and summary.json says "transport": "flower".
2. The same federation with seeded noise: the Prefect flow run shows the named tasks,
   MLflow has the federation run with nested cohort runs, the ledger holds each release
   once, and cohorts, published reports and envelopes equal the in-process simulation's.
3. A SuperNode is stopped during round 2's secure aggregation (after the key shares): the
   round completes with the survivors, secure aggregation recovers their sum; the
   orchestrating ServerApp is SIGKILLed in round 4 and the federation resumed: no client
   exchange of a committed step is sent again, nothing is charged twice.
`stop` leaves no process behind. Everything binds 127.0.0.1, with temporary Flower,
Prefect and MLflow homes.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clma.config import load_config, validate_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "infra" / "flower-local.sh"
LOCAL = ROOT / "clma" / "configs" / "flower_local.toml"
CLMA = str(Path(sys.executable).with_name("clma"))
VENV = str(Path(sys.executable).parents[1])

pytestmark = [pytest.mark.slow, pytest.mark.server]

TASKS = {"select-clients", "train-clients", "detect-drift", "score-divergence",
         "aggregate-per-cohort", "cohort", "merge-cohorts", "secure-aggregation",
         "charge-evaluation", "release-evaluation"}


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(n: int, start: int) -> int:
    """The first port p >= start with p .. p + n - 1 free."""
    p = start
    while not all(_free(p + i) for i in range(n)):
        p += n
    return p


def _tree(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        a, b = (int(x) for x in line.split())
        children.setdefault(b, []).append(a)
    seen, todo = {pid}, [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in seen:
                seen.add(c)
                todo.append(c)
    return seen


def _alive(pids: set[int]) -> set[int]:
    """Pids still running (zombies, already dead, do not count)."""
    out = set()
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(p)
    return out


def _leftovers(marker: str) -> set[int]:
    """Live processes started for this test: their environment names the test's folder."""
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if marker.encode() in (d / "environ").read_bytes() and _alive({int(d.name)}):
                out.add(int(d.name))
        except OSError:
            continue
    return out


class Deployment:
    """infra/flower-local.sh on free loopback ports, in a temporary run folder."""

    def __init__(self, run: Path, port: int, node_port: int, n: int = 6) -> None:
        self.run, self.port, self.node_port, self.n = run, port, node_port, n
        self.env = dict(os.environ, CLMA_FLOWER_DIR=str(run), CLMA_FLOWER_PORT=str(port),
                        CLMA_FLOWER_NODE_PORT=str(node_port), CLMA_VENV=VENV,
                        CLMA_START_TIMEOUT="240")
        self.superlink = f"127.0.0.1:{port}"

    def script(self, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
        return subprocess.run([str(SCRIPT), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def pids(self) -> set[int]:
        out: set[int] = set()
        for f in self.run.glob("*.pid"):
            out |= _tree(int(f.read_text()))
        return out

    def start(self) -> None:
        r = self.script("start", str(self.n))
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"{self.n} SuperNodes connected" in r.stdout

    def stop(self) -> set[int]:
        """Stop everything; the processes still alive that were running, or that carry the
        run folder in their environment (every process the deployment started)."""
        before = self.pids()
        r = self.script("stop", timeout=200)
        assert r.returncode == 0, r.stdout + r.stderr
        time.sleep(1)
        return _alive(before) | _leftovers(str(self.run))


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PREFECT_API_URL", None)
    env.update(PREFECT_HOME=str(tmp / "prefect-home"),
               MLFLOW_TRACKING_URI=f"sqlite:///{tmp / 'mlflow.db'}",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
               PREFECT_LOGGING_LEVEL="WARNING", PREFECT_SERVER_LOGGING_LEVEL="CRITICAL",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="true",
               FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1", **extra)
    return env


def _config(tmp: Path, name: str, superlink: str, flower: dict | None = None,
            **sections: dict) -> Path:
    """flower_local.toml with the test's SuperLink and the given section overrides."""
    data = load_config(LOCAL).model_dump(mode="json")
    data["federation"]["flower"]["superlink"] = superlink
    data["federation"]["flower"].update(flower or {})
    for sec, over in sections.items():
        data[sec].update(over)
    cfg = validate_config(data)
    p = tmp / f"{name}.json"
    p.write_text(cfg.model_dump_json())
    return p


def _toml(json_path: Path) -> Path:
    """A TOML file of a JSON config (clma run reads TOML)."""
    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        return repr(v)

    data = json.loads(json_path.read_text())
    lines: list[str] = []

    def table(prefix: str, d: dict) -> None:
        scalars = {k: v for k, v in d.items() if not isinstance(v, dict) and v is not None
                   and not (isinstance(v, list) and v and isinstance(v[0], dict))}
        if prefix:
            lines.append(f"[{prefix}]")
        lines.extend(f"{k} = {val(v)}" for k, v in scalars.items())
        for k, v in d.items():
            if isinstance(v, list) and v and isinstance(v[0], dict):
                for item in v:
                    lines.append(f"[[{prefix + '.' if prefix else ''}{k}]]")
                    lines.extend(f"{a} = {val(b)}" for a, b in item.items() if b is not None)
        for k, v in d.items():
            if isinstance(v, dict):
                table(f"{prefix + '.' if prefix else ''}{k}", v)

    table("", data)
    out = json_path.with_suffix(".toml")
    out.write_text("\n".join(lines) + "\n")
    assert load_config(out) == validate_config(data)
    return out


def _clma(args: list[str], env: dict[str, str], log: Path, timeout: float = 1500
          ) -> subprocess.CompletedProcess:
    with open(log, "ab") as f:
        r = subprocess.run([CLMA, *args], env=env, stdout=subprocess.PIPE, stderr=f,
                           timeout=timeout, cwd=str(log.parent))
    return r


def _progress(state: Path) -> list[dict]:
    p = state / "flower" / "progress.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


# ------------------------------------------------------------------ 1 + 2: one deployment
@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flower-deploy")
    port = 9093 if _free(9093) and all(_free(9110 + i) for i in range(6)) else _free_ports(1, 9600)
    d = Deployment(tmp / "run", port, _free_ports(6, 9110 if port == 9093 else 9620))
    t0 = time.perf_counter()
    d.start()
    d.started_in = time.perf_counter() - t0
    yield d
    left = d.stop()
    assert not left, f"processes left after stop: {sorted(left)}"


@pytest.fixture(scope="module")
def seeded_run(deployment, tmp_path_factory):
    """clma run, seeded noise, durable state, MLflow and Prefect in temporary homes."""
    tmp = tmp_path_factory.mktemp("seeded")
    cfg = _toml(_config(tmp, "seeded", deployment.superlink,
                        evaluation={"noise_seeded": True},
                        testing={"allow_seeded_noise_not_private": True}))
    t0 = time.perf_counter()
    r = _clma(["run", "--config", str(cfg), "--out", str(tmp / "out"), "--state-dir",
               str(tmp / "state"), "--quiet"], _env(tmp), tmp / "clma.log")
    seconds = time.perf_counter() - t0
    assert r.returncode == 0, (tmp / "clma.log").read_text()[-4000:]
    summary = json.loads((tmp / "out" / "summary.json").read_text())
    return {"tmp": tmp, "config": load_config(cfg), "summary": summary, "seconds": seconds,
            "stdout": r.stdout.decode()}


@pytest.fixture(scope="module")
def simulation(seeded_run, tmp_path_factory):
    """The same federation in process (simulated clients), bare engine, own ledger."""
    import torch

    from clma.engine import FederationEngine, open_budget
    from clma.sim.clients import SimulatedClients
    from clma.sim.federation import build_federation

    torch.set_num_threads(1)
    data = seeded_run["config"].model_dump()
    data["federation"] = {"transport": "simulation"}
    data["budget"]["state_dir"] = str(tmp_path_factory.mktemp("sim-ledger"))
    cfg = validate_config(data)
    fed = build_federation(cfg)
    eng = FederationEngine(cfg, fed.assets(), SimulatedClients(fed), budget=open_budget(cfg))
    return eng, [eng.run_round(r) for r in range(1, cfg.rounds + 1)]


def test_the_local_config_completes_over_the_script_deployment(deployment, tmp_path):
    cfg = LOCAL
    if deployment.superlink != "127.0.0.1:9093":  # the default port was taken here
        cfg = _toml(_config(tmp_path, "local", deployment.superlink))
    t0 = time.perf_counter()
    r = _clma(["run", "--config", str(cfg), "--out", str(tmp_path / "out")], _env(tmp_path),
              tmp_path / "clma.log")
    seconds = time.perf_counter() - t0
    assert r.returncode == 0, (tmp_path / "clma.log").read_text()[-4000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["federation"]["transport"] == "flower"
    assert summary["federation"]["executor"] == "flower-deployment"
    run_id = summary["federation"]["transport_details"]["flower_run_id"]
    assert f"Flower run: {run_id}" in " ".join(r.stdout.decode().split())
    assert [x["round"] for x in summary["rounds"]] == [1, 2, 3, 4]
    # the families separated: three cohorts, published as bands (schema clma.summary/2)
    assert summary["schema"] == "clma.summary/2" and len(summary["final_cohorts"]) == 3
    assert summary["sim_truth"] is None  # real clients: no ground truth
    print(f"\n[timing] local config over the script deployment: {seconds:.0f} s "
          f"(deployment started in {deployment.started_in:.0f} s)")


def test_named_prefect_tasks_mlflow_lineage_and_the_ledger(seeded_run):
    tmp, summary = seeded_run["tmp"], seeded_run["summary"]
    assert summary["federation"]["transport"] == "flower"
    with sqlite3.connect(tmp / "prefect-home" / "prefect.db") as con:
        tasks = {n.rsplit("-", 1)[0] for (n,) in con.execute("select name from task_run")}
        flows = {n for (n,) in con.execute("select name from flow_run")}
        states = {s for (s,) in con.execute("select state_type from flow_run")}
    assert TASKS <= tasks
    name = summary["federation"]["name"]  # round runs are named <federation>-round-<r>
    assert {f"{name}-round-{r}" for r in (1, 2, 3, 4)} <= flows and states == {"COMPLETED"}
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    run = client.get_run(summary["mlflow"]["run_id"])
    assert run.data.tags["clma.transport"] == "flower"
    kids = client.search_runs([run.info.experiment_id],
                              filter_string=f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    assert {k.data.tags.get("clma.cohort.id") for k in kids} >= {"0", "1", "2"}
    from clma.budget import PrivacyLedger, load_policy

    ledger = PrivacyLedger(tmp / "state" / "ledger", load_policy("simulation_policy_v3.toml"))
    keys = [(e["epoch"], e["round"], e["release"]) for e in ledger.entries()]
    assert keys and len(keys) == len(set(keys))
    assert {e["status"] for e in ledger.entries()} == {"committed"}
    print(f"\n[timing] seeded federation over 6 SuperNodes: {seeded_run['seconds']:.0f} s")


def test_cohorts_and_published_values_equal_the_in_process_simulation(seeded_run, simulation):
    from clma.release import count_band

    eng, results = simulation
    m = eng.evaluator.min_cohort
    summary, out = seeded_run["summary"], seeded_run["tmp"] / "out"
    for rec, res in zip(summary["rounds"], results, strict=True):
        assert rec["cohorts"] == {str(k): count_band(v, m) for k, v in sorted(res.cohorts.items())}
        assert rec["regional"] == json.loads(json.dumps(res.regional))
        if res.evaluation is not None:
            for rel, text in res.evaluation.envelopes.items():
                assert (out / "envelopes" / f"round_{res.round:03d}" / rel).read_text() == text
    assert summary["rounds"][3]["regional"]["metrics"]["accuracy"]["global"]["noise_source"] \
        == "seeded-simulation"
    assert summary["final_cohorts"] == {str(c): count_band(len(eng.state.registry.members(c)), m)
                                        for c in eng.state.registry.active_cohorts()}
    from clma.budget import PrivacyLedger, load_policy

    ledger = PrivacyLedger(seeded_run["tmp"] / "state" / "ledger",
                           load_policy("simulation_policy_v3.toml"))
    assert [(e["round"], e["release"], e["status"]) for e in ledger.entries()] == [
        (e["round"], e["release"], e["status"]) for e in eng.budget.ledger.entries()]


# ------------------------------------------------------------------ 3: failures
def test_a_node_lost_mid_round_and_a_killed_orchestrator_resume_without_repeats(
        tmp_path_factory):
    tmp = tmp_path_factory.mktemp("failures")
    port = _free_ports(1, 9700)
    d = Deployment(tmp / "run", port, _free_ports(6, port + 20))
    t0 = time.perf_counter()
    d.start()
    try:
        # a lost node is noticed by the SuperLink (heartbeat) or by the exchange timeout; the
        # resumed run waits at most 30 s for the six nodes of the roster
        cfg = _toml(_config(tmp, "failures", d.superlink, flower={"connect_timeout_seconds": 30.0},
                            evaluation={"noise_seeded": True},
                            testing={"allow_seeded_noise_not_private": True}))
        state, out = tmp / "state", tmp / "out"
        env = _env(tmp, CLMA_FLOWER_FAILPOINT="pause:2:secagg_share_keys,"
                                              "kill:4:secagg_share_keys")
        log = tmp / "clma.log"
        proc = subprocess.Popen([CLMA, "run", "--config", str(cfg), "--out", str(out),
                                 "--state-dir", str(state), "--quiet"], env=env,
                                stdout=subprocess.PIPE, stderr=open(log, "ab"), cwd=str(tmp))
        marker = state / "flower" / "failpoint-2-secagg_share_keys.paused"
        deadline = time.monotonic() + 900
        while not marker.exists():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "round 2 never reached its key shares"
            time.sleep(1)
        r = d.script("stop-node", "5")  # client 5 leaves after sharing its keys
        assert r.returncode == 0, r.stdout + r.stderr
        marker.unlink()
        rc = proc.wait(timeout=1800)  # the ServerApp kills itself in round 4
        assert rc == 1, log.read_text()[-3000:]
        first = _progress(state)
        killed_run = first[-1]["flower_run_id"]
        committed = {(x["round"], x["call"]) for x in first if x["status"] == "sent"}
        assert (4, "secagg_share_keys") in committed and (4, "secagg_masked_input") not in committed
        # resume: a new orchestrating process, a new Flower run
        r = _clma(["run", "--resume", str(state), "--out", str(out), "--quiet"], _env(tmp), log)
        assert r.returncode == 0, log.read_text()[-4000:]
        seconds = time.perf_counter() - t0
    finally:
        left = d.stop()
    assert not left, f"processes left after stop: {sorted(left)}"
    lines = _progress(state)
    runs = [json.loads(x)["flower_run_id"] for x in
            (state / "flower" / "runs.jsonl").read_text().splitlines()]
    assert len(runs) == 2 and runs[0] == killed_run != runs[1]
    second = [x for x in lines if x["flower_run_id"] == runs[1]]
    # no exchange of a committed step sent again: round 4's training, advertising and key
    # sharing are answered from the journal; the rest of round 4 is sent once
    for call in ("train", "secagg_advertise", "secagg_share_keys"):
        got = [x["status"] for x in second if x["round"] == 4 and x["call"] == call]
        assert got == ["replayed"], (call, got)
    for call in ("secagg_masked_input", "secagg_unmask"):
        assert [x["status"] for x in second if x["round"] == 4 and x["call"] == call] == ["sent"]
    # round 2: node 5 dropped after its key shares, the survivors' sum was recovered
    masked2 = [x for x in lines if x["round"] == 2 and x["call"] == "secagg_masked_input"]
    assert [(x["ok"], x["failed"]) for x in masked2] == [(5, 1)]
    summary = json.loads((out / "summary.json").read_text())
    assert [x["round"] for x in summary["rounds"]] == [1, 2, 3, 4]
    rep2 = summary["rounds"][1]["regional"]
    acc = rep2["metrics"]["accuracy"]["global"]
    assert acc is not None and acc["participant_band"] == "minimum_to_under_double"
    health = rep2["health"]["health.dropout_rate"]["global"]
    assert health["band"] in ("under_5pct", "5_to_under_20pct", "20pct_or_more")
    assert "dropped" not in json.dumps(rep2)  # the dropout only as the coarsened health band
    from clma.budget import PrivacyLedger, load_policy

    ledger = PrivacyLedger(state / "ledger", load_policy("simulation_policy_v3.toml"))
    keys = [(e["epoch"], e["round"], e["release"]) for e in ledger.entries()]
    assert keys and len(keys) == len(set(keys))  # nothing charged twice
    print(f"\n[timing] node loss + orchestrator kill + resume: {seconds:.0f} s")


def test_tls_certificates_from_the_script_serve_a_verified_deployment(tmp_path):
    port = _free_ports(1, 9800)
    d = Deployment(tmp_path / "run", port, _free_ports(1, port + 20), n=1)
    r = d.script("certs", str(tmp_path / "tls"))
    assert r.returncode == 0 and (tmp_path / "tls" / "ca.crt").exists(), r.stderr
    d.env["CLMA_FLOWER_TLS"] = str(tmp_path / "tls")
    d.start()
    try:
        home = tmp_path / "cli"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "t"\n[superlink.t]\naddress = "{d.superlink}"\n'
            f'insecure = false\nroot-certificates = "{tmp_path / "tls" / "ca.crt"}"\n')
        flwr = str(Path(sys.executable).with_name("flwr"))
        env = dict(os.environ, FLWR_HOME=str(home), FLWR_TELEMETRY_ENABLED="0",
                   FLWR_DISABLE_UPDATE_CHECK="1")
        ls = subprocess.run([flwr, "ls", "t", "--format", "json"], env=env, capture_output=True,
                            text=True, timeout=120)
        assert json.loads(ls.stdout[ls.stdout.index("{"):])["success"] is True
        (home / "config.toml").write_text(  # an unverified client is refused
            f'[superlink]\ndefault = "t"\n[superlink.t]\naddress = "{d.superlink}"\n'
            'insecure = false\n')
        bad = subprocess.run([flwr, "ls", "t", "--format", "json"], env=env,
                             capture_output=True, text=True, timeout=120)
        assert '"success": true' not in bad.stdout
    finally:
        left = d.stop()
    assert not left
