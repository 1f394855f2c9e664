"""A round re-run after a crash (Prefect retry, ``clma run --resume``) republishes exactly
what the ledger committed: same report, byte-identical envelopes, same alert decisions,
and not one noise draw (tasks/budget.py ``budgeted_evaluation`` -> tasks/evaluate.py
``restore_planned``)."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pytest

from clma.config import BudgetConfig, load_config
from clma.release.alerts import AlertBaseline
from clma.sim.federation import build_federation, evaluate_clients

SMALL = Path(__file__).parents[1] / "flows" / "small.toml"
SHIPPED = Path(__file__).parents[2] / "clma" / "policy" / "privacy_policy_v1.toml"


def wide_policy(tmp: Path) -> Path:
    """The shipped policy with room for large epsilons and regional releases every round."""
    text = SHIPPED.read_text()
    text = re.sub(r"(?m)^epsilon_per_client_per_epoch = .*$",
                  "epsilon_per_client_per_epoch = 100000.0", text)
    text = re.sub(r"(?m)^regional_cadence_rounds = .*$", "regional_cadence_rounds = 1", text)
    p = tmp / "policy_wide.toml"
    p.write_text(text)
    return p


def make_fed(tmp: Path, **evaluation):
    """The small federation with OpenDP noise (a second draw would change every value),
    large epsilons (tight error bars, so alerts are decided by the values), simulated
    dropouts (health) and the error histogram released every evaluation."""
    cfg = load_config(SMALL).with_overrides(rounds=3, clients=30)
    ev = {"noise_seeded": False, "epsilon": 50.0, "health_epsilon": 50.0,
          "bounds_every": 1, "dropout_rate": 0.15, **evaluation}
    cfg = cfg.model_copy(update={
        "budget": BudgetConfig(state_dir=str(tmp / "state"), policy=str(wide_policy(tmp))),
        "evaluation": cfg.evaluation.model_copy(update=ev),
        "tracking": cfg.tracking.model_copy(update={"enabled": False}),
    })
    return build_federation(cfg)


def evaluations(fed):
    ids = fed.client_ids
    return evaluate_clients([fed.clients[c] for c in ids], fed.models_for(ids),
                            {c: fed.registry.cohort_of(c) for c in ids}, fed.spec,
                            fed.config.evaluation.loss_max)


def _round(fed, budget, evs, r):
    from tasks.budget import budgeted_evaluation
    from tasks.evaluate import finish_evaluation

    view = budgeted_evaluation(fed, budget, evs, r, gate=None)
    return view, finish_evaluation(fed, fed.client_ids, r, budget_view=view)


def _without_budget(published):
    return {k: v for k, v in published.items() if k != "budget"}


def _crash_and_rerun(tmp_path, sampler_spy, *, rewrite=None):
    """Round 1, then round 2 with baselines forced so alerts fire, then round 2 again
    from the state before it (fresh round context, fresh ledger handle)."""
    from tasks.budget import open_budget
    from tasks.evaluate import EvaluationState, evaluation_state

    fed = make_fed(tmp_path)
    evs = evaluations(fed)
    budget = open_budget(fed.config)
    _round(fed, budget, evs, 1)
    state = evaluation_state(fed)
    # baselines no published value can be within the bars of: every scalar alert fires
    for key, b in list(state.baselines.baselines.items()):
        far = 1.0 if b.metric == "accuracy" else 0.0
        state.baselines.baselines[key] = AlertBaseline(
            **{**b.model_dump(), "value": far, "error_bar": 0.0})
    before = state.to_dict()
    view1, out1 = _round(fed, budget, evs, 2)
    after1 = evaluation_state(fed).to_dict()
    drawn = len(sampler_spy)
    if rewrite is not None:
        rewrite(budget.ledger.path)
    # the process died after the ledger commits, before the durable-state commit: a new
    # process restores the federation as it was before round 2 and runs round 2 again
    fed.evaluation_state = EvaluationState.from_dict(before)
    fed._evaluation_round = None
    view2, out2 = _round(fed, open_budget(fed.config), evs, 2)
    return view1, out1, after1, drawn, view2, out2, evaluation_state(fed).to_dict()


def _check_same_round(view1, out1, after1, drawn, view2, out2, after2, sampler_spy):
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


def test_rerun_republishes_the_committed_report_without_noise(tmp_path, prefect_harness,
                                                              sampler_spy):
    _check_same_round(*_crash_and_rerun(tmp_path, sampler_spy), sampler_spy)


def test_rerun_with_a_ledger_written_by_the_previous_format(tmp_path, prefect_harness,
                                                            sampler_spy):
    """A ledger that stored the published view ``{"releases": {group: published}}`` (the
    format before server-side payloads) is republished the same way."""
    from clma.release.aggregate import AggregatedMetric, AggregatedVector

    def to_old_format(path):
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

    _check_same_round(*_crash_and_rerun(tmp_path, sampler_spy, rewrite=to_old_format),
                      sampler_spy)


def test_committed_payload_is_server_side_and_restored_exactly(tmp_path, prefect_harness):
    """The ledger holds the server-side results (exact counts: ledger state, never
    published); the round's published values are those of the stored payload."""
    from tasks.budget import open_budget

    fed = make_fed(tmp_path)
    evs = evaluations(fed)
    budget = open_budget(fed.config)
    _, out = _round(fed, budget, evs, 1)
    con = sqlite3.connect(budget.ledger.path)
    stored = dict(con.execute("SELECT release, result FROM charges WHERE round = 0"))
    con.close()
    acc = json.loads(stored["global.accuracy"])
    assert acc["format"] == "clma.evaluation.server/2"
    assert acc["server"]["global"]["contributors"] == out.server["accuracy|global"].contributors
    assert acc["server"]["global"]["value"] == out.published["metrics"]["accuracy"]["global"]["value"]
    hist = json.loads(stored["global.error_histogram"])["server"]["global"]
    assert hist["values"] == out.server["error_histogram|global"].values


def test_restore_refuses_an_unknown_payload(tmp_path, prefect_harness):
    from tasks.budget import planned_releases
    from tasks.evaluate import restore_planned

    fed = make_fed(tmp_path)
    plan = next(p for p in planned_releases(fed, 1) if p.name == "global.accuracy")
    with pytest.raises(ValueError, match="unknown stored payload format"):
        restore_planned(fed, evaluations(fed), 1, plan, {"format": "other/9", "server": {}})
    with pytest.raises(ValueError, match="not planned in this round"):
        restore_planned(fed, evaluations(fed), 1, plan, {"releases": {"nowhere": {}}})


def test_rerun_after_a_crash_in_the_middle_of_a_round(tmp_path, prefect_harness, sampler_spy,
                                                      monkeypatch):
    """Killed after two of the round's entries were committed: the re-run republishes
    those two (no noise), draws the others once, and publishes a complete report whose
    republished values are the committed ones."""
    import tasks.budget as tb
    from tasks.budget import open_budget, planned_releases
    from tasks.evaluate import EvaluationState, evaluation_state

    fed = make_fed(tmp_path)
    evs = evaluations(fed)
    before = evaluation_state(fed).to_dict()
    real, calls = tb._draw_release, []

    def crashing(*a, **kw):
        if len(calls) == 2:
            raise RuntimeError("process killed")
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(tb, "_draw_release", crashing)
    with pytest.raises(RuntimeError, match="process killed"):
        _round(fed, open_budget(fed.config), evs, 1)
    monkeypatch.setattr(tb, "_draw_release", real)
    budget = open_budget(fed.config)
    committed = {e["release"] for e in budget.ledger.entries() if e["status"] == "committed"}
    assert committed == {"global.accuracy", "global.mean_loss"}
    con = sqlite3.connect(budget.ledger.path)
    stored = {k: json.loads(v) for k, v in con.execute(
        "SELECT release, result FROM charges WHERE status = 'committed'")}
    con.close()
    fed.evaluation_state = EvaluationState.from_dict(before)
    fed._evaluation_round = None
    n = len(sampler_spy)
    view, out = _round(fed, budget, evs, 1)
    assert sorted(view["budget"]["republished"]) == sorted(committed)
    names = [p.name for p in planned_releases(fed, 1)]
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
