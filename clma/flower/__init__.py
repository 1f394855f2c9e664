"""CLMA on Flower (optional extra ``flower``; imports ``flwr``).

* :class:`CLMA` -- a Flower message-API strategy on the round engine (drop-in for
  ``flwr.serverapp.strategy.FedAvg``: one model per cohort, quarantine, cohorting, the
  ledger, DP-FedAvg; :mod:`clma.flower.strategy`), and
  :class:`~clma.flower.private.PrivateEvaluation`, its private regional evaluation;
* :class:`FlowerTransport` -- the ``Clients`` seam over a ServerApp's grid, so the
  Prefect flow reaches real clients on Flower SuperNodes (:mod:`clma.flower.transport`,
  wire format :mod:`clma.flower.codec`, :mod:`clma.flower.journal`);
* :func:`make_client_app` -- the ClientApp (:mod:`clma.flower.clientapp`) over a
  :class:`TorchLearner` (:mod:`clma.flower.learner`);
* ``flows/flower_app`` -- the Flower app folder ``clma run`` submits with ``flwr run``,
  :mod:`flows.flower_launch` -- that launcher.

``import clma`` does not import this package; its names are resolved on first use, so a
ClientApp process imports only what its message needs.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CLMA": "clma.flower.strategy",
    "COHORT_ID_KEY": "clma.flower.strategy",
    "DRIFT_FLAG_KEY": "clma.flower.strategy",
    "ArrayLayout": "clma.flower.arrays",
    "PrivateEvaluation": "clma.flower.private",
    "FlowerTransport": "clma.flower.transport",
    "make_client_app": "clma.flower.clientapp",
    "TorchLearner": "clma.flower.learner",
    "digits_learner": "clma.sim.demo",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'clma.flower' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
