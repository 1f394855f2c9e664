"""Framework helpers (fed-clma 0.1.1's ``clma.adapters``): import the submodule you need,
``clma.adapters.torch`` or ``clma.adapters.tensorflow`` (Keras); neither imports its
framework at import time."""

__all__: list[str] = []
