"""clma.sim.models and clma.sim.training: the MLP, local SGD, losses and probabilities."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from clma.params import AllParams, model_to_vector
from clma.sim.models import MLPSpec, make_mlp
from clma.sim.training import local_train, mean_loss, predict_proba

SPEC = MLPSpec(64, (16, 8), 10)


def test_mlp_architecture_and_size():
    m = make_mlp(64, [16, 8], 10)
    kinds = [type(x) for x in m]
    assert kinds == [nn.Flatten, nn.Linear, nn.ReLU, nn.Linear, nn.ReLU, nn.Linear]
    n = sum(p.numel() for p in m.parameters())
    assert n == (64 * 16 + 16) + (16 * 8 + 8) + (8 * 10 + 10)
    v = model_to_vector(m, AllParams())
    assert v.shape == (n,) and v.dtype == np.float32  # no buffers in an MLP
    assert m(torch.zeros(3, 1, 8, 8)).shape == (3, 10)


def test_seeded_init_reproducible_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state().clone()
    a = model_to_vector(SPEC.build(seed=5), AllParams())
    assert torch.equal(torch.get_rng_state(), before)
    b = model_to_vector(SPEC.build(seed=5), AllParams())
    c = model_to_vector(SPEC.build(seed=6), AllParams())
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def _data(n=120, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 10, n).astype(np.int64)
    x = (rng.random((n, 1, 8, 8)) * 0.2).astype(np.float32)
    x[np.arange(n), 0, y % 8, y // 8 * 4] += 0.8  # a learnable pixel per class
    return x, y


def test_local_train_pre_loss_learning_and_reproducibility():
    x, y = _data()
    v0 = model_to_vector(SPEC.build(seed=0), AllParams())
    kw = {"epochs": 20, "learning_rate": 0.5, "batch_size": 16}
    r1 = local_train(SPEC, v0, x, y, rng=np.random.default_rng(1), **kw)
    assert r1.pre_loss == pytest.approx(mean_loss(SPEC, v0, x, y), abs=1e-6)
    assert r1.n_samples == 120
    assert r1.vector.dtype == np.float32 and r1.vector.shape == v0.shape
    after = mean_loss(SPEC, r1.vector, x, y)
    assert after < 0.5 * r1.pre_loss
    r2 = local_train(SPEC, v0, x, y, rng=np.random.default_rng(1), **kw)
    assert r1.vector.tobytes() == r2.vector.tobytes()
    r3 = local_train(SPEC, v0, x, y, rng=np.random.default_rng(2), **kw)
    assert r1.vector.tobytes() != r3.vector.tobytes()
    with pytest.raises(ValueError, match="at least one training example"):
        local_train(SPEC, v0, x[:0], y[:0], rng=np.random.default_rng(1), **kw)


def test_mean_loss_and_predict_proba_match_literal_formulas():
    x, y = _data(30, seed=3)
    v = model_to_vector(SPEC.build(seed=2), AllParams())
    p = predict_proba(SPEC, v, x)
    assert p.shape == (30, 10) and p.dtype == np.float64
    np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-6)
    literal = -np.mean(np.log(p[np.arange(30), y]))
    assert mean_loss(SPEC, v, x, y) == pytest.approx(literal, rel=1e-5)
    # an all-zero model predicts uniformly: loss ln(10)
    zero = np.zeros_like(v)
    np.testing.assert_allclose(predict_proba(SPEC, zero, x), 0.1, atol=1e-7)
    assert mean_loss(SPEC, zero, x, y) == pytest.approx(np.log(10), abs=1e-6)


def test_model_predictor_equals_predict_proba_bitwise():
    from clma.sim.training import model_predictor

    v = model_to_vector(SPEC.build(seed=4), AllParams())
    predict = model_predictor(SPEC, v)  # one model, many inputs (the simulation's truth)
    for seed, n in ((5, 7), (6, 30)):
        x, _ = _data(n, seed=seed)
        assert predict(x).tobytes() == predict_proba(SPEC, v, x).tobytes()
