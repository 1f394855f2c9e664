"""CLMA: drift-aware federated learning (cohorts, quarantine, cohorting, ledger).

The names fed-clma 0.1.1 exports from ``clma`` are resolved here on first use (module
``__getattr__``), so ``import clma`` stays cheap -- devices import it -- and works without
Flower: only touching :data:`CLMA`, :class:`~clma.client.DriftReporter` or
:func:`~clma.client.cohort_id` imports ``flwr`` (ImportError naming
``pip install 'clma[flower]'`` when it is missing). See the README, "Coming from fed-clma".
"""

from __future__ import annotations

import importlib
from typing import Any

_FLOWER_HINT = "pip install 'clma[flower]'"

#: name -> (module, needs flwr)
_EXPORTS: dict[str, tuple[str, bool]] = {
    "CLMA": ("clma.flower.strategy", True),
    "DriftReporter": ("clma.client", True),
    "cohort_id": ("clma.client", True),
    "COHORT_KEY": ("clma.client", True),
    "DRIFT_KEY": ("clma.client", True),
    "LOSS_KEY": ("clma.client", True),
    "InferenceDriftMonitor": ("clma.drift", False),
    "DriftDetector": ("clma.drift", False),
    "LossThresholdDetector": ("clma.drift", False),
    "ParamSelector": ("clma.params", False),
    "DefaultSelector": ("clma.params", False),
    "AllParams": ("clma.params", False),
    "LastLayers": ("clma.params", False),
    "NameFilter": ("clma.params", False),
    "AutoKMeans": ("clma.cohort", False),
    "CLMACohorter": ("clma.cohort", False),
    "Clusterer": ("clma.cohort", False),
    "OneCohortPerClient": ("clma.cohort", False),
    "Cohorter": ("clma.cohort", False),
    "CohortRegistry": ("clma.cohort", False),
    "signed_ks_statistic": ("clma.cohort", False),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    entry = _EXPORTS.get(name)
    if entry is None:
        raise AttributeError(f"module 'clma' has no attribute {name!r}")
    module, needs_flwr = entry
    if needs_flwr:
        try:
            import flwr  # noqa: F401
        except ImportError as exc:
            raise ImportError(f"clma.{name} needs Flower: {_FLOWER_HINT}") from exc
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
