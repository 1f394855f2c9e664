"""Which tensors of a model take part in CLMA's parameter vector.

:class:`ParamSelector` is the extension point (issue 3, item 1). A selector maps a named
state (``name -> numpy array or torch tensor``, e.g. ``module.state_dict()``) to the ordered
list of names that form the flattened vector; order follows the mapping's order.

On a plain mapping a selector cannot ask torch which entries are buffers, so buffers are
recognised by name and dtype: entries whose last name component is a tracked statistic
(:data:`TRACKED_BUFFER_SUFFIXES`: torch BatchNorm ``running_mean``, ``running_var``,
``num_batches_tracked``; Keras ``moving_mean``, ``moving_variance``) or whose dtype is not
floating. :meth:`ParamSelector.select_module`
uses the module's own registry instead (``named_parameters`` vs buffers), which is exact.
"""

from __future__ import annotations

import fnmatch
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

__all__ = [
    "TRACKED_BUFFER_SUFFIXES",
    "AllParams",
    "DefaultSelector",
    "LastLayers",
    "NameFilter",
    "ParamSelector",
    "TrainableOnly",
    "is_floating",
    "layer_of",
    "requires_grad_selector",
]

#: torch BatchNorm's and Keras BatchNormalization's statistics (``bn.running_mean``,
#: ``0004:moving_mean``: the last component after '.', ':' or '/').
TRACKED_BUFFER_SUFFIXES = frozenset({"running_mean", "running_var", "num_batches_tracked",
                                     "moving_mean", "moving_variance"})


def is_floating(value: Any) -> bool:
    """True if ``value`` (numpy array or torch tensor) has a floating dtype."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return False
    if hasattr(dtype, "is_floating_point"):  # torch.dtype
        return bool(dtype.is_floating_point)
    return np.dtype(dtype).kind == "f"


def layer_of(name: str) -> str:
    """The layer of a tensor name: the module prefix before the final '.' (the name itself
    when it has no '.')."""
    prefix, dot, _ = name.rpartition(".")
    return prefix if dot else name


def _is_tracked_buffer(name: str, value: Any) -> bool:
    return re.split(r"[./:]", name)[-1] in TRACKED_BUFFER_SUFFIXES or not is_floating(value)


def _check_named(named: Any) -> Mapping[str, Any]:
    if not isinstance(named, Mapping):
        raise TypeError("named: must be a mapping name -> array/tensor (e.g. a state_dict)")
    for k in named:
        if not isinstance(k, str):
            raise TypeError("named: keys must be str tensor names")
    return named


class ParamSelector(ABC):
    """Extension point: choose and order the tensors that form a parameter vector."""

    @abstractmethod
    def select(self, named: Mapping[str, Any]) -> list[str]:
        """Ordered names (mapping order) of the selected entries of ``named``."""

    def select_module(self, module: Any) -> list[str]:
        """Names selected from a torch ``nn.Module`` (its ``state_dict`` order).

        The default applies :meth:`select` to the state dict restricted to the module's
        learnable parameters (``named_parameters``), so buffers are excluded exactly.
        """
        state = module.state_dict()
        params = {n for n, _ in module.named_parameters()}
        return self.select({k: v for k, v in state.items() if k in params})

    def __call__(self, named: Mapping[str, Any]) -> list[str]:
        return self.select(named)


class DefaultSelector(ParamSelector):
    """Every learnable parameter; tracked buffers (BatchNorm statistics, counters) excluded."""

    def select(self, named: Mapping[str, Any]) -> list[str]:
        named = _check_named(named)
        return [k for k, v in named.items() if not _is_tracked_buffer(k, v)]

    def __repr__(self) -> str:
        return "DefaultSelector()"


class AllParams(ParamSelector):
    """Every floating tensor: parameters and floating buffers (running statistics).

    Integer counters (``num_batches_tracked``) cannot join a float32 vector meaningfully and
    are skipped.
    """

    def select(self, named: Mapping[str, Any]) -> list[str]:
        named = _check_named(named)
        return [k for k, v in named.items() if is_floating(v)]

    def select_module(self, module: Any) -> list[str]:
        return self.select(module.state_dict())

    def __repr__(self) -> str:
        return "AllParams()"


class LastLayers(ParamSelector):
    """The learnable parameters of the last ``n`` layers (layer = prefix before the final '.').

    Layers are ordered by first appearance in the mapping (a module's registration order),
    e.g. the classifier head of a vision or language backbone with ``n=1``.
    """

    def __init__(self, n: int) -> None:
        if int(n) != n or n < 1:
            raise ValueError("n: must be an integer >= 1")
        self.n = int(n)

    def select(self, named: Mapping[str, Any]) -> list[str]:
        names = DefaultSelector().select(named)
        layers: list[str] = []
        for k in names:
            layer = layer_of(k)
            if layer not in layers:
                layers.append(layer)
        keep = set(layers[-self.n:])
        return [k for k in names if layer_of(k) in keep]

    def __repr__(self) -> str:
        return f"LastLayers({self.n})"


class NameFilter(ParamSelector):
    """Learnable parameters whose name matches an ``include`` pattern and no ``exclude`` one.

    Patterns are shell-style (:mod:`fnmatch`, case-sensitive), matched against the full
    dotted name, e.g. ``include=("encoder.*",)``, ``exclude=("*.bias",)``. With
    ``include_buffers=True`` floating buffers are candidates too.
    """

    def __init__(self, include: Iterable[str] = ("*",), exclude: Iterable[str] = (),
                 include_buffers: bool = False) -> None:
        if isinstance(include, str) or isinstance(exclude, str):
            raise TypeError("include/exclude: must be sequences of patterns, not one string")
        self.include = tuple(include)
        self.exclude = tuple(exclude)
        self.include_buffers = bool(include_buffers)

    def _match(self, name: str) -> bool:
        return (any(fnmatch.fnmatchcase(name, p) for p in self.include)
                and not any(fnmatch.fnmatchcase(name, p) for p in self.exclude))

    def select(self, named: Mapping[str, Any]) -> list[str]:
        base = AllParams() if self.include_buffers else DefaultSelector()
        return [k for k in base.select(named) if self._match(k)]

    def select_module(self, module: Any) -> list[str]:
        if self.include_buffers:
            return self.select(module.state_dict())
        return super().select_module(module)

    def __repr__(self) -> str:
        return f"NameFilter(include={self.include!r}, exclude={self.exclude!r})"


class TrainableOnly(ParamSelector):
    """Parameters of ``module`` with ``requires_grad`` (fine-tuning a frozen backbone).

    The set is read from the module at each call, so freezing/unfreezing is picked up.
    On a mapping, returns the names of ``named`` that are trainable parameters of the module.
    """

    def __init__(self, module: Any) -> None:
        if not hasattr(module, "named_parameters"):
            raise TypeError("module: must be a torch.nn.Module")
        self.module = module

    def _trainable(self) -> set[str]:
        return {n for n, p in self.module.named_parameters() if p.requires_grad}

    def select(self, named: Mapping[str, Any]) -> list[str]:
        named = _check_named(named)
        trainable = self._trainable()
        return [k for k in named if k in trainable]

    def select_module(self, module: Any) -> list[str]:
        trainable = {n for n, p in module.named_parameters() if p.requires_grad}
        return [k for k in module.state_dict() if k in trainable]

    def __repr__(self) -> str:
        return f"TrainableOnly({type(self.module).__name__})"


def requires_grad_selector(module: Any) -> TrainableOnly:
    """Selector of ``module``'s parameters that have ``requires_grad=True``."""
    return TrainableOnly(module)
