"""The calibrated on-device drift detectors: CUSUM against its literal formula and its
average run length, river's Page-Hinkley and ADWIN against river's own output, state
round trips through JSON, the spec the devices receive and the config fields naming
errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from river import drift as river_drift
from scipy.stats import median_abs_deviation

from clma.config import ConfigError, default_config, validate_config
from clma.drift import (
    ADWINDetector,
    CusumDetector,
    DetectorSpec,
    LossThresholdDetector,
    PageHinkleyDetector,
    cusum_arl,
)

# ----------------------------------------------------------------------------- CUSUM


def _literal_cusum(losses, k, h, burn_in, warmup, window, min_scale):
    """Page's one-sided CUSUM of rises over a running 1.4826 * MAD scale, written out."""
    flags, rises, s, prev = [], [], 0.0, None
    for t, x in enumerate(losses, start=1):
        if t <= burn_in or prev is None:
            prev = None if t <= burn_in else x
            flags.append(False)
            continue
        r, prev = x - prev, x
        if len(rises) < warmup:
            rises = (rises + [r])[-window:]
            flags.append(False)
            continue
        med = np.median(rises)
        scale = max(1.4826 * np.median(np.abs(np.asarray(rises) - med)), min_scale)
        s = max(0.0, s + r / scale - k)
        if s > h:
            flags.append(True)
            s = 0.0
        else:
            flags.append(False)
            rises = (rises + [r])[-window:]
    return flags


# losses 1.0 x 4: the burn-in loss, the first of the series, then two rises of 0 (scale = min_scale = 0.5,
# exact in binary); then one rise of 2.25 + d: z = 4.5 + 2d, S = 4 + 2d against h = 4.
@pytest.mark.parametrize("d, flag", [(-1e-9, False), (0.0, False), (1e-9, True)])
def test_cusum_flags_strictly_above_h(d, flag):
    det = CusumDetector(k=0.5, h=4.0, min_scale=0.5)
    assert [det.update(x) for x in (1.0, 1.0, 1.0, 1.0)] == [False] * 4
    assert det.scale() == 0.5
    assert det.update(3.25 + d) is flag
    assert det.statistic == (0.0 if flag else pytest.approx(4.0 + 2 * d, abs=1e-12))
    assert det.n_flags == int(flag)


def test_cusum_accumulates_small_persistent_rises_the_loss_threshold_misses():
    # three rises of 0.8 nats on a client whose own scale is 0.5: z = 1.6 each,
    # S = 1.1, 2.2, 3.3, 4.4 -> flag at the fourth; a gamma of 1 nat never flags
    losses = [2.0, 1.0, 1.0, 1.0, 1.8, 2.6, 3.4, 4.2]
    det = CusumDetector(k=0.5, h=4.0, min_scale=0.5)
    assert [det.update(x) for x in losses] == [False] * 7 + [True]
    thr = LossThresholdDetector(1.0)
    assert not any(thr.update(x) for x in losses)


def test_cusum_scale_is_the_normal_consistent_mad_of_the_in_control_rises():
    rng = np.random.default_rng(3)
    losses = np.cumsum(rng.normal(0.0, 0.1, size=30)) + 5.0
    det = CusumDetector(window=10, min_scale=1e-6, h=100.0)
    for x in losses:
        det.update(float(x))
    rises = np.diff(losses[1:])[-10:]
    assert det.rises == pytest.approx(rises.tolist(), abs=1e-12)
    assert det.scale() == pytest.approx(median_abs_deviation(rises, scale="normal"), rel=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cusum_matches_its_literal_formula_on_random_series(seed):
    rng = np.random.default_rng(seed)
    base = np.concatenate([2.3 - np.cumsum(np.abs(rng.normal(0.2, 0.1, 8))),
                           rng.normal(0.4, 0.05, 20)])
    base[15:] += np.linspace(0.0, 1.5, base.size - 15)  # a slow covariate drift
    losses = [float(x) for x in base]
    params = {"k": 0.3, "h": 3.0, "burn_in": 2, "warmup": 3, "window": 6, "min_scale": 0.01}
    det = CusumDetector(**params)
    got = [det.update(x) for x in losses]
    assert got == _literal_cusum(losses, **params)
    assert any(got)  # the drift is found (a test that cannot fail is a defect)


def test_a_flagged_rise_does_not_inflate_the_scale_and_the_statistic_restarts():
    det = CusumDetector(k=0.5, h=4.0, min_scale=0.5)
    for x in (1.0, 1.0, 1.0, 1.0):
        det.update(x)
    assert det.update(11.0) is True
    assert det.rises == [0.0, 0.0] and det.statistic == 0.0
    assert det.update(11.0) is False and det.rises == [0.0, 0.0, 0.0]


def _mc_arl(k, h, shift, runs, rng):
    s = np.zeros(runs)
    alive = np.ones(runs, dtype=bool)
    length = np.zeros(runs)
    t = 0
    while alive.any():
        t += 1
        z = rng.normal(shift, 1.0, size=runs)
        s = np.where(alive, np.maximum(0.0, s + z - k), s)
        hit = alive & (s > h)
        length[hit] = t
        alive &= ~hit
    return length.mean(), length.std(ddof=1) / np.sqrt(runs)


@pytest.mark.parametrize("shift, expected", [(0.0, 338.09), (1.0, 8.343)])
def test_siegmund_arl_of_the_defaults_matches_a_simulated_cusum(shift, expected):
    """The docstring's ARL figures: Siegmund's formula, and a seeded Monte Carlo of the
    literal CUSUM on N(shift, 1) within 4 standard errors plus Siegmund's ~2 % error."""
    assert cusum_arl(0.5, 4.0, shift) == pytest.approx(expected, rel=1e-3)
    mean, se = _mc_arl(0.5, 4.0, shift, runs=3000 if shift == 0 else 20000,
                       rng=np.random.default_rng(11))
    assert abs(mean - cusum_arl(0.5, 4.0, shift)) < 4 * se + 0.02 * expected


def test_cusum_arl_zero_drift_limit_and_errors():
    assert cusum_arl(1.0, 3.0, 1.0) == pytest.approx((3.0 + 1.166) ** 2)
    assert cusum_arl(1.0, 3.0, 1.0 + 1e-6) == pytest.approx(cusum_arl(1.0, 3.0, 1.0), rel=1e-4)
    with pytest.raises(ValueError, match="h: must be > 0"):
        cusum_arl(0.5, 0.0)


@pytest.mark.parametrize("kwargs, field", [
    ({"k": -0.1}, "k"), ({"h": 0.0}, "h"), ({"warmup": 1}, "warmup"),
    ({"min_scale": 0.0}, "min_scale"), ({"burn_in": -1}, "burn_in"),
    ({"window": 3, "warmup": 4}, "window"), ({"k": "0.5"}, "k"), ({"kk": 1.0}, "kk"),
])
def test_cusum_parameters_are_validated_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CusumDetector(**kwargs)


# ----------------------------------------------------------------------------- river


def _river_flags(det, xs):
    out = []
    for x in xs:
        det.update(x)
        out.append(bool(det.drift_detected))
    return out


def _step_series(rng, n0, n1, lo, hi, sd):
    return [float(x) for x in np.concatenate([rng.normal(lo, sd, n0), rng.normal(hi, sd, n1)])]


# x = 0, 0, 0, 4 with delta 0, alpha 1: the running mean is 1 after the fourth value, the
# increase statistic 4 - 1 = 3 (exact); river flags iff 3 > threshold.
@pytest.mark.parametrize("threshold, flag", [(3.0 + 1e-9, False), (3.0, False),
                                             (3.0 - 1e-9, True)])
def test_page_hinkley_flags_at_below_and_above_its_threshold_as_river_does(threshold, flag):
    params = {"min_instances": 1, "delta": 0.0, "threshold": threshold, "alpha": 1.0,
              "mode": "up"}
    xs = [0.0, 0.0, 0.0, 4.0]
    det = PageHinkleyDetector(**params)
    got = [det.update(x) for x in xs]
    assert got == _river_flags(river_drift.PageHinkley(**params), xs)
    assert got == [False, False, False, flag]


@pytest.mark.parametrize("mode", ["up", "both", "down"])
def test_page_hinkley_is_rivers_output_on_a_sweep_of_step_sizes(mode):
    rng = np.random.default_rng(5)
    flagged = set()
    for step in np.linspace(-1.5, 1.5, 13):
        xs = _step_series(rng, 6, 6, 0.4, 0.4 + step, 0.05)
        det = PageHinkleyDetector(mode=mode)
        got = [det.update(x) for x in xs]
        ref = river_drift.PageHinkley(min_instances=3, delta=0.05, threshold=0.5,
                                      alpha=0.9999, mode=mode)
        assert got == _river_flags(ref, xs)
        flagged.add(any(got))
    assert flagged == {True, False}  # the sweep crosses the threshold


def test_adwin_both_is_rivers_output_and_up_keeps_only_rises():
    rng = np.random.default_rng(7)
    crossed, falls_river_flags = set(), 0
    for step in np.linspace(-4.0, 4.0, 17):  # ADWIN needs long series: 30 + 30 losses
        xs = _step_series(rng, 30, 30, 4.5, 4.5 + step, 0.05)
        ref = _river_flags(river_drift.ADWIN(delta=0.002, clock=1, max_buckets=5,
                                             min_window_length=2, grace_period=4), xs)
        both = ADWINDetector(direction="both")
        assert [both.update(x) for x in xs] == ref
        up = ADWINDetector()
        got = [up.update(x) for x in xs]
        if step > 0:
            assert got == ref
        elif step < 0:
            assert not any(got)  # "up" never flags a fall ...
            falls_river_flags += any(ref)
        crossed.add(any(ref))
    assert crossed == {True, False}
    assert falls_river_flags >= 2  # ... which river does flag


def test_river_detectors_default_parameters_are_the_documented_ones():
    assert PageHinkleyDetector().params.model_dump() == {
        "min_instances": 3, "delta": 0.05, "threshold": 0.5, "alpha": 0.9999, "mode": "up"}
    assert ADWINDetector().params.model_dump() == {
        "delta": 0.002, "clock": 1, "max_buckets": 5, "min_window_length": 2,
        "grace_period": 4, "direction": "up"}


@pytest.mark.parametrize("cls, kwargs, field", [
    (PageHinkleyDetector, {"threshold": 0.0}, "threshold"),
    (PageHinkleyDetector, {"mode": "sideways"}, "mode"),
    (PageHinkleyDetector, {"alpha": 1.5}, "alpha"),
    (ADWINDetector, {"delta": 1.0}, "delta"),
    (ADWINDetector, {"clock": 0}, "clock"),
    (ADWINDetector, {"direction": "down"}, "direction"),
])
def test_river_parameters_are_validated_naming_the_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=field):
        cls(**kwargs)


# ----------------------------------------------------------------------------- state


def _series(seed):
    rng = np.random.default_rng(seed)
    xs = np.concatenate([2.3 - np.cumsum(np.abs(rng.normal(0.3, 0.1, 5))),
                         rng.normal(0.5, 0.05, 20), rng.normal(3.5, 0.1, 15),
                         rng.normal(0.6, 0.05, 10)])
    return [float(x) for x in xs]


@pytest.mark.parametrize("cls", [CusumDetector, PageHinkleyDetector, ADWINDetector,
                                 LossThresholdDetector])
def test_state_round_trips_through_json_at_every_round(cls):
    make = (lambda: cls(0.5)) if cls is LossThresholdDetector else cls
    xs = _series(2)
    ref = make()
    ref_flags = [ref.update(x) for x in xs]
    assert any(ref_flags)
    for cut in range(len(xs) + 1):
        a = make()
        flags = [a.update(x) for x in xs[:cut]]
        b = make()
        b.load_state_dict(json.loads(json.dumps(a.state_dict())))
        flags += [b.update(x) for x in xs[cut:]]
        assert flags == ref_flags
        assert b.state_dict() == ref.state_dict()


@pytest.mark.parametrize("cls", [CusumDetector, PageHinkleyDetector, ADWINDetector])
def test_a_bad_state_is_refused_naming_the_field(cls):
    det = cls()
    det.update(1.0)
    good = det.state_dict()
    with pytest.raises(ValueError, match="state: not a"):
        cls().load_state_dict({**good, "kind": "Other"})
    bad_param = {**good, "params": {**good["params"], "delta" if "delta" in good["params"]
                                    else "k": -5.0}}
    with pytest.raises(ValueError, match="state.params."):
        cls().load_state_dict(bad_param)
    with pytest.raises(ValueError, match="state.n_flags"):
        cls().load_state_dict({**good, "n_flags": 5, "n_updates": 1})
    key = "rises" if cls is CusumDetector else "series"
    with pytest.raises(ValueError, match=f"state.{key}"):
        cls().load_state_dict({**good, key: [1.0, float("nan")]})


def test_reset_forgets_observations_and_keeps_parameters():
    for det in (CusumDetector(h=2.0), PageHinkleyDetector(threshold=0.2), ADWINDetector()):
        fresh = det.state_dict()
        for x in _series(4):
            det.update(x)
        det.reset()
        assert det.state_dict() == fresh


# ----------------------------------------------------------------------------- spec


def test_spec_restores_observations_under_the_servers_parameters():
    spec = DetectorSpec.of("cusum", {"h": 4.0, "min_scale": 0.5})
    det = spec.build(0.5)
    for x in (1.0, 1.0, 1.0, 1.0):
        det.update(x)
    state = det.state_dict()
    # the server lowers h: the stored rises are kept, the new h is in force
    lower = DetectorSpec.of("cusum", {"h": 1.0, "min_scale": 0.5}).restore(state, 0.5)
    assert lower.params.h == 1.0 and lower.rises == [0.0, 0.0]
    assert lower.update(2.0) is True  # z = 2, S = 1.5 > 1
    assert spec.restore(state, 0.5).update(2.0) is False  # S = 1.5 <= 4
    # a state of another kind is not carried over
    assert DetectorSpec.of("adwin").restore(state, 0.5).state_dict()["series"] == []
    lt = DetectorSpec().restore({"kind": "LossThresholdDetector", "gamma": 9.0,
                                 "previous_loss": 1.0, "n_updates": 1, "n_flags": 0}, 0.25)
    assert isinstance(lt, LossThresholdDetector) and lt.gamma == 0.25


def test_spec_json_round_trip_and_errors():
    spec = DetectorSpec.of("page_hinkley", {"threshold": 0.8})
    back = DetectorSpec.from_json(spec.to_json())
    assert back == spec and dict(back.params)["threshold"] == 0.8
    with pytest.raises(ValueError, match="drift.detector: must be one of"):
        DetectorSpec.of("magic")
    with pytest.raises(ValueError, match="drift.adwin.delta"):
        DetectorSpec.of("adwin", {"delta": 2.0})
    with pytest.raises(ValueError, match="drift.detector: not a JSON"):
        DetectorSpec.from_json("{oops")


# ----------------------------------------------------------------------------- config


def _with_drift(**drift):
    data = default_config().model_dump()
    data["drift"].update(drift)
    return validate_config(data)


def test_config_selects_the_detector_the_devices_receive():
    assert default_config().drift.detector_spec() == DetectorSpec.of("paired_loss")
    cfg = _with_drift(detector="cusum", cusum={"k": 0.25, "h": 3.0})
    spec = cfg.drift.detector_spec()
    assert spec.kind == "cusum" and dict(spec.params)["k"] == 0.25
    assert isinstance(spec.build(cfg.drift.gamma), CusumDetector)
    spec = _with_drift(detector="adwin", adwin={"delta": 0.01}).drift.detector_spec()
    assert isinstance(spec.build(0.5), ADWINDetector) and dict(spec.params)["delta"] == 0.01


@pytest.mark.parametrize("drift, message", [
    ({"detector": "kalman"}, "drift.detector: Input should be"),
    ({"cusum": {"h": 0.0}}, "drift.cusum.h: Input should be greater than 0"),
    ({"cusum": {"k": -1.0}}, "drift.cusum.k: Input should be greater than or equal to 0"),
    ({"cusum": {"warmup": 6, "window": 5}}, "drift.cusum: window: must be >= warmup"),
    ({"cusum": {"speed": 1.0}}, "drift.cusum.speed: unknown field"),
    ({"page_hinkley": {"mode": "down-ish"}}, "drift.page_hinkley.mode"),
    ({"page_hinkley": {"threshold": float("inf")}}, "drift.page_hinkley.threshold"),
    ({"adwin": {"delta": 1.0}}, "drift.adwin.delta: Input should be less than 1"),
    ({"adwin": {"grace_period": True}}, "drift.adwin.grace_period"),
])
def test_config_errors_name_the_field(drift, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        _with_drift(**drift)
