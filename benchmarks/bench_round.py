"""One full governed round, step by step, with N simulated digits clients (issue 15 item 3).

The embedded default config (``clma/configs/default.toml``) with ``clients = N``,
divergence scoring off, tracking off, the privacy ledger in a temporary folder and real
OpenDP noise (``noise_seeded`` false, the default). ``--rounds-before`` rounds (default 3)
warm the federation up untimed with :meth:`FederationEngine.run_round`, so that the
measured round (``rounds-before + 1``, default 4) is the default schedule's first drift
round: its devices flag drift, the server quarantines and cohorts them; evaluation is due
on it (``evaluation.every`` is set to the measured round when the config's cadence does
not fall on it), so it also runs the private regional evaluation: secure aggregation of
the participants' reports, the ledger's charges before noise, the releases, envelopes and
alerts. The measured round calls the engine's steps directly, each timed with
``perf_counter``: begin_round, train (the transport's ``train`` call, in chunks of
``orchestration.chunk_size``), check_replies, accept, detect_drift, score_divergence
(off: returns at once), aggregate, cohort, merge, end_training, secure_sums, evaluate,
finish. Shares are of the sum of the steps.

Digits has 1,797 images, so it cannot give 1,000 clients two samples each. Above
``--shards`` clients (default 60, the default config's client count: about 18 training
and 6 evaluation samples per client) the world is built with ``--shards`` clients and
client ``c`` gets shard ``c mod shards``'s data under its own id, its own region (the
partition's assignment of N clients) and its own drift schedule (the config's events
name clients 0-59 only). Every client thus does the default config's per-client work.

``--flower`` (default on; ``--no-flower``): the same clients, model and shards in a plain
FedAvg round on Flower's simulation engine (``flwr.simulation.run_simulation``, Ray with
2 CPUs, 1 CPU per ClientApp; ``flwr.serverapp.strategy.FedAvg``, training only): each
ClientApp trains the round's root-cohort start model on its shard exactly as the
simulated device does (``SimLearner.fit``: same data, seed and settings). Printed: the
training round's wall time (``strategy.start``, without Ray's start-up, after an identical
untimed warm-up round in which the Ray actors import torch and build the world), the seconds
spent training inside the ClientApps (summed; wall and thread CPU), and the ratio of this
project's train step to Flower's training round. If Ray cannot start, the reason is
printed and the benchmark carries on.

    .venv/bin/python benchmarks/bench_round.py                       # 1000 clients, seed 0
    .venv/bin/python benchmarks/bench_round.py --clients 20 --no-flower

Last line: ``round N: total T s, slowest STEP S s, train share P %``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SLOTS = 2  # Ray CPUs for Flower's ClientApps (the machine's 2 cores)

STEPS = ("begin_round", "train", "check_replies", "accept", "detect_drift", "score_divergence",
         "aggregate", "cohort", "merge", "end_training", "secure_sums", "evaluate", "finish")


# ---------------------------------------------------------------- the world
def bench_config(clients: int, seed: int, rounds_before: int, state_dir: Path):
    """The default config with N clients, divergence and tracking off, the ledger in
    ``state_dir`` and evaluation due on the measured round."""
    from clma.config import load_config

    measured = rounds_before + 1
    cfg = load_config(None)
    cfg = cfg.with_overrides(clients=clients, seed=seed, rounds=max(cfg.rounds, measured))
    every = cfg.evaluation.every if measured % cfg.evaluation.every == 0 else measured
    return cfg.model_copy(update={
        "divergence": cfg.divergence.model_copy(update={"enabled": False}),
        "tracking": cfg.tracking.model_copy(update={"enabled": False}),
        "evaluation": cfg.evaluation.model_copy(update={"every": every}),
        "budget": cfg.budget.model_copy(update={"state_dir": str(state_dir)}),
    })


def build_world(cfg, shards: int):
    """The simulated digits federation of ``cfg.clients`` clients; above ``shards``
    clients, client c reuses shard ``c mod shards``'s data (module docstring)."""
    from clma.sim.federation import SimClient, build_federation

    if cfg.clients <= shards:
        return build_federation(cfg)
    base = build_federation(cfg.with_overrides(clients=shards))
    regions = base.partition.assign(cfg.clients, cfg.seed)
    clients = {}
    for c in range(cfg.clients):
        src = base.clients[c % shards]
        clients[c] = SimClient(c, regions[c], src.train_x, src.train_y, src.eval_x, src.eval_y,
                               src.n_classes)
    return dataclasses.replace(base, config=cfg, clients=clients)


# ---------------------------------------------------------------- the measured round
def measured_round(engine, round_number: int) -> tuple[dict[str, float], Any, float]:
    """The round's steps one by one (what ``run_round`` does), each timed."""
    t: dict[str, float] = dict.fromkeys(STEPS, 0.0)

    def timed(step: str, fn, *a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        t[step] += time.perf_counter() - t0
        return out

    wall0 = time.perf_counter()
    ctx = timed("begin_round", engine.begin_round, round_number)
    size = max(1, engine.config.orchestration.chunk_size)
    checked = []
    for i in range(0, len(ctx.selected), size):
        # FederationEngine.train = train_request + the transport's train + check_replies
        request = timed("train", engine.train_request, ctx, ctx.selected[i:i + size])
        replies = timed("train", engine.clients.train, request)
        checked.append(timed("check_replies", engine.check_replies, request, replies))
    timed("accept", engine.accept, ctx, checked)
    timed("detect_drift", engine.detect_drift, ctx)
    timed("score_divergence", engine.score_divergence, ctx)
    timed("aggregate", engine.aggregate, ctx)
    timed("cohort", engine.cohort, ctx)
    timed("merge", engine.merge, ctx)
    timed("end_training", engine.end_training, ctx)
    if not (engine.evaluation_due(round_number) and ctx.participants):
        raise RuntimeError("evaluation is not due on the measured round")
    sums = timed("secure_sums", engine.secure_sums, ctx)
    timed("evaluate", engine.evaluate, ctx, sums)
    result = timed("finish", engine.finish, ctx)
    return t, (ctx, result), time.perf_counter() - wall0


# ---------------------------------------------------------------- Flower's FedAvg round
def _learners(cfg, shards: int):
    """This process's simulated devices, built once per process (each Ray actor). The
    cache lives on ``clma.sim.clients``, an imported module: Ray may unpickle the
    ClientApp (and this script's globals, when run as ``__main__``) for every message."""
    import clma.sim.clients as sc

    cache = sc.__dict__.setdefault("_bench_round_world", {})
    key = (cfg.fingerprint(), shards)
    if key not in cache:
        cache.clear()
        cache[key] = sc.SimulatedClients(build_world(cfg, shards)).learners
    return cache[key]


def run_flower(cfg, shards: int, spec, start_model, settings, round_number: int
               ) -> dict[str, float]:
    """One plain FedAvg training round of the same clients in Flower's simulation engine."""
    import logging

    import ray
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    from clma.flower import ArrayLayout
    from clma.params import AllParams, vector_to_model

    logging.getLogger("flwr").setLevel(logging.WARNING)
    n = cfg.clients
    capp = ClientApp()

    @capp.train()
    def train(msg: Message, context: Context) -> Message:
        import torch

        torch.set_num_threads(1)
        pid = int(context.node_config["partition-id"])
        learner = _learners(cfg, shards)[pid]
        layout = ArrayLayout.of(msg.content["arrays"])
        vec = layout.to_vector(msg.content["arrays"])
        t0, c0 = time.perf_counter(), time.thread_time()
        fit = learner.fit(vec, settings, round_number)  # the simulated device's training
        seconds, cpu = time.perf_counter() - t0, time.thread_time() - c0
        return Message(content=RecordDict({
            "arrays": layout.to_record(fit.params),
            "metrics": MetricRecord({"num-examples": int(fit.n_samples),
                                     "train-seconds": seconds, "train-cpu": cpu})}),
            reply_to=msg)

    def summed(records: list[RecordDict], weighting_key: str) -> MetricRecord:
        ms = [next(iter(r.metric_records.values())) for r in records]
        return MetricRecord({"train-seconds": float(sum(m["train-seconds"] for m in ms)),
                             "train-cpu": float(sum(m["train-cpu"] for m in ms)),
                             "replies": len(ms)})

    out: dict[str, float] = {}
    sapp = ServerApp()

    @sapp.main()
    def main(grid: Grid, context: Context) -> None:
        model = spec.build()
        vector_to_model(start_model, model, AllParams())
        for phase in ("warm", "round"):  # warm-up: the actors import torch, build the world
            strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n,
                              min_available_nodes=n, train_metrics_aggr_fn=summed)
            t0 = time.perf_counter()
            result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                                    num_rounds=1)
            out[phase] = time.perf_counter() - t0
        m = result.train_metrics_clientapp[1]
        out.update(client=m["train-seconds"], cpu=m["train-cpu"], replies=m["replies"])

    old = os.environ.get("PYTHONPATH")  # Ray's workers import clma from the worktree
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), old) if p)
    t0 = time.perf_counter()
    try:
        run_simulation(server_app=sapp, client_app=capp, num_supernodes=n,
                       backend_config={"client_resources": {"num_cpus": 1},
                                       "init_args": {"num_cpus": SLOTS,
                                                     "include_dashboard": False}})
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    if "round" not in out:
        raise RuntimeError("the Flower simulation ended without finishing its round")
    out["startup"] = time.perf_counter() - t0 - out["round"] - out.get("warm", 0.0)
    return out


# ---------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds-before", type=int, default=3,
                    help="untimed warm-up rounds (default 3: the measured round 4 is the "
                         "default schedule's first drift round)")
    ap.add_argument("--shards", type=int, default=60,
                    help="distinct data shards; clients above reuse shard c mod shards")
    ap.add_argument("--flower", action=argparse.BooleanOptionalAction, default=True,
                    help="also run a plain FedAvg round of the same clients on Flower/Ray")
    args = ap.parse_args(argv)
    if args.clients < 1 or args.rounds_before < 0 or args.shards < 1:
        ap.error("--clients and --shards must be positive, --rounds-before >= 0")

    import torch

    from clma.engine import FederationEngine, open_budget
    from clma.sim.clients import SimulatedClients

    torch.set_num_threads(1)  # as the flows: single-threaded torch per device
    measured = args.rounds_before + 1
    with tempfile.TemporaryDirectory(prefix="bench-round-") as d:
        cfg = bench_config(args.clients, args.seed, args.rounds_before, Path(d) / "ledger")
        t0 = time.perf_counter()
        world = build_world(cfg, args.shards)
        clients = SimulatedClients(world)
        engine = FederationEngine(cfg, world.assets(), clients, budget=open_budget(cfg))
        build = time.perf_counter() - t0
        t0 = time.perf_counter()
        for r in range(1, measured):
            engine.run_round(r, chunk_size=cfg.orchestration.chunk_size)
        warm = time.perf_counter() - t0
        steps, (ctx, res), wall = measured_round(engine, measured)
        shards = min(args.shards, args.clients)
        print(f"{args.clients} clients (digits, {shards} distinct shards), MLP "
              f"{cfg.model.hidden}, {cfg.training.local_epochs} local epochs, seed {args.seed}; "
              f"world built in {build:.1f} s, {args.rounds_before} warm-up rounds in "
              f"{warm:.1f} s")
        ev = res.evaluation
        print(f"round {measured}: {res.participants} participants, {res.dropouts} dropouts, "
              f"{res.flagged} flagged, {res.quarantined} quarantined, "
              f"{len(res.new_cohorts)} new cohorts, {len(res.cohorts)} active cohorts; "
              f"evaluation: {len(ev.releases) if ev is not None else 0} releases, "
              f"{len(ev.envelopes) if ev is not None else 0} envelopes "
              f"(noise seeded: {cfg.seeded_noise})")
        total = sum(steps.values())
        print(f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())} on "
              f"{os.cpu_count()} cores")
        print(f"{'step':<18}{'seconds':>10}{'share':>9}")
        for s in STEPS:
            print(f"{s:<18}{steps[s]:>10.3f}{100 * steps[s] / total:>8.1f}%")
        print(f"{'total':<18}{total:>10.3f}{100.0:>8.1f}%   (round wall {wall:.3f} s)")
        slowest = max(STEPS, key=steps.__getitem__)
        print(f"slowest step: {slowest} {steps[slowest]:.3f} s "
              f"({100 * steps[slowest] / total:.1f} %)")
        train_share = 100 * steps["train"] / total
        if args.flower:
            try:
                fl = run_flower(cfg, args.shards, world.spec, ctx.start_models[min(ctx.start_models)],
                                engine.train_settings(), measured)
            except Exception as exc:  # Ray could not start (or the simulation failed)
                print(f"flower: not run: {type(exc).__name__}: {exc}")
            else:
                print(f"client training, {args.clients} clients: this project's train step "
                      f"{steps['train']:.2f} s ({train_share:.1f} % of its round; in process, "
                      f"one after the other)")
                print(f"client training, {args.clients} clients: Flower FedAvg training round "
                      f"{fl['round']:.2f} s on Ray ({SLOTS} CPUs; {fl['replies']:.0f} replies; "
                      f"not counted: Ray start-up {fl['startup']:.1f} s and an identical "
                      f"warm-up round {fl['warm']:.1f} s), of which inside the "
                      f"ClientApps {fl['client']:.2f} s wall / {fl['cpu']:.2f} s CPU summed "
                      f"({100 * fl['cpu'] / SLOTS / fl['round']:.1f} % of the round on "
                      f"{SLOTS} slots)")
                print(f"client training ratio (ours train step / Flower training round): "
                      f"{steps['train'] / fl['round']:.3f}")
        print(f"round {args.clients}: total {total:.2f} s, slowest {slowest} "
              f"{steps[slowest]:.2f} s, train share {train_share:.1f} %")
        clients.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
