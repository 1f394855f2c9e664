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
    over 20 rounds x 2 groups x 2 metrics, the standardised errors of the published values
    against the exact sums have mean 0 and variance 1 (chi-square 0.1 %-99.9 %), and the
    exact-n 95 % bars cover 95 % of them (within 4 binomial standard errors)."""
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
    for rnd in range(1, 21):
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
    assert k == 80
    z = np.asarray(z)
    assert abs(z.mean()) <= 4 / math.sqrt(k)
    chi = float(np.sum(z**2))
    assert stats.chi2.ppf(0.001, k) <= chi <= stats.chi2.ppf(0.999, k)
    assert abs(covered / k - 0.95) <= 4 * math.sqrt(0.95 * 0.05 / k)
