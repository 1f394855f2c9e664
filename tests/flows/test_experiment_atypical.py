"""`clma experiment atypical-client`, tiny: 1 alpha, 1 perturbation, 4 rounds. Checks the
table files and columns, the statistics against a recomputation from the per-client scores,
and the MLflow layout (parent run with a nested child; the child keeps the production
schema: divergence statistics as metrics, no client id in any metric name)."""

from __future__ import annotations

import argparse
import csv
import json

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, prefect_harness):
    import os

    from flows.experiments import atypical_client as exp

    tmp = tmp_path_factory.mktemp("atypical")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    old = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    parser = argparse.ArgumentParser()
    exp.add_arguments(parser)
    args = parser.parse_args([
        "--out", str(tmp / "out"), "--alphas", "1", "--perturbations", "rotation",
        "--rounds", "4", "--seed", "2", "--probe-size", "64", "--experiment", "atyp-test",
    ])
    try:
        code = exp.run(args)
    finally:
        if old is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old
    return code, tmp / "out", uri


def test_table_files_and_columns(tiny_run):
    from flows.experiments.atypical_client import TABLE_COLUMNS

    code, out, _ = tiny_run
    assert code == 0
    with (out / "atypical_client.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == TABLE_COLUMNS
    assert len(rows) == 1
    row = rows[0]
    assert (row["alpha"], row["perturbation"], row["magnitude"]) == ("1.0", "rotation", "45.0")
    assert row["rounds_scored"] == "3"  # rounds 2..4
    md = (out / "atypical_client.md").read_text().splitlines()
    assert md[0] == "| " + " | ".join(TABLE_COLUMNS) + " |"
    assert len(md) == 3
    doc = json.loads((out / "atypical_client.json").read_text())
    assert doc["rounds_scored"] == "2..4" and doc["seed"] == 2
    assert [sorted(r) for r in doc["table"]] == [sorted(TABLE_COLUMNS)]


def test_statistics_match_the_per_client_scores(tiny_run):
    from sklearn.metrics import roc_auc_score

    _, out, _ = tiny_run
    with (out / "per_client_scores.csv").open() as fh:
        scores = [r for r in csv.DictReader(fh)]
    assert {r["round"] for r in scores} == {"1", "2", "3", "4"}
    assert len(scores) == 4 * 10
    row = json.loads((out / "atypical_client.json").read_text())["table"][0]
    late = [r for r in scores if int(r["round"]) >= 2]
    for signal in ("representation", "parameter"):
        labels = [int(r["client"] == "0") for r in late]
        z = [float(r[f"{signal}_z"]) for r in late]
        assert row[f"{signal}_auc"] == pytest.approx(roc_auc_score(labels, z))
        top = 0
        for rnd in ("2", "3", "4"):
            zr = {r["client"]: float(r[f"{signal}_z"]) for r in late if r["round"] == rnd}
            top += zr["0"] > max(v for c, v in zr.items() if c != "0")
        assert row[f"{signal}_top1_fraction"] == pytest.approx(top / 3)


def test_mlflow_parent_has_a_nested_child_with_id_free_metrics(tiny_run):
    from mlflow import MlflowClient

    _, out, uri = tiny_run
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("atyp-test")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 1
    assert parent.info.status == "FINISHED"
    arts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"atypical_client.md", "atypical_client.csv", "atypical_client.json"} <= arts
    assert "a1.rotation.representation.auc" in parent.data.metrics
    child = children[0]
    assert child.data.tags["clma.artifacts_client_ids"] == "simulation-ground-truth"
    assert len(child.data.tags["clma.probe_sha256"]) == 64
    for signal in ("representation", "parameter"):
        for k in ("median", "mad", "max_z"):
            hist = client.get_metric_history(child.info.run_id, f"divergence.{signal}.{k}")
            assert [m.step for m in hist] == [1, 2, 3, 4]
    # nothing per client and no count of clients: the divergence metrics are exactly the
    # 6 distribution statistics (counts are published as bands in summary.json)
    assert {n for n in child.data.metrics if n.startswith("divergence.")} == {
        f"divergence.{s}.{k}" for s in ("representation", "parameter")
        for k in ("median", "mad", "max_z")}
