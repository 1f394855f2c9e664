"""Sequential composition of DP releases with dp-accounting, under ONE declared adjacency.

Adjacency (:data:`ADJACENCY`): **replace-one client** (dp-accounting's
``NeighboringRelation.REPLACE_ONE``): two federations are neighbours when one client's data
is replaced by anything else; the number of clients is public. Every line of the ledger
(training and evaluation) is accounted under it, and every event states its parameter
against the *replace-one* sensitivity of what it releases:

- ``laplace``: ``epsilon = sensitivity / scale`` with the replace-one L1 sensitivity (for a
  clipped sum of a metric, ``clip_high - clip_low``: :attr:`clma.release.MetricSpec.sensitivity`);
- ``gaussian``: ``noise_multiplier = sigma / sensitivity`` with the replace-one L2
  sensitivity (for DP-FedAvg's sum of updates clipped to L2 norm ``C``: ``2 C``,
  :func:`clma.rounds.dp_fedavg`);
- ``gaussian`` sampled without replacement (:meth:`MechanismEvent.gaussian_sampled_without_replacement`):
  the same Gaussian on a uniformly random subset of exactly ``sample_size`` of the
  ``population_size`` clients (:func:`clma.rounds.select_clients`), i.e. dp-accounting's
  ``SampledWithoutReplacementDpEvent(population_size, sample_size,
  GaussianDpEvent(noise_multiplier))`` (Wang, Balle & Kasiviswanathan, AISTATS 2019,
  Theorem 27: a replace-one analysis).

:func:`compose` composes a list of events sequentially:

- only Laplace events (a *pure-epsilon line*): the exact running sum of the epsilons
  (``math.fsum``, correctly rounded), delta 0; under replace-one the Laplace event with
  ``epsilon = sensitivity / scale`` is the same pure-DP event, and dp-accounting's PLD
  reports ``inf`` at delta = 0, so it cannot account these lines. Method ``exact_sum``.
- a ``zcdp`` event (the distributed discrete Gaussian's charge, ``ZCDpEvent(rho)``: RDP
  ``rho * alpha``), which the PLD accountant does not take: the ``RdpAccountant`` below.
- any event sampled without replacement: dp-accounting's ``RdpAccountant`` under
  ``REPLACE_ONE`` (Mironov 2017; the only dp-accounting 0.6 accountant that supports
  ``SampledWithoutReplacementDpEvent``: its PLD accountant raises on it). Laplace and
  unsampled Gaussian events on the same line are composed in the same accountant (RDP
  of the Laplace and Gaussian mechanisms depends only on their ``epsilon`` /
  ``noise_multiplier``). Method ``rdp``; ``epsilon_rdp`` equals ``epsilon``.
- otherwise (unsampled Gaussian and Laplace): dp-accounting's ``PLDAccountant``
  (privacy loss distributions, Koskela et al. 2020, Doroshenko et al. 2022; pessimistic
  estimate, so an upper bound) at the line's delta, cross-checked against the
  ``RdpAccountant`` under ``REPLACE_ONE``: the PLD epsilon must not exceed the RDP
  epsilon by more than the policy's relative tolerance. Method ``pld``.

Conventions of dp-accounting 0.6 that this module relies on (each pinned by a test in
``tests/clma/test_accounting.py``, so that a change of the library fails loudly):

- the RDP accountant reads ``GaussianDpEvent(z)`` under ``REPLACE_ONE`` (with or without
  sampling without replacement) as ``sigma / (replace-one L2 sensitivity)``: its RDP at
  order ``a`` is ``a / (2 z^2)`` for ``sample_size == population_size``. (The docstring
  of ``GaussianDpEvent`` says ``sigma / C`` with ``C`` the per-record bound, whose
  replace-one sensitivity is ``2 C``; google/differential-privacy issue #378 reports the
  mismatch. Passing ``z = sigma / (2 C)`` is right for 0.6's implementation and, should
  the library adopt the docstring's reading, over-charges rather than under-charges.)
- the PLD accountant under ``REPLACE_ONE`` uses the docstring's reading (its privacy
  loss compares ``N(-C, sigma)`` with ``N(C, sigma)``) and refuses Laplace events. For an
  unsampled mechanism the privacy loss distribution depends only on
  ``sensitivity / sigma``, so the PLD path composes the events in a ``PLDAccountant``
  whose relation is ``ADD_OR_REMOVE_ONE``: it compares ``N(0, sigma)`` with
  ``N(Delta, sigma)`` for ``Delta`` the replace-one sensitivity the event states, which is
  exactly the replace-one pair. ``PLDAccountant(REPLACE_ONE)`` with ``GaussianDpEvent(2 z)``
  gives the same epsilon (tested).

Poisson-sampled events (``MechanismEvent(mechanism="gaussian", sampling_probability<1)``)
are what ledgers written before replace-one accounting charged for DP-FedAvg. They still
load (so those ledgers open and list their entries) but cannot be composed: Poisson
sampling is not how :func:`clma.rounds.select_clients` samples, dp-accounting's RDP
accountant supports it only under add-or-remove, and the recorded noise multiplier was
relative to the clipping bound; :func:`compose` raises :class:`AccountingError` on them,
and :class:`~clma.budget.PrivacyLedger` refuses to charge them.
"""

from __future__ import annotations

import functools
import math
import operator
from collections import Counter
from collections.abc import Iterable
from typing import Annotated, Any, Final, Literal

import dp_accounting
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "ADJACENCY",
    "ADJACENCY_NAME",
    "AccountingError",
    "CompositionResult",
    "MechanismEvent",
    "compose",
]

#: The one neighbouring relation of every line (training and evaluation).
ADJACENCY: Final = dp_accounting.NeighboringRelation.REPLACE_ONE
#: Its name as recorded in what the ledger reports.
ADJACENCY_NAME: Final[str] = "replace_one"

_MAX_CLIENTS = 1_000_000_000


class AccountingError(ValueError):
    """A composition could not be computed or failed its RDP cross-check."""


class MechanismEvent(BaseModel):
    """One noisy release, per client, parameterised against the replace-one sensitivity.

    Build with :meth:`laplace`, :meth:`gaussian` or
    :meth:`gaussian_sampled_without_replacement`. ``sampling_probability < 1`` (Poisson
    sampling) only loads from old ledgers (see the module docstring).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    mechanism: Literal["laplace", "gaussian", "zcdp"]
    epsilon: Annotated[float, Field(gt=0.0, le=1e6)] | None = None
    rho: Annotated[float, Field(gt=0.0, le=1e6)] | None = None
    noise_multiplier: Annotated[float, Field(gt=0.0, le=1e6)] | None = None
    sampling_probability: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    population_size: Annotated[int, Field(ge=1, le=_MAX_CLIENTS)] | None = None
    sample_size: Annotated[int, Field(ge=1, le=_MAX_CLIENTS)] | None = None

    @model_validator(mode="after")
    def _parameters_match(self) -> MechanismEvent:
        sampled = self.population_size is not None or self.sample_size is not None
        if self.mechanism == "zcdp":
            if (self.rho is None or self.epsilon is not None
                    or self.noise_multiplier is not None):
                raise ValueError("a zcdp event takes rho and no epsilon / noise_multiplier")
            if self.sampling_probability != 1.0 or sampled:
                raise ValueError("a zcdp event is not subsampled")
            return self
        if self.rho is not None:
            raise ValueError("rho: only a zcdp event takes rho")
        if self.mechanism == "laplace":
            if self.epsilon is None or self.noise_multiplier is not None:
                raise ValueError("a laplace event takes epsilon and no noise_multiplier")
            if self.sampling_probability != 1.0 or sampled:
                raise ValueError("a laplace event is not subsampled (sampling_probability = 1,"
                                 " no population_size / sample_size)")
            return self
        if self.noise_multiplier is None or self.epsilon is not None:
            raise ValueError("a gaussian event takes noise_multiplier and no epsilon")
        if sampled:
            if self.population_size is None or self.sample_size is None:
                raise ValueError("population_size and sample_size: give both or neither")
            if self.sample_size > self.population_size:
                raise ValueError("sample_size must be at most population_size")
            if self.sampling_probability != 1.0:
                raise ValueError("sampling_probability: an event sampled without replacement"
                                 " is not also Poisson-sampled")
        return self

    @classmethod
    def laplace(cls, epsilon: float) -> MechanismEvent:
        """Laplace release with ``epsilon = sensitivity / scale`` (pure DP; replace-one L1
        sensitivity)."""
        return cls(mechanism="laplace", epsilon=float(epsilon))

    @classmethod
    def zcdp(cls, rho: float) -> MechanismEvent:
        """A rho-zCDP release (RDP ``rho * alpha`` at every order alpha > 1, Bun & Steinke
        2016): the distributed discrete Gaussian's charge
        (:mod:`clma.privacy.distributed`); dp-accounting's ``ZCDpEvent(rho)``."""
        return cls(mechanism="zcdp", rho=float(rho))

    @classmethod
    def gaussian(cls, noise_multiplier: float, sampling_probability: float = 1.0) -> MechanismEvent:
        """Unsampled Gaussian release, ``noise_multiplier = sigma / (replace-one L2
        sensitivity)``.

        ``sampling_probability`` is kept for old callers and must be 1: Poisson sampling
        does not match how clients are selected; a DP-FedAvg round is
        :meth:`gaussian_sampled_without_replacement`.

        Raises:
            ValueError: ``sampling_probability != 1`` (names the replacement), or a bad
                ``noise_multiplier``.
        """
        if float(sampling_probability) != 1.0:
            raise ValueError(
                "sampling_probability: Poisson sampling is not how clients are selected"
                " (clma.rounds.select_clients draws a fixed-size sample without replacement);"
                " charge MechanismEvent.gaussian_sampled_without_replacement(noise_multiplier,"
                " population_size, sample_size)"
            )
        return cls(mechanism="gaussian", noise_multiplier=float(noise_multiplier))

    @classmethod
    def gaussian_sampled_without_replacement(
        cls, noise_multiplier: float, population_size: int, sample_size: int
    ) -> MechanismEvent:
        """The Gaussian mechanism on a uniformly random subset of exactly ``sample_size`` of
        ``population_size`` clients (one DP-FedAvg round).

        ``noise_multiplier = sigma / (replace-one L2 sensitivity)``; for DP-FedAvg the
        sensitivity of the sum of updates clipped to ``C`` is ``2 C``, so
        ``sigma = noise_multiplier * 2 C`` (:func:`clma.rounds.dp_fedavg`).
        :meth:`to_dp_event` is ``SampledWithoutReplacementDpEvent(population_size,
        sample_size, GaussianDpEvent(noise_multiplier))``.

        Raises:
            ValueError: a size that is not an integer, below 1, or ``sample_size >
                population_size``; a bad ``noise_multiplier``.
        """
        sizes = {}
        for name, value in (("population_size", population_size), ("sample_size", sample_size)):
            if isinstance(value, bool):
                raise ValueError(f"{name} must be an integer")
            try:
                sizes[name] = int(operator.index(value))
            except TypeError:
                raise ValueError(f"{name} must be an integer") from None
        return cls(mechanism="gaussian", noise_multiplier=float(noise_multiplier), **sizes)

    @property
    def sampling(self) -> Literal["none", "poisson", "without_replacement"]:
        """How the clients of this release were sampled."""
        if self.population_size is not None:
            return "without_replacement"
        return "poisson" if self.sampling_probability < 1.0 else "none"

    @property
    def is_pure(self) -> bool:
        return self.mechanism == "laplace"

    def to_record(self) -> dict[str, Any]:
        """The JSON form stored in the ledger (the sampling sizes only when set, so an
        unsampled event is stored exactly as ledgers before sampled events stored it)."""
        exclude = set() if self.population_size is not None else {"population_size", "sample_size"}
        if self.rho is None:
            exclude.add("rho")
        return self.model_dump(mode="json", exclude=exclude)

    def to_dp_event(self) -> dp_accounting.DpEvent:
        """The equivalent dp-accounting event."""
        if self.mechanism == "laplace":
            assert self.epsilon is not None
            return dp_accounting.LaplaceDpEvent(1.0 / self.epsilon)
        if self.mechanism == "zcdp":
            return dp_accounting.ZCDpEvent(float(self.rho))  # type: ignore[arg-type]
        event: dp_accounting.DpEvent = dp_accounting.GaussianDpEvent(self.noise_multiplier)
        if self.population_size is not None:
            return dp_accounting.SampledWithoutReplacementDpEvent(
                self.population_size, self.sample_size, event)
        if self.sampling_probability < 1.0:
            event = dp_accounting.PoissonSampledDpEvent(self.sampling_probability, event)
        return event


class CompositionResult(BaseModel):
    """Composed (epsilon, delta) of a sequence of events, under :data:`ADJACENCY`.

    ``method`` is ``exact_sum`` (pure-epsilon line, ``delta`` 0), ``pld`` (PLD,
    cross-checked by RDP), ``rdp`` (lines with events sampled without replacement) or
    ``none`` (no events). ``epsilon_rdp`` is the RDP value (``None`` for exact sums);
    ``adjacency`` the neighbouring relation the result holds for.
    """

    model_config = ConfigDict(frozen=True)

    epsilon: float
    delta: float
    method: Literal["exact_sum", "pld", "rdp", "none"]
    epsilon_rdp: float | None = None
    adjacency: str = ADJACENCY_NAME


def compose(
    events: Iterable[MechanismEvent],
    delta: float,
    *,
    value_discretization_interval: float = 1e-3,
    rdp_tolerance: float = 0.01,
) -> CompositionResult:
    """Sequentially compose ``events`` for one client, under replace-one adjacency.

    Args:
        events: the releases; order does not matter (composition is commutative).
        delta: target delta for lines with Gaussian events (ignored for pure lines).
        value_discretization_interval: PLD discretisation (smaller: tighter, slower).
        rdp_tolerance: allowed relative excess of the PLD epsilon over the RDP epsilon.

    Returns:
        :class:`CompositionResult` (method ``exact_sum``, ``rdp``, ``pld`` or ``none``:
        see the module docstring).

    Raises:
        AccountingError: a Poisson-sampled event (old ledgers only), a Gaussian event with
            ``delta`` outside (0, 1), a non-finite result, or a failed RDP cross-check.
    """
    events = list(events)
    if not events:
        return CompositionResult(epsilon=0.0, delta=0.0, method="none")
    if any(ev.sampling == "poisson" for ev in events):
        raise AccountingError(
            "events: a Poisson-sampled Gaussian event (sampling_probability < 1, written"
            " before replace-one accounting) has no replace-one accounting here; re-charge"
            " the rounds as MechanismEvent.gaussian_sampled_without_replacement"
        )
    if all(ev.is_pure for ev in events):
        # Exact running sum: fsum returns the correctly rounded sum of the epsilons.
        total = math.fsum(ev.epsilon for ev in events)  # type: ignore[misc]
        return CompositionResult(epsilon=total, delta=0.0, method="exact_sum")
    if not (0.0 < delta < 1.0):
        raise AccountingError("delta: a line with Gaussian events needs 0 < delta < 1")
    counts = Counter(events)
    key = tuple(sorted(((ev.model_dump_json(), n) for ev, n in counts.items())))
    if any(ev.sampling == "without_replacement" or ev.mechanism == "zcdp" for ev in events):
        eps = _rdp_cached(key, float(delta))
        if not math.isfinite(eps):
            raise AccountingError("composition: the RDP epsilon is not finite")
        return CompositionResult(epsilon=eps, delta=float(delta), method="rdp", epsilon_rdp=eps)
    eps_pld, eps_rdp = _pld_cached(key, float(delta), float(value_discretization_interval))
    if not math.isfinite(eps_pld):
        raise AccountingError("composition: the PLD epsilon is not finite")
    if eps_pld > eps_rdp * (1.0 + rdp_tolerance) + 1e-9:
        raise AccountingError("composition: the PLD epsilon exceeds the RDP cross-check")
    return CompositionResult(epsilon=eps_pld, delta=float(delta), method="pld", epsilon_rdp=eps_rdp)


def _events(key: tuple[tuple[str, int], ...]) -> list[tuple[dp_accounting.DpEvent, int]]:
    return [(MechanismEvent.model_validate_json(p).to_dp_event(), n) for p, n in key]


@functools.lru_cache(maxsize=512)
def _rdp_cached(key: tuple[tuple[str, int], ...], delta: float) -> float:
    rdp = RdpAccountant(neighboring_relation=ADJACENCY)
    for event, n in _events(key):
        rdp.compose(event, n)
    return float(rdp.get_epsilon(delta))


@functools.lru_cache(maxsize=512)
def _pld_cached(
    key: tuple[tuple[str, int], ...], delta: float, vdi: float
) -> tuple[float, float]:
    # ADD_OR_REMOVE_ONE here is not a second adjacency: for these unsampled events it
    # compares N(0, sigma) with N(Delta, sigma) (Laplace alike) for the replace-one Delta
    # the event states, which is the replace-one pair (module docstring).
    pld = PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                        value_discretization_interval=vdi)
    rdp = RdpAccountant(neighboring_relation=ADJACENCY)
    for event, n in _events(key):
        pld.compose(event, n)
        rdp.compose(event, n)
    return float(pld.get_epsilon(delta)), float(rdp.get_epsilon(delta))
