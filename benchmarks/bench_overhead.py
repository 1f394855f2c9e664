"""Orchestration overhead: the same federation through the bare engine and through Prefect.

Both paths run the same governed rounds on the same simulated clients (the embedded
default config, seed 0; and the same with 300 clients): selection, training through the
Clients seam, drift quarantine, divergence scoring, cohorting, the private evaluation with
secure aggregation, the ledger, envelopes and alerts.

* ``bare``: :meth:`clma.engine.FederationEngine.run_round` in a plain loop (no Prefect, no
  MLflow, no dashboards; the ledger in a temporary folder);
* ``prefect``: :func:`flows.federation.federation_flow` (every round a Prefect flow run of
  named tasks, on the temporary local Prefect API), tracked in a temporary MLflow SQLite
  store with lineage, models and dashboards.

Per-round wall time: bare = each ``run_round`` call; prefect = the time between two
consecutive rounds' ends (``on_round``), i.e. the round flow run and everything logged
after it. One-time start-up (the Prefect API's first start, MLflow store creation, the
first round's extra) is reported separately: prefect start-up = time to the end of round 1
minus the median per-round time. The last line is ``overhead: R`` with R = median prefect
per-round time / median bare per-round time (default config).

    .venv/bin/python benchmarks/bench_overhead.py            # default config, then 300 clients
    .venv/bin/python benchmarks/bench_overhead.py --quick    # default config only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env(tmp: Path) -> None:
    os.environ.setdefault("PREFECT_HOME", str(tmp / "prefect"))
    for k, v in {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "ERROR",
                 "PREFECT_SERVER_LOGGING_LEVEL": "CRITICAL", "DO_NOT_TRACK": "true",
                 "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
                 "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"}.items():
        os.environ.setdefault(k, v)
    sys.path.insert(0, str(ROOT))


def _config(clients: int | None, tmp: Path, tag: str):
    from clma.config import load_config

    cfg = load_config(None)
    if clients is not None:
        cfg = cfg.with_overrides(clients=clients)
    return cfg.model_copy(update={"budget": cfg.budget.model_copy(
        update={"state_dir": str(tmp / f"ledger-{tag}")})})


def bare(clients: int | None, tmp: Path) -> list[float]:
    import torch

    from clma.engine import FederationEngine, open_budget
    from flows.transport import open_transport

    torch.set_num_threads(1)
    cfg = _config(clients, tmp, f"bare-{clients}")
    tr = open_transport(cfg)
    engine = FederationEngine(cfg, tr.assets, tr.clients, budget=open_budget(cfg))
    times = []
    for r in range(1, cfg.rounds + 1):
        t = time.perf_counter()
        engine.run_round(r, chunk_size=cfg.orchestration.chunk_size)
        times.append(time.perf_counter() - t)
    tr.close()
    return times


def prefect(clients: int | None, tmp: Path) -> tuple[float, list[float]]:
    from flows.federation import federation_flow

    cfg = _config(clients, tmp, f"prefect-{clients}")
    ends: list[float] = []
    t0 = time.perf_counter()
    federation_flow(cfg, out_dir=str(tmp / f"out-{clients}"),
                    on_round=lambda rec: ends.append(time.perf_counter()))
    per = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    startup = (ends[0] - t0) - statistics.median(per)
    return startup, per


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="default config only")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as d:
        tmp = Path(d)
        _env(tmp)
        ratio = None
        for clients in ([None] if args.quick else [None, 300]):
            label = "default (60 clients)" if clients is None else f"{clients} clients"
            b = bare(clients, tmp)[1:]  # rounds 2..N, as for prefect
            startup, pf = prefect(clients, tmp)
            mb, mp = statistics.median(b), statistics.median(pf)
            print(f"{label}: bare per-round median {mb:.2f} s [min {min(b):.2f}, max "
                  f"{max(b):.2f}] over rounds 2-{len(b) + 1}")
            print(f"{label}: prefect+mlflow+dashboards per-round median {mp:.2f} s [min "
                  f"{min(pf):.2f}, max {max(pf):.2f}] over rounds 2-{len(pf) + 1}; one-time "
                  f"start-up {startup:.1f} s")
            print(f"{label}: ratio {mp / mb:.3f}")
            if clients is None:
                ratio = mp / mb
        print(f"overhead: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
