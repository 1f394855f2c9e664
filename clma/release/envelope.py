"""The closed, versioned envelope every published metric travels in.

Compatible with the published OpenMed federated aggregate metric envelope
(``openmed.training.federated_metrics``, docs "Federated aggregate metrics"): the same
builder keywords, the same 14 fields, the same enum values, the same schema version
string and the same JSON layout (``indent=2``, sorted keys, trailing newline), so an
envelope built here is readable by OpenMed and vice versa (within the stricter rules below).

Fields (exactly these; ``from_dict`` rejects any other key)::

    schema_version             "openmed.training.federated_metric.v1"
    metric_id                  [a-z][a-z0-9_.-]{0,63}
    metric_kind                count | rate | bounded_mean
    aggregate_value            number, or null when suppressed
    clipping_lower_bound       number (count: integer >= 0)
    clipping_upper_bound       number (count: integer), > lower bound
    privacy_mechanism          threshold_only | laplace | gaussian |
                               distributed_discrete_gaussian (clma extension)
    privacy_mechanism_version  the policy's version of that mechanism (e.g. "v1")
    minimum_group_size         integer >= the policy floor
    participant_count_band     suppressed | minimum_to_under_double |
                               double_to_under_fourfold | fourfold_or_more
    uncertainty_method         none | confidence_interval | suppressed
    uncertainty_lower_bound    number or null
    uncertainty_upper_bound    number or null
    confidence_level           number in (0, 1) or null

There is no generic metadata and no place for client identifiers, site names, exact
counts or local values. The exact ``participant_count`` is taken by the builder, mapped
to a band relative to ``minimum_group_size`` (``m``): below ``m`` -> ``suppressed``
(value and every uncertainty field null, method ``suppressed``); ``[m, 2m)`` ->
``minimum_to_under_double``; ``[2m, 4m)`` -> ``double_to_under_fourfold``; ``>= 4m`` ->
``fourfold_or_more``; it is never stored.

Rules: clipping bounds finite and increasing and the value inside them; ``count``: value
and bounds non-negative integers (Python/numpy integers, not floats); ``rate``: bounds
(hence value) in [0, 1]; a confidence interval is finite, contains the value, lies inside
the clipping range, and its level is strictly between 0 and 1; ``none`` carries no
interval fields. The builder validates the full release *before* suppressing, so whether
an input is accepted never depends on the participant count.

Beyond the published envelope:

- the minimum group size and its floor come from the privacy policy
  (``evaluation.minimum_group_size``): a caller may ask for a larger minimum, never a
  smaller one, and ``from_dict`` refuses envelopes below the floor;
- the mechanism version must be the policy's version of that mechanism;
- canonical numbers: non-count numbers are stored as floats (``1`` and ``1.0`` give
  identical bytes), ``-0.0`` becomes ``0.0``, count values and bounds are ints; equal
  envelopes serialise to identical bytes whatever the input types (Python or numpy);
- ``from_json`` refuses duplicate keys (the standard parser keeps the last one silently),
  the ``NaN`` / ``Infinity`` tokens, number literals that overflow to infinity, integers
  of magnitude above :data:`MAX_JSON_INTEGER` (2**53 - 1, the exactly representable
  range shared with IEEE doubles and JavaScript) and documents above
  :data:`MAX_JSON_BYTES`; ``to_json`` never writes a non-finite number;
- booleans are refused wherever a number belongs;
- errors (:class:`FederatedMetricError`, a ``ValueError``) name the field and the rule and
  never echo a value.

Direct construction (``FederatedMetricEnvelope(...)``, ``model_construct``,
``model_copy(update=...)``) is refused: only :func:`build_federated_metric_envelope` and
the parsers (:meth:`FederatedMetricEnvelope.from_dict` / ``from_json``, which apply every
rule) create envelopes.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Mapping
from contextvars import ContextVar
from enum import StrEnum
from typing import Any, ClassVar, Final

from pydantic import BaseModel, ConfigDict

from clma.budget.policy import PrivacyPolicy, default_policy

__all__ = [
    "FEDERATED_METRIC_SCHEMA_VERSION",
    "MAX_JSON_BYTES",
    "MAX_JSON_INTEGER",
    "FederatedMetricEnvelope",
    "FederatedMetricError",
    "FederatedMetricKind",
    "FederatedParticipantCountBand",
    "FederatedPrivacyMechanism",
    "FederatedUncertaintyMethod",
    "build_federated_metric_envelope",
    "participant_count_band",
]

FEDERATED_METRIC_SCHEMA_VERSION: Final = "openmed.training.federated_metric.v1"
MAX_JSON_INTEGER: Final = 2**53 - 1
MAX_JSON_BYTES: Final = 65_536
_MAX_MINIMUM_GROUP_SIZE: Final = 1_000_000
_METRIC_ID = re.compile(r"[a-z][a-z0-9_.-]{0,63}")
_TOKEN: Final = object()
_BUILDING: ContextVar[object] = ContextVar("clma_envelope_builder", default=None)


class FederatedMetricKind(StrEnum):
    """Closed metric kinds."""

    COUNT = "count"
    RATE = "rate"
    BOUNDED_MEAN = "bounded_mean"


class FederatedPrivacyMechanism(StrEnum):
    """Closed privacy mechanisms: what was applied upstream of the envelope."""

    THRESHOLD_ONLY = "threshold_only"
    LAPLACE = "laplace"
    GAUSSIAN = "gaussian"
    #: clma extension: discrete Gaussian shares added on the devices, summed by secure
    #: aggregation (clma.privacy.distributed); not in the OpenMed enum.
    DISTRIBUTED_DISCRETE_GAUSSIAN = "distributed_discrete_gaussian"


class FederatedParticipantCountBand(StrEnum):
    """Coarse participant bands relative to the minimum group size ``m``."""

    SUPPRESSED = "suppressed"
    MINIMUM_TO_UNDER_DOUBLE = "minimum_to_under_double"
    DOUBLE_TO_UNDER_FOURFOLD = "double_to_under_fourfold"
    FOURFOLD_OR_MORE = "fourfold_or_more"


class FederatedUncertaintyMethod(StrEnum):
    """Closed uncertainty descriptions."""

    NONE = "none"
    CONFIDENCE_INTERVAL = "confidence_interval"
    SUPPRESSED = "suppressed"


class FederatedMetricError(ValueError):
    """An envelope input broke a rule. The message names the field, never the value."""


_FIELDS: Final = (
    "aggregate_value",
    "clipping_lower_bound",
    "clipping_upper_bound",
    "confidence_level",
    "metric_id",
    "metric_kind",
    "minimum_group_size",
    "participant_count_band",
    "privacy_mechanism",
    "privacy_mechanism_version",
    "schema_version",
    "uncertainty_lower_bound",
    "uncertainty_method",
    "uncertainty_upper_bound",
)
_INTERVAL_FIELDS: Final = ("uncertainty_lower_bound", "uncertainty_upper_bound", "confidence_level")


# ------------------------------------------------------------------ scalar rules


def _is_bool(value: object) -> bool:
    return isinstance(value, bool) or type(value).__name__ == "bool_"


def _real(value: object, field: str) -> float:
    """A finite real number as a canonical float (-0.0 -> 0.0); no bools, no strings."""
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise FederatedMetricError(f"{field}: must be a finite number (not a boolean or text)")
    try:
        out = float(value)
    except (OverflowError, ValueError, TypeError):
        raise FederatedMetricError(f"{field}: must be a finite number") from None
    if not math.isfinite(out):
        raise FederatedMetricError(f"{field}: must be a finite number")
    return out + 0.0  # -0.0 + 0.0 == +0.0


def _integer(value: object, field: str, *, minimum: int = 0, maximum: int = MAX_JSON_INTEGER) -> int:
    """A Python or numpy integer in [minimum, maximum] as a Python int; no bools/floats."""
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        raise FederatedMetricError(f"{field}: must be an integer (not a float or boolean)")
    out = int(value)
    if not minimum <= out <= maximum:
        raise FederatedMetricError(f"{field}: must be an integer in [{minimum}, {maximum}]")
    return out


def _enum(enum: type[StrEnum], value: object, field: str) -> Any:
    if isinstance(value, enum):
        return value
    if type(value) is not str:
        raise FederatedMetricError(f"{field}: must be one of the documented values")
    try:
        return enum(value)
    except ValueError:
        raise FederatedMetricError(f"{field}: must be one of the documented values") from None


def participant_count_band(participant_count: int, minimum_group_size: int) -> FederatedParticipantCountBand:
    """Band of an exact count relative to ``m = minimum_group_size`` (see module doc)."""
    n = _integer(participant_count, "participant_count", maximum=2**63 - 1)
    m = _integer(minimum_group_size, "minimum_group_size", minimum=2, maximum=_MAX_MINIMUM_GROUP_SIZE)
    if n < m:
        return FederatedParticipantCountBand.SUPPRESSED
    if n < 2 * m:
        return FederatedParticipantCountBand.MINIMUM_TO_UNDER_DOUBLE
    if n < 4 * m:
        return FederatedParticipantCountBand.DOUBLE_TO_UNDER_FOURFOLD
    return FederatedParticipantCountBand.FOURFOLD_OR_MORE


def _minimum_group_size(value: object, policy: PrivacyPolicy) -> int:
    floor = policy.evaluation.minimum_group_size
    if value is None:
        return floor
    m = _integer(value, "minimum_group_size", minimum=2, maximum=_MAX_MINIMUM_GROUP_SIZE)
    if m < floor:
        raise FederatedMetricError(
            "minimum_group_size: must not be below the privacy policy's floor "
            "(evaluation.minimum_group_size)"
        )
    return m


def _normalise(raw: Mapping[str, Any], policy: PrivacyPolicy) -> dict[str, Any]:
    """Apply every rule to a full field mapping; return canonical values."""
    out: dict[str, Any] = {}
    if type(raw["schema_version"]) is not str or raw["schema_version"] != FEDERATED_METRIC_SCHEMA_VERSION:
        raise FederatedMetricError("schema_version: unsupported schema version")
    out["schema_version"] = FEDERATED_METRIC_SCHEMA_VERSION
    metric_id = raw["metric_id"]
    if type(metric_id) is not str or _METRIC_ID.fullmatch(metric_id) is None:
        raise FederatedMetricError("metric_id: must match [a-z][a-z0-9_.-]{0,63}")
    out["metric_id"] = metric_id
    kind = out["metric_kind"] = _enum(FederatedMetricKind, raw["metric_kind"], "metric_kind")
    mech = out["privacy_mechanism"] = _enum(
        FederatedPrivacyMechanism, raw["privacy_mechanism"], "privacy_mechanism"
    )
    version = raw["privacy_mechanism_version"]
    if type(version) is not str or version != policy.mechanism_version(mech.value):
        raise FederatedMetricError(
            "privacy_mechanism_version: must be the policy's version of the mechanism"
        )
    out["privacy_mechanism_version"] = version
    out["minimum_group_size"] = _minimum_group_size(raw["minimum_group_size"], policy)
    band = out["participant_count_band"] = _enum(
        FederatedParticipantCountBand, raw["participant_count_band"], "participant_count_band"
    )
    method = out["uncertainty_method"] = _enum(
        FederatedUncertaintyMethod, raw["uncertainty_method"], "uncertainty_method"
    )

    # clipping bounds
    if kind is FederatedMetricKind.COUNT:
        lo: float | int = _integer(raw["clipping_lower_bound"], "clipping_lower_bound")
        hi: float | int = _integer(raw["clipping_upper_bound"], "clipping_upper_bound")
    else:
        lo = _real(raw["clipping_lower_bound"], "clipping_lower_bound")
        hi = _real(raw["clipping_upper_bound"], "clipping_upper_bound")
    if not lo < hi:
        raise FederatedMetricError("clipping bounds: must be increasing (lower < upper)")
    if kind is FederatedMetricKind.RATE and not (0.0 <= lo and hi <= 1.0):
        raise FederatedMetricError("clipping bounds: a rate's bounds must lie in [0, 1]")
    out["clipping_lower_bound"], out["clipping_upper_bound"] = lo, hi

    if band is FederatedParticipantCountBand.SUPPRESSED:
        if raw["aggregate_value"] is not None:
            raise FederatedMetricError("aggregate_value: a suppressed metric carries no value")
        if method is not FederatedUncertaintyMethod.SUPPRESSED:
            raise FederatedMetricError("uncertainty_method: a suppressed metric must be 'suppressed'")
        if any(raw[f] is not None for f in _INTERVAL_FIELDS):
            raise FederatedMetricError("uncertainty: a suppressed metric carries no interval fields")
        out["aggregate_value"] = None
        out.update(dict.fromkeys(_INTERVAL_FIELDS))
        return out

    if raw["aggregate_value"] is None:
        raise FederatedMetricError("aggregate_value: a released metric needs a value")
    if kind is FederatedMetricKind.COUNT:
        value: float | int = _integer(raw["aggregate_value"], "aggregate_value")
    else:
        value = _real(raw["aggregate_value"], "aggregate_value")
    if not lo <= value <= hi:
        raise FederatedMetricError("aggregate_value: must lie inside the clipping bounds")
    out["aggregate_value"] = value

    if method is FederatedUncertaintyMethod.SUPPRESSED:
        raise FederatedMetricError("uncertainty_method: 'suppressed' only for a suppressed metric")
    if method is FederatedUncertaintyMethod.NONE:
        if any(raw[f] is not None for f in _INTERVAL_FIELDS):
            raise FederatedMetricError("uncertainty: interval fields require 'confidence_interval'")
        out.update(dict.fromkeys(_INTERVAL_FIELDS))
        return out
    for f in _INTERVAL_FIELDS:
        if raw[f] is None:
            raise FederatedMetricError(f"{f}: required by 'confidence_interval'")
    u_lo = _real(raw["uncertainty_lower_bound"], "uncertainty_lower_bound")
    u_hi = _real(raw["uncertainty_upper_bound"], "uncertainty_upper_bound")
    level = _real(raw["confidence_level"], "confidence_level")
    if not u_lo <= value <= u_hi:
        raise FederatedMetricError("confidence interval: must contain the aggregate value")
    if not (lo <= u_lo and u_hi <= hi):
        raise FederatedMetricError("confidence interval: must lie inside the clipping bounds")
    if not 0.0 < level < 1.0:
        raise FederatedMetricError("confidence_level: must be strictly between 0 and 1")
    out["uncertainty_lower_bound"], out["uncertainty_upper_bound"] = u_lo, u_hi
    out["confidence_level"] = level
    return out


# ------------------------------------------------------------------ the model


class FederatedMetricEnvelope(BaseModel):
    """Immutable, closed, versioned envelope of one released aggregate metric.

    Build with :func:`build_federated_metric_envelope`; parse with :meth:`from_dict` /
    :meth:`from_json`. See the module docstring for the fields and rules.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    FIELDS: ClassVar[tuple[str, ...]] = _FIELDS

    schema_version: str
    metric_id: str
    metric_kind: FederatedMetricKind
    aggregate_value: int | float | None
    clipping_lower_bound: int | float
    clipping_upper_bound: int | float
    privacy_mechanism: FederatedPrivacyMechanism
    privacy_mechanism_version: str
    minimum_group_size: int
    participant_count_band: FederatedParticipantCountBand
    uncertainty_method: FederatedUncertaintyMethod
    uncertainty_lower_bound: float | None
    uncertainty_upper_bound: float | None
    confidence_level: float | None

    def __init__(self, **data: Any) -> None:
        if _BUILDING.get() is not _TOKEN:
            raise FederatedMetricError(
                "FederatedMetricEnvelope: built only by build_federated_metric_envelope() "
                "or parsed by from_dict()/from_json()"
            )
        super().__init__(**data)

    def __setattr__(self, name: str, value: Any) -> None:
        raise FederatedMetricError("FederatedMetricEnvelope: immutable; build a new envelope")

    def __delattr__(self, name: str) -> None:
        raise FederatedMetricError("FederatedMetricEnvelope: immutable; build a new envelope")

    @classmethod
    def _create(cls, canonical: dict[str, Any]) -> FederatedMetricEnvelope:
        token = _BUILDING.set(_TOKEN)
        try:
            return cls(**canonical)
        finally:
            _BUILDING.reset(token)

    # --- closed against the generic pydantic entry points -------------------------
    @classmethod
    def model_construct(cls, *args: Any, **kwargs: Any) -> FederatedMetricEnvelope:  # type: ignore[override]
        raise FederatedMetricError("FederatedMetricEnvelope: model_construct is not allowed")

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> FederatedMetricEnvelope:  # type: ignore[override]
        return cls.from_dict(obj)

    @classmethod
    def model_validate_json(cls, json_data: Any, *args: Any, **kwargs: Any) -> FederatedMetricEnvelope:  # type: ignore[override]
        return cls.from_json(json_data)

    @classmethod
    def model_validate_strings(cls, obj: Any, *args: Any, **kwargs: Any) -> FederatedMetricEnvelope:  # type: ignore[override]
        raise FederatedMetricError("FederatedMetricEnvelope: use from_dict() or from_json()")

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> FederatedMetricEnvelope:  # type: ignore[override]
        if update:
            raise FederatedMetricError("FederatedMetricEnvelope: immutable; build a new envelope")
        return self

    # --- serialisation ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Exactly the documented fields; enums as their string values; canonical numbers."""
        out: dict[str, Any] = {}
        for name in _FIELDS:
            value = getattr(self, name)
            out[name] = value.value if isinstance(value, StrEnum) else value
        return out

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, ``indent=2``, ASCII, trailing newline. Equal
        envelopes give identical bytes; a non-finite number can never be written."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=2, ensure_ascii=True,
                          allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, payload: Mapping[str, Any], *, policy: PrivacyPolicy | None = None) -> FederatedMetricEnvelope:
        """Parse exactly the documented fields, applying every rule.

        Raises:
            FederatedMetricError: not a mapping, missing or unknown keys, unknown enum
                values or versions, non-finite numbers, booleans for numbers, invalid
                combinations, or a minimum group size below the policy floor.
        """
        if not isinstance(payload, Mapping):
            raise FederatedMetricError("envelope: must be a JSON object / mapping")
        keys = set(payload)
        if any(type(k) is not str for k in keys):
            raise FederatedMetricError("envelope: keys must be strings")
        if keys - set(_FIELDS):
            raise FederatedMetricError("envelope: unknown fields are not allowed")
        if set(_FIELDS) - keys:
            raise FederatedMetricError("envelope: every documented field is required")
        return cls._create(_normalise(payload, policy or default_policy()))

    @classmethod
    def from_json(cls, text: str | bytes, *, policy: PrivacyPolicy | None = None) -> FederatedMetricEnvelope:
        """Strict JSON parse, then :meth:`from_dict`.

        Refuses documents above :data:`MAX_JSON_BYTES`, duplicate keys, ``NaN`` /
        ``Infinity`` tokens, number literals that overflow to infinity and integers of
        magnitude above :data:`MAX_JSON_INTEGER`.
        """
        if isinstance(text, bytes | bytearray):
            if len(text) > MAX_JSON_BYTES:
                raise FederatedMetricError("envelope JSON: document too large")
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError:
                raise FederatedMetricError("envelope JSON: not UTF-8") from None
        if not isinstance(text, str):
            raise FederatedMetricError("envelope JSON: must be str or bytes")
        if len(text.encode("utf-8", "surrogatepass")) > MAX_JSON_BYTES:
            raise FederatedMetricError("envelope JSON: document too large")
        try:
            payload = json.loads(
                text,
                object_pairs_hook=_no_duplicate_keys,
                parse_constant=_no_constants,
                parse_int=_bounded_int,
                parse_float=_finite_float,
            )
        except FederatedMetricError:
            raise
        except (ValueError, RecursionError):
            raise FederatedMetricError("envelope JSON: malformed document") from None
        if type(payload) is not dict:
            raise FederatedMetricError("envelope: must be a JSON object / mapping")
        if any(isinstance(v, dict | list) for v in payload.values()):
            raise FederatedMetricError("envelope: field values must be scalars")
        return cls.from_dict(payload, policy=policy)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise FederatedMetricError("envelope JSON: duplicate keys are not allowed")
        out[key] = value
    return out


def _no_constants(token: str) -> Any:
    raise FederatedMetricError("envelope JSON: NaN and Infinity are not allowed")


def _bounded_int(token: str) -> int:
    digits = token.lstrip("-")
    if len(digits) > len(str(MAX_JSON_INTEGER)) or abs(int(token)) > MAX_JSON_INTEGER:
        raise FederatedMetricError("envelope JSON: integer beyond the documented size (2**53 - 1)")
    return int(token)


def _finite_float(token: str) -> float:
    if len(token) > 64:
        raise FederatedMetricError("envelope JSON: number literal too long")
    value = float(token)
    if not math.isfinite(value):
        raise FederatedMetricError("envelope JSON: numbers must be finite")
    return value


# ------------------------------------------------------------------ the builder


def build_federated_metric_envelope(
    *,
    metric_id: str,
    metric_kind: FederatedMetricKind | str,
    aggregate_value: int | float,
    clipping_lower_bound: int | float,
    clipping_upper_bound: int | float,
    privacy_mechanism: FederatedPrivacyMechanism | str,
    privacy_mechanism_version: str,
    participant_count: int,
    minimum_group_size: int | None = None,
    uncertainty_method: FederatedUncertaintyMethod | str = FederatedUncertaintyMethod.NONE,
    uncertainty_lower_bound: int | float | None = None,
    uncertainty_upper_bound: int | float | None = None,
    confidence_level: float | None = None,
    policy: PrivacyPolicy | None = None,
) -> FederatedMetricEnvelope:
    """Build the envelope of one released aggregate (keywords as in OpenMed).

    Args:
        metric_id: ``[a-z][a-z0-9_.-]{0,63}`` (a metric name; never a site or client).
        metric_kind: ``count`` / ``rate`` / ``bounded_mean``.
        aggregate_value: the released (already noised) aggregate, inside the clipping
            bounds (clamp a noisy value first: clamping is post-processing).
        clipping_lower_bound, clipping_upper_bound: the metric's clip bounds.
        privacy_mechanism, privacy_mechanism_version: what was applied upstream and the
            policy's version of it (e.g. ``"v1"``).
        participant_count: exact number of contributors; used for the band, never stored.
        minimum_group_size: ``None`` takes the policy floor; a larger value is allowed,
            a smaller one raises.
        uncertainty_method, uncertainty_lower_bound, uncertainty_upper_bound,
        confidence_level: ``confidence_interval`` with the error bar as the interval, or
            ``none``.
        policy: the privacy policy (default: the shipped one).

    Returns:
        :class:`FederatedMetricEnvelope`; suppressed (value and uncertainty null, band
        ``suppressed``) when ``participant_count < minimum_group_size``.

    Raises:
        FederatedMetricError: any rule of the module docstring; the full release is
            validated before suppression, so acceptance never depends on the count.
    """
    policy = policy or default_policy()
    m = _minimum_group_size(minimum_group_size, policy)
    band = participant_count_band(participant_count, m)
    release = {
        "schema_version": FEDERATED_METRIC_SCHEMA_VERSION,
        "metric_id": metric_id,
        "metric_kind": metric_kind,
        "aggregate_value": aggregate_value,
        "clipping_lower_bound": clipping_lower_bound,
        "clipping_upper_bound": clipping_upper_bound,
        "privacy_mechanism": privacy_mechanism,
        "privacy_mechanism_version": privacy_mechanism_version,
        "minimum_group_size": m,
        "participant_count_band": (
            FederatedParticipantCountBand.MINIMUM_TO_UNDER_DOUBLE
            if band is FederatedParticipantCountBand.SUPPRESSED else band
        ),
        "uncertainty_method": uncertainty_method,
        "uncertainty_lower_bound": uncertainty_lower_bound,
        "uncertainty_upper_bound": uncertainty_upper_bound,
        "confidence_level": confidence_level,
    }
    canonical = _normalise(release, policy)
    if band is FederatedParticipantCountBand.SUPPRESSED:
        canonical.update(
            aggregate_value=None,
            participant_count_band=FederatedParticipantCountBand.SUPPRESSED,
            uncertainty_method=FederatedUncertaintyMethod.SUPPRESSED,
            **dict.fromkeys(_INTERVAL_FIELDS),
        )
        canonical = _normalise(canonical, policy)
    return FederatedMetricEnvelope._create(canonical)
