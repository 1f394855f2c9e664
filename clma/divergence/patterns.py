"""Binary activation patterns of a ReLU network on a fixed probe set.

A ReLU layer partitions the input space into linear regions; the region a sample falls in is
identified by its *activation pattern*, the vector of bits ``1[pre-activation > 0]`` over the
layer's units. Comparing how two models assign patterns to the same probe samples compares the
partitions the two models induce, independent of how their units are permuted (Pérez-Corral,
Mestre, Fernández-Hernández, Dolz, Quintana-Ortí, "Detecting Atypical Clients in Federated
Learning via Representation-Level Divergence", arXiv:2605.22266, 2026, Sec. 3).

Patterns are captured with forward pre-hooks on the network's activation modules
(``torch.nn.ReLU`` by default), in the order the modules are *called* during the forward pass,
so "first layer first" holds for any architecture, and a module applied twice (e.g. the shared
``relu`` of a torchvision ``BasicBlock``) yields two layers. Functional calls
(``torch.relu``/``F.relu``) are invisible to hooks: models must use ``nn.ReLU`` modules.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

__all__ = ["LayerPattern", "activation_patterns", "probe_digest", "sample_probe"]


@dataclass(frozen=True)
class LayerPattern:
    """Bit-packed activation patterns of one ReLU layer on the probe set.

    Attributes:
        name: ``"<module path>"`` of the activation module (``"<module path>#k"`` for its
            k-th call, k >= 1, when one module is applied several times in a forward pass).
        bits: ``(P, ceil(width / 8))`` uint8, ``np.packbits(pattern, axis=1)`` (big-endian
            bit order, zero padding in the last byte) of the ``(P, width)`` 0/1 pattern.
        width: number of units (bits) per sample; for a convolutional feature map ``C*H*W``
            (the map flattened in PyTorch's C-major order).
    """

    name: str
    bits: np.ndarray
    width: int

    def __post_init__(self) -> None:
        if not isinstance(self.bits, np.ndarray) or self.bits.dtype != np.uint8:
            raise TypeError("LayerPattern.bits must be a uint8 numpy array")
        if self.bits.ndim != 2:
            raise ValueError("LayerPattern.bits must be 2-D (n_probe, n_bytes)")
        if not isinstance(self.width, int | np.integer) or self.width < 1:
            raise ValueError("LayerPattern.width must be a positive integer")
        if self.bits.shape[1] != (int(self.width) + 7) // 8:
            raise ValueError("LayerPattern.bits must have ceil(width / 8) columns")

    @property
    def n_probe(self) -> int:
        """Number of probe samples P (rows of ``bits``)."""
        return int(self.bits.shape[0])

    def unpack(self) -> np.ndarray:
        """The ``(P, width)`` uint8 0/1 pattern matrix (padding bits dropped)."""
        return np.unpackbits(self.bits, axis=1, count=int(self.width))


def _as_probe_tensor(probe: np.ndarray | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(probe, np.ndarray):
        if probe.dtype.kind not in "fiub":
            raise TypeError("probe must hold real numbers")
        tensor = torch.from_numpy(np.ascontiguousarray(probe))
    elif isinstance(probe, torch.Tensor):
        tensor = probe.detach()
    else:
        raise TypeError("probe must be a numpy array or a torch tensor")
    if tensor.ndim < 2:
        raise ValueError("probe must have shape (n_probe, *input_shape) with n_probe >= 1")
    if tensor.shape[0] < 1:
        raise ValueError("probe must hold at least one sample (n_probe >= 1)")
    if tensor.is_complex():
        raise TypeError("probe must hold real numbers")
    tensor = tensor.to(dtype=dtype, device="cpu")
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError("probe must be finite (no NaN or inf)")
    return tensor


def _model_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def activation_patterns(
    model: nn.Module,
    probe: np.ndarray | torch.Tensor,
    *,
    batch_size: int = 256,
    activation_types: tuple[type[nn.Module], ...] = (nn.ReLU,),
) -> list[LayerPattern]:
    """Binary activation patterns ``a_l(x; theta) = 1[pre-activation > 0]`` of every ReLU layer.

    The model runs in eval mode under ``torch.no_grad`` on the CPU, in batches of
    ``batch_size`` probe samples; its original train/eval mode is restored afterwards. Each
    call of an activation module (in call order) is one layer; its input is the
    pre-activation. For a ReLU, ``pre > 0`` iff ``out > 0``.

    Args:
        model: any ``torch.nn.Module`` whose nonlinearities are ``activation_types`` modules.
        probe: ``(P, *input_shape)`` real array or tensor, the shared probe set (cast to the
            model's floating dtype).
        batch_size: probe samples per forward pass (>= 1); does not change the result.
        activation_types: module classes whose calls count as layers (default ``nn.ReLU``;
            ``nn.LeakyReLU`` etc. also give a meaningful ``pre > 0`` pattern).

    Returns:
        One :class:`LayerPattern` per activation call, first layer first; ``bits`` has shape
        ``(P, ceil(width/8))``; convolutional maps are flattened per sample to ``C*H*W`` bits.

    Raises:
        TypeError: ``model`` is not a module, or ``probe`` is not a real array/tensor.
        ValueError: empty or non-finite probe, ``batch_size < 1``, a model without
            activation modules, or a model whose layer structure changes between batches.

    Source: arXiv:2605.22266, Sec. 3 (activation patterns on a shared probe set).
    """
    if not isinstance(model, nn.Module):
        raise TypeError("model must be a torch.nn.Module")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError("batch_size must be an integer >= 1")
    probe_t = _as_probe_tensor(probe, _model_dtype(model))

    names = {m: n for n, m in model.named_modules() if isinstance(m, activation_types)}
    if not names:
        raise ValueError(
            "model has no activation modules of type "
            + ", ".join(t.__name__ for t in activation_types)
            + " (functional relu calls cannot be observed)"
        )

    captured: list[tuple[str, np.ndarray, int]] = []
    call_counts: dict[str, int] = {}

    def pre_hook(module: nn.Module, args: tuple) -> None:
        pre = args[0]
        name = names[module]
        k = call_counts.get(name, 0)
        call_counts[name] = k + 1
        flat = (pre > 0).reshape(pre.shape[0], -1).numpy()
        captured.append((name if k == 0 else f"{name}#{k}", np.packbits(flat, axis=1), flat.shape[1]))

    handles = [m.register_forward_pre_hook(pre_hook) for m in names]
    was_training = model.training
    per_batch: list[list[tuple[str, np.ndarray, int]]] = []
    try:
        model.eval()
        with torch.no_grad():
            for start in range(0, probe_t.shape[0], batch_size):
                captured.clear()
                call_counts.clear()
                model(probe_t[start : start + batch_size])
                per_batch.append(list(captured))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)

    layout = [(name, width) for name, _, width in per_batch[0]]
    for batch in per_batch[1:]:
        if [(name, width) for name, _, width in batch] != layout:
            raise ValueError("model's activation layers changed between probe batches")
    return [
        LayerPattern(
            name=name,
            bits=np.concatenate([batch[i][1] for batch in per_batch], axis=0),
            width=int(width),
        )
        for i, (name, width) in enumerate(layout)
    ]


def sample_probe(
    data: np.ndarray,
    n_probe: int,
    *,
    seed: int | np.random.Generator | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Draw a probe set: an i.i.d. sample without replacement of ``n_probe`` rows of ``data``.

    The probe set is fixed per federation; record the returned indices (or
    :func:`probe_digest` of the probe) with the run.

    Args:
        data: ``(n, *input_shape)`` public data.
        n_probe: number of probe samples, ``1 <= n_probe <= n``.
        seed: integer seed or ``numpy.random.Generator`` (None draws fresh OS entropy).

    Returns:
        ``(probe, indices)``: ``data[indices]`` and the ``(n_probe,)`` int64 row indices.

    Raises:
        ValueError: ``data`` has no rows or ``n_probe`` is out of range.
    """
    data = np.asarray(data)
    if data.ndim < 1 or data.shape[0] < 1:
        raise ValueError("data must have at least one row")
    if not isinstance(n_probe, int | np.integer) or not 1 <= n_probe <= data.shape[0]:
        raise ValueError("n_probe must be an integer in [1, len(data)]")
    rng = np.random.default_rng(seed)
    indices = rng.choice(data.shape[0], size=int(n_probe), replace=False).astype(np.int64)
    return data[indices], indices


def probe_digest(probe: np.ndarray | torch.Tensor) -> str:
    """SHA-256 hex digest of the probe's float32 C-order bytes and shape, to record the probe."""
    if isinstance(probe, torch.Tensor):
        arr = probe.detach().cpu().numpy()
    else:
        arr = np.asarray(probe)
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    h = hashlib.sha256(repr(arr.shape).encode())
    h.update(arr.tobytes())
    return h.hexdigest()
