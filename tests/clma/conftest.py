"""Fixtures of the library tests: approver keys and a ledger under a policy that lists them
(helpers in ``approval_keys.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from clma.budget import load_policy
from tests.clma.approval_keys import signed, signed_policy_text


@pytest.fixture
def signed_policy(tmp_path: Path):
    """The shipped policy (v3) with the test approvers' public keys."""
    path = tmp_path / "signed_policy.toml"
    path.write_text(signed_policy_text())
    return load_policy(path)


@pytest.fixture
def sign():
    """:func:`signed`: ``sign(request, approver, approve=True, reason="")`` -> (request,
    approval) to pass to ``decide_borrow(*sign(...), policy, ledger)``."""
    return signed


@pytest.fixture
def signed_ledger(tmp_path: Path, signed_policy):
    """A fresh ledger under :func:`signed_policy`."""
    from clma.budget import PrivacyLedger

    return PrivacyLedger(tmp_path / "state", signed_policy)
