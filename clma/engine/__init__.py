"""The round engine: the server of a federation, behind the ``Clients`` seam.

Every server step of a governed round (select, train through the seam, quarantine,
divergence, FedAvg or DP-FedAvg, cohorting, merging, secure sums, release planning,
ledger charges, noise once per release, envelopes, alerts, bound updates) lives here, with
no orchestrator and no transport imported: :mod:`clma.engine.round` (the steps),
:mod:`clma.engine.clients` (the seam), :mod:`clma.engine.secure_sum`,
:mod:`clma.engine.evaluation`, :mod:`clma.engine.budget`, :mod:`clma.engine.divergence`,
:mod:`clma.engine.state`.
"""

from clma.engine.budget import BudgetState, ChargePlan, open_budget, policy_of
from clma.engine.clients import (
    TRANSPORTS,
    ClientInfo,
    Clients,
    Replies,
    ReportRequest,
    Roster,
    SecAggSession,
    ShareKeysRequest,
    TrainRequest,
    TrainSettings,
)
from clma.engine.evaluation import EvaluationOutcome, EvaluationState, PrivateEvaluator
from clma.engine.round import FederationEngine, RoundContext, RoundResult, make_cohorter
from clma.engine.state import ServerAssets, ServerState

__all__ = [
    "TRANSPORTS",
    "BudgetState",
    "ChargePlan",
    "ClientInfo",
    "Clients",
    "EvaluationOutcome",
    "EvaluationState",
    "FederationEngine",
    "PrivateEvaluator",
    "Replies",
    "ReportRequest",
    "Roster",
    "RoundContext",
    "RoundResult",
    "SecAggSession",
    "ServerAssets",
    "ServerState",
    "ShareKeysRequest",
    "TrainRequest",
    "TrainSettings",
    "make_cohorter",
    "open_budget",
    "policy_of",
]
