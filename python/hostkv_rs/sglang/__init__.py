"""Make an installed SGLang build hostkv_rs host pools.

`install()` works with every SGLang release from 0.5.18 to 0.5.23 (device-pool constructors up to
0.5.22, buffer infos in 0.5.23; our pools take both). It

* imports SGLang's host-pool modules first, so SGLang's own pools that subclass the classes we
  replace (HiSparse MHA, MXFP8, QSA, ...) keep SGLang's originals as their bases, whether or not
  they had been imported before;
* replaces `MHATokenToKVPoolHost`, `AsymmetricMHATokenToKVPoolHost`, `MLATokenToKVPoolHost`,
  `DeepSeekV4PagedHostPool`, `LogicalHostPool` and `get_mha_host_pool_cls` in their defining
  modules and in every loaded `sglang.*` module that bound them (`from ... import X`): the hybrid
  pool assembler, the HiSparse coordinator, the HiRadix cache (<= 0.5.20), the controllers, ...;
  modules imported later bind ours through the patched defining modules;
* never replaces SGLang's `HostKVCache`: our classes are registered as virtual subclasses of it and
  of the classes they replace, and SGLang's own subclasses of a replaced class are registered
  with ours, so every isinstance check SGLang makes answers as before;
* records SGLang's classes so a construction hostkv_rs does not serve (`page_first_kv_split`,
  KV scales, NPU device pools) is handed to SGLang's own class, with one
  log line; SGLang's other host pools (K-only, DSA indexer, Mamba, V4 state, HiSparse MHA, MXFP8,
  unified, QSA ...) are never touched.

`uninstall()` restores every module attribute and ABC registration.

    import hostkv_rs.sglang
    hostkv_rs.sglang.install()   # before SGLang builds its HiCache pools
"""

from __future__ import annotations

import abc
import contextlib
import importlib
import importlib.metadata
import importlib.util
import logging
import pkgutil
import sys
import threading
from dataclasses import dataclass

from hostkv_rs.sglang import handover as _handover

logger = logging.getLogger(__name__)

# Where SGLang defines each object we stand in for (all releases 0.5.18-0.5.23).
DEFINED_IN = {
    "MHATokenToKVPoolHost": "sglang.srt.mem_cache.pool_host.mha",
    "AsymmetricMHATokenToKVPoolHost": "sglang.srt.mem_cache.pool_host.mha",
    "get_mha_host_pool_cls": "sglang.srt.mem_cache.pool_host.mha",
    "MLATokenToKVPoolHost": "sglang.srt.mem_cache.pool_host.mla",
    "DeepSeekV4PagedHostPool": "sglang.srt.mem_cache.memory_pool_host",
    "LogicalHostPool": "sglang.srt.mem_cache.memory_pool_host",
}
NAMES = tuple(DEFINED_IN)
_BASE_MODULE = "sglang.srt.mem_cache.pool_host.base"

# Modules imported before patching: the defining modules, every module that builds a KV host
# pool in some release, and the modules whose isinstance checks read these names. A module a
# release lacks is skipped (hiradix_cache is gone from 0.5.21; device_pool_info arrives in 0.5.22).
KNOWN_MODULES = (
    "sglang.srt.mem_cache.pool_host",
    _BASE_MODULE,
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.memory_pool_host",
    "sglang.srt.mem_cache.hiradix_cache",
    "sglang.srt.mem_cache.kv_cache_builder",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
    "sglang.srt.managers.cache_controller",
    "sglang.srt.managers.hisparse_coordinator",
    "sglang.srt.mem_cache.l2_transfer",
)
# Every submodule of this package is imported too: SGLang's other host pools live there and must
# bind the original classes before we patch.
POOL_PACKAGE = "sglang.srt.mem_cache.pool_host"


@dataclass(frozen=True)
class Release:
    """The SGLang install() found: its version and which constructor generation it uses."""

    version: str
    api: str  # "device_pool" (0.5.18-0.5.22) | "buffer_info" (0.5.23)


_lock = threading.Lock()
# (module name, attribute) -> SGLang's original object, for uninstall().
_patched: dict[tuple[str, str], object] = {}
# ABC -> the registry it had before install() (weak references), for uninstall().
_registries: dict[type, list] = {}
_release: Release | None = None


def _replacements() -> dict[str, object]:
    import hostkv_rs

    return {name: getattr(hostkv_rs, name) for name in NAMES}


def detect_release() -> Release:
    """The installed SGLang's version and constructor generation (ImportError without SGLang)."""
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    try:
        info = importlib.import_module("sglang.srt.mem_cache.device_pool_info")
        api = "buffer_info" if hasattr(info, "MHABufferInfo") else "device_pool"
    except ImportError:
        api = "device_pool"
    return Release(version, api)


def release() -> Release | None:
    """What the last install() found, or None when not installed."""
    return _release


def _import_known() -> tuple[list, dict]:
    imported, failures = [], {}
    for name in KNOWN_MODULES:
        try:
            imported.append(importlib.import_module(name))
        except ImportError as exc:
            failures[name] = exc
    package = sys.modules.get(POOL_PACKAGE)
    for info in pkgutil.iter_modules(getattr(package, "__path__", ()), POOL_PACKAGE + "."):
        try:
            imported.append(importlib.import_module(info.name))
        except Exception as exc:  # noqa: BLE001 - a platform-only module (NPU) may not import
            failures[info.name] = exc
    return imported, failures


def _sglang_installed() -> bool:
    # find_spec may raise for a name a finder refuses outright (a test suite's guard against an
    # accidental namespace package called `sglang`): that is "not installed" too.
    try:
        return importlib.util.find_spec("sglang") is not None
    except (ImportError, ValueError):
        return False


def install() -> dict[str, list[str]]:
    """Patch SGLang to build hostkv_rs pools. Returns {module name: [patched attributes]} for this
    call (empty when already installed). Raises ImportError when SGLang is not importable."""
    global _release
    if not _sglang_installed():
        raise ImportError(
            f"hostkv_rs.sglang.install(): SGLang is not importable: it is not installed in this "
            f"interpreter ({sys.executable}); install it (pip install sglang) first"
        )
    ours = _replacements()
    # SGLang itself is imported before the lock: in a process the launcher armed
    # (HOSTKV_RS_SGLANG=1), the first `import sglang` runs install() from its hook, which would
    # otherwise wait for this call's lock on this very thread. What fails here is reported below.
    with contextlib.suppress(Exception):
        importlib.import_module("sglang")
    with _lock:
        imported, failures = _import_known()
        if not imported:
            raise ImportError(
                "hostkv_rs.sglang.install(): SGLang is not importable "
                f"({'; '.join(f'{k}: {v}' for k, v in failures.items())})"
            )
        for name, exc in failures.items():
            missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
            # The module, or a package above it, is not in this release.
            absent = missing is not None and (name == missing or name.startswith(missing + "."))
            if absent or name not in KNOWN_MODULES:
                # Not in this release (or a platform-only pool module): nothing to patch there.
                logger.debug("hostkv_rs.sglang.install(): skipped %s (%s)", name, exc)
            else:
                # It exists but did not import: what it defines stays SGLang's, for importers
                # too, until install() runs again after it imports.
                logger.warning(
                    "hostkv_rs.sglang.install(): %s did not import (%s: %s); the host pools it "
                    "defines or imports stay SGLang's there until install() runs again",
                    name,
                    type(exc).__name__,
                    exc,
                )
        originals = _originals(ours)
        done: dict[str, list[str]] = {}
        for module_name, module in sorted(_sglang_modules().items()):
            for name, original in originals.items():
                if getattr(module, name, None) is not original:
                    continue
                # A module defining SGLang's own subclasses (mha_mxfp8, qsa) keeps the name, so
                # nothing there resolves the base to ours; the defining module is always patched
                # (its subclasses call the base through super(), never by name).
                if module_name == DEFINED_IN[name] or not _subclasses_in(module, original):
                    _patched.setdefault((module_name, name), original)
                    setattr(module, name, ours[name])
                    done.setdefault(module_name, []).append(name)
        _register_with_sglang(ours, originals)
        _handover.set_originals(
            {ours[n]: originals[n] for n in originals if isinstance(originals[n], type)}
        )
        if _release is None:
            _release = detect_release()
            logger.info(
                "hostkv_rs: SGLang %s (%s constructors) now builds hostkv_rs host pools",
                _release.version,
                _release.api,
            )
        return done


def _originals(ours: dict[str, object]) -> dict[str, object]:
    """SGLang's own object per name, as its defining module holds it (or held it before an earlier
    install())."""
    found = {}
    for name, module_name in DEFINED_IN.items():
        module = sys.modules.get(module_name)
        if module is None:
            continue
        value = _patched.get((module_name, name), getattr(module, name, None))
        if value is not None and value is not ours[name]:
            found[name] = value
    return found


def _register(abc_cls: type, subclass: type) -> None:
    """`abc_cls.register(subclass)`, remembering `abc_cls`'s registry first for uninstall()."""
    if not isinstance(abc_cls, abc.ABCMeta) or issubclass(subclass, abc_cls):
        return
    if abc_cls not in _registries:
        _registries[abc_cls] = list(abc._get_dump(abc_cls)[0])
    abc_cls.register(subclass)


def _register_with_sglang(ours: dict[str, object], originals: dict[str, object]) -> None:
    import hostkv_rs

    base = sys.modules.get(_BASE_MODULE)
    sglang_base = getattr(base, "HostKVCache", None)
    if isinstance(sglang_base, type):
        # Every hostkv_rs pool answers isinstance(pool, SGLang's HostKVCache) as SGLang's do.
        _register(sglang_base, hostkv_rs.HostKVCache)
    for name, original in originals.items():
        mine = ours[name]
        if not (isinstance(original, type) and isinstance(mine, type)):
            continue
        _register(original, mine)
        # SGLang's own subclasses of a class we replaced still pass checks against its name.
        for sub in _all_subclasses(original):
            if not sub.__module__.startswith("hostkv_rs"):
                _register(mine, sub)


def _subclasses_in(module, original) -> bool:
    """Whether `module` defines one of SGLang's own subclasses of `original`."""
    if not isinstance(original, type):
        return False
    return any(sub.__module__ == module.__name__ for sub in _all_subclasses(original))


def _all_subclasses(cls: type) -> list[type]:
    seen, stack = [], list(cls.__subclasses__())
    while stack:
        sub = stack.pop()
        if sub not in seen:
            seen.append(sub)
            stack.extend(sub.__subclasses__())
    return seen


def uninstall() -> dict[str, list[str]]:
    """Restore every attribute and ABC registration `install()` changed. Returns {module name:
    [restored names]}."""
    global _release
    with _lock:
        restored: dict[str, list[str]] = {}
        ours = _replacements()
        by_name = {name: original for (_, name), original in _patched.items()}
        for (module_name, name), original in list(_patched.items()):
            module = sys.modules.get(module_name)
            if module is not None:
                setattr(module, name, original)
                restored.setdefault(module_name, []).append(name)
            del _patched[(module_name, name)]
        # Modules imported while installed bound ours through the patched defining modules.
        for module_name, module in sorted(_sglang_modules().items()):
            for name, original in by_name.items():
                if getattr(module, name, None) is ours[name]:
                    setattr(module, name, original)
                    restored.setdefault(module_name, []).append(name)
        for abc_cls, registry in _registries.items():
            abc_cls._abc_registry_clear()
            abc_cls._abc_caches_clear()
            for ref in registry:
                cls = ref()
                if cls is not None:
                    abc_cls.register(cls)
        _registries.clear()
        _handover.set_originals({})
        _release = None
        return restored


def installed() -> bool:
    return bool(_patched) or bool(_registries)


def _sglang_modules() -> dict[str, object]:
    return {
        name: module
        for name, module in list(sys.modules.items())
        if module is not None and (name == "sglang" or name.startswith("sglang."))
    }
