"""CLMA on Flower's message API (optional extra ``flower``; imports ``flwr``).

* :class:`CLMA` — drop-in replacement for ``flwr.serverapp.strategy.FedAvg`` keeping one
  model per cohort (:mod:`clma.flower.strategy`).
* :mod:`clma.flower.client` — the on-device drift flag kept in ``context.state`` and the
  training reply.
* :class:`PrivateEvaluation` — wraps a strategy's evaluate step with on-device clipped
  metrics, the project's secure aggregation (:mod:`clma.privacy.secagg`) carried in Flower
  messages, DP noise once on the aggregate and envelopes (:mod:`clma.flower.private`).

``import clma`` does not import this package.
"""

from clma.flower.arrays import ArrayLayout
from clma.flower.client import (
    flag_drift,
    load_detector_state,
    save_detector_state,
    train_reply_content,
)
from clma.flower.strategy import CLMA, COHORT_ID_KEY, DRIFT_FLAG_KEY

__all__ = [
    "CLMA",
    "COHORT_ID_KEY",
    "DRIFT_FLAG_KEY",
    "ArrayLayout",
    "flag_drift",
    "load_detector_state",
    "save_detector_state",
    "train_reply_content",
]
