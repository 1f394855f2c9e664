"""``cohort.client_choice``: after a drift round's split the split's clients choose among the
new cohorts on their own evaluation data (clma.device.choose_cohort, IFCA's rule applied
once); the engine moves a client that chose another candidate, keeps the split for a
client that fails or answers something else, and retires a new cohort the moves empty.
The loss is checked against scikit-learn's log loss; the engine's moves against the
choice each device's data gives."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from sklearn.metrics import log_loss

from clma.config import validate_config, with_cohort_method
from clma.device import choose_cohort
from clma.engine.clients import ChoiceRequest, Replies, check_choice

from .test_round import DRIFT, FLAGS


class _Fixed:
    """A learner whose predictions depend on the model's first coordinate only."""

    def __init__(self, table, labels):
        self.table, self.labels = table, np.asarray(labels)

    def predict(self, params, round_number):
        return np.asarray(self.table[int(params[0])], dtype=float), self.labels


def _models(*ks):
    return {k: np.full(3, k, dtype=np.float32) for k in ks}


def test_the_device_picks_the_lowest_log_loss():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, size=40)
    table = {k: rng.dirichlet(np.ones(3), size=40) for k in (4, 5, 6)}
    want = min((4, 5, 6), key=lambda k: log_loss(labels, table[k], labels=[0, 1, 2]))
    losses = sorted(log_loss(labels, table[k], labels=[0, 1, 2]) for k in (4, 5, 6))
    assert losses[1] - losses[0] > 1e-3  # a real choice, not a tie
    got = choose_cohort((5, 4, 6), _models(4, 5, 6), _Fixed(table, labels), 3)
    assert got == want


class _Both(_Fixed):
    """A learner with training records too (``predict_training``)."""

    def __init__(self, table, labels, train_table, train_labels):
        super().__init__(table, labels)
        self.train = _Fixed(train_table, train_labels)

    def predict_training(self, params, round_number):
        return self.train.predict(params, round_number)


def test_with_training_records_the_device_pools_all_its_records():
    # evaluation records alone prefer cohort 4, all records together cohort 5: the choice
    # is the pooled log loss (scikit-learn's, on the concatenated records)
    rng = np.random.default_rng(1)
    ey, ty = rng.integers(0, 2, size=4), rng.integers(0, 2, size=30)
    good_e = np.where(ey[:, None] == [0, 1], 0.8, 0.2)
    bad_e = np.where(ey[:, None] == [0, 1], 0.6, 0.4)
    good_t = np.where(ty[:, None] == [0, 1], 0.7, 0.3)
    bad_t = np.where(ty[:, None] == [0, 1], 0.45, 0.55)
    learner = _Both({4: good_e, 5: bad_e}, ey, {4: bad_t, 5: good_t}, ty)
    pooled = {k: log_loss(np.concatenate([ty, ey]),
                          np.concatenate([learner.train.table[k], learner.table[k]]),
                          labels=[0, 1]) for k in (4, 5)}
    assert pooled[5] < pooled[4]
    assert choose_cohort((4, 5), _models(4, 5), _Fixed(learner.table, ey), 2) == 4
    assert choose_cohort((4, 5), _models(4, 5), learner, 2) == 5


def test_a_tie_keeps_the_splits_cohort_and_zero_probabilities_are_finite():
    labels = [0, 1]
    same = np.array([[0.7, 0.3], [0.4, 0.6]])
    assert choose_cohort((2, 1), _models(1, 2), _Fixed({1: same, 2: same}, labels), 1) == 2
    zero = np.array([[0.0, 1.0], [1.0, 0.0]])  # every label given probability 0
    assert choose_cohort((1, 2), _models(1, 2), _Fixed({1: zero, 2: same}, labels), 1) == 2


@pytest.mark.parametrize(("labels", "proba", "rule"), [
    ([], np.zeros((0, 2)), "no local records"),
    ([0, 1], np.ones((3, 2)) / 2, "learner.predict: probabilities must be (n, n_classes)"),
])
def test_a_device_without_usable_evaluation_data_refuses(labels, proba, rule):
    with pytest.raises(ValueError, match=rule.replace("(", r"\(").replace(")", r"\)")):
        choose_cohort((1, 2), _models(1, 2), _Fixed({1: proba, 2: proba}, labels), 1)
    with pytest.raises(ValueError, match="candidates"):
        choose_cohort((), _models(1), _Fixed({1: proba}, labels), 1)


def test_a_choice_reply_is_an_integer_among_the_candidates():
    req = ChoiceRequest(2, {7: (3, 4)}, _models(3, 4))
    assert check_choice(4, req, 7) is None and check_choice(np.int64(3), req, 7) is None
    assert check_choice(5, req, 7) == "choice: not one of the candidate cohorts"
    assert check_choice(True, req, 7) == "choice: must be an integer cohort id"
    assert check_choice("4", req, 7) == "choice: must be an integer cohort id"
    assert check_choice(4, req, 8) == "reply from a client the request did not ask"
    part = req.for_clients([7])
    assert part.candidates == {7: (3, 4)} and sorted(part.models) == [3, 4]


# ------------------------------------------------------------------------- the engine


@pytest.fixture
def config(tiny_config):
    """12 clients, two opposite drift families at round 2 flagged by their devices."""
    def make(**cohort):
        return tiny_config(clients=12, rounds=2, drift=DRIFT, training={"local_epochs": 1},
                           model={"hidden": [32]}, evaluation={"min_cohort": 2},
                           cohort=cohort)
    return make


def _scripted(base, answers=None):
    """The simulated clients, with ``choose`` answered by ``answers(request)`` (None: the
    devices' own choice) and every request recorded."""

    class Scripted(base):
        asked: list[ChoiceRequest] = []

        def choose(self, request):
            self.asked.append(request)
            return super().choose(request) if answers is None else answers(request)

    return Scripted


def _split_round(make_engine, scripted_clients, cfg, answers=None):
    from tests.clma.engine.conftest import _federation

    sim = _federation(cfg)
    clients = _scripted(scripted_clients, answers)(sim, flags=FLAGS)
    eng = make_engine(cfg, clients)
    eng.run_round(1)
    res = eng.run_round(2)
    return eng, clients, res


def test_the_shipped_default_asks_and_each_client_ends_where_its_data_chose(
        config, make_engine, scripted_clients):
    cfg = config()
    assert cfg.cohort.client_choice is True  # as shipped, with the improved method
    eng, clients, res = _split_round(make_engine, scripted_clients, cfg)
    (req,) = clients.asked
    kids = sorted({k for v in req.candidates.values() for k in v})
    assert len(kids) == 2 and sorted(req.candidates) == list(range(6))
    reg = eng.state.registry
    chose_other = set()
    for c, cands in req.candidates.items():
        # each candidate list starts with the split's cohort, then the other one
        assert sorted(cands) == kids
        learner = clients.learners[c]

        def pooled(k, learner=learner):  # every local record: training, then evaluation
            (tp, ty), (ep, ey) = (learner.predict_training(req.models[k], 2),
                                  learner.predict(req.models[k], 2))
            return log_loss(np.concatenate([ty, ey]), np.concatenate([tp, ep]).astype(float),
                            labels=range(tp.shape[1]))

        want = min(cands, key=lambda k: (pooled(k), cands.index(k)))
        assert reg.cohort_of(c) == want
        if want != cands[0]:
            chose_other.add(c)
    moves = [e for e in reg.lineage if e.kind == "move"]
    assert all(e.reason == "client choice" and e.round == 2 for e in moves)
    assert {e.clients[0] for e in moves} == chose_other
    assert sum(v["size"] for v in res.new_cohorts.values()) == 6


def res_moved(eng, res):
    reg = eng.state.registry
    return [e.clients[0] for e in reg.lineage if e.kind == "move" and e.round == res.round]


def test_moves_failures_and_malformed_answers(config, make_engine, scripted_clients):
    def answers(req):
        out = Replies()
        for c, cands in req.candidates.items():
            if c == 0:
                out.ok[c] = cands[1]  # chooses the other cohort: moved
            elif c == 1:
                out.failed[c] = "device error: ValueError"  # keeps the split's
            elif c == 2:
                out.ok[c] = True  # malformed: keeps the split's
            elif c == 3:
                out.ok[c] = max(cands) + 10  # not a candidate: keeps the split's
            else:
                out.ok[c] = cands[0]
        return out

    first, _, _ = _split_round(make_engine, scripted_clients, config(client_choice=False))
    split = {c: first.state.registry.cohort_of(c) for c in range(6)}
    eng, clients, res = _split_round(make_engine, scripted_clients, config(), answers)
    reg = eng.state.registry
    (req,) = clients.asked
    assert {c: req.candidates[c][0] for c in range(6)} == split  # the same split
    assert reg.cohort_of(0) == req.candidates[0][1] != split[0]
    assert all(reg.cohort_of(c) == split[c] for c in range(1, 6))
    (move,) = [e for e in reg.lineage if e.kind == "move"]
    assert move.clients == [0] and move.parents == [split[0]] and move.reason == "client choice"
    sizes = {k: len(reg.members(k)) for k in set(split.values())}
    assert {k: v["size"] for k, v in res.new_cohorts.items()} == sizes
    assert res.cohorts == {k: len(reg.members(k)) for k in reg.active_cohorts()}


def test_when_one_model_draws_every_client_the_split_stands(config, make_engine,
                                                            scripted_clients):
    """Every client of the split answers the same cohort (what the loss gives when one
    model fits everyone better, as under covariate drift): the other cohort keeps none of
    its own members, so the choice tells nothing about the families and no one moves."""
    def everyone_to_the_larger(req):
        kid = max(sorted({k for v in req.candidates.values() for k in v}))
        return Replies(ok={c: kid for c in req.candidates})

    first, _, _ = _split_round(make_engine, scripted_clients, config(client_choice=False))
    split = {c: first.state.registry.cohort_of(c) for c in range(6)}
    eng, clients, res = _split_round(make_engine, scripted_clients, config(),
                                     everyone_to_the_larger)
    reg = eng.state.registry
    assert len(clients.asked) == 1 and not res_moved(eng, res)
    assert {c: reg.cohort_of(c) for c in range(6)} == split
    assert not [k for k, r in reg.cohorts.items() if r.status == "retired"]
    assert len(res.new_cohorts) == 2


def test_off_in_the_paper_method_and_without_the_call(config, make_engine, scripted_clients):
    paper = validate_config(with_cohort_method(config().model_dump(), "paper"))
    assert paper.cohort.client_choice is False and paper.cohort.components == "variance"
    eng, clients, res = _split_round(make_engine, scripted_clients, paper)
    assert clients.asked == [] and not res_moved(eng, res)
    assert validate_config({"cohort": {"method": "paper"}}).cohort.client_choice is False

    class NoChoice(scripted_clients):
        choose = None  # a transport without the call: the split stands

    from tests.clma.engine.conftest import _federation

    cfg = config()
    eng = make_engine(cfg, NoChoice(_federation(cfg), flags=FLAGS))
    eng.run_round(1)
    res = eng.run_round(2)
    assert len(res.new_cohorts) == 2 and not res_moved(eng, res)


# ------------------------------------------------------------- a new cohort of one client


class _OneAlone:
    """The shipped cohorter, with client ``alone`` taken out of its part into a part of its
    own (what the outlier refit does to a client it cannot place)."""

    def __init__(self, inner, alone):
        self.inner, self.alone = inner, alone

    def cohort(self, client_ids, matrix, reference):
        out = self.inner.cohort(client_ids, matrix, reference)
        if self.alone in out.assignments:
            out.assignments[self.alone] = max(out.assignments.values()) + 1
        return out


def test_a_client_left_alone_chooses_with_its_leave_one_out_model_and_joins_its_family(
        config, make_engine, scripted_clients):
    """Client 4 (family "plus") split off alone: it is asked to choose between staying
    alone and the two families' cohorts, its own cohort scored with the model the root
    cohort started round 2 from (its cohort's model trained on its update alone would fit
    it trivially); its data choose the "plus" cohort; the cohort of one is retired. No
    other client is offered the cohort of one."""
    from tests.clma.engine.conftest import _federation

    cfg = config()
    clients = _scripted(scripted_clients)(_federation(cfg), flags=FLAGS)
    eng = make_engine(cfg, clients)
    eng.run_round(1)
    start = eng.state.cohort_models[0].copy()  # what every client starts round 2 from
    eng.cohorter = _OneAlone(eng.cohorter, 4)
    res = eng.run_round(2)
    (req,) = clients.asked
    reg = eng.state.registry
    made = [k for e in reg.lineage if e.kind == "split" for k in e.children]
    alone = made[-1]
    shared = sorted(k for k in made if k != alone)
    assert len(shared) == 2 and req.candidates[4] == (alone, *shared)
    assert req.models[alone].tobytes() == start.tobytes()
    assert all(alone not in req.candidates[c] for c in (0, 1, 2, 3, 5))
    assert reg.cohort_of(4) == reg.cohort_of(0) == reg.cohort_of(2)  # the "plus" family
    assert reg.cohorts[alone].status == "retired" and alone not in res.new_cohorts
    assert sorted(reg.members(reg.cohort_of(0))) == [0, 2, 4]


def test_a_client_left_alone_stays_alone_when_it_chooses_so_across_source_cohorts(
        config, make_engine, scripted_clients):
    """The engine's candidates when the cohort of one comes from another source cohort
    than the two shared ones (two drifting source cohorts in one round): its member
    chooses among every shared new cohort of the round and staying alone (its source's
    start model); the shared cohorts' members choose between their two; nobody is offered
    the cohort of one. Staying alone keeps it; another answer moves it across sources,
    unless the group it would join keeps no majority of its own members ("held")."""
    from types import SimpleNamespace

    from clma.rounds import CohortingOutcome

    for answer in ("stay", "join", "held"):
        cfg = config()
        asked = []

        def answers(req, answer=answer, asked=asked):
            asked.append(req)
            if answer == "held":  # clients 0 and 2 leave a: a keeps none of its own
                return Replies(ok={c: (k[1] if c in (0, 2, 5) else k[0])
                                   for c, k in req.candidates.items()})
            return Replies(ok={c: (k[1] if (c == 5 and answer == "join") else k[0])
                               for c, k in req.candidates.items()})

        from tests.clma.engine.conftest import _federation

        clients = _scripted(scripted_clients, answers)(_federation(cfg), flags=FLAGS)
        eng = make_engine(cfg, clients)
        reg = eng.state.registry
        new = reg.split(0, {0: [0, 2], 1: [1, 3], 2: [5]}, 2, reason="drift")
        a, b, s = new[0], new[1], new[2]
        m = {k: np.full(4, float(k), dtype=np.float32) for k in (0, a, b, s)}
        other_source = np.full(4, -7.0, dtype=np.float32)
        ctx = SimpleNamespace(round=2, models=dict(m), start_models={0: m[0], 99: other_source},
                              cohorting=CohortingOutcome(
                                  new_cohorts={a: [0, 2], b: [1, 3], s: [5]},
                                  parents={a: 0, b: 0, s: 99}))
        moved = eng.choose(ctx)
        (req,) = asked
        assert req.candidates == {0: (a, b), 2: (a, b), 1: (b, a), 3: (b, a), 5: (s, a, b)}
        assert req.models[s].tobytes() == other_source.tobytes()
        assert req.models[a].tobytes() == m[a].tobytes()
        if answer in ("stay", "held"):  # held: neither a's clients nor 5 move into a or b
            assert moved == {} and reg.members(s) == [5] and s in ctx.cohorting.new_cohorts
            assert sorted(reg.members(a)) == [0, 2] and sorted(reg.members(b)) == [1, 3]
        else:
            assert moved == {5: a} and sorted(reg.members(a)) == [0, 2, 5]
            assert ctx.cohorting.retired == [s] and s not in ctx.cohorting.new_cohorts


class _Unflagged:
    """Scripted clients with the drift flag of ``quiet`` clients cleared in round 3 (a
    drifted device whose detector misses the drift)."""

    quiet: dict[int, set[int]] = {3: {4}}

    def train(self, request):
        out = super().train(request)
        for c in self.quiet.get(request.round, ()):
            if c in out.ok:
                out.ok[c] = dataclasses.replace(out.ok[c], drift_flag=False)
        return out


def test_the_client_its_cohort_left_alone_chooses_and_joins_its_family(
        tiny_config, make_engine, scripted_clients):
    """Both families drift again at round 3; client 4 ("plus") does not flag, so the
    split takes clients 0 and 2 out of the "plus" cohort and leaves 4 alone in it (its
    cohort's model would then be its own update). Client 4 is asked to choose between
    its cohort, scored with the model it started round 3 from, and the round's shared new
    cohorts; its data choose the "plus" family's new cohort, it moves there and its old
    cohort is retired ("emptied by a move")."""
    from tests.clma.engine.conftest import _federation

    drift = {"events": [*DRIFT["events"], *[{**e, "round": 3} for e in DRIFT["events"]]]}
    cfg = tiny_config(clients=12, rounds=3, drift=drift, training={"local_epochs": 1},
                      model={"hidden": [32]}, evaluation={"min_cohort": 2})
    flags = {2: range(6), 3: [0, 1, 2, 3, 5]}
    clients = _scripted(type("Quiet", (_Unflagged, scripted_clients), {}))(
        _federation(cfg), flags=flags)
    eng = make_engine(cfg, clients)
    eng.run_round(1)
    eng.run_round(2)
    reg = eng.state.registry
    plus = reg.cohort_of(4)
    assert sorted(reg.members(plus)) == [0, 2, 4]  # round 2 separated the families
    assert sorted(reg.members(reg.cohort_of(1))) == [1, 3, 5]
    start = eng.state.cohort_models[plus].copy()  # what client 4 starts round 3 from
    clients.asked.clear()
    eng.run_round(3)
    (req,) = clients.asked
    splits = [e for e in reg.lineage if e.kind == "split" and e.round == 3]
    new = sorted(k for e in splits for k in e.children)
    (family,) = [k for e in splits if e.parents == [plus] for k in e.children]
    assert req.candidates[4] == (plus, *new)
    assert req.models[plus].tobytes() == start.tobytes()
    assert all(plus not in req.candidates[c] for c in req.candidates if c != 4)
    assert reg.cohort_of(4) == family and sorted(reg.members(family)) == [0, 2, 4]
    assert reg.cohorts[plus].status == "retired"
    assert [(e.kind, e.reason) for e in reg.lineage if plus in (*e.parents, *e.children)
            and e.round == 3][-1] == ("retire", "emptied by a move")
