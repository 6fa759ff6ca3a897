"""MHATokenToKVPoolHost against host-pool-contract.md §2.1, §3.2, §4.4, §4.5: token-granular
transfers, geometry, metadata pointers and flat pages from the contract's formulas (the page round
trips of every pool kind are in test_transfers.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost
from reference import (
    DEVICE_PAGES,
    LAYERS,
    MHA_PAIRS,
    assert_bytes_equal,
    host_planes,
    make_mha,
    page_tokens,
    round_trip,
    snapshot_host,
)


@pytest.mark.parametrize(
    "backend,layout",
    [p for p in MHA_PAIRS if p[0] == "kernel" or p[1] == "layer_first"],
)
def test_round_trip_scattered_tokens(backend, layout):
    """Token-granular transfers (kernel, direct layer_first): arbitrary slot permutations. SGLang's
    direct ops refuse partial pages, so direct runs them on a page-size-1 pool."""
    rng = np.random.default_rng(7)
    page_size, device_pages = (1, 64) if backend == "direct" else (16, DEVICE_PAGES)
    host, dp = make_mha(layout, page_size, torch.bfloat16, device_pages=device_pages)
    n = 23
    host_tokens = rng.permutation(host.size)[:n]
    dev_rows = device_pages * page_size + page_size
    round_trip(
        host,
        dp,
        backend,
        host_tokens,
        rng.permutation(np.arange(1, dev_rows))[:n],
        rng.permutation(np.arange(1, dev_rows))[:n],
    )


def test_direct_layer_first_refuses_a_partial_page():
    """transfer_kv_direct's check (contract §3.1 / transfer-semantics §3.1), before any byte moves."""
    host, dp = make_mha("layer_first", 16, torch.bfloat16)
    h = host.alloc(16)[:9]
    before = host.kv_buffer.clone(), [t.clone() for t in dp.k_buffer]
    with pytest.raises(RuntimeError, match="Source indices size must be divisible by page size"):
        host.backup_from_device_all_layer(dp, h, torch.arange(16, 25), "direct")
    with pytest.raises(RuntimeError, match="Source indices size must be divisible by page size"):
        host.load_to_device_per_layer(dp, h, torch.arange(16, 25), 0, "direct")
    assert torch.equal(host.kv_buffer, before[0])
    assert all(torch.equal(a, b) for a, b in zip(dp.k_buffer, before[1]))


def test_geometry_and_attributes():
    host, _ = make_mha("layer_first", 16, torch.bfloat16, heads=2, head_dim=8)
    e = 2
    assert host.layer_num == host.target_layer_num == LAYERS
    assert host.size_per_token == 2 * LAYERS * 2 * 8 * e
    assert host.get_ksize_per_token() == LAYERS * 2 * 8 * e
    assert host.token_stride_size == 2 * 8 * e
    assert host.layout_dim == 2 * 8 * e * LAYERS
    assert host.element_dim == 16
    assert host.can_use_write_back_jit is False
    assert host.dtype == torch.bfloat16
    assert host.kv_buffer.shape == (2, LAYERS, host.size, 2, 8)
    assert host.k_buffer.data_ptr() == host.kv_buffer.data_ptr()
    assert host.v_buffer.data_ptr() == host.kv_buffer.data_ptr() + LAYERS * host.size * 32
    assert host.get_hybrid_pool_buffer()[1].data_ptr() == host.v_buffer.data_ptr()
    assert host.start_layer == 0 and host.end_layer == LAYERS - 1
    assert host.fd is None
    assert host.dcp_size == 1 and host.dcp_rank == 0


@pytest.mark.parametrize(
    "layout,shape",
    [
        ("layer_first", lambda L, S, Pn, P, H, D: (2, L, S, H, D)),
        ("page_first", lambda L, S, Pn, P, H, D: (2, S, L, H, D)),
        ("page_first_direct", lambda L, S, Pn, P, H, D: (2, Pn, L, P, H, D)),
        ("page_head", lambda L, S, Pn, P, H, D: (2, Pn, H, P, L, D)),
    ],
)
def test_buffer_shapes_and_fp8_store_dtype(layout, shape):
    host, dp = make_mha(layout, 4, torch.float8_e4m3fn, heads=2, head_dim=8)
    assert dp.store_dtype == torch.uint8 and host.dtype == torch.uint8
    assert host.kv_buffer.is_contiguous()
    assert tuple(host.kv_buffer.shape) == shape(LAYERS, host.size, host.page_num, 4, 2, 8)


def test_data_refs_and_pointer_tables():
    host, _ = make_mha("page_first", 4, torch.bfloat16)
    T, LD = host.token_stride_size, host.layout_dim
    base = host.kv_buffer.data_ptr()
    for layer in range(LAYERS):
        ref = host.k_data_refs[layer]
        assert ref.data_ptr() == base + layer * T
        assert ref.stride(0) * 2 == LD  # row pitch = layout_dim bytes
        assert host.v_data_refs[layer].data_ptr() == base + LAYERS * host.size * T + layer * T
    assert host.k_data_ptrs.dtype == torch.uint64
    assert host.k_data_ptrs.tolist() == [r.data_ptr() for r in host.k_data_refs]
    assert host.v_data_ptrs.tolist() == [r.data_ptr() for r in host.v_data_refs]
    assert len(host.host_kv_data_refs) == 2 * LAYERS

    lf, _ = make_mha("layer_first", 4, torch.bfloat16)
    S, T = lf.size, lf.token_stride_size
    assert lf.k_data_ptrs.tolist() == [
        lf.kv_buffer.data_ptr() + layer * S * T for layer in range(LAYERS)
    ]


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_get_page_buffer_meta_order_and_sizes(layout):
    P, H, D, e = 4, 2, 8, 2
    host, _ = make_mha(layout, P, torch.bfloat16, heads=H, head_dim=D)
    L, S = LAYERS, host.size
    base = host.kv_buffer.data_ptr()
    vo = L * S * H * D * e
    pages = [3, 0, 5]
    ptrs, sizes = host.get_page_buffer_meta(torch.tensor(page_tokens(pages, P)))
    want = []
    if layout == "layer_first":
        for p in pages:
            for layer in range(L):
                k = base + p * P * H * D * e + layer * S * H * D * e
                want += [k, k + vo]
        assert sizes == [P * H * D * e] * len(want)
    else:
        for p in pages:
            k = base + p * P * L * H * D * e
            want += [k, k + vo]
        assert sizes == [L * P * H * D * e] * len(want)
    assert ptrs == want


def test_get_page_buffer_meta_bytes_are_the_pages_bytes():
    """The region a (ptr, size) entry names holds exactly the page's K (or V) bytes."""
    host, _ = make_mha("page_first_direct", 4, torch.bfloat16)
    planes = host_planes(host)
    planes[0].copy_(torch.arange(planes[0].numel()) % 251)
    planes[1].copy_(torch.arange(planes[1].numel()) % 241)
    ptrs, sizes = host.get_page_buffer_meta(torch.arange(8, 12))
    flat = host.kv_buffer.reshape(-1).view(torch.uint8)
    base = host.kv_buffer.data_ptr()
    k = flat[ptrs[0] - base : ptrs[0] - base + sizes[0]]
    v = flat[ptrs[1] - base : ptrs[1] - base + sizes[1]]
    assert torch.equal(k, host.k_buffer[2].reshape(-1).view(torch.uint8))
    assert torch.equal(v, host.v_buffer[2].reshape(-1).view(torch.uint8))


def test_split_heads_page_buffer_meta():
    P, H, D, e = 4, 4, 8, 2
    host, _ = make_mha("page_head", P, torch.bfloat16, heads=H, head_dim=D)
    L, S = LAYERS, host.size
    base = host.kv_buffer.data_ptr()
    vo = L * S * H * D * e
    ptrs, sizes = host.get_split_heads_page_buffer_meta(torch.tensor(page_tokens([2, 1], P)), 2)
    want = []
    for p in (2, 1):
        for h0 in (0, 2):
            k = base + p * P * L * H * D * e + h0 * P * L * D * e
            want += [k, k + vo]
    assert ptrs == want
    assert sizes == [L * P * H * D * e // 2] * 8


def _flat_page_reference(host, slot):
    """The flat page's elements in the layout's own order (contract §4.4)."""
    P = host.page_size
    kv = host.kv_buffer
    if host.layout == "layer_first":
        return kv[:, :, slot : slot + P].reshape(-1)
    if host.layout == "page_first":
        return kv[:, slot : slot + P].reshape(-1)
    return kv[:, slot // P].reshape(-1)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_flat_data_pages_round_trip(layout, page_size):
    rng = np.random.default_rng(3)
    host, _ = make_mha(layout, page_size, torch.bfloat16)
    for plane in host_planes(host):
        plane.copy_(torch.from_numpy(rng.integers(0, 256, plane.numel(), dtype=np.uint8)))
    before = snapshot_host(host)
    src, dst = 2 * page_size, 5 * page_size

    page = host.get_data_page(src)
    assert page.dim() == 1
    assert torch.equal(page.view(torch.uint8), _flat_page_reference(host, src).view(torch.uint8))
    dummy = host.get_dummy_flat_data_page()
    assert dummy.numel() == page.numel() and dummy.dtype == host.dtype
    assert not dummy.any()
    dummy.copy_(page)  # what an L3 backend's batch_get does
    original_dst = host.get_data_page(dst).clone()

    host.set_from_flat_data_page(dst, dummy)
    assert torch.equal(
        _flat_page_reference(host, dst).view(torch.uint8),
        _flat_page_reference(host, src).view(torch.uint8),
    )
    # Everything except the destination page is untouched.
    host.set_from_flat_data_page(dst, original_dst)
    for got, want in zip(snapshot_host(host), before, strict=True):
        assert_bytes_equal(got, want, "host after restoring the page")

    unflat = host.get_data_page(src, flat=False)
    assert unflat.data_ptr() >= host.kv_buffer.data_ptr()
    assert torch.equal(unflat.reshape(-1).view(torch.uint8), page.view(torch.uint8))


def test_flat_pages_are_layout_specific():
    """The same logical page flattens in a different element order under another layout."""
    lf, _ = make_mha("layer_first", 4, torch.bfloat16)
    pf, _ = make_mha("page_first", 4, torch.bfloat16)
    assert lf.get_dummy_flat_data_page().numel() == pf.get_dummy_flat_data_page().numel()
    values = torch.arange(lf.get_dummy_flat_data_page().numel(), dtype=torch.float32)
    page = values.to(torch.bfloat16)
    lf.set_from_flat_data_page(0, page)
    pf.set_from_flat_data_page(0, page)
    assert torch.equal(lf.get_data_page(0), pf.get_data_page(0))
    # K of layer 1, token 0 sits at a different flat position in each layout.
    assert not torch.equal(lf.k_buffer[1, 0], pf.k_buffer[0, 1])


def test_is_stride_page_aligned():
    host, _ = make_mha("page_first_direct", 64, torch.bfloat16, heads=2, head_dim=16)
    assert host.kv_buffer.data_ptr() % 4096 == 0
    # page stride = 64 * 5 * 2 * 16 * 2 = 20480 bytes = 5 * 4096
    assert host.is_stride_page_aligned() is True
    odd, _ = make_mha("page_first_direct", 1, torch.bfloat16, heads=2, head_dim=8)
    assert odd.is_stride_page_aligned() is False
    lf, _ = make_mha("layer_first", 64, torch.bfloat16, heads=2, head_dim=16)
    assert lf.is_stride_page_aligned() is False


def test_empty_transfer_is_a_no_op():
    host, dp = make_mha("layer_first", 4, torch.bfloat16)
    before = snapshot_host(host)
    empty = torch.empty(0, dtype=torch.int64)
    host.backup_from_device_all_layer(dp, empty, empty, "kernel")
    host.load_to_device_per_layer(dp, empty, empty, 0, "direct")
    for got, want in zip(snapshot_host(host), before, strict=True):
        assert_bytes_equal(got, want, "host")


def test_destroy_is_idempotent_and_stops_transfers():
    host, dp = make_mha("layer_first", 4, torch.bfloat16)
    idx = torch.arange(4)
    host.destroy()
    host.destroy()
    assert host.kv_buffer is None
    with pytest.raises(RuntimeError, match="destroyed"):
        host.backup_from_device_all_layer(dp, idx, idx + 4, "kernel")
    with pytest.raises(RuntimeError, match="destroyed"):
        host.load_to_device_per_layer(dp, idx, idx + 4, 0, "kernel")
    with pytest.raises(RuntimeError, match="no KV bytes"):
        host.get_data_page(0)
    with pytest.raises(RuntimeError, match="no KV bytes"):
        host.get_page_buffer_meta(idx)
    assert host.is_stride_page_aligned() is False
    # the allocator keeps working (SGLang's destroy only drops the bytes)
    assert host.alloc(4) is not None


def test_split_heads_factor_must_be_an_integer():
    dev = MHATokenToKVPool(64, 4, torch.float16, 4, 8, 2)
    host = MHATokenToKVPoolHost(dev, 2.0, 0, 4, "page_head")
    with pytest.raises(TypeError, match="split_factor must be an integer"):
        host.get_split_heads_page_buffer_meta(torch.arange(4), 2.5)
