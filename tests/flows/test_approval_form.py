"""The borrow-approval form and `clma approve`'s wait, without a server: every field of the
form is required in the schema Prefect saves (the UI marks a field "(Optional)" when it is
not in "required"); the form's description shows the federation, the round, the line's
cap / spent / remaining and the deadline; the approval run ends with the submitted
decision in its state message and logs; `clma approve` retries a run the API does not
show yet, for a bounded time, and then says why it failed."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

import pytest

from clma.budget import BorrowRequest
from flows import approval
from flows.approval import ApprovalError, _form_description, _paused_target, approval_form

REQ = BorrowRequest(epoch=0, line="evaluation.global", epsilon=0.30000000000000004,
                    run_id="r-1", federation="fed-a", nonce="0" * 32,
                    reason="round 3: release 'global.accuracy' would exceed the "
                           "evaluation.global line of epoch 0")


def test_every_field_of_the_saved_form_schema_is_required():
    from prefect._internal.pydantic.v2_schema import create_v2_schema

    form = approval_form(["alice", "bob"], "d")
    schema = create_v2_schema(form.__name__, model_base=form)  # what RunInput.save stores
    assert set(schema["required"]) == {"approver", "approve", "reason", "token"}
    assert schema["properties"]["approver"]["enum"] == ["alice", "bob"]
    assert schema["properties"]["reason"]["minLength"] == 1
    for name in ("approve", "reason"):
        assert "default" not in schema["properties"][name]


def test_the_description_shows_federation_round_line_budget_and_deadline():
    now = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC
    text = _form_description(REQ, ("alice",), timeout=600, now=now,
                             line_budget={"cap": 1.5, "spent": 1.2000000000000002,
                                          "remaining": 0.29999999999999982})
    assert "| federation | `fed-a` |" in text
    assert "| round | 3 |" in text
    assert "cap 1.5, spent 1.2, remaining 0.3" in text
    assert "**Deadline: 2027-01-15 08:10:00 UTC** (in 600 s)" in text
    assert "epsilon 0.3 from epoch 1" in text
    assert "0.30000000000000004" not in text and "1.2000000000000002" not in text
    assert "(the ledger could not be read)" in _form_description(REQ, ("alice",))


class _Client:
    """A Prefect client whose API shows the run only after ``hidden`` reads."""

    def __init__(self, hidden: int) -> None:
        self.hidden, self.reads = hidden, 0
        state = SimpleNamespace(is_paused=lambda: True, is_final=lambda: False, name="Paused",
                                state_details=SimpleNamespace(run_input_keyset={"schema": "s"}))
        self.run = SimpleNamespace(id=uuid.uuid4(), state=state)

    def read_flow_run(self, rid):
        from prefect.exceptions import ObjectNotFound

        self.reads += 1
        if self.reads <= self.hidden:
            raise ObjectNotFound(http_exc=RuntimeError("404"))
        return self.run

    def read_flow_run_input(self, rid, key):
        return "{}"


def test_approve_retries_a_run_the_api_does_not_show_yet():
    client = _Client(hidden=3)
    t0 = time.monotonic()
    assert _paused_target(client, client.run.id, wait_seconds=10) is client.run
    assert client.reads == 4 and time.monotonic() - t0 < 5


def test_approve_gives_up_after_the_bounded_wait_and_says_why():
    client = _Client(hidden=10**6)
    t0 = time.monotonic()
    with pytest.raises(ApprovalError) as err:
        _paused_target(client, client.run.id, wait_seconds=1.5)
    assert 1.5 <= time.monotonic() - t0 < 5
    msg = str(err.value)
    assert f"no flow run {client.run.id} on this Prefect API" in msg
    assert "PREFECT_API_URL" in msg and "(waited 1.5 s)" in msg


def test_the_approval_run_shows_the_submitted_decision(prefect_harness, monkeypatch):
    answer = SimpleNamespace(approver="alice", approve=False, reason="not this quarter",
                             token="t0ken")
    monkeypatch.setattr(approval, "pause_flow_run", lambda **kw: answer)
    state = approval.borrow_approval_flow(
        0, "evaluation-global", "d", 60, 1.0, request={"federation": "fed-a"},
        approvers=["alice"], return_state=True)
    assert state.is_completed()
    assert state.message.startswith("decision submitted: DENIED by alice: not this quarter")
    assert "t0ken" not in state.message
    assert state.result() == {"approver": "alice", "approve": False,
                              "reason": "not this quarter", "token": "t0ken"}
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + 30
    with get_client(sync_client=True) as client:
        while True:
            logs = [lg.message for lg in client.read_logs(log_filter=LogFilter(
                flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))]
            if any("decision submitted" in m for m in logs) or time.monotonic() > deadline:
                break
            time.sleep(1)
    assert any(m.startswith("decision submitted: DENIED by alice") for m in logs), logs
