"""Parameter selection and flattening (filled in below)."""

from clma.params.errors import NonFiniteParameterError, ParameterAlignmentError, ParameterError

__all__ = ["NonFiniteParameterError", "ParameterAlignmentError", "ParameterError"]
