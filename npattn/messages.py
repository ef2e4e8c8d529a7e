"""How an error message says what it received.

Every ``TypeError`` / ``ValueError`` of npattn names the argument, what was
expected and what was received; the last part is written with these
functions, so that a value reads the same in every message ('int 3',
"str 'a'", 'type numpy.int32', 'None', 'an int too large for a float (1101
bits)'). They import nothing of npattn, so
the lowest module (``npattn.backend``) words its messages with them too;
``npattn.validation`` hands them on under the same names.
"""

from __future__ import annotations

import numbers
from typing import Any

__all__ = ["type_name", "described", "real_text"]


def type_name(x: Any) -> str:
    """How to call ``x`` in a message: 'numpy.ndarray', 'list', 'None'...; a class by its name
    ('type numpy.int32', where its type alone would read 'type')."""
    if x is None:
        return "None"
    if isinstance(x, type):
        return f"type {_class_name(x)}"
    t = type(x)
    if t.__module__ in ("builtins",):
        return t.__name__
    return f"{t.__module__.split('.')[0]}.{t.__name__}"


def _class_name(c: type) -> str:
    """A class as a user writes it: 'numpy.int32', 'jax.numpy.int32', 'int' (the module path up
    to its first private part, as in 'numpy._core...')."""
    public = []
    for part in str(getattr(c, "__module__", "builtins")).split("."):
        if part.startswith("_"):
            break
        public.append(part)
    module = ".".join(public)
    return c.__qualname__ if module in ("", "builtins") else f"{module}.{c.__qualname__}"


def described(x: Any) -> str:
    """How a message says what it got: the type and the value ('int 3', "str 'a'"), a class
    by its name ('type numpy.int32', not its repr "<class 'numpy.int32'>"), or 'None'."""
    if x is None or isinstance(x, type):
        return type_name(x)
    return f"{type_name(x)} {x!r}"


def real_text(value: Any) -> str:
    """A real number as a message's "got" part: its ``repr``, or for an int beyond the float
    range "an int too large for a float (N bits)" ("a negative int ..." below it), not its
    hundreds of digits; another number beyond it (a ``Fraction``) by its type."""
    if isinstance(value, numbers.Real):
        try:
            float(value)
        except OverflowError:
            negative = value < 0
            if isinstance(value, numbers.Integral):
                sign = "a negative int" if negative else "an int"
                return f"{sign} too large for a float ({int(value).bit_length()} bits)"
            return f"{'a negative ' if negative else 'a '}{type_name(value)} too large for a float"
    return repr(value)
