"""Sweep behind issue 6's negative result: which scoring, training, model or probe changes it?

``clma experiment atypical-client`` runs the production round (CLMA cohorting, Prefect tasks,
MLflow) and finds that the representation signal does not single out a perturbed client in
>= 80 % of rounds. This sweep asks whether that is a property of one choice we made, by
re-running the same federations (digits, ``--clients`` clients, Dirichlet ``alpha``, client 0
perturbed from round 1 by Gaussian noise, rotation or blur at the experiment's magnitudes) in a
plain FedAvg loop (one cohort, no cohorting, so every client always scores against the same
global model) under several *regimes* and scoring every round with several *scores*.

Regimes (:data:`REGIMES`; one changed factor each against ``default``):

* ``default``: the product's training (5 local epochs, SGD lr 0.3, batch 16), MLP [64, 32],
  128 clean probe samples (the experiment's setting);
* ``gentle-sgd``: lr 0.05 (no client's update norm exceeds twice the round's median; the
  default lr produces such spikes in 7.9 % of client-rounds, column ``update_spikes``, and a
  spiking regular client is genuinely atypical);
* ``wide-mlp``: MLP [256, 128] (finer activation patterns);
* ``probe-256``: 256 clean probe samples;
* ``uniform-probe``: 128 probe inputs drawn uniformly from [0, 1]^64 (the partition of the
  input space around, not on, the data);
* ``strong-perturbation``: twice the perturbation magnitudes (noise std 0.6, rotation 90
  degrees, blur sigma 2).

Scores (:data:`SCORES`; robust z across the round's clients for each):

* ``representation``: ``D_hier`` of the local model to the round's start model (issue 6 item 4,
  what the production round computes);
* ``representation_aggregate``: ``D_hier`` to the round's FedAvg aggregate of all clients;
* ``representation_consensus``: ``D_hier`` between the client's affinities and the mean of
  the *other* clients' affinities, layer by layer (leave-one-out consensus);
* ``representation_pairwise_median``: median over the other clients of ``D_hier`` between the
  two local models;
* ``representation_update_cosine``: cosine distance of the client's affinity change
  (upper triangles of ``K_l(local) - K_l(start)``, all layers) to the mean change of the others
  (the representation-space analogue of the parameter baseline);
* ``representation_cumulative_z``: mean of the client's ``representation`` z over rounds
  ``1..r`` (persistence: a client shifted for good keeps scoring high);
* ``parameter``: the parameter baseline (cosine distance of the update to the leave-one-out mean
  update), as in the production round.

Per federation and score (``atypical_client_sweep_cells.csv``, :data:`CELL_COLUMNS`), over
rounds ``2..R``: the strict top-1 fraction, AUC and mean z of the perturbed client, and the
two-sided readings of issue 20 (top-1 fraction and AUC by ``|z|``, mean ``|z|``); then, with
the production experiment's definitions (:func:`federation_readings`): the perturbed client's
mean rank by z and by ``|z|``, the regular clients' median z and 90th percentile of ``|z|`` in
the first and second half of the scored rounds (stable when the second is not larger), rounds
with ``|z| > z_threshold``, and the persistent flag (the library's EWMA rule and defaults,
:mod:`clma.divergence.flags`): first round, round from which it holds to ``R``, regular
clients ever flagged. Defaults (issue 20): seeds 0 1 2, 30 rounds.

Reported per (regime, score) (``atypical_client_sweep.md``): the fraction of rounds ``2..R``
in which the perturbed client has strictly the highest z, per (alpha, perturbation), averaged
over ``--seeds``; ``cells_at_target``, the number of (alpha in {10, 1}) x perturbation cells
where that mean reaches issue 6's 0.8; ``mean_auc_abs``; and issue 20's targets per cell
(:func:`cell_means`, ``atypical_client_sweep_cell_means.md``): ``cells_separated`` (seed-mean
``|z|`` >= 2 and AUC by ``|z|`` >= 0.8) and ``cells_persistent`` (flagged persistently by round
10 in every seed, at most one regular client flagged per federation). Each federation is
written to ``--out/cells/`` as it finishes; ``--resume`` reuses those files (an interrupted
sweep continues; a sweep over a subset of the regimes tabulates the finished ones). MLflow:
one run in experiment ``--experiment`` (default ``atypical-client-sweep``) with the tables as
artifacts.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

DESCRIPTION = (
    "issue 6 sweep: representation-score variants, training, width, probe and magnitude "
    "regimes vs the parameter baseline (plain FedAvg, client 0 perturbed, rounds 2..R scored)"
)

EPILOG = """\
scores (one row per regime and score): representation = D_hier to the round's start model
(the production signal); representation_aggregate = to the round's FedAvg aggregate;
representation_consensus = to the other clients' mean affinity; representation_pairwise_median
= median D_hier to the other clients; representation_update_cosine = cosine distance of the
affinity change to the others' mean change; representation_cumulative_z = mean z over rounds
1..r; parameter = the leave-one-out cosine parameter baseline.
cells: fraction of rounds 2..R in which client 0 has strictly the highest robust z (mean over
--seeds); cells_at_target: cells at alpha 10 or 1 whose mean reaches 0.8 (issue 6's target);
cells_separated: mean |z| >= 2 and AUC by |z| >= 0.8; cells_persistent: persistent flag by
round 10 in every seed, <= 1 regular client flagged per federation (issue 20's targets;
per-cell readings in atypical_client_sweep_cell_means.md). Each federation is written to
--out/cells as it finishes; --resume reuses them.
regimes: default (5 epochs, lr 0.3, MLP [64, 32], 128 clean probes), gentle-sgd (lr 0.05),
wide-mlp ([256, 128]), probe-256, uniform-probe (U[0,1] probe inputs), strong-perturbation
(2x magnitudes). Results go to --out and to the MLflow experiment --experiment."""

PERTURBATIONS = ("gaussian_noise", "rotation", "blur")
MAGNITUDE = {"gaussian_noise": 0.3, "rotation": 45.0, "blur": 1.0}
TARGET_ALPHAS = (10.0, 1.0)
TARGET_TOP1 = 0.8
#: Issue 20's targets (as ``flows.experiments.atypical_client``).
TARGET_MEAN_ABS_Z = 2.0
TARGET_AUC_ABS = 0.8
TARGET_PERSISTENT_BY = 10
TARGET_MAX_REGULAR_PERSISTENT = 1

SCORES = (
    "representation",
    "representation_aggregate",
    "representation_consensus",
    "representation_pairwise_median",
    "representation_update_cosine",
    "representation_cumulative_z",
    "parameter",
)


@dataclass(frozen=True)
class Regime:
    """Training, model and probe of one sweep regime."""

    local_epochs: int = 5
    learning_rate: float = 0.3
    batch_size: int = 16
    hidden: tuple[int, ...] = (64, 32)
    probe_size: int = 128
    probe: str = "clean"  # "clean": the federation's held-out probe; "uniform": U[0, 1] inputs
    magnitude_scale: float = 1.0  # multiplies MAGNITUDE


REGIMES: dict[str, Regime] = {
    "default": Regime(),
    "gentle-sgd": Regime(learning_rate=0.05),
    "wide-mlp": Regime(hidden=(256, 128)),
    "probe-256": Regime(probe_size=256),
    "uniform-probe": Regime(probe="uniform"),
    "strong-perturbation": Regime(magnitude_scale=2.0),
}

#: Per-federation readings taken from :func:`flows.experiments.atypical_client.
#: summarise_federation` (the production experiment's definitions, on the sweep's z).
FEDERATION_READINGS = ("mean_rank", "mean_rank_abs", "regular_median_z",
                       "regular_abs_z_p90_early", "regular_abs_z_p90_late",
                       "rounds_flagged_two_sided", "persistent_first_round",
                       "persistent_held_from", "regular_persistent_clients")

CELL_COLUMNS = ["regime", "score", "alpha", "perturbation", "seed", "top1_fraction", "auc",
                "mean_z_shifted", "top1_abs_z_fraction", "auc_abs_z", "mean_abs_z_shifted",
                *FEDERATION_READINGS, "rounds_scored", "update_spikes"]


# ------------------------------------------------------------------------------ scoring


def round_scores(
    start_aff: Sequence[np.ndarray],
    client_aff: Sequence[Sequence[np.ndarray]],
    aggregate_aff: Sequence[np.ndarray],
    updates: np.ndarray,
    beta: float,
) -> dict[str, np.ndarray]:
    """Raw per-client scores of one round (all but the cumulative one), client order kept.

    Args:
        start_aff: ``L`` ``(P, P)`` affinities of the round's start (global) model.
        client_aff: per client, its ``L`` affinities after local training (``n >= 3``).
        aggregate_aff: ``L`` affinities of the round's FedAvg aggregate.
        updates: ``(n, n_params)`` client updates (local - start).
        beta: hierarchical attenuation (:func:`clma.divergence.hierarchical_divergence`).

    Returns:
        score name -> ``(n,)`` float64 raw score (higher = more atypical).
    """
    from clma.divergence import cosine_distance_to_mean, hierarchical_divergence

    n = len(client_aff)
    layers = len(start_aff)
    out: dict[str, np.ndarray] = {
        "representation": np.array(
            [hierarchical_divergence(start_aff, k, beta=beta) for k in client_aff]),
        "representation_aggregate": np.array(
            [hierarchical_divergence(aggregate_aff, k, beta=beta) for k in client_aff]),
    }
    sums = [sum(k[layer] for k in client_aff) for layer in range(layers)]
    out["representation_consensus"] = np.array([
        hierarchical_divergence([(sums[layer] - k[layer]) / (n - 1) for layer in range(layers)],
                                k, beta=beta)
        for k in client_aff])
    pair = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1, n):
            pair[i, j] = pair[j, i] = hierarchical_divergence(client_aff[i], client_aff[j],
                                                              beta=beta)
    out["representation_pairwise_median"] = np.array(
        [np.median(np.delete(pair[i], i)) for i in range(n)])
    iu = np.triu_indices(start_aff[0].shape[0], 1)
    change = np.stack([np.concatenate([(k[layer] - start_aff[layer])[iu]
                                       for layer in range(layers)]) for k in client_aff])
    out["representation_update_cosine"] = cosine_distance_to_mean(change, leave_one_out=True)
    out["parameter"] = cosine_distance_to_mean(updates, leave_one_out=True)
    return out


def federation_readings(z: np.ndarray, shifted: int, divergence: Any) -> dict[str, Any]:
    """Rank, regular-client spread and persistent flag of one federation and score.

    Args:
        z: ``(R, n)`` float64 robust z, rounds ``1..R`` in order, clients in id order.
        shifted: the perturbed client's id (column).
        divergence: a :class:`clma.config.DivergenceConfig` (``z_threshold`` and the
            persistence EWMA's ``persistence_lambda`` / ``_clip`` / ``_threshold``).

    Returns:
        :data:`FEDERATION_READINGS` -> value, as
        :func:`flows.experiments.atypical_client.summarise_federation` defines them on the
        production experiment's traces: ranks (1 = most atypical, ties rank the shifted
        client first), the regular clients' median z and 90th percentile of ``|z|`` over the
        first / second half of rounds ``2..R``, rounds ``2..R`` with ``|z| > z_threshold``,
        the first round (from 1) the shifted client is flagged persistently (the library's
        rule, EWMA from round 1), the first round from which it stays flagged to ``R``
        (``None`` if never), and the number of regular clients ever flagged persistently.
    """
    from flows.experiments.atypical_client import PersistenceRule, summarise_federation

    rule = PersistenceRule("config", divergence.persistence_lambda,
                           divergence.persistence_clip, divergence.persistence_threshold,
                           True, divergence.z_threshold)
    rows = [{"seed": 0, "alpha": 0.0, "perturbation": "", "signal": "score",
             "round": t + 1, "client": c, "z": float(z[t, c]), "ewma": math.nan}
            for t in range(z.shape[0]) for c in range(z.shape[1])]
    stats = summarise_federation(rows, "score", shifted, z_threshold=divergence.z_threshold,
                                 rule=rule)
    return {k: stats[k] for k in FEDERATION_READINGS}


# ------------------------------------------------------------------------------ one cell


def _probe(regime: Regime, fed_probe: np.ndarray, seed: int) -> np.ndarray:
    if regime.probe == "clean":
        return fed_probe
    rng = np.random.default_rng([seed, 0x5EED])
    return rng.uniform(0.0, 1.0, size=fed_probe.shape).astype(np.float32)


def make_config(regime_name: str, alpha: float, perturbation: str, seed: int, rounds: int,
                clients: int, shifted: int = 0):
    """The federation of one sweep cell. Raises :class:`clma.config.ConfigError`."""
    from clma.config import default_config, validate_config

    regime = REGIMES[regime_name]
    base = default_config().model_dump()
    return validate_config({
        **base,
        "name": f"atypical-sweep-{regime_name}",
        "seed": seed, "rounds": rounds, "clients": clients,
        "data": {**base["data"], "partition": "dirichlet", "dirichlet_alpha": alpha,
                 "probe_size": regime.probe_size},
        "model": {"hidden": list(regime.hidden)},
        "training": {**base["training"], "local_epochs": regime.local_epochs,
                     "learning_rate": regime.learning_rate, "batch_size": regime.batch_size},
        "drift": {**base["drift"], "events": [{
            "round": 1, "kind": perturbation, "clients": [shifted], "family": perturbation,
            "magnitude": MAGNITUDE[perturbation] * regime.magnitude_scale}]},
    })


def run_cell(regime_name: str, alpha: float, perturbation: str, seed: int, rounds: int,
             clients: int, beta: float = 1.0, shifted: int = 0) -> list[dict[str, Any]]:
    """One federation of the sweep: per-score top-1 fraction and AUC over rounds ``2..rounds``.

    Returns one row per score (columns :data:`CELL_COLUMNS`).
    """
    import torch
    from sklearn.metrics import roc_auc_score

    from clma.divergence import RepresentationScorer, robust_z
    from clma.engine import TrainRequest, TrainSettings
    from clma.params import AllParams, vector_to_model
    from clma.rounds import fedavg
    from clma.sim.clients import SimulatedClients
    from clma.sim.federation import build_federation

    torch.set_num_threads(1)
    regime = REGIMES[regime_name]
    cfg = make_config(regime_name, alpha, perturbation, seed, rounds, clients, shifted)
    fed = build_federation(cfg)
    devices = SimulatedClients(fed)
    settings = TrainSettings(cfg.training.local_epochs, cfg.training.learning_rate,
                             cfg.training.batch_size, 0.5)
    start = fed.initial_model.copy()
    scorer = RepresentationScorer(_probe(regime, fed.probe_x, seed), beta=beta)

    def module(vec: np.ndarray):
        return vector_to_model(vec, fed.spec.build(), AllParams())

    zs: dict[str, list[np.ndarray]] = {s: [] for s in SCORES}
    spikes = 0
    for rnd in range(1, rounds + 1):
        ids = list(fed.client_ids)
        replies = devices.train(TrainRequest(rnd, {c: 0 for c in ids}, {0: start}, settings))
        ups = [replies.ok[c] for c in sorted(replies.ok)]
        if [u.client_id for u in ups] != list(range(clients)):
            raise RuntimeError("sweep expects every client every round, in id order")
        aggregate = fedavg([u.params for u in ups], [u.n_samples for u in ups])
        updates = np.stack([u.params - start for u in ups])
        norms = np.linalg.norm(updates, axis=1)
        if rnd >= 2:
            spikes += int((norms > 2.0 * np.median(norms)).sum())
        raw = round_scores(
            scorer.layer_affinities(module(start)),
            [scorer.layer_affinities(module(u.params)) for u in ups],
            scorer.layer_affinities(module(aggregate)),
            updates, beta)
        for name, values in raw.items():
            zs[name].append(robust_z(values))
        zs["representation_cumulative_z"].append(np.mean(zs["representation"], axis=0))
        start = aggregate

    out = []
    for name in SCORES:
        readings = federation_readings(np.array(zs[name]), shifted, cfg.divergence)
        z = np.array(zs[name][1:])  # rounds 2..R
        others = np.delete(z, shifted, axis=1)
        top = int(np.sum(z[:, shifted] > others.max(axis=1)))
        top_abs = int(np.sum(np.abs(z[:, shifted]) > np.abs(others).max(axis=1)))
        labels = np.zeros_like(z, dtype=int)
        labels[:, shifted] = 1
        finite = np.isfinite(z).all()
        out.append({
            "regime": regime_name, "score": name, "alpha": alpha, "perturbation": perturbation,
            "seed": seed, "top1_fraction": top / z.shape[0],
            "auc": float(roc_auc_score(labels.ravel(), z.ravel())) if finite else math.nan,
            "mean_z_shifted": float(np.mean(z[:, shifted])),
            # two-sided readings (issue 20): a shifted client can diverge much *less*
            "top1_abs_z_fraction": top_abs / z.shape[0],
            "auc_abs_z": (float(roc_auc_score(labels.ravel(), np.abs(z).ravel()))
                          if finite else math.nan),
            "mean_abs_z_shifted": float(np.mean(np.abs(z[:, shifted]))),
            **readings,
            "rounds_scored": z.shape[0],
            "update_spikes": spikes,
        })
    return out


# ------------------------------------------------------------------------------ tables


def _mean(values: Sequence[Any]) -> float:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(vals)) if vals else math.nan


def cell_means(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (regime, score, alpha, perturbation): readings averaged over the seeds.

    ``persistent_first_round``: mean over the seeds where the flag was raised (None if in
    none); ``seeds_persistent_by_10``: seeds whose shifted client was flagged persistently by
    round :data:`TARGET_PERSISTENT_BY`; ``max_regular_persistent``: the most regular clients
    flagged persistently in one federation; ``separated``: mean ``|z|`` of the shifted client
    >= :data:`TARGET_MEAN_ABS_Z` and mean AUC by ``|z|`` >= :data:`TARGET_AUC_ABS` (issue 20);
    ``persistent``: flagged by round 10 in every seed with at most
    :data:`TARGET_MAX_REGULAR_PERSISTENT` regular client flagged in every federation."""
    keys = sorted({(c["regime"], c["score"], c["alpha"], c["perturbation"]) for c in cells},
                  key=lambda k: (list(REGIMES).index(k[0]), SCORES.index(k[1]), -k[2],
                                 PERTURBATIONS.index(k[3])))
    out = []
    for regime, score, alpha, pert in keys:
        sel = [c for c in cells
               if (c["regime"], c["score"], c["alpha"], c["perturbation"])
               == (regime, score, alpha, pert)]
        row: dict[str, Any] = {"regime": regime, "score": score, "alpha": alpha,
                               "perturbation": pert, "seeds": len(sel)}
        for col in ("top1_fraction", "top1_abs_z_fraction", "auc", "auc_abs_z",
                    "mean_z_shifted", "mean_abs_z_shifted", "mean_rank", "mean_rank_abs",
                    "regular_abs_z_p90_early", "regular_abs_z_p90_late"):
            row[col] = _mean([c[col] for c in sel])
        firsts = [c["persistent_first_round"] for c in sel
                  if c["persistent_first_round"] is not None]
        row["persistent_first_round"] = float(np.mean(firsts)) if firsts else None
        row["seeds_persistent_by_10"] = sum(
            f <= TARGET_PERSISTENT_BY for f in firsts)
        row["max_regular_persistent"] = max(c["regular_persistent_clients"] for c in sel)
        row["separated"] = bool(row["mean_abs_z_shifted"] >= TARGET_MEAN_ABS_Z
                                and row["auc_abs_z"] >= TARGET_AUC_ABS)
        row["persistent"] = bool(
            row["seeds_persistent_by_10"] == len(sel)
            and row["max_regular_persistent"] <= TARGET_MAX_REGULAR_PERSISTENT)
        out.append(row)
    return out


def summarise(cells: list[dict[str, Any]], alphas: Sequence[float],
              perturbations: Sequence[str]) -> list[dict[str, Any]]:
    """One row per (regime, score): mean top-1 fraction over seeds per (alpha, perturbation),
    mean AUC, and ``cells_at_target`` = cells with alpha in {10, 1} whose mean top-1 >= 0.8;
    the two-sided readings ``mean_auc_abs`` (AUC by ``|z|``), ``cells_separated`` and
    ``cells_persistent`` (cells with alpha in {10, 1} meeting issue 20's separation and
    persistence targets, :func:`cell_means`), when the cells carry them."""
    rows = []
    keys = sorted({(c["regime"], c["score"]) for c in cells},
                  key=lambda k: (list(REGIMES).index(k[0]), SCORES.index(k[1])))
    two_sided = all("auc_abs_z" in c and "persistent_first_round" in c for c in cells)
    means = {(m["regime"], m["score"], m["alpha"], m["perturbation"]): m
             for m in cell_means(cells)} if two_sided else {}
    for regime, score in keys:
        row: dict[str, Any] = {"regime": regime, "score": score}
        at_target = separated = persistent = 0
        aucs, aucs_abs = [], []
        for a in alphas:
            for p in perturbations:
                sel = [c for c in cells if (c["regime"], c["score"], c["alpha"],
                                            c["perturbation"]) == (regime, score, a, p)]
                top = float(np.mean([c["top1_fraction"] for c in sel])) if sel else math.nan
                aucs += [c["auc"] for c in sel]
                row[f"a{a:g} {p}"] = top
                if a in TARGET_ALPHAS and top >= TARGET_TOP1:
                    at_target += 1
                m = means.get((regime, score, a, p))
                if m is not None:
                    aucs_abs += [c["auc_abs_z"] for c in sel]
                    separated += a in TARGET_ALPHAS and m["separated"]
                    persistent += a in TARGET_ALPHAS and m["persistent"]
        row["mean_auc"] = float(np.nanmean(aucs)) if aucs else math.nan
        row["cells_at_target"] = at_target
        if two_sided:
            row["mean_auc_abs"] = float(np.nanmean(aucs_abs)) if aucs_abs else math.nan
            row["cells_separated"] = separated
            row["cells_persistent"] = persistent
        rows.append(row)
    return rows


def to_markdown(rows: list[dict[str, Any]]) -> str:
    """The summary as a GitHub Markdown table."""
    if not rows:
        return ""
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(
            f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("runs/atypical-client-sweep"),
                        help="output folder (default: runs/atypical-client-sweep)")
    parser.add_argument("--regimes", nargs="+", choices=list(REGIMES), default=list(REGIMES),
                        help="regimes (default: all)")
    parser.add_argument("--alphas", type=float, nargs="+", default=list(TARGET_ALPHAS),
                        help="Dirichlet concentrations (default: 10 1)")
    parser.add_argument("--perturbations", nargs="+", choices=PERTURBATIONS,
                        default=list(PERTURBATIONS), help="perturbations (default: all three)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="federation seeds (default: 0 1 2)")
    parser.add_argument("--rounds", type=int, default=30,
                        help="rounds (default 30, the paper's horizon)")
    parser.add_argument("--clients", type=int, default=10, help="clients (default 10)")
    parser.add_argument("--workers", type=int, default=2,
                        help="worker processes (default 2)")
    parser.add_argument("--experiment", default="atypical-client-sweep",
                        help="MLflow experiment name (default atypical-client-sweep)")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the federations already in --out/cells (each written as "
                        "it finishes, with its columns; a file with other columns is rerun)")


def _check(args: argparse.Namespace) -> str | None:
    if args.rounds < 2:
        return "--rounds must be >= 2 (rounds 2.. are scored)"
    if args.clients < 3:
        return "--clients must be >= 3 (robust z needs 3 clients)"
    if args.workers < 1:
        return "--workers must be >= 1"
    if any(not (math.isfinite(a) and a > 0) for a in args.alphas):
        return "--alphas must be finite and > 0"
    for name in ("regimes", "alphas", "perturbations", "seeds"):
        values = getattr(args, name)
        if len(set(values)) != len(values):
            return f"--{name} must not repeat a value (each cell is counted once)"
    if args.out.exists() and not args.out.is_dir():
        return f"--out {str(args.out)!r} exists and is not a directory"
    from clma.config import ConfigError

    try:  # every cell's configuration, before any work (e.g. a negative seed)
        for job in _jobs(args):
            make_config(*job)
    except ConfigError as exc:
        return str(exc)
    return None


def _jobs(args: argparse.Namespace) -> list[tuple[str, float, str, int, int, int]]:
    return [(r, a, p, s, args.rounds, args.clients) for r in args.regimes for a in args.alphas
            for p in args.perturbations for s in args.seeds]


def cell_path(out: Path, job: tuple[str, float, str, int, int, int]) -> Path:
    """The file of one finished federation under ``out/cells``."""
    regime, alpha, pert, seed, rounds, clients = job
    return out / "cells" / f"{regime}_a{alpha:g}_{pert}_s{seed}_R{rounds}_n{clients}.json"


def _load_cell(path: Path) -> list[dict[str, Any]] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if doc.get("columns") != CELL_COLUMNS:
        return None
    return doc["rows"]


def _save_cell(path: Path, rows: list[dict[str, Any]], seconds: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"columns": CELL_COLUMNS, "seconds": seconds, "rows": rows}))
    tmp.replace(path)  # a reader never sees half a file


def _timed_cell(*job: Any) -> tuple[list[dict[str, Any]], float]:
    import time

    t0 = time.perf_counter()
    rows = run_cell(*job)
    return rows, time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    """Run the sweep; print the summary table. Returns 0, or 2 on bad arguments."""
    import sys

    problem = _check(args)  # before importing Prefect: bad arguments answer at once
    if problem:
        print(f"clma: {problem}", file=sys.stderr)
        return 2

    from prefect import flow, task

    from tasks.tracking import FederationTracker
    jobs = _jobs(args)
    args.out.mkdir(parents=True, exist_ok=True)

    @task(name="run-sweep-cells")
    def run_cells() -> list[dict[str, Any]]:
        import time

        done: dict[int, list[dict[str, Any]]] = {}
        if args.resume:
            for i, job in enumerate(jobs):
                rows = _load_cell(cell_path(args.out, job))
                if rows is not None:
                    done[i] = rows
        todo = [i for i in range(len(jobs)) if i not in done]
        print(f"clma: {len(jobs)} federations, {len(done)} reused from "
              f"{args.out / 'cells'}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()

        def finished(i: int, rows: list[dict[str, Any]], seconds: float) -> None:
            done[i] = rows
            _save_cell(cell_path(args.out, jobs[i]), rows, seconds)
            n = len(done)
            print(f"clma: [{n}/{len(jobs)}] {' '.join(map(str, jobs[i][:4]))}: "
                  f"{seconds:.0f} s (elapsed {time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr, flush=True)

        if args.workers == 1:
            for i in todo:
                finished(i, *_timed_cell(*jobs[i]))
        else:
            with ProcessPoolExecutor(max_workers=args.workers) as pool:
                futures = {pool.submit(_timed_cell, *jobs[i]): i for i in todo}
                for fut in as_completed(futures):
                    finished(futures[fut], *fut.result())
        return [row for i in range(len(jobs)) for row in done[i]]

    @flow(name="atypical-client-sweep")
    def sweep() -> tuple[list[dict[str, Any]], str]:
        tracker = FederationTracker()
        tracker.start(
            args.experiment, run_name="atypical-client-sweep",
            params={"regimes": json.dumps(args.regimes), "alphas": json.dumps(args.alphas),
                    "perturbations": json.dumps(args.perturbations),
                    "seeds": json.dumps(args.seeds), "rounds": str(args.rounds),
                    "clients": str(args.clients)},
            tags={"clma.experiment": "atypical-client-sweep", "clma.sim_truth_metrics": "true"},
        )
        status = "FAILED"
        try:
            cells = run_cells()
            summary = summarise(cells, args.alphas, args.perturbations)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "atypical_client_sweep.md").write_text(to_markdown(summary))
            means = cell_means(cells)
            (args.out / "atypical_client_sweep_cell_means.md").write_text(to_markdown(means))
            with (args.out / "atypical_client_sweep_cells.csv").open("w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=CELL_COLUMNS)
                w.writeheader()
                w.writerows(cells)
            (args.out / "atypical_client_sweep.json").write_text(json.dumps({
                "command": "clma experiment atypical-client-sweep",
                "seeds": args.seeds, "rounds": args.rounds, "clients": args.clients,
                "magnitudes": MAGNITUDE, "regimes": {k: asdict(REGIMES[k]) for k in args.regimes},
                "summary": [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                             for k, v in row.items()} for row in summary],
                "cell_means": [{k: (None if isinstance(v, float) and not math.isfinite(v)
                                    else v) for k, v in row.items()} for row in means],
            }, indent=2) + "\n")
            for name in ("atypical_client_sweep.md", "atypical_client_sweep_cell_means.md",
                         "atypical_client_sweep_cells.csv", "atypical_client_sweep.json"):
                tracker.log_artifact(str(args.out / name))
            status = "FINISHED"
        finally:
            tracker.finish(status)
        return summary, tracker.run_id

    summary, run_id = sweep()
    print(to_markdown(summary), end="")
    print(f"table: {args.out / 'atypical_client_sweep.md'}  MLflow run: {run_id}")
    return 0
