"""The Clients seam (clma.engine.clients): every training reply is checked
(``check_update``, ``FederationEngine.check_replies``); a malformed reply, a missing one
or a transport that fails is a dropout of that round, never an exception, and the round
completes with the other clients."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from clma.engine import ClientInfo, Replies, Roster, TrainRequest, TrainSettings
from clma.engine.clients import Clients, check_update
from clma.rounds import ClientUpdate, fedavg
from clma.sim.clients import SimulatedClients

N = 6
SETTINGS = TrainSettings(local_epochs=1, learning_rate=0.1, batch_size=8, drift_gamma=0.5)


def _request() -> TrainRequest:
    return TrainRequest(1, {0: 0, 1: 0, 2: 3}, {0: np.zeros(N, np.float32),
                                                3: np.ones(N, np.float32)}, SETTINGS)


def _good(client=0, cohort=0, **kw) -> ClientUpdate:
    u = ClientUpdate(client, cohort, np.zeros(N, np.float32), 12, False)
    return dataclasses.replace(u, **kw)


def test_a_well_formed_reply_passes():
    req = _request()
    assert check_update(_good(), req, N) is None
    assert check_update(_good(2, 3), req, N) is None
    assert check_update(_good(n_samples=np.int64(5), drift_flag=np.bool_(True)), req, N) is None


@pytest.mark.parametrize("reply, why", [
    (_good(params=np.zeros(N + 1, np.float32)), "params: must be a float32 vector of length 6"),
    (_good(params=np.zeros(N - 1, np.float32)), "params: must be a float32 vector of length 6"),
    (_good(params=np.zeros((1, N), np.float32)), "params: must be a float32 vector of length 6"),
    (_good(params=np.zeros(N, np.float64)), "params: must be a float32 vector of length 6"),
    (_good(params=[0.0] * N), "params: must be a float32 vector of length 6"),
    (_good(params=np.array([0, 0, np.nan, 0, 0, 0], np.float32)), "params: must be finite"),
    (_good(params=np.array([0, np.inf, 0, 0, 0, 0], np.float32)), "params: must be finite"),
    (_good(n_samples=0), "n_samples: must be an integer >= 1"),
    (_good(n_samples=-4), "n_samples: must be an integer >= 1"),
    (_good(n_samples=True), "n_samples: must be an integer >= 1"),
    (_good(n_samples=3.0), "n_samples: must be an integer >= 1"),
    (_good(n_samples=float("nan")), "n_samples: must be an integer >= 1"),
    (_good(cohort=3), "reply names another cohort than the one assigned"),
    (_good(2, 0), "reply names another cohort than the one assigned"),
    (_good(cohort=True), "reply names another cohort than the one assigned"),
    (_good(7), "reply from a client the request did not ask"),
    (_good(np.int64(0)), "reply from a client the request did not ask"),
    (_good(drift_flag=1), "drift_flag: must be a boolean"),
    (_good(drift_flag=None), "drift_flag: must be a boolean"),
    ({"client_id": 0, "cohort_id": 0}, "reply is not a ClientUpdate"),
    (None, "reply is not a ClientUpdate"),
])
def test_every_malformed_reply_is_named_and_nothing_raises(reply, why):
    assert check_update(reply, _request(), N) == why


# ----------------------------------------------------------------- hostile clients


class Hostile(SimulatedClients):
    """Simulated clients whose transport corrupts chosen replies: ``corrupt`` maps a
    client id to a function of its honest update that returns the reply sent instead;
    ``extra`` maps a client id the request did not ask to (an asked client, a function of
    that client's honest update): a reply added under the unasked id."""

    def __init__(self, federation, corrupt, extra=None):
        super().__init__(federation)
        self.corrupt, self.extra = corrupt, dict(extra or {})
        self.honest: dict[int, ClientUpdate] = {}

    def train(self, request):
        out = super().train(request)
        self.honest.update(out.ok)
        for c, f in self.corrupt.items():
            if c in out.ok:
                out.ok[c] = f(out.ok[c])
        for fake, (src, f) in self.extra.items():
            if src in self.honest and src in request.assignments:
                out.ok[fake] = f(self.honest[src])
        return out


def _swap(u, **kw):
    return dataclasses.replace(u, **kw)


CORRUPT = {
    0: lambda u: _swap(u, params=u.params[:-1]),                      # wrong length
    1: lambda u: _swap(u, params=u.params.astype(np.float64)),        # float64
    2: lambda u: _swap(u, params=np.where(np.arange(u.params.size) == 3, np.nan,
                                          u.params).astype(np.float32)),  # NaN
    3: lambda u: _swap(u, n_samples=0),
    4: lambda u: _swap(u, n_samples=-u.n_samples),
    5: lambda u: _swap(u, n_samples=True),
    6: lambda u: _swap(u, cohort_id=u.cohort_id + 1),                 # not the assigned cohort
    7: lambda u: {"params": u.params.tolist()},                       # not a ClientUpdate
    8: lambda u: _swap(u, client_id=9),                               # filed under another id
}
EXTRA = {99: (10, lambda u: _swap(u, client_id=99)),                 # a client not asked
         98: (11, lambda u: u)}                                       # not asked, another's reply


def test_malformed_replies_are_dropouts_and_the_round_completes_with_the_others(
        tiny_config, make_engine):
    cfg = tiny_config(training={"local_epochs": 1}, divergence={"enabled": False})
    honest = make_engine(cfg)
    clients = Hostile(honest.clients.federation, CORRUPT, EXTRA)
    engine = make_engine(cfg, clients)
    ctx = engine.begin_round(1)
    replies = engine.train(ctx)
    assert set(replies.ok) == set(range(9, 20))
    assert set(replies.failed) >= set(CORRUPT)
    assert replies.failed[0] == replies.failed[1] == "params: must be a float32 vector of length " \
        f"{engine.assets.n_params}"
    assert replies.failed[2] == "params: must be finite"
    assert {replies.failed[c] for c in (3, 4, 5)} == {"n_samples: must be an integer >= 1"}
    assert replies.failed[6] == "reply names another cohort than the one assigned"
    assert replies.failed[7] == "reply is not a ClientUpdate"
    assert replies.failed[8] == "reply filed under another client id"
    for c in range(9, 20):  # the accepted replies are the devices' own, unchanged
        assert replies.ok[c].params.tobytes() == clients.honest[c].params.tobytes()
    # the round goes on with the 11 good clients
    engine.accept(ctx, [replies])
    assert ctx.participants == list(range(9, 20))
    assert [u.client_id for u in ctx.updates] == ctx.participants
    engine.after_training(ctx)
    res = engine.finish(ctx)
    assert (res.participants, res.dropouts) == (11, 9)  # only selected clients are dropouts
    good = [clients.honest[c] for c in range(9, 20)]
    np.testing.assert_array_equal(engine.state.cohort_models[0],
                                  fedavg([u.params for u in good], [u.n_samples for u in good]))


def test_the_whole_round_with_hostile_clients_evaluates_the_good_ones(tiny_config, make_engine):
    cfg = tiny_config(training={"local_epochs": 1}, divergence={"enabled": False})
    sim = make_engine(cfg).clients.federation
    engine = make_engine(cfg, Hostile(sim, CORRUPT, EXTRA))
    res = engine.run_round(1, chunk_size=4)
    assert (res.participants, res.dropouts) == (11, 9)
    assert res.evaluation is not None and res.regional is not None
    assert res.evaluation.server["accuracy|global"].contributors == 11
    assert res.regional["metrics"]["accuracy"]["global"] is not None


def test_a_reply_both_ok_and_failed_is_a_dropout(tiny_config, make_engine):
    """A transport that reports one client both as answered and as failed: the reply is
    not used (a dropout), and the round's updates and participants agree."""

    class Contradictory(SimulatedClients):
        def train(self, request):
            out = super().train(request)
            out.failed[3] = "timed out"
            return out

    cfg = tiny_config(training={"local_epochs": 1}, divergence={"enabled": False})
    engine = make_engine(cfg, Contradictory(make_engine(cfg).clients.federation))
    ctx = engine.begin_round(1)
    engine.accept(ctx, [engine.train(ctx)])
    assert 3 not in ctx.participants and len(ctx.participants) == 19
    assert [u.client_id for u in ctx.updates] == ctx.participants


class Broken:
    """A transport whose train call fails outright (or answers garbage)."""

    transport = "simulation"

    def __init__(self, roster, reply):
        self._roster, self.reply = roster, reply
        self.asked: list[list[int]] = []

    def roster(self):
        return self._roster

    def train(self, request):
        self.asked.append(sorted(request.assignments))
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply

    def close(self):
        pass


@pytest.mark.parametrize("reply", [ConnectionError("network down"), RuntimeError("bug"),
                                   None, {"ok": {}}, Replies(ok=[1, 2], failed={})])
def test_a_failing_transport_is_every_asked_clients_dropout(tiny_config, make_engine, reply):
    cfg = tiny_config(training={"local_epochs": 1}, divergence={"enabled": False})
    sim = make_engine(cfg).clients.federation
    roster = Roster(tuple(ClientInfo(c, cl.region) for c, cl in sorted(sim.clients.items())))
    broken = Broken(roster, reply)
    engine = make_engine(cfg, broken)
    ctx = engine.begin_round(1)
    got = engine.train(ctx, ctx.selected[:5])
    assert got.ok == {} and set(got.failed) == set(ctx.selected[:5])
    assert broken.asked == [sorted(ctx.selected[:5])]
    if isinstance(reply, Exception):
        assert set(got.failed.values()) == {f"transport error: {type(reply).__name__}"}
    # a round whose transport fails for everyone completes: nothing trained, nothing lost
    res = engine.run_round(1, chunk_size=7)
    assert (res.participants, res.dropouts, res.cohorts) == (0, 20, {0: 20})
    np.testing.assert_array_equal(engine.state.cohort_models[0], sim.initial_model)
    assert res.evaluation is None  # no participant: nothing to evaluate


def test_simulated_clients_implement_the_protocol(tiny_config, make_engine):
    engine = make_engine(tiny_config())
    assert isinstance(engine.clients, Clients)
    assert engine.clients.transport == "simulation"
    assert engine.roster.client_ids == list(range(20))
