"""Models of a federation: the built-in MLP or the user's own torch model, by factory."""

from clma.models.factory import FactoryModelSpec, import_callable

__all__ = ["FactoryModelSpec", "import_callable"]
