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

import numpy as np
import pytest

# ------------------------------------------------------------------ synthetic (fast)


def _trace(z_by_client: dict[int, list[float]]):
    """Trace rows of one federation; ``ewma`` left 0 (the statistics recompute it from z)."""
    rows = []
    for t in range(len(next(iter(z_by_client.values())))):
        for c, zs in z_by_client.items():
            rows.append({"seed": 0, "alpha": 1.0, "perturbation": "rotation", "round": t + 1,
                         "client": c, "shifted": c == 0, "cohort": 0, "signal": "parameter",
                         "score": zs[t], "z": zs[t], "ewma": 0.0})
    return rows


def _by_hand(z_by_client, lam, clip, threshold, relative, z_threshold=3.0):
    """(round -> s per client, round -> flagged set), the rule written out with scipy."""
    from scipy import stats

    s = dict.fromkeys(z_by_client, 0.0)
    states, flagged = {}, {}
    for t in range(len(next(iter(z_by_client.values())))):
        for c, zs in z_by_client.items():
            s[c] = lam * max(-clip, min(clip, zs[t])) + (1 - lam) * s[c]
        ids = sorted(s)
        v = np.array([s[c] for c in ids])
        q = (v - np.median(v)) / stats.median_abs_deviation(v, scale="normal")
        states[t + 1] = dict(s)
        flagged[t + 1] = {c for c, a, b in zip(ids, v, q, strict=True)
                          if abs(a) > threshold and (not relative or abs(b) > z_threshold)}
    return states, flagged


HAND = {0: [0.0, -4.0, -4.0, -4.0, -4.0], 1: [1.0, 1.0, -1.0, 1.0, -1.0],
        2: [0.5, 0.2, 0.1, 0.0, 0.3], 3: [-0.5, 0.0, 0.5, 0.0, 0.5]}


def test_summarise_federation_on_a_hand_made_trace():
    from flows.experiments.atypical_client import summarise_federation

    # client 0 is far *below* the others from round 2 (a one-sided rule misses it)
    st = summarise_federation(_trace(HAND), "parameter", 0)
    assert st["rounds_scored"] == 4
    assert st["mean_z_shifted"] == -4.0 and st["mean_abs_z_shifted"] == 4.0
    assert st["mean_rank"] == 4.0 and st["mean_rank_abs"] == 1.0
    assert st["top1"] == 0.0 and st["top1_abs"] == 1.0
    assert st["auc"] == 0.0 and st["auc_abs"] == 1.0
    assert st["rounds_flagged_one_sided"] == 0 and st["rounds_flagged_two_sided"] == 4
    # default rule (lam 0.3, clip 3): s of client 0 = 0, -0.9, -1.53, -1.971, -2.2797;
    # |s| > 2 first at round 5, where its robust z across the 4 clients is -12.6 (< -3)
    states, flagged = _by_hand(HAND, 0.3, 3.0, 2.0, True)
    assert states[5][0] == pytest.approx(-3 * (1 - 0.7 ** 4))
    assert [t for t in flagged if 0 in flagged[t]] == [5]
    assert st["persistent_first_round"] == 5 and st["persistent_held_from"] == 5
    assert st["rounds_flagged_persistent"] == 1
    assert st["regular_persistent_clients"] == 0


def test_persistence_trace_is_the_library_rule_written_out():
    from flows.experiments.atypical_client import PersistenceRule, persistence_trace

    for rule in (PersistenceRule("r", 0.3, 3.0, 2.0, True),
                 PersistenceRule("a", 0.5, 5.0, 1.0, False),
                 PersistenceRule("r2", 0.5, 5.0, 1.0, True)):
        rows = _trace(HAND)
        out = persistence_trace(rows, rule)
        assert all(r["ewma"] == 0.0 for r in rows)  # input not changed
        states, flagged = _by_hand(HAND, rule.lam, rule.clip, rule.threshold, rule.relative)
        for r in out:
            assert r["ewma"] == pytest.approx(states[r["round"]][r["client"]], abs=1e-12)
            assert r["persistent"] is (r["client"] in flagged[r["round"]])
        assert any(r["persistent"] for r in out)
    # the relative condition removes the flags the absolute one alone raises when every
    # client's s is high alike (ALIKE), and keeps the one that stands out
    absolute = persistence_trace(_trace(ALIKE), PersistenceRule("a", 0.3, 5.0, 2.0, False))
    relative = persistence_trace(_trace(ALIKE), PersistenceRule("r", 0.3, 5.0, 2.0, True))
    rel = {(r["round"], r["client"]) for r in relative if r["persistent"]}
    assert rel < {(r["round"], r["client"]) for r in absolute if r["persistent"]}
    assert {c for _, c in rel} == {0}


#: Every regular client high alike (z 2.2-2.8, as in the first rounds when all clients
#: are still converging); client 0 at -4 from round 2.
ALIKE = {0: [0.0, -4.0, -4.0, -4.0, -4.0, -4.0],
         **{c: [2.2 + 0.15 * (c - 1)] * 6 for c in range(1, 6)}}


def test_persistence_rules_recompute_each_rule_from_z():
    from flows.experiments.atypical_client import PersistenceRule, persistence_rules

    rules = (PersistenceRule("absolute", 0.3, 5.0, 2.0, False),
             PersistenceRule("both", 0.3, 5.0, 2.0, True))
    got = {(g["rule"], g["signal"]): g for g in persistence_rules(_trace(ALIKE), 0, rules)}
    for rule in rules:
        _, flagged = _by_hand(ALIKE, rule.lam, rule.clip, rule.threshold, rule.relative)
        regular = {c for f in flagged.values() for c in f if c != 0}
        g = got[(rule.name, "parameter")]
        assert g["federations"] == 1 and g["cells"] == 1
        assert g["regular_flagged"] == len(regular)
        assert g["feds_by_round"] == int(any(0 in f for f in flagged.values()))
        assert g["feds_both"] == int(g["feds_by_round"] == 1 and len(regular) <= 1)
        assert g["cells_ok"] == g["feds_both"]
    # the warm-up and the relative condition alone, written out
    more = (PersistenceRule("warm", 0.3, 5.0, 2.0, relative=False, warmup=4),
            PersistenceRule("rel", 0.3, 5.0, 2.0, absolute=False))
    rows = {(g["rule"], g["signal"]): g for g in persistence_rules(_trace(ALIKE), 0, more)}
    _, absolute = _by_hand(ALIKE, 0.3, 5.0, 2.0, False)
    _, relative = _by_hand(ALIKE, 0.3, 5.0, -1.0, True)  # |s| > -1: the relative part only
    warm = {c for t, f in absolute.items() if t >= 4 for c in f if c != 0}
    assert rows[("warm", "parameter")]["regular_flagged"] == len(warm)
    assert rows[("rel", "parameter")]["regular_flagged"] == len(
        {c for f in relative.values() for c in f if c != 0})
    # absolute: s = z (1 - 0.7^t) passes 2 by round 6 for the four regulars at z >= 2.35
    # (2.2 (1 - 0.7^6) = 1.94 does not); both: only client 0
    assert got[("absolute", "parameter")]["regular_flagged"] == 4
    assert got[("absolute", "parameter")]["cells_ok"] == 0
    assert got[("both", "parameter")]["regular_flagged"] == 0
    assert got[("both", "parameter")]["cells_ok"] == 1


def test_regular_client_diagnostics_against_their_formulas():
    from flows.experiments.atypical_client import regular_client_diagnostics

    rng = np.random.default_rng(7)
    rounds, regular = 40, 8
    level = np.linspace(-1.0, 1.0, regular)  # each regular client keeps a level of its own
    z = {0: list(rng.normal(5.0, 1.0, rounds))}
    for i in range(regular):
        z[i + 1] = list(level[i] + rng.normal(0.0, 1.0, rounds))
    z[1][10] = 9.0  # one burst
    rows = _trace(z)
    d = {r["signal"]: r for r in regular_client_diagnostics(rows, 0, lam=0.3, clip=5.0)}
    p = d["parameter"]
    reg = np.array([z[c][1:] for c in range(1, regular + 1)])  # rounds 2..R
    assert p["pairs"] == reg.size
    assert p["p_abs_z_gt3"] == pytest.approx(np.mean(np.abs(reg) > 3))
    assert p["p_abs_z_gt5"] == pytest.approx(1 / reg.size)
    assert p["sd_clipped_z"] == pytest.approx(np.std(np.clip(reg, -5, 5)))
    assert p["sd_client_mean_z"] == pytest.approx(np.std(np.clip(reg, -5, 5).mean(axis=1)))
    assert p["sd_client_mean_iid"] == pytest.approx(p["sd_clipped_z"] / math.sqrt(rounds - 1))
    assert p["sd_ewma_iid_normal"] == pytest.approx(math.sqrt(0.3 / 1.7))
    # the levels' spread (sd 0.65) shows: the client means spread well beyond the iid value
    assert p["sd_client_mean_z"] > 2 * p["sd_client_mean_iid"]


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
        for k in ("alpha", "score", "z", "ewma", "engine_ewma"):
            r[k] = float(r[k])
        r["shifted"] = r["shifted"] == "True"
        r["persistent"] = r["persistent"] == "True"
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
        # the recorded persistence state is the literal EWMA of the z clipped at 3 from
        # round 1, and the engine's own state in this (uncached) run is the same
        s = {}
        for r in sorted(mine, key=lambda r: (r["round"], r["client"])):
            s[r["client"]] = 0.3 * max(-3.0, min(3.0, r["z"])) + 0.7 * s.get(r["client"], 0.0)
            assert r["ewma"] == pytest.approx(s[r["client"]], abs=1e-9)
            assert r["engine_ewma"] == pytest.approx(s[r["client"]], abs=1e-9)
        late = [r for r in mine if r["round"] >= 2]
        labels = [int(r["client"] == 0) for r in late]
        assert st["auc"] == pytest.approx(roc_auc_score(labels, [r["z"] for r in late]))
        assert st["auc_abs"] == pytest.approx(
            roc_auc_score(labels, [abs(r["z"]) for r in late]))
        z0 = [r["z"] for r in late if r["client"] == 0]
        assert st["mean_abs_z_shifted"] == pytest.approx(sum(map(abs, z0)) / 3)
        first = [r["round"] for r in sorted(mine, key=lambda r: r["round"])
                 if r["client"] == 0 and r["persistent"]]
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
