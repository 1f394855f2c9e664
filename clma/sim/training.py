"""Local training and evaluation on a simulated device.

Models travel as flat float32 vectors of their full state (``clma.params.AllParams``:
parameters and buffers, in ``state_dict`` order), shape ``(n_params,)``. Training is
plain minibatch SGD on cross-entropy for ``epochs`` epochs; the only randomness (the
minibatch order) comes from the ``numpy.random.Generator`` passed in, so a client's
training is reproducible and independent of thread scheduling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from clma.params import AllParams, model_to_vector, vector_to_model
from clma.sim.models import MLPSpec

__all__ = ["LocalResult", "local_train", "mean_loss", "model_predictor", "predict_proba"]

_FULL = AllParams()


@dataclass(frozen=True)
class LocalResult:
    """Outcome of local training: the new model vector and the pre-training loss.

    ``pre_loss`` (nats) is the received model's mean cross-entropy on the client's current
    training data; it stays on the device (it feeds the drift detector only).
    """

    vector: np.ndarray
    pre_loss: float
    n_samples: int


def _model(spec: MLPSpec, vector: np.ndarray) -> nn.Module:
    model = spec.build()
    vector_to_model(vector, model, _FULL)
    return model


def mean_loss(spec: MLPSpec, vector: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    """Mean cross-entropy (nats) of the model ``vector`` on ``(x, y)``."""
    model = _model(spec, vector)
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
        return float(nn.functional.cross_entropy(logits, torch.from_numpy(y)).item())


def predict_proba(spec: MLPSpec, vector: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Class probabilities ``(n, n_classes)`` float64 of the model ``vector`` on ``x``."""
    return model_predictor(spec, vector)(x)


def model_predictor(spec: MLPSpec, vector: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """:func:`predict_proba` of one model for many inputs: the model is built once.

    The returned function maps ``x`` float32 ``(n, ...)`` to class probabilities
    ``(n, n_classes)`` float64, exactly as ``predict_proba(spec, vector, x)``.
    """
    model = _model(spec, vector)
    model.eval()

    def predict(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return torch.softmax(model(torch.from_numpy(x)), dim=1).double().numpy()

    return predict


def local_train(
    spec: MLPSpec,
    vector: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int,
    learning_rate: float,
    batch_size: int,
    rng: np.random.Generator,
) -> LocalResult:
    """Train the received model ``vector`` on ``(x, y)`` with SGD; return the new vector.

    ``x`` float32 ``(n, c, h, w)``, ``y`` int64 ``(n,)``. Raises ValueError on empty data.
    """
    n = int(y.shape[0])
    if n == 0:
        raise ValueError("a client needs at least one training example")
    model = _model(spec, vector)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    model.eval()
    with torch.no_grad():
        pre_loss = float(nn.functional.cross_entropy(model(xt), yt).item())
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=learning_rate)
    for _ in range(epochs):
        order = torch.from_numpy(rng.permutation(n))
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(xt[idx]), yt[idx])
            loss.backward()
            opt.step()
    return LocalResult(model_to_vector(model, _FULL), pre_loss, n)
