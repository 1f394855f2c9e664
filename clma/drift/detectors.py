"""On-device drift detectors (CLMA, Algorithm 2: local loss-threshold drift flag).

:class:`DriftDetector` is the extension point: one detector per client, fed one loss per
round, returning True when drift is flagged. A detector whose class sets
``needs_inputs = True`` (:class:`clma.drift.InputKSDetector`) is also given the device's
current inputs: ``update(loss, inputs, seed=...)``; one that sets
``needs_previous_model = True`` (:class:`clma.drift.PairedLossDetector`) is also given the
received model and two scores of the device's records. Its state is a plain JSON-able dict
(:meth:`DriftDetector.state_dict`) so the client side of a simulation can persist it
between flow runs.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

__all__ = ["DriftDetector", "LossThresholdDetector", "check_loss"]


def check_loss(loss: object, field: str = "loss") -> float:
    """Return ``loss`` as a finite float or raise ``ValueError``/``TypeError`` naming ``field``."""
    if isinstance(loss, bool) or not isinstance(loss, (int, float)) and not hasattr(
            loss, "__float__"):
        raise TypeError(f"{field}: must be a real number")
    value = float(loss)  # type: ignore[arg-type]
    if not math.isfinite(value):
        raise ValueError(f"{field}: must be finite")
    return value


class DriftDetector(ABC):
    """Extension point: a per-client drift detector fed one loss per observation.

    ``needs_inputs``: False for loss-only detectors (``update(loss)``); True for a detector
    that also tests the device's inputs (``update(loss, inputs, seed=...)``; the device
    then fails the round with an error naming ``drift.detector`` if its learner gives no
    inputs).
    """

    needs_inputs: ClassVar[bool] = False
    #: True for a detector that also scores the model the device received the round
    #: before (:class:`clma.drift.PairedLossDetector`): ``update(loss, model=...,
    #: reference=..., same_model=...)``.
    needs_previous_model: ClassVar[bool] = False

    @abstractmethod
    def update(self, loss: float) -> bool:
        """Record one loss; True if drift is flagged by this observation."""

    @abstractmethod
    def reset(self) -> None:
        """Forget all observations (configuration is kept)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Configuration and state as a JSON-able dict."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` output (validated)."""


class LossThresholdDetector(DriftDetector):
    """Flag drift when this round's local loss exceeds the previous round's by more than gamma.

    Which loss: the loss of the model the client *received* this round (its cohort's
    aggregate), evaluated on the client's *current* local data *before* local training.
    A concept drift makes the received model fit the new local data worse, so this loss
    rises; training loss after local epochs would hide it.

    Rule: with ``previous`` the loss recorded at the client's previous update,
    ``flag = (loss - previous) > gamma`` (strict: a rise of exactly ``gamma`` does not flag;
    the difference is computed as a float64 subtraction). The first observation (and the
    first after :meth:`reset`) never flags. Every update, flagged or not, becomes the
    ``previous`` of the next one.

    Parameters
    ----------
    gamma:
        Finite threshold >= 0, in the loss's units (e.g. nats for cross-entropy).

    Source: CLMA (Adarsh N L et al., CODS-COMAD 2024), on-device drift detection.
    """

    def __init__(self, gamma: float) -> None:
        g = check_loss(gamma, "gamma")
        if g < 0:
            raise ValueError("gamma: must be >= 0")
        self.gamma = g
        self.previous_loss: float | None = None
        self.n_updates = 0
        self.n_flags = 0

    def __repr__(self) -> str:
        return f"LossThresholdDetector(gamma={self.gamma})"

    def update(self, loss: float) -> bool:
        value = check_loss(loss)
        flag = self.previous_loss is not None and (value - self.previous_loss) > self.gamma
        self.previous_loss = value
        self.n_updates += 1
        self.n_flags += int(flag)
        return bool(flag)

    def reset(self) -> None:
        self.previous_loss = None
        self.n_updates = 0
        self.n_flags = 0

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "LossThresholdDetector", "gamma": self.gamma,
                "previous_loss": self.previous_loss, "n_updates": self.n_updates,
                "n_flags": self.n_flags}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("kind") != "LossThresholdDetector":
            raise ValueError("state: not a LossThresholdDetector state_dict")
        gamma = check_loss(state["gamma"], "state.gamma")
        if gamma < 0:
            raise ValueError("state.gamma: must be >= 0")
        prev = state.get("previous_loss")
        prev = None if prev is None else check_loss(prev, "state.previous_loss")
        n_updates, n_flags = int(state.get("n_updates", 0)), int(state.get("n_flags", 0))
        if n_updates < 0 or n_flags < 0 or n_flags > n_updates:
            raise ValueError("state.n_updates/n_flags: must satisfy 0 <= n_flags <= n_updates")
        self.gamma, self.previous_loss = gamma, prev
        self.n_updates, self.n_flags = n_updates, n_flags

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> LossThresholdDetector:
        """A detector restored from :meth:`state_dict` output."""
        det = cls(gamma=state["gamma"])
        det.load_state_dict(state)
        return det
