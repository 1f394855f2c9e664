"""clma.sim.federation: building the simulated federation, on-device training and evaluation."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from clma.config import validate_config
from clma.rounds import fedavg
from clma.sim.data import holdout_split, load_digits
from clma.sim.drift import AppliedDrift
from clma.sim.federation import build_federation, evaluate_clients, train_clients
from clma.sim.training import mean_loss

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
    # registry: everyone in the root cohort, whose model is the initial model
    assert fed.registry.active_cohorts() == [0]
    np.testing.assert_array_equal(fed.cohort_models[0], fed.initial_model)
    assert fed.initial_model.dtype == np.float32


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


def test_inject_drift_follows_schedule():
    cfg = validate_config({"clients": 4, "rounds": 3, "data": {"probe_size": 32},
                           "drift": {"events": [
                               {"round": 2, "kind": "label_rotation", "shift": 2,
                                "family": "p", "clients": [1, 3]},
                               {"round": 3, "kind": "gaussian_noise", "magnitude": 0.2,
                                "family": "n", "clients": [1]}]}})
    f = build_federation(cfg)
    assert f.inject_drift(1) == {}
    assert f.inject_drift(2) == {1: "p", 3: "p"}
    assert f.drifted_clients() == [1, 3] and f.stationary_clients() == [0, 2]
    tx, ty, ex, ey = f.clients[1].current()
    np.testing.assert_array_equal(ty, (f.clients[1].train_y + 2) % 10)
    np.testing.assert_array_equal(ey, (f.clients[1].eval_y + 2) % 10)
    np.testing.assert_array_equal(tx, f.clients[1].train_x)
    assert f.inject_drift(3) == {1: "n"}
    assert f.clients[1].families == ["p", "n"]
    tx2, _, _, _ = f.clients[1].current()
    assert not np.array_equal(tx2, f.clients[1].train_x)
    np.testing.assert_array_equal(tx2, f.clients[1].current()[0])  # fixed noise draw


def _round(fed, clients, models, cohort_of, round_number):
    res = train_clients(clients, models, cohort_of, fed.spec, CFG.training, CFG.drift.gamma,
                        CFG.seed, round_number)
    for r in res:
        fed.clients[r.update.client_id].detector_state = r.detector_state
    return res


def test_detector_flags_rotated_client_not_stationary():
    fed = build_federation(CFG)
    ids = [0, 1, 2, 3, 4, 5]
    clients = [fed.clients[c] for c in ids]
    cohort_of = dict.fromkeys(ids, 0)
    model = fed.initial_model
    for rnd in (1, 2):
        res = _round(fed, clients, dict.fromkeys(ids, model), cohort_of, rnd)
        assert not any(r.update.drift_flag for r in res)  # falling losses never flag
        model = fedavg([r.update.params for r in res], [r.update.n_samples for r in res])
    fed.clients[0].drifts.append(AppliedDrift(3, "label_rotation", "p", shift=3))
    prev = {c: fed.clients[c].detector_state["previous_loss"] for c in ids}
    res = _round(fed, clients, dict.fromkeys(ids, model), cohort_of, 3)
    flags = {r.update.client_id: r.update.drift_flag for r in res}
    assert flags == {0: True, 1: False, 2: False, 3: False, 4: False, 5: False}
    for c in ids:
        tx, ty, _, _ = fed.clients[c].current()
        loss = fed.clients[c].detector_state["previous_loss"]
        # the detector saw the received model's loss on the current data, before training
        assert loss == pytest.approx(mean_loss(fed.spec, model, tx, ty), abs=1e-5)
        assert (loss - prev[c] > CFG.drift.gamma) == (c == 0)
    assert fed.clients[0].detector_state["n_flags"] == 1
    upd = {r.update.client_id: r.update for r in res}
    assert upd[0].n_samples == fed.clients[0].train_y.shape[0] and upd[0].cohort_id == 0
    assert upd[0].params.dtype == np.float32 and upd[0].params.shape == model.shape


def test_train_clients_bit_identical_on_same_inputs():
    fed = build_federation(CFG)
    clients = [fed.clients[c] for c in (2, 7)]
    models = {2: fed.initial_model, 7: fed.initial_model}
    a = train_clients(clients, models, {2: 0, 7: 0}, fed.spec, CFG.training, 0.5, 4, 1)
    b = train_clients(list(reversed(clients)), models, {2: 0, 7: 0}, fed.spec, CFG.training,
                      0.5, 4, 1)
    by_b = {r.update.client_id: r for r in b}
    for r in a:
        other = by_b[r.update.client_id]
        assert r.update.params.tobytes() == other.update.params.tobytes()
        assert r.detector_state == other.detector_state
    assert not np.array_equal(a[0].update.params, fed.initial_model)  # it trained
    c = train_clients(clients, models, {2: 0, 7: 0}, fed.spec, CFG.training, 0.5, 4, 2)
    assert c[0].update.params.tobytes() != a[0].update.params.tobytes()  # round seeds order


def test_evaluate_clients_values_and_clipping(fed):
    ids = [0, 1, 2]
    clients = [fed.clients[c] for c in ids]
    model = fed.initial_model
    ev = evaluate_clients(clients, dict.fromkeys(ids, model), dict.fromkeys(ids, 0), fed.spec,
                          loss_max=50.0, keep_probabilities=True)
    for e, cl in zip(ev, clients, strict=True):
        assert (e.client_id, e.region, e.cohort_id) == (cl.client_id, cl.region, 0)
        assert e.n_eval == cl.eval_y.shape[0]
        assert e.loss == pytest.approx(mean_loss(fed.spec, model, cl.eval_x, cl.eval_y),
                                       abs=1e-5)
        assert e.accuracy == float((e.probabilities.argmax(1) == cl.eval_y).mean())
        np.testing.assert_array_equal(e.labels, cl.eval_y)
        np.testing.assert_allclose(e.probabilities.sum(1), 1.0, atol=1e-6)
    # clipped to loss_max: a blown-up model has losses far above 1.0
    big = model * 40.0
    clipped = evaluate_clients(clients, dict.fromkeys(ids, big), dict.fromkeys(ids, 0),
                               fed.spec, loss_max=1.0)
    raw = [mean_loss(fed.spec, big, cl.eval_x, cl.eval_y) for cl in clients]
    assert min(raw) > 1.0
    assert [e.loss for e in clipped] == [1.0, 1.0, 1.0]
    assert all(e.probabilities is None and e.labels is None for e in clipped)
    for e in clipped:
        assert 0.0 <= e.accuracy <= 1.0


@pytest.mark.parametrize("shift", [10, -20])
def test_label_rotation_by_a_multiple_of_the_classes_is_rejected(shift):
    from clma.config import validate_config
    from clma.sim.federation import build_federation

    cfg = validate_config({"clients": 6, "drift": {"events": [
        {"round": 2, "kind": "label_rotation", "shift": shift, "clients": [0], "family": "f"}]}})
    with pytest.raises(ValueError, match=r"drift.events\[0\].shift: .* changes no label"):
        build_federation(cfg)
