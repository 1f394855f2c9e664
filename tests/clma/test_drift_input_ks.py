"""The input KS detector: p-values against scipy's ks_2samp, the Bonferroni rule at, below
and above its threshold, its false-flag rate under no drift, detection of the simulation's
own covariate drifts, state round trips, the spec and config, and the device path."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy.stats import ks_2samp

from clma.config import ConfigError, default_config, validate_config
from clma.device import LocalFit, train_on_device
from clma.drift import (
    DetectorSpec,
    InputKSDetector,
    InputKSParams,
    LossThresholdDetector,
    RoundKeyedState,
    feature_ks_pvalues,
    row_summaries,
)
from clma.engine import TrainSettings
from clma.engine.clients import TrainRequest
from clma.sim.drift import AppliedDrift, transform_images

REF = np.array([[0.10, 1.0, 5.0], [0.40, 2.0, 5.0], [0.35, 3.0, 5.0], [0.80, 4.0, 5.0],
                [0.55, 5.0, 5.0], [0.20, 6.0, 5.0]])
CUR = np.array([[0.90, 2.5, 5.0], [0.70, 3.5, 5.0], [0.95, 4.5, 5.0], [0.60, 5.5, 5.0],
                [0.85, 9.0, 5.0]])


def _ks(**kw):
    kw.setdefault("with_loss_threshold", False)
    kw.setdefault("summaries", False)  # the literal per-feature tests; summaries tested below
    return InputKSDetector(0.5, **kw)


# ----------------------------------------------------------------------------- the test


def test_pvalues_are_scipys_ks_2samp_per_feature_and_constant_features_are_skipped():
    pvals, tested = feature_ks_pvalues(REF, CUR)
    assert tested.tolist() == [True, True, False]  # column 2 is 5.0 in both samples
    expected = [ks_2samp(REF[:, j], CUR[:, j]).pvalue for j in (0, 1)]
    np.testing.assert_allclose(pvals, expected, rtol=1e-12, atol=0)
    # a feature constant in each sample but at different values is tested (D = 1)
    a, b = np.zeros((5, 1)), np.ones((4, 1))
    p, t = feature_ks_pvalues(a, b)
    assert t.tolist() == [True] and p[0] == pytest.approx(ks_2samp(a[:, 0], b[:, 0]).pvalue)
    assert p[0] == pytest.approx(2 / 126)  # exact: 2 / C(9, 4)
    with pytest.raises(ValueError, match="must be 2-D"):
        feature_ks_pvalues(REF[:, 0], CUR[:, 0])


@pytest.mark.parametrize("factor, flag", [(1 - 1e-9, False), (1.0, True), (1 + 1e-9, True)])
def test_flags_at_and_above_alpha_over_d_not_below(factor, flag):
    pvals, _ = feature_ks_pvalues(REF, CUR)
    p_min = float(pvals.min())
    # d = 2 tested features (the constant one is not counted): threshold alpha / 2
    det = _ks(alpha=2.0 * p_min * factor)
    assert det.update(1.0, REF) is False  # the first observation never flags
    assert det.update(1.0, CUR) is flag
    assert det.last_n_tested == 2 and det.last_min_pvalue == p_min
    # counting the constant feature (d = 3) would not flag at alpha = 2 p_min
    assert 2.0 * p_min / 3 < p_min


def test_first_observation_never_flags_and_becomes_the_reference():
    det = _ks(alpha=0.5)
    assert det.update(0.0, CUR) is False and det.reference.tolist() == CUR.astype(
        np.float32).tolist()
    assert det.last_min_pvalue is None and det.n_flags == 0


def test_reference_replaced_on_a_flag_and_kept_otherwise():
    det = _ks(alpha=0.5)
    det.update(1.0, REF)
    near = REF.copy()
    near[:, :2] += 1e-3  # each feature's values interleave with the reference's: p = 1
    assert det.update(1.0, near) is False
    np.testing.assert_array_equal(det.reference, REF.astype(np.float32))
    assert det.update(1.0, CUR) is True
    np.testing.assert_array_equal(det.reference, CUR.astype(np.float32))
    # the drifted client staying drifted is not flagged again
    assert det.update(1.0, CUR) is False and det.n_flags == 1 and det.n_updates == 4


def test_subsample_is_seeded_uniform_and_deterministic():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 3))
    a, b, c = (_ks(reference_size=10) for _ in range(3))
    a.update(1.0, x, seed=(3, 1))
    b.update(1.0, x, seed=(3, 1))
    c.update(1.0, x, seed=(3, 2))
    assert a.reference.shape == (10, 3)
    np.testing.assert_array_equal(a.reference, b.reference)
    assert not np.array_equal(a.reference, c.reference)
    # the rows are rows of x, in x's order, drawn by default_rng([3, 1, stream])
    from clma.drift.input_ks import SUBSAMPLE_STREAM

    idx = np.sort(np.random.default_rng([3, 1, SUBSAMPLE_STREAM]).choice(50, 10, replace=False))
    np.testing.assert_array_equal(a.reference, x[idx].astype(np.float32))
    small = _ks(reference_size=60)
    small.update(1.0, x, seed=(3, 1))
    assert small.reference.shape == (50, 3)  # not more rows than reference_size: all kept


def test_images_are_flattened_to_feature_rows():
    x = np.random.default_rng(1).random((7, 1, 2, 3)).astype(np.float32)
    det = _ks()
    det.update(1.0, x)
    assert det.reference.shape == (7, 6)
    np.testing.assert_array_equal(det.reference, x.reshape(7, 6))


def test_bad_inputs_are_refused_naming_the_field_and_leave_the_state():
    det = _ks()
    det.update(1.0, REF)
    before = det.state_dict()
    for bad, msg in [(None, "inputs: drift.detector input_ks needs"),
                     (np.zeros((0, 3)), "inputs: must hold at least one row"),
                     (np.array([[1.0, np.nan, 2.0]]), "inputs: must be finite"),
                     (np.zeros((4, 2)), "inputs: must have the reference's 3 features"),
                     ([["a", "b", "c"]], "inputs: must be a numeric array")]:
        with pytest.raises(ValueError, match=msg):
            det.update(1.0, bad)
        assert det.state_dict() == before


# ----------------------------------------------------------------------------- calibration


def test_false_flag_rate_under_no_drift_is_within_the_bonferroni_bound():
    # fresh iid samples every round (a real device): d = 8 independent continuous
    # features, n = m = 40; alpha = 0.2 so a dropped correction would be visible
    alpha, d, n, trials = 0.2, 8, 40, 400
    rng = np.random.default_rng(2024)
    flags = 0
    for _ in range(trials):
        det = _ks(alpha=alpha)
        det.update(1.0, rng.normal(size=(n, d)))
        flags += det.update(1.0, rng.normal(size=(n, d)))
    rate = flags / trials
    bound = 1.0 - (1.0 - alpha / d) ** d  # 0.183 for independent features
    se = np.sqrt(bound * (1.0 - bound) / trials)
    assert bound < alpha
    assert rate <= bound + 3 * se
    uncorrected = 1.0 - (1.0 - alpha) ** d  # 0.832: what dropping the correction gives
    assert rate < uncorrected - 10 * se
    assert rate > 0.25 * bound  # the test is live, not trivially silent


# ----------------------------------------------------------------------------- detection


@pytest.fixture(scope="module")
def federation():
    from clma.sim.federation import build_federation

    return build_federation(default_config())


def _rate(fed, kind, magnitude, alpha=0.01, summaries=True):
    hits = []
    for cid, cl in sorted(fed.clients.items()):
        det = _ks(alpha=alpha, summaries=summaries)
        det.update(1.0, cl.train_x, seed=(cid, 3))
        assert det.update(1.0, cl.train_x, seed=(cid, 4)) is False  # same data: p = 1
        drift = AppliedDrift(4, kind, "f", magnitude=magnitude, noise_seed=1000 + cid)
        hits.append(det.update(1.0, transform_images(cl.train_x, drift), seed=(cid, 5)))
    return int(np.sum(hits))


def test_the_default_federations_clients_hold_18_training_rows_of_64_pixels(federation):
    rows = {cl.train_x.shape[0] for cl in federation.clients.values()}
    assert rows <= {17, 18} and len(federation.clients) == 60
    assert {cl.train_x.shape[1:] for cl in federation.clients.values()} == {(1, 8, 8)}


@pytest.mark.parametrize("kind, magnitude, pixels_only, with_summaries", [
    # clients of 60 flagged at alpha 0.01 (the measured figures the docs quote)
    ("rotation", 30.0, 60, 60),
    ("blur", 1.0, 60, 60),
    # 18 rows per client are few for a noise of std 0.5 clipped to [0, 1] on the pixels
    # alone (its min p-value ~1e-4 sits at the Bonferroni threshold 1.6e-4); the row
    # summaries (roughness, sparsity) move on every noisy image
    ("gaussian_noise", 0.5, 33, 60),
])
def test_the_simulations_covariate_drifts_are_detected(federation, kind, magnitude,
                                                       pixels_only, with_summaries):
    assert _rate(federation, kind, magnitude, summaries=False) == pixels_only
    assert _rate(federation, kind, magnitude, summaries=True) == with_summaries


def test_row_summaries_are_their_literal_formulas():
    x = np.array([[0.0, 1.0, 0.5, 0.0], [2.0, 2.0, 2.0, 2.0]])
    np.testing.assert_allclose(row_summaries(x), [
        [0.375, np.sqrt(((x[0] - 0.375) ** 2).mean()), 0.5, (1.0 + 0.5 + 0.5) / 3],
        [2.0, 0.0, 0.0, 0.0]], rtol=1e-12, atol=0)
    np.testing.assert_array_equal(row_summaries(np.array([[3.0], [0.0]])),
                                  [[3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])


def test_summaries_are_four_more_tests_under_the_same_bonferroni_rule():
    pvals, tested = feature_ks_pvalues(np.hstack([REF, row_summaries(REF)]),
                                       np.hstack([CUR, row_summaries(CUR)]))
    # columns 0, 1 tested, 2 constant; summaries: mean, std, zeros (none in either: 0.0,
    # constant, skipped), roughness
    assert tested.tolist() == [True, True, False, True, True, False, True]
    d = int(tested.sum())
    p_min = float(pvals.min())
    for factor, flag in [(1 - 1e-9, False), (1.0, True)]:
        det = _ks(alpha=d * p_min * factor, summaries=True)
        det.update(1.0, REF)
        assert det.update(1.0, CUR) is flag and det.last_n_tested == d


def test_false_flag_rate_with_summaries_stays_within_alpha():
    # the summaries are functions of the same rows: the union bound still holds
    alpha, d, n, trials = 0.2, 8, 40, 400
    rng = np.random.default_rng(7)
    flags = 0
    for _ in range(trials):
        det = _ks(alpha=alpha, summaries=True)
        det.update(1.0, rng.normal(size=(n, d)))
        flags += det.update(1.0, rng.normal(size=(n, d)))
    se = np.sqrt(alpha * (1 - alpha) / trials)
    assert flags / trials <= alpha + 3 * se
    assert flags / trials > 0.25 * (1 - (1 - alpha / (d + 4)) ** (d + 4))  # live


@pytest.mark.parametrize("n, d, flag", [(7, 53, False), (8, 64, True)])
def test_a_client_can_flag_only_if_its_smallest_possible_p_reaches_alpha_over_d(n, d, flag):
    # every feature fully separated (D = 1): the exact two-sided p for n = m rows is
    # 2 / C(2n, n); 7 rows: 5.8e-4 > 0.01 / 53 (never flags, the misses of
    # cov-blurrot-a1's smallest shards); 8 rows: 1.554e-4 <= 0.01 / 64
    ref = np.random.default_rng(n).random((n, d))
    pvals, tested = feature_ks_pvalues(ref, ref + 2.0)
    assert tested.sum() == d
    np.testing.assert_allclose(pvals, 2.0 / math.comb(2 * n, n), rtol=1e-9)
    det = _ks(alpha=0.01)
    det.update(1.0, ref)
    assert det.update(1.0, ref + 2.0) is flag


# ----------------------------------------------------------------------------- loss rule


@pytest.mark.parametrize("with_loss, rise, flag", [
    (True, 0.5, False), (True, 0.5 + 1e-9, True), (False, 3.0, False)])
def test_the_loss_threshold_rule_joins_the_input_test(with_loss, rise, flag):
    det = InputKSDetector(0.5, with_loss_threshold=with_loss)
    lt = LossThresholdDetector(0.5)
    assert det.update(1.0, REF) is False and lt.update(1.0) is False
    assert det.update(1.0 + rise, REF) is flag  # inputs unchanged: only the loss can flag
    if with_loss:
        assert lt.update(1.0 + rise) is flag


# ----------------------------------------------------------------------------- state


def test_state_round_trips_through_json_and_continues_identically():
    rng = np.random.default_rng(5)
    xs = [rng.random((30, 1, 8, 8)).astype(np.float32) for _ in range(3)]
    xs.append(np.clip(xs[-1] + 0.4, 0, 1))
    a = InputKSDetector(0.5, alpha=0.05, reference_size=20)
    b = InputKSDetector(0.5, alpha=0.05, reference_size=20)
    for r, x in enumerate(xs):
        text = json.dumps(a.state_dict())
        b = InputKSDetector.from_state_dict(json.loads(text))
        assert b.state_dict() == a.state_dict()
        if a.reference is not None:
            np.testing.assert_array_equal(b.reference, a.reference)
        fa, fb = a.update(1.0 + r, x, seed=(1, r)), b.update(1.0 + r, x, seed=(1, r))
        assert fa is fb and a.last_min_pvalue == b.last_min_pvalue
    assert a.n_flags >= 1
    # compact: 20 x 64 float32 = 5120 bytes -> well under 10 kB of JSON
    assert len(json.dumps(a.state_dict())) < 10_000


@pytest.mark.parametrize("mutate, field", [
    (lambda s: s.update(kind="CusumDetector"), "state: not a InputKSDetector"),
    (lambda s: s["params"].update(alpha=1.5), "state.params.alpha"),
    (lambda s: s.update(gamma=-1.0), "state.gamma: must be >= 0"),
    (lambda s: s["reference"].update(zlib_b64="!!"), "state.reference.zlib_b64"),
    (lambda s: s["reference"].update(shape=[5, 3]), "state.reference: byte length"),
    (lambda s: s["reference"].update(shape=[300, 1]), "state.reference.shape: more rows"),
    (lambda s: s.update(reference=None), "state.reference: must be present"),
    (lambda s: s.update(n_flags=9), "state.n_flags: must be <="),
    (lambda s: s.update(last_min_pvalue=2.0), "state.last_min_pvalue"),
])
def test_a_bad_state_is_refused_naming_the_field(mutate, field):
    det = _ks()
    det.update(1.0, REF)
    det.update(1.0, CUR)
    state = json.loads(json.dumps(det.state_dict()))
    mutate(state)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        _ks().load_state_dict(state)


@pytest.mark.parametrize("kwargs, field", [
    ({"alpha": 0.0}, "alpha: Input should be greater than 0"),
    ({"alpha": 1.0}, "alpha: Input should be less than 1"),
    ({"reference_size": 1}, "reference_size: Input should be greater than or equal to 2"),
    ({"with_loss_threshold": "yes"}, "with_loss_threshold"),
    ({"summaries": 1}, "summaries"),
    ({"window": 3}, "window: Extra inputs are not permitted"),
])
def test_parameters_are_validated_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        InputKSDetector(0.5, **kwargs)
    with pytest.raises(ValueError, match="gamma: must be >= 0"):
        InputKSDetector(-0.1)


def test_defaults_are_the_documented_ones():
    p = InputKSParams()
    assert (p.alpha, p.reference_size, p.with_loss_threshold, p.summaries) == (
        0.01, 256, True, True)


# ----------------------------------------------------------------------------- spec, config


def test_spec_builds_it_and_restores_under_the_servers_parameters():
    spec = DetectorSpec.of("input_ks", {"alpha": 0.2})
    det = spec.build(0.75)
    assert isinstance(det, InputKSDetector) and det.gamma == 0.75 and det.params.alpha == 0.2
    det.update(1.0, REF)
    state = det.state_dict()
    again = DetectorSpec.of("input_ks", {"alpha": 0.03}).restore(state, 0.25)
    assert again.params.alpha == 0.03 and again.gamma == 0.25
    np.testing.assert_array_equal(again.reference, det.reference)
    assert DetectorSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match=r"drift\.input_ks\.reference_size"):
        DetectorSpec.of("input_ks", {"reference_size": 0})


def _with_drift(**drift):
    data = default_config().model_dump()
    data["drift"].update(drift)
    return validate_config(data)


def test_config_selects_input_ks_and_names_a_bad_parameter():
    cfg = _with_drift(detector="input_ks", input_ks={"alpha": 0.05, "reference_size": 64})
    spec = cfg.drift.detector_spec()
    assert spec.kind == "input_ks" and dict(spec.params) == {
        "alpha": 0.05, "reference_size": 64, "with_loss_threshold": True,
        "summaries": True}
    assert isinstance(spec.build(cfg.drift.gamma), InputKSDetector)
    with pytest.raises(ConfigError, match=r"drift\.input_ks\.alpha: Input should be less"):
        _with_drift(detector="input_ks", input_ks={"alpha": 2.0})
    with pytest.raises(ConfigError, match=r"drift\.input_ks\.seed: unknown field"):
        _with_drift(input_ks={"seed": 1})


# ----------------------------------------------------------------------------- device path


class _NoInputs:
    """A learner that trains but does not give its inputs."""

    def __init__(self, inner):
        self.inner = inner

    def fit(self, params, settings, round_number):
        f = self.inner.fit(params, settings, round_number)
        return LocalFit(f.params, f.pre_loss, f.n_samples)

    def predict(self, params, round_number):  # pragma: no cover - not used here
        return self.inner.predict(params, round_number)


def _cov_federation():
    from clma.sim.federation import build_federation

    data = default_config().model_dump()
    data["clients"], data["rounds"] = 8, 3
    data["drift"] = {"gamma": 0.5, "detector": "input_ks", "events": [
        {"round": 2, "kind": "rotation", "magnitude": 30.0, "family": "rot",
         "clients": [0, 1, 2]}]}
    data["training"]["local_epochs"] = 1
    cfg = validate_config(data)
    return cfg, build_federation(cfg)


def test_train_through_simulated_clients_retries_give_the_same_flags_and_no_inputs_fails():
    from clma.sim.clients import SimulatedClients

    cfg, fed = _cov_federation()
    clients = SimulatedClients(fed)
    clients.learners[5] = _NoInputs(clients.learners[5])
    settings = TrainSettings(local_epochs=1, learning_rate=0.1, batch_size=8,
                             drift_gamma=100.0, detector=cfg.drift.detector_spec())
    model = fed.initial_model
    assign = dict.fromkeys(fed.client_ids, 0)

    def ask(r):
        return clients.train(TrainRequest(r, assign, {0: model}, settings))

    first = ask(1)
    assert set(first.failed) == {5} and "ValueError" in first.failed[5]
    assert all(not u.drift_flag for u in first.ok.values())
    second = ask(2)
    flags = {c: u.drift_flag for c, u in second.ok.items()}
    again = {c: u.drift_flag for c, u in ask(2).ok.items()}  # the server retries round 2
    assert flags == again
    # gamma 100: only the input test can flag; the rotated clients 0-2 and nobody else
    assert {c for c, f in flags.items() if f} == {0, 1, 2}
    assert set(second.failed) == {5}


def test_the_device_error_names_drift_detector_and_leaves_the_history():
    cfg, fed = _cov_federation()
    from clma.sim.clients import SimLearner

    learner = _NoInputs(SimLearner(fed, fed.clients[3]))
    settings = TrainSettings(local_epochs=1, learning_rate=0.1, batch_size=8,
                             drift_gamma=0.5, detector=cfg.drift.detector_spec())
    history = RoundKeyedState()
    with pytest.raises(ValueError, match="drift.detector: input_ks needs the device's"):
        train_on_device(3, 0, fed.initial_model, settings, 1, learner, history)
    assert history.rounds == []


def test_the_torch_learner_gives_the_simulations_training_inputs():
    from clma.sim.clients import SimLearner
    from clma.sim.demo import digits_learner

    cfg, fed = _cov_federation()
    learner = digits_learner(cfg, 1)
    settings = TrainSettings(1, 0.1, 8, 0.5, detector=DetectorSpec.of("input_ks"))
    torch_fit = learner.fit(fed.initial_model, settings, 2)
    sim = SimLearner(fed, fed.clients[1])
    np.testing.assert_array_equal(torch_fit.inputs, sim.data(2)[0])  # the rotated rows
    assert torch_fit.inputs.dtype == np.float32
    # a loss-only detector: no copy of the inputs is made
    assert learner.fit(fed.initial_model, TrainSettings(1, 0.1, 8, 0.5), 2).inputs is None
    assert DetectorSpec.of("input_ks").needs_inputs and not DetectorSpec().needs_inputs
