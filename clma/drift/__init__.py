"""On-device drift detection for CLMA: the per-round loss-threshold flag, the calibrated
sequential detectors (CUSUM; river's Page-Hinkley and ADWIN), the covariate-drift test on
the device's own inputs (per-feature KS with Bonferroni), the spec that tells a device
which one to run, and the inference-time monitor (Algorithm 4)."""

from clma.drift.cusum import CusumDetector, CusumParams, cusum_arl
from clma.drift.detectors import DriftDetector, LossThresholdDetector, check_loss
from clma.drift.history import RoundKeyedState
from clma.drift.input_ks import (
    InputKSDetector,
    InputKSParams,
    feature_ks_pvalues,
    row_summaries,
)
from clma.drift.monitor import InferenceDriftMonitor
from clma.drift.paired import PairedLossDetector, PairedLossParams, mean_cross_entropy
from clma.drift.river_detectors import (
    ADWINDetector,
    ADWINParams,
    PageHinkleyDetector,
    PageHinkleyParams,
)
from clma.drift.spec import DETECTOR_KINDS, DetectorSpec

__all__ = ["ADWINDetector", "ADWINParams", "CusumDetector", "CusumParams", "DETECTOR_KINDS",
           "DetectorSpec", "DriftDetector", "InferenceDriftMonitor", "InputKSDetector",
           "InputKSParams", "LossThresholdDetector", "PairedLossDetector", "PairedLossParams",
           "PageHinkleyDetector", "PageHinkleyParams", "RoundKeyedState", "check_loss",
           "cusum_arl", "feature_ks_pvalues", "mean_cross_entropy", "row_summaries"]
