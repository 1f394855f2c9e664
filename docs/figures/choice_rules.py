"""Which on-device rule should a client of a split use to choose among the new cohorts?
The ARI each rule would give at each drift event of CLMA (improved) with the choice off
(the split as the server made it), every quarantined client choosing among the new
cohorts of the round (of any source cohort) by:

* ``split``: the split's cohort (no choice);
* ``eval`` / ``train`` / ``pooled``: the lowest mean cross-entropy of its evaluation, its
  training, or all its records (IFCA's rule; ``pooled`` is what
  :func:`clma.device.choose_cohort` does with a learner that has ``predict_training``);
* ``ttest_pooled`` / ``ttest_train`` / ``wilcoxon_pooled``: the best other cohort only if
  its per-record losses are lower than the split's cohort's, one-sided paired t-test or
  Wilcoxon at 0.05; else the split's;
* ``alone``: ``pooled`` among the new cohorts of two or more clients of the same source;
  a client the split left alone chooses between staying alone, scored with its source
  cohort's start model (its cohort's model without its own update), and every new cohort
  of two or more clients of the round (what :meth:`clma.engine.FederationEngine.choose`
  does since 227d240);
* ``majority``: ``alone``, but the moves among a source's shared new cohorts are kept only
  if each of them keeps the choice of more than half of its own members (else their models
  do not tell the families apart -- one fits everyone better -- and the split stands),
  and a client left alone joins a shared cohort only if that cohort's source group kept
  its moves or was not asked.

    OMP_NUM_THREADS=1 python docs/figures/choice_rules.py label2-a05 10 11 12 13 14 15 16 17 19
    OMP_NUM_THREADS=1 python docs/figures/choice_rules.py label2-a03 10 11 12 13 14 15 16 17 19
    OMP_NUM_THREADS=1 python docs/figures/choice_rules.py cov-blurrot-iid 0 1 2 3 4

Covariate scenarios run with ``drift.detector = "input_ks"`` (as the README runs them).

One line per seed: ``{round: {rule: ARI, "kept": [share of each asked cohort's members
choosing it]}}`` (docs/realistic_drift.md section 8).
"""
import sys

import numpy as np
from scipy import stats

from clma.config import validate_config
from clma.engine import FederationEngine
from clma.sim.clients import SimLearner, SimulatedClients
from clma.sim.federation import build_federation
from clma.sim.training import predict_proba
from clma.sim.truth import drift_event_ari
from flows.experiments.realistic_drift import is_covariate, method_config, scenario_config

RULES = ("split", "eval", "train", "pooled", "ttest_pooled", "ttest_train", "wilcoxon_pooled",
         "alone", "majority")


def rec_losses(fed, model, x, y):
    p = predict_proba(fed.spec, model, x)[np.arange(len(y)), y]
    return -np.log(np.clip(p, 1e-12, None))


def pick(rule, split_k, per):  # per: k -> (train_losses, eval_losses)
    if rule == "split":
        return split_k
    if rule in ("eval", "train", "pooled"):
        f = {"eval": lambda t, e: e, "train": lambda t, e: t,
             "pooled": lambda t, e: np.concatenate([t, e])}[rule]
        return min(per, key=lambda k: (f(*per[k]).mean(), k != split_k))
    src = (lambda t, e: np.concatenate([t, e])) if rule.endswith("pooled") else (lambda t, e: t)
    best = min(per, key=lambda k: src(*per[k]).mean())
    if best == split_k:
        return split_k
    d = src(*per[best]) - src(*per[split_k])
    if len(d) < 2 or np.all(d == 0):
        return split_k
    if rule.startswith("ttest"):
        p = stats.ttest_rel(src(*per[best]), src(*per[split_k]), alternative="less").pvalue
    else:
        p = stats.wilcoxon(d, alternative="less").pvalue
    return best if p < 0.05 else split_k


def run(scenario, seed):
    detector = "input_ks" if is_covariate(scenario) else None  # as the README runs them
    cfg = method_config(scenario_config(scenario), "clma_improved", seed, detector)
    data = cfg.model_dump()
    data["cohort"]["client_choice"] = False
    cfg = validate_config(data)
    fed = build_federation(cfg)
    eng = FederationEngine(cfg, fed.assets(), SimulatedClients(fed))
    cohort_step = eng.cohort
    out = {}

    def with_choice(ctx):
        res = cohort_step(ctx)
        families = fed.drifted_at(ctx.round)
        if families and res.new_cohorts:
            reg = eng.state.registry
            base = {c: reg.cohort_of(c) for c in fed.client_ids}
            kids = sorted(res.new_cohorts)
            choice = {r: dict(base) for r in RULES}
            alone = [k for k in kids if len(res.new_cohorts[k]) == 1]
            shared = [k for k in kids if k not in alone]
            for c in ctx.quarantined:
                tx, ty, ex, ey = SimLearner(fed, fed.clients[c]).data(ctx.round)
                scored = {**{k: ctx.models[k] for k in kids},
                          "source": ctx.start_models[res.parents[base[c]]]}
                per = {k: (rec_losses(fed, m, tx, ty), rec_losses(fed, m, ex, ey))
                       for k, m in scored.items()}
                sib = [k for k in kids if res.parents[k] == res.parents[base[c]]]
                for r in RULES[:-2]:  # among every new cohort of the round, any source
                    choice[r][c] = pick(r, base[c], {k: per[k] for k in kids})
                if base[c] in alone:  # stay alone (leave-one-out: the source) or join
                    opts = {k: per[k] for k in shared}
                    if opts:
                        opts[base[c]] = per["source"]
                        choice["alone"][c] = pick("pooled", base[c], opts)
                elif len([k for k in sib if k in shared]) >= 2:
                    choice["alone"][c] = pick("pooled", base[c],
                                              {k: per[k] for k in sib if k in shared})
            # majority: a group of shared siblings keeps its moves only if every cohort of
            # it keeps more than half of its own members
            choice["majority"] = dict(choice["alone"])
            ok = {}
            for k in shared:
                sib = [j for j in shared if res.parents[j] == res.parents[k]]
                stay = sum(choice["alone"][c] == k for c in res.new_cohorts[k])
                ok[k] = len(sib) < 2 or 2 * stay > len(res.new_cohorts[k])
            for k in shared:
                sib = [j for j in shared if res.parents[j] == res.parents[k]]
                if not all(ok[j] for j in sib):
                    for c in res.new_cohorts[k]:
                        choice["majority"][c] = base[c]
            for k in alone:
                (c,) = res.new_cohorts[k]
                target = choice["alone"][c]
                if target != k and not all(ok[j] for j in shared
                                           if res.parents[j] == res.parents[target]):
                    choice["majority"][c] = base[c]
            out[ctx.round] = {r: round(drift_event_ari(families, choice[r]), 2) for r in RULES}
            # per shared cohort of a group that was asked: the share of its members whose
            # choice ("alone") is the cohort itself
            out[ctx.round]["kept"] = sorted(
                round(sum(choice["alone"][c] == k for c in res.new_cohorts[k])
                      / len(res.new_cohorts[k]), 2) for k in shared
                if sum(res.parents[j] == res.parents[k] for j in shared) >= 2)
        return res

    eng.cohort = with_choice
    for r in range(1, cfg.rounds + 1):
        ctx = eng.begin_round(r)
        eng.accept(ctx, [eng.train(ctx)])
        eng.after_training(ctx)
        eng.finish(ctx)
    return out


if __name__ == "__main__":
    scenario = sys.argv[1]
    for s in sys.argv[2:]:
        try:
            print(scenario, s, run(scenario, int(s)), flush=True)
        except ValueError as e:
            print(scenario, s, "not built", e, flush=True)
