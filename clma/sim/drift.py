"""Drift injection for the simulation: concept drift and covariate drift.

- ``label_rotation`` (concept drift): y -> (y + shift) mod n_classes. Opposite families
  use +k and -k; repeated events accumulate.
- ``gaussian_noise`` (covariate): x -> clip(x + N(0, magnitude^2), 0, 1), the noise drawn
  once per (client, event) from a seeded generator so the client's data stay fixed.
- ``rotation`` (covariate): each image rotated by ``magnitude`` degrees
  (``scipy.ndimage.rotate``, bilinear, same shape).
- ``blur`` (covariate): Gaussian filter with sigma ``magnitude`` pixels on the spatial axes
  (``scipy.ndimage.gaussian_filter``).
- ``feature_scale`` (covariate, any features): x -> magnitude * x, every feature of every
  sample -- a site whose instrument changed its calibration (tabular or images).

Images are ``(n, c, h, w)`` float32 in [0, 1]; labels ``(n,)`` int64. ``feature_scale``
takes features of any shape ``(n, ...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

__all__ = ["AppliedDrift", "apply_drifts", "transform_images", "rotate_labels"]


@dataclass(frozen=True)
class AppliedDrift:
    """One drift a client has undergone (kept on the simulated client)."""

    round: int
    kind: str
    family: str
    shift: int = 0
    magnitude: float = 0.0
    noise_seed: int = 0


def rotate_labels(labels: np.ndarray, shift: int, n_classes: int) -> np.ndarray:
    """Concept drift by label rotation: ``(labels + shift) mod n_classes`` (int64)."""
    return np.mod(labels.astype(np.int64) + int(shift), n_classes)


def transform_images(images: np.ndarray, drift: AppliedDrift) -> np.ndarray:
    """Apply one covariate drift to ``images`` ``(n, c, h, w)`` (``feature_scale``: any
    ``(n, ...)``); returns a new float32 array."""
    if drift.kind == "gaussian_noise":
        rng = np.random.default_rng(drift.noise_seed)
        noisy = images + rng.normal(0.0, drift.magnitude, size=images.shape).astype(np.float32)
        return np.clip(noisy, 0.0, 1.0).astype(np.float32)
    if drift.kind == "rotation":
        out = ndimage.rotate(images, drift.magnitude, axes=(2, 3), reshape=False, order=1,
                             mode="constant", cval=0.0)
        return np.clip(out, 0.0, 1.0).astype(np.float32)
    if drift.kind == "feature_scale":
        return (images * np.float32(drift.magnitude)).astype(np.float32)
    if drift.kind == "blur":
        out = ndimage.gaussian_filter(images, sigma=(0, 0, drift.magnitude, drift.magnitude))
        return out.astype(np.float32)
    raise ValueError(f"drift kind {drift.kind!r} does not transform images")


def apply_drifts(
    images: np.ndarray, labels: np.ndarray, drifts: list[AppliedDrift], n_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Apply a client's drifts in order. Returns new ``(images, labels)`` arrays."""
    x, y = images, labels
    for d in drifts:
        if d.kind == "label_rotation":
            y = rotate_labels(y, d.shift, n_classes)
        else:
            x = transform_images(x, d)
    return x, y
