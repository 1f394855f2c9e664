"""One CLMA round with many simulated clients on three engines (issue 8, benchmark).

Same config, model and data (digits, ``build_federation``; on every engine the devices
train through ``clma.device`` (the Flower arm through the CLMA ClientApp over the digits
learner)):

* ``prefect-threads``: the Prefect round flow over the in-process simulated clients
  (``federation.transport = "simulation"``);
* ``prefect-dask``: the same flow with the simulated devices hosted by a local Dask
  cluster of 2 worker processes x 1 thread (the ``dask`` transport,
  ``orchestration.dask_local_workers = 2``);
* ``flower-ray``: the ``clma.flower.CLMA`` strategy in Flower's simulation engine (Ray,
  2 CPUs, 1 CPU per ClientApp), one SuperNode per client.

Per engine: the round's wall time (Prefect: the ``round_flow`` call; Flower: the
``strategy.start`` call inside the ServerApp, i.e. without Ray start-up), ``client`` =
time spent inside the client functions (Prefect: ``train_on_device`` on the devices plus
the simulation's ground-truth evaluation; Flower: training + evaluation in the
ClientApps; timed where they run: this process, Dask workers, Ray actors; summed over
calls) as wall time and as the calling thread's CPU time (``time.thread_time``; torch
runs single-threaded), and the orchestration overhead ``round - client_cpu / slots`` with
``slots = 2`` (2 cores, 2 workers, 2 Ray CPUs: the client work's best case on 2 parallel
slots). Engine start-up (Prefect API, transport: Dask cluster and its device actors, Ray)
is printed separately. Divergence scoring and the private release are off
(``divergence.enabled = false``, ``evaluation.every`` > rounds) so the three engines do
the same work: train, FedAvg/cohorting, evaluate.

    .venv/bin/python benchmarks/bench_scale_out.py            # 200 clients
    .venv/bin/python benchmarks/bench_scale_out.py --quick    # 20 clients
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "flower_digits"
SLOTS = 2


def _env() -> None:
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="bench-prefect-"))
    for k, v in {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "ERROR",
                 "PREFECT_SERVER_LOGGING_LEVEL": "CRITICAL", "DO_NOT_TRACK": "true"}.items():
        os.environ.setdefault(k, v)
    sys.path.insert(0, str(EXAMPLE))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(EXAMPLE), str(ROOT), os.environ.get("PYTHONPATH")) if p)


def bench_config(n_clients: int, seed: int, path: Path):
    from clma.config import load_config

    path.write_text(f"""
name = "bench-scale-out"
seed = {seed}
rounds = 1
clients = {n_clients}
[data]
probe_size = 32
[evaluation]
every = 2
[divergence]
enabled = false
[tracking]
enabled = false
[budget]
enabled = false
[orchestration]
chunk_size = 8
""")
    return load_config(path)


# ---------------------------------------------------------------- timing wrappers
def _times() -> list[float]:
    """Per-process list of client-function durations, kept on ``clma.sim.clients`` (the
    module every simulated device's process imports: this one, each Dask worker)."""
    import clma.sim.clients as sc

    return sc.__dict__.setdefault("_bench_client_seconds", [])


def _timed(fn):
    def wrapper(*args, **kwargs):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _times().append((time.perf_counter() - t0, time.thread_time() - c0))
    wrapper.__wrapped__ = fn
    return wrapper


def _patch_tasks() -> None:
    """Time the devices' training (``train_on_device``, looked up by SimulatedClients at
    each call) and the simulation's ground truth (``SimulatedClients.truth``)."""
    import clma.sim.clients as sc

    if not hasattr(sc.train_on_device, "__wrapped__"):
        sc.train_on_device = _timed(sc.train_on_device)
        sc.SimulatedClients.truth = _timed(sc.SimulatedClients.truth)


class _TimingPlugin:
    """Dask worker plugin: time the client functions inside the worker process."""

    name = "bench-client-timing"

    def setup(self, worker):
        _patch_tasks()


def _worker_times() -> tuple[float, float]:
    t = _times()
    return float(sum(w for w, _ in t)), float(sum(c for _, c in t))


def _worker_reset() -> None:
    _times().clear()


# ---------------------------------------------------------------- engines
def run_prefect(cfg, dask_workers: int | None) -> dict[str, float]:
    from clma.engine import FederationEngine
    from flows.federation import round_flow
    from flows.transport import open_transport

    t0 = time.perf_counter()
    if dask_workers:
        cfg = cfg.model_copy(update={"orchestration": cfg.orchestration.model_copy(
            update={"dask_local_workers": dask_workers})})
    transport = open_transport(cfg)
    dask = getattr(transport.clients, "_client", None)  # DaskClients' distributed.Client
    if dask is not None:
        from distributed.diagnostics.plugin import WorkerPlugin

        class Plugin(_TimingPlugin, WorkerPlugin):
            pass

        dask.register_plugin(Plugin())
        dask.run(_worker_reset)
    engine = FederationEngine(cfg, transport.assets, transport.clients)
    startup = time.perf_counter() - t0
    _times().clear()
    t0 = time.perf_counter()
    round_flow(engine, transport, 1)
    wall = time.perf_counter() - t0
    client, cpu = _worker_times()  # this process: the ground truth (and in-process devices)
    if dask is not None:
        per_worker = dask.run(_worker_times).values()
        client += sum(w for w, _ in per_worker)
        cpu += sum(c for _, c in per_worker)
    transport.close()
    return {"startup": startup, "round": wall, "client": client, "cpu": cpu}


class _TimedLearner:
    """A learner proxy that adds the wall and thread-CPU seconds of every ``fit`` and
    ``predict`` to a per-process file (Ray actors are other processes)."""

    def __init__(self, inner, timing_dir: str) -> None:
        self.inner, self.timing_dir = inner, timing_dir

    def _timed(self, fn, *args):
        import json

        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args)
        finally:
            f = Path(self.timing_dir) / f"{os.getpid()}.json"
            w, c = json.loads(f.read_text()) if f.exists() else (0.0, 0.0)
            f.write_text(json.dumps([w + time.perf_counter() - t0, c + time.thread_time() - c0]))

    def fit(self, *args):
        return self._timed(self.inner.fit, *args)

    def predict(self, *args):
        return self._timed(self.inner.predict, *args)


def run_flower(cfg, cfg_path: Path) -> dict[str, float]:
    """The ``clma.flower.CLMA`` strategy (round engine) and the CLMA ClientApp over the
    digits learner, in Flower's simulation engine; client time from the learners."""
    import json

    import ray
    from flwr.app import ArrayRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from clma.engine import make_cohorter
    from clma.flower import CLMA
    from clma.flower.clientapp import make_client_app
    from clma.sim.federation import build_federation

    timing_dir = tempfile.mkdtemp(prefix="bench-flower-timing-")
    learners: dict[int, object] = {}

    def learner(context: Context):
        import torch

        from clma.sim.demo import digits_learner

        torch.set_num_threads(1)
        pid = int(context.node_config["partition-id"])
        if pid not in learners:
            learners[pid] = _TimedLearner(digits_learner(cfg, pid), timing_dir)
        return learners[pid]

    capp = make_client_app(learner)
    out: dict[str, float] = {}
    sapp = ServerApp()

    @sapp.main()
    def main(grid: Grid, context: Context) -> None:
        assets = build_federation(cfg).assets()
        strategy = CLMA(config=cfg, assets=assets, cohorter=make_cohorter(cfg),
                        min_available_nodes=cfg.clients)
        initial = ArrayRecord(assets.model_spec.build(seed=cfg.seed).state_dict())
        t0 = time.perf_counter()
        strategy.start(grid=grid, initial_arrays=initial, num_rounds=1)
        out["round"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    try:
        run_simulation(server_app=sapp, client_app=capp, num_supernodes=cfg.clients,
                       backend_config={"client_resources": {"num_cpus": 1},
                                       "init_args": {"num_cpus": SLOTS,
                                                     "include_dashboard": False}})
    finally:
        if ray.is_initialized():
            ray.shutdown()
    out["startup"] = time.perf_counter() - t0 - out.get("round", 0.0)
    times = [json.loads(f.read_text()) for f in Path(timing_dir).glob("*.json")]
    out["client"] = float(sum(w for w, _ in times))
    out["cpu"] = float(sum(c for _, c in times))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="20 clients")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", default="prefect-threads,prefect-dask,flower-ray")
    args = ap.parse_args(argv)
    n = 20 if args.quick else args.clients
    _env()
    import logging

    import torch
    from prefect.testing.utilities import prefect_test_harness

    torch.set_num_threads(1)
    _patch_tasks()
    tmp = Path(tempfile.mkdtemp(prefix="bench-scale-out-"))
    cfg = bench_config(n, args.seed, tmp / "bench.toml")
    rows: dict[str, dict[str, float]] = {}
    engines = args.engines.split(",")
    logging.getLogger("flwr").setLevel(logging.WARNING)
    if any(e.startswith("prefect") for e in engines):
        t0 = time.perf_counter()
        with prefect_test_harness(server_startup_timeout=180):
            api = time.perf_counter() - t0
            if "prefect-threads" in engines:
                rows["prefect-threads"] = run_prefect(cfg, None)
                rows["prefect-threads"]["startup"] += api
            if "prefect-dask" in engines:
                rows["prefect-dask"] = run_prefect(cfg, 2)
                rows["prefect-dask"]["startup"] += api
    if "flower-ray" in engines:
        rows["flower-ray"] = run_flower(cfg, tmp / "bench.toml")
    print(f"\nOne round, {n} clients (digits, MLP {cfg.model.hidden}, "
          f"{cfg.training.local_epochs} local epochs), seed {args.seed}; slots = {SLOTS}")
    print(f"{'engine':<17}{'startup s':>10}{'round s':>10}{'client wall s':>14}"
          f"{'client cpu s':>13}{'overhead s':>12}{'overhead %':>11}")
    for name, r in rows.items():
        over = r["round"] - r["cpu"] / SLOTS
        print(f"{name:<17}{r['startup']:>10.2f}{r['round']:>10.2f}{r['client']:>14.2f}"
              f"{r['cpu']:>13.2f}{over:>12.2f}{100 * over / r['round']:>10.1f}%")
    print("client wall/cpu = wall / thread CPU time inside the client functions (devices' "
          "training + ground-truth evaluation), summed over calls (wall includes waiting for "
          "the CPU or the GIL: threads inflate it); overhead = round - client cpu / slots")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
