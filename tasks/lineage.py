"""Cohort lineage in MLflow: one nested run per cohort, its models, and the lineage graph.

Schema (what :class:`CohortLineageTracker` writes; no client id is ever logged):

* **Cohort run** (one per cohort, created in the round the cohort appears), nested under
  the federation run (tag ``mlflow.parentRunId``), run name ``cohort-<id>``. Tags:

  ====================================  ==================================================
  ``clma.kind``                         ``cohort``
  ``clma.cohort.id``                    the cohort's global id (``clma.cohort`` registry)
  ``clma.cohort.parents``               parent ids, comma-separated ascending ("" = root)
  ``clma.cohort.ancestor.<id>``         ``true`` for every ancestor (parents, their
                                        parents, ...): the search key for descendants
  ``clma.cohort.created_round``         round it was created (0 = the federation's start)
  ``clma.cohort.merged_round``          round it was merged into a new cohort (if so)
  ``clma.cohort.retired_round``         round it was retired (emptied by a split)
  ``clma.cohort.status``                ``active`` | ``merged`` | ``retired``
  ``clma.release.participant_band``     members' count band relative to the cohort floor
                                        (``minimum_to_under_double``,
                                        ``double_to_under_fourfold``, ``fourfold_or_more``;
                                        ``below_minimum`` under the floor, ``none`` when
                                        empty) -- never the exact count
  ``clma.federation.run_id``            the federation run
  ====================================  ==================================================

  Its model: in every round the cohort's parameter vector changes, an MLflow model
  (``mlflow.pytorch`` flavour, the safe ``pt2`` exported-graph format, batch dimension
  dynamic) under ``model/round_NNN`` of the cohort run, registered as a new version of
  the registered model :func:`registered_model_name` (version tags ``clma.cohort.id``,
  ``clma.round``, ``clma.model.sha256`` of the float32 parameter vector) and the alias ``cohort-<id>`` moved to it, so
  ``mlflow.pytorch.load_model("models:/<name>@cohort-<id>")`` loads a cohort's latest model.
  Metrics of the cohort run (step = round): ``active`` (1/0).

* **Lineage artifact** on the federation run: ``lineage/lineage.json`` (schema
  ``clma.lineage/1``: cohorts with parents, created/ended round, status, band; split and
  merge events by round) and ``lineage/lineage.png`` (each cohort a horizontal life line
  over rounds, arrows from parent to child at a split or merge). The JSON is rewritten
  after every round; the PNG is redrawn when the graph changed (a cohort created, merged
  or retired, a band changed) and after the flow run's last round (``final``), so the
  last one logged always shows the whole run.

Find every cohort descended from cohort 3 (documented search, tested)::

    MlflowClient().search_runs([experiment_id],
        filter_string="tags.`clma.cohort.ancestor.3` = 'true'")

(tag names containing dots must be quoted with backticks -- or double quotes -- in
MLflow's filter syntax; add ``and tags.`mlflow.parentRunId` = '<federation run id>'`` to
stay inside one federation).

Re-runs are idempotent: a cohort run is looked up by its tags before one is created, and
a model version already registered for (cohort, round) is reused, so resuming a crashed
round never duplicates runs or versions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from clma.cohort import CohortRegistry
from clma.release import count_band

__all__ = [
    "LINEAGE_SCHEMA",
    "REGISTERED_MODEL_DESCRIPTION",
    "CohortLineageTracker",
    "LineageState",
    "cohort_band",
    "descendants_filter",
    "lineage_document",
    "lineage_figure",
    "registered_model_name",
    "render_lineage_png",
]

LINEAGE_SCHEMA = "clma.lineage/1"
# Markdown in the MLflow UI: no angle brackets (a "<id>" would be swallowed as an HTML tag);
# the placeholder is in a code span.
REGISTERED_MODEL_DESCRIPTION = (
    "CLMA cohort models. The alias `cohort-{id}` (e.g. `cohort-3`) points at the latest "
    "model of cohort `{id}`; load it with `mlflow.pytorch.load_model(\"models:/NAME@cohort-{id}\")`."
)
TAG_ID = "clma.cohort.id"
TAG_PARENTS = "clma.cohort.parents"
TAG_ANCESTOR = "clma.cohort.ancestor."
TAG_BAND = "clma.release.participant_band"


def descendants_filter(cohort_id: int, federation_run_id: str | None = None) -> str:
    """MLflow ``filter_string`` matching every cohort run descended from ``cohort_id``.

    Raises ValueError for a negative or non-integer id.
    """
    if isinstance(cohort_id, bool) or not isinstance(cohort_id, int) or cohort_id < 0:
        raise ValueError("cohort_id: must be an integer >= 0")
    f = f"tags.`{TAG_ANCESTOR}{cohort_id}` = 'true'"
    if federation_run_id:
        f += f" and tags.`mlflow.parentRunId` = '{federation_run_id}'"
    return f


def registered_model_name(config: Any) -> str:
    """Registered-model name of a federation's cohort models: ``<name>-seed<seed>-cohorts``."""
    return f"{config.name}-seed{config.seed}-cohorts"


def cohort_band(n_members: int, min_cohort: int) -> str:
    """Members' count band of a cohort (see module table); never the count itself
    (:func:`clma.release.count_band`)."""
    return count_band(n_members, min_cohort)


def lineage_document(registry: CohortRegistry, min_cohort: int, rounds_done: int
                     ) -> dict[str, Any]:
    """``lineage.json``: cohorts (parents, rounds, status, band) and split/merge events.

    No client ids and no exact member counts.
    """
    cohorts = []
    for cid, rec in sorted(registry.cohorts.items()):
        cohorts.append({
            "cohort_id": cid,
            "parents": sorted(rec.parents),
            "ancestors": registry.ancestors(cid),
            "created_round": rec.created_round,
            "ended_round": rec.ended_round,
            "status": rec.status,
            "participant_band": cohort_band(len(rec.members), min_cohort),
        })
    events = [
        {"kind": e.kind, "round": e.round, "parents": list(e.parents),
         "children": list(e.children), "reason": e.reason}
        for e in registry.lineage if e.kind in ("split", "merge", "retire", "create")
    ]
    return {"schema": LINEAGE_SCHEMA, "rounds_done": rounds_done, "cohorts": cohorts,
            "events": events}


def render_lineage_png(doc: Mapping[str, Any], path: str | Path) -> Path:
    """Draw the lineage graph of :func:`lineage_document` (:func:`lineage_figure`) to a PNG
    file; returns its path."""
    import matplotlib.pyplot as plt

    from tasks.dashboards import DPI

    fig = lineage_figure(doc)
    try:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=DPI)
    finally:
        plt.close(fig)
    return out


def lineage_figure(doc: Mapping[str, Any]) -> Any:
    """The lineage graph of :func:`lineage_document` as a matplotlib Figure (the caller
    closes it).

    x = round (integer ticks, from round 1: a cohort created at the federation's start,
    round 0, is drawn from round 1, the first round it trained), one horizontal life line
    per cohort (solid while active, ending at its merge/retire round), arrows parent ->
    child at the child's creation round (blue for splits, green for merges). Rendered at
    :data:`tasks.dashboards.DPI`, at least ``MIN_WIDTH_PX`` wide; the title is two lines
    inside the figure (never clipped).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from tasks.dashboards import DPI, MIN_WIDTH_PX

    cohorts = list(doc["cohorts"])
    last = max([int(doc["rounds_done"])] + [c["created_round"] for c in cohorts] + [1])
    lane = {c["cohort_id"]: i for i, c in enumerate(cohorts)}
    fig, ax = plt.subplots(figsize=(max(MIN_WIDTH_PX / DPI, 0.6 * last + 3),
                                    max(3.0, 0.5 * len(cohorts) + 2.0)), dpi=DPI)
    try:
        for c in cohorts:
            y = lane[c["cohort_id"]]
            start = max(1, int(c["created_round"]))
            end = c["ended_round"] if c["ended_round"] is not None else last
            end = max(start, int(end))
            color = {"active": "tab:blue", "merged": "tab:green", "retired": "tab:gray"}[c["status"]]
            ax.plot([start, end], [y, y], color=color, lw=3, solid_capstyle="butt")
            ax.annotate(f"cohort {c['cohort_id']} [{c['participant_band']}]",
                        (start, y), xytext=(2, 5), textcoords="offset points",
                        fontsize=7)
        for e in doc["events"]:
            if e["kind"] not in ("split", "merge"):
                continue
            for p in e["parents"]:
                for ch in e["children"]:
                    if p in lane and ch in lane:
                        ax.annotate("", xy=(e["round"], lane[ch]), xytext=(e["round"], lane[p]),
                                    arrowprops={"arrowstyle": "->", "lw": 1.2, "color":
                                                "tab:blue" if e["kind"] == "split" else "tab:green"})
        ax.set_xlim(0.5, last + 0.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        ax.set_ylim(-0.8, len(cohorts) - 0.2)
        ax.set_yticks(range(len(cohorts)), [str(c["cohort_id"]) for c in cohorts])
        ax.invert_yaxis()
        ax.set_xlabel("round")
        ax.set_ylabel("cohort")
        ax.set_title("Cohort lineage over rounds\nsplits: blue arrows, merges: green arrows",
                     fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        fig.tight_layout()
    except BaseException:
        plt.close(fig)
        raise
    return fig


class LineageState(BaseModel):
    """What the tracker keeps between rounds (stored in the durable federation state).

    ``cohort_runs``: cohort id (as str) -> MLflow run id; ``model_sha``: cohort id ->
    SHA-256 of the last logged parameter vector; ``model_versions``: cohort id -> the
    registered version the alias points at.
    """

    model_config = ConfigDict(extra="forbid")

    cohort_runs: dict[str, str] = Field(default_factory=dict)
    model_sha: dict[str, str] = Field(default_factory=dict)
    model_versions: dict[str, str] = Field(default_factory=dict)
    ended: dict[str, str] = Field(default_factory=dict)


@dataclasses.dataclass
class _PendingModel:
    cohort_id: int
    run_id: str
    round: int
    sha: str
    args: tuple[Any, ...]  # save_model_folder's (vector, spec, example)
    tmp: Any  # tempfile.TemporaryDirectory holding the exported folder
    job: Any  # concurrent.futures.Future -> folder, or None (export at collect)


def save_model_folder(vector: np.ndarray, spec: Any, example: np.ndarray, tmp: str) -> str:
    """Save the model of parameter ``vector`` (architecture ``spec``) as an MLflow model
    (``mlflow.pytorch`` flavour, ``pt2`` exported graph, pinned torch requirement,
    ``example`` the input example, and the exact ``state_dict`` as
    ``extra_files/state_dict.pt``, which ``[model] weights = "models:/..."`` and
    :func:`clma.models.factory.load_weights` read) to ``tmp/model``; returns that folder. A plain function
    of picklable data, so a worker process can run it."""
    import mlflow.pytorch
    import torch

    from clma.models.factory import STATE_DICT_FILE
    from clma.params import AllParams, vector_to_model

    module = vector_to_model(vector, spec.build(seed=0), AllParams()).eval()
    logging.getLogger("mlflow").setLevel(logging.ERROR)
    state_file = Path(tmp) / Path(STATE_DICT_FILE).name
    torch.save(module.state_dict(), state_file)
    folder = str(Path(tmp) / "model")
    mlflow.pytorch.save_model(
        module, folder, serialization_format="pt2", input_example=example,
        pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
        extra_files=[str(state_file)],
    )
    return folder


def _save_model_in_worker(vector: np.ndarray, spec: Any, example: np.ndarray,
                          tmp: str) -> str:
    """:func:`save_model_folder` in a worker process: one torch thread (the rounds'
    training keeps the other core)."""
    import torch

    torch.set_num_threads(1)
    return save_model_folder(vector, spec, example, tmp)


def warm_up_export() -> None:
    """Import the export stack (torch, ``mlflow.pytorch``) in the worker process, its
    one-time start-up, while the federation sets up."""
    import mlflow.pytorch  # noqa: F401
    import torch  # noqa: F401


def _vector_sha(v: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(v, dtype=np.float32).tobytes()).hexdigest()


class CohortLineageTracker:
    """Mirror the cohort registry of one federation run into MLflow (see module docs).

    Args:
        client: an :class:`mlflow.MlflowClient`.
        experiment_id: the federation run's experiment.
        federation_run_id: the parent run.
        model_name: registered-model name (:func:`registered_model_name`).
        log_models: log and register cohort models (else tags and lineage only).
        state: a :class:`LineageState` from an earlier flow run (resume), or None.
        models_every: a changed model is logged when its cohort is new, in rounds that are
            multiples of ``models_every``, and by :meth:`finish` (the flow run's last
            state); 1 = every round it changes.
        worker: a :class:`tasks.dashboards.DashboardRenderer` (its ``submit_job``): the
            models are exported (``mlflow.pytorch.save_model``, about 0.5 s of CPU each) in
            its process while the next round runs and registered by :meth:`collect`;
            None: exported and registered at once. The registered versions are the same.
            What a crash can lose: the models of the latest round, not yet registered,
            when there is no state dir (there is no resume then); with one, the session
            collects them before it commits the round.
    """

    def __init__(self, client: Any, experiment_id: str, federation_run_id: str,
                 model_name: str, *, log_models: bool = True,
                 state: LineageState | None = None, models_every: int = 1,
                 worker: Any = None) -> None:
        self.client = client
        self.experiment_id = experiment_id
        self.federation_run_id = federation_run_id
        self.model_name = model_name
        self.log_models = log_models
        self.models_every = int(models_every)
        self.state = state or LineageState()
        self._model_registered = False
        self._drawn: str | None = None  # the graph (doc without rounds_done) last drawn
        self.worker = worker  # exports models in another process (submit_job), or None
        self._pending: list[_PendingModel] = []

    # ------------------------------------------------------------------ runs
    def _find_run(self, cohort_id: int) -> str | None:
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=(f"tags.`{TAG_ID}` = '{cohort_id}' and "
                           f"tags.`mlflow.parentRunId` = '{self.federation_run_id}'"),
            max_results=5,
        )
        return runs[0].info.run_id if runs else None

    def cohort_run(self, cohort_id: int, registry: CohortRegistry) -> str:
        """The MLflow run of ``cohort_id`` (found or created, with its static tags)."""
        key = str(cohort_id)
        if key in self.state.cohort_runs:
            return self.state.cohort_runs[key]
        rid = self._find_run(cohort_id)
        if rid is None:
            rec = registry.cohort(cohort_id)
            tags = {
                "mlflow.parentRunId": self.federation_run_id,
                "clma.kind": "cohort",
                TAG_ID: str(cohort_id),
                TAG_PARENTS: ",".join(str(p) for p in sorted(rec.parents)),
                "clma.cohort.created_round": str(rec.created_round),
                "clma.federation.run_id": self.federation_run_id,
            }
            for a in registry.ancestors(cohort_id):
                tags[f"{TAG_ANCESTOR}{a}"] = "true"
            rid = self.client.create_run(self.experiment_id, run_name=f"cohort-{cohort_id}",
                                         tags=tags).info.run_id
        self.state.cohort_runs[key] = rid
        return rid

    # ------------------------------------------------------------------ models
    def _ensure_registered_model(self) -> None:
        if self._model_registered:
            return
        from mlflow.exceptions import MlflowException

        try:
            model = self.client.get_registered_model(self.model_name)
        except MlflowException:
            self.client.create_registered_model(self.model_name,
                                                description=REGISTERED_MODEL_DESCRIPTION)
        else:  # a model registered by an older version: its description lost the "<id>"
            if model.description != REGISTERED_MODEL_DESCRIPTION:
                self.client.update_registered_model(self.model_name,
                                                    description=REGISTERED_MODEL_DESCRIPTION)
        self._model_registered = True

    def _existing_version(self, run_id: str, round_number: int, sha: str) -> str | None:
        """A version already registered for this cohort run at ``round_number`` or with
        these parameters (re-run of a round)."""
        existing = self.client.search_model_versions(
            f"name = '{self.model_name}' and run_id = '{run_id}'")
        for mv in existing:
            if mv.tags.get("clma.round") == str(round_number) \
                    or mv.tags.get("clma.model.sha256") == sha:
                return str(mv.version)
        return None

    def _register(self, cohort_id: int, run_id: str, folder: str, round_number: int,
                  sha: str) -> str:
        """Log the saved model ``folder`` under ``model/round_NNN`` and register it."""
        artifact = f"model/round_{round_number:03d}"
        self.client.log_artifacts(run_id, folder, artifact)
        mv = self.client.create_model_version(
            self.model_name, source=f"runs:/{run_id}/{artifact}", run_id=run_id,
            tags={TAG_ID: str(cohort_id), "clma.round": str(round_number),
                  "clma.model.sha256": sha},
        )
        return str(mv.version)

    def _export_args(self, engine: Any, vector: np.ndarray) -> tuple[Any, ...]:
        spec = engine.assets.model_spec
        n_features = getattr(spec, "n_features", None)  # the model's flat input (MLPSpec)
        example = (np.zeros((2, int(n_features)), dtype=np.float32) if n_features is not None
                   else np.zeros_like(np.asarray(engine.assets.probe_x[:2], dtype=np.float32)))
        return (np.asarray(vector), spec, example)

    def _log_model(self, engine: Any, cohort_id: int, run_id: str,
                   vector: np.ndarray, round_number: int, sha: str) -> str:
        self._ensure_registered_model()
        version = self._existing_version(run_id, round_number, sha)
        if version is not None:
            return version
        with tempfile.TemporaryDirectory(prefix="clma-model-") as tmp:
            folder = save_model_folder(*self._export_args(engine, vector), tmp)
            return self._register(cohort_id, run_id, folder, round_number, sha)

    def _submit_model(self, engine: Any, cohort_id: int, run_id: str,
                      vector: np.ndarray, round_number: int, sha: str) -> None:
        """Export the model in :attr:`worker`'s process; :meth:`collect` registers it."""
        self._ensure_registered_model()
        version = self._existing_version(run_id, round_number, sha)
        if version is not None:
            self._install(cohort_id, sha, version)
            return
        tmp = tempfile.TemporaryDirectory(prefix="clma-model-")
        args = self._export_args(engine, vector)
        job = self.worker.submit_job(_save_model_in_worker, *args, tmp.name)
        self._pending.append(_PendingModel(cohort_id, run_id, round_number, sha, args, tmp,
                                           job))

    def _install(self, cohort_id: int, sha: str, version: str) -> None:
        key = str(cohort_id)
        self.client.set_registered_model_alias(self.model_name, f"cohort-{cohort_id}", version)
        self.state.model_sha[key] = sha
        self.state.model_versions[key] = version

    def collect(self) -> None:
        """Register the models exported in the worker (in submission order): log each
        folder, create its version, move the alias. A worker that could not start or died
        exports here instead. Called at the start of every :meth:`sync_round`, by
        :meth:`log_final_models` and before a durable commit
        (:meth:`tasks.durable.FederationSession.flush`)."""
        from concurrent.futures.process import BrokenProcessPool

        pending, self._pending = self._pending, []
        try:
            for p in pending:
                try:
                    folder = p.job.result() if p.job is not None else None
                except BrokenProcessPool:
                    folder = None
                if folder is None:
                    folder = save_model_folder(*p.args, p.tmp.name)
                self._install(p.cohort_id, p.sha,
                              self._register(p.cohort_id, p.run_id, folder, p.round, p.sha))
        finally:
            for p in pending:
                p.tmp.cleanup()

    # ------------------------------------------------------------------ per round
    def sync_round(self, engine: Any, round_number: int, *, out_dir: str | Path | None = None,
                   final: bool = True) -> dict[str, Any]:
        """Bring MLflow up to date after ``round_number``: cohort runs and tags, changed
        models (logged + registered + alias), the lineage document and graph.

        ``out_dir``: also write ``lineage/lineage.json`` and ``lineage.png`` there (the same
        PNG file is logged). ``final``: the flow run's last round: the graph is drawn
        even if only the round axis grew; otherwise it is drawn when it changed.

        Returns the lineage document (also logged as ``lineage/lineage.json``).
        """
        from mlflow.entities import Metric, RunTag

        self.collect()  # models exported in the worker since the last round
        reg = engine.state.registry
        m = engine.evaluator.min_cohort
        import time

        ts = int(time.time() * 1000)
        for cid, rec in sorted(reg.cohorts.items()):
            key = str(cid)
            if key in self.state.ended:
                continue  # merged / retired earlier: its run is final
            rid = self.cohort_run(cid, reg)
            tags = [RunTag("clma.cohort.status", rec.status),
                    RunTag(TAG_BAND, cohort_band(len(rec.members), m))]
            if rec.status == "merged":
                tags.append(RunTag("clma.cohort.merged_round", str(rec.ended_round)))
            if rec.status == "retired":
                tags.append(RunTag("clma.cohort.retired_round", str(rec.ended_round)))
            self.client.log_batch(rid, metrics=[
                Metric("active", 1.0 if rec.status == "active" else 0.0, ts, round_number)],
                tags=tags)
            if rec.status != "active":
                self.state.ended[key] = rec.status
                self.client.set_terminated(rid, "FINISHED")
                continue
            due = key not in self.state.model_versions or round_number % self.models_every == 0
            if due:
                self._sync_model(engine, cid, rid, round_number)
        doc = lineage_document(reg, m, round_number)
        self.client.log_dict(self.federation_run_id, doc, "lineage/lineage.json")
        graph = json.dumps({k: v for k, v in doc.items() if k != "rounds_done"},
                           sort_keys=True)
        draw = final or graph != self._drawn
        if out_dir is not None:
            base = Path(out_dir) / "lineage"
            base.mkdir(parents=True, exist_ok=True)
            (base / "lineage.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
            if draw:  # drawn once: the out folder's file is the one logged
                png = render_lineage_png(doc, base / "lineage.png")
                self.client.log_artifact(self.federation_run_id, str(png), "lineage")
        elif draw:
            with tempfile.TemporaryDirectory(prefix="clma-lineage-") as tmp:
                png = render_lineage_png(doc, Path(tmp) / "lineage.png")
                self.client.log_artifact(self.federation_run_id, str(png), "lineage")
        if draw:
            self._drawn = graph
        return doc

    def _sync_model(self, engine: Any, cid: int, rid: str, round_number: int) -> None:
        """Log and register cohort ``cid``'s model if it changed since its last version
        (in :attr:`worker`'s process when there is one, registered by :meth:`collect`)."""
        key = str(cid)
        vec = engine.state.cohort_models.get(cid)
        if not self.log_models or vec is None:
            return
        sha = _vector_sha(vec)
        if self.state.model_sha.get(key) == sha or any(
                p.cohort_id == cid and p.sha == sha for p in self._pending):
            return
        if self.worker is not None:
            self._submit_model(engine, cid, rid, vec, round_number, sha)
            return
        self._install(cid, sha, self._log_model(engine, cid, rid, vec, round_number, sha))

    def log_final_models(self, engine: Any, round_number: int) -> None:
        """Log every active cohort's latest model (end of a flow run) and wait for every
        export."""
        for cid in engine.state.registry.active_cohorts():
            rid = self.state.cohort_runs.get(str(cid))
            if rid is not None:
                self._sync_model(engine, cid, rid, round_number)
        self.collect()

    def finish(self, status: str = "FINISHED") -> None:
        """Terminate the runs of cohorts still active (end of a flow run)."""
        for key, rid in self.state.cohort_runs.items():
            if key not in self.state.ended:
                self.client.set_terminated(rid, status)

    def to_dict(self) -> dict[str, Any]:
        return self.state.model_dump(mode="json")


def write_lineage_files(doc: Mapping[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``lineage.json`` and ``lineage.png`` under ``out_dir/lineage/``."""
    base = Path(out_dir) / "lineage"
    base.mkdir(parents=True, exist_ok=True)
    j = base / "lineage.json"
    j.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return j, render_lineage_png(doc, base / "lineage.png")
