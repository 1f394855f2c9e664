"""``clma experiment clma-vs-fedavg``: the results-table arithmetic against literal formulas,
the scenario and arm configs, option errors, and one tiny 1-seed run through the command
line (two Prefect federation flows nested under one MLflow parent run)."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest

from clma.config import ConfigError, load_config
from flows.experiments import clma_vs_fedavg as cvf

TINY = Path(__file__).with_name("clma_vs_fedavg_tiny.toml")


def _summary(per_round, final_stat, final_drift, separated, aris, run_id="r"):
    return {
        "mlflow": {"run_id": run_id},
        "sim_truth": {
            "stationary_final_accuracy": final_stat,
            "drifted_final_accuracy": final_drift,
            "families_separated_every_event": separated,
            "ari_per_drift_event": aris,
            "per_round": [
                {"round": i + 1, "stationary_accuracy": a, "drifted_accuracy": None}
                for i, a in enumerate(per_round)
            ],
        },
    }


# ------------------------------------------------------------------ scenario and arms


def test_bundled_scenario_is_the_issue_scenario():
    cfg = cvf.scenario_config()
    assert (cfg.clients, cfg.rounds, cfg.data.dataset, cfg.data.partition) == (
        10, 10, "digits", "iid"
    )
    assert cfg.cohort.enabled is True
    assert sorted({ev.round for ev in cfg.drift.events}) == [3, 5, 7, 9]
    for r in (3, 5, 7, 9):
        evs = {ev.shift: ev for ev in cfg.drift.events if ev.round == r}
        assert sorted(evs) == [-1, 1] and all(ev.kind == "label_rotation" for ev in evs.values())
        assert len(evs[1].clients) == len(evs[-1].clients) == 4
        assert not set(evs[1].clients) & set(evs[-1].clients)
    drifted = {c for ev in cfg.drift.events for c in ev.clients}
    assert len(drifted) == 8 and set(range(10)) - drifted == {8, 9}
    # every event drifts the same two families
    fams = {(ev.family, tuple(ev.clients)) for ev in cfg.drift.events}
    assert len(fams) == 2
    assert cvf.post_drift_rounds(cfg) == (4, 10)


def test_arms_differ_only_in_cohorting_name_and_seed():
    cfg = cvf.scenario_config()
    a, b = cvf.arm_config(cfg, "clma", 7), cvf.arm_config(cfg, "fedavg", 7)
    assert a.cohort.enabled is True and b.cohort.enabled is False
    assert a.seed == b.seed == 7
    assert a.tracking.experiment == b.tracking.experiment == "clma-vs-fedavg"
    da, db = a.model_dump(), b.model_dump()
    for d in (da, db):
        d["cohort"].pop("enabled")
        d.pop("name")
    assert da == db
    base = cfg.model_dump()
    base["cohort"].pop("enabled")
    base.pop("name")
    base["seed"] = 7
    assert da == base
    with pytest.raises(ValueError, match="method"):
        cvf.arm_config(cfg, "fedprox", 0)


def test_arm_experiment_defaults_when_config_has_none(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text(TINY.read_text().replace('experiment = "cvf-tiny"', ""))
    cfg = cvf.scenario_config(p)
    assert cfg.tracking.experiment is None
    assert cvf.arm_config(cfg, "fedavg", 0).tracking.experiment == "clma-vs-fedavg"


def _no_events(t: str) -> str:
    return t.split("[[drift.events]]")[0] + "[evaluation]\nmin_cohort = 2\n"


def _all_drift(t: str) -> str:
    return t.replace("clients = 10", "clients = 8")


def _drift_at_last_round(t: str) -> str:
    return _no_events(t).replace("rounds = 6", "rounds = 3") + (
        '[[drift.events]]\nround = 3\nkind = "label_rotation"\nshift = 1\n'
        'family = "a"\nclients = [0]\n'
    )


@pytest.mark.parametrize(
    ("edit", "rule"),
    [
        (_no_events, "at least one drift event"),
        (_all_drift, "stationary client"),
        (_drift_at_last_round, "before the last round"),
    ],
)
def test_scenario_rejects_what_it_cannot_report(tmp_path, edit, rule):
    p = tmp_path / "s.toml"
    p.write_text(edit(TINY.read_text()))
    with pytest.raises(ConfigError, match=rule):
        cvf.scenario_config(p)


def test_bad_options_exit_2_before_training(tmp_path, capsys):
    from flows.cli import main

    assert main(["experiment", "clma-vs-fedavg", "--seeds", "1", "1", "--out",
                 str(tmp_path)]) == 2
    assert "--seeds" in capsys.readouterr().err
    assert main(["experiment", "clma-vs-fedavg", "--seeds", "-1", "--out", str(tmp_path)]) == 2
    assert "--seeds" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY.read_text().replace("rounds = 6", "rounds = 0"))
    assert main(["experiment", "clma-vs-fedavg", "--config", str(bad), "--out",
                 str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "rounds" in err and "Traceback" not in err
    assert not (tmp_path / "results.csv").exists()


# ------------------------------------------------------------------ table arithmetic


def test_method_run_window_mean_and_fields():
    s = _summary([0.1, 0.2, 0.9, 0.5, None, 0.7], 0.7, 0.4, True, {"3": 1.0, "5": 0.5})
    r = cvf.method_run_from_summary(s, "clma", 3, (4, 6))
    assert r.stationary_post_drift_accuracy == pytest.approx((0.5 + 0.7) / 2, abs=1e-15)
    assert (r.stationary_final_accuracy, r.drifted_final_accuracy) == (0.7, 0.4)
    assert r.families_separated_every_event is True
    assert r.ari_per_drift_event == {"3": 1.0, "5": 0.5}
    assert (r.method, r.seed, r.mlflow_run_id) == ("clma", 3, "r")
    none = cvf.method_run_from_summary(_summary([0.3, None], None, None, False, {}), "x", 0,
                                       (2, 2))
    assert none.stationary_post_drift_accuracy is None and none.drifted_final_accuracy is None
    with pytest.raises(ValueError, match="sim_truth"):
        cvf.method_run_from_summary({"mlflow": {}}, "clma", 0, (1, 1))


def _runs():
    clma = [0.91, 0.88, 0.95]
    fed = [0.20, 0.55, 0.31]
    runs = []
    for seed, (a, b) in enumerate(zip(clma, fed, strict=True)):
        runs.append(cvf.MethodRun("fedavg", seed, b, b + 0.01, 0.3, False, {"3": 0.0}))
        runs.append(cvf.MethodRun("clma", seed, a, a - 0.01, 0.8, seed != 1,
                                  {"3": 1.0, "5": 0.5 if seed else 1.0}))
    return runs, clma, fed


def test_aggregate_matches_statistics_module():
    runs, clma, fed = _runs()
    rows = cvf.aggregate(runs, (4, 10))
    assert [r["method"] for r in rows] == ["clma", "fedavg"]
    assert all(tuple(r) == cvf.TABLE_COLUMNS for r in rows)
    c, f = rows
    assert c["n_seeds"] == 3 and c["seeds"] == "0 1 2" and c["post_drift_rounds"] == "4-10"
    for row, vals in ((c, clma), (f, fed)):
        assert row["stationary_final_accuracy_mean"] == pytest.approx(statistics.fmean(vals),
                                                                      abs=1e-12)
        assert row["stationary_final_accuracy_std"] == pytest.approx(statistics.stdev(vals),
                                                                     abs=1e-12)
        assert row["stationary_final_accuracy_min"] == min(vals)
        assert row["stationary_final_accuracy_max"] == max(vals)
    assert c["stationary_post_drift_accuracy_mean"] == pytest.approx(
        statistics.fmean(clma) - 0.01, abs=1e-12)
    assert c["families_separated_seeds"] == 2 and f["families_separated_seeds"] == 0
    assert c["drift_event_ari_mean"] == pytest.approx((1 + 1 + 1 + 0.5 + 1 + 0.5) / 6)
    one = cvf.aggregate([r for r in runs if r.seed == 0], (4, 10))
    assert one[0]["stationary_final_accuracy_std"] is None
    with pytest.raises(ValueError, match="runs"):
        cvf.aggregate([], (4, 10))


def test_lift_and_target_rule():
    runs, clma, fed = _runs()
    cfg = cvf.scenario_config()
    doc = cvf.results_document(cfg, runs, parent_run_id="p")
    lift = doc["stationary_final_lift_clma_minus_fedavg"]
    diffs = [a - b for a, b in zip(clma, fed, strict=True)]
    assert lift["per_seed"] == {str(i): pytest.approx(d, abs=1e-15) for i, d in enumerate(diffs)}
    assert lift["mean"] == pytest.approx(statistics.fmean(diffs), abs=1e-12)
    assert lift["min"] == pytest.approx(0.33, abs=1e-12)
    assert lift["lift_met_every_seed"] is True
    # seed 1's families were not separated: the issue's target is not met
    assert lift["clma_families_separated_every_seed"] is False
    assert lift["target_met"] is False
    ok = [cvf.MethodRun(r.method, r.seed, r.stationary_final_accuracy, None, None,
                        r.method == "clma", {}) for r in runs]
    assert cvf.results_document(cfg, ok, parent_run_id=None)[
        "stationary_final_lift_clma_minus_fedavg"]["target_met"] is True
    # a lift of 0.29 in one seed fails the every-seed rule
    low = [r if not (r.method == "clma" and r.seed == 1) else
           cvf.MethodRun("clma", 1, 0.55 + 0.29, None, None, True, {}) for r in ok]
    lift_low = cvf.results_document(cfg, low, parent_run_id=None)[
        "stationary_final_lift_clma_minus_fedavg"]
    assert lift_low["lift_met_every_seed"] is False and lift_low["target_met"] is False
    assert doc["scenario"]["stationary_clients"] == 2
    assert doc["scenario"]["drift_rounds"] == [3, 5, 7, 9]


def test_markdown_and_csv_render_the_rows():
    runs, _, _ = _runs()
    doc = cvf.results_document(cvf.scenario_config(), runs, parent_run_id=None)
    md = cvf.to_markdown(doc)
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert len(lines) == 4  # header, rule, CLMA, FedAvg
    assert "stationary acc., mean rounds 4-10" in lines[0]
    c = doc["table"][0]
    cell = (f"{c['stationary_final_accuracy_mean']:.3f} ± "
            f"{c['stationary_final_accuracy_std']:.3f} [0.880, 0.950]")
    assert lines[2].startswith("| CLMA | 3 | " + cell + " |")
    assert "| 2/3 seeds |" in lines[2] and "| 0/3 seeds |" in lines[3]
    assert "NOT met" in md
    rows = list(csv.DictReader(cvf.to_csv(doc["table"], cvf.TABLE_COLUMNS).splitlines()))
    assert [r["method"] for r in rows] == ["clma", "fedavg"]
    assert float(rows[1]["stationary_final_accuracy_max"]) == 0.55


# ------------------------------------------------------------------ the flow, end to end


@pytest.mark.slow
def test_cli_runs_both_arms_under_one_parent_run(tmp_path, prefect_harness, mlflow_store,
                                                 capsys):
    from flows.cli import main
    from mlflow import MlflowClient

    out = tmp_path / "out"
    code = main(["experiment", "clma-vs-fedavg", "--seeds", "0", "--config", str(TINY),
                 "--out", str(out), "--quiet"])
    assert code == 0
    assert json.loads(capsys.readouterr().out) == {"results": str(out / "results.json")}

    doc = json.loads((out / "results.json").read_text())
    client = MlflowClient(tracking_uri=mlflow_store)
    parent_id = doc["mlflow_parent_run_id"]
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    exp = client.get_experiment(parent.info.experiment_id)
    assert exp.name == "cvf-tiny"
    children = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'"
    )
    assert sorted(r.data.tags["clma.cohorting"] for r in children) == ["clma", "fedavg"]
    assert all(r.info.status == "FINISHED" and r.data.params["seed"] == "0" for r in children)
    assert {r.data.params["cohort.enabled"] for r in children} == {"true", "false"}
    assert {r.info.run_id for r in children} == {r["mlflow_run_id"] for r in doc["per_seed"]}
    arts = {a.path for a in client.list_artifacts(parent_id)}
    assert {"results_table.json", "results.json", "results.md"} <= arts
    table = json.loads(Path(client.download_artifacts(parent_id, "results_table.json"))
                       .read_text())
    assert table["columns"] == list(cvf.TABLE_COLUMNS) and len(table["data"]) == 2

    with (out / "results.csv").open() as fh:
        reader = csv.DictReader(fh)
        assert tuple(reader.fieldnames) == cvf.TABLE_COLUMNS
        rows = list(reader)
    assert [r["method"] for r in rows] == ["clma", "fedavg"]
    assert all(r["n_seeds"] == "1" and r["post_drift_rounds"] == "4-6" for r in rows)
    md = (out / "results.md").read_text()
    assert sum(ln.startswith("| CLMA |") or ln.startswith("| FedAvg |")
               for ln in md.splitlines()) == 2
    for m in ("clma", "fedavg"):
        s = json.loads((out / "seed0" / m / "summary.json").read_text())
        assert s["federation"]["cohorting"] == m and s["federation"]["seed"] == 0
        assert s["mlflow"]["run_id"] in {r.info.run_id for r in children}

    clma_row, fed_row = doc["table"]
    # CLMA separated the two opposite families at both drift events; FedAvg cannot
    assert clma_row["families_separated_seeds"] == 1
    clma_run = next(r for r in doc["per_seed"] if r["method"] == "clma")
    assert set(clma_run["ari_per_drift_event"]) == {"3", "5"}
    assert fed_row["families_separated_seeds"] == 0
    assert parent.data.metrics["clma.families_separated_seeds"] == 1.0
    assert parent.data.metrics["stationary_final_lift.mean"] == pytest.approx(
        clma_row["stationary_final_accuracy_mean"] - fed_row["stationary_final_accuracy_mean"]
    )
    # the drifted families pull FedAvg's single model away from the stationary clients
    assert clma_row["stationary_final_accuracy_mean"] > fed_row["stationary_final_accuracy_mean"]
    assert load_config(TINY).clients == 10
