"""Drifted accuracy at alpha 0.3 (issue 46): what the training changes tried give.

CLMA (improved) on the realistic-drift scenarios (same config, seed and schedule as
``clma experiment realistic-drift``; rounds extended to ``--rounds``), mean drifted and
minimum ARI over the seeds, per scenario. ``--set SECTION.FIELD=JSON`` overrides a config
field (e.g. ``training.local_epochs=2``); ``--momentum BETA`` sets the server momentum of
the server step on drift cohorts (FedAvgM: ``v = BETA v + (aggregate - start)``, model
``start + eta v``; Hsu, Qi and Brown 2019): ``training.server_momentum``, the library's
since issue 46 (default 0.3; before, patched in here with the velocity kept in float64):

    OMP_NUM_THREADS=1 python docs/figures/alpha03_training.py --rounds 14 --seeds 10 11 12 13 14
    OMP_NUM_THREADS=1 python docs/figures/alpha03_training.py --set training.server_learning_rate=2.0 --seeds 10 11 12 13 14
    OMP_NUM_THREADS=1 python docs/figures/alpha03_training.py --set training.local_epochs=2 --seeds 10 11 12 13 14
    OMP_NUM_THREADS=1 python docs/figures/alpha03_training.py --momentum 0.3 --seeds 10 11 12 13 14
    OMP_NUM_THREADS=1 python docs/figures/alpha03_training.py --momentum 0.3 --seeds 15 16 17 18 19
    OMP_NUM_THREADS=1 python docs/figures/alpha03_training.py --momentum 0.3 --scenarios label2-a5 label2-a1 label2-a05 --seeds 10 11 12 13 14

``--data-rise-only`` drops the default flag's loss-rise condition (a flag iff the paired
data rise exceeds ``min_data_rise``; patched in, not in the library):

    OMP_NUM_THREADS=1 python docs/figures/alpha03_training.py --data-rise-only --scenarios label2-iid label2-a5 label2-a1 label2-a05 label2-a03 --seeds 20 21 22 23 24 25 26 27 28 29

``--step-age K`` takes the server step only on drift cohorts at most ``K`` rounds old
(round minus the cohort's creation round). ``--objective la:TAU`` trains every client with
logit adjustment by its local label prior (cross-entropy of ``logits + TAU log
prior``; Menon et al. 2021, as in FedLC, Zhang et al. 2022), ``--objective prox:MU`` with
FedProx's proximal term ``MU / 2 ||w - w_start||^2`` (Li et al. 2020); both patched into the
simulation's local training, not in the library:

    OMP_NUM_THREADS=1 python docs/figures/alpha03_training.py --set training.server_learning_rate=1.000001 --momentum 0.5 --seeds 10 11 12 13 14 15 16 17 18 19
    OMP_NUM_THREADS=1 python docs/figures/alpha03_training.py --step-age 2 --seeds 10 11 12 13 14 15 16 17 18 19
    OMP_NUM_THREADS=1 python docs/figures/alpha03_training.py --objective la:1.0 --seeds 10 11 12 13 14 15 16 17 18 19
    OMP_NUM_THREADS=1 python docs/figures/alpha03_training.py --objective prox:0.1 --seeds 10 11 12 13 14 15 16 17 18 19

(``server_learning_rate=1.000001``: when that line was measured the engine skipped the
server step at exactly 1; since momentum is the library's it takes the step whenever the
momentum is not 0, so 1.0 now does the same.)

One line per scenario: mean drifted accuracy from round 8 on, each seed's at the last
round, and the minimum ARI per drift event. Simulation truth. docs/realistic_drift.md
section 8 has the tables.
"""
import argparse
import dataclasses
import json

import numpy as np
import torch
from torch import nn

import clma.engine.round as engine_round
import clma.rounds as rounds_module
import clma.sim.clients as sim_clients
import clma.sim.training as sim_training
from clma.config import validate_config
from clma.engine import FederationEngine
from clma.sim.clients import SimulatedClients
from clma.sim.federation import build_federation
from clma.sim.truth import drift_event_ari
from flows.experiments.realistic_drift import method_config, scenario_config


def with_step_age(max_age: int, current: dict):
    """``server_step_cohorts`` restricted to drift cohorts at most ``max_age`` rounds old
    (``current["round"]``: the round being run)."""
    original = engine_round.server_step_cohorts

    def cohorts(registry, cohort_ids, scope):
        return [c for c in original(registry, cohort_ids, scope)
                if current["round"] - registry.cohort(c).created_round <= max_age]

    return cohorts


def with_weight_power(power: float):
    """``fedavg`` with every weight raised to ``power`` (0: each client counts the same;
    0.5: square-root weighting; 1: FedAvg's sample-count weights)."""
    original = rounds_module.fedavg

    def fedavg(vectors, weights):
        return original(vectors, [float(w) ** power for w in weights])

    return fedavg


def with_paired_detector(gamma_data: float):
    """``train_on_device`` whose flag also needs the data to have changed: the model the
    device received the round before, scored on its current training records, must fit
    them worse by more than ``gamma_data`` nats than it fitted the records of that round
    (a rise of the received model's loss that the previous model does not show is a
    change of the model, not of the data). Kept per client in the script (no re-runs)."""
    original = sim_clients.train_on_device
    previous: dict[int, tuple[np.ndarray, float]] = {}
    counts = {"paper": 0, "paired": 0}

    def cross_entropy(learner, params, round_number):
        proba, labels = learner.predict_training(params, round_number)
        p = np.asarray(proba, dtype=np.float64)[np.arange(labels.size), labels]
        return float(-np.log(np.clip(p, 1e-12, None)).mean())

    def train(client_id, cohort_id, params, settings, round_number, learner, history):
        update = original(client_id, cohort_id, params, settings, round_number, learner,
                          history)
        now = cross_entropy(learner, params, round_number)
        flag = update.drift_flag
        if flag:
            counts["paper"] += 1
            if client_id in previous:
                old_params, old_loss = previous[client_id]
                flag = cross_entropy(learner, old_params, round_number) - old_loss > gamma_data
            counts["paired"] += int(flag)
        previous[client_id] = (np.asarray(params, dtype=np.float32).copy(), now)
        return dataclasses.replace(update, drift_flag=flag)

    return train, counts


def with_objective(kind: str, value: float):
    """The simulation's ``local_train`` with logit adjustment (``la``) or FedProx's
    proximal term (``prox``) added to the minibatch loss; otherwise the same SGD."""

    def local_train(spec, vector, x, y, *, epochs, learning_rate, batch_size, rng):
        n = int(y.shape[0])
        model = sim_training._model(spec, vector)
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        model.eval()
        with torch.no_grad():
            logits = model(xt)
            pre_loss = float(nn.functional.cross_entropy(logits, yt).item())
        start = [q.detach().clone() for q in model.parameters()]
        prior = torch.log((torch.bincount(yt, minlength=logits.shape[1]).float() + 1e-3) / n)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=learning_rate)
        for _ in range(epochs):
            order = torch.from_numpy(rng.permutation(n))
            for b in range(0, n, batch_size):
                idx = order[b:b + batch_size]
                opt.zero_grad(set_to_none=True)
                out = model(xt[idx])
                if kind == "la":
                    out = out + value * prior
                loss = nn.functional.cross_entropy(out, yt[idx])
                if kind == "prox":
                    loss = loss + value / 2 * sum(((q - q0) ** 2).sum() for q, q0
                                                  in zip(model.parameters(), start, strict=True))
                loss.backward()
                opt.step()
        return sim_training.LocalResult(sim_training.model_to_vector(model, sim_training._FULL),
                                        pre_loss, n)

    return local_train


def with_data_rise_only() -> None:
    """The library's ``paired_loss`` flag without its loss-rise condition: a flag iff the
    paired data rise exceeds ``[drift.paired_loss] min_data_rise`` (patched into
    :class:`clma.drift.paired.PairedLossDetector`; not in the library)."""
    from clma.drift import paired

    original = paired.PairedLossDetector.update

    def update(self, loss, **kw):
        flag = original(self, loss, **kw)
        rise = self.last_data_rise
        new = rise is not None and rise > self.params.min_data_rise
        self.n_flags += int(new) - int(flag)
        return bool(new)

    paired.PairedLossDetector.update = update


def run(scenario: str, seed: int, rounds: int, overrides: dict, beta: float | None,
        step_age: int | None = None):
    data = method_config(scenario_config(scenario), "clma_improved", seed).model_dump()
    if beta is not None:
        data["training"]["server_momentum"] = beta
    for path, value in overrides.items():
        section, leaf = path.split(".", 1)
        data[section][leaf] = value
    data["rounds"] = rounds
    cfg = validate_config(data)
    fed = build_federation(cfg)
    clients = SimulatedClients(fed)
    current = {"round": 0}
    if step_age is not None:
        engine_round.server_step_cohorts = with_step_age(step_age, current)
    eng = FederationEngine(cfg, fed.assets(), clients)
    drifted, aris = {}, {}
    for r in range(1, rounds + 1):
        current["round"] = r
        ctx = eng.begin_round(r)
        eng.accept(ctx, [eng.train(ctx)])
        eng.after_training(ctx)
        eng.finish(ctx)
        reg = eng.state.registry
        now = fed.drifted_at(r)
        if now:
            aris[r] = drift_event_ari(now, {c: reg.cohort_of(c) for c in now})
        if r >= 8:
            ev = clients.truth(r, {c: int(reg.cohort_of(c)) for c in fed.client_ids},
                               eng.state.cohort_models, cfg.evaluation.loss_max)
            acc = {e.client_id: e.accuracy for e in ev}
            drifted[r] = float(np.mean([acc[c] for c in fed.drifted_clients(r)]))
    return drifted, aris


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenarios", nargs="+", default=["label2-iid", "label2-a03"])
    p.add_argument("--seeds", nargs="+", type=int, required=True)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--momentum", type=float, default=None)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=JSON")
    p.add_argument("--step-age", type=int, default=None)
    p.add_argument("--objective", default=None, metavar="la:TAU|prox:MU")
    p.add_argument("--weight-power", type=float, default=None)
    p.add_argument("--paired", type=float, default=None, metavar="GAMMA_DATA")
    p.add_argument("--data-rise-only", action="store_true")
    args = p.parse_args()
    if args.data_rise_only:
        with_data_rise_only()
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    if args.objective:
        kind, value = args.objective.split(":")
        if kind not in ("la", "prox"):
            p.error("--objective: la:TAU or prox:MU")
        sim_clients.local_train = with_objective(kind, float(value))
    if args.weight_power is not None:
        rounds_module.fedavg = with_weight_power(args.weight_power)
    original_train = sim_clients.train_on_device
    original_cohorts = engine_round.server_step_cohorts
    for scenario in args.scenarios:
        rows = []
        for seed in args.seeds:
            if args.paired is not None:
                sim_clients.train_on_device, counts = with_paired_detector(args.paired)
            try:
                rows.append(run(scenario, seed, args.rounds, overrides, args.momentum,
                                args.step_age))
            except ValueError as e:  # a Dirichlet draw that never fits
                print(scenario, seed, "not built:", e, flush=True)
            finally:
                if args.paired is not None:
                    sim_clients.train_on_device = original_train
                    print(scenario, seed, "flags paper / paired", counts, flush=True)
                engine_round.server_step_cohorts = original_cohorts
        acc = {r: round(float(np.mean([d[r] for d, _ in rows])), 3) for r in rows[0][0]}
        last = [round(d[args.rounds], 3) for d, _ in rows]
        low = {r: round(min(a[r] for _, a in rows), 2) for r in rows[0][1]}
        print(scenario, "seeds", args.seeds, "drifted", acc, "per seed", last, "min ARI", low,
              flush=True)


if __name__ == "__main__":
    main()
