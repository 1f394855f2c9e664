"""Float32 arrays in a detector's JSON state (stays on the device): zlib-compressed,
base64-encoded little-endian bytes with their shape, ``{"shape": [...], "dtype":
"float32", "zlib_b64": ...}``. Used by :class:`clma.drift.InputKSDetector` (its reference
rows) and :class:`clma.drift.PairedLossDetector` (the model it keeps)."""

from __future__ import annotations

import base64
import zlib
from typing import Any

import numpy as np

__all__ = ["decode_array", "encode_array"]

_SHAPES = {1: "[n]", 2: "[n, d]"}


def encode_array(x: np.ndarray) -> dict[str, Any]:
    """``x`` as JSON data (float32, any shape)."""
    raw = np.ascontiguousarray(x, dtype="<f4").tobytes()
    return {"shape": [int(s) for s in x.shape], "dtype": "float32",
            "zlib_b64": base64.b64encode(zlib.compress(raw, 6)).decode("ascii")}


def decode_array(doc: Any, field: str, ndim: int, max_rows: int | None = None) -> np.ndarray:
    """Inverse of :func:`encode_array` for an array of ``ndim`` (1 or 2) dimensions, each
    >= 1 (at most ``max_rows`` rows when given).

    Raises:
        ValueError: malformed data, naming ``field`` and the rule.
    """
    shape_text = _SHAPES[ndim]
    if not isinstance(doc, dict) or doc.get("dtype") != "float32":
        raise ValueError(f"{field}: must be {{'shape': {shape_text}, 'dtype': 'float32', "
                         "'zlib_b64': ...}")
    shape = doc.get("shape")
    if (not isinstance(shape, list) or len(shape) != ndim
            or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape)):
        sizes = "n" if ndim == 1 else "n, d"
        raise ValueError(f"{field}.shape: must be {shape_text} with {sizes} >= 1")
    if max_rows is not None and shape[0] > max_rows:
        raise ValueError(f"{field}.shape: more rows than params.reference_size")
    try:
        raw = zlib.decompress(base64.b64decode(str(doc.get("zlib_b64", "")), validate=True))
    except (ValueError, zlib.error):
        raise ValueError(f"{field}.zlib_b64: not base64 of zlib-compressed bytes") from None
    if len(raw) != 4 * int(np.prod(shape)):
        raise ValueError(f"{field}: byte length does not match its shape")
    x = np.frombuffer(raw, dtype="<f4").reshape(shape).astype(np.float32)
    if not np.isfinite(x).all():
        raise ValueError(f"{field}: must be finite")
    return x
