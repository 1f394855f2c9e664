"""Privacy building blocks: central-DP mechanisms and secure aggregation."""

from clma.privacy.mechanisms import (
    Mechanism,
    NoiseSource,
    PrivacyParameterError,
    analytic_gaussian_sigma,
    classic_gaussian_sigma,
    error_bar,
    gaussian_delta,
    gaussian_rho,
    interval_quantile,
    noise_scale,
    sample,
)

__all__ = [
    "Mechanism",
    "NoiseSource",
    "PrivacyParameterError",
    "analytic_gaussian_sigma",
    "classic_gaussian_sigma",
    "error_bar",
    "gaussian_delta",
    "gaussian_rho",
    "interval_quantile",
    "noise_scale",
    "sample",
]
