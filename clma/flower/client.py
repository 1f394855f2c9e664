"""Client side of CLMA on Flower: the on-device drift flag and the training reply.

The :class:`clma.drift.LossThresholdDetector` (CLMA Algorithm 2: flag when the received
model's loss on the current local data, before training, rose by more than gamma over the
previous round) keeps its state in the node's ``context.state`` (a ``ConfigRecord`` under
``"clma-drift-detector"``), which Flower preserves between the rounds a node takes part
in. The reply (:func:`train_reply_content`) holds exactly what
:class:`clma.flower.CLMA` reads: the trained ``ArrayRecord`` and a ``MetricRecord`` with
``num-examples`` (int) and ``drift-flag`` (int 0/1). The loss itself never leaves the
device.
"""

from __future__ import annotations

from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict

from clma.drift import LossThresholdDetector
from clma.flower.strategy import DRIFT_FLAG_KEY

__all__ = [
    "DETECTOR_STATE_KEY",
    "load_detector_state",
    "save_detector_state",
    "flag_drift",
    "train_reply_content",
]

DETECTOR_STATE_KEY = "clma-drift-detector"


def load_detector_state(context: Context, key: str = DETECTOR_STATE_KEY) -> dict[str, Any] | None:
    """The detector's ``state_dict`` stored in ``context.state`` (None before the first
    round)."""
    if key not in context.state.config_records:
        return None
    rec = context.state.config_records[key]
    return {
        "kind": "LossThresholdDetector",
        "gamma": float(rec["gamma"]),
        "previous_loss": float(rec["previous-loss"]) if "previous-loss" in rec else None,
        "n_updates": int(rec["n-updates"]),
        "n_flags": int(rec["n-flags"]),
    }


def save_detector_state(context: Context, state: dict[str, Any],
                        key: str = DETECTOR_STATE_KEY) -> None:
    """Store a ``LossThresholdDetector.state_dict()`` in ``context.state``."""
    det = LossThresholdDetector.from_state_dict(state)  # validates
    rec = ConfigRecord({"gamma": float(det.gamma), "n-updates": int(det.n_updates),
                        "n-flags": int(det.n_flags)})
    if det.previous_loss is not None:
        rec["previous-loss"] = float(det.previous_loss)
    context.state.config_records[key] = rec


def flag_drift(context: Context, loss: float, gamma: float,
               key: str = DETECTOR_STATE_KEY) -> bool:
    """Feed this round's pre-training loss to the node's detector; True = drift flagged.

    ``loss``: the received model's loss on the current local data before training (e.g.
    mean cross-entropy in nats); ``gamma`` >= 0 in the same units. The first call on a
    node never flags. Raises ValueError/TypeError for a non-finite loss or bad gamma.
    """
    state = load_detector_state(context, key)
    det = LossThresholdDetector(gamma)
    if state is not None:
        state = {**state, "gamma": float(gamma)}
        det.load_state_dict(state)
    flag = det.update(loss)
    save_detector_state(context, det.state_dict(), key)
    return flag


def train_reply_content(arrays: ArrayRecord, num_examples: int, drift_flag: bool,
                        *, extra_metrics: dict[str, int | float] | None = None) -> RecordDict:
    """The reply a CLMA node sends after training.

    ``arrays``: the trained model; ``num_examples``: local training examples (>= 1, the
    FedAvg weight); ``drift_flag``: the detector's bit. Returns
    ``RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": n,
    "drift-flag": 0|1, ...})})``. Raises ValueError for ``num_examples < 1``.
    """
    if isinstance(num_examples, bool) or int(num_examples) != num_examples or num_examples < 1:
        raise ValueError("num_examples: must be an integer >= 1")
    metrics = MetricRecord({"num-examples": int(num_examples),
                            DRIFT_FLAG_KEY: int(bool(drift_flag))})
    for k, v in (extra_metrics or {}).items():
        metrics[k] = v
    return RecordDict({"arrays": arrays, "metrics": metrics})
