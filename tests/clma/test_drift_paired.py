"""The loss threshold confirmed on the same model (clma.drift.paired): the rule against its
definition, its state, the spec and config that name it, and the device step that feeds
it (a model change alone does not flag, a change of the records does; a re-asked round
gives the same flag)."""

import json

import numpy as np
import pytest
from scipy.special import softmax

from clma.config import CONFIG_ADDITIONS, FederationConfig, without_additions
from clma.device import LocalFit, records_loss, train_on_device
from clma.drift import (
    DetectorSpec,
    LossThresholdDetector,
    PairedLossDetector,
    RoundKeyedState,
    mean_cross_entropy,
)
from clma.engine.clients import TrainSettings

M0, M1, M2 = (np.full(3, v, dtype=np.float32) for v in (0.0, 1.0, 2.0))


def test_mean_cross_entropy_is_the_definition():
    rng = np.random.default_rng(0)
    p = softmax(rng.normal(size=(7, 4)), axis=1)
    y = rng.integers(0, 4, 7)
    assert mean_cross_entropy(p, y) == pytest.approx(-np.mean(np.log(p[np.arange(7), y])),
                                                     rel=1e-12)
    with pytest.raises(ValueError, match="learner: probabilities must be"):
        mean_cross_entropy(p, y[:6])
    with pytest.raises(ValueError, match="labels must lie"):
        mean_cross_entropy(p, np.array([0, 1, 2, 3, 4, 0, 0]))


def test_the_rule_flags_a_change_of_the_data_and_not_of_the_model():
    det = PairedLossDetector(0.5, min_data_rise=0.1)
    assert det.update(1.0, model=M0, reference=1.0) is False  # first update never flags
    # the received model fits worse (+0.8) but the previous model fits the records as it
    # did (paired difference 0): a change of the model, not flagged
    assert det.update(1.8, model=M1, reference=1.8, same_model=1.0) is False
    assert det.n_model_changes == 1 and det.last_data_rise == 0.0
    # the records changed: the previous model (M1, reference 1.8) now scores 2.5
    assert det.update(2.6, model=M2, reference=2.6, same_model=2.5) is True
    assert det.last_data_rise == pytest.approx(0.7)
    assert (det.n_updates, det.n_flags, det.n_model_changes) == (3, 1, 1)
    np.testing.assert_array_equal(det.previous_model, M2)


@pytest.mark.parametrize(("loss", "same_model", "flag"), [
    (1.5, 1.5, False),   # loss rise exactly gamma (0.5): strict, no flag
    (1.5001, 1.5, True),
    (2.0, 1.25, False),  # data rise exactly min_data_rise (0.25): strict, no flag
    (2.0, 1.2501, True),
])
def test_both_thresholds_are_strict(loss, same_model, flag):
    det = PairedLossDetector(0.5, min_data_rise=0.25)
    det.update(1.0, model=M0, reference=1.0)
    assert det.update(loss, model=M1, reference=loss, same_model=same_model) is flag


def test_it_flags_a_subset_of_the_loss_threshold():
    rng = np.random.default_rng(3)
    paired, plain = PairedLossDetector(0.5), LossThresholdDetector(0.5)
    prev_ref = None
    for t in range(200):
        loss = float(rng.uniform(0, 3))
        same = None if prev_ref is None else float(prev_ref + rng.normal(0, 0.5))
        ref = float(rng.uniform(0, 3))
        a = paired.update(loss, model=M0, reference=ref, same_model=same)
        b = plain.update(loss)
        assert not a or b, t
        prev_ref = ref
    assert 0 < paired.n_flags < plain.n_flags


def test_bad_calls_name_the_value_and_leave_the_state():
    det = PairedLossDetector(0.5)
    with pytest.raises(ValueError, match="same_model: there is no previous model"):
        det.update(1.0, model=M0, reference=1.0, same_model=1.0)
    assert det.n_updates == 0
    det.update(1.0, model=M0, reference=1.0)
    before = json.dumps(det.state_dict(), sort_keys=True)
    with pytest.raises(ValueError, match="same_model: the previous model's score"):
        det.update(3.0, model=M1, reference=3.0)
    with pytest.raises(ValueError, match="model: another number of parameters"):
        det.update(3.0, model=np.zeros(4, np.float32), reference=3.0, same_model=3.0)
    with pytest.raises(ValueError, match="reference: must be finite"):
        det.update(3.0, model=M1, reference=float("nan"), same_model=3.0)
    with pytest.raises(ValueError, match="model: the paired-loss detector keeps"):
        det.update(3.0, reference=3.0, same_model=3.0)
    assert json.dumps(det.state_dict(), sort_keys=True) == before
    with pytest.raises(ValueError, match="min_data_rise"):
        PairedLossDetector(0.5, min_data_rise=-0.1)
    with pytest.raises(ValueError, match="gamma: must be >= 0"):
        PairedLossDetector(-1.0)


def test_state_round_trips_as_json_with_the_model_bitwise():
    det = PairedLossDetector(0.4, min_data_rise=0.2)
    model = np.random.default_rng(1).normal(size=1000).astype(np.float32)
    det.update(1.0, model=model, reference=0.9)
    det.update(1.6, model=model * 2, reference=1.6, same_model=0.9)
    state = json.loads(json.dumps(det.state_dict()))
    back = PairedLossDetector.from_state_dict(state)
    assert back.state_dict() == det.state_dict()
    np.testing.assert_array_equal(back.previous_model, model * 2)
    assert back.previous_model.dtype == np.float32
    assert back.n_model_changes == 1
    assert state["previous_model"]["shape"] == [1000]
    for edit, field in [({"previous_model": {"shape": [999], "dtype": "float32",
                                             "zlib_b64": state["previous_model"]["zlib_b64"]}},
                         "state.previous_model: byte length"),
                        ({"previous_model": {**state["previous_model"], "shape": [10, 100]}},
                         r"state.previous_model.shape: must be \[n\] with n >= 1"),
                        ({"previous_model": None}, "state.previous_model: previous_loss"),
                        ({"n_flags": 5}, "state.n_flags"),
                        ({"reference": "x"}, "state.reference"),
                        ({"kind": "LossThresholdDetector"}, "state: not a PairedLossDetector")]:
        with pytest.raises((ValueError, TypeError), match=field):
            PairedLossDetector(0.4).load_state_dict({**state, **edit})


def test_spec_and_config_name_it_and_the_server_parameters_win():
    spec = DetectorSpec.of("paired_loss", {"min_data_rise": 0.3})
    assert spec.needs_previous_model and not spec.needs_inputs
    assert not DetectorSpec().needs_previous_model
    old = PairedLossDetector(0.9, min_data_rise=0.05)
    old.update(1.0, model=M0, reference=1.0)
    det = spec.restore(old.state_dict(), 0.5)
    assert (det.gamma, det.params.min_data_rise, det.n_updates) == (0.5, 0.3, 1)
    assert DetectorSpec.from_json(spec.to_json()) == spec
    cfg = FederationConfig.model_validate(
        {"drift": {"detector": "paired_loss", "paired_loss": {"min_data_rise": 0.3}}})
    assert cfg.drift.detector_spec() == spec
    with pytest.raises(ValueError, match="drift.paired_loss.min_data_rise"):
        FederationConfig.model_validate({"drift": {"paired_loss": {"min_data_rise": -1}}})
    # the improved method (the default) runs it, the paper's method the loss threshold
    assert FederationConfig().drift.detector_spec() == DetectorSpec.of("paired_loss")
    paper = FederationConfig.model_validate({"cohort": {"method": "paper"}})
    assert paper.drift.detector_spec() == DetectorSpec()
    # a config at the legacy parameters keeps the fingerprint it had before the field
    dump = without_additions(paper.model_dump(mode="json"), CONFIG_ADDITIONS)
    assert "paired_loss" not in json.dumps(dump)


class _Learner:
    """A device whose 'model' is a vector of class logits (the same for every record) and
    whose records' labels are set by the test; fit returns the received model."""

    def __init__(self, labels, with_training=True):
        self.labels = {0: np.asarray(labels)}
        if not with_training:
            self.predict_training = None

    def _labels(self, round_number):
        return self.labels[max(r for r in self.labels if r <= round_number)]

    def _proba(self, params, round_number):
        y = self._labels(round_number)
        return np.tile(softmax(np.asarray(params, np.float64)), (y.size, 1)), y

    def fit(self, params, settings, round_number):
        proba, y = self._proba(params, round_number)
        return LocalFit(np.asarray(params, np.float32), mean_cross_entropy(proba, y), y.size)

    def predict(self, params, round_number):
        return self._proba(params, round_number)

    def predict_training(self, params, round_number):
        return self._proba(params, round_number)


SETTINGS = TrainSettings(1, 0.1, 8, 0.5, DetectorSpec.of("paired_loss"))
PLAIN = TrainSettings(1, 0.1, 8, 0.5)
GOOD = np.array([5.0, 0.0, 0.0], np.float32)   # fits label 0 (0.013 nats)
WORSE = np.array([0.3, -3.0, 0.0], np.float32)  # a worse model of them (0.575 nats)
LABEL1 = np.array([0.0, 3.0, 0.0], np.float32)


@pytest.mark.parametrize("with_training", [True, False])
def test_on_the_device_a_worse_model_does_not_flag_and_new_records_do(with_training):
    learner = _Learner(np.zeros(6, int), with_training)
    hist, plain_hist = RoundKeyedState(), RoundKeyedState()
    assert records_loss(learner, GOOD, 1) == pytest.approx(
        -np.log(softmax(GOOD.astype(np.float64))[0]), rel=1e-12)

    def step(settings, history, model, r):
        return train_on_device(7, 1, model, settings, r, learner, history).drift_flag

    assert not step(SETTINGS, hist, GOOD, 1) and not step(PLAIN, plain_hist, GOOD, 1)
    ce = {m: records_loss(learner, v, 1) for m, v in (("good", GOOD), ("worse", WORSE))}
    assert ce["worse"] - ce["good"] == pytest.approx(0.562, abs=1e-3)  # > gamma 0.5
    # round 2: the server sends a worse model of unchanged records
    assert step(PLAIN, plain_hist, WORSE, 2) is True
    assert step(SETTINGS, hist, WORSE, 2) is False
    # round 3: the records' labels change (the drift); the received model is the same
    learner.labels[3] = np.ones(6, int)
    assert step(SETTINGS, hist, WORSE, 3) is True
    # asked again (a server retry), round 3 gives the same flag from the state before it
    assert step(SETTINGS, hist, WORSE, 3) is True
    assert hist.rounds == [1, 2, 3]
    # round 4: the cohort's new model fits the new labels: no flag
    assert step(SETTINGS, hist, LABEL1, 4) is False


def test_the_device_keeps_the_model_only_in_the_two_newest_states():
    """RoundKeyedState keeps 4 states; the paired detector's model copy stays in the newest
    two only (the states a round asked again reads), the older ones slimmed to no model:
    restored after a rollback that deep, the detector has no previous model and does not
    flag, like a first round. Asking the newest round again still gives the same flag."""
    learner = _Learner(np.zeros(6, int))
    hist = RoundKeyedState()

    def step(model, r):
        return train_on_device(7, 1, model, SETTINGS, r, learner, hist).drift_flag

    for r in (1, 2, 3):
        step(GOOD, r)
    learner.labels[4] = np.ones(6, int)
    assert step(WORSE, 4) is True
    doc = json.loads(json.dumps(hist.to_dict()))
    assert sorted(doc["rounds"]) == ["1", "2", "3", "4"]
    for r, full in (("1", False), ("2", False), ("3", True), ("4", True)):
        state = doc["rounds"][r]
        assert (state["previous_model"] is not None) is full
        assert (state["reference"] is not None) is full
        assert state["previous_loss"] is not None and state["n_updates"] == int(r)
    assert step(WORSE, 4) is True  # asked again: the full state of round 3
    # a rollback to round 3 reads round 2's slimmed state: no previous model, no flag
    # (the loss rise alone is 0.56 > gamma), and the new state has the model again
    slim = PairedLossDetector.from_state_dict(hist.before(3))
    assert slim.previous_model is None and slim.n_updates == 2
    assert step(WORSE, 3) is False
    assert hist.rounds == [1, 2, 3] and hist.before(4)["previous_model"] is not None
