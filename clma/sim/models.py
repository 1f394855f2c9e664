"""The simulation's models: the built-in MLP lives in :mod:`clma.models.mlp` (the server
and the devices build it too); re-exported here for the simulation's callers."""

from clma.models.mlp import MLPSpec, make_mlp

__all__ = ["MLPSpec", "make_mlp"]
