"""Argument checks shared by the pools: each refusal names the parameter, the value and what is
allowed (a bool is never taken for a number)."""

from __future__ import annotations

import math
import numbers
import operator
from contextlib import contextmanager

import numpy as np
import torch

from hostkv_rs import _core


class FlatPageError(ValueError, RuntimeError):
    """A flat L3 page that does not hold one page of this pool: a ValueError naming the sizes,
    and a RuntimeError, which the reshape in SGLang's pools raises for the same page."""


class SlotRangeError(ValueError, IndexError):
    """Slots outside the pool: a ValueError naming the range, and an IndexError, which SGLang's
    slot bookkeeping raises for the same slots."""


class NegativeSlotError(SlotRangeError, AssertionError):
    """A negative slot: also an AssertionError, the double-free assert SGLang's `free` raises
    for it (it reads the slot counted from the end, so it asserts while the last slot is free
    and otherwise frees that slot)."""


class RequestRowError(ValueError, RuntimeError):
    """A HiSparse request row that cannot take the slots a call needs (too narrow, or an
    allocated length inside a page): a ValueError naming the row, and the RuntimeError
    SGLang's pools raise for it (a failed allocation, or torch's write of the slots)."""


class NoHeadSplitError(ValueError, AttributeError):
    """A head split asked of a pool without one: a ValueError naming the split, and the
    AttributeError SGLang's pools raise there (they have no split-heads method)."""


class NoKVBytesError(RuntimeError, AttributeError, TypeError):
    """A page asked of a pool that holds no KV bytes (allocator-only, or destroyed): a
    RuntimeError saying so, and the AttributeError or TypeError SGLang's pools raise on their
    `None` kv_buffer for the same call (`.data_ptr()`, subscripting)."""


class ZeroSizeError(ValueError, ZeroDivisionError):
    """A size of zero: a ValueError naming the parameter, and the ZeroDivisionError SGLang's
    pools raise for it (they divide by it)."""


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
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int (or Fraction) past the largest float: no float holds it
        finite = False
    if not finite:
        raise ValueError(f"{name} must be {allowed}, got {_shown(value)}")
    return value


def finite_product(name: str, value: float, factor, what: str) -> float:
    """`value * factor` for sizing (GB to bytes, ratio x tokens); ValueError naming `name` when
    the product leaves the float range, where `int()` of it would raise OverflowError."""
    product = value * factor
    if not math.isfinite(product):
        raise ValueError(f"{name}={_shown(value)} is too large: {what} exceeds the float range")
    return product


def _shown(value) -> str:
    """`value` for a message; an int of hundreds of digits is cut to its size."""
    text = repr(value)
    if len(text) > 40 and isinstance(value, int):
        return f"{text[:12]}... ({len(text)} digits)"
    return text


def positive_int(name: str, value) -> int:
    """A positive size; zero is a `ZeroSizeError` (every size read here is one SGLang divides
    by), a negative one a ValueError."""
    value = as_int(name, value)
    if value <= 0:
        raise (ZeroSizeError if value == 0 else ValueError)(f"{name} must be positive, got {value}")
    return value


@contextmanager
def device_side_of(pool: str):
    """Reading the device pools (or buffer infos) a host pool is built from: an object missing
    what SGLang's have is a TypeError naming the arguments, not an AttributeError."""
    try:
        yield
    except AttributeError as exc:
        raise TypeError(
            f"{pool}: device_pool (or buffer_info) and the MTP drafts must be SGLang device pools "
            f"(or SGLang 0.5.23 buffer infos): {exc}"
        ) from exc


def truth(name: str, value) -> bool:
    """A flag read the way SGLang reads it (`if value:`), as a bool; a value without one truth
    value (a tensor or array of several elements) is a TypeError naming the parameter."""
    try:
        return bool(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}: {value!r}") from None


def required(form: str, **values) -> None:
    missing = [name for name, value in values.items() if value is None]
    if missing:
        raise TypeError(f"{form} needs {', '.join(missing)} (got None)")


def pool_sequence(name: str, value) -> tuple:
    """`value` (draft device pools or buffer infos) as a tuple, as SGLang's `tuple(value)` reads
    it; a tensor or array is refused by name (its rows are not pools, and iterating a huge or
    nested one only exhausts memory or fails inside torch)."""
    if hasattr(value, "__array__") or hasattr(value, "__dlpack__"):
        raise TypeError(f"{name} must be a sequence of pools, got {type(value).__name__}")
    try:
        return tuple(value)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of pools, got {type(value).__name__}") from None


def element_count(indices) -> int | None:
    """How many indices SGLang counts in `indices`: a tensor's or array's elements, a
    sequence's entries; None for anything else (no count to check)."""
    if isinstance(indices, torch.Tensor):
        return indices.numel()
    if isinstance(indices, np.ndarray):
        return indices.size
    try:
        return len(indices)
    except TypeError:
        return None


def layer_tensors(what: str, layers) -> list:
    """Per-layer tensors as a list. A nested tensor is refused by name: iterating one fails
    inside torch ("NestedTensorImpl doesn't support sizes")."""
    if isinstance(layers, torch.Tensor):
        _core.refuse_nested(layers, what)
    return list(layers)
