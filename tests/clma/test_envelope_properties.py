"""Property tests (hypothesis): the participant count never reaches an envelope, and the
canonical JSON does not depend on the Python types of equal inputs."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from clma.release import (
    FederatedMetricEnvelope,
    FederatedMetricError,
    FederatedParticipantCountBand,
    build_federated_metric_envelope,
    participant_count_band,
)

SETTINGS = settings(max_examples=150, deadline=None)
finite = dict(allow_nan=False, allow_infinity=False)


@st.composite
def releases(draw) -> dict[str, Any]:
    """Valid builder keywords, without participant_count / minimum_group_size."""
    kind = draw(st.sampled_from(["count", "rate", "bounded_mean"]))
    if kind == "count":
        lo = draw(st.integers(0, 1000))
        hi = lo + draw(st.integers(1, 10**6))
        value: float | int = draw(st.integers(lo, hi))
    else:
        if kind == "rate":
            a, b = draw(st.floats(0.0, 1.0, **finite)), draw(st.floats(0.0, 1.0, **finite))
        else:
            a = draw(st.floats(-1e6, 1e6, **finite))
            b = draw(st.floats(-1e6, 1e6, **finite))
        lo, hi = min(a, b), max(a, b)
        assume(lo < hi)
        value = draw(st.floats(lo, hi, **finite))
    kw: dict[str, Any] = dict(
        metric_id=draw(st.from_regex(r"[a-z][a-z0-9_.-]{0,20}", fullmatch=True)),
        metric_kind=kind, aggregate_value=value,
        clipping_lower_bound=lo, clipping_upper_bound=hi,
        privacy_mechanism=draw(st.sampled_from(["threshold_only", "laplace", "gaussian"])),
        privacy_mechanism_version="v1",
    )
    if draw(st.booleans()):
        kw.update(
            uncertainty_method="confidence_interval",
            uncertainty_lower_bound=draw(st.floats(float(lo), float(value), **finite)),
            uncertainty_upper_bound=draw(st.floats(float(value), float(hi), **finite)),
            confidence_level=draw(st.floats(0.0, 1.0, exclude_min=True, exclude_max=True, **finite)),
        )
    return kw


def _numbers(obj: Any) -> list[float]:
    return [v for v in obj.values() if isinstance(v, int | float) and not isinstance(v, bool)]


@SETTINGS
@given(kw=releases(), m=st.integers(5, 1000), n1=st.integers(0, 10**9), n2=st.integers(0, 10**9))
def test_no_field_but_the_band_depends_on_the_participant_count(kw, m, n1, n2):
    e1 = build_federated_metric_envelope(**kw, participant_count=n1, minimum_group_size=m)
    e2 = build_federated_metric_envelope(**kw, participant_count=n2, minimum_group_size=m)
    d1, d2 = e1.to_dict(), e2.to_dict()
    assert set(d1) == set(FederatedMetricEnvelope.FIELDS) and "participant_count" not in d1
    b1, b2 = participant_count_band(n1, m), participant_count_band(n2, m)
    assert d1["participant_count_band"] == b1.value
    if b1 is b2:
        # same band -> byte-identical envelopes: nothing else is derived from the count
        assert e1.to_json() == e2.to_json()
    else:
        diff = {k for k in d1 if d1[k] != d2[k]}
        allowed = {"participant_count_band"}
        if FederatedParticipantCountBand.SUPPRESSED in (b1, b2):
            allowed |= {"aggregate_value", "uncertainty_method", "uncertainty_lower_bound",
                        "uncertainty_upper_bound", "confidence_level"}
        assert diff <= allowed and "participant_count_band" in diff


@SETTINGS
@given(kw=releases(), m=st.integers(5, 50), n=st.integers(10**6 + 1, 10**12))
def test_the_exact_count_never_appears_in_dict_or_json(kw, m, n):
    # the count is chosen so that it cannot coincide with another input by accident
    inputs = [kw["aggregate_value"], kw["clipping_lower_bound"], kw["clipping_upper_bound"],
              kw.get("uncertainty_lower_bound"), kw.get("uncertainty_upper_bound")]
    assume(all(v is None or v != n for v in inputs))
    env = build_federated_metric_envelope(**kw, participant_count=n, minimum_group_size=m)
    data = env.to_dict()
    assert all(v != n for v in _numbers(data))
    parsed = json.loads(env.to_json())
    assert all(v != n for v in _numbers(parsed))
    assert all(str(n) not in v for v in parsed.values() if isinstance(v, str))
    assert "participant_count" not in env.to_json().replace("participant_count_band", "")


@SETTINGS
@given(kw=releases(), n=st.integers(0, 400))
def test_round_trip_is_exact(kw, n):
    env = build_federated_metric_envelope(**kw, participant_count=n)
    text = env.to_json()
    assert FederatedMetricEnvelope.from_json(text) == env
    assert FederatedMetricEnvelope.from_json(text).to_json() == text
    assert FederatedMetricEnvelope.from_dict(env.to_dict()) == env
    assert FederatedMetricEnvelope.from_json(text.encode()).to_json() == text


def _variants(x: float | int) -> list[Any]:
    """Equal numbers in different Python / numpy types (and signs of zero)."""
    out: list[Any] = [float(x), np.float64(x)]
    if float(x).is_integer() and abs(x) < 2**53:
        out += [int(x), np.int64(int(x))]
    if x == 0:
        out += [-0.0, np.float64(-0.0)]
    return out


@SETTINGS
@given(kw=releases(), n=st.integers(0, 400), data=st.data())
def test_to_json_is_stable_under_numeric_type_variations(kw, n, data):
    assume(kw["metric_kind"] != "count")
    reference = build_federated_metric_envelope(**kw, participant_count=n).to_json()
    varied = dict(kw)
    for key in ("aggregate_value", "clipping_lower_bound", "clipping_upper_bound",
                "uncertainty_lower_bound", "uncertainty_upper_bound"):
        if varied.get(key) is not None:
            varied[key] = data.draw(st.sampled_from(_variants(varied[key])))
    assert build_federated_metric_envelope(**varied, participant_count=n).to_json() == reference


@pytest.mark.parametrize("value", [0, 1, 3])
def test_zero_and_integral_floats_give_identical_bytes(value):
    base = dict(metric_id="mean_loss", metric_kind="bounded_mean", clipping_lower_bound=-5,
                clipping_upper_bound=5, privacy_mechanism="laplace",
                privacy_mechanism_version="v1", participant_count=30)
    outs = {build_federated_metric_envelope(**base, aggregate_value=v).to_json()
            for v in _variants(value)}
    assert len(outs) == 1
    assert f'"aggregate_value": {float(value)},' in outs.pop()


@SETTINGS
@given(lo=st.floats(-1e3, 0, **finite), width=st.floats(1.0, 1e3, **finite),
       excess=st.floats(1.000001, 1e6, **finite), n=st.integers(10**5 + 7, 10**9))
def test_errors_never_echo_values_or_the_count(lo, width, excess, n):
    value = lo + width + excess  # outside the clip range
    hi = lo + width
    assume(value > hi and math.isfinite(value))
    with pytest.raises(FederatedMetricError) as info:
        build_federated_metric_envelope(
            metric_id="mean_loss", metric_kind="bounded_mean", aggregate_value=value,
            clipping_lower_bound=lo, clipping_upper_bound=hi, privacy_mechanism="gaussian",
            privacy_mechanism_version="v1", participant_count=n)
    msg = str(info.value)
    for secret in (repr(value), str(n), repr(hi)):
        assert secret not in msg
