"""clma.sim.federation: building the simulated world (clients' data, regions, the drift
schedule as a function of the round, the server's public assets); its devices trained and
evaluated through clma.sim.clients.SimulatedClients (the in-process transport)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from clma.config import validate_config
from clma.datasets.builtin import holdout_split, load_digits
from clma.engine import ServerState, TrainRequest, TrainSettings
from clma.rounds import fedavg
from clma.sim.clients import SimLearner, SimulatedClients
from clma.sim.federation import build_federation
from clma.sim.training import mean_loss, predict_proba

CFG = validate_config({
    "name": "fed-test", "seed": 4, "rounds": 3, "clients": 10,
    "data": {"probe_size": 64},
    "model": {"hidden": [32]},
    "training": {"local_epochs": 3},
})


@pytest.fixture(scope="module")
def fed():
    return build_federation(CFG)


def _rows(x):
    return Counter(r.tobytes() for r in x.reshape(x.shape[0], -1))


def test_clients_regions_and_local_splits(fed):
    assert fed.client_ids == list(range(10))
    assert fed.dataset_name == "digits" and fed.spec.n_features == 64
    counts = Counter(cl.region for cl in fed.clients.values())
    assert dict(counts) == {k: v for k, v in fed.partition.region_sizes(10).items() if v}
    assert fed.region_of() == fed.partition.assign(10, CFG.seed)
    for cl in fed.clients.values():
        n_tr, n_ev = cl.train_y.shape[0], cl.eval_y.shape[0]
        assert n_tr > 0 and n_ev > 0
        assert n_ev == round(0.25 * (n_tr + n_ev))
        assert cl.train_x.shape == (n_tr, 1, 8, 8) and cl.train_x.dtype == np.float32
        assert cl.train_y.dtype == np.int64 and cl.drifts == []
    # the server's public assets: architecture, initial model, probe set, partition
    assets = fed.assets()
    assert assets.initial_model is fed.initial_model and assets.probe_x is fed.probe_x
    assert assets.partition is fed.partition and assets.dataset_name == "digits"
    assert fed.initial_model.dtype == np.float32
    assert assets.n_params == fed.initial_model.shape[0] == sum(
        p.numel() for p in fed.spec.build().state_dict().values())
    # a fresh server: everyone in root cohort 0, whose model is the initial model
    state = ServerState.fresh(fed.client_ids, assets.initial_model)
    assert state.registry.active_cohorts() == [0]
    np.testing.assert_array_equal(state.cohort_models[0], fed.initial_model)


def test_heldout_disjoint_from_clients_and_each_other(fed):
    ds = load_digits()
    split = holdout_split(ds.labels, holdout_fraction=0.2, probe_size=64, seed=CFG.seed)
    np.testing.assert_array_equal(fed.probe_indices, split.probe)
    assert not set(split.probe) & set(split.test)
    np.testing.assert_array_equal(fed.probe_x, ds.images[split.probe])
    np.testing.assert_array_equal(fed.test_x, ds.images[split.test])
    np.testing.assert_array_equal(fed.test_y, ds.labels[split.test])
    # the clients' data are exactly the pool (as a multiset of images), so none of the
    # held-out samples is on a client
    client_x = np.concatenate([np.concatenate([c.train_x, c.eval_x])
                               for c in fed.clients.values()])
    assert _rows(client_x) == _rows(ds.images[split.pool])
    client_y = np.concatenate([np.concatenate([c.train_y, c.eval_y])
                               for c in fed.clients.values()])
    assert Counter(client_y.tolist()) == Counter(ds.labels[split.pool].tolist())


def test_same_config_same_federation(fed):
    again = build_federation(CFG)
    np.testing.assert_array_equal(again.initial_model, fed.initial_model)
    for c in fed.client_ids:
        a, b = fed.clients[c], again.clients[c]
        assert a.region == b.region
        for x, y in ((a.train_x, b.train_x), (a.train_y, b.train_y), (a.eval_x, b.eval_x),
                     (a.eval_y, b.eval_y)):
            np.testing.assert_array_equal(x, y)
    other = build_federation(CFG.with_overrides(seed=5))
    assert not np.array_equal(other.clients[0].train_y, fed.clients[0].train_y)


def test_dirichlet_federation_builds():
    cfg = CFG.model_copy(update={"data": CFG.data.model_copy(
        update={"partition": "dirichlet", "dirichlet_alpha": 0.3})})
    f = build_federation(cfg)
    sizes = [c.train_y.shape[0] + c.eval_y.shape[0] for c in f.clients.values()]
    assert sum(sizes) == 1797 - 360 and min(sizes) >= 8


def test_drift_is_a_function_of_the_round():
    cfg = validate_config({"clients": 4, "rounds": 3, "data": {"probe_size": 32},
                           "drift": {"events": [
                               {"round": 2, "kind": "label_rotation", "shift": 2,
                                "family": "p", "clients": [1, 3]},
                               {"round": 3, "kind": "gaussian_noise", "magnitude": 0.2,
                                "family": "n", "clients": [1]}]}})
    f = build_federation(cfg)
    assert f.drifted_at(1) == {} and f.drifts_for(1, 1) == []
    assert f.drifted_at(2) == {1: "p", 3: "p"}
    assert f.drifted_clients(2) == [1, 3] and f.stationary_clients(2) == [0, 2]
    assert f.drifted_clients(1) == [] and f.stationary_clients(1) == [0, 1, 2, 3]
    learner = SimLearner(f, f.clients[1])
    tx, ty, ex, ey = learner.data(2)
    np.testing.assert_array_equal(ty, (f.clients[1].train_y + 2) % 10)
    np.testing.assert_array_equal(ey, (f.clients[1].eval_y + 2) % 10)
    np.testing.assert_array_equal(tx, f.clients[1].train_x)
    assert f.drifted_at(3) == {1: "n"}
    assert [d.family for d in f.drifts_for(1, 3)] == ["p", "n"]
    assert [d.family for d in f.drifts_for(1, 99)] == ["p", "n"]
    tx3, ty3, _, _ = learner.data(3)
    assert not np.array_equal(tx3, f.clients[1].train_x)
    np.testing.assert_array_equal(ty3, ty)
    np.testing.assert_array_equal(tx3, SimLearner(f, f.clients[1]).data(3)[0])  # fixed noise
    # data of an earlier round are that round's, also after a later one was asked
    np.testing.assert_array_equal(learner.data(1)[1], f.clients[1].train_y)
    # the world is not changed by asking: the clients' own data carry no drift
    assert all(cl.drifts == [] for cl in f.clients.values())


SETTINGS = TrainSettings(local_epochs=CFG.training.local_epochs,
                         learning_rate=CFG.training.learning_rate,
                         batch_size=CFG.training.batch_size, drift_gamma=CFG.drift.gamma)


def _train(clients, ids, model, round_number, settings=SETTINGS):
    req = TrainRequest(round_number, dict.fromkeys(ids, 0), {0: model}, settings)
    out = clients.train(req)
    assert out.failed == {} and sorted(out.ok) == sorted(ids)
    return out.ok


def test_detector_flags_rotated_client_not_stationary():
    cfg = validate_config({**CFG.model_dump(mode="json"), "drift": {"events": [
        {"round": 3, "kind": "label_rotation", "shift": 3, "family": "p", "clients": [0]}]}})
    fed = build_federation(cfg)
    clients = SimulatedClients(fed)
    ids = [0, 1, 2, 3, 4, 5]
    model = fed.initial_model
    for rnd in (1, 2):
        res = _train(clients, ids, model, rnd)
        assert not any(u.drift_flag for u in res.values())  # falling losses never flag
        model = fedavg([res[c].params for c in ids], [res[c].n_samples for c in ids])
    prev = {c: clients.store.load(c).before(3)["previous_loss"] for c in ids}
    res = _train(clients, ids, model, 3)
    flags = {c: u.drift_flag for c, u in res.items()}
    assert flags == {0: True, 1: False, 2: False, 3: False, 4: False, 5: False}
    for c in ids:
        tx, ty, _, _ = clients.learners[c].data(3)
        state = clients.store.load(c).before(4)
        loss = state["previous_loss"]
        # the detector saw the received model's loss on the current data, before training
        assert loss == pytest.approx(mean_loss(fed.spec, model, tx, ty), abs=1e-5)
        assert (loss - prev[c] > cfg.drift.gamma) == (c == 0)
        assert state["n_flags"] == (c == 0) and state["n_updates"] == 3
    upd = res[0]
    assert upd.n_samples == fed.clients[0].train_y.shape[0] and upd.cohort_id == 0
    assert upd.params.dtype == np.float32 and upd.params.shape == model.shape


def test_training_is_bit_identical_on_same_inputs():
    fed = build_federation(CFG)
    a = _train(SimulatedClients(fed), [2, 7], fed.initial_model, 1)
    other = SimulatedClients(build_federation(CFG))
    req = TrainRequest(1, {7: 0, 2: 0}, {0: fed.initial_model}, SETTINGS)  # other order
    b = other.train(req).ok
    for c in (2, 7):
        assert a[c].params.tobytes() == b[c].params.tobytes()
        assert a[c].n_samples == b[c].n_samples and a[c].drift_flag == b[c].drift_flag
    assert not np.array_equal(a[2].params, fed.initial_model)  # it trained
    c = _train(SimulatedClients(fed), [2, 7], fed.initial_model, 2)
    assert c[2].params.tobytes() != a[2].params.tobytes()  # round seeds order


def test_ground_truth_values_and_clipping(fed):
    ids = [0, 1, 2]
    clients = SimulatedClients(fed)
    model = fed.initial_model
    ev = clients.truth(1, dict.fromkeys(ids, 0), {0: model}, loss_max=50.0)
    for e, c in zip(ev, ids, strict=True):
        cl = fed.clients[c]
        assert (e.client_id, e.region, e.cohort_id) == (c, cl.region, 0)
        assert e.n_eval == cl.eval_y.shape[0]
        assert e.loss == pytest.approx(mean_loss(fed.spec, model, cl.eval_x, cl.eval_y),
                                       abs=1e-5)
        proba = predict_proba(fed.spec, model, cl.eval_x)
        assert e.accuracy == float((proba.argmax(1) == cl.eval_y).mean())
        assert e.probabilities is None and e.labels is None  # truth keeps no raw outputs
    # clipped to loss_max: a blown-up model has losses far above 1.0
    big = model * 40.0
    clipped = clients.truth(1, dict.fromkeys(ids, 0), {0: big}, loss_max=1.0)
    raw = [mean_loss(fed.spec, big, fed.clients[c].eval_x, fed.clients[c].eval_y) for c in ids]
    assert min(raw) > 1.0
    assert [e.loss for e in clipped] == [1.0, 1.0, 1.0]
    for e in clipped:
        assert 0.0 <= e.accuracy <= 1.0
    # each client evaluates its own cohort's model
    two = clients.truth(1, {0: 0, 1: 5}, {0: model, 5: big}, loss_max=50.0)
    assert [e.cohort_id for e in two] == [0, 5]
    assert two[0].loss == ev[0].loss
    assert two[1].loss > 1.0 and two[1].accuracy == clipped[1].accuracy  # cohort 5's model


@pytest.mark.parametrize("shift", [10, -20])
def test_label_rotation_by_a_multiple_of_the_classes_is_rejected(shift):
    from clma.config import validate_config
    from clma.sim.federation import build_federation

    cfg = validate_config({"clients": 6, "drift": {"events": [
        {"round": 2, "kind": "label_rotation", "shift": shift, "clients": [0], "family": "f"}]}})
    with pytest.raises(ValueError, match=r"drift.events\[0\].shift: .* changes no label"):
        build_federation(cfg)
