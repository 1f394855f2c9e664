"""End to end: the Prefect federation flow on a small config, tracked in a temporary
MLflow store; checks what the MLflow run and summary.json hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clma.config import load_config

SMALL = Path(__file__).with_name("small.toml")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, prefect_harness):
    import os

    tmp = tmp_path_factory.mktemp("e2e")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    old = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        from flows.federation import federation_flow

        summary = federation_flow(load_config(SMALL), out_dir=str(tmp / "out"))
    finally:
        if old is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old
    return summary, tmp, uri


def test_summary_json_schema_and_sim_truth(small_run):
    summary, tmp, _ = small_run
    on_disk = json.loads((tmp / "out" / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert on_disk["schema"] == "clma.summary/2"
    assert [r["round"] for r in on_disk["rounds"]] == [1, 2, 3, 4, 5]
    assert on_disk["mlflow"]["run_id"]
    assert on_disk["prefect"]["flow_run_id"]
    assert on_disk["region_partition"]["version"] == "1"
    assert len(on_disk["region_partition"]["content_hash"]) == 64
    gt = on_disk["sim_truth"]
    # the two opposite families at round 3 are separated into their own cohorts
    assert gt["ari_per_drift_event"] == {"3": 1.0}
    assert gt["families_separated_every_event"] is True
    # counts of clients are bands relative to the floor m = 5 (6 flagged: [m, 2m))
    assert on_disk["federation"]["min_cohort"] == 5
    assert on_disk["rounds"][2]["flagged_clients"] == "minimum_to_under_double"
    assert on_disk["rounds"][2]["quarantined_clients"] == "minimum_to_under_double"
    assert len(on_disk["rounds"][2]["new_cohorts"]) == 2
    # the two families of 3 clients: each new cohort is below the floor, never its count
    assert {v["band"] for v in on_disk["rounds"][2]["new_cohorts"].values()} == {
        "below_minimum"}
    assert set(on_disk["final_cohorts"].values()) <= {"below_minimum", "none",
                                                       "minimum_to_under_double"}
    assert 0.0 <= gt["stationary_final_accuracy"] <= 1.0
    # rounds before the drift: one cohort of 10 clients ([2m, 4m)), nobody flagged
    assert on_disk["rounds"][0]["cohorts"] == {"0": "double_to_under_fourfold"}
    # atypical-client scores per round, id-free: bands and distribution statistics only
    div = on_disk["rounds"][2]["divergence"]
    assert div["signal"] == "representation" and div["action"] == "report"
    assert div["n_flagged_band"] == div["representation"]["n_flagged_band"]
    assert div["representation"]["n_clients_band"] == "double_to_under_fourfold"
    assert div["quarantined_atypical_band"] in {"none", "below_minimum",
                                                "minimum_to_under_double"}
    assert on_disk["rounds"][1]["flagged_clients"] == "none"


def test_published_report_has_no_exact_counts(small_run):
    summary, _, _ = small_run
    published = 0
    for rec in summary["rounds"]:
        assert "contributors" not in json.dumps(rec["regional"])
        groups = [*rec["regional"]["metrics"].values(), *rec["regional"]["health"].values()]
        for metric in groups:
            pubs = [*metric["regions"].values(), *([metric["global"]] if metric["global"] else [])]
            for pub in pubs:
                published += 1
                assert "contributors" not in pub
                assert pub["participant_band"] in {
                    "minimum_to_under_double", "double_to_under_fourfold", "fourfold_or_more"
                }
                assert pub["error_bar"] > 0
    assert published > 0  # (regions of <= 4 clients are below the policy floor of 5)


def test_mlflow_run_holds_params_metrics_and_artifacts(small_run):
    from mlflow import MlflowClient

    summary, _, uri = small_run
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(summary["mlflow"]["run_id"])
    assert run.info.status == "FINISHED"
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.name == "e2e-small"
    params = run.data.params
    assert params["rounds"] == "5" and params["clients"] == "10" and params["seed"] == "3"
    assert params["drift.gamma"] == "0.5"
    tags = run.data.tags
    assert tags["clma.region_partition.version"] == "1"
    assert len(tags["clma.region_partition.content_hash"]) == 64
    assert tags["clma.prefect_flow_run_id"] == summary["prefect"]["flow_run_id"]
    # issue 14 item 6: the ledger of a stateless run lives in <out>/ledger, and the tag
    # points there (not at a throwaway /tmp/clma-state-* folder)
    ledger = (small_run[1] / "out" / "ledger" / "privacy_ledger.sqlite").resolve()
    assert tags["clma.budget.ledger_path"] == str(ledger) and ledger.is_file()
    hist = client.get_metric_history(run.info.run_id, "n_cohorts")
    assert sorted((m.step, m.value) for m in hist) == [
        (1, 1.0), (2, 1.0), (3, 3.0), (4, 3.0), (5, 3.0)
    ]
    # counts of clients never reach MLflow as numbers: the summary carries their bands
    # the floor m = max(config 2, policy minimum_group_size); 6 quarantined clients
    logged = set(run.data.metrics)
    assert not {"quarantined_clients", "flagged_clients", "divergence.n_flagged",
                "divergence.quarantined_atypical"} & logged
    assert not [k for k in logged if k.endswith(("n_flagged", "n_reweighted", "n_clients"))]
    from clma.engine.budget import policy_of
    from clma.release import count_band

    cfg = load_config(SMALL)
    m = max(cfg.evaluation.min_cohort, policy_of(cfg).evaluation.minimum_group_size)
    assert summary["rounds"][2]["quarantined_clients"] == count_band(6, m) != "none"
    assert summary["rounds"][0]["quarantined_clients"] == "none"
    truth = client.get_metric_history(run.info.run_id, "sim_truth.stationary_accuracy")
    assert len(truth) == 5
    # atypical clients: distribution statistics per round, flagged counts as bands
    def by_step(key):
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}

    assert sorted(by_step("divergence.representation.median")) == [1, 2, 3, 4, 5]
    div3 = summary["rounds"][2]["divergence"]
    from clma.release.aggregate import ParticipantBand

    bands = {"none", "below_minimum", *(b.value for b in ParticipantBand)}
    assert div3["n_flagged_band"] in bands
    assert div3["representation"]["n_flagged_band"] in bands

    def counts(d):  # every count of clients in the divergence summary, at any depth
        for k, v in d.items():
            if isinstance(v, dict):
                yield from counts(v)
            elif k.startswith(("n_", "quarantined")):
                yield k, v

    found = dict(counts(div3))
    assert found and all(k.endswith("_band") and v in bands for k, v in found.items()), found
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"cohort_history.json", "summary.json", "reports"} <= arts
    reports = {a.path for a in client.list_artifacts(run.info.run_id, "reports")}
    assert reports == {f"reports/round_00{r}.json" for r in range(1, 6)}
    local = client.download_artifacts(run.info.run_id, "cohort_history.json")
    hist_doc = json.loads(Path(local).read_text())
    assert hist_doc["rounds"]["3"] == {k: v for k, v in summary["rounds"][2]["cohorts"].items()}
    # no client ids anywhere in the cohort history artifact
    assert "members" not in json.dumps(hist_doc)


def test_same_seed_same_cohorts_and_numbers(prefect_harness, tmp_path, monkeypatch):
    import tempfile

    from flows.federation import federation_flow

    cfg = load_config(SMALL).with_overrides(rounds=4)
    cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"enabled": False})})
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    a = federation_flow(cfg)
    b = federation_flow(cfg)
    # no out folder, no state dir: the ledger was temporary and is gone (no stray files)
    assert sorted(tmp_path.glob("clma-state-*")) == []
    strip = lambda s: [{k: v for k, v in r.items() if k != "seconds"} for r in s["rounds"]]  # noqa: E731
    assert strip(a) == strip(b)
    assert a["sim_truth"] == b["sim_truth"]


def test_metric_key_makes_merged_region_names_valid_for_mlflow():
    from mlflow.utils.validation import _validate_metric_name

    from tasks.tracking import metric_key

    assert metric_key("regional.islands+west.accuracy") == "regional.islands_west.accuracy"
    assert metric_key("eval.global.accuracy.error_bar") == "eval.global.accuracy.error_bar"
    _validate_metric_name(metric_key("regional.a+b(c)*d.x"))  # raises if still invalid


def test_sqlite_store_keeps_artifacts_beside_the_database(tmp_path):
    from tasks.tracking import _artifact_location

    db = tmp_path / "s" / "mlflow.db"
    assert _artifact_location(f"sqlite:///{db}") == (tmp_path / "s" / "artifacts").as_uri()
    assert _artifact_location("http://127.0.0.1:5000") is None


def test_set_up_failure_releases_state_lock_and_fails_the_mlflow_run(
        tmp_path, monkeypatch, prefect_harness):
    """A failure after the state dir is locked and the MLflow run started, but before the
    round loop, must not leave the lock held (a `clma serve` process would refuse every later
    run of the federation) nor the MLflow run RUNNING."""
    from clma.state import StateStore
    from flows.federation import federation_flow
    from mlflow import MlflowClient
    from tasks.tracking import FederationTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)

    def boom(self, tags):
        raise RuntimeError("set-up failed after the MLflow run started")

    monkeypatch.setattr(FederationTracker, "set_tags", boom)
    state = tmp_path / "state"
    with pytest.raises(RuntimeError, match="set-up failed"):
        federation_flow(load_config(SMALL), state_dir=str(state))
    with StateStore(state).lock():  # raises StateLocked if the flow kept it
        pass
    client = MlflowClient(tracking_uri=uri)
    (exp,) = [e for e in client.search_experiments() if e.name == "e2e-small"]
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FAILED"
