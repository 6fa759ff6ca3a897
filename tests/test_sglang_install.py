"""hostkv_rs.sglang.install() against a stand-in `sglang` package tree (fast, no SGLang needed;
tests/sglang/ runs the same against SGLang's real releases): every lookup site gets our classes,
SGLang's HostKVCache and its other pools are left alone and still pass its isinstance checks,
unrelated objects are left alone, and uninstall() restores everything."""

from __future__ import annotations

import importlib
import sys
import textwrap

import hostkv_rs
import pytest
import torch
from hostkv_rs import sglang as shim

POOL_HOST = {
    "base.py": """
        import abc

        class HostKVCache(abc.ABC):
            pass
    """,
    "mha.py": """
        from sglang.srt.mem_cache.pool_host.base import HostKVCache

        class MHATokenToKVPoolHost(HostKVCache):
            pass

        class AsymmetricMHATokenToKVPoolHost(MHATokenToKVPoolHost):
            pass

        class HiSparseMHATokenToKVPoolHost(MHATokenToKVPoolHost):
            pass  # SGLang's own pool subclassing a class install() replaces

        class MHATokenToKOnlyPoolHost(HostKVCache):
            pass  # SGLang's own pool hostkv_rs never replaces

        def get_mha_host_pool_cls(device_pool):
            if device_pool.head_dim != device_pool.v_head_dim:
                return AsymmetricMHATokenToKVPoolHost
            return MHATokenToKVPoolHost
    """,
    "mla.py": """
        from sglang.srt.mem_cache.pool_host.base import HostKVCache

        class MLATokenToKVPoolHost(HostKVCache):
            pass
    """,
    "__init__.py": """
        from sglang.srt.mem_cache.pool_host.base import HostKVCache
        from sglang.srt.mem_cache.pool_host.mha import (
            AsymmetricMHATokenToKVPoolHost,
            MHATokenToKVPoolHost,
        )
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    """,
}
MEM_CACHE = {
    "__init__.py": "",
    "memory_pool_host.py": """
        from sglang.srt.mem_cache.pool_host import (
            HostKVCache,
            MHATokenToKVPoolHost,
            MLATokenToKVPoolHost,
        )

        class DeepSeekV4PagedHostPool(HostKVCache):
            pass

        class LogicalHostPool:
            pass
    """,
    "hiradix_cache.py": """
        from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        def build_host_pool(device_pool, layout):
            if hasattr(device_pool, "kv_lora_rank"):
                return MLATokenToKVPoolHost(device_pool, 2.0, 0, device_pool.page_size, layout)
            cls = get_mha_host_pool_cls(device_pool)
            return cls(device_pool, 2.0, 0, device_pool.page_size, layout)
    """,
}
# Imported before install(): it bound the originals with `from ... import`, so the scan must find
# it. `other_module` has an unrelated attribute that merely shares a name.
EXTRA = {
    "sglang/srt/mem_cache/hybrid_cache/__init__.py": "",
    "sglang/srt/mem_cache/hybrid_cache/hybrid_pool_assembler.py": """
        from sglang.srt.mem_cache.pool_host.mha import (
            MHATokenToKVPoolHost,
            get_mha_host_pool_cls,
        )
    """,
    "sglang/srt/other_module.py": """
        class HostKVCache:
            '''Not SGLang's pool class, only the same name.'''
    """,
}


@pytest.fixture
def fake_sglang(tmp_path, monkeypatch):
    # An earlier test may have looked SGLang up (a storage allocator type asks for its module):
    # whatever that left in sys.modules must not shadow the fake package.
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        del sys.modules[name]
    files = {"sglang/__init__.py": "", "sglang/srt/__init__.py": ""}
    files.update({f"sglang/srt/mem_cache/pool_host/{k}": v for k, v in POOL_HOST.items()})
    files.update({f"sglang/srt/mem_cache/{k}": v for k, v in MEM_CACHE.items()})
    files.update(EXTRA)
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield
    shim.uninstall()
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        del sys.modules[name]


def test_install_without_any_sglang_says_so_once(monkeypatch):
    monkeypatch.setattr(shim.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ImportError) as exc:
        shim.install()
    text = str(exc.value)
    assert "SGLang is not importable: it is not installed" in text and "pip install sglang" in text
    assert text.count("sglang") <= 3, text  # one reason, not one per module


def test_install_without_sglang_raises_import_error(monkeypatch):
    monkeypatch.setattr(shim, "KNOWN_MODULES", ("sglang_definitely_absent.pool_host",))
    with pytest.raises(ImportError, match="SGLang is not importable"):
        shim.install()


def test_install_patches_every_lookup_site(fake_sglang):
    assembler = importlib.import_module("sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler")
    other = importlib.import_module("sglang.srt.other_module")
    original_mha = assembler.MHATokenToKVPoolHost
    unrelated = other.HostKVCache

    patched = shim.install()

    base = sys.modules["sglang.srt.mem_cache.pool_host.base"]
    mha = sys.modules["sglang.srt.mem_cache.pool_host.mha"]
    mla = sys.modules["sglang.srt.mem_cache.pool_host.mla"]
    package = sys.modules["sglang.srt.mem_cache.pool_host"]
    mph = sys.modules["sglang.srt.mem_cache.memory_pool_host"]
    hiradix = sys.modules["sglang.srt.mem_cache.hiradix_cache"]

    sglang_base = base.HostKVCache
    assert sglang_base is not hostkv_rs.HostKVCache  # never replaced: SGLang's pools derive it
    assert mha.MHATokenToKVPoolHost is hostkv_rs.MHATokenToKVPoolHost
    assert mha.AsymmetricMHATokenToKVPoolHost is hostkv_rs.AsymmetricMHATokenToKVPoolHost
    assert mha.get_mha_host_pool_cls is hostkv_rs.get_mha_host_pool_cls
    assert mla.MLATokenToKVPoolHost is hostkv_rs.MLATokenToKVPoolHost
    assert package.MHATokenToKVPoolHost is hostkv_rs.MHATokenToKVPoolHost
    assert mph.MLATokenToKVPoolHost is hostkv_rs.MLATokenToKVPoolHost
    assert mph.DeepSeekV4PagedHostPool is hostkv_rs.DeepSeekV4PagedHostPool
    assert mph.LogicalHostPool is hostkv_rs.LogicalHostPool
    assert hiradix.get_mha_host_pool_cls is hostkv_rs.get_mha_host_pool_cls
    assert assembler.MHATokenToKVPoolHost is hostkv_rs.MHATokenToKVPoolHost
    assert assembler.get_mha_host_pool_cls is hostkv_rs.get_mha_host_pool_cls
    assert other.HostKVCache is unrelated  # same name, different object: untouched

    assert "get_mha_host_pool_cls" in patched["sglang.srt.mem_cache.hiradix_cache"]
    assert (
        "MHATokenToKVPoolHost" in patched["sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"]
    )
    assert "sglang.srt.other_module" not in patched
    assert shim.installed()
    assert shim.install() == {}  # idempotent

    # SGLang's construction path now builds our pools, and they pass SGLang's isinstance checks.
    dp = hostkv_rs.MHATokenToKVPool(32, 4, torch.bfloat16, 2, 8, 3, v_head_dim=4)
    pool = hiradix.build_host_pool(dp, "page_first")
    assert type(pool) is hostkv_rs.AsymmetricMHATokenToKVPoolHost
    assert isinstance(pool, sglang_base) and isinstance(pool, original_mha)
    # SGLang's own pools: still SGLang's classes, still instances of every name they were.
    k_only = mha.MHATokenToKOnlyPoolHost()
    hisparse = mha.HiSparseMHATokenToKVPoolHost()
    assert isinstance(k_only, sglang_base) and isinstance(hisparse, sglang_base)
    assert isinstance(hisparse, assembler.MHATokenToKVPoolHost)  # the name now means ours
    mla_dp = hostkv_rs.MLATokenToKVPool(32, 4, torch.bfloat16, 12, 4, 3)
    assert type(hiradix.build_host_pool(mla_dp, "layer_first")) is hostkv_rs.MLATokenToKVPoolHost

    # A module imported after install() binds our classes through the patched modules.
    late = importlib.import_module("sglang.srt.mem_cache.memory_pool_host")
    assert late.MHATokenToKVPoolHost is hostkv_rs.MHATokenToKVPoolHost

    restored = shim.uninstall()
    assert assembler.MHATokenToKVPoolHost is original_mha
    assert mha.MHATokenToKVPoolHost is original_mha
    assert base.HostKVCache is sglang_base
    assert not isinstance(pool, sglang_base)  # the ABC registrations are gone too
    assert not issubclass(mha.HiSparseMHATokenToKVPoolHost, hostkv_rs.MHATokenToKVPoolHost)
    assert hiradix.get_mha_host_pool_cls is mha.get_mha_host_pool_cls
    assert mha.get_mha_host_pool_cls is not hostkv_rs.get_mha_host_pool_cls
    assert set(restored) >= {
        "sglang.srt.mem_cache.pool_host.mha",
        "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler",
    }
    assert not shim.installed()
    assert shim.uninstall() == {}


def test_install_survives_a_missing_optional_module(fake_sglang, monkeypatch):
    monkeypatch.setattr(
        shim, "KNOWN_MODULES", (*shim.KNOWN_MODULES, "sglang.srt.mem_cache.not_in_this_version")
    )
    patched = shim.install()
    assert "sglang.srt.mem_cache.pool_host.mha" in patched
