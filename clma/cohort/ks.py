"""Signed two-sample Kolmogorov-Smirnov statistic (CLMA, Algorithm 3, step 1).

CLMA (Adarsh N L, Amarlingam, Sharma, CODS-COMAD 2024, doi 10.1145/3703323.3703341)
compares each quarantined client's flattened parameter vector with the reference (the
cohort model the client started from) by a two-sample KS test and uses the *sign* of the
statistic as the direction of the parameter shift.

Definitions (``F_s`` is the empirical CDF of the sample, ``F_r`` of the reference, both
right-continuous, exactly as ``scipy.stats.ks_2samp`` evaluates them)::

    D+ = max(0, max_x F_s(x) - F_r(x))      # sample ECDF above the reference's
    D- = max(0, max_x F_r(x) - F_s(x))      # sample ECDF below the reference's
    D  = max(D+, D-)                         # == ks_2samp(sample, reference).statistic
    sign = +1 if D+ >= D- else -1            # == ks_2samp(...).statistic_sign
    signed KS = sign * D

Tie rule: when ``D+ == D-`` the sign is ``+1``, which is scipy's rule (``statistic_sign``
is ``-1`` only when ``D- > D+``). When ``D == 0`` (identical empirical distributions) the
signed statistic is ``0.0``.

Direction convention: a *positive* signed KS means the client's ECDF lies above the
reference's, i.e. the client's parameters are shifted towards *smaller* values; negative
means shifted towards larger values. Only the grouping by sign matters to the algorithm.

Computation. ``F_s - F_r`` only rises at sample points and only falls at reference points,
so ``D+`` is attained at a sample point and ``D-`` at a reference point. With both arrays
sorted, one vectorised ``np.searchsorted`` pass of the sample into the reference gives the
counts (see ``_components_sorted``), and the differences are evaluated with the same float64
operations as scipy (``count/n``), so ``D`` is bitwise equal to scipy's ``statistic``. The
reference is sorted once (:class:`SortedReference`) and reused for every client of a round
(issue 3, item 6c); each client costs one sort of its own vector plus one searchsorted pass,
O(p log p), with one sorted copy and one int64 count array as temporaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import kstwobign

__all__ = [
    "KSComponents",
    "SortedReference",
    "ks_components",
    "ks_components_from_sorted",
    "ks_critical_value",
    "signed_ks_from_sorted",
    "signed_ks_statistic",
]


_SCIPY_MAX_AUTO_N = 10_000  # scipy.stats.ks_2samp: 'auto' is exact up to this size


def _as_1d_finite(values: object, field: str) -> np.ndarray:
    """Return ``values`` as a 1-D float array (no copy when it already is one)."""
    try:
        arr = np.asarray(values)
    except Exception as exc:  # pragma: no cover - defensive
        raise TypeError(f"{field}: must be array-like of real numbers") from exc
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"{field}: must hold real numbers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{field}: must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{field}: must not be empty")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise ValueError(f"{field}: must be finite (NaN or inf found)")
    return arr


@dataclass(frozen=True)
class KSComponents:
    """The one-sided KS distances of a sample against a reference.

    ``d_plus = max(0, max F_s - F_r)``, ``d_minus = max(0, max F_r - F_s)`` (float64 in
    [0, 1], computed with scipy's float operations: bitwise equal to
    ``ks_2samp(sample, reference, alternative='greater' / 'less', method='asymp').statistic``);
    ``n_sample`` and ``n_reference`` are the sample sizes. The sign compares these
    unrounded values, exactly as scipy does.
    """

    d_plus: float
    d_minus: float
    n_sample: int
    n_reference: int

    @property
    def statistic(self) -> float:
        """Two-sided D, bitwise equal to ``scipy.stats.ks_2samp(...).statistic``.

        scipy's default ``method='auto'`` uses its exact mode when both samples have at
        most 10,000 values, which snaps D to the grid ``h / lcm(n, m)``; the same snapping
        is applied here in that case (a difference of at most one ulp otherwise).
        """
        d = self.d_minus if self.d_minus > self.d_plus else self.d_plus
        n1, n2 = self.n_sample, self.n_reference
        g = math.gcd(n1, n2)
        if max(n1, n2) <= _SCIPY_MAX_AUTO_N and n1 // g < np.iinfo(np.int32).max / (n2 // g):
            lcm = (n1 // g) * n2
            d = int(np.round(d * lcm)) * 1.0 / lcm
        return float(d)

    @property
    def sign(self) -> int:
        """+1 when ``d_plus >= d_minus`` (scipy's tie rule), else -1."""
        return 1 if self.d_plus >= self.d_minus else -1

    @property
    def signed(self) -> float:
        """``sign * statistic`` (``0.0`` when the statistic is 0)."""
        d = self.statistic
        return float(d) if self.sign > 0 else -float(d)

    @property
    def direction_gap(self) -> float:
        """``|d_plus - d_minus|``: how clearly one direction dominates."""
        return abs(self.d_plus - self.d_minus)


class SortedReference:
    """A reference vector sorted once, to compute KS statistics of many samples against it.

    Parameters
    ----------
    reference:
        1-D real array ``(n_params,)`` (float32 parameter vectors in CLMA). It is copied
        once into a sorted array of the same dtype (4 bytes per parameter for float32).

    Raises
    ------
    TypeError, ValueError
        Non-numeric, not 1-D, empty or non-finite reference (field ``reference``).
    """

    __slots__ = ("sorted", "size")

    def __init__(self, reference: object, *, field: str = "reference") -> None:
        arr = _as_1d_finite(reference, field)
        self.sorted: np.ndarray = np.sort(arr)
        self.size: int = int(arr.shape[0])

    @classmethod
    def from_sorted(cls, sorted_reference: np.ndarray) -> SortedReference:
        """Wrap an array the caller guarantees is already sorted ascending (not checked)."""
        obj = cls.__new__(cls)
        arr = np.asarray(sorted_reference)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError("sorted_reference: must be a non-empty 1-D array")
        obj.sorted = arr
        obj.size = int(arr.shape[0])
        return obj


_BLOCK = 1 << 16  # elements per block of the O(p) passes (keeps temporaries in cache)


def _components_sorted(sample_sorted: np.ndarray, ref_sorted: np.ndarray) -> tuple[float, float]:
    """D+ and D- from one searchsorted pass of the sorted sample into the sorted reference.

    With ``i`` the 0-based position in the sorted sample, ``cR_i = #{r <= s_i}`` and
    ``cL_i = #{r < s_i}``:

    * ``D+ = max(0, max_i (i+1)/n1 - cR_i/n2)``: F_s - F_r only rises at sample points;
      ``(i+1)/n1`` is F_s(s_i) at the last element of a run of ties and smaller before it.
    * ``D- = max(0, max_i cL_i/n2 - i/n1)``: F_r - F_s is largest just before a sample
      point, at the largest reference value below ``s_i`` (``i/n1`` is F_s there for the
      first element of a run of ties, smaller values for the others).

    Each candidate is the same pair of counts scipy evaluates, with the same float64
    operations (``count / n`` then a subtraction), so the maxima are bitwise scipy's.
    ``cL`` differs from ``cR`` only where a sample value equals a reference value; those
    few positions get a second, ``side='left'`` search.
    """
    n1 = sample_sorted.shape[0]
    n2 = ref_sorted.shape[0]
    c_right = np.searchsorted(ref_sorted, sample_sorted, side="right")
    d_plus = 0.0
    d_minus = 0.0
    for start in range(0, n1, _BLOCK):
        stop = min(n1, start + _BLOCK)
        cr = c_right[start:stop]
        f_ref = cr / n2
        f_sample = np.arange(start + 1, stop + 1, dtype=np.int64) / n1
        d_plus = max(d_plus, float(np.max(f_sample - f_ref)))
        s_blk = sample_sorted[start:stop]
        tied = (cr > 0) & (ref_sorted[np.maximum(cr - 1, 0)] == s_blk)
        if tied.any():
            cl = cr.copy()
            cl[tied] = np.searchsorted(ref_sorted, s_blk[tied], side="left")
            f_ref = cl / n2
        f_sample = np.arange(start, stop, dtype=np.int64) / n1
        d_minus = max(d_minus, float(np.max(f_ref - f_sample)))
    return d_plus, d_minus


def ks_components_from_sorted(sample: object, reference: SortedReference | np.ndarray,
                              *, field: str = "sample") -> KSComponents:
    """``(D+, D-)`` of ``sample`` against an already-sorted reference.

    ``reference`` is a :class:`SortedReference` (or a 1-D array already sorted ascending).
    ``sample`` is 1-D, finite, any real dtype; it is sorted into one temporary copy.
    Errors name ``field``.
    """
    arr = _as_1d_finite(sample, field)
    ref = reference if isinstance(reference, SortedReference) else SortedReference.from_sorted(
        np.asarray(reference))
    d_plus, d_minus = _components_sorted(np.sort(arr), ref.sorted)
    return KSComponents(d_plus, d_minus, int(arr.shape[0]), ref.size)


def ks_components(sample: object, reference: object) -> KSComponents:
    """``(D+, D-)`` of ``sample`` against ``reference`` (both 1-D, finite; sorted here)."""
    return ks_components_from_sorted(sample, SortedReference(reference))


def signed_ks_from_sorted(sample: object, sorted_reference: SortedReference | np.ndarray) -> float:
    """Signed KS of ``sample`` against a reference sorted once per round.

    Same value as :func:`signed_ks_statistic`; use this inside a loop over clients.
    """
    return ks_components_from_sorted(sample, sorted_reference).signed


def signed_ks_statistic(sample: object, reference: object) -> float:
    """Signed two-sample KS statistic of ``sample`` against ``reference``.

    Parameters
    ----------
    sample, reference:
        1-D finite real arrays (float32 ``(n_params,)`` parameter vectors in CLMA); their
        lengths may differ.

    Returns
    -------
    float
        ``sign * D`` where ``D == scipy.stats.ks_2samp(sample, reference).statistic`` and
        ``sign == ks_2samp(...).statistic_sign`` (``+1`` when ``D+ >= D-``); 0.0 if D == 0.
        Positive: the sample's ECDF is above the reference's (values shifted smaller).

    Raises
    ------
    TypeError, ValueError
        Non-numeric, not 1-D, empty or non-finite input, naming ``sample`` or ``reference``.

    Source: CLMA Algorithm 3 (signed KS direction test); see the module docstring.
    """
    return ks_components(sample, reference).signed


def ks_critical_value(alpha: float, n_sample: int, n_reference: int) -> float:
    """Asymptotic two-sample KS critical value ``K_{1-alpha} * sqrt((n+m)/(n*m))``.

    ``K_{1-alpha}`` is the upper-alpha quantile of the Kolmogorov distribution
    (``scipy.stats.kstwobign.isf(alpha)``; 1.358 at alpha 0.05). Used to decide whether a
    direction ``|D+ - D-|`` is statistically established.
    """
    if not (0.0 < float(alpha) < 1.0):
        raise ValueError("alpha: must lie in (0, 1)")
    if n_sample < 1 or n_reference < 1:
        raise ValueError("n_sample, n_reference: must be >= 1")
    return float(kstwobign.isf(alpha) * np.sqrt((n_sample + n_reference) / (n_sample * n_reference)))
