"""river's drift detectors (Page-Hinkley, ADWIN) on a client's loss series, on the device.

The detection itself is river's (``river.drift.PageHinkley``, ``river.drift.ADWIN``,
river 0.26); these wrappers give them the :class:`clma.drift.DriftDetector` interface: one
loss per round in, a flag out, a JSON-able state.

State: the parameters plus the loss series since the last :meth:`reset`; loading a state
rebuilds river's detector from the parameters and replays the series through it. Why
replay rather than pickle: river's ADWIN keeps its window in a Rust object
(``river._river_rust``) whose pickled form is not plain data and is tied to the river
build; unpickling a state file would also execute whatever a tampered file holds. Both
detectors are deterministic, so replaying the same series gives river's exact internal
state (tested against an uninterrupted detector). Cost: the state grows by one float per
round and loading it is O(rounds) river updates (about 1 µs each).

river is the ``drift`` extra (``pip install 'clma[drift]'``, part of ``device`` and
``all``); it is imported when one of these detectors is built.
"""

from __future__ import annotations

import importlib
from typing import Annotated, Any, Literal

from pydantic import Field

from clma.drift.cusum import DetectorParams, _params
from clma.drift.detectors import DriftDetector, check_loss

__all__ = ["ADWINDetector", "ADWINParams", "PageHinkleyDetector", "PageHinkleyParams"]


class PageHinkleyParams(DetectorParams):
    """Parameters of ``river.drift.PageHinkley`` (also ``drift.page_hinkley``).

    Defaults differ from river's (30 instances, threshold 50, mode both), which suit long
    streams of unit-scale values: a client sends one loss per round, in nats, and only a
    rise means drift.
    """

    min_instances: Annotated[int, Field(ge=1, le=100_000)] = Field(
        default=3, description="Losses seen before a flag is possible.")
    delta: Annotated[float, Field(ge=0.0, le=100.0)] = Field(
        default=0.05, description="Tolerated drift per round (nats) subtracted from each "
        "deviation from the running mean.")
    threshold: Annotated[float, Field(gt=0.0, le=1e6)] = Field(
        default=0.5, description="lambda: flag when the cumulative deviation above its "
        "minimum exceeds it (nats).")
    alpha: Annotated[float, Field(gt=0.0, le=1.0)] = Field(
        default=0.9999, description="Forgetting factor of the cumulative sums (river's).")
    mode: Literal["up", "down", "both"] = Field(
        default="up", description="Which changes of the mean flag: 'up' (a loss rise).")


class ADWINParams(DetectorParams):
    """Parameters of ``river.drift.ADWIN`` (also ``drift.adwin``), plus ``direction``.

    ``clock`` defaults to 1 (river: 32): with one loss per round every round is checked.
    ``direction = "up"`` keeps only river's detections whose new window mean is above the
    mean of the part it dropped (a loss rise); ``"both"`` is river's output unchanged.
    """

    delta: Annotated[float, Field(gt=0.0, lt=1.0)] = Field(
        default=0.002, description="Confidence of the cut test (river's default).")
    clock: Annotated[int, Field(ge=1, le=100_000)] = Field(
        default=1, description="Check for a cut every `clock` losses.")
    max_buckets: Annotated[int, Field(ge=2, le=1000)] = Field(
        default=5, description="Buckets of each size kept before merging (river's).")
    min_window_length: Annotated[int, Field(ge=1, le=100_000)] = Field(
        default=2, description="Smallest sub-window a cut may leave.")
    grace_period: Annotated[int, Field(ge=1, le=100_000)] = Field(
        default=4, description="Losses seen before any cut is tested.")
    direction: Literal["up", "both"] = Field(
        default="up", description="'up': flag only a rise of the window mean.")


def _river_drift() -> Any:
    try:
        return importlib.import_module("river.drift")
    except ImportError:  # pragma: no cover - exercised only without the extra
        raise ImportError("drift.detector: page_hinkley and adwin need river "
                          "(pip install 'clma[drift]')") from None


class _RiverDetector(DriftDetector):
    """Shared parts: params, the replayed series, counters, state round trip."""

    kind: str
    params_model: type[DetectorParams]

    def __init__(self, **params: Any) -> None:
        self.params = _params(self.params_model, params, "")
        self.reset()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.model_dump().items())
        return f"{type(self).__name__}({args})"

    def _build(self) -> Any:
        raise NotImplementedError

    def _feed(self, x: float) -> bool:
        self.river.update(x)
        return bool(self.river.drift_detected)

    def update(self, loss: float) -> bool:
        value = check_loss(loss)
        self.series.append(value)
        flag = self._feed(value)
        self.n_updates += 1
        self.n_flags += int(flag)
        return flag

    def reset(self) -> None:
        self.river = self._build()
        self.series: list[float] = []
        self.n_updates = 0
        self.n_flags = 0

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "params": self.params.model_dump(),
                "series": list(self.series), "n_updates": self.n_updates,
                "n_flags": self.n_flags}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("kind") != self.kind:
            raise ValueError(f"state: not a {self.kind} state_dict")
        params = _params(self.params_model, dict(state.get("params") or {}), "state.params.")
        series = state.get("series", [])
        if not isinstance(series, list):
            raise ValueError("state.series: must be a list of numbers")
        series = [check_loss(x, "state.series") for x in series]
        counts = {}
        for name in ("n_updates", "n_flags"):
            v = state.get(name, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"state.{name}: must be an integer >= 0")
            counts[name] = v
        if counts["n_flags"] > counts["n_updates"]:
            raise ValueError("state.n_flags: must be <= state.n_updates")
        self.params = params
        self.river = self._build()
        for x in series:  # replay: river's state after exactly this series
            self._feed(x)
        self.series = series
        self.n_updates, self.n_flags = counts["n_updates"], counts["n_flags"]


class PageHinkleyDetector(_RiverDetector):
    """``river.drift.PageHinkley`` on the client's losses (nats); the flag is river's
    ``drift_detected`` after each update. River restarts its sums at the update after a
    detection. Parameters: :class:`PageHinkleyParams`.

    Source: E. S. Page (1954); D. V. Hinkley (1971); river 0.26 ``drift.PageHinkley``.
    """

    kind = "PageHinkleyDetector"
    params_model = PageHinkleyParams

    def _build(self) -> Any:
        p = self.params
        return _river_drift().PageHinkley(min_instances=p.min_instances, delta=p.delta,
                                          threshold=p.threshold, alpha=p.alpha, mode=p.mode)


class ADWINDetector(_RiverDetector):
    """``river.drift.ADWIN`` on the client's losses; flag = river's ``drift_detected``,
    restricted to rises of the window mean when ``direction = "up"`` (mean of the kept
    window after the cut > mean of the dropped part, from river's ``total`` and
    ``width`` before and after the update). Parameters: :class:`ADWINParams`.

    Source: A. Bifet, R. Gavaldà, "Learning from time-changing data with adaptive
    windowing", SDM 2007; river 0.26 ``drift.ADWIN``.
    """

    kind = "ADWINDetector"
    params_model = ADWINParams

    def _build(self) -> Any:
        p = self.params
        return _river_drift().ADWIN(delta=p.delta, clock=p.clock, max_buckets=p.max_buckets,
                                    min_window_length=p.min_window_length,
                                    grace_period=p.grace_period)

    def _feed(self, x: float) -> bool:
        total0, width0 = float(self.river.total), int(self.river.width)
        self.river.update(x)
        if not self.river.drift_detected:
            return False
        if self.params.direction == "both":
            return True
        total1, width1 = float(self.river.total), int(self.river.width)
        dropped = width0 + 1 - width1
        if dropped <= 0 or width1 <= 0:
            return False
        return (total1 / width1) > (total0 + x - total1) / dropped
