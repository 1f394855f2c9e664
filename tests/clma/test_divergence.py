"""Tests of clma.divergence: patterns, affinity, divergences, robust z, scorers (issue 6)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy import stats
from scipy.spatial import distance
from sklearn.datasets import load_digits
from torch import nn

from clma.divergence import (
    DivergenceConfig,
    DivergenceReport,
    LayerPattern,
    RepresentationScorer,
    activation_patterns,
    affinities,
    affinity,
    combine_layer_divergences,
    cosine_distance_to_mean,
    hierarchical_divergence,
    layer_divergence,
    parameter_baseline,
    probe_digest,
    robust_z,
    robust_z_stats,
    sample_probe,
)


def mlp(seed: int, sizes=(64, 32, 16, 10)) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def pattern_from_matrix(a: np.ndarray, name: str = "l") -> LayerPattern:
    return LayerPattern(name=name, bits=np.packbits(a.astype(np.uint8), axis=1), width=a.shape[1])


def brute_force_hamming(a: np.ndarray) -> np.ndarray:
    p, w = a.shape
    h = np.empty((p, p), dtype=np.int64)
    for i in range(p):
        for j in range(p):
            h[i, j] = sum(int(a[i, u] != a[j, u]) for u in range(w))
    return h


def brute_force_affinity(a: np.ndarray) -> np.ndarray:
    return 1.0 - brute_force_hamming(a) / a.shape[1]


@pytest.fixture(scope="module")
def digits() -> np.ndarray:
    x = load_digits().data.astype(np.float32)
    return (x - x.mean(axis=0)) / (x.std(axis=0) + 1.0)


# --------------------------------------------------------------------------- affinity


@pytest.mark.parametrize("width", [1, 8, 13, 29, 64])
def test_affinity_matches_brute_force_hamming(width: int) -> None:
    rng = np.random.default_rng(width)
    a = rng.integers(0, 2, size=(9, width))
    k = affinity(pattern_from_matrix(a))
    assert k.dtype == np.float64 and k.shape == (9, 9)
    # exact Hamming counts, and values equal up to the last bit of rounding
    np.testing.assert_array_equal(np.rint((1.0 - k) * width), brute_force_hamming(a))
    np.testing.assert_allclose(k, brute_force_affinity(a), rtol=0, atol=2.3e-16)


def test_affinity_blocked_equals_single_block() -> None:
    rng = np.random.default_rng(1)
    a = rng.integers(0, 2, size=(20, 203))  # 203 bits: 25 full bytes + 3 bits
    pat = pattern_from_matrix(a)
    np.testing.assert_array_equal(affinity(pat, block_bits=16), affinity(pat))
    np.testing.assert_array_equal(
        np.rint((1.0 - affinity(pat, block_bits=16)) * 203), brute_force_hamming(a)
    )


def test_affinity_symmetric_unit_diagonal_and_extremes() -> None:
    rng = np.random.default_rng(2)
    a = rng.integers(0, 2, size=(30, 77))
    a[1] = 1 - a[0]  # opposite of sample 0
    a[2] = a[0]  # identical to sample 0
    k = affinity(pattern_from_matrix(a))
    np.testing.assert_array_equal(k, k.T)
    np.testing.assert_array_equal(np.diag(k), np.ones(30))
    assert k[0, 1] == 0.0 and k[0, 2] == 1.0
    assert k.min() >= 0.0 and k.max() <= 1.0


def test_affinity_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="LayerPattern"):
        affinity(np.zeros((3, 1), dtype=np.uint8))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_bits"):
        affinity(pattern_from_matrix(np.ones((2, 5))), block_bits=12)
    with pytest.raises(ValueError, match="ceil"):
        LayerPattern(name="x", bits=np.zeros((2, 2), dtype=np.uint8), width=20)


# --------------------------------------------------------------------------- patterns


def test_mlp_patterns_equal_manual_preactivations() -> None:
    model = mlp(0)
    x = np.random.default_rng(3).normal(size=(37, 64)).astype(np.float32)
    pats = activation_patterns(model, x, batch_size=10)
    assert [p.name for p in pats] == ["1", "3"]
    assert [p.width for p in pats] == [32, 16]
    assert [p.bits.shape for p in pats] == [(37, 4), (37, 2)]
    with torch.no_grad():
        h1 = model[0](torch.from_numpy(x))
        h2 = model[2](torch.relu(h1))
    np.testing.assert_array_equal(pats[0].unpack(), (h1 > 0).numpy().astype(np.uint8))
    np.testing.assert_array_equal(pats[1].unpack(), (h2 > 0).numpy().astype(np.uint8))
    # batching does not change the result
    one_batch = activation_patterns(model, torch.from_numpy(x), batch_size=256)
    for p, q in zip(pats, one_batch, strict=True):
        np.testing.assert_array_equal(p.bits, q.bits)


def test_conv_patterns_have_flattened_feature_map_shape() -> None:
    torch.manual_seed(4)
    model = nn.Sequential(
        nn.Conv2d(2, 3, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Conv2d(3, 4, kernel_size=3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 2 * 2, 5),
    )
    x = torch.randn(6, 2, 5, 5)
    pats = activation_patterns(model, x)
    assert [p.width for p in pats] == [3 * 5 * 5, 4 * 2 * 2]
    assert [p.bits.shape for p in pats] == [(6, 10), (6, 2)]
    assert all(p.bits.dtype == np.uint8 for p in pats)
    with torch.no_grad():
        c1 = model[0](x)
        c2 = model[2](torch.relu(c1))
    np.testing.assert_array_equal(pats[0].unpack(), (c1 > 0).reshape(6, -1).numpy())
    np.testing.assert_array_equal(pats[1].unpack(), (c2 > 0).reshape(6, -1).numpy())


class SharedReLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 5)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.fc2(self.relu(self.fc1(x))))


def test_reused_relu_module_gives_one_layer_per_call() -> None:
    torch.manual_seed(5)
    model = SharedReLU()
    x = torch.randn(8, 4)
    pats = activation_patterns(model, x)
    assert [(p.name, p.width) for p in pats] == [("relu", 6), ("relu#1", 5)]
    with torch.no_grad():
        h1 = model.fc1(x)
        h2 = model.fc2(torch.relu(h1))
    np.testing.assert_array_equal(pats[0].unpack(), (h1 > 0).numpy())
    np.testing.assert_array_equal(pats[1].unpack(), (h2 > 0).numpy())


def test_patterns_use_eval_mode_and_restore_training_mode() -> None:
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), nn.ReLU(), nn.Linear(64, 2))
    model.train()
    x = torch.randn(20, 8)
    a = activation_patterns(model, x)
    b = activation_patterns(model, x)
    assert model.training
    np.testing.assert_array_equal(a[0].bits, b[0].bits)
    with torch.no_grad():
        expected = (model[0](x) > 0).numpy()  # dropout off: pattern of the eval-mode network
    np.testing.assert_array_equal(a[0].unpack(), expected)


def test_patterns_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="activation modules"):
        activation_patterns(nn.Linear(3, 2), torch.randn(4, 3))
    with pytest.raises(ValueError, match="finite"):
        activation_patterns(mlp(0), np.full((2, 64), np.nan, dtype=np.float32))
    with pytest.raises(ValueError, match="batch_size"):
        activation_patterns(mlp(0), np.zeros((2, 64), dtype=np.float32), batch_size=0)
    with pytest.raises(TypeError, match="model"):
        activation_patterns("not a model", np.zeros((2, 64)))  # type: ignore[arg-type]


def test_sample_probe_is_seeded_and_without_replacement(digits: np.ndarray) -> None:
    p1, i1 = sample_probe(digits, 100, seed=7)
    p2, i2 = sample_probe(digits, 100, seed=7)
    np.testing.assert_array_equal(i1, i2)
    assert len(set(i1.tolist())) == 100
    np.testing.assert_array_equal(p1, digits[i1])
    assert probe_digest(p1) == probe_digest(p2)
    assert probe_digest(p1) != probe_digest(sample_probe(digits, 100, seed=8)[0])
    with pytest.raises(ValueError, match="n_probe"):
        sample_probe(digits, len(digits) + 1, seed=0)


# --------------------------------------------------------------------------- divergences


def _base_affinity(p: int = 4) -> np.ndarray:
    k = np.full((p, p), 0.5)
    np.fill_diagonal(k, 1.0)
    return k


def _set_pair(k: np.ndarray, i: int, j: int, v: float) -> None:
    k[i, j] = k[j, i] = v


def hand_example() -> tuple[list[np.ndarray], list[np.ndarray]]:
    """P = 4, three layers with d = (0.25, 0.5, 0.125), worked out by hand:

    layer 1: pairs (0,1), (2,3) change by 0.5 -> ||diff||_F^2 = 4 * 0.25 = 1 -> d1 = 1/4
    layer 2: pairs (0,1), (0,2) change by 1.0 -> ||diff||_F^2 = 4 * 1 = 4 -> d2 = 2/4
    layer 3: pairs (1,2), (1,3) change by 0.25 -> ||diff||_F^2 = 4/16 -> d3 = 0.5/4
    """
    a = [_base_affinity() for _ in range(3)]
    b = [_base_affinity() for _ in range(3)]
    _set_pair(b[0], 0, 1, 1.0)
    _set_pair(b[0], 2, 3, 1.0)
    for i, j in [(0, 1), (0, 2)]:
        _set_pair(a[1], i, j, 0.0)
        _set_pair(b[1], i, j, 1.0)
    _set_pair(b[2], 1, 2, 0.75)
    _set_pair(b[2], 1, 3, 0.75)
    return a, b


def test_layer_divergence_hand_values() -> None:
    a, b = hand_example()
    assert [layer_divergence(x, y) for x, y in zip(a, b, strict=True)] == [0.25, 0.5, 0.125]


def test_hierarchical_divergence_hand_computed_three_layers() -> None:
    a, b = hand_example()
    # beta = 2: lambda_1 = exp(-0.5), lambda_2 = exp(-1)
    # D = 0.25 + exp(-0.5) * 0.5 + exp(-0.5) * exp(-1) * 0.125
    #   = 0.25 + 0.30326532985631671 + 0.02789127001..  = 0.58115659987..
    expected = 0.25 + 0.5 * math.exp(-0.5) + 0.125 * math.exp(-1.5)
    assert hierarchical_divergence(a, b, beta=2.0) == pytest.approx(expected, rel=1e-14)
    assert hierarchical_divergence(a, b, beta=2.0) == pytest.approx(0.5811565998, abs=1e-9)
    # symmetric in its arguments
    assert hierarchical_divergence(b, a, beta=2.0) == pytest.approx(expected, rel=1e-14)


def test_hierarchical_divergence_beta_zero_is_plain_sum() -> None:
    a, b = hand_example()
    assert hierarchical_divergence(a, b, beta=0.0) == pytest.approx(0.875, rel=1e-15)
    assert hierarchical_divergence(a, b, beta=0) == combine_layer_divergences(
        [0.25, 0.5, 0.125], beta=0.0
    )


def test_hierarchical_divergence_one_layer_is_d1() -> None:
    a, b = hand_example()
    for beta in (0.0, 1.0, 50.0):
        assert hierarchical_divergence(a[1:2], b[1:2], beta=beta) == 0.5


def test_larger_beta_discounts_deeper_layers() -> None:
    a, b = hand_example()
    values = [hierarchical_divergence(a, b, beta=beta) for beta in (0.0, 1.0, 4.0, 1e6)]
    assert values == sorted(values, reverse=True)
    assert values[-1] == pytest.approx(0.25, abs=1e-12)


def test_hierarchical_divergence_validates_input() -> None:
    a, b = hand_example()
    with pytest.raises(ValueError, match="same number of layers"):
        hierarchical_divergence(a, b[:2], beta=1.0)
    with pytest.raises(ValueError, match="at least one layer"):
        hierarchical_divergence([], [], beta=1.0)
    with pytest.raises(ValueError, match="beta"):
        hierarchical_divergence(a, b, beta=-0.1)
    with pytest.raises(ValueError, match="beta"):
        hierarchical_divergence(a, b, beta=math.inf)
    with pytest.raises(ValueError, match=r"differ in shape"):
        hierarchical_divergence(a, [b[0], _base_affinity(5), b[2]], beta=1.0)
    bad = [k.copy() for k in b]
    bad[2][0, 1] = np.nan
    with pytest.raises(ValueError, match=r"affinities_b\[2\] must be finite"):
        hierarchical_divergence(a, bad, beta=1.0)
    with pytest.raises(ValueError, match="square"):
        hierarchical_divergence([np.ones((2, 3))], [np.ones((2, 3))], beta=1.0)


def test_layer_divergence_invariant_to_probe_duplication_and_permutation() -> None:
    x = np.random.default_rng(8).normal(size=(50, 64)).astype(np.float32)
    m_a, m_b = mlp(10), mlp(11)

    def d(probe: np.ndarray) -> list[float]:
        ka = affinities(activation_patterns(m_a, probe))
        kb = affinities(activation_patterns(m_b, probe))
        return [layer_divergence(p, q) for p, q in zip(ka, kb, strict=True)]

    base = d(x)
    assert all(v > 0.05 for v in base)
    np.testing.assert_allclose(d(np.concatenate([x, x])), base, rtol=1e-12)
    np.testing.assert_allclose(d(x[np.random.default_rng(9).permutation(50)]), base, rtol=1e-12)


def test_layer_divergence_probe_size_invariant_in_expectation() -> None:
    """d**2 * P / (P - 1) estimates the same mean over distinct pairs at P = 32 and P = 1024."""
    rng = np.random.default_rng(12)
    m_a, m_b = mlp(20, (64, 48, 10)), mlp(21, (64, 48, 10))

    def d2_unbiased(p: int) -> float:
        probe = rng.normal(size=(p, 64)).astype(np.float32)
        ka = affinity(activation_patterns(m_a, probe)[0])
        kb = affinity(activation_patterns(m_b, probe)[0])
        return layer_divergence(ka, kb) ** 2 * p / (p - 1)

    small = np.array([d2_unbiased(32) for _ in range(60)])
    large = np.array([d2_unbiased(1024) for _ in range(3)])
    se = math.sqrt(small.var(ddof=1) / small.size + large.var(ddof=1) / large.size)
    assert abs(small.mean() - large.mean()) < 4 * se
    assert se < 0.05 * large.mean()  # the comparison is informative
    # the unnormalised Frobenius norm, by contrast, grows about linearly with P
    assert math.sqrt(large.mean()) * 1024 > 20 * math.sqrt(small.mean()) * 32


# --------------------------------------------------------------------------- robust z


def test_robust_z_matches_numpy_and_scipy() -> None:
    x = np.random.default_rng(13).standard_t(df=3, size=15)
    expected = (x - np.median(x)) / stats.median_abs_deviation(x, scale="normal")
    np.testing.assert_allclose(robust_z(x), expected, rtol=1e-13)
    raw_mad = np.median(np.abs(x - np.median(x)))
    np.testing.assert_allclose(robust_z(x), (x - np.median(x)) / (1.4826 * raw_mad), rtol=2e-6)
    st = robust_z_stats(x)
    assert st.rule == "mad" and st.mad == pytest.approx(raw_mad, rel=1e-15)
    assert st.scale == pytest.approx(1.482602218505602 * raw_mad, rel=1e-12)


def test_robust_z_mad_zero_falls_back_to_mean_absolute_deviation() -> None:
    x = [1.0, 1.0, 1.0, 1.0, 5.0]  # median 1, MAD 0, mean |x - 1| = 0.8
    st = robust_z_stats(x)
    assert st.rule == "mean_absolute_deviation" and st.mad == 0.0
    assert st.scale == pytest.approx(math.sqrt(math.pi / 2) * 0.8, rel=1e-15)
    np.testing.assert_allclose(st.z, [0, 0, 0, 0, 4.0 / (1.2533141373155 * 0.8)], rtol=1e-12)


def test_robust_z_all_equal_is_zero() -> None:
    st = robust_z_stats([2.5, 2.5, 2.5, 2.5])
    assert st.rule == "constant"
    np.testing.assert_array_equal(st.z, np.zeros(4))


def test_robust_z_fewer_than_three_clients_is_nan() -> None:
    for x in ([1.0, 9.0], [3.0]):
        st = robust_z_stats(x)
        assert st.rule == "too_few_clients" and np.isnan(st.z).all() and st.z.size == len(x)
    assert robust_z([]).shape == (0,)
    report = parameter_baseline(np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32))
    assert report.flagged == [] and math.isnan(report.max_z)
    assert report.to_dict()["max_z"] is None


def test_robust_z_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="finite"):
        robust_z([1.0, np.nan, 2.0])
    with pytest.raises(ValueError, match="1-D"):
        robust_z(np.ones((3, 2)))
    with pytest.raises(TypeError, match="real"):
        robust_z(["a", "b", "c"])


# --------------------------------------------------------------------------- scorers


def perturbed_copy(model: nn.Module, scale: float, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    copy = mlp(0)
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return copy


def test_scorer_flags_client_with_rerandomised_first_layer(digits: np.ndarray) -> None:
    probe, _ = sample_probe(digits, 256, seed=14)
    global_model = mlp(0)
    clients: dict[int | str, nn.Module] = {
        i: perturbed_copy(global_model, 1e-3, seed=100 + i) for i in range(9)
    }
    odd = perturbed_copy(global_model, 1e-3, seed=200)
    torch.manual_seed(999)
    odd[0].reset_parameters()
    clients["odd"] = odd
    scorer = RepresentationScorer(probe, beta=1.0, z_threshold=3.0)
    report = scorer.score(global_model, clients)
    assert report.method == "representation"
    others_z = [abs(v) for c, v in report.z.items() if c != "odd"]
    assert report.max_z == report.z["odd"] > 20 * max(others_z)
    assert "odd" in report.flagged
    assert report.scores["odd"] > 4 * max(v for c, v in report.scores.items() if c != "odd")
    # With 9 near-identical copies the MAD is itself a noisy scale: one copy reaches z ~ 3.5
    # here, so at the default threshold 3 it is flagged too; at 10 only "odd" is.
    strict = RepresentationScorer(probe, beta=1.0, z_threshold=10.0).score(global_model, clients)
    assert strict.flagged == ["odd"]
    # scores are the documented combination of the per-layer divergences
    for c, d in report.layer_divergences.items():
        assert report.scores[c] == pytest.approx(combine_layer_divergences(d, beta=1.0))
    json.dumps(report.to_dict(), allow_nan=False)
    assert report.to_dict()["flagged"] == [str(c) for c in report.flagged]
    assert report.to_dict()["z"]["odd"] == report.z["odd"]


def test_scorer_accepts_parameter_vectors_with_model_factory(digits: np.ndarray) -> None:
    probe, _ = sample_probe(digits, 64, seed=15)
    g = mlp(0)
    models = {i: perturbed_copy(g, 0.05, seed=i) for i in range(4)}
    vec = {
        i: nn.utils.parameters_to_vector(m.parameters()).detach().numpy()
        for i, m in models.items()
    }
    by_module = RepresentationScorer(probe).score(g, models)
    with pytest.raises(TypeError, match="model_factory"):
        RepresentationScorer(probe).score(g, vec)
    scorer = RepresentationScorer(probe, model_factory=lambda: mlp(1))
    g_vec = nn.utils.parameters_to_vector(g.parameters()).detach().numpy()
    by_vector = scorer.score(g_vec, vec)
    assert by_vector.scores == pytest.approx(by_module.scores, rel=1e-12)
    with pytest.raises(ValueError, match="n_params"):
        scorer.score(g, {0: np.zeros(5, dtype=np.float32)})


def test_scorer_rejects_mismatched_architecture_and_bad_settings(digits: np.ndarray) -> None:
    probe = digits[:32]
    scorer = RepresentationScorer(probe)
    with pytest.raises(ValueError, match="ReLU layers"):
        scorer.score(mlp(0), {0: mlp(1, (64, 32, 10))})
    with pytest.raises(ValueError, match="beta"):
        RepresentationScorer(probe, beta=-1.0)
    with pytest.raises(ValueError, match="z_threshold"):
        RepresentationScorer(probe, z_threshold=math.nan)
    with pytest.raises(ValueError, match="extra"):
        DivergenceConfig(beta=1.0, gamma=2.0)  # type: ignore[call-arg]
    cfg = DivergenceConfig(beta=0.5, z_threshold=2.0, batch_size=8)
    s = RepresentationScorer.from_config(probe, cfg)
    assert s.config == cfg and s.n_probe == 32


# --------------------------------------------------------------------------- baseline


def test_cosine_distance_matches_scipy() -> None:
    u = np.random.default_rng(16).normal(size=(7, 50)).astype(np.float32)
    mean = u.astype(np.float64).mean(axis=0)
    expected = [distance.cosine(row.astype(np.float64), mean) for row in u]
    np.testing.assert_allclose(cosine_distance_to_mean(u), expected, rtol=1e-10, atol=1e-12)
    w = np.arange(1.0, 8.0)
    wmean = (w[:, None] * u.astype(np.float64)).sum(axis=0) / w.sum()
    expected_w = [distance.cosine(row.astype(np.float64), wmean) for row in u]
    np.testing.assert_allclose(cosine_distance_to_mean(u, weights=w), expected_w, rtol=1e-10)
    loo = [
        distance.cosine(u[i].astype(np.float64), np.delete(u, i, axis=0).astype(np.float64).mean(0))
        for i in range(7)
    ]
    np.testing.assert_allclose(cosine_distance_to_mean(u, leave_one_out=True), loo, rtol=1e-10)


def test_cosine_distance_zero_update_is_one() -> None:
    u = np.array([[0.0, 0.0], [1.0, 0.0], [2.0, 0.0]], dtype=np.float32)
    np.testing.assert_allclose(cosine_distance_to_mean(u), [1.0, 0.0, 0.0], atol=1e-15)
    opposite = np.array([[1.0, 0.0], [-1.0, 0.0]], dtype=np.float32)
    np.testing.assert_array_equal(cosine_distance_to_mean(opposite), [1.0, 1.0])


def test_parameter_baseline_flags_opposite_update() -> None:
    rng = np.random.default_rng(17)
    direction = rng.normal(size=200)
    updates = (direction + 0.3 * rng.normal(size=(10, 200))).astype(np.float32)
    updates[6] = -updates[6]
    ids = [f"c{i}" for i in range(10)]
    report = parameter_baseline(updates, ids, z_threshold=3.0)
    assert report.method == "parameter_cosine" and report.flagged == ["c6"]
    dist = cosine_distance_to_mean(updates)
    np.testing.assert_allclose([report.scores[c] for c in ids], dist, rtol=1e-15)
    np.testing.assert_allclose([report.z[c] for c in ids], robust_z(dist), rtol=1e-15)
    assert report.median == pytest.approx(float(np.median(dist)), rel=1e-15)
    assert report.max_z == pytest.approx(float(robust_z(dist).max()), rel=1e-15)
    assert isinstance(report, DivergenceReport)
    json.dumps(report.to_dict(), allow_nan=False)


def test_parameter_baseline_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="2-D"):
        parameter_baseline(np.zeros(5, dtype=np.float32))
    with pytest.raises(ValueError, match="finite"):
        parameter_baseline(np.array([[np.inf, 0.0]] * 3, dtype=np.float32))
    with pytest.raises(ValueError, match="distinct"):
        parameter_baseline(np.ones((3, 2), dtype=np.float32), ["a", "a", "b"])
    with pytest.raises(ValueError, match="one id per row"):
        parameter_baseline(np.ones((3, 2), dtype=np.float32), ["a", "b"])
    with pytest.raises(ValueError, match="weights"):
        parameter_baseline(np.ones((3, 2), dtype=np.float32), weights=[-1.0, 1.0, 1.0])
    with pytest.raises(TypeError, match="floating"):
        parameter_baseline(np.ones((3, 2), dtype=np.int64))


# ------------------------------------------------------------------ flags (clma.divergence.flags)


def test_two_sided_flag_is_abs_z_strictly_above_threshold():
    from clma.divergence import one_sided_flags, two_sided_flags

    z = {0: 3.0, 1: -3.0, 2: 3.0001, 3: -3.0001, 4: 2.9999, 5: -2.9999, 6: float("nan"),
         7: -6.11}
    # at the threshold: not flagged (strict); just above |z|: flagged; below: not
    assert two_sided_flags(z, 3.0) == [2, 3, 7]
    assert one_sided_flags(z, 3.0) == [2]
    assert two_sided_flags(z, 6.11) == []
    assert two_sided_flags(z, 6.10) == [7]
    with pytest.raises(ValueError, match="z_threshold"):
        two_sided_flags(z, 0.0)


def test_ewma_step_is_the_literal_recursion():
    from clma.divergence import ewma_step

    # s_t = lam * clip(z_t, -c, c) + (1 - lam) * s_{t-1}, by hand
    assert ewma_step(0.0, 3.0, lam=0.3, clip=5.0) == pytest.approx(0.9)
    assert ewma_step(0.9, 3.0, lam=0.3, clip=5.0) == pytest.approx(0.3 * 3 + 0.7 * 0.9)
    assert ewma_step(1.0, 20.0, lam=0.3, clip=5.0) == pytest.approx(0.3 * 5 + 0.7)
    assert ewma_step(1.0, -20.0, lam=0.3, clip=5.0) == pytest.approx(-1.5 + 0.7)
    assert ewma_step(2.0, 7.0, lam=1.0, clip=5.0) == 5.0
    for bad in ({"lam": 0.0}, {"lam": 1.1}, {"clip": -1.0}):
        with pytest.raises(ValueError):
            ewma_step(0.0, 1.0, **bad)
    with pytest.raises(ValueError, match="finite"):
        ewma_step(float("nan"), 1.0)


def test_persistence_ewma_over_rounds_is_the_literal_recursion():
    from clma.divergence import update_persistence

    lam, clip = 0.3, 5.0
    traces = {0: [3.0, 3.0, 3.0, 3.0], 1: [20.0, 0.0, 0.0, 0.0], 2: [-3.0] * 4,
              3: [0.5, -0.5, 0.5, -0.5]}
    state: dict[int, float] = {}
    by_hand = dict.fromkeys(traces, 0.0)
    for t in range(4):
        z = {c: v[t] for c, v in traces.items()}
        state = update_persistence(state, z, lam=lam, clip=clip)
        for c in traces:
            by_hand[c] = lam * max(-clip, min(clip, traces[c][t])) + (1 - lam) * by_hand[c]
        assert state == pytest.approx(by_hand)
    # constant z = 3: s_4 = 3 (1 - 0.7^4) = 2.2797; one spike of 20 clipped: 5 * 0.3 * 0.7^3
    assert state[0] == pytest.approx(3 * (1 - 0.7 ** 4))
    assert state[1] == pytest.approx(1.5 * 0.7 ** 3)
    assert state[2] == pytest.approx(-state[0])
    # the default clip is 3: a spike of 1e6 adds 0.3 * 3
    assert update_persistence({}, {9: 1e6}) == {9: pytest.approx(0.9)}
    # absent clients and NaN z keep their state; new clients start at 0
    nxt = update_persistence(state, {0: float("nan"), 5: 1.0}, lam=lam, clip=clip)
    assert nxt[0] == state[0] and nxt[5] == pytest.approx(0.3) and nxt[3] == state[3]


def test_persistence_z_is_the_robust_z_of_the_ewma_across_clients():
    from scipy import stats

    from clma.divergence import persistence_z

    state = {0: 2.6, 1: 0.3, 2: -0.2, 3: 0.1, 4: -0.4, 5: 0.0, 9: 7.0}
    clients = [0, 1, 2, 3, 4, 5]  # client 9 is not in this round
    s = np.array([state[c] for c in clients])
    want = (s - np.median(s)) / stats.median_abs_deviation(s, scale="normal")
    got = persistence_z(state, clients)
    assert list(got) == clients
    assert [got[c] for c in clients] == pytest.approx(list(want), abs=1e-12)
    # a round's client without state counts as s = 0; with fewer than 3 clients: NaN
    assert persistence_z(state, [0, 1, 42])[42] == pytest.approx(
        (0.0 - 0.3) / stats.median_abs_deviation([2.6, 0.3, 0.0], scale="normal"))
    assert all(math.isnan(v) for v in persistence_z(state, [0, 1]).values())


def test_persistent_flag_needs_both_thresholds_at_below_and_above():
    from clma.divergence import flag_clients, persistence_z, persistent_flags

    state = {0: 2.6, 1: 0.3, 2: -0.2, 3: 0.1, 4: -0.4, 5: 0.0, 6: -2.9}
    zs = persistence_z(state)
    s0, z0 = state[0], zs[0]
    assert s0 > 2.0 and z0 > 3.0  # client 0: above both defaults
    assert zs[6] < -3.0 and state[6] < -2.0  # client 6: below both, two-sided
    assert persistent_flags(state, 2.0, 3.0) == [0, 6]
    # at either threshold: not flagged (strict); just below it: flagged
    assert 0 not in persistent_flags(state, s0, 3.0)
    assert 0 in persistent_flags(state, s0 - 1e-9, 3.0)
    assert 0 not in persistent_flags(state, 2.0, z0)
    assert 0 in persistent_flags(state, 2.0, z0 - 1e-9)
    # only the round's clients are standardised and flagged
    assert persistent_flags(state, 2.0, 3.0, clients=[0, 1, 2, 3, 4, 5]) == [0]
    assert flag_clients("persistent", dict.fromkeys(range(6), 0.0), state, z_threshold=3.0,
                        persistence_threshold=2.0) == [0]
    # every s shifted by 10: client 0 is still the only one standing out
    shifted_all = {c: v + 10.0 for c, v in state.items() if c != 6}
    assert persistent_flags(shifted_all, 2.0, 3.0) == [0]
    # large |s| alike everywhere: nobody stands out, nobody is flagged (relative condition)
    alike = {c: 3.0 + 0.1 * c for c in range(6)}
    assert persistent_flags(alike, 2.0, 3.0) == []
    # an outlier among tiny s, below the absolute threshold: not flagged
    tiny = {c: v / 10 for c, v in state.items()}
    assert abs(persistence_z(tiny)[0] - z0) < 1e-9 and persistent_flags(tiny, 2.0, 3.0) == []
    # fewer than 3 clients: no robust z, nobody flagged
    assert persistent_flags({0: 9.0, 1: 0.0}, 2.0, 3.0) == []
    for bad in ({"persistence_threshold": 0.0}, {"z_threshold": -1.0}):
        kw = {"persistence_threshold": 2.0, "z_threshold": 3.0, **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            persistent_flags(state, **kw)
    with pytest.raises(ValueError, match="divergence.flag"):
        flag_clients("both", {}, {}, z_threshold=3.0, persistence_threshold=2.0)


def test_persistent_flag_at_the_defaults_needs_four_rounds_at_the_clip():
    """lam 0.3, clip 3, |s| > 2: from s = 0, three rounds at |z| >= 3 give 3 (1 - 0.7^3) =
    1.971 (not flagged), four give 2.280 (flagged, the others' s staying near 0)."""
    from clma.config import DivergenceConfig
    from clma.divergence import flag_clients, update_persistence

    cfg = DivergenceConfig()
    assert (cfg.persistence_lambda, cfg.persistence_clip, cfg.persistence_threshold,
            cfg.z_threshold) == (0.3, 3.0, 2.0, 3.0)
    others = [0.4, -0.3, 0.2, -0.1, 0.0, 0.3, -0.2, 0.1, -0.4]
    state: dict[int, float] = {}
    flagged = []
    for t in range(5):
        z = {0: 50.0, **{c + 1: v * (-1) ** t for c, v in enumerate(others)}}
        state = update_persistence(state, z, lam=cfg.persistence_lambda,
                                   clip=cfg.persistence_clip)
        flagged.append(flag_clients("persistent", z, state, z_threshold=cfg.z_threshold,
                                    persistence_threshold=cfg.persistence_threshold))
        assert state[0] == pytest.approx(3.0 * (1 - 0.7 ** (t + 1)))
    assert flagged == [[], [], [], [0], [0]]
