"""Benchmark: CLMA cohorting time and memory at federation scale (issues 2 and 3).

For each size (n_clients x n_params, float32) a fresh subprocess builds a synthetic stack
(reference N(0, 0.05); four drift families: two opposite mean shifts, each with two
sub-families; per-client noise), then times ``CLMACohorter().cohort(...)`` and records

* wall and CPU time (all threads; the machine may be shared, so the 1-minute load
  average is printed too) of the whole call (signed KS with the reference sorted once, Gram-trick PCA,
  clustering), untraced; at 100 x 1M also the KS step alone;
* peak traced allocation during the call (``tracemalloc``: numpy buffers, all threads) —
  memory *beyond* the float32 stack, which is used in place;
* peak RSS of the process (``resource.getrusage``; includes the stack) and RSS growth
  during the call;
* beside them: the float32 stack size and the memory the literal route would need for the
  ``p x p`` matrix ``S^T S`` in float64 (``8 p^2`` bytes).

At 100 x 1M it also times ``scipy.stats.ks_2samp`` on a few clients (which sorts the
reference again for every client, as the reference package does) for comparison.

Usage::

    .venv/bin/python benchmarks/bench_cohorting.py            # full sizes (~several minutes)
    .venv/bin/python benchmarks/bench_cohorting.py --quick    # tiny sizes, smoke run
    .venv/bin/python benchmarks/bench_cohorting.py --sizes 100x1000000

Targets: 100 x 1M under 15 s with < 0.5 GB beyond the stack; 100 x 11.2M peak memory
within 2x the stack size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import tracemalloc

import numpy as np

FULL_SIZES = ["10x1000000", "100x1000000", "1000x1000000", "100x11200000"]
QUICK_SIZES = ["10x20000", "40x50000"]
GB = 1024**3


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build_stack(n: int, p: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 stack built in place (no float64 temporaries of stack size)."""
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal(p, dtype=np.float32)
    ref *= np.float32(0.05)
    fam_disp = []
    for mu in (0.01, 0.01, -0.01, -0.01):
        d = rng.standard_normal(p, dtype=np.float32)
        d *= np.float32(0.01)
        d += np.float32(mu)
        fam_disp.append(d)
    truth = np.arange(n) % 4
    stack = np.empty((n, p), dtype=np.float32)
    for i in range(n):
        row = stack[i]
        rng.standard_normal(out=row, dtype=np.float32)
        row *= np.float32(0.002)
        row += ref
        row += fam_disp[truth[i]]
    return stack, ref, truth


def run_case(n: int, p: int, seed: int, scipy_clients: int) -> dict:
    from sklearn.metrics import adjusted_rand_score

    from clma.cohort import CLMACohorter

    stack, ref, truth = build_stack(n, p, seed)
    ids = [f"c{i}" for i in range(n)]
    cohorter = CLMACohorter()
    rss_before = _rss_bytes()

    # Untraced run for the time, traced run for the allocations (tracemalloc slows numpy).
    t0, c0 = time.perf_counter(), time.process_time()
    res = cohorter.cohort(ids, stack, ref)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    load = os.getloadavg()[0]
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tracemalloc.start()
    cohorter.cohort(ids, stack, ref)
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    ks_wall = float("nan")
    if scipy_clients:
        t0 = time.perf_counter()
        cohorter.ks_components(stack, ref)
        ks_wall = time.perf_counter() - t0

    out = {
        "n_clients": n, "n_params": p, "seed": seed,
        "wall_s": wall, "cpu_s": cpu, "load_avg_1min": load, "ks_wall_s": ks_wall,
        "traced_peak_beyond_stack_bytes": traced_peak,
        "rss_peak_bytes": rss_peak, "rss_before_call_bytes": rss_before,
        "stack_bytes": stack.nbytes,
        "literal_StS_bytes": 8 * p * p,
        "n_cohorts": res.n_cohorts,
        "ari_vs_families": float(adjusted_rand_score(truth, res.labels(ids))),
    }
    if scipy_clients:
        from scipy.stats import ks_2samp
        t0 = time.perf_counter()
        for i in range(scipy_clients):
            ks_2samp(stack[i], ref)
        per = (time.perf_counter() - t0) / scipy_clients
        out["scipy_ks_2samp_per_client_s"] = per
        out["ours_ks_per_client_s"] = ks_wall / n
    return out


def fmt_bytes(b: float) -> str:
    return f"{b / GB:8.3f} GB" if b >= 0.1 * GB else f"{b / 1024**2:8.1f} MB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    ap.add_argument("--sizes", nargs="*", help="sizes as NxP, e.g. 100x1000000")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scipy-clients", type=int, default=3,
                    help="clients timed with scipy.stats.ks_2samp at 100 x 1M (0: skip)")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args()

    if args.case:  # child process: one size
        n, p = (int(x) for x in args.case.split("x"))
        scipy_clients = args.scipy_clients if (n, p) == (100, 1_000_000) else 0
        print(json.dumps(run_case(n, p, args.seed, scipy_clients)))
        return

    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    results = []
    print(f"{'clients x params':>20} {'wall':>8} {'CPU':>8} {'load':>5} {'KS':>8} "
          f"{'beyond stack':>12} "
          f"{'RSS peak':>11} {'stack f32':>11} {'peak/stack':>10} {'literal S^T S':>14} "
          f"{'cohorts':>7} {'ARI':>5}")
    for size in sizes:
        proc = subprocess.run(
            [sys.executable, __file__, "--case", size, "--seed", str(args.seed),
             "--scipy-clients", str(args.scipy_clients)],
            capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(f"{size}: failed\n{proc.stderr[-2000:]}")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(r)
        print(f"{r['n_clients']:>8} x {r['n_params']:>10,} {r['wall_s']:7.2f}s "
              f"{r['cpu_s']:7.2f}s {r['load_avg_1min']:5.1f} {r['ks_wall_s']:7.2f}s {fmt_bytes(r['traced_peak_beyond_stack_bytes']):>12} "
              f"{fmt_bytes(r['rss_peak_bytes']):>11} {fmt_bytes(r['stack_bytes']):>11} "
              f"{r['rss_peak_bytes'] / r['stack_bytes']:9.2f}x "
              f"{fmt_bytes(r['literal_StS_bytes']):>14} {r['n_cohorts']:>7} "
              f"{r['ari_vs_families']:5.2f}")
        if "scipy_ks_2samp_per_client_s" in r:
            print(f"{'':>22}KS per client: ours {r['ours_ks_per_client_s']:.3f} s "
                  f"(reference sorted once, 2 threads) vs scipy.stats.ks_2samp "
                  f"{r['scipy_ks_2samp_per_client_s']:.3f} s (re-sorts both; x{n_ratio(r):.1f})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


def n_ratio(r: dict) -> float:
    return r["scipy_ks_2samp_per_client_s"] / r["ours_ks_per_client_s"]


if __name__ == "__main__":
    main()
