"""Framework helpers (fed-clma 0.1.1's ``clma.adapters``): import the submodule you need,
``clma.adapters.torch``. No TensorFlow adapter is provided (README, "Coming from fed-clma")."""

__all__: list[str] = []
