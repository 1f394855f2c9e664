"""The drifted clients the default drift flag (``paired_loss``) misses at each drift event
(issue 46): for each, the rise of its received model's loss (the loss threshold's
quantity, flagged above ``drift.gamma``) and the paired data rise (the previous model on
the current records minus on its own round's records); and the largest absolute data
rise of any client that did not drift (0 while records do not change). One JSON line per
seed and event, then one per seed with the false-flag rate (flags of clients without a
drift event that round, rounds 2 on) and the detection rate. ``--set SECTION.FIELD=JSON``
overrides a config field (``data.record_churn=0.2``: records that change every round;
``drift.detector="loss_threshold"``); ``--data-rise-only`` drops the paired flag's
loss-rise condition (as in alpha03_training.py):

    OMP_NUM_THREADS=1 python docs/figures/missed_flags.py label2-a03 20 21 22 23 24 25 26 27 28 29
    OMP_NUM_THREADS=1 python docs/figures/missed_flags.py label2-a03 20 21 22 23 24 25 26 27 28 29 --set data.record_churn=0.2

Simulation truth, never part of a release (docs/realistic_drift.md section 8).
"""
import argparse
import json

import clma.sim.clients as sim_clients
from clma.config import validate_config
from clma.drift import paired
from clma.engine import FederationEngine
from clma.sim.clients import SimulatedClients
from clma.sim.federation import build_federation
from flows.experiments.realistic_drift import method_config, scenario_config

NOW: dict = {"client": None, "round": 0}
SEEN: dict[tuple[int, int], tuple[float | None, float | None, bool]] = {}


def note_training_client(now: dict) -> None:
    """Patch the simulated device's ``fit`` to set ``now["client"]`` to the client that is
    training (its detector's update follows in the same call)."""
    fit = sim_clients.SimLearner.fit

    def fit_and_note(self, params, settings, round_number):
        now["client"] = self.client.client_id
        return fit(self, params, settings, round_number)

    sim_clients.SimLearner.fit = fit_and_note


def _patch() -> None:
    note_training_client(NOW)
    update = paired.PairedLossDetector.update

    def update_and_note(self, loss, **kw):
        before = self.previous_loss
        flag = update(self, loss, **kw)
        SEEN[(NOW["round"], NOW["client"])] = (
            None if before is None else float(loss) - before, self.last_data_rise, flag)
        return flag

    paired.PairedLossDetector.update = update_and_note


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("scenario")
    p.add_argument("seeds", nargs="+", type=int)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=JSON")
    p.add_argument("--data-rise-only", action="store_true")
    args = p.parse_args()
    if args.data_rise_only:
        from alpha03_training import with_data_rise_only

        with_data_rise_only()
    _patch()
    scenario = args.scenario
    for seed in args.seeds:
        data = method_config(scenario_config(scenario), "clma_improved", seed).model_dump()
        for item in args.set:
            path, value = item.split("=", 1)
            section, leaf = path.split(".", 1)
            data[section][leaf] = json.loads(value)
        try:
            cfg = validate_config(data)
            fed = build_federation(cfg)
        except ValueError as e:  # a Dirichlet draw that never fits
            print(scenario, seed, "not built:", e, flush=True)
            continue
        SEEN.clear()
        eng = FederationEngine(cfg, fed.assets(), SimulatedClients(fed))
        false, quiet, hits, drifted = 0, 0, 0, 0
        for r in range(1, cfg.rounds + 1):
            NOW["round"] = r
            ctx = eng.begin_round(r)
            eng.accept(ctx, [eng.train(ctx)])
            now = fed.drifted_at(r)
            for u in ctx.updates:
                if u.client_id in now:
                    drifted, hits = drifted + 1, hits + int(u.drift_flag)
                elif r >= 2:
                    quiet, false = quiet + 1, false + int(u.drift_flag)
            eng.after_training(ctx)
            eng.finish(ctx)
        paired_flag = cfg.drift.detector == "paired_loss"
        for r in sorted({e.round for e in cfg.drift.events}) if paired_flag else []:
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
        print(json.dumps({"scenario": scenario, "seed": seed, "set": args.set,
                          "data_rise_only": args.data_rise_only,
                          "false_flag_rate": round(false / max(quiet, 1), 4),
                          "detection_rate": round(hits / max(drifted, 1), 4)}), flush=True)


if __name__ == "__main__":
    main()
