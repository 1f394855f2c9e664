"""One federation flow run's life cycle around the rounds: durable state, MLflow run reuse,
cohort lineage and dashboards (issue 7). The flow (``flows/federation.py``) calls:

``FederationSession.open(config, state_dir)`` -> ``session.config`` (ledger placed in the
state dir) -> ``session.restore_state()`` (the server state committed there, or None) ->
the engine -> ``session.make_tracker()`` (a :class:`DurableTracker`: a new MLflow run, or
the federation's run again when resuming) -> per round ``session.round_started(r)`` ...
the round and its logging ... ``session.round_done(engine, rec, tracker)`` (lineage,
dashboards, atomic commit) -> ``session.close(status)``.

With ``state_dir=None`` nothing is stored (the embedded default of ``clma run``): lineage
and dashboards are still published.

Exactly once, across crashes. The snapshot of round r is committed only after everything
of round r was logged. A crash before the commit makes the resumed run redo round r from
the snapshot of r - 1: every random choice is seeded by (seed, round), so it redoes the
same round; the ledger's idempotency keys (epoch, round, release) make the re-run charge
nothing twice and republish the committed releases; metrics of round r already in the
MLflow run are not logged again (:class:`DurableTracker` skips a (key, step) that is
present); artifacts are rewritten in place; cohort runs and model versions are looked up
before they are created (:mod:`tasks.lineage`); the dashboard history replaces round r.

Fault injection for tests: ``CLMA_FAILPOINT=kill-before-commit:<round>`` SIGKILLs the
process after round ``<round>`` was logged and before its commit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from clma.config import FederationConfig
from clma.state import (
    CommittedState,
    StateError,
    StateStore,
    restore_server,
    snapshot_server,
)
from tasks.dashboards import DashboardHistory, DashboardRenderer, publish_dashboards
from tasks.lineage import CohortLineageTracker, LineageState, registered_model_name
from tasks.tracking import FederationTracker

__all__ = ["DurableTracker", "FederationSession", "record_to_dict", "state_summary",
           "stored_config"]

FAILPOINT_ENV = "CLMA_FAILPOINT"


def _jsonable(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if hasattr(o, "model_dump"):
        return o.model_dump(mode="json")
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


def _dumps(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, default=_jsonable) + "\n").encode("utf-8")


def record_to_dict(rec: Any) -> dict[str, Any]:
    """A ``RoundRecord`` as JSON data (without the in-memory evaluation outcome)."""
    out = {}
    for f in dataclasses.fields(rec):
        if f.name == "evaluation":
            continue
        out[f.name] = getattr(rec, f.name)
    return json.loads(_dumps(out))


def _record_kwargs(d: dict[str, Any]) -> dict[str, Any]:
    d = dict(d)
    d["cohorts"] = {int(k): v for k, v in d.get("cohorts", {}).items()}
    d["new_cohorts"] = {int(k): v for k, v in d.get("new_cohorts", {}).items()}
    return d


class DurableTracker(FederationTracker):
    """A :class:`FederationTracker` that re-attaches to the federation's MLflow run when
    resuming and logs each (metric, round) once.

    ``start`` creates the run on a fresh federation (and commits round 0 so that the run
    id is durable before any round is logged); on resume it re-opens the stored run
    (status RUNNING; params are not logged again). ``log_metrics`` at the first round of a
    resumed flow run skips keys that already have a value at that step.
    """

    def __init__(self, session: FederationSession, tracking_uri: str | None = None) -> None:
        super().__init__(tracking_uri)
        self.session = session
        self.dedupe_step: int | None = None

    def start(self, experiment: str, run_name: str, params: dict[str, str],
              tags: dict[str, str], parent_run_id: str | None = None) -> str:
        rid = self.session.mlflow.get("run_id")
        if rid:
            from mlflow.exceptions import MlflowException

            try:
                run = self.client.get_run(rid)
            except MlflowException:
                raise StateError(
                    f"mlflow: the federation's run {rid} is not on {self.tracking_uri}; set "
                    "MLFLOW_TRACKING_URI to the store the federation started with") from None
            self.run_id = rid
            self.experiment_id = run.info.experiment_id
            self.client.update_run(rid, status="RUNNING")
            self.client.set_tag(rid, "clma.resumed_from_round",
                                str(self.session.committed_round))
            self.dedupe_step = self.session.committed_round + 1
            return rid
        rid = super().start(experiment, run_name, params, tags, parent_run_id)
        self.session.mlflow = {"run_id": rid, "experiment_id": self.experiment_id,
                               "tracking_uri": self.tracking_uri}
        self.session.commit_initial()
        return rid

    def _present_at(self, keys: list[str], step: int) -> set[str]:
        from tasks.tracking import metric_key

        present = set()
        for k in keys:  # the name MLflow holds: a merged region's '+' is logged as '_'
            history = self.client.get_metric_history(self._rid(), metric_key(k))
            if any(m.step == step for m in history):
                present.add(k)
        return present

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.dedupe_step is not None and step == self.dedupe_step:
            skip = self._present_at(sorted(metrics), step)
            metrics = {k: v for k, v in metrics.items() if k not in skip}
        super().log_metrics(metrics, step)


@dataclasses.dataclass
class FederationSession:
    """Durable state and publication around the rounds of one flow run (module docs)."""

    config: FederationConfig
    store: StateStore | None
    original_config: FederationConfig | None = None
    out_dir: str | None = None
    committed_round: int = 0
    mlflow: dict[str, Any] = dataclasses.field(default_factory=dict)
    stored_records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    dashboards: DashboardHistory = dataclasses.field(default_factory=DashboardHistory)
    lineage_state: LineageState = dataclasses.field(default_factory=LineageState)
    lineage: CohortLineageTracker | None = None
    renderer: DashboardRenderer | None = None  # draws the dashboard PNGs off the round
    engine: Any = None
    _snapshot: CommittedState | None = None
    _lock: Any = None
    _new_records: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, config: FederationConfig, state_dir: str | os.PathLike | None,
             out_dir: str | None = None, *, require: str | None = None) -> FederationSession:
        """Open (and lock) ``state_dir``; None = no durable state.

        ``require``: ``"fresh"`` refuses a directory that already holds a federation,
        ``"existing"`` refuses one that holds none; None accepts both (scheduled runs).
        The ledger goes to ``STATE_DIR/ledger`` unless ``budget.state_dir`` is set.

        Raises:
            StateError (StateLocked, StateCorrupt): locked, corrupt, or not as required.
        """
        if state_dir is None:
            return cls(config=config, store=None, out_dir=out_dir)._start_renderer()
        store = StateStore(state_dir, keep=config.state.keep_commits)
        lock = store.lock()
        lock.__enter__()
        try:
            snap = store.load()
            if require == "fresh" and snap is not None:
                raise StateError(
                    f"state dir {str(store.root)!r} already holds federation "
                    f"{snap.json('federation.json').get('name')!r} at round {snap.round}; "
                    "continue it with --resume, or choose another directory")
            if require == "existing" and snap is None:
                raise StateError(f"--resume {str(store.root)!r}: no committed federation "
                                 "state there")
            original = config
            if config.budget.state_dir is None:
                config = config.model_copy(update={"budget": config.budget.model_copy(
                    update={"state_dir": str(store.ledger_dir)})})
            s = cls(config=config, store=store, original_config=original, out_dir=out_dir,
                    _snapshot=snap, _lock=lock)
            if snap is not None:
                s.committed_round = snap.round
                s.mlflow = snap.json("mlflow.json")
                s.stored_records = snap.json("records.json")
                s.dashboards = DashboardHistory.from_dict(snap.json("dashboards.json"))
                s.lineage_state = LineageState.model_validate(snap.json("lineage.json"))
            return s._start_renderer()
        except BaseException:
            lock.__exit__(None, None, None)
            raise

    def _start_renderer(self) -> FederationSession:
        t = self.config.tracking
        exports = t.enabled and t.lineage and t.log_models  # models exported there too
        if (t.dashboards or exports) and self.renderer is None:
            self.renderer = DashboardRenderer()
            self.renderer.start()  # its start-up overlaps the set-up and round 1
            if exports:
                from tasks.lineage import warm_up_export

                self.renderer.submit_job(warm_up_export)
        return self

    def attach_engine(self, engine: Any) -> None:
        """``engine`` runs this federation's rounds: with a state folder, the differencing
        rule's memory is kept in its write-ahead journal (``audit/learned_sums.jsonl``),
        including sets learned by an attempt that crashed before its commit."""
        self.engine = engine
        if self.store is not None:
            engine.evaluator.attach_journal(self.store.append_learned,
                                            self.store.learned_entries())

    def restore_state(self) -> Any:
        """The server state committed in the state dir (None for a fresh federation).

        Raises:
            StateError: the stored federation has another configuration.
        """
        if self._snapshot is None:
            return None
        return restore_server(self._snapshot, self.config)

    def last_round(self, max_new_rounds: int | None = None) -> int:
        """Last round of this flow run: ``config.rounds``, or fewer with ``max_new_rounds``."""
        last = self.config.rounds
        if max_new_rounds is not None:
            last = min(last, self.committed_round + int(max_new_rounds))
        return last

    def make_tracker(self) -> DurableTracker:
        return DurableTracker(self)

    def previous_records(self, factory: Callable[..., Any]) -> list[Any]:
        """Records of rounds committed by earlier flow runs, rebuilt with ``factory``
        (``RoundRecord``)."""
        return [factory(**_record_kwargs(d)) for d in self.stored_records]

    # ------------------------------------------------------------------ rounds
    def round_started(self, round_number: int) -> None:
        if self.store is not None:
            self.store.mark_started(round_number)

    def _lineage(self, tracker: Any) -> CohortLineageTracker | None:
        if tracker is None or not self.config.tracking.lineage or tracker.run_id is None:
            return None
        if self.lineage is None:
            self.lineage = CohortLineageTracker(
                tracker.client, tracker.experiment_id, tracker.run_id,
                registered_model_name(self.config), log_models=self.config.tracking.log_models,
                state=self.lineage_state, models_every=self.config.tracking.models_every,
                worker=self.renderer)
        return self.lineage

    def round_done(self, engine: Any, rec: Any, tracker: Any, *, last: bool = True) -> None:
        """After round ``rec.round`` was logged: lineage, dashboards, then the commit.
        ``last``: the flow run's last round (the lineage graph is drawn in any case).

        The dashboard PNGs are drawn by :attr:`renderer` in a worker process while the
        next round runs; with durable state the commit waits for them first (everything
        of round r is logged before its commit), without they are collected at the next
        evaluation round or by :meth:`flush`."""
        lineage = self._lineage(tracker)
        if lineage is not None:
            lineage.sync_round(engine, rec.round, out_dir=self.out_dir, final=last)
        report = rec.regional
        if self.config.tracking.dashboards and report:
            publish_dashboards(self.dashboards, report, federation=self.config.name,
                               tracker=tracker, out_dir=self.out_dir, renderer=self.renderer)
        self._new_records.append(record_to_dict(rec))
        if self.store is not None and rec.evaluation is not None:
            self.store.write_audit(rec.round, rec.evaluation.audit)
        if self.store is not None:
            self.flush()
        _failpoint("kill-before-commit", rec.round)
        self.commit(engine, rec.round)

    def flush(self) -> None:
        """Wait for the dashboards being drawn and the models being exported and log them
        (before a commit, and before the MLflow run ends)."""
        if self.lineage is not None:
            self.lineage.collect()
        if self.renderer is not None:
            self.renderer.wait()

    def _files(self, engine: Any, round_number: int) -> dict[str, bytes]:
        files = snapshot_server(engine.state, self.config, round_number)
        files["mlflow.json"] = _dumps(self.mlflow)
        files["config.json"] = _dumps(self.original_config.model_dump(mode="json"))
        records = [r for r in self.stored_records if r["round"] <= round_number]
        seen = {r["round"] for r in records}
        records += [r for r in self._new_records if r["round"] not in seen]
        files["records.json"] = _dumps(sorted(records, key=lambda r: r["round"]))
        files["dashboards.json"] = _dumps(self.dashboards.to_dict())
        lin = self.lineage.state if self.lineage is not None else self.lineage_state
        files["lineage.json"] = _dumps(lin.model_dump(mode="json"))
        return files

    def commit(self, engine: Any, round_number: int) -> None:
        if self.store is None:
            return
        self.store.commit(round_number, self._files(engine, round_number),
                          meta={"federation": self.config.name, "seed": self.config.seed,
                                "mlflow_run_id": self.mlflow.get("run_id")})
        self.committed_round = round_number

    def commit_initial(self) -> None:
        """Commit round 0 (fresh federation) so the MLflow run id is durable at once."""
        if self.store is not None and self._snapshot is None and self.engine is not None \
                and self.committed_round == 0:
            self.commit(self.engine, 0)

    def close(self, status: str = "FINISHED") -> None:
        if self.lineage is not None:  # before the worker stops: its exports are collected
            with contextlib.suppress(Exception):
                if status == "FINISHED" and self.engine is not None:
                    self.lineage.log_final_models(self.engine, self.engine.state.rounds_done)
                else:
                    self.lineage.collect()
                self.lineage.finish(status)
        if self.renderer is not None:
            renderer, self.renderer = self.renderer, None
            if status == "FINISHED":
                renderer.close()
            else:  # a failed run: do not mask its error with the drawing's
                with contextlib.suppress(Exception):
                    renderer.close()
        if self._lock is not None:
            self._lock.__exit__(None, None, None)
            self._lock = None


def _failpoint(name: str, round_number: int) -> None:
    spec = os.environ.get(FAILPOINT_ENV, "")
    if spec and spec == f"{name}:{round_number}":
        os.kill(os.getpid(), signal.SIGKILL)


def stored_config(state_dir: str | Path) -> FederationConfig | None:
    """The configuration a federation's state was committed with (None: no state); fields
    added since it was written hold their legacy values (:func:`with_legacy_additions`:
    the federation resumes as it ran, not under a default that changed)."""
    from clma.config import validate_config, with_legacy_additions

    snap = StateStore(state_dir).load()
    if snap is None or "config.json" not in snap.files:
        return None
    return validate_config(with_legacy_additions(snap.json("config.json")))


def state_summary(state_dir: str | Path) -> dict[str, Any]:
    """Round committed and MLflow run of a state directory (for the CLI and tests)."""
    snap = StateStore(state_dir).load()
    if snap is None:
        return {"round": None}
    docs = {k: snap.json(f"{k}.json") if f"{k}.json" in snap.files else None
            for k in ("mlflow", "federation")}
    return {"round": snap.round, **docs}

