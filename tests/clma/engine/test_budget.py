"""clma.engine.budget: charges before noise, idempotent re-runs, the borrowing gate, the
policy's regional cadence, training back-off, and the DP-FedAvg step
(clma.rounds.dp_fedavg) against its literal formulas and noise scale. Library calls
only: the engine's evaluator over simulated clients and the federation's ledger."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from clma.budget import LineItem, decide_borrow
from clma.config import BudgetConfig, DPFedAvgConfig, load_config
from clma.engine import make_cohorter, open_budget
from clma.engine.budget import (
    TRAINING_RELEASE,
    charge_plans,
    coarse_size,
    dp_aggregate,
    dp_commit,
    dp_new_cohort_model,
    ledger_round,
    regional_on_cadence,
)
from clma.engine.state import restore_files, snapshot_files
from clma.rounds import ClientUpdate, clip_update, dp_fedavg
from tests.clma.approval_keys import signed

SMALL = Path(__file__).parents[2] / "flows" / "small.toml"


@pytest.fixture
def small_config(tmp_path, write_policy):
    """``small_config(epsilon_cap=..., epoch_rounds=10, cadence=1, **dp)``: small.toml
    (10 clients, evaluation epsilon 2) with a ledger in tmp and the shipped policy with
    that per-epoch cap, epoch length and regional cadence, and the test approvers' keys."""

    def make(*, epsilon_cap: float, epoch_rounds: int = 10, cadence: int = 1, **dp):
        policy = write_policy(epsilon_per_client_per_epoch=float(epsilon_cap),
                              epoch_length_rounds=epoch_rounds, regional_cadence_rounds=cadence,
                              approver_keys=True)
        cfg = load_config(SMALL).with_overrides(rounds=3)
        return cfg.model_copy(update={
            "budget": BudgetConfig(state_dir=str(tmp_path / "state"), policy=str(policy)),
            "training": cfg.training.model_copy(update={"dp": DPFedAvgConfig(**dp)}),
            "tracking": cfg.tracking.model_copy(update={"enabled": False}),
        })

    return make


# --------------------------------------------------------------------------- evaluation


def test_refused_charges_draw_no_noise(small_config, make_engine, evaluate_round, sampler_spy):
    # a cap so small that every release is refused: nothing may be drawn
    engine = make_engine(small_config(epsilon_cap=1e-6), budget=True)
    plans = charge_plans(engine.evaluator)
    view, out = evaluate_round(engine, 1)
    assert set(view["budget"]["refused"]) == {p.name for p in plans}
    assert set(view["budget"]["refused"].values()) == {"exceeds_line_cap"}
    assert view["budget"]["released"] == []
    assert sampler_spy == []
    # the round publishes nothing but refusals (and suppressed envelopes)
    assert out.releases == [] and out.refused
    refused = {f"{'global' if r.region == 'global' else 'regional'}.{r.name}"
               for r in out.refused}
    assert refused <= {p.name for p in plans}  # (no region reaches the floor in small.toml)
    assert {"global.accuracy", "global.mean_loss", "global.health.dropout_rate"} <= refused
    assert out.published["metrics"]["accuracy"]["global"] is None
    assert out.published["metrics"]["accuracy"]["regions"] == {}
    budget = engine.budget
    assert budget.ledger.entries() == []
    refusals = [d for d in budget.ledger.decisions() if d["kind"] == "charge_refused"]
    assert sorted(d["detail"]["release"] for d in refusals) == sorted(p.name for p in plans)
    assert all(d["policy_version"] == "clma-privacy-policy-test" for d in refusals)


def test_granted_charges_draw_noise_after_the_charge(small_config, make_engine, evaluate_round,
                                                     sampler_spy):
    """Control for the test above: with room in the lines, noise is drawn, and every
    drawn release has a ledger entry (the spy can see draws)."""
    engine = make_engine(small_config(epsilon_cap=1000.0), budget=True)
    view, out = evaluate_round(engine, 1)
    assert view["budget"]["refused"] == {}
    assert len(sampler_spy) == len(out.releases) > 0  # one draw per group release
    names = {e["release"] for e in engine.budget.ledger.entries()}
    assert names == set(view["budget"]["released"]) == {p.name for p in charge_plans(
        engine.evaluator)} - {"global.error_histogram"}
    assert {e["status"] for e in engine.budget.ledger.entries()} == {"committed"}
    assert out.published["budget"] == view["budget"]


def test_rerun_of_a_round_charges_once_and_draws_nothing(small_config, make_engine,
                                                         evaluate_round, sampler_spy):
    cfg = small_config(epsilon_cap=1000.0)
    engine = make_engine(cfg, budget=True)
    before = snapshot_files(engine.state)
    first, _ = evaluate_round(engine, 1)
    budget = engine.budget
    spent = {line: budget.ledger.spent(0, line).epsilon for line in LineItem}
    n_draws = len(sampler_spy)
    entries = budget.ledger.entries()
    # a retry or a re-run after a crash: a fresh process restores the server state as it
    # was before the round and opens the same (durable) ledger; same keys (epoch, round,
    # release)
    again = make_engine(cfg, budget=open_budget(cfg), state=restore_files(before, 0))
    second, _ = evaluate_round(again, 1)
    assert len(sampler_spy) == n_draws  # no new noise
    assert second["budget"]["released"] == []
    assert sorted(second["budget"]["republished"]) == sorted(first["budget"]["released"])
    assert second["metrics"] == first["metrics"]
    ledger = again.budget.ledger
    assert {line: ledger.spent(0, line).epsilon for line in LineItem} == spent
    assert [(e["release"], e["attempts"]) for e in ledger.entries()] == [
        (e["release"], 1) for e in entries]
    assert spent[LineItem.EVALUATION_GLOBAL] > 0 and spent[LineItem.EVALUATION_REGIONAL] > 0


def test_overspend_goes_to_the_gate_once_and_an_approved_borrow_releases(
        small_config, make_engine, evaluate_round):
    # cap 20: each evaluation line holds 3.0 = one release at epsilon 2 (small.toml), not
    # two; the policy lets a line borrow up to 0.5 * 3.0 = 1.5 from the next epoch
    engine = make_engine(small_config(epsilon_cap=20.0, epoch_rounds=1), budget=True)
    budget = engine.budget
    plans = charge_plans(engine.evaluator)
    assert engine.config.evaluation.epsilon == 2.0
    asked = []

    def approving_gate(b, request):
        assert b is budget
        asked.append(request)
        # an approval counts only signed by a key the policy lists (issue 19)
        return decide_borrow(*signed(request, "privacy-officer"), b.policy, b.ledger)

    view, _ = evaluate_round(engine, 1, gate=approving_gate)
    # one request only: after an approved borrow, a second one in the epoch would be refused
    assert len(asked) == 1
    line = asked[0].line
    first = next(p for p in plans if p.line is line)
    # epoch of one round: the request is exactly the shortfall of the second release
    assert asked[0].epsilon == pytest.approx(2 * first.epsilon - 3.0, rel=1e-6)
    assert budget.policy.line_cap(line)[0] == pytest.approx(3.0)
    assert first.name in view["budget"]["released"]
    second = [p.name for p in plans if p.line is line and p.epsilon == first.epsilon][1]
    assert second in view["budget"]["released"]  # released thanks to the borrow
    borrows = budget.ledger.borrows(0)
    assert [(b["approved"], b["approver"]) for b in borrows] == [(1, "privacy-officer")]
    assert view["budget"]["borrows"][0]["approved"] is True
    skipped = [e for e in budget.events if e["kind"] == "borrow_not_requested"]
    assert skipped and all(e["reason"] == "already_borrowed_this_epoch" for e in skipped)
    # whatever was released after the borrow is charged within the raised cap
    for ln in (LineItem.EVALUATION_GLOBAL, LineItem.EVALUATION_REGIONAL):
        row = next(r for r in budget.ledger.table(0) if r.line_item == ln.value)
        assert row.spent_epsilon <= row.cap_epsilon + 1e-12


def test_regional_releases_follow_the_policy_cadence(small_config, make_engine, evaluate_round,
                                                     sampler_spy):
    engine = make_engine(small_config(epsilon_cap=1000.0, cadence=2), budget=True)
    budget = engine.budget
    assert [regional_on_cadence(budget.policy, r) for r in (1, 2, 3, 4)] == [False, True, False, True]
    view, out = evaluate_round(engine, 3)
    assert view["budget"]["off_cadence"] and all(
        n.startswith("regional.") for n in view["budget"]["off_cadence"])
    assert {f"regional.{n}" for n in ("accuracy", "mean_loss", "health.dropout_rate")} == set(
        view["budget"]["off_cadence"])
    assert not any(e["release"].startswith("regional.") for e in budget.ledger.entries())
    assert out.releases and all(r.region == "global" for r in out.releases)
    assert len(sampler_spy) == len(out.releases)  # nothing drawn for the skipped entries
    assert [e["kind"] for e in budget.events] == ["release_off_cadence"] * 3


def test_ledger_round_maps_flow_rounds_from_one_to_ledger_rounds_from_zero():
    assert ledger_round(1) == 0 and ledger_round(10) == 9
    with pytest.raises(ValueError, match="round_number"):
        ledger_round(0)


# --------------------------------------------------------------------------- training


def _one_epoch_training_only(cfg):
    """``cfg`` with one local epoch, no divergence scoring and no evaluation in round 1."""
    return cfg.model_copy(update={
        "training": cfg.training.model_copy(update={"local_epochs": 1}),
        "divergence": cfg.divergence.model_copy(update={"enabled": False}),
        "evaluation": cfg.evaluation.model_copy(update={"every": 10})})


def _updates(rng, n_clients, n_params, cohort=0, scale=1.0):
    return [ClientUpdate(c, cohort, (scale * rng.normal(size=n_params)).astype(np.float32), 10, False)
            for c in range(n_clients)]


@pytest.fixture
def mechanism_draws(monkeypatch):
    """Counts the Gaussian mechanism's draws (clma.privacy.mechanisms.sample)."""
    import clma.privacy.mechanisms as mech

    draws = []
    real = mech.sample
    monkeypatch.setattr(mech, "sample", lambda *a, **k: (draws.append(1), real(*a, **k))[1])
    return draws


def test_training_backs_off_when_the_line_is_frozen(small_config, mechanism_draws):
    cfg = small_config(epsilon_cap=1000.0, enabled=True)
    budget = open_budget(cfg)
    rng = np.random.default_rng(0)
    start = {0: np.zeros(50, dtype=np.float32)}
    ups = _updates(rng, 6, 50)
    draws = mechanism_draws

    dp = {"population_size": 6, "sample_size": 6, "denominators": {0: 6.0}}
    models, info = dp_aggregate(cfg, budget, ups, [], start, 1, **dp)
    assert info["status"] == "aggregated" and len(draws) == 1
    assert not np.array_equal(models[0], start[0])
    assert [e["release"] for e in budget.ledger.entries()] == [TRAINING_RELEASE]
    models = dp_commit(info, models, {})  # after cohorting (none here)
    # re-run of round 1: the committed model is republished, no new noise, no new charge
    again, info2 = dp_aggregate(cfg, budget, ups, [], start, 1, **dp)
    assert info2["status"] == "republished" and len(draws) == 1
    np.testing.assert_array_equal(again[0], models[0])
    assert len(budget.ledger.entries()) == 1

    budget.ledger.freeze_training(0, "test: refused borrow")
    kept, info3 = dp_aggregate(cfg, budget, ups, [], start, 2, **dp)
    assert info3 == {"status": "backed_off", "reason": "training_frozen"}
    np.testing.assert_array_equal(kept[0], start[0])  # no aggregation: the model is kept
    assert len(draws) == 1 and len(budget.ledger.entries()) == 1
    assert budget.events[-1]["kind"] == "training_backed_off"


def test_training_charge_is_the_sampled_without_replacement_gaussian_event(small_config):
    """One round of DP-FedAvg over k of N clients is charged as dp-accounting's
    SampledWithoutReplacementDpEvent(N, k, GaussianDpEvent(z)) under replace-one: the
    ledger's epsilon equals the accountant's own value for that event."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    cfg = small_config(epsilon_cap=1000.0, enabled=True, noise_multiplier=1.3,
                       clipping_bound=0.5)
    budget = open_budget(cfg)
    ups = _updates(np.random.default_rng(1), 4, 20)
    dp_aggregate(cfg, budget, ups, [], {0: np.zeros(20, dtype=np.float32)}, 1,
                 population_size=10, sample_size=4, denominators={0: 4.0})
    (entry,) = budget.ledger.entries()
    assert entry["line"] == "training"
    assert '"noise_multiplier":1.3' in entry["events"]
    assert '"population_size":10' in entry["events"] and '"sample_size":4' in entry["events"]
    (row,) = [r for r in budget.ledger.table(0) if r.line_item == "training"]
    acc = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc.compose(dp_accounting.SampledWithoutReplacementDpEvent(
        10, 4, dp_accounting.GaussianDpEvent(1.3)))
    assert row.spent_epsilon == pytest.approx(acc.get_epsilon(row.delta), rel=1e-9)
    assert row.adjacency == "replace_one"


def test_crash_before_commit_redraws_but_after_commit_republishes_new_cohorts(
        small_config, mechanism_draws):
    """OpenDP noise (unseeded): the charge is committed after cohorting with every released
    model, the new cohort's included. A re-run of a committed round republishes them all
    (no new draw, no new charge); a crash before the commit left nothing published, so the
    re-run draws again under the same single charge."""
    cfg = small_config(epsilon_cap=1000.0, enabled=True, noise_seeded=False)
    budget = open_budget(cfg)
    rng = np.random.default_rng(3)
    start = {0: np.zeros(30, dtype=np.float32)}
    ups = _updates(rng, 6, 30)
    new_members = _updates(rng, 3, 30, cohort=0)
    draws = mechanism_draws

    def one_attempt(commit: bool):
        models, info = dp_aggregate(cfg, budget, ups, [], start, 1, population_size=6,
                                    sample_size=6, denominators={0: 6.0})
        models[7] = dp_new_cohort_model(cfg, info, 1)(7, new_members, start[0])
        if commit:
            models = dp_commit(info, models, {7: [0, 1, 2]})
        return models, info

    crashed, info0 = one_attempt(commit=False)  # crash before the commit: nothing published
    assert info0["status"] == "aggregated" and len(draws) == 2
    first, info1 = one_attempt(commit=True)  # the re-run draws again (retry of the charge)
    assert info1["status"] == "aggregated" and len(draws) == 4
    assert not np.array_equal(first[7], crashed[7])
    (entry,) = budget.ledger.entries()  # one charge for all attempts
    assert entry["status"] == "committed" and entry["attempts"] == 2
    again, info2 = one_attempt(commit=True)  # a re-run after the commit republishes
    assert info2["status"] == "republished" and len(draws) == 4
    np.testing.assert_array_equal(again[0], first[0])
    np.testing.assert_array_equal(again[7], first[7])
    assert len(budget.ledger.entries()) == 1


@pytest.mark.parametrize("choice", ["on_their_data", "alone_joins"])
def test_engine_rerun_of_a_dp_round_republishes_every_model_bitwise(small_config, make_engine,
                                                                    mechanism_draws, choice):
    """The engine's DP-FedAvg round (aggregate -> cohort -> choose -> merge commits the
    charge with every model, the new cohorts' included), OpenDP noise: run again from the
    state before it (a crash after the ledger commit), it trains again but republishes the
    committed models bitwise, draws no noise and charges nothing more. Also when the
    clients' choice empties a new cohort ("alone_joins": the split leaves client 5 alone
    and it joins a shared new cohort, so its cohort of one is retired in the round that
    released its model): that model is committed too, and the re-run draws no fresh noise
    for it."""
    from clma.engine.clients import Replies
    from clma.sim.clients import SimulatedClients

    class Flagging(SimulatedClients):
        """Clients 0-5 raise their drift flag (so the round quarantines and cohorts them)."""

        def train(self, request):
            out = super().train(request)
            for c, u in out.ok.items():
                if c < 6:
                    out.ok[c] = ClientUpdate(u.client_id, u.cohort_id, u.params, u.n_samples, True)
            return out

        def choose(self, request):
            if choice == "on_their_data":
                return super().choose(request)
            return Replies({c: (k[1] if c == 5 else k[0])
                            for c, k in request.candidates.items()})

    class FiveAlone:
        """The shipped cohorter, with client 5 in a part of its own."""

        def __init__(self, inner):
            self.inner = inner

        def cohort(self, client_ids, matrix, reference):
            out = self.inner.cohort(client_ids, matrix, reference)
            out.assignments[5] = max(out.assignments.values()) + 1
            return out

    cfg = small_config(epsilon_cap=1000.0, enabled=True, noise_seeded=False)
    cfg = _one_epoch_training_only(cfg)
    assert cfg.cohort.client_choice  # as shipped
    engine = make_engine(cfg, budget=True)
    sim = engine.clients.federation
    engine = make_engine(cfg, Flagging(sim), budget=engine.budget)
    if choice == "alone_joins":
        engine.cohorter = FiveAlone(engine.cohorter)
    before = snapshot_files(engine.state)
    first = engine.run_round(1)
    assert first.quarantined == 6 and first.new_cohorts
    made = [k for e in engine.state.registry.lineage if e.kind == "split" and e.round == 1
            for k in e.children]
    retired = [e.parents for e in engine.state.registry.lineage
               if e.kind == "retire" and e.round == 1]
    if choice == "alone_joins":
        assert len(made) == 3 and retired == [[max(made)]]
        assert sorted(first.new_cohorts) == sorted(made)[:2]
    n = len(mechanism_draws)
    assert n == 1 + len(made)  # the root cohort's noise and each new cohort's
    again = make_engine(cfg, Flagging(sim), budget=open_budget(cfg),
                        state=restore_files(before, 0))
    if choice == "alone_joins":
        again.cohorter = FiveAlone(again.cohorter)
    second = again.run_round(1)
    assert len(mechanism_draws) == n
    assert (second.cohorts, second.new_cohorts) == (first.cohorts, first.new_cohorts)
    assert sorted(again.state.cohort_models) == sorted(engine.state.cohort_models)
    for c, v in engine.state.cohort_models.items():
        assert again.state.cohort_models[c].tobytes() == v.tobytes()
    (entry,) = again.budget.ledger.entries()
    assert (entry["round"], entry["release"], entry["attempts"]) == (0, TRAINING_RELEASE, 1)


# --------------------------------------------------------------------------- DP-FedAvg


def test_dp_fedavg_noise_std_matches_sigma_seeded_and_opendp():
    n_params, n, z, c = 40_000, 8, 1.7, 0.9
    ref = np.zeros(n_params, dtype=np.float32)
    same = [ref.copy() for _ in range(n)]  # zero updates: the model IS the noise
    d = float(n)
    sigma = z * 2 * c / d  # std 2 z C on the sum (replace-one sensitivity 2C), over D
    for seed, size in ((5, n_params), (None, 3_000)):
        res = dp_fedavg(same[:], ref, clipping_bound=c, noise_multiplier=z, denominator=d,
                        seed=seed)
        assert res.sigma == pytest.approx(sigma, rel=1e-15)
        noise = res.model.astype(np.float64)[:size] if seed is not None else dp_fedavg(
            [r[:size] for r in same], ref[:size], clipping_bound=c, noise_multiplier=z,
            denominator=d, seed=None).model.astype(np.float64)
        # sample std within 4 standard errors (se of s ~ sigma / sqrt(2 size))
        assert abs(noise.std(ddof=1) - sigma) < 4 * sigma / np.sqrt(2 * size)
        assert abs(noise.mean()) < 4 * sigma / np.sqrt(size)
        # Gaussian shape (KS against N(0, sigma))
        assert stats.kstest(noise, "norm", args=(0.0, sigma)).pvalue > 1e-4
    assert res.noise_source == "opendp"


def test_dp_fedavg_is_the_literal_clipped_mean_plus_noise():
    rng = np.random.default_rng(3)
    ref = rng.normal(size=30).astype(np.float32)
    params = [(ref + s * rng.normal(size=30)).astype(np.float32) for s in (0.01, 5.0, 0.2, 30.0)]
    c, z = 1.0, 0.8
    res = dp_fedavg(params, ref, clipping_bound=c, noise_multiplier=z, denominator=4.0,
                    seed=11)
    deltas = [p.astype(np.float64) - ref for p in params]
    clipped = [d * min(1.0, c / np.linalg.norm(d)) for d in deltas]
    noise = np.random.default_rng(11).normal(0.0, z * 2 * c, size=30)  # on the sum
    expected = (ref + (np.sum(clipped, axis=0) + noise) / 4.0).astype(np.float32)
    np.testing.assert_allclose(res.model, expected, rtol=0, atol=1e-6)
    assert res.n_clipped == sum(np.linalg.norm(d) > c for d in deltas)


def test_clipping_bounds_the_update_norm():
    rng = np.random.default_rng(4)
    c = 0.25
    for scale in (1e-3, 0.1, 1.0, 100.0):
        u = scale * rng.normal(size=500)
        clipped, was = clip_update(u, c)
        assert np.linalg.norm(clipped) <= c * (1 + 1e-12)
        assert was == (np.linalg.norm(u) > c)
        if not was:
            np.testing.assert_array_equal(clipped, u)
        else:  # same direction
            assert np.dot(clipped, u) / (np.linalg.norm(clipped) * np.linalg.norm(u)) == pytest.approx(1.0)
    # the aggregate moves by at most C even when every client pushes far the same way
    ref = np.zeros(100, dtype=np.float32)
    far = [np.full(100, 50.0, dtype=np.float32) for _ in range(5)]
    res = dp_fedavg(far, ref, clipping_bound=c, noise_multiplier=1e-9, denominator=5.0,
                    seed=0)
    assert np.linalg.norm(res.model.astype(np.float64)) == pytest.approx(c, rel=1e-5)
    assert res.n_clipped == 5


@pytest.mark.parametrize("kwargs, match", [
    ({"clipping_bound": 0.0, "noise_multiplier": 1.0}, "clipping_bound"),
    ({"clipping_bound": 1.0, "noise_multiplier": -1.0}, "noise_multiplier"),
    ({"clipping_bound": float("nan"), "noise_multiplier": 1.0}, "clipping_bound"),
])
def test_dp_fedavg_rejects_bad_parameters(kwargs, match):
    ref = np.zeros(3, dtype=np.float32)
    with pytest.raises(ValueError, match=match):
        dp_fedavg([ref], ref, seed=0, denominator=1.0, **kwargs)


def test_new_cohorts_under_dp_are_released_through_the_dp_step(small_config):
    """A cohort created by cohorting under DP-FedAvg gets the DP step's model (clipped,
    noised), never the plain mean of its members; nothing is released when training
    backed off."""
    from clma.cohort import CohortRegistry
    from clma.rounds import cohort_quarantined, fedavg

    cfg = small_config(epsilon_cap=1000.0, enabled=True, clipping_bound=0.5,
                       noise_multiplier=1.0, noise_seeded=True)
    rng = np.random.default_rng(0)
    ref = rng.normal(size=400).astype(np.float32)
    shift = np.zeros(400, np.float32)
    shift[:200] = 1.0
    ups = [ClientUpdate(c, 0, (ref + s * shift + 0.01 * rng.normal(size=400)).astype(np.float32),
                        10, True) for c, s in ((0, 1), (1, 1), (2, 1), (3, -1), (4, -1), (5, -1))]
    reg = CohortRegistry()
    reg.create_root([0, 1, 2, 3, 4, 5], 0)
    hook = dp_new_cohort_model(cfg, {"status": "aggregated"}, 3)
    models, out = cohort_quarantined(ups, [0, 1, 2, 3, 4, 5], {0: ref}, reg,
                                     make_cohorter(cfg), 3, start_models={0: ref},
                                     new_model=hook)
    assert len(out.new_cohorts) == 2
    by = {u.client_id: u for u in ups}
    for cid, members in out.new_cohorts.items():
        literal = dp_fedavg([by[c].params for c in members], ref, clipping_bound=0.5,
                            noise_multiplier=1.0, denominator=float(coarse_size(len(members))),
                            seed=np.random.default_rng([cfg.seed, 3, 223, cid])).model
        np.testing.assert_array_equal(models[cid], literal)
        plain = fedavg([by[c].params for c in members], [10] * len(members))
        assert not np.allclose(models[cid], plain)  # not the un-noised, unclipped mean
    backed = dp_new_cohort_model(cfg, {"status": "backed_off"}, 3)
    np.testing.assert_array_equal(backed(9, [ups[0]], ref), ref)


@pytest.mark.parametrize("n, expected", [(0, 1), (1, 1), (2, 2), (3, 4), (5, 4), (6, 8),
                                         (11, 8), (12, 16), (22, 16), (23, 32), (45, 32),
                                         (46, 64), (60, 64)])
def test_coarse_size_is_the_nearest_power_of_two(n, expected):
    assert coarse_size(n) == expected
    if n >= 1:  # nearest on the log scale: within a factor sqrt(2)
        assert 1 / np.sqrt(2) - 1e-12 <= n / expected <= np.sqrt(2) + 1e-12


def test_dp_denominators_are_expected_participants_of_the_coarse_cohort():
    from clma.engine.budget import dp_denominators

    d = dp_denominators({0: 30, 3: 15, 4: 3}, population_size=60, sample_size=30)
    assert d == {0: 32 * 30 / 60, 3: 16 * 30 / 60, 4: 4 * 30 / 60}
    assert dp_denominators({0: 1}, 60, 6) == {0: 1.0}  # at least 1
    with pytest.raises(ValueError, match="n: must be an integer"):
        coarse_size(-1)


# --------------------------------------------------------------------------- where the ledger lives


def test_ledger_goes_to_the_default_dir_fresh_and_a_temporary_one_is_removed(
        tmp_path, monkeypatch):
    """Issue 14 item 6: no throwaway /tmp/clma-state-* folder is left by a run; the ledger
    of a run without a state dir lives in the given default dir (``<out>/ledger``)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    cfg = load_config(SMALL)
    assert cfg.budget.state_dir is None
    out_ledger = tmp_path / "out" / "ledger"
    b = open_budget(cfg, default_dir=out_ledger, fresh=True)
    assert b.ledger_path == out_ledger / "privacy_ledger.sqlite" and b.ledger_path.exists()
    assert not b.temporary
    assert b.tags()["clma.budget.ledger_path"] == str(b.ledger_path.resolve())
    from clma.budget import MechanismEvent

    with b.ledger.charge(0, "global.accuracy", LineItem.EVALUATION_GLOBAL,
                         [MechanismEvent.laplace(0.5)]):
        pass
    assert len(b.ledger.entries()) == 1
    b.close()
    assert b.ledger_path.exists()  # a durable ledger stays
    # the next stateless run into the same --out starts from an empty ledger
    again = open_budget(cfg, default_dir=out_ledger, fresh=True)
    assert again.ledger.entries() == []
    # neither a state dir nor an out folder: a temporary ledger, removed at close
    tmp = open_budget(cfg)
    assert tmp.temporary and tmp.state_dir.parent == tmp_path / "tmp"
    assert "temporary" in tmp.tags()["clma.budget.ledger_path"]
    tmp.close()
    assert list((tmp_path / "tmp").iterdir()) == []


def test_borrow_amount_counts_the_zcdp_entries_of_the_line(
        tiny_config, make_engine, write_policy, tmp_path):
    """Distributed mode, every round evaluated, regional cadence 1, 3 rounds in one
    epoch: asked in round 1 with a shortfall of 1, the request covers the shortfall plus
    the two later rounds' regional entries at their epsilons (2 zCDP entries at 2 and the
    health release at 0.5: 4.5 a round), not only the Laplace one (0.5 a round)."""
    from types import SimpleNamespace

    from clma.engine.budget import _borrow_amount

    policy = write_policy(epsilon_per_client_per_epoch=1000.0, regional_cadence_rounds=1,
                          epoch_length_rounds=10)
    cfg = tiny_config(evaluation={"noise": "distributed", "noise_seeded": False, "every": 1,
                                  "health_epsilon": 0.5}, rounds=3)
    cfg = cfg.model_copy(update={"budget": BudgetConfig(state_dir=str(tmp_path / "s"),
                                                        policy=str(policy))})
    engine = make_engine(cfg, budget=True)
    plans = charge_plans(engine.evaluator)
    assert sorted((p.name, p.mechanism, p.epsilon) for p in plans
                  if p.line is LineItem.EVALUATION_REGIONAL) == [
        ("regional.accuracy", "zcdp", 2.0), ("regional.health.dropout_rate", "laplace", 0.5),
        ("regional.mean_loss", "zcdp", 2.0)]
    res = SimpleNamespace(line_cap_epsilon=150.0, line_epsilon_after=151.0)
    got = _borrow_amount(engine.budget, plans, 1, LineItem.EVALUATION_REGIONAL, res)
    assert got == pytest.approx(1.0 + 1e-9 * 151.0 + 2 * 4.5, rel=1e-12)
    # the limit still caps it: half of the next epoch's regional line (0.15 x 1000 / 2)
    res = SimpleNamespace(line_cap_epsilon=150.0, line_epsilon_after=220.0)
    assert _borrow_amount(engine.budget, plans, 1, LineItem.EVALUATION_REGIONAL,
                          res) == pytest.approx(75.0, rel=1e-12)


def test_server_learning_rate_under_dp_fedavg_is_committed_and_republished_once(
        small_config, make_engine, mechanism_draws):
    """Under DP-FedAvg the server step post-processes the noisy aggregate: the model the
    round installs and the ledger commits is start + eta * (DP aggregate - start) (seeded
    noise: the eta = 1 run draws the same aggregate), and a re-run republishes it bitwise
    instead of stepping it again, with the same momentum velocity."""
    cfg = small_config(epsilon_cap=1000.0, enabled=True, noise_seeded=True)
    cfg = _one_epoch_training_only(cfg)
    cfg = cfg.model_copy(update={"training": cfg.training.model_copy(
        update={"server_learning_rate": 1.0})})  # eta = 1: the DP aggregate itself
    plain = make_engine(cfg, budget=True)
    start = plain.state.cohort_models[0].astype(np.float64)
    before = snapshot_files(plain.state)
    plain.run_round(1)
    agg = plain.state.cohort_models[0].astype(np.float64)
    assert not np.array_equal(agg, start)

    stepped_cfg = cfg.model_copy(update={"training": cfg.training.model_copy(
        update={"server_learning_rate": 1.5, "server_learning_rate_scope": "all",
                "server_momentum": 0.3}),
        "budget": cfg.budget.model_copy(
        update={"state_dir": cfg.budget.state_dir + "-eta"})})
    stepped = make_engine(stepped_cfg, budget=True, state=restore_files(before, 0))
    stepped.run_round(1)
    want = (start + 1.5 * (agg - start)).astype(np.float32)
    np.testing.assert_array_equal(stepped.state.cohort_models[0], want)
    n = len(mechanism_draws)
    again = make_engine(stepped_cfg, budget=open_budget(stepped_cfg),
                        state=restore_files(before, 0))
    again.run_round(1)  # re-run after the commit: the committed (stepped) model, once
    assert len(mechanism_draws) == n
    np.testing.assert_array_equal(again.state.cohort_models[0], want)
    # the momentum velocity comes from the committed model: the same on the re-run
    v = stepped.state.server_velocity[0]
    np.testing.assert_array_equal(v, ((want.astype(np.float64) - start) / 1.5).astype(
        np.float32))
    assert again.state.server_velocity[0].tobytes() == v.tobytes()
