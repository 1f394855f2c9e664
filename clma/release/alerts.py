"""Error-bar alerts on published regional metrics.

Rule
----
An alert fires for (metric, region) iff the current published value differs
from the baseline's by MORE than the sum of the two published error bars:
``|v_now - v_base| > bar_now + bar_base`` (the rule of
:meth:`clma.release.AggregatedMetric.is_significant`, on published bars so that
anyone holding the published numbers can reproduce the decision).  If each
bar covers its noise with probability >= 95 %, a false alert from noise alone
has probability <= 10 % (union bound); in practice much less because both
errors must push the same way.

Baselines
---------
A baseline is recorded the first time a (metric, region) is published under a
given (region-partition version, clip-bounds version).  A change of either
version starts a NEW baseline instead of comparing across versions (a
different partition or clipping changes what is measured).  Baselines hold
only published numbers (value, published error bar, participant band) and are
JSON-serialisable (:meth:`AlertBaselines.to_dict` / ``from_dict``) for the
durable store.

Cadence: detection latency vs budget
------------------------------------
With regional evaluation every k rounds at epsilon_eval per evaluation, R
rounds spend ``(R / k) * epsilon_eval`` (sequential composition over time;
regions compose in parallel).  For a fixed evaluation budget E over R rounds,
``epsilon_eval = E k / R`` and the Laplace bar is ``Delta ln 20 / (epsilon_eval n)
= Delta ln 20 R / (E k n)``: the smallest shift that can fire an alert
(about twice the bar) shrinks as 1/k, while the worst-case detection latency
grows as k rounds.  :func:`evaluation_due` implements the cadence;
:func:`minimum_detectable_shift` gives the trade-off numerically.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from clma.privacy.mechanisms import interval_quantile
from clma.release.aggregate import AggregatedMetric

__all__ = [
    "Alert",
    "AlertBaseline",
    "AlertBaselines",
    "AlertEvaluation",
    "AlertRule",
    "evaluation_due",
    "exceeds_combined_error_bars",
    "minimum_detectable_shift",
]


def exceeds_combined_error_bars(value_a: float, bar_a: float, value_b: float, bar_b: float) -> bool:
    """``|value_a - value_b| > bar_a + bar_b`` (bars are half-widths, >= 0)."""
    if bar_a < 0 or bar_b < 0 or not (math.isfinite(bar_a) and math.isfinite(bar_b)):
        raise ValueError("error bars must be finite and >= 0")
    return abs(value_a - value_b) > bar_a + bar_b


class AlertBaseline(BaseModel):
    """Published reference measurement for one (metric, region, versions)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    metric: str
    region: str
    partition_version: str
    bounds_version: str
    value: float
    error_bar: float = Field(ge=0.0)
    participant_band: str
    round: int


class Alert(BaseModel):
    """A fired alert (published numbers only)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    metric: str
    region: str
    round: int
    baseline_round: int
    baseline_value: float
    value: float
    change: float
    combined_error_bar: float
    partition_version: str
    bounds_version: str


class AlertEvaluation(BaseModel):
    """Outcome of one evaluation: fired alerts and regions that (re)started a baseline."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    alerts: list[Alert]
    new_baselines: dict[str, str]  # region -> reason: first | partition_changed | bounds_changed
    quiet: list[str]


class AlertBaselines(BaseModel):
    """Durable baseline store keyed by ``"metric|region"``."""

    model_config = ConfigDict(extra="forbid")

    baselines: dict[str, AlertBaseline] = Field(default_factory=dict)

    @staticmethod
    def key(metric: str, region: str) -> str:
        return f"{metric}|{region}"

    def get(self, metric: str, region: str) -> AlertBaseline | None:
        return self.baselines.get(self.key(metric, region))

    def set(self, baseline: AlertBaseline) -> None:
        self.baselines[self.key(baseline.metric, baseline.region)] = baseline

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict."""
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AlertBaselines:
        return cls.model_validate(dict(data))


class AlertRule(BaseModel):
    """Fires when a published change exceeds the combined published error bars.

    Attributes:
        metric: metric name the rule watches.
        direction: ``both`` (default), ``increase`` or ``decrease`` — which
            significant changes fire (e.g. ``decrease`` for accuracy).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    metric: str = Field(min_length=1)
    direction: Literal["both", "increase", "decrease"] = "both"

    def evaluate(
        self,
        report: Mapping[str, AggregatedMetric],
        baselines: AlertBaselines,
        *,
        partition_version: str,
        bounds_version: str,
        round: int,
    ) -> AlertEvaluation:
        """Compare each published region with its baseline; updates ``baselines`` in place.

        Args:
            report: region -> AggregatedMetric (suppressed regions are absent).
            baselines: durable store (mutated: new baselines recorded).
            partition_version: version of the region partition in force.
            bounds_version: version of the clip bounds in force.
            round: current round number.
        """
        alerts: list[Alert] = []
        new: dict[str, str] = {}
        quiet: list[str] = []
        for region in sorted(report):
            m = report[region]
            if m.name != self.metric:
                raise ValueError(f"report holds metric {m.name!r}, the rule watches {self.metric!r}")
            bar_now = m.published_error_bar
            base = baselines.get(self.metric, region)
            reason = None
            if base is None:
                reason = "first"
            elif base.partition_version != partition_version:
                reason = "partition_changed"
            elif base.bounds_version != bounds_version:
                reason = "bounds_changed"
            if reason is not None:
                baselines.set(AlertBaseline(
                    metric=self.metric, region=region, partition_version=partition_version,
                    bounds_version=bounds_version, value=m.value, error_bar=bar_now,
                    participant_band=m.participant_band.value, round=round,
                ))
                new[region] = reason
                continue
            assert base is not None
            change = m.value - base.value
            fired = exceeds_combined_error_bars(m.value, bar_now, base.value, base.error_bar)
            if fired and self.direction == "increase":
                fired = change > 0
            elif fired and self.direction == "decrease":
                fired = change < 0
            if fired:
                alerts.append(Alert(
                    metric=self.metric, region=region, round=round, baseline_round=base.round,
                    baseline_value=base.value, value=m.value, change=change,
                    combined_error_bar=bar_now + base.error_bar,
                    partition_version=partition_version, bounds_version=bounds_version,
                ))
            else:
                quiet.append(region)
        return AlertEvaluation(alerts=alerts, new_baselines=new, quiet=quiet)


def evaluation_due(round: int, every_k_rounds: int, *, offset: int = 0) -> bool:
    """True when regional evaluation runs this round (``(round - offset) % k == 0``)."""
    if every_k_rounds < 1:
        raise ValueError("every_k_rounds must be >= 1")
    return round >= offset and (round - offset) % every_k_rounds == 0


def minimum_detectable_shift(
    *, sensitivity: float, total_epsilon: float, rounds: int, every_k_rounds: int, n: int,
    level: float = 0.95,
) -> float:
    """Twice the Laplace bar when a budget ``total_epsilon`` over ``rounds`` is split
    evenly across evaluations every ``every_k_rounds`` rounds (see module docstring)."""
    if rounds < 1 or every_k_rounds < 1 or n < 1:
        raise ValueError("rounds, every_k_rounds and n must be >= 1")
    evaluations = math.ceil(rounds / every_k_rounds)
    eps = total_epsilon / evaluations
    return 2.0 * sensitivity / eps * interval_quantile("laplace", level) / n
