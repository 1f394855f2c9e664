"""The ServerApp of a federation on real clients: the Prefect flow inside Flower's run.

``clma run`` with ``[federation] transport = "flower"`` writes a job file (the validated
config, the out / state folders, the working directory and the environment the flow needs:
MLflow tracking URI, Prefect API or home, ...) and submits the app folder
``flows/flower_app`` to the SuperLink with ``flwr run`` (:mod:`flows.flower_launch`).
Flower starts this ServerApp on the SuperLink's host; :func:`main` reads the job, opens
the Flower transport over the run's grid (:class:`clma.flower.transport.FlowerTransport`,
its exchange journal in the federation's state folder) and runs
:func:`flows.federation.federation_flow` with it: the same named Prefect tasks, ledger,
borrow gate (the flow pauses inside this process), durable state, MLflow lineage and
dashboards as a simulation. The job folder receives ``result.json`` (status, Flower run
id, summary path) and ``rounds.jsonl`` (one line per round, for the launcher's progress).

Job files are server-side: the SuperNodes only see the run config's ``config-json``
(:func:`device_config`: what a device needs to build its learner).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

__all__ = ["JOB_FORMAT", "Job", "app", "device_config", "load_job", "server_assets"]

JOB_FORMAT = "clma.flower-job/1"


@dataclass
class Job:
    """One ``clma run`` of a federation on real clients (server side).

    ``config``: the validated config as JSON data; ``out_dir`` / ``state_dir``: absolute
    folders (``state_dir`` None: no durable state); ``resume`` / ``max_new_rounds``: as
    :func:`flows.federation.federation_flow`'s; ``cwd``: the launcher's working directory
    (relative paths of the config resolve there); ``env``: variables the flow needs
    (``MLFLOW_TRACKING_URI``, ``PREFECT_*``, fault-injection switches of the tests);
    ``job_dir``: where ``result.json`` and ``rounds.jsonl`` go.
    """

    config: dict[str, Any]
    out_dir: str
    cwd: str
    job_dir: str
    state_dir: str | None = None
    resume: bool | None = None
    max_new_rounds: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    format: str = JOB_FORMAT

    def write(self) -> Path:
        p = Path(self.job_dir) / "job.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(asdict(self), indent=1, sort_keys=True) + "\n", "utf-8")
        return p


def load_job(path: str | os.PathLike) -> Job:
    """Read a job file. Raises ValueError naming what is wrong."""
    try:
        doc = json.loads(Path(path).read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"run config 'job': {path!r} is not a readable job file ({exc})") from None
    if doc.get("format") != JOB_FORMAT:
        raise ValueError(f"run config 'job': {path!r} is not a {JOB_FORMAT} file")
    return Job(**doc)


def device_config(config: Any) -> dict[str, Any]:
    """What a SuperNode's learner needs of the config (seed, clients, data, drift, model,
    training), as JSON data; server-side sections (paths, budget, tracking, state) are left
    at their defaults, the region partition file and the probe file stay on the server and
    so do ``model.weights`` (a device's model is overwritten by the vector it receives)."""
    d = config.model_dump(mode="json")
    keep = {k: d[k] for k in ("name", "seed", "rounds", "clients", "drift", "model", "training")}
    keep["data"] = {**d["data"], "region_partition": None, "probe": None}
    keep["model"] = {**d["model"], "weights": None}
    return keep


def server_assets(config: Any) -> Any:
    """The server's public assets for real clients (:func:`clma.engine.assets.
    deployment_assets`): the configured model factory (or the built-in MLP of the reference
    data set), its initial weights, the probe set and the region partition; the same
    assets as a simulation of the same config, without building one."""
    from clma.engine.assets import deployment_assets

    return deployment_assets(config)


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", "utf-8")
    os.replace(tmp, path)


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the federation flow of the job named by the run config over ``grid``."""
    job = load_job(str(context.run_config.get("job", "")))
    os.chdir(job.cwd)
    os.environ.update(job.env)  # before prefect / mlflow are imported
    jobdir = Path(job.job_dir)
    run_id = getattr(getattr(grid, "run", None), "run_id", None)
    result: dict[str, Any] = {"status": "running", "flower_run_id": run_id, "pid": os.getpid(),
                              "started_at": time.time()}
    _write_json(jobdir / "result.json", result)
    try:
        from clma.config import validate_config
        from clma.flower.transport import FlowerTransport, check_noise_source
        from flows.federation import federation_flow
        from flows.transport import Transport

        cfg = validate_config(job.config)
        noise = check_noise_source(cfg)
        assets = server_assets(cfg)
        from clma.models.checks import model_layout

        clients = FlowerTransport(grid, cfg, state_dir=job.state_dir,
                                  partition=assets.partition, n_params=assets.n_params,
                                  model_layout=model_layout(assets.model_spec.build()))
        transport = Transport("flower", clients, assets, executor="flower-deployment",
                              details={"flower_run_id": str(run_id) if run_id is not None
                                       else None, "superlink": cfg.flower.superlink,
                                       "noise_source": noise})

        def on_round(rec: Any) -> None:
            with open(jobdir / "rounds.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps({"round": rec.round, "cohorts": len(rec.cohorts),
                                    "seconds": rec.seconds}) + "\n")

        federation_flow(cfg, out_dir=job.out_dir, state_dir=job.state_dir, resume=job.resume,
                        max_new_rounds=job.max_new_rounds, on_round=on_round,
                        transport=transport)
        result.update(status="completed", summary=str(Path(job.out_dir) / "summary.json"))
    except BaseException as exc:
        result.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:2000])
        raise
    finally:
        result["finished_at"] = time.time()
        _write_json(jobdir / "result.json", result)
