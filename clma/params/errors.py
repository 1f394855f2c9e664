"""Exceptions for parameter vectors (shared by :mod:`clma.params` and :mod:`clma.cohort`)."""

from __future__ import annotations

__all__ = ["NonFiniteParameterError", "ParameterAlignmentError", "ParameterError"]


class ParameterError(ValueError):
    """A parameter vector or state is unusable; the message names the client and/or field."""


class NonFiniteParameterError(ParameterError):
    """A client's parameters hold NaN or inf (the values themselves are never echoed)."""


class ParameterAlignmentError(ParameterError):
    """Tensors cannot be aligned by name: missing/extra names, wrong shapes or lengths."""
