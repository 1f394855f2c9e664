"""A device's own data and model on a Flower SuperNode.

The SuperNode names its data source in its node config::

    flower-supernode ... --node-config "partition-id=3 data-source='mysite.data:local_data'"

and the ClientApp (:func:`clma.flower.clientapp.make_client_app`'s default learner
factory, :func:`device_learner_factory`) calls it on the device: ``local_data(node_config)``
-- or ``local_data(node_config, federation=config)`` when the function has a parameter
named ``federation`` (the run's :class:`clma.config.FederationConfig`, device view: seed,
clients, drift schedule, training) -- and builds a :class:`clma.flower.learner.TorchLearner`
over the model the server names in the run config (``model-spec``: ``[model] factory``,
imported on the device, or the built-in MLP). The data never leave the device.

A data source returns the device's training and evaluation data as a mapping
``{"train": ..., "eval": ...}`` (optionally ``"pre_loss"``), a :class:`DeviceData` or a
pair ``(train, eval)``; each part is one of

* ``(features, labels)`` arrays (numpy or torch): features float32 ``(N, ...)`` finite,
  labels integer ``(N,)`` in ``[0, K)`` for the model's K outputs, N >= 1. Training takes
  minibatches of ``training.batch_size`` in a fresh seeded order every epoch
  (:class:`clma.flower.learner.SeededBatches`, seed ``[seed, round, partition-id, 7]``);
  evaluation and the drift detector's pre-training loss read all of it in one batch;
* a data loader: an iterable of ``(inputs, labels)`` batches (a torch ``DataLoader``),
  iterated once per epoch;
* a callable ``round_number -> either of the above``: data that change with the round (a
  drifting stream, a fresh sample per round).

Refusals name the node config field and the rule (``node config 'data-source': ...``);
the ClientApp answers them with an error reply, which the server records as that node's
failure in that exchange while the other nodes go on. Values are never quoted.

The built-in demo -- the simulated digits client of the node's partition id -- is one such
source: ``data-source='clma.sim.demo:simulated_shard'`` (:mod:`clma.sim.demo`).
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DATA_SOURCE", "DEMO_SOURCE", "DeviceData", "device_learner",
           "device_learner_factory", "device_model_spec", "load_device_data"]

#: The node config key naming the device's data source.
DATA_SOURCE = "data-source"
#: The built-in demo's data source (the simulated digits client of the node).
DEMO_SOURCE = "clma.sim.demo:simulated_shard"
_FIELD = f"node config '{DATA_SOURCE}'"


@dataclass
class DeviceData:
    """A device's data (module docstring): ``train`` and ``eval`` parts, and optionally
    ``pre_loss`` (the batches of the drift detector's pre-training loss; default: all the
    training arrays in one batch, or the training loader)."""

    train: Any
    eval: Any
    pre_loss: Any = None


def _is_array(v: Any) -> bool:
    if isinstance(v, np.ndarray):
        return True
    mod = type(v).__module__
    return mod.startswith("torch") and hasattr(v, "numpy") and hasattr(v, "shape")


def _is_pair(v: Any) -> bool:
    return isinstance(v, tuple | list) and len(v) == 2 and all(_is_array(a) for a in v)


def _check_arrays(v: Any, part: str, model_fn: Callable[[], Any] | None) -> tuple[Any, Any]:
    """``(x, y)`` as torch tensors, checked (module docstring); with ``model_fn``, a
    forward pass of the first two samples through a fresh model must give logits, and the
    labels must be below their width."""
    import torch

    x, y = (a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a))
            for a in v)
    if x.dtype != torch.float32:
        raise ValueError(f"{_FIELD}: '{part}' features must be float32 (got "
                         f"{str(x.dtype).removeprefix('torch.')})")
    if x.ndim < 2:
        raise ValueError(f"{_FIELD}: '{part}' features must have shape (N, ...) with at "
                         f"least one feature axis (got rank {x.ndim})")
    if y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
        raise ValueError(f"{_FIELD}: '{part}' labels must be integers (got "
                         f"{str(y.dtype).removeprefix('torch.')})")
    if tuple(y.shape) != (x.shape[0],):
        raise ValueError(f"{_FIELD}: '{part}' labels must have shape (N,) with N = "
                         f"{x.shape[0]} samples, like the features (got {tuple(y.shape)})")
    if x.shape[0] == 0:
        raise ValueError(f"{_FIELD}: '{part}' has no samples (a device needs at least one)")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{_FIELD}: '{part}' features must be finite (NaN or inf found)")
    if int(y.min()) < 0:
        raise ValueError(f"{_FIELD}: '{part}' labels must be classes 0 .. K - 1 (a label "
                         "is negative)")
    if model_fn is not None:
        from clma.models.checks import check_model_on_features

        model = model_fn()
        check_model_on_features(model, x[:2].numpy(), None, needs_relu=False, field=_FIELD)
        with torch.no_grad():
            width = int(model(x[:1]).shape[1])
        if int(y.max()) >= width:
            raise ValueError(f"{_FIELD}: '{part}' labels must be classes 0 .. {width - 1} of "
                             f"the model's {width} outputs (a label is out of range)")
    return x, y.to(torch.int64)


def load_device_data(path: str, node_config: Mapping[str, Any],
                     federation: Any = None) -> DeviceData:
    """Import and call the data source ``path`` (module docstring) and check the shape of
    what it returns (each part's arrays are checked when first read).

    Raises:
        ValueError: ``node config 'data-source'``: not 'package.module:function', the module
            does not import, the function raises, or it returns no train and eval parts.
    """
    from clma.models.factory import import_callable

    if not isinstance(path, str) or not path:
        raise ValueError(f"{_FIELD}: missing; name the device's data as "
                         f"--node-config \"{DATA_SOURCE}='package.module:function'\" (the "
                         f"built-in demo: {DEMO_SOURCE})")
    fn = import_callable(path, _FIELD)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    try:
        if "federation" in params:
            out = fn(dict(node_config), federation=federation)
        else:
            out = fn(dict(node_config))
    except Exception as exc:  # noqa: BLE001 (user code)
        raise ValueError(f"{_FIELD}: {path!r} raised {type(exc).__name__}: {exc}") from None
    if isinstance(out, DeviceData):
        data = out
    elif isinstance(out, Mapping):
        extra = sorted(set(out) - {"train", "eval", "pre_loss"})
        if "train" not in out or "eval" not in out or extra:
            raise ValueError(f"{_FIELD}: {path!r} must return a mapping with keys 'train' "
                             f"and 'eval' (and optionally 'pre_loss'; got {sorted(out)})")
        data = DeviceData(out["train"], out["eval"], out.get("pre_loss"))
    elif isinstance(out, tuple) and len(out) == 2 and not _is_pair(out):
        data = DeviceData(out[0], out[1])
    else:
        raise ValueError(f"{_FIELD}: {path!r} must return {{'train': ..., 'eval': ...}} or "
                         f"(train, eval), each (features, labels) arrays or a data loader "
                         f"(got {type(out).__name__})")
    for part in ("train", "eval", "pre_loss"):
        v = getattr(data, part)
        if part == "pre_loss" and v is None:
            continue
        if isinstance(v, str | bytes) or not (_is_pair(v) or callable(v)
                                              or isinstance(v, Iterable)):
            raise ValueError(f"{_FIELD}: '{part}' must be (features, labels) arrays, a data "
                             f"loader or a callable round -> either (got {type(v).__name__})")
    return data


class _Part:
    """One part of a device's data as the learner's loader ``round -> batches``."""

    def __init__(self, value: Any, part: str, model_fn: Callable[[], Any]) -> None:
        self.value, self.part, self.model_fn = value, part, model_fn
        self._checked = False
        self._fixed: tuple[Any, Any] | None = None

    def resolve(self, round_number: int) -> Any:
        """The round's ``(x, y)`` tensors (arrays, checked), or its iterable of batches."""
        v = self.value
        if _is_pair(v):
            if self._fixed is None:
                self._fixed = _check_arrays(v, self.part, self.model_fn)
            return self._fixed
        if callable(v) and not hasattr(v, "__iter__"):
            try:
                v = v(round_number)
            except Exception as exc:  # noqa: BLE001 (user code)
                raise ValueError(f"{_FIELD}: '{self.part}' at round {round_number} raised "
                                 f"{type(exc).__name__}: {exc}") from None
            if _is_pair(v):  # the model is checked on the first round's arrays only
                out = _check_arrays(v, self.part, None if self._checked else self.model_fn)
                self._checked = True
                return out
        if isinstance(v, str | bytes) or not isinstance(v, Iterable):
            raise ValueError(f"{_FIELD}: '{self.part}' at round {round_number} gave "
                             f"{type(v).__name__}, not (features, labels) arrays or batches")
        return v


def device_learner(model_fn: Callable[[], Any], data: DeviceData, *, seed: int,
                   partition_id: int, batch_size: int) -> Any:
    """A :class:`clma.flower.learner.TorchLearner` over ``model_fn`` and ``data``
    (module docstring: array parts train in seeded minibatches of ``batch_size``, seed
    ``[seed, round, partition_id, 7]``; loaders as given). Array parts are checked when
    first read, with one forward pass of ``model_fn()`` on two samples (a feature shape
    the model rejects, or labels beyond its outputs, are refused naming the field)."""
    from clma.flower.learner import SeededBatches, TorchLearner

    train = _Part(data.train, "train", model_fn)
    ev = _Part(data.eval, "eval", model_fn)
    pre = _Part(data.pre_loss, "pre_loss", model_fn) if data.pre_loss is not None else None

    def train_loader(r: int) -> Any:
        v = train.resolve(r)
        if isinstance(v, tuple):
            return SeededBatches(v[0], v[1], batch_size,
                                 np.random.default_rng([seed, r, partition_id, 7]))
        return v

    def whole(part: _Part) -> Callable[[int], Any]:
        def at(r: int) -> Any:
            v = part.resolve(r)
            return [v] if isinstance(v, tuple) else v

        return at

    return TorchLearner(model_fn, train_loader=train_loader, eval_loader=whole(ev),
                        pre_loss_loader=whole(pre if pre is not None else train))


def device_model_spec(run_config: Mapping[str, Any], federation: Any) -> Any:
    """The architecture the server named: run config ``model-spec``
    (:func:`clma.models.checks.spec_from_json`); without it, the one of the federation
    config (:func:`clma.models.checks.model_spec_of`).

    Raises:
        ValueError: ``run config 'model-spec'``: not the JSON of a model spec.
    """
    from clma.models.checks import model_spec_of, spec_from_json

    text = run_config.get("model-spec")
    if isinstance(text, str) and text:
        return spec_from_json(text)
    return model_spec_of(federation)


_LEARNERS: dict[tuple[str, ...], Any] = {}
_LEARNERS_LOCK = threading.Lock()


def device_learner_factory(context: Any) -> Any:
    """The ClientApp's default learner (module docstring): the federation config from the
    run config (``config-json``), the model from ``model-spec``, the data from the node
    config's ``data-source``, the client from ``partition-id``; built once per process and
    run config (a simulation reuses its workers).

    Raises:
        clma.flower.clientapp.DeviceRefusal: the run config's federation config is missing
            or invalid, or ``partition-id`` is not an integer >= 0;
        ValueError: ``node config 'data-source'`` or ``model.factory`` / ``run config
            'model-spec'`` (module docstring).
    """
    from clma.config import ConfigError, validate_config
    from clma.flower.clientapp import DeviceRefusal, partition_id_of

    text = context.run_config.get("config-json")
    if not isinstance(text, str) or not text:
        raise DeviceRefusal("run config 'config-json': the federation config is missing")
    try:
        cfg = validate_config(json.loads(text))
    except (ValueError, ConfigError) as exc:
        raise DeviceRefusal(f"run config 'config-json': {exc}") from None
    pid = partition_id_of(context)
    source = context.node_config.get(DATA_SOURCE)
    spec_text = context.run_config.get("model-spec")
    key = (cfg.fingerprint(), str(pid), str(source), str(spec_text),
           json.dumps(dict(context.node_config), sort_keys=True, default=str))
    with _LEARNERS_LOCK:
        hit = _LEARNERS.get(key)
        if hit is None:
            spec = device_model_spec(context.run_config, cfg)
            data = load_device_data(source, context.node_config, federation=cfg)
            hit = _LEARNERS[key] = device_learner(
                lambda: spec.build(), data, seed=cfg.seed, partition_id=pid,
                batch_size=cfg.training.batch_size)
        return hit
