"""Central-DP mechanisms: scales against literal formulas, samples against scipy."""

import math

import dp_accounting
import numpy as np
import pytest
from scipy import stats

from clma.privacy import mechanisms as mech
from clma.privacy.mechanisms import (
    NoiseSource,
    PrivacyParameterError,
    analytic_gaussian_sigma,
    classic_gaussian_sigma,
    error_bar,
    gaussian_delta,
    gaussian_rho,
    interval_quantile,
    noise_scale,
    sample,
)

N_DRAWS = 20_000


def test_laplace_scale_is_sensitivity_over_epsilon():
    assert noise_scale(2.5, 0.5) == pytest.approx(5.0, rel=1e-15)
    assert noise_scale(1.0, 4.0, mechanism="laplace") == 0.25


def test_laplace_interval_is_exact_and_normal_approximation_is_not():
    b = 1.7
    half = error_bar(b, level=0.95)
    assert half == pytest.approx(b * math.log(20.0), rel=1e-15)
    lap = stats.laplace(scale=b)
    assert lap.cdf(half) - lap.cdf(-half) == pytest.approx(0.95, abs=1e-12)
    normal_half = 1.96 * math.sqrt(2.0) * b
    cov = lap.cdf(normal_half) - lap.cdf(-normal_half)
    assert cov == pytest.approx(0.9375, abs=5e-4)
    assert cov < 0.94


def test_gaussian_interval_uses_normal_quantile():
    assert interval_quantile("gaussian", 0.95) == pytest.approx(1.959963984540054, rel=1e-12)
    assert error_bar(3.0, mechanism="gaussian", level=0.9, n=10) == pytest.approx(
        3.0 * stats.norm.ppf(0.95) / 10, rel=1e-12
    )


def test_error_bar_is_one_over_n():
    assert error_bar(2.0, n=400) * 400 == pytest.approx(error_bar(2.0, n=1), rel=1e-14)


@pytest.mark.parametrize("eps,delta", [(0.3, 1e-5), (1.0, 1e-6), (4.0, 1e-5)])
def test_analytic_gaussian_is_tight(eps, delta):
    sens = 2.0
    sigma = analytic_gaussian_sigma(sens, eps, delta)
    assert gaussian_delta(sigma, sens, eps) <= delta
    # slightly less noise violates (eps, delta): the sigma is the smallest one
    assert gaussian_delta(sigma * (1 - 1e-6), sens, eps) > delta
    # independent check: Google's PLD accountant gives back epsilon at that delta
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier=sigma / sens))
    assert acc.get_epsilon(delta) == pytest.approx(eps, rel=0.01)


def test_analytic_gaussian_never_exceeds_classic():
    for eps in (0.1, 0.5, 0.9):
        for delta in (1e-3, 1e-5, 1e-8):
            assert analytic_gaussian_sigma(1.0, eps, delta) <= classic_gaussian_sigma(1.0, eps, delta)
    assert classic_gaussian_sigma(1.0, 0.5, 1e-5) == pytest.approx(
        math.sqrt(2 * math.log(1.25e5)) / 0.5, rel=1e-14
    )
    with pytest.raises(PrivacyParameterError, match="epsilon"):
        classic_gaussian_sigma(1.0, 1.5, 1e-5)


def test_opendp_gaussian_rho_matches_conversion():
    import opendp.prelude as dp

    dp.enable_features("contrib")
    sigma = 3.0
    meas = dp.m.make_gaussian(dp.atom_domain(T=float, nan=False), dp.absolute_distance(T=float),
                              scale=sigma)
    assert meas.map(1.5) == pytest.approx(gaussian_rho(1.5, sigma), rel=1e-9)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_epsilon_rejected(bad):
    with pytest.raises(PrivacyParameterError, match="epsilon"):
        noise_scale(1.0, bad)


def test_gaussian_needs_delta():
    with pytest.raises(PrivacyParameterError, match="delta"):
        noise_scale(1.0, 1.0, mechanism="gaussian")
    with pytest.raises(PrivacyParameterError, match="delta"):
        noise_scale(1.0, 1.0, mechanism="gaussian", delta=1.0)
    with pytest.raises(PrivacyParameterError, match="mechanism"):
        noise_scale(1.0, 1.0, mechanism="cauchy")


def _laplace_checks(draws, b):
    # std sqrt(2) b within 5 % (the sample std's relative sd is ~1 % here)
    assert np.std(draws) == pytest.approx(math.sqrt(2.0) * b, rel=0.05)
    assert stats.kstest(draws, stats.laplace(scale=b).cdf).pvalue > 1e-3


def test_opendp_laplace_vector_matches_scipy():
    b = 2.0
    noisy, source = sample(np.zeros(N_DRAWS), b)
    assert source is NoiseSource.OPENDP
    _laplace_checks(noisy, b)
    # the same checks reject a wrong scale (guards the tolerance)
    with pytest.raises(AssertionError):
        _laplace_checks(noisy, b * 1.1)


def test_opendp_scalar_sample():
    noisy, source = sample(10.0, 1.0)
    assert source is NoiseSource.OPENDP and isinstance(noisy, float) and noisy != 10.0


def test_seeded_sample_is_reproducible_and_flagged():
    a, src = sample(np.zeros(N_DRAWS), 0.5, seed=3)
    b, _ = sample(np.zeros(N_DRAWS), 0.5, seed=3)
    assert src is NoiseSource.SEEDED_SIMULATION
    np.testing.assert_array_equal(a, b)
    _laplace_checks(a, 0.5)


def test_gaussian_sample_std():
    for seed in (None, 5):
        noisy, _ = sample(np.zeros(N_DRAWS), 1.5, mechanism="gaussian", seed=seed)
        assert np.std(noisy) == pytest.approx(1.5, rel=0.05)
        assert stats.kstest(noisy, stats.norm(scale=1.5).cdf).pvalue > 1e-3


def test_sample_rejects_non_finite_aggregate():
    with pytest.raises(ValueError, match="finite"):
        sample(float("nan"), 1.0)


def test_module_exports():
    assert set(mech.__all__) <= set(dir(mech))
