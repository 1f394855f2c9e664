"""The ``clma`` command line.

``clma run`` runs a federation on the embedded default (local Prefect without a server,
local MLflow store) and writes ``OUT/summary.json``. Invalid configuration fails before
any training with one message naming the field (exit code 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["main", "build_parser"]


def _quiet_prefect_defaults() -> None:
    """Quiet, analytics-free Prefect unless the user configured otherwise.

    Must run before ``import prefect``.
    """
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "CRITICAL")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "true")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    # The temporary local API needs ~10 s on an idle 2-core machine; Prefect's default
    # (20 s) is too tight when the machine is busy.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


def _prefect_home_refused() -> bool:
    """True (after printing why) when the local Prefect database was written by another
    Prefect (:mod:`flows.prefect_home`): refused at once instead of a 120 s time-out."""
    _quiet_prefect_defaults()
    from flows.prefect_home import PrefectDatabaseError, check_local_database

    try:
        check_local_database()
    except PrefectDatabaseError as exc:
        print(f"clma: {exc}", file=sys.stderr)
        return True
    return False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="clma",
        description="Drift-aware federated learning (CLMA) with private federated monitoring.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a federation (Prefect flow, tracked in MLflow)")
    run.add_argument("--config", type=Path, default=None, help="TOML config (default: embedded)")
    run.add_argument("--rounds", type=int, default=None, help="override the number of rounds")
    run.add_argument("--clients", type=int, default=None, help="override the number of clients")
    run.add_argument("--seed", type=int, default=None, help="override the seed")
    run.add_argument("--out", type=Path, default=Path("runs/latest"),
                     help="output folder for summary.json (default: runs/latest)")
    run.add_argument("--no-tracking", action="store_true", help="do not log to MLflow")
    run.add_argument("--quiet", action="store_true", help="no progress display or table")
    run.add_argument("--resume", type=Path, default=None, metavar="STATE_DIR",
                     help="continue the federation whose durable state is in STATE_DIR (its "
                     "stored config unless --config is given; --rounds may raise the total)")
    run.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                     help="keep durable state in DIR (a new federation; continue it later with "
                     "--resume DIR)")

    from flows.serve_cli import add_serve_parser

    add_serve_parser(sub)  # clma serve: the federation as a scheduled Prefect deployment

    appr = sub.add_parser(
        "approve", help="sign and answer a paused privacy-budget borrow request",
        description="Sign your decision on a flow run paused at the budget-borrow approval "
        "gate with your Ed25519 key (clma keygen) and resume it. RUN_ID is the paused approval "
        "run (or the federation/round run above it). The signature binds the federation, run, "
        "epoch, line, epsilon and nonce of the request to your decision and reason. Uses the "
        "Prefect API of PREFECT_API_URL (PREFECT_API_AUTH_STRING for an authenticated server), "
        "or of PREFECT_HOME when no server is configured.",
    )
    appr.add_argument("run_id", metavar="RUN_ID", help="flow run id (UUID)")
    appr.add_argument("--approver", required=True, help="your name, as on the policy's allow-list")
    appr.add_argument("--key", required=True, type=Path, metavar="FILE",
                      help="your private key file (written by clma keygen; mode 0600)")
    appr.add_argument("--reason", required=True, help="why (signed; recorded in the ledger and MLflow)")
    appr.add_argument("--deny", action="store_true", help="refuse the borrow (default: approve)")
    appr.add_argument("--token-only", action="store_true",
                      help="print the signed token (for the Prefect UI form) and do not resume")
    appr.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                      help="how long to wait for the run to be paused (default 30)")

    keygen = sub.add_parser(
        "keygen", help="make an approver's Ed25519 key pair and print its policy entry",
        description="Write a new Ed25519 private key (PKCS#8 PEM, mode 0600; keep it outside "
        "the repository) and print the [[borrowing.approver_keys]] entry to paste into the "
        "policy file. The private key is never printed unless --print-private-key is given.",
    )
    keygen.add_argument("--approver", required=True, help="the approver's name on the allow-list")
    keygen.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="private key file (default: $CLMA_KEY_DIR or "
                        "~/.config/clma/keys, file <approver>.ed25519.pem); never overwritten")
    keygen.add_argument("--print-private-key", action="store_true",
                        help="also print the private key PEM to stdout (e.g. for a secret store)")

    from flows import experiments

    exp = sub.add_parser("experiment", help="run an experiment (see: clma experiment --help)")
    # dest must not be "experiment": experiments take --experiment (their MLflow experiment)
    exp_sub = exp.add_subparsers(dest="experiment_name", required=True)
    for name in experiments.available():
        mod = experiments.load(name)
        ep = exp_sub.add_parser(name, help=mod.DESCRIPTION, description=mod.DESCRIPTION,
                                epilog=getattr(mod, "EPILOG", None),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(ep)
    return p


def _load(args: argparse.Namespace):
    from clma.config import ConfigError, load_config

    for name in ("rounds", "clients"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ConfigError(f"--{name}: must be a positive integer")
    if args.seed is not None and not 0 <= args.seed < 2**32:
        raise ConfigError("--seed: must be in [0, 2**32)")
    if getattr(args, "resume", None) is not None and args.config is None:
        from tasks.durable import stored_config

        cfg = stored_config(args.resume) or load_config(None)  # the federation's own config
    else:
        cfg = load_config(args.config)
    cfg = cfg.with_overrides(rounds=args.rounds, clients=args.clients, seed=args.seed)
    if args.no_tracking:
        cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"enabled": False})})
    return cfg


_BAND_LABEL = {"none": "0", "below_minimum": "<m", "minimum_to_under_double": "m-2m",
               "double_to_under_fourfold": "2m-4m", "fourfold_or_more": ">=4m"}


def _band(band: str, m: int) -> str:
    """Short console label of a published count band."""
    return _BAND_LABEL.get(band, band)


def _fmt_regional(rec_regional: dict[str, Any] | None) -> str:
    """Published accuracy of one evaluation round: global, then each released region."""
    if not rec_regional:
        return "-"
    acc = rec_regional.get("metrics", {}).get("accuracy", {})
    parts = []
    glob = acc.get("global")
    if glob and glob.get("value") is not None:
        parts.append(f"global {glob['value']:.2f}±{glob['error_bar']:.2f}")
    regions = acc.get("regions", {})
    parts += [f"{r} {v['value']:.2f}±{v['error_bar']:.2f}" for r, v in regions.items()
              if v.get("value") is not None]
    if not regions:
        off = rec_regional.get("budget", {}).get("off_cadence", [])
        parts.append("regions off cadence" if off else "regions suppressed")
    return ", ".join(parts)


def _check_out(args: argparse.Namespace) -> None:
    """--out must be a folder we can create or write, checked before any training. Nothing
    is created here: a run that fails validation leaves no empty --out folder behind
    (:func:`_make_out` creates it once every check passed)."""
    from clma.config import ConfigError

    out = args.out
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r}: exists and is not a folder")
    probe = out
    while not probe.exists():  # the nearest existing ancestor decides whether mkdir can work
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"--out {str(out)!r}: cannot be created ({str(probe)!r} is not a "
                          "folder)")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if probe == out else f"cannot be created ({str(probe)!r} " \
            "is not writable)"
        raise ConfigError(f"--out {str(out)!r}: {what}")


def _make_out(args: argparse.Namespace) -> None:
    """Create --out (after validation passed)."""
    from clma.config import ConfigError

    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {str(args.out)!r}: cannot be created ({exc.strerror})") from None


def _check_state_dir(args: argparse.Namespace, cfg: Any = None) -> int:
    """Rounds already committed in --resume STATE_DIR (0 without one). Raises StateError
    when --resume names no federation, --state-dir already holds one, --rounds asks for
    fewer rounds than are committed, or --config differs from the stored federation."""
    from clma.state import StateError, config_mismatch_message, resume_fingerprint
    from tasks.durable import state_summary, stored_config

    if args.resume is not None and args.state_dir is not None:
        raise StateError("--resume and --state-dir: give one (--resume continues a federation)")
    if args.resume is not None:
        done = state_summary(args.resume)["round"]
        if done is None:
            raise StateError(f"--resume {str(args.resume)!r}: no committed federation state there")
        if args.rounds is not None and args.rounds < int(done):
            raise StateError(
                f"--rounds {args.rounds}: the federation in {str(args.resume)!r} has already "
                f"committed {int(done)} rounds; --rounds is the total, so it must be at least that")
        stored = stored_config(args.resume)
        if cfg is not None and stored is not None and (
                resume_fingerprint(cfg) != resume_fingerprint(stored)):
            raise StateError(config_mismatch_message(cfg, stored.model_dump(mode="json"),
                                                     "--config"))
        return int(done)
    if args.state_dir is not None and state_summary(args.state_dir)["round"] is not None:
        raise StateError(f"--state-dir {str(args.state_dir)!r}: already holds a federation; "
                         "continue it with --resume")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from clma.config import ConfigError
    from clma.state import StateError

    try:
        cfg = _load(args)
        done = _check_state_dir(args, cfg)
        _check_out(args)
    except (ConfigError, StateError) as exc:
        print(f"clma: {exc}", file=sys.stderr)
        return 2
    # Data-dependent checks (dataset present, enough samples per client) also fail fast.
    try:
        if cfg.transport != "flower":
            from clma.sim.federation import build_federation

            build_federation(cfg)
        else:  # the server's side only: model factory, weights, probe file, partition
            from clma.engine.assets import deployment_assets

            deployment_assets(cfg)
    except (ValueError, OSError) as exc:
        print(f"clma: invalid configuration: {exc}", file=sys.stderr)
        return 2
    if _prefect_home_refused():
        return 2
    try:
        if cfg.transport != "flower":  # on Flower, launch() creates it once the run is taken
            _make_out(args)  # only now: a run refused above leaves no --out folder
    except ConfigError as exc:
        print(f"clma: {exc}", file=sys.stderr)
        return 2

    if cfg.seeded_noise:
        print("clma: WARNING: seeded noise (evaluation.noise_seeded / training.dp.noise_seeded)"
              ": this run's releases are reproducible and NOT private", file=sys.stderr)
    _quiet_prefect_defaults()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    if cfg.transport == "flower":
        return _run_on_flower(args, cfg, done)
    from flows.federation import federation_flow

    console = Console(stderr=True, quiet=args.quiet)
    progress = Progress(
        TextColumn("[bold]federation[/bold] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=args.quiet,
    )

    def on_round(rec):
        progress.update(
            task_id,
            advance=1,
            description=f"round {rec.round}: {len(rec.cohorts)} cohorts, "
            f"{rec.flagged} flagged",
        )

    with progress:
        task_id = progress.add_task("starting", total=max(0, cfg.rounds - done))
        state_dir = args.resume if args.resume is not None else args.state_dir
        summary = federation_flow(
            cfg, out_dir=str(args.out), on_round=on_round,
            state_dir=None if state_dir is None else str(state_dir),
            resume=None if state_dir is None else args.resume is not None,
        )

    if not args.quiet:
        m = summary["federation"]["min_cohort"]
        table = Table(title=f"{cfg.name} (seed {cfg.seed})")
        for col in ("round", "cohorts (members)", "flagged", "published accuracy ± 95% bar"):
            table.add_column(col)
        for r in summary["rounds"]:
            sizes = ", ".join(f"{k}:{_band(v, m)}" for k, v in r["cohorts"].items())
            table.add_row(str(r["round"]), sizes, _band(r["flagged_clients"], m),
                          _fmt_regional(r["regional"]))
        Console().print(table)
        Console().print(f"counts of clients are bands relative to the cohort floor m = {m}")
        gt = summary["sim_truth"]
        if gt is not None:
            Console().print(
                f"simulation ground truth: ARI per drift event {gt['ari_per_drift_event']}, "
                f"stationary final accuracy {gt['stationary_final_accuracy']:.3f}, "
                f"drifted final accuracy "
                f"{gt['drifted_final_accuracy'] if gt['drifted_final_accuracy'] is None else round(gt['drifted_final_accuracy'], 3)}"
            )
        Console().print(f"summary: {args.out / 'summary.json'}  MLflow run: "
                        f"{summary['mlflow']['run_id']}  Prefect flow run: "
                        f"{summary['prefect']['flow_run_id']}")
    else:
        print(json.dumps({"summary": str(args.out / "summary.json")}))
    return 0


def _cmd_approve(args: argparse.Namespace) -> int:
    if _prefect_home_refused():
        return 2
    from flows.approval import DEFAULT_WAIT_SECONDS, ApprovalError, approve_run

    wait = DEFAULT_WAIT_SECONDS if args.wait is None else args.wait
    try:
        if not 0 <= wait <= 3600:
            raise ApprovalError("--wait: seconds in [0, 3600]")
        res = approve_run(args.run_id, args.approver, key_file=args.key, reason=args.reason,
                          approve=not args.deny, token_only=args.token_only, wait_seconds=wait)
    except ApprovalError as exc:
        print(f"clma approve: {exc}", file=sys.stderr)
        return 2
    req = res.request
    decision = "deny" if args.deny else "approve"
    print(f"clma approve: signed with {res.key_id}: {decision} federation {req['federation']!r}, "
          f"run {req['run_id']}, epoch {req['epoch']}, line {req['line']}, epsilon "
          f"{req['epsilon']!r}, nonce {req['nonce']}", file=sys.stderr)
    if args.token_only:
        print(f"clma approve: in the Prefect UI (Resume on run {res.run_id}) enter approver "
              f"{args.approver!r}, approve {'off' if args.deny else 'on'}, the same reason, and "
              "this token:", file=sys.stderr)
        print(res.token)
        return 0
    print(json.dumps({"resumed": res.run_id, "approver": args.approver, "approve": not args.deny,
                      "key_id": res.key_id, "nonce": req["nonce"]}))
    return 0


def _print_table(cfg: Any, summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{cfg.name} (seed {cfg.seed})")
    for col in ("round", "cohorts (sizes)", "flagged", "published accuracy ± 95% bar"):
        table.add_column(col)
    for r in summary["rounds"]:
        sizes = ", ".join(f"{k}:{v}" for k, v in r["cohorts"].items())
        table.add_row(str(r["round"]), sizes, str(r["flagged_clients"]),
                      _fmt_regional(r["regional"]))
    Console().print(table)


def _run_on_flower(args: argparse.Namespace, cfg: Any, done: int) -> int:
    """``clma run`` with the flower transport: the flow runs inside a Flower ServerApp
    submitted to the SuperLink (flows/flower_launch.py); this process follows the run."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from flows.flower_launch import FlowerLaunchError, launch

    console = Console(stderr=True, quiet=args.quiet)
    state_dir = args.resume if args.resume is not None else args.state_dir
    progress = Progress(TextColumn("[bold]federation[/bold] {task.description}"), BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                        disable=args.quiet)
    with progress:
        task_id = progress.add_task(f"on {cfg.flower.superlink}", total=max(0, cfg.rounds - done))

        def on_start(run_id: str) -> None:
            console.print(f"Flower run {run_id} started on {cfg.flower.superlink}")

        def on_round(r: dict[str, Any]) -> None:
            progress.update(task_id, advance=1,
                            description=f"round {r['round']}: {r['cohorts']} cohorts")

        try:
            res = launch(cfg, out_dir=args.out,
                         state_dir=None if state_dir is None else str(state_dir),
                         resume=None if state_dir is None else args.resume is not None,
                         quiet=args.quiet, on_round=on_round, on_start=on_start)
        except (FlowerLaunchError, ValueError) as exc:  # ValueError: the noise rule
            print(f"clma: {exc}", file=sys.stderr)
            return 2
    if res.summary is None or res.status != "finished:completed":
        print(f"clma: Flower run {res.flower_run_id} ended {res.status}"
              f"{': ' + res.details if res.details else ''} (log: {res.log})", file=sys.stderr)
        return 1
    if args.quiet:
        print(json.dumps({"summary": str(args.out / "summary.json"),
                          "flower_run_id": res.flower_run_id}))
        return 0
    _print_table(cfg, res.summary)
    from rich.console import Console as _Console

    _Console().print(f"summary: {args.out / 'summary.json'}  MLflow run: "
                     f"{res.summary['mlflow']['run_id']}  Prefect flow run: "
                     f"{res.summary['prefect']['flow_run_id']}  Flower run: {res.flower_run_id}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # A device install (`clma[device]`: flwr + torch + the library) has the console script
    # but no Prefect: say which install the command needs instead of a traceback.
    from importlib.util import find_spec

    if find_spec("prefect") is None:
        print(f"clma {args.command}: needs the server side (Prefect, MLflow), not installed "
              "here: pip install 'clma[server]'", file=sys.stderr)
        return 2
    if args.command == "run":
        return _cmd_run(args)
    if args.command == "serve":
        if _prefect_home_refused():
            return 2
        from flows.serve_cli import cli_serve

        return cli_serve(args)
    if args.command == "approve":
        return _cmd_approve(args)
    if args.command == "keygen":
        from flows.keys import cli_keygen

        return cli_keygen(args)
    if args.command == "experiment":
        _quiet_prefect_defaults()
        from flows import experiments

        module = experiments.load(args.experiment_name)
        # experiments that run Prefect flows need the local API; the others never start it
        if getattr(module, "USES_PREFECT", True) and _prefect_home_refused():
            return 2
        return int(module.run(args))
    raise AssertionError(f"unhandled command {args.command}")  # argparse prevents this


if __name__ == "__main__":
    sys.exit(main())
