"""Conformance table for the federated metric envelope (builder, from_dict, from_json)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from clma.budget.policy import default_policy, load_policy
from clma.release import (
    FEDERATED_METRIC_SCHEMA_VERSION,
    MAX_JSON_INTEGER,
    FederatedMetricEnvelope,
    FederatedMetricError,
    FederatedMetricKind,
    FederatedParticipantCountBand,
    FederatedPrivacyMechanism,
    FederatedUncertaintyMethod,
    build_federated_metric_envelope,
)

BASE: dict[str, dict[str, Any]] = {
    "count": dict(
        metric_id="documents_processed", metric_kind="count", aggregate_value=18,
        clipping_lower_bound=0, clipping_upper_bound=100, privacy_mechanism="threshold_only",
        privacy_mechanism_version="v1", participant_count=12,
    ),
    "rate": dict(
        metric_id="safe_completion_rate", metric_kind=FederatedMetricKind.RATE,
        aggregate_value=0.82, clipping_lower_bound=0.0, clipping_upper_bound=1.0,
        privacy_mechanism=FederatedPrivacyMechanism.LAPLACE, privacy_mechanism_version="v1",
        participant_count=25, minimum_group_size=5,
        uncertainty_method=FederatedUncertaintyMethod.CONFIDENCE_INTERVAL,
        uncertainty_lower_bound=0.75, uncertainty_upper_bound=0.88, confidence_level=0.95,
    ),
    "mean": dict(
        metric_id="mean_loss", metric_kind="bounded_mean", aggregate_value=1.25,
        clipping_lower_bound=0.0, clipping_upper_bound=5.0, privacy_mechanism="gaussian",
        privacy_mechanism_version="v1", participant_count=40,
    ),
}
SUP = "suppressed"
MIN, DBL, FOUR = "minimum_to_under_double", "double_to_under_fourfold", "fourfold_or_more"
CI = "confidence_interval"
DELETE = object()


def band(n, m=None):
    kw = {"participant_count": n}
    if m is not None:
        kw["minimum_group_size"] = m
    return kw


# (id, via, base, overrides, expected): expected is a dict of to_dict() fields that must
# hold, or an error fragment (str) that the FederatedMetricError message must contain.
CASES: list[tuple[str, str, str, dict[str, Any], dict[str, Any] | str]] = [
    # --- bands at every boundary, default minimum 5 --------------------------------------
    ("band-0-suppressed", "build", "mean", band(0), {"participant_count_band": SUP, "aggregate_value": None}),
    ("band-4-just-below-min", "build", "mean", band(4), {"participant_count_band": SUP, "uncertainty_method": SUP}),
    ("band-5-at-min", "build", "mean", band(5), {"participant_count_band": MIN, "aggregate_value": 1.25}),
    ("band-9-under-double", "build", "mean", band(9), {"participant_count_band": MIN}),
    ("band-10-at-double", "build", "mean", band(10), {"participant_count_band": DBL}),
    ("band-19-under-fourfold", "build", "mean", band(19), {"participant_count_band": DBL}),
    ("band-20-at-fourfold", "build", "mean", band(20), {"participant_count_band": FOUR}),
    ("band-huge", "build", "mean", band(10**15), {"participant_count_band": FOUR}),
    # --- a larger minimum asked by the caller ---------------------------------------------
    ("band-m8-7-suppressed", "build", "mean", band(7, 8), {"participant_count_band": SUP, "minimum_group_size": 8}),
    ("band-m8-8", "build", "mean", band(8, 8), {"participant_count_band": MIN}),
    ("band-m8-15", "build", "mean", band(15, 8), {"participant_count_band": MIN}),
    ("band-m8-16", "build", "mean", band(16, 8), {"participant_count_band": DBL}),
    ("band-m8-31", "build", "mean", band(31, 8), {"participant_count_band": DBL}),
    ("band-m8-32", "build", "mean", band(32, 8), {"participant_count_band": FOUR}),
    ("suppressed-rate-drops-interval", "build", "rate", band(3),
     {"participant_count_band": SUP, "uncertainty_method": SUP, "uncertainty_lower_bound": None,
      "uncertainty_upper_bound": None, "confidence_level": None, "aggregate_value": None}),
    ("min-below-policy-floor", "build", "mean", band(40, 4), "minimum_group_size: must not be below"),
    ("min-2-below-floor", "build", "mean", band(40, 2), "minimum_group_size"),
    ("min-bool", "build", "mean", band(40, True), "minimum_group_size: must be an integer"),
    ("min-float", "build", "mean", band(40, 6.0), "minimum_group_size: must be an integer"),
    # --- participant counts -----------------------------------------------------------------
    ("count-negative", "build", "mean", {"participant_count": -12345}, "participant_count"),
    ("count-non-integer", "build", "mean", {"participant_count": 12.5}, "participant_count: must be an integer"),
    ("count-integral-float", "build", "mean", {"participant_count": 12.0}, "participant_count: must be an integer"),
    ("count-bool", "build", "mean", {"participant_count": True}, "participant_count: must be an integer"),
    ("count-text", "build", "mean", {"participant_count": "12345"}, "participant_count: must be an integer"),
    ("count-numpy-int", "build", "mean", {"participant_count": np.int64(12)}, {"participant_count_band": DBL}),
    # --- kind: count --------------------------------------------------------------------------
    ("count-valid", "build", "count", {}, {"aggregate_value": 18, "clipping_upper_bound": 100}),
    ("count-at-lower", "build", "count", {"aggregate_value": 0}, {"aggregate_value": 0}),
    ("count-at-upper", "build", "count", {"aggregate_value": 100}, {"aggregate_value": 100}),
    ("count-numpy-value", "build", "count", {"aggregate_value": np.int32(7)}, {"aggregate_value": 7}),
    ("count-float-value", "build", "count", {"aggregate_value": 18.5}, "aggregate_value: must be an integer"),
    ("count-integral-float-value", "build", "count", {"aggregate_value": 18.0}, "aggregate_value: must be an integer"),
    ("count-negative-lower", "build", "count", {"clipping_lower_bound": -1}, "clipping_lower_bound: must be an integer in [0,"),
    ("count-float-bound", "build", "count", {"clipping_upper_bound": 100.0}, "clipping_upper_bound: must be an integer"),
    ("count-above-upper", "build", "count", {"aggregate_value": 1017}, "aggregate_value: must lie inside the clipping bounds"),
    ("count-bound-too-large", "build", "count", {"clipping_upper_bound": MAX_JSON_INTEGER + 1}, "clipping_upper_bound"),
    ("count-with-interval", "build", "count",
     {"uncertainty_method": CI, "uncertainty_lower_bound": 15, "uncertainty_upper_bound": 21.5, "confidence_level": 0.9},
     {"uncertainty_lower_bound": 15.0, "uncertainty_upper_bound": 21.5}),
    # --- kind: rate ---------------------------------------------------------------------------
    ("rate-valid", "build", "rate", {}, {"aggregate_value": 0.82, "confidence_level": 0.95}),
    ("rate-value-0", "build", "rate", {"aggregate_value": 0, "uncertainty_lower_bound": 0}, {"aggregate_value": 0.0}),
    ("rate-value-1", "build", "rate", {"aggregate_value": 1, "uncertainty_upper_bound": 1}, {"aggregate_value": 1.0}),
    ("rate-upper-above-1", "build", "rate", {"clipping_upper_bound": 1.5}, "a rate's bounds must lie in [0, 1]"),
    ("rate-lower-below-0", "build", "rate", {"clipping_lower_bound": -0.25}, "a rate's bounds must lie in [0, 1]"),
    ("rate-value-above-1", "build", "rate", {"aggregate_value": 1.2345}, "aggregate_value: must lie inside"),
    # --- kind: bounded_mean -------------------------------------------------------------------
    ("mean-negative-range", "build", "mean",
     {"clipping_lower_bound": -3, "clipping_upper_bound": 3, "aggregate_value": -2.5},
     {"clipping_lower_bound": -3.0, "aggregate_value": -2.5}),
    ("mean-above-upper", "build", "mean", {"aggregate_value": 5.0001}, "aggregate_value: must lie inside"),
    ("mean-below-lower", "build", "mean", {"aggregate_value": -0.0001}, "aggregate_value: must lie inside"),
    ("bounds-equal", "build", "mean", {"clipping_lower_bound": 5.0}, "clipping bounds: must be increasing"),
    ("bounds-reversed", "build", "mean", {"clipping_lower_bound": 7.25, "clipping_upper_bound": 2.5}, "must be increasing"),
    ("bound-inf", "build", "mean", {"clipping_upper_bound": float("inf")}, "clipping_upper_bound: must be a finite number"),
    ("bound-nan", "build", "mean", {"clipping_lower_bound": float("nan")}, "clipping_lower_bound: must be a finite number"),
    ("bound-huge-int", "build", "mean", {"clipping_upper_bound": 10**400}, "clipping_upper_bound: must be a finite number"),
    ("value-nan", "build", "mean", {"aggregate_value": float("nan")}, "aggregate_value: must be a finite number"),
    ("value-inf", "build", "mean", {"aggregate_value": float("-inf")}, "aggregate_value: must be a finite number"),
    ("value-bool", "build", "mean", {"aggregate_value": True}, "aggregate_value: must be a finite number (not a boolean"),
    ("value-numpy-bool", "build", "mean", {"aggregate_value": np.bool_(True)}, "not a boolean"),
    ("value-text", "build", "mean", {"aggregate_value": "1.2345"}, "aggregate_value: must be a finite number"),
    ("bound-bool", "build", "mean", {"clipping_lower_bound": False}, "clipping_lower_bound: must be a finite number"),
    ("metric-id-site-name", "build", "mean", {"metric_id": "Boston_General"}, "metric_id: must match"),
    ("metric-id-empty", "build", "mean", {"metric_id": ""}, "metric_id"),
    ("metric-id-too-long", "build", "mean", {"metric_id": "m" * 65}, "metric_id"),
    # --- mechanisms -----------------------------------------------------------------------------
    ("mech-threshold-only", "build", "mean", {"privacy_mechanism": "threshold_only"}, {"privacy_mechanism": "threshold_only"}),
    ("mech-laplace", "build", "mean", {"privacy_mechanism": "laplace"}, {"privacy_mechanism": "laplace", "privacy_mechanism_version": "v1"}),
    ("mech-gaussian", "build", "mean", {"privacy_mechanism": FederatedPrivacyMechanism.GAUSSIAN}, {"privacy_mechanism": "gaussian"}),
    ("mech-unknown", "build", "mean", {"privacy_mechanism": "randomized_response"}, "privacy_mechanism: must be one of"),
    ("mech-enum-name", "build", "mean", {"privacy_mechanism": "GAUSSIAN"}, "privacy_mechanism: must be one of"),
    ("mech-version-unknown", "build", "mean", {"privacy_mechanism_version": "v2"}, "privacy_mechanism_version"),
    ("mech-version-case", "build", "mean", {"privacy_mechanism_version": "V1"}, "privacy_mechanism_version"),
    ("mech-version-int", "build", "mean", {"privacy_mechanism_version": 1}, "privacy_mechanism_version"),
    ("kind-unknown", "build", "mean", {"metric_kind": "histogram"}, "metric_kind: must be one of"),
    # --- uncertainty ------------------------------------------------------------------------------
    ("ci-valid-level-half", "build", "rate", {"confidence_level": 0.5}, {"confidence_level": 0.5}),
    ("ci-degenerate", "build", "rate", {"uncertainty_lower_bound": 0.82, "uncertainty_upper_bound": 0.82},
     {"uncertainty_lower_bound": 0.82}),
    ("ci-at-clip-range", "build", "rate", {"uncertainty_lower_bound": 0, "uncertainty_upper_bound": 1},
     {"uncertainty_upper_bound": 1.0}),
    ("ci-excludes-value-low", "build", "rate", {"uncertainty_lower_bound": 0.8345}, "must contain the aggregate value"),
    ("ci-excludes-value-high", "build", "rate", {"uncertainty_upper_bound": 0.8123}, "must contain the aggregate value"),
    ("ci-below-clip", "build", "rate", {"uncertainty_lower_bound": -0.0625}, "must lie inside the clipping bounds"),
    ("ci-above-clip", "build", "rate", {"uncertainty_upper_bound": 1.0625}, "must lie inside the clipping bounds"),
    ("ci-nan", "build", "rate", {"uncertainty_upper_bound": float("nan")}, "uncertainty_upper_bound: must be a finite number"),
    ("ci-inf", "build", "rate", {"uncertainty_lower_bound": float("-inf")}, "uncertainty_lower_bound: must be a finite number"),
    ("level-0", "build", "rate", {"confidence_level": 0}, "confidence_level: must be strictly between 0 and 1"),
    ("level-1", "build", "rate", {"confidence_level": 1.0}, "confidence_level: must be strictly between 0 and 1"),
    ("level-above-1", "build", "rate", {"confidence_level": 95.125}, "confidence_level"),
    ("level-bool", "build", "rate", {"confidence_level": True}, "confidence_level: must be a finite number"),
    ("level-missing", "build", "rate", {"confidence_level": None}, "confidence_level: required"),
    ("ci-bound-missing", "build", "rate", {"uncertainty_upper_bound": None}, "uncertainty_upper_bound: required"),
    ("none-with-interval", "build", "rate", {"uncertainty_method": "none"}, "interval fields require"),
    ("none-without-interval", "build", "rate",
     {"uncertainty_method": "none", "uncertainty_lower_bound": None, "uncertainty_upper_bound": None,
      "confidence_level": None}, {"uncertainty_method": "none", "confidence_level": None}),
    ("suppressed-method-on-release", "build", "mean", {"uncertainty_method": "suppressed"}, "only for a suppressed metric"),
    ("uncertainty-method-unknown", "build", "mean", {"uncertainty_method": "bootstrap"}, "uncertainty_method: must be one of"),
    ("invalid-even-when-suppressed", "build", "rate", {"participant_count": 2, "uncertainty_upper_bound": 1.0625},
     "must lie inside the clipping bounds"),
    # --- from_dict: hostile mappings -----------------------------------------------------------
    ("dict-unknown-key", "dict", "rate", {"site_name": "boston_general"}, "unknown fields"),
    ("dict-participant-count-key", "dict", "rate", {"participant_count": 12345}, "unknown fields"),
    ("dict-missing-key", "dict", "rate", {"confidence_level": DELETE}, "every documented field is required"),
    ("dict-schema-version", "dict", "rate", {"schema_version": "openmed.training.federated_metric.v2"}, "unsupported schema version"),
    ("dict-kind-enum-name", "dict", "rate", {"metric_kind": "RATE"}, "metric_kind: must be one of"),
    ("dict-band-exact", "dict", "rate", {"participant_count_band": "exactly_12345"}, "participant_count_band: must be one of"),
    ("dict-suppressed-with-value", "dict", "rate",
     {"participant_count_band": "suppressed", "uncertainty_method": "suppressed", "uncertainty_lower_bound": None,
      "uncertainty_upper_bound": None, "confidence_level": None}, "a suppressed metric carries no value"),
    ("dict-suppressed-method-none", "dict", "rate",
     {"participant_count_band": "suppressed", "aggregate_value": None, "uncertainty_method": "none",
      "uncertainty_lower_bound": None, "uncertainty_upper_bound": None, "confidence_level": None},
     "a suppressed metric must be 'suppressed'"),
    ("dict-released-without-value", "dict", "rate", {"aggregate_value": None}, "a released metric needs a value"),
    ("dict-min-below-floor", "dict", "rate", {"minimum_group_size": 3}, "below the privacy policy's floor"),
    ("dict-value-bool", "dict", "rate", {"aggregate_value": False}, "not a boolean"),
    ("dict-value-nan", "dict", "rate", {"aggregate_value": float("nan")}, "must be a finite number"),
    ("dict-level-1", "dict", "rate", {"confidence_level": 1}, "strictly between 0 and 1"),
    ("dict-interval-outside-clip", "dict", "rate", {"uncertainty_upper_bound": 1.0625}, "inside the clipping bounds"),
    ("dict-version-unknown", "dict", "rate", {"privacy_mechanism_version": "v9"}, "privacy_mechanism_version"),
    ("dict-schema-int", "dict", "rate", {"schema_version": 1}, "unsupported schema version"),
    # --- from_json: hostile documents ------------------------------------------------------------
    ("json-duplicate-key-smuggle", "json", "rate", {"text": lambda t: t.replace(
        '"metric_id": "safe_completion_rate",',
        '"metric_id": "safe_completion_rate",\n  "metric_id": "boston_general_icu",')}, "duplicate keys"),
    ("json-nan-token", "json", "rate", {"text": lambda t: t.replace("0.82,", "NaN,", 1)}, "NaN and Infinity"),
    ("json-infinity-token", "json", "rate", {"text": lambda t: t.replace("0.88", "Infinity")}, "NaN and Infinity"),
    ("json-neg-infinity-token", "json", "rate", {"text": lambda t: t.replace("0.75", "-Infinity")}, "NaN and Infinity"),
    ("json-overflowing-literal", "json", "rate", {"text": lambda t: t.replace("0.88", "1e999")}, "numbers must be finite"),
    ("json-integer-too-large", "json", "count", {"text": lambda t: t.replace('"clipping_upper_bound": 100', '"clipping_upper_bound": 9007199254740992')},
     "integer beyond the documented size"),
    ("json-integer-very-long", "json", "count", {"text": lambda t: t.replace('"clipping_upper_bound": 100', '"clipping_upper_bound": ' + "9" * 5000)},
     "integer beyond the documented size"),
    ("json-trailing-garbage", "json", "rate", {"text": lambda t: t + "}"}, "malformed"),
    ("json-not-object", "json", "rate", {"text": lambda t: "[" + t + "]"}, "must be a JSON object"),
    ("json-nested-value", "json", "rate", {"text": lambda t: t.replace('"v1"', '{"version": "v1"}')}, "must be scalars"),
    ("json-too-large", "json", "rate", {"text": lambda t: t[:-2] + " " * 70_000 + "}\n"}, "too large"),
    ("json-bytes-valid", "json", "rate", {"text": lambda t: t.encode("utf-8")}, {"aggregate_value": 0.82}),
    ("json-compact-openmed-style", "json", "count", {"text": lambda t: json.dumps(json.loads(t))}, {"aggregate_value": 18}),
    ("json-int-for-mean-is-canonicalised", "json", "mean", {"text": lambda t: t.replace("1.25", "1")},
     {"aggregate_value": 1.0}),
]


def _secrets(overrides: dict[str, Any]) -> list[str]:
    """Reprs of overridden values distinctive enough to detect an echo in a message."""
    out = []
    for v in overrides.values():
        if isinstance(v, bool) or v is None or callable(v) or v is DELETE:
            continue
        r = repr(v) if not isinstance(v, str) else v
        if len(r) >= 4 and r not in {"none", "suppressed", "laplace", "gaussian"}:
            out.append(r)
    return out


def _run(via: str, base: str, overrides: dict[str, Any]) -> FederatedMetricEnvelope:
    if via == "build":
        return build_federated_metric_envelope(**{**BASE[base], **overrides})
    env = build_federated_metric_envelope(**BASE[base])
    if via == "dict":
        payload = env.to_dict()
        for k, v in overrides.items():
            if v is DELETE:
                del payload[k]
            else:
                payload[k] = v
        return FederatedMetricEnvelope.from_dict(payload)
    return FederatedMetricEnvelope.from_json(overrides["text"](env.to_json()))


@pytest.mark.parametrize(("case_id", "via", "base", "overrides", "expected"), CASES,
                         ids=[c[0] for c in CASES])
def test_conformance(case_id, via, base, overrides, expected):
    if isinstance(expected, str):
        with pytest.raises(FederatedMetricError) as info:
            _run(via, base, overrides)
        msg = str(info.value)
        assert expected in msg
        for secret in _secrets(overrides):
            assert secret not in msg, "error message echoes a value"
        return
    env = _run(via, base, overrides)
    data = env.to_dict()
    for key, value in expected.items():
        assert data[key] == value and type(data[key]) is type(value), key
    # the documented field set, nothing else, never the participant count
    assert set(data) == set(FederatedMetricEnvelope.FIELDS) and len(data) == 14
    assert "participant_count" not in data
    # round trips: equality and byte-identical JSON
    assert FederatedMetricEnvelope.from_dict(env.to_dict()) == env
    text = env.to_json()
    again = FederatedMetricEnvelope.from_json(text)
    assert again == env and again.to_json() == text
    assert text.endswith("}\n") and json.loads(text) == data
    assert list(json.loads(text)) == sorted(data)


def test_table_has_at_least_60_cases_of_each_outcome():
    assert len(CASES) >= 60
    assert sum(isinstance(c[4], str) for c in CASES) >= 30
    assert sum(isinstance(c[4], dict) for c in CASES) >= 25
    assert len({c[0] for c in CASES}) == len(CASES)


def test_json_int_for_mean_is_canonical_float():
    env = build_federated_metric_envelope(**{**BASE["mean"], "aggregate_value": 1})
    text = env.to_json()
    assert '"aggregate_value": 1.0,' in text
    parsed = FederatedMetricEnvelope.from_json(text.replace('"aggregate_value": 1.0', '"aggregate_value": 1'))
    assert parsed.to_json() == text


def test_openmed_usage_example_and_layout():
    env = build_federated_metric_envelope(**BASE["rate"])
    assert env.metric_kind is FederatedMetricKind.RATE
    assert env.participant_count_band is FederatedParticipantCountBand.FOURFOLD_OR_MORE
    assert env.uncertainty_method is FederatedUncertaintyMethod.CONFIDENCE_INTERVAL
    assert env.schema_version == FEDERATED_METRIC_SCHEMA_VERSION == "openmed.training.federated_metric.v1"
    # OpenMed's to_json layout: json.dumps(to_dict(), indent=2, sort_keys=True) + "\n"
    assert env.to_json() == json.dumps(env.to_dict(), indent=2, sort_keys=True) + "\n"
    assert env.from_dict(env.to_dict()) == env


def test_direct_construction_and_mutation_are_refused():
    env = build_federated_metric_envelope(**BASE["mean"])
    fields = env.to_dict()
    with pytest.raises(FederatedMetricError, match="built only by"):
        FederatedMetricEnvelope(**fields)
    with pytest.raises(FederatedMetricError):
        FederatedMetricEnvelope.model_construct(**fields)
    with pytest.raises(FederatedMetricError, match="immutable"):
        env.model_copy(update={"aggregate_value": 4.5})
    with pytest.raises(FederatedMetricError, match="immutable"):
        env.aggregate_value = 4.5  # type: ignore[misc]
    # the generic pydantic parsers apply every rule
    with pytest.raises(FederatedMetricError, match="unknown fields"):
        FederatedMetricEnvelope.model_validate({**fields, "site": "x"})
    assert FederatedMetricEnvelope.model_validate_json(env.to_json()) == env


def test_to_json_never_writes_non_finite_and_is_stable():
    env = build_federated_metric_envelope(**BASE["rate"])
    assert "NaN" not in env.to_json() and "Infinity" not in env.to_json()
    assert env.to_json() == build_federated_metric_envelope(**BASE["rate"]).to_json()


def test_minimum_group_size_floor_comes_from_policy(tmp_path):
    text = (tmp_path / "p.toml")
    from importlib import resources

    src = resources.files("clma").joinpath("policy", "privacy_policy_v1.toml").read_text()
    text.write_text(src.replace("minimum_group_size = 5", "minimum_group_size = 10"))
    strict = load_policy(text)
    env = build_federated_metric_envelope(**{**BASE["mean"], "participant_count": 9}, policy=strict)
    assert env.participant_count_band is FederatedParticipantCountBand.SUPPRESSED
    assert env.minimum_group_size == 10
    with pytest.raises(FederatedMetricError, match="floor"):
        build_federated_metric_envelope(**{**BASE["mean"], "minimum_group_size": 5}, policy=strict)
    # an envelope valid under the default floor (5) is refused under the stricter policy
    loose = build_federated_metric_envelope(**BASE["mean"], policy=default_policy())
    with pytest.raises(FederatedMetricError, match="floor"):
        FederatedMetricEnvelope.from_dict(loose.to_dict(), policy=strict)
