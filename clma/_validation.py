"""One rule for turning a pydantic ``ValidationError`` into field-naming messages.

Used by the configuration (:mod:`clma.config`) and the privacy policy
(:mod:`clma.budget.policy`) loaders. Input values are never included, so a rejected value
(possibly sensitive) does not reach a log or a terminal.
"""

from __future__ import annotations

from pydantic import ValidationError

__all__ = ["field_errors"]

_VALUE_ERROR_PREFIX = "Value error, "


def field_errors(exc: ValidationError, root: str) -> list[tuple[str, str, str]]:
    """``(dotted location, message, pydantic error type)`` for every error of ``exc``.

    The location is ``root`` for a model-level error; pydantic's ``"Value error, "`` prefix
    of custom validator messages is removed; inputs and documentation URLs are left out.
    """
    out = []
    for err in exc.errors(include_input=False, include_url=False):
        loc = ".".join(str(p) for p in err["loc"]) or root
        msg = err["msg"]
        if msg.startswith(_VALUE_ERROR_PREFIX):
            msg = msg[len(_VALUE_ERROR_PREFIX):]
        out.append((loc, msg, err["type"]))
    return out
