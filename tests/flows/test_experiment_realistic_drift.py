"""clma experiment realistic-drift: scenarios, method configs, the table, the CLI wiring."""

from __future__ import annotations

import argparse

import pytest

from clma.config import validate_config
from flows import experiments
from flows.cli import build_parser
from flows.experiments import realistic_drift as rd


def test_registered_and_peers_helper_not_an_experiment() -> None:
    assert "realistic-drift" in experiments.available()
    assert "peers" not in experiments.available()
    args = build_parser().parse_args(["experiment", "realistic-drift", "--seeds", "0", "1",
                                      "--scenarios", "label2-a1", "--methods", "cfl"])
    assert args.seeds == [0, 1] and args.scenarios == ["label2-a1"]


def test_scenarios_change_only_partition_and_drift() -> None:
    iid, a05 = rd.scenario_config("label2-iid"), rd.scenario_config("label2-a05")
    assert iid.data.partition == "iid" and a05.data.partition == "dirichlet"
    assert a05.data.dirichlet_alpha == 0.5
    assert iid.clients == 60 and iid.rounds == 10
    assert {(e.round, e.shift, e.family) for e in iid.drift.events} == {
        (4, 1, "rotate+1"), (4, -1, "rotate-1"), (7, 1, "rotate+1"), (7, -1, "rotate-1")}
    assert iid.evaluation.every > iid.rounds  # no private release in the experiment
    three = rd.scenario_config("label3-a1")
    assert len({e.family for e in three.drift.events}) == 3
    cov = rd.scenario_config("cov-rotnoise-iid")
    assert {e.kind for e in cov.drift.events} == {"rotation", "gaussian_noise"}
    with pytest.raises(ValueError, match="scenario"):
        rd.scenario_config("label2-a2")


def test_method_configs() -> None:
    base = rd.scenario_config("label2-a1")
    imp = rd.method_config(base, "clma_improved", 3, "cusum")
    assert imp.seed == 3 and imp.drift.detector == "cusum"
    assert imp.cohort.components == "broken_stick" and imp.cohort.direction_rule == "none"
    assert imp.cohort.leading_split_alpha == 0.01
    assert imp.training.server_learning_rate == 1.5
    assert imp.training.server_learning_rate_scope == "drift_cohorts"
    today = rd.method_config(base, "clma", 0)
    assert today.cohort.components == "variance" and today.cohort.direction_rule == "auto"
    assert today.cohort.leading_split_alpha is None
    assert today.training.server_learning_rate == 1.0
    assert today.training.server_learning_rate_scope == "all"
    assert not rd.method_config(base, "fedavg", 0).cohort.enabled
    assert today.cohort.method == "paper" and imp.cohort.method == "improved"
    with pytest.raises(ValueError, match="method"):
        rd.method_config(base, "fedprox", 0)


def test_the_paper_method_and_the_peers_keep_their_fingerprints() -> None:
    """The default method changed (issue 46); CLMA (today) runs the paper's method with
    its fields written out, FedAvg, CFL and IFCA take the paper's (inert) cohort fields:
    their config fingerprints, and so their stored runs, are those of before (computed at
    75af8aa)."""
    a05 = rd.scenario_config("label2-a05")
    assert rd.method_config(a05, "clma", 3).fingerprint() == (
        "146733346143b4b59b36a6cfc3bef109a9063f81d7d34eed4621f9befa98e0c1")
    assert rd.method_config(a05, "fedavg", 3).fingerprint() == (
        "0c178ddcfe737f45638f2fbea88f5cbd6cffe93076e8b71b22020288882da4e1")
    assert rd.method_config(rd.scenario_config("label2-a1"), "cfl", 3).fingerprint() == (
        "56539fb81e14062634d1868c7c72b4a6372e53418c235c3282f69cf9765ecf50")


def test_the_input_ks_detector_is_one_of_the_detectors_run() -> None:
    assert rd.DETECTORS[-1] == "input_ks" and "loss_threshold" in rd.DETECTORS
    args = build_parser().parse_args(["experiment", "realistic-drift", "--detectors",
                                      "input_ks", "loss_threshold"])
    assert args.detectors == ["input_ks", "loss_threshold"]
    cfg = rd.method_config(rd.scenario_config("cov-blurrot-a1"), "clma_improved", 0,
                           "input_ks")
    assert cfg.drift.detector_spec().kind == "input_ks"


def _run(method: str, seed: int, aris: dict[str, float], acc: float) -> rd.RunFigures:
    return rd.RunFigures("label2-a1", method, seed, aris, acc, acc - 0.1, 1.0, 0.0)


def test_aggregate_means_and_sample_std() -> None:
    runs = [_run("clma", 0, {"4": 1.0, "7": 0.0}, 0.9), _run("clma", 1, {"4": 0.5, "7": 1.0},
                                                              0.7),
            _run("cfl", 0, {"4": 0.2}, 0.5)]
    rows = rd.aggregate(runs)
    assert [r["method"] for r in rows] == ["clma", "cfl"]
    c = rows[0]
    assert c["mean_ari_mean"] == pytest.approx((0.5 + 0.75) / 2)
    assert c["stationary_final_accuracy_std"] == pytest.approx(0.2 / 2 ** 0.5)
    assert c["ari_by_event"] == {"4": 0.75, "7": 0.5}
    assert rows[1]["mean_ari_std"] is None  # one seed
    md = rd.to_markdown({"seeds": [0, 1], "table": rows})
    assert "| label2-a1 | CLMA (today) | 2 | r4: 0.75, r7: 0.50 | 0.625 ± 0.177 |" in md


def test_bad_seeds_exit_2(capsys) -> None:
    ns = argparse.Namespace(seeds=[0, 0], scenarios=["label2-iid"], methods=["cfl"],
                            detectors=["cusum"], out=None, no_tracking=True)
    assert rd.run(ns) == 2
    assert "--seeds" in capsys.readouterr().err


def test_tabulate_uses_finished_runs_only(tmp_path) -> None:
    import json

    cfg = rd.method_config(rd.scenario_config("label2-a1"), "cfl", 0)
    rec = rd.RunFigures("label2-a1", "cfl", 0, {"4": 0.5, "7": 1.0}, 0.9, 0.8,
                        config_fingerprint=cfg.fingerprint())
    path = tmp_path / "runs" / "label2-a1" / "cfl" / "seed0.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(rd._row(rec)))
    stale = tmp_path / "runs" / "label2-a1" / "ifca" / "seed0.json"
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({**rd._row(rec), "method": "ifca",
                                 "config_fingerprint": "another config"}))
    ns = argparse.Namespace(seeds=[0], scenarios=["label2-a1"], methods=["cfl", "ifca"],
                            detectors=["cusum"], out=tmp_path, no_tracking=True,
                            tabulate=True)
    assert rd.run(ns) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert [r["method"] for r in doc["table"]] == ["cfl"]
    assert doc["table"][0]["mean_ari_mean"] == 0.75
    assert doc["not_run"] == ["label2-a1 ifca seed 0"]  # a stale fingerprint is not reused
    assert "Not run (1): label2-a1 ifca seed 0." in (tmp_path / "results.md").read_text()


def test_under_label_skew_the_default_method_separates_the_families() -> None:
    """Issue 46, as a user meets it: the shipped default federation with Dirichlet(0.5)
    label skew (default.toml, the label2 scenario cut at its first drift event, round 4).
    The default method puts each rotation family in a cohort of its own (ARI 1); the
    paper's, still one field away (cohort.method = "paper"), puts both in one (ARI 0)."""
    from clma.config import with_cohort_method

    base = rd.scenario_config("label2-a05").with_overrides(rounds=4, seed=0)
    assert base.cohort.method == "improved"  # the scenario runs default.toml's method
    default = rd.run_engine(base)
    assert default["ari_per_drift_event"] == {"4": 1.0}
    assert default["final_cohorts"] == [15, 15, 30]
    paper = rd.run_engine(validate_config(with_cohort_method(base.model_dump(), "paper")))
    assert paper["ari_per_drift_event"] == {"4": 0.0}
    assert paper["final_cohorts"] == [30, 30]


def test_a_seed_that_cannot_be_partitioned_is_listed_and_the_others_run(tmp_path, capsys
                                                                         ) -> None:
    """label2-a03 seed 18: no Dirichlet(0.3) draw of 100 gives every client 8 records (the
    held-out check of docs/realistic_drift.md section 8 met it). The run is listed as not
    built, the finished runs are tabulated, and the exit code is 1; no traceback."""
    import json

    cfg = rd.method_config(rd.scenario_config("label2-a03"), "cfl", 15)
    rec = rd.RunFigures("label2-a03", "cfl", 15, {"4": 1.0, "7": 1.0}, 0.9, 0.8,
                        config_fingerprint=cfg.fingerprint())
    path = tmp_path / "runs" / "label2-a03" / "cfl" / "seed15.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(rd._row(rec)))  # a finished run, reused
    ns = argparse.Namespace(seeds=[15, 18], scenarios=["label2-a03"], methods=["cfl"],
                            detectors=["cusum"], out=tmp_path, no_tracking=True)
    assert rd.run(ns) == 1
    err = capsys.readouterr().err
    assert ("clma: label2-a03 cfl seed 18 not built: data.dirichlet_alpha: no partition "
            "with at least 8 samples per client found in 100 draws") in err
    assert "Traceback" not in err
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["not_built"] == ["label2-a03 cfl seed 18"]
    assert [r["seed"] for r in doc["per_seed"]] == [15]
    assert "Not built (1: no Dirichlet partition" in (tmp_path / "results.md").read_text()
