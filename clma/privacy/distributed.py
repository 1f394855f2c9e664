"""Distributed DP for the device metric report: the distributed discrete Gaussian (DDG).

Each client adds integer noise ``N_Z(0, sigma^2)`` (the discrete Gaussian, Canonne,
Kamath & Steinke, NeurIPS 2020) to its clipped, quantised report *inside the modular
ring* before masking; secure aggregation then reveals only the noisy sum, and the server
publishes it without adding noise (Kairouz, Liu & Steinke, ICML 2021, "The Distributed
Discrete Gaussian Mechanism for Federated Learning with Secure Aggregation", here KLS21).

Why the discrete Gaussian and not Skellam: the Skellam mechanism (Agarwal, Kairouz & Liu,
NeurIPS 2021) is closed under summation, but needs a Poisson sampler; OpenDP 0.16 has
none (its integer samplers are the discrete Laplace and the discrete Gaussian, exact and
fed by its CSPRNG), and a hand-written or numpy Poisson sampler is not cryptographically
sound. So the device draws from OpenDP's ``make_gaussian`` over ``i64`` vectors
(:func:`sample_noise`) and the sum, which is *not* a discrete Gaussian, is accounted with
KLS21's bound for sums of discrete Gaussians.

Accounting (KLS21 Proposition 14, the Renyi-DP form of its Theorem 1). ``n`` clients each
add ``N_Z(0, sigma^2)`` independently to every one of ``d`` coordinates, ``sigma >= 1/2``;
for inputs differing by ``Delta`` (L2 norm ``D2``, L1 norm ``D1``), with
``a = D2 / (sqrt(n) sigma)``, ``b = D1 / (sqrt(n) sigma)`` and
``tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1))``, the Renyi divergence of
order ``alpha > 1`` is at most::

    min( alpha a^2 / 2 + tau d,
         alpha (a^2 + 2 b tau + tau^2 d) / 2,
         alpha (a + sqrt(d) tau)^2 / 2 )

Each term is a ``(xi, rho)``-zCDP curve ``xi + rho alpha``: dp-accounting's
``ZCDpEvent(rho, xi)``, which its ``RdpAccountant`` composes and converts to
(epsilon, delta) (:func:`ddg_event` picks the term with the smallest epsilon at the
target delta). The ledger charges every distributed release the same, known in advance,
``ZCDpEvent(rho)`` with ``rho`` the largest that dp-accounting converts to at most the
release's epsilon at its delta (:func:`rho_for_epsilon`), and each group's share is sized
so that the pure-rho term is at most that rho for its honest contributors
(:func:`sigma_for_rho`). ``tests/clma/test_distributed.py`` checks the bound against the
Renyi divergence computed numerically from the exact distribution of the sum (a
convolution of discrete Gaussian pmfs).

Who counts in ``n``: the noise the server does not know. Clients refuse to unmask a sum
over fewer than the survivor floor ``s = max(t, m)`` (:attr:`clma.privacy.secagg.SecAggConfig.survivor_floor`),
and up to ``c = ceil(gamma N)`` of a group's clients may collude with the server (and
tell it their noise), so every share is sized for ``n_h = s - c`` honest contributors:
the guarantee holds whenever the sum is unmasked at all, whatever the dropouts. More
survivors only add noise.

Ring (no wrap-around). The device sends ``(q + z) mod 2^k`` with ``q`` in ``[0, Q]``; the
server decodes the sum ``S`` of the ``N`` members' words around the centre
``c0 = floor(N Q / 2)``: ``v = ((S - c0 + 2^(k-1)) mod 2^k) - 2^(k-1) + c0`` (:func:`decode_sum`),
exact iff ``|noise| < 2^(k-1) - ceil(N Q / 2)``. The discrete Gaussian is
``sigma^2``-subgaussian (CKS20, the tail bounds of their Section 2), so the sum of at most ``N`` shares is
``N sigma^2``-subgaussian and, over ``d`` coordinates,
``P[wrap] <= 2 d exp(-(2^(k-1) - ceil(N Q / 2))^2 / (2 N sigma^2))`` (:func:`wrap_probability`).
:func:`ring_bits` picks the smallest ``k`` for which this is at most ``2^-security``; the
bound is added to the release's delta. Modular clipping: values are clipped to the layout
on the device before quantisation, noise is added after it (an input word can be any
ring element), and a decoded sum outside ``[0, n Q]`` is kept as is (it is noise); the
published mean is clamped to the clip range (post-processing).

Error bar (exact for the realised mechanism): the noise on a sum over ``n`` contributors
is the sum of ``n`` independent ``N_Z(0, sigma^2)``; its ``level`` quantile is computed
from its exact pmf (:func:`sum_noise_quantile`). Published bars use ``n`` = the
participant band's lower edge, never the exact count.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "MECHANISM",
    "MECHANISM_VERSION",
    "DistributedNoise",
    "calibrate_sigma",
    "ddg_epsilon",
    "ddg_event",
    "ddg_rdp",
    "ddg_tau",
    "decode_sum",
    "dg_variance",
    "noisy_words",
    "rho_for_epsilon",
    "ring_bits",
    "sample_noise",
    "sigma_for_rho",
    "sum_noise_quantile",
    "wrap_probability",
]

MECHANISM = "distributed_discrete_gaussian"
#: Version of this mechanism (KLS21 Prop. 14 accounting, OpenDP i64 discrete Gaussian
#: sampler, centred ring decoding); the policy's ``[mechanisms]`` table must carry it.
MECHANISM_VERSION = "v1"
#: Renyi orders of the accountant (dp-accounting's default grid is used by RdpAccountant).
_MIN_SIGMA = 0.5


class DistributedNoise(BaseModel):
    """What every client of one secure-aggregation session adds (sent in its config).

    Attributes:
        sigma: per-client discrete Gaussian parameter, in quantisation units (>= 0.5).
        coordinates: indices of the report coordinates that are noised and summed; every
            other coordinate is sent as 0 (the server learns nothing of it).
        mechanism, version: :data:`MECHANISM`, :data:`MECHANISM_VERSION`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    sigma: float = Field(ge=_MIN_SIGMA, le=1e12, allow_inf_nan=False)
    coordinates: tuple[int, ...] = Field(min_length=1)
    mechanism: str = MECHANISM
    version: str = MECHANISM_VERSION


# ----------------------------------------------------------------------------- sampler


def sample_noise(sigma: float, size: int) -> np.ndarray:
    """``size`` independent draws of ``N_Z(0, sigma^2)``: int64 ``(size,)``.

    OpenDP's ``make_gaussian`` over ``vector_domain(atom_domain(T="i64"))`` (exact
    sampling of CKS20, Algorithm 3, from OpenDP's CSPRNG; no seed by design).

    Raises:
        ValueError: ``sigma`` below 0.5 or not finite, or ``size`` < 1.
    """
    if not (math.isfinite(sigma) and sigma >= _MIN_SIGMA):
        raise ValueError("sigma: must be finite and >= 0.5")
    if size < 1:
        raise ValueError("size: must be >= 1")
    import opendp.prelude as dp

    dp.enable_features("contrib")
    meas = dp.m.make_gaussian(dp.vector_domain(dp.atom_domain(T="i64")),
                              dp.l2_distance(T="i64"), scale=float(sigma))
    return np.asarray(meas([0] * int(size)), dtype=np.int64)


def noisy_words(quantised: Any, noise: DistributedNoise, modulus_bits: int) -> np.ndarray:
    """The device's ring input: ``(q + z) mod 2^k`` on ``noise.coordinates``, 0 elsewhere.

    Args:
        quantised: uint64 ``(d,)`` report in ``[0, Q]``.
        noise: the session's noise share.
        modulus_bits: k.

    Returns:
        uint64 ``(d,)`` words in ``[0, 2^k)``.
    """
    q = np.asarray(quantised, dtype=np.uint64)
    idx = np.asarray(noise.coordinates, dtype=np.int64)
    if idx.min() < 0 or idx.max() >= q.size:
        raise ValueError("noise.coordinates: an index is outside the report")
    out = np.zeros(q.size, dtype=np.int64)
    out[idx] = q[idx].astype(np.int64) + sample_noise(noise.sigma, idx.size)
    mod = 1 << int(modulus_bits)
    return np.asarray([int(v) % mod for v in out], dtype=np.uint64)


def decode_sum(words: Any, modulus_bits: int, members: int, levels: int) -> np.ndarray:
    """Signed sum from the modular sum of ``members`` noisy words (module docstring).

    Returns int64 ``(d,)``: exact whenever the noise is below the ring's margin.
    """
    mod = 1 << int(modulus_bits)
    half = mod >> 1
    c0 = (int(members) * int(levels)) // 2
    return np.asarray([((int(s) - c0 + half) % mod) - half + c0
                       for s in np.asarray(words, dtype=np.uint64)], dtype=np.int64)


def wrap_probability(members: int, levels: int, sigma: float, dim: int,
                     modulus_bits: int) -> float:
    """Upper bound on P[some coordinate of the decoded sum wraps] (module docstring)."""
    margin = 2.0 ** (int(modulus_bits) - 1) - math.ceil(members * levels / 2)
    if margin <= 0:
        return 1.0
    return min(1.0, 2.0 * dim * math.exp(-margin * margin / (2.0 * members * sigma * sigma)))


def ring_bits(members: int, levels: int, sigma: float, dim: int, *, security: int = 40,
              minimum: int = 32) -> int:
    """Smallest ring size k in ``[minimum, 62]`` with wrap probability <= 2^-security.

    Raises:
        ValueError: no k up to 62 suffices (noise or group far too large).
    """
    for k in range(int(minimum), 63):
        if members * levels < 2**k and (
                wrap_probability(members, levels, sigma, dim, k) <= 2.0 ** -security):
            return k
    raise ValueError("ring: no modulus up to 2^62 keeps the noisy sum from wrapping with "
                     f"probability <= 2^-{security}")


# ----------------------------------------------------------------------------- distribution


def _dg_pmf(sigma: float) -> tuple[np.ndarray, np.ndarray]:
    r = int(math.ceil(sigma * 40.0)) + 2
    x = np.arange(-r, r + 1)
    w = np.exp(-(x.astype(np.float64) ** 2) / (2.0 * sigma * sigma))
    return x, w / w.sum()


def dg_variance(sigma: float) -> float:
    """Exact variance of ``N_Z(0, sigma^2)``.

    Direct summation below sigma = 50; above, the Poisson-summation identity
    ``Var = sigma^2 (1 - 4 pi^2 sigma^2 S2 / S0)``, ``S_j = sum_k k^j exp(-2 pi^2
    sigma^2 k^2)`` over all integers k (CKS20, Section 2.3), whose correction is below
    double precision there: the variance is ``sigma^2``.
    """
    if sigma < 50.0:
        x, p = _dg_pmf(sigma)
        return float(np.sum(p * x.astype(np.float64) ** 2))
    k = np.arange(1, 4)
    e = np.exp(-2.0 * math.pi**2 * sigma**2 * k**2)
    return float(sigma**2 * (1.0 - 4.0 * math.pi**2 * sigma**2 * 2 * np.sum(k**2 * e)
                             / (1.0 + 2 * np.sum(e))))


def sum_noise_quantile(sigma: float, n: int, level: float = 0.95) -> float:
    """Smallest integer b with ``P[|Z_1 + ... + Z_n| <= b] >= level``,
    ``Z_i ~ N_Z(0, sigma^2)`` independent (the exact two-sided interval of the noise on a
    sum over n contributors, in quantisation units).

    Exact pmf: by convolution below sigma = 4. From sigma = 4 on, the pmf of
    ``N_Z(0, s^2)``, ``s = sigma sqrt(n)``, is used: by Poisson summation the characteristic
    function of ``N_Z(0, sigma^2)`` differs from ``exp(-sigma^2 t^2 / 2)`` on ``[-pi, pi]``
    by less than ``3 exp(-pi^2 sigma^2 / 2)``, so the n-fold sum's pmf differs from it
    pointwise by less than ``6 n exp(-8 pi^2)`` (< 1e-33 n) -- below double precision
    (``tests/clma/test_distributed.py`` compares both ways at sigma = 4). Its normaliser is
    ``sum_k exp(-k^2 / 2 s^2) = s sqrt(2 pi) (1 + 2 sum_{j>=1} exp(-2 pi^2 s^2 j^2))``
    (Poisson summation), ``s sqrt(2 pi)`` in double precision for s >= 4, so only the
    terms up to b are summed: O(s) time and O(min(s, 2^20)) memory (a 95 % bar sums about
    2 s terms, where the whole pmf on +-40 s has 80 s).
    """
    if not 0.0 < level < 1.0:
        raise ValueError("level: must be in (0, 1)")
    if n < 1:
        raise ValueError("n: must be >= 1")
    if sigma >= 4.0:
        return float(_dg_quantile(sigma * math.sqrt(n), level))
    _, p = _dg_pmf(sigma)
    pmf = p
    for _ in range(int(n) - 1):
        pmf = np.convolve(pmf, p)
    r = len(pmf) // 2  # symmetric support -r..r
    absolute = pmf[r:].copy()
    absolute[1:] += pmf[:r][::-1]
    return float(np.searchsorted(np.cumsum(absolute), level))


def _dg_quantile(s: float, level: float, chunk: int | None = None) -> int:
    """Smallest integer b with ``P[|X| <= b] >= level``, ``X ~ N_Z(0, s^2)``, s >= 4:
    ``(1 + 2 sum_{k=1}^b exp(-k^2 / 2 s^2)) / (s sqrt(2 pi)) >= level``, summed in chunks."""
    target = level * s * math.sqrt(2.0 * math.pi)  # the normaliser (docstring above)
    chunk = chunk or int(min(1 << 20, math.ceil(3.0 * s)))  # a 99.7 % bar in one chunk
    total, start = 1.0, 1  # k = 0
    if total >= target:
        return 0
    while True:
        k = np.arange(start, start + chunk, dtype=np.float64)
        partial = total + 2.0 * np.cumsum(np.exp(-(k * k) / (2.0 * s * s)))
        hit = int(np.searchsorted(partial, target))
        if hit < chunk:
            return start + hit
        total, start = float(partial[-1]), start + chunk


# ----------------------------------------------------------------------------- accounting


def ddg_tau(sigma: float, n: int) -> float:
    """``tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1))`` (KLS21 Theorem 1)."""
    k = np.arange(1, int(n), dtype=np.float64)
    return float(10.0 * np.sum(np.exp(-2.0 * math.pi**2 * sigma**2 * k / (k + 1.0))))


def _terms(sigma: float, n: int, l2: float, l1: float, dim: int) -> list[tuple[float, float]]:
    if not (math.isfinite(sigma) and sigma >= _MIN_SIGMA):
        raise ValueError("sigma: KLS21 Proposition 14 needs sigma >= 1/2")
    if n < 1:
        raise ValueError("n: at least one honest contributor is needed")
    a = l2 / (math.sqrt(n) * sigma)
    b = l1 / (math.sqrt(n) * sigma)
    tau = ddg_tau(sigma, n)
    return [(a * a / 2.0, tau * dim),                           # (rho, xi)
            ((a * a + 2.0 * b * tau + tau * tau * dim) / 2.0, 0.0),
            ((a + math.sqrt(dim) * tau) ** 2 / 2.0, 0.0)]


def ddg_rdp(order: float | Sequence[float], sigma: float, n: int, l2: float,
            l1: float | None = None, dim: int = 1) -> np.ndarray:
    """KLS21 Proposition 14 bound on the Renyi divergence of order(s) ``order`` (> 1) of the
    sum of ``n`` per-client ``N_Z(0, sigma^2)`` shares, sensitivities ``l2``/``l1``
    (quantisation units; ``l1`` defaults to ``sqrt(dim) l2``)."""
    a = np.atleast_1d(np.asarray(order, dtype=np.float64))
    terms = _terms(sigma, n, l2, math.sqrt(dim) * l2 if l1 is None else l1, dim)
    return np.min([xi + rho * a for rho, xi in terms], axis=0)


@functools.lru_cache(maxsize=4096)
def _epsilon_of(rho: float, xi: float, delta: float) -> float:
    """Epsilon at ``delta`` of ``ZCDpEvent(rho, xi)``: what dp-accounting's
    ``RdpAccountant.get_epsilon`` returns for that one event (its default orders, its
    ``compute_epsilon`` conversion; ``test_distributed.py`` checks they agree)."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    orders = np.asarray(rdp.DEFAULT_RDP_ORDERS, dtype=np.float64)
    return float(rdp.compute_epsilon(orders, xi + rho * orders, delta)[0])


def ddg_event(sigma: float, n: int, l2: float, delta: float, l1: float | None = None,
              dim: int = 1) -> tuple[float, float]:
    """``(rho, xi)`` of the Proposition 14 term with the smallest epsilon at ``delta``
    (each term alone is a valid ``(xi, rho)``-zCDP guarantee: dp-accounting's
    ``ZCDpEvent(rho, xi)``)."""
    terms = _terms(sigma, n, l2, math.sqrt(dim) * l2 if l1 is None else l1, dim)
    return min(terms, key=lambda t: _epsilon_of(t[0], t[1], delta))


def ddg_epsilon(sigma: float, n: int, l2: float, delta: float, l1: float | None = None,
                dim: int = 1) -> float:
    """Epsilon at ``delta`` of one DDG release, by dp-accounting's ``RdpAccountant``
    (replace-one; the event's RDP does not depend on the relation)."""
    rho, xi = ddg_event(sigma, n, l2, delta, l1, dim)
    return _epsilon_of(rho, xi, delta)


def rho_for_epsilon(epsilon: float, delta: float) -> float:
    """Largest rho (to 1e-6 relative) whose ``ZCDpEvent(rho)`` dp-accounting converts to at
    most ``epsilon`` at ``delta``: the charge of one distributed release.

    Raises:
        ValueError: epsilon or delta out of range.
    """
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError("epsilon: must be finite and > 0")
    if not 0.0 < delta < 1.0:
        raise ValueError("delta: must be in (0, 1)")
    lo, hi = 0.0, epsilon
    while _epsilon_of(hi, 0.0, delta) <= epsilon:
        lo, hi = hi, hi * 2.0
    while hi - lo > 1e-6 * hi:
        mid = 0.5 * (lo + hi)
        if _epsilon_of(mid, 0.0, delta) <= epsilon:
            lo = mid
        else:
            hi = mid
    return lo


def sigma_for_rho(rho: float, n: int, l2: float, l1: float | None = None,
                  dim: int = 1) -> float:
    """Smallest per-client sigma (to 0.1 % relative, rounded up) for which the pure-rho
    term of Proposition 14, ``(a + sqrt(d) tau)^2 / 2``, is at most ``rho``: the sum over
    any ``n`` honest contributors is then rho-zCDP, whatever the order.

    Raises:
        ValueError: ``rho <= 0`` or ``n < 1``.
    """
    if not (math.isfinite(rho) and rho > 0):
        raise ValueError("rho: must be finite and > 0")
    if n < 1:
        raise ValueError("n: at least one honest contributor is needed")
    l1v = math.sqrt(dim) * l2 if l1 is None else l1

    def term(sig: float) -> float:
        return _terms(sig, n, l2, l1v, dim)[2][0]

    if term(_MIN_SIGMA) <= rho:
        return _MIN_SIGMA
    hi = max(_MIN_SIGMA, l2 / math.sqrt(2.0 * rho * n))
    while term(hi) > rho:
        hi *= 2.0
    lo = max(_MIN_SIGMA, hi / 4.0)
    while lo > _MIN_SIGMA and term(lo) <= rho:
        lo, hi = max(_MIN_SIGMA, lo / 2.0), lo
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        if term(mid) <= rho:
            hi = mid
        else:
            lo = mid
    return hi


def calibrate_sigma(epsilon: float, delta: float, n: int, l2: float,
                    l1: float | None = None, dim: int = 1) -> float:
    """Per-client sigma whose sum over ``n`` honest contributors is
    ``rho_for_epsilon(epsilon, delta)``-zCDP (so (epsilon, delta)-DP by dp-accounting's
    conversion): :func:`sigma_for_rho` of :func:`rho_for_epsilon`.

    Raises:
        ValueError: epsilon or delta out of range, or ``n < 1``.
    """
    return sigma_for_rho(rho_for_epsilon(epsilon, delta), n, l2, l1, dim)
