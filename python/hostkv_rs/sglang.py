"""Make an installed SGLang build hostkv_rs host pools.

`install()` replaces SGLang's host pool classes and `get_mha_host_pool_cls` wherever SGLang looks
them up: the defining modules (`sglang.srt.mem_cache.pool_host.*`, `memory_pool_host`) and every
already-imported `sglang.*` module that bound one of them with `from ... import X` (for example
`hiradix_cache` or the hybrid pool assembler). Modules imported later pick up our classes from the
patched defining modules. `uninstall()` puts every original back.

    import hostkv_rs.sglang
    hostkv_rs.sglang.install()   # before SGLang builds its HiCache pools
"""

from __future__ import annotations

import importlib
import sys
import threading

# The modules SGLang defines or re-exports the host pools in; imported by install().
KNOWN_MODULES = (
    "sglang.srt.mem_cache.pool_host",
    "sglang.srt.mem_cache.pool_host.base",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.memory_pool_host",
    "sglang.srt.mem_cache.hiradix_cache",
)

NAMES = (
    "HostKVCache",
    "MHATokenToKVPoolHost",
    "AsymmetricMHATokenToKVPoolHost",
    "MLATokenToKVPoolHost",
    "DeepSeekV4PagedHostPool",
    "LogicalHostPool",
    "get_mha_host_pool_cls",
)

_lock = threading.Lock()
# (module name, attribute) -> SGLang's original object, for uninstall().
_patched: dict[tuple[str, str], object] = {}


def _replacements() -> dict[str, object]:
    import hostkv_rs

    return {name: getattr(hostkv_rs, name) for name in NAMES}


def install() -> dict[str, list[str]]:
    """Patch SGLang to use hostkv_rs pools. Returns {module name: [patched attributes]} for this
    call (empty when already installed). Raises ImportError when SGLang is not importable."""
    ours = _replacements()
    with _lock:
        imported, failures = [], {}
        for name in KNOWN_MODULES:
            try:
                imported.append(importlib.import_module(name))
            except ImportError as exc:
                failures[name] = exc
        if not imported:
            raise ImportError(
                "hostkv_rs.sglang.install(): SGLang is not importable "
                f"({'; '.join(f'{k}: {v}' for k, v in failures.items())})"
            )
        # SGLang's own objects, by name, as its defining modules hold them (or held them before
        # an earlier install()).
        originals: dict[str, list[object]] = {name: [] for name in NAMES}
        for module in imported:
            for name in NAMES:
                value = _patched.get((module.__name__, name), getattr(module, name, None))
                fresh = all(value is not seen for seen in originals[name])
                if value is not None and value is not ours[name] and fresh:
                    originals[name].append(value)

        done: dict[str, list[str]] = {}
        for module_name, module in sorted(_sglang_modules().items()):
            for name in NAMES:
                if not hasattr(module, name):
                    continue
                current = getattr(module, name)
                if current is ours[name]:
                    continue
                known = module in imported
                if known or any(current is orig for orig in originals[name]):
                    _patched.setdefault((module_name, name), current)
                    setattr(module, name, ours[name])
                    done.setdefault(module_name, []).append(name)
        return done


def uninstall() -> dict[str, list[str]]:
    """Restore every attribute `install()` replaced. Returns {module name: [restored names]}."""
    with _lock:
        restored: dict[str, list[str]] = {}
        for (module_name, name), original in list(_patched.items()):
            module = sys.modules.get(module_name)
            if module is not None:
                setattr(module, name, original)
                restored.setdefault(module_name, []).append(name)
            del _patched[(module_name, name)]
        return restored


def installed() -> bool:
    return bool(_patched)


def _sglang_modules() -> dict[str, object]:
    return {
        name: module
        for name, module in list(sys.modules.items())
        if module is not None and (name == "sglang" or name.startswith("sglang."))
    }
