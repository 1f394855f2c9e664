"""The drifted clients the default drift flag (``paired_loss``) misses at each drift event
(issue 46): for each, the rise of its received model's loss (the loss threshold's
quantity, flagged above ``drift.gamma``) and the paired data rise (the previous model on
the current records minus on its own round's records); and the largest absolute data
rise of any client that did not drift (0 while records do not change). One JSON line per
seed and event:

    OMP_NUM_THREADS=1 python docs/figures/missed_flags.py label2-a03 20 21 22 23 24 25 26 27 28 29

Simulation truth, never part of a release (docs/realistic_drift.md section 8).
"""
import json
import sys

import clma.sim.clients as sim_clients
from clma.config import validate_config
from clma.drift import paired
from clma.engine import FederationEngine
from clma.sim.clients import SimulatedClients
from clma.sim.federation import build_federation
from flows.experiments.realistic_drift import method_config, scenario_config

NOW: dict = {"client": None, "round": 0}
SEEN: dict[tuple[int, int], tuple[float | None, float | None, bool]] = {}


def _patch() -> None:
    fit, update = sim_clients.SimLearner.fit, paired.PairedLossDetector.update

    def fit_and_note(self, params, settings, round_number):
        NOW["client"] = self.client.client_id
        return fit(self, params, settings, round_number)

    def update_and_note(self, loss, **kw):
        before = self.previous_loss
        flag = update(self, loss, **kw)
        SEEN[(NOW["round"], NOW["client"])] = (
            None if before is None else float(loss) - before, self.last_data_rise, flag)
        return flag

    sim_clients.SimLearner.fit = fit_and_note
    paired.PairedLossDetector.update = update_and_note


def main() -> None:
    _patch()
    scenario = sys.argv[1]
    for seed in (int(s) for s in sys.argv[2:]):
        data = method_config(scenario_config(scenario), "clma_improved", seed).model_dump()
        try:
            cfg = validate_config(data)
            fed = build_federation(cfg)
        except ValueError as e:  # a Dirichlet draw that never fits
            print(scenario, seed, "not built:", e, flush=True)
            continue
        SEEN.clear()
        eng = FederationEngine(cfg, fed.assets(), SimulatedClients(fed))
        for r in range(1, cfg.rounds + 1):
            NOW["round"] = r
            ctx = eng.begin_round(r)
            eng.accept(ctx, [eng.train(ctx)])
            eng.after_training(ctx)
            eng.finish(ctx)
        for r in sorted({e.round for e in cfg.drift.events}):
            now = fed.drifted_at(r)
            missed = [{"client": c, "loss_rise": round(SEEN[(r, c)][0], 3),
                       "data_rise": round(SEEN[(r, c)][1], 3)}
                      for c in sorted(now) if not SEEN[(r, c)][2]]
            others = [abs(v[1]) for (rr, c), v in SEEN.items()
                      if rr == r and c not in now and v[1] is not None]
            print(json.dumps({"scenario": scenario, "seed": seed, "round": r,
                              "drifted": len(now), "missed": missed,
                              "max_abs_data_rise_not_drifted": max(others, default=None)}),
                  flush=True)


if __name__ == "__main__":
    main()
