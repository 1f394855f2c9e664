"""Signed KS statistic against scipy.stats.ks_2samp (issue 2 checks; issue 3 item 6c)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from scipy.stats import ks_2samp

from clma.cohort import (
    SortedReference,
    ks_components,
    ks_components_from_sorted,
    ks_critical_value,
    signed_ks_from_sorted,
    signed_ks_statistic,
)


def exact_components(a: np.ndarray, b: np.ndarray) -> tuple[Fraction, Fraction]:
    """Literal D+ and D- in exact rational arithmetic over every data point."""
    a, b = np.sort(a), np.sort(b)
    pts = np.concatenate([a, b])
    c1 = np.searchsorted(a, pts, side="right")
    c2 = np.searchsorted(b, pts, side="right")
    diffs = [Fraction(int(x), len(a)) - Fraction(int(y), len(b)) for x, y in zip(c1, c2,
                                                                                  strict=True)]
    return max(max(diffs), Fraction(0)), max(-min(diffs), Fraction(0))


def random_pairs(n_pairs: int, seed: int):
    rng = np.random.default_rng(seed)
    for i in range(n_pairs):
        n1, n2 = rng.integers(1, 60, size=2)
        kind = i % 4
        if kind == 0:  # integer-valued: many ties within and across samples
            a = rng.integers(0, 6, n1).astype(float)
            b = rng.integers(0, 6, n2).astype(float) + rng.integers(-1, 2)
        elif kind == 1:  # continuous, shifted
            a = rng.normal(0, 1, n1)
            b = rng.normal(rng.normal(0, 1), rng.uniform(0.5, 2), n2)
        elif kind == 2:  # float32 with ties (rounded)
            a = np.round(rng.normal(0, 1, n1), 1).astype(np.float32)
            b = np.round(rng.normal(0.2, 1, n2), 1).astype(np.float32)
        else:  # identical multiset (D = 0) or a sample drawn from the reference
            b = rng.integers(0, 4, n2).astype(float)
            a = rng.permutation(b) if i % 8 == 3 else rng.choice(b, n1)
        yield a, b


def test_signed_ks_matches_scipy_many_pairs_with_ties() -> None:
    n_sign_checked = 0
    for a, b in random_pairs(600, seed=0):
        res = ks_2samp(a, b)
        value = signed_ks_statistic(a, b)
        assert abs(value) == res.statistic  # bitwise, scipy's default method
        comps = ks_components(a, b)
        # One-sided components against scipy's one-sided statistics (asymp: unrounded).
        assert comps.d_plus == ks_2samp(a, b, alternative="greater", method="asymp").statistic
        assert comps.d_minus == ks_2samp(a, b, alternative="less", method="asymp").statistic
        dp, dm = exact_components(a, b)
        assert comps.d_plus == pytest.approx(float(dp), abs=1e-15)
        assert comps.d_minus == pytest.approx(float(dm), abs=1e-15)
        if dp != dm:
            n_sign_checked += 1
            assert np.sign(value) == res.statistic_sign
            assert comps.sign == (1 if dp > dm else -1)
        elif dp == 0:
            assert value == 0.0
    assert n_sign_checked > 400  # the comparison really ran on most pairs


def test_large_samples_match_scipy_asymptotic_mode() -> None:
    rng = np.random.default_rng(1)
    ref = rng.normal(0, 0.05, 30_000).astype(np.float32)
    for shift in (-0.01, 0.0, 0.003, 0.02):
        x = (ref + rng.normal(shift, 0.01, ref.size)).astype(np.float32)
        res = ks_2samp(x, ref)  # > 10,000 values: scipy uses its asymptotic mode
        value = signed_ks_statistic(x, ref)
        assert abs(value) == res.statistic
        assert np.sign(value) == res.statistic_sign
    # Frozen layer: half the parameters are exactly the reference's (cross-sample ties).
    x = ref.copy()
    x[:15_000] += rng.normal(0.004, 0.01, 15_000).astype(np.float32)
    res = ks_2samp(x, ref)
    assert abs(signed_ks_statistic(x, ref)) == res.statistic
    assert np.sign(signed_ks_statistic(x, ref)) == res.statistic_sign
    comps = ks_components(x, ref)
    assert comps.d_minus == ks_2samp(x, ref, alternative="less", method="asymp").statistic
    assert comps.d_plus == ks_2samp(x, ref, alternative="greater", method="asymp").statistic
    # Direction convention: larger values => sample ECDF below the reference => negative.
    assert signed_ks_statistic(ref + np.float32(0.05), ref) < 0
    assert signed_ks_statistic(ref - np.float32(0.05), ref) > 0


def test_tie_rule_sign_positive_when_components_equal() -> None:
    # Symmetric widening: D+ == D- exactly.
    a = np.array([0.0, 3.0])
    b = np.array([1.0, 2.0])
    comps = ks_components(a, b)
    assert comps.d_plus == comps.d_minus == 0.5
    assert comps.sign == 1 and signed_ks_statistic(a, b) == 0.5
    assert ks_2samp(a, b).statistic_sign == 1  # scipy's rule is the same
    assert signed_ks_statistic(b, b) == 0.0


def test_sorted_reference_reused_gives_same_values() -> None:
    rng = np.random.default_rng(2)
    ref = rng.normal(size=5_000).astype(np.float32)
    sref = SortedReference(ref)
    assert np.all(np.diff(sref.sorted) >= 0) and sref.sorted.dtype == np.float32
    for _ in range(5):
        x = rng.normal(rng.normal(0, 0.1), 1, 4_000).astype(np.float32)
        assert signed_ks_from_sorted(x, sref) == signed_ks_statistic(x, ref)
        assert signed_ks_from_sorted(x, sref.sorted) == signed_ks_statistic(x, ref)
        assert ks_components_from_sorted(x, sref) == ks_components(x, ref)


@pytest.mark.parametrize("sample, match", [
    (np.array([1.0, np.nan]), "sample: must be finite"),
    (np.array([1.0, np.inf]), "sample: must be finite"),
    (np.zeros((2, 2)), "sample: must be 1-D"),
    (np.array([]), "sample: must not be empty"),
])
def test_bad_input_named(sample, match) -> None:
    with pytest.raises(ValueError, match=match):
        signed_ks_statistic(sample, np.ones(3))
    with pytest.raises(ValueError, match=match.replace("sample", "reference")):
        signed_ks_statistic(np.ones(3), sample)
    with pytest.raises(TypeError, match="sample"):
        signed_ks_statistic(np.array(["a", "b"]), np.ones(2))


def test_critical_value_matches_kolmogorov_quantile() -> None:
    # K_{0.95} = 1.3581 (Smirnov); two samples of 50,000: 1.3581 * sqrt(2 / 50,000).
    assert ks_critical_value(0.05, 50_000, 50_000) == pytest.approx(1.35810 * np.sqrt(4e-5),
                                                                    rel=1e-4)
    with pytest.raises(ValueError, match="alpha"):
        ks_critical_value(0.0, 10, 10)
