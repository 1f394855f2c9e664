"""Activation affinity: how alike two probe samples' activation patterns are in one layer.

``K_l(i, j) = 1 - Hamming(a_l(x_i), a_l(x_j)) / width_l``: 1 for identical patterns (same
linear region of the layer), 0 for opposite patterns (arXiv:2605.22266, Sec. 3).

Computation: with the +/-1 encoding ``s = 2a - 1``, ``s_i . s_j = width - 2 Hamming(i, j)``, so
``K = (width + S S^T) / (2 width)``: one matrix product per block of units, never a loop over
pairs. Blocks of at most ``block_bits`` units are multiplied in float32, where every partial sum
is an integer of magnitude <= ``block_bits`` < 2**24 and therefore exact, and accumulated in
float64; the result is the exact rational ``1 - H/width`` rounded once to float64.
"""

from __future__ import annotations

import numpy as np

from clma.divergence.patterns import LayerPattern

__all__ = ["affinity", "affinities"]

_MAX_EXACT_FLOAT32_INT = 1 << 24


def affinity(pattern: LayerPattern, *, block_bits: int = 8192) -> np.ndarray:
    """Activation affinity matrix of one layer.

    Args:
        pattern: the layer's :class:`LayerPattern` on ``P`` probe samples.
        block_bits: units unpacked and multiplied at a time (a multiple of 8, 8 <= block_bits
            < 2**24). Bounds the scratch memory to ``P * block_bits * 4`` bytes; does not
            change the result.

    Returns:
        ``(P, P)`` float64, symmetric, unit diagonal, entries in ``[0, 1]``:
        ``K[i, j] = 1 - Hamming(a(x_i), a(x_j)) / width``.

    Raises:
        TypeError: ``pattern`` is not a :class:`LayerPattern`.
        ValueError: ``block_bits`` out of range or not a multiple of 8.

    Source: arXiv:2605.22266, Sec. 3 (activation affinity).
    """
    if not isinstance(pattern, LayerPattern):
        raise TypeError("pattern must be a LayerPattern")
    if (
        not isinstance(block_bits, int)
        or block_bits % 8
        or not 8 <= block_bits < _MAX_EXACT_FLOAT32_INT
    ):
        raise ValueError("block_bits must be a multiple of 8 in [8, 2**24)")
    width = int(pattern.width)
    n = pattern.n_probe
    gram = np.zeros((n, n), dtype=np.float64)
    block_bytes = block_bits // 8
    for b0 in range(0, pattern.bits.shape[1], block_bytes):
        count = min(block_bits, width - 8 * b0)
        block = np.unpackbits(pattern.bits[:, b0 : b0 + block_bytes], axis=1, count=count)
        signs = block.astype(np.float32)
        signs *= 2.0
        signs -= 1.0
        gram += signs @ signs.T
    gram += width
    gram /= 2.0 * width
    return gram


def affinities(patterns: list[LayerPattern], *, block_bits: int = 8192) -> list[np.ndarray]:
    """:func:`affinity` of every layer, in the same order (first layer first)."""
    return [affinity(p, block_bits=block_bits) for p in patterns]
