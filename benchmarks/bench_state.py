"""Durable state: snapshot + atomic commit + verified load of a federation's state.

Builds the federation of a config (default: the embedded default), gives every client a
detector state and splits the root cohort into ``--cohorts`` cohorts, then times
``snapshot_federation`` + ``StateStore.commit`` (fsync'ed) and ``StateStore.load`` +
``restore_federation`` over ``--repeat`` rounds. Prints sizes and median times.

    .venv/bin/python benchmarks/bench_state.py            # default config, 20 commits
    .venv/bin/python benchmarks/bench_state.py --quick    # 3 commits
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

from clma.config import load_config
from clma.sim.federation import build_federation
from clma.state import StateStore, restore_federation, snapshot_federation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--cohorts", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    repeat = 3 if a.quick else a.repeat
    cfg = load_config(a.config)
    fed = build_federation(cfg)
    ids = fed.client_ids
    groups = {g: ids[g::a.cohorts] for g in range(1, a.cohorts)}
    fed.registry.split(0, groups, round=1)
    fed.cohort_models = {c: fed.initial_model.copy() for c in fed.registry.active_cohorts()}
    for cl in fed.clients.values():
        cl.detector_state = {"kind": "LossThresholdDetector", "gamma": 0.5,
                             "previous_loss": 1.0, "n_updates": 1, "n_flags": 0}
    with tempfile.TemporaryDirectory() as tmp:
        store = StateStore(tmp)
        commit_s, load_s = [], []
        for r in range(1, repeat + 1):
            fed.cohort_models = {c: v + np.float32(1e-3) for c, v in fed.cohort_models.items()}
            t = time.perf_counter()
            store.commit(r, snapshot_federation(fed, r))
            commit_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            restore_federation(build_federation(cfg) if r == 1 else fed, store.load())
            load_s.append(time.perf_counter() - t)
        snap = store.load()
        size = sum(len(b) for b in snap.files.values())
    print(f"config {cfg.name}: {cfg.clients} clients, {len(fed.cohort_models)} cohorts, "
          f"{fed.initial_model.size} parameters per model")
    print(f"snapshot size {size / 1024:.1f} KiB "
          + ", ".join(f"{k} {len(v) / 1024:.1f}" for k, v in sorted(snap.files.items())))
    print(f"commit (snapshot + fsync + rename + CURRENT swap): median "
          f"{statistics.median(commit_s) * 1e3:.1f} ms over {repeat}")
    print(f"load (verify SHA-256 + restore): median {statistics.median(load_s[1:] or load_s) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
