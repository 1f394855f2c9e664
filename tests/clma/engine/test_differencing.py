"""No sum below the cohort floor, not even by differencing (issue 21 item 1).

The server learns secure sums only for a partition of the round's participants into
groups of at least m clients (``aggregation_groups``); the global value is their sum. The
audit record lists every learned set; the rule checked on it: every set has at least m
clients and every difference of two nested sets too (a partition has no nested sets).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clma.config import validate_config
from clma.engine import FederationEngine
from clma.engine.evaluation import GLOBAL, aggregation_groups
from clma.sim.clients import SimulatedClients
from clma.sim.federation import build_federation

NEIGHBOURS = {"north": "central", "central": "north", "south": "central", "west": "south",
              "islands": "west"}
ONE_EACH = {r: (r,) for r in NEIGHBOURS}


def _check_rule(sets: list[set[int]], m: int) -> None:
    for s in sets:
        assert len(s) >= m
    for a, b in itertools.permutations(sets, 2):
        if a < b:
            assert len(b - a) >= m


def test_small_region_is_aggregated_with_its_named_neighbour():
    counts = {"north": 21, "central": 15, "south": 12, "west": 9, "islands": 3}
    groups = aggregation_groups(ONE_EACH, counts, NEIGHBOURS, 5)
    assert groups == {"north": ("north",), "central": ("central",), "south": ("south",),
                      "islands+west": ("islands", "west")}


def test_merging_cascades_until_every_group_reaches_the_floor():
    counts = {"north": 21, "central": 2, "south": 1, "west": 1, "islands": 1}
    groups = aggregation_groups(ONE_EACH, counts, NEIGHBOURS, 5)
    sizes = {g: sum(counts[r] for r in mem) for g, mem in groups.items()}
    assert all(n >= 5 for n in sizes.values())
    assert sorted(r for mem in groups.values() for r in mem) == sorted(NEIGHBOURS)


def test_a_federation_below_the_floor_is_one_group_below_it_and_regions_without_clients_stay():
    groups = aggregation_groups(ONE_EACH, {"north": 2, "central": 1}, NEIGHBOURS, 5)
    assert groups["central+north"] == ("central", "north")
    assert {"south", "west", "islands"} <= set(groups)  # no participants: left alone


@pytest.mark.parametrize("seed", range(20))
def test_random_partitions_keep_the_floor(seed):
    rng = np.random.default_rng(seed)
    counts = {r: int(rng.integers(0, 12)) for r in NEIGHBOURS}
    m = int(rng.integers(2, 9))
    groups = aggregation_groups(ONE_EACH, counts, NEIGHBOURS, m)
    live = {g: sum(counts[r] for r in mem) for g, mem in groups.items()}
    live = {g: n for g, n in live.items() if n > 0}
    if sum(live.values()) >= m:
        assert all(n >= m for n in live.values())
    else:
        assert len(live) <= 1
    assert sorted(r for mem in groups.values() for r in mem) == sorted(NEIGHBOURS)


def _engine(dropout_rate: float, clients: int = 40):
    cfg = validate_config({
        "name": "diff", "seed": 3, "rounds": 2, "clients": clients,
        "data": {"probe_size": 32}, "tracking": {"enabled": False},
        "budget": {"enabled": False}, "divergence": {"enabled": False},
        "training": {"local_epochs": 1},
        "evaluation": {"epsilon": 2.0, "min_cohort": 5, "dropout_rate": dropout_rate,
                       "noise_seeded": True},
    })
    sim = build_federation(cfg)
    return FederationEngine(cfg, sim.assets(), SimulatedClients(sim)), sim


@pytest.mark.parametrize("dropout_rate", [0.0, 0.15])
def test_the_audit_record_keeps_the_rule_and_the_global_sum_is_the_sum_of_the_groups(
        dropout_rate):
    engine, sim = _engine(dropout_rate)
    res = engine.run_round(1)
    ev = res.evaluation
    sets = [set(a["clients"]) for a in ev.audit]
    assert sets, "the round learned at least one sum"
    _check_rule(sets, 5)
    for a, b in itertools.combinations(sets, 2):
        assert not a & b  # a partition: disjoint
    # the 40 clients' smallest region has 2 clients: never summed on its own
    region_of = sim.region_of()
    for a in ev.audit:
        assert {region_of[c] for c in a["clients"]} <= set(a["group"].split("+"))
    # global = sum of the ok groups (post-processing, no session of its own)
    ok = [a for a in ev.audit if a["status"] == "ok"]
    g = ev.server["accuracy|global"]
    assert g.contributors == sum(len(a["clients"]) for a in ok)
    assert all(a["group"] != GLOBAL for a in ev.audit)


def test_unchanged_models_are_not_summed_again_over_another_set(monkeypatch):
    """Two evaluations of the same models over survivor sets that differ by one client
    would reveal that client's report: the second one is refused before unmasking."""
    engine, _ = _engine(0.0)
    ctx = engine.begin_round(1)
    engine.accept(ctx, [engine.train(ctx)])
    engine.after_training(ctx)
    first = engine.secure_sums(ctx)
    assert all(g.status == "ok" for g in first.groups.values())
    import clma.sim.clients as sc

    victim = sorted(first.audit, key=lambda a: a["group"])[0]
    drop = victim["clients"][0]
    monkeypatch.setattr(sc, "simulated_dropouts",
                        lambda seed, rate, ids, r: {drop: "masked_input"})
    second = engine.secure_sums(ctx)  # same round, same models, one client fewer
    assert second.groups[victim["group"]].status == "refused"
    assert all(a["group"] != victim["group"] for a in second.audit)
    others = [a for a in second.audit]
    assert all(set(a["clients"]) == set(b["clients"]) for a in others for b in first.audit
               if a["group"] == b["group"])


def _learned_elements(audits) -> list[set]:
    return [{(c, d) for d, cs in a["models"].items() for c in cs} for a in audits]


def _trained_round(clients: int = 40):
    engine, sim = _engine(0.0, clients)
    ctx = engine.begin_round(1)
    engine.accept(ctx, [engine.train(ctx)])
    engine.after_training(ctx)
    reg = engine.state.registry
    assignments = {c: int(reg.cohort_of(c)) for c in ctx.participants}
    return engine, ctx, assignments


def test_a_group_renamed_by_a_merge_is_not_a_way_around_the_floor():
    """Review case 1: region g at exactly m clients is summed alone; later, one of its
    clients missing, g falls below the floor and is merged with its neighbour under a new
    name. With unchanged models, g + neighbour - merged is that one client's report: the
    merged session is refused, and the learned sets keep the rule."""
    from clma.privacy.differencing import exposed_clients

    engine, ctx, assignments = _trained_round()
    ev, m = engine.evaluator, engine.evaluator.min_cohort
    region_of = engine.region_of
    by_region: dict[str, list[int]] = {}
    for c in sorted(ctx.participants):
        by_region.setdefault(region_of[c], []).append(c)
    g = next(r for r, cs in sorted(by_region.items()) if len(cs) >= m and r != "islands")
    first_ids = [c for c in ctx.participants if region_of[c] != g] + by_region[g][:m]
    models = engine.state.cohort_models
    first = ev.secure_sums(engine.clients, 1, first_ids, region_of, assignments, models)
    assert first.groups[g].status == "ok" and first.groups[g].contributors == m
    second_ids = [c for c in first_ids if c != by_region[g][0]]  # one client missing
    second = ev.secure_sums(engine.clients, 1, second_ids, region_of, assignments, models)
    merged = next(name for name in second.groups if g in name.split("+") and "+" in name)
    assert second.groups[merged].status == "refused"
    assert all(a["group"] != merged for a in second.audit)
    learned = _learned_elements(first.audit + second.audit)
    assert exposed_clients(learned, m) is None


def test_identical_parameters_under_a_new_cohort_id_are_the_same_unknowns():
    """Review case 2: a split while training is backed off gives a new cohort bit-identical
    parameters; the cohort id must not make them count as changed. One client fewer over
    the same parameters is refused."""
    from clma.privacy.differencing import exposed_clients

    engine, ctx, assignments = _trained_round()
    ev, m = engine.evaluator, engine.evaluator.min_cohort
    models = dict(engine.state.cohort_models)
    first = ev.secure_sums(engine.clients, 1, ctx.participants, engine.region_of,
                           assignments, models)
    victim = sorted(first.audit, key=lambda a: (-len(a["clients"]), a["group"]))[0]
    moved = victim["clients"][1:3]
    (k,) = {assignments[c] for c in victim["clients"]}
    new_id = max(models) + 7
    models[new_id] = models[k].copy()  # the new cohort starts from the source model
    split = {**assignments, **{c: new_id for c in moved}}
    ids = [c for c in ctx.participants if c != victim["clients"][0]]
    second = ev.secure_sums(engine.clients, 1, ids, engine.region_of, split, models)
    assert second.groups[victim["group"]].status == "refused"
    learned = _learned_elements(first.audit + second.audit)
    assert exposed_clients(learned, m) is None
    # the audit names the digests: the new cohort's clients carry the source's digest
    (digest,) = {d for d, cs in victim["models"].items()}
    assert set(victim["models"][digest]) == set(victim["clients"])


_ENGINE_CACHE: dict[str, tuple] = {}


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_participation_and_dropouts_never_admit_a_sum_below_the_floor(data, monkeypatch):
    """Unchanged parameters (the worst case: every sum is over the same unknowns), three
    secure aggregations over random participants, random dropouts and random models per
    cohort id: the learned sets, read back from the audit records alone, keep the rule."""
    import clma.sim.clients as sc
    from clma.privacy.differencing import exposed_clients

    if "e" not in _ENGINE_CACHE:
        _ENGINE_CACHE["e"] = _trained_round()
    engine, ctx, assignments = _ENGINE_CACHE["e"]
    ev, m = engine.evaluator, engine.evaluator.min_cohort
    ev.state.learned.clear()  # each example starts with an empty memory
    ids = sorted(ctx.participants)
    models = dict(engine.state.cohort_models)
    (k,) = set(models) if len(models) == 1 else (min(models),)
    audits = []
    for _ in range(3):
        part = data.draw(st.lists(st.sampled_from(ids), min_size=m, unique=True), "part")
        drop = data.draw(st.sets(st.sampled_from(part), max_size=3), "drop")
        # a split under a new id with the same parameters, for some clients
        renamed = data.draw(st.sets(st.sampled_from(part), max_size=6), "renamed")
        ms = {**models, k + 100: models[k].copy()}
        asg = {**assignments, **{c: k + 100 for c in renamed if assignments[c] == k}}
        monkeypatch.setattr(sc, "simulated_dropouts",
                            lambda seed, rate, ids, r, d=drop: {c: "masked_input" for c in d
                                                                if c in ids})
        out = ev.secure_sums(engine.clients, 1, sorted(part), engine.region_of, asg, ms)
        audits += out.audit
    assert exposed_clients(_learned_elements(audits), m) is None


def test_a_crash_between_the_sums_and_the_commit_keeps_the_memory(tmp_path):
    """Review case 3: the sets are journalled (fsync'ed) before unmasking, so a resume
    from the last commit still knows them; without the journal it would not."""
    from clma.engine.evaluation import EvaluationState
    from clma.state import StateStore

    engine, ctx, assignments = _trained_round()
    ev = engine.evaluator
    committed = ev.state.to_dict()  # what the last commit holds (before this round's sums)
    store = StateStore(tmp_path / "st")
    assert ev.attach_journal(store.append_learned, store.learned_entries()) == 0
    models = engine.state.cohort_models
    first = ev.secure_sums(engine.clients, 1, ctx.participants, engine.region_of,
                           assignments, models)
    journal = store.learned_entries()
    assert [(e["group"], sorted(c for cs in e["models"].values() for c in cs))
            for e in journal] == [(a["group"], a["clients"]) for a in first.audit]
    victim = sorted(first.audit, key=lambda a: a["group"])[0]
    fewer = [c for c in ctx.participants if c != victim["clients"][0]]

    def resumed(with_journal: bool):
        ev.server_state.evaluation = EvaluationState.from_dict(committed)  # the crash
        ev.on_learned = None
        if with_journal:
            assert ev.attach_journal(store.append_learned, store.learned_entries()) == \
                len(journal)
        return ev.secure_sums(engine.clients, 1, fewer, engine.region_of, assignments,
                              models)

    assert resumed(with_journal=False).groups[victim["group"]].status == "ok"  # the hole
    again = resumed(with_journal=True)
    assert again.groups[victim["group"]].status == "refused"
    # the journal only grows: the first attempt's lines are all still there
    assert store.learned_entries()[:len(journal)] == journal


def test_the_round_audit_file_keeps_what_an_earlier_attempt_learned(tmp_path):
    from clma.state import StateStore

    store = StateStore(tmp_path / "st")
    a = {"group": "north", "session": "s1", "clients": [1, 2], "status": "ok",
         "models": {"d": [1, 2]}}
    b = {**a, "session": "s2", "clients": [1], "models": {"d": [1]}}
    store.write_audit(4, [a])
    path = store.write_audit(4, [b, a])  # the re-run of round 4
    import json

    assert json.loads(path.read_text())["secure_sums"] == [a, b]


@pytest.mark.slow
def test_the_production_policy_with_training_backed_off_keeps_the_rule():
    """The review's end-to-end setting: privacy_policy_v3 (the default policy), DP-FedAvg
    with noise multiplier 1, participation 0.5, no drift, 10 % dropouts, evaluation every
    round. The training line runs out after two rounds, training backs off and the models
    stay bit-identical: every later sum is over the same unknowns. Everything learned, as
    the audit records and the server's memory show it, keeps the rule."""
    from clma.engine import open_budget
    from clma.privacy.differencing import exposed_clients

    cfg = validate_config({
        "name": "diff-e2e", "seed": 2, "rounds": 8, "clients": 60,
        "data": {"probe_size": 32}, "tracking": {"enabled": False},
        "divergence": {"enabled": False}, "drift": {"events": []},
        "training": {"local_epochs": 1, "participation": 0.5,
                     "dp": {"enabled": True, "noise_multiplier": 1.0, "noise_seeded": True}},
        "evaluation": {"min_cohort": 5, "dropout_rate": 0.1, "noise_seeded": True,
                       "every": 1},
        "testing": {"allow_seeded_noise_not_private": True},
    })
    assert cfg.budget.policy is None  # the shipped production policy
    sim = build_federation(cfg)
    budget = open_budget(cfg)
    engine = FederationEngine(cfg, sim.assets(), SimulatedClients(sim), budget=budget)
    audits, unchanged = [], []
    try:
        for r in range(1, 9):
            before = {k: v.tobytes() for k, v in engine.state.cohort_models.items()}
            res = engine.run_round(r)
            unchanged.append(before == {k: v.tobytes()
                                        for k, v in engine.state.cohort_models.items()})
            audits += [dict(a, round=r) for a in res.evaluation.audit]
    finally:
        budget.close()
    assert unchanged[:2] == [False, False] and all(unchanged[2:])  # backed off from round 3
    later = [a for a in audits if a["round"] >= 3]
    assert len({a["round"] for a in later}) >= 4  # sums over unchanged models, many rounds
    m = engine.evaluator.min_cohort
    assert exposed_clients(_learned_elements(audits), m) is None
    assert exposed_clients(engine.evaluator.state.learned_sets(), m) is None
