"""MLATokenToKVPoolHost against host-pool-contract.md §2.3, §3.4, §4.3-§4.5 (the page round trips of
every pool kind are in test_transfers.py)."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch
from hostkv_rs import MLATokenToKVPool, MLATokenToKVPoolHost
from reference import (
    LAYERS,
    assert_bytes_equal,
    host_planes,
    make_mla,
    page_tokens,
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
    with pytest.raises(ValueError, match="7 layers"):
        host.get_contiguous_buf_infos()
    lf, _ = make_mla("layer_first", 4, torch.bfloat16)
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
    with pytest.raises(ValueError, match="slots"):
        host.alloc_paged_token_slots(rows, lens, 0, 0, 17)
    big = torch.full((1, 4096), -1, dtype=torch.int64)
    with pytest.raises(
        RuntimeError, match=re.escape("HiSparse host mem pool alloc failed for 1024 pages")
    ):
        host.alloc_paged_token_slots(big, torch.zeros(1, dtype=torch.int64), 0, 0, 4096)


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
    with pytest.raises(ValueError, match="not a multiple of the page size 4"):
        host.alloc_paged_token_slots(row, allocated, 0, 0, 6)
    assert host.available_size() == before
    assert int(allocated[0]) == 2
