"""On-device bounded metrics: literal formulas, fixed bins, bounds, registry."""

import math

import numpy as np
import pytest

from clma.metrics import (
    REPORT_LENGTH,
    DeviceMetricLayout,
    DeviceMetricReport,
    MetricRegistry,
    MetricRegistryError,
    MetricSpec,
    accuracy,
    calibration_buckets,
    compute_device_report,
    default_registry,
    error_histogram,
    mean_loss,
    sample_count_bucket,
)


def _softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    p = _softmax(rng.normal(0, 3, size=(300, 10)))
    y = rng.integers(0, 10, size=300)
    return p, y


def test_registry_rejects_unbounded_specs():
    reg = MetricRegistry()
    reg.register(MetricSpec("accuracy", 0, 1))
    assert "accuracy" in reg and len(reg) == 1
    bypass = MetricSpec.model_construct(name="loss", clip_low=0.0, clip_high=math.inf)
    with pytest.raises(MetricRegistryError, match="clip_high.*finite"):
        reg.register(bypass)
    reversed_ = MetricSpec.model_construct(name="loss", clip_low=2.0, clip_high=1.0)
    with pytest.raises(MetricRegistryError, match="strictly greater"):
        reg.register(reversed_)
    with pytest.raises(MetricRegistryError, match="already registered"):
        reg.register(MetricSpec("accuracy", 0, 2))
    with pytest.raises(MetricRegistryError, match="unknown"):
        reg.get("f1")
    with pytest.raises(TypeError):
        reg.register({"name": "x", "clip_low": 0, "clip_high": 1})
    assert default_registry(3.0).get("mean_loss").sensitivity == 3.0


def test_accuracy_and_loss_literal(data):
    p, y = data
    assert accuracy(p, y) == np.mean(p.argmax(1) == y)
    ce = -np.log(p[np.arange(300), y])
    assert mean_loss(p, y, l_max=2.0) == pytest.approx(np.minimum(ce, 2.0).mean(), rel=1e-12)
    assert 0.0 <= mean_loss(p, y, l_max=0.5) <= 0.5
    # a confidently wrong model: loss clipped at L_max exactly
    bad = np.full((5, 2), 1e-20)
    bad[:, 1] = 1.0
    assert mean_loss(bad, np.zeros(5, dtype=int), l_max=4.0) == 4.0


def test_histogram_fixed_edges_not_data_dependent():
    edges = (0.0, 0.1, 0.5, 1.0, 2.0, 4.0)
    h = error_histogram([0.0, 0.05, 0.1, 0.7, 3.9, 4.0, 100.0, -1.0], edges)
    np.testing.assert_allclose(h, np.array([3, 1, 1, 0, 3]) / 8)
    # the edges are the spec's: shifting all data never moves edges
    h2 = error_histogram(np.full(10, 50.0), edges)
    np.testing.assert_array_equal(h2, [0, 0, 0, 0, 1])
    with pytest.raises(ValueError, match="between 5 and 9 buckets"):
        error_histogram([0.1], (0.0, 1.0, 2.0))
    with pytest.raises(ValueError, match="between 5 and 9 buckets"):
        error_histogram([0.1], np.arange(11.0))
    with pytest.raises(ValueError, match="strictly increasing"):
        error_histogram([0.1], (0, 1, 1, 2, 3, 4))


def test_calibration_matches_literal(data):
    p, y = data
    edges = (0.0, 0.25, 0.5, 0.75, 1.0)
    mass, conf, outcome = calibration_buckets(p, y, edges)
    c = p.max(1)
    ok = p.argmax(1) == y
    for b in range(4):
        inb = (c >= edges[b]) & ((c < edges[b + 1]) if b < 3 else True)
        assert mass[b] == pytest.approx(inb.mean())
        assert conf[b] == pytest.approx(c[inb].sum() / 300)
        assert outcome[b] == pytest.approx(ok[inb].sum() / 300)
    assert mass.sum() == pytest.approx(1.0)
    assert conf.sum() <= 1.0 and outcome.sum() <= 1.0


def test_sample_count_reported_as_bucket_only():
    edges = (0, 10, 50, 200)
    np.testing.assert_array_equal(sample_count_bucket(0, edges), [1, 0, 0])
    np.testing.assert_array_equal(sample_count_bucket(49, edges), [0, 1, 0])
    np.testing.assert_array_equal(sample_count_bucket(50, edges), [0, 0, 1])
    np.testing.assert_array_equal(sample_count_bucket(10**6, edges), [0, 0, 1])
    # 60 and 150 examples give the same report: the count is not recoverable
    np.testing.assert_array_equal(sample_count_bucket(60, edges), sample_count_bucket(150, edges))


def test_device_report_layout_and_bounds(data):
    p, y = data
    lay = DeviceMetricLayout(l_max=3.0)
    rep = compute_device_report(p, y, lay)
    v = rep.vector
    assert v.shape == (REPORT_LENGTH,) and REPORT_LENGTH == 32
    s = lay.slices
    assert (s["accuracy"], s["mean_loss"], s["error_histogram"]) == (
        slice(0, 1), slice(1, 2), slice(2, 9))
    assert s["sample_count_bucket"] == slice(24, 29) and s["padding"] == slice(29, 32)
    assert v[0] == accuracy(p, y) and v[1] == mean_loss(p, y, l_max=3.0)
    assert rep.group("error_histogram").sum() == pytest.approx(1.0)
    np.testing.assert_array_equal(rep.group("sample_count_bucket"), [0, 0, 0, 1, 0])  # 300
    assert np.all(v >= lay.lower_bounds()) and np.all(v <= lay.upper_bounds())
    assert np.all(v[29:] == 0)
    with pytest.raises(ValueError, match="clip bounds"):
        DeviceMetricReport(layout=lay, values=tuple([0.5, 3.5] + [0.0] * 30))
    with pytest.raises(ValueError, match="REPORT_LENGTH"):
        DeviceMetricReport(layout=lay, values=(0.0,) * 31)


def test_sensitivity_bounds_hold_for_replace_one(data):
    """Empirical check of the stated L1 sensitivities: two arbitrary clients'
    reports differ by at most the group sensitivity."""
    rng = np.random.default_rng(1)
    lay = DeviceMetricLayout()
    reports = []
    for _ in range(40):
        n = int(rng.integers(1, 400))
        p = _softmax(rng.normal(0, rng.uniform(0.1, 8), size=(n, 10)))
        reports.append(compute_device_report(p, rng.integers(0, 10, n), lay))
    for name, sl in lay.slices.items():
        if name == "padding":
            continue
        worst = max(np.abs(a.vector[sl] - b.vector[sl]).sum() for a in reports for b in reports)
        assert worst <= lay.l1_sensitivity(name) + 1e-12


def test_layout_validation():
    with pytest.raises(ValueError, match="l_max"):
        DeviceMetricLayout(l_max=math.inf)
    with pytest.raises(ValueError, match="error_edges"):
        DeviceMetricLayout(error_edges=(0.0, 1.0, 2.0))
    with pytest.raises(ValueError, match="calibration_edges"):
        DeviceMetricLayout(calibration_edges=(0.0, 0.5, 1.5))
    with pytest.raises(ValueError, match="REPORT_LENGTH"):
        DeviceMetricLayout(error_edges=tuple(range(10)), calibration_edges=tuple(np.linspace(0, 1, 10)))


def test_bad_probabilities_named():
    with pytest.raises(ValueError, match="sum to 1"):
        accuracy(np.ones((3, 2)), np.zeros(3, dtype=int))
    with pytest.raises(ValueError, match="labels"):
        accuracy(np.full((3, 2), 0.5), np.array([0, 1, 2]))
    with pytest.raises(TypeError, match="integers"):
        accuracy(np.full((3, 2), 0.5), np.array([0.0, 1.0, 1.0]))
