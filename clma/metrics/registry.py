"""Metric registry: the set of bounded metrics a federation may release."""

from __future__ import annotations

import math

from clma.release.aggregate import MetricSpec

__all__ = ["MetricRegistry", "MetricRegistryError"]


class MetricRegistryError(ValueError):
    """A spec is invalid for registration or a name is unknown/duplicated."""


class MetricRegistry:
    """Name -> :class:`~clma.release.MetricSpec`.

    ``register`` re-checks the bounds even though ``MetricSpec`` validates them,
    because a spec built with ``model_construct`` (or any duck-typed object)
    bypasses validation: a metric without finite, increasing clip bounds has
    no known sensitivity and can never be released.
    """

    def __init__(self) -> None:
        self._specs: dict[str, MetricSpec] = {}

    def register(self, spec: MetricSpec) -> MetricSpec:
        """Add ``spec``; returns it.

        Raises:
            TypeError: not a MetricSpec.
            MetricRegistryError: non-finite or non-increasing bounds, or a
                different spec already registered under the same name.
        """
        if not isinstance(spec, MetricSpec):
            raise TypeError("spec must be a clma.release.MetricSpec")
        for field in ("clip_low", "clip_high"):
            v = getattr(spec, field, None)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise MetricRegistryError(f"{field} of metric {spec.name!r} must be finite")
        if not spec.clip_low < spec.clip_high:
            raise MetricRegistryError(
                f"metric {spec.name!r}: clip_high must be strictly greater than clip_low"
            )
        existing = self._specs.get(spec.name)
        if existing is not None and existing != spec:
            raise MetricRegistryError(f"metric {spec.name!r} is already registered with other bounds")
        self._specs[spec.name] = spec
        return spec

    def get(self, name: str) -> MetricSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise MetricRegistryError(f"unknown metric {name!r}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __len__(self) -> int:
        return len(self._specs)

    def names(self) -> list[str]:
        return sorted(self._specs)
