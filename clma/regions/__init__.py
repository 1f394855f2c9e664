"""The versioned region partition: which client belongs to which region.

A partition file (TOML) names the regions, their client shares and each region's
neighbour for monitoring merges; it carries a ``version`` and every run records the
file's SHA-256 ``content_hash``. Regions are disjoint and every client is in exactly one
region, which is what lets regional releases use parallel composition.
"""

from __future__ import annotations

import hashlib
import tomllib
from importlib import resources
from pathlib import Path
from typing import Annotated

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["Region", "RegionPartition", "PartitionError", "load_partition"]


class PartitionError(ValueError):
    """A region partition file broke a rule. The message names the field and the rule."""


class Region(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-z0-9_-]+$")]
    share: Annotated[float, Field(gt=0.0, le=1.0)]
    neighbour: str


class RegionPartition(BaseModel):
    """A validated partition. ``content_hash`` is the SHA-256 of the file's bytes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Annotated[str, Field(min_length=1, max_length=32)]
    name: str
    regions: list[Region] = Field(min_length=1)
    content_hash: str = ""
    source: str = ""

    @model_validator(mode="after")
    def _consistent(self) -> RegionPartition:
        ids = [r.id for r in self.regions]
        if len(set(ids)) != len(ids):
            raise ValueError("regions: region ids must be unique")
        total = sum(r.share for r in self.regions)
        if abs(total - 1.0) > 1e-9:
            raise ValueError("regions: shares must sum to 1")
        for r in self.regions:
            if r.neighbour not in ids or r.neighbour == r.id:
                raise ValueError(f"regions[{r.id}].neighbour must name another region")
        return self

    @property
    def region_ids(self) -> list[str]:
        return [r.id for r in self.regions]

    @property
    def neighbours(self) -> dict[str, str]:
        return {r.id: r.neighbour for r in self.regions}

    def region_sizes(self, n_clients: int) -> dict[str, int]:
        """Clients per region by largest-remainder rounding of ``share * n_clients``."""
        if n_clients < 1:
            raise PartitionError("n_clients must be at least 1")
        raw = np.array([r.share * n_clients for r in self.regions])
        sizes = np.floor(raw).astype(int)
        order = np.argsort(-(raw - sizes), kind="stable")
        for i in order[: n_clients - int(sizes.sum())]:
            sizes[i] += 1
        return {r.id: int(s) for r, s in zip(self.regions, sizes, strict=True)}

    def assign(self, n_clients: int, seed: int) -> dict[int, str]:
        """Map client ids ``0..n_clients-1`` to regions: sizes from :meth:`region_sizes`,
        membership by a permutation seeded with ``seed`` (reproducible)."""
        sizes = self.region_sizes(n_clients)
        perm = np.random.default_rng(seed).permutation(n_clients)
        out: dict[int, str] = {}
        start = 0
        for rid, size in sizes.items():
            for c in perm[start : start + size]:
                out[int(c)] = rid
            start += size
        return dict(sorted(out.items()))


def load_partition(path: str | Path | None = None) -> RegionPartition:
    """Load a partition file; None loads the bundled ``regions_v1.toml``.

    Raises :class:`PartitionError` naming the field and rule.
    """
    if path is None:
        raw = resources.files("clma.regions").joinpath("regions_v1.toml").read_bytes()
        source = "clma/regions/regions_v1.toml"
    else:
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise PartitionError(f"region partition {str(path)!r}: {exc.strerror}") from None
        source = str(path)
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise PartitionError(f"region partition {source!r} is not valid TOML: {exc}") from None
    data["content_hash"] = hashlib.sha256(raw).hexdigest()
    data["source"] = source
    try:
        return RegionPartition.model_validate(data)
    except ValidationError as err:
        msgs = []
        for e in err.errors(include_url=False, include_input=False):
            loc = ".".join(str(p) for p in e["loc"]) or "(file)"
            msgs.append(f"{loc}: {e['msg'].removeprefix('Value error, ')}")
        raise PartitionError(f"region partition {source!r}: " + "; ".join(msgs)) from None
