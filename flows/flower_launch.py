"""``clma run`` on real clients: submit the federation's ServerApp to a SuperLink with
``flwr run`` and follow it to the end.

:func:`launch` (design (a) of docs/operating.md, "Real clients"):

1. writes the job (:class:`flows.flower_serverapp.Job`: the validated config, absolute out
   and state folders, the working directory, the environment of the flow -- MLflow
   tracking URI, Prefect API URL or home, quiet Prefect defaults, the tests' failpoints) in
   a fresh job folder, and a private Flower home whose ``config.toml`` has one SuperLink
   connection, ``clma``, from ``[federation.flower]`` (address, TLS or insecure, root
   certificates);
2. ``flwr run <app_dir> clma --run-config <file> --format json`` -- the run config holds
   the job's path (server side), ``config-json`` (:func:`flows.flower_serverapp.device_config`,
   what the devices need), ``model-spec`` (:func:`clma.models.checks.spec_to_json`: the
   architecture every device builds) and ``federation-id`` (:func:`federation_id`: devices
   keep one state per federation); prints the Flower run id;
3. streams the run's log (``flwr log <id> clma --stream``) to stderr unless quiet, and
   keeps it in ``<out>/flower/run-<id>.log``;
4. waits: the ServerApp writes ``result.json`` when the flow ends; ``flwr ls`` gives the
   run's status (``finished:completed`` / ``finished:failed`` / ``finished:stopped``), also
   when the ServerApp died without a word.

The ServerApp runs on the SuperLink's host, so the out / state folders and the MLflow
store named here are paths of that host: run ``clma run`` there (or on a machine sharing
those paths). Interrupting ``clma run`` stops the Flower run (``flwr stop``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["FlowerLaunchError", "LaunchResult", "app_dir", "federation_id", "launch"]

CONNECTION = "clma"
#: Environment variables the flow inside the ServerApp receives from ``clma run``.
FORWARDED_ENV = ("PREFECT_API_URL", "PREFECT_LOGGING_LEVEL", "PREFECT_SERVER_LOGGING_LEVEL",
                 "PREFECT_SERVER_ANALYTICS_ENABLED", "DO_NOT_TRACK",
                 "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW",
                 "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "CLMA_FAILPOINT",
                 "CLMA_FLOWER_FAILPOINT")
FLWR_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}


class FlowerLaunchError(RuntimeError):
    """The Flower run could not be started or did not complete (the message says why)."""


@dataclass
class LaunchResult:
    """``flower_run_id``; ``status`` as Flower reports it; ``summary`` (None unless the
    flow completed); ``log``: the run's log file."""

    flower_run_id: str
    status: str
    summary: dict[str, Any] | None
    log: Path
    details: str = ""


def federation_id(config: Any, state_dir: str | os.PathLike | None) -> str:
    """The id devices key their state by: the same for every run of a federation with a
    state folder (its resolved path and the config's resume fingerprint), a fresh one for a
    run without (it cannot be resumed)."""
    import hashlib
    import uuid

    from clma.state import resume_fingerprint

    if state_dir is None:
        return uuid.uuid4().hex[:24]
    key = f"{Path(state_dir).resolve()}|{resume_fingerprint(config)}"
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def app_dir(config: Any) -> Path:
    """The Flower app to run: ``federation.flower.app_dir`` or ``flows/flower_app``."""
    d = config.flower.app_dir
    return Path(d).resolve() if d else Path(__file__).resolve().parent / "flower_app"


def _flwr() -> str:
    exe = Path(sys.executable).with_name("flwr")
    if exe.exists():
        return str(exe)
    found = shutil.which("flwr")
    if found is None:
        raise FlowerLaunchError("federation.transport = 'flower' needs Flower's CLI: install "
                                "flwr (pip install 'flwr[simulation]==1.42.0')")
    return found


def _toml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid TOML basic string


def _flower_home(root: Path, config: Any) -> Path:
    fl = config.flower
    lines = ["[superlink]", f'default = "{CONNECTION}"', "", f"[superlink.{CONNECTION}]",
             f"address = {_toml_str(fl.superlink)}", f"insecure = {'true' if fl.insecure else 'false'}"]
    if fl.root_certificates:
        ca = Path(fl.root_certificates).resolve()
        if not ca.is_file():
            raise FlowerLaunchError(f"federation.flower.root_certificates: {str(ca)!r} is not "
                                    "a readable file")
        lines.append(f"root-certificates = {_toml_str(str(ca))}")
    home = root / "flwr-home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text("\n".join(lines) + "\n", "utf-8")
    return home


def _cli_env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(FLWR_ENV, FLWR_HOME=str(home))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _json_of(text: str) -> dict[str, Any]:
    start = text.find("{")
    try:
        return json.loads(text[start:]) if start >= 0 else {}
    except ValueError:
        return {}


def _status(flwr: str, env: dict[str, str], run_id: str) -> tuple[str, str]:
    r = subprocess.run([flwr, "ls", CONNECTION, "--run-id", run_id, "--format", "json"],
                       env=env, capture_output=True, text=True, timeout=120)
    runs = _json_of(r.stdout).get("runs") or []
    if not runs:
        return "unknown", r.stdout[-300:] + r.stderr[-300:]
    return str(runs[0].get("status", "unknown")), str(runs[0].get("status-details", ""))


def _stream(flwr: str, env: dict[str, str], run_id: str, log: Path, quiet: bool
            ) -> tuple[subprocess.Popen, threading.Thread]:
    proc = subprocess.Popen([flwr, "log", run_id, CONNECTION, "--stream"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)

    def pump() -> None:
        with open(log, "a", encoding="utf-8") as f:
            for line in proc.stdout:  # type: ignore[union-attr]
                f.write(line)
                f.flush()
                if not quiet:
                    sys.stderr.write(line)

    t = threading.Thread(target=pump, name="flwr-log", daemon=True)
    t.start()
    return proc, t


def _stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def launch(config: Any, *, out_dir: str | os.PathLike, state_dir: str | os.PathLike | None,
           resume: bool | None = None, max_new_rounds: int | None = None,
           quiet: bool = False, on_round: Callable[[dict[str, Any]], None] | None = None,
           on_start: Callable[[str], None] | None = None) -> LaunchResult:
    """Run the federation on the SuperLink of ``config.flower`` (module docstring).

    Raises:
        FlowerLaunchError: Flower's CLI is missing, the app folder or the root certificates
            are not there, or the SuperLink refused the run.
    """
    from clma.flower.transport import check_noise_source

    check_noise_source(config)  # refused here, before anything is submitted
    app = app_dir(config)
    if not (app / "pyproject.toml").is_file():
        raise FlowerLaunchError(f"federation.flower.app_dir: {str(app)!r} has no pyproject.toml "
                                "(a Flower app folder)")
    flwr = _flwr()
    out = Path(out_dir).resolve()  # created once the SuperLink took the run
    root = Path(tempfile.mkdtemp(prefix="clma-flower-job-"))
    try:
        run_id, cli_env = _submit(config, app, flwr, root, out, state_dir, resume,
                                  max_new_rounds)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)  # nothing of a refused run stays behind
        raise
    out.mkdir(parents=True, exist_ok=True)
    if on_start is not None:
        on_start(run_id)
    return _follow(flwr, cli_env, run_id, root, out, quiet, on_round)


def _submit(config: Any, app: Path, flwr: str, root: Path, out: Path,
            state_dir: str | os.PathLike | None, resume: bool | None,
            max_new_rounds: int | None) -> tuple[str, dict[str, str]]:
    """Write the job into ``root`` and submit it with ``flwr run``: (run id, CLI env)."""
    from clma.models.checks import model_spec_of, spec_to_json
    from flows.flower_serverapp import Job, device_config
    from tasks.tracking import default_tracking_uri

    env: dict[str, str] = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    env["PREFECT_HOME"] = str(Path(os.environ.get("PREFECT_HOME", "~/.prefect")).expanduser()
                              .resolve())
    if config.tracking.enabled:
        env["MLFLOW_TRACKING_URI"] = default_tracking_uri()
    job = Job(config=config.model_dump(mode="json"), out_dir=str(out), cwd=os.getcwd(),
              job_dir=str(root), state_dir=None if state_dir is None
              else str(Path(state_dir).resolve()), resume=resume,
              max_new_rounds=max_new_rounds, env=env)
    job_path = job.write()
    run_cfg = root / "run-config.toml"
    run_cfg.write_text(f"job = {_toml_str(str(job_path))}\n"
                       f"config-json = {_toml_str(json.dumps(device_config(config)))}\n"
                       f"model-spec = {_toml_str(spec_to_json(model_spec_of(config)))}\n"
                       f"federation-id = {_toml_str(federation_id(config, state_dir))}\n",
                       "utf-8")
    cli_env = _cli_env(_flower_home(root, config))
    r = subprocess.run([flwr, "run", str(app), CONNECTION, "--run-config", str(run_cfg),
                        "--format", "json"], env=cli_env, capture_output=True, text=True,
                       timeout=600)
    doc = _json_of(r.stdout)
    run_id = str(doc.get("run-id") or "")
    if r.returncode != 0 or not doc.get("success") or not run_id:
        why = doc.get("error-message") or (r.stderr or r.stdout).strip()[-800:]
        raise FlowerLaunchError(f"flwr run on {config.flower.superlink} failed: {why}")
    return run_id, cli_env


def _follow(flwr: str, cli_env: dict[str, str], run_id: str, root: Path, out: Path,
            quiet: bool, on_round: Callable[[dict[str, Any]], None] | None) -> LaunchResult:
    """Follow Flower run ``run_id`` to its end (module docstring, steps 3 and 4)."""
    logs = out / "flower"
    logs.mkdir(exist_ok=True)
    log = logs / f"run-{run_id}.log"
    streamer, pump = _stream(flwr, cli_env, run_id, log, quiet)
    seen_rounds = 0
    status, details = "running", ""
    try:
        last_ls, unknown = 0.0, 0
        result: dict[str, Any] = {}
        while True:
            time.sleep(1.0)
            rounds = root / "rounds.jsonl"
            if rounds.exists():
                lines = rounds.read_text("utf-8").splitlines()
                for line in lines[seen_rounds:]:
                    if on_round is not None:
                        on_round(json.loads(line))
                seen_rounds = len(lines)
            try:
                result = json.loads((root / "result.json").read_text("utf-8"))
            except (OSError, ValueError):
                result = {}
            ended = result.get("status") in ("completed", "failed")
            if ended or time.monotonic() - last_ls > 30:
                last_ls = time.monotonic()
                status, details = _status(flwr, cli_env, run_id)
                if status.startswith("finished"):
                    break
                unknown = unknown + 1 if status == "unknown" else 0
                if ended and time.time() - float(result.get("finished_at", 0)) > 120:
                    break  # the ServerApp said it ended; do not wait forever for Flower
                if unknown > 20:  # ~10 minutes without an answer from the SuperLink
                    details = f"the SuperLink stopped answering about run {run_id}"
                    break
    except KeyboardInterrupt:
        subprocess.run([flwr, "stop", run_id, CONNECTION], env=cli_env, capture_output=True,
                       timeout=120)
        raise
    finally:
        time.sleep(2.0)  # the last log lines
        _stop_group(streamer)
        pump.join(timeout=5)
    for _ in range(30):  # Flower may say "finished" before we read the ServerApp's last word
        try:
            result = json.loads((root / "result.json").read_text("utf-8"))
        except (OSError, ValueError):
            result = {}
        if result.get("status") != "running" or not status.startswith("finished"):
            break
        time.sleep(1.0)
    summary = None
    if result.get("status") == "completed":
        try:
            summary = json.loads((out / "summary.json").read_text("utf-8"))
        except (OSError, ValueError):
            summary = None
    if result.get("error"):
        details = f"{details} {result['error']}".strip()
    shutil.rmtree(root, ignore_errors=True)
    return LaunchResult(run_id, status, summary, log, details)
