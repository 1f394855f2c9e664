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
    args_list = [
        "--out", str(tmp_path / "out"), "--regimes", "default", "--alphas", "1",
        "--perturbations", "rotation", "--seeds", "4", "--rounds", "2", "--clients", "3",
        "--workers", "1", "--experiment", "sweep-test"]
    args = parser.parse_args(args_list)
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
    assert {"atypical_client_sweep.md", "atypical_client_sweep_cell_means.md",
            "atypical_client_sweep_cells.csv", "atypical_client_sweep.json"} <= names
    means = (out / "atypical_client_sweep_cell_means.md").read_text().splitlines()
    assert len(means) == 2 + len(sweep.SCORES)  # one (alpha, perturbation) cell per score
    assert [r["score"] for r in doc["cell_means"]] == list(sweep.SCORES)
    assert (out / "cells" / "default_a1_rotation_s4_R2_n3.json").exists()

    # --resume: the finished federation is read back, not recomputed; same cells
    def no_rerun(*job):
        raise AssertionError(f"--resume recomputed {job}")

    monkeypatch.setattr(sweep, "run_cell", no_rerun)
    assert sweep.run(parser.parse_args([*args_list, "--resume"])) == 0
    with (out / "atypical_client_sweep_cells.csv").open() as fh:
        assert list(csv.DictReader(fh)) == cells


# ------------------------------------------------------------------ issue 20 readings


def _literal_robust_z(x):
    x = np.asarray(x, dtype=float)
    med = np.median(x)
    return (x - med) / (1.482602218505602 * np.median(np.abs(x - med)))


def test_federation_readings_against_literal_formulas():
    """Ranks, regular spread and the persistent flag of a synthetic z matrix, by hand:
    s_t = 0.3 clip(z_t, -3, 3) + 0.7 s_{t-1}, flagged when |s| > 2 and |robust z of s
    across the round's clients| > 3 (the library's defaults)."""
    from clma.config import DivergenceConfig

    rng = np.random.default_rng(7)
    rounds, n = 14, 8
    z = rng.normal(size=(rounds, n))
    z[2:, 0] = 4.0 + rng.uniform(0, 1, rounds - 2)  # shifted client 0: high from round 3
    z[:6, 3] = -6.0  # a regular client atypical (low) in rounds 1..6 only
    got = sweep.federation_readings(z, 0, DivergenceConfig())

    scored = z[1:]  # rounds 2..R
    rank = 1 + (scored[:, 1:] > scored[:, [0]]).sum(axis=1)
    rank_abs = 1 + (np.abs(scored[:, 1:]) > np.abs(scored[:, [0]])).sum(axis=1)
    assert got["mean_rank"] == pytest.approx(rank.mean())
    assert got["mean_rank_abs"] == pytest.approx(rank_abs.mean())
    regular = scored[:, 1:]
    half = len(scored) // 2
    assert got["regular_median_z"] == pytest.approx(np.median(regular))
    assert got["regular_abs_z_p90_early"] == pytest.approx(
        np.percentile(np.abs(regular[:half]), 90))
    assert got["regular_abs_z_p90_late"] == pytest.approx(
        np.percentile(np.abs(regular[half:]), 90))
    assert got["rounds_flagged_two_sided"] == int((np.abs(scored[:, 0]) > 3).sum())

    s = np.zeros(n)
    flagged = []
    for t in range(rounds):
        s = 0.3 * np.clip(z[t], -3, 3) + 0.7 * s
        zs = _literal_robust_z(s)
        flagged.append({c for c in range(n) if abs(s[c]) > 2 and abs(zs[c]) > 3})
    first = next(t + 1 for t in range(rounds) if 0 in flagged[t])
    held = min(t + 1 for t in range(rounds) if all(0 in f for f in flagged[t:]))
    assert got["persistent_first_round"] == first
    assert got["persistent_held_from"] == held
    assert got["regular_persistent_clients"] == len(set().union(*flagged) - {0})
    # the synthetic federation exercises both branches: a regular client flagged, the
    # shifted one only after its EWMA has built up (4 rounds at the clip from s = 0)
    assert got["regular_persistent_clients"] == 1
    assert first >= 3 + 3


def test_federation_readings_never_flagged():
    from clma.config import DivergenceConfig

    z = np.random.default_rng(3).normal(size=(6, 5)) * 0.5
    got = sweep.federation_readings(z, 0, DivergenceConfig())
    assert got["persistent_first_round"] is None
    assert got["persistent_held_from"] is None
    assert got["regular_persistent_clients"] == 0


def _cell(seed, alpha, pert, *, abs_z, auc_abs, first, regular=0, score="representation"):
    return {"regime": "default", "score": score, "alpha": alpha, "perturbation": pert,
            "seed": seed, "top1_fraction": 0.5, "top1_abs_z_fraction": 0.5, "auc": 0.5,
            "auc_abs_z": auc_abs, "mean_z_shifted": -abs_z, "mean_abs_z_shifted": abs_z,
            "mean_rank": 2.0, "mean_rank_abs": 1.5, "regular_abs_z_p90_early": 1.0,
            "regular_abs_z_p90_late": 1.0, "persistent_first_round": first,
            "regular_persistent_clients": regular}


def test_cell_means_targets_at_below_and_above_thresholds():
    cells = [
        # gaussian_noise: seed means |z| 2.0 (at), AUC 0.8 (at) -> separated; flagged by 10
        # in both seeds, one regular client at most -> persistent
        _cell(0, 10.0, "gaussian_noise", abs_z=1.5, auc_abs=0.7, first=10, regular=1),
        _cell(1, 10.0, "gaussian_noise", abs_z=2.5, auc_abs=0.9, first=4),
        # rotation: |z| mean 1.99 (below) -> not separated; round 11 in one seed -> not
        # persistent
        _cell(0, 10.0, "rotation", abs_z=1.98, auc_abs=0.95, first=11),
        _cell(1, 10.0, "rotation", abs_z=2.0, auc_abs=0.95, first=2),
        # blur: AUC 0.79 -> not separated; never flagged in one seed -> not persistent
        _cell(0, 10.0, "blur", abs_z=5.0, auc_abs=0.79, first=None),
        _cell(1, 10.0, "blur", abs_z=5.0, auc_abs=0.79, first=3, regular=0),
        # alpha 1 gaussian_noise: separated, but two regular clients flagged -> not persistent
        _cell(0, 1.0, "gaussian_noise", abs_z=3.0, auc_abs=0.85, first=5, regular=2),
    ]
    means = {(m["alpha"], m["perturbation"]): m for m in sweep.cell_means(cells)}
    m = means[(10.0, "gaussian_noise")]
    assert m["mean_abs_z_shifted"] == pytest.approx(2.0)
    assert m["auc_abs_z"] == pytest.approx(0.8)
    assert m["separated"] and m["persistent"]
    assert m["persistent_first_round"] == pytest.approx(7.0)
    assert m["seeds_persistent_by_10"] == 2 and m["max_regular_persistent"] == 1
    m = means[(10.0, "rotation")]
    assert not m["separated"] and not m["persistent"] and m["seeds_persistent_by_10"] == 1
    m = means[(10.0, "blur")]
    assert not m["separated"] and not m["persistent"]
    assert m["persistent_first_round"] == pytest.approx(3.0)  # mean over flagged seeds only
    m = means[(1.0, "gaussian_noise")]
    assert m["separated"] and not m["persistent"]
    (row,) = sweep.summarise(cells, [10.0, 1.0], ["gaussian_noise", "rotation", "blur"])
    assert row["cells_separated"] == 2
    assert row["cells_persistent"] == 1
    assert row["mean_auc_abs"] == pytest.approx(np.mean([c["auc_abs_z"] for c in cells]))


def test_cell_files_round_trip_and_reject_other_columns(tmp_path):
    job = ("default", 10.0, "blur", 2, 30, 10)
    path = sweep.cell_path(tmp_path, job)
    assert path == tmp_path / "cells" / "default_a10_blur_s2_R30_n10.json"
    rows = [{"regime": "default", "score": "parameter", "auc": 0.7}]
    sweep._save_cell(path, rows, 12.5)
    assert sweep._load_cell(path) == rows
    assert not path.with_suffix(".tmp").exists()
    doc = json.loads(path.read_text())
    doc["columns"] = doc["columns"][:-1]  # a file written by a sweep with other columns
    path.write_text(json.dumps(doc))
    assert sweep._load_cell(path) is None
    path.write_text("{not json")
    assert sweep._load_cell(path) is None
