"""install() / uninstall() against the real SGLang: what install() changes is exactly the
construction sites, and uninstall() puts back every module attribute and every ABC registration.
"""

from __future__ import annotations

import abc
import sys
import types

import pytest
import sgl_harness as H

# SGLang packages whose module attributes install() may touch (and nothing else may change).
WATCHED = ("sglang.srt.mem_cache", "sglang.srt.managers", "sglang.srt.disaggregation")


def _module_state() -> dict[tuple[str, str], int]:
    """id() of every attribute of every loaded SGLang module under WATCHED."""
    state = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(WATCHED):
            continue
        for attr, value in list(vars(module).items()):
            # Submodules install() imported appear as package attributes: new modules loaded,
            # nothing of SGLang's changed.
            if not isinstance(value, types.ModuleType):
                state[(name, attr)] = id(value)
    return state


def _abc_registries() -> dict[str, set]:
    """Each SGLang ABC host-pool class's registry of virtual subclasses (as classes)."""
    out = {}
    for name, cls in H.ORIG_CLASSES.items():
        if isinstance(cls, abc.ABCMeta):
            registry = abc._get_dump(cls)[0]
            out[name] = {ref() for ref in registry if ref() is not None}
    return out


OUR_BASES = {
    "MHATokenToKVPoolHost": ("HostKVCache", "MHATokenToKVPoolHost"),
    "AsymmetricMHATokenToKVPoolHost": (
        "HostKVCache",
        "MHATokenToKVPoolHost",
        "AsymmetricMHATokenToKVPoolHost",
    ),
    "MLATokenToKVPoolHost": ("HostKVCache", "MLATokenToKVPoolHost"),
    "DeepSeekV4PagedHostPool": ("HostKVCache", "DeepSeekV4PagedHostPool"),
}


def test_install_uninstall_restores_everything(hk):
    import hostkv_rs.sglang as shim

    # import what install() may touch first, so the snapshot covers it
    for name in ("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",):
        H.module_or_none(name)
    modules_before = _module_state()
    registries_before = _abc_registries()
    assert not shim.installed()

    patched = shim.install()
    assert shim.installed()
    assert patched, "install() reported nothing patched"
    modules_during = _module_state()
    changed = sorted(k for k in modules_before if modules_during.get(k) != modules_before[k])
    H.REPORT.append(f"install() changed {len(changed)} module attributes: {changed}")
    assert changed, "install() changed no module attribute"
    unexpected = [k for k in changed if k[1] not in H.REPLACED]
    assert not unexpected, (
        f"install() replaced attributes outside the construction sites: {unexpected}"
    )
    assert H.ph_base.HostKVCache is H.ORIG["HostKVCache"]
    for ours, bases in OUR_BASES.items():
        cls = getattr(hk, ours)
        for base in bases:
            assert issubclass(cls, H.ORIG[base]), f"{ours} is not registered with SGLang's {base}"

    shim.install()  # idempotent: a second install() changes nothing more
    assert shim.installed()
    again = _module_state()
    assert not [k for k in modules_during if again.get(k, modules_during[k]) != modules_during[k]]
    shim.uninstall()
    assert not shim.installed()
    modules_after = _module_state()
    not_restored = sorted(
        k for k in modules_before if k in modules_after and modules_after[k] != modules_before[k]
    )
    assert not not_restored, f"uninstall() left these changed: {not_restored}"
    # every module loaded before install() keeps exactly its attribute names
    added = sorted(
        k for k in modules_after if k not in modules_before and (k[0], "__name__") in modules_before
    )
    assert not added, f"install()/uninstall() left new attributes behind: {added}"
    assert _abc_registries() == registries_before, "ABC registrations not undone"
    for ours, bases in OUR_BASES.items():
        cls = getattr(hk, ours)
        for base in bases:
            assert not issubclass(cls, H.ORIG[base]), (
                f"after uninstall(), {ours} is still a subclass of SGLang's {base} "
                "(ABC caches not reset?)"
            )
    shim.uninstall()  # harmless when not installed
    assert not shim.installed()


def test_install_twice_then_uninstall_once(hk):
    import hostkv_rs.sglang as shim

    before = _module_state()
    shim.install()
    shim.install()
    shim.uninstall()
    after = _module_state()
    assert not shim.installed()
    assert all(after.get(k, v) == v for k, v in before.items())
    for name in H.REPLACED:
        assert getattr(H._DEFINING[name], name) is H.ORIG[name], name


def test_a_known_module_that_does_not_import_is_a_warning(hk, monkeypatch, caplog):
    # A module install() patches that exists but fails to import (a missing dependency) keeps
    # SGLang's pools there: said at WARNING, naming it; a module this release lacks is debug.
    import importlib
    import logging

    import hostkv_rs.sglang as shim

    broken, absent = shim.KNOWN_MODULES[-1], "sglang.srt.mem_cache.hiradix_cache"
    # A release without the package above a module: the error names the package.
    below = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"
    real = importlib.import_module

    def import_module(name, package=None):
        if name == broken:
            raise ImportError("cannot import name 'x' from 'sgl_kernel'", name="sgl_kernel")
        if name == absent:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        if name == below:
            package_name = name.rsplit(".", 1)[0]
            raise ModuleNotFoundError(f"No module named {package_name!r}", name=package_name)
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", import_module)
    caplog.set_level(logging.DEBUG, logger="hostkv_rs")
    try:
        shim.install()
    finally:
        monkeypatch.undo()
        shim.uninstall()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and broken in warned[0].getMessage(), caplog.text
    assert "sgl_kernel" in warned[0].getMessage()
    for quiet in (absent, below):
        assert any(quiet in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)


def test_reinstall_round_trip(hk, publish):
    """install -> uninstall -> install builds ours again; uninstall -> SGLang's again."""
    import hostkv_rs.sglang as shim

    dev = H.mha_device()
    for _ in range(2):
        shim.install()
        publish(page_size=dev.page_size, hicache_mem_layout="page_first")
        assert H.is_ours(H.build_kv_host_pool(kv_pool=dev, page_size=16, use_mla=False))
        shim.uninstall()
        with H.sglang_cpu_alloc():
            pool = H.build_kv_host_pool(kv_pool=dev, page_size=16, use_mla=False)
        assert H.is_sglangs(pool)


@pytest.mark.parametrize("name", H.REPLACED)
def test_installed_module_attributes(name, installed, hk):
    assert getattr(H._DEFINING[name], name) is getattr(hk, name)
