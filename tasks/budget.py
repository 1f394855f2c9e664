"""Reporting the privacy ledger after each round (MLflow and Prefect).

The ledger logic (charge before noise, the borrowing gate, DP-FedAvg reserve / commit)
lives in :mod:`clma.engine.budget`; this module only publishes the ledger: the MLflow
table (``budget/ledger.json``: after every round the current epoch's rows with the round
in ``after_round``; ``log_table`` appends, so the file is the ledger's history, one block
per round), the decisions (``budget/decisions.json``), per-line metrics, tags for the
policy and every borrowing decision, and a Prefect table artifact (the whole ledger)
every round.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from clma.engine.budget import BudgetState, decisions_document, ledger_round

__all__ = ["ledger_history_block", "prefect_artifact_key", "report_budget_round"]


def prefect_artifact_key(name: str) -> str:
    """Prefect artifact key for a federation: lowercase letters, digits and dashes."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "federation"
    digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:8]
    return f"privacy-ledger-{slug[:40]}-{digest}"


def ledger_history_block(budget: BudgetState, round_number: int) -> dict[str, list]:
    """The rows ``budget/ledger.json`` gets after flow round ``round_number``: the ledger's
    rows of that round's epoch (:meth:`clma.budget.PrivacyLedger.table_columns`) as columns,
    with ``after_round`` (the round, first column). One block per round keeps the MLflow
    file linear in the rounds (appending the whole ledger every round grew it with the
    square of the epochs) and makes each copy say which round it is.

    Raises:
        ValueError: ``round_number`` not an integer >= 1.
    """
    epoch = budget.policy.epoch_of_round(ledger_round(round_number))
    columns = budget.ledger.table_columns(epoch)
    n = len(columns["epoch"])
    return {"after_round": [round_number] * n, **columns}


def report_budget_round(budget: BudgetState, tracker: Any | None, round_number: int) -> None:
    """Report the ledger after a round: MLflow table (:func:`ledger_history_block`,
    appended) + decisions + metrics + borrow tags (when ``tracker`` is a
    :class:`tasks.tracking.FederationTracker`) and a Prefect table artifact of the whole
    ledger (always; requires a Prefect API, which every flow run has)."""
    rows = budget.ledger.table()
    if tracker is not None and tracker.run_id:
        tracker.client.log_table(
            tracker.run_id, data=ledger_history_block(budget, round_number),
            artifact_file="budget/ledger.json"
        )
        tracker.log_dict(decisions_document(budget), "budget/decisions.json")
        epoch = budget.policy.epoch_of_round(ledger_round(round_number))
        metrics = {}
        for row in rows:
            if row.epoch == epoch:
                metrics[f"budget.{row.line_item}.spent_epsilon"] = row.spent_epsilon
                metrics[f"budget.{row.line_item}.remaining_epsilon"] = row.remaining_epsilon
        tracker.log_metrics(metrics, step=round_number)
        tags = {}
        for b in budget.ledger.borrows():
            key = f"clma.budget.borrow.e{b['epoch']}.{b['line']}"
            tags[f"{key}.decision"] = "approved" if b["approved"] else f"refused:{b['refusal']}"
            tags[f"{key}.approver"] = b["approver"] or ""
            tags[f"{key}.approver_key_id"] = b["approver_key_id"] or ""
            tags[f"{key}.reason"] = (b["approver_reason"] or "")[:1000]
            tags[f"{key}.epsilon"] = repr(float(b["epsilon"]))
        if tags:
            tracker.set_tags(tags)
    from prefect.artifacts import create_table_artifact

    create_table_artifact(
        key=prefect_artifact_key(budget.config.name),
        table=[r.model_dump(mode="json") for r in rows],
        description=(
            f"Privacy ledger after round {round_number} (per client; epsilon). Policy "
            f"{budget.policy.policy_version}, content hash {budget.policy.content_hash[:12]}."
        ),
    )
