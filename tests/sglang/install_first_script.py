"""Run by test_construction.py::test_install_before_import in a fresh interpreter:
hostkv_rs.sglang.install() FIRST, then SGLang's modules are imported and its construction
sites and other host pools exercised. Prints one JSON line: {"checks": {name: True | "why"}}.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import hostkv_rs.sglang as shim

os.environ["HOSTKV_SGLANG_INSTALL_FIRST"] = "1"
PRE_IMPORTED = sorted(n for n in sys.modules if n == "sglang" or n.startswith("sglang."))
shim.install()

import hostkv_rs
import sgl_harness as H  # imports SGLang's modules: after install(), on purpose

checks: dict[str, object] = {}
_SHIMS = H.cpu_shims()  # for the controllers the V4 stack builds (see sgl_harness); kept
_SHIMS.__enter__()  # referenced so the generator is not closed (and the shims undone) by GC


def check(name):
    def run(fn):
        try:
            result = fn()
            checks[name] = True if result is None else result
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            checks[name] = f"{type(exc).__name__}: {exc} | " + " / ".join(
                line.strip() for line in traceback.format_exc().strip().splitlines()[-9:-1]
            )
        return fn

    return run


@check("HostKVCache is SGLang's (never replaced)")
def _():
    assert H.ph_base.HostKVCache.__module__ == "sglang.srt.mem_cache.pool_host.base"


@check("defining modules hold ours")
def _():
    for name in H.REPLACED:
        module = H._DEFINING[name]
        assert getattr(module, name) is getattr(hostkv_rs, name), f"{module.__name__}.{name}"


@check("assembler module globals hold ours")
def _():
    for name in H.REPLACED:
        if hasattr(H.asm, name):
            assert getattr(H.asm, name) is getattr(hostkv_rs, name), name


@check("no SGLang host-pool class derives from hostkv_rs")
def _():
    classes = H.sglang_host_classes()
    assert classes, "found none"
    bad = [
        n
        for n, c in classes.items()
        if any(k.__module__.startswith("hostkv_rs") for k in c.__mro__)
    ]
    assert not bad, bad


def _build(kind, layout):
    dev = H.mla_device() if kind == "mla" else H.mha_device()
    H.publish(page_size=dev.page_size, hicache_mem_layout=layout)
    pool = H.build_kv_host_pool(kv_pool=dev, page_size=dev.page_size, use_mla=kind == "mla")
    assert H.is_ours(pool), type(pool)
    assert isinstance(pool, H.ph_base.HostKVCache)
    return pool


@check("build_kv_host_pool MHA -> ours")
def _():
    _build("mha", "page_first")


@check("build_kv_host_pool MLA -> ours")
def _():
    _build("mla", "layer_first")


@check("V4 stack: Logical/Paged ours, State SGLang's")
def _():
    H.publish(page_size=H.V4_PAGE, hicache_mem_layout="layer_first")
    with H.sglang_cpu_alloc():
        group, _ = H.v4_stack(H.v4_device())
    for entry in group.entries:
        pool, name = entry.host_pool, type(entry.host_pool).__name__
        if name in ("LogicalHostPool", "DeepSeekV4PagedHostPool"):
            assert H.is_ours(pool), (entry.name, type(pool))
        else:
            assert H.is_sglangs(pool) and isinstance(pool, H.ph_base.HostKVCache), entry.name


@check("SGLang's other pools construct, are SGLang's and HostKVCache instances")
def _():
    pools, notes = H.other_sglang_pools()
    assert pools, notes
    for label, pool in pools.items():
        assert H.is_sglangs(pool), (label, type(pool))
        assert isinstance(pool, H.ph_base.HostKVCache), label


@check("HiSparse MHA passes isinstance(pool, pool_host.mha.MHATokenToKVPoolHost)")
def _():
    if not H.at_least(0, 5, 21):
        return
    with H.sglang_cpu_alloc():
        pool = H.hisparse_mha()
    assert isinstance(pool, H.ph_mha.MHATokenToKVPoolHost)


@check("uninstall() restores SGLang's objects, also in modules imported while installed")
def _():
    # import every module that binds a replaced name (they bind ours: install() is active)
    for module_name, _name, how, _source in H.binding_sites():
        if how == "top":
            H.module_or_none(module_name.removesuffix(".__init__"))
    shim.uninstall()
    try:
        left = []
        for module_name, name, how, source in H.binding_sites():
            target = (source if how == "lazy" else module_name).removesuffix(".__init__")
            module = sys.modules.get(target)
            value = getattr(module, name, None) if module is not None else None
            if value is not None and not value.__module__.startswith("sglang."):
                left.append(f"{target}.{name}")
        assert not left, f"still hostkv_rs after uninstall(): {sorted(set(left))}"
    finally:
        shim.install()


shim.uninstall()
print(json.dumps({"checks": checks, "sglang_modules_imported_before_install": len(PRE_IMPORTED)}))
