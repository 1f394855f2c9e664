"""clma.engine.divergence.score_divergence: every client scored against its cohort's start
model on the server's probe set, leave-one-out parameter baseline, and the action's FedAvg
weights reaching the engine's aggregation step. Updates come from simulated clients
through the Clients seam; no Prefect."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from clma.config import validate_config
from clma.divergence import (
    activation_patterns,
    affinities,
    hierarchical_divergence,
    probe_digest,
)
from clma.engine import FederationEngine
from clma.engine.divergence import aggregation_weights, flagged_by, score_divergence
from clma.params import AllParams, model_to_vector, vector_to_model
from clma.rounds import ClientUpdate, fedavg
from clma.sim.clients import SimulatedClients
from clma.sim.federation import build_federation

N_CLIENTS = 8
ODD = 3  # the client whose first layer is re-randomised


def _config(action: str = "report", clients: int = N_CLIENTS, signal: str = "representation",
            flag: str = "one_sided", **extra):
    """One round's tests use the one-sided flag (a single round: no persistence yet)."""
    return validate_config({
        "name": "div-task", "seed": 5, "rounds": 2, "clients": clients,
        "data": {"probe_size": 48},
        "training": {"local_epochs": 1},
        "divergence": {"action": action, "z_threshold": 3.0, "beta": 1.0, "signal": signal,
                       "flag": flag, **extra},
        "tracking": {"enabled": False}, "budget": {"enabled": False},
    })


def _fed(action: str = "report", clients: int = N_CLIENTS, signal: str = "representation",
         flag: str = "one_sided", **extra):
    """The server's engine of the tiny federation over its simulated clients."""
    cfg = _config(action, clients, signal, flag, **extra)
    sim = build_federation(cfg)
    return FederationEngine(cfg, sim.assets(), SimulatedClients(sim))


def _updates(engine) -> list[ClientUpdate]:
    """Round 1's updates of every client, trained on the devices through the seam."""
    ctx = engine.begin_round(1)
    engine.accept(ctx, [engine.train(ctx)])
    assert ctx.failed == {}
    return ctx.updates


def _score(engine, updates, start, round_number):
    return score_divergence(engine.config.divergence, engine.assets, updates, start,
                            round_number)


def _rerandomise_first_layer(fed, params: np.ndarray, seed: int) -> np.ndarray:
    model = vector_to_model(params, fed.assets.model_spec.build(), AllParams())
    fresh = fed.assets.model_spec.build(seed=seed)
    with torch.no_grad():
        model[1].weight.copy_(fresh[1].weight)  # model[0] is Flatten, model[1] the first Linear
        model[1].bias.copy_(fresh[1].bias)
    return model_to_vector(model, AllParams())


@pytest.fixture(scope="module")
def scored():
    fed = _fed()
    updates = _updates(fed)
    odd = updates[ODD]
    updates[ODD] = ClientUpdate(odd.client_id, odd.cohort_id,
                                _rerandomise_first_layer(fed, odd.params, 1234),
                                odd.n_samples, odd.drift_flag)
    start = dict(fed.state.cohort_models)
    out = _score(fed, updates, start, 1)
    return fed, updates, start, out


def test_rerandomised_first_layer_is_flagged_by_representation(scored):
    _, _, _, out = scored
    rep = out.representation
    assert rep.flagged == [ODD]
    assert out.flagged == [ODD]
    assert max(rep.z, key=rep.z.get) == ODD
    assert rep.z[ODD] > 3.0
    assert sorted(rep.scores) == list(range(N_CLIENTS))
    assert out.weights is None  # action 'report': aggregation unchanged
    assert out.cohorts == dict.fromkeys(range(N_CLIENTS), 0)


def test_representation_score_is_the_library_divergence_to_the_start_model(scored):
    fed, updates, start, out = scored
    spec, probe = fed.clients.federation.spec, fed.clients.federation.probe_x  # the server's assets are the world's
    assert fed.assets.probe_x is probe
    ref = vector_to_model(start[0], spec.build(), AllParams())
    local = vector_to_model(updates[0].params, spec.build(), AllParams())
    k_ref = affinities(activation_patterns(ref, probe))
    k_loc = affinities(activation_patterns(local, probe))
    expected = hierarchical_divergence(k_ref, k_loc, beta=1.0)
    assert out.representation.scores[0] == pytest.approx(expected, rel=1e-12)
    # robust z against the literal formula across the round's clients
    s = np.array([out.representation.scores[c] for c in range(N_CLIENTS)])
    med = np.median(s)
    mad = np.median(np.abs(s - med))
    z_lit = (s - med) / (1.482602218505602 * mad)
    np.testing.assert_allclose([out.representation.z[c] for c in range(N_CLIENTS)], z_lit,
                               rtol=1e-9)


def test_parameter_baseline_is_leave_one_out_cosine(scored):
    _, updates, start, out = scored
    u = np.stack([x.params.astype(np.float64) - start[0] for x in updates])
    total = u.sum(axis=0)
    for i in range(N_CLIENTS):
        mean_others = (total - u[i]) / (N_CLIENTS - 1)
        cos = u[i] @ mean_others / (np.linalg.norm(u[i]) * np.linalg.norm(mean_others))
        assert out.parameter.scores[i] == pytest.approx(1.0 - cos, abs=1e-5)
    assert out.parameter.method == "parameter_cosine"


def test_summary_has_no_client_ids_and_records_probe(scored):
    fed, _, _, out = scored
    s = out.summary()
    assert s["probe_sha256"] == probe_digest(fed.clients.federation.probe_x) and len(s["probe_sha256"]) == 64
    assert s["representation"]["n_flagged"] == 1
    assert s["representation"]["n_clients"] == N_CLIENTS
    assert s["parameter"]["leave_one_out"] is True
    assert set(s["representation"]) == {
        "median", "mad", "scale", "scale_rule", "max_z", "min_z", "n_flagged",
        "n_flagged_one_sided", "n_flagged_two_sided", "n_persistent", "persistence_max_abs",
        "n_clients", "z_threshold"}
    assert s["flag"] == "one_sided"
    assert "flagged" not in s["representation"] and "scores" not in s["representation"]


def test_each_client_is_scored_against_its_own_cohort_start_model(scored):
    fed, updates, start, _ = scored
    # client 0 starts from cohort 7 whose model is exactly its local model: D = 0
    u0 = updates[0]
    moved = [ClientUpdate(0, 7, u0.params, u0.n_samples, False), *updates[1:]]
    out = _score(fed, moved, {**start, 7: u0.params.copy()}, 2)
    assert out.representation.scores[0] == 0.0
    assert out.cohorts[0] == 7
    assert out.representation.scores[1] > 0.0
    with pytest.raises(ValueError, match="start_models"):
        _score(fed, moved, start, 2)


def _aggregate(engine, updates, start):
    """The engine's steps 4-5 on a round context holding ``updates``: divergence scores,
    then FedAvg per cohort (with the action's weights). Returns (outcome, cohort 0 model)."""
    ctx = engine.begin_round(1)
    ctx.start_models, ctx.updates = dict(start), list(updates)
    div = engine.score_divergence(ctx)
    return div, engine.aggregate(ctx)[0]


@pytest.mark.parametrize("action, factor", [("exclude", 0.0), ("downweight", 0.5)])
def test_action_weights_reach_aggregation(scored, action, factor):
    _, updates, start, _ = scored
    out, agg = _aggregate(_fed(action), updates, start)
    assert out.flagged == [ODD]
    assert out.weights == {ODD: factor}
    w = [u.n_samples * (factor if u.client_id == ODD else 1.0) for u in updates]
    np.testing.assert_array_equal(agg, fedavg([u.params for u in updates], w))
    if action == "exclude":
        others = [u for u in updates if u.client_id != ODD]
        np.testing.assert_array_equal(
            agg, fedavg([u.params for u in others], [u.n_samples for u in others]))
    report, plain = _aggregate(_fed("report"), updates, start)
    assert report.weights is None
    np.testing.assert_array_equal(plain, fedavg([u.params for u in updates],
                                                [u.n_samples for u in updates]))
    assert not np.array_equal(agg, plain)


def _report(scores):
    from clma.divergence import build_report

    return build_report("parameter_cosine", list(range(len(scores))), np.asarray(scores, float),
                        3.0)


def test_flagged_by_rules():
    rep = _report([0.0, 0.1, 0.2, 0.1, 0.15, 0.12, 10.0, 9.0])  # flags 6, 7
    par = _report([9.0, 0.1, 0.2, 0.1, 0.15, 0.12, 10.0, 0.11])  # flags 0, 6
    assert rep.flagged == [6, 7] and par.flagged == [0, 6]
    assert flagged_by("representation", rep, par) == [6, 7]
    assert flagged_by("parameter", rep, par) == [0, 6]
    assert flagged_by("either", rep, par) == [0, 6, 7]
    assert flagged_by("both", rep, par) == [6]
    with pytest.raises(ValueError, match="divergence.signal"):
        flagged_by("any", rep, par)


@pytest.mark.parametrize("signal", ["representation", "parameter", "either", "both"])
def test_signal_picks_whose_flags_drive_the_action(scored, signal):
    _, updates, start, base = scored
    out = _score(_fed("exclude", signal=signal), updates, start, 1)
    want = flagged_by(signal, base.representation, base.parameter)
    assert out.flagged == want
    assert out.weights == (dict.fromkeys(want, 0.0) or None)
    assert out.summary()["signal"] == signal
    assert out.summary()["n_flagged"] == len(want)
    # both signals are still scored and reported whatever drives the action
    assert out.representation.flagged == base.representation.flagged
    assert out.parameter.flagged == base.parameter.flagged


def test_signal_is_validated():
    from clma.config import ConfigError

    with pytest.raises(ConfigError, match="divergence.signal"):
        validate_config({"name": "x", "divergence": {"signal": "any"}})


def test_aggregation_weights_rules():
    assert aggregation_weights([2, 5], "report", 0.5) is None
    assert aggregation_weights([], "exclude", 0.5) is None
    assert aggregation_weights([2, 5], "exclude", 0.5) == {2: 0.0, 5: 0.0}
    assert aggregation_weights([2], "downweight", 0.25) == {2: 0.25}
    with pytest.raises(ValueError, match="divergence.action"):
        aggregation_weights([2], "drop", 0.5)


def test_fewer_than_three_clients_flag_nobody():
    fed = _fed("exclude", clients=2)
    updates = _updates(fed)
    out = _score(fed, updates, dict(fed.state.cohort_models), 1)
    assert out.flagged == [] and out.weights is None
    assert all(math.isnan(z) for z in out.representation.z.values())
    assert out.representation.scale_rule == "too_few_clients"
    assert out.summary()["representation"]["max_z"] is None


def test_bad_input_is_one_clear_error(scored):
    fed, updates, start, _ = scored
    with pytest.raises(ValueError, match="updates"):
        _score(fed, [], start, 1)
    with pytest.raises(ValueError, match="distinct"):
        _score(fed, [updates[0], updates[0]], start, 1)


# ------------------------------------------------------------------ flags in the engine


def test_two_sided_flag_catches_a_client_far_below_the_others(scored):
    """A client whose representation barely moves (scored against its own local model:
    D = 0) is far *below* the others: one-sided misses it, two-sided flags it."""
    fed, updates, start, _ = scored
    u0 = updates[0]
    moved = [ClientUpdate(0, 7, u0.params, u0.n_samples, False), *updates[1:]]
    starts = {**start, 7: u0.params.copy()}
    for flag, want_in in (("one_sided", False), ("two_sided", True)):
        out = score_divergence(_config(flag=flag).divergence, fed.assets, moved, starts, 2)
        z0 = out.representation.z[0]
        assert (0 in out.flag_sets["representation"]) is want_in
        assert (0 in out.flag_sets["representation"]) is (
            (abs(z0) if flag == "two_sided" else z0) > 3.0)
    assert z0 < -3.0


def test_persistence_state_is_the_ewma_of_the_clipped_z(scored):
    """s_t = lam clip(z_t) + (1 - lam) s_{t-1} per signal and client, from the state passed
    in; the flag is |s_t| > persistence_threshold and |robust z of s_t over the round's
    clients| > z_threshold; the state is not mutated."""
    from scipy import stats

    fed, updates, start, _ = scored
    cfg = _config(flag="persistent", persistence_lambda=0.4, persistence_threshold=1.0,
                  persistence_clip=2.5).divergence
    before = {"representation": {c: 0.5 * (-1) ** c for c in range(N_CLIENTS)},
              "parameter": {1: -3.0}}
    snapshot = {k: dict(v) for k, v in before.items()}
    out = score_divergence(cfg, fed.assets, updates, start, 2, persistence=before)
    assert before == snapshot
    for sig, rep in (("representation", out.representation), ("parameter", out.parameter)):
        for c, z in rep.z.items():
            prev = before[sig].get(c, 0.0)
            want = 0.4 * min(max(z, -2.5), 2.5) + 0.6 * prev
            assert out.persistence[sig][c] == pytest.approx(want, abs=1e-12)
        ids = sorted(rep.z)
        sv = np.array([out.persistence[sig][c] for c in ids])
        zs = (sv - np.median(sv)) / stats.median_abs_deviation(sv, scale="normal")
        assert out.flag_sets[sig] == [c for c, v, q in zip(ids, sv, zs, strict=True)
                                      if abs(v) > 1.0 and abs(q) > 3.0]
    assert out.flagged == out.flag_sets["representation"]


def test_engine_keeps_persistence_in_server_state_and_snapshots_it(scored):
    from clma.engine.state import restore_files, snapshot_files

    _, updates, start, _ = scored
    eng = _fed(flag="persistent")
    assert eng.state.divergence_persistence == {}
    ctx = eng.begin_round(1)
    ctx.start_models, ctx.updates = dict(start), list(updates)
    out = eng.score_divergence(ctx)
    assert eng.state.divergence_persistence == out.persistence
    assert set(out.persistence["representation"]) == set(range(N_CLIENTS))
    files = snapshot_files(eng.state)
    assert "divergence.json" in files
    back = restore_files(files, 1)
    assert back.divergence_persistence == out.persistence
    # the published summary has no client id and no per-client s
    s = out.summary()
    assert "persistence" not in s and str(out.persistence) not in str(s)


@pytest.mark.parametrize("field, value", [
    ("flag", "sometimes"), ("persistence_lambda", 0.0), ("persistence_lambda", 1.5),
    ("persistence_threshold", -1.0), ("persistence_clip", 0.0)])
def test_bad_flag_settings_name_the_field(field, value):
    from clma.config import ConfigError

    with pytest.raises(ConfigError, match=f"divergence.{field}"):
        validate_config({"name": "x", "divergence": {field: value}})
