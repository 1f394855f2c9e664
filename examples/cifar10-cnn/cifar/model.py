"""A small CNN for 32x32 RGB images (fed-clma's setting): two convolution blocks (the
first with BatchNorm, whose running statistics travel in the parameter vector), then two
linear layers. ``[model] factory = "cifar.model:small_cnn"``."""

from __future__ import annotations

from torch import nn


def small_cnn() -> nn.Module:
    """``(N, 3, 32, 32)`` float32 in [0, 1] -> ``(N, 10)`` logits."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 10))
