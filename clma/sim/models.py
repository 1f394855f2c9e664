"""Models of the simulation: a small ReLU multilayer perceptron in torch.

The MLP is ``Flatten -> [Linear -> ReLU] * len(hidden) -> Linear`` on flattened images.
Its ReLU layers are what :mod:`clma.divergence` reads activation patterns from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MLPSpec", "make_mlp"]


@dataclass(frozen=True)
class MLPSpec:
    """Shape of the MLP: ``n_features`` inputs, ``hidden`` widths, ``n_classes`` outputs."""

    n_features: int
    hidden: tuple[int, ...]
    n_classes: int

    def build(self, seed: int | None = None) -> nn.Sequential:
        """A fresh model; with ``seed`` its initial weights are reproducible."""
        return make_mlp(self.n_features, self.hidden, self.n_classes, seed=seed)


def make_mlp(
    n_features: int, hidden: tuple[int, ...] | list[int], n_classes: int, *, seed: int | None = None
) -> nn.Sequential:
    """Build the MLP. With ``seed`` the default (Kaiming-uniform) initialisation is drawn
    from a private ``torch.Generator`` state so that threads do not disturb each other."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = n_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, n_classes))
    if seed is None:
        return nn.Sequential(*layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(*layers)
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
    return model
