"""Argument checks shared by the pools: each refusal names the parameter, the value and what is
allowed (a bool is never taken for a number)."""

from __future__ import annotations

import math
import numbers
import operator


def as_int(name: str, value) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None


def finite_number(name: str, value, allowed: str) -> float:
    """A real number argument: TypeError for anything else (a bool included), ValueError for NaN
    or an infinity; both name the parameter, the value and what is allowed."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {allowed}, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value


def positive_int(name: str, value) -> int:
    value = as_int(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def required(form: str, **values) -> None:
    missing = [name for name, value in values.items() if value is None]
    if missing:
        raise TypeError(f"{form} needs {', '.join(missing)} (got None)")
