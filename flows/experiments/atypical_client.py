"""Atypical-client detection: representation divergence vs the parameter-space baseline.

Issue 6, "How it is checked". On the handwritten digits, 10 clients, Dirichlet(alpha)
label partitions for each alpha, and one client (``--shifted-client``, default 0) whose data
(training and local evaluation) is perturbed from round 1 on by a drift event of kind
``gaussian_noise`` / ``rotation`` / ``blur`` (one federation per (alpha, perturbation)); no
other drift; CLMA cohorting on; divergence action ``report`` (aggregation unchanged).

Default magnitudes (8x8 images in [0, 1], see :mod:`clma.sim.drift`):

* ``gaussian_noise``: additive N(0, 0.3^2) pixel noise, clipped to [0, 1];
* ``rotation``: every image rotated by 45 degrees (bilinear);
* ``blur``: Gaussian filter with sigma 1.0 pixel.

Every round, every client gets the representation divergence ``D_c`` to its cohort's start
model on the shared probe set and the parameter baseline (leave-one-out cosine distance of
its update to the mean update), each with its robust z (:mod:`tasks.divergence`). Over rounds
2..R the experiment reports, per signal, the fraction of rounds in which the shifted client
has the highest z (strictly) and the ROC AUC (``sklearn.metrics.roc_auc_score``) of z for
separating the shifted client from the regular clients, pooling all (round, client) pairs.
Diagnostic extra: the fraction of rounds in which the shifted client has the largest ``|z|``
(a two-sided reading; flagging itself is one-sided, ``z > z_threshold``).

MLflow: one parent run (experiment ``--experiment``, default ``atypical-client``) with the
table as artifacts (``atypical_client.{md,csv,json}``) and per-cell metrics; one nested
child run per (alpha, perturbation): the federation run itself (production schema: no client
ids) plus, because this is a simulation, ``per_client_scores.csv`` / ``.json`` artifacts with
client ids, and the tag ``clma.artifacts_client_ids = simulation-ground-truth``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

DESCRIPTION = (
    "one perturbed client among --clients (default 10; digits, Dirichlet alpha 10/1/0.1): does it "
    "rank first by representation divergence? by the parameter baseline? (MLflow, nested runs)"
)

PERTURBATIONS = ("gaussian_noise", "rotation", "blur")
DEFAULT_MAGNITUDE = {"gaussian_noise": 0.3, "rotation": 45.0, "blur": 1.0}
SIGNALS = ("representation", "parameter")

#: Columns of the result table (one row per (alpha, perturbation)).
TABLE_COLUMNS = [
    "alpha",
    "perturbation",
    "magnitude",
    "rounds_scored",
    "representation_top1_fraction",
    "representation_auc",
    "representation_mean_z_shifted",
    "representation_rounds_flagged",
    "representation_top1_abs_z_fraction",
    "parameter_top1_fraction",
    "parameter_auc",
    "parameter_mean_z_shifted",
    "parameter_rounds_flagged",
    "parameter_top1_abs_z_fraction",
    "regular_flags_representation",
    "regular_flags_parameter",
    "shifted_quarantined",
]

#: Columns of the per-round, per-client score file (simulation ground truth: client ids).
SCORE_COLUMNS = [
    "alpha", "perturbation", "round", "client", "shifted", "cohort",
    "representation_score", "representation_z", "representation_flagged",
    "parameter_score", "parameter_z", "parameter_flagged",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("runs/atypical-client"),
                        help="output folder for the table (default: runs/atypical-client)")
    parser.add_argument("--alphas", type=float, nargs="+", default=[10.0, 1.0, 0.1],
                        help="Dirichlet concentrations (default: 10 1 0.1)")
    parser.add_argument("--perturbations", nargs="+", choices=PERTURBATIONS,
                        default=list(PERTURBATIONS), help="perturbations (default: all three)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds (default 10)")
    parser.add_argument("--clients", type=int, default=10, help="clients (default 10)")
    parser.add_argument("--shifted-client", type=int, default=0,
                        help="id of the perturbed client (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="federation seed (default 0)")
    parser.add_argument("--probe-size", type=int, default=128, help="probe samples (default 128)")
    parser.add_argument("--noise-std", type=float, default=DEFAULT_MAGNITUDE["gaussian_noise"],
                        help="gaussian_noise std on [0, 1] pixels (default 0.3)")
    parser.add_argument("--rotation-deg", type=float, default=DEFAULT_MAGNITUDE["rotation"],
                        help="rotation angle in degrees (default 45)")
    parser.add_argument("--blur-sigma", type=float, default=DEFAULT_MAGNITUDE["blur"],
                        help="blur Gaussian sigma in pixels (default 1.0)")
    parser.add_argument("--experiment", default="atypical-client",
                        help="MLflow experiment name (default atypical-client)")


def _magnitudes(args: argparse.Namespace) -> dict[str, float]:
    return {"gaussian_noise": args.noise_std, "rotation": args.rotation_deg,
            "blur": args.blur_sigma}


def make_config(args: argparse.Namespace, alpha: float, perturbation: str):
    """The federation of one cell: Dirichlet(alpha), one client perturbed from round 1."""
    from clma.config import validate_config

    tag = f"a{alpha:g}-{perturbation}".replace(".", "p")
    return validate_config({
        "name": f"atypical-client-{tag}",
        "seed": args.seed,
        "rounds": args.rounds,
        "clients": args.clients,
        "data": {"dataset": "digits", "partition": "dirichlet", "dirichlet_alpha": alpha,
                 "probe_size": args.probe_size},
        "drift": {"events": [{
            "round": 1, "kind": perturbation, "clients": [args.shifted_client],
            "family": perturbation, "magnitude": _magnitudes(args)[perturbation],
        }]},
        "cohort": {"enabled": True},
        "divergence": {"enabled": True, "action": "report"},
        "tracking": {"enabled": True, "experiment": args.experiment},
    })


def _rank_stats(rows: list[dict[str, Any]], signal: str, shifted: int, first_round: int
                ) -> dict[str, Any]:
    """Top-1 fraction, pooled ROC AUC, mean z of the shifted client, over rounds >= first."""
    from sklearn.metrics import roc_auc_score

    rows = [r for r in rows if r["round"] >= first_round]
    rounds = sorted({r["round"] for r in rows})
    top = top_abs = 0
    for rnd in rounds:
        zs = {r["client"]: r[f"{signal}_z"] for r in rows if r["round"] == rnd}
        others = [z for c, z in zs.items() if c != shifted]
        if shifted in zs and others and zs[shifted] > max(others):
            top += 1
        if shifted in zs and others and abs(zs[shifted]) > max(abs(z) for z in others):
            top_abs += 1
    labels = [int(r["client"] == shifted) for r in rows]
    scores = [r[f"{signal}_z"] for r in rows]
    auc = (float(roc_auc_score(labels, scores))
           if 0 < sum(labels) < len(labels) and all(math.isfinite(s) for s in scores)
           else math.nan)
    z_shift = [r[f"{signal}_z"] for r in rows if r["client"] == shifted]
    return {
        "top1_fraction": top / len(rounds) if rounds else math.nan,
        "top1_abs_z_fraction": top_abs / len(rounds) if rounds else math.nan,
        "auc": auc,
        "mean_z_shifted": float(np.mean(z_shift)) if z_shift else math.nan,
        "rounds_flagged": sum(bool(r[f"{signal}_flagged"]) for r in rows
                              if r["client"] == shifted),
        "regular_flags": sum(bool(r[f"{signal}_flagged"]) for r in rows
                             if r["client"] != shifted),
        "rounds": len(rounds),
    }


def summarise_cell(rows: list[dict[str, Any]], alpha: float, perturbation: str,
                   magnitude: float, shifted: int, first_round: int = 2) -> dict[str, Any]:
    """One table row from a cell's per-round, per-client scores."""
    rep = _rank_stats(rows, "representation", shifted, first_round)
    par = _rank_stats(rows, "parameter", shifted, first_round)
    quarantined_rounds = sorted({r["round"] for r in rows
                                 if r["client"] == shifted and r["cohort"] != 0})
    return {
        "alpha": alpha,
        "perturbation": perturbation,
        "magnitude": magnitude,
        "rounds_scored": rep["rounds"],
        "representation_top1_fraction": rep["top1_fraction"],
        "representation_auc": rep["auc"],
        "representation_mean_z_shifted": rep["mean_z_shifted"],
        "representation_rounds_flagged": rep["rounds_flagged"],
        "representation_top1_abs_z_fraction": rep["top1_abs_z_fraction"],
        "parameter_top1_fraction": par["top1_fraction"],
        "parameter_auc": par["auc"],
        "parameter_mean_z_shifted": par["mean_z_shifted"],
        "parameter_rounds_flagged": par["rounds_flagged"],
        "parameter_top1_abs_z_fraction": par["top1_abs_z_fraction"],
        "regular_flags_representation": rep["regular_flags"],
        "regular_flags_parameter": par["regular_flags"],
        # rounds in which the shifted client started from a child cohort (it was quarantined
        # and split off earlier): its reference is then its own cohort's model
        "shifted_quarantined": (f"from round {quarantined_rounds[0]}"
                                if quarantined_rounds else "no"),
    }


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.3g}" if abs(v) >= 100 else f"{v:.2f}"
    return str(v)


def to_markdown(table: list[dict[str, Any]]) -> str:
    """The table as GitHub Markdown (columns :data:`TABLE_COLUMNS`)."""
    head = "| " + " | ".join(TABLE_COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in TABLE_COLUMNS) + "|"
    body = ["| " + " | ".join(_fmt(row[c]) for c in TABLE_COLUMNS) + " |" for row in table]
    return "\n".join([head, sep, *body]) + "\n"


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _write_table(out: Path, table: list[dict[str, Any]], meta: dict[str, Any]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    md = out / "atypical_client.md"
    md.write_text(to_markdown(table))
    cv = out / "atypical_client.csv"
    with cv.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=TABLE_COLUMNS)
        w.writeheader()
        w.writerows(table)
    js = out / "atypical_client.json"
    js.write_text(json.dumps(
        {**meta, "table": [{k: _json_safe(v) for k, v in row.items()} for row in table]},
        indent=2, sort_keys=True) + "\n")
    return [md, cv, js]


def _write_scores(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=SCORE_COLUMNS)
        w.writeheader()
        w.writerows(rows)


def _collector(rows: list[dict[str, Any]], alpha: float, perturbation: str, shifted: int):
    def on_divergence(div) -> None:
        rep, par = div.representation, div.parameter
        for c in sorted(rep.scores):
            rows.append({
                "alpha": alpha, "perturbation": perturbation, "round": div.round,
                "client": int(c), "shifted": int(c) == shifted, "cohort": div.cohorts[int(c)],
                "representation_score": rep.scores[c], "representation_z": rep.z[c],
                "representation_flagged": c in rep.flagged,
                "parameter_score": par.scores[c], "parameter_z": par.z[c],
                "parameter_flagged": c in par.flagged,
            })
    return on_divergence


def _experiment_flow(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from prefect import flow

    from flows.federation import federation_flow
    from tasks.tracking import FederationTracker

    @flow(name="atypical-client-experiment")
    def experiment(alphas: list[float], perturbations: list[str]) -> dict[str, Any]:
        torch.set_num_threads(1)
        parent = FederationTracker()
        parent.start(
            args.experiment,
            run_name=f"atypical-client-seed{args.seed}",
            params={
                "alphas": json.dumps(alphas), "perturbations": json.dumps(perturbations),
                "rounds": str(args.rounds), "clients": str(args.clients),
                "shifted_client": str(args.shifted_client), "seed": str(args.seed),
                "probe_size": str(args.probe_size),
                **{f"magnitude.{k}": str(v) for k, v in _magnitudes(args).items()},
            },
            tags={"clma.experiment": "atypical-client", "clma.seed": str(args.seed),
                  "clma.sim_truth_metrics": "true",
                  "clma.artifacts_client_ids": "simulation-ground-truth"},
        )
        table: list[dict[str, Any]] = []
        all_rows: list[dict[str, Any]] = []
        children: dict[str, str] = {}
        status = "FAILED"
        try:
            for alpha in alphas:
                for pert in perturbations:
                    cfg = make_config(args, alpha, pert)
                    rows: list[dict[str, Any]] = []
                    summary = federation_flow(
                        cfg, parent_mlflow_run_id=parent.run_id,
                        on_divergence=_collector(rows, alpha, pert, args.shifted_client),
                    )
                    row = summarise_cell(rows, alpha, pert, _magnitudes(args)[pert],
                                         args.shifted_client)
                    table.append(row)
                    all_rows.extend(rows)
                    child = summary["mlflow"]["run_id"]
                    children[f"{alpha:g}/{pert}"] = child
                    c = parent.client
                    c.set_tag(child, "clma.artifacts_client_ids", "simulation-ground-truth")
                    c.set_tag(child, "clma.shifted_client", str(args.shifted_client))
                    c.log_dict(child, {"note": "simulation ground truth (client ids)",
                                       "rows": [{k: _json_safe(v) for k, v in r.items()}
                                                for r in rows]},
                               "per_client_scores.json")
                    key = f"a{alpha:g}.{pert}"
                    parent.log_metrics(
                        {f"{key}.{s}.{m}": row[f"{s}_{m}"] for s in SIGNALS
                         for m in ("top1_fraction", "auc", "mean_z_shifted")}, step=0)
            status = "FINISHED"
        finally:
            meta = {
                "command": "clma experiment atypical-client",
                "seed": args.seed, "rounds": args.rounds, "clients": args.clients,
                "shifted_client": args.shifted_client, "probe_size": args.probe_size,
                "magnitudes": _magnitudes(args), "rounds_scored": f"2..{args.rounds}",
                "z_rule": "robust z (median, 1.4826 MAD) across the round's clients",
                "parameter_baseline": "cosine distance to the leave-one-out mean update",
                "mlflow": {"parent_run_id": parent.run_id, "children": children},
            }
            paths = _write_table(args.out, table, meta)
            _write_scores(args.out / "per_client_scores.csv", all_rows)
            for p in paths:
                parent.log_artifact(str(p))
            parent.log_artifact(str(args.out / "per_client_scores.csv"))
            parent.finish(status)
        return {"table": table, "parent_run_id": parent.run_id, "children": children}

    return experiment(list(args.alphas), list(args.perturbations))


def run(args: argparse.Namespace) -> int:
    """Run the experiment; print the Markdown table. Returns 0, or 2 on bad arguments."""
    import sys

    from clma.config import ConfigError

    if args.rounds < 2 or args.clients < 3 or args.probe_size < 1:
        print("clma: --rounds must be >= 2 (rounds 2.. are scored), --clients >= 3 (robust z "
              "needs 3 clients) and --probe-size >= 1", file=sys.stderr)
        return 2
    for name in ("alphas", "perturbations"):
        if len(set(getattr(args, name))) != len(getattr(args, name)):
            print(f"clma: --{name} must not repeat a value", file=sys.stderr)
            return 2
    if args.out.exists() and not args.out.is_dir():
        print(f"clma: --out {str(args.out)!r} exists and is not a directory", file=sys.stderr)
        return 2
    if not 0 <= args.shifted_client < args.clients:
        print("clma: --shifted-client must be in [0, clients)", file=sys.stderr)
        return 2
    try:
        for a in args.alphas:
            for p in args.perturbations:
                make_config(args, a, p)
    except ConfigError as exc:
        print(f"clma: {exc}", file=sys.stderr)
        return 2
    result = _experiment_flow(args)
    print(to_markdown(result["table"]), end="")
    print(f"table: {args.out / 'atypical_client.md'}  MLflow parent run: "
          f"{result['parent_run_id']}")
    return 0
