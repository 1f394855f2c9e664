"""Data of a federation: the built-in data sets or the user's own source, by function."""

from clma.datasets.source import load_source

__all__ = ["load_source"]
