"""Recurring rounds: the federation as a Prefect deployment with a schedule.

``clma serve`` (or :func:`serve_federation`) registers :func:`scheduled_federation_flow`
as a deployment with the config's schedule (``schedule.cron`` or
``schedule.interval_seconds``) through Prefect's ``Runner`` (what ``flow.serve`` uses) and
keeps serving it:
every scheduled run -- or a manual ``prefect deployment run
'clma-scheduled-federation/<name>'`` -- loads the federation's durable state
(``state.dir``, default ``state/<name>``), advances it by ``schedule.rounds_per_run``
rounds (never beyond ``rounds``) and commits the state after each round. Runs are named by
the rounds they advance (``<name>-rounds-3-4``) and log what they do; the run that
completes the federation (or finds it complete) logs "federation complete" and pauses the
deployment, so the schedule stops firing. At most one run at a time: the deployment's
concurrency limit is 1 (``concurrency_limit=1``, shown on the deployment; the serving process
also runs one at a time and the state directory's lock refuses a second one anyway). On
SIGTERM or SIGINT (Ctrl-C) ``clma serve`` stops cleanly and pauses the deployment, so it
shows no next run while nothing serves it. One ``clma serve`` per state directory (a lock
beside the state, released on exit and after a crash); on a complete federation it serves
nothing and leaves the deployment paused.

It needs a Prefect API that outlives the command: a server (``infra/prefect-server.sh
start`` and ``PREFECT_API_URL``). With ``federation.transport = "flower"`` each scheduled
run submits the federation's ServerApp with ``flwr run`` (:mod:`flows.flower_launch`) and
waits for it; the rounds then run as a flow inside the ServerApp (a separate flow run on
the same Prefect API). For work pools instead of a serving process, see
``infra/prefect.yaml`` (same flow, same parameters).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from prefect import flow

from clma.config import FederationConfig, load_config
from clma.state import default_state_dir

__all__ = [
    "DEPLOYMENT_FLOW",
    "advance_run_name",
    "deployment_spec",
    "pause_deployment",
    "resolve",
    "scheduled_federation_flow",
    "serve_federation",
]

DEPLOYMENT_FLOW = "clma-scheduled-federation"


def resolve(config_path: str | None, state_dir: str | None
            ) -> tuple[FederationConfig, Path]:
    """The config and state dir of a scheduled run.

    ``config_path`` None: the config stored in ``state_dir`` by an earlier run, else the
    embedded default. ``state_dir`` None: ``state.dir`` or ``state/<name>``.
    Raises :class:`clma.config.ConfigError` / :class:`clma.state.StateError`.
    """
    if config_path:
        cfg = load_config(config_path)
        return cfg, Path(state_dir) if state_dir else default_state_dir(cfg)
    if state_dir:
        from tasks.durable import stored_config

        stored = stored_config(state_dir)
        if stored is not None:
            return stored, Path(state_dir)
    cfg = load_config(None)
    return cfg, Path(state_dir) if state_dir else default_state_dir(cfg)


def _plan(config_path: str | None, state_dir: str | None, rounds_per_run: int | None
          ) -> tuple[FederationConfig, Path, int, int]:
    """(config, state dir, first round to run, last round to run); first > last: complete."""
    from tasks.durable import state_summary

    cfg, sdir = resolve(config_path, state_dir)
    n = int(rounds_per_run) if rounds_per_run is not None else cfg.schedule.rounds_per_run
    if n < 1:
        raise ValueError("rounds_per_run: must be a positive integer")
    done = state_summary(sdir)["round"] or 0
    return cfg, sdir, done + 1, min(cfg.rounds, done + n)


def advance_run_name() -> str:
    """Run name of a scheduled run: ``<federation>-rounds-<a>-<b>`` (``-round-<a>`` for one
    round), ``<federation>-complete`` when nothing is left; ``advance`` if the state cannot
    be read (the run itself then reports why)."""
    from prefect.runtime import flow_run

    p = flow_run.parameters or {}
    try:
        cfg, _, first, last = _plan(p.get("config_path"), p.get("state_dir"),
                                    p.get("rounds_per_run"))
    except Exception:  # noqa: BLE001 (a name must never fail the run)
        return "advance"
    if first > last:
        return f"{cfg.name}-complete"
    return f"{cfg.name}-round-{first}" if first == last else f"{cfg.name}-rounds-{first}-{last}"


def pause_deployment(deployment_id: Any) -> bool:
    """Pause a deployment (its schedules stop creating runs); False if the API refused."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            client.pause_deployment(deployment_id)
    except Exception:  # noqa: BLE001 (reported by the caller)
        return False
    return True


@flow(name=DEPLOYMENT_FLOW, flow_run_name=advance_run_name)
def scheduled_federation_flow(
    config_path: str | None = None,
    state_dir: str | None = None,
    rounds_per_run: int | None = None,
    out_dir: str | None = None,
) -> dict[str, Any]:
    """Advance the federation in ``state_dir`` by ``rounds_per_run`` rounds (None: the
    config's ``schedule.rounds_per_run``); writes ``summary.json`` to ``out_dir``
    (default ``<state_dir>/out``) and returns the summary. When the federation is complete
    afterwards, pauses the deployment this run belongs to."""
    from prefect.runtime import deployment

    from flows.federation import federation_flow
    from tasks.story import run_logger

    log = run_logger()
    cfg, sdir, first, last = _plan(config_path, state_dir, rounds_per_run)
    if first <= last:
        log.info(f"federation {cfg.name}: advancing rounds {first} to {last} of {cfg.rounds}")
    out = out_dir or str(sdir / "out")
    n = max(1, last - first + 1)
    if cfg.transport == "flower":  # real clients: the flow runs inside a Flower ServerApp
        from flows.flower_launch import launch

        res = launch(cfg, out_dir=out, state_dir=str(sdir), resume=None, max_new_rounds=n,
                     quiet=True)
        if res.summary is None:
            raise RuntimeError(f"Flower run {res.flower_run_id} ended {res.status}: "
                               f"{res.details} (log: {res.log})")
        summary = res.summary
    else:
        summary = federation_flow(cfg, out_dir=out, state_dir=str(sdir), max_new_rounds=n)
    if last >= cfg.rounds:
        log.info(f"federation complete: {cfg.name}, all {cfg.rounds} rounds committed")
        dep = deployment.id
        if dep:
            if pause_deployment(dep):
                log.info("deployment paused: its schedule no longer creates runs")
            else:
                log.warning("federation complete, but the deployment could not be paused; "
                            "pause it in the Prefect UI")
    else:
        log.info(f"federation {cfg.name}: rounds 1 to {last} of {cfg.rounds} committed")
    return summary


def deployment_spec(
    config_path: str | None = None,
    state_dir: str | None = None,
    *,
    name: str | None = None,
    cron: str | None = None,
    interval_seconds: int | None = None,
    rounds_per_run: int | None = None,
) -> tuple[FederationConfig, Path, str, dict[str, Any]]:
    """What :func:`serve_federation` registers: ``(config, state dir, deployment name,
    keyword arguments of Prefect's Runner.add_flow)``.

    Schedule: ``cron`` / ``interval_seconds`` arguments, else the config's ``schedule``;
    with neither, the deployment has no schedule and runs only when triggered. Paths are
    made absolute so the served runs find them whatever their working directory.
    Raises ValueError (both cron and interval), ConfigError, StateError.
    """
    cfg, sdir = resolve(config_path, state_dir)
    sched = cfg.schedule
    if cron is None and interval_seconds is None:
        cron, interval_seconds = sched.cron, sched.interval_seconds
    if cron is not None and interval_seconds is not None:
        raise ValueError("schedule: give at most one of cron and interval_seconds")
    params = {
        "config_path": str(Path(config_path).resolve()) if config_path else None,
        "state_dir": str(sdir.resolve()),
        "rounds_per_run": rounds_per_run or sched.rounds_per_run,
    }
    dep_name = name or cfg.name
    spec = {
        "name": dep_name,
        "cron": cron,
        "interval": interval_seconds,
        "parameters": params,
        "description": f"Advance federation {cfg.name!r} by {params['rounds_per_run']} "
                       f"round(s) per run from its durable state in {params['state_dir']}. "
                       "At most one run at a time (concurrency limit 1); paused when the "
                       "federation is complete or `clma serve` stops.",
        "tags": ["clma"],
        "paused": False,  # serving again resumes a deployment paused by a shutdown
        "concurrency_limit": 1,  # the deployment's concurrency limit (shown in the UI)
    }
    return cfg, sdir, dep_name, spec


def _pause_by_name(dep_name: str) -> bool:
    """Pause ``clma-scheduled-federation/<dep_name>`` if it exists; False otherwise."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            dep = client.read_deployment_by_name(f"{DEPLOYMENT_FLOW}/{dep_name}")
    except Exception:  # noqa: BLE001 (absent or API down: nothing to pause)
        return False
    return pause_deployment(dep.id)


def _run_until_signal(runner: Any, stop_timeout: float = 60.0) -> None:
    """Run Prefect's ``runner`` until SIGTERM or SIGINT (Ctrl-C), then stop it cleanly.

    The runner runs in a thread of its own, so it installs no signal handler (Prefect's
    own SIGTERM handler exits from inside the event loop and prints a traceback; its
    SIGINT path can hang); this thread waits for the signal and stops the runner with
    ``Runner.astop`` (a flow run in progress is cancelled; its round was not committed
    and is run again from the last commit by the next run). Re-raises what ended the
    runner on its own (e.g. the Prefect API went away).
    """
    import asyncio
    import signal
    import threading

    stop = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        box["loop"], box["task"] = asyncio.get_running_loop(), asyncio.current_task()
        await runner.start()

    def target() -> None:
        try:
            asyncio.run(main())
        except asyncio.CancelledError:
            pass
        except BaseException as exc:  # noqa: BLE001 (handed to the serving thread)
            box["error"] = exc

    thread = threading.Thread(target=target, name="clma-serve-runner", daemon=True)
    signals = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in signals}
    try:
        thread.start()
        while thread.is_alive() and not stop.wait(0.5):
            pass
        if thread.is_alive():
            loop = box.get("loop")
            if loop is not None:
                async def halt() -> None:
                    if runner.started:
                        await runner.astop()
                    else:
                        box["task"].cancel()

                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(halt(), loop).result(stop_timeout)
            thread.join(stop_timeout)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if "error" in box:
        raise box["error"]


def serve_federation(
    config_path: str | None = None,
    state_dir: str | None = None,
    *,
    name: str | None = None,
    cron: str | None = None,
    interval_seconds: int | None = None,
    rounds_per_run: int | None = None,
    on_ready: Any = None,
) -> str:
    """Register the deployment with its schedule and serve it until SIGTERM or SIGINT
    (blocking). Returns ``"stopped"`` after a signal, ``"complete"`` at once (nothing
    registered or served, the deployment left paused) when the federation in the state
    directory has committed all its rounds.

    One serving process per state directory (:meth:`clma.state.StateStore.serve_lock`,
    released on exit, also after a crash). ``on_ready(deployment_name, deployment_id)`` is
    called once the deployment is registered, before serving starts. On exit the deployment is paused,
    so it shows no next run while nothing serves it. Schedule and paths:
    :func:`deployment_spec`.

    Raises:
        clma.state.ServeLocked: another ``clma serve`` serves this state directory.
        ValueError, ConfigError, StateError: as :func:`deployment_spec`.
    """
    from prefect.runner import Runner

    from clma.state import StateStore

    cfg, sdir, dep_name, spec = deployment_spec(
        config_path, state_dir, name=name, cron=cron, interval_seconds=interval_seconds,
        rounds_per_run=rounds_per_run)
    with StateStore(sdir).serve_lock(f"{DEPLOYMENT_FLOW}/{dep_name}"):
        _, _, first, last = _plan(config_path, str(sdir), spec["parameters"]["rounds_per_run"])
        if first > last:  # complete: serving it would only un-pause its schedule
            _pause_by_name(dep_name)
            return "complete"
        try:
            runner = Runner(name=dep_name, pause_on_shutdown=True, limit=1)
            deployment_id = runner.add_flow(scheduled_federation_flow, **spec)
            if on_ready is not None:
                on_ready(dep_name, deployment_id)
            _run_until_signal(runner)
        finally:  # the deployment shows no next run while nothing serves it
            _pause_by_name(dep_name)
    return "stopped"
