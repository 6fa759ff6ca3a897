"""SGLang's own Mooncake backend (`StorageBackendFactory.create_backend("mooncake", ...)`) over
hostkv_rs pools, against a real `mooncake_master` on loopback.

Each case saves pages of one hostkv_rs pool through SGLang's backend and loads them into another
pool of the same kind, both registered with SGLang's client as a server would (the v1 interface
for the KV pools, v2 for a DeepSeek V4 side pool), and checks every byte. This exercises the L3
surface SGLang reads from a host pool: `get_page_buffer_meta` (incl. split heads and MLA DCP's
rank-local page), `get_hybrid_pool_buffer`, `get_ksize_per_token`, `page_size`, `kv_buffer`,
`storage_format_tag`. Skips when Mooncake is not installed (it comes from the system interpreter
through --system-site-packages: scripts/test.sh installs it there). Independent of sgl_harness.
"""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import os
import threading
import uuid

import pytest
import torch

MISSING = None
if importlib.util.find_spec("mooncake") is None:
    MISSING = "Mooncake is not installed (pip install mooncake-transfer-engine-non-cuda)"
else:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:  # its native libraries need libibverbs1 and libnuma1
        MISSING = f"Mooncake does not import here: {exc}"

pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))

PAGE = 16


def _mha(layout, *, heads=2, v_head_dim=None, page=PAGE, **kwargs):
    from hostkv_rs import MHATokenToKVPool, get_mha_host_pool_cls

    dev = MHATokenToKVPool(4 * page, page, torch.bfloat16, heads, 8, 3, v_head_dim=v_head_dim)
    return get_mha_host_pool_cls(dev)(dev, 2.0, 0, page, layout, **kwargs)


def _mla(layout, **kwargs):
    from hostkv_rs import MLATokenToKVPool, MLATokenToKVPoolHost

    dev = MLATokenToKVPool(4 * PAGE, PAGE, torch.bfloat16, 12, 4, 3)
    return MLATokenToKVPoolHost(dev, 2.0, 0, PAGE, layout, **kwargs)


def _v4(layout):
    from hostkv_rs import DeepSeekV4PagedHostPool

    dev = [torch.zeros(7, 656, dtype=torch.uint8) for _ in range(3)]
    return DeepSeekV4PagedHostPool("c4_kv", dev, 656, 6, 4, layout=layout)


def _dcp(rank):  # SGLang wants DCP groups inside TP: tp_rank % dcp_size == dcp_rank
    return {
        "is_mla_model": True,
        "tp_size": 2,
        "tp_rank": rank,
        "dcp_size": 2,
        "dcp_rank": rank,
        "logical_page_size": PAGE,  # the widened page; each rank holds PAGE // 2 slots of it
    }


# id -> (pool builder, storage config overrides)
CASES = {
    "mha-page_first": (lambda: _mha("page_first"), {}),
    "mha-page_first_direct": (lambda: _mha("page_first_direct"), {}),
    "mha-page_head": (lambda: _mha("page_head"), {}),
    "mha-page_head-split-heads": (
        lambda: _mha("page_head", heads=4),
        {"should_split_heads": True, "tp_lcm_size": 2},
    ),
    "mha-asym-page_first": (lambda: _mha("page_first", v_head_dim=4), {}),
    "mha-asym-page_first_direct": (lambda: _mha("page_first_direct", v_head_dim=4), {}),
    "mla-layer_first": (lambda: _mla("layer_first"), {"is_mla_model": True}),
    "mla-page_first": (lambda: _mla("page_first"), {"is_mla_model": True}),
    "mla-page_first_direct": (lambda: _mla("page_first_direct"), {"is_mla_model": True}),
    "mla-dcp2-rank1-layer_first": (
        lambda: _mla("layer_first", dcp_size=2, dcp_rank=1),
        _dcp(1),
    ),
    "mla-dcp2-rank1-page_first_direct": (
        lambda: _mla("page_first_direct", dcp_size=2, dcp_rank=1),
        _dcp(1),
    ),
    "v4-layer_first": (lambda: _v4("layer_first"), {"is_mla_model": True, "v2": True}),
    "v4-page_first_direct": (lambda: _v4("page_first_direct"), {"is_mla_model": True, "v2": True}),
}


def _slots(pool, pages):
    per = pool.page_size * int(getattr(pool, "dcp_size", 1) or 1)
    return torch.cat([torch.arange(p * per, (p + 1) * per) for p in pages])


def _page_bytes(pool, page):
    ptrs, sizes = pool.get_page_buffer_meta(_slots(pool, [page]))
    return b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes))


def _regions(pool):
    regions = list(getattr(pool, "_host_regions", None) or [])
    if getattr(pool, "_region", None) is not None:
        regions.append(pool._region)
    return regions


def _randomize(pool, seed):
    g = torch.Generator().manual_seed(seed)
    for r in _regions(pool):
        buf = (ctypes.c_char * r.nbytes).from_address(r.address)
        torch.frombuffer(buf, dtype=torch.uint8).random_(0, 256, generator=g)


@pytest.fixture(scope="module")
def master():
    from hostkv_rs.l3.master import LoopbackMaster

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    m = LoopbackMaster.start()
    yield m
    m.stop()
    m.remove_log()


@pytest.fixture(scope="module")
def backends(master):
    """SGLang MooncakeStore backends by storage-config signature, closed before the master
    stops (a client outliving its master spends ~10 s in its destructor)."""
    made = {}

    def get(overrides):
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.storage import StorageBackendFactory

        sig = tuple(sorted((k, v) for k, v in overrides.items() if k != "v2"))
        if sig not in made:
            fields = {
                "tp_rank": 0,
                "tp_size": 1,
                "pp_rank": 0,
                "pp_size": 1,
                "attn_cp_rank": 0,
                "attn_cp_size": 1,
                "is_mla_model": False,
                "enable_storage_metrics": False,
                "is_page_first_layout": False,
                "model_name": "hostkv-test",
                "extra_config": {
                    "master_server_address": master.address,
                    "metadata_server": master.metadata_server,
                    "protocol": "tcp",
                    "device_name": "",
                    "local_hostname": "127.0.0.1",
                    "global_segment_size": 64 << 20,
                    "check_server": False,
                },
            }
            fields.update({k: v for k, v in overrides.items() if k != "v2"})
            config = HiCacheStorageConfig(**fields)
            # the controller's path: the factory, then register_mem_pool_host (here per case)
            made[sig] = StorageBackendFactory.create_backend("mooncake", config, None)
        return made[sig]

    yield get
    stores = [getattr(b, "_backend", b).store for b in made.values()]  # unwrap an injector
    closers = [threading.Thread(target=store.close) for store in stores]  # ~1-2 s each
    for t in closers:
        t.start()
    for t in closers:
        t.join()


def _register(backend, pool, v2):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    if v2:
        from hostkv_rs import LogicalHostPool

        backend.register_mem_pool_host(LogicalHostPool(64, pool.page_size))  # the KV anchor
        backend.register_mem_host_pool_v2(pool, PoolName.DEEPSEEK_V4_C4)
    else:
        backend.register_mem_pool_host(pool)


def _unregister(backend, pool):
    """SGLang's backend never unregisters a pool's memory; do it before the pool goes, or the
    next pool at the same addresses would be refused."""
    inner = getattr(backend, "_backend", backend)
    for buf in inner._iter_host_pool_buffers(pool):  # what its register_buffer calls were given
        if buf.numel():
            inner.store.unregister_buffer(buf.data_ptr())


@pytest.mark.parametrize("case", list(CASES))
def test_sglangs_mooncake_backend_round_trips_our_pools(backends, case):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer

    build, overrides = CASES[case]
    if "dcp_size" in overrides and "dcp_size" not in HiCacheStorageConfig.__dataclass_fields__:
        pytest.skip("this SGLang release's HiCache storage has no DCP shards (0.5.23 added them)")
    v2 = bool(overrides.get("v2"))
    backend = backends(overrides)
    src, dst = build(), build()
    assert src.storage_format_tag is None and src.stores_page_envelope is False
    assert src.shared_allocation_domain is None
    _randomize(src, 1)
    _randomize(dst, 2)
    keys = [uuid.uuid4().hex for _ in range(3)]
    src_pages, dst_pages = [1, 3, 4], [5, 0, 2]
    try:
        _register(backend, src, v2)
        if v2:
            ok = backend.batch_set_v2(
                [
                    PoolTransfer(
                        PoolName.DEEPSEEK_V4_C4, host_indices=_slots(src, src_pages), keys=keys
                    )
                ]
            )[PoolName.DEEPSEEK_V4_C4]
        else:
            ok = backend.batch_set_v1(keys, _slots(src, src_pages))
        assert ok == [True] * 3
        _register(backend, dst, v2)
        if v2:
            ok = backend.batch_get_v2(
                [
                    PoolTransfer(
                        PoolName.DEEPSEEK_V4_C4, host_indices=_slots(dst, dst_pages), keys=keys
                    )
                ]
            )[PoolName.DEEPSEEK_V4_C4]
        else:
            assert backend.batch_exists(keys) == 3
            ok = backend.batch_get_v1(keys, _slots(dst, dst_pages))
        assert ok == [True] * 3
        for s, d in zip(src_pages, dst_pages):
            assert _page_bytes(dst, d) == _page_bytes(src, s), (case, s, d)
        if overrides.get("dcp_size", 1) > 1:
            # one rank-local physical page per logical page: L * P * C * e bytes, not two pages
            inner = getattr(backend, "_backend", backend)
            key = inner._tag_keys([keys[0]])[0] + f"_{inner.mla_suffix}_k"
            assert (
                inner.store.get_size(key) == src.layer_num * src.page_size * src.token_stride_size
            )
    finally:
        _unregister(backend, src)
        _unregister(backend, dst)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_sglangs_mooncake_backend_over_pools_in_mooncakes_own_memory(backends, layout):
    """`--hicache-storage-backend mooncake`: each pool's planes are Mooncake's host allocator's
    memory, SGLang's backend registers exactly those buffers, once each, and moves pages
    through them byte-exact."""
    src = _mha(layout, allocator_type="mooncake")
    dst = _mha(layout, allocator_type="mooncake")
    for pool in (src, dst):
        assert type(pool.allocator).__name__ == "MooncakeHostTensorAllocator"
        assert pool.kv_buffer.data_ptr() == pool.allocator.ptr
        assert [r.hugepage_tier for r in _regions(pool)] == ["adopted"]
    backend = backends({})
    inner = getattr(backend, "_backend", backend)
    # SGLang registers each plane (K, V) of the one allocation: together they are exactly the
    # allocator's memory, no byte of it twice.
    spans = sorted(
        (b.data_ptr(), b.numel() * b.element_size()) for b in inner._iter_host_pool_buffers(src)
    )
    start, end = src.allocator.ptr, src.allocator.ptr + src.kv_buffer.nbytes
    assert spans[0][0] == start and sum(n for _, n in spans) == end - start, spans
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(spans)), spans
    _randomize(src, 3)
    _randomize(dst, 4)
    keys = [uuid.uuid4().hex for _ in range(3)]
    try:
        backend.register_mem_pool_host(src)
        assert backend.batch_set_v1(keys, _slots(src, [1, 3, 4])) == [True] * 3
        backend.register_mem_pool_host(dst)
        assert backend.batch_get_v1(keys, _slots(dst, [5, 0, 2])) == [True] * 3
        for s, d in zip([1, 3, 4], [5, 0, 2]):
            assert _page_bytes(dst, d) == _page_bytes(src, s), (layout, s, d)
    finally:
        _unregister(backend, src)
        _unregister(backend, dst)
