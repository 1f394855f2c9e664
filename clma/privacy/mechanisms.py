"""Central differential-privacy mechanisms applied ONCE to an aggregate.

The noise in CLMA is added to the (secure) sum over a cohort, never per
client: one draw per released coordinate.  This module gives the noise scale
for a mechanism from the sensitivity of the sum and the release's privacy
parameters, the half-width of the interval with exact coverage for that noise,
and a sampler.

Mechanisms
----------
``laplace`` (pure epsilon-DP)
    Noise ``Laplace(0, b)`` with ``b = sensitivity / epsilon`` where
    ``sensitivity`` is the L1 sensitivity of the released sum (Dwork, McSherry,
    Nissim & Smith 2006, "Calibrating noise to sensitivity", Prop. 1).
    ``P(|Z| <= t) = 1 - exp(-t / b)``, so the two-sided interval of level
    ``q`` has half-width ``b * ln(1 / (1 - q))`` (``b ln 20`` for 95 %), exact.
``gaussian`` ((epsilon, delta)-DP)
    Noise ``N(0, sigma^2)`` with ``sigma`` the *smallest* standard deviation
    for which the Gaussian mechanism is (epsilon, delta)-DP, from the analytic
    Gaussian mechanism (Balle & Wang, ICML 2018, Theorem 8): the mechanism is
    (epsilon, delta)-DP iff
    ``Phi(D/(2s) - e s/D) - exp(e) Phi(-D/(2s) - e s/D) <= delta``
    (``D`` the L2 sensitivity).  It is solved by root finding.  The classic
    bound ``sigma = sqrt(2 ln(1.25/delta)) D / epsilon`` (Dwork & Roth 2014,
    Thm 3.22, valid for epsilon < 1) is available as ``method="classic"``;
    the analytic sigma is never larger.  Half-width of the interval of level
    ``q``: ``sigma * Phi^{-1}((1 + q)/2)`` (exact).
    OpenDP's ``make_gaussian`` is accounted in zero-concentrated DP; its rho is
    ``D^2 / (2 sigma^2)`` (Bun & Steinke 2016, Prop. 1.6) and
    :func:`gaussian_rho` reports it.  We do NOT convert rho back to (epsilon,
    delta) with the generic zCDP bound (which is looser); the (epsilon, delta)
    guarantee comes from the analytic Gaussian mechanism directly.

Sampling
--------
``seed=None`` draws from OpenDP's samplers (cryptographically seeded,
no floating-point side channel; they take no seed by design).  An integer seed
or a ``numpy.random.Generator`` draws from numpy for reproducible simulations:
the draw is then NOT a private release, and the returned ``noise_source`` is
``"seeded-simulation"`` so callers record it.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Literal

import numpy as np
from scipy import optimize, special, stats

__all__ = [
    "Mechanism",
    "NoiseSource",
    "PrivacyParameterError",
    "analytic_gaussian_sigma",
    "classic_gaussian_sigma",
    "error_bar",
    "gaussian_delta",
    "gaussian_rho",
    "interval_quantile",
    "noise_scale",
    "sample",
]


class Mechanism(StrEnum):
    """Noise mechanisms; values match the OpenMed envelope's mechanism names."""

    LAPLACE = "laplace"
    GAUSSIAN = "gaussian"
    #: noise shares added on the devices (:mod:`clma.privacy.distributed`); the server
    #: adds none, so :func:`noise_scale` and :func:`sample` refuse it.
    DISTRIBUTED_DISCRETE_GAUSSIAN = "distributed_discrete_gaussian"


class NoiseSource(StrEnum):
    """Where a noise draw came from (recorded with every release)."""

    OPENDP = "opendp"
    SEEDED_SIMULATION = "seeded-simulation"


class PrivacyParameterError(ValueError):
    """A privacy parameter (epsilon, delta, sensitivity, level, scale) is invalid."""


def _check_positive(name: str, value: float) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise PrivacyParameterError(f"{name} must be a real number") from None
    if not math.isfinite(v) or v <= 0.0:
        raise PrivacyParameterError(f"{name} must be finite and > 0")
    return v


def _check_delta(delta: float | None) -> float:
    if delta is None:
        raise PrivacyParameterError("delta is required for the gaussian mechanism")
    d = _check_positive("delta", delta)
    if d >= 1.0:
        raise PrivacyParameterError("delta must be in (0, 1)")
    return d


def _check_level(level: float) -> float:
    q = float(level)
    if not (0.0 < q < 1.0):
        raise PrivacyParameterError("level must be in (0, 1)")
    return q


def gaussian_delta(sigma: float, sensitivity: float, epsilon: float) -> float:
    """Exact delta of the Gaussian mechanism at ``epsilon``.

    Balle & Wang (ICML 2018), Theorem 8: ``delta(eps) = Phi(D/(2s) - eps s/D)
    - exp(eps) Phi(-D/(2s) - eps s/D)``, evaluated in log space.
    """
    s = _check_positive("sigma", sigma)
    d = _check_positive("sensitivity", sensitivity)
    e = float(epsilon)
    a = d / (2.0 * s)
    c = e * s / d
    first = special.ndtr(a - c)
    second = math.exp(e + special.log_ndtr(-a - c))
    return float(max(first - second, 0.0))


def analytic_gaussian_sigma(sensitivity: float, epsilon: float, delta: float) -> float:
    """Smallest sigma making the Gaussian mechanism (epsilon, delta)-DP.

    Analytic Gaussian mechanism, Balle & Wang (ICML 2018), Theorem 8 / Alg. 1,
    solved by Brent's method on ``gaussian_delta(sigma) - delta`` (decreasing
    in sigma).  Units: same as ``sensitivity`` (L2 sensitivity of the sum).

    Raises:
        PrivacyParameterError: non-positive or non-finite inputs, delta >= 1.
    """
    d = _check_positive("sensitivity", sensitivity)
    e = _check_positive("epsilon", epsilon)
    dl = _check_delta(delta)

    def f(log_s: float) -> float:
        return gaussian_delta(math.exp(log_s), d, e) - dl

    lo, hi = math.log(d) - 10.0, math.log(d) + 10.0
    while f(lo) < 0.0:
        lo -= 10.0
    while f(hi) > 0.0:
        hi += 10.0
    root = optimize.brentq(f, lo, hi, xtol=1e-14, rtol=1e-13, maxiter=500)
    sigma = math.exp(root)
    # Brent's root may sit a hair on the non-private side: step up until valid.
    while gaussian_delta(sigma, d, e) > dl:
        sigma *= 1.0 + 1e-12
    return sigma


def classic_gaussian_sigma(sensitivity: float, epsilon: float, delta: float) -> float:
    """Classic ``sigma = sqrt(2 ln(1.25/delta)) * D / epsilon``.

    Dwork & Roth (2014), Theorem 3.22; only proven for epsilon < 1.
    """
    d = _check_positive("sensitivity", sensitivity)
    e = _check_positive("epsilon", epsilon)
    dl = _check_delta(delta)
    if e >= 1.0:
        raise PrivacyParameterError("epsilon must be < 1 for the classic Gaussian bound")
    return math.sqrt(2.0 * math.log(1.25 / dl)) * d / e


def gaussian_rho(sensitivity: float, sigma: float) -> float:
    """zCDP parameter ``rho = D^2 / (2 sigma^2)`` of the Gaussian mechanism.

    Bun & Steinke (TCC 2016), Prop. 1.6; this is what OpenDP's
    ``make_gaussian(...).map(D)`` returns.
    """
    d = _check_positive("sensitivity", sensitivity)
    s = _check_positive("sigma", sigma)
    return d * d / (2.0 * s * s)


def noise_scale(
    sensitivity: float,
    epsilon: float,
    *,
    mechanism: Mechanism | str = Mechanism.LAPLACE,
    delta: float | None = None,
    gaussian_method: Literal["analytic", "classic"] = "analytic",
) -> float:
    """Noise scale for one release of a sum.

    Args:
        sensitivity: L1 (Laplace) or L2 (Gaussian) sensitivity of the released
            sum, in the metric's units.  For a scalar sum the two coincide.
        epsilon: privacy parameter of this release, > 0.
        mechanism: ``"laplace"`` (``b = sensitivity / epsilon``) or
            ``"gaussian"`` (sigma from ``gaussian_method``).
        delta: required for the Gaussian mechanism, in (0, 1).
        gaussian_method: ``"analytic"`` (Balle & Wang 2018, default) or
            ``"classic"`` (Dwork & Roth 2014 Thm 3.22).

    Returns:
        Laplace scale ``b`` or Gaussian standard deviation ``sigma`` (float).

    Raises:
        PrivacyParameterError: invalid parameters.
    """
    mech = _mechanism(mechanism)
    if mech is Mechanism.DISTRIBUTED_DISCRETE_GAUSSIAN:
        raise PrivacyParameterError("mechanism: distributed noise is sized on the devices "
                                    "(clma.privacy.distributed.calibrate_sigma)")
    if mech is Mechanism.LAPLACE:
        return _check_positive("sensitivity", sensitivity) / _check_positive("epsilon", epsilon)
    if gaussian_method == "analytic":
        return analytic_gaussian_sigma(sensitivity, epsilon, delta)  # type: ignore[arg-type]
    if gaussian_method == "classic":
        return classic_gaussian_sigma(sensitivity, epsilon, delta)  # type: ignore[arg-type]
    raise PrivacyParameterError("gaussian_method must be 'analytic' or 'classic'")


def interval_quantile(mechanism: Mechanism | str = Mechanism.LAPLACE, level: float = 0.95) -> float:
    """Half-width of the level-``level`` interval for noise of unit scale.

    Laplace: ``ln(1 / (1 - level))`` (``ln 20 = 2.9957`` at 95 %).
    Gaussian: ``Phi^{-1}((1 + level) / 2)`` (``1.95996`` at 95 %).
    """
    q = _check_level(level)
    mech = _mechanism(mechanism)
    if mech is Mechanism.LAPLACE:
        return math.log(1.0 / (1.0 - q))
    if mech is Mechanism.DISTRIBUTED_DISCRETE_GAUSSIAN:
        raise PrivacyParameterError("mechanism: the distributed bar depends on n "
                                    "(clma.privacy.distributed.sum_noise_quantile)")
    return float(stats.norm.ppf(0.5 * (1.0 + q)))


def error_bar(
    scale: float,
    *,
    mechanism: Mechanism | str = Mechanism.LAPLACE,
    level: float = 0.95,
    n: float = 1.0,
) -> float:
    """Half-width of the exact-coverage interval on ``noisy_sum / n``.

    ``scale * interval_quantile(mechanism, level) / n``: it depends only on
    quantities fixed before the round (scale, level, n), and shrinks as 1/n.
    """
    s = _check_positive("scale", scale)
    m = _check_positive("n", n)
    return s * interval_quantile(mechanism, level) / m


def _mechanism(mechanism: Mechanism | str) -> Mechanism:
    try:
        return Mechanism(mechanism)
    except ValueError:
        raise PrivacyParameterError("mechanism must be 'laplace', 'gaussian' or "
                                    "'distributed_discrete_gaussian'") from None


def _opendp():
    import opendp.prelude as dp

    dp.enable_features("contrib")
    return dp


def sample(
    value: float | np.ndarray,
    scale: float,
    *,
    mechanism: Mechanism | str = Mechanism.LAPLACE,
    seed: int | np.random.Generator | None = None,
) -> tuple[float | np.ndarray, NoiseSource]:
    """Add one draw of noise per coordinate to an aggregate.

    Args:
        value: the aggregate (a float, or a float array of shape ``(d,)``).
        scale: Laplace ``b`` or Gaussian ``sigma`` (see :func:`noise_scale`).
        mechanism: ``"laplace"`` or ``"gaussian"``.
        seed: ``None`` -> OpenDP sampler (``make_laplace`` / ``make_gaussian``
            on a float atom or vector domain); an int or Generator -> numpy,
            reproducible, flagged ``seeded-simulation``.

    Returns:
        ``(noisy_value, noise_source)``; ``noisy_value`` has the input's shape
        (float for a scalar, float64 array otherwise).

    Raises:
        PrivacyParameterError: invalid scale or mechanism; ValueError for a
        non-finite aggregate.
    """
    s = _check_positive("scale", scale)
    mech = _mechanism(mechanism)
    if mech is Mechanism.DISTRIBUTED_DISCRETE_GAUSSIAN:
        raise PrivacyParameterError("mechanism: the server draws no distributed noise")
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim > 1:
        raise ValueError("value must be a scalar or a 1-D vector")
    if not np.all(np.isfinite(arr)):
        raise ValueError("value (the aggregate) must be finite")
    if seed is None:
        dp = _opendp()
        if arr.ndim == 0:
            domain, metric = dp.atom_domain(T=float, nan=False), dp.absolute_distance(T=float)
            payload: float | list[float] = float(arr)
        else:
            domain = dp.vector_domain(dp.atom_domain(T=float, nan=False))
            metric = dp.l1_distance(T=float) if mech is Mechanism.LAPLACE else dp.l2_distance(T=float)
            payload = arr.tolist()
        if mech is Mechanism.LAPLACE:
            meas = dp.m.make_laplace(domain, metric, scale=s)
        else:
            meas = dp.m.make_gaussian(domain, metric, scale=s)
        out = meas(payload)
        noisy = float(out) if arr.ndim == 0 else np.asarray(out, dtype=np.float64)
        return noisy, NoiseSource.OPENDP
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    if mech is Mechanism.LAPLACE:
        noise = rng.laplace(0.0, s, size=arr.shape)
    else:
        noise = rng.normal(0.0, s, size=arr.shape)
    noisy_arr = arr + noise
    noisy = float(noisy_arr) if arr.ndim == 0 else noisy_arr
    return noisy, NoiseSource.SEEDED_SIMULATION

