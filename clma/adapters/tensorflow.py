"""Keras helpers with fed-clma 0.1.1's names and keys, over :mod:`clma.params`.

Works with any Keras 3 model (backend TensorFlow, JAX or PyTorch: ``KERAS_BACKEND``) and
with ``tf.keras`` 2; nothing here imports keras or tensorflow (extra ``tensorflow``:
``keras``; ``clma[tensorflow-cpu]`` adds TensorFlow itself).

Keys are fed-clma's, ``"<index>:<local name>"`` -- ``"0000:kernel"``, ``"0004:moving_mean"``:
the variable's position in ``model.weights`` (4 digits) and the last segment of its path
(Keras 3 ``variable.path``, Keras 2 ``variable.name`` without ``:0``). Keras layer names
carry process-wide counters (``dense``, ``dense_1`` ... for the same architecture built
twice), so they are left out; the same architecture gives the same keys in every process,
and the keys equal fed-clma's (a fed-clma Keras client and one of this package can share a
federation).

Selectors on these keys: :class:`clma.params.DefaultSelector` drops the BatchNormalization
statistics (``moving_mean``, ``moving_variance``) and integer variables;
:class:`clma.params.AllParams` keeps every floating variable; :class:`clma.params.LastLayers`
counts *tensors* here (the keys name no layer: ``LastLayers(2)`` is the last kernel and
bias, as in fed-clma) -- :func:`head_selector` counts the model's layers;
:func:`trainable_selector` reads ``model.trainable_weights`` at each call.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from clma.params import DefaultSelector, ParamSelector

__all__ = ["get_weights", "head_selector", "set_weights", "trainable_selector",
           "variable_names"]


def _local(variable: Any) -> str:
    raw = getattr(variable, "path", None) or getattr(variable, "name", None) or "variable"
    return str(raw).rsplit("/", 1)[-1].split(":", 1)[0]


def variable_names(model: Any) -> list[str]:
    """The key of every variable of ``model.weights``, in that order (module docstring)."""
    return [f"{i:04d}:{_local(v)}" for i, v in enumerate(model.weights)]


def _names_of(model: Any, variables: Iterable[Any]) -> set[str]:
    wanted = {id(v) for v in variables}
    return {n for n, v in zip(variable_names(model), model.weights, strict=True)
            if id(v) in wanted}


def get_weights(model: Any) -> dict[str, np.ndarray]:
    """``model.weights`` as key -> numpy array (a copy, the variable's dtype and shape)."""
    return {n: np.array(v.numpy()) for n, v in zip(variable_names(model), model.weights,
                                                   strict=True)}


def set_weights(model: Any, params: Mapping[str, Any]) -> None:
    """Load ``params`` (key -> array, any order) into ``model``.

    Raises:
        ValueError: the keys are not exactly the model's (names the first missing or
            unexpected key) or an array's shape differs from its variable's.
    """
    names = variable_names(model)
    missing = [n for n in names if n not in params]
    extra = [k for k in params if k not in set(names)]
    if missing or extra:
        what = f"missing {missing[0]!r}" if missing else f"unexpected {extra[0]!r}"
        raise ValueError(f"params: keys must be the model's variable keys ({what})")
    arrays = [np.asarray(params[n]) for n in names]
    for n, a, v in zip(names, arrays, model.weights, strict=True):
        if tuple(a.shape) != tuple(v.shape):
            raise ValueError(f"params[{n!r}]: shape {tuple(a.shape)}, the model's is "
                             f"{tuple(v.shape)}")
    model.set_weights(arrays)


class _KerasNames(ParamSelector):
    """Learnable entries (:class:`DefaultSelector`) whose key is in ``names_fn()``."""

    def __init__(self, names_fn: Any, label: str) -> None:
        self._names_fn = names_fn
        self._label = label

    def select(self, named: Mapping[str, Any]) -> list[str]:
        keep = self._names_fn()
        return [k for k in DefaultSelector().select(named) if k in keep]

    def __repr__(self) -> str:
        return self._label


def trainable_selector(model: Any) -> ParamSelector:
    """The variables in ``model.trainable_weights`` (read at each call, so freezing a layer
    later is picked up), BatchNormalization statistics excluded.

    Raises:
        ValueError: the model has no trainable weights now.
    """
    if not list(model.trainable_weights):
        raise ValueError("model: has no trainable weights")
    return _KerasNames(lambda: _names_of(model, model.trainable_weights),
                       f"trainable_selector({type(model).__name__})")


def head_selector(model: Any, n_layers: int = 1) -> ParamSelector:
    """The learnable variables of the last ``n_layers`` layers that own variables
    (``model.layers`` order; e.g. the classifier head with ``n_layers=1``).

    Raises:
        ValueError: ``n_layers`` not an integer >= 1.
    """
    if isinstance(n_layers, bool) or int(n_layers) != n_layers or n_layers < 1:
        raise ValueError("n_layers: must be an integer >= 1")
    n = int(n_layers)

    def names() -> set[str]:
        owning = [layer for layer in model.layers if list(layer.weights)]
        return _names_of(model, [v for layer in owning[-n:] for v in layer.weights])

    return _KerasNames(names, f"head_selector({type(model).__name__}, {n})")
