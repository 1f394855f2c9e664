"""Prefect tasks of the evaluation path: regional releases of the round's metrics.

The server aggregates numbers, it never computes them: clients evaluate on device and
clip; per region the clipped values are summed, noised once on the aggregate, and
published with an error bar known in advance; regions below the cohort floor are
suppressed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE

from clma.release import MetricSpec, regional_report
from clma.sim.federation import ClientEvaluation, SimulatedFederation

__all__ = ["evaluate_regions_task"]


def _metric_specs(fed: SimulatedFederation) -> dict[str, MetricSpec]:
    return {
        "accuracy": MetricSpec("accuracy", 0.0, 1.0),
        "loss": MetricSpec("loss", 0.0, fed.config.evaluation.loss_max),
    }


@task(name="evaluate-regions", cache_policy=NO_CACHE, persist_result=False)
def evaluate_regions_task(
    fed: SimulatedFederation, evaluations: list[ClientEvaluation], round_number: int
) -> dict[str, Any]:
    """Per region, per metric: clipped mean with Laplace noise once on the sum, the error
    bar known in advance, suppression below the cohort floor (parallel composition:
    every region spends the full evaluation epsilon). Returns the published view."""
    ev = fed.config.evaluation
    out: dict[str, Any] = {"round": round_number, "metrics": {}}
    for name, spec in _metric_specs(fed).items():
        by_region: dict[str, list[float]] = {r: [] for r in fed.partition.region_ids}
        for e in evaluations:
            by_region[e.region].append(getattr(e, name))
        seed = (
            int(np.random.default_rng([fed.config.seed, round_number, 101]).integers(2**31))
            + len(name)
            if ev.noise_seeded
            else None
        )
        report = regional_report(
            {r: np.asarray(v, dtype=np.float64) for r, v in by_region.items()},
            spec,
            epsilon_total=ev.epsilon,
            min_cohort=ev.min_cohort,
            seed=seed,
        )
        out["metrics"][name] = report.to_published_dict()
    out["epsilon_spent"] = ev.epsilon * len(out["metrics"])
    return out
