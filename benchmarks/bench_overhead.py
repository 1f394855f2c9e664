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

The machine may be shared: the arms run interleaved and repeated in one process (``bare
prefect bare prefect`` for ``--repeats 2``), so a load change hits both arms of a pair.
Each arm run is a whole federation from round 1 (fresh ledger, fresh MLflow run).

Per-round figures, rounds 2..N of each run (round 1 holds one-time start-up):

* wall time: bare = each ``run_round`` call; prefect = the time between two consecutive
  rounds' ends (``on_round``), i.e. the round flow run and everything logged after it;
* CPU time: user + system seconds over the same intervals, of this process (every thread:
  Prefect's and MLflow's background workers included) and, for the prefect arm, of its
  child processes (the temporary Prefect API server: live children through psutil when it
  is installed, reaped ones through ``resource.getrusage(RUSAGE_CHILDREN)``; the bare arm
  has none of its own). CPU time does not grow when other
  processes compete for the cores, so it is the load-insensitive second measure.

Prefect start-up = time to the end of round 1 minus the run's median per-round time (the
first prefect run also starts the Prefect API). Per pair: R = median prefect per-round
wall time / median bare per-round wall time (and the same of CPU time). The last line is
``overhead: R`` with R the median over the pairs (default config).

    .venv/bin/python benchmarks/bench_overhead.py --quick              # default config
    .venv/bin/python benchmarks/bench_overhead.py --quick --repeats 3  # 3 pairs
    .venv/bin/python benchmarks/bench_overhead.py --quick --rounds 4   # rounds 1-4 only
    .venv/bin/python benchmarks/bench_overhead.py                      # and 300 clients
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
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


def cpu_seconds(children: bool = True) -> float:
    """User + system CPU seconds of this process and (``children``) of its child processes,
    live and reaped."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    total = own.ru_utime + own.ru_stime
    if not children:
        return total
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total += reaped.ru_utime + reaped.ru_stime
    try:
        import psutil
    except ImportError:  # live children not counted: said in the output
        return total
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:  # ended between listing and reading: counted when reaped
            continue
        total += t.user + t.system
    return total


def _has_psutil() -> bool:
    try:
        import psutil  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class ArmRun:
    """Per-round wall and CPU seconds of one arm run, rounds 2..N."""

    arm: str
    wall: list[float]
    cpu: list[float]
    startup: float | None = None

    def line(self, label: str, i: int) -> str:
        w, c = self.wall, self.cpu
        s = (f"{label} {self.arm} #{i}: per-round wall median {statistics.median(w):.2f} s "
             f"[min {min(w):.2f}, max {max(w):.2f}], CPU median {statistics.median(c):.2f} s "
             f"[min {min(c):.2f}, max {max(c):.2f}] over rounds 2-{len(w) + 1}")
        if self.startup is not None and self.startup >= 1.0:
            s += f"; one-time start-up {self.startup:.1f} s"
        elif self.startup is not None:  # round 1 within a second of the median round
            s += (f"; no one-time start-up left (round 1 - median round = "
                  f"{self.startup:.1f} s: the Prefect API is up from an earlier pair)")
        return s


ROUNDS: int | None = None  # --rounds: fewer rounds of the same federation (a loaded machine)


def _config(clients: int | None, tmp: Path, tag: str):
    from clma.config import load_config

    cfg = load_config(None)
    if clients is not None:
        cfg = cfg.with_overrides(clients=clients)
    if ROUNDS is not None:
        cfg = cfg.with_overrides(rounds=ROUNDS)
    return cfg.model_copy(update={"budget": cfg.budget.model_copy(
        update={"state_dir": str(tmp / f"ledger-{tag}")})})


def bare(clients: int | None, tmp: Path, tag: str) -> ArmRun:
    import torch

    from clma.engine import FederationEngine, open_budget
    from flows.transport import open_transport

    torch.set_num_threads(1)
    cfg = _config(clients, tmp, f"bare-{tag}")
    tr = open_transport(cfg)
    engine = FederationEngine(cfg, tr.assets, tr.clients, budget=open_budget(cfg))
    wall, cpu = [], []
    for r in range(1, cfg.rounds + 1):  # own process only: a Prefect API left by an
        t, c = time.perf_counter(), cpu_seconds(children=False)  # earlier pair is not ours
        engine.run_round(r, chunk_size=cfg.orchestration.chunk_size)
        wall.append(time.perf_counter() - t)
        cpu.append(cpu_seconds(children=False) - c)
    tr.close()
    return ArmRun("bare", wall[1:], cpu[1:])  # rounds 2..N, as for prefect


def prefect(clients: int | None, tmp: Path, tag: str) -> ArmRun:
    from flows.federation import federation_flow

    cfg = _config(clients, tmp, f"prefect-{tag}")
    ends: list[tuple[float, float]] = []
    t0 = time.perf_counter()
    federation_flow(cfg, out_dir=str(tmp / f"out-{tag}"),
                    on_round=lambda rec: ends.append((time.perf_counter(), cpu_seconds())))
    wall = [b[0] - a[0] for a, b in zip(ends, ends[1:], strict=False)]
    cpu = [b[1] - a[1] for a, b in zip(ends, ends[1:], strict=False)]
    startup = (ends[0][0] - t0) - statistics.median(wall)
    return ArmRun("prefect", wall, cpu, startup)


def compare(clients: int | None, tmp: Path, repeats: int) -> float:
    """Run ``repeats`` interleaved pairs (bare, prefect) and print each run and the ratios;
    returns the median wall-time ratio."""
    label = "default (60 clients)" if clients is None else f"{clients} clients"
    runs: dict[str, list[ArmRun]] = {"bare": [], "prefect": []}
    for i in range(1, repeats + 1):
        for arm, fn in (("bare", bare), ("prefect", prefect)):
            run = fn(clients, tmp, f"{clients}-{i}")
            runs[arm].append(run)
            print(run.line(label, i), flush=True)
    wall_r = [statistics.median(p.wall) / statistics.median(b.wall)
              for b, p in zip(runs["bare"], runs["prefect"], strict=True)]
    cpu_r = [statistics.median(p.cpu) / statistics.median(b.cpu)
             for b, p in zip(runs["bare"], runs["prefect"], strict=True)]
    print(f"{label}: wall ratio per pair {', '.join(f'{r:.3f}' for r in wall_r)}; "
          f"median {statistics.median(wall_r):.3f}")
    print(f"{label}: CPU ratio per pair {', '.join(f'{r:.3f}' for r in cpu_r)}; "
          f"median {statistics.median(cpu_r):.3f}")
    return statistics.median(wall_r)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="default config only")
    p.add_argument("--repeats", type=int, default=2,
                   help="interleaved (bare, prefect) pairs per config (default 2)")
    p.add_argument("--rounds", type=int, default=None,
                   help="run only the first ROUNDS rounds (at least 3; default: the config's 10)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.rounds is not None and args.rounds < 3:
        p.error("--rounds must be at least 3 (round 1 is start-up; two rounds to compare)")
    global ROUNDS
    ROUNDS = args.rounds
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as d:
        tmp = Path(d)
        _env(tmp)
        load = os.getloadavg()
        print(f"load average at start {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 "
              f"min), {os.cpu_count()} cores; CPU time counts "
              + ("live and reaped child processes" if _has_psutil()
                 else "reaped child processes only (psutil not installed)"), flush=True)
        ratio = None
        for clients in ([None] if args.quick else [None, 300]):
            r = compare(clients, tmp, args.repeats)
            if clients is None:
                ratio = r
        load = os.getloadavg()
        print(f"load average at end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
        print(f"overhead: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
