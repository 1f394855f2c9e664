"""Signed borrow approvals: the canonical bytes (literal), the token, every bound field, the
policy's approver keys, the ledger's record of accepted and refused tokens, key files."""

from __future__ import annotations

import base64
import os
import sqlite3
import tomllib

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from clma.budget import (
    BorrowApproval,
    BorrowRefusal,
    BorrowRequest,
    LineItem,
    PolicyError,
    PrivacyLedger,
    decide_borrow,
    load_policy,
)
from clma.budget.approval_token import (
    ENCODING_HEADER,
    ApprovalClaims,
    ApprovalTokenError,
    canonical_bytes,
    claims_for,
    decode_token,
    generate_key_pair,
    load_private_key,
    parse_canonical,
    policy_entry,
    sign_claims,
    verify_approval,
)
from tests.clma.approval_keys import key_entry, signed_policy_text, test_key

REQUEST = BorrowRequest(
    epoch=3, line="evaluation.regional", epsilon=0.1, run_id="0b7f3c1e-2d4a-4c55-9e61-7a8b9c0d1e2f",
    federation="clma-digits", nonce="00112233445566778899aabbccddeeff", reason="round 7 overspends",
)
REASON = "quarterly review: café ✓\nsecond line"
KEY_ID = "ed25519:86745c033d054f4f"  # of test_key("privacy-officer")

# The version-1 encoding, written out by hand from the documented format: lengths are
# UTF-8 bytes ("café ✓" is 9 bytes), the reason keeps its newline.
EXPECTED_BYTES = (
    b"clma.borrow-approval.v1\n"
    b"federation:11:clma-digits\n"
    b"run_id:36:0b7f3c1e-2d4a-4c55-9e61-7a8b9c0d1e2f\n"
    b"epoch:1:3\n"
    b"line:19:evaluation.regional\n"
    b"epsilon:3:0.1\n"
    b"nonce:32:00112233445566778899aabbccddeeff\n"
    b"approver:15:privacy-officer\n"
    b"key_id:24:ed25519:86745c033d054f4f\n"
    b"decision:7:approve\n"
    b"reason:39:quarterly review: caf\xc3\xa9 \xe2\x9c\x93\nsecond line\n"
)
# Ed25519 (RFC 8032) signatures are deterministic: the test key's signature of those bytes.
EXPECTED_SIGNATURE_B64URL = (
    "UTekphLpPl8MFBJljiesRC_0OWe8ySMXDJfvPiVIq5jTd8169Wb9Lh744Ismsqe4-Q13R0inPX5Jj-Ke0KAsCA")


def _claims(**change) -> ApprovalClaims:
    base = claims_for(REQUEST, approver="privacy-officer", key_id=KEY_ID, approve=True,
                      reason=REASON)
    return base.model_copy(update=change)


def _approval(token: str, **form) -> BorrowApproval:
    values = {"approver": "privacy-officer", "approve": True, "reason": REASON, "token": token}
    return BorrowApproval(**{**values, **form})


@pytest.fixture
def token() -> str:
    return sign_claims(_claims(), test_key("privacy-officer"))


# ------------------------------------------------------------------ encoding


def test_canonical_bytes_are_the_documented_encoding():
    assert key_entry("privacy-officer").key_id == KEY_ID
    assert canonical_bytes(_claims()) == EXPECTED_BYTES
    assert EXPECTED_BYTES.startswith(ENCODING_HEADER)
    # a denial and an empty reason are spelled too
    assert canonical_bytes(_claims(approve=False, reason="")).endswith(
        b"decision:4:deny\nreason:0:\n")
    # epsilon is the shortest round-trip decimal of the float
    assert b"\nepsilon:19:0.30000000000000004\n" in canonical_bytes(_claims(epsilon=0.1 + 0.2))


def test_token_is_prefix_claims_and_a_deterministic_signature(token):
    prefix, claims_part, sig_part = token.split(".")
    assert prefix == "clma-approval-v1"
    assert base64.urlsafe_b64decode(claims_part + "=" * (-len(claims_part) % 4)) == EXPECTED_BYTES
    assert sig_part == EXPECTED_SIGNATURE_B64URL
    assert "=" not in token
    sig = base64.urlsafe_b64decode(sig_part + "==")
    test_key("privacy-officer").public_key().verify(sig, EXPECTED_BYTES)  # raises if wrong
    claims, data, signature = decode_token(token)
    assert (claims, data, signature) == (_claims(), EXPECTED_BYTES, sig)


def test_parse_roundtrip_and_one_spelling_per_claims():
    assert parse_canonical(EXPECTED_BYTES) == _claims()
    cases = {
        b"epoch:1:3\n": (b"epoch:2:03\n", "epoch: not in its canonical spelling"),
        b"epsilon:3:0.1\n": (b"epsilon:4:0.10\n", "epsilon: not in its canonical spelling"),
        b"decision:7:approve\n": (b"decision:3:yes\n", "decision: must be 'approve' or 'deny'"),
        b"line:19:": (b"line:019:", "line: the length must be a decimal without leading zeros"),
        b"federation:11:": (b"federation:12:", "federation: the value does not end"),
        b"run_id:36:0b7f3c1e-2d4a-4c55-9e61-7a8b9c0d1e2f\nepoch:1:3\n": (
            b"epoch:1:3\nrun_id:36:0b7f3c1e-2d4a-4c55-9e61-7a8b9c0d1e2f\n",
            "run_id: missing or out of order"),
    }
    for old, (new, message) in cases.items():
        with pytest.raises(ApprovalTokenError, match=message):
            parse_canonical(EXPECTED_BYTES.replace(old, new, 1))
    with pytest.raises(ApprovalTokenError, match="bytes after the last field"):
        parse_canonical(EXPECTED_BYTES + b"x")
    with pytest.raises(ApprovalTokenError, match="not clma.borrow-approval.v1"):
        parse_canonical(EXPECTED_BYTES.replace(b".v1\n", b".v2\n", 1))
    with pytest.raises(ApprovalTokenError, match="nonce"):
        parse_canonical(EXPECTED_BYTES.replace(b"aabbcc", b"AABBCC"))  # lowercase hex only


def test_claims_need_the_request_nonce_and_a_finite_amount():
    with pytest.raises(ApprovalTokenError, match="nonce"):
        claims_for(REQUEST.model_copy(update={"nonce": ""}), approver="privacy-officer",
                   key_id=KEY_ID, approve=True, reason="x")
    with pytest.raises(ApprovalTokenError, match="key_id: is not the id of the signing key"):
        sign_claims(_claims(key_id="ed25519:0000000000000000"), test_key("privacy-officer"))


# ------------------------------------------------------------------ verification


def test_a_correct_token_verifies_with_the_key_id(token, signed_policy):
    check = verify_approval(REQUEST, _approval(token), signed_policy)
    assert (check.refusal, check.key_id, check.detail) == (None, KEY_ID, "")


@pytest.mark.parametrize(("field", "value"), [
    ("federation", "other-federation"),
    ("run_id", "5c3e1f00-0000-4000-8000-000000000000"),
    ("epoch", 4),
    ("line", LineItem.EVALUATION_GLOBAL),
    ("epsilon", 0.1000000001),
    ("nonce", "ffeeddccbbaa99887766554433221100"),
])
def test_a_token_for_another_request_is_replayed(token, signed_policy, field, value):
    other = REQUEST.model_copy(update={field: value})
    check = verify_approval(other, _approval(token), signed_policy)
    assert check.refusal is BorrowRefusal.TOKEN_REPLAYED and check.key_id is None
    assert check.detail.startswith(f"{field}: the token was signed for another request")


@pytest.mark.parametrize(("field", "form_value"), [
    ("approve", False), ("reason", REASON + " "), ("approver", "dpo-deputy")])
def test_a_form_that_differs_from_the_signed_decision_is_refused(token, signed_policy, field,
                                                                 form_value):
    check = verify_approval(REQUEST, _approval(token, **{field: form_value}), signed_policy)
    assert check.refusal is BorrowRefusal.FORM_MISMATCH
    assert check.detail.startswith(f"{field}: ")


@pytest.mark.parametrize(("field", "value"), [
    ("federation", "clma-digitz"), ("run_id", "0b7f3c1e-2d4a-4c55-9e61-7a8b9c0d1e20"),
    ("epoch", 2), ("line", "evaluation.global"), ("epsilon", 0.2),
    ("nonce", "00112233445566778899aabbccddeefe"), ("approve", False), ("reason", "approved"),
])
def test_every_bound_field_altered_in_the_token_breaks_the_signature(token, signed_policy,
                                                                     field, value):
    _, _, sig = decode_token(token)
    altered = canonical_bytes(_claims(**{field: value}))
    assert altered != EXPECTED_BYTES
    forged = (f"clma-approval-v1.{base64.urlsafe_b64encode(altered).rstrip(b'=').decode()}."
              f"{base64.urlsafe_b64encode(sig).rstrip(b'=').decode()}")
    # the form matches the altered claims, so only the signature can catch it
    form = {"approve": value} if field == "approve" else {"reason": value} if field == "reason" else {}
    check = verify_approval(REQUEST, _approval(forged, **form), signed_policy)
    assert check.refusal is BorrowRefusal.SIGNATURE_INVALID
    assert check.detail.startswith(f"signature: does not verify with {KEY_ID}")


def test_forged_right_name_wrong_key(signed_policy):
    mallory_key = Ed25519PrivateKey.generate()
    own_id = key_entry("privacy-officer", mallory_key).key_id
    own = sign_claims(_claims(key_id=own_id), mallory_key)
    check = verify_approval(REQUEST, _approval(own), signed_policy)
    assert check.refusal is BorrowRefusal.KEY_UNKNOWN
    assert check.detail == (f"key_id: {own_id} is not a key of 'privacy-officer' on policy "
                            "clma-privacy-policy-v3")
    # the same forgery naming the approver's real key id: the signature does not verify
    data = canonical_bytes(_claims())
    sig = mallory_key.sign(data)
    claimed = ("clma-approval-v1." + base64.urlsafe_b64encode(data).rstrip(b"=").decode() + "."
               + base64.urlsafe_b64encode(sig).rstrip(b"=").decode())
    check = verify_approval(REQUEST, _approval(claimed), signed_policy)
    assert check.refusal is BorrowRefusal.SIGNATURE_INVALID
    # another approver's genuine key does not sign for privacy-officer either
    deputy = sign_claims(_claims(key_id=key_entry("dpo-deputy").key_id), test_key("dpo-deputy"))
    assert verify_approval(REQUEST, _approval(deputy), signed_policy).refusal is (
        BorrowRefusal.KEY_UNKNOWN)


@pytest.mark.parametrize(("text", "refusal", "detail"), [
    ("", BorrowRefusal.TOKEN_MISSING, "token: missing"),
    ("   ", BorrowRefusal.TOKEN_MISSING, "token: missing"),
    ("approved!", BorrowRefusal.TOKEN_MALFORMED, "token: must be 'clma-approval-v1."),
    ("clma-approval-v2.AAAA.AAAA", BorrowRefusal.TOKEN_MALFORMED, "token: must be"),
    ("clma-approval-v1.@@@@.AAAA", BorrowRefusal.TOKEN_MALFORMED, "token: the claims part"),
    ("clma-approval-v1.AAAA.AAAA", BorrowRefusal.TOKEN_MALFORMED, "token: the signature must be"),
])
def test_missing_and_malformed_tokens(signed_policy, text, refusal, detail):
    check = verify_approval(REQUEST, _approval(text), signed_policy)
    assert check.refusal is refusal and check.detail.startswith(detail)


def test_a_policy_without_keys_refuses_every_token(token):
    v1 = load_policy("privacy_policy_v1.toml")
    assert v1.policy_version == "clma-privacy-policy-v1" and v1.borrowing.approver_keys == ()
    check = verify_approval(REQUEST, _approval(token), v1)
    assert check.refusal is BorrowRefusal.KEY_UNKNOWN


# ------------------------------------------------------------------ the policy's keys


def test_policy_lists_approver_keys(signed_policy):
    keys = signed_policy.borrowing.approver_keys
    assert [(k.name, k.key_id) for k in keys] == [
        ("privacy-officer", KEY_ID), ("dpo-deputy", key_entry("dpo-deputy").key_id)]
    assert signed_policy.borrowing.key_of("privacy-officer", KEY_ID) is keys[0]
    assert signed_policy.borrowing.key_of("dpo-deputy", KEY_ID) is None
    assert signed_policy.rules_hash != load_policy().rules_hash  # keys are rules


def _entry_text(**change: str) -> str:
    e = key_entry("privacy-officer")
    values = {"name": e.name, "key_id": e.key_id, "public_key": e.public_key, **change}
    return "[[borrowing.approver_keys]]\n" + "".join(f'{k} = "{v}"\n' for k, v in values.items())


@pytest.mark.parametrize(("change", "field", "rule"), [
    ({"public_key": "not base64!"}, "borrowing.approver_keys.0.public_key", "must be standard base64"),
    ({"public_key": base64.b64encode(bytes(31)).decode()}, "borrowing.approver_keys.0.public_key",
     "exactly 32 bytes"),
    ({"key_id": "ed25519:0000000000000000"}, "borrowing.approver_keys.0.key_id",
     "must be the fingerprint of public_key"),
    ({"key_id": "privacy-officer-2026"}, "borrowing.approver_keys.0.key_id", "pattern"),
    ({"name": "mallory"}, "borrowing.approver_keys", "name 'mallory' is not on borrowing.approvers"),
])
def test_bad_approver_key_fails_naming_the_field(tmp_path, change, field, rule):
    path = tmp_path / "p.toml"
    path.write_text(load_policy_text() + "\n" + _entry_text(**change))
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    msg = str(err.value)
    assert f"field '{field}'" in msg and rule in msg
    assert msg.count("field '") == 1


def test_duplicate_key_is_refused(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(load_policy_text() + "\n" + _entry_text() + "\n" + _entry_text())
    with pytest.raises(PolicyError, match="every key_id must be unique"):
        load_policy(path)


def load_policy_text() -> str:
    return signed_policy_text().split("\n[[borrowing.approver_keys]]")[0]


def test_generated_entry_pastes_into_the_policy(tmp_path):
    pem, entry = generate_key_pair("dpo-deputy")
    text = policy_entry(entry)
    assert tomllib.loads(text)["borrowing"]["approver_keys"][0] == entry.model_dump()
    path = tmp_path / "p.toml"
    path.write_text(load_policy_text() + "\n" + text)
    assert load_policy(path).borrowing.approver_keys == (entry,)
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----") and b"PRIVATE" not in text.encode()


# ------------------------------------------------------------------ key files


def _pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def test_key_file_permissions_and_type(tmp_path):
    path = tmp_path / "k.pem"
    path.write_bytes(_pem(test_key("privacy-officer")))
    os.chmod(path, 0o644)
    with pytest.raises(ApprovalTokenError, match="permissions 0644 are too open.*chmod 600"):
        load_private_key(path)
    os.chmod(path, 0o600)
    key, key_id = load_private_key(path)
    assert key_id == KEY_ID
    other = tmp_path / "x.pem"
    other.write_bytes(_pem(X25519PrivateKey.generate()))
    os.chmod(other, 0o600)
    with pytest.raises(ApprovalTokenError, match="not an Ed25519 private key"):
        load_private_key(other)
    junk = tmp_path / "junk.pem"
    junk.write_text("hello")
    os.chmod(junk, 0o400)
    with pytest.raises(ApprovalTokenError, match="not an unencrypted PEM private key"):
        load_private_key(junk)
    with pytest.raises(ApprovalTokenError, match="cannot be read"):
        load_private_key(tmp_path / "absent.pem")


# ------------------------------------------------------------------ the ledger's record


def test_accepted_approval_records_key_id_nonce_and_token(signed_ledger, sign):
    request, approval = sign(BorrowRequest(epoch=0, line="evaluation.global", epsilon=0.5,
                                           run_id="run-a", federation="fed"),
                             "privacy-officer", reason="alerting")
    d = decide_borrow(request, approval, signed_ledger.policy, signed_ledger)
    assert d.approved and d.approver_key_id == KEY_ID and d.refusal_detail == ""
    (b,) = signed_ledger.borrows()
    assert (b["approved"], b["approver"], b["approver_key_id"], b["request_nonce"]) == (
        1, "privacy-officer", KEY_ID, request.nonce)
    # the stored token still verifies against the policy: the approval is attributable
    stored = BorrowApproval(approver="privacy-officer", approve=True, reason="alerting",
                            token=b["approval_token"])
    assert verify_approval(request, stored, signed_ledger.policy).key_id == KEY_ID
    (dec,) = [x for x in signed_ledger.decisions() if x["kind"] == "borrow_approved"]
    assert dec["detail"]["approver_key_id"] == KEY_ID


def test_refused_token_is_recorded_with_its_reason_and_training_backs_off(signed_ledger, sign):
    first, approval = sign(BorrowRequest(epoch=0, line="evaluation.global", epsilon=0.5),
                           "privacy-officer", reason="ok")
    replay_target = BorrowRequest(epoch=1, line="evaluation.global", epsilon=0.5,
                                  nonce="ab" * 16)
    d = decide_borrow(replay_target, approval, signed_ledger.policy, signed_ledger)
    assert not d.approved and d.refusal is BorrowRefusal.TOKEN_REPLAYED and d.training_frozen
    assert d.approver_key_id is None and d.refusal_detail.startswith("nonce: ")
    (b,) = signed_ledger.borrows()
    assert (b["approved"], b["refusal"], b["refusal_detail"], b["approver_key_id"],
            b["approval_token"], b["training_frozen"]) == (
        0, "approval_token_replayed", d.refusal_detail, None, None, 1)
    (dec,) = [x for x in signed_ledger.decisions() if x["kind"] == "borrow_refused"]
    assert (dec["detail"]["refusal"], dec["detail"]["refusal_detail"]) == (
        "approval_token_replayed", d.refusal_detail)
    assert signed_ledger.table(1)[0].training_frozen
    assert signed_ledger.table(1)[2].borrowed_epsilon == 0.0


def test_a_ledger_written_before_signed_approvals_opens_and_records(tmp_path, signed_policy, sign):
    path = tmp_path / "old.sqlite"
    con = sqlite3.connect(path)
    con.execute(  # the borrows table as it was, with one old decision
        "CREATE TABLE borrows (id INTEGER PRIMARY KEY, epoch INTEGER NOT NULL, line TEXT NOT NULL,"
        " epsilon REAL NOT NULL, approved INTEGER NOT NULL, refusal TEXT, approver TEXT,"
        " approver_reason TEXT NOT NULL, run_id TEXT NOT NULL, request_reason TEXT NOT NULL,"
        " training_frozen INTEGER NOT NULL, policy_version TEXT NOT NULL, decided_at TEXT NOT NULL)")
    con.execute("INSERT INTO borrows VALUES (1, 5, 'evaluation.global', 0.5, 0, 'denied', 'x', '',"
                " '', '', 1, 'clma-privacy-policy-v1', 'then')")
    con.commit()
    con.close()
    led = PrivacyLedger(path, signed_policy)
    d = decide_borrow(*sign(BorrowRequest(epoch=0, line="evaluation.global", epsilon=0.5),
                            "dpo-deputy"), led.policy, led)
    assert d.approved
    old, new = led.borrows()
    assert (old["refusal"], old["approver_key_id"], old["request_nonce"]) == ("denied", None, None)
    assert new["approver_key_id"] == key_entry("dpo-deputy").key_id
