"""Sequential composition of DP releases with dp-accounting (PLD, cross-checked by RDP).

A :class:`MechanismEvent` describes one noisy release *as seen by one client*:

- ``laplace``: pure epsilon-DP, ``epsilon = sensitivity / scale`` (L1 sensitivity under
  the neighbouring relation the release states);
- ``gaussian``: ``noise_multiplier = sigma / sensitivity`` (L2), optionally Poisson
  subsampled with ``sampling_probability`` (DP-FedAvg, McMahan et al., ICLR 2018).

:func:`compose` composes a list of events sequentially:

- only unsubsampled Laplace events (a *pure-epsilon line*): the exact running sum of the
  epsilons (``math.fsum``, correctly rounded), delta 0. dp-accounting's PLD reports
  ``inf`` at delta = 0, so it cannot account these lines.
- anything else: dp-accounting's ``PLDAccountant`` (privacy loss distributions, Koskela
  et al. 2020, Doroshenko et al. 2022; pessimistic estimate, so an upper bound) at the
  line's delta, cross-checked against ``RdpAccountant`` (Mironov 2017): the PLD epsilon
  must not exceed the RDP epsilon by more than the policy's relative tolerance, since both
  bound the same composition and PLD is the tighter one.

Neighbouring relation: dp-accounting's default ``ADD_OR_REMOVE_ONE``; for unsubsampled
events the noise multiplier must be computed from the sensitivity under the relation the
release uses, and the result holds for that relation.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable
from typing import Annotated, Literal

import dp_accounting
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["AccountingError", "CompositionResult", "MechanismEvent", "compose"]


class AccountingError(ValueError):
    """A composition could not be computed or failed its RDP cross-check."""


class MechanismEvent(BaseModel):
    """One noisy release, per client. Build with :meth:`laplace` or :meth:`gaussian`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    mechanism: Literal["laplace", "gaussian"]
    epsilon: Annotated[float, Field(gt=0.0, le=1e6)] | None = None
    noise_multiplier: Annotated[float, Field(gt=0.0, le=1e6)] | None = None
    sampling_probability: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0

    @model_validator(mode="after")
    def _parameters_match(self) -> MechanismEvent:
        if self.mechanism == "laplace":
            if self.epsilon is None or self.noise_multiplier is not None:
                raise ValueError("a laplace event takes epsilon and no noise_multiplier")
            if self.sampling_probability != 1.0:
                raise ValueError("a laplace event is not subsampled (sampling_probability = 1)")
        elif self.noise_multiplier is None or self.epsilon is not None:
            raise ValueError("a gaussian event takes noise_multiplier and no epsilon")
        return self

    @classmethod
    def laplace(cls, epsilon: float) -> MechanismEvent:
        """Laplace release with ``epsilon = sensitivity / scale`` (pure DP)."""
        return cls(mechanism="laplace", epsilon=float(epsilon))

    @classmethod
    def gaussian(cls, noise_multiplier: float, sampling_probability: float = 1.0) -> MechanismEvent:
        """Gaussian release, ``noise_multiplier = sigma / L2 sensitivity``, optionally
        Poisson-subsampled with ``sampling_probability``."""
        return cls(
            mechanism="gaussian",
            noise_multiplier=float(noise_multiplier),
            sampling_probability=float(sampling_probability),
        )

    @property
    def is_pure(self) -> bool:
        return self.mechanism == "laplace"

    def to_dp_event(self) -> dp_accounting.DpEvent:
        """The equivalent dp-accounting event."""
        if self.mechanism == "laplace":
            assert self.epsilon is not None
            return dp_accounting.LaplaceDpEvent(1.0 / self.epsilon)
        event: dp_accounting.DpEvent = dp_accounting.GaussianDpEvent(self.noise_multiplier)
        if self.sampling_probability < 1.0:
            event = dp_accounting.PoissonSampledDpEvent(self.sampling_probability, event)
        return event


class CompositionResult(BaseModel):
    """Composed (epsilon, delta) of a sequence of events.

    ``method`` is ``exact_sum`` (pure-epsilon line, ``delta`` 0), ``pld`` or ``none``
    (no events). ``epsilon_rdp`` is the RDP cross-check (``None`` for exact sums).
    """

    model_config = ConfigDict(frozen=True)

    epsilon: float
    delta: float
    method: Literal["exact_sum", "pld", "none"]
    epsilon_rdp: float | None = None


def compose(
    events: Iterable[MechanismEvent],
    delta: float,
    *,
    value_discretization_interval: float = 1e-3,
    rdp_tolerance: float = 0.01,
) -> CompositionResult:
    """Sequentially compose ``events`` for one client.

    Args:
        events: the releases; order does not matter (composition is commutative).
        delta: target delta for lines with Gaussian events (ignored for pure lines).
        value_discretization_interval: PLD discretisation (smaller: tighter, slower).
        rdp_tolerance: allowed relative excess of the PLD epsilon over the RDP epsilon.

    Returns:
        :class:`CompositionResult`.

    Raises:
        AccountingError: a Gaussian event with ``delta <= 0`` (unbounded epsilon), a
            non-finite result, or a failed RDP cross-check.
    """
    events = list(events)
    if not events:
        return CompositionResult(epsilon=0.0, delta=0.0, method="none")
    if all(ev.is_pure for ev in events):
        # Exact running sum: fsum returns the correctly rounded sum of the epsilons.
        total = math.fsum(ev.epsilon for ev in events)  # type: ignore[misc]
        return CompositionResult(epsilon=total, delta=0.0, method="exact_sum")
    counts = Counter(events)
    if not (0.0 < delta < 1.0):
        raise AccountingError("delta: a line with Gaussian events needs 0 < delta < 1")
    key = tuple(sorted(((ev.model_dump_json(), n) for ev, n in counts.items())))
    eps_pld, eps_rdp = _compose_cached(key, float(delta), float(value_discretization_interval))
    if not math.isfinite(eps_pld):
        raise AccountingError("composition: the PLD epsilon is not finite")
    if eps_pld > eps_rdp * (1.0 + rdp_tolerance) + 1e-9:
        raise AccountingError("composition: the PLD epsilon exceeds the RDP cross-check")
    return CompositionResult(epsilon=eps_pld, delta=float(delta), method="pld", epsilon_rdp=eps_rdp)


@functools.lru_cache(maxsize=512)
def _compose_cached(
    key: tuple[tuple[str, int], ...], delta: float, vdi: float
) -> tuple[float, float]:
    pld = PLDAccountant(value_discretization_interval=vdi)
    rdp = RdpAccountant()
    for payload, n in key:
        event = MechanismEvent.model_validate_json(payload).to_dp_event()
        pld.compose(event, n)
        rdp.compose(event, n)
    return float(pld.get_epsilon(delta)), float(rdp.get_epsilon(delta))
