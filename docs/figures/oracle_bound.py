"""Oracle bound on drifted accuracy (issue 46): CLMA (improved)'s training and server step
with the simulation's true drift flags and every quarantined group split by its true
drift family (the clients' choice off), so no cohorting or detection error is left. One
line per seed (drifted accuracy at the last round, ARI per drift event), then the mean:

    OMP_NUM_THREADS=1 python docs/figures/oracle_bound.py label2-iid,label2-a03 10 11 12 13 14 15 16 17 18 19
    OMP_NUM_THREADS=1 python docs/figures/oracle_bound.py label2-iid,label2-a03 20 21 22 23 24 25 26 27 28 29

Simulation truth, never part of a release (docs/realistic_drift.md section 8).
"""
import sys

import numpy as np
from missed_flags import note_training_client

from clma.cohort.cohorter import CohortAssignment
from clma.config import validate_config
from clma.drift import paired
from clma.engine import FederationEngine
from clma.sim.clients import SimulatedClients
from clma.sim.federation import build_federation
from clma.sim.truth import drift_event_ari
from flows.experiments.realistic_drift import method_config, scenario_config

NOW: dict = {"client": None, "round": 0, "federation": None}


def _patch() -> None:
    """The device's flag becomes the truth (its detector state still updated)."""
    note_training_client(NOW)
    update = paired.PairedLossDetector.update

    def true_flag(self, loss, **kw):
        update(self, loss, **kw)
        return NOW["client"] in NOW["federation"].drifted_at(NOW["round"])

    paired.PairedLossDetector.update = true_flag


class TrueFamilies:
    """A cohorter that splits the quarantined clients by their true drift family."""

    def cohort(self, ids, matrix, reference):
        family = NOW["federation"].drifted_at(NOW["round"])
        names = sorted({family.get(c, "none") for c in ids})
        return CohortAssignment(assignments={c: names.index(family.get(c, "none")) for c in ids},
                                ks_statistics={c: 0.0 for c in ids})


def main() -> None:
    _patch()
    for scenario in sys.argv[1].split(","):
        drifted = []
        for seed in (int(s) for s in sys.argv[2:]):
            data = method_config(scenario_config(scenario), "clma_improved", seed).model_dump()
            data["cohort"]["client_choice"] = False
            try:
                cfg = validate_config(data)
                fed = build_federation(cfg)
            except ValueError as e:  # a Dirichlet draw that never fits
                print(scenario, seed, "not built:", e, flush=True)
                continue
            NOW["federation"] = fed
            clients = SimulatedClients(fed)
            eng = FederationEngine(cfg, fed.assets(), clients, cohorter=TrueFamilies())
            aris = []
            for r in range(1, cfg.rounds + 1):
                NOW["round"] = r
                ctx = eng.begin_round(r)
                eng.accept(ctx, [eng.train(ctx)])
                eng.after_training(ctx)
                eng.finish(ctx)
                now = fed.drifted_at(r)
                if now:
                    reg = eng.state.registry
                    aris.append(round(drift_event_ari(now, {c: reg.cohort_of(c) for c in now}), 2))
            reg = eng.state.registry
            ev = clients.truth(cfg.rounds, {c: int(reg.cohort_of(c)) for c in fed.client_ids},
                               eng.state.cohort_models, cfg.evaluation.loss_max)
            acc = {e.client_id: e.accuracy for e in ev}
            drifted.append(float(np.mean([acc[c] for c in fed.drifted_clients(cfg.rounds)])))
            print(scenario, seed, round(drifted[-1], 3), aris, flush=True)
        print(scenario, "mean drifted", round(float(np.mean(drifted)), 3), "seeds",
              len(drifted), flush=True)


if __name__ == "__main__":
    main()
