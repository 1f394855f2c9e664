"""The Prefect flow is the engine's recipe, nothing more: ``federation_flow`` (Prefect
tasks, durable state) gives the same round results, cohort registry, evaluation state,
ledger and bitwise cohort models as the bare engine loop (``FederationEngine.run_round``,
no Prefect) on the same config with seeded noise; and the simulated devices keep their
detector state in their own folder, ``<state_dir>.devices``, never in the server's."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from clma.config import load_config

TINY = Path(__file__).with_name("durable_tiny.toml")
DETECTOR_KEYS = (b"previous_loss", b"n_flags", b"n_updates", b"LossThresholdDetector")

pytestmark = pytest.mark.slow


def _config(tmp: Path):
    cfg = load_config(TINY).with_overrides(rounds=3)  # the drift at round 3 splits cohorts
    return cfg.model_copy(update={
        "tracking": cfg.tracking.model_copy(update={"enabled": False, "dashboards": False}),
        "evaluation": cfg.evaluation.model_copy(update={"noise_seeded": True})})


@pytest.fixture(scope="module")
def both(tmp_path_factory, prefect_harness):
    from clma.engine import FederationEngine, open_budget
    from clma.sim.clients import SimulatedClients
    from clma.sim.federation import build_federation
    from flows.federation import federation_flow

    tmp = tmp_path_factory.mktemp("parity")
    cfg = _config(tmp)
    assert cfg.evaluation.noise_seeded and cfg.budget.enabled
    records = []
    state_dir = tmp / "state"
    summary = federation_flow(cfg, state_dir=str(state_dir), on_round=records.append)
    bare_cfg = cfg.model_copy(update={"budget": cfg.budget.model_copy(
        update={"state_dir": str(tmp / "bare-ledger")})})
    sim = build_federation(bare_cfg)
    engine = FederationEngine(bare_cfg, sim.assets(), SimulatedClients(sim),
                              budget=open_budget(bare_cfg))
    results = [engine.run_round(r) for r in range(1, cfg.rounds + 1)]  # one chunk per round
    return {"cfg": cfg, "tmp": tmp, "state_dir": state_dir, "summary": summary,
            "records": records, "engine": engine, "results": results}


def test_round_results_equal_the_bare_engines(both):
    recs, res = both["records"], both["results"]
    assert [r.round for r in recs] == [r.round for r in res] == [1, 2, 3]
    assert both["cfg"].orchestration.chunk_size == 4  # 2 chunks per round (one train-clients task run)
    for a, b in zip(recs, res, strict=True):
        for k in ("cohorts", "flagged", "quarantined", "new_cohorts", "merges", "divergence"):
            assert getattr(a, k) == getattr(b, k), (a.round, k)
        # the published report (ledger view included) and every envelope, byte for byte
        assert json.dumps(a.regional, sort_keys=True) == json.dumps(b.regional, sort_keys=True)
        assert a.evaluation.envelopes == b.evaluation.envelopes
        assert [x.model_dump() for x in a.evaluation.alerts] == [
            x.model_dump() for x in b.evaluation.alerts]
    assert len(res[2].new_cohorts) == 2 and res[2].flagged == 6  # a real cohorting round
    assert all(r.regional["budget"]["released"] for r in res)  # charged releases, seeded noise


def test_registry_evaluation_state_and_models_equal_bitwise(both):
    from clma.engine.state import snapshot_files
    from clma.state import StateStore

    snap = StateStore(both["state_dir"]).load()
    assert snap.round == 3
    bare = snapshot_files(both["engine"].state)
    for name in ("registry.json", "evaluation.json"):
        assert snap.files[name] == bare[name], name
    with np.load(io.BytesIO(snap.files["models.npz"])) as a, \
            np.load(io.BytesIO(bare["models.npz"])) as b:
        assert sorted(a.files) == sorted(b.files) and "merge_reference" in a.files
        for k in a.files:
            assert a[k].dtype == np.float32 and a[k].tobytes() == b[k].tobytes(), k
    from clma.release import count_band

    m = both["summary"]["federation"]["min_cohort"]
    assert both["summary"]["final_cohorts"] == {
        str(c): count_band(n, m) for c, n in both["engine"].cohort_sizes().items()}


def test_ledgers_hold_the_same_charges(both):
    from clma.budget import PrivacyLedger, default_policy

    flow = PrivacyLedger(both["state_dir"] / "ledger", default_policy())
    bare = both["engine"].budget.ledger

    def charges(led):
        return [(e["epoch"], e["round"], e["release"], e["status"], e["events"])
                for e in led.entries()]

    assert charges(flow) == charges(bare) and charges(flow)


def test_device_state_is_on_the_device_side_only(both):
    state_dir = both["state_dir"]
    devices = state_dir.with_name("state.devices")
    files = sorted(p.name for p in devices.iterdir())
    assert files == [f"client_{c:06d}.json" for c in range(both["cfg"].clients)]
    for name in files:  # each device's own round-keyed detector state, up to round 3
        doc = json.loads((devices / name).read_text())
        assert max(int(r) for r in doc["rounds"]) == 3
        assert "previous_loss" in next(iter(doc["rounds"].values()))
    # nothing under the server's state folder holds a client's detector state
    server_files = [p for p in state_dir.rglob("*") if p.is_file()]
    assert any(p.name == "registry.json" for p in server_files)
    assert any(p.parent.name == "ledger" for p in server_files)
    for p in server_files:
        data = p.read_bytes()
        assert not any(k in data for k in DETECTOR_KEYS), p
        assert p.name != "clients.json"


def test_each_round_shows_the_engine_steps_as_named_prefect_tasks(both):
    """The Prefect UI shows one task per engine step of every round, training in one
    train-clients task for in-process clients (``orchestration.chunk_size`` = 4: the two
    chunks of 8 clients trained in order inside it, as the bare engine does), and the
    ledger's charge / release steps of the evaluation."""
    from collections import Counter

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )

    parent = both["summary"]["prefect"]["flow_run_id"]
    with get_client(sync_client=True) as client:
        rounds = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent])))
        assert sorted(r.name for r in rounds) == [f"{both['cfg'].name}-round-{r}" for r in (1, 2, 3)]
        for run in rounds:
            tasks = client.read_task_runs(task_run_filter=TaskRunFilter(
                flow_run_id=TaskRunFilterFlowRunId(any_=[run.id])))
            names = Counter(t.name.rsplit("-", 1)[0] for t in tasks)  # "<task>-<suffix>"
            for step in ("select-clients", "detect-drift", "score-divergence",
                         "aggregate-per-cohort", "cohort", "merge-cohorts",
                         "secure-aggregation"):
                assert names[step] == 1, (run.name, step, names)
            assert names["train-clients"] == 1, (run.name, names)
            # one charge per ledger entry: 3 global + 3 regional (off cadence: nothing charged)
            assert names["charge-evaluation"] == 6, (run.name, names)
            assert names["release-evaluation"] >= 3, (run.name, names)
            assert all(t.state.is_completed() for t in tasks), run.name


def test_each_round_run_tells_its_story_in_logs_and_artifacts(both):
    """The round's own flow run (not only the federation's) has INFO logs and a markdown
    and a table artifact, also with the quiet console default (PREFECT_LOGGING_LEVEL=
    WARNING): bands as ranges, rounded numbers, every release with its outcome."""
    import re
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )

    parent = both["summary"]["prefect"]["flow_run_id"]
    with get_client(sync_client=True) as client:
        rounds = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent])))
        assert len(rounds) == 3
        for run in rounds:
            r = int(run.name.rsplit("-", 1)[1])
            deadline = time.monotonic() + 30
            while True:  # the API log handler sends in batches
                logs = [lg.message for lg in client.read_logs(log_filter=LogFilter(
                    flow_run_id=LogFilterFlowRunId(any_=[run.id])))]
                if any("participants:" in m for m in logs) or time.monotonic() > deadline:
                    break
                time.sleep(1)
            assert f"round {r}: participants: 5–9 clients (cohort floor m = 5)" in logs, logs
            assert any(m.startswith(f"round {r}: release accuracy / global: published ")
                       for m in logs), logs
            arts = client.read_artifacts(artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
            kinds = sorted(a.type for a in arts)
            assert kinds == ["markdown", "table"], (run.name, kinds)
            md = next(a.data for a in arts if a.type == "markdown")
            assert f"round {r}" in md and "published" in md
            assert not re.search(r"\d\.\d{5,}", md), md  # rounded
            for raw in ("minimum_to_under_double", "below_minimum", "_to_"):
                assert raw not in md, (raw, md)
            if r in (1, 3):  # regional releases are off the cadence on odd rounds
                assert "off the regional cadence" in md
            if r == 3:  # the drift splits cohort 0
                assert re.search(r"split: cohort 0 -> \d", md), md
        # the federation run has logs of its own: what it runs, one line per round, the end
        deadline = time.monotonic() + 30
        while True:
            fed_logs = [lg.message for lg in client.read_logs(log_filter=LogFilter(
                flow_run_id=LogFilterFlowRunId(any_=[parent])))]
            if any("round(s) run" in m for m in fed_logs) or time.monotonic() > deadline:
                break
            time.sleep(1)
    name = both["cfg"].name
    assert fed_logs[0].startswith(f"federation {name}: rounds 1 to 3 of 3, 8 clients, "
                                  "transport simulation, noise seeded"), fed_logs
    rounds_logged = [m for m in fed_logs if " committed: cohorts " in m]
    assert [m.split(" ", 2)[1] for m in rounds_logged] == ["1", "2", "3"], fed_logs
    assert rounds_logged[2].endswith(f"(the round's story: run {name}-round-3)")
    assert re.match(r"round 3 committed: cohorts 0, \d+, \d+; releases \d+ published",
                    rounds_logged[2]), rounds_logged
    assert fed_logs[-1] == f"federation {name}: 3 round(s) run, 3 of 3 done", fed_logs


def test_distributed_dp_flow_charges_before_the_sums_like_the_engine(tmp_path, prefect_harness):
    """Distributed DP with the ledger: the flow charges the noised entries in its body
    before the ``secure-aggregation`` task (the engine raises otherwise) and its ledger
    holds exactly the bare engine's charges (the devices' noise is never seeded, so only
    the charges are compared)."""
    from clma.config import validate_config
    from clma.engine import FederationEngine, open_budget
    from clma.sim.clients import SimulatedClients
    from clma.sim.federation import build_federation
    from flows.federation import federation_flow

    data = _config(tmp_path).model_dump(mode="json")
    data["evaluation"].update(noise="distributed", noise_seeded=False, bounds_every=0)
    cfg = validate_config(data)
    federation_flow(cfg, state_dir=str(tmp_path / "state"))
    bare_cfg = cfg.model_copy(update={"budget": cfg.budget.model_copy(
        update={"state_dir": str(tmp_path / "bare-ledger")})})
    sim = build_federation(bare_cfg)
    engine = FederationEngine(bare_cfg, sim.assets(), SimulatedClients(sim),
                              budget=open_budget(bare_cfg))
    for r in range(1, cfg.rounds + 1):
        engine.run_round(r)
    from clma.budget import PrivacyLedger, default_policy

    flow = PrivacyLedger(tmp_path / "state" / "ledger", default_policy())

    def charges(led):
        return [(e["epoch"], e["round"], e["release"], e["status"], e["events"])
                for e in led.entries()]

    assert charges(flow) == charges(engine.budget.ledger)
    assert any(rel == "regional.accuracy" for _, _, rel, _, _ in charges(flow))
