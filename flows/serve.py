"""Recurring rounds: the federation as a Prefect deployment with a schedule.

``clma serve`` (or :func:`serve_federation`) registers :func:`scheduled_federation_flow`
as a deployment with the config's schedule (``schedule.cron`` or
``schedule.interval_seconds``) through the flow's own ``serve`` API and keeps serving it:
every scheduled run -- or a manual ``prefect deployment run
'clma-scheduled-federation/<name>'`` -- loads the federation's durable state
(``state.dir``, default ``state/<name>``), advances it by ``schedule.rounds_per_run``
rounds (never beyond ``rounds``) and commits the state after each round. A run that finds
the federation complete runs no round. At most one run at a time (``limit=1``; the state
directory's lock refuses a second one anyway).

It needs a Prefect API that outlives the command: a server (``infra/prefect-server.sh
start`` and ``PREFECT_API_URL``). With ``federation.transport = "flower"`` each scheduled
run submits the federation's ServerApp with ``flwr run`` (:mod:`flows.flower_launch`) and
waits for it; the rounds then run as a flow inside the ServerApp (a separate flow run on
the same Prefect API). For work pools instead of a serving process, see
``infra/prefect.yaml`` (same flow, same parameters).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from clma.config import FederationConfig, load_config
from clma.state import default_state_dir

__all__ = [
    "DEPLOYMENT_FLOW",
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


@flow(name=DEPLOYMENT_FLOW, flow_run_name="advance-{rounds_per_run}")
def scheduled_federation_flow(
    config_path: str | None = None,
    state_dir: str | None = None,
    rounds_per_run: int | None = None,
    out_dir: str | None = None,
) -> dict[str, Any]:
    """Advance the federation in ``state_dir`` by ``rounds_per_run`` rounds (None: the
    config's ``schedule.rounds_per_run``); writes ``summary.json`` to ``out_dir``
    (default ``<state_dir>/out``) and returns the summary."""
    from flows.federation import federation_flow

    cfg, sdir = resolve(config_path, state_dir)
    n = int(rounds_per_run) if rounds_per_run is not None else cfg.schedule.rounds_per_run
    if n < 1:
        raise ValueError("rounds_per_run: must be a positive integer")
    out = out_dir or str(sdir / "out")
    if cfg.transport == "flower":  # real clients: the flow runs inside a Flower ServerApp
        from flows.flower_launch import launch

        res = launch(cfg, out_dir=out, state_dir=str(sdir), resume=None, max_new_rounds=n,
                     quiet=True)
        if res.summary is None:
            raise RuntimeError(f"Flower run {res.flower_run_id} ended {res.status}: "
                               f"{res.details} (log: {res.log})")
        return res.summary
    return federation_flow(cfg, out_dir=out, state_dir=str(sdir), max_new_rounds=n)


def serve_federation(
    config_path: str | None = None,
    state_dir: str | None = None,
    *,
    name: str | None = None,
    cron: str | None = None,
    interval_seconds: int | None = None,
    rounds_per_run: int | None = None,
) -> None:
    """Register the deployment with its schedule and serve it until SIGTERM (blocking).

    Schedule: ``cron`` / ``interval_seconds`` arguments, else the config's ``schedule``;
    with neither, the deployment has no schedule and runs only when triggered. Paths are
    made absolute so the served runs find them whatever their working directory.
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
    scheduled_federation_flow.serve(
        name=name or cfg.name,
        cron=cron,
        interval=interval_seconds,
        parameters=params,
        description=f"Advance federation {cfg.name!r} by {params['rounds_per_run']} round(s) "
                    f"per run from its durable state in {params['state_dir']}.",
        tags=["clma"],
        limit=1,
        pause_on_shutdown=False,
    )

