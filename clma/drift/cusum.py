"""One-sided CUSUM on a client's own loss rises, scaled by the client's own variability.

The loss-threshold flag (:class:`clma.drift.LossThresholdDetector`) compares every rise
with one federation-wide ``gamma`` in nats. Under non-IID clients and covariate drift a
client's loss varies on its own scale, so one ``gamma`` misses small but persistent rises
on quiet clients and over-flags noisy ones. :class:`CusumDetector` standardises each rise
by the client's own robust scale and accumulates them (Page 1954):

* the first ``burn_in`` losses are skipped (the first is the untrained model's loss,
  whose drop to the second would dominate any scale estimate);
* rise ``r_t = loss_t - loss_{t-1}`` (float64);
* scale ``s_t = max(1.4826 * MAD(R), min_scale)`` where ``R`` holds the last ``window``
  in-control rises (``MAD(R) = median(|R - median(R)|)``; 1.4826 makes it the standard
  deviation of normal data);
* statistic ``S_t = max(0, S_{t-1} + r_t / s_t - k)``; flag iff ``S_t > h`` (strict).
  While fewer than ``warmup`` rises are in ``R`` nothing flags and ``S`` stays 0;
* a flagged rise does not enter ``R`` (drift must not inflate the in-control scale) and
  ``S`` restarts at 0 after a flag.

Average run length (ARL) for standardised rises ``z ~ N(mu, 1)``, Siegmund's
approximation (Siegmund 1985, eq. 2.57; :func:`cusum_arl`):
``ARL(mu) = (exp(-2 D b) + 2 D b - 1) / (2 D^2)``, ``D = mu - k``, ``b = h + 1.166``
(``b^2`` for ``D = 0``). The defaults ``k = 0.5``, ``h = 4`` give ARL0 = 338 rounds
between false alarms in control and ARL = 8.3 rounds at a one-standard-deviation shift;
a single rise of ``h + k = 4.5`` scales flags at once.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from clma._validation import field_errors
from clma.drift.detectors import DriftDetector, check_loss

__all__ = ["CusumDetector", "CusumParams", "cusum_arl"]

MAD_TO_SD = 1.4826


class DetectorParams(BaseModel):
    """Base of every detector's declared parameters: strict, frozen, no unknown field, no
    NaN or infinity (a bad value is refused naming its field)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False,
                              validate_default=True)


class CusumParams(DetectorParams):
    """Declared parameters of :class:`CusumDetector` (also ``drift.cusum`` in the config).

    ``k`` reference value (in scales, >= 0), ``h`` decision interval (in scales, > 0),
    ``burn_in`` losses skipped before the series starts (>= 0), ``warmup`` in-control rises
    needed before a flag (>= 2), ``window`` rises kept for the scale (>= warmup),
    ``min_scale`` floor of the scale in nats (> 0).
    """


    k: Annotated[float, Field(ge=0.0, le=10.0)] = Field(
        default=0.5, description="Reference value k: drift smaller than k scales per round "
        "is not accumulated.")
    h: Annotated[float, Field(gt=0.0, le=100.0)] = Field(
        default=4.0, description="Decision interval h (scales): flag when the statistic "
        "exceeds it. k=0.5, h=4: ARL0 338 rounds, ARL 8.3 at a 1-scale shift (Siegmund).")
    burn_in: Annotated[int, Field(ge=0, le=1000)] = Field(
        default=1, description="Losses skipped before the series starts (the untrained "
        "model's first loss).")
    warmup: Annotated[int, Field(ge=2, le=1000)] = Field(
        default=2, description="In-control rises needed before any flag.")
    window: Annotated[int, Field(ge=2, le=10_000)] = Field(
        default=20, description="In-control rises kept for the running robust scale.")
    min_scale: Annotated[float, Field(gt=0.0, le=100.0)] = Field(
        default=0.02, description="Floor of the scale (nats): a client whose loss barely "
        "moves is not flagged for a rounding-level rise.")

    @model_validator(mode="after")
    def _window_holds_warmup(self) -> CusumParams:
        if self.window < self.warmup:
            raise ValueError("window: must be >= warmup")
        return self


def _params(cls: type[BaseModel], values: dict[str, Any], prefix: str) -> Any:
    """``cls(**values)`` or ValueError naming ``prefix.field`` and the rule."""
    try:
        return cls.model_validate(values)
    except ValidationError as err:
        msgs = [f"{prefix}{loc}: {msg}" for loc, msg, _ in field_errors(err, "(params)")]
        raise ValueError("; ".join(msgs)) from None


def cusum_arl(k: float, h: float, shift: float = 0.0) -> float:
    """Siegmund's approximation of the one-sided CUSUM's average run length (rounds) for
    standardised observations ``N(shift, 1)`` with reference ``k`` and interval ``h``
    (module docstring). Raises ValueError for ``h <= 0`` or non-finite input."""
    for name, v in (("k", k), ("h", h), ("shift", shift)):
        if not math.isfinite(float(v)):
            raise ValueError(f"{name}: must be finite")
    if h <= 0:
        raise ValueError("h: must be > 0")
    d, b = float(shift) - float(k), float(h) + 1.166
    if abs(d) < 1e-12:
        return b * b
    return (math.exp(-2.0 * d * b) + 2.0 * d * b - 1.0) / (2.0 * d * d)


class CusumDetector(DriftDetector):
    """One-sided CUSUM of standardised loss rises (module docstring for the formula).

    Args: the fields of :class:`CusumParams` as keywords (defaults there).

    Raises:
        ValueError: a parameter outside its declared domain (message names it).

    Source: E. S. Page, "Continuous inspection schemes", Biometrika 41 (1954); robust
    scale: Hampel (1974) MAD; ARL: Siegmund, Sequential Analysis (1985).
    """

    def __init__(self, **params: Any) -> None:
        self.params: CusumParams = _params(CusumParams, params, "")
        self.reset()

    def __repr__(self) -> str:
        p = self.params
        return f"CusumDetector(k={p.k}, h={p.h}, warmup={p.warmup}, window={p.window})"

    # ------------------------------------------------------------------ core
    def scale(self) -> float:
        """The current robust scale ``max(1.4826 * MAD(R), min_scale)`` (nats)."""
        if not self.rises:
            return self.params.min_scale
        r = np.asarray(self.rises, dtype=np.float64)
        mad = float(np.median(np.abs(r - np.median(r))))
        return max(MAD_TO_SD * mad, self.params.min_scale)

    def update(self, loss: float) -> bool:
        value = check_loss(loss)
        p = self.params
        self.n_updates += 1
        self.n_seen += 1
        if self.n_seen <= p.burn_in:
            return False
        prev, self.previous_loss = self.previous_loss, value
        if prev is None:
            return False
        rise = value - prev
        if len(self.rises) < p.warmup:
            self._remember(rise)
            return False
        z = rise / self.scale()
        self.statistic = max(0.0, self.statistic + z - p.k)
        flag = self.statistic > p.h
        if flag:
            self.statistic = 0.0
            self.n_flags += 1
        else:
            self._remember(rise)
        return bool(flag)

    def _remember(self, rise: float) -> None:
        self.rises.append(float(rise))
        del self.rises[: max(0, len(self.rises) - self.params.window)]

    def reset(self) -> None:
        self.previous_loss: float | None = None
        self.rises: list[float] = []
        self.statistic = 0.0
        self.n_seen = 0
        self.n_updates = 0
        self.n_flags = 0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"kind": "CusumDetector", "params": self.params.model_dump(),
                "previous_loss": self.previous_loss, "rises": list(self.rises),
                "statistic": self.statistic, "n_seen": self.n_seen,
                "n_updates": self.n_updates, "n_flags": self.n_flags}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("kind") != "CusumDetector":
            raise ValueError("state: not a CusumDetector state_dict")
        params = _params(CusumParams, dict(state.get("params") or {}), "state.params.")
        prev = state.get("previous_loss")
        prev = None if prev is None else check_loss(prev, "state.previous_loss")
        rises = state.get("rises", [])
        if not isinstance(rises, list):
            raise ValueError("state.rises: must be a list of numbers")
        rises = [check_loss(r, "state.rises") for r in rises][-params.window:]
        stat = check_loss(state.get("statistic", 0.0), "state.statistic")
        if stat < 0:
            raise ValueError("state.statistic: must be >= 0")
        counts = {}
        for name in ("n_seen", "n_updates", "n_flags"):
            v = state.get(name, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"state.{name}: must be an integer >= 0")
            counts[name] = v
        if counts["n_flags"] > counts["n_updates"]:
            raise ValueError("state.n_flags: must be <= state.n_updates")
        self.params, self.previous_loss, self.rises, self.statistic = params, prev, rises, stat
        self.n_seen, self.n_updates, self.n_flags = (counts["n_seen"], counts["n_updates"],
                                                     counts["n_flags"])
