"""The budget-borrow approval gate: a named approver decides with a signed token, in the
Prefect UI or with ``clma approve``.

When an evaluation release would overspend its line, :func:`clma.engine.budget.budgeted_evaluation`
calls :func:`borrow_gate` (at most once per budget epoch). The gate draws a fresh random
nonce for the request. With ``budget.approval_gate = "pause"`` it runs the subflow
:func:`borrow_approval_flow` (run name ``borrow-e<epoch>-<line>``; its parameter
``request`` holds the request's federation, run id, epoch, line, epsilon and nonce), which
pauses *its own* flow run with ``pause_flow_run(wait_for_input=<form>)``. The form
(:func:`approval_form`) has four required fields: ``approver`` (a choice from the policy's
allow-list), ``approve``, ``reason`` and ``token``, the Ed25519-signed token of
:mod:`clma.budget.approval_token`. From a terminal::

    clma approve RUN_ID --approver NAME --key FILE --reason TEXT [--deny]

signs the decision for the paused request and resumes the run with it; ``--token-only``
prints the token for the UI form instead (``RUN_ID``: the paused approval run, or the
federation or round run above it; the gate prints the exact command). Nothing is
pre-filled: a resume without input is rejected by the Prefect server (the run stays paused).

Why a subflow of its own: a pause that times out leaves the paused run unable to finish
(the server rejects its later transitions and fails it). Pausing a dedicated subflow keeps
that failure inside the gate: the round collects the subflow's state
(``return_state=True``), and a timeout (``FlowPauseTimeout``, caught) or a failed gate run
counts as "no approval".

The decision always goes through :func:`clma.budget.decide_borrow`, which verifies the
token against the policy's keys and this request (a missing, forged, altered or replayed
token is a refusal naming the reason), then applies the allow-list, once per epoch and the
borrow limit, and records it in the ledger with the policy version and the signing key's
id. On any refusal or a timeout, training backs off (the ledger freezes the training line
for the epoch) and evaluation keeps its reserved allocation. ``approval_gate = "refuse"``
(the default, for unattended runs) never pauses: the request is decided at once as a
timeout.
"""

from __future__ import annotations

import re
import secrets
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger
from prefect.exceptions import FlowPauseTimeout
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from prefect.runtime import flow_run
from prefect.states import Completed
from pydantic import Field, ValidationError, create_model

from clma.budget import BorrowApproval, BorrowDecision, BorrowRequest, decide_borrow
from clma.budget.policy import MAX_TOKEN_CHARS
from clma.engine.budget import BudgetState

__all__ = [
    "ApprovalError",
    "ApprovalResult",
    "BorrowApprovalForm",
    "approval_form",
    "approve_run",
    "borrow_approval_flow",
    "borrow_gate",
]

#: How long ``clma approve`` waits by default for the run to be visible and paused (the
#: gate prints the command just before the pause reaches the API).
DEFAULT_WAIT_SECONDS = 30.0


class BorrowApprovalForm(RunInput):
    """The form the Prefect UI shows on the paused approval run (every field required).
    :func:`approval_form` narrows ``approver`` to the policy's allow-list."""

    approver: str = Field(description="Your name on the policy's approver allow-list.")
    approve: bool = Field(description="On: approve borrowing from the next budget epoch. "
                          "Off: deny. Must be the decision you signed.")
    reason: str = Field(min_length=1, max_length=1000,
                        description="Why; exactly the reason you signed (recorded in the "
                        "ledger and MLflow).")
    token: str = Field(max_length=MAX_TOKEN_CHARS,
                       description="The signed token printed by `clma approve RUN_ID "
                       "--approver NAME --key FILE --reason TEXT [--deny] --token-only`.")


def approval_form(approvers: Sequence[str], description: str) -> type[BorrowApprovalForm]:
    """The form for one request: ``approver`` a required choice (``Literal``) of the
    allow-list, so the UI shows a select; ``description`` is shown above the form."""
    choice = Literal[tuple(approvers)]  # type: ignore[valid-type]
    form = create_model(
        "BorrowApprovalForm", __base__=BorrowApprovalForm,
        # a one-name Literal is a JSON-schema "const": keep "enum" so the UI shows a select
        approver=(choice, Field(description="Your name on the policy's approver allow-list.",
                                json_schema_extra={"enum": list(approvers)})),
    )
    return form.with_initial_data(description=description)


def _request_parameter(request: BorrowRequest) -> dict[str, Any]:
    return {"federation": request.federation, "run_id": request.run_id,
            "epoch": request.epoch, "line": request.line.value,
            "epsilon": float(request.epsilon), "nonce": request.nonce}


def _line_budget(budget: BudgetState, epoch: int, line: str) -> dict[str, float] | None:
    """Cap, spent and remaining epsilon of ``line`` in ``epoch`` (None: not readable)."""
    try:
        row = next(r for r in budget.ledger.table(epoch) if r.line_item == line)
    except Exception:  # noqa: BLE001 (the form then says it could not read the ledger)
        return None
    return {"cap": row.cap_epsilon, "spent": row.spent_epsilon,
            "remaining": row.remaining_epsilon}


def _request_round(request: BorrowRequest) -> int | None:
    """The round of the request (its reason starts ``round N:``)."""
    m = re.match(r"round (\d+):", request.reason)
    return int(m.group(1)) if m else None


def _form_description(request: BorrowRequest, approvers: tuple[str, ...], *,
                      line_budget: dict[str, float] | None = None,
                      timeout: int | None = None, now: float | None = None) -> str:
    """The text above the form: what is asked, the line's budget, the deadline, how to sign."""
    rnd = _request_round(request)
    if line_budget is None:
        budget_text = "(the ledger could not be read)"
    else:
        budget_text = (f"cap {line_budget['cap']:.4g}, spent {line_budget['spent']:.4g}, "
                       f"remaining {line_budget['remaining']:.4g}")
    deadline = ""
    if timeout is not None:
        at = time.strftime("%Y-%m-%d %H:%M:%S UTC",
                           time.gmtime((time.time() if now is None else now) + int(timeout)))
        deadline = (f"**Deadline: {at}** (in {int(timeout)} s). No answer by then counts "
                    "as a timeout: a refusal.\n\n")
    return (
        f"**Privacy budget: borrow request**\n\n"
        f"| | |\n|---|---|\n"
        f"| federation | `{request.federation}` |\n"
        f"| round | {rnd if rnd is not None else 'n/a'} |\n"
        f"| budget epoch | {request.epoch} |\n"
        f"| line | `{request.line.value}`: {budget_text} (epsilon per client, this epoch) |\n"
        f"| borrow | epsilon {request.epsilon:.4g} from epoch {request.epoch + 1} |\n\n"
        f"{deadline}"
        f"Evaluation line `{request.line.value}` of budget epoch {request.epoch} of "
        f"federation `{request.federation}` would overspend. Borrow epsilon "
        f"{request.epsilon:.4g} (per client) from epoch {request.epoch + 1}'s allocation of "
        f"the same line?\n\n{request.reason}\n\n"
        f"Request: run `{request.run_id}`, nonce `{request.nonce}`.\n\n"
        f"All four fields are required. Approvers on the policy's allow-list: "
        f"{', '.join(approvers)}. Sign your decision "
        f"with your key and paste the token below: `clma approve <this run's id> --approver "
        f"NAME --key FILE --reason TEXT [--deny] --token-only` (approve, reason and approver "
        f"here must be the ones you signed). Refusing (or letting it time out) freezes "
        f"training for the rest of the epoch; evaluation keeps its reserved allocation."
    )


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in text)


@flow(name="clma-borrow-approval", flow_run_name="borrow-e{epoch}-{line_slug}")
def borrow_approval_flow(
    epoch: int, line_slug: str, description: str, timeout: int, poll_interval: float,
    request: dict[str, Any], approvers: list[str],
) -> dict[str, Any] | None:
    """Pause this flow run until a person answers the form; ``None`` on timeout.

    ``request`` (federation, run id, epoch, line, epsilon, nonce) is what ``clma approve``
    signs; ``approvers`` the allow-list the form offers.
    """
    run_id = str(flow_run.id)
    req = request
    msg = (
        f"clma: privacy budget epoch {epoch}: borrow request paused, flow run {run_id} "
        f"(federation {req.get('federation', '')!r}, line {req.get('line', '')}, epsilon "
        f"{req.get('epsilon')!r}, nonce {req.get('nonce', '')}). Approve in the Prefect UI "
        f"(Resume on the run page, with the token of --token-only) or run: "
        f"clma approve {run_id} --approver NAME --key FILE --reason TEXT [--deny]"
    )
    get_run_logger().warning(msg)
    print(msg, file=sys.stderr, flush=True)
    form = approval_form(approvers, description)
    log = get_run_logger()
    try:
        answer = pause_flow_run(
            wait_for_input=form, timeout=int(timeout), poll_interval=poll_interval,
        )
    except FlowPauseTimeout:
        answer = None
    if answer is None:  # also: prefect 3.7.7 returns nothing when a re-run finds it resumed
        msg = "no answer before the deadline: decided as a timeout (borrow refused)"
        log.warning(msg)
        return Completed(message=msg, data=None)  # type: ignore[return-value]
    verdict = "APPROVED" if answer.approve else "DENIED"
    msg = (f"decision submitted: {verdict} by {answer.approver}: {answer.reason} (the "
           "round checks the signed token and records the decision in the ledger)")
    log.warning(msg)  # at WARNING: shown also under the quiet console default
    return Completed(message=msg[:2000], data={  # type: ignore[return-value]
        "approver": answer.approver, "approve": bool(answer.approve),
        "reason": answer.reason, "token": answer.token})


def _approval_from(answer: dict[str, Any] | None) -> BorrowApproval | None:
    if answer is None:
        return None
    try:
        return BorrowApproval(
            approver=str(answer.get("approver", "")), approve=answer.get("approve") is True,
            reason=str(answer.get("reason", "")), token=str(answer.get("token", "")),
        )
    except ValidationError:
        # An unusable answer (e.g. an over-long name) is a refusal: not on the allow-list.
        return BorrowApproval(approver="(invalid approver name)", approve=False, reason="")


def borrow_gate(budget: BudgetState, request: BorrowRequest) -> BorrowDecision:
    """Put a borrow request to a named approver and record the decision.

    Draws the request's nonce (fresh, random, 128 bits). ``budget.approval_gate ==
    "pause"``: run :func:`borrow_approval_flow` as a subflow (pauses up to
    ``budget.approval_timeout_seconds`` or the policy's ``approval_timeout_seconds``) and
    decide with its answer; a timeout or a failed gate run is decided as a timeout.
    ``"refuse"``: decided as a timeout at once, no pause. Returns the recorded
    :class:`~clma.budget.BorrowDecision`.
    """
    request = request.model_copy(update={"nonce": secrets.token_hex(16)})
    mode = budget.config.budget.approval_gate
    answer: dict[str, Any] | None = None
    gate_state = "not_paused"
    if mode == "pause":
        approvers = budget.policy.borrowing.approvers
        description = _form_description(
            request, approvers, line_budget=_line_budget(budget, request.epoch,
                                                         request.line.value),
            timeout=budget.approval_timeout())
        state = borrow_approval_flow(
            request.epoch, _slug(request.line.value), description,
            budget.approval_timeout(), budget.config.budget.approval_poll_seconds,
            request=_request_parameter(request), approvers=list(approvers),
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
        "refusal_detail": decision.refusal_detail,
        "approver": decision.approver, "approver_key_id": decision.approver_key_id,
        "reason": decision.approver_reason, "nonce": request.nonce,
        "epsilon": decision.epsilon, "policy_version": decision.policy_version,
    })
    return decision


# --------------------------------------------------------------------------- clma approve


class ApprovalError(ValueError):
    """``clma approve`` could not sign or resume: bad id or key, unknown run, nothing
    paused, refused by the Prefect API. The message names the argument."""


@dataclass(frozen=True)
class ApprovalResult:
    """What ``clma approve`` signed: the paused run, the token and the signed request."""

    run_id: str
    token: str
    key_id: str
    request: dict[str, Any]
    resumed: bool


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


def _api_error(exc: Exception) -> ApprovalError | None:
    """A clear message for an HTTP refusal of the Prefect API (401 without the auth string)."""
    import httpx

    if isinstance(exc, httpx.HTTPStatusError):
        code = exc.response.status_code
        if code in (401, 403):
            return ApprovalError(
                f"PREFECT_API_URL: the Prefect API refused the request ({code}); an "
                "authenticated server needs PREFECT_API_AUTH_STRING (user:password) set")
        return ApprovalError(f"PREFECT_API_URL: the Prefect API answered {code}")
    if isinstance(exc, httpx.TransportError):
        return ApprovalError(f"PREFECT_API_URL: the Prefect API cannot be reached ({type(exc).__name__})")
    return None


def _api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or "the embedded local API of PREFECT_HOME"


def _schema_ready(client: Any, run: Any) -> bool:
    keyset = run.state.state_details.run_input_keyset if run.state is not None else None
    if not keyset:
        return False
    from prefect.exceptions import ObjectNotFound

    try:
        client.read_flow_run_input(run.id, keyset["schema"])
    except ObjectNotFound:
        return False
    return True


def _paused_target(client: Any, rid: uuid.UUID, wait_seconds: float) -> Any:
    """The paused approval run ``rid`` names, waiting up to ``wait_seconds``.

    The gate prints its command just before it pauses (``pause_flow_run`` blocks and then
    saves the form), so a command run at once can find the run not yet paused, its form not
    yet saved or, on a busy API, the run not yet readable: retry until then.
    """
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + max(0.0, wait_seconds)
    while True:
        problem: str
        try:
            run = client.read_flow_run(rid)
        except ObjectNotFound:
            problem = (f"RUN_ID: no flow run {rid} on this Prefect API ({_api_url()}); is "
                       "PREFECT_API_URL the server the federation runs on?")
        else:
            if run.state is not None and run.state.is_paused():
                found = [run]
            else:
                found = _find_paused(client, rid)
            if len(found) > 1:
                raise ApprovalError(
                    f"RUN_ID: {len(found)} paused runs below {rid}; pass one of: "
                    + ", ".join(str(f.id) for f in found))
            if found and _schema_ready(client, found[0]):
                return found[0]
            state = run.state.name if run.state is not None else "no state"
            problem = (f"RUN_ID: flow run {rid} is not paused (state: {state}) and has no "
                       "paused approval run below it")
            if found:
                problem = f"RUN_ID: flow run {found[0].id} is paused but its form is not saved"
            elif run.state is not None and run.state.is_final():
                raise ApprovalError(problem)
        if time.monotonic() >= deadline:
            raise ApprovalError(f"{problem} (waited {wait_seconds:g} s)")
        time.sleep(0.5)


def _read_request(run: Any) -> dict[str, Any]:
    req = (run.parameters or {}).get("request")
    keys = ("federation", "run_id", "epoch", "line", "epsilon", "nonce")
    if not isinstance(req, dict) or any(k not in req for k in keys):
        raise ApprovalError(f"RUN_ID: flow run {run.id} is not a borrow approval request "
                            "(no request parameter)")
    return {k: req[k] for k in keys}


def _allow_list(client: Any, run: Any) -> list[str] | None:
    """The approver choices of the saved form, if it offers a choice."""
    import json

    keyset = run.state.state_details.run_input_keyset
    try:
        schema = json.loads(client.read_flow_run_input(run.id, keyset["schema"]))
    except (ValueError, KeyError, TypeError):
        return None
    approver = schema.get("properties", {}).get("approver", {})
    choices = approver.get("enum") or ([approver["const"]] if "const" in approver else None)
    return [str(c) for c in choices] if choices else None


def approve_run(
    run_id: str, approver: str, *, key_file: str | Path, reason: str, approve: bool = True,
    token_only: bool = False, wait_seconds: float = DEFAULT_WAIT_SECONDS,
) -> ApprovalResult:
    """Sign a decision for a paused borrow request and resume the run with it (what the UI
    form sends: approver, approve, reason, token), or only return the token.

    ``run_id`` is the paused approval run, or a federation/round run with exactly one
    paused approval run below it; waits up to ``wait_seconds`` for it to be paused.

    Raises:
        ApprovalError: malformed id, unreadable or too open key file, empty reason,
            unknown run, nothing (or more than one run) paused, an approver not on the
            form's allow-list, a pause that timed out, or the Prefect API refused.
    """
    from clma.budget.approval_token import (
        ApprovalTokenError,
        claims_for,
        load_private_key,
        sign_claims,
    )

    try:
        rid = uuid.UUID(str(run_id).strip())
    except ValueError:
        raise ApprovalError("RUN_ID: not a flow run id (expected a UUID)") from None
    if not approver or approver != approver.strip():
        raise ApprovalError("--approver: a non-empty name without surrounding spaces")
    if not reason:
        raise ApprovalError("--reason: required (it is signed and recorded with the decision)")
    try:
        key, key_id = load_private_key(key_file)
    except ApprovalTokenError as exc:
        raise ApprovalError(str(exc)) from None
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.responses import SetStateStatus

    try:
        with get_client(sync_client=True) as client:
            target = _paused_target(client, rid, wait_seconds)
            req = _read_request(target)
            choices = _allow_list(client, target)
            if choices is not None and approver not in choices:
                raise ApprovalError(f"--approver: {approver!r} is not on the policy's allow-"
                                    f"list ({', '.join(choices)})")
            try:
                request = BorrowRequest(
                    federation=str(req["federation"]), run_id=str(req["run_id"]),
                    epoch=int(req["epoch"]), line=str(req["line"]),
                    epsilon=float(req["epsilon"]), nonce=str(req["nonce"]))
                claims = claims_for(request, approver=approver, key_id=key_id,
                                    approve=approve, reason=reason)
            except (ValueError, TypeError) as exc:  # ValidationError, ApprovalTokenError
                raise ApprovalError(f"RUN_ID: the paused request cannot be signed: {exc}") from None
            token = sign_claims(claims, key)
            if token_only:
                return ApprovalResult(str(target.id), token, key_id, req, resumed=False)
            payload = {"approver": approver, "approve": bool(approve), "reason": reason,
                       "token": token}
            result = client.resume_flow_run(target.id, run_input=payload)
    except ApprovalError:
        raise
    except Exception as exc:  # HTTP refusals, unreachable API
        err = _api_error(exc)
        if err is None:
            raise
        raise err from None
    if result.status == SetStateStatus.REJECT:
        if result.state is not None and result.state.is_failed():
            raise ApprovalError(f"RUN_ID: the pause of flow run {target.id} timed out")
        reason_text = getattr(result.details, "reason", "") or "rejected"
        raise ApprovalError(f"RUN_ID: flow run {target.id} could not be resumed: {reason_text}")
    if result.status == SetStateStatus.ABORT:
        raise ApprovalError(f"RUN_ID: flow run {target.id} is no longer paused")
    return ApprovalResult(str(target.id), token, key_id, req, resumed=True)
