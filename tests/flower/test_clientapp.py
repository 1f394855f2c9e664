"""The CLMA ClientApp's handlers, driven with Messages built here (no SuperLink): training
with the detector state kept on the node, the secure-aggregation steps answered once per
round (a repeated request gets the same reply, another version is refused), state carried
across Flower runs through the node's own folder, and clear error replies to bad
messages after which the node keeps answering."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from clma.engine.clients import (
    ReportRequest,
    SecAggSession,
    ShareKeysRequest,
    TrainRequest,
    TrainSettings,
)
from clma.flower import codec
from clma.flower.clientapp import BAD_REQUEST, REFUSED, STATE_KEY, DeviceState, make_client_app
from clma.flower.device_data import DEMO_SOURCE
from clma.metrics import DeviceMetricLayout
from clma.privacy.secagg import FixedPointQuantiser, SecAggConfig, SecAggServer
from clma.sim.clients import SimulatedClients
from clma.sim.federation import build_federation

from .conftest import tiny_config


@pytest.fixture(scope="module")
def world():
    import torch

    torch.set_num_threads(1)
    cfg = tiny_config()
    return cfg, build_federation(cfg)


def _ctx(cfg, pid, state_dir=None):
    node = {"partition-id": pid, "data-source": DEMO_SOURCE}
    if state_dir is not None:
        node["state-dir"] = str(state_dir)
    return Context(run_id=7, node_id=100 + pid, node_config=node, state=RecordDict(),
                   run_config={"config-json": cfg.model_dump_json()})


def _msg(content, call, node):
    m = Message(content=content, dst_node_id=node, message_type=codec.MESSAGE_TYPES[call])
    m.metadata.__dict__["_message_id"] = f"m-{call}-{node}-{id(content)}"
    return m


def _settings(cfg):
    t = cfg.training
    return TrainSettings(t.local_epochs, t.learning_rate, t.batch_size, cfg.drift.gamma)


def test_roster_and_training_keep_the_detector_on_the_node(run_id, world):
    cfg, fed = world
    app, ctx = make_client_app(), _ctx(cfg, 2)
    r = app(_msg(codec.encode_roster_request(), "roster", 102), ctx)
    assert codec.decode_roster_reply(r.content, cfg.clients) == 2
    sim = SimulatedClients(fed, client_ids=[2])
    flags, model, models = [], fed.initial_model, {}
    for rnd in (1, 2, 3):  # the node's own update comes back as its next model
        models[rnd] = model
        req = TrainRequest(rnd, {2: 0}, {0: model}, _settings(cfg))
        reply = app(_msg(codec.encode_train_request(req, 2), "train", 102), ctx)
        got = codec.decode_train_reply(reply.content, round_number=rnd, client_id=2,
                                       cohort_id=0, n_params=fed.initial_model.shape[0])
        want = sim.train(req).ok[2]
        np.testing.assert_array_equal(got.params, want.params)  # the simulation's device
        assert (got.n_samples, got.drift_flag) == (want.n_samples, want.drift_flag)
        flags.append(got.drift_flag)
        model = got.params
        assert set(reply.content.keys()) == {"clma", "arrays", "metrics"}  # no loss sent
    assert flags == [False, False, True]  # client 2 is label-rotated at round 3
    state = DeviceState.load(ctx)
    assert state.detector.rounds == [1, 2, 3]
    # round 3 asked again (server retry): same flag, from the state before round 3
    req = TrainRequest(3, {2: 0}, {0: models[3]}, _settings(cfg))
    again = app(_msg(codec.encode_train_request(req, 2), "train", 102), ctx)
    assert again.content["metrics"]["drift-flag"] == 1


def test_the_input_ks_detector_runs_on_the_node_as_in_the_simulation(run_id, world):
    from clma.drift import DetectorSpec

    cfg, fed = world
    app, ctx = make_client_app(), _ctx(cfg, 2)
    sim = SimulatedClients(fed, client_ids=[2])
    t = cfg.training
    settings = TrainSettings(t.local_epochs, t.learning_rate, t.batch_size, cfg.drift.gamma,
                             detector=DetectorSpec.of("input_ks"))
    flags, model = [], fed.initial_model
    for rnd in (1, 2, 3):
        req = TrainRequest(rnd, {2: 0}, {0: model}, settings)
        reply = app(_msg(codec.encode_train_request(req, 2), "train", 102), ctx)
        got = codec.decode_train_reply(reply.content, round_number=rnd, client_id=2,
                                       cohort_id=0, n_params=fed.initial_model.shape[0])
        want = sim.train(req).ok[2]
        assert (got.n_samples, got.drift_flag) == (want.n_samples, want.drift_flag)
        assert set(reply.content.keys()) == {"clma", "arrays", "metrics"}  # no inputs sent
        flags.append(got.drift_flag)
        model = got.params
    # label rotation at round 3: the inputs are unchanged, the loss-threshold part flags
    assert flags == [False, False, True]
    node = DeviceState.load(ctx).detector.before(4)
    assert node["kind"] == "InputKSDetector" and node["reference"]["dtype"] == "float32"
    assert node == sim.store.load(2).before(4)


def test_the_paired_loss_detector_keeps_its_model_in_the_node_state(run_id, world):
    """The node keeps the model it received in its own state (never sent) and flags as the
    simulated device does; a worse model of unchanged records does not flag."""
    from clma.drift import DetectorSpec

    cfg, fed = world
    app, ctx = make_client_app(), _ctx(cfg, 2)
    sim = SimulatedClients(fed, client_ids=[2])
    t = cfg.training
    settings = TrainSettings(t.local_epochs, t.learning_rate, t.batch_size, cfg.drift.gamma,
                             detector=DetectorSpec.of("paired_loss"))
    plain = TrainSettings(t.local_epochs, t.learning_rate, t.batch_size, cfg.drift.gamma)
    trained = sim.train(TrainRequest(1, {2: 0}, {0: fed.initial_model}, plain)).ok[2].params
    # round 1 receives a trained model, round 2 the untrained one (far worse on the same
    # records: the loss threshold flags it, sim_plain below)
    sim_plain = SimulatedClients(fed, client_ids=[2])
    flags = []
    for rnd, model in ((1, trained), (2, fed.initial_model)):
        req = TrainRequest(rnd, {2: 0}, {0: model}, settings)
        reply = app(_msg(codec.encode_train_request(req, 2), "train", 102), ctx)
        got = codec.decode_train_reply(reply.content, round_number=rnd, client_id=2,
                                       cohort_id=0, n_params=fed.initial_model.shape[0])
        assert got.drift_flag == sim.train(req).ok[2].drift_flag
        assert set(reply.content.keys()) == {"clma", "arrays", "metrics"}
        flags.append(got.drift_flag)
        plain_flag = sim_plain.train(TrainRequest(rnd, {2: 0}, {0: model}, plain)).ok[2]
    assert flags == [False, False] and plain_flag.drift_flag
    node = DeviceState.load(ctx).detector.before(3)
    assert node["kind"] == "PairedLossDetector" and node["n_model_changes"] == 1
    assert node["previous_model"]["shape"] == [fed.initial_model.shape[0]]
    assert node == sim.store.load(2).before(3)


def test_bad_messages_get_error_replies_and_the_node_keeps_answering(run_id, world):
    cfg, fed = world
    app, ctx = make_client_app(), _ctx(cfg, 1)
    req = TrainRequest(1, {1: 0}, {0: fed.initial_model}, _settings(cfg))
    bad = codec.encode_train_request(req, 1)
    bad["clma"]["round"] = 0
    r = app(_msg(bad, "train", 101), ctx)
    assert r.has_error() and r.error.code == BAD_REQUEST
    assert r.error.reason == "clma: train: bad request: clma.round: must be in [1, 2147483647]"
    other = codec.encode_train_request(TrainRequest(1, {4: 0}, {0: fed.initial_model},
                                                    _settings(cfg)), 4)
    r = app(_msg(other, "train", 101), ctx)
    assert r.has_error() and r.error.code == REFUSED and "another client" in r.error.reason
    garbage = RecordDict({"clma": ConfigRecord({"schema": "x"})})
    for call in codec.CALLS:
        r = app(_msg(garbage, call, 101), ctx)
        assert r.has_error() and r.error.code == BAD_REQUEST, call
    step = codec.encode_step_request("secagg_unmask", 1, 1, {})
    r = app(_msg(step, "secagg_unmask", 101), ctx)
    assert r.error.code == REFUSED and "advertise first" in r.error.reason
    ok = app(_msg(codec.encode_train_request(req, 1), "train", 101), ctx)
    assert not ok.has_error()  # still answering
    nopid = Context(run_id=7, node_id=9, node_config={}, state=RecordDict(), run_config={})
    r = app(_msg(codec.encode_roster_request(), "roster", 9), nopid)
    assert r.error.code == REFUSED and "partition-id" in r.error.reason


def _report_request(cfg, fed, rnd=2, members=(0, 1, 2, 3)):
    n = len(members)
    scfg = SecAggConfig(n_clients=n, threshold=3, vector_length=32, round_id=f"eval-{rnd}-global")
    return ReportRequest(rnd, {c: 0 for c in members}, {0: fed.initial_model},
                         DeviceMetricLayout(), 2**16 - 1,
                         {scfg.round_id: SecAggSession(scfg.round_id, scfg, tuple(members))})


def test_secure_aggregation_through_the_handlers_sums_the_clipped_reports(run_id, world, tmp_path):
    cfg, fed = world
    app = make_client_app()
    members = (0, 1, 2, 3)
    ctxs = {c: _ctx(cfg, c, tmp_path / f"node{c}") for c in members}
    req = _report_request(cfg, fed)
    sid = next(iter(req.sessions))
    server = SecAggServer(req.sessions[sid].config, list(members))

    def ask(call, c, content):
        r = app(_msg(content, call, 100 + c), ctxs[c])
        assert not r.has_error(), r.error.reason if r.has_error() else None
        return r

    adv = {c: codec.decode_step_reply("secagg_advertise", ask(
        "secagg_advertise", c, codec.encode_report_request(req, c)).content,
        round_number=2, client_id=c, sessions=[sid])[sid] for c in members}
    rosters = server.collect_advertisements(list(adv.values()))
    # the same advertise asked again: the same keys (a resumed server), never new ones
    again = ask("secagg_advertise", 0, codec.encode_report_request(req, 0))
    assert codec.decode_step_reply("secagg_advertise", again.content, round_number=2,
                                   client_id=0, sessions=[sid])[sid] == adv[0]

    def step(call, c, item):
        r = ask(call, c, codec.encode_step_request(call, 2, c, {sid: item}))
        return codec.decode_step_reply(call, r.content, round_number=2, client_id=c,
                                       sessions=[sid])[sid]

    shares = {c: step("secagg_share_keys", c, ShareKeysRequest(rosters[c], tuple(
        server.neighbours[c]))) for c in members}
    inbox = server.route_shares(list(shares.values()))
    # a new Flower run: empty context.state, the node's own folder carries the secrets
    ctxs[3] = _ctx(cfg, 3, tmp_path / "node3")
    masked = {c: step("secagg_masked_input", c, inbox[c]) for c in (0, 1, 3)}  # 2 drops out
    unmask = server.collect_masked_inputs(list(masked.values()))
    responses = [step("secagg_unmask", c, unmask) for c in (0, 1, 3)]
    result = server.finalize(responses)
    # the sum is the survivors' clipped, quantised reports (computed here on their data)
    sim = SimulatedClients(fed)
    quant = FixedPointQuantiser(DeviceMetricLayout().lower_bounds(),
                                DeviceMetricLayout().upper_bounds(), 2**16 - 1)
    from clma.device import quantised_report

    want = np.zeros(32, dtype=np.uint64)
    for c in (0, 1, 3):
        p, y = sim.learners[c].predict(fed.initial_model, 2)
        want += quantised_report(p, y, DeviceMetricLayout(), 2**16 - 1)
    np.testing.assert_array_equal(result.sum_quantised, want)
    assert result.contributors == 3 and quant.dim == 32
    # unmasking asked again: the same reply; another survivor set: refused
    rep = ask("secagg_unmask", 0, codec.encode_step_request("secagg_unmask", 2, 0, {sid: unmask}))
    assert codec.decode_step_reply("secagg_unmask", rep.content, round_number=2, client_id=0,
                                   sessions=[sid])[sid] == responses[0]
    from clma.privacy.secagg import UnmaskingRequest

    other = UnmaskingRequest(frozenset({0, 1}), frozenset({2, 3}))
    r = app(_msg(codec.encode_step_request("secagg_unmask", 2, 0, {sid: other}),
                 "secagg_unmask", 100), ctxs[0])
    assert r.error.code == REFUSED and "already answered another request" in r.error.reason
    # the same round's advertise with other sessions is refused (no second key set)
    other_req = _report_request(cfg, fed, members=(0, 1, 3))
    r = app(_msg(codec.encode_report_request(other_req, 0), "secagg_advertise", 100), ctxs[0])
    assert r.error.code == REFUSED
    # nothing secret in any reply; secrets only in the node's state
    assert STATE_KEY in ctxs[0].state and "secagg" in ctxs[0].state[STATE_KEY]["json"]


def test_the_digits_learner_is_the_simulations_device_with_or_without_its_cache(world, tmp_path):
    cfg, fed = world
    from clma.sim.clients import SimLearner
    from clma.sim.demo import digits_learner

    for attempt in ("built", "cached"):
        learner = digits_learner(cfg, 3, cache_dir=tmp_path)
        assert len(list(tmp_path.glob("digits-shard-*.npz"))) == 1
        for rnd in (1, 3):  # before and after client 3's label rotation
            want = SimLearner(fed, fed.clients[3]).fit(fed.initial_model, _settings(cfg), rnd)
            got = learner.fit(fed.initial_model, _settings(cfg), rnd)
            np.testing.assert_array_equal(got.params, want.params)
            assert (got.pre_loss, got.n_samples) == (want.pre_loss, want.n_samples), attempt
            p1, y1 = SimLearner(fed, fed.clients[3]).predict(fed.initial_model, rnd)
            p2, y2 = learner.predict(fed.initial_model, rnd)
            np.testing.assert_array_equal(p1, p2)
            np.testing.assert_array_equal(y1, y2)
    with pytest.raises(ValueError, match="partition-id: must be in"):
        digits_learner(cfg, cfg.clients)
