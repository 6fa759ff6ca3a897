#!/usr/bin/env python3
"""Import-check the SGLang HiCache modules that hostkv_rs replaces/plugs into.

Run it with the python of a venv made by ``scripts/sglang_venv.sh``::

    ~/.cache/hostkv_rs/sglang-venvs/0.5.23/bin/python scripts/sglang_import_check.py

Every module is imported in a fresh interpreter state of this process (in
order, so later ones reuse what earlier ones already imported) and reported as
``OK``/``FAIL``/``SKIP``. A module is ``SKIP`` when its source file is not part
of the installed SGLang release (e.g. ``hiradix_cache`` is gone in 0.5.21+,
``device_pool_info`` only exists from 0.5.22). Presence is decided from the
files of the installed ``sglang`` package, without importing anything, so a
broken parent package is reported as FAIL, not silently skipped.

Exit status: 0 when every present module imported, 1 when any failed, 2 when
``sglang`` itself cannot be found.

Options:
  --extra MOD [MOD ...]  additional dotted module names to check (same rules).
  --only MOD [MOD ...]   check just these modules instead of the default list.
  --quiet                print only failures and the summary line.
  --no-pool-host-scan    don't add every ``pool_host/*.py`` module automatically.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
import traceback
from pathlib import Path

# Modules every CI job cares about. ``pool_host`` submodules are discovered
# from the installed release and inserted right after the package itself.
DEFAULT_MODULES = [
    "sglang.srt.mem_cache.pool_host",
    # (pool_host/*.py inserted here)
    "sglang.srt.mem_cache.memory_pool_host",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
    "sglang.srt.mem_cache.l2_transfer",
    "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.hiradix_cache",  # <= 0.5.20
    "sglang.srt.mem_cache.unified_radix_cache",  # HiCache radix tree, 0.5.21+
    "sglang.srt.managers.hisparse_coordinator",
    "sglang.srt.mem_cache.device_pool_info",  # >= 0.5.22
    "sglang.srt.mem_cache.storage.backend_factory",
    "sglang.srt.mem_cache.storage.mooncake_store.mooncake_store",
    "sglang.srt.mem_cache.deepseek_v4_memory_pool",
]

POOL_HOST_PKG = "sglang.srt.mem_cache.pool_host"


def sglang_root() -> Path | None:
    # find_spec on a top-level name does not execute the package.
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def module_present(root: Path, dotted: str) -> bool:
    """True when the source of ``dotted`` exists in the installed sglang.

    Directories without ``__init__.py`` count (``hybrid_cache`` is a namespace
    package). Compiled extension modules (``*.so``) count too.
    """
    parts = dotted.split(".")
    if parts[0] != "sglang":
        # Not ours to locate by path: fall back to find_spec of the parent.
        parent = ".".join(parts[:-1])
        try:
            if parent and importlib.util.find_spec(parent) is None:
                return False
            return importlib.util.find_spec(dotted) is not None
        except Exception:  # noqa: BLE001 - the import below reports it
            return True
    base = root.joinpath(*parts[1:])
    if base.is_dir():
        return True
    if base.with_suffix(".py").is_file():
        return True
    return any(base.parent.glob(base.name + ".*.so")) if base.parent.is_dir() else False


def pool_host_modules(root: Path) -> list[str]:
    d = root / "srt" / "mem_cache" / "pool_host"
    if not d.is_dir():
        return []
    return [f"{POOL_HOST_PKG}.{p.stem}" for p in sorted(d.glob("*.py")) if p.stem != "__init__"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extra", nargs="*", default=[])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--no-pool-host-scan", action="store_true")
    args = ap.parse_args(argv)

    root = sglang_root()
    if root is None:
        print(f"FAIL sglang: package not found on sys.path (python={sys.executable})")
        return 2

    try:
        from importlib.metadata import version

        sgl_version = version("sglang")
    except Exception:  # noqa: BLE001 - metadata missing
        sgl_version = "?"
    print(f"# sglang {sgl_version} at {root}")
    print(f"# python {sys.version.split()[0]} ({sys.executable})")
    try:
        import torch

        print(f"# torch {torch.__version__}, cuda available: {torch.cuda.is_available()}")
    except Exception as e:  # noqa: BLE001
        print(f"# torch import failed: {e!r}")

    if args.only is not None:
        modules = list(args.only)
    else:
        modules = list(DEFAULT_MODULES)
        if not args.no_pool_host_scan:
            i = modules.index(POOL_HOST_PKG) + 1
            modules[i:i] = pool_host_modules(root)
    modules += [m for m in args.extra if m not in modules]

    ok = fail = skip = 0
    t_all = time.perf_counter()
    for mod in modules:
        if not module_present(root, mod):
            skip += 1
            if not args.quiet:
                print(f"SKIP {mod} (not in sglang {sgl_version})")
            continue
        t0 = time.perf_counter()
        before = set(sys.modules)
        try:
            importlib.import_module(mod)
        except BaseException as e:  # noqa: BLE001 - SystemExit, ImportError, anything
            # Drop the sglang modules the failed import left half-initialised
            # (e.g. ``sglang.srt`` without ``sglang``) so the next module gets
            # a clean attempt and reports its own error, not a KeyError.
            # Third-party modules stay: re-importing native extensions such as
            # triton's nanobind module aborts the interpreter.
            for name in set(sys.modules) - before:
                if name == "sglang" or name.startswith("sglang."):
                    sys.modules.pop(name, None)
            fail += 1
            dt = time.perf_counter() - t0
            print(f"FAIL {mod} ({dt:.2f}s): {type(e).__name__}: {e}")
            tb = traceback.format_exc().rstrip().splitlines()
            for line in tb[-12:]:
                print(f"     | {line}")
            continue
        ok += 1
        dt = time.perf_counter() - t0
        if not args.quiet:
            print(f"OK   {mod} ({dt:.2f}s)")
    total = time.perf_counter() - t_all
    print(f"# sglang {sgl_version}: {ok} ok, {fail} failed, {skip} skipped in {total:.1f}s")
    return 1 if fail else 0


if __name__ == "__main__":
    # Line-buffer so CI logs interleave sanely with SGLang's warnings (stderr).
    sys.stdout.reconfigure(line_buffering=True)
    sys.exit(main())
