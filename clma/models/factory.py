"""The user's own torch model: ``[model] factory = "package.module:function"``.

A factory is a callable with no arguments that returns a ``torch.nn.Module`` of any
architecture (convolutions, normalisation layers with their running statistics). The
federation treats the model as a flat float32 vector of every floating tensor of its
``state_dict`` (:class:`clma.params.AllParams`: parameters and floating buffers), so CLMA's
cohorting, DP-FedAvg and the cohort registry work on it unchanged. The divergence scores
read the activation patterns of every ``nn.ReLU`` module the forward pass calls, in call
order (a convolution's ReLU included); a model with no ``nn.ReLU`` module (functional
``F.relu``) gives no pattern layer and is refused when divergence scoring is on.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["FactoryModelSpec", "import_callable", "load_weights"]


def import_callable(path: str, field: str) -> Callable[..., Any]:
    """The callable named by ``"package.module:function"`` (``function`` may be dotted:
    ``module:Class.method``).

    Raises:
        ValueError: naming ``field``: not of the form module:function, the module does not
            import (the import error's type and message), the name is missing, or the
            object is not callable.
    """
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise ValueError(f"{field}: {path!r} must be 'package.module:function'")
    mod_name, attr = path.split(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except Exception as exc:  # noqa: BLE001 (any import-time failure of user code)
        raise ValueError(f"{field}: module {mod_name!r} does not import "
                         f"({type(exc).__name__}: {exc})") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{field}: {mod_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"{field}: {path!r} is not callable")
    return obj


@dataclass(frozen=True)
class FactoryModelSpec:
    """The architecture of a federation whose model comes from ``factory``
    (``"package.module:function"``). Picklable (it holds the path, not the callable), so
    worker processes rebuild the model by importing the user's module."""

    factory: str

    def build(self, seed: int | None = None) -> Any:
        """A fresh model from the factory. With ``seed``, the factory runs under
        ``torch.manual_seed(seed)`` inside a forked RNG state, so its initial weights are
        reproducible and the global torch RNG is left as it was.

        Raises:
            ValueError: ``model.factory``: does not import, is not callable, raises, or
                returns something other than a ``torch.nn.Module``.
        """
        import torch

        fn = import_callable(self.factory, "model.factory")
        try:
            if seed is None:
                model = fn()
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(int(seed))
                    model = fn()
        except Exception as exc:  # noqa: BLE001 (user code)
            raise ValueError(f"model.factory: {self.factory!r} raised "
                             f"{type(exc).__name__}: {exc}") from None
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model.factory: {self.factory!r} returned "
                             f"{type(model).__name__}, not a torch.nn.Module")
        return model


def load_weights(model: Any, path: str) -> Any:
    """Load the ``state_dict`` saved in ``path`` (``torch.save``) into ``model`` in place
    (``weights_only=True``: no code is unpickled; strict keys and shapes); returns it.

    Raises:
        ValueError: ``model.weights``: the file cannot be read or is not a state dict,
            or its keys or shapes do not fit the model (names the first few).
    """
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"model.weights: {path!r} does not exist") from None
    except Exception as exc:  # noqa: BLE001 (unreadable or unsafe file)
        raise ValueError(f"model.weights: {path!r} cannot be loaded as a state dict "
                         f"({type(exc).__name__})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        raise ValueError(f"model.weights: {path!r} must hold a state_dict (name -> tensor)")
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    if missing or extra:
        raise ValueError(f"model.weights: the keys do not fit the model (missing "
                         f"{missing[:3]}, unexpected {extra[:3]})")
    bad = [k for k in own if tuple(own[k].shape) != tuple(state[k].shape)]
    if bad:
        k = bad[0]
        raise ValueError(f"model.weights: {k!r} has shape {tuple(state[k].shape)}, the model "
                         f"expects {tuple(own[k].shape)}")
    model.load_state_dict(state, strict=True)
    return model
