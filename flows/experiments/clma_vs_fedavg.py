"""CLMA vs plain FedAvg: same clients, data, drift schedule and seed, two Prefect flows.

``clma experiment clma-vs-fedavg`` runs, for every seed, the scenario config twice through
:func:`flows.federation.federation_flow`: once as CLMA (``cohort.enabled = true``: drifted
clients are quarantined and cohorted by the direction of their parameter shift) and once as
plain FedAvg (``cohort.enabled = false``: one global model, no quarantine; McMahan et al.
2017). Everything else (clients, IID shards, drift schedule, model, training, seed) is
identical, so the difference between the two arms is the cohorting alone (CLMA: Adarsh N L
et al., CODS-COMAD 2024, doi 10.1145/3703323.3703341, whose reference results on CIFAR-10
this scenario mirrors on scikit-learn's handwritten digits).

The default scenario is the bundled ``clma/configs/clma_vs_fedavg.toml``: 10 clients, 10
rounds, label-rotation concept drift at rounds 3, 5, 7 and 9 into 8 clients split into two
opposite-direction families of 4 (+1 / -1 per event), 2 clients that never drift.

Tracking: one parent MLflow run (experiment ``tracking.experiment``, default
``"clma-vs-fedavg"``) holds every federation run of the experiment as a nested child run
(tag ``mlflow.parentRunId``; two per seed), the results table (``log_table``), the full
results document (``log_dict``) and the summary metrics. Prefect: one parent flow run
``clma-vs-fedavg`` with the federation flow runs as subflows.

Outputs in ``--out``: ``results.csv`` / ``results.md`` / ``results.json`` (one row per
method, mean, sample standard deviation and min/max over the seeds), ``per_seed.csv``
(one row per method and seed), and ``seed<k>/<method>/summary.json`` for every run.

Reported per run, from the run's ``summary["sim_truth"]`` (simulation truth, never a
private release): stationary clients' mean accuracy at the final round and averaged over the
rounds after the first drift event (rounds 4-10 in the default scenario), drifted clients'
mean accuracy at the final round, and whether no cohort ever held clients of two different
drift families at any drift event (``families_separated_every_event``; always false for
FedAvg, whose single model holds every family).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
import tomllib
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from clma.config import ConfigError, FederationConfig, load_config, validate_config

__all__ = [
    "DESCRIPTION",
    "DEFAULT_SEEDS",
    "EXPERIMENT_NAME",
    "METHODS",
    "TABLE_COLUMNS",
    "TARGET_STATIONARY_LIFT",
    "MethodRun",
    "add_arguments",
    "aggregate",
    "arm_config",
    "compare_flow",
    "method_run_from_summary",
    "post_drift_rounds",
    "results_document",
    "run",
    "scenario_config",
    "to_csv",
    "to_markdown",
]

DESCRIPTION = (
    "CLMA vs plain FedAvg on the same clients, data, drift schedule and seeds "
    "(two Prefect flows per seed, nested MLflow runs, results table)"
)
EXPERIMENT_NAME = "clma-vs-fedavg"
DEFAULT_SEEDS = (0, 1, 2, 3, 4)
METHODS = ("clma", "fedavg")
METHOD_LABELS = {"clma": "CLMA", "fedavg": "FedAvg"}
#: Issue 3's target: CLMA's stationary clients end at least this much accuracy above
#: FedAvg's stationary clients (final round), in every seed.
TARGET_STATIONARY_LIFT = 0.30

_STATS = ("mean", "std", "min", "max")
_METRICS = ("stationary_final_accuracy", "stationary_post_drift_accuracy",
            "drifted_final_accuracy")
#: Columns of ``results.csv`` (and of the MLflow table), one row per method.
TABLE_COLUMNS = (
    "method",
    "n_seeds",
    "seeds",
    "post_drift_rounds",
    *(f"{m}_{s}" for m in _METRICS for s in _STATS),
    "families_separated_seeds",
    "drift_event_ari_mean",
)
_PER_SEED_COLUMNS = (
    "method", "seed", *_METRICS, "families_separated_every_event", "ari_per_drift_event",
    "mlflow_run_id",
)


# ----------------------------------------------------------------------------- scenario


def scenario_config(path: str | Path | None = None) -> FederationConfig:
    """The experiment's scenario: ``path`` (a TOML config) or the bundled
    ``clma/configs/clma_vs_fedavg.toml``.

    Raises :class:`clma.config.ConfigError` for a bad file, and for a scenario the
    comparison cannot report on: no drift event, no client that never drifts, or a first
    drift event at the last round (no round after it to average over).
    """
    if path is None:
        text = resources.files("clma.configs").joinpath("clma_vs_fedavg.toml").read_text("utf-8")
        cfg = validate_config(tomllib.loads(text))
    else:
        cfg = load_config(path)
    if not cfg.drift.events:
        raise ConfigError("drift.events: the comparison needs at least one drift event")
    drifted = {c for ev in cfg.drift.events for c in ev.clients}
    if len(drifted) >= cfg.clients:
        raise ConfigError(
            "drift.events: every client drifts; the comparison needs at least one "
            "stationary client (one that never drifts)"
        )
    if min(ev.round for ev in cfg.drift.events) >= cfg.rounds:
        raise ConfigError(
            "drift.events: the first drift event must come before the last round "
            "(accuracy is averaged over the rounds after it)"
        )
    return cfg


def post_drift_rounds(config: FederationConfig) -> tuple[int, int]:
    """``(first, last)`` rounds averaged for the post-drift stationary accuracy: from the
    round after the first drift event to the last round (4-10 in the default scenario)."""
    first = min(ev.round for ev in config.drift.events) + 1
    return first, config.rounds


def arm_config(config: FederationConfig, method: str, seed: int) -> FederationConfig:
    """The scenario as run by one arm: ``method`` "clma" (``cohort.enabled = true``) or
    "fedavg" (``cohort.enabled = false``), with ``seed``; everything else unchanged.

    The run is named ``<name>-<method>`` and tracked in the experiment
    ``tracking.experiment`` (default ``"clma-vs-fedavg"``) so that both arms sit under the
    same parent run. Raises ValueError for an unknown method, ConfigError for a bad seed.
    """
    if method not in METHODS:
        raise ValueError(f"method: must be one of {', '.join(METHODS)}, got {method!r}")
    data = config.model_dump()
    data["seed"] = seed
    data["name"] = f"{config.name}-{method}"[:100]
    data["cohort"]["enabled"] = method == "clma"
    data["tracking"]["experiment"] = config.tracking.experiment or EXPERIMENT_NAME
    return validate_config(data)


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True)
class MethodRun:
    """One federation run's reported figures (accuracies in [0, 1]; None = not measured)."""

    method: str
    seed: int
    stationary_final_accuracy: float | None
    stationary_post_drift_accuracy: float | None
    drifted_final_accuracy: float | None
    families_separated_every_event: bool
    ari_per_drift_event: dict[str, float]
    mlflow_run_id: str | None = None


def method_run_from_summary(
    summary: Mapping[str, Any], method: str, seed: int, rounds: tuple[int, int]
) -> MethodRun:
    """Extract a :class:`MethodRun` from a ``clma.summary/2`` document.

    ``stationary_post_drift_accuracy`` is the plain mean of ``per_round`` stationary
    accuracies over rounds ``rounds[0]..rounds[1]`` (inclusive), skipping rounds where no
    stationary client was evaluated; None if there is none. Raises ValueError if the
    summary lacks its ``sim_truth`` section.
    """
    gt = summary.get("sim_truth")
    if not isinstance(gt, Mapping):
        raise ValueError("summary: no 'sim_truth' section (not a clma.summary/2 document "
                         "of a simulation)")
    lo, hi = rounds
    window = [
        float(r["stationary_accuracy"])
        for r in gt["per_round"]
        if lo <= int(r["round"]) <= hi and r["stationary_accuracy"] is not None
    ]

    def opt(v: Any) -> float | None:
        return None if v is None else float(v)

    return MethodRun(
        method=method,
        seed=int(seed),
        stationary_final_accuracy=opt(gt["stationary_final_accuracy"]),
        stationary_post_drift_accuracy=float(np.mean(window)) if window else None,
        drifted_final_accuracy=opt(gt["drifted_final_accuracy"]),
        families_separated_every_event=bool(gt["families_separated_every_event"]),
        ari_per_drift_event={str(k): float(v) for k, v in gt["ari_per_drift_event"].items()},
        mlflow_run_id=(summary.get("mlflow") or {}).get("run_id"),
    )


def _stats(values: Sequence[float | None]) -> dict[str, float | None]:
    """mean, sample standard deviation (ddof=1; None for one value), min, max."""
    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    if v.size == 0:
        return dict.fromkeys(_STATS)
    return {
        "mean": float(v.mean()),
        "std": float(v.std(ddof=1)) if v.size > 1 else None,
        "min": float(v.min()),
        "max": float(v.max()),
    }


def aggregate(runs: Sequence[MethodRun], rounds: tuple[int, int]) -> list[dict[str, Any]]:
    """The results table: one row per method (in :data:`METHODS` order), with the columns
    :data:`TABLE_COLUMNS`: mean / sample std (ddof=1, None for one seed) / min / max over
    seeds of each accuracy, the number of seeds in which families were separated at every
    drift event, and the mean ARI over all drift events of all seeds. Raises ValueError
    when ``runs`` is empty."""
    if not runs:
        raise ValueError("runs: nothing to aggregate")
    rows = []
    for method in [m for m in METHODS if any(r.method == m for r in runs)]:
        mine = sorted((r for r in runs if r.method == method), key=lambda r: r.seed)
        row: dict[str, Any] = {
            "method": method,
            "n_seeds": len(mine),
            "seeds": " ".join(str(r.seed) for r in mine),
            "post_drift_rounds": f"{rounds[0]}-{rounds[1]}",
        }
        for metric in _METRICS:
            for stat, value in _stats([getattr(r, metric) for r in mine]).items():
                row[f"{metric}_{stat}"] = value
        row["families_separated_seeds"] = sum(r.families_separated_every_event for r in mine)
        aris = [a for r in mine for a in r.ari_per_drift_event.values()]
        row["drift_event_ari_mean"] = float(np.mean(aris)) if aris else None
        rows.append(row)
    return rows


def _lift(runs: Sequence[MethodRun]) -> dict[str, Any]:
    """Per-seed CLMA - FedAvg stationary final accuracy and the issue's target check."""
    by = {(r.method, r.seed): r for r in runs}
    seeds = sorted({r.seed for r in runs})
    per_seed = {}
    for s in seeds:
        a, b = by.get(("clma", s)), by.get(("fedavg", s))
        if a and b and a.stationary_final_accuracy is not None \
                and b.stationary_final_accuracy is not None:
            per_seed[str(s)] = a.stationary_final_accuracy - b.stationary_final_accuracy
    vals = list(per_seed.values())
    clma_runs = [r for r in runs if r.method == "clma"]
    separated = bool(clma_runs) and all(r.families_separated_every_event for r in clma_runs)
    every = bool(vals) and len(vals) == len(seeds) and min(vals) >= TARGET_STATIONARY_LIFT
    return {
        "per_seed": per_seed,
        "mean": float(np.mean(vals)) if vals else None,
        "min": float(min(vals)) if vals else None,
        "target": TARGET_STATIONARY_LIFT,
        "lift_met_every_seed": every,
        "clma_families_separated_every_seed": separated,
        "target_met": every and separated,
    }


def results_document(
    config: FederationConfig, runs: Sequence[MethodRun], *, parent_run_id: str | None
) -> dict[str, Any]:
    """The ``results.json`` document (schema ``clma.experiment.clma-vs-fedavg/1``)."""
    rounds = post_drift_rounds(config)
    return {
        "schema": "clma.experiment.clma-vs-fedavg/1",
        "note": "simulation ground truth; never part of a private release",
        "scenario": {
            "name": config.name,
            "config_fingerprint": config.fingerprint(),
            "dataset": config.data.dataset,
            "clients": config.clients,
            "rounds": config.rounds,
            "drift_rounds": sorted({ev.round for ev in config.drift.events}),
            "stationary_clients": config.clients
            - len({c for ev in config.drift.events for c in ev.clients}),
            "post_drift_rounds": list(rounds),
        },
        "seeds": sorted({r.seed for r in runs}),
        "std": "sample standard deviation over seeds (ddof=1); null for one seed",
        "table": aggregate(runs, rounds),
        "stationary_final_lift_clma_minus_fedavg": _lift(runs),
        "per_seed": [asdict(r) for r in sorted(runs, key=lambda r: (r.seed, r.method))],
        "mlflow_parent_run_id": parent_run_id,
    }


def to_csv(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """CSV text (header + rows; None as an empty cell; dicts as JSON)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for row in rows:
        cells = []
        for c in columns:
            v = row[c]
            cells.append("" if v is None else json.dumps(v, sort_keys=True)
                         if isinstance(v, dict) else v)
        w.writerow(cells)
    return buf.getvalue()


def _cell(row: Mapping[str, Any], metric: str) -> str:
    m, s, lo, hi = (row[f"{metric}_{k}"] for k in _STATS)
    if m is None:
        return "n/a"
    spread = "" if s is None else f" ± {s:.3f}"
    return f"{m:.3f}{spread} [{lo:.3f}, {hi:.3f}]"


def to_markdown(doc: Mapping[str, Any]) -> str:
    """The Markdown results table (mean ± sample std [min, max] over seeds) and the
    CLMA - FedAvg stationary-accuracy line."""
    rows = doc["table"]
    lo, hi = doc["scenario"]["post_drift_rounds"]
    header = [
        "method", "seeds", "stationary acc., final round",
        f"stationary acc., mean rounds {lo}-{hi}", "drifted acc., final round",
        "families separated at every drift event", "mean ARI per drift event",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        ari = "n/a" if r["drift_event_ari_mean"] is None else f"{r['drift_event_ari_mean']:.3f}"
        lines.append("| " + " | ".join([
            METHOD_LABELS[r["method"]], str(r["n_seeds"]),
            _cell(r, "stationary_final_accuracy"), _cell(r, "stationary_post_drift_accuracy"),
            _cell(r, "drifted_final_accuracy"),
            f"{r['families_separated_seeds']}/{r['n_seeds']} seeds", ari,
        ]) + " |")
    lift = doc["stationary_final_lift_clma_minus_fedavg"]
    sc = doc["scenario"]
    text = [
        f"Scenario `{sc['name']}`: {sc['dataset']}, {sc['clients']} clients "
        f"({sc['stationary_clients']} never drift), {sc['rounds']} rounds, drift at rounds "
        f"{', '.join(map(str, sc['drift_rounds']))}; seeds "
        f"{' '.join(map(str, doc['seeds']))}. Cells: mean ± sample std [min, max] over seeds.",
        "",
        *lines,
        "",
    ]
    if lift["mean"] is not None:
        text.append(
            f"CLMA − FedAvg stationary accuracy at the final round: mean {lift['mean']:+.3f}, "
            f"min over seeds {lift['min']:+.3f} (target ≥ +{lift['target']:.2f} in every seed "
            f"with CLMA's families separated at every event: "
            f"{'met' if lift['target_met'] else 'NOT met'})."
        )
    return "\n".join(text) + "\n"


# ----------------------------------------------------------------------------- flows


def compare_flow(
    config: FederationConfig,
    seeds: Sequence[int],
    out_dir: str | None = None,
    progress: Any = None,
) -> dict[str, Any]:
    """Run both arms for every seed (Prefect flow ``clma-vs-fedavg``) and return the
    results document (see :func:`results_document`); write the tables to ``out_dir``.

    ``progress``, if given, is called as ``progress(method, seed, MethodRun)`` after each
    federation run. Defined as a Prefect flow on first call (this module is imported by
    the command line's parser, which must not import Prefect).
    """
    return _compare_flow()(config, list(seeds), out_dir, progress)


_FLOW: Any = None


def _compare_flow() -> Any:
    global _FLOW
    if _FLOW is None:
        from prefect import flow

        _FLOW = flow(name="clma-vs-fedavg", flow_run_name="clma-vs-fedavg-{config.name}")(
            _compare
        )
    return _FLOW


def _compare(
    config: FederationConfig, seeds: list[int], out_dir: str | None, progress: Any
) -> dict[str, Any]:
    from flows.federation import federation_flow
    from tasks.tracking import FederationTracker

    rounds = post_drift_rounds(config)
    experiment = config.tracking.experiment or EXPERIMENT_NAME
    tracker: FederationTracker | None = None
    if config.tracking.enabled:
        tracker = FederationTracker()
        params = config.flat_params()
        params["experiment.seeds"] = " ".join(map(str, seeds))
        params["experiment.methods"] = " ".join(METHODS)
        tracker.start(
            experiment,
            run_name=f"{EXPERIMENT_NAME}-seeds-{'-'.join(map(str, seeds))}"[:250],
            params=params,
            tags={
                "clma.experiment": EXPERIMENT_NAME,
                "clma.seeds": " ".join(map(str, seeds)),
                "clma.config_fingerprint": config.fingerprint(),
                "clma.sim_truth_metrics": "true",
            },
        )
    out = Path(out_dir) if out_dir else None
    runs: list[MethodRun] = []
    status = "FAILED"
    try:
        for seed in seeds:
            for method in METHODS:
                cfg = arm_config(config, method, seed)
                summary = federation_flow(
                    cfg,
                    out_dir=str(out / f"seed{seed}" / method) if out else None,
                    parent_mlflow_run_id=tracker.run_id if tracker else None,
                )
                rec = method_run_from_summary(summary, method, seed, rounds)
                runs.append(rec)
                if progress:
                    progress(method, seed, rec)
        doc = results_document(
            config, runs, parent_run_id=tracker.run_id if tracker else None
        )
        if out:
            _write_outputs(out, doc)
        if tracker:
            _log_parent(tracker, doc)
        status = "FINISHED"
    finally:
        if tracker:
            tracker.finish(status)
    return doc


def _write_outputs(out: Path, doc: Mapping[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "results.json": json.dumps(doc, indent=2, sort_keys=True) + "\n",
        "results.csv": to_csv(doc["table"], TABLE_COLUMNS),
        "results.md": to_markdown(doc),
        "per_seed.csv": to_csv(doc["per_seed"], _PER_SEED_COLUMNS),
    }
    for name, text in files.items():
        tmp = out / f"{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out / name)


def _log_parent(tracker: Any, doc: Mapping[str, Any]) -> None:
    rid = tracker.run_id
    table = {c: [row[c] for row in doc["table"]] for c in TABLE_COLUMNS}
    with warnings.catch_warnings():
        # MLflow's own select_dtypes(include=["object"]) call warns under pandas 3
        warnings.filterwarnings("ignore", message=".*'str' dtypes are included")
        tracker.client.log_table(rid, data=table, artifact_file="results_table.json")
    tracker.client.log_dict(rid, dict(doc), "results.json")
    tracker.client.log_text(rid, to_markdown(doc), "results.md")
    metrics: dict[str, float] = {}
    for row in doc["table"]:
        for metric in _METRICS:
            for stat in _STATS:
                v = row[f"{metric}_{stat}"]
                if v is not None:
                    metrics[f"{row['method']}.{metric}.{stat}"] = v
        metrics[f"{row['method']}.families_separated_seeds"] = row["families_separated_seeds"]
    lift = doc["stationary_final_lift_clma_minus_fedavg"]
    if lift["mean"] is not None:
        metrics["stationary_final_lift.mean"] = lift["mean"]
        metrics["stationary_final_lift.min"] = lift["min"]
    tracker.log_metrics(metrics, step=0)
    tracker.set_tags({"clma.target_met": str(lift["target_met"]).lower()})


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``clma experiment clma-vs-fedavg``."""
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS),
                        help="seeds; each runs both methods (default: 0 1 2 3 4)")
    parser.add_argument("--out", type=Path, default=Path("runs") / EXPERIMENT_NAME,
                        help="output folder for the results table (default: runs/clma-vs-fedavg)")
    parser.add_argument("--config", type=Path, default=None,
                        help="scenario TOML (default: bundled clma/configs/clma_vs_fedavg.toml)")
    parser.add_argument("--no-tracking", action="store_true", help="do not log to MLflow")
    parser.add_argument("--quiet", action="store_true", help="print only the output paths")


def _check_seeds(seeds: Sequence[int]) -> list[int]:
    if len(set(seeds)) != len(seeds):
        raise ConfigError("--seeds: each seed must be given once")
    bad = [s for s in seeds if not 0 <= s < 2**32]
    if bad:
        raise ConfigError("--seeds: every seed must be in [0, 2**32)")
    return list(seeds)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``clma experiment clma-vs-fedavg``; returns the exit code (2 for a
    bad scenario or option, before any training)."""
    try:
        seeds = _check_seeds(args.seeds)
        config = scenario_config(args.config)
        if args.no_tracking:
            config = config.model_copy(
                update={"tracking": config.tracking.model_copy(update={"enabled": False})}
            )
        from clma.sim.federation import build_federation

        build_federation(arm_config(config, "clma", seeds[0]))  # data-dependent checks
    except (ConfigError, ValueError, OSError) as exc:
        msg = str(exc)
        if not msg.startswith("invalid configuration"):
            msg = f"invalid configuration: {msg}"
        print(f"clma: {msg}", file=sys.stderr)
        return 2

    def progress(method: str, seed: int, rec: MethodRun) -> None:
        if args.quiet:
            return
        fmt = lambda v: "n/a" if v is None or math.isnan(v) else f"{v:.3f}"  # noqa: E731
        print(
            f"seed {seed} {METHOD_LABELS[method]:6s}: stationary final "
            f"{fmt(rec.stationary_final_accuracy)}, drifted final "
            f"{fmt(rec.drifted_final_accuracy)}, families separated every event: "
            f"{rec.families_separated_every_event}",
            file=sys.stderr, flush=True,
        )

    doc = compare_flow(config, seeds, str(args.out), progress)
    if args.quiet:
        print(json.dumps({"results": str(args.out / "results.json")}))
    else:
        print(to_markdown(doc))
        print(f"results: {args.out / 'results.md'} (.csv, .json)  MLflow parent run: "
              f"{doc['mlflow_parent_run_id']}")
    return 0
