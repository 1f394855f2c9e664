"""PyTorch helpers with fed-clma 0.1.1's names, over :mod:`clma.params` (requires torch
only when called)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from clma.params import LastLayers, ParamSelector, TrainableOnly

__all__ = ["get_weights", "head_selector", "set_weights", "trainable_selector"]


def get_weights(model: Any) -> dict[str, np.ndarray]:
    """``model.state_dict()`` as NumPy arrays."""
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


def set_weights(model: Any, params: dict[str, np.ndarray]) -> None:
    """Load NumPy arrays back into ``model`` (strict)."""
    import torch

    model.load_state_dict(OrderedDict((k, torch.as_tensor(np.asarray(v)))
                                      for k, v in params.items()), strict=True)


def trainable_selector(model: Any) -> ParamSelector:
    """The parameters of ``model`` with ``requires_grad`` (:class:`clma.params.TrainableOnly`;
    read at each call, so later freezing is picked up). Raises ValueError if none is."""
    sel = TrainableOnly(model)
    if not any(p.requires_grad for _, p in model.named_parameters()):
        raise ValueError("model: has no trainable parameters")
    return sel


def head_selector(model: Any, n_layers: int = 1) -> ParamSelector:
    """The learnable parameters of the last ``n_layers`` layers (:class:`LastLayers`; note:
    layers, not fed-clma's tensors)."""
    del model
    return LastLayers(n_layers)
