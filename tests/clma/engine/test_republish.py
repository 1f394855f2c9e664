"""A round re-run after a crash (Prefect retry, ``clma run --resume``) republishes exactly
what the ledger committed: same report, byte-identical envelopes, same alert decisions,
and not one noise draw (clma.engine.budget ``budgeted_evaluation`` ->
``PrivateEvaluator.restore``). Library calls: the engine over simulated clients, a fresh
engine restored from the state snapshot for the re-run."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from clma.config import BudgetConfig, load_config
from clma.engine import open_budget
from clma.engine.budget import charge_plans
from clma.engine.state import restore_files, snapshot_files
from clma.release.alerts import AlertBaseline

SMALL = Path(__file__).parents[2] / "flows" / "small.toml"


@pytest.fixture
def republish_config(tmp_path, write_policy):
    """The small federation with OpenDP noise (a second draw would change every value),
    large epsilons (tight error bars, so alerts are decided by the values), simulated
    dropouts (health) and the error histogram released every evaluation; the shipped
    policy with room for large epsilons and regional releases every round."""
    cfg = load_config(SMALL).with_overrides(rounds=3, clients=30)
    ev = {"noise_seeded": False, "epsilon": 50.0, "health_epsilon": 50.0,
          "bounds_every": 1, "dropout_rate": 0.15}
    policy = write_policy(epsilon_per_client_per_epoch=100000.0, regional_cadence_rounds=1)
    return cfg.model_copy(update={
        "budget": BudgetConfig(state_dir=str(tmp_path / "state"), policy=str(policy)),
        "evaluation": cfg.evaluation.model_copy(update=ev),
        "tracking": cfg.tracking.model_copy(update={"enabled": False}),
    })


def _without_budget(published):
    return {k: v for k, v in published.items() if k != "budget"}


@pytest.fixture
def crash_and_rerun(republish_config, make_engine, evaluate_round):
    """Round 1, then round 2 with baselines forced so alerts fire, then round 2 again
    from the state before it (fresh engine restored from the snapshot, fresh ledger
    handle, fresh simulated clients)."""

    def run(rewrite=None):
        cfg = republish_config
        engine = make_engine(cfg, budget=True)
        evaluate_round(engine, 1)
        state = engine.evaluator.state
        # baselines no published value can be within the bars of: every scalar alert fires
        for key, b in list(state.baselines.baselines.items()):
            far = 1.0 if b.metric == "accuracy" else 0.0
            state.baselines.baselines[key] = AlertBaseline(
                **{**b.model_dump(), "value": far, "error_bar": 0.0})
        before = snapshot_files(engine.state)
        view1, out1 = evaluate_round(engine, 2)
        after1 = engine.evaluator.state.to_dict()
        if rewrite is not None:
            rewrite(engine.budget.ledger.path)
        # the process died after the ledger commits, before the durable-state commit: a
        # new process restores the server as it was before round 2 and runs round 2 again
        again = make_engine(cfg, budget=open_budget(cfg), state=restore_files(before, 1))
        view2, out2 = evaluate_round(again, 2)
        return view1, out1, after1, view2, out2, again.evaluator.state.to_dict()

    return run


def _check_same_round(view1, out1, after1, view2, out2, after2, *, drawn, sampler_spy):
    assert len(sampler_spy) == drawn, "the re-run drew noise"
    assert view2["budget"]["released"] == []
    assert view2["budget"]["republished"] == view1["budget"]["released"]
    assert view2["epsilon_spent"] == 0.0
    # the first run published something worth comparing
    pub1, pub2 = out1.published, out2.published
    assert pub1["metrics"]["accuracy"]["global"] is not None
    assert pub1["metrics"]["accuracy"]["regions"]
    assert pub1["health"]["health.dropout_rate"]["global"] is not None
    assert "error_histogram" in pub1
    assert out1.alerts_fired > 0
    # ... and the re-run publishes exactly the same
    assert _without_budget(pub2) == _without_budget(pub1)
    assert json.dumps(_without_budget(pub2), sort_keys=True) == json.dumps(
        _without_budget(pub1), sort_keys=True)
    assert out2.envelopes == out1.envelopes  # byte-identical envelope JSON
    assert [a.model_dump() for a in out2.alerts] == [a.model_dump() for a in out1.alerts]
    assert [r.key for r in out2.releases] == [r.key for r in out1.releases]
    assert out2.refused == out1.refused
    assert after2 == after1  # baselines, merges, bounds, evaluation count
    # nothing published carries the exact contributor count
    for doc in (json.dumps(pub2), json.dumps(view2), *out2.envelopes.values()):
        assert "contributors" not in doc


def test_rerun_republishes_the_committed_report_without_noise(crash_and_rerun, sampler_spy):
    drawn_by = {}

    def rewrite(path):  # called between the first run and the re-run
        drawn_by["first"] = len(sampler_spy)

    res = crash_and_rerun(rewrite)
    assert drawn_by["first"] > 0
    _check_same_round(*res, drawn=drawn_by["first"], sampler_spy=sampler_spy)


def test_rerun_with_a_ledger_written_by_the_previous_format(crash_and_rerun, sampler_spy):
    """A ledger that stored the published view ``{"releases": {group: published}}`` (the
    format before server-side payloads) is republished the same way."""
    from clma.release.aggregate import AggregatedMetric, AggregatedVector

    drawn_by = {}

    def to_old_format(path):
        drawn_by["first"] = len(sampler_spy)
        con = sqlite3.connect(path)
        with con:
            rows = con.execute("SELECT id, release, result FROM charges WHERE round = 1").fetchall()
            assert rows
            for rid, release, result in rows:
                old = {}
                for group, data in json.loads(result)["server"].items():
                    if release.endswith("error_histogram"):
                        pub = AggregatedVector.model_validate(data).to_published_dict()
                        pub["values"] = [min(max(v, 0.0), 1.0) for v in pub["values"]]
                    else:
                        pub = AggregatedMetric.model_validate(data).to_published_dict()
                    old[group] = pub
                con.execute("UPDATE charges SET result = ? WHERE id = ?",
                            (json.dumps({"releases": old}), rid))
        con.close()

    res = crash_and_rerun(to_old_format)
    _check_same_round(*res, drawn=drawn_by["first"], sampler_spy=sampler_spy)


def test_committed_payload_is_server_side_and_restored_exactly(republish_config, make_engine,
                                                               evaluate_round):
    """The ledger holds the server-side results (exact counts: ledger state, never
    published); the round's published values are those of the stored payload."""
    engine = make_engine(republish_config, budget=True)
    _, out = evaluate_round(engine, 1)
    con = sqlite3.connect(engine.budget.ledger.path)
    stored = dict(con.execute("SELECT release, result FROM charges WHERE round = 0"))
    con.close()
    acc = json.loads(stored["global.accuracy"])
    assert acc["format"] == "clma.evaluation.server/2"
    assert acc["server"]["global"]["contributors"] == out.server["accuracy|global"].contributors
    assert acc["server"]["global"]["value"] == out.published["metrics"]["accuracy"]["global"]["value"]
    hist = json.loads(stored["global.error_histogram"])["server"]["global"]
    assert hist["values"] == out.server["error_histogram|global"].values


def test_restore_refuses_an_unknown_payload(republish_config, make_engine, secure_sums):
    engine = make_engine(republish_config)
    ev = engine.evaluator.open_round(secure_sums(engine, 1))
    assert "global.accuracy" in {p.name for p in charge_plans(engine.evaluator)}
    with pytest.raises(ValueError, match="unknown stored payload format"):
        engine.evaluator.restore(ev, "global.accuracy", {"format": "other/9", "server": {}})
    with pytest.raises(ValueError, match="not planned in this round"):
        engine.evaluator.restore(ev, "global.accuracy", {"releases": {"nowhere": {}}})
    assert ev.draws.made == []  # nothing recorded by the refused restores


def test_rerun_after_a_crash_in_the_middle_of_a_round(republish_config, make_engine,
                                                      evaluate_round, sampler_spy):
    """Killed after two of the round's entries were committed: the re-run republishes
    those two (no noise), draws the others once, and publishes a complete report whose
    republished values are the committed ones."""
    from clma.engine.budget import direct_step

    cfg = republish_config
    engine = make_engine(cfg, budget=True)
    before = snapshot_files(engine.state)
    calls = []

    def crashing(name, fn, *a, **kw):  # the orchestrator's step runner; the process dies
        if name == "release-evaluation":
            if len(calls) == 2:
                raise RuntimeError("process killed")
            calls.append(name)
        return direct_step(name, fn, *a, **kw)

    with pytest.raises(RuntimeError, match="process killed"):
        evaluate_round(engine, 1, step=crashing)
    budget = open_budget(cfg)
    committed = {e["release"] for e in budget.ledger.entries() if e["status"] == "committed"}
    assert committed == {"global.accuracy", "global.mean_loss"}
    con = sqlite3.connect(budget.ledger.path)
    stored = {k: json.loads(v) for k, v in con.execute(
        "SELECT release, result FROM charges WHERE status = 'committed'")}
    con.close()
    again = make_engine(cfg, budget=budget, state=restore_files(before, 0))
    n = len(sampler_spy)
    view, out = evaluate_round(again, 1)
    assert sorted(view["budget"]["republished"]) == sorted(committed)
    names = [p.name for p in charge_plans(again.evaluator)]
    assert sorted(view["budget"]["released"]) == sorted(set(names) - committed)
    # one draw per group of the entries not committed (histogram: one sampler call)
    assert len(sampler_spy) - n == sum(
        1 for r in out.releases if f"{'global' if r.region == 'global' else 'regional'}."
        f"{r.name}" not in committed)
    assert out.refused == []
    pub = out.published["metrics"]
    for metric in ("accuracy", "mean_loss"):
        assert pub[metric]["global"]["value"] == stored[f"global.{metric}"]["server"]["global"]["value"]
        env = json.loads(out.envelopes[f"{metric}/global.json"])
        assert env["aggregate_value"] == pytest.approx(pub[metric]["global"]["value"], abs=1e-12)
    assert pub["accuracy"]["regions"] and out.published["health"]["health.dropout_rate"]["global"]
