"""Atypical-client detection at the paper's horizon: representation divergence vs the
parameter baseline, over several seeds, with one-sided, two-sided and persistent flags.

Issue 20. The claim tested (arXiv:2605.22266, Pérez-Corral et al. 2026): a client whose
data shifts shows *consistently* different geometric divergence and robust z than the
regular clients across rounds. On the handwritten digits, ``--clients`` clients (default
10), Dirichlet(alpha) label partitions (default alpha 10 and 1), one client
(``--shifted-client``, default 0) whose data (training and local evaluation) is perturbed
from round 1 on by ``gaussian_noise`` (std 0.3 on [0, 1] pixels, clipped), ``rotation``
(45 degrees) or ``blur`` (sigma 1 pixel); no other drift; CLMA cohorting on; divergence
action ``report`` (aggregation unchanged, so the three flag rules can be read off the same
federation); ``--rounds`` rounds (default 30), seeds ``--seeds`` (default 0 1 2). One
federation per (seed, alpha, perturbation), run by the library's round engine
(:class:`clma.engine.FederationEngine` over simulated clients, no Prefect task per round)
in ``--workers`` processes; private regional evaluation is off (it does not feed back into
training, cohorting or divergence scoring, and costs about a second per round).

Every round, every client gets the representation divergence ``D_c`` to its cohort's start
model on the shared probe set and the parameter baseline (leave-one-out cosine distance of
its update), each with its robust z. The persistence EWMA ``s`` and the persistent flag are
recomputed from the z with the library's rule at the ``[divergence]`` defaults (lambda 0.3,
clip 3, ``|s| > 2`` and robust z of ``s`` across the round's clients ``> 3``;
:mod:`clma.divergence.flags`, :func:`persistence_trace`): under action ``report`` the z do
not depend on the flag, so a federation cached under an earlier rule gives what a run under
this one records.

Per (seed, cell, signal), over rounds ``2..R`` (:func:`summarise_federation`):
``mean_z_shifted`` / ``mean_abs_z_shifted`` (the shifted client's robust z), ``mean_rank``
/ ``mean_rank_abs`` (its rank among the clients by z / |z|, 1 = most atypical),
``top1`` / ``top1_abs`` (fraction of rounds it ranks first), ``auc`` / ``auc_abs`` (ROC AUC
of z / |z| over the pooled (round, client) pairs, shifted client positive), the regular
clients' z distribution (median, and the 90th percentile of |z| in the first and the second
half of the scored rounds: ``regular_abs_z_p90_early`` / ``_late``; it stabilises when the
late value is not larger), rounds flagged under each rule, ``persistent_first_round`` (first
round flagged persistently; rounds from 1), ``persistent_held_from`` (first round from
which it stays flagged to R), and ``regular_persistent_clients`` (regular clients ever
flagged persistently). Per cell, means over the seeds (:func:`summarise_cells`) and the
issue's targets (:func:`targets`).

Outputs (``--out``): ``federations/`` (each federation's traces as it finishes; a re-run
with the same arguments reuses them), ``atypical_client.{md,csv,json}`` (cells), ``atypical_client_seeds.csv``
(per seed), ``per_client_z.csv`` (every round, client and signal: **simulation research
output with client ids**, the ground truth of a simulation; never produced by ``clma run``),
``atypical_client_windows.md`` (AUC by z and |z| in rounds 2-10 and 11-R: :func:`window_aucs`),
``persistence_rules.md`` (the persistent flag of the former and the current rule, and of
each change alone, from the same z: :func:`persistence_rules`),
``persistence_diagnostics.md`` (the regular clients' z against the i.i.d. N(0, 1) model a
fixed EWMA threshold assumes: :func:`regular_client_diagnostics`), and ``figures/z_a<alpha>_<perturbation>.png`` (z per client over rounds, a row per seed, a
column per signal; the paper's figure form). MLflow experiment ``--experiment``: one parent
run (tables, figures, per-cell metrics) and one nested child per cell (its figure, its
traces), tagged ``clma.artifacts_client_ids = simulation-ground-truth``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DESCRIPTION = (
    "one perturbed client among --clients (digits, Dirichlet alpha 10/1, 30 rounds, seeds "
    "0 1 2): its robust z, rank, AUC and persistent flag by representation divergence and by "
    "the parameter baseline; z-per-client figures (MLflow, nested runs)"
)

PERTURBATIONS = ("gaussian_noise", "rotation", "blur")
DEFAULT_MAGNITUDE = {"gaussian_noise": 0.3, "rotation": 45.0, "blur": 1.0}
SIGNALS = ("representation", "parameter")
RULES = ("one_sided", "two_sided", "persistent")

#: Issue 20's targets (better of the two signals per cell).
TARGET_MEAN_ABS_Z = 2.0
TARGET_AUC_ABS = 0.8
TARGET_PERSISTENT_BY = 10
TARGET_MAX_REGULAR_PERSISTENT = 1

#: Per-(seed, cell, signal) statistics (:func:`summarise_federation`).
STAT_COLUMNS = [
    "mean_z_shifted", "mean_abs_z_shifted", "mean_rank", "mean_rank_abs", "top1", "top1_abs",
    "auc", "auc_abs", "regular_median_z", "regular_abs_z_p90_early", "regular_abs_z_p90_late",
    "rounds_flagged_one_sided", "rounds_flagged_two_sided", "rounds_flagged_persistent",
    "persistent_first_round", "persistent_held_from", "regular_persistent_clients",
    "regular_flags_two_sided",
]

SEED_COLUMNS = ["seed", "alpha", "perturbation", "signal", *STAT_COLUMNS,
                "shifted_quarantined"]

#: Columns of the cell table (means over seeds; counts of seeds where stated).
CELL_COLUMNS = [
    "alpha", "perturbation", "signal", "seeds", "mean_z_shifted", "mean_abs_z_shifted",
    "mean_rank", "top1", "top1_abs", "auc", "auc_abs", "regular_abs_z_p90_early",
    "regular_abs_z_p90_late", "persistent_first_round", "seeds_persistent_by_10",
    "max_regular_persistent", "seeds_quarantined",
]

#: Columns of the per-round, per-client trace file (simulation research output).
TRACE_COLUMNS = ["seed", "alpha", "perturbation", "round", "client", "shifted", "cohort",
                 "signal", "score", "z", "ewma", "persistent", "engine_ewma"]


# ------------------------------------------------------------------------------ arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("runs/atypical-client"),
                        help="output folder (default: runs/atypical-client)")
    parser.add_argument("--alphas", type=float, nargs="+", default=[10.0, 1.0],
                        help="Dirichlet concentrations (default: 10 1)")
    parser.add_argument("--perturbations", nargs="+", choices=PERTURBATIONS,
                        default=list(PERTURBATIONS), help="perturbations (default: all three)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="federation seeds (default: 0 1 2)")
    parser.add_argument("--rounds", type=int, default=30, help="rounds (default 30)")
    parser.add_argument("--clients", type=int, default=10, help="clients (default 10)")
    parser.add_argument("--shifted-client", type=int, default=0,
                        help="id of the perturbed client (default 0)")
    parser.add_argument("--probe-size", type=int, default=128, help="probe samples (default 128)")
    parser.add_argument("--noise-std", type=float, default=DEFAULT_MAGNITUDE["gaussian_noise"],
                        help="gaussian_noise std on [0, 1] pixels (default 0.3)")
    parser.add_argument("--rotation-deg", type=float, default=DEFAULT_MAGNITUDE["rotation"],
                        help="rotation angle in degrees (default 45)")
    parser.add_argument("--blur-sigma", type=float, default=DEFAULT_MAGNITUDE["blur"],
                        help="blur Gaussian sigma in pixels (default 1.0)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--experiment", default="atypical-client",
                        help="MLflow experiment name (default atypical-client)")


def _magnitudes(args: argparse.Namespace) -> dict[str, float]:
    return {"gaussian_noise": args.noise_std, "rotation": args.rotation_deg,
            "blur": args.blur_sigma}


def make_config(seed: int, alpha: float, perturbation: str, *, rounds: int, clients: int,
                shifted: int, probe_size: int, magnitude: float):
    """The federation of one cell: Dirichlet(alpha), one client perturbed from round 1.

    Raises :class:`clma.config.ConfigError` for a bad value (the field is named)."""
    from clma.config import validate_config

    tag = f"a{alpha:g}-{perturbation}".replace(".", "p")
    return validate_config({
        "name": f"atypical-client-{tag}",
        "seed": seed,
        "rounds": rounds,
        "clients": clients,
        "data": {"dataset": "digits", "partition": "dirichlet", "dirichlet_alpha": alpha,
                 "probe_size": probe_size},
        "drift": {"events": [{
            "round": 1, "kind": perturbation, "clients": [shifted],
            "family": perturbation, "magnitude": magnitude,
        }]},
        "cohort": {"enabled": True},
        "divergence": {"enabled": True, "action": "report"},
        # evaluation never due: it does not feed back into training or divergence
        "evaluation": {"every": rounds + 1},
        "budget": {"enabled": False},
        "tracking": {"enabled": False},
    })


# ------------------------------------------------------------------------------ one federation


def run_federation(job: dict[str, Any]) -> list[dict[str, Any]]:
    """One federation (``job``: :func:`make_config` keywords plus seed, alpha,
    perturbation): trace rows (:data:`TRACE_COLUMNS`) for every round, client and signal."""
    import torch

    from clma.engine import FederationEngine
    from clma.sim.clients import SimulatedClients
    from clma.sim.federation import build_federation

    torch.set_num_threads(1)
    cfg = make_config(**job)
    sim = build_federation(cfg)
    engine = FederationEngine(cfg, sim.assets(), SimulatedClients(sim))
    rows: list[dict[str, Any]] = []

    def collect(div) -> None:
        for sig, rep in (("representation", div.representation),
                         ("parameter", div.parameter)):
            for c in sorted(rep.z):
                rows.append({
                    "seed": job["seed"], "alpha": job["alpha"],
                    "perturbation": job["perturbation"], "round": div.round,
                    "client": int(c), "shifted": int(c) == job["shifted"],
                    "cohort": div.cohorts[int(c)], "signal": sig,
                    "score": float(rep.scores[c]), "z": float(rep.z[c]),
                    "ewma": float(div.persistence[sig][int(c)]),
                })

    for r in range(1, cfg.rounds + 1):
        engine.run_round(r, on_divergence=collect)
    return rows


# ------------------------------------------------------------------------------ statistics


def _auc(labels: list[int], scores: list[float]) -> float:
    from sklearn.metrics import roc_auc_score

    if not 0 < sum(labels) < len(labels) or not all(math.isfinite(s) for s in scores):
        return math.nan
    return float(roc_auc_score(labels, scores))


def _rank(values: dict[int, float], client: int) -> int:
    """1 + number of clients strictly above ``client`` (ties rank it first)."""
    return 1 + sum(v > values[client] for c, v in values.items() if c != client)


@dataclass(frozen=True)
class PersistenceRule:
    """One persistent-flag rule on the EWMA ``s`` (lambda ``lam``, clip ``clip``): flagged
    when ``|s| > threshold`` (if ``absolute``) and ``|zs| > z_threshold`` on the robust z
    of ``s`` across the round's clients (if ``relative``), from the client's ``warmup``-th
    round on (0: from its first). The library's rule is absolute and relative, no warm-up
    (:func:`clma.divergence.persistent_flags`)."""

    name: str
    lam: float
    clip: float
    threshold: float
    relative: bool = True
    z_threshold: float = 3.0
    absolute: bool = True
    warmup: int = 0

    def flags(self, state: dict[int, float], clients: list[int],
              seen: dict[int, int] | None = None) -> set[int]:
        """The flagged clients among ``clients`` (``seen``: client -> rounds scored)."""
        from clma.divergence import persistence_z, persistent_flags

        if self.absolute and self.relative:
            out = set(persistent_flags(state, self.threshold, self.z_threshold, clients))
        elif self.relative:
            zs = persistence_z(state, clients)
            out = {c for c, q in zs.items() if math.isfinite(q) and abs(q) > self.z_threshold}
        else:
            out = {c for c in clients if abs(state.get(c, 0.0)) > self.threshold}
        if self.warmup:
            out = {c for c in out if (seen or {}).get(c, 0) >= self.warmup}
        return out


def _default_rule() -> PersistenceRule:
    from clma.config import DivergenceConfig

    d = DivergenceConfig()
    return PersistenceRule("default", d.persistence_lambda, d.persistence_clip,
                           d.persistence_threshold, True, d.z_threshold)


#: The rules compared on the same z (:func:`persistence_rules`): the former default (issue
#: 20's first rule), the same with a warm-up of ``2 / lam - 1`` = 6 rounds (the EWMA's
#: equivalent window), the relative condition alone, each of the two changes alone, and
#: the library's default.
COMPARED_RULES = (
    PersistenceRule("former: clip 5, |s| > 2", 0.3, 5.0, 2.0, relative=False),
    PersistenceRule("former, warm-up 6 rounds", 0.3, 5.0, 2.0, relative=False, warmup=6),
    PersistenceRule("clip 5, |zs| > 3 alone", 0.3, 5.0, 2.0, absolute=False),
    PersistenceRule("clip 3, |s| > 2", 0.3, 3.0, 2.0, relative=False),
    PersistenceRule("clip 5, |s| > 2 and |zs| > 3", 0.3, 5.0, 2.0, relative=True),
    PersistenceRule("default: clip 3, |s| > 2 and |zs| > 3", 0.3, 3.0, 2.0, relative=True),
)


def persistence_trace(rows: list[dict[str, Any]], rule: PersistenceRule | None = None
                      ) -> list[dict[str, Any]]:
    """Trace rows with ``ewma`` (``s`` after the round) and ``persistent`` (flagged under
    ``rule``, default: the library's defaults) recomputed from their ``z``, per federation
    and signal (copies; ``rows`` is not changed); the ``ewma`` the run recorded (the
    engine's state, under the rule of the code that ran it) is kept as ``engine_ewma``. Under action ``report`` the z do not
    depend on the flag, so this is what a run under ``rule`` records
    (:func:`clma.divergence.update_persistence`)."""
    from clma.divergence import update_persistence

    rule = rule or _default_rule()
    groups: dict[Any, dict[int, list[dict[str, Any]]]] = {}
    for r in rows:
        key = (r["seed"], r["alpha"], r["perturbation"], r["signal"])
        groups.setdefault(key, {}).setdefault(r["round"], []).append(dict(r))
    out = []
    for by_round in groups.values():
        state: dict[int, float] = {}
        seen: dict[int, int] = {}
        for t in sorted(by_round):
            mine = by_round[t]
            state = update_persistence(state, {r["client"]: r["z"] for r in mine},
                                       lam=rule.lam, clip=rule.clip)
            for r in mine:
                seen[r["client"]] = seen.get(r["client"], 0) + int(math.isfinite(r["z"]))
            flagged = rule.flags(state, [r["client"] for r in mine], seen)
            for r in mine:
                r.setdefault("engine_ewma", r["ewma"])
                r["ewma"] = state[r["client"]]
                r["persistent"] = r["client"] in flagged
                out.append(r)
    return out


def summarise_federation(rows: list[dict[str, Any]], signal: str, shifted: int, *,
                         z_threshold: float = 3.0, rule: PersistenceRule | None = None,
                         first_round: int = 2) -> dict[str, Any]:
    """The statistics of one federation and signal (module docstring; :data:`STAT_COLUMNS`).

    ``rows``: trace rows of one federation (:data:`TRACE_COLUMNS`). Rank, top-1, AUC, mean z
    and rounds flagged are over rounds ``>= first_round``; the persistent flag (under
    ``rule``, default the library's: :func:`persistence_trace`, from the rows' z) counts
    from round 1 (the EWMA starts there).
    """
    mine = persistence_trace([r for r in rows if r["signal"] == signal], rule)
    last = max(r["round"] for r in mine)
    by_round: dict[int, dict[int, dict[str, Any]]] = {}
    for r in mine:
        by_round.setdefault(r["round"], {})[r["client"]] = r
    scored = [t for t in sorted(by_round) if t >= first_round and shifted in by_round[t]]
    ranks, ranks_abs, z_shift, regular_z = [], [], [], []
    for t in scored:
        z = {c: r["z"] for c, r in by_round[t].items()}
        ranks.append(_rank(z, shifted))
        ranks_abs.append(_rank({c: abs(v) for c, v in z.items()}, shifted))
        z_shift.append(z[shifted])
        regular_z.append([v for c, v in z.items() if c != shifted])
    pooled = [r for r in mine if r["round"] in set(scored)]
    labels = [int(r["client"] == shifted) for r in pooled]
    half = len(scored) // 2
    flat = [v for zs in regular_z for v in zs]

    def p90(block: list[list[float]]) -> float:
        vals = [abs(v) for zs in block for v in zs]
        return float(np.percentile(vals, 90)) if vals else math.nan

    persistent = {t: {c for c, r in by_round[t].items() if r["persistent"]}
                  for t in sorted(by_round)}
    shifted_rounds = [t for t in sorted(by_round) if shifted in persistent[t]]
    held = None
    for t in sorted(by_round, reverse=True):
        if shifted not in persistent[t]:
            break
        held = t
    regular_persistent = {c for t in persistent for c in persistent[t] if c != shifted}
    in_scored = set(scored)
    return {
        "mean_z_shifted": float(np.mean(z_shift)) if z_shift else math.nan,
        "mean_abs_z_shifted": float(np.mean(np.abs(z_shift))) if z_shift else math.nan,
        "mean_rank": float(np.mean(ranks)) if ranks else math.nan,
        "mean_rank_abs": float(np.mean(ranks_abs)) if ranks_abs else math.nan,
        "top1": float(np.mean([k == 1 for k in ranks])) if ranks else math.nan,
        "top1_abs": float(np.mean([k == 1 for k in ranks_abs])) if ranks_abs else math.nan,
        "auc": _auc(labels, [r["z"] for r in pooled]),
        "auc_abs": _auc(labels, [abs(r["z"]) for r in pooled]),
        "regular_median_z": float(np.median(flat)) if flat else math.nan,
        "regular_abs_z_p90_early": p90(regular_z[:half]),
        "regular_abs_z_p90_late": p90(regular_z[half:]),
        "rounds_flagged_one_sided": sum(z > z_threshold for z in z_shift),
        "rounds_flagged_two_sided": sum(abs(z) > z_threshold for z in z_shift),
        "rounds_flagged_persistent": sum(t in in_scored for t in shifted_rounds),
        "persistent_first_round": shifted_rounds[0] if shifted_rounds else None,
        "persistent_held_from": held,
        "regular_persistent_clients": len(regular_persistent),
        "regular_flags_two_sided": sum(abs(v) > z_threshold for zs in regular_z for v in zs),
        "rounds_scored": len(scored),
        "last_round": last,
    }


def summarise_cells(seed_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (alpha, perturbation, signal): means over seeds (:data:`CELL_COLUMNS`).

    ``persistent_first_round``: mean over the seeds where the flag was raised (None if in
    none); ``seeds_persistent_by_10``: seeds whose shifted client was flagged persistently by
    round 10; ``max_regular_persistent``: the largest number of regular clients flagged
    persistently in one federation."""
    out = []
    keys = sorted({(r["alpha"], r["perturbation"], r["signal"]) for r in seed_rows},
                  key=lambda k: (-k[0], PERTURBATIONS.index(k[1]), SIGNALS.index(k[2])))
    for alpha, pert, sig in keys:
        sel = [r for r in seed_rows
               if (r["alpha"], r["perturbation"], r["signal"]) == (alpha, pert, sig)]

        def mean(col: str, rows: list[dict[str, Any]] = sel) -> float:
            vals = [r[col] for r in rows if r[col] is not None and math.isfinite(r[col])]
            return float(np.mean(vals)) if vals else math.nan

        firsts = [r["persistent_first_round"] for r in sel
                  if r["persistent_first_round"] is not None]
        out.append({
            "alpha": alpha, "perturbation": pert, "signal": sig, "seeds": len(sel),
            **{c: mean(c) for c in ("mean_z_shifted", "mean_abs_z_shifted", "mean_rank",
                                    "top1", "top1_abs", "auc", "auc_abs",
                                    "regular_abs_z_p90_early", "regular_abs_z_p90_late")},
            "persistent_first_round": float(np.mean(firsts)) if firsts else None,
            "seeds_persistent_by_10": sum(
                r["persistent_first_round"] is not None
                and r["persistent_first_round"] <= TARGET_PERSISTENT_BY for r in sel),
            "max_regular_persistent": max(r["regular_persistent_clients"] for r in sel),
            "seeds_quarantined": sum(r["shifted_quarantined"] != "no" for r in sel),
        })
    return out


def targets(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 20's targets per (alpha, perturbation), for each signal and the better one.

    ``separation``: mean |z| of the shifted client >= 2 and AUC by |z| >= 0.8 (seed means).
    ``persistent``: flagged persistently by round 10 in every seed, and at most one regular
    client flagged persistently in every federation."""
    per_cell: dict[str, dict[str, Any]] = {}
    for c in cells:
        key = f"a{c['alpha']:g} {c['perturbation']}"
        sep = (c["mean_abs_z_shifted"] >= TARGET_MEAN_ABS_Z
               and c["auc_abs"] >= TARGET_AUC_ABS)
        pers = (c["seeds_persistent_by_10"] == c["seeds"]
                and c["max_regular_persistent"] <= TARGET_MAX_REGULAR_PERSISTENT)
        per_cell.setdefault(key, {})[c["signal"]] = {"separation": bool(sep),
                                                     "persistent": bool(pers)}
    for v in per_cell.values():
        v["better_separation"] = any(s["separation"] for s in v.values() if isinstance(s, dict))
        v["better_persistent"] = any(s["persistent"] for k, s in v.items()
                                     if k in SIGNALS)
    return {
        "cells": per_cell,
        "separation_all_cells": all(v["better_separation"] for v in per_cell.values()),
        "persistent_cells": sum(v["better_persistent"] for v in per_cell.values()),
        "n_cells": len(per_cell),
    }


def persistence_rules(traces: list[dict[str, Any]], shifted: int,
                      rules: tuple[PersistenceRule, ...] = COMPARED_RULES,
                      by_round: int = TARGET_PERSISTENT_BY) -> list[dict[str, Any]]:
    """Each rule's persistent flag recomputed from the traces' z (:func:`persistence_trace`).

    One row per (rule, signal): over all federations, how many have the shifted client
    flagged by ``by_round`` (``feds_by_round``), how many have at most one regular client
    ever flagged (``feds_regular_ok``), both (``feds_both``), the cells (alpha,
    perturbation) where every seed has both (``cells_ok``), and the regular clients flagged
    at least once, summed over the federations (``regular_flagged``)."""
    feds = sorted({(r["seed"], r["alpha"], r["perturbation"]) for r in traces})
    cells = sorted({(a, p) for _, a, p in feds})
    out = []
    for rule in rules:
        flagged = persistence_trace(traces, rule)
        for sig in SIGNALS:
            ok: dict[Any, tuple[bool, bool]] = {}
            n_regular = 0
            for f in feds:
                mine = [r for r in flagged if r["persistent"] and r["signal"] == sig
                        and (r["seed"], r["alpha"], r["perturbation"]) == f]
                early = any(r["client"] == shifted and r["round"] <= by_round for r in mine)
                regular = {r["client"] for r in mine if r["client"] != shifted}
                n_regular += len(regular)
                ok[f] = (early, len(regular) <= TARGET_MAX_REGULAR_PERSISTENT)
            out.append({
                "rule": rule.name, "signal": sig, "federations": len(feds),
                "feds_by_round": sum(a for a, _ in ok.values()),
                "feds_regular_ok": sum(b for _, b in ok.values()),
                "feds_both": sum(a and b for a, b in ok.values()),
                "cells_ok": sum(all(all(ok[f]) for f in feds if (f[1], f[2]) == c)
                                for c in cells),
                "cells": len(cells), "regular_flagged": n_regular,
            })
    return out


RULE_COLUMNS = ["rule", "signal", "federations", "feds_by_round", "feds_regular_ok",
                "feds_both", "cells_ok", "cells", "regular_flagged"]


def regular_client_diagnostics(traces: list[dict[str, Any]], shifted: int, *,
                               lam: float = 0.3, clip: float = 5.0, split: int = 10
                               ) -> list[dict[str, Any]]:
    """Why regular clients' EWMA crosses a fixed threshold: their z against the i.i.d.
    N(0, 1) model the fixed threshold assumes. One row per signal, pooled over
    federations, regular clients only, rounds ``2..R`` unless stated:

    * ``p_abs_z_gt3`` / ``p_abs_z_gt5``: fraction of (round, client) pairs with ``|z|`` above
      3 / 5 (N(0, 1): 0.0027 / 5.7e-7); ``kurtosis``: excess kurtosis of z (N: 0);
      ``sd_clipped_z``: standard deviation of ``clip(z, -clip, clip)`` (N: about 1);
    * ``..._early`` (rounds ``2..split``) / ``..._late`` (``split+1..R``) of ``p_abs_z_gt3``;
    * ``sd_client_mean_z``: standard deviation of each client's mean z over its rounds,
      against ``sd_client_mean_iid`` = ``sd_clipped_z / sqrt(rounds)``, its value if a
      client's rounds were independent draws around a common level (a larger value: each
      client keeps a level of its own);
    * ``lag1_autocorr``: mean over clients of the lag-1 autocorrelation of a client's
      clipped z around its own mean (short memory beyond its level);
    * ``sd_ewma_late``: standard deviation of the EWMA ``s`` (``lam``, ``clip``) in rounds
      ``split..R``, against ``sd_ewma_iid_normal`` = ``sqrt(lam / (2 - lam))`` (Lucas &
      Saccucci 1990); ``p_abs_ewma_gt2``: fraction of those ``|s| > 2``.
    """
    from scipy import stats

    from clma.divergence import update_persistence

    out = []
    feds = sorted({(r["seed"], r["alpha"], r["perturbation"]) for r in traces})
    for sig in SIGNALS:
        series: list[np.ndarray] = []
        ewma_late: list[float] = []
        for f in feds:
            rows = [r for r in traces if r["signal"] == sig
                    and (r["seed"], r["alpha"], r["perturbation"]) == f]
            rounds = sorted({r["round"] for r in rows})
            zmap = {(r["round"], r["client"]): r["z"] for r in rows}
            state: dict[int, float] = {}
            for t in rounds:
                state = update_persistence(state, {c: v for (tt, c), v in zmap.items()
                                                   if tt == t}, lam=lam, clip=clip)
                if t >= split:
                    ewma_late += [v for c, v in state.items() if c != shifted]
            for c in sorted({r["client"] for r in rows} - {shifted}):
                series.append(np.array([zmap[(t, c)] for t in rounds
                                        if t >= 2 and (t, c) in zmap]))
        if not series:
            continue
        z = np.concatenate(series)
        zc = np.clip(z, -clip, clip)
        early = np.concatenate([x[: split - 1] for x in series])
        late = np.concatenate([x[split - 1:] for x in series])
        acf = [np.corrcoef(np.clip(x[:-1], -clip, clip), np.clip(x[1:], -clip, clip))[0, 1]
               for x in series if len(x) > 2]
        sd_c = float(np.std(zc))
        n_rounds = float(np.mean([len(x) for x in series]))
        out.append({
            "signal": sig, "pairs": int(z.size),
            "p_abs_z_gt3": float(np.mean(np.abs(z) > 3)),
            "p_abs_z_gt3_early": float(np.mean(np.abs(early) > 3)),
            "p_abs_z_gt3_late": float(np.mean(np.abs(late) > 3)),
            "p_abs_z_gt5": float(np.mean(np.abs(z) > 5)),
            "kurtosis": float(stats.kurtosis(z)), "sd_clipped_z": sd_c,
            "sd_client_mean_z": float(np.std([np.mean(np.clip(x, -clip, clip))
                                              for x in series])),
            "sd_client_mean_iid": sd_c / math.sqrt(n_rounds),
            "lag1_autocorr": float(np.nanmean(acf)) if acf else math.nan,
            "sd_ewma_late": float(np.std(ewma_late)) if ewma_late else math.nan,
            "sd_ewma_iid_normal": math.sqrt(lam / (2 - lam)),
            "p_abs_ewma_gt2": float(np.mean(np.abs(ewma_late) > 2)) if ewma_late else math.nan,
        })
    return out


DIAGNOSTIC_COLUMNS = ["signal", "pairs", "p_abs_z_gt3", "p_abs_z_gt3_early",
                      "p_abs_z_gt3_late", "p_abs_z_gt5", "kurtosis", "sd_clipped_z",
                      "sd_client_mean_z", "sd_client_mean_iid", "lag1_autocorr",
                      "sd_ewma_late", "sd_ewma_iid_normal", "p_abs_ewma_gt2"]


def window_aucs(traces: list[dict[str, Any]], shifted: int, split: int = 10
                ) -> list[dict[str, Any]]:
    """AUC by z and by |z| per (alpha, perturbation, signal) in rounds ``2..split`` and
    ``split+1..R``, pooled over seeds (is the separation early or late?)."""
    out = []
    cells = sorted({(r["alpha"], r["perturbation"]) for r in traces},
                   key=lambda k: (-k[0], PERTURBATIONS.index(k[1])))
    for alpha, pert in cells:
        for sig in SIGNALS:
            row: dict[str, Any] = {"alpha": alpha, "perturbation": pert, "signal": sig}
            for name, lo, hi in (("early", 2, split), ("late", split + 1, 10**9)):
                sel = [r for r in traces if (r["alpha"], r["perturbation"], r["signal"])
                       == (alpha, pert, sig) and lo <= r["round"] <= hi]
                labels = [int(r["client"] == shifted) for r in sel]
                row[f"auc_{name}"] = _auc(labels, [r["z"] for r in sel])
                row[f"auc_abs_{name}"] = _auc(labels, [abs(r["z"]) for r in sel])
            out.append(row)
    return out


WINDOW_COLUMNS = ["alpha", "perturbation", "signal", "auc_early", "auc_abs_early",
                  "auc_late", "auc_abs_late"]


# ------------------------------------------------------------------------------ outputs


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.2f}"
    return str(v)


def to_markdown(rows: list[dict[str, Any]], columns: list[str] = CELL_COLUMNS) -> str:
    """Rows as a GitHub Markdown table."""
    head = "| " + " | ".join(columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(_fmt(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body]) + "\n"


def _json_safe(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str]) -> None:
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def plot_cell(traces: list[dict[str, Any]], alpha: float, perturbation: str, shifted: int,
              path: Path, z_threshold: float = 3.0):
    """z per client over rounds for one cell: a row per seed, a column per signal; the
    shifted client in red (its persistence EWMA dashed), regular clients in grey, the
    two-sided threshold dotted. Returns the matplotlib figure (also saved to ``path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted({r["seed"] for r in traces})
    fig, axes = plt.subplots(len(seeds), 2, figsize=(10, 2.6 * len(seeds)), squeeze=False,
                             sharex=True)
    for i, seed in enumerate(seeds):
        for j, sig in enumerate(SIGNALS):
            ax = axes[i][j]
            sel = [r for r in traces if r["seed"] == seed and r["signal"] == sig]
            for c in sorted({r["client"] for r in sel}):
                pts = sorted((r["round"], r["z"], r["ewma"]) for r in sel if r["client"] == c)
                xs = [p[0] for p in pts]
                if c == shifted:
                    ax.plot(xs, [p[1] for p in pts], color="tab:red", lw=2,
                            label=f"shifted client {c}: z")
                    ax.plot(xs, [p[2] for p in pts], color="tab:red", ls="--", lw=1,
                            label="its EWMA s")
                else:
                    ax.plot(xs, [p[1] for p in pts], color="0.6", lw=0.8)
            for y in (z_threshold, -z_threshold):
                ax.axhline(y, color="k", ls=":", lw=0.8)
            ax.set_title(f"{sig}, seed {seed}", fontsize=9)
            ax.set_ylabel("robust z")
            if i == 0 and j == 0:
                ax.legend(fontsize=7, loc="upper right")
    for ax in axes[-1]:
        ax.set_xlabel("round")
    fig.suptitle(f"alpha {alpha:g}, {perturbation}: robust z per client "
                 "(simulation research output)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    return fig


def figure_name(alpha: float, perturbation: str) -> str:
    """``z_a<alpha>_<perturbation>.png`` (a decimal point in alpha written as ``p``)."""
    return f"z_a{alpha:g}_{perturbation}.png".replace(".", "p", f"{alpha:g}".count("."))


def seed_rows_from_traces(traces: list[dict[str, Any]], shifted: int) -> list[dict[str, Any]]:
    """Per (seed, alpha, perturbation, signal) statistics (:data:`SEED_COLUMNS`)."""
    out = []
    feds = sorted({(r["seed"], r["alpha"], r["perturbation"]) for r in traces})
    for seed, alpha, pert in feds:
        fed = [r for r in traces if (r["seed"], r["alpha"], r["perturbation"]) == (seed, alpha, pert)]
        q = sorted({r["round"] for r in fed if r["client"] == shifted and r["cohort"] != 0})
        for sig in SIGNALS:
            out.append({"seed": seed, "alpha": alpha, "perturbation": pert, "signal": sig,
                        **summarise_federation(fed, sig, shifted),
                        "shifted_quarantined": f"from round {q[0]}" if q else "no"})
    return out


# ------------------------------------------------------------------------------ run


def _jobs(args: argparse.Namespace) -> list[dict[str, Any]]:
    mags = _magnitudes(args)
    # seed-major: an interrupted run has every cell at the first seeds
    return [{"seed": s, "alpha": a, "perturbation": p, "rounds": args.rounds,
             "clients": args.clients, "shifted": args.shifted_client,
             "probe_size": args.probe_size, "magnitude": mags[p]}
            for s in args.seeds for a in args.alphas for p in args.perturbations]


def _cache_path(out: Path, job: dict[str, Any]) -> Path:
    key = json.dumps(job, sort_keys=True)
    import hashlib

    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return out / "federations" / (
        f"seed{job['seed']}_a{job['alpha']:g}_{job['perturbation']}_{digest}.json")


def _run_cached(job: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    """:func:`run_federation`, its traces kept in ``out/federations/`` (keyed by the whole
    job): a re-run of the command with the same arguments reuses finished federations
    (each federation is deterministic in its job)."""
    path = _cache_path(out, job)
    if path.exists():
        return json.loads(path.read_text())["rows"]
    rows = run_federation(job)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"job": job, "rows": rows}))
    tmp.replace(path)
    return rows


def _check(args: argparse.Namespace) -> str | None:
    if args.rounds < 2:
        return "--rounds must be >= 2 (rounds 2.. are scored)"
    if args.clients < 3:
        return "--clients must be >= 3 (robust z needs 3 clients)"
    if args.probe_size < 1 or args.workers < 1:
        return "--probe-size and --workers must be >= 1"
    for name in ("alphas", "perturbations", "seeds"):
        if len(set(getattr(args, name))) != len(getattr(args, name)):
            return f"--{name} must not repeat a value"
    if args.out.exists() and not args.out.is_dir():
        return f"--out {str(args.out)!r} exists and is not a directory"
    if not 0 <= args.shifted_client < args.clients:
        return "--shifted-client must be in [0, clients)"
    from clma.config import ConfigError

    try:
        for job in _jobs(args):
            make_config(**job)
    except ConfigError as exc:
        return str(exc)
    return None


def run(args: argparse.Namespace) -> int:
    """Run the experiment; print the cell table. Returns 0, or 2 on bad arguments."""
    import sys

    problem = _check(args)
    if problem:
        print(f"clma: {problem}", file=sys.stderr)
        return 2
    from prefect import flow, task

    from tasks.tracking import FederationTracker

    jobs = _jobs(args)
    shifted = args.shifted_client
    tags = {"clma.experiment": "atypical-client", "clma.sim_truth_metrics": "true",
            "clma.artifacts_client_ids": "simulation-ground-truth",
            "clma.output_kind": "simulation research output"}

    @task(name="run-atypical-federations")
    def run_all() -> list[dict[str, Any]]:
        if args.workers == 1:
            return [row for job in jobs for row in _run_cached(job, args.out)]
        with ProcessPoolExecutor(max_workers=args.workers) as pool:
            return [row for rows in pool.map(_run_cached, jobs, [args.out] * len(jobs))
                    for row in rows]

    @flow(name="atypical-client-experiment")
    def experiment() -> dict[str, Any]:
        parent = FederationTracker()
        parent.start(
            args.experiment, run_name="atypical-client-seeds" + "-".join(map(str, args.seeds)),
            params={"alphas": json.dumps(args.alphas),
                    "perturbations": json.dumps(args.perturbations),
                    "seeds": json.dumps(args.seeds), "rounds": str(args.rounds),
                    "clients": str(args.clients), "shifted_client": str(shifted),
                    "probe_size": str(args.probe_size),
                    **{f"magnitude.{k}": str(v) for k, v in _magnitudes(args).items()}},
            tags=tags)
        status = "FAILED"
        children: dict[str, str] = {}
        try:
            # the persistence columns under the library's rule, from z (cached federations
            # recorded under an earlier rule give the same z: action report)
            traces = persistence_trace(run_all())
            seed_rows = seed_rows_from_traces(traces, shifted)
            cells = summarise_cells(seed_rows)
            verdict = targets(cells)
            out = args.out
            out.mkdir(parents=True, exist_ok=True)
            (out / "atypical_client.md").write_text(to_markdown(cells))
            _write_csv(out / "atypical_client.csv", cells, CELL_COLUMNS)
            _write_csv(out / "atypical_client_seeds.csv", seed_rows, SEED_COLUMNS)
            _write_csv(out / "per_client_z.csv", traces, TRACE_COLUMNS)
            grid = persistence_rules(traces, shifted)
            (out / "persistence_rules.md").write_text(to_markdown(grid, RULE_COLUMNS))
            diag = regular_client_diagnostics(traces, shifted)
            (out / "persistence_diagnostics.md").write_text(
                to_markdown(diag, DIAGNOSTIC_COLUMNS))
            windows = window_aucs(traces, shifted)
            (out / "atypical_client_windows.md").write_text(to_markdown(windows,
                                                                        WINDOW_COLUMNS))
            meta = {
                "command": "clma experiment atypical-client",
                "seeds": args.seeds, "rounds": args.rounds, "clients": args.clients,
                "alphas": args.alphas, "perturbations": args.perturbations,
                "shifted_client": shifted, "probe_size": args.probe_size,
                "magnitudes": _magnitudes(args), "rounds_scored": f"2..{args.rounds}",
                "z_rule": "robust z (median, 1.4826 MAD) across the round's clients",
                "persistence": "EWMA lambda 0.3 of z clipped at 3; flag |s| > 2 and |robust "
                               "z of s across the round's clients| > 3",
                "parameter_baseline": "cosine distance to the leave-one-out mean update",
                "note": "per_client_z.csv and the figures are simulation research output "
                        "(client ids are simulation ground truth)",
                "targets": verdict,
                "cells": [{k: _json_safe(v) for k, v in r.items()} for r in cells],
                "per_seed": [{k: _json_safe(v) for k, v in r.items()} for r in seed_rows],
                "persistence_rules": grid,
                "regular_client_diagnostics": diag,
                "windows": windows,
            }
            (out / "atypical_client.json").write_text(json.dumps(meta, indent=2) + "\n")
            import matplotlib.pyplot as plt

            for alpha in args.alphas:
                for pert in args.perturbations:
                    cell = [r for r in traces
                            if r["alpha"] == alpha and r["perturbation"] == pert]
                    name = figure_name(alpha, pert)
                    fig = plot_cell(cell, alpha, pert, shifted, out / "figures" / name)
                    child = FederationTracker(parent.tracking_uri)
                    child.start(args.experiment, run_name=f"a{alpha:g}-{pert}",
                                params={"alpha": str(alpha), "perturbation": pert,
                                        "seeds": json.dumps(args.seeds)},
                                tags={**tags, "clma.shifted_client": str(shifted)},
                                parent_run_id=parent.run_id)
                    child.log_figure(fig, f"figures/{name}")
                    plt.close(fig)
                    child.log_dict({"note": "simulation research output (client ids are "
                                            "simulation ground truth)",
                                    "rows": cell}, "per_client_z.json")
                    for row in (r for r in cells
                                if r["alpha"] == alpha and r["perturbation"] == pert):
                        child.log_metrics({f"{row['signal']}.{k}": row[k] for k in
                                           ("mean_z_shifted", "mean_abs_z_shifted", "auc",
                                            "auc_abs", "top1", "top1_abs", "mean_rank")},
                                          step=0)
                        key = f"a{alpha:g}.{pert}.{row['signal']}"
                        parent.log_metrics({f"{key}.{k}": row[k] for k in
                                            ("mean_abs_z_shifted", "auc_abs", "top1_abs",
                                             "seeds_persistent_by_10")}, step=0)
                    child.finish("FINISHED")
                    children[f"{alpha:g}/{pert}"] = child.run_id or ""
            for p in ("atypical_client.md", "atypical_client.csv", "atypical_client.json",
                      "atypical_client_seeds.csv", "per_client_z.csv", "persistence_rules.md",
                      "persistence_diagnostics.md",
                      "atypical_client_windows.md"):
                parent.log_artifact(str(out / p))
            parent.log_artifact(str(out / "figures"))
            status = "FINISHED"
        finally:
            parent.finish(status)
        return {"cells": cells, "targets": verdict, "parent_run_id": parent.run_id,
                "children": children}

    result = experiment()
    print(to_markdown(result["cells"]), end="")
    t = result["targets"]
    print(f"targets: separation in every cell: {t['separation_all_cells']}; persistent flag "
          f"by round {TARGET_PERSISTENT_BY}: {t['persistent_cells']} of {t['n_cells']} cells")
    print(f"table: {args.out / 'atypical_client.md'}  MLflow parent run: "
          f"{result['parent_run_id']}")
    return 0
