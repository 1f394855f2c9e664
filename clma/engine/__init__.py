"""The round engine: the server of a federation, behind the ``Clients`` seam.

Every server step of a governed round (select, train through the seam, quarantine,
divergence, FedAvg or DP-FedAvg, cohorting, merging, secure sums, release planning,
ledger charges, noise once per release, envelopes, alerts, bound updates) lives here, with
no orchestrator and no transport imported: :mod:`clma.engine.round` (the steps),
:mod:`clma.engine.clients` (the seam), :mod:`clma.engine.secure_sum`,
:mod:`clma.engine.evaluation`, :mod:`clma.engine.budget`, :mod:`clma.engine.divergence`,
:mod:`clma.engine.state`.

The names below are resolved on first use (PEP 562), so a device that imports only the
seam's dataclasses (``clma.engine.clients``, e.g. a Flower ClientApp process started for
one message) does not import the server's engine, torch or the privacy accountants.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "BudgetState": "clma.engine.budget",
    "ChargePlan": "clma.engine.budget",
    "open_budget": "clma.engine.budget",
    "policy_of": "clma.engine.budget",
    "TRANSPORTS": "clma.engine.clients",
    "ChoiceRequest": "clma.engine.clients",
    "ClientInfo": "clma.engine.clients",
    "Clients": "clma.engine.clients",
    "Replies": "clma.engine.clients",
    "ReportRequest": "clma.engine.clients",
    "Roster": "clma.engine.clients",
    "SecAggSession": "clma.engine.clients",
    "ShareKeysRequest": "clma.engine.clients",
    "TrainRequest": "clma.engine.clients",
    "TrainSettings": "clma.engine.clients",
    "EvaluationOutcome": "clma.engine.evaluation",
    "EvaluationState": "clma.engine.evaluation",
    "PrivateEvaluator": "clma.engine.evaluation",
    "FederationEngine": "clma.engine.round",
    "RoundContext": "clma.engine.round",
    "RoundResult": "clma.engine.round",
    "make_cohorter": "clma.engine.round",
    "ServerAssets": "clma.engine.state",
    "ServerState": "clma.engine.state",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'clma.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
