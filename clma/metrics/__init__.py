"""Metric specs, the metric registry and on-device bounded metrics."""

from clma.metrics.device import (
    REPORT_LENGTH,
    DeviceMetricLayout,
    DeviceMetricReport,
    accuracy,
    calibration_buckets,
    compute_device_report,
    error_histogram,
    mean_loss,
    per_example_loss,
    sample_count_bucket,
)
from clma.metrics.registry import MetricRegistry, MetricRegistryError
from clma.release.aggregate import MetricSpec

__all__ = [
    "REPORT_LENGTH",
    "DeviceMetricLayout",
    "DeviceMetricReport",
    "MetricRegistry",
    "MetricRegistryError",
    "MetricSpec",
    "accuracy",
    "calibration_buckets",
    "compute_device_report",
    "default_registry",
    "error_histogram",
    "mean_loss",
    "per_example_loss",
    "sample_count_bucket",
]


def default_registry(l_max: float = 5.0) -> MetricRegistry:
    """Registry with ``accuracy`` in [0, 1] and ``mean_loss`` in [0, l_max]."""
    reg = MetricRegistry()
    reg.register(MetricSpec("accuracy", 0.0, 1.0))
    reg.register(MetricSpec("mean_loss", 0.0, l_max))
    return reg
