"""Prefect tasks of the private evaluation: thin calls of :mod:`clma.engine.evaluation`.

``secure-aggregation`` runs the on-device reports and the secure sums through the
``Clients`` seam; the ledger's charge / release / republish steps are named sub-steps of
:func:`clma.engine.budget.budgeted_evaluation` (``tasks.round.prefect_step``);
``evaluate-regions`` closes the round (envelopes, alerts, merges, bounds).
:func:`log_evaluation` writes the round's envelopes and alerts to MLflow and the output
folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import task
from prefect.utilities.annotations import quote

from clma.engine import FederationEngine, RoundContext
from clma.engine.evaluation import EvaluationOutcome, SecureSums
from tasks.round import TASK_OPTIONS, prefect_step
from tasks.tracking import error_bar_key

__all__ = ["evaluate_regions", "log_evaluation", "secure_aggregation_task"]


@task(name="secure-aggregation", **TASK_OPTIONS)
def secure_aggregation_task(engine: FederationEngine, ctx: RoundContext) -> SecureSums:
    """On-device metric reports and the secure sums per group (four transport calls)."""
    return engine.secure_sums(ctx)


@task(name="evaluate-regions", **TASK_OPTIONS)
def _release_task(engine: FederationEngine, ctx: RoundContext, sums: SecureSums
                  ) -> EvaluationOutcome:
    """Releases without a ledger, envelopes, alerts, merges and bounds."""
    return engine.evaluate(ctx, sums)


def evaluate_regions(engine: FederationEngine, ctx: RoundContext, sums: SecureSums, *,
                     gate: Any = None, run_id: str = "") -> EvaluationOutcome:
    """The round's releases: with a ledger, each charged before its noise in the flow's
    body (the borrow gate may pause the run; charge / release / republish show as tasks);
    without, one ``evaluate-regions`` task."""
    if engine.budget is None:
        return _release_task(quote(engine), quote(ctx), quote(sums))  # not walked
    return engine.evaluate(ctx, sums, gate=gate, run_id=run_id, step=prefect_step)


def log_evaluation(outcome: EvaluationOutcome, tracker: Any = None, out_dir: str | None = None
                   ) -> None:
    """Write the round's envelopes and alerts (MLflow artifacts and/or the out folder).

    MLflow (``tracker``: :class:`tasks.tracking.FederationTracker`): metrics
    ``eval.global.<metric>`` / ``.error_bar`` and ``alerts_fired`` at step = round;
    artifacts ``envelopes/round_NNN/<metric>/<group>.json`` and ``alerts/round_NNN.json``.
    ``out_dir``: the same files under ``out_dir/envelopes`` and ``out_dir/alerts``.
    Nothing per client: envelopes carry bands, alerts published numbers.
    """
    r = outcome.round
    alerts_doc = {"round": r, "alerts_fired": outcome.alerts_fired,
                  "alerts": [a.model_dump() for a in outcome.alerts]}
    metrics: dict[str, float] = {"alerts_fired": float(outcome.alerts_fired)}
    for name, rep in outcome.published["metrics"].items():
        if rep.get("global"):
            metrics[f"eval.global.{name}"] = rep["global"]["value"]
            metrics[error_bar_key(f"eval.global.{name}")] = rep["global"]["error_bar"]
    roots: list[Path] = []
    if out_dir:
        roots.append(Path(out_dir))
    tmp = None
    if tracker is not None and not out_dir:
        import tempfile

        tmp = tempfile.TemporaryDirectory(prefix="clma-envelopes-")
        roots.append(Path(tmp.name))
    try:
        for root in roots:
            base = root / "envelopes" / f"round_{r:03d}"
            for rel, text in outcome.envelopes.items():
                p = base / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(text)
            a = root / "alerts" / f"round_{r:03d}.json"
            a.parent.mkdir(parents=True, exist_ok=True)
            a.write_text(json.dumps(alerts_doc, indent=2, sort_keys=True) + "\n")
        if tracker is not None:
            tracker.log_metrics(metrics, step=r)
            tracker.client.log_artifacts(
                tracker.run_id, str(roots[0] / "envelopes" / f"round_{r:03d}"),
                f"envelopes/round_{r:03d}")
            tracker.log_dict(alerts_doc, f"alerts/round_{r:03d}.json")
    finally:
        if tmp is not None:
            tmp.cleanup()
