"""The statistics of docs/figures/leading_split_diagnostics.py against their literal
formulas (the figures in docs/realistic_drift.md section 6 rest on them)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).parents[1] / "docs" / "figures" / "leading_split_diagnostics.py"


@pytest.fixture(scope="module")
def diag():
    spec = importlib.util.spec_from_file_location("leading_split_diagnostics", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_label_mix_r2_is_the_least_squares_r2_and_its_permutation_p(diag):
    from sklearn.linear_model import LinearRegression

    rng = np.random.default_rng(3)
    props = rng.dirichlet(np.ones(10), size=30)
    z = 4.0 * props[:, 2] - 2.0 * props[:, 7] + 0.05 * rng.standard_normal(30)
    r2, p = diag.label_mix_r2(z, props, n_perm=199, seed=1)
    ref = LinearRegression().fit(props[:, :-1], z).score(props[:, :-1], z)
    assert r2 == pytest.approx(ref, abs=1e-10)
    assert p == pytest.approx(1 / 200)  # no shuffle fits as well as the real pairing
    noise = rng.standard_normal(30)  # unrelated scores: p is not small
    r2n, pn = diag.label_mix_r2(noise, props, n_perm=199, seed=1)
    assert 0.0 < r2n < 1.0 and pn > 0.05


def test_eta2_and_separation_literal(diag):
    z = np.array([1.0, 2.0, 3.0, 7.0, 8.0, 9.0])
    lab = np.array([0, 0, 0, 1, 1, 1])
    # between = 3 * (2 - 5)^2 + 3 * (8 - 5)^2 = 54; total = 54 + 4 = 58
    assert diag._eta2(z, lab) == pytest.approx(54 / 58)
    # |2 - 8| / sqrt((1 + 1) / 2) = 6
    assert diag._separation(z, lab, [0, 1]) == pytest.approx(6.0)
