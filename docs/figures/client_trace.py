"""One run of CLMA (improved) on a realistic-drift scenario, client by client (issue 46).

For each watched client and round: the cohort it started the round in, its device's drift
flag, whether it was quarantined, the cohort it ends the round in and that cohort's size,
and its accuracy and clipped loss (nats) under that cohort's new model on its local
evaluation data (and how many records that is); per round the number of drift flags and each cohort's size and mean
loss; then each split's new cohorts and the clients' choice moves. Simulation
truth, never part of a release:

    OMP_NUM_THREADS=1 python docs/figures/client_trace.py label2-a03 11 --clients 37 1 45
    OMP_NUM_THREADS=1 python docs/figures/client_trace.py label2-iid 15 --clients 5 --rounds 12
    OMP_NUM_THREADS=1 python docs/figures/client_trace.py label2-iid 15 --clients 5 --rounds 12 --set training.server_learning_rate=1.0

(``--set SECTION.FIELD=JSON`` overrides a config field; ``--momentum BETA`` is
``--set training.server_momentum=BETA``.)

(docs/realistic_drift.md section 8, "The client its cohort leaves behind").
"""
import argparse
import json

import numpy as np

from clma.config import validate_config
from clma.engine import FederationEngine
from clma.sim.clients import SimulatedClients
from clma.sim.federation import build_federation
from flows.experiments.realistic_drift import method_config, scenario_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("scenario")
    p.add_argument("seed", type=int)
    p.add_argument("--clients", nargs="+", type=int, required=True)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=JSON")
    p.add_argument("--momentum", type=float, default=None)
    args = p.parse_args()
    if args.momentum is not None:
        args.set.append(f"training.server_momentum={args.momentum}")
    data = method_config(scenario_config(args.scenario), "clma_improved", args.seed).model_dump()
    data["rounds"] = args.rounds
    for path, value in (item.split("=", 1) for item in args.set):
        section, leaf = path.split(".", 1)
        data[section][leaf] = json.loads(value)
    cfg = validate_config(data)
    fed = build_federation(cfg)
    clients = SimulatedClients(fed)
    eng = FederationEngine(cfg, fed.assets(), clients)
    for r in range(1, args.rounds + 1):
        ctx = eng.begin_round(r)
        eng.accept(ctx, [eng.train(ctx)])
        updates = {u.client_id: u for u in ctx.updates}
        eng.after_training(ctx)
        reg = eng.state.registry
        every = {c: int(reg.cohort_of(c)) for c in fed.client_ids}
        ev = {e.client_id: e for e in clients.truth(r, every, eng.state.cohort_models,
                                                      cfg.evaluation.loss_max)}
        now = {c: every[c] for c in args.clients}
        by_cohort: dict[int, list[float]] = {}
        for e in ev.values():
            by_cohort.setdefault(e.cohort_id, []).append(e.loss)
        flags = sum(u.drift_flag for u in ctx.updates)
        print(f"round {r}: {flags} flags; cohorts (clients, mean loss) "
              + ", ".join(f"{k}: ({len(v)}, {np.mean(v):.2f})" for k, v in sorted(by_cohort.items())))
        for c in args.clients:
            u = updates.get(c)
            print(f"round {r} client {c}: started in {u.cohort_id if u else '-'}, "
                  f"flag {u.drift_flag if u else '-'}, quarantined {c in ctx.quarantined}, "
                  f"ends in {now[c]} ({len(reg.members(now[c]))} clients), "
                  f"accuracy {ev[c].accuracy:.3f}, loss {ev[c].loss:.2f} "
                  f"({ev[c].n_eval} evaluation records)")
        if ctx.cohorting is not None and (ctx.cohorting.new_cohorts or ctx.cohorting.moved):
            print(f"round {r}: new cohorts {ctx.cohorting.new_cohorts}, "
                  f"moved {ctx.cohorting.moved}")
        eng.finish(ctx)


if __name__ == "__main__":
    main()
