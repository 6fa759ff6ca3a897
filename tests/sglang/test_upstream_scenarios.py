"""SGLang's own CPU host-pool unit tests, each scenario restated in our words (no upstream code is
copied) and run twice: with SGLang's classes, and with ours after `hostkv_rs.sglang.install()`.

Provenance: repository sgl-project/sglang, folder `test/registered/unit/mem_cache/`, the stored
versions of `test_mem_pool_host.py` (commits 5632a556 and 03ba7b5b, and the stored versions
between them), `test_asymmetric_mha_pool_host_unit.py` (bebe28c3, 0d241e81),
`test_mxfp8_mha_pool_host_unit.py` (5f91778b, 373b5925) and `test_hicache_host_register.py`
(09eaaf15 and its earlier stored versions). `test_upstream_dcp.py` and `test_upstream_assembler.py` restate
`test_hicache_dcp_host_pool.py` and `test_hybrid_pool_assembler.py`.

A scenario SGLang's own classes of the installed release cannot pass is skipped on both sides,
with the reason. Not restated (README, "SGLang's own host-pool unit tests"): scenarios that patch
SGLang's copy kernels (`transfer_kv_*`, `transfer_cache_dsv4_mla`, the JIT staging kernels) or
its `ALLOC_MEMORY_FUNCS` to observe what a pool hands them, and those that build a host pool with
`__new__`; and scenarios whose behaviour is newer than every release tested here (contiguous-run
allocation, the hugetlb budget and its sync group, `host_pool_capacities`, the PLE state pool).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from functools import partial
from types import SimpleNamespace
from unittest import mock

import pytest
import sgl_harness as H
import sgl_upstream as U
import torch
from sglang.srt.mem_cache import pool_host as _pool_host
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.pool_host import base as ph_base
from sglang.srt.mem_cache.pool_host import common as ph_common

# The pool group's home: `pool_host` from 0.5.19, `memory_pool_host` in 0.5.18.
HostPoolGroup = getattr(_pool_host, "HostPoolGroup", None) or H.mph.HostPoolGroup
PoolEntry = getattr(_pool_host, "PoolEntry", None) or H.mph.PoolEntry

side = U.side  # the shared two-sided fixture

PAGE = 2


def _small_mha(side, **kw):
    """The upstream fixture pool: a 4-token fp16 MHA device pool (2 heads of 4, 2 layers, page 2)
    and a layer_first host pool twice its size."""
    dev = U.mha_device(size=2 * PAGE, page=PAGE)
    kw.setdefault("allocator_type", "default")
    return dev, U.kv_host(side, "MHATokenToKVPoolHost", dev, **kw)


# --------------------------------------------------------------------------- test_mem_pool_host.py
# TestHostKVCache


def test_double_alloc_is_reported(side):
    """Restates upstream test_mem_pool_host.py::TestHostKVCache::test_double_alloc"""
    _, pool = _small_mha(side)
    taken = pool.alloc(4)
    assert taken.tolist() == [0, 1, 2, 3]
    # A slot still in use pushed back to the front of the free list: the next alloc must refuse it.
    pool.free_slots = torch.cat([taken[:1].clone(), pool.free_slots])
    with pytest.raises(AssertionError) as err:
        pool.alloc(4)
    assert "Double-alloc" in str(err.value) and "[0]" in str(err.value)


def test_double_free_is_reported(side):
    """Restates upstream test_mem_pool_host.py::TestHostKVCache::test_double_free"""
    _, pool = _small_mha(side)
    taken = pool.alloc(4)
    assert pool.free(taken[:2]) == 2
    with pytest.raises(AssertionError) as err:
        pool.free(taken[1:])  # taken[1] is freed a second time
    assert "Double-free" in str(err.value) and f"[{int(taken[1])}]" in str(err.value)


def test_free_of_a_slot_never_allocated(side):
    """Restates upstream test_mem_pool_host.py::TestHostKVCache::test_free_unallocated"""
    _, pool = _small_mha(side)
    with pytest.raises(AssertionError) as err:
        pool.free(torch.tensor([1]))
    assert "Double-free" in str(err.value) and "[1]" in str(err.value)


def test_free_after_clear_is_a_double_free(side):
    """Restates upstream test_mem_pool_host.py::TestHostKVCache::test_free_after_clear"""
    _, pool = _small_mha(side)
    taken = pool.alloc(4)
    pool.clear()
    assert pool.available_size() == pool.size
    with pytest.raises(AssertionError) as err:
        pool.free(taken)
    assert "Double-free" in str(err.value) and str(taken.tolist()) in str(err.value)


def test_shm_allocator_gives_a_descriptor(side):
    """Restates upstream test_mem_pool_host.py::TestHostKVCache::test_shm_allocator"""
    _, shm = _small_mha(side, allocator_type="shm")
    assert isinstance(shm.fd, int) and shm.fd >= 0
    taken = shm.alloc(4)
    assert len(taken) == 4
    assert shm.free(taken) == 4
    assert shm.available_size() == shm.size


def test_empty_free_leaves_release_list_empty(side):
    """Restates upstream test_mem_pool_host.py::TestHostKVCache::test_empty_free_keeps_release_list_empty"""
    _, pool = _small_mha(side)
    assert pool.free(torch.empty(0, dtype=torch.int64)) == 0
    assert pool.num_release_slots == 0
    assert pool.release_slots == []


@U.requires(
    H.at_least(0, 5, 22),
    "its MHA host pool sizes a row from the reported head count (element_dim 8, not 24)",
)
@pytest.mark.parametrize("rows_per_token", [1, 3])
def test_wider_physical_rows_than_logical_heads(side, rows_per_token):
    """Restates upstream test_mem_pool_host.py::TestHostKVCache::test_multiple_attention_rows_per_token"""
    dev = U.mha_device(size=4, page=PAGE, heads=2 * rows_per_token)
    dev.head_num = 2  # the pool reports logical heads; its rows keep the physical width
    row = dev.k_buffer[0][0]
    row_bytes = row.numel() * row.element_size()
    assert row_bytes == 2 * rows_per_token * 4 * 2
    for layout in ("layer_first", "page_first", "page_first_direct", "page_head"):
        pool = U.kv_host(side, "MHATokenToKVPoolHost", dev, layout=layout)
        assert pool.element_dim == row.numel(), layout
        assert pool.token_stride_size == row_bytes, layout
        assert pool.size_per_token == 2 * dev.layer_num * row_bytes, layout
        assert pool.kv_buffer.nbytes == pool.size * pool.size_per_token, layout


@U.requires(
    H.at_least(0, 5, 22),
    "its K-only host pool has no can_use_write_back_jit: the group's AttributeError this "
    "scenario pins is not fixed there",
)
def test_k_only_index_pool_joins_a_group_with_the_kv_pool(side):
    """Restates upstream test_mem_pool_host.py::TestHostKVCache::test_index_k_host_pool_joins_a_host_pool_group"""
    dev, pool = _small_mha(side)
    index_dev = H.mp.MHATokenToKOnlyPool(
        size=2 * PAGE,
        page_size=PAGE,
        dtype=torch.float16,
        head_num=1,
        head_dim=4,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )
    index_host = side.cls("MHATokenToKOnlyPoolHost")(
        index_dev, pool, "layer_first", pin_memory=False
    )
    assert H.is_sglangs(index_host)  # never replaced
    assert index_host.size == pool.size
    group = HostPoolGroup(
        [
            PoolEntry(
                name=PoolName.KV,
                host_pool=pool,
                device_pool=dev,
                layer_mapper=lambda layer: layer,
                is_primary_index_anchor=True,
            ),
            PoolEntry(
                name=PoolName.INDEXER,
                host_pool=index_host,
                device_pool=index_dev,
                layer_mapper=lambda layer: layer,
            ),
        ]
    )
    assert group.can_use_write_back_jit is False


# TestLazyHostPoolRelease (the logical pool; the Mamba and V4 scenarios build pools with __new__)


def test_logical_pool_lazy_release(side):
    """Restates upstream test_mem_pool_host.py::TestLazyHostPoolRelease::test_logical_pool_lazy_release"""
    pool = side.cls("LogicalHostPool")(size=8, page_size=2)
    side.check(pool, "LogicalHostPool")
    assert pool.free(torch.empty(0, dtype=torch.int64)) == 0
    assert (pool.num_release_slots, pool.release_slots) == (0, [])

    taken = pool.alloc(6)
    assert taken.tolist() == [0, 1, 2, 3, 4, 5]
    front = pool.free_slots
    pool.free(taken[:2])
    # free() only parks the chunk; the free list itself is the same object until a merge.
    assert pool.free_slots is front
    assert (pool.num_release_slots, len(pool.release_slots), pool.available_size()) == (2, 1, 4)
    assert pool.alloc(2).tolist() == [6, 7]  # the free list first, nothing merged
    assert pool.num_release_slots == 2
    assert pool.alloc(2).tolist() == [0, 1]  # then the parked chunk
    assert (pool.num_release_slots, pool.release_slots, pool.available_size()) == (0, [], 0)

    pool.free(torch.tensor([0, 1]))
    pool.clear()
    assert (pool.num_release_slots, pool.release_slots, pool.available_size()) == (0, [], 8)

    taken = pool.alloc(8)
    pool.free(taken[:2])
    pool.free(taken[2:4])
    assert len(pool.release_slots) == 2
    assert pool.alloc(4).tolist() == [0, 1, 2, 3]  # two parked chunks merged in order
    assert (pool.num_release_slots, pool.release_slots) == (0, [])

    pool.clear()  # the logical pool keeps refusing what is not page-aligned
    with pytest.raises(ValueError):
        pool.alloc(1)
    with pytest.raises(ValueError):
        pool.free(torch.tensor([0]))


# TestHostMemoryBudget (SGLang's base functions; install() must leave them as they are)

_SPLITS = hasattr(ph_base, "ranks_per_host")
_SPLITS_WHY = "its host budget is not split across co-located ranks (no ranks_per_host)"
_AVAILABLE = ph_base.HICACHE_HOST_MEMORY_RESERVE_BYTES + 64 * 1024**3


def _budget(ranks: int) -> int:
    patches = [mock.patch.object(ph_base, "ranks_per_host", return_value=ranks)]
    if hasattr(ph_base, "available_host_memory_bytes"):
        patches.append(
            mock.patch.object(ph_base, "available_host_memory_bytes", return_value=_AVAILABLE)
        )
    else:
        fake = SimpleNamespace(available=_AVAILABLE)
        patches.append(mock.patch.object(ph_base.psutil, "virtual_memory", return_value=fake))
    with patches[0], patches[1]:
        return ph_base.host_memory_budget_bytes()


@U.requires(hasattr(ph_base, "host_memory_budget_bytes"), "no host_memory_budget_bytes")
@pytest.mark.parametrize("name", ["MHATokenToKVPoolHost", "MLATokenToKVPoolHost"])
def test_a_patched_budget_in_sglangs_module_steers_the_pool(side, name):
    # SGLang's own tests patch the budget where its pools look it up (and, from 0.5.20, the
    # available-memory function it reads): a pool of either side obeys.
    mla = name == "MLATokenToKVPoolHost"
    dev = H.mla_device() if mla else H.mha_device()
    U.kv_host(side, name, dev)  # fits
    refused = partial(pytest.raises, ValueError, match="Not enough host memory available")
    with mock.patch.object(ph_base, "host_memory_budget_bytes", lambda *a, **k: 0), refused():
        U.kv_host(side, name, dev)
    original = ph_base.host_memory_budget_bytes

    @functools.wraps(original)  # a stand-in that names itself as SGLang's function
    def nothing_left(*args, **kwargs):
        return 0

    with mock.patch.object(ph_base, "host_memory_budget_bytes", nothing_left), refused():
        U.kv_host(side, name, dev)
    # A mock wrapping SGLang's own, called as the release calls it.
    with mock.patch.object(ph_base, "host_memory_budget_bytes", wraps=original):
        U.kv_host(side, name, dev)
    if hasattr(ph_base, "available_host_memory_bytes"):
        with mock.patch.object(ph_base, "available_host_memory_bytes", return_value=0), refused():
            U.kv_host(side, name, dev)
    U.kv_host(side, name, dev)  # and fits again once the patch is gone


_READS_CGROUP = hasattr(ph_base, "available_host_memory_bytes")


@U.requires(_READS_CGROUP, "its budget reads psutil alone (no cgroup headroom)")
@pytest.mark.parametrize("name", ["MHATokenToKVPoolHost", "MLATokenToKVPoolHost"])
def test_the_pool_is_bounded_by_the_cgroup_headroom_sglang_reads(side, name, caplog):
    # 0.5.21+ bound the machine's memory by the cgroup hierarchy SGLang finds (mountinfo,
    # memory.high, its release's page-cache credit) and log the headroom: a pool of either side
    # sees the same figure, so a container SGLang's pool would not fit refuses ours too.
    from sglang.srt.mem_cache import host_memory

    dev = H.mla_device() if name == "MLATokenToKVPoolHost" else H.mha_device()
    refused = partial(pytest.raises, ValueError, match="Not enough host memory available")
    with mock.patch.object(host_memory, "_cgroup_memory_headroom", lambda *a, **k: 0), refused():
        U.kv_host(side, name, dev)
    roomy = mock.patch.object(host_memory, "_cgroup_memory_headroom", lambda *a, **k: 2**62)
    with caplog.at_level(logging.INFO, logger=host_memory.__name__), roomy:
        U.kv_host(side, name, dev)
    assert "HiCache memory headroom" in caplog.text
    with mock.patch.object(host_memory, "_cgroup_memory_headroom", lambda *a, **k: None):
        U.kv_host(side, name, dev)


@U.requires(_SPLITS, _SPLITS_WHY)
def test_budget_is_split_across_co_located_ranks(side):
    """Restates upstream test_mem_pool_host.py::TestHostMemoryBudget::test_budget_is_split_across_co_located_ranks"""
    solo = _budget(1)
    assert solo == 64 * 1024**3
    assert _budget(4) == solo // 4


@U.requires(_SPLITS, _SPLITS_WHY)
def test_reserve_is_taken_before_the_split(side):
    """Restates upstream test_mem_pool_host.py::TestHostMemoryBudget::test_reserve_is_taken_before_the_split"""
    assert _budget(8) * 8 <= _AVAILABLE - ph_base.HICACHE_HOST_MEMORY_RESERVE_BYTES
    assert _budget(8) == 8 * 1024**3


@U.requires(_SPLITS, _SPLITS_WHY)
def test_ranks_per_host_divides_world_size_by_nodes(side):
    """Restates upstream test_mem_pool_host.py::TestHostMemoryBudget::test_ranks_per_host_divides_world_size_by_nodes"""
    H.publish(nnodes=2)
    patches = [mock.patch.object(torch.distributed, "is_initialized", return_value=True)]
    if hasattr(ph_base, "get_world_group"):  # 0.5.19: the world group's size
        world = SimpleNamespace(world_size=16)
        patches.append(mock.patch.object(ph_base, "get_world_group", return_value=world))
        context = H.rc.get_context().override_server_args(nnodes=2)
    else:  # later: the launch world size the published arguments give
        context = H.rc.get_context().override_server_args(nnodes=2, tp_size=16)
    with contextlib.ExitStack() as stack:
        for patch in (context, *patches):
            stack.enter_context(patch)
        assert ph_base.ranks_per_host() == 8


# TestHostPoolGroup (over logical pools)
_RESOLVES = hasattr(HostPoolGroup, "resolve_host_transfers")
_RESOLVES_WHY = "its pool group has no resolve_host_transfers"


def _logical_group(side, **sizes):
    cls = side.cls("LogicalHostPool")
    return HostPoolGroup(
        [
            PoolEntry(
                name=PoolName(name),
                host_pool=cls(size=size, page_size=1),
                device_pool=None,
                layer_mapper=lambda layer: layer,
                is_primary_index_anchor=name == PoolName.KV.value,
            )
            for name, size in sizes.items()
        ]
    )


@U.requires(_RESOLVES, _RESOLVES_WHY)
def test_group_resolves_and_releases_a_multi_pool_allocation(side):
    """Restates upstream test_mem_pool_host.py::TestHostPoolGroup::test_resolve_and_release_multi_pool_allocation"""
    group = _logical_group(side, kv=4, swa=2)
    primary = group.alloc(2)
    assert primary.tolist() == [0, 1]
    transfers = [
        PoolTransfer(name=PoolName.SWA, device_indices=torch.arange(2)),
        PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.SWA),
    ]
    resolved = group.resolve_host_transfers(
        transfers, primary_device_indices=torch.arange(2), primary_host_indices=primary
    )
    assert resolved is not None
    assert transfers[1].host_indices is transfers[0].host_indices
    assert transfers[0].host_indices.tolist() == [0, 1]
    assert group.available_size(PoolName.SWA) == 0
    group.free(primary)
    group.release_transfers(transfers)
    assert group.available_size() == 4
    assert group.available_size(PoolName.SWA) == 2


@U.requires(_RESOLVES, _RESOLVES_WHY)
@pytest.mark.parametrize(
    "sizes",
    [
        pytest.param({"kv": 4, "swa": 2, "mamba": 1}, id="last-pool-short"),
        pytest.param({"kv": 4, "swa": 1, "mamba": 2}, id="first-pool-short"),
    ],
)
def test_group_rolls_back_a_partial_allocation(side, sizes):
    """Restates upstream test_mem_pool_host.py::TestHostPoolGroup::test_resolve_rolls_back_partial_allocation"""
    group = _logical_group(side, **sizes)
    transfers = [
        PoolTransfer(name=PoolName.SWA, device_indices=torch.arange(2)),
        PoolTransfer(name=PoolName.MAMBA, device_indices=torch.arange(2)),
    ]
    assert group.resolve_host_transfers(transfers) is None
    assert transfers[0].host_indices is None and transfers[1].host_indices is None
    assert group.available_size(PoolName.SWA) == sizes["swa"]
    assert group.available_size(PoolName.MAMBA) == sizes["mamba"]


def _backup_under_pressure(side, order):
    """Two leaves hold one slot of each of two full 2-slot pools; the pools' evictions prefer
    opposite leaves, and evicting a leaf frees its slots in every pool."""
    cls = side.cls("LogicalHostPool")
    pools = {name: cls(2, page_size=1) for name in (PoolName.SWA, PoolName.MAMBA)}
    leaves = {leaf: {name: pool.alloc(1) for name, pool in pools.items()} for leaf in "ab"}
    lru = {PoolName.SWA: ["a", "b"], PoolName.MAMBA: ["b", "a"]}
    victims = []

    def evict(name, size):
        for leaf in lru[name]:
            if pools[name].available_size() >= size:
                break
            if leaf in leaves:
                victims.append(leaf)
                for pool_name, slots in leaves.pop(leaf).items():
                    pools[pool_name].free(slots)

    group = HostPoolGroup(
        [
            PoolEntry(
                name=name,
                host_pool=pool,
                device_pool=None,
                layer_mapper=lambda layer: layer,
                host_evict_fn=partial(evict, name),
            )
            for name, pool in pools.items()
        ]
    )
    transfers = [PoolTransfer(name=name, device_indices=torch.tensor([0])) for name in order]
    assert group.resolve_host_transfers(transfers) is transfers
    assert tuple(t.name for t in transfers) == order
    assert len(victims) == 1
    assert all(pool.available_size() == 0 for pool in pools.values())
    return victims, set(leaves), {t.name: t.host_indices.tolist() for t in transfers}


@U.requires(
    H.at_least(0, 5, 22),
    "the leaf its group evicts depends on the transfer order (SWA first: a, Mamba first: b)",
)
def test_host_reclamation_does_not_depend_on_transfer_order(side):
    """Restates upstream test_mem_pool_host.py::TestHostPoolGroup::test_host_reclamation_is_independent_of_transfer_order"""
    swa_first = _backup_under_pressure(side, (PoolName.SWA, PoolName.MAMBA))
    mamba_first = _backup_under_pressure(side, (PoolName.MAMBA, PoolName.SWA))
    assert swa_first == mamba_first


# TestDSAIndexerPoolDecl (SGLang's DSA indexer pool over an MLA anchor of the side)

_DSA = U.has(H.module_or_none("sglang.srt.mem_cache.pool_host.dsa"), "make_dsa_indexer_pool_decl")
_DSA_WHY = "no DSA indexer pool declaration (make_dsa_indexer_pool_decl)"


@U.requires(_DSA, _DSA_WHY)
def test_dsa_indexer_declaration_bytes(side):
    """Restates upstream test_mem_pool_host.py::TestDSAIndexerPoolDecl::test_host_bytes_match_observed_allocation"""
    from sglang.srt.mem_cache.pool_host.dsa import make_dsa_indexer_pool_decl

    info = make_dsa_indexer_pool_decl(_dsa_geometry()).storage_info
    assert info.bytes_per_token_per_layer == 132
    assert info.page_bytes(64) == 8448
    # 5 layers of 284256 pages of 64 tokens: the 12.01 GB one server allocated.
    assert info.host_bytes(page_num=284256, layer_num=5, page_size=64) == 12006973440


def _dsa_geometry():
    """The DSA device-pool fields the declaration reads (GLM-5-like: 128-dim index keys in
    128-element quant blocks, 64-token pages, 5 layers)."""
    return SimpleNamespace(
        layer_num=5,
        layer_shard_enabled=False,
        store_dtype=torch.bfloat16,
        size=64 * 8,
        start_layer=0,
        end_layer=5,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        index_head_dim=128,
        quant_block_size=128,
        page_size=64,
        index_page_size=64,
        skip_topk_layers=[False] * 5,
    )


def _dsa_mirror(side, skip=None):
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl

    H.publish(page_size=64, hicache_mem_layout="page_first")
    dev = H.mp.DSATokenToKVPool(
        size=512,
        page_size=64,
        kv_lora_rank=64,
        dtype=torch.bfloat16,
        qk_rope_head_dim=32,
        layer_num=5,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=96,
        skip_topk_layers=skip,
    )
    decl = make_dsa_indexer_pool_decl(dev)
    anchor = U.kv_host(
        side,
        "MLATokenToKVPoolHost",
        dev,
        layout="page_first",
        override_kv_cache_dim=dev.kv_cache_dim,
    )
    mirror = DSAIndexerPoolHost(decl=decl, anchor_host=anchor, pin_memory=False)
    assert H.is_sglangs(mirror)
    return dev, decl, anchor, mirror


@U.requires(_DSA, _DSA_WHY)
def test_dsa_indexer_mirror_takes_its_bytes_from_the_declaration(side):
    """Restates upstream test_mem_pool_host.py::TestDSAIndexerPoolDecl::test_mirror_consumes_decl"""
    _, decl, anchor, mirror = _dsa_mirror(side)
    info = decl.storage_info
    assert mirror.layout == anchor.layout == "page_first"
    assert mirror.indexer_page_stride_size == info.page_bytes(64)
    assert mirror.get_size_per_token() == info.bytes_per_token_per_layer * 5
    assert (
        info.host_bytes(page_num=anchor.page_num, layer_num=5, page_size=64)
        == anchor.page_num * mirror.indexer_layout_dim
    )


@U.requires(_DSA, _DSA_WHY)
def test_dsa_indexer_mirror_covers_only_layers_with_index_buffers(side):
    """Restates upstream test_mem_pool_host.py::TestDSAIndexerPoolDecl::test_mirror_is_compact_over_layers_that_own_index_buffers"""
    dev, decl, anchor, mirror = _dsa_mirror(side, skip=[False, True, True, False, True])
    assert decl.owned_device_layers == (0, 3)
    assert mirror.layer_num == 2
    assert mirror.get_size_per_token() == decl.storage_info.bytes_per_token_per_layer * 2
    assert mirror._owned_device_layer_ids(dev) == [0, 3]
    assert mirror._host_layer_index(3) == 1
    assert not mirror._is_device_layer_owned(dev, 1)
    assert mirror._draft_host_layer(dev.layer_num) == 2  # a packed draft follows the live layers
    assert anchor.layer_num == 5


# ------------------------------------------------------- test_asymmetric_mha_pool_host_unit.py


def test_factory_picks_the_asymmetric_pool_for_unequal_kv_dims(side):
    """Restates upstream test_asymmetric_mha_pool_host_unit.py::TestAsymmetricMHATokenToKVPoolHost::test_factory_selects_asymmetric_pool_for_mismatched_kv_dims"""
    pick = side.cls("get_mha_host_pool_cls")
    same = U.mha_device(size=16, page=PAGE, head_dim=4, v_head_dim=4)
    unequal = U.mha_device(size=16, page=PAGE, head_dim=4, v_head_dim=6)
    assert pick(U.factory_input(same)) is side.cls("MHATokenToKVPoolHost")
    assert pick(U.factory_input(unequal)) is side.cls("AsymmetricMHATokenToKVPoolHost")


# --------------------------------------------------------- test_mxfp8_mha_pool_host_unit.py


@U.requires(
    H.module_or_none("sglang.srt.mem_cache.pool_host.mha_mxfp8") is not None,
    "no MXFP8 host pool (pool_host.mha_mxfp8)",
)
def test_factory_picks_sglangs_mxfp8_pool(side):
    """Restates upstream test_mxfp8_mha_pool_host_unit.py::TestMXFP8MHATokenToKVPoolHost::test_factory_selects_mxfp8_host_pool"""
    from sglang.srt.mem_cache.pool_host.mha_mxfp8 import MHATokenToKVPoolMXFP8Host

    # A 128-token page makes 0.5.23's scales MXFP8-interleaved, what its factory looks for.
    mxfp8 = H.mp.MHATokenToKVPoolMXFP8(
        size=256,
        page_size=128,
        dtype=H.FP8,
        head_num=1,
        head_dim=32,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    plain = U.mha_device(size=16, page=PAGE)
    pick = side.cls("get_mha_host_pool_cls")
    assert pick(U.factory_input(mxfp8)) is MHATokenToKVPoolMXFP8Host
    assert pick(U.factory_input(plain)) is side.cls("MHATokenToKVPoolHost")


# ---------------------------------------------------------- test_hicache_host_register.py
# (SGLang's registration helpers; the pool scenarios patch ALLOC_MEMORY_FUNCS or use __new__)

_CHUNKED = hasattr(
    H.module_or_none("sglang.srt.environ").envs, "SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB"
)
_CHUNKED_WHY = "it registers host memory in one piece (no SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB)"
_GIB = 1024**3
_BASE = 0x10000000


class _Buffer:
    """What the registration helpers read of a host tensor: its base, length and item size."""

    def __init__(self, base: int, size: int):
        self.base, self.size = base, size

    def data_ptr(self) -> int:
        return self.base

    def numel(self) -> int:
        return self.size

    def element_size(self) -> int:
        return 1


class _Runtime:
    """A stand-in CUDA runtime recording registrations; registration number `fail_at` fails."""

    def __init__(self, fail_at=None):
        self.registered, self.unregistered, self.fail_at = [], [], fail_at

    def cudaHostRegister(self, ptr, size, flags):  # the runtime's own names
        self.registered.append((ptr, size, flags))
        return 1 if len(self.registered) == self.fail_at else 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0

    def cudaGetErrorString(self, rc):
        return "injected error"


def _one_gib_chunks(runtime):
    from sglang.srt.environ import envs

    chunk = mock.patch.object(envs.SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB, "get", return_value=1)
    return chunk, mock.patch.object(torch.cuda, "cudart", return_value=runtime)


@U.requires(_CHUNKED, _CHUNKED_WHY)
def test_unregister_releases_each_chunk_once(side):
    """Restates upstream test_hicache_host_register.py::TestHiCacheHostRegister::test_unregister_releases_every_registered_chunk_once"""
    buffer, runtime = _Buffer(_BASE, 2 * _GIB + 17), _Runtime()
    chunk, cudart = _one_gib_chunks(runtime)
    with chunk, cudart:
        ph_common._cuda_host_register(buffer, registration_granularity_bytes=_GIB)
        ph_common._cuda_host_unregister(buffer)
        ph_common._cuda_host_unregister(buffer)
    assert [size for _, size, _ in runtime.registered] == [_GIB, _GIB, 17]
    assert runtime.unregistered == [_BASE + 2 * _GIB, _BASE + _GIB, _BASE]


@U.requires(_CHUNKED, _CHUNKED_WHY)
def test_failed_registration_rolls_back_earlier_chunks(side):
    """Restates upstream test_hicache_host_register.py::TestHiCacheHostRegister::test_registration_failure_rolls_back_prior_chunks"""
    buffer, runtime = _Buffer(_BASE, 2 * _GIB + 17), _Runtime(fail_at=2)
    chunk, cudart = _one_gib_chunks(runtime)
    with chunk, cudart, pytest.raises(RuntimeError, match="offset=1073741824"):
        ph_common._cuda_host_register(buffer, registration_granularity_bytes=_GIB)
    assert runtime.registered == [(_BASE, _GIB, 0), (_BASE + _GIB, _GIB, 0)]
    assert runtime.unregistered == [_BASE]


@U.requires(_CHUNKED, _CHUNKED_WHY)
def test_no_copy_granularity_registers_once(side):
    """Restates upstream test_hicache_host_register.py::TestHiCacheHostRegister::test_missing_copy_granularity_preserves_single_registration"""
    runtime = _Runtime()
    chunk, cudart = _one_gib_chunks(runtime)
    with chunk, cudart:
        ph_common._cuda_host_register(_Buffer(_BASE, 2 * _GIB + 17))
    assert runtime.registered == [(_BASE, 2 * _GIB + 17, 0)]


@U.requires(_CHUNKED, _CHUNKED_WHY)
def test_registration_chunks_end_on_page_copy_boundaries(side):
    """Restates upstream test_hicache_host_register.py::TestHiCacheHostRegister::test_registration_boundaries_honor_page_copy_granularity"""
    mib = 1024**2
    runtime = _Runtime()
    chunk, cudart = _one_gib_chunks(runtime)
    with chunk, cudart:
        ph_common._cuda_host_register(
            _Buffer(_BASE, 2500 * mib), registration_granularity_bytes=300 * mib
        )
    # The largest multiple of a 300 MiB page copy within the 1 GiB chunk is 900 MiB.
    assert runtime.registered == [
        (_BASE, 900 * mib, 0),
        (_BASE + 900 * mib, 900 * mib, 0),
        (_BASE + 1800 * mib, 700 * mib, 0),
    ]
    assert all((ptr - _BASE) % (300 * mib) == 0 for ptr, _, _ in runtime.registered)
