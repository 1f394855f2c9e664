"""`clma experiment atypical-client`: the statistics on synthetic traces (fast), and a tiny
run (1 alpha, 1 perturbation, 2 seeds, 4 rounds): table files and columns, statistics and
the persistence EWMA recomputed by hand from the per-client traces, the figure reproduced
byte for byte from the traces, and the MLflow layout (parent run, one nested child per cell
tagged as simulation research output)."""

from __future__ import annotations

import argparse
import csv
import json
import math

import pytest

# ------------------------------------------------------------------ synthetic (fast)


def _trace(z_by_client: dict[int, list[float]], lam: float = 0.3, clip: float = 5.0):
    rows = []
    s = dict.fromkeys(z_by_client, 0.0)
    for t in range(len(next(iter(z_by_client.values())))):
        for c, zs in z_by_client.items():
            s[c] = lam * max(-clip, min(clip, zs[t])) + (1 - lam) * s[c]
            rows.append({"seed": 0, "alpha": 1.0, "perturbation": "rotation", "round": t + 1,
                         "client": c, "shifted": c == 0, "cohort": 0, "signal": "parameter",
                         "score": zs[t], "z": zs[t], "ewma": s[c]})
    return rows


def test_summarise_federation_on_a_hand_made_trace():
    from flows.experiments.atypical_client import summarise_federation

    # client 0 is far *below* the others from round 2 (a one-sided rule misses it)
    rows = _trace({0: [0.0, -4.0, -4.0, -4.0, -4.0], 1: [1.0, 1.0, -1.0, 1.0, -1.0],
                   2: [0.5, 0.2, 0.1, 0.0, 0.3], 3: [-0.5, 0.0, 0.5, 0.0, 0.5]})
    st = summarise_federation(rows, "parameter", 0)
    assert st["rounds_scored"] == 4
    assert st["mean_z_shifted"] == -4.0 and st["mean_abs_z_shifted"] == 4.0
    assert st["mean_rank"] == 4.0 and st["mean_rank_abs"] == 1.0
    assert st["top1"] == 0.0 and st["top1_abs"] == 1.0
    assert st["auc"] == 0.0 and st["auc_abs"] == 1.0
    assert st["rounds_flagged_one_sided"] == 0 and st["rounds_flagged_two_sided"] == 4
    # EWMA of client 0: 0, -1.2, -2.04, -2.628, ...: above 2 in |s| from round 3
    assert st["persistent_first_round"] == 3 and st["persistent_held_from"] == 3
    assert st["rounds_flagged_persistent"] == 3
    assert st["regular_persistent_clients"] == 0


def test_persistence_grid_recomputes_the_ewma_from_z():
    from flows.experiments.atypical_client import persistence_grid

    rows = _trace({0: [0.0, -4.0, -4.0, -4.0, -4.0], 1: [2.6, 2.6, 0.0, 0.0, 0.0],
                   2: [2.6, 2.6, 0.0, 0.0, 0.0], 3: [0.0] * 5})
    grid = {(g["lambda"], g["threshold"]): g
            for g in persistence_grid(rows, 0, lambdas=(0.3, 0.5), thresholds=(2.0, 3.1))
            if g["signal"] == "parameter"}
    # lam 0.3: client 0's s = -1.2, -2.04, -2.628, -3.0396 (rounds 2-5): > 2, never > 3.1;
    # regulars 1 and 2 peak at 0.3 * 2.6 + 0.7 * 0.78 = 1.326
    assert grid[(0.3, 2.0)]["feds_both"] == 1 and grid[(0.3, 3.1)]["feds_by_round"] == 0
    # lam 0.5: regulars reach 1.95 (< 2); client 0 reaches -3.75 at round 5 (> 3.1)
    assert grid[(0.5, 2.0)]["feds_regular_ok"] == 1 and grid[(0.5, 3.1)]["cells_ok"] == 1


def test_targets_at_and_below_their_thresholds():
    from flows.experiments.atypical_client import targets

    def cell(sig, z, auc, by10=3, reg=1):
        return {"alpha": 1.0, "perturbation": "blur", "signal": sig, "seeds": 3,
                "mean_abs_z_shifted": z, "auc_abs": auc, "seeds_persistent_by_10": by10,
                "max_regular_persistent": reg}

    at = targets([cell("representation", 2.0, 0.8), cell("parameter", 1.0, 0.5, 2, 0)])
    assert at["cells"]["a1 blur"]["representation"] == {"separation": True, "persistent": True}
    assert at["cells"]["a1 blur"]["parameter"] == {"separation": False, "persistent": False}
    assert at["separation_all_cells"] and at["persistent_cells"] == 1
    below = targets([cell("representation", 1.999, 0.9, 3, 2),
                     cell("parameter", 2.5, 0.799)])
    assert not below["separation_all_cells"]
    assert below["cells"]["a1 blur"]["representation"]["persistent"] is False  # 2 regulars
    assert below["persistent_cells"] == 1  # the parameter signal's


# ------------------------------------------------------------------ tiny run (slow)


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
        "--rounds", "4", "--seeds", "2", "3", "--probe-size", "64", "--workers", "1",
        "--experiment", "atyp-test",
    ])
    try:
        code = exp.run(args)
    finally:
        if old is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old
    return code, tmp / "out", uri


def _traces(out):
    with (out / "per_client_z.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    for r in rows:
        for k in ("seed", "round", "client", "cohort"):
            r[k] = int(r[k])
        for k in ("alpha", "score", "z", "ewma"):
            r[k] = float(r[k])
        r["shifted"] = r["shifted"] == "True"
    return rows


@pytest.mark.slow
def test_table_files_and_columns(tiny_run):
    from flows.experiments.atypical_client import CELL_COLUMNS, SEED_COLUMNS

    code, out, _ = tiny_run
    assert code == 0
    with (out / "atypical_client.csv").open() as fh:
        cells = list(csv.DictReader(fh))
    assert list(cells[0]) == CELL_COLUMNS
    assert [(c["signal"], c["seeds"]) for c in cells] == [("representation", "2"),
                                                           ("parameter", "2")]
    with (out / "atypical_client_seeds.csv").open() as fh:
        seeds = list(csv.DictReader(fh))
    assert list(seeds[0]) == SEED_COLUMNS and len(seeds) == 4
    doc = json.loads((out / "atypical_client.json").read_text())
    assert doc["seeds"] == [2, 3] and doc["rounds_scored"] == "2..4"
    assert set(doc["targets"]["cells"]) == {"a1 rotation"}
    assert (out / "figures" / "z_a1_rotation.png").stat().st_size > 0


@pytest.mark.slow
def test_statistics_and_ewma_match_the_traces(tiny_run):
    from sklearn.metrics import roc_auc_score

    _, out, _ = tiny_run
    traces = _traces(out)
    assert len(traces) == 2 * 4 * 10 * 2  # seeds x rounds x clients x signals
    seed_rows = json.loads((out / "atypical_client.json").read_text())["per_seed"]
    for st in seed_rows:
        mine = [r for r in traces if r["seed"] == st["seed"] and r["signal"] == st["signal"]]
        # the engine's persistence state is the literal EWMA of the clipped z from round 1
        s = {}
        for r in sorted(mine, key=lambda r: (r["round"], r["client"])):
            s[r["client"]] = 0.3 * max(-5.0, min(5.0, r["z"])) + 0.7 * s.get(r["client"], 0.0)
            assert r["ewma"] == pytest.approx(s[r["client"]], abs=1e-9)
        late = [r for r in mine if r["round"] >= 2]
        labels = [int(r["client"] == 0) for r in late]
        assert st["auc"] == pytest.approx(roc_auc_score(labels, [r["z"] for r in late]))
        assert st["auc_abs"] == pytest.approx(
            roc_auc_score(labels, [abs(r["z"]) for r in late]))
        z0 = [r["z"] for r in late if r["client"] == 0]
        assert st["mean_abs_z_shifted"] == pytest.approx(sum(map(abs, z0)) / 3)
        first = [r["round"] for r in sorted(mine, key=lambda r: r["round"])
                 if r["client"] == 0 and abs(r["ewma"]) > 2.0]
        assert st["persistent_first_round"] == (first[0] if first else None)
    cells = json.loads((out / "atypical_client.json").read_text())["cells"]
    for c in cells:
        both = [r for r in seed_rows if r["signal"] == c["signal"]]
        assert c["auc_abs"] == pytest.approx(sum(r["auc_abs"] for r in both) / 2)
        assert not math.isnan(c["mean_rank"])


@pytest.mark.slow
def test_figure_reproduces_from_the_traces(tiny_run, tmp_path):
    from flows.experiments.atypical_client import plot_cell

    _, out, _ = tiny_run
    again = tmp_path / "z.png"
    plot_cell(_traces(out), 1.0, "rotation", 0, again)
    assert again.read_bytes() == (out / "figures" / "z_a1_rotation.png").read_bytes()


@pytest.mark.slow
def test_mlflow_parent_and_a_nested_child_per_cell(tiny_run):
    from mlflow import MlflowClient

    _, _, uri = tiny_run
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("atyp-test")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["clma.artifacts_client_ids"] == "simulation-ground-truth"
    arts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"atypical_client.md", "atypical_client.csv", "atypical_client.json",
            "per_client_z.csv", "figures"} <= arts
    assert "a1.rotation.representation.auc_abs" in parent.data.metrics
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 1
    child = children[0]
    assert child.data.tags["clma.artifacts_client_ids"] == "simulation-ground-truth"
    assert {a.path for a in client.list_artifacts(child.info.run_id, "figures")} == {
        "figures/z_a1_rotation.png"}
    assert "parameter.auc_abs" in child.data.metrics
