"""The budget-borrow approval gate: a named approver decides, in the Prefect UI or with
``clma approve``.

When an evaluation release would overspend its line, :func:`tasks.budget.budgeted_evaluation`
calls :func:`borrow_gate` (at most once per budget epoch). With
``budget.approval_gate = "pause"`` the gate runs the subflow :func:`borrow_approval_flow`
(run name ``borrow-e<epoch>-<line>``), which pauses *its own* flow run with
``pause_flow_run(wait_for_input=BorrowApprovalForm.with_initial_data(approve=False, ...))``:
the Prefect UI shows the form (approver, approve, reason) on that paused run's page
(Resume). For those without a browser::

    clma approve RUN_ID --approver NAME [--deny] [--reason TEXT]

resumes it with the same input (``RUN_ID``: the paused approval run, or the federation or
round run above it; the gate prints the exact command). The pre-filled values are the safe
ones: ``approve=False`` and an empty approver, so resuming without filling the form is a
refusal.

Why a subflow of its own: a pause that times out leaves the paused run unable to finish
(the server rejects its later transitions and fails it). Pausing a dedicated subflow keeps
that failure inside the gate: the round collects the subflow's state
(``return_state=True``), and a timeout (``FlowPauseTimeout``, caught) or a failed gate run
counts as "no approval".

The decision always goes through :func:`clma.budget.decide_borrow` (allow-list, once per
epoch, the policy's borrow limit), which records it in the ledger with the policy version.
On a timeout, a denial, an approver not on the allow-list or a second borrow in the same
epoch, training backs off (the ledger freezes the training line for the epoch) and
evaluation keeps its reserved allocation. ``approval_gate = "refuse"`` (the default, for
unattended runs) never pauses: the request is decided at once as a timeout.
"""

from __future__ import annotations

import sys
import uuid
from typing import Any

from prefect import flow, get_run_logger
from prefect.exceptions import FlowPauseTimeout
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from prefect.runtime import flow_run
from pydantic import Field, ValidationError

from clma.budget import BorrowApproval, BorrowDecision, BorrowRequest, decide_borrow
from clma.engine.budget import BudgetState

__all__ = [
    "BorrowApprovalForm",
    "approve_run",
    "borrow_approval_flow",
    "borrow_gate",
    "ApprovalError",
]


class BorrowApprovalForm(RunInput):
    """The form the Prefect UI shows on the paused approval run."""

    approver: str = Field(description="Your name, exactly as on the policy's approver allow-list.")
    approve: bool = Field(description="Approve borrowing from the next budget epoch.")
    reason: str = Field(default="", description="Why (recorded in the ledger and MLflow).")


def _form_description(request: BorrowRequest, approvers: tuple[str, ...]) -> str:
    return (
        f"**Privacy budget: borrow request**\n\n"
        f"Evaluation line `{request.line.value}` of budget epoch {request.epoch} would "
        f"overspend. Borrow epsilon {request.epsilon:.6g} (per client) from epoch "
        f"{request.epoch + 1}'s allocation of the same line?\n\n"
        f"{request.reason}\n\n"
        f"Approvers on the policy's allow-list: {', '.join(approvers)}. "
        f"Refusing (or letting it time out) freezes training for the rest of the epoch; "
        f"evaluation keeps its reserved allocation."
    )


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in text)


@flow(name="clma-borrow-approval", flow_run_name="borrow-e{epoch}-{line_slug}")
def borrow_approval_flow(
    epoch: int, line_slug: str, description: str, timeout: int, poll_interval: float,
) -> dict[str, Any] | None:
    """Pause this flow run until a person answers the form; ``None`` on timeout."""
    run_id = str(flow_run.id)
    msg = (
        f"clma: privacy budget epoch {epoch}: borrow request paused, flow run {run_id}. "
        f"Approve in the Prefect UI (Resume on the run page) or run: "
        f"clma approve {run_id} --approver NAME [--deny] [--reason TEXT]"
    )
    get_run_logger().warning(msg)
    print(msg, file=sys.stderr, flush=True)
    form = BorrowApprovalForm.with_initial_data(
        description=description, approve=False, approver="", reason=""
    )
    try:
        answer = pause_flow_run(
            wait_for_input=form, timeout=int(timeout), poll_interval=poll_interval,
        )
    except FlowPauseTimeout:
        return None
    return {"approver": answer.approver, "approve": bool(answer.approve), "reason": answer.reason}


def _approval_from(answer: dict[str, Any] | None) -> BorrowApproval | None:
    if answer is None:
        return None
    try:
        return BorrowApproval(
            approver=str(answer.get("approver", "")), approve=answer.get("approve") is True,
            reason=str(answer.get("reason", ""))[:1000],
        )
    except ValidationError:
        # An unusable answer (e.g. an over-long name) is a refusal: not on the allow-list.
        return BorrowApproval(approver="(invalid approver name)", approve=False, reason="")


def borrow_gate(budget: BudgetState, request: BorrowRequest) -> BorrowDecision:
    """Put a borrow request to a named approver and record the decision.

    ``budget.approval_gate == "pause"``: run :func:`borrow_approval_flow` as a subflow
    (pauses up to ``budget.approval_timeout_seconds`` or the policy's
    ``approval_timeout_seconds``) and decide with its answer; a timeout or a failed gate
    run is decided as a timeout. ``"refuse"``: decided as a timeout at once, no pause.
    Returns the recorded :class:`~clma.budget.BorrowDecision`.
    """
    mode = budget.config.budget.approval_gate
    answer: dict[str, Any] | None = None
    gate_state = "not_paused"
    if mode == "pause":
        state = borrow_approval_flow(
            request.epoch, _slug(request.line.value),
            _form_description(request, budget.policy.borrowing.approvers),
            budget.approval_timeout(), budget.config.budget.approval_poll_seconds,
            return_state=True,
        )
        gate_state = state.type.value.lower()
        if state.is_completed():
            answer = state.result()
    else:
        request = request.model_copy(update={
            "reason": (request.reason + " [approval_gate=refuse: unattended run, no pause]")[:1000]
        })
    decision = decide_borrow(request, _approval_from(answer), budget.policy, budget.ledger)
    budget.events.append({
        "kind": "borrow_gate", "epoch": request.epoch, "line": request.line.value,
        "mode": mode, "gate_run_state": gate_state, "decision_id": decision.decision_id,
        "approved": decision.approved,
        "refusal": None if decision.refusal is None else decision.refusal.value,
        "approver": decision.approver, "reason": decision.approver_reason,
        "epsilon": decision.epsilon, "policy_version": decision.policy_version,
    })
    return decision


# --------------------------------------------------------------------------- clma approve


class ApprovalError(ValueError):
    """``clma approve`` could not resume: bad id, unknown run, nothing paused."""


def _find_paused(client: Any, run_id: uuid.UUID, depth: int = 3) -> list[Any]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.client.schemas.objects import StateType

    paused: list[Any] = []
    frontier = [run_id]
    for _ in range(depth):
        if not frontier:
            break
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=frontier))
        )
        paused += [c for c in children if c.state is not None and c.state.type == StateType.PAUSED]
        frontier = [c.id for c in children]
    return paused


def approve_run(run_id: str, approver: str, *, approve: bool = True, reason: str = "") -> str:
    """Resume a paused approval run with ``{"approver", "approve", "reason"}`` (what the
    UI form sends). ``run_id`` is the paused run, or a federation/round run with exactly
    one paused approval run below it. Returns the id of the resumed run.

    Raises:
        ApprovalError: malformed id, unknown run, nothing (or more than one run) paused,
            or the pause already timed out.
    """
    try:
        rid = uuid.UUID(str(run_id).strip())
    except ValueError:
        raise ApprovalError("RUN_ID: not a flow run id (expected a UUID)") from None
    if not approver or approver != approver.strip():
        raise ApprovalError("--approver: a non-empty name without surrounding spaces")
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.flow_runs import resume_flow_run

    with get_client(sync_client=True) as client:
        try:
            run = client.read_flow_run(rid)
        except ObjectNotFound:
            raise ApprovalError(f"RUN_ID: no flow run {rid} on this Prefect API") from None
        if run.state is not None and run.state.is_paused():
            target = run
        else:
            found = _find_paused(client, rid)
            if not found:
                state = run.state.name if run.state is not None else "no state"
                raise ApprovalError(
                    f"RUN_ID: flow run {rid} is not paused (state: {state}) and has no paused "
                    "approval run below it"
                )
            if len(found) > 1:
                raise ApprovalError(
                    f"RUN_ID: {len(found)} paused runs below {rid}; pass one of: "
                    + ", ".join(str(f.id) for f in found)
                )
            target = found[0]
    payload = {"approver": approver, "approve": bool(approve), "reason": reason}
    try:
        resume_flow_run(target.id, run_input=payload)
    except FlowPauseTimeout:
        raise ApprovalError(f"RUN_ID: the pause of flow run {target.id} timed out") from None
    except Exception as exc:  # NotPausedError, rejected input
        raise ApprovalError(f"RUN_ID: flow run {target.id} could not be resumed: {exc}") from None
    return str(target.id)
