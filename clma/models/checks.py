"""Checks of a federation's model that the server and the devices share: the forward pass
on the probe set, the probe file, the model's parameter layout and the architecture as
JSON (what a Flower run tells its SuperNodes to build).

The layout (:func:`model_layout`) is what the flat parameter vector means: the name, shape
and dtype of every floating ``state_dict`` tensor in :class:`clma.params.AllParams` order.
Two models whose layouts have the same digest exchange vectors meaningfully; the Flower
roster refuses a device whose layout differs from the server's.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

__all__ = ["LAYOUT_FORMAT", "check_model_on_features", "load_probe", "model_layout",
           "model_spec_of", "spec_and_reference_data", "spec_from_json", "spec_to_json"]

#: Version of the layout digest (changes if what is hashed changes).
LAYOUT_FORMAT = "clma.model-layout/1"


def check_model_on_features(model: Any, features: np.ndarray, n_classes: int | None, *,
                            needs_relu: bool = True, field: str = "model.factory") -> None:
    """The start-up check of a user's model: one forward pass on ``features`` (float32
    ``(P, ...)``, the probe set) must give finite logits ``(P, n_classes)`` (any width
    >= 2 when ``n_classes`` is None: the server of real clients holds no labels); with
    divergence scoring on, the forward pass must call at least one ``nn.ReLU`` module.

    Raises:
        ValueError: ``field``: the model rejects the features (the error's type and
            message, the features' shape), its output has the wrong shape or width, is not
            finite, or it has no ``nn.ReLU`` layer to read.
    """
    import torch

    calls: list[int] = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1))
             for m in model.modules() if isinstance(m, torch.nn.ReLU)]
    try:
        model.eval()
        with torch.no_grad():
            out = model(torch.from_numpy(np.ascontiguousarray(features)))
    except Exception as exc:  # noqa: BLE001 (user code)
        raise ValueError(f"{field}: the model rejects the features of shape "
                         f"{tuple(features.shape[1:])} per sample ({type(exc).__name__}: "
                         f"{exc})") from None
    finally:
        for h in hooks:
            h.remove()
    if not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[0] != len(features):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{field}: the model must return logits of shape (N, classes) "
                         f"(got {shape} for N = {len(features)})")
    if n_classes is not None and out.shape[1] != n_classes:
        raise ValueError(f"{field}: the model's output width {out.shape[1]} does not "
                         f"match the data's {n_classes} classes")
    if n_classes is None and out.shape[1] < 2:
        raise ValueError(f"{field}: the model must return at least two logits per sample "
                         f"(got {out.shape[1]})")
    if not bool(torch.isfinite(out).all()):
        raise ValueError(f"{field}: the model's logits on the probe set are not finite")
    if needs_relu and not calls:
        raise ValueError(f"{field}: divergence scoring reads nn.ReLU modules and the "
                         "model's forward pass calls none (use nn.ReLU modules, or set "
                         "divergence.enabled = false)")


def load_probe(path: str, sample_shape: tuple[int, ...] | None = None) -> np.ndarray:
    """The probe set of ``[data] probe``: array ``features`` of the .npz file ``path``,
    float32 ``(P, *sample_shape)`` (any sample shape of rank >= 1 when ``sample_shape`` is
    None), finite, at least 2 samples.

    Raises:
        ValueError: ``data.probe``: unreadable, no ``features`` array, or it breaks a rule.
    """
    try:
        with np.load(path, allow_pickle=False) as z:
            if "features" not in z.files:
                raise ValueError(f"data.probe: {path!r} has no array 'features'")
            x = z["features"]
    except (OSError, ValueError) as exc:
        if str(exc).startswith("data.probe"):
            raise
        raise ValueError(f"data.probe: {path!r} cannot be read as an .npz file "
                         f"({type(exc).__name__})") from None
    if sample_shape is None:
        ok = x.dtype == np.float32 and x.ndim >= 2 and len(x) >= 2
        want = "(P, ...)"
    else:
        ok = (x.dtype == np.float32 and tuple(x.shape[1:]) == tuple(sample_shape)
              and len(x) >= 2)
        want = f"(P, {', '.join(map(str, sample_shape))})"
    if not ok:
        raise ValueError(f"data.probe: 'features' must be float32 of shape {want} with "
                         f"P >= 2 (got {x.dtype} {tuple(x.shape)})")
    if not np.isfinite(x).all():
        raise ValueError("data.probe: 'features' must be finite (NaN or inf found)")
    return np.ascontiguousarray(x)


def model_layout(model: Any) -> tuple[int, str]:
    """``(n_params, digest)`` of a torch model's parameter vector: the number of float32
    entries of :func:`clma.params.model_to_vector` (``AllParams``) and a sha256 (hex, 64
    characters) of the name, shape and dtype of each tensor in that order
    (:data:`LAYOUT_FORMAT`). Values do not enter it."""
    from clma.params import AllParams

    state = model.state_dict()
    names = AllParams().select_module(model)
    items = [[n, list(state[n].shape), str(state[n].dtype).removeprefix("torch.")]
             for n in names]
    n_params = int(sum(int(np.prod(s, dtype=np.int64)) for _, s, _ in items))
    doc = json.dumps({"format": LAYOUT_FORMAT, "tensors": items}, separators=(",", ":"))
    return n_params, hashlib.sha256(doc.encode()).hexdigest()


def spec_to_json(spec: Any) -> str:
    """The architecture a device builds, as JSON: ``{"kind": "mlp", "n_features",
    "hidden", "n_classes"}`` (:class:`clma.models.mlp.MLPSpec`) or ``{"kind": "factory",
    "factory": "package.module:function"}`` (:class:`clma.models.FactoryModelSpec`).

    Raises:
        TypeError: another kind of spec.
    """
    from clma.models.factory import FactoryModelSpec

    if isinstance(spec, FactoryModelSpec):
        return json.dumps({"kind": "factory", "factory": spec.factory})
    if type(spec).__name__ == "MLPSpec":
        return json.dumps({"kind": "mlp", "n_features": int(spec.n_features),
                           "hidden": [int(h) for h in spec.hidden],
                           "n_classes": int(spec.n_classes)})
    raise TypeError(f"spec_to_json: {type(spec).__name__} is not a model spec")


def spec_from_json(text: str, field: str = "run config 'model-spec'") -> Any:
    """The spec of :func:`spec_to_json`'s JSON. The factory is only named here; it is
    imported when the model is built.

    Raises:
        ValueError: naming ``field``: not JSON of one of the two kinds, or a width out of
            range.
    """
    try:
        doc = json.loads(text)
    except (TypeError, ValueError):
        raise ValueError(f"{field}: must be the JSON of a model spec") from None
    kind = doc.get("kind") if isinstance(doc, dict) else None
    if kind == "factory" and isinstance(doc.get("factory"), str) and doc["factory"]:
        from clma.models.factory import FactoryModelSpec

        return FactoryModelSpec(doc["factory"])
    if kind == "mlp":
        def width(v: Any) -> int:
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1_000_000:
                raise ValueError(f"{field}: an MLP width must be an integer in [1, 1000000]")
            return v

        hidden = doc.get("hidden")
        if not isinstance(hidden, list) or not 1 <= len(hidden) <= 8:
            raise ValueError(f"{field}: 'hidden' must list 1 to 8 widths")
        from clma.models.mlp import MLPSpec

        return MLPSpec(width(doc.get("n_features")), tuple(width(h) for h in hidden),
                       width(doc.get("n_classes")))
    raise ValueError(f"{field}: 'kind' must be 'mlp' or 'factory' (with its fields)")


def spec_and_reference_data(config: Any) -> tuple[Any, Any]:
    """``(spec, dataset)``: :func:`model_spec_of`, and the reference data set
    (:class:`clma.datasets.Dataset`) when the model is the built-in MLP (else None)."""
    if config.model.factory:
        from clma.models.factory import FactoryModelSpec

        return FactoryModelSpec(config.model.factory), None
    from clma.datasets import DatasetError, load_dataset
    from clma.models.mlp import MLPSpec

    try:
        dataset = load_dataset(config.data.dataset, config.data.data_dir)
    except DatasetError as exc:
        raise DatasetError(f"data.data_dir: {exc}") from None
    return MLPSpec(dataset.n_features, tuple(config.model.hidden), dataset.n_classes), dataset


def model_spec_of(config: Any) -> Any:
    """The architecture the server and every device build (:class:`clma.models.
    FactoryModelSpec` of ``[model] factory``, else the built-in
    :class:`clma.models.mlp.MLPSpec` shaped by the reference data set), without building a
    model. Raises :class:`clma.datasets.DatasetError` (``data.data_dir``) when the
    reference data set is missing."""
    return spec_and_reference_data(config)[0]
