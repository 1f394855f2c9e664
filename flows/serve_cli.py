"""``clma serve`` command line (kept apart from :mod:`flows.serve` so that building the
``clma`` parser does not import Prefect before the CLI has set its quiet defaults)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["add_serve_parser", "cli_serve"]


def add_serve_parser(sub: Any) -> None:
    """The ``clma serve`` sub-command (argparse sub-parsers ``sub``)."""
    sv = sub.add_parser(
        "serve", help="serve the federation as a scheduled Prefect deployment",
        description="Register the federation as a Prefect deployment with a schedule (the "
        "config's [schedule] cron or interval_seconds, or --cron/--interval) and serve it "
        "until SIGTERM: each run advances the federation by rounds_per_run rounds from its "
        "durable state. Needs a Prefect server: PREFECT_API_URL (infra/prefect-server.sh).",
    )
    sv.add_argument("--config", type=Path, default=None,
                    help="TOML config (default: the one stored in the state dir, else embedded)")
    sv.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                    help="durable state (default: state.dir or state/<name>)")
    sv.add_argument("--name", default=None, help="deployment name (default: the federation name)")
    trig = sv.add_mutually_exclusive_group()
    trig.add_argument("--cron", default=None, help="cron schedule, e.g. '0 * * * *'")
    trig.add_argument("--interval", type=int, default=None, metavar="SECONDS",
                      help="interval schedule in seconds")
    sv.add_argument("--rounds-per-run", type=int, default=None,
                    help="rounds per scheduled run (default: schedule.rounds_per_run)")


def cli_serve(args: Any) -> int:
    """``clma serve``: validate, then serve (blocks until SIGTERM). Exit 2 on bad input."""
    import os
    import sys

    import httpx

    from clma.config import ConfigError, ScheduleConfig
    from clma.state import StateError
    from flows.serve import DEPLOYMENT_FLOW, resolve, serve_federation

    if not os.environ.get("PREFECT_API_URL"):
        print("clma serve: PREFECT_API_URL is not set; start a server "
              "(infra/prefect-server.sh start) and export PREFECT_API_URL", file=sys.stderr)
        return 2
    try:
        if args.rounds_per_run is not None and args.rounds_per_run < 1:
            raise ConfigError("--rounds-per-run: must be a positive integer")
        if args.interval is not None and args.interval < 1:
            raise ConfigError("--interval: must be a positive number of seconds")
        if args.cron is not None:
            try:
                ScheduleConfig(cron=args.cron)
            except ValueError:
                raise ConfigError("--cron: must have 5 (or 6) space-separated fields") from None
        cfg, sdir = resolve(None if args.config is None else str(args.config),
                            None if args.state_dir is None else str(args.state_dir))
    except (ConfigError, StateError) as exc:
        print(f"clma serve: {exc}", file=sys.stderr)
        return 2
    cron = args.cron if args.cron or args.interval else cfg.schedule.cron
    interval = args.interval if args.cron or args.interval else cfg.schedule.interval_seconds
    every = (f"cron {cron!r}" if cron else f"every {interval} s" if interval
             else "no schedule: runs only when triggered")

    def ready(dep_name: str, deployment_id: Any) -> None:
        print(f"clma serve: serving deployment '{DEPLOYMENT_FLOW}/{dep_name}' ({every}; "
              f"state {sdir}); SIGTERM or Ctrl-C stops it and pauses the schedule.\n"
              f"clma serve: trigger a run now: prefect deployment run "
              f"'{DEPLOYMENT_FLOW}/{dep_name}'", file=sys.stderr, flush=True)

    try:
        outcome = serve_federation(None if args.config is None else str(args.config),
                                   str(sdir), name=args.name, cron=args.cron,
                                   interval_seconds=args.interval,
                                   rounds_per_run=args.rounds_per_run, on_ready=ready)
    except (ConfigError, StateError, ValueError) as exc:  # ServeLocked names the holder
        print(f"clma serve: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:  # the Prefect API is down or refused us
        print(f"clma serve: the Prefect API at {os.environ['PREFECT_API_URL']} cannot be "
              f"reached ({type(exc).__name__}: {exc}); is the server running "
              "(infra/prefect-server.sh status)?", file=sys.stderr)
        return 2
    if outcome == "complete":
        print(f"clma serve: federation {cfg.name!r} is complete (all {cfg.rounds} rounds "
              f"committed in {sdir}); nothing to serve, its deployment stays paused. To go "
              "on, raise `rounds` in the config and serve again.", file=sys.stderr)
        return 0
    print("clma serve: stopped; the deployment is paused", file=sys.stderr)
    return 0
