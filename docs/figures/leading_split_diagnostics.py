"""Why covariate-drift families share a cohort, and what the leading-split test sees.

Runs a realistic-drift scenario (flows/experiments/realistic_drift.py) under CLMA
(improved) *without* the leading-component split through the bare engine up to its first
drift round, captures what the cohorter receives (the quarantined clients' parameter
vectors and their reference) and prints one Markdown row per (scenario, seed): clients
quarantined per family, the leading component's share of variance against the
broken-stick expectation, how far apart the true families' scores are along it (difference
of means over the pooled standard deviation), the leading-split test's p-value
(clma.cohort.split, min size 5) and the adjusted Rand index of its split against the
families. ``--keep K`` keeps only drift event K (one family: the null case, where a split
is a false split).

    python docs/figures/leading_split_diagnostics.py --scenarios cov-rotnoise-iid --seeds 0 1 2
    python docs/figures/leading_split_diagnostics.py --scenarios cov-rotnoise-iid --keep 0

Figures are simulation truth on the bundled digits; OMP_NUM_THREADS=1 as in the README.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from sklearn.metrics import adjusted_rand_score


def diagnose(scenario: str, seed: int, keep: int | None = None) -> list[dict]:
    from clma.cohort.split import leading_split_test
    from clma.config import validate_config
    from clma.engine import FederationEngine
    from clma.sim.clients import SimulatedClients
    from clma.sim.federation import build_federation
    from flows.experiments.realistic_drift import method_config, scenario_config

    data = method_config(scenario_config(scenario), "clma_improved", seed,
                         "input_ks" if scenario.startswith("cov-") else None).model_dump()
    data["cohort"]["leading_split_alpha"] = None  # what the broken stick alone does
    if keep is not None:
        data["drift"]["events"] = [data["drift"]["events"][keep]]
    cfg = validate_config(data)
    first = min(e.round for e in cfg.drift.events)
    family = {c: i for i, e in enumerate(cfg.drift.events) for c in e.clients
              if e.round == first}
    fed = build_federation(cfg)
    engine = FederationEngine(cfg, fed.assets(), SimulatedClients(fed))
    seen: list[tuple[list, np.ndarray, np.ndarray, object]] = []
    cohort = engine.cohorter.cohort

    def capture(ids, matrix, reference):
        res = cohort(ids, matrix, reference)
        seen.append((list(ids), np.asarray(matrix, np.float64),
                     np.asarray(reference, np.float64), res))
        return res

    engine.cohorter.cohort = capture
    for r in range(1, first + 1):
        ctx = engine.begin_round(r)
        engine.accept(ctx, [engine.train(ctx)])
        engine.after_training(ctx)
        engine.finish(ctx)
    rows = []
    for ids, x, ref, res in seen:
        lab = np.array([family.get(c, -1) for c in ids])
        d = x - ref
        c = d - d.mean(axis=0)
        u, s, _ = np.linalg.svd(c, full_matrices=False)
        share = s ** 2 / (s ** 2).sum()
        rank = int((share > 1e-12).sum())
        z = u[:, 0] * s[0]
        test = leading_split_test(z, 0.01, min_size=5)
        fams = sorted(set(lab.tolist()))
        sep = ari = None
        if len(fams) == 2:
            a, b = z[lab == fams[0]], z[lab == fams[1]]
            sep = abs(a.mean() - b.mean()) / np.sqrt((a.var(ddof=1) + b.var(ddof=1)) / 2)
            ari = adjusted_rand_score(lab, test.labels)
        rows.append({
            "scenario": scenario, "seed": seed, "keep": keep, "n": len(ids),
            "families": "+".join(str(int((lab == f).sum())) for f in fams),
            "pc1_share": float(share[0]),
            "broken_stick": float(sum(1.0 / k for k in range(1, rank + 1)) / rank),
            "separation": sep, "p_value": test.p_value, "split_ari": ari,
            "cohorts_without": res.n_cohorts,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", nargs="+", required=True)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--keep", type=int, nargs="*", default=None,
                    help="drift event(s) to keep one at a time (single-family null)")
    args = ap.parse_args(argv)
    print("| scenario | seed | kept event | quarantined (per family) | PC1 share | broken "
          "stick | family separation on PC1 | split p | split ARI | cohorts (broken "
          "stick alone) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for sc in args.scenarios:
        for seed in args.seeds:
            for keep in (args.keep if args.keep else [None]):
                for r in diagnose(sc, seed, keep):
                    def f(v, fmt):
                        return "n/a" if v is None else format(v, fmt)
                    print(f"| {sc} | {seed} | {f(keep, 'd')} | {r['families']} | "
                          f"{r['pc1_share']:.3f} | {r['broken_stick']:.3f} | "
                          f"{f(r['separation'], '.2f')} | {r['p_value']:.3f} | "
                          f"{f(r['split_ari'], '.2f')} | {r['cohorts_without']} |",
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
