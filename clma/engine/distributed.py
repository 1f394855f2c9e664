"""Distributed-DP parameters of one aggregation group (``evaluation.noise = "distributed"``).

The mechanism and its accounting are :mod:`clma.privacy.distributed`'s; this module fixes,
per group of ``N`` selected clients, who the shares are sized for and the ring:

* survivors: clients refuse to unmask a sum over fewer than ``s(N) = N - ceil(delta N)``
  survivors (``min_survivors``; delta the dropout fraction, capped as the engine caps it
  so that ``s(N) >= m``): up to the tolerated dropouts the guarantee holds, beyond them
  the group is not evaluated;
* honest contributors: up to ``ceil(gamma N)`` clients may collude with the server and
  tell it their shares, so at least ``h(N) = s(N) - ceil(gamma N)`` shares in any unmasked
  sum are unknown to it;
* what the shares are sized for: ``h_pub = min h(N')`` over ``N'`` in ``[max(B, m), 2B)``,
  ``B`` the power of two at or below ``N`` (no group below the floor m is summed): the per-client sigma (which the published error bar
  reveals) depends on the group's size only through that power-of-two bracket, as the
  DP-FedAvg noise level does (:func:`clma.engine.budget.coarse_size`), never on the exact
  count, and ``h_pub <= h(N)``;
* sigma: the smallest for which the sum over ``h_pub`` honest shares is rho-zCDP for the
  charged ``rho = rho_for_epsilon(evaluation.epsilon, evaluation.delta)``, per released
  coordinate (accuracy, mean loss: replace-one sensitivity Q each);
* ring: the smallest ``k >= 32`` for which the noisy sum of the N members wraps with
  probability at most ``2^-secagg_statistical_security``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from clma.privacy.distributed import (
    DistributedNoise,
    calibrate_sigma,
    rho_for_epsilon,
    ring_bits,
    wrap_probability,
)
from clma.privacy.secagg import _count

__all__ = ["NOISED_METRICS", "GroupNoise", "group_noise", "survivors_required"]

#: The report coordinates noised and summed in distributed mode (all others are sent as 0).
NOISED_METRICS = ("accuracy", "mean_loss")


@dataclass(frozen=True)
class GroupNoise:
    """Distributed-noise parameters of one group (server side; ``sigma`` is public).

    ``sigma``: per-client discrete Gaussian parameter (quantisation units); ``rho``: the
    charge per released coordinate; ``honest_floor``: ``h_pub``; ``min_survivors``:
    ``s(N)``; ``dropout_fraction``: delta after the cap; ``modulus_bits``: k;
    ``wrap_probability``: the ring's wrap bound for this group.
    """

    sigma: float
    rho: float
    honest_floor: int
    min_survivors: int
    dropout_fraction: float
    modulus_bits: int
    wrap_probability: float
    coordinates: tuple[int, ...]

    def share(self) -> DistributedNoise:
        return DistributedNoise(sigma=self.sigma, coordinates=self.coordinates)


def capped_dropout(n: int, dropout_fraction: float, floor: int) -> float:
    """The engine's dropout fraction for a group of n: at most what keeps ``floor``
    survivors (``ceil(delta n) <= n - floor``)."""
    if n - _count(dropout_fraction, n) < floor:
        return max(0.0, (n - floor) / n * (1.0 - 1e-9))
    return dropout_fraction


def survivors_required(n: int, dropout_fraction: float, floor: int) -> int:
    """``s(n) = n - ceil(delta n)`` with the capped delta."""
    return n - _count(capped_dropout(n, dropout_fraction, floor), n)


def _honest(n: int, dropout_fraction: float, corrupted_fraction: float, floor: int) -> int:
    return survivors_required(n, dropout_fraction, floor) - _count(corrupted_fraction, n)


@functools.lru_cache(maxsize=256)
def _honest_floor(n: int, dropout_fraction: float, corrupted_fraction: float, floor: int) -> int:
    b = 1 << (int(n).bit_length() - 1)
    return min(_honest(k, dropout_fraction, corrupted_fraction, floor)
               for k in range(max(b, floor, 2), max(2 * b, floor + 1)))


@functools.lru_cache(maxsize=256)
def _sigma(epsilon: float, delta: float, honest: int, levels: int) -> tuple[float, float]:
    return calibrate_sigma(epsilon, delta, honest, float(levels)), rho_for_epsilon(epsilon, delta)


def group_noise(n: int, *, epsilon: float, delta: float, dropout_fraction: float,
                corrupted_fraction: float, floor: int, levels: int, security: int,
                coordinates: tuple[int, ...]) -> GroupNoise | None:
    """The group's parameters (module docstring); None when fewer than one honest share
    can be guaranteed (the group then has no safe parameters and is not evaluated)."""
    if n < 2:
        return None
    honest = _honest_floor(int(n), float(dropout_fraction), float(corrupted_fraction),
                           int(floor))
    if honest < 1:
        return None
    sigma, rho = _sigma(float(epsilon), float(delta), honest, int(levels))
    d = len(coordinates)
    try:
        k = ring_bits(n, levels, sigma, d, security=security)
    except ValueError:  # no ring up to 2^62 holds it: no safe parameters
        return None
    return GroupNoise(sigma=sigma, rho=rho, honest_floor=honest,
                      min_survivors=survivors_required(n, dropout_fraction, floor),
                      dropout_fraction=capped_dropout(n, dropout_fraction, floor),
                      modulus_bits=k, wrap_probability=wrap_probability(n, levels, sigma, d, k),
                      coordinates=tuple(coordinates))

