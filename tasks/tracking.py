"""MLflow tracking of a federation: what is logged where (schema in ``mlflow/README.md``).

One MLflow run per federation, in an experiment named after the config (``name``, or
``tracking.experiment``). Params: the flattened config. Tags: seed, config fingerprint,
region-partition version and hash, Prefect flow run id, noise source. Metrics (``step`` =
round): cohorts, quarantined clients, published regional values and their (published)
error bars, and the simulation's ground-truth accuracies (names prefixed ``sim_truth.``
and the run tagged ``clma.sim_truth_metrics=true``). Artifacts: ``cohort_history.json``,
``reports/round_NNN.json`` (the published regional report), ``summary.json``.

Nothing per client is logged: no client ids, no per-client values; the cohort history
artifact holds cohort ids, parents, rounds and member counts only.

The default store is a local SQLite database under ``mlflow/store/`` (relative to the
working directory, git-ignored); ``MLFLOW_TRACKING_URI`` overrides it.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from clma.models.factory import DEFAULT_STORE, reading_tracking_uri

__all__ = ["EXPERIMENT_KIND", "default_tracking_uri", "error_bar_key", "experiment_tags",
           "metric_key", "FederationTracker"]

#: MLflow's experiment-type tag: ``custom_model_development`` opens the experiment on its
#: runs ("Model training") instead of the GenAI view MLflow 3 infers for an untyped one.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
ERROR_BAR_SUFFIX = ".error_bar"


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<cwd>/mlflow/store/mlflow.db``."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return reading_tracking_uri()
    (Path.cwd() / DEFAULT_STORE).resolve().mkdir(parents=True, exist_ok=True)
    return reading_tracking_uri()


def _artifact_location(uri: str) -> str | None:
    """A local SQLite store keeps its artifacts beside the database (``<db dir>/artifacts``)
    instead of MLflow's default ``./mlruns`` of whatever directory the run started in;
    servers and other stores keep their own artifact root (None)."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///") :]).parent / "artifacts").resolve().as_uri()
    return None


_KEY_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-. :/")


def metric_key(name: str) -> str:
    """An MLflow-valid metric name: characters MLflow rejects (e.g. the '+' of a merged
    monitoring region 'islands+west') become '_'."""
    return "".join(ch if ch in _KEY_OK else "_" for ch in name)


def error_bar_key(name: str) -> str:
    """The metric name of the published 95 % error bar of metric ``name``: ``<name>.error_bar``.

    Grouping on purpose: a value and its bar share their whole name as a prefix, so they sort
    next to each other in MLflow's metric lists and its chart search (type the value's name
    and both charts show), and every ``x.error_bar`` has its ``x``.
    """
    return f"{name}{ERROR_BAR_SUFFIX}"


def experiment_tags(experiment: str, description: str | None = None) -> dict[str, str]:
    """Tags of a new experiment: its type (:data:`EXPERIMENT_KIND`) and its description
    (``mlflow.note.content``, shown on the experiment page)."""
    note = description or (
        f"CLMA federation `{experiment}`: one run per federation (step = round), one nested "
        "run per cohort. Metrics: cohort counts, published evaluation values `x` with their "
        "95 % error bars `x.error_bar`, `sim_truth.*` only in simulations. Counts of clients "
        "are bands; no client ids. Schema: mlflow/README.md.")
    return {EXPERIMENT_KIND[0]: EXPERIMENT_KIND[1], "mlflow.note.content": note}


class FederationTracker:
    """Thin wrapper around :class:`mlflow.MlflowClient` bound to one federation run.

    Uses the client API with explicit run ids (thread-safe; no fluent global state), so
    Prefect tasks running in worker threads can log to the same run.
    """

    def __init__(self, tracking_uri: str | None = None) -> None:
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="sqlalchemy")
        from mlflow import MlflowClient

        self.tracking_uri = tracking_uri or default_tracking_uri()
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.run_id: str | None = None
        self.experiment_id: str | None = None

    def start(
        self,
        experiment: str,
        run_name: str,
        params: dict[str, str],
        tags: dict[str, str],
        parent_run_id: str | None = None,
    ) -> str:
        """Create (or reuse) the experiment and start the federation run."""
        self.open_experiment(experiment)
        all_tags = dict(tags)
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=all_tags)
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])
        return self.run_id

    def open_experiment(self, experiment: str, description: str | None = None) -> str:
        """The experiment's id, created with :func:`experiment_tags` if new; an existing
        one gets the tags it lacks (an operator's own type or description is kept)."""
        exp = self.client.get_experiment_by_name(experiment)
        wanted = experiment_tags(experiment, description)
        if exp is None:
            self.experiment_id = self.client.create_experiment(
                experiment, artifact_location=_artifact_location(self.tracking_uri),
                tags=wanted)
        else:
            self.experiment_id = exp.experiment_id
            for k, v in wanted.items():
                if k not in exp.tags:
                    self.client.set_experiment_tag(self.experiment_id, k, v)
        return self.experiment_id

    def _rid(self) -> str:
        if self.run_id is None:
            raise RuntimeError("FederationTracker.start() was not called")
        return self.run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log finite metrics at ``step`` (= round)."""
        import math
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [
            Metric(metric_key(k), float(v), ts, step)
            for k, v in sorted(metrics.items())
            if v is not None and math.isfinite(float(v))
        ]
        for i in range(0, len(items), 200):
            self.client.log_batch(self._rid(), metrics=items[i : i + 200])

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        self.client.log_dict(self._rid(), obj, artifact_file)

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        self.client.log_figure(self._rid(), figure, artifact_file)

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self._rid(), path, artifact_path)

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set ``tags`` on the run in batches of 100 (one store write each)."""
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)) for k, v in tags.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self._rid(), tags=items[i : i + 100])

    def record_prefect_run(self, flow_run_id: str | None, first_round: int) -> list[dict]:
        """Record a Prefect flow run that advances this federation (a resumed or scheduled
        federation has several): tag ``clma.prefect_flow_run.<id>`` = its first round, tag
        ``clma.prefect_flow_run_id`` = the latest, and the artifact ``prefect_flow_runs.json``
        listing them all in order. Returns that list."""
        if not flow_run_id:
            return []
        prefix = "clma.prefect_flow_run."
        self.client.set_tag(self._rid(), f"{prefix}{flow_run_id}", str(int(first_round)))
        self.client.set_tag(self._rid(), "clma.prefect_flow_run_id", flow_run_id)
        tags = self.client.get_run(self._rid()).data.tags
        runs = sorted(({"flow_run_id": k[len(prefix):], "first_round": int(v)}
                       for k, v in tags.items() if k.startswith(prefix) and v.isdigit()),
                      key=lambda d: (d["first_round"], d["flow_run_id"] != flow_run_id))
        self.log_dict({"flow_runs": runs}, "prefect_flow_runs.json")
        return runs

    def finish(self, status: str = "FINISHED") -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status=status)
