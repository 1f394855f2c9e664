"""Privacy building blocks: central-DP mechanisms and secure aggregation.

The mechanisms' names are resolved on first use (PEP 562), so a device importing only
:mod:`clma.privacy.secagg` (its side of secure aggregation) does not import scipy.
"""

from __future__ import annotations

import importlib
from typing import Any

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


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'clma.privacy' has no attribute {name!r}")
    value = getattr(importlib.import_module("clma.privacy.mechanisms"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
