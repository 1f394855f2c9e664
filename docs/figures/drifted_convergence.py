"""Drifted and stationary clients' accuracy per round after the last drift event (round 7)
under CLMA (improved), on label2-iid and label2-a05 with the rounds extended to R: is the
alpha-0.5 gap at the scenario's last round (10) convergence time?

    OMP_NUM_THREADS=1 python docs/figures/drifted_convergence.py 14 0 1 2 3 4
    OMP_NUM_THREADS=1 python docs/figures/drifted_convergence.py --eta 1 14 0 1 2 3 4

``--eta`` sets ``training.server_learning_rate`` (default: CLMA (improved)'s own, 1.5 on
drift cohorts; 1 = FedAvg, the recipe before the server step). Prints one line per scenario and seed (``r<k>:<stationary>/<drifted>``) and the mean over
the seeds per round. Rounds 1-10 are the realistic-drift experiment's rounds (same
config, seed and schedule; round 10 reproduces its final accuracies). Simulation truth.
"""
import argparse
import sys

import numpy as np

from clma.config import validate_config
from clma.engine import FederationEngine
from clma.sim.clients import SimulatedClients
from clma.sim.federation import build_federation
from flows.experiments.realistic_drift import method_config, scenario_config


def curve(scenario: str, seed: int, rounds: int,
          eta: float | None = None) -> list[tuple[int, float, float]]:
    data = method_config(scenario_config(scenario), "clma_improved", seed).model_dump()
    if eta is not None:
        data["training"]["server_learning_rate"] = eta
    data["rounds"] = rounds
    data["evaluation"]["every"] = rounds + 1
    cfg = validate_config(data)
    fed = build_federation(cfg)
    clients = SimulatedClients(fed)
    eng = FederationEngine(cfg, fed.assets(), clients)
    rows = []
    for r in range(1, rounds + 1):
        ctx = eng.begin_round(r)
        eng.accept(ctx, [eng.train(ctx)])
        eng.after_training(ctx)
        eng.finish(ctx)
        if r >= 7:
            reg = eng.state.registry
            ev = clients.truth(r, {c: int(reg.cohort_of(c)) for c in fed.client_ids},
                               eng.state.cohort_models, cfg.evaluation.loss_max)
            acc = {e.client_id: e.accuracy for e in ev}
            st, dr = fed.stationary_clients(r), fed.drifted_clients(r)
            rows.append((r, float(np.mean([acc[c] for c in st])),
                         float(np.mean([acc[c] for c in dr]))))
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eta", type=float, default=None)
    ap.add_argument("rounds", type=int)
    ap.add_argument("seeds", nargs="+", type=int)
    args = ap.parse_args(argv)
    rounds, seeds = args.rounds, args.seeds
    for sc in ("label2-iid", "label2-a05"):
        curves = []
        for seed in seeds:
            rows = curve(sc, seed, rounds, args.eta)
            curves.append(rows)
            print(sc, seed, " ".join(f"r{r}:{s:.3f}/{d:.3f}" for r, s, d in rows), flush=True)
        mean = np.mean([[d for _, _, d in rows] for rows in curves], axis=0)
        print(sc, "mean drifted", " ".join(f"r{r}:{m:.3f}" for (r, _, _), m
                                            in zip(curves[0], mean, strict=True)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
