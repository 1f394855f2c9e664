"""On-device drift detection for CLMA: the per-round loss-threshold flag and the
inference-time monitor (Algorithm 4)."""

from clma.drift.detectors import DriftDetector, LossThresholdDetector, check_loss
from clma.drift.history import RoundKeyedState
from clma.drift.monitor import InferenceDriftMonitor

__all__ = ["DriftDetector", "InferenceDriftMonitor", "LossThresholdDetector", "RoundKeyedState",
           "check_loss"]
