"""Durable state: snapshot + atomic commit + verified load of a federation's server state.

Builds the server of a config (default: the embedded default) over its simulated clients,
splits the root cohort into ``--cohorts`` cohorts and creates the evaluation state, then
times ``snapshot_server`` + ``StateStore.commit`` (fsync'ed) and ``StateStore.load`` +
``restore_server`` over ``--repeat`` rounds. Prints sizes and median times. (The clients'
detector state is not part of it: the devices keep it in their own folder.)

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
from clma.engine import FederationEngine
from clma.sim.clients import SimulatedClients
from clma.sim.federation import build_federation
from clma.state import StateStore, restore_server, snapshot_server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--cohorts", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    repeat = 3 if a.quick else a.repeat
    cfg = load_config(a.config)
    sim = build_federation(cfg)
    engine = FederationEngine(cfg, sim.assets(), SimulatedClients(sim))
    state = engine.state
    ids = engine.roster.client_ids
    groups = {g: ids[g::a.cohorts] for g in range(1, a.cohorts)}
    state.registry.split(0, groups, round=1)
    initial = engine.assets.initial_model
    state.cohort_models = {c: initial.copy() for c in state.registry.active_cohorts()}
    state.merge_reference = initial.copy()
    engine.evaluator.state  # noqa: B018 - creates the evaluation state (bounds, merges)
    with tempfile.TemporaryDirectory() as tmp:
        store = StateStore(tmp)
        commit_s, load_s = [], []
        for r in range(1, repeat + 1):
            state.cohort_models = {c: v + np.float32(1e-3) for c, v in state.cohort_models.items()}
            t = time.perf_counter()
            store.commit(r, snapshot_server(state, cfg, r))
            commit_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            restore_server(store.load(), cfg)
            load_s.append(time.perf_counter() - t)
        snap = store.load()
        size = sum(len(b) for b in snap.files.values())
    print(f"config {cfg.name}: {cfg.clients} clients, {len(state.cohort_models)} cohorts, "
          f"{initial.size} parameters per model")
    print(f"snapshot size {size / 1024:.1f} KiB "
          + ", ".join(f"{k} {len(v) / 1024:.1f}" for k, v in sorted(snap.files.items())))
    print(f"commit (snapshot + fsync + rename + CURRENT swap): median "
          f"{statistics.median(commit_s) * 1e3:.1f} ms over {repeat}")
    print(f"load (verify SHA-256 + restore): median {statistics.median(load_s[1:] or load_s) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
