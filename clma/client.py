"""fed-clma 0.1.1's client-side helpers over this project's drift detectors (imports flwr).

* :class:`DriftReporter` -- ``DriftReporter(context).build_reply(msg, arrays=..., loss=...,
  num_examples=...)``: feeds ``loss`` to a :class:`clma.drift.LossThresholdDetector`
  (gamma 0.1 by default, fed-clma's), persisted in ``context.state`` across rounds, and
  builds the train reply in fed-clma's format: ``"arrays"`` (the ``ArrayRecord``) and
  ``"metrics"`` (``num-examples``, :data:`LOSS_KEY`, :data:`DRIFT_KEY` as 0/1).
  :class:`clma.flower.CLMA` accepts such replies (:mod:`clma.flower.fedclma`).
* :func:`cohort_id` -- the cohort a train message names (:data:`COHORT_KEY` in its
  ``"config"``, or this project's ``"clma"`` header).
* :class:`InferenceDriftMonitor` -- Algorithm 4, :class:`clma.drift.InferenceDriftMonitor`
  (windowed mean-shift test, not fed-clma's batch-to-batch threshold; README), with
  ``observe``/``reset``.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from clma.drift import DriftDetector, InferenceDriftMonitor, LossThresholdDetector
from clma.interop import COHORT_KEY, DRIFT_KEY, LOSS_KEY, NUM_EXAMPLES_KEY

__all__ = ["COHORT_KEY", "DEFAULT_GAMMA", "DRIFT_KEY", "LOSS_KEY", "NUM_EXAMPLES_KEY",
           "STATE_KEY", "DriftReporter", "InferenceDriftMonitor", "cohort_id"]

#: Key of the detector's state in ``Context.state`` (fed-clma's).
STATE_KEY = "clma-detector-state"
#: fed-clma's default loss-rise threshold (the paper's gamma).
DEFAULT_GAMMA = 0.1


def _default_detector() -> DriftDetector:
    return LossThresholdDetector(gamma=DEFAULT_GAMMA)


class DriftReporter:
    """A drift detector persisted across rounds in ``context.state`` (fed-clma's API).

    ``detector_factory`` builds a fresh detector (default: ``LossThresholdDetector(0.1)``);
    its state (:meth:`DriftDetector.state_dict`, as JSON) is restored from and written back
    to ``context.state[STATE_KEY]``.
    """

    def __init__(self, context: Context,
                 detector_factory: Callable[[], DriftDetector] = _default_detector) -> None:
        self.context = context
        self.detector = detector_factory()
        stored = context.state.config_records.get(STATE_KEY) if STATE_KEY in context.state \
            else None
        if stored is not None:
            self.detector.load_state_dict(json.loads(str(stored["json"])))

    def _persist(self) -> None:
        self.context.state[STATE_KEY] = ConfigRecord(
            {"json": json.dumps(self.detector.state_dict())})

    def observe(self, loss: float) -> bool:
        """Feed this round's loss, persist the detector, return the drift flag."""
        flag = self.detector.update(loss)
        self._persist()
        return bool(flag)

    def reset(self) -> None:
        """Clear the detector's history (persisted)."""
        self.detector.reset()
        self._persist()

    def build_reply(self, msg: Message, arrays: ArrayRecord, loss: float, num_examples: int,
                    extra_metrics: dict[str, float] | None = None) -> Message:
        """The train reply: ``arrays`` plus ``num-examples``, loss and drift flag."""
        if isinstance(num_examples, bool) or int(num_examples) != num_examples \
                or num_examples < 1:
            raise ValueError("num_examples: must be an integer >= 1")
        drifted = self.observe(loss)
        metrics: dict[str, float | int] = {NUM_EXAMPLES_KEY: int(num_examples),
                                           LOSS_KEY: float(loss), DRIFT_KEY: int(drifted)}
        if extra_metrics:
            metrics.update(extra_metrics)
        return Message(content=RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics)}),
                       reply_to=msg)


def cohort_id(msg: Message, config_key: str = "config") -> int:
    """The cohort a server train message assigns: ``config[COHORT_KEY]`` (fed-clma's
    messages) or this project's ``"clma"`` header's ``cohort-id``."""
    content = msg.content
    if config_key in content.config_records and COHORT_KEY in content[config_key]:
        return int(content[config_key][COHORT_KEY])
    return int(content["clma"]["cohort-id"])
