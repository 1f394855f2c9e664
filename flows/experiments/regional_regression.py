"""Regional regression: a drift in one small region fires that region's alert while the
national (global) metric stays within its error bars.

Runs the federation of ``clma/configs/regional_regression.toml`` (or ``--config``) and
prints / writes (``OUT/regional_regression.json`` and ``.md``) one row per evaluation
round: region value ± published bar, whether its alert fired, and the global value ± bar
and whether the global alert fired. Only published numbers appear.
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path
from typing import Any

DESCRIPTION = ("regression injected into one small region: its alert fires, the national "
               "metric stays within its error bars")

__all__ = ["DESCRIPTION", "add_arguments", "run", "scenario_report"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None,
                   help="TOML config (default: clma/configs/regional_regression.toml)")
    p.add_argument("--region", default="west", help="the drifted region (default: west)")
    p.add_argument("--metric", default="accuracy", help="metric to report (default: accuracy)")
    p.add_argument("--seed", type=int, default=None, help="override the seed")
    p.add_argument("--out", type=Path, default=Path("runs/regional-regression"))
    p.add_argument("--no-tracking", action="store_true", help="do not log to MLflow")


def scenario_report(summary: dict[str, Any], region: str, metric: str) -> dict[str, Any]:
    """Rows (one per evaluation round) from a federation summary's published reports."""
    rows = []
    for r in summary["rounds"]:
        rep = r.get("regional")
        if not rep:
            continue
        m = rep["metrics"][metric]
        pub = m["regions"].get(region)
        fired = {(a["metric"], a["region"]) for a in rep["alerts"]}
        glob = m.get("global")
        rows.append({
            "round": r["round"],
            "region": region,
            "value": None if pub is None else pub["value"],
            "error_bar": None if pub is None else pub["error_bar"],
            "participant_band": None if pub is None else pub["participant_band"],
            "alert": (metric, region) in fired,
            "global_value": None if glob is None else glob["value"],
            "global_error_bar": None if glob is None else glob["error_bar"],
            "global_alert": (metric, "global") in fired,
            "alerts_fired": rep["alerts_fired"],
        })
    return {"metric": metric, "region": region, "seed": summary["federation"]["seed"],
            "rows": rows}


def _fmt(v: float | None, bar: float | None) -> str:
    return "suppressed" if v is None else f"{v:.3f} ± {bar:.3f}"


def run(args: argparse.Namespace) -> int:
    import sys

    from clma.config import ConfigError, load_config
    from clma.regions import PartitionError, load_partition

    metrics = ("accuracy", "mean_loss")
    try:
        if args.config is None:
            text = resources.files("clma.configs").joinpath("regional_regression.toml")
            cfg = load_config(Path(str(text)))
        else:
            cfg = load_config(args.config)
        cfg = cfg.with_overrides(seed=args.seed)
        regions = load_partition(cfg.data.region_partition).region_ids
        if args.region not in regions:
            raise ConfigError(f"--region {args.region!r}: not a region of the partition "
                              f"({', '.join(regions)})")
        if args.metric not in metrics:
            raise ConfigError(f"--metric {args.metric!r}: must be one of {', '.join(metrics)}")
        if args.out.exists() and not args.out.is_dir():
            raise ConfigError(f"--out {str(args.out)!r}: exists and is not a folder")
    except (ConfigError, PartitionError) as exc:
        print(f"clma: {exc}", file=sys.stderr)
        return 2
    if args.no_tracking:
        cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"enabled": False})})
    from flows.federation import federation_flow

    summary = federation_flow(cfg, out_dir=str(args.out))
    rep = scenario_report(summary, args.region, args.metric)
    lines = [f"| round | {args.region} {args.metric} ± bar | alert | global ± bar | global alert |",
             "|---|---|---|---|---|"]
    for row in rep["rows"]:
        lines.append(f"| {row['round']} | {_fmt(row['value'], row['error_bar'])} | "
                     f"{'FIRED' if row['alert'] else '-'} | "
                     f"{_fmt(row['global_value'], row['global_error_bar'])} | "
                     f"{'FIRED' if row['global_alert'] else '-'} |")
    table = "\n".join(lines)
    print(f"{cfg.name} seed {cfg.seed}\n{table}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "regional_regression.json").write_text(json.dumps(rep, indent=2) + "\n")
    (args.out / "regional_regression.md").write_text(table + "\n")
    return 0
