"""Signed borrow approvals: an Ed25519 signature that binds one decision to one request.

An approver signs, with the private key whose public half the policy lists for them
(``[[borrowing.approver_keys]]``), the *claims*: the request (federation, run id, budget
epoch, line, epsilon, the request's nonce), who signs (approver, key id) and the decision
(approve or deny, reason). :func:`verify_approval` checks a token against the policy and
the request it answers before the ledger records anything.

Signed bytes (version 1), :func:`canonical_bytes`. A header line, then the ten fields in
this order, each as ``name:<length>:<value>`` and a newline, where ``<length>`` is the
value's UTF-8 length in bytes (decimal, no leading zeros) and ``<value>`` its UTF-8 bytes
(no normalisation, newlines allowed: the length delimits)::

    clma.borrow-approval.v1\\n
    federation:<n>:<name>\\n      run_id:<n>:<flow run id>\\n   epoch:<n>:<decimal>\\n
    line:<n>:evaluation.global|evaluation.regional\\n
    epsilon:<n>:<shortest round-trip decimal of the float, Python repr>\\n
    nonce:<n>:<32 lowercase hex>\\n   approver:<n>:<name>\\n   key_id:<n>:ed25519:<16 hex>\\n
    decision:<n>:approve|deny\\n      reason:<n>:<text>\\n

Exactly one encoding per claims (parsing re-encodes and compares), so a token cannot be
re-spelled. Token text: ``clma-approval-v1.<base64url(signed bytes)>.<base64url(signature)>``
(base64url without padding; the signature is Ed25519's 64 bytes). The token carries the
claims so a refusal can say *what* differs; it holds no secret (anyone with the policy can
re-verify it) and is kept with the ledger's borrow record.

Keys: ``clma keygen`` writes the private key as unencrypted PKCS#8 PEM with mode 0600 and
prints the policy entry; :func:`load_private_key` refuses a key file readable by group or
others. Private keys never pass through this module's return values except
:func:`generate_key_pair`'s PEM.
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from clma._validation import field_errors
from clma.budget.policy import (
    MAX_TOKEN_CHARS,
    ApproverKey,
    BorrowApproval,
    BorrowRefusal,
    BorrowRequest,
    LineItem,
    PrivacyPolicy,
    approver_key_id,
)

__all__ = [
    "ENCODING_HEADER",
    "TOKEN_PREFIX",
    "ApprovalCheck",
    "ApprovalClaims",
    "ApprovalTokenError",
    "canonical_bytes",
    "claims_for",
    "decode_token",
    "generate_key_pair",
    "load_private_key",
    "parse_canonical",
    "policy_entry",
    "sign_claims",
    "verify_approval",
]

ENCODING_HEADER = b"clma.borrow-approval.v1\n"
TOKEN_PREFIX = "clma-approval-v1"
_FIELDS = ("federation", "run_id", "epoch", "line", "epsilon", "nonce", "approver", "key_id",
           "decision", "reason")
_B64URL = re.compile(r"^[A-Za-z0-9_-]+$")
_SIGNATURE_BYTES = 64


class ApprovalTokenError(ValueError):
    """A token, a key file or claims broke a rule; the message names the field."""


class ApprovalClaims(BaseModel):
    """What an approver signs: the request, who signs, and the decision."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    federation: Annotated[str, Field(max_length=200)]
    run_id: Annotated[str, Field(max_length=128)]
    epoch: Annotated[int, Field(ge=0)]
    line: Annotated[str, Field(pattern=r"^evaluation\.(global|regional)$")]
    epsilon: Annotated[float, Field(gt=0.0)]
    nonce: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
    approver: Annotated[str, Field(min_length=1, max_length=128)]
    key_id: Annotated[str, Field(pattern=r"^ed25519:[0-9a-f]{16}$")]
    approve: bool
    reason: Annotated[str, Field(max_length=1000)]

    @field_validator("epsilon")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be finite")
        return value


def _claims_error(exc: ValidationError) -> ApprovalTokenError:
    return ApprovalTokenError("; ".join(f"{loc}: {msg}" for loc, msg, _ in field_errors(exc, "claims")))


def _make_claims(**values: object) -> ApprovalClaims:
    try:
        return ApprovalClaims(**values)
    except ValidationError as exc:
        raise _claims_error(exc) from None


def claims_for(request: BorrowRequest, *, approver: str, key_id: str, approve: bool,
               reason: str) -> ApprovalClaims:
    """The claims answering ``request`` (raises :class:`ApprovalTokenError` when a field
    breaks a rule, e.g. a request without a nonce)."""
    return _make_claims(
        federation=request.federation, run_id=request.run_id, epoch=request.epoch,
        line=LineItem(request.line).value, epsilon=float(request.epsilon), nonce=request.nonce,
        approver=approver, key_id=key_id, approve=bool(approve), reason=reason,
    )


def _values(claims: ApprovalClaims) -> dict[str, str]:
    return {
        "federation": claims.federation, "run_id": claims.run_id, "epoch": str(claims.epoch),
        "line": claims.line, "epsilon": repr(claims.epsilon), "nonce": claims.nonce,
        "approver": claims.approver, "key_id": claims.key_id,
        "decision": "approve" if claims.approve else "deny", "reason": claims.reason,
    }


def canonical_bytes(claims: ApprovalClaims) -> bytes:
    """The version-1 bytes an approver signs (module docstring)."""
    out = [ENCODING_HEADER]
    for name, text in _values(claims).items():
        try:
            value = text.encode("utf-8")
        except UnicodeEncodeError:
            raise ApprovalTokenError(f"{name}: must be valid Unicode text") from None
        out.append(b"%s:%d:%s\n" % (name.encode("ascii"), len(value), value))
    return b"".join(out)


def parse_canonical(data: bytes) -> ApprovalClaims:
    """Claims from version-1 bytes; :class:`ApprovalTokenError` names the first field
    that is absent, out of order, mis-sized or not in its one canonical spelling."""
    if not data.startswith(ENCODING_HEADER):
        raise ApprovalTokenError("encoding: not clma.borrow-approval.v1 bytes")
    pos = len(ENCODING_HEADER)
    raw: dict[str, str] = {}
    for name in _FIELDS:
        prefix = name.encode("ascii") + b":"
        if not data.startswith(prefix, pos):
            raise ApprovalTokenError(f"{name}: missing or out of order")
        pos += len(prefix)
        colon = data.find(b":", pos)
        digits = data[pos:colon] if colon >= 0 else b""
        if not digits.isdigit() or (len(digits) > 1 and digits.startswith(b"0")):
            raise ApprovalTokenError(f"{name}: the length must be a decimal without leading zeros")
        length = int(digits)
        start, end = colon + 1, colon + 1 + length
        if end >= len(data) + 1 or data[end:end + 1] != b"\n":
            raise ApprovalTokenError(f"{name}: the value does not end after its length")
        try:
            raw[name] = data[start:end].decode("utf-8")
        except UnicodeDecodeError:
            raise ApprovalTokenError(f"{name}: not UTF-8") from None
        pos = end + 1
    if pos != len(data):
        raise ApprovalTokenError("encoding: bytes after the last field")
    if raw["decision"] not in ("approve", "deny"):
        raise ApprovalTokenError("decision: must be 'approve' or 'deny'")
    if not raw["epoch"].isascii() or not raw["epoch"].isdigit():
        raise ApprovalTokenError("epoch: not a non-negative decimal integer")
    if not re.fullmatch(r"[0-9][0-9.e+-]*", raw["epsilon"]):
        raise ApprovalTokenError("epsilon: not a decimal number")
    try:
        epsilon = float(raw["epsilon"])
    except ValueError:
        raise ApprovalTokenError("epsilon: not a decimal number") from None
    claims = _make_claims(
        federation=raw["federation"], run_id=raw["run_id"], epoch=int(raw["epoch"]),
        line=raw["line"], epsilon=epsilon, nonce=raw["nonce"], approver=raw["approver"],
        key_id=raw["key_id"], approve=raw["decision"] == "approve", reason=raw["reason"],
    )
    if canonical_bytes(claims) != data:
        bad = next(n for n, v in _values(claims).items() if v != raw[n])
        raise ApprovalTokenError(f"{bad}: not in its canonical spelling")
    return claims


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64url(text: str, what: str) -> bytes:
    if not _B64URL.fullmatch(text) or len(text) % 4 == 1:
        raise ApprovalTokenError(f"token: the {what} is not base64url")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise ApprovalTokenError(f"token: the {what} is not base64url") from None


def sign_claims(claims: ApprovalClaims, private_key: Ed25519PrivateKey) -> str:
    """The token for ``claims``, signed with ``private_key``.

    Raises:
        ApprovalTokenError: ``claims.key_id`` is not the id of ``private_key``'s public key.
    """
    public = private_key.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    if approver_key_id(public) != claims.key_id:
        raise ApprovalTokenError("key_id: is not the id of the signing key")
    data = canonical_bytes(claims)
    return f"{TOKEN_PREFIX}.{_b64url(data)}.{_b64url(private_key.sign(data))}"


def decode_token(token: str) -> tuple[ApprovalClaims, bytes, bytes]:
    """``(claims, signed bytes, signature)`` of a token, without checking the signature.

    Raises:
        ApprovalTokenError: not a version-1 token, or its claims break a rule.
    """
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
        raise ApprovalTokenError(f"token: must be text of at most {MAX_TOKEN_CHARS} characters")
    parts = token.strip().split(".")
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        raise ApprovalTokenError(f"token: must be '{TOKEN_PREFIX}.<claims>.<signature>'")
    data = _unb64url(parts[1], "claims part")
    signature = _unb64url(parts[2], "signature part")
    if len(signature) != _SIGNATURE_BYTES:
        raise ApprovalTokenError("token: the signature must be 64 bytes (Ed25519)")
    return parse_canonical(data), data, signature


# --------------------------------------------------------------------------- keys


def generate_key_pair(approver: str) -> tuple[bytes, ApproverKey]:
    """A new Ed25519 key pair: (private key as PKCS#8 PEM, the policy entry)."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    raw = key.public_key().public_bytes(serialization.Encoding.Raw,
                                        serialization.PublicFormat.Raw)
    entry = ApproverKey(name=approver, public_key=base64.b64encode(raw).decode("ascii"),
                        key_id=approver_key_id(raw))
    return pem, entry


def policy_entry(key: ApproverKey) -> str:
    """The TOML entry of ``key`` for the policy's ``[borrowing]`` section."""
    def q(text: str) -> str:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

    return (f"[[borrowing.approver_keys]]\nname = {q(key.name)}\nkey_id = {q(key.key_id)}\n"
            f"public_key = {q(key.public_key)}\n")


def load_private_key(path: str | Path) -> tuple[Ed25519PrivateKey, str]:
    """``(private key, key id)`` from a PEM file written by ``clma keygen``.

    Raises:
        ApprovalTokenError: the file is missing, readable by group or others (as ssh,
            refused: ``chmod 600``), or not an unencrypted Ed25519 private key.
    """
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except OSError:
        raise ApprovalTokenError(f"--key {str(p)!r}: cannot be read") from None
    if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ApprovalTokenError(
            f"--key {str(p)!r}: permissions {stat.S_IMODE(mode):04o} are too open (group or "
            f"others may read it); run: chmod 600 {p}")
    try:
        key = serialization.load_pem_private_key(p.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        raise ApprovalTokenError(
            f"--key {str(p)!r}: not an unencrypted PEM private key (clma keygen writes one)"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ApprovalTokenError(f"--key {str(p)!r}: not an Ed25519 private key")
    raw = key.public_key().public_bytes(serialization.Encoding.Raw,
                                        serialization.PublicFormat.Raw)
    return key, approver_key_id(raw)


# --------------------------------------------------------------------------- verification


@dataclass(frozen=True)
class ApprovalCheck:
    """Outcome of :func:`verify_approval`: ``refusal`` ``None`` means the token is a valid
    signature of this approver's key over this request and this decision (``key_id``);
    otherwise ``detail`` names the field or the check that failed."""

    refusal: BorrowRefusal | None
    detail: str = ""
    key_id: str | None = None


def verify_approval(
    request: BorrowRequest, approval: BorrowApproval, policy: PrivacyPolicy
) -> ApprovalCheck:
    """Check ``approval.token`` against the policy's keys, the request and the form.

    In order: a token is present (``approval_token_missing``) and well formed
    (``approval_token_malformed``); it is signed as the form's approver
    (``approval_form_mismatch``) with a key the policy lists for that approver
    (``approver_key_unknown``: a forgery with another key); the signature verifies
    (``approval_signature_invalid``: a forgery naming a listed key, or a token altered
    after signing); it was signed for this request (``approval_token_replayed``: another
    nonce, run, epoch, federation, line or amount); and the form's decision and reason are
    the signed ones (``approval_form_mismatch``).
    """
    token = approval.token.strip()
    if not token:
        return ApprovalCheck(BorrowRefusal.TOKEN_MISSING,
                             "token: missing (sign with `clma approve RUN_ID --key FILE`)")
    try:
        claims, data, signature = decode_token(token)
    except ApprovalTokenError as exc:
        return ApprovalCheck(BorrowRefusal.TOKEN_MALFORMED, str(exc))
    if claims.approver != approval.approver:
        return ApprovalCheck(BorrowRefusal.FORM_MISMATCH,
                             "approver: the token is signed by another approver than the form names")
    key = policy.borrowing.key_of(claims.approver, claims.key_id)
    if key is None:
        return ApprovalCheck(
            BorrowRefusal.KEY_UNKNOWN,
            f"key_id: {claims.key_id} is not a key of {claims.approver!r} on policy "
            f"{policy.policy_version}")
    try:
        Ed25519PublicKey.from_public_bytes(key.public_key_bytes).verify(signature, data)
    except InvalidSignature:
        return ApprovalCheck(
            BorrowRefusal.SIGNATURE_INVALID,
            f"signature: does not verify with {key.key_id} of {key.name!r} (signed with "
            "another key, or altered after signing)")
    expected = {
        "nonce": request.nonce, "run_id": request.run_id, "epoch": request.epoch,
        "federation": request.federation, "line": LineItem(request.line).value,
        "epsilon": float(request.epsilon),
    }
    for name, value in expected.items():
        if getattr(claims, name) != value:
            return ApprovalCheck(
                BorrowRefusal.TOKEN_REPLAYED,
                f"{name}: the token was signed for another request ({name} differs)")
    if claims.approve != approval.approve:
        return ApprovalCheck(BorrowRefusal.FORM_MISMATCH,
                             "approve: the form's decision is not the signed decision")
    if claims.reason != approval.reason:
        return ApprovalCheck(BorrowRefusal.FORM_MISMATCH,
                             "reason: the form's reason is not the signed reason")
    return ApprovalCheck(None, "", key.key_id)
