"""What if each quarantined client chose, on its own training data, the new cohort model with
the lower loss? The ARI at each drift event of CLMA (improved) as run, and the ARI the same
round would have had with that choice (IFCA's rule, Ghosh et al. 2020, applied once, among
the cohorts the split just made). The run itself is not changed.

    OMP_NUM_THREADS=1 python docs/figures/client_choice.py label2-a05 10 11 12 13 14
    OMP_NUM_THREADS=1 python docs/figures/client_choice.py label2-a03 10 11 12 13 14

Prints one line per seed: ``{round: (ARI as run, ARI with the choice)}`` for each round in
which drifted clients were cohorted into new cohorts. Simulation truth; the loss is the
mean cross-entropy of the client's (drifted) training records under each new cohort's
model, which only the client can compute (docs/realistic_drift.md section 8).
"""
import sys

import numpy as np

from clma.engine import FederationEngine
from clma.sim.clients import SimLearner, SimulatedClients
from clma.sim.federation import build_federation
from clma.sim.training import predict_proba
from clma.sim.truth import drift_event_ari
from flows.experiments.realistic_drift import method_config, scenario_config


def choice_aris(scenario: str, seed: int) -> dict[int, tuple[float, float]]:
    cfg = method_config(scenario_config(scenario), "clma_improved", seed)
    fed = build_federation(cfg)
    eng = FederationEngine(cfg, fed.assets(), SimulatedClients(fed))
    cohort_step = eng.cohort
    out: dict[int, tuple[float, float]] = {}

    def with_choice(ctx):
        res = cohort_step(ctx)
        families = fed.drifted_at(ctx.round)
        if families and res.new_cohorts:
            reg = eng.state.registry
            as_run = {c: reg.cohort_of(c) for c in fed.client_ids}
            chosen = dict(as_run)
            for c in ctx.quarantined:
                x, y, _, _ = SimLearner(fed, fed.clients[c]).data(ctx.round)
                loss = {}
                for k in res.new_cohorts:
                    p = predict_proba(fed.spec, ctx.models[k], x)[np.arange(len(y)), y]
                    loss[k] = float(-np.log(np.clip(p, 1e-12, None)).mean())
                chosen[c] = min(loss, key=loss.get)
            out[ctx.round] = (drift_event_ari(families, as_run),
                              drift_event_ari(families, chosen))
        return res

    eng.cohort = with_choice
    for r in range(1, cfg.rounds + 1):
        ctx = eng.begin_round(r)
        eng.accept(ctx, [eng.train(ctx)])
        eng.after_training(ctx)
        eng.finish(ctx)
    return out


def main(argv: list[str]) -> int:
    scenario, seeds = argv[0], [int(s) for s in argv[1:]]
    for seed in seeds:
        try:
            res = choice_aris(scenario, seed)
        except ValueError as err:  # a Dirichlet partition that cannot be drawn
            print(scenario, seed, "not built:", err)
            continue
        print(scenario, seed, {r: (round(a, 2), round(b, 2)) for r, (a, b) in res.items()},
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
