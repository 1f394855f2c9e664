"""The built-in model: a small ReLU multilayer perceptron in torch (``[model] hidden``).

The MLP is ``Flatten -> [Linear -> ReLU] * len(hidden) -> Linear`` on flattened images.
Its ReLU layers are what :mod:`clma.divergence` reads activation patterns from.
"""

from __future__ import annotations

import math
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
    """Build the MLP. With ``seed`` the default (Kaiming-uniform) initialisation of
    ``nn.Linear`` is drawn from a private ``torch.Generator`` seeded with ``seed``: the
    global torch RNG is neither read nor advanced, so threads do not disturb each other.
    Without ``seed`` the layers use torch's global RNG as usual."""
    widths = [n_features, *hidden, n_classes]
    gen = None if seed is None else torch.Generator().manual_seed(int(seed))
    layers: list[nn.Module] = [nn.Flatten()]
    for i, (w_in, w_out) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        if gen is None:
            lin = nn.Linear(w_in, w_out)
        else:
            # same draws as nn.Linear.reset_parameters, from the private generator
            lin = torch.nn.utils.skip_init(nn.Linear, w_in, w_out)
            with torch.no_grad():
                nn.init.kaiming_uniform_(lin.weight, a=math.sqrt(5), generator=gen)
                bound = 1.0 / math.sqrt(w_in)
                nn.init.uniform_(lin.bias, -bound, bound, generator=gen)
        layers.append(lin)
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)
