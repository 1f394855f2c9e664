"""Durable federation state end to end: a federation process is killed twice (SIGKILL),
once after a round was logged but before its commit and once in the middle of a round, and
resumed each time; cohort history, ledger and MLflow run must equal an uninterrupted run
of the same config, with every round exactly once and no budget charged twice. The
simulated devices keep their detector state in their own folder, ``<state_dir>.devices``,
which the resumed runs find again: the re-asked rounds give the same flags."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from clma.config import load_config

TINY = Path(__file__).with_name("durable_tiny.toml")
CLMA = str(Path(sys.executable).with_name("clma"))

pytestmark = pytest.mark.slow


def _env(tmp: Path, uri: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PREFECT_API_URL", None)
    env.update(PREFECT_HOME=str(tmp / "prefect-home"), MLFLOW_TRACKING_URI=uri,
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
               PREFECT_LOGGING_LEVEL="WARNING", PREFECT_SERVER_LOGGING_LEVEL="CRITICAL",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="true", **extra)
    return env


def _committed(state: Path) -> int | None:
    from clma.state import StateStore

    snap = StateStore(state).load()
    return None if snap is None else snap.round


def _started(state: Path) -> int | None:
    try:
        return json.loads((state / "progress.json").read_text())["started_round"]
    except (OSError, ValueError, KeyError):
        return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory, prefect_harness):
    tmp = tmp_path_factory.mktemp("durable")
    uri = f"sqlite:///{tmp / 'crash.db'}"
    state, out = tmp / "state", tmp / "out"
    log = open(tmp / "clma.log", "ab")  # noqa: SIM115
    t0 = time.perf_counter()
    # 1. killed after round 2 was fully logged, before its commit (failpoint)
    # own session: the failpoint SIGKILLs only the clma process, so its temporary Prefect
    # API server (a child) is then stopped with the rest of the group, not left orphaned
    r1 = subprocess.Popen(
        [CLMA, "run", "--config", str(TINY), "--state-dir", str(state), "--out", str(out),
         "--quiet"], env=_env(tmp, uri, CLMA_FAILPOINT="kill-before-commit:2"),
        stdout=log, stderr=log, start_new_session=True)
    try:
        r1.wait(timeout=400)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(r1.pid, signal.SIGKILL)
    assert r1.returncode == -signal.SIGKILL
    assert _committed(state) == 1
    # 2. resumed, then SIGKILLed in the middle of round 3 (round 2 committed, 3 started)
    p2 = subprocess.Popen([CLMA, "run", "--resume", str(state), "--out", str(out), "--quiet"],
                          env=_env(tmp, uri), stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 400
    while not (_committed(state) == 2 and _started(state) == 3):
        assert p2.poll() is None, "the resumed run ended before round 3 started"
        assert time.monotonic() < deadline, "round 3 never started"
        time.sleep(0.05)
    os.killpg(p2.pid, signal.SIGKILL)
    p2.wait(timeout=60)
    assert _committed(state) == 2
    # 3. resumed to completion
    r3 = subprocess.run([CLMA, "run", "--resume", str(state), "--out", str(out), "--quiet"],
                        env=_env(tmp, uri), stdout=log, stderr=log, timeout=400)
    log.close()
    assert r3.returncode == 0, (tmp / "clma.log").read_text()[-3000:]
    crash_seconds = time.perf_counter() - t0
    # reference: the same federation, uninterrupted, in this process
    ref_uri = f"sqlite:///{tmp / 'ref.db'}"
    old = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = ref_uri
    try:
        from flows.federation import federation_flow

        ref = federation_flow(load_config(TINY), out_dir=str(tmp / "ref-out"),
                              state_dir=str(tmp / "ref-state"))
    finally:
        if old is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old
    summary = json.loads((out / "summary.json").read_text())
    print(f"crash+resume x2: {crash_seconds:.1f} s")
    return {"tmp": tmp, "state": state, "summary": summary, "uri": uri, "ref": ref,
            "ref_uri": ref_uri}


def _republished(rec):
    return ((rec["regional"] or {}).get("budget") or {}).get("republished") or []


def _published(rec):
    reg = rec["regional"] or {}
    return {k: reg.get(k) for k in ("metrics", "health", "alerts")}


def test_cohort_history_matches_uninterrupted_run(runs):
    s, ref = runs["summary"], runs["ref"]
    assert [r["round"] for r in s["rounds"]] == [1, 2, 3, 4]
    for a, b in zip(s["rounds"], ref["rounds"], strict=True):
        for k in ("cohorts", "flagged_clients", "quarantined_clients", "new_cohorts", "merges"):
            assert a[k] == b[k], (a["round"], k)
        # every round, the re-run round 2 included (its releases were republished from
        # the ledger, no noise drawn): the same published values, envelopes' inputs and
        # alert decisions as the uninterrupted run (seeded noise, so equal values)
        assert _published(a) == _published(b), a["round"]
        assert (a["regional"] is None) == (b["regional"] is None), a["round"]
    republished = next(a for a in s["rounds"] if _republished(a))["regional"]
    assert republished["metrics"]["accuracy"]["global"] is not None
    assert republished["health"]["health.dropout_rate"]["global"] is not None
    assert republished["refused_releases"] == []
    assert s["final_cohorts"] == ref["final_cohorts"]
    assert len(s["final_cohorts"]) == 3  # the drift at round 3 split off two cohorts
    assert s["sim_truth"]["ari_per_drift_event"] == {"3": 1.0}
    from clma.state import StateStore

    reg = StateStore(runs["state"]).load().json("registry.json")
    ref_reg = StateStore(runs["tmp"] / "ref-state").load().json("registry.json")
    assert reg == ref_reg
    assert [h["round"] for h in reg["history"]] == [1, 2, 3, 4]


def test_ledger_charged_each_release_once(runs):
    from clma.budget import PrivacyLedger, default_policy

    led = PrivacyLedger(runs["state"] / "ledger", default_policy())
    ref = PrivacyLedger(runs["tmp"] / "ref-state" / "ledger", default_policy())
    keys = [(e["epoch"], e["round"], e["release"]) for e in led.entries()]
    assert len(keys) == len(set(keys)) > 0
    assert sorted(keys) == sorted((e["epoch"], e["round"], e["release"]) for e in ref.entries())
    assert all(e["status"] == "committed" for e in led.entries())
    # round 2 was charged and released before the failpoint killed the process; its re-run
    # found every release committed in the ledger: republished, nothing charged or drawn
    rounds = {r["round"]: r for r in runs["summary"]["rounds"]}
    ledger_round_1 = sorted(e["release"] for e in led.entries() if e["round"] == 1)
    assert sorted(_republished(rounds[2])) == ledger_round_1
    assert all(_republished(rounds[r]) == [] for r in (1, 3, 4))
    spent = {(r.epoch, r.line_item): r.spent_epsilon for r in led.table()}
    ref_spent = {(r.epoch, r.line_item): r.spent_epsilon for r in ref.table()}
    assert spent == pytest.approx(ref_spent, rel=1e-12)
    assert spent[(0, "evaluation.global")] > 0


def test_mlflow_run_shows_each_round_once(runs):
    from mlflow import MlflowClient

    s = runs["summary"]
    client = MlflowClient(tracking_uri=runs["uri"])
    run = client.get_run(s["mlflow"]["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["clma.resumed_from_round"] == "2"
    exp = run.info.experiment_id
    federation_runs = [r for r in client.search_runs([exp])
                       if "mlflow.parentRunId" not in r.data.tags]
    assert [r.info.run_id for r in federation_runs] == [s["mlflow"]["run_id"]]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "n_cohorts")] == [1, 2, 3, 4]
    for key in run.data.metrics:
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert len(steps) == len(set(steps)), key
    cohort_runs = client.search_runs([exp], "tags.`clma.kind` = 'cohort'")
    ids = Counter(r.data.tags["clma.cohort.id"] for r in cohort_runs)
    assert set(ids) == set(s["final_cohorts"]) and max(ids.values()) == 1
    from tasks.lineage import registered_model_name

    versions = client.search_model_versions(
        f"name = '{registered_model_name(load_config(TINY))}'")
    keys = Counter((v.tags["clma.cohort.id"], v.tags["clma.round"]) for v in versions)
    assert max(keys.values()) == 1
    # descendants of the root cohort: the two cohorts split off at round 3
    from tasks.lineage import descendants_filter

    found = client.search_runs([exp], descendants_filter(0, run.info.run_id))
    assert sorted(r.data.tags["clma.cohort.id"] for r in found) == ["1", "2"]


def test_dashboards_and_lineage_files_written(runs):
    out = runs["tmp"] / "out"
    for name in ("accuracy", "mean_loss", "health.dropout_rate"):
        data = (out / "dashboards" / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    doc = json.loads((out / "lineage" / "lineage.json").read_text())
    assert [(e["kind"], e["round"]) for e in doc["events"] if e["kind"] == "split"] == [
        ("split", 3)]
    from clma.state import StateStore

    hist = StateStore(runs["state"]).load().json("dashboards.json")
    assert hist["rounds"] == [1, 2, 3, 4]


def test_envelopes_and_alerts_match_uninterrupted_run(runs):
    """The files the crashed-and-resumed run left in its out folder (envelopes and alert
    decisions of every round, the re-run round 2 included) are byte-identical to the
    uninterrupted run's."""
    out, ref = runs["tmp"] / "out", runs["tmp"] / "ref-out"
    for kind in ("envelopes", "alerts"):
        files = sorted(p.relative_to(ref) for p in (ref / kind).rglob("*.json"))
        assert files, kind
        assert sorted(p.relative_to(out) for p in (out / kind).rglob("*.json")) == files
        for f in files:
            assert (out / f).read_bytes() == (ref / f).read_bytes(), f
    assert any(f.parts[1] == "round_002" for f in
               (p.relative_to(ref) for p in (ref / "envelopes").rglob("*.json")))


def test_devices_kept_their_own_state_like_the_uninterrupted_run(runs):
    """Each simulated device's round-keyed detector state is in ``<state>.devices`` (one
    file per client), and after two crashes and the re-run rounds it equals the
    uninterrupted run's device for device; nothing of it is in the server's state."""
    tmp = runs["tmp"]
    crashed, ref = tmp / "state.devices", tmp / "ref-state.devices"
    # (a SIGKILL during a device's atomic write may leave a temporary file beside it)
    names = sorted(p.name for p in crashed.glob("client_*.json"))
    assert names == [f"client_{c:06d}.json" for c in range(load_config(TINY).clients)]
    assert all(".tmp-" in p.name for p in crashed.iterdir() if p.name not in names)
    assert sorted(p.name for p in ref.iterdir()) == names
    for n in names:
        got, want = (json.loads((d / n).read_text()) for d in (crashed, ref))
        assert got == want, n
        assert max(int(r) for r in got["rounds"]) == 4
    for p in runs["state"].rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            assert b"previous_loss" not in data and b"n_flags" not in data, p


def test_the_learned_sets_survive_the_crashes(runs):
    """The differencing rule's write-ahead journal: every set an audit file records was
    journalled before its sum was unmasked; the attempt of round 2 killed before its
    commit journalled its sets, and its re-run journalled them again (nothing lost,
    nothing rewritten); the rule holds over everything learned."""
    from clma.privacy.differencing import exposed_clients
    from clma.state import StateStore

    state, m = runs["state"], runs["summary"]["federation"]["min_cohort"]
    journal = StateStore(state).learned_entries()
    assert journal
    sets = [{(c, d) for d, cs in e["models"].items() for c in cs} for e in journal]
    assert exposed_clients(sets, m) is None
    audits = sorted((state / "audit").glob("secure_sums_round_*.json"))
    assert audits
    for f in audits:
        doc = json.loads(f.read_text())
        for a in doc["secure_sums"]:
            assert any(e["round"] == doc["round"] and e["session"] == a["session"]
                       and set(a["clients"]) <= {c for cs in e["models"].values() for c in cs}
                       for e in journal), (f.name, a["session"])
    r2 = [json.dumps(e, sort_keys=True) for e in journal if e["round"] == 2]
    if r2:  # round 2 evaluated: once by the killed attempt, once by its re-run
        assert len(r2) == 2 * len(set(r2))
