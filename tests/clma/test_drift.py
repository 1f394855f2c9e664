"""Drift detectors: loss-threshold flag and the inference monitor (Algorithm 4)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clma.drift import DriftDetector, InferenceDriftMonitor, LossThresholdDetector

# ---------------------------------------------------------------- LossThresholdDetector


def test_is_a_drift_detector() -> None:
    assert isinstance(LossThresholdDetector(0.1), DriftDetector)
    assert isinstance(InferenceDriftMonitor(), DriftDetector)


def test_first_observation_never_flags() -> None:
    det = LossThresholdDetector(gamma=0.0)
    assert det.update(100.0) is False


@pytest.mark.parametrize("rise, expected", [
    (0.25, False),        # exactly gamma: not flagged (strict)
    (0.125, False),       # below gamma
    (0.375, True),        # above gamma
    (0.25 + 2**-40, True),  # just above gamma
    (-0.5, False),        # loss fell
])
def test_flag_at_below_above_gamma(rise: float, expected: bool) -> None:
    det = LossThresholdDetector(gamma=0.25)
    det.update(0.5)
    assert det.update(0.5 + rise) is expected


def test_compares_with_previous_round_not_first() -> None:
    det = LossThresholdDetector(gamma=0.25)
    flags = [det.update(x) for x in [1.0, 1.2, 1.4, 1.6, 2.0]]
    # Each step rises by 0.2 <= gamma except the last (0.4); cumulative rise is ignored.
    assert flags == [False, False, False, False, True]
    assert det.n_flags == 1 and det.n_updates == 5


def test_state_dict_roundtrip_json_and_reset() -> None:
    det = LossThresholdDetector(gamma=0.1)
    det.update(0.3)
    state = json.loads(json.dumps(det.state_dict()))
    restored = LossThresholdDetector.from_state_dict(state)
    assert restored.state_dict() == det.state_dict()
    assert restored.update(0.5) is True  # continues from previous loss 0.3
    restored.reset()
    assert restored.update(5.0) is False and restored.previous_loss == 5.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "0.1", True])
def test_bad_losses_rejected(bad) -> None:
    det = LossThresholdDetector(gamma=0.1)
    with pytest.raises((ValueError, TypeError), match="loss"):
        det.update(bad)


def test_bad_gamma_and_state_rejected() -> None:
    with pytest.raises(ValueError, match="gamma"):
        LossThresholdDetector(gamma=-0.1)
    with pytest.raises(ValueError, match="gamma"):
        LossThresholdDetector(gamma=float("nan"))
    det = LossThresholdDetector(gamma=0.1)
    with pytest.raises(ValueError, match="state"):
        det.load_state_dict({"kind": "InferenceDriftMonitor"})
    with pytest.raises(ValueError, match="n_flags"):
        det.load_state_dict({"kind": "LossThresholdDetector", "gamma": 0.1,
                             "previous_loss": None, "n_updates": 1, "n_flags": 2})


# ---------------------------------------------------------------- InferenceDriftMonitor

N_STREAMS = 200


def _first_fire(monitor: InferenceDriftMonitor, stream: np.ndarray) -> int | None:
    for i, x in enumerate(stream):
        if monitor.update(float(x)):
            return i
    return None


def test_monitor_silent_on_stationary_noise_many_seeds() -> None:
    # 200 streams x 600 losses of N(1, 0.2^2) noise: the default rule (almost) never fires;
    # a z threshold of 1 (a rule that ignores the noise) fires in most of them.
    fires = 0
    loose_fires = 0
    for seed in range(N_STREAMS):
        stream = np.random.default_rng(seed).normal(1.0, 0.2, 600)
        fires += _first_fire(InferenceDriftMonitor(), stream) is not None
        loose_fires += _first_fire(InferenceDriftMonitor(threshold=1.0),
                                   stream) is not None
    assert fires <= 2  # <= 1 % false-alarm rate per 600-loss stream
    assert loose_fires > N_STREAMS // 2  # the test can tell a bad threshold apart


def test_monitor_fires_on_step_change_same_variance() -> None:
    # Same noise variance, mean steps up by two standard deviations after 300 losses.
    delays = []
    for seed in range(N_STREAMS):
        rng = np.random.default_rng(10_000 + seed)
        stream = np.concatenate([rng.normal(1.0, 0.2, 300), rng.normal(1.4, 0.2, 300)])
        fire = _first_fire(InferenceDriftMonitor(), stream)
        assert fire is not None and fire >= 300, (seed, fire)
        delays.append(fire - 300)
    assert max(delays) < 50  # within one window (the default 50) of the step


def test_monitor_latches_until_reset_and_recalibrates() -> None:
    mon = InferenceDriftMonitor(window=5, threshold=3.0)
    stream = [1.0, 1.1, 0.9, 1.0, 1.0] + [3.0] * 5
    out = [mon.update(x) for x in stream]
    assert out == [False] * 9 + [True]
    assert mon.drift_detected and mon.update(3.0) is False  # latched, fires once
    mon.reset()
    assert not mon.drift_detected and not mon.calibrated
    # The new level becomes the reference: no alarm for the same losses.
    assert not any(mon.update(3.0 + 0.01 * (i % 2)) for i in range(20))


def test_monitor_min_delta_and_constant_reference() -> None:
    mon = InferenceDriftMonitor(window=4, threshold=3.0, min_delta=0.5)
    for _ in range(4):
        mon.update(1.0)  # s0 = 0
    assert mon.reference_std == 0.0
    assert not any(mon.update(1.4) for _ in range(4))  # rise 0.4 <= min_delta
    assert mon.update(1.0 + 0.5 * 4 + 1.0) is True      # window mean rise > 0.5


def test_monitor_exact_z_value() -> None:
    mon = InferenceDriftMonitor(window=4, threshold=100.0)
    for x in [1.0, 2.0, 3.0, 4.0]:  # mean 2.5, sample std sqrt(5/3)
        mon.update(x)
    for x in [3.0, 3.0, 3.0, 3.0]:
        mon.update(x)
    expected = 0.5 / (np.sqrt(5.0 / 3.0) * np.sqrt(2.0 / 4))
    assert mon.last_z == pytest.approx(expected, rel=1e-12)


def test_monitor_state_dict_roundtrip() -> None:
    rng = np.random.default_rng(7)
    a = InferenceDriftMonitor(window=10, threshold=4.0)
    stream = np.concatenate([rng.normal(1.0, 0.1, 15), rng.normal(2.0, 0.1, 20)])
    for x in stream[:15]:
        a.update(float(x))
    b = InferenceDriftMonitor.from_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict()
    assert [a.update(float(x)) for x in stream[15:]] == [b.update(float(x)) for x in stream[15:]]
    assert a.drift_detected


def test_monitor_bad_config() -> None:
    with pytest.raises(ValueError, match="window"):
        InferenceDriftMonitor(window=1)
    with pytest.raises(ValueError, match="threshold"):
        InferenceDriftMonitor(threshold=0)
    with pytest.raises(ValueError, match="min_delta"):
        InferenceDriftMonitor(min_delta=-1)
