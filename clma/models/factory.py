"""The user's own torch model: ``[model] factory = "package.module:function"``.

A factory is a callable with no arguments that returns a ``torch.nn.Module`` of any
architecture (convolutions, normalisation layers with their running statistics). The
federation treats the model as a flat float32 vector of every floating tensor of its
``state_dict`` (:class:`clma.params.AllParams`: parameters and floating buffers), so CLMA's
cohorting, DP-FedAvg and the cohort registry work on it unchanged. The divergence scores
read the activation patterns of every ``nn.ReLU`` module the forward pass calls, in call
order (a convolution's ReLU included); a model with no ``nn.ReLU`` module (functional
``F.relu``) gives no pattern layer and is refused when divergence scoring is on.

``[model] weights`` starts the federation from saved weights: a ``torch.save`` file of the
model's ``state_dict``, or a cohort model CLMA registered in MLflow (``models:/name@alias``,
``models:/name/version`` or ``runs:/run_id/path``), whose folder carries the exact
``state_dict`` beside the exported graph (``extra_files/state_dict.pt``,
:data:`STATE_DICT_FILE`). The same file lets the user load a registered cohort model into
their own class: ``load_weights(my_factory(), "models:/fed-cohorts@cohort-3")``.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_STORE", "REGISTRY_SCHEMES", "STATE_DICT_FILE", "FactoryModelSpec",
           "import_callable", "load_weights", "reading_tracking_uri"]

#: The project's local MLflow store, relative to the working directory.
DEFAULT_STORE = Path("mlflow") / "store"
#: Where a registered cohort model keeps its exact ``state_dict`` (MLflow ``extra_files``).
STATE_DICT_FILE = "extra_files/state_dict.pt"
#: ``model.weights`` values read from MLflow rather than from a file.
REGISTRY_SCHEMES = ("models:/", "runs:/")


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


def reading_tracking_uri() -> str:
    """The MLflow store to read from: ``MLFLOW_TRACKING_URI`` if set, else the project's
    local store ``sqlite:///<cwd>/mlflow/store/mlflow.db`` (not created here)."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{(Path.cwd() / DEFAULT_STORE).resolve() / 'mlflow.db'}"


def _registry_state_file(ref: str, tracking_uri: str | None, tmp: str) -> str:
    """Download the model folder of ``ref`` into ``tmp``; the path of its state dict."""
    import mlflow.artifacts

    uri = tracking_uri or reading_tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise ValueError(f"model.weights: {ref!r} names an MLflow model, but there is no "
                         f"MLflow store at {uri} (set MLFLOW_TRACKING_URI)")
    try:
        folder = mlflow.artifacts.download_artifacts(artifact_uri=ref, dst_path=tmp,
                                                     tracking_uri=uri, registry_uri=uri)
    except Exception as exc:  # noqa: BLE001 (missing model/alias/run, unreachable server)
        why = getattr(exc, "error_code", None) or type(exc).__name__
        raise ValueError(f"model.weights: {ref!r} cannot be read from {uri} ({why}: no such "
                         "registered model, version, alias or run, or the store is "
                         "unreachable)") from None
    path = Path(folder) / STATE_DICT_FILE
    if not path.is_file():
        raise ValueError(f"model.weights: {ref!r} has no {STATE_DICT_FILE} (only cohort "
                         "models CLMA registered carry their state dict)")
    return str(path)


def load_weights(model: Any, path: str, *, tracking_uri: str | None = None) -> Any:
    """Load a saved ``state_dict`` into ``model`` in place (``weights_only=True``: no code is
    unpickled; strict keys and shapes); returns it.

    Args:
        model: a ``torch.nn.Module`` of the architecture the weights were saved from.
        path: a ``torch.save`` file of a state dict, or a model CLMA registered in MLflow
            (``models:/name@alias``, ``models:/name/version``, ``runs:/run_id/model``).
        tracking_uri: the MLflow store of a registry reference; None =
            :func:`reading_tracking_uri`.

    Raises:
        ValueError: ``model.weights``: the file cannot be read or is not a state dict; the
            MLflow store, model, alias or run does not exist or holds no state dict; the
            keys or shapes do not fit the model (names the first few).
    """
    if str(path).startswith(REGISTRY_SCHEMES):
        with tempfile.TemporaryDirectory(prefix="clma-weights-") as tmp:
            return _load_state_file(model, _registry_state_file(path, tracking_uri, tmp),
                                    shown=path)
    return _load_state_file(model, path, shown=path)


def _load_state_file(model: Any, path: str, *, shown: str) -> Any:
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"model.weights: {shown!r} does not exist") from None
    except Exception as exc:  # noqa: BLE001 (unreadable or unsafe file)
        raise ValueError(f"model.weights: {shown!r} cannot be loaded as a state dict "
                         f"({type(exc).__name__})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        raise ValueError(f"model.weights: {shown!r} must hold a state_dict (name -> tensor)")
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
