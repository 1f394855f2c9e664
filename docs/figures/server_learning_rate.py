"""CLMA (improved) and FedAvg with a server learning rate on the label-rotation scenarios
of the realistic-drift experiment: per scenario and seed, the mean ARI per drift event and
the stationary / drifted clients' final accuracy, then the means over the seeds.

    OMP_NUM_THREADS=1 python docs/figures/server_learning_rate.py --eta 1.5 \\
        --scenarios label2-iid label2-a5 label2-a1 label2-a05 --seeds 0 1 2 3 4
    OMP_NUM_THREADS=1 python docs/figures/server_learning_rate.py --eta 1.5 \\
        --scope drift_cohorts --methods clma_improved --scenarios label2-iid label2-a05 \\
        --seeds 5 6 7 8 9

Runs flows.experiments.realistic_drift.run_engine on method_config(...) with
``training.server_learning_rate`` and ``training.server_learning_rate_scope`` set (both
methods, whatever the experiment's recipe; ``--eta 1.5 --scope drift_cohorts`` is CLMA
(improved)'s own). Simulation truth.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from clma.config import validate_config
from flows.experiments.realistic_drift import method_config, run_engine, scenario_config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eta", type=float, required=True)
    ap.add_argument("--scenarios", nargs="+", required=True)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--scope", choices=["all", "drift_cohorts"], default="all",
                    help="training.server_learning_rate_scope (default all)")
    ap.add_argument("--methods", nargs="+", default=["clma_improved", "fedavg"])
    ap.add_argument("--detector", default=None,
                    help="drift.detector of the CLMA methods (e.g. input_ks on covariate "
                         "scenarios; default: the scenario's)")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.methods) - {"clma", "clma_improved", "fedavg"})
    if unknown:
        ap.error(f"--methods: must be among clma, clma_improved, fedavg, got {unknown}")
    if not 0.0 < args.eta <= 10.0:
        ap.error("--eta: training.server_learning_rate must be in (0, 10]")
    print(f"server learning rate scope: {args.scope}")
    print("| scenario | method | server learning rate | seeds | mean ARI per event | "
          "stationary final acc. | drifted final acc. |")
    print("|---|---|---|---|---|---|---|")
    for sc in args.scenarios:
        for method in args.methods:
            rows = []
            for seed in args.seeds:
                det = args.detector if method.startswith("clma") else None
                data = method_config(scenario_config(sc), method, seed, det).model_dump()
                data["training"]["server_learning_rate"] = args.eta
                data["training"]["server_learning_rate_scope"] = args.scope
                rows.append(run_engine(validate_config(data)))
            events = sorted({k for r in rows for k in r["ari_per_drift_event"]}, key=int)
            ari = ", ".join(f"r{k}: {np.mean([r['ari_per_drift_event'][k] for r in rows]):.2f}"
                            for k in events) or "n/a"
            st = np.mean([r["stationary_final_accuracy"] for r in rows])
            dr = np.mean([r["drifted_final_accuracy"] for r in rows])
            label = f"{method}[{args.detector}]" if args.detector and method.startswith(
                "clma") else method
            print(f"| {sc} | {label} | {args.eta:g} | {len(rows)} | {ari} | {st:.3f} | "
                  f"{dr:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
