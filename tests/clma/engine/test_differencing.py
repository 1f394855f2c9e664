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
