"""A device's model and data for the ClientApp: :class:`TorchLearner` over a user's torch
model factory and data loaders (a SuperNode's node config ``data-source`` builds one,
:mod:`clma.flower.device_data`), and :func:`digits_learner`, the simulated digits clients
of the built-in demo as one use of it.

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

__all__ = ["SeededBatches", "TorchLearner", "digits_learner", "simulated_client"]

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
        import torch

        model = self._model(params)
        model.eval()
        probs, labels = [], []
        with torch.no_grad():
            for x, y in _batches(self.eval_loader, round_number):
                probs.append(torch.softmax(model(x), dim=1).double().numpy())
                labels.append(np.asarray(y, dtype=np.int64))
        if not probs:
            raise ValueError("eval_loader: yielded no example")
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


def _shard_key(config: Any, partition_id: int) -> str:
    """What a client's shard depends on: the seed, the number of clients and the data and
    model sections (not the drift schedule: drift is applied per round)."""
    import hashlib
    import json

    d = config.model_dump(mode="json")
    doc = {"seed": d["seed"], "clients": d["clients"], "model": d["model"],
           "data": {k: v for k, v in d["data"].items() if k != "region_partition"},
           "client": int(partition_id), "format": 1}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:24]


def _device_view(config: Any, partition_id: int, cache_dir: Any) -> Any:
    """The simulated world as one device sees it: its own shard only (from the device's
    cache when there is one), the architecture and the drift schedule of the config."""
    import os
    from pathlib import Path

    from clma.sim.federation import SimClient, SimulatedFederation, build_federation
    from clma.sim.models import MLPSpec

    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"digits-shard-{_shard_key(config, partition_id)}.npz"
        if path.exists():
            try:
                with np.load(path, allow_pickle=False) as z:
                    cl = SimClient(int(partition_id), "-", z["train_x"], z["train_y"],
                                   z["eval_x"], z["eval_y"], int(z["n_classes"]))
                    spec = MLPSpec(int(z["n_features"]), tuple(config.model.hidden),
                                   int(z["n_classes"]))
                    name = str(z["dataset"])
                return SimulatedFederation(config, spec, {cl.client_id: cl}, None, None, None,
                                           None, None, None, name)
            except (OSError, ValueError, KeyError):
                pass  # a torn cache file: build it again
    fed = build_federation(config)
    if partition_id not in fed.clients:
        raise ValueError(f"partition-id: must be in [0, {config.clients}) for this federation")
    cl = fed.clients[partition_id]
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            np.savez(f, train_x=cl.train_x, train_y=cl.train_y, eval_x=cl.eval_x,
                     eval_y=cl.eval_y, n_classes=cl.n_classes,
                     n_features=fed.spec.n_features, dataset=fed.dataset_name)
        os.replace(tmp, path)
    return SimulatedFederation(config, fed.spec, {partition_id: cl}, None, None, None, None,
                               None, None, fed.dataset_name)


def simulated_client(config: Any, partition_id: Any, cache_dir: Any = None) -> Any:
    """The simulated client ``partition_id`` of ``config``'s federation as the device sees it
    (:class:`clma.sim.clients.SimLearner` over its own shard only; the shard kept in
    ``cache_dir`` as ``.npz`` when given).

    Raises:
        ValueError: ``partition_id`` is not a client of the federation.
    """
    from clma.sim.clients import SimLearner

    if isinstance(partition_id, bool) or not isinstance(partition_id, int) or not (
            0 <= partition_id < config.clients):
        raise ValueError(f"partition-id: must be in [0, {config.clients}) for this federation")
    fed = _device_view(config, int(partition_id), cache_dir)
    return SimLearner(fed, fed.clients[int(partition_id)])


def digits_learner(config: Any, partition_id: int, cache_dir: Any = None) -> TorchLearner:
    """The simulated client ``partition_id`` of ``config``'s federation (its data shard,
    drifted by the config's schedule as of the round asked) as a :class:`TorchLearner`:
    the built-in demo's data source (:func:`clma.flower.demo.simulated_shard`) under the
    ClientApp's learner (:func:`clma.flower.device_data.device_learner`), bit-identical to
    the in-process simulation's client (:class:`clma.sim.clients.SimLearner`).

    ``cache_dir``: the device's own folder; its shard is kept there (``.npz``) so later
    messages skip building the data set (a ClientApp process starts for every message).

    Raises:
        ValueError: ``partition_id`` is not a client of the federation.
    """
    from clma.flower.demo import simulated_shard
    from clma.flower.device_data import DeviceData, device_learner
    from clma.models.checks import model_spec_of

    node = {"partition-id": int(partition_id)}
    if cache_dir is not None:
        node["state-dir"] = str(cache_dir)
    parts = simulated_shard(node, config)
    spec = model_spec_of(config)
    return device_learner(spec.build, DeviceData(parts["train"], parts["eval"]),
                          seed=config.seed, partition_id=int(partition_id),
                          batch_size=config.training.batch_size)
