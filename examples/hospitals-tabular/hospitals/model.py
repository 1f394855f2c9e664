"""The hospitals' model: a small ReLU MLP over the 30 breast-cancer features.

``[model] factory = "hospitals.model:tabular_mlp"``: CLMA calls it with no arguments on
the server and on every device; the federation's parameter vector is every floating
tensor of its ``state_dict``, and the divergence scores read its ``nn.ReLU`` modules.
"""

from __future__ import annotations

from torch import nn

N_FEATURES = 30
N_CLASSES = 2


class TabularMLP(nn.Module):
    """``(N, 30)`` float32 features -> ``(N, 2)`` logits (malignant, benign)."""

    def __init__(self, hidden: tuple[int, int] = (32, 16)) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(N_FEATURES, hidden[0]), nn.ReLU(),
            nn.Linear(hidden[0], hidden[1]), nn.ReLU(),
            nn.Linear(hidden[1], N_CLASSES))

    def forward(self, x):
        return self.net(x)


def tabular_mlp() -> TabularMLP:
    """The factory the config names."""
    return TabularMLP()
