"""A device's model and data for the ClientApp: :class:`TorchLearner` over a user's torch
model factory and data loaders (a SuperNode's node config ``data-source`` builds one,
:mod:`clma.flower.device_data`; the built-in demo's digits clients are
:func:`clma.sim.demo.digits_learner`).

:class:`TorchLearner` implements :class:`clma.device.LocalLearner`. Models travel as the
float32 vector of the model's full state (``clma.params.AllParams``: parameters and
buffers in ``state_dict`` order), the layout of the server's initial model. ``fit``:

1. the received model's mean loss on the current training data, before training
   (``pre_loss_loader``, default the training loader; example-weighted mean over its
   batches) -- it feeds the on-device drift detector and never leaves the device; when
   the round's detector reads inputs (``drift.detector = "input_ks"``), the inputs of that
   pass, concatenated as float32 numpy, are ``LocalFit.inputs`` (tensors, on the device
   only; otherwise None, so a loss-only detector costs no copy);
2. ``local_epochs`` passes of plain minibatch SGD (``learning_rate``) over the training
   loader, one optimizer step per batch.

Loaders are iterables of ``(inputs, labels)`` tensor batches (a ``torch`` ``DataLoader``)
or callables ``round_number -> iterable`` (data that change with the round: a drifting
stream, a fresh sample per round), asked once per ``fit`` and iterated once per epoch. The batch size is the loader's (the federation's
``training.batch_size`` is passed to :func:`digits_learner`'s loaders).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from clma.device import LocalFit
from clma.engine.clients import TrainSettings

__all__ = ["SeededBatches", "TorchLearner"]

Loader = Iterable[Any] | Callable[[int], Iterable[Any]]


def _batches(loader: Loader, round_number: int) -> Iterable[Any]:
    if callable(loader) and not hasattr(loader, "__iter__"):
        return loader(round_number)
    return loader


class TorchLearner:
    """A :class:`clma.device.LocalLearner` over a torch model and data loaders.

    Args:
        model_fn: builds a fresh ``torch.nn.Module`` of the federation's architecture
            (its weights are overwritten by the received vector).
        train_loader: training batches ``(x, y)`` (or ``round -> batches``).
        eval_loader: local evaluation batches (or ``round -> batches``).
        pre_loss_loader: batches for the pre-training loss (default ``train_loader``).
        loss_fn: ``(logits, labels) -> mean loss`` (default cross-entropy).
    """

    def __init__(self, model_fn: Callable[[], Any], train_loader: Loader, eval_loader: Loader,
                 *, pre_loss_loader: Loader | None = None,
                 loss_fn: Callable[[Any, Any], Any] | None = None) -> None:
        self.model_fn = model_fn
        self.train_loader = train_loader
        self.eval_loader = eval_loader
        self.pre_loss_loader = pre_loss_loader if pre_loss_loader is not None else train_loader
        self.loss_fn = loss_fn

    def _model(self, params: np.ndarray) -> Any:
        from clma.params import AllParams, vector_to_model

        model = self.model_fn()
        vector_to_model(np.asarray(params, dtype=np.float32), model, AllParams())
        return model

    def _loss(self, logits: Any, labels: Any) -> Any:
        if self.loss_fn is not None:
            return self.loss_fn(logits, labels)
        from torch import nn

        return nn.functional.cross_entropy(logits, labels)

    def fit(self, params: np.ndarray, settings: TrainSettings, round_number: int) -> LocalFit:
        import torch

        from clma.params import AllParams, model_to_vector

        model = self._model(params)
        model.eval()
        losses, sizes, inputs = [], [], []
        keep_inputs = settings.detector.needs_inputs
        with torch.no_grad():
            for x, y in _batches(self.pre_loss_loader, round_number):
                losses.append(float(self._loss(model(x), y).item()))
                sizes.append(int(y.shape[0]))
                if keep_inputs:
                    inputs.append(x.detach().cpu().numpy().astype(np.float32, copy=False))
        n_pre = sum(sizes)
        if n_pre == 0:
            raise ValueError("pre_loss_loader: yielded no example (a client needs training data)")
        pre = losses[0] if len(losses) == 1 else float(np.dot(losses, sizes) / n_pre)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=settings.learning_rate)
        n = 0
        batches = _batches(self.train_loader, round_number)  # once per fit; one pass per epoch
        for epoch in range(settings.local_epochs):
            seen = 0
            for x, y in batches:
                opt.zero_grad(set_to_none=True)
                self._loss(model(x), y).backward()
                opt.step()
                seen += int(y.shape[0])
            if epoch == 0:
                n = seen
        if n == 0:
            raise ValueError("train_loader: yielded no example (a client needs training data)")
        return LocalFit(model_to_vector(model, AllParams()), pre, n,
                        inputs=np.concatenate(inputs) if keep_inputs else None)

    def predict(self, params: np.ndarray, round_number: int) -> tuple[np.ndarray, np.ndarray]:
        return self._predict(params, round_number, self.eval_loader, "eval_loader")

    def predict_training(self, params: np.ndarray, round_number: int
                         ) -> tuple[np.ndarray, np.ndarray]:
        """As :meth:`predict`, on the training batches of the pre-training loss
        (``pre_loss_loader``): :func:`clma.device.choose_cohort` scores all local records."""
        return self._predict(params, round_number, self.pre_loss_loader, "pre_loss_loader")

    def _predict(self, params: np.ndarray, round_number: int, loader: Loader, name: str
                 ) -> tuple[np.ndarray, np.ndarray]:
        import torch

        model = self._model(params)
        model.eval()
        probs, labels = [], []
        with torch.no_grad():
            for x, y in _batches(loader, round_number):
                probs.append(torch.softmax(model(x), dim=1).double().numpy())
                labels.append(np.asarray(y, dtype=np.int64))
        if not probs:
            raise ValueError(f"{name}: yielded no example")
        return np.concatenate(probs), np.concatenate(labels)


class SeededBatches:
    """Minibatches of ``(x, y)`` in a fresh seeded order at every pass (an epoch):
    ``rng.permutation(n)`` then consecutive slices of ``batch_size`` -- the simulation's
    order (:func:`clma.sim.training.local_train`), so training is bit-identical to it."""

    def __init__(self, x: Any, y: Any, batch_size: int, rng: np.random.Generator) -> None:
        self.x, self.y, self.batch_size, self.rng = x, y, int(batch_size), rng

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        import torch

        n = int(self.y.shape[0])
        order = torch.from_numpy(self.rng.permutation(n))
        for start in range(0, n, self.batch_size):
            idx = order[start:start + self.batch_size]
            yield self.x[idx], self.y[idx]
