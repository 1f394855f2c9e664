"""`clma experiment atypical-client-sweep`: every score against its literal formula, the
summary's counting rule, argument errors, and a tiny end-to-end run (files + MLflow run)."""

from __future__ import annotations

import argparse
import csv
import json

import numpy as np
import pytest
from scipy.spatial.distance import cosine

from clma.divergence import hierarchical_divergence, robust_z
from flows.experiments import atypical_client_sweep as sweep


def _affinities(rng, n_layers=2, p=6):
    out = []
    for _ in range(n_layers):
        a = rng.uniform(0, 1, (p, p))
        k = (a + a.T) / 2
        np.fill_diagonal(k, 1.0)
        out.append(k)
    return out


def _change(k, start):
    iu = np.triu_indices(start[0].shape[0], 1)
    return np.concatenate([(k[layer] - start[layer])[iu] for layer in range(len(start))])


def test_round_scores_against_literal_formulas():
    rng = np.random.default_rng(1)
    beta = 0.7
    start = _affinities(rng)
    aggregate = _affinities(rng)
    clients = [_affinities(rng) for _ in range(4)]
    updates = rng.normal(size=(4, 9))
    got = sweep.round_scores(start, clients, aggregate, updates, beta)
    assert set(got) == set(sweep.SCORES) - {"representation_cumulative_z"}
    h = hierarchical_divergence
    np.testing.assert_allclose(got["representation"], [h(start, k, beta=beta) for k in clients])
    np.testing.assert_allclose(got["representation_aggregate"],
                               [h(aggregate, k, beta=beta) for k in clients])
    for i, k in enumerate(clients):
        others = [c for j, c in enumerate(clients) if j != i]
        mean_aff = [np.mean([o[layer] for o in others], axis=0) for layer in range(2)]
        assert got["representation_consensus"][i] == pytest.approx(h(mean_aff, k, beta=beta))
        pair = [h(k, o, beta=beta) for o in others]
        assert got["representation_pairwise_median"][i] == pytest.approx(np.median(pair))
        mean_change = np.mean([_change(o, start) for o in others], axis=0)
        assert got["representation_update_cosine"][i] == pytest.approx(
            cosine(_change(k, start), mean_change))
        mean_up = np.delete(updates, i, axis=0).mean(axis=0)
        assert got["parameter"][i] == pytest.approx(cosine(updates[i], mean_up), rel=1e-6)


def test_summarise_counts_cells_at_target():
    cells = []
    for seed, tops in ((0, (0.9, 0.7, 1.0)), (1, (0.7, 0.9, 0.2))):
        for p, t in zip(sweep.PERTURBATIONS, tops, strict=True):
            cells.append({"regime": "default", "score": "parameter", "alpha": 10.0,
                          "perturbation": p, "seed": seed, "top1_fraction": t, "auc": 0.5})
    (row,) = sweep.summarise(cells, [10.0], list(sweep.PERTURBATIONS))
    # means over seeds: 0.8 (at target, >=), 0.8, 0.6
    assert row["a10 gaussian_noise"] == pytest.approx(0.8)
    assert row["a10 rotation"] == pytest.approx(0.8)
    assert row["a10 blur"] == pytest.approx(0.6)
    assert row["cells_at_target"] == 2
    assert row["mean_auc"] == pytest.approx(0.5)


def test_summarise_ignores_alphas_outside_the_target():
    cells = [{"regime": "default", "score": "parameter", "alpha": 0.1, "perturbation": "blur",
              "seed": 0, "top1_fraction": 1.0, "auc": 1.0}]
    (row,) = sweep.summarise(cells, [0.1], ["blur"])
    assert row["cells_at_target"] == 0


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "1"], "--rounds"),
    (["--clients", "2"], "--clients"),
    (["--workers", "0"], "--workers"),
    (["--alphas", "0"], "--alphas"),
])
def test_bad_arguments_exit_2(argv, message, capsys):
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    assert sweep.run(parser.parse_args(argv)) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_run_cell_top1_and_auc_from_its_own_z(monkeypatch):
    """The cell's statistics are the strict top-1 fraction and the pooled AUC of its z."""
    captured = []
    real = robust_z

    def spy(values):
        z = real(values)
        captured.append(z)
        return z

    monkeypatch.setattr("clma.divergence.robust_z", spy)
    rows = sweep.run_cell("default", 10.0, "blur", seed=3, rounds=3, clients=4)
    assert [r["score"] for r in rows] == list(sweep.SCORES)
    per_round = len(sweep.SCORES) - 1  # the cumulative score reuses representation's z
    assert len(captured) == 3 * per_round
    rep = np.array([captured[r * per_round] for r in range(3)])  # representation: first key
    row = rows[0]
    assert row["rounds_scored"] == 2
    assert row["top1_fraction"] == np.mean([rep[r, 0] > rep[r, 1:].max() for r in (1, 2)])
    assert row["mean_z_shifted"] == pytest.approx(rep[1:, 0].mean())
    cum = rows[sweep.SCORES.index("representation_cumulative_z")]
    cum_z = [rep[: r + 1].mean(axis=0) for r in (1, 2)]
    assert cum["mean_z_shifted"] == pytest.approx(np.mean([z[0] for z in cum_z]))


@pytest.mark.slow
def test_end_to_end_files_and_mlflow(tmp_path, monkeypatch, prefect_harness):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    args = parser.parse_args([
        "--out", str(tmp_path / "out"), "--regimes", "default", "--alphas", "1",
        "--perturbations", "rotation", "--seeds", "4", "--rounds", "2", "--clients", "3",
        "--workers", "1", "--experiment", "sweep-test"])
    assert sweep.run(args) == 0
    out = tmp_path / "out"
    with (out / "atypical_client_sweep_cells.csv").open() as fh:
        cells = list(csv.DictReader(fh))
    assert [c["score"] for c in cells] == list(sweep.SCORES)
    assert {c["seed"] for c in cells} == {"4"}
    doc = json.loads((out / "atypical_client_sweep.json").read_text())
    assert doc["command"] == "clma experiment atypical-client-sweep"
    assert [r["score"] for r in doc["summary"]] == list(sweep.SCORES)
    md = (out / "atypical_client_sweep.md").read_text().splitlines()
    assert len(md) == 2 + len(sweep.SCORES)
    client = mlflow.MlflowClient(uri)
    (exp,) = [e for e in client.search_experiments() if e.name == "sweep-test"]
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"atypical_client_sweep.md", "atypical_client_sweep_cells.csv",
            "atypical_client_sweep.json"} <= names
