"""clma.engine.evaluation (PrivateEvaluator) on a tiny federation, driven through the
library (simulated clients over the Clients seam, no Prefect): secure sums, dropouts and
the threshold, envelopes, no exact counts in published outputs, alerts, the configured
policy's cohort floor."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clma.engine.evaluation import QUANTISATION_LEVELS, EvaluationState
from clma.metrics import compute_device_report
from clma.privacy.secagg import FixedPointQuantiser, secagg_plus_parameters
from clma.release import FederatedMetricEnvelope
from clma.sim.clients import simulated_dropouts
from clma.sim.training import predict_proba

MASK32 = np.uint64(2**32 - 1)  # secure aggregation works modulo 2^32 (modulus_bits = 32)


def _north(engine, k=None):
    north = sorted(c for c, r in engine.region_of.items() if r == "north")
    return north if k is None else north[:k]


def test_min_cohort_is_raised_to_the_policy_floor(tiny_config, make_engine):
    assert make_engine(tiny_config(evaluation={"min_cohort": 2})).evaluator.min_cohort == 5
    assert make_engine(tiny_config(evaluation={"min_cohort": 7})).evaluator.min_cohort == 7


def test_secure_sums_equal_plain_sums_of_clipped_values(tiny_config, make_engine, secure_sums,
                                                        device_reports):
    engine = make_engine(tiny_config())
    layout = engine.evaluator.state.layout()
    sums = secure_sums(engine, 1)
    q = device_reports(engine, 1)
    quant = FixedPointQuantiser(layout.lower_bounds(), layout.upper_bounds(), QUANTISATION_LEVELS)
    ok = [g for g, s in sums.groups.items() if s.status == "ok"]
    assert "global" in ok and len(ok) >= 2
    sim = engine.clients.federation
    for name in ok:
        g = sums.groups[name]
        members = [c for c in sorted(q) if name == "global" or engine.region_of[c] in g.members]
        assert g.contributors == len(members) == g.selected and g.dropped == 0
        exact = sum(q[c] for c in members) & MASK32
        np.testing.assert_array_equal(g.sum_quantised, exact)  # exact integer sum
        plain = np.zeros(32)
        for c in members:  # the plain sum of the clipped on-device reports
            _, _, x, y = sim.clients[c].current()  # round 1: no drift event yet
            rep = compute_device_report(predict_proba(sim.spec, engine.state.cohort_models[0], x),
                                        y, layout)
            plain += rep.vector
        tol = len(members) * (layout.upper_bounds() - layout.lower_bounds()) / (2 * quant.levels)
        assert np.all(np.abs(g.sum - plain) <= tol + 1e-12)
    # a region below the floor is summed only together with its named neighbour: every
    # group the server learns a sum of has at least m clients, and the groups partition
    # the participants (the global value is their sum, not a second secure sum)
    assert sums.below_alone and any("+" in g for g in sums.groups)
    assert all(s.contributors >= 5 for s in sums.groups.values() if s.status == "ok")
    regions = [r for g, s in sums.groups.items() if g != "global" for r in s.members]
    assert sorted(regions) == sorted(engine.assets.partition.region_ids)
    assert sums.groups["global"].contributors == sum(
        s.contributors for g, s in sums.groups.items() if g != "global" and s.status == "ok")


def test_dropouts_up_to_n_minus_t_still_release(tiny_config, make_engine, secure_sums,
                                                device_reports):
    """North: 7 clients, assumed dropouts 30 % capped by the floor (at most 7 - 5 = 2
    may drop): the SecAgg+ graph of degree 4 and t = 3
    (clma.privacy.secagg.secagg_plus_parameters); two dropouts leave 5 survivors, at the
    floor and above t: the sum is exact."""
    cfg = tiny_config(evaluation={"secagg_dropout_fraction": 0.3})
    p = secagg_plus_parameters(7, corrupted_fraction=0.05, dropout_fraction=2 / 7 * (1 - 1e-9))
    assert (p.degree, p.threshold) == (4, 3)
    probe = make_engine(cfg)
    north = _north(probe)
    engine = make_engine(cfg, drops={c: "masked_input" for c in north[:2]})
    sums = secure_sums(engine, 1)
    g = sums.groups["north"]
    assert (len(north), g.threshold, g.contributors, g.dropped, g.status) == (7, 3, 5, 2, "ok")
    q = device_reports(engine, 1)
    np.testing.assert_array_equal(g.sum_quantised, sum(q[c] for c in north[2:]) & MASK32)
    out = engine.evaluator.release_all(engine.evaluator.open_round(sums))
    assert "north" in out.published["metrics"]["accuracy"]["regions"]
    assert out.not_evaluated == {}
    # one leaves before its masked input, one before unmasking: still n - t = 2 gone; the
    # second's input is in the sum (its masks are removed with the others' shares)
    engine = make_engine(cfg, drops={north[0]: "masked_input", north[1]: "unmasking"})
    g = secure_sums(engine, 1).groups["north"]
    assert (g.status, g.contributors, g.dropped) == ("ok", 6, 2)
    np.testing.assert_array_equal(g.sum_quantised, sum(q[c] for c in north[1:]) & MASK32)
    # one never advertises keys, one leaves before sharing them: neither is in the sum,
    # and the others' masks with them cancel (nobody shares keys with a silent client)
    engine = make_engine(cfg, drops={north[0]: "advertise", north[1]: "share_keys"})
    sums = secure_sums(engine, 1)
    for gname, n in (("north", 7), ("global", 20)):
        g = sums.groups[gname]
        assert (g.status, g.selected, g.dropped, g.contributors) == ("ok", n, 2, n - 2)
    np.testing.assert_array_equal(sums.groups["north"].sum_quantised,
                                  sum(q[c] for c in north[2:]) & MASK32)
    # three gone (more than n - t): fewer masked inputs than the floor, nothing learned
    engine = make_engine(cfg, drops={c: "masked_input" for c in north[:3]})
    sums = secure_sums(engine, 1)
    assert sums.groups["north"].status == "below_floor" and sums.groups["north"].sum is None
    out = engine.evaluator.release_all(engine.evaluator.open_round(sums))
    assert "north" not in out.published["metrics"]["accuracy"]["regions"]


def test_below_threshold_region_is_not_evaluated(tiny_config, make_engine, secure_sums):
    """Assuming 40 % corrupted clients and no dropouts, north's 7 clients need t = 5 of
    each client's 5 holders: one client silent at unmasking aborts the group (never an
    approximate sum)."""
    cfg = tiny_config(evaluation={"secagg_corrupted_fraction": 0.4,
                                  "secagg_dropout_fraction": 0.0})
    p = secagg_plus_parameters(7, corrupted_fraction=0.4, dropout_fraction=0.0)
    assert (p.degree, p.threshold) == (4, 5)
    engine = make_engine(cfg, drops={_north(make_engine(cfg))[0]: "unmasking"})
    sums = secure_sums(engine, 1)
    assert (sums.groups["north"].status, sums.groups["north"].threshold) == ("aborted", 5)
    assert sums.groups["north"].sum is None
    out = engine.evaluator.release_all(engine.evaluator.open_round(sums))
    assert list(out.not_evaluated) == ["north"]
    assert out.published["not_evaluated"] == ["north"]
    assert "north" not in out.published["metrics"]["accuracy"]["regions"]
    assert not any(r.region == "north" and r.name == "accuracy" for r in out.releases)
    # the group still gets a (suppressed) envelope
    env = FederatedMetricEnvelope.from_json(out.envelopes["accuracy/north.json"])
    assert env.aggregate_value is None and env.participant_count_band.value == "suppressed"


def test_simulated_dropouts_are_the_devices_seeded_draw(tiny_config, make_engine, secure_sums):
    """``evaluation.dropout_rate``: the simulated devices leave at the drawn step; the
    server sees exactly those as dropouts (none asked for anything after leaving)."""
    cfg = tiny_config(evaluation={"dropout_rate": 0.3})
    engine = make_engine(cfg)
    ids = engine.roster.client_ids
    drawn = simulated_dropouts(cfg.seed, 0.3, ids, 1)
    assert drawn == simulated_dropouts(cfg.seed, 0.3, list(reversed(ids)), 1)  # seeded
    assert drawn != simulated_dropouts(cfg.seed, 0.3, ids, 2)
    assert drawn and set(drawn.values()) <= {"masked_input", "unmasking"}
    g = secure_sums(engine, 1).groups["global"]
    assert (g.selected, g.dropped) == (20, len(drawn))
    # a client that left before unmasking sent its masked input: it is in the sum
    left_early = [c for c, stage in drawn.items() if stage == "masked_input"]
    assert g.status == "ok" and g.contributors == 20 - len(left_early)
    # the draw's rate: over many clients, within 4 standard errors of 0.3; stages ~ half
    many = simulated_dropouts(7, 0.3, range(4000), 3)
    se = np.sqrt(0.3 * 0.7 / 4000)
    assert abs(len(many) / 4000 - 0.3) < 4 * se
    share = sum(s == "masked_input" for s in many.values()) / len(many)
    assert abs(share - 0.5) < 4 * np.sqrt(0.25 / len(many))
    assert simulated_dropouts(7, 0.0, range(100), 3) == {}


def test_envelopes_validate_and_nothing_published_holds_a_count(tiny_config, make_engine,
                                                                secure_sums):
    engine = make_engine(tiny_config(evaluation={"dropout_rate": 0.1}))
    sums = secure_sums(engine, 1)
    assert sums.groups["global"].dropped > 0  # the dropout path is exercised
    out = engine.evaluator.release_all(engine.evaluator.open_round(sums))
    assert out.envelopes
    for text in out.envelopes.values():
        env = FederatedMetricEnvelope.from_json(text)
        assert env.to_json() == text
        if env.aggregate_value is not None:
            assert env.uncertainty_method.value == "confidence_interval"
            lo, hi = env.clipping_lower_bound, env.clipping_upper_bound
            assert lo <= env.uncertainty_lower_bound <= env.aggregate_value
            assert env.aggregate_value <= env.uncertainty_upper_bound <= hi
    pub = json.dumps(out.published)
    for key in ("contributors", "participant_count\"", "selected", "dropped", "client"):
        assert key not in pub
    # every release made is one envelope or histogram bucket set; global bar from band edge
    g = out.server["accuracy|global"]
    assert out.published["metrics"]["accuracy"]["global"]["error_bar"] == g.published_error_bar
    band = out.published["metrics"]["accuracy"]["global"]["participant_band"]
    lower = {"minimum_to_under_double": 5, "double_to_under_fourfold": 10,
             "fourfold_or_more": 20}[band]
    # Laplace, sensitivity 1, epsilon 2: bar = (1/2) ln 20 / (band's lower edge)
    assert g.published_error_bar == pytest.approx(0.5 * np.log(20) / lower, rel=1e-12)
    assert g.published_error_bar >= g.error_bar
    for r in out.releases:
        assert r.line == ("evaluation.global" if r.region == "global" else "evaluation.regional")
        assert r.epsilon == (0.5 if r.name.startswith("health") else 2.0)  # full, not divided


def _fixed(acc):
    v = np.zeros(32)
    v[0], v[1] = acc, 0.5
    return lambda c: v


@pytest.mark.parametrize("factor, fires", [(0.25, False), (2.0, True)])
def test_alert_fires_only_beyond_the_combined_bars(tiny_config, make_engine,
                                                   secure_sums, factor, fires):
    engine = make_engine(tiny_config(evaluation={"epsilon": 50.0}), report=_fixed(0.8))
    ev = engine.evaluator
    first = ev.release_all(ev.open_round(secure_sums(engine, 1)))
    assert first.alerts == [] and "global" in first.published["new_baselines"]["accuracy"]
    bar = first.published["metrics"]["accuracy"]["global"]["error_bar"]
    engine.clients.report = _fixed(0.8 - factor * 2 * bar)
    out = ev.release_all(ev.open_round(secure_sums(engine, 2)))
    fired = {(a.metric, a.region) for a in out.alerts}
    assert (("accuracy", "global") in fired) is fires
    assert out.published["alerts_fired"] == len(out.alerts)
    # baselines persist in the server state and survive a JSON round trip
    state = ev.state
    assert engine.state.evaluation is state and state.evaluations_done == 2
    assert EvaluationState.from_dict(json.loads(json.dumps(state.to_dict()))) == state


def test_unapproved_releases_are_refused_before_noise(tiny_config, make_engine, secure_sums,
                                                      sampler_spy):
    engine = make_engine(tiny_config())
    ev = engine.evaluator.open_round(secure_sums(engine, 1))
    approved = {r.key for r in ev.plan.releases if r.region == "global"}
    out = engine.evaluator.release_all(ev, approved=approved)
    assert out.refused and all(r.region != "global" for r in out.refused)
    assert out.releases and all(r.region == "global" for r in out.releases)
    assert {r.key for r in out.releases} == approved
    assert len(sampler_spy) == len(out.releases)  # one draw per approved release, none else
    assert out.published["metrics"]["accuracy"]["regions"] == {}
    assert [r["key"] for r in out.published["refused_releases"]] == [r.key for r in out.refused]


# ------------------------------------------------------------- the configured policy


@pytest.mark.parametrize("with_ledger", [False, True])
def test_configured_policy_floor_reaches_the_cohort_floor_and_the_envelopes(
        tiny_config, make_engine, secure_sums, evaluate_round, write_policy, tmp_path,
        with_ledger):
    """A ``budget.policy`` whose floor (7) differs from the shipped one (5): the engine's
    cohort floor, the secure sums (central's 5 clients are below it, so central is summed
    with its named neighbour north) and every envelope's minimum group size follow it (the
    old code read a ``fed.policy`` nothing set, so the shipped floor was used whatever the
    config said)."""
    policy = write_policy("simulation_policy_v1.toml", minimum_group_size=7,
                          regional_cadence_rounds=1)
    budget = {"enabled": with_ledger, "policy": str(policy), "state_dir": str(tmp_path / "led")}
    cfg = tiny_config(evaluation={"min_cohort": 2}, budget=budget)
    engine = make_engine(cfg, budget=True if with_ledger else None)
    assert engine.policy.evaluation.minimum_group_size == 7
    assert engine.evaluator.min_cohort == 7
    if not with_ledger:  # control: under the shipped floor north (7) is summed on its own
        shipped = make_engine(tiny_config(evaluation={"min_cohort": 2}))
        assert shipped.evaluator.min_cohort == 5
        control = secure_sums(shipped, 1)
        assert control.groups["north"].status == "ok" and "central" not in control.below_alone
    sums = secure_sums(engine, 1)
    (with_central,) = [g for g in sums.groups if "central" in g.split("+")]
    assert with_central != "central" and sums.groups[with_central].status == "ok"
    assert sums.groups[with_central].contributors >= 7
    assert sums.groups["north"].status == "ok"  # 7 clients: at the floor, on its own
    assert "central" in sums.below_alone and "north" not in sums.below_alone
    assert sums.min_cohort == 7
    if with_ledger:
        assert engine.budget.policy.policy_version == "clma-privacy-policy-test"
        _, out = evaluate_round(engine, 1)
        assert out.published["budget"]["refused"] == {}
    else:
        out = engine.evaluator.release_all(engine.evaluator.open_round(sums))
    assert out.published["min_cohort"] == 7
    regions = out.published["metrics"]["accuracy"]["regions"]
    assert with_central in regions and "north" in regions and "central" not in regions
    assert out.envelopes
    for text in out.envelopes.values():
        assert json.loads(text)["minimum_group_size"] == 7
    assert "accuracy/central.json" not in out.envelopes  # never released on its own
    north = FederatedMetricEnvelope.from_json(out.envelopes["accuracy/north.json"])
    assert north.participant_count_band.value == "minimum_to_under_double"  # 7 <= n < 14


def test_secure_graph_seed_is_keyed_by_the_server_secret_and_survives_a_resume(
        tiny_config, make_engine):
    """Under secure noise the SecAgg+ graph seed is HMAC-SHA256(server key, round|group)
    (not derivable from the published seed), and the same after the state is saved and
    restored, so a resumed round re-sends the request the devices already answered."""
    import hashlib
    import hmac

    from clma.engine.state import restore_files, snapshot_files

    cfg = tiny_config(evaluation={"noise_seeded": False})
    eng = make_engine(cfg)
    members = list(range(8))
    first = eng.evaluator.session_config("north", members, 2, 32)
    key = eng.state.selection_key
    assert first is not None and key is not None and len(key) == 32
    want = int.from_bytes(hmac.new(key, b"clma-secagg-graph|2|north", hashlib.sha256)
                          .digest()[:8], "little") % 2**63
    assert first.graph_seed == want
    assert eng.evaluator.session_config("north", members, 2, 32).graph_seed == want
    assert eng.evaluator.session_config("north", members, 4, 32).graph_seed != want
    assert eng.evaluator.session_config("south", members, 2, 32).graph_seed != want
    # a new engine on the restored state (a resume) draws the same seed ...
    restored = restore_files(snapshot_files(eng.state), eng.state.rounds_done)
    again = make_engine(cfg, state=restored).evaluator.session_config("north", members, 2, 32)
    assert again.graph_seed == want
    # ... and another federation's key another one
    other = make_engine(cfg).evaluator.session_config("north", members, 2, 32)
    assert other.graph_seed != want
