"""clma.sim.drift: label rotation, Gaussian noise, rotation and blur covariate drift."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import ndimage

from clma.sim.drift import AppliedDrift, apply_drifts, rotate_labels, transform_images


def _images(n=6, c=1, h=8, w=8, seed=0):
    return np.random.default_rng(seed).random((n, c, h, w)).astype(np.float32)


def test_rotate_labels_exact_formula_including_negative_shifts():
    y = np.arange(10, dtype=np.int64)
    for shift in (-23, -11, -3, -1, 0, 1, 4, 9, 10, 27):
        out = rotate_labels(y, shift, 10)
        assert out.dtype == np.int64
        np.testing.assert_array_equal(out, np.array([(v + shift) % 10 for v in range(10)]))
        assert out.min() >= 0 and out.max() <= 9
    np.testing.assert_array_equal(rotate_labels(y, -1, 10), [9, 0, 1, 2, 3, 4, 5, 6, 7, 8])
    # int32 / uint8 input gives int64
    assert rotate_labels(y.astype(np.uint8), -1, 10).dtype == np.int64
    np.testing.assert_array_equal(rotate_labels(y.astype(np.uint8), -1, 10)[0], 9)


def test_label_rotations_accumulate_and_opposite_families_differ():
    x = _images()
    y = np.array([0, 1, 2, 7, 8, 9], dtype=np.int64)
    plus = [AppliedDrift(2, "label_rotation", "p", shift=1),
            AppliedDrift(5, "label_rotation", "p", shift=1)]
    _, yp = apply_drifts(x, y, plus, 10)
    np.testing.assert_array_equal(yp, (y + 2) % 10)
    minus = [AppliedDrift(2, "label_rotation", "m", shift=-1),
             AppliedDrift(5, "label_rotation", "m", shift=-1)]
    xm, ym = apply_drifts(x, y, minus, 10)
    np.testing.assert_array_equal(ym, (y - 2) % 10)
    assert np.all(yp != ym)
    assert xm is x  # label drift leaves images untouched
    # +1 then -1 is the identity
    _, yid = apply_drifts(x, y, [plus[0], minus[0]], 10)
    np.testing.assert_array_equal(yid, y)
    np.testing.assert_array_equal(y, [0, 1, 2, 7, 8, 9])  # input not mutated


def test_gaussian_noise_seeded_clipped_and_of_the_right_scale():
    x = np.full((200, 1, 8, 8), 0.5, dtype=np.float32)
    d = AppliedDrift(1, "gaussian_noise", "n", magnitude=0.1, noise_seed=42)
    a = transform_images(x, d)
    b = transform_images(x, d)
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.float32 and a.shape == x.shape
    c = transform_images(x, AppliedDrift(1, "gaussian_noise", "n", magnitude=0.1, noise_seed=43))
    assert not np.array_equal(a, c)
    # exact formula: clip(x + N(0, s^2) from default_rng(seed), 0, 1)
    noise = np.random.default_rng(42).normal(0.0, 0.1, size=x.shape).astype(np.float32)
    np.testing.assert_array_equal(a, np.clip(x + noise, 0.0, 1.0))
    # std of the noise (5 sigma away from 0/1, almost never clipped): within 3 %
    assert abs(float((a - x).std()) - 0.1) < 0.003
    # large noise: clipped to [0, 1] and both bounds reached
    big = transform_images(x, AppliedDrift(1, "gaussian_noise", "n", magnitude=2.0, noise_seed=1))
    assert big.min() == 0.0 and big.max() == 1.0
    np.testing.assert_array_equal(x, 0.5)  # input not mutated


def test_rotation_by_90_degrees_equals_rot90():
    x = _images(n=4, c=2, h=8, w=8)
    out = transform_images(x, AppliedDrift(1, "rotation", "r", magnitude=90.0))
    assert out.shape == x.shape and out.dtype == np.float32
    # scipy rotates counter-clockwise in the displayed (row, col) image: np.rot90 on axes
    # (2, 3). Bilinear interpolation at exactly 90 degrees samples grid points only.
    np.testing.assert_allclose(out, np.rot90(x, k=1, axes=(2, 3)), atol=1e-6)
    assert not np.allclose(out, np.rot90(x, k=-1, axes=(2, 3)), atol=1e-3)
    out180 = transform_images(x, AppliedDrift(1, "rotation", "r", magnitude=180.0))
    np.testing.assert_allclose(out180, np.rot90(x, k=2, axes=(2, 3)), atol=1e-6)
    neg = transform_images(x, AppliedDrift(1, "rotation", "r", magnitude=-90.0))
    np.testing.assert_allclose(neg, np.rot90(x, k=-1, axes=(2, 3)), atol=1e-6)


def test_rotation_small_angle_stays_in_unit_range_and_loses_corners():
    x = np.ones((1, 1, 8, 8), dtype=np.float32)
    out = transform_images(x, AppliedDrift(1, "rotation", "r", magnitude=30.0))
    assert out.min() >= 0.0 and out.max() <= 1.0
    assert out[0, 0, 0, 0] < 0.5  # a corner rotated out is filled with 0 (mode constant)
    assert out[0, 0, 4, 4] == pytest.approx(1.0, abs=1e-6)


def test_blur_preserves_mean_and_reduces_variance():
    x = _images(n=5, c=3, h=16, w=16, seed=1)
    out = transform_images(x, AppliedDrift(1, "blur", "b", magnitude=1.0))
    assert out.shape == x.shape and out.dtype == np.float32
    # mode "reflect" (scipy's default, half-sample symmetric) preserves each image's sum
    np.testing.assert_allclose(out.mean(axis=(2, 3)), x.mean(axis=(2, 3)), atol=1e-6)
    assert np.all(out.var(axis=(2, 3)) < 0.5 * x.var(axis=(2, 3)))
    # only the spatial axes are filtered: each (image, channel) plane independently
    ref = np.stack([[ndimage.gaussian_filter(p, 1.0) for p in img] for img in x])
    np.testing.assert_allclose(out, ref, atol=1e-6)
    # a larger sigma blurs more
    more = transform_images(x, AppliedDrift(1, "blur", "b", magnitude=2.0))
    assert np.all(more.var(axis=(2, 3)) < out.var(axis=(2, 3)))
    assert out.min() >= 0.0 and out.max() <= 1.0


def test_transform_rejects_label_rotation_and_apply_orders_drifts():
    with pytest.raises(ValueError, match="does not transform images"):
        transform_images(_images(), AppliedDrift(1, "label_rotation", "p", shift=1))
    x = _images(n=2, h=8, w=8)
    y = np.array([3, 4], dtype=np.int64)
    drifts = [AppliedDrift(1, "rotation", "r", magnitude=90.0),
              AppliedDrift(2, "label_rotation", "p", shift=-4),
              AppliedDrift(3, "rotation", "r", magnitude=90.0)]
    xo, yo = apply_drifts(x, y, drifts, 10)
    np.testing.assert_allclose(xo, np.rot90(x, k=2, axes=(2, 3)), atol=1e-6)
    np.testing.assert_array_equal(yo, [9, 0])


def test_feature_scale_multiplies_every_feature_of_any_shape():
    from clma.sim.drift import AppliedDrift, apply_drifts

    tab = np.random.default_rng(0).normal(size=(5, 30)).astype(np.float32)
    y = np.arange(5, dtype=np.int64)
    d = AppliedDrift(3, "feature_scale", "recalibrated", magnitude=3.0)
    x2, y2 = apply_drifts(tab, y, [d], 2)
    np.testing.assert_array_equal(x2, tab * np.float32(3.0))
    assert x2.dtype == np.float32 and (y2 == y).all() and x2 is not tab
    img = np.full((2, 1, 4, 4), 0.5, np.float32)  # images too (not clipped to [0, 1])
    x3, _ = apply_drifts(img, y[:2], [d, d], 10)
    np.testing.assert_array_equal(x3, np.full_like(img, 4.5))


def test_feature_scale_is_the_one_covariate_drift_for_tabular_sources(tmp_path, monkeypatch):
    import pytest

    from clma.config import validate_config
    from clma.sim.federation import build_federation

    (tmp_path / "tabsrc.py").write_text(
        "import numpy as np\n\ndef load():\n"
        "    rng = np.random.default_rng(0)\n"
        "    return rng.normal(size=(200, 6)).astype(np.float32), rng.integers(0, 2, 200)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    base = {"clients": 4, "rounds": 2, "data": {"source": "tabsrc:load", "probe_size": 8}}
    ev = {"round": 2, "clients": [0], "family": "f", "magnitude": 2.0}
    fed = build_federation(validate_config(
        {**base, "drift": {"events": [{**ev, "kind": "feature_scale"}]}}))
    cl = fed.clients[0]
    cl.drifts = fed.drifts_for(0, 2)
    np.testing.assert_array_equal(cl.current()[0], cl.train_x * np.float32(2.0))
    with pytest.raises(ValueError, match=r"drift.events\[0\].kind: 'blur' drifts images"):
        build_federation(validate_config(
            {**base, "drift": {"events": [{**ev, "kind": "blur"}]}}))
    with pytest.raises(ValueError, match="feature_scale needs a positive 'magnitude'"):
        validate_config({**base, "drift": {"events": [{**ev, "kind": "feature_scale",
                                                       "magnitude": 0.0}]}})
