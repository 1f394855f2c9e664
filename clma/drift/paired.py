"""The loss threshold, confirmed on the same model: a change of the data, not of the model.

CLMA's on-device flag (:class:`clma.drift.LossThresholdDetector`) compares the loss of
the model a client received this round with the loss of the model it received the round
before, each on the data of its own round. The rise mixes two causes: the data changed
(a drift) or the model changed (a server step that overshoots the cohort's optimum, a
cohort that moved). Only the first is a drift; the second, flagged, quarantines clients
whose data never moved and splits their cohort (docs/realistic_drift.md section 8: ten of
fifteen clients of one cohort flag at once after an overshooting server step).

:class:`PairedLossDetector` keeps the model the device received at its previous update
and scores it again on the current records. With ``m_t`` the model received at round
``t``, ``D_t`` the device's records of that round and ``CE(m, D)`` the mean cross-entropy
of ``m`` on ``D`` (nats):

* ``loss_t``: the received model's loss before training (``LocalFit.pre_loss``, the
  paper's loss);
* ``reference_t = CE(m_t, D_t)`` and ``same_model_t = CE(m_{t-1}, D_t)`` (the device's
  scorer: ``learner.predict_training``, else ``learner.predict``);
* flag iff ``loss_t - loss_{t-1} > gamma`` (the loss threshold, strict) **and**
  ``same_model_t - reference_{t-1} > min_data_rise`` (strict): the model of the previous
  round fits the current records worse than it fitted that round's own, so the data
  moved. ``same_model_t - reference_{t-1}`` is a paired difference: one model, two sets
  of records; with unchanged records it is exactly 0.

So it flags a subset of what the loss threshold flags: every flag the loss threshold
raises on a data change at least ``min_data_rise`` large, none it raises on a model
change alone. The first update (and the first after :meth:`PairedLossDetector.reset`)
never flags.

The previous model stays on the device, in the detector's state (float32,
zlib-compressed base64: one model vector per state kept by
:class:`clma.drift.RoundKeyedState`); no loss and no model leaves the device.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import Field

from clma.drift._arrays import decode_array, encode_array
from clma.drift.cusum import DetectorParams, _params
from clma.drift.detectors import DriftDetector, check_loss

__all__ = ["PairedLossDetector", "PairedLossParams", "mean_cross_entropy"]


class PairedLossParams(DetectorParams):
    """Declared parameters of :class:`PairedLossDetector` (also ``drift.paired_loss``).

    ``min_data_rise``: nats, >= 0; how much worse the previous round's model must fit the
    current records than it fitted that round's own for a loss rise to count as a drift.
    """

    min_data_rise: Annotated[float, Field(ge=0.0, le=100.0)] = Field(
        default=0.1, description="Nats: a loss rise above drift.gamma flags only if the "
        "model the device received the round before also fits the current records worse, "
        "by more than this, than it fitted that round's own (a change of the data, not of "
        "the model).")


def mean_cross_entropy(probabilities: Any, labels: Any, field: str = "learner") -> float:
    """Mean cross-entropy (nats) of ``probabilities`` ``(n, n_classes)`` at the integer
    ``labels`` ``(n,)``; probabilities are clipped below at 1e-12.

    Raises:
        ValueError: shapes that do not match, no record, or a label outside the classes
            (names ``field``).
    """
    proba = np.asarray(probabilities, dtype=np.float64)
    y = np.asarray(labels)
    if y.ndim != 1 or proba.ndim != 2 or proba.shape[0] != y.size:
        raise ValueError(f"{field}: probabilities must be (n, n_classes) for n labels")
    if y.size == 0:
        raise ValueError(f"{field}: no local records to score")
    y = y.astype(np.int64)
    if y.min() < 0 or y.max() >= proba.shape[1]:
        raise ValueError(f"{field}: labels must lie in [0, n_classes)")
    p = proba[np.arange(y.size), y]
    return float(-np.log(np.clip(p, 1e-12, None)).mean())


class PairedLossDetector(DriftDetector):
    """The loss threshold, confirmed on the same model (module docstring).

    The device calls :meth:`update` with the received model's loss, that model and its
    two scores (``reference`` on the current records, ``same_model`` the previous model's
    score on the current records, computed with :attr:`previous_model`; None at the first
    update). :func:`clma.device.train_on_device` does this when
    ``needs_previous_model`` is set.

    Args:
        gamma: the loss threshold (nats, finite, >= 0): ``drift.gamma``.
        **params: the fields of :class:`PairedLossParams`.

    Raises:
        ValueError: a parameter outside its domain (names it).

    Source: CLMA (CODS-COMAD 2024), on-device loss threshold; the paired check is this
    project's (docs/realistic_drift.md section 8).
    """

    needs_previous_model: ClassVar[bool] = True
    kind = "PairedLossDetector"

    def __init__(self, gamma: float, **params: Any) -> None:
        g = check_loss(gamma, "gamma")
        if g < 0:
            raise ValueError("gamma: must be >= 0")
        self.gamma = g
        self.params: PairedLossParams = _params(PairedLossParams, params, "")
        self.reset()

    def __repr__(self) -> str:
        return (f"PairedLossDetector(gamma={self.gamma}, "
                f"min_data_rise={self.params.min_data_rise})")

    def update(self, loss: float, *, model: Any = None, reference: float | None = None,
               same_model: float | None = None) -> bool:
        """Record one round; True if drift is flagged.

        Args:
            loss: the received model's loss before training (nats).
            model: the received model, float32 ``(n_params,)`` (kept for the next round).
            reference: ``CE(model, current records)`` (nats).
            same_model: ``CE(previous_model, current records)`` (nats); None when there
                is no previous model.

        Raises:
            ValueError / TypeError: a missing or non-finite value, a model of another
                size than the kept one, or ``same_model`` given without a previous model
                (or missing with one); the state is then unchanged.
        """
        value = check_loss(loss)
        ref = check_loss(reference, "reference")
        if model is None:
            raise ValueError("model: the paired-loss detector keeps the received model")
        m = np.asarray(model, dtype=np.float32).ravel()
        if m.size < 1 or not np.isfinite(m).all():
            raise ValueError("model: must be a finite float vector (n_params,)")
        if self.previous_model is None:
            if same_model is not None:
                raise ValueError("same_model: there is no previous model to score")
            data_rise = None
        else:
            if same_model is None:
                raise ValueError("same_model: the previous model's score on the current "
                                 "records is needed")
            if m.size != self.previous_model.size:
                raise ValueError("model: another number of parameters than the kept model")
            data_rise = check_loss(same_model, "same_model") - self.reference  # type: ignore[operator]
        loss_rise = None if self.previous_loss is None else value - self.previous_loss
        loss_flag = loss_rise is not None and loss_rise > self.gamma
        flag = bool(loss_flag and data_rise is not None
                    and data_rise > self.params.min_data_rise)
        self.last_data_rise = data_rise
        self.previous_loss, self.reference, self.previous_model = value, ref, m.copy()
        self.n_updates += 1
        self.n_flags += int(flag)
        self.n_model_changes += int(loss_flag and not flag)
        return flag

    @staticmethod
    def slim_state(state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (a :meth:`state_dict`) without the kept model: what
        :class:`clma.drift.RoundKeyedState` keeps for rounds older than the newest two, so
        a device holds two copies of the model instead of one per kept round. Restored
        after a rollback that deep, the detector has no previous model (no flag that
        round, as in a client's first round)."""
        return {**state, "previous_model": None, "reference": None}

    def reset(self) -> None:
        self.previous_loss: float | None = None
        self.reference: float | None = None
        self.previous_model: np.ndarray | None = None
        self.last_data_rise: float | None = None
        self.n_updates = 0
        self.n_flags = 0
        self.n_model_changes = 0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """JSON data; ``n_model_changes`` counts the loss rises above gamma not flagged
        because the previous model did not fit the current records worse."""
        return {"kind": self.kind, "params": self.params.model_dump(), "gamma": self.gamma,
                "previous_loss": self.previous_loss, "reference": self.reference,
                "previous_model": (None if self.previous_model is None
                                   else encode_array(self.previous_model)),
                "last_data_rise": self.last_data_rise, "n_updates": self.n_updates,
                "n_flags": self.n_flags, "n_model_changes": self.n_model_changes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("kind") != self.kind:
            raise ValueError(f"state: not a {self.kind} state_dict")
        params = _params(PairedLossParams, dict(state.get("params") or {}), "state.params.")
        gamma = check_loss(state.get("gamma"), "state.gamma")
        if gamma < 0:
            raise ValueError("state.gamma: must be >= 0")
        values = {}
        for name in ("previous_loss", "reference", "last_data_rise"):
            v = state.get(name)
            values[name] = None if v is None else check_loss(v, f"state.{name}")
        model = state.get("previous_model")
        model = None if model is None else decode_array(model, "state.previous_model", 1)
        counts = {}
        for name in ("n_updates", "n_flags", "n_model_changes"):
            v = state.get(name, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"state.{name}: must be an integer >= 0")
            counts[name] = v
        if counts["n_flags"] + counts["n_model_changes"] > counts["n_updates"]:
            raise ValueError("state.n_flags: n_flags + n_model_changes must be <= n_updates")
        # previous_loss exactly when n_updates > 0; the model with its reference, both
        # absent in a slimmed state (slim_state)
        if ((values["previous_loss"] is not None) != (counts["n_updates"] > 0)
                or (values["reference"] is not None) != (model is not None)
                or (model is not None and counts["n_updates"] == 0)):
            raise ValueError("state.previous_model: previous_loss must be present exactly "
                             "when n_updates > 0, and reference exactly with previous_model")
        self.params, self.gamma = params, gamma
        self.previous_loss, self.reference = values["previous_loss"], values["reference"]
        self.last_data_rise, self.previous_model = values["last_data_rise"], model
        self.n_updates, self.n_flags = counts["n_updates"], counts["n_flags"]
        self.n_model_changes = counts["n_model_changes"]

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> PairedLossDetector:
        """A detector restored from :meth:`state_dict` output."""
        det = cls(gamma=check_loss(state.get("gamma") if isinstance(state, dict) else None,
                                   "state.gamma"))
        det.load_state_dict(state)
        return det

