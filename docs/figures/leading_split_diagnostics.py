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
is a false split). ``--label-mix`` adds what the leading component follows: the share of
its scores' variance explained by the family (eta squared) and by each client's label mix
(R squared of a least-squares fit on the client's training-label proportions, with its
permutation p-value over 999 seeded shuffles: with 9 free proportions and about 30
clients a fit explains about 9/29 of the variance by chance) and Pearson's correlation
with the client's training-set size (``scipy.stats.pearsonr``: under a Dirichlet
partition sizes differ, and with them the number of local SGD steps), the share of the
scores' sum of squares carried by the 3 largest (concentration on a few clients; its
median for Gaussian scores of the same count is printed beside it, from 2,000 seeded
draws), and the principal component among the first five along which the families are
farthest apart.

    python docs/figures/leading_split_diagnostics.py --scenarios cov-rotnoise-iid --seeds 0 1 2
    python docs/figures/leading_split_diagnostics.py --scenarios cov-rotnoise-iid --keep 0
    python docs/figures/leading_split_diagnostics.py --label-mix --scenarios cov-rotnoise-a1

Figures are simulation truth on the bundled digits; OMP_NUM_THREADS=1 as in the README.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from sklearn.metrics import adjusted_rand_score


def label_mix_r2(z: np.ndarray, proportions: np.ndarray, n_perm: int = 999,
                 seed: int = 0) -> tuple[float, float]:
    """R squared of the least-squares fit of ``z`` (shape (n,)) on ``proportions`` (shape
    (n, k), rows summing to 1; the last column is dropped, an intercept added) and its
    permutation p-value ((1 + #{R2_perm >= R2}) / (1 + n_perm), rows of ``z`` shuffled)."""
    a = np.column_stack([np.ones(len(z)), proportions[:, :-1]])

    def r2(y: np.ndarray) -> float:
        beta, *_ = np.linalg.lstsq(a, y, rcond=None)
        resid = y - a @ beta
        return float(1.0 - resid @ resid / ((y - y.mean()) @ (y - y.mean())))

    obs = r2(z)
    rng = np.random.default_rng(seed)
    null = np.array([r2(rng.permutation(z)) for _ in range(n_perm)])
    return obs, float((1 + (null >= obs - 1e-12).sum()) / (1 + n_perm))


def _eta2(z: np.ndarray, lab: np.ndarray) -> float:
    """Share of the variance of ``z`` between the groups ``lab``."""
    between = sum((lab == g).sum() * (z[lab == g].mean() - z.mean()) ** 2
                  for g in np.unique(lab))
    return float(between / ((z - z.mean()) ** 2).sum())


def _separation(z: np.ndarray, lab: np.ndarray, fams: list[int]) -> float:
    a, b = z[lab == fams[0]], z[lab == fams[1]]
    return float(abs(a.mean() - b.mean()) / np.sqrt((a.var(ddof=1) + b.var(ddof=1)) / 2))


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
    clients = SimulatedClients(fed)
    engine = FederationEngine(cfg, fed.assets(), clients)
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
        sep = ari = eta2 = best = None
        if len(fams) == 2:
            sep = _separation(z, lab, fams)
            ari = adjusted_rand_score(lab, test.labels)
            eta2 = _eta2(z, lab)
            seps = [_separation(u[:, k] * s[k], lab, fams) for k in range(min(5, rank))]
            best = (int(np.argmax(seps)) + 1, float(max(seps)))
        labels_now = np.array([np.bincount(clients.learners[c].data(first)[1],
                                           minlength=fed.clients[c].n_classes)
                               for c in ids], dtype=np.float64)
        props = labels_now / labels_now.sum(axis=1, keepdims=True)
        mix_r2, mix_p = label_mix_r2(z, props, seed=seed)
        from scipy.stats import pearsonr

        size = pearsonr(z, labels_now.sum(axis=1))
        top3 = float(np.sort(z ** 2)[-3:].sum() / (z ** 2).sum())
        g = np.random.default_rng(seed).standard_normal((2000, len(z)))
        g -= g.mean(axis=1, keepdims=True)
        top3_null = float(np.median(np.sort(g ** 2, axis=1)[:, -3:].sum(axis=1)
                                    / (g ** 2).sum(axis=1)))
        rows.append({
            "scenario": scenario, "seed": seed, "keep": keep, "n": len(ids),
            "families": "+".join(str(int((lab == f).sum())) for f in fams),
            "pc1_share": float(share[0]),
            "broken_stick": float(sum(1.0 / k for k in range(1, rank + 1)) / rank),
            "separation": sep, "p_value": test.p_value, "split_ari": ari,
            "cohorts_without": res.n_cohorts, "family_eta2": eta2,
            "label_mix_r2": mix_r2, "label_mix_p": mix_p, "best_pc": best,
            "size_r": float(size.statistic), "size_p": float(size.pvalue),
            "top3": top3, "top3_null": top3_null,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", nargs="+", required=True)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--keep", type=int, nargs="*", default=None,
                    help="drift event(s) to keep one at a time (single-family null)")
    ap.add_argument("--label-mix", action="store_true",
                    help="print what the leading component follows (family, label mix)")
    args = ap.parse_args(argv)
    if args.label_mix:
        print("| scenario | seed | quarantined (per family) | family separation on PC1 | "
              "family eta^2 on PC1 | label-mix R^2 on PC1 (permutation p) | r with "
              "training-set size (p) | top-3 clients' share of PC1 (Gaussian median) | "
              "farthest PC of the first 5 (separation) |")
        print("|---|---|---|---|---|---|---|---|---|")
    else:
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
                    if args.label_mix:
                        b = r["best_pc"]
                        print(f"| {sc} | {seed} | {r['families']} | "
                              f"{f(r['separation'], '.2f')} | {f(r['family_eta2'], '.2f')} | "
                              f"{r['label_mix_r2']:.2f} ({r['label_mix_p']:.3f}) | "
                              f"{r['size_r']:+.2f} ({r['size_p']:.3f}) | "
                              f"{r['top3']:.2f} ({r['top3_null']:.2f}) | "
                              f"{'n/a' if b is None else f'PC{b[0]} ({b[1]:.2f})'} |",
                              flush=True)
                        continue
                    print(f"| {sc} | {seed} | {f(keep, 'd')} | {r['families']} | "
                          f"{r['pc1_share']:.3f} | {r['broken_stick']:.3f} | "
                          f"{f(r['separation'], '.2f')} | {r['p_value']:.3f} | "
                          f"{f(r['split_ari'], '.2f')} | {r['cohorts_without']} |",
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
