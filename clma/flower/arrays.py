"""Flower ``ArrayRecord`` <-> CLMA parameter vectors (float32 ``(n_params,)``).

The layout is the record's key order: every array flattened in C order and concatenated,
cast to float32 (the precision CLMA averages and cohorts in). Going back, each array gets
its original shape and dtype (an integer array, e.g. a counter buffer, is rounded).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord

from clma.params import DefaultSelector, ParameterAlignmentError, ParamSelector

__all__ = ["ArrayLayout"]


@dataclass(frozen=True)
class ArrayLayout:
    """Names, shapes and dtypes of an ``ArrayRecord``, in record order."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]

    @classmethod
    def of(cls, record: ArrayRecord) -> ArrayLayout:
        """The layout of ``record`` (e.g. the strategy's ``initial_arrays``)."""
        arrays = record.to_numpy_ndarrays()
        if not arrays:
            raise ValueError("initial_arrays: the ArrayRecord holds no array")
        return cls(tuple(record.keys()), tuple(a.shape for a in arrays),
                   tuple(a.dtype for a in arrays))

    @property
    def n_params(self) -> int:
        return int(sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes))

    def to_vector(self, record: ArrayRecord) -> np.ndarray:
        """float32 ``(n_params,)`` of ``record``. Raises ParameterAlignmentError if its
        keys or shapes differ from the layout's."""
        if tuple(record.keys()) != self.names:
            raise ParameterAlignmentError("arrays: the ArrayRecord's keys differ from the "
                                          "initial_arrays' keys")
        arrays = record.to_numpy_ndarrays()
        if tuple(a.shape for a in arrays) != self.shapes:
            raise ParameterAlignmentError("arrays: an array's shape differs from initial_arrays")
        return np.concatenate([np.asarray(a, dtype=np.float32).ravel() for a in arrays])

    def to_record(self, vector: np.ndarray) -> ArrayRecord:
        """An ``ArrayRecord`` with the layout's keys, shapes and dtypes."""
        vec = np.asarray(vector)
        if vec.shape != (self.n_params,):
            raise ParameterAlignmentError(
                f"vector: shape {vec.shape}, expected ({self.n_params},)")
        out: OrderedDict[str, Array] = OrderedDict()
        off = 0
        for name, shape, dtype in zip(self.names, self.shapes, self.dtypes, strict=True):
            size = int(np.prod(shape, dtype=np.int64))
            part = vec[off:off + size].reshape(shape)
            if np.dtype(dtype).kind in "iub":
                part = np.rint(part)
            out[name] = Array(np.ascontiguousarray(part.astype(dtype)))
            off += size
        return ArrayRecord(out)

    def selector_indices(self, selector: ParamSelector | None) -> np.ndarray | None:
        """Indices of the vector entries ``selector`` keeps (None = all of them).

        ``selector.select`` sees name -> zero array of the right shape and dtype, so the
        library's selectors (:class:`clma.params.DefaultSelector`, ``LastLayers``,
        ``NameFilter``) work on Flower records as on torch state dicts.
        """
        sel = selector if selector is not None else DefaultSelector()
        named: Mapping[str, np.ndarray] = OrderedDict(
            (n, np.zeros(s, dtype=d)) for n, s, d in zip(self.names, self.shapes, self.dtypes,
                                                        strict=True))
        chosen: Sequence[str] = sel.select(named)
        if not chosen:
            raise ValueError("param_selector: selected no array of the record")
        if list(chosen) == list(self.names):
            return None
        starts, off = {}, 0
        for n, s in zip(self.names, self.shapes, strict=True):
            size = int(np.prod(s, dtype=np.int64))
            starts[n] = (off, size)
            off += size
        return np.concatenate([np.arange(starts[n][0], starts[n][0] + starts[n][1])
                               for n in chosen])
