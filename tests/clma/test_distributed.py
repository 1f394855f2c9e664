"""clma.privacy.distributed: the distributed discrete Gaussian's accounting (KLS21
Proposition 14) against the Renyi divergence computed numerically from the exact pmf of
the sum, its conversion by dp-accounting, the calibration, OpenDP's sampler against the
discrete Gaussian's moments and pmf, the exact error-bar quantile, and the ring's
no-wrap bound against simulated wrap-arounds."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant
from scipy import special, stats

from clma.budget.accounting import MechanismEvent, compose
from clma.privacy.distributed import (
    DistributedNoise,
    calibrate_sigma,
    ddg_epsilon,
    ddg_event,
    ddg_rdp,
    ddg_tau,
    decode_sum,
    dg_variance,
    noisy_words,
    rho_for_epsilon,
    ring_bits,
    sample_noise,
    sigma_for_rho,
    sum_noise_quantile,
    wrap_probability,
)
from clma.privacy.secagg import SecAggConfig


def _dg_log_pmf(sigma: float, r: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.arange(-r, r + 1)
    lw = -(x.astype(float) ** 2) / (2 * sigma * sigma)
    return x, lw - special.logsumexp(lw)


def _sum_pmf(sigma: float, n: int) -> np.ndarray:
    """Exact pmf of the sum of n independent N_Z(0, sigma^2), support -n r .. n r."""
    _, lp = _dg_log_pmf(sigma, int(math.ceil(25 * sigma)) + 3)
    p = np.exp(lp)
    out = p
    for _ in range(n - 1):
        out = np.convolve(out, p)
    return out


def _renyi(p: np.ndarray, shift: int, alpha: float) -> float:
    """D_alpha(P || P shifted by ``shift``) on the common support where both are > 1e-280."""
    a, b = p[shift:], p[:len(p) - shift]  # a(x) = P(x + shift), b(x) = P(x)
    keep = (a > 1e-280) & (b > 1e-280)
    la, lb = np.log(a[keep]), np.log(b[keep])
    return float(special.logsumexp(alpha * la + (1 - alpha) * lb) / (alpha - 1))


@pytest.mark.parametrize("sigma, n, delta_q", [(2.0, 5, 3), (4.0, 3, 6), (0.6, 4, 1),
                                               (1.0, 2, 2)])
def test_proposition_14_bounds_the_numerical_renyi_divergence(sigma, n, delta_q):
    """The bound holds at every order, and where tau is negligible it is tight (the sum is
    then essentially N_Z(0, n sigma^2), whose divergence is alpha Delta^2 / (2 n sigma^2))."""
    p = _sum_pmf(sigma, n)
    for alpha in (1.5, 2.0, 4.0, 8.0, 16.0):
        num = _renyi(p, delta_q, alpha)
        bound = float(ddg_rdp(alpha, sigma, n, float(delta_q))[0])
        assert num <= bound * (1 + 1e-9) + 1e-12, (alpha, num, bound)
        if ddg_tau(sigma, n) < 1e-12:
            assert num >= 0.98 * bound, (alpha, num, bound)
    gauss = 2.0 * delta_q**2 / (2 * n * sigma**2)
    assert float(ddg_rdp(2.0, sigma, n, float(delta_q))[0]) >= gauss


def test_tau_is_the_papers_sum():
    assert ddg_tau(1.0, 1) == 0.0
    assert ddg_tau(0.5, 3) == pytest.approx(
        10 * (math.exp(-2 * math.pi**2 * 0.25 / 2) + math.exp(-2 * math.pi**2 * 0.25 * 2 / 3)))


def test_epsilon_is_dp_accountings_rdp_conversion_and_the_ledger_charges_it():
    sigma, n, sens, delta = 3.0e4, 12, 65535.0, 1e-6
    rho, xi = ddg_event(sigma, n, sens, delta)
    acc = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc.compose(dp_accounting.ZCDpEvent(rho, xi))
    assert ddg_epsilon(sigma, n, sens, delta) == pytest.approx(acc.get_epsilon(delta), rel=1e-12)
    # rho_for_epsilon: the largest rho dp-accounting converts to at most epsilon
    r = rho_for_epsilon(1.0, delta)
    charged = compose([MechanismEvent.zcdp(r)], delta)
    assert charged.method == "rdp" and 0.999 <= charged.epsilon <= 1.0
    assert compose([MechanismEvent.zcdp(r * 1.01)], delta).epsilon > 1.0
    # two releases compose to ZCDpEvent(2 rho)
    acc2 = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc2.compose(dp_accounting.ZCDpEvent(2 * r))
    assert compose([MechanismEvent.zcdp(r)] * 2, delta).epsilon == pytest.approx(
        acc2.get_epsilon(delta), rel=1e-12)
    with pytest.raises(ValueError, match="zcdp event takes rho"):
        MechanismEvent(mechanism="zcdp", epsilon=1.0)


@pytest.mark.parametrize("n", [1, 6, 51])
def test_calibrated_sigma_is_the_smallest_meeting_rho(n):
    rho = rho_for_epsilon(2.0, 1e-6)
    s = sigma_for_rho(rho, n, 65535.0)
    assert float(ddg_rdp(1.0 + 1e-12, s, n, 65535.0)[0]) <= rho * (1 + 1e-9)
    assert ddg_epsilon(s, n, 65535.0, 1e-6) <= 2.0
    assert float(ddg_rdp(1.0 + 1e-12, s / 1.002, n, 65535.0)[0]) > rho
    # tau is 0 here, so the sum's sigma is the continuous Gaussian's Delta / sqrt(2 rho)
    assert s * math.sqrt(n) == pytest.approx(65535.0 / math.sqrt(2 * rho), rel=2e-3)
    assert calibrate_sigma(2.0, 1e-6, n, 65535.0) == s


def test_dg_variance_matches_direct_summation_on_both_branches():
    for sigma in (0.5, 0.6, 1.0, 3.0):
        x, lp = _dg_log_pmf(sigma, 60)
        assert dg_variance(sigma) == pytest.approx(float(np.sum(np.exp(lp) * x**2)), rel=1e-12)
    x, lp = _dg_log_pmf(50.0, 2000)
    assert dg_variance(50.0) == pytest.approx(float(np.sum(np.exp(lp) * x**2)), rel=1e-12)
    assert dg_variance(0.6) < 0.36  # below sigma^2 in the non-Gaussian regime


@pytest.mark.parametrize("sigma, size", [(3.0, 6000), (0.6, 3000)])
def test_opendp_sampler_moments_and_pmf(sigma, size):
    """Mean and variance within 5 standard errors of the discrete Gaussian's; the pmf by a
    chi-square test (p > 1e-4)."""
    z = sample_noise(sigma, size)
    assert z.dtype == np.int64 and z.shape == (size,)
    var = dg_variance(sigma)
    assert abs(z.mean()) <= 5 * math.sqrt(var / size)
    kurt_se = math.sqrt(2.0 / size) * var * 1.2
    assert abs(z.var() - var) <= 5 * kurt_se
    x, lp = _dg_log_pmf(sigma, int(6 * sigma) + 2)
    p = np.exp(lp)
    edges = [x[0]] + [v for v in x[1:] if p[x == v][0] * size >= 5]
    lo, hi = int(np.ceil(-3 * sigma)), int(np.floor(3 * sigma))
    bins = np.arange(lo, hi + 1)
    obs = np.array([np.sum(z < lo)] + [np.sum(z == b) for b in bins] + [np.sum(z > hi)])
    exp = np.array([p[x < lo].sum()] + [p[x == b][0] for b in bins] + [p[x > hi].sum()]) * size
    assert edges and stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-4
    with pytest.raises(ValueError, match="sigma"):
        sample_noise(0.4, 3)


def test_error_bar_quantile_is_exact_on_both_branches():
    # sigma below 4: exact convolution; compare with an independent computation here
    for sigma, n in ((1.5, 4), (0.7, 9)):
        p = _sum_pmf(sigma, n)
        r = len(p) // 2
        b = int(sum_noise_quantile(sigma, n))
        assert p[r - b:r + b + 1].sum() >= 0.95 > p[r - b + 1:r + b].sum()
    # at the switch (sigma = 4): the DG(n sigma^2) shortcut equals the convolution
    for n in (2, 3, 7):
        p = _sum_pmf(4.0, n)
        r = len(p) // 2
        b = int(sum_noise_quantile(4.0, n))
        assert p[r - b:r + b + 1].sum() >= 0.95 > p[r - b + 1:r + b].sum()
    # large sigma: the Gaussian quantile
    assert sum_noise_quantile(1e4, 16) == pytest.approx(1.959964 * 4e4, abs=2.0)


@pytest.mark.parametrize(("sigma", "n", "level"), [
    (4.0, 1, 0.01), (4.0, 7, 0.5), (5.3, 3, 0.99), (123.4, 6, 0.95), (1e4, 16, 0.95),
    (1e4, 16, 1 - 1e-6), (2.5e4, 9, 0.95)])
def test_error_bar_quantile_sums_only_up_to_the_bar_and_equals_the_whole_pmf(sigma, n, level):
    # from sigma = 4 the bar sums exp(-k^2 / 2 s^2) up to b against the Poisson-summation
    # normaliser s sqrt(2 pi): the same integer as the normalised pmf on +-40 s, also when
    # the sum runs over several chunks
    from clma.privacy.distributed import _dg_quantile

    s = sigma * np.sqrt(n)
    x = np.arange(-int(np.ceil(40 * s)) - 2, int(np.ceil(40 * s)) + 3)
    w = np.exp(-(x.astype(np.float64) ** 2) / (2 * s * s))
    p = w / w.sum()
    r = len(p) // 2
    expected = int(np.searchsorted(np.cumsum(np.r_[p[r], p[r + 1:] + p[:r][::-1]]), level))
    assert p[r - expected:r + expected + 1].sum() >= level
    assert sum_noise_quantile(sigma, n, level) == expected
    assert _dg_quantile(s, level, chunk=7) == expected
    assert abs(w.sum() - s * np.sqrt(2 * np.pi)) < 1e-12 * w.sum()


def test_ring_wraps_no_more_often_than_the_bound_and_decodes_exactly_otherwise():
    """A deliberately small ring (k = 10, 3 members, Q = 200, sigma = 61: margin 212, twice
    the sum's std): the bound (0.54) holds against simulated wrap-arounds (about 9 %
    expected), which a wrongly centred decoding would exceed."""
    k, n, levels, sigma = 10, 3, 200, 61.0
    rng = np.random.default_rng(5)
    trials = 300
    noise = DistributedNoise(sigma=sigma, coordinates=(0, 1))
    q = rng.integers(0, levels + 1, size=(trials, n, 2)).astype(np.uint64)
    margin = 2 ** (k - 1) - math.ceil(n * levels / 2)
    wraps = 0
    for t in range(trials):
        words = [noisy_words(q[t, i], noise, k) for i in range(n)]
        modsum = np.sum(words, axis=0, dtype=np.uint64) % np.uint64(2**k)
        dec = decode_sum(modsum, k, n, levels)
        noisy = dec - q[t].sum(axis=0).astype(np.int64)
        wrapped = np.abs(noisy) >= margin
        wraps += int(wrapped.any())
    bound = wrap_probability(n, levels, sigma, 2, k)
    # empirical wrap rate (both coordinates) <= bound (+ 4 standard errors)
    assert wraps / trials <= bound + 4 * math.sqrt(bound * (1 - bound) / trials)
    assert 0 < wraps  # the test can see wraps at all
    # the real sizes: the ring is the smallest keeping the bound at 2^-40
    kk = ring_bits(60, 65535, 1e5, 2, security=40)
    assert wrap_probability(60, 65535, 1e5, 2, kk) <= 2.0**-40
    assert kk == 32 or wrap_probability(60, 65535, 1e5, 2, kk - 1) > 2.0**-40
    assert ring_bits(60, 65535, 1e9, 2) > 32
    # secure aggregation refuses a ring that may wrap
    with pytest.raises(ValueError, match="may wrap around the ring"):
        SecAggConfig(n_clients=3, threshold=2, vector_length=2, modulus_bits=10,
                     quantisation_levels=15, noise=noise, min_survivors=2)


def test_decode_is_exact_without_wrap():
    k, n, levels = 32, 5, 65535
    true = np.array([3 * levels, -40000, 5 * levels + 90000], dtype=np.int64)
    words = (true % (1 << k)).astype(np.uint64)
    np.testing.assert_array_equal(decode_sum(words, k, n, levels), true)
