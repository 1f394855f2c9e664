"""Distributed DP (``evaluation.noise = "distributed"``) through the engine over simulated
clients: the devices add the noise (the server's sampler is never called for accuracy or
mean loss), the server only ever holds noisy sums, dropouts up to the tolerated number
keep the guarantee, the ledger charges the zCDP event dp-accounting composes, and the
published error matches the mechanism over many rounds."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

import clma.engine.evaluation as evaluation
import clma.privacy.distributed as distributed
from clma.budget import LineItem
from clma.budget.accounting import MechanismEvent, compose
from clma.config import BudgetConfig
from clma.engine.budget import budgeted_evaluation, charge_distributed
from clma.engine.evaluation import HEALTH_METRIC, QUANTISATION_LEVELS
from clma.privacy.distributed import ddg_epsilon, dg_variance, rho_for_epsilon
from clma.privacy.secagg import FixedPointQuantiser, _count

DISTRIBUTED = {"noise": "distributed", "noise_seeded": False}


@pytest.fixture
def central_spy(monkeypatch):
    """Names of the metrics the server's central noise path (aggregate_sum /
    aggregate_vector_sum) is called for."""
    names: list[str] = []
    real_sum, real_vec = evaluation.aggregate_sum, evaluation.aggregate_vector_sum

    def spy_sum(s, n, spec, **kw):
        names.append(spec.name)
        return real_sum(s, n, spec, **kw)

    def spy_vec(*a, **kw):
        names.append(kw.get("name", "vector"))
        return real_vec(*a, **kw)

    monkeypatch.setattr(evaluation, "aggregate_sum", spy_sum)
    monkeypatch.setattr(evaluation, "aggregate_vector_sum", spy_vec)
    return names


@pytest.fixture
def device_draws(monkeypatch):
    """Sizes of every noise draw made by the devices' sampler (clma.privacy.distributed)."""
    sizes: list[int] = []
    real = distributed.sample_noise

    def spy(sigma, size):
        sizes.append(int(size))
        return real(sigma, size)

    monkeypatch.setattr(distributed, "sample_noise", spy)
    return sizes


def test_devices_add_the_noise_and_the_server_only_sees_noisy_sums(
        tiny_config, make_engine, secure_sums, device_reports, central_spy, device_draws):
    engine = make_engine(tiny_config(evaluation=DISTRIBUTED))
    sums = secure_sums(engine, 1)
    q = device_reports(engine, 1)
    # one draw of 2 values (accuracy, mean loss) per client, on its device
    assert device_draws == [2] * len(q)
    ok = [g for g, s in sums.groups.items() if s.status == "ok" and g != "global"]
    assert len(ok) >= 2
    for name in ok:
        g = sums.groups[name]
        members = [c for c in q if engine.region_of[c] in g.members]
        exact = np.sum([q[c] for c in members], axis=0).astype(np.int64)
        noise = g.sum_quantised[:2] - exact[:2]
        assert np.all(noise != 0)  # what the server unmasks is never the exact sum
        sd = math.sqrt(len(members) * dg_variance(g.noise.sigma))
        assert np.all(np.abs(noise) < 8 * sd)
        assert np.all(g.sum_quantised[2:] == 0)  # the other coordinates are never summed
    out = engine.evaluator.release_all(engine.evaluator.open_round(sums))
    assert central_spy and set(central_spy) == {HEALTH_METRIC}  # only the server's own count
    quantum = 1.0 / QUANTISATION_LEVELS
    for name in ok:
        g = sums.groups[name]
        pub = out.published["metrics"]["accuracy"]["regions"][name]
        raw = g.sum[0] / g.contributors
        assert pub["value"] == pytest.approx(min(1.0, max(0.0, raw)), abs=1e-12)
        assert pub["mechanism"] == "distributed_discrete_gaussian"
        assert pub["per_client_sigma"] == pytest.approx(g.noise.sigma * quantum)
        env = json.loads(out.envelopes[f"accuracy/{name}.json"])
        assert env["privacy_mechanism"] == "distributed_discrete_gaussian"
        assert env["privacy_mechanism_version"] == "v1"
    glob = out.published["metrics"]["accuracy"]["global"]
    total = sum(sums.groups[g].sum[0] for g in ok)
    assert glob["value"] == pytest.approx(min(1.0, max(0.0, total / sum(
        sums.groups[g].contributors for g in ok))), abs=1e-12)
    assert out.published["noise"]["mode"] == "distributed"
    assert [r.epsilon for r in out.releases if r.region == "global"
            and r.name != HEALTH_METRIC] == [0.0, 0.0]  # post-processing
    text = json.dumps(out.published)
    assert "contributors" not in text and "participant_count" not in text


def test_dropouts_up_to_the_tolerated_number_keep_the_guarantee(
        tiny_config, make_engine, secure_sums):
    """North (7 clients, dropout fraction 0.3 capped by the floor 5: at most 2 drop): with
    2 dropouts the sum is released and its honest shares are at least the number the
    shares were sized for; with 3 the clients refuse to unmask (below the floor)."""
    cfg = tiny_config(evaluation={**DISTRIBUTED, "secagg_dropout_fraction": 0.3})
    north = sorted(c for c, r in make_engine(cfg).region_of.items() if r == "north")
    engine = make_engine(cfg, drops={c: "masked_input" for c in north[:2]})
    g = next(s for s in secure_sums(engine, 1).groups.values() if "north" in s.members)
    assert g.status == "ok" and g.contributors == 5
    assert g.contributors - _count(0.05, g.selected) >= g.noise.honest_floor >= 1
    assert ddg_epsilon(g.noise.sigma, g.noise.honest_floor, float(QUANTISATION_LEVELS),
                       1e-6) <= 2.0
    engine = make_engine(cfg, drops={c: "masked_input" for c in north[:3]})
    g = next(s for s in secure_sums(engine, 1).groups.values() if "north" in s.members)
    assert g.status != "ok" and g.sum is None


def test_the_ledger_charges_the_zcdp_event_the_accountant_composes(
        tiny_config, make_engine, evaluate_round, write_policy, tmp_path, central_spy):
    policy = write_policy(epsilon_per_client_per_epoch=1000.0, regional_cadence_rounds=1,
                          approver_keys=True)
    cfg = tiny_config(evaluation=DISTRIBUTED)
    cfg = cfg.model_copy(update={"budget": BudgetConfig(state_dir=str(tmp_path / "s"),
                                                        policy=str(policy))})
    engine = make_engine(cfg, budget=True)
    view, out = evaluate_round(engine, 1)
    assert {"regional.accuracy", "regional.mean_loss", "global.accuracy",
            "global.mean_loss"} <= set(view["budget"]["released"])
    assert set(central_spy) == {HEALTH_METRIC}
    ledger = engine.budget.ledger
    regional = ledger.spent(0, LineItem.EVALUATION_REGIONAL)
    rho = rho_for_epsilon(2.0, 1e-6)
    want = compose([MechanismEvent.zcdp(rho)] * 2 + [MechanismEvent.laplace(0.5)],
                   regional.delta)
    assert regional.epsilon == pytest.approx(want.epsilon, rel=1e-12)
    # the global line holds only the health release: the global metrics are the sum of
    # the regional noisy sums (post-processing)
    assert ledger.spent(0, LineItem.EVALUATION_GLOBAL).epsilon == pytest.approx(0.5)
    assert out.published["metrics"]["accuracy"]["global"]["value"] is not None


@pytest.mark.slow
def test_published_error_matches_the_mechanisms_std_over_many_rounds(
        tiny_config, make_engine, secure_sums, scripted_clients):
    """Fixed device reports (accuracy 0.5, loss 2.5), epsilon 20 so nothing is clamped:
    over 60 rounds x 2 groups x 2 metrics, the standardised errors of the published values
    against the exact sums have mean 0 and variance 1 (chi-square 0.01 %-99.99 %: the
    noise is OpenDP's, unseeded, so the bounds set the false-failure rate, 2 in 10,000;
    with 240 errors a variance 1.5 times too large fails 82 % of runs, scipy's chi-square),
    and the exact-n 95 % bars cover 95 % of them (within 4 binomial standard errors)."""
    cfg = tiny_config(evaluation={**DISTRIBUTED, "epsilon": 20.0})
    engine0 = make_engine(cfg)
    layout = engine0.evaluator.state.layout()
    report = np.zeros(32)
    report[0], report[1] = 0.5, 2.5
    quant = FixedPointQuantiser(layout.lower_bounds(), layout.upper_bounds(),
                                QUANTISATION_LEVELS)
    qrep = quant.quantise(report)
    engine = make_engine(cfg, report=lambda c: report)
    z, covered = [], 0
    for rnd in range(1, 61):
        sums = secure_sums(engine, rnd)
        out = engine.evaluator.release_all(engine.evaluator.open_round(sums))
        for gname, g in sums.groups.items():
            if gname == "global" or g.status != "ok":
                continue
            for i, metric in enumerate(("accuracy", "mean_loss")):
                agg = out.server[f"{metric}|{gname}"]
                unit = agg.quantum
                true_mean = float(quant.dequantise_sum(qrep * g.contributors,
                                                       g.contributors)[i]) / g.contributors
                err = agg.value - true_mean
                sd = math.sqrt(g.contributors * dg_variance(g.noise.sigma)) * unit / g.contributors
                z.append(err / sd)
                covered += abs(err) <= agg.error_bar
                assert agg.published_error_bar >= agg.error_bar
    k = len(z)
    assert k == 240
    z = np.asarray(z)
    assert abs(z.mean()) <= 4 / math.sqrt(k)
    chi = float(np.sum(z**2))
    assert stats.chi2.ppf(1e-4, k) <= chi <= stats.chi2.ppf(1 - 1e-4, k)
    assert abs(covered / k - 0.95) <= 4 * math.sqrt(0.95 * 0.05 / k)


# ------------------------------------------------------------- charge before unmasking


class SpyClients:
    """The transport, recording every secure-aggregation call: (method, round, session
    ids asked) and, at advertise, each session's noised coordinates."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[str, int, tuple[str, ...]]] = []
        self.coordinates: dict[str, tuple[int, ...]] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def secagg_advertise(self, request):
        for sid, sess in request.sessions.items():
            self.coordinates[sid] = tuple(sess.config.noise.coordinates)
        self.calls.append(("advertise", request.round, tuple(sorted(request.sessions))))
        return self.inner.secagg_advertise(request)

    def _step(self, name, round, requests):  # noqa: A002
        sids = tuple(sorted({s for per in requests.values() for s in per}))
        self.calls.append((name, round, sids))
        return getattr(self.inner, f"secagg_{name}")(round, requests)

    def secagg_share_keys(self, round, requests):  # noqa: A002
        return self._step("share_keys", round, requests)

    def secagg_masked_input(self, round, inboxes):  # noqa: A002
        return self._step("masked_input", round, inboxes)

    def secagg_unmask(self, round, requests):  # noqa: A002
        return self._step("unmask", round, requests)


def _ledger_engine(tiny_config, make_engine, write_policy, tmp_path, eps_epoch, *,
                   client_kw=None, **ev):
    policy = write_policy(epsilon_per_client_per_epoch=eps_epoch, regional_cadence_rounds=1,
                          epoch_length_rounds=10)
    cfg = tiny_config(evaluation={**DISTRIBUTED, **ev}, rounds=3)
    cfg = cfg.model_copy(update={"budget": BudgetConfig(state_dir=str(tmp_path / "s"),
                                                        policy=str(policy))})
    engine = make_engine(cfg, budget=True, **(client_kw or {}))
    engine.clients = SpyClients(engine.clients)
    return engine


def _charged_round(engine, round_number, secure_sums):
    """Charge (before secure aggregation), secure sums of what was charged, releases:
    ``(charges, sums, ledger view, outcome)``."""
    ids = engine.roster.client_ids
    region_of = {c: engine.region_of[c] for c in ids}
    groups = engine.evaluator.session_groups(round_number, ids, engine.region_of)
    charges = charge_distributed(engine.evaluator, engine.budget, groups, region_of,
                                 round_number)
    sums = secure_sums(engine, round_number, charges.unmask())
    ev = engine.evaluator.open_round(sums)
    view = budgeted_evaluation(engine.evaluator, ev, engine.budget, region_of,
                               charged=charges)
    return charges, sums, view, engine.evaluator.finish(ev, budget_view=view)


def test_a_release_refused_by_the_cap_is_never_unmasked(
        tiny_config, make_engine, secure_sums, write_policy, tmp_path, device_draws):
    """Regional cap 0.15 x 5 = 0.75 < 1.96 (one zCDP charge at epsilon 2 and the line's
    delta): both noised entries are refused before secure aggregation, so no session is
    formed: the clients are asked nothing, draw no share, and the server holds no sum."""
    engine = _ledger_engine(tiny_config, make_engine, write_policy, tmp_path, 5.0)
    charges, sums, view, out = _charged_round(engine, 1, secure_sums)
    assert len(charges.groups) >= 2
    assert view["budget"]["refused"] == {"regional.accuracy": "exceeds_line_cap",
                                         "regional.mean_loss": "exceeds_line_cap"}
    assert charges.unmask() == ()
    assert engine.clients.calls == [] and device_draws == []
    # no session, no observed dropouts: the health releases have nothing to release
    assert set(view["budget"]["not_charged"]) == {"global.health.dropout_rate",
                                                  "regional.health.dropout_rate"}
    for g in charges.groups:
        gs = sums.groups[g]
        assert gs.status == "not_unmasked"
        assert gs.sum is None and gs.sum_quantised is None and gs.contributors == 0
    assert sums.groups["global"].status == "below_floor" and sums.groups["global"].sum is None
    assert out.audit == [] and engine.evaluator.state.learned == []
    assert not [k for k in out.server if k.split("|")[0] in ("accuracy", "mean_loss")]
    assert out.published["metrics"]["accuracy"]["regions"] == {}
    assert out.published["metrics"]["accuracy"]["global"] is None
    assert out.published["not_unmasked"] == sorted(charges.groups)
    refused = {(r["name"], r["region"]) for r in out.published["refused_releases"]}
    assert {(m, g) for m in ("accuracy", "mean_loss") for g in charges.groups} <= refused
    # no envelope claims a value for a group that was never unmasked
    assert not [k for k in out.envelopes if k.split("/")[0] in ("accuracy", "mean_loss")
                and k.split("/")[1][:-5] in charges.groups]
    # nothing was charged for the noised metrics
    assert not [e for e in engine.budget.ledger.entries()
                if e["release"] in ("regional.accuracy", "regional.mean_loss")]


def test_only_the_charged_metric_reaches_the_sessions(
        tiny_config, make_engine, secure_sums, write_policy, tmp_path, device_draws):
    """Regional cap 0.15 x 16 = 2.4: one zCDP charge (1.96) fits, two (2.87) do not:
    accuracy is charged, mean loss refused, so the sessions carry only the accuracy
    coordinate: each device draws one share, the mean-loss coordinate of every unmasked
    sum is 0 (never summed), and only accuracy is published."""
    engine = _ledger_engine(tiny_config, make_engine, write_policy, tmp_path, 16.0)
    charges, sums, view, out = _charged_round(engine, 1, secure_sums)
    assert view["budget"]["refused"]["regional.mean_loss"] == "exceeds_line_cap"
    assert "regional.accuracy" in view["budget"]["released"]
    assert charges.unmask() == ("accuracy",)
    acc = engine.evaluator.state.layout().slices["accuracy"].start
    assert set(engine.clients.coordinates.values()) == {(acc,)}
    assert device_draws and set(device_draws) == {1}
    ok = [g for g in charges.groups if sums.groups[g].status == "ok"]
    assert len(ok) >= 2
    for g in ok:
        q = sums.groups[g].sum_quantised
        assert q[acc] != 0 and np.all(np.delete(q, acc) == 0)
    assert set(out.published["metrics"]["accuracy"]["regions"]) == set(ok)
    assert out.published["metrics"]["mean_loss"]["regions"] == {}
    assert out.published["metrics"]["mean_loss"]["global"] is None
    assert not [k for k in out.server if k.startswith("mean_loss|")]


def test_every_unmasked_group_has_exactly_one_ledger_charge(
        tiny_config, make_engine, write_policy, tmp_path):
    """Three engine rounds (evaluation every round) against a regional cap of
    0.15 x 30 = 4.5 that runs out: for every session the clients were asked to unmask,
    each metric it carried has exactly one committed ``regional.<metric>`` charge in that
    round covering every region of the group; a refused entry's metric is in no session;
    and the scenario has both (some unmasked, some refused)."""
    engine = _ledger_engine(tiny_config, make_engine, write_policy, tmp_path, 30.0,
                            every=1)
    outcomes = {r: engine.run_round(r).evaluation for r in (1, 2, 3)}
    calls = engine.clients.calls
    layout = engine.evaluator.state.layout()
    metric_at = {layout.slices[m].start: m for m in ("accuracy", "mean_loss")}
    entries = engine.budget.ledger.entries()
    unmasked = [(rnd, sid) for name, rnd, sids in calls if name == "unmask" for sid in sids]
    assert unmasked
    refused_any = False
    for rnd, out in outcomes.items():
        refused = {r["name"] for r in out.published["refused_releases"]
                   if r["region"] != "global"}
        refused_any |= bool(refused & {"accuracy", "mean_loss"})
        carried = {metric_at[i] for (r, sid) in unmasked if r == rnd
                   for i in engine.clients.coordinates[sid]}
        assert not carried & refused
    assert refused_any
    for rnd, sid in unmasked:
        group = sid.removeprefix(f"eval-{rnd}-")
        regions = set(group.split("+"))
        for i in engine.clients.coordinates[sid]:
            metric = metric_at[i]
            charges = [e for e in entries if e["round"] == rnd - 1
                       and e["release"] == f"regional.{metric}" and e["status"] == "committed"
                       and regions <= {tag for tag, _ in json.loads(e["events"])}]
            assert len(charges) == 1, (rnd, group, metric)


def test_a_charged_entry_is_never_unmasked_twice(
        tiny_config, make_engine, secure_sums, write_policy, tmp_path):
    """Round 1 released, then run again (a retry after the commit): both entries are
    already committed, so no session is formed, the stored regional values are
    republished, and the global one (the sum of the noisy sums, not stored) is not.
    Round 2 with ``regional.accuracy`` left pending by a crashed attempt: accuracy is not
    unmasked again (only mean loss reaches the sessions) and the pending charge is closed
    with nothing released."""
    from clma.budget import MechanismEvent as Event

    engine = _ledger_engine(tiny_config, make_engine, write_policy, tmp_path, 1000.0)
    _, _, view1, out1 = _charged_round(engine, 1, secure_sums)
    assert {"regional.accuracy", "regional.mean_loss"} <= set(view1["budget"]["released"])
    first = out1.published["metrics"]["accuracy"]["regions"]
    assert len(first) >= 2
    n_calls = len(engine.clients.calls)
    charges, sums, view, out = _charged_round(engine, 1, secure_sums)
    assert charges.unmask() == () and len(engine.clients.calls) == n_calls
    assert {"regional.accuracy", "regional.mean_loss"} <= set(view["budget"]["republished"])
    assert set(view["budget"]["not_unmasked"]) == {"regional.accuracy", "regional.mean_loss"}
    assert {g: p["value"] for g, p in out.published["metrics"]["accuracy"]["regions"].items()
            } == {g: p["value"] for g, p in first.items()}
    assert out.published["metrics"]["accuracy"]["global"] is None

    ids = engine.roster.client_ids
    regions = sorted({engine.region_of[c] for c in ids})
    pending = engine.budget.ledger.reserve(
        1, "regional.accuracy", LineItem.EVALUATION_REGIONAL,
        {r: Event.zcdp(rho_for_epsilon(2.0, 1e-6)) for r in regions},
        membership={str(c): engine.region_of[c] for c in sorted(ids)})
    assert pending.may_draw_noise
    charges, sums, view, out = _charged_round(engine, 2, secure_sums)
    assert charges.unmask() == ("mean_loss",)
    loss = engine.evaluator.state.layout().slices["mean_loss"].start
    round2 = [sid for name, rnd, sids in engine.clients.calls if rnd == 2 for sid in sids]
    assert round2 and {engine.clients.coordinates[s] for s in round2} == {(loss,)}
    assert view["budget"]["not_unmasked"]["regional.accuracy"].startswith("reused_pending")
    assert out.published["metrics"]["accuracy"]["regions"] == {}
    assert [e["status"] for e in engine.budget.ledger.entries()
            if e["round"] == 1 and e["release"] == "regional.accuracy"] == ["committed"]


def test_a_group_lost_to_dropouts_after_its_charge_stays_charged(
        tiny_config, make_engine, secure_sums, write_policy, tmp_path):
    """North (7 clients, at most 2 tolerated dropouts): 3 of its clients drop before
    their masked input, after the charge. North is not released and is listed as
    charged_not_released; the committed regional charges still hold north's event."""
    probe = make_engine(tiny_config(evaluation=DISTRIBUTED))
    north = sorted(c for c, r in probe.region_of.items() if r == "north")
    engine = _ledger_engine(tiny_config, make_engine, write_policy, tmp_path, 1000.0,
                            client_kw={"drops": {c: "masked_input" for c in north[:3]}},
                            secagg_dropout_fraction=0.3)
    charges, sums, view, out = _charged_round(engine, 1, secure_sums)
    lost = [g for g in charges.groups if "north" in sums.groups[g].members]
    assert len(lost) == 1 and sums.groups[lost[0]].status != "ok"
    assert sums.groups[lost[0]].sum is None
    for metric in ("accuracy", "mean_loss"):
        assert view["budget"]["charged_not_released"][f"regional.{metric}"] == lost
        assert lost[0] not in out.published["metrics"][metric]["regions"]
        (entry,) = [e for e in engine.budget.ledger.entries()
                    if e["release"] == f"regional.{metric}"]
        assert entry["status"] == "committed"
        assert "north" in {tag for tag, _ in json.loads(entry["events"])}
    assert [g for g in charges.groups if sums.groups[g].status == "ok"]
