"""clma.budget.accounting: one adjacency (replace-one), the DP-FedAvg event sampled without
replacement, and every charged epsilon against dp-accounting's own value for the declared
event (computed here with dp-accounting directly)."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from clma.budget import (
    ADJACENCY,
    ADJACENCY_NAME,
    AccountingError,
    MechanismEvent,
    compose,
)
from clma.config import default_config
from clma.rounds import selection_size

REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE
SWOR = MechanismEvent.gaussian_sampled_without_replacement


def _rdp(events_counts, delta):
    acc = RdpAccountant(neighboring_relation=REPLACE_ONE)
    for event, n in events_counts:
        acc.compose(event, n)
    return acc.get_epsilon(delta)


def test_one_declared_adjacency():
    assert ADJACENCY is REPLACE_ONE and ADJACENCY_NAME == "replace_one"
    assert compose([MechanismEvent.laplace(0.5)], 1e-5).adjacency == "replace_one"
    assert compose([SWOR(1.0, 60, 15)], 1e-5).adjacency == "replace_one"


# ------------------------------------------------------------------ the event


def test_sampled_without_replacement_event_is_dp_accountings_event():
    ev = SWOR(1.3, 60, 15)
    assert ev.to_dp_event() == dp_accounting.SampledWithoutReplacementDpEvent(
        60, 15, dp_accounting.GaussianDpEvent(1.3))
    assert ev.sampling == "without_replacement" and not ev.is_pure
    assert SWOR(1.3, np.int64(60), np.int64(15)) == ev  # numpy integers are integers
    assert MechanismEvent.gaussian(1.3).to_dp_event() == dp_accounting.GaussianDpEvent(1.3)
    assert MechanismEvent.laplace(0.5).to_dp_event() == dp_accounting.LaplaceDpEvent(2.0)
    # round trip through the ledger's stored form
    assert MechanismEvent.model_validate(ev.to_record()) == ev


@pytest.mark.parametrize(("args", "match"), [
    ((1.0, 10, 11), "sample_size must be at most population_size"),
    ((1.0, 10, 0), "sample_size"),
    ((1.0, 0, 0), "population_size"),
    ((1.0, 10.0, 5), "population_size must be an integer"),
    ((1.0, 10, True), "sample_size must be an integer"),
    ((0.0, 10, 5), "noise_multiplier"),
    ((float("nan"), 10, 5), "noise_multiplier"),
])
def test_sampled_without_replacement_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        SWOR(*args)


def test_event_fields_must_match_the_mechanism():
    with pytest.raises(ValueError, match="give both or neither"):
        MechanismEvent(mechanism="gaussian", noise_multiplier=1.0, population_size=10)
    with pytest.raises(ValueError, match="laplace event is not subsampled"):
        MechanismEvent(mechanism="laplace", epsilon=1.0, population_size=10, sample_size=5)
    with pytest.raises(ValueError, match="not also Poisson"):
        MechanismEvent(mechanism="gaussian", noise_multiplier=1.0, population_size=10,
                       sample_size=5, sampling_probability=0.5)


def test_unsampled_events_are_stored_as_before():
    """Ledgers written before sampled events hold exactly this form, so a re-run of one of
    their keys is not an idempotency conflict."""
    assert MechanismEvent.gaussian(4.0).to_record() == {
        "mechanism": "gaussian", "epsilon": None, "noise_multiplier": 4.0,
        "sampling_probability": 1.0}
    assert MechanismEvent.laplace(0.5).to_record() == {
        "mechanism": "laplace", "epsilon": 0.5, "noise_multiplier": None,
        "sampling_probability": 1.0}


def test_poisson_sampled_events_only_load():
    with pytest.raises(ValueError, match="gaussian_sampled_without_replacement"):
        MechanismEvent.gaussian(1.0, sampling_probability=0.25)
    old = MechanismEvent.model_validate({"mechanism": "gaussian", "epsilon": None,
                                         "noise_multiplier": 1.0, "sampling_probability": 0.25})
    assert old.sampling == "poisson"
    with pytest.raises(AccountingError, match="Poisson"):
        compose([old], 1e-5)


# ------------------------------------------------------------------ composition vs dp-accounting


@pytest.mark.parametrize(("z", "n_pop", "k", "rounds", "delta"), [
    (1.0, 60, 60, 10, 7e-6),
    (1.1, 60, 15, 10, 7e-6),
    (0.8, 1000, 50, 25, 1e-5),
])
def test_charged_epsilon_equals_dp_accounting_rdp_for_the_declared_event(z, n_pop, k, rounds,
                                                                         delta):
    got = compose([SWOR(z, n_pop, k)] * rounds, delta)
    expected = _rdp([(dp_accounting.SampledWithoutReplacementDpEvent(
        n_pop, k, dp_accounting.GaussianDpEvent(z)), rounds)], delta)
    assert got.method == "rdp" and got.delta == delta
    assert got.epsilon == pytest.approx(expected, rel=1e-12)
    assert got.epsilon_rdp == got.epsilon


def test_sampling_without_replacement_amplifies():
    full = compose([SWOR(1.0, 60, 60)] * 10, 7e-6).epsilon
    quarter = compose([SWOR(1.0, 60, 15)] * 10, 7e-6).epsilon
    assert quarter < full


def test_a_line_mixing_laplace_and_sampled_rounds_composes_in_one_rdp_accountant():
    events = [SWOR(1.2, 60, 30)] * 4 + [MechanismEvent.laplace(0.25)] * 3
    got = compose(events, 1e-5)
    expected = _rdp([
        (dp_accounting.SampledWithoutReplacementDpEvent(
            60, 30, dp_accounting.GaussianDpEvent(1.2)), 4),
        (dp_accounting.LaplaceDpEvent(4.0), 3),
    ], 1e-5)
    assert got.method == "rdp" and got.epsilon == pytest.approx(expected, rel=1e-12)
    # more than either part alone
    assert got.epsilon > compose([SWOR(1.2, 60, 30)] * 4, 1e-5).epsilon


def test_unsampled_gaussian_line_is_the_replace_one_pld():
    """The PLD path compares N(0, sigma) with N(Delta, sigma) for the replace-one Delta: it
    equals dp-accounting's PLD under REPLACE_ONE, which reads GaussianDpEvent(m) as
    sigma / C with the pair N(-C, sigma), N(C, sigma), i.e. m = 2 z."""
    z, n, delta = 2.0, 5, 1e-5
    got = compose([MechanismEvent.gaussian(z)] * n, delta)
    replace = PLDAccountant(REPLACE_ONE, value_discretization_interval=1e-3)
    replace.compose(dp_accounting.GaussianDpEvent(2 * z), n)
    assert got.method == "pld"
    assert got.epsilon == pytest.approx(replace.get_epsilon(delta), rel=1e-6)
    # and the RDP cross-check is the replace-one RDP of the same events
    assert got.epsilon_rdp == pytest.approx(
        _rdp([(dp_accounting.GaussianDpEvent(z), n)], delta), rel=1e-12)


def test_dp_accounting_rdp_reads_the_noise_multiplier_against_the_replace_one_sensitivity():
    """Pins the convention the charges rely on (google/differential-privacy issue #378):
    under REPLACE_ONE, sampling all N of N clients, dp-accounting 0.6's RDP of
    GaussianDpEvent(z) is a / (2 z^2), the Gaussian mechanism with sensitivity / sigma =
    1 / z. If the library starts reading z as sigma / C (sensitivity 2 C), this fails."""
    z = 1.7
    acc = RdpAccountant(neighboring_relation=REPLACE_ONE)
    acc.compose(dp_accounting.SampledWithoutReplacementDpEvent(
        40, 40, dp_accounting.GaussianDpEvent(z)))
    np.testing.assert_allclose(acc.rdp, acc.orders / (2 * z * z), rtol=1e-12)
    # and the PLD under REPLACE_ONE doubles the shift: GaussianDpEvent(z) there is z / 2 here
    pld_replace = PLDAccountant(REPLACE_ONE, value_discretization_interval=1e-3)
    pld_replace.compose(dp_accounting.GaussianDpEvent(z))
    pld_half = PLDAccountant(value_discretization_interval=1e-3)
    pld_half.compose(dp_accounting.GaussianDpEvent(z / 2))
    assert pld_replace.get_epsilon(1e-5) == pytest.approx(pld_half.get_epsilon(1e-5), rel=1e-6)


def test_pure_line_is_the_exact_sum_and_needs_no_delta():
    got = compose([MechanismEvent.laplace(e) for e in (0.25, 0.5, 0.125)], 0.0)
    assert (got.method, got.epsilon, got.delta, got.epsilon_rdp) == ("exact_sum", 0.875, 0.0, None)
    with pytest.raises(AccountingError, match="delta"):
        compose([SWOR(1.0, 10, 5)], 0.0)
    assert compose([], 1e-5).method == "none"


# ------------------------------------------------------------------ the review's figures


def test_review_regression_ten_rounds_at_z_one_on_the_default_configuration():
    """Issue 21 item 3: on the default configuration (60 clients, participation 1: all 60
    selected each round), 10 DP-FedAvg rounds with noise std C on the sum of updates
    clipped to C (the old estimator at z = 1, realised n = 60) cost epsilon 46.2 under
    replace-one (its replace-one noise multiplier is 1/2) but were charged 17.9 (add-or-
    remove, z = 1). The charge for that mechanism is now RDP's bound on the replace-one
    value (48.8 >= 46.2), and the new estimator at z = 1 (noise std 2 C) costs 19.05."""
    cfg = default_config()  # clma/configs/default.toml
    population = cfg.clients
    sample = selection_size(population, cfg.training.participation)
    assert (population, sample) == (60, 60)
    delta = 1e-5
    old_charge = PLDAccountant(value_discretization_interval=1e-3)
    old_charge.compose(dp_accounting.GaussianDpEvent(1.0), 10)
    assert round(old_charge.get_epsilon(delta), 1) == 17.9
    tight_replace_one = PLDAccountant(REPLACE_ONE, value_discretization_interval=1e-3)
    tight_replace_one.compose(dp_accounting.GaussianDpEvent(1.0), 10)  # sigma / C = 1
    assert round(tight_replace_one.get_epsilon(delta), 1) == 46.2

    # the same mechanism (sigma = C = z * 2C with z = 1/2), charged as declared now
    now = compose([SWOR(0.5, population, sample)] * 10, delta)
    assert now.epsilon == pytest.approx(_rdp([(dp_accounting.SampledWithoutReplacementDpEvent(
        60, 60, dp_accounting.GaussianDpEvent(0.5)), 10)], delta), rel=1e-12)
    assert round(now.epsilon, 2) == 48.80
    assert now.epsilon >= tight_replace_one.get_epsilon(delta)  # an upper bound, never less
    # the new estimator at z = 1: twice the noise
    new = compose([SWOR(1.0, population, sample)] * 10, delta)
    assert round(new.epsilon, 2) == 19.05
    assert new.epsilon >= old_charge.get_epsilon(delta)  # tight value of sigma = 2C: 17.86
    assert math.isclose(new.epsilon, compose([SWOR(1.0, 60, 60)] * 10, delta).epsilon)
