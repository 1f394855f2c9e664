"""Secure-aggregation cost for a 32-value metric vector (issue 4, benchmark).

For each client count n: one round without dropouts and one with a dropout
fraction (default 10 %) of clients going silent before sending their masked
input (the server must reconstruct their pairwise-mask keys).  Complete graph
(original SecAgg) for n <= --complete-max, SecAgg+ Harary graph of degree
2 ceil(log2 n) above it.  Clients run sequentially in one process, so the
"client" figure is the mean wall time per client; "server" is the total.

    .venv/bin/python benchmarks/bench_secagg.py            # 100, 1000, 5000
    .venv/bin/python benchmarks/bench_secagg.py --quick    # 100 only
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from clma.privacy.secagg import (
    FixedPointQuantiser,
    SecAggConfig,
    run_secure_aggregation,
    secagg_plus_degree,
)

D = 32


def bench(n: int, dropout: float, complete_max: int, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    quant = FixedPointQuantiser(np.zeros(D), np.ones(D))
    inputs = {u: quant.quantise(rng.uniform(0, 1, D)) for u in range(n)}
    if n <= complete_max:
        degree, holders = None, n
    else:
        degree = secagg_plus_degree(n)
        holders = degree + 1
    t = holders // 2 + 1
    cfg = SecAggConfig(n_clients=n, threshold=t, vector_length=D, neighbour_degree=degree,
                       graph_seed=seed, round_id=f"bench-{n}")
    dropped = sorted(rng.choice(n, size=int(round(dropout * n)), replace=False).tolist())
    start = time.perf_counter()
    res = run_secure_aggregation(inputs, cfg, drop_before_masked_input=dropped)
    wall = time.perf_counter() - start
    expect = sum(inputs[u] for u in range(n) if u not in set(dropped)) & np.uint64(2**32 - 1)
    assert np.array_equal(res.sum_quantised, expect), "secure sum mismatch"
    client_total = sum(res.client_seconds.values())
    phases = ("setup", "advertise_keys", "share_keys", "masked_input", "unmasking")
    return {
        "n": n, "graph": "complete" if degree is None else f"harary d={degree}", "t": t,
        "dropped": len(dropped), "client_ms": 1000 * client_total / n,
        "server_s": sum(res.server_seconds[p] for p in phases),
        "server_unmask_s": res.server_seconds["unmasking"],
        "recovery_s": res.server_seconds["unmasking.dropout_recovery"], "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="n = 100 only (smoke run)")
    ap.add_argument("--sizes", type=int, nargs="*", default=None)
    ap.add_argument("--dropout", type=float, default=0.10)
    ap.add_argument("--complete-max", type=int, default=100,
                    help="largest n run on the complete graph (SecAgg); above: SecAgg+")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sizes = args.sizes or ([100] if args.quick else [100, 1000, 5000])
    print(f"vector length {D}, modulus 2^32, Q = 2^16 - 1, dropout before masked input "
          f"{args.dropout:.0%}, seed {args.seed}")
    hdr = (f"{'n':>6} {'graph':>14} {'t':>5} {'drop':>5} {'client ms/client':>17} "
           f"{'server s':>9} {'of which unmask s':>18} {'dropout recovery s':>19} {'wall s':>8}")
    print(hdr)
    bench(12, 0.0, args.complete_max, args.seed)  # warm-up (library initialisation), discarded
    for n in sizes:
        rows = [bench(n, 0.0, args.complete_max, args.seed),
                bench(n, args.dropout, args.complete_max, args.seed)]
        for r in rows:
            print(f"{r['n']:>6} {r['graph']:>14} {r['t']:>5} {r['dropped']:>5} "
                  f"{r['client_ms']:>17.2f} {r['server_s']:>9.2f} {r['server_unmask_s']:>18.2f} "
                  f"{r['recovery_s']:>19.2f} {r['wall_s']:>8.2f}")
        r = rows[1]
        print(f"{'':>6} dropout recovery: {r['recovery_s']:.2f} s server time for "
              f"{r['dropped']} dropped clients ({1000 * r['recovery_s'] / max(r['dropped'], 1):.1f} "
              f"ms per dropped client; {r['recovery_s'] / r['server_s']:.0%} of that round's server time)")


if __name__ == "__main__":
    main()
