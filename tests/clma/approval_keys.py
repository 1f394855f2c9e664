"""Approver keys for the borrowing tests: fixed Ed25519 test keys (Ed25519 signatures are
deterministic, so tokens are reproducible byte for byte), the shipped policy with their
public keys, and a helper that signs a decision for a request. Imported by
``tests/clma/conftest.py`` and the tests (as ``tests.clma.approval_keys``: the repository root is on ``sys.path``)."""

from __future__ import annotations

import hashlib
from importlib import resources

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from clma.budget import BorrowApproval, BorrowRequest
from clma.budget.approval_token import claims_for, policy_entry, sign_claims
from clma.budget.policy import ApproverKey, approver_key_id

APPROVERS = ("privacy-officer", "dpo-deputy")


def test_key(name: str) -> Ed25519PrivateKey:
    """A fixed test key per name (seed: SHA-256 of ``clma-test-key:<name>``); never a real key."""
    return Ed25519PrivateKey.from_private_bytes(
        hashlib.sha256(f"clma-test-key:{name}".encode()).digest())


test_key.__test__ = False  # not a test


def key_entry(name: str, key: Ed25519PrivateKey | None = None) -> ApproverKey:
    import base64

    from cryptography.hazmat.primitives import serialization

    raw = (key or test_key(name)).public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return ApproverKey(name=name, public_key=base64.b64encode(raw).decode(),
                       key_id=approver_key_id(raw))


def signed_policy_text(policy_file: str = "privacy_policy_v3.toml") -> str:
    """The shipped policy with the test keys of both approvers appended."""
    text = resources.files("clma").joinpath("policy", policy_file).read_text()
    return text + "\n" + "\n".join(policy_entry(key_entry(n)) for n in APPROVERS)


def signed(request: BorrowRequest, approver: str, *, approve: bool = True, reason: str = "",
           key: Ed25519PrivateKey | None = None) -> tuple[BorrowRequest, BorrowApproval]:
    """``(request with a nonce, approval signed by approver's test key)`` for decide_borrow."""
    if not request.nonce:
        nonce = hashlib.sha256(repr(request).encode()).hexdigest()[:32]
        request = request.model_copy(update={"nonce": nonce})
    k = key or test_key(approver)
    entry = key_entry(approver, k)
    claims = claims_for(request, approver=approver, key_id=entry.key_id, approve=approve,
                        reason=reason)
    token = sign_claims(claims, k)
    return request, BorrowApproval(approver=approver, approve=approve, reason=reason, token=token)
