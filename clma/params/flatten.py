"""Flattening named states into float32 parameter vectors, aligned by name.

Every function here aligns tensors by *name*, never by position: a client whose tensors
arrive in another order is aligned; one with missing, extra or differently shaped tensors
is rejected with a :class:`~clma.params.errors.ParameterAlignmentError` naming the client
and the tensor (issue 3, item 6e). Values are written straight into a preallocated float32
buffer (no float64 copy, item 6d); NaN/inf raise
:class:`~clma.params.errors.NonFiniteParameterError` naming the client and tensor, never the
values.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from clma.params.errors import NonFiniteParameterError, ParameterAlignmentError
from clma.params.selectors import DefaultSelector, ParamSelector

__all__ = [
    "flatten_state",
    "model_to_vector",
    "stack_client_vectors",
    "state_shapes",
    "unflatten_state",
    "vector_to_model",
]


def _to_numpy(value: Any, what: str) -> np.ndarray:
    """A numpy view of an array or torch tensor (CPU, detached); no copy for numpy input."""
    if isinstance(value, np.ndarray):
        arr = value
    elif hasattr(value, "detach"):  # torch.Tensor
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        try:
            arr = t.numpy()
        except TypeError:  # e.g. bfloat16 has no numpy dtype
            arr = t.float().numpy()
    else:
        arr = np.asarray(value)
    if arr.dtype.kind not in "fiub":
        raise TypeError(f"{what}: must hold real numbers, got dtype {arr.dtype}")
    return arr


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in value.shape)


def state_shapes(state: Mapping[str, Any], names: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """name -> shape of the selected entries (raises if a name is missing)."""
    missing = [n for n in names if n not in state]
    if missing:
        raise ParameterAlignmentError(f"state: missing tensors {missing[:5]}")
    return {n: _shape(state[n]) for n in names}


def _fill(out: np.ndarray, state: Mapping[str, Any], names: Sequence[str],
          shapes: Mapping[str, tuple[int, ...]] | None, who: str) -> None:
    off = 0
    for name in names:
        if name not in state:
            raise ParameterAlignmentError(f"{who}: tensor {name!r} is missing")
        arr = _to_numpy(state[name], f"{who}: tensor {name!r}")
        if shapes is not None and tuple(arr.shape) != tuple(shapes[name]):
            raise ParameterAlignmentError(
                f"{who}: tensor {name!r} has shape {tuple(arr.shape)}, expected "
                f"{tuple(shapes[name])}")
        size = arr.size
        if off + size > out.shape[0]:
            raise ParameterAlignmentError(f"{who}: tensors hold more values than expected")
        seg = out[off:off + size]
        seg[...] = arr.reshape(-1)
        if not np.isfinite(seg).all():
            raise NonFiniteParameterError(f"{who}: tensor {name!r} contains NaN or inf")
        off += size
    if off != out.shape[0]:
        raise ParameterAlignmentError(f"{who}: tensors hold fewer values than expected")


def flatten_state(state: Mapping[str, Any], names: Sequence[str]) -> np.ndarray:
    """Concatenate the named tensors of ``state`` into one float32 vector.

    Parameters
    ----------
    state:
        name -> numpy array or torch tensor (e.g. ``module.state_dict()``).
    names:
        The tensors to take, in this order (e.g. ``DefaultSelector().select(state)``).

    Returns
    -------
    np.ndarray
        float32 ``(n_params,)``, each tensor flattened in C order.

    Raises
    ------
    ParameterAlignmentError
        A name is missing (the error names it). NonFiniteParameterError: NaN/inf.
    """
    if not isinstance(state, Mapping):
        raise TypeError("state: must be a mapping name -> array/tensor")
    names = list(names)
    shapes = state_shapes(state, names)
    total = int(sum(int(np.prod(s, dtype=np.int64)) for s in shapes.values()))
    out = np.empty(total, dtype=np.float32)
    _fill(out, state, names, None, "state")
    return out


def unflatten_state(vector: np.ndarray, template: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Split a flat vector back into named arrays shaped like ``template``.

    ``template`` maps name -> array/tensor (or a shape tuple); its order is the vector's
    order (pass exactly the selected entries). Returns views into ``vector`` (no copy), so
    the dtype is the vector's (float32). Raises ``ParameterAlignmentError`` if the total
    size differs from the vector length.
    """
    vec = np.asarray(vector)
    if vec.ndim != 1:
        raise ParameterAlignmentError(f"vector: must be 1-D, got shape {vec.shape}")
    shapes = {n: (tuple(int(x) for x in v) if isinstance(v, (tuple, list)) else _shape(v))
              for n, v in template.items()}
    total = int(sum(int(np.prod(s, dtype=np.int64)) for s in shapes.values()))
    if total != vec.shape[0]:
        raise ParameterAlignmentError(
            f"vector: has {vec.shape[0]} values but the template needs {total}")
    out: dict[str, np.ndarray] = {}
    off = 0
    for name, shape in shapes.items():
        size = int(np.prod(shape, dtype=np.int64))
        out[name] = vec[off:off + size].reshape(shape)
        off += size
    return out


def model_to_vector(module: Any, selector: ParamSelector | None = None) -> np.ndarray:
    """Flatten a torch module's selected tensors (default :class:`DefaultSelector`: every
    learnable parameter, no buffers) into a float32 ``(n_params,)`` vector."""
    sel = selector if selector is not None else DefaultSelector()
    names = sel.select_module(module)
    return flatten_state(module.state_dict(), names)


def vector_to_model(vector: np.ndarray, module: Any, selector: ParamSelector | None = None) -> Any:
    """Write a flat vector into ``module``'s selected tensors in place; returns ``module``.

    The inverse of :func:`model_to_vector` with the same selector. Raises
    ``ParameterAlignmentError`` on a length mismatch, ``NonFiniteParameterError`` on NaN/inf.
    """
    import torch

    sel = selector if selector is not None else DefaultSelector()
    names = sel.select_module(module)
    state = module.state_dict()
    vec = np.asarray(vector)
    if vec.dtype.kind == "f" and not np.isfinite(vec).all():
        raise NonFiniteParameterError("vector: contains NaN or inf")
    parts = unflatten_state(vec, {n: state[n] for n in names})
    with torch.no_grad():
        for name, arr in parts.items():
            target = state[name]  # state_dict tensors share storage with the module
            target.copy_(torch.from_numpy(np.ascontiguousarray(arr)).to(target.dtype))
    return module


def stack_client_vectors(client_states: Mapping[Hashable, Mapping[str, Any]],
                         names: Sequence[str], *,
                         shapes: Mapping[str, tuple[int, ...]] | None = None,
                         allow_extra: bool = False) -> np.ndarray:
    """Stack the clients' named states into one float32 matrix, aligned by name.

    Parameters
    ----------
    client_states:
        client id -> (name -> array/tensor). Row ``i`` of the result is the ``i``-th client
        in the mapping's iteration order. Each client's tensors may arrive in any order.
    names:
        The tensor names forming the vector, in order.
    shapes:
        Expected name -> shape; default: the first client's shapes (every other client must
        match them).
    allow_extra:
        False (default): a client holding names outside ``names`` is rejected.

    Returns
    -------
    np.ndarray
        float32 ``(n_clients, n_params)``, written in place (no float64 copy).

    Raises
    ------
    ParameterAlignmentError
        Missing or extra names, mismatched shapes (the error names the client and tensor).
    NonFiniteParameterError
        NaN or inf in a client's tensor (names the client and tensor, not the values).
    """
    if not isinstance(client_states, Mapping):
        raise TypeError("client_states: must be a mapping client id -> named state")
    names = list(names)
    if len(set(names)) != len(names):
        raise ParameterAlignmentError("names: must be unique")
    ids = list(client_states)
    if not ids:
        return np.empty((0, 0), dtype=np.float32)
    wanted = set(names)
    for cid in ids:
        state = client_states[cid]
        if not isinstance(state, Mapping):
            raise TypeError(f"client_states: state of client {cid!r} must be a mapping")
        missing = [n for n in names if n not in state]
        if missing:
            raise ParameterAlignmentError(
                f"client {cid!r}: missing tensors {missing[:5]}"
                + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
        if not allow_extra:
            extra = [n for n in state if n not in wanted]
            if extra:
                raise ParameterAlignmentError(
                    f"client {cid!r}: unexpected tensors {extra[:5]} (not in names)")
    if shapes is None:
        shapes = {n: _shape(client_states[ids[0]][n]) for n in names}
    else:
        shapes = {n: tuple(int(x) for x in shapes[n]) for n in names}
    total = int(sum(int(np.prod(s, dtype=np.int64)) for s in shapes.values()))
    out = np.empty((len(ids), total), dtype=np.float32)
    for i, cid in enumerate(ids):
        _fill(out[i], client_states[cid], names, shapes, f"client {cid!r}")
    return out
