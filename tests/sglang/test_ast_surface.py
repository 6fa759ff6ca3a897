"""The attributes and methods SGLang's consumers read on a host pool, derived from the installed
release's source (an AST scan, not a hand-written list), must all exist on hostkv_rs pools.

Scanned: the HiCache controllers, the L2 transfer engine, the host pool group, HiRadixCache
(up to 0.5.20), the HiSparse coordinator and every storage backend. Collected: `X.name` (and `getattr(X, "name")`,
`hasattr(X, "name")`) where X is a host-pool expression: its last identifier is one of
HOST_RECEIVERS (`self.mem_pool_host`, `transfer.host_pool`, `entry.host_pool`,
`anchor.host_pool`, `self.storage_host_pool`, `host_pool`, `mem_pool_host`, `pool`, ...).
Per pool kind the list is intersected with what SGLang's OWN equivalent pool instance has (so
attributes of the pool group, device pools or other objects sharing a receiver name drop out),
and every remaining name must be present on our pool built from the same arguments.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path

import pytest
import sgl_harness as H

HOST_RECEIVERS = {
    "mem_pool_host",
    "memory_pool_host",
    "storage_host_pool",
    "host_pool",
    "mem_pool",
    "anchor_host",
    "kv_host_pool",
    "token_to_kv_pool_host",
    "draft_host_pool",
    "target_host_pool",
    "target_swa_host_pool",
    "mha_pool",
    "mla_pool",
    "asymmetric_pool",
    "pool",
}
CONSUMER_MODULES = (
    "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
    "sglang.srt.mem_cache.l2_transfer",
    "sglang.srt.mem_cache.pool_host.group",  # 0.5.19+
    "sglang.srt.mem_cache.memory_pool_host",  # the pool group lives here in 0.5.18
    "sglang.srt.mem_cache.hiradix_cache",  # up to 0.5.20
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.managers.hisparse_coordinator",
)
STORAGE_PACKAGE = "sglang.srt.mem_cache.storage"


def _receiver(node: ast.AST) -> str | None:
    """The last identifier of a receiver expression: `self.mem_pool_host` -> mem_pool_host."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _file_of(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)


@cache
def consumer_files() -> tuple[Path, ...]:
    files = [f for m in CONSUMER_MODULES if (f := _file_of(m)) is not None]
    spec = importlib.util.find_spec(STORAGE_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            files += sorted(p for p in Path(root).rglob("*.py") if "test" not in p.name)
    return tuple(files)


@cache
def scanned_names() -> dict[str, set[Path]]:
    """{attribute name: files reading it on a host-pool expression}."""
    found: dict[str, set[Path]] = {}
    for path in consumer_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute) and _receiver(node.value) in HOST_RECEIVERS:
                name = node.attr
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and _receiver(node.args[0]) in HOST_RECEIVERS
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                name = node.args[1].value
            if name is not None:
                found.setdefault(name, set()).add(path)
    return found


def _has(obj, name: str) -> bool:
    """hasattr, except that an attribute whose getter raises something other than
    AttributeError still counts as present (it exists; it refuses this state)."""
    try:
        getattr(obj, name)
    except AttributeError:
        return False
    except Exception:  # noqa: BLE001
        return True
    return True


def _mha_like(kind, layout):
    def build():
        if kind == "asym":
            dev = H.mha_device(head_dim=16, v_head_dim=8)
        else:
            dev = H.mha_device()
        return H.recorded_kv_host_call(dev, use_mla=False, layout=layout)

    return build


def _mla(layout):
    def build():
        return H.recorded_kv_host_call(H.mla_device(), use_mla=True, layout=layout)

    return build


POOLS = {
    "MHA layer_first": _mha_like("mha", "layer_first"),
    "MHA page_first": _mha_like("mha", "page_first"),
    "MHA page_head": _mha_like("mha", "page_head"),
    "MHA page_first_direct": _mha_like("mha", "page_first_direct"),
    "AsymmetricMHA page_first": _mha_like("asym", "page_first"),
    "MLA layer_first": _mla("layer_first"),
    "MLA page_first": _mla("page_first"),
}


def _v4_calls(layout):
    H.publish(page_size=H.V4_PAGE, hicache_mem_layout=layout)
    with H.sglang_cpu_alloc():
        kv = H.v4_device()
        return H.recorded_v4_calls(kv, layout=layout)


def test_scan_is_nontrivial():
    names = scanned_names()
    files = consumer_files()
    H.REPORT.append(
        f"AST scan: {len(names)} attribute names read on host-pool expressions in "
        f"{len(files)} files"
    )
    assert len(files) >= 4, files
    for required in ("alloc", "free", "page_size", "layout", "size_per_token"):
        assert required in names, f"{required!r} not found: the scan is broken"
    if H.at_least(0, 5, 21):
        for required in (
            "prepare_transfer_indices",
            "backup_from_device_all_layer_physical",
            "load_to_device_per_layer_physical",
        ):
            assert required in names, f"{required!r} not found in the 0.5.21+ engine"
    else:
        assert "backup_from_device_all_layer" in names and "load_to_device_per_layer" in names


def _check(label, theirs, ours):
    names = scanned_names()
    required = sorted(n for n in names if _has(theirs, n))
    missing = [n for n in required if not _has(ours, n)]
    H.REPORT.append(
        f"{label}: {len(required)} read and present on SGLang's pool: " + ", ".join(required)
    )
    return required, missing


@pytest.mark.parametrize("label", list(POOLS))
def test_consumer_surface(label, hk):
    call = POOLS[label]()
    assert call.pool is not None
    required, missing = _check(label, call.pool, call.ours())
    assert len(required) >= 10, required
    where = {n: sorted(p.name for p in scanned_names()[n]) for n in missing}
    assert not missing, f"{label}: missing on hostkv_rs's pool (read in): {where}"


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_consumer_surface_v4(layout, hk):
    problems = {}
    for call in _v4_calls(layout):
        label = f"{call.name} {layout} ({call.kwargs.get('pool_name', '')})"
        _, missing = _check(label, call.pool, call.ours())
        if missing:
            problems[label] = missing
    assert not problems, f"missing on hostkv_rs's pools: {problems}"
