"""Reduced regional-regression scenario through the Prefect flow: covariate drift in the
small region fires that region's accuracy alert within the cadence, the global metric's
change stays within its bars; envelopes and alerts land in MLflow and the out folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from clma.config import validate_config
from clma.regions import load_partition

REGIONS = Path(__file__).with_name("regions_two.toml")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def scenario(tmp_path_factory, prefect_harness):
    tmp = tmp_path_factory.mktemp("rr")
    coast = sorted(c for c, r in load_partition(REGIONS).assign(50, 7).items() if r == "coast")
    cfg = validate_config({
        "name": "rr-small", "seed": 7, "rounds": 6, "clients": 50,
        "data": {"probe_size": 32, "region_partition": str(REGIONS),
                 "local_eval_fraction": 0.35},
        "drift": {"events": [{"round": 5, "kind": "gaussian_noise", "magnitude": 1.0,
                              "family": "coast-noise", "clients": coast}]},
        "training": {"local_epochs": 10, "learning_rate": 0.5},
        # seeded noise: the test checks the mechanism on one fixed draw (with fresh OpenDP
        # noise, whether a 0.3-wide alert fires is itself random)
        "evaluation": {"every": 2, "epsilon": 2.0, "baseline_from_round": 4,
                       "noise_seeded": True},
        "divergence": {"enabled": False}, "budget": {"enabled": False},
        "orchestration": {"chunk_size": 25},
    })
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    old = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        from flows.federation import federation_flow

        summary = federation_flow(cfg, out_dir=str(tmp / "out"))
    finally:
        if old is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old
    from flows.experiments.regional_regression import scenario_report

    return scenario_report(summary, "coast", "accuracy"), summary, tmp, uri


def test_regional_alert_fires_and_global_does_not(scenario):
    rep, _, _, _ = scenario
    rows = {r["round"]: r for r in rep["rows"]}
    assert sorted(rows) == [2, 4, 6]  # cadence: every 2 rounds
    assert rows[6]["alert"] is True and rows[6]["global_alert"] is False
    assert rows[4]["alert"] is False  # the baseline round
    drop = rows[4]["value"] - rows[6]["value"]
    assert drop > rows[4]["error_bar"] + rows[6]["error_bar"]
    g = abs(rows[6]["global_value"] - rows[4]["global_value"])
    assert g <= rows[4]["global_error_bar"] + rows[6]["global_error_bar"]


def test_envelopes_and_alerts_in_mlflow_and_out_folder(scenario):
    from clma.release import FederatedMetricEnvelope
    from mlflow import MlflowClient

    _, summary, tmp, uri = scenario
    client = MlflowClient(tracking_uri=uri)
    run_id = summary["mlflow"]["run_id"]
    fired = {m.step: m.value for m in client.get_metric_history(run_id, "alerts_fired")}
    assert fired[6] >= 1.0 and fired[2] == 0.0
    path = client.download_artifacts(run_id, "envelopes/round_006/accuracy/coast.json")
    env = FederatedMetricEnvelope.from_json(Path(path).read_text())
    assert env.participant_count_band.value == "double_to_under_fourfold"  # 10 of floor 5
    doc = json.loads(Path(client.download_artifacts(run_id, "alerts/round_006.json")).read_text())
    assert any(a["region"] == "coast" and a["metric"] == "accuracy" for a in doc["alerts"])
    local = tmp / "out" / "envelopes" / "round_006" / "accuracy" / "coast.json"
    assert local.read_text() == Path(path).read_text()
    assert "contributors" not in json.dumps(summary)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--region", "atlantis"], "--region 'atlantis': not a region of the partition"),
    (["--metric", "nope"], "--metric 'nope': must be one of accuracy, mean_loss"),
    (["--config", "/nonexistent/cfg.toml"], "cannot be read"),
])
def test_experiment_bad_arguments_exit_2_before_running(capsys, tmp_path, argv, needle):
    from flows.cli import main

    out = tmp_path / "out"
    rc = main(["experiment", "regional-regression", "--no-tracking", "--out", str(out), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1
    assert not out.exists()  # nothing half-written
