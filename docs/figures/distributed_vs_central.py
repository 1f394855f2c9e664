"""Central vs distributed error bars for one group of N clients (docs/private_evaluation.md).

    PYTHONPATH=. python docs/figures/distributed_vs_central.py

Deterministic (no sampling): accuracy (sensitivity 1), epsilon 1 per release, delta 1e-6
(distributed), floor m = 5, the default secure-aggregation assumptions (gamma 5 %,
delta_drop 10 %), every selected client contributing; 95 % bars on the mean.
"""

from __future__ import annotations

from clma.engine.distributed import group_noise
from clma.engine.evaluation import QUANTISATION_LEVELS
from clma.privacy.distributed import sum_noise_quantile
from clma.privacy.mechanisms import error_bar
from clma.release.aggregate import participant_band, participant_band_lower_edge

EPS, DELTA, M, Q = 1.0, 1e-6, 5, QUANTISATION_LEVELS


def row(n: int) -> tuple:
    lo = participant_band_lower_edge(participant_band(n, M), M)
    gn = group_noise(n, epsilon=EPS, delta=DELTA, dropout_fraction=0.10,
                     corrupted_fraction=0.05, floor=M, levels=Q, security=40,
                     coordinates=(0, 1))
    central_exact = error_bar(1.0 / EPS, n=n)
    central_pub = error_bar(1.0 / EPS, n=lo)
    dist_exact = sum_noise_quantile(gn.sigma, n) / Q / n
    dist_pub = sum_noise_quantile(gn.sigma, lo) / Q / lo
    return (n, lo, central_exact, central_pub, gn.honest_floor, gn.sigma / Q, dist_exact,
            dist_pub, gn.modulus_bits)


if __name__ == "__main__":
    print("| N | band lower edge | central bar (exact n) | central bar (published) | "
          "honest floor h | per-client sigma | distributed bar (exact n) | "
          "distributed bar (published) | ring bits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in (50, 500, 5000):
        r = row(n)
        print(f"| {r[0]:,} | {r[1]} | {r[2]:.4f} | {r[3]:.4f} | {r[4]:,} | {r[5]:.4f} | "
              f"{r[6]:.4f} | {r[7]:.4f} | {r[8]} |")
