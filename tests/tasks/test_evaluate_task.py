"""The evaluation task on a tiny federation (task logic via ``.fn``): secure sums, dropouts
and the threshold, envelopes, no exact counts in published outputs, alerts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clma.config import validate_config
from clma.metrics import compute_device_report
from clma.privacy.secagg import FixedPointQuantiser
from clma.release import FederatedMetricEnvelope
from clma.sim.federation import build_federation
from clma.sim.training import predict_proba
from tasks import evaluate as ev


def _fed(**evaluation):
    cfg = validate_config({
        "name": "tiny", "seed": 0, "rounds": 3, "clients": 20,
        "data": {"probe_size": 32}, "tracking": {"enabled": False},
        "budget": {"enabled": False},
        "evaluation": {"epsilon": 2.0, **evaluation},
    })
    return build_federation(cfg)


def _subs(fed):
    return ev.device_reports([fed.clients[c] for c in fed.client_ids],
                             fed.models_for(fed.client_ids), fed.spec,
                             ev.evaluation_state(fed).layout())


def test_min_cohort_is_raised_to_the_policy_floor():
    fed = _fed(min_cohort=2)
    assert ev.effective_min_cohort(fed) == 5
    assert ev.effective_min_cohort(_fed(min_cohort=7)) == 7


def test_secure_sums_equal_plain_sums_of_clipped_values():
    fed = _fed()
    layout = ev.evaluation_state(fed).layout()
    subs = _subs(fed)
    sums = ev.secure_sums(fed, subs, 1)
    quant = FixedPointQuantiser(layout.lower_bounds(), layout.upper_bounds())
    ok = [g for g, s in sums.groups.items() if s.status == "ok"]
    assert "global" in ok and len(ok) >= 2
    for name in ok:
        g = sums.groups[name]
        members = [s for s in subs if name == "global" or s.region in g.members]
        assert g.contributors == len(members)
        exact = sum(s.quantised for s in members) & np.uint64(2**32 - 1)
        np.testing.assert_array_equal(g.sum_quantised, exact)  # exact integer sum
        plain = np.zeros(32)
        for s in members:  # the plain sum of the clipped on-device reports
            cl = fed.clients[s.client_id]
            _, _, x, y = cl.current()
            rep = compute_device_report(predict_proba(fed.spec, fed.models_for([cl.client_id])[
                cl.client_id], x), y, layout)
            plain += rep.vector
        tol = len(members) * (layout.upper_bounds() - layout.lower_bounds()) / (2 * quant.levels)
        assert np.all(np.abs(g.sum - plain) <= tol + 1e-12)


def _north_drop(monkeypatch, fed, k, stage="masked_input"):
    north = sorted(c for c, cl in fed.clients.items() if cl.region == "north")
    monkeypatch.setattr(ev, "_dropouts", lambda f, ids, r: {c: stage for c in north[:k]})
    return north


def test_dropouts_up_to_n_minus_t_still_release(monkeypatch):
    fed = _fed(secagg_threshold=0.6)
    north = _north_drop(monkeypatch, fed, 2)  # 7 clients, complete graph, t = 5
    subs = _subs(fed)
    out = ev.evaluate_regions_task.fn(fed, subs, 1)
    g = ev.secure_sums(fed, subs, 1).groups["north"]
    assert (len(north), g.threshold, g.contributors, g.status) == (7, 5, 5, "ok")
    survivors = [s for s in subs if s.client_id in north[2:]]
    np.testing.assert_array_equal(g.sum_quantised, sum(s.quantised for s in survivors))
    assert "north" in out.published["metrics"]["accuracy"]["regions"]
    assert out.not_evaluated == {}


def test_below_threshold_region_is_not_evaluated(monkeypatch):
    fed = _fed(secagg_threshold=0.9)  # north: t = 7 of 7
    _north_drop(monkeypatch, fed, 1, stage="unmasking")
    out = ev.evaluate_regions_task.fn(fed, _subs(fed), 1)
    assert list(out.not_evaluated) == ["north"]
    assert out.published["not_evaluated"] == ["north"]
    assert "north" not in out.published["metrics"]["accuracy"]["regions"]
    assert not any(r.region == "north" and r.name == "accuracy" for r in out.releases)
    # the group still gets a (suppressed) envelope
    env = FederatedMetricEnvelope.from_json(out.envelopes["accuracy/north.json"])
    assert env.aggregate_value is None and env.participant_count_band.value == "suppressed"


def test_envelopes_validate_and_nothing_published_holds_a_count():
    fed = _fed(dropout_rate=0.1)
    out = ev.evaluate_regions_task.fn(fed, _subs(fed), 1)
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


def _synthetic(fed, acc):
    layout = ev.evaluation_state(fed).layout()
    quant = FixedPointQuantiser(layout.lower_bounds(), layout.upper_bounds())
    v = np.zeros(32)
    v[0], v[1] = acc, 0.5
    return [ev.DeviceSubmission(c, cl.region, quant.quantise(v)) for c, cl in fed.clients.items()]


@pytest.mark.parametrize("factor, fires", [(0.25, False), (2.0, True)])
def test_alert_fires_only_beyond_the_combined_bars(factor, fires):
    fed = _fed(epsilon=50.0)
    first = ev.evaluate_regions_task.fn(fed, _synthetic(fed, 0.8), 1)
    assert first.alerts == [] and "global" in first.published["new_baselines"]["accuracy"]
    bar = first.published["metrics"]["accuracy"]["global"]["error_bar"]
    out = ev.evaluate_regions_task.fn(fed, _synthetic(fed, 0.8 - factor * 2 * bar), 2)
    fired = {(a.metric, a.region) for a in out.alerts}
    assert (("accuracy", "global") in fired) is fires
    assert out.published["alerts_fired"] == len(out.alerts)
    # baselines persist on fed and survive a JSON round trip
    state = ev.evaluation_state(fed)
    assert ev.EvaluationState.from_dict(json.loads(json.dumps(state.to_dict()))) == state


def test_approve_hook_refuses_before_noise():
    fed = _fed()
    out = ev.evaluate_regions_task.fn(fed, _subs(fed), 1, approve=lambda plan: {
        r.key for r in plan.releases if r.region == "global"})
    assert out.refused and all(r.region != "global" for r in out.refused)
    assert all(r.region == "global" for r in out.releases)
    assert out.published["metrics"]["accuracy"]["regions"] == {}
