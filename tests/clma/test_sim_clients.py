"""clma.sim.clients: the in-process transport. Each simulated device keeps its own
detector state (DeviceStore: memory, or one JSON file per client in the devices' own
folder), plays only its own clients, and a device that fails at any step is that step's
failure for that client, never an exception for the others."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clma.config import validate_config
from clma.engine import FederationEngine, TrainRequest, TrainSettings
from clma.privacy.secagg import UnmaskingRequest
from clma.sim.clients import DeviceStore, SimulatedClients
from clma.sim.federation import build_federation

CFG = validate_config({
    "name": "sim-clients", "seed": 2, "rounds": 3, "clients": 6,
    "data": {"probe_size": 32}, "model": {"hidden": [16]},
    "training": {"local_epochs": 1},
    "drift": {"events": [{"round": 3, "kind": "label_rotation", "shift": 4, "family": "p",
                          "clients": [1, 4]}]},
    "tracking": {"enabled": False}, "budget": {"enabled": False},
})
SETTINGS = TrainSettings(local_epochs=3, learning_rate=0.3, batch_size=16, drift_gamma=0.2)


@pytest.fixture(scope="module")
def fed():
    return build_federation(CFG)


def _round(clients, fed, r, models=None):
    req = TrainRequest(r, dict.fromkeys(fed.client_ids, 0),
                       {0: fed.initial_model if models is None else models},
                       SETTINGS)
    out = clients.train(req)
    assert out.failed == {}
    return out.ok


def _fedavg(ok):
    from clma.rounds import fedavg

    return fedavg([u.params for u in ok.values()], [u.n_samples for u in ok.values()])


def test_device_state_survives_a_new_transport_object(fed, tmp_path):
    devices = tmp_path / "devices"
    ref = SimulatedClients(fed)  # memory only, one object for all rounds
    first = SimulatedClients(fed, device_dir=devices)
    m_ref = m = fed.initial_model
    for r in (1, 2):
        m_ref, m = _fedavg(_round(ref, fed, r, m_ref)), _fedavg(_round(first, fed, r, m))
    assert sorted(p.name for p in devices.iterdir()) == [f"client_{c:06d}.json"
                                                         for c in fed.client_ids]
    for c in fed.client_ids:
        doc = json.loads((devices / f"client_{c:06d}.json").read_text())
        assert sorted(doc["rounds"]) == ["1", "2"]
        assert doc == ref.store.load(c).to_dict()
    # a new transport object (a restarted simulation process) reads each device's state
    second = SimulatedClients(fed, device_dir=devices)
    got, want = _round(second, fed, 3, m), _round(ref, fed, 3, m_ref)
    assert {c: u.drift_flag for c, u in got.items()} == {c: u.drift_flag for c, u in want.items()}
    assert {c for c, u in got.items() if u.drift_flag} == {1, 4}  # the drift is detected
    for c in fed.client_ids:
        assert got[c].params.tobytes() == want[c].params.tobytes()
        assert second.store.load(c).to_dict() == ref.store.load(c).to_dict()
    # ... whereas a device that lost its state cannot flag (its first observation)
    amnesic = _round(SimulatedClients(fed), fed, 3, m)
    assert not any(u.drift_flag for u in amnesic.values())


def test_memory_only_devices_write_nothing(fed, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    clients = SimulatedClients(fed)
    _round(clients, fed, 1)
    assert clients.store.root is None and list(tmp_path.iterdir()) == []
    assert clients.store.load(0).rounds == [1]


def test_device_store_writes_atomically_and_reads_back(tmp_path):
    from clma.drift import RoundKeyedState

    store = DeviceStore(tmp_path / "d")
    st = RoundKeyedState()
    st.record(3, {"kind": "LossThresholdDetector", "gamma": 0.5, "previous_loss": 1.0,
                  "n_updates": 1, "n_flags": 0})
    store.save(12, st)
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["client_000012.json"]  # no tmp
    assert DeviceStore(tmp_path / "d").load(12).to_dict() == st.to_dict()
    assert DeviceStore(tmp_path / "d").load(13).rounds == []  # a device without state


def test_a_transport_plays_only_its_own_clients(fed):
    part = SimulatedClients(fed, client_ids=[4, 0])
    assert part.roster().client_ids == [0, 4]
    assert part.roster().region_of() == {0: fed.clients[0].region, 4: fed.clients[4].region}
    req = TrainRequest(1, {0: 0, 1: 0, 4: 0}, {0: fed.initial_model}, SETTINGS)
    out = part.train(req)
    assert sorted(out.ok) == [0, 4] and out.failed == {1: "not a client of this transport"}
    with pytest.raises(ValueError, match="client_ids: not clients of the federation"):
        SimulatedClients(fed, client_ids=[0, 99])


class Failing:
    """A device whose local model fails (out of memory, a corrupted shard...)."""

    def fit(self, *a):
        raise MemoryError("simulated device failure")

    def predict(self, *a):
        raise OSError("simulated device failure")


def test_a_failing_device_is_its_own_failure_at_training(fed):
    clients = SimulatedClients(fed)
    clients.learners[3] = Failing()
    req = TrainRequest(1, dict.fromkeys(fed.client_ids, 0), {0: fed.initial_model}, SETTINGS)
    out = clients.train(req)
    assert sorted(out.ok) == [0, 1, 2, 4, 5]
    assert list(out.failed) == [3] and "MemoryError" in out.failed[3]
    assert clients.store.load(3).rounds == []  # its state is untouched


def test_a_failing_device_is_a_dropout_of_the_evaluation(tmp_path):
    cfg = validate_config({"name": "fail-eval", "seed": 0, "clients": 20,
                           "data": {"probe_size": 32}, "tracking": {"enabled": False},
                           "budget": {"enabled": False}})
    sim = build_federation(cfg)
    clients = SimulatedClients(sim)
    clients.learners[7] = Failing()
    engine = FederationEngine(cfg, sim.assets(), clients)
    ids = engine.roster.client_ids
    sums = engine.evaluator.secure_sums(clients, 1, ids, engine.region_of,
                                        engine.state.assignments(ids), engine.state.cohort_models)
    g = sums.groups["global"]
    assert (g.status, g.selected, g.dropped, g.contributors) == ("ok", 20, 1, 19)
    # unmasking twice is refused by the device: a failure of that client, not an exception
    sid = next(iter(clients._secagg[0].unmasked))
    again = clients.secagg_unmask(1, {0: {sid: UnmaskingRequest(frozenset(), frozenset())}})
    assert again.ok == {} and list(again.failed) == [0]
    # a step asked for a round the device has no state of is a failure too
    other = clients.secagg_masked_input(2, {0: {sid: []}})
    assert other.failed == {0: "no secure-aggregation state for this round"}
    np.testing.assert_array_equal(engine.state.cohort_models[0], sim.initial_model)


def test_truth_is_each_clients_cohort_model_on_its_drifted_eval_data(fed):
    """One model per cohort serves all its clients: the same numbers as each client's own
    prediction (accuracy and clipped loss from the literal formulas)."""
    clients = SimulatedClients(fed)
    rng = np.random.default_rng(0)
    models = {k: (fed.initial_model + 0.05 * rng.standard_normal(fed.initial_model.shape)
                  ).astype(np.float32) for k in (0, 1)}
    assign = {c: c % 2 for c in fed.client_ids}
    out = clients.truth(3, assign, models, loss_max=5.0)  # round 3: clients 1, 4 drifted
    assert [e.client_id for e in out] == sorted(fed.client_ids)
    for e in out:
        proba, ey = clients.learners[e.client_id].predict(models[assign[e.client_id]], 3)
        p_true = np.clip(proba[np.arange(ey.shape[0]), ey], 1e-12, 1.0)
        assert e.cohort_id == assign[e.client_id] and e.n_eval == ey.shape[0]
        assert e.accuracy == float((proba.argmax(axis=1) == ey).mean())
        assert e.loss == float(np.clip(-np.log(p_true).mean(), 0.0, 5.0))


def test_record_churn_gives_each_round_its_own_seeded_subset_of_the_records():
    """data.record_churn = c: at every round a device's training records are a seeded
    subset of round((1 - c) n) of its n (drifted) records, the same when asked again and
    another at the next round; its evaluation records stay. At 0 every round has all."""
    from clma.sim.clients import SimLearner

    churned = build_federation(CFG.with_overrides(data={**CFG.data.model_dump(),
                                                        "record_churn": 0.25}))
    plain = build_federation(CFG)
    c = 1
    n = plain.clients[c].train_y.shape[0]
    lp, lc = SimLearner(plain, plain.clients[c]), SimLearner(churned, churned.clients[c])
    full = lp.data(2)
    assert full[1].shape[0] == n and lp.data(1)[1].tobytes() == full[1].tobytes()
    subsets = {}
    for r in (1, 2, 3):
        tx, ty, ex, ey = lc.data(r)
        assert ty.shape[0] == max(1, round(0.75 * n)) and tx.shape[0] == ty.shape[0]
        assert ey.tobytes() == lp.data(r)[3].tobytes()  # evaluation records unchanged
        # rows of the round's (drifted) records, in their order
        rows = [int(np.flatnonzero((lp.data(r)[0] == x).all(axis=tuple(range(1, x.ndim + 1))))[0])
                for x in tx]
        assert rows == sorted(rows) and len(set(rows)) == len(rows)
        np.testing.assert_array_equal(ty, lp.data(r)[1][rows])
        subsets[r] = tuple(rows)
        again = SimLearner(churned, churned.clients[c]).data(r)  # asked again: the same
        assert again[1].tobytes() == ty.tobytes() and again[0].tobytes() == tx.tobytes()
    assert len(set(subsets.values())) == 3
    with pytest.raises(ValueError, match="record_churn"):
        CFG.with_overrides(data={**CFG.data.model_dump(), "record_churn": 1.0})
