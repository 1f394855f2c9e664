"""The flower transport (clma.flower.transport) driven by the round engine over a loopback
grid of CLMA ClientApps (no Ray, no SuperLink): the same rounds, models, published reports
and ledger as the in-process simulated clients; one send_and_receive per protocol call;
every failure a Replies.failed entry; the secure sum of the survivors after a dropout; and
no exchange of a committed step sent again after a crash."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Error, Message, RecordDict

from clma.engine import FederationEngine, open_budget
from clma.flower import codec
from clma.flower.clientapp import make_client_app
from clma.flower.device_data import DEMO_SOURCE
from clma.flower.journal import ExchangeJournal
from clma.flower.transport import FlowerTransport
from clma.sim.clients import SimulatedClients
from clma.sim.federation import build_federation

from .conftest import LoopbackGrid, tiny_config


@pytest.fixture(scope="module")
def world():
    import torch

    torch.set_num_threads(1)
    cfg = tiny_config()
    cfg = cfg.model_copy(update={"federation": cfg.federation.model_copy(
        update={"transport": "flower"})})
    return cfg, build_federation(cfg)


def _budgeted(cfg, tmp: Path):
    return cfg.model_copy(update={"budget": cfg.budget.model_copy(update={"state_dir": str(tmp)})})


def _grid(cfg, state_root: Path | None = None, **kw) -> LoopbackGrid:
    nodes = {}
    for i in range(cfg.clients):
        nodes[1000 + i] = {"partition-id": i, "data-source": DEMO_SOURCE}
        if state_root is not None:
            nodes[1000 + i]["state-dir"] = str(state_root / f"node{i}")
    return LoopbackGrid(make_client_app(), nodes, run_config={"config-json": cfg.model_dump_json()},
                        **kw)


def _engine(cfg, fed, clients, tmp):
    b = _budgeted(cfg, tmp)
    return FederationEngine(b, fed.assets(), clients, budget=open_budget(b))


@pytest.fixture(scope="module")
def reference(world, tmp_path_factory):
    """The in-process simulation: every round's result, final state, ledger."""
    cfg, fed = world
    eng = _engine(cfg, fed, SimulatedClients(fed), tmp_path_factory.mktemp("ledger-sim"))
    return eng, [eng.run_round(r) for r in range(1, cfg.rounds + 1)]


def _normal(regional):
    """The published report, with a resumed run's republished releases counted as released
    (the ledger republishes what the crashed run had already committed)."""
    if regional is None:
        return None
    out = dict(regional)
    b = dict(out.pop("budget", {}))
    b["released"] = sorted(b.get("released", []) + b.pop("republished", []))
    return out, b


def _same_as(reference, eng, results):
    ref_eng, ref = reference
    assert eng.state.registry.history == ref_eng.state.registry.history
    assert eng.state.registry.history[3] != eng.state.registry.history[2]  # cohorts split
    assert sorted(eng.state.cohort_models) == sorted(ref_eng.state.cohort_models)
    for c, v in ref_eng.state.cohort_models.items():
        np.testing.assert_array_equal(eng.state.cohort_models[c], v)
    for a, b in zip(ref, results, strict=True):
        assert _normal(a.regional) == _normal(b.regional) and a.cohorts == b.cohorts
        assert a.evaluation.envelopes == b.evaluation.envelopes
    keys = [(e["round"], e["release"], e["status"]) for e in eng.budget.ledger.entries()]
    assert keys == [(e["round"], e["release"], e["status"]) for e in ref_eng.budget.ledger.entries()]
    assert len(set(keys)) == len(keys)  # each release charged once


def test_rounds_over_flower_equal_the_simulation_with_one_exchange_per_call(
        run_id, world, reference, tmp_path):
    cfg, fed = world
    grid = _grid(cfg)
    transport = FlowerTransport(grid, cfg, partition=fed.partition, n_params=fed.assets().n_params)
    eng = _engine(cfg, fed, transport, tmp_path)
    results = [eng.run_round(r) for r in range(1, cfg.rounds + 1)]
    _same_as(reference, eng, results)
    evals = sum(1 for r in results if r.regional is not None)
    assert evals == 3  # evaluation.every = 1
    # roster once, one call per round for training, four for the secure aggregation, and
    # the choice after round 3's split (cohort.client_choice, as shipped): its clients only
    split = [r for r in results if len(r.new_cohorts) >= 2]
    assert [r.round for r in split] == [3]
    kinds = [k for k, _ in grid.sent]
    assert kinds.count("query.clma_choose") == results[2].quarantined == 4
    assert grid.calls == 1 + cfg.rounds + 4 * evals + 1
    assert kinds.count("query.clma_roster") == cfg.clients
    assert kinds.count("evaluate.clma_masked") == cfg.clients * evals  # every session batched
    assert eng.roster.region_of() == fed.region_of()
    assert [ln["status"] for ln in transport.journal.lines] == ["sent"] * grid.calls


def _error(m, code=4500, reason="boom"):
    return Message(Error(code=code, reason=reason), reply_to=m)


def test_every_failure_is_a_failed_entry_and_the_round_completes(run_id, world, tmp_path):
    cfg, fed = world
    sent: dict[int, Message] = {}

    def tamper(kind, node, reply):
        if kind != "train":
            return reply
        pid = node - 1000
        c = reply.content
        if pid == 0:
            return _error(sent_to[node])
        if pid == 1:
            c["clma"]["round"] = 9
        if pid == 2:
            c["metrics"]["num-examples"] = -3
        if pid == 3:
            del c["arrays"]
        if pid == 4:
            return None
        return reply

    class Grid(LoopbackGrid):
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            for m in messages:
                sent_to[m.metadata.dst_node_id] = m
            return super().send_and_receive(messages, timeout=timeout)

    sent_to = sent
    grid = _grid(cfg, tamper=tamper)
    grid.__class__ = Grid
    transport = FlowerTransport(grid, cfg, partition=fed.partition, n_params=fed.assets().n_params,
                                timeout=1)
    eng = _engine(cfg, fed, transport, tmp_path)
    grid.superlink_down = {1005}  # gone after the roster: the SuperLink answers for it
    ctx = eng.begin_round(1)
    replies = eng.train(ctx)
    assert replies.ok == {}
    f = replies.failed
    assert f[0] == "error reply (code 4500): boom"
    assert f[1] == "malformed reply: clma.round: names another round than the one asked"
    assert f[2] == "malformed reply: metrics.num-examples: must be in [1, 1099511627776]"
    assert f[3] == "malformed reply: arrays: the ArrayRecord is missing"
    assert f[4] == "no reply within 1 s"
    assert f[5].startswith("error reply (code 5): Error: Node Unavailable")
    eng.accept(ctx, [replies])
    eng.after_training(ctx)  # nobody usable: the round still closes
    res = eng.finish(ctx)
    assert res.participants == 0 and res.dropouts == 6 and res.cohorts == {0: 6}


def test_roster_leaves_out_silent_malformed_and_duplicate_nodes(run_id, world):
    cfg, fed = world

    def tamper(kind, node, reply):
        if kind == "query.clma_roster" and node == 1001:
            reply.content["clma"]["partition-id"] = 3  # claims node 1003's id
        if kind == "query.clma_roster" and node == 1002:
            reply.content["clma"]["partition-id"] = -1
        return reply

    grid = _grid(cfg, tamper=tamper)
    grid.down = {1004}
    t = FlowerTransport(grid, cfg, partition=fed.partition, timeout=1, connect_timeout=1)
    roster = t.roster()
    assert roster.client_ids == [0, 5]
    assert set(t.roster_failures) == {1001, 1002, 1003, 1004}
    assert t.roster_failures[1003] == "another node claims the same partition id"
    assert t.roster() is roster and grid.calls == 1  # asked once
    assert roster.region_of() == {c: fed.region_of()[c] for c in (0, 5)}


def test_a_dropout_during_secure_aggregation_leaves_the_survivors_sum(run_id, world, tmp_path):
    cfg, fed = world

    def tamper(kind, node, reply):  # node 1004 leaves after sharing its keys
        return None if (kind == "evaluate.clma_masked" and node == 1004) else reply

    grid = _grid(cfg, tamper=tamper)
    transport = FlowerTransport(grid, cfg, partition=fed.partition, timeout=1)
    eng = _engine(cfg, fed, transport, tmp_path)
    ctx = eng.begin_round(1)
    eng.accept(ctx, [eng.train(ctx)])
    eng.after_training(ctx)
    sums = eng.secure_sums(ctx)
    g = sums.groups["global"]
    assert (g.status, g.selected, g.dropped, g.contributors) == ("ok", 6, 1, 5)
    from clma.device import quantised_report

    sim = SimulatedClients(fed)
    want = sum(quantised_report(*sim.learners[c].predict(eng.state.cohort_models[0], 1),
                                sums.layout, 2**16 - 1) for c in (0, 1, 2, 3, 5))
    np.testing.assert_array_equal(g.sum_quantised, want)
    out = eng.evaluate(ctx, sums)
    health = out.published["health"]["health.dropout_rate"]["global"]
    assert health["band"] in ("5_to_under_20pct", "20pct_or_more", "under_5pct")
    assert "participant_count" not in str(out.published)


class Crash(BaseException):
    """The orchestrating process dies (not an Exception: nothing catches it)."""


def test_after_a_crash_no_exchange_of_a_committed_step_is_sent_again(
        run_id, world, reference, tmp_path):
    cfg, fed = world
    state, nodes = tmp_path / "state", tmp_path / "nodes"

    class Dying(LoopbackGrid):
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            if any(m.metadata.message_type == "evaluate.clma_masked" and m.metadata.group_id == "3"
                   for m in messages):
                raise Crash()
            return super().send_and_receive(messages, timeout=timeout)

    first = _grid(cfg, nodes)
    first.__class__ = Dying
    t1 = FlowerTransport(first, cfg, partition=fed.partition, state_dir=state)
    e1 = _engine(cfg, fed, t1, tmp_path / "ledger")
    with pytest.raises(Crash):
        for r in range(1, cfg.rounds + 1):
            e1.run_round(r)
    # a new orchestrating process, a new Flower run (empty node contexts, same node folders)
    second = _grid(cfg, nodes)
    t2 = FlowerTransport(second, cfg, partition=fed.partition, state_dir=state)
    e2 = _engine(cfg, fed, t2, tmp_path / "ledger")
    results = [e2.run_round(r) for r in range(1, cfg.rounds + 1)]
    _same_as(reference, e2, results)
    kinds = {(k, g) for k, g in second.sent}
    assert {k for k, _ in kinds} == {"query.clma_roster", "evaluate.clma_masked",
                                     "evaluate.clma_unmask"}
    replayed = [(ln["round"], ln["call"]) for ln in t2.journal.lines if ln["status"] == "replayed"]
    assert (3, "train") in replayed and (3, "secagg_share_keys") in replayed
    assert (1, "secagg_unmask") in replayed
    assert sum(1 for m in second.sent if m[0] == "evaluate.clma_masked") == cfg.clients
    # committed rounds' records are dropped from the journal
    from clma.state import StateStore

    StateStore(state).commit(3, {"registry.json": b"{}"})
    t2.journal.prune()
    assert not (state / "flower" / "rounds").exists() or not any((state / "flower" / "rounds").iterdir())
    on_disk = [__import__("json").loads(x) for x in
               (state / "flower" / "progress.jsonl").read_text().splitlines()]
    assert sum(x["status"] == "replayed" for x in on_disk) == len(replayed)


def test_journal_replays_the_recorded_replies_exactly(tmp_path):
    from clma.flower.journal import JournalEntry

    j = ExchangeJournal(tmp_path, run_id=42)
    p = np.arange(4, dtype=np.float32)
    j.record(2, "train", "k1", JournalEntry({3: (p, 9, True, 1)}, {4: "no reply"}, {"x": 1}))
    j.record(2, "secagg_unmask", "k2", JournalEntry({3: b"\x01\x02"}, {}, {}))
    fresh = ExchangeJournal(tmp_path, run_id=43)
    e = fresh.lookup(2, "train", "k1")
    np.testing.assert_array_equal(e.ok[3][0], p)
    assert e.ok[3][1:] == (9, True, 1) and e.failed == {4: "no reply"}
    assert fresh.lookup(2, "secagg_unmask", "k2").ok == {3: b"\x01\x02"}
    assert fresh.lookup(2, "train", "other") is None
    runs = (tmp_path / "flower" / "runs.jsonl").read_text().splitlines()
    assert [__import__("json").loads(x)["flower_run_id"] for x in runs] == [42, 43]


def test_header_only_replies_and_foreign_records_never_raise(run_id, world, tmp_path):
    cfg, fed = world

    def tamper(kind, node, reply):
        if kind == "train" and node == 1000:
            return Message(content=RecordDict({"clma": ConfigRecord({"schema": codec.SCHEMA})}),
                           reply_to=last[node])
        return reply

    last: dict[int, Message] = {}

    class Grid(LoopbackGrid):
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            for m in messages:
                last[m.metadata.dst_node_id] = m
            return super().send_and_receive(messages, timeout=timeout)

    grid = _grid(cfg, tamper=tamper)
    grid.__class__ = Grid
    t = FlowerTransport(grid, cfg, partition=fed.partition, timeout=1)
    eng = _engine(cfg, fed, t, tmp_path)
    ctx = eng.begin_round(1)
    r = eng.train(ctx)
    assert r.failed == {0: "malformed reply: clma.call: must be 'train'"}
    assert sorted(r.ok) == [1, 2, 3, 4, 5]


def test_a_client_gone_at_resume_leaves_the_others_exchanges_replayed(run_id, world, tmp_path):
    """Node 5 fails its round-3 training and is gone when the federation resumes: the
    resumed round asks the remaining five the same messages, all answered from the
    journal (nothing sent); later steps are asked afresh."""
    cfg, fed = world
    state, nodes = tmp_path / "state", tmp_path / "nodes"

    class Dying(LoopbackGrid):
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            if any(m.metadata.message_type == "evaluate.clma_share_keys"
                   and m.metadata.group_id == "3" for m in messages):
                raise Crash()
            return super().send_and_receive(messages, timeout=timeout)

    first = _grid(cfg, nodes)
    first.__class__ = Dying
    t1 = FlowerTransport(first, cfg, partition=fed.partition, state_dir=state, timeout=1)
    e1 = _engine(cfg, fed, t1, tmp_path / "ledger")
    from clma.engine.state import restore_files, snapshot_files
    from clma.state import StateStore

    e1.run_round(1)
    e1.run_round(2)
    files = snapshot_files(e1.state)
    StateStore(state).commit(2, files)  # round 2 committed: its exchanges are pruned
    first.down = {1005}  # silent from round 3 on
    with pytest.raises(Crash):
        e1.run_round(3)
    second = _grid(cfg, nodes)
    del second.contexts[1005]  # gone: not a node of the new run
    t2 = FlowerTransport(second, cfg, partition=fed.partition, state_dir=state,
                         connect_timeout=1)
    b = _budgeted(cfg, tmp_path / "ledger")
    e2 = FederationEngine(b, fed.assets(), t2, budget=open_budget(b),
                          state=restore_files(files, 2))
    assert e2.roster.client_ids == [0, 1, 2, 3, 4, 5] and t2.absent == [5]
    res = e2.run_round(3)
    assert res.participants == 5 and res.dropouts == 1  # as in the first run's round 3
    sent3 = [k for k, _ in second.sent if k != "query.clma_roster"]
    assert "train" not in sent3 and "evaluate.clma_advertise" not in sent3
    status = {(ln["round"], ln["call"]): ln["status"] for ln in t2.journal.lines}
    assert status[(3, "train")] == status[(3, "secagg_advertise")] == "replayed"
    assert status[(3, "secagg_share_keys")] == "sent"
    assert res.regional["metrics"]["accuracy"]["global"] is not None or \
        res.regional["budget"]["refused"]  # released (or refused by the cap), never lost
