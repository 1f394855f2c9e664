"""Experiments run by ``clma experiment NAME``.

Each experiment is a module ``flows/experiments/<name with '-' as '_'>.py`` exposing
``DESCRIPTION: str``, ``add_arguments(parser: argparse.ArgumentParser) -> None`` and
``run(args: argparse.Namespace) -> int`` (the exit code). An experiment that never runs a Prefect flow sets
``USES_PREFECT = False`` (default True: ``clma experiment`` then first checks the local
Prefect database, :mod:`flows.prefect_home`). They are discovered by
module name, so adding an experiment touches no shared file.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

__all__ = ["HELPERS", "available", "load"]

#: Modules here that are shared harness code, not experiments (no ``DESCRIPTION`` /
#: ``run``): ``peers`` holds the CFL and IFCA baselines the experiments call.
HELPERS = frozenset({"peers"})


def available() -> list[str]:
    """Experiment names (module names with '_' shown as '-'; :data:`HELPERS` excluded)."""
    return sorted(
        m.name.replace("_", "-")
        for m in pkgutil.iter_modules(__path__)
        if not m.name.startswith("_") and m.name not in HELPERS
    )


def load(name: str) -> ModuleType:
    """Import the experiment module for ``name``. Raises ValueError for an unknown name."""
    if name not in available():
        raise ValueError(
            f"experiment: unknown name {name!r}; available: {', '.join(available()) or 'none'}"
        )
    return importlib.import_module(f"{__name__}.{name.replace('-', '_')}")
