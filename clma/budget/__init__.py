"""Privacy budget: the versioned policy, dp-accounting composition and the durable ledger.

See :mod:`clma.budget.policy` (policy file, line items, borrowing rule),
:mod:`clma.budget.accounting` (PLD / RDP / exact-sum composition) and
:mod:`clma.budget.ledger` (SQLite ledger with idempotent two-phase charges).
"""

from clma.budget.accounting import (
    ADJACENCY,
    ADJACENCY_NAME,
    AccountingError,
    CompositionResult,
    MechanismEvent,
    compose,
)
from clma.budget.ledger import (
    DEFAULT_LEDGER_FILENAME,
    IdempotencyConflictError,
    LedgerError,
    LedgerRow,
    PrivacyLedger,
    Reservation,
    ReservationStatus,
)
from clma.budget.policy import (
    BorrowApproval,
    BorrowDecision,
    BorrowRefusal,
    BorrowRequest,
    LineItem,
    PolicyError,
    PrivacyPolicy,
    decide_borrow,
    default_policy,
    evaluate_borrow,
    load_policy,
)

__all__ = [
    "ADJACENCY",
    "ADJACENCY_NAME",
    "DEFAULT_LEDGER_FILENAME",
    "AccountingError",
    "BorrowApproval",
    "BorrowDecision",
    "BorrowRefusal",
    "BorrowRequest",
    "CompositionResult",
    "IdempotencyConflictError",
    "LedgerError",
    "LedgerRow",
    "LineItem",
    "MechanismEvent",
    "PolicyError",
    "PrivacyLedger",
    "PrivacyPolicy",
    "Reservation",
    "ReservationStatus",
    "compose",
    "decide_borrow",
    "default_policy",
    "evaluate_borrow",
    "load_policy",
]
