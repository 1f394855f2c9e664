"""The user's own data: ``[data] source = "package.module:function"``.

A source is a callable with no arguments returning ``(features, labels)``: features a
float32 array of shape ``(N, ...)`` (images ``(N, C, H, W)``, tabular ``(N, F)``, ...),
labels an integer array of shape ``(N,)`` with classes ``0 .. K-1``. The federation divides
them among its clients exactly as the built-in data sets (a held-out split for the test and
probe sets, then IID or Dirichlet shards; ``[data]``), and drift events apply to them as
to the built-in ones (label rotation on any features; the image drifts ``rotation``,
``blur`` and ``gaussian_noise`` need image features ``(N, C, H, W)``).
"""

from __future__ import annotations

import numpy as np

from clma.datasets.builtin import Dataset
from clma.models.factory import import_callable

__all__ = ["load_source"]


def load_source(path: str) -> Dataset:
    """Call the source ``path`` and check what it returns.

    Raises:
        ValueError: naming ``data.source`` and the rule: the callable fails or does not
            import, it returns no ``(features, labels)`` pair, features are not a float32
            array with a sample axis and at least one feature axis, labels are not integer
            ``(N,)`` of the same length, a label is negative, fewer than two classes, or a
            feature is not finite. Values are never quoted.
    """
    fn = import_callable(path, "data.source")
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 (user code)
        raise ValueError(f"data.source: {path!r} raised {type(exc).__name__}: {exc}") from None
    if not isinstance(out, tuple) or len(out) != 2:
        raise ValueError(f"data.source: {path!r} must return a (features, labels) pair")
    x, y = out
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        got = x.dtype if isinstance(x, np.ndarray) else type(x).__name__
        raise ValueError(f"data.source: features must be a numpy float32 array (got {got})")
    if x.ndim < 2:
        raise ValueError(f"data.source: features must have shape (N, ...) with at least one "
                         f"feature axis (got rank {x.ndim})")
    if not isinstance(y, np.ndarray) or y.dtype.kind not in "iu":
        got = y.dtype if isinstance(y, np.ndarray) else type(y).__name__
        raise ValueError(f"data.source: labels must be a numpy integer array (got {got})")
    if y.shape != (x.shape[0],):
        raise ValueError(f"data.source: labels must have shape (N,) with N = {x.shape[0]} "
                         f"samples, like the features (got {y.shape})")
    if x.shape[0] == 0:
        raise ValueError("data.source: no samples")
    if int(y.min()) < 0:
        raise ValueError("data.source: labels must be classes 0 .. K-1 (a label is negative)")
    n_classes = int(y.max()) + 1
    if n_classes < 2:
        raise ValueError("data.source: labels must hold at least two classes")
    if not np.isfinite(x).all():
        raise ValueError("data.source: features must be finite (NaN or inf found)")
    return Dataset(np.ascontiguousarray(x), y.astype(np.int64), n_classes, f"source:{path}")
