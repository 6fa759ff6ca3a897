"""SGLang's CPU unit tests of its hybrid HiCache pool assembler, each scenario restated in our words
and run with SGLang's classes and with ours after `install()` (the assembler's own code is
SGLang's either way; the host pools it builds are the side's).

Provenance: repository sgl-project/sglang, folder `test/registered/unit/mem_cache/`,
`test_hybrid_pool_assembler.py`: the stored versions from 9ef74c37 (split and draft-sidecar
scenarios, `server_args=` form) to 0239b899 (device-allocation eviction, the hybrid Mamba
stack's MLA row width, the MLA host pool's row geometry) and the stored versions between them.

Where the upstream scenario builds fake device pools (SimpleNamespace) or patches the
assembler's CPU allocation, these use SGLang's real device pools, which allocate on CPU, and
SGLang's pools built by a site get the harness's CPU allocation (the sites ask for pinned memory).
From 0.5.22 the hybrid Mamba stack is built from pool declarations, so its row-width scenarios
are skipped there; the same rows are checked through `build_kv_host_pool`, the site every stack
builder calls. Not restated: the MLA host pool's own refusals of packed rows without
`override_kv_cache_dim` or with a draft of other rows ("row geometry"), newer than every release
here (their MLA pools accept those rows; the site builder refuses the draft).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from types import SimpleNamespace
from unittest import mock

import pytest
import sgl_harness as H
import sgl_upstream as U
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

side = U.side  # the shared two-sided fixture

asm = H.asm
PAGE = 64  # SGLang's DSA device pool takes 64-token pages only
LORA, ROPE = 8, 4
NOMINAL = LORA + ROPE
PACKED = 16  # a DSA fp8 row is wider than kv_lora_rank + qk_rope_head_dim


class _Bytes:
    """A device pool that reports only its KV bytes (an int, or a (k, v) pair)."""

    def __init__(self, kv_bytes):
        self.kv_bytes = kv_bytes

    def get_kv_size_bytes(self):
        return self.kv_bytes


class _HybridWrapper(H.mp.HybridLinearKVPool):
    """A hybrid-linear draft pool holding only its full-attention sub-pool."""

    def __init__(self, full_kv_pool):  # not SGLang's: that one builds device layers
        self.full_kv_pool = full_kv_pool


# --------------------------------------------------------------------------- device eviction

_EVICT = U.has(asm, "_evict_swa_for_device_alloc", "_evict_mamba_for_device_alloc")


@U.requires(_EVICT, "no device-allocation eviction helpers")
def test_swa_eviction_asks_only_for_the_shortfall(side):
    """Restates upstream test_hybrid_pool_assembler.py::TestDeviceAllocEviction::test_swa_evicts_only_allocation_shortfall"""
    cache = mock.MagicMock()
    cache.token_to_kv_pool_allocator.swa_available_size.return_value = 8
    asm._evict_swa_for_device_alloc(cache, required_size=10)
    cache.evict_for_alloc.assert_called_once_with(EvictParams(swa_num_tokens=2))
    cache.evict.assert_not_called()


@U.requires(_EVICT, "no device-allocation eviction helpers")
def test_mamba_eviction_asks_only_for_the_shortfall(side):
    """Restates upstream test_hybrid_pool_assembler.py::TestDeviceAllocEviction::test_mamba_evicts_only_allocation_shortfall"""
    cache = mock.MagicMock()
    cache.req_to_token_pool.mamba_allocator.schedulable_available_size.return_value = 8
    asm._evict_mamba_for_device_alloc(cache, required_size=10)
    cache.evict_for_alloc.assert_called_once_with(EvictParams(mamba_num=2))
    cache.evict.assert_not_called()


@U.requires(_EVICT, "no device-allocation eviction helpers")
def test_enough_capacity_evicts_nothing(side):
    """Restates upstream test_hybrid_pool_assembler.py::TestDeviceAllocEviction::test_sufficient_capacity_skips_eviction"""
    cache = mock.MagicMock()
    cache.token_to_kv_pool_allocator.swa_available_size.return_value = 10
    cache.req_to_token_pool.mamba_allocator.schedulable_available_size.return_value = 10
    asm._evict_swa_for_device_alloc(cache, required_size=10)
    asm._evict_mamba_for_device_alloc(cache, required_size=10)
    cache.evict_for_alloc.assert_not_called()
    cache.evict.assert_not_called()


# --------------------------------------------------------------------------- hicache size split


def test_hicache_size_splits_by_device_bytes(side):
    """Restates upstream test_hybrid_pool_assembler.py::TestSplitHicacheSize::test_splits_total_budget_by_device_bytes"""
    shares = asm._split_hicache_size(100, (_Bytes(75 * 10**9), _Bytes((15 * 10**9, 10 * 10**9))))
    assert shares == (75.0, 25.0)
    assert sum(shares) == 100  # the total is kept, not doubled


def test_hicache_size_splits_over_three_pools(side):
    """Restates upstream test_hybrid_pool_assembler.py::TestSplitHicacheSize::test_splits_total_budget_by_device_bytes_three_pools"""
    pools = (_Bytes(55 * 10**9), _Bytes((15 * 10**9, 10 * 10**9)), _Bytes(20 * 10**9))
    shares = asm._split_hicache_size(100, pools)
    assert shares == (55.0, 25.0, 20.0)
    assert sum(shares) == 100


# --------------------------------------------------------------------------- draft sidecars


def _draft_builder(**kwargs):
    if "server_args" in H._params(asm.build_full_draft_pools):  # 0.5.18
        kwargs["server_args"] = None
    return asm.build_full_draft_pools(**kwargs)


def test_empty_hybrid_draft_pool_builds_no_sidecar(side):
    """Restates upstream test_hybrid_pool_assembler.py::TestDraftSidecarPoolDispatch::test_full_builder_unwraps_empty_hybrid_linear_pool"""
    specs, entries = _draft_builder(
        draft_kv_pool=_HybridWrapper(SimpleNamespace(layer_num=0)), tree_cache=None
    )
    assert (specs, entries) == ([], [])


@U.requires(
    "server_args" not in H._params(asm.build_full_draft_pools),
    "its draft builder reads server_args, not the published configuration",
)
def test_draft_sidecar_spans_the_anchors_logical_slots(side):
    """Restates upstream test_hybrid_pool_assembler.py::TestDraftSidecarPoolDispatch::test_full_builder_sizes_sidecar_for_anchor_logical_space"""
    H.publish(page_size=PAGE, hicache_mem_layout="page_first")
    target = H.mha_device(size=256, page=PAGE, heads=2, head_dim=8, layers=2)
    anchor = U.kv_host(side, "MHATokenToKVPoolHost", target, layout="page_first")
    draft = H.mha_device(size=128, page=PAGE, heads=2, head_dim=8, layers=1)
    controller = SimpleNamespace(
        mem_pool_host=anchor, page_size=PAGE, transfer_layer_id_max=2, layer_num=2
    )
    spy = mock.patch.object(asm, "_build_mha_mla_host_pool", wraps=asm._build_mha_mla_host_pool)
    with H.sglang_cpu_alloc(), spy as build:  # the builder asks SGLang's pools for pinned memory
        specs, entries = _draft_builder(
            draft_kv_pool=draft, tree_cache=SimpleNamespace(cache_controller=controller)
        )
    assert build.call_args.kwargs["host_to_device_ratio"] == anchor.logical_size / draft.size
    assert len(specs) == 1 and len(entries) == 1
    sidecar = entries[0].host_pool
    side.check(sidecar, "MHATokenToKVPoolHost")
    # A slot for every anchor slot (0.5.23 sizes it to exactly that many).
    assert sidecar.size >= anchor.logical_size == anchor.size
    if H.at_least(0, 5, 23):
        assert sidecar.size == anchor.logical_size
    assert sidecar.layer_num == 1 and sidecar.layout == "page_first"


# --------------------------------------------------------------------------- packed MLA rows


def _dsa(*, kv_cache_dim=PACKED, layers=2, dtype=H.FP8):
    """SGLang's DSA device pool: its rows are `kv_cache_dim` wide (fp8 stores them as uint8)."""
    H.publish(page_size=PAGE, hicache_mem_layout="layer_first", hicache_io_backend="direct")
    return H.mp.DSATokenToKVPool(
        size=256,
        page_size=PAGE,
        kv_lora_rank=LORA,
        dtype=dtype,
        qk_rope_head_dim=ROPE,
        layer_num=layers,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=kv_cache_dim,
    )


# 0.5.19+: built from the kv_pool alone (0.5.18 also wants the server args, which it reads).
_STACK_PARAMS = inspect.signature(asm.build_hybrid_mamba_stack).parameters
_STACK_TAKES_KV_POOL = "kv_pool" in _STACK_PARAMS and (
    "server_args" not in _STACK_PARAMS
    or _STACK_PARAMS["server_args"].default is not inspect.Parameter.empty
)


def _mamba_stack(kv_pool, *, use_mla, drafts=(), patches=()):
    """Build SGLang's hybrid Mamba stack over `kv_pool` with the Mamba host pool, the group and
    the controller stood in for (not under test); returns the KV host pool it built."""
    H.publish(page_size=PAGE, hicache_mem_layout="layer_first", hicache_io_backend="direct")
    params = mock.MagicMock()
    params.page_size = PAGE
    params.mtp_draft_device_pools = tuple(_HybridWrapper(d) for d in drafts)
    group = mock.MagicMock(name="HostPoolGroup")
    with contextlib.ExitStack() as stack:
        stack.enter_context(H.sglang_cpu_alloc())  # the stack asks for pinned memory
        stack.enter_context(mock.patch.object(asm, "MambaPoolHost"))
        stack.enter_context(mock.patch.object(asm, "HostPoolGroup", group))
        stack.enter_context(mock.patch.object(asm, "HybridCacheController"))
        for patch in patches:
            stack.enter_context(patch)
        asm.build_hybrid_mamba_stack(
            params=params,
            kv_pool=kv_pool,
            mamba_pool=mock.MagicMock(),
            full_layer_mapping={i: i for i in range(kv_pool.layer_num)},
            mamba_layer_mapping={kv_pool.layer_num: kv_pool.layer_num},
            load_cache_event=threading.Event(),
            storage_backend=None,
            use_mla=use_mla,
        )
    return group.call_args.args[0][0].host_pool


_STACK_WHY = (
    "its hybrid Mamba stack is built from pool declarations, not a kv_pool"
    if not _STACK_TAKES_KV_POOL
    else "its hybrid Mamba stack builds the MLA host pool without the device pool's row width "
    "(kv_cache_dim 12, not 16)"
)
# 0.5.22+: the MLA host pool gets the device pool's resolved row width (0.5.20-0.5.21 build it
# with the nominal kv_lora_rank + qk_rope_head_dim, which both sides then reproduce).
_STACK = _STACK_TAKES_KV_POOL and "override_kv_cache_dim = kv_pool.kv_cache_dim" in (
    inspect.getsource(asm)
)


@U.requires(_STACK, _STACK_WHY)
def test_mamba_stack_mla_rows_match_the_packed_device_rows(side):
    """Restates upstream test_hybrid_pool_assembler.py::TestHybridMambaStackHostRowWidth::test_mla_host_pool_row_width_matches_packed_device_rows"""
    dev = _dsa()
    assert dev.kv_cache_dim == PACKED > NOMINAL
    host = _mamba_stack(dev, use_mla=True)
    side.check(host, "MLATokenToKVPoolHost")
    assert host.kv_cache_dim == PACKED
    assert host.token_stride_size == PACKED * dev.store_dtype.itemsize == PACKED
    assert host.kv_buffer.shape[-1] == PACKED


@U.requires(
    _STACK_TAKES_KV_POOL, "its hybrid Mamba stack is built from pool declarations, not a kv_pool"
)
def test_mamba_stack_gives_an_mha_pool_no_row_override(side):
    """Restates upstream test_hybrid_pool_assembler.py::TestHybridMambaStackHostRowWidth::test_non_mla_pool_exposing_kv_cache_dim_gets_no_override"""
    dev = H.mha_device(size=256, page=PAGE, heads=2, head_dim=8, layers=2)
    dev.kv_cache_dim = PACKED  # an MHA pool that happens to have one
    mha_host_cls = mock.MagicMock(name="MHAHostPool")
    _mamba_stack(
        dev,
        use_mla=False,
        patches=[mock.patch.object(asm, "get_mha_host_pool_cls", return_value=mha_host_cls)],
    )
    mha_host_cls.assert_called_once()
    assert "override_kv_cache_dim" not in mha_host_cls.call_args.kwargs


@U.requires(_STACK, _STACK_WHY)
def test_mamba_stack_takes_a_packed_draft_of_the_targets_rows(side):
    """Restates upstream test_hybrid_pool_assembler.py::TestHybridMambaStackHostRowWidth::test_packed_draft_pool_with_target_geometry_is_accepted"""
    dev = _dsa()
    host = _mamba_stack(dev, use_mla=True, drafts=[_dsa(layers=1)])
    side.check(host, "MLATokenToKVPoolHost")
    assert host.layer_num == dev.layer_num + 1 == 3
    assert host.kv_cache_dim == PACKED
    assert host.kv_buffer.shape[0] == 3  # layer_first: the draft layer follows the target's


def _mla_direct(side, dev, **kw):
    H.publish(page_size=PAGE, hicache_mem_layout="layer_first")
    return U.kv_host(side, "MLATokenToKVPoolHost", dev, **kw)


def test_mla_pool_with_row_override_and_a_matching_draft(side):
    """Restates upstream test_hybrid_pool_assembler.py::TestMLAHostPoolRowGeometry::test_packed_device_pool_with_override_and_matching_draft"""
    dev = _dsa()
    host = _mla_direct(side, dev, override_kv_cache_dim=PACKED, drafts=[_dsa(layers=1)])
    assert host.kv_cache_dim == PACKED
    assert host.layer_num == dev.layer_num + 1 == 3
    assert host.kv_buffer.shape[-1] == PACKED


def test_nominal_mla_rows_need_no_override(side):
    """Restates upstream test_hybrid_pool_assembler.py::TestMLAHostPoolRowGeometry::test_nominal_device_pool_needs_no_override"""
    dev = H.mla_device(size=256, page=PAGE, kv_lora_rank=LORA, rope=ROPE, layers=2)
    host = _mla_direct(side, dev)
    assert host.kv_cache_dim == NOMINAL
    assert host.kv_buffer.shape[-1] == NOMINAL


@pytest.mark.parametrize("override", [None, PACKED], ids=["no-override", "override"])
def test_packed_rows_kept_by_the_site_builder(side, override):
    """Restates upstream test_hybrid_pool_assembler.py::TestHybridMambaStackHostRowWidth::test_mla_host_pool_row_width_matches_packed_device_rows
    through `build_kv_host_pool`, the site every stack builder calls (0.5.22+ derive the row
    width from the device pool; 0.5.19 needs it passed)"""
    if override is None and not H.at_least(0, 5, 22):
        pytest.skip(f"SGLang {H.SGLANG_VERSION}: its site builder passes no row override")
    H.publish(page_size=PAGE, hicache_mem_layout="layer_first")
    dev = _dsa()
    kwargs = {} if override is None else {"override_kv_cache_dim": override}
    with H.sglang_cpu_alloc():  # the site asks SGLang's pools for pinned memory
        host = H.build_kv_host_pool(kv_pool=dev, page_size=PAGE, use_mla=True, **kwargs)
    side.check(host, "MLATokenToKVPoolHost")
    assert host.kv_cache_dim == PACKED
    assert host.kv_buffer.shape[-1] == PACKED


_DRAFT_CHECK = H.module_or_none("sglang.srt.mem_cache.hybrid_cache.host_pool_config")


@U.requires(
    U.has(_DRAFT_CHECK, "check_packed_kv_rows"),
    "its site builder does not compare a packed draft's rows with the target's",
)
@pytest.mark.parametrize(
    "target, draft",
    [
        pytest.param((PACKED, H.FP8), (NOMINAL, torch.bfloat16), id="narrower-draft"),
        pytest.param((NOMINAL, torch.bfloat16), (PACKED, H.FP8), id="wider-draft"),
        pytest.param((PACKED, H.FP8), (NOMINAL, H.FP8), id="same-dtype-other-width"),
    ],
)
def test_a_packed_draft_of_other_rows_is_refused(side, target, draft):
    """Restates upstream test_hybrid_pool_assembler.py::TestHybridMambaStackHostRowWidth::test_packed_draft_pool_with_narrower_rows_is_rejected
    (and its `_wider_rows_` and `test_same_dtype_draft_pool_with_different_width_is_rejected`
    siblings) through `build_kv_host_pool`; this release's text names the rows, not "draft pool 0"
    """
    kv_pool = _dsa(kv_cache_dim=target[0], dtype=target[1])
    drafts = (_dsa(kv_cache_dim=draft[0], dtype=draft[1], layers=1),)
    with H.sglang_cpu_alloc(), pytest.raises(ValueError, match="draft"):
        H.build_kv_host_pool(
            kv_pool=kv_pool, page_size=PAGE, use_mla=True, mtp_draft_device_pools=drafts
        )
