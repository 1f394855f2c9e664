"""clma.device: the on-device rules every transport runs. The drift flag with round-keyed
detector state (a round asked again gives the same flag), the quantised report, and the
device's secure-aggregation state, which serialises mid-protocol (a device process that
does not live between steps) and unmasks each session at most once."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clma.device import DeviceSecAgg, LocalFit, quantised_report, train_on_device
from clma.drift import RoundKeyedState
from clma.engine import SecAggSession, ShareKeysRequest, TrainSettings
from clma.metrics import DeviceMetricLayout, compute_device_report
from clma.privacy.secagg import FixedPointQuantiser, SecAggAbort, SecAggConfig, SecAggServer

GAMMA = 0.5


class ScriptedLearner:
    """A LocalLearner whose received model has the scripted loss at each round."""

    def __init__(self, losses: dict[int, float]) -> None:
        self.losses = losses
        self.calls: list[int] = []

    def fit(self, params, settings, round_number):
        self.calls.append(round_number)
        return LocalFit((params + np.float32(round_number)).astype(np.float32),
                        self.losses[round_number], 17)

    def predict(self, params, round_number):  # pragma: no cover - not used here
        raise NotImplementedError


def _settings(gamma=GAMMA):
    return TrainSettings(local_epochs=1, learning_rate=0.1, batch_size=8, drift_gamma=gamma)


def _train(learner, history, r, gamma=GAMMA):
    return train_on_device(4, 2, np.zeros(3, np.float32), _settings(gamma), r, learner, history)


@pytest.mark.parametrize("rise, flag", [
    (GAMMA - 1e-9, False),  # below gamma
    (GAMMA, False),         # exactly gamma: the rule is strict
    (GAMMA + 1e-9, True),   # above gamma
    (-1.0, False),          # a fall never flags
])
def test_flag_is_a_rise_of_the_received_models_loss_beyond_gamma(rise, flag):
    history = RoundKeyedState()
    learner = ScriptedLearner({1: 1.0, 2: 1.0 + rise})
    first = _train(learner, history, 1)
    assert first.drift_flag is False  # the first observation never flags
    u = _train(learner, history, 2)
    assert u.drift_flag is flag
    assert (u.client_id, u.cohort_id, u.n_samples) == (4, 2, 17)
    assert u.params.dtype == np.float32 and u.params.tolist() == [2.0, 2.0, 2.0]
    assert history.before(3)["previous_loss"] == 1.0 + rise  # the loss stays on the device
    assert not hasattr(u, "loss") and not hasattr(u, "pre_loss")


def test_asking_the_same_round_again_gives_the_same_flag():
    history = RoundKeyedState()
    learner = ScriptedLearner({1: 1.0, 2: 2.0, 3: 2.1})
    flags = [_train(learner, history, r).drift_flag for r in (1, 2, 3)]
    assert flags == [False, True, False]
    # the server crashed after round 2 and asks rounds 2 and 3 again: same flags, because
    # round 2 starts again from round 1's state (not from its own first attempt's)
    assert [_train(learner, history, r).drift_flag for r in (2, 2, 3, 3)] == [True, True,
                                                                               False, False]
    assert history.before(4)["n_updates"] == 3  # one update per round, not per attempt
    # a plain detector fed every attempt would have changed the flag of the re-run
    from clma.drift import LossThresholdDetector

    plain = LossThresholdDetector(GAMMA)
    assert [plain.update(x) for x in (1.0, 2.0, 2.0)] == [False, True, False]


def test_detector_state_survives_a_json_round_trip_between_rounds():
    learner = ScriptedLearner({1: 1.0, 2: 1.2, 3: 2.0, 4: 2.1})
    kept = RoundKeyedState()
    flags_kept = [_train(learner, kept, r).drift_flag for r in (1, 2, 3, 4)]
    moved = RoundKeyedState()
    flags_moved = []
    for r in (1, 2, 3, 4):  # the device stores its state as JSON after every round
        flags_moved.append(_train(learner, moved, r).drift_flag)
        moved = RoundKeyedState.from_dict(json.loads(json.dumps(moved.to_dict())))
    assert flags_moved == flags_kept == [False, False, True, False]
    assert moved.to_dict() == kept.to_dict()


def test_gamma_comes_from_the_servers_settings_each_round():
    history = RoundKeyedState()
    learner = ScriptedLearner({1: 1.0, 2: 1.3})
    _train(learner, history, 1, gamma=0.5)
    assert _train(learner, history, 2, gamma=0.2).drift_flag is True
    assert history.before(3)["gamma"] == 0.2


def test_quantised_report_is_the_clipped_device_report_on_the_fixed_point_grid():
    rng = np.random.default_rng(0)
    proba = rng.dirichlet(np.ones(10), size=40)
    labels = rng.integers(0, 10, size=40)
    layout = DeviceMetricLayout(l_max=2.0, version="test")
    q = quantised_report(proba, labels, layout, 2**16 - 1)
    assert q.dtype == np.uint64 and q.shape == (32,) and q.max() <= 2**16 - 1
    rep = compute_device_report(proba, labels, layout).vector
    quant = FixedPointQuantiser(layout.lower_bounds(), layout.upper_bounds(), 2**16 - 1)
    np.testing.assert_array_equal(q, quant.quantise(rep))
    # de-quantised, it is the report within half a grid step per coordinate
    step = (layout.upper_bounds() - layout.lower_bounds()) / (2**16 - 1)
    assert np.all(np.abs(quant.dequantise_sum(q, 1) - rep) <= step / 2 + 1e-12)


# ----------------------------------------------------------------- secure aggregation

MEMBERS = (3, 5, 8, 11, 12)
DIM = 32


def _sessions():
    """Two sessions of one round: all five devices, and a complete group of four."""
    out = {}
    for name, members, t in (("eval-1-global", MEMBERS, 3), ("eval-1-north", MEMBERS[:4], 3)):
        cfg = SecAggConfig(n_clients=len(members), threshold=t, vector_length=DIM,
                           round_id=name, graph_seed=7)
        out[name] = SecAggSession(name, cfg, members)
    return out


def _inputs():
    rng = np.random.default_rng(1)
    return {c: rng.integers(0, 2**16, size=DIM).astype(np.uint64) for c in MEMBERS}


def _run(serialise: bool, drop_before_masked=()):
    """The four protocol steps, server side with SecAggServer; with ``serialise`` every
    device lives only as its JSON state between steps."""
    sessions, inputs = _sessions(), _inputs()
    servers = {s: SecAggServer(sess.config, sess.members) for s, sess in sessions.items()}
    devices = {c: DeviceSecAgg(c, 1) for c in MEMBERS}

    def hop():
        nonlocal devices
        if serialise:
            blobs = {c: d.to_json() for c, d in devices.items()}
            for b in blobs.values():  # the state holds everything: to_dict is stable
                assert DeviceSecAgg.from_json(b).to_json() == b
            devices = {c: DeviceSecAgg.from_json(b) for c, b in blobs.items()}

    adv = {c: d.advertise(inputs[c], {s: x for s, x in sessions.items() if c in x.members})
           for c, d in devices.items()}
    hop()
    rosters = {s: servers[s].collect_advertisements([adv[c][s] for c in sess.members])
               for s, sess in sessions.items()}
    shares = {c: devices[c].share_keys({s: ShareKeysRequest(rosters[s][c],
                                                            tuple(servers[s].neighbours[c]))
                                        for s, sess in sessions.items() if c in sess.members})
              for c in MEMBERS}
    hop()
    boxes = {s: servers[s].route_shares([shares[c][s] for c in sess.members])
             for s, sess in sessions.items()}
    live = [c for c in MEMBERS if c not in drop_before_masked]
    masked = {c: devices[c].masked_input({s: boxes[s][c] for s in sessions if c in boxes[s]})
              for c in live}
    hop()
    reqs = {s: servers[s].collect_masked_inputs([masked[c][s] for c in live
                                                 if s in masked[c]]) for s in sessions}
    responses = {c: devices[c].unmask({s: r for s, r in reqs.items() if c in r.survivors})
                 for c in live}
    sums = {s: servers[s].finalize([responses[c][s] for c in live if s in responses[c]])
            for s in sessions}
    return sessions, inputs, devices, sums, reqs


@pytest.mark.parametrize("serialise", [False, True])
def test_serialised_device_state_gives_the_same_sums(serialise):
    sessions, inputs, _, sums, _ = _run(serialise)
    for s, sess in sessions.items():
        exact = sum(inputs[c] for c in sess.members) & np.uint64(2**32 - 1)
        np.testing.assert_array_equal(sums[s].sum_quantised, exact)
        assert sums[s].contributors == len(sess.members)


def test_serialised_state_recovers_a_dropout_mid_protocol():
    sessions, inputs, _, sums, _ = _run(True, drop_before_masked=(5,))
    for s, sess in sessions.items():
        kept = [c for c in sess.members if c != 5]
        np.testing.assert_array_equal(sums[s].sum_quantised,
                                      sum(inputs[c] for c in kept) & np.uint64(2**32 - 1))
        assert sums[s].dropped == (5,)


def test_the_serialised_state_holds_the_secrets_only_as_the_device_keeps_them():
    dev = DeviceSecAgg(3, 1)
    sess = _sessions()
    keys = dev.advertise(_inputs()[3], sess)
    data = dev.to_dict()
    assert (data["client_id"], data["round"], sorted(data["sessions"])) == (3, 1, sorted(sess))
    back = DeviceSecAgg.from_dict(json.loads(json.dumps(data)))
    for s in sess:  # same key pairs: the restored device advertises the same public keys
        again = back.sessions[s].advertise()
        assert (again.c_pk, again.s_pk) == (keys[s].c_pk, keys[s].s_pk)
        np.testing.assert_array_equal(back.inputs[s], dev.inputs[s])
        assert back.inputs[s].dtype == np.uint64


def test_unmasking_a_session_twice_is_refused_also_after_a_round_trip():
    sessions, _, devices, _, reqs = _run(True)
    dev = devices[3]
    assert dev.unmasked == set(sessions) and dev.sessions == {} and dev.inputs == {}
    for d in (dev, DeviceSecAgg.from_json(dev.to_json())):
        for s in sessions:
            with pytest.raises(SecAggAbort, match="already answered"):
                d.unmask({s: reqs[s]})
    # a session the device is not in is ignored (nothing to answer)
    assert DeviceSecAgg(99, 1).unmask({"eval-1-global": reqs["eval-1-global"]}) == {}


@pytest.mark.parametrize("kind", ["cusum", "page_hinkley", "adwin"])
def test_the_device_runs_the_detector_the_settings_name(kind):
    from clma.drift import DetectorSpec

    spec = DetectorSpec.of(kind, {"min_scale": 0.5} if kind == "cusum" else {})
    settings = TrainSettings(local_epochs=1, learning_rate=0.1, batch_size=8,
                             drift_gamma=GAMMA, detector=spec)
    losses = [2.3, 1.0, 1.0, 1.0, 1.02, 0.98, 3.5, 3.4, 1.0]
    learner = ScriptedLearner(dict(enumerate(losses, start=1)))
    history = RoundKeyedState()
    flags = [train_on_device(4, 2, np.zeros(3, np.float32), settings, r, learner,
                             history).drift_flag for r in range(1, len(losses) + 1)]
    direct = spec.build(GAMMA)
    assert flags == [direct.update(x) for x in losses]
    if kind != "adwin":  # ADWIN needs longer series (tests/clma/test_drift_sequential.py)
        assert flags[6] is True and sum(flags) == 1
    # a round asked again starts from the previous round's state: the same flag
    again = train_on_device(4, 2, np.zeros(3, np.float32), settings, 7, learner, history)
    assert again.drift_flag is flags[6]
    assert history.before(8)["kind"] == type(direct).__name__
