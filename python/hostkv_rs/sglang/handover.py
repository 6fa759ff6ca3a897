"""Constructions hostkv_rs does not serve go to SGLang's own class.

`hostkv_rs.sglang.install()` records, for each of our pool classes, the SGLang class it stands in
for. When SGLang then builds one of ours with something we do not implement (the Ascend layout
`page_first_kv_split`, KV scales, an NPU device pool), `HostKVCache.__new__` builds SGLang's class with
the same arguments instead and logs one line saying so. Without install() (no SGLang), our own
constructor refuses the same construction with SGLang's error text, so nothing is dropped
silently either way.
"""

from __future__ import annotations

import abc
import logging
import threading
import weakref
from typing import ClassVar

from hostkv_rs.pools.tensor_mode import outside_inference_mode

logger = logging.getLogger("hostkv_rs")

_lock = threading.Lock()
# our class -> SGLang's class it replaces (filled by hostkv_rs.sglang.install()). Replaced whole,
# never changed in place, so a check reading it without the lock sees one mapping or the other.
_originals: dict[type, type] = {}


def set_originals(mapping: dict[type, type]) -> None:
    global _originals
    with _lock:
        _originals = dict(mapping)
        classes = list(PoolMeta.classes)
    # Answers cached under the previous mapping, on every pool class: a base class caches what
    # its subclasses answered.
    for ours in classes:
        ours._abc_caches_clear()


def _replaces(cls: type, subclass) -> bool:
    """Whether `subclass` is (or derives from) SGLang's class that `cls` stands in for. The MRO,
    not issubclass: SGLang's class has ours registered under it, so asking the ABC machinery
    would come back here."""
    original = _originals.get(cls)
    return original is not None and original in getattr(subclass, "__mro__", ())


class PoolMeta(abc.ABCMeta):
    """The metaclass of our pool classes. Once install() has put our class under SGLang's name,
    an instance of SGLang's own class (what a hand-over builds, or anything built before
    install()) still passes SGLang's `isinstance` checks against that name, as it did before.
    `ABCMeta.register` cannot say so: ours is registered under SGLang's class, and the reverse
    would be a cycle. Asked before ABCMeta's own answer, which it caches per type (a cached
    "no" would otherwise hide this one from the second check on)."""

    classes: ClassVar[weakref.WeakSet] = weakref.WeakSet()

    def __init__(cls, name, bases, namespace, **kwargs):
        super().__init__(name, bases, namespace, **kwargs)
        with _lock:
            PoolMeta.classes.add(cls)
        # Every pool is built outside inference mode (wrapping `__init__` keeps its signature
        # for inspect, which a metaclass `__call__` would hide).
        init = namespace.get("__init__")
        if init is not None:
            cls.__init__ = outside_inference_mode(init)

    def __instancecheck__(cls, instance) -> bool:
        return _replaces(cls, type(instance)) or super().__instancecheck__(instance)

    def __subclasscheck__(cls, subclass) -> bool:
        return _replaces(cls, subclass) or super().__subclasscheck__(subclass)


def original_for(cls: type) -> type | None:
    """SGLang's class standing behind `cls` (its nearest recorded ancestor), if installed."""
    with _lock:
        for klass in cls.__mro__:
            original = _originals.get(klass)
            if original is not None:
                return original
    return None


def handover(cls: type, args: tuple, kwargs: dict):
    """An instance of SGLang's own class when hostkv_rs cannot serve this construction and
    install() recorded that class; None to build ours (which refuses what it cannot serve)."""
    reason = cls._unsupported_reason(args, kwargs)
    if reason is None:
        return None
    original = original_for(cls)
    if original is None:
        return None
    log_handover(cls.__name__, original, reason)
    return original(*args, **kwargs)


def log_handover(what: str, original: type, reason: str) -> None:
    logger.warning(
        "hostkv_rs: %s handed to SGLang's own %s.%s: %s",
        what,
        original.__module__,
        original.__qualname__,
        reason,
    )
