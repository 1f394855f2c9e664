"""The versioned privacy policy and the borrowing rule.

The policy is a TOML file reviewed like code (``clma/policy/privacy_policy_v3.toml``):
the per-client (epsilon, delta) cap per budget epoch, the per-client lifetime cap over all
epochs, the epoch length in rounds, the training / evaluation split, the global / regional
split inside evaluation, the regional cadence, the borrowing limit, the approver allow-list
and the approvers' public keys, the minimum-group-size floor and the mechanism versions.
:func:`load_policy` validates it into a frozen :class:`PrivacyPolicy` and records the
file's SHA-256 ``content_hash``; a bad value raises one :class:`PolicyError` naming the
field and the rule.

Line items (basic composition across them, so their epsilons and deltas add up to the cap)::

    training             = cap * training_fraction
    evaluation.global    = cap * evaluation_fraction * global_fraction
    evaluation.regional  = cap * evaluation_fraction * regional_fraction

Lifetime cap (``[budget] lifetime_epsilon_per_client``, ``lifetime_delta_per_client``):
a client's spend over all epochs, composed by basic composition of the per-epoch totals,
may not pass it (:class:`~clma.budget.ledger.PrivacyLedger` refuses the charge with
``exceeds_lifetime_cap``). It must be at least the per-epoch cap. The ``v1`` policies
predate it and stay loadable (no lifetime cap) for the ledgers and tests that refer to them;
the default is ``privacy_policy_v3``.

Borrowing (:func:`decide_borrow`): evaluation may borrow epsilon for one of its lines from
the next epoch's allocation of the same line, at most ``max_fraction_of_next_epoch`` of it,
at most ``max_borrows_per_epoch`` times per epoch, and only with an approval by a person on
the allow-list, signed with that person's Ed25519 key listed in
``[[borrowing.approver_keys]]`` (:mod:`clma.budget.approval_token`: the token binds the
decision to the request; an approver without a key on the policy cannot approve, so the
``v1`` and ``v2`` policies, which predate keys, load but approve nothing). Every decision
(approved or refused, with its reason) is recorded in the ledger with the policy version.
On any refusal (timeout, denial, approver not on the allow-list, a refused token, already
borrowed, over the limit) *training backs off*: the ledger freezes the training line for
the rest of the epoch, while evaluation keeps its reserved allocation (whatever remains of
its lines), so monitoring does not go blind and no line is ever raised without approval.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import math
import tomllib
from enum import StrEnum
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from clma._validation import field_errors

if TYPE_CHECKING:  # pragma: no cover
    from clma.budget.approval_token import ApprovalCheck
    from clma.budget.ledger import PrivacyLedger

__all__ = [
    "DEFAULT_POLICY_FILE",
    "ApproverKey",
    "BorrowApproval",
    "BorrowDecision",
    "BorrowRefusal",
    "BorrowRequest",
    "LineItem",
    "MAX_TOKEN_CHARS",
    "PolicyError",
    "PrivacyPolicy",
    "approver_key_id",
    "decide_borrow",
    "default_policy",
    "evaluate_borrow",
    "load_policy",
]

DEFAULT_POLICY_FILE = "privacy_policy_v3.toml"
_SUM_TOLERANCE = 1e-9
_MECHANISM_VERSION_PATTERN = r"^v[1-9][0-9]{0,3}$"


class PolicyError(ValueError):
    """A policy file or a borrowing input broke a rule. The message names the field."""


class LineItem(StrEnum):
    """Budget line items of one epoch. ``evaluation`` is the sum of its two sub-lines."""

    TRAINING = "training"
    EVALUATION_GLOBAL = "evaluation.global"
    EVALUATION_REGIONAL = "evaluation.regional"


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


_Fraction = Annotated[float, Field(gt=0.0, lt=1.0)]


class BudgetRules(_Closed):
    """Per-client cap of one budget epoch, its training / evaluation split, and the
    per-client lifetime cap.

    ``lifetime_epsilon_per_client`` / ``lifetime_delta_per_client``: the most a client may
    spend over all epochs together (basic composition of the per-epoch totals, see
    :mod:`clma.budget.ledger`). Given together, each at least its per-epoch counterpart.
    Both absent (``None``) only in policies written before lifetime caps
    (``privacy_policy_v1``, ``simulation_policy_v1``), which stay loadable for the ledgers
    and tests that refer to them; such a policy enforces no lifetime cap.
    """

    epsilon_per_client_per_epoch: Annotated[float, Field(gt=0.0)]
    delta_per_client_per_epoch: Annotated[float, Field(ge=0.0, lt=1.0)]
    epoch_length_rounds: Annotated[int, Field(ge=1)]
    training_fraction: _Fraction
    evaluation_fraction: _Fraction
    lifetime_epsilon_per_client: Annotated[float, Field(gt=0.0)] | None = None
    lifetime_delta_per_client: Annotated[float, Field(ge=0.0, lt=1.0)] | None = Field(
        default=None, validate_default=True)

    @field_validator("lifetime_epsilon_per_client")
    @classmethod
    def _lifetime_epsilon_at_least_epoch(cls, value: float | None, info: ValidationInfo) -> float | None:
        epoch = info.data.get("epsilon_per_client_per_epoch")
        if value is not None and epoch is not None and value < epoch:
            raise ValueError("the lifetime cap must be at least epsilon_per_client_per_epoch"
                             " (a lifetime cap below the epoch cap is an error)")
        return value

    @field_validator("lifetime_delta_per_client")
    @classmethod
    def _lifetime_delta_paired_and_at_least_epoch(
        cls, value: float | None, info: ValidationInfo
    ) -> float | None:
        if "lifetime_epsilon_per_client" not in info.data:
            return value  # that field failed: its own error names it
        has_epsilon = info.data["lifetime_epsilon_per_client"] is not None
        if has_epsilon != (value is not None):
            raise ValueError("lifetime_epsilon_per_client and lifetime_delta_per_client go"
                             " together: give both or neither")
        epoch = info.data.get("delta_per_client_per_epoch")
        if value is not None and epoch is not None and value < epoch:
            raise ValueError("the lifetime cap must be at least delta_per_client_per_epoch"
                             " (a lifetime cap below the epoch cap is an error)")
        return value

    @property
    def has_lifetime_cap(self) -> bool:
        return self.lifetime_epsilon_per_client is not None

    @model_validator(mode="after")
    def _split_sums_to_one(self) -> BudgetRules:
        if abs(self.training_fraction + self.evaluation_fraction - 1.0) > _SUM_TOLERANCE:
            raise ValueError("training_fraction + evaluation_fraction must equal 1")
        return self


class EvaluationRules(_Closed):
    """Global / regional split of the evaluation line, regional cadence, group floor."""

    global_fraction: _Fraction
    regional_fraction: _Fraction
    regional_cadence_rounds: Annotated[int, Field(ge=1)]
    minimum_group_size: Annotated[int, Field(ge=2, le=1_000_000)]

    @model_validator(mode="after")
    def _split_sums_to_one(self) -> EvaluationRules:
        if abs(self.global_fraction + self.regional_fraction - 1.0) > _SUM_TOLERANCE:
            raise ValueError("global_fraction + regional_fraction must equal 1")
        return self


def approver_key_id(public_key: bytes) -> str:
    """Key id of a raw 32-byte Ed25519 public key: ``ed25519:`` and the first 8 bytes of
    its SHA-256, in hex (what ``clma keygen`` prints and ledger records name)."""
    return "ed25519:" + hashlib.sha256(public_key).hexdigest()[:16]


class ApproverKey(_Closed):
    """One approver's Ed25519 public key on the policy (``clma keygen`` prints the entry).

    ``public_key``: the raw 32-byte public key in standard base64; ``key_id``: its
    fingerprint :func:`approver_key_id`. An approver may hold several keys (rotation).
    """

    name: Annotated[str, Field(min_length=1, max_length=128)]
    public_key: Annotated[str, Field(min_length=1, max_length=64)]
    key_id: Annotated[str, Field(pattern=r"^ed25519:[0-9a-f]{16}$")]

    @field_validator("public_key")
    @classmethod
    def _ed25519_public_key(cls, value: str) -> str:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("must be standard base64 (the raw 32-byte Ed25519 public key)") from None
        if len(raw) != 32:
            raise ValueError("must decode to exactly 32 bytes (a raw Ed25519 public key)")
        try:
            Ed25519PublicKey.from_public_bytes(raw)
        except ValueError:
            raise ValueError("is not a valid Ed25519 public key") from None
        return value

    @field_validator("key_id")
    @classmethod
    def _fingerprint_of_the_key(cls, value: str, info: ValidationInfo) -> str:
        key = info.data.get("public_key")
        if key is not None and value != approver_key_id(base64.b64decode(key)):
            raise ValueError("must be the fingerprint of public_key, as `clma keygen` prints it")
        return value

    @property
    def public_key_bytes(self) -> bytes:
        return base64.b64decode(self.public_key)


class BorrowingRules(_Closed):
    """How much, how often and with whose signed approval evaluation may borrow.

    ``approvers`` is the allow-list (names); ``approver_keys`` the Ed25519 public keys of
    those names. A name without a key stays on the list (policies written before keys,
    ``*_policy_v1`` and ``*_policy_v2``, load unchanged) but cannot approve: its tokens are
    refused as ``approver_key_unknown``.
    """

    max_fraction_of_next_epoch: Annotated[float, Field(ge=0.0, le=1.0)]
    max_borrows_per_epoch: Annotated[int, Field(ge=0, le=1)]
    approvers: Annotated[tuple[str, ...], Field(min_length=1)]
    approval_timeout_seconds: Annotated[int, Field(ge=1)]
    approver_keys: tuple[ApproverKey, ...] = ()

    @field_validator("approvers", "approver_keys", mode="before")
    @classmethod
    def _list_to_tuple(cls, value: object) -> object:
        return tuple(value) if isinstance(value, list) else value

    @field_validator("approvers")
    @classmethod
    def _approvers_named(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not name or name != name.strip() for name in value):
            raise ValueError("every approver must be a non-empty name without surrounding spaces")
        if len(set(value)) != len(value):
            raise ValueError("approvers must be unique")
        return value

    @field_validator("approver_keys")
    @classmethod
    def _keys_of_listed_approvers(
        cls, value: tuple[ApproverKey, ...], info: ValidationInfo
    ) -> tuple[ApproverKey, ...]:
        names = info.data.get("approvers")
        if names is not None:
            for key in value:
                if key.name not in names:
                    raise ValueError(f"name {key.name!r} is not on borrowing.approvers")
        ids = [key.key_id for key in value]
        if len(set(ids)) != len(ids):
            raise ValueError("every key_id must be unique (one public key, one entry)")
        return value

    def key_of(self, approver: str, key_id: str) -> ApproverKey | None:
        """The key ``key_id`` of ``approver`` on the policy, or ``None``."""
        for key in self.approver_keys:
            if key.name == approver and key.key_id == key_id:
                return key
        return None


class MechanismVersions(_Closed):
    """Stable mechanism versions written into every envelope."""

    threshold_only: Annotated[str, Field(pattern=_MECHANISM_VERSION_PATTERN)]
    laplace: Annotated[str, Field(pattern=_MECHANISM_VERSION_PATTERN)]
    gaussian: Annotated[str, Field(pattern=_MECHANISM_VERSION_PATTERN)]
    distributed_discrete_gaussian: Annotated[
        str, Field(pattern=_MECHANISM_VERSION_PATTERN)] = "v1"


class AccountingRules(_Closed):
    """dp-accounting settings: PLD discretisation and the RDP cross-check tolerance."""

    pld_value_discretization_interval: Annotated[float, Field(gt=0.0, le=0.1)]
    rdp_cross_check_tolerance: Annotated[float, Field(ge=0.0, le=1.0)]


class PrivacyPolicy(_Closed):
    """A validated privacy policy (frozen).

    ``content_hash`` is the SHA-256 (hex) of the policy file's bytes when loaded from a
    file; :attr:`rules_hash` is the SHA-256 of the canonical JSON of the rules alone
    (independent of comments and layout).
    """

    policy_version: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]
    budget: BudgetRules
    evaluation: EvaluationRules
    borrowing: BorrowingRules
    mechanisms: MechanismVersions
    accounting: AccountingRules
    content_hash: str = ""
    source: str = ""

    @property
    def rules_hash(self) -> str:
        rules = self.model_dump(mode="json", exclude={"content_hash", "source"})
        text = json.dumps(rules, sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def epoch_of_round(self, round_index: int) -> int:
        """Budget epoch of a round (rounds counted from 0): ``round // epoch_length_rounds``."""
        if type(round_index) is not int or round_index < 0:
            raise PolicyError("round must be a non-negative integer")
        return round_index // self.budget.epoch_length_rounds

    def line_cap(self, line: LineItem) -> tuple[float, float]:
        """Base (epsilon, delta) allocation of one line item for one epoch, per client."""
        line = LineItem(line)
        b, e = self.budget, self.evaluation
        if line is LineItem.TRAINING:
            share = b.training_fraction
        elif line is LineItem.EVALUATION_GLOBAL:
            share = b.evaluation_fraction * e.global_fraction
        else:
            share = b.evaluation_fraction * e.regional_fraction
        return b.epsilon_per_client_per_epoch * share, b.delta_per_client_per_epoch * share

    def lifetime_cap(self) -> tuple[float, float] | None:
        """Per-client lifetime (epsilon, delta) cap, or ``None`` (a v1 policy: no cap)."""
        b = self.budget
        if b.lifetime_epsilon_per_client is None or b.lifetime_delta_per_client is None:
            return None
        return b.lifetime_epsilon_per_client, b.lifetime_delta_per_client

    def mechanism_version(self, mechanism: str) -> str:
        """Version string of ``mechanism`` (``threshold_only``, ``laplace``, ``gaussian``)."""
        return getattr(self.mechanisms, str(getattr(mechanism, "value", mechanism)))


def _field_errors(exc: ValidationError) -> str:
    return "; ".join(f"field '{loc}': {msg}" for loc, msg, _ in field_errors(exc, "(policy)"))


def load_policy(path: str | Path | None = None) -> PrivacyPolicy:
    """Load and validate a policy TOML file (default: the shipped ``privacy_policy_v3``).

    ``path`` may also be the bare file name of a policy bundled in ``clma/policy/``
    (e.g. ``"simulation_policy_v1.toml"``) when no such file exists in the working
    directory.

    Raises:
        PolicyError: the file is missing or not TOML, or a field breaks a rule (the
            message names every offending field, e.g. ``budget.training_fraction``).
    """
    if path is None:
        data = resources.files("clma").joinpath("policy", DEFAULT_POLICY_FILE).read_bytes()
        source = f"clma/policy/{DEFAULT_POLICY_FILE}"
    elif (
        "/" not in str(path)
        and not Path(path).exists()
        and resources.files("clma").joinpath("policy", str(path)).is_file()
    ):  # a bare file name of a bundled policy, e.g. "simulation_policy_v1.toml"
        data = resources.files("clma").joinpath("policy", str(path)).read_bytes()
        source = f"clma/policy/{path}"
    else:
        p = Path(path)
        try:
            data = p.read_bytes()
        except OSError as exc:
            raise PolicyError(f"privacy policy file cannot be read: {p}") from exc
        source = str(p)
    try:
        raw = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise PolicyError(f"privacy policy file is not valid TOML: {source}") from exc
    if "content_hash" in raw or "source" in raw:
        raise PolicyError("privacy policy field 'content_hash'/'source': computed, not allowed in the file")
    try:
        return PrivacyPolicy.model_validate(
            {**raw, "content_hash": hashlib.sha256(data).hexdigest(), "source": source}
        )
    except ValidationError as exc:
        raise PolicyError("privacy policy " + _field_errors(exc)) from None


@functools.lru_cache(maxsize=1)
def default_policy() -> PrivacyPolicy:
    """The shipped policy (cached)."""
    return load_policy(None)


# --------------------------------------------------------------------------- borrowing


class BorrowRefusal(StrEnum):
    """Why a borrow was refused. The ``approval_*`` / ``approver_key_unknown`` reasons come
    from the check of the signed token (:func:`clma.budget.approval_token.verify_approval`)."""

    TIMEOUT = "timeout"
    NOT_ON_ALLOW_LIST = "not_on_allow_list"
    ALREADY_BORROWED_THIS_EPOCH = "already_borrowed_this_epoch"
    DENIED = "denied"
    EXCEEDS_BORROW_LIMIT = "exceeds_borrow_limit"
    TOKEN_MISSING = "approval_token_missing"
    TOKEN_MALFORMED = "approval_token_malformed"
    KEY_UNKNOWN = "approver_key_unknown"
    SIGNATURE_INVALID = "approval_signature_invalid"
    TOKEN_REPLAYED = "approval_token_replayed"
    FORM_MISMATCH = "approval_form_mismatch"


_NONCE_PATTERN = r"^([0-9a-f]{32})?$"
#: Longest approval token accepted (a token carries the signed fields, reason included).
MAX_TOKEN_CHARS = 4096


class BorrowRequest(_Closed):
    """A request to borrow ``epsilon`` for an evaluation ``line`` of ``epoch`` from the
    next epoch's allocation of the same line.

    ``federation`` names the federation, ``run_id`` the flow run that asks, ``nonce`` (32
    hex digits, fresh per request: the approval gate draws it) makes a signed approval
    valid for this request only.
    """

    epoch: Annotated[int, Field(ge=0)]
    line: LineItem
    epsilon: Annotated[float, Field(gt=0.0)]
    run_id: Annotated[str, Field(max_length=128)] = ""
    reason: Annotated[str, Field(max_length=1000)] = ""
    federation: Annotated[str, Field(max_length=200)] = ""
    nonce: Annotated[str, Field(pattern=_NONCE_PATTERN)] = ""

    @field_validator("line", mode="before")
    @classmethod
    def _line_from_str(cls, value: object) -> object:
        return LineItem(value) if isinstance(value, str) and not isinstance(value, LineItem) else value

    @field_validator("line")
    @classmethod
    def _evaluation_only(cls, value: LineItem) -> LineItem:
        if value is LineItem.TRAINING:
            raise ValueError("only evaluation lines may borrow")
        return value


class BorrowApproval(_Closed):
    """What the approval form collected (the fields of the Prefect ``RunInput``): the
    approver's name, the decision, the reason and the signed ``token`` (``clma approve``)."""

    approver: Annotated[str, Field(max_length=128)]
    approve: bool
    reason: Annotated[str, Field(max_length=1000)] = ""
    token: Annotated[str, Field(max_length=MAX_TOKEN_CHARS)] = ""


class BorrowDecision(_Closed):
    """The recorded outcome of one borrowing request.

    ``approver_key_id``: the key that signed an accepted approval (``None`` otherwise);
    ``refusal_detail``: for a refused token, which field or check failed.
    """

    decision_id: int
    epoch: int
    line: LineItem
    epsilon: float
    approved: bool
    refusal: BorrowRefusal | None
    approver: str | None
    approver_reason: str
    training_frozen: bool
    policy_version: str
    approver_key_id: str | None = None
    refusal_detail: str = ""


def evaluate_borrow(
    request: BorrowRequest,
    approval: BorrowApproval | None,
    policy: PrivacyPolicy,
    *,
    borrows_approved_this_epoch: int,
    next_epoch_line_epsilon: float,
    token_check: ApprovalCheck | None = None,
) -> BorrowRefusal | None:
    """The borrowing rule as a pure function: ``None`` when approved, else the reason.

    ``approval=None`` means the approval gate timed out. Checks, in order: timeout,
    approver on the allow-list (exact, case-sensitive match), the signed token
    (:func:`~clma.budget.approval_token.verify_approval`, or ``token_check``, its result
    when the caller already checked), borrows already approved this epoch
    (``max_borrows_per_epoch``), the approver's decision, and the amount (at most
    ``max_fraction_of_next_epoch * next_epoch_line_epsilon``).
    """
    if approval is None:
        return BorrowRefusal.TIMEOUT
    if approval.approver not in policy.borrowing.approvers:
        return BorrowRefusal.NOT_ON_ALLOW_LIST
    if token_check is None:
        from clma.budget.approval_token import verify_approval  # it imports this module

        token_check = verify_approval(request, approval, policy)
    if token_check.refusal is not None:
        return token_check.refusal
    if borrows_approved_this_epoch >= policy.borrowing.max_borrows_per_epoch:
        return BorrowRefusal.ALREADY_BORROWED_THIS_EPOCH
    if not approval.approve:
        return BorrowRefusal.DENIED
    limit = policy.borrowing.max_fraction_of_next_epoch * next_epoch_line_epsilon
    if not math.isfinite(request.epsilon) or request.epsilon > limit:
        return BorrowRefusal.EXCEEDS_BORROW_LIMIT
    return None


def decide_borrow(
    request: BorrowRequest,
    approval: BorrowApproval | None,
    policy: PrivacyPolicy,
    ledger: PrivacyLedger,
) -> BorrowDecision:
    """Decide a borrowing request and record the decision in ``ledger`` atomically.

    The Prefect approval gate only collects the form (``approval``; ``None`` on timeout)
    and calls this. The signed token is verified against the policy's keys before the
    ledger records anything; then the check of earlier borrows and the write happen in one
    ledger transaction, so two concurrent approvals cannot both borrow. On approval the
    epoch's line gains ``request.epsilon`` and the next epoch's same line loses it; on
    refusal the training line is frozen for the rest of the epoch (training backs off) and
    evaluation keeps its remaining allocation.

    Raises:
        PolicyError: ``policy`` is not the ledger's policy (versions differ).
    """
    if policy.policy_version != ledger.policy.policy_version:
        raise PolicyError("policy_version: the decision policy must be the ledger's policy")
    return ledger.record_borrow_decision(request, approval)
