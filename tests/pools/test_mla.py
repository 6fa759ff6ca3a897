"""MLATokenToKVPoolHost against host-pool-contract.md §2.3, §3.4, §4.3-§4.5 (the page round trips of
every pool kind are in core/test_transfers.py)."""

from __future__ import annotations

import logging
import re
import types

import numpy as np
import pytest
import torch
from hostkv_rs import MLATokenToKVPool, MLATokenToKVPoolHost
from hostkv_rs.pools.args import NoKVBytesError
from hostkv_rs.pools.hisparse import HiSparseHostPoolMixin
from reference import (
    LAYERS,
    MLA_PAIRS,
    assert_bytes_equal,
    distinct_pages,
    fill_random,
    host_planes,
    make_mla,
    page_tokens,
    round_trip,
    snapshot_device,
    snapshot_host,
)


def test_geometry_and_override_kv_cache_dim():
    host, _ = make_mla("page_first_direct", 4, torch.bfloat16, kv_lora_rank=12, rope=4)
    C, e, L = 16, 2, LAYERS
    assert host.kv_cache_dim == C
    assert host.size_per_token == host.get_ksize_per_token() == C * e * L
    assert host.token_stride_size == C * e and host.layout_dim == C * e * L
    assert host.kv_buffer.shape == (host.page_num, L, 4, 1, C)
    assert host.layer_num == host.target_layer_num == L

    packed, _ = make_mla("layer_first", 4, torch.bfloat16, override_kv_cache_dim=24)
    assert packed.kv_cache_dim == 24 and packed.kv_buffer.shape == (L, packed.size, 1, 24)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_get_page_buffer_meta(layout):
    P, C, e, L = 4, 16, 2, LAYERS
    host, _ = make_mla(layout, P, torch.bfloat16)
    S, base = host.size, host.kv_buffer.data_ptr()
    pages = [2, 0, 6]
    ptrs, sizes = host.get_page_buffer_meta(torch.tensor(page_tokens(pages, P)))
    if layout == "layer_first":
        assert ptrs == [
            base + p * P * C * e + layer * S * C * e for p in pages for layer in range(L)
        ]
        assert sizes == [P * C * e] * (L * len(pages))
    else:
        assert ptrs == [base + p * P * L * C * e for p in pages]
        assert sizes == [L * P * C * e] * len(pages)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_flat_data_pages_round_trip(layout):
    rng = np.random.default_rng(11)
    P = 8
    host, _ = make_mla(layout, P, torch.bfloat16)
    plane = host_planes(host)[0]
    plane.copy_(torch.from_numpy(rng.integers(0, 256, plane.numel(), dtype=np.uint8)))
    before = snapshot_host(host)
    kv = host.kv_buffer
    src, dst = 1 * P, 4 * P

    def reference(slot):
        if layout == "layer_first":
            return kv[:, slot : slot + P].reshape(-1).view(torch.uint8)
        if layout == "page_first":
            return kv[slot : slot + P].reshape(-1).view(torch.uint8)
        return kv[slot // P].reshape(-1).view(torch.uint8)

    page = host.get_data_page(src)
    assert torch.equal(page.view(torch.uint8), reference(src))
    dummy = host.get_dummy_flat_data_page()
    assert dummy.numel() == LAYERS * P * 16 and not dummy.any()
    original = host.get_data_page(dst).clone()
    dummy.copy_(page)
    host.set_from_flat_data_page(dst, dummy)
    assert torch.equal(reference(dst), reference(src))
    host.set_from_flat_data_page(dst, original)
    assert_bytes_equal(snapshot_host(host)[0], before[0], "host after restoring the page")


def test_get_contiguous_buf_infos():
    host, _ = make_mla("layer_first", 4, torch.bfloat16)
    ptrs, lens, items = host.get_contiguous_buf_infos()
    S, T = host.size, host.token_stride_size
    assert ptrs == [host.kv_buffer.data_ptr() + layer * S * T for layer in range(LAYERS)]
    assert lens == [S * T] * LAYERS
    assert items == [T * 4] * LAYERS


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_get_contiguous_buf_infos_page_layouts_report_what_sglang_reports(layout):
    # §4.3: data_ptrs are the per-layer data_refs pointers, data_lens `kv_buffer[l].nbytes`
    # (one token's or one page's slab in these layouts), item_lens `T * P`.
    P, L = 4, LAYERS
    host, _ = make_mla(layout, P, torch.bfloat16, device_pages=8)
    T, base = host.token_stride_size, host.kv_buffer.data_ptr()
    ptrs, lens, items = host.get_contiguous_buf_infos()
    if layout == "page_first":
        assert ptrs == [base + layer * T for layer in range(L)]
        assert lens == [L * T] * L
    else:
        assert ptrs == [base + layer * L * P * T for layer in range(L)]
        assert lens == [L * P * T] * L
    assert items == [T * P] * L


def test_get_contiguous_buf_infos_refuses_fewer_pages_than_layers_and_destroyed_pools():
    host, _ = make_mla("page_first_direct", 4, torch.bfloat16, layers=7, device_pages=1, ratio=1.0)
    assert host.page_num < 7
    # SGLang's kv_buffer[l] raises IndexError there; ours is that and a ValueError.
    with pytest.raises(IndexError, match="7 layers") as e:
        host.get_contiguous_buf_infos()
    assert isinstance(e.value, ValueError)
    lf, _ = make_mla("layer_first", 4, torch.bfloat16)
    # SGLang's MLA pool has no get_hybrid_pool_buffer; its storage backends ask whether a pool
    # has one (NIXL then registers it zero-copy as a sidecar pool).
    assert not hasattr(lf, "get_hybrid_pool_buffer")
    lf.destroy()
    with pytest.raises(RuntimeError, match="no KV bytes"):
        lf.get_contiguous_buf_infos()


def test_data_refs_and_ptrs():
    host, _ = make_mla("page_first", 4, torch.bfloat16)
    T = host.token_stride_size
    assert host.data_ptrs.dtype == torch.uint64
    assert host.data_ptrs.tolist() == [host.kv_buffer.data_ptr() + i * T for i in range(LAYERS)]
    assert host.data_refs[2].stride(0) * 2 == host.layout_dim


def test_dummy_mode(caplog):

    dp = MLATokenToKVPool(64, 16, torch.bfloat16, 12, 4, LAYERS)
    with caplog.at_level(logging.INFO, logger="hostkv_rs"):
        host = MLATokenToKVPoolHost(dp, 2.0, 0, 16, "layer_first", is_dummy=True)
    assert host.kv_buffer is None and host.data_refs is None and host.data_ptrs is None
    assert host.size == 144 and host.page_num == 9
    assert host.token_stride_size == 32 and host.layout_dim == 32 * LAYERS
    want = (
        f"MLATokenToKVPoolHost dummy mode: allocator-only, size=144 tokens, saving "
        f"{144 * 32 * LAYERS / 1e9:.2f} GB host memory"
    )
    assert want in caplog.text
    slots = host.alloc(32)
    assert slots.tolist() == list(range(32))
    assert host.free(slots) == 32
    assert host.get_contiguous_buf_infos() == ([], [], [])
    idx = torch.arange(16)
    # No pages: SGLang's pool fails on its None kv_buffer with an AttributeError (meta) or a
    # TypeError (flat pages); ours says why, as an error of all three kinds.
    for call in (lambda: host.get_page_buffer_meta(idx), lambda: host.get_data_page(0)):
        with pytest.raises(NoKVBytesError, match="holds no KV bytes") as e:
            call()
        assert all(isinstance(e.value, t) for t in (RuntimeError, AttributeError, TypeError))
    with pytest.raises(AssertionError, match=re.escape("load on a dummy (non-src MLA) host pool")):
        host.load_to_device_per_layer(dp, idx, idx + 16, 0, "kernel")
    with pytest.raises(
        AssertionError, match=re.escape("backup on a dummy (non-src MLA) host pool")
    ):
        host.backup_from_device_all_layer(dp, idx, idx + 16, "kernel")
    host.destroy()  # nothing to unregister, still fine


def test_dummy_mode_dcp_assert_text():

    dp = MLATokenToKVPool(64, 16, torch.bfloat16, 12, 4, LAYERS)
    with pytest.raises(
        AssertionError,
        match=re.escape("HiCache host pool page_size (16) must be a multiple of dcp_size (3)."),
    ):
        MLATokenToKVPoolHost(dp, 2.0, 0, 16, "layer_first", dcp_size=3, is_dummy=True)


@pytest.mark.parametrize("override", [None, 80])
def test_an_allocation_only_pool_sizes_by_the_allocations_bytes_per_token(override):
    # SGLang 0.5.23's `MLAHostAllocation` carries its own figure, which may count more than the
    # latent rows (e.g. an indexer's); an override of the width does not change it.
    allocation = types.SimpleNamespace(
        dtype=torch.bfloat16, kv_lora_rank=32, qk_rope_head_dim=16, kv_cache_dim=48,
        size_per_token=256, draft_layer_num=0, packed_fp8=False,
    )  # fmt: skip
    host = MLATokenToKVPoolHost(
        allocation, 2.0, 1, 16, "layer_first", False, "cpu", device_capacity_tokens=256,
        start_layer=0, end_layer=2, target_layer_num=2, override_kv_cache_dim=override,
    )  # fmt: skip
    assert host.kv_buffer is None and host.size_per_token == 256
    assert host.size == (10**9 // 256 // 16 + 1) * 16


def test_hisparse_request_rows():
    host, _ = make_mla("layer_first", 4)
    rows = torch.full((2, 16), -1, dtype=torch.int64)
    lens = torch.zeros(2, dtype=torch.int64)
    assert host.alloc_page(2).tolist() == list(range(8))
    got = host.alloc_paged_token_slots(rows, lens, 1, 0, 5)  # two pages for 5 tokens
    assert got.tolist() == list(range(8, 13))
    assert int(lens[1]) == 8 and rows[1, :8].tolist() == list(range(8, 16))
    assert host.alloc_paged_token_slots(rows, lens, 1, 5, 3).tolist() == [13, 14, 15]
    assert int(lens[1]) == 8  # still within the allocated pages
    assert host.alloc_paged_token_slots(rows, lens, 1, 8, 1).tolist() == [16]
    assert host.allocated_host_indices(rows, 1, 9).tolist() == list(range(8, 20))
    assert host.alloc_paged_token_slots(rows, lens, 0, 0, 0).numel() == 0
    with pytest.raises(AssertionError):
        host.alloc_paged_token_slots(rows, lens, 0, 3, 1)
    # Five pages for a row of 16 slots, and the pool has fewer: SGLang takes the pages first,
    # so the pool's failure is raised (a narrow row alone: test_hisparse_a_pool_too_short...).
    with pytest.raises(RuntimeError, match="alloc failed for 5 pages"):
        host.alloc_paged_token_slots(rows, lens, 0, 0, 17)
    big = torch.full((1, 4096), -1, dtype=torch.int64)
    with pytest.raises(
        RuntimeError, match=re.escape("HiSparse host mem pool alloc failed for 1024 pages")
    ):
        host.alloc_paged_token_slots(big, torch.zeros(1, dtype=torch.int64), 0, 0, 4096)


class _UnwritableLengths(torch.Tensor):
    def __setitem__(self, key, value):
        raise RuntimeError("lengths table refused the write")


def test_hisparse_request_rows_a_failed_write_takes_no_slots_and_leaves_the_row():
    host, _ = make_mla("layer_first", 4)
    free = host.available_size()
    # torch writes an inference tensor outside inference mode, then raises.
    with torch.inference_mode():
        rows = torch.full((2, 16), -1, dtype=torch.int64)
        lens = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="req_to_host_pool is an inference tensor"):
        host.alloc_paged_token_slots(rows, lens, 0, 0, 8)
    assert host.available_size() == free
    assert rows[0].tolist() == [-1] * 16 and lens.tolist() == [0, 0]
    # A call that writes nothing only reads them, as SGLang's does.
    assert host.alloc_paged_token_slots(rows, lens, 0, 0, 0).numel() == 0
    with torch.inference_mode():
        grown = host.alloc_paged_token_slots(rows, lens, 0, 0, 8).clone()
    assert host.alloc_paged_token_slots(rows, lens, 0, 2, 4).tolist() == grown[2:6].tolist()
    free = host.available_size()
    # A table that fails after the row was written: the row is put back and the slots go back
    # where they were, so the pool hands out what it would have without the call.
    next_eight = torch.cat([host.free_slots, *host.release_slots])[:8].tolist()
    rows = torch.full((2, 16), -1, dtype=torch.int64)
    lens = torch.zeros(2, dtype=torch.int64).as_subclass(_UnwritableLengths)
    with pytest.raises(RuntimeError, match="lengths table refused the write"):
        host.alloc_paged_token_slots(rows, lens, 0, 0, 8)
    assert host.available_size() == free
    assert rows[0].tolist() == [-1] * 16
    got = host.alloc_paged_token_slots(rows, torch.zeros(2, dtype=torch.int64), 0, 0, 8)
    assert got.tolist() == next_eight


def test_mla_flat_page_on_the_meta_device_is_a_value_error():
    dev = MLATokenToKVPool(64, 4, torch.float16, 8, 4, 2)
    host = MLATokenToKVPoolHost(dev, 2.0, 0, 4, "layer_first")
    page = torch.empty(host.get_dummy_flat_data_page().numel(), device="meta")
    with pytest.raises(ValueError, match="meta device"):
        host.set_from_flat_data_page(0, page)


def test_hisparse_unaligned_row_end_is_refused_before_taking_slots():
    dev = MLATokenToKVPool(64, 4, torch.float16, 8, 4, 2)
    host = MLATokenToKVPoolHost(dev, 2.0, 0, 4, "layer_first")
    row = torch.full((1, 16), -1, dtype=torch.int64)
    allocated = torch.tensor([2])
    before = host.available_size()
    with pytest.raises(ValueError, match="not a multiple of the page size 4") as refused:
        host.alloc_paged_token_slots(row, allocated, 0, 0, 6)
    assert isinstance(refused.value, RuntimeError)  # what SGLang's torch write raises there
    assert host.available_size() == before
    assert int(allocated[0]) == 2


# --- from test_contract_mla.py:
# MLATokenToKVPoolHost audited against host-pool-contract.md (§1.3, §2.0, §2.3, §3.4, §4.1,
# §4.3, §4.4): pools built from a minimal duck-typed device pool carrying only SGLang's attributes,
# SGLang's extra attributes, DCP slot arithmetic, the HiSparse mixin, and hostile inputs.


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def duck_mla(size=32, page_size=4, layers=3, rank=12, rope=4, dtype=torch.bfloat16, **extra):
    """Only what SGLang's MLATokenToKVPool exposes (§2.0): no layer-sharding hooks, `device` a
    string, `kv_buffer` a list of `(size + page_size, 1, kv_cache_dim)` tensors."""
    store = torch.uint8 if dtype in FP8 else dtype
    C = extra.pop("kv_cache_dim", rank + rope)
    kv = [torch.zeros(size + page_size, 1, C, dtype=store) for _ in range(layers)]
    return types.SimpleNamespace(
        size=size,
        page_size=page_size,
        dtype=dtype,
        store_dtype=store,
        device="cpu",
        layer_num=layers,
        start_layer=0,
        end_layer=layers - 1,
        kv_lora_rank=rank,
        qk_rope_head_dim=rope,
        kv_cache_dim=C,
        kv_buffer=kv,
        data_ptrs=torch.tensor([t.data_ptr() for t in kv], dtype=torch.uint64),
        **extra,
    )


def host_and_device(layout, P=4, **kw):
    dp = duck_mla(page_size=P, **kw)
    return MLATokenToKVPoolHost(dp, 2.0, 0, P, layout), dp


# ---- duck-typed device pools ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("backend,layout", MLA_PAIRS)
def test_round_trip_with_a_duck_typed_device_pool(backend, layout, dtype):
    P = 4
    host, dp = host_and_device(layout, P, dtype=dtype)
    assert host.dtype == dp.store_dtype
    rng = np.random.default_rng(5)
    dev_pages = distinct_pages(rng, 1, dp.size // P + 1, 3)
    round_trip(
        host,
        dp,
        backend,
        page_tokens(distinct_pages(rng, 0, host.page_num, 3), P),
        page_tokens(dev_pages, P),
        page_tokens(np.roll(dev_pages, 1), P),
    )


def test_duck_typed_pool_sizing_and_geometry():
    dp = duck_mla(size=200, page_size=16, layers=5, rank=12, rope=4)
    host = MLATokenToKVPoolHost(dp, 1.5, 0, 16, "layer_first")
    # int(200 * 1.5) = 300 tokens -> 300 // 16 + 1 = 19 pages (the +1 is unconditional)
    assert (host.size, host.page_num) == (19 * 16, 19)
    assert host.size_per_token == 16 * 2 * 5 and isinstance(host.size_per_token, int)
    assert host.kv_buffer.shape == (5, 19 * 16, 1, 16)
    assert (host.start_layer, host.end_layer) == (0, 4)


# ---- attributes SGLang's MLA host pool carries ----------------------------------------------


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_write_back_staging_is_off_and_empty(layout):
    # §3.1: the staging buffer exists only with the staged write-back JIT (never enabled here).
    host, _ = host_and_device(layout)
    assert host.can_use_write_back_jit is False and host.can_use_jit is False
    assert host.staging_buffer is None
    assert host.staging_page_capacity == 0 and host.staging_token_capacity == 0


def test_dsa_fp8_flag_mirrors_the_device_pool():
    host, _ = host_and_device("layer_first")
    assert host.dsa_kv_cache_store_fp8 is False
    packed, _ = host_and_device("layer_first", dsa_kv_cache_store_fp8=True)
    assert packed.dsa_kv_cache_store_fp8 is True


def test_hisparse_mixin_comes_first_in_the_bases():
    assert MLATokenToKVPoolHost.__mro__[1] is HiSparseHostPoolMixin


# ---- DCP ------------------------------------------------------------------------------------


def test_dummy_pool_hands_out_slots_in_the_widened_space():
    # §1.3 step 1 / §4.1: page_size and size are per-rank physical, slots are logical.
    dp = duck_mla(size=64, page_size=16)
    host = MLATokenToKVPoolHost(
        dp, 2.0, 0, 16, "layer_first", dcp_size=2, dcp_rank=1, is_dummy=True
    )
    assert (host.dcp_size, host.dcp_rank) == (2, 1)
    assert host.page_size == 8
    assert (host.size, host.page_num) == (136, 17)  # 128 // 8 + 1 pages of 8
    assert (host.logical_size, host.logical_page_size) == (272, 16)
    assert host.available_size() == 272
    with pytest.raises(
        AssertionError, match=re.escape("The requested size should be a multiple of the page size.")
    ):
        host.alloc(8)
    assert host.alloc(32).tolist() == list(range(32))
    assert host.available_size() == 240


def test_dummy_pool_has_sglangs_default_allocator():
    from hostkv_rs.pools.memory import HostTensorAllocator

    host = MLATokenToKVPoolHost(duck_mla(), 2.0, 0, 4, "layer_first", is_dummy=True)
    assert isinstance(host.allocator, HostTensorAllocator) and host.fd is None


def test_dummy_pool_refuses_a_rank_outside_the_group():
    dp = duck_mla(size=64, page_size=16)
    with pytest.raises(ValueError, match=re.escape("dcp_rank must lie in [0, 2), got 2")):
        MLATokenToKVPoolHost(dp, 2.0, 0, 16, "layer_first", dcp_size=2, dcp_rank=2, is_dummy=True)


def test_dcp_pool_sizes_per_rank_and_hands_out_logical_slots():
    # §1.3 step 1: the widened page arrives; size/page_size/page_num are per-rank physical.
    dp = duck_mla(size=64, page_size=4)
    host = MLATokenToKVPoolHost(dp, 2.0, 0, 8, "page_first_direct", dcp_size=2, dcp_rank=1)
    assert (host.dcp_size, host.dcp_rank, host.page_size) == (2, 1, 4)
    assert (host.size, host.page_num) == (132, 33)
    assert (host.logical_size, host.logical_page_size) == (264, 8)
    assert host.kv_buffer.shape == (33, 3, 4, 1, 16)
    assert host.alloc(16).tolist() == list(range(16))


@pytest.mark.parametrize("backend,layout", MLA_PAIRS)
def test_transfers_translate_logical_slots_to_this_ranks_physical_slots(backend, layout):
    # §3.4 / §4.1: load and backup pass both index tensors through maybe_dcp_kernel_indices
    # (`idx[rank::dcp] // dcp`) before any byte moves.
    P = 4
    dp = duck_mla(page_size=P)
    host = MLATokenToKVPoolHost(dp, 2.0, 0, 2 * P, layout, dcp_size=2, dcp_rank=1)
    assert host.page_size == P
    rng = np.random.default_rng(3)
    fill_random(host_planes(host), rng)
    fill_random([t.view(torch.uint8) for t in dp.kv_buffer], rng)
    host_before = snapshot_host(host)[0]
    # logical widened pages (2P slots) 3 and 1 on the host, 2 and 4 on the device
    logical_host = page_tokens([3, 1], 2 * P)
    logical_dev = page_tokens([2, 4], 2 * P)
    host.backup_from_device_all_layer(
        dp, torch.as_tensor(logical_host), torch.as_tensor(logical_dev), backend
    )
    phys_host, phys_dev = logical_host[1::2] // 2, logical_dev[1::2] // 2
    assert phys_host.tolist() == list(range(12, 16)) + list(range(4, 8))
    T, L, S = host.token_stride_size, host.layer_num, host.size
    want = host_before.copy()
    for layer in range(L):
        rows = dp.kv_buffer[layer].view(torch.uint8).reshape(dp.kv_buffer[layer].shape[0], -1)
        for h, d in zip(phys_host, phys_dev):
            if layout == "layer_first":
                off = layer * S * T + h * T
            elif layout == "page_first":
                off = h * L * T + layer * T
            else:
                off = (h // P) * P * L * T + layer * P * T + (h % P) * T
            want[off : off + T] = rows[d].numpy()
    assert_bytes_equal(snapshot_host(host)[0], want, "host after a DCP backup")

    for t in dp.kv_buffer:
        t.zero_()
    host.load_to_device_per_layer(
        dp, torch.as_tensor(logical_host), torch.as_tensor(logical_dev), 2, backend
    )
    for layer, t in enumerate(dp.kv_buffer):
        rows = t.view(torch.uint8).reshape(t.shape[0], -1)
        for d in range(rows.shape[0]):
            if layer == 2 and d in phys_dev:
                (k,) = np.flatnonzero(phys_dev == d)
                h = phys_host[k]
                if layout == "layer_first":
                    off = layer * S * T + h * T
                elif layout == "page_first":
                    off = h * L * T + layer * T
                else:
                    off = (h // P) * P * L * T + layer * P * T + (h % P) * T
                assert_bytes_equal(rows[d].numpy(), want[off : off + T], f"device row {d}")
            else:
                assert not rows[d].any()


def test_dcp_translation_needs_whole_widened_pages_and_changes_nothing(monkeypatch):
    from hostkv_rs.sglang import sources as _sources

    # SGLang 0.5.18-0.5.19 assert it; 0.5.20+ take the rank's share of any run (below).
    monkeypatch.setattr(_sources, "sglang_release", lambda: (0, 5, 19))
    dp = duck_mla(page_size=4)
    host = MLATokenToKVPoolHost(dp, 2.0, 0, 8, "layer_first", dcp_size=2, dcp_rank=0)
    before = snapshot_host(host)
    with pytest.raises(
        AssertionError,
        match=re.escape(
            "HiCache DCP translation expects runs of whole widened pages; got 7 logical slots "
            "with dcp_size=2."
        ),
    ):
        host.backup_from_device_all_layer(dp, torch.arange(7), torch.arange(7), "kernel")
    assert_bytes_equal(snapshot_host(host)[0], before[0], "host after a refused DCP backup")


@pytest.mark.parametrize(
    "layout, backend", [("page_first", "direct"), ("page_first_direct", "kernel")]
)
@pytest.mark.parametrize("release, first", [((0, 5, 19), "run"), ((0, 5, 20), "pair")])
def test_dcp_run_or_pair_refused_first_as_the_release_checks(
    monkeypatch, layout, backend, release, first
):
    # 0.5.18-0.5.19 translate DCP slots before they look at the io backend; 0.5.20+ refuse the
    # pair (their translation has no assert).
    from hostkv_rs.sglang import sources as _sources

    monkeypatch.setattr(_sources, "sglang_release", lambda: release)
    dp = duck_mla(page_size=4)
    host = MLATokenToKVPoolHost(dp, 2.0, 0, 8, layout, dcp_size=2, dcp_rank=0)
    run = torch.arange(3)
    # The pool it was built from, another one (read as <= 0.5.21 reads it), or none.
    calls = [
        call
        for named in (dp, duck_mla(page_size=4), None)
        for call in (
            lambda named=named: host.backup_from_device_all_layer(named, run, run, backend),
            lambda named=named: host.load_to_device_per_layer(named, run, run, 0, backend),
        )
    ]
    for call in calls:
        with pytest.raises((AssertionError, ValueError)) as e:
            call()
        if first == "run":
            assert type(e.value) is AssertionError
            assert str(e.value) == (
                "HiCache DCP translation expects runs of whole widened pages; got 3 logical "
                "slots with dcp_size=2."
            )
        else:
            assert str(e.value) == f"Unsupported layout: {layout}"


def test_dcp_run_refused_before_a_layer_sharded_backups_pair(monkeypatch):
    # 0.5.18-0.5.19 translate DCP slots before the layer-sharded backup looks at its pair.
    from hostkv_rs.sglang import sources as _sources

    monkeypatch.setattr(_sources, "sglang_release", lambda: (0, 5, 19))
    dp = duck_mla(page_size=4, layers=4)
    dp.layer_shard_enabled, dp.layer_shard_size = True, 2
    dp._owned_local_layer_range = lambda: (0, 2)
    host = MLATokenToKVPoolHost(dp, 2.0, 0, 8, "page_first_direct", dcp_size=2, dcp_rank=0)
    run = torch.arange(3)
    with pytest.raises(AssertionError, match="got 3 logical slots with dcp_size=2"):
        host.backup_from_device_all_layer(dp, run, run, "direct")
    whole = torch.arange(4)
    with pytest.raises(ValueError, match="only supports layer_first layout"):
        host.backup_from_device_all_layer(dp, whole, whole, "direct")


def test_dcp_run_counts_a_tensors_elements_as_the_release_does(monkeypatch):
    # 0.5.18-0.5.19 assert on numel(): a (3, 2) index tensor (or array) holds 6 slots (whole
    # widened pages), so the refused pair is what fails; a 0-d one holds 1.
    from hostkv_rs.sglang import sources as _sources

    monkeypatch.setattr(_sources, "sglang_release", lambda: (0, 5, 19))
    dp = duck_mla(page_size=4)
    host = MLATokenToKVPoolHost(dp, 2.0, 0, 8, "page_first", dcp_size=2, dcp_rank=0)
    for six in (torch.arange(6).reshape(3, 2), np.arange(6).reshape(3, 2)):
        for call in (
            lambda six=six: host.backup_from_device_all_layer(dp, six, six, "direct"),
            lambda six=six: host.load_to_device_per_layer(dp, six, six, 0, "direct"),
        ):
            with pytest.raises(ValueError, match="^Unsupported layout: page_first$"):
                call()
    one = torch.tensor(0)
    with pytest.raises(AssertionError, match="got 1 logical slots with dcp_size=2"):
        host.backup_from_device_all_layer(dp, one, one, "direct")


@pytest.mark.parametrize("rank", [0, 1])
def test_dcp_transfers_of_a_short_run_move_the_ranks_share(rank):
    # SGLang 0.5.20+ (and no SGLang): `idx[rank::2] // 2` of 7 logical slots, no assert.
    dp = duck_mla(page_size=4)
    for layer in dp.kv_buffer:
        layer.copy_(torch.randn(layer.shape))
    host = MLATokenToKVPoolHost(dp, 2.0, 0, 8, "layer_first", dcp_size=2, dcp_rank=rank)
    logical = torch.arange(16, 23)
    share = (logical[rank::2] // 2).tolist()
    host.backup_from_device_all_layer(dp, logical, logical, "kernel")
    for layer, device_layer in enumerate(dp.kv_buffer):
        got = host.kv_buffer[layer, share].reshape(len(share), -1)
        assert torch.equal(got, device_layer[share].reshape(len(share), -1)), layer
    for layer in dp.kv_buffer:
        layer.zero_()
    host.load_to_device_per_layer(dp, logical, logical, 1, "kernel")
    rows = dp.kv_buffer[1].reshape(dp.kv_buffer[1].shape[0], -1)
    assert torch.equal(rows[share], host.kv_buffer[1, share].reshape(len(share), -1))
    assert not rows[[r for r in range(rows.shape[0]) if r not in share]].any()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_l3_pages_with_dcp_address_the_rank_local_page(layout):
    # SGLang 0.5.23: a logical (widened) page start names this rank's physical page
    # index // dcp_size; anything else is refused before a byte moves.
    for rank in (0, 1):
        host = MLATokenToKVPoolHost(
            duck_mla(page_size=4), 2.0, 0, 8, layout, dcp_size=2, dcp_rank=rank
        )
        P, LP = host.page_size, host.logical_page_size
        assert (P, LP) == (4, 8)
        page = torch.arange(host.get_dummy_flat_data_page().numel(), dtype=torch.float32)
        host.set_from_flat_data_page(2 * LP, page.to(host.dtype))
        # Logical page 2 -> physical page 2 of this rank (slots 8..11).
        assert torch.equal(host.get_data_page(2 * LP), host.get_data_page(2 * LP).clone())
        assert torch.equal(host.get_data_page(2 * LP).float(), page)
        ptrs, sizes = host.get_page_buffer_meta(torch.arange(2 * LP, 3 * LP))
        base, T, L = host.kv_buffer.data_ptr(), host.token_stride_size, host.layer_num
        if layout == "layer_first":
            assert ptrs == [base + 2 * P * T + layer * host.size * T for layer in range(L)]
            assert sizes == [P * T] * L
        else:
            assert ptrs == [base + 2 * P * L * T] and sizes == [L * P * T]
        before = snapshot_host(host)
        with pytest.raises(ValueError, match="DCP L3 page start must be a nonnegative"):
            host.set_from_flat_data_page(P, page.to(host.dtype))
        with pytest.raises(IndexError, match="DCP L3 page is outside the host pool"):
            host.get_data_page(host.logical_size)
        assert_bytes_equal(snapshot_host(host)[0], before[0], "host after a refused page write")


# ---- HiSparse request rows -------------------------------------------------------------------


def test_hisparse_failure_logs_sglangs_error_and_takes_nothing(caplog):
    host, _ = host_and_device("layer_first")
    rows = torch.full((1, 4096), -1, dtype=torch.int64)
    lens = torch.zeros(1, dtype=torch.int64)
    free = host.available_size()
    with (
        caplog.at_level(logging.ERROR),
        pytest.raises(
            RuntimeError, match=re.escape("HiSparse host mem pool alloc failed for 1024 pages")
        ),
    ):
        host.alloc_paged_token_slots(rows, lens, 0, 0, 4096)
    assert (
        "HiSparse: host mem pool alloc failed for 1024 host pages "
        "(req_pool_idx=0, start_pos=0, num_tokens=4096)"
    ) in caplog.text
    assert host.available_size() == free and int(lens[0]) == 0 and bool((rows == -1).all())


@pytest.mark.parametrize(
    "args, exc",
    [
        ((0, -1, 4), ValueError),  # negative start
        ((2, 0, 4), IndexError),  # no such request row
        ((0, 0, 40), ValueError),  # more slots than the row holds
        ((0, 0.5, 4), TypeError),
    ],
)
def test_hisparse_refusals_take_no_slots(args, exc):
    host, _ = host_and_device("layer_first")
    rows = torch.full((2, 32), -1, dtype=torch.int64)
    lens = torch.zeros(2, dtype=torch.int64)
    free = host.available_size()
    with pytest.raises(exc):
        host.alloc_paged_token_slots(rows, lens, *args)
    assert host.available_size() == free and not lens.any() and bool((rows == -1).all())


def test_hisparse_a_pool_too_short_fails_before_a_row_too_narrow_as_in_sglang(caplog):
    """SGLang takes the pages before it writes the row, so when both fall short the pool's
    failure is what it raises."""
    host, _ = host_and_device("layer_first")
    host.alloc(host.available_size() - 4)  # one page left
    rows = torch.full((1, 4), -1, dtype=torch.int64)
    lens = torch.zeros(1, dtype=torch.int64)
    with (
        caplog.at_level(logging.ERROR),
        pytest.raises(RuntimeError) as e,
    ):
        host.alloc_paged_token_slots(rows, lens, 0, 0, 8)  # two pages, a row of one
    assert str(e.value) == "HiSparse host mem pool alloc failed for 2 pages"
    assert host.available_size() == 4 and int(lens[0]) == 0
    # With the pages there, the narrow row is what is refused.
    host.clear()
    with pytest.raises(ValueError, match="request row holds 4 host slots but 8 are needed"):
        host.alloc_paged_token_slots(rows, lens, 0, 0, 8)


def test_hisparse_under_dcp_asserts_the_page_multiple_before_the_pool_is_found_short():
    # SGLang's alloc asserts whole widened pages first, full pool or not.
    host = MLATokenToKVPoolHost(duck_mla(size=64, page_size=4), 2.0, 0, 8, "layer_first",
                                dcp_size=2, dcp_rank=0)  # fmt: skip
    rows = torch.full((1, 64), -1, dtype=torch.int64)
    lens = torch.zeros(1, dtype=torch.int64)
    for full in (False, True):
        host.clear()
        if full:
            host.alloc(host.available_size())
        with pytest.raises(AssertionError, match="multiple of the page size"):
            host.alloc_paged_token_slots(rows, lens, 0, 0, 4)  # one rank-local page of 4


def test_alloc_page_refuses_negative_counts():
    host, _ = host_and_device("layer_first")
    with pytest.raises(ValueError, match="num_pages must not be negative"):
        host.alloc_page(-1)
    assert host.alloc_page(2).tolist() == list(range(8))


# ---- hostile inputs --------------------------------------------------------------------------

HOSTILE = {
    "float": lambda h, d: (h.float(), d),
    "bool": lambda h, d: (torch.ones_like(h, dtype=torch.bool), d),
    "meta": lambda h, d: (h.to("meta"), d),
    "negative": lambda h, d: (h - 100, d),
    "huge": lambda h, d: (h + 2**40, d),
    "device out of range": lambda h, d: (h, d + 10_000),
    "length mismatch": lambda h, d: (h, torch.cat([d, d])),
    "none": lambda h, d: (None, d),
}


@pytest.mark.parametrize("case", HOSTILE)
@pytest.mark.parametrize("backend,layout", MLA_PAIRS)
def test_hostile_indices_raise_and_change_nothing(backend, layout, case):
    host, dp = host_and_device(layout)
    rng = np.random.default_rng(9)
    fill_random(host_planes(host), rng)
    fill_random([t.view(torch.uint8) for t in dp.kv_buffer], rng)
    host_before, dev_before = snapshot_host(host), snapshot_device(dp)
    h, d = HOSTILE[case](torch.arange(4, 8), torch.arange(8, 12))
    with pytest.raises((TypeError, ValueError, NotImplementedError, RuntimeError)):
        host.backup_from_device_all_layer(dp, h, d, backend)
    with pytest.raises((TypeError, ValueError, NotImplementedError, RuntimeError)):
        host.load_to_device_per_layer(dp, h, d, 1, backend)
    assert_bytes_equal(snapshot_host(host)[0], host_before[0], "host")
    for got, want in zip(snapshot_device(dp)[0], dev_before[0]):
        assert_bytes_equal(got, want, "device")


# ---- MTP draft packing -----------------------------------------------------------------------


def test_mtp_draft_layers_are_packed_after_the_target_layers(caplog):
    # §1.4 log, §2.3 packed tables, §3.1 draft loads (is_draft, device layer 0), §3.4 backup.
    P = 4
    target = duck_mla(page_size=P, layers=3)
    drafts = [duck_mla(page_size=P, layers=1) for _ in range(2)]
    with caplog.at_level(logging.INFO):
        host = MLATokenToKVPoolHost(target, 2.0, 0, P, "page_first", mtp_draft_device_pools=drafts)
    assert (host.target_layer_num, host.layer_num) == (3, 5)
    assert host.size_per_token == 16 * 2 * 5
    assert "packed MTP KV layers: target_layers=3, draft_layers=2, total_layers=5." in caplog.text
    packed = target.kv_buffer + [d.kv_buffer[0] for d in drafts]
    assert [t.data_ptr() for t in host.packed_device_kv_buffers] == [t.data_ptr() for t in packed]
    assert host.packed_device_data_ptrs.dtype == torch.uint64
    assert host.packed_device_data_ptrs.tolist() == [t.data_ptr() for t in packed]

    rng = np.random.default_rng(4)
    fill_random([t.view(torch.uint8) for t in packed], rng)
    h, d = torch.arange(8, 12), torch.arange(4, 8)
    host.backup_from_device_all_layer(target, h, d, "kernel")
    T, L = host.token_stride_size, host.layer_num
    flat = snapshot_host(host)[0]
    for layer, t in enumerate(packed):
        rows = t.view(torch.uint8).reshape(t.shape[0], -1).numpy()
        for hh, dd in zip(h.tolist(), d.tolist()):
            off = hh * L * T + layer * T  # page_first
            assert_bytes_equal(flat[off : off + T], rows[dd], f"host layer {layer} slot {hh}")

    for t in packed:
        t.zero_()
    host.load_to_device_per_layer(drafts[1], h, d + 4, 4, "kernel", is_draft=True)
    rows = drafts[1].kv_buffer[0].view(torch.uint8).reshape(drafts[1].kv_buffer[0].shape[0], -1)
    for hh, dd in zip(h.tolist(), (d + 4).tolist()):
        off = hh * L * T + 4 * T
        assert_bytes_equal(rows[dd].numpy(), flat[off : off + T], f"draft row {dd}")
    assert not any(t.any() for t in target.kv_buffer + drafts[0].kv_buffer)

    with pytest.raises(IndexError, match="not a packed MTP draft layer"):
        host.load_to_device_per_layer(drafts[0], h, d, 1, "kernel", is_draft=True)


def test_mtp_backup_needs_one_layer_per_draft_pool():
    P = 4
    target, two_layer_draft = duck_mla(page_size=P, layers=3), duck_mla(page_size=P, layers=2)
    host = MLATokenToKVPoolHost(
        target, 2.0, 0, P, "layer_first", mtp_draft_device_pools=[two_layer_draft]
    )
    before = snapshot_host(host)[0]
    with pytest.raises(ValueError, match="5 layers but the host pool holds 4"):
        host.backup_from_device_all_layer(target, torch.arange(4), torch.arange(4), "direct")
    assert_bytes_equal(snapshot_host(host)[0], before, "host after a refused MTP backup")


@pytest.mark.parametrize("backend", [["kernel"], None, 3])
def test_odd_backend_values_get_sglangs_value_error(backend):
    host, dp = host_and_device("layer_first")
    idx = torch.arange(4)
    with pytest.raises(ValueError, match=re.escape(f"Unsupported IO backend: {backend}")):
        host.backup_from_device_all_layer(dp, idx, idx + 4, backend)
    with pytest.raises(ValueError, match=re.escape(f"Unsupported IO backend: {backend}")):
        host.load_to_device_per_layer(dp, idx, idx + 4, 0, backend)


@pytest.mark.parametrize("layout, aligned", [("layer_first", False), ("page_first", True)])
def test_stride_page_alignment_uses_the_page_stride(layout, aligned):
    # §4.3: P * L * C * e = 16 * 4 * 32 * 2 = 4096 bytes per page.
    dp = duck_mla(size=64, page_size=16, layers=4, rank=28, rope=4)
    host = MLATokenToKVPoolHost(dp, 2.0, 0, 16, layout)
    assert host.is_stride_page_aligned() is aligned
    assert host.is_stride_page_aligned(8192) is False


# ---- where SGLang's releases differ (tests/sglang/test_release_semantics.py compares them) ----

_DCP_L3_TEXT = (
    "HiCache L3 storage paths are not yet DCP-aware (per-rank shards need dcp_rank-scoped keys); "
    "--hicache-storage-backend with --dcp-size > 1 should have been rejected at server start."
)


def geometry_of(dp, *drop):
    """`dp` without its layers and pointer tables: what SGLang <= 0.5.21 reads of it."""
    gone = {"kv_buffer", "data_ptrs", *drop}
    return types.SimpleNamespace(**{k: v for k, v in vars(dp).items() if k not in gone})


def _same_bytes(a, b) -> bool:
    # Random bytes hold NaNs, which torch.equal never finds equal.
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture
def release(monkeypatch):
    """release((0, 5, 21)): the pools follow that SGLang release, as if it were installed."""
    from hostkv_rs.sglang import sources as _sources

    def follow(version):
        monkeypatch.setattr(_sources, "sglang_release", lambda: version)

    return follow


def test_without_sglang_the_newest_releases_semantics_hold():
    from hostkv_rs.sglang import sources as _sources

    assert _sources.sglang_release() is None
    assert not _sources.binds_on_transfer() and not _sources.refuses_dcp_l3_pages()
    assert not _sources.ignores_transfer_device_pool()
    # A device pool without layers is refused at construction, as 0.5.22 does.
    with pytest.raises(TypeError, match="kv_buffer"):
        MLATokenToKVPoolHost(geometry_of(duck_mla()), 2.0, 0, 4, "layer_first")


def test_dummy_pool_reads_only_the_geometry():
    # Every release with is_dummy reads no device layers, no pointer table and no device.
    dp = geometry_of(duck_mla(size=64, page_size=16), "device")
    host = MLATokenToKVPoolHost(dp, 2.0, 0, 16, "layer_first", is_dummy=True)
    assert (host.size, host.layer_num, host.kv_buffer) == (144, 3, None)
    idx = torch.arange(16)
    # SGLang 0.5.20-0.5.22: a layer this rank does not hold returns before the dummy assertion.
    assert host.load_to_device_per_layer(dp, idx, idx, 3, "kernel") is None
    with pytest.raises(AssertionError, match=re.escape("load on a dummy (non-src MLA) host pool")):
        host.load_to_device_per_layer(dp, idx, idx, 2, "kernel")
    with pytest.raises(
        AssertionError, match=re.escape("backup on a dummy (non-src MLA) host pool")
    ):
        host.backup_from_device_all_layer(dp, idx, idx, "kernel")


def test_dummy_pool_sizes_from_the_token_count_when_the_capacity_is_zero():
    # SGLang's dummy init reads `host_capacity_tokens or size`.
    dp = duck_mla(size=64, page_size=16, host_capacity_tokens=0)
    host = MLATokenToKVPoolHost(dp, 2.0, 0, 16, "layer_first", is_dummy=True)
    assert (host.device_capacity_tokens, host.size) == (64, 144)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_dcp_l3_pages_before_0_5_23_raise_sglangs_assertion(layout, release):
    release((0, 5, 22))
    host = MLATokenToKVPoolHost(duck_mla(page_size=4), 2.0, 0, 8, layout, dcp_size=2, dcp_rank=1)
    page = torch.zeros(host.get_dummy_flat_data_page().numel(), dtype=host.dtype)
    before = snapshot_host(host)
    with pytest.raises(AssertionError, match=re.escape(_DCP_L3_TEXT)):
        host.get_data_page(host.logical_page_size)
    with pytest.raises(AssertionError, match=re.escape(_DCP_L3_TEXT)):
        host.set_from_flat_data_page(host.logical_page_size, page)
    assert_bytes_equal(snapshot_host(host)[0], before[0], "host after a refused page write")
    # Without DCP nothing changes.
    plain = MLATokenToKVPoolHost(duck_mla(page_size=4), 2.0, 0, 4, layout)
    plain.set_from_flat_data_page(4, page + 1)
    assert bool((plain.get_data_page(4) == 1).all())


def test_geometry_only_pool_moves_the_layers_each_transfer_names(release):
    # SGLang <= 0.5.21 builds from the geometry alone; each transfer reads the pool it names.
    release((0, 5, 21))
    rng = np.random.default_rng(5)
    full = duck_mla(page_size=4)
    dp = geometry_of(full)
    host = MLATokenToKVPoolHost(dp, 2.0, 0, 4, "layer_first")
    assert host._device_side is None and host.device_kv_buffers == ()
    assert host.data_ptrs.device == torch.device("cpu")
    fill_random([t.view(torch.uint8) for t in full.kv_buffer], rng)
    h, d = host.alloc(8), torch.arange(4, 12)
    host.backup_from_device_all_layer(full, h, d, "kernel")
    for layer in range(3):
        assert _same_bytes(host.kv_buffer[layer][h], full.kv_buffer[layer][d])
    other = duck_mla(page_size=4)
    host.load_to_device_per_layer(other, h, d, 1, "kernel")
    assert _same_bytes(other.kv_buffer[1][d], full.kv_buffer[1][d])
    assert not other.kv_buffer[0].any() and not other.kv_buffer[2].any()
    assert host.load_to_device_per_layer(other, h, d, 3, "kernel") is None  # not held
    # Naming the geometry-only pool (or none: the construction pool) is SGLang's AttributeError.
    for named in (dp, None):
        with pytest.raises(AttributeError, match="kv_buffer"):
            host.load_to_device_per_layer(named, h, d, 0, "kernel")
        with pytest.raises(AttributeError, match="kv_buffer"):
            host.backup_from_device_all_layer(named, h, d, "kernel")
    with pytest.raises(ValueError, match=re.escape("Unsupported layout: layer_first")):
        host.load_to_device_per_layer(dp, h, d, 0, "kernel_ascend")
    # The geometry must still describe the named pool's rows.
    wide = duck_mla(page_size=4, rank=20)
    with pytest.raises(ValueError, match="kv_cache_dim=24 differs"):
        host.load_to_device_per_layer(wide, h, d, 0, "kernel")


def test_geometry_only_pool_from_0_5_22_is_refused(release):
    release((0, 5, 22))
    with pytest.raises(TypeError, match="kv_buffer"):
        MLATokenToKVPoolHost(geometry_of(duck_mla()), 2.0, 0, 4, "layer_first")


@pytest.mark.parametrize(("version", "moved"), [((0, 5, 21), "named"), ((0, 5, 22), "built")])
def test_a_transfer_naming_another_device_pool(version, moved, release):
    # SGLang <= 0.5.21 moves the named pool's layers, 0.5.22 the ones it captured.
    release(version)
    built, named = duck_mla(page_size=4), duck_mla(page_size=4)
    host = MLATokenToKVPoolHost(built, 2.0, 0, 4, "layer_first")
    fill_random(host_planes(host), np.random.default_rng(9))
    h, d = host.alloc(8), torch.arange(4, 12)
    host.load_to_device_per_layer(named, h, d, 0, "kernel")
    wrote, untouched = (named, built) if moved == "named" else (built, named)
    assert _same_bytes(wrote.kv_buffer[0][d], host.kv_buffer[0][h])
    assert not untouched.kv_buffer[0].any()


@pytest.mark.parametrize(
    "layout, backend",
    [("layer_first", "kernel"), ("page_first", "kernel"), ("layer_first", "direct")],
)
def test_strided_device_rows_round_trip_and_touch_nothing_else(layout, backend):
    # SGLang 0.5.22+'s unified MLA pool: each layer a view of one token-major buffer whose
    # entries hold every layer's latent row, then spare elements.
    def strided(seed, layers=3, C=16, pad=5):
        dp = duck_mla(size=32, page_size=4, layers=layers, rank=12, rope=4, dtype=torch.float32)
        gen = torch.Generator().manual_seed(seed)
        entries = torch.randn(dp.size + dp.page_size, layers * C + pad, generator=gen)
        dp.kv_buffer = [entries[:, l * C : (l + 1) * C].view(-1, 1, C) for l in range(layers)]
        dp.entries = entries
        return dp

    src, dst = strided(1), strided(2)
    host = MLATokenToKVPoolHost(src, 2.0, 0, 4, layout)
    assert (host.device_rows_packed, host.device_row_stride_bytes) == (False, (3 * 16 + 5) * 4)
    h, d, d2 = host.alloc(8), torch.arange(4, 12), torch.arange(16, 24)
    host.backup_from_device_all_layer(src, h, d, backend)
    want = dst.entries.clone()
    want[d2, : 3 * 16] = src.entries[d, : 3 * 16]
    for layer in range(3):
        host.load_to_device_per_layer(dst, h, d2, layer, backend)
    assert torch.equal(dst.entries, want)


@pytest.mark.parametrize("dcp_rank", [0, 1])
def test_strided_device_rows_under_dcp_move_this_ranks_share(dcp_rank):
    # DCP reads both index arrays through `idx[rank::2] // 2`; the rows it names are strided.
    dp = duck_mla(size=32, page_size=4, layers=2, rank=12, rope=4, dtype=torch.float32)
    entries = torch.randn(
        dp.size + dp.page_size, 2 * 16 + 3, generator=torch.Generator().manual_seed(4)
    )
    dp.kv_buffer = [entries[:, l * 16 : (l + 1) * 16].view(-1, 1, 16) for l in range(2)]
    host = MLATokenToKVPoolHost(dp, 2.0, 0, 8, "layer_first", dcp_size=2, dcp_rank=dcp_rank)
    h, d = torch.arange(8, 16), torch.arange(16, 24)  # one widened page each
    host.backup_from_device_all_layer(dp, h, d, "kernel")
    rows_h, rows_d = h[dcp_rank::2] // 2, d[dcp_rank::2] // 2
    for layer in range(2):
        assert torch.equal(
            host.kv_buffer[layer][rows_h, 0], entries[rows_d, layer * 16 : (layer + 1) * 16]
        )
    want = entries.clone()
    entries.zero_()
    want.zero_()
    host.load_to_device_per_layer(dp, h, d + 8, 1, "kernel")
    back = (d + 8)[dcp_rank::2] // 2
    want[back, 16:32] = host.kv_buffer[1][rows_h, 0]
    assert torch.equal(entries, want)
